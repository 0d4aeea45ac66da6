/* normalization.c - layer normalization and batch normalization (its moving
 * statistics, synchronised across replicas), forward, backward and parameter gradients.
 * Moved out of layers.c; its file comment (chunks, threads, no allocation) holds. */
#include "nn_internal.h"
#include "kernel_internal.h"

#include <float.h>
#include <math.h>
#include <string.h>

/* ---- layer normalization over the last axis (Keras LayerNormalization) ---------- */

void nn_ln_forward_(const loom_model *m, const nn_layer_ *l, const float *x, float *y, int64_t b0, int64_t B)
{
    const int64_t C = l->C, rows = B * (l->n_out / C), r0 = b0 * (l->n_out / C);
    const float *gamma = m->params + l->kernel_off, *beta = m->params + l->bias_off;
    const float eps = (float)l->spec.epsilon;
    float *xh = l->xhat + b0 * l->n_out;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * C;
        double s = 0, ss = 0;
        for (int64_t c = 0; c < C; c++) s += xr[c];
        double mean = s / (double)C;
        for (int64_t c = 0; c < C; c++) ss += ((double)xr[c] - mean) * ((double)xr[c] - mean);
        float rstd = (float)(1.0 / sqrt(ss / (double)C + eps));
        l->stat[r0 + r] = rstd;
        for (int64_t c = 0; c < C; c++) {
            float h = ((float)(xr[c] - mean)) * rstd;
            xh[r * C + c] = h;
            y[r * C + c] = gamma[c] * h + beta[c];
        }
    }
}

/* dz (saved for gamma and beta) = g; dx = rstd (dh - mean(dh) - h mean(dh h)), dh = g gamma; in place in g. */
float *nn_ln_backward_(const loom_model *m, const nn_layer_ *l, nn_chunk_ *c, float *g)
{
    const int64_t C = l->C, rows = c->B * (l->n_out / C), r0 = c->b0 * (l->n_out / C);
    const float *gamma = m->params + l->kernel_off, *xh = l->xhat + c->b0 * l->n_out;
    memcpy(l->dz + c->b0 * l->n_out, g, (size_t)(c->B * l->n_out) * sizeof *g);
    if (!l->needs_dx) return NULL;
    for (int64_t r = 0; r < rows; r++) {
        float *gr = g + r * C;
        const float *hr = xh + r * C;
        double s = 0, sh = 0;
        for (int64_t k = 0; k < C; k++) {
            double dh = (double)gr[k] * gamma[k];
            s += dh;
            sh += dh * hr[k];
        }
        float ms = (float)(s / (double)C), msh = (float)(sh / (double)C), rstd = l->stat[r0 + r];
        for (int64_t k = 0; k < C; k++) gr[k] = rstd * (gr[k] * gamma[k] - ms - hr[k] * msh);
    }
    return g;
}

void nn_ln_param_grads_(const loom_model *m, int li, int64_t B, int part, int parts)
{
    const nn_layer_ *l = &m->layer[li];
    const int64_t C = l->C, rows = B * (l->n_out / C);
    const int64_t c0 = C * part / parts, c1 = C * (part + 1) / parts;
    float *dg = m->grads + l->kernel_off, *db = m->grads + l->bias_off;
    for (int64_t k = c0; k < c1; k++) dg[k] = db[k] = 0.f;
    for (int64_t r = 0; r < rows; r++) {
        const float *dz = l->dz + r * C, *h = l->xhat + r * C;
        for (int64_t k = c0; k < c1; k++) {
            dg[k] += dz[k] * h[k];
            db[k] += dz[k];
        }
    }
}

/* ---- batch normalization over every axis but the last (Keras BatchNormalization) ---- */

/* stat: mean (C), 1/std (C), then 4 C doubles of scratch, then (2 C + 1)
 * floats: the buffer of a synchronised layer's all-reduce. */
