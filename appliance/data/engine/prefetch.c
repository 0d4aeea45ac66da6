/* prefetch.c - a background producer thread filling a bounded queue from a
 * fixed pool of preallocated element slots (caffe's free/full queues): no
 * allocation per element, one thread per stage, condition variables only.
 * The consumer's element stays valid until its next call; upstream errors
 * and EOF travel through the queue in order and then stick until rewind.
 * buffer -1 ("auto"): a knob of the pipeline's autotuner (autotune.c), from
 * 1 up to PREFETCH_AUTO_CAP slots or what the RAM budget leaves; with
 * autotuning off, tf.data's legacy prefetch autotuner (start at 1; upswing
 * until the buffer reaches the limit, then if it drains to 0 double it).
 * When the input can write into a slot (next_into: batch, map+batch) the
 * producer hands it the free slot, so a batch is assembled once, in place.
 * Save/restore: the producer is paused, so upstream state is exactly "after
 * the queued elements"; the queued elements are saved with it. */
#include "data/data_internal.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#define PREFETCH_AUTO_CAP 16

typedef struct pent {
    int64_t  slot;  /* -1 for an EOF/error marker */
    int      rc;
    loom_err err;
} pent;

typedef struct prefst {
    dstage    s;
    int       threaded, autotune;
    dknob    *knob;         /* autotune with the pipeline's tuner; NULL: legacy or fixed */
    int64_t   cap;          /* most elements queued */
    int64_t   limit;        /* current limit (autotune grows it up to cap) */
    int       upswing;
    elem_pool pool;         /* cap + 1 slots: the queue plus the consumer's */
    int64_t  *freel, nfree;
    pent     *q;            /* ring of cap + 2 entries */
    int64_t   qcap, qhead, qlen;
    int64_t   lent;         /* slot the consumer holds, -1 */
    int       done;         /* producer saw EOF/error; idle until rewind */
    int       sticky;       /* consumer got EOF/error; repeats it until rewind */
    pent      sticky_e;
    int       pause_req, paused, stop, started;
    int       lazy;         /* threaded, its thread started by the first pull (loom_data_ctx.lazy_threads) */
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t  cprod, ccons;
} prefst;

static void q_push(prefst *s, int64_t slot, int rc, const loom_err *err)
{
    LOOM_ASSERT(s->qlen < s->qcap);
    pent *e = &s->q[(s->qhead + s->qlen++) % s->qcap];
    e->slot = slot;
    e->rc = rc;
    if (rc != LOOM_OK && rc != LOOM_EEOF && err) e->err = *err;
    else loom_err_clear(&e->err);
}

/* The input's next element straight into slot: its next_into with the stats of dstage_next_. */
static int next_into_slot(prefst *s, int64_t slot, loom_err *err)
{
    dstage *in = s->s.in;
    loom_elem v;
    elem_pool_view_(&s->pool, slot, &v);
    for (int f = 0; f < v.n; f++) memset(&v.t[f].shape, 0, sizeof v.t[f].shape); /* set by next_into, unused dims 0 */
    int64_t t0 = dnow_ns_();
    int rc = in->ops->next_into(in, &v, err);
    __atomic_fetch_add(&in->st_busy_ns, dnow_ns_() - t0, __ATOMIC_RELAXED);
    if (rc) return rc;
    __atomic_fetch_add(&in->st_elements, 1, __ATOMIC_RELAXED);
    for (int f = 0; f < v.n; f++) {
        if (s->pool.varshape) s->pool.shape[slot * s->pool.nf + f] = v.t[f].shape;
        else LOOM_ASSERT(loom_shape_eq(&v.t[f].shape, &s->pool.shape[f]));
    }
    return LOOM_OK;
}

/* One element from the input into a free slot; *slot = -1 unless LOOM_OK. */
static int produce(prefst *s, int64_t *slot, loom_err *err)
{
    pthread_mutex_lock(&s->mu);
    LOOM_ASSERT(s->nfree > 0);
    *slot = s->freel[--s->nfree];
    pthread_mutex_unlock(&s->mu);
    int rc;
    if (s->s.in->ops->next_into) {
        rc = next_into_slot(s, *slot, err);
    } else {
        loom_elem *e;
        rc = dstage_next_(s->s.in, &e, err);
        if (rc == LOOM_OK) rc = elem_pool_put_(&s->pool, *slot, e, err);
    }
    if (rc != LOOM_OK) {
        pthread_mutex_lock(&s->mu);
        s->freel[s->nfree++] = *slot;
        pthread_mutex_unlock(&s->mu);
        *slot = -1;
    }
    return rc;
}

static int64_t limit_now(prefst *s) { return s->knob ? dknob_get_(s->knob) : s->limit; }

