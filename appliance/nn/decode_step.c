/* decode_step.c - the step ops of the built-in layer kinds (nn_internal.h
 * nn_step_ops_): each runs one position of a sequence as its forward
 * computes that position's row, for the decoder's incremental path
 * (decode.c). Threads: as the decoder's. */
#include "nn_internal.h"

#include <math.h>
#include <string.h>

/* the floats of one position of layer l's output (T, ...) */
static int64_t row_of(const nn_layer_ *l) { return l->n_out / l->out.dim[0]; }

/* embedding of one id a position (input (T,)): the table's row, zeros for -1 */
static void embedding_step(const loom_model *m, const nn_layer_ *l, float *state, int64_t pos, const float *const *x,
                           float *y)
{
    (void)state, (void)pos;
    int64_t id = (int64_t)x[0][0];
    if (id < 0 || id >= l->rows) memset(y, 0, (size_t)l->dim * sizeof *y);
    else memcpy(y, m->params + l->kernel_off + id * l->dim, (size_t)l->dim * sizeof *y);
}

static void activation_step(const loom_model *m, const nn_layer_ *l, float *state, int64_t pos, const float *const *x,
                            float *y)
{
    (void)m, (void)state, (void)pos;
    nn_act_row_(l, x[0], y, row_of(l));
}

/* dropout is the identity outside training */
static void identity_step(const loom_model *m, const nn_layer_ *l, float *state, int64_t pos, const float *const *x,
                          float *y)
{
    (void)m, (void)state, (void)pos;
    memcpy(y, x[0], (size_t)row_of(l) * sizeof *y);
}

/* layer_normalization over the last axis, one row (as layers.c ln_forward) */
static void ln_step(const loom_model *m, const nn_layer_ *l, float *state, int64_t pos, const float *const *x, float *y)
{
    (void)state, (void)pos;
    const int64_t C = l->C;
    const float *gamma = m->params + l->kernel_off, *beta = m->params + l->bias_off, *xr = x[0];
    double s = 0, ss = 0;
    for (int64_t c = 0; c < C; c++) s += xr[c];
    double mean = s / (double)C;
    for (int64_t c = 0; c < C; c++) ss += ((double)xr[c] - mean) * ((double)xr[c] - mean);
    float rstd = (float)(1.0 / sqrt(ss / (double)C + (float)l->spec.epsilon));
    for (int64_t c = 0; c < C; c++) y[c] = gamma[c] * (((float)(xr[c] - mean)) * rstd) + beta[c];
}

/* add, subtract, multiply, average, maximum of inputs of the output's shape (as graph.c merge_forward) */
static void merge_step(const loom_model *m, const nn_layer_ *l, float *state, int64_t pos, const float *const *x,
                       float *y)
{
    (void)m, (void)state, (void)pos;
    const int64_t n = row_of(l);
    memcpy(y, x[0], (size_t)n * sizeof *y);
    for (int k = 1; k < l->n_src; k++)
        for (int64_t e = 0; e < n; e++) switch (l->spec.kind) {
            case LOOM_LAYER_SUBTRACT: y[e] -= x[k][e]; break;
            case LOOM_LAYER_MULTIPLY: y[e] *= x[k][e]; break;
            case LOOM_LAYER_MAXIMUM: y[e] = x[k][e] > y[e] ? x[k][e] : y[e]; break;
            default: y[e] += x[k][e]; break;
            }
    if (l->spec.kind == LOOM_LAYER_AVERAGE)
        for (int64_t e = 0; e < n; e++) y[e] *= 1.f / (float)l->n_src;
}

/* concatenate along the last axis: each input's row after the other */
static void concat_step(const loom_model *m, const nn_layer_ *l, float *state, int64_t pos, const float *const *x,
                        float *y)
{
    (void)m, (void)state, (void)pos;
    for (int k = 0, off = 0; k < l->n_src; k++) {
        int64_t w = l->src_shape[k].dim[l->src_shape[k].rank - 1];
        memcpy(y + off, x[k], (size_t)w * sizeof *y);
        off += (int)w;
    }
}

/* a dense layer on the last axis of (T, D): the row times the kernel (D, units) */
static void dense_step(const loom_model *m, const nn_layer_ *l, float *state, int64_t pos, const float *const *x,
                       float *y)
{
    (void)state, (void)pos;
    const int D = (int)l->in.dim[l->in.rank - 1], U = (int)row_of(l);
    loom_sgemm(false, false, 1, U, D, 1.f, x[0], D, m->params + l->kernel_off, U, 0.f, y, U);
    if (l->bias_off >= 0)
        for (int u = 0; u < U; u++) y[u] += m->params[l->bias_off + u];
    nn_act_row_(l, y, y, U);
}

static const nn_step_ops_ ln_ops = {.step = ln_step};
static const nn_step_ops_ merge_ops = {.step = merge_step};
static const nn_step_ops_ concat_ops = {.step = concat_step};
static const nn_step_ops_ dense_ops = {.step = dense_step};

/* every input of the output's shape (no broadcasting) */
static bool same_shapes(const nn_layer_ *l)
{
    for (int k = 0; k < l->n_src; k++)
        if (!loom_shape_eq(&l->src_shape[k], &l->out)) return false;
    return true;
}

/* ---- lstm and gru (recurrent.c), the attention layers (attention.c's layouts) ---- */

static int64_t rnn_state(const nn_layer_ *l, int64_t T) { (void)T; return nn_rnn_step_state_(l); }

static void rnn_step(const loom_model *m, const nn_layer_ *l, float *state, int64_t pos, const float *const *x, float *y)
{
    nn_rnn_step_(m, l, state, pos, x[0], y);
}

