/* test_nn_graph.c - issue 23's layers against PyTorch's forward values and
 * central differences, and graphs: gradients over merges and threads, merge
 * values, several inputs, output heads, graph errors. */
#include "nn_fixtures.h"

/* ---- issue 23's layers against PyTorch (vision_fixtures.h) ---------------------------- */

#include "vision_fixtures.h"

/* Layer l alone on a batch of 2 of per-example shape in, with parameters p
 * (Loom's flat order), its forward (predict under mean squared error) against
 * y within 1e-5 (relative beyond 1). */
static void forward_case(const char *name, loom_layer_spec l, loom_shape in, const float *x, const float *p, int64_t np,
                         const float *y, int64_t ny)
{
    static loom_model_spec ms;
    memset(&ms, 0, sizeof ms);
    ms.loss = LOOM_LOSS_MSE; /* predict gives the outputs as they are */
    ms.n_layers = 2;          /* the layer, then a flatten: the label is (ny / 2,) */
    ms.layer[0] = l;
    ms.layer[1] = L_kind(LOOM_LAYER_FLATTEN, 0, LOOM_ACT_NONE);
    loom_model *m = NULL;
    loom_shape probe = {.rank = 1, .dim = {ny / 2}};
    loom_err e = {0};
    int rc = loom_model_new(&m, &ms, &in, LOOM_F32, &probe, LOOM_F32, 2, &e);
    CHECK_MSG(rc == LOOM_OK, "%s: %s", name, e.msg);
    if (rc) return;
    CHECK_MSG(loom_model_num_params(m) == np, "%s: %lld params, fixture %lld", name,
              (long long)loom_model_num_params(m), (long long)np);
    if (np) memcpy(loom_model_params(m), p, (size_t)np * sizeof(float));
    int64_t n_out = loom_shape_numel(&probe);
    CHECK_MSG(2 * n_out == ny, "%s: output %lld per example, fixture %lld", name, (long long)n_out, (long long)ny / 2);
    loom_shape xs = {.rank = in.rank + 1};
    xs.dim[0] = 2;
    for (int i = 0; i < in.rank; i++) xs.dim[i + 1] = in.dim[i];
    loom_tensor xt = {.dtype = LOOM_F32, .shape = xs, .data = (void *)x};
    float *out = calloc((size_t)ny, sizeof(float));
    CHECK(loom_model_predict(m, &xt, out, &e) == LOOM_OK);
    double worst = 0;
    for (int64_t i = 0; i < ny && 2 * n_out == ny; i++) {
        double d = fabs((double)out[i] - y[i]) / (fabs(y[i]) > 1 ? fabs(y[i]) : 1);
        if (d > worst) worst = d;
    }
    CHECK_MSG(worst < 1e-5, "%s: max error %g against PyTorch", name, worst);
    free(out);
    loom_model_free(m);
}

static loom_layer_spec L_more(loom_layer_kind k, int filters, int ks, int stride, int dil, loom_padding p)
{
    loom_layer_spec s = {0};
    s.kind = k;
    s.filters = filters;
    s.kernel[0] = k == LOOM_LAYER_CONV1D ? 1 : ks, s.kernel[1] = ks;
    s.stride[0] = k == LOOM_LAYER_CONV1D ? 1 : stride, s.stride[1] = stride;
    s.dilation[0] = k == LOOM_LAYER_CONV1D ? 1 : dil, s.dilation[1] = dil;
    s.padding = p;
    s.use_bias = true;
    s.groups = s.depth_multiplier = 1;
    return s;
}

#define CASE(name, l, in) forward_case(#name, l, in, name##_x, name##_p, sizeof name##_p / 4, name##_y, sizeof name##_y / 4)

static void test_vision_forward(void)
{
    /* activations, as activation layers and on a dense layer with an identity kernel */
    const struct { loom_activation a; const float *y; } acts[] = {
        {LOOM_ACT_SWISH, act_swish}, {LOOM_ACT_HARD_SWISH, act_hard_swish}, {LOOM_ACT_SOFTPLUS, act_softplus},
        {LOOM_ACT_ELU, act_elu}, {LOOM_ACT_SIGMOID, act_sigmoid}, {LOOM_ACT_TANH, act_tanh}};
    float x2[30], y2[30], eye[15 * 15 + 15] = {0};
    for (int i = 0; i < 15; i++) eye[i * 15 + i] = 1.f;
    for (size_t k = 0; k < sizeof acts / sizeof acts[0]; k++) {
        for (int i = 0; i < 30; i++) x2[i] = act_x[i % 15], y2[i] = acts[k].y[i % 15];
        char nm[64];
        snprintf(nm, sizeof nm, "activation %s", loom_activation_name(acts[k].a));
        forward_case(nm, L_kind(LOOM_LAYER_ACTIVATION, 0, acts[k].a), (loom_shape){.rank = 1, .dim = {15}}, x2, NULL, 0,
                     y2, 30);
        snprintf(nm, sizeof nm, "dense + %s", loom_activation_name(acts[k].a));
        forward_case(nm, L_dense(15, acts[k].a), (loom_shape){.rank = 1, .dim = {15}}, x2, eye, 15 * 15 + 15, y2, 30);
    }
    loom_layer_spec l = L_more(LOOM_LAYER_CONV2D, 6, 3, 1, 2, LOOM_PAD_SAME);
    l.groups = 2;
    CASE(gconv, l, ((loom_shape){.rank = 3, .dim = {7, 6, 4}}));
    l = L_more(LOOM_LAYER_CONV2D, 3, 2, 1, 3, LOOM_PAD_VALID);
    l.groups = 3;
    CASE(gconv_valid, l, ((loom_shape){.rank = 3, .dim = {7, 8, 6}}));
    l = L_more(LOOM_LAYER_DEPTHWISE_CONV2D, 0, 3, 2, 1, LOOM_PAD_SAME);
    l.depth_multiplier = 2;
    CASE(dw, l, ((loom_shape){.rank = 3, .dim = {7, 6, 3}}));
    l = L_more(LOOM_LAYER_SEPARABLE_CONV2D, 4, 3, 1, 1, LOOM_PAD_VALID);
    l.depth_multiplier = 2;
    CASE(sep, l, ((loom_shape){.rank = 3, .dim = {6, 5, 3}}));
    CASE(tconv_same, L_more(LOOM_LAYER_CONV2D_TRANSPOSE, 2, 3, 2, 1, LOOM_PAD_SAME),
         ((loom_shape){.rank = 3, .dim = {4, 3, 3}}));
    CASE(tconv_valid, L_more(LOOM_LAYER_CONV2D_TRANSPOSE, 3, 2, 3, 1, LOOM_PAD_VALID),
         ((loom_shape){.rank = 3, .dim = {3, 4, 2}}));
    CASE(c1_causal, L_more(LOOM_LAYER_CONV1D, 4, 3, 1, 2, LOOM_PAD_CAUSAL), ((loom_shape){.rank = 2, .dim = {9, 3}}));
    l = L_more(LOOM_LAYER_CONV1D, 2, 3, 2, 1, LOOM_PAD_SAME);
    l.groups = 2;
    CASE(c1_same, l, ((loom_shape){.rank = 2, .dim = {9, 4}}));
    const loom_shape img = {.rank = 3, .dim = {3, 4, 2}};
    l = L_kind(LOOM_LAYER_ZERO_PADDING2D, 0, LOOM_ACT_NONE);
    l.pad[0] = 1, l.pad[1] = 2, l.pad[2] = 0, l.pad[3] = 3;
    forward_case("zero_padding2d", l, img, zp_x, NULL, 0, zp_y, sizeof zp_y / 4);
    l = L_kind(LOOM_LAYER_UPSAMPLING2D, 0, LOOM_ACT_NONE);
    l.size[0] = 2, l.size[1] = 3;
    forward_case("upsampling2d", l, img, zp_x, NULL, 0, up_y, sizeof up_y / 4);
    forward_case("global_max_pooling2d", L_kind(LOOM_LAYER_GLOBAL_MAX_POOL2D, 0, LOOM_ACT_NONE), img, zp_x, NULL, 0,
                 gmp_y, sizeof gmp_y / 4);
    l = L_kind(LOOM_LAYER_RESHAPE, 0, LOOM_ACT_NONE);
    l.n_target = 2, l.target[0] = -1, l.target[1] = 6;
    forward_case("reshape", l, img, zp_x, NULL, 0, zp_x, sizeof zp_x / 4);
}

