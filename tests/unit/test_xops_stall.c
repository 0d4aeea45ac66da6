/* test_xops_stall.c - bounded, observable waits in the per-rank collectives.
 * For every built-in op and N = 2, 3, 4: ranks calling different collectives
 * get LOOM_EUSAGE naming both (at the rendezvous when they share one, the
 * communicator then usable; from the watch when they do not, the
 * communicator then broken and every later call failing at once). For the
 * built-ins and a version 1 op (Loom's generic rendezvous): a late rank
 * makes the others log a stall report naming it, and the collective then
 * completes with the right sums; a rank that never comes makes the others
 * return LOOM_ETIMEOUT naming it and the collective, and its own call, when
 * it comes, fails at once. The warnings are read back from stderr, where
 * loom_log writes them. */
#include "distribute/distribute.h"
#include "harness.h"
#include "xops_v1.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#define N_MAX 4
#define COUNT 5000

static const char *const builtin[] = {"reduce_to_one_device", "hierarchical_copy", "ring", "stall_v1"};

/* A version 1 op (N-buffer entry points only): its ranks meet at Loom's
 * generic rendezvous, whose waits are watched too. */
static const v1_ops stall_v1 = XOPS_V1("stall_v1");

static const loom_cross_device_ops *op_named(const char *name)
{
    if (!strcmp(name, "stall_v1")) return (const loom_cross_device_ops *)&stall_v1;
    loom_err err;
    LOOM_ASSERT(loom_distribute_init(&err) == LOOM_OK);
    return loom_find_cross_device_ops(name);
}

typedef enum { ALL_REDUCE, BROADCAST, REDUCE_SCATTER, GATHER_SHARDS, UPDATE, NONE } coll;
static const char *const coll_name[] = {"all_reduce", "broadcast", "reduce_scatter", "all_gather_shards", "update"};

typedef struct group {
    loom_xcomm *comm;
    int         n;
    float       buf[N_MAX][COUNT], par[N_MAX][COUNT];
    coll        call[N_MAX];  /* what each rank calls; NONE: it stays away */
    useconds_t  delay[N_MAX]; /* before its call */
    int         rc[N_MAX];
    loom_err    err[N_MAX];
} group;

static void no_apply(void *arg, int64_t lo, int64_t hi)
{
    (void)arg, (void)lo, (void)hi;
}

static int call(group *g, int r, coll c, loom_err *err)
{
    float *b = g->buf[r];
    switch (c) {
    case ALL_REDUCE: return loom_xcomm_all_reduce(g->comm, r, b, COUNT, LOOM_REDUCE_SUM, err);
    case BROADCAST: return loom_xcomm_broadcast(g->comm, r, b, COUNT, 0, err);
    case REDUCE_SCATTER: return loom_xcomm_reduce_scatter(g->comm, r, b, COUNT, LOOM_REDUCE_SUM, err);
    case GATHER_SHARDS: return loom_xcomm_all_gather_shards(g->comm, r, b, COUNT, err);
    case UPDATE: return loom_xcomm_update(g->comm, r, b, g->par[r], COUNT, no_apply, NULL, err);
    case NONE: break;
    }
    return LOOM_OK;
}

static group *G;
static void *rank_main(void *p)
{
    int r = (int)(intptr_t)p;
    if (G->delay[r]) usleep(G->delay[r]);
    loom_err_clear(&G->err[r]);
    G->rc[r] = call(G, r, G->call[r], &G->err[r]);
    return NULL;
}

/* Runs every rank's call on a thread of its own and waits for all. */
static void run(group *g)
{
    pthread_t t[N_MAX];
    G = g;
    for (int r = 0; r < g->n; r++) {
        for (int i = 0; i < COUNT; i++) g->buf[r][i] = (float)(r + 1) + (float)(i % 5);
        pthread_create(&t[r], NULL, rank_main, (void *)(intptr_t)r);
    }
    for (int r = 0; r < g->n; r++) pthread_join(t[r], NULL);
}

static group *group_open(const char *op, int n)
{
    static group g;
    memset(&g, 0, sizeof g);
    g.n = n;
    loom_err err;
    LOOM_ASSERT(loom_xcomm_open(&g.comm, op_named(op), n, &err) == LOOM_OK);
    return &g;
}

