/* model.c - the train/evaluate/predict steps of a model model_build.c
 * built, whole or in parts, over the intra-op threads' chunks of the batch.
 * A step allocates nothing. */
#include "nn_internal.h"

#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <string.h>

/* ---- steps ------------------------------------------------------------------ */

static loom_shape batch_of(int64_t B, const loom_shape *s)
{
    loom_shape r = {.rank = s->rank + 1};
    r.dim[0] = B;
    for (int i = 0; i < s->rank; i++) r.dim[i + 1] = s->dim[i];
    return r;
}

int nn_check_batch_(loom_model *m, const loom_tensor *x, const loom_tensor *label, int64_t *B, loom_err *err)
{
    char a[96], b[96];
    if (x->dtype != m->input_dtype)
        return loom_err_set(err, LOOM_ESHAPE, m->where, "input batch is %s, the model needs %s",
                            loom_dtype_name(x->dtype), loom_dtype_name(m->input_dtype)),
               loom_err_hint(err, "add a cast or scale map to the input transforms");
    int ok = x->shape.rank == m->input.rank + 1;
    for (int i = 0; ok && i < m->input.rank; i++) ok = x->shape.dim[i + 1] == m->input.dim[i];
    loom_shape want = {.rank = m->input.rank + 1};
    want.dim[0] = x->shape.rank > 0 ? x->shape.dim[0] : 0;
    for (int i = 0; i < m->input.rank; i++) want.dim[i + 1] = m->input.dim[i];
    if (!ok)
        return loom_err_set(err, LOOM_ESHAPE, m->where, "input batch has shape %s, the model was built for %s",
                            loom_shape_str(&x->shape, a, sizeof a), loom_shape_str(&want, b, sizeof b));
    *B = x->shape.dim[0];
    if (*B < 1 || *B > m->max_batch)
        return loom_err_set(err, LOOM_ESHAPE, m->where, "batch of %lld examples; the model takes 1 to %lld",
                            (long long)*B, (long long)m->max_batch);
    int rc;
    if (m->layer[0].spec.kind == LOOM_LAYER_EMBEDDING && (rc = nn_embedding_check_ids_(m, 0, x->data, *B, err)))
        return rc;
    for (int f = 1; f < m->n_inputs; f++) { /* model.inputs: each (B, its shape), float32 */
        const loom_tensor *t = m->xs[f];
        if (!t)
            return loom_err_set(err, LOOM_ESHAPE, m->where, "model input \"%s\" was not given with the batch",
                                m->in_name[f]);
        bool same = t->dtype == LOOM_F32 && t->shape.rank == m->in_shape[f].rank + 1 && t->shape.dim[0] == *B;
        for (int d = 0; same && d < m->in_shape[f].rank; d++) same = t->shape.dim[d + 1] == m->in_shape[f].dim[d];
        if (!same) {
            loom_shape w = batch_of(*B, &m->in_shape[f]);
            return loom_err_set(err, LOOM_ESHAPE, m->where, "model input \"%s\" has shape %s (%s), the model was "
                                "built for %s float32", m->in_name[f], loom_shape_str(&t->shape, a, sizeof a),
                                loom_dtype_name(t->dtype), loom_shape_str(&w, b, sizeof b));
        }
    }
    return label ? nn_check_label_(m, label, *B, err) : LOOM_OK;
}

int nn_loss_error_(const loom_model *m, double loss, int64_t B, loom_err *err)
{
    return loom_err_set(err, LOOM_ENUMERIC, m->where, "the loss is %g on a batch of %lld examples", loss, (long long)B),
           loom_err_hint(err, "lower the learning rate, or check the inputs are scaled (e.g. to [0, 1])");
}

int nn_check_label_(loom_model *m, const loom_tensor *label, int64_t B, loom_err *err)
{
    char a[96], b[96];
    int ok = label->shape.rank == m->label.rank + 1 && label->shape.dim[0] == B;
    for (int i = 0; ok && i < m->label.rank; i++) ok = label->shape.dim[i + 1] == m->label.dim[i];
    if (!ok) {
        loom_shape lw = {.rank = m->label.rank + 1};
        lw.dim[0] = B;
        for (int i = 0; i < m->label.rank; i++) lw.dim[i + 1] = m->label.dim[i];
        return loom_err_set(err, LOOM_ESHAPE, m->where, "label batch has shape %s, expected %s",
                            loom_shape_str(&label->shape, a, sizeof a), loom_shape_str(&lw, b, sizeof b));
    }
    return LOOM_OK;
}

/* Labels, targets and sample weights come in any numeric dtype: value i
 * of a tensor's data as a double (exact for every dtype here). */
typedef double (*number_at)(const void *data, int64_t i);
static double u8_at(const void *d, int64_t i) { return ((const uint8_t *)d)[i]; }
static double i32_at(const void *d, int64_t i) { return ((const int32_t *)d)[i]; }
static double i64_at(const void *d, int64_t i) { return (double)((const int64_t *)d)[i]; }
static double f32_at(const void *d, int64_t i) { return ((const float *)d)[i]; }
static double f64_at(const void *d, int64_t i) { return ((const double *)d)[i]; }

/* The reader of dtype's values; NULL for a dtype that is not a number. */
static number_at number_reader(loom_dtype dt)
{
    switch (dt) {
    case LOOM_U8: return u8_at;
    case LOOM_I32: return i32_at;
    case LOOM_I64: return i64_at;
    case LOOM_F32: return f32_at;
    case LOOM_F64: return f64_at;
    default: return NULL;
    }
}

static int bad_label(loom_err *err, const loom_model *m, int64_t b, double v, int64_t n)
{
    return loom_err_set(err, LOOM_EDATA, m->where, "label of example %lld in the batch is %.17g, not a class in [0, %lld)",
                        (long long)b, v, (long long)n),
           loom_err_hint(err, "the last layer has %lld units; labels must be integers from 0 to %lld", (long long)n,
                         (long long)(n - 1));
}

int nn_read_labels_(loom_model *m, const loom_tensor *label, int64_t B, loom_err *err)
{
    const int64_t T = m->seq_T ? m->seq_T : 1, n = m->layer[m->n_layers - 1].n_out / T;
    number_at at = number_reader(label->dtype);
    if (!at) return loom_err_set(err, LOOM_ESHAPE, m->where, "label dtype %d is not known", (int)label->dtype);
    for (int64_t e = 0; e < B * T; e++) {
        double x = at(label->data, e);
        if (m->seq_T && x == (double)m->ignore_label) {
            m->labels[e] = -1; /* a masked token */
            continue;
        }
        if (!(x >= 0 && x < (double)n && x == (double)(int64_t)x)) {
            if (!m->seq_T) return bad_label(err, m, e, x, n);
            return loom_err_set(err, LOOM_EDATA, m->where, "label of example %lld in the batch, step %lld, is %.17g, "
                                "not a class in [0, %lld)", (long long)(e / T), (long long)(e % T), x, (long long)n),
                   loom_err_hint(err, "the last layer has %lld units; labels are integers from 0 to %lld, or "
                                 "model.ignore_label (%lld) for a token without a target", (long long)n,
                                 (long long)(n - 1), (long long)m->ignore_label);
        }
        m->labels[e] = (int32_t)x;
    }
    return LOOM_OK;
}

