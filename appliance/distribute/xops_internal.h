/* xops_internal.h - between distribute.c and xops.c: registering the built-in
 * cross-device ops and resolving strategy.cross_device_ops = "auto". */
#ifndef LOOM_XOPS_INTERNAL_H
#define LOOM_XOPS_INTERNAL_H

#include "distribute.h"

/* Registers reduce_to_one_device, hierarchical_copy and ring. */
int loom_xops_register_builtins_(loom_err *err);

/* The op "auto" stands for with n replicas, and why, in a sentence for the
 * log. gpus: the buffers it reduces are in GPU memory (then the first op
 * registered that works there); else the ring, never an op of GPU memory
 * only. A rule, not a timing, so the choice (and with it the summation
 * order) is the same on every run of a config. */
const loom_cross_device_ops *loom_xops_auto_(int n, int gpus, char *why, size_t why_n);

#endif
