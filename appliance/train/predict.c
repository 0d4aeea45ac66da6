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
            if (s->kind == LOOM_SRC_CSV) s->csv.columns[k] = s->csv.columns[f];
            if (s->kind == LOOM_SRC_TFRECORD) s->tfrecord.features[k] = s->tfrecord.features[f];
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

enum { MAX_IDS = 8 };

/* One prediction run: what it reads, and the columns it writes. */
typedef struct predict_job {
    const loom_spec *spec;
    const char      *input, *output;
    char             ids[MAX_IDS][LOOM_NAME_MAX]; /* --id's features */
    int              n_ids;
    int              in_idx, id_idx[MAX_IDS];      /* the model input and the ids in the predicted elements */
    int              more_idx[LOOM_MAX_MODEL_INPUTS]; /* model.inputs beyond the first, there */
    int64_t          classes;                      /* the model's outputs per example */
    int64_t          steps;                        /* a per-token softmax (T, classes): T; else 1 */
    int64_t          width;                        /* floats per example predicted: classes, or every head's */
    const loom_model *model;                       /* for the other heads' columns */
    bool             regression, multi_label;      /* the columns' kind of task */
} predict_job;

/* --id: up to MAX_IDS feature names, comma-separated */
static int parse_ids(predict_job *j, const char *id, loom_err *err)
{
    for (const char *p = id ? id : ""; *p;) {
        size_t n = strcspn(p, ",");
        if (n && n < LOOM_NAME_MAX && j->n_ids < MAX_IDS) snprintf(j->ids[j->n_ids++], LOOM_NAME_MAX, "%.*s", (int)n, p);
        else if (n)
            return loom_err_set(err, LOOM_EUSAGE, NULL, "--id: at most %d names of up to %d characters, got \"%s\"",
                                MAX_IDS, LOOM_NAME_MAX - 1, id);
        p += n + (p[n] == ',');
    }
    return LOOM_OK;
}

/* A file for the config's csv/tfrecord/text source: the base pipeline in
 * order, without its split, shuffles, repeats and random flips; without the
 * label (unless --id names it), which a new file may lack. */
static void source_file_dataset(const predict_job *j, const loom_dataset_spec *base, loom_dataset_spec *ds)
{
    const loom_spec *spec = j->spec;
    ds->source = base->source;
    ds->source.n_patterns = 1;
    ds->source.file_shards = ds->source.file_shard = 0;
    ds->source.shuffle_files = false;
    char abs[LOOM_PATH_MAX];
    if (j->input[0] != '/' && getcwd(abs, sizeof abs))
        snprintf(ds->source.pattern[0], LOOM_PATH_MAX, "%.*s/%s", (int)(LOOM_PATH_MAX / 2), abs, j->input);
    else
        snprintf(ds->source.pattern[0], LOOM_PATH_MAX, "%s", j->input);
    bool keep_label = false;
    for (int i = 0; i < j->n_ids; i++) keep_label |= !strcmp(j->ids[i], spec->model.label);
    if (!keep_label && base->source.kind != LOOM_SRC_TEXT) drop_feature(&ds->source, spec->model.label);
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
            for (int f = 0; f < t.features.n; f++)
                if (strcmp(t.features.name[f], spec->model.label)) memcpy(t.features.name[k++], t.features.name[f], LOOM_NAME_MAX);
            t.features.n = k;
        }
        ds->transform[ds->n_transforms++] = t;
    }
}

/* An IDX file of inputs: the base pipeline's maps of the model input, then a
 * batch of the largest size the model takes. */
