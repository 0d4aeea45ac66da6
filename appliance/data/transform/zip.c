/* zip.c - tf.data zip of two datasets (tf_semantics §4.2): each element is
 * the features of the main pipeline's next element followed by those of the
 * zipped dataset's (a whole pipeline of its own, built from the transform's
 * nested dataset spec, unsharded: a distributed plan shards what the zip
 * yields). The pass ends when either ends; the main input is pulled first, so
 * the zipped one is not pulled past the main one's end. A feature name in
 * both is a config error naming the transform and both sides.
 * Cardinality: the smaller, infinite counting as the larger, unknown if
 * either is unknown. State: the zipped pipeline's whole state (its own
 * fingerprint inside), after the main chain's.
 * Threads: as any stage; the zipped pipeline's background stages run inside it. */
#include "data/data_internal.h"

#include <string.h>

typedef struct zip_stage {
    dstage     s;
    loom_iter *other;
    int        n_in; /* features of the main input, first in the element */
    bool       done;
} zip_stage;

static int zip_next(dstage *st, loom_elem **out, loom_err *err)
{
    zip_stage *z = (zip_stage *)st;
    if (z->done) return LOOM_EEOF;
    loom_elem *a, *b;
    int rc = dstage_next_(st->in, &a, err);
    if (rc == LOOM_OK) rc = loom_iter_next(z->other, &b, err);
    if (rc == LOOM_EEOF) z->done = true;
    if (rc) return rc;
    for (int f = 0; f < z->n_in; f++) st->out.t[f] = a->t[f];
    for (int f = 0; f < b->n; f++) st->out.t[z->n_in + f] = b->t[f];
    memcpy(st->mut, st->in->mut, (size_t)z->n_in);
    memcpy(st->mut + z->n_in, iter_last_(z->other)->mut, (size_t)b->n);
    *out = &st->out;
    return LOOM_OK;
}

static int zip_rewind(dstage *st, int64_t epoch, loom_err *err)
{
    zip_stage *z = (zip_stage *)st;
    z->done = false;
    int rc = st->in->ops->rewind(st->in, epoch, err);
    return rc ? rc : loom_iter_rewind(z->other, epoch, err);
}

static void zip_save(dstage *st, loom_buf *b)
{
    zip_stage *z = (zip_stage *)st;
    loom_err err;
    loom_buf_put_u32(b, z->done);
    if (loom_iter_save(z->other, b, &err)) b->failed = 1; /* out of memory: the pipeline's save reports it */
}

static int zip_restore(dstage *st, loom_buf *b, loom_err *err)
{
    zip_stage *z = (zip_stage *)st;
    uint32_t done = loom_buf_get_u32(b);
    if (b->failed || done > 1)
        return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "iterator state is corrupt (zip)");
    int rc = loom_iter_restore(z->other, b, err);
    if (rc) return rc;
    z->done = done;
    return LOOM_OK;
}

static void zip_close(dstage *st)
{
    zip_stage *z = (zip_stage *)st;
    loom_iter_close(z->other);
    loom_free(z);
}

static const dstage_ops zip_ops = {
    .next = zip_next, .rewind = zip_rewind, .save = zip_save, .restore = zip_restore, .close = zip_close,
};

static int64_t zip_card(int64_t a, int64_t b)
{
    if (a == -2 || b == -2) return -2;
    if (a == -1) return b;
    if (b == -1) return a;
    return a < b ? a : b;
}

int zip_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, const loom_data_ctx *ctx, loom_err *err)
{
    *out = NULL;
    zip_stage *z = loom_calloc(1, sizeof *z);
    if (!z) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a zip stage");
    dstage *st = &z->s;
    dstage_init_(st, &zip_ops, in, id, &t->loc);
    snprintf(st->name, sizeof st->name, "zip");
    int rc;
    if (!t->dataset) {
        rc = dstage_err_(st, err, LOOM_ECONFIG, "zip needs a dataset");
        goto fail;
    }
    loom_data_ctx sub = *ctx;
    memset(&sub.input, 0, sizeof sub.input);
    sub.name = "zip";
    if ((rc = loom_data_open(&z->other, t->dataset, &sub, err))) goto fail;
    const dstage *o = iter_last_(z->other);
    const loom_elem_spec *a = &in->spec, *b = &o->spec;
    char sa[256], sb[256];
    for (int f = 0; f < b->n; f++)
        if (loom_elem_spec_find(a, b->name[f]) >= 0) {
            rc = dstage_err_(st, err, LOOM_ECONFIG,
                             "feature \"%s\" is in both the pipeline zipped into (%s) and the zipped dataset (%s)",
                             b->name[f], loom_elem_spec_str(a, sa, sizeof sa), loom_elem_spec_str(b, sb, sizeof sb));
            loom_err_hint(err, "a name may be on one side only: drop the feature from one source (a csv column can be "
                               "declared under another name with `column`)");
            goto fail;
        }
    if (a->n + b->n > LOOM_MAX_FEATURES) {
        rc = dstage_err_(st, err, LOOM_ECONFIG, "zip gives %d features, at most %d", a->n + b->n, LOOM_MAX_FEATURES);
        goto fail;
    }
    if (in->batch_dims != o->batch_dims) {
        rc = dstage_err_(st, err, LOOM_ECONFIG,
                         "the pipeline zipped into has %d batch dimension(s), the zipped dataset %d: zip both batched "
                         "or both unbatched", in->batch_dims, o->batch_dims);
        goto fail;
    }
    z->n_in = a->n;
    st->spec = *a;
    st->spec.n = st->out.n = a->n + b->n;
    for (int f = 0; f < b->n; f++) {
        memcpy(st->spec.name[a->n + f], b->name[f], LOOM_NAME_MAX);
        st->spec.dtype[a->n + f] = b->dtype[f];
        st->spec.shape[a->n + f] = b->shape[f];
        st->maxshape[a->n + f] = o->maxshape[f];
    }
    memcpy(st->maxshape, in->maxshape, (size_t)a->n * sizeof st->maxshape[0]);
    st->batch_dims = in->batch_dims;
    st->card = zip_card(in->card, o->card);
    snprintf(st->desc, sizeof st->desc, "zip(%.140s)", loom_elem_spec_str(b, sb, sizeof sb));
    *out = st;
    return LOOM_OK;
fail:
    zip_close(st);
    return rc;
}
