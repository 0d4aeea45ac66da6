/* test_model_device.c - the device executor (nn.h, model_device.c) on the
 * built-in CPU reference backend against nn's host path, on real
 * Fashion-MNIST batches, for an MLP (tests/configs/strategy_mlp.cfg), a CNN
 * with every layer kind and dropout (device_cnn.cfg) and an MSE model
 * (device_mse.cfg), and a residual graph with every merge the device runs
 * (device_resnet.cfg): one train step gives the same gradients (relative
 * difference <= 1e-5), loss and correct count; evaluate and predict agree;
 * 100 steps of SGD with momentum driven by hand, each from the host's
 * weights, give the same gradients and updates (<= 1e-5); two runs of the
 * device path are bit-identical; the parts of a step equal the whole step;
 * gradients kept on the device (for reductions in device memory) are the
 * downloaded ones, bit for bit, and come down by range; a softmax activation
 * the device cannot run is refused at open, naming its layer; bad batches and a non-finite loss give
 * the host path's errors. */
#include "harness.h"
#include "test_util.h"
#include "data/data.h"
#include "nn/nn.h"

#include <math.h>
#include <stdint.h>

static loom_err err;

/* A config's training pipeline and two equal models: one for the host path,
 * one behind a device executor on the CPU backend. */
typedef struct rig {
    loom_spec      *spec;
    loom_iter      *it;
    int             xi, yi;
    int64_t         epoch;
    loom_model     *host, *dm;
    loom_model_dev *dev;
} rig;

static void rig_close(rig *g)
{
    loom_model_dev_close(g->dev);
    loom_model_free(g->host);
    loom_model_free(g->dm);
    loom_iter_close(g->it);
    loom_config_free(g->spec);
    memset(g, 0, sizeof *g);
}

static int new_model(rig *g, loom_model **m)
{
    const loom_elem_spec *es = loom_iter_spec(g->it);
    loom_shape x = es->shape[g->xi], y = es->shape[g->yi];
    loom_shape xe = loom_shape_make(x.rank - 1, x.dim + 1), ye = loom_shape_make(y.rank - 1, y.dim + 1);
    int rc = loom_model_new(m, &g->spec->model, &xe, es->dtype[g->xi], &ye, es->dtype[g->yi], 64, &err);
    if (!rc) loom_model_init_params(*m, g->spec->run.seed);
    return rc;
}

static int rig_open(rig *g, const char *cfg, const char *const *sets, int n_sets)
{
    memset(g, 0, sizeof *g);
    int rc = train_pipeline_open(&g->spec, &g->it, cfg, sets, n_sets, &err);
    if (rc) return rc;
    g->xi = loom_elem_spec_find(loom_iter_spec(g->it), "image");
    g->yi = loom_elem_spec_find(loom_iter_spec(g->it), "label");
    if ((rc = new_model(g, &g->host)) || (rc = new_model(g, &g->dm))) return rc;
    return loom_model_dev_open(&g->dev, g->dm, loom_device_cpu(), 0, &err);
}

static int rig_open_ok(rig *g, const char *cfg)
{
    int rc = rig_open(g, cfg, NULL, 0);
    CHECK_MSG(rc == LOOM_OK, "%s: %s", err.where, err.msg);
    return rc == LOOM_OK;
}

/* The next batch, starting a new epoch at the end of one. */
static loom_elem *next(rig *g)
{
    loom_elem *b = NULL;
    int rc = loom_iter_next(g->it, &b, &err);
    if (rc == LOOM_EEOF && !(rc = loom_iter_rewind(g->it, ++g->epoch, &err))) rc = loom_iter_next(g->it, &b, &err);
    CHECK_MSG(rc == LOOM_OK, "%s", err.msg);
    return rc ? NULL : b;
}

