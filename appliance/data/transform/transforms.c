/* transforms.c - the synchronous stages: map (built-in ops on one feature),
 * its registry of built-in map fns and their checks and applies; the
 * element-wise kernels they call are in convert.c, shuffle (tf.data's buffer
 * algorithm; by index over a random-access input) in shuffle.c, batch in
 * batch.c, repeat, take, skip (take and skip pass random access through) in
 * repeat.c (transform_internal.h).
 * Buffers are sized at open from the upstream max shapes; next() never
 * allocates, except while a shuffle buffer first grows towards its size when
 * the input's cardinality is unknown. Maps work in place when the upstream
 * buffer is writable (mut) and the dtype size allows, else into their own
 * preallocated output. */
#include "data/data_internal.h"
#include "transform_internal.h"

#include <math.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

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
    if (t->dtype != c->s->out_dt) dconvert_(t->data, t->dtype, c->dst, c->s->out_dt, c->n);
    else c->dst = t->data;
    return map_done(c);
}

static int scale_apply(mapcall *c, loom_err *err)
{
    (void)err;
    const loom_map_spec *m = &c->s->m;
    dscale_vals_(c->t->data, c->t->dtype, c->dst, c->n, (float)m->scale, (float)m->offset);
    return map_done(c);
}

static int normalize_apply(mapcall *c, loom_err *err)
{
    (void)err;
    const loom_map_spec *m = &c->s->m;
    loom_tensor *t = c->t;
    if (m->n_norm > 1)
        dnormalize_vec_(t->data, t->dtype, c->dst, c->n, m->mean_v, m->std_v, (size_t)m->n_norm);
    else if (m->n_norm == 1)
        dnormalize_vals_(t->data, t->dtype, c->dst, c->n, m->mean_v[0], m->std_v[0]);
    else
        dnormalize_vals_(t->data, t->dtype, c->dst, c->n, (float)m->mean, (float)m->std);
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
            dnormalize_vals_(si, t->dtype, oi, vals, mean, sd);
            continue;
        }
        for (int64_t h0 = 0; h0 < H; h0 += rows) {
            int64_t nh = H - h0 < rows ? H - h0 : rows;
            flip_image(si + (size_t)h0 * rowb, tmp, nh, W, px);
            dnormalize_vals_(tmp, t->dtype, oi + (size_t)h0 * rowv, (size_t)nh * rowv, mean, sd);
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
    dconvert_(&v, LOOM_F64, fill, t->dtype, 1);
    dpad_image_(t->data, c->buf, H, W, p, (size_t)C * esz, fill, esz);
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

/* ---- pad, random_crop (then random_flip_left_right), in one pass ---------------
 * The crop's window of the padded image is read straight from the input, the
 * rows or columns it takes from the padding written with the fill value, and
 * a flip reverses each row as it is written: every pixel lands where the
 * maps apart put it, and the draws are theirs (the crop's two from its own
 * stage id, the flip's one from its own, each keyed by the element's
 * position), so the elements and a saved position are the same bit for bit.
 * The maps apart padded into one buffer, cropped into another and reversed
 * each row through a third. */

int map_pad_crop_len_(dstage *const *map, int n)
{
    if (n < 2 || custom_is_(map[0]) || custom_is_(map[1])) return 0;
    const mapst *p = (const mapst *)map[0], *c = (const mapst *)map[1];
    if (p->fn->kind != LOOM_MAP_PAD || c->fn->kind != LOOM_MAP_RANDOM_CROP || p->f != c->f || map[0]->batch_dims ||
        map[1]->batch_dims)
        return 0;
    if (n < 3 || custom_is_(map[2])) return 2;
    const mapst *f = (const mapst *)map[2];
    return f->fn->kind == LOOM_MAP_FLIP_LR && f->f == c->f && !map[2]->batch_dims ? 3 : 2;
}

/* Output row o from image row r, whose pixels [0, n) go to o's [lo, lo + n); flip: reversed. */
static inline void crop_segment(const uint8_t *r, uint8_t *o, int64_t lo, int64_t n, size_t px, bool flip)
{
    if (!flip) memcpy(o + (size_t)lo * px, r, (size_t)n * px);
    else if (px == 1) reverse_bytes(r, o + lo, n);
    else flip_image(r, o + (size_t)lo * px, 1, n, px);
}

int map_pad_crop_(dstage *const *map, int len, loom_elem *e, uint8_t *dst, int64_t epoch, int64_t pos, int *mut,
                  loom_err *err)
{
    const mapst *ps = (const mapst *)map[0], *cs = (const mapst *)map[1];
    const dstage *cst = map[1];
    loom_tensor *t = &e->t[ps->f];
    int64_t H = t->shape.dim[0], W = t->shape.dim[1], p = ps->m.padding, h = cs->m.size[0], w = cs->m.size[1];
    int64_t C = t->shape.rank == 3 ? t->shape.dim[2] : 1;
    if (H + 2 * p < h || W + 2 * p < w)
        return dstage_err_(cst, err, LOOM_EDATA, "map(random_crop) on \"%s\": element %lld is %lld x %lld, smaller than "
                           "the crop %lld x %lld", cst->spec.name[cs->f], (long long)pos, (long long)(H + 2 * p),
                           (long long)(W + 2 * p), (long long)h, (long long)w);
    loom_rng g;
    loom_rng_init(&g, cs->seed, (uint64_t)cst->id, (uint64_t)epoch, (uint64_t)pos);
    int64_t oh = (int64_t)loom_rng_below(&g, (uint64_t)(H + 2 * p - h + 1));
    int64_t ow = (int64_t)loom_rng_below(&g, (uint64_t)(W + 2 * p - w + 1));
    bool flip = false;
    if (len == 3) {
        const mapst *fs = (const mapst *)map[2];
        loom_rng_init(&g, fs->seed, (uint64_t)map[2]->id, (uint64_t)epoch, (uint64_t)pos);
        flip = loom_rng_uniform(&g) < 0.5f;
    }
    size_t esz = loom_dtype_size(t->dtype), px = (size_t)C * esz;
    uint8_t fill[8];
    double v = ps->m.value;
    dconvert_(&v, LOOM_F64, fill, t->dtype, 1);
    uint8_t *out = dst ? dst : cs->buf; /* the crop's buffer holds its output, which a flip keeps */
    /* the output columns [a, b) read image columns (the same on every row), rows [r0, r1) image rows */
    int64_t a = p - ow > 0 ? p - ow : 0, b = W + p - ow < w ? W + p - ow : w;
    int64_t r0 = p - oh > 0 ? p - oh : 0, r1 = H + p - oh < h ? H + p - oh : h;
    if (a > w) a = w;
    if (b < a) b = a;
    if (a > 0 || b < w || r0 > 0 || r1 < h) { /* the window shows padding: fill it all first */
        bool zero = true;
        for (size_t k = 0; k < esz; k++) zero &= fill[k] == 0;
        size_t all = (size_t)(h * w) * px;
        if (zero) memset(out, 0, all);
        else
            for (size_t k = 0; k < all; k += esz) memcpy(out + k, fill, esz);
    }
    const uint8_t *src = t->data;
    LOOM_ASSERT(out != src);
    int64_t lo = flip ? w - b : a; /* where a row's image pixels go */
    for (int64_t r = r0; r < r1 && b > a; r++)
        crop_segment(src + (size_t)((oh + r - p) * W + ow + a - p) * px, out + (size_t)(r * w) * px, lo, b - a, px, flip);
    t->shape.dim[0] = h;
    t->shape.dim[1] = w;
    t->data = out;
    *mut = 1;
    return LOOM_OK;
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
    dstats_vals_(t->data, t->dtype, c->n, &mean, &sd);
    double floor_sd = c->n ? 1.0 / sqrt((double)c->n) : 1.0;
    dnormalize_vals_(t->data, t->dtype, c->dst, c->n, (float)mean, (float)(sd > floor_sd ? sd : floor_sd));
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
    int rc = batch_next_scaled_(st->in, dst, err);
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
    if (s->m.kind != LOOM_MAP_SCALE || !batch_fuse_scale_(st->in, s->f, (float)s->m.scale, (float)s->m.offset)) return false;
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
    return batch_next_scaled_(st->in, e, err);
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
    if (!dis_int_(s->in_dt))
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
    if (dis_int_(s->in_dt) && (m->value != floor(m->value) || m->value < lo[s->in_dt] || m->value > hi[s->in_dt]))
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