static int bad_target(loom_err *err, const loom_model *m, int64_t b, int64_t j, int64_t n, double v)
{
    char at[48] = "";
    if (n > 1) snprintf(at, sizeof at, " (output %lld)", (long long)j);
    if (m->loss == LOOM_LOSS_BCE && isfinite(v))
        return loom_err_set(err, LOOM_EDATA, m->where,
                            "label of example %lld in the batch%s is %.9g, outside [0, 1] for binary_cross_entropy",
                            (long long)b, at, v),
               loom_err_hint(err, "binary labels are 0 or 1 (or a probability between); for more classes use "
                                  "sparse_softmax_cross_entropy with one output unit per class");
    return loom_err_set(err, LOOM_EDATA, m->where, "label of example %lld in the batch%s is %g, not a finite number",
                        (long long)b, at, v),
           loom_err_hint(err, "filter or fix the records with missing targets");
}

void loom_model_set_sample_weights(loom_model *m, const loom_tensor *w) { m->sw = w; }

/* The sample weights of a batch of B into m->swb. */
static int read_weights(loom_model *m, int64_t B, loom_err *err)
{
    char a[96];
    const loom_tensor *w = m->sw;
    if (w->shape.rank < 1 || w->shape.dim[0] != B || loom_shape_numel(&w->shape) != B)
        return loom_err_set(err, LOOM_ESHAPE, m->where, "sample weights of shape %s for a batch of %lld examples",
                            loom_shape_str(&w->shape, a, sizeof a), (long long)B),
               loom_err_hint(err, "model.sample_weight names a feature with one number per example");
    number_at at = number_reader(w->dtype);
    if (!at) return loom_err_set(err, LOOM_ESHAPE, m->where, "sample weight dtype %d is not a number", (int)w->dtype);
    for (int64_t b = 0; b < B; b++) {
        double x = at(w->data, b);
        if (!(x >= 0) || !isfinite(x))
            return loom_err_set(err, LOOM_EDATA, m->where,
                                "sample weight of example %lld in the batch is %g, not a finite number >= 0",
                                (long long)b, x);
        m->swb[b] = (float)x;
    }
    return LOOM_OK;
}

/* The labels of heads 1.. (loom_model_set_head_labels) into their buffers, checked as head 0's. */
static int read_head_labels(loom_model *m, int64_t B, loom_err *err)
{
    for (int h = 1; h < m->n_heads; h++) {
        struct nn_head_ *hd = &m->head[h];
        const int64_t n = m->layer[hd->layer].n_out;
        const bool sparse = hd->loss == LOOM_LOSS_SPARSE_SOFTMAX_CE;
        const loom_tensor *t = hd->label;
        if (!t)
            return loom_err_set(err, LOOM_ESHAPE, m->where, "head \"%s\" has no labels for this step", hd->name),
                   loom_err_hint(err, "give each head's label feature (model.outputs' label) with the batch");
        if (t->shape.rank < 1 || t->shape.dim[0] != B || loom_shape_numel(&t->shape) != B * (sparse ? 1 : n))
            return loom_err_set(err, LOOM_ESHAPE, m->where, "head \"%s\": its labels hold %lld values for a batch "
                                "of %lld and %lld outputs", hd->name, (long long)loom_shape_numel(&t->shape),
                                (long long)B, (long long)n),
                   loom_err_hint(err, sparse ? "sparse_softmax_cross_entropy takes one class per example"
                                             : "the other losses take one target per output");
        number_at at = number_reader(t->dtype);
        if (!at) return loom_err_set(err, LOOM_ESHAPE, m->where, "head \"%s\": label dtype %d is not known",
                                     hd->name, (int)t->dtype);
        for (int64_t e = 0; e < B * (sparse ? 1 : n); e++) {
            double x = at(t->data, e);
            bool ok = sparse ? x == floor(x) && x >= 0 && x < (double)n
                             : isfinite(x) && (hd->loss != LOOM_LOSS_BCE || (x >= 0 && x <= 1));
            if (!ok)
                return loom_err_set(err, LOOM_EDATA, m->where, "head \"%s\": example %lld's label is %g", hd->name,
                                    (long long)(sparse ? e : e / n), x),
                       loom_err_hint(err, sparse ? "classes run from 0 to the head's outputs - 1"
                                                 : "binary_cross_entropy takes targets in [0, 1]; others finite");
            if (sparse) hd->labels[e] = (int32_t)x;
            else hd->targets[e] = (float)x;
        }
    }
    return LOOM_OK;
}

void loom_model_set_head_labels(loom_model *m, const loom_tensor *const *labels, int n)
{
    for (int h = 1; h < m->n_heads; h++) m->head[h].label = labels && h - 1 < n ? labels[h - 1] : NULL;
}

int loom_model_num_heads(const loom_model *m) { return m->n_heads; }
const char *loom_model_head_name(const loom_model *m, int h) { return m->head[h].name; }
float loom_model_head_weight(const loom_model *m, int h) { return m->head[h].weight; }
loom_loss_kind loom_model_head_loss_kind(const loom_model *m, int h) { return m->head[h].loss; }
int loom_model_head_layer(const loom_model *m, int h) { return m->head[h].layer; }

bool loom_model_head_accuracy(const loom_model *m, int h) { return h > 0 && m->head[h].accuracy; }

double loom_model_head_value(const loom_model *m, int h, int which, const double *acc, int64_t examples)
{
    if (m->n_heads < 2 || !acc || examples <= 0) return NAN;
    return acc[m->hoff + 2 * h + (which ? 1 : 0)] / (double)examples;
}

void loom_model_head_results(const loom_model *m, int h, double *loss_sum, int64_t *correct)
{
    if (loss_sum) *loss_sum = m->hloss[h];
    if (correct) *correct = m->hcorrect[h];
}

int nn_read_label_(loom_model *m, const loom_tensor *label, int64_t B, loom_err *err)
{
    int rc;
    if (m->sw && (rc = read_weights(m, B, err))) return rc;
    if (m->n_heads > 1 && (rc = read_head_labels(m, B, err))) return rc;
    if (m->loss == LOOM_LOSS_SPARSE_SOFTMAX_CE) return nn_read_labels_(m, label, B, err);
    const int64_t n = m->layer[m->n_layers - 1].n_out;
    const int bce = m->loss == LOOM_LOSS_BCE;
    number_at at = number_reader(label->dtype);
    if (!at) return loom_err_set(err, LOOM_ESHAPE, m->where, "label dtype %d is not known", (int)label->dtype);
    for (int64_t e = 0; e < B * n; e++) {
        double x = at(label->data, e);
        if (!isfinite(x) || (bce && !(x >= 0 && x <= 1))) return bad_target(err, m, e / n, e % n, n, x);
        m->targets[e] = (float)x;
    }
    return LOOM_OK;
}

/* The chunks of a batch of B: up to n = min(threads, B) runs of contiguous
 * examples, fixed for a given (B, threads), the sizes differing by at most one.
 * On a BLAS with a row quantum (blas.c: on Haswell/Zen kernels a product's rows
 * get other bits when a call begins mid-tile, so chunks of 64 gave other
 * weights than one of 128), the layers' products over a chunk's rows go
 * through loom_sgemm_rows, which keeps each row in its tile wherever the chunk
 * begins; a model with a layer that does not (recurrent, attention, plugins:
 * !m->chunks_free) has its chunks start at the nearest multiples of the
 * quantum instead (on 2 threads, ResNet-50's batch of 32 split 12 + 20). */
