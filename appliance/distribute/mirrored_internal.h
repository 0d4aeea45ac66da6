/* mirrored_internal.h - between distribute.c and mirrored.c: registering the
 * built-in replicated strategies. */
#ifndef LOOM_MIRRORED_INTERNAL_H
#define LOOM_MIRRORED_INTERNAL_H

#include "distribute.h"

/* Registers mirrored and central_storage. */
int loom_replicated_register_(loom_err *err);
/* Whether ops is mirrored's or central_storage's. */
int loom_replicated_owns_(const loom_strategy_ops *ops);
/* The one_device strategy's vtable (one_device.c). */
const loom_strategy_ops *loom_one_device_ops_(void);

#endif
