/* interleave.c - tf.data interleave (tf_semantics §4.5): each input element
 * names a file (the "filename" feature of a list_files source upstream) on
 * which the transform's nested tfrecord, csv or text source is opened; up to
 * cycle_length such readers are visited in turn, block_length elements each.
 * The order is exactly tf.data's: a cursor over the cycle slots; an open slot
 * yields an element (after block_length of them the cursor moves on) or, when
 * exhausted, is closed and the cursor moves on at once; an empty slot takes
 * the next input element while there is one, else the cursor moves on; the
 * pass ends when the input is exhausted and no slot is open.
 *
 * Parallel (parallel = N or "auto"): readers fill rings of prefetched
 * elements through tasks on the pipeline's shared worker pool, at most N at
 * once, cursor slot first. Readers for the next input elements ("futures",
 * tf.data's prefetch_input_elements) are opened and filled ahead: every empty
 * slot takes the next input element, so they land in order whichever slot
 * frees first. deterministic = true yields the sequential order exactly;
 * false lets the cursor skip a slot whose reader has nothing ready.
 * Threads: the consumer (train thread, or a prefetch producer) drives the
 * input and the cursor; a task owns its reader's nested source while busy;
 * ring counts and flags are under the stage's mutex. A reader's end (eof or
 * error) is published together with busy = 0, so the consumer never closes a
 * reader a task still touches.
 * State: cursor, block count, and per open slot and future the file, the
 * nested source's own state and the prefetched elements (after a pause), so
 * resuming mid-epoch is exact. */
#include "data/data_internal.h"

#include <pthread.h>
#include <string.h>

#define RING_MIN   16         /* prefetched elements per reader, at least (memory permitting) */
#define RING_MAX   64         /* and at most */
#define RING_BYTES (64 << 20) /* and all rings together, about */

typedef struct ilv ilv;

typedef struct reader {
    ilv      *owner;
    int       idx;
    bool      used;
    bool      is_err;   /* an input error travelling in the future queue: no file */
    char      path[LOOM_PATH_MAX];
    dstage   *src;      /* the nested source, NULL until opened */
    /* under owner->mu */
    int64_t   head, count; /* ring: buffered elements start at head */
    int64_t   lent;        /* ring slot lent to the consumer, -1 */
    bool      busy;        /* a task runs on it */
    bool      eof;         /* src is exhausted (published with busy = 0) */
    int       rc;          /* open/read error after the buffered elements (published with busy = 0) */
    loom_err  err;
    elem_pool ring;        /* parallel only */
    dtask     task;
} reader;

struct ilv {
    dstage   s;
    loom_source_spec nested; /* t->source with its file patterns cleared */
    loom_data_ctx    ctx;    /* seed for the nested tfrecord source */
    int       fname, flen;   /* input features: "filename" (uint8 (n)), "length" (int64 (), -1 absent) */
    int64_t   cycle, block;
    bool      parallel, det;
    int       pfix;          /* parallelism when not tuned */
    dknob    *knob;          /* parallel = "auto": the tuned value (atomic pointer, set once) */
    bool      autotune;
    dpool    *pool;
    int       nr;            /* readers: cycle (+ cycle futures when parallel) */
    reader   *r;
    int      *slot;          /* cycle slots: reader index or -1 */
    int      *fut;           /* future queue (ring of nr indices) */
    int       fut_head, fut_n, fut_max;
    int64_t   ring_cap;
    int64_t   epoch, cursor, block_n, open_n;
    bool      input_done;    /* the input returned EOF this pass */
    bool      done;
    int       lent_r;        /* reader whose ring slot the consumer holds, -1 */
    /* under mu */
    int       inflight, waiting;
    int       hold;          /* > 0: no task may start (pause, save, rewind, restore, close nest) */
    int64_t   buffered;
    pthread_mutex_t mu;
    pthread_cond_t  cv;
};

static int par_now(const ilv *s)
{
    const dknob *k = __atomic_load_n(&s->knob, __ATOMIC_ACQUIRE);
    int p = k ? (int)dknob_get_(k) : s->pfix;
    return p < 1 ? 1 : p;
}

/* ---- readers ----------------------------------------------------------------- */