/* A train step of every new kind allocates nothing (with 1 and 2 threads),
 * and a build that runs out of memory part-way leaves nothing behind. */
static void test_vision_no_alloc(void)
{
    static loom_model_spec ms;
    memset(&ms, 0, sizeof ms);
    ms.loss = LOOM_LOSS_SPARSE_SOFTMAX_CE;
    loom_layer_spec *L = ms.layer;
    int n = 0;
    L[n] = L_kind(LOOM_LAYER_ZERO_PADDING2D, 0, LOOM_ACT_NONE), L[n].pad[0] = L[n].pad[2] = 1, n++;
    L[n] = L_more(LOOM_LAYER_CONV2D, 4, 3, 1, 2, LOOM_PAD_SAME), L[n].groups = 2, L[n++].activation = LOOM_ACT_SWISH;
    L[n] = L_more(LOOM_LAYER_SEPARABLE_CONV2D, 4, 3, 2, 1, LOOM_PAD_SAME), L[n++].activation = LOOM_ACT_ELU;
    L[n] = L_more(LOOM_LAYER_CONV2D_TRANSPOSE, 2, 3, 2, 1, LOOM_PAD_SAME), n++;
    L[n] = L_kind(LOOM_LAYER_UPSAMPLING2D, 0, LOOM_ACT_NONE), L[n].size[0] = L[n].size[1] = 1, n++;
    L[n] = L_more(LOOM_LAYER_DEPTHWISE_CONV2D, 0, 3, 1, 1, LOOM_PAD_VALID), n++;
    L[n] = L_kind(LOOM_LAYER_RESHAPE, 0, LOOM_ACT_NONE), L[n].n_target = 2, L[n].target[0] = -1, L[n++].target[1] = 2;
    L[n++] = L_more(LOOM_LAYER_CONV1D, 3, 2, 1, 1, LOOM_PAD_CAUSAL);
    L[n] = L_kind(LOOM_LAYER_RESHAPE, 0, LOOM_ACT_NONE), L[n].n_target = 3, L[n].target[0] = 1, L[n].target[1] = -1,
    L[n++].target[2] = 3;
    L[n++] = L_kind(LOOM_LAYER_GLOBAL_MAX_POOL2D, 0, LOOM_ACT_NONE);
    L[n++] = L_dense(5, LOOM_ACT_HARD_SWISH);
    ms.n_layers = n;
    fixture f;
    int frc = fixture_new(&f, &ms, shp(3, 8, 8, 2), LOOM_U8, 4, 3);
    CHECK(frc == LOOM_OK);
    if (frc) return;
    for (int t = 1; t <= 2; t++) {
        CHECK(loom_model_set_threads(f.m, t, &err) == LOOM_OK);
        loom_alloc_fail_after(0);
        double loss;
        int64_t c;
        CHECK_MSG(loom_model_train_step(f.m, &f.x, &f.y, 4, 1, &loss, &c, &err) == LOOM_OK, "%s", err.msg);
        void *p = loom_alloc(8); /* the armed failure is still pending */
        CHECK(p == NULL);
        loom_free(p);
        loom_alloc_fail_after(-1);
    }
    fixture_free(&f);
    loom_shape in = shp(3, 8, 8, 2), lab = shp(0, 0, 0, 0);
    for (long k = 0; k < 40; k++) {
        loom_model *m = NULL;
        loom_alloc_fail_after(k);
        int rc = loom_model_new(&m, &ms, &in, LOOM_F32, &lab, LOOM_U8, 4, &err);
        loom_alloc_fail_after(-1);
        CHECK(rc == LOOM_OK || rc == LOOM_ENOMEM);
        CHECK((rc == LOOM_OK) == (m != NULL));
        loom_model_free(m);
    }
}

/* ---- graphs (graph.c) ---------------------------------------------------- */

