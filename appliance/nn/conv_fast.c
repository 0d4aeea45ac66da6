/* conv_fast.c - conv2d 3x3, stride 1, "same" padding, direct (no im2col), for ResNet's convolutions.
 * im2col writes 9 cin floats per output pixel and BLAS packs them again before a product whose
 * N (cout: 16, 32, 64) is too narrow to amortise the packing. Here the input goes to a zero-padded
 * plane once per example and each output pixel's channels, 16 at a time, stay in registers over
 * the 9 taps and the input channels: a row of pixels shares each weight vector loaded. The input
 * gradient is the same convolution of dz with the kernel flipped and transposed (cin <-> cout).
 * Every output element is one fused multiply-add chain in (tap, input channel) order, so the bits
 * do not depend on the threads, the chunking, or the vector width (the AVX2 and AVX-512 kernels
 * compute the same chains). Threads: a call touches only its examples' rows and its scratch. */
#include <string.h>

#include "nn_internal.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define CF_HAVE 1
#else
#define CF_HAVE 0
#endif

/* Wider layers stay on im2col + BLAS: a 16-channel block's weights (9 cin 16 floats) are streamed
 * again for every row of pixels, out of L1 past 64 input channels, while BLAS's products are then
 * wide enough to run near its peak. */
#define CF_MAX_C 64

/* Stride 1 "same" (padding 1 all round), or stride 2 with the top and left padding 0 or 1 (TF's
 * "same" on an even plane pads the bottom and right only: ResNet's downsampling 3x3). */
int nn_conv3_ok_(const nn_layer_ *l)
{
    bool s1 = l->sh == 1 && l->sw == 1 && l->pad_t == 1 && l->pad_l == 1 && l->oh == l->ih && l->ow == l->iw;
    bool s2 = l->sh == 2 && l->sw == 2 && l->pad_t <= 1 && l->pad_l <= 1;
    return CF_HAVE && l->fma >= 1 && !l->direct && !l->fuse_pool && l->kh == 3 && l->kw == 3 && (s1 || s2) &&
           l->cin % 16 == 0 && l->cout % 16 == 0 && l->cin <= CF_MAX_C && l->cout <= CF_MAX_C;
}

/* The input gradient direct (the flipped kernel's stride-1 convolution of dz): stride 1 only; a
 * stride-2 layer's goes through im2col's GEMM and col2im. */
int nn_conv3_dx_ok_(const nn_layer_ *l) { return nn_conv3_ok_(l) && l->sh == 1; }

int64_t nn_conv3_scratch_(const nn_layer_ *l)
{
    int64_t c = l->cin > l->cout ? l->cin : l->cout;
    return (int64_t)(l->ih + 2) * (l->iw + 2) * c + 9 * (int64_t)l->cin * l->cout;
}

#if CF_HAVE
/* xp (Hp, Wp, C) = x (H, W, C) at row pt, column pl, zeros around: the plane a stride-S output of
 * OH x OW reads, Hp = (OH - 1) S + 3, Wp = (OW - 1) S + 3 (stride 1: H + 2, W + 2, pt = pl = 1). */
static void padp(const float *restrict x, float *restrict xp, int H, int W, int C, int pt, int pl, int Hp, int Wp)
{
    const int64_t rw = (int64_t)Wp * C;
    const int n = W < Wp - pl ? W : Wp - pl; /* the columns that lie in the plane */
    for (int r = 0; r < Hp; r++) {
        float *d = xp + (int64_t)r * rw;
        int sr = r - pt;
        if (sr < 0 || sr >= H) {
            memset(d, 0, (size_t)rw * sizeof *d);
            continue;
        }
        memset(d, 0, (size_t)pl * C * sizeof *d);
        memcpy(d + (int64_t)pl * C, x + (int64_t)sr * W * C, (size_t)n * C * sizeof *d);
        memset(d + (int64_t)(pl + n) * C, 0, (size_t)(Wp - pl - n) * C * sizeof *d);
    }
}

static void pad_layer(const nn_layer_ *l, const float *x, float *xp)
{
    padp(x, xp, l->ih, l->iw, l->cin, l->pad_t, l->pad_l, (l->oh - 1) * l->sh + 3, (l->ow - 1) * l->sw + 3);
}

