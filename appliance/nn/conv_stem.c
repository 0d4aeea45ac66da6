/* conv_stem.c - conv2d on 2-4 input channels with no padding of its own (ResNet-50's 7x7 stride-2 stem after its
 * zero_padding2d), direct: no im2col. There im2col writes kh*kw*cin floats (147) per output pixel in rows of kw*cin
 * (21) floats, and BLAS packs them again for a product only cout (64) wide; its weight gradient builds the same
 * columns again. Here each tap row of the input is read in place: a tile of output pixels keeps its output channels
 * in registers over the (kernel row, kw*cin) taps, and the weight gradient keeps a tile of kernel rows' channels in
 * registers over one output row of pixels at a time, the dz row staying in L1, then adds that row's sum into dW.
 * Bits: every output element is one fused multiply-add chain in (kernel row, tap) order from zero, every weight
 * gradient element the sum in (example, row) order of each output row's chain over its pixels from zero, so they do
 * not depend on the threads, the chunking, the part split or the vector width (the AVX2 and AVX-512 kernels compute
 * the same chains).
 * The input gradient (a layer after another) stays on GEMM + col2im. Threads: a call writes only its rows. */
#include <string.h>

#include "nn_internal.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define CS_HAVE 1
#else
#define CS_HAVE 0
#endif

int nn_convs_ok_(const nn_layer_ *l)
{
    return CS_HAVE && l->fma >= 1 && !l->direct && !l->fuse_pool && l->cin >= 2 && l->cin <= 4 &&
           l->cout % 16 == 0 && l->pad_t == 0 && l->pad_l == 0 && (int64_t)(l->oh - 1) * l->sh + l->kh <= l->ih &&
           (int64_t)(l->ow - 1) * l->sw + l->kw <= l->iw;
}

#if CS_HAVE
#define CS_512 __attribute__((target("avx512f,avx2,fma")))
#define CS_256 __attribute__((target("avx2,fma")))
#define CS_T 6 /* pixels (forward) or kernel taps (weight gradient) per tile */

/* The geometry both passes walk: a kernel row is KR = kw*cin contiguous floats of an input row. */
typedef struct cs_geo {
    int     KH, KR, CO, OH, OW;
    int64_t rw, px, img; /* floats per input row, between neighbouring output pixels' windows, per example */
} cs_geo;

static cs_geo geo_of(const nn_layer_ *l)
{
    return (cs_geo){l->kh, l->kw * l->cin, l->cout, l->oh, l->ow, (int64_t)l->iw * l->cin, (int64_t)l->sw * l->cin,
                    (int64_t)l->ih * l->iw * l->cin};
}

/* T output pixels from x (their first window's top-left), NB blocks of 16 channels from c0 of w (KH*KR, CO). */
static inline __attribute__((always_inline)) CS_512 void fwd512(int T, int NB, const cs_geo *g, const float *restrict x,
                                                                const float *restrict w, int c0, float *restrict y)
{
    __m512 acc[CS_T * 4];
#pragma GCC unroll 24
    for (int a = 0; a < T * NB; a++) acc[a] = _mm512_setzero_ps();
    for (int i = 0; i < g->KH; i++) {
        const float *xr = x + i * g->rw, *wr = w + (int64_t)i * g->KR * g->CO + c0;
        for (int r = 0; r < g->KR; r++) {
            __m512 wv[4];
#pragma GCC unroll 4
            for (int n = 0; n < NB; n++) wv[n] = _mm512_loadu_ps(wr + (int64_t)r * g->CO + 16 * n);
#pragma GCC unroll 6
            for (int t = 0; t < T; t++) {
                __m512 xv = _mm512_set1_ps(xr[t * g->px + r]);
#pragma GCC unroll 4
                for (int n = 0; n < NB; n++) acc[t * NB + n] = _mm512_fmadd_ps(xv, wv[n], acc[t * NB + n]);
            }
        }
    }
#pragma GCC unroll 6
    for (int t = 0; t < T; t++)
#pragma GCC unroll 4
        for (int n = 0; n < NB; n++) _mm512_storeu_ps(y + (int64_t)t * g->CO + c0 + 16 * n, acc[t * NB + n]);
}

