/* xops_v1.h - a version-1 cross-device op for the cross-device op tests, as
 * a plugin built before the per-rank entry points would register it: the
 * vtable ends at all_gather, so its ranks meet at Loom's generic rendezvous.
 * Its collectives are reduce_to_one_device's N-buffer ones. Define one with
 * XOPS_V1("name") and register it cast to loom_cross_device_ops. */
#ifndef LOOM_TESTS_XOPS_V1_H
#define LOOM_TESTS_XOPS_V1_H

#include "distribute/distribute.h"

typedef struct v1_ops {
    uint32_t    version;
    const char *name;
    int (*all_reduce)(float *const *bufs, int n, int64_t count, loom_redop op, loom_err *err);
    int (*broadcast)(float *const *bufs, int n, int64_t count, int root, loom_err *err);
    int (*all_gather)(float *const *bufs, int n, int64_t count, float *out, loom_err *err);
} v1_ops;

/* The built-in op it forwards to (registering the built-ins first if need be). */
static inline const loom_cross_device_ops *v1_target_(void)
{
    loom_err err;
    LOOM_ASSERT(loom_distribute_init(&err) == LOOM_OK);
    return loom_find_cross_device_ops("reduce_to_one_device");
}

static inline int v1_all_reduce(float *const *bufs, int n, int64_t count, loom_redop op, loom_err *err)
{
    return v1_target_()->all_reduce(bufs, n, count, op, err);
}

static inline int v1_broadcast(float *const *bufs, int n, int64_t count, int root, loom_err *err)
{
    return v1_target_()->broadcast(bufs, n, count, root, err);
}

#define XOPS_V1(name) {1, (name), v1_all_reduce, v1_broadcast, NULL}

#endif
