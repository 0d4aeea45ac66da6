/* layers.c - forward and backward kernels of every layer kind, the losses.
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

/* 16 floats as one GNU C vector: one AVX-512 register, two AVX2 or four SSE
 * ones; loads and stores through it need only float alignment. gcc leaves
 * some 16-long loops unrolled but scalar, and turns copy loops into memcpy
 * calls, which for im2col's short rows cost more than the copy. */
#define NN_CB 16
typedef float nn_v16_ __attribute__((vector_size(NN_CB * sizeof(float)), aligned(sizeof(float))));

static inline __attribute__((always_inline)) void copy_short(float *restrict d, const float *restrict s, int n)
{
    int k = 0;
    for (; k + NN_CB <= n; k += NN_CB) *(nn_v16_ *)(d + k) = *(const nn_v16_ *)(s + k);
    for (; k < n; k++) d[k] = s[k];
}

static inline __attribute__((always_inline)) void zero_short(float *restrict d, int n)
{
    int k = 0;
    for (; k + NN_CB <= n; k += NN_CB) *(nn_v16_ *)(d + k) = (nn_v16_){0};
    for (; k < n; k++) d[k] = 0.f;
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

/* dz (rows, n) = g * act'(y), out of place; one pass. */
NN_HOT static void act_grad_to(float *restrict dz, const float *restrict g, const float *restrict y, int64_t rows,
                               int64_t n, loom_activation act)
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
    default:
        memcpy(dz, g, (size_t)(rows * n) * sizeof *dz);
        break;
    }
}

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

/* The chunk's part: dz rows = g * act'(y) into l->dz, and dX (B, in) = dz W^T.
 * dW and db wait for all chunks' dz rows (nn_dense_param_grads_): one product
 * over the whole batch instead of one per chunk plus a sum of the chunks. */
static float *dense_backward(const loom_model *m, const nn_layer_ *l, nn_chunk_ *c, const float *y, float *g,
                             float *other)
{
    const int64_t B = c->B;
    const float *W = m->params + l->kernel_off;
    float *dz = l->dz + c->b0 * l->n_out;
    int in = (int)l->n_in, out = (int)l->n_out;
    nn_layer_act_grad_(l, dz, g, y, B, out);
    if (!l->needs_dx) return NULL;
    loom_sgemm(false, true, (int)B, in, out, 1.f, dz, out, W, out, 0.f, other, in);
    return other;
}

void nn_dense_param_grads_(const loom_model *m, int li, const float *x, int64_t B, int part, int parts)
{
    const nn_layer_ *l = &m->layer[li];
    const int64_t in = l->n_in, out = l->n_out;
    const float *restrict dz = l->dz;
    int64_t r0 = in * part / parts, r1 = in * (part + 1) / parts;
    /* dW rows [r0, r1) (r1 - r0, out) = x[:, r0:r1]^T dz */
    if (r1 > r0)
        loom_sgemm(true, false, (int)(r1 - r0), (int)out, (int)B, 1.f, x + r0, (int)in, dz, (int)out, 0.f,
                   m->grads + l->kernel_off + r0 * out, (int)out);
    if (l->bias_off < 0) return;
    int64_t c0 = out * part / parts, c1 = out * (part + 1) / parts;
    float *restrict db = m->grads + l->bias_off;
    for (int64_t j = c0; j < c1; j++) db[j] = 0.f;
    for (int64_t b = 0; b < B; b++)
        for (int64_t j = c0; j < c1; j++) db[j] += dz[b * out + j];
}

/* ---- conv2d: batch-chunked im2col + sgemm --------------------------------- */