#define CF_512 __attribute__((target("avx512f,avx2,fma")))
#define CF_256 __attribute__((target("avx2,fma")))

/* T output pixels from (row r of xp, column ox), channels [c0, c0 + 16 NB) of CO: the taps (i, j),
 * then the input channels, each a fused multiply-add. NB 16-channel blocks at once: one broadcast of
 * an input value feeds NB products (T NB accumulators, at most 28 of the 32 registers), so a
 * 32- or 64-channel layer loads about half the floats per product it did one block at a time; each
 * element's chain is the same. */
static inline __attribute__((always_inline)) CF_512 void tile512(int T, int NB, int S, const float *restrict xp,
                                                                 int64_t rw, int CI, int CO, const float *restrict w,
                                                                 int c0, float *restrict y)
{
    __m512 acc[28];
#pragma GCC unroll 28
    for (int t = 0; t < T * NB; t++) acc[t] = _mm512_setzero_ps();
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 3; j++) {
            const float *xr = xp + i * rw + (int64_t)j * CI;
            const float *wr = w + (int64_t)(i * 3 + j) * CI * CO + c0;
            for (int ci = 0; ci < CI; ci++) {
                __m512 wv[4];
#pragma GCC unroll 4
                for (int q = 0; q < NB; q++) wv[q] = _mm512_loadu_ps(wr + (int64_t)ci * CO + 16 * q);
#pragma GCC unroll 14
                for (int t = 0; t < T; t++) {
                    __m512 v = _mm512_set1_ps(xr[(int64_t)t * S * CI + ci]);
#pragma GCC unroll 4
                    for (int q = 0; q < NB; q++) acc[t * NB + q] = _mm512_fmadd_ps(v, wv[q], acc[t * NB + q]);
                }
            }
        }
#pragma GCC unroll 14
    for (int t = 0; t < T; t++)
#pragma GCC unroll 4
        for (int q = 0; q < NB; q++) _mm512_storeu_ps(y + (int64_t)t * CO + c0 + 16 * q, acc[t * NB + q]);
}

