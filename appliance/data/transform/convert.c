/* convert.c - the element-wise kernels of the synchronous stages: dtype
 * conversion (saturating, NaN to 0), scale, normalize (one mean and std, or
 * per channel), moments, and padding an image; the map fns (transforms.c)
 * and a batch with a fused scale (batch.c) call them, loom_data_* exposes
 * them to the tests and benches. No allocation, no state. */
#include "data/data_internal.h"
#include "transform_internal.h"

#include <math.h>
#include <string.h>

/* ---- dtype conversion ------------------------------------------------------ */

#define SAT_(x, lo, hi) ((x) != (x) ? 0 : (x) <= (lo) ? (lo) : (x) >= (hi) ? (hi) : (x))
#define CONV_LOOP_(ST, DT, E)                                       \
    {                                                               \
        const ST *a = src;                                          \
        DT *b = dst;                                                \
        for (size_t i = 0; i < n; i++) {                            \
            ST x = a[i];                                            \
            b[i] = (DT)(E);                                         \
        }                                                           \
        return;                                                     \
    }
#define ROW_INT_(ST)                                                \
    switch (dd) {                                                   \
    case LOOM_U8: CONV_LOOP_(ST, uint8_t, x)                        \
    case LOOM_I32: CONV_LOOP_(ST, int32_t, x)                       \
    case LOOM_I64: CONV_LOOP_(ST, int64_t, x)                       \
    case LOOM_F32: CONV_LOOP_(ST, float, x)                         \
    case LOOM_F64: CONV_LOOP_(ST, double, x)                        \
    default: break;                                                 \
    }                                                               \
    break
/* float to int truncates toward zero, saturates, and maps NaN to 0 */
#define ROW_FLT_(ST)                                                                        \
    switch (dd) {                                                                           \
    case LOOM_U8: CONV_LOOP_(ST, uint8_t, SAT_(x, 0, 255))                                  \
    case LOOM_I32: CONV_LOOP_(ST, int32_t, SAT_((double)x, -2147483648.0, 2147483647.0))    \
    case LOOM_I64: CONV_LOOP_(ST, int64_t, SAT_((double)x, -9223372036854775808.0, 9223372036854774784.0)) \
    case LOOM_F32: CONV_LOOP_(ST, float, x)                                                 \
    case LOOM_F64: CONV_LOOP_(ST, double, x)                                                \
    default: break;                                                                         \
    }                                                                                       \
    break

/* n values of sd at src into dd at dst; src == dst is allowed when the sizes are equal. */
void dconvert_(const void *src, loom_dtype sd, void *dst, loom_dtype dd, size_t n)
{
    switch (sd) {
    case LOOM_U8: ROW_INT_(uint8_t);
    case LOOM_I32: ROW_INT_(int32_t);
    case LOOM_I64: ROW_INT_(int64_t);
    case LOOM_F32: ROW_FLT_(float);
    case LOOM_F64: ROW_FLT_(double);
    default: break;
    }
    LOOM_ASSERT(!"bad dtype pair");
}

/* Elementwise float32 results of any input dtype; E_(v) is the op, defined around each use. */
#define AFFINE_LOOP_(ST)                                                \
    {                                                                   \
        const ST *a = src;                                              \
        for (size_t i = 0; i < n; i++) dst[i] = E_((float)a[i]);        \
        return;                                                         \
    }
#define AFFINE_ALL_                                                     \
    switch (sd) {                                                       \
    case LOOM_U8: AFFINE_LOOP_(uint8_t)                                 \
    case LOOM_I32: AFFINE_LOOP_(int32_t)                                \
    case LOOM_I64: AFFINE_LOOP_(int64_t)                                \
    case LOOM_F32: AFFINE_LOOP_(float)                                  \
    case LOOM_F64: AFFINE_LOOP_(double)                                 \
    default: LOOM_ASSERT(!"bad dtype");                                 \
    }

