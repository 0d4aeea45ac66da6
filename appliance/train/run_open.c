/* run_open.c - opening a run (run_internal.h) for every command of train/:
 * the config's pipelines (a multi-worker job's share of the batch, the
 * features the model reads and their agreement across data.train and
 * data.eval) and its strategy; closing it. check.c and train.c use it. */
#include "train.h"
#include "run_internal.h"
#include "dir_lock_internal.h"
#include "progress_internal.h"
#include "summary_internal.h"
#include "status_internal.h"
#include "train_hooks_internal.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>


int64_t train_batch_size_of_(const loom_dataset_spec *d)
{
    for (int i = d->n_transforms - 1; i >= 0; i--)
        if (d->transform[i].kind == LOOM_T_BATCH) return d->transform[i].batch_size;
    return 0;
}

static int find_features(const loom_spec *spec, const loom_elem_spec *es, const char *which, int *input_idx,
                         int *label_idx, loom_err *err)
{
    char w[600], have[512];
    *input_idx = loom_elem_spec_find(es, spec->model.input);
    *label_idx = loom_elem_spec_find(es, spec->model.label);
    if (*input_idx < 0 || *label_idx < 0) {
        const char *missing = *input_idx < 0 ? spec->model.input : spec->model.label;
        return loom_err_set(err, LOOM_ESHAPE, loom_loc_str(&spec->model.loc, w, sizeof w),
                            "model.%s: the %s pipeline has no feature \"%s\" (it yields %s)",
                            *input_idx < 0 ? "input" : "label", which, missing,
                            loom_elem_spec_str(es, have, sizeof have));
    }
    return LOOM_OK;
}

/* A source the config names that is missing, truncated or malformed is a
 * problem of the config (exit status 2), found before anything runs. */
static int data_open_failed(loom_err *err, const char *which)
{
    loom_err_prefix(err, "%s", which);
    if (err->code == LOOM_EIO || err->code == LOOM_EDATA) err->code = LOOM_ECONFIG;
    return err->code;
}

void train_run_close_(run *r)
{
    loom_status_close(r->status);
    train_hooks_close_(&r->hooks);
    loom_strategy_close(r->strat);
    loom_iter_close(r->train);
    loom_iter_close(r->eval);
    loom_free(r->train_spec);
    loom_free(r->macc[0]);
    loom_free(r->macc[1]);
    loom_free(r->msnap);
}

/* The config's batch is the job's GLOBAL batch (tf.distribute): with N
 * input pipelines (workers) each yields global / N examples a step, so the
 * union of one step's batches over the workers is one process's batch
 * (with shard_policy data, worker i keeps the batches i, i + N, ...). */
static int share_batch(run *r, const loom_dataset_spec *train, const loom_input_ctx *ic, loom_err *err)
{
    int n = ic->num_input_pipelines;
    r->train_spec = loom_alloc(sizeof *r->train_spec);
    if (!r->train_spec) return loom_err_set(err, LOOM_ENOMEM, NULL, "copying data.train for %d workers", n);
    *r->train_spec = *train;
    for (int i = train->n_transforms - 1; i >= 0; i--) {
        loom_transform_spec *t = &r->train_spec->transform[i];
        if (t->kind != LOOM_T_BATCH) continue;
        if (t->batch_size % n) {
            char w[600];
            loom_err_set(err, LOOM_ECONFIG, loom_loc_str(&t->loc, w, sizeof w),
                         "data.train: the global batch %lld does not split evenly among the %d workers of the job",
                         (long long)t->batch_size, n);
            return loom_err_hint(err, "use a batch size that is a multiple of %d, e.g. %lld (it is the global batch, "
                                 "split among the workers)", n,
                                 (long long)(t->batch_size > n ? t->batch_size / n * n : n));
        }
        t->batch_size /= n;
        return LOOM_OK;
    }
    return LOOM_OK; /* no batch transform: refused below */
}

/* Eval batches go through the same replicas as data.train's (es): the same
 * features at the same places, with the same per-example dtypes and shapes. */
