/* test_decode.c - nn/decode.c, the decoder of `loom generate`: the generic
 * path's greedy chain against argmax of loom_model_predict on the
 * left-padded windows computed here; the sampler (temperature 0 and top-k 1
 * are the argmax, a seed gives the same draws, top-k draws only the k
 * largest, the draws follow softmax(z / T)); the incremental path's logits
 * against the generic path's at every length, within the window and past
 * it; a model that is not a language model refused at the model block. */
#include "harness.h"
#include "nn/nn.h"
#include "nn/nn_internal.h"

#include <math.h>
#include <stdint.h>

static loom_err err;
static loom_model_spec spec_buf;

enum { T = 4, V = 12 };

static loom_layer_spec layer(loom_layer_kind k, int units, loom_activation a)
{
    loom_layer_spec s = {0};
    s.kind = k;
    s.units = units;
    s.activation = a;
    s.kernel_init = LOOM_INIT_GLOROT_UNIFORM;
    s.use_bias = true;
    s.input_dim = V;
    s.output_dim = 5;
    snprintf(s.loc.file, sizeof s.loc.file, "test.cfg");
    s.loc.line = 10;
    return s;
}

/* embedding (V, 5) over ids (T,) -> flatten -> dense 16 tanh -> dense V, sparse softmax CE */
static loom_model *lm(loom_dtype ids, uint64_t seed)
{
    memset(&spec_buf, 0, sizeof spec_buf);
    snprintf(spec_buf.loc.file, sizeof spec_buf.loc.file, "test.cfg");
    spec_buf.loc.line = 5;
    spec_buf.loss = LOOM_LOSS_SPARSE_SOFTMAX_CE;
    snprintf(spec_buf.input, sizeof spec_buf.input, "ids");
    spec_buf.n_layers = 4;
    spec_buf.layer[0] = layer(LOOM_LAYER_EMBEDDING, 0, LOOM_ACT_NONE);
    spec_buf.layer[1] = layer(LOOM_LAYER_FLATTEN, 0, LOOM_ACT_NONE);
    spec_buf.layer[2] = layer(LOOM_LAYER_DENSE, 16, LOOM_ACT_TANH);
    spec_buf.layer[3] = layer(LOOM_LAYER_DENSE, V, LOOM_ACT_NONE);
    loom_shape in = {.rank = 1, .dim = {T}}, lab = {.rank = 0};
    loom_model *m = NULL;
    if (loom_model_new(&m, &spec_buf, &in, ids, &lab, LOOM_I64, 8, &err)) {
        printf("# model_new: %s: %s\n", err.where, err.msg);
        return NULL;
    }
    loom_model_init_params(m, seed);
    float *p = loom_model_params(m); /* larger weights: a sharper, less tied distribution */
    for (int64_t i = 0; i < loom_model_num_params(m); i++) p[i] *= 3.f;
    return m;
}

static int64_t argmax(const float *p, int64_t lo, int64_t hi)
{
    int64_t b = lo;
    for (int64_t i = lo + 1; i < hi; i++)
        if (p[i] > p[b]) b = i;
    return b;
}