static int idx_file_dataset(const predict_job *j, const loom_dataset_spec *base, int64_t max_batch,
                            loom_dataset_spec *ds, loom_err *err)
{
    const loom_spec *spec = j->spec;
    ds->source.kind = LOOM_SRC_IDX;
    ds->source.loc = base->loc;
    ds->source.n_features = 1;
    snprintf(ds->source.feature[0], sizeof ds->source.feature[0], "%s", spec->model.input);
    snprintf(ds->source.idx.file[0], sizeof ds->source.idx.file[0], "%s", j->input);
    if (j->n_ids) return loom_err_set(err, LOOM_EUSAGE, j->input, "--id: an IDX file holds only the model input");
    for (int i = 0; i < base->n_transforms; i++) {
        const loom_transform_spec *t = &base->transform[i];
        if (t->kind == LOOM_T_MAP && t->map.kind == LOOM_MAP_LUA) { /* maps whole elements: not a bare input file's */
            char w[LOOM_PATH_MAX + 16];
            loom_err_set(err, LOOM_EUSAGE, loom_loc_str(&t->loc, w, sizeof w),
                         "--input %s: the preprocessing has a Lua map, which needs whole elements", j->input);
            return loom_err_hint(err, "use --input eval (or train), or make the map a built-in op");
        }
        if (t->kind == LOOM_T_MAP && t->map.kind != LOOM_MAP_FLIP_LR && !strcmp(t->map.feature, spec->model.input))
            ds->transform[ds->n_transforms++] = *t;
    }
    loom_transform_spec *b = &ds->transform[ds->n_transforms++];
    memset(b, 0, sizeof *b);
    b->kind = LOOM_T_BATCH;
    b->batch_size = max_batch;
    b->loc = base->loc;
    return LOOM_OK;
}

/* The pipeline --input names: a split of the config (read deterministically),
 * a new file for the config's source, or an IDX file of inputs. */
static int predict_dataset(const predict_job *j, int64_t max_batch, loom_dataset_spec *ds, loom_err *err)
{
    const loom_spec *spec = j->spec;
    const char *input = j->input;
    const loom_dataset_spec *base = spec->eval.present ? &spec->eval : &spec->train;
    if (!strcmp(input, "train") || !strcmp(input, "eval")) {
        if (!strcmp(input, "eval") && !spec->eval.present)
            return loom_err_set(err, LOOM_EUSAGE, spec->path, "--input eval: the config declares no data.eval");
        deterministic_copy(ds, !strcmp(input, "train") ? &spec->train : &spec->eval);
        return LOOM_OK;
    }
    loom_source_kind bk = base->source.kind;
    bool same_kind = (bk == LOOM_SRC_CSV || bk == LOOM_SRC_TFRECORD || bk == LOOM_SRC_TEXT) && !is_idx_name(input);
    ds->present = true;
    ds->loc = base->loc;
    if (!same_kind) return idx_file_dataset(j, base, max_batch, ds, err);
    source_file_dataset(j, base, ds);
    return LOOM_OK;
}

/* The predicted elements hold the model input, of the model's dtype and
 * shape, and each --id feature, one value per example. */
static int check_predicted(predict_job *j, const run *r, const loom_elem_spec *es, loom_err *err)
{
    j->in_idx = loom_elem_spec_find(es, j->spec->model.input);
    for (int f = 1; f < r->args.n_inputs; f++) {
        char buf[1024];
        if ((j->more_idx[f] = loom_elem_spec_find(es, j->spec->model.inputs[f])) < 0)
            return loom_err_set(err, LOOM_EUSAGE, j->input, "no feature \"%s\" (a model input, model.inputs) in the "
                                "predicted elements (%s)", j->spec->model.inputs[f], loom_elem_spec_str(es, buf, sizeof buf));
    }
    for (int i = 0; i < j->n_ids; i++) {
        j->id_idx[i] = loom_elem_spec_find(es, j->ids[i]);
        char buf[1024];
        if (j->id_idx[i] < 0)
            return loom_err_set(err, LOOM_EUSAGE, j->input, "--id: no feature \"%s\" in the predicted elements (%s)",
                                j->ids[i], loom_elem_spec_str(es, buf, sizeof buf));
        if (es->shape[j->id_idx[i]].rank < 1 || per_example(&es->shape[j->id_idx[i]]) != 1)
            return loom_err_set(err, LOOM_EUSAGE, j->input, "--id: feature \"%s\" is not one value per example (%s)",
                                j->ids[i], loom_elem_spec_str(es, buf, sizeof buf));
    }
    loom_shape want = r->args.input->shape[r->args.input_idx], got = es->shape[j->in_idx];
    want.dim[0] = got.dim[0] = 0;
    if (es->dtype[j->in_idx] != r->args.input->dtype[r->args.input_idx] || !loom_shape_eq(&want, &got)) {
        char a[64], b[64];
        return loom_err_set(err, LOOM_ESHAPE, j->input, "inputs are %s %s per example, the model takes %s %s",
                            loom_dtype_name(es->dtype[j->in_idx]), loom_shape_str(&got, a, sizeof a),
                            loom_dtype_name(r->args.input->dtype[r->args.input_idx]),
                            loom_shape_str(&want, b, sizeof b));
    }
    return LOOM_OK;
}

