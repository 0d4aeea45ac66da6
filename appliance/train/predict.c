/* predict.c - loom predict: a checkpoint's predictions for a split of the
 * config, a new file for its source, or an IDX file, written as CSV (the
 * index, the --id features, then the class and probabilities or the
 * prediction). Threads: the caller's. */
#include "run_internal.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* A dataset spec for prediction: no shuffle, no repeat, no random maps. */
static void deterministic_copy(loom_dataset_spec *dst, const loom_dataset_spec *src)
{
    *dst = *src;
    dst->n_transforms = 0;
    for (int i = 0; i < src->n_transforms; i++) {
        const loom_transform_spec *t = &src->transform[i];
        if (t->kind == LOOM_T_SHUFFLE || t->kind == LOOM_T_REPEAT) continue;
        if (t->kind == LOOM_T_MAP && (t->map.kind == LOOM_MAP_FLIP_LR || t->map.kind == LOOM_MAP_RANDOM_BRIGHTNESS ||
                                      t->map.kind == LOOM_MAP_RANDOM_CONTRAST))
            continue;
        dst->transform[dst->n_transforms++] = *t;
    }
}

/* Removes source feature `name` (a csv column, a tfrecord feature), if declared:
 * a new file need not hold the label. */
static void drop_feature(loom_source_spec *s, const char *name)
{
    int k = 0;
    for (int f = 0; f < s->n_features; f++) {
        if (!strcmp(s->feature[f], name)) continue;
        if (k != f) {
            memcpy(s->feature[k], s->feature[f], sizeof s->feature[k]);
            s->csv[k] = s->csv[f];
            s->tfr[k] = s->tfr[f];
        }
        k++;
    }
    s->n_features = k;
}

/* Values per example of a batched shape: the product of the dims after the first. */
static int64_t per_example(const loom_shape *s)
{
    int64_t n = 1;
    for (int d = 1; d < s->rank; d++) n *= s->dim[d];
    return n;
}

static bool is_idx_name(const char *p)
{
    size_t n = strlen(p);
    const char *ends[] = {".idx", ".idx.gz", "ubyte", "ubyte.gz"};
    for (size_t i = 0; i < sizeof ends / sizeof ends[0]; i++) {
        size_t m = strlen(ends[i]);
        if (n >= m && !strcmp(p + n - m, ends[i])) return true;
    }
    return false;
}

int loom_predict(const loom_spec *spec, const char *model_dir, const char *checkpoint, const char *input,
                 const char *output, loom_err *err)
{
    loom_predict_opts o = {.model_dir = model_dir, .checkpoint = checkpoint, .input = input, .output = output};
    return loom_predict_run(spec, &o, err);
}

/* long: the input's forms (a split of the config, a file for its source, an IDX file), the --id
 * columns and the CSV writer per kind of task share the run and its cleanup on every path; the
 * steps (pipeline, ids, header, rows) are to become functions of their own. */
