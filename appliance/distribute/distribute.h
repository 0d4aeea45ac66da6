/* distribute.h - distribution strategies and cross-device ops.
 *
 * A strategy owns the replicas (one model per replica, each with its flat
 * parameter and gradient buffers), splits each global batch among them,
 * reduces their gradients with a cross-device op and applies the update.
 * The trainer talks only to this interface. Both strategies and
 * cross-device ops are vtables found by name in the shared registry (core.h)
 * that built-ins and plugins register into.
 *
 * Loss scaling (tf.distribute): each replica's gradient is that of the sum of
 * its per-example losses divided by the GLOBAL batch size, so the SUM over
 * replicas equals one device's gradient on the whole batch.
 *
 * Threads: a strategy is driven from the train thread; it may run replicas
 * on threads of its own. */
#ifndef LOOM_DISTRIBUTE_H
#define LOOM_DISTRIBUTE_H

#include "cluster/cluster.h"
#include "data/data.h"
#include "nn/nn.h"

/* ---- cross-device ops ---------------------------------------------------- */

typedef enum { LOOM_REDUCE_SUM, LOOM_REDUCE_MEAN, LOOM_REDUCE_MAX } loom_redop;

/* What job_open gets: this rank, the job, and a bootstrap channel over Loom's
 * own cluster transport (already connected and authenticated), for what the
 * op's library needs exchanged before it can talk (NCCL's unique id). */
typedef struct loom_job_args {
    uint32_t    size;      /* sizeof at Loom's build: fields past it are absent */
    int         rank;      /* this process among the training ranks, 0 (the chief) .. ranks - 1 */
    int         ranks;
    const char *task;      /* "worker:1", for messages */
    const char *where;     /* strategy.communication's file:line (or --set), for errors */
    double      timeout_s; /* strategy.collective_timeout, 0 = none */
    void       *boot;      /* Loom's; pass it to the functions below */
    /* root's len bytes into every other rank's buf (every rank calls it). */
    int (*boot_broadcast)(void *boot, void *buf, size_t len, int root, loom_err *err);
    /* Every rank's len bytes, in rank order, into out (ranks * len bytes). */
    int (*boot_all_gather)(void *boot, const void *buf, size_t len, void *out, loom_err *err);
    /* ---- appended (present when size reaches them) ---- */
    const char *timeout_where; /* strategy.collective_timeout's file:line (or --set, or the strategy's
                                  section when it is not set), for errors */
    /* Any thread, until job_close: nonzero when Loom's transport has lost a
     * task of the job (heartbeats or connection), err naming it. */
    int (*boot_lost)(void *boot, loom_err *err);
    /* At job_close: nonzero when this task is ending in failure (its run
     * failed or was interrupted), so the op must not wait for the other ranks
     * on the way out (MPI_Finalize, ncclCommDestroy would): they may be
     * stopped, or waiting in a collective this task will never join. */
    int (*boot_failing)(void *boot);
} loom_job_args;

typedef struct loom_cross_device_ops {
    uint32_t    version; /* LOOM_CROSS_DEVICE_OPS_VERSION; append fields only */
    const char *name;    /* "reduce_to_one_device", "ring", a plugin's name */
    /* bufs[0..n) each hold count floats; afterwards each holds the reduction. */
    int (*all_reduce)(float *const *bufs, int n, int64_t count, loom_redop op, loom_err *err);
    /* bufs[root] copied into every other buffer. */
    int (*broadcast)(float *const *bufs, int n, int64_t count, int root, loom_err *err);
    /* (optional) out = concat(bufs[0..n)), each count floats; NULL => generic copy */
    int (*all_gather)(float *const *bufs, int n, int64_t count, float *out, loom_err *err);
    /* ---- version 2 (appended; read only when version >= 2) ----
     * (optional) Collectives that each of n ranks calls from its own thread
     * (see loom_xcomm below). NULL comm_new => the generic rendezvous: the
     * last rank to arrive runs the N-buffer entry point for all. */
    void *(*comm_new)(int n, loom_err *err); /* state the n ranks share; NULL + err on failure */
    void  (*comm_free)(void *comm);
    int   (*all_reduce_rank)(void *comm, int rank, float *buf, int64_t count, loom_redop op, loom_err *err);
    int   (*broadcast_rank)(void *comm, int rank, float *buf, int64_t count, int root, loom_err *err);
    /* (optional) out (n * count floats, one per rank) = concat of every rank's buf */
    int   (*all_gather_rank)(void *comm, int rank, const float *buf, int64_t count, float *out, loom_err *err);
    /* ---- version 3 (appended; read only when version >= 3: use loom_xops_memory) ---- */
    uint32_t caps; /* LOOM_XOPS_*_MEM: the memory its buffers may be in; neither flag = host memory */
    /* ---- version 4 (appended; read only when version >= 4: use loom_xops_job) ----
     * (optional: all three or none) Collectives across the processes of a
     * job: every training rank (one process each) calls them from its train
     * thread, in the same order with the same arguments (multi_worker_mirrored
     * with strategy.communication naming the op). buf is host memory. An op
     * with them may leave all_reduce and broadcast NULL: it then reduces
     * across processes only, and strategy.cross_device_ops refuses it. */
    int  (*job_open)(void **comm, const loom_job_args *a, loom_err *err); /* close even after a failure */
    void (*job_close)(void *comm); /* NULL is a no-op */
    /* buf (count floats) becomes the reduction over the ranks, with the same bits on every rank. */
    int  (*job_all_reduce)(void *comm, float *buf, int64_t count, loom_redop op, loom_err *err);
} loom_cross_device_ops;
/* 2 added the per-rank collectives, 3 caps, 4 the job's collectives; versions 1 to 3 still register. */
#define LOOM_CROSS_DEVICE_OPS_VERSION 4

