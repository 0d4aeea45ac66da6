/* conv_direct.c - conv2d k x k (k = 5, 7), stride 1, "same" padding, direct (no im2col): the
 * Fashion-MNIST CNN's second convolution (5x5, 32 -> 64 on 14x14) and its like.
 * im2col writes k*k*cin floats per output pixel (25x the input for 5x5) and BLAS packs them again
 * for a product whose N (cout) is narrow; on AVX2 (Haswell's kernel) that took the three products
 * of the layer to ~100% of their GEMM-only time. Here the input goes to a zero-padded plane once
 * per example and each output pixel's channels, 16 at a time, stay in registers over the k*k taps
 * and the input channels, a row of pixels sharing each weight vector loaded. The input gradient
 * is the same convolution of dz with the kernel flipped and transposed (cin <-> cout; "same" with
 * odd k pads alike on both sides), the kernel gradient a sum over the pixels per (tap, cin) row.
 * Every output element is one fused multiply-add chain in (tap, input channel) order (the kernel
 * gradient's: pixels in order, examples added in order), so the bits do not depend on the threads,
 * the chunking, or the vector width (the AVX2 and AVX-512 kernels compute the same chains).
 * The 3x3 case is conv_fast.c's. Threads: a call touches only its examples' rows and scratch. */
#include <string.h>

#include "nn_internal.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define CD_HAVE 1
#else
#define CD_HAVE 0
#endif

/* Up to 64 channels in and out: a 16-channel block's weights for one tap row (k cin 16 floats)
 * stay in L1; wider layers keep im2col + BLAS, whose products are then wide enough. */
#define CD_MAX_C 64

int nn_convd_ok_(const nn_layer_ *l)
{
    const int k = l->kh;
    return CD_HAVE && l->fma >= 1 && !l->direct && (k == 5 || k == 7) && l->kw == k && l->sh == 1 && l->sw == 1 &&
           l->pad_t == k / 2 && l->pad_l == k / 2 && l->oh == l->ih && l->ow == l->iw && l->cin % 16 == 0 &&
           l->cout % 16 == 0 && l->cin <= CD_MAX_C && l->cout <= CD_MAX_C;
}

int64_t nn_convd_scratch_(const nn_layer_ *l)
{
    const int64_t c = l->cin > l->cout ? l->cin : l->cout, kk = (int64_t)l->kh * l->kw;
    return (int64_t)(l->ih + l->kh - 1) * (l->iw + l->kw - 1) * c + kk * l->cin * l->cout;
}

#if CD_HAVE
/* xp (H + 2p, W + 2p, C) = x (H, W, C) with a border of p zeros. */
static void padp(const float *restrict x, float *restrict xp, int H, int W, int C, int p)
{
    const int64_t rw = (int64_t)(W + 2 * p) * C;
    memset(xp, 0, (size_t)(p * rw) * sizeof *xp);
    memset(xp + (int64_t)(H + p) * rw, 0, (size_t)(p * rw) * sizeof *xp);
    for (int r = 0; r < H; r++) {
        float *d = xp + (int64_t)(r + p) * rw;
        memset(d, 0, (size_t)(p * C) * sizeof *d);
        memcpy(d + (int64_t)p * C, x + (int64_t)r * W * C, (size_t)W * C * sizeof *d);
        memset(d + (int64_t)(W + p) * C, 0, (size_t)(p * C) * sizeof *d);
    }
}

#define CD_512 __attribute__((target("avx512f,avx2,fma")))
#define CD_256 __attribute__((target("avx2,fma")))

/* T output pixels from (row r of xp, column ox), channels [c0, c0 + 16) of CO: the taps (i, j),
 * then the input channels, each a fused multiply-add. */
static inline __attribute__((always_inline)) CD_512 void tile512(int T, int K, const float *restrict xp, int64_t rw,
                                                                 int CI, int CO, const float *restrict w, int c0,
                                                                 float *restrict y)
{
    __m512 acc[14];
#pragma GCC unroll 14
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int i = 0; i < K; i++)
        for (int j = 0; j < K; j++) {
            const float *xr = xp + i * rw + (int64_t)j * CI;
            const float *wr = w + (int64_t)(i * K + j) * CI * CO + c0;
            for (int ci = 0; ci < CI; ci++) {
                __m512 wv = _mm512_loadu_ps(wr + (int64_t)ci * CO);
#pragma GCC unroll 14
                for (int t = 0; t < T; t++) acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(xr[(int64_t)t * CI + ci]), wv, acc[t]);
            }
        }