static double *bn_scratch(const nn_layer_ *l) { return (double *)(l->stat + 2 * l->C); }
static float *bn_sync_buf(const nn_layer_ *l) { return l->stat + 10 * l->C; }
static bool bn_synced(const loom_model *m, const nn_layer_ *l)
{
    return m->bn_sync && l->spec.kind == LOOM_LAYER_BATCH_NORM && l->spec.sync;
}

void nn_bn_sync_(loom_model *m, float *buf, int64_t n)
{
    loom_err e;
    memset(&e, 0, sizeof e);
    m->sync_k++;
    int rc = m->bn_sync(m->bn_sync_arg, buf, n, &e);
    if (rc && !m->sync_rc) m->sync_rc = rc, m->sync_err = e;
}

/* The layer of a step's sync call k (-1: the step has fewer), its length
 * and pass: the forward's calls in layer order, then the backward's from
 * the last layer down (only layers that pass a gradient down). */
static int bn_sync_call(const loom_model *m, int k, int64_t *n, bool *fwd)
{
    for (int i = 0; i < m->n_layers; i++)
        if (bn_synced(m, &m->layer[i]) && k-- == 0) return *n = 2 * m->layer[i].C + 1, *fwd = true, i;
    for (int i = m->n_layers - 1; i >= 0; i--)
        if (bn_synced(m, &m->layer[i]) && m->layer[i].needs_dx && k-- == 0)
            return *n = 2 * m->layer[i].C, *fwd = false, i;
    return -1;
}

/* The global batch's mean and biased variance from a synchronised forward's
 * summed buffer b (count, sums, sums of squares about mm); 0 when the job
 * had no examples. */
static double bn_sync_global(nn_layer_ *l, const float *b, const float *mm, double *mean, double *var)
{
    const int64_t C = l->C;
    const double N = b[0];
    l->sync_n = N >= 1 ? N : 1;
    for (int64_t k = 0; k < C && N >= 1; k++) {
        double mu = b[1 + k] / N, dm = mu - mm[k], v = b[1 + C + k] / N - dm * dm;
        mean[k] = mu;
        var[k] = v > 0 ? v : 0;
    }
    return N >= 1 ? N : 0;
}

/* The moving statistics' step toward the global batch's (every replica
 * makes the same, so they stay equal). */
static void bn_move(const loom_model *m, const nn_layer_ *l, const double *mean, const double *var)
{
    float *mm = m->params + l->mm_off, *mv = m->params + l->mv_off;
    const float mom = (float)l->spec.momentum;
    for (int64_t k = 0; k < l->C; k++) {
        mm[k] = mm[k] * mom + (float)mean[k] * (1.f - mom);
        mv[k] = mv[k] * mom + (float)var[k] * (1.f - mom);
    }
}

int nn_bn_sync_rest_(loom_model *m, bool forward_only, loom_err *err)
{
    if (!m->bn_sync) return LOOM_OK;
    int64_t n;
    bool fwd;
    for (int i; (i = bn_sync_call(m, m->sync_k, &n, &fwd)) >= 0 && (fwd || !forward_only);) {
        nn_layer_ *l = &m->layer[i];
        float *b = bn_sync_buf(l);
        memset(b, 0, (size_t)n * sizeof *b);
        nn_bn_sync_(m, b, n);
        /* a replica without examples moves its statistics as the others do */
        double *gm = bn_scratch(l) + 2 * l->C, *gv = gm + l->C;
        if (fwd && !m->sync_rc && bn_sync_global(l, b, m->params + l->mm_off, gm, gv) > 0) bn_move(m, l, gm, gv);
    }
    int rc = m->sync_rc;
    if (rc && err) *err = m->sync_err;
    if (!forward_only) m->sync_k = 0, m->sync_rc = 0;
    return rc;
}

/* Synchronised statistics: this replica's count, sum and sum of squares
 * about the moving mean (the same on every replica: a shift that keeps the
 * float sums' cancellation small once it has moved) are summed over the
 * job's replicas; mean and biased variance of the global batch follow. */
