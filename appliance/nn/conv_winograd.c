/* conv_winograd.c - conv2d 5x5 and 3x3, stride 1, "same", by Winograd's F(2x2, 5x5) and F(4x4, 3x3):
 * the Fashion-MNIST CNN's second convolution (32 -> 64 on 14x14), ResNet-20's 3x3 convolutions (16, 32,
 * 64 channels on 28x28, 14x14, 7x7) and their like, forward and input gradient (3x3: kernel gradient too).
 * The direct kernels run these near the FMA peak (25 or 9 multiply-adds per output and channel pair);
 * here each 2x2 (5x5) or 4x4 (3x3) block of outputs takes 36 products per (input, output) channel pair,
 * 2.8x or 4x fewer, on 6x6 input tiles: V = B^T d B per tile and input channel, U = G g G^T per kernel
 * (once per call, in double), M[p] = V[p] U[p] for the 36 points p (independent (tiles x CI) . (CI x CO)
 * products, a register-blocked micro-kernel per ISA), Y = A^T M A. Both use the points 0, +-1, +-2 and
 * infinity, so B^T is the same 6x6 (|B| <= 5) and only G and A^T differ; A^T's entries reach 2 (5x5) or
 * 8 (3x3): fp32 results stay within ~4e-6 (5x5) and ~6e-6 (3x3) of the largest output of a double sum
 * (test_nn_conv). The input gradient is the same convolution of dz with the kernel flipped and
 * transposed. The 3x3 kernel gradient (nn_convw_kgrad_ok_; the 5x5's stays conv_direct.c's) is
 * G^T (sum over tiles of V (.) Z) G, Z = A dz A^T per tile: 36 products (CI x tiles) . (tiles x CO) over
 * the whole batch, summed in blocks of CW_KTB tiles then added, within ~7e-6 of the largest |dW| of a
 * double sum (ResNet-20's shapes at batch 64); its parts split the input channels (all 9 taps of each).
 * Bits: the transforms are one function for both ISAs (-ffp-contract=off: no FMA behind the
 * code's back) and each M element is one fused chain over the input channels in order (each S element
 * of the kernel gradient: one chain a block of CW_KTB tiles, the blocks added in order), so the AVX2 and AVX-512
 * kernels give the same bits, whatever the threads or the tile blocks. */
#include <string.h>

#include "nn_internal.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define CW_HAVE 1
#else
#define CW_HAVE 0
#endif

#define CW_MAX_C 256 /* channels in and out */
#define CW_TB    12 /* tiles per block: V (36 TB CI) and M (36 TB CO) stay in L2 (24: ~6% slower under perf) */
#define CW_P     36  /* points: 6 x 6 */
#define CW_KTB   12  /* the kernel gradient's tiles per block: S (36 CI CO) is read and written once a block */

int nn_convw_shape_ok_(const nn_layer_ *l)
{
    const int r = l->kh, pad = (r - 1) / 2;
    return (r == 3 || r == 5) && l->kw == r && l->sh == 1 && l->sw == 1 && l->pad_t == pad && l->pad_l == pad &&
           l->oh == l->ih && l->ow == l->iw && l->spec.dilation[0] <= 1 && l->spec.dilation[1] <= 1 &&
           l->spec.groups <= 1 && l->cin % 16 == 0 && l->cout % 16 == 0 && l->cin <= CW_MAX_C &&
           l->cout <= CW_MAX_C;
}

/* 3x3 under "auto": where it was measured to beat conv_fast.c's direct kernels, ResNet-20's shapes (loom profile
 * --train, batch 128, Zen 3 AVX2 under a CI run, alternated, medians of 3, the six layers of each stage summed;
 * direct -> Winograd, ms):
 *                   1 thread: forward, input gradient     2 threads: forward, input gradient
 *   16 -> 16, 28x28   39.0 -> 25.8, 44.0 -> 33.3              21.6 -> 14.8, 25.6 -> 20.7
 *   32 -> 32, 14x14   31.5 -> 16.9, 34.2 -> 19.9              16.6 -> 11.9, 18.0 -> 11.3
 *   64 -> 64,  7x7    35.8 -> 17.3, 38.0 -> 18.4              19.6 -> 13.7, 21.6 -> 14.3
 * Wider layers (im2col + GEMM there) and planes under 7x7 (a 4x4 tile mostly padding) were not measured. */
