/* profile.c - loom profile --train: where a training step's time goes, phase
 * by phase and layer by layer, beside the GEMM-only bound of each layer's
 * products measured at the same shapes. Threads: the caller's; the BLAS pool
 * is resized for the bound and restored. */
#include "run_internal.h"

#include <stdio.h>
#include <string.h>

enum { PROF_INPUT, PROF_FORWARD, PROF_LOSS, PROF_BACKWARD, PROF_REDUCE, PROF_APPLY, PROF_PHASES };

/* GEMM-only seconds of layer i's phases at batch B on `threads` cores: [0]
 * forward, [1] input gradient (none for a first layer), [2] kernel
 * gradient; each loom_sgemm_bound (the same bound tests/bench/gemm_peak
 * reports for the MLP). */
static int gemm_bounds(loom_model *m, int64_t B, int threads, double (*out)[3], loom_err *err)
{
    int n = loom_model_num_layers(m);
    for (int i = 0; i < n; i++)
        for (int w = 0; w < 3; w++) {
            loom_gemm_shape g;
            out[i][w] = 0;
            if (!loom_model_layer_gemm(m, i, B, w, &g)) continue;
            if ((out[i][w] = loom_sgemm_bound(g.ta, g.tb, g.M, g.N, g.K, threads, 7)) < 0)
                return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating the GEMM-bound operands");
        }
    return LOOM_OK;
}

/* The next batch, starting the next pass at the end of one. */
static int profile_next(run *r, int64_t *epoch, loom_elem **b, loom_err *err)
{
    int rc = loom_iter_next(r->train, b, err);
    if (rc != LOOM_EEOF) return rc;
    if ((rc = loom_iter_rewind(r->train, ++*epoch, err))) return rc;
    rc = loom_iter_next(r->train, b, err);
    return rc == LOOM_EEOF ? loom_err_set(err, LOOM_EDATA, r->spec->path, "data.train yields no batch") : rc;
}

static void prof_row(FILE *f, const char *name, double sec, double step, double gemm)
{
    char g[32] = "-", frac[32] = "-";
    if (gemm > 0) {
        snprintf(g, sizeof g, "%.1f", gemm * 1e6);
        snprintf(frac, sizeof frac, "%.0f%%", sec > 0 ? 100 * gemm / sec : 0);
    }
    fprintf(f, "  %-44s %10.1f %6.1f%% %10s %8s\n", name, sec * 1e6, step > 0 ? 100 * sec / step : 0, g, frac);
}

/* One profile: the run, what is measured, and the sums the report's rows share. */
typedef struct profile {
    run               r;
    int64_t           steps, warmup;
    int               cores;   /* BLAS threads of the GEMM-only bound */
    int               R;       /* replicas */
    bool              parts;   /* the strategy runs a step in parts (loom_strategy_step_part) */
    loom_model       *m0;      /* replica 0's model, whose layers are timed */
    int               nl;      /* its layers */
    loom_model_prof   prof;    /* per layer, summed over the profiled steps */
    loom_step_result *per;     /* (R) */
    double          (*bound)[3]; /* (nl) GEMM-only seconds: forward, input gradient, kernel gradient */
    double            phase[PROF_PHASES], total; /* seconds over the profiled steps */
    double            whole;   /* seconds of the unprofiled steps */
    int64_t           epoch, B, step;
} profile;

/* The warm-up, then the profiled steps, each phase timed. */
static int profile_steps(profile *p, loom_err *err)
{
    loom_model_prof zero = {0};
    int rc = LOOM_OK;
    if (p->parts) loom_model_set_prof(p->m0, &p->prof);
    for (int64_t k = 0; k < p->warmup + p->steps && !rc; k++) {
        if (k == p->warmup) {
            p->prof = zero;
            memset(p->phase, 0, sizeof p->phase);
            p->total = 0;
        }
        double t[PROF_PHASES + 1];
        loom_elem *b;
        t[0] = loom_now();
        rc = profile_next(&p->r, &p->epoch, &b, err);
        t[1] = loom_now();
        if (rc) break;
        p->B = b->t[p->r.args.input_idx].shape.dim[0];
        if (p->parts) {
            for (int part = LOOM_PART_FORWARD; part <= LOOM_PART_APPLY && !rc; part++) {
                rc = loom_strategy_step_part(p->r.strat, (loom_step_part)part, b, p->step, p->per, err);
                t[part + 2] = loom_now();
            }
        } else {
            loom_step_result res;
            rc = loom_strategy_train_step(p->r.strat, b, p->step, &res, err);
            for (int ph = PROF_FORWARD; ph < PROF_PHASES; ph++) t[ph + 1] = loom_now();
        }
        p->step++;
        for (int ph = 0; ph < PROF_PHASES; ph++) p->phase[ph] += t[ph + 1] - t[ph];
        p->total += t[PROF_PHASES] - t[0];
    }
    loom_model_set_prof(p->m0, NULL);
    return rc;
}

