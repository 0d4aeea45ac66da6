/* multi_worker.c - multi_worker_mirrored: synchronous training across the
 * processes of a cluster (tf.distribute.MultiWorkerMirroredStrategy).
 *
 * Each worker (the chief and the workers of the cluster, loom_cluster.rank
 * 0 .. n_train_ranks-1) runs mirrored on its local replicas (strategy.replicas
 * or .devices; mirrored.c's machinery through mirrored_internal.h). A step:
 * every local replica computes its gradients on its share of this worker's
 * batch, they are summed locally (the cross-device op, in this process), then
 * replica 0's sum is all-reduced across the workers with the group's ring
 * (loom_group_all_reduce: chunked reduce-scatter + all-gather over the
 * cluster transport; the result has the same bits on every worker), and
 * every worker applies the same update to its replicas. The variables thus
 * stay bit-identical across workers without a broadcast; the chief
 * broadcasts them once at the start and after a restore, so a worker that
 * initialised differently cannot drift.
 *
 * Four floats ride at the end of the all-reduced buffer, so the workers
 * agree on more than the gradients without another round trip: a stop
 * request (SIGTERM on any task: every worker sees it after the same step),
 * this worker's loss sum, correct count and examples (the step's result is
 * the job's, as one process would log it), and a failure flag (a worker whose
 * step failed still takes part, so the others stop at once naming the step
 * instead of waiting for a lost peer).
 *
 * Batches and losses (tf_semantics 5.3, 5.4, 5.7): the config's batch is the
 * GLOBAL batch G; each worker's pipeline yields G / workers examples a step
 * (the trainer builds it with this strategy's input context), and every
 * replica's summed losses are divided by G, so the sum over all replicas of
 * all workers is one device's gradient on the global batch. A step in which
 * the workers together have E != G examples (a short last batch) rescales the
 * summed gradient by G / E. A worker whose input ended contributes nothing to
 * the steps the others still take (end_of_data), so every worker takes the
 * same number of steps and the epoch ends on all at once.
 *
 * Packs are reduced as one buffer after the backward pass: the reduction does
 * not yet overlap the backward pass (strategy.bytes_per_pack packs only the
 * local reduction).
 *
 * strategy.communication: "ring" (and "auto", which is the ring on CPU) is
 * the group's ring; "mpi" and "nccl" name a plugin's cross-device op with
 * collectives across processes (loom_cross_device_ops version 4: job_open,
 * job_all_reduce, job_close): the gradient all-reduce goes through it (the
 * mpi plugin's MPI_Allreduce, NCCL's ncclAllReduce), everything else (the
 * variables' broadcast, iterator states, heartbeats, lost peers) stays on
 * the group, which also carries the op's bootstrap (NCCL's unique id). After
 * job_open every rank says whether it succeeded, so a rank that could not
 * open the op stops the job at once instead of leaving the others waiting
 * inside the library.
 *
 * Threads: driven from the train thread, which also drives the group. */
#include "distribute.h"
#include "mirrored_internal.h"

#include <stdio.h>
#include <string.h>

enum { TAIL_STOP, TAIL_LOSS, TAIL_CORRECT, TAIL_EXAMPLES, TAIL_FAILED, TAIL_N };

#define ITER_STATES_MAGIC 0x5354574du /* "MWTS": every worker's iterator state */

typedef struct multi_worker {
    loom_strategy  local;      /* mirrored on this worker's replicas */
    bool           local_open;
    loom_group    *group;      /* NULL: one worker (no cluster, or `loom check`) */
    int            workers, rank;
    int64_t        global_batch;
    int64_t        P;
    float         *stage;      /* (P + TAIL_N): replica 0's sum, then the job's */
    bool           stop_req, stop_seen;
    char           task[64];   /* "worker:1", for messages */
    const loom_cross_device_ops *job_ops; /* communication = "mpi" | "nccl": the plugin's op; NULL: the ring */
    void          *job_comm;   /* job_ops' state */
    loom_job_args  job_args;   /* what job_open got (valid until job_close) */
    char           comm_where[600];
} multi_worker;

