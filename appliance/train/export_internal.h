/* export_internal.h - what export.c's command calls in its sibling writers. */
#ifndef LOOM_EXPORT_INTERNAL_H
#define LOOM_EXPORT_INTERNAL_H

#include "train.h"

/* Writes m's variables to output as an .npz (atomically: a failure leaves no partial file). */
int loom_export_npz_(loom_model *m, const char *output, loom_err *err);

#endif
