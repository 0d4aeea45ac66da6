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

/* The CPU's features are read once, agree with the compiler's own reading,
 * and give the kernel level by the table; the level is never taken from the
 * environment. */
static void test_cpu_features(void)
{
    CHECK(loom_cpu_pick_level(true, true, true, true, true, true) == LOOM_CPU_AVX512);
    CHECK(loom_cpu_pick_level(true, false, true, true, true, true) == LOOM_CPU_AVX2_FMA); /* Knights Landing */
    CHECK(loom_cpu_pick_level(false, false, false, false, true, true) == LOOM_CPU_AVX2_FMA);
    CHECK(loom_cpu_pick_level(false, false, false, false, true, false) == LOOM_CPU_BASELINE);
    CHECK(loom_cpu_pick_level(false, false, false, false, false, false) == LOOM_CPU_BASELINE);
    CHECK(!strcmp(loom_cpu_level_name(LOOM_CPU_AVX512), "avx512"));
    CHECK(!strcmp(loom_cpu_level_name(LOOM_CPU_AVX2_FMA), "avx2-fma"));
    CHECK(!strcmp(loom_cpu_level_name(LOOM_CPU_BASELINE), "baseline"));
    const loom_cpu_info *c = loom_cpu();
    CHECK(c == loom_cpu());
    CHECK(c->level == loom_cpu_pick_level(c->avx512f, c->avx512bw, c->avx512vl, c->avx512dq, c->avx2, c->fma));
    /* the features are core's one probe's (which the stage clock and CRC-32C read too) */
    const loom_cpu_features *f = loom_cpu_probe();
    CHECK(!strcmp(c->vendor, f->vendor) && !strcmp(c->brand, f->brand) && c->family == f->family && c->model == f->model);
    CHECK(c->avx2 == f->avx2 && c->fma == f->fma && c->avx512f == f->avx512f && c->avx512bw == f->avx512bw &&
          c->avx512vl == f->avx512vl && c->avx512dq == f->avx512dq);
#if defined(__x86_64__) && defined(__GNUC__)
    CHECK(c->vendor[0] && strcmp(c->vendor, "unknown") != 0);
    if (!f->capped) {
        CHECK(c->avx2 == !!__builtin_cpu_supports("avx2") && c->fma == !!__builtin_cpu_supports("fma"));
        CHECK(c->avx512f == !!__builtin_cpu_supports("avx512f"));
    } else { /* LOOM_TEST_CPU (the CI's AVX2 leg): features hidden, never added */
        CHECK(!c->avx512f && !c->avx512bw && c->level <= LOOM_CPU_AVX2_FMA);
        CHECK(!c->avx2 || __builtin_cpu_supports("avx2"));
        CHECK(!strcmp(f->capped, "avx2") ? c->avx2 == !!__builtin_cpu_supports("avx2") : !c->avx2 && !c->fma);
        printf("# features capped at %s by LOOM_TEST_CPU\n", f->capped);
    }
#endif
    char line[400];
    loom_cpu_describe(line, sizeof line);
    CHECK_CONTAINS(line, loom_cpu_level_name(c->level));
    CHECK_CONTAINS(line, c->vendor);
    printf("# %s\n", line);
}

static void test_blas_loaded(void)
{
    loom_err e = {0};
    /* a core named in the environment does not decide: the CPU's features do */
    const char *mine = loom_blas_pick_core(loom_cpu()->avx512f, loom_cpu()->avx512bw, loom_cpu()->avx512vl,
                                           loom_cpu()->avx512dq, false, loom_cpu()->avx2, loom_cpu()->fma);
    setenv("OPENBLAS_CORETYPE", "Sandybridge", 1);
    CHECK(loom_blas_init(1, &e) == LOOM_OK);
    CHECK(strcmp(loom_blas_core(), "not loaded") != 0);
    if (mine) {
        CHECK_MSG(!strcmp(loom_blas_core(), mine), "core %s, the CPU's features call for %s", loom_blas_core(), mine);
        CHECK_CONTAINS(loom_blas_core_reason(), "chosen from CPU features");
        CHECK_CONTAINS(loom_blas_core_reason(), "OPENBLAS_CORETYPE=Sandybridge in the environment overridden");
    } else {
        CHECK(getenv("OPENBLAS_CORETYPE") == NULL); /* OpenBLAS reads the CPU model itself */
    }
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

/* loom_sgemm_bound, the GEMM-only bound of `loom profile --train` and
 * gemm_peak: every transpose, 1 and 2 threads, and an M smaller than the
 * threads (no split then): a time per call, the BLAS's thread count as it
 * was. The split reads op(A)'s row slices: ASan checks their bounds. */
static void test_gemm_bound(void)
{
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++)
            for (int t = 1; t <= 2; t++) {
                double s = loom_sgemm_bound(ta, tb, 37, 29, 53, t, 2);
                CHECK_MSG(s > 0 && s < 0.5, "ta=%d tb=%d threads=%d: %g s per call", ta, tb, t, s);
                CHECK(loom_blas_threads() == 1);
            }
    double one = loom_sgemm_bound(false, false, 1, 16, 16, 2, 1);
    CHECK_MSG(one > 0 && one < 0.5, "M=1 on 2 threads: %g s", one);
}

/* loom_sgemm_rows: any run of rows of a product, however a chunk split
 * cuts it (mid-tile starts and ends, a run inside one tile, the product's
 * partial last tile), has the bits of the one call over all its rows, which
 * the row quantum's probe makes those of calls starting on tiles. On a BLAS
 * with a quantum above 1 (OpenBLAS Haswell: any AVX2 machine, and
 * LOOM_TEST_CPU=avx2) plain calls over the same runs differ (said, the
 * count printed), so this checks the tiles are kept. */