static void *producer(void *arg)
{
    prefst *s = arg;
    loom_err perr;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->stop && (s->pause_req || s->done || s->qlen >= limit_now(s))) {
            if (s->pause_req && !s->paused) {
                s->paused = 1;
                pthread_cond_broadcast(&s->ccons);
            }
            pthread_cond_wait(&s->cprod, &s->mu);
        }
        if (s->stop) break;
        pthread_mutex_unlock(&s->mu);
        loom_err_clear(&perr);
        int64_t slot;
        int rc = produce(s, &slot, &perr);
        pthread_mutex_lock(&s->mu);
        q_push(s, slot, rc, &perr);
        if (rc != LOOM_OK) s->done = 1;
        dstage_gauge_(&s->s.st_buffered, s->qlen);
        pthread_cond_broadcast(&s->ccons);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

static void pref_pause(dstage *st)
{
    prefst *s = (prefst *)st;
    if (!s->started) return;
    pthread_mutex_lock(&s->mu);
    s->pause_req = 1;
    pthread_cond_broadcast(&s->cprod);
    while (!s->paused) pthread_cond_wait(&s->ccons, &s->mu);
    pthread_mutex_unlock(&s->mu);
}

static void pref_resume(dstage *st)
{
    prefst *s = (prefst *)st;
    if (!s->started) return;
    pthread_mutex_lock(&s->mu);
    s->pause_req = 0;
    s->paused = 0;
    pthread_cond_broadcast(&s->cprod);
    pthread_mutex_unlock(&s->mu);
}

/* tf.data's PrefetchAutotuner::RecordConsumption; called with the lock held. */
static void autotune(prefst *s)
{
    if (!s->autotune || s->knob) return;
    if (s->upswing) {
        if (s->qlen >= s->limit) s->upswing = 0;
    } else if (s->qlen == 0 && s->limit < s->cap) {
        s->limit = s->limit * 2 < s->cap ? s->limit * 2 : s->cap;
        s->upswing = 1;
        dstage_gauge_(&s->s.st_capacity, s->limit);
        pthread_cond_broadcast(&s->cprod);
    }
}

static int deliver(prefst *s, const pent *e, loom_elem **out, loom_err *err)
{
    if (e->slot >= 0) {
        s->lent = e->slot;
        elem_pool_view_(&s->pool, e->slot, &s->s.out);
        *out = &s->s.out;
        return LOOM_OK;
    }
    s->sticky = 1;
    s->sticky_e = *e;
    if (e->rc != LOOM_EEOF && err) *err = e->err;
    return e->rc;
}

static int pref_next(dstage *st, loom_elem **out, loom_err *err)
{
    prefst *s = (prefst *)st;
    pent e;
    if (!s->threaded) {
        if (s->lent >= 0) {
            s->freel[s->nfree++] = s->lent;
            s->lent = -1;
        }
        if (s->sticky) return deliver(s, &s->sticky_e, out, err);
        if (s->qlen > 0) { /* left by a restore */
            e = s->q[s->qhead];
            s->qhead = (s->qhead + 1) % s->qcap;
            s->qlen--;
            return deliver(s, &e, out, err);
        }
        int rc = dstage_next_(st->in, out, err);
        if (rc == LOOM_OK) memcpy(st->mut, st->in->mut, sizeof st->mut);
        return rc;
    }
    if (s->lazy && !s->started) { /* the first pull starts the producer */
        if (pthread_create(&s->th, NULL, producer, s) != 0)
            return dstage_err_(st, err, LOOM_ENOMEM, "prefetch: cannot start its thread");
        s->started = 1, s->lazy = 0;
    }
    pthread_mutex_lock(&s->mu);
    if (s->lent >= 0) {
        s->freel[s->nfree++] = s->lent;
        s->lent = -1;
    }
    if (s->sticky) {
        pthread_mutex_unlock(&s->mu);
        return deliver(s, &s->sticky_e, out, err);
    }
    autotune(s);
    if (s->qlen == 0) {
        int64_t t0 = dnow_ns_();
        while (s->qlen == 0) pthread_cond_wait(&s->ccons, &s->mu);
        __atomic_fetch_add(&st->st_wait_ns, dnow_ns_() - t0, __ATOMIC_RELAXED);
    }
    e = s->q[s->qhead];
    s->qhead = (s->qhead + 1) % s->qcap;
    s->qlen--;
    dstage_gauge_(&st->st_buffered, s->qlen);
    if (s->knob) dstage_gauge_(&st->st_capacity, dknob_get_(s->knob));
    pthread_cond_broadcast(&s->cprod);
    pthread_mutex_unlock(&s->mu);
    for (int f = 0; f < st->spec.n; f++) st->mut[f] = 1;
    return deliver(s, &e, out, err);
}