/* Everyone calls c, all arrive: the sums are right on every rank. */
static void check_all_reduce_ok(group *g, const char *what)
{
    for (int r = 0; r < g->n; r++) g->call[r] = ALL_REDUCE, g->delay[r] = 0;
    run(g);
    for (int r = 0; r < g->n; r++) {
        CHECK_MSG(g->rc[r] == LOOM_OK, "%s: rank %d: %s", what, r, g->err[r].msg);
        float want = (float)(g->n * (g->n + 1) / 2) + (float)(g->n * (7 % 5));
        CHECK_MSG(g->buf[r][7] == want, "%s: rank %d got %g, want %g", what, r, g->buf[r][7], want);
    }
}

/* ---- different collectives ------------------------------------------------ */

/* The built-ins: a version 1 op starts every collective at the generic
 * rendezvous, where test_xops_agree.c has them refused. */
static void test_different_collectives(void)
{
    /* [0] everyone else, [1] the odd rank; the first two pairs meet at the op's
     * rendezvous, the third does not (the shards' gather is Loom's own) */
    static const coll pairs[][2] = {{REDUCE_SCATTER, UPDATE}, {ALL_REDUCE, BROADCAST}, {ALL_REDUCE, GATHER_SHARDS},
                                    {GATHER_SHARDS, ALL_REDUCE}, {UPDATE, GATHER_SHARDS}};
    for (int o = 0; o < 3; o++)
        for (int n = 2; n <= N_MAX; n++)
            for (size_t p = 0; p < sizeof pairs / sizeof *pairs; p++)
                for (int odd = 0; odd < n; odd += n - 1) {
                    group *g = group_open(builtin[o], n);
                    for (int r = 0; r < n; r++) g->call[r] = pairs[p][r == odd];
                    double t0 = loom_now();
                    run(g);
                    double dt = loom_now() - t0;
                    int meets = pairs[p][0] != GATHER_SHARDS && pairs[p][1] != GATHER_SHARDS;
                    for (int r = 0; r < n; r++) {
                        CHECK_MSG(g->rc[r] == LOOM_EUSAGE && g->err[r].code == LOOM_EUSAGE,
                                  "%s n %d %s/%s odd %d rank %d: rc %d: %s", builtin[o], n, coll_name[pairs[p][0]],
                                  coll_name[pairs[p][1]], odd, r, g->rc[r], g->err[r].msg);
                        CHECK_CONTAINS(g->err[r].msg, "the ranks called different collectives");
                        char a[64], b[64];
                        snprintf(a, sizeof a, "loom_xcomm_%s", coll_name[pairs[p][0]]);
                        snprintf(b, sizeof b, "loom_xcomm_%s", coll_name[pairs[p][1]]);
                        CHECK_CONTAINS(g->err[r].msg, a);
                        CHECK_CONTAINS(g->err[r].msg, b);
                        CHECK_CONTAINS(g->err[r].where, builtin[o]);
                    }
                    CHECK_MSG(dt < 2.0, "%s n %d: detecting it took %.2f s", builtin[o], n, dt);
                    if (o == 2 && n == 3 && odd == 0 && p >= 1 && p <= 2)
                        printf("# %s, %.3f s: %s\n", meets ? "at the rendezvous" : "by the watch", dt, g->err[1].msg);
                    if (meets) {
                        check_all_reduce_ok(g, "the call after a refused one");
                    } else { /* broken: the next call fails at once, on every rank */
                        for (int r = 0; r < n; r++) g->call[r] = ALL_REDUCE;
                        run(g);
                        for (int r = 0; r < n; r++) {
                            CHECK(g->rc[r] == LOOM_EUSAGE);
                            CHECK_CONTAINS(g->err[r].msg, "loom_xcomm_all_reduce: the communicator broke in an "
                                                          "earlier call: the ranks called different collectives");
                        }
                    }
                    loom_xcomm_close(g->comm);
                }
}

/* ---- stall reports and timeouts ------------------------------------------- */

/* stderr into a file while f runs; returns what was logged (static). */
static const char *captured(void (*f)(group *), group *g)
{
    static char text[16384];
    char path[] = "/tmp/loom_test_stall_XXXXXX";
    int fd = mkstemp(path), saved = dup(2);
    LOOM_ASSERT(fd >= 0 && saved >= 0);
    fflush(stderr);
    dup2(fd, 2);
    f(g);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    ssize_t k = pread(fd, text, sizeof text - 1, 0);
    text[k > 0 ? k : 0] = 0;
    close(fd);
    unlink(path);
    return text;
}

