/* gradcheck.c - `loom check --gradcheck`: every layer's backward against
 * central differences. Each layer of the model is built alone (its own
 * one-layer model, the same spec and input shape) under a mean squared error
 * against random targets, on a small batch of random inputs; the analytic
 * gradients (of the input, and of each trained parameter tensor) come from
 * the usual forward, loss and backward, the numeric ones from the loss at
 * x +- h, in float as the model computes, each estimate taken twice (steps
 * h and h/2): where the two disagree by more than half the tolerance a kink
 * (relu at 0, a max's tie) lies inside the step, and smaller steps are
 * tried; an element where none agree is skipped, else the finer estimate is
 * compared. An element whose estimates agree but miss the analytic value
 * is re-tested one-sided before it fails: a kink exactly at the point (a
 * relu's pre-activation at 0) makes the central difference the mean of the
 * two slopes while the backward takes one of them, so the element passes if
 * the analytic value matches the slope on either side (each side by
 * Richardson's extrapolation of two steps, whose estimates agree); a wrong
 * backward matches neither. Sampled elements only (NN_GC_SAMPLES per
 * tensor), so a big layer checks quickly. */
#include "nn_internal.h"

#include <math.h>
#include <string.h>

#define NN_GC_SAMPLES 40
#define NN_GC_BATCH   2
#define NN_GC_H       4e-3
#define NN_GC_ATOL    2e-3 /* |analytic - numeric| <= atol + rtol max(|analytic|, |numeric|) */
#define NN_GC_RTOL    5e-2

/* Tests only (nn_internal.h): the analytic gradients scaled by 1 + this, a wrong backward to be caught. */
float nn_gradcheck_skew_ = 0.f;

typedef struct gc_case {
    loom_model  *m;
    loom_tensor  x, t;
    float       *xf;      /* the inputs as float (x's data, or NULL for ids) */
    uint64_t     key;
} gc_case;

/* The loss sum of the one-layer model on the case's batch. */
static double gc_loss(void *ctx, loom_err *err)
{
    gc_case *g = ctx;
    double l = NAN;
    int64_t ok;
    if (loom_model_forward(g->m, &g->x, g->key, err) || loom_model_loss(g->m, &g->t, NN_GC_BATCH, &l, &ok, err))
        return NAN;
    return l;
}

/* d(loss(p)) / d(*p) by differences with step h: central (side 0), or one-sided to the right (+1) or left (-1). */
static double gc_diff(nn_gc_loss_fn_ loss, void *ctx, float *p, double h, int side, loom_err *err)
{
    const float v = *p;
    double lp, lm, hp = 0, hm = 0;
    if (side >= 0) {
        *p = (float)(v + h);
        hp = (double)*p - v;
        lp = loss(ctx, err);
    } else lp = loss(ctx, err);
    if (side <= 0) {
        *p = (float)(v - h);
        hm = v - (double)*p;
        lm = loss(ctx, err);
    } else {
        *p = v;
        lm = loss(ctx, err);
    }
    *p = v;
    return (lp - lm) / (hp + hm);
}

static bool gc_close(double a, double n) /* the comparison's tolerance */
{
    double mag = fabs(a) > fabs(n) ? fabs(a) : fabs(n);
    return fabs(a - n) <= NN_GC_ATOL + NN_GC_RTOL * mag;
}

/* The slope on one side of *p (side +1 or -1), extrapolated from steps h and h/2 (Richardson), its two
 * estimates agreeing within a quarter of the tolerance; NAN where they do not (a kink inside that side too). */
static double gc_one_side(nn_gc_loss_fn_ loss, void *ctx, float *p, double h, int side, double scale, loom_err *err)
{
    double d1 = gc_diff(loss, ctx, p, h, side, err) * scale, d2 = gc_diff(loss, ctx, p, h / 2, side, err) * scale;
    double r = 2 * d2 - d1;
    if (!isfinite(d1) || !isfinite(d2)) return NAN;
    return fabs(r - d2) <= 0.25 * (NN_GC_ATOL + NN_GC_RTOL * fabs(r)) ? r : NAN;
}

