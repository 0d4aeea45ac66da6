/* profile.c - the per-stage report of `loom profile`, from loom_iter_stats.
 * A stage's busy time includes its input's (next() calls nest), so its own
 * time is busy minus the input's busy, clamped at 0: a threaded prefetch's
 * input runs on the producer thread, so the prefetch's own time is only the
 * consumer's wait. The bottleneck is the stage with the highest own time. */
#include "data/data_internal.h"

#include <stdio.h>
#include <string.h>

static const char *human_bytes(int64_t b, char *buf, size_t n)
{
    if (b >= (int64_t)1 << 30) snprintf(buf, n, "%.1f GiB", (double)b / (double)((int64_t)1 << 30));
    else if (b >= (int64_t)1 << 20) snprintf(buf, n, "%.1f MiB", (double)b / (double)((int64_t)1 << 20));
    else if (b >= 1024) snprintf(buf, n, "%.1f KiB", (double)b / 1024.0);
    else snprintf(buf, n, "%lld B", (long long)b);
    return buf;
}

int loom_iter_report(const loom_iter *it, double seconds, FILE *f)
{
    loom_stage_stats st[LOOM_MAX_TRANSFORMS + 1];
    int n = loom_iter_stats(it, st, LOOM_MAX_TRANSFORMS + 1);
    double own[LOOM_MAX_TRANSFORMS + 1], total = 0;
    int worst = 0;
    for (int i = 0; i < n; i++) {
        own[i] = st[i].busy_sec - (i ? st[i - 1].busy_sec : 0);
        /* a threaded prefetch's input runs on its producer: its own time is the dequeue, not the wait */
        if (!strncmp(st[i].name, "prefetch", 8) && strcmp(st[i].name, "prefetch(inline)")) own[i] = st[i].busy_sec - st[i].wait_sec;
        if (own[i] < 0) own[i] = 0;
        total += own[i];
        if (own[i] > own[worst]) worst = i;
    }
    fprintf(f, "%-3s %-26s %10s %10s %12s %9s %9s %11s %8s %10s\n", "#", "stage", "elements", "elem/s", "own us/elem",
            "busy s", "wait s", "buffer", "parallel", "memory");
    int64_t mem = 0;
    for (int i = 0; i < n; i++) {
        char buf[48] = "-", par[24] = "-", mb[32];
        if (st[i].capacity > 0 || st[i].buffered > 0)
            snprintf(buf, sizeof buf, "%lld/%lld", (long long)st[i].buffered, (long long)st[i].capacity);
        if (st[i].parallel > 0) snprintf(par, sizeof par, "%lld", (long long)st[i].parallel);
        double rate = seconds > 0 ? (double)st[i].elements / seconds : 0;
        double per = st[i].elements > 0 ? own[i] / (double)st[i].elements * 1e6 : 0;
        fprintf(f, "%-3d %-26s %10lld %10.0f %12.2f %9.3f %9.3f %11s %8s %10s\n", i, st[i].name, (long long)st[i].elements,
                rate, per, st[i].busy_sec, st[i].wait_sec, buf, par, human_bytes(st[i].bytes, mb, sizeof mb));
        mem += st[i].bytes;
    }
    char mb[32];
    fprintf(f, "total buffer memory: %s\n", human_bytes(mem, mb, sizeof mb));
    if (n > 0)
        fprintf(f, "bottleneck: %s (stage %d): %.3f s own time, %.0f%% of the pipeline's\n", st[worst].name, worst, own[worst],
                total > 0 ? own[worst] / total * 100 : 0);
    return LOOM_OK;
}

int loom_data_profile(const loom_dataset_spec *ds, const loom_data_ctx *ctx, int64_t steps, FILE *f, loom_err *err)
{
    loom_iter *it;
    double t0 = loom_now();
    int rc = loom_data_open(&it, ds, ctx, err);
    if (rc) return rc;
    double t1 = loom_now();
    int64_t card = loom_iter_cardinality(it);
    if (steps <= 0) steps = card >= 0 && card < 500 ? card : 500;
    int64_t n = 0, samples = 0;
    loom_elem *e;
    while (n < steps && (rc = loom_iter_next(it, &e, err)) == LOOM_OK) {
        n++;
        samples += e->n > 0 && e->t[0].shape.rank > 0 ? e->t[0].shape.dim[0] : 1;
    }
    double dt = loom_now() - t1;
    if (rc == LOOM_EEOF) rc = LOOM_OK;
    if (!rc) {
        fprintf(f, "profile %s: %lld elements (%lld samples) in %.3f s: %.1f elements/s, %.0f samples/s (open %.3f s, %d threads)\n",
                ctx && ctx->name ? ctx->name : "data", (long long)n, (long long)samples, dt, dt > 0 ? (double)n / dt : 0,
                dt > 0 ? (double)samples / dt : 0, t1 - t0, ctx ? ctx->threads : 1);
        fputs("plan: ", f);
        loom_iter_plan(it, f);
        loom_iter_report(it, dt, f);
        char tuned[512];
        int settled = loom_iter_tuned(it, tuned, sizeof tuned);
        if (tuned[0]) fprintf(f, "autotune%s: %s\n", settled ? "" : " (still moving)", tuned);
    }
    loom_iter_close(it);
    return rc;
}