#pragma GCC unroll 14
    for (int t = 0; t < T; t++) _mm512_storeu_ps(y + (int64_t)t * CO + c0, acc[t]);
}

static inline __attribute__((always_inline)) CD_256 void tile256(int T, int K, const float *restrict xp, int64_t rw,
                                                                 int CI, int CO, const float *restrict w, int c0,
                                                                 float *restrict y)
{
    __m256 lo[6], hi[6];
#pragma GCC unroll 6
    for (int t = 0; t < T; t++) lo[t] = hi[t] = _mm256_setzero_ps();
    for (int i = 0; i < K; i++)
        for (int j = 0; j < K; j++) {
            const float *xr = xp + i * rw + (int64_t)j * CI;
            const float *wr = w + (int64_t)(i * K + j) * CI * CO + c0;
            for (int ci = 0; ci < CI; ci++) {
                __m256 wl = _mm256_loadu_ps(wr + (int64_t)ci * CO), wh = _mm256_loadu_ps(wr + (int64_t)ci * CO + 8);
#pragma GCC unroll 6
                for (int t = 0; t < T; t++) {
                    __m256 v = _mm256_broadcast_ss(xr + (int64_t)t * CI + ci);
                    lo[t] = _mm256_fmadd_ps(v, wl, lo[t]);
                    hi[t] = _mm256_fmadd_ps(v, wh, hi[t]);
                }
            }
        }
#pragma GCC unroll 6
    for (int t = 0; t < T; t++) {
        _mm256_storeu_ps(y + (int64_t)t * CO + c0, lo[t]);
        _mm256_storeu_ps(y + (int64_t)t * CO + c0 + 8, hi[t]);
    }
}

/* One output row oy of a padded plane xp: y (W, CO). Rows of 14 (the CNN's) go 7 + 7 wide on
 * AVX-512, 5 + 5 + 4 on AVX2 (12 accumulators at most: 16 registers). */
CD_512 static void row512(const float *xp, int K, int W, int CI, int CO, const float *w, int oy, float *y)
{
    const int64_t rw = (int64_t)(W + K - 1) * CI;
    const float *x0 = xp + oy * rw;
    for (int c0 = 0; c0 < CO; c0 += 16) {
        int ox = 0;
        for (; ox + 14 <= W; ox += 14) tile512(14, K, x0 + (int64_t)ox * CI, rw, CI, CO, w, c0, y + (int64_t)ox * CO);
        for (; ox + 7 <= W; ox += 7) tile512(7, K, x0 + (int64_t)ox * CI, rw, CI, CO, w, c0, y + (int64_t)ox * CO);
        for (; ox + 2 <= W; ox += 2) tile512(2, K, x0 + (int64_t)ox * CI, rw, CI, CO, w, c0, y + (int64_t)ox * CO);
        for (; ox < W; ox++) tile512(1, K, x0 + (int64_t)ox * CI, rw, CI, CO, w, c0, y + (int64_t)ox * CO);
    }
}

CD_256 static void row256(const float *xp, int K, int W, int CI, int CO, const float *w, int oy, float *y)
{
    const int64_t rw = (int64_t)(W + K - 1) * CI;
    const float *x0 = xp + oy * rw;
    for (int c0 = 0; c0 < CO; c0 += 16) {
        int ox = 0, r = W;
        for (; r >= 6 && r != 8; ox += 6, r -= 6) tile256(6, K, x0 + (int64_t)ox * CI, rw, CI, CO, w, c0, y + (int64_t)ox * CO);
        for (; r >= 4; ox += 4, r -= 4) tile256(4, K, x0 + (int64_t)ox * CI, rw, CI, CO, w, c0, y + (int64_t)ox * CO);
        for (; r >= 2; ox += 2, r -= 2) tile256(2, K, x0 + (int64_t)ox * CI, rw, CI, CO, w, c0, y + (int64_t)ox * CO);
        for (; r >= 1; ox++, r--) tile256(1, K, x0 + (int64_t)ox * CI, rw, CI, CO, w, c0, y + (int64_t)ox * CO);
    }
}

