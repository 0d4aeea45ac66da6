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

#include "data/data.h"
#include "nn/nn.h"

/* ---- cross-device ops ---------------------------------------------------- */

typedef enum { LOOM_REDUCE_SUM, LOOM_REDUCE_MEAN, LOOM_REDUCE_MAX } loom_redop;

typedef struct loom_cross_device_ops {
    uint32_t    version; /* LOOM_CROSS_DEVICE_OPS_VERSION; append fields only */
    const char *name;    /* "reduce_to_one_device", "ring", a plugin's name */
    /* bufs[0..n) each hold count floats; afterwards each holds the reduction. */
    int (*all_reduce)(float *const *bufs, int n, int64_t count, loom_redop op, loom_err *err);
    /* bufs[root] copied into every other buffer. */
    int (*broadcast)(float *const *bufs, int n, int64_t count, int root, loom_err *err);
    /* (optional) out = concat(bufs[0..n)), each count floats; NULL => generic copy */
    int (*all_gather)(float *const *bufs, int n, int64_t count, float *out, loom_err *err);
} loom_cross_device_ops;
#define LOOM_CROSS_DEVICE_OPS_VERSION 1

/* ---- strategies ---------------------------------------------------------- */

typedef struct loom_strategy loom_strategy;

/* What the trainer gives a strategy to build its replicas. */
typedef struct loom_strategy_args {
    const loom_spec      *spec;       /* model, optimizer, strategy, run */
    const loom_elem_spec *input;      /* the batched training element */
    int                   input_idx;  /* index of model.input in the element */
    int                   label_idx;  /* index of model.label */
    int64_t               max_batch;  /* the largest global batch */
} loom_strategy_args;

/* Result of one step, summed over replicas. */
typedef struct loom_step_result {
    double  loss_sum; /* sum of per-example losses */
    int64_t correct;  /* correctly classified examples */
    int64_t examples;
} loom_step_result;

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
} loom_strategy_ops;
#define LOOM_STRATEGY_OPS_VERSION 1

struct loom_strategy {
    const loom_strategy_ops     *ops;
    const loom_cross_device_ops *xops;
    const loom_strategy_args    *args;
    void                        *impl;
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
const loom_cross_device_ops *loom_find_cross_device_ops(const char *name);
/* "one_device, ..." into buf, for error messages. */
char *loom_strategy_names(char *buf, size_t n);
char *loom_cross_device_ops_names(char *buf, size_t n);

/* Creates the strategy the spec names. Free with loom_strategy_close. */
int  loom_strategy_open(loom_strategy **out, const loom_strategy_args *a, loom_err *err);
void loom_strategy_close(loom_strategy *s); /* NULL is a no-op */

/* Thin wrappers over the vtable. */
int  loom_strategy_train_step(loom_strategy *s, const loom_elem *batch, int64_t step, loom_step_result *out,
                              loom_err *err);
int  loom_strategy_eval_step(loom_strategy *s, const loom_elem *batch, loom_step_result *out, loom_err *err);
int  loom_strategy_predict(loom_strategy *s, const loom_elem *batch, float *out, loom_err *err);
loom_model     *loom_strategy_model(loom_strategy *s);
loom_optimizer *loom_strategy_optimizer(loom_strategy *s);
int  loom_strategy_sync(loom_strategy *s, loom_err *err);
int  loom_strategy_num_replicas(loom_strategy *s);

/* Generic all-reduce over n buffers with a cross-device op (n == 1 is a no-op). */
int loom_all_reduce(const loom_cross_device_ops *x, float *const *bufs, int n, int64_t count, loom_redop op,
                    loom_err *err);

#endif