/* col (nb*OH*OW, KH*KW*C), columns in kernel order (i, j, c), from x (nb, H, W, C). */
NN_HOT __attribute__((optimize("no-tree-loop-distribute-patterns"))) static void im2col(const nn_layer_ *l, const float *restrict x, int64_t nb, float *restrict col)
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
NN_HOT static void conv1_forward(const nn_layer_ *l, const float *restrict Wt, const float *restrict bias,
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

/* dW taps [t0, t1) (of kh*kw; each cout wide) = sum over the examples and
 * pixels of x * dz: per output row a sum over its pixels, added to the
 * example's sum in acc, added to dW in example order; scratch xp holds
 * Hp*Wp floats. A tap's sums do not depend on the other taps, so any split
 * of the taps gives the same bits. */
NN_HOT static void conv1_kernel_grad(const nn_layer_ *l, const float *restrict x, const float *restrict dz, int64_t nb,
                                     int t0, int t1, float *restrict dW, float *restrict xp, float *restrict acc)
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
NN_HOT __attribute__((optimize("no-tree-loop-distribute-patterns"))) static void im2col_cols(
    const nn_layer_ *l, const float *restrict x, int64_t nb, int64_t k0, int64_t k1, float *restrict col)
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

static int conv_is_pointwise(const nn_layer_ *l)
{
    return l->kh == 1 && l->kw == 1 && l->sh == 1 && l->sw == 1 && l->pad_t == 0 && l->pad_l == 0;
}

/* ---- conv2d + max_pool2d in one pass (nn_internal.h: fuse_pool) -------------- */

/* Pool p over the conv's pre-activation z (nb examples of the conv's output):
 * each window's max (the first of equal ones in (i, j) order, as
 * pool_forward), then + bias (NULL: already in z) and the activation (relu or
 * none) into y, its position into argmax; rows (nb, p->n_out) each. */
NN_HOT static void pool_fused_forward(const nn_layer_ *p, const float *restrict bias, loom_activation act,
                                      const float *restrict z, float *restrict y, int32_t *restrict argmax, int64_t nb)
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

/* The fused pool's backward on B examples: gm (B, p->n_out) = g where the
 * pooled output y passed the ReLU (all of g without one), and the conv's dz
 * (B, p->n_in) = gm at each window's maximum, zero elsewhere: the windows
 * tile the conv's output, so every element is written once. */
NN_HOT static void pool_fused_backward(const nn_layer_ *p, loom_activation act, const float *restrict y,
                                       const int32_t *restrict argmax, const float *restrict g, float *restrict gm,
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
    for (int64_t b0 = 0; b0 < B; b0 += l->chunk) {
        int64_t nb = B - b0 < l->chunk ? B - b0 : l->chunk;
        const float *col = x + b0 * l->n_in;
        float *y = yc + b0 * l->n_out;
        if (nn_conv3_ok_(l)) { /* 3x3 "same", direct (conv_fast.c) */
            nn_conv3_forward_(l, W, x + b0 * l->n_in, y, nb, c->col);
            bias_act(y, bias, nb * P, l->cout, l->act);
            continue;
        }
        if (!conv_is_pointwise(l)) {
            im2col(l, x + b0 * l->n_in, nb, c->col);
            col = c->col;
        }
        loom_sgemm(false, false, (int)(nb * P), l->cout, (int)K, 1.f, col, (int)K, W, l->cout, 0.f, y, l->cout);
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
    for (int64_t b0 = 0; b0 < B; b0 += l->chunk) {
        int64_t nb = B - b0 < l->chunk ? B - b0 : l->chunk;
        const float *gz = dz + b0 * l->n_out;
        float *dx = other + b0 * l->n_in;
        if (conv_is_pointwise(l)) {
            loom_sgemm(false, true, (int)(nb * P), (int)K, l->cout, 1.f, gz, l->cout, W, l->cout, 0.f, dx, (int)K);
            continue;
        }
        if (nn_conv3_ok_(l)) {
            nn_conv3_backward_data_(l, W, gz, dx, nb, c->col);
            continue;
        }
        /* dcol (nb*P, K) = dZ W^T, in the col scratch, then scattered back */
        loom_sgemm(false, true, (int)(nb * P), (int)K, l->cout, 1.f, gz, l->cout, W, l->cout, 0.f, c->col, (int)K);
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
    } else if (nn_conv3_ok_(l)) { /* direct (conv_fast.c) */
        int64_t k0 = K * part / parts, k1 = K * (part + 1) / parts;
        if (k1 > k0) nn_conv3_kernel_grad_(l, x, dz, B, (int)k0, (int)k1, dW, scratch);
    } else {
        /* dW rows [k0, k1) (k1 - k0, cout) = col[:, k0:k1]^T dZ, over im2col
         * chunks at fixed example offsets, whatever the parts */
        int64_t k0 = K * part / parts, k1 = K * (part + 1) / parts;
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

/* ---- max_pool2d ------------------------------------------------------------ */

/* Window positions outside the input (SAME padding) are skipped, as TF does;
 * ties keep the first position in (i, j) order. */
NN_HOT static void pool_forward(const nn_layer_ *l, const float *x, float *y, int32_t *argmax, int64_t B)
{
    const int H = l->ih, W = l->iw, C = l->cin, OH = l->oh, OW = l->ow;
    if (l->kh == 2 && l->kw == 2 && l->sh == 2 && l->sw == 2 && l->pad_t == 0 && l->pad_l == 0 && 2 * OH <= H &&
        2 * OW <= W) {
        /* 2x2 windows, stride 2, no padding (the usual case): the four taps in
         * (i, j) order, unrolled, with the same first-wins rule on ties */
        for (int64_t b = 0; b < B; b++) {
            const float *xb = x + b * l->n_in;
            for (int oy = 0; oy < OH; oy++)
                for (int ox = 0; ox < OW; ox++) {
                    int64_t o = b * l->n_out + ((int64_t)oy * OW + ox) * C;
                    int32_t p0 = (2 * oy * W + 2 * ox) * C, p1 = p0 + C, p2 = p0 + W * C, p3 = p2 + C;
                    const float *restrict x0 = xb + p0, *restrict x1 = xb + p1, *restrict x2 = xb + p2,
                                          *restrict x3 = xb + p3;
                    float *restrict yo = y + o;
                    int32_t *restrict ao = argmax + o;
                    for (int c = 0; c < C; c++) {
                        float v = x0[c];
                        int32_t a = p0 + c;
                        if (x1[c] > v) v = x1[c], a = p1 + c;
                        if (x2[c] > v) v = x2[c], a = p2 + c;
                        if (x3[c] > v) v = x3[c], a = p3 + c;
                        yo[c] = v;
                        ao[c] = a;
                    }
                }
        }
        return;
    }
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
void nn_dropout_mask_(const nn_layer_ *l, int li, uint8_t *mk, int64_t e0, int64_t n, uint64_t rng_key)
{
    const uint64_t key = loom_rng_mix(rng_key, (uint64_t)li);
    const uint64_t thr = (uint64_t)(l->spec.rate * 4294967296.0);
    uint32_t w[4];
    for (int64_t e = 0; e < n;) {
        int64_t ge = e0 + e, k0 = ge & 3, lim = 4 - k0 < n - e ? 4 - k0 : n - e;
        loom_philox4x32(key, (uint64_t)ge >> 2, w);
        for (int64_t k = 0; k < lim; k++) mk[e + k] = (uint64_t)w[k0 + k] >= thr;
        e += lim;
    }
}

NN_HOT static void dropout_forward(const nn_layer_ *l, int li, const float *restrict x, float *restrict y,
                                   uint8_t *restrict mk, int64_t e0, int64_t n, uint64_t rng_key)
{
    const float scale = (float)(1.0 / (1.0 - l->spec.rate));
    nn_dropout_mask_(l, li, mk, e0, n, rng_key);
    for (int64_t e = 0; e < n; e++) y[e] = mk[e] ? x[e] * scale : 0.f;
}

NN_HOT static float *dropout_backward(const nn_layer_ *l, const uint8_t *restrict mk, float *restrict g, int64_t n)
{
    const float scale = (float)(1.0 / (1.0 - l->spec.rate));
    for (int64_t e = 0; e < n; e++) g[e] = mk[e] ? g[e] * scale : 0.f;
    return g;
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

/* ---- average pooling ------------------------------------------------------------ */

/* Each output is the mean of the window's elements inside the input (with
 * padding = same, Keras' AveragePooling2D counts only those). */
static void avg_pool_forward(const nn_layer_ *l, const float *x, float *y, int64_t B)
{
    const int C = l->cin;
    for (int64_t b = 0; b < B; b++) {
        const float *xb = x + b * l->n_in;
        float *yb = y + b * l->n_out;
        for (int oy = 0; oy < l->oh; oy++)
            for (int ox = 0; ox < l->ow; ox++) {
                float *yo = yb + ((int64_t)oy * l->ow + ox) * C;
                int y0 = oy * l->sh - l->pad_t, x0 = ox * l->sw - l->pad_l, cnt = 0;
                for (int c = 0; c < C; c++) yo[c] = 0.f;
                for (int i = y0 < 0 ? 0 : y0; i < y0 + l->kh && i < l->ih; i++)
                    for (int k = x0 < 0 ? 0 : x0; k < x0 + l->kw && k < l->iw; k++, cnt++) {
                        const float *xp = xb + ((int64_t)i * l->iw + k) * C;
                        for (int c = 0; c < C; c++) yo[c] += xp[c];
                    }
                float inv = cnt ? 1.f / (float)cnt : 0.f;
                for (int c = 0; c < C; c++) yo[c] *= inv;
            }
    }
}

static float *avg_pool_backward(const nn_layer_ *l, const float *g, float *other, int64_t B)
{
    if (!l->needs_dx) return NULL;
    const int C = l->cin;
    memset(other, 0, (size_t)(B * l->n_in) * sizeof *other);
    for (int64_t b = 0; b < B; b++) {
        float *dx = other + b * l->n_in;
        const float *gb = g + b * l->n_out;
        for (int oy = 0; oy < l->oh; oy++)
            for (int ox = 0; ox < l->ow; ox++) {
                const float *go = gb + ((int64_t)oy * l->ow + ox) * C;
                int y0 = oy * l->sh - l->pad_t, x0 = ox * l->sw - l->pad_l;
                int ya = y0 < 0 ? 0 : y0, yb = y0 + l->kh < l->ih ? y0 + l->kh : l->ih;
                int xa = x0 < 0 ? 0 : x0, xb = x0 + l->kw < l->iw ? x0 + l->kw : l->iw;
                int cnt = (yb - ya) * (xb - xa);
                if (cnt <= 0) continue;
                float inv = 1.f / (float)cnt;
                for (int i = ya; i < yb; i++)
                    for (int k = xa; k < xb; k++) {
                        float *d = dx + ((int64_t)i * l->iw + k) * C;
                        for (int c = 0; c < C; c++) d[c] += go[c] * inv;
                    }
            }
    }
    return other;
}

/* ---- global average pooling: (H, W, C) -> (C,) ------------------------------------ */

static void gap_forward(const nn_layer_ *l, const float *x, float *y, int64_t B)
{
    const int64_t P = (int64_t)l->ih * l->iw, C = l->cin;
    const float inv = 1.f / (float)P;
    for (int64_t b = 0; b < B; b++) {
        float *yb = y + b * C;
        for (int64_t c = 0; c < C; c++) yb[c] = 0.f;
        for (int64_t p = 0; p < P; p++)
            for (int64_t c = 0; c < C; c++) yb[c] += x[(b * P + p) * C + c];
        for (int64_t c = 0; c < C; c++) yb[c] *= inv;
    }
}

static float *gap_backward(const nn_layer_ *l, const float *g, float *other, int64_t B)
{
    if (!l->needs_dx) return NULL;
    const int64_t P = (int64_t)l->ih * l->iw, C = l->cin;
    const float inv = 1.f / (float)P;
    for (int64_t b = 0; b < B; b++)
        for (int64_t p = 0; p < P; p++)
            for (int64_t c = 0; c < C; c++) other[(b * P + p) * C + c] = g[b * C + c] * inv;
    return other;
}

/* ---- layer normalization over the last axis (Keras LayerNormalization) ---------- */

static void ln_forward(const loom_model *m, const nn_layer_ *l, const float *x, float *y, int64_t b0, int64_t B)
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
static float *ln_backward(const loom_model *m, const nn_layer_ *l, nn_chunk_ *c, float *g)
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

/* ---- embedding ------------------------------------------------------------ */

/* Id e of a batch of ids (int32 or int64, by the model's input dtype). */
static inline int64_t emb_id(const loom_model *m, const void *x, int64_t e)
{
    return m->input_dtype == LOOM_I32 ? (int64_t)((const int32_t *)x)[e] : ((const int64_t *)x)[e];
}

int nn_embedding_check_ids_(const loom_model *m, int li, const void *x, int64_t B, loom_err *err)
{
    const nn_layer_ *l = &m->layer[li];
    const int64_t per = (int64_t)l->cols * l->k;
    for (int64_t e = 0; e < B * per; e++) {
        int64_t id = emb_id(m, x, e);
        if (id >= -1 && id < l->rows) continue;
        return loom_err_set(err, LOOM_EDATA, l->where,
                            "layer \"%s\" (embedding): example %lld of the batch, column %lld: id %lld is outside "
                            "[0, %lld) (input_dim)",
                            l->spec.name, (long long)(e / per), (long long)(e % per / l->k), (long long)id,
                            (long long)l->rows),
               loom_err_hint(err, "hash the ids into [0, input_dim) in the data, or raise input_dim; -1 means no id");
    }
    return LOOM_OK;
}

/* y (B, cols, dim): row c of example b = the sum (or mean) of the table rows
 * of the example's k ids of column c; -1 ids are skipped. */
NN_HOT static void embedding_forward(const loom_model *m, const nn_layer_ *l, const void *x, int64_t e0,
                                     float *restrict y, int64_t B)
{
    const float *T = m->params + l->kernel_off;
    const int D = l->dim, K = l->k;
    for (int64_t r = 0; r < B * l->cols; r++) {
        float *restrict yr = y + r * D;
        int n = 0;
        zero_short(yr, D);
        for (int k = 0; k < K; k++) {
            int64_t id = emb_id(m, x, e0 + r * K + k);
            if (id < 0) continue;
            const float *restrict t = T + id * D;
            for (int j = 0; j < D; j++) yr[j] += t[j];
            n++;
        }
        if (l->spec.combiner == LOOM_COMBINER_MEAN && n > 1) {
            float inv = 1.f / (float)n;
            for (int j = 0; j < D; j++) yr[j] *= inv;
        }
    }
}

/* The slot of id in the layer's map, inserting it (its gradient row zeroed) when new. */
static int64_t emb_slot(nn_layer_ *l, int64_t id)
{
    uint64_t h = (uint64_t)id * 0x9e3779b97f4a7c15ull;
    int64_t mask = l->hsize - 1;
    for (int64_t i = (int64_t)(h >> 20) & mask;; i = (i + 1) & mask) {
        if (l->hkey[i] == id) return l->hval[i];
        if (l->hkey[i] < 0) {
            int64_t u = l->sp_n++;
            l->hkey[i] = id;
            l->hval[i] = (int32_t)u;
            l->sp_ids[u] = id;
            memset(l->sp_val + u * l->dim, 0, (size_t)l->dim * sizeof(float));
            return u;
        }
    }
}

void nn_embedding_param_grads_(loom_model *m, int li, const void *x, int64_t B)
{
    nn_layer_ *l = &m->layer[li];
    const int D = l->dim, K = l->k;
    float *G = m->grads + l->kernel_off;
    /* the previous batch's rows out of the map and the dense buffer */
    int64_t mask = l->hsize - 1;
    for (int64_t u = 0; u < l->sp_n; u++) {
        uint64_t h = (uint64_t)l->sp_ids[u] * 0x9e3779b97f4a7c15ull;
        for (int64_t i = (int64_t)(h >> 20) & mask;; i = (i + 1) & mask)
            if (l->hkey[i] == l->sp_ids[u]) {
                l->hkey[i] = -1;
                break;
            }
        if (m->sparse_owner) memset(G + l->sp_ids[u] * D, 0, (size_t)D * sizeof *G);
    }
    if (!m->sparse_owner) memset(G, 0, (size_t)(l->rows * D) * sizeof *G);
    /* (each removal probes until it finds its key, so earlier removals never hide a later one) */
    l->sp_n = 0;
    for (int64_t r = 0; r < B * l->cols; r++) {
        const float *restrict g = l->dz + r * D;
        int n = 0;
        if (l->spec.combiner == LOOM_COMBINER_MEAN)
            for (int k = 0; k < K; k++) n += emb_id(m, x, r * K + k) >= 0;
        float scale = n > 1 ? 1.f / (float)n : 1.f;
        for (int k = 0; k < K; k++) {
            int64_t id = emb_id(m, x, r * K + k);
            if (id < 0) continue;
            float *restrict v = l->sp_val + emb_slot(l, id) * D;
            if (scale == 1.f)
                for (int j = 0; j < D; j++) v[j] += g[j];
            else
                for (int j = 0; j < D; j++) v[j] += scale * g[j];
        }
    }
    for (int64_t u = 0; u < l->sp_n; u++)
        memcpy(G + l->sp_ids[u] * D, l->sp_val + u * D, (size_t)D * sizeof *G);
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
        if (nn_act_needs_x_(l->act)) nn_layer_act_(l, y, NULL, B, l->n_out);
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
        if (!l->fused) pool_forward(l, x, y, l->argmax + row0, B); /* fused: the conv's forward pooled */
        break;
    case LOOM_LAYER_DROPOUT:
        if (training && l->spec.rate > 0) dropout_forward(l, li, x, y, l->mask + row0, row0, B * l->n_out, rng_key);
        else c->act[li + 1] = x;
        break;
    case LOOM_LAYER_FLATTEN:
        c->act[li + 1] = x;
        break;
    case LOOM_LAYER_EMBEDDING:
        /* x is the batch's ids (the chunk's own rows), not floats */
        embedding_forward(m, l, x, 0, y, B);
        break;
    case LOOM_LAYER_AVG_POOL2D:
        avg_pool_forward(l, x, y, B);
        break;
    case LOOM_LAYER_GLOBAL_AVG_POOL2D:
        gap_forward(l, x, y, B);
        break;
    case LOOM_LAYER_LAYER_NORM:
        ln_forward(m, l, x, y, c->b0, B);
        break;
    case LOOM_LAYER_PLUGIN:
        nn_plugin_forward_(m, li, c, x, y, training, rng_key);
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
        } else {
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
        return dense_backward(m, l, c, y, g, other);
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
        return pool_backward(l, l->argmax + row0, g, other, B);
    case LOOM_LAYER_DROPOUT:
        if (y == x) return g;
        return dropout_backward(l, l->mask + row0, g, B * l->n_out);
    case LOOM_LAYER_FLATTEN:
        return g;
    case LOOM_LAYER_ACTIVATION:
        if (l->act == LOOM_ACT_LEAKY_RELU || l->act == LOOM_ACT_GELU) act_x_backward(l, x, g, B * l->n_out);
        else if (nn_act_needs_x_(l->act)) nn_act_grad_x_(l->act, x, g, g, B * l->n_out);
        else if (l->act != LOOM_ACT_NONE) act_grad_colsum(g, y, NULL, B, l->n_out, l->act);
        return g;
    case LOOM_LAYER_AVG_POOL2D:
        return avg_pool_backward(l, g, other, B);
    case LOOM_LAYER_GLOBAL_AVG_POOL2D:
        return gap_backward(l, g, other, B);
    case LOOM_LAYER_LAYER_NORM:
        return ln_backward(m, l, c, g);
    case LOOM_LAYER_BATCH_NORM: /* nn_bn_backward_ */
        return g;
    case LOOM_LAYER_EMBEDDING: /* the table's sparse gradient waits for the whole batch's rows */
        memcpy(l->dz + row0, g, (size_t)(B * l->n_out) * sizeof *g);
        return NULL;
    case LOOM_LAYER_PLUGIN:
        return nn_plugin_backward_(m, li, c, g, other);
    default: /* merge layers: graph.c */
        break;
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

double nn_loss_(const loom_model *m, const float *z, int64_t b0, int64_t B, float inv_gb, float *g, int64_t *correct)
{
    const int64_t n = m->layer[m->n_layers - 1].n_out;
    const float *sw = m->sw ? m->swb + b0 : NULL;
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