static int cw3_wins(const nn_layer_ *l) { return l->cin <= 64 && l->cout <= 64 && l->ih >= 7 && l->iw >= 7; }

/* The 3x3 kernel gradient under "auto": where it beat conv_fast.c's direct sums, 32 and 64 input channels
 * (one part of 2, half the input channels, batch 128, Zen 3 AVX2 under a CI run, alternated, medians of 7;
 * direct -> Winograd, ms): 16 -> 16 28x28 4.07 -> 4.61 (the transforms, dz's duplicated in each part, weigh
 * as much as the 36 products of 8 x 16 channels); 32 -> 32 14x14 4.16 -> 3.47; 64 -> 64 7x7 4.32 -> 3.24. */
static int cw3k_wins(const nn_layer_ *l) { return cw3_wins(l) && l->cin >= 32; }

int nn_convw_ok_(const nn_layer_ *l)
{
    return CW_HAVE && l->fma >= 1 && !l->direct && l->spec.algorithm != LOOM_CONV_DIRECT && nn_convw_shape_ok_(l) &&
           (l->kh == 5 || l->spec.algorithm == LOOM_CONV_WINOGRAD || cw3_wins(l));
}

int64_t nn_convw_scratch_(const nn_layer_ *l)
{
    const int64_t ci = l->cin, co = l->cout;
    const int64_t tb = CW_KTB > CW_TB ? CW_KTB : CW_TB;
    return CW_P * ci * co + CW_P * tb * (ci + co);
}

#if CW_HAVE
#define CW_512 __attribute__((target("avx512f,avx2,fma")))
#define CW_256 __attribute__((target("avx2,fma")))

/* G (6 x r) for the points 0, 1, -1, 2, -2, infinity: F(2x2, 5x5)'s and F(4x4, 3x3)'s */
static const double G5[6][5] = {{1. / 4, 0, 0, 0, 0},
                                {-1. / 6, -1. / 6, -1. / 6, -1. / 6, -1. / 6},
                                {-1. / 6, 1. / 6, -1. / 6, 1. / 6, -1. / 6},
                                {1. / 24, 1. / 12, 1. / 6, 1. / 3, 2. / 3},
                                {1. / 24, -1. / 12, 1. / 6, -1. / 3, 2. / 3},
                                {0, 0, 0, 0, 1}};
static const double G3[6][3] = {{1. / 4, 0, 0},
                                {-1. / 6, -1. / 6, -1. / 6},
                                {-1. / 6, 1. / 6, -1. / 6},
                                {1. / 24, 1. / 12, 1. / 6},
                                {1. / 24, -1. / 12, 1. / 6},
                                {0, 0, 1}};

/* U (36, CO, CI) from w (r, r, CI, CO) flipped and transposed when flip (the input gradient's
 * kernel), else U (36, CI, CO): G g G^T per channel pair, in double, rounded once. */
static void wtrans(const float *w, int r, int CI, int CO, int flip, float *U)
{
    const int IN = flip ? CO : CI, OUT = flip ? CI : CO;
    double G[6][5];
    for (int p = 0; p < 6; p++)
        for (int i = 0; i < r; i++) G[p][i] = r == 5 ? G5[p][i] : G3[p][i];
    for (int a = 0; a < IN; a++)
        for (int b = 0; b < OUT; b++) {
            double g[5][5], t[6][5];
            for (int i = 0; i < r; i++)
                for (int j = 0; j < r; j++)
                    g[i][j] = flip ? w[((int64_t)((r - 1 - i) * r + r - 1 - j) * CI + b) * CO + a]
                                   : w[((int64_t)(i * r + j) * CI + a) * CO + b];
            for (int p = 0; p < 6; p++)
                for (int j = 0; j < r; j++) {
                    double s = 0;
                    for (int i = 0; i < r; i++) s += G[p][i] * g[i][j];
                    t[p][j] = s;
                }
            for (int p = 0; p < 6; p++)
                for (int q = 0; q < 6; q++) {
                    double s = 0;
                    for (int j = 0; j < r; j++) s += t[p][j] * G[q][j];
                    U[((int64_t)(p * 6 + q) * IN + a) * OUT + b] = (float)s;
                }
        }
}

