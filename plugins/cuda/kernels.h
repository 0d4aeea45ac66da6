/* kernels.h - the CUDA kernels of the cuda plugin, as C launchers: each
 * queues its kernel on `s` and returns cudaGetLastError() (a launch error;
 * faults during the run surface at the next synchronize). Pointers are
 * device memory; shapes and layouts are those of loom_device_ops. */
#ifndef LOOM_CUDA_KERNELS_H
#define LOOM_CUDA_KERNELS_H

#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The subset of loom_dev_window the kernels need (same field order). */
typedef struct kwin {
    int32_t batch, h, w, c, kh, kw, sh, sw, pad_t, pad_l, oh, ow, cout;
} kwin;

cudaError_t lk_binary(cudaStream_t s, int op, int64_t n, const float *a, const float *b, float *out);
cudaError_t lk_axpy(cudaStream_t s, int64_t n, float alpha, const float *x, float *y);
cudaError_t lk_scale(cudaStream_t s, int64_t n, float alpha, float *x);
cudaError_t lk_bias_act(cudaStream_t s, int act, int64_t rows, int64_t cols, const float *bias, float *x);
cudaError_t lk_act_backward(cudaStream_t s, int act, int64_t n, const float *y, float *g);
cudaError_t lk_bias_grad(cudaStream_t s, int64_t rows, int64_t cols, const float *g, float *db);
cudaError_t lk_reduce(cudaStream_t s, int op, int64_t n, const float *x, float *out);
cudaError_t lk_softmax_xent(cudaStream_t s, int64_t rows, int64_t classes, const float *z, const int32_t *labels,
                            float scale, float *loss, int32_t *hit, float *g);
cudaError_t lk_im2col(cudaStream_t s, const kwin *w, const float *x, float *col);
cudaError_t lk_col2im(cudaStream_t s, const kwin *w, const float *col, float *dx);
cudaError_t lk_maxpool_forward(cudaStream_t s, const kwin *w, const float *x, float *y, int32_t *argmax);
cudaError_t lk_maxpool_backward(cudaStream_t s, const kwin *w, const float *dy, const int32_t *argmax, float *dx);

#ifdef __cplusplus
}
#endif

#endif