static int eval_matches_train(run *r, const loom_spec *spec, const loom_elem_spec *es, loom_err *err)
{
    char w[600];
    const loom_elem_spec *ev = loom_iter_spec(r->eval);
    int ei, el;
    int rc = find_features(spec, ev, "eval", &ei, &el, err);
    if (rc) return rc;
    if (ei != r->args.input_idx || el != r->args.label_idx) {
        char a[512], b[512];
        return loom_err_set(err, LOOM_ESHAPE, loom_loc_str(&spec->eval.loc, w, sizeof w),
                            "data.eval yields %s but data.train yields %s; the features must match",
                            loom_elem_spec_str(ev, a, sizeof a), loom_elem_spec_str(es, b, sizeof b));
    }
    for (int k = 0; k < 2; k++) {
        int i = k ? el : ei;
        loom_shape x = es->shape[i], y = ev->shape[i];
        x.dim[0] = y.dim[0] = 0;
        if (es->dtype[i] != ev->dtype[i] || !loom_shape_eq(&x, &y)) {
            char a[512], b[512];
            return loom_err_set(err, LOOM_ESHAPE, loom_loc_str(&spec->eval.loc, w, sizeof w),
                                "data.eval yields %s but data.train yields %s; feature \"%s\" must have the same "
                                "dtype and shape",
                                loom_elem_spec_str(ev, a, sizeof a), loom_elem_spec_str(es, b, sizeof b), es->name[i]);
        }
    }
    return LOOM_OK;
}

/* Opens the pipelines and the strategy. `need_eval`: fail if data.eval is
 * absent. cluster: this process's task in a job across processes (NULL: one
 * process); plan_only: `loom check` (the strategy opens no socket). */
/* one_device steps on its model's pool, the train thread with it, across
 * every core: a data.train that only gathers rows from memory makes each
 * batch on that pool inside loom_iter_next (a few us, both threads), not on
 * a prefetch thread that takes a core from one compute thread while the
 * other waits for it at the phase's end (loom_iter_share_pool). With a core
 * to spare (run.threads below the cores), or a pipeline with real work in
 * it, the prefetch keeps its thread. */
static void share_input_pool(run *r)
{
    loom_pool *pool = loom_strategy_step_pool(r->strat);
    if (pool && loom_pool_size(pool) >= loom_num_cores()) r->input_on_pool = loom_iter_share_pool(r->train, pool);
}

/* model.inputs: each a feature of the train and eval pipelines, at the same
 * place in both; their indices into the strategy's args. */
static int find_model_inputs(run *r, const loom_spec *spec, const loom_elem_spec *es, loom_err *err)
{
    char w[600];
    r->args.inputs_idx[0] = r->args.input_idx;
    r->args.n_inputs = spec->model.n_inputs > 1 ? spec->model.n_inputs : 1;
    for (int f = 1; f < r->args.n_inputs; f++) { /* model.inputs: each a feature of both pipelines, at one place */
        const char *name = spec->model.inputs[f];
        int ti = loom_elem_spec_find(es, name), ei = r->eval ? loom_elem_spec_find(loom_iter_spec(r->eval), name) : ti;
        if (ti < 0 || ei != ti) {
            char have[512];
            const loom_elem_spec *in = ti < 0 ? es : loom_iter_spec(r->eval);
            return loom_err_set(err, LOOM_ESHAPE, loom_loc_str(&spec->model.loc, w, sizeof w),
                                "model.inputs: the %s pipeline has no feature \"%s\"%s (it yields %s)",
                                ti < 0 ? "train" : "eval", name, ti < 0 ? "" : " where data.train has it",
                                loom_elem_spec_str(in, have, sizeof have)),
                   loom_err_hint(err, "a model input is a feature of the data: name one of those, or add the feature "
                                      "to the source");
        }
        r->args.inputs_idx[f] = ti;
    }
    /* model.outputs: each head's label a feature of both pipelines, at one place */
    const loom_model_spec *ms = &spec->model;
    r->args.heads_idx[0] = r->args.label_idx;
    r->args.n_heads = ms->n_heads > 1 ? ms->n_heads : 1;
    for (int h = 1; h < r->args.n_heads; h++) {
        const char *name = ms->head[h].label;
        int ti = loom_elem_spec_find(es, name), ei = r->eval ? loom_elem_spec_find(loom_iter_spec(r->eval), name) : ti;
        if (ti < 0 || ei != ti) {
            char have[512];
            const loom_elem_spec *in = ti < 0 ? es : loom_iter_spec(r->eval);
            return loom_err_set(err, LOOM_ESHAPE, loom_loc_str(&ms->head[h].loc, w, sizeof w),
                                "model.outputs: head \"%s\"'s label \"%s\" is not a feature of the %s pipeline%s (it "
                                "yields %s)", ms->head[h].layer, name, ti < 0 ? "train" : "eval",
                                ti < 0 ? "" : " where data.train has it", loom_elem_spec_str(in, have, sizeof have)),
                   loom_err_hint(err, "a head's label is a feature of the data: name one of those, or derive it with "
                                      "a map");
        }
        r->args.heads_idx[h] = ti;
    }
    return LOOM_OK;
}