/* B^T applied to 6 vectors s[0..5] (8 channels each) into o[0..5] */
static inline __attribute__((always_inline)) CW_256 void bt6(__m256 *o, const __m256 *s)
{
    const __m256 two = _mm256_set1_ps(2.f), four = _mm256_set1_ps(4.f), five = _mm256_set1_ps(5.f);
    o[0] = _mm256_add_ps(_mm256_sub_ps(_mm256_mul_ps(four, s[0]), _mm256_mul_ps(five, s[2])), s[4]);
    o[1] = _mm256_sub_ps(_mm256_add_ps(s[3], s[4]), _mm256_mul_ps(four, _mm256_add_ps(s[1], s[2])));
    o[2] = _mm256_add_ps(_mm256_sub_ps(s[4], s[3]), _mm256_mul_ps(four, _mm256_sub_ps(s[1], s[2])));
    o[3] = _mm256_add_ps(_mm256_sub_ps(s[4], s[2]), _mm256_mul_ps(two, _mm256_sub_ps(s[3], s[1])));
    o[4] = _mm256_sub_ps(_mm256_sub_ps(s[4], s[2]), _mm256_mul_ps(two, _mm256_sub_ps(s[3], s[1])));
    o[5] = _mm256_add_ps(_mm256_sub_ps(_mm256_mul_ps(four, s[1]), _mm256_mul_ps(five, s[3])), s[5]);
}

/* Tile g of x (nb, H, W, C), m x m outputs: its 6x6 input (rows m ty - (6 - m) / 2 .., zeros outside), channels
 * [c0, c1) (multiples of 8), to V[p][slot] (36 points, tb slots of c1 - c0) = B^T d B, 8 channels at a time.
 * One function for both ISAs: the same bits. */
CW_256 static void itrans(const float *x, int m, int H, int W, int C, int c0, int c1, int64_t g, float *restrict V,
                          int slot, int tb)
{
    const int TH = (H + m - 1) / m, TW = (W + m - 1) / m, pad = (6 - m) / 2;
    const int64_t b = g / (TH * TW);
    const int ty = (int)(g % (TH * TW)) / TW, tx = (int)(g % (TH * TW)) % TW;
    const float *xb = x + b * H * W * C;
    const float *src[36];
    for (int i = 0; i < 6; i++)
        for (int j = 0; j < 6; j++) {
            int r = m * ty - pad + i, c = m * tx - pad + j;
            src[i * 6 + j] = r < 0 || r >= H || c < 0 || c >= W ? NULL : xb + ((int64_t)r * W + c) * C;
        }
    for (int ch = c0; ch < c1; ch += 8) {
        __m256 t[36], s[6], o[6];
        for (int j = 0; j < 6; j++) { /* columns: t = B^T d */
            for (int i = 0; i < 6; i++)
                s[i] = src[i * 6 + j] ? _mm256_loadu_ps(src[i * 6 + j] + ch) : _mm256_setzero_ps();
            bt6(o, s);
            for (int i = 0; i < 6; i++) t[i * 6 + j] = o[i];
        }
        for (int i = 0; i < 6; i++) { /* rows: t B */
            bt6(o, t + i * 6);
            for (int j = 0; j < 6; j++)
                _mm256_storeu_ps(V + ((int64_t)(i * 6 + j) * tb + slot) * (c1 - c0) + ch - c0, o[j]);
        }
    }
}

/* A^T on 6 vectors: o0 = s0 + s1 + s2 + s3 + s4, o1 = s1 - s2 + 2 (s3 - s4) + s5 */
static inline __attribute__((always_inline)) CW_256 void at6(__m256 *o0, __m256 *o1, const __m256 *s, int st)
{
    *o0 = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(s[0], s[st]), s[2 * st]), s[3 * st]), s[4 * st]);
    *o1 = _mm256_add_ps(_mm256_add_ps(_mm256_sub_ps(s[st], s[2 * st]),
                                      _mm256_mul_ps(_mm256_set1_ps(2.f), _mm256_sub_ps(s[3 * st], s[4 * st]))),
                        s[5 * st]);
}

