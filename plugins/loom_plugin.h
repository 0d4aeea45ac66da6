/* loom_plugin.h - the whole ABI between Loom and its plugins.
 *
 * A plugin is a shared object that includes this header (and libc's) only.
 * It exports one function, loom_plugin_entry(), returning a static
 * loom_plugin; Loom checks its ABI version before touching anything else,
 * then calls init() once with the host table, through which the plugin
 * registers named providers (cross-device ops, strategies, dataset
 * sources, transforms, layer kinds; device backends too) and reaches everything
 * else it may use. Nothing of Loom is linked into a plugin.
 *
 *   cc -shared -fPIC -O2 -I <loom>/plugins my_op.c -o my_op.so
 *
 * Loom loads every *.so in plugins/ next to the loom binary, then in each
 * directory of the config's plugins.path, then of $LOOM_PLUGIN_PATH
 * (colon-separated); `loom plugins` lists what loaded and what was refused.
 *
 * Compatibility: LOOM_PLUGIN_ABI_VERSION changes whenever something here
 * changes incompatibly; a plugin built for another version is refused. The
 * host table and the vtables only grow at their end, and each vtable starts
 * with its own version: Loom reads a vtable only up to the fields of its
 * version, so a plugin built against an older header keeps working, and a
 * vtable newer than Loom knows is refused when it registers.
 * Memory: names and vtables a plugin registers must be static (they are
 * used until the process exits; plugins are never unloaded).
 * Threads: init runs once on the main thread. Vtable functions are called as
 * their comments say; host functions are thread-safe unless noted.
 * Device backends (a GPU's memory and kernels) register a loom_device_ops
 * (appliance/tensor/device.h, restated below) with host->register_device.
 * Dataset sources (source.type) and transforms (map/filter `plugin =
 * "provider:function"`) are the data module's provider interfaces
 * (appliance/data/engine/custom.h, restated below; Lua map/filter use the same). */
#ifndef LOOM_PLUGIN_H
#define LOOM_PLUGIN_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define LOOM_PLUGIN_ABI_VERSION 2 /* 2: LOOM_MAX_FEATURES 8 -> 256 (loom_elem_spec, loom_elem grew) */

#if defined(__GNUC__)
#define LOOM_PLUGIN_EXPORT __attribute__((visibility("default")))
#else
#define LOOM_PLUGIN_EXPORT
#endif

/* Inside Loom, its own headers (core.h, distribute.h) define the types
 * below and are included first, so the guards skip the copies here;
 * appliance/plugin/abi_check.c proves at compile time that both agree. */

/* ---- errors and logging ---------------------------------------------------- */

#ifndef LOOM_CORE_H
/* Return codes: 0 is success. The same values as Loom's own. */
typedef enum {
    LOOM_EOK, LOOM_ENOMEM, LOOM_ECONFIG, LOOM_EUSAGE, LOOM_EIO, LOOM_EDATA, LOOM_ESHAPE, LOOM_ECHECKPOINT,
    LOOM_ENUMERIC, LOOM_EUNSUPPORTED, LOOM_ECUDA, LOOM_ENCCL, LOOM_ENET, LOOM_ELUA, LOOM_EPLUGIN, LOOM_EEOF,
    LOOM_ETIMEOUT /* appended: a collective waited past strategy.collective_timeout */
} loom_errcode;

/* Detail of a failure: caller-owned, filled with host->err_set. */
typedef struct loom_err {
    int  code;        /* LOOM_E* */
    char where[256];  /* "configs/x.cfg:12", "plugins/my_op.so" */
    char msg[512];    /* what failed, quoting the offending value */
    char hint[256];   /* what to do about it; may be empty */
} loom_err;

typedef enum { LOOM_LOG_DEBUG, LOOM_LOG_INFO, LOOM_LOG_WARN, LOOM_LOG_ERROR } loom_log_level;

typedef struct loom_buf loom_buf; /* Loom's byte buffer (iterator states); opaque here */
#endif

#ifndef LOOM_TENSOR_H
/* ---- tensors and elements (appliance/tensor/tensor.h, data/data.h) ---------- */

typedef enum { LOOM_U8, LOOM_I32, LOOM_I64, LOOM_F32, LOOM_F64, LOOM_NDTYPES_ } loom_dtype;

#define LOOM_MAX_RANK 8

typedef struct loom_shape {
    int     rank;
    int64_t dim[LOOM_MAX_RANK];
} loom_shape;

/* A host tensor: row-major data of shape.dim[0] * ... values of dtype. */
typedef struct loom_tensor {
    loom_dtype dtype;
    loom_shape shape;
    void      *data;
    int        owns; /* Loom's; plugins leave it 0 */
} loom_tensor;
#endif

#ifndef LOOM_DATA_H
#define LOOM_MAX_FEATURES 256
#define LOOM_NAME_MAX     64

/* Names, dtypes and shapes of an element; batched: dim[0] is the batch
 * size, -1 when the last batch may be short. */
typedef struct loom_elem_spec {
    int        n;
    char       name[LOOM_MAX_FEATURES][LOOM_NAME_MAX];
    loom_dtype dtype[LOOM_MAX_FEATURES];
    loom_shape shape[LOOM_MAX_FEATURES];
} loom_elem_spec;

/* An element (the model input, the label, ...): tensors in the spec's order. */
typedef struct loom_elem {
    int         n;
    loom_tensor t[LOOM_MAX_FEATURES];
} loom_elem;