/* Opens the nested source on path (one spec for every file, so one element spec). */
static int open_source(const ilv *s, const char *path, dstage **out, loom_err *err)
{
    *out = NULL;
    loom_source_spec *spec = loom_alloc(sizeof *spec);
    if (!spec) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a source spec");
    *spec = s->nested;
    spec->n_patterns = 1;
    int rc;
    /* escaped: the nested source expands its pattern */
    if (loom_glob_escape(path, spec->pattern[0], sizeof spec->pattern[0]) < 0) {
        rc = loom_err_set(err, LOOM_ECONFIG, path, "file name too long once its glob characters are escaped (%d bytes at most)",
                          LOOM_PATH_MAX - 1);
    } else {
        switch (spec->kind) {
        case LOOM_SRC_TFRECORD: rc = tfrecord_source_open_(out, spec, &s->ctx, err); break;
        case LOOM_SRC_CSV: rc = csv_source_open_(out, spec, err); break;
        case LOOM_SRC_TEXT: rc = text_source_open_(out, spec, err); break;
        default: rc = dstage_err_(&s->s, err, LOOM_ECONFIG, "source type %d cannot be interleaved", (int)spec->kind);
        }
    }
    loom_free(spec);
    return rc;
}

static reader *new_reader(ilv *s)
{
    for (int i = 0; i < s->nr; i++) {
        reader *r = &s->r[i];
        if (r->used) continue;
        r->used = true;
        r->is_err = false;
        r->path[0] = 0;
        r->src = NULL;
        r->head = r->count = 0;
        r->lent = -1;
        r->busy = r->eof = false;
        r->rc = LOOM_OK;
        loom_err_clear(&r->err);
        return r;
    }
    LOOM_ASSERT(!"interleave: no free reader");
    return NULL;
}

/* Frees r; no task may be running on it. */
static void drop_reader(ilv *s, reader *r)
{
    if (r->src) r->src->ops->close(r->src);
    r->src = NULL;
    pthread_mutex_lock(&s->mu);
    s->buffered -= r->count;
    dstage_gauge_(&s->s.st_buffered, s->buffered);
    pthread_mutex_unlock(&s->mu);
    r->count = 0;
    r->used = false;
}

