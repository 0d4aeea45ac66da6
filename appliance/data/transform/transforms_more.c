/* transforms_more.c - filter (built-in predicates), shard, enumerate,
 * unbatch, padded_batch and cache (memory or file), with tf.data's semantics
 * (reference §4.2, 4.3, 4.7) and one deliberate difference: a file cache
 * written by another pipeline is refused instead of silently replayed.
 * Threads: driven by one thread at a time, like every stage. Buffers are
 * allocated at open; next() does not allocate, except while a memory cache
 * grows during its first pass (doubling, so amortised). */
#include "data/data_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

static int truncated(dstage *st, loom_err *err)
{
    return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "iterator state is truncated (%s)", st->name);
}

/* "image, label" into buf. */
static const char *feature_list(const loom_elem_spec *s, char *buf, size_t n)
{
    size_t k = 0;
    buf[0] = 0;
    for (int i = 0; i < s->n && k < n; i++) {
        int w = snprintf(buf + k, n - k, "%s%s", i ? ", " : "", s->name[i]);
        if (w < 0) break;
        k += (size_t)w;
    }
    return buf;
}

static int no_feature(dstage *st, loom_err *err, const char *op, const char *name)
{
    char avail[LOOM_MAX_FEATURES * (LOOM_NAME_MAX + 2)];
    return dstage_err_(st, err, LOOM_ECONFIG, "%s: no feature \"%s\" (available: %s)", op, name,
                       feature_list(&st->spec, avail, sizeof avail));
}

/* ---- filter ------------------------------------------------------------------
 * tf.data filter(pred): keeps the elements whose predicate holds, in order.
 * The predicate reads one scalar feature: in / not_in a set, or in [min, max]. */

typedef struct filterst {
    dstage             s;
    int                f;
    loom_filter_kind   kind;
    int                n;
    double             values[LOOM_MAX_FILTER_VALUES];
    double             min, max;
} filterst;

static int filter_keep(const filterst *s, double v)
{
    if (s->kind == LOOM_FILTER_RANGE) return v >= s->min && v <= s->max;
    int hit = 0;
    for (int i = 0; i < s->n && !hit; i++) hit = v == s->values[i];
    return s->kind == LOOM_FILTER_IN ? hit : !hit;
}

static int filter_next(dstage *st, loom_elem **out, loom_err *err)
{
    filterst *s = (filterst *)st;
    for (;;) {
        loom_elem *e;
        int rc = dstage_next_(st->in, &e, err);
        if (rc) return rc;
        if (!filter_keep(s, loom_tensor_get(&e->t[s->f], 0))) continue;
        memcpy(st->mut, st->in->mut, sizeof st->mut);
        *out = e;
        return LOOM_OK;
    }
}

static const dstage_ops filter_ops = {
    .next = filter_next, .rewind = dstage_pass_rewind_, .save = dstage_no_save_, .restore = dstage_no_restore_,
    .close = dstage_free_,
};

int filter_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err)
{
    filterst *s = loom_calloc(1, sizeof *s);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a filter stage");
    dstage *st = &s->s;
    dstage_init_(st, &filter_ops, in, id, &t->loc);
    snprintf(st->name, sizeof st->name, "filter(%.32s)", t->feature);
    s->kind = t->filter;
    s->n = t->n_values;
    memcpy(s->values, t->values, sizeof s->values);
    s->min = t->min;
    s->max = t->max;
    int rc = LOOM_OK;
    char a[128];
    s->f = loom_elem_spec_find(&st->spec, t->feature);
    if (s->f < 0) {
        rc = no_feature(st, err, "filter", t->feature);
        goto fail;
    }
    if (st->spec.shape[s->f].rank != 0) {
        rc = dstage_err_(st, err, LOOM_ESHAPE, "filter: feature \"%s\" has shape %s, the predicate needs a scalar (filter before "
                         "batch)", t->feature, loom_shape_str(&st->spec.shape[s->f], a, sizeof a));
        goto fail;
    }
    if (s->kind != LOOM_FILTER_RANGE && (s->n < 1 || s->n > LOOM_MAX_FILTER_VALUES)) {
        rc = dstage_err_(st, err, LOOM_ECONFIG, "filter: %d values (expected 1 to %d)", s->n, LOOM_MAX_FILTER_VALUES);
        goto fail;
    }
    size_t k = (size_t)snprintf(st->desc, sizeof st->desc, "filter(%s,%s", t->feature,
                                s->kind == LOOM_FILTER_IN ? "in" : s->kind == LOOM_FILTER_NOT_IN ? "not_in" : "range");
    if (s->kind == LOOM_FILTER_RANGE)
        k += (size_t)snprintf(st->desc + k, sizeof st->desc - k, ",%.17g,%.17g", s->min, s->max);
    for (int i = 0; s->kind != LOOM_FILTER_RANGE && i < s->n && k < sizeof st->desc; i++)
        k += (size_t)snprintf(st->desc + k, sizeof st->desc - k, ",%.17g", s->values[i]);
    if (k < sizeof st->desc) snprintf(st->desc + k, sizeof st->desc - k, ")");
    st->card = in->card == 0 ? 0 : -2; /* tf.data: unknown */
    *out = st;
    return LOOM_OK;
fail:
    loom_free(s);
    return rc;
}

/* ---- shard, split ---------------------------------------------------------------
 * shard keeps the elements whose position p in the pass has p % num_shards == index;
 * split keeps those whose loom_split_u(seed, p) is below fraction (part train) or
 * not (part eval): the same in every pass, so the two parts stay disjoint. */

typedef struct shardst {
    dstage   s;
    int64_t  n, index;
    int64_t  pos;      /* input elements consumed this pass */
    int      split;    /* a split rather than a shard */
    int      part;     /* split: LOOM_SPLIT_TRAIN or LOOM_SPLIT_EVAL */
    double   fraction; /* split */
    uint64_t seed;     /* split */
} shardst;

double loom_split_u(uint64_t seed, int64_t pos)
{
    uint64_t z = seed * 0x9e3779b97f4a7c15ull + (uint64_t)pos; /* splitmix64 of (seed, pos) */
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (double)(z >> 11) * 0x1.0p-53;
}

static int shard_keep(const shardst *s, int64_t pos)
{
    if (!s->split) return pos % s->n == s->index;
    return (loom_split_u(s->seed, pos) < s->fraction) == (s->part == LOOM_SPLIT_TRAIN);
}

static int shard_next(dstage *st, loom_elem **out, loom_err *err)
{
    shardst *s = (shardst *)st;
    for (;;) {
        loom_elem *e;
        int rc = dstage_next_(st->in, &e, err);
        if (rc) return rc;
        if (!shard_keep(s, s->pos++)) continue;
        memcpy(st->mut, st->in->mut, sizeof st->mut);
        *out = e;
        return LOOM_OK;
    }
}

static int shard_rewind(dstage *st, int64_t epoch, loom_err *err)
{
    ((shardst *)st)->pos = 0;
    return st->in->ops->rewind(st->in, epoch, err);
}

static void shard_save(dstage *st, loom_buf *b) { loom_buf_put_i64(b, ((shardst *)st)->pos); }

static int shard_restore(dstage *st, loom_buf *b, loom_err *err)
{
    int64_t pos = loom_buf_get_i64(b);
    if (b->failed || pos < 0) return truncated(st, err);
    ((shardst *)st)->pos = pos;
    return LOOM_OK;
}

static const dstage_ops shard_ops = {
    .next = shard_next, .rewind = shard_rewind, .save = shard_save, .restore = shard_restore, .close = dstage_free_,
};

int shard_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, uint64_t run_seed, loom_err *err)
{
    shardst *s = loom_calloc(1, sizeof *s);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a shard stage");
    dstage *st = &s->s;
    dstage_init_(st, &shard_ops, in, id, &t->loc);
    if (t->kind == LOOM_T_SPLIT) {
        s->split = 1;
        s->part = t->part;
        s->fraction = t->fraction;
        s->seed = t->seed_set ? t->seed : run_seed;
        snprintf(st->name, sizeof st->name, "split(%s)", s->part == LOOM_SPLIT_EVAL ? "eval" : "train");
        snprintf(st->desc, sizeof st->desc, "split(%.17g,%d,%llu)", s->fraction, s->part, (unsigned long long)s->seed);
        if (!(s->fraction > 0 && s->fraction < 1)) {
            int rc = dstage_err_(st, err, LOOM_ECONFIG, "split: fraction %g is outside (0, 1)", s->fraction);
            loom_free(s);
            return rc;
        }
        st->card = in->card < 0 ? in->card : -2; /* how many fall on each side is known only by reading */
        *out = st;
        return LOOM_OK;
    }
    s->n = t->num_shards;
    s->index = t->index;
    snprintf(st->name, sizeof st->name, "shard(%lld/%lld)", (long long)s->index, (long long)s->n);
    snprintf(st->desc, sizeof st->desc, "shard(%lld,%lld)", (long long)s->n, (long long)s->index);
    if (s->n < 1 || s->index < 0 || s->index >= s->n) {
        int rc = dstage_err_(st, err, LOOM_ECONFIG, "shard: index %lld is out of range: expected 0 <= index < num_shards (%lld)",
                             (long long)s->index, (long long)s->n);
        loom_free(s);
        return rc;
    }
    int64_t c = in->card;
    st->card = c < 0 ? c : c / s->n + (s->index < c % s->n ? 1 : 0);
    *out = st;
    return LOOM_OK;
}