/* A^T (4 x 6) on 6 vectors: F(4x4, 3x3)'s outputs at the points 0, +-1, +-2 and infinity */
static inline __attribute__((always_inline)) CW_256 void at4(__m256 *o, const __m256 *s, int st)
{
    const __m256 d1 = _mm256_sub_ps(s[st], s[2 * st]), e1 = _mm256_add_ps(s[st], s[2 * st]);
    const __m256 d2 = _mm256_sub_ps(s[3 * st], s[4 * st]), e2 = _mm256_add_ps(s[3 * st], s[4 * st]);
    o[0] = _mm256_add_ps(_mm256_add_ps(s[0], e1), e2);
    o[1] = _mm256_add_ps(d1, _mm256_mul_ps(_mm256_set1_ps(2.f), d2));
    o[2] = _mm256_add_ps(e1, _mm256_mul_ps(_mm256_set1_ps(4.f), e2));
    o[3] = _mm256_add_ps(_mm256_add_ps(d1, _mm256_mul_ps(_mm256_set1_ps(8.f), d2)), s[5 * st]);
}

/* Y (m x m) of tile g into y (nb, H, W, C) from M[p][slot] (36 points, TB slots of C): A^T M A; acc: added
 * to y (y + Y: the bits of Y written elsewhere, then added). */
CW_256 static void otrans(const float *restrict M, int slot, int m, int H, int W, int C, int64_t g, float *restrict y,
                          int acc)
{
    const int TH = (H + m - 1) / m, TW = (W + m - 1) / m;
    const int64_t b = g / (TH * TW);
    const int ty = (int)(g % (TH * TW)) / TW, tx = (int)(g % (TH * TW)) % TW;
    const int rows = H - m * ty < m ? H - m * ty : m, cols = W - m * tx < m ? W - m * tx : m;
    float *yb = y + (b * H * W + (int64_t)(m * ty) * W + m * tx) * C;
    for (int ch = 0; ch < C; ch += 8) {
        __m256 v[36], t[24], o[4];
        for (int p = 0; p < 36; p++) v[p] = _mm256_loadu_ps(M + ((int64_t)p * CW_TB + slot) * C + ch);
        if (m == 2) {
            for (int j = 0; j < 6; j++) at6(&t[j], &t[6 + j], v + j, 6); /* t (2, 6) = A^T v */
        } else {
            for (int j = 0; j < 6; j++) { /* t (4, 6) = A^T v */
                at4(o, v + j, 6);
                for (int i = 0; i < 4; i++) t[6 * i + j] = o[i];
            }
        }
        for (int i = 0; i < rows; i++) {
            if (m == 2) at6(&o[0], &o[1], t + 6 * i, 1);
            else at4(o, t + 6 * i, 1);
            for (int j = 0; j < cols; j++) {
                float *d = yb + ((int64_t)i * W + j) * C + ch;
                _mm256_storeu_ps(d, acc ? _mm256_add_ps(_mm256_loadu_ps(d), o[j]) : o[j]);
            }
        }
    }
}

/* T slots from v (slots of CI), out channels [c0, c0 + 16) of m (slots of CO): one fused chain
 * over the input channels per element. */
static inline __attribute__((always_inline)) CW_512 void mk512(int T, const float *restrict v, int CI, int CO,
                                                               const float *restrict u, int c0, float *restrict m)
{
    __m512 acc[12];
#pragma GCC unroll 12
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int ci = 0; ci < CI; ci++) {
        __m512 uv = _mm512_loadu_ps(u + (int64_t)ci * CO + c0);
#pragma GCC unroll 12
        for (int t = 0; t < T; t++) acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(v[(int64_t)t * CI + ci]), uv, acc[t]);
    }