/* Which of several input pipelines is built (tf.distribute.InputContext). */
typedef struct loom_input_ctx {
    int num_input_pipelines;  /* pipelines (workers) of the run; 0 = 1 */
    int input_pipeline_id;    /* this one, 0 .. num_input_pipelines - 1 */
    int num_replicas_in_sync; /* replicas over all workers; 0 = 1 */
    uint64_t seed_key;        /* (appended) nonzero: this pipeline's own seed, mixed with the run's; 0: the run's */
} loom_input_ctx;
#endif

#ifndef LOOM_DATA_CUSTOM_H
/* ---- transforms and dataset sources (appliance/data/engine/custom.h has more) ------ */

#define LOOM_CUSTOM_OPS_VERSION 1
#define LOOM_SOURCE_OPS_VERSION 1

/* A config's options for a provider (a plugin map's `args`, a source's
 * `options`): scalars as text, in config order. */
#define LOOM_MAX_OPTIONS 8
typedef struct loom_options {
    int         n;
    const char *key[LOOM_MAX_OPTIONS];
    const char *value[LOOM_MAX_OPTIONS];
    const char *where[LOOM_MAX_OPTIONS]; /* "configs/x.cfg:12": name it in errors (host->err_set's where) */
} loom_options;

/* What a transform provider is opened with: `plugin = "image_ops:cutout"`
 * opens provider "image_ops" with ref "cutout". */
typedef struct loom_custom_args {
    uint32_t              size;      /* sizeof at Loom's build: fields past it are absent */
    const char           *ref;       /* the function, "cutout" */
    const char           *base_dir;
    const char           *where;     /* "configs/x.cfg:31", the transform */
    const loom_elem_spec *in;        /* the elements it receives (may be batched) */
    const loom_shape     *in_max;    /* in's shapes with every -1 at its largest value */
    int                   filter;    /* 1: a predicate, 0: a map */
    int                   max_calls; /* most calls in flight at once (>= 1) */
    uint64_t              seed;      /* the run's seed */
    const void           *options;   /* Loom's own; plugins ignore it */
    const loom_options   *args;      /* the transform's `args` */
} loom_custom_args;

/* The RNG key of one call: derive the call's random numbers from it alone
 * (host->rng_mix), and results do not depend on threads or resume points. */
typedef struct loom_custom_key {
    uint64_t seed;
    int64_t  stage;  /* the transform's position in the pipeline */
    int64_t  epoch;
    int64_t  index;  /* the element's position in this pass of the stage's input */
} loom_custom_key;

/* A transform provider: map and/or filter functions selected by ref.
 * open/close run on the pipeline's thread; map and filter on up to
 * max_calls threads at once, each call with its own in/out. */
typedef struct loom_custom_ops {
    uint32_t    version; /* LOOM_CUSTOM_OPS_VERSION */
    const char *name;    /* what `plugin = "NAME:function"` selects */
    /* A map fills *out with the spec of what it returns (max shapes; a dim
     * that varies is -1 and out_max gives its largest value). */
    int  (*open)(void **inst, const loom_custom_args *args, loom_elem_spec *out, loom_shape *out_max, loom_err *err);
    /* out's tensors arrive with the output dtypes and buffers of the max
     * shapes: write the data and the actual shapes. in is read-only. */
    int  (*map)(void *inst, const loom_elem *in, loom_elem *out, const loom_custom_key *key, loom_err *err);
    int  (*filter)(void *inst, const loom_elem *in, int *keep, const loom_custom_key *key, loom_err *err);
    void (*close)(void *inst);
} loom_custom_ops;

/* What a source is opened with (source: { type = NAME; options: {...}; }). */
typedef struct loom_source_args {
    uint32_t            size;     /* sizeof at Loom's build */
    const char         *type;     /* the registry name */
    const char         *base_dir; /* the config's directory: resolve relative paths against it */
    const char         *where;    /* "configs/x.cfg:12", the source group */
    const loom_options *options;  /* keys already checked against loom_source_ops.options */
    uint64_t            seed;     /* the run's seed */
} loom_source_args;

/* A dataset source. Every function runs on the thread driving the
 * pipeline, one call at a time per instance. The same (options, seed,
 * epoch, position) must give the same element: that is what makes runs
 * reproducible and resumable. */
typedef struct loom_source_ops {
    uint32_t           version; /* LOOM_SOURCE_OPS_VERSION */
    const char        *name;    /* what source.type selects */
    const char *const *options; /* keys accepted in source.options (NULL-terminated, static); NULL: none;
                                   a "*" entry: any key (keys that name features) */
    /* Fills *spec with the elements next() yields and max with their
     * largest shapes. close() is called whenever *inst is not NULL, also
     * after a failed open. */
    int     (*open)(void **inst, const loom_source_args *a, loom_elem_spec *spec, loom_shape *max, loom_err *err);
    int64_t (*cardinality)(void *inst);                          /* per pass; -1 infinite, -2 unknown */
    int     (*rewind)(void *inst, int64_t epoch, loom_err *err); /* starts pass epoch (0, 1, ...) */
    /* The next element of the pass, LOOM_EEOF after the last. out's tensors
     * arrive with buffers of the max shapes: write them and set the shapes,
     * or point data at the source's own memory (read-only, valid until the
     * next call). */
    int     (*next)(void *inst, loom_elem *out, loom_err *err);
    /* The state (epoch, position) into buf when it fits in cap; returns its size either way. */
    size_t  (*save)(void *inst, void *buf, size_t cap);
    int     (*restore)(void *inst, const void *buf, size_t len, loom_err *err); /* bad state: LOOM_ECHECKPOINT */
    void    (*close)(void *inst);
} loom_source_ops;
#endif