/* ---- concat, select ---------------------------------------------------------------
 * concat appends feature `output`: the listed features, each flattened per
 * example (what follows the batch dims), joined in order (Keras
 * Concatenate on the last axis of flat features; scalars count as one
 * value); float32 unless all share one dtype. select keeps the listed
 * features, in the listed order (tf.data map(lambda e: {k: e[k] ...})). */

typedef struct catst {
    dstage   s;
    int      n, idx[LOOM_MAX_FEATURES]; /* concat: inputs; select: kept features */
    int64_t  per[LOOM_MAX_FEATURES];    /* concat: values per example of each input */
    int64_t  total;                     /* concat: values per example of the output */
    loom_dtype dt;
    void    *buf;
} catst;

static int cat_next(dstage *st, loom_elem **out, loom_err *err)
{
    catst *s = (catst *)st;
    loom_elem *e;
    int rc = dstage_next_(st->in, &e, err);
    if (rc) return rc;
    int n = e->n, bd = st->batch_dims;
    memcpy(st->out.t, e->t, (size_t)n * sizeof e->t[0]);
    memcpy(st->mut, st->in->mut, sizeof st->mut);
    int64_t rows = 1;
    loom_tensor *o = &st->out.t[n];
    o->dtype = s->dt;
    o->shape.rank = bd + 1;
    for (int d = 0; d < bd; d++) rows *= (o->shape.dim[d] = e->t[s->idx[0]].shape.dim[d]);
    o->shape.dim[bd] = s->total;
    o->data = s->buf;
    o->owns = 0;
    size_t esz = loom_dtype_size(s->dt);
    for (int64_t r = 0; r < rows; r++) {
        uint8_t *dst = (uint8_t *)s->buf + (size_t)(r * s->total) * esz;
        for (int k = 0; k < s->n; k++) {
            const loom_tensor *t = &e->t[s->idx[k]];
            if (t->dtype == s->dt) {
                memcpy(dst, (const uint8_t *)t->data + (size_t)(r * s->per[k]) * esz, (size_t)s->per[k] * esz);
            } else { /* mixed dtypes: float32 out */
                for (int64_t j = 0; j < s->per[k]; j++) ((float *)dst)[j] = (float)loom_tensor_get(t, r * s->per[k] + j);
            }
            dst += (size_t)s->per[k] * esz;
        }
    }
    st->out.n = n + 1;
    st->mut[n] = 1;
    *out = &st->out;
    return LOOM_OK;
}

static int sel_next(dstage *st, loom_elem **out, loom_err *err)
{
    catst *s = (catst *)st;
    loom_elem *e;
    int rc = dstage_next_(st->in, &e, err);
    if (rc) return rc;
    uint8_t mut[LOOM_MAX_FEATURES];
    memcpy(mut, st->in->mut, sizeof mut);
    for (int k = 0; k < s->n; k++) {
        st->out.t[k] = e->t[s->idx[k]];
        st->mut[k] = mut[s->idx[k]];
    }
    st->out.n = s->n;
    *out = &st->out;
    return LOOM_OK;
}

static int cat_rewind(dstage *st, int64_t epoch, loom_err *err) { return st->in->ops->rewind(st->in, epoch, err); }
static void cat_save(dstage *st, loom_buf *b) { (void)st, (void)b; }
static int cat_restore(dstage *st, loom_buf *b, loom_err *err) { (void)st, (void)b, (void)err; return LOOM_OK; }

static void cat_close(dstage *st)
{
    loom_free(((catst *)st)->buf);
    loom_free(st);
}

static const dstage_ops cat_ops = {
    .next = cat_next, .rewind = cat_rewind, .save = cat_save, .restore = cat_restore, .close = cat_close,
};
static const dstage_ops sel_ops = {
    .next = sel_next, .rewind = cat_rewind, .save = cat_save, .restore = cat_restore, .close = cat_close,
};

/* The indices of t's names in st's spec; an absent name is an error listing the features. */
static int find_names(catst *s, const loom_transform_spec *t, const char *op, loom_err *err)
{
    dstage *st = &s->s;
    s->n = t->features.n;
    for (int k = 0; k < t->features.n; k++) {
        s->idx[k] = loom_elem_spec_find(&st->spec, t->features.name[k]);
        if (s->idx[k] < 0) {
            char have[2048];
            return dstage_err_(st, err, LOOM_ECONFIG, "%s: no feature \"%s\" (the element has %s)", op, t->features.name[k],
                               loom_elem_spec_str(&st->spec, have, sizeof have));
        }
    }
    return s->n >= 1 ? LOOM_OK : dstage_err_(st, err, LOOM_ECONFIG, "%s: no features listed", op);
}

int concat_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err)
{
    catst *s = loom_calloc(1, sizeof *s);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a concat stage");
    dstage *st = &s->s;
    dstage_init_(st, &cat_ops, in, id, &t->loc);
    snprintf(st->name, sizeof st->name, "concat");
    snprintf(st->desc, sizeof st->desc, "concat(%s", t->features.output);
    for (int k = 0; k < t->features.n; k++) {
        size_t l = strlen(st->desc);
        snprintf(st->desc + l, sizeof st->desc - l, ",%s", t->features.name[k]);
    }
    size_t l = strlen(st->desc);
    snprintf(st->desc + l, sizeof st->desc - l, ")");
    int rc = find_names(s, t, "concat", err), bd = st->batch_dims;
    char a[128];
    if (rc) goto fail;
    if (loom_elem_spec_find(&st->spec, t->features.output) >= 0) {
        rc = dstage_err_(st, err, LOOM_ECONFIG, "concat: the element already has a feature \"%s\" (set `output` to "
                         "another name)", t->features.output);
        goto fail;
    }
    if (st->spec.n >= LOOM_MAX_FEATURES) {
        rc = dstage_err_(st, err, LOOM_ECONFIG, "concat: the element already has %d features (at most %d)", st->spec.n,
                         LOOM_MAX_FEATURES);
        goto fail;
    }
    s->dt = st->spec.dtype[s->idx[0]];
    for (int k = 0; k < s->n; k++) {
        const loom_shape *sh = &st->spec.shape[s->idx[k]];
        s->per[k] = 1;
        for (int d = bd; d < sh->rank; d++) {
            if (sh->dim[d] < 0) {
                rc = dstage_err_(st, err, LOOM_ESHAPE, "concat: feature \"%s\" has shape %s, which varies per example "
                                 "(pad it first)", t->features.name[k], loom_shape_str(sh, a, sizeof a));
                goto fail;
            }
            s->per[k] *= sh->dim[d];
        }
        if (st->spec.dtype[s->idx[k]] != s->dt) s->dt = LOOM_F32;
        s->total += s->per[k];
    }
    int n = st->spec.n;
    const loom_shape *mx0 = &st->maxshape[s->idx[0]];
    int64_t rows = 1;
    loom_shape osh = {.rank = bd + 1}, omx = {.rank = bd + 1};
    for (int d = 0; d < bd; d++) {
        osh.dim[d] = st->spec.shape[s->idx[0]].dim[d];
        rows *= (omx.dim[d] = mx0->dim[d]);
    }
    osh.dim[bd] = omx.dim[bd] = s->total;
    snprintf(st->spec.name[n], LOOM_NAME_MAX, "%s", t->features.output);
    st->spec.dtype[n] = s->dt;
    st->spec.shape[n] = osh;
    st->maxshape[n] = omx;
    st->spec.n = n + 1;
    size_t bytes = (size_t)(rows * s->total) * loom_dtype_size(s->dt);
    if (!(s->buf = loom_alloc_aligned(bytes ? bytes : 1))) {
        rc = loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate %zu bytes for concat", bytes);
        goto fail;
    }
    dstage_gauge_(&st->st_bytes, (int64_t)bytes);
    *out = st;
    return LOOM_OK;
fail:
    cat_close(st);
    return rc;
}