#pragma GCC unroll 12
    for (int t = 0; t < T; t++) _mm512_storeu_ps(m + (int64_t)t * CO + c0, acc[t]);
}

static inline __attribute__((always_inline)) CW_256 void mk256(int T, const float *restrict v, int CI, int CO,
                                                               const float *restrict u, int c0, float *restrict m)
{
    __m256 lo[6], hi[6];
#pragma GCC unroll 6
    for (int t = 0; t < T; t++) lo[t] = hi[t] = _mm256_setzero_ps();
    for (int ci = 0; ci < CI; ci++) {
        __m256 ul = _mm256_loadu_ps(u + (int64_t)ci * CO + c0), uh = _mm256_loadu_ps(u + (int64_t)ci * CO + c0 + 8);
#pragma GCC unroll 6
        for (int t = 0; t < T; t++) {
            __m256 s = _mm256_broadcast_ss(v + (int64_t)t * CI + ci);
            lo[t] = _mm256_fmadd_ps(s, ul, lo[t]);
            hi[t] = _mm256_fmadd_ps(s, uh, hi[t]);
        }
    }
#pragma GCC unroll 6
    for (int t = 0; t < T; t++) {
        _mm256_storeu_ps(m + (int64_t)t * CO + c0, lo[t]);
        _mm256_storeu_ps(m + (int64_t)t * CO + c0 + 8, hi[t]);
    }
}

/* M[p] (n slots, CO) = V[p] (n, CI) U[p] (CI, CO) for the 36 points */
CW_512 static void prod512(const float *V, const float *U, int n, int CI, int CO, float *M)
{
    for (int p = 0; p < CW_P; p++) {
        const float *v = V + (int64_t)p * CW_TB * CI, *u = U + (int64_t)p * CI * CO;
        float *m = M + (int64_t)p * CW_TB * CO;
        for (int c0 = 0; c0 < CO; c0 += 16) {
            int t = 0;
            for (; t + 12 <= n; t += 12) mk512(12, v + (int64_t)t * CI, CI, CO, u, c0, m + (int64_t)t * CO);
            for (; t + 4 <= n; t += 4) mk512(4, v + (int64_t)t * CI, CI, CO, u, c0, m + (int64_t)t * CO);
            for (; t < n; t++) mk512(1, v + (int64_t)t * CI, CI, CO, u, c0, m + (int64_t)t * CO);
        }
    }
}

CW_256 static void prod256(const float *V, const float *U, int n, int CI, int CO, float *M)
{
    for (int p = 0; p < CW_P; p++) {
        const float *v = V + (int64_t)p * CW_TB * CI, *u = U + (int64_t)p * CI * CO;
        float *m = M + (int64_t)p * CW_TB * CO;
        for (int c0 = 0; c0 < CO; c0 += 16) {
            int t = 0;
            for (; t + 6 <= n; t += 6) mk256(6, v + (int64_t)t * CI, CI, CO, u, c0, m + (int64_t)t * CO);
            for (; t + 2 <= n; t += 2) mk256(2, v + (int64_t)t * CI, CI, CO, u, c0, m + (int64_t)t * CO);
            for (; t < n; t++) mk256(1, v + (int64_t)t * CI, CI, CO, u, c0, m + (int64_t)t * CO);
        }
    }
}

/* y (nb, H, W, CO) = (acc: y +) the r x r "same" convolution of x (nb, H, W, CI) whose kernel U holds
 * transformed (m = 7 - r outputs a tile side); s: scratch after U. Tiles go in blocks of CW_TB over the whole
 * chunk, examples one after another. */
static void convw(int level, int r, int H, int W, int CI, int CO, const float *U, const float *x, float *y, int64_t nb,
                  float *s, int acc)
{
    float *V = s, *M = V + (int64_t)CW_P * CW_TB * CI;
    const int m = 7 - r;
    const int64_t tiles = nb * ((H + m - 1) / m) * ((W + m - 1) / m);
    for (int64_t g0 = 0; g0 < tiles; g0 += CW_TB) {
        const int n = tiles - g0 < CW_TB ? (int)(tiles - g0) : CW_TB;
        for (int t = 0; t < n; t++) itrans(x, m, H, W, CI, 0, CI, g0 + t, V, t, CW_TB);
        if (level == 2) prod512(V, U, n, CI, CO, M);
        else prod256(V, U, n, CI, CO, M);
        for (int t = 0; t < n; t++) otrans(M, t, m, H, W, CO, g0 + t, y, acc);
    }
}