#ifndef LOOM_NN_LAYER_PLUGIN_H
/* ---- layer kinds (appliance/nn/layer_plugin.h) ------------------------------
 * A plugin layer: model.layers `{ type = "NAME"; ... }` with its own keys.
 * Its parameters live in the model's flat parameters (and its trainable
 * ones' gradients in the flat gradients) at offsets the host chooses. */

#define LOOM_LAYER_OPS_VERSION 1 /* 1: unchanged when Loom began to run several inputs, whole_batch and state
                                    (trainable = 0): the fields were there and refused */
#define LOOM_LAYER_MAX_PARAMS  4 /* parameter tensors of one plugin layer */
#define LOOM_LAYER_MAX_INPUTS  8 /* inputs of one layer (LOOM_MAX_LAYER_INPUTS) */
#define LOOM_LAYER_MAX_SETTINGS 8 /* keys of a plugin layer's own in the config */
/* A plugin layer's own keys in its config group, scalars as text in config order. */
typedef struct loom_layer_settings {
    int         n;
    const char *key[LOOM_LAYER_MAX_SETTINGS];
    const char *value[LOOM_LAYER_MAX_SETTINGS];
    const char *where[LOOM_LAYER_MAX_SETTINGS]; /* "configs/x.cfg:33": name it in errors */
} loom_layer_settings;


/* How a parameter tensor starts (from run.seed, so replicas built alike start equal). */
typedef enum { LOOM_LINIT_ZEROS, LOOM_LINIT_ONES, LOOM_LINIT_CONSTANT, LOOM_LINIT_GLOROT_UNIFORM,
               LOOM_LINIT_HE_NORMAL } loom_layer_init;

/* One parameter tensor of a plugin layer, as build() declares it. */
typedef struct loom_layer_param {
    const char *name;      /* "alpha" (static): `loom check` and checkpoints show it as "<layer>/<name>" */
    loom_shape  shape;     /* without a batch dimension */
    int         init;      /* loom_layer_init */
    float       value;     /* LOOM_LINIT_CONSTANT's value */
    int         trainable; /* 1: trained (its gradient in the flat grads); 0: state the layer updates itself in a
                              training forward (moving statistics): checkpointed, never in the optimizer */
} loom_layer_param;

/* What build() gets: the layer's config and its inputs' shapes. */
typedef struct loom_layer_args {
    uint32_t            size;     /* sizeof at Loom's build: fields past it are absent */
    const char         *type;     /* the registry name, the config's `type` */
    const char         *name;     /* the layer's name ("prelu_2") */
    const char         *where;    /* "configs/x.cfg:31", the layer: name it in errors */
    const loom_layer_settings *settings; /* the layer's own keys (any key that is not `type`, `name` or `inputs`),
                                     scalars as text, already checked against loom_layer_ops.options */
    int                 n_in;     /* inputs (1 unless the config's `inputs` names several) */
    const loom_shape   *in;       /* (n_in,) each input's shape per example, without the batch */
    int64_t             max_batch; /* most examples in one call */
} loom_layer_args;

/* What build() fills: the output's shape, the parameters, the scratch. A
 * shape that does not fit returns LOOM_ESHAPE with a message naming it. */
typedef struct loom_layer_plan {
    loom_shape       out;                          /* per example, without the batch */
    int              n_params;
    loom_layer_param param[LOOM_LAYER_MAX_PARAMS];
    size_t           scratch_per_example; /* bytes: the host allocates them (no allocation in a step) and keeps
                                             each example's bytes from forward to its backward */
    size_t           scratch_fixed;       /* bytes per call (per thread), not kept between calls */
    int              whole_batch;         /* 1: forward and backward see the whole batch in one call (batch
                                             statistics); 0: they are called on chunks of examples on several
                                             threads at once, and param_grads once on the whole batch */
} loom_layer_plan;

/* One call of forward, backward or param_grads on examples [b0, b0 + B) of
 * a batch of global_batch examples: every pointer is to those B examples'
 * rows (row-major, the example first). */
typedef struct loom_layer_call {
    uint32_t            size;         /* sizeof at Loom's build */
    int64_t             b0, B, global_batch; /* global_batch: 0 when not known (dy already carries the loss's
                                                 1 / global_batch) */
    int                 n_in;
    const float *const *x;            /* (n_in,) each (B, in...) */
    float              *y;            /* forward: write (B, out...); backward, param_grads: forward's y, read-only */
    float *const       *param;        /* (n_params,) the tensors in plan order; state writable in a training forward */
    void               *scratch;      /* the B examples' scratch_per_example bytes, kept from forward */
    void               *scratch_fixed;
    int                 training;     /* forward: 1 in a training step (dropout, batch statistics) */
    uint64_t            rng_key;      /* forward: derive random numbers from it and b0 + row (host->rng_mix) alone,
                                         so results do not depend on how the batch is chunked */
    const float        *dy;           /* backward, param_grads: (B, out...) d(loss)/dy */
    float *const       *dx;           /* backward: (n_in,) write (B, in...) d(loss)/dx; an entry is NULL when not
                                         needed */
    float *const       *dparam;       /* param_grads (whole_batch: backward): (n_params,) ADD d(loss)/d(param) into
                                         them, in example order; NULL for state */
} loom_layer_call;

/* (optional) An ONNX node for the layer: its inputs are the layer's input(s)
 * then its parameter tensors in plan order (trainable or not). */
typedef struct loom_layer_onnx {
    char    op_type[32];  /* "PRelu" */
    int     n_attr;       /* integer attributes */
    char    attr_name[4][32];
    int64_t attr_value[4];
} loom_layer_onnx;

