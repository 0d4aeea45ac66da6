/* test_xops_agree.c - ranks that disagree, and the memory an op works on.
 * Every per-rank collective (all_reduce, broadcast, all_gather,
 * reduce_scatter, all_gather_shards, update) of every kind of op (the three
 * built-ins, a version-1 op through the generic rendezvous, a version-2 op
 * with per-rank entry points of its own), N = 2, 3, 4: when one rank passes
 * another count, op or root, or calls another collective, every rank returns
 * LOOM_EUSAGE with a message naming the collective and the values, no
 * buffer changes (guard floats past each count included), nothing hangs,
 * and the next, agreeing call gives the right result. Then the memory caps:
 * loom_xops_memory for every vtable version, "auto" never picking a
 * GPU-memory op for CPU replicas, and loom_strategy_open refusing one for
 * CPU replicas at the setting's file:line. */
#include "distribute/distribute.h"
#include "distribute/xops_internal.h"
#include "harness.h"
#include "xops_v1.h"

#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

#define N_MAX 4
#define COUNT 1000 /* what the agreeing ranks pass */
#define ODD   1005 /* what the odd rank passes instead */
#define CAP   1100 /* floats per buffer: the rest are guards that must never change */
#define GUARD -7.0f

static const loom_cross_device_ops *op_named(const char *name)
{
    loom_err err;
    LOOM_ASSERT(loom_distribute_init(&err) == LOOM_OK);
    return loom_find_cross_device_ops(name);
}

/* ---- two ops that are not built in ------------------------------------------- */

/* Version 1: N-buffer entry points only (xops_v1.h). */
static const v1_ops agree_v1 = XOPS_V1("agree_v1");

/* Version 2 with per-rank entry points of its own, as a plugin's would be:
 * a barrier, rank 0 reduces, the others copy. It records whether it was
 * ever called with counts that differ (Loom must stop such calls first). */
typedef struct own_comm {
    int               n;
    pthread_barrier_t bar;
    float            *bufs[N_MAX];
    int64_t           counts[N_MAX];
} own_comm;

static atomic_int own_saw_mismatch;

static void *own_new(int n, loom_err *err)
{
    (void)err;
    own_comm *c = calloc(1, sizeof *c);
    c->n = n;
    pthread_barrier_init(&c->bar, NULL, (unsigned)n);
    return c;
}

static void own_free(void *p)
{
    own_comm *c = p;
    pthread_barrier_destroy(&c->bar);
    free(c);
}

static void own_arrive(own_comm *c, int r, float *buf, int64_t count)
{
    c->bufs[r] = buf;
    c->counts[r] = count;
    pthread_barrier_wait(&c->bar);
    for (int k = 0; k < c->n; k++)
        if (c->counts[k] != count) atomic_store(&own_saw_mismatch, 1);
}

static int own_all_reduce(void *comm, int r, float *buf, int64_t count, loom_redop op, loom_err *err)
{
    own_comm *c = comm;
    own_arrive(c, r, buf, count);
    if (r == 0) v1_all_reduce(c->bufs, c->n, count, op, err);
    pthread_barrier_wait(&c->bar);
    if (r) memcpy(buf, c->bufs[0], (size_t)count * sizeof(float));
    pthread_barrier_wait(&c->bar);
    return LOOM_OK;
}

static int own_broadcast(void *comm, int r, float *buf, int64_t count, int root, loom_err *err)
{
    (void)err;
    own_comm *c = comm;
    own_arrive(c, r, buf, count);
    if (r != root) memcpy(buf, c->bufs[root], (size_t)count * sizeof(float));
    pthread_barrier_wait(&c->bar);
    return LOOM_OK;
}

static const loom_cross_device_ops agree_own = {
    .version = 2,
    .name = "agree_own",
    .all_reduce = v1_all_reduce,
    .broadcast = v1_broadcast,
    .comm_new = own_new,
    .comm_free = own_free,
    .all_reduce_rank = own_all_reduce,
    .broadcast_rank = own_broadcast,
};

static const loom_cross_device_ops *test_op(const char *name)
{
    loom_err err;
    if (!op_named(name)) {
        const loom_cross_device_ops *x =
            !strcmp(name, "agree_v1") ? (const loom_cross_device_ops *)&agree_v1 : &agree_own;
        CHECK(loom_register_cross_device_ops_from(x, "tests/agree.so", &err) == LOOM_OK);
    }
    return op_named(name);
}

/* ---- the cases ------------------------------------------------------------------ */

