/* elem.c - element specs, the stage plumbing shared by every iterator (stats,
 * located errors) and slot pools: preallocated per-feature arrays that hold
 * copies of elements for shuffle and prefetch without a malloc per element. */
#include "data/data_internal.h"

#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

int loom_elem_spec_find(const loom_elem_spec *s, const char *name)
{
    for (int i = 0; i < s->n; i++)
        if (!strcmp(s->name[i], name)) return i;
    return -1;
}

char *loom_elem_spec_str(const loom_elem_spec *s, char *buf, size_t n)
{
    size_t k = 0;
    if (n) buf[0] = 0;
    for (int i = 0; i < s->n && k < n; i++) {
        char sh[128];
        int w = snprintf(buf + k, n - k, "%s%s: %s %s", i ? "; " : "", s->name[i], loom_dtype_name(s->dtype[i]),
                         loom_shape_str(&s->shape[i], sh, sizeof sh));
        if (w < 0) break;
        k += (size_t)w;
    }
    return buf;
}

/* ---- stage plumbing ------------------------------------------------------- */

static int64_t mono_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* The stage timers run around every next() call of every stage (six clock
 * reads an element in a source -> map -> shuffle -> batch pipeline), where
 * clock_gettime took ~60 ns on a KVM guest and the time-stamp counter ~25.
 * With an invariant TSC (CPUID 0x80000007 EDX bit 8: constant rate, never
 * stopped) a thread reads the TSC and turns ticks into CLOCK_MONOTONIC
 * nanoseconds by a line anchored at its last CLOCK_MONOTONIC read: the
 * anchor is renewed once it is 1 ms old (its slope from the two anchors, at
 * least 200 us apart), so an interpolated value is within a few ns of
 * CLOCK_MONOTONIC's and the figures `loom profile` prints are the same sums
 * of per-call times as before. Per thread, never decreasing; the stats only
 * take differences of readings of one thread. Elsewhere: CLOCK_MONOTONIC. */
#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>

/* core's CPUID probe, kept in a plain static: this runs six times an element */
static int tsc_invariant(void)
{
    static int ok = -1; /* -1 unknown; a benign race: every thread stores the same */
    int v = __atomic_load_n(&ok, __ATOMIC_RELAXED);
    if (v < 0) {
        v = loom_cpu_probe()->tsc_invariant;
        __atomic_store_n(&ok, v, __ATOMIC_RELAXED);
    }
    return v;
}

typedef struct tsc_line {
    uint64_t tsc;    /* anchor: a TSC reading ... */
    int64_t  ns;     /* ... and CLOCK_MONOTONIC right before it */
    double   ns_per; /* slope; 0 until two anchors 200 us apart */
    uint64_t span;   /* ticks after the anchor the line is used for (~1 ms) */
    int64_t  last;   /* the last value returned */
} tsc_line;
static __thread tsc_line tline;

int64_t dnow_ns_(void)
{
    if (!tsc_invariant()) return mono_ns();
    tsc_line *l = &tline;
    uint64_t d = __rdtsc() - l->tsc;
    int64_t v;
    if (l->ns_per > 0 && d < l->span) {
        v = l->ns + (int64_t)((double)d * l->ns_per);
    } else {
        v = mono_ns();
        uint64_t t = __rdtsc();
        if (l->tsc == 0 || v - l->ns >= 200000) { /* re-anchor, with the slope since the last anchor */
            if (l->tsc && t > l->tsc) {
                l->ns_per = (double)(v - l->ns) / (double)(t - l->tsc);
                l->span = (uint64_t)(1e6 / l->ns_per);
            }
            l->tsc = t;
            l->ns = v;
        }
    }
    if (v < l->last) v = l->last;
    l->last = v;
    return v;
}
#else
int64_t dnow_ns_(void) { return mono_ns(); }
#endif

void dstage_gauge_(int64_t *field, int64_t v) { __atomic_store_n(field, v, __ATOMIC_RELAXED); }
int64_t dstage_load_(const int64_t *field) { return __atomic_load_n(field, __ATOMIC_RELAXED); }

int dstage_next_(dstage *s, loom_elem **out, loom_err *err)
{
    int64_t t0 = dnow_ns_();
    int rc = s->ops->next(s, out, err);
    __atomic_fetch_add(&s->st_busy_ns, dnow_ns_() - t0, __ATOMIC_RELAXED);
    if (rc == LOOM_OK) __atomic_fetch_add(&s->st_elements, 1, __ATOMIC_RELAXED);
    return rc;
}

