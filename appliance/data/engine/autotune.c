/* autotune.c - tf.data's AUTOTUNE (tf_semantics 4.10) for one pipeline: the
 * stages' "auto" knobs and a thread that moves them while the pipeline runs.
 * Every period (10 ms, doubling to 2 s while nothing changes, back to 10 ms
 * after a change) the tuner measures, per knob, the share of the period its
 * stage's consumer spent waiting for it (blocked, or running the stage's own
 * calls itself because none was done). It then raises by one the parallelism
 * of the stage waited on most, if that share is over WAIT_SHARE, the knob is
 * below its maximum and the CPU budget (the sum of tuned parallelism) allows,
 * and grows by one the buffer of a prefetch waited on. This is tf.data's hill
 * climb with measured waits instead of the analytic model: only the stage
 * that holds the pipeline up gets another call in flight, and a stage that
 * keeps up is never waited on, so no thread is spent where it cannot help.
 * Thread placement: CPU knobs (threads) rise only while the pipeline's own
 * consumer (the train loop, in loom_iter_next) spends more than WAIT_SHARE of
 * the period in it, so a compute-bound step, whose input wait is ~0, never
 * gets pipeline threads competing with its compute threads for the cores;
 * and after IDLE_LOWER_NS of such periods in a row, the CPU knob above its
 * minimum whose stage is waited on least gives one unit back.
 * Memory never moves at run time: each stage allocated its buffers for its
 * knob's maximum, which the RAM budget capped at open (pipeline.c).
 * Threads: knobs are registered before dtuner_start_; afterwards the tuner
 * thread writes values, and a stage's restore may put back a saved one
 * (relaxed atomics); stages read them. */
#include "data/data_internal.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define TUNER_MAX_KNOBS  32
#define PERIOD_MIN_NS    10000000LL   /* 10 ms */
#define PERIOD_MAX_NS    2000000000LL /* 2 s */
#define WAIT_SHARE       0.02         /* a stage waited on this share of a period is worth one more unit */
#define SETTLE_PERIODS   6            /* quiet periods in a row (0.6 s) before the values count as settled */
#define IDLE_LOWER_NS    1000000000LL /* consumer never waiting this long: one CPU unit is given back */

struct dtuner {
    int             cpu_budget;
    int             nk;
    dknob           knob[TUNER_MAX_KNOBS];
    int64_t         last_wait[TUNER_MAX_KNOBS];
    int             quiet;   /* periods without a change; under mu */
    dstage         *out;     /* the pipeline's last stage: its busy time is its consumer's input time */
    int64_t         last_out, idle_ns;
    pthread_t       th;
    int             started, stop;
    pthread_mutex_t mu;
    pthread_cond_t  cv;
};

int64_t dtuner_ram_budget_(const loom_data_options *o)
{
    if (o && o->present && o->ram_budget > 0) return o->ram_budget;
    double frac = o && o->present && o->ram_fraction > 0 ? o->ram_fraction : 0.5;
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    double phys = pages > 0 && psz > 0 ? (double)pages * (double)psz : 4.0 * (1 << 30);
    return (int64_t)(phys * frac);
}

int dtuner_new_(dtuner **out, int cpu_budget, loom_err *err)
{
    *out = loom_calloc(1, sizeof **out);
    if (!*out) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the autotuner");
    (*out)->cpu_budget = cpu_budget > 0 ? cpu_budget : 1;
    pthread_mutex_init(&(*out)->mu, NULL);
    pthread_cond_init(&(*out)->cv, NULL);
    return LOOM_OK;
}

dknob *dtuner_knob_(dtuner *t, dstage *s, const char *what, int64_t value, int64_t min, int64_t max, int cpu)
{
    LOOM_ASSERT(!t->started && min >= 1 && min <= max);
    if (t->nk == TUNER_MAX_KNOBS) return NULL;
    dknob *k = &t->knob[t->nk++];
    *k = (dknob){.stage = s, .what = what, .value = value < min ? min : value > max ? max : value, .min = min,
                 .max = max, .cpu = cpu};
    return k;
}

int64_t dtuner_cpu_spare_(const dtuner *t)
{
    int64_t used = 0;
    for (int i = 0; i < t->nk; i++)
        if (t->knob[i].cpu) used += t->knob[i].value;
    return t->cpu_budget - used;
}

static void set_value(dknob *k, int64_t v)
{
    __atomic_store_n(&k->value, v, __ATOMIC_RELAXED);
    dstage_gauge_(k->cpu ? &k->stage->st_parallel : &k->stage->st_capacity, v);
    if (k->changed) k->changed(k->stage);
}