#define LOOM_XOPS_HOST_MEM   1u /* buffers in host memory: CPU replicas (every built-in op) */
#define LOOM_XOPS_DEVICE_MEM 2u /* buffers in device memory: replicas on a device backend (the nccl plugin's op) */

/* x's job collectives, or NULL when x has none (version < 4 or no job_open). */
const loom_cross_device_ops *loom_xops_job(const loom_cross_device_ops *x);

/* The memory x works on: LOOM_XOPS_HOST_MEM and/or LOOM_XOPS_DEVICE_MEM,
 * never neither (an op that declares no memory works on host memory). A
 * strategy refuses an op that cannot work where its replicas' buffers are
 * when it opens (loom_strategy_open does so for CPU replicas run natively);
 * mirrored and central_storage reduce device replicas' gradients in device
 * memory with an op that has LOOM_XOPS_DEVICE_MEM. */
unsigned loom_xops_memory(const loom_cross_device_ops *x);

/* A communicator: n ranks of one cross-device op, each on its own thread
 * (a replica's), calling the same collectives in the same order with the
 * same count, op and root. All n must run concurrently: a rank waits inside a
 * collective until the others arrive (sleeping, not spinning), so n replicas
 * driven by loom_pool_run need a pool of at least n threads. A collective
 * returns on a rank once no other rank still reads its buffer. For one op the
 * result is bit-identical on every rank, on every run, and to the op's
 * N-buffer entry point; different ops sum in different orders (see docs/distribution.md).
 * Ranks that disagree (another collective, count, op or root) are caught at
 * the collective's rendezvous: every rank returns LOOM_EUSAGE naming the
 * collective and the differing values, having touched no buffer out of
 * range (all_gather may have written its own block of out), and the
 * communicator stays usable for the next call.
 * Waits are watched (Loom's rendezvous and the built-ins' waits; a plugin's
 * own per-rank entry points wait as they choose): ranks in collectives that
 * start at different rendezvous (all_gather_shards against all_reduce, say)
 * are found by the first rank that sleeps and all return LOOM_EUSAGE naming
 * both; a rank that has waited warn_s logs a stall report (which ranks are
 * ready, which are missing and what they last entered), again every warn_s;
 * after fail_s every waiting rank returns LOOM_ETIMEOUT with that report.
 * Either error breaks the communicator: every later call on any rank
 * returns it at once (a rank that left may be read by a peer finishing the
 * call, so close only once every rank has returned).
 * Free with loom_xcomm_close, after the last collective. */
typedef struct loom_xcomm loom_xcomm;
int  loom_xcomm_open(loom_xcomm **out, const loom_cross_device_ops *x, int n, loom_err *err);
void loom_xcomm_close(loom_xcomm *c); /* NULL is a no-op */
/* Stall threshold and hard timeout, seconds, per wait (0 = none); the
 * defaults are LOOM_XCOMM_STALL_WARN and 0 (strategy.collective_timeout).
 * Call between collectives. */
