/* attention.c - sequence layers of issue 24: multi_head_attention (Keras's
 * MultiHeadAttention: per-head query/key/value projections, scaled dot
 * products, a softmax over the keys with an optional causal mask and the key
 * padding mask of an embedding's mask_zero, dropout on
 * the attention weights, the output projection) and positional_embedding (a
 * learned (max_length, D) table or the fixed sinusoids, added to (T, D)).
 *
 * An example is a (T, D) sequence. The projections are one GEMM over all the
 * chunk's rows (B T); the scores and the weighted sums one small GEMM per
 * (example, head) through loom_sgemm, the softmax fused with the causal mask
 * and the dropout in one pass over each row. The forward keeps the
 * projections, the weights (before and after dropout) and the context rows;
 * the backward writes the gradients of the projections' outputs into the
 * layer's rows, and the parameter gradients are then one GEMM each over the
 * whole batch (tensor t of the 4 projections by part t % parts), so they do
 * not depend on the chunking. Nothing here allocates during a step.
 * Threads: as model.c (a chunk touches only its own rows). */
#include "nn_internal.h"

#include <math.h>
#include <string.h>

/* the per-example buffers of a multi_head_attention layer (l->ab) */
enum { AB_Q, AB_K, AB_V, AB_P, AB_PD, AB_CTX, AB_DCTX, AB_DQ, AB_DK, AB_DV, AB_DS, AB_DX, AB_N };
/* its parameter tensors (l->aoff), Keras's names */
enum { AW_QK, AW_QB, AW_KK, AW_KB, AW_VK, AW_VB, AW_OK, AW_OB, AW_N };

bool nn_is_attn_kind_(loom_layer_kind k)
{
    return k == LOOM_LAYER_MULTI_HEAD_ATTENTION || k == LOOM_LAYER_POSITIONAL_EMBEDDING;
}

/* floats per example of buffer i */
static int64_t ab_size(const nn_layer_ *l, int i)
{
    const int64_t T = l->T, S = l->S, H = l->heads;
    switch (i) {
    case AB_Q: case AB_DQ: return T * H * l->dk;
    case AB_K: case AB_DK: return S * H * l->dk;
    case AB_V: case AB_DV: return S * H * l->dv;
    case AB_CTX: case AB_DCTX: return T * H * l->dv;
    case AB_PD: return l->spec.rate > 0 ? H * T * S : 0;
    case AB_DX: return l->n_src > 1 ? S * (l->Dkv > l->Dvin ? l->Dkv : l->Dvin) : 0; /* a key or value input's gradient */
    default: return H * T * S; /* AB_P, AB_DS */
    }
}

static float *ab(const nn_layer_ *l, int i, int64_t b0) { return l->ab[i] + b0 * ab_size(l, i); }

/* ---- shapes and parameters ------------------------------------------------- */

static int need_seq(const nn_layer_ *l, const loom_shape *in, loom_err *err)
{
    char a[96];
    if (in->rank == 2) return LOOM_OK;
    loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\" (%s) needs a (T, D) sequence per example, got %s",
                 l->spec.name, nn_layer_kind_name_(l->spec.kind), loom_shape_str(in, a, sizeof a));
    return loom_err_hint(err, "put an embedding (input (T,) of ids) or a reshape to (T, D) before it");
}

