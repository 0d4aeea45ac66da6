/* losses.c - the losses on a chunk's outputs: softmax cross-entropy (class
 * weights), mean squared error and the other per-target losses, and each head's.
 * Moved out of layers.c; its file comment (chunks, threads, no allocation) holds. */
#include "nn_internal.h"
#include "kernel_internal.h"

#include <float.h>
#include <math.h>
#include <string.h>

/* ---- losses ---------------------------------------------------------------- */

/* Softmax cross-entropy on logits, numerically stable: loss = lse(z) - z[y],
 * dz = (softmax(z) - onehot(y)) * inv_gb. Labels were range-checked. */
double nn_loss_sparse_ce_(const float *z, const int32_t *labels, int64_t B, int64_t n, float inv_gb, float *g,
                          int64_t *correct)
{
    double total = 0;
    int64_t ok = 0;
    for (int64_t b = 0; b < B; b++) {
        const float *restrict zr = z + b * n;
        int64_t am = 0;
        float mx = zr[0];
        for (int64_t j = 1; j < n; j++)
            if (zr[j] > mx) {
                mx = zr[j];
                am = j;
            }
        ok += am == labels[b];
        float s = 0.f;
        if (g) {
            float *restrict gr = g + b * n;
            for (int64_t j = 0; j < n; j++) s += gr[j] = expf(zr[j] - mx);
            float k = inv_gb / s;
            for (int64_t j = 0; j < n; j++) gr[j] *= k;
            gr[labels[b]] -= inv_gb;
        } else {
            for (int64_t j = 0; j < n; j++) s += expf(zr[j] - mx);
        }
        total += (double)logf(s) + (double)mx - (double)zr[labels[b]];
    }
    *correct = ok;
    return total;
}

/* Mean squared error, mean over the n outputs of an example, summed over the
 * batch: dz = 2 (z - t) / n * inv_gb. Correct: argmax(z) == argmax(t). */
double nn_loss_mse_(const float *z, const float *t, int64_t B, int64_t n, float inv_gb, float *g, int64_t *correct)
{
    double total = 0;
    int64_t ok = 0;
    const float k = 2.f * inv_gb / (float)n;
    for (int64_t b = 0; b < B; b++) {
        const float *zr = z + b * n, *tr = t + b * n;
        double s = 0;
        int64_t az = 0, at = 0;
        for (int64_t j = 0; j < n; j++) {
            double d = (double)zr[j] - tr[j];
            s += d * d;
            if (zr[j] > zr[az]) az = j;
            if (tr[j] > tr[at]) at = j;
        }
        ok += az == at;
        total += s / (double)n;
        if (g)
            for (int64_t j = 0; j < n; j++) g[b * n + j] = k * (zr[j] - tr[j]);
    }
    *correct = ok;
    return total;
}

/* The losses on targets (m->targets): per example the mean over the n
 * outputs, times the class weight (binary: w[1] t + w[0] (1 - t)), summed
 * over the batch; dz = d(that)/dz * inv_gb.
 *   binary_cross_entropy on logits, stable as TF's
 *     sigmoid_cross_entropy_with_logits: max(z, 0) - z t + log(1 + exp(-|z|)),
 *     dz = sigmoid(z) - t; correct: every output on the label's side of 0.5
 *   mean_absolute_error |z - t|, dz = sign(z - t) (0 at z = t, as TF's abs)
 *   huber (Keras, delta d): e^2 / 2 for |e| <= d, else d |e| - d^2 / 2;
 *     dz = e clipped to [-d, d]
 *   mean_squared_error as nn_loss_mse_. */