/* A layer kind: `type = NAME` in model.layers. build and free run on the
 * main thread; forward, backward and param_grads on the model's threads:
 * with whole_batch 0, forward and backward on disjoint chunks at once (each
 * call writes only its own rows of y, dx and scratch), param_grads on one
 * thread. Nothing in a step may allocate: declare scratch in the plan. A
 * layer gives the same bits whatever the number of threads. */
typedef struct loom_layer_ops {
    uint32_t           version; /* LOOM_LAYER_OPS_VERSION */
    const char        *name;    /* what `type` selects; must not be a built-in layer's */
    const char *const *options; /* keys the layer accepts (NULL-terminated, static); NULL: none */
    int  (*build)(void **inst, const loom_layer_args *a, loom_layer_plan *plan, loom_err *err);
    void (*free)(void *inst);
    int  (*forward)(void *inst, const loom_layer_call *c, loom_err *err);
    int  (*backward)(void *inst, const loom_layer_call *c, loom_err *err);    /* dx (whole_batch: dparam too) */
    int  (*param_grads)(void *inst, const loom_layer_call *c, loom_err *err); /* whole_batch 0 with parameters */
    /* (optional) NULL: `loom export --format onnx` refuses the model naming the layer. */
    int  (*onnx)(void *inst, loom_layer_onnx *node, loom_err *err);
} loom_layer_ops;
#endif

/* Opaque to plugins: reached only through host functions. */
typedef struct loom_spec      loom_spec;      /* the loaded config */
typedef struct loom_model     loom_model;     /* one replica's layers, flat parameters and gradients */
typedef struct loom_optimizer loom_optimizer; /* an optimizer with its slots and schedule */
typedef struct loom_pool      loom_pool;      /* a fixed pool of worker threads */

#ifndef LOOM_DISTRIBUTE_H
/* ---- cross-device ops ------------------------------------------------------ */

typedef enum { LOOM_REDUCE_SUM, LOOM_REDUCE_MEAN, LOOM_REDUCE_MAX } loom_redop;

/* What a cross-device op's job_open gets (version 4, below): this rank, the
 * job, and a bootstrap channel over Loom's own cluster transport (already
 * connected and authenticated), for what the op's library must exchange
 * before it can talk (NCCL's unique id). */
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
    /* Any thread, any time until job_close: nonzero when Loom's transport has
     * lost a task of the job (its heartbeats stopped for
     * cluster.heartbeat_timeout, or its connection closed), err naming it; so
     * an op whose library cannot time out can still learn that a wait is
     * hopeless. */
    int (*boot_lost)(void *boot, loom_err *err);
    /* In job_close: nonzero when this task is ending in failure (its run
     * failed or was interrupted). job_close must then not wait for the other
     * ranks on its way out (MPI_Finalize and ncclCommDestroy would): they may
     * be stopped, or waiting in a collective this task will never join.
     * Leaving without it is what ends the job (mpirun stops the other ranks
     * when one exits non-zero; Loom's transport tells the others). */
    int (*boot_failing)(void *boot);
} loom_job_args;

/* Collectives over n in-process buffers of count floats each (one per
 * replica). Called from the train thread, one call at a time per op. */
typedef struct loom_cross_device_ops {
    uint32_t    version; /* LOOM_CROSS_DEVICE_OPS_VERSION; append fields only */
    const char *name;    /* the registry name, what strategy.cross_device_ops selects */
    /* Afterwards every bufs[i] holds the reduction of all n. */
    int (*all_reduce)(float *const *bufs, int n, int64_t count, loom_redop op, loom_err *err);
    /* bufs[root] copied into every other buffer. */
    int (*broadcast)(float *const *bufs, int n, int64_t count, int root, loom_err *err);
    /* (optional) out = concat(bufs[0..n)), n * count floats; NULL: Loom copies */
    int (*all_gather)(float *const *bufs, int n, int64_t count, float *out, loom_err *err);
    /* ---- version 2 (read only when version >= 2) ----
     * (optional) the same collectives called by each of n ranks from its own
     * thread, all n concurrently, in the same order with the same arguments;
     * a rank returns once no other rank still reads its buffer. NULL
     * comm_new: Loom gathers the ranks and calls the entry points above. */
    void *(*comm_new)(int n, loom_err *err); /* state the n ranks share; NULL + err on failure */
    void  (*comm_free)(void *comm);
    int   (*all_reduce_rank)(void *comm, int rank, float *buf, int64_t count, loom_redop op, loom_err *err);
    int   (*broadcast_rank)(void *comm, int rank, float *buf, int64_t count, int root, loom_err *err);
    /* (optional) out (n * count floats, one per rank) = concat of every rank's buf */
    int   (*all_gather_rank)(void *comm, int rank, const float *buf, int64_t count, float *out, loom_err *err);
    /* ---- version 3 (read only when version >= 3) ----
     * The memory the buffers may be in: LOOM_XOPS_HOST_MEM and/or
     * LOOM_XOPS_DEVICE_MEM; 0 means host memory. A strategy whose replicas'
     * buffers are elsewhere refuses the op when it opens (strategy.cross_device_ops'
     * file:line), and "auto" never picks it there. */
    uint32_t caps;
    /* ---- version 4 (read only when version >= 4) ----
     * (optional: all three or none) The same collectives across the
     * processes of a job (multi_worker_mirrored, strategy.communication =
     * NAME): every training rank, one per process, calls them from its train
     * thread, in the same order with the same arguments; buf is host memory.
     * An op that has them may leave all_reduce and broadcast NULL: it then
     * reduces across processes only (strategy.cross_device_ops refuses it).
     * job_close is called whenever *comm is not NULL, also after a failed open. */
    int  (*job_open)(void **comm, const loom_job_args *a, loom_err *err);
    void (*job_close)(void *comm);
    /* buf (count floats) becomes the reduction over the ranks, with the same bits on every rank. */
    int  (*job_all_reduce)(void *comm, float *buf, int64_t count, loom_redop op, loom_err *err);
} loom_cross_device_ops;
/* Version 1 (up to all_gather), 2 (up to all_gather_rank) and 3 (up to caps)
 * vtables are still accepted; 1 and 2 work on host memory. */