/* The same chains 8 lanes wide: T pixels, one block of 16 channels (two registers). */
static inline __attribute__((always_inline)) CS_256 void fwd256(int T, const cs_geo *g, const float *restrict x,
                                                                const float *restrict w, int c0, float *restrict y)
{
    __m256 acc[CS_T * 2];
#pragma GCC unroll 12
    for (int a = 0; a < 2 * T; a++) acc[a] = _mm256_setzero_ps();
    for (int i = 0; i < g->KH; i++) {
        const float *xr = x + i * g->rw, *wr = w + (int64_t)i * g->KR * g->CO + c0;
        for (int r = 0; r < g->KR; r++) {
            __m256 w0 = _mm256_loadu_ps(wr + (int64_t)r * g->CO), w1 = _mm256_loadu_ps(wr + (int64_t)r * g->CO + 8);
#pragma GCC unroll 6
            for (int t = 0; t < T; t++) {
                __m256 xv = _mm256_broadcast_ss(xr + t * g->px + r);
                acc[2 * t] = _mm256_fmadd_ps(xv, w0, acc[2 * t]);
                acc[2 * t + 1] = _mm256_fmadd_ps(xv, w1, acc[2 * t + 1]);
            }
        }
    }
#pragma GCC unroll 6
    for (int t = 0; t < T; t++) {
        _mm256_storeu_ps(y + (int64_t)t * g->CO + c0, acc[2 * t]);
        _mm256_storeu_ps(y + (int64_t)t * g->CO + c0 + 8, acc[2 * t + 1]);
    }
}

/* One output row of OW pixels at x (its first window), all CO channels, tiles of CS_T pixels. */
static CS_512 void row512(const cs_geo *g, const float *restrict x, const float *restrict w, float *restrict y)
{
    for (int c0 = 0; c0 < g->CO; c0 += 64) {
        const int nb = (g->CO - c0) / 16 < 4 ? (g->CO - c0) / 16 : 4;
        int ox = 0;
        for (; ox + CS_T <= g->OW; ox += CS_T) {
            const float *xo = x + ox * g->px;
            float *yo = y + (int64_t)ox * g->CO;
            if (nb == 4) fwd512(CS_T, 4, g, xo, w, c0, yo);
            else if (nb == 3) fwd512(CS_T, 3, g, xo, w, c0, yo);
            else if (nb == 2) fwd512(CS_T, 2, g, xo, w, c0, yo);
            else fwd512(CS_T, 1, g, xo, w, c0, yo);
        }
        for (; ox < g->OW; ox++) {
            const float *xo = x + ox * g->px;
            float *yo = y + (int64_t)ox * g->CO;
            if (nb == 4) fwd512(1, 4, g, xo, w, c0, yo);
            else if (nb == 3) fwd512(1, 3, g, xo, w, c0, yo);
            else if (nb == 2) fwd512(1, 2, g, xo, w, c0, yo);
            else fwd512(1, 1, g, xo, w, c0, yo);
        }
    }
}

static CS_256 void row256(const cs_geo *g, const float *restrict x, const float *restrict w, float *restrict y)
{
    for (int c0 = 0; c0 < g->CO; c0 += 16) {
        int ox = 0;
        for (; ox + CS_T <= g->OW; ox += CS_T) fwd256(CS_T, g, x + ox * g->px, w, c0, y + (int64_t)ox * g->CO);
        for (; ox < g->OW; ox++) fwd256(1, g, x + ox * g->px, w, c0, y + (int64_t)ox * g->CO);
    }
}

/* Weight gradient rows k0 + [0, R) (taps r0 + [0, R) of kernel row i: contiguous in an input row), NB blocks of 16
 * channels from c0, += the sum over one output row's OW pixels (a chain from zero, then one add into dw: two levels,
 * as BLAS blocks its long sums, so 400k pixels do not run up one chain's rounding): x at the row's first window's
 * kernel row i, dz its rows. */