static double loss_targets(const loom_model *m, const float *z, const float *t, const float *sw, int64_t B, int64_t n,
                           float inv_gb, float *g, int64_t *correct)
{
    double total = 0;
    int64_t ok = 0;
    const float d = m->huber_delta, inv_n = 1.f / (float)n;
    for (int64_t b = 0; b < B; b++) {
        const float *zr = z + b * n, *tr = t + b * n;
        float *gr = g ? g + b * n : NULL;
        float w = 1.f;
        if (m->n_cw == 2) w = m->cw[1] * tr[0] + m->cw[0] * (1.f - tr[0]);
        if (sw) w *= sw[b];
        const float k = w * inv_n * inv_gb;
        double s = 0;
        int64_t hits = 0, az = 0, at = 0;
        for (int64_t j = 0; j < n; j++) {
            float zj = zr[j], tj = tr[j], e = zj - tj, gj;
            switch (m->loss) {
            case LOOM_LOSS_BCE: {
                s += (double)(zj > 0.f ? zj : 0.f) - (double)zj * tj + log1p(exp(-fabs((double)zj)));
                gj = 1.f / (1.f + expf(-zj)) - tj;
                hits += (zj > 0.f) == (tj > 0.5f);
                break;
            }
            case LOOM_LOSS_MAE:
                s += fabs((double)e);
                gj = (float)((e > 0.f) - (e < 0.f));
                break;
            case LOOM_LOSS_HUBER: {
                double ae = fabs((double)e);
                s += ae <= d ? 0.5 * ae * ae : (double)d * ae - 0.5 * (double)d * d;
                gj = e > d ? d : e < -d ? -d : e;
                break;
            }
            default: /* mean squared error */
                s += (double)e * e;
                gj = 2.f * e;
                break;
            }
            if (zr[j] > zr[az]) az = j;
            if (tr[j] > tr[at]) at = j;
            if (gr) gr[j] = k * gj;
        }
        if (m->loss == LOOM_LOSS_BCE) ok += hits == n;
        else if (n > 1) ok += az == at; /* one-hot targets: the argmax agrees */
        total += (double)w * s / (double)n;
    }
    *correct = ok;
    return total;
}

/* Sparse softmax cross-entropy with class weights: each example's loss and gradient times w[label]. */
static double sparse_ce_weighted(const float *z, const int32_t *labels, const float *cw, const float *sw, int64_t B,
                                 int64_t n, float inv_gb, float *g, int64_t *correct)
{
    double total = 0;
    int64_t ok = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t c;
        float w = (cw ? cw[labels[b]] : 1.f) * (sw ? sw[b] : 1.f);
        double l = nn_loss_sparse_ce_(z + b * n, labels + b, 1, n, inv_gb * w, g ? g + b * n : NULL, &c);
        ok += c;
        total += (double)w * l;
    }
    *correct = ok;
    return total;
}

/* Per-token sparse softmax cross-entropy on z (B, T, V): an example's loss
 * is the mean over its unmasked tokens (the time mask, and labels equal to
 * model.ignore_label, read as -1), 0 without any; its gradient rows at
 * masked tokens are 0. The token sums go to the chunk (token accuracy,
 * perplexity). */
static double seq_ce(const loom_model *m, const float *z, int64_t b0, int64_t B, const float *sw, float inv_gb,
                     float *g, int64_t *correct, nn_chunk_ *c)
{
    const int64_t T = m->seq_T, V = m->layer[m->n_layers - 1].n_out / T;
    const uint8_t *mk = m->mask_T == T ? m->tmask + b0 * T : NULL;
    const int32_t *lab = m->labels + b0 * T;
    double total = 0, tl = 0;
    int64_t tok = 0, tn = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t n = 0, right = 0;
        for (int64_t t = 0; t < T; t++) n += lab[b * T + t] >= 0 && (!mk || mk[b * T + t]);
        const float w = (sw ? sw[b] : 1.f) / (float)(n ? n : 1);
        double s = 0;
        for (int64_t t = 0; t < T; t++) {
            const int64_t r = b * T + t;
            if (lab[r] < 0 || (mk && !mk[r])) {
                if (g) memset(g + r * V, 0, (size_t)V * sizeof *g);
                continue;
            }
            int64_t hit;
            s += nn_loss_sparse_ce_(z + r * V, lab + r, 1, V, inv_gb * w, g ? g + r * V : NULL, &hit);
            right += hit;
        }
        tok += right, tn += n, tl += s;
        total += n ? (double)w * s : 0;
    }
    if (c) c->tok_loss = tl, c->tok_ok = tok, c->tok_n = tn;
    /* correct (of examples, what the strategies sum and the progress line
     * divides by examples): the token accuracy in whole examples, rounded;
     * the accuracy metric is the exact token ratio */
    *correct = tn ? (int64_t)llround((double)tok * (double)B / (double)tn) : 0;
    return total;
}

