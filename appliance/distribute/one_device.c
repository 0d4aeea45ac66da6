/* one_device.c - the one_device strategy: one replica, on the host (nn's
 * code, run.threads as the model's intra-op threads) or on a device backend.
 * Threads: driven from the train thread. */
#include "distribute.h"
#include "mirrored_internal.h"
#include "placement_internal.h"

#include <stdio.h>
#include <string.h>

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
    bool             applied; /* the last backward part updated the parameters in it (a profile's) */
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
    int rc = loom_place_devices_(st, &st->device, 1, &st->device_loc, &spec->model, &od->place, err);
    if (rc) return rc;
    rc = loom_strategy_model_new_(&od->model, a, a->max_batch, err);
    if (rc) return rc;
    /* run.threads (0 = all cores) become the model's intra-op threads */
    if ((rc = loom_model_set_threads(od->model, spec->run.threads, err))) return rc;
    if (!a->plan_only) loom_model_init_params(od->model, spec->run.seed); /* `loom check`: no values wanted */
    if (od->place.ops &&
        (rc = loom_model_dev_open(&od->dev, od->model, od->place.ops, loom_place_index_(&od->place, 0), err)))
        return rc;
    rc = loom_optimizer_new(&od->opt, &spec->optimizer, loom_model_num_params(od->model), err);
    if (!rc) loom_optimizer_for_model(od->opt, od->model);
    if (!rc) loom_optimizer_set_pool(od->opt, loom_model_pool(od->model)); /* the update runs on the same threads */
    /* embedding tables: one replica writes its own gradients, so the update
     * visits just the rows the batch touched (sparse) */
    if (!rc) {
        loom_model_set_sparse_owner(od->model, 1);
        loom_optimizer_set_tables(od->opt, od->model, 1);
    }
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
    loom_strategy_weights_(s->args, od->model, batch);
    uint64_t key = loom_rng_mix(od->seed, (uint64_t)step);
    if (od->dev) {
        int rc = loom_model_dev_train_step(od->dev, x, y, B, key, &out->loss_sum, &out->correct, err);
        return rc ? rc : od_apply(od, step, err);
    }
    /* one replica: each layer's update right after its gradients when nothing needs them all first */
    bool applied;
    int rc = loom_model_train_step_update(od->model, x, y, B, key, od->opt, step, &out->loss_sum, &out->correct,
                                          &applied, err);
    if (rc || applied) return rc;
    return od_apply(od, step, err);
}

static int od_eval_step(loom_strategy *s, const loom_elem *batch, loom_step_result *out, loom_err *err)
{
    one_device *od = s->impl;
    const loom_tensor *x = &batch->t[s->args->input_idx], *y = &batch->t[s->args->label_idx];
    out->examples = x->shape.dim[0];
    loom_strategy_weights_(s->args, od->model, batch);
    if (od->dev) return loom_model_dev_evaluate(od->dev, x, y, &out->loss_sum, &out->correct, err);
    return loom_model_evaluate(od->model, x, y, &out->loss_sum, &out->correct, err);
}

static int od_predict(loom_strategy *s, const loom_elem *batch, float *out, loom_err *err)
{
    one_device *od = s->impl;
    const loom_tensor *x = &batch->t[s->args->input_idx];
    loom_strategy_inputs_(s->args, od->model, batch); /* model.inputs beyond the first */
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
        loom_strategy_weights_(s->args, od->model, batch);
        return od->dev ? loom_model_dev_forward(od->dev, x, key, err) : loom_model_forward(od->model, x, key, err);
    case LOOM_PART_LOSS:
        r->examples = y->shape.dim[0];
        loom_strategy_weights_(s->args, od->model, batch);
        if (od->dev) return loom_model_dev_loss(od->dev, y, r->examples, &r->loss_sum, &r->correct, err);
        return loom_model_loss(od->model, y, r->examples, &r->loss_sum, &r->correct, err);
    case LOOM_PART_BACKWARD: /* on a device, the gradients are downloaded into the model's buffer */
        od->applied = false;
        if (od->dev) return loom_model_dev_backward(od->dev, err);
        /* profiled (loom profile --train): the update where train_step makes it; a custom step's parts never */
        if (loom_model_profiled(od->model)) return loom_model_backward_update(od->model, od->opt, step, &od->applied, err);
        return loom_model_backward(od->model, err);
    case LOOM_PART_ALL_REDUCE: return LOOM_OK; /* one replica */
    case LOOM_PART_APPLY:
        if (od->applied) { /* in the backward part already */
            od->applied = false;
            return LOOM_OK;
        }
        return od_apply(od, step, err);
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



static void od_print_plan(loom_strategy *s, int64_t global_batch, FILE *f)
{
    const one_device *od = s->impl;
    char what[200];
    fprintf(f, "strategy: one_device on %s, 1 replica, global batch %lld, per-replica batch %lld, no cross-device "
            "reduction\n", s->args->spec->strategy.device, (long long)global_batch, (long long)global_batch);
    fprintf(f, "  compute: %s\n", loom_place_describe_(&od->place, what, sizeof what));
}

static void od_where(loom_strategy *s, char *buf, size_t n) { snprintf(buf, n, "%s", s->args->spec->strategy.device); }

/* One process: a cluster of one task at most. */
static const loom_cluster_roles one_device_roles = {.flags = LOOM_ROLES_ONE_PROCESS};

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
    .caps = LOOM_STRATEGY_OWN_THREADS,
    .print_plan = od_print_plan,
    .where = od_where,
    .roles = &one_device_roles,
};

const loom_strategy_ops *loom_one_device_ops_(void) { return &one_device_ops; }
