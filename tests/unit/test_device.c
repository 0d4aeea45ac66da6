/* test_device.c - the CPU device backend, the reference the GPU backends are
 * compared with (tests/gpu/), checked against independent math: convolution
 * against the direct sum, every backward against central finite
 * differences of its forward (caffe's GradientChecker), pooling's argmax
 * against a scan, the stager's order, and the gpu-availability report
 * without a cuda plugin. */
#include "harness.h"
#include "tensor/device.h"

#include <stdlib.h>

static const loom_device_ops *cpu;
static loom_device *d;
static uint64_t rng_state = 12345;

static float frand(void)
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rng_state >> 40) * (1.0 / (1 << 24))) * 2.f - 1.f;
}

static float *rnd(int64_t n)
{
    float *p = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) p[i] = frand();
    return p;
}

static double dot(const float *a, const float *b, int64_t n)
{
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += (double)a[i] * b[i];
    return s;
}

/* 3 examples of 6x5x2, 3x3 kernel, stride 2, SAME padding (1 above and left), 4 outputs. */
static const loom_dev_window G = {.batch = 3,
                                  .h = 6,
                                  .w = 5,
                                  .c = 2,
                                  .kh = 3,
                                  .kw = 3,
                                  .sh = 2,
                                  .sw = 2,
                                  .pad_t = 1,
                                  .pad_l = 1,
                                  .oh = 3,
                                  .ow = 3,
                                  .cout = 4};
enum { NX = 3 * 6 * 5 * 2, KK = 3 * 3 * 2, NW = KK * 4, NY = 3 * 3 * 3 * 4, NCOL = 3 * 3 * 3 * KK };

/* L = sum(conv(x, w, b) * r): linear in x, w and b, so dL/dx = conv_backward(dy = r). */
static double conv_loss(const float *x, const float *w, const float *b, const float *r)
{
    float y[NY], col[NCOL];
    loom_err err = {0};
    CHECK(cpu->conv2d_forward(d, &G, x, w, b, y, col, &err) == 0);
    return dot(y, r, NY);
}

static void test_conv_forward_is_the_direct_sum(void)
{
    float *x = rnd(NX), *w = rnd(NW), *b = rnd(4), y[NY], col[NCOL];
    loom_err err = {0};
    CHECK(cpu->conv2d_forward(d, &G, x, w, b, y, col, &err) == 0);
    for (int n = 0; n < G.batch; n++)
        for (int oy = 0; oy < G.oh; oy++)
            for (int ox = 0; ox < G.ow; ox++)
                for (int o = 0; o < G.cout; o++) {
                    double s = b[o];
                    for (int i = 0; i < G.kh; i++)
                        for (int j = 0; j < G.kw; j++)
                            for (int c = 0; c < G.c; c++) {
                                int yy = oy * G.sh - G.pad_t + i, xx = ox * G.sw - G.pad_l + j;
                                if (yy < 0 || yy >= G.h || xx < 0 || xx >= G.w) continue;
                                s += (double)x[((n * G.h + yy) * G.w + xx) * G.c + c] *
                                     w[((i * G.kw + j) * G.c + c) * G.cout + o];
                            }
                    CHECK_NEAR(y[((n * G.oh + oy) * G.ow + ox) * G.cout + o], s, 1e-5);
                }
    free(x), free(w), free(b);
}

static void test_conv_backward_matches_finite_differences(void)
{
    float *x = rnd(NX), *w = rnd(NW), *b = rnd(4), *r = rnd(NY), dx[NX], dw[NW], db[4], col[NCOL];
    loom_err err = {0};
    CHECK(cpu->conv2d_backward(d, &G, x, w, r, dx, dw, db, col, &err) == 0);
    const float eps = 1e-2f;
    for (int i = 0; i < NX; i += 7) {
        float v = x[i];
        x[i] = v + eps;
        double up = conv_loss(x, w, b, r);
        x[i] = v - eps;
        double dn = conv_loss(x, w, b, r);
        x[i] = v;
        CHECK_NEAR(dx[i], (up - dn) / (2 * eps), 2e-3);
    }
    for (int i = 0; i < NW; i += 5) {
        float v = w[i];
        w[i] = v + eps;
        double up = conv_loss(x, w, b, r);
        w[i] = v - eps;
        double dn = conv_loss(x, w, b, r);
        w[i] = v;
        CHECK_NEAR(dw[i], (up - dn) / (2 * eps), 2e-3);
    }
    for (int o = 0; o < 4; o++) {
        double s = 0;
        for (int k = o; k < NY; k += 4) s += r[k];
        CHECK_NEAR(db[o], s, 1e-4);
    }
    free(x), free(w), free(b), free(r);
}

static void test_maxpool_argmax_and_gradient(void)
{
    loom_dev_window g = G;
    g.cout = g.c; /* 3x3 windows, stride 2: overlapping, with padding */
    enum { NP = 3 * 3 * 3 * 2 };
    float *x = rnd(NX), y[NP], dx[NX], *dy = rnd(NP);
    int32_t am[NP];
    loom_err err = {0};
    CHECK(cpu->maxpool_forward(d, &g, x, y, am, &err) == 0);
    CHECK(cpu->maxpool_backward(d, &g, dy, am, dx, &err) == 0);
    double want_dx[NX] = {0};
    for (int k = 0; k < NP; k++) {
        int n = k / (NP / g.batch), c = k % g.c, ox = k / g.c % g.ow, oy = k / g.c / g.ow % g.oh;
        const float *xb = x + n * (NX / g.batch);
        float best = -1e30f;
        for (int yy = oy * 2 - 1; yy <= oy * 2 + 1; yy++)
            for (int xx = ox * 2 - 1; xx <= ox * 2 + 1; xx++)
                if (yy >= 0 && yy < g.h && xx >= 0 && xx < g.w && xb[(yy * g.w + xx) * g.c + c] > best)
                    best = xb[(yy * g.w + xx) * g.c + c];
        CHECK(y[k] == best && xb[am[k]] == best && am[k] % g.c == c);
        want_dx[n * (NX / g.batch) + am[k]] += dy[k];
    }
    for (int i = 0; i < NX; i++) CHECK_NEAR(dx[i], want_dx[i], 1e-6);
    free(x), free(dy);
}