int select_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err)
{
    catst *s = loom_calloc(1, sizeof *s);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a select stage");
    dstage *st = &s->s;
    dstage_init_(st, &sel_ops, in, id, &t->loc);
    snprintf(st->name, sizeof st->name, "select");
    snprintf(st->desc, sizeof st->desc, "select(");
    for (int k = 0; k < t->features.n; k++) {
        size_t l = strlen(st->desc);
        snprintf(st->desc + l, sizeof st->desc - l, "%s%s", k ? "," : "", t->features.name[k]);
    }
    size_t l = strlen(st->desc);
    snprintf(st->desc + l, sizeof st->desc - l, ")");
    int rc = find_names(s, t, "select", err);
    if (rc) {
        cat_close(st);
        return rc;
    }
    loom_elem_spec sp = st->spec;
    loom_shape mx[LOOM_MAX_FEATURES];
    memcpy(mx, st->maxshape, sizeof mx);
    for (int k = 0; k < s->n; k++) {
        memcpy(st->spec.name[k], sp.name[s->idx[k]], LOOM_NAME_MAX);
        st->spec.dtype[k] = sp.dtype[s->idx[k]];
        st->spec.shape[k] = sp.shape[s->idx[k]];
        st->maxshape[k] = mx[s->idx[k]];
    }
    st->spec.n = s->n;
    *out = st;
    return LOOM_OK;
}

/* ---- enumerate -----------------------------------------------------------------
 * zip(range(start, int64 max), ds): appends an int64 scalar feature. */

typedef struct enumst {
    dstage   s;
    int64_t  start, k; /* k: elements produced this pass */
    int64_t *val;      /* the added feature's buffer */
} enumst;

static int enum_next(dstage *st, loom_elem **out, loom_err *err)
{
    enumst *s = (enumst *)st;
    loom_elem *e;
    int rc = dstage_next_(st->in, &e, err);
    if (rc) return rc;
    int n = e->n;
    memcpy(st->out.t, e->t, (size_t)n * sizeof e->t[0]);
    memcpy(st->mut, st->in->mut, sizeof st->mut);
    *s->val = s->start + s->k++;
    st->out.t[n].dtype = LOOM_I64;
    st->out.t[n].shape.rank = 0;
    st->out.t[n].data = s->val;
    st->out.t[n].owns = 0;
    st->out.n = n + 1;
    st->mut[n] = 1;
    *out = &st->out;
    return LOOM_OK;
}

static int enum_rewind(dstage *st, int64_t epoch, loom_err *err)
{
    ((enumst *)st)->k = 0;
    return st->in->ops->rewind(st->in, epoch, err);
}

static void enum_save(dstage *st, loom_buf *b) { loom_buf_put_i64(b, ((enumst *)st)->k); }

static int enum_restore(dstage *st, loom_buf *b, loom_err *err)
{
    int64_t k = loom_buf_get_i64(b);
    if (b->failed || k < 0) return truncated(st, err);
    ((enumst *)st)->k = k;
    return LOOM_OK;
}

static void enum_close(dstage *st)
{
    loom_free(((enumst *)st)->val);
    loom_free(st);
}

static const dstage_ops enum_ops = {
    .next = enum_next, .rewind = enum_rewind, .save = enum_save, .restore = enum_restore, .close = enum_close,
};

int enumerate_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err)
{
    enumst *s = loom_calloc(1, sizeof *s);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate an enumerate stage");
    dstage *st = &s->s;
    dstage_init_(st, &enum_ops, in, id, &t->loc);
    const char *name = t->feature[0] ? t->feature : "index";
    s->start = t->start;
    snprintf(st->name, sizeof st->name, "enumerate");
    snprintf(st->desc, sizeof st->desc, "enumerate(%s,%lld)", name, (long long)s->start);
    int rc = LOOM_OK;
    if (loom_elem_spec_find(&st->spec, name) >= 0) {
        rc = dstage_err_(st, err, LOOM_ECONFIG, "enumerate: the element already has a feature \"%s\" (set `feature` to another "
                         "name)", name);
        goto fail;
    }
    if (st->spec.n >= LOOM_MAX_FEATURES) {
        rc = dstage_err_(st, err, LOOM_ECONFIG, "enumerate: the element already has %d features (at most %d)", st->spec.n,
                         LOOM_MAX_FEATURES);
        goto fail;
    }
    if (st->batch_dims > 0) {
        rc = dstage_err_(st, err, LOOM_EUNSUPPORTED, "enumerate after batch is not supported: put it before the batch so each "
                         "element gets its index");
        goto fail;
    }
    s->val = loom_alloc(sizeof *s->val);
    if (!s->val) {
        rc = loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate an enumerate stage");
        goto fail;
    }
    int n = st->spec.n++;
    snprintf(st->spec.name[n], LOOM_NAME_MAX, "%s", name);
    st->spec.dtype[n] = LOOM_I64;
    memset(&st->spec.shape[n], 0, sizeof st->spec.shape[n]);
    memset(&st->maxshape[n], 0, sizeof st->maxshape[n]);
    *out = st;
    return LOOM_OK;
fail:
    enum_close(st);
    return rc;
}

/* Writes an element as the slot pools do: per feature rank, dims, bytes. */
static void elem_save(const loom_elem *e, loom_buf *b)
{
    for (int f = 0; f < e->n; f++) {
        const loom_shape *sh = &e->t[f].shape;
        loom_buf_put_u32(b, (uint32_t)sh->rank);
        for (int d = 0; d < sh->rank; d++) loom_buf_put_i64(b, sh->dim[d]);
        loom_buf_put(b, e->t[f].data, loom_tensor_nbytes(&e->t[f]));
    }
}

/* ---- unbatch -------------------------------------------------------------------
 * Splits each element along dim 0; the element is held (a view of the input's,
 * or after a restore a copy in a one-slot pool) while its rows are emitted. */

typedef struct unbatchst {
    dstage     s;
    loom_elem *cur;      /* the element being split, NULL between elements */
    loom_elem  held;     /* view of pool slot 0 after a restore */
    int64_t    rows, k;  /* rows of cur, next row */
    int64_t    in_pos;   /* input elements taken this pass, for messages */
    size_t     row_bytes[LOOM_MAX_FEATURES];
    uint8_t    in_mut[LOOM_MAX_FEATURES];
    elem_pool  pool;
} unbatchst;

static int unbatch_take(unbatchst *s, loom_elem *e, loom_err *err)
{
    dstage *st = &s->s;
    int64_t rows = e->t[0].shape.dim[0];
    for (int f = 0; f < e->n; f++) {
        if (e->t[f].shape.dim[0] != rows) {
            char a[128], b[128];
            return dstage_err_(st, err, LOOM_ESHAPE, "unbatch: element %lld: feature \"%s\" has shape %s but \"%s\" has %s (all "
                               "features must agree on dim 0)", (long long)s->in_pos - 1, st->spec.name[f],
                               loom_shape_str(&e->t[f].shape, a, sizeof a), st->spec.name[0],
                               loom_shape_str(&e->t[0].shape, b, sizeof b));
        }
        s->row_bytes[f] = rows ? loom_tensor_nbytes(&e->t[f]) / (size_t)rows : 0;
    }
    s->cur = e;
    s->rows = rows;
    s->k = 0;
    return LOOM_OK;
}

static int unbatch_next(dstage *st, loom_elem **out, loom_err *err)
{
    unbatchst *s = (unbatchst *)st;
    while (!s->cur || s->k >= s->rows) {
        loom_elem *e;
        s->cur = NULL;
        int rc = dstage_next_(st->in, &e, err);
        if (rc) return rc;
        s->in_pos++;
        memcpy(s->in_mut, st->in->mut, sizeof s->in_mut);
        if ((rc = unbatch_take(s, e, err))) return rc;
    }
    loom_elem *o = &st->out;
    o->n = s->cur->n;
    for (int f = 0; f < o->n; f++) {
        const loom_tensor *t = &s->cur->t[f];
        o->t[f].dtype = t->dtype;
        o->t[f].shape.rank = t->shape.rank - 1;
        memcpy(o->t[f].shape.dim, t->shape.dim + 1, (size_t)(t->shape.rank - 1) * sizeof t->shape.dim[0]);
        o->t[f].data = (uint8_t *)t->data + (size_t)s->k * s->row_bytes[f];
        o->t[f].owns = 0;
    }
    memcpy(st->mut, s->in_mut, sizeof st->mut);
    s->k++;
    *out = o;
    return LOOM_OK;
}

static int unbatch_rewind(dstage *st, int64_t epoch, loom_err *err)
{
    unbatchst *s = (unbatchst *)st;
    s->cur = NULL;
    s->rows = s->k = s->in_pos = 0;
    return st->in->ops->rewind(st->in, epoch, err);
}

static void unbatch_save(dstage *st, loom_buf *b)
{
    unbatchst *s = (unbatchst *)st;
    int has = s->cur && s->k < s->rows;
    loom_buf_put_i64(b, s->in_pos);
    loom_buf_put_u32(b, (uint32_t)has);
    if (!has) return;
    loom_buf_put_i64(b, s->k);
    elem_save(s->cur, b);
}

