/* transforms.c - the synchronous stages: map (built-in ops on one feature),
 * shuffle (tf.data's buffer algorithm; by index over a random-access input),
 * batch, repeat, take, skip (take and skip pass random access through).
 * Buffers are sized at open from the upstream max shapes; next() never
 * allocates, except while a shuffle buffer first grows towards its size when
 * the input's cardinality is unknown. Maps work in place when the upstream
 * buffer is writable (mut) and the dtype size allows, else into their own
 * preallocated output. */
#include "data/data_internal.h"

#include <math.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

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
static void convert(const void *src, loom_dtype sd, void *dst, loom_dtype dd, size_t n)
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

static void scale_vals(const void *src, loom_dtype sd, float *dst, size_t n, float sc, float off)
{
    if (sd == LOOM_U8) {
        scale_u8(src, dst, n, sc, off);
        return;
    }
#define E_(v) ((v) * sc + off)
    AFFINE_ALL_
#undef E_
}

/* Vector clones chosen by the CPU at start (as nn/ does): the division stays a
 * division (IEEE, lane by lane), so every clone gives the scalar loop's floats. */
static __attribute__((target_clones("avx512f", "avx2", "default"))) void normalize_vals(const void *src, loom_dtype sd,
                                                                                       float *dst, size_t n, float mean,
                                                                                       float std)
{
#define E_(v) (((v) - mean) / std)
    AFFINE_ALL_
#undef E_
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
static void normalize_vec(const void *src, loom_dtype sd, float *dst, size_t n, const float *mean, const float *std,
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

static int is_int(loom_dtype t) { return t == LOOM_U8 || t == LOOM_I32 || t == LOOM_I64; }


/* Mean and population standard deviation of n values (two passes, in double). */
#define STATS_LOOP_(ST)                                                                 \
    {                                                                                   \
        const ST *a = src;                                                              \
        for (size_t i = 0; i < n; i++) sum += (double)a[i];                             \
        *mean = sum / (double)n;                                                        \
        for (size_t i = 0; i < n; i++) sq += ((double)a[i] - *mean) * ((double)a[i] - *mean); \
        break;                                                                          \
    }
static void stats_vals(const void *src, loom_dtype sd, size_t n, double *mean, double *std)
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
static void pad_image(const uint8_t *src, uint8_t *dst, int64_t H, int64_t W, int64_t p, size_t px, const uint8_t *fill,
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

/* The ops above (and flip_image below) for custom element functions (custom.h). */
void loom_data_convert(const void *src, loom_dtype sd, void *dst, loom_dtype dd, size_t n) { convert(src, sd, dst, dd, n); }
void loom_data_scale(const void *src, loom_dtype sd, float *dst, size_t n, float sc, float off) { scale_vals(src, sd, dst, n, sc, off); }
void loom_data_normalize(const void *src, loom_dtype sd, float *dst, size_t n, float mean, float std)
{
    normalize_vals(src, sd, dst, n, mean, std);
}
void loom_data_moments(const void *src, loom_dtype sd, size_t n, double *mean, double *std) { stats_vals(src, sd, n, mean, std); }
void loom_data_pad_image(const uint8_t *src, uint8_t *dst, int64_t H, int64_t W, int64_t p, size_t px, const uint8_t *fill,
                         size_t esz)
{
    pad_image(src, dst, H, W, p, px, fill, esz);
}

/* ---- map ------------------------------------------------------------------ */

/* A bad value in element pos of the pass: a map right after the source counts the source's records. */
static int elem_err(const dstage *st, loom_err *err, const char *kn, const char *feature, int64_t pos, const char *why)
{
    return dstage_err_(st, err, LOOM_EDATA, "map(%s) on \"%s\": %s %lld%s: %s", kn, feature, st->id == 1 ? "record" : "element",
                       (long long)pos, st->id == 1 ? " of this epoch's reading order (from 0)" : "", why);
}

typedef struct dmapfn dmapfn;
typedef struct mapst {
    dstage        s;
    int64_t       epoch, pos; /* pos: elements (images for flip) seen this pass: the RNG index */
    loom_map_spec m;
    int           f;        /* the feature */
    loom_dtype    in_dt, out_dt;
    uint8_t      *buf;      /* own output, sized for the max shape; NULL when never needed */
    uint64_t      seed;     /* random ops */
    uint8_t      *flags;    /* flip: per image of a batched element */
    size_t        buf_bytes, flag_bytes;
    int64_t      *vtab;     /* string_lookup: open addressing over the vocabulary, token index + 1 (0: empty) */
    uint64_t      vmask;    /* its size - 1 */
    const dmapfn *fn;       /* the built-in map fn */
    int           no_buf;   /* the output is the input or a view of it: no buffer of its own */
    int           fused;    /* a scale fused into the gathering batch it reads (map_fuse_into_batch_) */
} mapst;
DCURSOR_STAGE_CHECK(mapst);

static bool batch_fuse_scale(dstage *st, int f, float sc, float off);
static int  batch_next_scaled(dstage *st, loom_elem *o, loom_err *err);

typedef struct mapcall mapcall;
/* A built-in map fn: an entry of the registry (LOOM_REG_TRANSFORM) that starts as loom_custom_ops does. */
struct dmapfn {
    uint32_t      version; /* DMAPFN_BUILTIN; where loom_custom_ops has its version */
    const char   *name;    /* the config's fn name, the registry's */
    loom_map_kind kind;    /* what config resolved the name to */
    /* At open: s's settings against its input (s->in_dt, the feature's spec
     * and max shape, batch_dims); sets the output's spec and max shape,
     * s->out_dt, s->no_buf and the stage's description, and allocates any
     * scratch of its own. */
    int (*check)(mapst *s, loom_err *err);
    /* Per call (reentrant): maps the call's feature. */
    int (*apply)(mapcall *c, loom_err *err);
};

/* ---- string_lookup: a string is the bytes of the last axis up to its
 * trailing zero bytes (the zero padding of a csv string column or text line). */

uint64_t loom_data_str_hash(const uint8_t *p, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

static size_t str_len(const uint8_t *p, size_t L)
{
    while (L && !p[L - 1]) L--;
    return L;
}

/* The token index of p[0..n) in the stage's vocabulary, or -1. */
static int64_t vocab_find(const mapst *s, const uint8_t *p, size_t n)
{
    const loom_vocab *v = s->m.vocab;
    for (uint64_t i = loom_data_str_hash(p, n) & s->vmask;; i = (i + 1) & s->vmask) {
        int64_t k = s->vtab[i] - 1;
        if (k < 0) return -1;
        if (v->off[k + 1] - v->off[k] == n && !memcmp(v->data + v->off[k], p, n)) return k;
    }
}

static int vocab_table(mapst *s, loom_err *err)
{
    const loom_vocab *v = s->m.vocab;
    uint64_t size = 16;
    while (size < 2 * (uint64_t)v->n + 2) size *= 2;
    if (!(s->vtab = loom_calloc(size, sizeof *s->vtab)))
        return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the lookup table of %lld strings", (long long)v->n);
    s->vmask = size - 1;
    for (int64_t k = 0; k < v->n; k++) {
        const uint8_t *p = (const uint8_t *)v->data + v->off[k];
        size_t n = (size_t)(v->off[k + 1] - v->off[k]);
        if (vocab_find(s, p, n) >= 0) continue; /* a token twice: the first (more frequent) id holds */
        uint64_t i = loom_data_str_hash(p, n) & s->vmask;
        while (s->vtab[i]) i = (i + 1) & s->vmask;
        s->vtab[i] = k + 1;
    }
    return LOOM_OK;
}

/* A row of W px-byte pixels reversed into a distinct row. Inlined with px
 * constant for the common pixel sizes, where it compiles to vector shuffles. */
static inline __attribute__((always_inline)) void reverse_px(const uint8_t *restrict r, uint8_t *restrict o, int64_t W,
                                                             size_t px)
{
    for (int64_t w = 0; w < W; w++) memcpy(o + (size_t)w * px, r + (size_t)(W - 1 - w) * px, px);
}

/* A row of W bytes reversed into a distinct row, 8 at a time (a byte swap
 * of each 8 from the row's end): a byte loop was ~4 instructions a byte. */
static inline __attribute__((always_inline)) void reverse_bytes(const uint8_t *restrict r, uint8_t *restrict o, int64_t W)
{
    if (W < 8) {
        for (int64_t w = 0; w < W; w++) o[w] = r[W - 1 - w];
        return;
    }
    uint64_t v;
    for (int64_t w = 0; w + 8 <= W; w += 8) {
        memcpy(&v, r + W - 8 - w, sizeof v);
        v = __builtin_bswap64(v);
        memcpy(o + w, &v, sizeof v);
    }
    memcpy(&v, r, sizeof v); /* the last 8 (overlapping what is done when W % 8 != 0) */
    v = __builtin_bswap64(v);
    memcpy(o + W - 8, &v, sizeof v);
}

/* One row flipped, in place (src == dst: through a copy of the row, or by
 * swapping pixels when it is too long for the stack) or not. */
static inline __attribute__((always_inline)) void flip_row(const uint8_t *r, uint8_t *o, int64_t W, size_t px)
{
    uint8_t row[4096];
    if (r != o && px == 1) {
        reverse_bytes(r, o, W);
    } else if (r != o) {
        reverse_px(r, o, W, px);
    } else if ((size_t)W * px <= sizeof row) {
        memcpy(row, r, (size_t)W * px);
        reverse_px(row, o, W, px);
    } else {
        for (int64_t w = 0; w < W / 2; w++) {
            uint8_t *x = o + (size_t)w * px, *y = o + (size_t)(W - 1 - w) * px;
            memcpy(row, x, px);
            memcpy(x, y, px);
            memcpy(y, row, px);
        }
    }
}

static inline __attribute__((always_inline)) void flip_rows(const uint8_t *src, uint8_t *dst, int64_t H, int64_t W, size_t px)
{
    for (int64_t h = 0; h < H; h++) flip_row(src + (size_t)(h * W) * px, dst + (size_t)(h * W) * px, W, px);
}

static void flip_image(const uint8_t *src, uint8_t *dst, int64_t H, int64_t W, size_t px)
{
    switch (px) {
    case 1: flip_rows(src, dst, H, W, 1); return;
    case 2: flip_rows(src, dst, H, W, 2); return;
    case 3: flip_rows(src, dst, H, W, 3); return;
    case 4: flip_rows(src, dst, H, W, 4); return;
    case 8: flip_rows(src, dst, H, W, 8); return;
    case 12: flip_rows(src, dst, H, W, 12); return;
    case 16: flip_rows(src, dst, H, W, 16); return;
    default: break;
    }
    for (int64_t h = 0; h < H; h++) { /* other pixel sizes: swap in 64-byte pieces */
        const uint8_t *r = src + (size_t)(h * W) * px;
        uint8_t *o = dst + (size_t)(h * W) * px;
        if (r != o) {
            for (int64_t w = 0; w < W; w++) memcpy(o + (size_t)w * px, r + (size_t)(W - 1 - w) * px, px);
            continue;
        }
        uint8_t tmp[64];
        for (int64_t w = 0; w < W / 2; w++) {
            uint8_t *x = o + (size_t)w * px, *y = o + (size_t)(W - 1 - w) * px;
            for (size_t done = 0; done < px; done += sizeof tmp) {
                size_t k = px - done < sizeof tmp ? px - done : sizeof tmp;
                memcpy(tmp, x + done, k);
                memcpy(x + done, y + done, k);
                memcpy(y + done, tmp, k);
            }
        }
    }
}

void loom_data_flip_image(const uint8_t *src, uint8_t *dst, int64_t H, int64_t W, size_t px) { flip_image(src, dst, H, W, px); }

/* Elements in a tensor with bd leading batch dims (1 when unbatched). */
static int64_t elems_of(const loom_tensor *t, int bd)
{
    int64_t k = 1;
    for (int d = 0; d < bd; d++) k *= t->shape.dim[d];
    return k;
}

int64_t map_count_(const dstage *st, const loom_elem *e)
{
    if (custom_is_(st)) return 1; /* one call per element, batched or not */
    return elems_of(&e->t[((const mapst *)st)->f], st->batch_dims);
}

int map_feature_(const dstage *st) { return custom_is_(st) ? 0 : ((const mapst *)st)->f; }

void map_buffers_(const dstage *st, uint8_t **buf, uint8_t **flags)
{
    LOOM_ASSERT(!custom_is_(st)); /* the plan never fuses a Lua map (optimize.c) */
    const mapst *s = (const mapst *)st;
    *buf = s->buf;
    *flags = s->flags;
}

void map_scratch_(const dstage *st, size_t *buf_bytes, size_t *flag_bytes)
{
    if (custom_is_(st)) {
        *buf_bytes = custom_scratch_(st);
        *flag_bytes = 0;
        return;
    }
    const mapst *s = (const mapst *)st;
    *buf_bytes = s->buf ? s->buf_bytes : 0;
    *flag_bytes = s->flags ? s->flag_bytes : 0;
}

/* ---- the built-in map fns: each a check at open and an apply per call ----------------- */

/* One call of a map fn on feature t of an element: map_apply_'s arguments. */
typedef struct mapcall {
    const mapst  *s;
    const dstage *st;
    loom_tensor  *t;       /* the feature, mapped in place of the element's tensor */
    size_t        n;       /* values in t */
    void         *dst;     /* where an elementwise fn writes: t's own buffer when writable in place, else buf */
    uint8_t      *buf, *flags;
    int64_t       epoch, pos;
    int           writable;
    int          *mut;
} mapcall;

/* An elementwise fn's end: t holds what it wrote to dst, of the output dtype. */
static int map_done(mapcall *c)
{
    c->t->data = c->dst;
    c->t->dtype = c->s->out_dt;
    *c->mut = c->dst == c->buf || c->writable;
    return LOOM_OK;
}

static int cast_apply(mapcall *c, loom_err *err)
{
    (void)err;
    loom_tensor *t = c->t;
    if (t->dtype != c->s->out_dt) convert(t->data, t->dtype, c->dst, c->s->out_dt, c->n);
    else c->dst = t->data;
    return map_done(c);
}

static int scale_apply(mapcall *c, loom_err *err)
{
    (void)err;
    const loom_map_spec *m = &c->s->m;
    scale_vals(c->t->data, c->t->dtype, c->dst, c->n, (float)m->scale, (float)m->offset);
    return map_done(c);
}

static int normalize_apply(mapcall *c, loom_err *err)
{
    (void)err;
    const loom_map_spec *m = &c->s->m;
    loom_tensor *t = c->t;
    if (m->n_norm > 1)
        normalize_vec(t->data, t->dtype, c->dst, c->n, m->mean_v, m->std_v, (size_t)m->n_norm);
    else if (m->n_norm == 1)
        normalize_vals(t->data, t->dtype, c->dst, c->n, m->mean_v[0], m->std_v[0]);
    else
        normalize_vals(t->data, t->dtype, c->dst, c->n, (float)m->mean, (float)m->std);
    return map_done(c);
}

static int one_hot_apply(mapcall *c, loom_err *err)
{
    const dstage *st = c->st;
    loom_tensor *t = c->t;
    size_t n = c->n, depth = (size_t)c->s->m.depth;
    float *o = (float *)c->buf;
    memset(o, 0, n * depth * sizeof *o);
    for (size_t i = 0; i < n; i++) {
        int64_t v = (int64_t)loom_tensor_get(t, (int64_t)i);
        if (v < 0 || v >= (int64_t)depth) {
            int64_t idx = c->pos + (int64_t)(i / (n / (size_t)elems_of(t, st->batch_dims)));
            return dstage_err_(st, err, LOOM_EDATA, "map(one_hot) on \"%s\": element %lld has value %lld, outside [0, %lld)",
                               st->spec.name[c->s->f], (long long)idx, (long long)v, (long long)depth);
        }
        o[i * depth + (size_t)v] = 1.0f;
    }
    t->shape.dim[t->shape.rank++] = (int64_t)depth;
    c->dst = o;
    return map_done(c);
}

/* A stand-in for slow work that takes no CPU: ms per element of the batch; values untouched, mut unchanged. */
static int sleep_apply(mapcall *c, loom_err *err)
{
    (void)err;
    double ns = c->s->m.ms * 1e6 * (double)elems_of(c->t, c->st->batch_dims);
    struct timespec d = {(time_t)(ns / 1e9), (long)fmod(ns, 1e9)};
    while (nanosleep(&d, &d) != 0) {}
    return LOOM_OK;
}

/* A view: keeps the actual leading batch dims, replaces the rest; mut unchanged. */
static int reshape_apply(mapcall *c, loom_err *err)
{
    (void)err;
    const dstage *st = c->st;
    loom_shape sh = st->spec.shape[c->s->f];
    for (int d = 0; d < st->batch_dims; d++) sh.dim[d] = c->t->shape.dim[d];
    c->t->shape = sh;
    return LOOM_OK;
}

static int flip_apply(mapcall *c, loom_err *err)
{
    (void)err;
    const dstage *st = c->st;
    loom_tensor *t = c->t;
    uint8_t *flags = c->flags;
    int bd = st->batch_dims;
    int64_t images = elems_of(t, bd);
    int64_t H = t->shape.dim[bd], W = t->shape.dim[bd + 1];
    int64_t C = t->shape.rank - bd == 3 ? t->shape.dim[bd + 2] : 1;
    size_t px = (size_t)C * loom_dtype_size(t->dtype), img = (size_t)(H * W) * px;
    int any = 0;
    for (int64_t k = 0; k < images; k++) {
        loom_rng g;
        loom_rng_init(&g, c->s->seed, (uint64_t)st->id, (uint64_t)c->epoch, (uint64_t)(c->pos + k));
        flags[k] = loom_rng_uniform(&g) < 0.5f;
        any |= flags[k];
    }
    if (!any) return LOOM_OK; /* untouched: pass the input through */
    uint8_t *src = t->data, *o = c->dst; /* in place when writable, else buf */
    for (int64_t k = 0; k < images; k++) {
        if (flags[k])
            flip_image(src + (size_t)k * img, o + (size_t)k * img, H, W, px);
        else if (o != src)
            memcpy(o + (size_t)k * img, src + (size_t)k * img, img);
    }
    t->data = o;
    *c->mut = 1;
    return LOOM_OK;
}

/* ---- normalize then random_flip_left_right, in one pass ------------------------
 * A flip moves whole pixels and normalize maps each value alone with one mean
 * and std, so flip(normalize(x)) = normalize(flip(x)) bit for bit: the pass
 * reverses the rows of the input (1 byte a value for uint8 images, not 4)
 * into a scratch chunk and normalizes that, writing each float once where the
 * two maps wrote them twice (the vectorised normalize, then a float flip). */
#define NF_CHUNK 16384 /* bytes of input rows reversed at a time */

bool map_norm_flip_ok_(const dstage *a, const dstage *b)
{
    if (custom_is_(a) || custom_is_(b)) return false;
    const mapst *n = (const mapst *)a, *f = (const mapst *)b;
    if (n->fn->kind != LOOM_MAP_NORMALIZE || f->fn->kind != LOOM_MAP_FLIP_LR || n->f != f->f || n->m.n_norm > 1 ||
        a->batch_dims != b->batch_dims || !n->buf)
        return false;
    const loom_shape *mx = &a->in->maxshape[n->f];
    int bd = a->batch_dims;
    int64_t row = mx->dim[bd + 1] * (mx->rank - bd == 3 ? mx->dim[bd + 2] : 1) * (int64_t)loom_dtype_size(n->in_dt);
    return row > 0 && row <= NF_CHUNK;
}

int map_norm_flip_(const dstage *a, const dstage *b, loom_elem *e, int writable, uint8_t *dst, int64_t epoch, int64_t pos,
                   int *mut, loom_err *err)
{
    (void)err;
    const mapst *ns = (const mapst *)a, *fs = (const mapst *)b;
    loom_tensor *t = &e->t[ns->f];
    int bd = a->batch_dims;
    int64_t images = elems_of(t, bd), H = t->shape.dim[bd], W = t->shape.dim[bd + 1];
    int64_t C = t->shape.rank - bd == 3 ? t->shape.dim[bd + 2] : 1;
    size_t isz = loom_dtype_size(t->dtype), px = (size_t)C * isz, rowb = (size_t)W * px;
    size_t vals = (size_t)(H * W * C), rowv = (size_t)(W * C);
    float mean = ns->m.n_norm == 1 ? ns->m.mean_v[0] : (float)ns->m.mean;
    float sd = ns->m.n_norm == 1 ? ns->m.std_v[0] : (float)ns->m.std;
    /* where normalize alone would write (then flipped there in place): the
     * caller's dst, the input when writable and as wide, else its buffer */
    uint8_t *out = dst ? dst : writable && isz == sizeof(float) ? t->data : ns->buf;
    const uint8_t *src = t->data;
    int64_t rows = rowb ? (int64_t)(NF_CHUNK / rowb) : H;
    uint8_t tmp[NF_CHUNK] __attribute__((aligned(64)));
    for (int64_t k = 0; k < images; k++) {
        loom_rng g;
        loom_rng_init(&g, fs->seed, (uint64_t)b->id, (uint64_t)epoch, (uint64_t)(pos + k));
        const uint8_t *si = src + (size_t)k * vals * isz;
        float *oi = (float *)out + (size_t)k * vals;
        if (!(loom_rng_uniform(&g) < 0.5f)) {
            normalize_vals(si, t->dtype, oi, vals, mean, sd);
            continue;
        }
        for (int64_t h0 = 0; h0 < H; h0 += rows) {
            int64_t nh = H - h0 < rows ? H - h0 : rows;
            flip_image(si + (size_t)h0 * rowb, tmp, nh, W, px);
            normalize_vals(tmp, t->dtype, oi + (size_t)h0 * rowv, (size_t)nh * rowv, mean, sd);
        }
    }
    t->data = out;
    t->dtype = LOOM_F32;
    *mut = 1;
    return LOOM_OK;
}

/* t's data is now (of dtype dt) in buf, which later stages may modify. */
static int map_into_buf(mapcall *c, loom_dtype dt)
{
    c->t->data = c->buf;
    c->t->dtype = dt;
    *c->mut = 1;
    return LOOM_OK;
}

static int pad_apply(mapcall *c, loom_err *err) /* unbatched: (H, W[, C]) */
{
    (void)err;
    loom_tensor *t = c->t;
    int64_t H = t->shape.dim[0], W = t->shape.dim[1], p = c->s->m.padding;
    int64_t C = t->shape.rank == 3 ? t->shape.dim[2] : 1;
    size_t esz = loom_dtype_size(t->dtype);
    uint8_t fill[8];
    double v = c->s->m.value;
    convert(&v, LOOM_F64, fill, t->dtype, 1);
    pad_image(t->data, c->buf, H, W, p, (size_t)C * esz, fill, esz);
    t->shape.dim[0] = H + 2 * p;
    t->shape.dim[1] = W + 2 * p;
    return map_into_buf(c, t->dtype);
}

static int random_crop_apply(mapcall *c, loom_err *err) /* unbatched: (H, W[, C]) */
{
    const dstage *st = c->st;
    const mapst *s = c->s;
    loom_tensor *t = c->t;
    int64_t H = t->shape.dim[0], W = t->shape.dim[1], h = s->m.size[0], w = s->m.size[1];
    int64_t C = t->shape.rank == 3 ? t->shape.dim[2] : 1;
    if (H < h || W < w)
        return dstage_err_(st, err, LOOM_EDATA, "map(random_crop) on \"%s\": element %lld is %lld x %lld, smaller than the "
                           "crop %lld x %lld", st->spec.name[s->f], (long long)c->pos, (long long)H, (long long)W,
                           (long long)h, (long long)w);
    loom_rng g;
    loom_rng_init(&g, s->seed, (uint64_t)st->id, (uint64_t)c->epoch, (uint64_t)c->pos);
    int64_t oh = (int64_t)loom_rng_below(&g, (uint64_t)(H - h + 1));
    int64_t ow = (int64_t)loom_rng_below(&g, (uint64_t)(W - w + 1));
    size_t px = (size_t)C * loom_dtype_size(t->dtype), row = (size_t)w * px;
    const uint8_t *src = t->data;
    for (int64_t r = 0; r < h; r++) memcpy(c->buf + (size_t)r * row, src + (size_t)((oh + r) * W + ow) * px, row);
    t->shape.dim[0] = h;
    t->shape.dim[1] = w;
    return map_into_buf(c, t->dtype);
}

static int decode_image_apply(mapcall *c, loom_err *err) /* unbatched: uint8 [N] -> (H, W, C) */
{
    const dstage *st = c->st;
    const mapst *s = c->s;
    const loom_shape *mx = &st->maxshape[s->f];
    image_info ii;
    char why[256];
    if (image_decode_(c->t->data, c->n, s->m.channels, s->out_dt, mx->dim[0], mx->dim[1], c->buf, &ii, why, sizeof why)) {
        elem_err(st, err, "decode_image", s->m.feature, c->pos, why);
        if (ii.h > mx->dim[0] || ii.w > mx->dim[1])
            loom_err_hint(err, s->m.max_size[0] ? "raise max_size" : "images of several sizes: set max_size = [h, w] (the "
                          "largest) instead of size, and resize after the decode");
        return err->code;
    }
    if (!s->m.max_size[0] && (ii.h != s->m.size[0] || ii.w != s->m.size[1])) {
        char m[160];
        snprintf(m, sizeof m, "the image is %lld x %lld (H x W), not size [%d, %d]", (long long)ii.h, (long long)ii.w,
                 s->m.size[0], s->m.size[1]);
        elem_err(st, err, "decode_image", s->m.feature, c->pos, m);
        return loom_err_hint(err, "images of several sizes: set max_size = [h, w] (the largest) instead of size, and "
                             "resize after the decode");
    }
    c->t->shape = (loom_shape){.rank = 3, .dim = {ii.h, ii.w, ii.c}};
    return map_into_buf(c, s->out_dt);
}

static int resize_apply(mapcall *c, loom_err *err) /* unbatched: (H, W[, C]) -> (h, w[, C]) float32 */
{
    const mapst *s = c->s;
    loom_tensor *t = c->t;
    int64_t H = t->shape.dim[0], W = t->shape.dim[1], C = t->shape.rank == 3 ? t->shape.dim[2] : 1;
    if (H < 1 || W < 1) {
        char m[96];
        snprintf(m, sizeof m, "an empty image (%lld x %lld) has nothing to resize", (long long)H, (long long)W);
        return elem_err(c->st, err, "resize", s->m.feature, c->pos, m);
    }
    image_resize_(t->data, t->dtype, H, W, C, (float *)c->buf, s->m.size[0], s->m.size[1]);
    t->shape.dim[0] = s->m.size[0];
    t->shape.dim[1] = s->m.size[1];
    return map_into_buf(c, LOOM_F32);
}

static int central_crop_apply(mapcall *c, loom_err *err) /* unbatched: (H, W[, C]) -> the central box */
{
    (void)err;
    loom_tensor *t = c->t;
    int64_t H = t->shape.dim[0], W = t->shape.dim[1], C = t->shape.rank == 3 ? t->shape.dim[2] : 1, b[4];
    image_central_box_(H, W, c->s->m.fraction, b);
    if (b[2] == H && b[3] == W) return LOOM_OK; /* all of it: pass the input through */
    size_t px = (size_t)C * loom_dtype_size(t->dtype), row = (size_t)b[3] * px;
    const uint8_t *src = t->data;
    for (int64_t r = 0; r < b[2]; r++) memcpy(c->buf + (size_t)r * row, src + (size_t)((b[0] + r) * W + b[1]) * px, row);
    t->shape.dim[0] = b[2];
    t->shape.dim[1] = b[3];
    return map_into_buf(c, t->dtype);
}

static int string_lookup_apply(mapcall *c, loom_err *err) /* (..., L) uint8 -> (...) int64 */
{
    const mapst *s = c->s;
    loom_tensor *t = c->t;
    size_t L = (size_t)t->shape.dim[t->shape.rank - 1], ns = L ? c->n / L : 0;
    int64_t *o = (int64_t *)c->buf, oov = s->m.num_oov_indices, per = elems_of(t, c->st->batch_dims);
    for (size_t i = 0; i < ns; i++) {
        const uint8_t *p = (const uint8_t *)t->data + i * L;
        size_t len = str_len(p, L);
        int64_t k = vocab_find(s, p, len);
        if (k < 0 && !oov) {
            char why[200];
            snprintf(why, sizeof why, "\"%.*s\" is not in the vocabulary (%lld strings), and num_oov_indices = 0",
                     (int)(len < 60 ? len : 60), (const char *)p, (long long)s->m.vocab->n);
            int64_t spe = per > 0 && ns >= (size_t)per ? (int64_t)ns / per : 1; /* strings per element */
            elem_err(c->st, err, "string_lookup", s->m.feature, c->pos + (int64_t)i / spe, why);
            return loom_err_hint(err, "set num_oov_indices = 1; to map unknown strings to id 0");
        }
        o[i] = k >= 0 ? oov + k : (int64_t)(loom_data_str_hash(p, len) % (uint64_t)oov);
    }
    t->shape.rank--;
    return map_into_buf(c, LOOM_I64);
}

/* random_brightness, random_contrast (unbatched): one draw per image, keyed by its position like random_crop. */
static int adjust_apply(mapcall *c, loom_err *err)
{
    (void)err;
    const mapst *s = c->s;
    loom_tensor *t = c->t;
    loom_rng g;
    loom_rng_init(&g, s->seed, (uint64_t)c->st->id, (uint64_t)c->epoch, (uint64_t)c->pos);
    double u = loom_rng_uniform64(&g);
    if (s->m.kind == LOOM_MAP_RANDOM_BRIGHTNESS) {
        image_brightness_(t->data, c->dst, t->dtype, c->n, -s->m.max_delta + 2 * s->m.max_delta * u);
    } else {
        int64_t C = t->shape.rank == 3 ? t->shape.dim[2] : 1;
        image_contrast_(t->data, c->dst, t->dtype, C ? (int64_t)c->n / C : 0, C,
                        s->m.lower + (s->m.upper - s->m.lower) * u);
    }
    return map_done(c);
}

static int standardize_apply(mapcall *c, loom_err *err)
{
    (void)err;
    loom_tensor *t = c->t;
    double mean, sd;
    stats_vals(t->data, t->dtype, c->n, &mean, &sd);
    double floor_sd = c->n ? 1.0 / sqrt((double)c->n) : 1.0;
    normalize_vals(t->data, t->dtype, c->dst, c->n, (float)mean, (float)(sd > floor_sd ? sd : floor_sd));
    return map_done(c);
}

/* Reentrant: reads only the stage's settings, writes e, buf and flags. One
 * indirect call per element (or batch) to the fn's apply, where a switch over
 * the kinds was. */
int map_apply_(const dstage *st, loom_elem *e, int writable, uint8_t *buf, uint8_t *flags, int64_t epoch, int64_t pos,
               int *mut, loom_err *err)
{
    if (custom_is_(st)) { /* every feature lands in buf */
        *mut = 1;
        return custom_apply_(st, e, buf, epoch, pos, err);
    }
    const mapst *s = (const mapst *)st;
    loom_tensor *t = &e->t[s->f];
    int inplace = writable && loom_dtype_size(t->dtype) == loom_dtype_size(s->out_dt);
    mapcall c = {.s = s, .st = st, .t = t, .n = (size_t)loom_shape_numel(&t->shape), .dst = inplace ? t->data : buf,
                 .buf = buf, .flags = flags, .epoch = epoch, .pos = pos, .writable = writable, .mut = mut};
    *mut = writable;
    return s->fn->apply(&c, err);
}

static int map_next(dstage *st, loom_elem **out, loom_err *err)
{
    mapst *s = (mapst *)st;
    loom_elem *e;
    int rc = dstage_next_(st->in, &e, err);
    if (rc) return rc;
    elem_copy_(&st->out, e);
    memcpy(st->mut, st->in->mut, sizeof st->mut);
    *out = &st->out;
    int64_t k = map_count_(st, &st->out);
    int mut;
    rc = map_apply_(st, &st->out, st->in->mut[s->f], s->buf, s->flags, s->epoch, s->pos, &mut, err);
    if (rc) return rc;
    st->mut[s->f] = (uint8_t)mut;
    s->pos += k;
    return LOOM_OK;
}

/* next() into dst (a prefetch's slot), for an elementwise fn (cast, scale,
 * normalize): it writes its feature there rather than into its own buffer,
 * and the other features are copied, as the fused chain does (optimize.c). */
static int map_next_into(dstage *st, loom_elem *dst, loom_err *err)
{
    mapst *s = (mapst *)st;
    loom_elem *in;
    int rc = dstage_next_(st->in, &in, err);
    if (rc) return rc;
    loom_elem e;
    elem_copy_(&e, in);
    int64_t k = map_count_(st, &e);
    int mut;
    rc = map_apply_(st, &e, 0, dst->t[s->f].data, s->flags, s->epoch, s->pos, &mut, err);
    if (rc) return rc;
    s->pos += k;
    for (int f = 0; f < dst->n; f++) {
        if (e.t[f].data != dst->t[f].data) memcpy(dst->t[f].data, e.t[f].data, loom_tensor_nbytes(&e.t[f]));
        dst->t[f].shape = e.t[f].shape;
    }
    return LOOM_OK;
}

/* A scale fused into the batch: the batch writes the feature scaled, into
 * dst's buffers; the map keeps its cursor (its state) as map_next does. */
static int map_fused_into(dstage *st, loom_elem *dst, loom_err *err)
{
    mapst *s = (mapst *)st;
    int rc = batch_next_scaled(st->in, dst, err);
    if (rc) return rc;
    s->pos += map_count_(st, dst);
    return LOOM_OK;
}

/* next() of a fused scale: the batch's other features in its own buffers, this one in the map's. */
static int map_fused_next(dstage *st, loom_elem **out, loom_err *err)
{
    mapst *s = (mapst *)st;
    elem_copy_(&st->out, &st->in->out);
    st->out.t[s->f].data = s->buf;
    st->out.t[s->f].dtype = LOOM_F32;
    int rc = map_fused_into(st, &st->out, err);
    if (rc) return rc;
    memcpy(st->mut, st->in->mut, sizeof st->mut);
    st->mut[s->f] = 1;
    *out = &st->out;
    return LOOM_OK;
}

static void map_close(dstage *st)
{
    mapst *s = (mapst *)st;
    loom_free(s->buf);
    loom_free(s->flags);
    loom_free(s->vtab);
    loom_free(s);
}

static const dstage_ops map_ops = {
    .next = map_next, .rewind = dcursor_stage_rewind_, .save = dcursor_stage_save_, .restore = dcursor_stage_restore_,
    .close = map_close,
};
static const dstage_ops map_into_ops = {
    .next = map_next, .rewind = dcursor_stage_rewind_, .save = dcursor_stage_save_, .restore = dcursor_stage_restore_,
    .close = map_close, .next_into = map_next_into,
};
static const dstage_ops map_fused_ops = {
    .next = map_fused_next, .rewind = dcursor_stage_rewind_, .save = dcursor_stage_save_, .restore = dcursor_stage_restore_,
    .close = map_close, .next_into = map_fused_into,
};

bool map_is_fused_(const dstage *st) { return st->ops == &map_fused_ops; }

bool map_fuse_into_batch_(dstage *st)
{
    if (st->ops != &map_into_ops) return false; /* (a Lua map is no mapst) */
    mapst *s = (mapst *)st;
    if (s->m.kind != LOOM_MAP_SCALE || !batch_fuse_scale(st->in, s->f, (float)s->m.scale, (float)s->m.offset)) return false;
    s->fused = 1;
    st->ops = &map_fused_ops;
    snprintf(st->name, sizeof st->name, "map(scale in the batch)");
    return true;
}

int map_fused_pull_(dstage *st, loom_elem *e, uint8_t *const *to, loom_err *err)
{
    mapst *s = (mapst *)st;
    LOOM_ASSERT(s->fused);
    elem_copy_(e, &st->in->out);
    for (int f = 0; f < e->n; f++)
        if (to[f]) e->t[f].data = to[f];
    if (!to[s->f]) e->t[s->f].data = s->buf;
    e->t[s->f].dtype = LOOM_F32;
    return batch_next_scaled(st->in, e, err);
}

static char *shape_str(const loom_shape *s, char *buf, size_t n) { return loom_shape_str(s, buf, n); }

/* Checks and resolves a reshape; fills the new spec and max shapes of feature f. */
static int reshape_check(mapst *s, loom_err *err)
{
    dstage *st = &s->s;
    int f = s->f, bd = st->batch_dims;
    const loom_map_spec *m = &s->m;
    loom_shape in = st->spec.shape[f];
    char a[128], b[128];
    if (m->rank < 0 || m->rank > 8 || bd + m->rank > LOOM_MAX_RANK)
        return dstage_err_(st, err, LOOM_ECONFIG, "map(reshape): target rank %d is out of range (at most %d after %d batch dims)",
                           m->rank, LOOM_MAX_RANK - bd, bd);
    int64_t numel = 1;
    for (int d = bd; d < in.rank; d++) {
        if (in.dim[d] < 0)
            return dstage_err_(st, err, LOOM_EUNSUPPORTED, "map(reshape) on \"%s\": the input shape %s has an unknown dimension",
                               st->spec.name[f], shape_str(&in, a, sizeof a));
        numel *= in.dim[d];
    }
    loom_shape tgt = {0};
    tgt.rank = m->rank;
    int infer = -1;
    int64_t known = 1;
    for (int d = 0; d < m->rank; d++) {
        tgt.dim[d] = m->shape[d];
        if (m->shape[d] == -1 && infer < 0) infer = d;
        else if (m->shape[d] < 0)
            return dstage_err_(st, err, LOOM_ECONFIG, "map(reshape): bad target shape %s (one dimension may be -1, the others >= 0)",
                               shape_str(&tgt, a, sizeof a));
        else known *= m->shape[d];
    }
    if (infer >= 0) {
        if (known == 0 || numel % known)
            return dstage_err_(st, err, LOOM_ESHAPE, "map(reshape) on \"%s\": cannot reshape %s (%lld values) to %s: %lld is not "
                               "a multiple of %lld", st->spec.name[f], shape_str(&in, a, sizeof a), (long long)numel,
                               shape_str(&tgt, b, sizeof b), (long long)numel, (long long)known);
        tgt.dim[infer] = numel / known;
    } else if (known != numel) {
        return dstage_err_(st, err, LOOM_ESHAPE, "map(reshape) on \"%s\": cannot reshape %s (%lld values) to %s (%lld values)",
                           st->spec.name[f], shape_str(&in, a, sizeof a), (long long)numel, shape_str(&tgt, b, sizeof b),
                           (long long)known);
    }
    loom_shape sp = {0}, mx = {0};
    sp.rank = mx.rank = bd + tgt.rank;
    for (int d = 0; d < bd; d++) {
        sp.dim[d] = in.dim[d];
        mx.dim[d] = st->maxshape[f].dim[d];
    }
    for (int d = 0; d < tgt.rank; d++) sp.dim[bd + d] = mx.dim[bd + d] = tgt.dim[d];
    st->spec.shape[f] = sp;
    st->maxshape[f] = mx;
    return LOOM_OK;
}

/* decode_image: uint8 [N] in, (H, W, C) out; -1 where images vary (max_size, channels 0). */
static int decode_check(mapst *s, loom_err *err)
{
    dstage *st = &s->s;
    const loom_map_spec *m = &s->m;
    loom_shape *sh = &st->spec.shape[s->f], *mx = &st->maxshape[s->f];
    char a[128];
    if (s->in_dt != LOOM_U8 || sh->rank != 1) {
        dstage_err_(st, err, LOOM_ESHAPE, "map(decode_image) needs the encoded image as uint8 bytes of shape [N], \"%s\" is "
                    "%s %s", m->feature, loom_dtype_name(s->in_dt), loom_shape_str(sh, a, sizeof a));
        return loom_err_hint(err, "in a tfrecord source declare it { dtype = \"uint8\"; shape = [N]; var_len = true; }, "
                             "N at least the largest encoded image's bytes");
    }
    if (m->dtype != LOOM_CFG_U8 && m->dtype != LOOM_CFG_F32)
        return dstage_err_(st, err, LOOM_ECONFIG, "map(decode_image): dtype must be uint8 or float32");
    if (m->channels < 0 || m->channels > 4)
        return dstage_err_(st, err, LOOM_ECONFIG, "map(decode_image): channels must be 0 (as stored) to 4, got %d", m->channels);
    bool vary = m->max_size[0] > 0;
    int64_t H = vary ? m->max_size[0] : m->size[0], W = vary ? m->max_size[1] : m->size[1];
    if (H < 1 || W < 1)
        return dstage_err_(st, err, LOOM_ECONFIG, "map(decode_image) needs size = [h, w] (every image that size) or "
                           "max_size = [h, w] (images up to that size)");
    s->out_dt = m->dtype == LOOM_CFG_F32 ? LOOM_F32 : LOOM_U8;
    *sh = (loom_shape){.rank = 3, .dim = {vary ? -1 : H, vary ? -1 : W, m->channels ? m->channels : -1}};
    *mx = (loom_shape){.rank = 3, .dim = {H, W, m->channels ? m->channels : 4}};
    snprintf(st->desc, sizeof st->desc, "map(decode_image,%s,%d,%s,%s%lld,%lld)", m->feature, m->channels,
             loom_dtype_name(s->out_dt), vary ? "max_size," : "", (long long)H, (long long)W);
    return LOOM_OK;
}

static int cast_check(mapst *s, loom_err *err)
{
    dstage *st = &s->s;
    if ((unsigned)s->m.dtype >= LOOM_NDTYPES_) return dstage_err_(st, err, LOOM_ECONFIG, "map(cast): bad dtype %d", (int)s->m.dtype);
    s->out_dt = (loom_dtype)s->m.dtype;
    s->no_buf = s->out_dt == s->in_dt; /* the input passes through */
    snprintf(st->desc, sizeof st->desc, "map(cast,%s,%s)", s->m.feature, loom_dtype_name(s->out_dt));
    return LOOM_OK;
}

static int scale_check(mapst *s, loom_err *err)
{
    (void)err;
    s->out_dt = LOOM_F32;
    snprintf(s->s.desc, sizeof s->s.desc, "map(scale,%s,%.17g,%.17g)", s->m.feature, s->m.scale, s->m.offset);
    return LOOM_OK;
}

static int normalize_check(mapst *s, loom_err *err)
{
    dstage *st = &s->s;
    const loom_shape *sh = &st->spec.shape[s->f];
    char a[128];
    if (s->m.adapt && !s->m.n_norm) {
        dstage_err_(st, err, LOOM_ECONFIG, "map(normalize) on \"%s\": adapt = true, but no numbers were adapted from "
                    "data.train for it", s->m.feature);
        return loom_err_hint(err, "loom train computes them (and caches them in model_dir/adapt.txt) before evaluate, "
                                  "predict or export can use them");
    }
    if (!(s->m.std > 0)) return dstage_err_(st, err, LOOM_ECONFIG, "map(normalize): std must be > 0, got %g", s->m.std);
    int64_t L = sh->rank > st->batch_dims ? sh->dim[sh->rank - 1] : 1;
    if (s->m.n_norm > 1 && L != s->m.n_norm) {
        dstage_err_(st, err, LOOM_ESHAPE, "map(normalize) on \"%s\": %d mean/std values, but the feature has shape %s, "
                    "whose last axis has %lld", s->m.feature, s->m.n_norm, loom_shape_str(sh, a, sizeof a), (long long)L);
        return loom_err_hint(err, "give one value per index of the last axis, or one number for all");
    }
    s->out_dt = LOOM_F32;
    uint64_t h = 0xcbf29ce484222325ull; /* the values in the stage's identity (cache keys) */
    for (int i = 0; i < s->m.n_norm; i++) {
        float v[2] = {s->m.mean_v[i], s->m.std_v[i]};
        const unsigned char *p = (const unsigned char *)v;
        for (size_t k = 0; k < sizeof v; k++) h = (h ^ p[k]) * 0x100000001b3ull;
    }
    if (s->m.n_norm)
        snprintf(st->desc, sizeof st->desc, "map(normalize,%s,%d,%016llx)", s->m.feature, s->m.n_norm, (unsigned long long)h);
    else
        snprintf(st->desc, sizeof st->desc, "map(normalize,%s,%.17g,%.17g)", s->m.feature, s->m.mean, s->m.std);
    return LOOM_OK;
}

static int string_lookup_check(mapst *s, loom_err *err)
{
    dstage *st = &s->s;
    loom_shape *sh = &st->spec.shape[s->f], *mx = &st->maxshape[s->f];
    char a[128];
    if (s->in_dt != LOOM_U8 || sh->rank <= st->batch_dims) {
        dstage_err_(st, err, LOOM_ESHAPE, "map(string_lookup) needs a string feature (uint8 bytes, the last axis one "
                    "string), \"%s\" is %s %s", s->m.feature, loom_dtype_name(s->in_dt), loom_shape_str(sh, a, sizeof a));
        return loom_err_hint(err, "strings come from a csv column with dtype = \"string\" or the text source's \"line\"; a "
                                  "number feature needs no lookup (one_hot or an embedding take int ids)");
    }
    if (!s->m.vocab) {
        dstage_err_(st, err, LOOM_ECONFIG, "map(string_lookup) on \"%s\": adapt = true, but no vocabulary was adapted "
                    "from data.train for it", s->m.feature);
        return loom_err_hint(err, "loom train adapts it (and keeps it in model_dir/adapt.txt and its checkpoints) before "
                                  "evaluate, predict or export can use it");
    }
    int rc = vocab_table(s, err);
    if (rc) return rc;
    s->out_dt = LOOM_I64;
    sh->rank--;
    mx->rank--;
    snprintf(st->desc, sizeof st->desc, "map(string_lookup,%s,%d,%lld,%016llx)", s->m.feature, s->m.num_oov_indices,
             (long long)s->m.vocab->n, (unsigned long long)s->m.vocab->digest);
    return LOOM_OK;
}

static int one_hot_check(mapst *s, loom_err *err)
{
    dstage *st = &s->s;
    loom_shape *sh = &st->spec.shape[s->f], *mx = &st->maxshape[s->f];
    char a[128];
    if (!is_int(s->in_dt))
        return dstage_err_(st, err, LOOM_ESHAPE, "map(one_hot) needs an integer feature, \"%s\" is %s", s->m.feature,
                           loom_dtype_name(s->in_dt));
    if (s->m.depth < 1 || sh->rank >= LOOM_MAX_RANK)
        return dstage_err_(st, err, LOOM_ECONFIG, "map(one_hot) on \"%s\": depth %d with shape %s is not possible (depth >= 1, "
                           "rank < %d)", s->m.feature, s->m.depth, loom_shape_str(sh, a, sizeof a), LOOM_MAX_RANK);
    s->out_dt = LOOM_F32;
    sh->dim[sh->rank++] = s->m.depth;
    mx->dim[mx->rank++] = s->m.depth;
    snprintf(st->desc, sizeof st->desc, "map(one_hot,%s,%d)", s->m.feature, s->m.depth);
    return LOOM_OK;
}

static int reshape_open_check(mapst *s, loom_err *err)
{
    dstage *st = &s->s;
    char a[128];
    int rc = reshape_check(s, err);
    if (rc) return rc;
    s->no_buf = 1; /* a view */
    snprintf(st->desc, sizeof st->desc, "map(reshape,%s,%s)", s->m.feature, loom_shape_str(&st->spec.shape[s->f], a, sizeof a));
    return LOOM_OK;
}

static int flip_check(mapst *s, loom_err *err)
{
    dstage *st = &s->s;
    int bd = st->batch_dims, r = st->spec.shape[s->f].rank - bd;
    const loom_shape *mx = &st->maxshape[s->f];
    char a[128];
    if (r != 2 && r != 3)
        return dstage_err_(st, err, LOOM_ESHAPE, "map(random_flip_left_right) needs images (H, W) or (H, W, C), \"%s\" has shape %s",
                           s->m.feature, loom_shape_str(&st->spec.shape[s->f], a, sizeof a));
    int64_t images = 1;
    for (int d = 0; d < bd; d++) images *= mx->dim[d];
    s->flag_bytes = (size_t)images + 1;
    s->flags = loom_alloc(s->flag_bytes);
    if (!s->flags) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate flip flags");
    snprintf(st->desc, sizeof st->desc, "map(flip_lr,%s)", s->m.feature);
    return LOOM_OK;
}

static int sleep_check(mapst *s, loom_err *err)
{
    if (!(s->m.ms >= 0)) return dstage_err_(&s->s, err, LOOM_ECONFIG, "map(sleep): ms must be >= 0, got %g", s->m.ms);
    s->no_buf = 1; /* values untouched */
    snprintf(s->s.desc, sizeof s->s.desc, "map(sleep,%s,%.17g)", s->m.feature, s->m.ms);
    return LOOM_OK;
}

/* The image fns apply to single elements. */
static int unbatched(mapst *s, loom_err *err)
{
    dstage *st = &s->s;
    char a[128];
    if (st->batch_dims > 0)
        return dstage_err_(st, err, LOOM_ECONFIG, "map(%s) on \"%s\" applies to single elements, but the elements here are "
                           "batched %s: put it before the batch", s->fn->name, s->m.feature,
                           loom_shape_str(&st->spec.shape[s->f], a, sizeof a));
    return LOOM_OK;
}

/* Single elements that are images (H, W) or (H, W, C). */
static int images(mapst *s, loom_err *err)
{
    dstage *st = &s->s;
    const loom_shape *sh = &st->spec.shape[s->f];
    char a[128];
    int rc = unbatched(s, err);
    if (!rc && sh->rank != 2 && sh->rank != 3)
        rc = dstage_err_(st, err, LOOM_ESHAPE, "map(%s) needs images (H, W) or (H, W, C), \"%s\" has shape %s", s->fn->name,
                         s->m.feature, loom_shape_str(sh, a, sizeof a));
    return rc;
}

static int standardize_check(mapst *s, loom_err *err)
{
    int rc = unbatched(s, err);
    if (rc) return rc;
    s->out_dt = LOOM_F32;
    snprintf(s->s.desc, sizeof s->s.desc, "map(per_image_standardization,%s)", s->m.feature);
    return LOOM_OK;
}

static int decode_image_check(mapst *s, loom_err *err)
{
    int rc = unbatched(s, err);
    return rc ? rc : decode_check(s, err);
}

static int pad_check(mapst *s, loom_err *err)
{
    dstage *st = &s->s;
    const loom_map_spec *m = &s->m;
    loom_shape *sh = &st->spec.shape[s->f], *mx = &st->maxshape[s->f];
    int rc = images(s, err);
    if (rc) return rc;
    if (m->padding < 0) return dstage_err_(st, err, LOOM_ECONFIG, "map(pad): padding must be >= 0, got %d", m->padding);
    static const double lo[] = {[LOOM_U8] = 0, [LOOM_I32] = -2147483648.0, [LOOM_I64] = -9223372036854775808.0};
    static const double hi[] = {[LOOM_U8] = 255, [LOOM_I32] = 2147483647.0, [LOOM_I64] = 9223372036854774784.0};
    if (is_int(s->in_dt) && (m->value != floor(m->value) || m->value < lo[s->in_dt] || m->value > hi[s->in_dt]))
        return dstage_err_(st, err, LOOM_ECONFIG, "map(pad) on \"%s\": value %g is not a %s value", m->feature, m->value,
                           loom_dtype_name(s->in_dt));
    for (int d = 0; d < 2; d++) {
        if (sh->dim[d] >= 0) sh->dim[d] += 2 * (int64_t)m->padding;
        mx->dim[d] += 2 * (int64_t)m->padding;
    }
    snprintf(st->desc, sizeof st->desc, "map(pad,%s,%d,%.17g)", m->feature, m->padding, m->value);
    return LOOM_OK;
}

static int resize_check(mapst *s, loom_err *err)
{
    dstage *st = &s->s;
    const loom_map_spec *m = &s->m;
    int rc = images(s, err);
    if (rc) return rc;
    if (m->size[0] < 1 || m->size[1] < 1)
        return dstage_err_(st, err, LOOM_ECONFIG, "map(resize): size [%d, %d] must be at least 1 x 1", m->size[0], m->size[1]);
    for (int d = 0; d < 2; d++) st->spec.shape[s->f].dim[d] = st->maxshape[s->f].dim[d] = m->size[d];
    s->out_dt = LOOM_F32;
    snprintf(st->desc, sizeof st->desc, "map(resize,%s,%d,%d)", m->feature, m->size[0], m->size[1]);
    return LOOM_OK;
}

static int central_crop_check(mapst *s, loom_err *err)
{
    dstage *st = &s->s;
    const loom_map_spec *m = &s->m;
    loom_shape *sh = &st->spec.shape[s->f], *mx = &st->maxshape[s->f];
    int rc = images(s, err);
    if (rc) return rc;
    if (!(m->fraction > 0 && m->fraction <= 1))
        return dstage_err_(st, err, LOOM_ECONFIG, "map(central_crop): fraction must be in (0, 1], got %g", m->fraction);
    int64_t b[4];
    image_central_box_(sh->dim[0], sh->dim[1], m->fraction, b);
    for (int d = 0; d < 2; d++) /* an unknown size keeps its bound: the box is never larger than the image */
        if (sh->dim[d] >= 0) sh->dim[d] = mx->dim[d] = b[2 + d];
    snprintf(st->desc, sizeof st->desc, "map(central_crop,%s,%.17g)", m->feature, m->fraction);
    return LOOM_OK;
}

/* random_brightness, random_contrast */
static int adjust_check(mapst *s, loom_err *err)
{
    dstage *st = &s->s;
    const loom_map_spec *m = &s->m;
    const char *kn = s->fn->name;
    int rc = images(s, err);
    if (rc) return rc;
    if (s->in_dt != LOOM_U8 && s->in_dt != LOOM_F32 && s->in_dt != LOOM_F64) {
        dstage_err_(st, err, LOOM_ESHAPE, "map(%s) needs uint8 or float pixels, \"%s\" is %s", kn, m->feature,
                    loom_dtype_name(s->in_dt));
        return loom_err_hint(err, "cast it to float32 first (map fn = \"cast\")");
    }
    bool bright = m->kind == LOOM_MAP_RANDOM_BRIGHTNESS;
    if (bright ? !(m->max_delta >= 0) : !(m->lower >= 0 && m->lower < m->upper))
        return dstage_err_(st, err, LOOM_ECONFIG, bright ? "map(%s): max_delta must be >= 0" : "map(%s): needs 0 <= lower < upper",
                           kn);
    if (bright) snprintf(st->desc, sizeof st->desc, "map(random_brightness,%s,%.17g)", m->feature, m->max_delta);
    else snprintf(st->desc, sizeof st->desc, "map(random_contrast,%s,%.17g,%.17g)", m->feature, m->lower, m->upper);
    return LOOM_OK;
}

static int random_crop_check(mapst *s, loom_err *err)
{
    dstage *st = &s->s;
    const loom_map_spec *m = &s->m;
    loom_shape *sh = &st->spec.shape[s->f], *mx = &st->maxshape[s->f];
    char a[128];
    int rc = images(s, err);
    if (rc) return rc;
    for (int d = 0; d < 2; d++)
        if (m->size[d] < 1 || mx->dim[d] < m->size[d])
            return dstage_err_(st, err, LOOM_ECONFIG, "map(random_crop) on \"%s\": crop size [%d, %d] does not fit in the "
                               "input %s", m->feature, m->size[0], m->size[1], loom_shape_str(sh, a, sizeof a));
    for (int d = 0; d < 2; d++) sh->dim[d] = mx->dim[d] = m->size[d];
    snprintf(st->desc, sizeof st->desc, "map(random_crop,%s,%d,%d)", m->feature, m->size[0], m->size[1]);
    return LOOM_OK;
}

/* tokenize is a stage of its own (text.c; map_open_ hands it there first):
 * its entry is here so that the registry names every fn, and is never run. */
static int tokenize_entry_check(mapst *s, loom_err *err)
{
    return dstage_err_(&s->s, err, LOOM_ECONFIG, "map(tokenize) runs as a stage of its own (text.c)");
}

/* The built-in map fns, registered in LOOM_REG_TRANSFORM under config's fn
 * names (loom_map_kind_name: one list; "lua" is the Lua provider's). name:
 * filled at registration, so not const for that one write. */
static dmapfn mapfns[] = {
    {DMAPFN_BUILTIN, NULL, LOOM_MAP_CAST, cast_check, cast_apply},
    {DMAPFN_BUILTIN, NULL, LOOM_MAP_SCALE, scale_check, scale_apply},
    {DMAPFN_BUILTIN, NULL, LOOM_MAP_NORMALIZE, normalize_check, normalize_apply},
    {DMAPFN_BUILTIN, NULL, LOOM_MAP_ONE_HOT, one_hot_check, one_hot_apply},
    {DMAPFN_BUILTIN, NULL, LOOM_MAP_RESHAPE, reshape_open_check, reshape_apply},
    {DMAPFN_BUILTIN, NULL, LOOM_MAP_FLIP_LR, flip_check, flip_apply},
    {DMAPFN_BUILTIN, NULL, LOOM_MAP_PAD, pad_check, pad_apply},
    {DMAPFN_BUILTIN, NULL, LOOM_MAP_RANDOM_CROP, random_crop_check, random_crop_apply},
    {DMAPFN_BUILTIN, NULL, LOOM_MAP_STANDARDIZE, standardize_check, standardize_apply},
    {DMAPFN_BUILTIN, NULL, LOOM_MAP_SLEEP, sleep_check, sleep_apply},
    {DMAPFN_BUILTIN, NULL, LOOM_MAP_DECODE_IMAGE, decode_image_check, decode_image_apply},
    {DMAPFN_BUILTIN, NULL, LOOM_MAP_RESIZE, resize_check, resize_apply},
    {DMAPFN_BUILTIN, NULL, LOOM_MAP_CENTRAL_CROP, central_crop_check, central_crop_apply},
    {DMAPFN_BUILTIN, NULL, LOOM_MAP_RANDOM_BRIGHTNESS, adjust_check, adjust_apply},
    {DMAPFN_BUILTIN, NULL, LOOM_MAP_RANDOM_CONTRAST, adjust_check, adjust_apply},
    {DMAPFN_BUILTIN, NULL, LOOM_MAP_STRING_LOOKUP, string_lookup_check, string_lookup_apply},
    {DMAPFN_BUILTIN, NULL, LOOM_MAP_TOKENIZE, tokenize_entry_check, NULL},
};

int dmapfn_register_(loom_err *err)
{
    int rc = LOOM_OK;
    for (int i = 0; !rc && i < (int)(sizeof mapfns / sizeof mapfns[0]); i++) {
        if (!mapfns[i].name) mapfns[i].name = loom_map_kind_name(mapfns[i].kind);
        LOOM_ASSERT(strcmp(mapfns[i].name, "?")); /* config names every fn this table has */
        if (loom_registry_find(LOOM_REG_TRANSFORM, mapfns[i].name, NULL) != &mapfns[i])
            rc = loom_registry_add(LOOM_REG_TRANSFORM, mapfns[i].name, &mapfns[i], NULL, err);
    }
    return rc;
}

int map_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, const loom_data_ctx *ctx, loom_err *err)
{
    if (t->map.kind == LOOM_MAP_LUA) return custom_map_open_(out, in, id, t, ctx, err);
    if (t->map.kind == LOOM_MAP_TOKENIZE) return tokenize_open_(out, in, id, t, err);
    mapst *s = loom_calloc(1, sizeof *s);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a map stage");
    dstage *st = &s->s;
    dstage_init_(st, &map_ops, in, id, &t->loc);
    s->m = t->map;
    s->seed = ctx->seed;
    int rc = loom_data_init(err);
    if (rc) goto fail;
    s->fn = loom_registry_find(LOOM_REG_TRANSFORM, loom_map_kind_name(s->m.kind), NULL);
    if (!s->fn || s->fn->version != DMAPFN_BUILTIN) {
        char names[512];
        s->fn = NULL;
        rc = dstage_err_(st, err, LOOM_ECONFIG, "unknown map fn %d (built in: %s)", (int)s->m.kind,
                         dxform_names_(DMAPFN_BUILTIN, names, sizeof names));
        goto fail;
    }
    const char *kn = s->fn->name;
    snprintf(st->name, sizeof st->name, "map(%s)", kn);
    s->f = loom_elem_spec_find(&st->spec, s->m.feature);
    if (s->f < 0) {
        char avail[LOOM_MAX_FEATURES * (LOOM_NAME_MAX + 2)] = "";
        size_t k = 0;
        for (int i = 0; i < st->spec.n; i++) k += (size_t)snprintf(avail + k, sizeof avail - k, "%s%s", i ? ", " : "", st->spec.name[i]);
        rc = dstage_err_(st, err, LOOM_ECONFIG, "map(%s): no feature \"%s\" (available: %s)", kn, s->m.feature, avail);
        goto fail;
    }
    s->in_dt = s->out_dt = st->spec.dtype[s->f];
    if ((rc = s->fn->check(s, err))) goto fail;
    st->spec.dtype[s->f] = s->out_dt;
    if (!s->no_buf) {
        const loom_shape *mx = &st->maxshape[s->f];
        size_t bytes = (size_t)loom_shape_numel(mx) * loom_dtype_size(s->out_dt);
        s->buf_bytes = bytes ? bytes : 1;
        s->buf = loom_alloc_aligned(s->buf_bytes);
        if (!s->buf) {
            rc = loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate %zu bytes for map(%s)", bytes, kn);
            goto fail;
        }
        dstage_gauge_(&st->st_bytes, (int64_t)s->buf_bytes);
    }
    loom_map_kind mk = s->m.kind;
    if (mk == LOOM_MAP_CAST || mk == LOOM_MAP_SCALE || mk == LOOM_MAP_NORMALIZE) st->ops = &map_into_ops;
    *out = st;
    return LOOM_OK;
fail:
    map_close(st);
    return rc;
}

/* ---- shuffle -----------------------------------------------------------------
 * tf.data ShuffleDataset (shuffle_dataset_op.cc): fill the buffer up to
 * buffer_size, pick a uniform index among the buffered elements, emit it and
 * move the oldest buffered element into the hole; refill one per emission.
 * The buffer is a ring of slot ids (perm) over a slot pool, so moving an
 * element is moving an id; the emitted slot stays lent until the next call.
 * Index mode, when the input has random access (get) and a known finite
 * cardinality: the same algorithm on the input's positions 0, 1, 2, ... of
 * the pass, the ring holding positions rather than slot ids and an emitted
 * position read with get. The draws, and so the output, are those of element
 * mode bit for bit; the buffer is 8 bytes an element and fills without
 * reading anything, and the input's cursor stays where rewind put it. */

typedef struct shufst {
    dstage    s;
    int64_t   size;        /* buffer_size */
    uint64_t  seed;
    int       reshuffle;
    int       by_index;    /* index mode: perm holds input positions, there is no pool */
    elem_pool pool;
    int64_t  *perm;        /* ring of cap slot ids (index mode: positions); logical positions [start, end) */
    int64_t   cap;         /* ring size: pool.cap, or in index mode the most the buffer can hold */
    int64_t  *freel;       /* free slot ids */
    int64_t   nfree;
    int64_t   start, end;
    int64_t   lent;        /* slot lent out, -1 */
    int64_t   next_in;     /* index mode: the input position the buffer takes next */
    int       eoi;         /* input exhausted this pass */
    int64_t   epoch;
    loom_rng  rng;
    /* element mode: the next draw made ahead for shuf_prefetch_next, used
     * when the next call draws among pre_live elements (else drawn again):
     * the offset from start, and the RNG after it. Never saved. */
    int       pre_valid;
    int64_t   pre_live, pre_k;
    loom_rng  pre_rng;
} shufst;

static void shuf_reset(shufst *s, int64_t epoch)
{
    s->start = s->end = 0;
    s->lent = -1;
    s->next_in = 0;
    s->eoi = 0;
    s->epoch = epoch;
    s->pre_valid = 0;
    s->nfree = 0;
    if (!s->by_index)
        for (int64_t i = s->pool.cap - 1; i >= 0; i--) s->freel[s->nfree++] = i;
    loom_rng_init(&s->rng, s->seed, (uint64_t)s->s.id, s->reshuffle ? (uint64_t)epoch : 0, 0);
    dstage_gauge_(&s->s.st_buffered, 0);
}

/* Grows the pool (and ring) to cap, keeping the buffered elements' order. */
static int shuf_grow(shufst *s, int64_t cap, loom_err *err)
{
    int64_t old = s->pool.cap, live = s->end - s->start;
    int64_t *perm = loom_alloc((size_t)cap * sizeof *perm), *freel = loom_alloc((size_t)cap * sizeof *freel);
    if (!perm || !freel || elem_pool_grow_(&s->pool, cap, err)) {
        loom_free(perm);
        loom_free(freel);
        return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot grow the shuffle buffer to %lld elements", (long long)cap);
    }
    for (int64_t i = 0; i < live; i++) perm[i] = s->perm[(s->start + i) % old];
    if (s->freel) memcpy(freel, s->freel, (size_t)s->nfree * sizeof *freel);
    for (int64_t i = cap - 1; i >= old; i--) freel[s->nfree++] = i;
    loom_free(s->perm);
    loom_free(s->freel);
    s->perm = perm;
    s->freel = freel;
    s->cap = cap;
    s->start = 0;
    s->end = live;
    dstage_gauge_(&s->s.st_capacity, s->size);
    return LOOM_OK;
}

/* The input's next element written straight into free slot `slot` by its
 * next_into (fixed shapes only): the element is made where it is buffered
 * instead of being made in the input's buffer and copied (3 KB a
 * Fashion-MNIST float image). The elements are the same: next_into yields
 * what next would. */
static int shuf_next_into_slot(shufst *s, int64_t slot, loom_err *err)
{
    dstage *st = &s->s;
    loom_elem v;
    elem_pool_view_(&s->pool, slot, &v);
    for (int f = 0; f < v.n; f++) memset(&v.t[f].shape, 0, sizeof v.t[f].shape); /* set by next_into */
    int rc = dstage_next_into_(st->in, &v, err);
    if (rc) return rc;
    for (int f = 0; f < v.n; f++)
        if (!loom_shape_eq(&v.t[f].shape, &s->pool.shape[f])) {
            char a[128], b[128];
            return dstage_err_(st, err, LOOM_ESHAPE, "shuffle: feature \"%s\" has shape %s, not its declared %s",
                               st->spec.name[f], loom_shape_str(&v.t[f].shape, a, sizeof a),
                               loom_shape_str(&s->pool.shape[f], b, sizeof b));
        }
    return LOOM_OK;
}

/* Fills the buffer up to size: element mode puts input elements into free
 * slots (made there by the input's next_into when it has one and the shapes
 * are fixed, else copied). */
static int shuf_fill_elems(shufst *s, loom_err *err)
{
    dstage *st = &s->s;
    int into = st->in->ops->next_into && !s->pool.varshape;
    while (!s->eoi && s->end - s->start < s->size) {
        if (s->nfree == 0) {
            int64_t cap = s->pool.cap * 2 < 64 ? 64 : s->pool.cap * 2;
            int rc = shuf_grow(s, cap < s->size ? cap : s->size, err);
            if (rc) return rc;
        }
        int64_t slot = s->freel[s->nfree - 1];
        int rc;
        if (into) {
            rc = shuf_next_into_slot(s, slot, err);
        } else {
            loom_elem *e;
            rc = dstage_next_(st->in, &e, err);
            if (rc == LOOM_OK && (rc = elem_pool_put_(&s->pool, slot, e, err)))
                return dstage_err_(st, err, rc, "shuffle: %s", err->msg);
        }
        if (rc == LOOM_EEOF) {
            s->eoi = 1;
            break;
        }
        if (rc) return rc;
        s->nfree--;
        s->perm[s->end++ % s->cap] = slot;
    }
    return LOOM_OK;
}

/* Element mode, after a draw that left `left` elements buffered: the slot
 * the next call will most likely draw (the buffer refilled by one unless
 * the input has ended) is fetched into the cache while the caller copies
 * this element (a batch row), as the slots lie at random in a buffer of
 * tens of MiB. The draw is made now on a copy of the RNG and kept: the
 * next call uses it (and that RNG) when it draws among as many elements,
 * else draws anew, so the draws, the RNG's state and the elements are
 * those of drawing in turn. The element the refill adds goes into the slot
 * lent now, which is in the cache already. */
static void shuf_prefetch_next(shufst *s, int64_t left)
{
    int64_t live = s->eoi ? left : left + 1;
    if (live <= 0) return;
    s->pre_rng = s->rng;
    s->pre_k = (int64_t)loom_rng_below(&s->pre_rng, (uint64_t)live);
    s->pre_live = live;
    s->pre_valid = 1;
    int64_t k = s->pre_k;
    if (k == left) return; /* the element the refill adds */
    int64_t slot = s->perm[(s->start + k) % s->cap];
    for (int f = 0; f < s->pool.nf; f++) {
        const uint8_t *p = s->pool.data[f] + (size_t)slot * s->pool.slot_bytes[f];
        size_t n = s->pool.slot_bytes[f] < 16384 ? s->pool.slot_bytes[f] : 16384;
        for (size_t o = 0; o < n; o += 64) __builtin_prefetch(p + o);
    }
}

static int shuf_next(dstage *st, loom_elem **out, loom_err *err)
{
    shufst *s = (shufst *)st;
    if (s->by_index) {
        /* "pulling" position next_in; past the pass's end is the input's EOF */
        while (!s->eoi && s->end - s->start < s->size) {
            if (s->next_in >= st->in->card) s->eoi = 1;
            else s->perm[s->end++ % s->cap] = s->next_in++;
        }
    } else {
        if (s->lent >= 0) {
            s->freel[s->nfree++] = s->lent;
            s->lent = -1;
        }
        int rc = shuf_fill_elems(s, err);
        if (rc) return rc;
    }
    int64_t live = s->end - s->start, cap = s->cap;
    if (live == 0) {
        dstage_gauge_(&st->st_buffered, 0);
        return LOOM_EEOF;
    }
    int64_t k;
    if (s->pre_valid && s->pre_live == live) { /* drawn ahead by shuf_prefetch_next */
        k = s->pre_k;
        s->rng = s->pre_rng;
    } else {
        k = (int64_t)loom_rng_below(&s->rng, (uint64_t)live);
    }
    s->pre_valid = 0;
    int64_t j = (s->start + k) % cap;
    int64_t slot = s->perm[j];
    s->perm[j] = s->perm[s->start % cap];
    s->start++;
    dstage_gauge_(&st->st_buffered, live - 1);
    if (s->by_index) {
        int rc = dstage_get_(st->in, slot, out, err);
        if (rc) return rc;
        memcpy(st->mut, st->in->mut, sizeof st->mut); /* the input's element, as the input lends it */
        return LOOM_OK;
    }
    s->lent = slot;
    elem_pool_view_(&s->pool, slot, &st->out);
    *out = &st->out;
    shuf_prefetch_next(s, live - 1);
    return LOOM_OK;
}

/* Index mode's next() as positions (a batch's gather): the same fill and
 * draws as shuf_next, without the get. */
static int shuf_draw(dstage *st, int64_t *pos, int64_t n, int64_t *got, loom_err *err)
{
    (void)err;
    shufst *s = (shufst *)st;
    LOOM_ASSERT(s->by_index);
    int64_t k = 0, cap = s->cap, card = st->in->card;
    for (; k < n; k++) {
        while (!s->eoi && s->end - s->start < s->size) {
            if (s->next_in >= card) s->eoi = 1;
            else s->perm[s->end++ % cap] = s->next_in++;
        }
        int64_t live = s->end - s->start;
        if (live == 0) break;
        int64_t j = (s->start + (int64_t)loom_rng_below(&s->rng, (uint64_t)live)) % cap;
        pos[k] = s->perm[j];
        s->perm[j] = s->perm[s->start % cap];
        s->start++;
    }
    dstage_gauge_(&st->st_buffered, s->end - s->start);
    *got = k;
    return LOOM_OK;
}

static int shuf_rewind(dstage *st, int64_t epoch, loom_err *err)
{
    shuf_reset((shufst *)st, epoch);
    return st->in->ops->rewind(st->in, epoch, err);
}

/* Element mode: epoch, eoi, rng, the buffered elements. Index mode: epoch,
 * eoi, rng, next_in, the buffered positions (the pipeline fingerprint tells
 * the two apart: the desc differs). */
static void shuf_save(dstage *st, loom_buf *b)
{
    shufst *s = (shufst *)st;
    loom_buf_put_i64(b, s->epoch);
    loom_buf_put_u32(b, (uint32_t)s->eoi);
    loom_rng_save(&s->rng, b);
    if (s->by_index) loom_buf_put_i64(b, s->next_in);
    loom_buf_put_i64(b, s->end - s->start);
    for (int64_t i = s->start; i < s->end; i++) {
        if (s->by_index) loom_buf_put_i64(b, s->perm[i % s->cap]);
        else elem_pool_save_(&s->pool, s->perm[i % s->cap], b);
    }
}

static int shuf_restore(dstage *st, loom_buf *b, loom_err *err)
{
    shufst *s = (shufst *)st;
    int64_t epoch = loom_buf_get_i64(b);
    shuf_reset(s, epoch);
    s->eoi = (int)loom_buf_get_u32(b);
    int bad = loom_rng_restore(&s->rng, b);
    if (s->by_index) s->next_in = loom_buf_get_i64(b);
    int64_t live = loom_buf_get_i64(b);
    bool bad_pos = s->by_index && (s->next_in < 0 || s->next_in > st->in->card || live > s->next_in || live > s->cap);
    if (bad || bad_pos || b->failed || live < 0 || live > s->size)
        return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "iterator state is corrupt (shuffle buffer)");
    if (!s->by_index && live > s->pool.cap && shuf_grow(s, live, err)) return err->code;
    for (int64_t i = 0; i < live; i++) {
        if (s->by_index) {
            s->perm[i] = loom_buf_get_i64(b);
            if (b->failed || s->perm[i] < 0 || s->perm[i] >= s->next_in)
                return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "iterator state is corrupt (shuffle buffer index)");
            continue;
        }
        int rc = elem_pool_load_(&s->pool, i, b, err);
        if (rc) return rc;
        s->perm[i] = i;
    }
    s->start = 0;
    s->end = live;
    s->nfree = 0;
    if (!s->by_index)
        for (int64_t i = s->pool.cap - 1; i >= live; i--) s->freel[s->nfree++] = i;
    dstage_gauge_(&st->st_buffered, live);
    return LOOM_OK;
}

static void shuf_close(dstage *st)
{
    shufst *s = (shufst *)st;
    elem_pool_fini_(&s->pool);
    loom_free(s->perm);
    loom_free(s->freel);
    loom_free(s);
}

static const dstage_ops shuf_ops = {
    .next = shuf_next, .rewind = shuf_rewind, .save = shuf_save, .restore = shuf_restore, .close = shuf_close,
};
static const dstage_ops shuf_index_ops = { /* index mode: draws positions for a batch's gather too */
    .next = shuf_next, .rewind = shuf_rewind, .save = shuf_save, .restore = shuf_restore, .close = shuf_close,
    .draw = shuf_draw,
};

bool shuffle_by_index_(const dstage *in) { return in->ops->get && in->card >= 0; }

int shuffle_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, const loom_data_ctx *ctx, loom_err *err)
{
    shufst *s = loom_calloc(1, sizeof *s);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a shuffle stage");
    dstage *st = &s->s;
    dstage_init_(st, &shuf_ops, in, id, &t->loc);
    s->size = t->buffer;
    s->seed = t->seed_set ? t->seed : ctx->seed;
    s->reshuffle = t->reshuffle;
    s->by_index = shuffle_by_index_(in);
    if (s->by_index) st->ops = &shuf_index_ops;
    snprintf(st->name, sizeof st->name, s->by_index ? "shuffle(indices)" : "shuffle");
    snprintf(st->desc, sizeof st->desc, "shuffle(%s%lld,%llu,%d)", s->by_index ? "indices," : "", (long long)s->size,
             (unsigned long long)s->seed, s->reshuffle);
    int rc;
    if (s->size < 1) {
        rc = dstage_err_(st, err, LOOM_ECONFIG, "shuffle: buffer must be >= 1, got %lld", (long long)s->size);
        goto fail;
    }
    /* with a known cardinality the buffer never holds more than one pass */
    int64_t cap = in->card >= 0 ? (in->card < s->size ? in->card : s->size) : (s->size < 1024 ? s->size : 1024);
    if (cap < 1) cap = 1;
    if (s->by_index) {
        s->cap = cap;
        if (!(s->perm = loom_alloc((size_t)cap * sizeof *s->perm))) {
            rc = loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the shuffle buffer of %lld indices",
                              (long long)cap);
            goto fail;
        }
        dstage_gauge_(&st->st_bytes, cap * (int64_t)sizeof *s->perm);
        dstage_gauge_(&st->st_capacity, s->size);
        memcpy(st->mut, in->mut, sizeof st->mut);
    } else {
        rc = elem_pool_init_(&s->pool, st, 0, err);
        if (rc) goto fail;
        /* room for the whole buffer (what the RAM budget allowed at open)
         * in one untouched allocation: filling it never copies */
        rc = elem_pool_reserve_(&s->pool, in->card >= 0 && in->card < s->size ? (in->card > 0 ? in->card : 1) : s->size, err);
        if (rc) goto fail;
        rc = shuf_grow(s, cap, err);
        if (rc) goto fail;
        for (int f = 0; f < st->spec.n; f++) st->mut[f] = 1;
    }
    shuf_reset(s, 0);
    *out = st;
    return LOOM_OK;
