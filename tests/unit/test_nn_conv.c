/* test_nn_conv.c - the convolution kernels: conv + pool fused, the direct,
 * Winograd and narrow-input kernels against im2col + GEMM or a double sum,
 * the same bits at every CPU level and thread count, im2col chunk sizes. */
#include "nn_fixtures.h"

/* conv2d (relu or none) followed by a max_pool2d whose windows tile its
 * output runs as one pass (nn_internal.h, fuse_pool): gradients against
 * central differences on the GEMM path and the direct one (cin = 1), 2x2 and
 * 3x3 windows, two fused pairs stacked as in the CNN config; the flags are
 * set exactly where the windows tile; and the same model with an identity
 * activation layer between conv and pool (which is not fused) gives the same
 * loss and predictions bit for bit and the same gradients to rounding (the
 * bias sums run in another order). */
static void same_step(const char *what, const loom_layer_spec *fu, int nfu, const loom_layer_spec *un, int nun,
                      loom_shape in)
{
    fixture a, b;
    const int64_t B = 5;
    if (fixture_new(&a, mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, nfu, fu), in, LOOM_I32, B, 3) != LOOM_OK ||
        fixture_new(&b, mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, nun, un), in, LOOM_I32, B, 3) != LOOM_OK) {
        CHECK_MSG(0, "%s: cannot build", what);
        return;
    }
    CHECK_MSG(a.m->layer[0].fuse_pool && a.m->layer[1].fused, "%s: conv + pool not fused", what);
    CHECK_MSG(!b.m->layer[0].fuse_pool && !b.m->layer[2].fused, "%s: fused across an activation layer", what);
    const int64_t P = loom_model_num_params(a.m), n = B * loom_shape_numel(&a.out);
    CHECK(P == loom_model_num_params(b.m) && n <= 40);
    memcpy(loom_model_params(b.m), loom_model_params(a.m), (size_t)P * sizeof(float));
    memcpy(b.x.data, a.x.data, (size_t)loom_shape_numel(&a.x.shape) * sizeof(float));
    memcpy(b.y.data, a.y.data, (size_t)B * sizeof(int32_t));
    double la = step_loss(&a, 1), lb = step_loss(&b, 1);
    CHECK_MSG(la == lb, "%s: loss %.17g fused, %.17g not", what, la, lb);
    CHECK_MSG(close_vec("grads", loom_model_grads(b.m), loom_model_grads(a.m), P), "%s: gradients differ", what);
    float pa[40], pb[40];
    CHECK(loom_model_predict(a.m, &a.x, pa, &err) == LOOM_OK && loom_model_predict(b.m, &b.x, pb, &err) == LOOM_OK);
    CHECK_MSG(!memcmp(pa, pb, (size_t)n * sizeof(float)), "%s: predictions differ", what);
    printf("# %s: fused = unfused: loss and predictions bit for bit, gradients within %.2g of the largest\n", what,
           worst_scaled);
    worst_scaled = 0;
    fixture_free(&a);
    fixture_free(&b);
}

static void fused_same_as_unfused(const char *what, loom_activation act, loom_shape in, int cout)
{
    loom_layer_spec fu[] = {L_conv(cout, 3, 1, LOOM_PAD_SAME, act), L_pool(2, 2, LOOM_PAD_VALID),
                            L_kind(LOOM_LAYER_FLATTEN, 0, 0), L_dense(4, LOOM_ACT_NONE)};
    loom_layer_spec un[] = {L_conv(cout, 3, 1, LOOM_PAD_SAME, act), L_kind(LOOM_LAYER_ACTIVATION, 0, LOOM_ACT_NONE),
                            L_pool(2, 2, LOOM_PAD_VALID), L_kind(LOOM_LAYER_FLATTEN, 0, 0), L_dense(4, LOOM_ACT_NONE)};
    same_step(what, fu, 4, un, 5, in);
}