static void test_softmax_xent_gradient(void)
{
    enum { R = 5, C = 7 };
    float *z = rnd(R * C), g[R * C], loss[R];
    int32_t labels[R] = {0, 6, 3, 3, 1}, hit[R];
    loom_err err = {0};
    const float scale = 0.25f, eps = 1e-2f;
    CHECK(cpu->softmax_xent(d, R, C, z, labels, scale, loss, hit, g, &err) == 0);
    for (int i = 0; i < R * C; i++) {
        float v = z[i], lu[R], ld[R];
        z[i] = v + eps;
        cpu->softmax_xent(d, R, C, z, labels, scale, lu, hit, NULL, &err);
        z[i] = v - eps;
        cpu->softmax_xent(d, R, C, z, labels, scale, ld, hit, NULL, &err);
        z[i] = v;
        double fd = 0;
        for (int r = 0; r < R; r++) fd += (lu[r] - ld[r]) * scale / (2 * eps);
        CHECK_NEAR(g[i], fd, 2e-3);
    }
    cpu->softmax_xent(d, R, C, z, labels, scale, loss, hit, NULL, &err);
    for (int r = 0; r < R; r++) {
        int am = 0;
        for (int j = 1; j < C; j++) am = z[r * C + j] > z[r * C + am] ? j : am;
        CHECK(hit[r] == (am == labels[r]));
        CHECK(loss[r] > 0.f);
    }
    free(z);
}

static void test_act_backward_matches_finite_differences(void)
{
    enum { N = 40 };
    for (int a = LOOM_DEV_ACT_NONE; a <= LOOM_DEV_ACT_TANH; a++) {
        float *x = rnd(N), y[N], g[N], up[N], dn[N];
        loom_err err = {0};
        const float eps = 1e-3f;
        for (int i = 0; i < N; i++) {
            if (fabsf(x[i]) < 2 * eps) x[i] = 0.1f; /* relu's kink */
            y[i] = x[i], up[i] = x[i] + eps, dn[i] = x[i] - eps, g[i] = 1.f;
        }
        cpu->bias_act(d, a, 1, N, NULL, y, &err);
        cpu->bias_act(d, a, 1, N, NULL, up, &err);
        cpu->bias_act(d, a, 1, N, NULL, dn, &err);
        CHECK(cpu->act_backward(d, a, N, y, g, &err) == 0);
        for (int i = 0; i < N; i++) CHECK_NEAR(g[i], (up[i] - dn[i]) / (2 * eps), 2e-3);
        free(x);
    }
}

static void test_gpus_without_the_plugin(void)
{
    char why[600];
    CHECK(loom_device_backend("cuda") == NULL);
    CHECK(loom_device_gpus(why, sizeof why) == 0);
    CHECK_CONTAINS(why, "the cuda plugin is not loaded");
    CHECK(cpu->probe(why, sizeof why) == 1);
}

/* Batches come out of the stager in the order they went in, each intact,
 * alternating between its two device buffers. */
static void test_stager_order(void)
{
    loom_dev_stager *st = NULL;
    loom_err err = {0};
    CHECK(loom_dev_stager_open(&st, cpu, d, 4 * sizeof(float), &err) == 0);
    if (!st) return;
    float batch[4];
    void *got[6] = {0};
    int taken = 0;
    for (int k = 0; k < 6; k++) {
        for (int i = 0; i < 4; i++) batch[i] = (float)(10 * k + i);
        CHECK(loom_dev_stager_put(st, batch, sizeof batch, &err) == 0);
        if (k == 0) continue; /* two in flight from here on */
        CHECK(loom_dev_stager_take(st, &got[taken], &err) == 0);
        const float *x = got[taken];
        CHECK(x[0] == 10.f * taken && x[3] == 10.f * taken + 3);
        taken++;
    }
    CHECK(loom_dev_stager_take(st, &got[taken], &err) == 0);
    CHECK(((const float *)got[taken])[2] == 52.f);
    CHECK(got[0] != got[1] && got[0] == got[2] && got[1] == got[5]);
    loom_dev_stager_close(st);
    loom_dev_stager_close(NULL);
}

static const loom_test tests[] = {
    {"stager_order", test_stager_order},
    {"conv_forward_is_the_direct_sum", test_conv_forward_is_the_direct_sum},
    {"conv_backward_matches_finite_differences", test_conv_backward_matches_finite_differences},
    {"maxpool_argmax_and_gradient", test_maxpool_argmax_and_gradient},
    {"softmax_xent_gradient", test_softmax_xent_gradient},
    {"act_backward_matches_finite_differences", test_act_backward_matches_finite_differences},
    {"gpus_without_the_plugin", test_gpus_without_the_plugin},
    {0},
};

int main(void)
{
    loom_err err = {0};
    cpu = loom_device_cpu();
    if (loom_blas_init(1, &err) || cpu->open(&d, 0, &err)) {
        printf("Bail out! %s\n", err.msg);
        return 1;
    }
    return loom_test_run(tests);
}
