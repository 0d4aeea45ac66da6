/* cuda.c - the cuda plugin: a device backend (loom_device_ops "cuda") over
 * the CUDA runtime, cuBLAS for matrix products and the kernels of
 * kernels.cu. Each open device has two streams: compute (kernels, cuBLAS)
 * and copy (uploads of the next batch while the current one computes,
 * ordered against compute by events, never host waits).
 * Linked against libcudart only: the runtime finds the driver (libcuda.so.1)
 * lazily at the first call, so without a driver or a GPU the plugin still
 * loads and registers, and probe() says what is missing. cuBLAS is opened
 * with dlopen when the first device opens: mapping it costs about 150 MB of
 * resident memory and tens of milliseconds, which every loom run would pay
 * at plugin load on machines that never use a GPU.
 * Threads: a loom_device is used by one thread at a time; every entry point
 * selects its device first (cudaSetDevice is per thread). */
#include "kernels.h"
#include "loom_plugin.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

static const loom_host *host;

struct loom_device {
    int id;
    cudaStream_t stream[2]; /* LOOM_DEV_STREAM_COMPUTE, LOOM_DEV_STREAM_COPY */
    cudaEvent_t ev;         /* stream_wait's marker */
    cublasHandle_t blas;
};

_Static_assert(LOOM_DEV_ADD == 0 && LOOM_DEV_SUB == 1 && LOOM_DEV_MUL == 2, "kernels.cu binary op codes");
_Static_assert(LOOM_DEV_ACT_RELU == 1 && LOOM_DEV_ACT_SIGMOID == 2 && LOOM_DEV_ACT_TANH == 3, "activation codes");
_Static_assert(LOOM_DEV_SUM == 0 && LOOM_DEV_MAX == 1, "reduce codes");
_Static_assert(sizeof(kwin) == sizeof(loom_dev_window), "kwin restates loom_dev_window");

/* ---- errors: the call, its file:line and the library's words ----------------- */

static int cuda_fail(loom_err *err, cudaError_t e, const char *call, int line)
{
    return host->err_set(err, LOOM_ECUDA, NULL, "%s failed at cuda.c:%d: %s (%s)", call, line, cudaGetErrorString(e),
                         cudaGetErrorName(e));
}

/* ---- cuBLAS, loaded on first use ------------------------------------------------ */

#define CUBLAS_SONAME "libcublas.so." CUDA_STR_(CUBLAS_VER_MAJOR)
#define CUDA_STR_(x) CUDA_STR2_(x)
#define CUDA_STR2_(x) #x

static struct {
    cublasStatus_t (*create)(cublasHandle_t *);
    cublasStatus_t (*destroy)(cublasHandle_t);
    cublasStatus_t (*set_stream)(cublasHandle_t, cudaStream_t);
    cublasStatus_t (*sgemm)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const float *,
                            const float *, int, const float *, int, const float *, float *, int);
    const char *(*status_string)(cublasStatus_t);
} blas;
static pthread_once_t blas_once = PTHREAD_ONCE_INIT;
static char blas_error[300];

static void blas_load(void)
{
    void *h = dlopen(CUBLAS_SONAME, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(blas_error, sizeof blas_error, "cannot load %s: %s", CUBLAS_SONAME, dlerror());
        return;
    }
    /* the _v2 entry points are what cublas_v2.h's names resolve to */
    *(void **)&blas.create = dlsym(h, "cublasCreate_v2");
    *(void **)&blas.destroy = dlsym(h, "cublasDestroy_v2");
    *(void **)&blas.set_stream = dlsym(h, "cublasSetStream_v2");
    *(void **)&blas.sgemm = dlsym(h, "cublasSgemm_v2");
    *(void **)&blas.status_string = dlsym(h, "cublasGetStatusString");
    if (!blas.create || !blas.destroy || !blas.set_stream || !blas.sgemm || !blas.status_string) {
        snprintf(blas_error, sizeof blas_error, "%s lacks the cuBLAS v2 entry points", CUBLAS_SONAME);
        blas.create = NULL;
    }
}