typedef enum { ALL_REDUCE, BROADCAST, ALL_GATHER, REDUCE_SCATTER, GATHER_SHARDS, UPDATE, N_COLL } coll;
static const char *const coll_name[] = {"all_reduce", "broadcast", "all_gather", "reduce_scatter",
                                        "all_gather_shards", "update"};

/* What differs in a case: the odd rank's count, its op or root, or the collective it calls. */
typedef enum { DIFF_COUNT, DIFF_ARG, DIFF_CALL } diff;

typedef struct group {
    const loom_cross_device_ops *x;
    loom_xcomm                  *comm;
    int                          n;
    pthread_barrier_t            bar;
    float                       *buf[N_MAX], *out[N_MAX]; /* CAP and N_MAX * CAP floats */
    atomic_long                  bad;
} group;

static float value(int r, int64_t i) { return (float)(r + 1 + i % 7); } /* sums of a few are exact */

static void fail_(group *g, int r, const char *what, const char *detail)
{
    printf("#   %s, n %d, rank %d: %s%s%s\n", g->x->name, g->n, r, what, detail ? ": " : "", detail ? detail : "");
    atomic_fetch_add(&g->bad, 1);
}

/* update's apply: params -= grads over [lo, hi); arg: {int *calls, params, grads} */
static void apply_sub(void *arg, int64_t lo, int64_t hi)
{
    int *calls = ((int **)arg)[0];
    float *params = ((float **)arg)[1], *grads = ((float **)arg)[2];
    (*calls)++;
    for (int64_t i = lo; i < hi; i++) params[i] -= grads[i];
}

/* Rank r's call of collective c with count and arg (the reduce op or root). */
static int call(group *g, int r, coll c, int64_t count, int arg, int *applied, loom_err *err)
{
    float *buf = g->buf[r], *out = g->out[r];
    void *apply_arg[3] = {applied, out, buf};
    switch (c) {
    case ALL_REDUCE: return loom_xcomm_all_reduce(g->comm, r, buf, count, (loom_redop)arg, err);
    case BROADCAST: return loom_xcomm_broadcast(g->comm, r, buf, count, arg, err);
    case ALL_GATHER: return loom_xcomm_all_gather(g->comm, r, buf, count, out, err);
    case REDUCE_SCATTER: return loom_xcomm_reduce_scatter(g->comm, r, buf, count, (loom_redop)arg, err);
    case GATHER_SHARDS: return loom_xcomm_all_gather_shards(g->comm, r, buf, count, err);
    case UPDATE: return loom_xcomm_update(g->comm, r, buf, out, count, apply_sub, apply_arg, err);
    default: return -1;
    }
}

static void fill(group *g, int r)
{
    for (int64_t i = 0; i < CAP; i++) g->buf[r][i] = i < ODD ? value(r, i) : GUARD;
    for (int64_t i = 0; i < (int64_t)N_MAX * CAP; i++) g->out[r][i] = GUARD;
    for (int64_t i = 0; i < COUNT; i++) g->out[r][i] = 0; /* update: the variables, equal on every rank */
}

/* After a refused call: nothing changed, except all_gather's own block of out
 * (written before the ranks compare, in range of the rank's own count). */
static void check_untouched(group *g, int r, coll c, int64_t mine)
{
    for (int64_t i = 0; i < CAP; i++)
        if (g->buf[r][i] != (i < ODD ? value(r, i) : GUARD)) {
            fail_(g, r, "a refused call changed its buffer", coll_name[c]);
            return;
        }
    for (int64_t i = 0; i < (int64_t)N_MAX * CAP; i++) {
        if (c == ALL_GATHER && i >= r * mine && i < (r + 1) * mine) continue;
        if (g->out[r][i] != (i < COUNT ? 0 : GUARD)) {
            fail_(g, r, "a refused call changed its output", coll_name[c]);
            return;
        }
    }
}

/* The message every rank must get when rank odd differs by d from the
 * others, which call c (the odd one calls other for DIFF_CALL). */