nn_gc_verdict_ nn_gc_element_(nn_gc_loss_fn_ loss, void *ctx, float *p, double ana, double scale, double *num,
                              loom_err *err)
{
    /* three steps (h, h/2, h/4) disagree by about the finer ones' own errors when a kink lies inside the step (relu's
     * at 0 crossed by one of the many outputs a weight feeds): then again with steps 8 and 64 times
     * smaller (fewer crossings, more rounding), and compared only once they agree well inside the
     * tolerance; else the element is skipped */
    double h = NN_GC_H * (fabs(*p) > 1 ? fabs(*p) : 1), n2 = 0;
    bool agree = false;
    for (int t = 0; t < 3 && !agree; t++, h /= 8) {
        double n1 = gc_diff(loss, ctx, p, h, 0, err) * scale;
        n2 = gc_diff(loss, ctx, p, h / 2, 0, err) * scale;
        double n4 = gc_diff(loss, ctx, p, h / 4, 0, err) * scale;
        if (!isfinite(n1) || !isfinite(n2) || !isfinite(n4)) return NN_GC_ERROR;
        double tol = 0.25 * (NN_GC_ATOL + NN_GC_RTOL * fabs(n2));
        agree = fabs(n1 - n2) <= tol && fabs(n2 - n4) <= tol;
    }
    *num = n2;
    if (!agree) return NN_GC_SKIPPED;
    if (gc_close(ana, n2)) return NN_GC_PASS;
    /* re-tested one-sided, with the finest step the central check reached (fewest crossings) */
    h = NN_GC_H * (fabs(*p) > 1 ? fabs(*p) : 1) / 16;
    for (int side = 1; side >= -1; side -= 2) {
        double s = gc_one_side(loss, ctx, p, h, side, scale, err);
        if (err->code) return NN_GC_ERROR;
        if (isfinite(s) && gc_close(ana, s)) return NN_GC_RETESTED;
    }
    return NN_GC_BAD;
}

typedef struct gc_stats {
    double max_abs, max_rel;
    int    checked, skipped, bad, retested;
} gc_stats;

/* Compares n sampled elements of p (len floats) with the analytic ana.
 * Both are scaled by the layer's outputs per example (scale): the mean
 * squared error divides by them, the comparison is of the gradient of the
 * summed squares, O(1) whatever the layer's size. */
static int gc_tensor(gc_case *g, float *p, const float *ana, int64_t len, double scale, loom_rng *r, gc_stats *st,
                     loom_err *err)
{
    for (int k = 0; k < NN_GC_SAMPLES && len > 0; k++) {
        int64_t e = len <= NN_GC_SAMPLES ? k : (int64_t)loom_rng_below(r, (uint64_t)len);
        if (e >= len) break;
        /* every other sample where the analytic gradient is not zero (a max's winners, a padding's inside) */
        for (int tries = 0; len > NN_GC_SAMPLES && k % 2 && ana[e] == 0.f && tries < 256; tries++)
            e = (int64_t)loom_rng_below(r, (uint64_t)len);
        double n2 = 0, a = ana[e] * scale;
        nn_gc_verdict_ v = nn_gc_element_(gc_loss, g, &p[e], a, scale / NN_GC_BATCH, &n2, err);
        if (v == NN_GC_ERROR) return err->code ? err->code : LOOM_ENUMERIC;
        if (v == NN_GC_SKIPPED) {
            st->skipped++;
            continue;
        }
        double d = fabs(a - n2), mag = fabs(a) > fabs(n2) ? fabs(a) : fabs(n2);
        st->checked++;
        st->retested += v == NN_GC_RETESTED;
        if (v == NN_GC_RETESTED) continue; /* its central error is the kink's, not the backward's */
        if (d > st->max_abs) st->max_abs = d;
        if (mag > 1e-3 && d / mag > st->max_rel) st->max_rel = d / mag;
        st->bad += v == NN_GC_BAD;
    }
    return LOOM_OK;
}