int loom_predict_run(const loom_spec *spec, const loom_predict_opts *po, loom_err *err)
{
    const char *model_dir = po->model_dir, *checkpoint = po->checkpoint, *input = po->input, *output = po->output;
    enum { MAX_IDS = 8 };
    char ids[MAX_IDS][LOOM_NAME_MAX];
    int n_ids = 0;
    for (const char *p = po->id ? po->id : ""; *p;) {
        size_t n = strcspn(p, ",");
        if (n && n < LOOM_NAME_MAX && n_ids < MAX_IDS) snprintf(ids[n_ids++], LOOM_NAME_MAX, "%.*s", (int)n, p);
        else if (n)
            return loom_err_set(err, LOOM_EUSAGE, NULL, "--id: at most %d names of up to %d characters, got \"%s\"",
                                MAX_IDS, LOOM_NAME_MAX - 1, po->id);
        p += n + (p[n] == ',');
    }
    run r;
    int rc = run_open_(&r, spec, model_dir, false, NULL, false, err);
    char path[LOOM_PATH_MAX];
    int64_t step;
    if (!rc) rc = load_for_inference_(&r, checkpoint, path, &step, err);
    if (rc) {
        run_close_(&r);
        return rc;
    }
    loom_dataset_spec *ds = loom_calloc(1, sizeof *ds);
    if (!ds) {
        run_close_(&r);
        return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating a dataset spec");
    }
    const loom_dataset_spec *base = spec->eval.present ? &spec->eval : &spec->train;
    if (!strcmp(input, "train") || !strcmp(input, "eval")) {
        if (!strcmp(input, "eval") && !spec->eval.present) {
            loom_free(ds);
            run_close_(&r);
            return loom_err_set(err, LOOM_EUSAGE, spec->path, "--input eval: the config declares no data.eval");
        }
        deterministic_copy(ds, !strcmp(input, "train") ? &spec->train : &spec->eval);
    } else {
        /* An IDX file of inputs, or a file for the config's csv/tfrecord/text
         * source: the base pipeline's deterministic maps of the model input, then batch. */
        loom_source_kind bk = base->source.kind;
        bool same_kind = (bk == LOOM_SRC_CSV || bk == LOOM_SRC_TFRECORD || bk == LOOM_SRC_TEXT) && !is_idx_name(input);
        ds->present = true;
        ds->loc = base->loc;
        if (same_kind) {
            ds->source = base->source;
            ds->source.n_patterns = 1;
            ds->source.file_shards = ds->source.file_shard = 0;
            ds->source.shuffle_files = false;
            char abs[LOOM_PATH_MAX];
            if (input[0] != '/' && getcwd(abs, sizeof abs))
                snprintf(ds->source.pattern[0], LOOM_PATH_MAX, "%.*s/%s", (int)(LOOM_PATH_MAX / 2), abs, input);
            else
                snprintf(ds->source.pattern[0], LOOM_PATH_MAX, "%s", input);
            /* the base pipeline in order, without its split, shuffles, repeats and random
             * flips; without the label (unless --id names it), which a new file may lack */
            bool keep_label = false;
            for (int i = 0; i < n_ids; i++) keep_label |= !strcmp(ids[i], spec->model.label);
            if (!keep_label && bk != LOOM_SRC_TEXT) drop_feature(&ds->source, spec->model.label);
            for (int i = 0; i < base->n_transforms; i++) {
                loom_transform_spec t = base->transform[i];
                if (t.kind == LOOM_T_SHUFFLE || t.kind == LOOM_T_REPEAT || t.kind == LOOM_T_SPLIT) continue;
                if (t.kind == LOOM_T_MAP && t.map.kind == LOOM_MAP_FLIP_LR) continue;
                if (!keep_label && ((t.kind == LOOM_T_MAP && t.map.kind != LOOM_MAP_LUA &&
                                     !strcmp(t.map.feature, spec->model.label)) ||
                                    (t.kind == LOOM_T_FILTER && t.filter != LOOM_FILTER_LUA &&
                                     !strcmp(t.feature, spec->model.label))))
                    continue;
                if (!keep_label && t.kind == LOOM_T_SELECT) {
                    int k = 0;
                    for (int j = 0; j < t.features.n; j++)
                        if (strcmp(t.features.name[j], spec->model.label)) memcpy(t.features.name[k++], t.features.name[j], LOOM_NAME_MAX);
                    t.features.n = k;
                }
                ds->transform[ds->n_transforms++] = t;
            }
        } else {
            ds->source.kind = LOOM_SRC_IDX;
            ds->source.loc = base->loc;
            ds->source.n_features = 1;
            snprintf(ds->source.feature[0], sizeof ds->source.feature[0], "%s", spec->model.input);
            snprintf(ds->source.file[0], sizeof ds->source.file[0], "%s", input);
            if (n_ids) {
                loom_free(ds);
                run_close_(&r);
                return loom_err_set(err, LOOM_EUSAGE, input, "--id: an IDX file holds only the model input");
            }
        }
        for (int i = 0; i < base->n_transforms && !same_kind; i++) {
            const loom_transform_spec *t = &base->transform[i];
            if (t->kind == LOOM_T_MAP && t->map.kind == LOOM_MAP_LUA) { /* maps whole elements: not a bare input file's */
                char w[LOOM_PATH_MAX + 16];
                loom_free(ds);
                run_close_(&r);
                loom_err_set(err, LOOM_EUSAGE, loom_loc_str(&t->loc, w, sizeof w),
                             "--input %s: the preprocessing has a Lua map, which needs whole elements", input);
                return loom_err_hint(err, "use --input eval (or train), or make the map a built-in op");
            }
            if (t->kind == LOOM_T_MAP && t->map.kind != LOOM_MAP_FLIP_LR && !strcmp(t->map.feature, spec->model.input))
                ds->transform[ds->n_transforms++] = *t;
        }
        if (!same_kind) {
            loom_transform_spec *b = &ds->transform[ds->n_transforms++];
            memset(b, 0, sizeof *b);
            b->kind = LOOM_T_BATCH;
            b->batch_size = r.args.max_batch;
            b->loc = base->loc;
        }
    }
    loom_iter *it = NULL;
    loom_data_ctx ctx = {.seed = spec->run.seed, .threads = 1, .name = "predict"};
    rc = loom_data_open(&it, ds, &ctx, err);
    if (rc) loom_err_prefix(err, "--input %s", input);
    int in_idx = -1, id_idx[MAX_IDS];
    if (!rc) {
        const loom_elem_spec *es = loom_iter_spec(it);
        in_idx = loom_elem_spec_find(es, spec->model.input);
        for (int i = 0; i < n_ids && !rc; i++) {
            id_idx[i] = loom_elem_spec_find(es, ids[i]);
            char buf[1024];
            if (id_idx[i] < 0)
                rc = loom_err_set(err, LOOM_EUSAGE, input, "--id: no feature \"%s\" in the predicted elements (%s)",
                                  ids[i], loom_elem_spec_str(es, buf, sizeof buf));
            else if (es->shape[id_idx[i]].rank < 1 || per_example(&es->shape[id_idx[i]]) != 1)
                rc = loom_err_set(err, LOOM_EUSAGE, input, "--id: feature \"%s\" is not one value per example (%s)",
                                  ids[i], loom_elem_spec_str(es, buf, sizeof buf));
        }
        if (rc) {
            loom_iter_close(it);
            loom_free(ds);
            run_close_(&r);
            return rc;
        }
        loom_shape want = r.args.input->shape[r.args.input_idx], got = es->shape[in_idx];
        want.dim[0] = got.dim[0] = 0;
        if (es->dtype[in_idx] != r.args.input->dtype[r.args.input_idx] || !loom_shape_eq(&want, &got)) {
            char a[64], b[64];
            rc = loom_err_set(err, LOOM_ESHAPE, input, "inputs are %s %s per example, the model takes %s %s",
                              loom_dtype_name(es->dtype[in_idx]), loom_shape_str(&got, a, sizeof a),
                              loom_dtype_name(r.args.input->dtype[r.args.input_idx]), loom_shape_str(&want, b, sizeof b));
        }
    }
    FILE *f = NULL;
    if (!rc) {
        f = strcmp(output, "-") ? fopen(output, "w") : stdout;
        if (!f) rc = loom_err_set(err, LOOM_EIO, output, "cannot create: %s", strerror(errno));
    }
    loom_shape os = loom_model_output_shape(loom_strategy_model(r.strat));
    int64_t classes = loom_shape_numel(&os);
    float *probs = rc ? NULL : loom_alloc((size_t)(r.args.max_batch * classes) * sizeof(float));
    if (!rc && !probs) rc = loom_err_set(err, LOOM_ENOMEM, NULL, "allocating predictions");
    /* columns by task: regression "prediction"; binary (one sigmoid) "class,probability";
     * multi-label (several sigmoids) "probability_k"; softmax "class,p0,..." */
    loom_loss_kind lk = spec->model.loss;
    bool regression = lk == LOOM_LOSS_MSE || lk == LOOM_LOSS_MAE || lk == LOOM_LOSS_HUBER;
    bool multi_label = lk == LOOM_LOSS_BCE && classes > 1;
    if (!rc) {
        fprintf(f, "index");
        for (int i = 0; i < n_ids; i++) fprintf(f, ",%s", ids[i]);
        if (regression && classes == 1) fprintf(f, ",prediction");
        else if (regression)
            for (int64_t c = 0; c < classes; c++) fprintf(f, ",prediction_%lld", (long long)c);
        else if (lk == LOOM_LOSS_BCE && classes == 1)
            fprintf(f, ",class,probability");
        else if (multi_label)
            for (int64_t c = 0; c < classes; c++) fprintf(f, ",probability_%lld", (long long)c);
        else {
            fprintf(f, ",class");
            for (int64_t c = 0; c < classes; c++) fprintf(f, ",p%lld", (long long)c);
        }
        fputc('\n', f);
    }
    int64_t index = 0;
    while (!rc) {
        loom_elem *b;
        rc = loom_iter_next(it, &b, err);
        if (rc == LOOM_EEOF) {
            rc = LOOM_OK;
            break;
        }
        if (rc) break;
        loom_elem e = {0};
        e.n = r.args.input->n;
        e.t[r.args.input_idx] = b->t[in_idx];
        rc = loom_strategy_predict(r.strat, &e, probs, err);
        int64_t B = b->t[in_idx].shape.dim[0];
        for (int64_t i = 0; i < B && !rc; i++) {
            const float *p = probs + i * classes;
            fprintf(f, "%lld", (long long)index++);
            for (int k = 0; k < n_ids; k++) {
                const loom_tensor *t = &b->t[id_idx[k]];
                double v = loom_tensor_get(t, i);
                if (t->dtype == LOOM_F32 || t->dtype == LOOM_F64) fprintf(f, ",%.9g", v);
                else fprintf(f, ",%lld", (long long)v);
            }
            if (!regression && !multi_label) {
                int64_t best = 0;
                for (int64_t c = 1; c < classes; c++)
                    if (p[c] > p[best]) best = c;
                if (classes == 1) best = p[0] > 0.5f; /* one sigmoid output: its probability decides */
                fprintf(f, ",%lld", (long long)best);
            }
            for (int64_t c = 0; c < classes; c++) fprintf(f, ",%.6g", p[c]);
            fputc('\n', f);
        }
    }
    if (f && f != stdout && fclose(f) != 0 && !rc) rc = loom_err_set(err, LOOM_EIO, output, "write failed: %s", strerror(errno));
    if (!rc) loom_info("wrote %lld predictions to %s (checkpoint %s)", (long long)index, output, path);
    loom_free(probs);
    loom_iter_close(it);
    loom_free(ds);
    run_close_(&r);
    return rc;
}