/* uint8 -> float32 v * sc + off, vectorised by the CPU's features (loom_cpu,
 * as the nn kernels choose): the scalar loop's operations (an exact
 * conversion, a multiply, an add: no FMA, and the build has -ffp-contract=off),
 * so the same floats bit for bit on any path, at a fraction of the
 * instructions (gcc -O2 leaves the scalar loop scalar). */
#if defined(__x86_64__)
#include <immintrin.h>
__attribute__((target("avx512f"))) static size_t scale_u8_512(const uint8_t *a, float *dst, size_t n, float sc, float off)
{
    __m512 vs = _mm512_set1_ps(sc), vo = _mm512_set1_ps(off);
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512 x0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(a + i))));
        __m512 x1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(a + i + 16))));
        _mm512_storeu_ps(dst + i, _mm512_add_ps(_mm512_mul_ps(x0, vs), vo));
        _mm512_storeu_ps(dst + i + 16, _mm512_add_ps(_mm512_mul_ps(x1, vs), vo));
    }
    if (i + 16 <= n) { /* a 28x28 image's row of 784 ends in 16 */
        __m512 x0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(a + i))));
        _mm512_storeu_ps(dst + i, _mm512_add_ps(_mm512_mul_ps(x0, vs), vo));
        i += 16;
    }
    return i;
}

__attribute__((target("avx2"))) static size_t scale_u8_256(const uint8_t *a, float *dst, size_t n, float sc, float off)
{
    __m256 vs = _mm256_set1_ps(sc), vo = _mm256_set1_ps(off);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 x0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(a + i))));
        __m256 x1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(a + i + 8))));
        _mm256_storeu_ps(dst + i, _mm256_add_ps(_mm256_mul_ps(x0, vs), vo));
        _mm256_storeu_ps(dst + i + 8, _mm256_add_ps(_mm256_mul_ps(x1, vs), vo));
    }
    return i;
}
#endif

static void scale_u8(const uint8_t *a, float *dst, size_t n, float sc, float off)
{
    size_t i = 0;
#if defined(__x86_64__)
    const loom_cpu_info *cpu = loom_cpu();
    if (cpu->avx512f) i = scale_u8_512(a, dst, n, sc, off);
    else if (cpu->avx2) i = scale_u8_256(a, dst, n, sc, off);
#endif
    for (; i < n; i++) dst[i] = (float)a[i] * sc + off;
}

void dscale_vals_(const void *src, loom_dtype sd, float *dst, size_t n, float sc, float off)
{
    if (sd == LOOM_U8) {
        scale_u8(src, dst, n, sc, off);
        return;
    }
#define E_(v) ((v) * sc + off)
    AFFINE_ALL_
#undef E_
}

/* Vector clones chosen by loom_cpu()'s level (tensor.h LOOM_CLONES, as nn/ does): the division stays a
 * division (IEEE, lane by lane), so every clone gives the scalar loop's floats. */
static inline LOOM_CLONE_BODY void normalize_vals_body(const void *src, loom_dtype sd, float *dst, size_t n, float mean,
                                                       float std)
{
#define E_(v) (((v) - mean) / std)
    AFFINE_ALL_
#undef E_
}
LOOM_CLONES(, void, normalize_vals, (const void *src, loom_dtype sd, float *dst, size_t n, float mean, float std),
            (src, sd, dst, n, mean, std))

/* normalize_vals for the map fns (transforms.c); the clones stay static. */
void dnormalize_vals_(const void *src, loom_dtype sd, float *dst, size_t n, float mean, float std)
{
    normalize_vals(src, sd, dst, n, mean, std);
}

/* Per index of the last axis (length L): (x - mean[i % L]) / std[i % L]. */
#define NORMV_LOOP_(ST)                                                 \
    {                                                                   \
        const ST *a = src;                                              \
        for (size_t i = 0, j = 0; i < n; i++) {                         \
            dst[i] = ((float)a[i] - mean[j]) / std[j];                  \
            if (++j == L) j = 0;                                        \
        }                                                               \
        return;                                                         \
    }