void dtuner_output_(dtuner *t, dstage *last)
{
    if (!t) return;
    t->out = last;
    t->last_out = dstage_load_(&last->st_busy_ns);
}

/* One decision over a period of dt ns; returns whether a value changed. */
static int step(dtuner *t, int64_t dt)
{
    int best = -1, least = -1, used = 0, changed = 0;
    double best_share = WAIT_SHARE, least_share = 2;
    bool starved = true; /* the consumer waits for input (or nobody said who it is) */
    if (t->out) {
        int64_t in = dstage_load_(&t->out->st_busy_ns);
        starved = (double)(in - t->last_out) / (double)dt > WAIT_SHARE;
        t->last_out = in;
        t->idle_ns = starved ? 0 : t->idle_ns + dt;
    }
    for (int i = 0; i < t->nk; i++) {
        dknob *k = &t->knob[i];
        int64_t v = dknob_get_(k), wait = dstage_load_(&k->stage->st_wait_ns);
        double share = (double)(wait - t->last_wait[i]) / (double)dt;
        t->last_wait[i] = wait;
        if (__atomic_load_n(&k->inert, __ATOMIC_RELAXED)) continue;
        if (k->cpu) {
            used += (int)v;
            if (share > best_share && v < k->max) best = i, best_share = share;
            if (share < least_share && v > k->min) least = i, least_share = share;
        } else if (share > WAIT_SHARE && v < k->max) {
            set_value(k, v + 1);
            changed = 1;
        }
    }
    if (best >= 0 && used < t->cpu_budget && starved) {
        set_value(&t->knob[best], dknob_get_(&t->knob[best]) + 1);
        changed = 1;
    } else if (least >= 0 && t->idle_ns >= IDLE_LOWER_NS) {
        set_value(&t->knob[least], dknob_get_(&t->knob[least]) - 1);
        t->idle_ns = 0;
        changed = 1;
    }
    return changed;
}

static void *tuner_main(void *arg)
{
    dtuner *t = arg;
    int64_t period = PERIOD_MIN_NS, t0 = dnow_ns_();
    pthread_mutex_lock(&t->mu);
    while (!t->stop) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        int64_t ns = until.tv_nsec + period;
        until.tv_sec += ns / 1000000000;
        until.tv_nsec = ns % 1000000000;
        while (!t->stop && pthread_cond_timedwait(&t->cv, &t->mu, &until) == 0) {}
        if (t->stop) break;
        pthread_mutex_unlock(&t->mu);
        int64_t t1 = dnow_ns_();
        int changed = step(t, t1 - t0);
        t0 = t1;
        pthread_mutex_lock(&t->mu);
        t->quiet = changed ? 0 : t->quiet + 1;
        period = changed ? PERIOD_MIN_NS : period * 2 < PERIOD_MAX_NS ? period * 2 : PERIOD_MAX_NS;
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

int dtuner_start_(dtuner *t, loom_err *err)
{
    if (t->nk == 0) return LOOM_OK;
    for (int i = 0; i < t->nk; i++) {
        t->last_wait[i] = dstage_load_(&t->knob[i].stage->st_wait_ns);
        set_value(&t->knob[i], t->knob[i].value);
    }
    if (pthread_create(&t->th, NULL, tuner_main, t) != 0)
        return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot start the autotuner thread");
    t->started = 1;
    return LOOM_OK;
}

void dtuner_stop_(dtuner *t)
{
    if (!t || !t->started) return;
    pthread_mutex_lock(&t->mu);
    t->stop = 1;
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
    pthread_join(t->th, NULL);
    t->started = 0;
}

void dtuner_free_(dtuner *t)
{
    if (!t) return;
    dtuner_stop_(t);
    pthread_mutex_destroy(&t->mu);
    pthread_cond_destroy(&t->cv);
    loom_free(t);
}

int dtuner_summary_(dtuner *t, char *buf, size_t n)
{
    size_t k = 0;
    if (n) buf[0] = 0;
    for (int i = 0; t && i < t->nk && k < n; i++) {
        const dknob *kn = &t->knob[i];
        if (__atomic_load_n(&kn->inert, __ATOMIC_RELAXED)) continue;
        int w = snprintf(buf + k, n - k, "%s%s: %s %lld (of %lld)", k ? "; " : "", kn->stage->name, kn->what,
                         (long long)dknob_get_(kn), (long long)kn->max);
        if (w < 0) break;
        k += (size_t)w;
    }
    if (!t || !t->started || k == 0) return 0; /* nothing tuned: nothing to report */
    pthread_mutex_lock(&t->mu);
    int settled = t->quiet >= SETTLE_PERIODS;
    pthread_mutex_unlock(&t->mu);
    return settled;
}
