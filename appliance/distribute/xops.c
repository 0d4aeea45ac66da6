/* xops.c - the built-in cross-device ops (reduce_to_one_device,
 * hierarchical_copy, ring), the communicator that runs any registered op
 * collectively from n threads (loom_xcomm), and the choice behind "auto".
 *
 * Two ways in. The N-buffer entry points get every buffer from one thread and
 * run on it. The per-rank collectives are called by each of n ranks from its
 * own thread and split the work among them. Both run the same arithmetic in
 * the same order, so for one op they give the same bits, on every rank, on
 * every run. Different ops sum in different orders and may differ from each
 * other in the last bits (for n = 2 they agree: a + b == b + a).
 *
 * Waiting never burns a core: a rank polls briefly, only while every rank has
 * a core of its own, then sleeps on a futex until the rank it waits for posts.
 * Every per-rank collective checks at its rendezvous that the ranks agree on
 * what they called (see "the ranks agree" below), and a rank that sleeps
 * wakes now and then to look at what the others are in (see "the watch"). */
#include "distribute.h"
#include "xops_internal.h"

#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define XOPS_CHUNK 16384 /* floats per pipelined chunk (64 KiB): a chunk's three streams stay in L2 */
#define XOPS_SPIN  256   /* polls before sleeping (~10 us), only when the ranks fit on the cores */
#define XOPS_LOOK  0.25  /* s: a sleeping rank looks at the others at least this often */
#define XOPS_BROKEN (-1) /* internal: a wait gave up because the communicator broke (see the watch) */

/* ---- waiting: poll briefly, then sleep on a futex ------------------------ */

/* A counter that only grows (modulo 2^32); waiters sleep until it reaches a target. */
typedef struct xsig {
    _Atomic uint32_t v;
    _Atomic uint32_t sleepers;
    char             pad[56]; /* one cache line per counter: ranks post to their own */
} xsig;

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static inline int reached(uint32_t v, uint32_t target) { return (int32_t)(v - target) >= 0; }

/* The seq_cst store of v and load of sleepers pair with sig_wait's increment of
 * sleepers and load of v: either the waiter sees the new value or we see it. */
