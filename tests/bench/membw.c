/* membw.c - memory bandwidth by memcpy, for pipeline_bench.sh's bound: each
 * of T threads copies its own 64 MiB buffer (far beyond the caches) R times;
 * prints the median over repetitions of bytes touched per second (a copy of
 * n bytes reads n and writes n: 2n touched) for 1 thread and for T threads.
 *   membw [-t THREADS] [-r REPS] [-m MIB]
 * Output: one line "membw: threads=1 touched_gbps=X" per thread count, then a
 * JSON line prefixed "json: ". */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct job {
    uint8_t          *src, *dst;
    size_t            n;
    pthread_barrier_t *start;
} job;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void *copy_once(void *arg)
{
    job *j = arg;
    pthread_barrier_wait(j->start);
    memcpy(j->dst, j->src, j->n);
    return NULL;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Median touched bytes/s of `reps` rounds of `threads` concurrent copies. */
static double measure(job *jobs, int threads, int reps)
{
    double *rate = calloc((size_t)reps, sizeof *rate);
    pthread_t tid[64];
    for (int r = 0; r < reps; r++) {
        pthread_barrier_t start;
        pthread_barrier_init(&start, NULL, (unsigned)threads + 1);
        for (int t = 0; t < threads; t++) {
            jobs[t].start = &start;
            pthread_create(&tid[t], NULL, copy_once, &jobs[t]);
        }
        double t0 = now();
        pthread_barrier_wait(&start);
        for (int t = 0; t < threads; t++) pthread_join(tid[t], NULL);
        double dt = now() - t0;
        pthread_barrier_destroy(&start);
        rate[r] = 2.0 * (double)jobs[0].n * threads / dt;
    }
    qsort(rate, (size_t)reps, sizeof *rate, cmp_d);
    double m = rate[reps / 2];
    free(rate);
    return m;
}

int main(int argc, char **argv)
{
    int threads = 2, reps = 7;
    size_t mib = 64;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "-t")) threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-r")) reps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-m")) mib = (size_t)atoi(argv[i + 1]);
    }
    if (threads < 1 || threads > 64 || reps < 1 || mib < 1) {
        fprintf(stderr, "usage: membw [-t THREADS (1-64)] [-r REPS] [-m MIB]\n");
        return 2;
    }
    job jobs[64];
    size_t n = mib << 20;
    for (int t = 0; t < threads; t++) {
        jobs[t].n = n;
        jobs[t].src = malloc(n);
        jobs[t].dst = malloc(n);
        if (!jobs[t].src || !jobs[t].dst) {
            fprintf(stderr, "membw: cannot allocate 2 x %zu MiB\n", mib);
            return 1;
        }
        memset(jobs[t].src, t + 1, n); /* touch every page before timing */
        memset(jobs[t].dst, 0, n);
    }
    double one = measure(jobs, 1, reps), all = threads > 1 ? measure(jobs, threads, reps) : one;
    printf("membw: threads=1 touched_gbps=%.2f\n", one / 1e9);
    if (threads > 1) printf("membw: threads=%d touched_gbps=%.2f\n", threads, all / 1e9);
    printf("json: {\"threads\": %d, \"touched_bytes_per_sec_1\": %.0f, \"touched_bytes_per_sec\": %.0f}\n", threads, one,
           all);
    for (int t = 0; t < threads; t++) {
        free(jobs[t].src);
        free(jobs[t].dst);
    }
    return 0;
}
