/* layer_examples.c - two more example plugin layers (docs/plugins.md,
 * "Write a layer"), for what layer_prelu does not show:
 *
 * "weighted_add": several inputs (a merge of your own), one learned weight
 * per input:   y = sum_k w[k] * x_k      (inputs of one shape; w starts at 1)
 *     { type = "weighted_add"; name = "mix"; inputs = ["a", "b"]; }
 * It works per example, so Loom runs it on chunks of the batch on several
 * threads; w's gradient is summed in param_grads over the whole batch.
 *
 * "running_norm": state (trainable = 0) and whole_batch: each channel (the
 * last axis) centred on the batch's mean in training and on a moving mean
 * otherwise, then scaled by a learned gamma:
 *     training:   y = gamma * (x - mean_batch),  moving = m * moving + (1 - m) * mean_batch
 *     inference:  y = gamma * (x - moving)
 *     { type = "running_norm"; momentum = 0.9; }
 * The moving mean is state, as batch normalization's moving statistics:
 * updated by forward in a training step, saved in checkpoints, never in the
 * optimizer; whole_batch = 1 gives forward and backward the whole batch in
 * one call on one thread (the batch's mean, and one update per step), and
 * backward then adds gamma's gradient itself (no param_grads).
 *
 * Built by plugins/meson.build; by hand:
 *     cc -shared -fPIC -O2 -I <loom>/plugins layer_examples.c -o layer_examples.so */
#include "loom_plugin.h"

#include <stdlib.h>
#include <string.h>

static const loom_host *host;

/* ---- weighted_add ------------------------------------------------------------- */

typedef struct wadd {
    int     n_in;
    int64_t n; /* values per example */
} wadd;

static int wadd_build(void **inst, const loom_layer_args *a, loom_layer_plan *plan, loom_err *err)
{
    if (a->n_in < 2)
        return host->err_set(err, LOOM_ECONFIG, a->where, "layer \"%s\" (weighted_add) takes 2 or more inputs "
                             "(inputs = [\"a\", \"b\"]), not %d", a->name, a->n_in);
    for (int k = 1; k < a->n_in; k++) {
        bool same = a->in[k].rank == a->in[0].rank;
        for (int d = 0; same && d < a->in[0].rank; d++) same = a->in[k].dim[d] == a->in[0].dim[d];
        if (!same)
            return host->err_set(err, LOOM_ESHAPE, a->where, "layer \"%s\" (weighted_add): input %d's shape is not "
                                 "input 0's", a->name, k);
    }
    wadd *p = host->calloc(1, sizeof *p);
    if (!p) return host->err_set(err, LOOM_ENOMEM, a->where, "out of memory");
    p->n_in = a->n_in;
    p->n = 1;
    for (int d = 0; d < a->in[0].rank; d++) p->n *= a->in[0].dim[d];
    plan->out = a->in[0];
    plan->n_params = 1;
    plan->param[0] = (loom_layer_param){.name = "w", .shape = {.rank = 1, .dim = {a->n_in}},
                                        .init = LOOM_LINIT_ONES, .trainable = 1};
    *inst = p;
    return 0;
}

static void ex_free(void *inst) { host->free(inst); }

static int wadd_forward(void *inst, const loom_layer_call *c, loom_err *err)
{
    (void)err;
    const wadd *p = inst;
    const float *w = c->param[0];
    for (int64_t i = 0, n = c->B * p->n; i < n; i++) {
        float v = w[0] * c->x[0][i];
        for (int k = 1; k < p->n_in; k++) v += w[k] * c->x[k][i];
        c->y[i] = v;
    }
    return 0;
}

/* dx_k = w[k] dy (an input nobody needs the gradient of has dx[k] NULL) */
static int wadd_backward(void *inst, const loom_layer_call *c, loom_err *err)
{
    (void)err;
    const wadd *p = inst;
    const float *w = c->param[0];
    for (int k = 0; k < p->n_in; k++)
        for (int64_t i = 0, n = c->B * p->n; c->dx[k] && i < n; i++) c->dx[k][i] = w[k] * c->dy[i];
    return 0;
}

/* dw[k] = sum of dy * x_k over the batch, in example order */
static int wadd_param_grads(void *inst, const loom_layer_call *c, loom_err *err)
{
    (void)err;
    const wadd *p = inst;
    for (int k = 0; k < p->n_in; k++) {
        double s = 0;
        for (int64_t i = 0, n = c->B * p->n; i < n; i++) s += (double)c->dy[i] * c->x[k][i];
        c->dparam[0][k] += (float)s;
    }
    return 0;
}

static const char *const no_options[] = {NULL};

static const loom_layer_ops wadd_ops = {
    .version = LOOM_LAYER_OPS_VERSION,
    .name = "weighted_add",
    .options = no_options,
    .build = wadd_build,
    .free = ex_free,
    .forward = wadd_forward,
    .backward = wadd_backward,
    .param_grads = wadd_param_grads,
};

/* ---- running_norm ---------------------------------------------------------------- */

typedef struct rnorm {
    int64_t C, R; /* channels (the last axis), rows of them per example */
    float   momentum;
    double *mean; /* (C,) the batch's mean, forward to backward */
} rnorm;

static const char *const rnorm_options[] = {"momentum", NULL};

