/* metrics.c - model.metrics as Keras computes them, from an additive state.
 * Every metric but accuracy keeps sums (counts, histograms) that a model adds
 * to on each step, so the states of replicas and batches add up and a take
 * (loom_model_metrics_take) reads and clears them. accuracy comes from the
 * steps' correct counts, which the strategies already sum across replicas and
 * workers.
 * The outputs are seen as probabilities against targets: softmax of the
 * logits against one_hot(label) (sparse softmax cross-entropy), sigmoid of
 * the logits against the label (binary cross-entropy), the outputs
 * themselves against the label (regressions).
 *   auc        Keras AUC(curve="ROC", summation_method="interpolation"):
 *              T thresholds {-eps, 1/(T-1), ..., (T-2)/(T-1), 1+eps}; a
 *              prediction p counts as positive at threshold i when i <=
 *              max(ceil(p (T-1)) - 1, 0) (Keras' bucketing for evenly spaced
 *              thresholds); the state is a histogram of positives (weight t)
 *              and negatives (1 - t) by bucket; the result is the trapezoid
 *              sum over the (fpr, tpr) points. multi_label: one curve per
 *              output, averaged; else all outputs pooled (micro).
 *   precision, recall   at threshold 0.5 (p > 0.5), pooled over outputs.
 *   top_k_accuracy      the label among the k largest logits (ties: a logit
 *              equal to the label's counts as smaller, as tf.math.in_top_k).
 *   mae, rmse  mean over outputs, then over examples (rmse: sqrt of the mean).
 *   perplexity exp of the mean token loss of sparse softmax cross-entropy
 *              (an example is a token without a time axis).
 * With a per-token loss (output (T, V), labels (T,)) accuracy is the token
 * accuracy: right unmasked tokens over unmasked tokens, from the chunks'
 * token sums. */
#include "nn_internal.h"

#include <math.h>
#include <string.h>

static int is_regression(loom_loss_kind k) { return k == LOOM_LOSS_MSE || k == LOOM_LOSS_MAE || k == LOOM_LOSS_HUBER; }

static int metric_error(const loom_model_spec *spec, loom_metric_kind k, loom_err *err, const char *why)
{
    char where[LOOM_PATH_MAX + 16];
    nn_loc_str_(&spec->metrics_loc, where, sizeof where);
    return loom_err_set(err, LOOM_ECONFIG, where, "model.metrics: \"%s\" does not fit this model: %s",
                        loom_metric_name(k), why);
}

