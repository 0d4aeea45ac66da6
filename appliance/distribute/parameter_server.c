/* parameter_server.c - parameter-server training (TF2's
 * ParameterServerStrategy with a ClusterCoordinator; tf_semantics 5.8).
 *
 * Roles. The chief is the coordinator: it runs the trainer's loop, whose
 * every train_step hands out one applied update; it creates the variables
 * (the run's seed) and sends each ps its shards (INIT), schedules step
 * functions of run.steps_per_execution steps into a queue that any free
 * worker takes from, pulls the variables back for evaluation and
 * checkpoints, and tells every task when the job is done (END). A ps task
 * holds its shards and their optimizer slots (placement: ps_plan.c) and
 * applies the optimizer to them. A worker runs step functions: for each
 * step it pulls the variables from every ps, computes the gradients of one
 * batch of ITS OWN input pipeline and pushes them to the ps tasks. Workers
 * never talk to each other. An evaluator task has no part here (it exits).
 *
 * Input (create_per_worker_dataset): every worker builds data.train as
 * written, with the full batch, repeated (the worker starts the next pass
 * itself) and shuffled with a seed of its own (the run's seed mixed with
 * the worker's index; a transform's explicit seed is the same on every
 * worker). Nothing is sharded: there is no exactly-once visitation; each
 * worker visits its own permutation of the data, so over a pass of W
 * workers every example is seen W times in expectation. The chief's own
 * pipeline only paces the trainer's epochs (steps_per_epoch applied updates
 * make an epoch) and is never computed on.
 *
 * Updates. Asynchronous by default: a ps applies each push at once, with
 * the learning rate of its count of applied updates; a worker's gradients
 * may be some updates stale. strategy.sync = { replicas_to_aggregate = N;
 * total_replicas = M; } gives SyncReplicasOptimizer's semantics: every
 * worker takes part in every step function; each ps takes the first N
 * gradients pushed for its current step, applies their mean and moves to the
 * next step; a gradient pushed for an earlier step is stale: dropped,
 * counted and logged; workers wait (PULL with a least step) for the update
 * before computing the next one, so M - N backup workers hide stragglers.
 *
 * Counting. The trainer's step counter is the count of applied updates the
 * chief has been told of; the chief never schedules past the next point
 * where the trainer needs the variables at rest (an epoch's end, a multiple
 * of run.checkpoint_steps, run.max_steps), so a checkpoint holds exactly
 * the updates it counts. Execution is at least once (as TF's closures): a
 * worker lost in the middle of a step function may have pushed some of its
 * steps; the function is put back in the queue and runs again whole.
 *
 * Checkpoints are sharded (ps_internal.h): with the workers at rest, each
 * ps writes its shards and their slots to a file of its own, then the chief
 * commits an index naming them (train/checkpoint.c writes and reads both;
 * the model_dir is shared by every task). A restore reads the index on the
 * chief, which sends each ps its shards (INIT) and reads them back; the
 * iterator blob records the ps count and the partitioning, and another of
 * either is refused. A ps never builds the model: the variable list comes
 * from the config's model section (loom_model_param_list).
 *
 * Threads: driven from the train thread of each task; the transport runs
 * its own. */
#include "distribute.h"
#include "mirrored_internal.h"
#include "ps_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define ITER_MAGIC  0x53505350u /* "PSPS": the chief's iterator state with the ps count */
#define ITER_MAGIC2 0x32505350u /* "PSP2": ... the ps count, the shard count and the plan id */

typedef struct fn_slot {
    uint64_t fn;
    int64_t  first;
    uint32_t steps;
    int      worker;   /* running on; -1 queued */
} fn_slot;

typedef struct ps_strategy {
    const loom_strategy_args *args;
    loom_role       role;
    int             index;
    char            task[32];
    int             n_workers, n_ps;
    loom_model     *model;      /* chief and workers; a ps builds none (ps_open) */
    loom_optimizer *opt;
    loom_param_info *pi;        /* the variables (nv), from the model or, on a ps, the config alone */
    loom_sparse_grad lean_table; /* on a ps without the model: its embedding table (param -1: none) */
    int             nv;
    loom_ps_plan    plan;
    uint64_t        plan_id;    /* loom_ps_plan_id_: checkpoints name the partitioning */
    loom_ckpt_write_fn write_ckpt; /* the trainer's shard-file writer */
    int             n_slots;
    int64_t         P;
    loom_net       *net;
    int             peer_chief, *peer_ps, *peer_worker; /* net peer indices; -1 none */
    int             n_peers;
    loom_role      *peer_role;
    int            *peer_index;
    uint64_t        nonce, seed;
    int64_t         K;
    unsigned        test_step_us; /* LOOM_TEST_PS_STEP_MS: tests slow the workers' steps down */
    bool            sync;
    int             sync_n;
    double          wait_s;     /* how long the chief waits for a lost worker to come back */
    /* ---- chief ---- */
    bool            need_init;  /* the ps tasks need the chief's variables (open, restore) */
    bool            fresh;      /* the chief's model holds the ps tasks' variables */
    bool            restored;   /* the next INIT carries a checkpoint: read it back */
    int64_t         dispatched; /* the step after the last one scheduled */
    uint64_t        next_fn;
    fn_slot        *fns;        /* queued or running */
    int             n_fns, cap_fns;
    bool           *busy;       /* per worker */
    bool           *alive;      /* per worker */
    loom_ps_step_out *ready;    /* results not yet handed to the trainer (FIFO) */
    int64_t         n_ready, ready_head, cap_ready;
    loom_step_result pool;      /* sync: accepted contributions reported late */
    int64_t         stale, lost_fns, requeued;
    uint64_t        req;
    int64_t         ps_step;    /* the ps tasks' applied count at the last fetch */
    /* ---- the embedding table: sparse pull and push (every role) ---- */
    int             table_var;  /* the table's parameter tensor; -1: the model has none */
    int64_t         table_rows, table_off, table_dim;
    double          clip_norm;  /* optimizer.clip_norm: the worker clips its gradients before a push */
    bool           *is_table;   /* per shard: a shard of the table (updated row-wise, lazily) */
    bool            sparse;     /* workers pull and push the table rows a batch looks up, not the table */
    /* ---- worker ---- */
    int64_t        *sel_n;      /* per shard: rows of this step (-1: the whole shard) */
    uint32_t      **sel_rows;   /* per table shard: those rows, shard-local (first-seen order; ascending with clip_norm) */
    uint8_t        *mark;       /* per table row: selected already (cleared after each selection) */
    loom_elem      *held;       /* a batch taken but not computed on (sync: the step function ended) */
    int64_t         sel_total;  /* rows selected for this step */
    int64_t         moved_bytes, moved_rows, moved_steps; /* chief: the workers' reports (loom_ps_traffic) */
    int64_t         bytes_pull, bytes_push, rows_sel, steps_run;
} ps_strategy;

/* ---- small helpers -------------------------------------------------------- */

/* A ps or worker that gets SIGTERM or SIGINT (launch forwards them to every
 * task) keeps serving until the coordinator, which saves a checkpoint with
 * the ps tasks' variables, ends the job; a second signal stops it at once. */
static volatile sig_atomic_t serve_signals;
static void on_serve_signal(int sig)
{
    (void)sig;
    serve_signals++;
}

/* loom_net_recv in one-second waits, so a second signal is seen. */
static int recv_or_stop(ps_strategy *ps, int p, uint32_t lo, uint32_t hi, int *from, uint32_t *type, loom_buf *msg,
                        loom_err *err)
{
    for (;;) {
        int rc = loom_net_recv(ps->net, p, lo, hi, from, type, msg, 1.0, err);
        if (rc != LOOM_ETIMEOUT) return rc;
        if (serve_signals >= 2)
            return loom_err_set(err, LOOM_EIO, ps->task, "interrupted twice while waiting for the coordinator: stopped"),
                   loom_err_hint(err, "the coordinator saves the checkpoints; run the job again to resume");
    }
}

/* What each role reads from whom (ps_internal.h's message table): any other
 * type from a peer would wait in the transport's queue with nobody to take
 * it, so the transport refuses it at once, naming it (loom_net_reads). A ps
 * reads every ps type and answers one it does not expect with REFUSED. */
static void declare_reads(ps_strategy *ps)
{
#define B_(t) LOOM_NET_TYPE_BIT(LOOM_PS_MSG_##t)
    if (ps->role == LOOM_ROLE_PS) {
        uint64_t all = 0;
        for (uint32_t t = LOOM_PS_MSG_FIRST; t <= LOOM_PS_MSG_LAST; t++) all |= LOOM_NET_TYPE_BIT(t);
        loom_net_reads(ps->net, -1, all);
        return;
    }
    /* late answers to an abandoned request (VALUES, PUSHED, INIT_OK, SAVED) are read and skipped */
    const uint64_t from_ps = B_(INIT_OK) | B_(VALUES) | B_(PUSHED) | B_(REFUSED) | B_(SAVED);
    for (int q = 0; q < ps->n_ps; q++)
        if (ps->peer_ps[q] >= 0) loom_net_reads(ps->net, ps->peer_ps[q], from_ps);
    if (ps->role == LOOM_ROLE_CHIEF) {
        for (int w = 0; w < ps->n_workers; w++)
            if (ps->peer_worker[w] >= 0) loom_net_reads(ps->net, ps->peer_worker[w], B_(RESULT));
    } else if (ps->peer_chief >= 0) {
        loom_net_reads(ps->net, ps->peer_chief, B_(RUN) | B_(END));
    }
#undef B_
}

static uint64_t fresh_nonce(void)
{
    uint64_t v = 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        if (read(fd, &v, sizeof v) != (ssize_t)sizeof v) v = 0;
        close(fd);
    }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return v ^ loom_rng_mix((uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30), (uint64_t)getpid());
}

static const char *peer_name(const ps_strategy *ps, int p, char *buf, size_t n)
{
    if (p < 0 || p >= ps->n_peers) return snprintf(buf, n, "peer %d", p), buf;
    return loom_task_name(ps->peer_role[p], ps->peer_index[p], buf, n);
}


/* Tests: LOOM_TEST_PS_DIE = "TASK@N" kills this task (_exit 137) at its Nth
 * step function (a worker) or Nth push (a ps), once per file named by
 * LOOM_TEST_PS_DIE_MARK (created on dying) when that is set. */
static bool test_die_now(const char *task, int64_t nth)
{
    const char *die = getenv("LOOM_TEST_PS_DIE");
    char want[48];
    long long at = 0;
    if (!die || sscanf(die, "%47[^@]@%lld", want, &at) != 2 || strcmp(want, task) || at != nth) return false;
    const char *mark = getenv("LOOM_TEST_PS_DIE_MARK");
    if (mark) {
        if (access(mark, F_OK) == 0) return false;
        FILE *f = fopen(mark, "w");
        if (f) fclose(f);
    }
    loom_warn("%s: LOOM_TEST_PS_DIE: dying now (%s)", task, die);
    return true;
}

/* Tests: LOOM_TEST_PS_SAVE_DIE = "TASK@PHASE@STEP" kills this task
 * (_exit 137) in the checkpoint of STEP, at PHASE: a ps "before" writing its
 * shard file or "after" it (before answering), the chief at "index" (every
 * shard written, the index not yet); once per LOOM_TEST_PS_DIE_MARK file. */
static bool test_save_die_now(const char *task, const char *phase, int64_t step)
{
    const char *die = getenv("LOOM_TEST_PS_SAVE_DIE");
    char want[48], ph[16];
    long long at = 0;
    if (!die || sscanf(die, "%47[^@]@%15[^@]@%lld", want, ph, &at) != 3 || strcmp(want, task) || strcmp(ph, phase) ||
        at != step)
        return false;
    const char *mark = getenv("LOOM_TEST_PS_DIE_MARK");
    if (mark) {
        if (access(mark, F_OK) == 0) return false;
        FILE *f = fopen(mark, "w");
        if (f) fclose(f);
    }
    loom_warn("%s: LOOM_TEST_PS_SAVE_DIE: dying now (%s)", task, die);
    return true;
}

/* This process's resident memory, bytes ("VmRSS": now, "VmHWM": its
 * peak), from /proc/self/status; 0 when unknown. */
static int64_t resident(const char *key)
{
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return 0;
    char line[256], fmt[32];
    long long kb = 0;
    snprintf(fmt, sizeof fmt, "%s: %%lld kB", key);
    while (fgets(line, sizeof line, f))
        if (sscanf(line, fmt, &kb) == 1) break;
    fclose(f);
    return (int64_t)kb * 1024;
}

/* ---- open / close ---------------------------------------------------------- */

static int add_peer(ps_strategy *ps, loom_net_peer *peers, loom_role role, int index)
{
    int p = ps->n_peers++;
    peers[p] = (loom_net_peer){role, index};
    ps->peer_role[p] = role;
    ps->peer_index[p] = index;
    return p;
}

/* The model's embedding table (an embedding is the first layer, so there
 * is one at most) and its shards. A worker moves only the rows its batch
 * looks up (LOOM_TEST_PS_DENSE_TABLES=1: the whole table, as a dense
 * variable, for tests that compare the two), and keeps the model's grads
 * buffer to itself, so a backward clears only the rows it wrote. */