static int split_batch(loom_model *m, int64_t B)
{
    int n = B < m->threads ? (int)B : m->threads, k = 0;
    if (!m->row_q) m->row_q = loom_blas_row_quantum();
    const int64_t q = m->chunks_free ? 1 : m->row_q;
    int64_t e0 = 0;
    for (int t = 0; t < n; t++) {
        int64_t e = B * (t + 1) / n;
        if (t < n - 1) e = (e + q / 2) / q * q;
        if (e > B) e = B;
        if (e <= e0) continue;
        nn_chunk_ *c = &m->chunk[k++];
        c->b0 = e0;
        c->B = e - e0;
        c->bt = B;
        e0 = e;
        c->gbuf[0] = m->gbuf[0] + c->b0 * m->gmax;
        c->gbuf[1] = m->gbuf[1] + c->b0 * m->gmax;
        c->loss = 0;
        c->correct = 0;
        c->tok_loss = 0;
        c->tok_ok = c->tok_n = 0;
    }
    m->n_split = k;
    return k;
}

enum { JOB_TRAIN, JOB_EVAL, JOB_PREDICT };

/* One step's work, shared by its chunks. */
typedef struct step_job {
    loom_model        *m;
    int                kind;      /* JOB_* */
    const float       *x;         /* (B, n_in) */
    const loom_tensor *label;     /* MSE targets (B, n) */
    float              inv_gb;    /* 1 / global batch */
    int64_t            gb;        /* the global batch (train) */
    uint64_t           rng_key;
    float             *out;       /* predict: (B, n) */
    int64_t            B;         /* examples in the batch */
    int                nchunks;   /* chunks of the batch, and parts of the gradient pass */
    int                l0, l1;    /* the layers [l0, l1) of a segment (between batch normalizations) */
    bool               timed;     /* a profiled phase: each chunk clocks its layers into c->pt (run_phase) */
} step_job;

/* With j->timed, a chunk's phase clocks layer i when it is done: the time
 * since the previous clock t, into c->pt[i]; returns the new clock. Reading
 * the clock changes no computation, so a profiled step has the same bits. */
static double clock_layer(nn_chunk_ *c, int i, double t)
{
    double now = loom_now();
    c->pt[i] = now - t;
    return now;
}

/* The three phases of a chunk's step. chunk_step runs them back to back;
 * loom_model_forward / _loss / _backward run one each over all chunks, and
 * since a phase reads only what the previous one left in the chunk's own
 * rows and buffers, the result is the same bit for bit. */
static void chunk_forward(const step_job *j, nn_chunk_ *c)
{
    const loom_model *m = j->m;
    /* the input may be ids (int32, int64) rather than floats: offset in bytes */
    if (j->l0 == 0)
        c->act[0] = (const float *)((const char *)j->x +
                                    c->b0 * m->layer[0].n_in * (int64_t)loom_dtype_size(m->input_dtype));
    if (j->l0 == 0)
        for (int f = 0; f < m->n_inputs; f++)
            c->xin[f] = f ? (const float *)m->xs[f]->data + c->b0 * loom_shape_numel(&m->in_shape[f]) : c->act[0];
    /* a graph's gathered gradients start with the step (the loss phase gives the heads' first) */
    if (j->l0 == 0 && m->graph) memset(c->ginit, 0, (size_t)m->n_layers);
    double t = j->timed ? loom_now() : 0;
    for (int i = j->l0; i < j->l1; i++) {
        if (m->graph) nn_graph_forward_(m, i, c, j->kind == JOB_TRAIN, j->rng_key);
        else nn_layer_forward_(m, i, c, j->kind == JOB_TRAIN, j->rng_key);
        if (j->timed) t = clock_layer(c, i, t);
    }
}

/* The loss of the chunk's outputs and, for a train step, its gradient into gbuf[0]. */
static void chunk_loss(const step_job *j, nn_chunk_ *c)
{
    const loom_model *m = j->m;
    const int64_t n = m->layer[m->n_layers - 1].n_out;
    const float *z = c->act[m->n_layers];
    float *g = j->kind == JOB_TRAIN ? c->gbuf[0] : NULL;
    (void)n;
    const float w0 = m->head[0].weight;
    c->hloss[0] = nn_loss_(m, z, c->b0, c->B, j->inv_gb * w0, g, &c->correct);
    c->hcorrect[0] = c->correct;
    if (!m->seq_T) c->tok_loss = c->hloss[0], c->tok_ok = c->correct, c->tok_n = c->B; /* a token per example */
    c->loss = (double)w0 * c->hloss[0];
    for (int h = 1; h < m->n_heads; h++) {
        const struct nn_head_ *hd = &m->head[h];
        const nn_layer_ *l = &m->layer[hd->layer];
        const int64_t nh = l->n_out;
        float *gh = j->kind == JOB_TRAIN ? l->dgy + c->b0 * nh : NULL;
        c->hloss[h] = nn_head_loss_(hd->loss, c->yo[hd->layer], hd->labels + c->b0, hd->targets + c->b0 * nh, c->B,
                                    nh, j->inv_gb * hd->weight, gh, &c->hcorrect[h]);
        if (gh) c->ginit[hd->layer] = 1;
        c->loss += (double)hd->weight * c->hloss[h];
    }
}

/* The index of layer i's first parameter tensor (its kernel), or -1. */
static int first_tensor(const loom_model *m, const nn_layer_ *l)
{
    for (int t = 0; t < m->n_ptensors && l->kernel_off >= 0; t++)
        if (m->pinfo[t].offset == l->kernel_off) return t;
    return -1;
}

/* Part `part` of `parts` of layer i's whole-batch parameter gradients (dense,
 * conv2d, layer_normalization; an embedding's sparse rows in part 0; batch
 * normalization's come from nn_bn_backward_). */
static bool has_grad_pass(const nn_layer_ *l) { return l->kernel_off >= 0 && !nn_whole_batch_layer_(l); }

static void layer_param_grads(const step_job *j, int i, int part, int parts)
{
    loom_model *m = j->m;
    const nn_layer_ *l = &m->layer[i];
    if (!has_grad_pass(l)) return;
    if (l->spec.kind == LOOM_LAYER_EMBEDDING) {
        if (part == 0) nn_embedding_param_grads_(m, i, m->chunk[0].act[0], j->B);
        return;
    }
    if (l->spec.kind == LOOM_LAYER_PLUGIN) {
        if (part == 0) nn_plugin_param_grads_(m, i, m->chunk[0].act[i], j->B);
        return;
    }
    /* chunk 0 starts at example 0: its input pointer is the whole batch's */
    if (nn_is_attn_kind_(l->spec.kind)) nn_attn_param_grads_(m, i, m->chunk[0].act[i], j->B, part, parts);
    else if (nn_runs_more_(l)) nn_more_param_grads_(m, i, m->chunk[0].act[i], j->B, part, parts);
    else if (l->spec.kind == LOOM_LAYER_DENSE) nn_dense_param_grads_(m, i, m->chunk[0].act[i], j->B, part, parts);
    else if (l->spec.kind == LOOM_LAYER_LAYER_NORM) nn_ln_param_grads_(m, i, j->B, part, parts);
    else if (nn_is_rnn_kind_(l->spec.kind)) nn_rnn_param_grads_(m, i, m->chunk[0].act[i], j->B, part, parts);
    else nn_conv_param_grads_(m, i, m->chunk[0].act[i], j->B, part, parts, m->chunk[part].col);
}

