/* bn_pass.c - batch normalization's passes over the whole batch, on the model's pool.
 * A batch normalization runs between two phases of the chunks (model.c), once over the batch:
 * run on one thread, its three passes over the activations left the other cores idle for a
 * fifth of a ResNet step. Here the rows go in NN_BN_BLOCKS fixed blocks (bounds from the row
 * count alone), each block's per-channel sums in double in row order, then the blocks' sums
 * added in block order: the bits depend on the batch, never on the threads or the chunks.
 * xhat is not kept: the backward recomputes it from the forward's input rows (bn_x), which the
 * layer before keeps for the step anyway, with the forward's expression, so to the same bits;
 * a buffer of the layer's output size less per batch normalization.
 * Threads: the blocks run on m->pool; each writes only its own rows and its own partial sums. */
#include <stdint.h>
#include <string.h>

#include "nn_internal.h"
#include "kernel_internal.h"

#define NN_BN_BLOCKS 32            /* the partial sums' room in stat: nn_bn_stat_floats_ */
#define NN_BN_PARALLEL (1 << 15)   /* below this many elements the pool's wake-up costs more than it saves */

int64_t nn_bn_stat_floats_(int64_t C) { return 12 * C + 2 + 4 * NN_BN_BLOCKS * C + 3 * C; }

/* The blocks' partial sums: 2 NN_BN_BLOCKS C doubles after the 12 C + 2 floats of stat (an even float
 * offset on a 64-byte aligned buffer, so 8-byte aligned). */
static double *bn_parts(const nn_layer_ *l) { return (double *)(l->stat + 12 * l->C + 2); }
/* Then the backward's per-channel factors: gamma rstd, mean(g), mean(g xhat) (3 C floats). */
static float *bn_coef(const nn_layer_ *l) { return l->stat + 12 * l->C + 2 + 4 * NN_BN_BLOCKS * l->C; }

/* The passes vectorised for the machine (tensor.h LOOM_CLONES, with BN_OPT on each clone): each
 * channel's sum still runs over the rows in order, and with no contraction into fused multiply-adds
 * every clone computes the same bits as the baseline one. */
#define BN_OPT __attribute__((optimize("fp-contract=off")))

/* ---- the passes with the channel count a constant (ResNet's 16, 32, 64), on Loom's own ISA choice ----
 * The generic loops above ran at ~14 cycles per element at C = 16: a runtime C leaves gcc a short inner
 * loop per row with its remainder and alias checks. Here (bn_kern_internal.h) the sums' passes hold every
 * channel's sums in registers over the block's rows (where they fit: bn_sums_fast), the element-wise ones
 * go row by row, with the generic loops' operations in their order: the same bits on every ISA
 * (test_bn_pass). The level is loom_cpu()'s (LOOM_TEST_CPU=avx2 runs the AVX2 path), as the clones'. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define BN_FAST 1
typedef enum { BN_MOMENTS, BN_NORMALIZE, BN_SUMS, BN_APPLY } bn_op;
typedef struct bn_args {
    const float *x, *g0;
    float *y, *g;
    int64_t r0, r1, n;
    const float *mean, *rstd, *p, *q, *u; /* normalize: gamma, beta; apply: gr, mg, mgh */
    const float *ga, *be;                 /* sums, apply with relu: gamma, beta (the output's sign) */
    int relu;                             /* the layer's bn_relu */
    double *s, *t;
} bn_args;

#define BN_W 8
#define BN_SFX 512
#define BN_ATTR __attribute__((target("avx512f,avx2"), optimize("fp-contract=off")))
#include "bn_kern_internal.h"
#undef BN_W
#undef BN_SFX
#undef BN_ATTR
#define BN_W 4
#define BN_SFX 256
#define BN_ATTR __attribute__((target("avx2"), optimize("fp-contract=off")))
#include "bn_kern_internal.h"
#undef BN_W
#undef BN_SFX
#undef BN_ATTR