static int unbatch_restore(dstage *st, loom_buf *b, loom_err *err)
{
    unbatchst *s = (unbatchst *)st;
    s->in_pos = loom_buf_get_i64(b);
    uint32_t has = loom_buf_get_u32(b);
    s->cur = NULL;
    s->rows = s->k = 0;
    if (b->failed) return truncated(st, err);
    if (!has) return LOOM_OK;
    int64_t k = loom_buf_get_i64(b);
    int rc = elem_pool_load_(&s->pool, 0, b, err);
    if (rc) return rc;
    elem_pool_view_(&s->pool, 0, &s->held);
    if ((rc = unbatch_take(s, &s->held, err))) return rc;
    if (k < 0 || k > s->rows) return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "iterator state is corrupt (unbatch)");
    s->k = k;
    memset(s->in_mut, 1, sizeof s->in_mut);
    return LOOM_OK;
}

static void unbatch_close(dstage *st)
{
    elem_pool_fini_(&((unbatchst *)st)->pool);
    loom_free(st);
}

static const dstage_ops unbatch_ops = {
    .next = unbatch_next, .rewind = unbatch_rewind, .save = unbatch_save, .restore = unbatch_restore, .close = unbatch_close,
};

int unbatch_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err)
{
    unbatchst *s = loom_calloc(1, sizeof *s);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate an unbatch stage");
    dstage *st = &s->s;
    dstage_init_(st, &unbatch_ops, in, id, &t->loc);
    snprintf(st->name, sizeof st->name, "unbatch");
    snprintf(st->desc, sizeof st->desc, "unbatch");
    int rc = elem_pool_init_(&s->pool, in, 1, err);
    if (rc) goto fail;
    elem_pool_own_(&s->pool, st); /* the held element (a restore loads it) is this stage's memory */
    int64_t d0 = -2; /* the common dim 0: -2 none yet, -1 varies */
    char a[128];
    for (int f = 0; f < st->spec.n; f++) {
        loom_shape *sh = &st->spec.shape[f], *mx = &st->maxshape[f];
        if (sh->rank < 1) {
            rc = dstage_err_(st, err, LOOM_ESHAPE, "unbatch: feature \"%s\" is a scalar; every feature needs a dim 0 to split along",
                             st->spec.name[f]);
            goto fail;
        }
        if (sh->dim[0] >= 0 && d0 >= 0 && sh->dim[0] != d0) {
            rc = dstage_err_(st, err, LOOM_ESHAPE, "unbatch: feature \"%s\" has shape %s but another has dim 0 = %lld (all features "
                             "must agree on dim 0)", st->spec.name[f], loom_shape_str(sh, a, sizeof a), (long long)d0);
            goto fail;
        }
        d0 = sh->dim[0] < 0 ? -1 : d0 == -1 ? -1 : sh->dim[0];
        memmove(sh->dim, sh->dim + 1, (size_t)(sh->rank - 1) * sizeof sh->dim[0]);
        memmove(mx->dim, mx->dim + 1, (size_t)(mx->rank - 1) * sizeof mx->dim[0]);
        sh->rank--;
        mx->rank--;
    }
    st->batch_dims = in->batch_dims > 0 ? in->batch_dims - 1 : 0;
    int64_t c = in->card;
    st->card = c == 0 || d0 == 0 ? 0 : c == -1 ? -1 : c < 0 || d0 < 0 ? -2 : c * d0;
    *out = st;
    return LOOM_OK;
fail:
    unbatch_close(st);
    return rc;
}

/* ---- padded_batch ----------------------------------------------------------------
 * Like batch, but each feature's per-element shape is padded: a dim given in
 * padded_shapes pads to that size, any other dim (or -1) to the largest in the
 * batch; padding with the feature's padding value (default 0). The batch's
 * elements are copied to a pool first, since the largest is known only at the
 * end. */

typedef struct pbatchst {
    dstage    s;
    int64_t   size;
    int       drop;
    int64_t   pos;                                /* input elements consumed this pass, for messages */
    int64_t   fixed[LOOM_MAX_FEATURES][LOOM_MAX_RANK]; /* padded dim, -1 = max in batch */
    double    pad[LOOM_MAX_FEATURES];
    elem_pool pool;
    int       n_in;      /* input features; the mask (if any) is output feature n_in */
    int       mask_f;    /* the masked feature, -1 none */
    float    *ones;      /* the mask's source: 1s of the masked feature's max size */
} pbatchst;

void dfill_value_(void *dst, loom_dtype dt, size_t n, double v)
{
    switch (dt) {
    case LOOM_U8: memset(dst, (int)(uint8_t)v, n); break;
    case LOOM_I32: for (size_t i = 0; i < n; i++) ((int32_t *)dst)[i] = (int32_t)v; break;
    case LOOM_I64: for (size_t i = 0; i < n; i++) ((int64_t *)dst)[i] = (int64_t)v; break;
    case LOOM_F32: for (size_t i = 0; i < n; i++) ((float *)dst)[i] = (float)v; break;
    case LOOM_F64: for (size_t i = 0; i < n; i++) ((double *)dst)[i] = v; break;
    default: LOOM_ASSERT(!"bad dtype");
    }
}

/* Copies src (shape s) into the corner of dst (shape t, t >= s per dim), row-major. */
void dcopy_padded_(uint8_t *dst, const loom_shape *t, const uint8_t *src, const loom_shape *s, size_t es)
{
    int r = s->rank;
    if (r == 0) {
        memcpy(dst, src, es);
        return;
    }
    size_t run = (size_t)s->dim[r - 1] * es;
    int64_t rows = 1;
    for (int d = 0; d < r - 1; d++) rows *= s->dim[d];
    for (int64_t i = 0; i < rows; i++) {
        /* i as an index into s's leading dims, re-linearised in t */
        int64_t rem = i, off = 0, stride = 1;
        for (int d = r - 2; d >= 0; d--) {
            off += (rem % s->dim[d]) * stride;
            rem /= s->dim[d];
            stride *= t->dim[d];
        }
        memcpy(dst + (size_t)(off * t->dim[r - 1]) * es, src + (size_t)i * run, run);
    }
}

static int pbatch_next(dstage *st, loom_elem **out, loom_err *err)
{
    pbatchst *s = (pbatchst *)st;
    loom_elem *o = &st->out;
    loom_shape tgt[LOOM_MAX_FEATURES];
    int64_t i;
    for (int f = 0; f < s->n_in; f++) {
        tgt[f].rank = st->spec.shape[f].rank - 1;
        for (int d = 0; d < tgt[f].rank; d++) tgt[f].dim[d] = s->fixed[f][d] > 0 ? s->fixed[f][d] : 0;
    }
    for (i = 0; i < s->size; i++) {
        loom_elem *e;
        int rc = dstage_next_(st->in, &e, err);
        if (rc == LOOM_EEOF) break;
        if (rc) return rc;
        for (int f = 0; f < s->n_in; f++) {
            const loom_shape *es = &e->t[f].shape;
            for (int d = 0; d < es->rank; d++) {
                if (s->fixed[f][d] > 0 && es->dim[d] > s->fixed[f][d]) {
                    char a[128], b[128];
                    loom_shape want = tgt[f];
                    for (int q = 0; q < want.rank; q++) want.dim[q] = s->fixed[f][q];
                    return dstage_err_(st, err, LOOM_ESHAPE, "padded_batch: element %lld: feature \"%s\" has shape %s, larger "
                                       "than its padded shape %s (-1 = the largest in the batch)", (long long)s->pos,
                                       st->spec.name[f], loom_shape_str(es, a, sizeof a), loom_shape_str(&want, b, sizeof b));
                }
                if (s->fixed[f][d] < 0 && es->dim[d] > tgt[f].dim[d]) tgt[f].dim[d] = es->dim[d];
            }
        }
        rc = elem_pool_put_(&s->pool, i, e, err);
        if (rc) return dstage_err_(st, err, rc, "padded_batch: element %lld: %s", (long long)s->pos, err->msg);
        s->pos++;
    }
    if (i == 0 || (i < s->size && s->drop)) return LOOM_EEOF;
    loom_elem v;
    for (int f = 0; f < s->n_in; f++) {
        size_t esz = loom_dtype_size(st->spec.dtype[f]), per = (size_t)loom_shape_numel(&tgt[f]) * esz;
        loom_tensor *ot = &o->t[f];
        dfill_value_(ot->data, ot->dtype, (size_t)i * per / esz, s->pad[f]);
        for (int64_t j = 0; j < i; j++) {
            elem_pool_view_(&s->pool, j, &v);
            dcopy_padded_((uint8_t *)ot->data + (size_t)j * per, &tgt[f], v.t[f].data, &v.t[f].shape, esz);
            if (f == s->mask_f) { /* 1 over the element's own extent, 0 over the padding */
                loom_tensor *mt = &o->t[s->n_in];
                size_t mper = (size_t)loom_shape_numel(&tgt[f]) * sizeof(float);
                if (j == 0) memset(mt->data, 0, (size_t)i * mper);
                dcopy_padded_((uint8_t *)mt->data + (size_t)j * mper, &tgt[f], (const uint8_t *)s->ones, &v.t[f].shape,
                              sizeof(float));
            }
        }
        ot->shape.rank = tgt[f].rank + 1;
        ot->shape.dim[0] = i;
        memcpy(ot->shape.dim + 1, tgt[f].dim, (size_t)tgt[f].rank * sizeof tgt[f].dim[0]);
        if (f == s->mask_f) o->t[s->n_in].shape = ot->shape;
    }
    *out = o;
    return LOOM_OK;
}

