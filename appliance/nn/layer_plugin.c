/* layer_plugin.c - plugin layer kinds (nn/layer_plugin.h): the registry's
 * LOOM_REG_LAYER entries, which host->register_layer fills. */
#include "nn/nn.h"

const loom_layer_ops *loom_layer_plugin_find(const char *type, const char **origin)
{
    if (!type || !*type) return NULL;
    return (const loom_layer_ops *)loom_registry_find(LOOM_REG_LAYER, type, origin);
}

#include <math.h>
#include <string.h>

/* A parameter tensor's initial values, from seed and the tensor's index. */
static void init_param(const loom_layer_param *p, float *v, uint64_t seed, int t)
{
    int64_t n = loom_shape_numel(&p->shape);
    int64_t fan_out = p->shape.rank ? p->shape.dim[p->shape.rank - 1] : 1, fan_in = fan_out ? n / fan_out : 1;
    loom_rng r;
    loom_rng_init(&r, seed, 0x1a7e0000u, (uint64_t)t, 0);
    for (int64_t i = 0; i < n; i++) {
        switch (p->init) {
        case LOOM_LINIT_ZEROS: v[i] = 0.0f; break;
        case LOOM_LINIT_ONES: v[i] = 1.0f; break;
        case LOOM_LINIT_CONSTANT: v[i] = p->value; break;
        case LOOM_LINIT_GLOROT_UNIFORM: {
            float lim = sqrtf(6.0f / (float)(fan_in + fan_out));
            v[i] = (2.0f * loom_rng_uniform(&r) - 1.0f) * lim;
            break;
        }
        default: v[i] = loom_rng_normal(&r) * sqrtf(2.0f / (float)(fan_in ? fan_in : 1)); break;
        }
    }
}

typedef struct lp_run_ {
    const loom_layer_ops *ops;
    void                 *inst;
    loom_layer_plan       plan;
    const loom_layer_args *a;
    int64_t               B, n_in[LOOM_LAYER_MAX_INPUTS], n_out;
    float                *x[LOOM_LAYER_MAX_INPUTS], *dx[LOOM_LAYER_MAX_INPUTS], *param[LOOM_LAYER_MAX_PARAMS],
                         *dparam[LOOM_LAYER_MAX_PARAMS], *y, *r;
    unsigned char        *scratch, *fixed;
} lp_run_;

/* forward (and with dy, backward and the parameter gradients) on examples
 * [0, B) in chunks of `chunk` examples, as the model's threads would. */
static int lp_pass(lp_run_ *p, int64_t chunk, bool back, loom_err *err)
{
    const loom_layer_plan *pl = &p->plan;
    if (pl->whole_batch) chunk = p->B;
    for (int64_t b0 = 0; b0 < p->B; b0 += chunk) {
        int64_t B = b0 + chunk <= p->B ? chunk : p->B - b0;
        const float *x[LOOM_LAYER_MAX_INPUTS];
        float *dx[LOOM_LAYER_MAX_INPUTS];
        for (int k = 0; k < p->a->n_in; k++) x[k] = p->x[k] + b0 * p->n_in[k], dx[k] = p->dx[k] + b0 * p->n_in[k];
        loom_layer_call c = {.size = sizeof c, .b0 = b0, .B = B, .global_batch = p->B, .n_in = p->a->n_in, .x = x,
                             .y = p->y + b0 * p->n_out, .param = p->param,
                             .scratch = p->scratch + (size_t)b0 * pl->scratch_per_example, .scratch_fixed = p->fixed,
                             .training = 1, .rng_key = 7, .dy = back ? p->r + b0 * p->n_out : NULL, .dx = dx,
                             .dparam = pl->whole_batch ? p->dparam : NULL};
        int rc = p->ops->forward(p->inst, &c, err);
        if (!rc && back) rc = p->ops->backward(p->inst, &c, err);
        if (rc) return rc;
    }
    if (back && !pl->whole_batch && p->ops->param_grads && pl->n_params) {
        const float *x[LOOM_LAYER_MAX_INPUTS];
        for (int k = 0; k < p->a->n_in; k++) x[k] = p->x[k];
        loom_layer_call c = {.size = sizeof c, .b0 = 0, .B = p->B, .global_batch = p->B, .n_in = p->a->n_in, .x = x,
                             .y = p->y, .param = p->param, .scratch = p->scratch, .scratch_fixed = p->fixed,
                             .training = 1, .rng_key = 7, .dy = p->r, .dx = p->dx, .dparam = p->dparam};
        return p->ops->param_grads(p->inst, &c, err);
    }
    return 0;
}