static void expected(const group *g, coll c, coll other, diff d, int odd, char *want, size_t n)
{
    int k = odd == 0 ? 1 : odd; /* the first rank that differs from rank 0 */
    const char *as = coll_name[c]; /* the collective called, also where it runs as an all_reduce */
    if (d == DIFF_CALL) {
        snprintf(want, n, "the ranks called different collectives: rank 0 loom_xcomm_%s, rank %d loom_xcomm_%s",
                 odd == 0 ? coll_name[other] : as, k, odd == 0 ? as : coll_name[other]);
    } else if (d == DIFF_COUNT) {
        char by_rank[64] = "";
        for (int r = 0; r < g->n; r++)
            snprintf(by_rank + strlen(by_rank), sizeof by_rank - strlen(by_rank), "%s%d", r ? ", " : "",
                     r == odd ? ODD : COUNT);
        snprintf(want, n,
                 "loom_xcomm_%s: the ranks passed different counts: rank 0 %d floats, rank %d %d (by rank: %s)", as,
                 odd == 0 ? ODD : COUNT, k, odd == k ? ODD : COUNT, by_rank);
    } else if (c == BROADCAST) {
        snprintf(want, n, "loom_xcomm_broadcast: the ranks named different roots: rank 0 root %d, rank %d root %d",
                 odd == 0 ? 1 : 0, k, odd == k ? 1 : 0);
    } else {
        snprintf(want, n, "loom_xcomm_%s: the ranks asked for different reductions: rank 0 %s, rank %d %s", as,
                 odd == 0 ? "MAX" : "SUM", k, odd == k ? "MAX" : "SUM");
    }
}

/* The agreeing call after a refused one: the right result on rank r. */
static void check_result(group *g, int r, coll c)
{
    int64_t lo = 0, hi = COUNT;
    float sum0 = 0; /* the SUM over ranks of value(k, 0), shifted per element below */
    for (int k = 0; k < g->n; k++) sum0 += value(k, 0);
    for (int64_t i = 0; i < COUNT; i++) {
        float sum = sum0 + (float)(g->n * (i % 7)), got, want;
        if (c == ALL_REDUCE || c == REDUCE_SCATTER) {
            if (c == REDUCE_SCATTER) loom_xcomm_shard(g->comm, r, COUNT, &lo, &hi);
            if (i < lo || i >= hi) continue;
            got = g->buf[r][i], want = sum;
        } else if (c == BROADCAST) {
            got = g->buf[r][i], want = value(0, i);
        } else if (c == ALL_GATHER) {
            for (int k = 0; k < g->n; k++)
                if (g->out[r][k * COUNT + i] != value(k, i)) {
                    fail_(g, r, "all_gather after a refused call is wrong", NULL);
                    return;
                }
            continue;
        } else if (c == GATHER_SHARDS) {
            int owner = 0;
            for (int k = 0; k < g->n; k++) {
                loom_xcomm_shard(g->comm, k, COUNT, &lo, &hi);
                if (i >= lo && i < hi) owner = k;
            }
            got = g->buf[r][i], want = value(owner, i);
        } else {
            got = g->out[r][i], want = -sum;
        }
        if (got != want) {
            char d[96];
            snprintf(d, sizeof d, "element %lld: got %g, want %g", (long long)i, got, want);
            fail_(g, r, "the agreeing call after a refused one is wrong", d);
            return;
        }
    }
}

/* Which cases run: an op or root only where there is one; another
 * collective only where both meet at the same rendezvous (not the shards'
 * gather: test_xops_stall.c has those, which break the communicator). */
static int runs(coll c, diff d)
{
    if (d == DIFF_ARG) return c == ALL_REDUCE || c == BROADCAST || c == REDUCE_SCATTER;
    if (d == DIFF_CALL) return c != GATHER_SHARDS;
    return 1;
}

/* One rank: for every collective, every kind of disagreement and every
 * odd rank, a refused call, then the agreeing one (broadcast from 0, SUM). */
static void *rank_main(void *p)
{
    void **a = p;
    group *g = a[0];
    int r = (int)(intptr_t)a[1];
    for (int ci = 0; ci < N_COLL; ci++)
        for (int d = DIFF_COUNT; d <= DIFF_CALL; d++) {
            coll c = (coll)ci, other = c == BROADCAST ? ALL_REDUCE : BROADCAST;
            if (!runs(c, (diff)d)) continue;
            for (int odd = 0; odd < g->n; odd++) {
                int applied = 0, is_odd = r == odd;
                coll mine = d == DIFF_CALL && is_odd ? other : c;
                int64_t count = d == DIFF_COUNT && is_odd ? ODD : COUNT;
                int arg = d == DIFF_ARG && is_odd ? (c == BROADCAST ? 1 : LOOM_REDUCE_MAX) : 0;
                char want[300];
                expected(g, c, other, (diff)d, odd, want, sizeof want);
                fill(g, r);
                pthread_barrier_wait(&g->bar);
                loom_err err = {0};
                int rc = call(g, r, mine, count, arg, &applied, &err);
                if (rc != LOOM_EUSAGE || err.code != LOOM_EUSAGE) fail_(g, r, "not refused", want);
                else if (!strstr(err.msg, want)) fail_(g, r, err.msg, want);
                else if (!strstr(err.hint, "same count, op and root")) fail_(g, r, "no hint", err.hint);
                if (applied) fail_(g, r, "a refused update applied", NULL);
                check_untouched(g, r, mine, count);
                pthread_barrier_wait(&g->bar);
                fill(g, r);
                pthread_barrier_wait(&g->bar);
                if ((rc = call(g, r, c, COUNT, 0, &applied, &err))) fail_(g, r, "the next call failed", err.msg);
                else check_result(g, r, c);
                pthread_barrier_wait(&g->bar);
            }
        }
    return NULL;
}

