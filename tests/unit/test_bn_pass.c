/* test_bn_pass.c - batch normalization's passes over the batch (bn_pass.c), white box: at C = 16, 32
 * and 64 they run the channel-count-specialised kernels of bn_kern_internal.h at loom_cpu()'s level
 * (AVX-512, or AVX2 under LOOM_TEST_CPU=avx2), elsewhere the generic loops. Every pass must give the
 * bits of the generic loops' arithmetic, written out here once more: per fixed block of rows, each
 * channel's sums in double in row order, no fused multiply-adds; the backward's gradient rows split
 * over chunks at odd places. */
#include "harness.h"
#include "nn/nn.h"
#include "nn/nn_internal.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define REF __attribute__((optimize("fp-contract=off"), noinline))
#define NB_MAX 32 /* bn_pass.c's NN_BN_BLOCKS */

static int64_t blocks(int64_t rows) { return rows < NB_MAX ? rows : NB_MAX; }

/* The batch's mean and biased variance as bn_pass.c's generic loops: per block its mean and squares
 * about it, then the blocks combined in order (Chan et al.). */
REF static void ref_moments(const float *x, int64_t rows, int64_t C, double *mean, double *var)
{
    const int64_t nb = blocks(rows);
    double *s = calloc((size_t)(nb * C), sizeof(double)), *q = calloc((size_t)(nb * C), sizeof(double));
    for (int64_t b = 0; b < nb; b++) {
        int64_t r0 = rows * b / nb, r1 = rows * (b + 1) / nb;
        for (int64_t r = r0; r < r1; r++)
            for (int64_t k = 0; k < C; k++) s[b * C + k] += x[r * C + k];
        for (int64_t k = 0; k < C; k++) s[b * C + k] /= (double)(r1 - r0);
        for (int64_t r = r0; r < r1; r++)
            for (int64_t k = 0; k < C; k++) {
                double d = (double)x[r * C + k] - s[b * C + k];
                q[b * C + k] += d * d;
            }
    }
    for (int64_t k = 0; k < C; k++) mean[k] = var[k] = 0;
    for (int64_t b = 0; b < nb; b++)
        for (int64_t k = 0; k < C; k++) mean[k] += (double)(rows * (b + 1) / nb - rows * b / nb) * s[b * C + k];
    for (int64_t k = 0; k < C; k++) mean[k] /= (double)rows;
    for (int64_t b = 0; b < nb; b++)
        for (int64_t k = 0; k < C; k++) {
            double n = (double)(rows * (b + 1) / nb - rows * b / nb), d = s[b * C + k] - mean[k];
            var[k] += q[b * C + k] + n * d * d;
        }
    for (int64_t k = 0; k < C; k++) var[k] /= (double)rows;
    free(s);
    free(q);
}

/* How many of y's n values are not gamma (x - mean) rstd + beta's bits (relu: then layers.c's relu). */
REF static int ref_normalize_diff(const float *x, const float *y, int64_t n, int64_t C, const float *mean,
                                  const float *rstd, const float *gamma, const float *beta, int relu)
{
    int bad = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t k = i % C;
        float h = (x[i] - mean[k]) * rstd[k], want = gamma[k] * h + beta[k];
        if (relu) want = want > 0.f ? want : 0.f;
        bad += memcmp(&want, &y[i], 4) != 0;
    }
    return bad;
}

/* The backward's sums of g and g xhat (per block in row order, blocks in order), then g in place. */
REF static void ref_backward(float *g, const float *x, int64_t rows, int64_t C, const float *mean, const float *rstd,
                             const float *gamma, double *sg, double *sgh)
{
    const int64_t nb = blocks(rows);
    double *a = calloc((size_t)(2 * nb * C), sizeof(double)), *b2 = a + nb * C;
    for (int64_t b = 0; b < nb; b++)
        for (int64_t r = rows * b / nb; r < rows * (b + 1) / nb; r++)
            for (int64_t k = 0; k < C; k++) {
                float h = (x[r * C + k] - mean[k]) * rstd[k];
                a[b * C + k] += g[r * C + k];
                b2[b * C + k] += (double)g[r * C + k] * h;
            }
    for (int64_t k = 0; k < C; k++) sg[k] = sgh[k] = 0;
    for (int64_t b = 0; b < nb; b++)
        for (int64_t k = 0; k < C; k++) sg[k] += a[b * C + k], sgh[k] += b2[b * C + k];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t k = 0; k < C; k++) {
            float h = (x[r * C + k] - mean[k]) * rstd[k], gr = gamma[k] * rstd[k];
            float mg = (float)(sg[k] / (double)rows), mgh = (float)(sgh[k] / (double)rows);
            g[r * C + k] = gr * (g[r * C + k] - mg - h * mgh);
        }
    free(a);
}

static float frand(uint64_t *s)
{
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float)((*s >> 40) & 0xffffff) / 16777216.0f * 4.0f - 1.5f;
}

/* One batch of B examples of R rows of C channels through the four passes against the reference. relu: the
 * layer's bn_relu, against the unfused composition: the reference's output through layers.c's relu, and the
 * gradient masked where that output is not > 0 before the reference's backward. */