static int table_open(ps_strategy *ps, bool plan_only, loom_err *err)
{
    ps->table_var = -1;
    ps->is_table = loom_calloc((size_t)(ps->plan.n_shards ? ps->plan.n_shards : 1), sizeof *ps->is_table);
    if (!ps->is_table) return loom_err_set(err, LOOM_ENOMEM, NULL, "listing the table's shards");
    loom_sparse_grad sg = ps->lean_table;
    if (ps->model) {
        if (loom_model_num_sparse(ps->model) != 1) return LOOM_OK;
        loom_model_sparse_grad(ps->model, 0, &sg);
    } else if (sg.param < 0)
        return LOOM_OK;
    ps->table_var = sg.param;
    ps->table_rows = sg.rows;
    ps->table_off = sg.offset;
    ps->table_dim = sg.dim;
    for (int i = 0; i < ps->plan.n_shards; i++) ps->is_table[i] = ps->plan.shard[i].var == sg.param;
    const char *dense = getenv("LOOM_TEST_PS_DENSE_TABLES");
    ps->sparse = !(dense && strcmp(dense, "1") == 0);
    if (plan_only || ps->role != LOOM_ROLE_WORKER) return LOOM_OK;
    loom_model_set_sparse_owner(ps->model, 1);
    ps->sel_n = loom_calloc((size_t)ps->plan.n_shards, sizeof *ps->sel_n);
    ps->sel_rows = loom_calloc((size_t)ps->plan.n_shards, sizeof *ps->sel_rows);
    ps->mark = loom_calloc((size_t)(sg.rows ? sg.rows : 1), 1);
    if (!ps->sel_n || !ps->sel_rows || !ps->mark) return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating row lists");
    for (int i = 0; i < ps->plan.n_shards; i++) {
        ps->sel_n[i] = -1;
        if (!ps->is_table[i]) continue;
        ps->sel_rows[i] = loom_alloc((size_t)(ps->plan.shard[i].rows ? ps->plan.shard[i].rows : 1) * sizeof(uint32_t));
        if (!ps->sel_rows[i])
            return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating the row list of %lld rows",
                                (long long)ps->plan.shard[i].rows);
    }
    return LOOM_OK;
}

/* Asynchronous updates add momentum of their own: a gradient computed on
 * variables some updates old acts like a momentum term (with W workers about
 * 1 - 1/W; Mitliagkas et al., "Asynchrony begets momentum", 2016), on top of
 * the optimizer's. Heavy momentum with async workers then overshoots:
 * fashion_mnist_parameter_server.cfg with momentum 0.9 ended at 0.80-0.84
 * eval accuracy after 2000 steps against 0.87 on one_device (issue 22). Said
 * once by the coordinator (and by loom check). */
#define PS_ASYNC_MOMENTUM_WARN 0.9
static void warn_async_momentum(const loom_spec *spec, int n_workers)
{
    const loom_optimizer_spec *o = &spec->optimizer;
    if (spec->strategy.sync.enabled || o->kind != LOOM_OPT_MOMENTUM || o->momentum < PS_ASYNC_MOMENTUM_WARN ||
        n_workers == 1)
        return;
    char w[600];
    loom_warn("%s: optimizer.momentum = %g with asynchronous parameter-server training: stale gradients add momentum "
              "of their own (about 1 - 1/workers), so training may end less accurate than on one device; lower "
              "optimizer.momentum, use sgd (as configs/fashion_mnist_parameter_server.cfg does) or synchronous updates "
              "(strategy.sync = { replicas_to_aggregate = N; })", loom_loc_str(&o->loc, w, sizeof w), o->momentum);
}

static int ps_open(loom_strategy *s, const loom_strategy_args *a, loom_err *err)
{
    const loom_spec *spec = a->spec;
    const loom_cluster *c = a->cluster;
    ps_strategy *ps = loom_calloc(1, sizeof *ps);
    if (!ps) return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating the parameter_server strategy");
    s->impl = ps;
    ps->args = a;
    /* no cluster, no task (loom evaluate, predict, export, check) or the evaluator (check --task evaluator:0):
     * the model alone, as the coordinator holds it, and no transport; training refuses */
    ps->role = c && c->index >= 0 ? c->role : LOOM_ROLE_CHIEF;
    ps->index = c && c->index >= 0 ? c->index : 0;
    loom_task_name(ps->role, ps->index, ps->task, sizeof ps->task);
    ps->n_workers = c ? c->n_tasks[LOOM_ROLE_WORKER] : 0;
    ps->n_ps = c ? c->n_tasks[LOOM_ROLE_PS] : 1;
    ps->seed = spec->run.seed;
    ps->K = spec->run.steps_per_execution > 0 ? spec->run.steps_per_execution : 1;
    if (ps->K > LOOM_PS_MAX_STEPS) ps->K = LOOM_PS_MAX_STEPS;
    ps->sync = spec->strategy.sync.enabled;
    ps->sync_n = spec->strategy.sync.replicas_to_aggregate;
    ps->clip_norm = spec->optimizer.clip_norm;
    ps->wait_s = c && c->connect_timeout > 0 ? c->connect_timeout : 60;
    ps->peer_chief = -1;
    const char *slow = getenv("LOOM_TEST_PS_STEP_MS");
    if (slow && atoi(slow) > 0 && atoi(slow) < 10000) ps->test_step_us = (unsigned)atoi(slow) * 1000u;
    const loom_elem_spec *in = a->input;
    loom_shape x = in->shape[a->input_idx], y = in->shape[a->label_idx];
    loom_shape xe = loom_shape_make(x.rank - 1, x.dim + 1), ye = loom_shape_make(y.rank - 1, y.dim + 1);
    int rc;
    if (ps->role == LOOM_ROLE_PS && !a->plan_only && c && c->index >= 0) {
        /* a ps holds its shards only: the variable list from the config's
         * model section, no weights, gradients or activations of the whole
         * model (it gets its shards' values from the coordinator) */
        rc = loom_model_param_list(&spec->model, &xe, in->dtype[a->input_idx], &ye, in->dtype[a->label_idx], &ps->pi,
                                   &ps->nv, &ps->P, &ps->lean_table, err);
        if (rc) return rc;
    } else {
        rc = loom_model_new(&ps->model, &spec->model, &xe, in->dtype[a->input_idx], &ye, in->dtype[a->label_idx],
                            a->max_batch, err);
        if (rc) return rc;
        if (ps->role != LOOM_ROLE_PS && (rc = loom_model_set_threads(ps->model, spec->run.threads, err))) return rc;
        loom_model_init_params(ps->model, spec->run.seed);
        ps->P = loom_model_num_params(ps->model);
        ps->nv = loom_model_num_param_tensors(ps->model);
        ps->pi = loom_calloc((size_t)(ps->nv ? ps->nv : 1), sizeof *ps->pi);
        if (!ps->pi) return loom_err_set(err, LOOM_ENOMEM, NULL, "listing %d variables", ps->nv);
        for (int v = 0; v < ps->nv; v++) ps->pi[v] = *loom_model_param_tensor(ps->model, v);
    }
    int nv = ps->nv;
    loom_param_info *pi = ps->pi;
    char pw[600];
    const loom_partitioner_spec *part = &spec->strategy.partitioner;
    loom_loc_str(part->kind != LOOM_PARTITIONER_NONE ? &part->loc : &spec->strategy.loc, pw, sizeof pw);
    rc = loom_ps_plan_make_(&ps->plan, pi, nv, ps->n_ps > 0 ? ps->n_ps : 1,
                            part->kind != LOOM_PARTITIONER_NONE ? part : NULL, pw, err);
    if (rc) return rc;
    ps->plan_id = loom_ps_plan_id_(&ps->plan, pi);
    /* the chief's optimizer: for checkpoints (slots pulled back) and the LR it reports */
    rc = loom_optimizer_new(&ps->opt, &spec->optimizer, ps->role == LOOM_ROLE_PS ? 1 : ps->P, err);
    if (rc) return rc;
    ps->n_slots = loom_optimizer_num_slots(ps->opt);
    if (ps->role == LOOM_ROLE_CHIEF) warn_async_momentum(spec, ps->n_workers);
    bool alone = a->plan_only || !c || c->index < 0 || ps->role == LOOM_ROLE_EVALUATOR; /* no part in training */
    if ((rc = table_open(ps, alone, err))) return rc;
    if (alone) return LOOM_OK;

    int maxp = ps->n_workers + ps->n_ps + 1;
    loom_net_peer *peers = loom_calloc((size_t)maxp, sizeof *peers);
    ps->peer_role = loom_calloc((size_t)maxp, sizeof *ps->peer_role);
    ps->peer_index = loom_calloc((size_t)maxp, sizeof *ps->peer_index);
    ps->peer_ps = loom_calloc((size_t)(ps->n_ps + 1), sizeof *ps->peer_ps);
    ps->peer_worker = loom_calloc((size_t)(ps->n_workers + 1), sizeof *ps->peer_worker);
    ps->busy = loom_calloc((size_t)(ps->n_workers + 1), sizeof *ps->busy);
    ps->alive = loom_calloc((size_t)(ps->n_workers + 1), sizeof *ps->alive);
    if (!peers || !ps->peer_role || !ps->peer_index || !ps->peer_ps || !ps->peer_worker || !ps->busy || !ps->alive) {
        loom_free(peers);
        return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating the peer tables");
    }
    for (int i = 0; i < ps->n_ps; i++) ps->peer_ps[i] = -1;
    for (int i = 0; i < ps->n_workers; i++) ps->peer_worker[i] = -1;
    if (ps->role != LOOM_ROLE_CHIEF) ps->peer_chief = add_peer(ps, peers, LOOM_ROLE_CHIEF, 0);
    if (ps->role != LOOM_ROLE_WORKER)
        for (int i = 0; i < ps->n_workers; i++) ps->peer_worker[i] = add_peer(ps, peers, LOOM_ROLE_WORKER, i);
    if (ps->role != LOOM_ROLE_PS)
        for (int i = 0; i < ps->n_ps; i++) ps->peer_ps[i] = add_peer(ps, peers, LOOM_ROLE_PS, i);
    rc = loom_net_open(&ps->net, c, peers, ps->n_peers, err);
    loom_free(peers);
    if (rc) return rc;
    /* workers may leave and come back: their loss is news, not the end of the job */
    for (int i = 0; i < ps->n_workers; i++)
        if (ps->peer_worker[i] >= 0) loom_net_tolerate(ps->net, ps->peer_worker[i]);
    for (int i = 0; i < ps->n_workers; i++) ps->alive[i] = true;
    declare_reads(ps);
    if (ps->role == LOOM_ROLE_CHIEF) {
        ps->nonce = fresh_nonce();
        ps->need_init = true;
        ps->fresh = true;
    }
    return LOOM_OK;
}

static void drain_workers(ps_strategy *ps);

static void send_end(ps_strategy *ps)
{
    loom_err e;
    for (int p = 0; p < ps->n_peers; p++) loom_net_send(ps->net, p, LOOM_PS_MSG_END, "", 0, &e);
}

/* The bytes of the workers' pull and push messages (the transport's
 * framing aside) per step they computed, beside those of moving every
 * variable whole both ways; benches and tests read the key=value fields. */
static void traffic_report(const ps_strategy *ps)
{
    int64_t n = ps->moved_steps, per = ps->moved_bytes / n, whole = 2 * ps->P * (int64_t)sizeof(float);
    char a[32], w[32], rows[160] = "";
    loom_ps_bytes_str_(per, a, sizeof a);
    loom_ps_bytes_str_(whole, w, sizeof w);
    if (ps->table_var >= 0 && ps->sparse)
        snprintf(rows, sizeof rows, "; sparse table updates: %.1f of the table's %lld rows a step (rows_per_step=%.1f)",
                 (double)ps->moved_rows / (double)n, (long long)ps->table_rows, (double)ps->moved_rows / (double)n);
    else if (ps->table_var >= 0)
        snprintf(rows, sizeof rows, "; the table moved whole");
    loom_info("parameter_server: the workers' pulls and pushes moved %s a step (bytes_per_step=%lld over %lld steps); "
              "every variable whole both ways would be %s (whole_bytes_per_step=%lld, %.1fx)%s", a, (long long)per,
              (long long)n, w, (long long)whole, per ? (double)whole / (double)per : 0.0, rows);
}

static void ps_close(loom_strategy *s)
{
    ps_strategy *ps = s->impl;
    if (!ps) return;
    if (ps->net && ps->role == LOOM_ROLE_CHIEF) {
        drain_workers(ps);
        send_end(ps);
        if (ps->stale || ps->requeued || ps->sync)
            loom_info("parameter_server: %lld stale gradient%s dropped, %lld step function%s put back in the queue "
                      "after a lost worker", (long long)ps->stale, ps->stale == 1 ? "" : "s", (long long)ps->requeued,
                      ps->requeued == 1 ? "" : "s");
        if (ps->moved_steps) traffic_report(ps);
    }
    loom_net_close(ps->net);
    loom_model_free(ps->model);
    loom_optimizer_free(ps->opt);
    loom_free(ps->pi);
    loom_free(ps->peer_role);
    loom_free(ps->peer_index);
    loom_free(ps->peer_ps);
    loom_free(ps->peer_worker);
    loom_free(ps->busy);
    loom_free(ps->alive);
    loom_free(ps->fns);
    loom_free(ps->ready);
    if (ps->sel_rows)
        for (int i = 0; i < ps->plan.n_shards; i++) loom_free(ps->sel_rows[i]);
    loom_free(ps->sel_rows);
    loom_free(ps->sel_n);
    loom_free(ps->mark);
    loom_free(ps->is_table);
    loom_ps_plan_free_(&ps->plan); /* last: the loops above count its shards */
    loom_free(ps);
}

/* ---- range messages --------------------------------------------------------- */

/* Rows sel_n[i] of shard i on a worker's step: -1 the whole shard. */
static int64_t sel_of(const ps_strategy *ps, bool sel, int i) { return sel && ps->sel_n ? ps->sel_n[i] : -1; }

/* Every shard of ps q, whole, with values from base (flat layout, NULL: none)
 * and slots (n_slots blocks of P floats, flat layout) when slots is given.
 * sel (a worker's step, never with slots): a table shard only with the rows
 * the step selected (select_rows), none when it selected none. */
