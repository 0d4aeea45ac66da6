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

/* The build's arguments for layer l: its settings (with their file:line in where[]) and its inputs' shapes. */
typedef struct plugin_args_ {
    loom_layer_args     a;
    loom_layer_settings st;
    char                where[LOOM_LAYER_MAX_SETTINGS][LOOM_PATH_MAX + 16];
} plugin_args_;

static int plugin_args(const loom_model *m, const nn_layer_ *l, const loom_layer_ops *ops, plugin_args_ *pa,
                       loom_err *err)
{
    const loom_layer_spec *s = &l->spec;
    pa->st = (loom_layer_settings){.n = s->settings.n};
    for (int k = 0; k < pa->st.n; k++) {
        if (s->settings.line[k] > 0) snprintf(pa->where[k], sizeof pa->where[k], "%s:%d", s->loc.file, s->settings.line[k]);
        else snprintf(pa->where[k], sizeof pa->where[k], "--set");
        pa->st.key[k] = s->settings.key[k], pa->st.value[k] = s->settings.value[k], pa->st.where[k] = pa->where[k];
    }
    for (int k = 0; k < pa->st.n; k++) { /* the keys the layer accepts */
        bool ok = false;
        for (int o = 0; ops->options && ops->options[o] && !ok; o++) ok = !strcmp(ops->options[o], pa->st.key[k]);
        if (!ok)
            return loom_err_set(err, LOOM_ECONFIG, pa->where[k], "layer \"%s\" (%s) has no setting \"%s\"", s->name,
                                s->plugin, pa->st.key[k]);
    }
    pa->a = (loom_layer_args){.size = sizeof pa->a, .type = s->plugin, .name = s->name, .where = l->where,
                              .settings = &pa->st, .n_in = l->n_src, .in = l->src_shape, .max_batch = m->max_batch};
    return LOOM_OK;
}

/* The plan's parameters into the flat buffer: the first trainable tensor is the layer's kernel (model.l2, the
 * gradient pass); state (trainable = 0) needs whole_batch: it is updated once per batch, on one thread. */
static int plugin_params(loom_model *m, nn_layer_ *l, loom_err *err)
{
    const loom_layer_plan *p = l->pplan;
    const loom_layer_spec *s = &l->spec;
    for (int t = 0; t < p->n_params; t++) {
        const loom_layer_param *q = &p->param[t];
        if (!q->trainable && !p->whole_batch)
            return loom_err_set(err, LOOM_EPLUGIN, l->where,
                                "layer \"%s\" (%s): state parameter \"%s\" (trainable = 0) without whole_batch",
                                s->name, s->plugin, q->name ? q->name : "param"),
                   loom_err_hint(err, "a layer with state sets plan->whole_batch = 1: its forward updates the state "
                                      "once per batch, on one thread (as batch normalization's moving statistics)");
        int64_t n = loom_shape_numel(&q->shape), fout = q->shape.rank ? q->shape.dim[q->shape.rank - 1] : 1;
        int init = q->init == LOOM_LINIT_ZEROS ? LOOM_INIT_ZEROS
                   : q->init == LOOM_LINIT_ONES ? NN_INIT_ONES_
                   : q->init == LOOM_LINIT_CONSTANT ? NN_INIT_CONST_
                   : q->init == LOOM_LINIT_HE_NORMAL ? LOOM_INIT_HE_NORMAL : LOOM_INIT_GLOROT_UNIFORM;
        double fin = init == NN_INIT_CONST_ ? (double)q->value : (double)(fout ? n / fout : 1);
        int64_t off = nn_add_param_(m, l, q->name ? q->name : "param", &q->shape, init, fin, (double)fout);
        l->poff[t] = off;
        if (q->trainable && l->kernel_off < 0) l->kernel_off = off;
    }
    if (p->whole_batch) m->n_bn++; /* the model runs in segments around it, as around batch normalization */
    return LOOM_OK;
}

