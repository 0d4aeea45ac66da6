/* distribute.c - the strategy and cross-device-ops registries and the
 * one_device strategy (the built-in cross-device ops are in xops.c). */
#include "distribute.h"
#include "mirrored_internal.h"
#include "placement_internal.h"
#include "xops_internal.h"

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
    if (ops->version < 1 || ops->version > LOOM_CROSS_DEVICE_OPS_VERSION)
        return loom_err_set(err, LOOM_EPLUGIN, origin ? origin : ops->name,
                            "cross-device ops \"%s\": version %u, this build speaks 1 to %u", ops->name,
                            ops->version, LOOM_CROSS_DEVICE_OPS_VERSION);
    if (!ops->all_reduce || !ops->broadcast)
        return loom_err_set(err, LOOM_EPLUGIN, origin ? origin : ops->name,
                            "cross-device ops \"%s\" lack all_reduce or broadcast", ops->name);
    if (ops->version >= 2 && ops->comm_new && (!ops->comm_free || !ops->all_reduce_rank || !ops->broadcast_rank))
        return loom_err_set(err, LOOM_EPLUGIN, origin ? origin : ops->name,
                            "cross-device ops \"%s\" have comm_new but lack comm_free, all_reduce_rank or "
                            "broadcast_rank", ops->name);
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

int loom_all_reduce(const loom_cross_device_ops *x, float *const *bufs, int n, int64_t count, loom_redop op,
                    loom_err *err)
{
    if (n <= 1 && op != LOOM_REDUCE_MEAN) return LOOM_OK;
    return x->all_reduce(bufs, n, count, op, err);
}

/* ---- one_device ------------------------------------------------------------ */

/* On a device backend (strategy.device = "gpu:N", or device_backend =
 * "cpu"), the model's steps run through an executor (nn.h), the host model
 * keeping the variables and the optimizer: parameters are uploaded after
 * every update and restore. */
typedef struct one_device {
    loom_model      *model;
    loom_optimizer  *opt;
    uint64_t         seed;
    loom_placement_  place;
    loom_model_dev  *dev; /* NULL: nn's host code */
} one_device;

static int od_open(loom_strategy *s, const loom_strategy_args *a, loom_err *err)
{
    const loom_spec *spec = a->spec;
    if (spec->strategy.device[0] != 'g' && strcmp(spec->strategy.device, "cpu:0") != 0) {
        char w[600];
        return loom_err_set(err, LOOM_ECONFIG, loom_loc_str(&spec->strategy.loc, w, sizeof w),
                            "strategy.device: device \"%s\" does not exist", spec->strategy.device),
               loom_err_hint(err, "this machine has: cpu:0");
    }
    one_device *od = loom_calloc(1, sizeof *od);
    if (!od) return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating the one_device strategy");
    s->impl = od;
    od->seed = spec->run.seed;
    const loom_strategy_spec *st = &spec->strategy;
    int rc = loom_place_devices_(st, &st->device, 1, &st->device_loc, &od->place, err);
    if (rc) return rc;
    const loom_elem_spec *in = a->input;
    loom_shape x = in->shape[a->input_idx], y = in->shape[a->label_idx];
    /* per-example shapes: drop the batch dimension */
    loom_shape xe = loom_shape_make(x.rank - 1, x.dim + 1), ye = loom_shape_make(y.rank - 1, y.dim + 1);
    rc = loom_model_new(&od->model, &spec->model, &xe, in->dtype[a->input_idx], &ye, in->dtype[a->label_idx],
                        a->max_batch, err);
    if (rc) return rc;
    /* run.threads (0 = all cores) become the model's intra-op threads */
    if ((rc = loom_model_set_threads(od->model, spec->run.threads, err))) return rc;
    loom_model_init_params(od->model, spec->run.seed);
    if (od->place.ops &&
        (rc = loom_model_dev_open(&od->dev, od->model, od->place.ops, loom_place_index_(&od->place, 0), err)))
        return rc;
    rc = loom_optimizer_new(&od->opt, &spec->optimizer, loom_model_num_params(od->model), err);
    if (!rc) loom_optimizer_set_pool(od->opt, loom_model_pool(od->model)); /* the update runs on the same threads */
    return rc;
}

static void od_close(loom_strategy *s)
{
    one_device *od = s->impl;
    if (!od) return;
    loom_model_dev_close(od->dev);
    loom_model_free(od->model);
    loom_optimizer_free(od->opt);
    loom_free(od);
}

/* The update on the host, then (on a device) the new parameters to it. */
static int od_apply(one_device *od, int64_t step, loom_err *err)
{
    loom_optimizer_apply(od->opt, loom_model_params(od->model), loom_model_grads(od->model), step);
    return od->dev ? loom_model_dev_upload_params(od->dev, err) : LOOM_OK;
}