static int put_shards_sel(loom_buf *b, const ps_strategy *ps, int q, const loom_ps_hdr *h0, const float *base,
                          const float *slots, bool sel)
{
    loom_ps_hdr h = *h0;
    h.n_ranges = 0;
    for (int i = 0; i < ps->plan.n_shards; i++) h.n_ranges += ps->plan.shard[i].ps == q && sel_of(ps, sel, i) != 0;
    loom_ps_put_hdr_(b, &h);
    for (int i = 0; i < ps->plan.n_shards; i++) {
        const loom_ps_shard *sh = &ps->plan.shard[i];
        int64_t n = sel_of(ps, sel, i);
        if (sh->ps != q || n == 0) continue;
        if (n > 0) { /* rows of the table */
            LOOM_ASSERT(!slots);
            loom_ps_put_range_(b, (uint32_t)i, (uint32_t)n, ps->sel_rows[i]);
            if (base)
                for (int64_t j = 0; j < n; j++)
                    loom_buf_put(b, base + sh->offset + (int64_t)ps->sel_rows[i][j] * sh->row_size,
                                 (size_t)sh->row_size * sizeof(float));
            continue;
        }
        loom_ps_put_range_(b, (uint32_t)i, LOOM_PS_WHOLE, NULL);
        if (base) loom_buf_put(b, base + sh->offset, (size_t)sh->count * sizeof(float));
        if (slots)
            for (int k = 0; k < ps->n_slots; k++)
                loom_buf_put(b, slots + (size_t)k * (size_t)ps->P + sh->offset, (size_t)sh->count * sizeof(float));
    }
    return b->failed ? LOOM_ENOMEM : LOOM_OK;
}

static int put_shards(loom_buf *b, const ps_strategy *ps, int q, const loom_ps_hdr *h0, const float *base,
                      const float *slots)
{
    return put_shards_sel(b, ps, q, h0, base, slots, false);
}

/* A VALUES message's floats into the flat buffers (whole ranges, or rows). */
static void take_values(const ps_strategy *ps, const loom_ps_msg *m, float *base, float *slots)
{
    for (int i = 0; i < m->n; i++) {
        const loom_ps_range *r = &m->r[i];
        const loom_ps_shard *sh = &ps->plan.shard[r->shard];
        int blocks = 1 + ((m->h.flags & LOOM_PS_F_SLOTS) ? ps->n_slots : 0);
        for (int k = 0; k < blocks; k++) {
            float *dst = k == 0 ? base : slots ? slots + (size_t)(k - 1) * (size_t)ps->P : NULL;
            if (!dst) continue;
            const uint8_t *src = r->vals + (size_t)k * (size_t)r->n_vals * sizeof(float);
            if (r->n_rows == LOOM_PS_WHOLE) {
                memcpy(dst + sh->offset, src, (size_t)sh->count * sizeof(float));
            } else {
                for (uint32_t j = 0; j < r->n_rows; j++)
                    memcpy(dst + sh->offset + (int64_t)loom_ps_row_(r, j) * sh->row_size,
                           src + (size_t)j * (size_t)sh->row_size * sizeof(float), (size_t)sh->row_size * sizeof(float));
            }
        }
    }
}

/* A ps's refusal: the text it sent. */
static int refused(const ps_strategy *ps, int from, const loom_buf *msg, loom_err *err)
{
    char who[32], text[400];
    size_t l = msg->len < sizeof text - 1 ? msg->len : sizeof text - 1;
    memcpy(text, msg->data, l);
    text[l] = 0;
    return loom_err_set(err, LOOM_ENET, ps->task, "%s refused our message: %s", peer_name(ps, from, who, sizeof who),
                        text);
}

/* Pulls every ps's shards into base (and slots, with_slots); min_step: the
 * least applied count to answer with. *step: the least applied count the
 * ps tasks answered with. */
static int pull_sel(ps_strategy *ps, float *base, float *slots, int64_t min_step, int64_t *step, bool sel,
                    loom_err *err)
{
    loom_buf b;
    loom_buf_init(&b);
    uint64_t req = ++ps->req;
    int rc = LOOM_OK;
    for (int q = 0; q < ps->n_ps && !rc; q++) {
        b.len = 0;
        loom_ps_hdr h = {.req = req, .nonce = ps->nonce, .step = min_step, .flags = slots ? LOOM_PS_F_SLOTS : 0};
        if (put_shards_sel(&b, ps, q, &h, NULL, NULL, sel))
            rc = loom_err_set(err, LOOM_ENOMEM, NULL, "building a pull request");
        else
            rc = loom_net_send(ps->net, ps->peer_ps[q], LOOM_PS_MSG_PULL, b.data, b.len, err);
        ps->bytes_pull += (int64_t)b.len;
    }
    int64_t least = INT64_MAX;
    for (int q = 0; q < ps->n_ps && !rc; q++) {
        uint32_t type;
        int from;
        for (;;) { /* a refusal (a pull that did not decode) ends the wait; a late PUSHED is skipped */
            rc = loom_net_recv(ps->net, ps->peer_ps[q], LOOM_PS_MSG_VALUES, LOOM_PS_MSG_REFUSED, &from, &type, &b, -1, err);
            if (rc) break;
            if (type == LOOM_PS_MSG_REFUSED) {
                rc = refused(ps, from, &b, err);
                break;
            }
            if (type != LOOM_PS_MSG_VALUES) continue;
            loom_ps_msg m;
            if ((rc = loom_ps_decode_(b.data, b.len, &ps->plan, q, ps->n_slots, true, &m, err))) {
                char who[32];
                loom_err_hint(err, "a VALUES message from %s did not decode", peer_name(ps, from, who, sizeof who));
                break;
            }
            if (m.h.req != req) { /* an answer to an earlier pull (abandoned): skip it */
                loom_ps_msg_fini_(&m);
                continue;
            }
            ps->bytes_pull += (int64_t)b.len;
            take_values(ps, &m, base, slots);
            if (m.h.step < least) least = m.h.step;
            loom_ps_msg_fini_(&m);
            break;
        }
    }
    loom_buf_fini(&b);
    if (!rc && step) *step = least == INT64_MAX ? 0 : least;
    return rc;
}

static int pull_all(ps_strategy *ps, float *base, float *slots, int64_t min_step, int64_t *step, loom_err *err)
{
    return pull_sel(ps, base, slots, min_step, step, false, err);
}

/* ---- the worker ------------------------------------------------------------- */

static int next_batch(loom_iter *it, int64_t *epoch, loom_elem **out, loom_err *err)
{
    int rc = loom_iter_next(it, out, err);
    if (rc != LOOM_EEOF) return rc;
    if ((rc = loom_iter_rewind(it, ++*epoch, err))) return rc; /* repeat: the next pass */
    rc = loom_iter_next(it, out, err);
    if (rc == LOOM_EEOF)
        return loom_err_set(err, LOOM_EDATA, NULL, "data.train yielded no batch on this worker"),
               loom_err_hint(err, "the dataset is empty after take/skip/batch(drop_remainder)");
    return rc;
}

/* The table rows the batch's ids x look up, per shard of the table, into
 * sel_n and sel_rows (distinct, in first-seen order). An id of -1 adds
 * nothing (padding); an id outside the table is not pulled: the step that
 * follows fails naming it, as on one machine. */
