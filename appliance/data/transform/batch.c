/* batch.c - the batch stage: stacks elements into one of (n, ...) tensors
 * with a short last batch unless dropped; over a random-access input it
 * gathers the rows itself (on the pool's threads for large batches), and a
 * scale map may fuse into that gather. dbatch_card_ and dbatch_feature_
 * are the batch shape arithmetic padded_batch and unbatch share. */
#include "data/data_internal.h"
#include "transform_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- batch ------------------------------------------------------------------ */

typedef struct batchst {
    dstage     s;
    int64_t    size;
    int        drop;
    int        gather;  /* the input draws positions into in-memory rows: batch_gather */
    int        scale_f; /* >= 0: a map(scale) of this feature is fused into the gather (batch_fuse_scale_) */
    float      sc, off; /* its scale and offset */
    loom_pool *pool;    /* (optional) the rows' copies split over it (batch_share_pool_) */
} batchst;

/* Whether a batch over in may gather: in draws positions (an index-mode
 * shuffle, a source in plain order) into a stage with in-memory rows of fixed
 * shapes. LOOM_DATA_GATHER=0 in the environment keeps the element-by-element
 * path (the tests compare the two). */
static bool batch_can_gather(dstage *in)
{
    const char *env = getenv("LOOM_DATA_GATHER");
    if (env && !strcmp(env, "0")) return false;
    dstage *from = ddraw_from_(in);
    if (!in->ops->draw || !from->ops->rows || from->spec.n != in->spec.n) return false;
    for (int f = 0; f < from->spec.n; f++) {
        if (from->spec.dtype[f] != in->spec.dtype[f] || !loom_shape_eq(&from->spec.shape[f], &in->spec.shape[f])) return false;
        for (int d = 0; d < from->spec.shape[f].rank; d++)
            if (from->spec.shape[f].dim[d] < 0) return false;
    }
    return true;
}

/* The copies of one chunk of drawn positions: rows [k0, k1) of pos, to the
 * batch's rows i + k. scaled: feature s->scale_f is written as float32
 * v * sc + off (scale_vals: the map's own loop, so its floats bit for bit). */
typedef struct gather_job {
    const batchst  *s;
    const loom_elem *o;
    const uint8_t  *base[LOOM_MAX_FEATURES];
    size_t          ib[LOOM_MAX_FEATURES];
    const int64_t  *pos;
    int64_t         i, got;
    int             scaled, parts;
} gather_job;

/* Rows at random places of a large array: each is asked for a few rows
 * ahead of its copy, the first few at once. */
#define GATHER_AHEAD 8
#define GATHER_STAGE_BYTES (16 << 10)
static inline void prefetch_row(const uint8_t *p, size_t n)
{
    uintptr_t r = (uintptr_t)p;
    for (uintptr_t c = r & ~(uintptr_t)63; c < r + n; c += 64) __builtin_prefetch((const void *)c);
}

