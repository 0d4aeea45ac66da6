/* test_xops.c - the cross-device ops against a float64 reference: every
 * built-in (and a version-1 op through the generic rendezvous), N = 1..8,
 * SUM/MEAN/MAX, broadcast from every root, all_gather, odd sizes up to 64 MiB;
 * bit-identical results across runs, ranks and entry points; more ranks than
 * cores sleep rather than spin; gradient pack plans. */
#include "distribute/distribute.h"
#include "distribute/xops_internal.h"
#include "harness.h"
#include "xops_v1.h"

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>

static const char *const builtin[] = {"reduce_to_one_device", "hierarchical_copy", "ring"};
static const loom_redop redops[] = {LOOM_REDUCE_SUM, LOOM_REDUCE_MEAN, LOOM_REDUCE_MAX};
static const char *const redop_name[] = {"SUM", "MEAN", "MAX"};
/* 1 element, primes around the 16384-float chunk, several chunks per segment
 * (more at 64 MiB below) */
static const int64_t sizes[] = {1, 2, 3, 7, 31, 257, 16381, 16411, 65537, 196613};
#define NSIZES ((int)(sizeof sizes / sizeof sizes[0]))

static const loom_cross_device_ops *op_named(const char *name)
{
    loom_err err;
    LOOM_ASSERT(loom_distribute_init(&err) == LOOM_OK);
    return loom_find_cross_device_ops(name);
}

/* ---- inputs and the float64 reference ---------------------------------------- */

/* A value in [-1, 1) with 24 random bits, a pure function of (seed, rank, i). */
static inline float value(uint64_t seed, int r, int64_t i)
{
    uint64_t z = seed * 0x9e3779b97f4a7c15ull + ((uint64_t)r << 40) + (uint64_t)i;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (float)((double)(z >> 40) / 8388608.0 - 1.0);
}

static void fill(float *buf, uint64_t seed, int r, int64_t lo, int64_t hi)
{
    for (int64_t i = lo; i < hi; i++) buf[i] = value(seed, r, i);
}

/* Elements [lo, hi) of got against the float64 reduction of the n ranks'
 * inputs: SUM/MEAN within the float rounding of n terms, MAX exact.
 * Returns the number of elements out of bounds (the first is printed). */
static long check_ref(const float *got, int n, uint64_t seed, int64_t lo, int64_t hi, loom_redop op)
{
    long bad = 0;
    for (int64_t i = lo; i < hi; i++) {
        double sum = 0, sumabs = 0, max = -INFINITY;
        for (int r = 0; r < n; r++) {
            double v = value(seed, r, i);
            sum += v;
            sumabs += fabs(v);
            if (v > max) max = v;
        }
        double ref = op == LOOM_REDUCE_MAX ? max : op == LOOM_REDUCE_MEAN ? sum / n : sum;
        double tol = op == LOOM_REDUCE_MAX ? 0 : (n + 1) * 0x1p-24 * sumabs / (op == LOOM_REDUCE_MEAN ? n : 1);
        if (!(fabs(got[i] - ref) <= tol) && !bad++)
            printf("#   element %lld of %lld: got %.9g, float64 reference %.9g (n %d, %s)\n", (long long)i,
                   (long long)hi, got[i], ref, n, redop_name[op]);
    }
    return bad;
}

static float **new_bufs(int n, int64_t count)
{
    float **b = calloc((size_t)n, sizeof *b);
    for (int r = 0; r < n; r++) b[r] = malloc((size_t)(count ? count : 1) * sizeof(float));
    return b;
}

static void free_bufs(float **b, int n)
{
    for (int r = 0; r < n; r++) free(b[r]);
    free(b);
}

/* ---- running n ranks on n threads -------------------------------------------- */

typedef struct ranks ranks;
typedef void (*rank_fn)(ranks *g, int r);
struct ranks {
    loom_xcomm       *comm;
    int               n;
    pthread_barrier_t bar; /* the test's own, between cases */
    float           **bufs, **outs;
    atomic_long       bad;
    atomic_int        failed_rc;
    void             *arg;
};

typedef struct rank_arg {
    ranks  *g;
    int     r;
    rank_fn fn;
} rank_arg;

static void *rank_main(void *p)
{
    rank_arg *a = p;
    a->fn(a->g, a->r);
    return NULL;
}

/* Runs fn(g, r) for r = 0..n-1, each on its own thread, over a communicator of op x. */
static void run_ranks(const loom_cross_device_ops *x, int n, rank_fn fn, ranks *g)
{
    loom_err err;
    g->n = n;
    atomic_store(&g->bad, 0);
    atomic_store(&g->failed_rc, 0);
    CHECK(loom_xcomm_open(&g->comm, x, n, &err) == LOOM_OK);
    pthread_barrier_init(&g->bar, NULL, (unsigned)n);
    pthread_t t[8];
    rank_arg a[8];
    for (int r = 0; r < n; r++) {
        a[r] = (rank_arg){g, r, fn};
        pthread_create(&t[r], NULL, rank_main, &a[r]);
    }
    for (int r = 0; r < n; r++) pthread_join(t[r], NULL);
    pthread_barrier_destroy(&g->bar);
    loom_xcomm_close(g->comm);
    g->comm = NULL;
}

