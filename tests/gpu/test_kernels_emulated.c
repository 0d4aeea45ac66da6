/* test_kernels_emulated.c - the cuda plugin's kernels, run on the host by
 * kernels_emulated.cpp, against the CPU reference backend: every launcher
 * of plugins/cuda/kernels.h, and convolution assembled from im2col /
 * col2im and a gemm exactly as plugins/cuda/cuda.c assembles it. This is
 * the part of the GPU code that runs on machines without a GPU; cuBLAS,
 * streams and the real parallel launch run only in test_cuda_kernels. */
#include "harness.h"
#include "kernels.h"
#include "tensor/device.h"

#include <stdlib.h>

static const loom_device_ops *cpu;
static loom_device *d;
static uint64_t rng_state = 777;

static float frand(void)
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rng_state >> 40) * (1.0 / (1 << 24))) * 2.f - 1.f;
}

static float *rnd(int64_t n)
{
    float *p = malloc(sizeof(float) * (size_t)(n ? n : 1));
    for (int64_t i = 0; i < n; i++) p[i] = frand();
    return p;
}

static float *copy(const float *x, int64_t n)
{
    float *p = malloc(sizeof(float) * (size_t)n);
    memcpy(p, x, sizeof(float) * (size_t)n);
    return p;
}

static void same(const char *what, const float *want, const float *got, int64_t n, double rtol)
{
    int bad = 0;
    for (int64_t i = 0; i < n && bad < 3; i++)
        if (!(fabs((double)got[i] - want[i]) <= rtol * (1 + fabs(want[i])))) {
            printf("#   %s[%lld]: kernel %.9g, cpu %.9g\n", what, (long long)i, got[i], want[i]);
            bad++;
        }
    CHECK_MSG(!bad, "%s differs from the CPU reference", what);
}

#define REF(call)                                                                                                      \
    do {                                                                                                               \
        loom_err err_ = {0};                                                                                           \
        CHECK(cpu->call == 0);                                                                                         \
        (void)err_;                                                                                                    \
    } while (0)

static void test_elementwise(void)
{
    const int64_t n = 1003; /* more than the 15 emulated threads, and not a multiple of them */
    float *a = rnd(n), *b = rnd(n), want[1003], got[1003];
    for (int op = LOOM_DEV_ADD; op <= LOOM_DEV_MUL; op++) {
        REF(binary(d, op, n, a, b, want, &err_));
        CHECK(lk_binary(NULL, op, n, a, b, got) == cudaSuccess);
        same("binary", want, got, n, 0);
    }
    float *y1 = copy(b, n), *y2 = copy(b, n);
    REF(axpy(d, n, 0.3f, a, y1, &err_));
    lk_axpy(NULL, n, 0.3f, a, y2);
    same("axpy", y1, y2, n, 0);
    REF(scale(d, n, -2.5f, y1, &err_));
    lk_scale(NULL, n, -2.5f, y2);
    same("scale", y1, y2, n, 0);
    free(a), free(b), free(y1), free(y2);
}

static void test_bias_act_and_gradients(void)
{
    const int64_t rows = 19, cols = 11, n = rows * cols;
    for (int a = LOOM_DEV_ACT_NONE; a <= LOOM_DEV_ACT_TANH; a++) {
        float *x1 = rnd(n), *bias = rnd(cols), *g1 = rnd(n);
        float *x2 = copy(x1, n), *g2 = copy(g1, n), db1[11], db2[11];
        REF(bias_act(d, a, rows, cols, bias, x1, &err_));
        lk_bias_act(NULL, a, rows, cols, bias, x2);
        same("bias_act", x1, x2, n, 1e-6);
        REF(act_backward(d, a, n, x1, g1, &err_));
        lk_act_backward(NULL, a, n, x1, g2);
        same("act_backward", g1, g2, n, 1e-6);
        REF(bias_grad(d, rows, cols, g1, db1, &err_));
        lk_bias_grad(NULL, rows, cols, g1, db2);
        same("bias_grad", db1, db2, cols, 0);
        free(x1), free(x2), free(bias), free(g1), free(g2);
    }
}

static void test_reduce(void)
{
    static const int64_t sizes[] = {1, 17, 100003};
    for (int k = 0; k < 3; k++) {
        float *x = rnd(sizes[k]), want, got;
        for (int op = LOOM_DEV_SUM; op <= LOOM_DEV_MAX; op++) {
            REF(reduce(d, op, sizes[k], x, &want, &err_));
            lk_reduce(NULL, op, sizes[k], x, &got);
            same(op ? "reduce max" : "reduce sum", &want, &got, 1, op ? 0 : 1e-6);
        }
        free(x);
    }
}

