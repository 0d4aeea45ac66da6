/* pool.c - a fixed worker pool for data-parallel loops. Workers sleep on a
 * condition variable between jobs; with loom_pool_set_spin they first
 * busy-wait a bounded, adaptive time for the next job (and the caller for
 * the job's end), so the back-to-back phases of a training step skip the
 * futex wake-ups. One job at a time; the caller works too, so a pool of 1 runs
 * everything inline. */
#include "core.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

struct loom_pool {
    int             nthreads; /* workers, excluding the caller */
    pthread_t      *threads;
    pthread_mutex_t mu;
    pthread_cond_t  wake, done;
    _Atomic uint64_t generation; /* written under mu; read without it while spinning */
    atomic_int      stop;
    int             sleepers;    /* workers waiting on wake (under mu) */
    atomic_llong    spin_ns;     /* loom_pool_set_spin; 0: sleep at once */
    atomic_llong    spin_win;    /* the current window, adapted in [SPIN_MIN_NS, spin_ns] */
    atomic_llong    sleeps;      /* condition-variable waits so far (loom_pool_sleeps) */
    /* the current job */
    loom_pool_fn    fn;
    void           *arg;
    int             n;
    atomic_int      next;
    atomic_int      active; /* workers still inside the job */
    /* loom_pool_pin: the caller's core during a run (-1: not pinned) */
    int             caller_cpu;
};

static void run_items(loom_pool *p)
{
    for (;;) {
        int i = atomic_fetch_add(&p->next, 1);
        if (i >= p->n) break;
        p->fn(p->arg, i);
    }
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Busy-waits for done(p, x) to hold, up to the pool's current window;
 * whether it did. The clock is read every 64 pauses (a pause is ~10-150
 * cycles). The window adapts, as glibc's adaptive mutexes do: a wait that
 * ends within it doubles it (up to loom_pool_set_spin's), one that does not
 * halves it (down to SPIN_MIN_NS), and so does one the scheduler stretched
 * past it by taking the core away. On a machine with more runnable threads
 * than cores most waits end so: spinning there only burns the CPU share
 * the computing threads need, and a sleeping thread woken by the futex
 * gets the core back sooner, so the pool then sleeps nearly at once, as
 * without spinning. (No sched_yield: under load it gives the core away for
 * a whole time slice, and the caller waiting in it delays the next job.) */
#define SPIN_MIN_NS 5000
static bool spin_until(loom_pool *p, bool (*done)(const loom_pool *, uint64_t), uint64_t x)
{
    const int64_t max = atomic_load_explicit(&p->spin_ns, memory_order_relaxed);
    if (max <= 0) return done(p, x);
    int64_t win = atomic_load_explicit(&p->spin_win, memory_order_relaxed);
    win = win < SPIN_MIN_NS ? SPIN_MIN_NS : win > max ? max : win;
    const int64_t t0 = now_ns();
    bool ok = false, late = false;
    for (;;) {
        for (int k = 0; k < 64 && !(ok = done(p, x)); k++) cpu_relax();
        late = now_ns() - t0 > win;
        if (ok || late) break;
    }
    int64_t next = ok && !late ? (win * 2 < max ? win * 2 : max) : (win / 2 > SPIN_MIN_NS ? win / 2 : SPIN_MIN_NS);
    if (next != win) atomic_store_explicit(&p->spin_win, next, memory_order_relaxed);
    return ok;
}

static bool new_job(const loom_pool *p, uint64_t seen)
{
    return atomic_load_explicit(&p->generation, memory_order_acquire) != seen ||
           atomic_load_explicit(&p->stop, memory_order_relaxed);
}

static bool job_done(const loom_pool *p, uint64_t unused)
{
    (void)unused;
    return atomic_load_explicit(&p->active, memory_order_acquire) == 0;
}

static void *worker(void *arg)
{
    loom_pool *p = arg;
    uint64_t seen = 0;
    for (;;) {
        /* the caller publishes a job under mu and wakes sleepers then: a
         * worker that saw no job while spinning re-checks under mu first */
        if (!spin_until(p, new_job, seen)) {
            pthread_mutex_lock(&p->mu);
            while (!atomic_load(&p->stop) && atomic_load(&p->generation) == seen) {
                p->sleepers++;
                atomic_fetch_add_explicit(&p->sleeps, 1, memory_order_relaxed);
                pthread_cond_wait(&p->wake, &p->mu);
                p->sleepers--;
            }
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->stop)) break;
        /* a job cannot be replaced before this worker checks out of it (active) */
        seen = atomic_load_explicit(&p->generation, memory_order_acquire);
        run_items(p);
        if (atomic_fetch_sub_explicit(&p->active, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&p->mu); /* the caller may be about to wait on done */
            pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->mu);
        }
    }
    return NULL;
}

