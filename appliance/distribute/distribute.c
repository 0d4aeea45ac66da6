/* distribute.c - the strategy and cross-device-ops registries, the built-in
 * reduce_to_one_device op and the one_device strategy. */
#include "distribute.h"

#include <stdio.h>
#include <string.h>

static int distribute_inited;

/* Strategies and cross-device ops live in the shared registry (core.h), so a
 * plugin's and a built-in's are found the same way. origin: NULL = built-in. */
int loom_register_strategy_from(const loom_strategy_ops *ops, const char *origin, loom_err *err)
{
    if (ops->version != LOOM_STRATEGY_OPS_VERSION)
        return loom_err_set(err, LOOM_EPLUGIN, origin ? origin : ops->name,
                            "strategy \"%s\": ops version %u, this build speaks %u", ops->name, ops->version,
                            LOOM_STRATEGY_OPS_VERSION);
    return loom_registry_add(LOOM_REG_STRATEGY, ops->name, ops, origin, err);
}

int loom_register_cross_device_ops_from(const loom_cross_device_ops *ops, const char *origin, loom_err *err)
{
    if (ops->version != LOOM_CROSS_DEVICE_OPS_VERSION)
        return loom_err_set(err, LOOM_EPLUGIN, origin ? origin : ops->name,
                            "cross-device ops \"%s\": version %u, this build speaks %u", ops->name, ops->version,
                            LOOM_CROSS_DEVICE_OPS_VERSION);
    if (!ops->all_reduce || !ops->broadcast)
        return loom_err_set(err, LOOM_EPLUGIN, origin ? origin : ops->name,
                            "cross-device ops \"%s\" lack all_reduce or broadcast", ops->name);
    return loom_registry_add(LOOM_REG_CROSS_DEVICE_OPS, ops->name, ops, origin, err);
}

int loom_register_strategy(const loom_strategy_ops *ops, loom_err *err)
{
    return loom_register_strategy_from(ops, NULL, err);
}

int loom_register_cross_device_ops(const loom_cross_device_ops *ops, loom_err *err)
{
    return loom_register_cross_device_ops_from(ops, NULL, err);
}

const loom_strategy_ops *loom_find_strategy(const char *name)
{
    return loom_registry_find(LOOM_REG_STRATEGY, name, NULL);
}

const loom_cross_device_ops *loom_find_cross_device_ops(const char *name)
{
    return loom_registry_find(LOOM_REG_CROSS_DEVICE_OPS, name, NULL);
}

char *loom_strategy_names(char *buf, size_t n)
{
    return loom_registry_names(LOOM_REG_STRATEGY, buf, n);
}

char *loom_cross_device_ops_names(char *buf, size_t n)
{
    return loom_registry_names(LOOM_REG_CROSS_DEVICE_OPS, buf, n);
}

/* ---- reduce_to_one_device ------------------------------------------------- */

static int rto_all_reduce(float *const *bufs, int n, int64_t count, loom_redop op, loom_err *err)
{
    (void)err;
    if (n <= 1) return LOOM_OK;
    float *dst = bufs[0];
    for (int r = 1; r < n; r++) {
        const float *src = bufs[r];
        if (op == LOOM_REDUCE_MAX)
            for (int64_t i = 0; i < count; i++) dst[i] = src[i] > dst[i] ? src[i] : dst[i];
        else
            for (int64_t i = 0; i < count; i++) dst[i] += src[i];
    }
    if (op == LOOM_REDUCE_MEAN) {
        float inv = 1.0f / (float)n;
        for (int64_t i = 0; i < count; i++) dst[i] *= inv;
    }
    for (int r = 1; r < n; r++) memcpy(bufs[r], dst, (size_t)count * sizeof(float));
    return LOOM_OK;
}

static int rto_broadcast(float *const *bufs, int n, int64_t count, int root, loom_err *err)
{
    (void)err;
    for (int r = 0; r < n; r++)
        if (r != root) memcpy(bufs[r], bufs[root], (size_t)count * sizeof(float));
    return LOOM_OK;
}

static const loom_cross_device_ops reduce_to_one_device = {
    .version = LOOM_CROSS_DEVICE_OPS_VERSION,
    .name = "reduce_to_one_device",
    .all_reduce = rto_all_reduce,
    .broadcast = rto_broadcast,
};

int loom_all_reduce(const loom_cross_device_ops *x, float *const *bufs, int n, int64_t count, loom_redop op,
                    loom_err *err)
{
    if (n <= 1 && op != LOOM_REDUCE_MEAN) return LOOM_OK;
    return x->all_reduce(bufs, n, count, op, err);
}

/* ---- one_device ------------------------------------------------------------ */

typedef struct one_device {
    loom_model     *model;
    loom_optimizer *opt;
    uint64_t        seed;
} one_device;

static int od_open(loom_strategy *s, const loom_strategy_args *a, loom_err *err)
{
    const loom_spec *spec = a->spec;
    if (strcmp(spec->strategy.device, "cpu:0") != 0) {
        char w[600];
        return loom_err_set(err, LOOM_ECONFIG, loom_loc_str(&spec->strategy.loc, w, sizeof w),
                            "strategy.device: device \"%s\" does not exist", spec->strategy.device),
               loom_err_hint(err, "this machine has: cpu:0");
    }
    one_device *od = loom_calloc(1, sizeof *od);
    if (!od) return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating the one_device strategy");
    s->impl = od;
    od->seed = spec->run.seed;
    const loom_elem_spec *in = a->input;
    loom_shape x = in->shape[a->input_idx], y = in->shape[a->label_idx];
    /* per-example shapes: drop the batch dimension */
    loom_shape xe = loom_shape_make(x.rank - 1, x.dim + 1), ye = loom_shape_make(y.rank - 1, y.dim + 1);
    int rc = loom_model_new(&od->model, &spec->model, &xe, in->dtype[a->input_idx], &ye, in->dtype[a->label_idx],
                            a->max_batch, err);
    if (rc) return rc;
    /* run.threads (0 = all cores) become the model's intra-op threads */
    if ((rc = loom_model_set_threads(od->model, spec->run.threads, err))) return rc;
    loom_model_init_params(od->model, spec->run.seed);
    rc = loom_optimizer_new(&od->opt, &spec->optimizer, loom_model_num_params(od->model), err);
    if (!rc) loom_optimizer_set_pool(od->opt, loom_model_pool(od->model)); /* the update runs on the same threads */
    return rc;
}

