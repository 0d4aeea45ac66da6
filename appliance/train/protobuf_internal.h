/* protobuf_internal.h - the few protobuf wire-format writers that train/'s
 * hand-encoded messages share (TensorBoard events in summary.c, ONNX models
 * in export.c): varints, field keys and length-delimited fields, appended to
 * a loom_buf. Writing only; see export.c for why no protobuf library. */
#ifndef LOOM_TRAIN_PROTOBUF_INTERNAL_H
#define LOOM_TRAIN_PROTOBUF_INTERNAL_H

#include <stdint.h>
#include <string.h>

#include "core/core.h"

enum { WT_VARINT = 0, WT_I64 = 1, WT_LEN = 2, WT_I32 = 5 }; /* wire types */

static inline void pb_varint(loom_buf *b, uint64_t v)
{
    uint8_t tmp[10];
    int n = 0;
    do {
        tmp[n++] = (uint8_t)((v & 0x7f) | (v > 0x7f ? 0x80 : 0));
        v >>= 7;
    } while (v);
    loom_buf_put(b, tmp, (size_t)n);
}

static inline void pb_key(loom_buf *b, int field, int wt) { pb_varint(b, (uint64_t)field << 3 | (uint64_t)wt); }

static inline void pb_bytes(loom_buf *b, int field, const void *p, size_t n)
{
    pb_key(b, field, WT_LEN);
    pb_varint(b, n);
    loom_buf_put(b, p, n);
}

static inline void pb_str(loom_buf *b, int field, const char *s) { pb_bytes(b, field, s, strlen(s)); }

#endif