static int64_t last_batch_size(const loom_dataset_spec *d)
{
    for (int i = d->n_transforms - 1; i >= 0; i--)
        if (d->transform[i].kind == LOOM_T_BATCH || d->transform[i].kind == LOOM_T_PADDED_BATCH)
            return d->transform[i].batch_size;
    return 0;
}

static int n_workers(const loom_strategy_args *a)
{
    return a->cluster && a->cluster->n_train_ranks > 0 ? a->cluster->n_train_ranks : 1;
}

/* This process's rank; `loom check` without a task plans as the chief. */
static int rank_of(const loom_strategy_args *a)
{
    return n_workers(a) > 1 && a->cluster->rank > 0 ? a->cluster->rank : 0;
}

static int local_replicas(const loom_strategy_spec *st)
{
    if (st->devices_listed) return st->n_devices;
    return st->replicas > 0 ? st->replicas : loom_num_cores();
}

/* The input context: one pipeline per worker, this one the worker's rank. */
static int mw_input_context(const loom_strategy_args *a, loom_input_ctx *ctx, loom_err *err)
{
    (void)err;
    int n = n_workers(a);
    ctx->num_input_pipelines = n;
    ctx->input_pipeline_id = rank_of(a);
    ctx->num_replicas_in_sync = n * local_replicas(&a->spec->strategy);
    return LOOM_OK;
}

/* communication = "mpi" | "nccl": the plugin's cross-device op of that name
 * with collectives across processes, else an error at the setting. */
static int find_job_op(multi_worker *mw, const loom_strategy_spec *st, loom_err *err)
{
    const char *name = loom_communication_name(st->communication), *origin = NULL;
    loom_loc_str(st->communication_loc.file[0] ? &st->communication_loc : &st->loc, mw->comm_where,
                 sizeof mw->comm_where);
    const char *setting = strncmp(mw->comm_where, "--set ", 6) ? "strategy.communication: " : "";
    const loom_cross_device_ops *x = loom_registry_find(LOOM_REG_CROSS_DEVICE_OPS, name, &origin);
    if (loom_xops_job(x)) {
        mw->job_ops = x;
        return LOOM_OK;
    }
    if (!x) {
        loom_err_set(err, LOOM_EUNSUPPORTED, mw->comm_where, "%s\"%s\": no cross-device op \"%s\" is loaded (the %s "
                     "plugin is not built or not found)", setting, name, name, name);
        return loom_err_hint(err, "%s; `loom plugins` lists what loaded and what was refused. Or use communication "
                             "= \"ring\": the cluster transport's all-reduce",
                             st->communication == LOOM_COMM_MPI
                                 ? "the mpi plugin is built when Open MPI is found (Debian: libopenmpi-dev)"
                                 : "the nccl plugin is built when the CUDA toolkit and NCCL are found");
    }
    loom_err_set(err, LOOM_EUNSUPPORTED, mw->comm_where, "%s\"%s\": the cross-device op \"%s\" (%s) has no "
                 "collectives across processes (its vtable is version %u; job_open and job_all_reduce came in 4)",
                 setting, name, name, origin ? origin : "built in", x->version);
    return loom_err_hint(err, "rebuild the plugin against this loom's plugins/loom_plugin.h, or use communication = "
                         "\"ring\"");
}

/* The bootstrap channel of loom_job_args: the group's collectives. */
static int boot_broadcast(void *boot, void *buf, size_t len, int root, loom_err *err)
{
    return loom_group_broadcast(boot, buf, len, root, err);
}

static int boot_all_gather(void *boot, const void *buf, size_t len, void *out, loom_err *err)
{
    loom_group *g = boot;
    int n = loom_group_size(g);
    loom_buf *all = loom_calloc((size_t)n, sizeof *all);
    if (!all) return loom_err_set(err, LOOM_ENOMEM, NULL, "gathering %d bootstrap messages", n);
    int rc = loom_group_all_gather_bytes(g, buf, len, all, err);
    for (int r = 0; r < n && !rc; r++) {
        if (all[r].len != len)
            rc = loom_err_set(err, LOOM_EUSAGE, NULL, "bootstrap all-gather: rank %d sent %zu bytes, this rank %zu",
                              r, all[r].len, len);
        else if (len)
            memcpy((char *)out + (size_t)r * len, all[r].data, len);
    }
    for (int r = 0; r < n; r++) loom_buf_fini(&all[r]);
    loom_free(all);
    return rc;
}