/* Layer s named `name`, taking the layers (or model inputs) listed, NULL-terminated. */
static loom_layer_spec G(loom_layer_spec s, const char *name, ...)
{
    snprintf(s.name, sizeof s.name, "%s", name);
    va_list ap;
    va_start(ap, name);
    for (const char *in; (in = va_arg(ap, const char *));)
        snprintf(s.inputs[s.n_inputs++], sizeof s.inputs[0], "%s", in);
    va_end(ap);
    return s;
}

static loom_layer_spec L_bn(void)
{
    loom_layer_spec s = L_kind(LOOM_LAYER_BATCH_NORM, 0, 0);
    s.momentum = 0.9;
    s.epsilon = 1e-3;
    return s;
}

static loom_layer_spec L_merge(loom_layer_kind k)
{
    loom_layer_spec s = L_kind(k, 0, 0);
    s.axis = -1;
    return s;
}

/* A residual block (conv-bn-act-conv-bn + a 1x1 strided conv shortcut, add,
 * act), then a second block with the identity shortcut feeding two
 * layers; global average pooling, dense. (The gradient check takes tanh:
 * central differences of a net of ReLUs cross too many kinks.) */
static int residual_net(loom_layer_spec *r, loom_activation act, bool bn)
{
    int n = 0;
    r[n++] = G(L_conv(4, 3, 1, LOOM_PAD_SAME, act), "stem", NULL);
    r[n++] = G(L_conv(6, 3, 2, LOOM_PAD_SAME, LOOM_ACT_NONE), "c1", NULL);
    if (bn) r[n++] = G(L_bn(), "bn1", NULL);
    r[n++] = G(L_kind(LOOM_LAYER_ACTIVATION, 0, act), "r1", NULL);
    r[n++] = G(L_conv(6, 3, 1, LOOM_PAD_SAME, LOOM_ACT_NONE), "c2", NULL);
    if (bn) r[n++] = G(L_bn(), "bn2", NULL);
    r[n++] = G(L_conv(6, 1, 2, LOOM_PAD_VALID, LOOM_ACT_NONE), "short", "stem", NULL);
    r[n++] = G(L_merge(LOOM_LAYER_ADD), "add1", bn ? "bn2" : "c2", "short", NULL);
    r[n++] = G(L_kind(LOOM_LAYER_ACTIVATION, 0, act), "out1", NULL);
    r[n++] = G(L_conv(6, 3, 1, LOOM_PAD_SAME, LOOM_ACT_TANH), "c3", NULL);
    r[n++] = G(L_merge(LOOM_LAYER_ADD), "add2", "c3", "out1", NULL);
    r[n++] = G(L_kind(LOOM_LAYER_GLOBAL_AVG_POOL2D, 0, 0), "gap", NULL);
    r[n++] = G(L_dense(5, LOOM_ACT_NONE), "logits", NULL);
    return n;
}

/* A residual block on the Winograd convolutions (16 channels on 8x8 planes): a and c, which read the stem's
 * output with the add, write their input gradient straight into its gathered rows (graph.c dx_into): c first
 * (written), a last (added to the add's and c's). */
static int wino_net(loom_layer_spec *r, bool bn)
{
    int n = 0;
    r[n++] = G(L_conv(16, 3, 1, LOOM_PAD_SAME, LOOM_ACT_TANH), "stem", NULL);
    r[n++] = G(L_conv(16, 3, 1, LOOM_PAD_SAME, LOOM_ACT_NONE), "a", NULL);
    if (bn) r[n++] = G(L_bn(), "bn_a", NULL);
    r[n++] = G(L_kind(LOOM_LAYER_ACTIVATION, 0, LOOM_ACT_TANH), "t", NULL);
    r[n++] = G(L_conv(16, 3, 1, LOOM_PAD_SAME, LOOM_ACT_NONE), "b", NULL);
    if (bn) r[n++] = G(L_bn(), "bn_b", NULL);
    r[n++] = G(L_merge(LOOM_LAYER_ADD), "add", bn ? "bn_b" : "b", "stem", NULL);
    r[n++] = G(L_conv(16, 3, 1, LOOM_PAD_SAME, LOOM_ACT_NONE), "c", "stem", NULL);
    r[n++] = G(L_merge(LOOM_LAYER_ADD), "add2", "add", "c", NULL);
    r[n++] = G(L_kind(LOOM_LAYER_GLOBAL_AVG_POOL2D, 0, 0), "gap", NULL);
    r[n++] = G(L_dense(5, LOOM_ACT_NONE), "logits", NULL);
    return n;
}

/* Every merge kind, broadcasting and fan-out on dense branches. */
static int merge_net(loom_layer_spec *r)
{
    int n = 0;
    r[n++] = G(L_dense(6, LOOM_ACT_TANH), "d0", NULL);
    r[n++] = G(L_dense(6, LOOM_ACT_SIGMOID), "d1", "d0", NULL);
    r[n++] = G(L_dense(6, LOOM_ACT_NONE), "d2", "d0", NULL);
    r[n++] = G(L_dense(1, LOOM_ACT_NONE), "one", "d0", NULL);
    r[n++] = G(L_merge(LOOM_LAYER_SUBTRACT), "sub", "d1", "d2", NULL);
    r[n++] = G(L_merge(LOOM_LAYER_MULTIPLY), "mul", "d0", "d1", "one", NULL); /* (6,) (6,) (1,) */
    r[n++] = G(L_merge(LOOM_LAYER_AVERAGE), "avg", "sub", "mul", "d2", NULL);
    r[n++] = G(L_merge(LOOM_LAYER_MAXIMUM), "mx", "avg", "d1", NULL);
    r[n++] = G(L_merge(LOOM_LAYER_ADD), "bc", "mx", "one", NULL);            /* (6,) + (1,) */
    r[n++] = G(L_merge(LOOM_LAYER_CONCATENATE), "cat", "bc", "d0", "sub", NULL);
    r[n++] = G(L_dense(4, LOOM_ACT_NONE), "logits", "cat", NULL);
    return n;
}

/* A graph's gradients (fan-out summed, merges' backward, batch
 * normalization between segments) against central differences. */
