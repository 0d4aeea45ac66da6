/* test_tasks.c - tasks beyond 10-way classification (issue 16, sections 3
 * and 4): binary cross-entropy from logits, MAE, Huber, class weights, each
 * gradient against central finite differences; model.metrics (AUC against
 * an independent implementation of Keras' definition, precision, recall,
 * top-k, mae, rmse) and the metrics that do not fit a task; labels a loss
 * cannot take. */
#include "harness.h"
#include "nn/nn.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static loom_err err;

static loom_layer_spec L_dense(int units, loom_activation a)
{
    loom_layer_spec s = {0};
    s.kind = LOOM_LAYER_DENSE;
    s.units = units;
    s.activation = a;
    s.kernel_init = LOOM_INIT_GLOROT_UNIFORM;
    s.use_bias = true;
    return s;
}

static loom_model_spec spec_buf;

static loom_model_spec *mk(loom_loss_kind loss, int n, const loom_layer_spec *layers)
{
    memset(&spec_buf, 0, sizeof spec_buf);
    snprintf(spec_buf.loc.file, sizeof spec_buf.loc.file, "test.cfg");
    spec_buf.loc.line = 5;
    spec_buf.metrics_loc = spec_buf.loc;
    spec_buf.metrics_loc.line = 7;
    spec_buf.loss = loss;
    spec_buf.n_layers = n;
    spec_buf.auc_thresholds = 200;
    spec_buf.top_k = 5;
    spec_buf.huber_delta = 1.0;
    for (int i = 0; i < n; i++) {
        spec_buf.layer[i] = layers[i];
        snprintf(spec_buf.layer[i].name, sizeof spec_buf.layer[i].name, "layer_%d", i);
        snprintf(spec_buf.layer[i].loc.file, sizeof spec_buf.layer[i].loc.file, "test.cfg");
        spec_buf.layer[i].loc.line = 10 + i;
    }
    return &spec_buf;
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
    const double l0 = step_loss(&f);
    memcpy(ga, loom_model_grads(f.m), (size_t)P * sizeof *ga);
    int64_t bad = 0, tested = 0, kinks = 0;
    double worst = 0;
    for (int64_t k = 0; k < P; k++) {
        float p0 = p[k];
        p[k] = p0 + eps;
        double lp = step_loss(&f);
        p[k] = p0 - eps;
        double lm = step_loss(&f);
        p[k] = p0;
        if (fabs(lp - 2 * l0 + lm) > 0.05 * fabs(lp - lm) + 1e-5) {
            kinks++;
            continue;
        }
        double num = (lp - lm) / (2.0 * eps) / (double)B, an = ga[k];
        double rel = fabs(num - an) / fmax(fmax(fabs(num), fabs(an)), 1e-2);
        worst = fmax(worst, rel);
        tested++;
        if (rel > 1e-2) {
            if (bad < 5) printf("#   %s: param %lld: analytic %.6g numeric %.6g\n", what, (long long)k, an, num);
            bad++;
        }
    }
    printf("# %s: %lld params checked, worst relative error %.2e, %lld skipped at kinks\n", what, (long long)tested,
           worst, (long long)kinks);
    CHECK_MSG(tested > 0 && kinks * 3 <= tested, "%s: %lld checked, %lld kinks", what, (long long)tested,
              (long long)kinks);
    CHECK_MSG(bad == 0, "%s: %lld of %lld gradients off", what, (long long)bad, (long long)tested);
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
    gradcheck("bce, scalar 0/1 int64 labels", mk(LOOM_LOSS_BCE, 2, one), in, scalar, LOOM_I64, 6, 0);
    gradcheck("bce, sigmoid output fused", mk(LOOM_LOSS_BCE, 2, sig), in, scalar, LOOM_F32, 6, 0);
    gradcheck("bce, 3 outputs, soft labels", mk(LOOM_LOSS_BCE, 2, three), in, v3, LOOM_F32, 6, 1);
    loom_model_spec *s = mk(LOOM_LOSS_BCE, 2, one);
    s->n_class_weights = 2;
    s->class_weight[0] = 0.3f;
    s->class_weight[1] = 2.5f;
    gradcheck("bce, class weights", s, in, scalar, LOOM_F32, 6, 0);
    gradcheck("mae, scalar labels", mk(LOOM_LOSS_MAE, 2, one), in, scalar, LOOM_F32, 6, 0);
    /* piecewise linear: a smaller step meets fewer kinks that the second difference cannot see */
    gradcheck_eps("mae, 3 outputs", mk(LOOM_LOSS_MAE, 2, three), in, v3, LOOM_F64, 6, 0, 2e-3f);
    s = mk(LOOM_LOSS_HUBER, 2, three);
    s->huber_delta = 0.7; /* targets ~ N(0, 4): both sides of delta */
    gradcheck("huber, delta 0.7", s, in, v3, LOOM_F32, 6, 0);
    gradcheck("mse, scalar labels", mk(LOOM_LOSS_MSE, 2, one), in, scalar, LOOM_F32, 6, 0);
    s = mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 2, three);
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
    loom_model *m = identity_model(mk(LOOM_LOSS_BCE, 1, d), shp(0, 0, 0, 0), LOOM_F32, 4);
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
    CHECK(loom_model_new(&m, mk(LOOM_LOSS_MSE, 1, one), &in, LOOM_F32, &scalar, LOOM_F32, 4, &err) == LOOM_OK);
    if (m) CHECK(loom_model_num_metrics(m) == 0);
    loom_model_free(m);
    m = NULL;
    /* a scalar float target with ten outputs: say how to make one output */
    CHECK(loom_model_new(&m, mk(LOOM_LOSS_HUBER, 1, ten), &in, LOOM_F32, &scalar, LOOM_F32, 4, &err) == LOOM_ESHAPE);
    CHECK_CONTAINS(err.msg, "huber needs labels of the output's shape");
    CHECK_CONTAINS(err.hint, "units = 1");
    CHECK(strstr(err.hint, "one_hot") == NULL);
    /* integer classes against ten outputs under MSE: the one_hot hint still helps */
    CHECK(loom_model_new(&m, mk(LOOM_LOSS_MSE, 1, ten), &in, LOOM_F32, &scalar, LOOM_U8, 4, &err) == LOOM_ESHAPE);
    CHECK_CONTAINS(err.hint, "one_hot map with depth = 10");
    /* accuracy asked of a regression */
    loom_model_spec *s = mk(LOOM_LOSS_MAE, 1, one);
    loom_metric_kind acc[] = {LOOM_METRIC_MAE, LOOM_METRIC_ACCURACY};
    set_metrics(s, 2, acc);
    CHECK(loom_model_new(&m, s, &in, LOOM_F32, &scalar, LOOM_F32, 4, &err) == LOOM_ECONFIG);
    CHECK_CONTAINS(err.where, "test.cfg:7");
    CHECK_CONTAINS(err.msg, "model.metrics: \"accuracy\" does not fit this model");
    CHECK_CONTAINS(err.hint, "rmse");
    /* class weights need classes */
    s = mk(LOOM_LOSS_MSE, 1, one);
    s->n_class_weights = 2;
    s->class_weight[0] = s->class_weight[1] = 1;
    CHECK(loom_model_new(&m, s, &in, LOOM_F32, &scalar, LOOM_F32, 4, &err) == LOOM_ECONFIG);
    CHECK_CONTAINS(err.msg, "class_weight");
    s = mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 1, ten);
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
        loom_model_spec *s = mk(LOOM_LOSS_BCE, 1, d);
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
    loom_model_spec *s = mk(LOOM_LOSS_BCE, 1, d);
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
    loom_model_spec *s = mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 1, d);
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
    loom_model_spec *s = mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 1, ten);
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
    s = mk(LOOM_LOSS_BCE, 1, one);
    loom_metric_kind tk[] = {LOOM_METRIC_TOP_K_ACCURACY};
    set_metrics(s, 1, tk);
    CHECK(loom_model_new(&m, s, &in, LOOM_F32, &scalar, LOOM_F32, 4, &err) == LOOM_ECONFIG);
    CHECK_CONTAINS(err.msg, "\"top_k_accuracy\" does not fit");
    s = mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 1, ten);
    set_metrics(s, 1, tk);
    s->top_k = 10;
    CHECK(loom_model_new(&m, s, &in, LOOM_F32, &scalar, LOOM_I64, 4, &err) == LOOM_ECONFIG);
    CHECK_CONTAINS(err.msg, "always right");
    s = mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 1, ten);
    loom_metric_kind mae[] = {LOOM_METRIC_MAE};
    set_metrics(s, 1, mae);
    CHECK(loom_model_new(&m, s, &in, LOOM_F32, &scalar, LOOM_I64, 4, &err) == LOOM_ECONFIG);
    CHECK_CONTAINS(err.msg, "\"mae\" does not fit");
    /* AUC of a regression */
    s = mk(LOOM_LOSS_MSE, 1, one);
    loom_metric_kind a1[] = {LOOM_METRIC_AUC};
    set_metrics(s, 1, a1);
    CHECK(loom_model_new(&m, s, &in, LOOM_F32, &scalar, LOOM_F32, 4, &err) == LOOM_ECONFIG);
    CHECK_CONTAINS(err.msg, "regression");
    /* defaults: accuracy for a classification, nothing for a regression */
    CHECK(loom_model_new(&m, mk(LOOM_LOSS_BCE, 1, one), &in, LOOM_F32, &scalar, LOOM_F32, 4, &err) == LOOM_OK);
    if (m) CHECK(loom_model_num_metrics(m) == 1 && loom_model_metric(m, 0) == LOOM_METRIC_ACCURACY);
    loom_model_free(m);
}

static const loom_test tests[] = {
    {"loss gradients (bce, mae, huber, class weights)", test_grad_losses},
    {"binary cross-entropy values and bad labels", test_bce_values},
    {"regression shapes, hints and metrics", test_regression_shapes},
    {"auc as Keras, precision, recall, mae, rmse", test_auc},
    {"top_k, accuracy, precision of classes", test_classification_metrics},
    {"metrics that do not fit the task", test_metric_fit},
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
