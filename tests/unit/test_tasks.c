/* test_tasks.c - tasks beyond 10-way classification (issue 16, sections 3
 * and 4): binary cross-entropy from logits, MAE, Huber, class weights, each
 * gradient against central finite differences; model.metrics (AUC against
 * an independent implementation of Keras' definition, precision, recall,
 * top-k, mae, rmse) and the metrics that do not fit a task; labels a loss
 * cannot take; synchronised batch normalization over two replicas in two
 * threads against one model on the whole batch and finite differences. */
#include "harness.h"
#include "nn/nn.h"
#include "spec_fixtures.h"

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static loom_err err;

/* test.cfg's model with model.metrics at line 7, the metrics' and huber's
 * settings at their defaults and layer i named layer_i. */
static loom_model_spec *mk_task(loom_loss_kind loss, int n, const loom_layer_spec *layers)
{
    loom_model_spec *s = mk(loss, n, layers);
    s->metrics_loc = s->loc;
    s->metrics_loc.line = 7;
    s->auc_thresholds = 200;
    s->top_k = 5;
    s->huber_delta = 1.0;
    for (int i = 0; i < n; i++) snprintf(s->layer[i].name, sizeof s->layer[i].name, "layer_%d", i);
    return s;
}

static void set_metrics(loom_model_spec *s, int n, const loom_metric_kind *k)
{
    s->metrics_set = true;
    s->n_metrics = n;
    for (int i = 0; i < n; i++) s->metric[i] = k[i];
}

static loom_shape shp(int rank, int64_t a, int64_t b, int64_t c)
{
    loom_shape s = {0};
    s.rank = rank;
    s.dim[0] = a;
    s.dim[1] = b;
    s.dim[2] = c;
    return s;
}

static loom_shape batch_shape(int64_t B, const loom_shape *s)
{
    loom_shape o = {.rank = s->rank + 1};
    o.dim[0] = B;
    for (int i = 0; i < s->rank; i++) o.dim[i + 1] = s->dim[i];
    return o;
}

/* A model on random inputs with labels the loss takes: classes for sparse
 * CE, 0/1 (or soft) targets for BCE, normal targets for the regressions. */
typedef struct fixture {
    loom_model *m;
    loom_tensor x, y;
    int64_t     B;
} fixture;

