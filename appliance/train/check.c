/* check.c - loom check (the pipelines, the model's summary, the strategy's
 * plan; an empty data.train and labels beyond the classes found before any
 * step) and loom check --gradcheck, on a run opened plan-only. */
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


static void print_pipeline(FILE *f, const char *name, loom_iter *it)
{
    char buf[1024];
    int64_t card = loom_iter_cardinality(it);
    fprintf(f, "data.%s: %s", name, loom_elem_spec_str(loom_iter_spec(it), buf, sizeof buf));
    if (card >= 0) fprintf(f, "; %lld batches per epoch\n", (long long)card);
    else fprintf(f, "; %s\n", card == -1 ? "infinite" : "unknown length");
    fprintf(f, "  plan: "); /* the stages after data.options.optimization's rewrites */
    loom_iter_plan(it, f);
}

/* `loom check` reads data.train and data.eval (a first batch, the labels):
 * a synthetic source under transforms that only move elements (batch,
 * shuffle, take, ...) gives the same labels and batches with its other
 * features one value each, as each feature is drawn from a stream of its
 * own; so check reads such a copy (the real pipeline of ResNet-50's
 * 224x224x3 images took most of its 1.5 s), opened as run_open opens the
 * pipeline (this worker's share and shard, its seed). NULL: read the
 * pipeline itself (another source or transform). */
static loom_iter *check_light_open(const run *r, const loom_spec *spec, bool eval)
{
    static const bool moves[] = {[LOOM_T_SHUFFLE] = true, [LOOM_T_BATCH] = true, [LOOM_T_REPEAT] = true,
                                 [LOOM_T_TAKE] = true, [LOOM_T_SKIP] = true, [LOOM_T_PREFETCH] = true};
    const loom_dataset_spec *d = eval ? &spec->eval : r->train_spec ? r->train_spec : &spec->train;
    if (d->source.kind != LOOM_SRC_SYNTHETIC) return NULL;
    for (int i = 0; i < d->n_transforms; i++)
        if ((unsigned)d->transform[i].kind >= sizeof moves / sizeof moves[0] || !moves[d->transform[i].kind])
            return NULL;
    loom_dataset_spec *c = loom_calloc(1, sizeof *c);
    if (!c) return NULL;
    *c = *d;
    for (int f = 0; f < c->source.n_features; f++)
        if (strcmp(c->source.feature[f], spec->model.label)) {
            loom_syn_feature *sf = &c->source.synthetic.features[f];
            sf->rank = 1, sf->shape[0] = 1;
        }
    loom_data_ctx ctx = {.seed = spec->run.seed, .threads = 0, .name = eval ? "eval" : "train"};
    if (!eval) {
        ctx.input = r->ictx;
        if (r->ictx.seed_key) { /* as run_open: the pipeline's own seed, the source the run's */
            ctx.seed = loom_rng_mix(spec->run.seed, r->ictx.seed_key);
            ctx.source_seed = spec->run.seed, ctx.source_seed_set = true;
        }
    }
    loom_iter *it = NULL;
    loom_err e;
    if (loom_data_open(&it, c, &ctx, &e)) it = NULL; /* (the pipeline itself then says what is wrong) */
    loom_free(c);
    return it;
}

/* An empty data.train is the config's error, found by check rather than by
 * the first epoch: its size when known ahead, else by reading one batch.
 * its: the iterators check reads, data.train's [0] and data.eval's [1] (NULL: none). */