/* The task: opens r's file if needed, then fills its ring. */
static void fill_task(void *arg)
{
    reader *r = arg;
    ilv *s = r->owner;
    int64_t t0 = dnow_ns_();
    loom_err err;
    loom_err_clear(&err);
    int rc = r->src ? LOOM_OK : open_source(s, r->path, &r->src, &err);
    while (rc == LOOM_OK) {
        pthread_mutex_lock(&s->mu);
        int64_t slot = -1;
        if (!s->hold && r->count + (r->lent >= 0) < s->ring_cap) slot = (r->head + r->count) % s->ring_cap;
        pthread_mutex_unlock(&s->mu);
        if (slot < 0) break;
        loom_elem *e;
        rc = dstage_next_(r->src, &e, &err);
        if (rc == LOOM_OK) rc = elem_pool_put_(&r->ring, slot, e, &err);
        if (rc) break;
        pthread_mutex_lock(&s->mu);
        r->count++;
        s->buffered++;
        dstage_gauge_(&s->s.st_buffered, s->buffered);
        if (s->waiting) pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
    }
    __atomic_fetch_add(&s->s.st_work_ns, dnow_ns_() - t0, __ATOMIC_RELAXED);
    pthread_mutex_lock(&s->mu);
    if (rc == LOOM_EEOF) {
        r->eof = true;
    } else if (rc) {
        r->rc = rc;
        r->err = err;
    }
    r->busy = false;
    s->inflight--;
    if (s->waiting) pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* Whether a task should run on r; under mu. Only once its ring is half
 * empty: each task then reads many elements, so the hand-off to a worker
 * (a wake-up, the locks) is paid per half ring, not per element. */
static bool wants_fill(const ilv *s, const reader *r)
{
    return !r->is_err && !r->busy && !r->eof && !r->rc && r->count + (r->lent >= 0) <= s->ring_cap / 2;
}

/* Submits fill tasks up to the parallelism: the cursor's slot first, then the
 * other slots in cursor order, then the futures in input order. */
static void schedule(ilv *s)
{
    int order[2 * 1024], n = 0, p = par_now(s);
    dstage_gauge_(&s->s.st_parallel, p);
    for (int64_t j = 0; j < s->cycle; j++) {
        int i = s->slot[(s->cursor + j) % s->cycle];
        if (i >= 0) order[n++] = i;
    }
    for (int j = 0; j < s->fut_n; j++) order[n++] = s->fut[(s->fut_head + j) % s->nr];
    dtask *go[2 * 1024];
    int ng = 0;
    pthread_mutex_lock(&s->mu);
    for (int j = 0; j < n && !s->hold && s->inflight < p; j++) {
        reader *r = &s->r[order[j]];
        if (!wants_fill(s, r)) continue;
        r->busy = true;
        s->inflight++;
        go[ng++] = &r->task;
    }
    pthread_mutex_unlock(&s->mu);
    for (int j = 0; j < ng; j++) dpool_submit_(s->pool, go[j]);
}

/* Waits until no task runs, and keeps new ones from starting until unhold(). */
static void quiesce(ilv *s)
{
    if (!s->parallel) return;
    pthread_mutex_lock(&s->mu);
    s->hold++;
    s->waiting++;
    while (s->inflight > 0) {
        pthread_mutex_unlock(&s->mu);
        int helped = dpool_help_own_(s->pool, s);
        pthread_mutex_lock(&s->mu);
        if (!helped && s->inflight > 0) pthread_cond_wait(&s->cv, &s->mu);
    }
    s->waiting--;
    pthread_mutex_unlock(&s->mu);
}

static void unhold(ilv *s)
{
    if (!s->parallel) return;
    pthread_mutex_lock(&s->mu);
    if (s->hold > 0) s->hold--;
    pthread_mutex_unlock(&s->mu);
}

/* Returns the consumer's ring slot to its reader. */
static void release_lent(ilv *s)
{
    if (s->lent_r < 0) return;
    pthread_mutex_lock(&s->mu);
    s->r[s->lent_r].lent = -1;
    pthread_mutex_unlock(&s->mu);
    s->lent_r = -1;
}

/* Pulls the file name of the next input element into a new reader (or the
 * input's error into an error reader); NULL at the end of the input. */
static int pull_input(ilv *s, reader **out, loom_err *err)
{
    *out = NULL;
    loom_elem *e;
    int rc = dstage_next_(s->s.in, &e, err);
    if (rc == LOOM_EEOF) {
        s->input_done = true;
        return LOOM_OK;
    }
    if (rc) return rc;
    const loom_tensor *name = &e->t[s->fname];
    size_t n = (size_t)loom_shape_numel(&name->shape);
    if (s->flen >= 0) {
        int64_t len = *(const int64_t *)e->t[s->flen].data;
        if (len < 0 || (size_t)len > n)
            return dstage_err_(&s->s, err, LOOM_EDATA, "input element has length %lld for a filename of %zu bytes",
                               (long long)len, n);
        n = (size_t)len;
    }
    const char *p = name->data;
    n = strnlen(p, n);
    if (n == 0 || n >= LOOM_PATH_MAX)
        return dstage_err_(&s->s, err, LOOM_EDATA, "input element has an empty or too long filename (%zu bytes)", n);
    reader *r = new_reader(s);
    memcpy(r->path, p, n);
    r->path[n] = 0;
    *out = r;
    return LOOM_OK;
}

/* Parallel: opens readers on the next input elements, up to fut_max ahead.
 * An input error is queued as an error reader and stops the pulls. */
static void top_up_futures(ilv *s)
{
    while (s->fut_n < s->fut_max && !s->input_done) {
        if (s->fut_n && s->r[s->fut[(s->fut_head + s->fut_n - 1) % s->nr]].is_err) return;
        reader *r;
        loom_err err;
        loom_err_clear(&err);
        int rc = pull_input(s, &r, &err);
        if (rc) {
            r = new_reader(s);
            r->is_err = true;
            r->rc = rc;
            r->err = err;
        }
        if (!r) return;
        s->fut[(s->fut_head + s->fut_n++) % s->nr] = r->idx;
    }
}

/* The reader for an empty slot: the next input element's. NULL at the end of the input. */
static int take_input(ilv *s, reader **out, loom_err *err)
{
    if (!s->parallel) {
        int rc = pull_input(s, out, err);
        if (rc || !*out) return rc;
        if ((rc = open_source(s, (*out)->path, &(*out)->src, err))) drop_reader(s, *out);
        return rc;
    }
    top_up_futures(s);
    *out = NULL;
    if (!s->fut_n) return LOOM_OK;
    reader *r = &s->r[s->fut[s->fut_head]];
    s->fut_head = (s->fut_head + 1) % s->nr;
    s->fut_n--;
    if (r->is_err) {
        int rc = r->rc;
        *err = r->err;
        drop_reader(s, r);
        return rc;
    }
    *out = r;
    return LOOM_OK;
}

/* Whether r can give an answer now (an element, its end or its error); under mu. */
static bool settled(const reader *r) { return r->count > 0 || r->eof || r->rc; }

/* Nondeterministic: whether some other open slot can give an answer now. */
static bool other_settled(ilv *s, int64_t except)
{
    bool any = false;
    pthread_mutex_lock(&s->mu);
    for (int64_t j = 0; j < s->cycle && !any; j++)
        if (j != except && s->slot[j] >= 0) any = settled(&s->r[s->slot[j]]);
    pthread_mutex_unlock(&s->mu);
    return any;
}

enum { PULL_OK, PULL_END, PULL_ERR, PULL_NOT_READY };

/* Parallel: the next element of r from its ring, waiting for it unless may_skip.
 * PULL_ERR: *rc and *err hold r's error. */
static int pull_ring(ilv *s, reader *r, loom_elem *out, bool may_skip, int *rc, loom_err *err)
{
    pthread_mutex_lock(&s->mu);
    int64_t t0 = 0;
    while (!settled(r)) {
        if (may_skip) {
            pthread_mutex_unlock(&s->mu);
            return PULL_NOT_READY;
        }
        bool idle = !r->busy;
        pthread_mutex_unlock(&s->mu);
        if (!t0) t0 = dnow_ns_();
        if (idle) schedule(s);
        int helped = dpool_help_own_(s->pool, s);
        pthread_mutex_lock(&s->mu);
        /* sleep only while a task is bound to broadcast: r's own, or one holding the parallelism r waits for */
        if (!helped && !settled(r) && (r->busy || s->inflight >= par_now(s))) {
            s->waiting++;
            pthread_cond_wait(&s->cv, &s->mu);
            s->waiting--;
        }
    }
    if (t0) __atomic_fetch_add(&s->s.st_wait_ns, dnow_ns_() - t0, __ATOMIC_RELAXED);
    int res = PULL_OK;
    if (r->count > 0) {
        r->lent = r->head;
        r->head = (r->head + 1) % s->ring_cap;
        r->count--;
        s->buffered--;
        dstage_gauge_(&s->s.st_buffered, s->buffered);
    } else if (r->rc) {
        res = PULL_ERR;
        *rc = r->rc;
        *err = r->err;
    } else {
        res = PULL_END;
    }
    pthread_mutex_unlock(&s->mu);
    if (res == PULL_OK) {
        elem_pool_view_(&r->ring, r->lent, out);
        s->lent_r = r->idx;
    }
    return res;
}

static void advance(ilv *s)
{
    s->cursor = (s->cursor + 1) % s->cycle;
    s->block_n = 0;
}

/* Closes the cursor's slot (its reader ended or failed) and moves on. */
static void close_slot(ilv *s)
{
    drop_reader(s, &s->r[s->slot[s->cursor]]);
    s->slot[s->cursor] = -1;
    s->open_n--;
    advance(s);
}

static int ilv_next(dstage *st, loom_elem **out, loom_err *err)
{
    ilv *s = (ilv *)st;
    release_lent(s);
    while (!s->done) {
        if (s->parallel) {
            top_up_futures(s);
            schedule(s);
        }
        if (s->open_n == 0 && s->input_done && s->fut_n == 0) break;
        int i = s->slot[s->cursor];
        if (i < 0) {
            if (s->input_done && s->fut_n == 0) {
                advance(s);
                continue;
            }
            reader *r;
            int rc = take_input(s, &r, err);
            if (rc) return rc;
            if (r) {
                s->slot[s->cursor] = r->idx;
                s->open_n++;
            }
            continue;
        }
        reader *r = &s->r[i];
        int res, rc = LOOM_OK;
        if (s->parallel) {
            bool may_skip = !s->det && other_settled(s, s->cursor);
            res = pull_ring(s, r, &st->out, may_skip, &rc, err);
            if (res == PULL_NOT_READY) {
                advance(s);
                continue;
            }
            for (int f = 0; f < st->spec.n; f++) st->mut[f] = 1; /* our own copy */
        } else {
            loom_elem *e;
            rc = dstage_next_(r->src, &e, err);
            res = rc == LOOM_OK ? PULL_OK : rc == LOOM_EEOF ? PULL_END : PULL_ERR;
            if (rc == LOOM_OK) {
                elem_copy_(&st->out, e);
                memcpy(st->mut, r->src->mut, sizeof st->mut);
            }
        }
        if (res == PULL_OK) {
            if (++s->block_n == s->block) advance(s);
            *out = &st->out;
            return LOOM_OK;
        }
        close_slot(s); /* exhausted, or failed: the error is returned once, the rest goes on */
        if (res == PULL_ERR) return rc;
    }
    s->done = true;
    return LOOM_EEOF;
}

/* Closes every reader; no task may be running. */
static void clear(ilv *s)
{
    s->lent_r = -1;
    for (int i = 0; i < s->nr; i++)
        if (s->r[i].used) drop_reader(s, &s->r[i]);
    for (int64_t j = 0; j < s->cycle; j++) s->slot[j] = -1;
    s->fut_head = s->fut_n = 0;
    s->cursor = s->block_n = s->open_n = 0;
    s->input_done = s->done = false;
}

static int ilv_rewind(dstage *st, int64_t epoch, loom_err *err)
{
    ilv *s = (ilv *)st;
    quiesce(s);
    clear(s);
    unhold(s);
    s->epoch = epoch;
    return st->in->ops->rewind(st->in, epoch, err);
}

static void ilv_pause(dstage *st) { quiesce((ilv *)st); }
static void ilv_resume(dstage *st) { unhold((ilv *)st); }

/* ---- save / restore ---------------------------------------------------------- */

static void save_reader(const ilv *s, const reader *r, loom_buf *b)
{
    loom_buf_put_u32(b, r->is_err);
    loom_buf_put_str(b, r->path);
    loom_buf_put_u32(b, r->src != NULL);
    if (r->src) r->src->ops->save(r->src, b);
    loom_buf_put_u32(b, r->eof);
    loom_buf_put_u32(b, (uint32_t)r->rc);
    if (r->rc) {
        loom_buf_put_str(b, r->err.where);
        loom_buf_put_str(b, r->err.msg);
        loom_buf_put_str(b, r->err.hint);
    }
    loom_buf_put_i64(b, r->count);
    for (int64_t k = 0; k < r->count; k++) elem_pool_save_(&r->ring, (r->head + k) % s->ring_cap, b);
}

/* State (after pause: no task runs): the pass, the cursor, then each slot's and future's reader. */
static void ilv_save(dstage *st, loom_buf *b)
{
    ilv *s = (ilv *)st;
    quiesce(s);
    loom_buf_put_i64(b, s->epoch);
    loom_buf_put_i64(b, s->cursor);
    loom_buf_put_i64(b, s->block_n);
    loom_buf_put_u32(b, s->input_done);
    loom_buf_put_u32(b, s->done);
    for (int64_t j = 0; j < s->cycle; j++) {
        loom_buf_put_u32(b, s->slot[j] >= 0);
        if (s->slot[j] >= 0) save_reader(s, &s->r[s->slot[j]], b);
    }
    loom_buf_put_u32(b, (uint32_t)s->fut_n);
    for (int j = 0; j < s->fut_n; j++) save_reader(s, &s->r[s->fut[(s->fut_head + j) % s->nr]], b);
    unhold(s); /* the pipeline's pause still holds them until resume */
}

static int corrupt(loom_err *err)
{
    return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "iterator state is corrupt (interleave)");
}