static void run_op(const loom_cross_device_ops *x)
{
    CHECK(x != NULL);
    for (int n = 2; x && n <= N_MAX; n++) {
        group g = {.x = x, .n = n};
        loom_err err;
        CHECK(loom_xcomm_open(&g.comm, x, n, &err) == LOOM_OK);
        pthread_barrier_init(&g.bar, NULL, (unsigned)n);
        pthread_t t[N_MAX];
        void *a[N_MAX][2];
        for (int r = 0; r < n; r++) {
            g.buf[r] = malloc(CAP * sizeof(float));
            g.out[r] = malloc(N_MAX * CAP * sizeof(float));
            a[r][0] = &g;
            a[r][1] = (void *)(intptr_t)r;
            pthread_create(&t[r], NULL, rank_main, a[r]);
        }
        for (int r = 0; r < n; r++) pthread_join(t[r], NULL);
        CHECK_MSG(atomic_load(&g.bad) == 0, "%s, n %d: %ld failures", x->name, n, atomic_load(&g.bad));
        for (int r = 0; r < n; r++) free(g.buf[r]), free(g.out[r]);
        pthread_barrier_destroy(&g.bar);
        loom_xcomm_close(g.comm);
    }
}

static void test_ring(void) { run_op(op_named("ring")); }
static void test_hierarchical_copy(void) { run_op(op_named("hierarchical_copy")); }
static void test_reduce_to_one_device(void) { run_op(op_named("reduce_to_one_device")); }
static void test_version1_generic(void) { run_op(test_op("agree_v1")); }

static void test_own_per_rank_entry_points(void)
{
    atomic_store(&own_saw_mismatch, 0);
    run_op(test_op("agree_own"));
    CHECK_MSG(!atomic_load(&own_saw_mismatch), "the op's own per-rank entry points saw ranks that disagree");
}

/* ---- the memory an op works on -------------------------------------------------- */

static int gpu_all_reduce(float *const *bufs, int n, int64_t count, loom_redop op, loom_err *err)
{
    (void)bufs, (void)n, (void)count, (void)op;
    return loom_err_set(err, LOOM_EUSAGE, NULL, "test_gpu_mem: called with host buffers");
}

static int gpu_broadcast(float *const *bufs, int n, int64_t count, int root, loom_err *err)
{
    (void)bufs, (void)n, (void)count, (void)root;
    return loom_err_set(err, LOOM_EUSAGE, NULL, "test_gpu_mem: called with host buffers");
}

/* A version-3 op for GPU memory only, as the nccl plugin's. */
static const loom_cross_device_ops gpu_mem = {
    .version = 3,
    .name = "test_gpu_mem",
    .all_reduce = gpu_all_reduce,
    .broadcast = gpu_broadcast,
    .caps = LOOM_XOPS_DEVICE_MEM,
};

static const loom_cross_device_ops *gpu_op(void)
{
    loom_err err;
    if (!op_named("test_gpu_mem"))
        CHECK(loom_register_cross_device_ops_from(&gpu_mem, "plugins/test_gpu_mem.so", &err) == LOOM_OK);
    return op_named("test_gpu_mem");
}

