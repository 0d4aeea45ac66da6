/* window.c - tf.data's window(size, shift, stride, drop_remainder) and
 * lm_pairs, for sequences cut from a stream (language modelling).
 *
 * window: window k holds the input elements k*shift + j*stride, j < size, of
 * the pass; without drop_remainder the last windows are shorter (as tf.data's
 * ends: range(7).window(3, 2) is [0 1 2] [2 3 4] [4 5 6] [6]); with it they
 * are dropped. tf.data yields each window as a dataset that the user batches
 * with flat_map(lambda w: w.batch(size)); here a window is that batch: one
 * element whose features are the elements stacked on a new leading dim,
 * (n, ...) with n = size (or fewer at the end without drop_remainder). Every
 * feature must keep one shape across elements (unbatch a ragged tokenize
 * first). A pass shorter than one window yields nothing, as tf.data does,
 * with a warning at its end. Buffer: a ring of (size - 1) * stride + 1
 * elements (the span), counted in the stage's bytes and the RAM budget.
 * State: window index, input position, end flag, and the ring's elements the
 * next window needs.
 *
 * lm_pairs: feature (T + 1, ...) -> input = w[:-1] and target = w[1:] (the TF
 * text-generation tutorial's split_input_target), views of the window.
 * Threads: one thread drives a stage (data_internal.h). */
#include "data/data_internal.h"

#include <stdio.h>
#include <string.h>

typedef struct winst {
    dstage    s;
    int64_t   size, shift, stride, span;
    int       drop;
    int64_t   k;        /* windows yielded this pass */
    int64_t   in_pos;   /* input elements consumed this pass */
    int       eof;      /* the input's pass has ended */
    size_t    item[LOOM_MAX_FEATURES]; /* bytes of one element's feature */
    elem_pool ring;     /* element i in slot i % span */
    bool      warned;
} winst;

static int64_t elem_bytes(const dstage *in)
{
    int64_t b = 0;
    for (int f = 0; f < in->spec.n; f++) b += loom_shape_numel(&in->maxshape[f]) * (int64_t)loom_dtype_size(in->spec.dtype[f]);
    return b;
}

int64_t window_max_bytes_(const dstage *in, const loom_transform_spec *t)
{
    int64_t stride = t->stride > 0 ? t->stride : 1;
    return ((t->batch_size - 1) * stride + 1 + t->batch_size) * elem_bytes(in);
}

static int win_end(winst *s)
{
    if (!s->k && s->in_pos > 0 && s->drop && !s->warned) {
        s->warned = true;
        loom_warn("%s: window: the pass had %lld elements, fewer than one window spans (size %lld, stride %lld: %lld "
                  "elements), so it yields no windows (as tf.data's window with drop_remainder does)", s->s.where,
                  (long long)s->in_pos, (long long)s->size, (long long)s->stride, (long long)s->span);
    }
    return LOOM_EEOF;
}

static int win_next(dstage *st, loom_elem **out, loom_err *err)
{
    winst *s = (winst *)st;
    int64_t start = s->k * s->shift;
    while (!s->eof && s->in_pos < start + s->span) {
        loom_elem *e;
        int rc = dstage_next_(st->in, &e, err);
        if (rc == LOOM_EEOF) {
            s->eof = 1;
            break;
        }
        if (rc) return rc;
        if (s->in_pos >= start && (rc = elem_pool_put_(&s->ring, s->in_pos % s->span, e, err)))
            return dstage_err_(st, err, rc, "window: element %lld: %s", (long long)s->in_pos, err->msg);
        s->in_pos++;
    }
    int64_t end = s->in_pos < start + s->span ? s->in_pos : start + s->span, avail = end - start;
    if (avail <= 0) return win_end(s);
    int64_t n = (avail - 1) / s->stride + 1;
    if (n > s->size) n = s->size;
    if (n < s->size && s->drop) return win_end(s);
    loom_elem *o = &st->out, v;
    for (int64_t j = 0; j < n; j++) {
        elem_pool_view_(&s->ring, (start + j * s->stride) % s->span, &v);
        for (int f = 0; f < o->n; f++) memcpy((uint8_t *)o->t[f].data + (size_t)j * s->item[f], v.t[f].data, s->item[f]);
    }
    for (int f = 0; f < o->n; f++) o->t[f].shape.dim[0] = n;
    s->k++;
    *out = o;
    return LOOM_OK;
}

