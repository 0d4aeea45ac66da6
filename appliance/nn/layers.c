/* layers.c - forward and backward kernels of the layer kinds, and the
 * dispatch to every kind's: the conv2d family and the element-wise passes
 * here; dense.c, pooling.c, dropout.c, normalization.c and embedding.c hold
 * those families, losses.c the losses, kernel_internal.h what they share.
 * Each kernel works on one chunk of the batch (nn_chunk_) and may run
 * concurrently with the same kernel on other chunks: it reads the shared
 * parameters, writes only its chunk's rows and its chunk's gradient buffer.
 * Dense parameter gradients come after all chunks, over the whole batch.
 * Matrix work goes to loom_sgemm; element-wise work is
 * written as single fused passes over restrict pointers so gcc -O3
 * vectorises it: bias+activation after a product, activation gradient +
 * bias column sums before one, softmax + cross-entropy + its gradient.
 * Nothing here allocates; every buffer was sized at loom_model_new. */
#include "nn_internal.h"
#include "kernel_internal.h"

#include <float.h>
#include <math.h>
#include <string.h>

const char *nn_loc_str_(const loom_loc *l, char *buf, size_t n)
{
    if (!l->file[0]) snprintf(buf, n, "%s", "");
    else if (l->line > 0) snprintf(buf, n, "%s:%d", l->file, l->line);
    else snprintf(buf, n, "%s", l->file);
    return buf;
}

const char *nn_layer_kind_name_(loom_layer_kind k)
{
    return loom_layer_kind_name(k); /* config.c's names, the config's spelling */
}

const char *nn_activation_name_(loom_activation a)
{
    static const char *const names[] = {"none", "relu",       "sigmoid",  "tanh", "softmax", "leaky_relu",
                                        "gelu", "swish", "hard_swish", "softplus", "elu",  "silu"};
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
static inline LOOM_CLONE_BODY void bias_act_body(float *restrict y, const float *restrict b, int64_t rows, int64_t n,
                                                 loom_activation act)
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
LOOM_CLONES(, void, bias_act,
            (float *restrict y, const float *restrict b, int64_t rows, int64_t n, loom_activation act),
            (y, b, rows, n, act))

void nn_bias_act_(float *y, const float *b, int64_t rows, int64_t n, loom_activation act)
{
    bias_act(y, b, rows, n, act);
}

/* g (rows, n) *= act'(y) in place, and db = column sums of the result (db may
 * be NULL). One pass; db is overwritten, so the grads need no zeroing. */
static inline LOOM_CLONE_BODY void act_grad_colsum_body(float *restrict g, const float *restrict y, float *restrict db,
                                                        int64_t rows, int64_t n, loom_activation act)
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
LOOM_CLONES(, void, act_grad_colsum,
            (float *restrict g, const float *restrict y, float *restrict db, int64_t rows, int64_t n,
             loom_activation act),
            (g, y, db, rows, n, act))

/* dz (rows, n) = g * act'(y), out of place; one pass. */
static inline LOOM_CLONE_BODY void act_grad_to_body(float *restrict dz, const float *restrict g,
                                                    const float *restrict y, int64_t rows, int64_t n,
                                                    loom_activation act)
{
    switch (act) {
    case LOOM_ACT_RELU:
        for (int64_t e = 0; e < rows * n; e++) dz[e] = y[e] > 0.f ? g[e] : 0.f;
        break;
    case LOOM_ACT_SIGMOID:
        for (int64_t e = 0; e < rows * n; e++) dz[e] = g[e] * (y[e] * (1.f - y[e]));
        break;
    case LOOM_ACT_TANH:
        for (int64_t e = 0; e < rows * n; e++) dz[e] = g[e] * (1.f - y[e] * y[e]);
        break;
    case LOOM_ACT_SOFTMAX:
        memcpy(dz, g, (size_t)(rows * n) * sizeof *dz);
        act_grad_colsum(dz, y, NULL, rows, n, act);
        break;
    default: /* (dz may be g already: a batch normalization over the layer wrote there, bn_dx_dz) */
        if (dz != g) memcpy(dz, g, (size_t)(rows * n) * sizeof *dz);
        break;
    }
}
LOOM_CLONES(, void, act_grad_to,
            (float *restrict dz, const float *restrict g, const float *restrict y, int64_t rows, int64_t n,
             loom_activation act),
            (dz, g, y, rows, n, act))

void nn_layer_act_(const nn_layer_ *l, float *y, const float *b, int64_t rows, int64_t n)
{
    bias_act(y, b, rows, n, l->act); /* (the activations below: the bias alone) */
    if (!nn_act_needs_x_(l->act)) return;
    float *z = l->dz + (y - l->y);
    memcpy(z, y, (size_t)(rows * n) * sizeof *z);
    nn_act_apply_(l->act, z, y, rows * n);
}

void nn_layer_act_grad_(const nn_layer_ *l, float *dz, const float *g, const float *y, int64_t rows, int64_t n)
{
    if (nn_act_needs_x_(l->act)) nn_act_grad_x_(l->act, dz, g, dz, rows * n);
    else act_grad_to(dz, g, y, rows, n, l->act);
}

/* ---- conv2d: batch-chunked im2col + sgemm --------------------------------- */

/* col (nb*OH*OW, KH*KW*C), columns in kernel order (i, j, c), from x (nb, H, W, C). */
static inline LOOM_CLONE_BODY void im2col_body(const nn_layer_ *l, const float *restrict x, int64_t nb,
                                               float *restrict col)
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
                    /* columns [ja, jb) of the kernel row fall inside the image: one copy, zeros around it */
                    int ja = x0 < 0 ? (-x0 < KW ? -x0 : KW) : 0, jb = x0 + KW > W ? W - x0 : KW;
                    if (jb < ja) jb = ja;
                    zero_short(dst, ja * C);
                    copy_short(dst + ja * C, src + (int64_t)(x0 + ja) * C, (jb - ja) * C);
                    zero_short(dst + jb * C, (KW - jb) * C);
                }
            }
        }
    }
}
LOOM_CLONES(__attribute__((optimize("no-tree-loop-distribute-patterns"))), void, im2col,
            (const nn_layer_ *l, const float *restrict x, int64_t nb, float *restrict col), (l, x, nb, col))

/* dx (nb, H, W, C) += col2im(col); dx must be zeroed by the caller. */
static inline LOOM_CLONE_BODY void col2im_body(const nn_layer_ *l, const float *restrict col, int64_t nb,
                                               float *restrict dx)
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
LOOM_CLONES(, void, col2im, (const nn_layer_ *l, const float *restrict col, int64_t nb, float *restrict dx),
            (l, col, nb, dx))

/* ---- conv2d with one input channel: direct ----------------------------------
 * With cin = 1 an im2col row is kh*kw scalars: the product has K = kh*kw (25)
 * and im2col writes, and BLAS packs, kh*kw floats per output pixel. Direct
 * loops over a zero-padded copy of the example instead: each output pixel's
 * channels (16 at a time) stay in registers over the kh*kw taps, four pixels
 * at once so the multiply-adds do not wait on each other. */

/* xp (Hp, Wp) = x (H, W) with the layer's zero padding around it. */
static void pad_plane(const nn_layer_ *l, const float *restrict x, float *restrict xp, int Hp, int Wp)
{
    for (int r = 0; r < Hp; r++) {
        int yy = r - l->pad_t;
        float *restrict d = xp + (int64_t)r * Wp;
        for (int q = 0; q < Wp; q++) {
            int xx = q - l->pad_l;
            d[q] = yy >= 0 && yy < l->ih && xx >= 0 && xx < l->iw ? x[(int64_t)yy * l->iw + xx] : 0.f;
        }
    }
}

