/* kernels.cu - the cuda plugin's kernels: element-wise ops, bias +
 * activation, reductions, softmax cross-entropy, im2col / col2im and max
 * pooling. Every kernel that sums does so in a fixed order (no atomics), so
 * results are deterministic run to run; col2im and the pool backward gather
 * per input pixel instead of scattering. Grid-stride loops throughout. */
#include "kernels.h"

#include <float.h>

#define THREADS 256

#define FOR_EACH(i, n) for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (n); \
                            i += (int64_t)gridDim.x * blockDim.x)

__global__ void k_binary(int op, int64_t n, const float *a, const float *b, float *out)
{
    FOR_EACH(i, n) out[i] = op == 0 ? a[i] + b[i] : op == 1 ? a[i] - b[i] : a[i] * b[i];
}

__global__ void k_axpy(int64_t n, float alpha, const float *x, float *y)
{
    FOR_EACH(i, n) y[i] += alpha * x[i];
}

__global__ void k_scale(int64_t n, float alpha, float *x)
{
    FOR_EACH(i, n) x[i] *= alpha;
}

static __device__ float act(int a, float v)
{
    return a == 1 ? (v > 0.f ? v : 0.f) : a == 2 ? 1.f / (1.f + expf(-v)) : a == 3 ? tanhf(v) : v;
}

__global__ void k_bias_act(int a, int64_t rows, int64_t cols, const float *bias, float *x)
{
    FOR_EACH(i, rows * cols) x[i] = act(a, x[i] + (bias ? bias[i % cols] : 0.f));
}

__global__ void k_act_backward(int a, int64_t n, const float *y, float *g)
{
    FOR_EACH(i, n)
    {
        float v = y[i];
        g[i] *= a == 1 ? (float)(v > 0.f) : a == 2 ? v * (1.f - v) : a == 3 ? 1.f - v * v : 1.f;
    }
}

/* One thread per column, rows in order: the CPU's summation order. */
__global__ void k_bias_grad(int64_t rows, int64_t cols, const float *g, float *db)
{
    FOR_EACH(c, cols)
    {
        float s = 0.f;
        for (int64_t r = 0; r < rows; r++) s += g[r * cols + c];
        db[c] = s;
    }
}

/* One block: each thread folds a strided slice in double, then a tree. */
__global__ void k_reduce(int op, int64_t n, const float *x, float *out)
{
    __shared__ double part[THREADS];
    double v = op == 0 ? 0. : -DBL_MAX;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) v = op == 0 ? v + x[i] : fmax(v, (double)x[i]);
    part[threadIdx.x] = v;
    __syncthreads();
    for (unsigned k = blockDim.x / 2; k > 0; k /= 2) {
        if (threadIdx.x < k)
            part[threadIdx.x] = op == 0 ? part[threadIdx.x] + part[threadIdx.x + k]
                                        : fmax(part[threadIdx.x], part[threadIdx.x + k]);
        __syncthreads();
    }
    if (threadIdx.x == 0) *out = (float)part[0];
}

/* One thread per row: rows are few (a batch), classes short. */
__global__ void k_softmax_xent(int64_t rows, int64_t classes, const float *z, const int32_t *labels, float scale,
                               float *loss, int32_t *hit, float *g)
{
    FOR_EACH(r, rows)
    {
        const float *zr = z + r * classes;
        int64_t am = 0;
        for (int64_t j = 1; j < classes; j++) am = zr[j] > zr[am] ? j : am;
        float mx = zr[am], s = 0.f;
        for (int64_t j = 0; j < classes; j++) s += expf(zr[j] - mx);
        int32_t y = labels[r];
        loss[r] = logf(s) + mx - zr[y];
        hit[r] = am == y;
        if (g)
            for (int64_t j = 0; j < classes; j++) g[r * classes + j] = (expf(zr[j] - mx) / s - (j == y)) * scale;
    }
}