/* Zeroed parameter gradients, then forward and backward in chunks. */
static int lp_grads(lp_run_ *p, int64_t chunk, loom_err *err)
{
    for (int t = 0; t < p->plan.n_params; t++)
        if (p->dparam[t]) memset(p->dparam[t], 0, (size_t)loom_shape_numel(&p->plan.param[t].shape) * sizeof(float));
    return lp_pass(p, chunk, true, err);
}

/* L = sum(r * y) in double after a forward. */
static int lp_loss(lp_run_ *p, double *L, loom_err *err)
{
    int rc = lp_pass(p, p->B, false, err);
    double s = 0;
    for (int64_t i = 0; i < p->B * p->n_out; i++) s += (double)p->r[i] * p->y[i];
    *L = s;
    return rc;
}

static void lp_free(lp_run_ *p)
{
    for (int k = 0; k < LOOM_LAYER_MAX_INPUTS; k++) loom_free(p->x[k]), loom_free(p->dx[k]);
    for (int t = 0; t < LOOM_LAYER_MAX_PARAMS; t++) loom_free(p->param[t]), loom_free(p->dparam[t]);
    loom_free(p->y), loom_free(p->r), loom_free(p->scratch), loom_free(p->fixed);
    if (p->inst) p->ops->free(p->inst);
}

/* Central difference of L at *v, restored. */
static int lp_numeric(lp_run_ *p, float *v, float eps, double *g, loom_err *err)
{
    float keep = *v;
    double lp = 0, lm = 0;
    *v = keep + eps;
    int rc = lp_loss(p, &lp, err);
    *v = keep - eps;
    if (!rc) rc = lp_loss(p, &lm, err);
    *v = keep;
    *g = (lp - lm) / (2.0 * (double)eps);
    return rc;
}

