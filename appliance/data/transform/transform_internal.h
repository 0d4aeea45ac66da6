/* transform_internal.h - between the files of the synchronous stages:
 * transforms.c (map), convert.c (the element-wise kernels), shuffle.c,
 * batch.c, repeat.c (repeat, take, skip). Their stage constructors are in
 * data/data_internal.h with the others. */
#ifndef LOOM_TRANSFORM_INTERNAL_H
#define LOOM_TRANSFORM_INTERNAL_H

#include "data/data_internal.h"

/* ---- the element-wise kernels (convert.c) ---------------------------------- */
/* n values of sd at src into dd at dst; src == dst is allowed when the sizes are equal. */
void dconvert_(const void *src, loom_dtype sd, void *dst, loom_dtype dd, size_t n);
/* float32 v * sc + off of any input dtype. */
void dscale_vals_(const void *src, loom_dtype sd, float *dst, size_t n, float sc, float off);
/* float32 (v - mean) / std of any input dtype; per channel: the last axis, of length L. */
void dnormalize_vals_(const void *src, loom_dtype sd, float *dst, size_t n, float mean, float std);
void dnormalize_vec_(const void *src, loom_dtype sd, float *dst, size_t n, const float *mean, const float *std,
                     size_t L);
/* u8, i32 or i64. */
int  dis_int_(loom_dtype t);
/* The mean and population standard deviation of n values. */
void dstats_vals_(const void *src, loom_dtype sd, size_t n, double *mean, double *std);
/* An image (H, W) of px-byte pixels padded by p on each side with fill (esz bytes). */
void dpad_image_(const uint8_t *src, uint8_t *dst, int64_t H, int64_t W, int64_t p, size_t px, const uint8_t *fill,
                 size_t esz);

/* ---- a map(scale) fused into the gathering batch it reads (batch.c) ------------- */
bool batch_fuse_scale_(dstage *st, int f, float sc, float off);
int  batch_next_scaled_(dstage *st, loom_elem *o, loom_err *err);

#endif
