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
 * The sharded update (ZeRO-1 across the workers, as mirrored shards it
 * across its replicas): with one replica per worker on the host, one pack,
 * the ring and an optimizer whose update of a range reads only that range
 * (no clip_norm), the all-reduce is split in its halves. The gradients are
 * reduce-scattered (loom_group_reduce_scatter; worker r's shard, on 16-float
 * lines as mirrored's, is the job's sum), each worker applies the optimizer
 * to its own shard of the variables and slots, and the variables are
 * all-gathered (loom_group_all_gather): the bytes of one all-reduce, and
 * the optimizer's work split among the workers instead of repeated by each.
 * The tail rides the reduce-scatter, summed on every worker, so every
 * worker decides alike before the update; a non-finite weight rides the
 * all-gather, so every worker stops on it alike. The update is element-wise
 * on whole lines, so the variables have the bits of the whole update
 * (2 workers = mirrored(2) bit for bit). Each worker's optimizer slots are
 * current in its own shard only: a checkpoint all-gathers them first
 * (mw_gather_iter_state, which every worker calls at the same step). A
 * custom (Lua) step on any worker (the tail says so) gets the whole sum on
 * every worker instead: its shards are all-gathered at once, and every
 * worker applies the whole update. LOOM_SHARDED_UPDATE=0 (on every task)
 * applies the whole update on every worker, as before.
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
 * A custom (Lua) train_step runs part by part (mw_step_part): its
 * all_reduce_gradients is the local sum and this cross-worker all-reduce,
 * with the same tail, so it trains as the built-in step does and 2 workers
 * match mirrored(2) in one process. Every worker's train_step must call
 * all_reduce_gradients once per step; one that does not is found at its
 * next step and stops the job naming the step.
 *
 * Packs (strategy.bytes_per_pack / num_packs; default one) overlap the
 * reduction with the backward pass, as DDP's buckets do: nn calls a hook as
 * each layer's gradients become final (last layer first); mirrored sums
 * each finished pack over the local replicas there, and replica 0 hands it
 * to this strategy's communicator thread, which all-reduces it across the
 * workers while backward goes on for the earlier layers. The last pack (the
 * first layers') carries the tail and goes after the step. The all-reduce
 * calls are the same, in the same order, as reducing the packs after the
 * backward pass (LOOM_OVERLAP=0), so the bits are too; with one pack the step
 * is one all-reduce of P + TAIL_N floats, as before packs existed.
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
 * With a plugin's op (mpi, nccl) the packs are reduced after backward, on
 * the train thread: the libraries are not handed a second thread.
 *
 * strategy.compression = "bf16" | "fp16" (the ring only): each pack's
 * gradients cross the workers as 16 bits (loom_group_all_reduce_wire: half
 * the bytes, summed in float32 at each hop, the same bits on every worker);
 * the tail (stop, loss, counts) stays float32, in an all-reduce of its own.
 * With compression_error_feedback each worker adds last step's rounding
 * error to its gradients before rounding them; the error is each worker's
 * own, and checkpoints keep every worker's after the iterator states
 * (mw_gather_iter_state), so a resumed run continues it bit for bit.
 *
 * strategy.elastic (elastic.c): every worker reads the whole data.train (one
 * input pipeline, the same stream) and trains on its member's slice of each
 * global batch; a step whose all-reduce fails on a lost worker goes through
 * the membership change, then is taken again on the new slices (or, on a
 * member one step behind, was done elsewhere and its state taken).
 *
 * Threads: driven from the train thread, which also drives the group, except
 * that during a step with overlapping packs the communicator thread drives
 * the group's all-reduces (the step waits for it before it returns). */
#include "distribute.h"
#include "elastic_internal.h"
#include "mirrored_internal.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <string.h>

enum { TAIL_STOP, TAIL_LOSS, TAIL_CORRECT, TAIL_EXAMPLES, TAIL_FAILED, TAIL_N };
/* strategy.elastic: the chief adds this to TAIL_STOP (whose sum is otherwise the
 * number of tasks asking to stop) when a task waits to join after the step */
#define JOIN_FLAG 4096.0f
/* the sharded update's tail has one more: the workers running a custom step */
enum { TAIL_CUSTOM = TAIL_N, TAIL_SHARD_N };

#define ITER_STATES_MAGIC 0x5354574du /* "MWTS": every worker's iterator state */
#define EF_MAGIC 0x4645574du          /* "MWEF": then every worker's error feedback */

typedef struct multi_worker {
    loom_strategy  local;      /* mirrored on this worker's replicas */
    bool           local_open;
    loom_group    *group;      /* NULL: one worker (no cluster, or `loom check`) */
    int            workers, rank;
    int64_t        global_batch;
    int64_t        P;
    float         *stage;      /* the all-reduce buffer: g and tail (laid out in mw_open) */
    float         *g, *tail;   /* (P,) replica 0's sum, then the job's; (TAIL_N,) */
    /* packs (strategy.bytes_per_pack / num_packs), all-reduced across the
     * workers one after the other in plan order (the last layers' first);
     * the last carries the tail */
    const loom_pack *packs;
    int            n_packs;
    int            staged;     /* packs copied into g (and announced) during this step's backward */
    /* overlap: the communicator thread all-reduces the packs as the
     * backward pass announces them (LOOM_OVERLAP=0: after it, on the train thread) */
    bool           overlap, thread_started, quit;
    pthread_t      thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int            submitted, reduced; /* packs handed to the thread, and done by it (under mu) */
    int            comm_rc;            /* the first failure of this step's pack all-reduces (under mu) */
    loom_err       comm_err;
    int64_t        packs_early, packs_total; /* announced during backward, and all (the chief logs them) */
    bool           stop_req, stop_seen;
    bool           leave_req;  /* strategy.elastic, a worker: SIGTERM: leave the job before the next step */
    /* a custom (Lua) step: this worker's results (LOSS), and whether the
     * step that ran FORWARD has yet to take part in the all-reduce */
    loom_step_result part_mine;
    bool           reduce_pending;
    int64_t        pending_step;
    char           task[64];   /* "worker:1", for messages */
    const loom_cross_device_ops *job_ops; /* communication = "mpi" | "nccl": the plugin's op; NULL: the ring */
    void          *job_comm;   /* job_ops' state */
    loom_job_args  job_args;   /* what job_open got (valid until job_close) */
    loom_strategy *self;       /* the instance (its failing flag, for job_close) */
    char           comm_where[600];
    char           timeout_where[600]; /* strategy.collective_timeout's file:line */
    /* the sharded update: possible (the config allows it), on (a job of
     * several workers), each worker's shard [off[r], off[r + 1]) of the
     * parameters, and whether this step's g holds the whole sum */
    bool           shardable, shard, whole;
    int64_t       *off;        /* (workers + 1,) */
    loom_wire_fmt  wire;       /* strategy.compression: the gradients' format across workers */
    float         *resid;      /* (P,) compression_error_feedback: this worker's rounding error; NULL: none */
    loom_elastic  *elastic;    /* strategy.elastic: a lost worker is dropped, the others go on (elastic.c) */
    bool           adopted;    /* this step was completed by another member: its state taken, no update here */
    bool           redo;       /* the members changed: take this step again on this member's new slice */
    float          tail_mine[TAIL_N]; /* this step's tail as staged (elastic: reduced again after a loss) */
    bool           want_join;  /* the chief: a task waits to join after this step (elastic.c) */
    bool           join_due;   /* the last step said so: admit it (loom_strategy_elastic_admit) */
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
    /* elastic: every worker reads the whole global batch and trains on its
     * member's slice of it (the slices follow the membership) */
    if (a->spec->strategy.elastic.enabled) ctx->num_input_pipelines = 1, ctx->input_pipeline_id = 0;
    return LOOM_OK;
}

/* communication = "mpi" | "nccl": the plugin's cross-device op of that name
 * with collectives across processes, else an error at the setting. */
static int find_job_op(multi_worker *mw, const loom_strategy_spec *st, loom_err *err)
{
    const char *name = loom_communication_name(st->communication), *origin = NULL;
    loom_loc_str(st->communication_loc.file[0] ? &st->communication_loc : &st->loc, mw->comm_where,
                 sizeof mw->comm_where);
    loom_loc_str(st->collective_timeout_loc.file[0] ? &st->collective_timeout_loc : &st->loc, mw->timeout_where,
                 sizeof mw->timeout_where);
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

/* The bootstrap channel of loom_job_args (boot is the multi_worker): the
 * group's collectives. */
static int boot_broadcast(void *boot, void *buf, size_t len, int root, loom_err *err)
{
    return loom_group_broadcast(((multi_worker *)boot)->group, buf, len, root, err);
}

static int boot_all_gather(void *boot, const void *buf, size_t len, void *out, loom_err *err)
{
    loom_group *g = ((multi_worker *)boot)->group;
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

/* Any thread: whether the group's transport has lost a task (its heartbeats
 * or its connection), for an op's watchdog. */
static int boot_lost(void *boot, loom_err *err)
{
    return loom_net_lost_peer(loom_group_net(((multi_worker *)boot)->group), err) >= 0;
}

/* In job_close: whether the run is ending in failure (loom_strategy_set_failing). */
static int boot_failing(void *boot)
{
    return ((multi_worker *)boot)->self->failing;
}

/* Opens the op's job collectives on every rank, then every rank learns
 * whether all of them could: a failure anywhere stops the whole job now. */
static int open_job_op(multi_worker *mw, const loom_strategy_args *a, loom_err *err)
{
    mw->job_args = (loom_job_args){.size = sizeof(loom_job_args), .rank = mw->rank, .ranks = mw->workers,
                                   .task = mw->task, .where = mw->comm_where,
                                   .timeout_s = a->spec->strategy.collective_timeout, .boot = mw,
                                   .boot_broadcast = boot_broadcast, .boot_all_gather = boot_all_gather,
                                   .timeout_where = mw->timeout_where, .boot_lost = boot_lost,
                                   .boot_failing = boot_failing};
    loom_err own;
    memset(&own, 0, sizeof own);
    int orc = mw->job_ops->job_open(&mw->job_comm, &mw->job_args, &own);
    if (orc && !own.where[0]) snprintf(own.where, sizeof own.where, "%.255s", mw->comm_where);
    uint8_t mine = orc ? 1 : 0, *all = loom_calloc((size_t)mw->workers, 1);
    if (!all) return loom_err_set(err, LOOM_ENOMEM, NULL, "agreeing on communication");
    int rc = boot_all_gather(mw, &mine, 1, all, err);
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

static int start_communicator(multi_worker *mw, loom_err *err);
static int bn_cross(void *arg, float *buf, int64_t n, loom_err *err);
static int reduce_pack(multi_worker *mw, int k, loom_err *err);

/* The tasks train in lock-step from one starting point: each says where it
 * resumes from (loom train's resume_key, "key\0text"), all gathered, so
 * every task sees every other's and all fail at once, naming the tasks that
 * differ from rank 0 and both resume points, instead of parting ways at their
 * first collective (one restores and broadcasts, the other steps). */
static int agree_resume(multi_worker *mw, const loom_strategy_args *a, loom_err *err)
{
    if (!a->resume_key || !a->resume_text) return LOOM_OK;
    loom_buf mine;
    loom_buf_init(&mine);
    loom_buf_put(&mine, a->resume_key, strlen(a->resume_key) + 1);
    loom_buf_put(&mine, a->resume_text, strlen(a->resume_text) + 1);
    loom_buf *all = mine.failed ? NULL : loom_calloc((size_t)mw->workers, sizeof *all);
    if (!all) {
        loom_buf_fini(&mine);
        return loom_err_set(err, LOOM_ENOMEM, NULL, "gathering the tasks' resume points");
    }
    int rc = loom_group_all_gather_bytes(mw->group, mine.data, mine.len, all, err);
    loom_buf_fini(&mine);
    const char *key[2] = {0}, *text[2] = {0};
    char task[2][64], msg[sizeof err->msg];
    size_t len = 0;
    int differ = 0;
    for (int r = 0; r < mw->workers && !rc; r++) {
        const char *k = (const char *)all[r].data, *end = k ? k + all[r].len : NULL;
        const char *tx = k ? memchr(k, 0, all[r].len) : NULL;
        if (!tx || tx + 1 >= end || end[-1]) { /* each rank sent "key\0text\0" */
            rc = loom_err_set(err, LOOM_ENET, NULL, "rank %d sent an unreadable resume point (%zu bytes)", r,
                              all[r].len);
            break;
        }
        int i = r == 0 ? 0 : 1;
        if (r > 0 && !strcmp(k, key[0])) continue;
        const loom_task_addr *ta = loom_cluster_rank_task(a->cluster, r);
        key[i] = k, text[i] = tx + 1;
        if (ta) loom_task_name(ta->role, ta->index, task[i], sizeof task[i]);
        else snprintf(task[i], sizeof task[i], "rank %d", r);
        if (r == 0) continue;
        if (!differ++) len = (size_t)snprintf(msg, sizeof msg, "%s resumes from %s", task[0], text[0]);
        if (len < sizeof msg)
            len += (size_t)snprintf(msg + len, sizeof msg - len, "; %s from %s", task[1], text[1]);
    }
    if (!rc && differ) {
        loom_err_set(err, LOOM_ECHECKPOINT, NULL, "the tasks of the job would start from different points: %s", msg);
        loom_err_hint(err, "every task must resume from the same checkpoint: give them one shared model_dir (with "
                           "its checkpoints), or pass --fresh to every task to start over");
        rc = LOOM_ECHECKPOINT;
    }
    for (int r = 0; r < mw->workers; r++) loom_buf_fini(&all[r]);
    loom_free(all);
    return rc;
}

/* Whether the update can be sharded across the workers (see the top), and
 * the shards: worker r's is lines [L r / n, L (r + 1) / n) of the L 16-float
 * lines of the parameters, as mirrored cuts its replicas' shards. */
static int plan_shards(multi_worker *mw, loom_err *err)
{
    const char *env = getenv("LOOM_SHARDED_UPDATE");
    /* compressed gradients keep the all-reduce of 16-bit segments (the
     * reduce-scatter halves carry float32 only) */
    mw->shardable = mw->workers > 1 && !mw->job_ops && mw->n_packs <= 1 && mw->wire == LOOM_WIRE_F32 &&
                    !mw->local.args->spec->strategy.elastic.enabled &&
                    loom_replicated_shardable_(&mw->local) && !(env && !strcmp(env, "0"));
    if (!mw->shardable) return LOOM_OK;
    mw->off = loom_calloc((size_t)mw->workers + 1, sizeof *mw->off);
    if (!mw->off) return loom_err_set(err, LOOM_ENOMEM, NULL, "planning %d shards", mw->workers);
    int64_t lines = (mw->P + 15) / 16;
    for (int k = 0; k <= mw->workers; k++) {
        int64_t o = lines * k / mw->workers * 16;
        mw->off[k] = o < mw->P ? o : mw->P;
    }
    return LOOM_OK;
}

/* The group across the workers. strategy.elastic: the transport first, then
 * the chief admits every worker (elastic.c): the first ring, or this task
 * entering a running job at a step boundary. */
static int open_group(multi_worker *mw, const loom_strategy_args *a, loom_err *err)
{
    const loom_strategy_spec *st = &a->spec->strategy;
    int rc;
    if (!st->elastic.enabled) {
        if ((rc = loom_group_open(&mw->group, a->cluster, st->collective_timeout, err))) return rc;
        mw->shard = mw->shardable;
        return LOOM_OK;
    }
    if (mw->job_ops) {
        char where[600];
        loom_loc_str(&st->elastic.loc, where, sizeof where);
        return loom_err_set(err, LOOM_EUNSUPPORTED, where, "strategy.elastic: communication = \"%s\" cannot "
                            "change its members while the job runs", mw->job_ops->name),
               loom_err_hint(err, "use communication = \"ring\" (the default on CPU) with strategy.elastic");
    }
    if ((rc = loom_group_open_elastic(&mw->group, a->cluster, st->collective_timeout, loom_elastic_reads_(),
                                      st->elastic.start_timeout, err)) ||
        (rc = loom_elastic_open_(&mw->elastic, mw->group, a->cluster, &st->elastic, mw->task, a->model_dir, err)))
        return rc;
    mw->workers = loom_group_size(mw->group);
    return LOOM_OK;
}

static int mw_open(loom_strategy *s, const loom_strategy_args *a, loom_err *err)
{
    multi_worker *mw = loom_calloc(1, sizeof *mw);
    if (!mw) return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating the multi_worker_mirrored strategy");
    s->impl = mw;
    mw->self = s;
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
    mw->packs = loom_replicated_packs_(&mw->local, &mw->n_packs);
    /* one pack: g then the tail, one all-reduce of P + TAIL_N floats; several:
     * the tail just before g (which stays on a 64-byte line), so the last pack
     * reduced (the first layers', at offset 0) carries it */
    mw->stage = loom_alloc_aligned((size_t)(16 + mw->P + TAIL_SHARD_N) * sizeof(float));
    if (!mw->stage) return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating the all-reduce buffer (%lld floats)",
                                        (long long)(mw->P + TAIL_N));
    LOOM_ASSERT(mw->n_packs >= 1 && mw->packs[mw->n_packs - 1].offset == 0); /* plan order: top of the buffer down */
    if (mw->n_packs <= 1) mw->g = mw->stage, mw->tail = mw->g + mw->P;
    else mw->g = mw->stage + 16, mw->tail = mw->g - TAIL_N;
    if ((st->communication == LOOM_COMM_MPI || st->communication == LOOM_COMM_NCCL) &&
        (rc = find_job_op(mw, st, err)))
        return rc;
    mw->wire = st->compression == LOOM_COMPRESS_BF16 ? LOOM_WIRE_BF16
             : st->compression == LOOM_COMPRESS_FP16 ? LOOM_WIRE_FP16 : LOOM_WIRE_F32;
    if (mw->wire != LOOM_WIRE_F32 && st->compression_error_feedback &&
        !(mw->resid = loom_calloc((size_t)mw->P, sizeof(float))))
        return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating the error feedback (%lld floats)", (long long)mw->P);
    if ((rc = plan_shards(mw, err))) return rc;
    /* (elastic: a job listed with one worker may still grow: n_train_slots) */
    if ((mw->workers == 1 && !(a->cluster && loom_cluster_train_slots(a->cluster) > 1)) || a->plan_only) return LOOM_OK;
    if ((rc = open_group(mw, a, err))) return rc;
    bool joined = loom_elastic_joined_(mw->elastic, NULL, NULL);
    if (!joined && (rc = agree_resume(mw, a, err))) return rc;
    if (mw->job_ops && (rc = open_job_op(mw, a, err))) return rc;
    /* synchronised batch normalization: the local replicas' sums, then across the workers */
    if ((rc = loom_replicated_set_bn_cross_(&mw->local, bn_cross, mw, err))) return rc;
    /* a plugin's op (MPI, NCCL) is driven from the train thread alone: its
     * packs are reduced after backward */
    const char *ov = getenv("LOOM_OVERLAP");
    mw->overlap = mw->n_packs > 1 && !mw->job_ops && !(ov && !strcmp(ov, "0"));
    if (mw->overlap && (rc = start_communicator(mw, err))) return rc;
    /* the chief's initial variables on every worker (they agree already: the same seed);
     * a worker entering a running job gets the members' (and their optimizer slots) */
    loom_optimizer *o = loom_strategy_optimizer(&mw->local);
    if (joined)
        rc = loom_elastic_enter_(mw->elastic, loom_model_params(loom_strategy_model(&mw->local)), mw->P,
                                 loom_optimizer_slots(o), (int64_t)loom_optimizer_num_slots(o) * mw->P, err);
    else
        rc = loom_group_broadcast(mw->group, loom_model_params(loom_strategy_model(&mw->local)),
                                  (size_t)mw->P * sizeof(float), 0, err);
    return rc ? rc : mw->local.ops->sync(&mw->local, err);
}

static void mw_close(loom_strategy *s)
{
    multi_worker *mw = s->impl;
    if (!mw) return;
    if (mw->thread_started) {
        pthread_mutex_lock(&mw->mu);
        mw->quit = true;
        pthread_cond_broadcast(&mw->cv);
        pthread_mutex_unlock(&mw->mu);
        pthread_join(mw->thread, NULL);
        pthread_mutex_destroy(&mw->mu);
        pthread_cond_destroy(&mw->cv);
        if (mw->rank == 0 && mw->packs_total > 0)
            loom_info("multi_worker_mirrored: %lld of %lld pack all-reduces across the workers started while the "
                      "backward pass still ran (%d packs a step)", (long long)mw->packs_early,
                      (long long)mw->packs_total, mw->n_packs);
    }
    if (mw->job_comm) mw->job_ops->job_close(mw->job_comm);
    loom_elastic_free_(mw->elastic);
    loom_group_close(mw->group);
    if (mw->local_open) mw->local.ops->close(&mw->local);
    loom_free(mw->stage);
    loom_free(mw->off);
    loom_free(mw->resid);
    loom_free(mw);
}

/* Pack k's range of the stage: the last pack carries the tail, just before it. */
static float *pack_buf(const multi_worker *mw, int k, int64_t *count)
{
    float *b = mw->g + mw->packs[k].offset;
    *count = mw->packs[k].count;
    if (k == mw->n_packs - 1) b -= TAIL_N, *count += TAIL_N;
    return b;
}

/* The communicator: all-reduces the packs handed to it, in order; after a
 * failure it only counts the rest off (every worker fails the step). It
 * drives the group while a step runs; the train thread drives it between
 * steps (broadcasts, iterator states), never both at once: a step waits for
 * every pack before it returns. */
static void *communicator(void *arg)
{
    multi_worker *mw = arg;
    pthread_mutex_lock(&mw->mu);
    for (;;) {
        while (!mw->quit && mw->reduced == mw->submitted) pthread_cond_wait(&mw->cv, &mw->mu);
        if (mw->quit) break;
        int k = mw->reduced, failed = mw->comm_rc;
        pthread_mutex_unlock(&mw->mu);
        loom_err e;
        int rc = failed ? LOOM_OK : reduce_pack(mw, k, &e);
        pthread_mutex_lock(&mw->mu);
        if (rc && !mw->comm_rc) mw->comm_rc = rc, mw->comm_err = e;
        mw->reduced++;
        pthread_cond_broadcast(&mw->cv);
    }
    pthread_mutex_unlock(&mw->mu);
    return NULL;
}

static int start_communicator(multi_worker *mw, loom_err *err)
{
    pthread_mutex_init(&mw->mu, NULL);
    pthread_cond_init(&mw->cv, NULL);
    if (pthread_create(&mw->thread, NULL, communicator, mw)) {
        pthread_mutex_destroy(&mw->mu);
        pthread_cond_destroy(&mw->cv);
        return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot start the communicator thread");
    }
    mw->thread_started = true;
    return LOOM_OK;
}

static void submit(multi_worker *mw, int upto)
{
    pthread_mutex_lock(&mw->mu);
    if (upto > mw->submitted) mw->submitted = upto;
    pthread_cond_broadcast(&mw->cv);
    pthread_mutex_unlock(&mw->mu);
}

/* loom_replicated_grads_'s announcement (replica 0's thread, during
 * backward): pack k's local sum is final. The last pack waits for the tail. */
static void on_pack_ready(void *arg, int k)
{
    multi_worker *mw = arg;
    if (k != mw->staged || k >= mw->n_packs - 1) return;
    const loom_pack *p = &mw->packs[k];
    memcpy(mw->g + p->offset, loom_replicated_grads0_(&mw->local) + p->offset, (size_t)p->count * sizeof(float));
    mw->staged = k + 1;
    mw->packs_early++;
    submit(mw, mw->staged);
}

/* A step's all-reduces across the workers: one of P + TAIL_N floats with one
 * pack; with several, pack by pack in plan order, on the communicator
 * (handing it what backward did not) or here: the same calls either way. */
static int cross_all_reduce(multi_worker *mw, float *buf, int64_t count, loom_err *err)
{
    return mw->job_ops ? mw->job_ops->job_all_reduce(mw->job_comm, buf, count, LOOM_REDUCE_SUM, err)
                       : loom_group_all_reduce(mw->group, buf, count, err);
}

/* Synchronised batch normalization's sums across the workers (replica 0's
 * thread, during a step's forward or backward: no pack is in flight then,
 * as a model with batch normalization announces its packs after backward). */
static int bn_cross(void *arg, float *buf, int64_t n, loom_err *err) { return cross_all_reduce(arg, buf, n, err); }

/* Pack k across the workers (with one pack: g and the tail): float32, or
 * with strategy.compression the gradients in 16 bits (after adding in the
 * error feedback) and the tail apart in float32. */
static int reduce_pack(multi_worker *mw, int k, loom_err *err)
{
    int64_t count, off = mw->n_packs <= 1 ? 0 : mw->packs[k].offset;
    float *b = mw->n_packs <= 1 ? mw->stage : pack_buf(mw, k, &count);
    if (mw->n_packs <= 1) count = mw->P + TAIL_N;
    if (mw->wire == LOOM_WIRE_F32 || mw->job_ops) return cross_all_reduce(mw, b, count, err);
    bool last = k == mw->n_packs - 1;
    float *grads = mw->n_packs > 1 && last ? b + TAIL_N : b;
    int64_t n = last ? count - TAIL_N : count;
    if (mw->resid) loom_wire_feedback(mw->wire, grads, mw->resid + off, n);
    int rc = loom_group_all_reduce_wire(mw->group, grads, n, mw->wire, err);
    return rc || !last ? rc : loom_group_all_reduce(mw->group, mw->tail, TAIL_N, err);
}

static int all_reduce_packs(multi_worker *mw, loom_err *err)
{
    if (mw->n_packs <= 1) return reduce_pack(mw, 0, err);
    mw->packs_total += mw->n_packs;
    if (!mw->overlap) {
        for (int k = 0; k < mw->n_packs; k++) {
            int rc = reduce_pack(mw, k, err);
            if (rc) return rc;
        }
        return LOOM_OK;
    }
    submit(mw, mw->n_packs);
    pthread_mutex_lock(&mw->mu);
    while (mw->reduced < mw->n_packs) pthread_cond_wait(&mw->cv, &mw->mu);
    int rc = mw->comm_rc;
    if (rc) *err = mw->comm_err;
    mw->submitted = mw->reduced = 0, mw->comm_rc = 0;
    pthread_mutex_unlock(&mw->mu);
    return rc;
}

/* Before a step: nothing staged; the communicator idle (it finished the last step's packs). */
static void begin_step(multi_worker *mw)
{
    mw->staged = 0;
    if (mw->overlap) loom_replicated_set_pack_ready_(&mw->local, on_pack_ready, mw);
}

/* strategy.elastic: this step's all-reduce failed on a lost worker. The
 * members left agree (elastic.c) and re-form the ring; a member the step
 * completed elsewhere takes that state (adopted: no update here), one at
 * the frontier takes the step again (redo) on its slice of the same global
 * batch under the new membership, so the lost member's examples are not lost. */
static int elastic_go_on(multi_worker *mw, int64_t step, loom_step_result *out, loom_err *err)
{
    const float *tail0 = mw->tail_mine;
    loom_err fail = *err;
    /* this member's stop request (a SIGINT) rode the failed step, which cleared it: it rides the
     * step taken again (or the next), else the loss eats it and launch SIGKILLs after --grace */
    float stop = tail0[TAIL_STOP] >= JOIN_FLAG ? tail0[TAIL_STOP] - JOIN_FLAG : tail0[TAIL_STOP];
    if (stop > 0) mw->stop_req = true;
    loom_optimizer *o = loom_strategy_optimizer(&mw->local);
    int64_t ns = (int64_t)loom_optimizer_num_slots(o) * mw->P;
    loom_elastic_outcome oc;
    int rc = loom_elastic_recover_(mw->elastic, step, loom_model_params(loom_strategy_model(&mw->local)), mw->P,
                                   loom_optimizer_slots(o), ns, &fail, &oc, err);
    if (!rc) rc = mw->local.ops->sync(&mw->local, err);
    if (rc) return rc;
    mw->workers = oc.workers;
    if (oc.stop) mw->stop_seen = true;
    if (oc.join) mw->want_join = true; /* rides this step (taken again) or the next: then they enter */
    if (oc.redo) {
        mw->redo = true; /* mw_step takes the step again on this member's new slice (a new loss: again) */
        return LOOM_OK;
    }
    mw->adopted = true;
    /* the member that finished the step summed this request into its tail: it stops after it, so do we */
    if (stop > 0) mw->stop_seen = true, mw->stop_req = false;
    out->loss_sum = tail0[TAIL_LOSS], out->correct = (int64_t)tail0[TAIL_CORRECT];
    out->examples = (int64_t)tail0[TAIL_EXAMPLES];
    return LOOM_OK;
}

/* The cross-worker half of a step: this worker's local sum (in replica 0's
 * buffer; lrc: its computation failed, zeros go instead) and results ride
 * the all-reduce with the tail; *out gets the job's results and g (the
 * stage) the job's gradients, rescaled for a short global batch. Packs
 * staged during backward are already on their way. */
/* The sharded update's first half: the reduce-scatter of g (this worker's
 * shard becomes the job's sum) with the tail, summed on every worker. A
 * custom step on any worker (TAIL_CUSTOM) needs the whole sum on every
 * worker: the shards are all-gathered at once (the all-reduce's bits), with
 * the float the built-in step's all-gather of the variables carries, so the
 * two pair up when the workers differ (one whose input ended runs the
 * built-in step). Every worker takes the same branch: the tail is the same. */
static int scatter_across(multi_worker *mw, bool custom, loom_err *err)
{
    mw->tail[TAIL_CUSTOM] = custom ? 1.0f : 0.0f;
    int rc = loom_group_reduce_scatter(mw->group, mw->g, mw->off, mw->tail, TAIL_SHARD_N, err);
    mw->whole = !rc && mw->tail[TAIL_CUSTOM] > 0;
    if (!mw->whole || mw->tail[TAIL_FAILED] > 0) return rc;
    float none = 0;
    return loom_group_all_gather(mw->group, mw->g, mw->off, &none, 1, err);
}

static int reduce_across(multi_worker *mw, int lrc, const loom_err *lerr, const loom_step_result *mine, int64_t step,
                         bool custom, loom_step_result *out, loom_err *err)
{
    float *g = mw->g, *tail = mw->tail;
    if (mw->overlap) loom_replicated_set_pack_ready_(&mw->local, NULL, NULL);
    /* packs are in plan order from the top of the buffer down: the unstaged ones are [0, from) */
    int64_t from = mw->staged ? mw->packs[mw->staged].offset + mw->packs[mw->staged].count : mw->P;
    if (lrc) memset(g, 0, (size_t)from * sizeof(float));
    else memcpy(g, loom_replicated_grads0_(&mw->local), (size_t)from * sizeof(float));
    tail[TAIL_STOP] = (mw->stop_req ? 1.0f : 0.0f) + (mw->want_join ? JOIN_FLAG : 0.0f);
    tail[TAIL_LOSS] = (float)mine->loss_sum;
    tail[TAIL_CORRECT] = (float)mine->correct;
    tail[TAIL_EXAMPLES] = (float)mine->examples;
    tail[TAIL_FAILED] = lrc ? 1.0f : 0.0f;
    mw->stop_req = false;
    mw->staged = 0;
    mw->whole = true;
    mw->adopted = false;
    memcpy(mw->tail_mine, tail, sizeof mw->tail_mine);
    if (mw->group) {
        int rc = mw->shard ? scatter_across(mw, custom, err) : all_reduce_packs(mw, err);
        if (rc && !lrc && mw->elastic && rc == LOOM_ENET) rc = elastic_go_on(mw, step, out, err);
        if (rc == LOOM_OK && (mw->adopted || mw->redo)) return LOOM_OK;
        if (rc) {
            if (lrc) *err = *lerr; /* this worker's own failure explains it better */
            return lrc ? lrc : rc;
        }
    }
    if (lrc) {
        *err = *lerr;
        return lrc;
    }
    if (tail[TAIL_FAILED] > 0)
        return loom_err_set(err, LOOM_ENET, NULL, "step %lld failed on another worker of the job (see its log); "
                            "%s stops with it", (long long)step + 1, mw->task),
               loom_err_hint(err, "fix what that worker reports, then run the job again: it resumes from the last "
                             "checkpoint");
    /* sticky: a request carried by a step without examples (every input had
     * ended: the epoch ends first) still stops the job after its next step */
    if (tail[TAIL_STOP] >= JOIN_FLAG) mw->join_due = true, tail[TAIL_STOP] -= JOIN_FLAG;
    if (tail[TAIL_STOP] > 0) mw->stop_seen = true;
    out->loss_sum = tail[TAIL_LOSS];
    out->correct = (int64_t)tail[TAIL_CORRECT];
    out->examples = (int64_t)tail[TAIL_EXAMPLES];
    if (out->examples > 0 && out->examples != mw->global_batch) { /* a short global batch: the losses over its own size */
        float k = (float)((double)mw->global_batch / (double)out->examples);
        int64_t lo = mw->whole ? 0 : mw->off[mw->rank], hi = mw->whole ? mw->P : mw->off[mw->rank + 1];
        for (int64_t i = lo; i < hi; i++) g[i] *= k;
    }
    return LOOM_OK;
}

/* The sharded update's second half: this worker's shard of the variables
 * (and slots) with the job's summed gradients, then every worker's shard
 * to every worker, with whether an update left a non-finite weight. */
static int apply_shard(multi_worker *mw, int64_t step, loom_err *err)
{
    loom_optimizer *opt = mw->local.ops->optimizer(&mw->local);
    loom_replicated_apply_range_(&mw->local, mw->g, step, mw->off[mw->rank], mw->off[mw->rank + 1]);
    float nonfinite = loom_optimizer_take_nonfinite(opt) ? 1.0f : 0.0f;
    int rc = loom_group_all_gather(mw->group, loom_model_params(mw->local.ops->model(&mw->local)), mw->off,
                                   &nonfinite, 1, err);
    if (nonfinite > 0) loom_optimizer_mark_nonfinite(opt);
    return rc;
}

/* One step of the job: this worker's gradients (batch NULL: none), the
 * all-reduce across workers with the tail, the update (sharded or whole). */
static int mw_step(loom_strategy *s, const loom_elem *batch, int64_t step, loom_step_result *out, loom_err *err)
{
    multi_worker *mw = s->impl;
    if (loom_elastic_step_(mw->elastic, step)) mw->stop_req = true;
    if (mw->leave_req) loom_elastic_leave_(mw->elastic, step);
    mw->want_join = loom_elastic_want_join_(mw->elastic, step);
    for (;;) {
        loom_step_result mine = {0};
        loom_err lerr;
        loom_elem part;
        const loom_elem *b = batch;
        int lrc = LOOM_OK;
        /* elastic: every worker has the global batch; this member trains on its slice */
        if (mw->elastic && batch) {
            lrc = loom_batch_split(batch, loom_group_size(mw->group), loom_group_rank(mw->group), &part, &lerr);
            b = !lrc && part.t[0].shape.dim[0] == 0 ? NULL : &part; /* a short batch may leave this member none */
        }
        begin_step(mw);
        if (!lrc) lrc = loom_replicated_grads_(&mw->local, b, step, &mine, &lerr);
        mw->redo = false;
        int rc = reduce_across(mw, lrc, &lerr, &mine, step, false, out, err);
        if (rc) return rc;
        if (mw->redo) continue;
        if (mw->elastic && b) loom_elastic_trained_(mw->elastic, b, s->args->input_idx, step);
        if (out->examples == 0 || mw->adopted) return LOOM_OK; /* every input had ended, or the step was done elsewhere */
        return mw->whole ? loom_replicated_apply_(&mw->local, mw->g, step, err) : apply_shard(mw, step, err);
    }
}

static int mw_train_step(loom_strategy *s, const loom_elem *batch, int64_t step, loom_step_result *out, loom_err *err)
{
    memset(out, 0, sizeof *out);
    return mw_step(s, batch, step, out, err);
}

static int settle_pending(multi_worker *mw, loom_err *err);

static int mw_end_of_data(loom_strategy *s, int64_t step, loom_step_result *out, bool *all_ended, loom_err *err)
{
    multi_worker *mw = s->impl;
    *all_ended = true;
    if (!mw->group) return LOOM_OK;
    int rc = settle_pending(mw, err);
    if (!rc) rc = mw_step(s, NULL, step, out, err);
    *all_ended = !rc && out->examples == 0;
    return rc;
}

/* ---- custom training steps (a Lua train_step) ------------------------------------------ */

/* A custom step that ran FORWARD in step `pending_step` but never called
 * all_reduce_gradients: the other workers wait in that step's all-reduce.
 * It takes part now, carrying the failure flag, so every worker stops
 * naming the step instead of pairing this worker's next all-reduce with
 * that one. */
static int settle_pending(multi_worker *mw, loom_err *err)
{
    if (!mw->reduce_pending) return LOOM_OK;
    mw->reduce_pending = false;
    loom_err lerr;
    loom_err_set(&lerr, LOOM_ELUA, NULL, "the custom train_step did not call ctx:all_reduce_gradients() in step %lld: "
                 "under multi_worker_mirrored every worker's train_step must call it once per step (the other workers "
                 "wait for it)", (long long)mw->pending_step + 1);
    loom_err_hint(&lerr, "call ctx:all_reduce_gradients() in every step, on every worker; decide to skip an update "
                  "from values every worker shares (after the all-reduce)");
    loom_step_result none = {0}, out;
    return reduce_across(mw, LOOM_ELUA, &lerr, &none, mw->pending_step, true, &out, err);
}

/* FORWARD, LOSS, BACKWARD and APPLY are mirrored's on this worker's
 * replicas; ALL_REDUCE sums the gradients over them, then across the
 * workers (the tail with them, as in the built-in step: stop, results,
 * failure), and every local replica's buffer gets the job's sum, so a clip
 * after it and APPLY see what every worker sees. per_replica[0] gets the
 * job's results at ALL_REDUCE (the others zero): the step's result is the
 * job's, as the built-in step reports it. */
static int mw_step_part(loom_strategy *s, loom_step_part part, const loom_elem *batch, int64_t step,
                        loom_step_result *per_replica, loom_err *err)
{
    multi_worker *mw = s->impl;
    int nloc = mw->local.ops->num_replicas(&mw->local), rc;
    if (part == LOOM_PART_FORWARD) {
        if (mw->reduce_pending && mw->pending_step != step && (rc = settle_pending(mw, err))) return rc;
        mw->reduce_pending = true;
        mw->pending_step = step;
    }
    if (part != LOOM_PART_ALL_REDUCE) {
        rc = mw->local.ops->step_part(&mw->local, part, batch, step, per_replica, err);
        if (!rc && part == LOOM_PART_LOSS) {
            memset(&mw->part_mine, 0, sizeof mw->part_mine);
            for (int r = 0; r < nloc; r++) {
                mw->part_mine.loss_sum += per_replica[r].loss_sum;
                mw->part_mine.correct += per_replica[r].correct;
                mw->part_mine.examples += per_replica[r].examples;
            }
        }
        return rc;
    }
    mw->reduce_pending = false;
    loom_err lerr;
    int lrc = mw->local.ops->step_part(&mw->local, part, batch, step, per_replica, &lerr);
    loom_step_result job = {0};
    if ((rc = reduce_across(mw, lrc, &lerr, &mw->part_mine, step, true, &job, err))) return rc;
    for (int r = 0; r < nloc; r++) {
        memcpy(loom_model_grads(mw->local.ops->replica(&mw->local, r)), mw->g, (size_t)mw->P * sizeof(float));
        memset(&per_replica[r], 0, sizeof per_replica[r]);
    }
    per_replica[0] = job;
    return LOOM_OK;
}

static loom_model *mw_replica(loom_strategy *s, int r)
{
    multi_worker *mw = s->impl;
    return mw->local.ops->replica(&mw->local, r);
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
/* A signal: the job stops after the next step; under strategy.elastic a
 * worker (not the chief) given SIGTERM leaves it instead (the others go on). */
static void mw_request_stop(loom_strategy *s)
{
    multi_worker *mw = s->impl;
    if (mw->elastic && mw->rank != 0 && loom_stop_signal() == SIGTERM) mw->leave_req = true;
    else mw->stop_req = true;
}
static bool mw_stop_agreed(loom_strategy *s) { return ((multi_worker *)s->impl)->stop_seen; }

/* The sharded update leaves each worker's optimizer slots current in its
 * own shard: every shard to every worker (the chief writes them). */
static int gather_slots(multi_worker *mw, loom_err *err)
{
    loom_optimizer *o = mw->local.ops->optimizer(&mw->local);
    float *slots = loom_optimizer_slots(o);
    for (int k = 0; k < loom_optimizer_num_slots(o); k++) {
        int rc = loom_group_all_gather(mw->group, slots + (int64_t)k * mw->P, mw->off, NULL, 0, err);
        if (rc) return loom_err_prefix(err, "gathering the optimizer's %s slots for the checkpoint",
                                       loom_optimizer_slot_name(o, k));
    }
    return LOOM_OK;
}

/* Every worker's piece (its iterator state, or its error feedback), in
 * rank order: per worker u64 length and the bytes. */
static int gather_pieces(multi_worker *mw, const void *data, size_t len, loom_buf *stored, loom_err *err)
{
    loom_buf *all = loom_calloc((size_t)mw->workers, sizeof *all);
    if (!all) return loom_err_set(err, LOOM_ENOMEM, NULL, "gathering %d workers' states", mw->workers);
    for (int r = 0; r < mw->workers; r++) loom_buf_init(&all[r]);
    int rc = loom_group_all_gather_bytes(mw->group, data, len, all, err);
    for (int r = 0; !rc && r < mw->workers; r++) {
        loom_buf_put_i64(stored, (int64_t)all[r].len);
        loom_buf_put(stored, all[r].data, all[r].len);
    }
    for (int r = 0; r < mw->workers; r++) loom_buf_fini(&all[r]);
    loom_free(all);
    return rc;
}

/* Every worker's iterator state, in rank order: u32 magic, u32 workers,
 * then per worker u64 length and the bytes; with error feedback then u32
 * EF_MAGIC, u32 wire format and per worker u64 length and its P floats
 * (each worker's own rounding error: a resumed run continues it; readers
 * that predate it stop before it). One worker stores its own iterator state
 * as it is, as one process does. With the sharded update, the optimizer's
 * slots are gathered first (this is called at every checkpoint, on every
 * worker at the same step). */
static int mw_gather_iter_state(loom_strategy *s, const loom_buf *mine, loom_buf *stored, loom_err *err)
{
    multi_worker *mw = s->impl;
    loom_buf_init(stored);
    if (!mw->group) {
        loom_buf_put(stored, mine->data, mine->len);
        return stored->failed ? loom_err_set(err, LOOM_ENOMEM, NULL, "copying the iterator state") : LOOM_OK;
    }
    if (mw->shard) {
        int rc = gather_slots(mw, err);
        if (rc) return rc;
    }
    loom_buf_put_u32(stored, ITER_STATES_MAGIC);
    loom_buf_put_u32(stored, (uint32_t)mw->workers);
    int rc = gather_pieces(mw, mine->data, mine->len, stored, err);
    if (!rc && mw->resid) {
        loom_buf_put_u32(stored, EF_MAGIC);
        loom_buf_put_u32(stored, (uint32_t)mw->wire);
        rc = gather_pieces(mw, mw->resid, (size_t)mw->P * sizeof(float), stored, err);
    }
    if (!rc && stored->failed) rc = loom_err_set(err, LOOM_ENOMEM, NULL, "packing %d iterator states", mw->workers);
    return rc;
}

/* After the iterator states (b at their end): this worker's error feedback
 * when the checkpoint has it, else it starts at zero (a checkpoint written
 * without compression_error_feedback, or before it was kept). */
static int pick_feedback(multi_worker *mw, loom_buf *b, uint32_t n, loom_err *err)
{
    memset(mw->resid, 0, (size_t)mw->P * sizeof(float));
    if (b->len - b->pos < 8 || loom_buf_get_u32(b) != EF_MAGIC) {
        loom_warn("%s: the checkpoint holds no error feedback (written without compression_error_feedback): "
                  "it starts at zero", mw->task);
        return LOOM_OK;
    }
    (void)loom_buf_get_u32(b); /* the wire format it was rounded for */
    for (int r = 0; r < (int)n && !b->failed; r++) {
        int64_t len = loom_buf_get_i64(b);
        if (b->failed || len < 0 || (uint64_t)len > b->len - b->pos) break;
        if (r == mw->rank) {
            if (len != mw->P * (int64_t)sizeof(float))
                return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "the checkpoint's error feedback of %s holds %lld "
                                    "floats, the model has %lld parameters", mw->task,
                                    (long long)(len / (int64_t)sizeof(float)), (long long)mw->P);
            memcpy(mw->resid, b->data + b->pos, (size_t)len);
            return LOOM_OK;
        }
        b->pos += (size_t)len;
    }
    if (!b->failed && mw->rank >= (int)n) return LOOM_OK; /* elastic: a member the checkpoint did not have */
    return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "the workers' error feedback in the checkpoint is truncated");
}

static int mw_pick_iter_state(loom_strategy *s, const loom_buf *stored, loom_buf *mine, loom_err *err)
{
    multi_worker *mw = s->impl;
    loom_buf_init(mine);
    loom_buf b = *stored;
    b.pos = 0;
    b.failed = 0;
    uint32_t magic = stored->len >= 8 ? loom_buf_get_u32(&b) : 0;
    bool same = mw->elastic || s->args->spec->strategy.elastic.enabled; /* elastic: every worker reads the same stream */
    if (magic != ITER_STATES_MAGIC) { /* a checkpoint of one process */
        if (mw->workers > 1 && !same)
            return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "the checkpoint was written by a run of one process, "
                                "this job has %d workers: its input position cannot be split among them",
                                mw->workers),
                   loom_err_hint(err, "resume it with one process (loom train without a cluster), or pass --fresh");
        loom_buf_put(mine, stored->data, stored->len);
        return mine->failed ? loom_err_set(err, LOOM_ENOMEM, NULL, "copying the iterator state") : LOOM_OK;
    }
    uint32_t n = loom_buf_get_u32(&b);
    int want = same ? 0 : mw->rank; /* elastic: the states are the same; the first serves any number of workers */
    if (!b.failed && (int)n != mw->workers && !same)
        return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "the checkpoint was written by a job of %u worker%s, this "
                            "job has %d: each worker resumes its own input position", n, n == 1 ? "" : "s",
                            mw->workers),
               loom_err_hint(err, "run the job with %u workers to resume it, or pass --fresh to start over", n);
    int r = 0;
    for (; r < (int)n && !b.failed; r++) {
        int64_t len = loom_buf_get_i64(&b);
        if (b.failed || len < 0 || (uint64_t)len > b.len - b.pos) break;
        if (r == want) loom_buf_put(mine, b.data + b.pos, (size_t)len);
        b.pos += (size_t)len;
    }
    if (r < (int)n || want >= (int)n)
        return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "the workers' iterator states in the checkpoint are truncated");
    if (mine->failed) return loom_err_set(err, LOOM_ENOMEM, NULL, "copying the iterator state");
    return mw->resid ? pick_feedback(mw, &b, n, err) : LOOM_OK;
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
    if (mw->shardable)
        fprintf(f, "  across workers: a sharded update over the ring of the cluster transport (communication = \"%s\"): "
                "the %lld gradients reduce-scattered (with %d floats of agreement summed on every worker: stop, loss, "
                "correct, examples, failure, custom step), each worker updates its 1/%d of the variables and optimizer "
                "slots, the variables all-gathered (the bytes of one all-reduce); checkpoints gather the slots; the "
                "chief broadcasts the variables at the start and after a restore\n",
                loom_communication_name(s->args->spec->strategy.communication), (long long)mw->P, TAIL_SHARD_N,
                mw->workers);
    else
        fprintf(f, "  across workers: %s (communication = \"%s\"), %lld floats "
                "per step (the gradients plus %d of agreement: stop, loss, correct, examples, failure); the chief "
                "broadcasts the variables at the start and after a restore\n", how,
                loom_communication_name(s->args->spec->strategy.communication), (long long)(mw->P + TAIL_N), TAIL_N);
    if (mw->wire != LOOM_WIRE_F32)
        fprintf(f, "  compression = \"%s\": the gradients cross as 16 bits (half the bytes), summed in float32 at "
                "each hop; the %d floats of agreement in float32 apart%s\n",
                loom_grad_compression_name(s->args->spec->strategy.compression), TAIL_N,
                mw->resid ? "; with error feedback (each worker's rounding error joins its next step)" : "");
    const loom_elastic_spec *el = &s->args->spec->strategy.elastic;
    if (el->enabled)
        fprintf(f, "  elastic: a worker lost is dropped at the next step boundary and the others go on (the chief "
                "must live); below %d worker%s the job stops with a checkpoint; every worker reads the whole "
                "data.train and trains on its member's slice of each global batch\n", el->min_workers,
                el->min_workers == 1 ? "" : "s");
    if (mw->n_packs > 1)
        fprintf(f, "  in %d packs (strategy.bytes_per_pack / num_packs), each all-reduced across the workers as soon as "
                "backward has finished it, the last layers' first, on a communicator thread (LOOM_OVERLAP=0: after "
                "backward); the same bits either way\n", mw->n_packs);
    fprintf(f, "  on this worker: ");
    mw->local.ops->print_plan(&mw->local, per_worker, f);
}