/* One train step on both paths: gradients, loss and count agree. */
static void one_step(const char *cfg)
{
    rig g;
    if (!rig_open_ok(&g, cfg)) return rig_close(&g);
    loom_elem *b = next(&g);
    double lh, ld;
    int64_t ch, cd;
    const loom_tensor *x = &b->t[g.xi], *y = &b->t[g.yi];
    CHECK(loom_model_train_step(g.host, x, y, 64, 1234, &lh, &ch, &err) == LOOM_OK);
    CHECK(loom_model_dev_train_step(g.dev, x, y, 64, 1234, &ld, &cd, &err) == LOOM_OK);
    int64_t P = loom_model_num_params(g.host);
    double r = rel_diff(loom_model_grads(g.host), loom_model_grads(g.dm), P);
    CHECK_MSG(r <= 1e-5, "%s: gradients differ by %g", cfg, r);
    CHECK_NEAR(ld, lh, 1e-6 * fabs(lh));
    CHECK(cd == ch);
    printf("# %s: %lld parameters, gradients %.2g apart, loss %.9g vs %.9g\n", cfg, (long long)P, r, lh, ld);

    /* the three parts give the whole step's gradients, bit for bit */
    float *whole = malloc((size_t)P * sizeof *whole);
    memcpy(whole, loom_model_grads(g.dm), (size_t)P * sizeof *whole);
    memset(loom_model_grads(g.dm), 0, (size_t)P * sizeof *whole);
    double lp;
    int64_t cp;
    CHECK(loom_model_dev_loss(g.dev, y, 64, &lp, &cp, &err) == LOOM_EUSAGE);
    CHECK(loom_model_dev_forward(g.dev, x, 1234, &err) == LOOM_OK);
    CHECK(loom_model_dev_backward(g.dev, &err) == LOOM_EUSAGE);
    CHECK(loom_model_dev_loss(g.dev, y, 64, &lp, &cp, &err) == LOOM_OK);
    CHECK(loom_model_dev_backward(g.dev, &err) == LOOM_OK);
    CHECK(lp == ld && cp == cd);
    CHECK(!memcmp(whole, loom_model_grads(g.dm), (size_t)P * sizeof *whole));
    free(whole);

    /* evaluate and predict, dropout off */
    CHECK(loom_model_evaluate(g.host, x, y, &lh, &ch, &err) == LOOM_OK);
    CHECK(loom_model_dev_evaluate(g.dev, x, y, &ld, &cd, &err) == LOOM_OK);
    CHECK_NEAR(ld, lh, 1e-6 * fabs(lh));
    CHECK(cd == ch);
    int64_t n = x->shape.dim[0] * 10;
    float *ph = malloc((size_t)n * sizeof *ph), *pd = malloc((size_t)n * sizeof *pd);
    CHECK(loom_model_predict(g.host, x, ph, &err) == LOOM_OK);
    CHECK(loom_model_dev_predict(g.dev, x, pd, &err) == LOOM_OK);
    r = rel_diff(ph, pd, n);
    CHECK_MSG(r <= 1e-5, "%s: predictions differ by %g", cfg, r);
    free(ph);
    free(pd);
    rig_close(&g);
}

/* Gradients kept on the device, for reductions in device memory: the fused
 * step and the parts leave the host buffer alone and put the download's bits
 * into the device buffer (one flat buffer, the host's layout); a range comes
 * down alone; an upload replaces the device buffer. The CPU backend's device
 * memory is host memory, so the test reads it directly. */
static void keep_grads(const char *cfg)
{
    rig g;
    if (!rig_open_ok(&g, cfg)) return rig_close(&g);
    loom_elem *b = next(&g);
    const loom_tensor *x = &b->t[g.xi], *y = &b->t[g.yi];
    int64_t P = loom_model_num_params(g.dm), lo = P / 3, hi = 2 * P / 3, c, ck;
    double l, lk;
    float *host = loom_model_grads(g.dm), *dev = loom_model_dev_grads(g.dev);
    float *whole = malloc((size_t)P * sizeof *whole);
    CHECK(dev != NULL && dev != host);
    CHECK(loom_model_dev_train_step(g.dev, x, y, 64, 99, &l, &c, &err) == LOOM_OK);
    memcpy(whole, host, (size_t)P * sizeof *whole);
    for (int64_t i = 0; i < P; i++) host[i] = 7.f;
    memset(dev, 0, (size_t)P * sizeof *dev);
    CHECK(loom_model_dev_train_step_keep(g.dev, x, y, 64, 99, &lk, &ck, &err) == LOOM_OK);
    CHECK(lk == l && ck == c);
    int64_t untouched = 0;
    for (int64_t i = 0; i < P; i++) untouched += host[i] == 7.f;
    CHECK_MSG(untouched == P, "%s: train_step_keep changed %lld host gradients", cfg, (long long)(P - untouched));
    CHECK_MSG(!memcmp(dev, whole, (size_t)P * sizeof *dev), "%s: the kept gradients are not the downloaded ones", cfg);
    CHECK(loom_model_dev_download_grads(g.dev, lo, hi, &err) == LOOM_OK);
    CHECK(!memcmp(host + lo, whole + lo, (size_t)(hi - lo) * sizeof *host));
    CHECK(host[lo - 1] == 7.f && host[hi] == 7.f);
    /* the parts: backward_keep in order only, then the same bits */
    memset(dev, 0, (size_t)P * sizeof *dev);
    CHECK(loom_model_dev_forward(g.dev, x, 99, &err) == LOOM_OK);
    CHECK(loom_model_dev_backward_keep(g.dev, &err) == LOOM_EUSAGE);
    CHECK(loom_model_dev_loss(g.dev, y, 64, &lk, &ck, &err) == LOOM_OK);
    CHECK(loom_model_dev_backward_keep(g.dev, &err) == LOOM_OK);
    CHECK(!memcmp(dev, whole, (size_t)P * sizeof *dev));
    CHECK(host[0] == 7.f && host[P - 1] == 7.f);
    /* an upload replaces the device buffer with the host's */
    CHECK(loom_model_dev_upload_grads(g.dev, &err) == LOOM_OK);
    CHECK(dev[0] == 7.f && dev[lo] == whole[lo] && dev[P - 1] == 7.f);
    free(whole);
    rig_close(&g);
}