static void test_fused_conv_pool(void)
{
    /* relu and max-pool make kinks everywhere: the relu cases are small enough for central differences to hold */
    loom_layer_spec r2[] = {L_conv(3, 3, 1, LOOM_PAD_SAME, LOOM_ACT_RELU), L_pool(2, 2, LOOM_PAD_VALID),
                            L_kind(LOOM_LAYER_FLATTEN, 0, 0), L_dense(3, LOOM_ACT_NONE)};
    gradcheck("fused conv relu + pool 2x2", r2, 4, LOOM_LOSS_SPARSE_SOFTMAX_CE, shp(3, 4, 6, 3), LOOM_I32, 2, 1);
    gradcheck("fused conv cin 1 relu + pool 2x2", r2, 4, LOOM_LOSS_SPARSE_SOFTMAX_CE, shp(3, 6, 4, 1), LOOM_I32, 2, 1);
    loom_layer_spec n2[] = {L_conv(3, 3, 1, LOOM_PAD_SAME, LOOM_ACT_NONE), L_pool(2, 2, LOOM_PAD_VALID),
                            L_kind(LOOM_LAYER_FLATTEN, 0, 0), L_dense(3, LOOM_ACT_NONE)};
    gradcheck("fused conv + pool 2x2", n2, 4, LOOM_LOSS_SPARSE_SOFTMAX_CE, shp(3, 6, 4, 2), LOOM_I32, 2, 1);
    loom_layer_spec r3[] = {L_conv(2, 3, 1, LOOM_PAD_SAME, LOOM_ACT_RELU), L_pool(3, 3, LOOM_PAD_VALID),
                            L_kind(LOOM_LAYER_FLATTEN, 0, 0), L_dense(3, LOOM_ACT_NONE)};
    gradcheck("fused conv relu + pool 3x3", r3, 4, LOOM_LOSS_SPARSE_SOFTMAX_CE, shp(3, 6, 9, 2), LOOM_I32, 3, 1);
    /* two pairs stacked as in the CNN config (central differences see too many kinks through two pools) */
    loom_layer_spec two[] = {L_conv(4, 5, 1, LOOM_PAD_SAME, LOOM_ACT_RELU), L_pool(2, 2, LOOM_PAD_VALID),
                             L_conv(5, 3, 1, LOOM_PAD_SAME, LOOM_ACT_RELU), L_pool(2, 2, LOOM_PAD_VALID),
                             L_kind(LOOM_LAYER_FLATTEN, 0, 0), L_dense(3, LOOM_ACT_NONE)};
    loom_layer_spec twou[] = {L_conv(4, 5, 1, LOOM_PAD_SAME, LOOM_ACT_RELU), L_kind(LOOM_LAYER_ACTIVATION, 0, LOOM_ACT_NONE),
                              L_pool(2, 2, LOOM_PAD_VALID), L_conv(5, 3, 1, LOOM_PAD_SAME, LOOM_ACT_RELU),
                              L_kind(LOOM_LAYER_ACTIVATION, 0, LOOM_ACT_NONE), L_pool(2, 2, LOOM_PAD_VALID),
                              L_kind(LOOM_LAYER_FLATTEN, 0, 0), L_dense(3, LOOM_ACT_NONE)};
    same_step("two pairs, cin 1 first", two, 6, twou, 8, shp(3, 8, 12, 1));
    /* the CNN config's sizes: the second conv's im2col runs one example at a time (several chunks) */
    loom_layer_spec cnn[] = {L_conv(32, 5, 1, LOOM_PAD_SAME, LOOM_ACT_RELU), L_pool(2, 2, LOOM_PAD_VALID),
                             L_conv(64, 5, 1, LOOM_PAD_SAME, LOOM_ACT_RELU), L_pool(2, 2, LOOM_PAD_VALID),
                             L_kind(LOOM_LAYER_FLATTEN, 0, 0), L_dense(4, LOOM_ACT_NONE)};
    loom_layer_spec cnnu[] = {L_conv(32, 5, 1, LOOM_PAD_SAME, LOOM_ACT_RELU), L_kind(LOOM_LAYER_ACTIVATION, 0, LOOM_ACT_NONE),
                              L_pool(2, 2, LOOM_PAD_VALID), L_conv(64, 5, 1, LOOM_PAD_SAME, LOOM_ACT_RELU),
                              L_kind(LOOM_LAYER_ACTIVATION, 0, LOOM_ACT_NONE), L_pool(2, 2, LOOM_PAD_VALID),
                              L_kind(LOOM_LAYER_FLATTEN, 0, 0), L_dense(4, LOOM_ACT_NONE)};
    same_step("the CNN config's sizes", cnn, 6, cnnu, 8, shp(3, 28, 28, 1));

    /* where the windows tile: 2x2 over 6x4 yes, over 6x5 no (a column left out), 3x3 stride 2 no; tanh no */
    struct { loom_shape in; loom_layer_spec c, p; int fused; } cases[] = {
        {shp(3, 6, 4, 2), L_conv(2, 3, 1, LOOM_PAD_SAME, LOOM_ACT_RELU), L_pool(2, 2, LOOM_PAD_VALID), 1},
        {shp(3, 6, 4, 2), L_conv(2, 3, 1, LOOM_PAD_SAME, LOOM_ACT_NONE), L_pool(2, 2, LOOM_PAD_VALID), 1},
        {shp(3, 6, 5, 2), L_conv(2, 3, 1, LOOM_PAD_SAME, LOOM_ACT_RELU), L_pool(2, 2, LOOM_PAD_VALID), 0},
        {shp(3, 7, 7, 2), L_conv(2, 3, 1, LOOM_PAD_SAME, LOOM_ACT_RELU), L_pool(3, 2, LOOM_PAD_VALID), 0},
        {shp(3, 6, 4, 2), L_conv(2, 3, 1, LOOM_PAD_SAME, LOOM_ACT_TANH), L_pool(2, 2, LOOM_PAD_VALID), 0},
        {shp(3, 6, 4, 2), L_conv(2, 3, 1, LOOM_PAD_SAME, LOOM_ACT_RELU), L_pool(2, 2, LOOM_PAD_SAME), 1},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        loom_layer_spec ls[] = {cases[k].c, cases[k].p, L_kind(LOOM_LAYER_FLATTEN, 0, 0), L_dense(2, LOOM_ACT_NONE)};
        loom_model *m = NULL;
        loom_shape lab = shp(0, 0, 0, 0);
        CHECK(loom_model_new(&m, mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 4, ls), &cases[k].in, LOOM_F32, &lab, LOOM_I32, 4,
                             &err) == LOOM_OK);
        if (!m) continue;
        CHECK_MSG(m->layer[0].fuse_pool == cases[k].fused && m->layer[1].fused == cases[k].fused,
                  "fusion case %zu: fuse_pool %d fused %d, expected %d", k, m->layer[0].fuse_pool, m->layer[1].fused,
                  cases[k].fused);
        loom_model_free(m);
    }
    fused_same_as_unfused("relu, GEMM path", LOOM_ACT_RELU, shp(3, 6, 8, 3), 5);
    fused_same_as_unfused("none, GEMM path", LOOM_ACT_NONE, shp(3, 6, 8, 3), 5);
    fused_same_as_unfused("relu, cin 1", LOOM_ACT_RELU, shp(3, 8, 6, 1), 17);
    fused_same_as_unfused("none, cin 1", LOOM_ACT_NONE, shp(3, 8, 6, 1), 16);
}

