/* profile.c - loom profile --train: where a training step's time goes, phase
 * by phase and layer by layer, beside the GEMM-only bound of each layer's
 * products measured at the same shapes. Threads: the caller's; the BLAS pool
 * is resized for the bound and restored. */
#include "run_internal.h"

#include <stdio.h>
#include <string.h>

enum { PROF_INPUT, PROF_FORWARD, PROF_LOSS, PROF_BACKWARD, PROF_REDUCE, PROF_APPLY, PROF_PHASES };

/* Seconds of one sgemm of shape g: the fastest of 7 repetitions, each
 * repeating it for >= 5 ms (a bound: on a shared machine the median
 * measures the other processes too). */
static double gemm_seconds(const loom_gemm_shape *g, float *A, float *B, float *C)
{
    int lda = g->ta ? g->M : g->K, ldb = g->tb ? g->K : g->N;
    loom_sgemm(g->ta, g->tb, g->M, g->N, g->K, 1.f, A, lda, B, ldb, 0.f, C, g->N);
    int calls = 0;
    double t0 = loom_now();
    do {
        loom_sgemm(g->ta, g->tb, g->M, g->N, g->K, 1.f, A, lda, B, ldb, 0.f, C, g->N);
        calls++;
    } while (loom_now() - t0 < 0.005);
    double best = 0;
    for (int r = 0; r < 7; r++) {
        t0 = loom_now();
        for (int i = 0; i < calls; i++) loom_sgemm(g->ta, g->tb, g->M, g->N, g->K, 1.f, A, lda, B, ldb, 0.f, C, g->N);
        double v = (loom_now() - t0) / calls;
        if (r == 0 || v < best) best = v;
    }
    return best;
}