static void gather_rows(const gather_job *j, int64_t k0, int64_t k1)
{
    const batchst *s = j->s;
    const int64_t *pos = j->pos;
    for (int f = 0; f < j->o->n; f++) {
        size_t n = j->ib[f];
        if (n == 0) continue; /* empty items: nothing to copy (and maybe no array) */
        const uint8_t *b = j->base[f];
        if (j->scaled && f == s->scale_f) {
            loom_dtype dt = s->s.in->spec.dtype[f];
            size_t vals = n / loom_dtype_size(dt);
            float *d = (float *)j->o->t[f].data + (size_t)j->i * vals;
            /* a block of rows copied into a stage in L1 (the loads of many
             * rows in flight at once, as a plain gather's copies have them),
             * then scaled from there; a row larger than the stage directly */
            _Alignas(64) uint8_t stage[GATHER_STAGE_BYTES];
            int64_t per = n <= sizeof stage ? (int64_t)(sizeof stage / n) : 0;
            for (int64_t k = k0; k < k1;) {
                if (!per) {
                    dscale_vals_(b + (size_t)pos[k] * n, dt, d + (size_t)k * vals, vals, s->sc, s->off);
                    k++;
                    continue;
                }
                int64_t m = k1 - k < per ? k1 - k : per;
                for (int64_t r = 0; r < m; r++) {
                    if (k + r + GATHER_AHEAD < k1) prefetch_row(b + (size_t)pos[k + r + GATHER_AHEAD] * n, n);
                    memcpy(stage + (size_t)r * n, b + (size_t)pos[k + r] * n, n);
                }
                dscale_vals_(stage, dt, d + (size_t)k * vals, (size_t)m * vals, s->sc, s->off);
                k += m;
            }
            continue;
        }
        uint8_t *d = (uint8_t *)j->o->t[f].data + (size_t)j->i * n;
        if (n == 1)
            for (int64_t k = k0; k < k1; k++) d[k] = b[pos[k]];
        else
            for (int64_t k = k0; k < k1; k++) {
                if (k + 8 < k1) {
                    uintptr_t r = (uintptr_t)(b + (size_t)pos[k + 8] * n);
                    for (uintptr_t c = r & ~(uintptr_t)63; c < r + n; c += 64) __builtin_prefetch((const void *)c);
                }
                memcpy(d + (size_t)k * n, b + (size_t)pos[k] * n, n);
            }
    }
}

static void gather_part(void *arg, int t)
{
    const gather_job *j = arg;
    gather_rows(j, j->got * t / j->parts, j->got * (t + 1) / j->parts);
}

/* Below this many bytes written per chunk the copies stay on one thread: a
 * pool run costs a wake-up or two, a 16 KiB copy about as much. Above it the
 * chunk is cut in parts of at least 16 KiB, up to 4 per thread, which the
 * threads take as they come: one that the scheduler holds up (a shared
 * machine) delays the batch by one small part, not by half of it. */
#define GATHER_SPLIT_BYTES (32 << 10)

/* batch_into when gathering: the input's draws, a chunk of positions at a
 * time, then a copy per row and feature straight from the rows (split over
 * s->pool when it is set and the chunk is large). No element is lent and no
 * clock is read per element: the draws are timed per chunk, and the stats
 * count the elements as next() (and get, on the rows' stage) would. */
static int batch_gather(batchst *s, loom_elem *o, int scaled, loom_err *err)
{
    dstage *st = &s->s, *in = st->in, *from = ddraw_from_(in);
    gather_job j = {.s = s, .o = o, .scaled = scaled};
    from->ops->rows(from, j.base, j.ib);
    size_t row_out = 0;
    for (int f = 0; f < o->n; f++)
        row_out += scaled && f == s->scale_f ? j.ib[f] / loom_dtype_size(in->spec.dtype[f]) * sizeof(float) : j.ib[f];
    int64_t pos[256], i = 0;
    int rc = LOOM_OK;
    j.pos = pos;
    while (i < s->size) {
        int64_t want = s->size - i < 256 ? s->size - i : 256, got = 0, t0 = dnow_ns_();
        rc = in->ops->draw(in, pos, want, &got, err);
        __atomic_fetch_add(&in->st_busy_ns, dnow_ns_() - t0, __ATOMIC_RELAXED);
        __atomic_fetch_add(&in->st_elements, got, __ATOMIC_RELAXED);
        if (from != in) __atomic_fetch_add(&from->st_elements, got, __ATOMIC_RELAXED);
        j.i = i;
        j.got = got;
        j.parts = 1;
        if (s->pool && (size_t)got * row_out >= GATHER_SPLIT_BYTES) { /* parts of >= 16 KiB, up to 4 a thread */
            int64_t most = 4 * (int64_t)loom_pool_size(s->pool), by = (int64_t)((size_t)got * row_out / (16 << 10));
            j.parts = (int)(by < loom_pool_size(s->pool) ? loom_pool_size(s->pool) : by < most ? by : most);
        }
        if (j.parts > got) j.parts = (int)got;
        if (j.parts > 1) loom_pool_run(s->pool, j.parts, gather_part, &j);
        else gather_rows(&j, 0, got);
        i += got;
        if (rc || got < want) break;
    }
    if (rc) return rc;
    return dbatch_finish_(o, from->spec.shape, i, s->size, s->drop);
}