fail:
    shuf_close(st);
    return rc;
}

/* ---- batch ------------------------------------------------------------------ */

typedef struct batchst {
    dstage     s;
    int64_t    size;
    int        drop;
    int        gather;  /* the input draws positions into in-memory rows: batch_gather */
    int        scale_f; /* >= 0: a map(scale) of this feature is fused into the gather (batch_fuse_scale) */
    float      sc, off; /* its scale and offset */
    loom_pool *pool;    /* (optional) the rows' copies split over it (batch_share_pool_) */
} batchst;

/* Whether a batch over in may gather: in draws positions (an index-mode
 * shuffle, a source in plain order) into a stage with in-memory rows of fixed
 * shapes. LOOM_DATA_GATHER=0 in the environment keeps the element-by-element
 * path (the tests compare the two). */
static bool batch_can_gather(dstage *in)
{
    const char *env = getenv("LOOM_DATA_GATHER");
    if (env && !strcmp(env, "0")) return false;
    dstage *from = ddraw_from_(in);
    if (!in->ops->draw || !from->ops->rows || from->spec.n != in->spec.n) return false;
    for (int f = 0; f < from->spec.n; f++) {
        if (from->spec.dtype[f] != in->spec.dtype[f] || !loom_shape_eq(&from->spec.shape[f], &in->spec.shape[f])) return false;
        for (int d = 0; d < from->spec.shape[f].rank; d++)
            if (from->spec.shape[f].dim[d] < 0) return false;
    }
    return true;
}

