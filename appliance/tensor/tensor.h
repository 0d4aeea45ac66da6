/* tensor.h - dtypes, shapes, host tensors, the device-backend interface and
 * the CPU backend over BLAS.
 * BLAS: OpenBLAS is loaded at run time by loom_blas_init(), after its core
 * type and thread count are chosen from the CPU's features and the caller's
 * thread budget, because OpenBLAS fixes both when it initialises (a linked
 * OpenBLAS would already have spawned one thread per core and may have
 * picked a slow generic kernel on CPUs it does not know).
 * Threads: loom_blas_init once, from the main thread, before any gemm. */
#ifndef LOOM_TENSOR_H
#define LOOM_TENSOR_H

#include "core/core.h"
#include <stdbool.h>

typedef enum { LOOM_U8, LOOM_I32, LOOM_I64, LOOM_F32, LOOM_F64, LOOM_NDTYPES_ } loom_dtype;

#define LOOM_MAX_RANK 8

typedef struct loom_shape {
    int     rank;
    int64_t dim[LOOM_MAX_RANK];
} loom_shape;

size_t      loom_dtype_size(loom_dtype t);
const char *loom_dtype_name(loom_dtype t); /* "float32" */
/* Parses "float32", "uint8", ...; -1 when unknown. */
int         loom_dtype_parse(const char *s);

/* The element count; -1 when a dim is negative or the product overflows
 * int64 (callers that index or allocate with it must check, or use the
 * checked forms below). */
int64_t loom_shape_numel(const loom_shape *s);
/* *numel = the product of the dims; 0 when it fits, -1 (and *numel = -1) when
 * a dim is negative, the rank is out of range, the product overflows int64 or
 * exceeds max (max < 0: no bound beyond int64). */
int     loom_shape_numel_checked(const loom_shape *s, int64_t max, int64_t *numel);
/* *nbytes = numel * dtype size; 0 when it fits in max_bytes, else -1 (*nbytes = 0). */
int     loom_shape_nbytes_checked(const loom_shape *s, loom_dtype dt, size_t max_bytes, size_t *nbytes);
bool    loom_shape_eq(const loom_shape *a, const loom_shape *b);
/* "(28, 28)" into buf; returns buf. */
char   *loom_shape_str(const loom_shape *s, char *buf, size_t n);
loom_shape loom_shape_make(int rank, const int64_t *dims);

/* A host tensor. data is 64-byte aligned when owned. */
typedef struct loom_tensor {
    loom_dtype dtype;
    loom_shape shape;
    void      *data;
    int        owns; /* data freed by loom_tensor_fini */
} loom_tensor;

int  loom_tensor_init(loom_tensor *t, loom_dtype dt, const loom_shape *s, loom_err *err); /* zeroed */
void loom_tensor_fini(loom_tensor *t);
size_t loom_tensor_nbytes(const loom_tensor *t);
/* Element i converted to double (any dtype). */
double loom_tensor_get(const loom_tensor *t, int64_t i);

/* ---- the CPU (cpu.c) -------------------------------------------------------- */

/* The vector kernels Loom runs, chosen from CPUID features at start. */
typedef enum {
    LOOM_CPU_BASELINE,  /* x86-64's SSE2 (or not x86) */
    LOOM_CPU_AVX2_FMA,  /* Haswell on, Zen on */
    LOOM_CPU_AVX512,    /* F+BW+VL+DQ: Skylake-SP on, Zen 4 on */
} loom_cpu_level;

typedef struct loom_cpu_info {
    char vendor[13];    /* "GenuineIntel", "AuthenticAMD" */
    char brand[49];     /* "AMD EPYC 9R14 96-Core Processor"; may be empty */
    int  family, model; /* as CPUID leaf 1 gives them, extended fields folded in */
    bool avx2, fma, avx512f, avx512bw, avx512vl, avx512dq; /* supported by the CPU and saved by the OS */
    loom_cpu_level level;
} loom_cpu_info;