static const dstage_ops batch_ops;

/* A gathering batch stage, or NULL. */
static batchst *gather_stage(dstage *st)
{
    return st && st->ops == &batch_ops && ((batchst *)st)->gather ? (batchst *)st : NULL;
}

bool batch_is_gather_(dstage *st) { return gather_stage(st) != NULL; }

void batch_share_pool_(dstage *st, loom_pool *pool)
{
    batchst *s = gather_stage(st);
    LOOM_ASSERT(s);
    s->pool = pool;
}

/* map(scale) of feature f (sc, off) fused into st, a gathering batch stage
 * (map_open_, for a scale opened right on it): its next batch for the map
 * comes from batch_next_scaled_, feature f written once, scaled, as float32. */
bool batch_fuse_scale_(dstage *st, int f, float sc, float off)
{
    batchst *s = gather_stage(st);
    if (!s || s->scale_f >= 0) return false;
    s->scale_f = f;
    s->sc = sc;
    s->off = off;
    snprintf(st->name, sizeof st->name, "batch(gather+scale)");
    return true;
}

/* The fused map's pull: the next batch into o (feature scale_f float32),
 * with the stats of dstage_next_into_. */
int batch_next_scaled_(dstage *st, loom_elem *o, loom_err *err)
{
    int64_t t0 = dnow_ns_();
    int rc = batch_gather((batchst *)st, o, 1, err);
    __atomic_fetch_add(&st->st_busy_ns, dnow_ns_() - t0, __ATOMIC_RELAXED);
    if (rc == LOOM_OK) __atomic_fetch_add(&st->st_elements, 1, __ATOMIC_RELAXED);
    return rc;
}

/* The next batch into o's buffers (sized for the max shapes); sets o's shapes. */
static int batch_into(dstage *st, loom_elem *o, loom_err *err)
{
    batchst *s = (batchst *)st;
    if (s->gather) return batch_gather(s, o, 0, err);
    loom_shape first[LOOM_MAX_FEATURES];
    size_t bytes[LOOM_MAX_FEATURES];
    int64_t i;
    for (i = 0; i < s->size; i++) {
        loom_elem *e;
        int rc = dstage_next_(st->in, &e, err);
        if (rc == LOOM_EEOF) break;
        if (rc) return rc;
        for (int f = 0; f < o->n; f++) {
            if (i == 0) {
                first[f] = e->t[f].shape;
                bytes[f] = loom_tensor_nbytes(&e->t[f]);
            } else if (!loom_shape_eq(&first[f], &e->t[f].shape)) {
                char a[128], b[128];
                return dstage_err_(st, err, LOOM_ESHAPE, "batch: feature \"%s\" has shape %s in element %lld of the batch but %s "
                                   "in its first element (a batch needs equal shapes)", st->spec.name[f],
                                   loom_shape_str(&e->t[f].shape, a, sizeof a), (long long)i, loom_shape_str(&first[f], b, sizeof b));
            }
            memcpy((uint8_t *)o->t[f].data + (size_t)i * bytes[f], e->t[f].data, bytes[f]);
        }
    }
    return dbatch_finish_(o, first, i, s->size, s->drop);
}

static int batch_next(dstage *st, loom_elem **out, loom_err *err)
{
    int rc = batch_into(st, &st->out, err);
    if (rc == LOOM_OK) *out = &st->out;
    return rc;
}

static void batch_close(dstage *st)
{
    for (int f = 0; f < st->out.n; f++) loom_tensor_fini(&st->out.t[f]);
    loom_free(st);
}