static void plane_dims(const nn_layer_ *l, int *Hp, int *Wp)
{
    *Hp = (l->oh - 1) * l->sh + l->kh;
    *Wp = (l->ow - 1) * l->sw + l->kw;
}

/* Output channels go in blocks of 16 (NN_CB) held in registers across the
 * taps; a last partial block goes element-wise. */

/* y (nb, OH, OW, cout) = conv(x) + b for cin = 1 (activation left to the
 * caller); scratch xp holds Hp*Wp floats. */
static inline LOOM_CLONE_BODY void conv1_forward_body(const nn_layer_ *l, const float *restrict Wt,
                                                      const float *restrict bias, const float *restrict x,
                                                      float *restrict y, int64_t nb, float *restrict xp)
{
    int Hp, Wp;
    plane_dims(l, &Hp, &Wp);
    const int OH = l->oh, OW = l->ow, CO = l->cout, KH = l->kh, KW = l->kw, SH = l->sh, SW = l->sw;
    const int CB = CO - CO % NN_CB;
    for (int64_t b = 0; b < nb; b++) {
        pad_plane(l, x + b * l->n_in, xp, Hp, Wp);
        for (int oy = 0; oy < OH; oy++)
            for (int ox = 0; ox < OW; ox++) {
                float *restrict yp = y + ((b * OH + oy) * OW + ox) * (int64_t)CO;
                const float *restrict x0 = xp + (int64_t)oy * SH * Wp + (int64_t)ox * SW;
                /* four pixels at a time: four independent sums hide the FMA latency */
                if (ox + 4 <= OW) {
                    for (int c0 = 0; c0 < CB; c0 += NN_CB) {
                        nn_v16_ a0 = bias ? *(const nn_v16_ *)(bias + c0) : (nn_v16_){0}, a1 = a0, a2 = a0, a3 = a0;
                        for (int i = 0; i < KH; i++)
                            for (int j = 0; j < KW; j++) {
                                const float *xv = x0 + i * Wp + j;
                                nn_v16_ w = *(const nn_v16_ *)(Wt + (i * KW + j) * CO + c0);
                                a0 += xv[0] * w;
                                a1 += xv[SW] * w;
                                a2 += xv[2 * SW] * w;
                                a3 += xv[3 * SW] * w;
                            }
                        *(nn_v16_ *)(yp + c0) = a0;
                        *(nn_v16_ *)(yp + CO + c0) = a1;
                        *(nn_v16_ *)(yp + 2 * CO + c0) = a2;
                        *(nn_v16_ *)(yp + 3 * CO + c0) = a3;
                    }
                    for (int q = 0; q < 4; q++)
                        for (int co = CB; co < CO; co++) {
                            float a = bias ? bias[co] : 0.f;
                            for (int i = 0; i < KH; i++)
                                for (int j = 0; j < KW; j++) a += x0[i * Wp + j + q * SW] * Wt[(i * KW + j) * CO + co];
                            yp[q * CO + co] = a;
                        }
                    ox += 3;
                    continue;
                }
                for (int c0 = 0; c0 < CB; c0 += NN_CB) {
                    nn_v16_ acc = bias ? *(const nn_v16_ *)(bias + c0) : (nn_v16_){0};
                    for (int i = 0; i < KH; i++)
                        for (int j = 0; j < KW; j++)
                            acc += x0[i * Wp + j] * *(const nn_v16_ *)(Wt + (i * KW + j) * CO + c0);
                    *(nn_v16_ *)(yp + c0) = acc;
                }
                for (int co = CB; co < CO; co++) {
                    float a = bias ? bias[co] : 0.f;
                    for (int i = 0; i < KH; i++)
                        for (int j = 0; j < KW; j++) a += x0[i * Wp + j] * Wt[(i * KW + j) * CO + co];
                    yp[co] = a;
                }
            }
    }
}
LOOM_CLONES(, void, conv1_forward,
            (const nn_layer_ *l, const float *restrict Wt, const float *restrict bias, const float *restrict x,
             float *restrict y, int64_t nb, float *restrict xp),
            (l, Wt, bias, x, y, nb, xp))

/* dW taps [t0, t1) (of kh*kw; each cout wide) = sum over the examples and
 * pixels of x * dz: per output row a sum over its pixels, added to the
 * example's sum in acc, added to dW in example order; scratch xp holds
 * Hp*Wp floats. A tap's sums do not depend on the other taps, so any split
 * of the taps gives the same bits. */
static inline LOOM_CLONE_BODY void conv1_kernel_grad_body(const nn_layer_ *l, const float *restrict x,
                                                          const float *restrict dz, int64_t nb, int t0, int t1,
                                                          float *restrict dW, float *restrict xp, float *restrict acc)
{
    int Hp, Wp;
    plane_dims(l, &Hp, &Wp);
    const int OH = l->oh, OW = l->ow, CO = l->cout, KW = l->kw, SH = l->sh, SW = l->sw;
    const int CB = CO - CO % NN_CB;
    const int64_t n = (int64_t)(t1 - t0) * CO;
    for (int64_t e = 0; e < n; e++) dW[(int64_t)t0 * CO + e] = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        pad_plane(l, x + b * l->n_in, xp, Hp, Wp);
        for (int64_t e = 0; e < n; e++) acc[e] = 0.f;
        for (int oy = 0; oy < OH; oy++) {
            const float *restrict gr = dz + (b * OH + oy) * (int64_t)OW * CO;
            for (int tap = t0; tap < t1; tap++) {
                const int i = tap / KW, j = tap % KW;
                const float *restrict xr = xp + (int64_t)(oy * SH + i) * Wp + j;
                float *restrict at = acc + (int64_t)(tap - t0) * CO;
                for (int c0 = 0; c0 < CB; c0 += NN_CB) {
                    /* four partial sums (pixel mod 4) hide the FMA latency */
                    nn_v16_ s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
                    int ox = 0;
                    for (; ox + 4 <= OW; ox += 4) {
                        const float *gp = gr + ox * CO + c0, *xv = xr + ox * SW;
                        s0 += xv[0] * *(const nn_v16_ *)gp;
                        s1 += xv[SW] * *(const nn_v16_ *)(gp + CO);
                        s2 += xv[2 * SW] * *(const nn_v16_ *)(gp + 2 * CO);
                        s3 += xv[3 * SW] * *(const nn_v16_ *)(gp + 3 * CO);
                    }
                    for (; ox < OW; ox++) s0 += xr[ox * SW] * *(const nn_v16_ *)(gr + ox * CO + c0);
                    *(nn_v16_ *)(at + c0) += (s0 + s1) + (s2 + s3);
                }
                for (int co = CB; co < CO; co++) {
                    float a = 0.f;
                    for (int ox = 0; ox < OW; ox++) a += xr[ox * SW] * gr[ox * CO + co];
                    at[co] += a;
                }
            }
        }
        for (int64_t e = 0; e < n; e++) dW[(int64_t)t0 * CO + e] += acc[e];
    }
}
LOOM_CLONES(, void, conv1_kernel_grad,
            (const nn_layer_ *l, const float *restrict x, const float *restrict dz, int64_t nb, int t0, int t1,
             float *restrict dW, float *restrict xp, float *restrict acc),
            (l, x, dz, nb, t0, t1, dW, xp, acc))

