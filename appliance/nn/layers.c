/* layers.c - forward and backward kernels of every layer kind, the losses.
 * Each kernel works on one chunk of the batch (nn_chunk_) and may run
 * concurrently with the same kernel on other chunks: it reads the shared
 * parameters, writes only its chunk's rows and its chunk's gradient buffer.
 * Matrix work goes to loom_sgemm; element-wise work is
 * written as single fused passes over restrict pointers so gcc -O3
 * vectorises it: bias+activation after a product, activation gradient +
 * bias column sums before one, softmax + cross-entropy + its gradient.
 * Nothing here allocates; every buffer was sized at loom_model_new. */
#include "nn_internal.h"

#include <float.h>
#include <math.h>
#include <string.h>

/* The build targets baseline x86-64 (SSE2); the hot element-wise loops are
 * cloned for AVX2 and AVX-512 and picked at load time (ifunc). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define NN_HOT __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define NN_HOT
#endif

/* Short copies in im2col (a kernel row of a few channels) are faster inline
 * than as memcpy calls; keep gcc from turning the loop back into one. */
static inline __attribute__((always_inline)) void copy_short(float *restrict d, const float *restrict s, int n)
{
    if (n >= 32) {
        memcpy(d, s, (size_t)n * sizeof *d);
        return;
    }
    for (int k = 0; k < n; k++) d[k] = s[k];
}

static inline __attribute__((always_inline)) void zero_short(float *restrict d, int n)
{
    for (int k = 0; k < n; k++) d[k] = 0.f;
}

const char *nn_loc_str_(const loom_loc *l, char *buf, size_t n)
{
    if (!l->file[0]) snprintf(buf, n, "%s", "");
    else if (l->line > 0) snprintf(buf, n, "%s:%d", l->file, l->line);
    else snprintf(buf, n, "%s", l->file);
    return buf;
}

const char *nn_layer_kind_name_(loom_layer_kind k)
{
    static const char *const names[] = {"dense", "conv2d", "max_pool2d", "dropout", "flatten", "activation"};
    return (unsigned)k < sizeof names / sizeof names[0] ? names[k] : "?";
}

const char *nn_activation_name_(loom_activation a)
{
    static const char *const names[] = {"none", "relu", "sigmoid", "tanh", "softmax"};
    return (unsigned)a < sizeof names / sizeof names[0] ? names[a] : "?";
}

/* ---- element-wise passes -------------------------------------------------- */

void nn_softmax_rows_(const float *z, float *p, int64_t B, int64_t n)
{
    for (int64_t b = 0; b < B; b++) {
        const float *zr = z + b * n;
        float *pr = p + b * n;
        float mx = zr[0];
        for (int64_t j = 1; j < n; j++) mx = zr[j] > mx ? zr[j] : mx;
        float s = 0.f;
        for (int64_t j = 0; j < n; j++) s += pr[j] = expf(zr[j] - mx);
        float inv = 1.f / s;
        for (int64_t j = 0; j < n; j++) pr[j] *= inv;
    }
}

/* y (rows, n) = act(y + b); b may be NULL. One pass. */
NN_HOT static void bias_act(float *restrict y, const float *restrict b, int64_t rows, int64_t n, loom_activation act)
{
    if (act == LOOM_ACT_SOFTMAX) {
        if (b)
            for (int64_t r = 0; r < rows; r++)
                for (int64_t j = 0; j < n; j++) y[r * n + j] += b[j];
        nn_softmax_rows_(y, y, rows, n);
        return;
    }
    for (int64_t r = 0; r < rows; r++) {
        float *restrict yr = y + r * n;
        switch (act) {
        case LOOM_ACT_RELU:
            if (b)
                for (int64_t j = 0; j < n; j++) {
                    float v = yr[j] + b[j];
                    yr[j] = v > 0.f ? v : 0.f;
                }
            else
                for (int64_t j = 0; j < n; j++) yr[j] = yr[j] > 0.f ? yr[j] : 0.f;
            break;
        case LOOM_ACT_SIGMOID:
            for (int64_t j = 0; j < n; j++) yr[j] = 1.f / (1.f + expf(-(yr[j] + (b ? b[j] : 0.f))));
            break;
        case LOOM_ACT_TANH:
            for (int64_t j = 0; j < n; j++) yr[j] = tanhf(yr[j] + (b ? b[j] : 0.f));
            break;
        default:
            if (b)
                for (int64_t j = 0; j < n; j++) yr[j] += b[j];
            break;
        }
    }
}

