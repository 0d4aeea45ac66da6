/* recurrent.c - lstm, gru and bidirectional layers over (T, D) inputs.
 * Gate layout as cuDNN and PyTorch, so weights map one to one:
 *   lstm: kernel (D, 4H) = weight_ih_l0^T, recurrent_kernel (H, 4H) =
 *         weight_hh_l0^T, gates i, f, g, o (Keras' i, f, c, o: the same
 *         order); bias (4H,) = bias_ih_l0 + bias_hh_l0.
 *   gru:  reset_after (Keras 2, cuDNN, PyTorch): kernel (D, 3H) =
 *         weight_ih_l0^T, recurrent_kernel (H, 3H) = weight_hh_l0^T, gates
 *         r, z, n (Keras orders z, r, h); bias (2, 3H) = [bias_ih_l0,
 *         bias_hh_l0]; n = act(x W_n + b_in + r * (h U_n + b_hn)),
 *         h' = (1 - z) n + z h.
 *   bidirectional: the forward direction's three tensors, then the
 *         backward one's (PyTorch's *_reverse).
 * Speed: the input projection of all T steps is one GEMM over the chunk's
 * B T rows, the recurrent product one GEMM per step over the chunk's B
 * rows, the gate math one fused pass per step. The backward mirrors it, and
 * the parameter gradients are three GEMMs over the whole batch's B T rows
 * (nn_rnn_param_grads_), so they do not depend on the chunking.
 * Masks (nn_tmask_): a masked step carries h and c unchanged and outputs
 * zeros (Keras); the last-step output is then the last real step's h.
 * Threads: forward and backward per chunk on the chunk's rows of the
 * layer's buffers; the parameter gradients once, in parts. */
#include "nn_internal.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

bool nn_is_rnn_kind_(loom_layer_kind k)
{
    return k == LOOM_LAYER_LSTM || k == LOOM_LAYER_GRU || k == LOOM_LAYER_BIDIRECTIONAL;
}

/* ---- geometry ----------------------------------------------------------------- */

static bool is_gru(const nn_layer_ *l) { return l->gates == 3; }
static int  ndir(const nn_layer_ *l) { return l->spec.kind == LOOM_LAYER_BIDIRECTIONAL ? 2 : 1; }
/* The width of an output step: H, or 2H for a bidirectional concat. */
static int  out_w(const nn_layer_ *l) { return ndir(l) == 2 && l->spec.merge_mode == 0 ? 2 * l->H : l->H; }

/* A direction's saved state for the chunk starting at example b0, each array
 * (max_batch, T, width) in rs (l->rs_per is max_batch):
 *   G (T, gates H): the gates' activations of the forward, then (backward)
 *     d(loss)/d(pre-activation) of the input projection;
 *   P (T, H): h entering each step (h_{t-1});
 *   A (T, H): lstm: c entering each step; gru: U_n h + b_hn of each step,
 *     then (backward) its gradient (dan r).
 * After the directions: the scratch S (max_batch, 2 H + gates H) and, for a
 * bidirectional sum, Y (max_batch, n_out) the backward direction's output. */
typedef struct rnn_buf {
    float *G, *P, *A;
} rnn_buf;

static int64_t dir_floats(const nn_layer_ *l) { return l->rs_per * l->steps * (int64_t)(l->gates + 2) * l->H; }

static rnn_buf buf_of(const nn_layer_ *l, int dir, int64_t b0)
{
    const int64_t T = l->steps, H = l->H, gH = (int64_t)l->gates * H, mb = l->rs_per;
    float *base = l->rs + dir * dir_floats(l);
    return (rnn_buf){base + b0 * T * gH, base + mb * T * gH + b0 * T * H, base + mb * T * (gH + H) + b0 * T * H};
}

static float *scratch_of(const nn_layer_ *l, int64_t b0)
{
    return l->rs + ndir(l) * dir_floats(l) + b0 * (2 * (int64_t)l->H + (int64_t)l->gates * l->H);
}

static float *ysum_of(const nn_layer_ *l, int64_t b0)
{
    return l->rs + ndir(l) * dir_floats(l) + l->rs_per * (2 * (int64_t)l->H + (int64_t)l->gates * l->H) +
           b0 * l->n_out;
}

/* return_state: after Y, the final h and c (max_batch, 2 H) the forward leaves, then their gradients
 * (max_batch, 2 H), which the state views (state_of 1: h, 2: c) read and write. */
static int64_t base_floats(const nn_layer_ *l)
{
    return ndir(l) * dir_floats(l) + l->rs_per * (2 * (int64_t)l->H + (int64_t)l->gates * l->H) +
           (ndir(l) == 2 ? l->rs_per * l->n_out : 0);
}