static int blas_ready(loom_err *err)
{
    pthread_once(&blas_once, blas_load);
    if (blas.create) return 0;
    host->err_set(err, LOOM_ECUDA, NULL, "%s", blas_error);
    return host->err_hint(err, "install the CUDA toolkit's cuBLAS (it ships with the toolkit) or add its directory "
                               "to LD_LIBRARY_PATH");
}

static int cublas_fail(loom_err *err, cublasStatus_t st, const char *call, int line)
{
    return host->err_set(err, LOOM_ECUDA, NULL, "%s failed at cuda.c:%d: %s", call, line, blas.status_string(st));
}

#define CUDA_TRY(call)                                                                                                 \
    do {                                                                                                               \
        cudaError_t e_ = (call);                                                                                       \
        if (e_ != cudaSuccess) return cuda_fail(err, e_, #call, __LINE__);                                             \
    } while (0)
#define CUBLAS_TRY(call)                                                                                               \
    do {                                                                                                               \
        cublasStatus_t st_ = (call);                                                                                   \
        if (st_ != CUBLAS_STATUS_SUCCESS) return cublas_fail(err, st_, #call, __LINE__);                               \
    } while (0)

/* ---- devices ---------------------------------------------------------------------- */

static int cu_probe(char *why, size_t why_n)
{
    int n = 0, drv = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e == cudaSuccess && n > 0) {
        if (why && why_n) why[0] = '\0';
        return n;
    }
    cudaGetLastError(); /* clear it: the next call must not see this one's error */
    if (!why) return 0;
    if (e == cudaErrorInsufficientDriver && cudaDriverGetVersion(&drv) == cudaSuccess && drv == 0)
        snprintf(why, why_n, "no CUDA driver (libcuda.so.1 not found; install the NVIDIA driver)");
    else if (e == cudaErrorInsufficientDriver)
        snprintf(why, why_n, "the CUDA driver (%d.%d) is older than the plugin's runtime (%d.%d)", drv / 1000,
                 drv % 1000 / 10, CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10);
    else if (e == cudaErrorNoDevice || e == cudaSuccess)
        snprintf(why, why_n, "no CUDA device (the driver sees no GPU; check CUDA_VISIBLE_DEVICES)");
    else
        snprintf(why, why_n, "no usable CUDA device: cudaGetDeviceCount: %s", cudaGetErrorString(e));
    return 0;
}

static void cu_describe(int device, char *buf, size_t n)
{
    int rt = 0, drv = 0, blas_major = CUBLAS_VER_MAJOR, blas_minor = CUBLAS_VER_MINOR; /* built against */
    cudaRuntimeGetVersion(&rt);
    cudaDriverGetVersion(&drv);
    struct cudaDeviceProp p;
    if (device >= 0 && cudaGetDeviceProperties(&p, device) == cudaSuccess) {
        snprintf(buf, n, "%s, %.1f GiB, compute capability %d.%d", p.name, (double)p.totalGlobalMem / (1 << 30),
                 p.major, p.minor);
        return;
    }
    cudaGetLastError();
    char d[32] = "none";
    if (drv) snprintf(d, sizeof d, "%d.%d", drv / 1000, drv % 1000 / 10);
    snprintf(buf, n, "CUDA runtime %d.%d, cuBLAS %d.%d, driver %s", rt / 1000, rt % 1000 / 10, blas_major, blas_minor,
             d);
}

static void cu_close(loom_device *d)
{
    if (!d) return;
    cudaSetDevice(d->id);
    if (d->blas) blas.destroy(d->blas);
    if (d->ev) cudaEventDestroy(d->ev);
    for (int i = 0; i < 2; i++)
        if (d->stream[i]) cudaStreamDestroy(d->stream[i]);
    host->free(d);
}

static int open_streams(loom_device *d, loom_err *err)
{
    CUDA_TRY(cudaSetDevice(d->id));
    for (int i = 0; i < 2; i++) CUDA_TRY(cudaStreamCreateWithFlags(&d->stream[i], cudaStreamNonBlocking));
    CUDA_TRY(cudaEventCreateWithFlags(&d->ev, cudaEventDisableTiming));
    if (blas_ready(err)) return LOOM_ECUDA;
    CUBLAS_TRY(blas.create(&d->blas));
    CUBLAS_TRY(blas.set_stream(d->blas, d->stream[LOOM_DEV_STREAM_COMPUTE]));
    return 0;
}

static int cu_open(loom_device **out, int device, loom_err *err)
{
    char why[300];
    int n = cu_probe(why, sizeof why);
    if (n == 0) return host->err_set(err, LOOM_ECUDA, NULL, "gpu:%d: %s", device, why);
    if (device < 0 || device >= n)
        return host->err_set(err, LOOM_ECUDA, NULL, "gpu:%d does not exist: this machine has gpu:0 to gpu:%d", device,
                             n - 1);
    loom_device *d = host->calloc(1, sizeof *d);
    if (!d) return host->err_set(err, LOOM_ENOMEM, NULL, "out of memory opening gpu:%d", device);
    d->id = device;
    int rc = open_streams(d, err);
    if (rc) {
        cu_close(d);
        return rc;
    }
    *out = d;
    return 0;
}

/* ---- memory and copies ---------------------------------------------------------- */

static int cu_alloc(loom_device *d, void **out, size_t bytes, loom_err *err)
{
    CUDA_TRY(cudaSetDevice(d->id));
    CUDA_TRY(cudaMalloc(out, bytes ? bytes : 1));
    return 0;
}

static void cu_free(loom_device *d, void *p)
{
    if (!p) return;
    cudaSetDevice(d->id);
    cudaFree(p);
}

static int cu_host_alloc(loom_device *d, void **out, size_t bytes, loom_err *err)
{
    CUDA_TRY(cudaSetDevice(d->id));
    CUDA_TRY(cudaMallocHost(out, bytes ? bytes : 1));
    return 0;
}

static void cu_host_free(loom_device *d, void *p)
{
    (void)d;
    if (p) cudaFreeHost(p);
}

static int check_stream(int stream, loom_err *err)
{
    if (stream == LOOM_DEV_STREAM_COMPUTE || stream == LOOM_DEV_STREAM_COPY) return 0;
    return host->err_set(err, LOOM_EUSAGE, NULL, "stream %d: the cuda backend has streams 0 (compute) and 1 (copy)",
                         stream);
}

static int cu_upload(loom_device *d, int stream, void *dst, const void *src, size_t bytes, loom_err *err)
{
    if (check_stream(stream, err)) return err->code;
    CUDA_TRY(cudaSetDevice(d->id));
    CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, d->stream[stream]));
    return 0;
}

