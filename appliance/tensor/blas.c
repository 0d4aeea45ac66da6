/* blas.c - loading OpenBLAS with the right kernel and thread count.
 *
 * Debian's OpenBLAS is built with DYNAMIC_ARCH: at load time it reads CPUID
 * and picks a kernel by CPU model number. 0.3.21 does not know newer Xeons
 * (e.g. family 6 model 207) and falls back to a generic kernel about 5x
 * slower, although the CPU runs the SkylakeX (AVX-512) kernel correctly.
 * Both the kernel (OPENBLAS_CORETYPE) and the thread count
 * (OPENBLAS_NUM_THREADS) are read once, in the library's constructor, so we
 * do not link OpenBLAS: we set both from CPUID features (cpu.c) and our
 * thread budget, then dlopen it. An OPENBLAS_CORETYPE in the environment is
 * overridden (some VMs export one that does not fit their CPU) and named in
 * the reason; LOOM_BLAS names another CBLAS library (e.g. BLIS) to load
 * instead. */
#include "tensor.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef LOOM_OPENBLAS_LIBDIR
#define LOOM_OPENBLAS_LIBDIR ""
#endif

enum { RowMajor = 101, NoTrans = 111, Trans = 112 };
typedef void (*sgemm_fn)(int order, int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                         const float *B, int ldb, float beta, float *C, int ldc);

static struct {
    void      *lib;
    sgemm_fn   sgemm;
    void     (*set_threads)(int);
    char     *(*corename)(void);
    int        threads;
    int        quantum;   /* loom_blas_row_quantum, 0 until probed */
    char       core[64];
    char       reason[160];
} blas;

const char *loom_blas_pick_core(bool avx512f, bool avx512bw, bool avx512vl, bool avx512dq, bool avx512bf16, bool avx2,
                                bool fma)
{
    (void)avx512bf16; /* Cooperlake's extra kernels are bf16 only; sgemm is SkylakeX's */
    if (avx512f && avx512bw && avx512vl && avx512dq) return "SkylakeX";
    if (avx2 && fma) return "Haswell";
    return NULL;
}

static const char *cpu_core(void)
{
    const loom_cpu_info *c = loom_cpu();
    return loom_blas_pick_core(c->avx512f, c->avx512bw, c->avx512vl, c->avx512dq, false, c->avx2, c->fma);
}

static const char *wanted_core;

void loom_blas_want_core(const char *core) { wanted_core = core && *core ? core : NULL; }

/* ---- the row quantum ---------------------------------------------------------
 * Some kernels give a row of C different bits depending on where the call's
 * rows begin and end: OpenBLAS's Haswell/Zen sgemm computes rows in tiles of
 * 12 or 24 and its narrower tail tiles sum in another order, so the same
 * product split at row 64 (two chunks) or not (one) differs in the last bit,
 * and a model's weights then depend on its thread count. Splitting calls
 * only at multiples of the quantum keeps every row in the same tile. The
 * probe runs once, on one thread: op(A) B as one call and as calls of q rows,
 * for the three forms the model uses (NN, NT, TN), and takes the smallest q
 * for which all agree bit for bit: 12 on Haswell/Zen. On SkylakeX NN and TN
 * agree at 1 while NT at this small size takes the small-matrix path, which
 * agrees for no q; the quantum is then NN and TN's (1, as before the probe:
 * the thread-count tests pass there). */
enum { PROBE_M = 192, PROBE_K = 128, PROBE_N = 32 };

static bool probe_agrees(bool ta, bool tb, int q, const float *A, const float *B, float *full, float *part)
{
    int lda = ta ? PROBE_M : PROBE_K, ldb = tb ? PROBE_K : PROBE_N;
    loom_sgemm(ta, tb, PROBE_M, PROBE_N, PROBE_K, 1.f, A, lda, B, ldb, 0.f, full, PROBE_N);
    for (int m0 = 0; m0 < PROBE_M; m0 += q) {
        int m = PROBE_M - m0 < q ? PROBE_M - m0 : q;
        const float *a = ta ? A + m0 : A + (size_t)m0 * lda;
        loom_sgemm(ta, tb, m, PROBE_N, PROBE_K, 1.f, a, lda, B, ldb, 0.f, part + (size_t)m0 * PROBE_N, PROBE_N);
    }
    return !memcmp(full, part, sizeof(float) * PROBE_M * PROBE_N);
}