/* ---- the kernel gradient, F(4x4, 3x3) ----
 * Y = A^T (U (.) V) A per tile, summed over the input channels, is linear in U = G g G^T: dL/dU[p] (CI, CO) =
 * the sum over tiles of V[p] (CI) times Z[p] (CO), Z = A dz A^T the tile's 4x4 output gradient (zeros past the
 * plane) lifted to 6x6, and dL/dg = G^T (dL/dU) G. So S[p] = V[p]^T Z[p] over every tile of the batch (36
 * products (CI x tiles) . (tiles x CO), each S element one fused chain over the tiles in order), then
 * G^T S G per channel pair in double. */

/* A (6 x 4) on 4 vectors: z0 = s0, z1,2 = (s0 + s2) +- (s1 + s3), z3,4 = (s0 + 4 s2) +- (2 s1 + 8 s3), z5 = s3 */
static inline __attribute__((always_inline)) CW_256 void a4(__m256 *o, const __m256 *s, int st)
{
    const __m256 e = _mm256_add_ps(s[0], s[2 * st]), f = _mm256_add_ps(s[st], s[3 * st]);
    const __m256 e4 = _mm256_add_ps(s[0], _mm256_mul_ps(_mm256_set1_ps(4.f), s[2 * st]));
    const __m256 f2 = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(2.f), s[st]),
                                    _mm256_mul_ps(_mm256_set1_ps(8.f), s[3 * st]));
    o[0] = s[0];
    o[1] = _mm256_add_ps(e, f);
    o[2] = _mm256_sub_ps(e, f);
    o[3] = _mm256_add_ps(e4, f2);
    o[4] = _mm256_sub_ps(e4, f2);
    o[5] = s[3 * st];
}

/* Tile g of dz (nb, H, W, C): its 4x4 outputs (zeros past the plane) to Z[p][slot] (36 points, tb slots of
 * C) = A dz A^T, 8 channels at a time; one function for both ISAs. */
CW_256 static void ztrans(const float *dz, int H, int W, int C, int64_t g, float *restrict Z, int slot, int tb)
{
    const int TH = (H + 3) / 4, TW = (W + 3) / 4;
    const int64_t b = g / (TH * TW);
    const int ty = (int)(g % (TH * TW)) / TW, tx = (int)(g % (TH * TW)) % TW;
    const float *db = dz + b * H * W * C;
    const float *src[16];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) {
            int r = 4 * ty + i, c = 4 * tx + j;
            src[i * 4 + j] = r >= H || c >= W ? NULL : db + ((int64_t)r * W + c) * C;
        }
    for (int ch = 0; ch < C; ch += 8) {
        __m256 s[16], t[24], o[6];
        for (int k = 0; k < 16; k++) s[k] = src[k] ? _mm256_loadu_ps(src[k] + ch) : _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) { /* columns: t (6, 4) = A dz */
            a4(o, s + j, 4);
            for (int i = 0; i < 6; i++) t[i * 4 + j] = o[i];
        }
        for (int i = 0; i < 6; i++) { /* rows: t A^T */
            a4(o, t + i * 4, 1);
            for (int j = 0; j < 6; j++) _mm256_storeu_ps(Z + ((int64_t)(i * 6 + j) * tb + slot) * C + ch, o[j]);
        }
    }
}

/* s rows [0, R) (of CO), columns [c0, c0 + 16) += v^T z over n tiles: v (n, cp) from its row 0, z (n, CO); the
 * block's sum (one fused chain over its tiles in order) then added to s, so the long sums go in two levels */