int loom_layer_plugin_check(const loom_layer_ops *ops, const loom_layer_args *a, int64_t B, uint64_t seed,
                            double tol, double *max_err, loom_err *err)
{
    lp_run_ p = {.ops = ops, .a = a, .B = B};
    *max_err = 0;
    char why[160] = "";
    int rc = ops->build(&p.inst, a, &p.plan, err);
    if (rc) return rc;
    loom_rng r;
    loom_rng_init(&r, seed, 0x1a7e0001u, 0, 0);
    p.n_out = loom_shape_numel(&p.plan.out);
    for (int k = 0; k < a->n_in; k++) {
        p.n_in[k] = loom_shape_numel(&a->in[k]);
        p.x[k] = loom_alloc_aligned((size_t)(B * p.n_in[k]) * sizeof(float));
        p.dx[k] = loom_alloc_aligned((size_t)(B * p.n_in[k]) * sizeof(float));
        if (!p.x[k] || !p.dx[k]) goto nomem;
        /* inputs kept 0.1 away from 0, where piecewise functions bend */
        for (int64_t i = 0; i < B * p.n_in[k]; i++) {
            float u = 2.0f * loom_rng_uniform(&r) - 1.0f;
            p.x[k][i] = u + (u < 0 ? -0.1f : 0.1f);
        }
    }
    for (int t = 0; t < p.plan.n_params; t++) {
        size_t n = (size_t)loom_shape_numel(&p.plan.param[t].shape);
        p.param[t] = loom_alloc_aligned(n * sizeof(float));
        p.dparam[t] = p.plan.param[t].trainable ? loom_alloc_aligned(n * sizeof(float)) : NULL;
        if (!p.param[t] || (p.plan.param[t].trainable && !p.dparam[t])) goto nomem;
        init_param(&p.plan.param[t], p.param[t], seed, t);
    }
    p.y = loom_alloc_aligned((size_t)(B * p.n_out) * sizeof(float));
    p.r = loom_alloc_aligned((size_t)(B * p.n_out) * sizeof(float));
    p.scratch = loom_alloc_aligned((size_t)B * p.plan.scratch_per_example + 1);
    p.fixed = loom_alloc_aligned(p.plan.scratch_fixed + 1);
    if (!p.y || !p.r || !p.scratch || !p.fixed) goto nomem;
    for (int64_t i = 0; i < B * p.n_out; i++) p.r[i] = 2.0f * loom_rng_uniform(&r) - 1.0f;

    /* the analytic gradients, on the whole batch, and the same bits in chunks of one example */
    if ((rc = lp_grads(&p, B, err))) goto out;
    size_t ny = (size_t)(B * p.n_out) * sizeof(float), nx = (size_t)(B * p.n_in[0]) * sizeof(float);
    size_t np = p.plan.n_params && p.dparam[0] ? (size_t)loom_shape_numel(&p.plan.param[0].shape) * sizeof(float) : 0;
    float *ref = loom_alloc(ny + nx + np + 1);
    if (!ref) goto nomem;
    memcpy(ref, p.y, ny), memcpy((char *)ref + ny, p.dx[0], nx);
    if (np) memcpy((char *)ref + ny + nx, p.dparam[0], np);
    bool same = true;
    if (!p.plan.whole_batch && B > 1) {
        if ((rc = lp_grads(&p, 1, err))) {
            loom_free(ref);
            goto out;
        }
        same = !memcmp(ref, p.y, ny) && !memcmp((char *)ref + ny, p.dx[0], nx) &&
               (!np || !memcmp((char *)ref + ny + nx, p.dparam[0], np));
    }
    loom_free(ref);
    if (!same) {
        rc = loom_err_set(err, LOOM_ENUMERIC, a->where,
                          "layer \"%s\" (%s): forward or backward gives other bits on chunks of the batch", a->name,
                          a->type);
        loom_err_hint(err, "a row's result may depend only on that row (else set whole_batch in the plan)");
        goto out;
    }
    /* central differences of every input and parameter value */
    const float eps = 1e-3f;
    for (int k = 0; k < a->n_in && !rc; k++)
        for (int64_t i = 0; i < B * p.n_in[k] && !rc; i++) {
            double g, e;
            if ((rc = lp_numeric(&p, &p.x[k][i], eps, &g, err))) break;
            e = fabs(g - p.dx[k][i]) / fmax(1.0, fabs(g));
            if (e > *max_err) {
                *max_err = e;
                snprintf(why, sizeof why, "d/d input %d [%lld]: backward %g, central difference %g", k, (long long)i,
                         (double)p.dx[k][i], g);
            }
        }
    for (int t = 0; t < p.plan.n_params && !rc; t++) {
        if (!p.dparam[t]) continue;
        for (int64_t i = 0, n = loom_shape_numel(&p.plan.param[t].shape); i < n && !rc; i++) {
            double g, e;
            if ((rc = lp_numeric(&p, &p.param[t][i], eps, &g, err))) break;
            e = fabs(g - p.dparam[t][i]) / fmax(1.0, fabs(g));
            if (e > *max_err) {
                *max_err = e;
                snprintf(why, sizeof why, "d/d %s [%lld]: backward %g, central difference %g",
                         p.plan.param[t].name ? p.plan.param[t].name : "param", (long long)i, (double)p.dparam[t][i], g);
            }
        }
    }
    if (!rc && *max_err > tol)
        rc = loom_err_set(err, LOOM_ENUMERIC, a->where, "layer \"%s\" (%s) fails gradcheck: error %.3g > %.3g at %s",
                          a->name, a->type, *max_err, tol, why);
out:
    lp_free(&p);
    return rc;
nomem:
    lp_free(&p);
    return loom_err_set(err, LOOM_ENOMEM, a->where, "out of memory checking layer \"%s\"", a->name);
}