/* ---- the same two kernels with explicit FMA (AVX2 + FMA) --------------------
 * The build keeps -ffp-contract=off (a multiply-add is fused only where the
 * code says so, so the bits do not depend on the compiler's mood), which
 * leaves the generic kernels above a multiply and an add per tap. These say
 * fused multiply-add explicitly: one rounding per tap, the same loops and
 * summation order as above, so a split of the taps or the batch still gives
 * the same bits. Chosen at model build from the CPU's features
 * (loom_cpu()->level >= LOOM_CPU_AVX2_FMA, nn_layer_.fma); AVX-512 CPUs run
 * the 512-bit kernels below, which give the same bits. */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define NN_FMA_TARGET __attribute__((target("avx2,fma")))

NN_FMA_TARGET static void conv1_forward_fma(const nn_layer_ *l, const float *restrict Wt, const float *restrict bias,
                                            const float *restrict x, float *restrict y, int64_t nb, float *restrict xp)
{
    int Hp, Wp;
    plane_dims(l, &Hp, &Wp);
    const int OH = l->oh, OW = l->ow, CO = l->cout, KH = l->kh, KW = l->kw, SH = l->sh, SW = l->sw;
    const int CB = CO - CO % NN_CB;
    for (int64_t b = 0; b < nb; b++) {
        pad_plane(l, x + b * l->n_in, xp, Hp, Wp);
        for (int oy = 0; oy < OH; oy++)
            for (int ox = 0; ox < OW; ox++) {
                float *restrict yp = y + ((b * OH + oy) * OW + ox) * (int64_t)CO;
                const float *restrict x0 = xp + (int64_t)oy * SH * Wp + (int64_t)ox * SW;
                int q = ox + 4 <= OW ? 4 : 1; /* pixels done together */
                for (int c0 = 0; c0 < CB; c0 += NN_CB) {
                    __m256 lo = bias ? _mm256_loadu_ps(bias + c0) : _mm256_setzero_ps();
                    __m256 hi = bias ? _mm256_loadu_ps(bias + c0 + 8) : _mm256_setzero_ps();
                    __m256 a0 = lo, a1 = lo, a2 = lo, a3 = lo, b0 = hi, b1 = hi, b2 = hi, b3 = hi;
                    for (int i = 0; i < KH; i++)
                        for (int j = 0; j < KW; j++) {
                            const float *xv = x0 + i * Wp + j;
                            const float *wp = Wt + (i * KW + j) * CO + c0;
                            __m256 wl = _mm256_loadu_ps(wp), wh = _mm256_loadu_ps(wp + 8);
                            __m256 v = _mm256_broadcast_ss(xv);
                            a0 = _mm256_fmadd_ps(v, wl, a0);
                            b0 = _mm256_fmadd_ps(v, wh, b0);
                            if (q == 4) {
                                v = _mm256_broadcast_ss(xv + SW);
                                a1 = _mm256_fmadd_ps(v, wl, a1);
                                b1 = _mm256_fmadd_ps(v, wh, b1);
                                v = _mm256_broadcast_ss(xv + 2 * SW);
                                a2 = _mm256_fmadd_ps(v, wl, a2);
                                b2 = _mm256_fmadd_ps(v, wh, b2);
                                v = _mm256_broadcast_ss(xv + 3 * SW);
                                a3 = _mm256_fmadd_ps(v, wl, a3);
                                b3 = _mm256_fmadd_ps(v, wh, b3);
                            }
                        }
                    _mm256_storeu_ps(yp + c0, a0);
                    _mm256_storeu_ps(yp + c0 + 8, b0);
                    if (q == 4) {
                        _mm256_storeu_ps(yp + CO + c0, a1);
                        _mm256_storeu_ps(yp + CO + c0 + 8, b1);
                        _mm256_storeu_ps(yp + 2 * CO + c0, a2);
                        _mm256_storeu_ps(yp + 2 * CO + c0 + 8, b2);
                        _mm256_storeu_ps(yp + 3 * CO + c0, a3);
                        _mm256_storeu_ps(yp + 3 * CO + c0 + 8, b3);
                    }
                }
                for (int p = 0; p < q; p++)
                    for (int co = CB; co < CO; co++) {
                        float a = bias ? bias[co] : 0.f;
                        for (int i = 0; i < KH; i++)
                            for (int j = 0; j < KW; j++)
                                a = __builtin_fmaf(x0[i * Wp + j + p * SW], Wt[(i * KW + j) * CO + co], a);
                        yp[p * CO + co] = a;
                    }
                ox += q - 1;
            }
    }
}

NN_FMA_TARGET static void conv1_kernel_grad_fma(const nn_layer_ *l, const float *restrict x, const float *restrict dz,
                                                int64_t nb, int t0, int t1, float *restrict dW, float *restrict xp,
                                                float *restrict acc)
{
    int Hp, Wp;
    plane_dims(l, &Hp, &Wp);
    const int OH = l->oh, OW = l->ow, CO = l->cout, KW = l->kw, SH = l->sh, SW = l->sw;
    const int CB = CO - CO % NN_CB;
    const int64_t n = (int64_t)(t1 - t0) * CO;
    for (int64_t e = 0; e < n; e++) dW[(int64_t)t0 * CO + e] = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        pad_plane(l, x + b * l->n_in, xp, Hp, Wp);
        for (int64_t e = 0; e < n; e++) acc[e] = 0.f;
        for (int oy = 0; oy < OH; oy++) {
            const float *restrict gr = dz + (b * OH + oy) * (int64_t)OW * CO;
            for (int tap = t0; tap < t1; tap++) {
                const int i = tap / KW, j = tap % KW;
                const float *restrict xr = xp + (int64_t)(oy * SH + i) * Wp + j;
                float *restrict at = acc + (int64_t)(tap - t0) * CO;
                for (int c0 = 0; c0 < CB; c0 += NN_CB) {
                    /* four partial sums (pixel mod 4), as the generic kernel keeps them */
                    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, h0 = s0, h1 = s0, h2 = s0, h3 = s0;
                    int ox = 0;
                    for (; ox + 4 <= OW; ox += 4) {
                        const float *gp = gr + ox * CO + c0, *xv = xr + ox * SW;
                        __m256 v = _mm256_broadcast_ss(xv);
                        s0 = _mm256_fmadd_ps(v, _mm256_loadu_ps(gp), s0);
                        h0 = _mm256_fmadd_ps(v, _mm256_loadu_ps(gp + 8), h0);
                        v = _mm256_broadcast_ss(xv + SW);
                        s1 = _mm256_fmadd_ps(v, _mm256_loadu_ps(gp + CO), s1);
                        h1 = _mm256_fmadd_ps(v, _mm256_loadu_ps(gp + CO + 8), h1);
                        v = _mm256_broadcast_ss(xv + 2 * SW);
                        s2 = _mm256_fmadd_ps(v, _mm256_loadu_ps(gp + 2 * CO), s2);
                        h2 = _mm256_fmadd_ps(v, _mm256_loadu_ps(gp + 2 * CO + 8), h2);
                        v = _mm256_broadcast_ss(xv + 3 * SW);
                        s3 = _mm256_fmadd_ps(v, _mm256_loadu_ps(gp + 3 * CO), s3);
                        h3 = _mm256_fmadd_ps(v, _mm256_loadu_ps(gp + 3 * CO + 8), h3);
                    }
                    for (; ox < OW; ox++) {
                        __m256 v = _mm256_broadcast_ss(xr + ox * SW);
                        s0 = _mm256_fmadd_ps(v, _mm256_loadu_ps(gr + ox * CO + c0), s0);
                        h0 = _mm256_fmadd_ps(v, _mm256_loadu_ps(gr + ox * CO + c0 + 8), h0);
                    }
                    __m256 sl = _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3));
                    __m256 sh = _mm256_add_ps(_mm256_add_ps(h0, h1), _mm256_add_ps(h2, h3));
                    _mm256_storeu_ps(at + c0, _mm256_add_ps(_mm256_loadu_ps(at + c0), sl));
                    _mm256_storeu_ps(at + c0 + 8, _mm256_add_ps(_mm256_loadu_ps(at + c0 + 8), sh));
                }
                for (int co = CB; co < CO; co++) {
                    float a = 0.f;
                    for (int ox = 0; ox < OW; ox++) a = __builtin_fmaf(xr[ox * SW], gr[ox * CO + co], a);
                    at[co] += a;
                }
            }
        }
        for (int64_t e = 0; e < n; e++) dW[(int64_t)t0 * CO + e] += acc[e];
    }
}