/* The direct cin = 1 kernels at each level the CPU runs (nn_layer_.fma:
 * 2 AVX-512, 1 AVX2+FMA) give the same gradients and outputs bit for bit:
 * the 512-bit kernels compute each lane as the 256-bit ones do. 17 and 40
 * filters: a block pair, a lone block and a scalar tail. */
static void test_conv1_levels(void)
{
    const int level = loom_cpu()->level;
    if (level < LOOM_CPU_AVX2_FMA) {
        printf("# this CPU has no AVX2+FMA: only the generic kernels run here\n");
        CHECK(1);
        return;
    }
    for (int f = 0; f < 2; f++) {
        loom_layer_spec ls[] = {L_conv(f ? 40 : 17, 5, 1, LOOM_PAD_SAME, LOOM_ACT_RELU), L_pool(2, 2, LOOM_PAD_VALID),
                                L_kind(LOOM_LAYER_FLATTEN, 0, 0), L_dense(3, LOOM_ACT_NONE)};
        loom_layer_spec st[] = {L_conv(f ? 40 : 17, 3, 2, LOOM_PAD_VALID, LOOM_ACT_TANH), L_kind(LOOM_LAYER_FLATTEN, 0, 0),
                                L_dense(3, LOOM_ACT_NONE)};
        for (int k = 0; k < 2; k++) {
            fixture a;
            const int64_t B = 3;
            if (fixture_new(&a, mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, k ? 3 : 4, k ? st : ls), shp(3, 10, 9, 1), LOOM_I32, B,
                            4) != LOOM_OK) {
                CHECK_MSG(0, "cannot build");
                continue;
            }
            const int64_t P = loom_model_num_params(a.m);
            float *g1 = malloc((size_t)P * sizeof *g1), p1[9], p2[9];
            a.m->layer[0].fma = 1;
            double l1 = step_loss(&a, 1);
            memcpy(g1, loom_model_grads(a.m), (size_t)P * sizeof *g1);
            CHECK(loom_model_predict(a.m, &a.x, p1, &err) == LOOM_OK);
            if (level >= LOOM_CPU_AVX512) {
                a.m->layer[0].fma = 2;
                double l2 = step_loss(&a, 1);
                CHECK(loom_model_predict(a.m, &a.x, p2, &err) == LOOM_OK);
                CHECK_MSG(l1 == l2 && !memcmp(g1, loom_model_grads(a.m), (size_t)P * sizeof *g1) &&
                              !memcmp(p1, p2, sizeof p1),
                          "%d filters, case %d: the AVX-512 kernels differ from the AVX2 ones", f ? 40 : 17, k);
            }
            /* the generic kernels: a multiply and an add per tap, so only close */
            a.m->layer[0].fma = 0;
            double l0 = step_loss(&a, 1);
            CHECK_MSG(fabs(l0 - l1) <= 1e-5 * fabs(l1), "generic kernels: loss %.9g vs %.9g", l0, l1);
            CHECK(close_vec("grads", g1, loom_model_grads(a.m), P));
            worst_scaled = 0;
            free(g1);
            fixture_free(&a);
        }
    }
    printf("# direct conv kernels: %s\n", level >= LOOM_CPU_AVX512 ? "AVX-512 = AVX2+FMA bit for bit, generic close"
                                                                     : "AVX2+FMA and generic close (no AVX-512 here)");
}

/* The direct k x k convolutions (conv_direct.c: 5x5 and 7x7 "same", 16k channels up to 64) against
 * the reference path (im2col + GEMM, nn_layer_.fma = 0) at each level the CPU runs: loss, every
 * gradient (the kernel gradient, and the input gradient through the layer before) and predictions
 * close; AVX-512 = AVX2 bit for bit. Widths 8 (fused 2x2 pool), 9 and 14 (the CNN's: 5x5 32 -> 64)
 * go through every tile width of both kernels; the first conv needs no input gradient. */
