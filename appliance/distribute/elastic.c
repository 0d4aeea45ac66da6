/* elastic.c - the membership of an elastic multi_worker_mirrored job
 * (strategy.elastic = { min_workers; max_workers; }), as Horovod elastic and
 * torchrun's rendezvous do it, without restarting the survivors.
 *
 * A worker lost (killed, or silent past cluster.heartbeat_timeout) makes the
 * step's collective fail on every member (the group tells them). Each member
 * then reports to the chief how many steps it completed (the ring is lock-step,
 * so the reports differ by at most one: a member may have received the whole
 * sum of a step that another could not finish). The chief waits for every
 * member still connected, decides the new membership (itself and those that
 * reported) and tells them with the step they continue from: the most any
 * member completed. Everyone re-forms the ring over the members and the member
 * that got furthest broadcasts its parameters and optimizer slots, so all hold
 * the same bits: a member one step behind takes them and its step is done (its
 * examples were in that sum); a member at the frontier takes its step's
 * reduction again over the new members. No rollback, no restart.
 *
 * The chief must live: its loss ends the job as before (launch --restarts).
 *
 * Threads: the train thread. */
#include "elastic_internal.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The group's first free message types (cluster.h: LOOM_MSG_USER + 16 up). */
enum { MSG_REPORT = LOOM_MSG_USER + 16, MSG_DECISION = LOOM_MSG_USER + 17 };

struct loom_elastic {
    loom_group         *group;
    const loom_cluster *cluster;
    loom_elastic_spec   spec;
    uint32_t            epoch;     /* membership changes so far */
    char                task[64];
    char                metrics[LOOM_PATH_MAX + 16]; /* <model_dir>/metrics.jsonl ("" none) */
    int64_t             leave_at;  /* LOOM_TEST_MEMBERSHIP: this task dies before this step (-1: never) */
};

/* LOOM_TEST_MEMBERSHIP="leave worker:2 at 300; ...": a scripted timeline,
 * for bit-reproducible tests: the named task dies (SIGKILL, as kill -9) when
 * it is about to take that step (0-based: after 300 complete), so every
 * member fails the same step's all-reduce. Other entries are refused. */
static int parse_timeline(loom_elastic *e, const char *v, loom_err *err)
{
    e->leave_at = -1;
    if (!v || !*v) return LOOM_OK;
    char buf[512];
    snprintf(buf, sizeof buf, "%s", v);
    for (char *save = NULL, *item = strtok_r(buf, ";", &save); item; item = strtok_r(NULL, ";", &save)) {
        char task[64], tail;
        long long at;
        while (*item == ' ') item++;
        if (!*item) continue;
        if (sscanf(item, "leave %63s at %lld %c", task, &at, &tail) != 2 || at < 0)
            return loom_err_set(err, LOOM_EUSAGE, "LOOM_TEST_MEMBERSHIP", "cannot read \"%s\" (expected \"leave "
                                "worker:N at STEP\"; joins are not supported yet)", item);
        if (!strcmp(task, e->task)) e->leave_at = at;
    }
    return LOOM_OK;
}

void loom_elastic_trained_(loom_elastic *e, const loom_elem *b, int feature, int64_t step)
{
    const char *prefix = getenv("LOOM_TEST_EXAMPLE_IDS");
    if (!prefix || !*prefix || feature < 0 || feature >= b->n) return;
    char path[LOOM_PATH_MAX + 80];
    snprintf(path, sizeof path, "%s.%s", prefix, e->task);
    FILE *f = fopen(path, "a");
    if (!f) return;
    const loom_tensor *t = &b->t[feature];
    int64_t rows = t->shape.rank > 0 ? t->shape.dim[0] : 0;
    size_t row = rows > 0 ? (size_t)(loom_shape_numel(&t->shape) / rows) * loom_dtype_size(t->dtype) : 0;
    for (int64_t i = 0; i < rows; i++)
        fprintf(f, "%lld %08x\n", (long long)step + 1, loom_crc32c((const uint8_t *)t->data + (size_t)i * row, row));
    fclose(f);
}

void loom_elastic_step_(loom_elastic *e, int64_t step)
{
    if (!e || e->leave_at < 0 || step != e->leave_at) return;
    loom_warn("%s: leaving the job before step %lld (LOOM_TEST_MEMBERSHIP): killed as kill -9 would", e->task,
              (long long)step + 1);
    raise(SIGKILL);
}