/* Every rank: a buffer of `count` holding the same bits as rank 0's. */
static void same_as_rank0(ranks *g, int r, int64_t count)
{
    if (r && count && memcmp(g->bufs[r], g->bufs[0], (size_t)count * sizeof(float))) {
        printf("#   rank %d's result differs from rank 0's (n %d, count %lld)\n", r, g->n, (long long)count);
        atomic_fetch_add(&g->bad, 1);
    }
}

/* ---- all_reduce ---------------------------------------------------------------- */

static void all_reduce_cases(ranks *g, int r)
{
    loom_err err;
    int n = g->n;
    for (int si = 0; si < NSIZES; si++)
        for (int k = 0; k < 3; k++) {
            int64_t count = sizes[si];
            uint64_t seed = (uint64_t)(si * 3 + k + 1);
            fill(g->bufs[r], seed, r, 0, count);
            if (loom_xcomm_all_reduce(g->comm, r, g->bufs[r], count, redops[k], &err))
                atomic_store(&g->failed_rc, 1);
            pthread_barrier_wait(&g->bar);
            same_as_rank0(g, r, count);
            /* the ranks share the reference check of rank 0's result */
            long bad = check_ref(g->bufs[0], n, seed, count * r / n, count * (r + 1) / n, redops[k]);
            atomic_fetch_add(&g->bad, bad);
            pthread_barrier_wait(&g->bar);
        }
}

static void test_all_reduce_per_rank(void)
{
    for (int o = 0; o < 3; o++)
        for (int n = 1; n <= 8; n++) {
            ranks g = {0};
            g.bufs = new_bufs(n, sizes[NSIZES - 1]);
            run_ranks(op_named(builtin[o]), n, all_reduce_cases, &g);
            CHECK_MSG(atomic_load(&g.bad) == 0 && !atomic_load(&g.failed_rc), "%s, n %d: %ld bad elements",
                      builtin[o], n, atomic_load(&g.bad));
            free_bufs(g.bufs, n);
        }
}

static void test_all_reduce_n_buffers(void)
{
    loom_err err;
    for (int o = 0; o < 3; o++)
        for (int n = 1; n <= 8; n++) {
            float **b = new_bufs(n, sizes[NSIZES - 1]);
            long bad = 0;
            for (int si = 0; si < NSIZES; si++)
                for (int k = 0; k < 3; k++) {
                    int64_t count = sizes[si];
                    for (int r = 0; r < n; r++) fill(b[r], 7, r, 0, count);
                    CHECK(loom_all_reduce(op_named(builtin[o]), b, n, count, redops[k], &err) == LOOM_OK);
                    bad += check_ref(b[0], n, 7, 0, count, redops[k]);
                    for (int r = 1; r < n; r++) bad += memcmp(b[r], b[0], (size_t)count * sizeof(float)) != 0;
                }
            CHECK_MSG(bad == 0, "%s, n %d: %ld bad", builtin[o], n, bad);
            free_bufs(b, n);
        }
}

/* ---- determinism: per-rank twice == N-buffer once, bit for bit -------------- */

#define DET_COUNT 100003

static void det_cases(ranks *g, int r)
{
    loom_err err;
    float *keep = g->arg;
    for (int k = 0; k < 3; k++)
        for (int rep = 0; rep < 2; rep++) {
            fill(g->bufs[r], 99, r, 0, DET_COUNT);
            loom_xcomm_all_reduce(g->comm, r, g->bufs[r], DET_COUNT, redops[k], &err);
            pthread_barrier_wait(&g->bar);
            if (rep == 0 && r == 0) memcpy(keep + (int64_t)k * DET_COUNT, g->bufs[0], DET_COUNT * sizeof(float));
            if (rep == 1 && memcmp(keep + (int64_t)k * DET_COUNT, g->bufs[r], DET_COUNT * sizeof(float)))
                atomic_fetch_add(&g->bad, 1);
            pthread_barrier_wait(&g->bar);
        }
}

static void test_deterministic_bits(void)
{
    loom_err err;
    float *keep = malloc(3 * DET_COUNT * sizeof(float));
    for (int o = 0; o < 3; o++)
        for (int n = 1; n <= 8; n++) {
            ranks g = {0};
            g.bufs = new_bufs(n, DET_COUNT);
            g.arg = keep;
            run_ranks(op_named(builtin[o]), n, det_cases, &g);
            CHECK_MSG(atomic_load(&g.bad) == 0, "%s, n %d: a second run gave other bits", builtin[o], n);
            for (int k = 0; k < 3; k++) {
                for (int r = 0; r < n; r++) fill(g.bufs[r], 99, r, 0, DET_COUNT);
                loom_all_reduce(op_named(builtin[o]), g.bufs, n, DET_COUNT, redops[k], &err);
                CHECK_MSG(!memcmp(keep + (int64_t)k * DET_COUNT, g.bufs[0], DET_COUNT * sizeof(float)),
                          "%s, n %d, %s: the N-buffer entry point and the per-rank collective differ", builtin[o],
                          n, redop_name[k]);
            }
            free_bufs(g.bufs, n);
        }
    free(keep);
}

