/* layer_prelu.c - the example plugin layer (docs/plugins.md, "Write a
 * layer"): PReLU, Keras's PReLU with shared_axes over every axis but the
 * last, so one learned slope per channel:
 *
 *     y = x                 where x >= 0
 *     y = alpha[c] * x      where x <  0      (c: the last axis)
 *
 * In a config:  { type = "prelu"; alpha_init = 0.25; }
 *
 * Shapes: any input (..., C) -> the same shape; one parameter tensor,
 * alpha (C,), starting at alpha_init (default 0.25, as PyTorch's PReLU).
 * forward and backward work per example, so Loom runs them on chunks of the
 * batch on several threads; alpha's gradient is summed in param_grads once
 * over the whole batch in example order, so the bits do not depend on the
 * number of threads. No scratch: the backward needs only x.
 *
 * Built by plugins/meson.build; by hand:
 *     cc -shared -fPIC -O2 -I <loom>/plugins layer_prelu.c -o layer_prelu.so
 * (the test builds it also with -DLOOM_PRELU_BROKEN, a backward with a
 * wrong dx that gradcheck must catch, and -DLOOM_PRELU_VERSION=99.) */
#include "loom_plugin.h"

#include <stdlib.h>
#include <math.h>
#include <string.h>

#ifndef LOOM_PRELU_VERSION
#define LOOM_PRELU_VERSION LOOM_LAYER_OPS_VERSION
#endif
#if defined(LOOM_PRELU_BROKEN) /* the test's variants load beside the real one under names of their own */
#define PRELU_NAME_ "_broken"
#elif LOOM_PRELU_VERSION != LOOM_LAYER_OPS_VERSION
#define PRELU_NAME_ "_v99"
#else
#define PRELU_NAME_ ""
#endif

static const loom_host *host;

typedef struct prelu {
    int64_t C;     /* channels: the last axis */
    int64_t n;     /* values per example */
} prelu;

static const char *const prelu_options[] = {"alpha_init", NULL};

static int prelu_build(void **inst, const loom_layer_args *a, loom_layer_plan *plan, loom_err *err)
{
    if (a->n_in != 1)
        return host->err_set(err, LOOM_ECONFIG, a->where, "layer \"%s\" (prelu) takes one input, not %d", a->name,
                             a->n_in);
    const loom_shape *in = &a->in[0];
    if (in->rank < 1 || in->dim[in->rank - 1] < 1)
        return host->err_set(err, LOOM_ESHAPE, a->where,
                             "layer \"%s\" (prelu) needs an input with a channel axis (rank >= 1), got rank %d",
                             a->name, in->rank);
    float alpha0 = 0.25f;
    for (int i = 0; i < a->settings->n; i++) {
        if (strcmp(a->settings->key[i], "alpha_init") != 0) continue;
        char *end;
        alpha0 = strtof(a->settings->value[i], &end);
        if (end == a->settings->value[i] || *end)
            return host->err_set(err, LOOM_ECONFIG, a->settings->where[i],
                                 "alpha_init = %s is not a number", a->settings->value[i]);
    }
    prelu *p = host->calloc(1, sizeof *p);
    if (!p) return host->err_set(err, LOOM_ENOMEM, a->where, "out of memory");
    p->C = in->dim[in->rank - 1];
    p->n = 1;
    for (int d = 0; d < in->rank; d++) p->n *= in->dim[d];
    plan->out = *in;
    plan->n_params = 1;
    plan->param[0] = (loom_layer_param){.name = "alpha", .shape = {.rank = 1, .dim = {p->C}},
                                        .init = LOOM_LINIT_CONSTANT, .value = alpha0, .trainable = 1};
    plan->scratch_per_example = 0;
    plan->whole_batch = 0;
    *inst = p;
    return 0;
}

static void prelu_free(void *inst) { host->free(inst); }

static int prelu_forward(void *inst, const loom_layer_call *c, loom_err *err)
{
    const prelu *p = inst;
    const float *x = c->x[0], *alpha = c->param[0];
    for (int64_t k = 0; k < p->C; k++) /* a slope gone non-finite would spread to every output */
        if (!isfinite(alpha[k]))
            return host->err_set(err, LOOM_ENUMERIC, NULL, "alpha of channel %lld is %g", (long long)k,
                                 (double)alpha[k]);
    for (int64_t i = 0, n = c->B * p->n; i < n; i++) {
        float v = x[i];
        c->y[i] = v >= 0.0f ? v : alpha[i % p->C] * v;
    }
    return 0;
}

/* dx = dy where x >= 0, alpha[c] * dy elsewhere. */
static int prelu_backward(void *inst, const loom_layer_call *c, loom_err *err)
{
    (void)err;
    const prelu *p = inst;
    if (!c->dx[0]) return 0;
    const float *x = c->x[0], *alpha = c->param[0];
    for (int64_t i = 0, n = c->B * p->n; i < n; i++) {
#ifdef LOOM_PRELU_BROKEN
        (void)x, (void)alpha;
        c->dx[0][i] = c->dy[i]; /* wrong below zero: gradcheck must catch it */
#else
        c->dx[0][i] = x[i] >= 0.0f ? c->dy[i] : alpha[i % p->C] * c->dy[i];
#endif
    }
    return 0;
}

/* d alpha[c] = sum of dy * x over the values of channel c where x < 0, in order. */
static int prelu_param_grads(void *inst, const loom_layer_call *c, loom_err *err)
{
    (void)err;
    const prelu *p = inst;
    const float *x = c->x[0];
    float *da = c->dparam[0];
    for (int64_t i = 0, n = c->B * p->n; i < n; i++)
        if (x[i] < 0.0f) da[i % p->C] += c->dy[i] * x[i];
    return 0;
}

#ifndef LOOM_PRELU_BROKEN
/* ONNX's PRelu broadcasts slope (C,) along the last axis: our layout. */
static int prelu_onnx(void *inst, loom_layer_onnx *node, loom_err *err)
{
    (void)inst, (void)err;
    strcpy(node->op_type, "PRelu");
    node->n_attr = 0;
    return 0;
}
#endif

static const loom_layer_ops prelu_ops = {
    .version = LOOM_PRELU_VERSION,
    .name = "prelu" PRELU_NAME_,
    .options = prelu_options,
    .build = prelu_build,
    .free = prelu_free,
    .forward = prelu_forward,
    .backward = prelu_backward,
    .param_grads = prelu_param_grads,
#ifndef LOOM_PRELU_BROKEN
    .onnx = prelu_onnx, /* optional: the broken build has none (export refuses it) */
#endif
};

static int prelu_init(const loom_host *h, loom_err *err)
{
    host = h;
    if (h->size < offsetof(loom_host, register_layer) + sizeof h->register_layer)
        return h->err_set(err, LOOM_EPLUGIN, NULL, "this loom has no layer plugins (host table too old)");
    return h->register_layer(&prelu_ops, err);
}

LOOM_PLUGIN_EXPORT const loom_plugin *loom_plugin_entry(void)
{
    static const loom_plugin plugin = {
        .abi = LOOM_PLUGIN_ABI_VERSION,
        .size = sizeof(loom_plugin),
        .name = "layer_prelu" PRELU_NAME_,
        .version = "1.0",
        .description = "layer \"prelu\": PReLU with a learned slope per channel (the example plugin layer)",
        .init = prelu_init,
    };
    return &plugin;
}
