/* layer_plugin.h - layer kinds provided by plugins (model.layers `type =
 * NAME` of a registered LOOM_REG_LAYER): the vtable a plugin registers
 * with host->register_layer. plugins/loom_plugin.h restates it (for
 * plugins) and appliance/plugin/abi_check.c proves both agree. */
#ifndef LOOM_NN_LAYER_PLUGIN_H
#define LOOM_NN_LAYER_PLUGIN_H

#include "config/config.h"
#include "tensor/tensor.h"

#define LOOM_LAYER_OPS_VERSION 1
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

/* A plugin layer kind by name (the registry's LOOM_REG_LAYER); NULL when none. */
const loom_layer_ops *loom_layer_plugin_find(const char *type, const char **origin);


/* The ONNX node of model m's plugin layer s (its spec as
 * loom_model_layer_spec returns it), its count of parameter tensors and
 * its output shape per example;
 * LOOM_EUNSUPPORTED naming the layer when the plugin has no onnx(). */
struct loom_model;
int loom_model_plugin_onnx(struct loom_model *m, const loom_layer_spec *s, loom_layer_onnx *node, int *n_params,
                           loom_shape *out, loom_err *err);

/* Gradcheck of a plugin layer on its own (what `loom check --gradcheck`
 * does for a model's layers): builds it with a (inputs per example), gives
 * its parameters their initial values from seed and checks, on B random
 * examples (inputs 0.1 away from 0) and L = sum(r * y) with random r, that
 * the backward's input and parameter gradients match central differences
 * within tol (|a - n| / max(1, |n|); *max_err the worst), and that with no
 * parameters the outputs and input gradients are the same bits on chunks of
 * one example as on the whole batch. LOOM_ENUMERIC naming the layer and the
 * worst value when not; the layer's own errors as it returns them. */
int loom_layer_plugin_check(const loom_layer_ops *ops, const loom_layer_args *a, int64_t B, uint64_t seed,
                            double tol, double *max_err, loom_err *err);

#endif