static int load_reader(ilv *s, loom_buf *b, reader **out, loom_err *err)
{
    reader *r = *out = new_reader(s);
    r->is_err = loom_buf_get_u32(b) != 0;
    loom_buf_get_str(b, r->path, sizeof r->path);
    uint32_t opened = loom_buf_get_u32(b);
    if (b->failed || opened > 1 || (!r->is_err && !r->path[0])) return corrupt(err);
    int rc;
    if (opened) {
        if ((rc = open_source(s, r->path, &r->src, err))) return rc;
        if ((rc = r->src->ops->restore(r->src, b, err))) {
            if (!err->where[0]) snprintf(err->where, sizeof err->where, "%.255s", r->path);
            return rc;
        }
    }
    uint32_t eof = loom_buf_get_u32(b);
    r->rc = (int)loom_buf_get_u32(b);
    r->eof = eof != 0;
    if (r->rc) {
        r->err.code = r->rc;
        loom_buf_get_str(b, r->err.where, sizeof r->err.where);
        loom_buf_get_str(b, r->err.msg, sizeof r->err.msg);
        loom_buf_get_str(b, r->err.hint, sizeof r->err.hint);
    }
    int64_t n = loom_buf_get_i64(b);
    if (b->failed || eof > 1 || n < 0 || n > (s->parallel ? s->ring_cap : 0)) return corrupt(err);
    for (int64_t k = 0; k < n; k++)
        if ((rc = elem_pool_load_(&r->ring, k, b, err))) return rc;
    r->count = n;
    pthread_mutex_lock(&s->mu);
    s->buffered += n;
    dstage_gauge_(&s->s.st_buffered, s->buffered);
    pthread_mutex_unlock(&s->mu);
    return LOOM_OK;
}