static int win_rewind(dstage *st, int64_t epoch, loom_err *err)
{
    winst *s = (winst *)st;
    s->k = s->in_pos = s->eof = 0;
    s->warned = false;
    return st->in->ops->rewind(st->in, epoch, err);
}

/* The buffered elements the next window needs: [max(start, in_pos - span), in_pos). */
static void win_held(const winst *s, int64_t *from, int64_t *to)
{
    int64_t start = s->k * s->shift;
    *to = s->in_pos;
    *from = start > s->in_pos - s->span ? start : s->in_pos - s->span;
    if (*from > *to) *from = *to;
}

static void win_save(dstage *st, loom_buf *b)
{
    winst *s = (winst *)st;
    int64_t from, to;
    win_held(s, &from, &to);
    loom_buf_put_i64(b, s->k);
    loom_buf_put_i64(b, s->in_pos);
    loom_buf_put_u32(b, (uint32_t)s->eof);
    loom_buf_put_i64(b, to - from);
    for (int64_t i = from; i < to; i++) elem_pool_save_(&s->ring, i % s->span, b);
}

static int win_restore(dstage *st, loom_buf *b, loom_err *err)
{
    winst *s = (winst *)st;
    s->k = loom_buf_get_i64(b);
    s->in_pos = loom_buf_get_i64(b);
    s->eof = (int)loom_buf_get_u32(b);
    int64_t held = loom_buf_get_i64(b), from, to;
    if (b->failed || s->k < 0 || s->in_pos < 0 || held < 0 || held > s->span)
        return loom_err_set(err, LOOM_ECHECKPOINT, st->where, "iterator state is corrupt (%s)", st->name);
    win_held(s, &from, &to);
    if (to - from != held)
        return loom_err_set(err, LOOM_ECHECKPOINT, st->where, "iterator state is corrupt (%s: %lld elements held, "
                            "%lld expected)", st->name, (long long)held, (long long)(to - from));
    for (int64_t i = from; i < to; i++) {
        int rc = elem_pool_load_(&s->ring, i % s->span, b, err);
        if (rc) return rc;
    }
    return LOOM_OK;
}

static void win_close(dstage *st)
{
    winst *s = (winst *)st;
    for (int f = 0; f < st->out.n; f++) loom_tensor_fini(&st->out.t[f]);
    elem_pool_fini_(&s->ring);
    loom_free(s);
}

static const dstage_ops win_ops = {
    .next = win_next, .rewind = win_rewind, .save = win_save, .restore = win_restore, .close = win_close,
};

