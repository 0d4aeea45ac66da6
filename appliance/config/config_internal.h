/* config_internal.h - shared between config.c (loading) and config_print.c.
 * The name tables are NULL-terminated and indexed by the matching enum, so a
 * name is resolved to its enum by position and printed back the same way. */
#ifndef LOOM_CONFIG_INTERNAL_H
#define LOOM_CONFIG_INTERNAL_H

#include "config/config.h"

extern const char *const loom_cfg_dtype_names_[];     /* loom_cfg_dtype */
extern const char *const loom_source_names_[];        /* loom_source_kind */
extern const char *const loom_map_names_[];           /* loom_map_kind */
extern const char *const loom_norm_mode_names_[];     /* loom_norm_mode */
extern const char *const loom_csv_dtype_names_[];     /* loom_cfg_dtype, then "string" (LOOM_CSV_STRING) */
extern const char *const loom_transform_names_[];     /* loom_transform_kind */
extern const char *const loom_layer_names_[];         /* loom_layer_kind */
extern const char *const loom_combiner_names_[];      /* loom_combiner */
extern const char *const loom_activation_names_[];    /* loom_activation */
extern const char *const loom_init_names_[];          /* loom_init */
extern const char *const loom_padding_names_[];       /* loom_padding */
extern const char *const loom_loss_names_[];          /* loom_loss_kind */
extern const char *const loom_metric_names_[];        /* loom_metric_kind */
extern const char *const loom_opt_names_[];           /* loom_opt_kind */
extern const char *const loom_sched_names_[];         /* loom_sched_kind */
extern const char *const loom_strategy_names_[];      /* loom_strategy_kind */
extern const char *const loom_progress_names_[];      /* loom_progress */
extern const char *const loom_tfr_dtype_names_[];     /* loom_tfr_dtype */
extern const char *const loom_tfr_comp_names_[];      /* loom_tfr_compression */
extern const char *const loom_tfr_corrupt_names_[];   /* loom_tfr_on_corrupt */
extern const char *const loom_syn_dist_names_[];      /* loom_syn_dist */
extern const char *const loom_nonfinite_names_[];     /* loom_on_nonfinite */
extern const char *const loom_shard_policy_names_[];  /* loom_shard_policy */

/* names[i], or "?" when i is out of range. */
const char *loom_cfg_name_(const char *const *names, int i);

#endif