static int attn_shapes(loom_model *m, nn_layer_ *l, loom_err *err)
{
    const loom_layer_spec *s = &l->spec;
    int rc = need_seq(l, &l->in, err);
    if (rc) return rc;
    if (s->num_heads < 1 || s->key_dim < 1)
        return loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\": num_heads = %d and key_dim = %d must be >= 1",
                            s->name, s->num_heads, s->key_dim);
    /* inputs [query], [query, value] or [query, value, key] (Keras's call order; key defaults to value) */
    const loom_shape *vs = &l->src_shape[l->n_src > 1 ? 1 : 0], *ks = &l->src_shape[l->n_src > 2 ? 2 : l->n_src > 1];
    char a[96], b[96];
    if ((rc = need_seq(l, vs, err)) || (rc = need_seq(l, ks, err))) return rc;
    if (vs->dim[0] != ks->dim[0])
        return loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\": value %s and key %s differ in steps", s->name,
                            loom_shape_str(vs, a, sizeof a), loom_shape_str(ks, b, sizeof b));
    l->T = (int)l->in.dim[0], l->S = (int)vs->dim[0];
    l->Dq = (int)l->in.dim[1], l->Dkv = (int)ks->dim[1], l->Dvin = (int)vs->dim[1];
    l->heads = s->num_heads, l->dk = s->key_dim, l->dv = s->value_dim > 0 ? s->value_dim : s->key_dim;
    l->Do = l->Dq; /* Keras: output_shape defaults to the query's last dim */
    l->out = l->in;
    const int H = l->heads;
    const char *suf[AW_N] = {"query/kernel", "query/bias", "key/kernel", "key/bias", "value/kernel", "value/bias",
                             "attention_output/kernel", "attention_output/bias"};
    int din[4] = {l->Dq, l->Dkv, l->Dvin, H * l->dv}, dout[4] = {l->dk, l->dk, l->dv, l->Do};
    for (int t = 0; t < 4; t++) {
        loom_shape ks = t < 3 ? (loom_shape){.rank = 3, .dim = {din[t], H, dout[t]}}
                              : (loom_shape){.rank = 3, .dim = {H, l->dv, l->Do}};
        double fo = t < 3 ? (double)H * dout[t] : (double)l->Do;
        l->aoff[2 * t] = nn_add_param_(m, l, suf[2 * t], &ks, s->kernel_init, (double)din[t], fo);
        l->aoff[2 * t + 1] = -1;
        if (!s->use_bias) continue;
        loom_shape bs = t < 3 ? (loom_shape){.rank = 2, .dim = {H, dout[t]}} : (loom_shape){.rank = 1, .dim = {l->Do}};
        l->aoff[2 * t + 1] = nn_add_param_(m, l, suf[2 * t + 1], &bs, LOOM_INIT_ZEROS, 0, 0);
    }
    /* the tensors are contiguous: model.c's ranges (kernel_off to the end of the last of kernel, bias, pw) span them */
    l->kernel_off = l->aoff[AW_QK];
    l->pw_off = l->aoff[AW_OK];
    l->bias_off = l->aoff[AW_OB];
    double T = l->T, S = l->S;
    m->flops += 2.0 * T * l->Dq * H * l->dk + 2.0 * S * (l->Dkv * l->dk + l->Dvin * l->dv) * H + 2.0 * T * S * H * (l->dk + l->dv) +
                2.0 * T * H * l->dv * l->Do;
    return LOOM_OK;
}

/* PE[t, 2i] = sin(t / 10000^(2i / D)), PE[t, 2i + 1] = cos(the same) (Vaswani et al., keras_hub's SinePositionEncoding) */
static void sinusoids(float *pe, int T, int D)
{
    for (int t = 0; t < T; t++)
        for (int d = 0; d < D; d++) {
            double ang = t / pow(10000.0, (double)(d - d % 2) / D);
            pe[(int64_t)t * D + d] = (float)(d % 2 ? cos(ang) : sin(ang));
        }
}

static int pos_shapes(loom_model *m, nn_layer_ *l, loom_err *err)
{
    const loom_layer_spec *s = &l->spec;
    int rc = need_seq(l, &l->in, err);
    if (rc) return rc;
    l->T = (int)l->in.dim[0], l->Dq = (int)l->in.dim[1];
    if (s->max_length < l->T) {
        loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\" (positional_embedding): sequences of %d steps, "
                     "max_length = %d", s->name, l->T, s->max_length);
        return loom_err_hint(err, "set max_length >= %d", l->T);
    }
    l->out = l->in;
    l->kernel_off = -1;
    if (s->pos_mode != LOOM_POS_SINUSOIDAL) {
        loom_shape ks = {.rank = 2, .dim = {s->max_length, l->Dq}};
        l->kernel_off = nn_add_param_(m, l, "embeddings", &ks, LOOM_INIT_GLOROT_UNIFORM, s->max_length, l->Dq);
    }
    m->flops += (double)l->T * l->Dq;
    return LOOM_OK;
}