static void bn_pass(int lvl, int C, bn_op op, const bn_args *a)
{
    if (lvl == 2) bn_pass512(op, C, a);
    else bn_pass256(op, C, a);
}
#else
#define BN_FAST 0
#endif

/* g where v > 0, else +0: the relu's backward (v > 0 ? g : 0) as a mask of bits, which gcc vectorises (the
 * select it left as a branch per element: ten times slower). */
static inline float relu_keep(float g, float v)
{
    uint32_t b;
    memcpy(&b, &g, sizeof b);
    b &= -(uint32_t)(v > 0.f);
    memcpy(&g, &b, sizeof g);
    return g;
}

static int bn_blocks(int64_t rows) { return rows < NN_BN_BLOCKS ? (int)rows : NN_BN_BLOCKS; }

/* Whether the sums (moments, gradient sums) of a block of `rows` rows at level lvl take the BN_FAST path:
 * where one group of registers holds every channel's sums (AVX-512: C <= 32, AVX2: C = 16), or on AVX2 where
 * the block stays in L2 (BN_FAST_BLOCK bytes). Past both, each group reads the block's rows again a cache line
 * in four, and at 56x56x64 (ResNet-50, 800 KB blocks) the hardware's prefetch did not follow: twice the
 * generic loops' time on AVX2. The element-wise passes take it at 16, 32 and 64. */
#define BN_FAST_BLOCK (256 << 10)
static int bn_sums_fast(int lvl, int64_t C, int64_t rows)
{
    return lvl == 2 ? C <= 32 : lvl == 1 && (C <= 16 || rows * C * (int64_t)sizeof(float) <= BN_FAST_BLOCK);
}

/* The BN_FAST passes' level for layer l: 0 where they do not apply. */
static int bn_level(const nn_layer_ *l)
{
#if BN_FAST
    if (l->C != 16 && l->C != 32 && l->C != 64) return 0;
    return loom_cpu()->level >= LOOM_CPU_AVX512 ? 2 : loom_cpu()->level >= LOOM_CPU_AVX2_FMA;
#else
    (void)l;
    return 0;
#endif
}

typedef struct bn_job {
    const nn_layer_ *l;
    int64_t rows, R;             /* rows of the batch; rows per example (backward: chunk row bounds) */
    int nb;                      /* blocks */
    int lvl;                     /* the BN_FAST passes' ISA: 2 AVX-512, 1 AVX2, 0 the generic loops */
    const float *x;              /* forward: (rows, C) */
    const nn_chunk_ *chunk;      /* backward: the gradient rows, chunk by chunk */
    int nchunks;
    const float *a, *b, *c;      /* per channel: forward mean, rstd, (gamma, beta in e, f); backward gamma*rstd, mg, mgh */
    const float *e, *f;
    const float *ga, *be;        /* backward with bn_relu: gamma, beta, for the output's sign (else NULL) */
    float *y;
    float *d;                    /* backward apply: the input gradient's rows (bn_dx_dz: the conv's dz), else NULL:
                                    in place in the chunks' gradient rows */
} bn_job;

static void block_rows(const bn_job *j, int blk, int64_t *r0, int64_t *r1)
{
    *r0 = j->rows * blk / j->nb;
    *r1 = j->rows * (blk + 1) / j->nb;
}

/* The gradient rows [r, *end) that lie in one chunk, from global row r. */
static float *chunk_rows(const bn_job *j, int64_t r, int64_t r1, int64_t *end)
{
    for (int t = 0; t < j->nchunks; t++) {
        const nn_chunk_ *c = &j->chunk[t];
        int64_t a = c->b0 * j->R, z = (c->b0 + c->B) * j->R;
        if (r >= a && r < z) {
            *end = z < r1 ? z : r1;
            return c->g + (r - a) * j->l->C;
        }
    }
    LOOM_ASSERT(!"a batch normalization row outside every chunk");
    return NULL;
}