#define LOOM_CROSS_DEVICE_OPS_VERSION 4
#define LOOM_XOPS_HOST_MEM   1u /* host memory: CPU replicas */
#define LOOM_XOPS_DEVICE_MEM 2u /* device memory from the device backend's alloc: replicas on a device backend */

/* ---- strategies ------------------------------------------------------------ */

typedef struct loom_strategy loom_strategy;

/* The roles of a cluster (TensorFlow's ClusterSpec jobs), and the ones a
 * strategy uses (appliance/cluster/cluster.h): `loom check`, train and launch
 * check a cluster against its strategy's description before anything opens,
 * with the same messages for a plugin's strategy as for a built-in one. */
typedef enum { LOOM_ROLE_CHIEF, LOOM_ROLE_WORKER, LOOM_ROLE_PS, LOOM_ROLE_EVALUATOR, LOOM_ROLE_COUNT } loom_role;
typedef enum { LOOM_ROLE_ALLOWED, LOOM_ROLE_REFUSED, LOOM_ROLE_REQUIRED } loom_role_use;
#define LOOM_ROLES_ONE_PROCESS 1u /* runs in one process: a cluster of several tasks is ignored (use[] unread) */
#define LOOM_ROLES_REJOIN      2u /* a worker that fails is started again alone and rejoins (loom launch) */
typedef struct loom_cluster_roles {
    unsigned    flags;                  /* LOOM_ROLES_* */
    /* by loom_role: ALLOWED, REFUSED (no such task), REQUIRED (at least one;
     * the chief: one). Requiring and refusing neither the chief nor the
     * worker role, the cluster needs one of them. */
    uint8_t     use[LOOM_ROLE_COUNT];
    const char *why[LOOM_ROLE_COUNT];   /* what a required role is for, after its name in the error; NULL: nothing */
    const char *hint[LOOM_ROLE_COUNT];  /* the hint of an error about the role; NULL: none */
    /* (optional) the strategy's settings against the cluster's tasks per
     * role, after the roles pass (the built-ins read the loaded config;
     * a plugin may leave it NULL). */
    int (*check)(const loom_spec *spec, const int *n_tasks, const char *cluster_from, loom_err *err);
} loom_cluster_roles;

/* What the trainer gives a strategy to build its replicas: pass it to the
 * host's model_new, optimizer_new and option functions. */
typedef struct loom_strategy_args {
    const loom_spec      *spec;       /* model, optimizer, strategy, run */
    const loom_elem_spec *input;      /* the batched training element */
    int                   input_idx;  /* index of model.input in the element */
    int                   label_idx;  /* index of model.label */
    int64_t               max_batch;  /* the largest global batch */
    /* appended */
    const struct loom_cluster *cluster; /* a job across processes (appliance/cluster/cluster.h); NULL: one process */
    bool                  plan_only;  /* `loom check`: build, print the plan, open no socket */
    /* appended (strategy ops version 4) */
    int64_t               steps_per_epoch; /* batches of one pass of data.train on this task; < 0 unknown */
    int                   weight_idx1; /* model.sample_weight's feature index + 1 in the element; 0: none */
    /* appended: loom train's resume point of this task, to compare across
     * tasks that train in lock-step (key compared, text shown); NULL outside
     * loom train. A host built before this field passes a shorter struct:
     * read it only from a host of this header or later. */
    const char           *resume_key, *resume_text;
    /* appended: a graph's several model inputs (model.inputs); a plugin that
     * builds its replicas' models with loom_model_new gets one input only */
    int                   n_inputs;       /* 0 or 1: model.input alone (input_idx) */
    int                   inputs_idx[8];  /* each input's feature index; [0] = input_idx */
    /* appended: output heads (model.outputs); the host refuses heads with a plugin strategy */
    int                   n_heads;        /* 0 or 1: one output (label_idx) */
    int                   heads_idx[8];   /* each head's label feature index; [0] = label_idx */
    /* appended: the run's model_dir (loom train; NULL otherwise). A host
     * built before this field passes a shorter struct. */
    const char           *model_dir;
} loom_strategy_args;

/* Result of one step, summed over replicas. */
typedef struct loom_step_result {
    double  loss_sum; /* sum of per-example losses */
    int64_t correct;  /* correctly classified examples */
    int64_t examples;
} loom_step_result;

/* The parts of a training step, for custom steps (a Lua train_step): in
 * this order they must do exactly what train_step does, bit for bit. */
typedef enum {
    LOOM_PART_FORWARD,    /* each replica: forward on its share of the batch (dropout keyed by step) */
    LOOM_PART_LOSS,       /* each replica: the loss of its share, and its gradient w.r.t. the outputs */
    LOOM_PART_BACKWARD,   /* each replica: gradients into its flat gradient buffer */
    LOOM_PART_ALL_REDUCE, /* SUM the replicas' gradient buffers with the cross-device op */
    LOOM_PART_APPLY,      /* the optimizer's `step`-th update with the (reduced) gradients */
} loom_step_part;

/* A strategy owns its replicas and runs training steps on global batches.
 * Every function is called from the train thread. */
