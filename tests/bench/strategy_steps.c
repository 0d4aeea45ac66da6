/* strategy_steps.c - per-step time of the strategies, in process, robust to
 * a busy machine: the training pipeline of a config is opened once per
 * strategy, batches are prefetched into memory, and each of `steps` training
 * steps is timed alone; the 10th percentile and the median are reported. A
 * step that another process preempted only lengthens the upper tail, so the
 * 10th percentile estimates the step time of a quiet machine.
 *
 *   strategy_steps CONFIG [steps] [runs]      (from the source root)
 *
 * Strategies: one_device with 1 thread and with all cores, mirrored(2),
 * central_storage(2), and the ceiling of any 2-replica strategy on this
 * machine: two independent one_device trainers (1 thread each, each its own
 * model and optimizer) stepping at once on the two halves of every batch,
 * with no communication at all; a step ends when both have. mirrored(2)
 * cannot beat it; its ratio to one_device(1 thread) is what perfect data
 * parallelism reaches here, cores, caches and clocks as they are now.
 * Prints a table, then "json: {...}". */
#include "train/train.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_BATCHES 64

typedef struct variant {
    const char *name;
    const char *sets[3];
} variant;

static const variant variants[] = {
    {"one_device_1thread", {"run.threads=1", NULL, NULL}},
    {"one_device_all_cores", {"run.threads=0", NULL, NULL}},
    {"mirrored2", {"strategy.type=mirrored", "strategy.replicas=2", "strategy.cross_device_ops=auto"}},
    {"central_storage2", {"strategy.type=central_storage", "strategy.replicas=2", NULL}},
    {"ceiling_2x_independent", {"run.threads=1", NULL, NULL}},
};
#define NV (int)(sizeof variants / sizeof variants[0])
enum { CEILING = 4 }; /* the two independent trainers: the last variant */
_Static_assert(sizeof variants / sizeof variants[0] == CEILING + 1, "the ceiling is the last variant");

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void die(const loom_err *e)
{
    fprintf(stderr, "strategy_steps: %s: %s\n", e->where, e->msg);
    exit(1);
}

/* Copies of the first n batches of the pipeline, so that the timed steps
 * measure the strategy, not the input. */
static int load_batches(loom_iter *it, loom_elem *out, int n, loom_err *err)
{
    for (int i = 0; i < n; i++) {
        loom_elem *b;
        int rc = loom_iter_next(it, &b, err);
        if (rc) return rc == LOOM_EEOF ? i : -1;
        out[i].n = b->n;
        for (int f = 0; f < b->n; f++) {
            if (loom_tensor_init(&out[i].t[f], b->t[f].dtype, &b->t[f].shape, err)) return -1;
            memcpy(out[i].t[f].data, b->t[f].data, loom_tensor_nbytes(&b->t[f]));
        }
    }
    return n;
}

/* The ceiling: trainer i steps on half i of the batch (loom_batch_split). */
typedef struct ceiling_job {
    loom_strategy *s[2];
    loom_elem      half[2];
    int64_t        step;
    int            rc[2];
    loom_err       err[2];
} ceiling_job;

static void ceiling_item(void *arg, int i)
{
    ceiling_job *j = arg;
    loom_step_result r;
    j->rc[i] = loom_strategy_train_step(j->s[i], &j->half[i], j->step, &r, &j->err[i]);
}