static inline __attribute__((always_inline)) CW_512 void kk512(int R, int n, const float *restrict v, int cp,
                                                               const float *restrict z, int CO, int c0,
                                                               float *restrict s)
{
    __m512 acc[12];
#pragma GCC unroll 12
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int t = 0; t < n; t++) {
        __m512 zv = _mm512_loadu_ps(z + (int64_t)t * CO + c0);
#pragma GCC unroll 12
        for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(v[(int64_t)t * cp + r]), zv, acc[r]);
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; r++)
        _mm512_storeu_ps(s + (int64_t)r * CO + c0, _mm512_add_ps(_mm512_loadu_ps(s + (int64_t)r * CO + c0), acc[r]));
}

static inline __attribute__((always_inline)) CW_256 void kk256(int R, int n, const float *restrict v, int cp,
                                                               const float *restrict z, int CO, int c0,
                                                               float *restrict s)
{
    __m256 lo[6], hi[6];
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int t = 0; t < n; t++) {
        __m256 zl = _mm256_loadu_ps(z + (int64_t)t * CO + c0), zh = _mm256_loadu_ps(z + (int64_t)t * CO + c0 + 8);
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            __m256 b = _mm256_broadcast_ss(v + (int64_t)t * cp + r);
            lo[r] = _mm256_fmadd_ps(b, zl, lo[r]);
            hi[r] = _mm256_fmadd_ps(b, zh, hi[r]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) {
        float *sr = s + (int64_t)r * CO + c0;
        _mm256_storeu_ps(sr, _mm256_add_ps(_mm256_loadu_ps(sr), lo[r]));
        _mm256_storeu_ps(sr + 8, _mm256_add_ps(_mm256_loadu_ps(sr + 8), hi[r]));
    }
}

/* S[p] (cp, CO) += V[p]^T (cp, n) Z[p] (n, CO) for the 36 points (V, Z: tb slots a point) */
CW_512 static void kprod512(const float *V, const float *Z, int n, int tb, int cp, int CO, float *S)
{
    for (int p = 0; p < CW_P; p++) {
        const float *v = V + (int64_t)p * tb * cp, *z = Z + (int64_t)p * tb * CO;
        float *s = S + (int64_t)p * cp * CO;
        for (int c0 = 0; c0 < CO; c0 += 16) {
            int r = 0;
            for (; r + 12 <= cp; r += 12) kk512(12, n, v + r, cp, z, CO, c0, s + (int64_t)r * CO);
            for (; r + 4 <= cp; r += 4) kk512(4, n, v + r, cp, z, CO, c0, s + (int64_t)r * CO);
            for (; r < cp; r++) kk512(1, n, v + r, cp, z, CO, c0, s + (int64_t)r * CO);
        }
    }
}

CW_256 static void kprod256(const float *V, const float *Z, int n, int tb, int cp, int CO, float *S)
{
    for (int p = 0; p < CW_P; p++) {
        const float *v = V + (int64_t)p * tb * cp, *z = Z + (int64_t)p * tb * CO;
        float *s = S + (int64_t)p * cp * CO;
        for (int c0 = 0; c0 < CO; c0 += 16) {
            int r = 0;
            for (; r + 6 <= cp; r += 6) kk256(6, n, v + r, cp, z, CO, c0, s + (int64_t)r * CO);
            for (; r + 2 <= cp; r += 2) kk256(2, n, v + r, cp, z, CO, c0, s + (int64_t)r * CO);
            for (; r < cp; r++) kk256(1, n, v + r, cp, z, CO, c0, s + (int64_t)r * CO);
        }
    }
}

/* dW rows (tap, c0 .. c1) of (9 CI, CO) from x (nb, H, W, CI) and dz (nb, H, W, CO); s: scratch of
 * 36 (c1 - c0) CO + 36 CW_KTB (c1 - c0 + CO) floats. The tiles go in blocks of CW_KTB over the whole batch. */