/* The copies of one chunk of drawn positions: rows [k0, k1) of pos, to the
 * batch's rows i + k. scaled: feature s->scale_f is written as float32
 * v * sc + off (scale_vals: the map's own loop, so its floats bit for bit). */
typedef struct gather_job {
    const batchst  *s;
    const loom_elem *o;
    const uint8_t  *base[LOOM_MAX_FEATURES];
    size_t          ib[LOOM_MAX_FEATURES];
    const int64_t  *pos;
    int64_t         i, got;
    int             scaled, parts;
} gather_job;

/* Rows at random places of a large array: each is asked for a few rows
 * ahead of its copy, the first few at once. */
#define GATHER_AHEAD 8
#define GATHER_STAGE_BYTES (16 << 10)
static inline void prefetch_row(const uint8_t *p, size_t n)
{
    uintptr_t r = (uintptr_t)p;
    for (uintptr_t c = r & ~(uintptr_t)63; c < r + n; c += 64) __builtin_prefetch((const void *)c);
}

static void gather_rows(const gather_job *j, int64_t k0, int64_t k1)
{
    const batchst *s = j->s;
    const int64_t *pos = j->pos;
    for (int f = 0; f < j->o->n; f++) {
        size_t n = j->ib[f];
        if (n == 0) continue; /* empty items: nothing to copy (and maybe no array) */
        const uint8_t *b = j->base[f];
        if (j->scaled && f == s->scale_f) {
            loom_dtype dt = s->s.in->spec.dtype[f];
            size_t vals = n / loom_dtype_size(dt);
            float *d = (float *)j->o->t[f].data + (size_t)j->i * vals;
            /* a block of rows copied into a stage in L1 (the loads of many
             * rows in flight at once, as a plain gather's copies have them),
             * then scaled from there; a row larger than the stage directly */
            _Alignas(64) uint8_t stage[GATHER_STAGE_BYTES];
            int64_t per = n <= sizeof stage ? (int64_t)(sizeof stage / n) : 0;
            for (int64_t k = k0; k < k1;) {
                if (!per) {
                    scale_vals(b + (size_t)pos[k] * n, dt, d + (size_t)k * vals, vals, s->sc, s->off);
                    k++;
                    continue;
                }
                int64_t m = k1 - k < per ? k1 - k : per;
                for (int64_t r = 0; r < m; r++) {
                    if (k + r + GATHER_AHEAD < k1) prefetch_row(b + (size_t)pos[k + r + GATHER_AHEAD] * n, n);
                    memcpy(stage + (size_t)r * n, b + (size_t)pos[k + r] * n, n);
                }
                scale_vals(stage, dt, d + (size_t)k * vals, (size_t)m * vals, s->sc, s->off);
                k += m;
            }
            continue;
        }
        uint8_t *d = (uint8_t *)j->o->t[f].data + (size_t)j->i * n;
        if (n == 1)
            for (int64_t k = k0; k < k1; k++) d[k] = b[pos[k]];
        else
            for (int64_t k = k0; k < k1; k++) {
                if (k + 8 < k1) {
                    uintptr_t r = (uintptr_t)(b + (size_t)pos[k + 8] * n);
                    for (uintptr_t c = r & ~(uintptr_t)63; c < r + n; c += 64) __builtin_prefetch((const void *)c);
                }
                memcpy(d + (size_t)k * n, b + (size_t)pos[k] * n, n);
            }
    }
}

