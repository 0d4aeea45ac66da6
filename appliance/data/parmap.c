/* parmap.c - parallel map (tf.data map with num_parallel_calls): the
 * pipeline's one shared worker pool (dpool) and a map stage that keeps a
 * bounded window of in-flight elements in preallocated slots.
 * Threads: the consumer (train thread, or a prefetch producer downstream)
 * pulls the input, copies each element into a free slot and submits the
 * call; pool workers run map_apply_ on the slot and mark it done under the
 * stage's mutex. Results leave in input order when deterministic, else in
 * completion order; EOF/errors from upstream travel as markers in order.
 * The RNG index of every element is fixed at dispatch, so the output is the
 * same for any parallelism. Save/restore: pause waits for the calls in
 * flight, so upstream is exactly "after the window", and the finished but
 * unconsumed results are saved with the stage (as prefetch does). */
#include "data_internal.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

/* ---- the shared worker pool ------------------------------------------------ */

struct dpool {
    int             n;
    pthread_t      *th;
    pthread_mutex_t mu;
    pthread_cond_t  cv;
    dtask          *head, *tail;
    int             stop;
    int             idle;   /* workers asleep: submit signals only then */
    int             budget; /* CPU units left for autotuned maps (parmap_claim) */
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
    p->budget = threads > 0 ? threads : 1;
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

/* Takes one unit of the CPU budget shared by autotuned maps; 0 when none is left. */
static int dpool_claim(dpool *p)
{
    pthread_mutex_lock(&p->mu);
    int ok = p->budget > 0;
    if (ok) p->budget--;
    pthread_mutex_unlock(&p->mu);
    return ok;
}

static void dpool_unclaim(dpool *p, int n)
{
    pthread_mutex_lock(&p->mu);
    p->budget += n;
    pthread_mutex_unlock(&p->mu);
}

/* ---- the stage ---------------------------------------------------------------- */

enum { SL_FREE, SL_QUEUED, SL_DONE, SL_LENT };

#define AUTO_MIN_PERIOD 16   /* elements per autotune period, at least */
#define AUTO_WAIT_FRAC  0.05 /* grow while the consumer waits more than this share of a period */
#define AUTO_GAIN       1.03 /* a step up must raise the rate by 3%, else it is undone */
#define AUTO_COOLDOWN   8    /* periods before trying again after an undone step */

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
    loom_elem res;    /* the result: views of the slot's input copy and obuf */
    uint8_t  *obuf, *flags;
    dtask     task;
} pslot;

struct parst {
    dstage    s;
    dstage   *map;        /* the sequential map stage: settings, spec and map_apply_ */
    int       f;          /* the feature it maps */
    dpool    *pool;
    int       det;
    int       autotune;
    int       pmax;       /* slots - 1: most elements in the window */
    int       p;          /* the window now (calls in flight plus finished results) */
    int       claimed;    /* budget units held (autotune) */
    elem_pool in;         /* input copies, pmax + 1 slots */
    pslot    *sl;
    int64_t   epoch, pos; /* pos: RNG index of the next element pulled */
    int64_t   next_seq, emit_seq, ticks;
    int       occupied;   /* slots in the window: queued or done (not free, not lent) */
    int       inflight;   /* queued or running calls; under mu */
    int       waiting;    /* the consumer sleeps on cv: completions signal only then; under mu */
    int       blocked;    /* a marker is in the window: pull nothing more */
    int       lent;       /* slot the consumer holds, -1 */
    /* autotune: the current period and the hill climb */
    int64_t   per_t0, per_wait, per_n;
    double    best_rate;
    int       trying, cooldown;
    pthread_mutex_t mu;
    pthread_cond_t  cv;
};