static void run_blocks(const loom_model *m, bn_job *j, loom_pool_fn fn)
{
    loom_pool_run(j->rows * j->l->C >= NN_BN_PARALLEL ? m->pool : NULL, j->nb, fn, j);
}

/* Block blk's mean of x and its sum of (x - block mean)^2, per channel (the second nb C after the
 * first): the block's rows read twice while they are in cache, where a variance about the batch
 * mean read the whole batch again. */
static inline LOOM_CLONE_BODY void moments_block_body(void *arg, int blk)
{
    const bn_job *j = arg;
    const int64_t C = j->l->C;
    double *restrict s = bn_parts(j->l) + (int64_t)blk * C, *restrict q = s + (int64_t)j->nb * C;
    int64_t r0, r1;
    block_rows(j, blk, &r0, &r1);
#if BN_FAST
    if (bn_sums_fast(j->lvl, C, r1 - r0)) {
        bn_pass(j->lvl, (int)C, BN_MOMENTS, &(bn_args){.x = j->x, .r0 = r0, .r1 = r1, .s = s, .t = q});
        return;
    }
#endif
    for (int64_t k = 0; k < C; k++) s[k] = q[k] = 0;
    const float *restrict x = j->x;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t k = 0; k < C; k++) s[k] += x[r * C + k];
    const double n = (double)(r1 - r0);
    for (int64_t k = 0; k < C; k++) s[k] /= n;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t k = 0; k < C; k++) {
            double d = (double)x[r * C + k] - s[k];
            q[k] += d * d;
        }
}
LOOM_CLONES(BN_OPT, void, moments_block, (void *arg, int blk), (arg, blk))

/* The blocks' partials (nb, C) summed in block order into out (C). */
static void sum_blocks(const double *p, int nb, int64_t C, double *out)
{
    for (int64_t k = 0; k < C; k++) out[k] = 0;
    for (int b = 0; b < nb; b++)
        for (int64_t k = 0; k < C; k++) out[k] += p[(int64_t)b * C + k];
}

/* mean (C) and the biased variance (C), from the blocks in block order: the means weighted by their
 * rows, the squares about each block's mean moved to the batch's (Chan et al.:
 * q_b + n_b (mean_b - mean)^2). */
void nn_bn_moments_(const loom_model *m, const nn_layer_ *l, const float *x, int64_t rows, double *mean, double *var)
{
    bn_job j = {.l = l, .rows = rows, .nb = bn_blocks(rows), .lvl = bn_level(l), .x = x};
    const int64_t C = l->C;
    run_blocks(m, &j, moments_block);
    const double *p = bn_parts(l), *q = p + (int64_t)j.nb * C;
    for (int64_t k = 0; k < C; k++) mean[k] = var[k] = 0;
    for (int b = 0; b < j.nb; b++) {
        int64_t r0, r1;
        block_rows(&j, b, &r0, &r1);
        for (int64_t k = 0; k < C; k++) mean[k] += (double)(r1 - r0) * p[(int64_t)b * C + k];
    }
    for (int64_t k = 0; k < C; k++) mean[k] /= (double)rows;
    for (int b = 0; b < j.nb; b++) {
        int64_t r0, r1;
        block_rows(&j, b, &r0, &r1);
        const double n = (double)(r1 - r0);
        for (int64_t k = 0; k < C; k++) {
            double d = p[(int64_t)b * C + k] - mean[k];
            var[k] += q[(int64_t)b * C + k] + n * d * d;
        }
    }
    for (int64_t k = 0; k < C; k++) var[k] /= (double)rows; /* biased, as Keras normalises and moves */
}