/* One thread per entry of col (batch*oh*ow, kh*kw*c). */
__global__ void k_im2col(kwin w, const float *x, float *col)
{
    int64_t K = (int64_t)w.kh * w.kw * w.c, total = (int64_t)w.batch * w.oh * w.ow * K;
    FOR_EACH(i, total)
    {
        int64_t row = i / K, k = i % K;
        int c = (int)(k % w.c), j = (int)(k / w.c % w.kw), ki = (int)(k / w.c / w.kw);
        int ox = (int)(row % w.ow), oy = (int)(row / w.ow % w.oh);
        int64_t b = row / w.ow / w.oh;
        int yy = oy * w.sh - w.pad_t + ki, xx = ox * w.sw - w.pad_l + j;
        col[i] = yy >= 0 && yy < w.h && xx >= 0 && xx < w.w ? x[((b * w.h + yy) * w.w + xx) * w.c + c] : 0.f;
    }
}

/* One thread per input pixel: the col entries that came from it, gathered
 * in (output row, kernel position) order. */
__global__ void k_col2im(kwin w, const float *col, float *dx)
{
    int64_t K = (int64_t)w.kh * w.kw * w.c, total = (int64_t)w.batch * w.h * w.w * w.c;
    FOR_EACH(p, total)
    {
        int c = (int)(p % w.c), xx = (int)(p / w.c % w.w), yy = (int)(p / w.c / w.w % w.h);
        int64_t b = p / w.c / w.w / w.h;
        float s = 0.f;
        for (int oy = 0; oy < w.oh; oy++) {
            int i = yy - (oy * w.sh - w.pad_t);
            if (i < 0 || i >= w.kh) continue;
            for (int ox = 0; ox < w.ow; ox++) {
                int j = xx - (ox * w.sw - w.pad_l);
                if (j < 0 || j >= w.kw) continue;
                s += col[((b * w.oh + oy) * w.ow + ox) * K + ((int64_t)i * w.kw + j) * w.c + c];
            }
        }
        dx[p] = s;
    }
}

__global__ void k_maxpool_forward(kwin w, const float *x, float *y, int32_t *argmax)
{
    int64_t in = (int64_t)w.h * w.w * w.c, total = (int64_t)w.batch * w.oh * w.ow * w.c;
    FOR_EACH(o, total)
    {
        int c = (int)(o % w.c), ox = (int)(o / w.c % w.ow), oy = (int)(o / w.c / w.ow % w.oh);
        int64_t b = o / w.c / w.ow / w.oh;
        const float *xb = x + b * in;
        int32_t best = -1;
        for (int i = 0; i < w.kh; i++)
            for (int j = 0; j < w.kw; j++) {
                int yy = oy * w.sh - w.pad_t + i, xx = ox * w.sw - w.pad_l + j;
                if (yy < 0 || yy >= w.h || xx < 0 || xx >= w.w) continue;
                int32_t at = (yy * w.w + xx) * w.c + c;
                if (best < 0 || xb[at] > xb[best]) best = at;
            }
        y[o] = xb[best];
        argmax[o] = best;
    }
}

/* One thread per input pixel: the gradients of the windows whose argmax it
 * is, in output order (the CPU reference's order). */
__global__ void k_maxpool_backward(kwin w, const float *dy, const int32_t *argmax, float *dx)
{
    int64_t in = (int64_t)w.h * w.w * w.c, out = (int64_t)w.oh * w.ow * w.c;
    FOR_EACH(p, w.batch * in)
    {
        int64_t b = p / in;
        int32_t at = (int32_t)(p % in);
        int c = at % w.c, xx = at / w.c % w.w, yy = at / w.c / w.w;
        float s = 0.f;
        for (int oy = 0; oy < w.oh; oy++) {
            int i = yy - (oy * w.sh - w.pad_t);
            if (i < 0 || i >= w.kh) continue;
            for (int ox = 0; ox < w.ow; ox++) {
                int j = xx - (ox * w.sw - w.pad_l);
                if (j < 0 || j >= w.kw) continue;
                int64_t o = b * out + ((int64_t)oy * w.ow + ox) * w.c + c;
                if (argmax[o] == at) s += dy[o];
            }
        }
        dx[p] = s;
    }
}