static void test_keep_mlp(void) { keep_grads("strategy_mlp.cfg"); }
static void test_keep_cnn(void) { keep_grads("device_cnn.cfg"); }

static void test_step_mlp(void) { one_step("strategy_mlp.cfg"); }
static void test_step_cnn(void) { one_step("device_cnn.cfg"); }
static void test_step_mse(void) { one_step("device_mse.cfg"); }
static void test_step_graph(void) { one_step("device_resnet.cfg"); }
static void test_keep_graph(void) { keep_grads("device_resnet.cfg"); }

/* 100 steps of the config's optimizer on the device path (host update,
 * parameters uploaded after each) and, unless dev_only, on the host path in
 * lockstep; the device path's weights into *out (malloc'd).
 * In lockstep every step starts both paths from the same weights and slots:
 * the step's gradients and updated weights must agree to 1e-5, then the
 * device takes the host's weights and slots. The two paths round differently
 * (nn's direct 1-channel convolution, the reference's im2col: ~1e-7 a step),
 * and left to run apart a rounding difference that moves a pre-activation
 * across ReLU's kink or changes a max-pool winner switches a gradient term
 * on or off, which later steps amplify: device_cnn.cfg ended 4e-6 or 5e-5
 * apart by step 100 depending only on which multiply-adds the compiler
 * fused. Compared step by step, what is measured is one step's rounding. */