/* g (rows, n) *= act'(y) in place, and db = column sums of the result (db may
 * be NULL). One pass; db is overwritten, so the grads need no zeroing. */
NN_HOT static void act_grad_colsum(float *restrict g, const float *restrict y, float *restrict db, int64_t rows, int64_t n,
                            loom_activation act)
{
    if (db) memset(db, 0, (size_t)n * sizeof *db);
    for (int64_t r = 0; r < rows; r++) {
        float *restrict gr = g + r * n;
        const float *restrict yr = y + r * n;
        switch (act) {
        case LOOM_ACT_RELU:
            for (int64_t j = 0; j < n; j++) gr[j] = yr[j] > 0.f ? gr[j] : 0.f;
            break;
        case LOOM_ACT_SIGMOID:
            for (int64_t j = 0; j < n; j++) gr[j] *= yr[j] * (1.f - yr[j]);
            break;
        case LOOM_ACT_TANH:
            for (int64_t j = 0; j < n; j++) gr[j] *= 1.f - yr[j] * yr[j];
            break;
        case LOOM_ACT_SOFTMAX: {
            float dot = 0.f;
            for (int64_t j = 0; j < n; j++) dot += gr[j] * yr[j];
            for (int64_t j = 0; j < n; j++) gr[j] = yr[j] * (gr[j] - dot);
            break;
        }
        default:
            break;
        }
        if (db)
            for (int64_t j = 0; j < n; j++) db[j] += gr[j];
    }
}

/* ---- dense ---------------------------------------------------------------- */

/* Y (B, out) = act(X (B, in) W (in, out) + b) */
static void dense_forward(const loom_model *m, const nn_layer_ *l, const float *x, float *y, int64_t B)
{
    const float *W = m->params + l->kernel_off;
    const float *b = l->bias_off >= 0 ? m->params + l->bias_off : NULL;
    int in = (int)l->n_in, out = (int)l->n_out;
    loom_sgemm(false, false, (int)B, out, in, 1.f, x, in, W, out, 0.f, y, out);
    bias_act(y, b, B, out, l->act);
}

static float *dense_backward(const loom_model *m, const nn_layer_ *l, nn_chunk_ *c, const float *x, const float *y,
                             float *g, float *other)
{
    const int64_t B = c->B;
    const float *W = m->params + l->kernel_off;
    float *dW = c->grads + l->kernel_off;
    float *db = l->bias_off >= 0 ? c->grads + l->bias_off : NULL;
    int in = (int)l->n_in, out = (int)l->n_out;
    act_grad_colsum(g, y, db, B, out, l->act);
    /* dW (in, out) = X^T dZ; dX (B, in) = dZ W^T */
    loom_sgemm(true, false, in, out, (int)B, 1.f, x, in, g, out, 0.f, dW, out);
    if (!l->needs_dx) return NULL;
    loom_sgemm(false, true, (int)B, in, out, 1.f, g, out, W, out, 0.f, other, in);
    return other;
}

/* ---- conv2d: batch-chunked im2col + sgemm --------------------------------- */

/* col (nb*OH*OW, KH*KW*C), columns in kernel order (i, j, c), from x (nb, H, W, C). */
__attribute__((optimize("no-tree-loop-distribute-patterns"))) static void im2col(const nn_layer_ *l, const float *restrict x, int64_t nb, float *restrict col)
{
    const int H = l->ih, W = l->iw, C = l->cin, OH = l->oh, OW = l->ow, KH = l->kh, KW = l->kw;
    const int64_t K = (int64_t)KH * KW * C;
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * (int64_t)H * W * C;
        for (int oy = 0; oy < OH; oy++) {
            for (int ox = 0; ox < OW; ox++) {
                float *row = col + ((b * OH + oy) * OW + ox) * K;
                int y0 = oy * l->sh - l->pad_t, x0 = ox * l->sw - l->pad_l;
                for (int i = 0; i < KH; i++) {
                    float *dst = row + (int64_t)i * KW * C;
                    int yy = y0 + i;
                    if (yy < 0 || yy >= H) {
                        zero_short(dst, KW * C);
                        continue;
                    }
                    const float *src = xb + ((int64_t)yy * W) * C;
                    if (x0 >= 0 && x0 + KW <= W) {
                        copy_short(dst, src + (int64_t)x0 * C, KW * C);
                        continue;
                    }
                    for (int j = 0; j < KW; j++) {
                        int xx = x0 + j;
                        if (xx < 0 || xx >= W) zero_short(dst + j * C, C);
                        else copy_short(dst + j * C, src + (int64_t)xx * C, C);
                    }
                }
            }
        }
    }
}

