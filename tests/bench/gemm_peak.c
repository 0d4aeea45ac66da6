/* gemm_peak.c - single-precision GEMM throughput through Loom's BLAS loader.
 *
 * Measures loom_sgemm GFLOP/s at 1 and 2 threads (or the counts given with
 * -t), at 1024^3 (the "peak") and at the shapes the Fashion-MNIST MLP and
 * CNN actually run at batch 128, and the GEMM-only time of one whole MLP
 * training step (the samples/s no MLP implementation on this BLAS can beat:
 * loom_sgemm_bound, the fastest repetitions, as `loom profile --train`).
 * Each figure is the median of -r repetitions (gflops_max: the fastest one,
 * closer to the true peak when other processes share the cores); a repetition repeats the call
 * until it has run for at least ~20 ms, so small shapes are not lost in
 * timer noise. Prints one JSON object on stdout; progress on stderr.
 *
 *   gemm_peak [-t 1,2] [-r 7] [-q]      -q: only 1024^3 and the MLP shapes
 */
#include "tensor/tensor.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct shape {
    const char *name;
    bool ta, tb;
    int  M, N, K;
    bool quick; /* part of the -q set */
} shape;

/* Batch 128. Row-major C(M,N) = op(A)(M,K) op(B)(K,N), as the layers call it:
 * forward y = x W (x (B,in), W (in,out)); dW = x^T dy; dx = dy W^T. */
static const shape shapes[] = {
    {"square_1024", false, false, 1024, 1024, 1024, true},
    {"mlp_fwd1_128x256x784", false, false, 128, 256, 784, true},
    {"mlp_fwd2_128x128x256", false, false, 128, 128, 256, true},
    {"mlp_fwd3_128x10x128", false, false, 128, 10, 128, true},
    {"mlp_dw1_784x256x128", true, false, 784, 256, 128, true},
    {"mlp_dw2_256x128x128", true, false, 256, 128, 128, true},
    {"mlp_dw3_128x10x128", true, false, 128, 10, 128, true},
    {"mlp_dx2_128x256x128", false, true, 128, 256, 128, true},
    {"mlp_dx3_128x128x10", false, true, 128, 128, 10, true},
    /* CNN via im2col: conv1 (B*28*28, 5*5*1) x (25, 32); conv2 (B*14*14, 5*5*32) x (800, 64). */
    {"cnn_conv1_100352x32x25", false, false, 128 * 28 * 28, 32, 25, false},
    {"cnn_conv2_25088x64x800", false, false, 128 * 14 * 14, 64, 800, false},
    {"cnn_dense_128x128x3136", false, false, 128, 128, 3136, false},
};
enum { NSHAPES = sizeof shapes / sizeof shapes[0] };
/* The GEMMs of one MLP training step (forward, dW for all layers, dx for layers 2-3). */
static const char *mlp_step[] = {"mlp_fwd1_128x256x784", "mlp_fwd2_128x128x256", "mlp_fwd3_128x10x128",
                                 "mlp_dw1_784x256x128",  "mlp_dw2_256x128x128",  "mlp_dw3_128x10x128",
                                 "mlp_dx2_128x256x128",  "mlp_dx3_128x128x10"};