static inline LOOM_CLONE_BODY void normalize_block_body(void *arg, int blk)
{
    const bn_job *j = arg;
    const int64_t C = j->l->C;
    const float *restrict x = j->x, *restrict mean = j->a, *restrict rstd = j->b, *restrict gamma = j->e,
                          *restrict beta = j->f;
    float *restrict y = j->y;
    int64_t r0, r1;
    block_rows(j, blk, &r0, &r1);
#if BN_FAST
    if (j->lvl) {
        bn_pass(j->lvl, (int)C, BN_NORMALIZE,
                &(bn_args){.x = x, .y = y, .r0 = r0, .r1 = r1, .mean = mean, .rstd = rstd, .p = gamma, .q = beta,
                           .relu = j->l->bn_relu});
        return;
    }
#endif
    if (!j->l->bn_relu)
        for (int64_t r = r0; r < r1; r++)
            for (int64_t k = 0; k < C; k++) {
                float h = (x[r * C + k] - mean[k]) * rstd[k];
                y[r * C + k] = gamma[k] * h + beta[k];
            }
    else /* then the relu's forward (layers.c bias_act) */
        for (int64_t r = r0; r < r1; r++)
            for (int64_t k = 0; k < C; k++) {
                float h = (x[r * C + k] - mean[k]) * rstd[k], v = gamma[k] * h + beta[k];
                y[r * C + k] = v > 0.f ? v : 0.f;
            }
}
LOOM_CLONES(BN_OPT, void, normalize_block, (void *arg, int blk), (arg, blk))

void nn_bn_normalize_(const loom_model *m, const nn_layer_ *l, const float *x, int64_t rows, const float *mean,
                      const float *rstd, const float *gamma, const float *beta)
{
    bn_job j = {.l = l, .rows = rows, .nb = bn_blocks(rows), .lvl = bn_level(l), .x = x, .a = mean, .b = rstd, .e = gamma, .f = beta,
                .y = l->y};
    run_blocks(m, &j, normalize_block);
}

/* Block blk's sums of g and g * xhat over its rows (C each, the second after nb C). */
static inline LOOM_CLONE_BODY void grad_sums_block_body(void *arg, int blk)
{
    const bn_job *j = arg;
    const int64_t C = j->l->C;
    double *restrict sg = bn_parts(j->l) + (int64_t)blk * C, *restrict sgh = sg + (int64_t)j->nb * C;
    int64_t r0, r1;
    block_rows(j, blk, &r0, &r1);
    for (int64_t k = 0; k < C; k++) sg[k] = sgh[k] = 0;
    const float *restrict mean = j->l->stat, *restrict rstd = mean + C, *restrict ga = j->ga, *restrict be = j->be;
    for (int64_t r = r0, e; r < r1; r = e) {
        const float *restrict g = chunk_rows(j, r, r1, &e), *restrict x = j->l->bn_x + r * C;
#if BN_FAST
        if (bn_sums_fast(j->lvl, C, r1 - r0) || (ga && j->lvl)) { /* the generic masked loop is not vectorised */
            bn_pass(j->lvl, (int)C, BN_SUMS,
                    &(bn_args){.g0 = g, .x = x, .n = e - r, .mean = mean, .rstd = rstd, .s = sg, .t = sgh, .ga = ga,
                               .be = be, .relu = ga != NULL});
            continue;
        }
#endif
        if (!ga)
            for (int64_t q = 0; q < (e - r) * C; q += C)
                for (int64_t k = 0; k < C; k++) {
                    float h = (x[q + k] - mean[k]) * rstd[k]; /* xhat, as the forward computed it */
                    sg[k] += g[q + k];
                    sgh[k] += (double)g[q + k] * h;
                }
        else /* the relu's backward (bn_relu) first: g where the forward's output was > 0 */
            for (int64_t q = 0; q < (e - r) * C; q += C)
                for (int64_t k = 0; k < C; k++) {
                    float h = (x[q + k] - mean[k]) * rstd[k], gv = relu_keep(g[q + k], ga[k] * h + be[k]);
                    sg[k] += gv;
                    sgh[k] += (double)gv * h;
                }
    }
}
LOOM_CLONES(BN_OPT, void, grad_sums_block, (void *arg, int blk), (arg, blk))