static int probe_quantum(void)
{
    static const int cand[] = {1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96};
    float *A = malloc(sizeof(float) * PROBE_M * PROBE_K), *B = malloc(sizeof(float) * PROBE_K * PROBE_N);
    float *full = malloc(sizeof(float) * PROBE_M * PROBE_N), *part = malloc(sizeof(float) * PROBE_M * PROBE_N);
    int q = 1, nn_tn = 0;
    if (A && B && full && part) {
        uint32_t x = 2463534242u; /* xorshift: values in [-1, 1) whose sums round differently by order */
        for (int i = 0; i < PROBE_M * PROBE_K + PROBE_K * PROBE_N; i++) {
            x ^= x << 13, x ^= x >> 17, x ^= x << 5;
            float v = (float)(x >> 8) / 8388608.f - 1.f;
            if (i < PROBE_M * PROBE_K) A[i] = v;
            else B[i - PROBE_M * PROBE_K] = v;
        }
        q = 0;
        for (size_t i = 0; i < sizeof cand / sizeof *cand && !q && !(nn_tn && cand[i] > 4 * nn_tn); i++) {
            bool nt = probe_agrees(false, false, cand[i], A, B, full, part) &&
                      probe_agrees(true, false, cand[i], A, B, full, part);
            if (nt && !nn_tn) nn_tn = cand[i];
            if (nt && probe_agrees(false, true, cand[i], A, B, full, part)) q = cand[i];
        }
        if (!q) q = nn_tn ? nn_tn : 1;
    }
    free(A), free(B), free(full), free(part);
    return q;
}

int loom_blas_row_quantum(void) { return blas.lib && blas.quantum > 0 ? blas.quantum : 1; }

int loom_blas_init(int threads, loom_err *err)
{
    if (threads <= 0) threads = loom_num_cores();
    if (blas.lib) {
        loom_blas_set_threads(threads);
        return LOOM_OK;
    }
    const char *env_core = getenv("OPENBLAS_CORETYPE");
    const char *custom = getenv("LOOM_BLAS");
    char env_note[96] = "";
    if (env_core && *env_core)
        snprintf(env_note, sizeof env_note, "; OPENBLAS_CORETYPE=%.40s in the environment overridden", env_core);
    if (wanted_core) {
        setenv("OPENBLAS_CORETYPE", wanted_core, 1);
        snprintf(blas.reason, sizeof blas.reason, "%s asked for by the caller", wanted_core);
    } else if (!custom) {
        const char *core = cpu_core();
        if (core) {
            if (env_core && !strcmp(env_core, core)) env_note[0] = 0;
            setenv("OPENBLAS_CORETYPE", core, 1);
            snprintf(blas.reason, sizeof blas.reason, "chosen from CPU features (%s)%s",
                     loom_cpu_level_name(loom_cpu()->level), env_note);
        } else {
            unsetenv("OPENBLAS_CORETYPE"); /* OpenBLAS reads the CPU model itself */
            snprintf(blas.reason, sizeof blas.reason, "detected by OpenBLAS from the CPU model%s", env_note);
        }
    }
    char nt[16];
    snprintf(nt, sizeof nt, "%d", threads);
    setenv("OPENBLAS_NUM_THREADS", nt, 1);
    setenv("BLIS_NUM_THREADS", nt, 1);

    char path[512];
    const char *tried[3];
    int ntried = 0;
    if (custom) {
        tried[ntried++] = custom;
    } else {
        snprintf(path, sizeof path, "%s/libopenblas.so.0", LOOM_OPENBLAS_LIBDIR);
        if (LOOM_OPENBLAS_LIBDIR[0]) tried[ntried++] = path;
        tried[ntried++] = "libopenblas.so.0";
    }
    for (int i = 0; i < ntried && !blas.lib; i++) blas.lib = dlopen(tried[i], RTLD_NOW | RTLD_LOCAL);
    if (!blas.lib)
        return loom_err_set(err, LOOM_EIO, tried[ntried - 1], "cannot load the BLAS library: %s", dlerror()),
               loom_err_hint(err, custom ? "LOOM_BLAS must name a shared library that exports cblas_sgemm"
                                         : "install it with: apt-get install libopenblas0-pthread");
    blas.sgemm = (sgemm_fn)dlsym(blas.lib, "cblas_sgemm");
    if (!blas.sgemm) {
        dlclose(blas.lib);
        blas.lib = NULL;
        return loom_err_set(err, LOOM_EIO, tried[ntried - 1], "the BLAS library has no cblas_sgemm");
    }
    blas.set_threads = (void (*)(int))dlsym(blas.lib, "openblas_set_num_threads");
    blas.corename = (char *(*)(void))dlsym(blas.lib, "openblas_get_corename");
    if (!blas.set_threads) blas.set_threads = (void (*)(int))dlsym(blas.lib, "bli_thread_set_num_threads");
    snprintf(blas.core, sizeof blas.core, "%s", blas.corename ? blas.corename() : (custom ? custom : "unknown"));
    if (custom) snprintf(blas.reason, sizeof blas.reason, "LOOM_BLAS=%s", custom);
    loom_blas_set_threads(1);
    blas.quantum = probe_quantum(); /* on one thread: OpenBLAS's own split would be probed too */
    loom_blas_set_threads(threads);
    return LOOM_OK;
}