static void test_convd_levels(void)
{
    const int level = loom_cpu()->level;
    if (level < LOOM_CPU_AVX2_FMA) {
        printf("# this CPU has no AVX2+FMA: conv_direct.c's kernels do not run here\n");
        CHECK(1);
        return;
    }
    struct {
        int k, w, c, f1, f2, pool;
    } cases[] = {{5, 8, 16, 32, 16, 1}, {7, 9, 32, 16, 48, 0}, {5, 14, 16, 32, 64, 1}};
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        loom_layer_spec ls[] = {L_conv(cases[k].f1, cases[k].k, 1, LOOM_PAD_SAME, LOOM_ACT_TANH),
                                L_conv(cases[k].f2, cases[k].k, 1, LOOM_PAD_SAME, LOOM_ACT_RELU),
                                cases[k].pool ? L_pool(2, 2, LOOM_PAD_VALID) : L_kind(LOOM_LAYER_FLATTEN, 0, 0),
                                L_kind(LOOM_LAYER_FLATTEN, 0, 0), L_dense(3, LOOM_ACT_NONE)};
        fixture a;
        if (fixture_new(&a, mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 5, ls), shp(3, 6, cases[k].w, cases[k].c), LOOM_I32, 3,
                        4) != LOOM_OK) {
            CHECK_MSG(0, "cannot build case %zu", k);
            continue;
        }
        nn_layer_ *c0 = &a.m->layer[0], *c1 = &a.m->layer[1];
        CHECK_MSG(nn_convd_ok_(c0) && nn_convd_ok_(c1) && c1->needs_dx && c1->fuse_pool == cases[k].pool,
                  "case %zu: both convs direct (%d %d), the second fused with the pool (%d)", k, nn_convd_ok_(c0),
                  nn_convd_ok_(c1), c1->fuse_pool);
        const int64_t P = loom_model_num_params(a.m);
        float *g1 = malloc((size_t)P * sizeof *g1), p1[9], p2[9];
        c0->fma = c1->fma = 1;
        double l1 = step_loss(&a, 1);
        memcpy(g1, loom_model_grads(a.m), (size_t)P * sizeof *g1);
        CHECK(loom_model_predict(a.m, &a.x, p1, &err) == LOOM_OK);
        if (level >= LOOM_CPU_AVX512) {
            c0->fma = c1->fma = 2;
            double l2 = step_loss(&a, 1);
            CHECK(loom_model_predict(a.m, &a.x, p2, &err) == LOOM_OK);
            CHECK_MSG(l1 == l2 && !memcmp(g1, loom_model_grads(a.m), (size_t)P * sizeof *g1) && !memcmp(p1, p2, sizeof p1),
                      "case %zu: the AVX-512 direct kernels differ from the AVX2 ones", k);
        }
        c0->fma = c1->fma = 0; /* the reference: im2col + GEMM */
        CHECK(!nn_convd_ok_(c1));
        double l0 = step_loss(&a, 1);
        CHECK_MSG(fabs(l0 - l1) <= 1e-5 * fabs(l1), "case %zu: loss %.9g (GEMM) vs %.9g (direct)", k, l0, l1);
        CHECK(close_vec("grads", g1, loom_model_grads(a.m), P));
        CHECK(loom_model_predict(a.m, &a.x, p2, &err) == LOOM_OK);
        CHECK(close_vec("predictions", p1, p2, 9));
        worst_scaled = 0;
        free(g1);
        fixture_free(&a);
    }
    printf("# conv_direct.c: %s\n", level >= LOOM_CPU_AVX512 ? "AVX-512 = AVX2 bit for bit, both close to im2col + GEMM"
                                                              : "AVX2 close to im2col + GEMM (no AVX-512 here)");
}

/* conv_winograd.c's F(2x2, 5x5) and F(4x4, 3x3) against a double-precision "same" convolution: the forward
 * and the input gradient (flipped, transposed kernel) within 1e-5 of the largest output, each at AVX2 and
 * (where the CPU has it) AVX-512 with the same bits, and conv_direct.c's (5x5) or conv_fast.c's (3x3) sums
 * as close. Sizes: 6x8 / 8x12 (whole tiles), 7x9 (part tiles at the bottom and the right), 14x14 32 -> 64
 * (the CNN's second convolution), and ResNet-20's 28x28 16 -> 16, 14x14 32 -> 32, 7x7 64 -> 64. */
static double convw_worst(const float *a, const double *ref, int64_t n)
{
    double scale = 0, worst = 0;
    for (int64_t k = 0; k < n; k++) scale = fmax(scale, fabs(ref[k]));
    for (int64_t k = 0; k < n; k++) worst = fmax(worst, fabs(a[k] - ref[k]));
    return scale > 0 ? worst / scale : 1;
}

/* ref (nb, H, W, OUT) = x (nb, H, W, IN) convolved "same" with w (K, K, CI, CO), flipped and transposed when flip */
static void convw_ref(const float *w, int K, const float *x, double *ref, int nb, int H, int W, int CI, int CO,
                      int flip)
{
    const int IN = flip ? CO : CI, OUT = flip ? CI : CO, pad = (K - 1) / 2;
    for (int b = 0; b < nb; b++)
        for (int oy = 0; oy < H; oy++)
            for (int ox = 0; ox < W; ox++)
                for (int o = 0; o < OUT; o++) {
                    double s = 0;
                    for (int i = 0; i < K; i++)
                        for (int j = 0; j < K; j++) {
                            int r = oy + i - pad, c = ox + j - pad;
                            if (r < 0 || r >= H || c < 0 || c >= W) continue;
                            for (int a = 0; a < IN; a++) {
                                double wv = flip ? w[((int64_t)((K - 1 - i) * K + K - 1 - j) * CI + o) * CO + a]
                                                 : w[((int64_t)(i * K + j) * CI + a) * CO + o];
                                s += wv * x[(((int64_t)b * H + r) * W + c) * IN + a];
                            }
                        }
                    ref[(((int64_t)b * H + oy) * W + ox) * OUT + o] = s;
                }
}

/* ref (K, K, CI, CO) = the kernel gradient of the "same" convolution: x (nb, H, W, CI) times dz (nb, H, W, CO),
 * in double */