int window_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err)
{
    winst *s = loom_calloc(1, sizeof *s);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a window stage");
    dstage *st = &s->s;
    dstage_init_(st, &win_ops, in, id, &t->loc);
    s->size = t->batch_size;
    s->shift = t->shift > 0 ? t->shift : t->batch_size;
    s->stride = t->stride > 0 ? t->stride : 1;
    s->drop = t->drop_remainder;
    snprintf(st->name, sizeof st->name, "window");
    snprintf(st->desc, sizeof st->desc, "window(%lld,%lld,%lld,%d)", (long long)s->size, (long long)s->shift,
             (long long)s->stride, s->drop);
    int rc = LOOM_OK;
    char a[128];
    if (s->size < 1 || (s->size - 1) > (INT32_MAX - 1) / s->stride) {
        rc = dstage_err_(st, err, LOOM_ECONFIG, "window: size %lld with stride %lld is out of range", (long long)s->size,
                         (long long)s->stride);
        goto fail;
    }
    s->span = (s->size - 1) * s->stride + 1;
    for (int f = 0; f < st->spec.n; f++) {
        loom_shape *sh = &st->spec.shape[f], *mx = &st->maxshape[f];
        for (int d = 0; d < sh->rank; d++)
            if (sh->dim[d] < 0) {
                rc = dstage_err_(st, err, LOOM_ESHAPE, "window: feature \"%s\" has shape %s, which varies per element; "
                                 "a window stacks elements into one tensor", st->spec.name[f], loom_shape_str(sh, a, sizeof a));
                loom_err_hint(err, "unbatch a ragged tokenize into a stream of ids first, or give tokenize an "
                                   "output_sequence_length");
                goto fail;
            }
        if (sh->rank >= LOOM_MAX_RANK) {
            rc = dstage_err_(st, err, LOOM_ESHAPE, "window: feature \"%s\" already has rank %d", st->spec.name[f], sh->rank);
            goto fail;
        }
        s->item[f] = (size_t)loom_shape_numel(sh) * loom_dtype_size(st->spec.dtype[f]);
        memmove(sh->dim + 1, sh->dim, (size_t)sh->rank * sizeof sh->dim[0]);
        memmove(mx->dim + 1, mx->dim, (size_t)mx->rank * sizeof mx->dim[0]);
        sh->rank++;
        mx->rank++;
        sh->dim[0] = s->drop ? s->size : -1;
        mx->dim[0] = s->size;
        st->mut[f] = 1;
        if ((rc = loom_tensor_init(&st->out.t[f], st->spec.dtype[f], mx, err))) goto fail;
    }
    st->out.n = st->spec.n;
    if ((rc = elem_pool_init_(&s->ring, in, s->span, err))) goto fail;
    elem_pool_own_(&s->ring, st);
    __atomic_fetch_add(&st->st_bytes, s->size * elem_bytes(in), __ATOMIC_RELAXED); /* the window's tensors */
    int64_t c = in->card;
    st->card = c == -1 ? -1 : c < 0 ? -2 : s->drop ? (c >= s->span ? (c - s->span) / s->shift + 1 : 0)
                                                   : (c + s->shift - 1) / s->shift;
    *out = st;
    return LOOM_OK;
fail:
    win_close(st);
    return rc;
}

/* ---- lm_pairs -------------------------------------------------------------- */

typedef struct lmst {
    dstage s;
    int    f;                      /* the split feature in the input */
    int    map[LOOM_MAX_FEATURES]; /* output feature -> input feature (-1 input, -2 target) */
    size_t row;                    /* bytes of one step of the split feature */
    bool   last;                   /* target = w[-1] */
} lmst;

static int lm_next(dstage *st, loom_elem **out, loom_err *err)
{
    lmst *s = (lmst *)st;
    loom_elem *e;
    int rc = dstage_next_(st->in, &e, err);
    if (rc) return rc;
    loom_elem *o = &st->out;
    const loom_tensor *w = &e->t[s->f];
    int64_t T = w->shape.dim[0] > 0 ? w->shape.dim[0] - 1 : 0;
    for (int k = 0; k < o->n; k++) {
        if (s->map[k] >= 0) {
            o->t[k] = e->t[s->map[k]];
            st->mut[k] = st->in->mut[s->map[k]];
            continue;
        }
        o->t[k] = *w;
        o->t[k].owns = 0;
        o->t[k].shape.dim[0] = T;
        if (s->map[k] == -2 && s->last) { /* the step after the input */
            o->t[k].shape.rank--;
            memmove(o->t[k].shape.dim, o->t[k].shape.dim + 1, (size_t)o->t[k].shape.rank * sizeof o->t[k].shape.dim[0]);
            o->t[k].data = (uint8_t *)w->data + (size_t)T * s->row;
        } else if (s->map[k] == -2 && T > 0) {
            o->t[k].data = (uint8_t *)w->data + s->row;
        }
        st->mut[k] = 0; /* input and target share bytes */
    }
    *out = o;
    return LOOM_OK;
}

static const dstage_ops lm_ops = {
    .next = lm_next, .rewind = dstage_pass_rewind_, .save = dstage_no_save_, .restore = dstage_no_restore_,
    .close = dstage_free_,
};

