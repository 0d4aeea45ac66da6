/* config_internal.h - shared by the files of config/: the name tables
 * (config.c, read back by config_print.c), the load context and the option
 * tables' engine (config_table.c), and each section's entry points, called by
 * loom_config_load (config.c) in the order the sections are validated.
 * The name tables are NULL-terminated and indexed by the matching enum, so a
 * name is resolved to its enum by position and printed back the same way. */
#ifndef LOOM_CONFIG_INTERNAL_H
#define LOOM_CONFIG_INTERNAL_H

#include "config/config.h"

#include <libconfig.h>
#include <stddef.h>

extern const char *const loom_cfg_dtype_names_[];     /* loom_cfg_dtype */
extern const char *const loom_source_names_[];        /* loom_source_kind */
extern const char *const loom_map_names_[];           /* loom_map_kind */
extern const char *const loom_norm_mode_names_[];     /* loom_norm_mode */
extern const char *const loom_tok_mode_names_[];      /* loom_tok_mode */
extern const char *const loom_tok_std_names_[];       /* loom_tok_std */
extern const char *const loom_tok_invalid_names_[];   /* loom_tok_invalid */
extern const char *const loom_csv_dtype_names_[];     /* loom_cfg_dtype, then "string" (LOOM_CSV_STRING) */
extern const char *const loom_transform_names_[];     /* loom_transform_kind */
extern const char *const loom_layer_names_[];         /* loom_layer_kind */
extern const char *const loom_combiner_names_[];      /* loom_combiner */
extern const char *const loom_pos_mode_names_[];      /* loom_pos_mode */
extern const char *const loom_activation_names_[];    /* loom_activation */
extern const char *const loom_init_names_[];          /* loom_init */
extern const char *const loom_padding_names_[];       /* loom_padding */
extern const char *const loom_conv_algorithm_names_[]; /* loom_conv_algorithm */
extern const char *const loom_loss_names_[];          /* loom_loss_kind */
extern const char *const loom_metric_names_[];        /* loom_metric_kind */
extern const char *const loom_merge_mode_names_[];    /* bidirectional merge_mode */
extern const char *const loom_cell_names_[];          /* bidirectional layer */
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
extern const char *const loom_communication_names_[]; /* loom_communication */
extern const char *const loom_grad_compression_names_[];   /* loom_grad_compression */
extern const char *const loom_partitioner_names_[];   /* loom_partitioner_kind */

/* names[i], or "?" when i is out of range. */
const char *loom_cfg_name_(const char *const *names, int i);

/* ---- the load context (config_table.c) ----------------------------------- */

typedef struct cfg_ctx {
    const char   *path;                /* the config file as given */
    char          pdir[LOOM_PATH_MAX]; /* its directory as given: "" or "configs/" */
    char          dir[LOOM_PATH_MAX];  /* its directory, absolute when it can be resolved */
    loom_errlist *errs;
    const char   *skip_key;            /* cfg_parse_opts_ neither reads nor requires this key
                                          (an interleave's source files) */
    int           depth;               /* datasets nested by zip */
    const config_setting_t *huge[16];  /* integers written beyond 64 bits (see cfg_fix_wide_ints_) */
    char          huge_text[16][32];   /* ... as written */
    int           n_huge;
} cfg_ctx;

typedef struct cfg_int_lit {
    int64_t v;         /* the value written (clamped when huge) */
    bool    suffix;    /* ends in L: libconfig read it as an int64 */
    bool    huge;      /* beyond the 64-bit range */
    char    text[32];  /* as written, cut */
} cfg_int_lit;

typedef struct cfg_int_lits {
    cfg_int_lit *v;
    int          n, cap;
    bool         bad; /* out of memory, or an include that could not be read */
} cfg_int_lits;

/* ---- option tables ------------------------------------------------------- */

enum {
    OT_INT,    /* int or int64_t/uint64_t field (by size); libconfig int or int64 */
    OT_F64,    /* double; libconfig int or float */
    OT_BOOL,   /* bool */
    OT_ENUM,   /* int-sized enum; a string among names */
    OT_STR,    /* char[]; non-empty; among names when names is set */
    OT_PAIR,   /* int[2]; an int (both) or [h, w] */
    OT_CUSTOM, /* parsed by parse() */
    OT_SUB,    /* a sub-group or list, parsed by the caller */
};