/* GEMM-only seconds of layer i's phases at batch B on `threads` BLAS threads: [0] forward, [1] input gradient, [2] kernel gradient. */
static int gemm_bounds(loom_model *m, int64_t B, int threads, double (*out)[3], loom_err *err)
{
    size_t na = 1, nb = 1, nc = 1;
    int n = loom_model_num_layers(m);
    for (int i = 0; i < n; i++)
        for (int w = 0; w < 3; w++) {
            loom_gemm_shape g;
            if (!loom_model_layer_gemm(m, i, B, w, &g)) continue;
            size_t a = (size_t)g.M * g.K, b = (size_t)g.K * g.N, c = (size_t)g.M * g.N;
            na = a > na ? a : na, nb = b > nb ? b : nb, nc = c > nc ? c : nc;
        }
    float *A = loom_alloc_aligned(na * sizeof(float)), *Bm = loom_alloc_aligned(nb * sizeof(float)),
          *C = loom_alloc_aligned(nc * sizeof(float));
    if (!A || !Bm || !C) {
        loom_free(A), loom_free(Bm), loom_free(C);
        return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating the GEMM-bound operands");
    }
    for (size_t k = 0; k < na; k++) A[k] = (float)(k % 7) * 0.1f - 0.3f;
    for (size_t k = 0; k < nb; k++) Bm[k] = (float)(k % 5) * 0.1f - 0.2f;
    int prev = loom_blas_threads();
    loom_blas_set_threads(threads);
    for (int i = 0; i < n; i++)
        for (int w = 0; w < 3; w++) {
            loom_gemm_shape g;
            out[i][w] = loom_model_layer_gemm(m, i, B, w, &g) ? gemm_seconds(&g, A, Bm, C) : 0;
        }
    loom_blas_set_threads(prev);
    loom_free(A), loom_free(Bm), loom_free(C);
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

/* long: measures (warm-up, profiled steps, the unprofiled steps, GEMM bounds), then prints one
 * table whose rows share the sums; the report is to become a function of its own. */
int loom_train_profile(const loom_spec *spec, int64_t steps, int64_t warmup, FILE *f, loom_err *err)
{
    if (steps < 1) steps = 20;
    if (warmup < 0) warmup = 3;
    int cores = spec->run.threads > 0 ? spec->run.threads : loom_num_cores();
    /* BLAS's own pool sized for every core, for the GEMM-only bound; the
     * strategies then set the threads they call it with */
    run r;
    memset(&r, 0, sizeof r);
    int rc = loom_blas_init(cores, err);
    if (!rc) rc = run_open_(&r, spec, NULL, false, NULL, false, err);
    if (rc) {
        run_close_(&r);
        return rc;
    }
    loom_strategy *s = r.strat;
    int R = loom_strategy_num_replicas(s);
    bool parts = loom_strategy_has_parts(s);
    loom_model *m0 = parts ? loom_strategy_replica(s, 0) : loom_strategy_model(s);
    int nl = loom_model_num_layers(m0);
    loom_model_prof prof = {0}, zero = {0};
    loom_step_result *per = loom_calloc((size_t)R, sizeof *per);
    double (*bound)[3] = loom_calloc((size_t)nl, sizeof *bound);
    if (!per || !bound) {
        rc = loom_err_set(err, LOOM_ENOMEM, NULL, "allocating the profile");
        goto out;
    }
    double phase[PROF_PHASES] = {0}, total = 0, whole = 0;
    int64_t epoch = 0, B = 0, step = 0;
    if (parts) loom_model_set_prof(m0, &prof);
    for (int64_t k = 0; k < warmup + steps && !rc; k++) {
        if (k == warmup) {
            prof = zero;
            memset(phase, 0, sizeof phase);
            total = 0;
        }
        double t[PROF_PHASES + 1];
        loom_elem *b;
        t[0] = loom_now();
        rc = profile_next(&r, &epoch, &b, err);
        t[1] = loom_now();
        if (rc) break;
        B = b->t[r.args.input_idx].shape.dim[0];
        if (parts) {
            for (int p = LOOM_PART_FORWARD; p <= LOOM_PART_APPLY && !rc; p++) {
                rc = loom_strategy_step_part(s, (loom_step_part)p, b, step, per, err);
                t[p + 2] = loom_now();
            }
        } else {
            loom_step_result res;
            rc = loom_strategy_train_step(s, b, step, &res, err);
            for (int p = PROF_FORWARD; p < PROF_PHASES; p++) t[p + 1] = loom_now();
        }
        step++;
        for (int p = 0; p < PROF_PHASES; p++) phase[p] += t[p + 1] - t[p];
        total += t[PROF_PHASES] - t[0];
    }
    loom_model_set_prof(m0, NULL);
    /* the same number of steps through the whole, unprofiled train step */
    for (int64_t k = 0; k < steps && !rc; k++) {
        loom_elem *b;
        double t0 = loom_now();
        loom_step_result res;
        rc = profile_next(&r, &epoch, &b, err);
        if (!rc) rc = loom_strategy_train_step(s, b, step++, &res, err);
        whole += loom_now() - t0;
    }
    if (!rc) rc = gemm_bounds(m0, B, cores, bound, err);
    if (rc) goto out;

    const double n = (double)steps, st = total / n;
    char what[160], name[200];
    fprintf(f, "profile of a training step: %s\n", spec->path);
    loom_strategy_where(s, what, sizeof what);
    fprintf(f, "strategy %s on %s, %d replica%s, %d thread%s per replica; batch %lld; %lld steps after %lld warm-up\n",
            spec->strategy.name, what, R, R == 1 ? "" : "s", loom_model_threads(m0),
            loom_model_threads(m0) == 1 ? "" : "s", (long long)B, (long long)steps, (long long)warmup);
    fprintf(f, "BLAS: %s (%s); GEMM-only bound: each phase's products at batch %lld on %d BLAS thread%s\n",
            loom_blas_core(), loom_blas_core_reason(), (long long)B, cores, cores == 1 ? "" : "s");
    if (parts && R > 1)
        fprintf(f, "layer rows are replica 0's (per-replica batch %lld); the replicas run side by side\n",
                (long long)(B / R));
    fprintf(f, "  %-44s %10s %7s %10s %8s\n", "phase", "us/step", "share", "GEMM us", "of bound");
    double gemm_total = 0, sum = 0;
#define ROW(label, sec, gemm) (prof_row(f, label, sec, st, gemm), sum += (sec), gemm_total += (gemm))
    ROW("input hand-off", phase[PROF_INPUT] / n, 0);
    if (parts) {
        double lay = 0;
        for (int i = 0; i < nl; i++) {
            snprintf(name, sizeof name, "forward  %s", loom_model_layer_describe(m0, i, what, sizeof what));
            ROW(name, prof.fwd[i] / n, bound[i][0]);
            lay += prof.fwd[i] / n;
        }
        ROW("forward: dispatch, chunk imbalance", phase[PROF_FORWARD] / n - lay, 0);
        ROW("loss", phase[PROF_LOSS] / n, 0);
        lay = 0;
        for (int i = nl - 1; i >= 0; i--) {
            snprintf(name, sizeof name, "backward %s", loom_model_layer_describe(m0, i, what, sizeof what));
            ROW(name, prof.bwd[i] / n, bound[i][1]);
            lay += prof.bwd[i] / n;
        }
        for (int i = 0; i < nl; i++) {
            if (!bound[i][2] && !(prof.pgrad[i] > 0)) continue; /* layers with a weight-gradient pass */
            snprintf(name, sizeof name, "weights  %s", loom_model_layer_describe(m0, i, what, sizeof what));
            ROW(name, prof.pgrad[i] / n, bound[i][2]);
            lay += prof.pgrad[i] / n;
        }
        ROW("backward: dispatch, chunk imbalance", phase[PROF_BACKWARD] / n - lay, 0);
        ROW("gradient reduction", phase[PROF_REDUCE] / n, 0);
        ROW("optimizer", phase[PROF_APPLY] / n, 0);
    } else {
        double g = 0;
        for (int i = 0; i < nl; i++) g += bound[i][0] + bound[i][1] + bound[i][2];
        double whole_step = 0;
        for (int p = PROF_FORWARD; p < PROF_PHASES; p++) whole_step += phase[p] / n;
        ROW("train step (strategy has no parts: timed whole)", whole_step, g);
    }
#undef ROW
    fprintf(f, "  %-44s %10s %7s %10s %8s\n", "", "----------", "-------", "----------", "--------");
    prof_row(f, "step", st, st, gemm_total);
    fprintf(f, "rows sum to %.1f us of the %.1f us step; GEMM-only bound %.0f samples/s, profiled step %.0f samples/s\n",
            sum * 1e6, st * 1e6, gemm_total > 0 ? (double)B / gemm_total : 0, (double)B / st);
    fprintf(f, "unprofiled train step (the same count of the next batches): %.1f us, %.0f samples/s (%.0f%% of the "
            "GEMM-only bound)\n",
            whole / n * 1e6, (double)B * n / whole, gemm_total > 0 ? 100 * gemm_total / (whole / n) : 0);
out:
    loom_free(per);
    loom_free(bound);
    run_close_(&r);
    return rc;
}
