/* nn_fixtures.h - what the nn unit tests share (test_nn.c, test_nn_conv.c,
 * test_nn_optim.c, test_nn_graph.c): layer specs (spec_fixtures.h), a model fixture on random
 * data, a gradient check against central differences, and the comparison
 * of a step on 1, 2 and 3 intra-op threads. Included by one test file per
 * executable; all static. */
#ifndef LOOM_NN_FIXTURES_H
#define LOOM_NN_FIXTURES_H

#include "harness.h"
#include "nn/nn.h"
#include "spec_fixtures.h" /* L_dense, L_conv, L_pool, L_kind, L_emb, mk */
#include "nn/nn_internal.h" /* white box: the dropout masks across thread counts */

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static loom_err err __attribute__((unused));

/* ---- helpers ---------------------------------------------------------------- */

static inline loom_shape shp(int rank, int64_t a, int64_t b, int64_t c)
{
    int64_t d[3] = {a, b, c};
    return loom_shape_make(rank, d);
}

static inline loom_shape batch_shape(int64_t B, const loom_shape *s)
{
    loom_shape r = {.rank = s->rank + 1};
    r.dim[0] = B;
    for (int i = 0; i < s->rank; i++) r.dim[i + 1] = s->dim[i];
    return r;
}

static inline void fill_normal(float *p, int64_t n, loom_rng *r, float sd)
{
    for (int64_t i = 0; i < n; i++) p[i] = loom_rng_normal(r) * sd;
}

/* A model plus a batch (x, label) ready to step. */
typedef struct fixture {
    loom_model *m;
    loom_tensor x, y;
    loom_shape  out;
    int64_t     B;
} fixture;

static inline int fixture_new(fixture *f, const loom_model_spec *spec, loom_shape in, loom_dtype label_dtype, int64_t B,
                       uint64_t seed)
{
    memset(f, 0, sizeof *f);
    loom_shape lab = shp(0, 0, 0, 0);
    /* MSE labels take the output's shape: build once to learn it */
    if (spec->loss == LOOM_LOSS_MSE) {
        loom_model *probe = NULL;
        loom_shape guess = shp(1, 1, 0, 0);
        if (loom_model_new(&probe, spec, &in, LOOM_F32, &guess, LOOM_F32, B, &err) == LOOM_OK) {
            lab = loom_model_output_shape(probe);
        } else {
            char *p = strstr(err.msg, "model output ");
            LOOM_ASSERT(p);
            /* parse "(a, b, c)" */
            lab.rank = 0;
            for (char *q = strchr(p, '(') + 1; *q && *q != ')';) {
                lab.dim[lab.rank++] = strtoll(q, &q, 10);
                while (*q == ',' || *q == ' ') q++;
            }
        }
        loom_model_free(probe);
        label_dtype = LOOM_F32;
    }
    int rc = loom_model_new(&f->m, spec, &in, LOOM_F32, &lab, label_dtype, B, &err);
    if (rc) {
        printf("# model_new: %s: %s\n", err.where, err.msg);
        return rc;
    }
    f->B = B;
    f->out = loom_model_output_shape(f->m);
    loom_model_init_params(f->m, seed);
    loom_rng r;
    loom_rng_init(&r, seed, 99, 0, 0);
    /* non-zero biases, so their gradients matter */
    for (int i = 0; i < loom_model_num_param_tensors(f->m); i++) {
        const loom_param_info *p = loom_model_param_tensor(f->m, i);
        if (strstr(p->name, "/bias")) fill_normal(loom_model_params(f->m) + p->offset, loom_shape_numel(&p->shape), &r, 0.1f);
    }
    loom_shape xs = batch_shape(B, &in), ys = batch_shape(B, &lab);
    loom_tensor_init(&f->x, LOOM_F32, &xs, &err);
    loom_tensor_init(&f->y, label_dtype, &ys, &err);
    fill_normal(f->x.data, loom_shape_numel(&xs), &r, 1.f);
    int64_t classes = f->out.rank == 1 ? f->out.dim[0] : 1;
    for (int64_t b = 0; b < loom_shape_numel(&ys); b++) {
        double v = spec->loss == LOOM_LOSS_MSE ? loom_rng_normal(&r) : (double)loom_rng_below(&r, (uint64_t)classes);
        switch (label_dtype) {
        case LOOM_U8: ((uint8_t *)f->y.data)[b] = (uint8_t)v; break;
        case LOOM_I32: ((int32_t *)f->y.data)[b] = (int32_t)v; break;
        case LOOM_I64: ((int64_t *)f->y.data)[b] = (int64_t)v; break;
        case LOOM_F32: ((float *)f->y.data)[b] = (float)v; break;
        case LOOM_F64: ((double *)f->y.data)[b] = v; break;
        default: break;
        }
    }
    return LOOM_OK;
}

static inline void fixture_free(fixture *f)
{
    loom_model_free(f->m);
    loom_tensor_fini(&f->x);
    loom_tensor_fini(&f->y);
}

