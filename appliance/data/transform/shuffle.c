/* shuffle.c - the shuffle stage: tf.data's buffer algorithm, or, over a
 * random-access input of known length, a permutation drawn by index (which a
 * batch's gather also draws from); with exact save and restore. */
#include "data/data_internal.h"
#include "transform_internal.h"

#include <stdlib.h>
#include <string.h>

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
