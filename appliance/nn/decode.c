/* decode.c - decoding a language model one token at a time (loom generate):
 * the generic path (the whole model on the last T tokens, left-padded, once
 * per token), the incremental path (each layer one position at a time with
 * a per-sequence state, for layer kinds that have step ops: nn_step_ops_)
 * and sampling.
 * Threads: a decoder is used by one thread at a time, and its model is not
 * used by another meanwhile. The decoder owns its buffers, borrows the model. */
#include "nn_internal.h"

#include <math.h>
#include <string.h>

struct loom_decoder {
    loom_model *m;
    int64_t     T, V;       /* positions the model reads; logits per position */
    int64_t     pad;        /* the id the context is left-padded with */
    int64_t    *seq;        /* (cap,) the sequence so far */
    int64_t     n, cap;
    loom_tensor x;          /* (1, T) ids, the model's input dtype */
    float      *probs;      /* (predict width,) loom_model_predict's output, unused but required */
    /* the incremental path (inc): every layer has step ops and runs one position at a time */
    bool        inc_ok;     /* the model allows it (and the caller asked for it) */
    bool        inc;        /* in use for the current sequence */
    bool        unbounded;  /* every layer steps at any position (no attention cache nor position table):
                             * the incremental path goes on past T */
    int64_t     fed;        /* positions run through the layers */
    int64_t     dropped;    /* tokens of the sequence no longer in seq (seq[0] is token dropped) */
    float      *state[LOOM_MAX_LAYERS]; /* each layer's per-sequence state, or NULL */
    float      *ybuf[LOOM_MAX_LAYERS];  /* each layer's output at the current position */
    float       xin;        /* the current position's id, as the first layer reads it */
};

/* ---- the decoder ------------------------------------------------------------ */

/* Whether every layer runs position by position: its output (T, ...) and
 * step ops of its kind; the model's one input (T,). */
static bool can_step(const loom_model *m, int64_t T)
{
    if (m->n_inputs != 1 || m->input.rank != 1) return false;
    for (int i = 0; i < m->n_layers; i++) {
        const nn_layer_ *l = &m->layer[i];
        if (l->out.rank < 2 || l->out.dim[0] != T || !nn_step_ops_of_(l)) return false;
        for (int k = 0; k < l->n_src; k++)
            if (l->src[k] < 0 && i != 0) return false; /* the ids feed the first layer only */
    }
    return m->layer[0].spec.kind == LOOM_LAYER_EMBEDDING;
}

int loom_decoder_new(loom_decoder **out, loom_model *m, int64_t pad_id, bool incremental, loom_err *err)
{
    return nn_decoder_new_(out, m, pad_id, incremental, true, err);
}

