/* test_seq.c - sequences in the model (issue 24): dense on the last axis of
 * a (T, D) input, the time mask an embedding with mask_zero carries, the
 * per-token sparse softmax cross-entropy (mean over unmasked tokens, labels
 * equal to model.ignore_label masked), token accuracy and perplexity; the
 * recurrent layers (lstm, gru, bidirectional) against PyTorch-computed
 * numbers and central differences. */
#include "harness.h"
#include "nn/nn.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static loom_err err;
static loom_model_spec spec_buf;

static loom_layer_spec L_emb(int64_t rows, int dim, bool mask_zero)
{
    loom_layer_spec s = {0};
    s.kind = LOOM_LAYER_EMBEDDING;
    s.input_dim = rows;
    s.output_dim = dim;
    s.mask_zero = mask_zero;
    snprintf(s.name, sizeof s.name, "emb");
    return s;
}

static loom_layer_spec L_dense(int units, loom_activation a)
{
    loom_layer_spec s = {0};
    s.kind = LOOM_LAYER_DENSE;
    s.units = units;
    s.activation = a;
    s.use_bias = true;
    snprintf(s.name, sizeof s.name, "dense_%d", units);
    return s;
}

static const loom_model_spec *mk(int n, const loom_layer_spec *layers)
{
    memset(&spec_buf, 0, sizeof spec_buf);
    snprintf(spec_buf.loc.file, sizeof spec_buf.loc.file, "test.cfg");
    spec_buf.loc.line = 5;
    spec_buf.loss = LOOM_LOSS_SPARSE_SOFTMAX_CE;
    spec_buf.ignore_label = -100;
    spec_buf.metrics_set = true;
    spec_buf.n_metrics = 2;
    spec_buf.metric[0] = LOOM_METRIC_ACCURACY;
    spec_buf.metric[1] = LOOM_METRIC_PERPLEXITY;
    spec_buf.n_layers = n;
    snprintf(spec_buf.input, sizeof spec_buf.input, "ids");
    for (int i = 0; i < n; i++) {
        spec_buf.layer[i] = layers[i];
        snprintf(spec_buf.layer[i].loc.file, sizeof spec_buf.layer[i].loc.file, "test.cfg");
        spec_buf.layer[i].loc.line = 10 + i;
    }
    return &spec_buf;
}

/* A model over ids (B, T) with labels (B, T) of V classes. */
typedef struct fixture {
    loom_model *m;
    loom_tensor x, y;
    int64_t     B, T, V;
} fixture;

static int fixture_new(fixture *f, int n, const loom_layer_spec *ls, int64_t B, int64_t T, int64_t V, uint64_t seed)
{
    memset(f, 0, sizeof *f);
    loom_shape in = {.rank = 1, .dim = {T}}, lab = {.rank = 1, .dim = {T}};
    int rc = loom_model_new(&f->m, mk(n, ls), &in, LOOM_I32, &lab, LOOM_I32, B, &err);
    if (rc) {
        printf("# model_new: %s: %s\n", err.where, err.msg);
        return rc;
    }
    f->B = B, f->T = T, f->V = V;
    loom_model_init_params(f->m, seed);
    loom_shape xs = {.rank = 2, .dim = {B, T}};
    loom_tensor_init(&f->x, LOOM_I32, &xs, &err);
    loom_tensor_init(&f->y, LOOM_I32, &xs, &err);
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
    loom_layer_spec ls[3] = {L_emb(7, 3, true), L_dense(5, LOOM_ACT_TANH), L_dense(6, LOOM_ACT_NONE)};
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
    loom_layer_spec ls[3] = {L_emb(7, 3, true), L_dense(5, LOOM_ACT_TANH), L_dense(6, LOOM_ACT_NONE)};
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
    loom_layer_spec ls[2] = {L_emb(7, 3, true), L_dense(6, LOOM_ACT_NONE)};
    loom_model *m;
    loom_shape in = {.rank = 1, .dim = {4}}, lab = {.rank = 1, .dim = {3}};
    CHECK(loom_model_new(&m, mk(2, ls), &in, LOOM_I32, &lab, LOOM_I32, 2, &err) == LOOM_ESHAPE);
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

static const loom_test tests[] = {
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