static int fixture_new(fixture *f, const loom_model_spec *spec, loom_shape in, loom_shape lab, loom_dtype ldt,
                       int64_t B, uint64_t seed, int soft)
{
    memset(f, 0, sizeof *f);
    int rc = loom_model_new(&f->m, spec, &in, LOOM_F32, &lab, ldt, B, &err);
    if (rc) {
        printf("# model_new: %s: %s\n", err.where, err.msg);
        return rc;
    }
    f->B = B;
    loom_model_init_params(f->m, seed);
    loom_rng r;
    loom_rng_init(&r, seed, 99, 0, 0);
    float *p = loom_model_params(f->m);
    for (int i = 0; i < loom_model_num_param_tensors(f->m); i++) {
        const loom_param_info *t = loom_model_param_tensor(f->m, i);
        if (strstr(t->name, "/bias"))
            for (int64_t k = 0; k < loom_shape_numel(&t->shape); k++) p[t->offset + k] = 0.1f * loom_rng_normal(&r);
    }
    loom_shape xs = batch_shape(B, &in), ys = batch_shape(B, &lab);
    loom_tensor_init(&f->x, LOOM_F32, &xs, &err);
    loom_tensor_init(&f->y, ldt, &ys, &err);
    for (int64_t k = 0; k < loom_shape_numel(&xs); k++) ((float *)f->x.data)[k] = loom_rng_normal(&r);
    int64_t classes = loom_model_output_shape(f->m).dim[0];
    for (int64_t b = 0; b < loom_shape_numel(&ys); b++) {
        double v;
        if (spec->loss == LOOM_LOSS_SPARSE_SOFTMAX_CE) v = (double)loom_rng_below(&r, (uint64_t)classes);
        else if (spec->loss == LOOM_LOSS_BCE) v = soft ? loom_rng_uniform64(&r) : (double)loom_rng_below(&r, 2);
        else v = 2 * loom_rng_normal(&r);
        switch (ldt) {
        case LOOM_U8: ((uint8_t *)f->y.data)[b] = (uint8_t)v; break;
        case LOOM_I64: ((int64_t *)f->y.data)[b] = (int64_t)v; break;
        case LOOM_F64: ((double *)f->y.data)[b] = v; break;
        default: ((float *)f->y.data)[b] = (float)v; break;
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

static double step_loss(fixture *f)
{
    double loss = 0;
    int64_t correct;
    int rc = loom_model_train_step(f->m, &f->x, &f->y, f->B, 1, &loss, &correct, &err);
    LOOM_ASSERT(rc == LOOM_OK);
    return loss;
}

static double gc_loss(void *f) { return step_loss(f); }

/* The analytic gradient of the mean loss against central differences on
 * every parameter (these models are small), skipping kinks (MAE at z = t,
 * Huber at |e| = delta). */
static void gradcheck_eps(const char *what, const loom_model_spec *spec, loom_shape in, loom_shape lab, loom_dtype ldt,
                          int64_t B, int soft, float eps)
{
    fixture f;
    if (fixture_new(&f, spec, in, lab, ldt, B, 11, soft) != LOOM_OK) {
        CHECK_MSG(0, "%s: cannot build", what);
        return;
    }
    int64_t P = loom_model_num_params(f.m);
    float *p = loom_model_params(f.m);
    float *ga = malloc((size_t)P * sizeof *ga);
    step_loss(&f);
    memcpy(ga, loom_model_grads(f.m), (size_t)P * sizeof *ga);
    harness_gradcheck g = harness_gradcheck_run(what, p, ga, P, 1, eps, (double)B, gc_loss, &f, NULL, 1);
    CHECK_MSG(g.tested > 0 && g.kinks * 3 <= g.tested, "%s: %lld checked, %lld kinks", what, g.tested, g.kinks);
    CHECK_MSG(g.bad == 0, "%s: %lld of %lld gradients off", what, g.bad, g.tested);
    free(ga);
    fixture_free(&f);
}

static void gradcheck(const char *what, const loom_model_spec *spec, loom_shape in, loom_shape lab, loom_dtype ldt,
                      int64_t B, int soft)
{
    gradcheck_eps(what, spec, in, lab, ldt, B, soft, 1e-2f);
}

/* ---- losses ---------------------------------------------------------------- */

static void test_grad_losses(void)
{
    loom_layer_spec one[] = {L_dense(6, LOOM_ACT_TANH), L_dense(1, LOOM_ACT_NONE)};
    loom_layer_spec sig[] = {L_dense(6, LOOM_ACT_TANH), L_dense(1, LOOM_ACT_SIGMOID)};
    loom_layer_spec three[] = {L_dense(6, LOOM_ACT_TANH), L_dense(3, LOOM_ACT_NONE)};
    loom_shape in = shp(1, 5, 0, 0), scalar = shp(0, 0, 0, 0), v3 = shp(1, 3, 0, 0);
    gradcheck("bce, scalar 0/1 int64 labels", mk_task(LOOM_LOSS_BCE, 2, one), in, scalar, LOOM_I64, 6, 0);
    gradcheck("bce, sigmoid output fused", mk_task(LOOM_LOSS_BCE, 2, sig), in, scalar, LOOM_F32, 6, 0);
    gradcheck("bce, 3 outputs, soft labels", mk_task(LOOM_LOSS_BCE, 2, three), in, v3, LOOM_F32, 6, 1);
    loom_model_spec *s = mk_task(LOOM_LOSS_BCE, 2, one);
    s->n_class_weights = 2;
    s->class_weight[0] = 0.3f;
    s->class_weight[1] = 2.5f;
    gradcheck("bce, class weights", s, in, scalar, LOOM_F32, 6, 0);
    gradcheck("mae, scalar labels", mk_task(LOOM_LOSS_MAE, 2, one), in, scalar, LOOM_F32, 6, 0);
    /* piecewise linear: a smaller step meets fewer kinks that the second difference cannot see */
    gradcheck_eps("mae, 3 outputs", mk_task(LOOM_LOSS_MAE, 2, three), in, v3, LOOM_F64, 6, 0, 2e-3f);
    s = mk_task(LOOM_LOSS_HUBER, 2, three);
    s->huber_delta = 0.7; /* targets ~ N(0, 4): both sides of delta */
    gradcheck("huber, delta 0.7", s, in, v3, LOOM_F32, 6, 0);
    gradcheck("mse, scalar labels", mk_task(LOOM_LOSS_MSE, 2, one), in, scalar, LOOM_F32, 6, 0);
    s = mk_task(LOOM_LOSS_SPARSE_SOFTMAX_CE, 2, three);
    s->n_class_weights = 3;
    s->class_weight[0] = 1.f;
    s->class_weight[1] = 0.2f;
    s->class_weight[2] = 4.f;
    gradcheck("sparse ce, class weights", s, in, scalar, LOOM_U8, 6, 0);
}

/* A one-unit linear model whose logit is its input: z = x. */
static loom_model *identity_model(loom_model_spec *s, loom_shape lab, loom_dtype ldt, int64_t B)
{
    loom_shape in = shp(1, 1, 0, 0);
    loom_model *m = NULL;
    if (loom_model_new(&m, s, &in, LOOM_F32, &lab, ldt, B, &err)) {
        printf("# %s: %s (%s)\n", err.where, err.msg, err.hint);
        return NULL;
    }
    loom_model_params(m)[0] = 1.f; /* kernel */
    loom_model_params(m)[1] = 0.f; /* bias */
    return m;
}

static void tensor_of(loom_tensor *t, loom_dtype dt, loom_shape s, const void *data)
{
    loom_tensor_init(t, dt, &s, &err);
    memcpy(t->data, data, (size_t)loom_shape_numel(&s) * loom_dtype_size(dt));
}

static void test_bce_values(void)
{
    loom_layer_spec d[] = {L_dense(1, LOOM_ACT_NONE)};
    loom_model *m = identity_model(mk_task(LOOM_LOSS_BCE, 1, d), shp(0, 0, 0, 0), LOOM_F32, 4);
    if (!m) {
        CHECK(0);
        return;
    }
    /* TF: sigmoid_cross_entropy_with_logits(z, t) = max(z, 0) - z t + log(1 + exp(-|z|)) */
    float xs[] = {0.f, 2.f, -3.f, 40.f}, ts[] = {1.f, 0.f, 0.f, 1.f};
    loom_tensor x, y;
    tensor_of(&x, LOOM_F32, shp(2, 4, 1, 0), xs);
    tensor_of(&y, LOOM_F32, shp(1, 4, 0, 0), ts);
    double want = 0;
    for (int i = 0; i < 4; i++)
        want += fmax(xs[i], 0) - xs[i] * ts[i] + log1p(exp(-fabs(xs[i])));
    double loss;
    int64_t correct;
    CHECK(loom_model_evaluate(m, &x, &y, &loss, &correct, &err) == LOOM_OK);
    CHECK_NEAR(loss, want, 1e-6);
    CHECK(correct == 2); /* z = 0 is not above 0.5's logit, and z = 2 says 1 for a 0 */
    float probs[4];
    CHECK(loom_model_predict(m, &x, probs, &err) == LOOM_OK);
    CHECK_NEAR(probs[0], 0.5, 1e-7);
    CHECK_NEAR(probs[2], 1 / (1 + exp(3.0)), 1e-7);
    /* a label outside [0, 1] is the data's error, naming the example */
    ts[2] = 2.f;
    memcpy(y.data, ts, sizeof ts);
    CHECK(loom_model_train_step(m, &x, &y, 4, 0, &loss, &correct, &err) == LOOM_EDATA);
    CHECK_CONTAINS(err.msg, "label of example 2 in the batch is 2, outside [0, 1] for binary_cross_entropy");
    CHECK_CONTAINS(err.hint, "sparse_softmax_cross_entropy");
    ts[2] = NAN;
    memcpy(y.data, ts, sizeof ts);
    CHECK(loom_model_evaluate(m, &x, &y, &loss, &correct, &err) == LOOM_EDATA);
    CHECK_CONTAINS(err.msg, "not a finite number");
    loom_tensor_fini(&x);
    loom_tensor_fini(&y);
    loom_model_free(m);
}

static void test_regression_shapes(void)
{
    loom_layer_spec one[] = {L_dense(1, LOOM_ACT_NONE)};
    loom_layer_spec ten[] = {L_dense(10, LOOM_ACT_NONE)};
    loom_shape in = shp(1, 4, 0, 0), scalar = shp(0, 0, 0, 0);
    loom_model *m = NULL;
    /* a scalar float target with one output: no one_hot hint, and no accuracy */
    CHECK(loom_model_new(&m, mk_task(LOOM_LOSS_MSE, 1, one), &in, LOOM_F32, &scalar, LOOM_F32, 4, &err) == LOOM_OK);
    if (m) CHECK(loom_model_num_metrics(m) == 0);
    loom_model_free(m);
    m = NULL;
    /* a scalar float target with ten outputs: say how to make one output */
    CHECK(loom_model_new(&m, mk_task(LOOM_LOSS_HUBER, 1, ten), &in, LOOM_F32, &scalar, LOOM_F32, 4, &err) ==
          LOOM_ESHAPE);
    CHECK_CONTAINS(err.msg, "huber needs labels of the output's shape");
    CHECK_CONTAINS(err.hint, "units = 1");
    CHECK(strstr(err.hint, "one_hot") == NULL);
    /* integer classes against ten outputs under MSE: the one_hot hint still helps */
    CHECK(loom_model_new(&m, mk_task(LOOM_LOSS_MSE, 1, ten), &in, LOOM_F32, &scalar, LOOM_U8, 4, &err) == LOOM_ESHAPE);
    CHECK_CONTAINS(err.hint, "one_hot map with depth = 10");
    /* accuracy asked of a regression */
    loom_model_spec *s = mk_task(LOOM_LOSS_MAE, 1, one);
    loom_metric_kind acc[] = {LOOM_METRIC_MAE, LOOM_METRIC_ACCURACY};
    set_metrics(s, 2, acc);
    CHECK(loom_model_new(&m, s, &in, LOOM_F32, &scalar, LOOM_F32, 4, &err) == LOOM_ECONFIG);
    CHECK_CONTAINS(err.where, "test.cfg:7");
    CHECK_CONTAINS(err.msg, "model.metrics: \"accuracy\" does not fit this model");
    CHECK_CONTAINS(err.hint, "rmse");
    /* class weights need classes */
    s = mk_task(LOOM_LOSS_MSE, 1, one);
    s->n_class_weights = 2;
    s->class_weight[0] = s->class_weight[1] = 1;
    CHECK(loom_model_new(&m, s, &in, LOOM_F32, &scalar, LOOM_F32, 4, &err) == LOOM_ECONFIG);
    CHECK_CONTAINS(err.msg, "class_weight");
    s = mk_task(LOOM_LOSS_SPARSE_SOFTMAX_CE, 1, ten);
    s->n_class_weights = 3;
    CHECK(loom_model_new(&m, s, &in, LOOM_F32, &scalar, LOOM_I64, 4, &err) == LOOM_ECONFIG);
    CHECK_CONTAINS(err.msg, "3 weights for 10 classes");
}

/* ---- metrics --------------------------------------------------------------- */

/* Keras' AUC (ROC, interpolation) written out from its definition: explicit
 * thresholds, prediction > threshold, trapezoids over (fpr, tpr). */
static double keras_auc(const double *p, const double *t, int n, int T)
{
    double *th = malloc((size_t)T * sizeof *th), *tpr = malloc((size_t)T * sizeof *tpr),
           *fpr = malloc((size_t)T * sizeof *fpr);
    th[0] = -1e-7;
    for (int i = 1; i < T - 1; i++) th[i] = (double)i / (T - 1);
    th[T - 1] = 1 + 1e-7;
    for (int i = 0; i < T; i++) {
        double tp = 0, fp = 0, fn = 0, tn = 0;
        for (int k = 0; k < n; k++) {
            int pos = p[k] > th[i];
            tp += pos * t[k], fp += pos * (1 - t[k]), fn += (1 - pos) * t[k], tn += (1 - pos) * (1 - t[k]);
        }
        tpr[i] = tp + fn > 0 ? tp / (tp + fn) : 0;
        fpr[i] = fp + tn > 0 ? fp / (fp + tn) : 0;
    }
    double a = 0;
    for (int i = 0; i < T - 1; i++) a += (fpr[i] - fpr[i + 1]) * (tpr[i] + tpr[i + 1]) / 2;
    free(th), free(tpr), free(fpr);
    return a;
}

/* Runs B logits x through an identity model in two evaluate steps and reads the metrics. */
static void eval_metrics(loom_model *m, const float *xs, const float *ts, loom_dtype tdt, int64_t B, double *out,
                         int64_t *correct_out)
{
    int64_t h = B / 2, correct = 0;
    double *acc = calloc((size_t)(loom_model_metrics_size(m) + 1), sizeof *acc);
    for (int part = 0; part < 2; part++) { /* two batches: the state adds up */
        int64_t b0 = part ? h : 0, nb = part ? B - h : h;
        loom_tensor x, y;
        tensor_of(&x, LOOM_F32, shp(2, nb, 1, 0), xs + b0);
        if (tdt == LOOM_F32) tensor_of(&y, LOOM_F32, shp(1, nb, 0, 0), ts + b0);
        else {
            int64_t *lab = malloc((size_t)nb * sizeof *lab);
            for (int64_t k = 0; k < nb; k++) lab[k] = (int64_t)ts[b0 + k];
            tensor_of(&y, LOOM_I64, shp(1, nb, 0, 0), lab);
            free(lab);
        }
        double loss;
        int64_t c;
        CHECK(loom_model_evaluate(m, &x, &y, &loss, &c, &err) == LOOM_OK);
        correct += c;
        loom_model_metrics_take(m, acc);
        loom_tensor_fini(&x);
        loom_tensor_fini(&y);
    }
    for (int i = 0; i < loom_model_num_metrics(m); i++) out[i] = loom_model_metric_value(m, i, acc, correct, B);
    if (correct_out) *correct_out = correct;
    free(acc);
}

static void test_auc(void)
{
    enum { B = 400 };
    static float xs[B], ts[B];
    double p[B], t[B];
    loom_rng r;
    loom_rng_init(&r, 5, 0, 0, 0);
    for (int k = 0; k < B; k++) { /* logits that separate the classes somewhat, with ties at 0 */
        ts[k] = (float)loom_rng_below(&r, 2);
        xs[k] = k % 17 == 0 ? 0.f : (float)(loom_rng_normal(&r) + (ts[k] ? 1.0 : -0.5));
        p[k] = 1 / (1 + exp(-(double)xs[k]));
        t[k] = ts[k];
    }
    static const int Ts[] = {200, 13, 2};
    for (int i = 0; i < 3; i++) {
        loom_layer_spec d[] = {L_dense(1, LOOM_ACT_NONE)};
        loom_model_spec *s = mk_task(LOOM_LOSS_BCE, 1, d);
        loom_metric_kind k[] = {LOOM_METRIC_ACCURACY, LOOM_METRIC_AUC, LOOM_METRIC_PRECISION, LOOM_METRIC_RECALL,
                                LOOM_METRIC_MAE, LOOM_METRIC_RMSE};
        set_metrics(s, 6, k);
        s->auc_thresholds = Ts[i];
        loom_model *m = identity_model(s, shp(0, 0, 0, 0), LOOM_F32, B);
        if (!m) {
            CHECK(0);
            return;
        }
        double v[6];
        eval_metrics(m, xs, ts, LOOM_F32, B, v, NULL);
        double want = keras_auc(p, t, B, Ts[i]);
        printf("# auc with %d thresholds: %.6f (Keras' definition: %.6f)\n", Ts[i], v[1], want);
        CHECK_NEAR(v[1], want, 1e-9);
        if (i == 0) {
            double tp = 0, fp = 0, fn = 0, hits = 0, ae = 0, se = 0;
            for (int k2 = 0; k2 < B; k2++) {
                int pos = p[k2] > 0.5;
                tp += pos && t[k2] == 1, fp += pos && t[k2] == 0, fn += !pos && t[k2] == 1;
                hits += pos == (t[k2] == 1);
                ae += fabs(p[k2] - t[k2]), se += (p[k2] - t[k2]) * (p[k2] - t[k2]);
            }
            CHECK_NEAR(v[0], hits / B, 1e-12);
            CHECK_NEAR(v[2], tp / (tp + fp), 1e-12);
            CHECK_NEAR(v[3], tp / (tp + fn), 1e-12);
            CHECK_NEAR(v[4], ae / B, 1e-6);
            CHECK_NEAR(v[5], sqrt(se / B), 1e-6);
        }
        loom_model_free(m);
    }
    /* a perfect ranking gives 1, an inverted one 0 */
    for (int k = 0; k < B; k++) xs[k] = ts[k] ? 3.f + (float)k / B : -3.f - (float)k / B;
    loom_layer_spec d[] = {L_dense(1, LOOM_ACT_NONE)};
    loom_model_spec *s = mk_task(LOOM_LOSS_BCE, 1, d);
    loom_metric_kind k[] = {LOOM_METRIC_AUC};
    set_metrics(s, 1, k);
    loom_model *m = identity_model(s, shp(0, 0, 0, 0), LOOM_F32, B);
    double v;
    eval_metrics(m, xs, ts, LOOM_F32, B, &v, NULL);
    CHECK_NEAR(v, 1.0, 1e-12);
    for (int k2 = 0; k2 < B; k2++) xs[k2] = -xs[k2];
    eval_metrics(m, xs, ts, LOOM_F32, B, &v, NULL);
    CHECK_NEAR(v, 0.0, 1e-12);
    /* no examples: NaN, not 0 */
    CHECK(isnan(loom_model_metric_value(m, 0, NULL, 0, 0)));
    loom_model_free(m);
}

static void test_classification_metrics(void)
{
    /* 4 classes, logits by hand: top-1 and top-2 hits */
    loom_layer_spec d[] = {L_dense(4, LOOM_ACT_NONE)};
    loom_model_spec *s = mk_task(LOOM_LOSS_SPARSE_SOFTMAX_CE, 1, d);
    loom_metric_kind k[] = {LOOM_METRIC_TOP_K_ACCURACY, LOOM_METRIC_ACCURACY, LOOM_METRIC_PRECISION};
    set_metrics(s, 3, k);
    s->top_k = 2;
    loom_shape in = shp(1, 4, 0, 0), scalar = shp(0, 0, 0, 0);
    loom_model *m = NULL;
    CHECK(loom_model_new(&m, s, &in, LOOM_F32, &scalar, LOOM_I64, 4, &err) == LOOM_OK);
    if (!m) return;
    float *p = loom_model_params(m);
    memset(p, 0, (size_t)loom_model_num_params(m) * sizeof *p);
    for (int i = 0; i < 4; i++) p[i * 4 + i] = 1.f; /* identity kernel: logits = input */
    float xs[] = {5, 1, 0, 0,  /* label 0: top-1 */
                  3, 2, 0, 0,  /* label 1: top-2 only */
                  0, 0, 1, 2,  /* label 0: neither */
                  0, 0, 0, 9}; /* label 3: top-1 */
    int64_t ls[] = {0, 1, 0, 3};
    loom_tensor x, y;
    tensor_of(&x, LOOM_F32, shp(2, 4, 4, 0), xs);
    tensor_of(&y, LOOM_I64, shp(1, 4, 0, 0), ls);
    double loss, acc[8] = {0};
    int64_t correct;
    CHECK(loom_model_evaluate(m, &x, &y, &loss, &correct, &err) == LOOM_OK);
    CHECK(loom_model_metrics_size(m) <= 8);
    loom_model_metrics_take(m, acc);
    CHECK_NEAR(loom_model_metric_value(m, 0, acc, correct, 4), 0.75, 1e-12);
    CHECK_NEAR(loom_model_metric_value(m, 1, acc, correct, 4), 0.5, 1e-12);
    /* precision over one-hot targets at p > 0.5: rows 1 and 4 predict their label; row 2's class 0 (p 0.68)
     * and row 3's class 3 (p 0.61) are wrong */
    CHECK_NEAR(loom_model_metric_value(m, 2, acc, correct, 4), 0.5, 1e-12);
    /* a take clears the state */
    double again[8] = {0};
    loom_model_metrics_take(m, again);
    CHECK(again[0] == 0 && again[1] == 0);
    loom_tensor_fini(&x);
    loom_tensor_fini(&y);
    loom_model_free(m);
}

static void test_metric_fit(void)
{
    loom_layer_spec ten[] = {L_dense(10, LOOM_ACT_NONE)};
    loom_shape in = shp(1, 4, 0, 0), scalar = shp(0, 0, 0, 0);
    loom_model *m = NULL;
    /* AUC on 10 classes without multi_label */
    loom_model_spec *s = mk_task(LOOM_LOSS_SPARSE_SOFTMAX_CE, 1, ten);
    loom_metric_kind auc[] = {LOOM_METRIC_ACCURACY, LOOM_METRIC_AUC};
    set_metrics(s, 2, auc);
    CHECK(loom_model_new(&m, s, &in, LOOM_F32, &scalar, LOOM_I64, 4, &err) == LOOM_ECONFIG);
    CHECK(!strcmp(err.where, "test.cfg:7"));
    CHECK_CONTAINS(err.msg, "model.metrics: \"auc\" does not fit this model: the model has 10 classes");
    CHECK_CONTAINS(err.hint, "multi_label = true");
    /* ... with multi_label: one curve per class */
    s->multi_label = true;
    CHECK(loom_model_new(&m, s, &in, LOOM_F32, &scalar, LOOM_I64, 4, &err) == LOOM_OK);
    if (m) CHECK(loom_model_metrics_size(m) == 2 * 200 * 10);
    loom_model_free(m);
    m = NULL;
    /* top_k of a binary task, k >= classes, mae of class labels */
    loom_layer_spec one[] = {L_dense(1, LOOM_ACT_NONE)};
    s = mk_task(LOOM_LOSS_BCE, 1, one);
    loom_metric_kind tk[] = {LOOM_METRIC_TOP_K_ACCURACY};
    set_metrics(s, 1, tk);
    CHECK(loom_model_new(&m, s, &in, LOOM_F32, &scalar, LOOM_F32, 4, &err) == LOOM_ECONFIG);
    CHECK_CONTAINS(err.msg, "\"top_k_accuracy\" does not fit");
    s = mk_task(LOOM_LOSS_SPARSE_SOFTMAX_CE, 1, ten);
    set_metrics(s, 1, tk);
    s->top_k = 10;
    CHECK(loom_model_new(&m, s, &in, LOOM_F32, &scalar, LOOM_I64, 4, &err) == LOOM_ECONFIG);
    CHECK_CONTAINS(err.msg, "always right");
    s = mk_task(LOOM_LOSS_SPARSE_SOFTMAX_CE, 1, ten);
    loom_metric_kind mae[] = {LOOM_METRIC_MAE};
    set_metrics(s, 1, mae);
    CHECK(loom_model_new(&m, s, &in, LOOM_F32, &scalar, LOOM_I64, 4, &err) == LOOM_ECONFIG);
    CHECK_CONTAINS(err.msg, "\"mae\" does not fit");
    /* AUC of a regression */
    s = mk_task(LOOM_LOSS_MSE, 1, one);
    loom_metric_kind a1[] = {LOOM_METRIC_AUC};
    set_metrics(s, 1, a1);
    CHECK(loom_model_new(&m, s, &in, LOOM_F32, &scalar, LOOM_F32, 4, &err) == LOOM_ECONFIG);
    CHECK_CONTAINS(err.msg, "regression");
    /* defaults: accuracy for a classification, nothing for a regression */
    CHECK(loom_model_new(&m, mk_task(LOOM_LOSS_BCE, 1, one), &in, LOOM_F32, &scalar, LOOM_F32, 4, &err) == LOOM_OK);
    if (m) CHECK(loom_model_num_metrics(m) == 1 && loom_model_metric(m, 0) == LOOM_METRIC_ACCURACY);
    loom_model_free(m);
}


/* ---- optimizers -------------------------------------------------------------- */

static loom_optimizer_spec opt_spec(loom_opt_kind k)
{
    loom_optimizer_spec s = {0};
    s.kind = k;
    s.learning_rate = 0.1;
    s.beta1 = 0.9;
    s.beta2 = 0.999;
    s.epsilon = 1e-7;
    s.rho = 0.9;
    s.weight_decay = 0.004;
    s.schedule.kind = LOOM_SCHED_CONSTANT;
    return s;
}

static const float G3[3] = {0.1f, -0.2f, 0.3f};

static void run_opt(loom_optimizer_spec s, float p[3], const float *g, int steps)
{
    loom_optimizer *o = NULL;
    CHECK(loom_optimizer_new(&o, &s, 3, &err) == LOOM_OK);
    if (!o) return;
    p[0] = 1, p[1] = 2, p[2] = 3;
    for (int t = 0; t < steps; t++) loom_optimizer_apply(o, p, g, t);
    loom_optimizer_free(o);
}

static void test_optimizers_more(void)
{
    /* AdamW (Keras): p -= lr wd p, then Adam's step, in double for 3 steps */
    float p[3];
    run_opt(opt_spec(LOOM_OPT_ADAMW), p, G3, 3);
    for (int i = 0; i < 3; i++) {
        double w = i + 1, m = 0, v = 0;
        for (int t = 1; t <= 3; t++) {
            w -= 0.1 * 0.004 * w;
            m = 0.9 * m + 0.1 * G3[i];
            v = 0.999 * v + 0.001 * G3[i] * G3[i];
            double lr_t = 0.1 * sqrt(1 - pow(0.999, t)) / (1 - pow(0.9, t));
            w -= lr_t * m / (sqrt(v) + 1e-7);
        }
        CHECK_NEAR(p[i], w, 1e-5);
    }
    /* AdamW with weight_decay 0 is Adam, bit for bit */
    float a[3], b[3];
    loom_optimizer_spec s = opt_spec(LOOM_OPT_ADAMW);
    s.weight_decay = 0;
    run_opt(s, a, G3, 4);
    run_opt(opt_spec(LOOM_OPT_ADAM), b, G3, 4);
    CHECK(memcmp(a, b, sizeof a) == 0);
    /* RMSprop (Keras 3): v = rho v + (1 - rho) g^2; p -= lr g / sqrt(v + eps) */
    run_opt(opt_spec(LOOM_OPT_RMSPROP), p, G3, 3);
    for (int i = 0; i < 3; i++) {
        double w = i + 1, v = 0;
        for (int t = 0; t < 3; t++) {
            v = 0.9 * v + 0.1 * G3[i] * G3[i];
            w -= 0.1 * G3[i] / sqrt(v + 1e-7);
        }
        CHECK_NEAR(p[i], w, 1e-5);
    }
    loom_optimizer *o = NULL;
    loom_optimizer_spec rs = opt_spec(LOOM_OPT_RMSPROP);
    CHECK(loom_optimizer_new(&o, &rs, 3, &err) == LOOM_OK);
    CHECK(loom_optimizer_num_slots(o) == 1 && !strcmp(loom_optimizer_slot_name(o, 0), "rms"));
    loom_optimizer_free(o);
    /* clip_norm: g = (3, 4, 0) has norm 5; clipped to 1 it is (0.6, 0.8, 0) */
    const float g[3] = {3, 4, 0};
    s = opt_spec(LOOM_OPT_SGD);
    s.clip_norm = 1.0;
    run_opt(s, p, g, 1);
    CHECK_NEAR(p[0], 1 - 0.1 * 0.6, 1e-7);
    CHECK_NEAR(p[1], 2 - 0.1 * 0.8, 1e-7);
    CHECK_NEAR(p[2], 3, 0);
    s.clip_norm = 10.0; /* under the norm: unchanged */
    run_opt(s, p, g, 1);
    CHECK_NEAR(p[0], 1 - 0.3, 1e-7);
    CHECK_NEAR(p[1], 2 - 0.4, 1e-7);
}

/* With clip_norm, ranges that partition [0, P) give apply's bits: each range
 * reads the norm of the whole buffer (mirrored's sharded update relies on it). */
static void test_clip_ranges(void)
{
    enum { P = 5000 };
    float *g = malloc(P * sizeof *g), *p1 = malloc(P * sizeof *p1), *p2 = malloc(P * sizeof *p2);
    loom_rng r;
    loom_rng_init(&r, 3, 0, 0, 0);
    for (int i = 0; i < P; i++) g[i] = loom_rng_normal(&r), p1[i] = p2[i] = loom_rng_normal(&r);
    static const loom_opt_kind kinds[] = {LOOM_OPT_SGD, LOOM_OPT_ADAMW, LOOM_OPT_RMSPROP};
    for (int k = 0; k < 3; k++) {
        loom_optimizer_spec s = opt_spec(kinds[k]);
        s.clip_norm = 2.5;
        loom_optimizer *a = NULL, *b = NULL;
        CHECK(loom_optimizer_new(&a, &s, P, &err) == LOOM_OK && loom_optimizer_new(&b, &s, P, &err) == LOOM_OK);
        CHECK(loom_optimizer_needs_full_grads(a));
        for (int t = 0; t < 3; t++) {
            loom_optimizer_apply(a, p1, g, t);
            loom_optimizer_apply_range(b, NULL, p2, g, t, 0, 1600);
            loom_optimizer_apply_range(b, NULL, p2, g, t, 1600, 3200);
            loom_optimizer_apply_range(b, NULL, p2, g, t, 3200, P);
        }
        CHECK_MSG(memcmp(p1, p2, P * sizeof *p1) == 0, "optimizer %d: ranges differ from one apply", (int)kinds[k]);
        /* the clipped step is small: no weight moved by more than lr * clip_norm */
        loom_optimizer_free(a);
        loom_optimizer_free(b);
    }
    free(g), free(p1), free(p2);
}

static void test_l2(void)
{
    loom_layer_spec ls[] = {L_dense(6, LOOM_ACT_TANH), L_dense(3, LOOM_ACT_NONE)};
    loom_model_spec *s = mk_task(LOOM_LOSS_SPARSE_SOFTMAX_CE, 2, ls);
    s->l2 = 0.05;
    gradcheck("sparse ce + l2 0.05", s, shp(1, 5, 0, 0), shp(0, 0, 0, 0), LOOM_I64, 6, 0);
    /* the reported mean loss carries l2 * sum(kernel^2) once; biases are not penalised */
    fixture f;
    if (fixture_new(&f, s, shp(1, 5, 0, 0), shp(0, 0, 0, 0), LOOM_I64, 6, 11, 0) != LOOM_OK) return;
    double with = step_loss(&f), ss = 0;
    for (int i = 0; i < loom_model_num_param_tensors(f.m); i++) {
        const loom_param_info *t = loom_model_param_tensor(f.m, i);
        if (!strstr(t->name, "/kernel")) continue;
        for (int64_t k = 0; k < loom_shape_numel(&t->shape); k++)
            ss += (double)loom_model_params(f.m)[t->offset + k] * loom_model_params(f.m)[t->offset + k];
    }
    fixture g;
    s->l2 = 0;
    if (fixture_new(&g, s, shp(1, 5, 0, 0), shp(0, 0, 0, 0), LOOM_I64, 6, 11, 0) == LOOM_OK) {
        double without = step_loss(&g);
        CHECK_NEAR(with / 6, without / 6 + 0.05 * ss, 1e-6);
        fixture_free(&g);
    }
    fixture_free(&f);
}

/* ---- layers -------------------------------------------------------------------- */

/* A layer of kind k with Keras' epsilon, momentum and alpha (batch and layer
 * normalization, leaky relu); the other builders are spec_fixtures.h's. */
static loom_layer_spec L_keras(loom_layer_kind k)
{
    loom_layer_spec s = L_kind(k, 0, LOOM_ACT_NONE);
    s.epsilon = 1e-3;
    s.momentum = 0.99;
    s.alpha = 0.3;
    return s;
}

static loom_layer_spec L_avg(int k, int stride, loom_padding p)
{
    loom_layer_spec s = L_keras(LOOM_LAYER_AVG_POOL2D);
    s.pool[0] = s.pool[1] = k;
    s.stride[0] = s.stride[1] = stride;
    s.padding = p;
    return s;
}

static loom_layer_spec L_act(loom_activation a)
{
    loom_layer_spec s = L_keras(LOOM_LAYER_ACTIVATION);
    s.activation = a;
    return s;
}

/* Each new layer's backward against central differences, behind a layer with
 * parameters (so its input gradient is checked too). */
static void test_grad_layers(void)
{
    loom_shape img = shp(3, 5, 5, 2), vec = shp(1, 5, 0, 0), scalar = shp(0, 0, 0, 0);
    loom_layer_spec bn_dense[] = {L_dense(6, LOOM_ACT_NONE), L_keras(LOOM_LAYER_BATCH_NORM), L_act(LOOM_ACT_TANH),
                                  L_dense(3, LOOM_ACT_NONE)};
    gradcheck("batch_normalization (features)", mk_task(LOOM_LOSS_SPARSE_SOFTMAX_CE, 4, bn_dense), vec, scalar,
              LOOM_I64, 8, 0);
    /* tanh, not relu, after it: a weight's step moves every normalised value, and relu kinks would blur the check */
    loom_layer_spec bn_conv[] = {L_conv(3, 3, 1, LOOM_PAD_SAME, LOOM_ACT_NONE), L_keras(LOOM_LAYER_BATCH_NORM),
                                 L_act(LOOM_ACT_TANH), L_keras(LOOM_LAYER_FLATTEN), L_dense(3, LOOM_ACT_NONE)};
    gradcheck("batch_normalization (conv channels)", mk_task(LOOM_LOSS_SPARSE_SOFTMAX_CE, 5, bn_conv), img, scalar,
              LOOM_I64, 4, 0);
    loom_layer_spec bn_first[] = {L_keras(LOOM_LAYER_BATCH_NORM), L_dense(3, LOOM_ACT_NONE)}; /* no input gradient */
    gradcheck("batch_normalization first", mk_task(LOOM_LOSS_SPARSE_SOFTMAX_CE, 2, bn_first), vec, scalar, LOOM_I64, 8,
              0);
    loom_layer_spec ln[] = {L_dense(6, LOOM_ACT_NONE), L_keras(LOOM_LAYER_LAYER_NORM), L_dense(3, LOOM_ACT_NONE)};
    gradcheck("layer_normalization", mk_task(LOOM_LOSS_SPARSE_SOFTMAX_CE, 3, ln), vec, scalar, LOOM_I64, 6, 0);
    loom_layer_spec ln_img[] = {L_conv(4, 3, 1, LOOM_PAD_SAME, LOOM_ACT_NONE), L_keras(LOOM_LAYER_LAYER_NORM),
                                L_keras(LOOM_LAYER_FLATTEN), L_dense(3, LOOM_ACT_NONE)};
    gradcheck("layer_normalization (per position)", mk_task(LOOM_LOSS_SPARSE_SOFTMAX_CE, 4, ln_img), img, scalar,
              LOOM_I64, 3, 0);
    loom_layer_spec gap[] = {L_conv(4, 3, 1, LOOM_PAD_SAME, LOOM_ACT_NONE), L_keras(LOOM_LAYER_GLOBAL_AVG_POOL2D),
                             L_dense(3, LOOM_ACT_NONE)};
    gradcheck("global_average_pooling2d", mk_task(LOOM_LOSS_SPARSE_SOFTMAX_CE, 3, gap), img, scalar, LOOM_I64, 4, 0);
    loom_layer_spec avg_v[] = {L_conv(3, 3, 1, LOOM_PAD_SAME, LOOM_ACT_NONE), L_avg(2, 2, LOOM_PAD_VALID),
                               L_keras(LOOM_LAYER_FLATTEN), L_dense(3, LOOM_ACT_NONE)};
    gradcheck("average_pooling2d valid", mk_task(LOOM_LOSS_SPARSE_SOFTMAX_CE, 4, avg_v), img, scalar, LOOM_I64, 4, 0);
    loom_layer_spec avg_s[] = {L_conv(3, 3, 1, LOOM_PAD_SAME, LOOM_ACT_NONE), L_avg(3, 2, LOOM_PAD_SAME),
                               L_keras(LOOM_LAYER_FLATTEN), L_dense(3, LOOM_ACT_NONE)};
    gradcheck("average_pooling2d same 3/2", mk_task(LOOM_LOSS_SPARSE_SOFTMAX_CE, 4, avg_s), img, scalar, LOOM_I64, 4,
              0);
    loom_layer_spec leaky[] = {L_dense(6, LOOM_ACT_NONE), L_act(LOOM_ACT_LEAKY_RELU), L_dense(3, LOOM_ACT_NONE)};
    gradcheck("leaky_relu", mk_task(LOOM_LOSS_SPARSE_SOFTMAX_CE, 3, leaky), vec, scalar, LOOM_I64, 6, 0);
    loom_layer_spec gelu[] = {L_dense(6, LOOM_ACT_NONE), L_act(LOOM_ACT_GELU), L_dense(3, LOOM_ACT_NONE)};
    gradcheck("gelu", mk_task(LOOM_LOSS_SPARSE_SOFTMAX_CE, 3, gelu), vec, scalar, LOOM_I64, 6, 0);
    /* gelu and leaky_relu inside a dense layer: an error with the layer to write instead */
    loom_layer_spec bad[] = {L_dense(6, LOOM_ACT_GELU)};
    loom_model *m = NULL;
    CHECK(loom_model_new(&m, mk_task(LOOM_LOSS_SPARSE_SOFTMAX_CE, 1, bad), &vec, LOOM_F32, &scalar, LOOM_I64, 4,
                         &err) == LOOM_ESHAPE);
    CHECK_CONTAINS(err.hint, "{ type = \"activation\"; activation = \"gelu\"; }");
}

static void test_layer_values(void)
{
    /* gelu(1) = 0.8413447, leaky_relu(-2) = -0.6 with alpha 0.3; avg pool same counts only the inside */
    loom_layer_spec g1[] = {L_act(LOOM_ACT_GELU)}, l1[] = {L_act(LOOM_ACT_LEAKY_RELU)};
    loom_shape vec = shp(1, 2, 0, 0);
    loom_model *m = NULL;
    float x[] = {1.f, -2.f}, out[2];
    loom_tensor xt;
    tensor_of(&xt, LOOM_F32, shp(2, 1, 2, 0), x);
    CHECK(loom_model_new(&m, mk_task(LOOM_LOSS_MSE, 1, g1), &vec, LOOM_F32, &vec, LOOM_F32, 1, &err) == LOOM_OK);
    if (m && loom_model_predict(m, &xt, out, &err) == LOOM_OK) {
        CHECK_NEAR(out[0], 0.8413447, 1e-6);
        CHECK_NEAR(out[1], -2 * 0.0227501319, 1e-6);
    }
    loom_model_free(m);
    CHECK(loom_model_new(&m, mk_task(LOOM_LOSS_MSE, 1, l1), &vec, LOOM_F32, &vec, LOOM_F32, 1, &err) == LOOM_OK);
    if (m && loom_model_predict(m, &xt, out, &err) == LOOM_OK) CHECK(out[0] == 1.f && fabsf(out[1] + 0.6f) < 1e-7f);
    loom_model_free(m);
    loom_tensor_fini(&xt);
    loom_layer_spec ap[] = {L_avg(2, 2, LOOM_PAD_SAME)};
    loom_shape in = shp(3, 3, 3, 1), o = shp(3, 2, 2, 1);
    CHECK(loom_model_new(&m, mk_task(LOOM_LOSS_MSE, 1, ap), &in, LOOM_F32, &o, LOOM_F32, 1, &err) == LOOM_OK);
    float img[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9}, po[4];
    loom_shape xs4 = {.rank = 4, .dim = {1, 3, 3, 1}};
    tensor_of(&xt, LOOM_F32, xs4, img);
    if (m && loom_model_predict(m, &xt, po, &err) == LOOM_OK) {
        CHECK_NEAR(po[0], 3.0, 1e-6); /* (1 + 2 + 4 + 5) / 4 */
        CHECK_NEAR(po[1], 4.5, 1e-6); /* (3 + 6) / 2: the padding is not counted */
        CHECK_NEAR(po[3], 9.0, 1e-6);
    }
    loom_model_free(m);
    loom_tensor_fini(&xt);
}

/* Batch normalization: moving statistics move toward the batch's as Keras
 * does, evaluation uses them, and a step gives the same bits with 1 and 3
 * threads (the statistics cross the chunks). */
static void test_batch_norm(void)
{
    loom_layer_spec ls[] = {L_dense(4, LOOM_ACT_NONE), L_keras(LOOM_LAYER_BATCH_NORM), L_dense(3, LOOM_ACT_NONE)};
    loom_model_spec *s = mk_task(LOOM_LOSS_SPARSE_SOFTMAX_CE, 3, ls);
    fixture a, b;
    if (fixture_new(&a, s, shp(1, 5, 0, 0), shp(0, 0, 0, 0), LOOM_I64, 9, 3, 0) ||
        fixture_new(&b, s, shp(1, 5, 0, 0), shp(0, 0, 0, 0), LOOM_I64, 9, 3, 0)) {
        CHECK(0);
        return;
    }
    const loom_param_info *mm = NULL, *mv = NULL;
    for (int i = 0; i < loom_model_num_param_tensors(a.m); i++) {
        const loom_param_info *t = loom_model_param_tensor(a.m, i);
        if (strstr(t->name, "/moving_mean")) mm = t;
        if (strstr(t->name, "/moving_variance")) mv = t;
    }
    CHECK(mm && mv && !strcmp(mm->name, "layer_1/moving_mean"));
    if (!mm || !mv) return;
    float *pa = loom_model_params(a.m);
    CHECK(pa[mm->offset] == 0.f && pa[mv->offset] == 1.f);
    /* the batch's mean of the dense outputs, by hand */
    double mean0 = 0;
    const float *W = pa, *bias = pa + 5 * 4;
    for (int e = 0; e < 9; e++) {
        double z = bias[0];
        for (int k = 0; k < 5; k++) z += (double)((float *)a.x.data)[e * 5 + k] * W[k * 4];
        mean0 += z / 9;
    }
    step_loss(&a);
    CHECK_NEAR(pa[mm->offset], 0.01 * mean0, 1e-6);
    loom_model_set_threads(b.m, 3, &err);
    step_loss(&b);
    CHECK(memcmp(loom_model_grads(a.m), loom_model_grads(b.m), (size_t)loom_model_num_params(a.m) * sizeof(float)) == 0);
    CHECK(memcmp(pa, loom_model_params(b.m), (size_t)loom_model_num_params(a.m) * sizeof(float)) == 0);
    /* evaluation normalises with the moving statistics: set them to the identity and compare */
    for (int k = 0; k < 4; k++) pa[mm->offset + k] = 0.f, pa[mv->offset + k] = 1.f - 1e-3f;
    double l_eval;
    int64_t c;
    CHECK(loom_model_evaluate(a.m, &a.x, &a.y, &l_eval, &c, &err) == LOOM_OK);
    loom_layer_spec plain[] = {L_dense(4, LOOM_ACT_NONE), L_dense(3, LOOM_ACT_NONE)};
    fixture p;
    if (fixture_new(&p, mk_task(LOOM_LOSS_SPARSE_SOFTMAX_CE, 2, plain), shp(1, 5, 0, 0), shp(0, 0, 0, 0), LOOM_I64, 9,
                    3, 0) == LOOM_OK) {
        float *pp = loom_model_params(p.m);
        memcpy(pp, pa, 24 * sizeof(float));                    /* dense 0 */
        memcpy(pp + 24, pa + 24 + 16, 15 * sizeof(float));     /* dense 1, past gamma, beta, mean, variance */
        memcpy(p.x.data, a.x.data, 9 * 5 * sizeof(float));
        memcpy(p.y.data, a.y.data, 9 * sizeof(int64_t));
        double l_plain;
        CHECK(loom_model_evaluate(p.m, &p.x, &p.y, &l_plain, &c, &err) == LOOM_OK);
        CHECK_NEAR(l_eval, l_plain, 1e-4);
        fixture_free(&p);
    }
    /* AdamW's decay leaves the moving statistics alone (not trained), and decays gamma */
    loom_optimizer_spec os = opt_spec(LOOM_OPT_ADAMW);
    os.weight_decay = 0.5;
    loom_optimizer *o = NULL;
    CHECK(loom_optimizer_new(&o, &os, loom_model_num_params(b.m), &err) == LOOM_OK);
    if (o) {
        loom_optimizer_for_model(o, b.m);
        float *pb = loom_model_params(b.m);
        step_loss(&b);
        float mm0 = pb[mm->offset + 1], mv0 = pb[mv->offset + 2], gamma0 = pb[mm->offset - 8];
        memset(loom_model_grads(b.m), 0, (size_t)loom_model_num_params(b.m) * sizeof(float));
        loom_optimizer_apply(o, pb, loom_model_grads(b.m), 0);
        CHECK(pb[mm->offset + 1] == mm0 && pb[mv->offset + 2] == mv0);
        CHECK_NEAR(pb[mm->offset - 8], gamma0 * (1 - 0.1 * 0.5), 1e-6);
        loom_optimizer_free(o);
    }
    fixture_free(&a);
    fixture_free(&b);
}

/* Per-example weights multiply each example's loss and gradient. */
static void test_sample_weights(void)
{
    loom_layer_spec ls[] = {L_dense(6, LOOM_ACT_TANH), L_dense(3, LOOM_ACT_NONE)};
    static const loom_loss_kind losses[] = {LOOM_LOSS_SPARSE_SOFTMAX_CE, LOOM_LOSS_MSE};
    for (int k = 0; k < 2; k++) {
        loom_model_spec *s = mk_task(losses[k], 2, ls);
        loom_shape lab = k ? shp(1, 3, 0, 0) : shp(0, 0, 0, 0);
        fixture f;
        if (fixture_new(&f, s, shp(1, 5, 0, 0), lab, k ? LOOM_F32 : LOOM_I64, 4, 5, 0) != LOOM_OK) {
            CHECK(0);
            return;
        }
        /* each example's loss alone, from evaluate on a batch of one */
        double each[4], loss, want = 0;
        int64_t c;
        const double wv[4] = {2, 0, 1, 0.5};
        for (int b = 0; b < 4; b++) {
            loom_tensor x1 = f.x, y1 = f.y;
            x1.shape.dim[0] = y1.shape.dim[0] = 1;
            x1.data = (float *)f.x.data + b * 5;
            y1.data = (char *)f.y.data + b * (k ? 3 * sizeof(float) : sizeof(int64_t));
            CHECK(loom_model_evaluate(f.m, &x1, &y1, &each[b], &c, &err) == LOOM_OK);
            want += wv[b] * each[b];
        }
        loom_tensor w;
        tensor_of(&w, LOOM_F64, shp(1, 4, 0, 0), wv);
        loom_model_set_sample_weights(f.m, &w);
        CHECK(loom_model_evaluate(f.m, &f.x, &f.y, &loss, &c, &err) == LOOM_OK);
        CHECK_NEAR(loss, want, 1e-5);
        char what[64];
        snprintf(what, sizeof what, "loss %d with sample weights", k);
        loom_model_set_sample_weights(f.m, NULL);
        fixture_free(&f);
        /* the gradient of the weighted loss against finite differences: the
         * fixture's weights stay set through gradcheck's steps */
        fixture g;
        if (fixture_new(&g, s, shp(1, 5, 0, 0), lab, k ? LOOM_F32 : LOOM_I64, 4, 5, 0) == LOOM_OK) {
            loom_model_set_sample_weights(g.m, &w);
            int64_t P = loom_model_num_params(g.m);
            float *p = loom_model_params(g.m);
            step_loss(&g);
            float *ga = malloc((size_t)P * sizeof *ga);
            memcpy(ga, loom_model_grads(g.m), (size_t)P * sizeof *ga);
            harness_gradcheck gc = harness_gradcheck_run(what, p, ga, P, 1, 1e-2f, 4, gc_loss, &g, NULL, 0);
            CHECK_MSG(gc.bad == 0, "%s: %lld gradients off", what, gc.bad);
            free(ga);
            /* a negative weight is the data's error */
            ((double *)w.data)[2] = -1;
            CHECK(loom_model_train_step(g.m, &g.x, &g.y, 4, 0, &loss, &c, &err) == LOOM_EDATA);
            CHECK_CONTAINS(err.msg, "sample weight of example 2 in the batch is -1");
            fixture_free(&g);
        }
        loom_tensor_fini(&w);
    }
}


/* ---- synchronised batch normalization ------------------------------------------- */

/* Two replicas in two threads; their sync sums the pair's buffers. */
typedef struct sync_pair {
    pthread_barrier_t bar;
    float            *buf[2];
} sync_pair;
typedef struct sync_side {
    sync_pair *p;
    int        r;
    fixture   *f;
    int64_t    gb;
    double     loss;
    int        rc;
    loom_err   err;
} sync_side;

static int pair_sync(void *arg, float *buf, int64_t n, loom_err *e)
{
    (void)e;
    sync_side *s = arg;
    s->p->buf[s->r] = buf;
    pthread_barrier_wait(&s->p->bar);
    if (s->r == 0)
        for (int64_t i = 0; i < n; i++) s->p->buf[0][i] = s->p->buf[1][i] = s->p->buf[0][i] + s->p->buf[1][i];
    pthread_barrier_wait(&s->p->bar);
    return LOOM_OK;
}

static void *side_step(void *arg)
{
    sync_side *s = arg;
    s->rc = loom_model_train_step(s->f->m, &s->f->x, &s->f->y, s->gb, 1, &s->loss, NULL, &s->err);
    return NULL;
}

typedef struct idle_side {
    loom_model *m;
    int         rc;
    loom_err    err;
} idle_side;

static void *idle_thread(void *arg)
{
    idle_side *s = arg;
    s->rc = loom_model_bn_sync_idle(s->m, LOOM_BN_SYNC_STEP, &s->err);
    return NULL;
}

/* One training step of both replicas (the second on its own thread): the pair's summed loss. */
static double pair_step(sync_side *a, sync_side *b)
{
    pthread_t t;
    LOOM_ASSERT(pthread_create(&t, NULL, side_step, b) == 0);
    side_step(a);
    pthread_join(t, NULL);
    CHECK_MSG(a->rc == LOOM_OK && b->rc == LOOM_OK, "pair step: %s / %s", a->err.msg, b->err.msg);
    return a->loss + b->loss;
}

/* Replicas of Ba and Bb examples with a sync layer: their summed gradient
 * equals one model's on the Ba + Bb examples (and does not without sync),
 * and it matches central differences of the pair's summed loss. */
static void sync_gradcheck(const char *what, const loom_model_spec *spec, loom_shape in, int64_t Ba, int64_t Bb)
{
    fixture a, b, c;
    loom_shape scalar = shp(0, 0, 0, 0);
    if (fixture_new(&a, spec, in, scalar, LOOM_I64, Ba, 11, 0) || fixture_new(&b, spec, in, scalar, LOOM_I64, Bb, 12, 0) ||
        fixture_new(&c, spec, in, scalar, LOOM_I64, Ba + Bb, 13, 0)) {
        CHECK_MSG(0, "%s: cannot build", what);
        return;
    }
    const int64_t P = loom_model_num_params(a.m), nx = loom_shape_numel(&in), B = Ba + Bb;
    CHECK(loom_model_num_sync_bn(a.m) == 1);
    float *p0 = malloc((size_t)P * sizeof *p0), *g = malloc((size_t)P * sizeof *g);
    memcpy(p0, loom_model_params(a.m), (size_t)P * sizeof *p0);
    /* c: one model on both batches */
    memcpy((float *)c.x.data, a.x.data, (size_t)(Ba * nx) * sizeof(float));
    memcpy((float *)c.x.data + Ba * nx, b.x.data, (size_t)(Bb * nx) * sizeof(float));
    memcpy((int64_t *)c.y.data, a.y.data, (size_t)Ba * sizeof(int64_t));
    memcpy((int64_t *)c.y.data + Ba, b.y.data, (size_t)Bb * sizeof(int64_t));
    sync_pair pr;
    pthread_barrier_init(&pr.bar, NULL, 2);
    sync_side sa = {.p = &pr, .r = 0, .f = &a, .gb = B}, sb = {.p = &pr, .r = 1, .f = &b, .gb = B};
#define RESET() (memcpy(loom_model_params(a.m), p0, (size_t)P * sizeof *p0), \
                 memcpy(loom_model_params(b.m), p0, (size_t)P * sizeof *p0))
    for (int synced = 0; synced < 2; synced++) {
        loom_model_set_bn_sync(a.m, synced ? pair_sync : NULL, &sa);
        loom_model_set_bn_sync(b.m, synced ? pair_sync : NULL, &sb);
        RESET();
        memcpy(loom_model_params(c.m), p0, (size_t)P * sizeof *p0);
        double lc = 0, lab = pair_step(&sa, &sb);
        CHECK(loom_model_train_step(c.m, &c.x, &c.y, B, 1, &lc, NULL, &err) == LOOM_OK);
        double d = 0, n = 0;
        for (int64_t k = 0; k < P; k++) {
            g[k] = loom_model_grads(a.m)[k] + loom_model_grads(b.m)[k];
            d = fmax(d, fabs(g[k] - loom_model_grads(c.m)[k]));
            n = fmax(n, fabs(loom_model_grads(c.m)[k]));
        }
        /* the moving statistics too: every replica moves them with the global batch's */
        double dp = 0;
        for (int64_t k = 0; k < P; k++) dp = fmax(dp, fabs(loom_model_params(a.m)[k] - loom_model_params(c.m)[k]));
        printf("# %s, %s: pair vs one model: loss %.3g apart, gradient %.3g (of %.3g), moving statistics %.3g\n", what,
               synced ? "sync" : "no sync", fabs(lab - lc), d, n, dp);
        if (synced)
            CHECK_MSG(d <= 1e-5 * n && fabs(lab - lc) <= 1e-5 * fabs(lc) && dp <= 1e-6,
                      "%s: synced pair differs from one model (gradient %.3g, loss %.3g, moving stats %.3g)", what, d,
                      fabs(lab - lc), dp);
        else
            CHECK_MSG(d > 1e-3 * n, "%s: without sync the pair should differ from one model (%.3g)", what, d);
    }
    /* central differences of the pair's summed loss (synced) */
    const float eps = 1e-2f;
    int64_t bad = 0, tested = 0, kinks = 0;
    double worst = 0;
    for (int64_t k = 0; k < P; k++) {
        RESET();
        loom_model_params(a.m)[k] = loom_model_params(b.m)[k] = p0[k] + eps;
        double lp = pair_step(&sa, &sb);
        RESET();
        loom_model_params(a.m)[k] = loom_model_params(b.m)[k] = p0[k] - eps;
        double lm = pair_step(&sa, &sb);
        RESET();
        double l0 = pair_step(&sa, &sb);
        if (fabs(lp - 2 * l0 + lm) > 0.05 * fabs(lp - lm) + 1e-5) {
            kinks++;
            continue;
        }
        double num = (lp - lm) / (2.0 * eps) / (double)B, an = g[k];
        double rel = fabs(num - an) / fmax(fmax(fabs(num), fabs(an)), 1e-2);
        worst = fmax(worst, rel);
        tested++;
        if (rel > 1e-2) {
            if (bad < 5) printf("#   %s: param %lld: analytic %.6g numeric %.6g\n", what, (long long)k, an, num);
            bad++;
        }
    }
    printf("# %s, sync: %lld params checked against central differences, worst relative error %.2e, %lld skipped at "
           "kinks\n", what, (long long)tested, worst, (long long)kinks);
    CHECK_MSG(tested > 0 && kinks * 3 <= tested, "%s: %lld checked, %lld kinks", what, (long long)tested, (long long)kinks);
    CHECK_MSG(bad == 0, "%s: %lld of %lld synced gradients off", what, (long long)bad, (long long)tested);
    /* a replica without examples takes part with zeros: the other's step is then one model's on its batch */
    RESET();
    memcpy(loom_model_params(c.m), p0, (size_t)P * sizeof *p0);
    sa.gb = Ba;
    pthread_t t;
    idle_side id = {.m = b.m, .rc = -1};
    LOOM_ASSERT(pthread_create(&t, NULL, idle_thread, &id) == 0);
    side_step(&sa);
    pthread_join(t, NULL);
    fixture one;
    if (fixture_new(&one, spec, in, scalar, LOOM_I64, Ba, 11, 0) == LOOM_OK) {
        memcpy(loom_model_params(one.m), p0, (size_t)P * sizeof *p0);
        double l1 = 0;
        CHECK(loom_model_train_step(one.m, &one.x, &one.y, Ba, 1, &l1, NULL, &err) == LOOM_OK);
        double d = 0;
        for (int64_t k = 0; k < P; k++) d = fmax(d, fabs(loom_model_grads(a.m)[k] - loom_model_grads(one.m)[k]));
        CHECK_MSG(id.rc == LOOM_OK && sa.rc == LOOM_OK && d <= 1e-5, "%s: beside an idle replica: gradient %.3g apart",
                  what, d);
        fixture_free(&one);
    }
#undef RESET
    pthread_barrier_destroy(&pr.bar);
    free(p0), free(g);
    fixture_free(&a), fixture_free(&b), fixture_free(&c);
}

static void test_sync_batch_norm(void)
{
    loom_layer_spec bn = L_keras(LOOM_LAYER_BATCH_NORM);
    bn.sync = true;
    bn.momentum = 0.5; /* the moving statistics move visibly */
    loom_layer_spec dense[] = {L_dense(6, LOOM_ACT_NONE), bn, L_act(LOOM_ACT_TANH), L_dense(3, LOOM_ACT_NONE)};
    sync_gradcheck("sync batch_normalization (features), replicas of 5 and 3",
                   mk_task(LOOM_LOSS_SPARSE_SOFTMAX_CE, 4, dense), shp(1, 5, 0, 0), 5, 3);
    loom_layer_spec conv[] = {L_conv(3, 3, 1, LOOM_PAD_SAME, LOOM_ACT_NONE), bn, L_act(LOOM_ACT_TANH),
                              L_keras(LOOM_LAYER_FLATTEN), L_dense(3, LOOM_ACT_NONE)};
    sync_gradcheck("sync batch_normalization (conv channels), replicas of 2 and 3",
                   mk_task(LOOM_LOSS_SPARSE_SOFTMAX_CE, 5, conv), shp(3, 5, 5, 2), 2, 3);
    /* without a sync function (one_device) the layer normalises over its own batch: the bits of sync = false */
    fixture f, g;
    bn.sync = false;
    loom_layer_spec plain[] = {L_dense(6, LOOM_ACT_NONE), bn, L_act(LOOM_ACT_TANH), L_dense(3, LOOM_ACT_NONE)};
    if (fixture_new(&f, mk_task(LOOM_LOSS_SPARSE_SOFTMAX_CE, 4, dense), shp(1, 5, 0, 0), shp(0, 0, 0, 0), LOOM_I64, 7,
                    5, 0) ||
        fixture_new(&g, mk_task(LOOM_LOSS_SPARSE_SOFTMAX_CE, 4, plain), shp(1, 5, 0, 0), shp(0, 0, 0, 0), LOOM_I64, 7,
                    5, 0)) {
        CHECK(0);
        return;
    }
    step_loss(&f), step_loss(&g);
    const int64_t P = loom_model_num_params(f.m);
    CHECK(!memcmp(loom_model_grads(f.m), loom_model_grads(g.m), (size_t)P * sizeof(float)));
    CHECK(!memcmp(loom_model_params(f.m), loom_model_params(g.m), (size_t)P * sizeof(float)));
    fixture_free(&f), fixture_free(&g);
}

static const loom_test tests[] = {
    {"loss gradients (bce, mae, huber, class weights)", test_grad_losses},
    {"binary cross-entropy values and bad labels", test_bce_values},
    {"regression shapes, hints and metrics", test_regression_shapes},
    {"auc as Keras, precision, recall, mae, rmse", test_auc},
    {"top_k, accuracy, precision of classes", test_classification_metrics},
    {"metrics that do not fit the task", test_metric_fit},
    {"adamw, rmsprop, clip_norm against their formulas", test_optimizers_more},
    {"clip_norm: ranges read the whole norm", test_clip_ranges},
    {"l2 regularisation: gradient and reported loss", test_l2},
    {"new layers' gradients", test_grad_layers},
    {"gelu, leaky_relu, average pooling values", test_layer_values},
    {"batch normalization: moving statistics, threads, eval", test_batch_norm},
    {"sample weights: loss, gradient, bad weights", test_sample_weights},
    {"synchronised batch normalization: two replicas = one model, finite differences", test_sync_batch_norm},
    {0},
};

int main(void)
{
    if (loom_blas_init(1, &err) != LOOM_OK) {
        printf("Bail out! %s: %s\n", err.where, err.msg);
        return 1;
    }
    return loom_test_run(tests);
}