static void test_softmax_xent(void)
{
    enum { R = 23, C = 10 };
    float *z = rnd(R * C), l1[R], l2[R], g1[R * C], g2[R * C];
    int32_t labels[R], h1[R], h2[R];
    for (int r = 0; r < R; r++) labels[r] = (r * 3) % C, z[r * C + labels[r]] += (r % 2) * 1.5f;
    REF(softmax_xent(d, R, C, z, labels, 0.125f, l1, h1, g1, &err_));
    lk_softmax_xent(NULL, R, C, z, labels, 0.125f, l2, h2, g2);
    same("softmax_xent loss", l1, l2, R, 1e-6);
    same("softmax_xent gradient", g1, g2, R * C, 1e-6);
    CHECK(!memcmp(h1, h2, sizeof h1));
    free(z);
}

/* Forward and backward as cuda.c does them: im2col, gemm, bias; col2im of dy w^T. */
static void conv_case(loom_dev_window g)
{
    int64_t nx = (int64_t)g.batch * g.h * g.w * g.c, K = (int64_t)g.kh * g.kw * g.c, nw = K * g.cout;
    int64_t M = (int64_t)g.batch * g.oh * g.ow, ny = M * g.cout;
    float *x = rnd(nx), *w = rnd(nw), *b = rnd(g.cout), *dy = rnd(ny);
    float *y1 = rnd(ny), *y2 = rnd(ny), *col = rnd(M * K), *dx1 = rnd(nx), *dx2 = rnd(nx), *dw = rnd(nw),
          *db = rnd(g.cout);
    REF(conv2d_forward(d, &g, x, w, b, y1, col, &err_));
    lk_im2col(NULL, (const kwin *)&g, x, col);
    loom_sgemm(false, false, (int)M, g.cout, (int)K, 1.f, col, (int)K, w, g.cout, 0.f, y2, g.cout);
    lk_bias_act(NULL, LOOM_DEV_ACT_NONE, M, g.cout, b, y2);
    same("conv2d forward (im2col)", y1, y2, ny, 1e-5);
    REF(conv2d_backward(d, &g, x, w, dy, dx1, dw, db, col, &err_));
    loom_sgemm(false, true, (int)M, (int)K, g.cout, 1.f, dy, g.cout, w, g.cout, 0.f, col, (int)K);
    lk_col2im(NULL, (const kwin *)&g, col, dx2);
    same("conv2d backward dx (col2im)", dx1, dx2, nx, 1e-5);
    free(x), free(w), free(b), free(dy), free(y1), free(y2), free(col), free(dx1), free(dx2), free(dw), free(db);
}

static void test_conv2d(void)
{
    conv_case((loom_dev_window){3, 9, 8, 2, 3, 3, 1, 1, 1, 1, 9, 8, 5});   /* SAME, stride 1 */
    conv_case((loom_dev_window){2, 10, 10, 3, 5, 5, 2, 2, 0, 0, 3, 3, 4}); /* VALID, stride 2 */
    conv_case((loom_dev_window){2, 7, 7, 1, 4, 4, 3, 3, 1, 1, 3, 3, 3});   /* even kernel, padding on one side */
}

static void pool_case(loom_dev_window g)
{
    int64_t nx = (int64_t)g.batch * g.h * g.w * g.c, ny = (int64_t)g.batch * g.oh * g.ow * g.c;
    float *x = rnd(nx), *y1 = rnd(ny), *y2 = rnd(ny), *dy = rnd(ny), *dx1 = rnd(nx), *dx2 = rnd(nx);
    int32_t *a1 = calloc((size_t)ny, 4), *a2 = calloc((size_t)ny, 4);
    x[1] = x[0] = 0.99f; /* a tie: the first position wins on both */
    REF(maxpool_forward(d, &g, x, y1, a1, &err_));
    lk_maxpool_forward(NULL, (const kwin *)&g, x, y2, a2);
    same("maxpool forward", y1, y2, ny, 0);
    CHECK(!memcmp(a1, a2, sizeof(int32_t) * (size_t)ny));
    REF(maxpool_backward(d, &g, dy, a1, dx1, &err_));
    lk_maxpool_backward(NULL, (const kwin *)&g, dy, a1, dx2);
    same("maxpool backward", dx1, dx2, nx, 1e-6);
    free(x), free(y1), free(y2), free(dy), free(dx1), free(dx2), free(a1), free(a2);
}

static void test_maxpool(void)
{
    pool_case((loom_dev_window){2, 8, 8, 3, 2, 2, 2, 2, 0, 0, 4, 4, 3});
    pool_case((loom_dev_window){3, 7, 7, 2, 3, 3, 2, 2, 1, 1, 4, 4, 2}); /* overlapping, SAME padding */
}

static const loom_test tests[] = {
    {"elementwise", test_elementwise},
    {"bias_act_and_gradients", test_bias_act_and_gradients},
    {"reduce", test_reduce},
    {"softmax_xent", test_softmax_xent},
    {"conv2d", test_conv2d},
    {"maxpool", test_maxpool},
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
