/* parmap.c - parallel map (tf.data map with num_parallel_calls): the
 * pipeline's one shared worker pool (dpool) and a map stage that keeps a
 * bounded window of in-flight elements in preallocated slots. A stage runs
 * one map, or several consecutive maps fused (map_fusion) as one call.
 * Threads: the consumer (train thread, or a prefetch producer downstream)
 * pulls the input, copies each element into a free slot and submits the
 * calls of up to PAR_GROUP consecutive slots as one task (the window is
 * parallel x group slots, refilled a group at a time), so one wake-up of a
 * worker serves a group; pool workers run map_apply_ on each slot and mark
 * it done under the stage's mutex. A consumer that must wait runs queued
 * tasks itself (no hand-off latency on cheap maps, no spinning). Results
 * leave in input order when deterministic, else in completion order;
 * EOF/errors from upstream travel as markers in order. parallel = "auto":
 * the parallelism is a knob the autotuner (autotune.c) moves between 1 and
 * the pool's size.
 * Fused with a batch (map_and_batch_fusion), a slot holds a whole batch: the
 * consumer pulls its elements, and one call maps them straight into the
 * slot's batch buffer (the last map of each feature writes the element's
 * row), so calls run in parallel across batches, one hand-off per batch.
 * The RNG index of every element is fixed at dispatch, so the output is the
 * same for any parallelism. Save/restore: pause waits for the calls in
 * flight, so upstream is exactly "after the window", and the finished but
 * unconsumed results are saved with the stage (as prefetch does). */
#include "data/data_internal.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

/* ---- the shared worker pool ------------------------------------------------ */

struct dpool {
    int             n;
    pthread_t      *th;
    pthread_mutex_t mu;
    pthread_cond_t  cv;
    dtask          *head, *tail;
    int             stop;
    int             idle;   /* workers asleep: submit signals only then */
};

static void *dpool_main(void *arg)
{
    dpool *p = arg;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->head && !p->stop) {
            p->idle++;
            pthread_cond_wait(&p->cv, &p->mu);
            p->idle--;
        }
        if (!p->head) break;
        dtask *t = p->head;
        p->head = t->next;
        if (!p->head) p->tail = NULL;
        pthread_mutex_unlock(&p->mu);
        t->fn(t->arg);
        pthread_mutex_lock(&p->mu);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

int dpool_new_(dpool **out, int threads, loom_err *err)
{
    *out = NULL;
    dpool *p = loom_calloc(1, sizeof *p);
    if (!p) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the data worker pool");
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    if (threads > 0) {
        p->th = loom_calloc((size_t)threads, sizeof *p->th);
        if (!p->th) {
            dpool_free_(p);
            return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the data worker pool");
        }
    }
    for (int i = 0; i < threads; i++) {
        if (pthread_create(&p->th[i], NULL, dpool_main, p) != 0) {
            dpool_free_(p);
            return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot start data worker thread %d of %d", i + 1, threads);
        }
        p->n++;
    }
    *out = p;
    return LOOM_OK;
}

void dpool_free_(dpool *p)
{
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n; i++) pthread_join(p->th[i], NULL);
    LOOM_ASSERT(!p->head);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    loom_free(p->th);
    loom_free(p);
}

int dpool_size_(const dpool *p) { return p ? p->n : 0; }