static float *fin_of(const nn_layer_ *l, int64_t b0) { return l->rs + base_floats(l) + b0 * 2 * l->H; }
static float *dfin_of(const nn_layer_ *l, int64_t b0) { return fin_of(l, l->rs_per + b0); }

/* ---- shapes and buffers ---------------------------------------------------------- */

/* A state view: (units,), the h or c of the lstm or gru it takes as input. */
static int view_shapes(loom_model *m, nn_layer_ *l, loom_err *err)
{
    const nn_layer_ *r = l->n_src == 1 && l->src[0] >= 0 ? &m->layer[l->src[0]] : NULL;
    if (!r || !r->spec.return_state || r->spec.kind != l->spec.kind)
        return loom_err_set(err, LOOM_ECONFIG, l->where, "layer \"%s\": the state of \"%s\", which is not a %s "
                            "with return_state", l->spec.name, l->spec.inputs[0], nn_layer_kind_name_(l->spec.kind));
    l->H = r->H, l->gates = r->gates, l->steps = 0, l->act = LOOM_ACT_NONE;
    l->out.rank = 1, l->out.dim[0] = r->H;
    return LOOM_OK;
}

int nn_rnn_shapes_(loom_model *m, nn_layer_ *l, int li, loom_err *err)
{
    (void)li;
    char a[96];
    const loom_layer_spec *s = &l->spec;
    if (s->state_of) return view_shapes(m, l, err);
    const char *kind = nn_layer_kind_name_(s->kind);
    bool gru = s->kind == LOOM_LAYER_GRU || (s->kind == LOOM_LAYER_BIDIRECTIONAL && s->cell == 1);
    if (l->in.rank != 2)
        return loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\" (%s) needs a sequence input (steps, features), "
                            "got %s", s->name, kind, loom_shape_str(&l->in, a, sizeof a)),
               loom_err_hint(err, "feed it an embedding of ids (T,), or a (T, D) feature; a lstm or gru with "
                                  "return_sequences = true before it");
    if (s->units < 1)
        return loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\": units = %d, must be >= 1", s->name, s->units);
    if (gru && !s->reset_after)
        return loom_err_set(err, LOOM_EUNSUPPORTED, l->where, "layer \"%s\" (%s): reset_after = false (Keras 1's "
                            "GRU) is not supported", s->name, kind),
               loom_err_hint(err, "use reset_after = true (Keras 2's default, cuDNN's and PyTorch's GRU)");
    l->steps = l->in.dim[0];
    l->D = (int)l->in.dim[1];
    l->H = s->units;
    l->gates = gru ? 3 : 4;
    l->act = LOOM_ACT_NONE; /* the activations are the cell's own */
    const int64_t gH = (int64_t)l->gates * l->H;
    if (s->return_sequences) {
        l->out.rank = 2, l->out.dim[0] = l->steps, l->out.dim[1] = out_w(l);
    } else {
        l->out.rank = 1, l->out.dim[0] = out_w(l);
    }
    for (int d = 0; d < ndir(l); d++) {
        const char *pre = ndir(l) == 1 ? "" : d ? "backward_" : "forward_";
        char nk[40], nr[40], nb[40];
        snprintf(nk, sizeof nk, "%skernel", pre);
        snprintf(nr, sizeof nr, "%srecurrent_kernel", pre);
        snprintf(nb, sizeof nb, "%sbias", pre);
        loom_shape ks = {.rank = 2, .dim = {l->D, gH}}, rs = {.rank = 2, .dim = {l->H, gH}};
        loom_shape bs = gru ? (loom_shape){.rank = 2, .dim = {2, gH}} : (loom_shape){.rank = 1, .dim = {gH}};
        int64_t k = nn_add_param_(m, l, nk, &ks, s->kernel_init, (double)l->D, (double)gH);
        int64_t r = nn_add_param_(m, l, nr, &rs, s->recurrent_init, (double)l->H, (double)gH);
        int binit = !gru && s->unit_forget_bias ? NN_INIT_FORGET_BIAS_ : LOOM_INIT_ZEROS;
        int64_t b = s->use_bias ? nn_add_param_(m, l, nb, &bs, binit, (double)l->H, 0) : -1;
        if (d == 0) l->kernel_off = k, l->rk_off = r, l->bias_off = b;
        else l->dir2 = k - l->kernel_off;
    }
    m->flops += 2.0 * (double)ndir(l) * (double)l->steps * (double)(l->D + l->H) * (double)gH;
    return LOOM_OK;
}