static int od_train_step(loom_strategy *s, const loom_elem *batch, int64_t step, loom_step_result *out, loom_err *err)
{
    one_device *od = s->impl;
    const loom_tensor *x = &batch->t[s->args->input_idx], *y = &batch->t[s->args->label_idx];
    int64_t B = x->shape.dim[0];
    out->examples = B;
    uint64_t key = loom_rng_mix(od->seed, (uint64_t)step);
    int rc = od->dev ? loom_model_dev_train_step(od->dev, x, y, B, key, &out->loss_sum, &out->correct, err)
                     : loom_model_train_step(od->model, x, y, B, key, &out->loss_sum, &out->correct, err);
    if (rc) return rc;
    return od_apply(od, step, err);
}

static int od_eval_step(loom_strategy *s, const loom_elem *batch, loom_step_result *out, loom_err *err)
{
    one_device *od = s->impl;
    const loom_tensor *x = &batch->t[s->args->input_idx], *y = &batch->t[s->args->label_idx];
    out->examples = x->shape.dim[0];
    if (od->dev) return loom_model_dev_evaluate(od->dev, x, y, &out->loss_sum, &out->correct, err);
    return loom_model_evaluate(od->model, x, y, &out->loss_sum, &out->correct, err);
}

static int od_predict(loom_strategy *s, const loom_elem *batch, float *out, loom_err *err)
{
    one_device *od = s->impl;
    const loom_tensor *x = &batch->t[s->args->input_idx];
    return od->dev ? loom_model_dev_predict(od->dev, x, out, err) : loom_model_predict(od->model, x, out, err);
}

static int od_step_part(loom_strategy *s, loom_step_part part, const loom_elem *batch, int64_t step,
                        loom_step_result *per_replica, loom_err *err)
{
    one_device *od = s->impl;
    const loom_tensor *x = batch ? &batch->t[s->args->input_idx] : NULL, *y = batch ? &batch->t[s->args->label_idx] : NULL;
    uint64_t key = loom_rng_mix(od->seed, (uint64_t)step);
    loom_step_result *r = per_replica;
    switch (part) {
    case LOOM_PART_FORWARD:
        return od->dev ? loom_model_dev_forward(od->dev, x, key, err) : loom_model_forward(od->model, x, key, err);
    case LOOM_PART_LOSS:
        r->examples = y->shape.dim[0];
        if (od->dev) return loom_model_dev_loss(od->dev, y, r->examples, &r->loss_sum, &r->correct, err);
        return loom_model_loss(od->model, y, r->examples, &r->loss_sum, &r->correct, err);
    case LOOM_PART_BACKWARD: /* on a device, the gradients are downloaded into the model's buffer */
        return od->dev ? loom_model_dev_backward(od->dev, err) : loom_model_backward(od->model, err);
    case LOOM_PART_ALL_REDUCE: return LOOM_OK; /* one replica */
    case LOOM_PART_APPLY: return od_apply(od, step, err);
    }
    return loom_err_set(err, LOOM_EUSAGE, NULL, "unknown step part %d", (int)part);
}

static loom_model *od_replica(loom_strategy *s, int r) { return r == 0 ? ((one_device *)s->impl)->model : NULL; }

static loom_model *od_model(loom_strategy *s) { return ((one_device *)s->impl)->model; }
static loom_optimizer *od_optimizer(loom_strategy *s) { return ((one_device *)s->impl)->opt; }
/* After a restore of the host variables: the device's copy. */
static int od_sync(loom_strategy *s, loom_err *err)
{
    one_device *od = s->impl;
    return od->dev ? loom_model_dev_upload_params(od->dev, err) : LOOM_OK;
}
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
    .step_part = od_step_part,
    .replica = od_replica,
};

int loom_strategy_print_plan(loom_strategy *s, int64_t global_batch, FILE *f)
{
    if (s->ops != &one_device_ops) return loom_replicated_print_plan_(s, global_batch, f);
    const one_device *od = s->impl;
    char what[200];
    fprintf(f, "strategy: one_device on %s, 1 replica, global batch %lld, per-replica batch %lld, no cross-device "
            "reduction\n", s->args->spec->strategy.device, (long long)global_batch, (long long)global_batch);
    fprintf(f, "  compute: %s\n", loom_place_describe_(&od->place, what, sizeof what));
    return 1;
}

/* ---- registry setup and wrappers ------------------------------------------ */

int loom_distribute_init(loom_err *err)
{
    if (distribute_inited) return LOOM_OK;
    int rc = loom_xops_register_builtins_(err);
    if (!rc) rc = loom_register_strategy(&one_device_ops, err);
    if (!rc) rc = loom_replicated_register_(err);
    if (!rc) distribute_inited = 1;
    return rc;
}

/* Where strategy.cross_device_ops was set, into w; returns the prefix that
 * names the setting ("" when w is "--set ...", which names it). */
static const char *xops_where(const loom_strategy_spec *st, char *w, size_t n)
{
    loom_loc_str(st->cross_device_ops_loc.file[0] ? &st->cross_device_ops_loc : &st->loc, w, n);
    return strncmp(w, "--set ", 6) ? "strategy.cross_device_ops: " : "";
}

/* An unknown strategy.cross_device_ops, at its file:line (or --set), listing
 * every registered op (plugins' included) and the closest one. */