static void dpool_submit(dpool *p, dtask *t)
{
    if (p->n == 0) {
        t->fn(t->arg);
        return;
    }
    t->next = NULL;
    pthread_mutex_lock(&p->mu);
    if (p->tail) p->tail->next = t;
    else p->head = t;
    p->tail = t;
    if (p->idle) pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

int dpool_help_(dpool *p) { return dpool_help_own_(p, NULL); }

int dpool_help_own_(dpool *p, const void *owner)
{
    if (!p || p->n == 0) return 0;
    pthread_mutex_lock(&p->mu);
    dtask *t = p->head, *prev = NULL;
    while (t && owner && t->owner != owner) prev = t, t = t->next;
    if (t) {
        if (prev) prev->next = t->next;
        else p->head = t->next;
        if (p->tail == t) p->tail = prev;
    }
    pthread_mutex_unlock(&p->mu);
    if (t) t->fn(t->arg);
    return t != NULL;
}

void dpool_submit_(dpool *p, dtask *t) { dpool_submit(p, t); }

/* ---- the stage ---------------------------------------------------------------- */

/* Calls per task for element maps: one hand-off to a worker (a wake-up, the
 * pool's lock) costs about as much as a cheap call, so calls go in groups. */
#define PAR_GROUP 8

enum { SL_FREE, SL_QUEUED, SL_DONE, SL_LENT };

typedef struct parst parst;

typedef struct pslot {
    parst    *owner;
    int       idx;
    int       state;  /* SL_*; under owner->mu */
    int       used;   /* not free: the consumer's own view of state, read without the lock */
    int       marker; /* upstream EOF/error: no element, blocks further pulls until consumed */
    int64_t   seq;    /* input order */
    int64_t   tick;   /* completion order */
    int64_t   epoch, pos;
    int       rc;
    loom_err  err;
    loom_elem res;    /* the result: views of the slot's input copy and obuf (or of bout) */
    struct pslot *gnext; /* the next slot of the same task (group), NULL */
    uint8_t **obuf, **flags; /* per map of the chain */
    int64_t   n;      /* batch mode: elements pulled into this slot */
    loom_tensor bout[LOOM_MAX_FEATURES]; /* batch mode: the batch buffer, the batch's max shapes */
    dtask     task;
} pslot;

struct parst {
    dstage    s;
    int       nmap;
    dstage   *map[LOOM_MAX_TRANSFORMS]; /* sequential map stages: settings, specs and map_apply_; map[k]'s input is map[k-1] */
    uint8_t   fuse[LOOM_MAX_TRANSFORMS]; /* maps k.. that run as one pass (map_pad_crop_len_), 0: none */
    dpool    *pool;
    dstage   *batch;      /* batch mode: the batch stage (spec, card, its errors; never pulled); else NULL */
    int64_t   bsize;      /* batch mode: elements per batch (1 otherwise) */
    int       drop;       /* batch mode: drop_remainder */
    dknob    *knob;       /* "auto": the tuned window; NULL for a fixed one */
    int       det;
    int       autotune;   /* parallel = "auto" */
    int       pmax;       /* slots - 1: most elements in the window */
    int       group;      /* elements per task (1 in batch mode): cheap calls share one hand-off */
    int       p;          /* the window now (calls in flight plus finished results): parallelism x group */
    elem_pool in;         /* input copies, pmax + 1 slots */
    pslot    *sl;
    int64_t   epoch, pos; /* pos: RNG index of the next element pulled */
    int64_t   next_seq, emit_seq, ticks;
    int       occupied;   /* slots in the window: queued or done (not free, not lent) */
    int       inflight;   /* queued or running calls; under mu */
    int       waiting;    /* the consumer sleeps on cv: completions signal only then; under mu */
    int       blocked;    /* a marker is in the window: pull nothing more */
    int       lent;       /* slot the consumer holds, -1 */
    pthread_mutex_t mu;
    pthread_cond_t  cv;
};

/* The map chain on slot sl's element; every feature starts writable (the slot's own copy). */
static int apply_chain(parst *s, pslot *sl, loom_elem *e, loom_err *err)
{
    uint8_t mut[LOOM_MAX_FEATURES];
    memset(mut, 1, sizeof mut);
    for (int k = 0; k < s->nmap; k++) {
        int f = map_feature_(s->map[k]), m, rc;
        int fused = s->fuse[k]; /* pad + random_crop (+ flip) as one pass into the crop's buffer */
        if (fused) rc = map_pad_crop_(s->map + k, fused, e, sl->obuf[k + 1], sl->epoch, sl->pos, &m, err), k += fused - 1;
        else rc = map_apply_(s->map[k], e, mut[f], sl->obuf[k], sl->flags[k], sl->epoch, sl->pos, &m, err);
        if (rc) return rc;
        mut[f] = (uint8_t)m;
    }
    return LOOM_OK;
}

/* Batch mode: maps the slot's sl->n elements into its batch buffer, as
 * batch does (equal shapes, rows in order); the result views bout. */
static int apply_batch(parst *s, pslot *sl, loom_elem *res, loom_err *err)
{
    int nf = s->s.spec.n;
    loom_shape first[LOOM_MAX_FEATURES];
    size_t bytes[LOOM_MAX_FEATURES] = {0};
    int64_t pos = sl->pos;
    for (int64_t k = 0; k < sl->n; k++) {
        loom_elem e;
        elem_pool_view_(&s->in, sl->idx * s->bsize + k, &e);
        uint8_t mut[LOOM_MAX_FEATURES], *row[LOOM_MAX_FEATURES];
        memset(mut, 1, sizeof mut);
        for (int f = 0; f < nf; f++) row[f] = (uint8_t *)sl->bout[f].data + (size_t)k * bytes[f];
        int64_t count = map_count_(s->map[0], &e);
        for (int m = 0; m < s->nmap; m++) {
            int f = map_feature_(s->map[m]), last = 1, w, rc, fused = s->fuse[m];
            for (int j = m + (fused ? fused : 1); j < s->nmap; j++) last &= map_feature_(s->map[j]) != f;
            if (fused) { /* pad + random_crop (+ flip) as one pass, into the row when nothing maps the feature after */
                rc = map_pad_crop_(s->map + m, fused, &e, last ? row[f] : sl->obuf[m + 1], sl->epoch, pos, &w, err);
                m += fused - 1;
            } else {
                rc = map_apply_(s->map[m], &e, last ? 0 : mut[f], last ? row[f] : sl->obuf[m], sl->flags[m], sl->epoch,
                                pos, &w, err);
            }
            if (rc) return rc;
            mut[f] = (uint8_t)w;
        }
        pos += count;
        for (int f = 0; f < nf; f++) {
            if (k == 0) {
                first[f] = e.t[f].shape;
                bytes[f] = loom_tensor_nbytes(&e.t[f]);
            } else if (!loom_shape_eq(&first[f], &e.t[f].shape)) {
                char a[128], b[128];
                return dstage_err_(s->batch, err, LOOM_ESHAPE, "batch: feature \"%s\" has shape %s in element %lld of the "
                                   "batch but %s in its first element (a batch needs equal shapes)", s->s.spec.name[f],
                                   loom_shape_str(&e.t[f].shape, a, sizeof a), (long long)k,
                                   loom_shape_str(&first[f], b, sizeof b));
            }
            if (e.t[f].data != row[f]) memcpy(row[f], e.t[f].data, bytes[f]);
        }
    }
    res->n = nf;
    for (int f = 0; f < nf; f++) {
        loom_tensor *t = &res->t[f];
        *t = sl->bout[f];
        t->owns = 0;
        memset(&t->shape, 0, sizeof t->shape);
        t->shape.rank = first[f].rank + 1;
        t->shape.dim[0] = sl->n;
        for (int d = 0; d < first[f].rank; d++) t->shape.dim[d + 1] = first[f].dim[d];
    }
    return LOOM_OK;
}

static void run_call(void *arg)
{
    pslot *sl = arg;
    parst *s = sl->owner;
    int64_t t0 = dnow_ns_();
    loom_elem e;
    loom_err err;
    loom_err_clear(&err);
    int rc;
    if (s->batch) {
        rc = apply_batch(s, sl, &e, &err);
    } else {
        elem_pool_view_(&s->in, sl->idx, &e);
        rc = apply_chain(s, sl, &e, &err);
    }
    __atomic_fetch_add(&s->s.st_work_ns, dnow_ns_() - t0, __ATOMIC_RELAXED);
    pthread_mutex_lock(&s->mu);
    sl->res = e;
    sl->rc = rc;
    if (rc) sl->err = err;
    sl->tick = s->ticks++;
    sl->state = SL_DONE;
    s->inflight--;
    if (s->waiting) pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* The task: the calls of a group of slots, in input order. */
static void run_group(void *arg)
{
    for (pslot *sl = arg; sl;) {
        pslot *next = sl->gnext; /* read first: a finished slot may be reused at once */
        run_call(sl);
        sl = next;
    }
}

/* Waits until no call is in flight, running queued ones meanwhile. */
static void quiesce(parst *s)
{
    pthread_mutex_lock(&s->mu);
    while (s->inflight > 0) {
        pthread_mutex_unlock(&s->mu);
        int ran = dpool_help_own_(s->pool, s);
        pthread_mutex_lock(&s->mu);
        if (ran) continue;
        s->waiting = 1;
        if (s->inflight > 0) pthread_cond_wait(&s->cv, &s->mu);
        s->waiting = 0;
    }
    pthread_mutex_unlock(&s->mu);
}

static int free_slot(const parst *s)
{
    for (int i = 0; i <= s->pmax; i++)
        if (!s->sl[i].used) return i;
    return -1;
}

/* Pulls slot i's input: one element, or in batch mode up to a batch of them
 * (a short last batch unless drop_remainder). Sets sl->n, advances the RNG
 * position; LOOM_EEOF or an error when there is nothing to map. */
static int pull(parst *s, int i, loom_err *err)
{
    pslot *sl = &s->sl[i];
    sl->epoch = s->epoch;
    sl->pos = s->pos;
    int rc = LOOM_OK;
    int64_t k;
    for (k = 0; k < s->bsize; k++) {
        loom_elem *e, v;
        rc = dstage_next_(s->s.in, &e, err);
        if (rc == LOOM_OK) rc = elem_pool_put_(&s->in, i * s->bsize + k, e, err);
        if (rc) break;
        elem_pool_view_(&s->in, i * s->bsize + k, &v);
        s->pos += map_count_(s->map[0], &v);
    }
    sl->n = k;
    if (rc == LOOM_EEOF && k > 0 && !(s->drop && k < s->bsize)) rc = LOOM_OK; /* a short last batch */
    return rc;
}

/* Pulls input and submits calls until the window is full or a marker is in it,
 * group calls per task. A window that is not empty is refilled only once a
 * whole group fits, so each hand-off to a worker carries a group of calls.
 * Runs on the consumer thread without the lock: only it changes FREE slots. */
static void fill(parst *s)
{
    dstage *st = &s->s;
    if (s->knob) {
        s->p = (int)dknob_get_(s->knob) * s->group;
        dstage_gauge_(&st->st_parallel, s->p / s->group);
        dstage_gauge_(&st->st_capacity, s->p);
    }
    pslot *head = NULL, *last = NULL;
    int ng = 0;
    while (!s->blocked && s->occupied < s->p && (s->occupied == 0 || s->p - s->occupied >= s->group || head)) {
        int i = free_slot(s);
        LOOM_ASSERT(i >= 0);
        pslot *sl = &s->sl[i];
        sl->used = 1;
        loom_err_clear(&sl->err);
        sl->rc = pull(s, i, &sl->err);
        sl->seq = s->next_seq++;
        sl->marker = sl->rc != LOOM_OK;
        s->occupied++;
        if (sl->rc != LOOM_OK) {
            if (sl->marker) s->blocked = 1;
            pthread_mutex_lock(&s->mu);
            sl->tick = s->ticks++;
            sl->state = SL_DONE;
            pthread_mutex_unlock(&s->mu);
            continue;
        }
        pthread_mutex_lock(&s->mu);
        sl->state = SL_QUEUED;
        s->inflight++;
        pthread_mutex_unlock(&s->mu);
        if (head && ng == s->group) {
            dpool_submit(s->pool, &head->task);
            head = NULL;
        }
        sl->gnext = NULL;
        if (head) {
            last->gnext = sl;
        } else {
            head = sl;
            ng = 0;
        }
        last = sl;
        ng++;
    }
    if (head) dpool_submit(s->pool, &head->task);
    dstage_gauge_(&st->st_buffered, s->occupied);
}

/* The slot to emit now, or -1; under the lock. */
static int ready(const parst *s)
{
    int best = -1;
    for (int i = 0; i <= s->pmax; i++) {
        const pslot *sl = &s->sl[i];
        if (sl->state != SL_DONE && sl->state != SL_QUEUED) continue;
        if (s->det) {
            if (sl->seq == s->emit_seq) return sl->state == SL_DONE ? i : -1;
        } else if (sl->state == SL_DONE && !sl->marker && (best < 0 || sl->tick < s->sl[best].tick)) {
            best = i;
        }
    }
    if (s->det || best >= 0) return best;
    /* a marker goes last: only once every element before it has left */
    for (int i = 0; i <= s->pmax; i++)
        if (s->sl[i].state == SL_DONE && s->sl[i].marker && s->occupied == 1) return i;
    return -1;
}

/* The next slot to emit, under the lock (returned held). While it waits the
 * consumer runs this stage's queued calls itself, any of them, not only the
 * one it waits for: the pool's workers take calls in order, so with fewer
 * workers than `parallel` (the consumer counts as one of the stage's threads)
 * the calls behind the awaited one would queue until a worker frees and the
 * stage would run at the pool's width. Running a later call first delays the
 * awaited result by at most one call; the output order is the slots'. It
 * sleeps only when nothing of its own is queued. */
static int await_ready(parst *s)
{
    pthread_mutex_lock(&s->mu);
    int i = ready(s);
    if (i >= 0) return i;
    int64_t t0 = dnow_ns_();
    while ((i = ready(s)) < 0) {
        pthread_mutex_unlock(&s->mu);
        int ran = dpool_help_own_(s->pool, s);
        pthread_mutex_lock(&s->mu);
        if (ran || (i = ready(s)) >= 0) continue;
        s->waiting = 1;
        pthread_cond_wait(&s->cv, &s->mu);
        s->waiting = 0;
    }
    __atomic_fetch_add(&s->s.st_wait_ns, dnow_ns_() - t0, __ATOMIC_RELAXED);
    return i;
}

static int par_next(dstage *st, loom_elem **out, loom_err *err)
{
    parst *s = (parst *)st;
    if (s->lent >= 0) {
        pthread_mutex_lock(&s->mu);
        s->sl[s->lent].state = SL_FREE;
        pthread_mutex_unlock(&s->mu);
        s->sl[s->lent].used = 0;
        s->lent = -1;
    }
    fill(s);
    int i = await_ready(s);
    pslot *sl = &s->sl[i];
    sl->state = sl->rc == LOOM_OK ? SL_LENT : SL_FREE;
    pthread_mutex_unlock(&s->mu);
    if (sl->rc != LOOM_OK) sl->used = 0;
    s->occupied--;
    if (s->det) s->emit_seq++;
    dstage_gauge_(&st->st_buffered, s->occupied);
    if (sl->rc != LOOM_OK) {
        if (sl->marker) s->blocked = 0; /* the next call pulls again, as the sequential map does */
        if (sl->rc != LOOM_EEOF && err) *err = sl->err;
        return sl->rc;
    }
    s->lent = i;
    st->out = sl->res;
    for (int f = 0; f < st->spec.n; f++) st->mut[f] = 1; /* our own copy */
    *out = &st->out;
    fill(s); /* keep p calls going while the consumer works on this one (the lent slot is the extra one) */
    return LOOM_OK;
}

/* Frees every slot; no call may be in flight. */
static void clear(parst *s)
{
    for (int i = 0; i <= s->pmax; i++) s->sl[i].state = SL_FREE, s->sl[i].used = 0;
    s->lent = -1;
    s->occupied = 0;
    s->blocked = 0;
    s->next_seq = s->emit_seq = 0;
    dstage_gauge_(&s->s.st_buffered, 0);
}

static void par_pause(dstage *st) { quiesce((parst *)st); }

static int par_rewind(dstage *st, int64_t epoch, loom_err *err)
{
    parst *s = (parst *)st;
    quiesce(s);
    clear(s);
    s->epoch = epoch;
    s->pos = 0;
    return st->in->ops->rewind(st->in, epoch, err);
}

/* Slots of the window in input order (done after quiesce). */
static int window(const parst *s, int *order)
{
    int n = 0;
    for (int i = 0; i <= s->pmax; i++)
        if (s->sl[i].state == SL_DONE) order[n++] = i;
    for (int a = 1; a < n; a++)
        for (int b = a; b > 0 && s->sl[order[b]].seq < s->sl[order[b - 1]].seq; b--) {
            int x = order[b];
            order[b] = order[b - 1];
            order[b - 1] = x;
        }
    return n;
}

static void par_save(dstage *st, loom_buf *b)
{
    parst *s = (parst *)st;
    quiesce(s);
    int order[s->pmax + 1];
    int n = window(s, order);
    loom_buf_put_i64(b, s->epoch);
    loom_buf_put_i64(b, s->pos);
    loom_buf_put_u32(b, (uint32_t)(s->p / s->group)); /* the parallelism */
    loom_buf_put_u32(b, (uint32_t)n);
    for (int k = 0; k < n; k++) {
        const pslot *sl = &s->sl[order[k]];
        loom_buf_put_u32(b, (uint32_t)sl->rc);
        loom_buf_put_u32(b, (uint32_t)sl->marker);
        if (sl->rc != LOOM_OK) {
            loom_buf_put_str(b, sl->err.where);
            loom_buf_put_str(b, sl->err.msg);
            loom_buf_put_str(b, sl->err.hint);
            continue;
        }
        for (int f = 0; f < st->spec.n; f++) {
            const loom_tensor *t = &sl->res.t[f];
            loom_buf_put_u32(b, (uint32_t)t->shape.rank);
            for (int d = 0; d < t->shape.rank; d++) loom_buf_put_i64(b, t->shape.dim[d]);
            loom_buf_put(b, t->data, loom_tensor_nbytes(t));
        }
    }
}

static int corrupt(loom_err *err) { return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "iterator state is corrupt (parallel map)"); }

/* Where a restored result's feature f goes: the output buffer of the last map
 * of the chain that writes one for f (sized for f's final shape), else the
 * slot's input copy (maps without one keep f's size). */
static uint8_t *result_home(parst *s, pslot *sl, const loom_elem *in, int f, size_t *cap)
{
    if (s->batch) {
        *cap = loom_tensor_nbytes(&sl->bout[f]);
        return sl->bout[f].data;
    }
    for (int k = s->nmap - 1; k >= 0; k--) {
        if (custom_is_(s->map[k])) return sl->obuf[k] + custom_offset_(s->map[k], f, cap); /* writes every feature */
        size_t obytes, fbytes;
        map_scratch_(s->map[k], &obytes, &fbytes);
        if (obytes > 0 && map_feature_(s->map[k]) == f) {
            *cap = obytes;
            return sl->obuf[k];
        }
    }
    *cap = s->in.slot_bytes[f];
    return in->t[f].data;
}

/* Reads one saved result into slot i. */
static int load_result(parst *s, int i, loom_buf *b, loom_err *err)
{
    dstage *st = &s->s;
    pslot *sl = &s->sl[i];
    loom_elem v;
    elem_pool_view_(&s->in, i, &v);
    sl->res.n = st->spec.n;
    for (int f = 0; f < st->spec.n; f++) {
        loom_tensor *t = &sl->res.t[f];
        memset(t, 0, sizeof *t);
        t->dtype = st->spec.dtype[f];
        t->shape.rank = (int)loom_buf_get_u32(b);
        if (b->failed || t->shape.rank < 0 || t->shape.rank > LOOM_MAX_RANK) return corrupt(err);
        for (int d = 0; d < t->shape.rank; d++)
            if ((t->shape.dim[d] = loom_buf_get_i64(b)) < 0) return corrupt(err);
        size_t n = loom_tensor_nbytes(t), cap;
        uint8_t *home = result_home(s, sl, &v, f, &cap);
        const void *src = loom_buf_take(b, n);
        if (!src || n > cap) return corrupt(err);
        t->data = home;
        memcpy(t->data, src, n);
    }
    return LOOM_OK;
}

static int par_restore(dstage *st, loom_buf *b, loom_err *err)
{
    parst *s = (parst *)st;
    quiesce(s);
    clear(s);
    s->epoch = loom_buf_get_i64(b);
    s->pos = loom_buf_get_i64(b);
    int p = (int)loom_buf_get_u32(b);
    uint32_t n = loom_buf_get_u32(b);
    if (b->failed || s->pos < 0 || n > (uint32_t)s->pmax) return corrupt(err);
    if (s->knob && p >= s->knob->min && p <= s->knob->max) /* resume at the tuned value */
        __atomic_store_n(&s->knob->value, (int64_t)p, __ATOMIC_RELAXED);
    for (uint32_t k = 0; k < n; k++) {
        pslot *sl = &s->sl[k];
        sl->rc = (int)loom_buf_get_u32(b);
        sl->marker = (int)loom_buf_get_u32(b);
        loom_err_clear(&sl->err);
        if (sl->rc != LOOM_OK) {
            sl->err.code = sl->rc;
            loom_buf_get_str(b, sl->err.where, sizeof sl->err.where);
            loom_buf_get_str(b, sl->err.msg, sizeof sl->err.msg);
            loom_buf_get_str(b, sl->err.hint, sizeof sl->err.hint);
            if (sl->marker) s->blocked = 1;
        } else {
            int rc = load_result(s, (int)k, b, err);
            if (rc) return rc;
        }
        if (b->failed) return corrupt(err);
        sl->seq = s->next_seq++;
        sl->tick = s->ticks++;
        sl->state = SL_DONE;
        sl->used = 1;
        s->occupied++;
    }
    dstage_gauge_(&st->st_buffered, s->occupied);
    return LOOM_OK;
}

static void par_close(dstage *st)
{
    parst *s = (parst *)st;
    if (s->sl) {
        quiesce(s);
        for (int i = 0; i <= s->pmax; i++) {
            for (int k = 0; k < s->nmap && s->sl[i].obuf; k++) {
                loom_free(s->sl[i].obuf[k]);
                loom_free(s->sl[i].flags[k]);
            }
            loom_free(s->sl[i].obuf);
            loom_free(s->sl[i].flags);
            for (int f = 0; f < LOOM_MAX_FEATURES; f++) loom_tensor_fini(&s->sl[i].bout[f]);
        }
    }
    if (s->batch) s->batch->ops->close(s->batch);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    elem_pool_fini_(&s->in);
    loom_free(s->sl);
    for (int k = s->nmap - 1; k >= 0; k--) s->map[k]->ops->close(s->map[k]);
    loom_free(s);
}

static void par_tune(dstage *st, dtuner *t)
{
    parst *s = (parst *)st;
    if (!s->autotune) return;
    s->knob = dtuner_knob_(t, st, "parallel", 1, 1, s->pmax / s->group, 1);
    if (s->knob) s->p = s->group; /* else (no room left in the tuner) the window stays at its maximum */
    dstage_gauge_(&st->st_parallel, s->p / s->group);
    dstage_gauge_(&st->st_capacity, s->p);
}

static const dstage_ops par_ops = {
    .next = par_next, .rewind = par_rewind, .save = par_save, .restore = par_restore,
    .pause = par_pause, .close = par_close, .tune = par_tune,
};

/* Per slot, a buffer and flags for each map of the chain (as the map's own). */
static int alloc_slots(parst *s, loom_err *err)
{
    s->sl = loom_calloc((size_t)s->pmax + 1, sizeof *s->sl);
    if (!s->sl) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the parallel map window");
    for (int i = 0; i <= s->pmax; i++) {
        pslot *sl = &s->sl[i];
        sl->owner = s;
        sl->idx = i;
        sl->task.fn = run_group;
        sl->task.arg = sl;
        sl->task.owner = s;
        sl->obuf = loom_calloc((size_t)s->nmap, sizeof *sl->obuf);
        sl->flags = loom_calloc((size_t)s->nmap, sizeof *sl->flags);
        if (!sl->obuf || !sl->flags) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the parallel map window");
        for (int k = 0; k < s->nmap; k++) {
            size_t obytes, fbytes;
            map_scratch_(s->map[k], &obytes, &fbytes);
            if (obytes) sl->obuf[k] = loom_alloc_aligned(obytes);
            if (fbytes) sl->flags[k] = loom_alloc(fbytes);
            if ((obytes && !sl->obuf[k]) || (fbytes && !sl->flags[k]))
                return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate %zu bytes per slot for the parallel map",
                                    obytes + fbytes);
            __atomic_fetch_add(&s->s.st_bytes, (int64_t)(obytes + fbytes), __ATOMIC_RELAXED);
        }
        for (int f = 0; s->batch && f < s->s.spec.n; f++) {
            int rc = loom_tensor_init(&sl->bout[f], s->s.spec.dtype[f], &s->s.maxshape[f], err);
            if (rc) return rc;
            __atomic_fetch_add(&s->s.st_bytes, (int64_t)loom_tensor_nbytes(&sl->bout[f]), __ATOMIC_RELAXED);
        }
    }
    return LOOM_OK;
}