/* dx (nb, H, W, C) += col2im(col); dx must be zeroed by the caller. */
NN_HOT static void col2im(const nn_layer_ *l, const float *restrict col, int64_t nb, float *restrict dx)
{
    const int H = l->ih, W = l->iw, C = l->cin, OH = l->oh, OW = l->ow, KH = l->kh, KW = l->kw;
    const int64_t K = (int64_t)KH * KW * C;
    for (int64_t b = 0; b < nb; b++) {
        float *xb = dx + b * (int64_t)H * W * C;
        for (int oy = 0; oy < OH; oy++) {
            for (int ox = 0; ox < OW; ox++) {
                const float *row = col + ((b * OH + oy) * OW + ox) * K;
                int y0 = oy * l->sh - l->pad_t, x0 = ox * l->sw - l->pad_l;
                for (int i = 0; i < KH; i++) {
                    int yy = y0 + i;
                    if (yy < 0 || yy >= H) continue;
                    const float *restrict src = row + (int64_t)i * KW * C;
                    float *restrict dst = xb + ((int64_t)yy * W) * C;
                    if (x0 >= 0 && x0 + KW <= W) {
                        float *restrict d = dst + (int64_t)x0 * C;
                        for (int k = 0; k < KW * C; k++) d[k] += src[k];
                        continue;
                    }
                    for (int j = 0; j < KW; j++) {
                        int xx = x0 + j;
                        if (xx < 0 || xx >= W) continue;
                        float *restrict d = dst + (int64_t)xx * C;
                        for (int c = 0; c < C; c++) d[c] += src[j * C + c];
                    }
                }
            }
        }
    }
}

static int conv_is_pointwise(const nn_layer_ *l)
{
    return l->kh == 1 && l->kw == 1 && l->sh == 1 && l->sw == 1 && l->pad_t == 0 && l->pad_l == 0;
}

static void conv_forward(const loom_model *m, const nn_layer_ *l, nn_chunk_ *c, const float *x, float *yc)
{
    const int64_t B = c->B;
    const float *W = m->params + l->kernel_off;
    const float *bias = l->bias_off >= 0 ? m->params + l->bias_off : NULL;
    const int64_t K = (int64_t)l->kh * l->kw * l->cin, P = (int64_t)l->oh * l->ow;
    for (int64_t b0 = 0; b0 < B; b0 += l->chunk) {
        int64_t nb = B - b0 < l->chunk ? B - b0 : l->chunk;
        const float *col = x + b0 * l->n_in;
        if (!conv_is_pointwise(l)) {
            im2col(l, x + b0 * l->n_in, nb, c->col);
            col = c->col;
        }
        float *y = yc + b0 * l->n_out;
        loom_sgemm(false, false, (int)(nb * P), l->cout, (int)K, 1.f, col, (int)K, W, l->cout, 0.f, y, l->cout);
        bias_act(y, bias, nb * P, l->cout, l->act);
    }
}

static float *conv_backward(const loom_model *m, const nn_layer_ *l, nn_chunk_ *c, const float *x, const float *y,
                            float *g, float *other)
{
    const int64_t B = c->B;
    const float *W = m->params + l->kernel_off;
    float *dW = c->grads + l->kernel_off;
    float *db = l->bias_off >= 0 ? c->grads + l->bias_off : NULL;
    const int64_t K = (int64_t)l->kh * l->kw * l->cin, P = (int64_t)l->oh * l->ow;
    act_grad_colsum(g, y, db, B * P, l->cout, l->act);
    for (int64_t b0 = 0; b0 < B; b0 += l->chunk) {
        int64_t nb = B - b0 < l->chunk ? B - b0 : l->chunk;
        const float *col = x + b0 * l->n_in;
        const float *gz = g + b0 * l->n_out;
        if (!conv_is_pointwise(l)) {
            im2col(l, x + b0 * l->n_in, nb, c->col);
            col = c->col;
        }
        /* dW (K, cout) += col^T dZ; the first chunk overwrites */
        loom_sgemm(true, false, (int)K, l->cout, (int)(nb * P), 1.f, col, (int)K, gz, l->cout, b0 ? 1.f : 0.f, dW,
                   l->cout);
        if (!l->needs_dx) continue;
        float *dx = other + b0 * l->n_in;
        if (conv_is_pointwise(l)) {
            loom_sgemm(false, true, (int)(nb * P), (int)K, l->cout, 1.f, gz, l->cout, W, l->cout, 0.f, dx, (int)K);
            continue;
        }
        /* dcol (nb*P, K) = dZ W^T, reusing the col scratch, then scattered back */
        loom_sgemm(false, true, (int)(nb * P), (int)K, l->cout, 1.f, gz, l->cout, W, l->cout, 0.f, c->col, (int)K);
        memset(dx, 0, (size_t)(nb * l->n_in) * sizeof *dx);
        col2im(l, c->col, nb, dx);
    }
    return l->needs_dx ? other : NULL;
}