static int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void run_call(void *arg)
{
    pslot *sl = arg;
    parst *s = sl->owner;
    loom_elem e;
    elem_pool_view_(&s->in, sl->idx, &e);
    loom_err err;
    loom_err_clear(&err);
    int mut;
    int rc = map_apply_(s->map, &e, 1, sl->obuf, sl->flags, sl->epoch, sl->pos, &mut, &err);
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

/* Waits until no call is in flight. */
static void quiesce(parst *s)
{
    pthread_mutex_lock(&s->mu);
    s->waiting = 1;
    while (s->inflight > 0) pthread_cond_wait(&s->cv, &s->mu);
    s->waiting = 0;
    pthread_mutex_unlock(&s->mu);
}

static int free_slot(const parst *s)
{
    for (int i = 0; i <= s->pmax; i++)
        if (!s->sl[i].used) return i;
    return -1;
}

/* Pulls input and submits calls until the window is full or a marker is in it.
 * Runs on the consumer thread without the lock: only it changes FREE slots. */
static void fill(parst *s)
{
    dstage *st = &s->s;
    while (!s->blocked && s->occupied < s->p) {
        int i = free_slot(s);
        LOOM_ASSERT(i >= 0);
        pslot *sl = &s->sl[i];
        loom_elem *e;
        sl->used = 1;
        loom_err_clear(&sl->err);
        sl->rc = dstage_next_(st->in, &e, &sl->err);
        sl->seq = s->next_seq++;
        sl->marker = sl->rc != LOOM_OK;
        if (sl->rc == LOOM_OK) sl->rc = elem_pool_put_(&s->in, i, e, &sl->err);
        s->occupied++;
        if (sl->rc != LOOM_OK) {
            if (sl->marker) s->blocked = 1;
            pthread_mutex_lock(&s->mu);
            sl->tick = s->ticks++;
            sl->state = SL_DONE;
            pthread_mutex_unlock(&s->mu);
            continue;
        }
        sl->epoch = s->epoch;
        sl->pos = s->pos;
        loom_elem v;
        elem_pool_view_(&s->in, i, &v);
        s->pos += map_count_(s->map, &v);
        pthread_mutex_lock(&s->mu);
        sl->state = SL_QUEUED;
        s->inflight++;
        pthread_mutex_unlock(&s->mu);
        dpool_submit(s->pool, &sl->task);
    }
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

/* One step of the hill climb at the end of a period; consumer thread. */
static void autotune(parst *s, int64_t t)
{
    double dt = (double)(t - s->per_t0) * 1e-9;
    if (s->per_n < AUTO_MIN_PERIOD + 4 * s->p || dt <= 0) return;
    double rate = (double)s->per_n / dt, waitf = (double)s->per_wait * 1e-9 / dt;
    if (s->trying) {
        s->trying = 0;
        if (rate < s->best_rate * AUTO_GAIN) { /* no gain: undo the step */
            s->p--;
            s->claimed--;
            dpool_unclaim(s->pool, 1);
            s->cooldown = AUTO_COOLDOWN;
        } else {
            s->best_rate = rate;
        }
    } else if (rate > s->best_rate) {
        s->best_rate = rate;
    }
    if (s->cooldown > 0) s->cooldown--;
    else if (!s->trying && waitf > AUTO_WAIT_FRAC && s->p < s->pmax && dpool_claim(s->pool)) {
        s->claimed++;
        s->p++;
        s->trying = 1;
    }
    dstage_gauge_(&s->s.st_parallel, s->p);
    dstage_gauge_(&s->s.st_capacity, s->p);
    s->per_t0 = t;
    s->per_wait = s->per_n = 0;
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
    pthread_mutex_lock(&s->mu);
    int i = ready(s);
    if (i < 0) {
        int64_t t0 = now_ns();
        s->waiting = 1;
        while ((i = ready(s)) < 0) pthread_cond_wait(&s->cv, &s->mu);
        s->waiting = 0;
        int64_t w = now_ns() - t0;
        __atomic_fetch_add(&st->st_wait_ns, w, __ATOMIC_RELAXED);
        s->per_wait += w;
    }
    pslot *sl = &s->sl[i];
    sl->state = sl->rc == LOOM_OK ? SL_LENT : SL_FREE;
    pthread_mutex_unlock(&s->mu);
    if (sl->rc != LOOM_OK) sl->used = 0;
    s->occupied--;
    if (s->det) s->emit_seq++;
    dstage_gauge_(&st->st_buffered, s->occupied);
    if (s->autotune) {
        s->per_n++;
        autotune(s, now_ns());
    }
    if (sl->rc != LOOM_OK) {
        if (sl->marker) s->blocked = 0; /* the next call pulls again, as the sequential map does */
        if (sl->rc != LOOM_EEOF && err) *err = sl->err;
        return sl->rc;
    }
    s->lent = i;
    st->out = sl->res;
    for (int f = 0; f < st->spec.n; f++) st->mut[f] = 1; /* our own copy */
    *out = &st->out;
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
    loom_buf_put_u32(b, (uint32_t)s->p);
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

/* Reads one saved result into slot i: feature f into obuf when the map writes
 * one, else into the slot's input copy (same size as the result). */
static int load_result(parst *s, int i, loom_buf *b, loom_err *err)
{
    dstage *st = &s->s;
    pslot *sl = &s->sl[i];
    loom_elem v;
    elem_pool_view_(&s->in, i, &v);
    size_t obytes, fbytes;
    map_scratch_(s->map, &obytes, &fbytes);
    sl->res.n = st->spec.n;
    for (int f = 0; f < st->spec.n; f++) {
        loom_tensor *t = &sl->res.t[f];
        memset(t, 0, sizeof *t);
        t->dtype = st->spec.dtype[f];
        t->shape.rank = (int)loom_buf_get_u32(b);
        if (b->failed || t->shape.rank < 0 || t->shape.rank > LOOM_MAX_RANK) return corrupt(err);
        for (int d = 0; d < t->shape.rank; d++)
            if ((t->shape.dim[d] = loom_buf_get_i64(b)) < 0) return corrupt(err);
        size_t n = loom_tensor_nbytes(t);
        /* the mapped feature goes to obuf (sized for the result) when the map has one */
        int to_obuf = obytes > 0 && f == s->f;
        size_t cap = to_obuf ? obytes : s->in.slot_bytes[f];
        const void *src = loom_buf_take(b, n);
        if (!src || n > cap) return corrupt(err);
        t->data = to_obuf ? (void *)sl->obuf : v.t[f].data;
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
    if (s->autotune && p > s->p) { /* keep the tuned value, within the budget */
        while (s->p < p && s->p < s->pmax && dpool_claim(s->pool)) s->p++, s->claimed++;
        dstage_gauge_(&st->st_parallel, s->p);
        dstage_gauge_(&st->st_capacity, s->p);
    }
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
            loom_free(s->sl[i].obuf);
            loom_free(s->sl[i].flags);
        }
    }
    if (s->claimed && s->pool) dpool_unclaim(s->pool, s->claimed);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    elem_pool_fini_(&s->in);
    loom_free(s->sl);
    if (s->map) s->map->ops->close(s->map);
    loom_free(s);
}

static const dstage_ops par_ops = {
    .next = par_next, .rewind = par_rewind, .save = par_save, .restore = par_restore,
    .pause = par_pause, .close = par_close,
};

int parmap_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, const loom_data_ctx *ctx, dpool **pool,
                 loom_err *err)
{
    *out = NULL;
    dstage *map;
    int rc = map_open_(&map, in, id, t, ctx, err);
    if (rc) return rc;
    parst *s = loom_calloc(1, sizeof *s);
    if (!s) {
        map->ops->close(map);
        return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a parallel map stage");
    }
    dstage *st = &s->s;
    dstage_init_(st, &par_ops, in, id, &t->loc);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->map = map;
    s->f = loom_elem_spec_find(&map->spec, t->map.feature);
    s->lent = -1;
    st->spec = map->spec;
    memcpy(st->maxshape, map->maxshape, sizeof st->maxshape);
    st->batch_dims = map->batch_dims;
    st->card = map->card;
    snprintf(st->name, sizeof st->name, "%s", map->name);
    s->det = t->deterministic;
    s->autotune = t->parallel == LOOM_PARALLEL_AUTO;
    if (s->autotune) snprintf(st->desc, sizeof st->desc, "%.120s+par(auto,%d)", map->desc, s->det);
    else snprintf(st->desc, sizeof st->desc, "%.120s+par(%d,%d)", map->desc, t->parallel, s->det);
    if (!*pool) {
        rc = dpool_new_(pool, ctx->threads > 0 ? ctx->threads : 1, err);
        if (rc) goto fail;
    }
    s->pool = *pool;
    s->pmax = s->autotune ? dpool_size_(s->pool) : t->parallel;
    if (s->pmax < 1) s->pmax = 1;
    s->p = s->autotune ? 1 : s->pmax;
    if (s->autotune && dpool_claim(s->pool)) s->claimed = 1;
    s->per_t0 = now_ns();
    dstage_gauge_(&st->st_parallel, s->p);
    dstage_gauge_(&st->st_capacity, s->p);
    /* the input copies are this stage's memory, though sized from the input's spec */
    int64_t before = dstage_load_(&in->st_bytes);
    rc = elem_pool_init_(&s->in, in, s->pmax + 1, err);
    int64_t added = dstage_load_(&in->st_bytes) - before;
    __atomic_fetch_sub(&in->st_bytes, added, __ATOMIC_RELAXED);
    __atomic_fetch_add(&st->st_bytes, added, __ATOMIC_RELAXED);
    s->in.bytes_gauge = &st->st_bytes;
    if (rc) goto fail;
    s->sl = loom_calloc((size_t)s->pmax + 1, sizeof *s->sl);
    if (!s->sl) {
        rc = loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the parallel map window");
        goto fail;
    }
    size_t obytes, fbytes;
    map_scratch_(map, &obytes, &fbytes);
    for (int i = 0; i <= s->pmax; i++) {
        pslot *sl = &s->sl[i];
        sl->owner = s;
        sl->idx = i;
        sl->task.fn = run_call;
        sl->task.arg = sl;
        if (obytes) sl->obuf = loom_alloc_aligned(obytes);
        if (fbytes) sl->flags = loom_alloc(fbytes);
        if ((obytes && !sl->obuf) || (fbytes && !sl->flags)) {
            rc = loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate %zu bytes per slot for the parallel map", obytes + fbytes);
            goto fail;
        }
        __atomic_fetch_add(&st->st_bytes, (int64_t)(obytes + fbytes), __ATOMIC_RELAXED);
    }
    *out = st;
    return LOOM_OK;
fail:
    par_close(st);
    return rc;
}