/* Whether a gradient hook can be told layer by layer: not with batch
 * normalization (its gradients come from a whole-batch pass between
 * segments), an embedding (its rows are gathered over the whole batch, and
 * its dense region is cleared and rewritten then) or model.l2 (its penalty
 * is added to the kernels' gradients after every layer's). Those models
 * compute their gradients as without a hook and tell it once (t = 0): the
 * same bits, no overlap. */
static bool hook_per_layer(const loom_model *m)
{
    if (m->n_bn || m->l2 > 0 || m->graph) return false;
    for (int i = 0; i < m->n_layers; i++)
        if (m->layer[i].spec.kind == LOOM_LAYER_EMBEDDING || m->layer[i].spec.kind == LOOM_LAYER_PLUGIN) return false;
    return true;
}

/* The optimizer inside the step (m->upd): parameters [lo, hi) updated on
 * the calling thread, with the step's gradients there. */
static void update_range(const loom_model *m, int64_t lo, int64_t hi)
{
    if (hi > lo) loom_optimizer_apply_range(m->upd, NULL, m->params, m->grads, m->upd_step, lo, hi);
}

/* Layer l's parameters, kernel then bias: [*lo, *hi) of the flat buffer. */
static void layer_params(const loom_model *m, const nn_layer_ *l, int64_t *lo, int64_t *hi)
{
    *lo = *hi = l->kernel_off;
    for (int t = 0; t < m->n_ptensors; t++) {
        const loom_param_info *p = &m->pinfo[t];
        if (p->offset != l->kernel_off && p->offset != l->bias_off && p->offset != l->pw_off) continue;
        int64_t end = p->offset + loom_shape_numel(&p->shape);
        if (end > *hi) *hi = end;
    }
}

/* Whether each part of `parts` of layer l's gradient pass updates what it
 * wrote itself: a dense or conv2d layer's kernel rows (of n_in, or of
 * kh*kw*cin) and bias columns, the ranges nn_dense_param_grads_ and
 * nn_conv_param_grads_ write, or the whole layer when one part writes it. */
static bool updates_in_part(const nn_layer_ *l, int parts)
{
    return l->spec.kind == LOOM_LAYER_DENSE || (l->spec.kind == LOOM_LAYER_CONV2D && !l->direct) || parts == 1;
}

static void update_part(const loom_model *m, const nn_layer_ *l, int part, int parts)
{
    if (parts == 1) {
        int64_t lo, hi;
        layer_params(m, l, &lo, &hi);
        update_range(m, lo, hi);
        return;
    }
    /* a dense layer's kernel is (n_in / steps, n_out / steps): its rows are one step's inputs */
    const bool dense = l->spec.kind == LOOM_LAYER_DENSE;
    const int64_t K = dense ? l->n_in / l->steps : (int64_t)l->kh * l->kw * l->cin;
    const int64_t out = dense ? l->n_out / l->steps : l->cout;
    if (!dense && nn_convw_kgrad_ok_(l)) { /* conv_winograd.c's parts: input channels [c0, c1) of each tap */
        const int64_t c0 = nn_convw_grad_ci_(l, part, parts), c1 = nn_convw_grad_ci_(l, part + 1, parts);
        for (int64_t tap = 0; tap < (int64_t)l->kh * l->kw; tap++)
            update_range(m, l->kernel_off + (tap * l->cin + c0) * out, l->kernel_off + (tap * l->cin + c1) * out);
    } else
        update_range(m, l->kernel_off + nn_grad_row_(m, l, K, part, parts) * out,
                     l->kernel_off + nn_grad_row_(m, l, K, part + 1, parts) * out);
    if (l->bias_off >= 0) update_range(m, l->bias_off + out * part / parts, l->bias_off + out * (part + 1) / parts);
}

/* After a gradient pass of `parts` parts: the in-step update of the layers
 * whose parts did not update what they wrote (layer normalization split in
 * parts), over the pool. prof: a profile's upd. */
static void update_rest(loom_model *m, int parts, double *prof)
{
    for (int i = 0; i < m->n_layers; i++) {
        const nn_layer_ *l = &m->layer[i];
        if (!has_grad_pass(l) || updates_in_part(l, parts)) continue;
        int64_t lo, hi;
        double t0 = prof ? loom_now() : 0;
        layer_params(m, l, &lo, &hi);
        loom_optimizer_apply_range(m->upd, m->pool, m->params, m->grads, m->upd_step, lo, hi);
        if (prof) prof[i] += loom_now() - t0;
    }
}

/* Layer i's backward on chunk c: the gradient rows in c->g, the other
 * buffer c->other (swapped when the layer writes there); sets c->bw_done
 * when no earlier layer needs anything. with_hook: then the layer's
 * parameter gradients, its in-step update (m->upd) and the hook (see
 * chunk_backward_). */
static void chunk_backward_layer(const step_job *j, nn_chunk_ *c, int i, bool with_hook)
{
    const loom_model *m = j->m;
    const nn_layer_ *l = &m->layer[i];
    float *r = NULL;
    if (l->needs_dx || l->kernel_off >= 0) r = nn_layer_backward_(m, i, c, c->g, c->other);
    if (with_hook && l->kernel_off >= 0) {
        layer_param_grads(j, i, 0, 1);
        if (m->upd && has_grad_pass(l)) update_part(m, l, 0, 1);
        if (m->grad_hook) m->grad_hook(m->grad_hook_arg, first_tensor(m, l));
    }
    if (!r) {
        c->bw_done = 1;
    } else if (r == c->other) { /* (c->g may be a conv's dz rows, not a gradient buffer: bn_dx_dz) */
        c->other = r == c->gbuf[0] ? c->gbuf[1] : c->gbuf[0];
        c->g = r;
    }
}

/* The backward of layers [l0, l1), from the top; the gradient buffers carry
 * over between segments in c->g and c->other (set by the top segment).
 * with_hook: one chunk (the whole batch), one segment, and a per-layer
 * gradient hook: each layer's parameter gradients right after its backward,
 * then the hook. */
static void chunk_backward_(const step_job *j, nn_chunk_ *c, bool with_hook)
{
    const loom_model *m = j->m;
    if (j->l1 == m->n_layers) {
        c->g = c->gbuf[0], c->other = c->gbuf[1];
        c->bw_done = 0;
    }
    /* a non-finite loss fails the step (the caller checks the sum), so its gradient is never used */
    if (!isfinite(c->loss)) return;
    double t = j->timed ? loom_now() : 0;
    for (int i = j->l1 - 1; i >= j->l0 && !c->bw_done; i--) {
        if (m->graph) nn_graph_backward_(m, i, c);
        else chunk_backward_layer(j, c, i, with_hook);
        if (j->timed) t = clock_layer(c, i, t);
    }
}

static void chunk_backward(const step_job *j, nn_chunk_ *c) { chunk_backward_(j, c, false); }

static void part_forward_(void *arg, int t) { step_job *j = arg; chunk_forward(j, &j->m->chunk[t]); }
static void part_backward_(void *arg, int t) { step_job *j = arg; chunk_backward(j, &j->m->chunk[t]); }

/* Runs fn over j's chunks. acc: a profile's phase (NULL: none); the chunks
 * clock the layers they run (j->timed) and acc gets each layer's mean over
 * the chunks. */