enum { NSTEP = sizeof mlp_step / sizeof mlp_step[0] };

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static float *make(size_t n)
{
    float *p = loom_alloc_aligned(n * sizeof(float));
    if (!p) {
        fprintf(stderr, "gemm_peak: out of memory (%zu floats)\n", n);
        exit(1);
    }
    for (size_t i = 0; i < n; i++) p[i] = (float)((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
    return p;
}

static void run(const shape *s, const float *A, const float *B, float *C)
{
    int lda = s->ta ? s->M : s->K, ldb = s->tb ? s->K : s->N;
    loom_sgemm(s->ta, s->tb, s->M, s->N, s->K, 1.0f, A, lda, B, ldb, 0.0f, C, s->N);
}

/* Median seconds per call of shape s over reps repetitions; *best gets the fastest. */
static double time_shape(const shape *s, int reps, float *A, float *B, float *C, double *best)
{
    run(s, A, B, C); /* warm-up: threads, caches, page faults */
    run(s, A, B, C);
    double t0 = loom_now();
    int calls = 0;
    do {
        run(s, A, B, C);
        calls++;
    } while (loom_now() - t0 < 0.02);
    double v[64];
    for (int r = 0; r < reps; r++) {
        t0 = loom_now();
        for (int i = 0; i < calls; i++) run(s, A, B, C);
        v[r] = (loom_now() - t0) / calls;
    }
    double m = median(v, reps); /* sorts v */
    *best = v[0];
    return m;
}

int main(int argc, char **argv)
{
    int threads[8] = {1, 2}, nthreads = 2, reps = 7;
    bool quick = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-t") && i + 1 < argc) {
            nthreads = 0;
            for (char *p = argv[++i]; *p && nthreads < 8;) {
                threads[nthreads++] = (int)strtol(p, &p, 10);
                if (*p == ',') p++;
                else if (*p) break;
            }
        } else if (!strcmp(argv[i], "-r") && i + 1 < argc) {
            reps = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "-q")) {
            quick = true;
        } else {
            fprintf(stderr, "usage: gemm_peak [-t 1,2] [-r reps] [-q]\n");
            return 2;
        }
    }
    if (reps < 1) reps = 1;
    if (reps > 64) reps = 64;
    int maxt = 1;
    for (int i = 0; i < nthreads; i++) {
        if (threads[i] < 1) threads[i] = 1;
        if (threads[i] > maxt) maxt = threads[i];
    }

    loom_err err = {0};
    /* Initialise at the largest count: OpenBLAS sizes its pool once; fewer threads are set per run. */
    if (loom_blas_init(maxt, &err) != LOOM_OK) {
        char buf[1024];
        loom_err_format(&err, buf, sizeof buf);
        fprintf(stderr, "gemm_peak: %s\n", buf);
        return 1;
    }

    size_t maxa = 0, maxb = 0, maxc = 0;
    for (int i = 0; i < NSHAPES; i++) {
        size_t a = (size_t)shapes[i].M * shapes[i].K, b = (size_t)shapes[i].K * shapes[i].N,
               c = (size_t)shapes[i].M * shapes[i].N;
        if (a > maxa) maxa = a;
        if (b > maxb) maxb = b;
        if (c > maxc) maxc = c;
    }
    float *A = make(maxa), *B = make(maxb), *C = make(maxc);

    printf("{\"core\":\"%s\",\"core_reason\":\"%s\",\"reps\":%d,\"runs\":[", loom_blas_core(),
           loom_blas_core_reason(), reps);
    double peak[8] = {0}, peak_max[8] = {0};
    for (int ti = 0; ti < nthreads; ti++) {
        loom_blas_set_threads(threads[ti]);
        double secs[NSHAPES] = {0};
        printf("%s{\"threads\":%d,\"shapes\":[", ti ? "," : "", threads[ti]);
        int first = 1;
        for (int i = 0; i < NSHAPES; i++) {
            const shape *s = &shapes[i];
            if (quick && !s->quick) continue;
            double best;
            secs[i] = time_shape(s, reps, A, B, C, &best);
            double gf = 2.0 * s->M * s->N * s->K / secs[i] / 1e9, gf_max = 2.0 * s->M * s->N * s->K / best / 1e9;
            if (i == 0) peak[ti] = gf, peak_max[ti] = gf_max;
            fprintf(stderr, "gemm_peak: threads=%d %-26s %9.3f ms %8.1f GFLOP/s\n", threads[ti], s->name,
                    secs[i] * 1e3, gf);
            printf("%s{\"name\":\"%s\",\"ta\":%s,\"tb\":%s,\"M\":%d,\"N\":%d,\"K\":%d,\"ms\":%.5f,\"gflops\":%.2f,\"gflops_max\":%.2f}",
                   first ? "" : ",", s->name, s->ta ? "true" : "false", s->tb ? "true" : "false", s->M, s->N,
                   s->K, secs[i] * 1e3, gf, gf_max);
            first = 0;
        }
        /* GEMM-only time of one MLP training step: loom_sgemm_bound of each
         * product, the bound `loom profile --train` prints (the fastest
         * repetition of one BLAS thread, all of them, or the rows split) */
        double step = 0, flops = 0;
        for (int j = 0; j < NSTEP; j++)
            for (int i = 0; i < NSHAPES; i++)
                if (!strcmp(shapes[i].name, mlp_step[j])) {
                    const shape *s = &shapes[i];
                    double b = loom_sgemm_bound(s->ta, s->tb, s->M, s->N, s->K, threads[ti], reps);
                    if (b < 0) {
                        fprintf(stderr, "gemm_peak: out of memory\n");
                        return 1;
                    }
                    step += b;
                    flops += 2.0 * s->M * s->N * s->K;
                }
        loom_blas_set_threads(threads[ti]);
        printf("],\"peak_gflops\":%.2f,\"mlp_step_gemm_ms\":%.5f,\"mlp_step_gflops\":%.2f,"
               "\"mlp_gemm_bound_samples_per_sec\":%.0f}",
               peak[ti], step * 1e3, flops / step / 1e9, 128.0 / step);
        fprintf(stderr, "gemm_peak: threads=%d MLP step GEMMs %.3f ms = %.0f samples/s GEMM bound\n", threads[ti],
                step * 1e3, 128.0 / step);
    }
    printf("],\"peak_gflops\":{");
    for (int ti = 0; ti < nthreads; ti++) printf("%s\"%d\":%.2f", ti ? "," : "", threads[ti], peak[ti]);
    printf("},\"peak_gflops_max\":{");
    for (int ti = 0; ti < nthreads; ti++) printf("%s\"%d\":%.2f", ti ? "," : "", threads[ti], peak_max[ti]);
    printf("}}\n");
    loom_free(A);
    loom_free(B);
    loom_free(C);
    return 0;
}