/* ---- launchers ------------------------------------------------------------
 * tests/gpu/kernels_emulated.cpp compiles the kernels above as host code
 * (LOOM_KERNELS_EMULATED) and provides these launchers itself. */
#ifndef LOOM_KERNELS_EMULATED

static unsigned blocks(int64_t n)
{
    int64_t b = (n + THREADS - 1) / THREADS;
    return (unsigned)(b < 1 ? 1 : b > 65535 ? 65535 : b);
}

extern "C" {

cudaError_t lk_binary(cudaStream_t s, int op, int64_t n, const float *a, const float *b, float *out)
{
    k_binary<<<blocks(n), THREADS, 0, s>>>(op, n, a, b, out);
    return cudaGetLastError();
}

cudaError_t lk_axpy(cudaStream_t s, int64_t n, float alpha, const float *x, float *y)
{
    k_axpy<<<blocks(n), THREADS, 0, s>>>(n, alpha, x, y);
    return cudaGetLastError();
}

cudaError_t lk_scale(cudaStream_t s, int64_t n, float alpha, float *x)
{
    k_scale<<<blocks(n), THREADS, 0, s>>>(n, alpha, x);
    return cudaGetLastError();
}

cudaError_t lk_bias_act(cudaStream_t s, int act, int64_t rows, int64_t cols, const float *bias, float *x)
{
    k_bias_act<<<blocks(rows * cols), THREADS, 0, s>>>(act, rows, cols, bias, x);
    return cudaGetLastError();
}

cudaError_t lk_act_backward(cudaStream_t s, int act, int64_t n, const float *y, float *g)
{
    k_act_backward<<<blocks(n), THREADS, 0, s>>>(act, n, y, g);
    return cudaGetLastError();
}

cudaError_t lk_bias_grad(cudaStream_t s, int64_t rows, int64_t cols, const float *g, float *db)
{
    k_bias_grad<<<blocks(cols), THREADS, 0, s>>>(rows, cols, g, db);
    return cudaGetLastError();
}

cudaError_t lk_reduce(cudaStream_t s, int op, int64_t n, const float *x, float *out)
{
    k_reduce<<<1, THREADS, 0, s>>>(op, n, x, out);
    return cudaGetLastError();
}

cudaError_t lk_softmax_xent(cudaStream_t s, int64_t rows, int64_t classes, const float *z, const int32_t *labels,
                            float scale, float *loss, int32_t *hit, float *g)
{
    k_softmax_xent<<<blocks(rows), THREADS, 0, s>>>(rows, classes, z, labels, scale, loss, hit, g);
    return cudaGetLastError();
}

cudaError_t lk_im2col(cudaStream_t s, const kwin *w, const float *x, float *col)
{
    k_im2col<<<blocks((int64_t)w->batch * w->oh * w->ow * w->kh * w->kw * w->c), THREADS, 0, s>>>(*w, x, col);
    return cudaGetLastError();
}

cudaError_t lk_col2im(cudaStream_t s, const kwin *w, const float *col, float *dx)
{
    k_col2im<<<blocks((int64_t)w->batch * w->h * w->w * w->c), THREADS, 0, s>>>(*w, col, dx);
    return cudaGetLastError();
}

cudaError_t lk_maxpool_forward(cudaStream_t s, const kwin *w, const float *x, float *y, int32_t *argmax)
{
    k_maxpool_forward<<<blocks((int64_t)w->batch * w->oh * w->ow * w->c), THREADS, 0, s>>>(*w, x, y, argmax);
    return cudaGetLastError();
}

cudaError_t lk_maxpool_backward(cudaStream_t s, const kwin *w, const float *dy, const int32_t *argmax, float *dx)
{
    k_maxpool_backward<<<blocks((int64_t)w->batch * w->h * w->w * w->c), THREADS, 0, s>>>(*w, dy, argmax, dx);
    return cudaGetLastError();
}

} /* extern "C" */

#endif