/* greedy decoding = the argmax chain of predict on the left-padded last T tokens */
static void test_greedy_chain(void)
{
    for (int d = 0; d < 2; d++) {
        loom_dtype dt = d ? LOOM_I32 : LOOM_I64;
        loom_model *m = lm(dt, 3);
        CHECK(m != NULL);
        if (!m) return;
        loom_decoder *dec = NULL;
        CHECK(loom_decoder_new(&dec, m, 0, true, &err) == LOOM_OK);
        CHECK(loom_decoder_context(dec) == T && loom_decoder_vocab(dec) == V);
        CHECK(!loom_decoder_incremental(dec)); /* flatten + dense: no step ops */
        int64_t seq[64] = {5, 2};
        int64_t n = 2;
        for (int64_t i = 0; i < n; i++) CHECK(loom_decoder_push(dec, seq[i], &err) == LOOM_OK);
        loom_shape xs = {.rank = 2, .dim = {1, T}};
        loom_tensor x;
        CHECK(loom_tensor_init(&x, dt, &xs, &err) == LOOM_OK);
        float probs[V], scratch[V];
        int64_t moved = 0;
        for (int k = 0; k < 20; k++) {
            const float *z;
            CHECK(loom_decoder_logits(dec, &z, &err) == LOOM_OK);
            int64_t got = loom_decode_sample(z, 1, V, 0.0, 0, NULL, scratch);
            for (int t = 0; t < T; t++) { /* the window, here */
                int64_t id = n - T + t < 0 ? 0 : seq[n - T + t];
                if (dt == LOOM_I64) ((int64_t *)x.data)[t] = id;
                else ((int32_t *)x.data)[t] = (int32_t)id;
            }
            CHECK(loom_model_predict(m, &x, probs, &err) == LOOM_OK);
            int64_t want = argmax(probs, 1, V);
            CHECK_MSG(got == want, "token %d: decoder %lld, argmax of predict %lld", k, (long long)got, (long long)want);
            moved += got != seq[n - 1];
            seq[n++] = got;
            CHECK(loom_decoder_push(dec, got, &err) == LOOM_OK);
        }
        CHECK(moved > 0); /* not a fixed point from the start: the window moved */
        loom_tensor_fini(&x);
        loom_decoder_free(dec);
        loom_model_free(m);
    }
}

static void test_sampler(void)
{
    float z[V], scratch[V];
    for (int i = 0; i < V; i++) z[i] = (float)(i % 5) * 0.7f - (float)i * 0.05f; /* max at 4, then 9 */
    z[0] = 100.f;                                                               /* outside [1, V): never drawn */
    CHECK(loom_decode_sample(z, 1, V, 0.0, 0, NULL, scratch) == 4);
    loom_rng a, b;
    loom_rng_init(&a, 42, 0, 0, 0);
    CHECK(loom_decode_sample(z, 1, V, 1.5, 1, &a, scratch) == 4); /* top-k 1 */
    loom_rng_init(&a, 42, 0, 0, 0);
    loom_rng_init(&b, 42, 0, 0, 0);
    int64_t count[V] = {0};
    const int N = 60000;
    bool same = true;
    for (int k = 0; k < N; k++) {
        int64_t x = loom_decode_sample(z, 1, V, 1.0, 0, &a, scratch);
        same &= x == loom_decode_sample(z, 1, V, 1.0, 0, &b, scratch);
        count[x]++;
    }
    CHECK(same);
    CHECK(count[0] == 0);
    double zmax = z[4], sum = 0;
    for (int i = 1; i < V; i++) sum += exp(z[i] - zmax);
    for (int i = 1; i < V; i++) { /* 5 standard deviations */
        double p = exp(z[i] - zmax) / sum, sd = sqrt(N * p * (1 - p));
        CHECK_MSG(fabs(count[i] - N * p) < 5 * sd + 1, "id %d: %lld draws, expected %.0f", i, (long long)count[i], N * p);
    }
    memset(count, 0, sizeof count); /* top-k 2 at temperature 0.5: ids 4 and 9 only, in their ratio */
    for (int k = 0; k < N; k++) count[loom_decode_sample(z, 1, V, 0.5, 2, &a, scratch)]++;
    CHECK(count[4] + count[9] == N);
    double p4 = 1 / (1 + exp((z[9] - z[4]) / 0.5));
    CHECK_MSG(fabs(count[4] - N * p4) < 5 * sqrt(N * p4 * (1 - p4)), "id 4: %lld of %d, expected %.0f",
              (long long)count[4], N, N * p4);
    for (int i = 0; i < V; i++) z[i] = 1.f; /* ties at the cut: the lowest ids */
    memset(count, 0, sizeof count);
    for (int k = 0; k < 3000; k++) count[loom_decode_sample(z, 1, V, 1.0, 3, &a, scratch)]++;
    CHECK(count[1] > 0 && count[2] > 0 && count[3] > 0 && count[1] + count[2] + count[3] == 3000);
}

/* emb: embedding (V, 8) -> ln: layer_normalization -> act: tanh -> sum: add(emb, act); output (T, 8), each
 * position from itself only, so every layer has step ops; MSE (no loss takes (T, V) logits yet) */