static void gather_part(void *arg, int t)
{
    const gather_job *j = arg;
    gather_rows(j, j->got * t / j->parts, j->got * (t + 1) / j->parts);
}

/* Below this many bytes written per chunk the copies stay on one thread: a
 * pool run costs a wake-up or two, a 16 KiB copy about as much. Above it the
 * chunk is cut in parts of at least 16 KiB, up to 4 per thread, which the
 * threads take as they come: one that the scheduler holds up (a shared
 * machine) delays the batch by one small part, not by half of it. */
#define GATHER_SPLIT_BYTES (32 << 10)

/* batch_into when gathering: the input's draws, a chunk of positions at a
 * time, then a copy per row and feature straight from the rows (split over
 * s->pool when it is set and the chunk is large). No element is lent and no
 * clock is read per element: the draws are timed per chunk, and the stats
 * count the elements as next() (and get, on the rows' stage) would. */
static int batch_gather(batchst *s, loom_elem *o, int scaled, loom_err *err)
{
    dstage *st = &s->s, *in = st->in, *from = ddraw_from_(in);
    gather_job j = {.s = s, .o = o, .scaled = scaled};
    from->ops->rows(from, j.base, j.ib);
    size_t row_out = 0;
    for (int f = 0; f < o->n; f++)
        row_out += scaled && f == s->scale_f ? j.ib[f] / loom_dtype_size(in->spec.dtype[f]) * sizeof(float) : j.ib[f];
    int64_t pos[256], i = 0;
    int rc = LOOM_OK;
    j.pos = pos;
    while (i < s->size) {
        int64_t want = s->size - i < 256 ? s->size - i : 256, got = 0, t0 = dnow_ns_();
        rc = in->ops->draw(in, pos, want, &got, err);
        __atomic_fetch_add(&in->st_busy_ns, dnow_ns_() - t0, __ATOMIC_RELAXED);
        __atomic_fetch_add(&in->st_elements, got, __ATOMIC_RELAXED);
        if (from != in) __atomic_fetch_add(&from->st_elements, got, __ATOMIC_RELAXED);
        j.i = i;
        j.got = got;
        j.parts = 1;
        if (s->pool && (size_t)got * row_out >= GATHER_SPLIT_BYTES) { /* parts of >= 16 KiB, up to 4 a thread */
            int64_t most = 4 * (int64_t)loom_pool_size(s->pool), by = (int64_t)((size_t)got * row_out / (16 << 10));
            j.parts = (int)(by < loom_pool_size(s->pool) ? loom_pool_size(s->pool) : by < most ? by : most);
        }
        if (j.parts > got) j.parts = (int)got;
        if (j.parts > 1) loom_pool_run(s->pool, j.parts, gather_part, &j);
        else gather_rows(&j, 0, got);
        i += got;
        if (rc || got < want) break;
    }
    if (rc) return rc;
    return dbatch_finish_(o, from->spec.shape, i, s->size, s->drop);
}