/* Times `steps` steps of one variant; sorted step times into t. */
static void run_variant(const char *cfg, const variant *v, int steps, double *t)
{
    loom_errlist *errs = calloc(1, sizeof *errs);
    loom_spec *spec;
    const char *sets[3];
    int ns = 0;
    for (int i = 0; i < 3 && v->sets[i]; i++) sets[ns++] = v->sets[i];
    if (loom_config_load(&spec, cfg, sets, ns, errs)) die(&errs->e[0]);
    free(errs);
    loom_err err;
    loom_iter *it;
    loom_data_ctx ctx = {.seed = spec->run.seed, .threads = 1, .name = "train"};
    if (loom_data_open(&it, &spec->train, &ctx, &err)) die(&err);
    static loom_elem batches[MAX_BATCHES];
    int nb = load_batches(it, batches, MAX_BATCHES, &err);
    if (nb <= 0) die(&err);
    const loom_elem_spec *es = loom_iter_spec(it);
    loom_strategy_args a = {.spec = spec, .input = es, .input_idx = loom_elem_spec_find(es, spec->model.input),
                            .label_idx = loom_elem_spec_find(es, spec->model.label),
                            .max_batch = batches[0].t[0].shape.dim[0]};
    loom_strategy *s;
    if (loom_strategy_open(&s, &a, &err)) die(&err);
    ceiling_job cj = {.s = {s}};
    loom_pool *pool = NULL;
    if (v == &variants[CEILING]) {
        a.max_batch = (a.max_batch + 1) / 2;
        if (loom_strategy_open(&cj.s[1], &a, &err) || loom_pool_new(&pool, 2, &err)) die(&err);
    }
    for (int i = 0; i < steps + 5; i++) {
        loom_step_result r;
        double t0 = loom_now();
        if (pool) {
            for (int h = 0; h < 2; h++)
                if (loom_batch_split(&batches[i % nb], 2, h, &cj.half[h], &err)) die(&err);
            cj.step = i;
            loom_pool_run(pool, 2, ceiling_item, &cj);
            for (int h = 0; h < 2; h++)
                if (cj.rc[h]) die(&cj.err[h]);
        } else if (loom_strategy_train_step(s, &batches[i % nb], i, &r, &err)) {
            die(&err);
        }
        if (i >= 5) t[i - 5] = loom_now() - t0; /* the first steps warm the caches */
    }
    qsort(t, (size_t)steps, sizeof *t, cmp_double);
    loom_pool_free(pool);
    loom_strategy_close(cj.s[1]);
    loom_strategy_close(s);
    for (int i = 0; i < nb; i++)
        for (int f = 0; f < batches[i].n; f++) loom_tensor_fini(&batches[i].t[f]);
    loom_iter_close(it);
    loom_config_free(spec);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: strategy_steps CONFIG [steps] [runs]\n");
        return 2;
    }
    int steps = argc > 2 ? atoi(argv[2]) : 300, runs = argc > 3 ? atoi(argv[3]) : 3;
    if (steps < 10 || runs < 1) return 2;
    loom_log_set_level(LOOM_LOG_WARN);
    loom_err err;
    if (loom_blas_init(1, &err)) die(&err);
    double *t = malloc((size_t)steps * sizeof *t), p10[NV] = {0}, p50[NV] = {0};
    int64_t batch = 0;
    /* the variants alternate within a run; the best run's percentiles count */
    for (int r = 0; r < runs; r++)
        for (int v = 0; v < NV; v++) {
            run_variant(argv[1], &variants[v], steps, t);
            double a = t[steps / 10], b = t[steps / 2];
            if (!p10[v] || a < p10[v]) p10[v] = a;
            if (!p50[v] || b < p50[v]) p50[v] = b;
        }
    loom_spec *spec;
    loom_errlist *errs = calloc(1, sizeof *errs);
    if (loom_config_load(&spec, argv[1], NULL, 0, errs)) die(&errs->e[0]);
    for (int i = spec->train.n_transforms - 1; i >= 0 && !batch; i--)
        if (spec->train.transform[i].kind == LOOM_T_BATCH) batch = spec->train.transform[i].batch_size;
    printf("%-22s %12s %12s %16s\n", "strategy", "p10 ms/step", "p50 ms/step", "p10 samples/s");
    for (int v = 0; v < NV; v++)
        printf("%-22s %12.3f %12.3f %16.0f\n", variants[v].name, p10[v] * 1e3, p50[v] * 1e3, (double)batch / p10[v]);
    printf("mirrored(2) / one_device(all cores) = %.3f (target >= 0.95)\n", p10[1] / p10[2]);
    printf("mirrored(2) / one_device(1 thread)  = %.3f (target >= 1.8)\n", p10[0] / p10[2]);
    printf("ceiling (2 independent halves) / one_device(1 thread) = %.3f: the most any 2-replica strategy gets "
           "here now\n", p10[0] / p10[CEILING]);
    printf("mirrored(2) / ceiling = %.3f\n", p10[CEILING] / p10[2]);
    printf("json: {\"config\": \"%s\", \"steps\": %d, \"runs\": %d", argv[1], steps, runs);
    for (int v = 0; v < NV; v++) printf(", \"%s_p10_samples_per_sec\": %.0f", variants[v].name, (double)batch / p10[v]);
    printf(", \"mirrored_vs_all_cores\": %.3f, \"mirrored_vs_1thread\": %.3f, \"ceiling_vs_1thread\": %.3f, "
           "\"mirrored_vs_ceiling\": %.3f}\n", p10[1] / p10[2], p10[0] / p10[2], p10[0] / p10[CEILING],
           p10[CEILING] / p10[2]);
    free(t);
    free(errs);
    loom_config_free(spec);
    return 0;
}