void loom_xcomm_set_timeouts(loom_xcomm *c, double warn_s, double fail_s);
#define LOOM_XCOMM_STALL_WARN 60.0
int  loom_xcomm_size(const loom_xcomm *c);
const loom_cross_device_ops *loom_xcomm_ops(const loom_xcomm *c);
/* buf (count floats) becomes the SUM, MEAN (SUM / n) or MAX over the ranks. */
int  loom_xcomm_all_reduce(loom_xcomm *c, int rank, float *buf, int64_t count, loom_redop op, loom_err *err);
/* root's buf is copied into every other rank's buf. */
int  loom_xcomm_broadcast(loom_xcomm *c, int rank, float *buf, int64_t count, int root, loom_err *err);
/* out (n * count floats, this rank's own) = concat of every rank's buf, in rank order. */
int  loom_xcomm_all_gather(loom_xcomm *c, int rank, const float *buf, int64_t count, float *out, loom_err *err);
/* A sharded update (ZeRO-1): reduce-scatter, each rank updates its shard,
 * all-gather in place. loom_xcomm_shard is rank's shard [lo, hi) of a buffer
 * of count floats: the shards partition it on 16-float lines. After loom_xcomm_reduce_scatter
 * rank's shard of buf holds the reduction, with the same bits that
 * loom_xcomm_all_reduce gives there (the rest of buf is unspecified);
 * loom_xcomm_all_gather_shards then copies every other rank's shard of its
 * buf into this rank's, so all ranks' bufs are equal. The ring moves half the
 * bytes of its all-reduce in each; other ops all-reduce the whole buffer. */
void loom_xcomm_shard(const loom_xcomm *c, int rank, int64_t count, int64_t *lo, int64_t *hi);
int  loom_xcomm_reduce_scatter(loom_xcomm *c, int rank, float *buf, int64_t count, loom_redop op, loom_err *err);
int  loom_xcomm_all_gather_shards(loom_xcomm *c, int rank, float *buf, int64_t count, loom_err *err);
/* The three as one collective: grads are reduce-scattered (SUM), apply(arg,
 * lo, hi) updates params [lo, hi) from grads [lo, hi) for ranges that tile
 * this rank's shard (each starting on a 16-float line, so an element-wise
 * optimizer gives the bits of one call over the shard), and every rank's
 * params end up holding every rank's shard. The same bits as
 * reduce_scatter + apply(shard) + all_gather_shards, with fewer passes over
 * memory and fewer waits: the ring applies each chunk of the shard as soon
 * as it is reduced and writes it straight into the other ranks' params.
 * No rank may read its params between its call and its return (they are
 * written by the others); apply runs on the calling rank's thread. */
typedef void (*loom_xcomm_apply_fn)(void *arg, int64_t lo, int64_t hi);
int  loom_xcomm_update(loom_xcomm *c, int rank, float *grads, float *params, int64_t count, loom_xcomm_apply_fn apply,
                       void *arg, loom_err *err);

/* Gradient packing (tf.distribute). A pack is a contiguous range of the flat
 * parameter/gradient buffer, all-reduced as one; packs are listed in the
 * order to reduce them: last layers first, as backprop produces them, so a
 * strategy can start reducing a pack once backward has passed tensor `first`. */
typedef struct loom_pack {
    int64_t offset, count; /* floats */
    int     first, last;   /* the parameter tensors it covers (model order, inclusive; the ends may be partial) */
} loom_pack;

/* Packs for n parameter tensors that tile [0, total) in order, as a model's
 * do (loom_model_param_tensor(m, 0..n-1)).
 * bytes_per_pack > 0 (CommunicationOptions.bytes_per_pack): the tensors in
 *   reverse order, grouped greedily: a new pack starts once the current one
 *   holds more than bytes_per_pack bytes, so packs are at least that large.
 * else num_packs >= 1 (NcclAllReduce(num_packs)): all tensors concatenated in
 *   model order and cut into num_packs chunks of total / num_packs floats, the
 *   last taking the remainder (empty chunks dropped); num_packs = 0: one pack
 *   per tensor.
 * bytes_per_pack = 0 with num_packs = 1 is one pack of everything.
 * *out is freed with loom_free; a tensor list that does not tile is LOOM_ESHAPE. */
int loom_pack_plan(const loom_param_info *params, int n, int64_t bytes_per_pack, int num_packs, loom_pack **out,
                   int *n_out, loom_err *err);

/* ---- strategies ---------------------------------------------------------- */

typedef struct loom_strategy loom_strategy;