static void run_phase(loom_model *m, step_job *j, loom_pool_fn fn, double *acc)
{
    if (!acc) {
        loom_pool_run(m->pool, j->nchunks, fn, j);
        return;
    }
    for (int t = 0; t < j->nchunks; t++) {
        memset(m->chunk[t].pt, 0, sizeof m->chunk[t].pt);
        memset(m->chunk[t].pu, 0, sizeof m->chunk[t].pu);
    }
    j->timed = true;
    loom_pool_run(m->pool, j->nchunks, fn, j);
    j->timed = false;
    double most = 0, all = 0; /* the chunks' clocked work: the slowest, and the sum */
    for (int t = 0; t < j->nchunks; t++) {
        double w = 0;
        for (int i = 0; i < m->n_layers; i++) w += m->chunk[t].pt[i] + (m->upd ? m->chunk[t].pu[i] : 0);
        most = w > most ? w : most, all += w;
    }
    if (m->prof) m->prof->imbalance[acc == m->prof->fwd ? 0 : 1] += most - all / j->nchunks;
    for (int i = 0; i < m->n_layers; i++) {
        double s = 0, u = 0;
        for (int t = 0; t < j->nchunks; t++) s += m->chunk[t].pt[i], u += m->chunk[t].pu[i];
        acc[i] += s / j->nchunks;
        if (m->prof && m->upd) m->prof->upd[i] += u / j->nchunks; /* the gradient pass's in-step update */
    }
}

/* The forward of every segment (whole-model job j, its chunks split): the
 * chunks run the layers between batch normalizations, which run once over
 * the whole batch. acc: a profile's forward (NULL: none); a batch
 * normalization is clocked whole, on this thread. */
static void forward_all(loom_model *m, step_job *j, double *acc)
{
    int l0 = 0;
    /* the input may be ids (int32, int64) rather than floats: offset in bytes */
    for (int t = 0; t < j->nchunks; t++) {
        nn_chunk_ *c = &m->chunk[t];
        c->xin[0] = c->act[0] = (const float *)((const char *)j->x + c->b0 * loom_shape_numel(&m->input) *
                                                                         (int64_t)loom_dtype_size(m->input_dtype));
        for (int f = 1; f < m->n_inputs; f++)
            c->xin[f] = (const float *)m->xs[f]->data + c->b0 * loom_shape_numel(&m->in_shape[f]);
    }
    for (int i = 0; i <= m->n_layers; i++) {
        if (i < m->n_layers && !nn_whole_batch_layer_(&m->layer[i])) continue;
        j->l0 = l0, j->l1 = i;
        if (i > l0) run_phase(m, j, part_forward_, acc);
        if (i < m->n_layers) {
            double t0 = acc ? loom_now() : 0;
            if (m->graph) nn_graph_bn_in_(m, i, j->nchunks);
            if (m->layer[i].spec.kind == LOOM_LAYER_PLUGIN)
                nn_plugin_forward_whole_(m, i, j->B, j->kind == JOB_TRAIN, j->rng_key);
            else nn_bn_forward_(m, i, m->chunk[0].act[i], j->B, j->kind == JOB_TRAIN);
            if (acc) acc[i] += loom_now() - t0;
            for (int t = 0; t < j->nchunks; t++) m->chunk[t].act[i + 1] = m->layer[i].y + m->chunk[t].b0 * m->layer[i].n_out;
            if (m->graph) nn_graph_bn_out_(m, i, j->nchunks);
        }
        l0 = i + 1;
    }
    j->l0 = 0, j->l1 = m->n_layers;
}

/* Part t of the parameter gradients of the early layers (buffer_plan.c) of segment [j->l0, j->l1), as
 * grad_part takes them (the same bits), right after the segment's backward: their dz rows are dead then. */
static void early_part(void *arg, int t)
{
    const step_job *j = arg;
    const loom_model *m = j->m;
    double t0 = j->timed ? loom_now() : 0;
    for (int i = j->l0; i < j->l1; i++) {
        if (!m->layer[i].early) continue;
        layer_param_grads(j, i, t, j->nchunks);
        if (j->timed) t0 = clock_layer(&m->chunk[t], i, t0);
    }
}

/* After segment [j->l0, j->l1)'s backward: its early layers' parameter gradients (not when a chunk's loss is
 * not finite: the step fails, its gradients unused). pacc: a profile's gradient pass (NULL: none). */
static void early_grads(loom_model *m, step_job *j, double *pacc)
{
    bool any = false;
    for (int i = j->l0; i < j->l1 && !any; i++) any = m->layer[i].early;
    for (int t = 0; t < j->nchunks && any; t++) any = isfinite(m->chunk[t].loss);
    if (any) run_phase(m, j, early_part, pacc);
}

/* The backward of every segment, from the top (as forward_all); pacc: a profile's gradient pass. */
static void backward_all(loom_model *m, step_job *j, double *acc, double *pacc)
{
    int l1 = m->n_layers;
    for (int i = m->n_layers - 1; i >= -1; i--) {
        if (i >= 0 && !nn_whole_batch_layer_(&m->layer[i])) continue;
        j->l0 = i + 1, j->l1 = l1;
        if (l1 > i + 1 || l1 == m->n_layers) run_phase(m, j, part_backward_, acc);
        early_grads(m, j, pacc);
        if (i >= 0) {
            int done = 1;
            for (int t = 0; t < j->nchunks; t++) done &= m->chunk[t].bw_done || !isfinite(m->chunk[t].loss);
            if (m->graph) { /* bw_done does not end a graph's backward: the layer's own need */
                bool any = false;
                for (int t = 0; t < j->nchunks; t++) any |= isfinite(m->chunk[t].loss);
                done = !m->layer[i].need_out || !any;
            }
            double t0 = acc ? loom_now() : 0;
            if (!done && m->graph) nn_graph_bn_grad_in_(m, i, j->nchunks);
            if (!done && m->layer[i].spec.kind == LOOM_LAYER_PLUGIN)
                nn_plugin_backward_whole_(m, i, m->chunk, j->nchunks, j->B);
            else if (!done) nn_bn_backward_(m, i, m->chunk, j->nchunks, j->B);
            if (!done && m->graph) nn_graph_bn_grad_out_(m, i, j->nchunks);
            else if (!done && m->layer[i].bn_dx_dz && m->layer[i].needs_dx) /* its input gradient: the conv's dz */
                for (int t = 0; t < j->nchunks; t++)
                    m->chunk[t].g = m->layer[i - 1].dz + m->chunk[t].b0 * m->layer[i].n_out;
            if (acc) acc[i] += loom_now() - t0;
        }
        l1 = i;
    }
    j->l0 = 0, j->l1 = m->n_layers;
}

/* Chunk c's output rows of a predict job, from its last layer's logits:
 * probabilities under softmax (binary) cross-entropy, else the values. */
/* z (rows, n) as the head's loss reads it into out (row stride ld): softmax or sigmoid probabilities, else values. */
static void head_rows(loom_loss_kind loss, const float *z, int64_t rows, int64_t n, float *out, int64_t ld)
{
    for (int64_t b = 0; b < rows; b++) {
        const float *zr = z + b * n;
        float *o = out + b * ld;
        if (loss == LOOM_LOSS_SPARSE_SOFTMAX_CE) nn_softmax_rows_(zr, o, 1, n);
        else if (loss == LOOM_LOSS_BCE)
            for (int64_t e = 0; e < n; e++) o[e] = 1.f / (1.f + expf(-zr[e]));
        else memcpy(o, zr, (size_t)n * sizeof *o);
    }
}