bool nn_rnn_buffers_(nn_layer_ *l, int64_t max_batch)
{
    l->rs_per = max_batch;
    int64_t n = base_floats(l) + (l->spec.return_state ? max_batch * 4 * (int64_t)l->H : 0);
    if (l->spec.state_of) return (l->y = loom_alloc_aligned((size_t)(max_batch * l->n_out) * sizeof(float))) != NULL;
    if (!(l->y = loom_alloc_aligned((size_t)(max_batch * l->n_out) * sizeof(float)))) return false;
    if (!(l->rs = loom_alloc_aligned((size_t)n * sizeof(float)))) return false;
    memset(l->rs, 0, (size_t)n * sizeof(float));
    return true;
}

/* ---- the cell's arithmetic --------------------------------------------------------- */

/* The build targets baseline x86-64; the step loops are cloned for AVX2 and
 * AVX-512 as layers.c's hot loops are (tensor.h LOOM_CLONES). */

/* e^x in straight-line arithmetic the compiler vectorises (libm's expf is a
 * call per element): x = n ln2 + r, |r| <= ln2 / 2, e^r by Cephes' expf
 * polynomial (within 2 ulp), 2^n through the exponent bits. */
static inline __attribute__((always_inline)) float fast_exp(float x)
{
    x = x < -87.f ? -87.f : x; /* (fminf, copysignf and fabsf keep the loops from vectorising) */
    x = x > 88.f ? 88.f : x;
    const float t = x * 1.44269504088896341f;
    const float fn = (t + 12582912.f) - 12582912.f; /* round to nearest: 1.5 2^23 */
    const int n = (int)fn;
    float r = x - fn * 0.693359375f + fn * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float e = p * r * r + r + 1.f;
    int32_t bits = (n + 127) * (1 << 23);
    float sc;
    memcpy(&sc, &bits, sizeof sc);
    return e * sc;
}

/* tanh as (1 - e^-2x) / (1 + e^-2x): within 1e-7 absolute, -1 and 1 at the
 * clamped ends, no branch, so it vectorises. */
static inline __attribute__((always_inline)) float fast_tanh(float x)
{
    float e = fast_exp(-2.f * x);
    return (1.f - e) / (1.f + e);
}

static inline __attribute__((always_inline)) float fast_sigmoid(float x) { return 1.f / (1.f + fast_exp(-x)); }

static inline __attribute__((always_inline)) float act_f(loom_activation a, float x)
{
    switch (a) {
    case LOOM_ACT_SIGMOID: return 1.f / (1.f + fast_exp(-x));
    case LOOM_ACT_TANH: return fast_tanh(x);
    case LOOM_ACT_RELU: return x > 0.f ? x : 0.f;
    default: return x;
    }
}

/* The derivative from the output y = act(x). */
static inline __attribute__((always_inline)) float act_d(loom_activation a, float y)
{
    switch (a) {
    case LOOM_ACT_SIGMOID: return y * (1.f - y);
    case LOOM_ACT_TANH: return 1.f - y * y;
    case LOOM_ACT_RELU: return y > 0.f ? 1.f : 0.f;
    default: return 1.f;
    }
}

/* Where a direction reads and writes one step of the layer's output (or its
 * gradient): example b's step t at y + b ys + t yt + off. */
typedef struct rnn_io {
    float  *y;
    int64_t ys, yt, off;
} rnn_io;

static inline float *io_at(const rnn_io *o, int64_t b, int64_t t) { return o->y + b * o->ys + t * o->yt + o->off; }

/* The parameters of direction dir. */
typedef struct rnn_par {
    const float *W, *U, *b; /* b NULL without bias */
} rnn_par;

static rnn_par par_of(const loom_model *m, const nn_layer_ *l, int dir, bool grads)
{
    const float *base = grads ? m->grads : m->params;
    int64_t d = dir ? l->dir2 : 0;
    return (rnn_par){base + l->kernel_off + d, base + l->rk_off + d, l->bias_off >= 0 ? base + l->bias_off + d : NULL};
}

/* One lstm step of example b: the gates (pre-activations in g) activated in
 * place, h and c out. */
