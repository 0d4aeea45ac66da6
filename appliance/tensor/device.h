/* device.h - the device-backend interface: memory, host<->device copies on
 * streams, and the compute primitives of the layers (gemm, element-wise,
 * bias + activation, reductions, softmax cross-entropy, im2col convolution
 * and max pooling, forward and backward), as one versioned vtable.
 * The CPU backend is built in and is the reference every other backend is
 * tested against (tests/gpu/); a GPU backend registers the same table from
 * a plugin (plugins/cuda/) under LOOM_REG_DEVICE, through loom_plugin.h,
 * which restates this header (appliance/plugin/abi_check.c proves they
 * agree). Layouts are nn's: row-major, images NHWC, convolution weights
 * (KH*KW*C, COUT) in kernel order (i, j, c), pool argmax an index within
 * the example.
 * Threads: a loom_device is used by one thread at a time; probe and
 * describe may be called from any thread. Pointers given to compute
 * functions are device memory from alloc (CPU: host memory). */
#ifndef LOOM_DEVICE_H
#define LOOM_DEVICE_H

#include "tensor/tensor.h"

#include <stdio.h>

typedef struct loom_device loom_device; /* one open device: its streams and library handles */

/* Activations of bias_act / act_backward (nn's, without softmax). */
typedef enum { LOOM_DEV_ACT_NONE, LOOM_DEV_ACT_RELU, LOOM_DEV_ACT_SIGMOID, LOOM_DEV_ACT_TANH } loom_dev_act;
/* Element-wise binary ops. */
typedef enum { LOOM_DEV_ADD, LOOM_DEV_SUB, LOOM_DEV_MUL } loom_dev_binop;
/* Reductions of a whole vector. */
typedef enum { LOOM_DEV_SUM, LOOM_DEV_MAX } loom_dev_reduce;
/* Streams of a device: compute work, and copies that overlap it. */
enum { LOOM_DEV_STREAM_COMPUTE = 0, LOOM_DEV_STREAM_COPY = 1 };

/* Geometry of a convolution or pooling window over a batch of NHWC images:
 * output (batch, oh, ow, cout); pooling has cout == c. */
typedef struct loom_dev_window {
    int32_t batch, h, w, c; /* input */
    int32_t kh, kw, sh, sw; /* window and strides */
    int32_t pad_t, pad_l;   /* zero padding above and left (SAME or VALID, resolved) */
    int32_t oh, ow, cout;   /* output */
} loom_dev_window;

/* Every compute function is queued on the compute stream and returns
 * LOOM_OK or a LOOM_E* code with err filled (a launch failure, "no device").
 * Results are visible to the host after synchronize. */