static void select_rows(ps_strategy *ps, const loom_tensor *x)
{
    if (!ps->sparse || !ps->sel_n) return;
    if (x->dtype != LOOM_I32 && x->dtype != LOOM_I64) return; /* (refused when the model was built) */
    int first = -1, k = 0;
    for (int i = 0; i < ps->plan.n_shards; i++)
        if (ps->is_table[i]) {
            if (first < 0) first = i;
            k++;
            ps->sel_n[i] = 0;
        }
    int64_t n = 1, rows = ps->table_rows;
    for (int d = 0; d < x->shape.rank; d++) n *= x->shape.dim[d];
    /* shard j of k holds rows [j*base + min(j, extra), ...): the first extra shards one row longer */
    int64_t base = rows / k, extra = rows % k, cut = extra * (base + 1);
    for (int64_t e = 0; e < n; e++) {
        int64_t id = x->dtype == LOOM_I64 ? ((const int64_t *)x->data)[e] : ((const int32_t *)x->data)[e];
        if (id < 0 || id >= rows || ps->mark[id]) continue;
        ps->mark[id] = 1;
        int64_t j = id < cut ? id / (base + 1) : extra + (id - cut) / base;
        const loom_ps_shard *sh = &ps->plan.shard[first + j];
        LOOM_ASSERT(id >= sh->row0 && id < sh->row0 + sh->rows);
        ps->sel_rows[first + j][ps->sel_n[first + j]++] = (uint32_t)(id - sh->row0);
    }
    ps->sel_total = 0;
    for (int i = first; i < first + k; i++) {
        for (int64_t j = 0; j < ps->sel_n[i]; j++) ps->mark[ps->plan.shard[i].row0 + ps->sel_rows[i][j]] = 0;
        ps->sel_total += ps->sel_n[i];
    }
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

/* optimizer.clip_norm (tf.clip_by_global_norm) under parameter_server: no
 * ps holds every gradient, so the worker scales its own by their global
 * norm before pushing them, as a TF worker's step function clips before
 * the update, and the ps tasks apply them unclipped. The norm sums the
 * squares in the flat buffer's order (a sparse step: the dense part, then
 * the table's selected rows in ascending order, the other table rows being
 * zero) and the scaled gradients are g * factor in float, so the update's
 * bits are those of one_device's optimizer clipping the same gradients. */
static void clip_grads(ps_strategy *ps)
{
    float *g = loom_model_grads(ps->model);
    bool rows = ps->table_var >= 0 && ps->sparse && ps->sel_n;
    int64_t lo = rows ? ps->table_off : ps->P, hi = rows ? ps->table_off + ps->table_rows * ps->table_dim : ps->P;
    double ss = 0;
    for (int64_t i = 0; i < lo; i++) ss += (double)g[i] * g[i];
    for (int i = 0; rows && i < ps->plan.n_shards; i++) { /* the table's shards ascend */
        if (!ps->is_table[i] || ps->sel_n[i] <= 0) continue;
        qsort(ps->sel_rows[i], (size_t)ps->sel_n[i], sizeof(uint32_t), cmp_u32);
        for (int64_t j = 0; j < ps->sel_n[i]; j++) {
            const float *r = g + ps->table_off + (ps->plan.shard[i].row0 + ps->sel_rows[i][j]) * ps->table_dim;
            for (int64_t e = 0; e < ps->table_dim; e++) ss += (double)r[e] * r[e];
        }
    }
    for (int64_t i = hi; i < ps->P; i++) ss += (double)g[i] * g[i];
    double norm = sqrt(ss);
    if (!(norm > ps->clip_norm)) return;
    float c = (float)(ps->clip_norm / norm);
    for (int64_t i = 0; i < lo; i++) g[i] = g[i] * c;
    for (int i = 0; rows && i < ps->plan.n_shards; i++) {
        if (!ps->is_table[i] || ps->sel_n[i] <= 0) continue;
        for (int64_t j = 0; j < ps->sel_n[i]; j++) {
            float *r = g + ps->table_off + (ps->plan.shard[i].row0 + ps->sel_rows[i][j]) * ps->table_dim;
            for (int64_t e = 0; e < ps->table_dim; e++) r[e] = r[e] * c;
        }
    }
    for (int64_t i = hi; i < ps->P; i++) g[i] = g[i] * c;
}

/* Pushes the model's gradients (flat) to every ps; *accepted: all took them.
 * pull: the ps tasks answer with the new values, into the model (async). */
static int push_all(ps_strategy *ps, int64_t tag, bool pull, bool *accepted, int64_t *applied, loom_err *err)
{
    loom_buf b;
    loom_buf_init(&b);
    uint64_t req = ++ps->req;
    const float *g = loom_model_grads(ps->model);
    int rc = LOOM_OK;
    for (int q = 0; q < ps->n_ps && !rc; q++) {
        b.len = 0;
        loom_ps_hdr h = {.req = req, .nonce = ps->nonce, .step = tag, .flags = pull ? LOOM_PS_F_PULL : 0};
        if (put_shards_sel(&b, ps, q, &h, g, NULL, true)) rc = loom_err_set(err, LOOM_ENOMEM, NULL, "building a push");
        else rc = loom_net_send(ps->net, ps->peer_ps[q], LOOM_PS_MSG_PUSH, b.data, b.len, err);
        ps->bytes_push += (int64_t)b.len;
    }
    *accepted = true;
    *applied = INT64_MAX;
    for (int q = 0; q < ps->n_ps && !rc; q++) {
        uint32_t type;
        int from;
        for (;;) {
            rc = loom_net_recv(ps->net, ps->peer_ps[q], LOOM_PS_MSG_VALUES, LOOM_PS_MSG_REFUSED, &from, &type, &b, -1, err);
            if (rc) break;
            if (type == LOOM_PS_MSG_REFUSED) {
                rc = refused(ps, from, &b, err);
                break;
            }
            if (type != LOOM_PS_MSG_PUSHED && type != LOOM_PS_MSG_VALUES) continue;
            loom_ps_msg m;
            if ((rc = loom_ps_decode_(b.data, b.len, &ps->plan, q, ps->n_slots, type == LOOM_PS_MSG_VALUES, &m, err)))
                break;
            bool mine = m.h.req == req;
            if (mine) ps->bytes_push += (int64_t)b.len;
            if (mine && type == LOOM_PS_MSG_VALUES) take_values(ps, &m, loom_model_params(ps->model), NULL);
            if (mine) {
                if (!(m.h.flags & LOOM_PS_F_ACCEPTED)) *accepted = false;
                if (m.h.step < *applied) *applied = m.h.step;
            }
            loom_ps_msg_fini_(&m);
            if (mine) break;
        }
    }
    loom_buf_fini(&b);
    return rc;
}

/* One step function: r->steps steps (async), or (sync) the steps of the
 * job from r->first until the ps tasks reach r->first + r->steps. */
static int run_fn(ps_strategy *ps, const loom_strategy_args *a, loom_iter *it, int64_t *epoch, const loom_ps_run *r,
                  loom_ps_step_out *out, uint32_t *n_out, loom_err *err)
{
    float *params = loom_model_params(ps->model);
    *n_out = 0;
    int64_t end = r->first + r->steps, t = r->first;
    bool have = false; /* (async) the last push brought the new values back */
    for (uint32_t i = 0; i < r->steps || ps->sync; i++) {
        int64_t seen = 0;
        int rc;
        /* sparse: the batch first, to pull the rows it looks up; one the
         * function ends without computing on is held for the next */
        loom_elem *batch = ps->held;
        ps->held = NULL;
        if (ps->sparse && !batch && (rc = next_batch(it, epoch, &batch, err))) return rc;
        if (batch) select_rows(ps, &batch->t[a->input_idx]);
        rc = have ? LOOM_OK : pull_sel(ps, params, NULL, ps->sync ? t : 0, &seen, true, err);
        if (rc) return rc;
        if (ps->sync && seen >= end) {
            ps->held = batch;
            break;
        }
        if (!ps->sync) seen = r->first + i;
        if (!batch && (rc = next_batch(it, epoch, &batch, err))) return rc;
        const loom_tensor *x = &batch->t[a->input_idx], *y = &batch->t[a->label_idx];
        int64_t B = x->shape.dim[0];
        loom_ps_step_out *o = &out[*n_out];
        memset(o, 0, sizeof *o);
        o->step = seen;
        o->examples = B;
        uint64_t key = loom_rng_mix(loom_rng_mix(ps->seed, 0x50530000u + (uint64_t)ps->index), (uint64_t)seen);
        rc = loom_model_train_step(ps->model, x, y, B, key, &o->loss_sum, &o->correct, err);
        if (rc) return rc;
        if (ps->clip_norm > 0) clip_grads(ps);
        if (ps->test_step_us) usleep(ps->test_step_us); /* tests: a slower worker */
        bool accepted;
        int64_t applied;
        ps->steps_run++;
        ps->rows_sel += ps->sparse ? ps->sel_total : 0;
        have = !ps->sync && !ps->sparse && i + 1 < r->steps; /* (sparse: the next batch wants other rows) */
        if ((rc = push_all(ps, seen, have, &accepted, &applied, err))) return rc;
        o->accepted = accepted;
        (*n_out)++;
        t = seen + 1;
        if (*n_out >= LOOM_PS_MAX_STEPS) break;
    }
    return LOOM_OK;
}

static int worker_serve(ps_strategy *ps, const loom_strategy_args *a, loom_iter *it, loom_err *err)
{
    loom_buf msg;
    loom_buf_init(&msg);
    loom_ps_step_out *out = loom_calloc(LOOM_PS_MAX_STEPS, sizeof *out);
    if (!out) return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating step results");
    int64_t epoch = 0, runs = 0;
    int rc;
    for (;;) {
        int from;
        uint32_t type;
        rc = recv_or_stop(ps, ps->peer_chief, LOOM_PS_MSG_RUN, LOOM_PS_MSG_END, &from, &type, &msg, err);
        if (rc) break;
        if (type == LOOM_PS_MSG_END) break;
        if (type != LOOM_PS_MSG_RUN) continue;
        loom_ps_run r;
        if ((rc = loom_ps_decode_run_(msg.data, msg.len, &r, err))) break;
        ps->nonce = r.nonce;
        uint32_t n = 0;
        int64_t bytes0 = ps->bytes_pull + ps->bytes_push, rows0 = ps->rows_sel;
        if (test_die_now(ps->task, ++runs)) { /* in the middle of the function: some of its steps pushed */
            loom_ps_run half = r;
            half.steps = r.steps > 1 ? r.steps / 2 : 1;
            if (!ps->sync) run_fn(ps, a, it, &epoch, &half, out, &n, err);
            _exit(137);
        }
        if ((rc = run_fn(ps, a, it, &epoch, &r, out, &n, err))) break;
        loom_buf_fini(&msg);
        loom_buf_init(&msg);
        loom_ps_traffic tr = {.bytes = (uint64_t)(ps->bytes_pull + ps->bytes_push - bytes0),
                              .rows = (uint64_t)(ps->rows_sel - rows0)};
        loom_ps_put_result_(&msg, r.fn, out, n, &tr);
        if (msg.failed) {
            rc = loom_err_set(err, LOOM_ENOMEM, NULL, "building a step result");
            break;
        }
        if ((rc = loom_net_send(ps->net, ps->peer_chief, LOOM_PS_MSG_RESULT, msg.data, msg.len, err))) break;
    }
    loom_buf_fini(&msg);
    loom_free(out);
    return rc;
}

/* ---- the ps ------------------------------------------------------------------ */

typedef struct pending_pull {
    int       from;
    loom_buf  msg;
    int64_t   min_step;
} pending_pull;

typedef struct ps_state {
    ps_strategy    *ps;
    int             q;
    int64_t         L;
    float          *params, *grads, *acc, *slots;
    loom_optimizer *opt;
    int64_t         step, stale, refused, pushes;
    int64_t         alloc_bytes; /* its variables, gradients, sums and slots: what it allocated to serve */
    int64_t         rss_ready;   /* resident bytes with those allocated, before any message */
    int             acc_n;
    bool            inited;
    pending_pull   *pend;
    int             n_pend, cap_pend;
    /* rows of table shards: the ids of a push (and 0..rows-1 for a whole
     * shard) as the optimizer takes them; sync: per shard, the rows the
     * step's accepted pushes touched (acc is zero elsewhere) */
    int64_t        *ids, *iota;
    bool           *acc_whole;   /* per shard: pushed whole into acc */
    int64_t       **acc_rows;    /* per table shard of this ps: rows in acc, first-touched order */
    int64_t        *acc_nrows;
    uint8_t       **acc_mark;    /* per table shard of this ps: row in acc_rows already */
} ps_state;

static int refuse(ps_state *st, int from, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int refuse(ps_state *st, int from, const char *fmt, ...)
{
    char text[400], who[32];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    st->refused++;
    loom_warn("%s: refused a message from %s: %s", st->ps->task, peer_name(st->ps, from, who, sizeof who), text);
    loom_err e;
    return loom_net_send(st->ps->net, from, LOOM_PS_MSG_REFUSED, text, strlen(text), &e) ? LOOM_OK : LOOM_OK;
}

/* Answers a PULL (already decoded as m), or a PUSH asking for the new values. */
static int answer_pull(ps_state *st, int from, const loom_ps_msg *m, bool pushed, loom_err *err)
{
    ps_strategy *ps = st->ps;
    bool slots = (m->h.flags & LOOM_PS_F_SLOTS) && ps->n_slots > 0 && !pushed;
    loom_buf b;
    loom_buf_init(&b);
    loom_ps_hdr h = {.req = m->h.req, .nonce = ps->nonce, .step = st->step,
                     .flags = (slots ? LOOM_PS_F_SLOTS : 0) | (pushed ? LOOM_PS_F_ACCEPTED : 0),
                     .n_ranges = (uint32_t)m->n};
    loom_ps_put_hdr_(&b, &h);
    for (int i = 0; i < m->n; i++) {
        const loom_ps_range *r = &m->r[i];
        const loom_ps_shard *sh = &ps->plan.shard[r->shard];
        uint32_t *rows = NULL;
        if (r->n_rows != LOOM_PS_WHOLE) {
            rows = loom_alloc((size_t)(r->n_rows ? r->n_rows : 1) * sizeof *rows);
            if (!rows) {
                loom_buf_fini(&b);
                return loom_err_set(err, LOOM_ENOMEM, NULL, "answering a pull");
            }
            for (uint32_t j = 0; j < r->n_rows; j++) rows[j] = loom_ps_row_(r, j);
        }
        loom_ps_put_range_(&b, r->shard, r->n_rows, rows);
        for (int k = 0; k < 1 + (slots ? ps->n_slots : 0); k++) {
            const float *src = k == 0 ? st->params : st->slots + (size_t)(k - 1) * (size_t)st->L;
            if (!rows)
                loom_buf_put(&b, src + sh->local, (size_t)sh->count * sizeof(float));
            else
                for (uint32_t j = 0; j < r->n_rows; j++)
                    loom_buf_put(&b, src + sh->local + (int64_t)rows[j] * sh->row_size,
                                 (size_t)sh->row_size * sizeof(float));
        }
        loom_free(rows);
    }
    int rc = b.failed ? loom_err_set(err, LOOM_ENOMEM, NULL, "answering a pull")
                      : loom_net_send(ps->net, from, LOOM_PS_MSG_VALUES, b.data, b.len, err);
    loom_buf_fini(&b);
    return rc;
}

static int flush_pulls(ps_state *st, loom_err *err)
{
    int keep = 0, rc = LOOM_OK;
    for (int i = 0; i < st->n_pend; i++) {
        pending_pull *pp = &st->pend[i];
        if (!rc && pp->min_step <= st->step) {
            loom_ps_msg m;
            rc = loom_ps_decode_(pp->msg.data, pp->msg.len, &st->ps->plan, st->q, st->ps->n_slots, false, &m, err);
            if (!rc) rc = answer_pull(st, pp->from, &m, false, err);
            loom_ps_msg_fini_(&m);
            loom_buf_fini(&pp->msg);
        } else {
            st->pend[keep++] = *pp;
        }
    }
    st->n_pend = keep;
    return rc;
}

/* Gradients of a push (m) into buf at the local layout (rows: only theirs),
 * added when add, else copied. */
static void take_grads(ps_state *st, const loom_ps_msg *m, float *buf, bool add)
{
    for (int i = 0; i < m->n; i++) {
        const loom_ps_range *r = &m->r[i];
        const loom_ps_shard *sh = &st->ps->plan.shard[r->shard];
        int64_t nrows = r->n_rows == LOOM_PS_WHOLE ? sh->rows : r->n_rows;
        for (int64_t j = 0; j < nrows; j++) {
            int64_t row = r->n_rows == LOOM_PS_WHOLE ? j : (int64_t)loom_ps_row_(r, (uint32_t)j);
            float *dst = buf + sh->local + row * sh->row_size;
            const uint8_t *src = r->vals + (size_t)j * (size_t)sh->row_size * sizeof(float);
            for (int64_t k = 0; k < sh->row_size; k++) {
                float v;
                memcpy(&v, src + (size_t)k * sizeof(float), sizeof v);
                dst[k] = add ? dst[k] + v : v;
            }
        }
    }
}

/* The update of shard i (its rows ids[0..n), or ids NULL: all of it) from
 * st->grads. A table's shard is updated as one machine updates the table
 * (loom_optimizer_set_tables): lazily, only the elements with a gradient,
 * so moving the table whole or by rows gives the same bits. */
static void apply_shard(ps_state *st, int i, const int64_t *ids, int64_t n)
{
    const loom_ps_shard *sh = &st->ps->plan.shard[i];
    if (st->ps->is_table[i]) {
        if (!ids) ids = st->iota, n = sh->rows;
        loom_optimizer_apply_rows(st->opt, st->params, st->grads, st->step, sh->local, sh->row_size, ids, n, NULL);
    } else if (!ids) {
        loom_optimizer_apply_range(st->opt, NULL, st->params, st->grads, st->step, sh->local, sh->local + sh->count);
    } else {
        for (int64_t j = 0; j < n; j++) {
            int64_t lo = sh->local + ids[j] * sh->row_size;
            loom_optimizer_apply_range(st->opt, NULL, st->params, st->grads, st->step, lo, lo + sh->row_size);
        }
    }
}

/* A range's row ids as the optimizer takes them (st->ids); NULL: whole. */
static const int64_t *range_ids(ps_state *st, const loom_ps_range *r)
{
    if (r->n_rows == LOOM_PS_WHOLE) return NULL;
    for (uint32_t j = 0; j < r->n_rows; j++) st->ids[j] = loom_ps_row_(r, j);
    return st->ids;
}

/* Synchronous: the push m added into acc; note what it touched. */
static void note_acc(ps_state *st, const loom_ps_msg *m)
{
    for (int i = 0; i < m->n; i++) {
        const loom_ps_range *r = &m->r[i];
        int s = (int)r->shard;
        if (r->n_rows == LOOM_PS_WHOLE || !st->acc_mark[s]) {
            st->acc_whole[s] = true;
            continue;
        }
        for (uint32_t j = 0; j < r->n_rows; j++) {
            uint32_t row = loom_ps_row_(r, j);
            if (st->acc_mark[s][row]) continue;
            st->acc_mark[s][row] = 1;
            st->acc_rows[s][st->acc_nrows[s]++] = row;
        }
    }
}

/* Synchronous: the mean of the step's accepted gradients (acc / acc_n)
 * applied where they touched (a dense shard whole, as ever; a table's
 * shard by its rows, summed by id over the pushes), and acc zeroed there. */
static void apply_acc(ps_state *st)
{
    const ps_strategy *ps = st->ps;
    float k = 1.0f / (float)st->acc_n;
    for (int i = 0; i < ps->plan.n_shards; i++) {
        const loom_ps_shard *sh = &ps->plan.shard[i];
        if (sh->ps != st->q) continue;
        if (st->acc_whole[i] || !ps->is_table[i]) {
            for (int64_t e = sh->local; e < sh->local + sh->count; e++) st->grads[e] = st->acc[e] * k;
            apply_shard(st, i, NULL, 0);
            memset(st->acc + sh->local, 0, (size_t)sh->count * sizeof(float));
        } else if (st->acc_nrows[i]) {
            for (int64_t j = 0; j < st->acc_nrows[i]; j++) {
                int64_t lo = sh->local + st->acc_rows[i][j] * sh->row_size;
                for (int64_t e = lo; e < lo + sh->row_size; e++) st->grads[e] = st->acc[e] * k;
            }
            apply_shard(st, i, st->acc_rows[i], st->acc_nrows[i]);
            for (int64_t j = 0; j < st->acc_nrows[i]; j++) {
                int64_t lo = sh->local + st->acc_rows[i][j] * sh->row_size;
                memset(st->acc + lo, 0, (size_t)sh->row_size * sizeof(float));
            }
        }
        if (st->acc_mark[i])
            for (int64_t j = 0; j < st->acc_nrows[i]; j++) st->acc_mark[i][st->acc_rows[i][j]] = 0;
        st->acc_nrows[i] = 0;
        st->acc_whole[i] = false;
    }
}

static int handle_push(ps_state *st, int from, const loom_buf *msg, loom_err *err)
{
    ps_strategy *ps = st->ps;
    char who[32];
    peer_name(ps, from, who, sizeof who);
    if (ps->peer_role[from] != LOOM_ROLE_WORKER)
        return refuse(st, from, "a gradient push from %s, which is not a worker of this job: only workers push", who);
    if (!st->inited) return refuse(st, from, "a gradient push before the coordinator sent the variables");
    loom_ps_msg m;
    loom_err e;
    if (loom_ps_decode_(msg->data, msg->len, &ps->plan, st->q, ps->n_slots, true, &m, &e))
        return refuse(st, from, "a gradient push that does not decode: %s", e.msg);
    if (test_die_now(ps->task, ++st->pushes)) _exit(137);
    if (m.h.nonce != ps->nonce) {
        loom_ps_msg_fini_(&m);
        return refuse(st, from, "a gradient push for another run of the job (nonce %016llx, this run's is %016llx)",
                      (unsigned long long)m.h.nonce, (unsigned long long)ps->nonce);
    }
    bool accepted = true;
    if (!ps->sync) {
        take_grads(st, &m, st->grads, false);
        for (int i = 0; i < m.n; i++) {
            const loom_ps_range *r = &m.r[i];
            apply_shard(st, (int)r->shard, range_ids(st, r), r->n_rows == LOOM_PS_WHOLE ? 0 : r->n_rows);
        }
        st->step++;
        if (m.h.flags & LOOM_PS_F_PULL) { /* the new values back at once: one round trip a step */
            int rc = answer_pull(st, from, &m, true, err);
            loom_ps_msg_fini_(&m);
            return rc == LOOM_ENET ? LOOM_OK : rc;
        }
    } else if (m.h.step < st->step) { /* a gradient for a step already applied: stale */
        accepted = false;
        st->stale++;
        loom_debug("%s: dropped a stale gradient from %s for step %lld (now at step %lld; %lld dropped so far)",
                   ps->task, who, (long long)m.h.step + 1, (long long)st->step + 1, (long long)st->stale);
    } else if (m.h.step > st->step) {
        loom_ps_msg_fini_(&m);
        return refuse(st, from, "a gradient for step %lld, but this ps is at step %lld", (long long)m.h.step + 1,
                      (long long)st->step + 1);
    } else {
        take_grads(st, &m, st->acc, true);
        note_acc(st, &m);
        if (++st->acc_n >= ps->sync_n) { /* the mean of the first N, applied */
            apply_acc(st);
            st->step++;
            st->acc_n = 0;
        }
    }
    loom_ps_msg_fini_(&m);
    loom_buf b;
    loom_buf_init(&b);
    loom_ps_hdr h = {.req = m.h.req, .nonce = ps->nonce, .step = st->step, .flags = accepted ? LOOM_PS_F_ACCEPTED : 0};
    loom_ps_put_hdr_(&b, &h);
    int rc = b.failed ? loom_err_set(err, LOOM_ENOMEM, NULL, "answering a push")
                      : loom_net_send(ps->net, from, LOOM_PS_MSG_PUSHED, b.data, b.len, err);
    loom_buf_fini(&b);
    if (!rc && ps->sync) rc = flush_pulls(st, err);
    return rc == LOOM_ENET ? LOOM_OK : rc; /* the worker may be gone: its loss comes as news */
}

/* No gradient in acc (a new run of the job: a step's pushes start over). */
static void acc_reset(ps_state *st)
{
    if (st->acc) memset(st->acc, 0, (size_t)(st->L ? st->L : 1) * sizeof(float)); /* (synchronous only) */
    for (int i = 0; i < st->ps->plan.n_shards; i++) {
        if (st->acc_mark[i]) memset(st->acc_mark[i], 0, (size_t)st->ps->plan.shard[i].rows);
        st->acc_nrows[i] = 0;
        st->acc_whole[i] = false;
    }
}

static int handle_init(ps_state *st, int from, const loom_buf *msg, loom_err *err)
{
    ps_strategy *ps = st->ps;
    char who[32];
    if (ps->peer_role[from] != LOOM_ROLE_CHIEF)
        return refuse(st, from, "variables from %s: only the coordinator (chief) initialises a ps",
                      peer_name(ps, from, who, sizeof who));
    loom_ps_msg m;
    int rc = loom_ps_decode_(msg->data, msg->len, &ps->plan, st->q, ps->n_slots, true, &m, err);
    if (rc) return loom_err_hint(err, "the coordinator's INIT message did not decode");
    for (int i = 0; i < m.n; i++) {
        const loom_ps_range *r = &m.r[i];
        const loom_ps_shard *sh = &ps->plan.shard[r->shard];
        int blocks = 1 + ((m.h.flags & LOOM_PS_F_SLOTS) ? ps->n_slots : 0);
        for (int k = 0; k < blocks && r->n_rows == LOOM_PS_WHOLE; k++) {
            float *dst = k == 0 ? st->params : st->slots + (size_t)(k - 1) * (size_t)st->L;
            memcpy(dst + sh->local, r->vals + (size_t)k * (size_t)r->n_vals * sizeof(float),
                   (size_t)sh->count * sizeof(float));
        }
    }
    st->step = m.h.step;
    ps->nonce = m.h.nonce;
    st->acc_n = 0;
    acc_reset(st);
    st->inited = true;
    loom_ps_hdr h = {.req = m.h.req, .nonce = ps->nonce, .step = st->step};
    loom_ps_msg_fini_(&m);
    loom_buf b;
    loom_buf_init(&b);
    loom_ps_put_hdr_(&b, &h);
    loom_buf_put_u64(&b, (uint64_t)st->alloc_bytes); /* what this ps holds, for the coordinator's log */
    loom_buf_put_u64(&b, (uint64_t)st->rss_ready);
    loom_buf_put_u64(&b, (uint64_t)resident("VmHWM"));
    rc = loom_net_send(ps->net, from, LOOM_PS_MSG_INIT_OK, b.data, b.len, err);
    loom_buf_fini(&b);
    return rc ? rc : flush_pulls(st, err);
}

/* SAVE: every shard this ps holds, with its slots, into its file of the
 * checkpoint (ps_internal.h), then SAVED with the file's size and CRC. */
static int handle_save(ps_state *st, int from, const loom_buf *msg, loom_err *err)
{
    ps_strategy *ps = st->ps;
    char who[32], dir[LOOM_PATH_MAX];
    peer_name(ps, from, who, sizeof who);
    if (ps->peer_role[from] != LOOM_ROLE_CHIEF)
        return refuse(st, from, "a checkpoint request from %s: only the coordinator (chief) saves", who);
    if (!st->inited) return refuse(st, from, "a checkpoint request before the coordinator sent the variables");
    loom_ps_hdr h;
    loom_err e;
    if (loom_ps_decode_save_(msg->data, msg->len, &h, dir, sizeof dir, &e))
        return refuse(st, from, "a checkpoint request that does not decode: %s", e.msg);
    if (h.nonce != ps->nonce)
        return refuse(st, from, "a checkpoint request of another run of the job (nonce %016llx, this run's is %016llx)",
                      (unsigned long long)h.nonce, (unsigned long long)ps->nonce);
    LOOM_ASSERT(ps->write_ckpt);
    if (test_save_die_now(ps->task, "before", h.step)) _exit(137);
    int per = 1 + ps->n_slots, n = 0;
    for (int i = 0; i < ps->plan.n_shards; i++) n += (ps->plan.shard[i].ps == st->q) * per;
    loom_ckpt_tensor *t = loom_calloc((size_t)(n ? n : 1), sizeof *t);
    char (*names)[160] = loom_calloc((size_t)(n ? n : 1), sizeof *names);
    if (!t || !names) {
        loom_free(t);
        loom_free(names);
        return loom_err_set(err, LOOM_ENOMEM, ps->task, "listing the %d tensors of a checkpoint", n);
    }
    int k = 0;
    for (int i = 0; i < ps->plan.n_shards; i++) {
        const loom_ps_shard *sh = &ps->plan.shard[i];
        if (sh->ps != st->q) continue;
        loom_shape shape = ps->pi[sh->var].shape;
        if (shape.rank) shape.dim[0] = sh->rows;
        char rec[128];
        loom_ps_record_name_(&ps->plan, ps->pi, i, rec, sizeof rec);
        for (int b = 0; b < per; b++, k++) {
            if (b == 0) snprintf(names[k], sizeof names[k], "%s", rec);
            else snprintf(names[k], sizeof names[k], "%s/%s", rec, loom_optimizer_slot_name(st->opt, b - 1));
            t[k] = (loom_ckpt_tensor){.name = names[k], .shape = shape,
                                      .data = (b == 0 ? st->params : st->slots + (size_t)(b - 1) * (size_t)st->L) + sh->local};
        }
    }
    char name[128], path[LOOM_PATH_MAX + 160];
    snprintf(name, sizeof name, "ckpt-%lld.data-%05d-of-%05d", (long long)h.step, st->q, ps->n_ps);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    loom_ckpt_shard_meta meta = {.step = h.step, .ps = st->q, .n_ps = ps->n_ps, .plan_id = ps->plan_id};
    uint64_t size = 0;
    uint32_t crc = 0;
    int rc = ps->write_ckpt(path, &meta, t, n, &size, &crc, &e);
    loom_free(t);
    loom_free(names);
    if (rc) return refuse(st, from, "cannot write its shard of the checkpoint of step %lld: %s: %s", (long long)h.step,
                          e.where, e.msg);
    if (test_save_die_now(ps->task, "after", h.step)) _exit(137);
    loom_buf b;
    loom_buf_init(&b);
    loom_ps_hdr out = {.req = h.req, .nonce = ps->nonce, .step = h.step};
    loom_ps_put_saved_(&b, &out, size, crc, name);
    rc = b.failed ? loom_err_set(err, LOOM_ENOMEM, NULL, "answering a checkpoint request")
                  : loom_net_send(ps->net, from, LOOM_PS_MSG_SAVED, b.data, b.len, err);
    loom_buf_fini(&b);
    return rc;
}

static void ps_state_fini(ps_state *st)
{
    for (int i = 0; i < st->ps->plan.n_shards; i++) {
        if (st->acc_rows) loom_free(st->acc_rows[i]);
        if (st->acc_mark) loom_free(st->acc_mark[i]);
    }
    loom_free(st->acc_rows);
    loom_free(st->acc_mark);
    loom_free(st->acc_nrows);
    loom_free(st->acc_whole);
    loom_free(st->ids);
    loom_free(st->iota);
    loom_free(st->params);
    loom_free(st->grads);
    loom_free(st->acc);
    loom_optimizer_free(st->opt);
    for (int i = 0; i < st->n_pend; i++) loom_buf_fini(&st->pend[i].msg);
    loom_free(st->pend);
}

/* The row lists of a ps: ids and iota as long as its longest shard (a
 * table's), and (sync) the rows each table shard's acc holds. */
static int ps_rows_alloc(ps_state *st, loom_err *err)
{
    const ps_strategy *ps = st->ps;
    int n = ps->plan.n_shards ? ps->plan.n_shards : 1;
    int64_t most = 1;
    for (int i = 0; i < ps->plan.n_shards; i++)
        if (ps->plan.shard[i].ps == st->q && ps->plan.shard[i].rows > most) most = ps->plan.shard[i].rows;
    st->ids = loom_alloc((size_t)most * sizeof *st->ids);
    st->iota = loom_alloc((size_t)most * sizeof *st->iota);
    st->acc_whole = loom_calloc((size_t)n, sizeof *st->acc_whole);
    st->acc_nrows = loom_calloc((size_t)n, sizeof *st->acc_nrows);
    st->acc_rows = loom_calloc((size_t)n, sizeof *st->acc_rows);
    st->acc_mark = loom_calloc((size_t)n, sizeof *st->acc_mark);
    if (!st->ids || !st->iota || !st->acc_whole || !st->acc_nrows || !st->acc_rows || !st->acc_mark)
        return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating the row lists of %s", ps->task);
    for (int64_t j = 0; j < most; j++) st->iota[j] = j;
    for (int i = 0; i < ps->plan.n_shards && ps->sync; i++) {
        const loom_ps_shard *sh = &ps->plan.shard[i];
        if (sh->ps != st->q || !ps->is_table[i]) continue;
        st->acc_rows[i] = loom_alloc((size_t)(sh->rows ? sh->rows : 1) * sizeof **st->acc_rows);
        st->acc_mark[i] = loom_calloc((size_t)(sh->rows ? sh->rows : 1), 1);
        if (!st->acc_rows[i] || !st->acc_mark[i])
            return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating the row lists of %s", ps->task);
    }
    return LOOM_OK;
}

static int ps_serve_loop(ps_strategy *ps, const loom_spec *spec, loom_err *err)
{
    ps_state st = {.ps = ps, .q = ps->index};
    st.L = ps->plan.ps_floats[st.q];
    size_t L = (size_t)(st.L ? st.L : 1);
    st.params = loom_alloc_aligned(L * sizeof(float));
    st.grads = loom_alloc_aligned(L * sizeof(float));
    st.acc = ps->sync ? loom_alloc_aligned(L * sizeof(float)) : NULL; /* the sum of a synchronous step's gradients */
    loom_optimizer_spec os = spec->optimizer;
    os.clip_norm = 0; /* the workers clip their gradients (clip_grads): no ps sees them all */
    int rc = loom_optimizer_new(&st.opt, &os, st.L ? st.L : 1, err);
    if (!rc && (!st.params || !st.grads || (ps->sync && !st.acc)))
        rc = loom_err_set(err, LOOM_ENOMEM, NULL, "allocating %lld floats of variables on %s", (long long)st.L, ps->task);
    if (rc) {
        ps_state_fini(&st);
        return rc;
    }
    if ((rc = ps_rows_alloc(&st, err))) {
        ps_state_fini(&st);
        return rc;
    }
    memset(st.params, 0, L * sizeof(float));
    memset(st.grads, 0, L * sizeof(float));
    acc_reset(&st);
    st.slots = ps->n_slots ? loom_optimizer_slots(st.opt) : NULL;
    st.alloc_bytes = (int64_t)L * (int64_t)sizeof(float) * (2 + ps->sync + ps->n_slots);
    st.rss_ready = resident("VmRSS");
    loom_buf msg;
    loom_buf_init(&msg);
    for (;;) {
        int from;
        uint32_t type;
        rc = recv_or_stop(ps, -1, LOOM_MSG_PEER_DOWN, LOOM_PS_MSG_LAST, &from, &type, &msg, err);
        if (rc) break;
        char who[32];
        peer_name(ps, from, who, sizeof who);
        if (type == LOOM_MSG_PEER_DOWN) {
            loom_info("%s: lost %s; its pulls are dropped, it may come back", ps->task, who);
            int keep = 0;
            for (int i = 0; i < st.n_pend; i++)
                if (st.pend[i].from == from) loom_buf_fini(&st.pend[i].msg);
                else st.pend[keep++] = st.pend[i];
            st.n_pend = keep;
            continue;
        }
        if (type == LOOM_MSG_PEER_UP) {
            loom_info("%s: %s is back", ps->task, who);
            continue;
        }
        if (type == LOOM_PS_MSG_END) {
            if (ps->peer_role[from] == LOOM_ROLE_CHIEF) break;
            refuse(&st, from, "END from %s: only the coordinator ends the job", who);
            continue;
        }
        if (type == LOOM_PS_MSG_INIT) {
            if ((rc = handle_init(&st, from, &msg, err))) break;
        } else if (type == LOOM_PS_MSG_PUSH) {
            if ((rc = handle_push(&st, from, &msg, err))) break;
        } else if (type == LOOM_PS_MSG_SAVE) {
            if ((rc = handle_save(&st, from, &msg, err))) break;
        } else if (type == LOOM_PS_MSG_PULL) {
            loom_ps_msg m;
            loom_err e;
            if (loom_ps_decode_(msg.data, msg.len, &ps->plan, st.q, ps->n_slots, false, &m, &e)) {
                refuse(&st, from, "a pull that does not decode: %s", e.msg);
                continue;
            }
            if (!st.inited || m.h.step > st.step) { /* wait for the variables, or for the step's update */
                loom_ps_msg_fini_(&m);
                if (st.n_pend == st.cap_pend) {
                    int nc = st.cap_pend ? 2 * st.cap_pend : 8;
                    pending_pull *np = loom_realloc(st.pend, (size_t)nc * sizeof *np);
                    if (!np) {
                        rc = loom_err_set(err, LOOM_ENOMEM, NULL, "queueing a pull");
                        break;
                    }
                    st.pend = np, st.cap_pend = nc;
                }
                pending_pull *pp = &st.pend[st.n_pend++];
                pp->from = from;
                pp->min_step = m.h.step;
                pp->msg = msg;
                loom_buf_init(&msg); /* handed over */
                continue;
            }
            rc = answer_pull(&st, from, &m, false, err);
            loom_ps_msg_fini_(&m);
            if (rc == LOOM_ENET) rc = LOOM_OK; /* the puller is gone */
            if (rc) break;
        } else {
            refuse(&st, from, "an unexpected message of type %u", type);
        }
    }
    if (st.refused) /* (stale gradients are a synchronous job's routine: the coordinator reports them) */
        loom_warn("%s: %lld message%s refused (see above), %lld stale gradient%s dropped", ps->task,
                  (long long)st.refused, st.refused == 1 ? "" : "s", (long long)st.stale, st.stale == 1 ? "" : "s");
    loom_buf_fini(&msg);
    ps_state_fini(&st);
    return rc;
}

/* ---- the chief (coordinator) -------------------------------------------------- */

/* Where the trainer next needs the variables at rest, after `step`. */
static int64_t horizon(const ps_strategy *ps, const loom_strategy_args *a, int64_t step)
{
    const loom_run_spec *rs = &a->spec->run;
    int64_t h = INT64_MAX;
    if (rs->max_steps > 0) h = rs->max_steps;
    if (rs->checkpoint_steps > 0) {
        int64_t c = (step / rs->checkpoint_steps + 1) * rs->checkpoint_steps;
        if (c < h) h = c;
    }
    if (a->steps_per_epoch > 0) {
        int64_t e = (step / a->steps_per_epoch + 1) * a->steps_per_epoch;
        if (e < h) h = e;
    }
    (void)ps;
    return h;
}

static int init_ps_tasks(ps_strategy *ps, int64_t step, loom_err *err)
{
    loom_buf b;
    loom_buf_init(&b);
    int rc = LOOM_OK;
    uint64_t req = ++ps->req;
    const float *slots = ps->n_slots ? loom_optimizer_slots(ps->opt) : NULL;
    for (int q = 0; q < ps->n_ps && !rc; q++) {
        b.len = 0;
        loom_ps_hdr h = {.req = req, .nonce = ps->nonce, .step = step, .flags = slots ? LOOM_PS_F_SLOTS : 0};
        if (put_shards(&b, ps, q, &h, loom_model_params(ps->model), slots))
            rc = loom_err_set(err, LOOM_ENOMEM, NULL, "building the variables of ps:%d", q);
        else
            rc = loom_net_send(ps->net, ps->peer_ps[q], LOOM_PS_MSG_INIT, b.data, b.len, err);
    }
    for (int q = 0; q < ps->n_ps && !rc; q++) {
        int from;
        uint32_t type;
        do /* a late answer to an abandoned pull or push is skipped: the INIT_OK (or a refusal) is this q's */
            rc = loom_net_recv(ps->net, ps->peer_ps[q], LOOM_PS_MSG_INIT_OK, LOOM_PS_MSG_REFUSED, &from, &type, &b, -1, err);
        while (!rc && type != LOOM_PS_MSG_INIT_OK && type != LOOM_PS_MSG_REFUSED);
        if (!rc && type == LOOM_PS_MSG_REFUSED) rc = refused(ps, from, &b, err);
        if (!rc && type == LOOM_PS_MSG_INIT_OK && b.len >= LOOM_PS_HDR + 24) { /* what the ps holds, and its memory */
            loom_buf r = b;
            r.pos = LOOM_PS_HDR;
            r.failed = 0;
            uint64_t alloc = loom_buf_get_u64(&r), ready = loom_buf_get_u64(&r), hwm = loom_buf_get_u64(&r);
            const double MiB = 1048576.0;
            loom_info("ps:%d holds %lld of the model's %lld floats: %.1f MiB allocated for them (variables, gradients, "
                      "%s%d slot%s); resident %.1f MiB when it was ready to serve, %.1f MiB at most so far (the "
                      "whole model's variables alone are %.1f MiB)", q, (long long)ps->plan.ps_floats[q],
                      (long long)ps->P, (double)alloc / MiB, ps->sync ? "sums, " : "", ps->n_slots,
                      ps->n_slots == 1 ? "" : "s", (double)ready / MiB, (double)hwm / MiB,
                      (double)ps->P * sizeof(float) / MiB);
        }
    }
    if (!rc && getenv("LOOM_TEST_PS_FORGE_PUSH")) { /* tests: a push from a task that is no worker is refused */
        b.len = 0;
        loom_ps_hdr h = {.req = ++ps->req, .nonce = ps->nonce, .step = step};
        if (!put_shards(&b, ps, 0, &h, loom_model_grads(ps->model), NULL))
            rc = loom_net_send(ps->net, ps->peer_ps[0], LOOM_PS_MSG_PUSH, b.data, b.len, err);
        loom_warn("LOOM_TEST_PS_FORGE_PUSH: the coordinator pushed gradients to ps:0 itself");
    }
    loom_buf_fini(&b);
    if (!rc) {
        ps->need_init = false;
        ps->ps_step = step;
    }
    if (!rc && ps->restored) { /* a restore: read it back, every bit must be the checkpoint's */
        ps->restored = false;
        size_t nb = (size_t)ps->P * sizeof(float) * (size_t)(1 + ps->n_slots);
        float *back = loom_alloc_aligned(nb ? nb : 1), *want = loom_alloc_aligned(nb ? nb : 1);
        if (!back || !want) rc = loom_err_set(err, LOOM_ENOMEM, NULL, "checking the restored variables");
        int64_t got = 0;
        if (!rc) {
            memcpy(want, loom_model_params(ps->model), (size_t)ps->P * sizeof(float));
            if (ps->n_slots)
                memcpy(want + ps->P, loom_optimizer_slots(ps->opt), (size_t)ps->P * ps->n_slots * sizeof(float));
            rc = pull_all(ps, back, ps->n_slots ? back + ps->P : NULL, 0, &got, err);
        }
        if (!rc && (memcmp(back, want, nb) || got != step))
            rc = loom_err_set(err, LOOM_ECHECKPOINT, ps->task, "the ps tasks do not hold the restored checkpoint's "
                              "variables (step %lld, they report %lld)", (long long)step, (long long)got);
        if (!rc)
            loom_info("the %d ps task%s hold the checkpoint's %lld variables and %d slot%s exactly, at step %lld",
                      ps->n_ps, ps->n_ps == 1 ? "" : "s", (long long)ps->P, ps->n_slots, ps->n_slots == 1 ? "" : "s",
                      (long long)step);
        loom_free(back);
        loom_free(want);
    }
    return rc;
}

static int alive_workers(const ps_strategy *ps)
{
    int n = 0;
    for (int w = 0; w < ps->n_workers; w++) n += ps->alive[w];
    return n;
}

static int running_fns(const ps_strategy *ps)
{
    int n = 0;
    for (int i = 0; i < ps->n_fns; i++) n += ps->fns[i].worker != -1;
    return n;
}

static int add_ready(ps_strategy *ps, const loom_ps_step_out *o)
{
    if (ps->ready_head > 0 && ps->ready_head == ps->n_ready) ps->ready_head = ps->n_ready = 0;
    if (ps->n_ready == ps->cap_ready) {
        int64_t nc = ps->cap_ready ? 2 * ps->cap_ready : 64;
        loom_ps_step_out *nr = loom_realloc(ps->ready, (size_t)nc * sizeof *nr);
        if (!nr) return LOOM_ENOMEM;
        ps->ready = nr, ps->cap_ready = nc;
    }
    ps->ready[ps->n_ready++] = *o;
    return LOOM_OK;
}

static int find_fn(const ps_strategy *ps, uint64_t fn)
{
    for (int i = 0; i < ps->n_fns; i++)
        if (ps->fns[i].fn == fn) return i;
    return -1;
}

static void drop_fn(ps_strategy *ps, int i)
{
    ps->fns[i] = ps->fns[--ps->n_fns];
}

static int send_run(ps_strategy *ps, int w, const fn_slot *f, loom_err *err)
{
    loom_ps_run r = {.fn = f->fn, .nonce = ps->nonce, .first = f->first, .steps = f->steps};
    loom_buf b;
    loom_buf_init(&b);
    loom_ps_put_run_(&b, &r);
    int rc = b.failed ? loom_err_set(err, LOOM_ENOMEM, NULL, "building a step function")
                      : loom_net_send(ps->net, ps->peer_worker[w], LOOM_PS_MSG_RUN, b.data, b.len, err);
    loom_buf_fini(&b);
    return rc;
}

/* Queues step functions up to the horizon, and gives queued ones to free workers. */
static int schedule(ps_strategy *ps, int64_t step, loom_err *err)
{
    int64_t h = horizon(ps, ps->args, step);
    if (ps->dispatched < step) ps->dispatched = step;
    int want = ps->sync ? 1 : alive_workers(ps);
    while (ps->dispatched < h && ps->n_fns < (want > 0 ? want : 1)) {
        if (ps->n_fns == ps->cap_fns) {
            int nc = ps->cap_fns ? 2 * ps->cap_fns : 8;
            fn_slot *nf = loom_realloc(ps->fns, (size_t)nc * sizeof *nf);
            if (!nf) return loom_err_set(err, LOOM_ENOMEM, NULL, "queueing a step function");
            ps->fns = nf, ps->cap_fns = nc;
        }
        int64_t n = h - ps->dispatched < ps->K ? h - ps->dispatched : ps->K;
        ps->fns[ps->n_fns++] = (fn_slot){.fn = ++ps->next_fn, .first = ps->dispatched, .steps = (uint32_t)n, .worker = -1};
        ps->dispatched += n;
    }
    for (int i = 0; i < ps->n_fns; i++) {
        fn_slot *f = &ps->fns[i];
        if (f->worker != -1) continue;
        if (ps->sync) { /* every worker takes part in every step */
            for (int w = 0; w < ps->n_workers; w++) {
                if (!ps->alive[w]) continue;
                loom_err e;
                if (send_run(ps, w, f, &e) == LOOM_OK) ps->busy[w] = true;
            }
            f->worker = -2; /* all */
            continue;
        }
        for (int w = 0; w < ps->n_workers; w++) {
            if (!ps->alive[w] || ps->busy[w]) continue;
            loom_err e;
            if (send_run(ps, w, f, &e)) { /* lost in between: its news comes */
                continue;
            }
            ps->busy[w] = true;
            f->worker = w;
            break;
        }
    }
    return LOOM_OK;
}

static int worker_of_peer(const ps_strategy *ps, int p)
{
    for (int w = 0; w < ps->n_workers; w++)
        if (ps->peer_worker[w] == p) return w;
    return -1;
}

/* News: worker w (who) was lost; the step functions it ran go back in the queue. */
static void news_down(ps_strategy *ps, int w, const char *who)
{
    ps->alive[w] = false;
    ps->busy[w] = false;
    for (int i = 0; i < ps->n_fns; i++)
        if (ps->fns[i].worker == w) {
            ps->fns[i].worker = -1;
            ps->requeued++;
            loom_warn("lost %s in the middle of step function %llu (steps %lld to %lld): put back in the queue for "
                      "another worker", who, (unsigned long long)ps->fns[i].fn, (long long)ps->fns[i].first + 1,
                      (long long)(ps->fns[i].first + ps->fns[i].steps));
        }
    if (ps->sync && alive_workers(ps) < ps->sync_n)
        loom_warn("only %d worker%s left, replicas_to_aggregate = %d: the job waits for a worker to come back",
                  alive_workers(ps), alive_workers(ps) == 1 ? "" : "s", ps->sync_n);
}

/* News: worker w (who) came back. */
static void news_up(ps_strategy *ps, int w, const char *who)
{
    ps->alive[w] = true;
    ps->busy[w] = false;
    loom_info("%s rejoined: it rebuilt its input pipeline and takes step functions again", who);
}

/* News: worker w's result of a step function (msg): its steps' sums become
 * ready, in order; a late report of a finished synchronous step adds its
 * accepted gradients' sums to the pool the next step reports. */
static int news_result(ps_strategy *ps, int w, const char *who, const loom_buf *msg, loom_err *err)
{
    uint64_t fn;
    loom_ps_step_out *out;
    uint32_t n;
    loom_ps_traffic tr;
    int rc = loom_ps_decode_result_(msg->data, msg->len, &fn, &out, &n, &tr, err);
    if (rc) return loom_err_hint(err, "a step result from %s did not decode", who);
    ps->moved_bytes += (int64_t)tr.bytes;
    ps->moved_rows += (int64_t)tr.rows;
    ps->moved_steps += n;
    int i = find_fn(ps, fn);
    if (!ps->sync) ps->busy[w] = false;
    else if (ps->fns && i < 0) ps->busy[w] = false;
    for (uint32_t k = 0; k < n; k++)
        if (!out[k].accepted && ++ps->stale <= 3) /* the first few named; all counted, in the end line */
            loom_info("the gradient %s computed for step %lld was stale: dropped%s", who,
                      (long long)out[k].step + 1, ps->stale == 3 ? " (further ones are counted, not logged)" : "");
    if (i >= 0) {
        fn_slot f = ps->fns[i];
        drop_fn(ps, i);
        if (ps->sync) ps->busy[w] = false;
        for (uint32_t k = 0; k < f.steps && !rc; k++) {
            loom_ps_step_out o = {.step = f.first + k, .accepted = 1};
            for (uint32_t j = 0; j < n; j++)
                if (out[j].step == o.step && out[j].accepted) {
                    o.loss_sum += out[j].loss_sum;
                    o.correct += out[j].correct;
                    o.examples += out[j].examples;
                }
            if (!ps->sync) o = out[k < n ? k : 0], o.step = f.first + k;
            if (k == 0 && ps->pool.examples) {
                o.loss_sum += ps->pool.loss_sum;
                o.correct += ps->pool.correct;
                o.examples += ps->pool.examples;
                memset(&ps->pool, 0, sizeof ps->pool);
            }
            if (add_ready(ps, &o)) rc = loom_err_set(err, LOOM_ENOMEM, NULL, "keeping step results");
        }
    } else if (ps->sync) { /* a late report of a finished step: its accepted gradients count */
        ps->busy[w] = false;
        for (uint32_t j = 0; j < n; j++)
            if (out[j].accepted) {
                ps->pool.loss_sum += out[j].loss_sum;
                ps->pool.correct += out[j].correct;
                ps->pool.examples += out[j].examples;
            }
    }
    loom_free(out);
    return rc;
}

/* News: a task refused a message of the coordinator (msg: why). */
static void news_refused(const char *who, const loom_buf *msg)
{
    char text[400];
    size_t l = msg->len < sizeof text - 1 ? msg->len : sizeof text - 1;
    memcpy(text, msg->data, l);
    text[l] = 0;
    loom_warn("%s refused a message of the coordinator: %s", who, text);
}

/* Waits (wait_s; < 0: as long as workers may still come back) for one
 * piece of news from the workers (a loss, a return, a result, a refusal)
 * and acts on it. */
static int pump_for(ps_strategy *ps, double wait_s, loom_err *err)
{
    loom_buf msg;
    loom_buf_init(&msg);
    int from;
    uint32_t type;
    int alive = alive_workers(ps);
    bool starved = alive == 0 || (ps->sync && alive < ps->sync_n); /* no step can complete until one is back */
    int rc = loom_net_recv(ps->net, -1, LOOM_MSG_PEER_DOWN, LOOM_PS_MSG_LAST, &from, &type, &msg,
                           wait_s >= 0 ? wait_s : starved ? ps->wait_s : -1, err);
    if (rc == LOOM_ETIMEOUT && wait_s >= 0) return rc;
    if (rc == LOOM_ETIMEOUT) {
        if (alive)
            loom_err_set(err, LOOM_ENET, ps->task, "only %d worker%s left, fewer than replicas_to_aggregate = %d, and "
                         "none came back within %g s (cluster.connect_timeout)", alive, alive == 1 ? "" : "s",
                         ps->sync_n, ps->wait_s);
        else
            loom_err_set(err, LOOM_ENET, ps->task, "every worker was lost and none came back within %g s "
                         "(cluster.connect_timeout)", ps->wait_s);
        loom_err_hint(err, "the job stops; restart it (loom launch --restarts K) to resume from the last checkpoint");
        return LOOM_ENET;
    }
    if (rc) {
        loom_err_hint(err, "a ps task holds variables no other task has: the job stops; loom launch --restarts K "
                           "restarts it from the last checkpoint");
        return rc;
    }
    int w = worker_of_peer(ps, from);
    char who[32];
    peer_name(ps, from, who, sizeof who);
    if (type == LOOM_MSG_PEER_DOWN && w >= 0) news_down(ps, w, who);
    else if (type == LOOM_MSG_PEER_UP && w >= 0) news_up(ps, w, who);
    else if (type == LOOM_PS_MSG_RESULT && w >= 0) rc = news_result(ps, w, who, &msg, err);
    else if (type == LOOM_PS_MSG_REFUSED) news_refused(who, &msg);
    /* anything else (late VALUES of an abandoned pull): ignored */
    loom_buf_fini(&msg);
    return rc;
}

static int pump(ps_strategy *ps, loom_err *err) { return pump_for(ps, -1, err); }

/* The end of the job: waits (at most 10 s) for every worker still busy
 * (a synchronous backup finishing a stale step) to report, so none is
 * cut off from the ps tasks in the middle of a push. */
static void drain_workers(ps_strategy *ps)
{
    double until = loom_now() + 10;
    for (;;) {
        bool any = false;
        for (int w = 0; w < ps->n_workers; w++) any |= ps->alive[w] && ps->busy[w];
        double left = until - loom_now();
        if (!any || left <= 0) return;
        loom_err e;
        if (pump_for(ps, left, &e)) return;
    }
}

/* Waits until no step function runs (the variables at rest on the ps tasks). */
static int quiesce(ps_strategy *ps, loom_err *err)
{
    /* queued, not started: dropped (their steps were never counted) */
    for (int i = 0; i < ps->n_fns;)
        if (ps->fns[i].worker == -1) {
            ps->dispatched -= ps->fns[i].steps;
            drop_fn(ps, i);
        } else
            i++;
    while (running_fns(ps)) {
        int rc = pump(ps, err);
        if (rc) return rc;
        for (int i = 0; i < ps->n_fns;)
            if (ps->fns[i].worker == -1) { /* requeued after a loss: never mind, the next schedule redoes it */
                ps->dispatched -= ps->fns[i].steps;
                drop_fn(ps, i);
            } else
                i++;
    }
    return LOOM_OK;
}

/* The ps tasks' variables (and slots) into the chief's model. */
static int fetch(ps_strategy *ps, bool slots, loom_err *err)
{
    if (ps->fresh && !slots) return LOOM_OK;
    int rc = quiesce(ps, err);
    if (!rc) rc = pull_all(ps, loom_model_params(ps->model), slots && ps->n_slots ? loom_optimizer_slots(ps->opt) : NULL,
                           0, &ps->ps_step, err);
    if (!rc) ps->fresh = true;
    return rc;
}

static int ps_train_step(loom_strategy *s, const loom_elem *batch, int64_t step, loom_step_result *out, loom_err *err)
{
    (void)batch; /* the workers compute on their own pipelines */
    ps_strategy *ps = s->impl;
    memset(out, 0, sizeof *out);
    if (!ps->net) {
        char w[600];
        return loom_err_set(err, LOOM_ECONFIG, loom_loc_str(&s->args->spec->strategy.loc, w, sizeof w),
                            "parameter_server trains across processes, but this one has no task of a cluster: it needs "
                            "a chief, workers and ps tasks"),
               loom_err_hint(err, "run it with loom launch --local CONFIG --workers 2 --ps 1 (or --task ROLE:I for "
                                  "each task); for one process use one_device or mirrored");
    }
    int rc;
    if (ps->need_init && (rc = init_ps_tasks(ps, step, err))) return rc;
    if (test_die_now(ps->task, step + 1)) _exit(137); /* tests: the coordinator lost */
    ps->fresh = false;
    while (ps->ready_head == ps->n_ready) {
        if ((rc = schedule(ps, step, err))) return rc;
        if (ps->ready_head < ps->n_ready) break;
        if (ps->n_fns == 0)
            return loom_err_set(err, LOOM_EUSAGE, ps->task, "nothing to schedule at step %lld", (long long)step + 1);
        if ((rc = pump(ps, err))) return rc;
    }
    loom_ps_step_out *o = &ps->ready[ps->ready_head++];
    out->loss_sum = o->loss_sum;
    out->correct = o->correct;
    out->examples = o->examples;
    return LOOM_OK;
}

static int ps_eval_step(loom_strategy *s, const loom_elem *batch, loom_step_result *out, loom_err *err)
{
    ps_strategy *ps = s->impl;
    int rc = ps->net && !ps->need_init ? fetch(ps, false, err) : LOOM_OK;
    if (rc) return rc;
    const loom_tensor *x = &batch->t[s->args->input_idx], *y = &batch->t[s->args->label_idx];
    out->examples = x->shape.dim[0];
    return loom_model_evaluate(ps->model, x, y, &out->loss_sum, &out->correct, err);
}

static int ps_predict(loom_strategy *s, const loom_elem *batch, float *out, loom_err *err)
{
    ps_strategy *ps = s->impl;
    int rc = ps->net && !ps->need_init ? fetch(ps, false, err) : LOOM_OK;
    if (rc) return rc;
    return loom_model_predict(ps->model, &batch->t[s->args->input_idx], out, err);
}

static loom_model *ps_model(loom_strategy *s) { return ((ps_strategy *)s->impl)->model; }
static loom_optimizer *ps_optimizer(loom_strategy *s) { return ((ps_strategy *)s->impl)->opt; }
static int ps_num_replicas(loom_strategy *s) { (void)s; return 1; }

/* After a restore into the chief's model: the ps tasks get it at the next step. */
static int ps_sync(loom_strategy *s, loom_err *err)
{
    (void)err;
    ps_strategy *ps = s->impl;
    ps->need_init = ps->net != NULL;
    ps->restored = ps->net != NULL;
    ps->fresh = true;
    return LOOM_OK;
}

/* Each worker's own pipeline (not sharded, repeated) shuffles with a seed
 * of its own, as create_per_worker_dataset gives each worker its own
 * dataset; the keys are those the trainer used before they moved here. */
static int ps_input_context(const loom_strategy_args *a, loom_input_ctx *ctx, loom_err *err)
{
    (void)err;
    if (a->cluster && a->cluster->role == LOOM_ROLE_WORKER) ctx->seed_key = 0x7073776bu + (uint64_t)a->cluster->index;
    return LOOM_OK;
}

static bool ps_is_chief(loom_strategy *s) { return ((ps_strategy *)s->impl)->role == LOOM_ROLE_CHIEF; }

/* A checkpoint: the variables back from the ps tasks (and their slots,
 * when the chief writes the checkpoint whole; with sharded checkpoints each
 * ps writes its own), then the chief's iterator state with the ps count and
 * the partitioning. */
static int ps_gather_iter_state(loom_strategy *s, const loom_buf *mine, loom_buf *stored, loom_err *err)
{
    ps_strategy *ps = s->impl;
    loom_buf_init(stored);
    if (ps->net && !ps->need_init) {
        int rc = fetch(ps, !ps->write_ckpt, err);
        if (rc) return rc;
    }
    loom_buf_put_u32(stored, ITER_MAGIC2);
    loom_buf_put_u32(stored, (uint32_t)ps->n_ps);
    loom_buf_put_u32(stored, (uint32_t)ps->plan.n_shards);
    loom_buf_put_u64(stored, ps->plan_id);
    loom_buf_put(stored, mine->data, mine->len);
    return stored->failed ? loom_err_set(err, LOOM_ENOMEM, NULL, "packing the iterator state") : LOOM_OK;
}

static int ps_pick_iter_state(loom_strategy *s, const loom_buf *stored, loom_buf *mine, loom_err *err)
{
    ps_strategy *ps = s->impl;
    loom_buf_init(mine);
    loom_buf b = *stored;
    b.pos = 0;
    b.failed = 0;
    uint32_t magic = stored->len >= 8 ? loom_buf_get_u32(&b) : 0;
    if (magic != ITER_MAGIC && !(magic == ITER_MAGIC2 && stored->len >= 20))
        return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "the checkpoint was not written by parameter_server training: "
                            "it holds no ps count"),
               loom_err_hint(err, "resume it with the strategy that wrote it, or pass --fresh");
    uint32_t n = loom_buf_get_u32(&b);
    if ((int)n != ps->n_ps)
        return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "the checkpoint was written by a job of %u ps task%s, this job "
                            "has %d: its shards restore only onto the same number of ps tasks", n, n == 1 ? "" : "s",
                            ps->n_ps),
               loom_err_hint(err, "run the job with %u ps task%s (loom launch --ps %u), or pass --fresh to start over",
                             n, n == 1 ? "" : "s", n);
    if (magic == ITER_MAGIC2) { /* the partitioning too (TF: the shard count must not change) */
        uint32_t shards = loom_buf_get_u32(&b);
        uint64_t id = loom_buf_get_u64(&b);
        if (id != ps->plan_id)
            return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "the checkpoint's variables were cut into %u shard%s over "
                                "%u ps task%s by another partitioning (plan %016llx); this job cuts them into %d over %d "
                                "(plan %016llx): shards restore only onto the partitioning that wrote them", shards,
                                shards == 1 ? "" : "s", n, n == 1 ? "" : "s", (unsigned long long)id, ps->plan.n_shards,
                                ps->n_ps, (unsigned long long)ps->plan_id),
                   loom_err_hint(err, "run it with the model and strategy.variable_partitioner that wrote it (loom "
                                 "check prints the shards), or pass --fresh to start over");
    }
    loom_buf_put(mine, b.data + b.pos, b.len - b.pos);
    return mine->failed ? loom_err_set(err, LOOM_ENOMEM, NULL, "copying the iterator state") : LOOM_OK;
}

