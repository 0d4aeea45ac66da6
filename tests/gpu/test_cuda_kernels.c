/* test_cuda_kernels.c - every op of a device backend against the CPU
 * reference (appliance/tensor/device_cpu.c) on random inputs of odd sizes:
 * gemm (all transposes), element-wise ops, bias + activation and its
 * gradient, bias gradients, reductions, softmax cross-entropy, convolution
 * and max pooling forward and backward, and a double-buffered upload
 * (copy stream) overlapped with gemm (compute stream).
 * The backend under test is the cuda plugin (LOOM_BUILD_ROOT/plugins/cuda.so);
 * without a usable GPU the test exits 77 (skip) saying why. With
 * LOOM_DEVICE_UNDER_TEST=cpu it runs the CPU backend against itself, which
 * checks this test's own plumbing on machines without a GPU. */
#include "harness.h"
#include "plugin/plugin.h"
#include "tensor/device.h"

#include <stdlib.h>

static const loom_device_ops *dut, *ref;
static loom_device *dd, *rd;
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static float frand(void) /* uniform in [-1, 1) */
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rng_state >> 40) * (1.0 / (1 << 24))) * 2.f - 1.f;
}

static float *host_rand(int64_t n)
{
    float *p = malloc(sizeof(float) * (size_t)(n ? n : 1));
    for (int64_t i = 0; i < n; i++) p[i] = frand();
    return p;
}

/* A device copy of n floats (or int32s) of host memory. */
static void *up(const void *h, size_t bytes)
{
    void *d = NULL;
    loom_err err = {0};
    if (dut->alloc(dd, &d, bytes, &err) || dut->upload(dd, LOOM_DEV_STREAM_COMPUTE, d, h, bytes, &err) ||
        dut->synchronize(dd, -1, &err)) {
        printf("# upload of %zu bytes: %s\n", bytes, err.msg);
        abort();
    }
    return d;
}

static void *dzeros(size_t bytes)
{
    void *z = calloc(1, bytes), *d = up(z, bytes);
    free(z);
    return d;
}

static void down(void *h, const void *d, size_t bytes)
{
    loom_err err = {0};
    int rc = dut->download(dd, LOOM_DEV_STREAM_COMPUTE, h, d, bytes, &err);
    if (!rc) rc = dut->synchronize(dd, -1, &err);
    CHECK_MSG(rc == 0, "download: %s", err.msg);
}

/* The device result d (n floats) equals the reference r within rtol of its magnitude. */
static void same(const char *what, const float *r, const void *d, int64_t n, double rtol)
{
    float *h = malloc(sizeof(float) * (size_t)(n ? n : 1));
    down(h, d, sizeof(float) * (size_t)n);
    int bad = 0;
    for (int64_t i = 0; i < n && bad < 3; i++)
        if (!(fabs((double)h[i] - r[i]) <= rtol * (1 + fabs(r[i])))) {
            printf("#   %s[%lld]: device %.9g, cpu %.9g\n", what, (long long)i, h[i], r[i]);
            bad++;
        }
    CHECK_MSG(!bad, "%s differs from the CPU reference", what);
    free(h);
}

static void same_i32(const char *what, const int32_t *r, const void *d, int64_t n)
{
    int32_t *h = malloc(sizeof(int32_t) * (size_t)n);
    down(h, d, sizeof(int32_t) * (size_t)n);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) bad += h[i] != r[i];
    CHECK_MSG(!bad, "%s: %lld of %lld differ", what, (long long)bad, (long long)n);
    free(h);
}