static const dstage_ops batch_ops;

/* A gathering batch stage, or NULL. */
static batchst *gather_stage(dstage *st)
{
    return st && st->ops == &batch_ops && ((batchst *)st)->gather ? (batchst *)st : NULL;
}

bool batch_is_gather_(dstage *st) { return gather_stage(st) != NULL; }

void batch_share_pool_(dstage *st, loom_pool *pool)
{
    batchst *s = gather_stage(st);
    LOOM_ASSERT(s);
    s->pool = pool;
}

/* map(scale) of feature f (sc, off) fused into st, a gathering batch stage
 * (map_open_, for a scale opened right on it): its next batch for the map
 * comes from batch_next_scaled, feature f written once, scaled, as float32. */
static bool batch_fuse_scale(dstage *st, int f, float sc, float off)
{
    batchst *s = gather_stage(st);
    if (!s || s->scale_f >= 0) return false;
    s->scale_f = f;
    s->sc = sc;
    s->off = off;
    snprintf(st->name, sizeof st->name, "batch(gather+scale)");
    return true;
}

/* The fused map's pull: the next batch into o (feature scale_f float32),
 * with the stats of dstage_next_into_. */
static int batch_next_scaled(dstage *st, loom_elem *o, loom_err *err)
{
    int64_t t0 = dnow_ns_();
    int rc = batch_gather((batchst *)st, o, 1, err);
    __atomic_fetch_add(&st->st_busy_ns, dnow_ns_() - t0, __ATOMIC_RELAXED);
    if (rc == LOOM_OK) __atomic_fetch_add(&st->st_elements, 1, __ATOMIC_RELAXED);
    return rc;
}