int nn_attn_shapes_(loom_model *m, nn_layer_ *l, int li, loom_err *err)
{
    (void)li;
    for (int t = 0; t < AW_N; t++) l->aoff[t] = -1;
    if (l->spec.kind == LOOM_LAYER_POSITIONAL_EMBEDDING) return pos_shapes(m, l, err);
    return attn_shapes(m, l, err);
}

bool nn_attn_buffers_(nn_layer_ *l, int64_t max_batch)
{
    const size_t outs = (size_t)(max_batch * l->n_out) * sizeof(float);
    if (!(l->y = loom_alloc_aligned(outs))) return false;
    if (l->spec.kind == LOOM_LAYER_POSITIONAL_EMBEDDING) {
        if (l->spec.pos_mode == LOOM_POS_SINUSOIDAL) {
            if (!(l->ab[0] = loom_alloc_aligned((size_t)l->n_out * sizeof(float)))) return false;
            sinusoids(l->ab[0], l->T, l->Dq);
        } else if (!(l->dz = loom_alloc_aligned(outs))) {
            return false;
        }
        return true;
    }
    if (!(l->dz = loom_alloc_aligned(outs))) return false;
    for (int i = 0; i < AB_N; i++)
        if (ab_size(l, i) && !(l->ab[i] = loom_alloc_aligned((size_t)(max_batch * ab_size(l, i)) * sizeof(float))))
            return false;
    if (l->spec.rate > 0 && !(l->mask = loom_alloc_aligned((size_t)(max_batch * ab_size(l, AB_P))))) return false;
    return true;
}

void nn_attn_free_(nn_layer_ *l)
{
    for (int i = 0; i < AB_N; i++) loom_free(l->ab[i]);
}

bool nn_attn_owns_(const nn_layer_ *l, int64_t off)
{
    if (l->spec.kind != LOOM_LAYER_MULTI_HEAD_ATTENTION) return false;
    for (int t = 0; t < AW_N; t++)
        if (off == l->aoff[t] && off >= 0) return true;
    return false;
}

/* ---- multi_head_attention ------------------------------------------------------- */

/* Y (rows, n) = X (rows, k) W (k, n) + b */
static void proj(const float *x, const float *W, const float *b, float *y, int64_t rows, int k, int n)
{
    loom_sgemm(false, false, (int)rows, n, k, 1.f, x, k, W, n, 0.f, y, n);
    if (b)
        for (int64_t r = 0; r < rows; r++)
            for (int j = 0; j < n; j++) y[r * n + j] += b[j];
}

static const float *wt(const loom_model *m, const nn_layer_ *l, int t)
{
    return l->aoff[t] >= 0 ? m->params + l->aoff[t] : NULL;
}

/* Row t of scores z (S,) into softmax weights in place over keys [0, valid)
 * (valid = t + 1 when causal) that the key mask km (NULL: none) keeps; the
 * others (and a row with no key kept) get 0. The dropped-out weights (scaled
 * by 1 / keep) into pd. */
static void softmax_row(float *z, float *pd, const uint8_t *mk, const uint8_t *km, int S, int valid, float keep_inv)
{
    float mx = -INFINITY, sum = 0.f;
    for (int s = 0; s < valid; s++)
        if (!km || km[s]) mx = z[s] > mx ? z[s] : mx;
    for (int s = 0; s < valid; s++) sum += z[s] = !km || km[s] ? expf(z[s] - mx) : 0.f;
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int s = 0; s < valid; s++) z[s] *= inv;
    for (int s = valid; s < S; s++) z[s] = 0.f;
    if (pd)
        for (int s = 0; s < S; s++) pd[s] = mk[s] ? z[s] * keep_inv : 0.f;
}