double nn_loss_(const loom_model *m, const float *z, int64_t b0, int64_t B, float inv_gb, float *g, int64_t *correct)
{
    const int64_t n = m->layer[m->n_layers - 1].n_out;
    const float *sw = m->sw ? m->swb + b0 : NULL;
    if (m->seq_T) {
        nn_chunk_ *c = NULL; /* the chunk of rows b0.. (its token sums) */
        for (int t = 0; t < m->threads && !c; t++)
            if (m->chunk[t].b0 == b0 && m->chunk[t].B == B) c = &m->chunk[t];
        return seq_ce(m, z, b0, B, sw, inv_gb, g, correct, c);
    }
    if (m->loss == LOOM_LOSS_SPARSE_SOFTMAX_CE)
        return m->n_cw || sw ? sparse_ce_weighted(z, m->labels + b0, m->n_cw ? m->cw : NULL, sw, B, n, inv_gb, g, correct)
                             : nn_loss_sparse_ce_(z, m->labels + b0, B, n, inv_gb, g, correct);
    if (m->loss == LOOM_LOSS_MSE && !m->n_cw && !sw)
        return nn_loss_mse_(z, m->targets + b0 * n, B, n, inv_gb, g, correct);
    return loss_targets(m, z, m->targets + b0 * n, sw, B, n, inv_gb, g, correct);
}

/* A head's loss (model.outputs, heads 1..): no class or sample weights.
 * Sparse softmax cross-entropy on labels, else per example the mean over the
 * n outputs of binary cross-entropy on logits, absolute or squared error on
 * targets t, as loss_targets; dz times inv_gb into g (when not NULL). */
double nn_head_loss_(loom_loss_kind kind, const float *z, const int32_t *labels, const float *t, int64_t B, int64_t n,
                     float inv_gb, float *g, int64_t *correct)
{
    if (kind == LOOM_LOSS_SPARSE_SOFTMAX_CE) return nn_loss_sparse_ce_(z, labels, B, n, inv_gb, g, correct);
    if (kind == LOOM_LOSS_MSE) return nn_loss_mse_(z, t, B, n, inv_gb, g, correct);
    double total = 0;
    int64_t ok = 0;
    const float k = inv_gb / (float)n;
    for (int64_t b = 0; b < B; b++) {
        const float *zr = z + b * n, *tr = t + b * n;
        double s = 0;
        int64_t hits = 0, az = 0, at = 0;
        for (int64_t j = 0; j < n; j++) {
            float zj = zr[j], tj = tr[j], e = zj - tj, gj;
            if (kind == LOOM_LOSS_BCE) {
                s += (double)(zj > 0.f ? zj : 0.f) - (double)zj * tj + log1p(exp(-fabs((double)zj)));
                gj = 1.f / (1.f + expf(-zj)) - tj;
                hits += (zj > 0.f) == (tj > 0.5f);
            } else { /* mean absolute error */
                s += fabs((double)e);
                gj = (float)((e > 0.f) - (e < 0.f));
            }
            if (zr[j] > zr[az]) az = j;
            if (tr[j] > tr[at]) at = j;
            if (g) g[b * n + j] = k * gj;
        }
        if (kind == LOOM_LOSS_BCE) ok += hits == n;
        else if (n > 1) ok += az == at;
        total += s / (double)n;
    }
    *correct = ok;
    return total;
}
