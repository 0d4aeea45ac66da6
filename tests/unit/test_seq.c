/* test_seq.c - sequences in the model (issue 24): dense on the last axis of
 * a (T, D) input, the time mask an embedding with mask_zero carries, the
 * per-token sparse softmax cross-entropy (mean over unmasked tokens, labels
 * equal to model.ignore_label masked), token accuracy and perplexity; the
 * recurrent layers (lstm, gru, bidirectional) against PyTorch-computed
 * numbers and central differences. */
#include "harness.h"
#include "nn/nn.h"
#include "spec_fixtures.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static loom_err err;
/* An embedding named "emb" (spec_fixtures.h) that masks id 0 or not. */
static loom_layer_spec L_emb_mask(int64_t rows, int dim, bool mask_zero)
{
    loom_layer_spec s = L_emb(rows, dim, LOOM_COMBINER_SUM);
    s.mask_zero = mask_zero;
    return s;
}

/* A dense layer named dense_<units>: the PyTorch comparison finds its kernel by name. */
static loom_layer_spec L_dense_named(int units, loom_activation a)
{
    loom_layer_spec s = L_dense(units, a);
    snprintf(s.name, sizeof s.name, "dense_%d", units);
    return s;
}

/* test.cfg's model over "ids": sparse softmax CE with ignore_label -100,
 * token accuracy and perplexity. */
static const loom_model_spec *mk_seq(int n, const loom_layer_spec *layers)
{
    loom_model_spec *s = mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, n, layers);
    snprintf(s->input, sizeof s->input, "ids");
    s->ignore_label = -100;
    s->metrics_set = true;
    s->n_metrics = 2;
    s->metric[0] = LOOM_METRIC_ACCURACY;
    s->metric[1] = LOOM_METRIC_PERPLEXITY;
    return s;
}

/* A model over ids (B, T) with labels (B, T) of V classes. */
typedef struct fixture {
    loom_model *m;
    loom_tensor x, y;
    int64_t     B, T, V;
} fixture;

static int fixture_new2(fixture *f, int n, const loom_layer_spec *ls, int64_t B, int64_t T, int64_t V, uint64_t seed,
                        bool per_token)
{
    memset(f, 0, sizeof *f);
    loom_shape in = {.rank = 1, .dim = {T}}, lab = {.rank = per_token ? 1 : 0, .dim = {T}};
    int rc = loom_model_new(&f->m, mk_seq(n, ls), &in, LOOM_I32, &lab, LOOM_I32, B, &err);
    if (rc) {
        printf("# model_new: %s: %s\n", err.where, err.msg);
        return rc;
    }
    f->B = B, f->T = T, f->V = V;
    loom_model_init_params(f->m, seed);
    loom_shape xs = {.rank = 2, .dim = {B, T}}, ys = per_token ? xs : (loom_shape){.rank = 1, .dim = {B}};
    loom_tensor_init(&f->x, LOOM_I32, &xs, &err);
    loom_tensor_init(&f->y, LOOM_I32, &xs, &err);
    f->y.shape = ys;
    loom_rng r;
    loom_rng_init(&r, seed, 3, 0, 0);
    int32_t *x = f->x.data, *y = f->y.data;
    for (int64_t b = 0; b < B; b++) {
        int64_t len = T - b % 3; /* trailing padding (id 0) on some examples */
        for (int64_t t = 0; t < T; t++) {
            x[b * T + t] = t < len ? 1 + (int32_t)loom_rng_below(&r, (uint64_t)V - 1) : 0;
            y[b * T + t] = (int32_t)loom_rng_below(&r, (uint64_t)V);
        }
    }
    return LOOM_OK;
}

static int fixture_new(fixture *f, int n, const loom_layer_spec *ls, int64_t B, int64_t T, int64_t V, uint64_t seed)
{
    return fixture_new2(f, n, ls, B, T, V, seed, true);
}

static void fixture_free(fixture *f)
{
    loom_model_free(f->m);
    loom_tensor_fini(&f->x);
    loom_tensor_fini(&f->y);
}

