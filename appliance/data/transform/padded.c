/* padded.c - bucket_by_sequence_length (tf.data.experimental, tf_semantics
 * 4.3's padded_batch per bucket): each element goes to the bucket of its
 * length (dim 0 of `feature`): bucket i holds lengths in [b(i-1), b(i)), the
 * first from 0, the last to infinity. When a bucket holds its batch size
 * (bucket_batch_sizes[i]) it is emitted as one padded batch: every dim that
 * varies per element padded to the largest in the batch, or with
 * pad_to_bucket_boundary to the bucket's boundary - 1 (a length in the last
 * bucket is then an error, as tf asserts). At the pass's end the partial
 * buckets are emitted in bucket order (tf's group_by_window flushes its
 * groups by key), or dropped with drop_remainder. padding_values and mask as
 * padded_batch's. Buffer: every bucket's slots (sum of the batch sizes),
 * counted in the stage's bytes and the RAM budget. State: the input position
 * and the held elements of each bucket.
 * Threads: one thread drives the stage (data_internal.h). */
#include "data/data_internal.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

typedef struct bucketst {
    dstage     s;
    int        nb;                   /* buckets: boundaries + 1 */
    int64_t    bound[LOOM_MAX_BUCKETS], bsize[LOOM_MAX_BUCKETS + 1];
    int        f;                    /* the sequence feature */
    int        to_boundary, drop;
    double     pad[LOOM_MAX_FEATURES];
    int        mask_f;               /* feature masked, -1 none; its mask is output feature n_in */
    int        n_in;                 /* input features */
    float     *ones;                 /* the mask's source: 1s of the masked feature's max size */
    elem_pool *pool;                 /* nb pools */
    int64_t    cnt[LOOM_MAX_BUCKETS + 1];
    int64_t    pos;                  /* input elements consumed this pass */
    int        eof, flush;           /* the input ended; next bucket to flush */
} bucketst;

static int64_t elem_bytes(const dstage *in)
{
    int64_t b = 0;
    for (int f = 0; f < in->spec.n; f++) b += loom_shape_numel(&in->maxshape[f]) * (int64_t)loom_dtype_size(in->spec.dtype[f]);
    return b;
}

int64_t bucket_max_bytes_(const dstage *in, const loom_transform_spec *t)
{
    int64_t n = 0, mx = 0;
    for (int i = 0; i <= t->padded.n_boundaries; i++) {
        n += t->padded.bucket_size[i];
        if (t->padded.bucket_size[i] > mx) mx = t->padded.bucket_size[i];
    }
    return (n + mx) * elem_bytes(in);
}

static int bucket_of(const bucketst *s, int64_t len)
{
    int b = 0;
    while (b < s->nb - 1 && len >= s->bound[b]) b++;
    return b;
}

/* Bucket b's cnt elements as one padded batch into the stage's output. */
static int emit(bucketst *s, int b, loom_elem **out, loom_err *err)
{
    dstage *st = &s->s;
    loom_elem *o = &st->out, v;
    int64_t n = s->cnt[b];
    loom_shape tgt[LOOM_MAX_FEATURES];
    for (int f = 0; f < s->n_in; f++) {
        const loom_shape *sh = &st->in->spec.shape[f];
        tgt[f] = *sh;
        for (int d = 0; d < sh->rank; d++)
            if (sh->dim[d] < 0) tgt[f].dim[d] = s->to_boundary ? s->bound[b] - 1 : 0;
    }
    for (int64_t j = 0; j < n && !s->to_boundary; j++) {
        elem_pool_view_(&s->pool[b], j, &v);
        for (int f = 0; f < s->n_in; f++)
            for (int d = 0; d < tgt[f].rank; d++)
                if (v.t[f].shape.dim[d] > tgt[f].dim[d]) tgt[f].dim[d] = v.t[f].shape.dim[d];
    }
    for (int f = 0; f < s->n_in; f++) {
        size_t esz = loom_dtype_size(st->spec.dtype[f]), per = (size_t)loom_shape_numel(&tgt[f]) * esz;
        loom_tensor *ot = &o->t[f];
        dfill_value_(ot->data, ot->dtype, (size_t)n * per / (esz ? esz : 1), s->pad[f]);
        for (int64_t j = 0; j < n; j++) {
            elem_pool_view_(&s->pool[b], j, &v);
            dcopy_padded_((uint8_t *)ot->data + (size_t)j * per, &tgt[f], v.t[f].data, &v.t[f].shape, esz);
            if (f == s->mask_f) {
                loom_tensor *mt = &o->t[s->n_in];
                size_t mper = (size_t)loom_shape_numel(&tgt[f]) * sizeof(float);
                if (j == 0) memset(mt->data, 0, (size_t)n * mper);
                dcopy_padded_((uint8_t *)mt->data + (size_t)j * mper, &tgt[f], (const uint8_t *)s->ones, &v.t[f].shape,
                              sizeof(float));
            }
        }
        ot->shape.rank = tgt[f].rank + 1;
        ot->shape.dim[0] = n;
        memcpy(ot->shape.dim + 1, tgt[f].dim, (size_t)tgt[f].rank * sizeof tgt[f].dim[0]);
        if (f == s->mask_f) o->t[s->n_in].shape = ot->shape;
    }
    s->cnt[b] = 0;
    *out = o;
    (void)err;
    return LOOM_OK;
}