int64_t loom_model_head_outputs(const loom_model *m, int h) { return m->layer[m->head[h].layer].n_out; }

int64_t loom_model_predict_width(const loom_model *m)
{
    int64_t w = 0;
    for (int h = 0; h < m->n_heads; h++) w += m->layer[m->head[h].layer].n_out;
    return w;
}

static void predict_rows(step_job *j, nn_chunk_ *c)
{
    const loom_model *m = j->m;
    const int64_t n = m->layer[m->n_layers - 1].n_out;
    const float *z = c->act[m->n_layers];
    if (m->n_heads > 1) { /* each example's row: head 0's outputs, then each other head's */
        const int64_t W = loom_model_predict_width(m);
        for (int h = 0, off = 0; h < m->n_heads; h++) {
            const nn_layer_ *l = &m->layer[m->head[h].layer];
            head_rows(m->head[h].loss, h ? c->yo[m->head[h].layer] : z, c->B, l->n_out, j->out + c->b0 * W + off, W);
            off += (int)l->n_out;
        }
        return;
    }
    float *out = j->out + c->b0 * n;
    if (m->loss == LOOM_LOSS_SPARSE_SOFTMAX_CE && m->seq_T) /* per token: a softmax per time step */
        nn_softmax_rows_(z, out, c->B * m->seq_T, n / m->seq_T);
    else if (m->loss == LOOM_LOSS_SPARSE_SOFTMAX_CE) nn_softmax_rows_(z, out, c->B, n);
    else if (m->loss == LOOM_LOSS_BCE)
        for (int64_t e = 0; e < c->B * n; e++) out[e] = 1.f / (1.f + expf(-z[e]));
    else memcpy(out, z, (size_t)(c->B * n) * sizeof *out);
}

static void chunk_step(void *arg, int t)
{
    step_job *j = arg;
    j->l0 = 0, j->l1 = j->m->n_layers;
    loom_model *m = j->m;
    nn_chunk_ *c = &m->chunk[t];
    chunk_forward(j, c);
    if (j->kind == JOB_PREDICT) {
        predict_rows(j, c);
        return;
    }
    chunk_loss(j, c);
    if (j->kind == JOB_TRAIN) chunk_backward_(j, c, j->nchunks == 1 && ((m->grad_hook && hook_per_layer(m)) || m->upd));
}

static void part_loss(void *arg, int t) { step_job *j = arg; chunk_loss(j, &j->m->chunk[t]); }
/* a predict job's output rows (after forward_all) */
static void part_predict(void *arg, int t)
{
    step_job *j = arg;
    predict_rows(j, &j->m->chunk[t]);
}

/* Part t of the gradients that wait for all chunks: dense and conv layers'
 * kernel rows and bias columns, each over the whole batch, so no gradient
 * element is a sum split at chunk boundaries: the same bits for any number
 * of threads. Timed, only the layers with such a pass are clocked (the
 * others' few instructions go to the next one's). */
static void grad_part(void *arg, int t)
{
    const step_job *j = arg;
    const loom_model *m = j->m;
    double t0 = j->timed ? loom_now() : 0;
    for (int i = 0; i < m->n_layers; i++) {
        const nn_layer_ *l = &m->layer[i];
        if (l->early) continue; /* taken in backward_all */
        layer_param_grads(j, i, t, j->nchunks);
        if (j->timed && has_grad_pass(l)) t0 = clock_layer(&m->chunk[t], i, t0);
        if (m->upd && has_grad_pass(l) && updates_in_part(l, j->nchunks)) { /* what this part wrote, still in cache */
            update_part(m, l, t, j->nchunks);
            if (j->timed) {
                double now = loom_now();
                m->chunk[t].pu[i] = now - t0;
                t0 = now;
            }
        }
    }
}

/* With a per-layer gradient hook and several chunks: the whole-batch
 * gradient pass of one layer (job->layer), split among the threads as
 * grad_part splits it. */
typedef struct layer_job {
    const step_job *j;
    int             layer;
} layer_job;

static void grad_part_layer(void *arg, int t)
{
    const layer_job *lj = arg;
    layer_param_grads(lj->j, lj->layer, t, lj->j->nchunks);
}

/* model.l2 for a batch of B of a global batch gb: returns l2 * sum(kernel^2) * B
 * (the penalty's share of the batch's loss sum, so the mean loss carries it
 * once) and, when grads is set, adds its gradient 2 l2 w * B / gb there (the
 * replicas' shares add up to one penalty). */
static double l2_penalty(const loom_model *m, int64_t B, int64_t gb, float *grads)
{
    if (m->l2 <= 0) return 0;
    double ss = 0;
    const float k = 2.f * m->l2 * (float)B / (float)gb;
    for (int i = 0; i < m->n_layers; i++) {
        const nn_layer_ *l = &m->layer[i];
        if (!nn_kernel_kind_(l->spec.kind)) continue; /* kernels only (a separable's two) */
        for (int t = 0; t < m->n_ptensors; t++) {
            int64_t off = m->pinfo[t].offset;
            if (off != l->kernel_off && off != l->pw_off) continue;
            int64_t n = loom_shape_numel(&m->pinfo[t].shape);
            const float *w = m->params + off;
            for (int64_t e = 0; e < n; e++) {
                ss += (double)w[e] * w[e];
                if (grads) grads[off + e] += k * w[e];
            }
        }
    }
    return (double)m->l2 * ss * (double)B;
}

/* Each head's loss and correct count of the step: its chunks' in chunk order. */
static void sum_heads(loom_model *m, int nchunks)
{
    for (int h = 0; h < m->n_heads; h++) {
        m->hloss[h] = 0;
        m->hcorrect[h] = 0;
        for (int t = 0; t < nchunks; t++) {
            m->hloss[h] += m->chunk[t].hloss[h];
            m->hcorrect[h] += m->chunk[t].hcorrect[h];
        }
        if (m->n_heads > 1) {
            m->mstate[m->hoff + 2 * h] += m->hloss[h];
            m->mstate[m->hoff + 2 * h + 1] += (double)m->hcorrect[h];
        }
    }
}

/* Runs job over the batch's chunks, one per thread, and sums their results
 * in chunk order; a train step then finishes the gradients (grad_part). */