/* A lstm or gru with return_state: its state views after it, their outputs joined to its own (as rows
 * (1, H) after its (T, H), or (3 H,) / (2 H,) after its (H,)), so d h_T and d c_T are checked too; out
 * the joined shape. */
static void gc_states(loom_model_spec *spec, const nn_layer_ *l, loom_shape *out)
{
    const loom_layer_spec *r = &spec->layer[0];
    const int nv = r->kind == LOOM_LAYER_LSTM ? 2 : 1;
    const bool seq = r->return_sequences;
    loom_layer_spec *cat = &spec->layer[1 + nv * (seq ? 2 : 1)];
    memset(cat, 0, sizeof *cat);
    cat->kind = LOOM_LAYER_CONCATENATE, cat->loc = r->loc, cat->axis = seq ? 1 : -1, cat->n_inputs = 1 + nv;
    snprintf(cat->name, sizeof cat->name, "gc_states");
    snprintf(cat->inputs[0], sizeof cat->inputs[0], "%s", r->name);
    for (int v = 1; v <= nv; v++) {
        loom_layer_spec *p = &spec->layer[v];
        *p = *r;
        p->return_state = false, p->state_of = v, p->n_inputs = 1;
        snprintf(p->name, sizeof p->name, "gc_state_%d", v);
        snprintf(p->inputs[0], sizeof p->inputs[0], "%s", r->name);
        snprintf(cat->inputs[v], sizeof cat->inputs[v], "%s", p->name);
        if (!seq) continue;
        loom_layer_spec *q = &spec->layer[nv + v];
        memset(q, 0, sizeof *q);
        q->kind = LOOM_LAYER_RESHAPE, q->loc = r->loc, q->n_target = 2, q->target[0] = 1, q->target[1] = r->units;
        q->n_inputs = 1;
        snprintf(q->name, sizeof q->name, "gc_row_%d", v);
        snprintf(q->inputs[0], sizeof q->inputs[0], "%s", p->name);
        snprintf(cat->inputs[v], sizeof cat->inputs[v], "%s", q->name);
    }
    spec->n_layers = 2 + nv * (seq ? 2 : 1);
    *out = l->out;
    if (seq) out->dim[0] += nv;
    else out->dim[0] *= 1 + nv;
}