static inline double step_loss(fixture *f, uint64_t key)
{
    double loss = 0;
    int64_t correct;
    int rc = loom_model_train_step(f->m, &f->x, &f->y, f->B, key, &loss, &correct, &err);
    LOOM_ASSERT(rc == LOOM_OK);
    return loss;
}

typedef struct gc_ctx {
    fixture *f;
    uint64_t key;
} gc_ctx;
static inline double gc_loss(void *ctx) { return step_loss(((gc_ctx *)ctx)->f, ((gc_ctx *)ctx)->key); }

/* Compares the analytic gradient of the mean loss with central differences
 * on (up to 300 of) the parameters. The first layer of every case has
 * parameters, so these also test each later layer's input gradient. */
static inline void gradcheck(const char *what, const loom_layer_spec *layers, int n, loom_loss_kind loss, loom_shape in,
                      loom_dtype label_dtype, int64_t B, uint64_t key)
{
    fixture f;
    if (fixture_new(&f, mk(loss, n, layers), in, label_dtype, B, 11) != LOOM_OK) {
        CHECK_MSG(0, "%s: cannot build", what);
        return;
    }
    int64_t P = loom_model_num_params(f.m);
    float *p = loom_model_params(f.m);
    float *ga = malloc((size_t)P * sizeof *ga);
    step_loss(&f, key);
    memcpy(ga, loom_model_grads(f.m), (size_t)P * sizeof *ga);
    gc_ctx c = {&f, key};
    harness_gradcheck g = harness_gradcheck_run(what, p, ga, P, P > 300 ? P / 300 + 1 : 1, 1e-2f, (double)B, gc_loss, &c,
                                                NULL, 1);
    CHECK_MSG(g.kinks * 5 <= g.tested, "%s: too many kinks (%lld)", what, g.kinks);
    CHECK_MSG(g.bad == 0, "%s: %lld of %lld gradients off", what, g.bad, g.tested);
    free(ga);
    fixture_free(&f);
}


static inline loom_optimizer_spec opt_spec(loom_opt_kind k)
{
    loom_optimizer_spec s = {0};
    s.kind = k;
    s.learning_rate = 0.1;
    s.momentum = 0.9;
    s.beta1 = 0.9;
    s.beta2 = 0.999;
    s.epsilon = 1e-7;
    s.schedule.kind = LOOM_SCHED_CONSTANT;
    return s;
}

/* ---- intra-op threads ------------------------------------------------------------ */

/* What one step leaves behind: loss, correct count, gradients; evaluate's
 * loss and count; predict's outputs; the dropout masks. */
typedef struct step_out {
    double   loss, eval_loss;
    int64_t  correct, eval_correct;
    float   *grads, *pred;
    uint8_t *masks;
    int64_t  n_mask;
} step_out;

/* Runs one train step, evaluate and predict on the first B examples of f with
 * `threads` threads. */
static inline void run_threads(fixture *f, int threads, int64_t B, uint64_t key, step_out *o)
{
    memset(o, 0, sizeof *o);
    CHECK(loom_model_set_threads(f->m, threads, &err) == LOOM_OK);
    loom_tensor x = f->x, y = f->y;
    x.shape.dim[0] = y.shape.dim[0] = B;
    x.owns = y.owns = 0;
    int64_t P = loom_model_num_params(f->m), n_out = loom_shape_numel(&f->out);
    CHECK(loom_model_train_step(f->m, &x, &y, 2 * B, key, &o->loss, &o->correct, &err) == LOOM_OK);
    o->grads = malloc((size_t)P * sizeof *o->grads);
    memcpy(o->grads, loom_model_grads(f->m), (size_t)P * sizeof *o->grads);
    for (int i = 0; i < f->m->n_layers; i++) o->n_mask += f->m->layer[i].mask ? B * f->m->layer[i].n_out : 0;
    o->masks = malloc((size_t)o->n_mask + 1);
    for (int i = 0, k = 0; i < f->m->n_layers; i++)
        if (f->m->layer[i].mask) {
            memcpy(o->masks + k, f->m->layer[i].mask, (size_t)(B * f->m->layer[i].n_out));
            k += (int)(B * f->m->layer[i].n_out);
        }
    CHECK(loom_model_evaluate(f->m, &x, &y, &o->eval_loss, &o->eval_correct, &err) == LOOM_OK);
    o->pred = malloc((size_t)(B * n_out) * sizeof *o->pred);
    CHECK(loom_model_predict(f->m, &x, o->pred, &err) == LOOM_OK);
}

static inline void step_out_free(step_out *o)
{
    free(o->grads);
    free(o->pred);
    free(o->masks);
}

