/* kernels_emulated.cpp - the cuda plugin's kernels (plugins/cuda/kernels.cu)
 * compiled as plain C++ and run on the host: each launch walks a small grid
 * (3 blocks of 5 threads) one thread after the other, so every kernel's
 * index arithmetic, grid-stride coverage and fixed summation order run
 * where there is no GPU. It provides the launchers of kernels.h; pointers
 * are host memory. Not emulated: concurrency (every kernel writes each
 * output from one thread only, by design) and k_reduce's shared-memory tree,
 * which runs here as one thread of one block. */
#include <cuda_runtime.h>
#include <math.h>

#undef __global__
#undef __device__
#undef __shared__
#define __global__
#define __device__
#define __shared__ static
static uint3 blockIdx, threadIdx;
static dim3  blockDim, gridDim;
static void  __syncthreads(void) {}

#define LOOM_KERNELS_EMULATED
#include "../../plugins/cuda/kernels.cu"

/* Runs f once per (block, thread) of a blocks x threads grid, in order. */
template <typename F> static cudaError_t grid(unsigned blocks, unsigned threads, F f)
{
    gridDim = dim3(blocks), blockDim = dim3(threads);
    for (unsigned b = 0; b < blocks; b++)
        for (unsigned t = 0; t < threads; t++) {
            blockIdx.x = b, threadIdx.x = t;
            f();
        }
    return cudaSuccess;
}
#define RUN(call) return grid(3, 5, [&] { call; })

extern "C" {

cudaError_t lk_binary(cudaStream_t, int op, int64_t n, const float *a, const float *b, float *out)
{
    RUN(k_binary(op, n, a, b, out));
}

cudaError_t lk_axpy(cudaStream_t, int64_t n, float alpha, const float *x, float *y) { RUN(k_axpy(n, alpha, x, y)); }

cudaError_t lk_scale(cudaStream_t, int64_t n, float alpha, float *x) { RUN(k_scale(n, alpha, x)); }

cudaError_t lk_bias_act(cudaStream_t, int act, int64_t rows, int64_t cols, const float *bias, float *x)
{
    RUN(k_bias_act(act, rows, cols, bias, x));
}

cudaError_t lk_act_backward(cudaStream_t, int act, int64_t n, const float *y, float *g)
{
    RUN(k_act_backward(act, n, y, g));
}

cudaError_t lk_bias_grad(cudaStream_t, int64_t rows, int64_t cols, const float *g, float *db)
{
    RUN(k_bias_grad(rows, cols, g, db));
}

cudaError_t lk_reduce(cudaStream_t, int op, int64_t n, const float *x, float *out)
{
    return grid(1, 1, [&] { k_reduce(op, n, x, out); });
}

cudaError_t lk_softmax_xent(cudaStream_t, int64_t rows, int64_t classes, const float *z, const int32_t *labels,
                            float scale, float *loss, int32_t *hit, float *g)
{
    RUN(k_softmax_xent(rows, classes, z, labels, scale, loss, hit, g));
}

cudaError_t lk_im2col(cudaStream_t, const kwin *w, const float *x, float *col) { RUN(k_im2col(*w, x, col)); }

cudaError_t lk_col2im(cudaStream_t, const kwin *w, const float *col, float *dx) { RUN(k_col2im(*w, col, dx)); }

cudaError_t lk_maxpool_forward(cudaStream_t, const kwin *w, const float *x, float *y, int32_t *argmax)
{
    RUN(k_maxpool_forward(*w, x, y, argmax));
}

cudaError_t lk_maxpool_backward(cudaStream_t, const kwin *w, const float *dy, const int32_t *argmax, float *dx)
{
    RUN(k_maxpool_backward(*w, dy, argmax, dx));
}

} /* extern "C" */
