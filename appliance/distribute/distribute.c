/* distribute.c - the strategy and cross-device-ops registries and the thin
 * wrappers over their vtables (the built-in strategies are in one_device.c,
 * mirrored.c and multi_worker.c, the built-in cross-device ops in xops.c). */
#include "distribute.h"
#include "mirrored_internal.h"
#include "placement_internal.h"
#include "ps_internal.h"
#include "xops_internal.h"

#include <stdio.h>
#include <string.h>

static int distribute_inited;

/* Strategies and cross-device ops live in the shared registry (core.h), so a
 * plugin's and a built-in's are found the same way. origin: NULL = built-in. */
int loom_register_strategy_from(const loom_strategy_ops *ops, const char *origin, loom_err *err)
{
    if (ops->version < 1 || ops->version > LOOM_STRATEGY_OPS_VERSION)
        return loom_err_set(err, LOOM_EPLUGIN, origin ? origin : ops->name,
                            "strategy \"%s\": ops version %u, this build speaks 1 to %u", ops->name, ops->version,
                            LOOM_STRATEGY_OPS_VERSION);
    return loom_registry_add(LOOM_REG_STRATEGY, ops->name, ops, origin, err);
}

int loom_register_cross_device_ops_from(const loom_cross_device_ops *ops, const char *origin, loom_err *err)
{
    if (ops->version < 1 || ops->version > LOOM_CROSS_DEVICE_OPS_VERSION)
        return loom_err_set(err, LOOM_EPLUGIN, origin ? origin : ops->name,
                            "cross-device ops \"%s\": version %u, this build speaks 1 to %u", ops->name,
                            ops->version, LOOM_CROSS_DEVICE_OPS_VERSION);
    int job = ops->version >= 4 && (ops->job_open || ops->job_close || ops->job_all_reduce);
    if (job && (!ops->job_open || !ops->job_close || !ops->job_all_reduce))
        return loom_err_set(err, LOOM_EPLUGIN, origin ? origin : ops->name,
                            "cross-device ops \"%s\" have some of job_open, job_close and job_all_reduce: all three "
                            "or none", ops->name);
    if (!job ? !ops->all_reduce || !ops->broadcast : !ops->all_reduce != !ops->broadcast)
        return loom_err_set(err, LOOM_EPLUGIN, origin ? origin : ops->name,
                            "cross-device ops \"%s\" lack all_reduce or broadcast%s", ops->name,
                            job ? " (an op with job collectives may leave out both, not one)" : "");
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

/* ---- registry setup and wrappers ------------------------------------------ */

int loom_distribute_init(loom_err *err)
{
    if (distribute_inited) return LOOM_OK;
    int rc = loom_xops_register_builtins_(err);
    if (!rc) rc = loom_register_strategy(loom_one_device_ops_(), err);
    if (!rc) rc = loom_replicated_register_(err);
    if (!rc) rc = loom_register_strategy(loom_multi_worker_ops_(), err);
    if (!rc) rc = loom_register_strategy(loom_parameter_server_ops_(), err);
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
        if ((loom_xops_memory(op) & LOOM_XOPS_HOST_MEM) && ((const loom_cross_device_ops *)op)->all_reduce)
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
    const loom_model_spec *ms = &a->spec->model;
    if (ms->n_heads > 1 && a->spec->strategy.kind == LOOM_STRAT_PLUGIN) { /* a plugin's replicas: one output */
        char w[600];
        return loom_err_set(err, LOOM_EUNSUPPORTED, loom_loc_str(&ms->head[1].loc, w, sizeof w),
                            "model.outputs has %d heads; strategy \"%s\" trains a model of one output", ms->n_heads,
                            name),
               loom_err_hint(err, "several heads train under the built-in strategies (strategy.type)");
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
    if (s->xops && !s->xops->all_reduce) { /* an op of the job's collectives only */
        char w[600];
        const char *setting = xops_where(&a->spec->strategy, w, sizeof w);
        loom_err_set(err, LOOM_ECONFIG, w, "%s\"%s\" reduces across the processes of a job only, not among the "
                     "replicas of one process", setting, s->xops->name);
        loom_err_hint(err, "select it with strategy.communication = \"%s\" under multi_worker_mirrored; for the "
                      "replicas of a process use \"auto\" or a built-in op", s->xops->name);
        loom_free(s);
        return LOOM_ECONFIG;
    }
    int builtin = loom_strategy_builtin(ops);
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

void loom_strategy_set_failing(loom_strategy *s)
{
    if (s) s->failing = 1;
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

void loom_strategy_metrics_take(loom_strategy *s, double *acc)
{
    if (!s->ops->replica) {
        loom_model_metrics_take(loom_strategy_model(s), acc);
        return;
    }
    for (int i = 0, n = loom_strategy_num_replicas(s); i < n; i++) {
        loom_model *m = loom_strategy_replica(s, i);
        if (m) loom_model_metrics_take(m, acc);
    }
}

int loom_strategy_step_part(loom_strategy *s, loom_step_part part, const loom_elem *batch, int64_t step,
                            loom_step_result *per_replica, loom_err *err)
{
    return s->ops->step_part(s, part, batch, step, per_replica, err);
}

/* ---- the strategies' descriptions of themselves (version 2) ------------------- */

#define V2(s, f) ((s)->ops->version >= 2 && (s)->ops->f)

bool loom_strategy_builtin(const loom_strategy_ops *ops)
{
    return ops && (ops == loom_one_device_ops_() || ops == loom_multi_worker_ops_() ||
                   ops == loom_parameter_server_ops_() || loom_replicated_owns_(ops));
}

const loom_cluster_roles *loom_strategy_roles(const loom_spec *spec)
{
    loom_err err = {0};
    if (loom_distribute_init(&err)) return NULL;
    const loom_strategy_ops *ops = loom_find_strategy(spec->strategy.name);
    return ops && ops->version >= 5 ? ops->roles : NULL;
}

unsigned loom_strategy_caps(const loom_strategy *s) { return s->ops->version >= 2 ? s->ops->caps : 0; }

loom_pool *loom_strategy_step_pool(loom_strategy *s)
{
    if (!s->args || !s->args->spec || s->args->spec->strategy.kind != LOOM_STRAT_ONE_DEVICE || s->args->plan_only) return NULL;
    loom_model *m = loom_strategy_model(s);
    return m ? loom_model_pool(m) : NULL;
}

int loom_strategy_blas_threads(const loom_spec *spec)
{
    loom_err err;
    if (loom_distribute_init(&err)) return spec->run.threads;
    const loom_strategy_ops *ops = loom_find_strategy(spec->strategy.name);
    return ops && ops->version >= 2 && (ops->caps & LOOM_STRATEGY_OWN_THREADS) ? 1 : spec->run.threads;
}

void loom_strategy_print_plan(loom_strategy *s, int64_t global_batch, FILE *f)
{
    if (V2(s, print_plan)) {
        s->ops->print_plan(s, global_batch, f);
        return;
    }
    const char *origin = NULL;
    loom_registry_find(LOOM_REG_STRATEGY, s->ops->name, &origin);
    const loom_strategy_spec *st = &s->args->spec->strategy;
    fprintf(f, "strategy: %s%s%s%s, %d replica%s, global batch %lld, cross-device op %s\n", s->ops->name,
            origin ? " (from " : "", origin ? origin : "", origin ? ")" : "", loom_strategy_num_replicas(s),
            loom_strategy_num_replicas(s) == 1 ? "" : "s", (long long)global_batch,
            s->xops ? s->xops->name : st->cross_device_ops[0] ? st->cross_device_ops : "none");
}

char *loom_strategy_where(loom_strategy *s, char *buf, size_t n)
{
    if (V2(s, where))
        s->ops->where(s, buf, n);
    else
        snprintf(buf, n, "%d %s replica%s, each", loom_strategy_num_replicas(s), s->ops->name,
                 loom_strategy_num_replicas(s) == 1 ? "" : "s");
    return buf;
}

int loom_strategy_input_context(const loom_strategy_args *a, loom_input_ctx *ctx, loom_err *err)
{
    memset(ctx, 0, sizeof *ctx);
    int rc = loom_distribute_init(err);
    if (rc) return rc;
    const loom_strategy_ops *ops = loom_find_strategy(a->spec->strategy.name);
    if (!ops || ops->version < 2 || !ops->input_context) return LOOM_OK; /* an unknown name fails at open */
    return ops->input_context(a, ctx, err);
}

bool loom_strategy_is_chief(loom_strategy *s) { return V2(s, is_chief) ? s->ops->is_chief(s) : true; }

static int buf_copy(const loom_buf *src, loom_buf *dst, loom_err *err)
{
    loom_buf_init(dst);
    loom_buf_put(dst, src->data, src->len);
    return dst->failed ? loom_err_set(err, LOOM_ENOMEM, NULL, "copying an iterator state of %zu bytes", src->len)
                       : LOOM_OK;
}

int loom_strategy_gather_iter_state(loom_strategy *s, const loom_buf *mine, loom_buf *stored, loom_err *err)
{
    return V2(s, gather_iter_state) ? s->ops->gather_iter_state(s, mine, stored, err) : buf_copy(mine, stored, err);
}

int loom_strategy_pick_iter_state(loom_strategy *s, const loom_buf *stored, loom_buf *mine, loom_err *err)
{
    return V2(s, pick_iter_state) ? s->ops->pick_iter_state(s, stored, mine, err) : buf_copy(stored, mine, err);
}

bool loom_strategy_request_stop(loom_strategy *s)
{
    if (!V2(s, request_stop)) return false;
    s->ops->request_stop(s);
    return true;
}

bool loom_strategy_stop_agreed(loom_strategy *s) { return V2(s, stop_agreed) && s->ops->stop_agreed(s); }

int loom_strategy_end_of_data(loom_strategy *s, int64_t step, loom_step_result *out, bool *all_ended, loom_err *err)
{
    *all_ended = true;
    memset(out, 0, sizeof *out);
    return V2(s, end_of_data) ? s->ops->end_of_data(s, step, out, all_ended, err) : LOOM_OK;
}

int loom_strategy_peers(loom_strategy *s, loom_peer_info *out, int max)
{
    return s->ops->version >= 3 && s->ops->peers ? s->ops->peers(s, out, max) : 0;
}

bool loom_strategy_serves(loom_strategy *s)
{
    return s->ops->version >= 4 && s->ops->serve && !loom_strategy_is_chief(s);
}

int loom_strategy_serve(loom_strategy *s, loom_iter *train, loom_err *err)
{
    LOOM_ASSERT(loom_strategy_serves(s));
    return s->ops->serve(s, train, err);
}

/* ---- sharded checkpoints (parameter_server's; see distribute.h) ---- */

void loom_ckpt_shards_fini(loom_ckpt_shards *s)
{
    if (!s) return;
    loom_free(s->file);
    loom_free(s->part);
    memset(s, 0, sizeof *s);
}

bool loom_strategy_saves_shards(loom_strategy *s) { return s->ops == loom_parameter_server_ops_() && loom_ps_saves_shards_(s); }

void loom_strategy_set_ckpt_writer(loom_strategy *s, loom_ckpt_write_fn fn)
{
    if (s->ops == loom_parameter_server_ops_()) loom_ps_set_ckpt_writer_(s, fn);
}

int loom_strategy_save_shards(loom_strategy *s, const char *dir, int64_t step, loom_ckpt_shards *out, loom_err *err)
{
    LOOM_ASSERT(loom_strategy_saves_shards(s));
    return loom_ps_save_shards_(s, dir, step, out, err);
}