/* ---- sharded checkpoints (distribute.h; the seams distribute.c calls) ---- */

bool loom_ps_saves_shards_(loom_strategy *s)
{
    ps_strategy *ps = s->impl;
    return ps->net && ps->write_ckpt && ps->role == LOOM_ROLE_CHIEF;
}

void loom_ps_set_ckpt_writer_(loom_strategy *s, loom_ckpt_write_fn fn) { ((ps_strategy *)s->impl)->write_ckpt = fn; }

int loom_ps_save_shards_(loom_strategy *s, const char *dir, int64_t step, loom_ckpt_shards *out, loom_err *err)
{
    ps_strategy *ps = s->impl;
    memset(out, 0, sizeof *out);
    char abs[PATH_MAX];
    if (dir[0] != '/') { /* the ps tasks need the directory itself, whatever their working directory */
        if (!realpath(dir, abs))
            return loom_err_set(err, LOOM_EIO, dir, "cannot resolve the model directory: %s", strerror(errno));
        dir = abs;
    }
    if (strlen(dir) >= LOOM_PATH_MAX)
        return loom_err_set(err, LOOM_EIO, dir, "the model directory's path is longer than %d bytes", LOOM_PATH_MAX - 1);
    int rc = ps->need_init ? init_ps_tasks(ps, step, err) : quiesce(ps, err); /* the variables at rest */
    if (rc) return rc;
    out->file = loom_calloc((size_t)ps->n_ps, sizeof *out->file);
    out->part = loom_calloc((size_t)(ps->plan.n_shards ? ps->plan.n_shards : 1), sizeof *out->part);
    if (!out->file || !out->part) {
        loom_ckpt_shards_fini(out);
        return loom_err_set(err, LOOM_ENOMEM, NULL, "listing the shards of a checkpoint");
    }
    out->n_ps = out->n_files = ps->n_ps;
    out->plan_id = ps->plan_id;
    loom_buf b;
    loom_buf_init(&b);
    uint64_t req = ++ps->req;
    loom_ps_hdr h = {.req = req, .nonce = ps->nonce, .step = step};
    loom_ps_put_save_(&b, &h, dir);
    for (int q = 0; q < ps->n_ps && !rc; q++)
        rc = b.failed ? loom_err_set(err, LOOM_ENOMEM, NULL, "building a checkpoint request")
                      : loom_net_send(ps->net, ps->peer_ps[q], LOOM_PS_MSG_SAVE, b.data, b.len, err);
    for (int q = 0; q < ps->n_ps && !rc; q++) {
        int from;
        uint32_t type;
        char who[32];
        for (;;) { /* (a late answer to an abandoned request is skipped) */
            rc = loom_net_recv(ps->net, ps->peer_ps[q], LOOM_PS_MSG_REFUSED, LOOM_PS_MSG_SAVED, &from, &type, &b, -1, err);
            if (rc) break;
            if (type == LOOM_PS_MSG_REFUSED) {
                rc = refused(ps, from, &b, err);
                break;
            }
            if (type != LOOM_PS_MSG_SAVED) continue;
            loom_ckpt_shard_file *f = &out->file[q];
            loom_ps_hdr got;
            if ((rc = loom_ps_decode_saved_(b.data, b.len, &got, &f->size, &f->crc, f->name, sizeof f->name, err))) {
                loom_err_hint(err, "the answer of %s to a checkpoint request did not decode",
                              peer_name(ps, from, who, sizeof who));
                break;
            }
            if (got.req != req) continue;
            f->ps = q;
            break;
        }
        if (rc) break;
        /* the index refers to the file by name in dir: this task must see it there */
        char path[PATH_MAX + 160];
        snprintf(path, sizeof path, "%s/%s", dir, out->file[q].name);
        struct stat sb;
        int missing = stat(path, &sb) < 0 ? errno : 0;
        if (missing || (uint64_t)sb.st_size != out->file[q].size) {
            rc = loom_err_set(err, LOOM_EIO, path, "ps:%d wrote its shard of the checkpoint of step %lld here (%llu "
                              "bytes), but the coordinator %s%s", q, (long long)step,
                              (unsigned long long)out->file[q].size, missing ? "cannot see it: " : "sees another size",
                              missing ? strerror(missing) : "");
            loom_err_hint(err, "run.model_dir must be one directory that every task of the job shares (the same "
                               "path on a shared file system); the index the chief writes names the ps tasks' files");
        }
    }
    loom_buf_fini(&b);
    for (int i = 0; i < ps->plan.n_shards && !rc; i++) {
        const loom_ps_shard *sh = &ps->plan.shard[i];
        loom_ckpt_part *p = &out->part[out->n_parts++];
        snprintf(p->var, sizeof p->var, "%s", ps->pi[sh->var].name);
        loom_ps_record_name_(&ps->plan, ps->pi, i, p->record, sizeof p->record);
        p->file = sh->ps;
        p->row0 = sh->row0;
        p->rows = sh->rows;
    }
    if (rc) loom_ckpt_shards_fini(out);
    if (!rc && test_save_die_now(ps->task, "index", step)) _exit(137);
    return rc;
}