static void test_incremental(void)
{
    memset(&spec_buf, 0, sizeof spec_buf);
    snprintf(spec_buf.loc.file, sizeof spec_buf.loc.file, "test.cfg");
    spec_buf.loc.line = 5;
    spec_buf.loss = LOOM_LOSS_MSE;
    snprintf(spec_buf.input, sizeof spec_buf.input, "ids");
    spec_buf.n_layers = 4;
    spec_buf.layer[0] = layer(LOOM_LAYER_EMBEDDING, 0, LOOM_ACT_NONE);
    spec_buf.layer[0].output_dim = 8;
    spec_buf.layer[1] = layer(LOOM_LAYER_LAYER_NORM, 0, LOOM_ACT_NONE);
    spec_buf.layer[1].epsilon = 1e-3;
    spec_buf.layer[2] = layer(LOOM_LAYER_ACTIVATION, 0, LOOM_ACT_TANH);
    spec_buf.layer[3] = layer(LOOM_LAYER_ADD, 0, LOOM_ACT_NONE);
    const char *names[4] = {"emb", "ln", "act", "sum"};
    for (int i = 0; i < 4; i++) snprintf(spec_buf.layer[i].name, sizeof spec_buf.layer[i].name, "%s", names[i]);
    spec_buf.layer[3].n_inputs = 2;
    snprintf(spec_buf.layer[3].inputs[0], LOOM_NAME_MAX, "emb");
    snprintf(spec_buf.layer[3].inputs[1], LOOM_NAME_MAX, "act");
    loom_shape in = {.rank = 1, .dim = {T}}, lab = {.rank = 2, .dim = {T, 8}};
    loom_model *m = NULL;
    if (loom_model_new(&m, &spec_buf, &in, LOOM_I64, &lab, LOOM_F32, 1, &err)) printf("# %s: %s\n", err.where, err.msg);
    CHECK(m != NULL);
    if (!m) return;
    loom_model_init_params(m, 5);
    float *p = loom_model_params(m); /* gamma and beta away from 1 and 0 */
    for (int64_t i = 0; i < loom_model_num_params(m); i++) p[i] += 0.1f * (float)(i % 7) - 0.2f;
    loom_decoder *inc = NULL, *gen = NULL;
    CHECK(loom_decoder_new(&inc, m, 0, true, &err) == LOOM_ECONFIG); /* MSE: not a language model's loss */
    CHECK(nn_decoder_new_(&inc, m, 0, true, false, &err) == LOOM_OK);
    CHECK(nn_decoder_new_(&gen, m, 0, false, false, &err) == LOOM_OK);
    CHECK(loom_decoder_incremental(inc) && !loom_decoder_incremental(gen));
    const int64_t ids[10] = {3, 7, 1, 11, 0, 4, 4, 9, 2, 6};
    float a[8];
    for (int n = 1; n <= 10; n++) {
        const float *z;
        CHECK(loom_decoder_push(inc, ids[n - 1], &err) == LOOM_OK && loom_decoder_push(gen, ids[n - 1], &err) == LOOM_OK);
        CHECK(loom_decoder_logits(inc, &z, &err) == LOOM_OK);
        memcpy(a, z, sizeof a);
        CHECK(loom_decoder_incremental(inc)); /* every position from itself: the incremental path goes on past T */
        CHECK(loom_decoder_logits(gen, &z, &err) == LOOM_OK);
        float worst = 0;
        for (int e = 0; e < 8; e++) worst = fmaxf(worst, fabsf(a[e] - z[e]));
        CHECK_MSG(worst < 1e-5f, "%d tokens: incremental and generic logits differ by %g", n, worst);
    }
    loom_decoder_reset(inc); /* a new sequence starts from a reset state */
    CHECK(loom_decoder_incremental(inc));
    const float *z;
    CHECK(loom_decoder_push(inc, 3, &err) == LOOM_OK && loom_decoder_logits(inc, &z, &err) == LOOM_OK);
    memcpy(a, z, sizeof a);
    loom_decoder_reset(gen);
    CHECK(loom_decoder_push(gen, 3, &err) == LOOM_OK && loom_decoder_logits(gen, &z, &err) == LOOM_OK);
    CHECK(fabsf(a[0] - z[0]) < 1e-5f && fabsf(a[7] - z[7]) < 1e-5f);
    loom_decoder_free(inc);
    loom_decoder_free(gen);
    loom_model_free(m);
}