int dstage_next_into_(dstage *s, loom_elem *dst, loom_err *err)
{
    int64_t t0 = dnow_ns_();
    int rc = s->ops->next_into(s, dst, err);
    __atomic_fetch_add(&s->st_busy_ns, dnow_ns_() - t0, __ATOMIC_RELAXED);
    if (rc == LOOM_OK) __atomic_fetch_add(&s->st_elements, 1, __ATOMIC_RELAXED);
    return rc;
}

int dstage_get_(dstage *s, int64_t index, loom_elem **out, loom_err *err)
{
    int64_t t0 = dnow_ns_();
    int rc = s->ops->get(s, index, out, err);
    __atomic_fetch_add(&s->st_busy_ns, dnow_ns_() - t0, __ATOMIC_RELAXED);
    if (rc == LOOM_OK) __atomic_fetch_add(&s->st_elements, 1, __ATOMIC_RELAXED);
    return rc;
}

void dstage_init_(dstage *s, const dstage_ops *ops, dstage *in, int id, const loom_loc *loc)
{
    s->ops = ops;
    s->in = in;
    s->id = id;
    if (loc && loc->file[0]) {
        if (loc->line > 0)
            snprintf(s->where, sizeof s->where, "%s:%d", loc->file, loc->line);
        else
            snprintf(s->where, sizeof s->where, "%s", loc->file);
    }
    if (loc) snprintf(s->path, sizeof s->path, "%s", loc->path);
    if (in) {
        s->spec = in->spec;
        memcpy(s->maxshape, in->maxshape, sizeof s->maxshape);
        s->batch_dims = in->batch_dims;
        s->card = in->card;
    }
}

int dstage_pass_rewind_(dstage *s, int64_t epoch, loom_err *err) { return s->in->ops->rewind(s->in, epoch, err); }
void dstage_no_save_(dstage *s, loom_buf *b) { (void)s; (void)b; }
int dstage_no_restore_(dstage *s, loom_buf *b, loom_err *err) { (void)s; (void)b; (void)err; return LOOM_OK; }
void dstage_free_(dstage *s) { loom_free(s); }

int dcursor_rewind_(dstage *s, int64_t *epoch, int64_t *pos, int64_t to, loom_err *err)
{
    *epoch = to;
    *pos = 0;
    return s->in ? s->in->ops->rewind(s->in, to, err) : LOOM_OK;
}

void dcursor_save_(loom_buf *b, int64_t epoch, int64_t pos)
{
    loom_buf_put_i64(b, epoch);
    loom_buf_put_i64(b, pos);
}

bool dcursor_load_(loom_buf *b, int64_t *epoch, int64_t *pos)
{
    *epoch = loom_buf_get_i64(b);
    *pos = loom_buf_get_i64(b);
    return !b->failed;
}

int dbatch_finish_(loom_elem *o, const loom_shape *first, int64_t n, int64_t size, int drop)
{
    if (n == 0 || (n < size && drop)) return LOOM_EEOF;
    for (int f = 0; f < o->n; f++) {
        o->t[f].shape.rank = first[f].rank + 1;
        o->t[f].shape.dim[0] = n;
        for (int d = 0; d < first[f].rank; d++) o->t[f].shape.dim[d + 1] = first[f].dim[d];
    }
    return LOOM_OK;
}

int dcursor_stage_rewind_(dstage *st, int64_t epoch, loom_err *err)
{
    dcursor_stage *c = (dcursor_stage *)st;
    return dcursor_rewind_(st, &c->epoch, &c->pos, epoch, err);
}

void dcursor_stage_save_(dstage *st, loom_buf *b)
{
    const dcursor_stage *c = (const dcursor_stage *)st;
    dcursor_save_(b, c->epoch, c->pos);
}

int dcursor_stage_restore_(dstage *st, loom_buf *b, loom_err *err)
{
    dcursor_stage *c = (dcursor_stage *)st;
    if (!dcursor_load_(b, &c->epoch, &c->pos) || c->pos < 0)
        return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "iterator state is corrupt (%s)", st->name);
    return LOOM_OK;
}