int nn_plugin_shapes_(loom_model *m, nn_layer_ *l, int li, loom_err *err)
{
    (void)li;
    const loom_layer_spec *s = &l->spec;
    l->pinst = NULL, l->pscratch = NULL, l->pplan = NULL, l->pdx = NULL;
    const loom_layer_ops *ops = loom_layer_plugin_find(s->plugin, NULL);
    if (!ops)
        return loom_err_set(err, LOOM_ECONFIG, l->where, "layer \"%s\": unknown layer type \"%s\"", s->name, s->plugin),
               loom_err_hint(err, "load the plugin that provides it (plugins.path, $LOOM_PLUGIN_PATH); "
                                  "`loom plugins` lists the layer types");
    static _Thread_local plugin_args_ pa;
    int rc = plugin_args(m, l, ops, &pa, err);
    if (rc) return rc;
    l->pplan = loom_calloc(1, sizeof *l->pplan);
    if (!l->pplan) return loom_err_set(err, LOOM_ENOMEM, l->where, "out of memory");
    l->pops = ops;
    rc = ops->build(&l->pinst, &pa.a, l->pplan, err);
    if (rc) {
        if (!err->where[0]) snprintf(err->where, sizeof err->where, "%.*s", (int)sizeof err->where - 1, l->where);
        return rc;
    }
    const loom_layer_plan *p = l->pplan;
    if (p->scratch_fixed)
        return loom_err_set(err, LOOM_EUNSUPPORTED, l->where,
                            "layer \"%s\" (%s): scratch_fixed plugin layers are not run by the model yet", s->name,
                            s->plugin);
    if (p->n_params < 0 || p->n_params > LOOM_LAYER_MAX_PARAMS || p->out.rank < 0 || p->out.rank > LOOM_MAX_RANK)
        return loom_err_set(err, LOOM_EPLUGIN, l->where, "layer \"%s\" (%s): build() declared %d parameter tensors "
                            "(at most %d) or an output of rank %d", s->name, s->plugin, p->n_params,
                            LOOM_LAYER_MAX_PARAMS, p->out.rank);
    bool trained = false;
    for (int t = 0; t < p->n_params; t++) trained |= p->param[t].trainable != 0;
    if (trained && !p->whole_batch && !ops->param_grads)
        return loom_err_set(err, LOOM_EPLUGIN, l->where, "layer \"%s\" (%s) has parameters but no param_grads",
                            s->name, s->plugin);
    l->out = p->out;
    return plugin_params(m, l, err);
}

bool nn_plugin_buffers_(nn_layer_ *l, int64_t max_batch)
{
    size_t outs = (size_t)(max_batch * l->n_out) * sizeof(float);
    if (!(l->y = loom_alloc_aligned(outs)) || !(l->dz = loom_alloc_aligned(outs))) return false;
    if (!(l->pscratch = loom_alloc_aligned((size_t)max_batch * l->pplan->scratch_per_example + 64))) return false;
    if (l->n_src == 1 && !l->pplan->whole_batch) return true;
    int64_t n = 0;
    for (int k = 0; k < l->n_src; k++) n += loom_shape_numel(&l->src_shape[k]);
    return (l->pdx = loom_alloc_aligned((size_t)(max_batch * n) * sizeof(float))) != NULL;
}

/* Input k's gradient rows in pdx (max_batch of them), example b0 on. */
static float *pdx_rows(const loom_model *m, const nn_layer_ *l, int k, int64_t b0)
{
    int64_t off = 0;
    for (int q = 0; q < k; q++) off += m->max_batch * loom_shape_numel(&l->src_shape[q]);
    return l->pdx + off + b0 * loom_shape_numel(&l->src_shape[k]);
}

/* Whether input k takes a gradient: a layer whose output's gradient is needed (graph.c's wants_grad). */
static bool wants_dx(const loom_model *m, const nn_layer_ *l, int k)
{
    return l->src[k] >= 0 && m->layer[l->src[k]].need_out;
}

bool nn_whole_batch_layer_(const nn_layer_ *l)
{
    return l->spec.kind == LOOM_LAYER_BATCH_NORM || (l->spec.kind == LOOM_LAYER_PLUGIN && l->pplan->whole_batch);
}