/* Ops may differ from each other in the last bits, but for n = 2 they agree. */
static void test_ops_agree_for_two(void)
{
    loom_err err;
    float *res[3];
    for (int o = 0; o < 3; o++) {
        float **b = new_bufs(2, DET_COUNT);
        for (int r = 0; r < 2; r++) fill(b[r], 5, r, 0, DET_COUNT);
        loom_all_reduce(op_named(builtin[o]), b, 2, DET_COUNT, LOOM_REDUCE_MEAN, &err);
        res[o] = b[0];
        free(b[1]);
        free(b);
    }
    CHECK(!memcmp(res[0], res[1], DET_COUNT * sizeof(float)));
    CHECK(!memcmp(res[0], res[2], DET_COUNT * sizeof(float)));
    for (int o = 0; o < 3; o++) free(res[o]);
}

/* ---- 64 MiB -------------------------------------------------------------------- */

#define BIG 16777259 /* the first prime above 2^24 floats: 64 MiB and 172 bytes */

/* At this size hashing every input twice would dominate: rank r's input is
 * the random table shifted by r, big[r + i], and the reference slides over it. */
static float *big;

static long check_big(const float *got, int n, int64_t lo, int64_t hi, loom_redop op)
{
    long bad = 0;
    for (int64_t i = lo; i < hi; i++) {
        double sum = 0, sumabs = 0, max = -INFINITY;
        for (int r = 0; r < n; r++) {
            double v = big[i + r];
            sum += v;
            sumabs += fabs(v);
            if (v > max) max = v;
        }
        double ref = op == LOOM_REDUCE_MAX ? max : op == LOOM_REDUCE_MEAN ? sum / n : sum;
        double tol = op == LOOM_REDUCE_MAX ? 0 : (n + 1) * 0x1p-24 * sumabs / (op == LOOM_REDUCE_MEAN ? n : 1);
        if (!(fabs(got[i] - ref) <= tol) && !bad++)
            printf("#   element %lld: got %.9g, float64 reference %.9g (n %d, %s)\n", (long long)i, got[i], ref, n,
                   redop_name[op]);
    }
    return bad;
}

static void big_case(ranks *g, int r)
{
    loom_err err;
    int n = g->n;
    loom_redop op = redops[n % 3];
    memcpy(g->bufs[r], big + r, (size_t)BIG * sizeof(float));
    if (loom_xcomm_all_reduce(g->comm, r, g->bufs[r], BIG, op, &err)) atomic_store(&g->failed_rc, 1);
    pthread_barrier_wait(&g->bar);
    same_as_rank0(g, r, BIG);
    atomic_fetch_add(&g->bad, check_big(g->bufs[0], n, BIG * (int64_t)r / n, BIG * (int64_t)(r + 1) / n, op));
}

/* N = 1..8, each with one op and reduction in turn, so each op meets 64 MiB at
 * several N (the full matrix runs at the smaller sizes above). */
static void test_all_reduce_64mib(void)
{
    big = malloc((BIG + 8) * sizeof(float));
    fill(big, 64, 0, 0, BIG + 8);
    ranks g = {0};
    g.bufs = new_bufs(8, BIG);
    for (int n = 1; n <= 8; n++) {
        const char *name = builtin[n % 3];
        run_ranks(op_named(name), n, big_case, &g);
        CHECK_MSG(atomic_load(&g.bad) == 0 && !atomic_load(&g.failed_rc), "%s, n %d, %s, 64 MiB: %ld bad", name,
                  n, redop_name[n % 3], atomic_load(&g.bad));
    }
    free_bufs(g.bufs, 8);
    free(big);
}

/* ---- broadcast and all_gather ----------------------------------------------- */

static const int64_t bsizes[] = {1, 31, 65537};

static void broadcast_cases(ranks *g, int r)
{
    loom_err err;
    for (int si = 0; si < 3; si++)
        for (int root = 0; root < g->n; root++) {
            int64_t count = bsizes[si];
            fill(g->bufs[r], 3, r, 0, count);
            loom_xcomm_broadcast(g->comm, r, g->bufs[r], count, root, &err);
            for (int64_t i = 0; i < count; i++)
                if (g->bufs[r][i] != value(3, root, i)) {
                    atomic_fetch_add(&g->bad, 1);
                    break;
                }
        }
}

static void test_broadcast_every_root(void)
{
    loom_err err;
    for (int o = 0; o < 3; o++)
        for (int n = 1; n <= 8; n++) {
            ranks g = {0};
            g.bufs = new_bufs(n, 65537);
            run_ranks(op_named(builtin[o]), n, broadcast_cases, &g);
            CHECK_MSG(atomic_load(&g.bad) == 0, "%s, n %d: per-rank broadcast wrong", builtin[o], n);
            for (int root = 0; root < n; root++) {
                for (int r = 0; r < n; r++) fill(g.bufs[r], 4, r, 0, 65537);
                CHECK(op_named(builtin[o])->broadcast(g.bufs, n, 65537, root, &err) == LOOM_OK);
                for (int r = 0; r < n; r++)
                    for (int64_t i = 0; i < 65537; i += 97) CHECK(g.bufs[r][i] == value(4, root, i));
            }
            free_bufs(g.bufs, n);
        }
}