static void attn_forward(const loom_model *m, int li, nn_chunk_ *c, const float *x, float *y, int training,
                         uint64_t rng_key)
{
    const nn_layer_ *l = &m->layer[li];
    const int64_t B = c->B, b0 = c->b0;
    const int T = l->T, S = l->S, H = l->heads, dk = l->dk, dv = l->dv, hk = H * dk, hv = H * dv;
    float *q = ab(l, AB_Q, b0), *k = ab(l, AB_K, b0), *v = ab(l, AB_V, b0), *ctx = ab(l, AB_CTX, b0);
    const float *xv = l->n_src > 1 ? nn_src_ptr_(c, l->src[1]) : x, *xk = l->n_src > 2 ? nn_src_ptr_(c, l->src[2]) : xv;
    proj(x, wt(m, l, AW_QK), wt(m, l, AW_QB), q, B * T, l->Dq, hk);
    proj(xk, wt(m, l, AW_KK), wt(m, l, AW_KB), k, B * S, l->Dkv, hk);
    proj(xv, wt(m, l, AW_VK), wt(m, l, AW_VB), v, B * S, l->Dvin, hv);
    const bool drop = training && l->spec.rate > 0;
    const float scale = 1.f / sqrtf((float)dk), keep_inv = (float)(1.0 / (1.0 - l->spec.rate));
    const int64_t per = (int64_t)H * T * S;
    uint8_t *mk = drop ? l->mask + b0 * per : NULL;
    if (drop) nn_dropout_mask_(l, li, mk, b0 * per, B * per, rng_key);
    const uint8_t *kmask = nn_tmask_(m, c, S); /* padding keys (an embedding's mask_zero): weight 0 */
    for (int64_t b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            const int64_t o = (b * H + h) * (int64_t)T * S;
            float *p = ab(l, AB_P, b0) + o, *pd = drop ? ab(l, AB_PD, b0) + o : NULL;
            const float *qb = q + b * T * hk + h * dk, *kb = k + b * S * hk + h * dk, *vb = v + b * S * hv + h * dv;
            loom_sgemm(false, true, T, S, dk, scale, qb, hk, kb, hk, 0.f, p, S);
            for (int t = 0; t < T; t++)
                softmax_row(p + (int64_t)t * S, pd ? pd + (int64_t)t * S : NULL, mk ? mk + o + (int64_t)t * S : NULL,
                            kmask ? kmask + b * S : NULL, S, l->spec.causal ? (t + 1 < S ? t + 1 : S) : S, keep_inv);
            loom_sgemm(false, false, T, dv, S, 1.f, pd ? pd : p, S, vb, hv, 0.f, ctx + b * T * hv + h * dv, hv);
        }
    proj(ctx, wt(m, l, AW_OK), wt(m, l, AW_OB), y, B * T, hv, l->Do);
}

/* dX += dY W^T for one projection (rows, k) from dY (rows, n) */
static void proj_dx(const float *dy, const float *W, float *dx, int64_t rows, int k, int n, float beta)
{
    loom_sgemm(false, true, (int)rows, k, n, 1.f, dy, n, W, n, beta, dx, k);
}

/* Several inputs (a graph's layer): the value's and key's gradients handed to their layers (a model input
 * takes none), the query's returned in other. */
static float *cross_dx(const loom_model *m, const nn_layer_ *l, nn_chunk_ *c, float *other)
{
    const int64_t B = c->B, b0 = c->b0;
    const int hk = l->heads * l->dk, hv = l->heads * l->dv;
    float *dx = ab(l, AB_DX, b0);
    for (int k = 1; k < l->n_src; k++) {
        int s = l->src[k];
        if (s < 0 || !m->layer[s].need_out) continue;
        if (k == 1) proj_dx(ab(l, AB_DV, b0), wt(m, l, AW_VK), dx, B * l->S, l->Dvin, hv, 0.f);
        if (k == 1 && l->n_src == 2) proj_dx(ab(l, AB_DK, b0), wt(m, l, AW_KK), dx, B * l->S, l->Dkv, hk, 1.f);
        if (k == 2) proj_dx(ab(l, AB_DK, b0), wt(m, l, AW_KK), dx, B * l->S, l->Dkv, hk, 0.f);
        nn_graph_deliver_(m, s, c, dx);
    }
    proj_dx(ab(l, AB_DQ, b0), wt(m, l, AW_QK), other, B * l->T, l->Dq, hk, 0.f);
    return other;
}