static int ilv_restore(dstage *st, loom_buf *b, loom_err *err)
{
    ilv *s = (ilv *)st;
    quiesce(s);
    clear(s);
    unhold(s);
    int64_t epoch = loom_buf_get_i64(b), cursor = loom_buf_get_i64(b), block_n = loom_buf_get_i64(b);
    uint32_t input_done = loom_buf_get_u32(b), done = loom_buf_get_u32(b);
    if (b->failed || epoch < 0 || cursor < 0 || cursor >= s->cycle || block_n < 0 || block_n >= s->block ||
        input_done > 1 || done > 1)
        return corrupt(err);
    s->epoch = epoch;
    s->cursor = cursor;
    s->block_n = block_n;
    s->input_done = input_done;
    s->done = done;
    int rc;
    reader *r;
    for (int64_t j = 0; j < s->cycle; j++) {
        uint32_t present = loom_buf_get_u32(b);
        if (b->failed || present > 1) return corrupt(err);
        if (!present) continue;
        if ((rc = load_reader(s, b, &r, err))) return rc;
        if (r->is_err) return corrupt(err);
        s->slot[j] = r->idx;
        s->open_n++;
    }
    uint32_t nf = loom_buf_get_u32(b);
    if (b->failed || nf > (uint32_t)s->fut_max) return corrupt(err);
    for (uint32_t j = 0; j < nf; j++) {
        if ((rc = load_reader(s, b, &r, err))) return rc;
        s->fut[(s->fut_head + s->fut_n++) % s->nr] = r->idx;
    }
    return LOOM_OK;
}