/* Layer li of m alone: its gradients checked into st. */
static int gc_layer(const loom_model *m, int li, gc_stats *st, loom_err *err)
{
    const nn_layer_ *l = &m->layer[li];
    static loom_model_spec spec; /* big; the check runs on one thread */
    memset(&spec, 0, sizeof spec);
    spec.loc = l->spec.loc;
    spec.loss = LOOM_LOSS_MSE;
    spec.huber_delta = 1;
    spec.n_layers = 1;
    spec.layer[0] = l->spec;
    if (l->n_src == 1) spec.layer[0].n_inputs = 0; /* alone it reads the model input, not the layer it named */
    const bool ids = li == 0 && m->input_dtype != LOOM_F32;
    loom_shape os = l->out;
    if (l->spec.return_state) gc_states(&spec, l, &os);
    gc_case g = {.key = 0x6772616463686bull};
    int rc = loom_model_new(&g.m, &spec, &l->in, ids ? m->input_dtype : LOOM_F32, &os, LOOM_F32, NN_GC_BATCH, err);
    if (rc) return rc;
    loom_model *gm = g.m;
    nn_layer_ *gl = &gm->layer[0];
    gl->needs_dx = !ids; /* the input gradient too */
    loom_model_init_params(gm, 11 + (uint64_t)li);
    loom_rng r;
    loom_rng_init(&r, 0x6763, (uint64_t)li, 0, 0);
    /* parameters away from their initial zeros and ones, so every term of the gradient shows */
    for (int64_t e = 0; e < gm->n_params; e++) gm->params[e] += 0.2f * loom_rng_normal(&r);
    if (gl->mv_off >= 0)
        for (int64_t e = 0; e < gl->C; e++) gm->params[gl->mv_off + e] = 1.f + fabsf(gm->params[gl->mv_off + e]);
    const int64_t nin = l->n_in, nout = loom_shape_numel(&os);
    float *xf = NULL, *tf = loom_alloc((size_t)(NN_GC_BATCH * nout) * sizeof(float));
    void *xd = loom_alloc((size_t)(NN_GC_BATCH * nin) * 8);
    float *ana = loom_alloc((size_t)(gm->n_params + NN_GC_BATCH * nin + 1) * sizeof(float));
    if (!tf || !xd || !ana) {
        rc = loom_err_set(err, LOOM_ENOMEM, l->where, "gradcheck of layer \"%s\"", l->spec.name);
        goto done;
    }
    if (ids) {
        for (int64_t e = 0; e < NN_GC_BATCH * nin; e++) {
            int64_t id = (int64_t)loom_rng_below(&r, (uint64_t)gl->rows);
            if (m->input_dtype == LOOM_I32) ((int32_t *)xd)[e] = (int32_t)id;
            else ((int64_t *)xd)[e] = id;
        }
    } else {
        xf = xd;
        for (int64_t e = 0; e < NN_GC_BATCH * nin; e++) xf[e] = loom_rng_normal(&r);
    }
    loom_shape xs = {.rank = l->in.rank + 1}, ts = {.rank = os.rank + 1};
    xs.dim[0] = ts.dim[0] = NN_GC_BATCH;
    for (int i = 0; i < l->in.rank; i++) xs.dim[i + 1] = l->in.dim[i];
    for (int i = 0; i < os.rank; i++) ts.dim[i + 1] = os.dim[i];
    g.x = (loom_tensor){.dtype = ids ? m->input_dtype : LOOM_F32, .shape = xs, .data = xd};
    g.t = (loom_tensor){.dtype = LOOM_F32, .shape = ts, .data = tf};
    /* targets: the outputs plus noise, so d(loss)/d(output) is random and independent of the output: a
     * rounding every output shares (a normalisation's 1/std in float) then adds up as noise, not coherently */
    for (int64_t e = 0; e < NN_GC_BATCH * nout; e++) tf[e] = 0.f;
    if ((rc = loom_model_forward(gm, &g.x, g.key, err))) goto done;
    for (int64_t e = 0; e < NN_GC_BATCH * nout; e++) tf[e] = gm->chunk[0].act[gm->n_layers][e] + loom_rng_normal(&r);
    /* the analytic gradients: parameters from the grads buffer, the input's from the chunk's rows */
    if (!isfinite(gc_loss(&g, err)) || (rc = loom_model_backward(gm, err))) {
        rc = rc ? rc : err->code ? err->code : LOOM_ENUMERIC;
        goto done;
    }
    memcpy(ana, gm->grads, (size_t)gm->n_params * sizeof(float));
    float *gx = ana + gm->n_params;
    if (xf) memcpy(gx, gm->chunk[0].g, (size_t)(NN_GC_BATCH * nin) * sizeof(float));
    for (int64_t e = 0; nn_gradcheck_skew_ != 0.f && e < gm->n_params + (xf ? NN_GC_BATCH * nin : 0); e++)
        ana[e] *= 1.f + nn_gradcheck_skew_;
    if (xf && (rc = gc_tensor(&g, xf, gx, NN_GC_BATCH * nin, (double)nout, &r, st, err))) goto done;
    for (int t = 0; t < gm->n_ptensors; t++) {
        const loom_param_info *p = &gm->pinfo[t];
        if (p->offset == gl->mm_off || p->offset == gl->mv_off || nn_plugin_state_(gl, p->offset, NULL))
            continue; /* not trained */
        if ((rc = gc_tensor(&g, gm->params + p->offset, ana + p->offset, loom_shape_numel(&p->shape), (double)nout, &r,
                            st, err)))
            goto done;
    }
done:
    loom_free(tf);
    loom_free(xd);
    loom_free(ana);
    loom_model_free(gm);
    return rc;
}