/* A language model of sequence layers: emb (V, 8) -> body -> dense V on each step, sparse softmax
 * cross-entropy per token, for sequences of Tn; params shaken (biases and tables away from 0). */
static loom_model *seq_lm(int body, int64_t Tn)
{
    memset(&spec_buf, 0, sizeof spec_buf);
    snprintf(spec_buf.loc.file, sizeof spec_buf.loc.file, "test.cfg");
    spec_buf.loc.line = 5;
    spec_buf.loss = LOOM_LOSS_SPARSE_SOFTMAX_CE;
    snprintf(spec_buf.input, sizeof spec_buf.input, "ids");
    loom_layer_spec *L = spec_buf.layer;
    int n = 0;
    L[n] = layer(LOOM_LAYER_EMBEDDING, 0, LOOM_ACT_NONE);
    L[n++].output_dim = 8;
    if (body <= 1) { /* lstm or gru, every step */
        L[n] = layer(body ? LOOM_LAYER_GRU : LOOM_LAYER_LSTM, 6, LOOM_ACT_TANH);
        L[n].recurrent_activation = LOOM_ACT_SIGMOID, L[n].reset_after = true, L[n++].return_sequences = true;
    } else { /* positional (sinusoidal) -> causal attention -> add -> layer_norm -> dense 8 relu */
        L[n] = layer(LOOM_LAYER_POSITIONAL_EMBEDDING, 0, LOOM_ACT_NONE);
        L[n].max_length = (int)Tn, L[n++].pos_mode = LOOM_POS_SINUSOIDAL;
        L[n] = layer(LOOM_LAYER_MULTI_HEAD_ATTENTION, 0, LOOM_ACT_NONE);
        L[n].num_heads = 2, L[n].key_dim = 3, L[n++].causal = true;
        L[n] = layer(LOOM_LAYER_ADD, 0, LOOM_ACT_NONE);
        L[n].n_inputs = 2;
        snprintf(L[n].inputs[0], LOOM_NAME_MAX, "l1");
        snprintf(L[n++].inputs[1], LOOM_NAME_MAX, "l2");
        L[n] = layer(LOOM_LAYER_LAYER_NORM, 0, LOOM_ACT_NONE);
        L[n++].epsilon = 1e-3;
        L[n++] = layer(LOOM_LAYER_DENSE, 8, LOOM_ACT_RELU);
    }
    L[n++] = layer(LOOM_LAYER_DENSE, V, LOOM_ACT_NONE);
    spec_buf.n_layers = n;
    for (int i = 0; i < n; i++) snprintf(L[i].name, sizeof L[i].name, "l%d", i);
    loom_shape in = {.rank = 1, .dim = {Tn}}, lab = {.rank = 1, .dim = {Tn}};
    loom_model *m = NULL;
    if (loom_model_new(&m, &spec_buf, &in, LOOM_I64, &lab, LOOM_I64, 2, &err)) {
        printf("# model_new: %s: %s\n", err.where, err.msg);
        return NULL;
    }
    loom_model_init_params(m, 11);
    loom_rng r;
    loom_rng_init(&r, 11, 9, 0, 0);
    float *p = loom_model_params(m);
    for (int64_t k = 0; k < loom_model_num_params(m); k++) p[k] += 0.3f * loom_rng_normal(&r);
    return m;
}

static float max_diff(const float *a, const float *b, int n)
{
    float w = 0;
    for (int e = 0; e < n; e++) w = fmaxf(w, fabsf(a[e] - b[e]));
    return w;
}

/* lstm, gru (a state), causal attention (a KV cache): the incremental path's logits equal the generic
 * path's for every length up to T; past T an RNN's state carries on (the generic path of the same weights
 * over a window of 3 T, which sees the whole sequence), attention falls back to the generic path */