static void sig_post(xsig *s, uint32_t v)
{
    atomic_store(&s->v, v);
    if (atomic_load(&s->sleepers)) syscall(SYS_futex, &s->v, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

typedef struct xstate xstate;
static int sig_sleep(xstate *st, int r, int whom, xsig *s, uint32_t target);

/* Rank r waits until s reaches target; whom is the rank that posts it, or
 * -1 for a barrier. LOOM_OK, or XOPS_BROKEN when the communicator broke
 * while it slept (the watch). The poll is all a prompt wait costs. */
static inline int sig_wait(xstate *st, int r, int whom, xsig *s, uint32_t target, int spin)
{
    for (int i = 0; i < spin; i++) {
        if (reached(atomic_load_explicit(&s->v, memory_order_acquire), target)) return LOOM_OK;
        cpu_relax();
    }
    return sig_sleep(st, r, whom, s, target);
}

/* A reusable barrier of n ranks. */
typedef struct xbar {
    _Atomic int arrived;
    xsig        gen;
} xbar;

/* Returns when all n ranks have arrived. The last to arrive first runs
 * last(arg) (may be NULL), whose effects every rank then sees. */
static int bar_sync(xstate *st, int r, xbar *b, int n, int spin, void (*last)(void *), void *arg)
{
    uint32_t g = atomic_load(&b->gen.v);
    if (atomic_fetch_add(&b->arrived, 1) + 1 == n) {
        atomic_store(&b->arrived, 0);
        if (last) last(arg);
        sig_post(&b->gen, g + 1);
        return LOOM_OK;
    }
    return sig_wait(st, r, -1, &b->gen, g + 1, spin);
}

/* ---- the state n ranks share --------------------------------------------- */

/* The per-rank collectives, as a rank names what it calls (the first three
 * are also generic_rank's). */
typedef enum { XC_ALL_REDUCE, XC_BROADCAST, XC_ALL_GATHER, XC_REDUCE_SCATTER, XC_ALL_GATHER_SHARDS, XC_UPDATE } xkind;

/* What a rank asked for in a collective. */
typedef struct xcall {
    int64_t count;
    int32_t kind; /* xkind */
    int32_t arg;  /* the reduce op, or the broadcast's root; else 0 */
} xcall;

typedef struct xwatch xwatch;

struct xstate {
    int       n, spin;
    const char *name; /* the op's, for messages (may be NULL) */
    xwatch   *w;      /* the communicator's watch, set once it opens */
    xbar      bar;
    float   **bufs;   /* (n,) each rank's buffer in the current collective */
    float   **outs;   /* (n,) each rank's all_gather output */
    xsig     *done;   /* ring: (n,) items each rank has completed, over all calls */
    uint32_t *base;   /* ring: (n,) rank r's own count of items before this call */
    xcall    *calls;  /* (2, n) what each rank asked for, in the slot of its call number's parity */
    uint32_t *seq;    /* (n,) rank r's own count of its calls */
};

static void xstate_free(void *p)
{
    xstate *s = p;
    if (!s) return;
    loom_free(s->bufs);
    loom_free(s->outs);
    loom_free(s->done);
    loom_free(s->base);
    loom_free(s->calls);
    loom_free(s->seq);
    loom_free(s);
}

static void *xstate_new(int n, loom_err *err)
{
    xstate *s = loom_calloc(1, sizeof *s);
    if (s) {
        s->n = n;
        s->spin = n <= loom_num_cores() ? XOPS_SPIN : 0; /* more ranks than cores: sleep at once */
        s->bufs = loom_calloc((size_t)n, sizeof *s->bufs);
        s->outs = loom_calloc((size_t)n, sizeof *s->outs);
        s->done = loom_alloc_aligned((size_t)n * sizeof *s->done);
        s->base = loom_calloc((size_t)n, sizeof *s->base);
        s->calls = loom_calloc(2 * (size_t)n, sizeof *s->calls);
        s->seq = loom_calloc((size_t)n, sizeof *s->seq);
    }
    if (!s || !s->bufs || !s->outs || !s->done || !s->base || !s->calls || !s->seq) {
        xstate_free(s);
        loom_err_set(err, LOOM_ENOMEM, NULL, "allocating a communicator of %d ranks", n);
        return NULL;
    }
    memset(s->done, 0, (size_t)n * sizeof *s->done);
    return s;
}

static int bar(xstate *s, int r) { return bar_sync(s, r, &s->bar, s->n, s->spin, NULL, NULL); }

/* What a rank is in: written only by that rank, on entry to and return from
 * each public collective (a few stores into a line of its own), read by the
 * others only once they have slept, so a prompt call moves no shared line. */
typedef struct xslot {
    alignas(64) _Atomic uint64_t seq; /* calls entered: the one it is in, or the last one */
    _Atomic uint64_t left;            /* calls returned from (== seq: between calls) */
    _Atomic int64_t  count;           /* of call seq */
    _Atomic int32_t  kind;            /* xkind of call seq */
} xslot;

/* The communicator's watch over its waits (see "the watch" below). */
struct xwatch {
    int         n;
    const char *name;                /* the op's */
    xslot      *slots;               /* (n,) */
    uint8_t     lane[XC_UPDATE + 1]; /* by xkind: where the collective starts, 0 gen's rendezvous, 1 the op's */
    double      warn_s, fail_s;      /* stall threshold and hard timeout, s; 0 = none */
    xstate     *states[2];           /* gen, and the op's when it is ours: woken when the communicator breaks */
    _Atomic int broken;              /* 0, or the LOOM_E* code of the error that broke it */
    pthread_mutex_t lock;            /* guards why while it is written */
    loom_err    why;                 /* that error, complete once broken is set */
};

/* ---- the ranks agree --------------------------------------------------------
 * A rank that called another collective, or passed another count, op or
 * root, would make the others read or write past its buffer, or wait for
 * steps that never come. So each rank publishes what it asked for (16 bytes)
 * before the rendezvous its collective has anyway, and after it every rank
 * compares all n: on a mismatch every rank returns LOOM_EUSAGE with the same
 * message before touching another's buffer, and the ranks stay in step for
 * the next call. The ring has no closing barrier, so a rank may already be
 * in its next call when another compares: each rank has two slots, used by
 * the parity of its call number. */

static const char *const xkind_names[] = {"all_reduce", "broadcast", "all_gather", "reduce_scatter",
                                          "all_gather_shards", "update"};

/* The n slots of the call rank r is in. */
static xcall *calls_of(const xstate *s, int r) { return s->calls + (size_t)(s->seq[r] & 1) * (size_t)s->n; }

/* The kind compared is the public collective rank r is in (its slot), so a
 * sharded update that runs as an all-reduce and a gather never matches a
 * plain all-reduce or gather. */
static void call_publish(xstate *s, int r, xkind kind, int64_t count, int arg)
{
    if (s->w) kind = (xkind)atomic_load_explicit(&s->w->slots[r].kind, memory_order_relaxed);
    calls_of(s, r)[r] = (xcall){count, (int32_t)kind, (int32_t)arg};
}

static const char *redop_str(int op)
{
    return op == LOOM_REDUCE_SUM ? "SUM" : op == LOOM_REDUCE_MEAN ? "MEAN" : op == LOOM_REDUCE_MAX ? "MAX" : "?";
}

/* LOOM_OK when the n calls c[] are the same; else LOOM_EUSAGE naming the
 * collective and the first rank that differs from rank 0. */
static int calls_agree(const xstate *s, const xcall *c, loom_err *err)
{
    int n = s->n, k = 1;
    while (k < n && c[k].kind == c[0].kind && c[k].count == c[0].count && c[k].arg == c[0].arg) k++;
    if (k == n) return LOOM_OK;
    const char *what = xkind_names[c[0].kind];
    if (c[k].kind != c[0].kind) {
        loom_err_set(err, LOOM_EUSAGE, s->name, "the ranks called different collectives: rank 0 loom_xcomm_%s, "
                     "rank %d loom_xcomm_%s", what, k, xkind_names[c[k].kind]);
    } else if (c[k].count != c[0].count) {
        char by_rank[200];
        size_t len = 0;
        for (int r = 0; r < n && len < sizeof by_rank; r++)
            len += (size_t)snprintf(by_rank + len, sizeof by_rank - len, "%s%lld", r ? ", " : "",
                                    (long long)c[r].count);
        loom_err_set(err, LOOM_EUSAGE, s->name, "loom_xcomm_%s: the ranks passed different counts: rank 0 %lld "
                     "floats, rank %d %lld (by rank: %s)", what, (long long)c[0].count, k, (long long)c[k].count,
                     by_rank);
    } else if (c[0].kind == XC_BROADCAST) {
        loom_err_set(err, LOOM_EUSAGE, s->name, "loom_xcomm_broadcast: the ranks named different roots: rank 0 "
                     "root %d, rank %d root %d", c[0].arg, k, c[k].arg);
    } else {
        loom_err_set(err, LOOM_EUSAGE, s->name, "loom_xcomm_%s: the ranks asked for different reductions: rank 0 "
                     "%s, rank %d %s", what, redop_str(c[0].arg), k, redop_str(c[k].arg));
    }
    loom_err_hint(err, "every rank must call the same collectives in the same order, with the same count, op and "
                  "root; nothing was reduced or copied between the ranks, and they may go on with the next call");
    return LOOM_EUSAGE;
}

/* After the rendezvous: whether every rank asked for what rank r did. Moves
 * rank r on to its next call. */
static int call_check(xstate *s, int r, loom_err *err)
{
    int rc = calls_agree(s, calls_of(s, r), err);
    s->seq[r]++;
    return rc;
}

/* The start of a collective whose rendezvous is a barrier. */
static int bar_start(xstate *s, int r, xkind kind, int64_t count, int arg, loom_err *err)
{
    call_publish(s, r, kind, count, arg);
    int rc = bar(s, r);
    return rc ? rc : call_check(s, r, err);
}

/* ---- the watch ----------------------------------------------------------------
 * Collectives that start at different rendezvous (the op's state and the
 * generic one: all_gather_shards against all_reduce, say) never meet, and a
 * rank that never arrives leaves the others waiting. So each rank publishes
 * in its slot which collective it is in and its call number, and a rank that
 * sleeps wakes at least every XOPS_LOOK s and looks:
 *   - a rank in the same call number but in a collective that starts at the
 *     other rendezvous: the communicator breaks with LOOM_EUSAGE naming both
 *     (a collective that starts at the same one is caught there, cleanly);
 *   - after warn_s of waiting, and every warn_s after: a stall report, logged;
 *   - after fail_s: the communicator breaks with LOOM_ETIMEOUT and the report.
 * Breaking records the error once, wakes every rank asleep in our states,
 * and each returns it; the communicator stays broken (every later call
 * returns the error at once): the ranks left it at different points, so no
 * count or barrier can be trusted to be in step. */

static uint64_t slot_load(_Atomic uint64_t *p) { return atomic_load_explicit(p, memory_order_acquire); }

/* Rank k's slot, consistently: the kind and count of call *seq. */
static void slot_read(const xwatch *w, int k, uint64_t *seq, uint64_t *left, xkind *kind, int64_t *count)
{
    xslot *sl = &w->slots[k];
    uint64_t a;
    do {
        a = slot_load(&sl->seq);
        *kind = (xkind)atomic_load_explicit(&sl->kind, memory_order_acquire);
        *count = atomic_load_explicit(&sl->count, memory_order_acquire);
        *left = slot_load(&sl->left);
    } while (a != slot_load(&sl->seq));
    *seq = a;
}

static void wake_all(xsig *s) { syscall(SYS_futex, &s->v, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0); }

/* Records e as what broke the communicator, unless something already did,
 * and wakes every sleeper. A timeout is also logged at once: the caller
 * that would print it may wait for a rank stuck outside the collective
 * (mirrored's step ends when every replica has returned). */
static int watch_break(xwatch *w, const loom_err *e)
{
    pthread_mutex_lock(&w->lock);
    if (!atomic_load_explicit(&w->broken, memory_order_relaxed)) {
        w->why = *e;
        atomic_store_explicit(&w->broken, e->code, memory_order_release);
        if (e->code == LOOM_ETIMEOUT) loom_warn("%s: %s; every waiting rank returns this error", w->name, e->msg);
    }
    pthread_mutex_unlock(&w->lock);
    for (int i = 0; i < 2; i++) {
        xstate *s = w->states[i];
        if (!s) continue;
        wake_all(&s->bar.gen);
        for (int k = 0; k < s->n; k++) wake_all(&s->done[k]);
    }
    return XOPS_BROKEN;
}

/* The stall report of rank r: what it waits in, for how long, and who is
 * ready (has entered its call) and who is missing (and what they are in). */
static void watch_report(const xwatch *w, int r, int whom, double waited, char *buf, size_t n)
{
    uint64_t q, left, sq;
    xkind kind, kk;
    int64_t count, kc;
    slot_read(w, r, &q, &left, &kind, &count);
    size_t len = (size_t)snprintf(buf, n, "rank %d has waited %.1f s in loom_xcomm_%s #%llu (%lld floats)", r, waited,
                                  xkind_names[kind], (unsigned long long)q, (long long)count);
    if (whom >= 0 && len < n) len += (size_t)snprintf(buf + len, n - len, " for rank %d", whom);
    for (int pass = 0; pass < 2; pass++) {
        int first = 1;
        for (int k = 0; k < w->n && len < n; k++) {
            slot_read(w, k, &sq, &left, &kk, &kc);
            if ((sq >= q) != (pass == 0)) continue;
            len += (size_t)snprintf(buf + len, n - len, "%s%s%d", first ? (pass ? "; missing: " : "; ready: ") : ", ",
                                    first ? "rank " : "", k);
            first = 0;
            if (pass && len < n) {
                if (!sq)
                    len += (size_t)snprintf(buf + len, n - len, " (has made no call)");
                else
                    len += (size_t)snprintf(buf + len, n - len, " (last entered %s %s #%llu, %s, and has not reached "
                                            "#%llu)", w->name, xkind_names[kk], (unsigned long long)sq,
                                            left == sq ? "returned from it" : "is still in it", (unsigned long long)q);
            }
        }
        if (!pass && first && len < n) len += (size_t)snprintf(buf + len, n - len, "; ready: none");
    }
}

/* A rank in rank r's call number whose collective starts at the other
 * rendezvous: break with LOOM_EUSAGE naming both. */
static int watch_look(xwatch *w, int r)
{
    uint64_t q, left, sq;
    xkind kind, kk;
    int64_t count, kc;
    slot_read(w, r, &q, &left, &kind, &count);
    for (int k = 0; k < w->n; k++) {
        slot_read(w, k, &sq, &left, &kk, &kc);
        if (sq != q || w->lane[kk] == w->lane[kind]) continue;
        int a = r < k ? r : k, b = r < k ? k : r;
        loom_err e;
        loom_err_clear(&e);
        loom_err_set(&e, LOOM_EUSAGE, w->name, "the ranks called different collectives at call #%llu: rank %d "
                     "loom_xcomm_%s, rank %d loom_xcomm_%s", (unsigned long long)q, a,
                     xkind_names[a == r ? kind : kk], b, xkind_names[b == r ? kind : kk]);
        loom_err_hint(&e, "every rank must call the same collectives in the same order; the communicator is broken "
                      "(every later call fails at once)");
        return watch_break(w, &e);
    }
    return LOOM_OK;
}

/* The slow path of sig_wait: sleep in timed futex waits, looking at the
 * others at the start and every XOPS_LOOK s, reporting a stall every warn_s
 * and giving up after fail_s. A state outside a communicator (an op's
 * comm_new called directly) has no watch and sleeps until posted. */
static __attribute__((noinline)) int sig_sleep(xstate *st, int r, int whom, xsig *s, uint32_t target)
{
    xwatch *w = st->w;
    int rc = LOOM_OK, started = 0;
    double t0 = 0, look = 0, warn = 0;
    atomic_fetch_add(&s->sleepers, 1);
    uint32_t v;
    while (!reached(v = atomic_load(&s->v), target)) {
        struct timespec ts, *tp = NULL;
        if (w) {
            if (atomic_load_explicit(&w->broken, memory_order_acquire)) {
                rc = XOPS_BROKEN;
                break;
            }
            double now = loom_now();
            if (!started) {
                started = 1;
                t0 = look = now;
                warn = now + w->warn_s;
            }
            if (now >= look) {
                if ((rc = watch_look(w, r))) break;
                look = now + XOPS_LOOK;
            }
            if (w->fail_s > 0 && now - t0 >= w->fail_s) {
                char rep[400];
                watch_report(w, r, whom, now - t0, rep, sizeof rep);
                loom_err e;
                loom_err_clear(&e);
                loom_err_set(&e, LOOM_ETIMEOUT, w->name, "collective timed out after %.1f s: %s", w->fail_s, rep);
                loom_err_hint(&e, "a rank is stuck elsewhere or calls other collectives; raise "
                              "strategy.collective_timeout if the wait is legitimate");
                rc = watch_break(w, &e);
                break;
            }
            if (w->warn_s > 0 && now >= warn) {
                char rep[400];
                watch_report(w, r, whom, now - t0, rep, sizeof rep);
                loom_warn("%s: collective stalled: %s", w->name, rep);
                warn += w->warn_s;
            }
            double until = look;
            if (w->warn_s > 0 && warn < until) until = warn;
            if (w->fail_s > 0 && t0 + w->fail_s < until) until = t0 + w->fail_s;
            double d = until - now > 1e-3 ? until - now : 1e-3;
            ts.tv_sec = (time_t)d;
            ts.tv_nsec = (long)((d - (double)ts.tv_sec) * 1e9);
            tp = &ts;
        }
        syscall(SYS_futex, &s->v, FUTEX_WAIT_PRIVATE, v, tp, NULL, 0); /* returns at once if v moved */
    }
    atomic_fetch_sub(&s->sleepers, 1);
    return rc;
}

/* ---- element-wise kernels ------------------------------------------------ */

/* dst op= src over m floats (SUM and MEAN add; MAX keeps the larger). */
static void combine(float *restrict dst, const float *restrict src, int64_t m, loom_redop op)
{
    if (op == LOOM_REDUCE_MAX)
        for (int64_t i = 0; i < m; i++) dst[i] = src[i] > dst[i] ? src[i] : dst[i];
    else
        for (int64_t i = 0; i < m; i++) dst[i] += src[i];
}

/* MEAN = SUM / n, divided (not multiplied by 1/n) so it matches the float64 reference's rounding. */
static void finish(float *dst, int64_t m, loom_redop op, int n)
{
    if (op != LOOM_REDUCE_MEAN) return;
    float d = (float)n;
    for (int64_t i = 0; i < m; i++) dst[i] /= d;
}

/* The ring's last reduce step: mine op= theirs, finished, written to both
 * (one pass; the same bits as combine, finish and copy). */
static void combine_both(float *restrict mine, float *restrict theirs, int64_t m, loom_redop op, int n)
{
    float d = (float)n;
    if (op == LOOM_REDUCE_MAX)
        for (int64_t i = 0; i < m; i++) mine[i] = theirs[i] = theirs[i] > mine[i] ? theirs[i] : mine[i];
    else if (op == LOOM_REDUCE_MEAN)
        for (int64_t i = 0; i < m; i++) mine[i] = theirs[i] = (mine[i] + theirs[i]) / d;
    else
        for (int64_t i = 0; i < m; i++) mine[i] = theirs[i] = mine[i] + theirs[i];
}

static void copy(float *dst, const float *src, int64_t m)
{
    if (m > 0 && dst != src) memcpy(dst, src, (size_t)m * sizeof *dst);
}

/* [lo, hi) of part j of [0, count) split k ways. */
static void split(int64_t count, int k, int j, int64_t *lo, int64_t *hi)
{
    *lo = count * j / k;
    *hi = count * (j + 1) / k;
}

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* The same on whole 16-float (64-byte) lines: an optimizer applied to the
 * parts then runs its vector loop over the same elements as over the whole
 * (a loop's scalar tail may round differently, with contracted multiply-adds). */
static void split_lines(int64_t count, int k, int j, int64_t *lo, int64_t *hi)
{
    int64_t lines = ceil_div(count, 16);
    *lo = lines * j / k * 16;
    *hi = lines * (j + 1) / k * 16;
    if (*lo > count) *lo = count;
    if (*hi > count) *hi = count;
}

/* ---- generic per-rank pieces: direct copies after a rendezvous ------------- */

static int copy_broadcast_rank(void *comm, int r, float *buf, int64_t count, int root, loom_err *err)
{
    xstate *s = comm;
    s->bufs[r] = buf;
    int rc = bar_start(s, r, XC_BROADCAST, count, root, err);
    if (rc) return rc;
    if (r != root) copy(buf, s->bufs[root], count);
    return bar(s, r); /* the root's buffer stays untouched until everyone has copied */
}

static int copy_all_gather_rank(void *comm, int r, const float *buf, int64_t count, float *out, loom_err *err)
{
    xstate *s = comm;
    s->bufs[r] = (float *)buf;
    int rc = bar_start(s, r, XC_ALL_GATHER, count, 0, err);
    if (rc) return rc;
    for (int k = 0; k < s->n; k++) copy(out + (int64_t)k * count, s->bufs[k], count);
    return bar(s, r);
}

static int copy_broadcast(float *const *bufs, int n, int64_t count, int root, loom_err *err)
{
    (void)err;
    for (int r = 0; r < n; r++)
        if (r != root) copy(bufs[r], bufs[root], count);
    return LOOM_OK;
}

static int copy_all_gather(float *const *bufs, int n, int64_t count, float *out, loom_err *err)
{
    (void)err;
    for (int k = 0; k < n; k++) copy(out + (int64_t)k * count, bufs[k], count);
    return LOOM_OK;
}

/* ---- reduce_to_one_device -------------------------------------------------
 * tf.distribute's ReductionToOneDevice: rank 0 sums every buffer in rank
 * order, ((b0 + b1) + b2) + ..., divides for MEAN, and the others copy the
 * result. */

static void rto_reduce(float *const *bufs, int n, int64_t count, loom_redop op)
{
    for (int r = 1; r < n; r++) combine(bufs[0], bufs[r], count, op);
    finish(bufs[0], count, op, n);
}

static int rto_all_reduce(float *const *bufs, int n, int64_t count, loom_redop op, loom_err *err)
{
    rto_reduce(bufs, n, count, op);
    return copy_broadcast(bufs, n, count, 0, err);
}

static int rto_all_reduce_rank(void *comm, int r, float *buf, int64_t count, loom_redop op, loom_err *err)
{
    xstate *s = comm;
    s->bufs[r] = buf;
    int rc = bar_start(s, r, XC_ALL_REDUCE, count, (int)op, err);
    if (rc) return rc;
    if (r == 0) rto_reduce(s->bufs, s->n, count, op);
    if ((rc = bar(s, r))) return rc;
    if (r != 0) copy(buf, s->bufs[0], count);
    return bar(s, r);
}

static const loom_cross_device_ops reduce_to_one_device = {
    .version = LOOM_CROSS_DEVICE_OPS_VERSION,
    .name = "reduce_to_one_device",
    .all_reduce = rto_all_reduce,
    .broadcast = copy_broadcast,
    .all_gather = copy_all_gather,
    .comm_new = xstate_new,
    .comm_free = xstate_free,
    .all_reduce_rank = rto_all_reduce_rank,
    .broadcast_rank = copy_broadcast_rank,
    .all_gather_rank = copy_all_gather_rank,
    .caps = LOOM_XOPS_HOST_MEM,
};

/* ---- hierarchical_copy ----------------------------------------------------
 * tf.distribute's HierarchicalCopyAllReduce (built for the two 4-GPU halves
 * of a DGX-1), on threads: the ranks form two groups, [0, h) and [h, n) with
 * h = ceil(n/2), each led by its first rank.
 *   A. each leader sums its group, in rank order;
 *   B. half p of the buffer is finished at leader p, which adds the other
 *      leader's half (and divides for MEAN);
 *   C. each leader copies the half it did not finish from the other leader,
 *      then the members copy the whole buffer from their leader.
 * Per rank, a group's members share each phase's work by slices. */

typedef struct hgeo {
    int g, lead, other, j, size; /* my group, its leader, the other leader, my index in it, its size */
} hgeo;

static hgeo hier_geo(int n, int r)
{
    int h = (n + 1) / 2;
    hgeo q;
    q.g = r >= h;
    q.lead = q.g ? h : 0;
    q.other = q.g ? 0 : h;
    q.j = r - q.lead;
    q.size = q.g ? n - h : h;
    return q;
}

static void hier_phase_a(float *const *bufs, int n, const hgeo *q, int64_t lo, int64_t hi, loom_redop op)
{
    (void)n;
    for (int m = q->lead + 1; m < q->lead + q->size; m++) combine(bufs[q->lead] + lo, bufs[m] + lo, hi - lo, op);
}

static int hier_all_reduce(float *const *bufs, int n, int64_t count, loom_redop op, loom_err *err)
{
    (void)err;
    if (n == 1) return LOOM_OK;
    hgeo q[2] = {hier_geo(n, 0), hier_geo(n, n - 1)};
    for (int g = 0; g < 2; g++) hier_phase_a(bufs, n, &q[g], 0, count, op);
    for (int g = 0; g < 2; g++) {
        int64_t lo, hi;
        split(count, 2, g, &lo, &hi);
        combine(bufs[q[g].lead] + lo, bufs[q[g].other] + lo, hi - lo, op);
        finish(bufs[q[g].lead] + lo, hi - lo, op, n);
    }
    for (int g = 0; g < 2; g++) {
        int64_t lo, hi;
        split(count, 2, 1 - g, &lo, &hi);
        copy(bufs[q[g].lead] + lo, bufs[q[g].other] + lo, hi - lo);
    }
    for (int r = 0; r < n; r++) {
        hgeo m = hier_geo(n, r);
        if (r != m.lead) copy(bufs[r], bufs[m.lead], count);
    }
    return LOOM_OK;
}

static int hier_all_reduce_rank(void *comm, int r, float *buf, int64_t count, loom_redop op, loom_err *err)
{
    xstate *s = comm;
    int n = s->n;
    if (n == 1) return LOOM_OK;
    hgeo q = hier_geo(n, r);
    int64_t lo, hi, hlo, hhi;
    s->bufs[r] = buf;
    int rc = bar_start(s, r, XC_ALL_REDUCE, count, (int)op, err);
    if (rc) return rc;
    split(count, q.size, q.j, &lo, &hi); /* A: my slice of the whole buffer */
    hier_phase_a(s->bufs, n, &q, lo, hi, op);
    if ((rc = bar(s, r))) return rc;
    split(count, 2, q.g, &hlo, &hhi); /* B: my slice of my group's half */
    split(hhi - hlo, q.size, q.j, &lo, &hi);
    combine(s->bufs[q.lead] + hlo + lo, s->bufs[q.other] + hlo + lo, hi - lo, op);
    finish(s->bufs[q.lead] + hlo + lo, hi - lo, op, n);
    if ((rc = bar(s, r))) return rc;
    split(count, 2, 1 - q.g, &hlo, &hhi); /* C: my slice of the other half, into my leader */
    split(hhi - hlo, q.size, q.j, &lo, &hi);
    copy(s->bufs[q.lead] + hlo + lo, s->bufs[q.other] + hlo + lo, hi - lo);
    if ((rc = bar(s, r))) return rc;
    if (r != q.lead) copy(buf, s->bufs[q.lead], count);
    return bar(s, r);
}

static const loom_cross_device_ops hierarchical_copy = {
    .version = LOOM_CROSS_DEVICE_OPS_VERSION,
    .name = "hierarchical_copy",
    .all_reduce = hier_all_reduce,
    .broadcast = copy_broadcast,
    .all_gather = copy_all_gather,
    .comm_new = xstate_new,
    .comm_free = xstate_free,
    .all_reduce_rank = hier_all_reduce_rank,
    .broadcast_rank = copy_broadcast_rank,
    .all_gather_rank = copy_all_gather_rank,
    .caps = LOOM_XOPS_HOST_MEM,
};

/* ---- ring -------------------------------------------------------------------
 * The bandwidth-optimal ring (as NCCL and Horovod run it), over buffers that
 * every thread can read. The buffer is cut into n segments, on 16-float
 * lines (split_lines: the shards of a sharded update), and each segment into
 * chunks of XOPS_CHUNK floats.
 *   reduce-scatter, steps s = 0..n-2: rank r adds segment (r-1-s) of rank
 *     r-1's buffer into its own, so segment k is summed in the fixed order
 *     b[k] + b[k+1] + ... around the ring and ends complete at rank k-1,
 *     which at that last step also writes it back into rank k-2's buffer
 *     (it has just read that chunk; no one reads it there again);
 *   all-gather, steps s = 0..n-3: rank r copies segment (r-s) from rank r-1.
 * The write-back saves the last all-gather step, the whole of it for n = 2.
 * Pipelined: each rank counts the chunk-steps it has done (done[r]); a
 * chunk-step waits only for the same chunk of the step before at rank r-1,
 * so ranks work on different chunks at once. Only rank r+1 touches rank r's
 * buffer (reads it, writes back into it), so rank r returns once rank r+1
 * has finished. The counters run on
 * across calls; every rank does the same number of chunk-steps per call, so
 * their bases agree. */

static int64_t ring_chunks(int64_t count, int n)
{
    int64_t c = ceil_div(ceil_div(ceil_div(count, 16), n) * 16, XOPS_CHUNK); /* the longest segment's */
    return c ? c : 1;
}

static int mod(int a, int n) { return ((a % n) + n) % n; }

/* Chunk c of segment k. */
static void seg_chunk(int64_t count, int n, int k, int64_t c, int64_t *lo, int64_t *hi)
{
    int64_t s0, s1;
    split_lines(count, n, k, &s0, &s1);
    *lo = s0 + c * XOPS_CHUNK < s1 ? s0 + c * XOPS_CHUNK : s1;
    *hi = *lo + XOPS_CHUNK < s1 ? *lo + XOPS_CHUNK : s1;
}

/* Chunk-step (s, c) of rank r's reduce-scatter; the last step writes the sum
 * back into rank r-1's buffer when write_back (the all-reduce). */
static void ring_rs_item(float *const *bufs, int n, int r, int s, int64_t c, int64_t count, loom_redop op,
                         int write_back)
{
    int p = mod(r - 1, n);
    int64_t lo, hi;
    seg_chunk(count, n, mod(r - 1 - s, n), c, &lo, &hi);
    if (s == n - 2 && write_back) {
        combine_both(bufs[r] + lo, bufs[p] + lo, hi - lo, op, n);
    } else {
        combine(bufs[r] + lo, bufs[p] + lo, hi - lo, op);
        if (s == n - 2) finish(bufs[r] + lo, hi - lo, op, n);
    }
}

static void ring_ag_item(float *const *bufs, int n, int r, int s, int64_t c, int64_t count)
{
    int64_t lo, hi;
    seg_chunk(count, n, mod(r - s, n), c, &lo, &hi);
    copy(bufs[r] + lo, bufs[mod(r - 1, n)] + lo, hi - lo);
}

/* One thread plays every rank, step by step: within a step no rank touches
 * what another reads, so this is the same arithmetic as the pipelined ring. */
static int ring_all_reduce(float *const *bufs, int n, int64_t count, loom_redop op, loom_err *err)
{
    (void)err;
    int64_t C = ring_chunks(count, n);
    for (int s = 0; s < n - 1; s++)
        for (int r = 0; r < n; r++)
            for (int64_t c = 0; c < C; c++) ring_rs_item(bufs, n, r, s, c, count, op, 1);
    for (int s = 0; s < n - 2; s++)
        for (int r = 0; r < n; r++)
            for (int64_t c = 0; c < C; c++) ring_ag_item(bufs, n, r, s, c, count);
    return LOOM_OK;
}

/* Waits until rank p has done its chunk-step `item` (0 = published its buffer). */
static inline int ring_wait(xstate *s, int r, int p, uint32_t base, uint32_t item)
{
    return sig_wait(s, r, p, &s->done[p], base + item + 1, s->spin);
}

static void ring_post(xstate *s, int r, uint32_t base, uint32_t item) { sig_post(&s->done[r], base + item + 1); }

/* After rank r's T chunk-steps: wait for its reader, rank r+1, then move on. */
static int ring_end(xstate *s, int r, uint32_t T)
{
    uint32_t base = s->base[r];
    int rc = sig_wait(s, r, (r + 1) % s->n, &s->done[(r + 1) % s->n], base + T, s->spin);
    s->base[r] = base + T;
    return rc;
}

/* The start of rank r's ring collective, once it has published its buffer:
 * post item 0 and wait until every rank has (not only rank r-1), so that
 * the calls can be compared. When they differ the call is one item long on
 * every rank, and nobody has touched another's buffer. */
static int ring_start(xstate *s, int r, xkind kind, int64_t count, int arg, loom_err *err)
{
    uint32_t base = s->base[r];
    call_publish(s, r, kind, count, arg);
    ring_post(s, r, base, 0);
    for (int k = 0; k < s->n; k++)
        if (k != r && ring_wait(s, r, k, base, 0)) return XOPS_BROKEN;
    int rc = call_check(s, r, err);
    if (rc) s->base[r] = base + 1;
    return rc;
}

static int ring_all_reduce_rank(void *comm, int r, float *buf, int64_t count, loom_redop op, loom_err *err)
{
    xstate *s = comm;
    int n = s->n, p = mod(r - 1, n);
    if (n == 1) return LOOM_OK;
    s->bufs[r] = buf;
    int rc = ring_start(s, r, XC_ALL_REDUCE, count, (int)op, err);
    if (rc) return rc;
    int64_t C = ring_chunks(count, n);
    LOOM_ASSERT(C < (1 << 28) / n); /* chunk-steps per call must stay far below 2^31 */
    uint32_t base = s->base[r], T = 1 + (uint32_t)(2 * n - 3) * (uint32_t)C;
    for (int st = 0; st < n - 1; st++)
        for (int64_t c = 0; c < C; c++) {
            if ((rc = ring_wait(s, r, p, base, st == 0 ? 0 : 1 + (uint32_t)((st - 1) * C + c)))) return rc;
            ring_rs_item(s->bufs, n, r, st, c, count, op, 1);
            ring_post(s, r, base, 1 + (uint32_t)(st * C + c));
        }
    uint32_t ag = 1 + (uint32_t)((n - 1) * C);
    for (int st = 0; st < n - 2; st++)
        for (int64_t c = 0; c < C; c++) {
            uint32_t item = st == 0 ? ag - (uint32_t)C + (uint32_t)c : ag + (uint32_t)((st - 1) * C + c);
            if ((rc = ring_wait(s, r, p, base, item))) return rc;
            ring_ag_item(s->bufs, n, r, st, c, count);
            ring_post(s, r, base, ag + (uint32_t)(st * C + c));
        }
    return ring_end(s, r, T);
}

/* The all-reduce's reduce-scatter alone, without the write-back: segment
 * r+1 ends complete at rank r (ring_shard). */
static int ring_reduce_scatter_rank(xstate *s, int r, float *buf, int64_t count, loom_redop op, loom_err *err)
{
    int n = s->n, p = mod(r - 1, n);
    if (n == 1) return LOOM_OK;
    s->bufs[r] = buf;
    int rc = ring_start(s, r, XC_REDUCE_SCATTER, count, (int)op, err);
    if (rc) return rc;
    int64_t C = ring_chunks(count, n);
    LOOM_ASSERT(C < (1 << 28) / n);
    uint32_t base = s->base[r], T = 1 + (uint32_t)(n - 1) * (uint32_t)C;
    for (int st = 0; st < n - 1; st++)
        for (int64_t c = 0; c < C; c++) {
            if ((rc = ring_wait(s, r, p, base, st == 0 ? 0 : 1 + (uint32_t)((st - 1) * C + c)))) return rc;
            ring_rs_item(s->bufs, n, r, st, c, count, op, 0);
            ring_post(s, r, base, 1 + (uint32_t)(st * C + c));
        }
    return ring_end(s, r, T);
}

/* Broadcast down the ring from root, chunk by chunk (a pipelined chain). */
static int ring_broadcast_rank(void *comm, int r, float *buf, int64_t count, int root, loom_err *err)
{
    xstate *s = comm;
    int n = s->n, p = mod(r - 1, n);
    if (n == 1) return LOOM_OK;
    s->bufs[r] = buf;
    int rc = ring_start(s, r, XC_BROADCAST, count, root, err);
    if (rc) return rc;
    int64_t C = ceil_div(count, XOPS_CHUNK);
    uint32_t base = s->base[r], T = 1 + (uint32_t)C;
    if (r == root) {
        ring_post(s, r, base, T - 1); /* the root has every chunk */
    } else {
        for (int64_t c = 0; c < C; c++) {
            int64_t lo = c * XOPS_CHUNK, hi = lo + XOPS_CHUNK < count ? lo + XOPS_CHUNK : count;
            if ((rc = ring_wait(s, r, p, base, 1 + (uint32_t)c))) return rc;
            copy(buf + lo, s->bufs[p] + lo, hi - lo);
            ring_post(s, r, base, 1 + (uint32_t)c);
        }
    }
    return ring_end(s, r, T);
}

/* All-gather around the ring: each rank's block travels to the next rank,
 * which passes it on at the next step. */
static int ring_all_gather_rank(void *comm, int r, const float *buf, int64_t count, float *out, loom_err *err)
{
    xstate *s = comm;
    int n = s->n, p = mod(r - 1, n);
    copy(out + (int64_t)r * count, buf, count); /* rank r+1 reads it once item 0 is posted */
    s->outs[r] = out;
    int rc = ring_start(s, r, XC_ALL_GATHER, count, 0, err);
    if (rc) return rc;
    int64_t C = ceil_div(count, XOPS_CHUNK);
    if (!C) C = 1;
    uint32_t base = s->base[r], T = 1 + (uint32_t)(n - 1) * (uint32_t)C;
    for (int st = 0; st < n - 1; st++) {
        int64_t blk = (int64_t)mod(r - 1 - st, n) * count;
        for (int64_t c = 0; c < C; c++) {
            int64_t lo = c * XOPS_CHUNK, hi = lo + XOPS_CHUNK < count ? lo + XOPS_CHUNK : count;
            if ((rc = ring_wait(s, r, p, base, st == 0 ? 0 : 1 + (uint32_t)((st - 1) * C + c)))) return rc;
            copy(out + blk + lo, s->outs[p] + blk + lo, hi - lo);
            ring_post(s, r, base, 1 + (uint32_t)(st * C + c));
        }
    }
    return n > 1 ? ring_end(s, r, T) : LOOM_OK;
}

static const loom_cross_device_ops ring = {
    .version = LOOM_CROSS_DEVICE_OPS_VERSION,
    .name = "ring",
    .all_reduce = ring_all_reduce,
    .broadcast = copy_broadcast,
    .all_gather = copy_all_gather,
    .comm_new = xstate_new,
    .comm_free = xstate_free,
    .all_reduce_rank = ring_all_reduce_rank,
    .broadcast_rank = ring_broadcast_rank,
    .all_gather_rank = ring_all_gather_rank,
    .caps = LOOM_XOPS_HOST_MEM,
};

int loom_xops_register_builtins_(loom_err *err)
{
    int rc = loom_register_cross_device_ops(&reduce_to_one_device, err);
    if (!rc) rc = loom_register_cross_device_ops(&hierarchical_copy, err);
    if (!rc) rc = loom_register_cross_device_ops(&ring, err);
    return rc;
}

unsigned loom_xops_memory(const loom_cross_device_ops *x)
{
    unsigned m = x->version >= 3 ? x->caps & (LOOM_XOPS_HOST_MEM | LOOM_XOPS_DEVICE_MEM) : 0;
    return m ? m : LOOM_XOPS_HOST_MEM;
}

const loom_cross_device_ops *loom_xops_job(const loom_cross_device_ops *x)
{
    return x && x->version >= 4 && x->job_open ? x : NULL;
}

/* ---- wrappers of the N-buffer entry points -------------------------------- */

int loom_all_gather(const loom_cross_device_ops *x, float *const *bufs, int n, int64_t count, float *out,
                    loom_err *err)
{
    if (x->all_gather) return x->all_gather(bufs, n, count, out, err);
    return copy_all_gather(bufs, n, count, out, err);
}

/* ---- the communicator ------------------------------------------------------ */

/* Per-rank entry points exist only from version 2 on. */
static int has_ranked(const loom_cross_device_ops *x) { return x->version >= 2 && x->comm_new; }

/* The built-ins' per-rank entry points check that the ranks agree themselves. */
static int checks_itself(const loom_cross_device_ops *x) { return has_ranked(x) && x->comm_new == xstate_new; }

struct loom_xcomm {
    const loom_cross_device_ops *x;
    int                          n;
    void                        *state; /* x->comm_new's, or NULL */
    xstate                      *gen;   /* the rendezvous for ops without per-rank entry points */
    /* the collective the last rank to arrive runs for everyone (written by rank 0) */
    xkind    what; /* XC_ALL_REDUCE, XC_BROADCAST or XC_ALL_GATHER */
    int64_t  count;
    loom_redop op;
    int      root, rc;
    loom_err err;
    xwatch   w;
};

int loom_xcomm_open(loom_xcomm **out, const loom_cross_device_ops *x, int n, loom_err *err)
{
    *out = NULL;
    if (n < 1)
        return loom_err_set(err, LOOM_EUSAGE, x->name, "a communicator needs at least 1 rank, got %d", n);
    loom_xcomm *c = loom_calloc(1, sizeof *c);
    if (!c) return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating a communicator");
    c->x = x;
    c->n = n;
    if (!(c->gen = xstate_new(n, err)) || (has_ranked(x) && !(c->state = x->comm_new(n, err)))) {
        loom_xcomm_close(c);
        return err ? err->code : LOOM_ENOMEM;
    }
    xwatch *w = &c->w;
    if (!(w->slots = loom_alloc_aligned((size_t)n * sizeof *w->slots))) {
        loom_xcomm_close(c);
        return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating a communicator of %d ranks", n);
    }
    memset(w->slots, 0, (size_t)n * sizeof *w->slots);
    pthread_mutex_init(&w->lock, NULL);
    w->n = n;
    w->name = x->name;
    w->warn_s = LOOM_XCOMM_STALL_WARN;
    w->states[0] = c->gen;
    c->gen->name = x->name;
    c->gen->w = w;
    if (checks_itself(x)) {
        xstate *s = c->state;
        s->name = x->name;
        s->w = w;
        w->states[1] = s;
    }
    /* where each collective starts (loom_xcomm_* below): the built-ins' at
     * their own state except all_gather_shards; everything else at gen */
    for (int k = 0; k <= XC_UPDATE; k++) w->lane[k] = checks_itself(x) && k != XC_ALL_GATHER_SHARDS;
    *out = c;
    return LOOM_OK;
}

void loom_xcomm_close(loom_xcomm *c)
{
    if (!c) return;
    if (c->state) c->x->comm_free(c->state);
    xstate_free(c->gen);
    if (c->w.slots) {
        pthread_mutex_destroy(&c->w.lock);
        loom_free(c->w.slots);
    }
    loom_free(c);
}

void loom_xcomm_set_timeouts(loom_xcomm *c, double warn_s, double fail_s)
{
    LOOM_ASSERT(warn_s >= 0 && fail_s >= 0);
    c->w.warn_s = warn_s;
    c->w.fail_s = fail_s;
}

/* Rank r enters a public collective: fails at once on a broken
 * communicator, else publishes what it is in (its own line, no waiting). */
static int xc_enter(loom_xcomm *c, int r, xkind kind, int64_t count, loom_err *err)
{
    xwatch *w = &c->w;
    if (atomic_load_explicit(&w->broken, memory_order_relaxed)) {
        pthread_mutex_lock(&w->lock);
        if (err) *err = w->why;
        pthread_mutex_unlock(&w->lock);
        loom_err_prefix(err, "loom_xcomm_%s: the communicator broke in an earlier call", xkind_names[kind]);
        return atomic_load(&w->broken);
    }
    xslot *me = &w->slots[r];
    atomic_store_explicit(&me->kind, (int32_t)kind, memory_order_relaxed);
    atomic_store_explicit(&me->count, count, memory_order_relaxed);
    atomic_store_explicit(&me->seq, atomic_load_explicit(&me->seq, memory_order_relaxed) + 1, memory_order_release);
    return LOOM_OK;
}

/* Rank r returns rc from its collective: an XOPS_BROKEN becomes the error
 * that broke the communicator, the same on every rank. */
static int xc_leave(loom_xcomm *c, int r, int rc, loom_err *err)
{
    xslot *me = &c->w.slots[r];
    atomic_store_explicit(&me->left, atomic_load_explicit(&me->seq, memory_order_relaxed), memory_order_release);
    if (rc != XOPS_BROKEN) return rc;
    pthread_mutex_lock(&c->w.lock);
    if (err) *err = c->w.why;
    pthread_mutex_unlock(&c->w.lock);
    return c->w.why.code;
}

int loom_xcomm_size(const loom_xcomm *c) { return c->n; }
const loom_cross_device_ops *loom_xcomm_ops(const loom_xcomm *c) { return c->x; }

/* Run by the last rank to arrive: the op's N-buffer entry point for all. */
static void generic_run(void *arg)
{
    loom_xcomm *c = arg;
    float *const *bufs = c->gen->bufs;
    loom_err_clear(&c->err);
    if (calls_agree(c->gen, calls_of(c->gen, 0), NULL)) return; /* each rank says so (generic_rank) */
    if (c->what == XC_ALL_REDUCE)
        c->rc = c->x->all_reduce(bufs, c->n, c->count, c->op, &c->err);
    else if (c->what == XC_BROADCAST)
        c->rc = c->x->broadcast(bufs, c->n, c->count, c->root, &c->err);
    else
        for (int r = 0; r < c->n && !c->rc; r++)
            c->rc = loom_all_gather(c->x, bufs, c->n, c->count, c->gen->outs[r], &c->err);
}

static int generic_rank(loom_xcomm *c, int r, xkind what, float *buf, float *out, int64_t count, loom_redop op,
                        int root, loom_err *err)
{
    if (r == 0) {
        c->what = what;
        c->count = count;
        c->op = op;
        c->root = root;
        c->rc = LOOM_OK;
    }
    c->gen->bufs[r] = buf;
    c->gen->outs[r] = out;
    call_publish(c->gen, r, what, count, what == XC_BROADCAST ? root : what == XC_ALL_REDUCE ? (int)op : 0);
    if (bar_sync(c->gen, r, &c->gen->bar, c->n, c->gen->spin, generic_run, c)) return XOPS_BROKEN;
    /* the same verdict on every rank, so all leave here after one barrier,
     * as from bar_start (another collective may have been called there) */
    int rc = call_check(c->gen, r, err);
    if (rc) return rc;
    rc = c->rc;
    if (rc && err) *err = c->err;
    /* everyone has read rc before the next call */
    return bar_sync(c->gen, r, &c->gen->bar, c->n, c->gen->spin, NULL, NULL) ? XOPS_BROKEN : rc;
}

/* A plugin's own per-rank entry points are called only once the ranks agree,
 * at a rendezvous of ours (one barrier more per call); the built-ins check
 * at their own. */
static int plugin_agree(loom_xcomm *c, int r, xkind what, int64_t count, int arg, loom_err *err)
{
    return checks_itself(c->x) || c->n == 1 ? LOOM_OK : bar_start(c->gen, r, what, count, arg, err);
}

static int all_reduce_(loom_xcomm *c, int rank, float *buf, int64_t count, loom_redop op, loom_err *err)
{
    if (!has_ranked(c->x)) return generic_rank(c, rank, XC_ALL_REDUCE, buf, NULL, count, op, 0, err);
    int rc = plugin_agree(c, rank, XC_ALL_REDUCE, count, (int)op, err);
    return rc ? rc : c->x->all_reduce_rank(c->state, rank, buf, count, op, err);
}

int loom_xcomm_all_reduce(loom_xcomm *c, int rank, float *buf, int64_t count, loom_redop op, loom_err *err)
{
    LOOM_ASSERT(rank >= 0 && rank < c->n && count >= 0);
    int rc = xc_enter(c, rank, XC_ALL_REDUCE, count, err);
    return rc ? rc : xc_leave(c, rank, all_reduce_(c, rank, buf, count, op, err), err);
}

static int broadcast_(loom_xcomm *c, int rank, float *buf, int64_t count, int root, loom_err *err)
{
    if (!has_ranked(c->x)) return generic_rank(c, rank, XC_BROADCAST, buf, NULL, count, LOOM_REDUCE_SUM, root, err);
    int rc = plugin_agree(c, rank, XC_BROADCAST, count, root, err);
    return rc ? rc : c->x->broadcast_rank(c->state, rank, buf, count, root, err);
}

int loom_xcomm_broadcast(loom_xcomm *c, int rank, float *buf, int64_t count, int root, loom_err *err)
{
    LOOM_ASSERT(rank >= 0 && rank < c->n && root >= 0 && root < c->n && count >= 0);
    int rc = xc_enter(c, rank, XC_BROADCAST, count, err);
    return rc ? rc : xc_leave(c, rank, broadcast_(c, rank, buf, count, root, err), err);
}

static int all_gather_(loom_xcomm *c, int rank, const float *buf, int64_t count, float *out, loom_err *err)
{
    if (!has_ranked(c->x) || !c->x->all_gather_rank)
        return generic_rank(c, rank, XC_ALL_GATHER, (float *)buf, out, count, LOOM_REDUCE_SUM, 0, err);
    int rc = plugin_agree(c, rank, XC_ALL_GATHER, count, 0, err);
    return rc ? rc : c->x->all_gather_rank(c->state, rank, buf, count, out, err);
}

int loom_xcomm_all_gather(loom_xcomm *c, int rank, const float *buf, int64_t count, float *out, loom_err *err)
{
    LOOM_ASSERT(rank >= 0 && rank < c->n && count >= 0);
    int rc = xc_enter(c, rank, XC_ALL_GATHER, count, err);
    return rc ? rc : xc_leave(c, rank, all_gather_(c, rank, buf, count, out, err), err);
}

/* ---- sharded updates ------------------------------------------------------
 * The ring's reduce-scatter leaves segment r+1 complete at rank r, so that is
 * rank r's shard; the other ops all-reduce the whole buffer and shard it in
 * rank order. The all-gather copies directly from the other ranks' buffers,
 * through the generic rendezvous, which every op has. */

static int is_ring(const loom_xcomm *c) { return c->x == &ring; }

void loom_xcomm_shard(const loom_xcomm *c, int rank, int64_t count, int64_t *lo, int64_t *hi)
{
    LOOM_ASSERT(rank >= 0 && rank < c->n && count >= 0);
    split_lines(count, c->n, is_ring(c) ? (rank + 1) % c->n : rank, lo, hi);
}

static int reduce_scatter_(loom_xcomm *c, int rank, float *buf, int64_t count, loom_redop op, loom_err *err)
{
    if (is_ring(c)) return ring_reduce_scatter_rank(c->state, rank, buf, count, op, err);
    return all_reduce_(c, rank, buf, count, op, err);
}

int loom_xcomm_reduce_scatter(loom_xcomm *c, int rank, float *buf, int64_t count, loom_redop op, loom_err *err)
{
    LOOM_ASSERT(rank >= 0 && rank < c->n && count >= 0);
    int rc = xc_enter(c, rank, XC_REDUCE_SCATTER, count, err);
    return rc ? rc : xc_leave(c, rank, reduce_scatter_(c, rank, buf, count, op, err), err);
}

static int all_gather_shards_(loom_xcomm *c, int rank, float *buf, int64_t count, loom_err *err)
{
    xstate *s = c->gen;
    s->bufs[rank] = buf;
    int rc = bar_start(s, rank, XC_ALL_GATHER_SHARDS, count, 0, err);
    if (rc) return rc;
    for (int k = 0; k < c->n; k++) {
        int64_t lo, hi;
        loom_xcomm_shard(c, k, count, &lo, &hi);
        if (k != rank) copy(buf + lo, s->bufs[k] + lo, hi - lo);
    }
    return bar(s, rank); /* no rank changes its buffer before every other has copied from it */
}

int loom_xcomm_all_gather_shards(loom_xcomm *c, int rank, float *buf, int64_t count, loom_err *err)
{
    LOOM_ASSERT(rank >= 0 && rank < c->n && count >= 0);
    int rc = xc_enter(c, rank, XC_ALL_GATHER_SHARDS, count, err);
    return rc ? rc : xc_leave(c, rank, all_gather_shards_(c, rank, buf, count, err), err);
}

/* The ring's fused update: its reduce-scatter, where each chunk of this
 * rank's shard, once its last reduce step has completed it, is applied at
 * once (the gradient and the variables it updates are still in cache) and
 * the new variables written straight into every other rank's buffer. The
 * last reduce step of a chunk waits, through the chain of ranks before it,
 * for every rank to have published its gradients, so no rank still reads
 * its variables for the step (forward, backward) when they are written; the
 * closing barrier keeps every rank here until all writes into its buffer
 * are done and nobody reads its gradients. */
static int ring_update_rank(xstate *s, int r, float *grads, float *params, int64_t count, loom_xcomm_apply_fn apply,
                            void *arg, loom_err *err)
{
    int n = s->n, p = mod(r - 1, n);
    s->bufs[r] = grads;
    s->outs[r] = params;
    int rc = ring_start(s, r, XC_UPDATE, count, 0, err);
    if (rc) return rc;
    int64_t C = ring_chunks(count, n);
    LOOM_ASSERT(C < (1 << 28) / n);
    uint32_t base = s->base[r], T = 1 + (uint32_t)(n - 1) * (uint32_t)C;
    for (int st = 0; st < n - 1; st++)
        for (int64_t c = 0; c < C; c++) {
            if ((rc = ring_wait(s, r, p, base, st == 0 ? 0 : 1 + (uint32_t)((st - 1) * C + c)))) return rc;
            ring_rs_item(s->bufs, n, r, st, c, count, LOOM_REDUCE_SUM, 0);
            ring_post(s, r, base, 1 + (uint32_t)(st * C + c));
            if (st < n - 2) continue;
            int64_t lo, hi;
            seg_chunk(count, n, mod(r + 1, n), c, &lo, &hi);
            if (lo == hi) continue;
            apply(arg, lo, hi);
            for (int k = 1; k < n; k++) copy(s->outs[mod(r + k, n)] + lo, params + lo, hi - lo);
        }
    s->base[r] = base + T;
    return bar(s, r);
}

/* The other ops: their reduce-scatter, apply, their gather, both rendezvous
 * published as the update. When the ranks disagree (LOOM_EUSAGE, on every
 * rank) or the communicator broke, nobody gathers: a rank that called
 * another collective has a single rendezvous. */
static int update_(loom_xcomm *c, int rank, float *grads, float *params, int64_t count, loom_xcomm_apply_fn apply,
                   void *arg, loom_err *err)
{
    int64_t lo, hi;
    if (c->n == 1) {
        if (count) apply(arg, 0, count);
        return LOOM_OK;
    }
    if (is_ring(c)) return ring_update_rank(c->state, rank, grads, params, count, apply, arg, err);
    int rc = reduce_scatter_(c, rank, grads, count, LOOM_REDUCE_SUM, err);
    if (rc == LOOM_EUSAGE || rc == XOPS_BROKEN) return rc;
    loom_xcomm_shard(c, rank, count, &lo, &hi);
    if (!rc && lo < hi) apply(arg, lo, hi);
    int gc = all_gather_shards_(c, rank, params, count, rc ? NULL : err); /* a plugin's failure: every rank gathers */
    return rc && gc != XOPS_BROKEN ? rc : gc;
}

int loom_xcomm_update(loom_xcomm *c, int rank, float *grads, float *params, int64_t count, loom_xcomm_apply_fn apply,
                      void *arg, loom_err *err)
{
    LOOM_ASSERT(rank >= 0 && rank < c->n && count >= 0);
    int rc = xc_enter(c, rank, XC_UPDATE, count, err);
    return rc ? rc : xc_leave(c, rank, update_(c, rank, grads, params, count, apply, arg, err), err);
}

/* ---- "auto" ------------------------------------------------------------------
 * Measured with tests/bench/allreduce_bench (docs/distribution.md): on CPU threads the ring
 * is never slower than the other two and moves the fewest bytes per rank,
 * 2(n-1)/n of the buffer; with more replicas than cores all three ran within
 * the noise of each other. */

const loom_cross_device_ops *loom_xops_auto_(int n, int gpus, char *why, size_t why_n)
{
    /* GPU replicas: the first op registered that works on GPU memory (the nccl plugin's) */
    const char *name;
    const void *x;
    for (int i = 0; gpus && loom_registry_entry(LOOM_REG_CROSS_DEVICE_OPS, i, &name, &x, NULL) == 0; i++)
        if ((loom_xops_memory(x) & LOOM_XOPS_DEVICE_MEM) && ((const loom_cross_device_ops *)x)->all_reduce) {
            snprintf(why, why_n, "GPU devices, and %s works on GPU memory", name);
            return x;
        }
    /* CPU replicas, or GPU replicas without such an op: the ring, which works on host memory, as every built-in does */
    if (gpus)
        snprintf(why, why_n, "GPU devices, but no loaded op works on GPU memory (the nccl plugin is not loaded): the "
                 "pipelined ring on the gradients downloaded to host memory");
    else
        snprintf(why, why_n, "%d replicas on %d cores: the pipelined ring moves 2(n-1)/n of the gradients per "
                 "replica, the fewest bytes", n, loom_num_cores());
    return &ring;
}