static void convw_kgrad_ref(int K, const float *x, const float *dz, double *ref, int nb, int H, int W, int CI, int CO)
{
    const int pad = (K - 1) / 2;
    memset(ref, 0, (size_t)K * K * CI * CO * sizeof *ref);
    for (int b = 0; b < nb; b++)
        for (int oy = 0; oy < H; oy++)
            for (int ox = 0; ox < W; ox++) {
                const float *d = dz + (((int64_t)b * H + oy) * W + ox) * CO;
                for (int i = 0; i < K; i++)
                    for (int j = 0; j < K; j++) {
                        int r = oy + i - pad, c = ox + j - pad;
                        if (r < 0 || r >= H || c < 0 || c >= W) continue;
                        const float *xv = x + (((int64_t)b * H + r) * W + c) * CI;
                        for (int a = 0; a < CI; a++)
                            for (int o = 0; o < CO; o++)
                                ref[((int64_t)(i * K + j) * CI + a) * CO + o] += (double)xv[a] * d[o];
                    }
            }
}

/* conv_winograd.c's 3x3 kernel gradient: whole and split at every 8 input channels (the same bits), within
 * bound of the largest |dW| of a double sum; AVX-512 = AVX2 bit for bit. Returns the worst error. */
static double convw_kgrad_check(nn_layer_ *l, size_t k, const float *x, const float *dz, int nb, float *s, int level,
                                double bound)
{
    const int H = l->ih, W = l->iw, CI = l->cin, CO = l->cout;
    const int64_t nw = (int64_t)9 * CI * CO;
    double *ref = malloc((size_t)nw * sizeof *ref);
    float *g1 = malloc((size_t)nw * 4), *g2 = malloc((size_t)nw * 4);
    convw_kgrad_ref(3, x, dz, ref, nb, H, W, CI, CO);
    l->fma = 1;
    nn_convw_kernel_grad_(l, x, dz, nb, 0, CI, g1, s);
    double e = convw_worst(g1, ref, nw);
    CHECK_MSG(e <= bound, "case %zu: Winograd kernel gradient %.3g of the largest (bound %.3g)", k, e, bound);
    for (int c = 0; c < CI; c += 8) nn_convw_kernel_grad_(l, x, dz, nb, c, c + 8, g2, s);
    CHECK_MSG(!memcmp(g1, g2, (size_t)nw * 4), "case %zu: the kernel gradient by 8 channels differs", k);
    if (level >= LOOM_CPU_AVX512) {
        l->fma = 2;
        nn_convw_kernel_grad_(l, x, dz, nb, 0, CI, g2, s);
        CHECK_MSG(!memcmp(g1, g2, (size_t)nw * 4), "case %zu: the AVX-512 kernel gradient differs from AVX2's", k);
        l->fma = 1;
    }
    nn_conv3_kernel_grad_(l, x, dz, nb, 0, 9 * CI, g2, s); /* the direct sums: as close */
    CHECK_MSG(convw_worst(g2, ref, nw) <= bound, "case %zu: direct kernel gradient %.3g", k, convw_worst(g2, ref, nw));
    free(ref), free(g1), free(g2);
    return e;
}