/* The same number of steps through the whole, unprofiled train step. */
static int profile_whole(profile *p, loom_err *err)
{
    int rc = LOOM_OK;
    for (int64_t k = 0; k < p->steps && !rc; k++) {
        loom_elem *b;
        double t0 = loom_now();
        loom_step_result res;
        rc = profile_next(&p->r, &p->epoch, &b, err);
        if (!rc) rc = loom_strategy_train_step(p->r.strat, b, p->step++, &res, err);
        p->whole += loom_now() - t0;
    }
    return rc;
}

/* The report's table: rows that sum into the step, beside their GEMM-only bound. */
typedef struct prof_table {
    FILE  *f;
    double st;              /* the profiled step's seconds */
    double sum, gemm_total; /* over the rows so far */
} prof_table;

static void row(prof_table *t, const char *label, double sec, double gemm)
{
    prof_row(t->f, label, sec, t->st, gemm);
    t->sum += sec;
    t->gemm_total += gemm;
}

/* A strategy with parts: a row per layer and phase, and what is left of each phase. */
static void part_rows(prof_table *t, const profile *p)
{
    const double n = (double)p->steps;
    char what[160], name[200];
    double lay = 0;
    row(t, "input hand-off", p->phase[PROF_INPUT] / n, 0);
    for (int i = 0; i < p->nl; i++) {
        snprintf(name, sizeof name, "forward  %s", loom_model_layer_describe(p->m0, i, what, sizeof what));
        row(t, name, p->prof.fwd[i] / n, p->bound[i][0]);
        lay += p->prof.fwd[i] / n;
    }
    row(t, "forward: chunk imbalance", p->prof.imbalance[0] / n, 0);
    row(t, "forward: dispatch", p->phase[PROF_FORWARD] / n - lay - p->prof.imbalance[0] / n, 0);
    row(t, "loss", p->phase[PROF_LOSS] / n, 0);
    lay = 0;
    for (int i = p->nl - 1; i >= 0; i--) {
        snprintf(name, sizeof name, "backward %s", loom_model_layer_describe(p->m0, i, what, sizeof what));
        row(t, name, p->prof.bwd[i] / n, p->bound[i][1]);
        lay += p->prof.bwd[i] / n;
    }
    for (int i = 0; i < p->nl; i++) {
        if (!p->bound[i][2] && !(p->prof.pgrad[i] > 0)) continue; /* layers with a weight-gradient pass */
        snprintf(name, sizeof name, "weights  %s", loom_model_layer_describe(p->m0, i, what, sizeof what));
        row(t, name, p->prof.pgrad[i] / n, p->bound[i][2]);
        lay += p->prof.pgrad[i] / n;
    }
    /* one_device updates each layer right after its weight gradients (loom_model_train_step_update) */
    double upd = 0;
    for (int i = 0; i < p->nl; i++) upd += p->prof.upd[i] / n;
    if (upd > 0) row(t, "optimizer (in backward, per layer)", upd, 0);
    row(t, "backward: chunk imbalance", p->prof.imbalance[1] / n, 0);
    row(t, "backward: dispatch", p->phase[PROF_BACKWARD] / n - lay - upd - p->prof.imbalance[1] / n, 0);
    row(t, "gradient reduction", p->phase[PROF_REDUCE] / n, 0);
    row(t, upd > 0 ? "optimizer (after backward)" : "optimizer", p->phase[PROF_APPLY] / n, 0);
}

/* A strategy without parts: the step timed whole, beside every layer's bound. */
static void whole_rows(prof_table *t, const profile *p)
{
    const double n = (double)p->steps;
    row(t, "input hand-off", p->phase[PROF_INPUT] / n, 0);
    double g = 0;
    for (int i = 0; i < p->nl; i++) g += p->bound[i][0] + p->bound[i][1] + p->bound[i][2];
    double whole_step = 0;
    for (int ph = PROF_FORWARD; ph < PROF_PHASES; ph++) whole_step += p->phase[ph] / n;
    row(t, "train step (strategy has no parts: timed whole)", whole_step, g);
}