static void test_graph_grad(void)
{
    loom_layer_spec r[32];
    int n = residual_net(r, LOOM_ACT_TANH, true);
    gradcheck("residual graph (conv, bn, add, 1x1 shortcut)", r, n, LOOM_LOSS_SPARSE_SOFTMAX_CE, shp(3, 8, 8, 2),
              LOOM_I32, 4, 3);
    n = merge_net(r);
    gradcheck("merge layers (subtract, multiply, average, maximum, add, concatenate)", r, n, LOOM_LOSS_MSE,
              shp(1, 5, 0, 0), LOOM_F32, 3, 3);
    n = wino_net(r, true);
    gradcheck("residual graph on Winograd convolutions (input gradients into the gathered rows)", r, n,
              LOOM_LOSS_SPARSE_SOFTMAX_CE, shp(3, 8, 8, 1), LOOM_I32, 4, 3);
    {
        fixture f;
        if (fixture_new(&f, mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, n, r), shp(3, 8, 8, 1), LOOM_I32, 4, 5) == LOOM_OK) {
            bool wino = nn_convw_ok_(&f.m->layer[1]) && nn_convw_ok_(&f.m->layer[7]);
            CHECK_MSG(loom_cpu()->level < LOOM_CPU_AVX2_FMA || wino, "wino_net: a and c are not on the Winograd path");
            fixture_free(&f);
        } else {
            CHECK(0);
        }
    }
    /* intra-op threads: the same as one thread, and the same bits run to run (without batch
     * normalization, whose moving statistics each train step of the check moves) */
    n = residual_net(r, LOOM_ACT_RELU, false);
    check_threads("residual graph", r, n, LOOM_LOSS_SPARSE_SOFTMAX_CE, shp(3, 8, 8, 2), 7);
    n = merge_net(r);
    check_threads("merge graph", r, n, LOOM_LOSS_MSE, shp(1, 5, 0, 0), 7);
    n = wino_net(r, false);
    check_threads("residual graph on Winograd convolutions", r, n, LOOM_LOSS_SPARSE_SOFTMAX_CE, shp(3, 8, 8, 1), 7);
    /* with batch normalization between segments: the gradients of 1, 2 and 3 threads, fresh models */
    n = residual_net(r, LOOM_ACT_RELU, true);
    float *g1 = NULL;
    for (int t = 1; t <= 3; t++) {
        fixture f;
        if (fixture_new(&f, mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, n, r), shp(3, 8, 8, 2), LOOM_I32, 7, 5) != LOOM_OK) {
            CHECK(0);
            break;
        }
        int64_t P = loom_model_num_params(f.m);
        CHECK(loom_model_set_threads(f.m, t, &err) == LOOM_OK);
        step_loss(&f, 9);
        if (t == 1) {
            g1 = malloc((size_t)P * sizeof *g1);
            memcpy(g1, loom_model_grads(f.m), (size_t)P * sizeof *g1);
        } else {
            CHECK_MSG(close_vec("grads", g1, loom_model_grads(f.m), P), "residual graph + bn, threads %d", t);
        }
        fixture_free(&f);
    }
    free(g1);
    /* the relu over bn1 runs in its passes (bn_relu, relu_in_bn), and bn1 and bn2 write their input gradient
     * into c1's and c2's dz rows (bn_dx_dz): a model with the flags cleared (the passes apart, the gradient
     * through the chunks' rows and copied) gives the same loss and gradient bits, at 1 and 2 threads */
    for (int t = 1; t <= 2; t++) {
        fixture f[2];
        if (fixture_new(&f[0], mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, n, r), shp(3, 8, 8, 2), LOOM_I32, 7, 5) != LOOM_OK ||
            fixture_new(&f[1], mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, n, r), shp(3, 8, 8, 2), LOOM_I32, 7, 5) != LOOM_OK) {
            CHECK(0);
            break;
        }
        int fused = 0, into = 0, links = 0;
        for (int i = 0; i < f[1].m->n_layers; i++) {
            fused += f[0].m->layer[i].bn_relu;
            into += f[0].m->layer[i].bn_dx_dz;
            /* the add's input just below it takes the add's gradient in place, no rows of its own */
            links += i + 1 < f[0].m->n_layers && f[0].m->layer[i + 1].spec.kind == LOOM_LAYER_ADD &&
                     !f[0].m->layer[i].gacc && f[0].m->layer[i].n_cons == 1;
            f[1].m->layer[i].bn_relu = f[1].m->layer[i].relu_in_bn = f[1].m->layer[i].bn_dx_dz = 0;
        }
        CHECK_MSG(fused == 1, "residual graph + bn: %d batch normalizations take their relu, want 1 (bn1)", fused);
        CHECK_MSG(into == 2, "residual graph + bn: %d batch normalizations write a conv's dz, want 2 (bn1, bn2)", into);
        CHECK_MSG(links == 2, "residual graph + bn: %d adds hand their gradient down the chain, want 2 (short, c3)",
                  links);
        double l[2];
        for (int k = 0; k < 2; k++) {
            CHECK(loom_model_set_threads(f[k].m, t, &err) == LOOM_OK);
            l[k] = step_loss(&f[k], 9);
        }
        int64_t P = loom_model_num_params(f[0].m);
        bool same = !memcmp(loom_model_grads(f[0].m), loom_model_grads(f[1].m), (size_t)P * sizeof(float));
        CHECK_MSG(l[0] == l[1] && same, "threads %d: bn + relu fused: loss %.9g, apart %.9g, gradients %s", t, l[0],
                  l[1], same ? "equal" : "differ");
        fixture_free(&f[0]);
        fixture_free(&f[1]);
    }
    loom_blas_set_threads(1);
}

/* The merges' forward values on the model input itself (predict under MSE
 * returns the outputs): x in, [max(x * x, x), (2x + x) / 2] out. */