static inline __attribute__((always_inline)) void lstm_cell(const nn_layer_ *l, float *restrict g,
                                                            const float *restrict cp, float *restrict h,
                                                            float *restrict c)
{
    const int H = l->H;
    const loom_activation ra = l->spec.recurrent_activation, a = l->spec.activation;
    if (ra == LOOM_ACT_SIGMOID && a == LOOM_ACT_TANH) { /* the default, in one vectorised pass */
        for (int j = 0; j < H; j++) {
            float i = fast_sigmoid(g[j]), f = fast_sigmoid(g[H + j]), gg = fast_tanh(g[2 * H + j]);
            float o = fast_sigmoid(g[3 * H + j]);
            g[j] = i, g[H + j] = f, g[2 * H + j] = gg, g[3 * H + j] = o;
            float cn = f * cp[j] + i * gg;
            c[j] = cn;
            h[j] = o * fast_tanh(cn);
        }
        return;
    }
    for (int j = 0; j < H; j++) {
        float i = act_f(ra, g[j]), f = act_f(ra, g[H + j]), gg = act_f(a, g[2 * H + j]), o = act_f(ra, g[3 * H + j]);
        g[j] = i, g[H + j] = f, g[2 * H + j] = gg, g[3 * H + j] = o;
        float cn = f * cp[j] + i * gg;
        c[j] = cn;
        h[j] = o * act_f(a, cn);
    }
}

/* One gru step of example b: xg (the input projection plus b_ih) becomes the
 * activated r, z, n; hg (U h + b_hh) leaves its n part in hn; h out. */
static inline __attribute__((always_inline)) void gru_cell(const nn_layer_ *l, float *restrict xg,
                                                           const float *restrict hg, float *restrict hn,
                                                           const float *restrict hp, float *restrict h)
{
    const int H = l->H;
    const loom_activation ra = l->spec.recurrent_activation, a = l->spec.activation;
    if (ra == LOOM_ACT_SIGMOID && a == LOOM_ACT_TANH) {
        for (int j = 0; j < H; j++) {
            float r = fast_sigmoid(xg[j] + hg[j]), z = fast_sigmoid(xg[H + j] + hg[H + j]);
            float n = fast_tanh(xg[2 * H + j] + r * hg[2 * H + j]);
            xg[j] = r, xg[H + j] = z, xg[2 * H + j] = n;
            hn[j] = hg[2 * H + j];
            h[j] = (1.f - z) * n + z * hp[j];
        }
        return;
    }
    for (int j = 0; j < H; j++) {
        float r = act_f(ra, xg[j] + hg[j]), z = act_f(ra, xg[H + j] + hg[H + j]);
        float n = act_f(a, xg[2 * H + j] + r * hg[2 * H + j]);
        xg[j] = r, xg[H + j] = z, xg[2 * H + j] = n;
        hn[j] = hg[2 * H + j];
        h[j] = (1.f - z) * n + z * hp[j];
    }
}

/* ---- forward ---------------------------------------------------------------------- */