/* The kernel gradient's rows [r0, r1) of (K K CI) for one example: acc (r1 - r0, CO) = the sums
 * over its pixels of xp's shifted channel times dz (one fused chain per element, pixels in order),
 * G rows at a time. A row's sum does not depend on which rows go with it. */
static inline __attribute__((always_inline)) CD_512 void grad_rows512(int G, int K, const float *restrict xp,
                                                                      const float *restrict dz, int H, int W, int CI,
                                                                      int CO, int r0, float *restrict acc)
{
    const int64_t rw = (int64_t)(W + K - 1) * CI;
    int64_t off[24];
    for (int g = 0; g < G; g++) {
        int r = r0 + g, t = r / CI;
        off[g] = (t / K) * rw + (int64_t)(t % K) * CI + r % CI;
    }
    for (int c0 = 0; c0 < CO; c0 += 16) {
        __m512 s[24];
#pragma GCC unroll 24
        for (int g = 0; g < G; g++) s[g] = _mm512_setzero_ps();
        for (int oy = 0; oy < H; oy++) {
            const float *xr = xp + oy * rw, *dr = dz + (int64_t)oy * W * CO + c0;
            for (int ox = 0; ox < W; ox++) {
                __m512 d = _mm512_loadu_ps(dr + (int64_t)ox * CO);
                const float *xo = xr + (int64_t)ox * CI;
#pragma GCC unroll 24
                for (int g = 0; g < G; g++) s[g] = _mm512_fmadd_ps(_mm512_set1_ps(xo[off[g]]), d, s[g]);
            }
        }
#pragma GCC unroll 24
        for (int g = 0; g < G; g++) _mm512_storeu_ps(acc + (int64_t)g * CO + c0, s[g]);
    }
}

static inline __attribute__((always_inline)) CD_256 void grad_rows256(int G, int K, const float *restrict xp,
                                                                      const float *restrict dz, int H, int W, int CI,
                                                                      int CO, int r0, float *restrict acc)
{
    const int64_t rw = (int64_t)(W + K - 1) * CI;
    int64_t off[6];
    for (int g = 0; g < G; g++) {
        int r = r0 + g, t = r / CI;
        off[g] = (t / K) * rw + (int64_t)(t % K) * CI + r % CI;
    }
    for (int c0 = 0; c0 < CO; c0 += 16) {
        __m256 lo[6], hi[6];
#pragma GCC unroll 6
        for (int g = 0; g < G; g++) lo[g] = hi[g] = _mm256_setzero_ps();
        for (int oy = 0; oy < H; oy++) {
            const float *xr = xp + oy * rw, *dr = dz + (int64_t)oy * W * CO + c0;
            for (int ox = 0; ox < W; ox++) {
                __m256 dl = _mm256_loadu_ps(dr + (int64_t)ox * CO), dh = _mm256_loadu_ps(dr + (int64_t)ox * CO + 8);
                const float *xo = xr + (int64_t)ox * CI;
#pragma GCC unroll 6
                for (int g = 0; g < G; g++) {
                    __m256 v = _mm256_broadcast_ss(xo + off[g]);
                    lo[g] = _mm256_fmadd_ps(v, dl, lo[g]);
                    hi[g] = _mm256_fmadd_ps(v, dh, hi[g]);
                }
            }
        }
#pragma GCC unroll 6
        for (int g = 0; g < G; g++) {
            _mm256_storeu_ps(acc + (int64_t)g * CO + c0, lo[g]);
            _mm256_storeu_ps(acc + (int64_t)g * CO + c0 + 8, hi[g]);
        }
    }
}

CD_512 static void grad512(const float *xp, const float *dz, int K, int H, int W, int CI, int CO, int r0, int r1,
                           float *acc)
{
    int r = r0;
    for (; r + 24 <= r1; r += 24) grad_rows512(24, K, xp, dz, H, W, CI, CO, r, acc + (int64_t)(r - r0) * CO);
    for (; r + 8 <= r1; r += 8) grad_rows512(8, K, xp, dz, H, W, CI, CO, r, acc + (int64_t)(r - r0) * CO);
    for (; r < r1; r++) grad_rows512(1, K, xp, dz, H, W, CI, CO, r, acc + (int64_t)(r - r0) * CO);
}

