/* device_cpu.c - the built-in CPU device backend: the reference the GPU
 * backends are tested against, so it is written for obviousness (plain
 * loops, gemm through loom_sgemm), not speed; nn keeps its own tuned kernels.
 * Memory is host memory, copies are memcpy and every stream is synchronous. */
#include "tensor/device.h"

#include <float.h>
#include <math.h>
#include <string.h>

struct loom_device {
    int unused;
};
static loom_device cpu_dev;

static int cpu_probe(char *why, size_t why_n)
{
    if (why && why_n) why[0] = '\0';
    return 1;
}

static void cpu_describe(int device, char *buf, size_t n)
{
    (void)device;
    snprintf(buf, n, "%d cores, BLAS: OpenBLAS (%s)", loom_num_cores(), loom_blas_core());
}

static int cpu_open(loom_device **out, int device, loom_err *err)
{
    if (device != 0)
        return loom_err_set(err, LOOM_EUNSUPPORTED, NULL, "the cpu backend has one device, not %d", device);
    *out = &cpu_dev;
    return LOOM_OK;
}

static void cpu_close(loom_device *d) { (void)d; }

static int cpu_alloc(loom_device *d, void **out, size_t bytes, loom_err *err)
{
    (void)d;
    *out = loom_alloc_aligned(bytes ? bytes : 1);
    return *out ? LOOM_OK : loom_err_set(err, LOOM_ENOMEM, NULL, "out of memory allocating %zu bytes", bytes);
}

static void cpu_free(loom_device *d, void *p)
{
    (void)d;
    loom_free(p);
}

static int cpu_copy(loom_device *d, int stream, void *dst, const void *src, size_t bytes, loom_err *err)
{
    (void)d, (void)stream, (void)err;
    memcpy(dst, src, bytes);
    return LOOM_OK;
}

static int cpu_stream_wait(loom_device *d, int waiter, int signaller, loom_err *err)
{
    (void)d, (void)waiter, (void)signaller, (void)err;
    return LOOM_OK;
}

static int cpu_synchronize(loom_device *d, int stream, loom_err *err)
{
    (void)d, (void)stream, (void)err;
    return LOOM_OK;
}

static int cpu_gemm(loom_device *d, bool ta, bool tb, int M, int N, int K, float alpha, const float *A, int lda,
                    const float *B, int ldb, float beta, float *C, int ldc, loom_err *err)
{
    (void)d, (void)err;
    loom_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return LOOM_OK;
}

static int cpu_binary(loom_device *d, loom_dev_binop op, int64_t n, const float *a, const float *b, float *out,
                      loom_err *err)
{
    (void)d, (void)err;
    for (int64_t i = 0; i < n; i++)
        out[i] = op == LOOM_DEV_ADD ? a[i] + b[i] : op == LOOM_DEV_SUB ? a[i] - b[i] : a[i] * b[i];
    return LOOM_OK;
}

static int cpu_axpy(loom_device *d, int64_t n, float alpha, const float *x, float *y, loom_err *err)
{
    (void)d, (void)err;
    for (int64_t i = 0; i < n; i++) y[i] += alpha * x[i];
    return LOOM_OK;
}

static int cpu_scale(loom_device *d, int64_t n, float alpha, float *x, loom_err *err)
{
    (void)d, (void)err;
    for (int64_t i = 0; i < n; i++) x[i] *= alpha;
    return LOOM_OK;
}

static float act(loom_dev_act a, float v)
{
    switch (a) {
    case LOOM_DEV_ACT_RELU:
        return v > 0.f ? v : 0.f;
    case LOOM_DEV_ACT_SIGMOID:
        return 1.f / (1.f + expf(-v));
    case LOOM_DEV_ACT_TANH:
        return tanhf(v);
    default:
        return v;
    }
}

static int cpu_bias_act(loom_device *d, loom_dev_act a, int64_t rows, int64_t cols, const float *bias, float *x,
                        loom_err *err)
{
    (void)d, (void)err;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) x[r * cols + c] = act(a, x[r * cols + c] + (bias ? bias[c] : 0.f));
    return LOOM_OK;
}

static int cpu_act_backward(loom_device *d, loom_dev_act a, int64_t n, const float *y, float *g, loom_err *err)
{
    (void)d, (void)err;
    for (int64_t i = 0; i < n; i++) {
        float v = y[i];
        g[i] *= a == LOOM_DEV_ACT_RELU      ? (v > 0.f)
                : a == LOOM_DEV_ACT_SIGMOID ? v * (1.f - v)
                : a == LOOM_DEV_ACT_TANH    ? 1.f - v * v
                                            : 1.f;
    }
    return LOOM_OK;
}