/* Direction dir over the chunk's B examples of x (B, T, D) into out. */
static inline LOOM_CLONE_BODY void dir_forward_body(const loom_model *m, const nn_layer_ *l, int dir,
                                                    const nn_chunk_ *c, const float *x, const rnn_io *out)
{
    const int64_t B = c->B, T = l->steps, H = l->H, gH = (int64_t)l->gates * H;
    const uint8_t *mk = nn_tmask_(m, c, T);
    const rnn_par p = par_of(m, l, dir, false);
    const rnn_buf s = buf_of(l, dir, c->b0);
    const bool gru = is_gru(l), seq = l->spec.return_sequences;
    float *hg = scratch_of(l, c->b0), *h = hg + B * gH, *cc = h + B * H; /* (B, gH), (B, H), (B, H) */
    /* the input projection of every step: one GEMM over B T rows, plus the (input) bias */
    loom_sgemm(false, false, (int)(B * T), (int)gH, l->D, 1.f, x, l->D, p.W, (int)gH, 0.f, s.G, (int)gH);
    if (p.b)
        for (int64_t r = 0; r < B * T; r++)
            for (int64_t j = 0; j < gH; j++) s.G[r * gH + j] += p.b[j];
    for (int64_t k = 0; k < T; k++) {
        const int64_t t = dir ? T - 1 - k : k;
        float *P = s.P + t * H, *A = s.A + t * H, *G = s.G + t * gH; /* example b at + b T (width) */
        if (k == 0) {
            for (int64_t b = 0; b < B; b++) memset(P + b * T * H, 0, (size_t)H * sizeof *P);
            if (!gru)
                for (int64_t b = 0; b < B; b++) memset(A + b * T * H, 0, (size_t)H * sizeof *A);
        }
        if (gru) { /* hg = h U + b_hh */
            if (k == 0) memset(hg, 0, (size_t)(B * gH) * sizeof *hg);
            else loom_sgemm(false, false, (int)B, (int)gH, (int)H, 1.f, P, (int)(T * H), p.U, (int)gH, 0.f, hg, (int)gH);
            if (p.b)
                for (int64_t b = 0; b < B; b++)
                    for (int64_t j = 0; j < gH; j++) hg[b * gH + j] += p.b[gH + j];
        } else if (k > 0) { /* G_t += h U */
            loom_sgemm(false, false, (int)B, (int)gH, (int)H, 1.f, P, (int)(T * H), p.U, (int)gH, 1.f, G,
                       (int)(T * gH));
        }
        for (int64_t b = 0; b < B; b++) {
            const float *hp = P + b * T * H;
            float *hb = h + b * H, *cb = cc + b * H;
            bool on = !mk || mk[b * T + t];
            if (!on) { /* carried */
                memcpy(hb, hp, (size_t)H * sizeof *hb);
                if (!gru) memcpy(cb, A + b * T * H, (size_t)H * sizeof *cb);
                else memset(A + b * T * H, 0, (size_t)H * sizeof *A);
            } else if (gru) {
                gru_cell(l, G + b * T * gH, hg + b * gH, A + b * T * H, hp, hb);
            } else {
                lstm_cell(l, G + b * T * gH, A + b * T * H, hb, cb);
            }
            if (seq) {
                float *y = io_at(out, b, t);
                if (on) memcpy(y, hb, (size_t)H * sizeof *y);
                else memset(y, 0, (size_t)H * sizeof *y);
            } else if (k == T - 1) {
                memcpy(io_at(out, b, 0), hb, (size_t)H * sizeof *hb);
            }
            if (k == T - 1 && l->spec.return_state) { /* the final state (carried past masked steps) */
                memcpy(fin_of(l, c->b0 + b), hb, (size_t)H * sizeof *hb);
                if (!gru) memcpy(fin_of(l, c->b0 + b) + H, cb, (size_t)H * sizeof *cb);
            }
            if (k < T - 1) { /* the state entering the next step */
                const int64_t tn = dir ? t - 1 : t + 1;
                memcpy(s.P + tn * H + b * T * H, hb, (size_t)H * sizeof *hb);
                if (!gru) memcpy(s.A + tn * H + b * T * H, cb, (size_t)H * sizeof *cb);
            }
        }
    }
}
LOOM_CLONES(, void, dir_forward,
            (const loom_model *m, const nn_layer_ *l, int dir, const nn_chunk_ *c, const float *x, const rnn_io *out),
            (m, l, dir, c, x, out))

/* The io of direction dir of a layer's output (or gradient) rows for chunk rows at y. */
static rnn_io io_of(const nn_layer_ *l, int dir, float *y)
{
    const int64_t W = out_w(l), ys = l->n_out;
    const int64_t off = ndir(l) == 2 && l->spec.merge_mode == 0 && dir ? l->H : 0;
    return (rnn_io){y, ys, l->spec.return_sequences ? W : 0, off};
}

void nn_rnn_forward_(const loom_model *m, int li, nn_chunk_ *c)
{
    const nn_layer_ *l = &m->layer[li];
    const float *x = c->act[li];
    float *y = l->y + c->b0 * l->n_out;
    c->act[li + 1] = y;
    if (l->spec.state_of) { /* a copy of the final state the recurrent layer left */
        const nn_layer_ *r = &m->layer[l->src[0]];
        for (int64_t b = 0; b < c->B; b++)
            memcpy(y + b * l->H, fin_of(r, c->b0 + b) + (l->spec.state_of - 1) * l->H, (size_t)l->H * sizeof *y);
        return;
    }
    rnn_io o = io_of(l, 0, y);
    dir_forward(m, l, 0, c, x, &o);
    if (ndir(l) == 1) return;
    if (l->spec.merge_mode == 0) {
        rnn_io o2 = io_of(l, 1, y);
        dir_forward(m, l, 1, c, x, &o2);
        return;
    }
    float *y2 = ysum_of(l, c->b0); /* sum: the backward direction apart, then added */
    rnn_io o2 = io_of(l, 1, y2);
    dir_forward(m, l, 1, c, x, &o2);
    for (int64_t e = 0; e < c->B * l->n_out; e++) y[e] += y2[e];
}

/* ---- backward ---------------------------------------------------------------------- */

/* One lstm step's backward of example b: dh and dc (carried in, d c_{t-1}
 * out in dc); the gates' gradients into g (their activations before). */