static void bn_sync_stats(loom_model *m, nn_layer_ *l, const float *x, int64_t rows, const float *mm, double *mean,
                          double *var)
{
    const int64_t C = l->C;
    double *s = bn_scratch(l), *ss = s + C;
    for (int64_t k = 0; k < C; k++) s[k] = ss[k] = 0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t k = 0; k < C; k++) {
            double v = x[r * C + k], d = v - mm[k];
            s[k] += v;
            ss[k] += d * d;
        }
    float *b = bn_sync_buf(l);
    b[0] = (float)rows;
    for (int64_t k = 0; k < C; k++) b[1 + k] = (float)s[k], b[1 + C + k] = (float)ss[k];
    nn_bn_sync_(m, b, 2 * C + 1);
    bn_sync_global(l, b, mm, mean, var); /* N >= rows >= 1 */
}

void nn_bn_forward_(loom_model *m, int li, const float *x, int64_t B, int training)
{
    nn_layer_ *l = &m->layer[li];
    const int64_t C = l->C, rows = B * (l->n_out / C);
    const float *gamma = m->params + l->kernel_off, *beta = m->params + l->bias_off;
    float *mm = m->params + l->mm_off, *mv = m->params + l->mv_off;
    float *mean = l->stat, *rstd = l->stat + C;
    const double eps = l->spec.epsilon;
    if (training && bn_synced(m, l)) {
        double *gm = bn_scratch(l) + 2 * C, *gv = gm + C; /* the global batch's mean and variance */
        bn_sync_stats(m, l, x, rows, mm, gm, gv);
        for (int64_t k = 0; k < C; k++) {
            mean[k] = (float)gm[k];
            rstd[k] = (float)(1.0 / sqrt(gv[k] + eps));
        }
        bn_move(m, l, gm, gv);
    } else if (training) {
        double *s = bn_scratch(l), *ss = s + C;
        nn_bn_moments_(m, l, x, rows, s, ss); /* mean, biased variance */
        const float mom = (float)l->spec.momentum;
        for (int64_t k = 0; k < C; k++) {
            double var = ss[k];
            mean[k] = (float)s[k];
            rstd[k] = (float)(1.0 / sqrt(var + eps));
            mm[k] = mm[k] * mom + (float)s[k] * (1.f - mom);
            mv[k] = mv[k] * mom + (float)var * (1.f - mom);
        }
    } else {
        for (int64_t k = 0; k < C; k++) {
            mean[k] = mm[k];
            rstd[k] = (float)(1.0 / sqrt((double)mv[k] + eps));
        }
    }
    l->bn_x = x;
    nn_bn_normalize_(m, l, x, rows, mean, rstd, gamma, beta);
}

void nn_bn_backward_(loom_model *m, int li, nn_chunk_ *chunk, int nchunks, int64_t B)
{
    nn_layer_ *l = &m->layer[li];
    const int64_t C = l->C, R = l->n_out / C;
    const float *gamma = m->params + l->kernel_off, *rstd = l->stat + C;
    double *sg = bn_scratch(l), *sgh = sg + C;
    nn_bn_grad_sums_(m, l, chunk, nchunks, B, sg, sgh); /* whatever the chunks */
    float *dgamma = m->grads + l->kernel_off, *dbeta = m->grads + l->bias_off;
    for (int64_t k = 0; k < C; k++) dgamma[k] = (float)sgh[k], dbeta[k] = (float)sg[k];
    if (!l->needs_dx) {
        for (int t = 0; t < nchunks; t++) chunk[t].bw_done = 1;
        return;
    }
    double N = (double)(B * R);
    if (bn_synced(m, l)) { /* the input gradient's means over the global batch (gamma's and beta's stay this
                              replica's: the gradient all-reduce sums them) */
        float *b = bn_sync_buf(l);
        for (int64_t k = 0; k < C; k++) b[k] = (float)sg[k], b[C + k] = (float)sgh[k];
        nn_bn_sync_(m, b, 2 * C);
        for (int64_t k = 0; k < C; k++) sg[k] = b[k], sgh[k] = b[C + k];
        N = l->sync_n;
    }
    nn_bn_grad_apply_(m, l, chunk, nchunks, B, gamma, rstd, sg, sgh, N);
}
