/* dense.c - the dense layer's forward, backward and parameter gradients.
 * Moved out of layers.c; its file comment (chunks, threads, no allocation) holds. */
#include "nn_internal.h"
#include "kernel_internal.h"

#include <float.h>
#include <math.h>
#include <string.h>

/* ---- dense ---------------------------------------------------------------- */

/* Y (B, out) = act(X (B, in) W (in, out) + b) of the chunk's B examples; on
 * the last axis of a (B, T, in) input, one product over the B T rows. */
void nn_dense_forward_(const loom_model *m, const nn_layer_ *l, const nn_chunk_ *c, const float *x, float *y)
{
    const float *W = m->params + l->kernel_off;
    const float *b = l->bias_off >= 0 ? m->params + l->bias_off : NULL;
    int in = (int)(l->n_in / l->steps), out = (int)(l->n_out / l->steps);
    const int64_t B = c->B * l->steps;
    nn_chunk_gemm_(m, c, 0, l->steps, false, B, out, in, x, in, W, out, y, out);
    nn_bias_act_(y, b, B, out, l->act);
}
/* The chunk's part: dz rows = g * act'(y) into l->dz, and dX (B, in) = dz W^T.
 * dW and db wait for all chunks' dz rows (nn_dense_param_grads_): one product
 * over the whole batch instead of one per chunk plus a sum of the chunks. */
float *nn_dense_backward_(const loom_model *m, const nn_layer_ *l, nn_chunk_ *c, const float *y, float *g,
                          float *other)
{
    const int64_t B = c->B * l->steps;
    const float *W = m->params + l->kernel_off;
    float *dz = l->dz + c->b0 * l->n_out;
    int in = (int)(l->n_in / l->steps), out = (int)(l->n_out / l->steps);
    nn_layer_act_grad_(l, dz, g, y, B, out);
    if (!l->needs_dx) return NULL;
    nn_chunk_gemm_(m, c, 0, l->steps, true, B, in, out, dz, out, W, out, other, in);
    return other;
}

void nn_dense_param_grads_(const loom_model *m, int li, const float *x, int64_t B, int part, int parts)
{
    const nn_layer_ *l = &m->layer[li];
    const int64_t in = l->n_in / l->steps, out = l->n_out / l->steps;
    const float *restrict dz = l->dz;
    B *= l->steps;
    int64_t r0 = nn_grad_row_(m, l, in, part, parts), r1 = nn_grad_row_(m, l, in, part + 1, parts);
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