/* What the trainer gives a strategy to build its replicas. */
typedef struct loom_strategy_args {
    const loom_spec      *spec;       /* model, optimizer, strategy, run */
    const loom_elem_spec *input;      /* the batched training element */
    int                   input_idx;  /* index of model.input in the element */
    int                   label_idx;  /* index of model.label */
    int64_t               max_batch;  /* the largest global batch */
    /* ---- appended (plugins built against the first layout never read them) ---- */
    const loom_cluster   *cluster;    /* the resolved cluster of a job across processes; NULL: one process */
    bool                  plan_only;  /* `loom check`: build the replicas (their variables need no values), print the plan, open no socket */
    /* ---- appended (version 4) ---- */
    int64_t               steps_per_epoch; /* batches of one pass of data.train on this task; < 0 unknown */
    int                   weight_idx1; /* model.sample_weight's feature index + 1; 0: none */
    /* ---- appended (the host's args only grow; a plugin built before may ignore them) ---- */
    /* loom train: where this task resumes from, as it found its model_dir
     * before the strategy opened. A strategy whose tasks train in lock-step
     * compares resume_key across them (the same key: the same starting
     * weights, step and data position) and names each task's resume_text
     * when they differ. NULL: not a training run (evaluate, predict, check). */
    const char           *resume_key, *resume_text;
    /* ---- appended: a graph's several model inputs (model.inputs) ---- */
    int                   n_inputs;    /* 0 or 1: model.input alone (input_idx) */
    int                   inputs_idx[LOOM_MAX_MODEL_INPUTS]; /* each input's feature index; [0] = input_idx */
    /* ---- appended: output heads (model.outputs) ---- */
    int                   n_heads;     /* 0 or 1: one output (label_idx) */
    int                   heads_idx[LOOM_MAX_HEADS]; /* each head's label feature index; [0] = label_idx */
    /* ---- appended: the run's model_dir (loom train; NULL otherwise), where
     * multi_worker_mirrored's chief records membership changes in metrics.jsonl ---- */
    const char           *model_dir;
} loom_strategy_args;

/* e's model inputs beyond the first (model.inputs) to m for its next steps (none: NULL). */
static inline void loom_strategy_inputs_(const loom_strategy_args *a, loom_model *m, const loom_elem *e)
{
    if (a->n_inputs > 1) {
        const loom_tensor *xs[LOOM_MAX_MODEL_INPUTS];
        for (int f = 1; f < a->n_inputs; f++) xs[f - 1] = e ? &e->t[a->inputs_idx[f]] : NULL;
        loom_model_set_inputs(m, e ? xs : NULL, a->n_inputs - 1);
    }
    if (a->n_heads > 1) { /* the labels of heads beyond the first travel as the extra inputs do */
        const loom_tensor *ys[LOOM_MAX_HEADS];
        for (int h = 1; h < a->n_heads; h++) ys[h - 1] = e ? &e->t[a->heads_idx[h]] : NULL;
        loom_model_set_head_labels(m, e ? ys : NULL, a->n_heads - 1);
    }
}

/* e's sample weights (args->weight_idx1) and its model inputs beyond the
 * first to m for its next steps (none: NULL). */
static inline void loom_strategy_weights_(const loom_strategy_args *a, loom_model *m, const loom_elem *e)
{
    loom_model_set_sample_weights(m, a->weight_idx1 > 0 && e ? &e->t[a->weight_idx1 - 1] : NULL);
    loom_strategy_inputs_(a, m, e);
}

/* The per-example shapes and dtypes of the model inputs of the element
 * a->input (xs, dt: LOOM_MAX_MODEL_INPUTS each) and of its label (ye);
 * returns the number of inputs. */
static inline int loom_strategy_model_shapes_(const loom_strategy_args *a, loom_shape *xs, loom_dtype *dt,
                                              loom_shape *ye);
/* The model of a->spec for batches of up to max_batch of the element a->input:
 * its inputs model.input or model.inputs, its label model.label (each feature's
 * per-example shape: the batch dimension dropped). */
static inline int loom_strategy_model_shapes_(const loom_strategy_args *a, loom_shape *xs, loom_dtype *dt,
                                              loom_shape *ye)
{
    const loom_elem_spec *in = a->input;
    int n = a->n_inputs > 1 ? a->n_inputs : 1;
    for (int f = 0; f < n; f++) {
        int i = f ? a->inputs_idx[f] : a->input_idx;
        xs[f] = loom_shape_make(in->shape[i].rank - 1, in->shape[i].dim + 1);
        dt[f] = in->dtype[i];
    }
    *ye = loom_shape_make(in->shape[a->label_idx].rank - 1, in->shape[a->label_idx].dim + 1);
    return n;
}

