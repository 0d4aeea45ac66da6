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
 * its own.
 *
 * Files: this one opens and closes the strategy, holds the helpers every
 * role uses (the range messages) and the vtable; the chief is ps_coord.c, a
 * worker ps_worker.c, a ps task ps_task.c, checkpoints and restore
 * ps_ckpt.c; placement ps_plan.c, messages ps_wire.c (ps_internal.h). */
#include "distribute.h"
#include "mirrored_internal.h"
#include "ps_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

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
int loom_ps_recv_or_stop_(ps_strategy *ps, int p, uint32_t lo, uint32_t hi, int *from, uint32_t *type, loom_buf *msg,
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

const char *loom_ps_peer_name_(const ps_strategy *ps, int p, char *buf, size_t n)
{
    if (p < 0 || p >= ps->n_peers) return snprintf(buf, n, "peer %d", p), buf;
    return loom_task_name(ps->peer_role[p], ps->peer_index[p], buf, n);
}


/* Tests: LOOM_TEST_PS_DIE = "TASK@N" kills this task (_exit 137) at its Nth
 * step function (a worker) or Nth push (a ps), once per file named by
 * LOOM_TEST_PS_DIE_MARK (created on dying) when that is set. */
bool loom_ps_test_die_now_(const char *task, int64_t nth)
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
bool loom_ps_test_save_die_now_(const char *task, const char *phase, int64_t step)
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
    loom_shape xs[LOOM_MAX_MODEL_INPUTS], ye;
    loom_dtype dt[LOOM_MAX_MODEL_INPUTS];
    int n_in = loom_strategy_model_shapes_(a, xs, dt, &ye), rc;
    if (ps->role == LOOM_ROLE_PS && !a->plan_only && c && c->index >= 0) {
        /* a ps holds its shards only: the variable list from the config's
         * model section, no weights, gradients or activations of the whole
         * model (it gets its shards' values from the coordinator) */
        rc = loom_model_param_list(&spec->model, n_in, xs, dt, &ye, in->dtype[a->label_idx], &ps->pi,
                                   &ps->nv, &ps->P, &ps->lean_table, err);
        if (rc) return rc;
    } else {
        rc = loom_strategy_model_new_(&ps->model, a, a->max_batch, err);
        if (rc) return rc;
        if (ps->role != LOOM_ROLE_PS && (rc = loom_model_set_threads(ps->model, spec->run.threads, err))) return rc;
        if (!a->plan_only) loom_model_init_params(ps->model, spec->run.seed); /* `loom check`: no values wanted */
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
        loom_ps_drain_workers_(ps);
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
int loom_ps_put_shards_sel_(loom_buf *b, const ps_strategy *ps, int q, const loom_ps_hdr *h0, const float *base,
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

int loom_ps_put_shards_(loom_buf *b, const ps_strategy *ps, int q, const loom_ps_hdr *h0, const float *base,
                        const float *slots)
{
    return loom_ps_put_shards_sel_(b, ps, q, h0, base, slots, false);
}

/* A VALUES message's floats into the flat buffers (whole ranges, or rows). */
void loom_ps_take_values_(const ps_strategy *ps, const loom_ps_msg *m, float *base, float *slots)
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
int loom_ps_refused_(const ps_strategy *ps, int from, const loom_buf *msg, loom_err *err)
{
    char who[32], text[400];
    size_t l = msg->len < sizeof text - 1 ? msg->len : sizeof text - 1;
    memcpy(text, msg->data, l);
    text[l] = 0;
    return loom_err_set(err, LOOM_ENET, ps->task, "%s refused our message: %s",
                        loom_ps_peer_name_(ps, from, who, sizeof who), text);
}

/* Pulls every ps's shards into base (and slots, with_slots); min_step: the
 * least applied count to answer with. *step: the least applied count the
 * ps tasks answered with. */
int loom_ps_pull_sel_(ps_strategy *ps, float *base, float *slots, int64_t min_step, int64_t *step, bool sel,
                      loom_err *err)
{
    loom_buf b;
    loom_buf_init(&b);
    uint64_t req = ++ps->req;
    int rc = LOOM_OK;
    for (int q = 0; q < ps->n_ps && !rc; q++) {
        b.len = 0;
        loom_ps_hdr h = {.req = req, .nonce = ps->nonce, .step = min_step, .flags = slots ? LOOM_PS_F_SLOTS : 0};
        if (loom_ps_put_shards_sel_(&b, ps, q, &h, NULL, NULL, sel))
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
                rc = loom_ps_refused_(ps, from, &b, err);
                break;
            }
            if (type != LOOM_PS_MSG_VALUES) continue;
            loom_ps_msg m;
            if ((rc = loom_ps_decode_(b.data, b.len, &ps->plan, q, ps->n_slots, true, &m, err))) {
                char who[32];
                loom_err_hint(err, "a VALUES message from %s did not decode",
                              loom_ps_peer_name_(ps, from, who, sizeof who));
                break;
            }
            if (m.h.req != req) { /* an answer to an earlier pull (abandoned): skip it */
                loom_ps_msg_fini_(&m);
                continue;
            }
            ps->bytes_pull += (int64_t)b.len;
            loom_ps_take_values_(ps, &m, base, slots);
            if (m.h.step < least) least = m.h.step;
            loom_ps_msg_fini_(&m);
            break;
        }
    }
    loom_buf_fini(&b);
    if (!rc && step) *step = least == INT64_MAX ? 0 : least;
    return rc;
}

int loom_ps_pull_all_(ps_strategy *ps, float *base, float *slots, int64_t min_step, int64_t *step, loom_err *err)
{
    return loom_ps_pull_sel_(ps, base, slots, min_step, step, false, err);
}

static int ps_eval_step(loom_strategy *s, const loom_elem *batch, loom_step_result *out, loom_err *err)
{
    ps_strategy *ps = s->impl;
    int rc = ps->net && !ps->need_init ? loom_ps_fetch_(ps, false, err) : LOOM_OK;
    if (rc) return rc;
    const loom_tensor *x = &batch->t[s->args->input_idx], *y = &batch->t[s->args->label_idx];
    out->examples = x->shape.dim[0];
    loom_strategy_weights_(s->args, ps->model, batch); /* sample weights, other inputs, other heads' labels */
    return loom_model_evaluate(ps->model, x, y, &out->loss_sum, &out->correct, err);
}

static int ps_predict(loom_strategy *s, const loom_elem *batch, float *out, loom_err *err)
{
    ps_strategy *ps = s->impl;
    int rc = ps->net && !ps->need_init ? loom_ps_fetch_(ps, false, err) : LOOM_OK;
    if (rc) return rc;
    loom_strategy_inputs_(s->args, ps->model, batch); /* model.inputs beyond the first */
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
    int rc = ps->role == LOOM_ROLE_PS ? loom_ps_serve_loop_(ps, s->args->spec, err)
                                      : loom_ps_worker_serve_(ps, s->args, train, err);
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
    .train_step = loom_ps_train_step_,
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
    .gather_iter_state = loom_ps_gather_iter_state_,
    .pick_iter_state = loom_ps_pick_iter_state_,
    .peers = ps_peers,
    .serve = ps_serve,
    .roles = &parameter_server_roles,
};

const loom_strategy_ops *loom_parameter_server_ops_(void) { return &parameter_server_ops; }
