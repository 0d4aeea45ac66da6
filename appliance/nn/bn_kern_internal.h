/* bn_kern_internal.h - batch normalization's passes with the channel count a constant, for one ISA:
 * bn_pass.c includes it twice, BN_W 8 (AVX-512: 8 doubles a register) and 4 (AVX2), BN_ATTR the
 * functions' target, BN_SFX their names' suffix. One width's own vector types (a 64-byte double
 * vector under AVX2 went through the stack). Each channel's sums are one double chain over the rows
 * in order, with bn_pass.c's generic loops' operations and no contraction: the same bits at any
 * width. Private to bn_pass.c. */
#define BN_CAT_(a, b) a##b
#define BN_CAT(a, b) BN_CAT_(a, b)
#define BN_F(n) BN_CAT(n, BN_SFX)
#define BN_VF BN_F(bn_vf_)    /* BN_W floats */
#define BN_VD BN_F(bn_vd_)    /* BN_W doubles */
#define BN_VW BN_F(bn_vw_)    /* 2 BN_W floats: the float-only passes */
#define BN_VFI BN_F(bn_vfi_)  /* BN_W int32: a BN_VF's comparison */
#define BN_VWI BN_F(bn_vwi_)  /* 2 BN_W int32: a BN_VW's comparison */
#define BN_KI static inline __attribute__((always_inline)) BN_ATTR

typedef float BN_VF __attribute__((vector_size(BN_W * 4), aligned(4)));
typedef double BN_VD __attribute__((vector_size(BN_W * 8), aligned(8)));
typedef float BN_VW __attribute__((vector_size(BN_W * 8), aligned(4)));
typedef int32_t BN_VFI __attribute__((vector_size(BN_W * 4)));
typedef int32_t BN_VWI __attribute__((vector_size(BN_W * 8)));
/* v where keep > 0, else +0: the relu's v > 0 ? v : 0 (a comparison's lanes are all ones or zeros) */
#define BN_RELU_F(v, keep) ((BN_VF)((BN_VFI)(v) & ((keep) > 0)))
#define BN_RELU_W(v, keep) ((BN_VW)((BN_VWI)(v) & ((keep) > 0)))
#define BN_CVT(p) __builtin_convertvector(*(const BN_VF *)(p), BN_VD)

/* Block rows [r0, r1) of x (rows, C): the block's mean s and sum of squares about it q (C each),
 * CG channels at a time. */
BN_KI void BN_F(moments_k)(const float *restrict x, int64_t r0, int64_t r1, int C, int CG, double *restrict s,
                           double *restrict q)
{
    const double n = (double)(r1 - r0);
    for (int c0 = 0; c0 < C; c0 += CG) {
        BN_VD a[4], m[4];
#pragma GCC unroll 4
        for (int v = 0; v < CG / BN_W; v++) a[v] = (BN_VD){0};
        for (int64_t r = r0; r < r1; r++)
#pragma GCC unroll 4
            for (int v = 0; v < CG / BN_W; v++) a[v] += BN_CVT(x + r * C + c0 + BN_W * v);
#pragma GCC unroll 4
        for (int v = 0; v < CG / BN_W; v++) {
            m[v] = a[v] / n;
            *(BN_VD *)(s + c0 + BN_W * v) = m[v];
            a[v] = (BN_VD){0};
        }
        for (int64_t r = r0; r < r1; r++)
#pragma GCC unroll 4
            for (int v = 0; v < CG / BN_W; v++) {
                BN_VD d = BN_CVT(x + r * C + c0 + BN_W * v) - m[v];
                a[v] += d * d;
            }
#pragma GCC unroll 4
        for (int v = 0; v < CG / BN_W; v++) *(BN_VD *)(q + c0 + BN_W * v) = a[v];
    }
}

/* y = gamma (x - mean) rstd + beta over rows [r0, r1), row by row (a channel group at a time over the
 * whole block read a large layer's block C / 2 BN_W times from beyond L1); relu: then max(0, y). */
BN_KI void BN_F(normalize_k)(const float *restrict x, float *restrict y, int64_t r0, int64_t r1, int C,
                             const float *restrict mean, const float *restrict rstd, const float *restrict gamma,
                             const float *restrict beta, int relu)
{
    for (int64_t r = r0; r < r1; r++)
#pragma GCC unroll 8
        for (int c0 = 0; c0 < C; c0 += 2 * BN_W) {
            BN_VW h = (*(const BN_VW *)(x + r * C + c0) - *(const BN_VW *)(mean + c0)) * *(const BN_VW *)(rstd + c0);
            BN_VW v = *(const BN_VW *)(gamma + c0) * h + *(const BN_VW *)(beta + c0);
            *(BN_VW *)(y + r * C + c0) = relu ? BN_RELU_W(v, v) : v;
        }
}

/* n rows of g and x (C each): sg += g, sgh += g xhat, per channel, in row order; relu: g where
 * gamma xhat + beta > 0, else 0 (the relu's backward, from the forward's output recomputed). */