static int cu_download(loom_device *d, int stream, void *dst, const void *src, size_t bytes, loom_err *err)
{
    if (check_stream(stream, err)) return err->code;
    CUDA_TRY(cudaSetDevice(d->id));
    CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, d->stream[stream]));
    return 0;
}

static int cu_stream_wait(loom_device *d, int waiter, int signaller, loom_err *err)
{
    if (check_stream(waiter, err) || check_stream(signaller, err)) return err->code;
    CUDA_TRY(cudaSetDevice(d->id));
    CUDA_TRY(cudaEventRecord(d->ev, d->stream[signaller]));
    CUDA_TRY(cudaStreamWaitEvent(d->stream[waiter], d->ev, 0));
    return 0;
}

static int cu_synchronize(loom_device *d, int stream, loom_err *err)
{
    CUDA_TRY(cudaSetDevice(d->id));
    if (stream == -1) {
        CUDA_TRY(cudaStreamSynchronize(d->stream[0]));
        CUDA_TRY(cudaStreamSynchronize(d->stream[1]));
        return 0;
    }
    if (check_stream(stream, err)) return err->code;
    CUDA_TRY(cudaStreamSynchronize(d->stream[stream]));
    return 0;
}

/* ---- compute ---------------------------------------------------------------------- */

static cudaStream_t compute(loom_device *d) { return d->stream[LOOM_DEV_STREAM_COMPUTE]; }

/* Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands. */
static int cu_gemm(loom_device *d, bool ta, bool tb, int M, int N, int K, float alpha, const float *A, int lda,
                   const float *B, int ldb, float beta, float *C, int ldc, loom_err *err)
{
    CUDA_TRY(cudaSetDevice(d->id));
    CUBLAS_TRY(blas.sgemm(d->blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &alpha, B,
                           ldb, A, lda, &beta, C, ldc));
    return 0;
}

/* A launcher's result: its launch error, with the launcher's name. */
#define LAUNCH(call)                                                                                                   \
    do {                                                                                                               \
        CUDA_TRY(cudaSetDevice(d->id));                                                                                \
        CUDA_TRY(call);                                                                                                \
        return 0;                                                                                                      \
    } while (0)

static int cu_binary(loom_device *d, loom_dev_binop op, int64_t n, const float *a, const float *b, float *out,
                     loom_err *err)
{
    LAUNCH(lk_binary(compute(d), (int)op, n, a, b, out));
}

static int cu_axpy(loom_device *d, int64_t n, float alpha, const float *x, float *y, loom_err *err)
{
    LAUNCH(lk_axpy(compute(d), n, alpha, x, y));
}

static int cu_scale(loom_device *d, int64_t n, float alpha, float *x, loom_err *err)
{
    LAUNCH(lk_scale(compute(d), n, alpha, x));
}

static int cu_bias_act(loom_device *d, loom_dev_act act, int64_t rows, int64_t cols, const float *bias, float *x,
                       loom_err *err)
{
    LAUNCH(lk_bias_act(compute(d), (int)act, rows, cols, bias, x));
}

static int cu_act_backward(loom_device *d, loom_dev_act act, int64_t n, const float *y, float *g, loom_err *err)
{
    LAUNCH(lk_act_backward(compute(d), (int)act, n, y, g));
}

static int cu_bias_grad(loom_device *d, int64_t rows, int64_t cols, const float *g, float *db, loom_err *err)
{
    LAUNCH(lk_bias_grad(compute(d), rows, cols, g, db));
}

static int cu_reduce(loom_device *d, loom_dev_reduce op, int64_t n, const float *x, float *out, loom_err *err)
{
    if (n < 1)
        return host->err_set(err, LOOM_EUSAGE, NULL, "reduce over %lld elements (needs at least 1)", (long long)n);
    LAUNCH(lk_reduce(compute(d), (int)op, n, x, out));
}

static int cu_softmax_xent(loom_device *d, int64_t rows, int64_t classes, const float *z, const int32_t *labels,
                           float scale, float *loss, int32_t *hit, float *g, loom_err *err)
{
    LAUNCH(lk_softmax_xent(compute(d), rows, classes, z, labels, scale, loss, hit, g));
}

/* Every window must overlap the image (as SAME and VALID padding guarantee):
 * a window wholly in the padding has no maximum and reads nothing. */
static int check_window(const loom_dev_window *g, loom_err *err)
{
    bool ok = g->batch > 0 && g->h > 0 && g->w > 0 && g->c > 0 && g->kh > 0 && g->kw > 0 && g->sh > 0 && g->sw > 0 &&
              g->oh > 0 && g->ow > 0 && g->pad_t >= 0 && g->pad_l >= 0 && g->pad_t < g->kh && g->pad_l < g->kw &&
              (g->oh - 1) * g->sh - g->pad_t < g->h && (g->ow - 1) * g->sw - g->pad_l < g->w;
    if (ok) return 0;
    return host->err_set(err, LOOM_ESHAPE, NULL,
                         "window %dx%d, stride %dx%d, padding %d,%d over (%d, %d, %d, %d) -> %dx%d: a window lies "
                         "outside the image",
                         g->kh, g->kw, g->sh, g->sw, g->pad_t, g->pad_l, g->batch, g->h, g->w, g->c, g->oh, g->ow);
}

static int cu_conv2d_forward(loom_device *d, const loom_dev_window *g, const float *x, const float *w, const float *b,
                             float *y, float *col, loom_err *err)
{
    if (check_window(g, err)) return err->code;
    int M = g->batch * g->oh * g->ow, K = g->kh * g->kw * g->c;
    CUDA_TRY(cudaSetDevice(d->id));
    CUDA_TRY(lk_im2col(compute(d), (const kwin *)g, x, col));
    int rc = cu_gemm(d, false, false, M, g->cout, K, 1.f, col, K, w, g->cout, 0.f, y, g->cout, err);
    return rc ? rc : cu_bias_act(d, LOOM_DEV_ACT_NONE, M, g->cout, b, y, err);
}