static double step(fixture *f)
{
    double loss = 0;
    int64_t correct;
    int rc = loom_model_train_step(f->m, &f->x, &f->y, f->B, 1, &loss, &correct, &err);
    if (rc) printf("# step: %s: %s\n", err.where, err.msg);
    LOOM_ASSERT(rc == LOOM_OK);
    return loss;
}

static double gc_loss(void *ctx) { return step(ctx); }

/* Every parameter against central differences of the summed loss. */
static void gradcheck(fixture *f, const char *what, float eps)
{
    int64_t P = loom_model_num_params(f->m);
    float *p = loom_model_params(f->m), *ga = malloc((size_t)P * sizeof *ga);
    step(f);
    memcpy(ga, loom_model_grads(f->m), (size_t)P * sizeof *ga);
    harness_gradcheck g = harness_gradcheck_run(what, p, ga, P, 1, eps, (double)f->B, gc_loss, f, NULL, 0);
    CHECK(g.tested > 20);
    CHECK_MSG(g.bad == 0, "%s: %lld of %lld gradients off", what, g.bad, g.tested);
    free(ga);
}

/* ---- the per-token loss -------------------------------------------------------- */

/* The loss of evaluate against softmax probabilities by hand: each example's
 * mean over its tokens with a nonzero id and a label not ignore_label; the
 * token accuracy and perplexity from the same tokens. */
static void test_token_loss(void)
{
    loom_layer_spec ls[3] = {L_emb_mask(7, 3, true), L_dense_named(5, LOOM_ACT_TANH), L_dense_named(6, LOOM_ACT_NONE)};
    fixture f;
    if (fixture_new(&f, 3, ls, 5, 4, 6, 21)) {
        CHECK(0);
        return;
    }
    int32_t *x = f.x.data, *y = f.y.data;
    y[1 * 4 + 1] = -100; /* an ignored label on a real token */
    float *p = malloc((size_t)(f.B * f.T * f.V) * sizeof *p);
    CHECK(loom_model_predict_width(f.m) == f.T * f.V);
    CHECK(loom_model_predict(f.m, &f.x, p, &err) == LOOM_OK);
    double want = 0, tl = 0;
    int64_t tn = 0, right = 0;
    for (int64_t b = 0; b < f.B; b++) {
        double s = 0;
        int n = 0;
        for (int64_t t = 0; t < f.T; t++) {
            int64_t r = b * f.T + t;
            if (!x[r] || y[r] == -100) continue;
            const float *pr = p + r * f.V;
            double ce = -log((double)pr[y[r]]);
            int am = 0;
            for (int j = 1; j < f.V; j++) am = pr[j] > pr[am] ? j : am;
            s += ce, n++, right += am == y[r];
        }
        want += n ? s / n : 0;
        tl += s, tn += n;
    }
    double loss;
    int64_t correct;
    double acc[8] = {0};
    loom_model_metrics_take(f.m, NULL);
    CHECK(loom_model_evaluate(f.m, &f.x, &f.y, &loss, &correct, &err) == LOOM_OK);
    CHECK_NEAR(loss, want, 1e-5 * fabs(want));
    CHECK(loom_model_metrics_size(f.m) == 4);
    loom_model_metrics_take(f.m, acc);
    CHECK_NEAR(loom_model_metric_value(f.m, 0, acc, correct, f.B), (double)right / (double)tn, 1e-12);
    CHECK_NEAR(loom_model_metric_value(f.m, 1, acc, correct, f.B), exp(tl / (double)tn), 1e-4 * exp(tl / tn));
    free(p);
    fixture_free(&f);
}

/* The whole model (embedding with its mask, dense on the last axis twice,
 * the per-token loss) against central differences, with 1 and 2 threads
 * giving the same bits. */