static void test_incremental_seq(void)
{
    const char *what[3] = {"lstm", "gru", "attention"};
    for (int body = 0; body < 3; body++) {
        loom_model *m = seq_lm(body, T), *wide = seq_lm(body, 3 * T);
        CHECK(m && wide);
        if (!m || !wide) return;
        CHECK(loom_model_num_params(m) == loom_model_num_params(wide));
        memcpy(loom_model_params(wide), loom_model_params(m), (size_t)loom_model_num_params(m) * sizeof(float));
        loom_decoder *inc = NULL, *gen = NULL, *ref = NULL;
        CHECK(loom_decoder_new(&inc, m, 0, true, &err) == LOOM_OK);
        CHECK(loom_decoder_new(&gen, m, 0, false, &err) == LOOM_OK);
        CHECK(loom_decoder_new(&ref, wide, 0, false, &err) == LOOM_OK);
        CHECK_MSG(loom_decoder_incremental(inc), "%s: incremental", what[body]);
        loom_rng r;
        loom_rng_init(&r, 3, 0, 0, 0);
        float a[V], scratch[V];
        int64_t id = 4;
        for (int n = 1; n <= 3 * T; n++) {
            const float *z;
            CHECK(loom_decoder_push(inc, id, &err) == LOOM_OK && loom_decoder_push(gen, id, &err) == LOOM_OK &&
                  loom_decoder_push(ref, id, &err) == LOOM_OK);
            CHECK(loom_decoder_logits(inc, &z, &err) == LOOM_OK);
            memcpy(a, z, sizeof a);
            bool carries = body < 2;
            CHECK_MSG(loom_decoder_incremental(inc) == (n <= T || carries), "%s, %d tokens", what[body], n);
            CHECK(loom_decoder_logits(n <= T || !carries ? gen : ref, &z, &err) == LOOM_OK);
            float w = max_diff(a, z, V);
            CHECK_MSG(w < 2e-5f, "%s, %d tokens: incremental and generic logits differ by %g", what[body], n, w);
            id = loom_decode_sample(a, 1, V, 1.0, 0, &r, scratch); /* a sampled sequence */
        }
        loom_decoder_free(inc);
        loom_decoder_free(gen);
        loom_decoder_free(ref);
        loom_model_free(m);
        loom_model_free(wide);
    }
}

/* a float input (one-hot windows) is not a language model: refused at the model block */
static void test_not_lm(void)
{
    memset(&spec_buf, 0, sizeof spec_buf);
    snprintf(spec_buf.loc.file, sizeof spec_buf.loc.file, "lm.cfg");
    spec_buf.loc.line = 7;
    spec_buf.loss = LOOM_LOSS_SPARSE_SOFTMAX_CE;
    spec_buf.n_layers = 2;
    spec_buf.layer[0] = layer(LOOM_LAYER_FLATTEN, 0, LOOM_ACT_NONE);
    spec_buf.layer[1] = layer(LOOM_LAYER_DENSE, V, LOOM_ACT_NONE);
    loom_shape in = {.rank = 2, .dim = {T, V}}, lab = {.rank = 0};
    loom_model *m = NULL;
    CHECK(loom_model_new(&m, &spec_buf, &in, LOOM_F32, &lab, LOOM_I64, 1, &err) == LOOM_OK);
    loom_decoder *d = NULL;
    CHECK(loom_decoder_new(&d, m, 0, true, &err) == LOOM_ECONFIG && d == NULL);
    CHECK_CONTAINS(err.where, "lm.cfg:7");
    CHECK_CONTAINS(err.msg, "not a language model");
    CHECK_CONTAINS(err.msg, "token ids (T,)");
    loom_model_free(m);
}

static const loom_test tests[] = {
    {"greedy_chain", test_greedy_chain},
    {"sampler", test_sampler},
    {"incremental", test_incremental},
    {"incremental_seq", test_incremental_seq},
    {"not_lm", test_not_lm},
    {0},
};

int main(void)
{
    if (loom_blas_init(1, &err) != LOOM_OK) {
        printf("Bail out! %s\n", err.msg);
        return 1;
    }
    return loom_test_run(tests);
}