int dstage_err_(const dstage *s, loom_err *err, int code, const char *fmt, ...)
{
    char msg[sizeof err->msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (s->path[0]) return loom_err_set(err, code, s->where, "%s: %s", s->path, msg);
    return loom_err_set(err, code, s->where, "%s", msg);
}

/* ---- slot pools ----------------------------------------------------------- */

int elem_pool_init_(elem_pool *p, const dstage *s, int64_t cap, loom_err *err)
{
    memset(p, 0, sizeof *p);
    p->nf = s->spec.n;
    for (int f = 0; f < p->nf; f++) {
        p->dtype[f] = s->spec.dtype[f];
        p->slot_bytes[f] = (size_t)loom_shape_numel(&s->maxshape[f]) * loom_dtype_size(p->dtype[f]);
        for (int d = 0; d < s->spec.shape[f].rank; d++)
            if (s->spec.shape[f].dim[d] < 0) p->varshape = 1;
    }
    /* a stats gauge (atomic), not the stage's state: fine to update through a const stage */
    p->bytes_gauge = (int64_t *)&s->st_bytes;
    if (!p->varshape) {
        p->shape = loom_calloc((size_t)(p->nf ? p->nf : 1), sizeof *p->shape);
        if (!p->shape) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate an element pool");
        for (int f = 0; f < p->nf; f++) p->shape[f] = s->spec.shape[f];
    }
    return elem_pool_grow_(p, cap, err);
}

void elem_pool_own_(elem_pool *p, dstage *owner)
{
    int64_t held = 0;
    for (int f = 0; f < p->nf; f++) held += (int64_t)((size_t)p->cap * p->slot_bytes[f]);
    if (p->bytes_gauge) __atomic_fetch_sub(p->bytes_gauge, held, __ATOMIC_RELAXED);
    p->bytes_gauge = &owner->st_bytes;
    __atomic_fetch_add(p->bytes_gauge, held, __ATOMIC_RELAXED);
}

/* Large buffers: transparent huge pages where the kernel offers them on
 * request (enabled = madvise), so filling 30 MB of shuffle buffer takes ~15
 * page faults instead of ~7,500, and freeing it is cheaper too. Advice only:
 * any failure is ignored. */
static void advise_huge(void *d, size_t bytes)
{
#ifdef MADV_HUGEPAGE
    const uintptr_t pg = 4096;
    uintptr_t a = ((uintptr_t)d + pg - 1) & ~(pg - 1), b = ((uintptr_t)d + bytes) & ~(pg - 1);
    if (bytes >= ((size_t)4 << 20) && b > a) (void)madvise((void *)a, b - a, MADV_HUGEPAGE);
#else
    (void)d, (void)bytes;
#endif
}

int elem_pool_reserve_(elem_pool *p, int64_t max, loom_err *err)
{
    if (p->varshape || max <= p->reserved || max <= p->cap) return LOOM_OK;
    for (int f = 0; f < p->nf; f++) {
        size_t bytes = (size_t)max * p->slot_bytes[f];
        uint8_t *d = loom_alloc_aligned(bytes ? bytes : 1);
        if (!d) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate %zu bytes for %lld buffered elements", bytes,
                                    (long long)max);
        advise_huge(d, bytes);
        if (p->data[f]) memcpy(d, p->data[f], (size_t)p->cap * p->slot_bytes[f]);
        loom_free(p->data[f]);
        p->data[f] = d;
    }
    p->reserved = max;
    return LOOM_OK;
}

int elem_pool_grow_(elem_pool *p, int64_t cap, loom_err *err)
{
    if (cap <= p->cap) return LOOM_OK;
    if (cap <= p->reserved) { /* the room is there: no copy */
        for (int f = 0; f < p->nf && p->bytes_gauge; f++)
            __atomic_fetch_add(p->bytes_gauge, (int64_t)((size_t)(cap - p->cap) * p->slot_bytes[f]), __ATOMIC_RELAXED);
        p->cap = cap;
        return LOOM_OK;
    }
    for (int f = 0; f < p->nf; f++) {
        size_t bytes = (size_t)cap * p->slot_bytes[f];
        uint8_t *d = loom_alloc_aligned(bytes ? bytes : 1);
        if (!d) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate %zu bytes for %lld buffered elements", bytes,
                                    (long long)cap);
        if (p->data[f]) memcpy(d, p->data[f], (size_t)p->cap * p->slot_bytes[f]);
        loom_free(p->data[f]);
        p->data[f] = d;
        advise_huge(d, bytes);
        if (p->bytes_gauge)
            __atomic_fetch_add(p->bytes_gauge, (int64_t)((size_t)(cap - p->cap) * p->slot_bytes[f]), __ATOMIC_RELAXED);
    }
    if (p->varshape) {
        loom_shape *sh = loom_realloc(p->shape, (size_t)cap * (size_t)p->nf * sizeof *sh);
        if (!sh) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate shapes for %lld elements", (long long)cap);
        p->shape = sh;
    }
    p->cap = cap;
    return LOOM_OK;
}