static int pbatch_rewind(dstage *st, int64_t epoch, loom_err *err)
{
    ((pbatchst *)st)->pos = 0;
    return st->in->ops->rewind(st->in, epoch, err);
}

static void pbatch_save(dstage *st, loom_buf *b) { loom_buf_put_i64(b, ((pbatchst *)st)->pos); }

static int pbatch_restore(dstage *st, loom_buf *b, loom_err *err)
{
    int64_t pos = loom_buf_get_i64(b);
    if (b->failed) return truncated(st, err);
    ((pbatchst *)st)->pos = pos;
    return LOOM_OK;
}

static void pbatch_close(dstage *st)
{
    pbatchst *s = (pbatchst *)st;
    for (int f = 0; f < st->out.n; f++) loom_tensor_fini(&st->out.t[f]);
    elem_pool_fini_(&s->pool);
    loom_free(s->ones);
    loom_free(s);
}

static const dstage_ops pbatch_ops = {
    .next = pbatch_next, .rewind = pbatch_rewind, .save = pbatch_save, .restore = pbatch_restore, .close = pbatch_close,
};

/* A padding value the dtype holds exactly. */
static int pad_ok(loom_dtype dt, double v)
{
    switch (dt) {
    case LOOM_U8: return v == floor(v) && v >= 0 && v <= 255;
    case LOOM_I32: return v == floor(v) && v >= -2147483648.0 && v <= 2147483647.0;
    case LOOM_I64: return v == floor(v) && fabs(v) <= 9007199254740992.0;
    default: return 1;
    }
}

/* mask = "feature": adds "<feature>_mask", float32 of the feature's padded shape, 1 = value, 0 = padding. */
static int pbatch_mask(pbatchst *s, const char *name, loom_err *err)
{
    dstage *st = &s->s;
    int f = loom_elem_spec_find(&st->spec, name), m = s->n_in;
    if (f < 0) return no_feature(st, err, "padded_batch: mask", name);
    if (m + 1 > LOOM_MAX_FEATURES)
        return dstage_err_(st, err, LOOM_ECONFIG, "padded_batch: mask: no room for one more feature (at most %d)",
                           LOOM_MAX_FEATURES);
    snprintf(st->spec.name[m], LOOM_NAME_MAX, "%.*s_mask", LOOM_NAME_MAX - 6, name);
    if (loom_elem_spec_find(&st->spec, st->spec.name[m]) != m && loom_elem_spec_find(&st->spec, st->spec.name[m]) >= 0)
        return dstage_err_(st, err, LOOM_ECONFIG, "padded_batch: mask: a feature \"%s\" exists already", st->spec.name[m]);
    st->spec.dtype[m] = LOOM_F32;
    st->spec.shape[m] = st->spec.shape[f];
    st->maxshape[m] = st->maxshape[f];
    st->mut[m] = 1;
    st->spec.n = st->out.n = m + 1;
    int rc = loom_tensor_init(&st->out.t[m], LOOM_F32, &st->maxshape[m], err);
    if (rc) return rc;
    loom_shape one = st->maxshape[f];
    one.dim[0] = 1;
    int64_t numel = loom_shape_numel(&one);
    if (!(s->ones = loom_alloc((size_t)(numel ? numel : 1) * sizeof(float))))
        return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the mask");
    for (int64_t i = 0; i < numel; i++) s->ones[i] = 1.0f;
    s->mask_f = f;
    return LOOM_OK;
}

int padded_batch_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err)
{
    pbatchst *s = loom_calloc(1, sizeof *s);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a padded_batch stage");
    dstage *st = &s->s;
    dstage_init_(st, &pbatch_ops, in, id, &t->loc);
    snprintf(st->name, sizeof st->name, "padded_batch");
    s->size = t->batch_size;
    s->drop = t->drop_remainder;
    s->n_in = in->spec.n;
    s->mask_f = -1;
    int rc = LOOM_OK;
    char a[128], b[128];
    if (s->size < 1) {
        rc = dstage_err_(st, err, LOOM_ECONFIG, "padded_batch: size must be >= 1, got %lld", (long long)s->size);
        goto fail;
    }
    size_t k = (size_t)snprintf(st->desc, sizeof st->desc, "padded_batch(%lld,%d", (long long)s->size, s->drop);
    for (int f = 0; f < LOOM_MAX_FEATURES; f++)
        for (int d = 0; d < LOOM_MAX_RANK; d++) s->fixed[f][d] = -1;
    for (int j = 0; j < t->padded.n_shapes; j++) {
        int f = loom_elem_spec_find(&st->spec, t->padded.shape_name[j]);
        if (f < 0) {
            rc = no_feature(st, err, "padded_batch: padded_shapes", t->padded.shape_name[j]);
            goto fail;
        }
        loom_shape want = {0};
        want.rank = t->padded.rank[j];
        for (int d = 0; d < want.rank; d++) want.dim[d] = t->padded.shape[j][d];
        const loom_shape *sh = &st->spec.shape[f];
        if (want.rank != sh->rank) {
            rc = dstage_err_(st, err, LOOM_ESHAPE, "padded_batch: padded_shapes.%s = %s has rank %d, the feature has shape %s "
                             "(rank %d)", t->padded.shape_name[j], loom_shape_str(&want, a, sizeof a), want.rank,
                             loom_shape_str(sh, b, sizeof b), sh->rank);
            goto fail;
        }
        for (int d = 0; d < want.rank; d++) {
            if (want.dim[d] > 0 && sh->dim[d] > want.dim[d]) {
                rc = dstage_err_(st, err, LOOM_ESHAPE, "padded_batch: feature \"%s\" has shape %s, larger than padded_shapes.%s = %s",
                                 t->padded.shape_name[j], loom_shape_str(sh, a, sizeof a), t->padded.shape_name[j],
                                 loom_shape_str(&want, b, sizeof b));
                goto fail;
            }
            s->fixed[f][d] = want.dim[d] > 0 ? want.dim[d] : -1;
        }
    }
    for (int j = 0; j < t->padded.n_values; j++) {
        int f = loom_elem_spec_find(&st->spec, t->padded.value_name[j]);
        if (f < 0) {
            rc = no_feature(st, err, "padded_batch: padding_values", t->padded.value_name[j]);
            goto fail;
        }
        if (!pad_ok(st->spec.dtype[f], t->padded.value[j])) {
            rc = dstage_err_(st, err, LOOM_ECONFIG, "padded_batch: padding_values.%s = %g does not fit the feature's dtype %s",
                             t->padded.value_name[j], t->padded.value[j], loom_dtype_name(st->spec.dtype[f]));
            goto fail;
        }
        s->pad[f] = t->padded.value[j];
    }
    rc = elem_pool_init_(&s->pool, in, s->size, err);
    if (rc) goto fail;
    elem_pool_own_(&s->pool, st); /* the batch's elements are this stage's memory, not its input's */
    int64_t d0;
    st->card = dbatch_card_(in->card, s->size, s->drop, &d0);
    st->batch_dims = in->batch_dims + 1;
    st->out.n = st->spec.n;
    for (int f = 0; f < st->spec.n; f++) {
        loom_shape *sh = &st->spec.shape[f], *mx = &st->maxshape[f];
        for (int d = 0; d < sh->rank; d++) {
            if (s->fixed[f][d] > 0) {
                sh->dim[d] = mx->dim[d] = s->fixed[f][d];
            }
            if (k < sizeof st->desc) k += (size_t)snprintf(st->desc + k, sizeof st->desc - k, "%s%lld", d ? "x" : ",", (long long)s->fixed[f][d]);
        }
        if (k < sizeof st->desc) k += (size_t)snprintf(st->desc + k, sizeof st->desc - k, ":%g", s->pad[f]);
        if ((rc = dbatch_feature_(st, f, d0, s->size, "padded_batch", err))) goto fail;
    }
    if (t->padded.mask[0] && (rc = pbatch_mask(s, t->padded.mask, err))) goto fail;
    if (k < sizeof st->desc) snprintf(st->desc + k, sizeof st->desc - k, "%s%s)", t->padded.mask[0] ? ",mask " : "",
                                      t->padded.mask);
    *out = st;
    return LOOM_OK;
fail:
    pbatch_close(st);
    return rc;
}