static void convw_kgrad(int level, int H, int W, int CI, int c0, int c1, int CO, const float *x, const float *dz,
                        int64_t nb, float *dW, float *s)
{
    const int cp = c1 - c0;
    float *S = s, *V = S + (int64_t)CW_P * cp * CO, *Z = V + (int64_t)CW_P * CW_KTB * cp;
    const int64_t tiles = nb * ((H + 3) / 4) * ((W + 3) / 4);
    memset(S, 0, (size_t)CW_P * cp * CO * sizeof *S);
    for (int64_t g0 = 0; g0 < tiles; g0 += CW_KTB) {
        const int n = tiles - g0 < CW_KTB ? (int)(tiles - g0) : CW_KTB;
        for (int t = 0; t < n; t++) {
            itrans(x, 4, H, W, CI, c0, c1, g0 + t, V, t, CW_KTB);
            ztrans(dz, H, W, CO, g0 + t, Z, t, CW_KTB);
        }
        if (level == 2) kprod512(V, Z, n, CW_KTB, cp, CO, S);
        else kprod256(V, Z, n, CW_KTB, cp, CO, S);
    }
    for (int a = 0; a < cp; a++) /* dg = G^T S G, in double */
        for (int b = 0; b < CO; b++) {
            double t[3][6];
            for (int i = 0; i < 3; i++)
                for (int q = 0; q < 6; q++) {
                    double u = 0;
                    for (int p = 0; p < 6; p++)
                        u += G3[p][i] * (double)S[((int64_t)(p * 6 + q) * cp + a) * CO + b];
                    t[i][q] = u;
                }
            for (int i = 0; i < 3; i++)
                for (int j = 0; j < 3; j++) {
                    double u = 0;
                    for (int q = 0; q < 6; q++) u += t[i][q] * G3[q][j];
                    dW[((int64_t)(i * 3 + j) * CI + c0 + a) * CO + b] = (float)u;
                }
        }
}
#endif

void nn_convw_kernel_(const nn_layer_ *l, const float *w, float *scratch)
{
#if CW_HAVE
    wtrans(w, l->kh, l->cin, l->cout, 0, scratch);
#else
    (void)l, (void)w, (void)scratch;
    LOOM_ASSERT(!"nn_convw_kernel_ without nn_convw_ok_");
#endif
}

void nn_convw_forward_(const nn_layer_ *l, const float *x, float *y, int64_t nb, float *scratch)
{
#if CW_HAVE
    convw(l->fma, l->kh, l->ih, l->iw, l->cin, l->cout, scratch, x, y, nb,
          scratch + (int64_t)CW_P * l->cin * l->cout, 0);
#else
    (void)l, (void)x, (void)y, (void)nb, (void)scratch;
    LOOM_ASSERT(!"nn_convw_forward_ without nn_convw_ok_");
#endif
}

void nn_convw_backward_data_(const nn_layer_ *l, const float *w, const float *dz, float *dx, int64_t nb,
                             float *scratch, int acc)
{
#if CW_HAVE
    wtrans(w, l->kh, l->cin, l->cout, 1, scratch);
    convw(l->fma, l->kh, l->ih, l->iw, l->cout, l->cin, scratch, dz, dx, nb,
          scratch + (int64_t)CW_P * l->cin * l->cout, acc);
#else
    (void)l, (void)w, (void)dz, (void)dx, (void)nb, (void)scratch, (void)acc;
    LOOM_ASSERT(!"nn_convw_backward_data_ without nn_convw_ok_");
#endif
}

int nn_convw_kgrad_ok_(const nn_layer_ *l)
{
    return nn_convw_ok_(l) && l->kh == 3 && (l->spec.algorithm == LOOM_CONV_WINOGRAD || cw3k_wins(l));
}

void nn_convw_kernel_grad_(const nn_layer_ *l, const float *x, const float *dz, int64_t nb, int c0, int c1, float *dW,
                           float *scratch)
{
#if CW_HAVE
    LOOM_ASSERT(c0 % 8 == 0 && c1 % 8 == 0 && c0 < c1 && c1 <= l->cin);
    convw_kgrad(l->fma, l->ih, l->iw, l->cin, c0, c1, l->cout, x, dz, nb, dW, scratch);
#else
    (void)l, (void)x, (void)dz, (void)nb, (void)c0, (void)c1, (void)dW, (void)scratch;
    LOOM_ASSERT(!"nn_convw_kernel_grad_ without nn_convw_kgrad_ok_");
#endif
}