int nn_decoder_new_(loom_decoder **out, loom_model *m, int64_t pad_id, bool incremental, bool lm_loss, loom_err *err)
{
    *out = NULL;
    char a[96], b[96];
    int brc = nn_model_ready_(m, err); /* the step ops read layer buffers (a sinusoidal table) without a step */
    if (brc) return brc;
    loom_shape os = loom_model_output_shape(m);
    bool ids = m->input_dtype == LOOM_I32 || m->input_dtype == LOOM_I64;
    int64_t T = m->input.rank == 1 ? m->input.dim[0] : 0;
    int64_t V = os.rank >= 1 ? os.dim[os.rank - 1] : 0;
    bool out_ok = os.rank == 1 || (os.rank == 2 && os.dim[0] == T);
    if (m->n_inputs != 1 || !ids || T < 1 || !out_ok || m->n_heads != 1 ||
        (lm_loss && m->loss != LOOM_LOSS_SPARSE_SOFTMAX_CE)) {
        loom_err_set(err, LOOM_ECONFIG, m->where,
                     "model: not a language model: it reads %s %s%s and outputs %s under %s; generate needs one "
                     "input of token ids (T,) (int32 or int64) and an output of logits over the vocabulary, (V,) "
                     "for the next token or (T, V) for each position, under sparse_softmax_cross_entropy",
                     loom_dtype_name(m->input_dtype), loom_shape_str(&m->input, a, sizeof a),
                     m->n_inputs > 1 ? " (and more inputs)" : "", loom_shape_str(&os, b, sizeof b),
                     loom_loss_name(m->loss));
        return loom_err_hint(err, "feed the model the tokenize map's ids (no one_hot map; an embedding layer first) "
                                  "and end it with a dense layer of one unit per vocabulary id");
    }
    if (V >= (1 << 24))
        return loom_err_set(err, LOOM_ECONFIG, m->where, "model: %lld logits per position; generate takes at most "
                            "2^24", (long long)V);
    loom_decoder *d = loom_calloc(1, sizeof *d);
    if (!d) return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating a decoder");
    d->m = m, d->T = T, d->V = V, d->pad = pad_id;
    loom_shape xs = {.rank = 2, .dim = {1, T}};
    int rc = loom_tensor_init(&d->x, m->input_dtype, &xs, err);
    d->cap = 4 * T + 256;
    d->seq = loom_alloc((size_t)d->cap * sizeof *d->seq);
    d->probs = loom_alloc((size_t)loom_model_predict_width(m) * T * sizeof *d->probs);
    if (!rc && (!d->seq || !d->probs)) rc = loom_err_set(err, LOOM_ENOMEM, NULL, "allocating a decoder");
    d->inc_ok = incremental && can_step(m, T);
    d->unbounded = true;
    for (int i = 0; d->inc_ok && i < m->n_layers; i++) d->unbounded &= !nn_step_ops_of_(&m->layer[i])->bounded;
    for (int i = 0; !rc && d->inc_ok && i < m->n_layers; i++) {
        const nn_layer_ *l = &m->layer[i];
        const nn_step_ops_ *ops = nn_step_ops_of_(l);
        int64_t ns = ops->state_floats ? ops->state_floats(l, T) : 0;
        d->ybuf[i] = loom_alloc((size_t)(l->n_out / T) * sizeof(float));
        d->state[i] = ns > 0 ? loom_alloc((size_t)ns * sizeof(float)) : NULL;
        if (!d->ybuf[i] || (ns > 0 && !d->state[i])) rc = loom_err_set(err, LOOM_ENOMEM, NULL, "allocating a decoder");
    }
    if (!rc) rc = loom_model_set_threads(m, 1, err); /* one example: chunks would only wait for each other */
    if (rc) {
        loom_decoder_free(d);
        return rc;
    }
    loom_decoder_reset(d);
    *out = d;
    return LOOM_OK;
}

void loom_decoder_free(loom_decoder *d)
{
    if (!d) return;
    for (int i = 0; i < LOOM_MAX_LAYERS; i++) {
        loom_free(d->ybuf[i]);
        loom_free(d->state[i]);
    }
    loom_tensor_fini(&d->x);
    loom_free(d->seq);
    loom_free(d->probs);
    loom_free(d);
}

int64_t loom_decoder_context(const loom_decoder *d) { return d->T; }
int64_t loom_decoder_vocab(const loom_decoder *d) { return d->V; }
bool    loom_decoder_incremental(const loom_decoder *d) { return d->inc; }

void loom_decoder_reset(loom_decoder *d)
{
    d->n = 0;
    d->fed = 0;
    d->dropped = 0;
    d->inc = d->inc_ok;
    for (int i = 0; d->inc && i < d->m->n_layers; i++) {
        const nn_layer_ *l = &d->m->layer[i];
        const nn_step_ops_ *ops = nn_step_ops_of_(l);
        int64_t ns = ops->state_floats ? ops->state_floats(l, d->T) : 0;
        if (ops->reset) ops->reset(l, d->state[i]);
        else if (ns > 0) memset(d->state[i], 0, (size_t)ns * sizeof(float));
    }
}

int loom_decoder_push(loom_decoder *d, int64_t id, loom_err *err)
{
    if (d->n == d->cap) { /* only the last T are read, and those not yet fed: keep those */
        int64_t unfed = d->n - (d->fed - d->dropped), keep = d->T > unfed ? d->T : unfed;
        if (keep == d->cap) { /* a prompt longer than the buffer, not fed yet: grow it */
            int64_t *p = loom_realloc(d->seq, (size_t)(2 * d->cap) * sizeof *p);
            if (!p) return loom_err_set(err, LOOM_ENOMEM, NULL, "a sequence of %lld tokens", (long long)d->n);
            d->seq = p, d->cap *= 2;
        } else {
            memmove(d->seq, d->seq + d->n - keep, (size_t)keep * sizeof *d->seq);
            d->dropped += d->n - keep;
            d->n = keep;
        }
    }
    d->seq[d->n++] = id;
    return LOOM_OK;
}

/* The layers on one position (id) of the sequence, in the executor's order. */
static void step_position(loom_decoder *d, int64_t id)
{
    loom_model *m = d->m;
    d->xin = (float)id;
    for (int i = 0; i < m->n_layers; i++) {
        const nn_layer_ *l = &m->layer[i];
        const float *x[LOOM_MAX_LAYER_INPUTS];
        for (int k = 0; k < l->n_src; k++) x[k] = l->src[k] < 0 ? &d->xin : d->ybuf[l->src[k]];
        if (l->n_src == 0) x[0] = i ? d->ybuf[i - 1] : &d->xin;
        nn_step_ops_of_(l)->step(m, l, d->state[i], d->fed, x, d->ybuf[i]);
    }
    d->fed++;
}