/* ---- cache -----------------------------------------------------------------------
 * tf.data cache(): the first pass that reaches the end of its input fills the
 * cache, later passes replay it without touching the input; a pass cut short
 * discards what it cached (with a warning) and the next pass starts over.
 * Memory: a slot pool. File: <prefix>.data + <prefix>.index, written to
 * temporary names during the pass and renamed at its end (index last: its
 * presence means complete), under an flock on <prefix>.lock so a second
 * writer fails. The index records the upstream pipeline's fingerprint; a
 * cache from another pipeline is refused.
 *
 * Save/restore keeps checkpoints small: the state is (fill epoch, complete,
 * count, position). A restore that finds no cache to replay (memory, or a
 * file cache still being written) re-reads the saved part of the upstream
 * pass `fill epoch`, which is deterministic (randomness is keyed by seed,
 * stage, epoch and index), then carries on. */

#define CACHE_IDX_MAGIC   0x58444943u /* "CIDX" */
#define CACHE_DATA_MAGIC  0x54414443u /* "CDAT" */
#define CACHE_VERSION     1u

typedef struct cachest {
    dstage    s;
    int       file;          /* file cache */
    int       complete;      /* a whole pass is cached: replay it */
    int64_t   n;             /* elements cached */
    int64_t   pos;           /* replay position */
    int64_t   fill_epoch;    /* the upstream pass being (or that was) cached */
    int64_t   refill;        /* pending after a restore: re-read this many (-1: the whole pass) */
    int64_t   refill_n;      /* with refill -1: the count the saved pass had */
    elem_pool pool;          /* memory: the cache; file: one slot for the element read */
    int64_t   slot;          /* memory: bytes one cached element holds */
    int64_t   ram_left, ram; /* memory: the RAM budget left for the cache, and the whole budget */
    char      fp[4096];      /* fingerprint of the upstream pipeline and element spec */
    /* file */
    char      prefix[LOOM_PATH_MAX];
    char      data_path[LOOM_PATH_MAX + 16], index_path[LOOM_PATH_MAX + 16], lock_path[LOOM_PATH_MAX + 16];
    char      tmp_data[LOOM_PATH_MAX + 160];
    int       lock_fd;       /* -1 unless writing */
    FILE     *wf;            /* the data being written */
    uint64_t *woff;          /* offsets of the written elements */
    int64_t   woff_cap;
    FILE     *rf;            /* replay */
    uint64_t *roff;          /* offsets of the cached elements, n of them */
    int64_t   rnext;         /* element rf is positioned at */
} cachest;

static int sys_err(dstage *st, loom_err *err, const char *call, const char *path)
{
    return dstage_err_(st, err, LOOM_EIO, "cache: %s(%s) failed: %s", call, path, strerror(errno));
}

/* Writes one element to f: per feature u32 rank, i64 dims, raw bytes. */
static int write_elem(FILE *f, const loom_elem *e)
{
    for (int i = 0; i < e->n; i++) {
        const loom_tensor *t = &e->t[i];
        uint32_t r = (uint32_t)t->shape.rank;
        if (fwrite(&r, 4, 1, f) != 1) return -1;
        if (r && fwrite(t->shape.dim, 8, r, f) != r) return -1;
        size_t nb = loom_tensor_nbytes(t);
        if (nb && fwrite(t->data, 1, nb, f) != nb) return -1;
    }
    return 0;
}

static int cache_store(cachest *s, const loom_elem *e, loom_err *err)
{
    dstage *st = &s->s;
    if (!s->file) {
        /* a pass of unknown length is held to the RAM budget as it fills
         * (a known one was checked at open) */
        if (s->ram_left > 0 && (s->n + 1) * s->slot > s->ram_left) {
            dstage_err_(st, err, LOOM_ENOMEM,
                        "cache: the pass being cached in memory reached %lld elements (%lld bytes); one more would "
                        "exceed the %lld bytes left of the RAM budget of %lld bytes (data.options.autotune.ram_budget)",
                        (long long)s->n, (long long)(s->n * s->slot), (long long)s->ram_left, (long long)s->ram);
            return loom_err_hint(err, "a memory cache holds a whole pass: put it before repeat so the pass is finite, "
                                      "use a file cache (file = \"...\") or raise the RAM budget");
        }
        if (s->n == s->pool.cap) {
            int64_t cap = s->pool.cap < 64 ? 64 : s->pool.cap * 2;
            if (s->ram_left > 0 && cap * s->slot > s->ram_left) cap = s->ram_left / s->slot > s->n ? s->ram_left / s->slot : s->n + 1;
            int rc = elem_pool_grow_(&s->pool, cap, err);
            if (rc) return dstage_err_(st, err, rc, "cache: %s", err->msg);
        }
        int rc = elem_pool_put_(&s->pool, s->n, e, err);
        if (rc) return dstage_err_(st, err, rc, "cache: element %lld: %s", (long long)s->n, err->msg);
    } else {
        if (s->n == s->woff_cap) {
            int64_t cap = s->woff_cap < 1024 ? 1024 : s->woff_cap * 2;
            uint64_t *w = loom_realloc(s->woff, (size_t)cap * sizeof *w);
            if (!w) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot grow the cache index to %lld elements", (long long)cap);
            s->woff = w;
            s->woff_cap = cap;
        }
        long off = ftell(s->wf);
        if (off < 0 || write_elem(s->wf, e)) return sys_err(st, err, "write", s->tmp_data);
        s->woff[s->n] = (uint64_t)off;
    }
    s->n++;
    dstage_gauge_(&st->st_buffered, s->n);
    return LOOM_OK;
}

/* Starts writing the data file from scratch (a new or restarted fill pass). */
static int cache_wbegin(cachest *s, loom_err *err)
{
    if (!s->file) return LOOM_OK;
    if (!s->wf) {
        s->wf = fopen(s->tmp_data, "w+b");
        if (!s->wf) return sys_err(&s->s, err, "fopen", s->tmp_data);
    }
    rewind(s->wf);
    if (ftruncate(fileno(s->wf), 0) < 0) return sys_err(&s->s, err, "ftruncate", s->tmp_data);
    uint32_t h[2] = {CACHE_DATA_MAGIC, CACHE_VERSION};
    if (fwrite(h, sizeof h, 1, s->wf) != 1) return sys_err(&s->s, err, "write", s->tmp_data);
    return LOOM_OK;
}

static void cache_unlock(cachest *s)
{
    if (s->lock_fd < 0) return;
    unlink(s->lock_path); /* before unlocking: a writer waiting on this inode then finds the index */
    close(s->lock_fd);
    s->lock_fd = -1;
}

/* Loads <prefix>.index and opens <prefix>.data for replay; checks the fingerprint. */
static int cache_open_read(cachest *s, loom_err *err)
{
    dstage *st = &s->s;
    uint8_t *raw = NULL;
    size_t len = 0;
    int rc = loom_read_file(s->index_path, &raw, &len, err);
    if (rc) return dstage_err_(st, err, rc, "cache: %s", err->msg);
    loom_buf b;
    loom_buf_wrap(&b, raw, len);
    uint32_t magic = loom_buf_get_u32(&b), ver = loom_buf_get_u32(&b);
    char *fp = loom_alloc(sizeof s->fp);
    if (!fp) {
        loom_free(raw);
        return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot read a cache index");
    }
    loom_buf_get_str(&b, fp, sizeof s->fp);
    int64_t n = loom_buf_get_i64(&b);
    uint64_t data_size = loom_buf_get_u64(&b);
    if (b.failed || magic != CACHE_IDX_MAGIC || ver != CACHE_VERSION || n < 0 || (uint64_t)n > (len - b.pos) / 8) {
        rc = dstage_err_(st, err, LOOM_EDATA, "cache: %s is not a Loom cache index (or is damaged)", s->index_path);
        loom_err_hint(err, "delete %s.* to rebuild the cache", s->prefix);
        goto out;
    }
    if (strcmp(fp, s->fp)) {
        rc = dstage_err_(st, err, LOOM_EDATA, "cache: %s was written by a different pipeline (cached: %.160s; this one: %.160s)",
                         s->index_path, fp, s->fp);
        loom_err_hint(err, "delete %s.data and %s.index to rebuild it, or give this cache another `file` name", s->prefix,
                      s->prefix);
        goto out;
    }
    s->roff = loom_alloc((size_t)(n ? n : 1) * sizeof *s->roff);
    if (!s->roff) {
        rc = loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the cache index");
        goto out;
    }
    for (int64_t i = 0; i < n; i++) s->roff[i] = loom_buf_get_u64(&b);
    struct stat sb;
    s->rf = loom_fopen_regular(s->data_path, err); /* a FIFO in its place would block forever */
    if (!s->rf) {
        rc = dstage_err_(st, err, err->code, "cache: %s: %s", s->data_path, err->msg);
        loom_err_hint(err, "delete %s.data and %s.index to rebuild the cache, or give this cache another `file` name",
                      s->prefix, s->prefix);
        goto out;
    }
    if (fstat(fileno(s->rf), &sb) < 0 || (uint64_t)sb.st_size != data_size) {
        rc = dstage_err_(st, err, LOOM_EDATA, "cache: %s has %lld bytes, its index says %llu (damaged or replaced)", s->data_path,
                         (long long)sb.st_size, (unsigned long long)data_size);
        loom_err_hint(err, "delete %s.data and %s.index to rebuild the cache", s->prefix, s->prefix);
        goto out;
    }
    s->n = n;
    s->complete = 1;
    s->rnext = -1;
    dstage_gauge_(&st->st_buffered, n);
out:
    loom_free(fp);
    loom_free(raw);
    return rc;
}

