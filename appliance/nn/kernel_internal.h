/* kernel_internal.h - what the element-wise kernels of layers.c and the
 * layer families' files (dense.c, pooling.c, dropout.c, normalization.c,
 * embedding.c, losses.c) share: the target clones of hot loops and short
 * vector copies. Private to nn/. */
#ifndef LOOM_NN_KERNEL_INTERNAL_H
#define LOOM_NN_KERNEL_INTERNAL_H

/* The build targets baseline x86-64 (SSE2); the hot element-wise loops are
 * compiled for AVX2 and AVX-512 too and picked by loom_cpu()'s level at each
 * call (tensor.h LOOM_CLONES), so LOOM_TEST_CPU caps them as it caps the
 * kernels. */

/* 16 floats as one GNU C vector: one AVX-512 register, two AVX2 or four SSE
 * ones; loads and stores through it need only float alignment. gcc leaves
 * some 16-long loops unrolled but scalar, and turns copy loops into memcpy
 * calls, which for im2col's short rows cost more than the copy. */
#define NN_CB 16
typedef float nn_v16_ __attribute__((vector_size(NN_CB * sizeof(float)), aligned(sizeof(float))));

static inline __attribute__((always_inline)) void copy_short(float *restrict d, const float *restrict s, int n)
{
    int k = 0;
    for (; k + NN_CB <= n; k += NN_CB) *(nn_v16_ *)(d + k) = *(const nn_v16_ *)(s + k);
    for (; k < n; k++) d[k] = s[k];
}

static inline __attribute__((always_inline)) void zero_short(float *restrict d, int n)
{
    int k = 0;
    for (; k + NN_CB <= n; k += NN_CB) *(nn_v16_ *)(d + k) = (nn_v16_){0};
    for (; k < n; k++) d[k] = 0.f;
}


#endif