static int bucket_next(dstage *st, loom_elem **out, loom_err *err)
{
    bucketst *s = (bucketst *)st;
    while (!s->eof) {
        loom_elem *e;
        int rc = dstage_next_(st->in, &e, err);
        if (rc == LOOM_EEOF) {
            s->eof = 1;
            s->flush = 0;
            break;
        }
        if (rc) return rc;
        const loom_tensor *t = &e->t[s->f];
        int64_t len = t->shape.rank ? t->shape.dim[0] : 1;
        int b = bucket_of(s, len);
        if (s->to_boundary) {
            if (b == s->nb - 1)
                return dstage_err_(st, err, LOOM_EDATA, "bucket_by_sequence_length: element %lld has length %lld, not "
                                   "below the largest boundary %lld; with pad_to_bucket_boundary every length must be "
                                   "(as tf asserts)", (long long)s->pos, (long long)len, (long long)s->bound[s->nb - 2]);
            for (int f = 0; f < s->n_in; f++)
                for (int d = 0; d < e->t[f].shape.rank; d++)
                    if (st->in->spec.shape[f].dim[d] < 0 && e->t[f].shape.dim[d] > s->bound[b] - 1)
                        return dstage_err_(st, err, LOOM_ESHAPE, "bucket_by_sequence_length: element %lld: feature "
                                           "\"%s\" has dim %d = %lld, more than its bucket's boundary - 1 = %lld",
                                           (long long)s->pos, st->spec.name[f], d, (long long)e->t[f].shape.dim[d],
                                           (long long)s->bound[b] - 1);
        }
        rc = elem_pool_put_(&s->pool[b], s->cnt[b], e, err);
        if (rc) return dstage_err_(st, err, rc, "bucket_by_sequence_length: element %lld: %s", (long long)s->pos, err->msg);
        s->cnt[b]++;
        s->pos++;
        if (s->cnt[b] == s->bsize[b]) return emit(s, b, out, err);
    }
    for (; s->flush < s->nb; s->flush++) {
        int b = s->flush;
        if (!s->cnt[b]) continue;
        if (s->drop) {
            s->cnt[b] = 0;
            continue;
        }
        s->flush++;
        return emit(s, b, out, err);
    }
    return LOOM_EEOF;
}

static int bucket_rewind(dstage *st, int64_t epoch, loom_err *err)
{
    bucketst *s = (bucketst *)st;
    s->pos = s->eof = s->flush = 0;
    memset(s->cnt, 0, sizeof s->cnt);
    return st->in->ops->rewind(st->in, epoch, err);
}

static void bucket_save(dstage *st, loom_buf *b)
{
    bucketst *s = (bucketst *)st;
    loom_buf_put_i64(b, s->pos);
    loom_buf_put_u32(b, (uint32_t)s->eof);
    loom_buf_put_u32(b, (uint32_t)s->flush);
    loom_buf_put_u32(b, (uint32_t)s->nb);
    for (int k = 0; k < s->nb; k++) {
        loom_buf_put_i64(b, s->cnt[k]);
        for (int64_t j = 0; j < s->cnt[k]; j++) elem_pool_save_(&s->pool[k], j, b);
    }
}

