/* allreduce_bench.c - in-process all-reduce bandwidth of every cross-device op
 * against single-thread memcpy, measured in the same run.
 *
 *   allreduce_bench [-n replicas] [-r reps] [-o op,op,...] [--min-mib M] [--max-mib M] [--floats F] [--json]
 *
 * n replica threads each hold one buffer and call loom_xcomm_all_reduce (SUM)
 * back to back, as mirrored replicas do: on a pool whose threads are pinned
 * one per core when they fit (loom_pool_pin, as mirrored pins its replicas). For each size from min to max MiB
 * (powers of two): the median time of an all-reduce over `reps` timings
 * (each of enough back-to-back calls to move 16 MiB, as nccl-tests times
 * batches of iterations, so a thread's wake-up is not counted), the bus bandwidth
 * as nccl-tests defines it, 2(n-1)/n * bytes / time, and the median bandwidth
 * of memcpy of the same size on one thread (bytes / time) in the same run;
 * then busbw / memcpy, of the medians and of the fastest runs (on a loaded
 * machine the fastest run is the better estimate of either's own cost).
 * --floats F times one size of F floats instead (a model's gradient buffer).
 * Prints a table and, with --json, one JSON line per op. */
#include "distribute/distribute.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct bench {
    loom_xcomm       *comm;
    int               n, reps, iters; /* iters: all-reduces per timing */
    int64_t           count;
    float           **bufs;
    double           *times; /* (reps,) seconds, rank 0's */
    pthread_barrier_t bar;
} bench;

typedef struct rank_arg {
    bench *b;
    int    r;
} rank_arg;

/* Timed on rank 0 from a barrier that releases every rank to the return of
 * its last call, which comes only after its peers are done with its buffer. */
static void *rank_main(void *p)
{
    rank_arg *a = p;
    bench *b = a->b;
    loom_err err;
    for (int i = -2; i < b->reps; i++) { /* two warm-ups */
        pthread_barrier_wait(&b->bar);
        double t0 = loom_now();
        for (int k = 0; k < b->iters; k++)
            if (loom_xcomm_all_reduce(b->comm, a->r, b->bufs[a->r], b->count, LOOM_REDUCE_SUM, &err)) {
                fprintf(stderr, "allreduce_bench: %s\n", err.msg);
                exit(1);
            }
        if (a->r == 0 && i >= 0) b->times[i] = (loom_now() - t0) / b->iters;
    }
    return NULL;
}

static void rank_item(void *arg, int r) { rank_main((rank_arg *)arg + r); }

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The median of v (sorted in place); *best gets the smallest. */
static double median(double *v, int n, double *best)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    *best = v[0];
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Median seconds of one all-reduce of count floats over n threads. */
/* Calls per timing: enough to move 16 MiB. */
static int iters_for(int64_t count) { return count >= (4 << 20) ? 1 : (int)((4 << 20) / count); }

static double time_all_reduce(const loom_cross_device_ops *x, int n, int64_t count, int reps, float **bufs,
                              double *best)
{
    bench b = {.n = n, .reps = reps, .iters = iters_for(count), .count = count, .bufs = bufs};
    loom_err err;
    if (loom_xcomm_open(&b.comm, x, n, &err)) {
        fprintf(stderr, "allreduce_bench: %s\n", err.msg);
        exit(1);
    }
    b.times = calloc((size_t)reps, sizeof *b.times);
    pthread_barrier_init(&b.bar, NULL, (unsigned)n);
    rank_arg a[64];
    int core[64];
    for (int r = 0; r < n; r++) a[r] = (rank_arg){&b, r}, core[r] = r;
    loom_pool *pool;
    if (loom_pool_new(&pool, n, &err) || (n <= loom_num_cores() && loom_pool_pin(pool, core, &err))) {
        fprintf(stderr, "allreduce_bench: %s\n", err.msg);
        exit(1);
    }
    loom_pool_run(pool, n, rank_item, a); /* each thread takes one rank: a rank blocks until all have one */
    loom_pool_free(pool);
    pthread_barrier_destroy(&b.bar);
    loom_xcomm_close(b.comm);
    double m = median(b.times, reps, best);
    free(b.times);
    return m;
}

/* Median seconds of a memcpy of count floats on this thread, timed like the all-reduces. */
static double time_memcpy(int64_t count, int reps, float *dst, const float *src, double *best)
{
    double *t = calloc((size_t)reps, sizeof *t);
    int iters = iters_for(count);
    for (int i = -2; i < reps; i++) {
        double t0 = loom_now();
        for (int k = 0; k < iters; k++) {
            memcpy(dst, src, (size_t)count * sizeof(float));
            __asm__ volatile("" ::: "memory");
        }
        if (i >= 0) t[i] = (loom_now() - t0) / iters;
    }
    double m = median(t, reps, best);
    free(t);
    return m;
}