static int cu_conv2d_backward(loom_device *d, const loom_dev_window *g, const float *x, const float *w, const float *dy,
                              float *dx, float *dw, float *db, float *col, loom_err *err)
{
    if (check_window(g, err)) return err->code;
    int M = g->batch * g->oh * g->ow, K = g->kh * g->kw * g->c;
    CUDA_TRY(cudaSetDevice(d->id));
    CUDA_TRY(lk_im2col(compute(d), (const kwin *)g, x, col));
    int rc = cu_gemm(d, true, false, K, g->cout, M, 1.f, col, K, dy, g->cout, 0.f, dw, g->cout, err);
    if (!rc) rc = cu_bias_grad(d, M, g->cout, dy, db, err);
    if (rc || !dx) return rc;
    rc = cu_gemm(d, false, true, M, K, g->cout, 1.f, dy, g->cout, w, g->cout, 0.f, col, K, err);
    if (rc) return rc;
    LAUNCH(lk_col2im(compute(d), (const kwin *)g, col, dx));
}

static int cu_maxpool_forward(loom_device *d, const loom_dev_window *g, const float *x, float *y, int32_t *argmax,
                              loom_err *err)
{
    if (check_window(g, err)) return err->code;
    LAUNCH(lk_maxpool_forward(compute(d), (const kwin *)g, x, y, argmax));
}

static int cu_maxpool_backward(loom_device *d, const loom_dev_window *g, const float *dy, const int32_t *argmax,
                               float *dx, loom_err *err)
{
    if (check_window(g, err)) return err->code;
    LAUNCH(lk_maxpool_backward(compute(d), (const kwin *)g, dy, argmax, dx));
}

/* ---- registration ------------------------------------------------------------------ */

static const loom_device_ops cuda_ops = {
    .version = LOOM_DEVICE_OPS_VERSION,
    .name = "cuda",
    .probe = cu_probe,
    .describe = cu_describe,
    .open = cu_open,
    .close = cu_close,
    .alloc = cu_alloc,
    .free = cu_free,
    .host_alloc = cu_host_alloc,
    .host_free = cu_host_free,
    .upload = cu_upload,
    .download = cu_download,
    .stream_wait = cu_stream_wait,
    .synchronize = cu_synchronize,
    .gemm = cu_gemm,
    .binary = cu_binary,
    .axpy = cu_axpy,
    .scale = cu_scale,
    .bias_act = cu_bias_act,
    .act_backward = cu_act_backward,
    .bias_grad = cu_bias_grad,
    .reduce = cu_reduce,
    .softmax_xent = cu_softmax_xent,
    .conv2d_forward = cu_conv2d_forward,
    .conv2d_backward = cu_conv2d_backward,
    .maxpool_forward = cu_maxpool_forward,
    .maxpool_backward = cu_maxpool_backward,
};

/* Registers even without a device: a GPU config then hears why. */
static int cuda_init(const loom_host *h, loom_err *err)
{
    host = h;
    if (offsetof(loom_host, register_device) >= h->size)
        return h->err_set(err, LOOM_EPLUGIN, NULL, "this loom cannot register device backends (too old)");
    char why[300];
    if (!cu_probe(why, sizeof why)) h->log(LOOM_LOG_DEBUG, "cuda plugin: %s", why);
    return h->register_device(&cuda_ops, err);
}

static const loom_plugin plugin = {
    .abi = LOOM_PLUGIN_ABI_VERSION,
    .size = sizeof(loom_plugin),
    .name = "cuda",
    .version = "0.1.0",
    .description = "CUDA device backend: device memory, cuBLAS gemm, kernels, copy/compute streams",
    .init = cuda_init,
};

LOOM_PLUGIN_EXPORT const loom_plugin *loom_plugin_entry(void) { return &plugin; }