static void od_close(loom_strategy *s)
{
    one_device *od = s->impl;
    if (!od) return;
    loom_model_free(od->model);
    loom_optimizer_free(od->opt);
    loom_free(od);
}

static int od_train_step(loom_strategy *s, const loom_elem *batch, int64_t step, loom_step_result *out, loom_err *err)
{
    one_device *od = s->impl;
    const loom_tensor *x = &batch->t[s->args->input_idx], *y = &batch->t[s->args->label_idx];
    int64_t B = x->shape.dim[0];
    out->examples = B;
    int rc = loom_model_train_step(od->model, x, y, B, loom_rng_mix(od->seed, (uint64_t)step), &out->loss_sum,
                                   &out->correct, err);
    if (rc) return rc;
    loom_optimizer_apply(od->opt, loom_model_params(od->model), loom_model_grads(od->model), step);
    return LOOM_OK;
}

static int od_eval_step(loom_strategy *s, const loom_elem *batch, loom_step_result *out, loom_err *err)
{
    one_device *od = s->impl;
    const loom_tensor *x = &batch->t[s->args->input_idx], *y = &batch->t[s->args->label_idx];
    out->examples = x->shape.dim[0];
    return loom_model_evaluate(od->model, x, y, &out->loss_sum, &out->correct, err);
}

static int od_predict(loom_strategy *s, const loom_elem *batch, float *out, loom_err *err)
{
    one_device *od = s->impl;
    return loom_model_predict(od->model, &batch->t[s->args->input_idx], out, err);
}

static loom_model *od_model(loom_strategy *s) { return ((one_device *)s->impl)->model; }
static loom_optimizer *od_optimizer(loom_strategy *s) { return ((one_device *)s->impl)->opt; }
static int od_sync(loom_strategy *s, loom_err *err) { (void)s; (void)err; return LOOM_OK; }
static int od_num_replicas(loom_strategy *s) { (void)s; return 1; }

static const loom_strategy_ops one_device_ops = {
    .version = LOOM_STRATEGY_OPS_VERSION,
    .name = "one_device",
    .open = od_open,
    .close = od_close,
    .train_step = od_train_step,
    .eval_step = od_eval_step,
    .predict = od_predict,
    .model = od_model,
    .optimizer = od_optimizer,
    .sync = od_sync,
    .num_replicas = od_num_replicas,
};

/* ---- registry setup and wrappers ------------------------------------------ */

int loom_distribute_init(loom_err *err)
{
    if (distribute_inited) return LOOM_OK;
    int rc = loom_register_cross_device_ops(&reduce_to_one_device, err);
    if (!rc) rc = loom_register_strategy(&one_device_ops, err);
    if (!rc) distribute_inited = 1;
    return rc;
}

int loom_strategy_open(loom_strategy **out, const loom_strategy_args *a, loom_err *err)
{
    *out = NULL;
    int rc = loom_distribute_init(err);
    if (rc) return rc;
    const char *name = loom_strategy_kind_name(a->spec->strategy.kind);
    const loom_strategy_ops *ops = loom_find_strategy(name);
    if (!ops) {
        char names[256], w[600];
        return loom_err_set(err, LOOM_EUNSUPPORTED, loom_loc_str(&a->spec->strategy.loc, w, sizeof w),
                            "strategy.type: \"%s\" is not supported yet (available: %s)", name,
                            loom_strategy_names(names, sizeof names));
    }
    loom_strategy *s = loom_calloc(1, sizeof *s);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating a strategy");
    s->ops = ops;
    s->args = a;
    s->xops = loom_find_cross_device_ops("reduce_to_one_device");
    rc = ops->open(s, a, err);
    if (rc) {
        loom_strategy_close(s);
        return rc;
    }
    *out = s;
    return LOOM_OK;
}

void loom_strategy_close(loom_strategy *s)
{
    if (!s) return;
    s->ops->close(s);
    loom_free(s);
}

int loom_strategy_train_step(loom_strategy *s, const loom_elem *batch, int64_t step, loom_step_result *out,
                             loom_err *err)
{
    return s->ops->train_step(s, batch, step, out, err);
}

int loom_strategy_eval_step(loom_strategy *s, const loom_elem *batch, loom_step_result *out, loom_err *err)
{
    return s->ops->eval_step(s, batch, out, err);
}

int loom_strategy_predict(loom_strategy *s, const loom_elem *batch, float *out, loom_err *err)
{
    return s->ops->predict(s, batch, out, err);
}

loom_model *loom_strategy_model(loom_strategy *s) { return s->ops->model(s); }
loom_optimizer *loom_strategy_optimizer(loom_strategy *s) { return s->ops->optimizer(s); }
int loom_strategy_sync(loom_strategy *s, loom_err *err) { return s->ops->sync(s, err); }
int loom_strategy_num_replicas(loom_strategy *s) { return s->ops->num_replicas(s); }