/* The fill pass ended: memory is complete as is; a file is renamed into place
 * (data, then the index), unlocked and reopened for replay. */
static int cache_finish(cachest *s, loom_err *err)
{
    dstage *st = &s->s;
    if (!s->file) {
        s->complete = 1;
        return LOOM_OK;
    }
    if (fflush(s->wf) || fsync(fileno(s->wf)) < 0) return sys_err(st, err, "write", s->tmp_data);
    long size = ftell(s->wf);
    fclose(s->wf);
    s->wf = NULL;
    if (rename(s->tmp_data, s->data_path) < 0) return sys_err(st, err, "rename", s->data_path);
    loom_buf b;
    loom_buf_init(&b);
    loom_buf_put_u32(&b, CACHE_IDX_MAGIC);
    loom_buf_put_u32(&b, CACHE_VERSION);
    loom_buf_put_str(&b, s->fp);
    loom_buf_put_i64(&b, s->n);
    loom_buf_put_u64(&b, (uint64_t)size);
    for (int64_t i = 0; i < s->n; i++) loom_buf_put_u64(&b, s->woff[i]);
    int rc = b.failed ? loom_err_set(err, LOOM_ENOMEM, NULL, "cannot build the cache index")
                      : loom_write_file_atomic(s->index_path, b.data, b.len, err);
    loom_buf_fini(&b);
    if (rc) return dstage_err_(st, err, rc, "cache: %s", err->msg);
    loom_free(s->woff);
    s->woff = NULL;
    s->woff_cap = 0;
    cache_unlock(s);
    int64_t n = s->n;
    rc = cache_open_read(s, err);
    if (!rc && s->n != n) rc = dstage_err_(st, err, LOOM_EDATA, "cache: %s changed while it was written", s->index_path);
    loom_info("cache: wrote %lld elements to %s.data", (long long)n, s->prefix);
    return rc;
}

/* Reads cached element i of a file cache into pool slot 0. */
static int cache_read(cachest *s, int64_t i, loom_err *err)
{
    dstage *st = &s->s;
    if (s->rnext != i && fseek(s->rf, (long)s->roff[i], SEEK_SET) < 0) return sys_err(st, err, "fseek", s->data_path);
    loom_elem *o = &st->out;
    elem_pool_view_(&s->pool, 0, o);
    for (int f = 0; f < o->n; f++) {
        uint32_t r;
        loom_shape sh = {0};
        if (fread(&r, 4, 1, s->rf) != 1 || r > LOOM_MAX_RANK) goto bad;
        sh.rank = (int)r;
        if (r && fread(sh.dim, 8, r, s->rf) != r) goto bad;
        for (int d = 0; d < sh.rank; d++)
            if (sh.dim[d] < 0) goto bad;
        size_t nb = (size_t)loom_shape_numel(&sh) * loom_dtype_size(s->pool.dtype[f]);
        if (nb > s->pool.slot_bytes[f] || (!s->pool.varshape && !loom_shape_eq(&sh, &s->pool.shape[f]))) goto bad;
        if (nb && fread(o->t[f].data, 1, nb, s->rf) != nb) goto bad;
        o->t[f].shape = sh;
    }
    s->rnext = i + 1;
    return LOOM_OK;
bad:
    s->rnext = -1;
    dstage_err_(st, err, LOOM_EDATA, "cache: %s: element %lld is truncated or does not match the pipeline", s->data_path,
                (long long)i);
    return loom_err_hint(err, "delete %s.data and %s.index to rebuild the cache", s->prefix, s->prefix);
}

/* After a restore without a cache to replay: re-read the saved part of pass fill_epoch. */
static int cache_refill(cachest *s, loom_err *err)
{
    dstage *st = &s->s;
    int64_t want = s->refill, pos = s->pos;
    s->refill = 0;
    s->n = 0;
    s->complete = 0;
    int rc = cache_wbegin(s, err);
    if (!rc) rc = st->in->ops->rewind(st->in, s->fill_epoch, err);
    while (!rc && (want < 0 || s->n < want)) {
        loom_elem *e;
        rc = dstage_next_(st->in, &e, err);
        if (rc == LOOM_EEOF) {
            rc = want < 0 ? LOOM_OK : LOOM_EEOF;
            break;
        }
        if (!rc) rc = cache_store(s, e, err);
    }
    if (rc == LOOM_EEOF || (!rc && want < 0 && s->n != s->refill_n)) {
        dstage_err_(st, err, LOOM_ECHECKPOINT, "cache: re-reading the input to rebuild the cache gave %lld elements, the saved "
                    "state had %lld", (long long)s->n, (long long)(want < 0 ? s->refill_n : want));
        return loom_err_hint(err, "the input changed since the checkpoint; restart the input from an epoch boundary");
    }
    if (rc) return rc;
    if (want < 0) {
        rc = cache_finish(s, err);
        s->pos = pos;
    }
    return rc;
}

static int cache_next(dstage *st, loom_elem **out, loom_err *err)
{
    cachest *s = (cachest *)st;
    int rc;
    if (s->refill && (rc = cache_refill(s, err))) return rc;
    if (s->complete) {
        if (s->pos >= s->n) return LOOM_EEOF;
        if (s->file) {
            if ((rc = cache_read(s, s->pos, err))) return rc;
            memset(st->mut, 1, sizeof st->mut); /* our slot, rewritten each time */
        } else {
            elem_pool_view_(&s->pool, s->pos, &st->out);
            memset(st->mut, 0, sizeof st->mut); /* the cache itself: read-only */
        }
        s->pos++;
        *out = &st->out;
        return LOOM_OK;
    }
    loom_elem *e;
    rc = dstage_next_(st->in, &e, err);
    if (rc == LOOM_EEOF) {
        if ((rc = cache_finish(s, err))) return rc;
        s->pos = s->n;
        return LOOM_EEOF;
    }
    if (rc) return rc;
    if ((rc = cache_store(s, e, err))) return rc;
    s->pos = s->n;
    memcpy(st->mut, st->in->mut, sizeof st->mut); /* already copied: downstream may modify the input's buffer */
    *out = e;
    return LOOM_OK;
}

static int cache_rewind(dstage *st, int64_t epoch, loom_err *err)
{
    cachest *s = (cachest *)st;
    if (s->complete || s->refill < 0) {
        s->pos = 0;
        return LOOM_OK;
    }
    if (s->n > 0)
        loom_warn("%s%s%s: the pass ended after %lld elements, before the end of its input: the partial cache is discarded (to "
                  "cache a part of a dataset, put take() before cache())", st->where, st->where[0] ? ": " : "", st->name,
                  (long long)s->n);
    s->n = s->pos = s->refill = 0;
    s->fill_epoch = epoch;
    dstage_gauge_(&st->st_buffered, 0);
    int rc = cache_wbegin(s, err);
    return rc ? rc : st->in->ops->rewind(st->in, epoch, err);
}

static void cache_save(dstage *st, loom_buf *b)
{
    cachest *s = (cachest *)st;
    int complete = s->complete || s->refill < 0;
    loom_buf_put_i64(b, s->fill_epoch);
    loom_buf_put_u32(b, (uint32_t)complete);
    loom_buf_put_i64(b, s->refill < 0 ? s->refill_n : s->refill > 0 ? s->refill : s->n);
    loom_buf_put_i64(b, s->pos);
}