static void test_token_gradcheck(void)
{
    loom_layer_spec ls[3] = {L_emb_mask(7, 3, true), L_dense_named(5, LOOM_ACT_TANH), L_dense_named(6, LOOM_ACT_NONE)};
    float *g1 = NULL;
    for (int th = 1; th <= 2; th++) {
        fixture f;
        if (fixture_new(&f, 3, ls, 5, 4, 6, 22)) {
            CHECK(0);
            return;
        }
        ((int32_t *)f.y.data)[7] = -100;
        CHECK(loom_model_set_threads(f.m, th, &err) == LOOM_OK);
        int64_t P = loom_model_num_params(f.m);
        if (th == 1) {
            gradcheck(&f, "embedding + dense (T, D) + per-token loss", 1e-2f);
            step(&f);
            g1 = malloc((size_t)P * sizeof *g1);
            memcpy(g1, loom_model_grads(f.m), (size_t)P * sizeof *g1);
        } else {
            step(&f);
            CHECK(!memcmp(g1, loom_model_grads(f.m), (size_t)P * sizeof *g1));
        }
        fixture_free(&f);
    }
    free(g1);
}

/* Bad shapes and labels: labels (T,) against a (T', V) output, a label
 * outside the classes names the example and step. */
static void test_token_errors(void)
{
    loom_layer_spec ls[2] = {L_emb_mask(7, 3, true), L_dense_named(6, LOOM_ACT_NONE)};
    loom_model *m;
    loom_shape in = {.rank = 1, .dim = {4}}, lab = {.rank = 1, .dim = {3}};
    CHECK(loom_model_new(&m, mk_seq(2, ls), &in, LOOM_I32, &lab, LOOM_I32, 2, &err) == LOOM_ESHAPE);
    CHECK(strstr(err.msg, "per token") != NULL);
    fixture f;
    if (fixture_new(&f, 2, ls, 2, 4, 6, 5)) {
        CHECK(0);
        return;
    }
    ((int32_t *)f.y.data)[6] = 6;
    double loss;
    int64_t correct;
    CHECK(loom_model_evaluate(f.m, &f.x, &f.y, &loss, &correct, &err) == LOOM_EDATA);
    CHECK_MSG(strstr(err.msg, "example 1 in the batch, step 2, is 6") != NULL, "%s", err.msg);
    fixture_free(&f);
}

/* ---- recurrent layers ------------------------------------------------------------ */

static loom_layer_spec L_rnn(loom_layer_kind k, int units, bool seq)
{
    loom_layer_spec s = {0};
    s.kind = k;
    s.units = units;
    s.return_sequences = seq;
    s.activation = LOOM_ACT_TANH;
    s.recurrent_activation = LOOM_ACT_SIGMOID;
    s.reset_after = true;
    s.use_bias = true;
    snprintf(s.name, sizeof s.name, "rnn");
    return s;
}

/* Keras' defaults for a recurrence's start: the recurrent kernel orthogonal
 * (its (H, gates H) rows orthonormal: R R^T = I), an lstm's forget-gate bias
 * at 1 (i f g o: the second H of the bias), the input kernel Glorot. */
static const float *param_named(loom_model *m, const char *name, loom_shape *shape)
{
    for (int i = 0;; i++) {
        const loom_param_info *p = loom_model_param_tensor(m, i);
        if (!p) return NULL;
        if (!strcmp(p->name, name)) {
            *shape = p->shape;
            return loom_model_params(m) + p->offset;
        }
    }
}

static void check_orthonormal_rows(const char *what, const float *w, int64_t rows, int64_t cols)
{
    double worst = 0;
    for (int64_t a = 0; a < rows; a++)
        for (int64_t b = 0; b <= a; b++) {
            double d = 0;
            for (int64_t k = 0; k < cols; k++) d += (double)w[a * cols + k] * w[b * cols + k];
            double e = fabs(d - (a == b ? 1.0 : 0.0));
            if (e > worst) worst = e;
        }
    CHECK_MSG(worst < 1e-5, "%s: R R^T differs from I by %.3g", what, worst);
}