/* The next batch into o's buffers (sized for the max shapes); sets o's shapes. */
static int batch_into(dstage *st, loom_elem *o, loom_err *err)
{
    batchst *s = (batchst *)st;
    if (s->gather) return batch_gather(s, o, 0, err);
    loom_shape first[LOOM_MAX_FEATURES];
    size_t bytes[LOOM_MAX_FEATURES];
    int64_t i;
    for (i = 0; i < s->size; i++) {
        loom_elem *e;
        int rc = dstage_next_(st->in, &e, err);
        if (rc == LOOM_EEOF) break;
        if (rc) return rc;
        for (int f = 0; f < o->n; f++) {
            if (i == 0) {
                first[f] = e->t[f].shape;
                bytes[f] = loom_tensor_nbytes(&e->t[f]);
            } else if (!loom_shape_eq(&first[f], &e->t[f].shape)) {
                char a[128], b[128];
                return dstage_err_(st, err, LOOM_ESHAPE, "batch: feature \"%s\" has shape %s in element %lld of the batch but %s "
                                   "in its first element (a batch needs equal shapes)", st->spec.name[f],
                                   loom_shape_str(&e->t[f].shape, a, sizeof a), (long long)i, loom_shape_str(&first[f], b, sizeof b));
            }
            memcpy((uint8_t *)o->t[f].data + (size_t)i * bytes[f], e->t[f].data, bytes[f]);
        }
    }
    return dbatch_finish_(o, first, i, s->size, s->drop);
}