static void test_graph_merge_values(void)
{
    loom_layer_spec r[8];
    int n = 0;
    r[n++] = G(L_merge(LOOM_LAYER_ADD), "dbl", "image", "image", NULL);
    r[n++] = G(L_merge(LOOM_LAYER_SUBTRACT), "sub", "dbl", "image", NULL);
    r[n++] = G(L_merge(LOOM_LAYER_MULTIPLY), "sq", "sub", "image", NULL);
    r[n++] = G(L_merge(LOOM_LAYER_MAXIMUM), "mx", "sq", "image", NULL);
    r[n++] = G(L_merge(LOOM_LAYER_AVERAGE), "avg", "dbl", "image", NULL);
    r[n++] = G(L_merge(LOOM_LAYER_CONCATENATE), "cat", "mx", "avg", NULL);
    loom_shape in = shp(2, 2, 3, 0), lab = shp(2, 2, 6, 0);
    loom_model *m = NULL;
    int rc = loom_model_new(&m, mk(LOOM_LOSS_MSE, n, r), &in, LOOM_F32, &lab, LOOM_F32, 4, &err);
    CHECK_MSG(rc == LOOM_OK, "%s: %s", err.where, err.msg);
    if (rc) return;
    CHECK(loom_model_num_params(m) == 0);
    loom_shape out = loom_model_output_shape(m);
    CHECK(out.rank == 2 && out.dim[0] == 2 && out.dim[1] == 6);
    float x[3 * 6], y[3 * 12];
    for (int e = 0; e < 18; e++) x[e] = (float)(e - 7) * 0.25f;
    loom_shape xs = shp(3, 3, 2, 3);
    loom_tensor t = {.dtype = LOOM_F32, .shape = xs, .data = x};
    CHECK(loom_model_predict(m, &t, y, &err) == LOOM_OK);
    int bad = 0;
    for (int b = 0; b < 3; b++)
        for (int h = 0; h < 2; h++)
            for (int c = 0; c < 6; c++) {
                float v = x[b * 6 + h * 3 + c % 3];
                float want = c < 3 ? fmaxf(v * v, v) : (2 * v + v) * 0.5f;
                bad += y[b * 12 + h * 6 + c] != want;
            }
    CHECK_MSG(bad == 0, "%d merge outputs differ", bad);
    loom_model_free(m);
    /* the graph runs in a topological order: layers listed before their inputs work the same */
    loom_layer_spec back[] = {G(L_dense(3, LOOM_ACT_NONE), "late", "early", NULL), G(L_dense(4, LOOM_ACT_RELU), "early", "image", NULL),
                              G(L_merge(LOOM_LAYER_CONCATENATE), "out", "late", "early", NULL)};
    in = shp(1, 5, 0, 0), lab = shp(1, 7, 0, 0);
    rc = loom_model_new(&m, mk(LOOM_LOSS_MSE, 3, back), &in, LOOM_F32, &lab, LOOM_F32, 2, &err);
    CHECK_MSG(rc == LOOM_OK, "%s: %s", err.where, err.msg);
    if (!rc) {
        CHECK(loom_model_output_shape(m).dim[0] == 7);
        CHECK(!strcmp(loom_model_param_tensor(m, 0)->name, "early/kernel")); /* parameters in the run's order */
        loom_model_free(m);
    }
}

/* loom_model_gradcheck passes every new kind and fails a wrong backward. */
static void test_vision_gradcheck(void)
{
    static loom_model_spec ms;
    memset(&ms, 0, sizeof ms);
    ms.loss = LOOM_LOSS_MSE;
    loom_layer_spec *L = ms.layer;
    int n = 0;
    L[n] = L_kind(LOOM_LAYER_ZERO_PADDING2D, 0, LOOM_ACT_NONE);
    L[n].pad[0] = 1, L[n].pad[3] = 2, n++;
    L[n] = L_more(LOOM_LAYER_CONV2D, 4, 3, 1, 2, LOOM_PAD_SAME), L[n].groups = 2, L[n++].activation = LOOM_ACT_ELU;
    L[n] = L_more(LOOM_LAYER_DEPTHWISE_CONV2D, 0, 3, 2, 1, LOOM_PAD_SAME), L[n++].activation = LOOM_ACT_SWISH;
    L[n] = L_more(LOOM_LAYER_SEPARABLE_CONV2D, 3, 2, 1, 1, LOOM_PAD_VALID), L[n++].activation = LOOM_ACT_HARD_SWISH;
    L[n] = L_more(LOOM_LAYER_CONV2D_TRANSPOSE, 2, 3, 2, 1, LOOM_PAD_VALID), L[n++].activation = LOOM_ACT_SOFTPLUS;
    L[n] = L_kind(LOOM_LAYER_UPSAMPLING2D, 0, LOOM_ACT_NONE), L[n].size[0] = 2, L[n++].size[1] = 1;
    L[n] = L_kind(LOOM_LAYER_RESHAPE, 0, LOOM_ACT_NONE), L[n].n_target = 2, L[n].target[0] = -1, L[n++].target[1] = 4;
    L[n++] = L_more(LOOM_LAYER_CONV1D, 3, 3, 1, 2, LOOM_PAD_CAUSAL);
    L[n] = L_kind(LOOM_LAYER_RESHAPE, 0, LOOM_ACT_NONE), L[n].n_target = 3, L[n].target[0] = 7, L[n].target[1] = -1,
    L[n++].target[2] = 3;
    L[n++] = L_kind(LOOM_LAYER_GLOBAL_MAX_POOL2D, 0, LOOM_ACT_NONE);
    ms.n_layers = n;
    loom_shape in = {.rank = 3, .dim = {6, 5, 2}}, lab = {.rank = 1, .dim = {3}};
    loom_model *m;
    loom_err e = {0};
    CHECK_MSG(loom_model_new(&m, &ms, &in, LOOM_F32, &lab, LOOM_F32, 4, &e) == LOOM_OK, "%s", e.msg);
    if (!m) return;
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    int failed = -1;
    CHECK(loom_model_gradcheck(m, f, &failed, &e) == LOOM_OK);
    fclose(f);
    CHECK_MSG(failed == 0, "%d layers fail:\n%s", failed, buf);
    CHECK_CONTAINS(buf, "every layer passes");
    free(buf);
    /* a backward 10% off: every layer with a gradient fails, the table says so */
    nn_gradcheck_skew_ = 0.1f;
    f = open_memstream(&buf, &len);
    CHECK(loom_model_gradcheck(m, f, &failed, &e) == LOOM_OK);
    fclose(f);
    nn_gradcheck_skew_ = 0.f;
    CHECK_MSG(failed == ms.n_layers, "%d of %d layers fail:\n%s", failed, ms.n_layers, buf);
    CHECK_CONTAINS(buf, "FAIL (");
    CHECK_CONTAINS(buf, "gradcheck: FAILED");
    free(buf);
    loom_model_free(m);
}