static void gather_cases(ranks *g, int r)
{
    loom_err err;
    for (int si = 0; si < 3; si++) {
        int64_t count = bsizes[si];
        fill(g->bufs[r], 8, r, 0, count);
        memset(g->outs[r], 0xff, (size_t)(g->n * count) * sizeof(float));
        loom_xcomm_all_gather(g->comm, r, g->bufs[r], count, g->outs[r], &err);
        for (int k = 0; k < g->n; k++)
            for (int64_t i = 0; i < count; i++)
                if (g->outs[r][k * count + i] != value(8, k, i)) {
                    atomic_fetch_add(&g->bad, 1);
                    k = g->n;
                    break;
                }
        pthread_barrier_wait(&g->bar);
    }
}

static void test_all_gather(void)
{
    loom_err err;
    for (int o = 0; o < 3; o++)
        for (int n = 1; n <= 8; n++) {
            ranks g = {0};
            g.bufs = new_bufs(n, 65537);
            g.outs = new_bufs(n, 8 * 65537);
            run_ranks(op_named(builtin[o]), n, gather_cases, &g);
            CHECK_MSG(atomic_load(&g.bad) == 0, "%s, n %d: per-rank all_gather wrong", builtin[o], n);
            for (int r = 0; r < n; r++) fill(g.bufs[r], 9, r, 0, 31);
            CHECK(loom_all_gather(op_named(builtin[o]), g.bufs, n, 31, g.outs[0], &err) == LOOM_OK);
            for (int k = 0; k < n; k++)
                for (int64_t i = 0; i < 31; i++) CHECK(g.outs[0][k * 31 + i] == value(9, k, i));
            free_bufs(g.bufs, n);
            free_bufs(g.outs, n);
        }
}

/* ---- more ranks than cores: waiting sleeps ---------------------------------- */