static inline __attribute__((always_inline)) CS_512 void wgt512(int R, int NB, const cs_geo *g, const float *restrict x,
                                                                const float *restrict dz, int c0, float *restrict dw)
{
    __m512 acc[CS_T * 4];
#pragma GCC unroll 6
    for (int t = 0; t < R; t++)
#pragma GCC unroll 4
        for (int n = 0; n < NB; n++) acc[t * NB + n] = _mm512_setzero_ps();
    for (int ox = 0; ox < g->OW; ox++) {
        const float *xo = x + ox * g->px, *d = dz + (int64_t)ox * g->CO + c0;
        __m512 dv[4];
#pragma GCC unroll 4
        for (int n = 0; n < NB; n++) dv[n] = _mm512_loadu_ps(d + 16 * n);
#pragma GCC unroll 6
        for (int t = 0; t < R; t++) {
            __m512 xv = _mm512_set1_ps(xo[t]);
#pragma GCC unroll 4
            for (int n = 0; n < NB; n++) acc[t * NB + n] = _mm512_fmadd_ps(xv, dv[n], acc[t * NB + n]);
        }
    }
#pragma GCC unroll 6
    for (int t = 0; t < R; t++)
#pragma GCC unroll 4
        for (int n = 0; n < NB; n++) {
            float *d = dw + (int64_t)t * g->CO + c0 + 16 * n;
            _mm512_storeu_ps(d, _mm512_add_ps(_mm512_loadu_ps(d), acc[t * NB + n]));
        }
}

static inline __attribute__((always_inline)) CS_256 void wgt256(int R, const cs_geo *g, const float *restrict x,
                                                                const float *restrict dz, int c0, float *restrict dw)
{
    __m256 acc[CS_T * 2];
#pragma GCC unroll 6
    for (int t = 0; t < R; t++) {
        acc[2 * t] = _mm256_setzero_ps();
        acc[2 * t + 1] = _mm256_setzero_ps();
    }
    for (int ox = 0; ox < g->OW; ox++) {
        const float *xo = x + ox * g->px, *d = dz + (int64_t)ox * g->CO + c0;
        __m256 d0 = _mm256_loadu_ps(d), d1 = _mm256_loadu_ps(d + 8);
#pragma GCC unroll 6
        for (int t = 0; t < R; t++) {
            __m256 xv = _mm256_broadcast_ss(xo + t);
            acc[2 * t] = _mm256_fmadd_ps(xv, d0, acc[2 * t]);
            acc[2 * t + 1] = _mm256_fmadd_ps(xv, d1, acc[2 * t + 1]);
        }
    }
#pragma GCC unroll 6
    for (int t = 0; t < R; t++) {
        float *d = dw + (int64_t)t * g->CO + c0;
        _mm256_storeu_ps(d, _mm256_add_ps(_mm256_loadu_ps(d), acc[2 * t]));
        _mm256_storeu_ps(d + 8, _mm256_add_ps(_mm256_loadu_ps(d + 8), acc[2 * t + 1]));
    }
}

/* wgt512 with R (1 to CS_T) and NB (1 or 4) as constants. */
static CS_512 void wgt512_r(int R, int NB, const cs_geo *g, const float *x, const float *dz, int c0, float *dw)
{
#define CS_W(r)                                                                                                        \
    case r:                                                                                                            \
        if (NB == 4) wgt512(r, 4, g, x, dz, c0, dw);                                                                   \
        else wgt512(r, 1, g, x, dz, c0, dw);                                                                           \
        break;
    switch (R) {
        CS_W(1) CS_W(2) CS_W(3) CS_W(4) CS_W(5) CS_W(6)
    }
#undef CS_W
}