static void test_sgemm_rows(void)
{
    loom_err e = {0};
    CHECK(loom_blas_init(1, &e) == LOOM_OK);
    enum { T = 203, K = 40, N = 24 }; /* 203 rows: 16 tiles of 12 and a partial one of 11 */
    static float A[T * K], B[K * N], whole[T * N], part[T * N], plain[T * N];
    const int q = loom_blas_row_quantum();
    float *tmp = malloc(sizeof(float) * (size_t)(q * (K + N)));
    loom_rng r;
    loom_rng_init(&r, 5, 6, 7, 8);
    for (int i = 0; i < T * K; i++) A[i] = (loom_rng_uniform(&r) - 0.5f) * (float)(1 + i % 7);
    for (int i = 0; i < K * N; i++) B[i] = loom_rng_uniform(&r) - 0.5f;
    static const int cuts[][4] = {{0, 100, 203}, {0, 101, 203}, {0, 5, 7, 203}, {0, 60, 68, 203},
                                  {0, 1, 202, 203}, {0, 67, 135, 203}, {0, 193, 203}, {0, 194, 200, 203}};
    int differ = 0;
    for (int tb = 0; tb < 2; tb++) {
        const float *Bm = B; /* read as (K, N), or as (N, K) transposed */
        loom_sgemm(false, tb, T, N, K, 1.f, A, K, Bm, tb ? K : N, 0.f, whole, N);
        for (size_t c = 0; c < sizeof cuts / sizeof *cuts; c++) {
            memset(part, 0, sizeof part);
            for (int i = 0; i < 3 && cuts[c][i] < T; i++) {
                const int r0 = cuts[c][i], r1 = cuts[c][i + 1] ? cuts[c][i + 1] : T;
                if (r1 <= r0) break;
                loom_sgemm_rows(tb, r0, T, q, r1 - r0, N, K, A + r0 * K, K, Bm, tb ? K : N, part + r0 * N, N, tmp);
                loom_sgemm(false, tb, r1 - r0, N, K, 1.f, A + r0 * K, K, Bm, tb ? K : N, 0.f, plain + r0 * N, N);
            }
            CHECK_MSG(!memcmp(part, whole, sizeof part), "tb=%d cuts %d %d %d %d: other bits than the whole product",
                      tb, cuts[c][0], cuts[c][1], cuts[c][2], cuts[c][3]);
            differ += memcmp(plain, whole, sizeof plain) != 0;
        }
    }
    printf("# row quantum %d: plain calls over the same runs differed from the whole product in %d of %d splits\n", q,
           differ, (int)(2 * sizeof cuts / sizeof *cuts));
    if (q > 1) CHECK_MSG(differ > 0, "a quantum of %d, yet plain mid-tile calls gave the whole product's bits", q);
    free(tmp);
}

/* LOOM_CLONES runs the clone of loom_cpu()'s level, which LOOM_TEST_CPU caps (gcc's target_clones ran the
 * real CPU's). A sum the clones vectorise under fast-math: each vector width splits it into other partial
 * sums, so 2^24 plus 63 ones comes out differently from each clone, and the dispatcher's result names
 * the clone that ran. */
static inline LOOM_CLONE_BODY float wide_sum_body(const float *x, int n)
{
    float s = 0.f;
    for (int i = 0; i < n; i++) s += x[i];
    return s;
}
LOOM_CLONES(__attribute__((optimize("fast-math", "tree-vectorize"))), float, wide_sum, (const float *x, int n), (x, n))

static void test_clones(void)
{
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    float x[64];
    x[0] = 16777216.f; /* 2^24: a 1 added to it alone is lost */
    for (int i = 1; i < 64; i++) x[i] = 1.f;
    const loom_cpu_info *c = loom_cpu();
    const float got = wide_sum(x, 64), gen = wide_sum_gen_(x, 64);
    float want = gen;
    if (c->level >= LOOM_CPU_AVX2_FMA) want = wide_sum_256_(x, 64);
    if (c->level >= LOOM_CPU_AVX512) want = wide_sum_512_(x, 64);
    CHECK_MSG(got == want, "level %s: the dispatch gave %.1f, its clone %.1f", loom_cpu_level_name(c->level), got, want);
    printf("# level %s: baseline clone %.1f", loom_cpu_level_name(c->level), gen - 16777216.f);
    if (__builtin_cpu_supports("avx2")) { /* the teeth: the clones differ, so a wrong pick shows */
        const float w256 = wide_sum_256_(x, 64);
#if defined(__SANITIZE_ADDRESS__) /* ASan's checks keep gcc from vectorising the sum: the pick alone is checked */
        if (w256 == gen) printf(" (the clones sum alike under ASan)");
#else
        CHECK_MSG(w256 != gen, "the AVX2 and baseline clones agree (%.1f): this check cannot tell them apart", w256);
#endif
        printf(", AVX2 clone %.1f", w256 - 16777216.f);
    }
    if (__builtin_cpu_supports("avx512f")) printf(", AVX-512 clone %.1f", wide_sum_512_(x, 64) - 16777216.f);
    printf(" (above 2^24)\n");
#endif
}

static const loom_test tests[] = {
    {"dtypes_shapes", test_dtypes_shapes},
    {"pick_core", test_pick_core},
    {"cpu_features", test_cpu_features},
    {"blas_loaded", test_blas_loaded},
    {"sgemm_rows", test_sgemm_rows},
    {"gemm_bound", test_gemm_bound},
    {"clones follow the level (LOOM_TEST_CPU)", test_clones},
    {0},
};

int main(void) { return loom_test_run(tests); }