static int bucket_restore(dstage *st, loom_buf *b, loom_err *err)
{
    bucketst *s = (bucketst *)st;
    s->pos = loom_buf_get_i64(b);
    s->eof = (int)loom_buf_get_u32(b);
    s->flush = (int)loom_buf_get_u32(b);
    int nb = (int)loom_buf_get_u32(b);
    if (b->failed || nb != s->nb || s->flush < 0 || s->flush > s->nb)
        return loom_err_set(err, LOOM_ECHECKPOINT, st->where, "iterator state is corrupt (%s)", st->name);
    for (int k = 0; k < s->nb; k++) {
        s->cnt[k] = loom_buf_get_i64(b);
        if (b->failed || s->cnt[k] < 0 || s->cnt[k] >= s->bsize[k])
            return loom_err_set(err, LOOM_ECHECKPOINT, st->where, "iterator state is corrupt (%s)", st->name);
        for (int64_t j = 0; j < s->cnt[k]; j++) {
            int rc = elem_pool_load_(&s->pool[k], j, b, err);
            if (rc) return rc;
        }
    }
    return LOOM_OK;
}

static void bucket_close(dstage *st)
{
    bucketst *s = (bucketst *)st;
    for (int f = 0; f < st->out.n; f++) loom_tensor_fini(&st->out.t[f]);
    for (int k = 0; s->pool && k < s->nb; k++) elem_pool_fini_(&s->pool[k]);
    loom_free(s->pool);
    loom_free(s->ones);
    loom_free(s);
}

static const dstage_ops bucket_ops = {
    .next = bucket_next, .rewind = bucket_rewind, .save = bucket_save, .restore = bucket_restore, .close = bucket_close,
};

/* The mask of feature s->mask_f as output feature n_in: "<name>_mask", float32 of its padded shape. */
static int bucket_mask(bucketst *s, const char *name, loom_err *err)
{
    dstage *st = &s->s;
    int m = s->n_in;
    snprintf(st->spec.name[m], LOOM_NAME_MAX, "%.*s_mask", LOOM_NAME_MAX - 6, name);
    if (loom_elem_spec_find(&st->in->spec, st->spec.name[m]) >= 0)
        return dstage_err_(st, err, LOOM_ECONFIG, "bucket_by_sequence_length: a feature \"%s\" exists already",
                           st->spec.name[m]);
    st->spec.dtype[m] = LOOM_F32;
    st->spec.shape[m] = st->spec.shape[s->mask_f];
    st->maxshape[m] = st->maxshape[s->mask_f];
    st->mut[m] = 1;
    st->spec.n = st->out.n = m + 1;
    int rc = loom_tensor_init(&st->out.t[m], LOOM_F32, &st->maxshape[m], err);
    if (rc) return rc;
    loom_shape one = st->maxshape[s->mask_f];
    one.dim[0] = 1;
    int64_t numel = loom_shape_numel(&one);
    if (!(s->ones = loom_alloc((size_t)(numel ? numel : 1) * sizeof(float))))
        return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the mask");
    for (int64_t i = 0; i < numel; i++) s->ones[i] = 1.0f;
    return LOOM_OK;
}

