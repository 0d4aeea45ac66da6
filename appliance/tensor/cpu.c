/* cpu.c - what the CPU can do (core's one CPUID probe, loom_cpu_probe), and
 * the kernels Loom runs for it. Every choice of kernel (OpenBLAS's core in blas.c, the nn
 * kernels' level) is made from these features at start, never from the
 * environment: a VM that exports OPENBLAS_CORETYPE=Haswell on an AVX-512
 * machine would otherwise halve the products' speed. Threads: loom_cpu()
 * may be called from any thread (pthread_once). */
#include "tensor.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

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

/* The features from core's one CPUID probe (loom_cpu_probe), and the level they call for. */
static void cpu_read(void)
{
    const loom_cpu_features *f = loom_cpu_probe();
    memcpy(cpu.vendor, f->vendor, sizeof cpu.vendor);
    memcpy(cpu.brand, f->brand, sizeof cpu.brand);
    cpu.family = f->family;
    cpu.model = f->model;
    cpu.avx2 = f->avx2;
    cpu.fma = f->fma;
    cpu.avx512f = f->avx512f;
    cpu.avx512bw = f->avx512bw;
    cpu.avx512vl = f->avx512vl;
    cpu.avx512dq = f->avx512dq;
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
    const char *cap = loom_cpu_probe()->capped;
    size_t k = strlen(buf);
    if (cap && k < n) snprintf(buf + k, n - k, " (capped at %s by LOOM_TEST_CPU, a tests-only switch)", cap);
    return buf;
}