/* Opens the op's job collectives on every rank, then every rank learns
 * whether all of them could: a failure anywhere stops the whole job now. */
static int open_job_op(multi_worker *mw, const loom_strategy_args *a, loom_err *err)
{
    mw->job_args = (loom_job_args){.size = sizeof(loom_job_args), .rank = mw->rank, .ranks = mw->workers,
                                   .task = mw->task, .where = mw->comm_where,
                                   .timeout_s = a->spec->strategy.collective_timeout, .boot = mw->group,
                                   .boot_broadcast = boot_broadcast, .boot_all_gather = boot_all_gather};
    loom_err own;
    memset(&own, 0, sizeof own);
    int orc = mw->job_ops->job_open(&mw->job_comm, &mw->job_args, &own);
    if (orc && !own.where[0]) snprintf(own.where, sizeof own.where, "%.255s", mw->comm_where);
    uint8_t mine = orc ? 1 : 0, *all = loom_calloc((size_t)mw->workers, 1);
    if (!all) return loom_err_set(err, LOOM_ENOMEM, NULL, "agreeing on communication");
    int rc = boot_all_gather(mw->group, &mine, 1, all, err);
    char failed[256] = "";
    size_t len = 0;
    for (int r = 0; r < mw->workers && !rc; r++)
        if (all[r] && len < sizeof failed) {
            char t[64];
            const loom_task_addr *ta = loom_cluster_rank_task(a->cluster, r);
            len += (size_t)snprintf(failed + len, sizeof failed - len, "%s%s", len ? ", " : "",
                                    ta ? loom_task_name(ta->role, ta->index, t, sizeof t) : "?");
        }
    loom_free(all);
    if (orc) { /* this rank's own failure says most */
        *err = own;
        return orc;
    }
    if (rc) return rc;
    if (failed[0])
        return loom_err_set(err, LOOM_ENET, mw->comm_where, "communication = \"%s\" could not open on %s (see %s "
                            "log); %s stops with it", mw->job_ops->name, failed, strchr(failed, ',') ? "their" : "its",
                            mw->task),
               loom_err_hint(err, "fix what that task reports, or use communication = \"ring\"");
    return LOOM_OK;
}

static int mw_open(loom_strategy *s, const loom_strategy_args *a, loom_err *err)
{
    multi_worker *mw = loom_calloc(1, sizeof *mw);
    if (!mw) return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating the multi_worker_mirrored strategy");
    s->impl = mw;
    const loom_strategy_spec *st = &a->spec->strategy;
    mw->workers = n_workers(a);
    mw->rank = rank_of(a);
    if (a->cluster && a->cluster->rank >= 0) loom_task_name(a->cluster->role, a->cluster->index, mw->task, sizeof mw->task);
    else if (a->cluster) snprintf(mw->task, sizeof mw->task, "no task given; planned as");
    else snprintf(mw->task, sizeof mw->task, "chief:0");
    mw->global_batch = last_batch_size(&a->spec->train);
    mw->local = (loom_strategy){.ops = loom_mirrored_ops_(), .xops = s->xops, .args = a};
    mw->local_open = true;
    int nloc = local_replicas(st);
    int rc = loom_replicated_open_(&mw->local, a, mw->rank * nloc, mw->global_batch, err);
    if (rc) return rc;
    mw->P = loom_replicated_num_params_(&mw->local);
    mw->stage = loom_alloc_aligned((size_t)(mw->P + TAIL_N) * sizeof(float));
    if (!mw->stage) return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating the all-reduce buffer (%lld floats)",
                                        (long long)(mw->P + TAIL_N));
    if ((st->communication == LOOM_COMM_MPI || st->communication == LOOM_COMM_NCCL) &&
        (rc = find_job_op(mw, st, err)))
        return rc;
    if (mw->workers == 1 || a->plan_only) return LOOM_OK;
    if ((rc = loom_group_open(&mw->group, a->cluster, st->collective_timeout, err))) return rc;
    if (mw->job_ops && (rc = open_job_op(mw, a, err))) return rc;
    /* the chief's initial variables on every worker (they agree already: the same seed) */
    rc = loom_group_broadcast(mw->group, loom_model_params(loom_strategy_model(&mw->local)),
                              (size_t)mw->P * sizeof(float), 0, err);
    return rc ? rc : mw->local.ops->sync(&mw->local, err);
}