static int check_train_not_empty(loom_iter *const *its, const loom_spec *spec, loom_err *err)
{
    /* the first batch of each pipeline is read, so a wrong header, a field of
     * the wrong dtype or a missing feature fails here rather than mid-run */
    loom_elem *b;
    int rc;
    if (its[1]) {
        rc = loom_iter_next(its[1], &b, err);
        if (rc == LOOM_EEOF)
            loom_warn("data.eval yields no batch: there will be no eval data");
        else if (rc)
            return loom_err_prefix(err, "data.eval, first batch"), rc;
        if ((rc = loom_iter_rewind(its[1], 0, err))) return rc;
    }
    rc = loom_iter_next(its[0], &b, err);
    if (rc != LOOM_EEOF) return rc == LOOM_OK ? loom_iter_rewind(its[0], 0, err) : rc;
    const loom_dataset_spec *d = &spec->train;
    const loom_loc *l = d->loc.file[0] ? &d->loc : &d->source.loc;
    char where[LOOM_PATH_MAX + 16];
    loom_loc_str(l, where, sizeof where);
    loom_err_set(err, LOOM_ECONFIG, where[0] ? where : spec->path, "data.train yields no batch: the training set is empty");
    return loom_err_hint(err, "check the source's files and counts, and take/skip/filter/shard, or a batch with "
                         "drop_remainder larger than the data");
}

/* The largest label of up to CHECK_LABEL_BATCHES batches of it (the whole
 * pass when shorter), for a class count check, reading for at most
 * CHECK_LABEL_SECONDS after the first batch (224x224 images make 100 batches
 * seconds of work, and check is meant to be quick); *batches gets how many
 * it read. NaN when it holds no label or none was read. Rewinds it. */
#define CHECK_LABEL_BATCHES 100
#define CHECK_LABEL_SECONDS 0.25
static int largest_label(loom_iter *it, const char *label, double *top, int64_t *batches, loom_err *err)
{
    *top = NAN;
    *batches = 0;
    int li = loom_elem_spec_find(loom_iter_spec(it), label);
    if (li < 0) return LOOM_OK;
    int rc = LOOM_OK;
    double t0 = loom_now();
    while (*batches < CHECK_LABEL_BATCHES && (*batches == 0 || loom_now() - t0 < CHECK_LABEL_SECONDS)) {
        loom_elem *b;
        if ((rc = loom_iter_next(it, &b, err))) break;
        ++*batches;
        const loom_tensor *t = &b->t[li];
        int64_t n = loom_shape_numel(&t->shape);
        for (int64_t i = 0; i < n; i++) {
            double v = t->dtype == LOOM_U8    ? ((const uint8_t *)t->data)[i]
                       : t->dtype == LOOM_I32 ? ((const int32_t *)t->data)[i]
                       : t->dtype == LOOM_I64 ? (double)((const int64_t *)t->data)[i]
                       : t->dtype == LOOM_F32 ? ((const float *)t->data)[i]
                       : t->dtype == LOOM_F64 ? ((const double *)t->data)[i]
                                              : NAN;
            if (!(v <= *top)) *top = v; /* (the first, and NaN beats nothing: training names it) */
        }
    }
    if (rc == LOOM_EEOF) rc = LOOM_OK;
    return rc ? rc : loom_iter_rewind(it, 0, err);
}

/* sparse_softmax_cross_entropy needs a class per label: labels of 0..2 on a
 * last layer of 2 units passed check and failed at step 1. The labels of
 * the first batches of data.train and data.eval (each pass whole when it is
 * short) against the model's output count, naming the last layer's line. */
static int check_classes(run *r, loom_iter *const *its, const loom_spec *spec, loom_err *err)
{
    const loom_model_spec *ms = &spec->model;
    if (ms->loss != LOOM_LOSS_SPARSE_SOFTMAX_CE || ms->n_layers < 1) return LOOM_OK;
    loom_shape os = loom_model_output_shape(loom_strategy_model(r->strat));
    int64_t classes = loom_shape_numel(&os);
    for (int k = 0; k < 2; k++) {
        if (!its[k]) continue;
        double top;
        int64_t nb;
        int rc = largest_label(its[k], ms->label, &top, &nb, err);
        if (rc) return loom_err_prefix(err, "data.%s, reading its labels", k ? "eval" : "train"), rc;
        if (!(top >= (double)classes)) continue;
        const loom_layer_spec *l = &ms->layer[ms->n_layers - 1];
        char where[LOOM_PATH_MAX + 16], outs[48];
        loom_loc_str(l->loc.file[0] ? &l->loc : &ms->loc, where, sizeof where);
        if (l->kind == LOOM_LAYER_DENSE && l->units == classes) snprintf(outs, sizeof outs, "units = %d", l->units);
        else snprintf(outs, sizeof outs, "%lld output%s", (long long)classes, classes == 1 ? "" : "s");
        loom_err_set(err, LOOM_ECONFIG, where,
                     "model.layers.[%d] (%s): %s, but data.%s has label %.17g (the largest in its first %lld batch%s): "
                     "sparse_softmax_cross_entropy needs one output per class",
                     ms->n_layers - 1, l->name, outs, k ? "eval" : "train", top, (long long)nb, nb == 1 ? "" : "es");
        return loom_err_hint(err, "labels must be integers from 0 to %lld here: give the last layer %.17g outputs (or "
                             "more), or map the labels into range", (long long)(classes - 1), top + 1);
    }
    return LOOM_OK;
}