void dnormalize_vec_(const void *src, loom_dtype sd, float *dst, size_t n, const float *mean, const float *std,
                     size_t L)
{
    switch (sd) {
    case LOOM_U8: NORMV_LOOP_(uint8_t)
    case LOOM_I32: NORMV_LOOP_(int32_t)
    case LOOM_I64: NORMV_LOOP_(int64_t)
    case LOOM_F32: NORMV_LOOP_(float)
    case LOOM_F64: NORMV_LOOP_(double)
    default: LOOM_ASSERT(!"bad dtype");
    }
}
#undef NORMV_LOOP_

int dis_int_(loom_dtype t) { return t == LOOM_U8 || t == LOOM_I32 || t == LOOM_I64; }


/* Mean and population standard deviation of n values (two passes, in double). */
#define STATS_LOOP_(ST)                                                                 \
    {                                                                                   \
        const ST *a = src;                                                              \
        for (size_t i = 0; i < n; i++) sum += (double)a[i];                             \
        *mean = sum / (double)n;                                                        \
        for (size_t i = 0; i < n; i++) sq += ((double)a[i] - *mean) * ((double)a[i] - *mean); \
        break;                                                                          \
    }
void dstats_vals_(const void *src, loom_dtype sd, size_t n, double *mean, double *std)
{
    double sum = 0, sq = 0;
    *mean = *std = 0;
    if (!n) return;
    switch (sd) {
    case LOOM_U8: STATS_LOOP_(uint8_t)
    case LOOM_I32: STATS_LOOP_(int32_t)
    case LOOM_I64: STATS_LOOP_(int64_t)
    case LOOM_F32: STATS_LOOP_(float)
    case LOOM_F64: STATS_LOOP_(double)
    default: LOOM_ASSERT(!"bad dtype");
    }
    *std = sqrt(sq / (double)n);
}
#undef STATS_LOOP_

/* (H, W, px bytes) at src -> (H + 2p, W + 2p, px) at dst, the border filled with the dtype value at fill (esz bytes). */
void dpad_image_(const uint8_t *src, uint8_t *dst, int64_t H, int64_t W, int64_t p, size_t px, const uint8_t *fill,
                 size_t esz)
{
    int64_t OW = W + 2 * p;
    size_t total = (size_t)((H + 2 * p) * OW) * px, row = (size_t)W * px;
    int zero = 1;
    for (size_t k = 0; k < esz; k++) zero &= fill[k] == 0;
    if (zero) memset(dst, 0, total);
    else
        for (size_t k = 0; k < total; k += esz) memcpy(dst + k, fill, esz);
    for (int64_t h = 0; h < H; h++) memcpy(dst + (size_t)((h + p) * OW + p) * px, src + (size_t)h * row, row);
}

/* The ops above (and flip_image, transforms.c) for custom element functions (custom.h). */
void loom_data_convert(const void *src, loom_dtype sd, void *dst, loom_dtype dd, size_t n) { dconvert_(src, sd, dst, dd, n); }
void loom_data_scale(const void *src, loom_dtype sd, float *dst, size_t n, float sc, float off) { dscale_vals_(src, sd, dst, n, sc, off); }
void loom_data_normalize(const void *src, loom_dtype sd, float *dst, size_t n, float mean, float std)
{
    normalize_vals(src, sd, dst, n, mean, std);
}
void loom_data_moments(const void *src, loom_dtype sd, size_t n, double *mean, double *std) { dstats_vals_(src, sd, n, mean, std); }
void loom_data_pad_image(const uint8_t *src, uint8_t *dst, int64_t H, int64_t W, int64_t p, size_t px, const uint8_t *fill,
                         size_t esz)
{
    dpad_image_(src, dst, H, W, p, px, fill, esz);
}
