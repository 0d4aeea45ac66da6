/* cpuid.c - the one CPUID probe of the process: vendor, model, the vector
 * features the kernels are chosen by (tensor/cpu.c, blas.c, nn, data), SSE4.2
 * for CRC-32C and the invariant TSC the pipeline's stage clock relies on.
 * Read once (pthread_once), from any thread; the result is immutable after.
 * Tests only: LOOM_TEST_CPU=avx2|baseline hides the features above that
 * level, so the AVX2 (or generic) kernels run, and are tested, on an AVX-512
 * machine; it never adds a feature the CPU lacks. */
#include "core.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

static loom_cpu_features feat;
static pthread_once_t feat_once = PTHREAD_ONCE_INIT;

static void apply_test_cap(loom_cpu_features *f)
{
    const char *cap = getenv("LOOM_TEST_CPU");
    if (!cap || !*cap) return;
    if (!strcmp(cap, "avx2")) {
        f->avx512f = f->avx512bw = f->avx512vl = f->avx512dq = false;
        f->capped = "avx2";
    } else if (!strcmp(cap, "baseline")) {
        f->avx512f = f->avx512bw = f->avx512vl = f->avx512dq = f->avx2 = f->fma = f->f16c = false;
        f->capped = "baseline";
    } else {
        loom_warn("LOOM_TEST_CPU=\"%s\" ignored (expected avx2 or baseline; a tests-only cap on the kernels' CPU "
                  "features)", cap);
    }
}

static void probe(void)
{
    loom_cpu_features *f = &feat;
    snprintf(f->vendor, sizeof f->vendor, "unknown");
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
    unsigned a, b, c, d;
    if (__get_cpuid(0, &a, &b, &c, &d)) {
        memcpy(f->vendor, &b, 4);
        memcpy(f->vendor + 4, &d, 4);
        memcpy(f->vendor + 8, &c, 4);
        f->vendor[12] = 0;
    }
    bool f16c = false;
    if (__get_cpuid(1, &a, &b, &c, &d)) {
        f16c = c >> 29 & 1;
        unsigned fam = (a >> 8) & 0xf, mod = (a >> 4) & 0xf;
        if (fam == 0xf) fam += (a >> 20) & 0xff;
        if (fam == 0x6 || fam >= 0xf) mod |= ((a >> 16) & 0xf) << 4;
        f->family = (int)fam;
        f->model = (int)mod;
    }
    unsigned max_ext = __get_cpuid_max(0x80000000, NULL);
    if (max_ext >= 0x80000004) {
        unsigned r[12];
        for (unsigned i = 0; i < 3; i++) __get_cpuid(0x80000002 + i, &r[4 * i], &r[4 * i + 1], &r[4 * i + 2], &r[4 * i + 3]);
        memcpy(f->brand, r, 48);
        f->brand[48] = 0;
        /* trim the padding some CPUs put around the name */
        char *s = f->brand;
        while (*s == ' ') s++;
        memmove(f->brand, s, strlen(s) + 1);
        for (size_t n = strlen(f->brand); n && f->brand[n - 1] == ' '; n--) f->brand[n - 1] = 0;
    }
    /* constant rate, never stopped: the TSC can stand in for CLOCK_MONOTONIC */
    f->tsc_invariant = max_ext >= 0x80000007 && __get_cpuid(0x80000007, &a, &b, &c, &d) && (d >> 8 & 1u);
    /* __builtin_cpu_supports also checks that the OS saves the vector state (XGETBV) */
    __builtin_cpu_init();
    f->sse42 = __builtin_cpu_supports("sse4.2");
    f->avx2 = __builtin_cpu_supports("avx2");
    f->fma = __builtin_cpu_supports("fma");
    f->avx512f = __builtin_cpu_supports("avx512f");
    f->avx512bw = __builtin_cpu_supports("avx512bw");
    f->avx512vl = __builtin_cpu_supports("avx512vl");
    f->avx512dq = __builtin_cpu_supports("avx512dq");
    f->f16c = f16c && __builtin_cpu_supports("avx"); /* its registers are AVX's: saved by the OS if AVX is */
#endif
    apply_test_cap(f);
}

const loom_cpu_features *loom_cpu_probe(void)
{
    pthread_once(&feat_once, probe);
    return &feat;
}