CD_256 static void grad256(const float *xp, const float *dz, int K, int H, int W, int CI, int CO, int r0, int r1,
                           float *acc)
{
    int r = r0;
    for (; r + 6 <= r1; r += 6) grad_rows256(6, K, xp, dz, H, W, CI, CO, r, acc + (int64_t)(r - r0) * CO);
    for (; r < r1; r++) grad_rows256(1, K, xp, dz, H, W, CI, CO, r, acc + (int64_t)(r - r0) * CO);
}

/* y (nb, H, W, CO) = the K x K "same" convolution of x (nb, H, W, CI) by w (K, K, CI, CO); xp scratch. */
static void convd(int level, int K, int H, int W, int CI, int CO, const float *w, const float *x, float *y,
                  int64_t nb, float *xp)
{
    for (int64_t b = 0; b < nb; b++) {
        padp(x + b * (int64_t)H * W * CI, xp, H, W, CI, K / 2);
        float *yb = y + b * (int64_t)H * W * CO;
        for (int oy = 0; oy < H; oy++) {
            if (level == 2) row512(xp, K, W, CI, CO, w, oy, yb + (int64_t)oy * W * CO);
            else row256(xp, K, W, CI, CO, w, oy, yb + (int64_t)oy * W * CO);
        }
    }
}
#endif

void nn_convd_forward_(const nn_layer_ *l, const float *w, const float *x, float *y, int64_t nb, float *scratch)
{
#if CD_HAVE
    convd(l->fma, l->kh, l->ih, l->iw, l->cin, l->cout, w, x, y, nb, scratch);
#else
    (void)l, (void)w, (void)x, (void)y, (void)nb, (void)scratch;
    LOOM_ASSERT(!"nn_convd_forward_ without nn_convd_ok_");
#endif
}

void nn_convd_backward_data_(const nn_layer_ *l, const float *w, const float *dz, float *dx, int64_t nb,
                             float *scratch)
{
#if CD_HAVE
    const int CI = l->cin, CO = l->cout, KK = l->kh * l->kw;
    float *wt = scratch, *xp = scratch + (int64_t)KK * CI * CO;
    /* wt (K, K, CO, CI): tap (i, j) of the flipped kernel, transposed */
    for (int t = 0; t < KK; t++)
        for (int co = 0; co < CO; co++)
            for (int ci = 0; ci < CI; ci++)
                wt[((int64_t)t * CO + co) * CI + ci] = w[((int64_t)(KK - 1 - t) * CI + ci) * CO + co];
    convd(l->fma, l->kh, l->ih, l->iw, CO, CI, wt, dz, dx, nb, xp);
#else
    (void)l, (void)w, (void)dz, (void)dx, (void)nb, (void)scratch;
    LOOM_ASSERT(!"nn_convd_backward_data_ without nn_convd_ok_");
#endif
}

void nn_convd_kernel_grad_(const nn_layer_ *l, const float *x, const float *dz, int64_t nb, int r0, int r1, float *dW,
                           float *scratch)
{
#if CD_HAVE
    const int H = l->ih, W = l->iw, CI = l->cin, CO = l->cout, K = l->kh;
    float *xp = scratch, *acc = scratch + (int64_t)(H + K - 1) * (W + K - 1) * CI;
    const int64_t n = (int64_t)(r1 - r0) * CO;
    float *restrict d = dW + (int64_t)r0 * CO;
    for (int64_t e = 0; e < n; e++) d[e] = 0.f;
    for (int64_t b = 0; b < nb; b++) { /* each example's sums, added in example order */
        padp(x + b * (int64_t)H * W * CI, xp, H, W, CI, K / 2);
        if (l->fma == 2) grad512(xp, dz + b * (int64_t)H * W * CO, K, H, W, CI, CO, r0, r1, acc);
        else grad256(xp, dz + b * (int64_t)H * W * CO, K, H, W, CI, CO, r0, r1, acc);
        for (int64_t e = 0; e < n; e++) d[e] += acc[e];
    }
#else
    (void)l, (void)x, (void)dz, (void)nb, (void)r0, (void)r1, (void)dW, (void)scratch;
    LOOM_ASSERT(!"nn_convd_kernel_grad_ without nn_convd_ok_");
#endif
}