static void mw_close(loom_strategy *s)
{
    multi_worker *mw = s->impl;
    if (!mw) return;
    if (mw->job_comm) mw->job_ops->job_close(mw->job_comm);
    loom_group_close(mw->group);
    if (mw->local_open) mw->local.ops->close(&mw->local);
    loom_free(mw->stage);
    loom_free(mw);
}

/* One step of the job: this worker's gradients (batch NULL: none), the
 * all-reduce across workers with the tail, the update. */
static int mw_step(loom_strategy *s, const loom_elem *batch, int64_t step, loom_step_result *out, loom_err *err)
{
    multi_worker *mw = s->impl;
    loom_step_result mine;
    loom_err lerr;
    int lrc = loom_replicated_grads_(&mw->local, batch, step, &mine, &lerr);
    float *g = mw->stage, *tail = mw->stage + mw->P;
    if (lrc) memset(g, 0, (size_t)mw->P * sizeof(float));
    else memcpy(g, loom_replicated_grads0_(&mw->local), (size_t)mw->P * sizeof(float));
    tail[TAIL_STOP] = mw->stop_req ? 1.0f : 0.0f;
    tail[TAIL_LOSS] = (float)mine.loss_sum;
    tail[TAIL_CORRECT] = (float)mine.correct;
    tail[TAIL_EXAMPLES] = (float)mine.examples;
    tail[TAIL_FAILED] = lrc ? 1.0f : 0.0f;
    mw->stop_req = false;
    if (mw->group) {
        int rc = mw->job_ops ? mw->job_ops->job_all_reduce(mw->job_comm, mw->stage, mw->P + TAIL_N, LOOM_REDUCE_SUM, err)
                             : loom_group_all_reduce(mw->group, mw->stage, mw->P + TAIL_N, err);
        if (rc) {
            if (lrc) *err = lerr; /* this worker's own failure explains it better */
            return lrc ? lrc : rc;
        }
    }
    if (lrc) {
        *err = lerr;
        return lrc;
    }
    if (tail[TAIL_FAILED] > 0)
        return loom_err_set(err, LOOM_ENET, NULL, "step %lld failed on another worker of the job (see its log); "
                            "%s stops with it", (long long)step + 1, mw->task),
               loom_err_hint(err, "fix what that worker reports, then run the job again: it resumes from the last "
                             "checkpoint");
    /* sticky: a request carried by a step without examples (every input had
     * ended: the epoch ends first) still stops the job after its next step */
    if (tail[TAIL_STOP] > 0) mw->stop_seen = true;
    out->loss_sum = tail[TAIL_LOSS];
    out->correct = (int64_t)tail[TAIL_CORRECT];
    out->examples = (int64_t)tail[TAIL_EXAMPLES];
    if (out->examples == 0) return LOOM_OK; /* every worker's input had ended: no update */
    if (out->examples != mw->global_batch) { /* a short global batch: the losses over its own size */
        float k = (float)((double)mw->global_batch / (double)out->examples);
        for (int64_t i = 0; i < mw->P; i++) g[i] *= k;
    }
    return loom_replicated_apply_(&mw->local, g, step, err);
}

static int mw_train_step(loom_strategy *s, const loom_elem *batch, int64_t step, loom_step_result *out, loom_err *err)
{
    memset(out, 0, sizeof *out);
    return mw_step(s, batch, step, out, err);
}

static int mw_end_of_data(loom_strategy *s, int64_t step, loom_step_result *out, bool *all_ended, loom_err *err)
{
    multi_worker *mw = s->impl;
    *all_ended = true;
    if (!mw->group) return LOOM_OK;
    int rc = mw_step(s, NULL, step, out, err);
    *all_ended = !rc && out->examples == 0;
    return rc;
}