static int cache_restore(dstage *st, loom_buf *b, loom_err *err)
{
    cachest *s = (cachest *)st;
    int64_t epoch = loom_buf_get_i64(b);
    int complete = (int)loom_buf_get_u32(b);
    int64_t n = loom_buf_get_i64(b), pos = loom_buf_get_i64(b);
    if (b->failed || n < 0 || pos < 0 || pos > n) return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "iterator state is corrupt (cache)");
    s->fill_epoch = epoch;
    if (s->file && s->rf) { /* the file is complete: replay it from the saved position */
        if (n > s->n || (complete && n != s->n))
            return dstage_err_(st, err, LOOM_ECHECKPOINT, "cache: the saved state is at element %lld of %lld, the cache file %s holds %lld",
                               (long long)pos, (long long)n, s->data_path, (long long)s->n);
        s->pos = complete ? pos : n;
        s->refill = 0;
        return LOOM_OK;
    }
    s->complete = 0;
    s->n = 0;
    s->pos = complete ? pos : n;
    s->refill = complete ? -1 : n;
    s->refill_n = n;
    return LOOM_OK;
}

static void cache_close(dstage *st)
{
    cachest *s = (cachest *)st;
    if (s->wf) {
        fclose(s->wf);
        unlink(s->tmp_data); /* an incomplete cache is deleted, as tf.data does */
    }
    cache_unlock(s);
    if (s->rf) fclose(s->rf);
    loom_free(s->woff);
    loom_free(s->roff);
    elem_pool_fini_(&s->pool);
    loom_free(s);
}

static const dstage_ops cache_ops = {
    .next = cache_next, .rewind = cache_rewind, .save = cache_save, .restore = cache_restore, .close = cache_close,
};

/* Takes <prefix>.lock for writing; LOOM_EIO naming the holder when another writer has it. */
static int cache_lock(cachest *s, loom_err *err)
{
    dstage *st = &s->s;
    s->lock_fd = open(s->lock_path, O_RDWR | O_CREAT | O_CLOEXEC | O_NONBLOCK | O_NOCTTY, 0644);
    if (s->lock_fd < 0) return sys_err(st, err, "open", s->lock_path);
    struct stat lst;
    if (fstat(s->lock_fd, &lst) < 0 || !S_ISREG(lst.st_mode)) { /* a FIFO or a device: not ours to write a pid into */
        close(s->lock_fd);
        s->lock_fd = -1;
        dstage_err_(st, err, LOOM_EIO, "cache: %s is not a regular file: refused", s->lock_path);
        return loom_err_hint(err, "remove it, or give this cache another `file` name");
    }
    if (flock(s->lock_fd, LOCK_EX | LOCK_NB) < 0) {
        int e = errno;
        char pid[32] = "?";
        ssize_t k = pread(s->lock_fd, pid, sizeof pid - 1, 0);
        pid[k > 0 ? k : 1] = 0;
        pid[strcspn(pid, "\n")] = 0;
        close(s->lock_fd);
        s->lock_fd = -1;
        if (e != EWOULDBLOCK) {
            errno = e;
            return sys_err(st, err, "flock", s->lock_path);
        }
        dstage_err_(st, err, LOOM_EIO, "cache: %s.* is being written by another iterator (process %s holds %s)", s->prefix, pid,
                    s->lock_path);
        return loom_err_hint(err, "let that run finish writing the cache, or give this cache another `file` name");
    }
    char pid[32];
    int k = snprintf(pid, sizeof pid, "%ld\n", (long)getpid());
    if (ftruncate(s->lock_fd, 0) < 0 || pwrite(s->lock_fd, pid, (size_t)k, 0) != k) return sys_err(st, err, "write", s->lock_path);
    return LOOM_OK;
}

/* Source files into the fingerprint: a cache of other files is another cache. */
static void fp_source(char *fp, size_t n, size_t k, const loom_source_spec *src)
{
    if (!src) return;
    if (src->kind == LOOM_SRC_IDX)
        for (int i = 0; i < src->n_features && k < n; i++)
            k += (size_t)snprintf(fp + k, n - k, " %s=%s", src->feature[i], src->idx.file[i]);
    else if (src->kind == LOOM_SRC_TFRECORD)
        for (int i = 0; i < src->n_patterns && k < n; i++) k += (size_t)snprintf(fp + k, n - k, " %s", src->pattern[i]);
    else if (src->kind == LOOM_SRC_CATALOG && k < n)
        snprintf(fp + k, n - k, " %s/%s", src->catalog.name, src->catalog.split);
    else if (k < n)
        snprintf(fp + k, n - k, " /"); /* the other kinds: no file named here */
}

int cache_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, const loom_source_spec *src,
                int64_t ram_left, int64_t ram, loom_err *err)
{
    cachest *s = loom_calloc(1, sizeof *s);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a cache stage");
    dstage *st = &s->s;
    dstage_init_(st, &cache_ops, in, id, &t->loc);
    s->lock_fd = -1;
    s->file = t->cache_file[0] != 0;
    snprintf(st->name, sizeof st->name, "cache(%s)", s->file ? "file" : "memory");
    snprintf(st->desc, sizeof st->desc, "cache(%.140s)", s->file ? t->cache_file : "");
    if (in->card == -1) {
        /* an endless input never ends a pass: the cache would only grow */
        int rc = dstage_err_(st, err, LOOM_ECONFIG, "cache: its input is infinite (a repeat of -1 before it), so the "
                             "pass it caches never ends and its %s would grow without bound", s->file ? "file" : "memory");
        loom_err_hint(err, "put cache before repeat, so that it holds one finite pass");
        cache_close(st);
        return rc;
    }
    for (int f = 0; f < in->spec.n; f++)
        s->slot += loom_shape_numel(&in->maxshape[f]) * (int64_t)loom_dtype_size(in->spec.dtype[f]);
    if (s->slot < 1) s->slot = 1;
    s->ram_left = ram_left;
    s->ram = ram;
    /* upstream descriptions, source first, then the element spec */
    const dstage *chain[LOOM_MAX_TRANSFORMS + 2];
    int nc = 0;
    for (const dstage *p = in; p && nc < LOOM_MAX_TRANSFORMS + 2; p = p->in) chain[nc++] = p;
    size_t k = 0;
    for (int i = nc - 1; i >= 0 && k < sizeof s->fp; i--)
        k += (size_t)snprintf(s->fp + k, sizeof s->fp - k, "%s%s", i < nc - 1 ? " | " : "", chain[i]->desc);
    if (k < sizeof s->fp) {
        fp_source(s->fp, sizeof s->fp, k, src);
        k = strlen(s->fp);
    }
    if (k < sizeof s->fp) k += (size_t)snprintf(s->fp + k, sizeof s->fp - k, " => ");
    if (k < sizeof s->fp) loom_elem_spec_str(&st->spec, s->fp + k, sizeof s->fp - k);
    int rc = elem_pool_init_(&s->pool, st, s->file ? 1 : (in->card > 0 && in->card < 1024 ? in->card : 64), err);
    if (rc) goto fail;
    if (s->file) {
        snprintf(s->prefix, sizeof s->prefix, "%s", t->cache_file);
        snprintf(s->data_path, sizeof s->data_path, "%s.data", s->prefix);
        snprintf(s->index_path, sizeof s->index_path, "%s.index", s->prefix);
        snprintf(s->lock_path, sizeof s->lock_path, "%s.lock", s->prefix);
        /* the files it may write: new, regular, or links to regular files
         * (written through); a FIFO or a directory there is refused now */
        char tgt[LOOM_PATH_MAX];
        if ((rc = loom_output_target(s->data_path, tgt, sizeof tgt, err)) ||
            (snprintf(s->data_path, sizeof s->data_path, "%s", tgt),
             rc = loom_output_target(s->index_path, tgt, sizeof tgt, err))) {
            rc = dstage_err_(st, err, rc, "cache: %s: %s", err->where, err->msg);
            goto fail;
        }
        snprintf(s->index_path, sizeof s->index_path, "%s", tgt);
        char sfx[128];
        snprintf(s->tmp_data, sizeof s->tmp_data, "%s%s", s->data_path, loom_tmp_suffix(sfx, sizeof sfx));
        char dir[LOOM_PATH_MAX];
        snprintf(dir, sizeof dir, "%s", s->prefix);
        char *slash = strrchr(dir, '/');
        if (slash && slash != dir) {
            *slash = 0;
            if ((rc = loom_mkdirs(dir, err))) {
                rc = dstage_err_(st, err, rc, "cache: %s", err->msg);
                goto fail;
            }
        }
        if (access(s->index_path, F_OK) < 0) {
            if ((rc = cache_lock(s, err))) goto fail;
            if (access(s->index_path, F_OK) == 0) cache_unlock(s); /* finished while we waited */
        }
        if (s->lock_fd < 0) {
            if ((rc = cache_open_read(s, err))) goto fail;
        } else if ((rc = cache_wbegin(s, err))) {
            goto fail;
        }
    }
    *out = st;
    return LOOM_OK;
fail:
    cache_close(st);
    return rc;
}