static int ps_serve(loom_strategy *s, loom_iter *train, loom_err *err)
{
    ps_strategy *ps = s->impl;
    if (ps->role == LOOM_ROLE_EVALUATOR) {
        loom_warn("%s: parameter_server has no sidecar evaluator yet: the chief evaluates at epoch ends", ps->task);
        return LOOM_OK;
    }
    if (!ps->net) return LOOM_OK;
    struct sigaction sa = {0}, old_int, old_term;
    sa.sa_handler = on_serve_signal;
    serve_signals = 0;
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
    int rc = ps->role == LOOM_ROLE_PS ? ps_serve_loop(ps, s->args->spec, err) : worker_serve(ps, s->args, train, err);
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);
    return rc;
}

static void ps_where(loom_strategy *s, char *buf, size_t n)
{
    ps_strategy *ps = s->impl;
    snprintf(buf, n, "%d worker%s and %d ps (parameter_server, %s), each", ps->n_workers,
             ps->n_workers == 1 ? "" : "s", ps->n_ps, ps->sync ? "sync" : "async");
}

static void ps_print_plan(loom_strategy *s, int64_t global_batch, FILE *f)
{
    ps_strategy *ps = s->impl;
    const loom_strategy_spec *st = &s->args->spec->strategy;
    if (ps->role == LOOM_ROLE_EVALUATOR || !ps->pi) {
        fprintf(f, "strategy: parameter_server (this is %s: no part in training)\n", ps->task);
        return;
    }
    fprintf(f, "strategy: parameter_server, coordinator chief:0, %d worker%s, %d ps task%s; this is %s\n", ps->n_workers,
            ps->n_workers == 1 ? "" : "s", ps->n_ps, ps->n_ps == 1 ? "" : "s", ps->task);
    fprintf(f, "  each worker computes on its own pipeline (data.train repeated, its own shuffle seed, not sharded), "
            "batch %lld per step\n", (long long)global_batch);
    fprintf(f, "  step functions of %lld step%s (run.steps_per_execution), taken by any free worker\n", (long long)ps->K,
            ps->K == 1 ? "" : "s");
    if (ps->sync)
        fprintf(f, "  synchronous: each step applies the mean of the first %d of %d workers' gradients; later ones are "
                "stale and dropped (%d backup worker%s)\n", ps->sync_n, ps->n_workers, ps->n_workers - ps->sync_n,
                ps->n_workers - ps->sync_n == 1 ? "" : "s");
    else
        fprintf(f, "  asynchronous: each ps applies every push at once (optimizer %s on the ps tasks)\n",
                loom_optimizer_slot_name(ps->opt, 0) ? "with its slots beside each variable" : "without slots");
    if (st->partitioner.kind == LOOM_PARTITIONER_NONE)
        fprintf(f, "  placement: whole variables round-robin over the ps tasks\n");
    else
        fprintf(f, "  placement: variables split along axis 0 by the %s partitioner, shards round-robin over the ps "
                "tasks\n", loom_partitioner_name(st->partitioner.kind));
    if (ps->table_var >= 0)
        fprintf(f, "  the embedding table %s: %s\n", ps->pi[ps->table_var].name,
                ps->sparse ? "workers pull only the rows a batch looks up and push only their gradients (sparse "
                             "updates, applied lazily on the ps)" : "moved whole (LOOM_TEST_PS_DENSE_TABLES)");
    loom_ps_plan_print_(&ps->plan, ps->pi, ps->n_slots, f);
}