static int mw_eval_step(loom_strategy *s, const loom_elem *batch, loom_step_result *out, loom_err *err)
{
    multi_worker *mw = s->impl;
    return mw->local.ops->eval_step(&mw->local, batch, out, err);
}

static int mw_predict(loom_strategy *s, const loom_elem *batch, float *out, loom_err *err)
{
    multi_worker *mw = s->impl;
    return mw->local.ops->predict(&mw->local, batch, out, err);
}

static loom_model *mw_model(loom_strategy *s)
{
    multi_worker *mw = s->impl;
    return mw->local.ops->model(&mw->local);
}

static loom_optimizer *mw_optimizer(loom_strategy *s)
{
    multi_worker *mw = s->impl;
    return mw->local.ops->optimizer(&mw->local);
}

/* After a restore (every worker read the same checkpoint): the chief's
 * variables to every worker, then to the local replicas. */
static int mw_sync(loom_strategy *s, loom_err *err)
{
    multi_worker *mw = s->impl;
    if (mw->group) {
        int rc = loom_group_broadcast(mw->group, loom_model_params(mw_model(s)), (size_t)mw->P * sizeof(float), 0, err);
        if (rc) return rc;
    }
    return mw->local.ops->sync(&mw->local, err);
}

static int mw_num_replicas(loom_strategy *s)
{
    multi_worker *mw = s->impl;
    return mw->local.ops->num_replicas(&mw->local);
}

static bool mw_is_chief(loom_strategy *s) { return ((multi_worker *)s->impl)->rank == 0; }
static void mw_request_stop(loom_strategy *s) { ((multi_worker *)s->impl)->stop_req = true; }
static bool mw_stop_agreed(loom_strategy *s) { return ((multi_worker *)s->impl)->stop_seen; }

/* Every worker's iterator state, in rank order: u32 magic, u32 workers,
 * then per worker u64 length and the bytes. One worker stores its own as
 * it is, as one process does. */
static int mw_gather_iter_state(loom_strategy *s, const loom_buf *mine, loom_buf *stored, loom_err *err)
{
    multi_worker *mw = s->impl;
    loom_buf_init(stored);
    if (!mw->group) {
        loom_buf_put(stored, mine->data, mine->len);
        return stored->failed ? loom_err_set(err, LOOM_ENOMEM, NULL, "copying the iterator state") : LOOM_OK;
    }
    loom_buf *all = loom_calloc((size_t)mw->workers, sizeof *all);
    if (!all) return loom_err_set(err, LOOM_ENOMEM, NULL, "gathering %d iterator states", mw->workers);
    for (int r = 0; r < mw->workers; r++) loom_buf_init(&all[r]);
    int rc = loom_group_all_gather_bytes(mw->group, mine->data, mine->len, all, err);
    if (!rc) {
        loom_buf_put_u32(stored, ITER_STATES_MAGIC);
        loom_buf_put_u32(stored, (uint32_t)mw->workers);
        for (int r = 0; r < mw->workers; r++) {
            loom_buf_put_i64(stored, (int64_t)all[r].len);
            loom_buf_put(stored, all[r].data, all[r].len);
        }
        if (stored->failed) rc = loom_err_set(err, LOOM_ENOMEM, NULL, "packing %d iterator states", mw->workers);
    }
    for (int r = 0; r < mw->workers; r++) loom_buf_fini(&all[r]);
    loom_free(all);
    return rc;
}