static inline __attribute__((always_inline)) void lstm_cell_back(const nn_layer_ *l, float *restrict g,
                                                                 const float *restrict cp, const float *restrict dh,
                                                                 float *restrict dc)
{
    const int H = l->H;
    const loom_activation ra = l->spec.recurrent_activation, a = l->spec.activation;
    if (ra == LOOM_ACT_SIGMOID && a == LOOM_ACT_TANH) {
        for (int j = 0; j < H; j++) {
            float i = g[j], f = g[H + j], gg = g[2 * H + j], o = g[3 * H + j];
            float cn = f * cp[j] + i * gg, tc = fast_tanh(cn);
            float dct = dc[j] + dh[j] * o * (1.f - tc * tc);
            g[j] = dct * gg * (i * (1.f - i));
            g[H + j] = dct * cp[j] * (f * (1.f - f));
            g[2 * H + j] = dct * i * (1.f - gg * gg);
            g[3 * H + j] = dh[j] * tc * (o * (1.f - o));
            dc[j] = dct * f;
        }
        return;
    }
    for (int j = 0; j < H; j++) {
        float i = g[j], f = g[H + j], gg = g[2 * H + j], o = g[3 * H + j];
        float cn = f * cp[j] + i * gg, tc = act_f(a, cn);
        float dct = dc[j] + dh[j] * o * act_d(a, tc);
        g[j] = dct * gg * act_d(ra, i);
        g[H + j] = dct * cp[j] * act_d(ra, f);
        g[2 * H + j] = dct * i * act_d(a, gg);
        g[3 * H + j] = dh[j] * tc * act_d(ra, o);
        dc[j] = dct * f;
    }
}

/* One gru step's backward of example b: dh in; xg's gradient into xg (its
 * activations r, z, n before), the recurrent n part's (dan r) into hn (U_n h
 * + b_hn before); dh z, the direct part of d h_{t-1}, into dhz. */
static inline __attribute__((always_inline)) void gru_cell_back(const nn_layer_ *l, float *restrict xg, float *restrict hn, const float *restrict hp,
                                 const float *restrict dh, float *restrict dhz)
{
    const int H = l->H;
    const loom_activation ra = l->spec.recurrent_activation, a = l->spec.activation;
    if (ra == LOOM_ACT_SIGMOID && a == LOOM_ACT_TANH) {
        for (int j = 0; j < H; j++) {
            float r = xg[j], z = xg[H + j], n = xg[2 * H + j];
            float dan = dh[j] * (1.f - z) * (1.f - n * n);
            float dar = dan * hn[j] * (r * (1.f - r)), daz = dh[j] * (hp[j] - n) * (z * (1.f - z));
            xg[j] = dar, xg[H + j] = daz, xg[2 * H + j] = dan;
            hn[j] = dan * r;
            dhz[j] = dh[j] * z;
        }
        return;
    }
    for (int j = 0; j < H; j++) {
        float r = xg[j], z = xg[H + j], n = xg[2 * H + j];
        float dan = dh[j] * (1.f - z) * act_d(a, n);
        float dar = dan * hn[j] * act_d(ra, r), daz = dh[j] * (hp[j] - n) * act_d(ra, z);
        xg[j] = dar, xg[H + j] = daz, xg[2 * H + j] = dan;
        hn[j] = dan * r;
        dhz[j] = dh[j] * z;
    }
}

/* Direction dir's backward over the chunk: g the gradient of its output;
 * leaves the gradients of the pre-activations in G (and A for a gru) for
 * the parameter gradients, and adds (beta 1) or writes (beta 0) the input
 * gradient into dx (B, T, D) when dx is not NULL. */