static int ps_peers(loom_strategy *s, loom_peer_info *out, int max)
{
    ps_strategy *ps = s->impl;
    return ps->net ? loom_net_peers(ps->net, out, max) : 0;
}

/* strategy.sync against the workers the cluster has (the sync settings were
 * checked among themselves at load; the cluster is known only now). */
static int ps_check_cluster(const loom_spec *spec, const int *n_tasks, const char *cluster_from, loom_err *err)
{
    const loom_ps_sync_spec *y = &spec->strategy.sync;
    if (!y->enabled) return LOOM_OK;
    int nw = n_tasks[LOOM_ROLE_WORKER];
    char yw[LOOM_PATH_MAX + 16];
    loom_loc_str(&y->loc, yw, sizeof yw);
    int m = y->total_replicas > 0 ? y->total_replicas : nw;
    if (m != nw) {
        loom_err_set(err, LOOM_ECONFIG, yw, "strategy.sync.total_replicas = %d, but the cluster (from %s) has %d "
                     "worker%s", m, cluster_from, nw, nw == 1 ? "" : "s");
        return loom_err_hint(err, "set total_replicas to the number of workers (or leave it out)");
    }
    if (y->replicas_to_aggregate > m) {
        loom_err_set(err, LOOM_ECONFIG, yw, "strategy.sync.replicas_to_aggregate = %d is more than the %d worker%s of "
                     "the cluster (from %s): no step could gather that many gradients", y->replicas_to_aggregate, m,
                     m == 1 ? "" : "s", cluster_from);
        return loom_err_hint(err, "aggregate at most one gradient per worker");
    }
    return LOOM_OK;
}