static void test_convw_levels(void)
{
    const int level = loom_cpu()->level;
    if (level < LOOM_CPU_AVX2_FMA) {
        printf("# this CPU has no AVX2+FMA: conv_winograd.c's kernels do not run here\n");
        CHECK(1);
        return;
    }
    struct { int k, h, w, ci, co; } cases[] = {{5, 6, 8, 16, 32},  {5, 7, 9, 32, 16},  {5, 14, 14, 32, 64},
                                               {3, 8, 12, 16, 32}, {3, 7, 9, 32, 16},  {3, 14, 14, 32, 32},
                                               {3, 28, 28, 16, 16}, {3, 7, 7, 64, 64}};
    double worst[2] = {0, 0}, worst_k = 0; /* 5x5, 3x3; the 3x3 kernel gradient */
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        const int KS = cases[k].k, H = cases[k].h, W = cases[k].w, CI = cases[k].ci, CO = cases[k].co, nb = 3;
        loom_layer_spec ls[] = {L_conv(CO, KS, 1, LOOM_PAD_SAME, LOOM_ACT_RELU), L_kind(LOOM_LAYER_FLATTEN, 0, 0),
                                L_dense(3, LOOM_ACT_NONE)};
        ls[0].algorithm = LOOM_CONV_WINOGRAD; /* 3x3: whatever "auto" picks */
        loom_model *m = NULL;
        loom_shape in = shp(3, H, W, CI), lab = shp(0, 0, 0, 0);
        CHECK(loom_model_new(&m, mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 3, ls), &in, LOOM_F32, &lab, LOOM_I32, nb, &err) ==
              LOOM_OK);
        if (!m) continue;
        nn_layer_ *l = &m->layer[0];
        const int direct_ok = KS == 5 ? nn_convd_ok_(l) : nn_conv3_ok_(l);
        CHECK_MSG(nn_convw_ok_(l) && direct_ok, "case %zu: Winograd (%d) and direct (%d)", k, nn_convw_ok_(l),
                  direct_ok);
        const int64_t nx = (int64_t)nb * H * W * CI, ny = (int64_t)nb * H * W * CO, nw = (int64_t)KS * KS * CI * CO;
        int64_t nsd = KS == 5 ? nn_convd_scratch_(l) : nn_conv3_scratch_(l);
        int64_t ns = nn_convw_scratch_(l) > nsd ? nn_convw_scratch_(l) : nsd;
        float *w = malloc((size_t)nw * sizeof *w), *x = malloc((size_t)nx * sizeof *x), *dz = malloc((size_t)ny * 4),
              *y1 = malloc((size_t)ny * 4), *y2 = malloc((size_t)ny * 4), *dx1 = malloc((size_t)nx * 4),
              *dx2 = malloc((size_t)nx * 4), *s = malloc((size_t)ns * 4);
        double *ry = malloc((size_t)ny * sizeof *ry), *rx = malloc((size_t)nx * sizeof *rx);
        loom_rng r;
        loom_rng_init(&r, 7 + k, 99, 0, 0);
        fill_normal(w, nw, &r, 0.1f);
        fill_normal(x, nx, &r, 1.f);
        fill_normal(dz, ny, &r, 1.f);
        convw_ref(w, KS, x, ry, nb, H, W, CI, CO, 0);
        convw_ref(w, KS, dz, rx, nb, H, W, CI, CO, 1);
        l->fma = 1;
        nn_convw_kernel_(l, w, s);
        nn_convw_forward_(l, x, y1, nb, s);
        nn_convw_backward_data_(l, w, dz, dx1, nb, s, 0);
        /* acc: dx + the input gradient, the bits of adding it afterwards (graph.c's gathered rows) */
        for (int64_t e = 0; e < nx; e++) dx2[e] = x[e];
        nn_convw_backward_data_(l, w, dz, dx2, nb, s, 1);
        bool added = true;
        for (int64_t e = 0; e < nx; e++) added &= dx2[e] == x[e] + dx1[e];
        CHECK_MSG(added, "case %zu: the Winograd input gradient added in place differs from adding it after", k);
        double ey = convw_worst(y1, ry, ny), ex = convw_worst(dx1, rx, nx);
        CHECK_MSG(ey <= 1e-5 && ex <= 1e-5, "case %zu: Winograd forward %.3g, input gradient %.3g of the largest", k,
                  ey, ex);
        worst[KS == 3] = fmax(worst[KS == 3], fmax(ey, ex));
        if (level >= LOOM_CPU_AVX512) {
            l->fma = 2;
            nn_convw_kernel_(l, w, s);
            nn_convw_forward_(l, x, y2, nb, s);
            nn_convw_backward_data_(l, w, dz, dx2, nb, s, 0);
            CHECK_MSG(!memcmp(y1, y2, (size_t)ny * 4) && !memcmp(dx1, dx2, (size_t)nx * 4),
                      "case %zu: the AVX-512 Winograd kernels differ from the AVX2 ones", k);
        }
        if (KS == 3) worst_k = fmax(worst_k, convw_kgrad_check(l, k, x, dz, nb, s, level, 1e-5));
        if (KS == 5) { /* the direct sums: as close */
            nn_convd_forward_(l, w, x, y2, nb, s);
            nn_convd_backward_data_(l, w, dz, dx2, nb, s);
        } else {
            nn_conv3_forward_(l, w, x, y2, nb, s);
            nn_conv3_backward_data_(l, w, dz, dx2, nb, s);
        }
        CHECK_MSG(convw_worst(y2, ry, ny) <= 1e-5 && convw_worst(dx2, rx, nx) <= 1e-5, "case %zu: direct", k);
        l->spec.algorithm = LOOM_CONV_AUTO; /* these shapes (3x3: up to 64 channels, 7x7 planes or more) */
        CHECK_MSG(nn_convw_ok_(l), "case %zu: \"auto\" does not pick Winograd", k);
        CHECK_MSG(nn_convw_kgrad_ok_(l) == (KS == 3 && CI >= 32), "case %zu: \"auto\"'s kernel gradient", k);
        l->spec.algorithm = LOOM_CONV_DIRECT; /* the switch */
        CHECK(!nn_convw_ok_(l) && !nn_convw_kgrad_ok_(l) && (KS == 5 ? nn_convd_ok_(l) : nn_conv3_ok_(l)));
        free(w), free(x), free(dz), free(y1), free(y2), free(dx1), free(dx2), free(s), free(ry), free(rx);
        loom_model_free(m);
    }
    printf("# conv_winograd.c: F(2x2, 5x5) within %.2g, F(4x4, 3x3) within %.2g of the largest output of a double "
           "sum, the 3x3 kernel gradient within %.2g of the largest |dW|%s\n",
           worst[0], worst[1], worst_k, level >= LOOM_CPU_AVX512 ? ", AVX-512 = AVX2 bit for bit" : "");
}

/* The direct narrow-input kernels (conv_stem.c: 2-4 channels in, no padding of their own, as ResNet-50's 7x7
 * stride-2 stem) at each level the CPU runs give the same loss, gradients and outputs bit for bit, and the im2col +
 * GEMM path's (fma = 0) within 1e-5: a 3 -> 64 7x7 stride-2 first layer (6-pixel rows: one tile) and a 4 -> 80
 * 3x3 after a 1x1 conv (80: a 64-channel group and a 16 one; 3-pixel rows, shorter than a tile; its input
 * gradient from GEMM + col2im), batch 3 over 2 threads (the weight gradient's rows split mid kernel row). */
