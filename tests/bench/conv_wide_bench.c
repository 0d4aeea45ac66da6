/* conv_wide_bench.c - the kernel gradient of ResNet-50's 1x1 convolutions (stride 1 and 2, 16-512 channels, batch
 * 32) by appliance/nn/conv_wide.c's direct kernel against OpenBLAS's sgemm (TN, the path layers.c runs: a stride-2
 * one first gathers its rows), side by side in one run: one thread each on half the kernel rows (one of the two
 * parts of a 2-thread step), the fastest of 9 interleaved runs, the ratio gemm / direct (> 1: direct is faster) and
 * their largest difference. The kernel set is the CPU's; LOOM_TEST_CPU=avx2 takes the AVX2 kernels and OpenBLAS's
 * Haswell ones. Usage: conv_wide_bench [batch] */
#include "nn/nn_internal.h"
#include "tensor/tensor.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); /* the thread's CPU time: steadier on a loaded machine */
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* the GEMM path's rows [0, k1): a stride-2 layer's im2col of a 1x1 kernel is a gather of its input rows */
static void gemm_grad(const nn_layer_ *l, const float *x, const float *dz, int B, int k1, float *col, float *dw)
{
    const int64_t nin = (int64_t)l->ih * l->iw * l->cin, P = (int64_t)l->oh * l->ow;
    const float *c = x;
    int ld = l->cin;
    if (l->sh != 1) {
        for (int b = 0; b < B; b++)
            for (int oy = 0; oy < l->oh; oy++)
                for (int ox = 0; ox < l->ow; ox++)
                    memcpy(col + (((int64_t)b * l->oh + oy) * l->ow + ox) * k1,
                           x + b * nin + ((int64_t)oy * l->sh * l->iw + ox * l->sw) * l->cin, (size_t)k1 * sizeof *x);
        c = col, ld = k1;
    }
    loom_sgemm(true, false, k1, l->cout, (int)(B * P), 1.f, c, ld, dz, l->cout, 0.f, dw, l->cout);
}

static void run(int hw, int cin, int cout, int s, int B, double *lsum, int *n)
{
    nn_layer_ l;
    memset(&l, 0, sizeof l);
    l.ih = l.iw = hw, l.cin = cin, l.cout = cout, l.kh = l.kw = 1, l.sh = l.sw = s, l.oh = l.ow = (hw - 1) / s + 1;
    l.fma = loom_cpu()->level >= LOOM_CPU_AVX512 ? 2 : loom_cpu()->level >= LOOM_CPU_AVX2_FMA;
    if (!nn_convp_ok_(&l)) {
        printf("%dx%d %d->%d stride %d: no direct kernel on this CPU\n", hw, hw, cin, cout, s);
        return;
    }
    const int64_t nin = (int64_t)hw * hw * cin, P = (int64_t)l.oh * l.ow;
    const int k1 = cin / 2;
    float *x = malloc((size_t)(B * nin) * sizeof *x), *dz = malloc((size_t)(B * P * cout) * sizeof *dz);
    float *dw = malloc((size_t)cin * cout * sizeof *dw), *dw2 = malloc((size_t)cin * cout * sizeof *dw2);
    float *col = malloc((size_t)(B * P * k1) * sizeof *col);
    for (int64_t i = 0; i < B * nin; i++) x[i] = (float)rand() / (float)RAND_MAX - 0.5f;
    for (int64_t i = 0; i < B * P * cout; i++) dz[i] = (float)rand() / (float)RAND_MAX - 0.5f;
    double td = 1e9, tg = 1e9, md = 0;
    for (int r = 0; r < 9; r++) {
        double t0 = now();
        nn_convp_kernel_grad_(&l, x, dz, B, 0, k1, dw);
        double t1 = now();
        gemm_grad(&l, x, dz, B, k1, col, dw2);
        double t2 = now();
        td = t1 - t0 < td ? t1 - t0 : td, tg = t2 - t1 < tg ? t2 - t1 : tg;
    }
    for (int64_t i = 0; i < (int64_t)k1 * cout; i++) md = fabs(dw[i] - dw2[i]) > md ? fabs(dw[i] - dw2[i]) : md;
    double fl = 2.0 * k1 * cout * (double)(B * P);
    printf("%2dx%-2d %3d->%-3d stride %d  direct %7.2f ms %6.1f GFLOP/s  gemm %7.2f ms %6.1f GFLOP/s  "
           "gemm/direct %.2f  max diff %.2g\n",
           l.oh, l.ow, cin, cout, s, td * 1e3, fl / td * 1e-9, tg * 1e3, fl / tg * 1e-9, tg / td, md);
    *lsum += log(tg / td), ++*n;
    free(x), free(dz), free(dw), free(dw2), free(col);
}

int main(int argc, char **argv)
{
    int B = argc > 1 ? atoi(argv[1]) : 32;
    loom_err err;
    memset(&err, 0, sizeof err);
    if (loom_blas_init(1, &err)) {
        fprintf(stderr, "conv_wide_bench: no BLAS: %s\n", err.msg);
        return 1;
    }
    printf("batch %d, one thread, BLAS %s, %s kernels\n", B, loom_blas_core(),
           loom_cpu()->level >= LOOM_CPU_AVX512 ? "AVX-512" : "AVX2");
    /* ResNet-50's 1x1 convolutions within 16-512 channels (output size, input channels, output channels, stride) */
    static const int shapes[][4] = {{56, 64, 64, 1},  {56, 64, 256, 1},  {56, 256, 64, 1},  {56, 256, 128, 2},
                                    {56, 256, 512, 2}, {28, 128, 512, 1}, {28, 512, 128, 1}, {28, 512, 256, 2}};
    double lsum = 0;
    int n = 0;
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        run(shapes[i][0], shapes[i][1], shapes[i][2], shapes[i][3], B, &lsum, &n);
    if (n) printf("geometric mean gemm/direct %.2f\n", exp(lsum / n));
    return 0;
}