/* The ps tasks hold the variables, the chief coordinates, the workers
 * compute gradients (a lost worker is started again and rejoins: the job
 * goes on without it meanwhile); an evaluator may watch the job. */
static const loom_cluster_roles parameter_server_roles = {
    .flags = LOOM_ROLES_REJOIN,
    .use = {[LOOM_ROLE_CHIEF] = LOOM_ROLE_REQUIRED, [LOOM_ROLE_WORKER] = LOOM_ROLE_REQUIRED,
            [LOOM_ROLE_PS] = LOOM_ROLE_REQUIRED},
    .why = {[LOOM_ROLE_CHIEF] = "(the coordinator)", [LOOM_ROLE_PS] = "to hold the variables"},
    .hint = {[LOOM_ROLE_CHIEF] = "declare cluster.chief (one task) and cluster.worker (loom launch --local --workers 2 "
                                 "--ps 1)",
             [LOOM_ROLE_PS] = "add cluster.ps = [\"host:port\"] (loom launch --local --ps 1), or use "
                              "multi_worker_mirrored"},
    .check = ps_check_cluster,
};

static const loom_strategy_ops parameter_server_ops = {
    .version = LOOM_STRATEGY_OPS_VERSION,
    .name = "parameter_server",
    .open = ps_open,
    .close = ps_close,
    .train_step = ps_train_step,
    .eval_step = ps_eval_step,
    .predict = ps_predict,
    .model = ps_model,
    .optimizer = ps_optimizer,
    .sync = ps_sync,
    .num_replicas = ps_num_replicas,
    .caps = LOOM_STRATEGY_OWN_THREADS,
    .print_plan = ps_print_plan,
    .where = ps_where,
    .input_context = ps_input_context,
    .is_chief = ps_is_chief,
    .gather_iter_state = ps_gather_iter_state,
    .pick_iter_state = ps_pick_iter_state,
    .peers = ps_peers,
    .serve = ps_serve,
    .roles = &parameter_server_roles,
};

const loom_strategy_ops *loom_parameter_server_ops_(void) { return &parameter_server_ops; }