static float *attn_backward(const loom_model *m, int li, nn_chunk_ *c, float *g, float *other)
{
    const nn_layer_ *l = &m->layer[li];
    const int64_t B = c->B, b0 = c->b0;
    const int T = l->T, S = l->S, H = l->heads, dk = l->dk, dv = l->dv, hk = H * dk, hv = H * dv;
    const bool drop = l->spec.rate > 0;
    const float scale = 1.f / sqrtf((float)dk), keep_inv = (float)(1.0 / (1.0 - l->spec.rate));
    const int64_t per = (int64_t)H * T * S;
    memcpy(l->dz + b0 * l->n_out, g, (size_t)(B * l->n_out) * sizeof *g);
    float *dctx = ab(l, AB_DCTX, b0), *dq = ab(l, AB_DQ, b0), *dkk = ab(l, AB_DK, b0), *dvv = ab(l, AB_DV, b0);
    const float *q = ab(l, AB_Q, b0), *k = ab(l, AB_K, b0), *v = ab(l, AB_V, b0);
    proj_dx(g, wt(m, l, AW_OK), dctx, B * T, hv, l->Do, 0.f);
    for (int64_t b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            const int64_t o = (b * H + h) * (int64_t)T * S;
            const float *p = ab(l, AB_P, b0) + o, *pd = drop ? ab(l, AB_PD, b0) + o : p;
            const uint8_t *mk = drop ? l->mask + b0 * per + o : NULL;
            float *ds = ab(l, AB_DS, b0) + o;
            const float *dcb = dctx + b * T * hv + h * dv;
            /* dPd = dctx V^T, dV = Pd^T dctx */
            loom_sgemm(false, true, T, S, dv, 1.f, dcb, hv, v + b * S * hv + h * dv, hv, 0.f, ds, S);
            loom_sgemm(true, false, S, dv, T, 1.f, pd, S, dcb, hv, 0.f, dvv + b * S * hv + h * dv, hv);
            /* dS = scale P (dP - sum(dP P)), dP = dPd * mask / keep */
            for (int64_t e = 0; e < (int64_t)T * S; e += S) {
                float dot = 0.f;
                for (int s = 0; s < S; s++) {
                    if (mk) ds[e + s] = mk[e + s] ? ds[e + s] * keep_inv : 0.f;
                    dot += ds[e + s] * p[e + s];
                }
                for (int s = 0; s < S; s++) ds[e + s] = scale * p[e + s] * (ds[e + s] - dot);
            }
            /* dQ = dS K, dK = dS^T Q */
            loom_sgemm(false, false, T, dk, S, 1.f, ds, S, k + b * S * hk + h * dk, hk, 0.f, dq + b * T * hk + h * dk, hk);
            loom_sgemm(true, false, S, dk, T, 1.f, ds, S, q + b * T * hk + h * dk, hk, 0.f, dkk + b * S * hk + h * dk, hk);
        }
    if (!l->needs_dx) return NULL;
    if (l->n_src > 1) return cross_dx(m, l, c, other);
    proj_dx(dq, wt(m, l, AW_QK), other, B * T, l->Dq, hk, 0.f);
    proj_dx(dkk, wt(m, l, AW_KK), other, B * S, l->Dkv, hk, 1.f);
    proj_dx(dvv, wt(m, l, AW_VK), other, B * S, l->Dvin, hv, 1.f);
    return other;
}

/* dW = X^T dY (k, n) and db = column sums of dY over rows */
static void proj_grads(const float *x, const float *dy, float *dW, float *db, int64_t rows, int k, int n)
{
    loom_sgemm(true, false, k, n, (int)rows, 1.f, x, k, dy, n, 0.f, dW, n);
    if (!db) return;
    memset(db, 0, (size_t)n * sizeof *db);
    for (int64_t r = 0; r < rows; r++)
        for (int j = 0; j < n; j++) db[j] += dy[r * n + j];
}