/* The same two kernels 512 bits wide (l->fma == 2: the CPU has the AVX-512
 * subset, loom_cpu()->level): a lane computes exactly what the lane of the
 * 256-bit kernel above computes (the same fused multiply-adds in the same
 * order, the same partial sums by pixel mod 4), so the bits are those of the
 * AVX2 kernels; two blocks of 16 channels go together, so eight sums are in
 * flight, as in the 256-bit kernels. */
#define NN_512_TARGET __attribute__((target("avx512f,avx2,fma")))

NN_512_TARGET static void conv1_forward_512(const nn_layer_ *l, const float *restrict Wt, const float *restrict bias,
                                            const float *restrict x, float *restrict y, int64_t nb, float *restrict xp)
{
    int Hp, Wp;
    plane_dims(l, &Hp, &Wp);
    const int OH = l->oh, OW = l->ow, CO = l->cout, KH = l->kh, KW = l->kw, SH = l->sh, SW = l->sw;
    const int CB = CO - CO % NN_CB;
    for (int64_t b = 0; b < nb; b++) {
        pad_plane(l, x + b * l->n_in, xp, Hp, Wp);
        for (int oy = 0; oy < OH; oy++)
            for (int ox = 0; ox < OW; ox++) {
                float *restrict yp = y + ((b * OH + oy) * OW + ox) * (int64_t)CO;
                const float *restrict x0 = xp + (int64_t)oy * SH * Wp + (int64_t)ox * SW;
                int q = ox + 4 <= OW ? 4 : 1; /* pixels done together */
                for (int c0 = 0; c0 < CB; c0 += 2 * NN_CB) {
                    const int two = c0 + NN_CB < CB; /* a second block of 16 channels */
                    const int c1 = two ? c0 + NN_CB : c0;
                    __m512 lo = bias ? _mm512_loadu_ps(bias + c0) : _mm512_setzero_ps();
                    __m512 hi = bias ? _mm512_loadu_ps(bias + c1) : _mm512_setzero_ps();
                    __m512 a0 = lo, a1 = lo, a2 = lo, a3 = lo, b0 = hi, b1 = hi, b2 = hi, b3 = hi;
                    for (int i = 0; i < KH; i++)
                        for (int j = 0; j < KW; j++) {
                            const float *xv = x0 + i * Wp + j;
                            const float *wp = Wt + (i * KW + j) * CO;
                            __m512 wl = _mm512_loadu_ps(wp + c0), wh = _mm512_loadu_ps(wp + c1);
                            __m512 v = _mm512_set1_ps(xv[0]);
                            a0 = _mm512_fmadd_ps(v, wl, a0);
                            b0 = _mm512_fmadd_ps(v, wh, b0);
                            if (q == 4) {
                                v = _mm512_set1_ps(xv[SW]);
                                a1 = _mm512_fmadd_ps(v, wl, a1);
                                b1 = _mm512_fmadd_ps(v, wh, b1);
                                v = _mm512_set1_ps(xv[2 * SW]);
                                a2 = _mm512_fmadd_ps(v, wl, a2);
                                b2 = _mm512_fmadd_ps(v, wh, b2);
                                v = _mm512_set1_ps(xv[3 * SW]);
                                a3 = _mm512_fmadd_ps(v, wl, a3);
                                b3 = _mm512_fmadd_ps(v, wh, b3);
                            }
                        }
                    _mm512_storeu_ps(yp + c0, a0);
                    _mm512_storeu_ps(yp + c1, b0);
                    if (q == 4) {
                        _mm512_storeu_ps(yp + CO + c0, a1);
                        _mm512_storeu_ps(yp + CO + c1, b1);
                        _mm512_storeu_ps(yp + 2 * CO + c0, a2);
                        _mm512_storeu_ps(yp + 2 * CO + c1, b2);
                        _mm512_storeu_ps(yp + 3 * CO + c0, a3);
                        _mm512_storeu_ps(yp + 3 * CO + c1, b3);
                    }
                }
                for (int p = 0; p < q; p++)
                    for (int co = CB; co < CO; co++) {
                        float a = bias ? bias[co] : 0.f;
                        for (int i = 0; i < KH; i++)
                            for (int j = 0; j < KW; j++)
                                a = __builtin_fmaf(x0[i * Wp + j + p * SW], Wt[(i * KW + j) * CO + co], a);
                        yp[p * CO + co] = a;
                    }
                ox += q - 1;
            }
    }
}

NN_512_TARGET static void conv1_kernel_grad_512(const nn_layer_ *l, const float *restrict x, const float *restrict dz,
                                                int64_t nb, int t0, int t1, float *restrict dW, float *restrict xp,
                                                float *restrict acc)
{
    int Hp, Wp;
    plane_dims(l, &Hp, &Wp);
    const int OH = l->oh, OW = l->ow, CO = l->cout, KW = l->kw, SH = l->sh, SW = l->sw;
    const int CB = CO - CO % NN_CB;
    const int64_t n = (int64_t)(t1 - t0) * CO;
    for (int64_t e = 0; e < n; e++) dW[(int64_t)t0 * CO + e] = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        pad_plane(l, x + b * l->n_in, xp, Hp, Wp);
        for (int64_t e = 0; e < n; e++) acc[e] = 0.f;
        for (int oy = 0; oy < OH; oy++) {
            const float *restrict gr = dz + (b * OH + oy) * (int64_t)OW * CO;
            for (int tap = t0; tap < t1; tap++) {
                const int i = tap / KW, j = tap % KW;
                const float *restrict xr = xp + (int64_t)(oy * SH + i) * Wp + j;
                float *restrict at = acc + (int64_t)(tap - t0) * CO;
                for (int c0 = 0; c0 < CB; c0 += 2 * NN_CB) {
                    const int c1 = c0 + NN_CB < CB ? c0 + NN_CB : c0; /* a second block, or the first again */
                    /* four partial sums (pixel mod 4) per block, as the 256-bit kernel keeps them */
                    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, h0 = s0, h1 = s0, h2 = s0, h3 = s0;
                    int ox = 0;
                    for (; ox + 4 <= OW; ox += 4) {
                        const float *gp = gr + ox * CO, *xv = xr + ox * SW;
                        __m512 v = _mm512_set1_ps(xv[0]);
                        s0 = _mm512_fmadd_ps(v, _mm512_loadu_ps(gp + c0), s0);
                        h0 = _mm512_fmadd_ps(v, _mm512_loadu_ps(gp + c1), h0);
                        v = _mm512_set1_ps(xv[SW]);
                        s1 = _mm512_fmadd_ps(v, _mm512_loadu_ps(gp + CO + c0), s1);
                        h1 = _mm512_fmadd_ps(v, _mm512_loadu_ps(gp + CO + c1), h1);
                        v = _mm512_set1_ps(xv[2 * SW]);
                        s2 = _mm512_fmadd_ps(v, _mm512_loadu_ps(gp + 2 * CO + c0), s2);
                        h2 = _mm512_fmadd_ps(v, _mm512_loadu_ps(gp + 2 * CO + c1), h2);
                        v = _mm512_set1_ps(xv[3 * SW]);
                        s3 = _mm512_fmadd_ps(v, _mm512_loadu_ps(gp + 3 * CO + c0), s3);
                        h3 = _mm512_fmadd_ps(v, _mm512_loadu_ps(gp + 3 * CO + c1), h3);
                    }
                    for (; ox < OW; ox++) {
                        __m512 v = _mm512_set1_ps(xr[ox * SW]);
                        s0 = _mm512_fmadd_ps(v, _mm512_loadu_ps(gr + ox * CO + c0), s0);
                        h0 = _mm512_fmadd_ps(v, _mm512_loadu_ps(gr + ox * CO + c1), h0);
                    }
                    __m512 sl = _mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3));
                    __m512 sh = _mm512_add_ps(_mm512_add_ps(h0, h1), _mm512_add_ps(h2, h3));
                    _mm512_storeu_ps(at + c0, _mm512_add_ps(_mm512_loadu_ps(at + c0), sl));
                    if (c1 != c0) _mm512_storeu_ps(at + c1, _mm512_add_ps(_mm512_loadu_ps(at + c1), sh));
                }
                for (int co = CB; co < CO; co++) {
                    float a = 0.f;
                    for (int ox = 0; ox < OW; ox++) a = __builtin_fmaf(xr[ox * SW], gr[ox * CO + co], a);
                    at[co] += a;
                }
            }
        }
        for (int64_t e = 0; e < n; e++) dW[(int64_t)t0 * CO + e] += acc[e];
    }
}
#define NN_HAVE_FMA 1
#else
#define NN_HAVE_FMA 0
#endif

