/* cpu.c - what the CPU can do, read once from CPUID, and the kernels Loom
 * runs for it. Every choice of kernel (OpenBLAS's core in blas.c, the nn
 * kernels' level) is made from these features at start, never from the
 * environment: a VM that exports OPENBLAS_CORETYPE=Haswell on an AVX-512
 * machine would otherwise halve the products' speed. Threads: loom_cpu()
 * may be called from any thread (pthread_once). */
#include "tensor.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

static loom_cpu_info cpu;
static pthread_once_t cpu_once = PTHREAD_ONCE_INIT;

loom_cpu_level loom_cpu_pick_level(bool avx512f, bool avx512bw, bool avx512vl, bool avx512dq, bool avx2, bool fma)
{
    /* the AVX-512 subset every AVX-512 core has had since Skylake-SP, Intel's and AMD's (Zen 4 on) alike */
    if (avx512f && avx512bw && avx512vl && avx512dq && avx2 && fma) return LOOM_CPU_AVX512;
    if (avx2 && fma) return LOOM_CPU_AVX2_FMA;
    return LOOM_CPU_BASELINE;
}

const char *loom_cpu_level_name(loom_cpu_level l)
{
    switch (l) {
    case LOOM_CPU_AVX512: return "avx512";
    case LOOM_CPU_AVX2_FMA: return "avx2-fma";
    default: return "baseline";
    }
}

static void cpu_read(void)
{
    snprintf(cpu.vendor, sizeof cpu.vendor, "unknown");
#if defined(__x86_64__) && defined(__GNUC__)
    unsigned a, b, c, d;
    if (__get_cpuid(0, &a, &b, &c, &d)) {
        memcpy(cpu.vendor, &b, 4);
        memcpy(cpu.vendor + 4, &d, 4);
        memcpy(cpu.vendor + 8, &c, 4);
        cpu.vendor[12] = 0;
    }
    if (__get_cpuid(1, &a, &b, &c, &d)) {
        unsigned fam = (a >> 8) & 0xf, mod = (a >> 4) & 0xf;
        if (fam == 0xf) fam += (a >> 20) & 0xff;
        if (fam == 0x6 || fam >= 0xf) mod |= ((a >> 16) & 0xf) << 4;
        cpu.family = (int)fam;
        cpu.model = (int)mod;
    }
    unsigned max_ext = __get_cpuid_max(0x80000000, NULL);
    if (max_ext >= 0x80000004) {
        unsigned r[12];
        for (unsigned i = 0; i < 3; i++) __get_cpuid(0x80000002 + i, &r[4 * i], &r[4 * i + 1], &r[4 * i + 2], &r[4 * i + 3]);
        memcpy(cpu.brand, r, 48);
        cpu.brand[48] = 0;
        /* trim the padding some CPUs put around the name */
        char *s = cpu.brand;
        while (*s == ' ') s++;
        memmove(cpu.brand, s, strlen(s) + 1);
        for (size_t n = strlen(cpu.brand); n && cpu.brand[n - 1] == ' '; n--) cpu.brand[n - 1] = 0;
    }
    /* __builtin_cpu_supports also checks that the OS saves the vector state (XGETBV) */
    __builtin_cpu_init();
    cpu.avx2 = __builtin_cpu_supports("avx2");
    cpu.fma = __builtin_cpu_supports("fma");
    cpu.avx512f = __builtin_cpu_supports("avx512f");
    cpu.avx512bw = __builtin_cpu_supports("avx512bw");
    cpu.avx512vl = __builtin_cpu_supports("avx512vl");
    cpu.avx512dq = __builtin_cpu_supports("avx512dq");
#endif
    cpu.level = loom_cpu_pick_level(cpu.avx512f, cpu.avx512bw, cpu.avx512vl, cpu.avx512dq, cpu.avx2, cpu.fma);
}

const loom_cpu_info *loom_cpu(void)
{
    pthread_once(&cpu_once, cpu_read);
    return &cpu;
}

char *loom_cpu_describe(char *buf, size_t n)
{
    const loom_cpu_info *c = loom_cpu();
    snprintf(buf, n, "%s%s%s family %d model %d; features:%s%s%s%s%s%s%s; Loom's kernels: %s", c->brand[0] ? c->brand : "",
             c->brand[0] ? ", " : "", c->vendor, c->family, c->model, c->avx2 ? " avx2" : "", c->fma ? " fma" : "",
             c->avx512f ? " avx512f" : "", c->avx512bw ? " avx512bw" : "", c->avx512vl ? " avx512vl" : "",
             c->avx512dq ? " avx512dq" : "", c->avx2 || c->fma || c->avx512f ? "" : " sse2 only",
             loom_cpu_level_name(c->level));
    return buf;
}