static int batch_next(dstage *st, loom_elem **out, loom_err *err)
{
    int rc = batch_into(st, &st->out, err);
    if (rc == LOOM_OK) *out = &st->out;
    return rc;
}

static void batch_close(dstage *st)
{
    for (int f = 0; f < st->out.n; f++) loom_tensor_fini(&st->out.t[f]);
    loom_free(st);
}

static const dstage_ops batch_ops = {
    .next = batch_next, .rewind = dstage_pass_rewind_, .save = dstage_no_save_, .restore = dstage_no_restore_,
    .close = batch_close, .next_into = batch_into,
};

int batch_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err)
{
    batchst *s = loom_calloc(1, sizeof *s);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a batch stage");
    dstage *st = &s->s;
    dstage_init_(st, &batch_ops, in, id, &t->loc);
    snprintf(st->name, sizeof st->name, "batch");
    s->size = t->batch_size;
    s->drop = t->drop_remainder;
    s->scale_f = -1;
    snprintf(st->desc, sizeof st->desc, "batch(%lld,%d)", (long long)s->size, s->drop);
    if ((s->gather = batch_can_gather(in))) snprintf(st->name, sizeof st->name, "batch(gather)"); /* the desc, and so the state, stay */
    int rc = LOOM_OK;
    if (s->size < 1) {
        rc = dstage_err_(st, err, LOOM_ECONFIG, "batch: size must be >= 1, got %lld", (long long)s->size);
        goto fail;
    }
    int64_t d0;
    st->card = dbatch_card_(in->card, s->size, s->drop, &d0);
    st->batch_dims = in->batch_dims + 1;
    st->out.n = st->spec.n;
    for (int f = 0; f < st->spec.n; f++) {
        if ((rc = dbatch_feature_(st, f, d0, s->size, "batch", err))) goto fail;
        __atomic_fetch_add(&st->st_bytes, (int64_t)loom_tensor_nbytes(&st->out.t[f]), __ATOMIC_RELAXED);
    }
    *out = st;
    return LOOM_OK;
fail:
    batch_close(st);
    return rc;
}