/* Two model inputs (model.inputs) concatenated, then dense layers: the
 * same loss and gradients, bit for bit, as one input holding both
 * (the parameters start equal: the same tensors in the same order), at 1
 * and 2 threads; a step without the second input, and loom_model_new on a
 * spec with two inputs, are refused. */
static void test_graph_inputs(void)
{
    loom_layer_spec two[] = {G(L_merge(LOOM_LAYER_CONCATENATE), "cat", "a", "b", NULL),
                             G(L_dense(4, LOOM_ACT_TANH), "h", NULL), G(L_dense(3, LOOM_ACT_NONE), "o", NULL)};
    loom_model_spec *s2 = malloc(sizeof *s2);
    *s2 = *mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 3, two);
    s2->n_inputs = 2;
    snprintf(s2->inputs[0], sizeof s2->inputs[0], "a");
    snprintf(s2->inputs[1], sizeof s2->inputs[1], "b");
    snprintf(s2->input, sizeof s2->input, "a");
    loom_shape shapes[2] = {shp(1, 3, 0, 0), shp(1, 2, 0, 0)}, lab = shp(0, 0, 0, 0), one = shp(1, 5, 0, 0);
    loom_dtype dts[2] = {LOOM_F32, LOOM_F32};
    loom_model *m2 = NULL, *m1 = NULL;
    CHECK(loom_model_new(&m2, s2, &shapes[0], LOOM_F32, &lab, LOOM_I32, 6, &err) == LOOM_EUNSUPPORTED);
    CHECK_CONTAINS(err.msg, "model.inputs names 2 features; here the model is given 1");
    int rc = loom_model_new_inputs(&m2, s2, 2, shapes, dts, &lab, LOOM_I32, 6, &err);
    CHECK_MSG(rc == LOOM_OK, "%s: %s", err.where, err.msg);
    loom_layer_spec flat[] = {G(L_dense(4, LOOM_ACT_TANH), "h", NULL), G(L_dense(3, LOOM_ACT_NONE), "o", NULL)};
    CHECK(loom_model_new(&m1, mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 2, flat), &one, LOOM_F32, &lab, LOOM_I32, 6, &err) ==
          LOOM_OK);
    if (rc || !m1) goto out;
    CHECK(loom_model_num_inputs(m2) == 2 && loom_model_num_params(m1) == loom_model_num_params(m2));
    loom_model_init_params(m1, 3);
    loom_model_init_params(m2, 3);
    float x[6 * 5], a[6 * 3], b[6 * 2];
    int32_t y[6];
    loom_rng r;
    loom_rng_init(&r, 1, 2, 3, 4);
    for (int e = 0; e < 6; e++) {
        for (int k = 0; k < 5; k++) x[e * 5 + k] = loom_rng_normal(&r);
        memcpy(a + e * 3, x + e * 5, 3 * sizeof(float));
        memcpy(b + e * 2, x + e * 5 + 3, 2 * sizeof(float));
        y[e] = (int32_t)loom_rng_below(&r, 3);
    }
    loom_tensor tx = {.dtype = LOOM_F32, .shape = shp(2, 6, 5, 0), .data = x};
    loom_tensor ta = {.dtype = LOOM_F32, .shape = shp(2, 6, 3, 0), .data = a};
    loom_tensor tb = {.dtype = LOOM_F32, .shape = shp(2, 6, 2, 0), .data = b};
    loom_tensor ty = {.dtype = LOOM_I32, .shape = shp(1, 6, 0, 0), .data = y};
    double l1, l2;
    int64_t c1, c2;
    CHECK(loom_model_train_step(m2, &ta, &ty, 6, 1, &l2, &c2, &err) == LOOM_ESHAPE);
    CHECK_CONTAINS(err.msg, "model input \"b\" was not given with the batch");
    const loom_tensor *more[] = {&tb};
    loom_model_set_inputs(m2, more, 1);
    for (int t = 1; t <= 2; t++) {
        CHECK(loom_model_set_threads(m1, t, &err) == LOOM_OK && loom_model_set_threads(m2, t, &err) == LOOM_OK);
        CHECK(loom_model_train_step(m1, &tx, &ty, 6, 1, &l1, &c1, &err) == LOOM_OK);
        CHECK(loom_model_train_step(m2, &ta, &ty, 6, 1, &l2, &c2, &err) == LOOM_OK);
        CHECK_MSG(l1 == l2 && c1 == c2, "threads %d: loss %.9g vs %.9g", t, l1, l2);
        CHECK_MSG(!memcmp(loom_model_grads(m1), loom_model_grads(m2),
                          (size_t)loom_model_num_params(m1) * sizeof(float)), "threads %d: gradients differ", t);
    }
    float p1[6 * 3], p2[6 * 3];
    CHECK(loom_model_predict(m1, &tx, p1, &err) == LOOM_OK && loom_model_predict(m2, &ta, p2, &err) == LOOM_OK);
    CHECK(!memcmp(p1, p2, sizeof p1));
    loom_tensor bad = tb;
    bad.shape = shp(2, 3, 4, 0);
    const loom_tensor *wrong[] = {&bad};
    loom_model_set_inputs(m2, wrong, 1);
    CHECK(loom_model_predict(m2, &ta, p2, &err) == LOOM_ESHAPE);
    CHECK_CONTAINS(err.msg, "model input \"b\" has shape (3, 4) (float32), the model was built for (6, 2) float32");
out:
    loom_model_free(m1);
    loom_model_free(m2);
    free(s2);
    loom_blas_set_threads(1);
}

/* ---- output heads (model.outputs) ------------------------------------------ */

/* d0 feeds two branches: head 0 "logits" (4 classes, sparse softmax CE,
 * weight w0) through t, and head 1 "aux" (3 binary outputs, BCE, weight w1)
 * straight from d0, which t also reads: the head's gradient and t's add up. */
