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
 * Joining: every task asks the chief to join once its transport connects
 * (MSG_JOIN); at the start the chief admits them all (MSG_ADMIT: the first
 * ring, the first max_workers in task order, the others refused): those
 * connected once the transport has waited strategy.elastic.start_timeout
 * for every listed task (loom_group_open_elastic), at least min_workers (a
 * task listed that comes later joins the running job); in a
 * running job it sees the request before a step (loom_elastic_want_join_),
 * the step's agreement tells every member, and after the step (and its
 * boundary) the chief sends the members the new membership (MSG_DECISION)
 * and the joiner its admission with the trainer's state; the ring re-forms
 * in task order and the chief broadcasts the variables and optimizer slots
 * (loom_elastic_admit_). Below min_workers after a loss the chief first
 * waits up to strategy.elastic.wait_timeout for requests (wait_joiners).
 *
 * Unlisted workers (task ranks from the cluster's n_train_ranks up to
 * strategy.elastic.max_workers: no address in the list) join the same way:
 * the request carries the port the worker listens on, the chief records it
 * with the IP the connection comes from (note_join), and the admissions and
 * decisions carry the unlisted members' addresses (put_addrs), so every
 * member can reach them (an unlisted worker dials another that it learns of).
 *
 * The chief must live: its loss ends the job as before (launch --restarts).
 *
 * Threads: the train thread. */
#include "elastic_internal.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The group's first free message types (cluster.h: LOOM_MSG_USER + 16 up). */
enum { MSG_REPORT = LOOM_MSG_USER + 16, MSG_DECISION = LOOM_MSG_USER + 17, MSG_JOIN = LOOM_MSG_USER + 18,
       MSG_ADMIT = LOOM_MSG_USER + 19 };
/* MSG_ADMIT's kinds: the job forms (its first ring), a running job takes the task in, or refuses it */
enum { ADMIT_FORM = 1, ADMIT_JOIN = 2, ADMIT_REFUSED = 3 };
#define JOIN_MAGIC 0x4e494f4au /* "JOIN" */
#define MAX_TASKS 64

struct loom_elastic {
    loom_group         *group;
    const loom_cluster *cluster;
    loom_elastic_spec   spec;
    uint32_t            epoch;     /* membership changes so far */
    char                task[64];
    char                metrics[LOOM_PATH_MAX + 16]; /* <model_dir>/metrics.jsonl ("" none) */
    int64_t             leave_at;  /* LOOM_TEST_MEMBERSHIP: this task dies before this step (-1: never) */
    int64_t             stop_at;   /* LOOM_TEST_MEMBERSHIP: a stop request (as SIGINT) lands in this step (-1) */
    int64_t             join_at[MAX_TASKS]; /* the chief, by task rank: "join TASK at STEP" (-1: when it asks) */
    bool                waiting[MAX_TASKS]; /* the chief: task ranks that asked to join, not yet admitted */
    bool                joined;    /* this task entered a running job; `state` is the chief's trainer state */
    /* unlisted workers (task ranks from n_train_ranks up): where each listens,
     * as its request to join said (the chief) or the chief told (port 0: unknown) */
    char                addr_host[MAX_TASKS][LOOM_HOST_MAX];
    int                 addr_port[MAX_TASKS];
    int64_t             joined_at;
    loom_buf            state;
};

/* LOOM_TEST_MEMBERSHIP="leave worker:2 at 300; ...": a scripted timeline,
 * for bit-reproducible tests: the named task dies (SIGKILL, as kill -9) when
 * it is about to take that step (0-based: after 300 complete), so every
 * member fails the same step's all-reduce. "interrupt TASK at 300": a stop
 * request (as a SIGINT caught while the step runs) rides that step on TASK,
 * so a loss and a stop can fall in one step. Other entries are refused. */
static int task_rank_of(const loom_elastic *e, const char *name);