/* flags */
#define F_KIND        0x01u /* the entry that selects the group's kind; read first */
#define F_LO_OPEN     0x02u /* F64: > lo rather than >= lo */
#define F_HI_OPEN     0x04u /* F64: < hi rather than <= hi */
#define F_NO_HI       0x08u /* F64: no upper bound */
#define F_NO_LO       0x10u /* F64: no lower bound */
#define F_UNSUPPORTED 0x20u /* SUB: recognised, refused as not supported yet */

#define ALL  0xffffffffu
#define K(x) (1u << (x))

typedef struct cfg_opt cfg_opt;
typedef void (*cfg_opt_parse_fn)(cfg_ctx *c, const config_setting_t *s, void *base);

struct cfg_opt {
    const char         *name;
    int                 type;
    size_t              off, size;       /* the field in the group's struct */
    unsigned            applies;         /* kinds of the group it applies to */
    unsigned            required;        /* kinds where it must be given */
    unsigned            flags;
    int64_t             ilo, ihi, idef;  /* INT, PAIR; idef also ENUM and BOOL */
    double              flo, fhi, fdef;  /* F64 */
    const char         *sdef;            /* STR */
    const char *const  *names;           /* ENUM, STR */
    cfg_opt_parse_fn    parse;           /* CUSTOM */
    const char         *help;
};

#define FLD(T, f) .off = offsetof(T, f), .size = sizeof(((T *)0)->f)
#define O_KIND(T, key, f, def, nm, req, h) \
    {.name = key, .type = OT_ENUM, FLD(T, f), .applies = ALL, .required = req, .flags = F_KIND, .idef = def, \
     .names = nm, .help = h}
#define O_INT(T, key, f, def, lo, hi, app, req, h) \
    {.name = key, .type = OT_INT, FLD(T, f), .applies = app, .required = req, .idef = def, .ilo = lo, .ihi = hi, \
     .help = h}
#define O_F64(T, key, f, def, lo, hi, fl, app, req, h) \
    {.name = key, .type = OT_F64, FLD(T, f), .applies = app, .required = req, .flags = fl, .fdef = def, \
     .flo = lo, .fhi = hi, .help = h}
#define O_BOOL(T, key, f, def, app, h) \
    {.name = key, .type = OT_BOOL, FLD(T, f), .applies = app, .idef = def, .help = h}
#define O_ENUM(T, key, f, def, nm, app, req, h) \
    {.name = key, .type = OT_ENUM, FLD(T, f), .applies = app, .required = req, .idef = def, .names = nm, .help = h}
#define O_STR(T, key, f, def, nm, app, req, h) \
    {.name = key, .type = OT_STR, FLD(T, f), .applies = app, .required = req, .sdef = def, .names = nm, .help = h}
#define O_PAIR(T, key, f, def, lo, hi, app, req, h) \
    {.name = key, .type = OT_PAIR, FLD(T, f), .applies = app, .required = req, .idef = def, .ilo = lo, \
     .ihi = hi, .help = h}
#define O_CUSTOM(key, fn, app, req, h) \
    {.name = key, .type = OT_CUSTOM, .applies = app, .required = req, .parse = fn, .help = h}
#define O_SUB(key, fl, req, h) {.name = key, .type = OT_SUB, .applies = ALL, .required = req, .flags = fl, .help = h}
#define O_END {.name = NULL}

/* One table's view of a group when checking its keys. */
typedef struct cfg_scope {
    const cfg_opt *tbl;
    int            kind; /* -1: unknown, so any key of the table is accepted */
    const char    *gate; /* non-NULL: no key of this table applies here, e.g. "op = \"map\"" */
} cfg_scope;