static int run_open(run *r, const loom_spec *spec, const char *model_dir, bool need_eval, const loom_cluster *cluster,
                    bool plan_only, const char *resume_key, const char *resume_text, loom_err *err);

int train_run_open_(run *r, const loom_spec *spec, const char *model_dir, bool need_eval,
                    const loom_cluster *cluster, bool plan_only, loom_err *err)
{
    return run_open(r, spec, model_dir, need_eval, cluster, plan_only, NULL, NULL, err);
}

int train_run_open_at_(run *r, const loom_spec *spec, const char *model_dir, const loom_cluster *cluster,
                       const char *resume_key, const char *resume_text, loom_err *err)
{
    return run_open(r, spec, model_dir, false, cluster, false, resume_key, resume_text, err);
}

static int run_open(run *r, const loom_spec *spec, const char *model_dir, bool need_eval, const loom_cluster *cluster,
                    bool plan_only, const char *resume_key, const char *resume_text, loom_err *err)
{
    memset(r, 0, sizeof *r);
    r->spec = spec;
    r->args.resume_key = resume_key;
    r->args.resume_text = resume_text;
    r->chief = true;
    r->args.spec = spec;
    r->args.cluster = cluster;
    r->args.plan_only = plan_only;
    snprintf(r->model_dir, sizeof r->model_dir, "%s", model_dir ? model_dir : spec->run.model_dir);
    loom_path_normalize(r->model_dir); /* every checkpoint path it names, as the user reads it */
    r->args.model_dir = r->model_dir;
    /* the built-in strategies spend run.threads on their replicas' own
     * threads (intra-op data parallelism, measured faster than BLAS threads
     * on these small GEMMs), each calling single-threaded BLAS, so the cores
     * are never oversubscribed (LOOM_STRATEGY_OWN_THREADS); a plugin's
     * strategy without that cap gives BLAS run.threads */
    int rc = loom_blas_init(loom_strategy_blas_threads(spec), err);
    if (rc) return rc;
    char w[600];
    if (need_eval && !spec->eval.present)
        return loom_err_set(err, LOOM_ECONFIG, spec->path, "data.eval is not declared"),
               loom_err_hint(err, "add a data.eval section, e.g. the catalog's \"test\" split");
    loom_input_ctx ictx;
    if ((rc = loom_strategy_input_context(&r->args, &ictx, err))) return rc;
    r->multi = ictx.num_input_pipelines > 1;
    r->ictx = ictx;
    if (r->multi && (rc = share_batch(r, &spec->train, &ictx, err))) return rc;
    if (cluster && cluster->n_train_ranks > 1 && spec->strategy.elastic.enabled) r->multi = true; /* (one stream, several tasks) */
    const loom_dataset_spec *train = r->train_spec ? r->train_spec : &spec->train;
    int64_t max_batch = train_batch_size_of_(train);
    if (max_batch <= 0)
        return loom_err_set(err, LOOM_ECONFIG, loom_loc_str(&spec->train.loc, w, sizeof w),
                            "data.train.transforms: no batch transform"),
               loom_err_hint(err, "add { op = \"batch\"; size = 128; } to data.train.transforms");
    int threads = spec->run.threads > 0 ? spec->run.threads : loom_num_cores();
    double t0 = loom_now();
    /* Lua maps and filters run under the hooks section's sandbox and limits */
    loom_lua_opts lua = {.model_dir = r->model_dir, .unsafe = spec->hooks.unsafe, .memory_limit = spec->hooks.memory_limit,
                         .instruction_limit = spec->hooks.instruction_limit};
    loom_data_ctx ctx = {.seed = spec->run.seed, .threads = threads, .name = "train", .input = ictx,
                         .custom_options = &lua, .lazy_threads = plan_only};
    if (ictx.seed_key) { /* the strategy's own per-pipeline seed; the source draws the run's data set */
        ctx.seed = loom_rng_mix(spec->run.seed, ictx.seed_key);
        ctx.source_seed = spec->run.seed, ctx.source_seed_set = true;
    }
    rc = loom_data_open(&r->train, train, &ctx, err);
    if (rc) return data_open_failed(err, "data.train");
    if (spec->eval.present) {
        loom_data_ctx ectx = {.seed = spec->run.seed, .threads = threads, .name = "eval", .custom_options = &lua,
                              .lazy_threads = plan_only};
        rc = loom_data_open(&r->eval, &spec->eval, &ectx, err);
        if (rc) return data_open_failed(err, "data.eval");
        int64_t eb = train_batch_size_of_(&spec->eval);
        if (eb <= 0)
            return loom_err_set(err, LOOM_ECONFIG, loom_loc_str(&spec->eval.loc, w, sizeof w),
                                "data.eval.transforms: no batch transform"),
                   loom_err_hint(err, "add { op = \"batch\"; size = 256; } to data.eval.transforms");
        if (eb > max_batch) max_batch = eb;
    }
    r->decode_sec = loom_now() - t0;
    const loom_elem_spec *es = loom_iter_spec(r->train);
    r->args.input = es;
    r->args.max_batch = max_batch;
    r->args.steps_per_epoch = loom_iter_cardinality(r->train);
    rc = find_features(spec, es, "train", &r->args.input_idx, &r->args.label_idx, err);
    if (rc) return rc;
    if ((rc = find_model_inputs(r, spec, es, err))) return rc;
    if (spec->model.sample_weight[0]) { /* model.sample_weight: in both pipelines, at the same place */
        int wi = loom_elem_spec_find(es, spec->model.sample_weight);
        int we = r->eval ? loom_elem_spec_find(loom_iter_spec(r->eval), spec->model.sample_weight) : wi;
        if (wi < 0 || we != wi) {
            char have[512];
            const loom_elem_spec *in = wi < 0 ? es : loom_iter_spec(r->eval);
            return loom_err_set(err, LOOM_ESHAPE, loom_loc_str(&spec->model.loc, w, sizeof w),
                                "model.sample_weight: the %s pipeline has no feature \"%s\" where data.train has it "
                                "(it yields %s)",
                                wi < 0 ? "train" : "eval", spec->model.sample_weight,
                                loom_elem_spec_str(in, have, sizeof have));
        }
        r->args.weight_idx1 = wi + 1;
    }
    if (r->eval && (rc = eval_matches_train(r, spec, es, err))) return rc;
    if ((rc = loom_strategy_open(&r->strat, &r->args, err))) return rc;
    r->chief = loom_strategy_is_chief(r->strat);
    loom_strategy_set_ckpt_writer(r->strat, loom_ckpt_write_shard); /* tasks that hold shards write them (ps) */
    share_input_pool(r);
    return LOOM_OK;
}