#define OK(call)                                                                                                       \
    do {                                                                                                               \
        loom_err err_ = {0};                                                                                           \
        int rc_ = (call);                                                                                              \
        CHECK_MSG(rc_ == 0, "%s: %s", #call, err_.msg);                                                                \
    } while (0)
/* The same op on both backends: f(backend, device, args...) with the reference's host pointers first. */
#define BOTH(op, rargs, dargs)                                                                                         \
    do {                                                                                                               \
        OK(ref->op rargs);                                                                                             \
        OK(dut->op dargs);                                                                                             \
    } while (0)

/* ---- cases ---------------------------------------------------------------- */

static void test_gemm(void)
{
    const int M = 37, N = 23, K = 51;
    for (int t = 0; t < 4; t++) {
        bool ta = t & 1, tb = t & 2;
        float *A = host_rand(M * K), *B = host_rand(K * N), *C = host_rand(M * N);
        void *dA = up(A, sizeof(float) * M * K), *dB = up(B, sizeof(float) * K * N), *dC = up(C, sizeof(float) * M * N);
        int lda = ta ? M : K, ldb = tb ? K : N;
        BOTH(gemm, (rd, ta, tb, M, N, K, 0.7f, A, lda, B, ldb, 0.3f, C, N, &err_),
             (dd, ta, tb, M, N, K, 0.7f, dA, lda, dB, ldb, 0.3f, dC, N, &err_));
        same(ta ? (tb ? "gemm TT" : "gemm TN") : (tb ? "gemm NT" : "gemm NN"), C, dC, M * N, 1e-4);
        dut->free(dd, dA), dut->free(dd, dB), dut->free(dd, dC);
        free(A), free(B), free(C);
    }
}

static void test_elementwise(void)
{
    const int64_t n = 1001;
    float *a = host_rand(n), *b = host_rand(n), *o = host_rand(n);
    void *da = up(a, sizeof(float) * n), *db = up(b, sizeof(float) * n), *dout = dzeros(sizeof(float) * n);
    static const char *const names[] = {"add", "sub", "mul"};
    for (int op = LOOM_DEV_ADD; op <= LOOM_DEV_MUL; op++) {
        BOTH(binary, (rd, op, n, a, b, o, &err_), (dd, op, n, da, db, dout, &err_));
        same(names[op], o, dout, n, 1e-6);
    }
    BOTH(axpy, (rd, n, -1.5f, a, b, &err_), (dd, n, -1.5f, da, db, &err_));
    same("axpy", b, db, n, 1e-6);
    BOTH(scale, (rd, n, 0.25f, b, &err_), (dd, n, 0.25f, db, &err_));
    same("scale", b, db, n, 1e-6);
    dut->free(dd, da), dut->free(dd, db), dut->free(dd, dout);
    free(a), free(b), free(o);
}

static void test_bias_act(void)
{
    const int64_t rows = 29, cols = 17, n = rows * cols;
    static const char *const names[] = {"bias_act none", "bias_act relu", "bias_act sigmoid", "bias_act tanh"};
    for (int a = LOOM_DEV_ACT_NONE; a <= LOOM_DEV_ACT_TANH; a++) {
        float *x = host_rand(n), *bias = host_rand(cols), *g = host_rand(n);
        void *dx = up(x, sizeof(float) * n), *dbias = up(bias, sizeof(float) * cols), *dg = up(g, sizeof(float) * n);
        BOTH(bias_act, (rd, a, rows, cols, a == 0 ? NULL : bias, x, &err_),
             (dd, a, rows, cols, a == 0 ? NULL : dbias, dx, &err_));
        same(names[a], x, dx, n, 1e-5);
        BOTH(act_backward, (rd, a, n, x, g, &err_), (dd, a, n, dx, dg, &err_));
        same("act_backward", g, dg, n, 1e-5);
        dut->free(dd, dx), dut->free(dd, dbias), dut->free(dd, dg);
        free(x), free(bias), free(g);
    }
}

static void test_bias_grad(void)
{
    const int64_t rows = 67, cols = 13;
    float *g = host_rand(rows * cols), db[13];
    void *dg = up(g, sizeof(float) * rows * cols), *ddb = dzeros(sizeof db);
    BOTH(bias_grad, (rd, rows, cols, g, db, &err_), (dd, rows, cols, dg, ddb, &err_));
    same("bias_grad", db, ddb, cols, 1e-5);
    dut->free(dd, dg), dut->free(dd, ddb);
    free(g);
}

static void test_reduce(void)
{
    static const int64_t sizes[] = {1, 1000, 100003};
    for (int k = 0; k < 3; k++) {
        int64_t n = sizes[k];
        float *x = host_rand(n), out;
        void *dx = up(x, sizeof(float) * (size_t)n), *dout = dzeros(sizeof(float));
        BOTH(reduce, (rd, LOOM_DEV_SUM, n, x, &out, &err_), (dd, LOOM_DEV_SUM, n, dx, dout, &err_));
        same("reduce sum", &out, dout, 1, 1e-5);
        BOTH(reduce, (rd, LOOM_DEV_MAX, n, x, &out, &err_), (dd, LOOM_DEV_MAX, n, dx, dout, &err_));
        same("reduce max", &out, dout, 1, 0);
        dut->free(dd, dx), dut->free(dd, dout);
        free(x);
    }
}

static void test_softmax_xent(void)
{
    const int64_t rows = 33, classes = 10;
    float *z = host_rand(rows * classes), *g = host_rand(rows * classes), loss[33];
    int32_t labels[33], hit[33];
    for (int r = 0; r < rows; r++) labels[r] = (r * 7) % (int)classes, z[r * classes + labels[r]] += (r % 3) * 0.8f;
    void *dz = up(z, sizeof(float) * rows * classes), *dl = up(labels, sizeof labels);
    void *dloss = dzeros(sizeof loss), *dhit = dzeros(sizeof hit), *dg = dzeros(sizeof(float) * rows * classes);
    for (int with_g = 0; with_g < 2; with_g++) {
        BOTH(softmax_xent, (rd, rows, classes, z, labels, 1.f / 64, loss, hit, with_g ? g : NULL, &err_),
             (dd, rows, classes, dz, dl, 1.f / 64, dloss, dhit, with_g ? dg : NULL, &err_));
        same("softmax_xent loss", loss, dloss, rows, 1e-5);
        same_i32("softmax_xent hit", hit, dhit, rows);
    }
    same("softmax_xent gradient", g, dg, rows * classes, 1e-5);
    dut->free(dd, dz), dut->free(dd, dl), dut->free(dd, dloss), dut->free(dd, dhit), dut->free(dd, dg);
    free(z), free(g);
}

/* NHWC geometry of a k x k window with stride s, SAME or VALID as TF pads. */
static loom_dev_window window(int batch, int h, int w, int c, int k, int s, bool same_pad, int cout)
{
    loom_dev_window g = {.batch = batch, .h = h, .w = w, .c = c, .kh = k, .kw = k, .sh = s, .sw = s, .cout = cout};
    g.oh = same_pad ? (h + s - 1) / s : (h - k) / s + 1;
    g.ow = same_pad ? (w + s - 1) / s : (w - k) / s + 1;
    if (same_pad) {
        int ph = (g.oh - 1) * s + k - h, pw = (g.ow - 1) * s + k - w;
        g.pad_t = ph > 0 ? ph / 2 : 0, g.pad_l = pw > 0 ? pw / 2 : 0;
    }
    return g;
}

static void conv_case(loom_dev_window g)
{
    int64_t nx = (int64_t)g.batch * g.h * g.w * g.c, K = (int64_t)g.kh * g.kw * g.c, nw = K * g.cout;
    int64_t ny = (int64_t)g.batch * g.oh * g.ow * g.cout, ncol = (int64_t)g.batch * g.oh * g.ow * K;
    float *x = host_rand(nx), *w = host_rand(nw), *b = host_rand(g.cout), *y = host_rand(ny), *col = host_rand(ncol);
    float *dy = host_rand(ny), *dx = host_rand(nx), *dw = host_rand(nw), *db = host_rand(g.cout);
    void *gx = up(x, sizeof(float) * nx), *gw = up(w, sizeof(float) * nw), *gb = up(b, sizeof(float) * g.cout);
    void *gy = dzeros(sizeof(float) * ny), *gcol = dzeros(sizeof(float) * ncol), *gdy = up(dy, sizeof(float) * ny);
    void *gdx = dzeros(sizeof(float) * nx), *gdw = dzeros(sizeof(float) * nw), *gdb = dzeros(sizeof(float) * g.cout);
    BOTH(conv2d_forward, (rd, &g, x, w, b, y, col, &err_), (dd, &g, gx, gw, gb, gy, gcol, &err_));
    same("conv2d_forward", y, gy, ny, 1e-4);
    BOTH(conv2d_backward, (rd, &g, x, w, dy, dx, dw, db, col, &err_),
         (dd, &g, gx, gw, gdy, gdx, gdw, gdb, gcol, &err_));
    same("conv2d_backward dx", dx, gdx, nx, 1e-4);
    same("conv2d_backward dw", dw, gdw, nw, 1e-4);
    same("conv2d_backward db", db, gdb, g.cout, 1e-4);
    BOTH(conv2d_backward, (rd, &g, x, w, dy, NULL, dw, db, col, &err_),
         (dd, &g, gx, gw, gdy, NULL, gdw, gdb, gcol, &err_));
    same("conv2d_backward dw (no dx)", dw, gdw, nw, 1e-4);
    void *all[] = {gx, gw, gb, gy, gcol, gdy, gdx, gdw, gdb};
    for (int i = 0; i < 9; i++) dut->free(dd, all[i]);
    free(x), free(w), free(b), free(y), free(col), free(dy), free(dx), free(dw), free(db);
}

static void test_conv2d(void)
{
    conv_case(window(3, 9, 8, 2, 3, 1, true, 5));
    conv_case(window(2, 10, 10, 3, 5, 2, false, 4));
    conv_case(window(2, 7, 7, 1, 4, 3, true, 3)); /* even kernel: padding only on one side */
}

static void pool_case(loom_dev_window g)
{
    int64_t nx = (int64_t)g.batch * g.h * g.w * g.c, ny = (int64_t)g.batch * g.oh * g.ow * g.c;
    float *x = host_rand(nx), *y = host_rand(ny), *dy = host_rand(ny), *dx = host_rand(nx);
    int32_t *am = calloc((size_t)ny, sizeof *am);
    x[0] = x[1]; /* a tie: the first position wins on both */
    void *gx = up(x, sizeof(float) * nx), *gy = dzeros(sizeof(float) * ny), *gam = dzeros(sizeof(int32_t) * ny);
    void *gdy = up(dy, sizeof(float) * ny), *gdx = dzeros(sizeof(float) * nx);
    BOTH(maxpool_forward, (rd, &g, x, y, am, &err_), (dd, &g, gx, gy, gam, &err_));
    same("maxpool_forward", y, gy, ny, 0);
    same_i32("maxpool_forward argmax", am, gam, ny);
    BOTH(maxpool_backward, (rd, &g, dy, am, dx, &err_), (dd, &g, gdy, gam, gdx, &err_));
    same("maxpool_backward", dx, gdx, nx, 1e-6);
    dut->free(dd, gx), dut->free(dd, gy), dut->free(dd, gam), dut->free(dd, gdy), dut->free(dd, gdx);
    free(x), free(y), free(dy), free(dx), free(am);
}

static void test_maxpool(void)
{
    pool_case((loom_dev_window){2, 8, 8, 3, 2, 2, 2, 2, 0, 0, 4, 4, 3});
    loom_dev_window g = window(3, 7, 7, 2, 3, 2, true, 2); /* overlapping windows, SAME padding */
    pool_case(g);
}

/* The stager (tensor/device.c) uploads batch k+1 on the copy stream while
 * batch k's gemm runs on the compute stream; every result must be that of
 * its own batch. */
static void test_double_buffered_upload(void)
{
    enum { BATCHES = 5, M = 64, K = 48, N = 32 };
    float *W = host_rand(K * N), *X[BATCHES], ref_out[M * N];
    void *dW = up(W, sizeof(float) * K * N), *dY[BATCHES];
    loom_dev_stager *st = NULL;
    OK(loom_dev_stager_open(&st, dut, dd, sizeof(float) * M * K, &err_));
    if (!st) return;
    for (int k = 0; k < BATCHES; k++) X[k] = host_rand(M * K), dY[k] = dzeros(sizeof(float) * M * N);
    OK(loom_dev_stager_put(st, X[0], sizeof(float) * M * K, &err_));
    for (int k = 0; k < BATCHES; k++) {
        void *x = NULL;
        if (k + 1 < BATCHES) OK(loom_dev_stager_put(st, X[k + 1], sizeof(float) * M * K, &err_));
        OK(loom_dev_stager_take(st, &x, &err_));
        OK(dut->gemm(dd, false, false, M, N, K, 1.f, x, K, dW, N, 0.f, dY[k], N, &err_));
    }
    OK(dut->synchronize(dd, -1, &err_));
    for (int k = 0; k < BATCHES; k++) {
        loom_sgemm(false, false, M, N, K, 1.f, X[k], K, W, N, 0.f, ref_out, N);
        same("double-buffered gemm", ref_out, dY[k], M * N, 1e-4);
        dut->free(dd, dY[k]);
        free(X[k]);
    }
    loom_dev_stager_close(st);
    dut->free(dd, dW);
    free(W);
}

/* Bad requests fail with a message, never a crash. */
static void test_errors(void)
{
    loom_device *d = NULL;
    loom_err err = {0};
    CHECK(dut->open(&d, 1000, &err) != 0);
    CHECK(err.msg[0] != '\0');
    memset(&err, 0, sizeof err);
    CHECK(dut->synchronize(dd, 7, &err) != 0 || !strcmp(dut->name, "cpu"));
}

static const loom_test tests[] = {
    {"gemm", test_gemm},
    {"elementwise", test_elementwise},
    {"bias_act", test_bias_act},
    {"bias_grad", test_bias_grad},
    {"reduce", test_reduce},
    {"softmax_xent", test_softmax_xent},
    {"conv2d", test_conv2d},
    {"maxpool", test_maxpool},
    {"double_buffered_upload", test_double_buffered_upload},
    {"errors", test_errors},
    {0},
};

int main(void)
{
    loom_err err = {0};
    const char *which = getenv("LOOM_DEVICE_UNDER_TEST"), *root = getenv("LOOM_BUILD_ROOT");
    ref = loom_device_cpu();
    if (loom_blas_init(1, &err) || ref->open(&rd, 0, &err)) {
        printf("Bail out! %s\n", err.msg);
        return 1;
    }
    if (which && !strcmp(which, "cpu")) {
        dut = ref;
    } else {
        char path[4096];
        snprintf(path, sizeof path, "%s/plugins/cuda.so", root ? root : "build");
        if (loom_plugin_load_file(path, NULL, &err)) {
            printf("Bail out! %s: %s\n", path, err.msg);
            return 1;
        }
        dut = loom_device_backend("cuda");
        char why[400];
        if (!dut) {
            printf("Bail out! the cuda plugin registered no device backend\n");
            return 1;
        }
        if (dut->probe(why, sizeof why) == 0) {
            /* what can be checked without a device: open says why, no crash */
            int rc = dut->open(&dd, 0, &err);
            if (!rc || !strstr(err.msg, why)) {
                printf("Bail out! without a device, open gave %d \"%s\" (probe: \"%s\")\n", rc, err.msg, why);
                return 1;
            }
            printf("1..0 # SKIP %s\n", why);
            return 77;
        }
    }
    if (dut->open(&dd, 0, &err)) {
        printf("Bail out! opening %s device 0: %s\n", dut->name, err.msg);
        return 1;
    }
    int rc = loom_test_run(tests);
    dut->close(dd);
    return rc;
}