/* col (nb*OH*OW, k1 - k0): columns [k0, k1) of im2col's (i, j, c) order. */
/* A kernel row's columns are KW*C floats of one image row, contiguous where
 * the window lies inside the image: as im2col, one copy per kernel row (of
 * its columns inside [k0, k1)) with zeros around it, not one call per tap. */
static inline LOOM_CLONE_BODY void im2col_cols_body(const nn_layer_ *l, const float *restrict x, int64_t nb, int64_t k0,
                                                    int64_t k1, float *restrict col)
{
    const int H = l->ih, W = l->iw, C = l->cin, OH = l->oh, OW = l->ow, KH = l->kh, KW = l->kw;
    const int64_t w = k1 - k0, RW = (int64_t)KW * C; /* a kernel row's columns */
    const int i0 = (int)(k0 / RW), i1 = (int)((k1 - 1) / RW) + 1 < KH ? (int)((k1 - 1) / RW) + 1 : KH;
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * (int64_t)H * W * C;
        for (int oy = 0; oy < OH; oy++)
            for (int ox = 0; ox < OW; ox++) {
                float *restrict row = col + ((b * OH + oy) * OW + ox) * w;
                int y0 = oy * l->sh - l->pad_t, x0 = ox * l->sw - l->pad_l;
                /* columns [ja*C, jb*C) of a kernel row fall inside the image */
                int ja = x0 < 0 ? (-x0 < KW ? -x0 : KW) : 0, jb = x0 + KW > W ? W - x0 : KW;
                if (jb < ja) jb = ja;
                for (int i = i0; i < i1; i++) {
                    int64_t r0 = (int64_t)i * RW, a = k0 > r0 ? k0 - r0 : 0, e = k1 < r0 + RW ? k1 - r0 : RW;
                    float *restrict d = row + (r0 + a - k0); /* columns [a, e) of kernel row i */
                    int yy = y0 + i;
                    if (yy < 0 || yy >= H) {
                        zero_short(d, (int)(e - a));
                        continue;
                    }
                    int64_t va = (int64_t)ja * C > a ? (int64_t)ja * C : a, vb = (int64_t)jb * C < e ? (int64_t)jb * C : e;
                    if (vb < va) vb = va;
                    zero_short(d, (int)(va - a));
                    copy_short(d + (va - a), xb + (((int64_t)yy * W + x0) * C + va), (int)(vb - va));
                    zero_short(d + (vb - a), (int)(e - vb));
                }
            }
    }
}
LOOM_CLONES(__attribute__((optimize("no-tree-loop-distribute-patterns"))), void, im2col_cols,
            (const nn_layer_ *l, const float *restrict x, int64_t nb, int64_t k0, int64_t k1, float *restrict col),
            (l, x, nb, k0, k1, col))

static int conv_is_pointwise(const nn_layer_ *l) { return nn_conv_pointwise_(l); }

/* ---- conv2d + max_pool2d in one pass (nn_internal.h: fuse_pool) -------------- */

/* Pool p over the conv's pre-activation z (nb examples of the conv's output):
 * each window's max (the first of equal ones in (i, j) order, as
 * pool_forward), then + bias (NULL: already in z) and the activation (relu or
 * none) into y, its position into argmax; rows (nb, p->n_out) each. */
static inline LOOM_CLONE_BODY void pool_fused_forward_body(const nn_layer_ *p, const float *restrict bias,
                                                           loom_activation act, const float *restrict z,
                                                           float *restrict y, int32_t *restrict argmax, int64_t nb)
{
    const int W = p->iw, C = p->cin, OH = p->oh, OW = p->ow, KH = p->kh, KW = p->kw;
    const int relu = act == LOOM_ACT_RELU;
    for (int64_t b = 0; b < nb; b++) {
        const float *zb = z + b * p->n_in;
        for (int oy = 0; oy < OH; oy++)
            for (int ox = 0; ox < OW; ox++) {
                const int64_t o = b * p->n_out + ((int64_t)oy * OW + ox) * C;
                float *restrict yo = y + o;
                int32_t *restrict ao = argmax + o;
                const int32_t p0 = (oy * KH * W + ox * KW) * C;
                if (KH == 2 && KW == 2) { /* the usual case, unrolled */
                    const int32_t p1 = p0 + C, p2 = p0 + W * C, p3 = p2 + C;
                    const float *restrict x0 = zb + p0, *restrict x1 = zb + p1, *restrict x2 = zb + p2,
                                          *restrict x3 = zb + p3;
                    for (int c = 0; c < C; c++) {
                        float v = x0[c];
                        int32_t a = p0 + c;
                        if (x1[c] > v) v = x1[c], a = p1 + c;
                        if (x2[c] > v) v = x2[c], a = p2 + c;
                        if (x3[c] > v) v = x3[c], a = p3 + c;
                        yo[c] = v;
                        ao[c] = a;
                    }
                } else {
                    for (int c = 0; c < C; c++) {
                        yo[c] = zb[p0 + c];
                        ao[c] = p0 + c;
                    }
                    for (int i = 0; i < KH; i++)
                        for (int j = 0; j < KW; j++) {
                            const int32_t base = p0 + (i * W + j) * C;
                            const float *restrict xp = zb + base;
                            for (int c = 0; c < C; c++) {
                                int gt = xp[c] > yo[c];
                                yo[c] = gt ? xp[c] : yo[c];
                                ao[c] = gt ? base + c : ao[c];
                            }
                        }
                }
                if (bias)
                    for (int c = 0; c < C; c++) yo[c] += bias[c];
                if (relu)
                    for (int c = 0; c < C; c++) yo[c] = yo[c] > 0.f ? yo[c] : 0.f;
            }
    }
}
LOOM_CLONES(, void, pool_fused_forward,
            (const nn_layer_ *p, const float *restrict bias, loom_activation act, const float *restrict z,
             float *restrict y, int32_t *restrict argmax, int64_t nb),
            (p, bias, act, z, y, argmax, nb))