static void ilv_close(dstage *st)
{
    ilv *s = (ilv *)st;
    if (s->r) {
        quiesce(s);
        for (int i = 0; i < s->nr; i++) {
            if (s->r[i].used) drop_reader(s, &s->r[i]);
            elem_pool_fini_(&s->r[i].ring);
        }
    }
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    loom_free(s->r);
    loom_free(s->slot);
    loom_free(s->fut);
    loom_free(s);
}

/* parallel = "auto": the tuner sets the reads in flight, 1 to cycle_length. */
static void ilv_tune(dstage *st, dtuner *t)
{
    ilv *s = (ilv *)st;
    /* atomic: a prefetch downstream may already be pulling through this stage */
    if (s->autotune && !s->knob)
        __atomic_store_n(&s->knob, dtuner_knob_(t, st, "parallel", s->pfix, 1, s->cycle, 1), __ATOMIC_RELEASE);
}

static const dstage_ops ilv_ops = {
    .next = ilv_next, .rewind = ilv_rewind, .save = ilv_save, .restore = ilv_restore,
    .pause = ilv_pause, .resume = ilv_resume, .close = ilv_close, .tune = ilv_tune,
};

/* ---- open ------------------------------------------------------------------------ */

/* The input must carry file names: "filename" uint8 (n) and optionally "length" int64 (). */
static int check_input(ilv *s, loom_err *err)
{
    const loom_elem_spec *in = &s->s.in->spec;
    char have[512];
    s->fname = loom_elem_spec_find(in, "filename");
    s->flen = loom_elem_spec_find(in, "length");
    if (s->fname < 0 || in->dtype[s->fname] != LOOM_U8 || in->shape[s->fname].rank != 1 ||
        (s->flen >= 0 && (in->dtype[s->flen] != LOOM_I64 || in->shape[s->flen].rank != 0))) {
        dstage_err_(&s->s, err, LOOM_ECONFIG, "interleave needs file names as input (\"filename\" uint8 (n)), got %s",
                    loom_elem_spec_str(in, have, sizeof have));
        return loom_err_hint(err, "put a list_files source first: source: { type = \"list_files\"; files = [...]; }");
    }
    return LOOM_OK;
}

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