struct loom_peer_info;
struct loom_iter;
typedef struct loom_strategy_ops {
    uint32_t    version; /* LOOM_STRATEGY_OPS_VERSION; append fields only */
    const char *name;    /* the registry name, what strategy.type selects */
    /* Builds the replicas; store private state in s->impl. close() is called
     * even when open fails, with whatever impl holds. */
    int  (*open)(loom_strategy *s, const loom_strategy_args *a, loom_err *err);
    void (*close)(loom_strategy *s);
    /* One training step on a global batch; step = updates applied so far. */
    int  (*train_step)(loom_strategy *s, const loom_elem *batch, int64_t step, loom_step_result *out, loom_err *err);
    int  (*eval_step)(loom_strategy *s, const loom_elem *batch, loom_step_result *out, loom_err *err);
    /* The model's outputs (B, outputs) for a batch. */
    int  (*predict)(loom_strategy *s, const loom_elem *batch, float *out, loom_err *err);
    /* The replica whose variables are checkpointed, evaluated and restored, and its optimizer. */
    loom_model     *(*model)(loom_strategy *s);
    loom_optimizer *(*optimizer)(loom_strategy *s);
    /* After the variables of model() were overwritten (restore): make every replica agree. */
    int  (*sync)(loom_strategy *s, loom_err *err);
    int  (*num_replicas)(loom_strategy *s);
    /* (optional, both or neither) custom training steps; NULL: refused.
     * One part on every replica; batch is read by FORWARD and LOSS, step by
     * FORWARD and APPLY; LOSS fills per_replica[r] for r < num_replicas. */
    int  (*step_part)(loom_strategy *s, loom_step_part part, const loom_elem *batch, int64_t step,
                      loom_step_result *per_replica, loom_err *err);
    /* Replica r's model, whose gradient buffer a custom step may change (clipping). */
    loom_model *(*replica)(loom_strategy *s, int r);
    /* ---- version 2 (appended; read only when version >= 2; each optional,
     * see appliance/distribute/distribute.h): the strategy describes itself. ---- */
    unsigned caps; /* LOOM_STRATEGY_OWN_THREADS: BLAS runs single-threaded under it */
    void (*print_plan)(loom_strategy *s, int64_t global_batch, FILE *f);      /* `loom check` */
    void (*where)(loom_strategy *s, char *buf, size_t n);                     /* for the log */
    int  (*input_context)(const loom_strategy_args *a, loom_input_ctx *ctx, loom_err *err); /* before open */
    bool (*is_chief)(loom_strategy *s); /* writes checkpoints, metrics, the log's progress */
    int  (*gather_iter_state)(loom_strategy *s, const loom_buf *mine, loom_buf *stored, loom_err *err);
    int  (*pick_iter_state)(loom_strategy *s, const loom_buf *stored, loom_buf *mine, loom_err *err);
    void (*request_stop)(loom_strategy *s);
    bool (*stop_agreed)(loom_strategy *s);
    int  (*end_of_data)(loom_strategy *s, int64_t step, loom_step_result *out, bool *all_ended, loom_err *err);
    /* ---- version 3 (appended; read only when version >= 3; optional) ---- */
    /* The other tasks of a job across processes, for the status endpoint
     * (struct loom_peer_info: appliance/cluster/cluster.h); returns how many. */
    int  (*peers)(loom_strategy *s, struct loom_peer_info *out, int max);
    /* ---- version 4 (appended; read only when version >= 4; optional) ---- */
    /* A task other than the chief serves the job instead of training (a ps
     * task); train is its training iterator. NULL: every task trains. */
    int  (*serve)(loom_strategy *s, struct loom_iter *train, loom_err *err);
    /* ---- version 5 (appended; read only when version >= 5; optional) ---- */
    /* The roles of a cluster the strategy uses (above). NULL: any cluster
     * (the strategy checks when it opens). */
    const loom_cluster_roles *roles;
} loom_strategy_ops;
#define LOOM_STRATEGY_OPS_VERSION 5 /* versions 1 to 4 (without the appended fields) still register */
#define LOOM_STRATEGY_OWN_THREADS 1u

/* The instance Loom passes to every strategy function. */
struct loom_strategy {
    const loom_strategy_ops     *ops;
    const loom_cross_device_ops *xops; /* strategy.cross_device_ops, resolved; NULL for "auto":
                                          the strategy picks one (host->find_cross_device_ops) */
    const loom_strategy_args    *args;
    void                        *impl; /* the strategy's own */
    int                          failing; /* (appended) nonzero at close when the run failed */
};
#endif

#ifndef LOOM_DEVICE_H
/* ---- device backends (appliance/tensor/device.h has the full comments) ----- */

typedef struct loom_device loom_device; /* one open device: the backend's own */
typedef enum { LOOM_DEV_ACT_NONE, LOOM_DEV_ACT_RELU, LOOM_DEV_ACT_SIGMOID, LOOM_DEV_ACT_TANH } loom_dev_act;
typedef enum { LOOM_DEV_ADD, LOOM_DEV_SUB, LOOM_DEV_MUL } loom_dev_binop;
typedef enum { LOOM_DEV_SUM, LOOM_DEV_MAX } loom_dev_reduce;
enum { LOOM_DEV_STREAM_COMPUTE = 0, LOOM_DEV_STREAM_COPY = 1 };

/* A batch of NHWC images through a window: output (batch, oh, ow, cout). */
typedef struct loom_dev_window {
    int32_t batch, h, w, c;
    int32_t kh, kw, sh, sw;
    int32_t pad_t, pad_l;
    int32_t oh, ow, cout;
} loom_dev_window;