/* The fused pool's backward on B examples: gm (B, p->n_out) = g where the
 * pooled output y passed the ReLU (all of g without one), and the conv's dz
 * (B, p->n_in) = gm at each window's maximum, zero elsewhere: the windows
 * tile the conv's output, so every element is written once. */
static inline LOOM_CLONE_BODY void pool_fused_backward_body(const nn_layer_ *p, loom_activation act,
                                                            const float *restrict y, const int32_t *restrict argmax,
                                                            const float *restrict g, float *restrict gm,
                                                            float *restrict dz, int64_t B)
{
    const int C = p->cin, W = p->iw, KH = p->kh, KW = p->kw;
    const int64_t n = B * p->n_out;
    if (act == LOOM_ACT_RELU)
        for (int64_t e = 0; e < n; e++) gm[e] = y[e] > 0.f ? g[e] : 0.f;
    else
        memcpy(gm, g, (size_t)n * sizeof *gm);
    for (int64_t b = 0; b < B; b++) {
        float *dzb = dz + b * p->n_in;
        const float *gb = gm + b * p->n_out;
        const int32_t *ab = argmax + b * p->n_out;
        for (int oy = 0; oy < p->oh; oy++)
            for (int ox = 0; ox < p->ow; ox++) {
                const int64_t o = ((int64_t)oy * p->ow + ox) * C;
                for (int i = 0; i < KH; i++)
                    for (int j = 0; j < KW; j++) {
                        const int32_t base = ((oy * KH + i) * W + ox * KW + j) * C;
                        float *restrict d = dzb + base;
                        for (int c = 0; c < C; c++) d[c] = ab[o + c] == base + c ? gb[o + c] : 0.f;
                    }
            }
    }
}
LOOM_CLONES(, void, pool_fused_backward,
            (const nn_layer_ *p, loom_activation act, const float *restrict y, const int32_t *restrict argmax,
             const float *restrict g, float *restrict gm, float *restrict dz, int64_t B),
            (p, act, y, argmax, g, gm, dz, B))

static void conv_forward(const loom_model *m, const nn_layer_ *l, nn_chunk_ *c, const float *x, float *yc)
{
    const int64_t B = c->B;
    const float *W = m->params + l->kernel_off;
    const float *bias = l->bias_off >= 0 ? m->params + l->bias_off : NULL;
    const int64_t K = (int64_t)l->kh * l->kw * l->cin, P = (int64_t)l->oh * l->ow;
    const nn_layer_ *p = l->fuse_pool ? l + 1 : NULL; /* the fused pool, its rows of this chunk */
    float *py = p ? p->y + c->b0 * p->n_out : NULL;
    int32_t *pa = p ? p->argmax + c->b0 * p->n_out : NULL;
    if (l->cin == 1 && !conv_is_pointwise(l)) {
        /* fused: one example at a time, pooled while its output is in cache */
        for (int64_t b0 = 0, nb = p ? 1 : B; b0 < B; b0 += nb) {
#if NN_HAVE_FMA
            if (l->fma == 2) conv1_forward_512(l, W, bias, x + b0 * l->n_in, yc + b0 * l->n_out, nb, c->col);
            else if (l->fma) conv1_forward_fma(l, W, bias, x + b0 * l->n_in, yc + b0 * l->n_out, nb, c->col);
            else
#endif
                conv1_forward(l, W, bias, x + b0 * l->n_in, yc + b0 * l->n_out, nb, c->col);
            if (p) pool_fused_forward(p, NULL, l->act, yc + b0 * l->n_out, py + b0 * p->n_out, pa + b0 * p->n_out, nb);
        }
        if (!p && l->act != LOOM_ACT_NONE) bias_act(yc, NULL, B * P, l->cout, l->act);
        return;
    }
    if (nn_convw_ok_(l)) nn_convw_kernel_(l, W, c->col); /* once for all chunks */
    for (int64_t b0 = 0; b0 < B; b0 += l->chunk) {
        int64_t nb = B - b0 < l->chunk ? B - b0 : l->chunk;
        const float *col = x + b0 * l->n_in;
        float *y = yc + b0 * l->n_out;
        if (nn_convs_ok_(l)) { /* 2-4 channels in, direct (conv_stem.c) */
            nn_convs_forward_(l, W, x + b0 * l->n_in, y, nb);
            bias_act(y, bias, nb * P, l->cout, l->act);
            continue;
        }
        if (nn_conv3_ok_(l) && !nn_convw_ok_(l)) { /* 3x3, stride 1 or 2, direct (conv_fast.c) */
            nn_conv3_forward_(l, W, x + b0 * l->n_in, y, nb, c->col);
            bias_act(y, bias, nb * P, l->cout, l->act);
            continue;
        }
        if (nn_convw_ok_(l)) { /* 3x3 / 5x5 "same", Winograd (conv_winograd.c; the kernel transformed above) */
            nn_convw_forward_(l, x + b0 * l->n_in, y, nb, c->col);
        } else if (nn_convd_ok_(l)) { /* 5x5 / 7x7 "same", direct (conv_direct.c) */
            nn_convd_forward_(l, W, x + b0 * l->n_in, y, nb, c->col);
        } else {
            if (!conv_is_pointwise(l)) {
                im2col(l, x + b0 * l->n_in, nb, c->col);
                col = c->col;
            }
            nn_chunk_gemm_(m, c, b0, P, false, nb * P, l->cout, (int)K, col, (int)K, W, l->cout, y, l->cout);
        }
        if (p) pool_fused_forward(p, bias, l->act, y, py + b0 * p->n_out, pa + b0 * p->n_out, nb);
        else bias_act(y, bias, nb * P, l->cout, l->act);
    }
}

/* The chunk's part: dz rows = g * act'(y) into l->dz, and dX from them. The
 * kernel and bias gradients wait for all chunks' dz rows
 * (nn_conv_param_grads_), so no sum is ever split at chunk boundaries. */
static float *conv_backward(const loom_model *m, const nn_layer_ *l, nn_chunk_ *c, const float *y, float *g,
                            float *other)
{
    const int64_t B = c->B;
    const float *W = m->params + l->kernel_off;
    const int64_t K = (int64_t)l->kh * l->kw * l->cin, P = (int64_t)l->oh * l->ow;
    float *dz = l->dz + c->b0 * l->n_out;
    if (!l->fuse_pool) nn_layer_act_grad_(l, dz, g, y, B * P, l->cout); /* fused: the pool's backward wrote dz */
    if (!l->needs_dx) return NULL;
    if (nn_convw_ok_(l)) { /* Winograd, no im2col chunks: the flipped kernel transformed once for all B */
        nn_convw_backward_data_(l, W, dz, other, B, c->col, c->dx_acc);
        return other;
    }
    if (nn_convd_ok_(l)) { /* direct, no im2col chunks: the flipped kernel is made once for all B */
        nn_convd_backward_data_(l, W, dz, other, B, c->col);
        return other;
    }
    for (int64_t b0 = 0; b0 < B; b0 += l->chunk) {
        int64_t nb = B - b0 < l->chunk ? B - b0 : l->chunk;
        const float *gz = dz + b0 * l->n_out;
        float *dx = other + b0 * l->n_in;
        if (conv_is_pointwise(l)) {
            nn_chunk_gemm_(m, c, b0, P, true, nb * P, (int)K, l->cout, gz, l->cout, W, l->cout, dx, (int)K);
            continue;
        }
        if (nn_conv3_dx_ok_(l)) {
            nn_conv3_backward_data_(l, W, gz, dx, nb, c->col);
            continue;
        }
        /* dcol (nb*P, K) = dZ W^T, in the col scratch, then scattered back */
        nn_chunk_gemm_(m, c, b0, P, true, nb * P, (int)K, l->cout, gz, l->cout, W, l->cout, c->col, (int)K);
        memset(dx, 0, (size_t)(nb * l->n_in) * sizeof *dx);
        col2im(l, c->col, nb, dx);
    }
    return other;
}