static void train_100(const char *cfg, int dev_only, float **out)
{
    *out = NULL;
    rig g;
    if (!rig_open_ok(&g, cfg)) return rig_close(&g);
    int64_t P = loom_model_num_params(g.host);
    loom_optimizer *oh = NULL, *od = NULL;
    CHECK(loom_optimizer_new(&oh, &g.spec->optimizer, P, &err) == LOOM_OK);
    CHECK(loom_optimizer_new(&od, &g.spec->optimizer, P, &err) == LOOM_OK);
    const size_t slot_bytes = (size_t)(loom_optimizer_num_slots(oh) * P) * sizeof(float);
    double lh = 0, ld = 0, rg = 0, rw = 0;
    int64_t sg = -1, sw = -1;
    for (int64_t step = 0; step < 100; step++) {
        loom_elem *b = next(&g);
        if (!b) break;
        const loom_tensor *x = &b->t[g.xi], *y = &b->t[g.yi];
        uint64_t key = loom_rng_mix(g.spec->run.seed, (uint64_t)step);
        double l;
        int64_t c;
        if (!dev_only) {
            int rc = loom_model_train_step(g.host, x, y, x->shape.dim[0], key, &l, &c, &err);
            CHECK_MSG(rc == LOOM_OK, "step %lld: %s", (long long)step, err.msg);
            if (rc) break;
            lh += l;
        }
        int rc = loom_model_dev_train_step(g.dev, x, y, x->shape.dim[0], key, &l, &c, &err);
        CHECK_MSG(rc == LOOM_OK, "step %lld: %s", (long long)step, err.msg);
        if (rc) break;
        ld += l;
        if (!dev_only) {
            double r = rel_diff(loom_model_grads(g.host), loom_model_grads(g.dm), P);
            if (!(r <= rg)) rg = r, sg = step;
            loom_optimizer_apply(oh, loom_model_params(g.host), loom_model_grads(g.host), step);
        }
        loom_optimizer_apply(od, loom_model_params(g.dm), loom_model_grads(g.dm), step);
        if (!dev_only) {
            double r = rel_diff(loom_model_params(g.host), loom_model_params(g.dm), P);
            if (!(r <= rw)) rw = r, sw = step;
            memcpy(loom_model_params(g.dm), loom_model_params(g.host), (size_t)P * sizeof(float));
            if (slot_bytes) memcpy(loom_optimizer_slots(od), loom_optimizer_slots(oh), slot_bytes);
        }
        CHECK(loom_model_dev_upload_params(g.dev, &err) == LOOM_OK);
    }
    if (!dev_only) {
        CHECK_MSG(rg <= 1e-5, "%s: step %lld's gradients differ by %g", cfg, (long long)sg, rg);
        CHECK_MSG(rw <= 1e-5, "%s: the weights after step %lld differ by %g", cfg, (long long)sw, rw);
        printf("# %s: 100 steps from shared weights: gradients at most %.2g apart, updated weights %.2g; mean loss "
               "%.6f (host) vs %.6f (device)\n",
               cfg, rg, rw, lh / 100, ld / 100);
    }
    *out = malloc((size_t)P * sizeof **out);
    memcpy(*out, loom_model_params(g.dm), (size_t)P * sizeof **out);
    loom_optimizer_free(oh);
    loom_optimizer_free(od);
    rig_close(&g);
}

/* lockstep with the host path, then two device-only runs: bit-identical */
static void train_twice(const char *cfg)
{
    float *a, *b, *c;
    train_100(cfg, 0, &c);
    train_100(cfg, 1, &a);
    train_100(cfg, 1, &b);
    CHECK_MSG(a && b && c, "%s: a run failed", cfg);
    if (a && b) {
        rig g;
        if (rig_open_ok(&g, cfg)) CHECK(!memcmp(a, b, (size_t)loom_model_num_params(g.host) * sizeof *a));
        rig_close(&g);
    }
    free(a);
    free(b);
    free(c);
}

static void test_train_mlp(void) { train_twice("strategy_mlp.cfg"); }
static void test_train_cnn(void) { train_twice("device_cnn.cfg"); }
static void test_train_mse(void) { train_twice("device_mse.cfg"); }
static void test_train_graph(void) { train_twice("device_resnet.cfg"); }

/* A softmax activation has no device op: refused at open at the layer's line. */
static void test_softmax_refused(void)
{
    rig g;
    if (!rig_open_ok(&g, "device_mse.cfg")) return rig_close(&g);
    g.spec->model.layer[3].activation = LOOM_ACT_SOFTMAX; /* the last dense layer, under MSE: not fused */
    loom_model *m = NULL;
    loom_model_dev *d = NULL;
    CHECK(new_model(&g, &m) == LOOM_OK);
    CHECK(loom_model_dev_open(&d, m, loom_device_cpu(), 0, &err) == LOOM_EUNSUPPORTED);
    CHECK(d == NULL);
    CHECK_CONTAINS(err.where, "device_mse.cfg:");
    CHECK_CONTAINS(err.msg, "(dense): the \"cpu\" device backend has no softmax activation");
    CHECK_CONTAINS(err.hint, "strategy.device_backend");
    loom_model_free(m);
    rig_close(&g);
}

/* Every layer kind, activation and model setting no device backend runs is
 * refused before any device is looked for, at its file:line, saying what to
 * do; the executor refuses the same layer at open (the layer replaces the
 * dropout of device_mse.cfg, line 21, so the model builds). */
