/* test_tensor.c - dtypes, shapes, the BLAS loader and its kernel choice. */
#include "harness.h"
#include "tensor/tensor.h"

static void test_dtypes_shapes(void)
{
    CHECK(loom_dtype_parse("float32") == LOOM_F32);
    CHECK(loom_dtype_parse("float") == -1);
    CHECK(loom_dtype_size(LOOM_F64) == 8 && loom_dtype_size(LOOM_U8) == 1);
    int64_t d[3] = {28, 28, 1};
    loom_shape s = loom_shape_make(3, d);
    char buf[64];
    CHECK(!strcmp(loom_shape_str(&s, buf, sizeof buf), "(28, 28, 1)"));
    CHECK(loom_shape_numel(&s) == 784);
    loom_shape scalar = {0};
    CHECK(!strcmp(loom_shape_str(&scalar, buf, sizeof buf), "()"));
    CHECK(loom_shape_numel(&scalar) == 1);
    loom_shape one = loom_shape_make(1, d);
    CHECK(!strcmp(loom_shape_str(&one, buf, sizeof buf), "(28,)"));
    CHECK(!loom_shape_eq(&s, &one));
}

static void test_pick_core(void)
{
    /* AVX-512 (SkylakeX and newer, e.g. family 6 model 207 which OpenBLAS 0.3.21 does not know) */
    CHECK(!strcmp(loom_blas_pick_core(true, true, true, true, true, true, true), "SkylakeX"));
    CHECK(!strcmp(loom_blas_pick_core(true, true, true, true, false, true, true), "SkylakeX"));
    /* AVX-512F alone (Knights Landing) is not SkylakeX */
    CHECK(!strcmp(loom_blas_pick_core(true, false, false, false, false, true, true), "Haswell"));
    CHECK(!strcmp(loom_blas_pick_core(false, false, false, false, false, true, true), "Haswell"));
    CHECK(loom_blas_pick_core(false, false, false, false, false, false, false) == NULL);
}

static void test_blas_loaded(void)
{
    loom_err e = {0};
    CHECK(loom_blas_init(1, &e) == LOOM_OK);
    CHECK(strcmp(loom_blas_core(), "not loaded") != 0);
    CHECK(loom_blas_threads() == 1);
    printf("# BLAS core %s (%s)\n", loom_blas_core(), loom_blas_core_reason());
    /* an odd-shaped product against a float64 reference, all transposes */
    enum { M = 37, N = 29, K = 53 };
    static float A[M * K], B[K * N], C[M * N];
    loom_rng r;
    loom_rng_init(&r, 1, 2, 3, 4);
    for (int i = 0; i < M * K; i++) A[i] = loom_rng_uniform(&r) - 0.5f;
    for (int i = 0; i < K * N; i++) B[i] = loom_rng_uniform(&r) - 0.5f;
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            /* the same memory read as op(A) (M x K) and op(B) (K x N) */
            for (int i = 0; i < M * N; i++) C[i] = 1.0f;
            loom_sgemm(ta, tb, M, N, K, 0.5f, A, ta ? M : K, B, tb ? K : N, 2.0f, C, N);
            double worst = 0;
            for (int i = 0; i < M; i++)
                for (int j = 0; j < N; j++) {
                    double s = 0;
                    for (int k = 0; k < K; k++)
                        s += (double)(ta ? A[k * M + i] : A[i * K + k]) * (tb ? B[j * K + k] : B[k * N + j]);
                    double want = 0.5 * s + 2.0, d = fabs(want - C[i * N + j]);
                    if (d > worst) worst = d;
                }
            CHECK_MSG(worst < 1e-5, "ta=%d tb=%d worst error %g", ta, tb, worst);
        }
}

static const loom_test tests[] = {
    {"dtypes_shapes", test_dtypes_shapes},
    {"pick_core", test_pick_core},
    {"blas_loaded", test_blas_loaded},
    {0},
};

int main(void) { return loom_test_run(tests); }