/* Threads split the batch into row blocks, and BLAS computes a block's rows
 * with kernels picked by the block's row count (OpenBLAS edge and
 * small-matrix kernels), so a dot product of K terms may be summed in another
 * order: within gamma_K * sum|terms| of each other, and the terms' size is
 * that of the vector's largest elements, not of the element (a gradient near
 * zero is a cancellation of large terms). Measured over the OpenBLAS cores
 * Haswell, Zen, SkylakeX, Sandybridge, Nehalem and Prescott: at most 3.5e-7
 * of the vector's largest magnitude (element-relative up to 3e-4). The bound
 * 1e-5 of the largest magnitude (K * eps for K ~ 170) keeps a margin of 30
 * and still fails any chunking bug, whose errors are of the order of the
 * values. Parameter gradients are not summed across chunks at all (dense and
 * conv kernel gradients are whole-batch products), so the only source is the
 * per-row-count BLAS kernel. */
static double worst_scaled __attribute__((unused));
static inline int close_vec(const char *what, const float *a, const float *b, int64_t n)
{
    double scale = 0;
    for (int64_t k = 0; k < n; k++) scale = fmax(scale, fabs(a[k]));
    int64_t bad = 0;
    for (int64_t k = 0; k < n; k++) {
        double d = fabs((double)a[k] - b[k]);
        worst_scaled = fmax(worst_scaled, d / scale);
        if (d > 1e-5 * scale) {
            if (bad < 3) printf("#   %s[%lld]: %.9g vs %.9g\n", what, (long long)k, a[k], b[k]);
            bad++;
        }
    }
    return bad == 0 && scale > 0;
}

static inline void check_threads(const char *what, const loom_layer_spec *ls, int n, loom_loss_kind loss, loom_shape in,
                          int64_t max_batch)
{
    fixture f;
    if (fixture_new(&f, mk(loss, n, ls), in, LOOM_I32, max_batch, 5) != LOOM_OK) {
        CHECK_MSG(0, "%s: cannot build", what);
        return;
    }
    int64_t P = loom_model_num_params(f.m), n_out = loom_shape_numel(&f.out);
    const int64_t batches[] = {max_batch, max_batch - 1, 2, 1};
    for (size_t bi = 0; bi < sizeof batches / sizeof batches[0]; bi++) {
        int64_t B = batches[bi];
        step_out one, o, again;
        run_threads(&f, 1, B, 77, &one);
        for (int t = 2; t <= 3; t++) {
            run_threads(&f, t, B, 77, &o);
            CHECK(loom_model_threads(f.m) == t);
            CHECK_MSG(fabs(o.loss - one.loss) <= 1e-5 * fabs(one.loss), "%s B=%lld threads %d: loss %.9g vs %.9g", what,
                      (long long)B, t, o.loss, one.loss);
            CHECK_MSG(o.correct == one.correct, "%s B=%lld threads %d: correct %lld vs %lld", what, (long long)B, t,
                      (long long)o.correct, (long long)one.correct);
            CHECK_MSG(close_vec("grads", one.grads, o.grads, P), "%s B=%lld threads %d: gradients differ", what,
                      (long long)B, t);
            CHECK_MSG(o.n_mask == one.n_mask && !memcmp(o.masks, one.masks, (size_t)o.n_mask),
                      "%s B=%lld threads %d: dropout masks differ", what, (long long)B, t);
            CHECK(fabs(o.eval_loss - one.eval_loss) <= 1e-5 * fabs(one.eval_loss));
            CHECK(o.eval_correct == one.eval_correct);
            CHECK_MSG(close_vec("predict", one.pred, o.pred, B * n_out), "%s B=%lld threads %d: predictions differ",
                      what, (long long)B, t);
            /* the same thread count again: bit for bit */
            run_threads(&f, t, B, 77, &again);
            CHECK_MSG(again.loss == o.loss && again.correct == o.correct &&
                          !memcmp(again.grads, o.grads, (size_t)P * sizeof(float)) &&
                          !memcmp(again.pred, o.pred, (size_t)(B * n_out) * sizeof(float)),
                      "%s B=%lld threads %d: two runs differ", what, (long long)B, t);
            step_out_free(&again);
            step_out_free(&o);
        }
        step_out_free(&one);
    }
    printf("# %s: threads 2 and 3 match 1 thread for batches of %lld, %lld, 2 and 1 (worst difference %.2g of the "
           "largest magnitude)\n", what, (long long)max_batch, (long long)max_batch - 1, worst_scaled);
    worst_scaled = 0;
    fixture_free(&f);
}


/* The tests' main: BLAS on one thread, then the table. `OPENBLAS_CORETYPE=X
 * test_nn` checks the thread-count tolerance on OpenBLAS core X (loom itself
 * ignores the variable). */
static inline int nn_test_main(const loom_test *tests)
{
    loom_blas_want_core(getenv("OPENBLAS_CORETYPE"));
    if (loom_blas_init(1, &err) != LOOM_OK) {
        printf("Bail out! %s: %s\n", err.where, err.msg);
        return 1;
    }
    return loom_test_run(tests);
}

#endif