static inline LOOM_CLONE_BODY void dir_backward_body(const loom_model *m, const nn_layer_ *l, int dir,
                                                     const nn_chunk_ *c, const rnn_io *g, float *dx, float beta)
{
    const int64_t B = c->B, T = l->steps, H = l->H, gH = (int64_t)l->gates * H;
    const uint8_t *mk = nn_tmask_(m, c, T);
    const rnn_par p = par_of(m, l, dir, false);
    const rnn_buf s = buf_of(l, dir, c->b0);
    const bool gru = is_gru(l), seq = l->spec.return_sequences;
    float *tmp = scratch_of(l, c->b0), *dh = tmp + B * gH, *dc = dh + B * H; /* (B, H) at tmp: the GEMM's */
    memset(dh, 0, (size_t)(2 * B * H) * sizeof *dh);
    if (l->spec.return_state) /* d h_T and d c_T from the state views (zero where a view is unused) */
        for (int64_t b = 0; b < B; b++) {
            memcpy(dh + b * H, dfin_of(l, c->b0 + b), (size_t)H * sizeof *dh);
            if (!gru) memcpy(dc + b * H, dfin_of(l, c->b0 + b) + H, (size_t)H * sizeof *dc);
        }
    for (int64_t k = T - 1; k >= 0; k--) {
        const int64_t t = dir ? T - 1 - k : k;
        float *G = s.G + t * gH, *A = s.A + t * H;
        const float *P = s.P + t * H;
        for (int64_t b = 0; b < B; b++) {
            float *dhb = dh + b * H, *db = dc + b * H;
            bool on = !mk || mk[b * T + t];
            if ((seq && on) || (!seq && k == T - 1)) {
                const float *gy = io_at(g, b, seq ? t : 0);
                for (int64_t j = 0; j < H; j++) dhb[j] += gy[j];
            }
            float *Gb = G + b * T * gH, *Ab = A + b * T * H;
            if (!on) { /* h and c were carried: their gradients go on unchanged */
                memset(Gb, 0, (size_t)gH * sizeof *Gb);
                if (gru) memset(Ab, 0, (size_t)H * sizeof *Ab);
                continue;
            }
            if (gru) gru_cell_back(l, Gb, Ab, P + b * T * H, dhb, tmp + b * H);
            else lstm_cell_back(l, Gb, Ab, dhb, db);
        }
        if (k == 0) break;
        /* d h_{t-1} = dG U^T (+ the carried dh of masked rows, + dh z for a gru) */
        float *nd = tmp + B * H * (gru ? 1 : 0); /* a gru's tmp rows hold dh z */
        if (gru) {
            loom_sgemm(false, true, (int)B, (int)H, (int)(2 * H), 1.f, G, (int)(T * gH), p.U, (int)gH, 0.f, nd, (int)H);
            loom_sgemm(false, true, (int)B, (int)H, (int)H, 1.f, A, (int)(T * H), p.U + 2 * H, (int)gH, 1.f, nd,
                       (int)H);
        } else {
            loom_sgemm(false, true, (int)B, (int)H, (int)gH, 1.f, G, (int)(T * gH), p.U, (int)gH, 0.f, nd, (int)H);
        }
        for (int64_t b = 0; b < B; b++) {
            bool on = !mk || mk[b * T + t];
            float *dhb = dh + b * H;
            const float *nb = nd + b * H, *zb = tmp + b * H;
            if (!on) {
                for (int64_t j = 0; j < H; j++) dhb[j] += nb[j]; /* nb is 0 there: dG rows are 0 */
            } else if (gru) {
                for (int64_t j = 0; j < H; j++) dhb[j] = nb[j] + zb[j];
            } else {
                memcpy(dhb, nb, (size_t)H * sizeof *dhb);
            }
        }
    }
    if (dx)
        loom_sgemm(false, true, (int)(B * T), l->D, (int)gH, 1.f, s.G, (int)gH, p.W, (int)gH, beta, dx, l->D);
}
LOOM_CLONES(, void, dir_backward,
            (const loom_model *m, const nn_layer_ *l, int dir, const nn_chunk_ *c, const rnn_io *g, float *dx,
             float beta),
            (m, l, dir, c, g, dx, beta))

float *nn_rnn_backward_(const loom_model *m, int li, nn_chunk_ *c, float *g, float *other)
{
    const nn_layer_ *l = &m->layer[li];
    float *dx = l->needs_dx ? other : NULL;
    if (l->spec.state_of) { /* the gradient goes to the recurrent layer's d h_T (d c_T), its output's is 0 */
        const nn_layer_ *r = &m->layer[l->src[0]];
        for (int64_t b = 0; b < c->B; b++)
            memcpy(dfin_of(r, c->b0 + b) + (l->spec.state_of - 1) * l->H, g + b * l->H, (size_t)l->H * sizeof *g);
        if (dx) memset(dx, 0, (size_t)(c->B * r->n_out) * sizeof *dx);
        return dx;
    }
    for (int d = 0; d < ndir(l); d++) {
        rnn_io gi = io_of(l, d, g);
        dir_backward(m, l, d, c, &gi, dx, d ? 1.f : 0.f);
    }
    return dx;
}

/* ---- parameter gradients over the whole batch ------------------------------------- */