static loom_model_spec *heads_spec(float w0, float w1, loom_loss_kind l1)
{
    static loom_model_spec s;
    loom_layer_spec ls[] = {G(L_dense(6, LOOM_ACT_TANH), "d0", NULL), G(L_dense(3, LOOM_ACT_NONE), "aux", "d0", NULL),
                            G(L_dense(5, LOOM_ACT_TANH), "t", "d0", NULL), G(L_dense(4, LOOM_ACT_NONE), "logits", "t", NULL)};
    s = *mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 4, ls);
    s.n_heads = 2;
    snprintf(s.head[0].layer, sizeof s.head[0].layer, "logits");
    s.head[0].loss = LOOM_LOSS_SPARSE_SOFTMAX_CE;
    s.head[0].weight = w0;
    snprintf(s.head[1].layer, sizeof s.head[1].layer, "aux");
    s.head[1].loss = l1;
    s.head[1].weight = w1;
    snprintf(s.head[1].loc.file, sizeof s.head[1].loc.file, "test.cfg");
    s.head[1].loc.line = 30;
    return &s;
}

typedef struct heads_ctx {
    loom_model *m;
    loom_tensor *x, *y;
    int64_t B;
} heads_ctx;

static double heads_loss(void *ctx)
{
    heads_ctx *h = ctx;
    double l = 0;
    int64_t c;
    LOOM_ASSERT(loom_model_train_step(h->m, h->x, h->y, h->B, 1, &l, &c, &err) == LOOM_OK);
    return l;
}

static void test_graph_heads(void)
{
    const int64_t B = 5;
    loom_shape in = shp(1, 5, 0, 0), lab = shp(0, 0, 0, 0);
    float x[5 * 5], t1[5 * 3];
    int32_t y[5];
    loom_rng r;
    loom_rng_init(&r, 7, 1, 2, 3);
    for (int e = 0; e < 25; e++) x[e] = loom_rng_normal(&r);
    for (int e = 0; e < 15; e++) t1[e] = (float)loom_rng_below(&r, 2);
    for (int e = 0; e < 5; e++) y[e] = (int32_t)loom_rng_below(&r, 4);
    loom_tensor tx = {.dtype = LOOM_F32, .shape = shp(2, B, 5, 0), .data = x};
    loom_tensor ty = {.dtype = LOOM_I32, .shape = shp(1, B, 0, 0), .data = y};
    loom_tensor tt = {.dtype = LOOM_F32, .shape = shp(2, B, 3, 0), .data = t1};
    const loom_tensor *more[] = {&tt};
    loom_model *m = NULL, *m1 = NULL;
    int rc = loom_model_new(&m, heads_spec(2.f, 0.5f, LOOM_LOSS_BCE), &in, LOOM_F32, &lab, LOOM_I32, B, &err);
    CHECK_MSG(rc == LOOM_OK, "%s: %s", err.where, err.msg);
    if (rc) return;
    CHECK(loom_model_num_heads(m) == 2 && !strcmp(loom_model_head_name(m, 1), "aux"));
    loom_model_init_params(m, 3);
    double l, l0, l1;
    int64_t c, c0, c1;
    CHECK(loom_model_train_step(m, &tx, &ty, B, 1, &l, &c, &err) == LOOM_ESHAPE);
    CHECK_CONTAINS(err.msg, "head \"aux\" has no labels for this step");
    loom_model_set_head_labels(m, more, 1);
    CHECK(loom_model_train_step(m, &tx, &ty, B, 1, &l, &c, &err) == LOOM_OK);
    loom_model_head_results(m, 0, &l0, &c0);
    loom_model_head_results(m, 1, &l1, &c1);
    /* the total is the weighted sum; head 0's is the loss of the same model without head 1 */
    CHECK_MSG(fabs(l - (2 * l0 + 0.5 * l1)) < 1e-9 * fabs(l), "loss %.9g vs 2 * %.9g + 0.5 * %.9g", l, l0, l1);
    CHECK(c == c0 && c1 >= 0 && c1 <= B);
    double bce = 0;
    {   /* head 1's loss by hand: the mean over 3 outputs of BCE on logits, summed over the batch */
        float p[5 * 3];
        loom_layer_spec one[] = {G(L_dense(6, LOOM_ACT_TANH), "d0", NULL), G(L_dense(3, LOOM_ACT_NONE), "aux", NULL)};
        loom_shape l3 = shp(1, 3, 0, 0);
        CHECK(loom_model_new(&m1, mk(LOOM_LOSS_MSE, 2, one), &in, LOOM_F32, &l3, LOOM_F32, B, &err) == LOOM_OK);
        /* the same d0 and aux parameters: d0 first, aux second in both (order: d0, aux, t, logits) */
        memcpy(loom_model_params(m1), loom_model_params(m), (size_t)loom_model_num_params(m1) * sizeof(float));
        CHECK(loom_model_predict(m1, &tx, p, &err) == LOOM_OK);
        for (int e = 0; e < 15; e++) {
            double z = p[e], t = t1[e];
            bce += ((z > 0 ? z : 0) - z * t + log1p(exp(-fabs(z)))) / 3;
        }
        CHECK_MSG(fabs(bce - l1) < 1e-5 * (1 + bce), "head 1 loss %.9g, by hand %.9g", l1, bce);
        loom_model_free(m1);
    }
    /* the gradient of the weighted total against central differences */
    int64_t P = loom_model_num_params(m);
    float *ga = malloc((size_t)P * sizeof *ga), *g1 = malloc((size_t)P * sizeof *g1);
    CHECK(loom_model_train_step(m, &tx, &ty, B, 1, &l, &c, &err) == LOOM_OK);
    memcpy(ga, loom_model_grads(m), (size_t)P * sizeof *ga);
    heads_ctx hc = {m, &tx, &ty, B};
    harness_gradcheck g = harness_gradcheck_run("two heads", loom_model_params(m), ga, P, 1, 1e-2f, (double)B,
                                                heads_loss, &hc, NULL, 1);
    CHECK_MSG(g.bad == 0 && g.tested >= P - 5, "two heads: %lld of %lld gradients off", g.bad, g.tested);
    /* intra-op threads: the same bits */
    for (int t = 1; t <= 3; t++) {
        CHECK(loom_model_set_threads(m, t, &err) == LOOM_OK);
        double lt;
        CHECK(loom_model_train_step(m, &tx, &ty, B, 1, &lt, &c, &err) == LOOM_OK);
        if (t == 1) memcpy(g1, loom_model_grads(m), (size_t)P * sizeof *g1), l = lt;
        CHECK_MSG(lt == l && !memcmp(g1, loom_model_grads(m), (size_t)P * sizeof *g1), "two heads, threads %d", t);
        double le;
        CHECK(loom_model_evaluate(m, &tx, &ty, &le, &c, &err) == LOOM_OK);
        CHECK_MSG(le == l, "evaluate %.9g vs train %.9g", le, l);
    }
    /* bad labels of a head */
    t1[4] = 2;
    CHECK(loom_model_train_step(m, &tx, &ty, B, 1, &l, &c, &err) == LOOM_EDATA);
    CHECK_CONTAINS(err.msg, "head \"aux\": example 1's label is 2");
    t1[4] = 1;
    free(ga);
    free(g1);
    loom_model_free(m);
    /* errors at the head's file:line: an unknown layer, the same layer twice, head 0 not last */
    loom_model_spec *s = heads_spec(1, 1, LOOM_LOSS_MSE);
    snprintf(s->head[1].layer, sizeof s->head[1].layer, "nope");
    CHECK(loom_model_new(&m, s, &in, LOOM_F32, &lab, LOOM_I32, B, &err) == LOOM_ECONFIG);
    CHECK_CONTAINS(err.where, "test.cfg:30");
    CHECK_CONTAINS(err.msg, "head 1's layer \"nope\" is not a layer");
    snprintf(s->head[1].layer, sizeof s->head[1].layer, "logits");
    CHECK(loom_model_new(&m, s, &in, LOOM_F32, &lab, LOOM_I32, B, &err) == LOOM_ECONFIG);
    CHECK_CONTAINS(err.msg, "layer \"logits\" is head 0 and head 1");
    s = heads_spec(1, 1, LOOM_LOSS_MSE);
    snprintf(s->head[0].layer, sizeof s->head[0].layer, "aux");
    snprintf(s->head[1].layer, sizeof s->head[1].layer, "logits");
    CHECK(loom_model_new(&m, s, &in, LOOM_F32, &lab, LOOM_I32, B, &err) == LOOM_ECONFIG);
    CHECK_CONTAINS(err.msg, "head 0's layer \"aux\" is not the last layer (\"logits\")");
    loom_blas_set_threads(1);
}