/* ---- plugin layers in a model ----------------------------------------------- */

#include "nn/nn_internal.h"

#include <stdio.h>

int nn_plugin_shapes_(loom_model *m, nn_layer_ *l, int li, loom_err *err)
{
    (void)li;
    const loom_layer_spec *s = &l->spec;
    l->pinst = NULL, l->pscratch = NULL, l->pplan = NULL;
    const loom_layer_ops *ops = loom_layer_plugin_find(s->plugin, NULL);
    if (!ops)
        return loom_err_set(err, LOOM_ECONFIG, l->where, "layer \"%s\": unknown layer type \"%s\"", s->name, s->plugin),
               loom_err_hint(err, "load the plugin that provides it (plugins.path, $LOOM_PLUGIN_PATH); "
                                  "`loom plugins` lists the layer types");
    if (s->n_inputs > 1)
        return loom_err_set(err, LOOM_EUNSUPPORTED, l->where,
                            "layer \"%s\" (%s): plugin layers take one input for now, not %d", s->name, s->plugin,
                            s->n_inputs);
    static _Thread_local char where[LOOM_LAYER_MAX_SETTINGS][LOOM_PATH_MAX + 16];
    loom_layer_settings st = {.n = s->settings.n};
    for (int k = 0; k < st.n; k++) {
        if (s->settings.line[k] > 0) snprintf(where[k], sizeof where[k], "%s:%d", s->loc.file, s->settings.line[k]);
        else snprintf(where[k], sizeof where[k], "--set");
        st.key[k] = s->settings.key[k], st.value[k] = s->settings.value[k], st.where[k] = where[k];
    }
    for (int k = 0; k < st.n; k++) { /* the keys the layer accepts */
        bool ok = false;
        for (int o = 0; ops->options && ops->options[o] && !ok; o++) ok = !strcmp(ops->options[o], st.key[k]);
        if (!ok)
            return loom_err_set(err, LOOM_ECONFIG, where[k], "layer \"%s\" (%s) has no setting \"%s\"", s->name,
                                s->plugin, st.key[k]);
    }
    loom_layer_args a = {.size = sizeof a, .type = s->plugin, .name = s->name, .where = l->where, .settings = &st,
                         .n_in = 1, .in = &l->in, .max_batch = m->max_batch};
    l->pplan = loom_calloc(1, sizeof *l->pplan);
    if (!l->pplan) return loom_err_set(err, LOOM_ENOMEM, l->where, "out of memory");
    l->pops = ops;
    int rc = ops->build(&l->pinst, &a, l->pplan, err);
    if (rc) {
        if (!err->where[0]) snprintf(err->where, sizeof err->where, "%.*s", (int)sizeof err->where - 1, l->where);
        return rc;
    }
    const loom_layer_plan *p = l->pplan;
    if (p->whole_batch || p->scratch_fixed)
        return loom_err_set(err, LOOM_EUNSUPPORTED, l->where,
                            "layer \"%s\" (%s): %s plugin layers are not run by the model yet", s->name, s->plugin,
                            p->whole_batch ? "whole_batch" : "scratch_fixed");
    if (p->n_params < 0 || p->n_params > LOOM_LAYER_MAX_PARAMS || p->out.rank < 0 || p->out.rank > LOOM_MAX_RANK)
        return loom_err_set(err, LOOM_EPLUGIN, l->where, "layer \"%s\" (%s): build() declared %d parameter tensors "
                            "(at most %d) or an output of rank %d", s->name, s->plugin, p->n_params,
                            LOOM_LAYER_MAX_PARAMS, p->out.rank);
    if (p->n_params && !ops->param_grads)
        return loom_err_set(err, LOOM_EPLUGIN, l->where, "layer \"%s\" (%s) has parameters but no param_grads",
                            s->name, s->plugin);
    l->out = p->out;
    for (int t = 0; t < p->n_params; t++) {
        const loom_layer_param *q = &p->param[t];
        if (!q->trainable)
            return loom_err_set(err, LOOM_EUNSUPPORTED, l->where,
                                "layer \"%s\" (%s): state parameters (trainable = 0) are not run by the model yet",
                                s->name, s->plugin);
        int64_t n = loom_shape_numel(&q->shape), fout = q->shape.rank ? q->shape.dim[q->shape.rank - 1] : 1;
        int init = q->init == LOOM_LINIT_ZEROS ? LOOM_INIT_ZEROS
                   : q->init == LOOM_LINIT_ONES ? NN_INIT_ONES_
                   : q->init == LOOM_LINIT_CONSTANT ? NN_INIT_CONST_
                   : q->init == LOOM_LINIT_HE_NORMAL ? LOOM_INIT_HE_NORMAL : LOOM_INIT_GLOROT_UNIFORM;
        double fin = init == NN_INIT_CONST_ ? (double)q->value : (double)(fout ? n / fout : 1);
        int64_t off = nn_add_param_(m, l, q->name ? q->name : "param", &q->shape, init, fin, (double)fout);
        l->poff[t] = off;
        if (t == 0) l->kernel_off = off;
    }
    return LOOM_OK;
}