static void run_chunks(loom_model *m, step_job *j, int64_t B, double *loss, int64_t *correct)
{
    j->m = m;
    j->B = B;
    j->nchunks = split_batch(m, B);
    m->part_done = 0; /* the chunks' buffers no longer hold a step in parts */
    if (!m->n_bn) {
        loom_pool_run(m->pool, j->nchunks, chunk_step, j);
    } else { /* batch normalization needs the whole batch between segments */
        int kind = j->kind;
        forward_all(m, j, NULL);
        if (kind == JOB_PREDICT) {
            loom_pool_run(m->pool, j->nchunks, part_predict, j);
            return;
        }
        loom_pool_run(m->pool, j->nchunks, part_loss, j);
        if (kind == JOB_TRAIN) backward_all(m, j, NULL, NULL);
    }
    double l = 0;
    int64_t ok = 0;
    for (int t = 0; t < j->nchunks; t++) {
        l += m->chunk[t].loss;
        ok += m->chunk[t].correct;
    }
    if (j->kind != JOB_PREDICT) sum_heads(m, j->nchunks);
    if (loss) *loss = l;
    if (correct) *correct = ok;
    if (j->kind != JOB_PREDICT) nn_metrics_update_(m, m->chunk[0].act[m->n_layers], B);
    if (j->kind == JOB_TRAIN && isfinite(l)) {
        bool per_layer = m->grad_hook && hook_per_layer(m);
        if (m->upd) { /* one chunk: chunk_backward_ did it all */
            if (j->nchunks > 1) {
                loom_pool_run(m->pool, j->nchunks, grad_part, j);
                update_rest(m, j->nchunks, NULL);
            }
        } else if (!per_layer) {
            loom_pool_run(m->pool, j->nchunks, grad_part, j);
        } else if (j->nchunks > 1) { /* last layer first, the hook after each (one chunk: chunk_backward_ did) */
            for (int i = m->n_layers - 1; i >= 0; i--) {
                if (m->layer[i].kernel_off < 0) continue;
                layer_job lj = {j, i};
                loom_pool_run(m->pool, j->nchunks, grad_part_layer, &lj);
                m->grad_hook(m->grad_hook_arg, first_tensor(m, &m->layer[i]));
            }
        }
    }
    if (j->kind != JOB_PREDICT && loss && isfinite(l)) /* Keras reports the loss with its regularisation */
        *loss += l2_penalty(m, B, j->gb > 0 ? j->gb : B, j->kind == JOB_TRAIN ? m->grads : NULL);
    /* every gradient is final (layers without parameters below, the l2 penalty added) */
    if (j->kind == JOB_TRAIN && isfinite(l) && m->grad_hook) m->grad_hook(m->grad_hook_arg, 0);
}

void loom_model_set_prof(loom_model *m, loom_model_prof *p) { m->prof = p; }
int loom_model_num_layers(const loom_model *m) { return m->n_layers; }

const loom_layer_spec *loom_model_layer_spec(const loom_model *m, int i, int *src, int *n_src)
{
    const nn_layer_ *l = &m->layer[i];
    for (int k = 0; k < l->n_src; k++) src[k] = l->src[k];
    *n_src = l->n_src;
    return &l->spec;
}

void loom_model_set_grad_hook(loom_model *m, loom_grad_ready_fn fn, void *arg)
{
    m->grad_hook = fn;
    m->grad_hook_arg = arg;
}

static int train_step(loom_model *m, const loom_tensor *x, const loom_tensor *label, int64_t global_batch,
                          uint64_t rng_key, double *loss_sum, int64_t *correct, loom_err *err)
{
    int64_t B;
    int rc;
    if ((rc = nn_check_batch_(m, x, label, &B, err)) || (rc = nn_model_ready_(m, err))) return rc;
    if ((rc = nn_read_label_(m, label, B, err))) return rc;
    if (global_batch < 1) global_batch = B;
    step_job j = {.kind = JOB_TRAIN, .x = x->data, .label = label, .inv_gb = (float)(1.0 / (double)global_batch),
                  .gb = global_batch, .rng_key = rng_key};
    double loss;
    run_chunks(m, &j, B, &loss, correct);
    if (loss_sum) *loss_sum = loss;
    return isfinite(loss) ? LOOM_OK : nn_loss_error_(m, loss, B, err);
}

int loom_model_train_step(loom_model *m, const loom_tensor *x, const loom_tensor *label, int64_t global_batch,
                          uint64_t rng_key, double *loss_sum, int64_t *correct, loom_err *err)
{
    m->sync_k = 0, m->sync_rc = 0;
    int rc = train_step(m, x, label, global_batch, rng_key, loss_sum, correct, err);
    int src = nn_bn_sync_rest_(m, false, rc ? NULL : err); /* the calls a failed step did not make */
    if (__atomic_load_n(&m->plugin_rc, __ATOMIC_ACQUIRE)) return nn_plugin_error_(m, err); /* the cause of the rest */
    return rc ? rc : src;
}

/* Per layer needs no other gradient than the layer's own (hook_per_layer:
 * no batch normalization, model.l2 or embedding), no hook (a replica among
 * several reduces first), an update of a range that reads only the range. */
bool loom_model_can_update_in_step(const loom_model *m, const loom_optimizer *o)
{
    return o && hook_per_layer(m) && !m->grad_hook && !m->bn_sync && nn_optimizer_ranged_(o);
}

bool loom_model_profiled(const loom_model *m) { return m->prof != NULL; }

int loom_model_train_step_update(loom_model *m, const loom_tensor *x, const loom_tensor *label, int64_t global_batch,
                                 uint64_t rng_key, loom_optimizer *o, int64_t step, double *loss_sum,
                                 int64_t *correct, bool *applied, loom_err *err)
{
    bool in_step = loom_model_can_update_in_step(m, o);
    m->upd = in_step ? o : NULL;
    m->upd_step = step;
    int rc = loom_model_train_step(m, x, label, global_batch, rng_key, loss_sum, correct, err);
    m->upd = NULL;
    *applied = in_step && rc == LOOM_OK; /* a failed step (a bad batch, a non-finite loss) updated nothing */
    return rc;
}

void loom_model_set_bn_sync(loom_model *m, loom_bn_sync_fn fn, void *arg)
{
    m->bn_sync = m->n_sync_bn ? fn : NULL;
    m->bn_sync_arg = arg;
    m->sync_k = 0, m->sync_rc = 0;
}

int loom_model_num_sync_bn(const loom_model *m) { return m->n_sync_bn; }

int loom_model_bn_sync_idle(loom_model *m, int pass, loom_err *err)
{
    if (pass != LOOM_BN_SYNC_BACKWARD) m->sync_k = 0, m->sync_rc = 0; /* the backward's follow the forward's */
    return nn_bn_sync_rest_(m, pass == LOOM_BN_SYNC_FORWARD, err);
}

/* ---- a train step in parts ------------------------------------------------ */

int loom_model_forward(loom_model *m, const loom_tensor *x, uint64_t rng_key, loom_err *err)
{
    int64_t B;
    int rc;
    m->part_done = 0;
    m->sync_k = 0, m->sync_rc = 0;
    if ((rc = nn_check_batch_(m, x, NULL, &B, err)) || (rc = nn_model_ready_(m, err))) {
        nn_bn_sync_rest_(m, true, NULL);
        return rc;
    }
    step_job j = {.m = m, .kind = JOB_TRAIN, .x = x->data, .rng_key = rng_key, .B = B};
    j.nchunks = split_batch(m, B);
    for (int t = 0; t < j.nchunks; t++) m->chunk[t].loss = 0;
    forward_all(m, &j, m->prof ? m->prof->fwd : NULL);
    if ((rc = nn_bn_sync_rest_(m, true, err))) return nn_plugin_error_(m, NULL), rc;
    if ((rc = nn_plugin_error_(m, err))) return rc;
    m->part_B = B;
    m->part_chunks = j.nchunks;
    m->part_done = 1;
    return LOOM_OK;
}

