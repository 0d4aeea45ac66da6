/* mirrored_internal.h - between distribute.c and mirrored.c: registering the
 * built-in replicated strategies. */
#ifndef LOOM_MIRRORED_INTERNAL_H
#define LOOM_MIRRORED_INTERNAL_H

#include "distribute.h"

/* Registers mirrored and central_storage. */
int loom_replicated_register_(loom_err *err);

#endif