bool nn_plugin_buffers_(nn_layer_ *l, int64_t max_batch)
{
    size_t outs = (size_t)(max_batch * l->n_out) * sizeof(float);
    if (!(l->y = loom_alloc_aligned(outs)) || !(l->dz = loom_alloc_aligned(outs))) return false;
    return (l->pscratch = loom_alloc_aligned((size_t)max_batch * l->pplan->scratch_per_example + 64)) != NULL;
}

void nn_plugin_free_(nn_layer_ *l)
{
    if (l->pinst) l->pops->free(l->pinst);
    loom_free(l->pscratch);
    loom_free(l->pplan);
    l->pinst = NULL, l->pscratch = NULL, l->pplan = NULL;
}

static loom_layer_call plugin_call(const nn_layer_ *l, int64_t b0, int64_t B,
                                   const float *const *x, float *const *param)
{
    return (loom_layer_call){.size = sizeof(loom_layer_call), .b0 = b0, .B = B, .global_batch = 0,
                             .n_in = 1, .x = x, .y = l->y + b0 * l->n_out, .param = param,
                             .scratch = l->pscratch + (size_t)b0 * l->pplan->scratch_per_example};
}

/* A plugin's failure in a step: the first is kept (the chunks run on several
 * threads) and fails the step when it ends (nn_plugin_error_), so training
 * never goes on from outputs or gradients the plugin did not write. */