/* Rows [k0, k1) of dw (KH*KR, CO) += one output row: x its first window, dz its OW rows. */
static CS_512 void wrow512(const cs_geo *g, const float *restrict x, const float *restrict dz, int k0, int k1,
                           float *restrict dw)
{
    for (int k = k0; k < k1;) {
        const int i = k / g->KR, r = k % g->KR, R0 = g->KR - r < k1 - k ? g->KR - r : k1 - k;
        const int R = R0 < CS_T ? R0 : CS_T;
        const float *xi = x + i * g->rw + r;
        float *d = dw + (int64_t)k * g->CO;
        for (int c0 = 0; c0 < g->CO; c0 += 64) {
            const int nb = (g->CO - c0) / 16 < 4 ? (g->CO - c0) / 16 : 4;
            if (nb == 4) wgt512_r(R, 4, g, xi, dz, c0, d);
            else
                for (int n = 0; n < nb; n++) wgt512_r(R, 1, g, xi, dz, c0 + 16 * n, d);
        }
        k += R;
    }
}

static CS_256 void wrow256(const cs_geo *g, const float *restrict x, const float *restrict dz, int k0, int k1,
                           float *restrict dw)
{
    for (int k = k0; k < k1;) {
        const int i = k / g->KR, r = k % g->KR, R0 = g->KR - r < k1 - k ? g->KR - r : k1 - k;
        const int R = R0 < CS_T ? R0 : CS_T;
        const float *xi = x + i * g->rw + r;
        float *d = dw + (int64_t)k * g->CO;
        for (int c0 = 0; c0 < g->CO; c0 += 16) {
            switch (R) {
            case 6: wgt256(6, g, xi, dz, c0, d); break;
            case 5: wgt256(5, g, xi, dz, c0, d); break;
            case 4: wgt256(4, g, xi, dz, c0, d); break;
            case 3: wgt256(3, g, xi, dz, c0, d); break;
            case 2: wgt256(2, g, xi, dz, c0, d); break;
            default: wgt256(1, g, xi, dz, c0, d); break;
            }
        }
        k += R;
    }
}
#endif

/* y (nb, OH, OW, cout) = conv(x (nb, H, W, cin)) without bias; w (kh, kw, cin, cout). */
void nn_convs_forward_(const nn_layer_ *l, const float *w, const float *x, float *y, int64_t nb)
{
#if CS_HAVE
    const cs_geo g = geo_of(l);
    const int64_t orow = (int64_t)g.OW * g.CO, step = (int64_t)l->sh * g.rw;
    for (int64_t b = 0; b < nb; b++)
        for (int oy = 0; oy < g.OH; oy++) {
            const float *xr = x + b * g.img + oy * step;
            float *yr = y + (b * g.OH + oy) * orow;
            if (l->fma == 2) row512(&g, xr, w, yr);
            else row256(&g, xr, w, yr);
        }
#else
    (void)l, (void)w, (void)x, (void)y, (void)nb;
#endif
}

/* dw rows [k0, k1) of (kh*kw*cin, cout) = sum over the B examples' pixels of x's taps times dz (B, OH, OW, cout). */
void nn_convs_kernel_grad_(const nn_layer_ *l, const float *x, const float *dz, int64_t B, int k0, int k1, float *dw)
{
#if CS_HAVE
    const cs_geo g = geo_of(l);
    const int64_t orow = (int64_t)g.OW * g.CO, step = (int64_t)l->sh * g.rw;
    memset(dw + (int64_t)k0 * g.CO, 0, (size_t)(k1 - k0) * g.CO * sizeof *dw);
    for (int64_t b = 0; b < B; b++)
        for (int oy = 0; oy < g.OH; oy++) {
            const float *xr = x + b * g.img + oy * step, *dr = dz + (b * g.OH + oy) * orow;
            if (l->fma == 2) wrow512(&g, xr, dr, k0, k1, dw);
            else wrow256(&g, xr, dr, k0, k1, dw);
        }
#else
    (void)l, (void)x, (void)dz, (void)B, (void)k0, (void)k1, (void)dw;
#endif
}