static const dstage_ops batch_ops = {
    .next = batch_next, .rewind = dstage_pass_rewind_, .save = dstage_no_save_, .restore = dstage_no_restore_,
    .close = batch_close, .next_into = batch_into,
};

int batch_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err)
{
    batchst *s = loom_calloc(1, sizeof *s);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a batch stage");
    dstage *st = &s->s;
    dstage_init_(st, &batch_ops, in, id, &t->loc);
    snprintf(st->name, sizeof st->name, "batch");
    s->size = t->batch_size;
    s->drop = t->drop_remainder;
    s->scale_f = -1;
    snprintf(st->desc, sizeof st->desc, "batch(%lld,%d)", (long long)s->size, s->drop);
    if ((s->gather = batch_can_gather(in))) snprintf(st->name, sizeof st->name, "batch(gather)"); /* the desc, and so the state, stay */
    int rc = LOOM_OK;
    if (s->size < 1) {
        rc = dstage_err_(st, err, LOOM_ECONFIG, "batch: size must be >= 1, got %lld", (long long)s->size);
        goto fail;
    }
    int64_t d0;
    st->card = dbatch_card_(in->card, s->size, s->drop, &d0);
    st->batch_dims = in->batch_dims + 1;
    st->out.n = st->spec.n;
    for (int f = 0; f < st->spec.n; f++) {
        if ((rc = dbatch_feature_(st, f, d0, s->size, "batch", err))) goto fail;
        __atomic_fetch_add(&st->st_bytes, (int64_t)loom_tensor_nbytes(&st->out.t[f]), __ATOMIC_RELAXED);
    }
    *out = st;
    return LOOM_OK;
fail:
    batch_close(st);
    return rc;
}


int64_t dbatch_card_(int64_t c, int64_t size, bool drop, int64_t *dim0)
{
    /* a short last batch is possible unless dropped, or the pass is infinite, or it divides evenly */
    *dim0 = drop || c == -1 || (c >= 0 && c % size == 0) ? size : -1;
    return c < 0 ? c : drop ? c / size : (c + size - 1) / size;
}

int dbatch_feature_(dstage *st, int f, int64_t dim0, int64_t size, const char *what, loom_err *err)
{
    loom_shape *sh = &st->spec.shape[f], *mx = &st->maxshape[f];
    if (sh->rank >= LOOM_MAX_RANK)
        return dstage_err_(st, err, LOOM_ESHAPE, "%s: feature \"%s\" already has rank %d", what, st->spec.name[f],
                           sh->rank);
    memmove(sh->dim + 1, sh->dim, (size_t)sh->rank * sizeof sh->dim[0]);
    memmove(mx->dim + 1, mx->dim, (size_t)mx->rank * sizeof mx->dim[0]);
    sh->rank++;
    mx->rank++;
    sh->dim[0] = dim0;
    mx->dim[0] = size;
    st->mut[f] = 1; /* refilled by every batch */
    /* a batch that cannot fit in memory (or whose size overflows) is the config's error, found at open */
    int64_t bytes = 0, phys = loom_phys_bytes();
    bool fits = loom_dims_ok(mx->dim, mx->rank, &bytes) &&
                loom_mul_ok(bytes, (int64_t)loom_dtype_size(st->spec.dtype[f]), &bytes);
    if (!fits || bytes > phys) {
        char a[96], b[48];
        snprintf(b, sizeof b, fits ? "%lld bytes" : "more than 2^63 bytes", (long long)bytes);
        dstage_err_(st, err, LOOM_ECONFIG, "%s: a batch of %lld elements of feature \"%s\", %s %s, takes %s, more "
                    "than this machine's %lld bytes of memory", what, (long long)size, st->spec.name[f],
                    loom_shape_str(mx, a, sizeof a), loom_dtype_name(st->spec.dtype[f]), b, (long long)phys);
        return loom_err_hint(err, "use a smaller batch size");
    }
    return loom_tensor_init(&st->out.t[f], st->spec.dtype[f], mx, err);
}