static void test_rnn_init(void)
{
    for (int k = 0; k < 3; k++) {
        loom_layer_kind kind = k == 1 ? LOOM_LAYER_GRU : LOOM_LAYER_LSTM;
        loom_layer_spec ls[2] = {L_emb_mask(7, 5, false), L_rnn(kind, 6, false)};
        ls[1].recurrent_init = LOOM_INIT_ORTHOGONAL;
        ls[1].unit_forget_bias = k != 2;
        fixture f;
        CHECK(fixture_new2(&f, 2, ls, 2, 4, 6, 11, false) == LOOM_OK);
        if (!f.m) return;
        loom_shape rs = {0}, bs = {0};
        const float *r = param_named(f.m, "rnn/recurrent_kernel", &rs);
        const float *b = param_named(f.m, "rnn/bias", &bs);
        CHECK(r && b && rs.rank == 2 && rs.dim[0] == 6 && rs.dim[1] == (kind == LOOM_LAYER_GRU ? 18 : 24));
        if (!r || !b) return;
        check_orthonormal_rows(kind == LOOM_LAYER_GRU ? "gru" : "lstm", r, rs.dim[0], rs.dim[1]);
        int bad = 0;
        for (int64_t i = 0; i < loom_shape_numel(&bs); i++) {
            float want = kind == LOOM_LAYER_LSTM && ls[1].unit_forget_bias && i / 6 == 1 ? 1.f : 0.f;
            bad += b[i] != want;
        }
        CHECK_MSG(bad == 0, "case %d: %d bias elements off", k, bad);
        fixture_free(&f);
    }
    /* a kernel with more rows than columns: orthonormal columns (Keras: the (cols, rows) case transposed) */
    loom_layer_spec d[2] = {L_emb_mask(7, 5, false), L_dense_named(3, LOOM_ACT_NONE)};
    d[1].kernel_init = LOOM_INIT_ORTHOGONAL;
    fixture f;
    CHECK(fixture_new2(&f, 2, d, 2, 4, 3, 12, true) == LOOM_OK);
    if (!f.m) return;
    loom_shape ks = {0};
    const float *w = param_named(f.m, "dense_3/kernel", &ks);
    CHECK(w && ks.dim[0] == 5 && ks.dim[1] == 3);
    if (w) {
        float t[15];
        for (int a = 0; a < 5; a++)
            for (int c = 0; c < 3; c++) t[c * 5 + a] = w[a * 3 + c];
        check_orthonormal_rows("dense (5, 3)^T", t, 3, 5);
    }
    fixture_free(&f);
}

/* The bias starts at 0: give it values so its gradient sees a general point. */
static void shake_params(loom_model *m, uint64_t seed)
{
    loom_rng r;
    loom_rng_init(&r, seed, 9, 0, 0);
    float *p = loom_model_params(m);
    for (int64_t k = 0; k < loom_model_num_params(m); k++) p[k] += 0.3f * loom_rng_normal(&r);
}

/* embedding (mask_zero) -> lstm / gru / bidirectional (concat, sum; every
 * step or the last one) -> dense V, against central differences, with the
 * trailing padding masked; 1 and 3 threads give the same bits. */