BN_KI void BN_F(grad_sums_k)(const float *restrict g, const float *restrict x, int64_t n, int C, int CG,
                             const float *restrict mean, const float *restrict rstd, double *restrict sg,
                             double *restrict sgh, const float *restrict ga, const float *restrict be, int relu)
{
    for (int c0 = 0; c0 < C; c0 += CG) {
        BN_VD a[4], b[4];
        BN_VF mu[4], rs[4], gm[4], bt[4];
#pragma GCC unroll 4
        for (int v = 0; v < CG / BN_W; v++) {
            a[v] = *(const BN_VD *)(sg + c0 + BN_W * v), b[v] = *(const BN_VD *)(sgh + c0 + BN_W * v);
            mu[v] = *(const BN_VF *)(mean + c0 + BN_W * v), rs[v] = *(const BN_VF *)(rstd + c0 + BN_W * v);
            if (relu) gm[v] = *(const BN_VF *)(ga + c0 + BN_W * v), bt[v] = *(const BN_VF *)(be + c0 + BN_W * v);
        }
        for (int64_t r = 0; r < n; r++)
#pragma GCC unroll 4
            for (int v = 0; v < CG / BN_W; v++) {
                const int64_t o = r * C + c0 + BN_W * v;
                BN_VF h = (*(const BN_VF *)(x + o) - mu[v]) * rs[v];
                BN_VF gf = *(const BN_VF *)(g + o);
                if (relu) gf = BN_RELU_F(gf, gm[v] * h + bt[v]);
                BN_VD gd = __builtin_convertvector(gf, BN_VD);
                a[v] += gd;
                b[v] += gd * __builtin_convertvector(h, BN_VD);
            }
#pragma GCC unroll 4
        for (int v = 0; v < CG / BN_W; v++)
            *(BN_VD *)(sg + c0 + BN_W * v) = a[v], *(BN_VD *)(sgh + c0 + BN_W * v) = b[v];
    }
}

/* n rows of g into d (d may be g): d = gr (g - mg - xhat mgh), row by row (as normalize_k); relu: g masked as
 * in grad_sums_k first. */
BN_KI void BN_F(grad_apply_k)(const float *g, float *d, const float *restrict x, int64_t n, int C,
                              const float *restrict mean, const float *restrict rstd, const float *restrict gr,
                              const float *restrict mg, const float *restrict mgh, const float *restrict ga,
                              const float *restrict be, int relu)
{
    for (int64_t r = 0; r < n; r++)
#pragma GCC unroll 8
        for (int c0 = 0; c0 < C; c0 += 2 * BN_W) {
            BN_VW gv = *(const BN_VW *)(g + r * C + c0), *gp = (BN_VW *)(d + r * C + c0);
            BN_VW h = (*(const BN_VW *)(x + r * C + c0) - *(const BN_VW *)(mean + c0)) * *(const BN_VW *)(rstd + c0);
            if (relu) gv = BN_RELU_W(gv, *(const BN_VW *)(ga + c0) * h + *(const BN_VW *)(be + c0));
            *gp = *(const BN_VW *)(gr + c0) * (gv - *(const BN_VW *)(mg + c0) - h * *(const BN_VW *)(mgh + c0));
        }
}

#define BN_BODY(C, CG)                                                                                              \
    switch (op) {                                                                                                    \
    case BN_MOMENTS: BN_F(moments_k)(a->x, a->r0, a->r1, C, CG, a->s, a->t); break;                                 \
    case BN_NORMALIZE:                                                                                               \
        if (a->relu) BN_F(normalize_k)(a->x, a->y, a->r0, a->r1, C, a->mean, a->rstd, a->p, a->q, 1);              \
        else BN_F(normalize_k)(a->x, a->y, a->r0, a->r1, C, a->mean, a->rstd, a->p, a->q, 0);                      \
        break;                                                                                                       \
    case BN_SUMS:                                                                                                    \
        if (a->relu) BN_F(grad_sums_k)(a->g0, a->x, a->n, C, CG, a->mean, a->rstd, a->s, a->t, a->ga, a->be, 1);    \
        else BN_F(grad_sums_k)(a->g0, a->x, a->n, C, CG, a->mean, a->rstd, a->s, a->t, NULL, NULL, 0);             \
        break;                                                                                                       \
    case BN_APPLY:                                                                                                   \
        if (a->relu)                                                                                                 \
            BN_F(grad_apply_k)(a->g0, a->g, a->x, a->n, C, a->mean, a->rstd, a->p, a->q, a->u, a->ga, a->be, 1);      \
        else BN_F(grad_apply_k)(a->g0, a->g, a->x, a->n, C, a->mean, a->rstd, a->p, a->q, a->u, NULL, NULL, 0);    \
        break;                                                                                                       \
    }

/* The pass op for C = 16, 32 or 64: up to 4 registers of sums per group of CG channels. */
BN_ATTR static void BN_F(bn_pass)(bn_op op, int C, const bn_args *a)
{
    enum { CG = 4 * BN_W };
    if (C == 16) BN_BODY(16, 16 < CG ? 16 : CG)
    else if (C == 32) BN_BODY(32, 32 < CG ? 32 : CG)
    else BN_BODY(64, CG)
}

#undef BN_BODY
#undef BN_CVT
#undef BN_KI
#undef BN_RELU_W
#undef BN_RELU_F
#undef BN_VWI
#undef BN_VFI
#undef BN_VW
#undef BN_VD
#undef BN_VF