/* A fingerprint of how the nested source reads a file (features, columns,
 * options), for the state check: not its files, nor where it was declared. */
static uint64_t nested_hash(const loom_source_spec *n)
{
    uint64_t h = 0xcbf29ce484222325ull;
    /* the read options of the nested source's own kind, 0 for the other kinds' */
    int64_t opts[6] = {n->kind, n->n_features};
    if (n->kind == LOOM_SRC_TFRECORD) {
        opts[2] = n->tfrecord.compression;
        opts[3] = n->tfrecord.on_corrupt;
    } else if (n->kind == LOOM_SRC_TEXT) {
        opts[4] = n->text.max_length;
        opts[5] = n->text.truncate;
    }
    h = fnv(h, opts, sizeof opts);
    for (int f = 0; f < n->n_features; f++) {
        h = fnv(h, n->feature[f], strlen(n->feature[f]) + 1);
        if (n->kind == LOOM_SRC_TFRECORD) {
            const loom_tfr_feature *t = &n->tfrecord.features[f];
            int64_t v[4] = {t->dtype, t->rank, t->var_len, t->has_default};
            double d[2] = {t->default_value, t->pad};
            h = fnv(fnv(fnv(h, v, sizeof v), t->shape, (size_t)t->rank * sizeof t->shape[0]), d, sizeof d);
        } else if (n->kind == LOOM_SRC_CSV) {
            const loom_csv_column *c = &n->csv.columns[f];
            int64_t v[4] = {c->dtype, c->index, c->has_default, c->count};
            h = fnv(fnv(fnv(h, v, sizeof v), c->column, strlen(c->column) + 1), &c->default_value, sizeof(double));
        }
    }
    if (n->kind == LOOM_SRC_CSV) {
        int64_t v[2] = {n->csv.header, n->csv.delimiter};
        h = fnv(h, v, sizeof v);
    }
    return h;
}

/* The nested source's element spec, from the first file of the list_files
 * source upstream (which also checks the declared features against it). */
static int probe(ilv *s, loom_err *err)
{
    const dstage *src = s->s.in;
    while (src->in) src = src->in;
    const char *first = list_files_first_(src);
    if (!first) {
        dstage_err_(&s->s, err, LOOM_ECONFIG, "interleave reads the file names of a list_files source, and this "
                                              "pipeline's source is \"%s\"", src->name);
        return loom_err_hint(err, "use source: { type = \"list_files\"; files = [...]; } for the dataset");
    }
    dstage *d;
    int rc = open_source(s, first, &d, err);
    if (rc) return rc;
    dstage *st = &s->s;
    st->spec = d->spec;
    memcpy(st->maxshape, d->maxshape, sizeof st->maxshape);
    snprintf(st->name, sizeof st->name, "interleave(%.30s)", d->name);
    /* the nested desc names its file: keep the part before the file-specific fields */
    char kind[32];
    int kl = (int)strcspn(d->desc, "(");
    snprintf(kind, sizeof kind, "%.*s", kl < 31 ? kl : 31, d->desc);
    d->ops->close(d);
    char par[24];
    if (s->autotune) snprintf(par, sizeof par, "auto");
    else snprintf(par, sizeof par, "%d", s->parallel ? s->pfix : 1);
    snprintf(st->desc, sizeof st->desc, "interleave(%lld,%lld,%s,%d,%s,%016llx)", (long long)s->cycle,
             (long long)s->block, par, s->det, kind, (unsigned long long)nested_hash(&s->nested));
    return LOOM_OK;
}