static int parse_timeline(loom_elastic *e, const char *v, loom_err *err)
{
    e->leave_at = e->stop_at = -1;
    for (int r = 0; r < MAX_TASKS; r++) e->join_at[r] = -1;
    if (!v || !*v) return LOOM_OK;
    char buf[512];
    snprintf(buf, sizeof buf, "%s", v);
    for (char *save = NULL, *item = strtok_r(buf, ";", &save); item; item = strtok_r(NULL, ";", &save)) {
        char task[64], tail;
        long long at;
        while (*item == ' ') item++;
        if (!*item) continue;
        if (sscanf(item, "join %63s at %lld %c", task, &at, &tail) == 2 && at >= 1) {
            int tr = task_rank_of(e, task);
            if (tr <= 0)
                return loom_err_set(err, LOOM_EUSAGE, "LOOM_TEST_MEMBERSHIP", "\"%s\": %s is not a worker of the "
                                    "cluster (the chief cannot join: it never leaves)", item, task);
            e->join_at[tr] = at;
            continue;
        }
        if (sscanf(item, "interrupt %63s at %lld %c", task, &at, &tail) == 2 && at >= 0) {
            if (!strcmp(task, e->task)) e->stop_at = at;
            continue;
        }
        if (sscanf(item, "leave %63s at %lld %c", task, &at, &tail) != 2 || at < 0)
            return loom_err_set(err, LOOM_EUSAGE, "LOOM_TEST_MEMBERSHIP", "cannot read \"%s\" (expected \"leave "
                                "worker:N at STEP\", \"join worker:N at STEP\" or \"interrupt TASK at STEP\", "
                                "STEP >= 1)", item);
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

bool loom_elastic_step_(loom_elastic *e, int64_t step)
{
    if (e && e->stop_at >= 0 && step == e->stop_at) {
        loom_warn("%s: a stop request in step %lld (LOOM_TEST_MEMBERSHIP), as a SIGINT caught during it", e->task,
                  (long long)step + 1);
        return true;
    }
    if (!e || e->leave_at < 0 || step != e->leave_at) return false;
    loom_warn("%s: leaving the job before step %lld (LOOM_TEST_MEMBERSHIP): killed as kill -9 would", e->task,
              (long long)step + 1);
    raise(SIGKILL);
    return false;
}

void loom_elastic_leave_(loom_elastic *e, int64_t step)
{
    if (!e || e->cluster->rank == 0) return;
    loom_warn("%s: SIGTERM: leaving the job before step %lld (strategy.elastic); the others go on without it", e->task,
              (long long)step + 1);
    fflush(NULL);
    _exit(0); /* its connections close at once: the members' next collective fails and they re-form */
}

static int form(loom_elastic *e, loom_err *err);

int loom_elastic_open_(loom_elastic **out, loom_group *g, const loom_cluster *c, const loom_elastic_spec *spec,
                       const char *task, const char *model_dir, loom_err *err)
{
    *out = NULL;
    if (loom_cluster_train_slots(c) > MAX_TASKS)
        return loom_err_set(err, LOOM_EUNSUPPORTED, task, "strategy.elastic: at most %d training tasks (the cluster "
                            "has %d, up to max_workers)", MAX_TASKS, loom_cluster_train_slots(c));
    loom_elastic *e = loom_calloc(1, sizeof *e);
    if (!e) return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating the elastic membership");
    e->group = g, e->cluster = c, e->spec = *spec;
    loom_buf_init(&e->state);
    snprintf(e->task, sizeof e->task, "%s", task);
    if (model_dir && model_dir[0]) snprintf(e->metrics, sizeof e->metrics, "%s/metrics.jsonl", model_dir);
    int rc = parse_timeline(e, getenv("LOOM_TEST_MEMBERSHIP"), err);
    if (!rc) {
        loom_group_elastic(g);
        loom_net_reads(loom_group_net(g), -1, loom_elastic_reads_()); /* (declared at open already) */
        rc = form(e, err);
    }
    if (rc) {
        loom_elastic_free_(e);
        return rc;
    }
    *out = e;
    return LOOM_OK;
}

uint64_t loom_elastic_reads_(void)
{
    return LOOM_NET_TYPE_BIT(MSG_REPORT) | LOOM_NET_TYPE_BIT(MSG_DECISION) | LOOM_NET_TYPE_BIT(MSG_JOIN) |
           LOOM_NET_TYPE_BIT(MSG_ADMIT);
}

void loom_elastic_free_(loom_elastic *e)
{
    if (!e) return;
    loom_buf_fini(&e->state);
    loom_free(e);
}

bool loom_elastic_joined_(const loom_elastic *e, int64_t *step, const loom_buf **state)
{
    if (!e || !e->joined) return false;
    if (step) *step = e->joined_at;
    if (state) *state = &e->state;
    return true;
}

static const char *task_of(const loom_elastic *e, int task_rank, char *buf, size_t n)
{
    const loom_task_addr *t = loom_cluster_rank_task(e->cluster, task_rank);
    if (t) return loom_task_name(t->role, t->index, buf, n);
    snprintf(buf, n, "rank %d", task_rank);
    return buf;
}

/* The chief: one metrics.jsonl record of the change (the trainer's lines are whole lines too). */
static void record(const loom_elastic *e, const char *what, int64_t step, const char *who, const int *members, int n)
{
    if (!e->metrics[0]) return;
    FILE *f = fopen(e->metrics, "a");
    if (!f) return;
    fprintf(f, "{\"membership\": \"%s\", \"step\": %lld, \"%s\": \"%s\", \"workers\": %d, \"members\": [", what,
            (long long)step, what, who, n);
    for (int i = 0; i < n; i++) {
        char t[64];
        fprintf(f, "%s\"%s\"", i ? ", " : "", task_of(e, members[i], t, sizeof t));
    }
    fputs("]}\n", f);
    fclose(f);
}

/* ---- unlisted workers' addresses ------------------------------------------------------------ */

/* The chief: a request to join from net peer `from` (task rank from + 1):
 * u32 magic, str task, u32 the port it listens on. A worker the chief's
 * cluster does not list is recorded where it listens: the IP its connection
 * comes from, that port (the ring's data connection dials it there, and the
 * members learn it with their decision). */
static void note_join(loom_elastic *e, int from, loom_buf *m)
{
    int tr = from + 1;
    char task[64];
    if (tr >= MAX_TASKS || m->len < 4 || loom_buf_get_u32(m) != JOIN_MAGIC) return;
    loom_buf_get_str(m, task, sizeof task);
    uint32_t port = m->pos + 4 <= m->len ? loom_buf_get_u32(m) : 0;
    if (tr >= e->cluster->n_train_ranks && port > 0 && port < 65536) {
        char ip[LOOM_HOST_MAX];
        loom_err w;
        if (loom_group_task_ip(e->group, tr, ip, sizeof ip)) return; /* (gone already) */
        snprintf(e->addr_host[tr], sizeof e->addr_host[tr], "%s", ip);
        e->addr_port[tr] = (int)port;
        if (loom_group_learn(e->group, tr, ip, (int)port, &w)) loom_warn("%s", w.msg);
        loom_info("%s (not in the cluster's list) asks to join; it listens on %s:%u", task, ip, port);
    }
    e->waiting[tr] = true;
}

/* After a list of members: u32 k, k x (u32 task rank, str host, u32 port), the unlisted ones known. */
static void put_addrs(const loom_elastic *e, loom_buf *b, const int *m, int n)
{
    uint32_t k = 0;
    for (int i = 0; i < n; i++) k += m[i] < MAX_TASKS && e->addr_port[m[i]] > 0;
    loom_buf_put_u32(b, k);
    for (int i = 0; i < n; i++) {
        if (m[i] >= MAX_TASKS || e->addr_port[m[i]] <= 0) continue;
        loom_buf_put_u32(b, (uint32_t)m[i]);
        loom_buf_put_str(b, e->addr_host[m[i]]);
        loom_buf_put_u32(b, (uint32_t)e->addr_port[m[i]]);
    }
}

/* A member: the addresses put_addrs wrote; each one this task does not list
 * is recorded (and dialed when this task is the one that dials it). */
static void get_addrs(loom_elastic *e, loom_buf *b)
{
    uint32_t k = loom_buf_get_u32(b);
    for (uint32_t i = 0; i < k && i < MAX_TASKS && !b->failed; i++) {
        int tr = (int)loom_buf_get_u32(b);
        char host[LOOM_HOST_MAX];
        loom_buf_get_str(b, host, sizeof host);
        int port = (int)loom_buf_get_u32(b);
        if (b->failed || tr < 0 || tr >= MAX_TASKS || tr == e->cluster->rank || port <= 0 || port > 65535) continue;
        snprintf(e->addr_host[tr], sizeof e->addr_host[tr], "%s", host);
        e->addr_port[tr] = port;
        loom_err w;
        if (loom_group_learn(e->group, tr, host, port, &w)) loom_warn("%s", w.msg);
    }
}

/* The decision: u32 epoch, i64 step, u32 source (a task rank), u32 stop, u32 n, n x u32 members, then the
 * unlisted members' addresses (put_addrs). */
static void put_decision(const loom_elastic *e, loom_buf *b, uint32_t epoch, int64_t step, int source, bool stop,
                         const int *m, int n)
{
    loom_buf_init(b);
    loom_buf_put_u32(b, epoch);
    loom_buf_put_i64(b, step);
    loom_buf_put_u32(b, (uint32_t)source);
    loom_buf_put_u32(b, stop ? 1u : 0u);
    loom_buf_put_u32(b, (uint32_t)n);
    for (int i = 0; i < n; i++) loom_buf_put_u32(b, (uint32_t)m[i]);
    put_addrs(e, b, m, n);
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
        for (int r = 1; r < size; r++) /* (a member restarted meanwhile asks to join instead) */
            if (!reported[r] && loom_group_task_up(e->group, old[r]) && !e->waiting[old[r]]) all = false;
        if (all || loom_now() > until) break;
        loom_buf m;
        loom_buf_init(&m);
        int from;
        loom_err w;
        uint32_t type = 0;
        int got = loom_net_recv(net, -1, MSG_REPORT, MSG_JOIN, &from, &type, &m, 0.05, &w);
        if (got == LOOM_OK && type == MSG_JOIN) note_join(e, from, &m);
        if (got == LOOM_OK && type == MSG_REPORT && m.len == 12) {
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

static int recv_decision(loom_elastic *e, int *members, int *n, int64_t *best, int *source, bool *stop, loom_err *err);

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
    return recv_decision(e, members, n, best, source, stop, err);
}

/* A member: the chief's decision (after a loss, or an admission). */
static int recv_decision(loom_elastic *e, int *members, int *n, int64_t *best, int *source, bool *stop, loom_err *err)
{
    loom_net *net = loom_group_net(e->group);
    loom_buf b;
    int rc;
    double bound = 2 * e->cluster->heartbeat_timeout + 10 + e->spec.wait_timeout, wait = bound;
    for (;;) {
        loom_buf_init(&b);
        rc = loom_net_recv(net, 0, MSG_DECISION, MSG_DECISION, NULL, NULL, &b, 0.2, err);
        if (rc == LOOM_OK) break;
        loom_buf_fini(&b);
        if (!loom_group_task_up(e->group, 0)) return chief_lost(e, err);
        if ((wait -= 0.2) <= 0)
            return loom_err_set(err, LOOM_ETIMEOUT, e->task, "no membership decision from the chief within %g s",
                                bound);
    }
    uint32_t ep = loom_buf_get_u32(&b);
    *best = loom_buf_get_i64(&b);
    *source = (int)loom_buf_get_u32(&b);
    *stop = loom_buf_get_u32(&b) != 0;
    *n = (int)loom_buf_get_u32(&b);
    for (int i = 0; i < *n && i < 64; i++) members[i] = (int)loom_buf_get_u32(&b);
    if (!b.failed && *n >= 1 && *n <= 64) get_addrs(e, &b);
    bool bad = b.failed || ep != e->epoch + 1 || *n < 1 || *n > 64;
    loom_buf_fini(&b);
    if (bad) return loom_err_set(err, LOOM_ENET, e->task, "an unreadable membership decision from the chief");
    return LOOM_OK;
}

static bool wait_joiners(loom_elastic *e, int64_t done, const char *left, const int *members, int n);

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
        stop = n < e->spec.min_workers && !(out->join = wait_joiners(e, best, left, members, n));
        loom_buf d;
        put_decision(e, &d, e->epoch + 1, best, source, stop, members, n);
        loom_err w;
        for (int i = 1; i < n; i++) loom_net_send(loom_group_net(e->group), members[i] - 1, MSG_DECISION, d.data, d.len, &w);
        loom_buf_fini(&d);
        if (stop)
            loom_warn("%s left at step %lld; %d worker%s left, fewer than strategy.elastic.min_workers = %d: the job "
                      "stops with a checkpoint", left, (long long)best, n, n == 1 ? " is" : "s are", e->spec.min_workers);
        else if (!out->join)
            loom_warn("%s left at step %lld; continuing with %d worker%s", left, (long long)best, n, n == 1 ? "" : "s");
        record(e, "left", best, left, members, n);
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

/* ---- joining: the first ring, and tasks entering a running job ---------------------------- */

static int task_rank_of(const loom_elastic *e, const char *name)
{
    for (int r = 0; r < loom_cluster_train_slots(e->cluster) && r < MAX_TASKS; r++) {
        char t[64];
        if (!strcmp(task_of(e, r, t, sizeof t), name)) return r;
    }
    return -1;
}

static bool is_member(const loom_elastic *e, int task_rank)
{
    for (int i = 0; i < loom_group_size(e->group); i++)
        if (loom_group_member(e->group, i) == task_rank) return true;
    return false;
}

/* The admission message: u32 kind, u32 epoch, i64 step, u32 n, n x u32 members, the unlisted members'
 * addresses (put_addrs), then (ADMIT_JOIN) the trainer's state or (ADMIT_REFUSED) the reason, to the end. */
static int send_admit(loom_elastic *e, int task_rank, uint32_t kind, uint32_t epoch, int64_t step, const int *m, int n,
                      const void *rest, size_t rest_len)
{
    loom_buf b;
    loom_buf_init(&b);
    loom_buf_put_u32(&b, kind);
    loom_buf_put_u32(&b, epoch);
    loom_buf_put_i64(&b, step);
    loom_buf_put_u32(&b, (uint32_t)n);
    for (int i = 0; i < n; i++) loom_buf_put_u32(&b, (uint32_t)m[i]);
    put_addrs(e, &b, m, n);
    if (rest_len) loom_buf_put(&b, rest, rest_len);
    loom_err w;
    int rc = b.failed ? LOOM_ENOMEM
                      : loom_net_send(loom_group_net(e->group), task_rank - 1, MSG_ADMIT, b.data, b.len, &w);
    loom_buf_fini(&b);
    return rc;
}

/* The chief: the requests to join that came (waiting up to `wait` s for the first). */
static void take_requests(loom_elastic *e, double wait)
{
    for (;;) {
        loom_buf m;
        loom_buf_init(&m);
        int from;
        loom_err w;
        int rc = loom_net_recv(loom_group_net(e->group), -1, MSG_JOIN, MSG_JOIN, &from, NULL, &m, wait, &w);
        if (rc == LOOM_OK) note_join(e, from, &m);
        loom_buf_fini(&m);
        if (rc) return;
        wait = 0;
    }
}

/* The chief at the start: every training task connected asks to join, and
 * they form the first ring. The transport waited strategy.elastic.start_timeout
 * for every listed task (loom_group_open_elastic); the job starts with those
 * connected, at least min_workers (below it, it waits up to wait_timeout for
 * more), and the others join the running job when they come. */
static int admit_limit(const loom_elastic *e);

static bool is_member_of(const int *members, int n, int r)
{
    for (int i = 0; i < n; i++)
        if (members[i] == r) return true;
    return false;
}

static int start_short(loom_elastic *e, int got, int n, loom_err *err)
{
    loom_err_set(err, LOOM_ETIMEOUT, e->task, "strategy.elastic: %d of the %d listed training tasks connected within "
                 "strategy.elastic.start_timeout + wait_timeout = %g s, fewer than min_workers = %d", got, n,
                 e->spec.start_timeout + e->spec.wait_timeout, e->spec.min_workers);
    return loom_err_hint(err, "start the missing workers (the job starts once min_workers are there), or lower "
                         "strategy.elastic.min_workers");
}

static int chief_wait_start(loom_elastic *e, int n, int *got_out, loom_err *err)
{
    double t = e->cluster->connect_timeout > 0 ? e->cluster->connect_timeout : 60, t0 = loom_now();
    bool said = false;
    for (;;) {
        int got = 1, up = 1; /* (an unlisted worker there at the start is in the first ring too) */
        for (int r = 1; r < loom_cluster_train_slots(e->cluster); r++) got += e->waiting[r], up += loom_group_task_up(e->group, r);
        *got_out = got;
        if (got == up && (got >= n || got >= e->spec.min_workers)) return LOOM_OK;
        if (got == up && !said) {
            said = true;
            loom_warn("strategy.elastic: %d of the %d listed training tasks connected, fewer than min_workers = %d: "
                      "waiting up to %g s (strategy.elastic.wait_timeout) for more", got, n, e->spec.min_workers,
                      e->spec.wait_timeout);
        }
        if (got == up && loom_now() > t0 + e->spec.wait_timeout) return start_short(e, got, n, err);
        if (got < up && loom_now() > t0 + t + 5)
            return loom_err_set(err, LOOM_ETIMEOUT, e->task, "strategy.elastic: %d of the %d training tasks "
                                "connected asked to join within %g s", got, up, t + 5);
        take_requests(e, 0.2);
    }
}

static int chief_form(loom_elastic *e, int *members, int *out_n, loom_err *err)
{
    int n = e->cluster->n_train_ranks, got = 0;
    int rc = chief_wait_start(e, n, &got, err);
    if (rc) return rc;
    int asked[MAX_TASKS], na = 0, listed = 0;
    for (int r = 0; r < loom_cluster_train_slots(e->cluster); r++)
        if (r == 0 || e->waiting[r]) asked[na++] = r, listed += r < n;
    int m = admit_limit(e) < na ? admit_limit(e) : na; /* the first max_workers in task order; the others are refused */
    for (int k = 0; k < na; k++) members[k] = asked[k], e->waiting[asked[k]] = false;
    for (int k = 1; k < na; k++) {
        int r = asked[k];
        if (k < m) {
            send_admit(e, r, ADMIT_FORM, 0, 0, members, m, NULL, 0);
            continue;
        }
        char t[64], why[160];
        int w = snprintf(why, sizeof why, "the job starts with strategy.elastic.max_workers = %d workers", m);
        send_admit(e, r, ADMIT_REFUSED, 0, 0, NULL, 0, why, (size_t)w);
        loom_warn("%s asked to join; refused: the job starts with strategy.elastic.max_workers = %d workers",
                  task_of(e, r, t, sizeof t), m);
    }
    if (listed < n) {
        char who[256] = "", t[64], extra[64] = "";
        size_t len = 0;
        for (int r = 1; r < n; r++)
            if (!is_member_of(asked, na, r))
                len += (size_t)snprintf(who + len, len < sizeof who ? sizeof who - len : 0, "%s%s", len ? ", " : "",
                                        task_of(e, r, t, sizeof t));
        if (na > listed) snprintf(extra, sizeof extra, " and %d unlisted", na - listed);
        loom_warn("strategy.elastic: starting with %d of the %d listed workers%s (strategy.elastic.start_timeout = "
                  "%g s); %s join%s when %s connect%s", listed, n, extra, e->spec.start_timeout, who,
                  listed + 1 < n ? "" : "s", listed + 1 < n ? "they" : "it", listed + 1 < n ? "" : "s");
    }
    *out_n = m;
    return LOOM_OK;
}

/* A worker: asks the chief to join and waits for its answer: the first
 * ring, or (a running job) the step it enters at with the trainer's state,
 * or a refusal. The chief admits it at a step boundary: this waits while the
 * chief lives. */
static int member_form(loom_elastic *e, int *members, int *n, loom_err *err)
{
    loom_net *net = loom_group_net(e->group);
    loom_buf b;
    loom_buf_init(&b);
    loom_buf_put_u32(&b, JOIN_MAGIC);
    loom_buf_put_str(&b, e->task);
    loom_buf_put_u32(&b, (uint32_t)loom_group_listen_port(e->group)); /* (where an unlisted worker listens) */
    int rc = loom_net_send(net, 0, MSG_JOIN, b.data, b.len, err);
    loom_buf_fini(&b);
    if (rc) return rc;
    double t0 = loom_now();
    bool said = false;
    for (;;) {
        loom_buf_init(&b);
        if (loom_net_recv(net, 0, MSG_ADMIT, MSG_ADMIT, NULL, NULL, &b, 0.2, err) == LOOM_OK) break;
        loom_buf_fini(&b);
        if (!loom_group_task_up(e->group, 0)) {
            char t[64];
            loom_err_set(err, LOOM_ENET, e->task, "the chief (%s) went away before it admitted this task into the job",
                         task_of(e, 0, t, sizeof t));
            return loom_err_hint(err, "start this worker again once the job runs (its chief must live)");
        }
        if (!said && loom_now() - t0 > 5)
            said = true, loom_info("%s: waiting for the chief to admit this task at a step boundary", e->task);
    }
    uint32_t kind = loom_buf_get_u32(&b), epoch = loom_buf_get_u32(&b);
    int64_t step = loom_buf_get_i64(&b);
    *n = (int)loom_buf_get_u32(&b);
    for (int i = 0; i < *n && i < MAX_TASKS; i++) members[i] = (int)loom_buf_get_u32(&b);
    if (!b.failed && *n <= MAX_TASKS) get_addrs(e, &b);
    const char *rest = (const char *)b.data + b.pos;
    size_t rest_len = b.failed ? 0 : b.len - b.pos;
    bool bad = *n < (kind == ADMIT_REFUSED ? 0 : 1) || *n > MAX_TASKS || kind < ADMIT_FORM || kind > ADMIT_REFUSED;
    if (b.failed || bad) {
        loom_buf_fini(&b);
        return loom_err_set(err, LOOM_ENET, e->task, "an unreadable admission from the chief");
    }
    if (kind == ADMIT_REFUSED) {
        loom_err_set(err, LOOM_EUSAGE, e->task, "the chief refused this task's request to join the running job: %.*s",
                     (int)(rest_len > 300 ? 300 : rest_len), rest);
        loom_buf_fini(&b);
        return loom_err_hint(err, "raise strategy.elastic.max_workers (every task's config), or start it when a worker "
                             "has left");
    }
    if (kind == ADMIT_JOIN) {
        e->joined = true, e->joined_at = step, e->epoch = epoch;
        loom_buf_put(&e->state, rest, rest_len);
        loom_group_set_epoch(e->group, epoch); /* the members' count before this change's */
        loom_info("%s: admitted into the running job at step %lld, with %d workers", e->task, (long long)step, *n);
    }
    loom_buf_fini(&b);
    return e->state.failed ? loom_err_set(err, LOOM_ENOMEM, e->task, "holding the trainer's state") : LOOM_OK;
}

/* The first ring (or, for a task entering a running job, the ring of the members and this task). */
static int form(loom_elastic *e, loom_err *err)
{
    int members[MAX_TASKS], n = 0;
    int rc = e->cluster->rank == 0 ? chief_form(e, members, &n, err) : member_form(e, members, &n, err);
    return rc ? rc : loom_group_reform(e->group, members, n, err);
}

static int admit_limit(const loom_elastic *e)
{
    int n = loom_cluster_train_slots(e->cluster);
    return e->spec.max_workers > 0 && e->spec.max_workers < n ? e->spec.max_workers : n;
}

/* Whether the chief admits task tr after `done` steps: it asked, it is up,
 * it is not a member (a member restarted is dropped first), and a scripted
 * join (LOOM_TEST_MEMBERSHIP) is due. */
static bool admissible(loom_elastic *e, int tr, int64_t done)
{
    if (!e->waiting[tr] || is_member(e, tr)) return false;
    if (!loom_group_task_up(e->group, tr)) { /* it asked, then went away */
        e->waiting[tr] = false;
        return false;
    }
    return e->join_at[tr] < 0 || e->join_at[tr] <= done;
}

bool loom_elastic_want_join_(loom_elastic *e, int64_t step)
{
    if (!e || e->cluster->rank != 0) return false;
    take_requests(e, 0);
    int ntr = loom_cluster_train_slots(e->cluster);
    for (int tr = 1; tr < ntr; tr++) { /* a scripted join: the job waits for the task to ask */
        if (e->join_at[tr] != step + 1 || e->waiting[tr] || is_member(e, tr)) continue;
        char t[64];
        loom_info("holding step %lld until %s asks to join (LOOM_TEST_MEMBERSHIP)", (long long)step + 1,
                  task_of(e, tr, t, sizeof t));
        for (double until = loom_now() + 120; !e->waiting[tr] && loom_now() < until;) take_requests(e, 0.2);
        if (!e->waiting[tr]) loom_warn("%s did not ask to join within 120 s: the job goes on without it", t);
    }
    int n = loom_group_size(e->group);
    bool any = false;
    for (int tr = 1; tr < ntr; tr++) {
        if (!admissible(e, tr, step + 1)) continue;
        if (n >= admit_limit(e)) { /* refused politely: the job goes on */
            char t[64], why[160];
            int k = snprintf(why, sizeof why, "it has %d workers, strategy.elastic.max_workers = %d", n,
                             admit_limit(e));
            send_admit(e, tr, ADMIT_REFUSED, 0, 0, NULL, 0, why, (size_t)k);
            loom_warn("%s asked to join; refused: the job has %d workers (strategy.elastic.max_workers = %d)",
                      task_of(e, tr, t, sizeof t), n, admit_limit(e));
            e->waiting[tr] = false;
            continue;
        }
        n++, any = true;
    }
    return any;
}

/* The chief's decision on the tasks waiting to join after `done` steps:
 * the new members (task order), the joiners' names; tells every member and
 * hands each joiner the trainer's state. */
static int chief_admit(loom_elastic *e, int64_t done, const loom_buf *state, int *members, loom_err *err)
{
    int n = 0, ntr = loom_cluster_train_slots(e->cluster), joiners[MAX_TASKS], nj = 0, size = loom_group_size(e->group);
    for (int tr = 0; tr < ntr; tr++) {
        bool j = admissible(e, tr, done) && size + nj < admit_limit(e);
        if (j) joiners[nj++] = tr;
        if (j || is_member(e, tr)) members[n++] = tr;
    }
    loom_buf d;
    put_decision(e, &d, e->epoch + 1, done, 0, false, members, n);
    loom_err w;
    for (int i = 0; i < size; i++) {
        int tr = loom_group_member(e->group, i);
        if (tr != 0) loom_net_send(loom_group_net(e->group), tr - 1, MSG_DECISION, d.data, d.len, &w);
    }
    loom_buf_fini(&d);
    char who[256] = "";
    size_t len = 0;
    for (int k = 0; k < nj; k++) {
        char t[64];
        e->waiting[joiners[k]] = false;
        send_admit(e, joiners[k], ADMIT_JOIN, e->epoch + 1, done, members, n, state->data, state->len);
        len += (size_t)snprintf(who + len, len < sizeof who ? sizeof who - len : 0, "%s%s", k ? ", " : "",
                                task_of(e, joiners[k], t, sizeof t));
    }
    if (nj) {
        loom_warn("%s joined at step %lld; continuing with %d workers", who, (long long)done, n);
        record(e, "joined", done, who, members, n);
    }
    (void)err;
    return n;
}

int loom_elastic_admit_(loom_elastic *e, int64_t done, const loom_buf *state, float *params, int64_t P, float *slots,
                        int64_t n_slots, int *workers, loom_err *err)
{
    int members[MAX_TASKS], n = 0, source = 0, rc;
    int64_t best = done;
    bool stop = false;
    if (e->cluster->rank == 0) n = chief_admit(e, done, state, members, err);
    else if ((rc = recv_decision(e, members, &n, &best, &source, &stop, err))) return rc;
    if (best != done)
        return loom_err_set(err, LOOM_ENET, e->task, "the chief admitted workers after step %lld, this task is at "
                            "step %lld", (long long)best, (long long)done);
    e->epoch++;
    if ((rc = loom_group_reform(e->group, members, n, err))) return rc;
    if ((rc = loom_elastic_enter_(e, params, P, slots, n_slots, err))) return rc;
    *workers = n;
    return LOOM_OK;
}

int loom_elastic_enter_(loom_elastic *e, float *params, int64_t P, float *slots, int64_t n_slots, loom_err *err)
{
    int rc = loom_group_broadcast(e->group, params, (size_t)P * sizeof(float), 0, err);
    if (!rc && n_slots > 0) rc = loom_group_broadcast(e->group, slots, (size_t)n_slots * sizeof(float), 0, err);
    return rc ? loom_err_prefix(err, "handing the variables and optimizer slots to the workers that joined") : LOOM_OK;
}

/* The chief, after a loss left n < min_workers members (after `done`
 * steps): waits up to strategy.elastic.wait_timeout for tasks to ask to
 * join; true when enough did (the members go on and admit them after the
 * next step), false: the job stops with a checkpoint. */
static bool wait_joiners(loom_elastic *e, int64_t done, const char *left, const int *members, int n)
{
    if (e->spec.wait_timeout <= 0) return false;
    loom_warn("%s left at step %lld; %d worker%s left, fewer than strategy.elastic.min_workers = %d: waiting up to "
              "%g s (strategy.elastic.wait_timeout) for workers to join", left, (long long)done, n,
              n == 1 ? " is" : "s are", e->spec.min_workers, e->spec.wait_timeout);
    for (double until = loom_now() + e->spec.wait_timeout; loom_now() < until;) {
        take_requests(e, 0.2);
        int k = n;
        for (int tr = 1; tr < loom_cluster_train_slots(e->cluster) && k < admit_limit(e); tr++) {
            bool member = false;
            for (int i = 0; i < n; i++) member |= members[i] == tr;
            k += !member && e->waiting[tr] && (e->join_at[tr] < 0 || e->join_at[tr] <= done + 1) &&
                 loom_group_task_up(e->group, tr);
        }
        if (k >= e->spec.min_workers) {
            loom_warn("%d worker%s asked to join: the job goes on with %d workers for step %lld, then admits them",
                      k - n, k - n == 1 ? "" : "s", n, (long long)done + 1);
            return true;
        }
    }
    return false;
}