/* Memory, copies on streams and the layers' compute primitives of one kind
 * of device. Row-major; images NHWC; conv weights (kh*kw*c, cout). Compute
 * is queued on the compute stream; each returns 0 or LOOM_E* with err. */
typedef struct loom_device_ops {
    uint32_t    version; /* LOOM_DEVICE_OPS_VERSION; append fields only */
    const char *name;    /* "cuda": devices are "gpu:N" */
    int  (*probe)(char *why, size_t why_n);             /* usable devices; 0 + why ("no CUDA driver") */
    void (*describe)(int device, char *buf, size_t n);  /* one line; device -1: the libraries */
    int  (*open)(loom_device **out, int device, loom_err *err);
    void (*close)(loom_device *d);
    int  (*alloc)(loom_device *d, void **out, size_t bytes, loom_err *err);
    void (*free)(loom_device *d, void *p);
    int  (*host_alloc)(loom_device *d, void **out, size_t bytes, loom_err *err); /* pinned */
    void (*host_free)(loom_device *d, void *p);
    int (*upload)(loom_device *d, int stream, void *dst, const void *host_src, size_t bytes, loom_err *err);
    int (*download)(loom_device *d, int stream, void *host_dst, const void *src, size_t bytes, loom_err *err);
    int (*stream_wait)(loom_device *d, int waiter, int signaller, loom_err *err);
    int (*synchronize)(loom_device *d, int stream, loom_err *err); /* stream -1: all */
    int (*gemm)(loom_device *d, bool ta, bool tb, int M, int N, int K, float alpha, const float *A, int lda,
                const float *B, int ldb, float beta, float *C, int ldc, loom_err *err);
    int (*binary)(loom_device *d, loom_dev_binop op, int64_t n, const float *a, const float *b, float *out,
                  loom_err *err);
    int (*axpy)(loom_device *d, int64_t n, float alpha, const float *x, float *y, loom_err *err);
    int (*scale)(loom_device *d, int64_t n, float alpha, float *x, loom_err *err);
    int (*bias_act)(loom_device *d, loom_dev_act act, int64_t rows, int64_t cols, const float *bias, float *x,
                    loom_err *err);
    int (*act_backward)(loom_device *d, loom_dev_act act, int64_t n, const float *y, float *g, loom_err *err);
    int (*bias_grad)(loom_device *d, int64_t rows, int64_t cols, const float *g, float *db, loom_err *err);
    int (*reduce)(loom_device *d, loom_dev_reduce op, int64_t n, const float *x, float *out, loom_err *err);
    int (*softmax_xent)(loom_device *d, int64_t rows, int64_t classes, const float *z, const int32_t *labels,
                        float scale, float *loss, int32_t *hit, float *g, loom_err *err);
    int (*conv2d_forward)(loom_device *d, const loom_dev_window *g, const float *x, const float *w, const float *b,
                          float *y, float *col, loom_err *err);
    int (*conv2d_backward)(loom_device *d, const loom_dev_window *g, const float *x, const float *w,
                           const float *dy, float *dx, float *dw, float *db, float *col, loom_err *err);
    int (*maxpool_forward)(loom_device *d, const loom_dev_window *g, const float *x, float *y, int32_t *argmax,
                           loom_err *err);
    int (*maxpool_backward)(loom_device *d, const loom_dev_window *g, const float *dy, const int32_t *argmax,
                            float *dx, loom_err *err);
    /* (version 2; may be NULL: graphs with concatenate are then refused) out[r * ldo + c] = x[r * ldx + c] */
    int (*copy2d)(loom_device *d, int64_t rows, int64_t cols, const float *x, int64_t ldx, float *out, int64_t ldo,
                  loom_err *err);
} loom_device_ops;
#define LOOM_DEVICE_OPS_VERSION 2 /* 2: copy2d appended; Loom still takes a version-1 table (without it) */
#endif

/* ---- the host -------------------------------------------------------------- */

/* Everything a plugin may call. Check host->size before using a field added
 * after the ABI version you need (offsetof(loom_host, field) < host->size). */