void nn_bn_grad_sums_(const loom_model *m, const nn_layer_ *l, const nn_chunk_ *chunk, int nchunks, int64_t B,
                      double *sg, double *sgh)
{
    const int64_t R = l->n_out / l->C;
    bn_job j = {.l = l, .rows = B * R, .R = R, .nb = bn_blocks(B * R), .lvl = bn_level(l), .chunk = chunk,
                .nchunks = nchunks};
    if (l->bn_relu) j.ga = m->params + l->kernel_off, j.be = m->params + l->bias_off;
    run_blocks(m, &j, grad_sums_block);
    sum_blocks(bn_parts(l), j.nb, l->C, sg);
    sum_blocks(bn_parts(l) + (int64_t)j.nb * l->C, j.nb, l->C, sgh);
}

/* dx = gamma rstd (g - mean(g) - xhat mean(g xhat)), block blk's rows: in place in g, or into j->d's rows. */
static inline LOOM_CLONE_BODY void grad_apply_block_body(void *arg, int blk)
{
    const bn_job *j = arg;
    const int64_t C = j->l->C;
    const float *restrict gr = j->a, *restrict mg = j->b, *restrict mgh = j->c;
    const float *restrict mean = j->l->stat, *restrict rstd = mean + C, *restrict ga = j->ga, *restrict be = j->be;
    int64_t r0, r1;
    block_rows(j, blk, &r0, &r1);
    for (int64_t r = r0, e; r < r1; r = e) {
        float *g = chunk_rows(j, r, r1, &e), *d = j->d ? j->d + r * C : g;
        const float *restrict x = j->l->bn_x + r * C;
#if BN_FAST
        if (j->lvl) {
            bn_pass(j->lvl, (int)C, BN_APPLY,
                    &(bn_args){.g0 = g, .g = d, .x = x, .n = e - r, .mean = mean, .rstd = rstd, .p = gr, .q = mg,
                               .u = mgh, .ga = ga, .be = be, .relu = ga != NULL});
            continue;
        }
#endif
        if (!ga)
            for (int64_t q = 0; q < (e - r) * C; q += C)
                for (int64_t k = 0; k < C; k++) {
                    float h = (x[q + k] - mean[k]) * rstd[k];
                    d[q + k] = gr[k] * (g[q + k] - mg[k] - h * mgh[k]);
                }
        else /* masked as in grad_sums_block */
            for (int64_t q = 0; q < (e - r) * C; q += C)
                for (int64_t k = 0; k < C; k++) {
                    float h = (x[q + k] - mean[k]) * rstd[k], gv = relu_keep(g[q + k], ga[k] * h + be[k]);
                    d[q + k] = gr[k] * (gv - mg[k] - h * mgh[k]);
                }
    }
}
LOOM_CLONES(BN_OPT, void, grad_apply_block, (void *arg, int blk), (arg, blk))

void nn_bn_grad_apply_(const loom_model *m, const nn_layer_ *l, const nn_chunk_ *chunk, int nchunks, int64_t B,
                       const float *gamma, const float *rstd, const double *sg, const double *sgh, double N)
{
    const int64_t C = l->C, R = l->n_out / C;
    float *gr = bn_coef(l), *mg = gr + C, *mgh = mg + C;
    for (int64_t k = 0; k < C; k++) {
        gr[k] = gamma[k] * rstd[k];
        mg[k] = (float)(sg[k] / N);
        mgh[k] = (float)(sgh[k] / N);
    }
    bn_job j = {.l = l, .rows = B * R, .R = R, .nb = bn_blocks(B * R), .lvl = bn_level(l), .chunk = chunk,
                .nchunks = nchunks, .a = gr, .b = mg, .c = mgh};
    if (l->bn_relu) j.ga = m->params + l->kernel_off, j.be = m->params + l->bias_off;
    if (l->bn_dx_dz) j.d = l[-1].dz;
    run_blocks(m, &j, grad_apply_block);
}