typedef struct loom_device_ops {
    uint32_t version; /* LOOM_DEVICE_OPS_VERSION; append fields only */
    const char *name; /* the registry name: "cpu", "cuda"; devices are "<kind>:N" */

    /* Usable devices now. 0 with why filled ("no CUDA driver: ..."), so
     * callers can say what is missing; why may be NULL. */
    int (*probe)(char *why, size_t why_n);
    /* One line about the backend and device `device` (-1: the backend
     * alone: library versions) for `loom devices`. */
    void (*describe)(int device, char *buf, size_t n);
    int (*open)(loom_device **out, int device, loom_err *err);
    void (*close)(loom_device *d); /* NULL is a no-op */

    /* memory: device memory, and pinned host memory for async copies */
    int (*alloc)(loom_device *d, void **out, size_t bytes, loom_err *err);
    void (*free)(loom_device *d, void *p);
    int (*host_alloc)(loom_device *d, void **out, size_t bytes, loom_err *err);
    void (*host_free)(loom_device *d, void *p);
    /* Copies queued on `stream`; host memory must stay untouched until the
     * stream is synchronized (and be pinned to overlap compute). */
    int (*upload)(loom_device *d, int stream, void *dst, const void *host_src, size_t bytes, loom_err *err);
    int (*download)(loom_device *d, int stream, void *host_dst, const void *src, size_t bytes, loom_err *err);
    /* Work queued on `waiter` from now on starts after the work queued so
     * far on `signaller` (an event, not a host wait). */
    int (*stream_wait)(loom_device *d, int waiter, int signaller, loom_err *err);
    /* Host waits for `stream` (-1: every stream). */
    int (*synchronize)(loom_device *d, int stream, loom_err *err);

    /* Row-major C (M, N) = alpha op(A) op(B) + beta C; op(A) (M, K), op(B) (K, N). */
    int (*gemm)(loom_device *d, bool ta, bool tb, int M, int N, int K, float alpha, const float *A, int lda,
                const float *B, int ldb, float beta, float *C, int ldc, loom_err *err);
    /* out (n,) = a op b; out may alias a or b. */
    int (*binary)(loom_device *d, loom_dev_binop op, int64_t n, const float *a, const float *b, float *out,
                  loom_err *err);
    int (*axpy)(loom_device *d, int64_t n, float alpha, const float *x, float *y, loom_err *err); /* y += alpha x */
    int (*scale)(loom_device *d, int64_t n, float alpha, float *x, loom_err *err);                /* x *= alpha */
    /* x (rows, cols) = act(x + bias (cols,)); bias may be NULL. */
    int (*bias_act)(loom_device *d, loom_dev_act act, int64_t rows, int64_t cols, const float *bias, float *x,
                    loom_err *err);
    /* g (n,) *= act'(.) written in terms of the activation's output y (n,). */
    int (*act_backward)(loom_device *d, loom_dev_act act, int64_t n, const float *y, float *g, loom_err *err);
    /* db (cols,) = column sums of g (rows, cols). */
    int (*bias_grad)(loom_device *d, int64_t rows, int64_t cols, const float *g, float *db, loom_err *err);
    /* out (1,) = the sum or max of x (n,), n >= 1; out is device memory. */
    int (*reduce)(loom_device *d, loom_dev_reduce op, int64_t n, const float *x, float *out, loom_err *err);
    /* Softmax cross-entropy on logits z (rows, classes) with labels (rows,)
     * in [0, classes): loss (rows,) = lse(z) - z[label], hit (rows,) = 1
     * where argmax (first on ties) is the label, and, unless g is NULL,
     * g (rows, classes) = (softmax(z) - onehot(label)) * scale. */
    int (*softmax_xent)(loom_device *d, int64_t rows, int64_t classes, const float *z, const int32_t *labels,
                        float scale, float *loss, int32_t *hit, float *g, loom_err *err);
    /* y (batch, oh, ow, cout) = conv(x (batch, h, w, c), w (kh*kw*c, cout)) + b (cout,);
     * col is scratch of batch*oh*ow*kh*kw*c floats (the im2col matrix). */
    int (*conv2d_forward)(loom_device *d, const loom_dev_window *g, const float *x, const float *w, const float *b,
                          float *y, float *col, loom_err *err);
    /* From dy (batch, oh, ow, cout): dw = col(x)^T dy, db = column sums of
     * dy (both overwritten), and unless dx is NULL dx (batch, h, w, c) =
     * col2im(dy w^T). col as for forward. */
    int (*conv2d_backward)(loom_device *d, const loom_dev_window *g, const float *x, const float *w, const float *dy,
                           float *dx, float *dw, float *db, float *col, loom_err *err);
    /* y (batch, oh, ow, c) = max over each window (positions in the padding
     * skipped; ties keep the first in (i, j) order), argmax its index in the
     * example (int32). */
    int (*maxpool_forward)(loom_device *d, const loom_dev_window *g, const float *x, float *y, int32_t *argmax,
                           loom_err *err);
    /* dx (batch, h, w, c) = dy scattered (summed) to the argmax positions. */
    int (*maxpool_backward)(loom_device *d, const loom_dev_window *g, const float *dy, const int32_t *argmax, float *dx,
                            loom_err *err);
    /* (version 2; may be NULL) out[r * ldo + c] = x[r * ldx + c] for r < rows, c < cols: a graph's
     * concatenate along the last axis (each input into its columns of the output) and its backward. */
    int (*copy2d)(loom_device *d, int64_t rows, int64_t cols, const float *x, int64_t ldx, float *out, int64_t ldo,
                  loom_err *err);
} loom_device_ops;
#define LOOM_DEVICE_OPS_VERSION 2 /* 2: copy2d appended (a version-1 table is read without it) */

/* The built-in CPU backend: the reference. Device pointers are host memory,
 * copies are memcpy, streams run synchronously; one device per process
 * (cpu:N in strategy.devices name replicas, not backends). */
const loom_device_ops *loom_device_cpu(void);

/* The device backend registered as `name` ("cuda"); NULL when none is. */
const loom_device_ops *loom_device_backend(const char *name);

/* What "gpu:N" in a config can use: the number of usable GPUs, and when
 * that is 0 why, naming what is missing (the cuda plugin is not loaded, no
 * driver, no device) and what to do. Call after plugins are loaded. */
int loom_device_gpus(char *why, size_t why_n);

/* Double-buffered upload of batches: while the compute stream works on
 * batch k, batch k+1 is copied (through pinned memory) on the copy stream.
 *   put(b0); for k: { put(b[k+1]); take(&x); queue compute on x; }
 * put copies the host batch and queues its upload (at most two batches put
 * and not yet taken); take makes the compute stream wait for the oldest
 * upload and returns its device buffer, valid until the second put after
 * it. Device work is ordered by events (the upload into a buffer waits for
 * the compute queued before it); on the host, put waits for the copies
 * queued before it, so that its staging buffer is free. One thread at a time. */
typedef struct loom_dev_stager loom_dev_stager;
int loom_dev_stager_open(loom_dev_stager **out, const loom_device_ops *ops, loom_device *dev, size_t bytes,
                         loom_err *err); /* close with loom_dev_stager_close */
int loom_dev_stager_put(loom_dev_stager *s, const void *host, size_t bytes, loom_err *err);
int loom_dev_stager_take(loom_dev_stager *s, void **dev_buf, loom_err *err);
void loom_dev_stager_close(loom_dev_stager *s); /* waits for the device; NULL is a no-op */

#endif