static int cpu_bias_grad(loom_device *d, int64_t rows, int64_t cols, const float *g, float *db, loom_err *err)
{
    (void)d, (void)err;
    for (int64_t c = 0; c < cols; c++) {
        float s = 0.f;
        for (int64_t r = 0; r < rows; r++) s += g[r * cols + c];
        db[c] = s;
    }
    return LOOM_OK;
}

static int cpu_reduce(loom_device *d, loom_dev_reduce op, int64_t n, const float *x, float *out, loom_err *err)
{
    (void)d, (void)err;
    double s = op == LOOM_DEV_SUM ? 0. : x[0];
    for (int64_t i = op == LOOM_DEV_SUM ? 0 : 1; i < n; i++) s = op == LOOM_DEV_SUM ? s + x[i] : fmax(s, x[i]);
    *out = (float)s;
    return LOOM_OK;
}

static int cpu_softmax_xent(loom_device *d, int64_t rows, int64_t classes, const float *z, const int32_t *labels,
                            float scale, float *loss, int32_t *hit, float *g, loom_err *err)
{
    (void)d, (void)err;
    for (int64_t r = 0; r < rows; r++) {
        const float *zr = z + r * classes;
        int64_t am = 0;
        for (int64_t j = 1; j < classes; j++) am = zr[j] > zr[am] ? j : am;
        float mx = zr[am], s = 0.f;
        for (int64_t j = 0; j < classes; j++) s += expf(zr[j] - mx);
        loss[r] = logf(s) + mx - zr[labels[r]];
        hit[r] = am == labels[r];
        if (!g) continue;
        for (int64_t j = 0; j < classes; j++) g[r * classes + j] = (expf(zr[j] - mx) / s - (j == labels[r])) * scale;
    }
    return LOOM_OK;
}

/* col (batch*oh*ow, kh*kw*c), columns in kernel order (i, j, c). */
static void im2col(const loom_dev_window *g, const float *x, float *col)
{
    int64_t K = (int64_t)g->kh * g->kw * g->c, row = 0;
    for (int b = 0; b < g->batch; b++)
        for (int oy = 0; oy < g->oh; oy++)
            for (int ox = 0; ox < g->ow; ox++, row++)
                for (int i = 0; i < g->kh; i++)
                    for (int j = 0; j < g->kw; j++)
                        for (int c = 0; c < g->c; c++) {
                            int yy = oy * g->sh - g->pad_t + i, xx = ox * g->sw - g->pad_l + j;
                            bool in = yy >= 0 && yy < g->h && xx >= 0 && xx < g->w;
                            col[row * K + ((int64_t)i * g->kw + j) * g->c + c] =
                                in ? x[(((int64_t)b * g->h + yy) * g->w + xx) * g->c + c] : 0.f;
                        }
}

/* dx = col2im(col): every column entry added back to the pixel it came from. */
static void col2im(const loom_dev_window *g, const float *col, float *dx)
{
    int64_t K = (int64_t)g->kh * g->kw * g->c, row = 0;
    memset(dx, 0, sizeof(float) * (size_t)g->batch * g->h * g->w * g->c);
    for (int b = 0; b < g->batch; b++)
        for (int oy = 0; oy < g->oh; oy++)
            for (int ox = 0; ox < g->ow; ox++, row++)
                for (int i = 0; i < g->kh; i++)
                    for (int j = 0; j < g->kw; j++)
                        for (int c = 0; c < g->c; c++) {
                            int yy = oy * g->sh - g->pad_t + i, xx = ox * g->sw - g->pad_l + j;
                            if (yy < 0 || yy >= g->h || xx < 0 || xx >= g->w) continue;
                            dx[(((int64_t)b * g->h + yy) * g->w + xx) * g->c + c] +=
                                col[row * K + ((int64_t)i * g->kw + j) * g->c + c];
                        }
}

static int cpu_conv2d_forward(loom_device *d, const loom_dev_window *g, const float *x, const float *w, const float *b,
                              float *y, float *col, loom_err *err)
{
    int M = g->batch * g->oh * g->ow, K = g->kh * g->kw * g->c;
    im2col(g, x, col);
    loom_sgemm(false, false, M, g->cout, K, 1.f, col, K, w, g->cout, 0.f, y, g->cout);
    return cpu_bias_act(d, LOOM_DEV_ACT_NONE, M, g->cout, b, y, err);
}

