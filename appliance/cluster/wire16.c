/* wire16.c - the 16-bit wire formats of loom_group_all_reduce_wire
 * (strategy.compression): float32 <-> bfloat16 and IEEE half, round to
 * nearest even, 8 at a time with F16C/AVX2 where the CPU has them and one at
 * a time otherwise, with the same bits either way (test_cluster_net's
 * wire_round), so workers on different machines round alike.
 * Threads: none (pure functions). */
#include "cluster/wire16_internal.h"
#include "core/core.h"

#include <stdbool.h>
#include <string.h>

/* float32 -> bfloat16, round to nearest even (a NaN stays a quiet NaN). */
static inline uint16_t to_bf16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40);
    x += 0x7fffu + ((x >> 16) & 1);
    return (uint16_t)(x >> 16);
}

static inline float from_bf16(uint16_t h)
{
    uint32_t x = (uint32_t)h << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

/* float32 -> IEEE half, round to nearest even; beyond 65504 an infinity
 * (F. Giesen's float_to_half_fast3_rtne). */
static inline uint16_t to_fp16(float f)
{
    uint32_t x, sign;
    memcpy(&x, &f, 4);
    sign = x & 0x80000000u;
    x ^= sign;
    uint16_t o;
    if (x >= 0x47800000u) /* 65536 and up, infinities; NaNs quieted, the payload's top bits kept (as F16C) */
        o = x > 0x7f800000u ? (uint16_t)(0x7e00u | ((x >> 13) & 0x3ffu)) : 0x7c00;
    else if (x < 0x38800000u) { /* a half subnormal or zero: let the FPU round the shifted mantissa */
        const uint32_t magic = ((127 - 15) + (23 - 10) + 1) << 23;
        float fx, fm;
        memcpy(&fx, &x, 4);
        memcpy(&fm, &magic, 4);
        fx += fm;
        uint32_t r;
        memcpy(&r, &fx, 4);
        o = (uint16_t)(r - magic);
    } else {
        uint32_t odd = (x >> 13) & 1;
        x += ((uint32_t)(15 - 127) << 23) + 0xfffu + odd;
        o = (uint16_t)(x >> 13);
    }
    return (uint16_t)(o | (sign >> 16));
}

static inline float from_fp16(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, em = h & 0x7fffu, o;
    if (em >= 0x7c00u) o = 0x7f800000u | ((em & 0x3ffu) << 13) | (em > 0x7c00u ? 0x400000u : 0); /* NaNs quiet */
    else if (em >= 0x400u) o = (em << 13) + ((uint32_t)(127 - 15) << 23);
    else {
        float f = (float)em * 5.9604644775390625e-8f; /* em x 2^-24 */
        memcpy(&o, &f, 4);
    }
    o |= sign;
    float f;
    memcpy(&f, &o, 4);
    return f;
}

#if defined(__x86_64__)
#include <immintrin.h>
/* The same conversions with F16C (8 at a time, round to nearest even as
 * to_fp16: the same bits) and AVX2 (bf16); chosen at run time. */
#define WIRE_SIMD __attribute__((target("avx2,f16c")))
/* AVX2 and F16C as the process's one CPU probe says (LOOM_TEST_CPU may lower
 * them). Not CPUID here: every conversion call asks, and under a hypervisor
 * each CPUID traps (~20 us on a Zen 3 VM: a million single-value rounds took
 * 41 s). */
static bool wire_simd(void)
{
    const loom_cpu_features *f = loom_cpu_probe();
    return f->avx2 && f->f16c;
}
WIRE_SIMD static __m256i bf16_round8(__m256 v)
{
    __m256i x = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    __m256i qn = _mm256_or_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(r, qn, nan); /* 8 x 32 bits, each holding its 16 */
}
WIRE_SIMD static void pack8(uint16_t *dst, __m256i w)
{
    __m128i lo = _mm256_castsi256_si128(w), hi = _mm256_extracti128_si256(w, 1);
    _mm_storeu_si128((__m128i *)dst, _mm_packus_epi32(lo, hi));
}
WIRE_SIMD static __m256 load8(uint8_t fmt, const uint16_t *src)
{
    __m128i h = _mm_loadu_si128((const __m128i *)src);
    if (fmt == LOOM_WIRE_FP16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
WIRE_SIMD static void store8(uint8_t fmt, uint16_t *dst, __m256 v)
{
    if (fmt == LOOM_WIRE_FP16) _mm_storeu_si128((__m128i *)dst, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    else pack8(dst, bf16_round8(v));
}
/* n rounded down to 8: what the SIMD loops did (the scalar loops finish). */
WIRE_SIMD static size_t narrow8(uint8_t fmt, uint16_t *dst, const float *src, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) store8(fmt, dst + i, _mm256_loadu_ps(src + i));
    return i;
}
WIRE_SIMD static size_t widen8(uint8_t fmt, float *dst, const uint16_t *src, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(fmt, src + i));
    return i;
}
WIRE_SIMD static size_t add8(uint8_t fmt, float *acc, uint16_t *out, const uint16_t *in, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_add_ps(_mm256_loadu_ps(acc + i), load8(fmt, in + i));
        _mm256_storeu_ps(acc + i, v);
        store8(fmt, out + i, v);
    }
    return i;
}
/* v = g + e; g = v rounded to 16 bits (as float32); e = v - g */
WIRE_SIMD static size_t feedback8(uint8_t fmt, float *g, float *e, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_add_ps(_mm256_loadu_ps(g + i), _mm256_loadu_ps(e + i)), r;
        if (fmt == LOOM_WIRE_FP16) r = _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
        else r = _mm256_castsi256_ps(_mm256_slli_epi32(bf16_round8(v), 16));
        _mm256_storeu_ps(e + i, _mm256_sub_ps(v, r));
        _mm256_storeu_ps(g + i, r);
    }
    return i;
}
#else
static size_t feedback8(uint8_t fmt, float *g, float *e, size_t n) { return (void)fmt, (void)g, (void)e, (void)n, 0; }
static bool wire_simd(void) { return false; }
static size_t narrow8(uint8_t fmt, uint16_t *dst, const float *src, size_t n) { return (void)fmt, (void)dst, (void)src, (void)n, 0; }
static size_t widen8(uint8_t fmt, float *dst, const uint16_t *src, size_t n) { return (void)fmt, (void)dst, (void)src, (void)n, 0; }
static size_t add8(uint8_t fmt, float *acc, uint16_t *out, const uint16_t *in, size_t n)
{
    return (void)fmt, (void)acc, (void)out, (void)in, (void)n, 0;
}
#endif