/* ---- the engine (config_table.c); each function is described where it is defined */
void cfg_where_of_(const cfg_ctx *c, const config_setting_t *s, char *buf, size_t n, int *line_out);
void cfg_loc_of_(const cfg_ctx *c, const config_setting_t *s, loom_loc *l);
__attribute__((format(printf, 3, 4)))
loom_err *cfg_err_(cfg_ctx *c, const config_setting_t *s, const char *fmt, ...);
__attribute__((format(printf, 4, 5)))
loom_err *cfg_rawerr_(cfg_ctx *c, int code, const char *where, const char *fmt, ...);
const char *cfg_fmt_double_(double v, char *buf, size_t n);
const char *cfg_value_str_(const config_setting_t *s, char *buf, size_t n);
int cfg_find_name_(const char *const *names, const char *s);
const char *cfg_closest_(const char *const *names, const char *s);
bool cfg_is_int_(const config_setting_t *s);
bool cfg_is_number_(const config_setting_t *s);
double cfg_get_number_(const config_setting_t *s);
void cfg_lex_text_(const char *t, const char *dir, cfg_int_lits *L, int depth);
void cfg_lex_file_(const char *path, const char *dir, cfg_int_lits *L, int depth);
void cfg_fix_wide_ints_(cfg_ctx *c, config_setting_t *root, cfg_int_lits *L);
void cfg_forget_huge_(cfg_ctx *c, const config_setting_t *s);
bool cfg_applies_(const cfg_opt *o, int kind);
void cfg_opt_default_(const cfg_opt *o, void *base);
bool cfg_get_int_in_(cfg_ctx *c, const config_setting_t *s, int64_t lo, int64_t hi, int64_t *out);
int cfg_get_enum_(cfg_ctx *c, const config_setting_t *s, const char *const *names);
int cfg_parse_kind_(cfg_ctx *c, const config_setting_t *g, const cfg_opt *tbl, void *base);
void cfg_parse_opts_(cfg_ctx *c, const config_setting_t *g, const cfg_opt *tbl, int kind, void *base);
void cfg_check_keys_(cfg_ctx *c, const config_setting_t *g, const cfg_scope *sc, int n_sc);
const config_setting_t *cfg_sub_group_(cfg_ctx *c, const config_setting_t *g, const char *key);
const config_setting_t *cfg_sub_list_(cfg_ctx *c, const config_setting_t *g, const char *key);
void cfg_opts_default_(const cfg_opt *tbl, void *base);
int cfg_string_list_(cfg_ctx *c, const config_setting_t *s, int max, const char *what);

/* ---- the sections, in the order loom_config_load validates them ----------- */

/* config_data.c */
void cfg_parse_data_(cfg_ctx *c, const config_setting_t *root, loom_spec *spec);

/* config_source.c */
extern const cfg_opt cfg_source_opts_[];
int cfg_plugin_source_type_(cfg_ctx *c, const config_setting_t *t, loom_source_spec *src);

/* config_model.c */
void cfg_parse_model_(cfg_ctx *c, const config_setting_t *root, loom_model_spec *m);

/* config_optimizer.c */
void cfg_parse_optimizer_(cfg_ctx *c, const config_setting_t *root, loom_optimizer_spec *o);

/* config_strategy.c */
void cfg_check_replicas_batch_(cfg_ctx *c, const config_setting_t *root, const loom_spec *spec);
void cfg_parse_strategy_(cfg_ctx *c, const config_setting_t *root, loom_strategy_spec *st);

/* config_cluster.c */
void cfg_parse_cluster_(cfg_ctx *c, const config_setting_t *root, loom_cluster_spec *cl);

/* config_run.c */
void cfg_parse_run_(cfg_ctx *c, const config_setting_t *root, loom_spec *spec);

/* config_hooks.c */
void cfg_resolve_lua_ref_(cfg_ctx *c, const config_setting_t *s, char *out, size_t n);
void cfg_parse_hooks_(cfg_ctx *c, const config_setting_t *root, loom_hooks_spec *h);

/* config_plugins.c */
void cfg_plugin_opts_group_(cfg_ctx *c, const config_setting_t *s, loom_plugin_opts *o);
void cfg_parse_plugins_(cfg_ctx *c, const config_setting_t *root, loom_plugins_spec *p);

/* config_override.c */
void cfg_apply_override_(cfg_ctx *c, config_t *cfg, const char *text, char *key);

#endif