/* The generic path: the model on the last T tokens. An output (V,) is the
 * next token's: the tokens are left-padded. An output (T, V) has each
 * position's: a sequence shorter than T is right-padded and row n - 1 read,
 * which a causal model computes from the sequence alone, its positions
 * counted from 0 as in training (the incremental path's rows). The logits
 * are the output layer's rows, before the softmax predict applies. */
static int generic_logits(loom_decoder *d, const float **out, loom_err *err)
{
    loom_model *m = d->m;
    bool rows = loom_model_output_shape(m).rank == 2;
    int64_t k = d->n < d->T ? d->n : d->T, p = rows ? 0 : d->T - k;
    for (int64_t t = 0; t < d->T; t++) {
        int64_t id = t < p || t >= p + k ? d->pad : d->seq[d->n - k + (t - p)];
        if (d->x.dtype == LOOM_I64) ((int64_t *)d->x.data)[t] = id;
        else ((int32_t *)d->x.data)[t] = (int32_t)id;
    }
    int rc = loom_model_predict(m, &d->x, d->probs, err);
    if (rc) return rc;
    const float *z = m->chunk[0].act[m->n_layers]; /* (1, [T,] V): one example, in chunk 0 */
    *out = z + (rows ? (p + k - 1) * d->V : 0);
    return LOOM_OK;
}

int loom_decoder_logits(loom_decoder *d, const float **out, loom_err *err)
{
    if (d->n < 1) return loom_err_set(err, LOOM_EUSAGE, NULL, "decoding needs at least one token of context");
    if (d->inc && !d->unbounded && d->dropped + d->n > d->T) d->inc = false; /* past the window: the generic path slides it */
    if (!d->inc) return generic_logits(d, out, err);
    while (d->fed < d->dropped + d->n) step_position(d, d->seq[d->fed - d->dropped]);
    *out = d->ybuf[d->m->n_layers - 1];
    return LOOM_OK;
}

/* ---- sampling --------------------------------------------------------------- */

int64_t loom_decode_sample(const float *logits, int64_t lo, int64_t hi, double temperature, int64_t top_k,
                           loom_rng *rng, float *scratch)
{
    LOOM_ASSERT(lo < hi);
    int64_t best = lo;
    for (int64_t i = lo + 1; i < hi; i++)
        if (logits[i] > logits[best]) best = i; /* the lowest id among equal maxima */
    int64_t n = hi - lo;
    if (temperature <= 0 || top_k == 1 || !isfinite(logits[best])) return best;
    /* the k-th largest logit: ids above it are kept, ids equal to it in id order until k are */
    float cut = -INFINITY;
    int64_t n_eq = n;
    if (top_k > 0 && top_k < n) {
        memcpy(scratch, logits + lo, (size_t)n * sizeof *scratch);
        int64_t l = 0, r = n - 1, want = top_k - 1; /* quickselect, descending */
        while (l < r) {
            float piv = scratch[(l + r) / 2];
            int64_t i = l, j = r;
            while (i <= j) {
                while (scratch[i] > piv) i++;
                while (scratch[j] < piv) j--;
                if (i <= j) {
                    float t = scratch[i];
                    scratch[i++] = scratch[j];
                    scratch[j--] = t;
                }
            }
            if (want <= j) r = j;
            else if (want >= i) l = i;
            else break;
        }
        cut = scratch[want];
        int64_t above = 0;
        for (int64_t i = lo; i < hi; i++) above += logits[i] > cut;
        n_eq = top_k - above;
    }
    double inv = 1.0 / temperature, sum = 0, zmax = logits[best];
    int64_t eq = n_eq;
    for (int64_t i = lo; i < hi; i++) {
        bool keep = logits[i] > cut || (logits[i] == cut && eq-- > 0);
        scratch[i - lo] = keep ? (float)exp((logits[i] - zmax) * inv) : 0.f;
        sum += scratch[i - lo];
    }
    double u = loom_rng_uniform64(rng) * sum, c = 0;
    int64_t last = best;
    for (int64_t i = lo; i < hi; i++) {
        if (scratch[i - lo] <= 0) continue;
        c += scratch[i - lo];
        last = i;
        if (u < c) return i;
    }
    return last; /* u at the sum's rounding edge */
}