/* A plugin layer of several inputs: loom_layer_plugin_check on a build of its own (batch 3, every input and
 * trained value by central differences, the bits on chunks of one example); its row. */
static int gc_plugin_row(const loom_model *m, const nn_layer_ *l, FILE *f, int *failed, loom_err *err)
{
    char nm[112];
    double e = 0;
    loom_err pe = {0};
    int rc = nn_plugin_check_(m, l, &e, &pe);
    snprintf(nm, sizeof nm, "%s (%s)", l->spec.name, l->spec.plugin);
    if (rc && rc != LOOM_ENUMERIC) return *err = pe, rc;
    *failed += rc != 0;
    fprintf(f, "%-48s %8s %12s %12.3g  %s (%d inputs: the plugin check, every element)\n", nm, "all", "-", e,
            rc ? "FAIL" : "pass", l->n_src);
    if (rc) fprintf(f, "  %s\n", pe.msg);
    return LOOM_OK;
}

int loom_model_gradcheck(const loom_model *m, FILE *f, int *failed, loom_err *err)
{
    *failed = 0;
    fprintf(f, "gradcheck: each layer alone, batch %d, central differences (h = %g, h/2, h/4), up to %d elements "
               "per tensor (smaller steps at kinks, a miss re-tested one-sided); errors of the gradient of the summed squared error\n", NN_GC_BATCH, NN_GC_H, NN_GC_SAMPLES);
    fprintf(f, "%-48s %8s %12s %12s  %s\n", "Layer (type)", "checked", "max abs err", "max rel err", "result");
    for (int i = 0; i < m->n_layers; i++) {
        const nn_layer_ *l = &m->layer[i];
        gc_stats st = {0};
        if (l->n_src > 1 && l->spec.kind == LOOM_LAYER_PLUGIN) { /* its own build, every input and value */
            if (gc_plugin_row(m, l, f, failed, err)) return loom_err_prefix(err, "gradcheck of layer \"%s\"",
                                                                            l->spec.name), err->code;
            continue;
        }
        if (l->n_src > 1) { /* alone it would need several model inputs; tests/unit check the merges' gradients */
            char nm[112];
            snprintf(nm, sizeof nm, "%s (%s)", l->spec.name, nn_layer_kind_name_(l->spec.kind));
            fprintf(f, "%-48s %8s %12s %12s  %s\n", nm, "-", "-", "-", "skipped (a merge of several inputs)");
            continue;
        }
        if (l->spec.state_of) { /* a copy of its recurrent layer's final state, checked with that layer */
            char nm[112], why[LOOM_NAME_MAX + 40];
            snprintf(nm, sizeof nm, "%s (%s)", l->spec.name, nn_layer_kind_name_(l->spec.kind));
            snprintf(why, sizeof why, "checked with \"%s\" (its state)", l->spec.inputs[0]);
            fprintf(f, "%-48s %8s %12s %12s  %s\n", nm, "-", "-", "-", why);
            continue;
        }
        int rc = gc_layer(m, i, &st, err);
        if (rc) return loom_err_prefix(err, "gradcheck of layer \"%s\"", l->spec.name), rc;
        char nm[112];
        snprintf(nm, sizeof nm, "%s (%s)", l->spec.name,
                 l->spec.kind == LOOM_LAYER_PLUGIN ? l->spec.plugin : nn_layer_kind_name_(l->spec.kind));
        bool ok = st.bad == 0;
        *failed += !ok;
        fprintf(f, "%-48s %8d %12.3g %12.3g  %s", nm, st.checked, st.max_abs, st.max_rel, ok ? "pass" : "FAIL");
        if (st.skipped) fprintf(f, " (%d at kinks skipped)", st.skipped);
        if (st.retested) fprintf(f, " (%d re-tested one-sided at a kink: pass)", st.retested);
        if (!ok) fprintf(f, " (%d of %d elements off)", st.bad, st.checked);
        fputc('\n', f);
    }
    fprintf(f, "gradcheck: %s\n", *failed ? "FAILED" : "every layer passes");
    return LOOM_OK;
}