static void test_late_rank_warns_then_completes(void)
{
    for (int o = 0; o < 4; o++)
        for (int n = 2; n <= 3; n++) {
            group *g = group_open(builtin[o], n);
            check_all_reduce_ok(g, "the first call"); /* the late rank has made call #1 */
            loom_xcomm_set_timeouts(g->comm, 0.2, 0);
            for (int r = 0; r < n; r++) g->call[r] = ALL_REDUCE;
            g->delay[n - 1] = 500000;
            const char *log = captured(run, g);
            g->delay[n - 1] = 0;
            char want[200];
            for (int r = 0; r < n; r++) CHECK_MSG(g->rc[r] == LOOM_OK, "%s rank %d: %s", builtin[o], r, g->err[r].msg);
            float sum = (float)(n * (n + 1) / 2) + (float)(n * 2);
            CHECK(g->buf[0][2] == sum && g->buf[n - 1][2] == sum);
            CHECK_CONTAINS(log, "warning: ");
            CHECK_CONTAINS(log, ": collective stalled: rank 0 has waited 0.");
            CHECK_CONTAINS(log, "in loom_xcomm_all_reduce #2 (5000 floats)");
            snprintf(want, sizeof want, "missing: rank %d (last entered %s all_reduce #1, returned from it, and "
                     "has not reached #2)", n - 1, builtin[o]);
            CHECK_CONTAINS(log, want);
            CHECK_CONTAINS(log, n == 2 ? "ready: rank 0;" : "ready: rank 0, 1;");
            if (o == 2 && n == 3) printf("# logged:\n# %.*s", (int)(strchr(log, '\n') - log + 1), log);
            check_all_reduce_ok(g, "the call after a stall"); /* not broken */
            loom_xcomm_close(g->comm);
        }
}

static void test_missing_rank_times_out(void)
{
    for (int o = 0; o < 4; o++)
        for (int n = 2; n <= N_MAX; n++) {
            group *g = group_open(builtin[o], n);
            loom_xcomm_set_timeouts(g->comm, 0, 0.3);
            for (int r = 0; r < n; r++) g->call[r] = r == n - 1 ? NONE : ALL_REDUCE;
            double t0 = loom_now();
            const char *log = captured(run, g);
            double dt = loom_now() - t0;
            char logged[120];
            snprintf(logged, sizeof logged, "warning: %s: collective timed out after 0.3 s: rank ", builtin[o]);
            CHECK_CONTAINS(log, logged); /* at once, by the rank that gave up, for a caller stuck waiting for rank n-1 */
            CHECK_MSG(dt >= 0.29 && dt < 1.5, "%s n %d: timed out after %.2f s", builtin[o], n, dt);
            char want[120];
            snprintf(want, sizeof want, "missing: rank %d (has made no call)", n - 1);
            for (int r = 0; r < n - 1; r++) {
                CHECK_MSG(g->rc[r] == LOOM_ETIMEOUT, "%s n %d rank %d: rc %d: %s", builtin[o], n, r, g->rc[r],
                          g->err[r].msg);
                CHECK_CONTAINS(g->err[r].msg, "collective timed out after 0.3 s: rank ");
                CHECK_CONTAINS(g->err[r].msg, "in loom_xcomm_all_reduce #1 (5000 floats)");
                CHECK_CONTAINS(g->err[r].msg, want);
                CHECK_CONTAINS(g->err[r].hint, "strategy.collective_timeout");
            }
            if (o == 2 && n == 3) printf("# %s\n", g->err[0].msg);
            /* the missing rank comes at last: its call, and any other, fails at once */
            for (int r = 0; r < n; r++) g->call[r] = r == n - 1 ? ALL_REDUCE : NONE;
            run(g);
            CHECK(g->rc[n - 1] == LOOM_ETIMEOUT);
            CHECK_CONTAINS(g->err[n - 1].msg, "the communicator broke in an earlier call: collective timed out");
            for (int r = 0; r < n; r++) g->call[r] = BROADCAST;
            run(g);
            for (int r = 0; r < n; r++) CHECK(g->rc[r] == LOOM_ETIMEOUT);
            loom_xcomm_close(g->comm);
        }
}

static const loom_test tests[] = {
    {"different_collectives", test_different_collectives},
    {"late_rank_warns_then_completes", test_late_rank_warns_then_completes},
    {"missing_rank_times_out", test_missing_rank_times_out},
    {0},
};

int main(void)
{
    alarm(100); /* a rank left waiting is a failure, not a hang */
    return loom_test_run(tests);
}
