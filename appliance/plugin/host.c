/* host.c - the loom_host table: what a plugin may call. Thin adapters over
 * core, nn and distribute; a strategy plugin gets replicas, optimizers and
 * row slices of a batch without seeing Loom's structs.
 * Threads: logging, errors, memory and the pool are thread-safe; a model or
 * optimizer is used by one thread at a time (nn.h). */
#include "plugin/plugin_internal.h"

#include <stdlib.h>
#include <string.h>

/* ---- logging and errors ------------------------------------------------------ */

static void h_log(loom_log_level lvl, const char *fmt, ...)
{
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    loom_log(lvl, "%s", buf);
}

static int h_err_set(loom_err *err, int code, const char *where, const char *fmt, ...)
{
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return loom_err_set(err, code, where, "%s", buf);
}

static int h_err_hint(loom_err *err, const char *fmt, ...)
{
    char buf[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return loom_err_hint(err, "%s", buf);
}

/* ---- registry ---------------------------------------------------------------- */

/* The checks distribute's loom_register_*_from make, made here already, so
 * that a plugin is refused at the registration that is wrong and its
 * registrations, committed after init, cannot fail half-way. */

static int h_register_cross_device_ops(const loom_cross_device_ops *ops, loom_err *err)
{
    if (!ops) return loom_err_set(err, LOOM_EPLUGIN, NULL, "register_cross_device_ops(NULL)");
    if (ops->version < 1 || ops->version > LOOM_CROSS_DEVICE_OPS_VERSION)
        return loom_err_set(err, LOOM_EPLUGIN, NULL, "cross-device ops \"%s\": version %u, this loom speaks 1 to %u",
                            ops->name ? ops->name : "?", ops->version, LOOM_CROSS_DEVICE_OPS_VERSION);
    int job = ops->version >= 4 && (ops->job_open || ops->job_close || ops->job_all_reduce);
    if (job && (!ops->job_open || !ops->job_close || !ops->job_all_reduce))
        return loom_err_set(err, LOOM_EPLUGIN, NULL, "cross-device ops \"%s\" have some of job_open, job_close and "
                            "job_all_reduce: all three or none", ops->name ? ops->name : "?");
    if (!job ? !ops->all_reduce || !ops->broadcast : !ops->all_reduce != !ops->broadcast)
        return loom_err_set(err, LOOM_EPLUGIN, NULL, "cross-device ops \"%s\" lack all_reduce or broadcast%s",
                            ops->name ? ops->name : "?",
                            job ? " (an op with job collectives may leave out both, not one)" : "");
    if (ops->version >= 2 && ops->comm_new && (!ops->comm_free || !ops->all_reduce_rank || !ops->broadcast_rank))
        return loom_err_set(err, LOOM_EPLUGIN, NULL,
                            "cross-device ops \"%s\" have comm_new but lack comm_free, "
                            "all_reduce_rank or broadcast_rank",
                            ops->name ? ops->name : "?");
    return loom_plugin_register_(LOOM_REG_CROSS_DEVICE_OPS, ops->name, ops, NULL, err);
}

static int h_register_strategy(const loom_strategy_ops *ops, const char *const *options, loom_err *err)
{
    if (!ops) return loom_err_set(err, LOOM_EPLUGIN, NULL, "register_strategy(NULL)");
    const char *name = ops->name ? ops->name : "?";
    if (ops->version < 1 || ops->version > LOOM_STRATEGY_OPS_VERSION)
        return loom_err_set(err, LOOM_EPLUGIN, NULL, "strategy \"%s\": version %u, this loom speaks 1 to %u", name,
                            ops->version, LOOM_STRATEGY_OPS_VERSION);
    if (!ops->open || !ops->close || !ops->train_step || !ops->eval_step || !ops->predict || !ops->model ||
        !ops->optimizer || !ops->sync || !ops->num_replicas)
        return loom_err_set(err, LOOM_EPLUGIN, NULL, "strategy \"%s\" leaves a required function NULL", name);
    if (!ops->step_part != !ops->replica)
        return loom_err_set(err, LOOM_EPLUGIN, NULL, "strategy \"%s\": step_part and replica go together", name);
    return loom_plugin_register_(LOOM_REG_STRATEGY, ops->name, ops, options, err);
}

/* A backend that finds no device still registers: `loom devices` and a
 * config naming gpu:N then say why (its probe), instead of "unknown". */
static int h_register_device(const loom_device_ops *ops, loom_err *err)
{
    if (!ops) return loom_err_set(err, LOOM_EPLUGIN, NULL, "register_device(NULL)");
    const char *name = ops->name ? ops->name : "?";
    if (ops->version < 1 || ops->version > LOOM_DEVICE_OPS_VERSION) /* 1: without copy2d */
        return loom_err_set(err, LOOM_EPLUGIN, NULL, "device backend \"%s\": version %u, this loom speaks 1 to %u",
                            name, ops->version, LOOM_DEVICE_OPS_VERSION);
    if (!ops->probe || !ops->describe || !ops->open || !ops->close || !ops->alloc || !ops->free || !ops->upload ||
        !ops->download || !ops->synchronize || !ops->gemm)
        return loom_err_set(err, LOOM_EPLUGIN, NULL, "device backend \"%s\" leaves a required function NULL", name);
    return loom_plugin_register_(LOOM_REG_DEVICE, ops->name, ops, NULL, err);
}

static int h_register_source(const loom_source_ops *ops, loom_err *err)
{
    if (!ops) return loom_err_set(err, LOOM_EPLUGIN, NULL, "register_source(NULL)");
    const char *name = ops->name ? ops->name : "?";
    if (ops->version != LOOM_SOURCE_OPS_VERSION)
        return loom_err_set(err, LOOM_EPLUGIN, NULL, "source \"%s\": version %u, this loom speaks %u", name,
                            ops->version, LOOM_SOURCE_OPS_VERSION);
    if (!ops->open || !ops->cardinality || !ops->rewind || !ops->next || !ops->save || !ops->restore || !ops->close)
        return loom_err_set(err, LOOM_EPLUGIN, NULL, "source \"%s\" leaves a required function NULL", name);
    return loom_plugin_register_(LOOM_REG_SOURCE, ops->name, ops, NULL, err);
}

static int h_register_layer(const loom_layer_ops *ops, loom_err *err)
{
    if (!ops) return loom_err_set(err, LOOM_EPLUGIN, NULL, "register_layer(NULL)");
    const char *name = ops->name ? ops->name : "?";
    if (ops->version != LOOM_LAYER_OPS_VERSION)
        return loom_err_set(err, LOOM_EPLUGIN, NULL, "layer \"%s\": version %u, this loom speaks %u", name,
                            ops->version, LOOM_LAYER_OPS_VERSION);
    if (!ops->build || !ops->free || !ops->forward || !ops->backward)
        return loom_err_set(err, LOOM_EPLUGIN, NULL, "layer \"%s\" leaves a required function NULL (build, free, "
                            "forward and backward are required)", name);
    return loom_plugin_register_(LOOM_REG_LAYER, ops->name, ops, NULL, err);
}

/* "lua" is the Lua provider's, taken at startup like any built-in name. */
static int h_register_transform(const loom_custom_ops *ops, loom_err *err)
{
    if (!ops) return loom_err_set(err, LOOM_EPLUGIN, NULL, "register_transform(NULL)");
    const char *name = ops->name ? ops->name : "?";
    if (ops->version != LOOM_CUSTOM_OPS_VERSION)
        return loom_err_set(err, LOOM_EPLUGIN, NULL, "transform provider \"%s\": version %u, this loom speaks %u",
                            name, ops->version, LOOM_CUSTOM_OPS_VERSION);
    if (!ops->open || !ops->close || (!ops->map && !ops->filter))
        return loom_err_set(err, LOOM_EPLUGIN, NULL,
                            "transform provider \"%s\" needs open, close and a map or filter function", name);
    if (strchr(name, ':'))
        return loom_err_set(err, LOOM_EPLUGIN, NULL, "transform provider \"%s\": a name cannot contain ':'", name);
    return loom_plugin_register_(LOOM_REG_TRANSFORM, ops->name, ops, NULL, err);
}

/* ---- strategy settings --------------------------------------------------------- */

static int h_replicas(const loom_strategy_args *a) { return a->spec->strategy.replicas; }
static uint64_t h_seed(const loom_strategy_args *a) { return a->spec->run.seed; }
static int h_threads(const loom_strategy_args *a)
{
    return a->spec->run.threads > 0 ? a->spec->run.threads : loom_num_cores();
}

static int option_index(const loom_strategy_spec *st, const char *key)
{
    for (int i = 0; i < st->n_options; i++)
        if (!strcmp(st->option_key[i], key)) return i;
    return -1;
}

static const char *h_option(const loom_strategy_args *a, const char *key)
{
    int i = option_index(&a->spec->strategy, key);
    return i < 0 ? NULL : a->spec->strategy.option_value[i];
}

static int h_option_int(const loom_strategy_args *a, const char *key, int64_t def, int64_t lo, int64_t hi, int64_t *out,
                        loom_err *err)
{
    const loom_strategy_spec *st = &a->spec->strategy;
    int i = option_index(st, key);
    *out = def;
    if (i < 0) return LOOM_OK;
    const char *v = st->option_value[i];
    char *end;
    long long x = strtoll(v, &end, 10);
    if (end != v && !*end && x >= lo && x <= hi) {
        *out = x;
        return LOOM_OK;
    }
    char where[LOOM_PATH_MAX + 80];
    if (st->option_line[i] > 0)
        snprintf(where, sizeof where, "%s:%d", st->loc.file, st->option_line[i]);
    else
        snprintf(where, sizeof where, "--set strategy.options.%s", key);
    return loom_err_set(err, LOOM_ECONFIG, where, "strategy.options.%s: expected an integer in [%lld, %lld], got %s",
                        key, (long long)lo, (long long)hi, v);
}

/* ---- batches and models ----------------------------------------------------------- */

static int64_t h_batch_size(const loom_strategy_args *a, const loom_elem *batch)
{
    return batch->t[a->input_idx].shape.dim[0];
}

/* Rows [lo, hi) of a batched tensor, as a view. */
static loom_tensor rows(const loom_tensor *t, int64_t lo, int64_t hi)
{
    loom_tensor v = *t;
    size_t row = t->shape.dim[0] > 0 ? loom_tensor_nbytes(t) / (size_t)t->shape.dim[0] : 0;
    v.owns = 0;
    v.shape.dim[0] = hi - lo;
    v.data = (char *)t->data + (size_t)lo * row;
    return v;
}

static int check_rows(const loom_strategy_args *a, const loom_elem *batch, int64_t lo, int64_t hi, loom_err *err)
{
    int64_t B = h_batch_size(a, batch);
    if (lo < 0 || lo > hi || hi > B)
        return loom_err_set(err, LOOM_EPLUGIN, NULL, "examples [%lld, %lld) are outside the batch of %lld",
                            (long long)lo, (long long)hi, (long long)B);
    return LOOM_OK;
}

static int h_model_new(loom_model **out, const loom_strategy_args *a, loom_err *err)
{
    const loom_elem_spec *in = a->input;
    loom_shape x = in->shape[a->input_idx], y = in->shape[a->label_idx];
    if (x.rank < 1 || x.rank > LOOM_MAX_RANK || y.rank < 1 || y.rank > LOOM_MAX_RANK)
        return loom_err_set(err, LOOM_EPLUGIN, NULL, "model_new: the input and label must be batched (rank 1 to %d), "
                            "got ranks %d and %d", LOOM_MAX_RANK, x.rank, y.rank);
    /* per-example shapes: drop the batch dimension */
    loom_shape xe = loom_shape_make(x.rank - 1, x.dim + 1), ye = loom_shape_make(y.rank - 1, y.dim + 1);
    int rc = loom_model_new(out, &a->spec->model, &xe, in->dtype[a->input_idx], &ye, in->dtype[a->label_idx],
                            a->max_batch, err);
    if (!rc) loom_model_init_params(*out, a->spec->run.seed);
    return rc;
}

static int64_t h_model_outputs(const loom_model *m)
{
    loom_shape s = loom_model_output_shape(m);
    return loom_shape_numel(&s);
}

static int h_model_train_step(loom_model *m, const loom_strategy_args *a, const loom_elem *batch, int64_t lo,
                              int64_t hi, int64_t global_batch, uint64_t rng_key, loom_step_result *out, loom_err *err)
{
    int rc = check_rows(a, batch, lo, hi, err);
    if (rc) return rc;
    if (lo == hi) { /* no examples for this replica: it contributes nothing */
        memset(loom_model_grads(m), 0, (size_t)loom_model_num_params(m) * sizeof(float));
        return LOOM_OK;
    }
    loom_tensor x = rows(&batch->t[a->input_idx], lo, hi), y = rows(&batch->t[a->label_idx], lo, hi);
    double loss = 0;
    int64_t correct = 0;
    rc = loom_model_train_step(m, &x, &y, global_batch, rng_key, &loss, &correct, err);
    if (rc) return rc;
    out->loss_sum += loss;
    out->correct += correct;
    out->examples += hi - lo;
    return LOOM_OK;
}

static int h_model_evaluate(loom_model *m, const loom_strategy_args *a, const loom_elem *batch, int64_t lo, int64_t hi,
                            loom_step_result *out, loom_err *err)
{
    int rc = check_rows(a, batch, lo, hi, err);
    if (rc || lo == hi) return rc;
    loom_tensor x = rows(&batch->t[a->input_idx], lo, hi), y = rows(&batch->t[a->label_idx], lo, hi);
    double loss = 0;
    int64_t correct = 0;
    rc = loom_model_evaluate(m, &x, &y, &loss, &correct, err);
    if (rc) return rc;
    out->loss_sum += loss;
    out->correct += correct;
    out->examples += hi - lo;
    return LOOM_OK;
}

static int h_model_predict(loom_model *m, const loom_strategy_args *a, const loom_elem *batch, int64_t lo, int64_t hi,
                           float *out, loom_err *err)
{
    int rc = check_rows(a, batch, lo, hi, err);
    if (rc || lo == hi) return rc;
    loom_tensor x = rows(&batch->t[a->input_idx], lo, hi);
    return loom_model_predict(m, &x, out, err);
}

/* ---- optimizers --------------------------------------------------------------------- */

static int h_optimizer_new(loom_optimizer **out, const loom_strategy_args *a, int64_t num_params, loom_err *err)
{
    return loom_optimizer_new(out, &a->spec->optimizer, num_params, err);
}

static float *h_optimizer_slots(loom_optimizer *o, int *num_slots)
{
    *num_slots = loom_optimizer_num_slots(o);
    return loom_optimizer_slots(o);
}

/* ---- the table ------------------------------------------------------------------------ */

static const loom_host host = {
    .abi = LOOM_PLUGIN_ABI_VERSION,
    .size = sizeof(loom_host),
    .loom_version = LOOM_VERSION,
    .log = h_log,
    .err_set = h_err_set,
    .err_hint = h_err_hint,
    .alloc = loom_alloc,
    .calloc = loom_calloc,
    .alloc_aligned = loom_alloc_aligned,
    .free = loom_free,
    .register_cross_device_ops = h_register_cross_device_ops,
    .register_strategy = h_register_strategy,
    .find_cross_device_ops = loom_find_cross_device_ops,
    .num_cores = loom_num_cores,
    .pool_new = loom_pool_new,
    .pool_free = loom_pool_free,
    .pool_size = loom_pool_size,
    .pool_run = loom_pool_run,
    .blas_set_threads = loom_blas_set_threads,
    .replicas = h_replicas,
    .seed = h_seed,
    .threads = h_threads,
    .option = h_option,
    .option_int = h_option_int,
    .rng_mix = loom_rng_mix,
    .batch_size = h_batch_size,
    .model_new = h_model_new,
    .model_free = loom_model_free,
    .model_num_params = loom_model_num_params,
    .model_params = loom_model_params,
    .model_grads = loom_model_grads,
    .model_outputs = h_model_outputs,
    .model_train_step = h_model_train_step,
    .model_evaluate = h_model_evaluate,
    .model_predict = h_model_predict,
    .optimizer_new = h_optimizer_new,
    .optimizer_free = loom_optimizer_free,
    .optimizer_apply = loom_optimizer_apply,
    .optimizer_slots = h_optimizer_slots,
    .cluster = NULL,
    .register_device = h_register_device,
    .register_source = h_register_source,
    .register_transform = h_register_transform,
    .register_layer = h_register_layer,
};

const loom_host *loom_plugin_host_(void) { return &host; }