/* Empties the queue and the consumer's slot; the producer must be paused. */
static void pref_clear(prefst *s)
{
    for (int64_t i = 0; i < s->qlen; i++) {
        pent *e = &s->q[(s->qhead + i) % s->qcap];
        if (e->slot >= 0) s->freel[s->nfree++] = e->slot;
    }
    if (s->lent >= 0) s->freel[s->nfree++] = s->lent;
    s->lent = -1;
    s->qhead = s->qlen = 0;
    s->done = s->sticky = 0;
    dstage_gauge_(&s->s.st_buffered, 0);
}

static int pref_rewind(dstage *st, int64_t epoch, loom_err *err)
{
    prefst *s = (prefst *)st;
    pref_pause(st);
    pref_clear(s);
    int rc = st->in->ops->rewind(st->in, epoch, err);
    pref_resume(st);
    return rc;
}

static void put_marker(loom_buf *b, const pent *e)
{
    loom_buf_put_u32(b, (uint32_t)e->rc);
    loom_buf_put_str(b, e->err.where);
    loom_buf_put_str(b, e->err.msg);
    loom_buf_put_str(b, e->err.hint);
}

static void get_marker(loom_buf *b, pent *e)
{
    e->slot = -1;
    e->rc = (int)loom_buf_get_u32(b);
    e->err.code = e->rc;
    loom_buf_get_str(b, e->err.where, sizeof e->err.where);
    loom_buf_get_str(b, e->err.msg, sizeof e->err.msg);
    loom_buf_get_str(b, e->err.hint, sizeof e->err.hint);
}

/* The producer is paused (by loom_iter_save) or absent. */
static void pref_save(dstage *st, loom_buf *b)
{
    prefst *s = (prefst *)st;
    loom_buf_put_i64(b, limit_now(s));
    loom_buf_put_u32(b, (uint32_t)s->upswing);
    loom_buf_put_u32(b, (uint32_t)s->done);
    loom_buf_put_u32(b, (uint32_t)s->sticky);
    if (s->sticky) put_marker(b, &s->sticky_e);
    loom_buf_put_i64(b, s->qlen);
    for (int64_t i = 0; i < s->qlen; i++) {
        const pent *e = &s->q[(s->qhead + i) % s->qcap];
        loom_buf_put_u32(b, e->slot >= 0 ? 0 : 1);
        if (e->slot >= 0) elem_pool_save_(&s->pool, e->slot, b);
        else put_marker(b, e);
    }
}

static int pref_restore(dstage *st, loom_buf *b, loom_err *err)
{
    prefst *s = (prefst *)st;
    pref_clear(s);
    int64_t limit = loom_buf_get_i64(b);
    s->upswing = (int)loom_buf_get_u32(b);
    s->done = (int)loom_buf_get_u32(b);
    s->sticky = (int)loom_buf_get_u32(b);
    if (s->sticky) get_marker(b, &s->sticky_e);
    int64_t n = loom_buf_get_i64(b);
    if (b->failed || limit < 1 || limit > s->cap || n < 0 || n > s->cap + 1)
        return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "iterator state is corrupt (prefetch queue)");
    s->limit = limit;
    if (s->knob) __atomic_store_n(&s->knob->value, limit, __ATOMIC_RELAXED);
    dstage_gauge_(&st->st_capacity, limit);
    for (int64_t i = 0; i < n; i++) {
        uint32_t kind = loom_buf_get_u32(b);
        pent e = {0};
        if (kind == 0) {
            if (s->nfree == 0) return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "iterator state is corrupt (prefetch queue)");
            e.slot = s->freel[--s->nfree];
            int rc = elem_pool_load_(&s->pool, e.slot, b, err);
            if (rc) return rc;
        } else {
            get_marker(b, &e);
        }
        if (b->failed) return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "iterator state is truncated (prefetch queue)");
        s->q[s->qlen++] = e;
    }
    dstage_gauge_(&st->st_buffered, s->qlen);
    return LOOM_OK;
}

/* Ends the producer thread, if it runs; what it queued stays queued. */
static void stop_producer(prefst *s)
{
    if (!s->started) return;
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_broadcast(&s->cprod);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->th, NULL);
    s->started = 0;
}

static void pref_close(dstage *st)
{
    prefst *s = (prefst *)st;
    stop_producer(s);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cprod);
    pthread_cond_destroy(&s->ccons);
    elem_pool_fini_(&s->pool);
    loom_free(s->freel);
    loom_free(s->q);
    loom_free(s);
}