static void profile_report(const profile *p, const loom_spec *spec, FILE *f)
{
    const double n = (double)p->steps, st = p->total / n;
    const int64_t B = p->B;
    const int R = p->R, cores = p->cores, threads = loom_model_threads(p->m0);
    char what[160];
    fprintf(f, "profile of a training step: %s\n", spec->path);
    loom_strategy_where(p->r.strat, what, sizeof what);
    fprintf(f, "strategy %s on %s, %d replica%s, %d thread%s per replica; batch %lld; %lld steps after %lld warm-up\n",
            spec->strategy.name, what, R, R == 1 ? "" : "s", threads, threads == 1 ? "" : "s", (long long)B,
            (long long)p->steps, (long long)p->warmup);
    fprintf(f, "BLAS: %s (%s); GEMM-only bound: each phase's products at batch %lld on %d core%s (one BLAS "
               "thread, all of them, or the rows split, whichever is fastest; the fastest of 7, as gemm_peak)\n",
            loom_blas_core(), loom_blas_core_reason(), (long long)B, cores, cores == 1 ? "" : "s");
    if (p->parts && R > 1)
        fprintf(f, "layer rows are replica 0's (per-replica batch %lld); the replicas run side by side\n",
                (long long)(B / R));
    fputs("data.train: ", f);
    loom_iter_plan(p->r.train, f);
    if (p->r.input_on_pool)
        fprintf(f, "  (each batch gathered inside the input hand-off on the step's %d threads, no producer thread)\n", threads);
    fprintf(f, "  %-44s %10s %7s %10s %8s\n", "phase", "us/step", "share", "GEMM us", "of bound");
    prof_table t = {.f = f, .st = st};
    if (p->parts) part_rows(&t, p);
    else whole_rows(&t, p);
    fprintf(f, "  %-44s %10s %7s %10s %8s\n", "", "----------", "-------", "----------", "--------");
    prof_row(f, "step", st, st, t.gemm_total);
    fprintf(f, "rows sum to %.1f us of the %.1f us step; GEMM-only bound %.0f samples/s, profiled step %.0f samples/s\n",
            t.sum * 1e6, st * 1e6, t.gemm_total > 0 ? (double)B / t.gemm_total : 0, (double)B / st);
    fprintf(f, "unprofiled train step (the same count of the next batches): %.1f us, %.0f samples/s (%.0f%% of the "
            "GEMM-only bound)\n",
            p->whole / n * 1e6, (double)B * n / p->whole, t.gemm_total > 0 ? 100 * t.gemm_total / (p->whole / n) : 0);
}

int loom_train_profile(const loom_spec *spec, int64_t steps, int64_t warmup, FILE *f, loom_err *err)
{
    profile prof, *p = &prof;
    memset(p, 0, sizeof *p);
    p->steps = steps < 1 ? 20 : steps;
    p->warmup = warmup < 0 ? 3 : warmup;
    p->cores = spec->run.threads > 0 ? spec->run.threads : loom_num_cores();
    /* BLAS's own pool sized for every core, for the GEMM-only bound; the
     * strategies then set the threads they call it with */
    int rc = loom_blas_init(p->cores, err);
    if (!rc) rc = train_run_open_(&p->r, spec, NULL, false, NULL, false, err);
    if (rc) goto out;
    p->R = loom_strategy_num_replicas(p->r.strat);
    p->parts = loom_strategy_has_parts(p->r.strat);
    p->m0 = p->parts ? loom_strategy_replica(p->r.strat, 0) : loom_strategy_model(p->r.strat);
    p->nl = loom_model_num_layers(p->m0);
    p->per = loom_calloc((size_t)p->R, sizeof *p->per);
    p->bound = loom_calloc((size_t)p->nl, sizeof *p->bound);
    if (!p->per || !p->bound) {
        rc = loom_err_set(err, LOOM_ENOMEM, NULL, "allocating the profile");
        goto out;
    }
    if (!(rc = profile_steps(p, err)) && !(rc = profile_whole(p, err)) &&
        !(rc = gemm_bounds(p->m0, p->B, p->cores, p->bound, err)))
        profile_report(p, spec, f);
out:
    loom_free(p->per);
    loom_free(p->bound);
    train_run_close_(&p->r);
    return rc;
}