static void test_convs_levels(void)
{
    const int level = loom_cpu()->level;
    if (level < LOOM_CPU_AVX2_FMA) {
        printf("# this CPU has no AVX2+FMA: only the im2col + GEMM path runs here\n");
        CHECK(1);
        return;
    }
    loom_layer_spec ls[] = {L_conv(64, 7, 2, LOOM_PAD_VALID, LOOM_ACT_RELU), L_conv(4, 1, 1, LOOM_PAD_VALID, LOOM_ACT_NONE),
                            L_conv(80, 3, 1, LOOM_PAD_VALID, LOOM_ACT_TANH), L_kind(LOOM_LAYER_FLATTEN, 0, 0),
                            L_dense(3, LOOM_ACT_NONE)};
    fixture a;
    const int64_t B = 3;
    if (fixture_new(&a, mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 5, ls), shp(3, 15, 17, 3), LOOM_I32, B, 2) != LOOM_OK) {
        CHECK_MSG(0, "cannot build");
        return;
    }
    const int64_t P = loom_model_num_params(a.m);
    float *g1 = malloc((size_t)P * sizeof *g1), p1[9], p2[9];
    a.m->layer[0].fma = a.m->layer[2].fma = 1;
    CHECK_MSG(nn_convs_ok_(&a.m->layer[0]) && nn_convs_ok_(&a.m->layer[2]) && !nn_convs_ok_(&a.m->layer[1]),
              "the 3- and 4-channel convolutions run direct, the 1x1 one does not");
    double l1 = step_loss(&a, 1);
    memcpy(g1, loom_model_grads(a.m), (size_t)P * sizeof *g1);
    CHECK(loom_model_predict(a.m, &a.x, p1, &err) == LOOM_OK);
    if (level >= LOOM_CPU_AVX512) {
        a.m->layer[0].fma = a.m->layer[2].fma = 2;
        double l2 = step_loss(&a, 1);
        CHECK(loom_model_predict(a.m, &a.x, p2, &err) == LOOM_OK);
        CHECK_MSG(l1 == l2 && !memcmp(g1, loom_model_grads(a.m), (size_t)P * sizeof *g1) && !memcmp(p1, p2, sizeof p1),
                  "the AVX-512 narrow-input kernels differ from the AVX2 ones");
    }
    a.m->layer[0].fma = a.m->layer[2].fma = 0;
    CHECK(!nn_convs_ok_(&a.m->layer[0]));
    double l0 = step_loss(&a, 1);
    CHECK(loom_model_predict(a.m, &a.x, p2, &err) == LOOM_OK);
    CHECK_MSG(fabs(l0 - l1) <= 1e-5 * fabs(l1), "im2col + GEMM: loss %.9g vs %.9g", l0, l1);
    CHECK(close_vec("grads", g1, loom_model_grads(a.m), P));
    CHECK(close_vec("outputs", p1, p2, 9));
    printf("# narrow-input conv kernels: %s, im2col + GEMM within %.2g\n",
           level >= LOOM_CPU_AVX512 ? "AVX-512 = AVX2+FMA bit for bit" : "AVX2+FMA (no AVX-512 here)", worst_scaled);
    worst_scaled = 0;
    free(g1);
    fixture_free(&a);
}

/* A wide conv's im2col chunk holds at least 1024 output pixels (model_build.c NN_COL_ROWS), not one example's: 3x3
 * on 4x4x256 (147 KB of columns an example) takes the whole batch of 8 (128 pixels), where the 1 MB budget alone
 * gave 7, and BLAS packed the kernel again per chunk; the gradients match those of one example per chunk. */
static void test_conv_chunk_rows(void)
{
    loom_layer_spec ls[] = {L_conv(64, 3, 1, LOOM_PAD_SAME, LOOM_ACT_RELU), L_kind(LOOM_LAYER_FLATTEN, 0, 0),
                            L_dense(3, LOOM_ACT_NONE)};
    fixture a;
    if (fixture_new(&a, mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 3, ls), shp(3, 4, 4, 256), LOOM_I32, 8, 3) != LOOM_OK) {
        CHECK_MSG(0, "cannot build");
        return;
    }
    CHECK_MSG(a.m->layer[0].chunk == 8, "chunk %d, expected the batch's 8", a.m->layer[0].chunk);
    const int64_t P = loom_model_num_params(a.m);
    float *g8 = malloc((size_t)P * sizeof *g8);
    double l8 = step_loss(&a, 1);
    memcpy(g8, loom_model_grads(a.m), (size_t)P * sizeof *g8);
    a.m->layer[0].chunk = 1;
    double l1 = step_loss(&a, 1);
    CHECK_MSG(fabs(l8 - l1) <= 1e-5 * fabs(l1), "loss %.9g vs %.9g", l8, l1);
    CHECK(close_vec("grads", g8, loom_model_grads(a.m), P));
    worst_scaled = 0;
    free(g8);
    fixture_free(&a);
}