int loom_model_loss(loom_model *m, const loom_tensor *label, int64_t global_batch, double *loss_sum, int64_t *correct,
                    loom_err *err)
{
    if (m->part_done < 1)
        return loom_err_set(err, LOOM_EUSAGE, m->where, "the loss needs a forward pass on the batch first");
    int64_t B = m->part_B;
    int rc;
    if ((rc = nn_check_label_(m, label, B, err))) return rc;
    if ((rc = nn_read_label_(m, label, B, err))) return rc;
    if (global_batch < 1) global_batch = B;
    step_job j = {.m = m, .kind = JOB_TRAIN, .label = label, .inv_gb = (float)(1.0 / (double)global_batch), .B = B};
    j.nchunks = m->part_chunks; /* the forward's chunks: min(B, threads) would take in a stale one (row quantum) */
    loom_pool_run(m->pool, j.nchunks, part_loss, &j);
    double l = 0;
    int64_t ok = 0;
    for (int t = 0; t < j.nchunks; t++) {
        l += m->chunk[t].loss;
        ok += m->chunk[t].correct;
    }
    sum_heads(m, j.nchunks);
    if (loss_sum) *loss_sum = l;
    if (isfinite(l)) l += l2_penalty(m, B, global_batch, NULL);
    m->part_gb = global_batch;
    if (correct) *correct = ok;
    nn_metrics_update_(m, m->chunk[0].act[m->n_layers], B);
    if (!isfinite(l))
        return loom_err_set(err, LOOM_ENUMERIC, m->where, "the loss is %g on a batch of %lld examples", l, (long long)B);
    m->part_done = 2;
    return LOOM_OK;
}

int loom_model_backward(loom_model *m, loom_err *err)
{
    if (m->part_done < 2) {
        nn_bn_sync_rest_(m, false, NULL); /* the synchronised layers' calls all the same */
        return loom_err_set(err, LOOM_EUSAGE, m->where, "backward needs the loss of a forward pass first");
    }
    step_job j = {.m = m, .kind = JOB_TRAIN, .B = m->part_B};
    j.nchunks = m->part_chunks;
    backward_all(m, &j, m->prof ? m->prof->bwd : NULL, m->prof ? m->prof->pgrad : NULL);
    run_phase(m, &j, grad_part, m->prof ? m->prof->pgrad : NULL);
    if (m->upd) update_rest(m, j.nchunks, m->prof ? m->prof->upd : NULL);
    l2_penalty(m, j.B, m->part_gb, m->grads);
    m->part_done = 0;
    int src = nn_bn_sync_rest_(m, false, err);
    int prc = nn_plugin_error_(m, src ? NULL : err);
    return src ? src : prc;
}

int loom_model_backward_update(loom_model *m, loom_optimizer *o, int64_t step, bool *applied, loom_err *err)
{
    bool in_step = m->part_done >= 2 && loom_model_can_update_in_step(m, o);
    m->upd = in_step ? o : NULL;
    m->upd_step = step;
    int rc = loom_model_backward(m, err);
    m->upd = NULL;
    *applied = in_step && rc == LOOM_OK;
    return rc;
}

int loom_model_evaluate(loom_model *m, const loom_tensor *x, const loom_tensor *label, double *loss_sum,
                        int64_t *correct, loom_err *err)
{
    int64_t B;
    int rc;
    if ((rc = nn_check_batch_(m, x, label, &B, err)) || (rc = nn_model_ready_(m, err))) return rc;
    if ((rc = nn_read_label_(m, label, B, err))) return rc;
    step_job j = {.kind = JOB_EVAL, .x = x->data, .label = label, .inv_gb = 1.f};
    run_chunks(m, &j, B, loss_sum, correct);
    return nn_plugin_error_(m, err);
}

int loom_model_predict(loom_model *m, const loom_tensor *x, float *out, loom_err *err)
{
    int64_t B;
    int rc;
    if ((rc = nn_check_batch_(m, x, NULL, &B, err)) || (rc = nn_model_ready_(m, err))) return rc;
    step_job j = {.kind = JOB_PREDICT, .x = x->data, .out = out};
    run_chunks(m, &j, B, NULL, NULL);
    return nn_plugin_error_(m, err);
}

/* ---- sparse gradients ------------------------------------------------------ */

int loom_model_num_sparse(const loom_model *m)
{
    int n = 0;
    for (int i = 0; i < m->n_layers; i++) n += m->layer[i].spec.kind == LOOM_LAYER_EMBEDDING;
    return n;
}

void loom_model_sparse_grad(const loom_model *m, int i, loom_sparse_grad *out)
{
    memset(out, 0, sizeof *out);
    out->param = -1;
    for (int li = 0; li < m->n_layers; li++) {
        const nn_layer_ *l = &m->layer[li];
        if (l->spec.kind != LOOM_LAYER_EMBEDDING || i-- > 0) continue;
        for (int p = 0; p < m->n_ptensors; p++)
            if (m->pinfo[p].offset == l->kernel_off) out->param = p;
        *out = (loom_sparse_grad){.param = out->param, .offset = l->kernel_off, .rows = l->rows, .dim = l->dim,
                                  .n = l->sp_n, .ids = l->sp_ids, .values = l->sp_val};
        return;
    }
    LOOM_ASSERT(!"loom_model_sparse_grad: no such table");
}

void loom_model_set_sparse_owner(loom_model *m, int on) { m->sparse_owner = on != 0; }

/* ---- describing layers for a profile ---------------------------------------- */

const char *loom_model_layer_describe(const loom_model *m, int i, char *buf, size_t n)
{
    const nn_layer_ *l = &m->layer[i];
    const char *kind = nn_layer_kind_name_(l->spec.kind), *act = l->act ? nn_activation_name_(l->act) : "";
    switch (l->spec.kind) {
    case LOOM_LAYER_DENSE:
        snprintf(buf, n, "%s %s %lld->%lld%s%s", l->spec.name, kind, (long long)l->n_in, (long long)l->n_out,
                 *act ? " " : "", act);
        break;
    case LOOM_LAYER_CONV2D:
        snprintf(buf, n, "%s %s %dx%d %d->%d%s%s", l->spec.name, kind, l->kh, l->kw, l->cin, l->cout, *act ? " " : "",
                 act);
        break;
    case LOOM_LAYER_MAX_POOL2D:
        snprintf(buf, n, "%s %s %dx%d", l->spec.name, kind, l->kh, l->kw);
        break;
    default:
        snprintf(buf, n, "%s %s%s%s", l->spec.name, kind, *act ? " " : "", act);
        break;
    }
    return buf;
}

int loom_model_layer_gemm(const loom_model *m, int i, int64_t B, int which, loom_gemm_shape *out)
{
    const nn_layer_ *l = &m->layer[i];
    int64_t rows, in, outn; /* the product's batch rows, its inner and outer widths */
    if (l->spec.kind == LOOM_LAYER_DENSE) {
        rows = B * l->steps, in = l->n_in / l->steps, outn = l->n_out / l->steps;
    } else if (l->spec.kind == LOOM_LAYER_CONV2D && !l->direct) {
        rows = B * l->oh * l->ow, in = (int64_t)l->kh * l->kw * l->cin, outn = l->cout;
    } else {
        return 0;
    }
    if (rows > INT_MAX || in > INT_MAX) return 0;
    switch (which) {
    case 0: *out = (loom_gemm_shape){false, false, (int)rows, (int)outn, (int)in}; return 1; /* y = x W */
    case 1: /* dx = dz W^T */
        if (!l->needs_dx) return 0;
        *out = (loom_gemm_shape){false, true, (int)rows, (int)in, (int)outn};
        return 1;
    case 2: *out = (loom_gemm_shape){true, false, (int)in, (int)outn, (int)rows}; return 1; /* dW = x^T dz */
    }
    return 0;
}