int bucket_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err)
{
    bucketst *s = loom_calloc(1, sizeof *s);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a bucket_by_sequence_length stage");
    dstage *st = &s->s;
    dstage_init_(st, &bucket_ops, in, id, &t->loc);
    snprintf(st->name, sizeof st->name, "bucket_by_sequence_length");
    const loom_padded_spec *p = &t->padded;
    int rc = LOOM_OK;
    char a[128];
    s->nb = p->n_boundaries + 1;
    s->to_boundary = p->pad_to_bucket_boundary;
    s->drop = t->drop_remainder;
    s->mask_f = -1;
    s->n_in = in->spec.n;
    if (p->n_boundaries < 1 || p->n_boundaries > LOOM_MAX_BUCKETS) {
        rc = dstage_err_(st, err, LOOM_ECONFIG, "bucket_by_sequence_length: 1 to %d bucket_boundaries, got %d",
                         LOOM_MAX_BUCKETS, p->n_boundaries);
        goto fail;
    }
    size_t k = (size_t)snprintf(st->desc, sizeof st->desc, "bucket(%s,%d,%d", t->feature, s->to_boundary, s->drop);
    for (int i = 0; i < s->nb; i++) {
        if (i < p->n_boundaries) s->bound[i] = p->boundary[i];
        s->bsize[i] = p->bucket_size[i];
        if (s->bsize[i] < 1 || (i < p->n_boundaries && (s->bound[i] < 1 || (i && s->bound[i] <= s->bound[i - 1])))) {
            rc = dstage_err_(st, err, LOOM_ECONFIG, "bucket_by_sequence_length: boundaries must increase from 1 and "
                             "each of the %d buckets needs a batch size >= 1", s->nb);
            goto fail;
        }
        if (k < sizeof st->desc)
            k += (size_t)snprintf(st->desc + k, sizeof st->desc - k, ",%lld:%lld", i < p->n_boundaries ? (long long)s->bound[i] : -1LL,
                                  (long long)s->bsize[i]);
    }
    if (k < sizeof st->desc) snprintf(st->desc + k, sizeof st->desc - k, ")");
    s->f = loom_elem_spec_find(&in->spec, t->feature);
    if (s->f < 0) {
        rc = dstage_err_(st, err, LOOM_ECONFIG, "bucket_by_sequence_length: no feature \"%s\" reaches it", t->feature);
        goto fail;
    }
    if (in->spec.shape[s->f].rank < 1 || in->batch_dims) {
        rc = dstage_err_(st, err, LOOM_ESHAPE, "bucket_by_sequence_length: \"%s\" must be a sequence (its length is dim 0), "
                         "unbatched; it is %s%s", t->feature, loom_shape_str(&in->spec.shape[s->f], a, sizeof a),
                         in->batch_dims ? " (batched)" : "");
        goto fail;
    }
    for (int j = 0; j < p->n_values; j++) {
        int f = loom_elem_spec_find(&in->spec, p->value_name[j]);
        if (f < 0) {
            rc = dstage_err_(st, err, LOOM_ECONFIG, "bucket_by_sequence_length: padding_values: no feature \"%s\"",
                             p->value_name[j]);
            goto fail;
        }
        s->pad[f] = p->value[j];
    }
    if (p->mask[0]) {
        s->mask_f = loom_elem_spec_find(&in->spec, p->mask);
        if (s->mask_f < 0 || s->n_in + 1 > LOOM_MAX_FEATURES) {
            rc = dstage_err_(st, err, LOOM_ECONFIG, "bucket_by_sequence_length: mask: no feature \"%s\" (or no room for "
                             "its mask)", p->mask);
            goto fail;
        }
    }
    if (!(s->pool = loom_calloc((size_t)s->nb, sizeof *s->pool))) {
        rc = loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the buckets");
        goto fail;
    }
    int64_t most = 0;
    for (int i = 0; i < s->nb; i++) {
        if ((rc = elem_pool_init_(&s->pool[i], in, s->bsize[i], err))) goto fail;
        elem_pool_own_(&s->pool[i], st);
        if (s->bsize[i] > most) most = s->bsize[i];
    }
    st->out.n = s->n_in; /* (freed by close from here on) */
    /* the output: every feature batched, padded dims at their max (the boundary - 1 when it is larger) */
    for (int f = 0; f < s->n_in; f++) {
        loom_shape *sh = &st->spec.shape[f], *mx = &st->maxshape[f];
        for (int d = 0; d < sh->rank && s->to_boundary; d++)
            if (sh->dim[d] < 0 && mx->dim[d] < s->bound[s->nb - 2] - 1) mx->dim[d] = s->bound[s->nb - 2] - 1;
        if ((rc = dbatch_feature_(st, f, -1, most, "bucket_by_sequence_length", err))) goto fail;
    }
    st->spec.n = st->out.n = s->n_in;
    if (s->mask_f >= 0 && (rc = bucket_mask(s, p->mask, err))) goto fail;
    int64_t out_bytes = 0; /* the batch's tensors */
    for (int f = 0; f < st->out.n; f++) out_bytes += (int64_t)loom_tensor_nbytes(&st->out.t[f]);
    __atomic_fetch_add(&st->st_bytes, out_bytes, __ATOMIC_RELAXED);
    st->batch_dims = in->batch_dims + 1;
    st->card = in->card == -1 ? -1 : in->card == 0 ? 0 : -2;
    *out = st;
    return LOOM_OK;
fail:
    bucket_close(st);
    return rc;
}
