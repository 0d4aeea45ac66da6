/* placement_internal.h - between placement.c and the strategies
 * (distribute.c, mirrored.c): the device backend and devices that run the
 * replicas, from strategy.device(s) and strategy.device_backend. */
#ifndef LOOM_PLACEMENT_INTERNAL_H
#define LOOM_PLACEMENT_INTERNAL_H

#include "distribute.h"

typedef struct loom_placement_ {
    const loom_device_ops *ops;                    /* NULL: nn's native host code (cpu devices) */
    int                    gpu;                    /* the devices are gpu:N */
    int                    n;                      /* gpu: the devices ("gpu:*" = every usable GPU) */
    int                    index[LOOM_MAX_DEVICES]; /* gpu: replica r's device for ops->open */
} loom_placement_;

/* Resolves the backend for replicas on devices[0..n) ("cpu:N", "gpu:N" or
 * the single "gpu:*"; n = 0: cpu replicas by count), which the setting at
 * loc names: "" runs cpu devices natively and gpu devices on "cuda", "cpu"
 * the CPU reference backend (cpu devices only), any other name a registered
 * backend (gpu devices only). GPUs must be usable now, and the model ms
 * must not use what device backends cannot run (loom_model_spec_dev_check,
 * checked first: it holds on any machine). Errors are
 * LOOM_ECONFIG at the setting's file:line, saying what is missing. */
int loom_place_devices_(const loom_strategy_spec *st, const char (*devices)[16], int n, const loom_loc *loc,
                        const loom_model_spec *ms, loom_placement_ *p, loom_err *err);
/* Replica r's device index for p->ops->open (the CPU backend has one device). */
int loom_place_index_(const loom_placement_ *p, int r);
/* One line for `loom check`: what runs the replicas. */
const char *loom_place_describe_(const loom_placement_ *p, char *buf, size_t n);

#endif