bool nn_plugin_state_(const nn_layer_ *l, int64_t off, int64_t *len)
{
    for (int t = 0; l->spec.kind == LOOM_LAYER_PLUGIN && t < l->pplan->n_params; t++)
        if (l->poff[t] == off && !l->pplan->param[t].trainable) {
            if (len) *len = loom_shape_numel(&l->pplan->param[t].shape);
            return true;
        }
    return false;
}

void nn_plugin_free_(nn_layer_ *l)
{
    if (l->pinst) l->pops->free(l->pinst);
    loom_free(l->pscratch);
    loom_free(l->pplan);
    loom_free(l->pdx);
    l->pinst = NULL, l->pscratch = NULL, l->pplan = NULL, l->pdx = NULL;
}

static loom_layer_call plugin_call(const nn_layer_ *l, int64_t b0, int64_t B,
                                   const float *const *x, float *const *param)
{
    return (loom_layer_call){.size = sizeof(loom_layer_call), .b0 = b0, .B = B, .global_batch = 0,
                             .n_in = l->n_src, .x = x, .y = l->y + b0 * l->n_out, .param = param,
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
    const float *xs[LOOM_MAX_LAYER_INPUTS] = {x};
    for (int k = 1; k < l->n_src; k++) xs[k] = nn_src_ptr_(c, l->src[k]);
    for (int t = 0; t < l->pplan->n_params; t++) param[t] = m->params + l->poff[t];
    loom_layer_call call = plugin_call(l, c->b0, c->B, xs, param);
    call.training = training, call.rng_key = rng_key;
    loom_err e = {0};
    if (l->pops->forward(l->pinst, &call, &e)) plugin_failed(m, l, "forward", &e);
}

float *nn_plugin_backward_(const loom_model *m, int li, nn_chunk_ *c, float *g, float *other)
{
    const nn_layer_ *l = &m->layer[li];
    const int64_t row0 = c->b0 * l->n_out;
    const float *x[LOOM_MAX_LAYER_INPUTS] = {c->act[li]};
    float *dx[LOOM_MAX_LAYER_INPUTS] = {other};
    for (int k = 1; k < l->n_src; k++) {
        x[k] = nn_src_ptr_(c, l->src[k]);
        dx[k] = wants_dx(m, l, k) ? pdx_rows(m, l, k, c->b0) : NULL;
    }
    memcpy(l->dz + row0, g, (size_t)(c->B * l->n_out) * sizeof *g); /* dy, for param_grads */
    float *param[LOOM_LAYER_MAX_PARAMS];
    for (int t = 0; t < l->pplan->n_params; t++) param[t] = m->params + l->poff[t];
    loom_layer_call call = plugin_call(l, c->b0, c->B, x, param);
    call.dy = l->dz + row0, call.dx = dx, call.training = 1;
    loom_err e = {0};
    if (l->pops->backward(l->pinst, &call, &e)) plugin_failed(m, l, "backward", &e);
    for (int k = 1; k < l->n_src; k++) /* the other inputs' gradients to their layers (input 0's: the caller) */
        if (dx[k]) nn_graph_deliver_(m, l->src[k], c, dx[k]);
    return other;
}

void nn_plugin_param_grads_(loom_model *m, int li, const float *x, int64_t B)
{
    const nn_layer_ *l = &m->layer[li];
    if (!l->pplan->n_params) return;
    float *param[LOOM_LAYER_MAX_PARAMS], *dparam[LOOM_LAYER_MAX_PARAMS];
    const float *xs[LOOM_MAX_LAYER_INPUTS] = {x};
    for (int k = 1; k < l->n_src; k++) xs[k] = nn_src_ptr_(&m->chunk[0], l->src[k]); /* chunk 0: the batch's rows */
    for (int t = 0; t < l->pplan->n_params; t++) {
        param[t] = m->params + l->poff[t];
        dparam[t] = m->grads + l->poff[t];
        memset(dparam[t], 0, (size_t)loom_shape_numel(&l->pplan->param[t].shape) * sizeof(float));
    }
    loom_layer_call call = plugin_call(l, 0, B, xs, param);
    call.dy = l->dz, call.dparam = dparam, call.training = 1;
    loom_err e = {0};
    if (l->pops->param_grads(l->pinst, &call, &e)) plugin_failed(m, l, "param_grads", &e);
}

/* ---- whole_batch layers: between the segments, as batch normalization ------------ */

/* The whole batch's inputs: chunk 0's rows are the batch's (its act, or in a graph its sources). */
static void whole_inputs(const loom_model *m, const nn_layer_ *l, int li, const float **x)
{
    const nn_chunk_ *c0 = &m->chunk[0];
    x[0] = c0->act[li];
    for (int k = 1; k < l->n_src; k++) x[k] = nn_src_ptr_(c0, l->src[k]);
}

void nn_plugin_forward_whole_(loom_model *m, int li, int64_t B, int training, uint64_t rng_key)
{
    const nn_layer_ *l = &m->layer[li];
    float *param[LOOM_LAYER_MAX_PARAMS];
    const float *x[LOOM_MAX_LAYER_INPUTS];
    whole_inputs(m, l, li, x);
    for (int t = 0; t < l->pplan->n_params; t++) param[t] = m->params + l->poff[t];
    loom_layer_call call = plugin_call(l, 0, B, x, param);
    call.training = training, call.rng_key = rng_key;
    loom_err e = {0};
    if (l->pops->forward(l->pinst, &call, &e)) plugin_failed(m, l, "forward", &e);
}

/* dy gathered from the chunks' gradient rows (c->g), one backward over the batch (dx and the trainable
 * tensors' gradients), then each chunk's input-0 rows into its other buffer (its new c->g) and the other
 * inputs' to their layers. */
void nn_plugin_backward_whole_(loom_model *m, int li, nn_chunk_ *chunk, int nchunks, int64_t B)
{
    const nn_layer_ *l = &m->layer[li];
    const int64_t n0 = loom_shape_numel(&l->src_shape[0]);
    for (int t = 0; t < nchunks; t++)
        memcpy(l->dz + chunk[t].b0 * l->n_out, chunk[t].g, (size_t)(chunk[t].B * l->n_out) * sizeof(float));
    float *param[LOOM_LAYER_MAX_PARAMS], *dparam[LOOM_LAYER_MAX_PARAMS], *dx[LOOM_MAX_LAYER_INPUTS];
    const float *x[LOOM_MAX_LAYER_INPUTS];
    whole_inputs(m, l, li, x);
    for (int t = 0; t < l->pplan->n_params; t++) {
        param[t] = m->params + l->poff[t];
        dparam[t] = l->pplan->param[t].trainable ? m->grads + l->poff[t] : NULL;
        if (dparam[t]) memset(dparam[t], 0, (size_t)loom_shape_numel(&l->pplan->param[t].shape) * sizeof(float));
    }
    for (int k = 0; k < l->n_src; k++) dx[k] = (k ? wants_dx(m, l, k) : l->needs_dx) ? pdx_rows(m, l, k, 0) : NULL;
    loom_layer_call call = plugin_call(l, 0, B, x, param);
    call.dy = l->dz, call.dx = dx, call.dparam = dparam, call.training = 1;
    loom_err e = {0};
    if (l->pops->backward(l->pinst, &call, &e)) plugin_failed(m, l, "backward", &e);
    for (int t = 0; t < nchunks; t++) {
        nn_chunk_ *c = &chunk[t];
        if (!dx[0]) {
            c->bw_done = 1;
        } else {
            memcpy(c->other, dx[0] + c->b0 * n0, (size_t)(c->B * n0) * sizeof(float));
            c->g = c->other, c->other = c->g == c->gbuf[0] ? c->gbuf[1] : c->gbuf[0];
        }
        for (int k = 1; k < l->n_src; k++)
            if (dx[k]) nn_graph_deliver_(m, l->src[k], c, pdx_rows(m, l, k, c->b0));
    }
}

/* ---- --gradcheck of a layer of several inputs ------------------------------------ */

int nn_plugin_check_(const loom_model *m, const nn_layer_ *l, double *max_err, loom_err *err)
{
    static _Thread_local plugin_args_ pa;
    int rc = plugin_args(m, l, l->pops, &pa, err);
    pa.a.max_batch = 3;
    return rc ? rc : loom_layer_plugin_check(l->pops, &pa.a, 3, 0x6763, 1e-2, max_err, err);
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