static inline __attribute__((always_inline)) CF_256 void tile256(int T, int S, const float *restrict xp, int64_t rw,
                                                                 int CI, int CO, const float *restrict w, int c0,
                                                                 float *restrict y)
{
    __m256 lo[6], hi[6];
#pragma GCC unroll 6
    for (int t = 0; t < T; t++) lo[t] = hi[t] = _mm256_setzero_ps();
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 3; j++) {
            const float *xr = xp + i * rw + (int64_t)j * CI;
            const float *wr = w + (int64_t)(i * 3 + j) * CI * CO + c0;
            for (int ci = 0; ci < CI; ci++) {
                __m256 wl = _mm256_loadu_ps(wr + (int64_t)ci * CO), wh = _mm256_loadu_ps(wr + (int64_t)ci * CO + 8);
#pragma GCC unroll 6
                for (int t = 0; t < T; t++) {
                    __m256 v = _mm256_broadcast_ss(xr + (int64_t)t * S * CI + ci);
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

/* One output row oy (of W pixels, stride S) of a padded plane xp: y (W, CO). Inlined into row512 /
 * row256 with S, CI and CO constants (ResNet's 16, 32, 64): the input values' offsets and the
 * weights' stride become immediates, where a 14-pixel tile otherwise spilled its 14 index registers. */
static inline __attribute__((always_inline)) CF_512 void row512_(const float *xp, int W, int S, int CI, int CO,
                                                                 const float *w, int oy, float *y)
{
    const int64_t rw = (int64_t)((W - 1) * S + 3) * CI, ps = (int64_t)S * CI;
    const float *x0 = xp + oy * S * rw;
    int c0 = 0;
    for (; c0 + 32 <= CO; c0 += 32) { /* two blocks: 14 pixels x 32 channels, 28 accumulators */
        int ox = 0;
        for (; ox + 14 <= W; ox += 14) tile512(14, 2, S, x0 + ox * ps, rw, CI, CO, w, c0, y + (int64_t)ox * CO);
        for (; ox + 7 <= W; ox += 7) tile512(7, 2, S, x0 + ox * ps, rw, CI, CO, w, c0, y + (int64_t)ox * CO);
        for (; ox + 4 <= W; ox += 4) tile512(4, 2, S, x0 + ox * ps, rw, CI, CO, w, c0, y + (int64_t)ox * CO);
        for (; ox < W; ox++) tile512(1, 2, S, x0 + ox * ps, rw, CI, CO, w, c0, y + (int64_t)ox * CO);
    }
    for (; c0 < CO; c0 += 16) {
        int ox = 0;
        for (; ox + 14 <= W; ox += 14) tile512(14, 1, S, x0 + ox * ps, rw, CI, CO, w, c0, y + (int64_t)ox * CO);
        for (; ox + 7 <= W; ox += 7) tile512(7, 1, S, x0 + ox * ps, rw, CI, CO, w, c0, y + (int64_t)ox * CO);
        for (; ox + 2 <= W; ox += 2) tile512(2, 1, S, x0 + ox * ps, rw, CI, CO, w, c0, y + (int64_t)ox * CO);
        for (; ox < W; ox++) tile512(1, 1, S, x0 + ox * ps, rw, CI, CO, w, c0, y + (int64_t)ox * CO);
    }
}

static inline __attribute__((always_inline)) CF_256 void row256_(const float *xp, int W, int S, int CI, int CO,
                                                                 const float *w, int oy, float *y)
{
    const int64_t rw = (int64_t)((W - 1) * S + 3) * CI, ps = (int64_t)S * CI;
    const float *x0 = xp + oy * S * rw;
    for (int c0 = 0; c0 < CO; c0 += 16) {
        int ox = 0;
        for (; ox + 6 <= W; ox += 6) tile256(6, S, x0 + ox * ps, rw, CI, CO, w, c0, y + (int64_t)ox * CO);
        for (; ox + 2 <= W; ox += 2) tile256(2, S, x0 + ox * ps, rw, CI, CO, w, c0, y + (int64_t)ox * CO);
        for (; ox < W; ox++) tile256(1, S, x0 + ox * ps, rw, CI, CO, w, c0, y + (int64_t)ox * CO);
    }
}

/* CI and CO as constants for each of ResNet's pairs; other multiples of 16 up to CF_MAX_C as variables. */
#define CF_CASES(F, ...)                                                                                        \
    switch (CI * 1024 + CO) {                                                                                  \
    case 16 * 1024 + 16: F(__VA_ARGS__, 16, 16); break;                                                        \
    case 16 * 1024 + 32: F(__VA_ARGS__, 16, 32); break;                                                        \
    case 32 * 1024 + 16: F(__VA_ARGS__, 32, 16); break;                                                        \
    case 32 * 1024 + 32: F(__VA_ARGS__, 32, 32); break;                                                        \
    case 32 * 1024 + 64: F(__VA_ARGS__, 32, 64); break;                                                        \
    case 64 * 1024 + 32: F(__VA_ARGS__, 64, 32); break;                                                        \
    case 64 * 1024 + 64: F(__VA_ARGS__, 64, 64); break;                                                        \
    default: F(__VA_ARGS__, CI, CO); break;                                                                    \
    }
#define CF_ROW(fn, s, ci, co) fn(xp, W, s, ci, co, w, oy, y)

CF_512 static void row512(const float *xp, int W, int S, int CI, int CO, const float *w, int oy, float *y)
{
    if (S == 2) CF_CASES(CF_ROW, row512_, 2)
    else CF_CASES(CF_ROW, row512_, 1)
}

CF_256 static void row256(const float *xp, int W, int S, int CI, int CO, const float *w, int oy, float *y)
{
    if (S == 2) CF_CASES(CF_ROW, row256_, 2)
    else CF_CASES(CF_ROW, row256_, 1)
}

/* The kernel gradient's rows [r0, r1) of (9 CI) for one example: acc (r1 - r0, CO) = the sums over its
 * pixels of xp's shifted channel times dz (one fused chain per element, pixels in order), G rows at a
 * time. A row's sum does not depend on which rows go with it. */
static inline __attribute__((always_inline)) CF_512 void grad_rows512(int G, const float *restrict xp,
                                                                      const float *restrict dz, int H, int W, int S, int CI,
                                                                      int CO, int r0, float *restrict acc)
{
    const int64_t rw = (int64_t)((W - 1) * S + 3) * CI;
    int64_t off[24];
    for (int g = 0; g < G; g++) {
        int r = r0 + g, t = r / CI;
        off[g] = (t / 3) * rw + (int64_t)(t % 3) * CI + r % CI;
    }
    for (int c0 = 0; c0 < CO; c0 += 16) {
        __m512 s[24];
#pragma GCC unroll 24
        for (int g = 0; g < G; g++) s[g] = _mm512_setzero_ps();
        for (int oy = 0; oy < H; oy++) {
            const float *xr = xp + oy * S * rw, *dr = dz + (int64_t)oy * W * CO + c0;
            for (int ox = 0; ox < W; ox++) {
                __m512 d = _mm512_loadu_ps(dr + (int64_t)ox * CO);
                const float *xo = xr + (int64_t)ox * S * CI;
#pragma GCC unroll 24
                for (int g = 0; g < G; g++) s[g] = _mm512_fmadd_ps(_mm512_set1_ps(xo[off[g]]), d, s[g]);
            }
        }
#pragma GCC unroll 24
        for (int g = 0; g < G; g++) _mm512_storeu_ps(acc + (int64_t)g * CO + c0, s[g]);
    }
}

static inline __attribute__((always_inline)) CF_256 void grad_rows256(int G, const float *restrict xp,
                                                                      const float *restrict dz, int H, int W, int S, int CI,
                                                                      int CO, int r0, float *restrict acc)
{
    const int64_t rw = (int64_t)((W - 1) * S + 3) * CI;
    int64_t off[6];
    for (int g = 0; g < G; g++) {
        int r = r0 + g, t = r / CI;
        off[g] = (t / 3) * rw + (int64_t)(t % 3) * CI + r % CI;
    }
    for (int c0 = 0; c0 < CO; c0 += 16) {
        __m256 lo[6], hi[6];
#pragma GCC unroll 6
        for (int g = 0; g < G; g++) lo[g] = hi[g] = _mm256_setzero_ps();
        for (int oy = 0; oy < H; oy++) {
            const float *xr = xp + oy * S * rw, *dr = dz + (int64_t)oy * W * CO + c0;
            for (int ox = 0; ox < W; ox++) {
                __m256 dl = _mm256_loadu_ps(dr + (int64_t)ox * CO), dh = _mm256_loadu_ps(dr + (int64_t)ox * CO + 8);
                const float *xo = xr + (int64_t)ox * S * CI;
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

/* Kernel gradient rows [r, r + G) that are G consecutive input channels of one tap (G divides CI):
 * their values lie side by side in xp, at constant offsets, where grad_rows512's rows from anywhere
 * take each offset from memory. G rows times NB 16-channel blocks of dz (16 accumulators): the
 * same chains as grad_rows512's. */
static inline __attribute__((always_inline)) CF_512 void grad_blk512(int G, int NB, const float *restrict xp,
                                                                     const float *restrict dz, int H, int W, int S, int CI,
                                                                     int CO, int r, float *restrict acc)
{
    const int64_t rw = (int64_t)((W - 1) * S + 3) * CI;
    const int t = r / CI;
    const float *x0 = xp + (t / 3) * rw + (int64_t)(t % 3) * CI + r % CI;
    for (int c0 = 0; c0 < CO; c0 += 16 * NB) {
        __m512 s[16];
#pragma GCC unroll 16
        for (int g = 0; g < G * NB; g++) s[g] = _mm512_setzero_ps();
        for (int oy = 0; oy < H; oy++) {
            const float *xr = x0 + oy * S * rw, *dr = dz + (int64_t)oy * W * CO + c0;
            for (int ox = 0; ox < W; ox++) {
                __m512 d[4];
#pragma GCC unroll 4
                for (int q = 0; q < NB; q++) d[q] = _mm512_loadu_ps(dr + (int64_t)ox * CO + 16 * q);
                const float *xo = xr + (int64_t)ox * S * CI;
#pragma GCC unroll 16
                for (int g = 0; g < G; g++) {
                    __m512 v = _mm512_set1_ps(xo[g]);
#pragma GCC unroll 4
                    for (int q = 0; q < NB; q++) s[g * NB + q] = _mm512_fmadd_ps(v, d[q], s[g * NB + q]);
                }
            }
        }
#pragma GCC unroll 16
        for (int g = 0; g < G; g++)
#pragma GCC unroll 4
            for (int q = 0; q < NB; q++) _mm512_storeu_ps(acc + (int64_t)g * CO + c0 + 16 * q, s[g * NB + q]);
    }
}

/* Rows [r, r1) (fewer than 16) in groups of 8, 4, 2, 1: a thread's share of the rows (layers.c splits
 * 9 CI rows in two) that does not start or end on a block. One at a time, each row was one fused
 * chain latency-bound at 4 cycles a pixel: a 16 -> 16 layer's half (72 rows, 4 blocks and 8 rows
 * alone) took twice the forward's time. */
static inline __attribute__((always_inline)) CF_512 void grad_odd512(const float *xp, const float *dz, int H, int W,
                                                                     int S, int CI, int CO, int r, int r1, float *acc)
{
    if (r + 8 <= r1) grad_rows512(8, xp, dz, H, W, S, CI, CO, r, acc), r += 8, acc += 8 * (int64_t)CO;
    if (r + 4 <= r1) grad_rows512(4, xp, dz, H, W, S, CI, CO, r, acc), r += 4, acc += 4 * (int64_t)CO;
    if (r + 2 <= r1) grad_rows512(2, xp, dz, H, W, S, CI, CO, r, acc), r += 2, acc += 2 * (int64_t)CO;
    if (r < r1) grad_rows512(1, xp, dz, H, W, S, CI, CO, r, acc);
}

static inline __attribute__((always_inline)) CF_512 void grad512_(const float *xp, const float *dz, int H, int W,
                                                                  int S, int CI, int CO, int r0, int r1, float *acc)
{
    const int NB = CO % 64 == 0 ? 4 : CO % 32 == 0 ? 2 : 1, G = 16 / NB; /* G divides CI (a multiple of 16) */
    int r = (r0 + G - 1) / G * G;
    if (r > r1) r = r1;
    grad_odd512(xp, dz, H, W, S, CI, CO, r0, r, acc);
    for (; r + G <= r1; r += G) {
        float *a = acc + (int64_t)(r - r0) * CO;
        if (NB == 4) grad_blk512(4, 4, xp, dz, H, W, S, CI, CO, r, a);
        else if (NB == 2) grad_blk512(8, 2, xp, dz, H, W, S, CI, CO, r, a);
        else grad_blk512(16, 1, xp, dz, H, W, S, CI, CO, r, a);
    }
    grad_odd512(xp, dz, H, W, S, CI, CO, r, r1, acc + (int64_t)(r - r0) * CO);
}

#define CF_GRAD(fn, ci, co) fn(xp, dz, H, W, S, ci, co, r0, r1, acc)

/* S as a constant too: a runtime stride took one more register in the pixel loop (AVX2's spilled). */
CF_512 static void grad512(const float *xp, const float *dz, int H, int W, int S, int CI, int CO, int r0, int r1,
                           float *acc)
{
    if (S == 2) {
        enum { S = 2 };
        CF_CASES(CF_GRAD, grad512_)
    } else {
        enum { S = 1 };
        CF_CASES(CF_GRAD, grad512_)
    }
}

static inline __attribute__((always_inline)) CF_256 void grad256_(const float *xp, const float *dz, int H, int W,
                                                                  int S, int CI, int CO, int r0, int r1, float *acc)
{
    int r = r0;
    for (; r + 6 <= r1; r += 6) grad_rows256(6, xp, dz, H, W, S, CI, CO, r, acc + (int64_t)(r - r0) * CO);
    if (r + 4 <= r1) grad_rows256(4, xp, dz, H, W, S, CI, CO, r, acc + (int64_t)(r - r0) * CO), r += 4; /* as grad_odd512 */
    if (r + 2 <= r1) grad_rows256(2, xp, dz, H, W, S, CI, CO, r, acc + (int64_t)(r - r0) * CO), r += 2;
    if (r < r1) grad_rows256(1, xp, dz, H, W, S, CI, CO, r, acc + (int64_t)(r - r0) * CO);
}

CF_256 static void grad256(const float *xp, const float *dz, int H, int W, int S, int CI, int CO, int r0, int r1,
                           float *acc)
{
    if (S == 2) grad256_(xp, dz, H, W, 2, CI, CO, r0, r1, acc);
    else grad256_(xp, dz, H, W, 1, CI, CO, r0, r1, acc);
}

/* y (nb, OH, OW, CO) = the 3x3 convolution (stride S, padding pt, pl) of x (nb, H, W, CI) by
 * w (3, 3, CI, CO); xp scratch. */
static void conv3(int level, int H, int W, int S, int pt, int pl, int OH, int OW, int CI, int CO, const float *w,
                  const float *x, float *y, int64_t nb, float *xp)
{
    for (int64_t b = 0; b < nb; b++) {
        padp(x + b * (int64_t)H * W * CI, xp, H, W, CI, pt, pl, (OH - 1) * S + 3, (OW - 1) * S + 3);
        float *yb = y + b * (int64_t)OH * OW * CO;
        for (int oy = 0; oy < OH; oy++) {
            if (level == 2) row512(xp, OW, S, CI, CO, w, oy, yb + (int64_t)oy * OW * CO);
            else row256(xp, OW, S, CI, CO, w, oy, yb + (int64_t)oy * OW * CO);
        }
    }
}
#endif

void nn_conv3_forward_(const nn_layer_ *l, const float *w, const float *x, float *y, int64_t nb, float *scratch)
{
#if CF_HAVE
    conv3(l->fma, l->ih, l->iw, l->sh, l->pad_t, l->pad_l, l->oh, l->ow, l->cin, l->cout, w, x, y, nb, scratch);
#else
    (void)l, (void)w, (void)x, (void)y, (void)nb, (void)scratch;
    LOOM_ASSERT(!"nn_conv3_forward_ without nn_conv3_ok_");
#endif
}

void nn_conv3_backward_data_(const nn_layer_ *l, const float *w, const float *dz, float *dx, int64_t nb,
                             float *scratch)
{
#if CF_HAVE
    const int CI = l->cin, CO = l->cout;
    float *wt = scratch, *xp = scratch + 9 * (int64_t)CI * CO;
    /* wt (3, 3, CO, CI): tap (i, j) of the flipped kernel, transposed */
    for (int t = 0; t < 9; t++)
        for (int co = 0; co < CO; co++)
            for (int ci = 0; ci < CI; ci++)
                wt[((int64_t)t * CO + co) * CI + ci] = w[((int64_t)(8 - t) * CI + ci) * CO + co];
    LOOM_ASSERT(l->sh == 1); /* nn_conv3_dx_ok_ */
    conv3(l->fma, l->ih, l->iw, 1, 1, 1, l->ih, l->iw, CO, CI, wt, dz, dx, nb, xp);
#else
    (void)l, (void)w, (void)dz, (void)dx, (void)nb, (void)scratch;
    LOOM_ASSERT(!"nn_conv3_backward_data_ without nn_conv3_ok_");
#endif
}

void nn_conv3_kernel_grad_(const nn_layer_ *l, const float *x, const float *dz, int64_t nb, int r0, int r1, float *dW,
                           float *scratch)
{
#if CF_HAVE
    const int H = l->oh, W = l->ow, S = l->sh, CI = l->cin, CO = l->cout;
    float *xp = scratch, *acc = scratch + (int64_t)((H - 1) * S + 3) * ((W - 1) * S + 3) * CI;
    const int64_t n = (int64_t)(r1 - r0) * CO;
    float *restrict d = dW + (int64_t)r0 * CO;
    for (int64_t e = 0; e < n; e++) d[e] = 0.f;
    for (int64_t b = 0; b < nb; b++) { /* each example's sums, added in example order */
        pad_layer(l, x + b * l->n_in, xp);
        if (l->fma == 2) grad512(xp, dz + b * (int64_t)H * W * CO, H, W, S, CI, CO, r0, r1, acc);
        else grad256(xp, dz + b * (int64_t)H * W * CO, H, W, S, CI, CO, r0, r1, acc);
        for (int64_t e = 0; e < n; e++) d[e] += acc[e];
    }
#else
    (void)l, (void)x, (void)dz, (void)nb, (void)r0, (void)r1, (void)dW, (void)scratch;
    LOOM_ASSERT(!"nn_conv3_kernel_grad_ without nn_conv3_ok_");
#endif
}