/* The header. Columns by task: regression "prediction"; binary (one sigmoid)
 * "class,probability"; multi-label (several sigmoids) "probability_k";
 * softmax "class,p0,..." */
static void write_header(FILE *f, const predict_job *j)
{
    fprintf(f, "index");
    for (int i = 0; i < j->n_ids; i++) fprintf(f, ",%s", j->ids[i]);
    if (j->regression && j->classes == 1) fprintf(f, ",prediction");
    else if (j->regression)
        for (int64_t c = 0; c < j->classes; c++) fprintf(f, ",prediction_%lld", (long long)c);
    else if (j->spec->model.loss == LOOM_LOSS_BCE && j->classes == 1)
        fprintf(f, ",class,probability");
    else if (j->multi_label)
        for (int64_t c = 0; c < j->classes; c++) fprintf(f, ",probability_%lld", (long long)c);
    else if (j->steps > 1) { /* per token: each step's class, then its probabilities */
        for (int64_t t = 0; t < j->steps; t++) fprintf(f, ",class_%lld", (long long)t);
        for (int64_t c = 0; c < j->classes; c++)
            fprintf(f, ",p%lld_%lld", (long long)(c / (j->classes / j->steps)), (long long)(c % (j->classes / j->steps)));
    } else {
        fprintf(f, ",class");
        for (int64_t c = 0; c < j->classes; c++) fprintf(f, ",p%lld", (long long)c);
    }
    /* several heads: each other head's outputs (probabilities for a classification) as <layer>_<k> */
    for (int h = 1; j->model && h < loom_model_num_heads(j->model); h++) {
        int64_t n = loom_model_head_outputs(j->model, h);
        for (int64_t c = 0; c < n; c++) fprintf(f, ",%s_%lld", loom_model_head_name(j->model, h), (long long)c);
    }
    fputc('\n', f);
}

/* Example i of batch b, its predictions p, as one row. */
static void write_row(FILE *f, const predict_job *j, int64_t index, const loom_elem *b, int64_t i, const float *p)
{
    fprintf(f, "%lld", (long long)index);
    for (int k = 0; k < j->n_ids; k++) {
        const loom_tensor *t = &b->t[j->id_idx[k]];
        double v = loom_tensor_get(t, i);
        if (t->dtype == LOOM_F32 || t->dtype == LOOM_F64) fprintf(f, ",%.9g", v);
        else fprintf(f, ",%lld", (long long)v);
    }
    for (int64_t t = 0; j->steps > 1 && t < j->steps; t++) { /* per token: each step's argmax */
        const int64_t V = j->classes / j->steps;
        int64_t best = 0;
        for (int64_t c = 1; c < V; c++)
            if (p[t * V + c] > p[t * V + best]) best = c;
        fprintf(f, ",%lld", (long long)best);
    }
    if (!j->regression && !j->multi_label && j->steps == 1) {
        int64_t best = 0;
        for (int64_t c = 1; c < j->classes; c++)
            if (p[c] > p[best]) best = c;
        if (j->classes == 1) best = p[0] > 0.5f; /* one sigmoid output: its probability decides */
        fprintf(f, ",%lld", (long long)best);
    }
    for (int64_t c = 0; c < j->width; c++) fprintf(f, ",%.6g", p[c]);
    fputc('\n', f);
}