/* The tuner moved the knob: wake the producer (a larger limit frees it). */
static void pref_changed(dstage *st)
{
    prefst *s = (prefst *)st;
    pthread_mutex_lock(&s->mu);
    pthread_cond_broadcast(&s->cprod);
    pthread_mutex_unlock(&s->mu);
}

static void pref_tune(dstage *st, dtuner *t)
{
    prefst *s = (prefst *)st;
    if (!s->autotune || !s->threaded) return;
    pthread_mutex_lock(&s->mu);
    s->knob = dtuner_knob_(t, st, "buffer", s->limit, 1, s->cap, 0);
    if (s->knob) s->knob->changed = pref_changed;
    pthread_mutex_unlock(&s->mu);
}

static const dstage_ops pref_ops = {
    .next = pref_next, .rewind = pref_rewind, .save = pref_save, .restore = pref_restore,
    .pause = pref_pause, .resume = pref_resume, .close = pref_close, .tune = pref_tune,
};

bool prefetch_inline_(dstage *st)
{
    if (st->ops != &pref_ops) return false;
    prefst *s = (prefst *)st;
    if (!s->threaded) return false;
    stop_producer(s); /* what it queued is delivered first, in order */
    s->threaded = 0;
    if (s->knob) __atomic_store_n(&s->knob->inert, 1, __ATOMIC_RELAXED); /* no buffer left to tune */
    snprintf(st->name, sizeof st->name, "prefetch(inline)");
    return true;
}

int prefetch_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, int threaded, bool lazy,
                   int64_t ram_left, loom_err *err)
{
    prefst *s = loom_calloc(1, sizeof *s);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a prefetch stage");
    dstage *st = &s->s;
    dstage_init_(st, &pref_ops, in, id, &t->loc);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cprod, NULL);
    pthread_cond_init(&s->ccons, NULL);
    s->lent = -1;
    snprintf(st->desc, sizeof st->desc, "prefetch(%lld)", (long long)t->buffer);
    int rc = LOOM_OK;
    if (t->buffer < -1) {
        rc = dstage_err_(st, err, LOOM_ECONFIG, "prefetch: buffer must be >= -1, got %lld", (long long)t->buffer);
        goto fail;
    }
    s->autotune = t->buffer == -1;
    s->cap = s->autotune ? PREFETCH_AUTO_CAP : t->buffer;
    int64_t slot = 0;
    for (int f = 0; f < st->spec.n; f++) slot += loom_shape_numel(&st->maxshape[f]) * (int64_t)loom_dtype_size(st->spec.dtype[f]);
    if (threaded && s->cap > 0 && slot > 0 && (s->cap + 1) * slot > ram_left) { /* the queue plus the consumer's slot */
        if (!s->autotune || 2 * slot > ram_left) {
            rc = dstage_err_(st, err, LOOM_ECONFIG, "prefetch: %lld elements of %lld bytes need %lld bytes, more than the "
                             "%lld bytes left of the RAM budget", (long long)(s->cap + 1), (long long)slot,
                             (long long)((s->cap + 1) * slot), (long long)ram_left);
            loom_err_hint(err, "lower `buffer`, or raise data.options.autotune.ram_budget");
            goto fail;
        }
        s->cap = ram_left / slot - 1;
    }
    s->limit = s->autotune ? 1 : s->cap;
    s->upswing = 1;
    s->threaded = threaded && s->cap > 0;
    if (s->cap < 1) s->cap = 1; /* buffer 0: a pass-through that still can hold restored entries */
    snprintf(st->name, sizeof st->name, "%s", s->threaded ? (s->autotune ? "prefetch(auto)" : "prefetch") : "prefetch(inline)");
    rc = elem_pool_init_(&s->pool, st, s->cap + 1, err);
    if (rc) goto fail;
    s->qcap = s->cap + 2;
    s->freel = loom_alloc((size_t)(s->cap + 1) * sizeof *s->freel);
    s->q = loom_calloc((size_t)s->qcap, sizeof *s->q);
    if (!s->freel || !s->q) {
        rc = loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the prefetch queue");
        goto fail;
    }
    for (int64_t i = s->cap; i >= 0; i--) s->freel[s->nfree++] = i;
    dstage_gauge_(&st->st_capacity, s->threaded ? s->limit : 0);
    if (s->threaded && lazy) {
        s->lazy = 1;
    } else if (s->threaded) {
        if (pthread_create(&s->th, NULL, producer, s) != 0) {
            rc = dstage_err_(st, err, LOOM_ENOMEM, "prefetch: cannot start its thread");
            goto fail;
        }
        s->started = 1;
    }
    *out = st;
    return LOOM_OK;
fail:
    pref_close(st);
    return rc;
}
