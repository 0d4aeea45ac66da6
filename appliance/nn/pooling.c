/* pooling.c - max_pool2d (with its argmax), average_pooling2d and
 * global_average_pooling2d, forward and backward.
 * Moved out of layers.c; its file comment (chunks, threads, no allocation) holds. */
#include "nn_internal.h"
#include "kernel_internal.h"

#include <float.h>
#include <math.h>
#include <string.h>

/* ---- max_pool2d ------------------------------------------------------------ */

/* Window positions outside the input (SAME padding) are skipped, as TF does;
 * ties keep the first position in (i, j) order. */
static inline LOOM_CLONE_BODY void pool_forward_body(const nn_layer_ *l, const float *x, float *y, int32_t *argmax,
                                                     int64_t B)
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
LOOM_CLONES(, void, pool_forward, (const nn_layer_ *l, const float *x, float *y, int32_t *argmax, int64_t B),
            (l, x, y, argmax, B))

/* (the exported name; the clones and their dispatch stay static) */
void nn_pool_forward_(const nn_layer_ *l, const float *x, float *y, int32_t *argmax, int64_t B)
{
    pool_forward(l, x, y, argmax, B);
}

static inline LOOM_CLONE_BODY float *pool_backward_body(const nn_layer_ *l, const int32_t *argmax, const float *g,
                                                        float *other, int64_t B)
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
LOOM_CLONES(, float *, pool_backward,
            (const nn_layer_ *l, const int32_t *argmax, const float *g, float *other, int64_t B),
            (l, argmax, g, other, B))

/* (the exported name; the clones and their dispatch stay static) */
float *nn_pool_backward_(const nn_layer_ *l, const int32_t *argmax, const float *g, float *other, int64_t B)
{
    return pool_backward(l, argmax, g, other, B);
}
/* ---- average pooling ------------------------------------------------------------ */

/* Each output is the mean of the window's elements inside the input (with
 * padding = same, Keras' AveragePooling2D counts only those). */
void nn_avg_pool_forward_(const nn_layer_ *l, const float *x, float *y, int64_t B)
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

float *nn_avg_pool_backward_(const nn_layer_ *l, const float *g, float *other, int64_t B)
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

void nn_gap_forward_(const nn_layer_ *l, const float *x, float *y, int64_t B)
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

float *nn_gap_backward_(const nn_layer_ *l, const float *g, float *other, int64_t B)
{
    if (!l->needs_dx) return NULL;
    const int64_t P = (int64_t)l->ih * l->iw, C = l->cin;
    const float inv = 1.f / (float)P;
    for (int64_t b = 0; b < B; b++)
        for (int64_t p = 0; p < P; p++)
            for (int64_t c = 0; c < C; c++) other[(b * P + p) * C + c] = g[b * C + c] * inv;
    return other;
}