static inline int loom_strategy_model_new_(loom_model **out, const loom_strategy_args *a, int64_t max_batch,
                                           loom_err *err)
{
    const loom_elem_spec *in = a->input;
    loom_shape xs[LOOM_MAX_MODEL_INPUTS], ye;
    loom_dtype dt[LOOM_MAX_MODEL_INPUTS];
    int n = loom_strategy_model_shapes_(a, xs, dt, &ye);
    if (a->plan_only) /* `loom check`: the model described, never run (its buffers wait for a first step) */
        return loom_model_new_plan(out, &a->spec->model, n, xs, dt, &ye, in->dtype[a->label_idx], max_batch, err);
    if (n == 1)
        return loom_model_new(out, &a->spec->model, &xs[0], dt[0], &ye, in->dtype[a->label_idx], max_batch, err);
    return loom_model_new_inputs(out, &a->spec->model, n, xs, dt, &ye, in->dtype[a->label_idx], max_batch, err);
}

/* Result of one step, summed over replicas. */
typedef struct loom_step_result {
    double  loss_sum; /* sum of per-example losses */
    int64_t correct;  /* correctly classified examples */
    int64_t examples;
} loom_step_result;

/* The parts of a training step, for custom steps (a Lua train_step): in this
 * order they must do exactly what train_step does, bit for bit. */
typedef enum {
    LOOM_PART_FORWARD,    /* each replica: forward on its share of the batch (dropout keyed by step) */
    LOOM_PART_LOSS,       /* each replica: the loss of its share, and its gradient w.r.t. the outputs */
    LOOM_PART_BACKWARD,   /* each replica: gradients into its flat gradient buffer */
    LOOM_PART_ALL_REDUCE, /* SUM the replicas' gradient buffers with the cross-device op */
    LOOM_PART_APPLY,      /* the optimizer's `step`-th update with the (reduced) gradients */
} loom_step_part;

typedef struct loom_strategy_ops {
    uint32_t    version; /* LOOM_STRATEGY_OPS_VERSION; append fields only */
    const char *name;    /* "one_device" */
    int  (*open)(loom_strategy *s, const loom_strategy_args *a, loom_err *err);
    void (*close)(loom_strategy *s);
    /* One synchronous training step on a global batch; step = updates applied so far. */
    int  (*train_step)(loom_strategy *s, const loom_elem *batch, int64_t step, loom_step_result *out, loom_err *err);
    int  (*eval_step)(loom_strategy *s, const loom_elem *batch, loom_step_result *out, loom_err *err);
    /* Outputs (B, classes) for a batch. */
    int  (*predict)(loom_strategy *s, const loom_elem *batch, float *out, loom_err *err);
    /* The replica whose variables are checkpointed, and the optimizer. */
    loom_model     *(*model)(loom_strategy *s);
    loom_optimizer *(*optimizer)(loom_strategy *s);
    /* After the variables of model() were overwritten (restore): make every replica agree. */
    int  (*sync)(loom_strategy *s, loom_err *err);
    int  (*num_replicas)(loom_strategy *s);
    /* (optional, both or neither) custom training steps; NULL => refused.
     * One part on every replica; batch is read by FORWARD and LOSS, step by
     * FORWARD and APPLY; LOSS fills per_replica[r] for r < num_replicas.
     * A strategy whose ALL_REDUCE agrees the step's result across processes
     * (multi_worker_mirrored) puts the job's sums in per_replica[0] there
     * (the trainer logs that); others leave per_replica alone. */
    int  (*step_part)(loom_strategy *s, loom_step_part part, const loom_elem *batch, int64_t step,
                      loom_step_result *per_replica, loom_err *err);
    /* Replica r's model, whose gradient buffer a custom step may change (clipping). */
    loom_model *(*replica)(loom_strategy *s, int r);
    /* ---- version 2 (appended; read only when version >= 2): the strategy
     * describes itself, so the trainer treats every strategy alike. Each is
     * optional; NULL gives the behaviour of one process. ---- */
    unsigned caps; /* LOOM_STRATEGY_* below */
    /* `loom check`: the plan (replicas, devices, per-replica batches, the
     * reductions) for a global batch, into f. NULL: one generic line. */
    void (*print_plan)(loom_strategy *s, int64_t global_batch, FILE *f);
    /* Where the replicas run, for the log's "training N parameters on ..."
     * line: "cpu:0", "2 mirrored replicas, each". NULL: "N <name> replicas, each". */
    void (*where)(loom_strategy *s, char *buf, size_t n);
    /* Called before open (the input pipelines are built first, with it):
     * this task's input pipeline among the job's. NULL: the only one. */
    int  (*input_context)(const loom_strategy_args *a, loom_input_ctx *ctx, loom_err *err);
    /* Whether this task writes the job's checkpoints, metrics.jsonl and the
     * log's progress lines (and evaluates). NULL: yes. */
    bool (*is_chief)(loom_strategy *s);
    /* Checkpoints: mine (this task's training-iterator state) into the blob
     * the checkpoint stores (every task's, gathered: a collective, every task
     * calls it at the same step). NULL: mine as it is. */
    int  (*gather_iter_state)(loom_strategy *s, const loom_buf *mine, loom_buf *stored, loom_err *err);
    /* Resuming: this task's state out of the stored blob (reset first);
     * one written by another number of tasks is LOOM_ECHECKPOINT. NULL: the blob as it is. */
    int  (*pick_iter_state)(loom_strategy *s, const loom_buf *stored, loom_buf *mine, loom_err *err);
    /* A stop request on this task (SIGTERM, SIGINT): the next train_step (or
     * end_of_data) carries it to every task, and each reports it in its
     * result's stop flag, so all stop after the same step. NULL: the
     * request concerns this process only. */
    void (*request_stop)(loom_strategy *s);
    bool (*stop_agreed)(loom_strategy *s); /* the last step carried a stop request of some task */
    /* This task's training input ended for the epoch. The tasks agree:
     * *all_ended when every task's ended (the epoch ends), else a step ran
     * in which this task contributed no examples (out holds the step's
     * result; its update was applied). NULL: *all_ended = true. */
    int  (*end_of_data)(loom_strategy *s, int64_t step, loom_step_result *out, bool *all_ended, loom_err *err);
    /* ---- version 3 (appended; read only when version >= 3; optional) ---- */
    /* The other tasks of a job across processes as this task sees them
     * (alive, last heard, time its collectives waited on each), up to max;
     * returns how many. For the status endpoint. NULL: none (one process). */
    int  (*peers)(loom_strategy *s, loom_peer_info *out, int max);
    /* ---- version 4 (appended; read only when version >= 4; optional) ---- */
    /* A task that is not the chief serves the job instead of running the
     * training loop (parameter_server's ps and worker tasks); train is this
     * task's training iterator (a worker's own pipeline), borrowed. Returns
     * when the job is done (LOOM_OK) or this task failed. NULL: every task
     * runs the training loop. */
    int  (*serve)(loom_strategy *s, loom_iter *train, loom_err *err);
    /* ---- version 5 (appended; read only when version >= 5; optional) ---- */
    /* The roles of a cluster the strategy uses (see loom_cluster_roles in
     * cluster.h): whether it runs in one process, which roles it refuses or
     * requires, whether a lost worker rejoins. `loom check`, train and launch
     * check the cluster against it before anything opens. NULL: any cluster
     * (the strategy checks when it opens). */
    const loom_cluster_roles *roles;
} loom_strategy_ops;
#define LOOM_STRATEGY_OPS_VERSION 5 /* versions 1 to 4 (without the appended fields) still register */
/* caps: the strategy runs its replicas on threads of its own sized from
 * run.threads, so BLAS runs single-threaded under it (else BLAS gets run.threads). */