int lm_pairs_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err)
{
    lmst *s = loom_calloc(1, sizeof *s);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate an lm_pairs stage");
    dstage *st = &s->s;
    dstage_init_(st, &lm_ops, in, id, &t->loc);
    snprintf(st->name, sizeof st->name, "lm_pairs");
    snprintf(st->desc, sizeof st->desc, "lm_pairs(%.40s,%.40s,%.40s,%d)", t->feature, t->input_name, t->target_name,
             (int)t->target_last);
    int rc = LOOM_OK;
    char a[128];
    s->f = loom_elem_spec_find(&in->spec, t->feature);
    if (s->f < 0) {
        rc = dstage_err_(st, err, LOOM_ECONFIG, "lm_pairs: no feature \"%s\" reaches it", t->feature);
        goto fail;
    }
    const loom_shape *sh = &in->spec.shape[s->f], *mx = &in->maxshape[s->f];
    if (sh->rank < 1 || in->batch_dims || mx->dim[0] < 2) {
        rc = dstage_err_(st, err, LOOM_ESHAPE, "lm_pairs: \"%s\" must be one sequence of at least 2 steps (T + 1, ...), "
                         "unbatched; it is %s%s", t->feature, loom_shape_str(sh, a, sizeof a), in->batch_dims ? " (batched)" : "");
        loom_err_hint(err, "put lm_pairs after window (size = T + 1) and before batch");
        goto fail;
    }
    if (in->spec.n + 1 > LOOM_MAX_FEATURES) {
        rc = dstage_err_(st, err, LOOM_ECONFIG, "lm_pairs: no room for one more feature (at most %d)", LOOM_MAX_FEATURES);
        goto fail;
    }
    for (int g = 0; g < in->spec.n; g++)
        if (g != s->f && (!strcmp(in->spec.name[g], t->input_name) || !strcmp(in->spec.name[g], t->target_name))) {
            rc = dstage_err_(st, err, LOOM_ECONFIG, "lm_pairs: a feature \"%s\" exists already; choose other names with "
                             "input = ...; target = ...;", in->spec.name[g]);
            goto fail;
        }
    if (!strcmp(t->input_name, t->target_name)) {
        rc = dstage_err_(st, err, LOOM_ECONFIG, "lm_pairs: input and target are both \"%s\"", t->input_name);
        goto fail;
    }
    s->last = t->target_last;
    if (s->last && sh->dim[0] < 0) {
        rc = dstage_err_(st, err, LOOM_ESHAPE, "lm_pairs: target_last needs windows of one length (%s is %s): give the "
                         "window drop_remainder = true", t->feature, loom_shape_str(sh, a, sizeof a));
        goto fail;
    }
    s->row = (size_t)loom_dtype_size(in->spec.dtype[s->f]);
    for (int d = 1; d < mx->rank; d++) s->row *= (size_t)mx->dim[d];
    int k = 0;
    loom_elem_spec *os = &st->spec;
    loom_shape *omx = st->maxshape;
    for (int g = 0; g < in->spec.n; g++) {
        if (g != s->f) {
            snprintf(os->name[k], LOOM_NAME_MAX, "%s", in->spec.name[g]);
            os->dtype[k] = in->spec.dtype[g];
            os->shape[k] = in->spec.shape[g];
            omx[k] = in->maxshape[g];
            s->map[k++] = g;
            continue;
        }
        for (int side = 0; side < 2; side++) {
            snprintf(os->name[k], LOOM_NAME_MAX, "%s", side ? t->target_name : t->input_name);
            os->dtype[k] = in->spec.dtype[g];
            os->shape[k] = *sh;
            omx[k] = *mx;
            if (sh->dim[0] > 0) os->shape[k].dim[0]--;
            omx[k].dim[0]--;
            if (side && t->target_last) { /* w[-1]: one step */
                loom_shape *a2 = &os->shape[k], *b2 = &omx[k];
                a2->rank--;
                b2->rank--;
                memmove(a2->dim, a2->dim + 1, (size_t)a2->rank * sizeof a2->dim[0]);
                memmove(b2->dim, b2->dim + 1, (size_t)b2->rank * sizeof b2->dim[0]);
            }
            s->map[k++] = side ? -2 : -1;
        }
    }
    os->n = st->out.n = k;
    st->card = in->card;
    *out = st;
    return LOOM_OK;
fail:
    loom_free(s);
    return rc;
}