static int mw_pick_iter_state(loom_strategy *s, const loom_buf *stored, loom_buf *mine, loom_err *err)
{
    multi_worker *mw = s->impl;
    loom_buf_init(mine);
    loom_buf b = *stored;
    b.pos = 0;
    b.failed = 0;
    uint32_t magic = stored->len >= 8 ? loom_buf_get_u32(&b) : 0;
    if (magic != ITER_STATES_MAGIC) { /* a checkpoint of one process */
        if (mw->workers > 1)
            return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "the checkpoint was written by a run of one process, "
                                "this job has %d workers: its input position cannot be split among them",
                                mw->workers),
                   loom_err_hint(err, "resume it with one process (loom train without a cluster), or pass --fresh");
        loom_buf_put(mine, stored->data, stored->len);
        return mine->failed ? loom_err_set(err, LOOM_ENOMEM, NULL, "copying the iterator state") : LOOM_OK;
    }
    uint32_t n = loom_buf_get_u32(&b);
    if (!b.failed && (int)n != mw->workers)
        return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "the checkpoint was written by a job of %u worker%s, this "
                            "job has %d: each worker resumes its own input position", n, n == 1 ? "" : "s",
                            mw->workers),
               loom_err_hint(err, "run the job with %u workers to resume it, or pass --fresh to start over", n);
    for (int r = 0; r < (int)n && !b.failed; r++) {
        int64_t len = loom_buf_get_i64(&b);
        if (b.failed || len < 0 || (uint64_t)len > b.len - b.pos) break;
        if (r == mw->rank) {
            loom_buf_put(mine, b.data + b.pos, (size_t)len);
            return mine->failed ? loom_err_set(err, LOOM_ENOMEM, NULL, "copying the iterator state") : LOOM_OK;
        }
        b.pos += (size_t)len;
    }
    return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "the workers' iterator states in the checkpoint are truncated");
}

static void mw_where(loom_strategy *s, char *buf, size_t n)
{
    multi_worker *mw = s->impl;
    int r = mw_num_replicas(s);
    snprintf(buf, n, "%d worker%s x %d replica%s (multi_worker_mirrored; this is %s), each", mw->workers,
             mw->workers == 1 ? "" : "s", r, r == 1 ? "" : "s", mw->task);
}

static void mw_print_plan(loom_strategy *s, int64_t global_batch, FILE *f)
{
    multi_worker *mw = s->impl;
    int64_t per_worker = global_batch / mw->workers;
    char who[160];
    if (strchr(mw->task, ';')) /* `loom check` without a task */
        snprintf(who, sizeof who, "no task given: planned as rank 0, the chief");
    else
        snprintf(who, sizeof who, "this is %s, rank %d%s", mw->task, mw->rank, mw->rank == 0 ? ", the chief" : "");
    fprintf(f, "strategy: multi_worker_mirrored, %d worker%s (%s), global batch %lld, %lld per worker\n", mw->workers,
            mw->workers == 1 ? "" : "s", who, (long long)global_batch, (long long)per_worker);
    char how[160];
    if (mw->job_ops)
        snprintf(how, sizeof how, "the %s plugin's all-reduce across processes", mw->job_ops->name);
    else
        snprintf(how, sizeof how, "the ring all-reduce of the cluster transport");
    fprintf(f, "  across workers: %s (communication = \"%s\"), %lld floats "
            "per step (the gradients plus %d of agreement: stop, loss, correct, examples, failure); the chief "
            "broadcasts the variables at the start and after a restore\n", how,
            loom_communication_name(s->args->spec->strategy.communication), (long long)(mw->P + TAIL_N), TAIL_N);
    fprintf(f, "  on this worker: ");
    mw->local.ops->print_plan(&mw->local, per_worker, f);
}

/* The other ranks' liveness and the time this rank's collectives waited on each. */
static int mw_peers(loom_strategy *s, loom_peer_info *out, int max)
{
    multi_worker *mw = s->impl;
    return mw->group ? loom_group_peers(mw->group, out, max) : 0;
}

static const loom_strategy_ops multi_worker_ops = {
    .version = LOOM_STRATEGY_OPS_VERSION,
    .name = "multi_worker_mirrored",
    .open = mw_open,
    .close = mw_close,
    .train_step = mw_train_step,
    .eval_step = mw_eval_step,
    .predict = mw_predict,
    .model = mw_model,
    .optimizer = mw_optimizer,
    .sync = mw_sync,
    .num_replicas = mw_num_replicas,
    .caps = LOOM_STRATEGY_OWN_THREADS,
    .print_plan = mw_print_plan,
    .where = mw_where,
    .input_context = mw_input_context,
    .is_chief = mw_is_chief,
    .gather_iter_state = mw_gather_iter_state,
    .pick_iter_state = mw_pick_iter_state,
    .request_stop = mw_request_stop,
    .stop_agreed = mw_stop_agreed,
    .end_of_data = mw_end_of_data,
    .peers = mw_peers,
};

const loom_strategy_ops *loom_multi_worker_ops_(void) { return &multi_worker_ops; }