/* Shapes that do not merge, a cycle, an unknown input: LOOM_ESHAPE /
 * LOOM_ECONFIG at the layer's file:line naming what is wrong. */
static void test_graph_errors(void)
{
    loom_shape in = shp(1, 5, 0, 0), lab = shp(0, 0, 0, 0);
    loom_model *m = NULL;
    loom_layer_spec a[] = {G(L_dense(4, LOOM_ACT_NONE), "a", NULL), G(L_dense(3, LOOM_ACT_NONE), "b", "image", NULL),
                           G(L_merge(LOOM_LAYER_ADD), "s", "a", "b", NULL), G(L_dense(2, LOOM_ACT_NONE), "o", NULL)};
    CHECK(loom_model_new(&m, mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 4, a), &in, LOOM_F32, &lab, LOOM_I32, 2, &err) ==
          LOOM_ESHAPE);
    CHECK_CONTAINS(err.where, "test.cfg:12");
    CHECK_CONTAINS(err.msg, "shapes (4,) and (3,) (input \"b\") do not merge");
    a[2] = G(L_merge(LOOM_LAYER_CONCATENATE), "s", "a", "b", NULL);
    a[2].axis = 0;
    CHECK(loom_model_new(&m, mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 4, a), &in, LOOM_F32, &lab, LOOM_I32, 2, &err) ==
          LOOM_ESHAPE);
    CHECK_CONTAINS(err.msg, "axis 0 is not an axis");
    loom_shape in3 = shp(3, 4, 4, 2);
    loom_layer_spec c[] = {G(L_conv(3, 3, 1, LOOM_PAD_SAME, LOOM_ACT_NONE), "a", NULL),
                           G(L_conv(3, 3, 2, LOOM_PAD_SAME, LOOM_ACT_NONE), "b", "image", NULL),
                           G(L_merge(LOOM_LAYER_CONCATENATE), "s", "a", "b", NULL),
                           G(L_kind(LOOM_LAYER_FLATTEN, 0, 0), "f", NULL), G(L_dense(2, LOOM_ACT_NONE), "o", NULL)};
    CHECK(loom_model_new(&m, mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 5, c), &in3, LOOM_F32, &lab, LOOM_I32, 2, &err) ==
          LOOM_ESHAPE);
    CHECK_CONTAINS(err.msg, "inputs \"a\" (4, 4, 3) and \"b\" (2, 2, 3) differ outside axis -1");
    loom_layer_spec cy[] = {G(L_dense(4, LOOM_ACT_NONE), "a", "b", NULL), G(L_dense(4, LOOM_ACT_NONE), "b", "a", NULL),
                            G(L_dense(2, LOOM_ACT_NONE), "o", "b", NULL)};
    CHECK(loom_model_new(&m, mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 3, cy), &in, LOOM_F32, &lab, LOOM_I32, 2, &err) ==
          LOOM_ECONFIG);
    CHECK_CONTAINS(err.msg, "is on a cycle of layers");
    cy[0] = G(L_dense(4, LOOM_ACT_NONE), "a", "nowhere", NULL);
    CHECK(loom_model_new(&m, mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 3, cy), &in, LOOM_F32, &lab, LOOM_I32, 2, &err) ==
          LOOM_ECONFIG);
    CHECK_CONTAINS(err.msg, "input \"nowhere\" is neither a layer nor a model input");
}


static const loom_test tests[] = {
    {"issue 23 layers and activations: forward = PyTorch", test_vision_forward},
    {"issue 23 layers: loom_model_gradcheck passes each", test_vision_gradcheck},
    {"issue 23 layers: no allocation in a step", test_vision_no_alloc},
    {"graph: gradients, threads", test_graph_grad},
    {"graph: merge values, order", test_graph_merge_values},
    {"graph: output heads (weighted loss, gradient, threads, errors)", test_graph_heads},
    {"graph: shape and graph errors", test_graph_errors},
    {"graph: several model inputs", test_graph_inputs},
    {0},
};

int main(void) { return nn_test_main(tests); }
