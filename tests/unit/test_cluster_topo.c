/* test_cluster_topo.c - the cluster topology: Slurm's hostlist and tasks per
 * node, --task, TF_CONFIG, Slurm and MPI environments, and every error of
 * loom_cluster_resolve (unknown role, index out of range, duplicate address,
 * malformed TF_CONFIG with its byte offset, sources that disagree, a role the
 * strategy cannot use, no secret off loopback), with the message asserted. */
#include "test_util.h"
#include "cluster/cluster.h"
#include "cluster/topology_internal.h"
#include "distribute/distribute.h"

#include <sys/stat.h>
#include <unistd.h>

/* good_minimal.cfg with overrides; NULL (and a failed check) when it does not load. */
static loom_spec *load_spec(const char *const *sets, int n)
{
    loom_spec *s = NULL;
    loom_errlist errs;
    int rc = loom_config_load(&s, cfg_path("good_minimal.cfg"), sets, n, &errs);
    char buf[4096];
    errs_text(&errs, buf, sizeof buf);
    CHECK_MSG(rc == LOOM_OK, "config: %s", buf);
    return s;
}

#define MWM "strategy.type=multi_worker_mirrored"
#define W2 "cluster.worker=[\"127.0.0.1:2222\", \"127.0.0.1:2223\"]"

/* Resolves with the given environment; the error text (where: msg hint) in msg. */
static int resolve(loom_cluster **c, const loom_spec *s, const char *task, const char *const *env, char *msg, size_t n)
{
    loom_err err = {0};
    static const char *const none[] = {NULL};
    int rc = loom_cluster_resolve(c, s, loom_strategy_roles(s), task, (char *const *)(env ? env : none), &err);
    if (msg) snprintf(msg, n, "%s: %s | %s", err.where, err.msg, err.hint);
    return rc;
}

#define EXPECT_ERR(spec, task, env, sub)                                                              \
    do {                                                                                              \
        loom_cluster *c_ = NULL;                                                                      \
        char m_[2048];                                                                                \
        int rc_ = resolve(&c_, spec, task, env, m_, sizeof m_);                                       \
        CHECK_MSG(rc_ != LOOM_OK && c_ == NULL, "expected an error with \"%s\", got rc %d", sub, rc_); \
        CHECK_MSG(strstr(m_, sub) != NULL, "error \"%s\" lacks \"%s\"", m_, sub);                     \
        loom_cluster_free(c_);                                                                        \
    } while (0)