/* Every batch of it through the model, a row per example; *index counts them. */
static int write_rows(FILE *f, const predict_job *j, run *r, loom_iter *it, float *probs, int64_t *index,
                      loom_err *err)
{
    for (;;) {
        loom_elem *b;
        int rc = loom_iter_next(it, &b, err);
        if (rc == LOOM_EEOF) return LOOM_OK;
        if (rc) return rc;
        loom_elem e = {0};
        e.n = r->args.input->n;
        e.t[r->args.input_idx] = b->t[j->in_idx];
        for (int f = 1; f < r->args.n_inputs; f++) e.t[r->args.inputs_idx[f]] = b->t[j->more_idx[f]];
        rc = loom_strategy_predict(r->strat, &e, probs, err);
        if (rc) return rc;
        int64_t B = b->t[j->in_idx].shape.dim[0];
        for (int64_t i = 0; i < B; i++) write_row(f, j, (*index)++, b, i, probs + i * j->width);
    }
}

int loom_predict_run(const loom_spec *spec, const loom_predict_opts *po, loom_err *err)
{
    predict_job j = {.spec = spec, .input = po->input, .output = po->output};
    int rc = parse_ids(&j, po->id, err);
    if (rc) return rc;
    char target[LOOM_PATH_MAX];
    bool to_stdout = !strcmp(j.output, "-");
    if (!to_stdout && (rc = loom_output_target(j.output, target, sizeof target, err))) return rc; /* before any work */
    run r;
    rc = train_run_open_(&r, spec, po->model_dir, false, NULL, false, err);
    char path[LOOM_PATH_MAX];
    int64_t step;
    if (!rc) rc = train_load_for_inference_(&r, po->checkpoint, path, &step, err);
    if (rc) {
        train_run_close_(&r);
        return rc;
    }
    loom_dataset_spec *ds = loom_calloc(1, sizeof *ds);
    if (!ds) {
        train_run_close_(&r);
        return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating a dataset spec");
    }
    loom_iter *it = NULL;
    FILE *f = NULL;
    loom_wfile *wf = NULL;
    float *probs = NULL;
    int64_t index = 0;
    loom_shape os = loom_model_output_shape(loom_strategy_model(r.strat));
    loom_loss_kind lk = spec->model.loss;
    j.classes = loom_shape_numel(&os);
    j.model = loom_strategy_model(r.strat);
    j.width = loom_model_num_heads(j.model) > 1 ? loom_model_predict_width(j.model) : j.classes;
    j.steps = lk == LOOM_LOSS_SPARSE_SOFTMAX_CE && os.rank == 2 && loom_model_num_heads(j.model) == 1 ? os.dim[0] : 1;
    j.regression = lk == LOOM_LOSS_MSE || lk == LOOM_LOSS_MAE || lk == LOOM_LOSS_HUBER;
    j.multi_label = lk == LOOM_LOSS_BCE && j.classes > 1;
    rc = predict_dataset(&j, r.args.max_batch, ds, err);
    if (!rc) {
        loom_data_ctx ctx = {.seed = spec->run.seed, .threads = 1, .name = "predict"};
        rc = loom_data_open(&it, ds, &ctx, err);
        if (rc) loom_err_prefix(err, "--input %s", j.input);
    }
    if (!rc) rc = check_predicted(&j, &r, loom_iter_spec(it), err);
    if (!rc) { /* written beside the target and renamed onto it when complete */
        if (to_stdout) f = stdout;
        else if (!(rc = loom_wfile_open(&wf, j.output, err))) f = loom_wfile_stream(wf);
    }
    if (!rc && !(probs = loom_alloc((size_t)(r.args.max_batch * j.width) * sizeof(float))))
        rc = loom_err_set(err, LOOM_ENOMEM, NULL, "allocating predictions");
    if (!rc) write_header(f, &j);
    if (!rc) rc = write_rows(f, &j, &r, it, probs, &index, err);
    if (wf && !rc) rc = loom_wfile_commit(wf, err);
    else loom_wfile_abort(wf);
    if (to_stdout && fflush(stdout) != 0 && !rc)
        rc = loom_err_set(err, LOOM_EIO, "-", "write failed: %s", strerror(errno));
    if (!rc) loom_info("wrote %lld predictions to %s (checkpoint %s)", (long long)index, j.output, path);
    loom_free(probs);
    loom_iter_close(it);
    loom_free(ds);
    train_run_close_(&r);
    return rc;
}