void loom_wire_narrow_(loom_wire_fmt fmt, uint16_t *dst, const float *src, size_t n)
{
    size_t i = wire_simd() ? narrow8(fmt, dst, src, n) : 0;
    if (fmt == LOOM_WIRE_BF16)
        for (; i < n; i++) dst[i] = to_bf16(src[i]);
    else
        for (; i < n; i++) dst[i] = to_fp16(src[i]);
}

void loom_wire_widen_(loom_wire_fmt fmt, float *dst, const uint16_t *src, size_t n)
{
    size_t i = wire_simd() ? widen8(fmt, dst, src, n) : 0;
    if (fmt == LOOM_WIRE_BF16)
        for (; i < n; i++) dst[i] = from_bf16(src[i]);
    else
        for (; i < n; i++) dst[i] = from_fp16(src[i]);
}

void loom_wire_add_(loom_wire_fmt fmt, float *acc, uint16_t *out, const uint16_t *in, size_t n)
{
    size_t i = out && wire_simd() ? add8(fmt, acc, out, in, n) : 0;
    if (!out) { /* widen in blocks, then add: the same float32 sums */
        float w[512];
        for (; i < n; i += 512) {
            size_t k = n - i < 512 ? n - i : 512;
            loom_wire_widen_(fmt, w, in + i, k);
            for (size_t j = 0; j < k; j++) acc[i + j] += w[j];
        }
    } else if (fmt == LOOM_WIRE_BF16)
        for (; i < n; i++) acc[i] += from_bf16(in[i]), out[i] = to_bf16(acc[i]);
    else
        for (; i < n; i++) acc[i] += from_fp16(in[i]), out[i] = to_fp16(acc[i]);
}

void loom_wire_round(loom_wire_fmt fmt, float *x, int64_t n)
{
    if (fmt != LOOM_WIRE_BF16 && fmt != LOOM_WIRE_FP16) return;
    uint16_t h[512];
    for (int64_t i = 0; i < n; i += 512) {
        size_t k = n - i < 512 ? (size_t)(n - i) : 512;
        loom_wire_narrow_(fmt, h, x + i, k);
        loom_wire_widen_(fmt, x + i, h, k);
    }
}

void loom_wire_feedback(loom_wire_fmt fmt, float *g, float *e, int64_t n)
{
    if (fmt != LOOM_WIRE_BF16 && fmt != LOOM_WIRE_FP16) return;
    size_t i = wire_simd() ? feedback8(fmt, g, e, (size_t)n) : 0;
    for (; i < (size_t)n; i++) {
        float v = g[i] + e[i];
        float r = fmt == LOOM_WIRE_BF16 ? from_bf16(to_bf16(v)) : from_fp16(to_fp16(v));
        e[i] = v - r, g[i] = r;
    }
}