void nn_conv_param_grads_(const loom_model *m, int li, const float *x, int64_t B, int part, int parts, float *scratch)
{
    const nn_layer_ *l = &m->layer[li];
    const int64_t K = (int64_t)l->kh * l->kw * l->cin, P = (int64_t)l->oh * l->ow, CO = l->cout;
    const float *restrict dz = l->dz;
    float *dW = m->grads + l->kernel_off;
    if (l->cin == 1 && !conv_is_pointwise(l)) {
        int T = l->kh * l->kw, t0 = (int)((int64_t)T * part / parts), t1 = (int)((int64_t)T * (part + 1) / parts);
        int Hp, Wp;
        plane_dims(l, &Hp, &Wp);
#if NN_HAVE_FMA
        if (t1 > t0 && l->fma == 2) conv1_kernel_grad_512(l, x, dz, B, t0, t1, dW, scratch, scratch + (int64_t)Hp * Wp);
        else if (t1 > t0 && l->fma) conv1_kernel_grad_fma(l, x, dz, B, t0, t1, dW, scratch, scratch + (int64_t)Hp * Wp);
        else
#endif
            if (t1 > t0) conv1_kernel_grad(l, x, dz, B, t0, t1, dW, scratch, scratch + (int64_t)Hp * Wp);
    } else if (nn_convs_ok_(l)) { /* direct (conv_stem.c) */
        int64_t k0 = nn_grad_row_(m, l, K, part, parts), k1 = nn_grad_row_(m, l, K, part + 1, parts);
        if (k1 > k0) nn_convs_kernel_grad_(l, x, dz, B, (int)k0, (int)k1, dW);
    } else if (nn_convw_kgrad_ok_(l)) { /* Winograd (conv_winograd.c): its parts take input channels, all 9 taps */
        int c0 = nn_convw_grad_ci_(l, part, parts), c1 = nn_convw_grad_ci_(l, part + 1, parts);
        if (c1 > c0) nn_convw_kernel_grad_(l, x, dz, B, c0, c1, dW, scratch);
    } else if (nn_conv3_ok_(l)) { /* direct (conv_fast.c) */
        int64_t k0 = nn_grad_row_(m, l, K, part, parts), k1 = nn_grad_row_(m, l, K, part + 1, parts);
        if (k1 > k0) nn_conv3_kernel_grad_(l, x, dz, B, (int)k0, (int)k1, dW, scratch);
    } else if (nn_convd_ok_(l)) { /* direct (conv_direct.c) */
        int64_t k0 = nn_grad_row_(m, l, K, part, parts), k1 = nn_grad_row_(m, l, K, part + 1, parts);
        if (k1 > k0) nn_convd_kernel_grad_(l, x, dz, B, (int)k0, (int)k1, dW, scratch);
    } else if (nn_convp_grad_ok_(l)) { /* 1x1 stride 2 on AVX-512, direct (conv_wide.c) */
        int64_t k0 = nn_grad_row_(m, l, K, part, parts), k1 = nn_grad_row_(m, l, K, part + 1, parts);
        if (k1 > k0) nn_convp_kernel_grad_(l, x, dz, B, (int)k0, (int)k1, dW);
    } else {
        /* dW rows [k0, k1) (k1 - k0, cout) = col[:, k0:k1]^T dZ, over im2col
         * chunks at fixed example offsets, whatever the parts */
        int64_t k0 = nn_grad_row_(m, l, K, part, parts), k1 = nn_grad_row_(m, l, K, part + 1, parts);
        for (int64_t b0 = 0; k1 > k0 && b0 < B; b0 += l->chunk) {
            int64_t nb = B - b0 < l->chunk ? B - b0 : l->chunk;
            const float *col = x + b0 * l->n_in + k0;
            int64_t ld = K;
            if (!conv_is_pointwise(l)) {
                im2col_cols(l, x + b0 * l->n_in, nb, k0, k1, scratch);
                col = scratch;
                ld = k1 - k0;
            }
            loom_sgemm(true, false, (int)(k1 - k0), (int)CO, (int)(nb * P), 1.f, col, (int)ld, dz + b0 * l->n_out,
                       (int)CO, b0 ? 1.f : 0.f, dW + k0 * CO, (int)CO);
        }
    }
    if (l->bias_off < 0) return;
    int64_t c0 = CO * part / parts, c1 = CO * (part + 1) / parts;
    float *restrict db = m->grads + l->bias_off;
    /* fused with a pool: dz is zero off the windows' maxima, so the sums run
     * over the pool's masked gradient rows instead, kh*kw times fewer */
    const float *restrict gs = l->fuse_pool ? m->layer[li + 1].dz : dz;
    const int64_t rows = l->fuse_pool ? B * (m->layer[li + 1].n_out / CO) : B * P;
    for (int64_t j = c0; j < c1; j++) db[j] = 0.f;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = c0; j < c1; j++) db[j] += gs[r * CO + j];
}

/* ---- leaky_relu and gelu (activation layers: their gradients read x) ---------- */

/* leaky_relu: x > 0 ? x : alpha x. gelu (Keras, approximate = false): x Phi(x) = x (1 + erf(x / sqrt 2)) / 2. */
static void act_x_forward(const nn_layer_ *l, const float *restrict x, float *restrict y, int64_t n)
{
    const float a = (float)l->spec.alpha;
    if (l->act == LOOM_ACT_LEAKY_RELU)
        for (int64_t e = 0; e < n; e++) y[e] = x[e] > 0.f ? x[e] : a * x[e];
    else
        for (int64_t e = 0; e < n; e++) y[e] = 0.5f * x[e] * (1.f + erff(x[e] * (float)M_SQRT1_2));
}

/* y (n) = layer l's activation of x (n), y may be x: one position's row, as
 * the activation layer's forward computes it (decode_step.c). Not softmax. */
void nn_act_row_(const nn_layer_ *l, const float *x, float *y, int64_t n)
{
    if (x != y) memcpy(y, x, (size_t)n * sizeof *y);
    const float a = (float)l->spec.alpha;
    if (l->act == LOOM_ACT_LEAKY_RELU)
        for (int64_t e = 0; e < n; e++) y[e] = y[e] > 0.f ? y[e] : a * y[e];
    else if (l->act == LOOM_ACT_GELU)
        for (int64_t e = 0; e < n; e++) y[e] = 0.5f * y[e] * (1.f + erff(y[e] * (float)M_SQRT1_2));
    else if (nn_act_needs_x_(l->act)) nn_act_apply_(l->act, y, y, n);
    else bias_act(y, NULL, 1, n, l->act);
}