/* Bytes one slot of the window holds: the input copies plus every map's
 * scratch (and in batch mode the batch buffer). */
static int64_t slot_bytes(const parst *s)
{
    int64_t b = 0;
    for (int f = 0; f < s->s.in->spec.n; f++)
        b += s->bsize * loom_shape_numel(&s->s.in->maxshape[f]) * (int64_t)loom_dtype_size(s->s.in->spec.dtype[f]);
    for (int f = 0; s->batch && f < s->s.spec.n; f++)
        b += loom_shape_numel(&s->s.maxshape[f]) * (int64_t)loom_dtype_size(s->s.spec.dtype[f]);
    for (int k = 0; k < s->nmap; k++) {
        size_t obytes, fbytes;
        map_scratch_(s->map[k], &obytes, &fbytes);
        b += (int64_t)(obytes + fbytes);
    }
    return b;
}

int parmap_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, int n, int parallel, int batch,
                 const loom_data_ctx *ctx, dpool **pool, int64_t ram_left, loom_err *err)
{
    *out = NULL;
    parst *s = loom_calloc(1, sizeof *s);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a parallel map stage");
    dstage *st = &s->s;
    dstage_init_(st, &par_ops, in, id, &t[0].loc);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->lent = -1;
    int rc = LOOM_OK;
    for (int k = 0; k < n; k++) {
        rc = map_open_(&s->map[k], k ? s->map[k - 1] : in, id + k, &t[k], ctx, err);
        if (rc) goto fail;
        s->nmap++;
    }
    for (int k = 0; k < n; k++) s->fuse[k] = (uint8_t)map_pad_crop_len_(s->map + k, n - k);
    s->bsize = 1;
    if (batch) {
        rc = batch_open_(&s->batch, s->map[n - 1], id + n, &t[n], err);
        if (rc) goto fail;
        s->bsize = t[n].batch_size;
        s->drop = t[n].drop_remainder;
    }
    dstage *last = batch ? s->batch : s->map[n - 1];
    st->spec = last->spec;
    memcpy(st->maxshape, last->maxshape, sizeof st->maxshape);
    st->batch_dims = last->batch_dims;
    st->card = last->card;
    dmaps_name_(st->name, sizeof st->name, s->map, n, batch ? "+batch" : "");
    size_t k = 0;
    for (int j = 0; j < n && k < sizeof st->desc; j++)
        k += (size_t)snprintf(st->desc + k, sizeof st->desc - k, "%s%.100s", j ? "+" : "", s->map[j]->desc);
    if (batch && k < sizeof st->desc) k += (size_t)snprintf(st->desc + k, sizeof st->desc - k, "+%s", s->batch->desc);
    s->det = t[0].deterministic;
    int autotune = s->autotune = parallel == LOOM_PARALLEL_AUTO;
    if (k < sizeof st->desc) {
        if (autotune) snprintf(st->desc + k, sizeof st->desc - k, "+par(auto,%d)", s->det);
        else snprintf(st->desc + k, sizeof st->desc - k, "+par(%d,%d)", parallel, s->det);
    }
    if (!*pool) {
        rc = dpool_new_(pool, ctx->threads > 0 ? ctx->threads : 1, err);
        if (rc) goto fail;
    }
    s->pool = *pool;
    int level = autotune ? dpool_size_(s->pool) : parallel;
    if (level < 1) level = 1;
    int64_t per = slot_bytes(s);
    /* per element, a group of calls per task (as the RAM budget allows); a batch is one call's worth */
    s->group = batch ? 1 : PAR_GROUP;
    while (s->group > 1 && per > 0 && (int64_t)(level * s->group + 1) * per > ram_left) s->group--;
    s->pmax = level * s->group;
    if (per > 0 && (int64_t)(s->pmax + 1) * per > ram_left) {
        if (!autotune || 2 * per > ram_left) {
            rc = dstage_err_(st, err, LOOM_ECONFIG, "%s: a window of %d %s needs %lld bytes, more than the %lld bytes "
                             "left of the RAM budget", st->name, s->pmax + 1, batch ? "batches" : "elements",
                             (long long)((s->pmax + 1) * per), (long long)ram_left);
            loom_err_hint(err, "lower `parallel`, or raise data.options.autotune.ram_budget");
            goto fail;
        }
        s->pmax = (int)(ram_left / per) - 1; /* "auto" stays within the budget */
    }
    s->p = s->pmax; /* "auto" without the autotuner: the pool's size, as tf.data; par_tune lowers it to 1 */
    dstage_gauge_(&st->st_parallel, s->p / s->group);
    dstage_gauge_(&st->st_capacity, s->p);
    /* the input copies are this stage's memory, though sized from the input's spec */
    int64_t before = dstage_load_(&in->st_bytes);
    rc = elem_pool_init_(&s->in, in, (s->pmax + 1) * s->bsize, err);
    int64_t added = dstage_load_(&in->st_bytes) - before;
    __atomic_fetch_sub(&in->st_bytes, added, __ATOMIC_RELAXED);
    __atomic_fetch_add(&st->st_bytes, added, __ATOMIC_RELAXED);
    s->in.bytes_gauge = &st->st_bytes;
    if (rc) goto fail;
    rc = alloc_slots(s, err);
    if (rc) goto fail;
    *out = st;
    return LOOM_OK;
fail:
    par_close(st);
    return rc;
}