/* ---- max_pool2d ------------------------------------------------------------ */

/* Window positions outside the input (SAME padding) are skipped, as TF does;
 * ties keep the first position in (i, j) order. */
NN_HOT static void pool_forward(const nn_layer_ *l, const float *x, float *y, int32_t *argmax, int64_t B)
{
    const int H = l->ih, W = l->iw, C = l->cin, OH = l->oh, OW = l->ow;
    for (int64_t b = 0; b < B; b++) {
        const float *xb = x + b * l->n_in;
        for (int oy = 0; oy < OH; oy++) {
            int y0 = oy * l->sh - l->pad_t, ya = y0 < 0 ? 0 : y0, yb = y0 + l->kh > H ? H : y0 + l->kh;
            for (int ox = 0; ox < OW; ox++) {
                int x0 = ox * l->sw - l->pad_l, xa = x0 < 0 ? 0 : x0, xe = x0 + l->kw > W ? W : x0 + l->kw;
                int64_t o = b * l->n_out + ((int64_t)oy * OW + ox) * C;
                float *restrict yo = y + o;
                int32_t *restrict ao = argmax + o;
                int32_t first = (ya * W + xa) * C;
                for (int c = 0; c < C; c++) {
                    yo[c] = xb[first + c];
                    ao[c] = first + c;
                }
                for (int yy = ya; yy < yb; yy++)
                    for (int xx = xa; xx < xe; xx++) {
                        int32_t base = (yy * W + xx) * C;
                        const float *restrict xp = xb + base;
                        for (int c = 0; c < C; c++) {
                            int gt = xp[c] > yo[c];
                            yo[c] = gt ? xp[c] : yo[c];
                            ao[c] = gt ? base + c : ao[c];
                        }
                    }
            }
        }
    }
}

NN_HOT static float *pool_backward(const nn_layer_ *l, const int32_t *argmax, const float *g, float *other, int64_t B)
{
    if (!l->needs_dx) return NULL;
    if (l->sh == l->kh && l->sw == l->kw && l->oh * l->kh == l->ih && l->ow * l->kw == l->iw) {
        /* windows tile the input exactly: every input element is written once, no memset */
        const int C = l->cin, W = l->iw;
        for (int64_t b = 0; b < B; b++) {
            float *dx = other + b * l->n_in;
            const float *gb = g + b * l->n_out;
            const int32_t *ab = argmax + b * l->n_out;
            for (int oy = 0; oy < l->oh; oy++)
                for (int ox = 0; ox < l->ow; ox++) {
                    int64_t o = ((int64_t)oy * l->ow + ox) * C;
                    for (int i = 0; i < l->kh; i++)
                        for (int j = 0; j < l->kw; j++) {
                            int32_t base = ((oy * l->kh + i) * W + ox * l->kw + j) * C;
                            float *restrict d = dx + base;
                            for (int c = 0; c < C; c++) d[c] = ab[o + c] == base + c ? gb[o + c] : 0.f;
                        }
                }
        }
        return other;
    }
    memset(other, 0, (size_t)(B * l->n_in) * sizeof *other);
    for (int64_t b = 0; b < B; b++) {
        float *dx = other + b * l->n_in;
        const float *gb = g + b * l->n_out;
        const int32_t *ab = argmax + b * l->n_out;
        for (int64_t k = 0; k < l->n_out; k++) dx[ab[k]] += gb[k];
    }
    return other;
}