int loom_elastic_open_(loom_elastic **out, loom_group *g, const loom_cluster *c, const loom_elastic_spec *spec,
                       const char *task, const char *model_dir, loom_err *err)
{
    loom_elastic *e = loom_calloc(1, sizeof *e);
    if (!e) return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating the elastic membership");
    e->group = g, e->cluster = c, e->spec = *spec;
    snprintf(e->task, sizeof e->task, "%s", task);
    if (model_dir && model_dir[0]) snprintf(e->metrics, sizeof e->metrics, "%s/metrics.jsonl", model_dir);
    int rc = parse_timeline(e, getenv("LOOM_TEST_MEMBERSHIP"), err);
    if (rc) {
        loom_free(e);
        return rc;
    }
    loom_group_elastic(g);
    loom_net_reads(loom_group_net(g), -1, LOOM_NET_TYPE_BIT(MSG_REPORT) | LOOM_NET_TYPE_BIT(MSG_DECISION));
    *out = e;
    return LOOM_OK;
}

void loom_elastic_free_(loom_elastic *e) { loom_free(e); }

static const char *task_of(const loom_elastic *e, int task_rank, char *buf, size_t n)
{
    const loom_task_addr *t = loom_cluster_rank_task(e->cluster, task_rank);
    if (t) return loom_task_name(t->role, t->index, buf, n);
    snprintf(buf, n, "rank %d", task_rank);
    return buf;
}

/* The chief: one metrics.jsonl record of the change (the trainer's lines are whole lines too). */
static void record(const loom_elastic *e, int64_t step, const char *left, const int *members, int n)
{
    if (!e->metrics[0]) return;
    FILE *f = fopen(e->metrics, "a");
    if (!f) return;
    fprintf(f, "{\"membership\": \"left\", \"step\": %lld, \"left\": \"%s\", \"workers\": %d, \"members\": [",
            (long long)step, left, n);
    for (int i = 0; i < n; i++) {
        char t[64];
        fprintf(f, "%s\"%s\"", i ? ", " : "", task_of(e, members[i], t, sizeof t));
    }
    fputs("]}\n", f);
    fclose(f);
}

/* The decision: u32 epoch, i64 step, u32 source (a task rank), u32 stop, u32 n, n x u32 members. */
static void put_decision(loom_buf *b, uint32_t epoch, int64_t step, int source, bool stop, const int *m, int n)
{
    loom_buf_init(b);
    loom_buf_put_u32(b, epoch);
    loom_buf_put_i64(b, step);
    loom_buf_put_u32(b, (uint32_t)source);
    loom_buf_put_u32(b, stop ? 1u : 0u);
    loom_buf_put_u32(b, (uint32_t)n);
    for (int i = 0; i < n; i++) loom_buf_put_u32(b, (uint32_t)m[i]);
}

/* The chief: waits for the reports of every member still connected (a
 * member lost meanwhile is dropped too), bounded by heartbeat_timeout + 5 s. */
static int chief_decide(loom_elastic *e, int64_t step, int *members, int *n, int64_t *best, int *source,
                        char *left, size_t left_n, loom_err *err)
{
    loom_net *net = loom_group_net(e->group);
    int size = loom_group_size(e->group), old[64];
    int64_t done[64];
    bool reported[64] = {false};
    for (int r = 0; r < size && r < 64; r++) old[r] = loom_group_member(e->group, r), done[r] = -1;
    done[0] = step, reported[0] = true; /* the chief is member 0 (task rank 0) */
    double until = loom_now() + e->cluster->heartbeat_timeout + 5;
    for (;;) {
        bool all = true;
        for (int r = 1; r < size; r++)
            if (!reported[r] && loom_group_task_up(e->group, old[r])) all = false;
        if (all || loom_now() > until) break;
        loom_buf m;
        loom_buf_init(&m);
        int from;
        loom_err w;
        if (loom_net_recv(net, -1, MSG_REPORT, MSG_REPORT, &from, NULL, &m, 0.05, &w) == LOOM_OK && m.len == 12) {
            uint32_t ep = loom_buf_get_u32(&m);
            int64_t d = loom_buf_get_i64(&m);
            int tr = from + 1; /* the chief's net peers: task ranks 1, 2, ... */
            for (int r = 1; r < size; r++)
                if (old[r] == tr && ep == e->epoch) reported[r] = true, done[r] = d;
        }
        loom_buf_fini(&m);
    }
    *n = 0, *best = -1, *source = 0;
    size_t len = 0;
    left[0] = 0;
    for (int r = 0; r < size; r++) {
        if (reported[r]) {
            members[(*n)++] = old[r];
            if (done[r] > *best) *best = done[r], *source = old[r];
        } else {
            char t[64];
            len += (size_t)snprintf(left + len, len < left_n ? left_n - len : 0, "%s%s", len ? ", " : "",
                                    task_of(e, old[r], t, sizeof t));
        }
    }
    if (!left[0]) snprintf(left, left_n, "none");
    (void)err;
    return LOOM_OK;
}