static void plugin_failed(const loom_model *cm, const nn_layer_ *l, const char *what, const loom_err *e)
{
    loom_model *m = (loom_model *)cm; /* only plugin_rc/err, claimed once */
    int none = 0;
    if (!__atomic_compare_exchange_n(&m->plugin_rc, &none, -1, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) return;
    loom_err_set(&m->plugin_err, LOOM_EPLUGIN, l->where, "layer \"%s\" (%s) %s failed: %s",
                 l->spec.name, l->spec.plugin, what, e->msg[0] ? e->msg : "(the plugin gave no message)");
    if (e->hint[0]) loom_err_hint(&m->plugin_err, "%s", e->hint);
    __atomic_store_n(&m->plugin_rc, m->plugin_err.code, __ATOMIC_RELEASE);
}

int nn_plugin_error_(loom_model *m, loom_err *err)
{
    int rc = __atomic_load_n(&m->plugin_rc, __ATOMIC_ACQUIRE);
    if (!rc) return LOOM_OK;
    if (err) *err = m->plugin_err;
    m->plugin_rc = 0;
    memset(&m->plugin_err, 0, sizeof m->plugin_err);
    return rc;
}

void nn_plugin_forward_(const loom_model *m, int li, nn_chunk_ *c, const float *x, float *y, int training,
                        uint64_t rng_key)
{
    const nn_layer_ *l = &m->layer[li];
    (void)y;
    float *param[LOOM_LAYER_MAX_PARAMS];
    for (int t = 0; t < l->pplan->n_params; t++) param[t] = m->params + l->poff[t];
    loom_layer_call call = plugin_call(l, c->b0, c->B, &x, param);
    call.training = training, call.rng_key = rng_key;
    loom_err e = {0};
    if (l->pops->forward(l->pinst, &call, &e)) plugin_failed(m, l, "forward", &e);
}

float *nn_plugin_backward_(const loom_model *m, int li, nn_chunk_ *c, float *g, float *other)
{
    const nn_layer_ *l = &m->layer[li];
    const int64_t row0 = c->b0 * l->n_out;
    const float *x = c->act[li];
    memcpy(l->dz + row0, g, (size_t)(c->B * l->n_out) * sizeof *g); /* dy, for param_grads */
    float *param[LOOM_LAYER_MAX_PARAMS];
    for (int t = 0; t < l->pplan->n_params; t++) param[t] = m->params + l->poff[t];
    loom_layer_call call = plugin_call(l, c->b0, c->B, &x, param);
    float *dx[1] = {other};
    call.dy = l->dz + row0, call.dx = dx, call.training = 1;
    loom_err e = {0};
    if (l->pops->backward(l->pinst, &call, &e)) plugin_failed(m, l, "backward", &e);
    return other;
}

void nn_plugin_param_grads_(loom_model *m, int li, const float *x, int64_t B)
{
    const nn_layer_ *l = &m->layer[li];
    if (!l->pplan->n_params) return;
    float *param[LOOM_LAYER_MAX_PARAMS], *dparam[LOOM_LAYER_MAX_PARAMS];
    for (int t = 0; t < l->pplan->n_params; t++) {
        param[t] = m->params + l->poff[t];
        dparam[t] = m->grads + l->poff[t];
        memset(dparam[t], 0, (size_t)loom_shape_numel(&l->pplan->param[t].shape) * sizeof(float));
    }
    loom_layer_call call = plugin_call(l, 0, B, &x, param);
    call.dy = l->dz, call.dparam = dparam, call.training = 1;
    loom_err e = {0};
    if (l->pops->param_grads(l->pinst, &call, &e)) plugin_failed(m, l, "param_grads", &e);
}

int loom_model_plugin_onnx(loom_model *m, const loom_layer_spec *s, loom_layer_onnx *node, int *n_params, loom_shape *out,
                           loom_err *err)
{
    for (int i = 0; i < m->n_layers; i++) {
        const nn_layer_ *l = &m->layer[i];
        if (&l->spec != s || l->spec.kind != LOOM_LAYER_PLUGIN) continue;
        memset(node, 0, sizeof *node);
        *n_params = l->pplan->n_params;
        *out = l->out;
        if (!l->pops->onnx)
            return loom_err_set(err, LOOM_EUNSUPPORTED, l->where, "layer \"%s\" (%s) has no ONNX form: its plugin "
                                "has no onnx function", s->name, s->plugin);
        int rc = l->pops->onnx(l->pinst, node, err);
        if (!rc && (!node->op_type[0] || node->n_attr < 0 || node->n_attr > 4))
            rc = loom_err_set(err, LOOM_EPLUGIN, l->where, "layer \"%s\" (%s): its onnx function gave no op_type or "
                              "%d attributes (at most 4)", s->name, s->plugin, node->n_attr);
        return rc;
    }
    return loom_err_set(err, LOOM_EUNSUPPORTED, NULL, "layer \"%s\" is not a plugin layer of this model", s->name);
}