int nn_metrics_init_(loom_model *m, const loom_model_spec *spec, loom_err *err)
{
    const int64_t n = m->layer[m->n_layers - 1].n_out;
    const loom_loss_kind loss = m->loss;
    const char *lname = loom_loss_name(loss);
    char why[256];
    m->auc_T = spec->auc_thresholds >= 2 ? spec->auc_thresholds : 200;
    m->top_k = spec->top_k >= 1 ? spec->top_k : 5;
    if (!spec->metrics_set) { /* Keras' habit: accuracy for a classification, the loss alone for a regression */
        m->n_metrics = 0;
        if (!is_regression(loss) || (loss == LOOM_LOSS_MSE && n > 1)) m->metric[m->n_metrics++] = LOOM_METRIC_ACCURACY;
    } else {
        m->n_metrics = spec->n_metrics;
        memcpy(m->metric, spec->metric, sizeof m->metric);
    }
    m->msize = 0;
    for (int i = 0; i < m->n_metrics; i++) {
        loom_metric_kind k = m->metric[i];
        int64_t size = 0;
        if (m->seq_T && k != LOOM_METRIC_ACCURACY && k != LOOM_METRIC_PERPLEXITY)
            return metric_error(spec, k, err, "the loss is per token (output (T, classes)); its metrics are "
                                "accuracy (of the tokens) and perplexity"),
                   loom_err_hint(err, "use metrics = [\"accuracy\", \"perplexity\"]");
        switch (k) {
        case LOOM_METRIC_PERPLEXITY:
            if (loss != LOOM_LOSS_SPARSE_SOFTMAX_CE) {
                snprintf(why, sizeof why, "it is exp of the mean cross-entropy (sparse_softmax_cross_entropy), the "
                         "loss is %s", lname);
                return metric_error(spec, k, err, why);
            }
            size = 2; /* token loss sum, tokens */
            break;
        case LOOM_METRIC_ACCURACY:
            if (m->seq_T) size = 2; /* right tokens, tokens */
            if (is_regression(loss) && !(loss == LOOM_LOSS_MSE && n > 1)) {
                snprintf(why, sizeof why, "the loss %s with %lld output makes a regression, where no prediction is "
                         "right or wrong", lname, (long long)n);
                return metric_error(spec, k, err, why), loom_err_hint(err, "use \"mae\" or \"rmse\"");
            }
            break;
        case LOOM_METRIC_AUC:
        case LOOM_METRIC_PRECISION:
        case LOOM_METRIC_RECALL:
            if (is_regression(loss)) {
                snprintf(why, sizeof why, "the loss %s makes a regression, not a classification", lname);
                return metric_error(spec, k, err, why), loom_err_hint(err, "use \"mae\" or \"rmse\"");
            }
            if (k != LOOM_METRIC_AUC) {
                size = 3; /* tp, fp, fn */
                break;
            }
            if (loss == LOOM_LOSS_SPARSE_SOFTMAX_CE && !spec->multi_label) {
                snprintf(why, sizeof why, "the model has %lld classes and AUC is a curve of two", (long long)n);
                return metric_error(spec, k, err, why),
                       loom_err_hint(err, "set model.multi_label = true for one curve per class (averaged), or for "
                                          "two classes use loss = \"binary_cross_entropy\" with one output unit");
            }
            m->auc_curves = spec->multi_label ? (int)n : 1;
            size = 2 * (int64_t)m->auc_T * m->auc_curves;
            break;
        case LOOM_METRIC_TOP_K_ACCURACY:
            if (loss != LOOM_LOSS_SPARSE_SOFTMAX_CE) {
                snprintf(why, sizeof why, "it needs class labels (sparse_softmax_cross_entropy), the loss is %s", lname);
                return metric_error(spec, k, err, why);
            }
            if (m->top_k >= n) {
                snprintf(why, sizeof why, "top_k = %d with %lld classes is always right", m->top_k, (long long)n);
                return metric_error(spec, k, err, why),
                       loom_err_hint(err, "set model.top_k below %lld", (long long)n);
            }
            size = 2; /* hits, examples */
            break;
        case LOOM_METRIC_MAE:
        case LOOM_METRIC_RMSE:
            if (loss == LOOM_LOSS_SPARSE_SOFTMAX_CE) {
                snprintf(why, sizeof why, "it compares outputs with targets of their shape, and the labels are "
                         "class numbers (%s)", lname);
                return metric_error(spec, k, err, why), loom_err_hint(err, "use \"accuracy\" or \"top_k_accuracy\"");
            }
            size = 2; /* sum of per-example means, examples */
            break;
        default:
            return loom_err_set(err, LOOM_ECONFIG, m->where, "unknown metric %d", (int)k);
        }
        m->moff[i] = m->msize;
        m->msize += size;
    }
    /* several heads: each head's loss sum and correct count (loom_model_head_value) */
    m->hoff = m->msize;
    if (m->n_heads > 1) m->msize += 2 * m->n_heads;
    if (m->msize && !(m->mstate = loom_calloc((size_t)m->msize, sizeof(double))))
        return loom_err_set(err, LOOM_ENOMEM, m->where, "cannot allocate the metrics' state");
    return LOOM_OK;
}

/* The example's probability-like output j and its target. */
static inline double prob(const loom_model *m, const float *zr, int64_t n, int64_t j, float mx, double inv_s)
{
    if (m->loss == LOOM_LOSS_SPARSE_SOFTMAX_CE) return exp((double)zr[j] - mx) * inv_s;
    if (m->loss == LOOM_LOSS_BCE) return 1.0 / (1.0 + exp(-(double)zr[j]));
    (void)n;
    return zr[j];
}

/* The token sums of the last step's chunks (as many as model.c's split_batch made: fewer than
 * min(B, threads) where the BLAS row quantum rounds a cut to 0, and the others hold an older step's). */
static void token_update(loom_model *m, int64_t B)
{
    (void)B;
    int nc = m->n_split;
    for (int i = 0; i < m->n_metrics; i++) {
        double *st = m->mstate + m->moff[i];
        bool acc = m->metric[i] == LOOM_METRIC_ACCURACY && m->seq_T;
        if (!acc && m->metric[i] != LOOM_METRIC_PERPLEXITY) continue;
        for (int t = 0; t < nc; t++) {
            st[0] += acc ? (double)m->chunk[t].tok_ok : m->chunk[t].tok_loss;
            st[1] += (double)m->chunk[t].tok_n;
        }
    }
}

