/* conv_wide.c - the kernel gradient of a 1x1 conv2d without padding (stride 1 or 2), 16-512 channels (ResNet-50's
 * pointwise convolutions of its first two stages), direct: dW (cin, cout) = sum over the output pixels p of
 * x(p)^T dz(p), an outer product per pixel read in place from the NHWC rows (a stride-2 one gathers nothing). On GEMM
 * these products have M or N of 32-256 and K = batch x pixels (100k at 56x56), and OpenBLAS packs both operands.
 * Here the x of 6 kernel rows over a block of 32 output pixels is packed (one stream for the broadcasts), then a
 * tile of those 6 rows x 64 (AVX-512) or 16 (AVX2) output channels stays in registers over the block, whose dz rows
 * stay in L1 over the channel tiles, and adds into dW.
 * Bits: each dW element is the sum in (example, pixel block) order of each block's fused multiply-add chain over its
 * pixels from zero, whatever the threads, the part split, the tiling or the vector width.
 * Threads: a call writes only its rows [k0, k1) of dW.
 * Speed (tests/bench/conv_wide_bench.c, CPU time on a loaded machine, against OpenBLAS's TN sgemm): 0.9-1.25x on
 * AVX-512, 0.83-1.12x on AVX2 shape by shape; it wins on the stride-2 ones on AVX-512, which GEMM first gathers, and
 * layers.c takes it for those only (nn_convp_grad_ok_). */
#include <string.h>

#include "nn_internal.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define CW_HAVE 1
#else
#define CW_HAVE 0
#endif
#define CW_MAX_C 512 /* wider (ResNet-50's last two stages): OpenBLAS's products run near its peak */
#define CW_NP 32     /* pixels per chain: a block's dz for up to 256 channels (32 KB) stays near L1 over the kernel rows */

int nn_convp_ok_(const nn_layer_ *l)
{
    return CW_HAVE && l->fma >= 1 && !l->direct && !l->fuse_pool && l->kh == 1 && l->kw == 1 && l->pad_t == 0 &&
           l->pad_l == 0 && l->cout % 16 == 0 && l->cin >= 16 && l->cin <= CW_MAX_C && l->cout <= CW_MAX_C &&
           (int64_t)(l->oh - 1) * l->sh < l->ih && (int64_t)(l->ow - 1) * l->sw < l->iw;
}

/* Where layers.c takes it: the stride-2 ones on AVX-512, whose GEMM first gathers the input rows (conv_wide_bench:
 * 1.0-1.2x OpenBLAS; in a training step of 256 -> 512 and 512 -> 256 at batch 32, `loom profile --train`'s weights
 * rows 1.6-1.8x faster). On AVX2 the two ran even (0.97-1.12x; in the step 0.4-1.0x and 0.8-1.4x under the load), and
 * at stride 1 on both (0.8-1.25x shape by shape): those stay on GEMM. */
int nn_convp_grad_ok_(const nn_layer_ *l) { return nn_convp_ok_(l) && l->fma == 2 && l->sh == 2 && l->sw == 2; }

#if CW_HAVE
#define CW_512 __attribute__((target("avx512f,avx2,fma")))
#define CW_256 __attribute__((target("avx2,fma")))

/* One block of n pixels: pixel j's TK kernel rows at xt + j TK (packed), its dz row at g + j CO (NV blocks of 16
 * channels from there); dw (TK, CO) += each element's chain over the n pixels. */
static inline __attribute__((always_inline)) CW_512 void tile512(int TK, int NV, const float *restrict xt,
                                                                 const float *restrict g, int CO, int n,
                                                                 float *restrict dw)
{
    __m512 acc[24];
#pragma GCC unroll 24
    for (int a = 0; a < TK * NV; a++) acc[a] = _mm512_setzero_ps();
    for (int j = 0; j < n; j++) {
        const float *xp = xt + j * TK, *gp = g + (int64_t)j * CO;
        __m512 gv[4];
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) gv[v] = _mm512_loadu_ps(gp + 16 * v);
#pragma GCC unroll 6
        for (int i = 0; i < TK; i++) {
            __m512 s = _mm512_set1_ps(xp[i]);
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) acc[i * NV + v] = _mm512_fmadd_ps(s, gv[v], acc[i * NV + v]);
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < TK; i++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) {
            float *d = dw + (int64_t)i * CO + 16 * v;
            _mm512_storeu_ps(d, _mm512_add_ps(_mm512_loadu_ps(d), acc[i * NV + v]));
        }
}