#define LOOM_STRATEGY_OWN_THREADS 1u

struct loom_strategy {
    const loom_strategy_ops     *ops;
    const loom_cross_device_ops *xops;
    const loom_strategy_args    *args;
    void                        *impl;
    int                          failing; /* set by loom_strategy_set_failing before close */
};

/* The registry. Built-ins are registered by loom_distribute_init (an explicit
 * list: static constructors get dropped from static libraries). */
int loom_distribute_init(loom_err *err);
int loom_register_strategy(const loom_strategy_ops *ops, loom_err *err);
int loom_register_cross_device_ops(const loom_cross_device_ops *ops, loom_err *err);
/* The same with the registering plugin's path as origin (NULL = built-in);
 * a vtable of another version, or a name already taken, is LOOM_EPLUGIN. */
int loom_register_strategy_from(const loom_strategy_ops *ops, const char *origin, loom_err *err);
int loom_register_cross_device_ops_from(const loom_cross_device_ops *ops, const char *origin, loom_err *err);
const loom_strategy_ops     *loom_find_strategy(const char *name);
/* Whether ops is one of Loom's own strategies (the config engine knows their
 * names and settings; any other is a plugin's). */
bool loom_strategy_builtin(const loom_strategy_ops *ops);
const loom_cross_device_ops *loom_find_cross_device_ops(const char *name);
/* "one_device, ..." into buf, for error messages. */
char *loom_strategy_names(char *buf, size_t n);
char *loom_cross_device_ops_names(char *buf, size_t n);

/* Creates the strategy the spec names. Free with loom_strategy_close. */
int  loom_strategy_open(loom_strategy **out, const loom_strategy_args *a, loom_err *err);
void loom_strategy_close(loom_strategy *s); /* NULL is a no-op */
/* Before close: the run is ending in failure, so the strategy must not wait
 * for its peers on the way out (a job's cross-device op skips MPI_Finalize).
 * NULL is a no-op. */