/* g *= f'(x): leaky 1 or alpha; gelu Phi(x) + x phi(x). */
static void act_x_backward(const nn_layer_ *l, const float *restrict x, float *restrict g, int64_t n)
{
    const float a = (float)l->spec.alpha;
    if (l->act == LOOM_ACT_LEAKY_RELU)
        for (int64_t e = 0; e < n; e++) g[e] *= x[e] > 0.f ? 1.f : a;
    else
        for (int64_t e = 0; e < n; e++) {
            float v = x[e];
            g[e] *= 0.5f * (1.f + erff(v * (float)M_SQRT1_2)) + v * expf(-0.5f * v * v) * 0.3989422804014327f;
        }
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
        nn_dense_forward_(m, l, c, x, y);
        if (nn_act_needs_x_(l->act)) nn_layer_act_(l, y, NULL, B, l->n_out);
        break;
    case LOOM_LAYER_LSTM:
    case LOOM_LAYER_GRU:
    case LOOM_LAYER_BIDIRECTIONAL:
        nn_rnn_forward_(m, li, c);
        break;
    case LOOM_LAYER_CONV2D:
        if (l->direct) {
            nn_more_forward_(m, li, c);
            break;
        }
        conv_forward(m, l, c, x, y);
        if (nn_act_needs_x_(l->act)) nn_layer_act_(l, y, NULL, B, l->n_out);
        break;
    case LOOM_LAYER_ZERO_PADDING2D:
    case LOOM_LAYER_GLOBAL_MAX_POOL2D:
    case LOOM_LAYER_RESHAPE:
    case LOOM_LAYER_UPSAMPLING2D:
    case LOOM_LAYER_DEPTHWISE_CONV2D:
    case LOOM_LAYER_SEPARABLE_CONV2D:
    case LOOM_LAYER_CONV2D_TRANSPOSE:
    case LOOM_LAYER_CONV1D:
        nn_more_forward_(m, li, c);
        break;
    case LOOM_LAYER_MAX_POOL2D:
        if (!l->fused) nn_pool_forward_(l, x, y, l->argmax + row0, B); /* fused: the conv's forward pooled */
        break;
    case LOOM_LAYER_DROPOUT:
        if (training && l->spec.rate > 0) nn_dropout_forward_(l, li, x, y, l->mask + row0, row0, B * l->n_out, rng_key);
        else c->act[li + 1] = x;
        break;
    case LOOM_LAYER_FLATTEN:
        c->act[li + 1] = x;
        break;
    case LOOM_LAYER_EMBEDDING:
        /* x is the batch's ids (the chunk's own rows), not floats */
        nn_embedding_forward_(m, l, x, 0, y, B);
        if (l->spec.mask_zero) nn_embedding_tmask_(m, l, x, c->b0, B); /* the chunk's rows of the time mask */
        break;
    case LOOM_LAYER_AVG_POOL2D:
        nn_avg_pool_forward_(l, x, y, B);
        break;
    case LOOM_LAYER_GLOBAL_AVG_POOL2D:
        nn_gap_forward_(l, x, y, B);
        break;
    case LOOM_LAYER_LAYER_NORM:
        nn_ln_forward_(m, l, x, y, c->b0, B);
        break;
    case LOOM_LAYER_PLUGIN:
        nn_plugin_forward_(m, li, c, x, y, training, rng_key);
        break;
    case LOOM_LAYER_MULTI_HEAD_ATTENTION:
    case LOOM_LAYER_POSITIONAL_EMBEDDING:
        nn_attn_forward_(m, li, c, x, y, training, rng_key);
        break;
    case LOOM_LAYER_BATCH_NORM: /* over the whole batch: nn_bn_forward_ */
    default:                    /* merge layers: graph.c */
        break;
    case LOOM_LAYER_ACTIVATION:
        if (l->act == LOOM_ACT_NONE) {
            c->act[li + 1] = x;
        } else if (l->act == LOOM_ACT_LEAKY_RELU || l->act == LOOM_ACT_GELU) {
            act_x_forward(l, x, y, B * l->n_out);
        } else if (nn_act_needs_x_(l->act)) {
            nn_act_apply_(l->act, x, y, B * l->n_out);
        } else if (!l->relu_in_bn) { /* else the batch normalization before it applied it (bn_relu) */
            if (y != x) memcpy(y, x, (size_t)(B * l->n_out) * sizeof *y); /* else in place (inplace) */
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
        return nn_dense_backward_(m, l, c, y, g, other);
    case LOOM_LAYER_LSTM:
    case LOOM_LAYER_GRU:
    case LOOM_LAYER_BIDIRECTIONAL:
        return nn_rnn_backward_(m, li, c, g, other);
    case LOOM_LAYER_CONV2D:
        if (l->direct) return nn_more_backward_(m, li, c, g, other);
        return conv_backward(m, l, c, y, g, other);
    case LOOM_LAYER_ZERO_PADDING2D:
    case LOOM_LAYER_GLOBAL_MAX_POOL2D:
    case LOOM_LAYER_RESHAPE:
    case LOOM_LAYER_UPSAMPLING2D:
    case LOOM_LAYER_DEPTHWISE_CONV2D:
    case LOOM_LAYER_SEPARABLE_CONV2D:
    case LOOM_LAYER_CONV2D_TRANSPOSE:
    case LOOM_LAYER_CONV1D:
        return nn_more_backward_(m, li, c, g, other);
    case LOOM_LAYER_MAX_POOL2D:
        if (l->fused) { /* the conv's dz rows directly; the conv ignores g */
            const nn_layer_ *cv = l - 1;
            pool_fused_backward(l, cv->act, y, l->argmax + row0, g, l->dz + row0, cv->dz + c->b0 * cv->n_out, B);
            return g;
        }
        return nn_pool_backward_(l, l->argmax + row0, g, other, B);
    case LOOM_LAYER_DROPOUT:
        if (y == x) return g;
        return nn_dropout_backward_(l, l->mask + row0, g, B * l->n_out);
    case LOOM_LAYER_FLATTEN:
        return g;
    case LOOM_LAYER_ACTIVATION:
        if (l->act == LOOM_ACT_LEAKY_RELU || l->act == LOOM_ACT_GELU) act_x_backward(l, x, g, B * l->n_out);
        else if (nn_act_needs_x_(l->act)) nn_act_grad_x_(l->act, x, g, g, B * l->n_out);
        else if (l->act != LOOM_ACT_NONE && !l->relu_in_bn) act_grad_colsum(g, y, NULL, B, l->n_out, l->act);
        return g;
    case LOOM_LAYER_AVG_POOL2D:
        return nn_avg_pool_backward_(l, g, other, B);
    case LOOM_LAYER_GLOBAL_AVG_POOL2D:
        return nn_gap_backward_(l, g, other, B);
    case LOOM_LAYER_LAYER_NORM:
        return nn_ln_backward_(m, l, c, g);
    case LOOM_LAYER_BATCH_NORM: /* nn_bn_backward_ */
        return g;
    case LOOM_LAYER_EMBEDDING: /* the table's sparse gradient waits for the whole batch's rows */
        memcpy(l->dz + row0, g, (size_t)(B * l->n_out) * sizeof *g);
        return NULL;
    case LOOM_LAYER_PLUGIN:
        return nn_plugin_backward_(m, li, c, g, other);
    case LOOM_LAYER_MULTI_HEAD_ATTENTION:
    case LOOM_LAYER_POSITIONAL_EMBEDDING:
        return nn_attn_backward_(m, li, c, g, other);
    default: /* merge layers: graph.c */
        break;
    }
    return NULL;
}