/* The same chains 8 lanes wide: TK kernel rows, one block of 16 channels (two registers). */
static inline __attribute__((always_inline)) CW_256 void tile256(int TK, const float *restrict xt,
                                                                 const float *restrict g, int CO, int n,
                                                                 float *restrict dw)
{
    __m256 acc[12];
#pragma GCC unroll 12
    for (int a = 0; a < 2 * TK; a++) acc[a] = _mm256_setzero_ps();
    for (int j = 0; j < n; j++) {
        const float *xp = xt + j * TK, *gp = g + (int64_t)j * CO;
        __m256 g0 = _mm256_loadu_ps(gp), g1 = _mm256_loadu_ps(gp + 8);
#pragma GCC unroll 6
        for (int i = 0; i < TK; i++) {
            __m256 s = _mm256_set1_ps(xp[i]);
            acc[2 * i] = _mm256_fmadd_ps(s, g0, acc[2 * i]);
            acc[2 * i + 1] = _mm256_fmadd_ps(s, g1, acc[2 * i + 1]);
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < TK; i++) {
        float *d = dw + (int64_t)i * CO;
        _mm256_storeu_ps(d, _mm256_add_ps(_mm256_loadu_ps(d), acc[2 * i]));
        _mm256_storeu_ps(d + 8, _mm256_add_ps(_mm256_loadu_ps(d + 8), acc[2 * i + 1]));
    }
}

/* Pixel j's TK kernel rows from k into xt + j TK: the tile's broadcasts then read one stream. */
static inline __attribute__((always_inline)) void pack(int TK, const float *x, const int64_t *off, int k, int n,
                                                       float *restrict xt)
{
    for (int j = 0; j < n; j++)
        for (int i = 0; i < TK; i++) xt[j * TK + i] = x[off[j] + k + i];
}

/* One block of n pixels: dW rows [k0, k1). Kernel rows in sixes (then ones) outside, packed once, channels in
 * blocks of 64 (then 16) inside. */
static CW_512 void block512(const float *x, const int64_t *off, const float *g, int CO, int n, int k0, int k1,
                            float *dW)
{
    float xt[CW_NP * 6];
    for (int k = k0; k < k1;) {
        int tk = k1 - k >= 6 ? 6 : 1;
        if (tk == 6) pack(6, x, off, k, n, xt);
        else pack(1, x, off, k, n, xt);
        for (int c = 0; c < CO;) {
            int nv = CO - c >= 64 ? 4 : 1;
            float *d = dW + (int64_t)k * CO + c;
            if (tk == 6 && nv == 4) tile512(6, 4, xt, g + c, CO, n, d);
            else if (tk == 6) tile512(6, 1, xt, g + c, CO, n, d);
            else if (nv == 4) tile512(1, 4, xt, g + c, CO, n, d);
            else tile512(1, 1, xt, g + c, CO, n, d);
            c += 16 * nv;
        }
        k += tk;
    }
}

static CW_256 void block256(const float *x, const int64_t *off, const float *g, int CO, int n, int k0, int k1,
                            float *dW)
{
    float xt[CW_NP * 6];
    for (int k = k0; k < k1;) {
        int tk = k1 - k >= 6 ? 6 : 1;
        if (tk == 6) pack(6, x, off, k, n, xt);
        else pack(1, x, off, k, n, xt);
        for (int c = 0; c < CO; c += 16)
            if (tk == 6) tile256(6, xt, g + c, CO, n, dW + (int64_t)k * CO + c);
            else tile256(1, xt, g + c, CO, n, dW + (int64_t)k * CO + c);
        k += tk;
    }
}
#endif

void nn_convp_kernel_grad_(const nn_layer_ *l, const float *x, const float *dz, int64_t B, int k0, int k1, float *dW)
{
#if CW_HAVE
    const int C = l->cin, CO = l->cout, OH = l->oh, OW = l->ow;
    const int64_t px = (int64_t)l->sw * C, rw = (int64_t)l->sh * l->iw * C, img = (int64_t)l->ih * l->iw * C;
    memset(dW + (int64_t)k0 * CO, 0, (size_t)(k1 - k0) * (size_t)CO * sizeof *dW);
    int64_t off[CW_NP];
    for (int64_t b = 0; b < B; b++)
        for (int p0 = 0; p0 < OH * OW; p0 += CW_NP) {
            int n = OH * OW - p0 < CW_NP ? OH * OW - p0 : CW_NP;
            for (int j = 0; j < n; j++) off[j] = ((p0 + j) / OW) * rw + ((p0 + j) % OW) * px;
            const float *xb = x + b * img, *gb = dz + (b * OH * OW + p0) * (int64_t)CO;
            if (l->fma == 2) block512(xb, off, gb, CO, n, k0, k1, dW);
            else block256(xb, off, gb, CO, n, k0, k1, dW);
        }
#else
    (void)l, (void)x, (void)dz, (void)B, (void)k0, (void)k1, (void)dW;
    LOOM_ASSERT(!"nn_convp_kernel_grad_ without nn_convp_ok_");
#endif
}