static int cpu_conv2d_backward(loom_device *d, const loom_dev_window *g, const float *x, const float *w,
                               const float *dy, float *dx, float *dw, float *db, float *col, loom_err *err)
{
    int M = g->batch * g->oh * g->ow, K = g->kh * g->kw * g->c;
    im2col(g, x, col);
    loom_sgemm(true, false, K, g->cout, M, 1.f, col, K, dy, g->cout, 0.f, dw, g->cout);
    cpu_bias_grad(d, M, g->cout, dy, db, err);
    if (!dx) return LOOM_OK;
    loom_sgemm(false, true, M, K, g->cout, 1.f, dy, g->cout, w, g->cout, 0.f, col, K);
    col2im(g, col, dx);
    return LOOM_OK;
}

static int cpu_maxpool_forward(loom_device *d, const loom_dev_window *g, const float *x, float *y, int32_t *argmax,
                               loom_err *err)
{
    (void)d, (void)err;
    int64_t in = (int64_t)g->h * g->w * g->c, o = 0;
    for (int b = 0; b < g->batch; b++)
        for (int oy = 0; oy < g->oh; oy++)
            for (int ox = 0; ox < g->ow; ox++)
                for (int c = 0; c < g->c; c++, o++) {
                    int32_t best = -1;
                    for (int i = 0; i < g->kh; i++)
                        for (int j = 0; j < g->kw; j++) {
                            int yy = oy * g->sh - g->pad_t + i, xx = ox * g->sw - g->pad_l + j;
                            if (yy < 0 || yy >= g->h || xx < 0 || xx >= g->w) continue;
                            int32_t at = (yy * g->w + xx) * g->c + c;
                            if (best < 0 || x[b * in + at] > x[b * in + best]) best = at;
                        }
                    LOOM_ASSERT(best >= 0); /* every window overlaps the image */
                    y[o] = x[b * in + best];
                    argmax[o] = best;
                }
    return LOOM_OK;
}

static int cpu_maxpool_backward(loom_device *d, const loom_dev_window *g, const float *dy, const int32_t *argmax,
                                float *dx, loom_err *err)
{
    (void)d, (void)err;
    int64_t in = (int64_t)g->h * g->w * g->c, out = (int64_t)g->oh * g->ow * g->c;
    memset(dx, 0, sizeof(float) * (size_t)(g->batch * in));
    for (int b = 0; b < g->batch; b++)
        for (int64_t k = 0; k < out; k++) dx[b * in + argmax[b * out + k]] += dy[b * out + k];
    return LOOM_OK;
}

static int cpu_copy2d(loom_device *d, int64_t rows, int64_t cols, const float *x, int64_t ldx, float *out, int64_t ldo,
                      loom_err *err)
{
    (void)d, (void)err;
    for (int64_t r = 0; r < rows; r++) memcpy(out + r * ldo, x + r * ldx, (size_t)cols * sizeof *out);
    return LOOM_OK;
}

static const loom_device_ops cpu_ops = {
    .version = LOOM_DEVICE_OPS_VERSION,
    .name = "cpu",
    .probe = cpu_probe,
    .describe = cpu_describe,
    .open = cpu_open,
    .close = cpu_close,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .host_alloc = cpu_alloc,
    .host_free = cpu_free,
    .upload = cpu_copy,
    .download = cpu_copy,
    .stream_wait = cpu_stream_wait,
    .synchronize = cpu_synchronize,
    .gemm = cpu_gemm,
    .binary = cpu_binary,
    .axpy = cpu_axpy,
    .scale = cpu_scale,
    .bias_act = cpu_bias_act,
    .act_backward = cpu_act_backward,
    .bias_grad = cpu_bias_grad,
    .reduce = cpu_reduce,
    .softmax_xent = cpu_softmax_xent,
    .conv2d_forward = cpu_conv2d_forward,
    .conv2d_backward = cpu_conv2d_backward,
    .maxpool_forward = cpu_maxpool_forward,
    .maxpool_backward = cpu_maxpool_backward,
    .copy2d = cpu_copy2d,
};

const loom_device_ops *loom_device_cpu(void) { return &cpu_ops; }