void loom_strategy_set_failing(loom_strategy *s);

/* The roles description of the strategy the spec names, found by its name
 * in the registry (a plugin's once its plugin is loaded): pass it to
 * loom_cluster_resolve. NULL for a strategy that describes none (ops version
 * < 5, or roles NULL) or an unknown name. Borrowed, static. */
const loom_cluster_roles *loom_strategy_roles(const loom_spec *spec);

/* Thin wrappers over the vtable. */
int  loom_strategy_train_step(loom_strategy *s, const loom_elem *batch, int64_t step, loom_step_result *out,
                              loom_err *err);
int  loom_strategy_eval_step(loom_strategy *s, const loom_elem *batch, loom_step_result *out, loom_err *err);
int  loom_strategy_predict(loom_strategy *s, const loom_elem *batch, float *out, loom_err *err);
loom_model     *loom_strategy_model(loom_strategy *s);
loom_optimizer *loom_strategy_optimizer(loom_strategy *s);
int  loom_strategy_sync(loom_strategy *s, loom_err *err);
int  loom_strategy_num_replicas(loom_strategy *s);
/* Custom training steps: whether the strategy has step_part, one part, and
 * replica r's model (r < num_replicas). */
bool loom_strategy_has_parts(loom_strategy *s);
int  loom_strategy_step_part(loom_strategy *s, loom_step_part part, const loom_elem *batch, int64_t step,
                             loom_step_result *per_replica, loom_err *err);
loom_model *loom_strategy_replica(loom_strategy *s, int r);
/* model.metrics: every replica's state added into acc and cleared (a
 * strategy without replica(): its model's), as loom_model_metrics_take. */
void loom_strategy_metrics_take(loom_strategy *s, double *acc);

/* For `loom check`: the strategy's plan for a global batch: replicas,
 * devices, threads, what computes (nn's host code or a device backend),
 * per-replica batches, the cross-device op and its packs, the bytes reduced
 * per step (a strategy without print_plan: one line naming it, its origin
 * and replicas). */
void loom_strategy_print_plan(loom_strategy *s, int64_t global_batch, FILE *f);
/* The version-2 descriptions (see loom_strategy_ops), with their defaults
 * for strategies that leave them NULL (or speak version 1). */
unsigned loom_strategy_caps(const loom_strategy *s);
/* The pool a training step computes on, when the trainer may run other work
 * on it between steps (data.train's batches, loom_iter_share_pool): one
 * device, its step on the calling thread with the model's pool, nothing else
 * driving that pool. NULL otherwise (other strategies, a model of one
 * thread). Borrowed. */
loom_pool *loom_strategy_step_pool(loom_strategy *s);
/* BLAS threads for the strategy the spec names (before it opens): 1 when it
 * has LOOM_STRATEGY_OWN_THREADS, else run.threads. */
int  loom_strategy_blas_threads(const loom_spec *spec);
char *loom_strategy_where(loom_strategy *s, char *buf, size_t n);
/* The input context of the strategy a->spec names, before it opens; zero
 * (the only pipeline) for strategies without one. */
int  loom_strategy_input_context(const loom_strategy_args *a, loom_input_ctx *ctx, loom_err *err);
bool loom_strategy_is_chief(loom_strategy *s);
int  loom_strategy_gather_iter_state(loom_strategy *s, const loom_buf *mine, loom_buf *stored, loom_err *err);
int  loom_strategy_pick_iter_state(loom_strategy *s, const loom_buf *stored, loom_buf *mine, loom_err *err);
/* Returns whether the strategy carries the request to the other tasks (then
 * the trainer keeps stepping until stop_agreed); false: stop now. */
bool loom_strategy_request_stop(loom_strategy *s);
bool loom_strategy_stop_agreed(loom_strategy *s);
int  loom_strategy_end_of_data(loom_strategy *s, int64_t step, loom_step_result *out, bool *all_ended, loom_err *err);
/* The job's other tasks as this one sees them (0 for one process). */
int  loom_strategy_peers(loom_strategy *s, loom_peer_info *out, int max);
/* strategy.elastic (multi_worker_mirrored), the trainer's part in a
 * membership change. loom_strategy_elastic_joined: this task entered a
 * running job (the variables and optimizer slots are the members'): the
 * trainer's state the chief's save wrote (borrowed) and the steps done, else
 * NULL (any other strategy too). loom_strategy_elastic_admit: after every
 * step's bookkeeping (`done` steps): when that step said a task waits to
 * join, the chief's save(arg, out) writes the trainer's state (its position,
 * the hooks' and data.train's, as a checkpoint holds them) and every member
 * takes the newcomers in; else nothing. */
