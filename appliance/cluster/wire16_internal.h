/* wire16_internal.h - the 16-bit wire formats' conversions (wire16.c), for group.c. */
#ifndef LOOM_CLUSTER_WIRE16_INTERNAL_H
#define LOOM_CLUSTER_WIRE16_INTERNAL_H
#include "cluster/cluster.h"

#include <stddef.h>
#include <stdint.h>

void loom_wire_narrow_(loom_wire_fmt fmt, uint16_t *dst, const float *src, size_t n); /* dst = src rounded */
void loom_wire_widen_(loom_wire_fmt fmt, float *dst, const uint16_t *src, size_t n);  /* dst = src as float32 */
/* acc += in (widened), in float32; out (when not NULL) = the sums rounded: a reducing hop */
void loom_wire_add_(loom_wire_fmt fmt, float *acc, uint16_t *out, const uint16_t *in, size_t n);
#endif