int loom_pool_new(loom_pool **out, int threads, loom_err *err)
{
    *out = NULL;
    if (threads < 1) threads = 1;
    loom_pool *p = loom_calloc(1, sizeof *p);
    if (!p) return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating a thread pool");
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->done, NULL);
    p->caller_cpu = -1;
    p->threads = loom_calloc((size_t)threads, sizeof *p->threads);
    if (!p->threads) {
        loom_pool_free(p);
        return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating a thread pool");
    }
    for (int i = 0; i < threads - 1; i++) {
        if (pthread_create(&p->threads[i], NULL, worker, p)) {
            loom_pool_free(p);
            return loom_err_set(err, LOOM_ENOMEM, NULL, "pthread_create failed for worker %d of %d", i, threads);
        }
        p->nthreads++;
    }
    *out = p;
    return LOOM_OK;
}

void loom_pool_free(loom_pool *p)
{
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, 1);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->nthreads; i++) pthread_join(p->threads[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->wake);
    pthread_cond_destroy(&p->done);
    loom_free(p->threads);
    loom_free(p);
}

int loom_pool_size(const loom_pool *p) { return p ? p->nthreads + 1 : 1; }

void loom_pool_set_spin(loom_pool *p, int usec)
{
    if (!p) return;
    atomic_store(&p->spin_ns, usec > 0 ? (long long)usec * 1000 : 0);
    atomic_store(&p->spin_win, usec > 0 ? (long long)usec * 1000 : 0);
}

int64_t loom_pool_sleeps(const loom_pool *p) { return p ? atomic_load(&p->sleeps) : 0; }

/* The index-th CPU (counting from 0) this process may run on, or -1. */
static int allowed_cpu(int index)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) != 0) return -1;
    for (int c = 0, seen = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &set) && seen++ == index) return c;
    return -1;
}

int loom_pool_pin(loom_pool *p, const int *cores, loom_err *err)
{
    int cpu[64];
    const int n = loom_pool_size(p);
    if (n > 64) return loom_err_set(err, LOOM_EUSAGE, NULL, "pinning a pool of %d threads (at most 64)", n);
    for (int i = 0; i < n; i++)
        if ((cpu[i] = allowed_cpu(cores[i])) < 0)
            return loom_err_set(err, LOOM_EUSAGE, NULL, "pinning to core %d: this process may run on %d", cores[i],
                                loom_num_cores());
    for (int i = 0; i < p->nthreads; i++) {
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(cpu[i + 1], &one);
        int rc = pthread_setaffinity_np(p->threads[i], sizeof one, &one);
        if (rc) return loom_err_set(err, LOOM_EIO, NULL, "pinning worker %d to CPU %d: %s", i, cpu[i + 1], strerror(rc));
    }
    p->caller_cpu = cpu[0];
    return LOOM_OK;
}

void loom_pool_run(loom_pool *p, int n, loom_pool_fn fn, void *arg)
{
    if (n <= 0) return;
    if (!p || p->nthreads == 0 || n == 1) {
        for (int i = 0; i < n; i++) fn(arg, i);
        return;
    }
    cpu_set_t own;
    int pinned = p->caller_cpu >= 0 && pthread_getaffinity_np(pthread_self(), sizeof own, &own) == 0;
    if (pinned) {
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(p->caller_cpu, &one);
        pinned = pthread_setaffinity_np(pthread_self(), sizeof one, &one) == 0; /* a failure leaves it unpinned */
    }
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->arg = arg;
    p->n = n;
    atomic_store(&p->next, 0);
    atomic_store(&p->active, p->nthreads);
    atomic_fetch_add_explicit(&p->generation, 1, memory_order_release); /* publishes the fields above */
    if (p->sleepers) pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    run_items(p);
    if (!spin_until(p, job_done, 0)) {
        pthread_mutex_lock(&p->mu);
        while (atomic_load(&p->active) > 0) {
            atomic_fetch_add_explicit(&p->sleeps, 1, memory_order_relaxed);
            pthread_cond_wait(&p->done, &p->mu);
        }
        pthread_mutex_unlock(&p->mu);
    }
    if (pinned) pthread_setaffinity_np(pthread_self(), sizeof own, &own);
}

int loom_num_cores(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        int n = CPU_COUNT(&set);
        if (n > 0) return n;
    }
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}