typedef int (*loom_train_state_fn)(void *arg, loom_buf *out, loom_err *err);
const loom_buf *loom_strategy_elastic_joined(loom_strategy *s, int64_t *step);
int  loom_strategy_elastic_admit(loom_strategy *s, int64_t done, loom_train_state_fn save, void *arg, loom_err *err);
/* Whether this task serves the job instead of training (see serve above),
 * and the serving itself. */
bool loom_strategy_serves(loom_strategy *s);
int  loom_strategy_serve(loom_strategy *s, loom_iter *train, loom_err *err);

/* ---- sharded checkpoints (the built-in parameter_server; not in the plugin ABI) ----
 * The variables live on ps tasks, and each ps writes the shards it holds to
 * a file of its own in the (shared) model_dir; the chief then commits an
 * index naming them (train/checkpoint.c writes and reads both kinds of file:
 * the strategy is handed its writer, as the module below cannot call up). */
typedef struct loom_ckpt_tensor {
    const char  *name;   /* record name: "<variable>" or "<variable>/part_<i>", a slot "<that>/<slot>" */
    loom_shape   shape;  /* the shard's: the variable's with dim 0 = its rows */
    const float *data;   /* numel(shape) floats, borrowed */
} loom_ckpt_tensor;
typedef struct loom_ckpt_shard_meta {
    int64_t  step;       /* the applied updates the shard holds */
    int      ps, n_ps;   /* written by ps:ps of a job of n_ps */
    uint64_t plan_id;    /* the partitioning (variables, shards, placement) it was cut by */
} loom_ckpt_shard_meta;
/* Writes a shard file (the checkpoint format: the tensors and the meta) at
 * path atomically; *size and *crc: its bytes and their CRC-32C. */
typedef int (*loom_ckpt_write_fn)(const char *path, const loom_ckpt_shard_meta *meta, const loom_ckpt_tensor *t,
                                  int n, uint64_t *size, uint32_t *crc, loom_err *err);
typedef struct loom_ckpt_shard_file {
    char     name[128];  /* file name in the model_dir: ckpt-<step>.data-<ps>-of-<n_ps> */
    uint64_t size;
    uint32_t crc;        /* CRC-32C of the whole file */
    int      ps;
} loom_ckpt_shard_file;
typedef struct loom_ckpt_part {
    char    var[96];     /* the variable (loom_param_info.name) */
    char    record[128]; /* its record in the file (slots: record "/" slot name) */
    int     file;        /* index into loom_ckpt_shards.file */
    int64_t row0, rows;  /* rows [row0, row0 + rows) of axis 0 */
} loom_ckpt_part;
typedef struct loom_ckpt_shards {
    int                   n_ps, n_files, n_parts;
    uint64_t              plan_id;
    loom_ckpt_shard_file *file; /* n_files */
    loom_ckpt_part       *part; /* n_parts; both freed by loom_ckpt_shards_fini */
} loom_ckpt_shards;
void loom_ckpt_shards_fini(loom_ckpt_shards *s);
/* Whether this strategy's checkpoints are sharded (the chief calls
 * loom_strategy_save_shards instead of writing model() whole). */
bool loom_strategy_saves_shards(loom_strategy *s);
/* The writer the tasks holding shards use (train/checkpoint.c's); set after
 * open, before train or serve. A no-op for other strategies. */
void loom_strategy_set_ckpt_writer(loom_strategy *s, loom_ckpt_write_fn fn);
/* On the chief, with the variables at rest: every ps writes its shard file
 * of `step` under dir (absolute; the directory every task shares) and *out
 * lists the files (sizes, CRCs) and where each variable's rows are in them.
 * A file the chief cannot see in dir (model_dir not shared) is LOOM_EIO. */
int  loom_strategy_save_shards(loom_strategy *s, const char *dir, int64_t step, loom_ckpt_shards *out, loom_err *err);

/* Generic all-reduce over n buffers with a cross-device op (n == 1 is a no-op). */
int loom_all_reduce(const loom_cross_device_ops *x, float *const *bufs, int n, int64_t count, loom_redop op,
                    loom_err *err);
/* out = concat(bufs[0..n)) with the op's all_gather, or a plain copy when it has none. */
int loom_all_gather(const loom_cross_device_ops *x, float *const *bufs, int n, int64_t count, float *out,
                    loom_err *err);

#endif