static int unknown_xops(const loom_strategy_spec *st, const char *name, loom_err *err)
{
    char names[256], w[600];
    const char *setting = xops_where(st, w, sizeof w);
    loom_err_set(err, LOOM_ECONFIG, w, "%sunknown cross-device op \"%s\" (available: %s, auto)", setting, name,
                 loom_cross_device_ops_names(names, sizeof names));
    const char *known, *best = NULL;
    int best_d = 3;
    for (int i = 0; loom_registry_entry(LOOM_REG_CROSS_DEVICE_OPS, i, &known, NULL, NULL) == 0; i++) {
        int d = loom_edit_distance(name, known);
        if (d < best_d) best_d = d, best = known;
    }
    if (best) return loom_err_hint(err, "did you mean \"%s\"?", best);
    return loom_err_hint(err, "a plugin's op is available once its plugin is loaded (plugins.path)");
}

/* The replicas strategy.devices or .replicas put on the CPU, for messages:
 * "cpu:0, cpu:1", "cpu:0 to cpu:3" or "one per core". */
static void cpu_replicas_str(const loom_strategy_spec *st, char *buf, size_t n)
{
    size_t len = 0;
    if (st->devices_listed)
        for (int i = 0; i < st->n_devices && len < n; i++)
            len += (size_t)snprintf(buf + len, n - len, "%s%s", i ? ", " : "", st->devices[i]);
    else if (st->replicas > 1)
        snprintf(buf, n, "cpu:0 to cpu:%d", st->replicas - 1);
    else
        snprintf(buf, n, "%s", st->replicas == 1 ? "cpu:0" : "one per core");
}

/* Replicas on the CPU run natively keep their buffers in host memory: an op
 * that works only on device memory (the nccl plugin's; loom_xops_memory) is
 * refused here, at its setting, instead of failing at the first step.
 * Replicas on a device backend may use it: GPU replicas (any strategy), and
 * the built-in strategies' replicas on device_backend = "cpu", which reduce
 * their device buffers with it (the CPU reference's device memory is host
 * memory, so ops of either memory work there). builtin: the strategy is one
 * of Loom's (plugins' strategies do not run on device backends). */
static int check_xops_memory(const loom_strategy_spec *st, const loom_cross_device_ops *x, int builtin, loom_err *err)
{
    int on_device = (st->devices_listed && st->devices[0][0] == 'g') ||
                    (builtin && (st->device_backend[0] || st->device[0] == 'g'));
    if (on_device || (loom_xops_memory(x) & LOOM_XOPS_HOST_MEM)) return LOOM_OK;
    char w[600], devs[200], names[256];
    const char *setting = xops_where(st, w, sizeof w), *name;
    const void *op;
    size_t len = 0;
    names[0] = 0;
    for (int i = 0; loom_registry_entry(LOOM_REG_CROSS_DEVICE_OPS, i, &name, &op, NULL) == 0 && len < sizeof names; i++)
        if (loom_xops_memory(op) & LOOM_XOPS_HOST_MEM)
            len += (size_t)snprintf(names + len, sizeof names - len, "%s%s", len ? ", " : "", name);
    cpu_replicas_str(st, devs, sizeof devs);
    loom_err_set(err, LOOM_ECONFIG, w, "%s\"%s\" reduces GPU memory only, but the %s replicas are on the CPU (%s), "
                 "with their buffers in host memory", setting, x->name, st->name, devs);
    loom_err_hint(err, "for CPU replicas use an op that works on host memory: %s, or \"auto\"", names);
    return LOOM_ECONFIG;
}

int loom_strategy_open(loom_strategy **out, const loom_strategy_args *a, loom_err *err)
{
    *out = NULL;
    int rc = loom_distribute_init(err);
    if (rc) return rc;
    const char *name = a->spec->strategy.name; /* a built-in's or a plugin's */
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
    const char *xname = a->spec->strategy.cross_device_ops[0] ? a->spec->strategy.cross_device_ops
                                                              : "reduce_to_one_device";
    /* "auto" is left to the strategy (s->xops NULL), which knows the replicas */
    if (strcmp(xname, "auto") && !(s->xops = loom_find_cross_device_ops(xname))) {
        loom_free(s);
        return unknown_xops(&a->spec->strategy, xname, err);
    }
    int builtin = ops == &one_device_ops || loom_replicated_owns_(ops);
    if (s->xops && (rc = check_xops_memory(&a->spec->strategy, s->xops, builtin, err))) {
        loom_free(s);
        return rc;
    }
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
bool loom_strategy_has_parts(loom_strategy *s) { return s->ops->step_part && s->ops->replica; }
loom_model *loom_strategy_replica(loom_strategy *s, int r) { return s->ops->replica(s, r); }

int loom_strategy_step_part(loom_strategy *s, loom_step_part part, const loom_elem *batch, int64_t step,
                            loom_step_result *per_replica, loom_err *err)
{
    return s->ops->step_part(s, part, batch, step, per_replica, err);
}