static void check_passes(int64_t C, int64_t B, int64_t R, uint64_t seed, int relu)
{
    static loom_model m; /* no pool: the blocks run in turn (the threads' bits are graph.sh's) */
    const int64_t rows = B * R, n = rows * C;
    nn_layer_ l = {.C = C, .n_out = R * C, .bn_relu = relu, .kernel_off = 0, .bias_off = C};
    l.stat = aligned_alloc(64, (size_t)((nn_bn_stat_floats_(C) * 4 + 63) / 64 * 64));
    float *x = malloc((size_t)n * 4), *y = malloc((size_t)n * 4), *g = malloc((size_t)n * 4), *gr = malloc((size_t)n * 4);
    float *gamma = malloc((size_t)C * 4), *beta = malloc((size_t)C * 4), *rstd = l.stat + C;
    double *mean = malloc((size_t)C * 32), *var = mean + C, *rm = var + C, *rv = rm + C;
    for (int64_t i = 0; i < n; i++) x[i] = frand(&seed) * (1 + (float)(i % C)), g[i] = gr[i] = frand(&seed);
    for (int64_t k = 0; k < C; k++) gamma[k] = 1 + frand(&seed) / 4, beta[k] = frand(&seed);
    float *params = malloc((size_t)(2 * C) * 4); /* gamma, beta at the layer's offsets */
    memcpy(params, gamma, (size_t)C * 4), memcpy(params + C, beta, (size_t)C * 4);
    m.params = params;
    l.y = y;
    l.bn_x = x;

    nn_bn_moments_(&m, &l, x, rows, mean, var);
    ref_moments(x, rows, C, rm, rv);
    CHECK_MSG(!memcmp(mean, rm, (size_t)C * 8) && !memcmp(var, rv, (size_t)C * 8), "C %lld rows %lld: moments",
              (long long)C, (long long)rows);
    for (int64_t k = 0; k < C; k++) l.stat[k] = (float)mean[k], rstd[k] = (float)(1 / sqrt(var[k] + 1e-3));
    nn_bn_normalize_(&m, &l, x, rows, l.stat, rstd, gamma, beta);
    int bad = ref_normalize_diff(x, y, n, C, l.stat, rstd, gamma, beta, relu);
    CHECK_MSG(!bad, "C %lld rows %lld relu %d: normalize, %d values not the generic bits", (long long)C,
              (long long)rows, relu, bad);
    if (relu) { /* the relu's backward on the reference's gradient, from the output (layers.c act_grad_colsum) */
        int64_t zeros = 0;
        for (int64_t i = 0; i < n; i++) gr[i] = y[i] > 0.f ? gr[i] : 0.f, zeros += y[i] == 0.f;
        CHECK_MSG(zeros > 0 && zeros < n, "C %lld rows %lld: the relu cuts %lld of %lld outputs", (long long)C,
                  (long long)rows, (long long)zeros, (long long)n);
    }

    /* the gradient rows in two chunks, the first of B / 3 examples: a block straddles them */
    nn_chunk_ ch[2] = {{.b0 = 0, .B = B / 3}, {.b0 = B / 3, .B = B - B / 3}};
    ch[0].g = g, ch[1].g = g + B / 3 * R * C;
    double sg[64], sgh[64], rsg[64], rsgh[64];
    nn_bn_grad_sums_(&m, &l, ch, 2, B, sg, sgh);
    ref_backward(gr, x, rows, C, l.stat, rstd, gamma, rsg, rsgh);
    CHECK_MSG(!memcmp(sg, rsg, (size_t)C * 8) && !memcmp(sgh, rsgh, (size_t)C * 8),
              "C %lld rows %lld relu %d: gradient sums", (long long)C, (long long)rows, relu);
    nn_bn_grad_apply_(&m, &l, ch, 2, B, gamma, rstd, sg, sgh, (double)rows);
    CHECK_MSG(!memcmp(g, gr, (size_t)n * 4), "C %lld rows %lld relu %d: input gradient", (long long)C, (long long)rows,
              relu);
    m.params = NULL;
    free(l.stat), free(x), free(y), free(g), free(gr), free(gamma), free(beta), free(mean), free(params);
}

static void test_passes(void)
{
    printf("# kernels at %s\n", loom_cpu_level_name(loom_cpu()->level));
    const int64_t cs[] = {16, 32, 64, 8, 24};
    for (int relu = 0; relu < 2; relu++)
        for (int i = 0; i < 5; i++) {
            check_passes(cs[i], 7, 9, 11 + (uint64_t)i, relu);      /* 63 rows: blocks of 1 and 2 */
            check_passes(cs[i], 13, 7 * 7, 3 + (uint64_t)i, relu);  /* blocks of ~20 rows */
            check_passes(cs[i], 2, relu ? 3 : 1, 5, relu);          /* fewer rows than blocks */
            /* blocks of 122 or 123 rows: tiles of 64 and the rest */
            check_passes(cs[i], 5, 28 * 28, 7 + (uint64_t)i, relu);
        }
}

static const loom_test tests[] = {
    {"batch normalization passes, alone and with a relu fused (bn_relu): the generic loops' bits and the unfused "
     "relu's at C = 16, 32, 64 and others", test_passes},
    {0},
};

int main(void) { return loom_test_run(tests); }