void elem_pool_fini_(elem_pool *p)
{
    for (int f = 0; f < p->nf; f++) loom_free(p->data[f]);
    loom_free(p->shape);
    memset(p, 0, sizeof *p);
}

static loom_shape *slot_shape(const elem_pool *p, int64_t i, int f)
{
    return p->varshape ? &p->shape[i * p->nf + f] : &p->shape[f];
}

int elem_pool_put_(elem_pool *p, int64_t i, const loom_elem *e, loom_err *err)
{
    for (int f = 0; f < p->nf; f++) {
        size_t n = loom_tensor_nbytes(&e->t[f]);
        if (n > p->slot_bytes[f] || e->t[f].dtype != p->dtype[f] ||
            (!p->varshape && !loom_shape_eq(&e->t[f].shape, &p->shape[f]))) {
            char a[128];
            return loom_err_set(err, LOOM_ESHAPE, NULL, "element feature %d has shape %s (%zu bytes), larger than the %zu bytes expected",
                                f, loom_shape_str(&e->t[f].shape, a, sizeof a), n, p->slot_bytes[f]);
        }
        if (n) memcpy(p->data[f] + (size_t)i * p->slot_bytes[f], e->t[f].data, n); /* a 0-size tensor may have no data */
        if (p->varshape) *slot_shape(p, i, f) = e->t[f].shape;
    }
    return LOOM_OK;
}

void elem_pool_view_(const elem_pool *p, int64_t i, loom_elem *e)
{
    e->n = p->nf;
    for (int f = 0; f < p->nf; f++) {
        e->t[f].dtype = p->dtype[f];
        e->t[f].shape = *slot_shape(p, i, f);
        e->t[f].data = p->data[f] + (size_t)i * p->slot_bytes[f];
        e->t[f].owns = 0;
    }
}

void elem_pool_save_(const elem_pool *p, int64_t i, loom_buf *b)
{
    for (int f = 0; f < p->nf; f++) {
        const loom_shape *sh = slot_shape(p, i, f);
        loom_buf_put_u32(b, (uint32_t)sh->rank);
        for (int d = 0; d < sh->rank; d++) loom_buf_put_i64(b, sh->dim[d]);
        loom_buf_put(b, p->data[f] + (size_t)i * p->slot_bytes[f],
                     (size_t)loom_shape_numel(sh) * loom_dtype_size(p->dtype[f]));
    }
}

int elem_pool_load_(elem_pool *p, int64_t i, loom_buf *b, loom_err *err)
{
    for (int f = 0; f < p->nf; f++) {
        loom_shape sh = {0};
        sh.rank = (int)loom_buf_get_u32(b);
        if (b->failed || sh.rank < 0 || sh.rank > LOOM_MAX_RANK) goto bad;
        for (int d = 0; d < sh.rank; d++) {
            sh.dim[d] = loom_buf_get_i64(b);
            if (sh.dim[d] < 0) goto bad;
        }
        int64_t nb;
        if (!loom_dims_ok(sh.dim, sh.rank, &nb) || !loom_mul_ok(nb, (int64_t)loom_dtype_size(p->dtype[f]), &nb)) goto bad;
        size_t n = (size_t)nb;
        if (n > p->slot_bytes[f] || (!p->varshape && !loom_shape_eq(&sh, &p->shape[f]))) goto bad;
        const void *src = loom_buf_take(b, n);
        if (!src) goto bad;
        if (n) memcpy(p->data[f] + (size_t)i * p->slot_bytes[f], src, n);
        if (p->varshape) *slot_shape(p, i, f) = sh;
    }
    return LOOM_OK;
bad:
    return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "iterator state is corrupt: a buffered element does not fit the pipeline");
}