/* ---- dropout ---------------------------------------------------------------- */

/* Inverted dropout: element e of the batch is kept when word e of the Philox
 * stream keyed by (rng_key, layer index) is >= rate * 2^32, and scaled by
 * 1 / (1 - rate). The mask depends only on (key, layer, position in the
 * whole batch): a chunk starting at element e0 of the batch draws words
 * e0.. of the stream, so the mask does not depend on the chunking. */
NN_HOT static void dropout_forward(const nn_layer_ *l, int li, const float *restrict x, float *restrict y,
                                   uint8_t *restrict mk, int64_t e0, int64_t n, uint64_t rng_key)
{
    const double rate = l->spec.rate;
    const uint64_t key = loom_rng_mix(rng_key, (uint64_t)li);
    const uint64_t thr = (uint64_t)(rate * 4294967296.0);
    const float scale = (float)(1.0 / (1.0 - rate));
    uint32_t w[4];
    for (int64_t e = 0; e < n;) {
        int64_t ge = e0 + e, k0 = ge & 3, lim = 4 - k0 < n - e ? 4 - k0 : n - e;
        loom_philox4x32(key, (uint64_t)ge >> 2, w);
        for (int64_t k = 0; k < lim; k++) mk[e + k] = (uint64_t)w[k0 + k] >= thr;
        e += lim;
    }
    for (int64_t e = 0; e < n; e++) y[e] = mk[e] ? x[e] * scale : 0.f;
}

NN_HOT static float *dropout_backward(const nn_layer_ *l, const uint8_t *restrict mk, float *restrict g, int64_t n)
{
    const float scale = (float)(1.0 / (1.0 - l->spec.rate));
    for (int64_t e = 0; e < n; e++) g[e] = mk[e] ? g[e] * scale : 0.f;
    return g;
}

/* ---- dispatch ------------------------------------------------------------- */

void nn_layer_forward_(const loom_model *m, int li, nn_chunk_ *c, int training, uint64_t rng_key)
{
    const nn_layer_ *l = &m->layer[li];
    const int64_t B = c->B, row0 = c->b0 * l->n_out;
    const float *x = c->act[li];
    float *y = l->y ? l->y + row0 : NULL;
    c->act[li + 1] = y;
    switch (l->spec.kind) {
    case LOOM_LAYER_DENSE:
        dense_forward(m, l, x, y, B);
        break;
    case LOOM_LAYER_CONV2D:
        conv_forward(m, l, c, x, y);
        break;
    case LOOM_LAYER_MAX_POOL2D:
        pool_forward(l, x, y, l->argmax + row0, B);
        break;
    case LOOM_LAYER_DROPOUT:
        if (training && l->spec.rate > 0) dropout_forward(l, li, x, y, l->mask + row0, row0, B * l->n_out, rng_key);
        else c->act[li + 1] = x;
        break;
    case LOOM_LAYER_FLATTEN:
        c->act[li + 1] = x;
        break;
    case LOOM_LAYER_ACTIVATION:
        if (l->act == LOOM_ACT_NONE) {
            c->act[li + 1] = x;
        } else {
            memcpy(y, x, (size_t)(B * l->n_out) * sizeof *y);
            bias_act(y, NULL, B, l->n_out, l->act);
        }
        break;
    }
}

float *nn_layer_backward_(const loom_model *m, int li, nn_chunk_ *c, float *g, float *other)
{
    const nn_layer_ *l = &m->layer[li];
    const int64_t B = c->B, row0 = c->b0 * l->n_out;
    const float *x = c->act[li], *y = c->act[li + 1];
    switch (l->spec.kind) {
    case LOOM_LAYER_DENSE:
        return dense_backward(m, l, c, x, y, g, other);
    case LOOM_LAYER_CONV2D:
        return conv_backward(m, l, c, x, y, g, other);
    case LOOM_LAYER_MAX_POOL2D:
        return pool_backward(l, l->argmax + row0, g, other, B);
    case LOOM_LAYER_DROPOUT:
        if (y == x) return g;
        return dropout_backward(l, l->mask + row0, g, B * l->n_out);
    case LOOM_LAYER_FLATTEN:
        return g;
    case LOOM_LAYER_ACTIVATION:
        if (l->act != LOOM_ACT_NONE) act_grad_colsum(g, y, NULL, B, l->n_out, l->act);
        return g;
    }
    return NULL;
}

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