/* ---- repeat, take, skip ------------------------------------------------------ */

typedef struct countst {
    dstage  s;
    int64_t count;    /* the spec's count */
    int64_t epoch;    /* this stage's pass */
    int64_t k;        /* repeat: pass within the epoch; take: taken; skip: skipped */
    int     produced; /* repeat: the current inner pass yielded something */
    int     done;     /* repeat: finished; skip: done skipping */
} countst;

/* Upstream epoch of repeat's inner pass k: distinct for every (epoch, k). */
static int64_t repeat_inner_epoch(const countst *s, int64_t k)
{
    return s->count > 0 ? s->epoch * s->count + k : (int64_t)((uint64_t)s->epoch << 32) + k;
}

static int repeat_next(dstage *st, loom_elem **out, loom_err *err)
{
    countst *s = (countst *)st;
    while (!s->done) {
        int rc = dstage_next_(st->in, out, err);
        if (rc == LOOM_OK) {
            s->produced = 1;
            memcpy(st->mut, st->in->mut, sizeof st->mut);
            return LOOM_OK;
        }
        if (rc != LOOM_EEOF) return rc;
        /* tf.data ends an infinite repeat whose pass is empty, rather than spinning */
        if ((s->count >= 0 && s->k + 1 >= s->count) || (s->count < 0 && !s->produced)) {
            s->done = 1;
            break;
        }
        s->k++;
        s->produced = 0;
        rc = st->in->ops->rewind(st->in, repeat_inner_epoch(s, s->k), err);
        if (rc) return rc;
    }
    return LOOM_EEOF;
}

static int repeat_rewind(dstage *st, int64_t epoch, loom_err *err)
{
    countst *s = (countst *)st;
    s->epoch = epoch;
    s->k = 0;
    s->produced = 0;
    s->done = s->count == 0;
    return st->in->ops->rewind(st->in, repeat_inner_epoch(s, 0), err);
}

static void count_save(dstage *st, loom_buf *b)
{
    countst *s = (countst *)st;
    loom_buf_put_i64(b, s->epoch);
    loom_buf_put_i64(b, s->k);
    loom_buf_put_u32(b, (uint32_t)s->produced);
    loom_buf_put_u32(b, (uint32_t)s->done);
}

static int count_restore(dstage *st, loom_buf *b, loom_err *err)
{
    countst *s = (countst *)st;
    s->epoch = loom_buf_get_i64(b);
    s->k = loom_buf_get_i64(b);
    s->produced = (int)loom_buf_get_u32(b);
    s->done = (int)loom_buf_get_u32(b);
    if (b->failed) return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "iterator state is truncated (%s)", st->name);
    return LOOM_OK;
}

static int take_next(dstage *st, loom_elem **out, loom_err *err)
{
    countst *s = (countst *)st;
    if (s->count >= 0 && s->k >= s->count) return LOOM_EEOF;
    int rc = dstage_next_(st->in, out, err);
    if (rc == LOOM_OK) {
        s->k++;
        memcpy(st->mut, st->in->mut, sizeof st->mut);
    }
    return rc;
}

static int skip_next(dstage *st, loom_elem **out, loom_err *err)
{
    countst *s = (countst *)st;
    int rc;
    while (!s->done) {
        if (s->count >= 0 && s->k >= s->count) {
            s->done = 1;
            break;
        }
        rc = dstage_next_(st->in, out, err);
        if (rc) return rc; /* EOF included: the pass is shorter than the skip */
        s->k++;
    }
    rc = dstage_next_(st->in, out, err);
    if (rc == LOOM_OK) memcpy(st->mut, st->in->mut, sizeof st->mut);
    return rc;
}

/* Random access through take and skip: a position of their pass is one of
 * the input's, offset by what skip skips; card (set at open) bounds index. */
static int take_get(dstage *st, int64_t index, loom_elem **out, loom_err *err)
{
    int rc = dstage_get_(st->in, index, out, err);
    if (rc == LOOM_OK) memcpy(st->mut, st->in->mut, sizeof st->mut);
    return rc;
}

static int skip_get(dstage *st, int64_t index, loom_elem **out, loom_err *err)
{
    int rc = dstage_get_(st->in, index + ((countst *)st)->count, out, err);
    if (rc == LOOM_OK) memcpy(st->mut, st->in->mut, sizeof st->mut);
    return rc;
}

static int count_rewind(dstage *st, int64_t epoch, loom_err *err)
{
    countst *s = (countst *)st;
    s->epoch = epoch;
    s->k = 0;
    s->produced = 0;
    s->done = 0;
    return st->in->ops->rewind(st->in, epoch, err);
}

static const dstage_ops repeat_ops = {
    .next = repeat_next, .rewind = repeat_rewind, .save = count_save, .restore = count_restore, .close = dstage_free_,
};
static const dstage_ops take_ops = {
    .next = take_next, .rewind = count_rewind, .save = count_save, .restore = count_restore, .close = dstage_free_,
};
static const dstage_ops skip_ops = {
    .next = skip_next, .rewind = count_rewind, .save = count_save, .restore = count_restore, .close = dstage_free_,
};
/* The same over an input with random access and a known finite pass. */
static const dstage_ops take_get_ops = {
    .next = take_next, .rewind = count_rewind, .save = count_save, .restore = count_restore, .close = dstage_free_,
    .get = take_get,
};
static const dstage_ops skip_get_ops = {
    .next = skip_next, .rewind = count_rewind, .save = count_save, .restore = count_restore, .close = dstage_free_,
    .get = skip_get,
};

static int count_open(dstage **out, dstage *in, int id, const loom_transform_spec *t, const dstage_ops *ops, const char *name,
                      loom_err *err)
{
    countst *s = loom_calloc(1, sizeof *s);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a %s stage", name);
    dstage_init_(&s->s, ops, in, id, &t->loc);
    snprintf(s->s.name, sizeof s->s.name, "%s", name);
    snprintf(s->s.desc, sizeof s->s.desc, "%s(%lld)", name, (long long)t->count);
    s->count = t->count;
    if (s->count < -1) {
        int rc = dstage_err_(&s->s, err, LOOM_ECONFIG, "%s: count must be >= -1, got %lld", name, (long long)t->count);
        loom_free(s);
        return rc;
    }
    *out = &s->s;
    return LOOM_OK;
}

int repeat_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err)
{
    int rc = count_open(out, in, id, t, &repeat_ops, "repeat", err);
    if (rc) return rc;
    countst *s = (countst *)*out;
    int64_t c = in->card, n = s->count;
    (*out)->card = n == 0 || c == 0 ? 0 : n < 0 ? (c == -2 ? -2 : -1) : c < 0 ? c : c * n;
    s->done = n == 0;
    return LOOM_OK;
}

int take_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err)
{
    int rc = count_open(out, in, id, t, in->ops->get && in->card >= 0 ? &take_get_ops : &take_ops, "take", err);
    if (rc) return rc;
    int64_t c = in->card, n = t->count;
    (*out)->card = n < 0 ? c : c == -1 ? n : c == -2 ? -2 : (c < n ? c : n);
    return LOOM_OK;
}

int skip_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err)
{
    int rc = count_open(out, in, id, t, in->ops->get && in->card >= 0 ? &skip_get_ops : &skip_ops, "skip", err);
    if (rc) return rc;
    int64_t c = in->card, n = t->count;
    if (n < 0 && c == -1) {
        rc = dstage_err_(*out, err, LOOM_ECONFIG, "skip(-1) after an infinite repeat would never yield an element");
        loom_free(*out);
        *out = NULL;
        return rc;
    }
    (*out)->card = c < 0 ? c : n < 0 ? 0 : (c > n ? c - n : 0);
    return LOOM_OK;
}

int64_t dbatch_card_(int64_t c, int64_t size, bool drop, int64_t *dim0)
{
    /* a short last batch is possible unless dropped, or the pass is infinite, or it divides evenly */
    *dim0 = drop || c == -1 || (c >= 0 && c % size == 0) ? size : -1;
    return c < 0 ? c : drop ? c / size : (c + size - 1) / size;
}

int dbatch_feature_(dstage *st, int f, int64_t dim0, int64_t size, const char *what, loom_err *err)
{
    loom_shape *sh = &st->spec.shape[f], *mx = &st->maxshape[f];
    if (sh->rank >= LOOM_MAX_RANK)
        return dstage_err_(st, err, LOOM_ESHAPE, "%s: feature \"%s\" already has rank %d", what, st->spec.name[f],
                           sh->rank);
    memmove(sh->dim + 1, sh->dim, (size_t)sh->rank * sizeof sh->dim[0]);
    memmove(mx->dim + 1, mx->dim, (size_t)mx->rank * sizeof mx->dim[0]);
    sh->rank++;
    mx->rank++;
    sh->dim[0] = dim0;
    mx->dim[0] = size;
    st->mut[f] = 1; /* refilled by every batch */
    /* a batch that cannot fit in memory (or whose size overflows) is the config's error, found at open */
    int64_t bytes = 0, phys = loom_phys_bytes();
    bool fits = loom_dims_ok(mx->dim, mx->rank, &bytes) &&
                loom_mul_ok(bytes, (int64_t)loom_dtype_size(st->spec.dtype[f]), &bytes);
    if (!fits || bytes > phys) {
        char a[96], b[48];
        snprintf(b, sizeof b, fits ? "%lld bytes" : "more than 2^63 bytes", (long long)bytes);
        dstage_err_(st, err, LOOM_ECONFIG, "%s: a batch of %lld elements of feature \"%s\", %s %s, takes %s, more "
                    "than this machine's %lld bytes of memory", what, (long long)size, st->spec.name[f],
                    loom_shape_str(mx, a, sizeof a), loom_dtype_name(st->spec.dtype[f]), b, (long long)phys);
        return loom_err_hint(err, "use a smaller batch size");
    }
    return loom_tensor_init(&st->out.t[f], st->spec.dtype[f], mx, err);
}