void nn_rnn_param_grads_(const loom_model *m, int li, const float *x, int64_t B, int part, int parts)
{
    const nn_layer_ *l = &m->layer[li];
    if (l->spec.state_of) return; /* a state view has no parameters */
    const int64_t T = l->steps, H = l->H, D = l->D, gH = (int64_t)l->gates * H, R = B * T;
    const bool gru = is_gru(l);
    for (int d = 0; d < ndir(l); d++) {
        rnn_par gp = par_of(m, l, d, true);
        const rnn_buf s = buf_of(l, d, 0);
        float *dW = (float *)gp.W, *dU = (float *)gp.U, *db = (float *)gp.b;
        int64_t r0 = nn_part_row_(m, D, part, parts), r1 = nn_part_row_(m, D, part + 1, parts);
        if (r1 > r0) /* dW rows [r0, r1) = x[:, r0:r1]^T dG */
            loom_sgemm(true, false, (int)(r1 - r0), (int)gH, (int)R, 1.f, x + r0, (int)D, s.G, (int)gH, 0.f,
                       dW + r0 * gH, (int)gH);
        int64_t h0 = nn_part_row_(m, H, part, parts), h1 = nn_part_row_(m, H, part + 1, parts);
        if (h1 > h0 && !gru) /* dU rows [h0, h1) = P[:, h0:h1]^T dG */
            loom_sgemm(true, false, (int)(h1 - h0), (int)gH, (int)R, 1.f, s.P + h0, (int)H, s.G, (int)gH, 0.f,
                       dU + h0 * gH, (int)gH);
        if (h1 > h0 && gru) { /* r and z from dG, n from A (dan r) */
            loom_sgemm(true, false, (int)(h1 - h0), (int)(2 * H), (int)R, 1.f, s.P + h0, (int)H, s.G, (int)gH, 0.f,
                       dU + h0 * gH, (int)gH);
            loom_sgemm(true, false, (int)(h1 - h0), (int)H, (int)R, 1.f, s.P + h0, (int)H, s.A, (int)H, 0.f,
                       dU + h0 * gH + 2 * H, (int)gH);
        }
        if (!db) continue;
        int64_t c0 = gH * part / parts, c1 = gH * (part + 1) / parts;
        for (int64_t j = c0; j < c1; j++) db[j] = 0.f;
        if (gru)
            for (int64_t j = c0; j < c1; j++) db[gH + j] = 0.f;
        for (int64_t r = 0; r < R; r++) {
            const float *gr = s.G + r * gH;
            for (int64_t j = c0; j < c1; j++) db[j] += gr[j];
            if (!gru) continue;
            for (int64_t j = c0; j < c1 && j < 2 * H; j++) db[gH + j] += gr[j];
            for (int64_t j = c0 > 2 * H ? c0 : 2 * H; j < c1; j++) db[gH + j] += s.A[r * H + j - 2 * H];
        }
    }
}

/* ---- one step at a time (the decoder's incremental path, decode_step.c) ---------------
 * A lstm or gru with return_sequences, one direction: output step t depends
 * on steps 0..t alone. The state of a sequence: h (H), lstm's c (H), then
 * scratch: the gates (gates H), gru's h U + b_hh (gates H), the new h and
 * c (2 H). Step t computes what dir_forward computes for it, in its order
 * (x W + b, then + h U for t > 0). */
bool nn_rnn_can_step_(const nn_layer_ *l)
{
    return (l->spec.kind == LOOM_LAYER_LSTM || l->spec.kind == LOOM_LAYER_GRU) && l->spec.return_sequences &&
           !l->spec.return_state && !l->spec.state_of;
}

int64_t nn_rnn_step_state_(const nn_layer_ *l) { return (int64_t)(4 + 2 * l->gates) * l->H; }

void nn_rnn_step_(const loom_model *m, const nn_layer_ *l, float *state, int64_t pos, const float *x, float *y)
{
    const int H = l->H, gH = l->gates * H;
    const rnn_par p = par_of(m, l, 0, false);
    float *h = state, *c = h + H, *g = c + H, *hg = g + gH, *hn = hg + gH, *cn = hn + H;
    loom_sgemm(false, false, 1, gH, l->D, 1.f, x, l->D, p.W, gH, 0.f, g, gH);
    if (p.b)
        for (int j = 0; j < gH; j++) g[j] += p.b[j];
    if (is_gru(l)) {
        if (pos == 0) memset(hg, 0, (size_t)gH * sizeof *hg);
        else loom_sgemm(false, false, 1, gH, H, 1.f, h, H, p.U, gH, 0.f, hg, gH);
        if (p.b)
            for (int j = 0; j < gH; j++) hg[j] += p.b[gH + j];
        if (pos == 0) memset(h, 0, (size_t)H * sizeof *h);
        gru_cell(l, g, hg, cn, h, hn); /* (cn: the n part of h U, unused) */
    } else {
        if (pos == 0) memset(h, 0, (size_t)2 * H * sizeof *h); /* h and c */
        else loom_sgemm(false, false, 1, gH, H, 1.f, h, H, p.U, gH, 1.f, g, gH);
        lstm_cell(l, g, c, hn, cn);
        memcpy(c, cn, (size_t)H * sizeof *c);
    }
    memcpy(h, hn, (size_t)H * sizeof *h);
    memcpy(y, hn, (size_t)H * sizeof *y);
}