static double cpu_seconds(void)
{
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Rank 7 arrives 300 ms late; the other seven wait for it inside the collective. */
static void late_rank(ranks *g, int r)
{
    loom_err err;
    int64_t count = 1000;
    fill(g->bufs[r], 11, r, 0, count);
    pthread_barrier_wait(&g->bar);
    if (r == 7) usleep(300000);
    loom_xcomm_all_reduce(g->comm, r, g->bufs[r], count, LOOM_REDUCE_SUM, &err);
    atomic_fetch_add(&g->bad, check_ref(g->bufs[r], 8, 11, 0, count, LOOM_REDUCE_SUM));
}

static void test_more_ranks_than_cores_sleep(void)
{
    for (int o = 0; o < 3; o++) {
        ranks g = {0};
        g.bufs = new_bufs(8, 1000);
        double c0 = cpu_seconds(), w0 = loom_now();
        run_ranks(op_named(builtin[o]), 8, late_rank, &g);
        double cpu = cpu_seconds() - c0, wall = loom_now() - w0;
        printf("# %s: 8 ranks on %d cores, one 300 ms late: %.3f s wall, %.3f s CPU\n", builtin[o],
               loom_num_cores(), wall, cpu);
        CHECK(atomic_load(&g.bad) == 0);
        CHECK(wall >= 0.3);
        CHECK_MSG(cpu < 0.1 * wall, "%s burnt %.3f s of CPU waiting %.3f s", builtin[o], cpu, wall);
        free_bufs(g.bufs, 8);
    }
}

/* ---- a version-1 op (a plugin built before the per-rank entry points) -------- */

static const v1_ops test_v1 = XOPS_V1("test_v1");

static void v1_cases(ranks *g, int r)
{
    loom_err err;
    for (int k = 0; k < 3; k++) {
        fill(g->bufs[r], 21, r, 0, 65537);
        loom_xcomm_all_reduce(g->comm, r, g->bufs[r], 65537, redops[k], &err);
        atomic_fetch_add(&g->bad, check_ref(g->bufs[r], g->n, 21, 0, 65537, redops[k]));
        pthread_barrier_wait(&g->bar);
    }
    fill(g->bufs[r], 22, r, 0, 65537);
    loom_xcomm_broadcast(g->comm, r, g->bufs[r], 65537, g->n - 1, &err);
    if (g->bufs[r][65536] != value(22, g->n - 1, 65536)) atomic_fetch_add(&g->bad, 1);
    fill(g->bufs[r], 23, r, 0, 257);
    loom_xcomm_all_gather(g->comm, r, g->bufs[r], 257, g->outs[r], &err);
    for (int k = 0; k < g->n; k++)
        if (g->outs[r][k * 257 + 256] != value(23, k, 256)) atomic_fetch_add(&g->bad, 1);
}

static void test_version1_op_generic_rendezvous(void)
{
    loom_err err;
    op_named("ring");
    const loom_cross_device_ops *x = loom_find_cross_device_ops("test_v1");
    if (!x) {
        CHECK(loom_register_cross_device_ops_from((const loom_cross_device_ops *)&test_v1, "tests/v1.so", &err) ==
              LOOM_OK);
        x = loom_find_cross_device_ops("test_v1");
    }
    CHECK(x != NULL);
    for (int n = 1; n <= 8 && x; n++) {
        ranks g = {0};
        g.bufs = new_bufs(n, 65537);
        g.outs = new_bufs(n, 8 * 257);
        run_ranks(x, n, v1_cases, &g);
        CHECK_MSG(atomic_load(&g.bad) == 0, "version-1 op, n %d", n);
        free_bufs(g.bufs, n);
        free_bufs(g.outs, n);
    }
    char names[256];
    CHECK_CONTAINS(loom_cross_device_ops_names(names, sizeof names), "test_v1");
}

static void test_registration_refusals(void)
{
    loom_err err;
    op_named("ring");
    loom_cross_device_ops bad = *op_named("ring");
    bad.name = "test_v5";
    bad.version = 5;
    CHECK(loom_register_cross_device_ops_from(&bad, "plugins/new.so", &err) == LOOM_EPLUGIN);
    CHECK_CONTAINS(err.msg, "version 5, this build speaks 1 to 4");
    CHECK_CONTAINS(err.where, "plugins/new.so");
    bad.version = 2;
    bad.comm_free = NULL;
    CHECK(loom_register_cross_device_ops_from(&bad, "plugins/half.so", &err) == LOOM_EPLUGIN);
    CHECK_CONTAINS(err.msg, "lack comm_free");
    bad = *op_named("ring");
    CHECK(loom_register_cross_device_ops_from(&bad, "plugins/dup.so", &err) == LOOM_EPLUGIN); /* name taken */
}

/* ---- version 4: collectives across the processes of a job ------------------------ */

static int job_open_stub(void **comm, const loom_job_args *a, loom_err *err)
{
    (void)a, (void)err;
    *comm = NULL;
    return LOOM_OK;
}
static void job_close_stub(void *comm) { (void)comm; }
static int job_all_reduce_stub(void *comm, float *buf, int64_t count, loom_redop op, loom_err *err)
{
    (void)comm, (void)buf, (void)count, (void)op, (void)err;
    return LOOM_OK;
}

static void test_job_ops_registration(void)
{
    loom_err err;
    op_named("ring");
    /* some of the three job entry points: refused, saying all or none */
    loom_cross_device_ops x = {.version = 4, .name = "test_job_half", .job_open = job_open_stub,
                               .job_all_reduce = job_all_reduce_stub};
    CHECK(loom_register_cross_device_ops_from(&x, "plugins/job_half.so", &err) == LOOM_EPLUGIN);
    CHECK_CONTAINS(err.msg, "some of job_open, job_close and job_all_reduce: all three or none");
    /* a job-only op (no in-process entry points): accepted, and found as one */
    static const loom_cross_device_ops job_only = {.version = 4, .name = "test_job_only", .caps = LOOM_XOPS_DEVICE_MEM,
                                                   .job_open = job_open_stub, .job_close = job_close_stub,
                                                   .job_all_reduce = job_all_reduce_stub};
    if (!loom_find_cross_device_ops("test_job_only"))
        CHECK(loom_register_cross_device_ops_from(&job_only, "plugins/job_only.so", &err) == LOOM_OK);
    CHECK(loom_xops_job(loom_find_cross_device_ops("test_job_only")) == &job_only);
    /* ... which "auto" never picks for replicas, even on GPUs (it works on device memory) */
    char why[256];
    CHECK(loom_xops_auto_(2, 1, why, sizeof why) != &job_only);
    /* one of all_reduce and broadcast without the other: refused */
    x = job_only;
    x.name = "test_job_one";
    x.all_reduce = op_named("ring")->all_reduce;
    CHECK(loom_register_cross_device_ops_from(&x, "plugins/job_one.so", &err) == LOOM_EPLUGIN);
    CHECK_CONTAINS(err.msg, "may leave out both, not one");
    /* the built-ins and version-3 ops have no job collectives */
    CHECK(loom_xops_job(op_named("ring")) == NULL);
    loom_cross_device_ops v3 = job_only;
    v3.version = 3; /* the job fields are not read at version 3 */
    CHECK(loom_xops_job(&v3) == NULL);
    /* version 3 still registers (and needs its in-process entry points) */
    v3 = *op_named("ring");
    v3.version = 3;
    v3.name = "test_v3";
    if (!loom_find_cross_device_ops("test_v3"))
        CHECK(loom_register_cross_device_ops_from(&v3, "plugins/v3.so", &err) == LOOM_OK);
}

/* ---- "auto" -------------------------------------------------------------------- */

static void test_auto_choice(void)
{
    char why[256];
    op_named("ring");
    for (int n = 1; n <= 16; n++) {
        const loom_cross_device_ops *x = loom_xops_auto_(n, 0, why, sizeof why);
        CHECK(x != NULL);
        CHECK(why[0] != 0);
        CHECK(x == loom_xops_auto_(n, 0, why, sizeof why)); /* a rule: the same every time */
    }
    CHECK(!strcmp(loom_xops_auto_(2, 0, why, sizeof why)->name, "ring"));
    /* no nccl plugin loaded: GPUs alone do not pick it */
    CHECK(strcmp(loom_xops_auto_(2, 1, why, sizeof why)->name, "nccl") != 0);
}

/* ---- packing ------------------------------------------------------------------- */

/* The MLP of configs/: dense 784x256, 256, 256x128, 128, 128x10, 10. */
static int mlp_params(loom_param_info *p)
{
    static const int64_t dims[6][2] = {{784, 256}, {256, 0}, {256, 128}, {128, 0}, {128, 10}, {10, 0}};
    int64_t off = 0;
    for (int i = 0; i < 6; i++) {
        memset(&p[i], 0, sizeof p[i]);
        snprintf(p[i].name, sizeof p[i].name, "dense_%d/%s", i / 2, i % 2 ? "bias" : "kernel");
        p[i].offset = off;
        p[i].shape = dims[i][1] ? loom_shape_make(2, (int64_t[]){dims[i][0], dims[i][1]})
                                : loom_shape_make(1, (int64_t[]){dims[i][0]});
        off += loom_shape_numel(&p[i].shape);
    }
    return 6;
}

#define MLP_TOTAL (784 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10)

static void test_pack_plan_bytes_per_pack(void)
{
    loom_err err;
    loom_param_info p[6];
    int n = mlp_params(p), np;
    loom_pack *k;
    /* 0: one pack */
    CHECK(loom_pack_plan(p, n, 0, 1, &k, &np, &err) == LOOM_OK);
    CHECK(np == 1 && k[0].offset == 0 && k[0].count == MLP_TOTAL && k[0].first == 0 && k[0].last == 5);
    loom_free(k);
    /* 1 byte: every tensor its own pack, last layer first (tf: a new pack once the current exceeds the target) */
    CHECK(loom_pack_plan(p, n, 1, 1, &k, &np, &err) == LOOM_OK);
    CHECK(np == 6);
    for (int i = 0; i < np && np == 6; i++) {
        CHECK(k[i].first == 5 - i && k[i].last == 5 - i);
        CHECK(k[i].offset == p[5 - i].offset && k[i].count == loom_shape_numel(&p[5 - i].shape));
    }
    loom_free(k);
    /* 4 KiB: [bias 10 (40 B), kernel 128x10 (5120 B)] exceeds it after the kernel; then
     * [bias 128, kernel 256x128] exceeds; then [bias 256, kernel 784x256] */
    CHECK(loom_pack_plan(p, n, 4096, 1, &k, &np, &err) == LOOM_OK);
    CHECK(np == 3);
    if (np == 3) {
        CHECK(k[0].first == 4 && k[0].last == 5 && k[0].count == 1290 && k[0].offset == MLP_TOTAL - 1290);
        CHECK(k[1].first == 2 && k[1].last == 3 && k[1].count == 256 * 128 + 128);
        CHECK(k[2].first == 0 && k[2].last == 1 && k[2].offset == 0);
    }
    loom_free(k);
    /* 100,000 bytes: 40 + 5,120 + 512 + 131,072 (the last added while the pack held 5,672 B),
     * then the rest: the packs reach past the target rather than fall short of it */
    CHECK(loom_pack_plan(p, n, 100000, 1, &k, &np, &err) == LOOM_OK);
    CHECK(np == 2);
    if (np == 2) {
        CHECK(k[0].first == 2 && k[0].last == 5 && k[1].first == 0 && k[1].last == 1);
        CHECK(k[0].offset + k[0].count == MLP_TOTAL && k[1].offset == 0 && k[1].count == 784 * 256 + 256);
    }
    loom_free(k);
}

static void test_pack_plan_num_packs(void)
{
    loom_err err;
    loom_param_info p[6];
    int n = mlp_params(p), np;
    loom_pack *k;
    CHECK(loom_pack_plan(p, n, 0, 3, &k, &np, &err) == LOOM_OK);
    CHECK(np == 3);
    if (np == 3) {
        int64_t chunk = MLP_TOTAL / 3;
        CHECK(k[2].offset == 0 && k[2].count == chunk && k[1].offset == chunk && k[1].count == chunk);
        CHECK(k[0].offset == 2 * chunk && k[0].count == MLP_TOTAL - 2 * chunk); /* the remainder, reduced first */
        CHECK(k[0].last == 5 && k[2].first == 0 && k[2].last == 0);
    }
    loom_free(k);
    CHECK(loom_pack_plan(p, n, 0, 0, &k, &np, &err) == LOOM_OK); /* 0: per tensor */
    CHECK(np == 6 && k[0].first == 5 && k[5].first == 0);
    loom_free(k);
    /* more packs than floats: empty ones are dropped */
    loom_param_info one[1];
    memset(one, 0, sizeof one);
    one[0].shape = loom_shape_make(1, (int64_t[]){3});
    CHECK(loom_pack_plan(one, 1, 0, 5, &k, &np, &err) == LOOM_OK);
    CHECK(np == 1 && k[0].count == 3);
    loom_free(k);
    /* a gap between tensors */
    p[3].offset += 1;
    CHECK(loom_pack_plan(p, n, 0, 1, &k, &np, &err) == LOOM_ESHAPE);
    CHECK_CONTAINS(err.where, "dense_1/bias");
}

/* Reducing pack by pack gives the whole-buffer result: bit-identical for
 * reduce_to_one_device and hierarchical_copy, within the reference for the ring. */
static void test_packs_reduce_like_whole(void)
{
    loom_err err;
    loom_param_info p[6];
    int n = mlp_params(p), np;
    loom_pack *k;
    CHECK(loom_pack_plan(p, n, 65536, 1, &k, &np, &err) == LOOM_OK);
    for (int o = 0; o < 3; o++) {
        float **whole = new_bufs(3, MLP_TOTAL), **packed = new_bufs(3, MLP_TOTAL);
        for (int r = 0; r < 3; r++) {
            fill(whole[r], 31, r, 0, MLP_TOTAL);
            fill(packed[r], 31, r, 0, MLP_TOTAL);
        }
        loom_all_reduce(op_named(builtin[o]), whole, 3, MLP_TOTAL, LOOM_REDUCE_SUM, &err);
        for (int i = 0; i < np; i++) {
            float *b[3] = {packed[0] + k[i].offset, packed[1] + k[i].offset, packed[2] + k[i].offset};
            loom_all_reduce(op_named(builtin[o]), b, 3, k[i].count, LOOM_REDUCE_SUM, &err);
        }
        CHECK(check_ref(packed[0], 3, 31, 0, MLP_TOTAL, LOOM_REDUCE_SUM) == 0);
        if (o < 2) CHECK(!memcmp(whole[0], packed[0], MLP_TOTAL * sizeof(float)));
        free_bufs(whole, 3);
        free_bufs(packed, 3);
    }
    loom_free(k);
}

/* ---- sharded update: reduce_scatter, shard, all_gather_shards --------------- */

static const int64_t ssizes[] = {1, 2, 7, 257, 16411, 65537};
#define NSSIZES (int)(sizeof ssizes / sizeof ssizes[0])

/* g->arg: (NSSIZES,) the all-reduce of each size's inputs, from the N-buffer
 * entry point. Each rank reduce-scatters, halves its shard (an element-wise
 * update) and all-gathers: every rank must end with the halved all-reduce,
 * bit for bit, and the shards must tile the buffer. */
static void shard_cases(ranks *g, int r)
{
    loom_err err;
    float **want = g->arg;
    for (int si = 0; si < NSSIZES; si++) {
        int64_t count = ssizes[si], lo, hi;
        fill(g->bufs[r], 11 + si, r, 0, count);
        if (loom_xcomm_reduce_scatter(g->comm, r, g->bufs[r], count, LOOM_REDUCE_SUM, &err))
            atomic_store(&g->failed_rc, 1);
        loom_xcomm_shard(g->comm, r, count, &lo, &hi);
        if (lo < 0 || hi > count || lo > hi || memcmp(g->bufs[r] + lo, want[si] + lo, (size_t)(hi - lo) * 4))
            atomic_fetch_add(&g->bad, 1);
        for (int64_t i = lo; i < hi; i++) g->bufs[r][i] *= 0.5f;
        if (loom_xcomm_all_gather_shards(g->comm, r, g->bufs[r], count, &err)) atomic_store(&g->failed_rc, 1);
        for (int64_t i = 0; i < count; i++)
            if (g->bufs[r][i] != want[si][i] * 0.5f) {
                atomic_fetch_add(&g->bad, 1);
                break;
            }
        /* the shards tile [0, count): their sizes add up and they do not overlap */
        int64_t total = 0, plo, phi;
        for (int k = 0; k < g->n; k++) {
            loom_xcomm_shard(g->comm, k, count, &plo, &phi);
            total += phi - plo;
            for (int j = 0; j < k; j++) {
                int64_t qlo, qhi;
                loom_xcomm_shard(g->comm, j, count, &qlo, &qhi);
                if (plo < qhi && qlo < phi) atomic_fetch_add(&g->bad, 1);
            }
        }
        if (total != count) atomic_fetch_add(&g->bad, 1);
        pthread_barrier_wait(&g->bar);
    }
}

/* Runs fn on every op (the built-ins and a version 1 op), n = 1..8, with
 * g->arg = want: for each size, the SUM all-reduce of the inputs fill(seed0
 * + size index) gives (by the op's N-buffer entry point), passed through
 * expect when not NULL; g->outs are a second buffer per rank. */
static void run_update_cases(uint64_t seed0, void (*expect)(float *want, int64_t count), rank_fn fn)
{
    loom_err err;
    const loom_cross_device_ops *ops[4] = {op_named(builtin[0]), op_named(builtin[1]), op_named(builtin[2]),
                                           (const loom_cross_device_ops *)&test_v1};
    for (int o = 0; o < 4; o++)
        for (int n = 1; n <= 8; n++) {
            float *want[NSSIZES];
            float **b = new_bufs(n, ssizes[NSSIZES - 1]), **p = new_bufs(n, ssizes[NSSIZES - 1]);
            for (int si = 0; si < NSSIZES; si++) {
                for (int r = 0; r < n; r++) fill(b[r], seed0 + (uint64_t)si, r, 0, ssizes[si]);
                CHECK(loom_all_reduce(ops[o], b, n, ssizes[si], LOOM_REDUCE_SUM, &err) == LOOM_OK);
                want[si] = malloc((size_t)ssizes[si] * sizeof(float));
                memcpy(want[si], b[0], (size_t)ssizes[si] * sizeof(float));
                if (expect) expect(want[si], ssizes[si]);
            }
            ranks g = {.bufs = b, .outs = p, .arg = want};
            run_ranks(ops[o], n, fn, &g);
            CHECK_MSG(atomic_load(&g.bad) == 0 && !atomic_load(&g.failed_rc), "%s, n %d: %ld bad cases", ops[o]->name,
                      n, atomic_load(&g.bad));
            for (int si = 0; si < NSSIZES; si++) free(want[si]);
            free_bufs(b, n);
            free_bufs(p, n);
        }
}

static void test_sharded_update(void) { run_update_cases(11, NULL, shard_cases); }

/* ---- the fused update: loom_xcomm_update ---------------------------------------- */

/* The apply of the fused update: params -= 0.5 grads over [lo, hi), and a
 * record of the ranges so the test can check they tile the rank's shard on
 * 16-float lines. */
typedef struct fused_rank {
    ranks  *g;
    int     r;
    float  *params;
    int64_t covered, lo_min, hi_max;
    int     misaligned;
} fused_rank;

static void fused_apply(void *arg, int64_t lo, int64_t hi)
{
    fused_rank *f = arg;
    float *grads = f->g->bufs[f->r];
    if (lo % 16) f->misaligned = 1;
    f->covered += hi - lo;
    if (lo < f->lo_min) f->lo_min = lo;
    if (hi > f->hi_max) f->hi_max = hi;
    for (int64_t i = lo; i < hi; i++) f->params[i] -= 0.5f * grads[i];
}

/* g->arg: (NSSIZES,) the expected variables: start - 0.5 * the all-reduce. */
static void fused_cases(ranks *g, int r)
{
    loom_err err;
    float **want = g->arg;
    for (int si = 0; si < NSSIZES; si++) {
        int64_t count = ssizes[si], lo, hi;
        fill(g->bufs[r], 21 + si, r, 0, count);
        fill(g->outs[r], 99, 0, 0, count); /* the variables: equal on every rank */
        fused_rank f = {.g = g, .r = r, .params = g->outs[r], .lo_min = count, .hi_max = 0};
        pthread_barrier_wait(&g->bar); /* every rank's variables are set before any rank writes into them */
        if (loom_xcomm_update(g->comm, r, g->bufs[r], g->outs[r], count, fused_apply, &f, &err))
            atomic_store(&g->failed_rc, 1);
        loom_xcomm_shard(g->comm, r, count, &lo, &hi);
        if (f.misaligned || f.covered != hi - lo || (hi > lo && (f.lo_min != lo || f.hi_max != hi))) {
            printf("#   rank %d of %d, count %lld: applied %lld floats in [%lld, %lld), shard [%lld, %lld)%s\n", r,
                   g->n, (long long)count, (long long)f.covered, (long long)f.lo_min, (long long)f.hi_max,
                   (long long)lo, (long long)hi, f.misaligned ? ", a range off a 16-float line" : "");
            atomic_fetch_add(&g->bad, 1);
        }
        if (memcmp(g->outs[r], want[si], (size_t)count * sizeof(float))) {
            printf("#   rank %d of %d, count %lld: variables differ from reduce + apply\n", r, g->n, (long long)count);
            atomic_fetch_add(&g->bad, 1);
        }
        pthread_barrier_wait(&g->bar);
    }
}

/* The variables the fused update must give: start - 0.5 * the all-reduce. */
static void fused_expect(float *want, int64_t count)
{
    float *start = malloc((size_t)count * sizeof(float));
    fill(start, 99, 0, 0, count);
    for (int64_t i = 0; i < count; i++) want[i] = start[i] - 0.5f * want[i];
    free(start);
}

/* Every op, n = 1..8, odd sizes: the fused update gives every rank the
 * variables of applying the all-reduced gradients, bit for bit, and calls
 * apply exactly over the rank's shard. */
static void test_fused_update(void) { run_update_cases(21, fused_expect, fused_cases); }

static const loom_test tests[] = {
    {"all_reduce_per_rank", test_all_reduce_per_rank},
    {"all_reduce_n_buffers", test_all_reduce_n_buffers},
    {"deterministic_bits", test_deterministic_bits},
    {"ops_agree_for_two", test_ops_agree_for_two},
    {"all_reduce_64mib", test_all_reduce_64mib},
    {"broadcast_every_root", test_broadcast_every_root},
    {"all_gather", test_all_gather},
    {"more_ranks_than_cores_sleep", test_more_ranks_than_cores_sleep},
    {"version1_op_generic_rendezvous", test_version1_op_generic_rendezvous},
    {"registration_refusals", test_registration_refusals},
    {"job_ops_registration", test_job_ops_registration},
    {"auto_choice", test_auto_choice},
    {"pack_plan_bytes_per_pack", test_pack_plan_bytes_per_pack},
    {"pack_plan_num_packs", test_pack_plan_num_packs},
    {"packs_reduce_like_whole", test_packs_reduce_like_whole},
    {"sharded_update", test_sharded_update},
    {"fused_update", test_fused_update},
    {0},
};

int main(void) { return loom_test_run(tests); }