int loom_gradcheck(const loom_spec *spec, const loom_cluster *cluster, FILE *f, loom_err *err)
{
    run r;
    int failed = 0;
    int rc = train_run_open_(&r, spec, NULL, false, cluster, true, err);
    if (!rc) rc = loom_model_gradcheck(loom_strategy_model(r.strat), f, &failed, err);
    if (!rc && failed) {
        char w[LOOM_PATH_MAX + 16];
        loom_loc_str(&spec->model.loc, w, sizeof w);
        rc = loom_err_set(err, LOOM_ENUMERIC, w[0] ? w : spec->path,
                          "gradcheck: %d layer%s backward disagree%s with central differences", failed,
                          failed == 1 ? "'s" : "s'", failed == 1 ? "s" : "");
        loom_err_hint(err, "the FAIL rows above name them; a plugin layer's backward is its own code");
    }
    train_run_close_(&r);
    return rc;
}

int loom_check(const loom_spec *spec, const loom_cluster *cluster, FILE *f, loom_err *err)
{
    run r;
    int rc = train_run_open_(&r, spec, NULL, false, cluster, true, err);
    if (!rc) rc = train_hooks_open_(&r.hooks, spec, r.model_dir, r.strat, err); /* finds every Lua function */
    loom_iter *light[2] = {NULL, NULL}, *its[2] = {r.train, r.eval};
    if (!rc) {
        light[0] = check_light_open(&r, spec, false);
        light[1] = r.eval ? check_light_open(&r, spec, true) : NULL;
        for (int k = 0; k < 2; k++) its[k] = light[k] ? light[k] : its[k];
    }
    if (!rc) rc = check_train_not_empty(its, spec, err);
    if (!rc) rc = check_classes(&r, its, spec, err);
    for (int k = 0; k < 2; k++) loom_iter_close(light[k]);
    if (!rc && r.hooks.hooks)
        fprintf(f, "hooks: %d callback%s, %s training step\n", loom_hooks_num_callbacks(r.hooks.hooks),
                loom_hooks_num_callbacks(r.hooks.hooks) == 1 ? "" : "s",
                loom_hooks_has_train_step(r.hooks.hooks) ? "a custom (Lua)" : "the built-in");
    if (!rc) {
        print_pipeline(f, "train", r.train);
        if (r.eval) print_pipeline(f, "eval", r.eval);
        loom_model *m = loom_strategy_model(r.strat);
        loom_model_summary(m, f);
        fprintf(f, "optimizer: %s, learning rate %g at step 0\n",
                (const char *const[]){"sgd", "momentum", "adam", "adamw", "rmsprop", "adagrad"}[spec->optimizer.kind],
                loom_optimizer_lr(loom_strategy_optimizer(r.strat), 0));
        loom_strategy_print_plan(r.strat, train_batch_size_of_(&spec->train), f);
        fprintf(f, "compute: %d thread%s; BLAS %s (%s), %d thread%s each\n", loom_model_threads(m),
                loom_model_threads(m) == 1 ? "" : "s", loom_blas_core(), loom_blas_core_reason(), loom_blas_threads(),
                loom_blas_threads() == 1 ? "" : "s");
    }
    train_run_close_(&r);
    return rc;
}