static void attn_param_grads(const loom_model *m, int li, const float *x, int64_t B, int part, int parts)
{
    const nn_layer_ *l = &m->layer[li];
    const int hk = l->heads * l->dk, hv = l->heads * l->dv;
    float *G = m->grads;
    const nn_chunk_ *c0 = &m->chunk[0]; /* example 0 on: the whole batch's rows of each input */
    const float *xv = l->n_src > 1 ? nn_src_ptr_(c0, l->src[1]) : x, *xk = l->n_src > 2 ? nn_src_ptr_(c0, l->src[2]) : xv;
    for (int t = part; t < 4; t += parts) {
        float *dW = G + l->aoff[2 * t], *db = l->aoff[2 * t + 1] >= 0 ? G + l->aoff[2 * t + 1] : NULL;
        switch (t) {
        case 0: proj_grads(x, l->ab[AB_DQ], dW, db, B * l->T, l->Dq, hk); break;
        case 1: proj_grads(xk, l->ab[AB_DK], dW, db, B * l->S, l->Dkv, hk); break;
        case 2: proj_grads(xv, l->ab[AB_DV], dW, db, B * l->S, l->Dvin, hv); break;
        default: proj_grads(l->ab[AB_CTX], l->dz, dW, db, B * l->T, hv, l->Do); break;
        }
    }
}

/* ---- positional_embedding --------------------------------------------------------- */

static void pos_forward(const loom_model *m, const nn_layer_ *l, const float *x, float *y, int64_t B)
{
    const int64_t n = l->n_out;
    const float *pe = l->spec.pos_mode == LOOM_POS_SINUSOIDAL ? l->ab[0] : m->params + l->kernel_off;
    for (int64_t b = 0; b < B; b++)
        for (int64_t e = 0; e < n; e++) y[b * n + e] = x[b * n + e] + pe[e];
}

static void pos_param_grads(const loom_model *m, const nn_layer_ *l, int64_t B, int part, int parts)
{
    const int64_t n = l->n_out, rows = (int64_t)l->spec.max_length * l->Dq;
    const int64_t e0 = rows * part / parts, e1 = rows * (part + 1) / parts;
    float *G = m->grads + l->kernel_off;
    for (int64_t e = e0; e < e1; e++) G[e] = 0.f;
    for (int64_t b = 0; b < B; b++)
        for (int64_t e = e0; e < e1 && e < n; e++) G[e] += l->dz[b * n + e];
}

/* ---- dispatch (layers.c, model.c) ------------------------------------------------- */

void nn_attn_forward_(const loom_model *m, int li, nn_chunk_ *c, const float *x, float *y, int training,
                      uint64_t rng_key)
{
    const nn_layer_ *l = &m->layer[li];
    if (l->spec.kind == LOOM_LAYER_POSITIONAL_EMBEDDING) pos_forward(m, l, x, y, c->B);
    else attn_forward(m, li, c, x, y, training, rng_key);
}

float *nn_attn_backward_(const loom_model *m, int li, nn_chunk_ *c, float *g, float *other)
{
    const nn_layer_ *l = &m->layer[li];
    if (l->spec.kind == LOOM_LAYER_MULTI_HEAD_ATTENTION) return attn_backward(m, li, c, g, other);
    if (l->spec.pos_mode != LOOM_POS_SINUSOIDAL) memcpy(l->dz + c->b0 * l->n_out, g, (size_t)(c->B * l->n_out) * sizeof *g);
    return l->needs_dx ? g : NULL; /* dx = dy */
}

void nn_attn_param_grads_(const loom_model *m, int li, const float *x, int64_t B, int part, int parts)
{
    const nn_layer_ *l = &m->layer[li];
    if (l->spec.kind == LOOM_LAYER_POSITIONAL_EMBEDDING) pos_param_grads(m, l, B, part, parts);
    else attn_param_grads(m, li, x, B, part, parts);
}