static int chief_lost(loom_elastic *e, loom_err *err)
{
    char t[64];
    loom_err_set(err, LOOM_ENET, e->task, "the chief (%s) was lost while the job re-formed after a lost worker: elastic "
                 "training goes on only while the chief lives", task_of(e, 0, t, sizeof t));
    return loom_err_hint(err, "run the job again: it resumes from the last checkpoint (with any number of workers)");
}

/* A member: its report to the chief, then the chief's decision. */
static int member_wait(loom_elastic *e, int64_t step, int *members, int *n, int64_t *best, int *source, bool *stop,
                       loom_err *err)
{
    loom_net *net = loom_group_net(e->group);
    loom_buf b;
    loom_buf_init(&b);
    loom_buf_put_u32(&b, e->epoch);
    loom_buf_put_i64(&b, step);
    int rc = loom_net_send(net, 0, MSG_REPORT, b.data, b.len, err);
    loom_buf_fini(&b);
    if (rc) return loom_group_task_up(e->group, 0) ? rc : chief_lost(e, err);
    double wait = 2 * e->cluster->heartbeat_timeout + 10;
    for (;;) {
        loom_buf_init(&b);
        rc = loom_net_recv(net, 0, MSG_DECISION, MSG_DECISION, NULL, NULL, &b, 0.2, err);
        if (rc == LOOM_OK) break;
        loom_buf_fini(&b);
        if (!loom_group_task_up(e->group, 0)) return chief_lost(e, err);
        if ((wait -= 0.2) <= 0)
            return loom_err_set(err, LOOM_ETIMEOUT, e->task, "no membership decision from the chief within %g s",
                                2 * e->cluster->heartbeat_timeout + 10);
    }
    uint32_t ep = loom_buf_get_u32(&b);
    *best = loom_buf_get_i64(&b);
    *source = (int)loom_buf_get_u32(&b);
    *stop = loom_buf_get_u32(&b) != 0;
    *n = (int)loom_buf_get_u32(&b);
    for (int i = 0; i < *n && i < 64; i++) members[i] = (int)loom_buf_get_u32(&b);
    bool bad = b.failed || ep != e->epoch + 1 || *n < 1 || *n > 64;
    loom_buf_fini(&b);
    if (bad) return loom_err_set(err, LOOM_ENET, e->task, "an unreadable membership decision from the chief");
    return LOOM_OK;
}

int loom_elastic_recover_(loom_elastic *e, int64_t step, float *params, int64_t P, float *slots, int64_t n_slots,
                          const loom_err *fail, loom_elastic_outcome *out, loom_err *err)
{
    memset(out, 0, sizeof *out);
    int me = e->cluster->rank, members[64], n = 0, source = 0;
    int64_t best = step;
    bool stop = false;
    char left[256];
    int rc;
    if (me == 0) {
        chief_decide(e, step, members, &n, &best, &source, left, sizeof left, err);
        stop = n < e->spec.min_workers;
        loom_buf d;
        put_decision(&d, e->epoch + 1, best, source, stop, members, n);
        loom_err w;
        for (int i = 1; i < n; i++) loom_net_send(loom_group_net(e->group), members[i] - 1, MSG_DECISION, d.data, d.len, &w);
        loom_buf_fini(&d);
        if (stop)
            loom_warn("%s left at step %lld; %d worker%s left, fewer than strategy.elastic.min_workers = %d: the job "
                      "stops with a checkpoint", left, (long long)best, n, n == 1 ? " is" : "s are", e->spec.min_workers);
        else
            loom_warn("%s left at step %lld; continuing with %d worker%s", left, (long long)best, n, n == 1 ? "" : "s");
        record(e, best, left, members, n);
    } else if ((rc = member_wait(e, step, members, &n, &best, &source, &stop, err))) {
        return rc;
    }
    bool in = false;
    int src_rank = 0;
    for (int i = 0; i < n; i++) {
        if (members[i] == me) in = true;
        if (members[i] == source) src_rank = i;
    }
    if (!in) {
        *err = *fail;
        return loom_err_prefix(err, "the chief dropped %s from the job (it did not report in time)", e->task);
    }
    e->epoch++;
    if ((rc = loom_group_reform(e->group, members, n, err))) return rc;
    if (me != 0) loom_info("%s: the job goes on with %d workers from step %lld", e->task, n, (long long)best);
    if ((rc = loom_group_broadcast(e->group, params, (size_t)P * sizeof(float), src_rank, err))) return rc;
    if (n_slots > 0 && (rc = loom_group_broadcast(e->group, slots, (size_t)n_slots * sizeof(float), src_rank, err)))
        return rc;
    out->redo = step == best;
    out->stop = stop;
    out->workers = n;
    return LOOM_OK;
}