static void usage(void)
{
    fputs("usage: allreduce_bench [-n replicas] [-r reps] [-o op,op,...] [--min-mib M] [--max-mib M] [--floats F] "
          "[--json]\n", stderr);
    exit(2);
}

int main(int argc, char **argv)
{
    int n = 2, reps = 15, json = 0;
    int64_t min_mib = 1, max_mib = 64, floats = 0;
    char ops[512] = "";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-n") && i + 1 < argc) n = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-r") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-o") && i + 1 < argc) snprintf(ops, sizeof ops, "%s", argv[++i]);
        else if (!strcmp(argv[i], "--min-mib") && i + 1 < argc) min_mib = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--max-mib") && i + 1 < argc) max_mib = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--floats") && i + 1 < argc) floats = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--json")) json = 1;
        else usage();
    }
    if (n < 1 || n > 64 || reps < 1 || min_mib < 1 || max_mib < min_mib || floats < 0) usage();
    if (floats) min_mib = max_mib = (floats * 4 + (1 << 20) - 1) >> 20; /* one size, in whole MiB of buffer */
    loom_err err;
    if (loom_distribute_init(&err)) {
        fprintf(stderr, "allreduce_bench: %s\n", err.msg);
        return 1;
    }
    if (!ops[0]) loom_cross_device_ops_names(ops, sizeof ops);
    int64_t max_count = max_mib << 18; /* floats */
    float **bufs = calloc((size_t)n, sizeof *bufs);
    for (int r = 0; r < n; r++) {
        bufs[r] = loom_alloc_aligned((size_t)max_count * sizeof(float));
        memset(bufs[r], 0, (size_t)max_count * sizeof(float)); /* touch every page; zeros stay zeros under SUM */
    }
    float *src = loom_alloc_aligned((size_t)max_count * sizeof(float));
    float *dst = loom_alloc_aligned((size_t)max_count * sizeof(float));
    memset(src, 0, (size_t)max_count * sizeof(float));
    memset(dst, 0, (size_t)max_count * sizeof(float));

    printf("# %d replicas on %d cores, %d reps per size, medians; busbw = 2(n-1)/n * bytes / time\n", n,
           loom_num_cores(), reps);
    printf("%-22s %8s %10s %10s %10s %10s %7s %7s\n", "op", floats ? "floats" : "MiB", "time_us", "algbw_GB/s",
           "busbw_GB/s", "memcpy_GB/s", "ratio", "best");
    char *save = NULL;
    for (char *name = strtok_r(ops, ", ", &save); name; name = strtok_r(NULL, ", ", &save)) {
        const loom_cross_device_ops *x = loom_find_cross_device_ops(name);
        if (!x) {
            char names[256];
            fprintf(stderr, "allreduce_bench: unknown op \"%s\" (available: %s)\n", name,
                    loom_cross_device_ops_names(names, sizeof names));
            return 2;
        }
        double worst = 1e30, worst_best = 1e30;
        char sizes_json[2048] = "";
        size_t used = 0;
        for (int64_t mib = min_mib; mib <= max_mib; mib *= 2) {
            int64_t count = floats ? floats : mib << 18;
            double bytes = (double)count * sizeof(float);
            double tb, tmb;
            double t = time_all_reduce(x, n, count, reps, bufs, &tb);
            double tm = time_memcpy(count, reps, dst, src, &tmb); /* right after, under the same load */
            double factor = n > 1 ? 2.0 * (n - 1) / n : 1.0;
            double busbw = factor * bytes / t, mbw = bytes / tm;
            double ratio = busbw / mbw, ratio_best = factor * tmb / tb;
            if (ratio < worst) worst = ratio;
            if (ratio_best < worst_best) worst_best = ratio_best;
            printf("%-22s %8lld %10.1f %10.2f %10.2f %10.2f %6.0f%% %6.0f%%\n", name,
                   (long long)(floats ? floats : mib), t * 1e6, bytes / t / 1e9, busbw / 1e9, mbw / 1e9, 100 * ratio,
                   100 * ratio_best);
            used += (size_t)snprintf(sizes_json + used, sizeof sizes_json - used,
                                     "%s{\"mib\":%lld,\"busbw_gbs\":%.3f,\"memcpy_gbs\":%.3f,\"ratio\":%.3f,"
                                     "\"ratio_best\":%.3f}",
                                     used ? "," : "", (long long)mib, busbw / 1e9, mbw / 1e9, ratio, ratio_best);
        }
        printf("%-22s worst ratio %.0f%%, of the fastest runs %.0f%% (target >= 70%%)\n", name, 100 * worst,
               100 * worst_best);
        if (json)
            printf("json: {\"op\":\"%s\",\"replicas\":%d,\"worst_ratio\":%.3f,\"worst_ratio_best\":%.3f,"
                   "\"sizes\":[%s]}\n", name, n, worst, worst_best, sizes_json);
        fflush(stdout);
    }
    for (int r = 0; r < n; r++) loom_free(bufs[r]);
    free(bufs);
    loom_free(src);
    loom_free(dst);
    return 0;
}