static void test_unsupported_refused(void)
{
    rig g;
    if (!rig_open_ok(&g, "device_mse.cfg")) return rig_close(&g);
    loom_model_spec *ms = &g.spec->model;
    const loom_layer_spec keep = ms->layer[2];
    CHECK(loom_model_spec_dev_check(ms, "cuda", &err) == LOOM_OK);
    static const struct {
        loom_layer_kind kind;
        loom_activation act;
        const char *what;
    } bad[] = {
        {LOOM_LAYER_BATCH_NORM, LOOM_ACT_NONE, "(batch_normalization) is not implemented on the"},
        {LOOM_LAYER_LAYER_NORM, LOOM_ACT_NONE, "(layer_normalization) is not implemented on the"},
        {LOOM_LAYER_AVG_POOL2D, LOOM_ACT_NONE, "(average_pooling2d) is not implemented on the"},
        {LOOM_LAYER_GLOBAL_AVG_POOL2D, LOOM_ACT_NONE, "(global_average_pooling2d) is not implemented on the"},
        {LOOM_LAYER_EMBEDDING, LOOM_ACT_NONE, "(embedding): the \"cuda\" device backend has no embedding lookup"},
        {LOOM_LAYER_ACTIVATION, LOOM_ACT_LEAKY_RELU, "(activation, leaky_relu) is not implemented on the"},
        {LOOM_LAYER_ACTIVATION, LOOM_ACT_GELU, "(activation, gelu) is not implemented on the"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ms->layer[2] = keep;
        ms->layer[2].kind = bad[i].kind;
        ms->layer[2].activation = bad[i].act;
        memset(&err, 0, sizeof err);
        CHECK(loom_model_spec_dev_check(ms, "cuda", &err) == LOOM_EUNSUPPORTED);
        CHECK_CONTAINS(err.where, "device_mse.cfg:21");
        CHECK_CONTAINS(err.msg, bad[i].what);
        CHECK_CONTAINS(err.hint, "use cpu devices");
        CHECK(loom_model_spec_dev_check(ms, "cpu", &err) == LOOM_EUNSUPPORTED);
        CHECK_CONTAINS(err.hint, "remove strategy.device_backend");
    }
    /* batch normalization through the executor: the same refusal at open */
    ms->layer[2] = keep;
    ms->layer[2].kind = LOOM_LAYER_BATCH_NORM;
    ms->layer[2].momentum = 0.99, ms->layer[2].epsilon = 1e-3;
    loom_model *m = NULL;
    loom_model_dev *d = NULL;
    int nrc = new_model(&g, &m);
    CHECK_MSG(nrc == LOOM_OK, "%s: %s", err.where, err.msg);
    if (nrc == LOOM_OK) {
        CHECK(loom_model_dev_open(&d, m, loom_device_cpu(), 0, &err) == LOOM_EUNSUPPORTED);
        CHECK(d == NULL);
        CHECK_CONTAINS(err.where, "device_mse.cfg:21");
        CHECK_CONTAINS(err.msg, "(batch_normalization) is not implemented on the \"cpu\" device backend");
    }
    loom_model_free(m);
    ms->layer[2] = keep;
    /* model settings, at the model block's line */
    ms->l2 = 0.01;
    CHECK(loom_model_spec_dev_check(ms, "cuda", &err) == LOOM_EUNSUPPORTED);
    CHECK_CONTAINS(err.msg, "model.l2 is not implemented on the \"cuda\" device backend");
    CHECK_CONTAINS(err.hint, "adamw");
    ms->l2 = 0;
    ms->loss = LOOM_LOSS_SPARSE_SOFTMAX_CE;
    snprintf(ms->sample_weight, sizeof ms->sample_weight, "w");
    CHECK(loom_model_spec_dev_check(ms, "cuda", &err) == LOOM_EUNSUPPORTED);
    CHECK_CONTAINS(err.msg, "model.sample_weight with sparse_softmax_cross_entropy (its fused softmax_xent is unweighted) is not implemented");
    CHECK_CONTAINS(err.where, "device_mse.cfg:");
    rig_close(&g);
}

/* A graph's merges the device ops cannot run are refused at open, at the layer: a concatenate on another axis
 * than the last, on a backend without copy2d (a version-1 table), and maximum (no device op) before any device
 * is looked for. */
static void test_graph_refused(void)
{
    rig g;
    if (!rig_open_ok(&g, "device_resnet.cfg")) return rig_close(&g);
    loom_model_spec *ms = &g.spec->model;
    int cat = 0;
    while (cat < ms->n_layers && strcmp(ms->layer[cat].name, "cat")) cat++;
    CHECK(cat < ms->n_layers);
    loom_model *m = NULL;
    loom_model_dev *d = NULL;
    ms->layer[cat].axis = 1; /* (14, 14, 8) twice along the rows: valid, but not the last axis */
    CHECK(new_model(&g, &m) == LOOM_OK);
    CHECK(loom_model_dev_open(&d, m, loom_device_cpu(), 0, &err) == LOOM_EUNSUPPORTED);
    CHECK(d == NULL);
    CHECK_CONTAINS(err.where, "device_resnet.cfg:");
    CHECK_CONTAINS(err.msg, "layer \"cat\" (concatenate) joins along another than the last axis");
    loom_model_free(m);
    ms->layer[cat].axis = -1;
    loom_device_ops v1 = *loom_device_cpu();
    v1.version = 1, v1.copy2d = NULL;
    CHECK(new_model(&g, &m) == LOOM_OK);
    CHECK(loom_model_dev_open(&d, m, &v1, 0, &err) == LOOM_EUNSUPPORTED);
    CHECK_CONTAINS(err.msg, "layer \"cat\" (concatenate) needs the backend's copy2d");
    loom_model_free(m);
    ms->layer[cat].kind = LOOM_LAYER_MAXIMUM;
    CHECK(loom_model_spec_dev_check(ms, "cuda", &err) == LOOM_EUNSUPPORTED);
    CHECK_CONTAINS(err.msg, "layer \"cat\" (maximum) is not implemented on the \"cuda\" device backend");
    rig_close(&g);
}

/* Two model inputs (model.inputs: the image and a float "aux" the test makes): the second is uploaded with
 * the batch, and a step's gradients, loss and predictions match the host executor's. */
static void test_two_inputs(void)
{
    loom_spec *spec = NULL;
    loom_iter *it = NULL;
    loom_model *mh = NULL, *md = NULL;
    loom_model_dev *dev = NULL;
    int rc = train_pipeline_open(&spec, &it, "device_two_inputs.cfg", NULL, 0, &err);
    CHECK_MSG(rc == LOOM_OK, "%s: %s", err.where, err.msg);
    loom_elem *b = NULL;
    if (!rc) rc = loom_iter_next(it, &b, &err);
    CHECK_MSG(rc == LOOM_OK, "%s", err.msg);
    if (rc) goto out;
    const loom_elem_spec *es = loom_iter_spec(it);
    int xi = loom_elem_spec_find(es, "image"), yi = loom_elem_spec_find(es, "label");
    const loom_tensor *x = &b->t[xi], *y = &b->t[yi];
    const int64_t B = x->shape.dim[0];
    loom_shape in[2] = {loom_shape_make(3, (int64_t[]){28, 28, 1}), loom_shape_make(1, (int64_t[]){12})};
    loom_dtype dt[2] = {LOOM_F32, LOOM_F32};
    loom_shape ls = loom_shape_make(0, NULL);
    static float aux[32 * 12];
    for (int64_t e = 0; e < B * 12; e++) aux[e] = (float)((e * 7919) % 101) / 50.f - 1.f;
    loom_tensor at = {.dtype = LOOM_F32, .shape = loom_shape_make(2, (int64_t[]){B, 12}), .data = aux};
    const loom_tensor *xs[1] = {&at};
    CHECK(loom_model_new_inputs(&mh, &spec->model, 2, in, dt, &ls, y->dtype, 32, &err) == LOOM_OK);
    CHECK(loom_model_new_inputs(&md, &spec->model, 2, in, dt, &ls, y->dtype, 32, &err) == LOOM_OK);
    if (!mh || !md) goto out;
    loom_model_init_params(mh, 3), loom_model_init_params(md, 3);
    loom_model_set_inputs(mh, xs, 1), loom_model_set_inputs(md, xs, 1);
    rc = loom_model_dev_open(&dev, md, loom_device_cpu(), 0, &err);
    CHECK_MSG(rc == LOOM_OK, "%s: %s", err.where, err.msg);
    if (rc) goto out;
    double lh, ld;
    int64_t ch, cd, P = loom_model_num_params(mh);
    CHECK(loom_model_train_step(mh, x, y, B, 77, &lh, &ch, &err) == LOOM_OK);
    CHECK(loom_model_dev_train_step(dev, x, y, B, 77, &ld, &cd, &err) == LOOM_OK);
    double r = rel_diff(loom_model_grads(mh), loom_model_grads(md), P);
    CHECK_MSG(r <= 1e-5, "two inputs: gradients differ by %g", r);
    CHECK_NEAR(ld, lh, 1e-6 * fabs(lh));
    CHECK(cd == ch);
    /* the aux input matters: other values, other gradients on both paths alike */
    for (int64_t e = 0; e < B * 12; e++) aux[e] = -aux[e];
    CHECK(loom_model_train_step(mh, x, y, B, 77, &lh, &ch, &err) == LOOM_OK);
    CHECK(loom_model_dev_train_step(dev, x, y, B, 77, &ld, &cd, &err) == LOOM_OK);
    CHECK_NEAR(ld, lh, 1e-6 * fabs(lh));
    CHECK_MSG(rel_diff(loom_model_grads(mh), loom_model_grads(md), P) <= 1e-5, "after the aux change");
    printf("# two inputs: %lld parameters, gradients %.2g apart, loss %.9g vs %.9g\n", (long long)P, r, lh, ld);
    float ph[32 * 10], pd[32 * 10];
    CHECK(loom_model_predict(mh, x, ph, &err) == LOOM_OK);
    CHECK(loom_model_dev_predict(dev, x, pd, &err) == LOOM_OK);
    CHECK(rel_diff(ph, pd, B * 10) <= 1e-5);
out:
    loom_model_dev_close(dev);
    loom_model_free(mh);
    loom_model_free(md);
    loom_iter_close(it);
    loom_config_free(spec);
}

/* A batch over max_batch or of the wrong shape: the host path's errors. */
static void test_bad_batch(void)
{
    rig g;
    if (!rig_open_ok(&g, "strategy_mlp.cfg")) return rig_close(&g);
    static float buf[70 * 784];
    loom_tensor x = {.dtype = LOOM_F32, .shape = loom_shape_make(3, (int64_t[]){70, 28, 28}), .data = buf};
    CHECK(loom_model_dev_predict(g.dev, &x, buf, &err) == LOOM_ESHAPE);
    CHECK_CONTAINS(err.msg, "batch of 70 examples; the model takes 1 to 64");
    x.shape = loom_shape_make(3, (int64_t[]){4, 28, 27});
    CHECK(loom_model_dev_predict(g.dev, &x, buf, &err) == LOOM_ESHAPE);
    CHECK_CONTAINS(err.msg, "input batch has shape");
    rig_close(&g);
}

/* A non-finite loss fails the step as on the host: LOOM_ENUMERIC, the same message. */
static void test_non_finite(void)
{
    rig g;
    if (!rig_open_ok(&g, "strategy_mlp.cfg")) return rig_close(&g);
    loom_elem *b = next(&g);
    for (int64_t i = 0; i < loom_model_num_params(g.host); i++) /* logits overflow */
        loom_model_params(g.host)[i] = loom_model_params(g.dm)[i] *= 1e20f;
    CHECK(loom_model_dev_upload_params(g.dev, &err) == LOOM_OK);
    double lh, ld;
    int64_t c;
    CHECK(loom_model_train_step(g.host, &b->t[g.xi], &b->t[g.yi], 64, 1, &lh, &c, &err) == LOOM_ENUMERIC);
    char host[sizeof err.msg];
    snprintf(host, sizeof host, "%s", err.msg);
    CHECK(loom_model_dev_train_step(g.dev, &b->t[g.xi], &b->t[g.yi], 64, 1, &ld, &c, &err) == LOOM_ENUMERIC);
    CHECK_MSG(!strcmp(err.msg, host), "host: %s; device: %s", host, err.msg);
    CHECK_CONTAINS(err.msg, " on a batch of 64 examples");
    CHECK_CONTAINS(err.hint, "lower the learning rate");
    CHECK(!isfinite(lh) && !isfinite(ld));
    rig_close(&g);
}

static const loom_test tests[] = {
    {"step_mlp", test_step_mlp},
    {"step_cnn", test_step_cnn},
    {"step_mse", test_step_mse},
    {"step_graph", test_step_graph},
    {"keep_graph", test_keep_graph},
    {"train_graph", test_train_graph},
    {"keep_mlp", test_keep_mlp},
    {"keep_cnn", test_keep_cnn},
    {"train_mlp", test_train_mlp},
    {"train_cnn", test_train_cnn},
    {"train_mse", test_train_mse},
    {"softmax_refused", test_softmax_refused},
    {"unsupported_refused", test_unsupported_refused},
    {"graph_refused", test_graph_refused},
    {"two_inputs", test_two_inputs},
    {"bad_batch", test_bad_batch},
    {"non_finite", test_non_finite},
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