static void test_memory_of_each_version(void)
{
    const char *builtin[] = {"reduce_to_one_device", "hierarchical_copy", "ring"};
    for (int i = 0; i < 3; i++) CHECK(loom_xops_memory(op_named(builtin[i])) == LOOM_XOPS_HOST_MEM);
    CHECK(loom_xops_memory(test_op("agree_v1")) == LOOM_XOPS_HOST_MEM); /* version 1: no caps field */
    CHECK(loom_xops_memory(test_op("agree_own")) == LOOM_XOPS_HOST_MEM); /* version 2: no caps field */
    CHECK(loom_xops_memory(gpu_op()) == LOOM_XOPS_DEVICE_MEM);
    loom_cross_device_ops v3 = gpu_mem;
    v3.caps = 0; /* declares nothing: host memory */
    CHECK(loom_xops_memory(&v3) == LOOM_XOPS_HOST_MEM);
    v3.caps = LOOM_XOPS_HOST_MEM | LOOM_XOPS_DEVICE_MEM;
    CHECK(loom_xops_memory(&v3) == (LOOM_XOPS_HOST_MEM | LOOM_XOPS_DEVICE_MEM));
    v3.version = 2; /* a version 2 vtable's caps are past its end: never read */
    CHECK(loom_xops_memory(&v3) == LOOM_XOPS_HOST_MEM);
}

/* With an op for GPU memory registered, "auto" picks it for GPU replicas
 * only: CPU replicas always get an op that works on host memory. */
static void test_auto_never_gpu_memory_for_cpu(void)
{
    char why[256];
    const loom_cross_device_ops *g = gpu_op();
    for (int n = 1; n <= 16; n++) {
        const loom_cross_device_ops *x = loom_xops_auto_(n, 0, why, sizeof why);
        CHECK(x != NULL && (loom_xops_memory(x) & LOOM_XOPS_HOST_MEM));
    }
    CHECK(loom_xops_auto_(2, 1, why, sizeof why) == g);
    CHECK_CONTAINS(why, "test_gpu_mem works on GPU memory");
}

/* loom_strategy_open refuses it for CPU replicas before building any:
 * ECONFIG at the setting's file:line, saying why and what works. */
static void test_strategy_refuses_gpu_memory_for_cpu(void)
{
    static loom_spec spec; /* only the strategy is read before the refusal */
    gpu_op();
    loom_strategy_spec *st = &spec.strategy;
    st->kind = LOOM_STRAT_MIRRORED;
    snprintf(st->name, sizeof st->name, "mirrored");
    snprintf(st->cross_device_ops, sizeof st->cross_device_ops, "test_gpu_mem");
    snprintf(st->cross_device_ops_loc.file, sizeof st->cross_device_ops_loc.file, "t.cfg");
    st->cross_device_ops_loc.line = 7;
    const char *devs[2][3] = {{"cpu:0", "cpu:1", "cpu:0, cpu:1"}, {NULL, NULL, "cpu:0 to cpu:2"}};
    for (int v = 0; v < 2; v++) {
        st->devices_listed = v == 0;
        st->n_devices = v == 0 ? 2 : 0;
        st->replicas = v == 0 ? 2 : 3;
        for (int i = 0; i < 2 && devs[v][i]; i++) snprintf(st->devices[i], sizeof st->devices[i], "%s", devs[v][i]);
        loom_strategy_args a = {.spec = &spec};
        loom_strategy *s = NULL;
        loom_err err = {0};
        CHECK(loom_strategy_open(&s, &a, &err) == LOOM_ECONFIG);
        CHECK(s == NULL);
        CHECK_CONTAINS(err.where, "t.cfg:7");
        CHECK_CONTAINS(err.msg, "strategy.cross_device_ops: \"test_gpu_mem\" reduces GPU memory only, but the "
                                "mirrored replicas are on the CPU");
        CHECK_CONTAINS(err.msg, devs[v][2]);
        CHECK_CONTAINS(err.hint, "reduce_to_one_device, hierarchical_copy, ring");
        CHECK(!strstr(err.hint, "test_gpu_mem"));
    }
}

static const loom_test tests[] = {
    {"ring", test_ring},
    {"hierarchical_copy", test_hierarchical_copy},
    {"reduce_to_one_device", test_reduce_to_one_device},
    {"version1_generic", test_version1_generic},
    {"own_per_rank_entry_points", test_own_per_rank_entry_points},
    {"memory_of_each_version", test_memory_of_each_version},
    {"auto_never_gpu_memory_for_cpu", test_auto_never_gpu_memory_for_cpu},
    {"strategy_refuses_gpu_memory_for_cpu", test_strategy_refuses_gpu_memory_for_cpu},
    {0},
};

int main(void)
{
    alarm(60); /* a rank left waiting is a failure, not a hang (the whole run takes well under a second) */
    return loom_test_run(tests);
}