/* The other ranks' liveness and the time this rank's collectives waited on each. */
static int mw_peers(loom_strategy *s, loom_peer_info *out, int max)
{
    multi_worker *mw = s->impl;
    return mw->group ? loom_group_peers(mw->group, out, max) : 0;
}

/* Every training task (the chief and the workers, at least one of them)
 * holds the variables; an evaluator may watch the job. */
static const loom_cluster_roles multi_worker_roles = {
    .use = {[LOOM_ROLE_PS] = LOOM_ROLE_REFUSED},
    .hint = {[LOOM_ROLE_PS] = "remove the ps tasks (variables are mirrored on every worker), or use parameter_server"},
};

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
    .step_part = mw_step_part,
    .replica = mw_replica,
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
    .roles = &multi_worker_roles,
};

const loom_strategy_ops *loom_multi_worker_ops_(void) { return &multi_worker_ops; }

/* strategy.elastic, between the trainer and multi_worker (distribute.h). */
const loom_buf *loom_strategy_elastic_joined(loom_strategy *s, int64_t *step)
{
    const loom_buf *state = NULL;
    if (!s || s->ops != &multi_worker_ops || !s->impl) return NULL;
    return loom_elastic_joined_(((multi_worker *)s->impl)->elastic, step, &state) ? state : NULL;
}

int loom_strategy_elastic_admit(loom_strategy *s, int64_t done, loom_train_state_fn save, void *arg, loom_err *err)
{
    if (!s || s->ops != &multi_worker_ops || !s->impl) return LOOM_OK;
    multi_worker *mw = s->impl;
    if (!mw->elastic || !mw->join_due) return LOOM_OK;
    mw->join_due = false;
    loom_buf state;
    loom_buf_init(&state);
    int rc = mw->rank == 0 ? save(arg, &state, err) : LOOM_OK;
    loom_optimizer *o = loom_strategy_optimizer(&mw->local);
    if (!rc)
        rc = loom_elastic_admit_(mw->elastic, done, &state, loom_model_params(loom_strategy_model(&mw->local)), mw->P,
                                 loom_optimizer_slots(o), (int64_t)loom_optimizer_num_slots(o) * mw->P, &mw->workers,
                                 err);
    loom_buf_fini(&state);
    return rc ? rc : mw->local.ops->sync(&mw->local, err);
}
