/* repeat.c - repeat, take and skip: counting stages (take and skip pass
 * random access through); with save and restore of their counts. */
#include "data/data_internal.h"
#include "transform_internal.h"

#include <string.h>

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