static void test_hostlist(void)
{
    loom_hostname *h = NULL;
    int n = 0;
    char why[256];
    CHECK(loom_slurm_hostlist_("node[01-04,07]", &h, &n, why, sizeof why) == 0);
    CHECK(n == 5);
    if (n == 5) {
        CHECK(!strcmp(h[0].s, "node01") && !strcmp(h[3].s, "node04") && !strcmp(h[4].s, "node07"));
    }
    loom_free(h);
    CHECK(loom_slurm_hostlist_("h[1-2]-ib,x", &h, &n, why, sizeof why) == 0);
    CHECK(n == 3 && !strcmp(h[0].s, "h1-ib") && !strcmp(h[1].s, "h2-ib") && !strcmp(h[2].s, "x"));
    loom_free(h);
    CHECK(loom_slurm_hostlist_("r[1-2]n[08-10]", &h, &n, why, sizeof why) == 0);
    CHECK(n == 6 && !strcmp(h[0].s, "r1n08") && !strcmp(h[2].s, "r1n10") && !strcmp(h[5].s, "r2n10"));
    loom_free(h);
    CHECK(loom_slurm_hostlist_("a.example.org,b", &h, &n, why, sizeof why) == 0);
    CHECK(n == 2 && !strcmp(h[0].s, "a.example.org"));
    loom_free(h);
    static const struct { const char *list, *why; } bad[] = {
        {"node[01-", "'[' at byte 4 is never closed"},
        {"node[4-1]", "runs backwards"},
        {"node[a]", "expected a number or a range like 01-04 at byte 5"},
        {"a,,b", "empty host name at byte 2"},
        {"a,", "trailing ','"},
        {"node]1", "']' at byte 4 without its '['"},
        {"n[1-2[3]]", "nested '[' at byte 5"},
        {"n[]", "empty range"},
        {"n[1,]", "empty number"},
        {"n[1-]", "empty number"},
        {"bad host", "unexpected ' ' at byte 3"},
        {"", "empty node list"},
        {"n[0-99999]", "longer than 65536 hosts"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        h = NULL;
        why[0] = 0;
        int rc = loom_slurm_hostlist_(bad[i].list, &h, &n, why, sizeof why);
        CHECK_MSG(rc == -1 && h == NULL, "\"%s\" accepted", bad[i].list);
        CHECK_MSG(strstr(why, bad[i].why) != NULL, "\"%s\": \"%s\" lacks \"%s\"", bad[i].list, why, bad[i].why);
        loom_free(h);
    }
}

static void test_tasks_per_node(void)
{
    int c[8];
    char why[128];
    CHECK(loom_slurm_tasks_per_node_("2(x3),1", c, 8, why, sizeof why) == 4);
    CHECK(c[0] == 2 && c[2] == 2 && c[3] == 1);
    CHECK(loom_slurm_tasks_per_node_("4", c, 8, why, sizeof why) == 1 && c[0] == 4);
    CHECK(loom_slurm_tasks_per_node_("2(3)", c, 8, why, sizeof why) == -1 && strstr(why, "(xN)"));
    CHECK(loom_slurm_tasks_per_node_("0", c, 8, why, sizeof why) == -1);
    CHECK(loom_slurm_tasks_per_node_("2,", c, 8, why, sizeof why) == -1 && strstr(why, "trailing"));
    CHECK(loom_slurm_tasks_per_node_("1(x9)", c, 8, why, sizeof why) == -1 && strstr(why, "more than 8 nodes"));
}

static void test_task_flag(void)
{
    loom_role r;
    int i;
    char why[256];
    CHECK(loom_task_parse_("worker:12", &r, &i, why, sizeof why) == 0 && r == LOOM_ROLE_WORKER && i == 12);
    CHECK(loom_task_parse_("chief:0", &r, &i, why, sizeof why) == 0 && r == LOOM_ROLE_CHIEF && i == 0);
    CHECK(loom_task_parse_("wrker:1", &r, &i, why, sizeof why) == -1 && strstr(why, "unknown role \"wrker\"") &&
          strstr(why, "did you mean \"worker\""));
    CHECK(loom_task_parse_("worker:-1", &r, &i, why, sizeof why) == -1 && strstr(why, "integer >= 0"));
    CHECK(loom_task_parse_("worker:x", &r, &i, why, sizeof why) == -1);
    CHECK(loom_task_parse_("worker", &r, &i, why, sizeof why) == -1 && strstr(why, "ROLE:INDEX"));
    char buf[32];
    CHECK(!strcmp(loom_task_name(LOOM_ROLE_EVALUATOR, 0, buf, sizeof buf), "evaluator:0"));
    CHECK(loom_role_parse("ps") == LOOM_ROLE_PS && loom_role_parse("master") == -1);
    CHECK(loom_host_is_loopback_("127.0.0.1") && loom_host_is_loopback_("127.1.2.3") && loom_host_is_loopback_("::1") &&
          loom_host_is_loopback_("localhost"));
    CHECK(!loom_host_is_loopback_("10.0.0.1") && !loom_host_is_loopback_("node01") &&
          !loom_host_is_loopback_("127.0.0.1.example.com"));
}

static void test_config_and_flag(void)
{
    const char *sets[] = {MWM, "cluster.chief=[\"127.0.0.1:2221\"]", W2, "cluster.evaluator=[\"127.0.0.1:2224\"]"};
    loom_spec *s = load_spec(sets, 4);
    if (!s) return;
    loom_cluster *c = NULL;
    char msg[2048];
    CHECK(resolve(&c, s, "worker:1", NULL, msg, sizeof msg) == LOOM_OK);
    if (c) {
        CHECK(c->role == LOOM_ROLE_WORKER && c->index == 1 && c->task_from == LOOM_FROM_FLAG);
        CHECK(c->addrs_from == LOOM_FROM_CONFIG);
        CHECK(c->n_tasks[LOOM_ROLE_CHIEF] == 1 && c->n_tasks[LOOM_ROLE_WORKER] == 2 && c->n_tasks[LOOM_ROLE_EVALUATOR] == 1);
        CHECK(c->n_train_ranks == 3 && c->rank == 2);
        CHECK(loom_cluster_rank_task(c, 0)->role == LOOM_ROLE_CHIEF);
        CHECK(loom_cluster_rank_task(c, 2)->port == 2223 && !strcmp(loom_cluster_rank_task(c, 2)->host, "127.0.0.1"));
        CHECK(c->connect_timeout == 60 && c->heartbeat_timeout == 30 && c->heartbeat_interval == 6);
        CHECK(c->secret_len == 0 && c->config_text && strstr(c->config_text, "127.0.0.1:2223"));
        CHECK(!strstr(c->config_text, "runs/minimal")); /* model_dir is a per-task key */
    }
    loom_cluster_free(c);
    c = NULL;
    CHECK(resolve(&c, s, "evaluator:0", NULL, msg, sizeof msg) == LOOM_OK && c && c->rank == -1);
    loom_cluster_free(c);
    EXPECT_ERR(s, "worker:2", NULL, "task index out of range: worker:2, but the cluster");
    EXPECT_ERR(s, "worker:2", NULL, "has 2 worker tasks (worker:0 to worker:1)");
    EXPECT_ERR(s, "ps:0", NULL, "no ps tasks");
    EXPECT_ERR(s, "boss:0", NULL, "unknown role \"boss\"");
    EXPECT_ERR(s, NULL, NULL, "the cluster has 4 tasks; which one is this process?");
    loom_err err = {0};
    c = NULL;
    static const char *const none[] = {NULL};
    CHECK(loom_cluster_resolve_any(&c, s, loom_strategy_roles(s), NULL, (char *const *)none, &err) == LOOM_OK && c && c->index == -1 &&
          c->rank == -1 && c->task_from == LOOM_FROM_NONE && c->n_train_ranks == 3);
    loom_cluster_free(c);
    CHECK(loom_cluster_resolve_any(&c, s, loom_strategy_roles(s), "worker:7", (char *const *)none, &err) == LOOM_ECONFIG && !c);
    loom_config_free(s);

    /* no cluster: one process, and --task is refused */
    s = load_spec(NULL, 0);
    if (!s) return;
    c = (loom_cluster *)1;
    CHECK(resolve(&c, s, NULL, NULL, msg, sizeof msg) == LOOM_OK && c == NULL);
    EXPECT_ERR(s, "worker:0", NULL, "--task worker:0, but there is no cluster");
    loom_config_free(s);
}

static void test_strategy_roles(void)
{
    const char *ps[] = {MWM, W2, "cluster.ps=[\"127.0.0.1:2230\"]"};
    loom_spec *s = load_spec(ps, 3);
    if (s) EXPECT_ERR(s, "worker:0", NULL, "multi_worker_mirrored has no use for ps tasks");
    loom_config_free(s);
    /* a one-process strategy ignores a cluster of several tasks (issue 22):
     * one process, also when --task names one of them */
    const char *mirrored[] = {"strategy.type=mirrored", "strategy.replicas=2", W2};
    s = load_spec(mirrored, 3);
    loom_cluster *c = NULL;
    char msg[2048];
    if (s) CHECK_MSG(resolve(&c, s, "worker:0", NULL, msg, sizeof msg) == LOOM_OK && c == NULL, "%s", msg);
    if (s) CHECK_MSG(resolve(&c, s, NULL, NULL, msg, sizeof msg) == LOOM_OK && c == NULL, "%s", msg);
    loom_config_free(s);
    const char *one[] = {"cluster.worker=[\"127.0.0.1:2222\"]"}; /* a one-task cluster is one process */
    s = load_spec(one, 1);
    if (s) CHECK_MSG(resolve(&c, s, NULL, NULL, msg, sizeof msg) == LOOM_OK && c && c->index == 0, "%s", msg);
    loom_cluster_free(c);
    loom_config_free(s);
}

/* The strategy-kind switch topology.c had before strategies described
 * their roles (issue 12), kept here as the oracle: every built-in strategy
 * x cluster shape must give the same accept or the same error (where, message
 * and hint) through the description. Its output was checked against the
 * release binary of main 91a28dc on the same table (loom check). */
static int old_switch(const loom_spec *spec, const int *n, const char *from, loom_err *err)
{
    const loom_strategy_spec *st = &spec->strategy;
    char w[LOOM_PATH_MAX + 16];
    loom_loc_str(&st->loc, w, sizeof w);
    /* (before issue 22 a one-process strategy refused a cluster of several
     * tasks; now it ignores it with a warning: no cluster, LOOM_OK) */
    if (!strcmp(st->name, "one_device") || !strcmp(st->name, "mirrored") || !strcmp(st->name, "central_storage"))
        return LOOM_OK;
    if (!strcmp(st->name, "multi_worker_mirrored")) {
        if (n[LOOM_ROLE_PS] > 0) {
            loom_err_set(err, LOOM_ECONFIG, w, "multi_worker_mirrored has no use for ps tasks, but the cluster (from "
                         "%s) has %d", from, n[LOOM_ROLE_PS]);
            return loom_err_hint(err, "remove the ps tasks (variables are mirrored on every worker), or use "
                                      "parameter_server");
        }
        if (n[LOOM_ROLE_CHIEF] + n[LOOM_ROLE_WORKER] == 0)
            return loom_err_set(err, LOOM_ECONFIG, w, "multi_worker_mirrored needs a chief or a worker, but the "
                                "cluster (from %s) has none", from);
        return LOOM_OK;
    }
    int nw = n[LOOM_ROLE_WORKER], nc = n[LOOM_ROLE_CHIEF];
    if (n[LOOM_ROLE_PS] == 0) {
        loom_err_set(err, LOOM_ECONFIG, w, "parameter_server needs ps tasks to hold the variables, but the cluster "
                     "(from %s) has none", from);
        return loom_err_hint(err, "add cluster.ps = [\"host:port\"] (loom launch --local --ps 1), or use "
                                  "multi_worker_mirrored");
    }
    if (nw == 0 || nc != 1) {
        loom_err_set(err, LOOM_ECONFIG, w, "parameter_server needs one chief (the coordinator) and at least one "
                     "worker, but the cluster (from %s) has %d chief%s and %d worker%s", from, nc, nc == 1 ? "" : "s",
                     nw, nw == 1 ? "" : "s");
        return loom_err_hint(err, "declare cluster.chief (one task) and cluster.worker (loom launch --local "
                                  "--workers 2 --ps 1)");
    }
    const loom_ps_sync_spec *y = &st->sync;
    if (!y->enabled) return LOOM_OK;
    char yw[LOOM_PATH_MAX + 16];
    loom_loc_str(&y->loc, yw, sizeof yw);
    int m = y->total_replicas > 0 ? y->total_replicas : nw;
    if (m != nw) {
        loom_err_set(err, LOOM_ECONFIG, yw, "strategy.sync.total_replicas = %d, but the cluster (from %s) has %d "
                     "worker%s", m, from, nw, nw == 1 ? "" : "s");
        return loom_err_hint(err, "set total_replicas to the number of workers (or leave it out)");
    }
    if (y->replicas_to_aggregate > m) {
        loom_err_set(err, LOOM_ECONFIG, yw, "strategy.sync.replicas_to_aggregate = %d is more than the %d worker%s "
                     "of the cluster (from %s): no step could gather that many gradients", y->replicas_to_aggregate,
                     m, m == 1 ? "" : "s", from);
        return loom_err_hint(err, "aggregate at most one gradient per worker");
    }
    return LOOM_OK;
}

/* The cluster settings for n tasks per role on 127.0.0.1 (sets[] points into buf). */
static int cluster_sets(const int *n, const char **sets, char buf[LOOM_ROLE_COUNT][256])
{
    static const char *const names[] = {"chief", "worker", "ps", "evaluator"};
    int k = 0, port = 24000;
    for (int r = 0; r < LOOM_ROLE_COUNT; r++) {
        if (!n[r]) continue;
        size_t len = (size_t)snprintf(buf[r], 256, "cluster.%s=[", names[r]);
        for (int i = 0; i < n[r]; i++)
            len += (size_t)snprintf(buf[r] + len, 256 - len, "%s\"127.0.0.1:%d\"", i ? ", " : "", port++);
        snprintf(buf[r] + len, 256 - len, "]");
        sets[k++] = buf[r];
    }
    return k;
}

static void test_roles_as_before(void)
{
    static const char *const strategies[][3] = {
        {"strategy.type=one_device"},
        {"strategy.type=mirrored", "strategy.replicas=2"},
        {"strategy.type=central_storage", "strategy.replicas=2"},
        {MWM},
        {"strategy.type=parameter_server"},
        {"strategy.type=parameter_server", "strategy.sync.replicas_to_aggregate=2"},
        {"strategy.type=parameter_server", "strategy.sync.total_replicas=3", "strategy.sync.replicas_to_aggregate=2"},
    };
    int cases = 0, errors = 0;
    for (size_t si = 0; si < sizeof strategies / sizeof *strategies; si++)
        for (int shape = 0; shape < 2 * 3 * 2 * 2; shape++) {
            int n[LOOM_ROLE_COUNT] = {shape % 2, shape / 2 % 3, shape / 6 % 2, shape / 12};
            if (n[0] + n[1] + n[2] + n[3] == 0) continue; /* no cluster: one process, nothing to check */
            const char *sets[8];
            char buf[LOOM_ROLE_COUNT][256];
            int k = 0;
            for (int j = 0; j < 3 && strategies[si][j]; j++) sets[k++] = strategies[si][j];
            k += cluster_sets(n, sets + k, buf);
            loom_spec *s = load_spec(sets, k);
            if (!s) continue;
            loom_cluster *c = NULL;
            loom_err got = {0}, want = {0};
            static const char *const none[] = {NULL};
            int rc = loom_cluster_resolve_any(&c, s, loom_strategy_roles(s), NULL, (char *const *)none, &got);
            char from[64];
            snprintf(from, sizeof from, "--set cluster.%s", n[0] ? "chief" : n[1] ? "worker" : n[2] ? "ps" : "evaluator");
            int old = old_switch(s, n, from, &want);
            cases++;
            bool same = rc == old && !strcmp(got.where, want.where) && !strcmp(got.msg, want.msg) &&
                        !strcmp(got.hint, want.hint);
            errors += rc != LOOM_OK;
            bool alone = si < 3 && n[0] + n[1] + n[2] + n[3] > 1; /* ignored: one process */
            if (alone) CHECK_MSG(rc == LOOM_OK && c == NULL, "%s c%d w%d p%d e%d: the cluster is not ignored", sets[0],
                                 n[0], n[1], n[2], n[3]);
            CHECK_MSG(same, "%s c%d w%d p%d e%d: got %d \"%s: %s | %s\", before %d \"%s: %s | %s\"", sets[0], n[0], n[1],
                      n[2], n[3], rc, got.where, got.msg, got.hint, old, want.where, want.msg, want.hint);
            loom_cluster_free(c);
            loom_config_free(s);
        }
    CHECK_MSG(cases == 7 * 23 && errors > 60 && errors < cases, "%d cases, %d refused", cases, errors);
}

/* A strategy registered from outside (as a plugin's): its description is
 * honoured as a built-in's is, and one of ops version 4 (before roles) is
 * given any cluster, as every plugin strategy was before. */
static int evaluator_check(const loom_spec *spec, const int *n, const char *from, loom_err *err)
{
    (void)spec;
    return n[LOOM_ROLE_EVALUATOR] > 1 ? loom_err_set(err, LOOM_ECONFIG, from, "at most one evaluator") : LOOM_OK;
}
static int nop_open(loom_strategy *s, const loom_strategy_args *a, loom_err *err) { (void)s, (void)a, (void)err; return LOOM_OK; }
static void nop_close(loom_strategy *s) { (void)s; }
static const loom_cluster_roles watched_roles = {
    .use = {[LOOM_ROLE_CHIEF] = LOOM_ROLE_REFUSED, [LOOM_ROLE_EVALUATOR] = LOOM_ROLE_REQUIRED},
    .why = {[LOOM_ROLE_EVALUATOR] = "to watch the checkpoints"},
    .hint = {[LOOM_ROLE_CHIEF] = "worker 0 coordinates", [LOOM_ROLE_EVALUATOR] = "add cluster.evaluator"},
    .check = evaluator_check,
};
static const loom_strategy_ops watched_ops = {
    .version = 5, .name = "watched", .open = nop_open, .close = nop_close, .roles = &watched_roles,
};
static const loom_strategy_ops old_ops = {.version = 4, .name = "old_plugin", .open = nop_open, .close = nop_close};

static void expect_roles(const char *type, const char *cluster, const char *cluster2, const char *want)
{
    char t[64];
    snprintf(t, sizeof t, "strategy.type=%s", type);
    const char *sets[] = {t, cluster, cluster2};
    loom_spec *s = load_spec(sets, cluster2 ? 3 : 2);
    if (!s) return;
    loom_cluster *c = NULL;
    loom_err err = {0};
    static const char *const none[] = {NULL};
    int rc = loom_cluster_resolve_any(&c, s, loom_strategy_roles(s), NULL, (char *const *)none, &err);
    char msg[2048];
    snprintf(msg, sizeof msg, "%s: %s | %s", err.where, err.msg, err.hint);
    if (want) CHECK_MSG(rc == LOOM_ECONFIG && !c && !strcmp(msg, want), "%s %s: got \"%s\"", type, cluster, msg);
    else CHECK_MSG(rc == LOOM_OK && c, "%s %s: got \"%s\"", type, cluster, msg);
    loom_cluster_free(c);
    loom_config_free(s);
}

static void test_plugin_roles(void)
{
    loom_err err = {0};
    CHECK(loom_distribute_init(&err) == LOOM_OK);
    CHECK(loom_register_strategy_from(&watched_ops, "test/watched.so", &err) == LOOM_OK);
    CHECK(loom_register_strategy_from(&old_ops, "test/old.so", &err) == LOOM_OK);
    CHECK(!loom_strategy_builtin(&watched_ops) && loom_strategy_builtin(loom_find_strategy("mirrored")));
    expect_roles("watched", W2, "cluster.evaluator=[\"127.0.0.1:2230\"]", NULL);
    expect_roles("watched", W2, NULL,
                 "--set strategy.type: watched needs evaluator tasks to watch the checkpoints, but the cluster (from "
                 "--set cluster.worker) has none | add cluster.evaluator");
    expect_roles("watched", "cluster.chief=[\"127.0.0.1:2229\"]", "cluster.evaluator=[\"127.0.0.1:2230\"]",
                 "--set strategy.type: watched has no use for chief tasks, but the cluster (from --set cluster.chief) "
                 "has 1 | worker 0 coordinates");
    /* refusing the chief, it does not ask for "a chief or a worker" */
    expect_roles("watched", "cluster.evaluator=[\"127.0.0.1:2230\"]", NULL, NULL);
    expect_roles("watched", W2, "cluster.evaluator=[\"127.0.0.1:2230\", \"127.0.0.1:2231\"]",
                 "--set cluster.worker: at most one evaluator | ");
    /* ops version 4: the roles field is not read; any cluster passes */
    expect_roles("old_plugin", W2, "cluster.ps=[\"127.0.0.1:2230\"]", NULL);
}

static void test_tf_config(void)
{
    loom_spec *s = load_spec((const char *[]){MWM}, 1);
    if (!s) return;
    loom_cluster *c = NULL;
    char msg[2048];
    const char *env[] = {"HOME=/x",
                         "TF_CONFIG={\"cluster\": {\"chief\": [\"127.0.0.1:3000\"], \"worker\": [\"127.0.0.1:3001\", "
                         "\"127.0.0.1:3002\"]}, \"task\": {\"type\": \"worker\", \"index\": 1}, \"environment\": \"cloud\"}",
                         NULL};
    CHECK_MSG(resolve(&c, s, NULL, env, msg, sizeof msg) == LOOM_OK, "%s", msg);
    if (c) {
        CHECK(c->addrs_from == LOOM_FROM_TF_CONFIG && c->task_from == LOOM_FROM_TF_CONFIG);
        CHECK(c->role == LOOM_ROLE_WORKER && c->index == 1 && c->rank == 2 && c->n_train_ranks == 3);
    }
    loom_cluster_free(c);
    c = NULL;
    /* --task agreeing with TF_CONFIG is fine; disagreeing is an error */
    CHECK(resolve(&c, s, "worker:1", env, msg, sizeof msg) == LOOM_OK);
    loom_cluster_free(c);
    EXPECT_ERR(s, "worker:0", env, "--task worker:0 disagrees with TF_CONFIG's task worker:1");
    /* "master" is the chief's old name */
    const char *master[] = {"TF_CONFIG={\"cluster\": {\"master\": [\"127.0.0.1:3000\"], \"worker\": [\"127.0.0.1:3001\"]},"
                            " \"task\": {\"type\": \"master\", \"index\": 0}}", NULL};
    c = NULL;
    CHECK(resolve(&c, s, NULL, master, msg, sizeof msg) == LOOM_OK && c && c->role == LOOM_ROLE_CHIEF && c->rank == 0);
    loom_cluster_free(c);
    /* malformed: the byte offset */
    const char *bad[] = {"TF_CONFIG={\"cluster\": {\"worker\": [\"a:1\" \"b:2\"]}}", NULL};
    EXPECT_ERR(s, NULL, bad, "TF_CONFIG: invalid JSON at byte 35 (line 1, column 35)");
    const char *role[] = {"TF_CONFIG={\"cluster\": {\"wroker\": [\"127.0.0.1:1\"]}}", NULL};
    EXPECT_ERR(s, NULL, role, "unknown role \"wroker\"");
    const char *idx[] = {"TF_CONFIG={\"cluster\": {\"worker\": [\"127.0.0.1:1\"]}, \"task\": {\"type\": \"worker\", "
                         "\"index\": 3}}", NULL};
    EXPECT_ERR(s, NULL, idx, "task index out of range: worker:3");
    const char *dup[] = {"TF_CONFIG={\"cluster\": {\"chief\": [\"127.0.0.1:1\"], \"worker\": [\"127.0.0.1:1\"]}, "
                         "\"task\": {\"type\": \"worker\", \"index\": 0}}", NULL};
    EXPECT_ERR(s, NULL, dup, "duplicate address 127.0.0.1:1: chief:0 and worker:0 both listen on it");
    const char *addr[] = {"TF_CONFIG={\"cluster\": {\"worker\": [\"127.0.0.1\"]}}", NULL};
    EXPECT_ERR(s, NULL, addr, "cluster.worker[0]: bad address \"127.0.0.1\": missing \":port\"");
    const char *type[] = {"TF_CONFIG={\"task\": {\"type\": \"worker\", \"index\": \"1\"}}", NULL};
    EXPECT_ERR(s, NULL, type, "task.index must be an integer");
    /* an index past what int holds said "must be >= 0" (issue 22): a range error, both ways */
    const char *huge[] = {"TF_CONFIG={\"cluster\": {\"worker\": [\"127.0.0.1:1\"]}, \"task\": {\"type\": \"worker\", "
                          "\"index\": 4294967296}}", NULL};
    EXPECT_ERR(s, NULL, huge, "TF_CONFIG: task.index 4294967296 is out of range: expected 0 to 63");
    const char *neg[] = {"TF_CONFIG={\"cluster\": {\"worker\": [\"127.0.0.1:1\"]}, \"task\": {\"type\": \"worker\", "
                         "\"index\": -1}}", NULL};
    EXPECT_ERR(s, NULL, neg, "task.index must be an integer >= 0, got -1");
    EXPECT_ERR(s, "worker:4294967296", NULL, "the index in \"worker:4294967296\" is out of range: expected 0 to 63");
    const char *empty[] = {"TF_CONFIG={}", NULL};
    c = (loom_cluster *)1;
    CHECK(resolve(&c, s, NULL, empty, msg, sizeof msg) == LOOM_OK && c == NULL);
    loom_config_free(s);

    /* TF_CONFIG and the config's cluster section */
    const char *sets[] = {MWM, W2};
    s = load_spec(sets, 2);
    if (!s) return;
    const char *same[] = {"TF_CONFIG={\"cluster\": {\"worker\": [\"127.0.0.1:2222\", \"127.0.0.1:2223\"]}, "
                          "\"task\": {\"type\": \"worker\", \"index\": 0}}", NULL};
    c = NULL;
    CHECK(resolve(&c, s, NULL, same, msg, sizeof msg) == LOOM_OK && c && c->addrs_from == LOOM_FROM_CONFIG &&
          c->task_from == LOOM_FROM_TF_CONFIG);
    loom_cluster_free(c);
    const char *other[] = {"TF_CONFIG={\"cluster\": {\"worker\": [\"127.0.0.1:2222\", \"127.0.0.1:2299\"]}}", NULL};
    EXPECT_ERR(s, "worker:0", other, "cluster.worker[1] is \"127.0.0.1:2223\" here but \"127.0.0.1:2299\" in TF_CONFIG");
    const char *more[] = {"TF_CONFIG={\"cluster\": {\"worker\": [\"127.0.0.1:2222\"]}}", NULL};
    EXPECT_ERR(s, "worker:0", more, "the config's cluster.worker lists 2 tasks but TF_CONFIG's cluster.worker has 1");
    loom_config_free(s);
}

static void test_slurm(void)
{
    loom_spec *s = load_spec((const char *[]){MWM, "cluster.port_base=9000"}, 2);
    if (!s) return;
    loom_cluster *c = NULL;
    char msg[2048];
    const char *env[] = {"SLURM_PROCID=3", "SLURM_NTASKS=4", "SLURM_STEP_NODELIST=node[01-02]",
                         "SLURM_STEP_TASKS_PER_NODE=2(x2)", "SLURM_NODEID=1", "SLURM_LOCALID=1",
                         "LOOM_CLUSTER_SECRET=s3cret", NULL};
    CHECK_MSG(resolve(&c, s, NULL, env, msg, sizeof msg) == LOOM_OK, "%s", msg);
    if (c) {
        CHECK(c->addrs_from == LOOM_FROM_SLURM && c->task_from == LOOM_FROM_SLURM);
        CHECK(c->role == LOOM_ROLE_WORKER && c->index == 3 && c->n_tasks[LOOM_ROLE_WORKER] == 4);
        CHECK(!strcmp(c->tasks[LOOM_ROLE_WORKER][3].host, "node02") && c->tasks[LOOM_ROLE_WORKER][3].port == 9001);
        CHECK(!strcmp(c->tasks[LOOM_ROLE_WORKER][1].host, "node01") && c->tasks[LOOM_ROLE_WORKER][1].port == 9001);
        CHECK(c->secret_len == 6 && !memcmp(c->secret, "s3cret", 6));
    }
    loom_cluster_free(c);
    /* no secret off loopback */
    const char *nosecret[] = {"SLURM_PROCID=0", "SLURM_NTASKS=2", "SLURM_STEP_NODELIST=node[01-02]", NULL};
    EXPECT_ERR(s, NULL, nosecret, "worker:0 listens on node01:9000, which is not loopback, and the cluster has no secret");
    const char *bad[] = {"SLURM_PROCID=0", "SLURM_NTASKS=2", "SLURM_STEP_NODELIST=node[01-", "LOOM_CLUSTER_SECRET=x", NULL};
    EXPECT_ERR(s, NULL, bad, "malformed node list \"node[01-\": '[' at byte 4 is never closed");
    const char *cyclic[] = {"SLURM_PROCID=1", "SLURM_NTASKS=4", "SLURM_STEP_NODELIST=n[1-2]", "SLURM_NODEID=1",
                            "SLURM_LOCALID=0", "LOOM_CLUSTER_SECRET=x", NULL};
    EXPECT_ERR(s, NULL, cyclic, "--distribution=block");
    const char *sum[] = {"SLURM_PROCID=1", "SLURM_NTASKS=4", "SLURM_STEP_NODELIST=n[1-2]",
                         "SLURM_STEP_TASKS_PER_NODE=1(x2)", "LOOM_CLUSTER_SECRET=x", NULL};
    EXPECT_ERR(s, NULL, sum, "adds up to 2 tasks but SLURM_NTASKS is 4");
    const char *rank[] = {"SLURM_PROCID=x", "SLURM_NTASKS=4", "SLURM_STEP_NODELIST=n1", NULL};
    EXPECT_ERR(s, NULL, rank, "SLURM_PROCID: expected an integer");
    /* --task wins over Slurm's rank */
    c = NULL;
    CHECK(resolve(&c, s, "worker:0", env, msg, sizeof msg) == LOOM_OK && c && c->index == 0 &&
          c->task_from == LOOM_FROM_FLAG);
    loom_cluster_free(c);
    loom_config_free(s);
    /* with the config's addresses, Slurm gives the task and must start as many */
    s = load_spec((const char *[]){MWM, W2}, 2);
    if (!s) return;
    const char *two[] = {"SLURM_PROCID=1", "SLURM_NTASKS=2", "SLURM_STEP_NODELIST=n[1-2]", NULL};
    c = NULL;
    CHECK(resolve(&c, s, NULL, two, msg, sizeof msg) == LOOM_OK && c && c->addrs_from == LOOM_FROM_CONFIG &&
          c->task_from == LOOM_FROM_SLURM && c->index == 1);
    loom_cluster_free(c);
    const char *three[] = {"SLURM_PROCID=1", "SLURM_NTASKS=3", "SLURM_STEP_NODELIST=n[1-3]", NULL};
    EXPECT_ERR(s, NULL, three, "Slurm starts 3 tasks but the cluster");
    loom_config_free(s);
}

static void test_mpi(void)
{
    loom_spec *s = load_spec((const char *[]){MWM}, 1);
    if (!s) return;
    loom_cluster *c = NULL;
    char msg[2048];
    const char *env[] = {"OMPI_COMM_WORLD_RANK=1", "OMPI_COMM_WORLD_SIZE=2", "OMPI_COMM_WORLD_LOCAL_SIZE=2", NULL};
    CHECK_MSG(resolve(&c, s, NULL, env, msg, sizeof msg) == LOOM_OK, "%s", msg);
    if (c) {
        CHECK(c->addrs_from == LOOM_FROM_MPI && c->task_from == LOOM_FROM_MPI && c->index == 1);
        CHECK(!strcmp(c->tasks[LOOM_ROLE_WORKER][1].host, "127.0.0.1") && c->tasks[LOOM_ROLE_WORKER][1].port == 8889);
    }
    loom_cluster_free(c);
    const char *pmix[] = {"PMIX_RANK=0", "OMPI_COMM_WORLD_SIZE=2", "OMPI_COMM_WORLD_LOCAL_SIZE=2", NULL};
    c = NULL;
    CHECK(resolve(&c, s, NULL, pmix, msg, sizeof msg) == LOOM_OK && c && c->index == 0);
    loom_cluster_free(c);
    const char *hosts[] = {"OMPI_COMM_WORLD_RANK=1", "OMPI_COMM_WORLD_SIZE=4", "OMPI_COMM_WORLD_LOCAL_SIZE=2", NULL};
    EXPECT_ERR(s, NULL, hosts, "under MPI on several hosts the addresses come from the config's cluster section");
    const char *nosize[] = {"PMI_RANK=1", NULL};
    EXPECT_ERR(s, NULL, nosize, "PMI_RANK is set but PMI_SIZE is not");
    loom_config_free(s);
}

static void test_secret_and_digest(void)
{
    const char *far[] = {MWM, "cluster.worker=[\"10.0.0.1:2222\", \"10.0.0.2:2222\"]"};
    loom_spec *s = load_spec(far, 2);
    if (!s) return;
    EXPECT_ERR(s, "worker:0", NULL, "worker:0 listens on 10.0.0.1:2222, which is not loopback");
    loom_cluster *c = NULL;
    char msg[2048];
    const char *env[] = {"LOOM_CLUSTER_SECRET=abc\n", NULL};
    CHECK(resolve(&c, s, "worker:0", env, msg, sizeof msg) == LOOM_OK && c && c->secret_len == 3);
    if (c) CHECK(!strcmp(c->secret_from, "LOOM_CLUSTER_SECRET"));
    uint8_t d1[32];
    if (c) memcpy(d1, c->config_digest, 32);
    loom_cluster_free(c);
    const char *empty[] = {"LOOM_CLUSTER_SECRET=", NULL};
    EXPECT_ERR(s, "worker:0", empty, "the cluster secret is empty");
    loom_config_free(s);

    /* a secret file; another model_dir keeps the digest, another learning rate changes it */
    const char *path = tpath("secret");
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    if (f) {
        fputs("0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789\n", f); /* 74 bytes */
        fclose(f);
    }
    chmod(path, 0600);
    char sf[600], md[] = "run.model_dir=\"elsewhere\"";
    snprintf(sf, sizeof sf, "cluster.secret_file=\"%s\"", path);
    const char *withfile[] = {MWM, "cluster.worker=[\"10.0.0.1:2222\", \"10.0.0.2:2222\"]", sf, md};
    s = load_spec(withfile, 4);
    if (!s) return;
    c = NULL;
    CHECK_MSG(resolve(&c, s, "worker:1", NULL, msg, sizeof msg) == LOOM_OK, "%s", msg);
    if (c) {
        CHECK(c->secret_len == 32); /* longer than HMAC's 64-byte block: its SHA-256 */
        CHECK(strstr(c->secret_from, "cluster.secret_file") != NULL);
        CHECK_MSG(!memcmp(d1, c->config_digest, 32), "the digest depends on model_dir or the secret file");
    }
    loom_cluster_free(c);
    loom_config_free(s);
    /* a FIFO as the secret file is refused at once, not waited on */
    const char *fifo = tpath("secret_fifo");
    unlink(fifo);
    CHECK(mkfifo(fifo, 0600) == 0);
    char ff[600];
    snprintf(ff, sizeof ff, "cluster.secret_file=\"%s\"", fifo);
    const char *withfifo[] = {MWM, "cluster.worker=[\"10.0.0.1:2222\", \"10.0.0.2:2222\"]", ff, md};
    s = load_spec(withfifo, 4);
    if (!s) return;
    EXPECT_ERR(s, "worker:1", NULL, "secret_fifo: is a FIFO (named pipe), not a regular file: refused");
    loom_config_free(s);
    const char *lr[] = {MWM, "cluster.worker=[\"10.0.0.1:2222\", \"10.0.0.2:2222\"]", "optimizer.learning_rate=0.5",
                        "cluster.insecure=true"};
    s = load_spec(lr, 4);
    if (!s) return;
    c = NULL;
    CHECK(resolve(&c, s, "worker:0", NULL, msg, sizeof msg) == LOOM_OK && c); /* insecure: no secret needed */
    if (c) CHECK(memcmp(d1, c->config_digest, 32) != 0);
    if (c) CHECK(strstr(c->config_text, "learning_rate = 0.5;") != NULL);
    loom_cluster_free(c);
    loom_config_free(s);
}

static void test_print(void)
{
    const char *sets[] = {MWM, "cluster.chief=[\"127.0.0.1:2221\"]", W2};
    loom_spec *s = load_spec(sets, 3);
    if (!s) return;
    loom_cluster *c = NULL;
    char msg[2048];
    CHECK(resolve(&c, s, "worker:0", NULL, msg, sizeof msg) == LOOM_OK && c);
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    loom_cluster_print(c, f);
    fclose(f);
    CHECK_MSG(strstr(text, "cluster: 3 tasks, addresses from the config's cluster section (--set cluster.chief)"),
              "%s", text);
    CHECK_MSG(strstr(text, "worker:0     127.0.0.1:2222           rank 1  <- this task"), "%s", text);
    CHECK_MSG(strstr(text, "task: worker:0 from --task (--task worker:0), training rank 1 of 3"), "%s", text);
    CHECK_MSG(strstr(text, "config digest: sha256 "), "%s", text);
    free(text);
    loom_cluster_free(c);
    loom_config_free(s);
}

static const loom_test tests[] = {
    {"hostlist", test_hostlist},
    {"tasks_per_node", test_tasks_per_node},
    {"task_flag", test_task_flag},
    {"config_and_flag", test_config_and_flag},
    {"strategy_roles", test_strategy_roles},
    {"roles_as_before", test_roles_as_before},
    {"plugin_roles", test_plugin_roles},
    {"tf_config", test_tf_config},
    {"slurm", test_slurm},
    {"mpi", test_mpi},
    {"secret_and_digest", test_secret_and_digest},
    {"print", test_print},
    {0},
};

int main(void) { return run_in_tmpdir("loom_cluster_topo", tests); }