void nn_metrics_update_(loom_model *m, const float *z, int64_t B)
{
    if (!m->msize) return;
    token_update(m, B);
    if (m->seq_T) return; /* the others refuse a per-token loss */
    const int64_t n = m->layer[m->n_layers - 1].n_out;
    const int T = m->auc_T;
    for (int64_t b = 0; b < B; b++) {
        const float *zr = z + b * n;
        float mx = zr[0];
        double inv_s = 1;
        if (m->loss == LOOM_LOSS_SPARSE_SOFTMAX_CE) {
            double s = 0;
            for (int64_t j = 1; j < n; j++) mx = zr[j] > mx ? zr[j] : mx;
            for (int64_t j = 0; j < n; j++) s += exp((double)zr[j] - mx);
            inv_s = 1.0 / s;
        }
        const int32_t y = m->loss == LOOM_LOSS_SPARSE_SOFTMAX_CE ? m->labels[b] : -1;
        const float *tr = m->loss == LOOM_LOSS_SPARSE_SOFTMAX_CE ? NULL : m->targets + b * n;
        for (int i = 0; i < m->n_metrics; i++) {
            double *st = m->mstate + m->moff[i];
            switch (m->metric[i]) {
            case LOOM_METRIC_AUC:
                for (int64_t j = 0; j < n; j++) {
                    double t = tr ? (double)tr[j] : (double)(j == y);
                    float p = (float)prob(m, zr, n, j, mx, inv_s);
                    p = p < 0.f ? 0.f : p > 1.f ? 1.f : p;
                    int bk = (int)ceilf(p * (float)(T - 1)) - 1;
                    bk = bk < 0 ? 0 : bk > T - 1 ? T - 1 : bk;
                    double *h = st + (m->auc_curves > 1 ? 2 * (int64_t)T * j : 0);
                    h[bk] += t;
                    h[T + bk] += 1.0 - t;
                }
                break;
            case LOOM_METRIC_PRECISION:
            case LOOM_METRIC_RECALL:
                for (int64_t j = 0; j < n; j++) {
                    double t = tr ? (double)tr[j] : (double)(j == y);
                    int pos = prob(m, zr, n, j, mx, inv_s) > 0.5;
                    st[0] += pos * t;
                    st[1] += pos * (1.0 - t);
                    st[2] += (1 - pos) * t;
                }
                break;
            case LOOM_METRIC_TOP_K_ACCURACY: {
                int64_t above = 0;
                for (int64_t j = 0; j < n; j++) above += zr[j] > zr[y];
                st[0] += above < m->top_k && isfinite(zr[y]);
                st[1] += 1;
                break;
            }
            case LOOM_METRIC_MAE:
            case LOOM_METRIC_RMSE: {
                double s = 0;
                for (int64_t j = 0; j < n; j++) {
                    double d = prob(m, zr, n, j, mx, inv_s) - (double)tr[j];
                    s += m->metric[i] == LOOM_METRIC_MAE ? fabs(d) : d * d;
                }
                st[0] += s / (double)n;
                st[1] += 1;
                break;
            }
            default:
                break;
            }
        }
    }
}

int loom_model_num_metrics(const loom_model *m) { return m->n_metrics; }
loom_metric_kind loom_model_metric(const loom_model *m, int i) { return m->metric[i]; }
int64_t loom_model_metrics_size(const loom_model *m) { return m->msize; }

void loom_model_metrics_take(loom_model *m, double *acc)
{
    for (int64_t i = 0; i < m->msize; i++) {
        if (acc) acc[i] += m->mstate[i];
        m->mstate[i] = 0;
    }
}

static double ratio(double a, double b) { return b > 0 ? a / b : NAN; }

/* Keras AUC.result for ROC with interpolation, from a bucket histogram. */
static double auc_curve(const double *h, int T)
{
    const double *pos = h, *neg = h + T;
    double P = 0, N = 0;
    for (int i = 0; i < T; i++) P += pos[i], N += neg[i];
    /* tp[i], fp[i]: the buckets >= i (reverse cumulative sums) */
    double tp_next = 0, fp_next = 0, area = 0;
    double tpr_next = 0, fpr_next = 0;
    for (int i = T - 1; i >= 0; i--) {
        double tp = tp_next + pos[i], fp = fp_next + neg[i];
        double tpr = P > 0 ? tp / P : 0, fpr = N > 0 ? fp / N : 0; /* divide_no_nan */
        if (i < T - 1) area += (fpr - fpr_next) * (tpr + tpr_next) / 2;
        tp_next = tp, fp_next = fp, tpr_next = tpr, fpr_next = fpr;
    }
    return area;
}

double loom_model_metric_value(const loom_model *m, int i, const double *acc, int64_t correct, int64_t examples)
{
    if (i < 0 || i >= m->n_metrics) return NAN;
    const double *st = acc ? acc + m->moff[i] : NULL;
    switch (m->metric[i]) {
    case LOOM_METRIC_ACCURACY:
        if (m->seq_T) return st ? ratio(st[0], st[1]) : NAN;
        return examples > 0 ? (double)correct / (double)examples : NAN;
    case LOOM_METRIC_PERPLEXITY:
        return st && st[1] > 0 ? exp(st[0] / st[1]) : NAN;
    case LOOM_METRIC_AUC: {
        if (!examples) return NAN;
        double s = 0;
        for (int c = 0; c < m->auc_curves; c++) s += auc_curve(st + 2 * (int64_t)m->auc_T * c, m->auc_T);
        return s / m->auc_curves;
    }
    case LOOM_METRIC_PRECISION:
        return examples ? (st[0] + st[1] > 0 ? st[0] / (st[0] + st[1]) : 0) : NAN; /* Keras: divide_no_nan */
    case LOOM_METRIC_RECALL:
        return examples ? (st[0] + st[2] > 0 ? st[0] / (st[0] + st[2]) : 0) : NAN;
    case LOOM_METRIC_TOP_K_ACCURACY:
    case LOOM_METRIC_MAE:
        return ratio(st[0], st[1]);
    case LOOM_METRIC_RMSE:
        return st[1] > 0 ? sqrt(st[0] / st[1]) : NAN;
    default:
        return NAN;
    }
}