/* Ring slots per reader: a block, at least RING_MIN (fewer tasks per element) and at
 * most RING_MAX, halved (down to 2) while the rings would pass RING_BYTES. */
static int64_t ring_size(const ilv *s)
{
    size_t bytes = 0;
    for (int f = 0; f < s->s.spec.n; f++)
        bytes += (size_t)loom_shape_numel(&s->s.maxshape[f]) * loom_dtype_size(s->s.spec.dtype[f]);
    int64_t k = s->block < RING_MIN ? RING_MIN : s->block > RING_MAX ? RING_MAX : s->block;
    while (k > 2 && (double)k * s->nr * (double)bytes > RING_BYTES) k /= 2;
    return k;
}

int interleave_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, const loom_data_ctx *ctx,
                     dpool **pool, loom_err *err)
{
    *out = NULL;
    ilv *s = loom_calloc(1, sizeof *s);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate an interleave stage");
    dstage *st = &s->s;
    dstage_init_(st, &ilv_ops, in, id, &t->loc);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->lent_r = -1;
    s->cycle = t->cycle_length;
    s->block = t->block_length;
    s->det = t->deterministic;
    s->autotune = t->parallel == LOOM_PARALLEL_AUTO;
    s->parallel = s->autotune || t->parallel > 1;
    s->ctx = *ctx;
    s->ctx.name = NULL;
    int rc;
    if (!t->source || s->cycle < 1 || s->cycle > 1024 || s->block < 1) {
        rc = dstage_err_(st, err, LOOM_ECONFIG, "interleave needs a source, cycle_length in [1, 1024] and "
                                                "block_length >= 1 (got %lld, %lld)",
                         (long long)s->cycle, (long long)s->block);
        goto fail;
    }
    s->nested = *t->source;
    s->nested.n_patterns = 0;
    s->nested.file_shards = 0; /* the input was sharded, if at all: each file is read whole */
    s->nested.shuffle_files = false;
    if ((rc = check_input(s, err))) goto fail;
    if (s->parallel) {
        if (!*pool && (rc = dpool_new_(pool, ctx->threads > 0 ? ctx->threads : 1, err))) goto fail;
        s->pool = *pool;
        /* auto starts at what the pool can run at once (the tuner moves it); N is capped by the cycle */
        int p = s->autotune ? dpool_size_(s->pool) : t->parallel;
        s->pfix = p < 1 ? 1 : p > s->cycle ? (int)s->cycle : p;
        s->fut_max = (int)s->cycle;
    }
    if ((rc = probe(s, err))) goto fail;
    st->card = -2;
    s->nr = (int)s->cycle + s->fut_max;
    s->r = loom_calloc((size_t)s->nr, sizeof *s->r);
    s->slot = loom_alloc((size_t)s->cycle * sizeof *s->slot);
    s->fut = loom_alloc((size_t)s->nr * sizeof *s->fut);
    if (!s->r || !s->slot || !s->fut) {
        rc = loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the interleave's %lld readers", (long long)s->cycle);
        goto fail;
    }
    for (int64_t j = 0; j < s->cycle; j++) s->slot[j] = -1;
    s->ring_cap = s->parallel ? ring_size(s) : 0;
    for (int i = 0; i < s->nr; i++) {
        reader *r = &s->r[i];
        r->owner = s;
        r->idx = i;
        r->lent = -1;
        r->task.fn = fill_task;
        r->task.arg = r;
        r->task.owner = s; /* a waiting consumer runs its own fills rather than sleep */
        if (s->parallel && (rc = elem_pool_init_(&r->ring, st, s->ring_cap, err))) goto fail;
    }
    dstage_gauge_(&st->st_parallel, s->parallel ? s->pfix : 0);
    dstage_gauge_(&st->st_capacity, (int64_t)s->nr * s->ring_cap);
    *out = st;
    return LOOM_OK;
fail:
    ilv_close(st);
    return rc;
}
