/* mirrored_internal.h - between distribute.c and mirrored.c: registering the
 * built-in replicated strategies. */
#ifndef LOOM_MIRRORED_INTERNAL_H
#define LOOM_MIRRORED_INTERNAL_H

#include "distribute.h"

/* Registers mirrored and central_storage. */
int loom_replicated_register_(loom_err *err);
/* Whether ops is mirrored's or central_storage's. */
int loom_replicated_owns_(const loom_strategy_ops *ops);
/* loom_strategy_print_plan for mirrored and central_storage; 0 for any other strategy. */
int loom_replicated_print_plan_(loom_strategy *s, int64_t global_batch, FILE *f);

#endif