/* Read once (thread-safe); borrowed for the process's life. */
const loom_cpu_info *loom_cpu(void);
/* The level those features call for. Pure; exposed for tests. */
loom_cpu_level loom_cpu_pick_level(bool avx512f, bool avx512bw, bool avx512vl, bool avx512dq, bool avx2, bool fma);
const char *loom_cpu_level_name(loom_cpu_level l); /* "avx512", "avx2-fma", "baseline" */
/* Hot loops compiled for each level (AVX-512, AVX2, baseline x86-64) and picked at each call by
 * loom_cpu()'s level, which LOOM_TEST_CPU caps: gcc's target_clones pick from the real CPU at load,
 * before any environment is read, so a capped run kept the wider clones. After
 *     static inline LOOM_CLONE_BODY ret name_body(params) { ... }
 * LOOM_CLONES(attrs, ret, name, (params), (args)) defines `static ret name(params)`; attrs (an optimize
 * attribute, or nothing) go on each clone, which compiles the inlined body. The target strings are the
 * ones target_clones had, so each level's code is what its clone was. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LOOM_CLONE_BODY __attribute__((always_inline))
#define LOOM_CLONES(attrs, ret, name, params, args)                                                                    \
    attrs __attribute__((target("avx512f"))) static ret name##_512_ params { return name##_body args; }                \
    attrs __attribute__((target("avx2"))) static ret name##_256_ params { return name##_body args; }                   \
    attrs static ret name##_gen_ params { return name##_body args; }                                                   \
    static ret name params                                                                                             \
    {                                                                                                                  \
        const loom_cpu_level lv_ = loom_cpu()->level;                                                                  \
        return lv_ >= LOOM_CPU_AVX512     ? name##_512_ args                                                           \
               : lv_ >= LOOM_CPU_AVX2_FMA ? name##_256_ args                                                           \
                                          : name##_gen_ args;                                                          \
    }
#else
#define LOOM_CLONE_BODY
#define LOOM_CLONES(attrs, ret, name, params, args)                                                                    \
    attrs static ret name params { return name##_body args; }
#endif

/* One line for `loom devices`: the CPU, its features and the kernel level. */
char *loom_cpu_describe(char *buf, size_t n);

/* ---- BLAS ---------------------------------------------------------------- */

/* Loads OpenBLAS with `threads` threads (0 = all cores). Chooses its core
 * (OPENBLAS_CORETYPE) from the CPU's features (loom_cpu), overriding one set
 * in the environment; where the features name none, OpenBLAS picks by CPU
 * model. Idempotent. */
int  loom_blas_init(int threads, loom_err *err);
/* Tests and benchmarks only, before loom_blas_init: load OpenBLAS with this
 * core instead of the CPU's (to check results on other kernels). NULL: the CPU's. */
void loom_blas_want_core(const char *core);
/* The kernel OpenBLAS runs ("SkylakeX") and how it was chosen. */
const char *loom_blas_core(void);
const char *loom_blas_core_reason(void);
int  loom_blas_threads(void);
/* The row quantum of the loaded BLAS: splitting a product's rows into calls
 * only at multiples of it gives every row the bits of the unsplit product
 * (probed once on first use; 1 before loom_blas_init or when any split does). */
int  loom_blas_row_quantum(void);
void loom_blas_set_threads(int n);
/* The core type the CPU's features call for ("SkylakeX", "Haswell", ...),
 * or NULL to let OpenBLAS decide. Pure; exposed for tests. */
const char *loom_blas_pick_core(bool avx512f, bool avx512bw, bool avx512vl, bool avx512dq,
                                bool avx512bf16, bool avx2, bool fma);

/* Row-major C = alpha * op(A) * op(B) + beta * C; op(A) is M x K, op(B) K x N. */
void loom_sgemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float *A, int lda,
                const float *B, int ldb, float beta, float *C, int ldc);
/* Rows [row0, row0 + M) of the product C = A op(B) (beta 0) of `total` rows, with the bits of calls that
 * start at multiples of q (loom_blas_row_quantum): the rows wherever the caller's split begins and ends.
 * The whole tiles of q rows go to one call; a tile the rows cover only in part is computed whole in
 * tmp (zeros in its other rows, which no row's sum reads) and the rows copied out. tmp: q (K + N)
 * floats (unused when q <= 1 or the rows start and end on tiles). */
void loom_sgemm_rows(bool trans_b, int64_t row0, int64_t total, int q, int M, int N, int K, const float *A, int lda,
                     const float *B, int ldb, float *C, int ldc, float *tmp);

/* The GEMM-only bound of one product op(A)(M,K) op(B)(K,N) on `threads`
 * cores, in seconds per call: the least time of three ways to use them,
 * the BLAS on one thread (more cores never need longer), on `threads`
 * threads over the whole product, or `threads` one-thread BLAS calls side
 * by side on slices of M rows (how Loom's intra-op threads split a layer:
 * batch rows forward, kernel rows for a weight gradient);
 * each the fastest of `reps` repetitions of back-to-back calls (at least
 * 5 ms each). A bound is the least time the products can take: the
 * fastest repetition estimates it, a median on a shared machine measures
 * the other processes. `loom profile --train` and tests/bench/gemm_peak
 * both take the MLP's GEMM-only bound from here. Allocates its own
 * operands; restores the BLAS thread count. < 0 when out of memory. */
double loom_sgemm_bound(bool trans_a, bool trans_b, int M, int N, int K, int threads, int reps);

/* The device-backend interface (memory, copies, the layers' compute
 * primitives; CPU built in, CUDA from a plugin): the second part of this
 * header, kept in its own file. */
#include "tensor/device.h"

#endif