static void test_rnn_gradcheck(void)
{
    const struct { loom_layer_kind k; int cell, merge; bool seq; const char *what; } cases[] = {
        {LOOM_LAYER_LSTM, 0, 0, true, "lstm, every step"},
        {LOOM_LAYER_LSTM, 0, 0, false, "lstm, last step"},
        {LOOM_LAYER_GRU, 0, 0, true, "gru, every step"},
        {LOOM_LAYER_GRU, 0, 0, false, "gru, last step"},
        {LOOM_LAYER_BIDIRECTIONAL, 0, 0, true, "bidirectional lstm concat, every step"},
        {LOOM_LAYER_BIDIRECTIONAL, 1, 1, false, "bidirectional gru sum, last step"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        loom_layer_spec r = L_rnn(cases[i].k, 3, cases[i].seq);
        r.cell = cases[i].cell, r.merge_mode = cases[i].merge;
        loom_layer_spec ls[3] = {L_emb_mask(7, 2, true), r, L_dense_named(5, LOOM_ACT_NONE)};
        float *g1 = NULL;
        for (int th = 1; th <= 3; th += 2) {
            fixture f;
            if (fixture_new2(&f, 3, ls, 4, 5, 5, 30 + i, cases[i].seq)) {
                CHECK(0);
                return;
            }
            shake_params(f.m, 40 + i);
            CHECK(loom_model_set_threads(f.m, th, &err) == LOOM_OK);
            int64_t P = loom_model_num_params(f.m);
            if (th == 1) {
                gradcheck(&f, cases[i].what, 1e-2f);
                step(&f);
                g1 = malloc((size_t)P * sizeof *g1);
                memcpy(g1, loom_model_grads(f.m), (size_t)P * sizeof *g1);
            } else {
                step(&f);
                CHECK_MSG(!memcmp(g1, loom_model_grads(f.m), (size_t)P * sizeof *g1), "%s: threads", cases[i].what);
            }
            fixture_free(&f);
        }
        free(g1);
    }
}

/* PyTorch 1.13's nn.LSTM / nn.GRU (bidirectional too) on the same numbers,
 * computed once in float64 by tests/unit/test_seq_torch.py: embedding table
 * (5, 3) and the layer's tensors from loom's flat buffer p[k] = 0.5
 * sin(0.37 k + 0.1), mapped as recurrent.c's header says (weight_ih =
 * kernel^T, weight_hh = recurrent_kernel^T, lstm bias_ih = bias and
 * bias_hh = 0, gru bias_ih, bias_hh = bias rows); ids [[1, 2, 3, 4], [3, 1,
 * 2, 0]], the 0 padding as pack_padded_sequence lengths [4, 3] (Keras'
 * mask semantics: zeros out, the last real step's h, the backward
 * direction starting at the last real step). H = 2. */
static const double want_lstm_seq[16] = {0.0437194786, 0.00719648564, 0.0522289308, -0.0139228245, 0.0183559784, -0.0651813156, -0.0156187502, -0.103524619, -0.00709045328, -0.0553466809, 0.0381797939, -0.033840058, 0.0488446204, -0.0372763016, 0, 0};
static const double want_gru_seq[16] = {-0.0484915145, 0.0412848412, -0.0078055463, 0.110963935, 0.010574913, 0.139225609, -0.0504981407, 0.0868252074, 0.0157700852, 0.0850537011, -0.0393212593, 0.0824856287, -0.0028405234, 0.132012234, 0, 0};
static const double want_gru_last[4] = {-0.0504981407, 0.0868252074, -0.0028405234, 0.132012234};
static const double want_bi_lstm_concat_seq[32] = {0.0437194786, 0.00719648564, 0.257822342, 0.220112777, 0.0522289308, -0.0139228245, 0.273304858, 0.215789898, 0.0183559784, -0.0651813156, 0.246829054, 0.174775607, -0.0156187502, -0.103524619, 0.153876817, 0.10215573, -0.00709045328, -0.0553466809, 0.245956152, 0.192445406, 0.0381797939, -0.033840058, 0.170133158, 0.155124828, 0.0488446204, -0.0372763016, 0.124597389, 0.106741991, 0, 0, 0, 0};
static const double want_bi_gru_sum_last[4] = {-0.0504961596, -0.0519583267, -0.031674299, -0.0221872425};
static const double want_lstm_last[4] = {-0.0156187502, -0.103524619, 0.0488446204, -0.0372763016};

static void torch_case(const char *what, loom_layer_kind k, int cell, int merge, bool seq, const double *want, int n)
{
    loom_layer_spec r = L_rnn(k, 2, seq);
    r.cell = cell, r.merge_mode = merge;
    loom_layer_spec ls[2] = {L_emb_mask(5, 3, true), r};
    mk_seq(2, ls);
    spec_buf.loss = LOOM_LOSS_MSE;
    spec_buf.metrics_set = false;
    spec_buf.n_metrics = 0;
    loom_model *m;
    loom_shape in = {.rank = 1, .dim = {4}};
    loom_shape lab = seq ? (loom_shape){.rank = 2, .dim = {4, n / 8}} : (loom_shape){.rank = 1, .dim = {n / 2}};
    if (loom_model_new(&m, &spec_buf, &in, LOOM_I32, &lab, LOOM_F32, 2, &err)) {
        CHECK_MSG(0, "%s: %s", what, err.msg);
        return;
    }
    float *p = loom_model_params(m);
    for (int64_t i = 0; i < loom_model_num_params(m); i++) p[i] = (float)(0.5 * sin(0.37 * (double)i + 0.1));
    int32_t ids[8] = {1, 2, 3, 4, 3, 1, 2, 0};
    loom_tensor x;
    loom_shape xs = {.rank = 2, .dim = {2, 4}};
    loom_tensor_init(&x, LOOM_I32, &xs, &err);
    memcpy(x.data, ids, sizeof ids);
    float out[32];
    CHECK(loom_model_predict_width(m) == n / 2);
    CHECK(loom_model_predict(m, &x, out, &err) == LOOM_OK);
    double worst = 0;
    for (int i = 0; i < n; i++) worst = fmax(worst, fabs(out[i] - want[i]));
    printf("# %s: worst difference from PyTorch %.2e\n", what, worst);
    CHECK_MSG(worst < 1e-5, "%s: %g", what, worst);
    loom_tensor_fini(&x);
    loom_model_free(m);
}

static void test_rnn_torch(void)
{
    torch_case("lstm, every step", LOOM_LAYER_LSTM, 0, 0, true, want_lstm_seq, 16);
    torch_case("lstm, last step", LOOM_LAYER_LSTM, 0, 0, false, want_lstm_last, 4);
    torch_case("gru, every step", LOOM_LAYER_GRU, 0, 0, true, want_gru_seq, 16);
    torch_case("gru, last step", LOOM_LAYER_GRU, 0, 0, false, want_gru_last, 4);
    torch_case("bidirectional lstm concat", LOOM_LAYER_BIDIRECTIONAL, 0, 0, true, want_bi_lstm_concat_seq, 32);
    torch_case("bidirectional gru sum, last step", LOOM_LAYER_BIDIRECTIONAL, 1, 1, false, want_bi_gru_sum_last, 4);
}

/* A recurrent layer on a (features,) input, gru with reset_after = false,
 * mask_zero on (columns, k) ids: each refused at the layer's line, saying
 * what to do. */
static void test_rnn_errors(void)
{
    loom_model *m = NULL;
    loom_layer_spec ls[2] = {L_dense_named(4, LOOM_ACT_NONE), L_rnn(LOOM_LAYER_LSTM, 3, false)};
    mk_seq(2, ls);
    spec_buf.metrics_set = false;
    loom_shape in = {.rank = 1, .dim = {6}}, lab = {.rank = 0};
    CHECK(loom_model_new(&m, &spec_buf, &in, LOOM_F32, &lab, LOOM_I32, 2, &err) == LOOM_ESHAPE);
    CHECK(!strcmp(err.where, "test.cfg:11"));
    CHECK_MSG(strstr(err.msg, "needs a sequence input (steps, features), got (4") != NULL, "%s", err.msg);
    CHECK(strstr(err.hint, "embedding") != NULL);
    loom_layer_spec g[2] = {L_emb_mask(7, 3, true), L_rnn(LOOM_LAYER_GRU, 3, false)};
    g[1].reset_after = false;
    mk_seq(2, g);
    spec_buf.metrics_set = false;
    loom_shape ids = {.rank = 1, .dim = {5}};
    CHECK(loom_model_new(&m, &spec_buf, &ids, LOOM_I32, &lab, LOOM_I32, 2, &err) == LOOM_EUNSUPPORTED);
    CHECK(strstr(err.msg, "reset_after = false") != NULL);
    CHECK(strstr(err.hint, "reset_after = true") != NULL);
    loom_layer_spec e[2] = {L_emb_mask(7, 3, true), L_rnn(LOOM_LAYER_GRU, 3, false)};
    mk_seq(2, e);
    spec_buf.metrics_set = false;
    loom_shape ck = {.rank = 2, .dim = {5, 2}};
    CHECK(loom_model_new(&m, &spec_buf, &ck, LOOM_I32, &lab, LOOM_I32, 2, &err) == LOOM_ESHAPE);
    CHECK(strstr(err.msg, "mask_zero needs ids of shape (T,)") != NULL);
    CHECK(m == NULL);
}

/* ---- return_state ------------------------------------------------------------------ */

/* A state view of layer "rnn": what the config makes of return_state ("rnn/h", "rnn/c"). */
static loom_layer_spec L_state(loom_layer_kind k, int units, int which)
{
    loom_layer_spec s = L_rnn(k, units, false);
    s.state_of = which, s.n_inputs = 1;
    snprintf(s.name, sizeof s.name, "rnn/%s", which == 1 ? "h" : "c");
    snprintf(s.inputs[0], sizeof s.inputs[0], "rnn");
    return s;
}

static loom_layer_spec L_concat(int n, const char *const *in)
{
    loom_layer_spec s = {0};
    s.kind = LOOM_LAYER_CONCATENATE, s.axis = -1, s.n_inputs = n;
    snprintf(s.name, sizeof s.name, "cat");
    for (int i = 0; i < n; i++) snprintf(s.inputs[i], sizeof s.inputs[i], "%s", in[i]);
    return s;
}

/* The last real step's h and c of torch_case's lstm (ids, params p) in double: Keras' masking by hand. */
static void lstm_ref(const float *p, const int32_t *ids, int T, double *h, double *c)
{
    const int D = 3, H = 2;
    const float *E = p, *W = p + 5 * D, *U = W + D * 4 * H, *bb = U + H * 4 * H;
    memset(h, 0, H * sizeof *h), memset(c, 0, H * sizeof *c);
    for (int t = 0; t < T && ids[t] > 0; t++) {
        double g[8], hn[2];
        for (int j = 0; j < 4 * H; j++) {
            g[j] = bb[j];
            for (int d = 0; d < D; d++) g[j] += E[ids[t] * D + d] * W[d * 4 * H + j];
            for (int k = 0; k < H; k++) g[j] += h[k] * U[k * 4 * H + j];
        }
        for (int j = 0; j < H; j++) {
            double i = 1 / (1 + exp(-g[j])), f = 1 / (1 + exp(-g[H + j])), gg = tanh(g[2 * H + j]);
            double o = 1 / (1 + exp(-g[3 * H + j]));
            c[j] = f * c[j] + i * gg, hn[j] = o * tanh(c[j]);
        }
        memcpy(h, hn, sizeof hn);
    }
}

/* h of return_state is the last real step's output (PyTorch's h_n with the padding as lengths, the last-step
 * output), c the cell state a reference lstm in double gives, on a batch whose second example is padded. */
static void test_rnn_states(void)
{
    static const char *const in[2] = {"rnn/h", "rnn/c"};
    for (int gru = 0; gru < 2; gru++) {
        loom_layer_kind k = gru ? LOOM_LAYER_GRU : LOOM_LAYER_LSTM;
        loom_layer_spec r = L_rnn(k, 2, true);
        r.return_state = true;
        loom_layer_spec ls[5] = {L_emb_mask(5, 3, true), r, L_state(k, 2, 1), L_state(k, 2, 2), L_concat(2, in)};
        mk_seq(gru ? 3 : 5, ls); /* a gru: its h view is the output */
        spec_buf.loss = LOOM_LOSS_MSE, spec_buf.metrics_set = false, spec_buf.n_metrics = 0;
        loom_model *m;
        loom_shape xin = {.rank = 1, .dim = {4}}, lab = {.rank = 1, .dim = {gru ? 2 : 4}};
        if (loom_model_new(&m, &spec_buf, &xin, LOOM_I32, &lab, LOOM_F32, 2, &err)) {
            CHECK_MSG(0, "%s: %s", gru ? "gru" : "lstm", err.msg);
            continue;
        }
        float *p = loom_model_params(m);
        for (int64_t i = 0; i < loom_model_num_params(m); i++) p[i] = (float)(0.5 * sin(0.37 * (double)i + 0.1));
        int32_t ids[8] = {1, 2, 3, 4, 3, 1, 2, 0};
        loom_tensor x;
        loom_shape xs = {.rank = 2, .dim = {2, 4}};
        loom_tensor_init(&x, LOOM_I32, &xs, &err);
        memcpy(x.data, ids, sizeof ids);
        float out[8];
        CHECK(loom_model_predict(m, &x, out, &err) == LOOM_OK);
        double worst = 0;
        for (int b = 0; b < 2; b++) {
            const int w = gru ? 2 : 4;
            double h[2], c[2];
            lstm_ref(p, ids + 4 * b, 4, h, c);
            for (int j = 0; j < 2; j++) {
                worst = fmax(worst, fabs(out[b * w + j] - (gru ? want_gru_last : want_lstm_last)[b * 2 + j]));
                if (!gru) worst = fmax(worst, fabs(out[b * w + j] - h[j]));
                if (!gru) worst = fmax(worst, fabs(out[b * w + 2 + j] - c[j]));
            }
        }
        printf("# %s return_state: worst difference from the last real step's h%s %.2e\n", gru ? "gru" : "lstm",
               gru ? "" : " and c", worst);
        CHECK_MSG(worst < 1e-5, "%s: %g", gru ? "gru" : "lstm", worst);
        loom_tensor_fini(&x);
        loom_model_free(m);
    }
}

/* The gradients through h and c (d h_T, d c_T of the last real step) beside the last-step output, against
 * central differences under masks; 1 and 3 threads give the same bits. */
static void test_rnn_states_gradcheck(void)
{
    static const char *const in[3] = {"rnn", "rnn/h", "rnn/c"};
    for (int gru = 0; gru < 2; gru++) {
        loom_layer_kind k = gru ? LOOM_LAYER_GRU : LOOM_LAYER_LSTM;
        loom_layer_spec r = L_rnn(k, 3, false);
        r.return_state = true;
        const int n = gru ? 5 : 6;
        loom_layer_spec ls[6] = {L_emb_mask(7, 2, true), r, L_state(k, 3, 1), L_state(k, 3, 2), L_concat(3, in),
                                 L_dense_named(5, LOOM_ACT_NONE)};
        if (gru) ls[3] = L_concat(2, in), ls[4] = L_dense_named(5, LOOM_ACT_NONE);
        float *g1 = NULL;
        for (int th = 1; th <= 3; th += 2) {
            fixture f;
            if (fixture_new2(&f, n, ls, 4, 5, 5, 60 + gru, false)) {
                CHECK(0);
                return;
            }
            shake_params(f.m, 70 + gru);
            CHECK(loom_model_set_threads(f.m, th, &err) == LOOM_OK);
            int64_t P = loom_model_num_params(f.m);
            if (th == 1) {
                gradcheck(&f, gru ? "gru return_state" : "lstm return_state", 1e-2f);
                step(&f);
                g1 = malloc((size_t)P * sizeof *g1);
                memcpy(g1, loom_model_grads(f.m), (size_t)P * sizeof *g1);
            } else {
                step(&f);
                CHECK_MSG(!memcmp(g1, loom_model_grads(f.m), (size_t)P * sizeof *g1), "states: threads");
            }
            fixture_free(&f);
        }
        free(g1);
    }
}

static const loom_test tests[] = {
    {"rnn_states", test_rnn_states},
    {"rnn_states_gradcheck", test_rnn_states_gradcheck},
    {"rnn_errors", test_rnn_errors},
    {"rnn_torch", test_rnn_torch},
    {"rnn_gradcheck", test_rnn_gradcheck},
    {"rnn_init", test_rnn_init},
    {"token_loss", test_token_loss},
    {"token_gradcheck", test_token_gradcheck},
    {"token_errors", test_token_errors},
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