static const nn_step_ops_ rnn_ops = {.state_floats = rnn_state, .step = rnn_step};

/* ---- multi_head_attention (causal self-attention) and positional_embedding ----
 * attention.c's layouts: parameter tensors aoff[0..7] = query kernel (D, H,
 * dk) and bias (H, dk), key, value, then the output kernel (H, dv, Do) and
 * bias (Do). The state of a sequence is its KV cache: the keys (T, H dk)
 * and values (T, H dv) of the positions so far, then scratch for the
 * position's query (H dk), scores (T) and context (H dv). */
static int64_t attn_state(const nn_layer_ *l, int64_t T)
{
    const int64_t hk = (int64_t)l->heads * l->dk, hv = (int64_t)l->heads * l->dv;
    return T * (hk + hv) + hk + T + hv;
}

/* y (n) = x (k) W (k, n) + b */
static void row_proj(const float *x, const float *W, const float *b, float *y, int k, int n)
{
    loom_sgemm(false, false, 1, n, k, 1.f, x, k, W, n, 0.f, y, n);
    if (b)
        for (int j = 0; j < n; j++) y[j] += b[j];
}

static const float *aw(const loom_model *m, const nn_layer_ *l, int t)
{
    return l->aoff[t] >= 0 ? m->params + l->aoff[t] : NULL;
}

static void attn_step(const loom_model *m, const nn_layer_ *l, float *state, int64_t pos, const float *const *x,
                      float *y)
{
    const int H = l->heads, dk = l->dk, dv = l->dv, hk = H * dk, hv = H * dv;
    float *K = state, *V = K + (int64_t)l->T * hk, *q = V + (int64_t)l->T * hv, *sc = q + hk, *ctx = sc + l->T;
    row_proj(x[0], aw(m, l, 0), aw(m, l, 1), q, l->Dq, hk);
    row_proj(x[0], aw(m, l, 2), aw(m, l, 3), K + pos * hk, l->Dkv, hk);
    row_proj(x[0], aw(m, l, 4), aw(m, l, 5), V + pos * hv, l->Dkv, hv);
    const float scale = 1.f / sqrtf((float)dk);
    for (int h = 0; h < H; h++) {
        float mx = -INFINITY, sum = 0.f;
        for (int64_t s = 0; s <= pos; s++) {
            float d = 0.f;
            for (int j = 0; j < dk; j++) d += q[h * dk + j] * K[s * hk + h * dk + j];
            sc[s] = scale * d;
            mx = sc[s] > mx ? sc[s] : mx;
        }
        for (int64_t s = 0; s <= pos; s++) sum += sc[s] = expf(sc[s] - mx);
        const float inv = 1.f / sum;
        float *c = ctx + h * dv;
        for (int j = 0; j < dv; j++) c[j] = 0.f;
        for (int64_t s = 0; s <= pos; s++)
            for (int j = 0; j < dv; j++) c[j] += sc[s] * inv * V[s * hv + h * dv + j];
    }
    row_proj(ctx, aw(m, l, 6), aw(m, l, 7), y, hv, l->Do);
}

/* y = x + the table's row pos */
static void pos_step(const loom_model *m, const nn_layer_ *l, float *state, int64_t pos, const float *const *x,
                     float *y)
{
    (void)state;
    const int64_t D = l->Dq;
    const float *pe = (l->spec.pos_mode == LOOM_POS_SINUSOIDAL ? l->ab[0] : m->params + l->kernel_off) + pos * D;
    for (int64_t e = 0; e < D; e++) y[e] = x[0][e] + pe[e];
}

static const nn_step_ops_ attn_ops = {.state_floats = attn_state, .step = attn_step, .bounded = true};
static const nn_step_ops_ pos_ops = {.step = pos_step, .bounded = true};

static const nn_step_ops_ embedding_ops = {.step = embedding_step};
static const nn_step_ops_ activation_ops = {.step = activation_step};
static const nn_step_ops_ identity_ops = {.step = identity_step};

const nn_step_ops_ *nn_step_ops_of_(const nn_layer_ *l)
{
    switch (l->spec.kind) {
    case LOOM_LAYER_EMBEDDING: return l->in.rank == 1 ? &embedding_ops : NULL; /* one id a position */
    case LOOM_LAYER_ACTIVATION: return l->act != LOOM_ACT_SOFTMAX ? &activation_ops : NULL;
    case LOOM_LAYER_DROPOUT: return &identity_ops;
    case LOOM_LAYER_LAYER_NORM: return l->C == row_of(l) ? &ln_ops : NULL;
    case LOOM_LAYER_ADD:
    case LOOM_LAYER_SUBTRACT:
    case LOOM_LAYER_MULTIPLY:
    case LOOM_LAYER_AVERAGE:
    case LOOM_LAYER_MAXIMUM: return same_shapes(l) ? &merge_ops : NULL;
    case LOOM_LAYER_CONCATENATE: return l->C == l->out.rank - 1 ? &concat_ops : NULL; /* the last axis */
    case LOOM_LAYER_DENSE: return l->in.rank == 2 && l->out.rank == 2 && l->act != LOOM_ACT_SOFTMAX ? &dense_ops : NULL;
    case LOOM_LAYER_LSTM:
    case LOOM_LAYER_GRU: return nn_rnn_can_step_(l) ? &rnn_ops : NULL;
    case LOOM_LAYER_MULTI_HEAD_ATTENTION: return l->spec.causal && l->n_src == 1 && l->T == l->S ? &attn_ops : NULL;
    case LOOM_LAYER_POSITIONAL_EMBEDDING: return &pos_ops;
    default: return NULL;
    }
}