typedef struct loom_host {
    uint32_t    abi;          /* LOOM_PLUGIN_ABI_VERSION of this Loom */
    uint32_t    size;         /* sizeof(loom_host) in this Loom */
    const char *loom_version; /* "0.1.0" */

    /* logging (to Loom's log, at its level) and errors */
    void (*log)(loom_log_level lvl, const char *fmt, ...);
    /* Fills err and returns code, so `return host->err_set(err, ...)` works; where may be NULL. */
    int  (*err_set)(loom_err *err, int code, const char *where, const char *fmt, ...);
    int  (*err_hint)(loom_err *err, const char *fmt, ...); /* returns err->code */

    /* memory: Loom's allocator (NULL on failure, never aborts) */
    void *(*alloc)(size_t n);
    void *(*calloc)(size_t count, size_t size);
    void *(*alloc_aligned)(size_t n); /* 64-byte aligned */
    void  (*free)(void *p);           /* any of the three; NULL is a no-op */

    /* the registry: the provider's origin is this plugin's file. A name
     * already taken is refused (err says by whom), as is a vtable of
     * another version. Only during init. */
    int (*register_cross_device_ops)(const loom_cross_device_ops *ops, loom_err *err);
    /* options: the keys the strategy accepts in strategy.options (NULL-
     * terminated, static; NULL = none); any other key is a config error. */
    int (*register_strategy)(const loom_strategy_ops *ops, const char *const *options, loom_err *err);
    /* A cross-device op by name (built in or a plugin's); NULL when unknown. */
    const loom_cross_device_ops *(*find_cross_device_ops)(const char *name);

    /* threads */
    int  (*num_cores)(void);
    int  (*pool_new)(loom_pool **out, int threads, loom_err *err); /* free with pool_free */
    void (*pool_free)(loom_pool *p);                               /* NULL is a no-op */
    int  (*pool_size)(const loom_pool *p);                         /* threads incl. the caller */
    /* Runs fn(arg, i) for i in [0, n) on the pool and the calling thread; returns when all are done. */
    void (*pool_run)(loom_pool *p, int n, void (*fn)(void *arg, int i), void *arg);
    /* BLAS threads, process-wide: set 1 when replicas run on threads of their own. */
    void (*blas_set_threads)(int n);

    /* strategy settings */
    int      (*replicas)(const loom_strategy_args *a);         /* strategy.replicas */
    uint64_t (*seed)(const loom_strategy_args *a);             /* run.seed */
    int      (*threads)(const loom_strategy_args *a);          /* run.threads, 0 resolved to the cores */
    /* strategy.options KEY as text, NULL when absent. */
    const char *(*option)(const loom_strategy_args *a, const char *key);
    /* strategy.options KEY as an integer in [lo, hi], def when absent; else
     * LOOM_ECONFIG naming the option's file:line. */
    int (*option_int)(const loom_strategy_args *a, const char *key, int64_t def, int64_t lo, int64_t hi,
                      int64_t *out, loom_err *err);
    uint64_t (*rng_mix)(uint64_t seed, uint64_t label); /* splits a seed into independent streams */

    /* batches: examples in a global batch (its leading dimension) */
    int64_t (*batch_size)(const loom_strategy_args *a, const loom_elem *batch);

    /* models: a replica of the configured model, parameters initialised from
     * run.seed (so replicas built alike start equal), single-threaded. Free
     * with model_free. A model is used by one thread at a time. */
    int     (*model_new)(loom_model **out, const loom_strategy_args *a, loom_err *err);
    void    (*model_free)(loom_model *m); /* NULL is a no-op */
    int64_t (*model_num_params)(const loom_model *m);
    float  *(*model_params)(loom_model *m); /* (P,) flat, borrowed */
    float  *(*model_grads)(loom_model *m);  /* (P,) flat, borrowed */
    int64_t (*model_outputs)(const loom_model *m); /* outputs per example */
    /* Forward and backward on examples [lo, hi) of batch: overwrites the
     * gradients with d(sum of their losses)/d(params) / global_batch, and
     * adds to *out (loss sum, correct, examples). rng_key seeds dropout. */
    int (*model_train_step)(loom_model *m, const loom_strategy_args *a, const loom_elem *batch, int64_t lo,
                            int64_t hi, int64_t global_batch, uint64_t rng_key, loom_step_result *out,
                            loom_err *err);
    /* Forward only on examples [lo, hi): adds to *out. */
    int (*model_evaluate)(loom_model *m, const loom_strategy_args *a, const loom_elem *batch, int64_t lo,
                          int64_t hi, loom_step_result *out, loom_err *err);
    /* Forward only on examples [lo, hi): outputs into out ((hi - lo), outputs). */
    int (*model_predict)(loom_model *m, const loom_strategy_args *a, const loom_elem *batch, int64_t lo,
                         int64_t hi, float *out, loom_err *err);

    /* optimizers: the configured optimizer for num_params parameters. */
    int    (*optimizer_new)(loom_optimizer **out, const loom_strategy_args *a, int64_t num_params, loom_err *err);
    void   (*optimizer_free)(loom_optimizer *o); /* NULL is a no-op */
    /* params -= update(grads) for the step-th update (0-based). */
    void   (*optimizer_apply)(loom_optimizer *o, float *params, const float *grads, int64_t step);
    /* The slots (momentum, Adam m and v), num_slots * P floats, borrowed. */
    float *(*optimizer_slots)(loom_optimizer *o, int *num_slots);

    /* The cluster transport between processes: NULL until Loom has one. */
    const void *cluster;

    /* A device backend, registered under ops->name (LOOM_REG_DEVICE), even
     * when it finds no device: probe() says why. Only during init. */
    int (*register_device)(const loom_device_ops *ops, loom_err *err);

    /* A dataset source, registered under ops->name (LOOM_REG_SOURCE): what
     * source.type selects. Only during init. */
    int (*register_source)(const loom_source_ops *ops, loom_err *err);
    /* A transform provider under ops->name (LOOM_REG_TRANSFORM): what a
     * map's or filter's `plugin = "NAME:function"` selects. Only during init. */
    int (*register_transform)(const loom_custom_ops *ops, loom_err *err);
    /* A layer kind under ops->name (LOOM_REG_LAYER): what a model layer's
     * `type = "NAME"` selects. Only during init. */
    int (*register_layer)(const loom_layer_ops *ops, loom_err *err);
} loom_host;

/* ---- the entry point ------------------------------------------------------- */

typedef struct loom_plugin {
    uint32_t    abi;         /* LOOM_PLUGIN_ABI_VERSION the plugin was built with; must stay first */
    uint32_t    size;        /* sizeof(loom_plugin) */
    const char *name;        /* unique among loaded plugins; what plugins.require names */
    const char *version;     /* the plugin's own, for `loom plugins` */
    const char *description; /* one line, for `loom plugins` */
    /* Registers the providers. On failure fill err (its message is shown
     * with the plugin's file) and return non-zero: the plugin is refused and
     * whatever it registered stays unused. */
    int (*init)(const loom_host *host, loom_err *err);
} loom_plugin;

/* The one symbol Loom looks up; returns a pointer to static storage. */
LOOM_PLUGIN_EXPORT const loom_plugin *loom_plugin_entry(void);

#endif