static int rnorm_build(void **inst, const loom_layer_args *a, loom_layer_plan *plan, loom_err *err)
{
    if (a->n_in != 1)
        return host->err_set(err, LOOM_ECONFIG, a->where, "layer \"%s\" (running_norm) takes one input, not %d",
                             a->name, a->n_in);
    const loom_shape *in = &a->in[0];
    if (in->rank < 1)
        return host->err_set(err, LOOM_ESHAPE, a->where, "layer \"%s\" (running_norm) needs a channel axis",
                             a->name);
    float mom = 0.99f;
    for (int i = 0; i < a->settings->n; i++) {
        char *end;
        mom = strtof(a->settings->value[i], &end);
        if (end == a->settings->value[i] || *end || !(mom >= 0.f && mom < 1.f))
            return host->err_set(err, LOOM_ECONFIG, a->settings->where[i], "momentum = %s is not a number in [0, 1)",
                                 a->settings->value[i]);
    }
    rnorm *p = host->calloc(1, sizeof *p);
    if (!p) return host->err_set(err, LOOM_ENOMEM, a->where, "out of memory");
    p->C = in->dim[in->rank - 1];
    p->R = 1;
    for (int d = 0; d + 1 < in->rank; d++) p->R *= in->dim[d];
    p->momentum = mom;
    if (!(p->mean = host->calloc((size_t)p->C, sizeof *p->mean))) {
        host->free(p);
        return host->err_set(err, LOOM_ENOMEM, a->where, "out of memory");
    }
    plan->out = *in;
    plan->n_params = 2;
    plan->param[0] = (loom_layer_param){.name = "gamma", .shape = {.rank = 1, .dim = {p->C}},
                                        .init = LOOM_LINIT_ONES, .trainable = 1};
    plan->param[1] = (loom_layer_param){.name = "moving_mean", .shape = {.rank = 1, .dim = {p->C}},
                                        .init = LOOM_LINIT_ZEROS, .trainable = 0};
    plan->whole_batch = 1;
    *inst = p;
    return 0;
}

static void rnorm_free(void *inst)
{
    rnorm *p = inst;
    host->free(p->mean);
    host->free(p);
}

/* The batch's mean per channel into p->mean (double, rows in order). */
static void batch_mean(rnorm *p, const float *x, int64_t rows)
{
    for (int64_t ch = 0; ch < p->C; ch++) p->mean[ch] = 0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t ch = 0; ch < p->C; ch++) p->mean[ch] += x[r * p->C + ch];
    for (int64_t ch = 0; ch < p->C; ch++) p->mean[ch] /= (double)(rows ? rows : 1);
}

static int rnorm_forward(void *inst, const loom_layer_call *c, loom_err *err)
{
    (void)err;
    rnorm *p = inst;
    const int64_t rows = c->B * p->R;
    const float *x = c->x[0], *gamma = c->param[0];
    float *moving = c->param[1];
    if (c->training) {
        batch_mean(p, x, rows);
        for (int64_t ch = 0; ch < p->C; ch++) /* the state, once per training batch */
            moving[ch] = p->momentum * moving[ch] + (1.f - p->momentum) * (float)p->mean[ch];
    } else {
        for (int64_t ch = 0; ch < p->C; ch++) p->mean[ch] = moving[ch];
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t ch = 0; ch < p->C; ch++)
            c->y[r * p->C + ch] = gamma[ch] * (x[r * p->C + ch] - (float)p->mean[ch]);
    return 0;
}

/* y = gamma (x - mean(x)): dx = gamma dy - mean(gamma dy) per channel; dgamma = sum dy (x - mean) */
static int rnorm_backward(void *inst, const loom_layer_call *c, loom_err *err)
{
    (void)err;
    rnorm *p = inst;
    const int64_t rows = c->B * p->R;
    const float *x = c->x[0], *gamma = c->param[0], *dy = c->dy;
    batch_mean(p, x, rows);
    for (int64_t ch = 0; ch < p->C; ch++) {
        double sdy = 0, sg = 0;
        for (int64_t r = 0; r < rows; r++) {
            sdy += dy[r * p->C + ch];
            sg += (double)dy[r * p->C + ch] * (x[r * p->C + ch] - (float)p->mean[ch]);
        }
        if (c->dparam[0]) c->dparam[0][ch] += (float)sg;
        const float m = (float)(sdy / (double)(rows ? rows : 1));
        for (int64_t r = 0; c->dx[0] && r < rows; r++) c->dx[0][r * p->C + ch] = gamma[ch] * (dy[r * p->C + ch] - m);
    }
    return 0;
}

static const loom_layer_ops rnorm_ops = {
    .version = LOOM_LAYER_OPS_VERSION,
    .name = "running_norm",
    .options = rnorm_options,
    .build = rnorm_build,
    .free = rnorm_free,
    .forward = rnorm_forward,
    .backward = rnorm_backward, /* whole_batch: gamma's gradient here too, no param_grads */
};

static int ex_init(const loom_host *h, loom_err *err)
{
    host = h;
    if (h->size < offsetof(loom_host, register_layer) + sizeof h->register_layer)
        return h->err_set(err, LOOM_EPLUGIN, NULL, "this loom has no layer plugins (host table too old)");
    int rc = h->register_layer(&wadd_ops, err);
    return rc ? rc : h->register_layer(&rnorm_ops, err);
}

LOOM_PLUGIN_EXPORT const loom_plugin *loom_plugin_entry(void)
{
    static const loom_plugin plugin = {
        .abi = LOOM_PLUGIN_ABI_VERSION,
        .size = sizeof(loom_plugin),
        .name = "layer_examples",
        .version = "1.0",
        .description = "layers \"weighted_add\" (several inputs) and \"running_norm\" (state, whole_batch): "
                       "example plugin layers",
        .init = ex_init,
    };
    return &plugin;
}