const char *loom_blas_core(void) { return blas.lib ? blas.core : "not loaded"; }
const char *loom_blas_core_reason(void) { return blas.reason; }
int loom_blas_threads(void) { return blas.threads; }

void loom_blas_set_threads(int n)
{
    if (n < 1) n = 1;
    if (blas.set_threads) blas.set_threads(n);
    blas.threads = n;
}

void loom_sgemm(bool ta, bool tb, int M, int N, int K, float alpha, const float *A, int lda, const float *B, int ldb,
                float beta, float *C, int ldc)
{
    LOOM_ASSERT(blas.sgemm != NULL);
    blas.sgemm(RowMajor, ta ? Trans : NoTrans, tb ? Trans : NoTrans, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void loom_sgemm_rows(bool tb, int64_t row0, int64_t total, int q, int M, int N, int K, const float *A, int lda,
                     const float *B, int ldb, float *C, int ldc, float *tmp)
{
    const int64_t end = row0 + M;
    if (q <= 1) {
        if (M > 0) loom_sgemm(false, tb, M, N, K, 1.f, A, lda, B, ldb, 0.f, C, ldc);
        return;
    }
    LOOM_ASSERT(row0 >= 0 && end <= total);
    for (int64_t r = row0; r < end;) {
        const int64_t t0 = r / q * q;
        if (r == t0) { /* whole tiles, or up to the product's end (its last tile, partial, as one call ends it) */
            const int64_t be = end == total ? end : end / q * q;
            if (be > r) {
                loom_sgemm(false, tb, (int)(be - r), N, K, 1.f, A + (r - row0) * lda, lda, B, ldb, 0.f,
                           C + (r - row0) * ldc, ldc);
                r = be;
                continue;
            }
        }
        const int64_t n = total - t0 < q ? total - t0 : q, e = end < t0 + n ? end : t0 + n;
        float *ta = tmp, *tc = tmp + (int64_t)q * K;
        memset(ta, 0, (size_t)(n * K) * sizeof *ta);
        for (int64_t i = r; i < e; i++) memcpy(ta + (i - t0) * K, A + (i - row0) * lda, (size_t)K * sizeof *ta);
        loom_sgemm(false, tb, (int)n, N, K, 1.f, ta, K, B, ldb, 0.f, tc, N);
        for (int64_t i = r; i < e; i++) memcpy(C + (i - row0) * ldc, tc + (i - t0) * N, (size_t)N * sizeof *tc);
        r = e;
    }
}

/* ---- the GEMM-only bound ---------------------------------------------------- */

typedef struct bound_job {
    bool         ta, tb;
    int          M, N, K, parts, calls;
    const float *A, *B;
    float       *C;
} bound_job;

static void bound_call(const bound_job *j, int m0, int m1)
{
    int lda = j->ta ? j->M : j->K, ldb = j->tb ? j->K : j->N;
    const float *a = j->ta ? j->A + m0 : j->A + (size_t)m0 * lda; /* op(A)'s rows m0.. */
    loom_sgemm(j->ta, j->tb, m1 - m0, j->N, j->K, 1.f, a, lda, j->B, ldb, 0.f, j->C + (size_t)m0 * j->N, j->N);
}

static void bound_part(void *arg, int t)
{
    const bound_job *j = arg;
    int m0 = (int)((int64_t)j->M * t / j->parts), m1 = (int)((int64_t)j->M * (t + 1) / j->parts);
    if (m1 > m0)
        for (int c = 0; c < j->calls; c++) bound_call(j, m0, m1);
}

/* Seconds per call of job j's product: the whole on the BLAS's threads (pool
 * NULL), or split among the pool's threads; the fastest of reps. */
static double bound_time(bound_job *j, loom_pool *pool, int reps)
{
    j->parts = pool ? loom_pool_size(pool) : 1;
    j->calls = 1;
    loom_pool_run(pool, j->parts, bound_part, j); /* warm-up: threads, caches, page faults */
    double t0 = loom_now();
    int calls = 0;
    do {
        loom_pool_run(pool, j->parts, bound_part, j);
        calls++;
    } while (loom_now() - t0 < 0.005);
    j->calls = calls;
    double best = 0;
    for (int r = 0; r < reps; r++) {
        t0 = loom_now();
        loom_pool_run(pool, j->parts, bound_part, j);
        double v = (loom_now() - t0) / calls;
        if (r == 0 || v < best) best = v;
    }
    return best;
}

double loom_sgemm_bound(bool ta, bool tb, int M, int N, int K, int threads, int reps)
{
    if (threads < 1) threads = 1;
    if (reps < 1) reps = 1;
    size_t na = (size_t)M * K, nb = (size_t)K * N, nc = (size_t)M * N;
    float *A = loom_alloc_aligned(na * sizeof *A), *B = loom_alloc_aligned(nb * sizeof *B),
          *C = loom_alloc_aligned(nc * sizeof *C);
    double best = -1;
    if (!A || !B || !C) goto out;
    for (size_t k = 0; k < na; k++) A[k] = (float)(k % 7) * 0.1f - 0.3f;
    for (size_t k = 0; k < nb; k++) B[k] = (float)(k % 5) * 0.1f - 0.2f;
    bound_job j = {.ta = ta, .tb = tb, .M = M, .N = N, .K = K, .A = A, .B = B, .C = C};
    int prev = loom_blas_threads();
    loom_blas_set_threads(1);
    best = bound_time(&j, NULL, reps); /* one core: more cannot take longer (leave them idle) */
    if (threads > 1) {
        loom_blas_set_threads(threads);
        double whole = bound_time(&j, NULL, reps);
        best = whole < best ? whole : best;
    }
    loom_pool *pool = NULL;
    loom_err err;
    if (threads > 1 && M >= threads && loom_pool_new(&pool, threads, &err) == LOOM_OK) {
        loom_blas_set_threads(1);
        loom_pool_set_spin(pool, 1000);
        double split = bound_time(&j, pool, reps);
        best = split < best ? split : best;
        loom_pool_free(pool);
    }
    loom_blas_set_threads(prev);
out:
    loom_free(A), loom_free(B), loom_free(C);
    return best;
}