/* A step of f's first 5 examples on 2 and 3 threads: 1 thread's loss, gradients and predictions, bit for bit. */
static void same_bits_2_3_threads(fixture *f)
{
    const int64_t P = loom_model_num_params(f->m), n_out = loom_shape_numel(&f->out);
    step_out one, o;
    run_threads(f, 1, 5, 11, &one);
    for (int t = 2; t <= 3; t++) {
        run_threads(f, t, 5, 11, &o);
        CHECK_MSG(o.loss == one.loss && !memcmp(o.grads, one.grads, (size_t)P * sizeof(float)) &&
                      !memcmp(o.pred, one.pred, (size_t)(5 * n_out) * sizeof(float)),
                  "%d threads: not the bits of 1 thread (%s kernels)", t, loom_cpu_level_name(loom_cpu()->level));
        step_out_free(&o);
    }
    step_out_free(&one);
}

/* conv_direct.c's kernels with 1, 2 and 3 threads: the same bits (each output one chain; the
 * kernel gradient's rows split by thread, each summed over every example in order). No dense
 * layer (OpenBLAS's Haswell sgemm changes the last bits with the rows a thread gets): 5x5 16 -> 16,
 * 7x7 16 -> 32 with a fused pool, global average pooling to 32 logits. Run by the CI at both
 * levels (LOOM_TEST_CPU=avx2). */
static void test_convd_threads(void)
{
    if (loom_cpu()->level < LOOM_CPU_AVX2_FMA) {
        printf("# this CPU has no AVX2+FMA: conv_direct.c's kernels do not run here\n");
        CHECK(1);
        return;
    }
    loom_layer_spec ls[] = {L_conv(16, 5, 1, LOOM_PAD_SAME, LOOM_ACT_TANH), L_conv(32, 7, 1, LOOM_PAD_SAME, LOOM_ACT_RELU),
                            L_pool(2, 2, LOOM_PAD_VALID), L_kind(LOOM_LAYER_GLOBAL_AVG_POOL2D, 0, 0)};
    ls[0].algorithm = LOOM_CONV_DIRECT; /* else conv_winograd.c's */
    fixture f;
    if (fixture_new(&f, mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 4, ls), shp(3, 6, 10, 16), LOOM_I32, 5, 3) != LOOM_OK) {
        CHECK_MSG(0, "cannot build");
        return;
    }
    CHECK(nn_convd_ok_(&f.m->layer[0]) && !nn_convw_ok_(&f.m->layer[0]) && nn_convd_ok_(&f.m->layer[1]) &&
          f.m->layer[1].fuse_pool);
    same_bits_2_3_threads(&f);
    printf("# conv_direct.c, %s kernels: 2 and 3 threads give 1 thread's bits\n", loom_cpu_level_name(loom_cpu()->level));
    fixture_free(&f);
}

/* conv_winograd.c with 1, 2 and 3 threads: the same bits (the tiles go in fixed blocks; each product
 * element one chain). KxK (5: F(2x2, 5x5), 3: F(4x4, 3x3)) 16 -> 16 then 16 -> 32 (its input gradient
 * Winograd too) and a 2x2 pool, on 8x9 planes (part tiles at the right), global average pooling to 32
 * logits. */
static void convw_threads(int K)
{
    if (loom_cpu()->level < LOOM_CPU_AVX2_FMA) {
        printf("# this CPU has no AVX2+FMA: conv_winograd.c's kernels do not run here\n");
        CHECK(1);
        return;
    }
    loom_layer_spec ls[] = {L_conv(16, K, 1, LOOM_PAD_SAME, LOOM_ACT_TANH), L_conv(32, K, 1, LOOM_PAD_SAME, LOOM_ACT_RELU),
                            L_pool(2, 2, LOOM_PAD_VALID), L_kind(LOOM_LAYER_GLOBAL_AVG_POOL2D, 0, 0)};
    ls[0].algorithm = ls[1].algorithm = LOOM_CONV_WINOGRAD;
    fixture f;
    if (fixture_new(&f, mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 4, ls), shp(3, 8, 9, 16), LOOM_I32, 5, 3) != LOOM_OK) {
        CHECK_MSG(0, "cannot build");
        return;
    }
    CHECK(nn_convw_ok_(&f.m->layer[0]) && nn_convw_ok_(&f.m->layer[1]) && f.m->layer[1].needs_dx);
    same_bits_2_3_threads(&f);
    printf("# conv_winograd.c %dx%d, %s kernels: 2 and 3 threads give 1 thread's bits\n", K, K,
           loom_cpu_level_name(loom_cpu()->level));
    fixture_free(&f);
}

static void test_convw_threads(void) { convw_threads(5); }
static void test_convw3_threads(void) { convw_threads(3); }


static const loom_test tests[] = {
    {"conv2d + max_pool2d fused", test_fused_conv_pool},
    {"direct conv kernels: same bits at every CPU level", test_conv1_levels},
    {"conv_direct.c 5x5 / 7x7 against im2col + GEMM, same bits at every CPU level", test_convd_levels},
    {"conv_direct.c: same bits with 1, 2 and 3 threads", test_convd_threads},
    {"conv_winograd.c F(2x2, 5x5), F(4x4, 3x3) against a double sum, same bits at every CPU level", test_convw_levels},
    {"conv_winograd.c: same bits with 1, 2 and 3 threads", test_convw_threads},
    {"conv_winograd.c 3x3: same bits with 1, 2 and 3 threads", test_convw3_threads},
    {"narrow-input conv kernels: same bits at every CPU level, close to im2col + GEMM", test_convs_levels},
    {"a wide conv's im2col chunk holds 1024 output pixels", test_conv_chunk_rows},
    {0},
};

int main(void) { return nn_test_main(tests); }
