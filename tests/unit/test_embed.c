/* test_embed.c - embedding layers and sparse updates: the lookup (sum, mean,
 * -1 padding) against a hand computation, the backward against central
 * finite differences, the sparse gradient against the dense one, the same
 * bits for any number of threads, bad ids; sparse SGD and Adagrad against
 * their dense updates bit for bit, lazy Adam and momentum against their
 * documented semantics, Adagrad against Keras' formula; the synthetic ctr
 * source (reproducible by seed, labels drawn from its known model). */
#include "harness.h"
#include "data/data.h"
#include "nn/nn.h"
#include "spec_fixtures.h"

#include <stdint.h>

static loom_err err;

/* ---- helpers ---------------------------------------------------------------- */

/* test.cfg's model over the input "ids", MSE. */
static const loom_model_spec *mk_ids(int n, const loom_layer_spec *layers)
{
    loom_model_spec *s = mk(LOOM_LOSS_MSE, n, layers);
    snprintf(s->input, sizeof s->input, "ids");
    return s;
}

/* embedding (rows, 4) over ids (3, 2) -> flatten -> dense 5 tanh -> dense 2, MSE. */
typedef struct fixture {
    loom_model *m;
    loom_tensor x, y;
    int64_t     B;
} fixture;

static int fixture_new(fixture *f, int64_t rows, loom_combiner comb, int64_t B, loom_dtype id_dtype, uint64_t seed)
{
    memset(f, 0, sizeof *f);
    loom_layer_spec ls[4] = {L_emb(rows, 4, comb), L_flat(), L_dense(5, LOOM_ACT_TANH), L_dense(2, LOOM_ACT_NONE)};
    loom_shape in = {.rank = 2, .dim = {3, 2}}, lab = {.rank = 1, .dim = {2}};
    int rc = loom_model_new(&f->m, mk_ids(4, ls), &in, id_dtype, &lab, LOOM_F32, B, &err);
    if (rc) {
        printf("# model_new: %s: %s\n", err.where, err.msg);
        return rc;
    }
    f->B = B;
    loom_model_init_params(f->m, seed);
    loom_shape xs = {.rank = 3, .dim = {B, 3, 2}}, ys = {.rank = 2, .dim = {B, 2}};
    loom_tensor_init(&f->x, id_dtype, &xs, &err);
    loom_tensor_init(&f->y, LOOM_F32, &ys, &err);
    loom_rng r;
    loom_rng_init(&r, seed, 7, 0, 0);
    for (int64_t e = 0; e < B * 6; e++) {
        /* few distinct ids, so rows repeat within the batch; some padding */
        int64_t id = (int64_t)loom_rng_below(&r, (uint64_t)(rows < 12 ? rows : 12));
        if (e % 7 == 3) id = -1;
        if (id_dtype == LOOM_I32) ((int32_t *)f->x.data)[e] = (int32_t)id;
        else ((int64_t *)f->x.data)[e] = id;
    }
    for (int64_t e = 0; e < B * 2; e++) ((float *)f->y.data)[e] = loom_rng_normal(&r);
    return LOOM_OK;
}

static void fixture_free(fixture *f)
{
    loom_model_free(f->m);
    loom_tensor_fini(&f->x);
    loom_tensor_fini(&f->y);
}

static double step(fixture *f)
{
    double loss = 0;
    int64_t correct;
    int rc = loom_model_train_step(f->m, &f->x, &f->y, f->B, 1, &loss, &correct, &err);
    if (rc) printf("# step: %s: %s\n", err.where, err.msg);
    LOOM_ASSERT(rc == LOOM_OK);
    return loss;
}

/* The gradient check's loss and the rows it leaves out: a row no id looked
 * up must have a zero gradient, and moving it changes nothing. */
typedef struct gc_ctx {
    fixture     *f;
    const float *ga;
    int          touched[40];
} gc_ctx;
static double gc_loss(void *ctx) { return step(((gc_ctx *)ctx)->f); }
static int gc_skip(long long k, void *ctx)
{
    gc_ctx *c = ctx;
    if (k >= 160 || c->touched[k / 4]) return 0;
    CHECK_MSG(c->ga[k] == 0.f, "untouched row %lld has gradient %g", k / 4, c->ga[k]);
    return 1;
}

static int64_t id_at(const fixture *f, int64_t e)
{
    return f->x.dtype == LOOM_I32 ? ((const int32_t *)f->x.data)[e] : ((const int64_t *)f->x.data)[e];
}

/* ---- the lookup ---------------------------------------------------------------- */

/* Outputs of embedding + flatten (no dense) against the table rows by hand. */
static void test_forward(void)
{
    for (int comb = 0; comb < 2; comb++) {
        loom_layer_spec ls[2] = {L_emb(10, 3, (loom_combiner)comb), L_flat()};
        loom_model *m = NULL;
        loom_shape in = {.rank = 2, .dim = {2, 3}}, lab = {.rank = 1, .dim = {6}};
        CHECK(loom_model_new(&m, mk_ids(2, ls), &in, LOOM_I64, &lab, LOOM_F32, 2, &err) == LOOM_OK);
        if (!m) return;
        loom_model_init_params(m, 3);
        const float *T = loom_model_params(m);
        int64_t ids[12] = {1, 2, 2, /**/ 9, -1, -1, /**/ -1, -1, -1, /**/ 0, 0, 5};
        loom_tensor x = {.dtype = LOOM_I64, .shape = {.rank = 3, .dim = {2, 2, 3}}, .data = ids};
        float out[12];
        CHECK(loom_model_predict(m, &x, out, &err) == LOOM_OK);
        for (int r = 0; r < 4; r++)
            for (int j = 0; j < 3; j++) {
                double s = 0;
                int n = 0;
                for (int k = 0; k < 3; k++)
                    if (ids[r * 3 + k] >= 0) s += T[ids[r * 3 + k] * 3 + j], n++;
                if (comb == LOOM_COMBINER_MEAN && n) s /= n;
                CHECK_NEAR(out[r * 3 + j], s, 1e-6);
            }
        loom_shape os = loom_model_output_shape(m);
        CHECK(os.rank == 1 && os.dim[0] == 6);
        loom_model_free(m);
    }
    /* the table is a named parameter tensor, initialised uniform in [-0.05, 0.05) */
    loom_layer_spec ls[1] = {L_emb(1000, 8, LOOM_COMBINER_SUM)};
    loom_model *m = NULL;
    loom_shape in = {.rank = 0}, lab = {.rank = 1, .dim = {8}};
    CHECK(loom_model_new(&m, mk_ids(1, ls), &in, LOOM_I32, &lab, LOOM_F32, 4, &err) == LOOM_OK);
    if (!m) return;
    loom_model_init_params(m, 5);
    const loom_param_info *pi = loom_model_param_tensor(m, 0);
    CHECK(!strcmp(pi->name, "emb/embeddings") && pi->shape.rank == 2 && pi->shape.dim[0] == 1000 && pi->shape.dim[1] == 8);
    double mx = 0, mean = 0;
    for (int64_t i = 0; i < 8000; i++) mx = fmax(mx, fabs(loom_model_params(m)[i])), mean += loom_model_params(m)[i];
    CHECK(mx <= 0.05 && mx > 0.045);
    CHECK(fabs(mean / 8000) < 0.003);
    CHECK(loom_model_output_shape(m).rank == 1 && loom_model_output_shape(m).dim[0] == 8);
    loom_model_free(m);
}

/* ---- the backward ------------------------------------------------------------- */

/* Every parameter (the touched table rows and the dense layers) against
 * central differences of the loss; untouched rows have a zero gradient. */
static void test_gradcheck(void)
{
    for (int comb = 0; comb < 2; comb++) {
        fixture f;
        if (fixture_new(&f, 40, (loom_combiner)comb, 6, comb ? LOOM_I32 : LOOM_I64, 11)) {
            CHECK(0);
            return;
        }
        int64_t P = loom_model_num_params(f.m);
        float *p = loom_model_params(f.m), *ga = malloc((size_t)P * sizeof *ga);
        step(&f);
        memcpy(ga, loom_model_grads(f.m), (size_t)P * sizeof *ga);
        gc_ctx c = {&f, ga, {0}};
        for (int64_t e = 0; e < f.B * 6; e++)
            if (id_at(&f, e) >= 0) c.touched[id_at(&f, e)] = 1;
        harness_gradcheck g = harness_gradcheck_run(comb ? "combiner mean" : "combiner sum", p, ga, P, 1, 1e-2f,
                                                    (double)f.B, gc_loss, &c, gc_skip, 0);
        CHECK(g.tested > 60);
        CHECK_MSG(g.bad == 0, "%lld of %lld gradients off", g.bad, g.tested);
        free(ga);
        fixture_free(&f);
    }
}

/* The sparse gradient names each touched row once with the dense buffer's
 * row; a second batch's rows replace the first's in the dense buffer, with
 * the model as sparse owner (clearing only its rows) and without. */
static void test_sparse_grad(void)
{
    for (int owner = 0; owner < 2; owner++) {
        fixture f;
        if (fixture_new(&f, 40, LOOM_COMBINER_SUM, 5, LOOM_I64, 13)) {
            CHECK(0);
            return;
        }
        loom_model_set_sparse_owner(f.m, owner);
        CHECK(loom_model_num_sparse(f.m) == 1);
        for (int round = 0; round < 2; round++) {
            if (round) /* other ids: rows 20..39 */
                for (int64_t e = 0; e < f.B * 6; e++)
                    if (id_at(&f, e) >= 0) ((int64_t *)f.x.data)[e] = 20 + (e * 7) % 20;
            step(&f);
            loom_sparse_grad sg;
            loom_model_sparse_grad(f.m, 0, &sg);
            CHECK(sg.param == 0 && sg.offset == 0 && sg.rows == 40 && sg.dim == 4);
            int seen[40] = {0}, used[40] = {0};
            for (int64_t e = 0; e < f.B * 6; e++)
                if (id_at(&f, e) >= 0) used[id_at(&f, e)] = 1;
            int nused = 0;
            for (int r = 0; r < 40; r++) nused += used[r];
            CHECK(sg.n == nused);
            const float *G = loom_model_grads(f.m);
            for (int64_t u = 0; u < sg.n; u++) {
                CHECK(sg.ids[u] >= 0 && sg.ids[u] < 40 && used[sg.ids[u]] && !seen[sg.ids[u]]);
                seen[sg.ids[u]] = 1;
                CHECK(!memcmp(sg.values + u * 4, G + sg.ids[u] * 4, 4 * sizeof(float)));
            }
            for (int r = 0; r < 40; r++)
                if (!used[r])
                    for (int j = 0; j < 4; j++) CHECK_MSG(G[r * 4 + j] == 0.f, "round %d: row %d left %g", round, r, G[r * 4 + j]);
        }
        fixture_free(&f);
    }
}

/* Gradients (dense buffer and sparse rows) are the same bits with 1 and 3 threads. */
static void test_threads(void)
{
    float *g1 = NULL;
    int64_t P = 0, n1 = 0;
    int64_t ids1[64];
    for (int t = 1; t <= 3; t += 2) {
        fixture f;
        if (fixture_new(&f, 40, LOOM_COMBINER_MEAN, 9, LOOM_I64, 17)) {
            CHECK(0);
            return;
        }
        CHECK(loom_model_set_threads(f.m, t, &err) == LOOM_OK);
        step(&f);
        step(&f);
        loom_sparse_grad sg;
        loom_model_sparse_grad(f.m, 0, &sg);
        P = loom_model_num_params(f.m);
        if (t == 1) {
            g1 = malloc((size_t)P * sizeof *g1);
            memcpy(g1, loom_model_grads(f.m), (size_t)P * sizeof *g1);
            n1 = sg.n;
            memcpy(ids1, sg.ids, (size_t)sg.n * sizeof *ids1);
        } else {
            CHECK(!memcmp(g1, loom_model_grads(f.m), (size_t)P * sizeof *g1));
            CHECK(sg.n == n1 && !memcmp(ids1, sg.ids, (size_t)n1 * sizeof *ids1));
        }
        fixture_free(&f);
    }
    free(g1);
}

/* `loom profile --train` on an embedding model: forward, loss and backward
 * in parts with a profile attached give the dense and sparse gradients of an
 * unprofiled train_step bit for bit (1 and 3 threads); the table has a
 * forward and a weights time, flatten no weights time. */
static void test_profiled(void)
{
    for (int t = 1; t <= 3; t += 2) {
        fixture a, b;
        if (fixture_new(&a, 40, LOOM_COMBINER_SUM, 9, LOOM_I32, 23) ||
            fixture_new(&b, 40, LOOM_COMBINER_SUM, 9, LOOM_I32, 23)) {
            CHECK(0);
            return;
        }
        CHECK(loom_model_set_threads(a.m, t, &err) == LOOM_OK);
        CHECK(loom_model_set_threads(b.m, t, &err) == LOOM_OK);
        step(&a);
        loom_model_prof prof = {0};
        double lb;
        int64_t cb;
        loom_model_set_prof(b.m, &prof);
        CHECK(loom_model_forward(b.m, &b.x, 1, &err) == LOOM_OK);
        CHECK(loom_model_loss(b.m, &b.y, b.B, &lb, &cb, &err) == LOOM_OK);
        CHECK(loom_model_backward(b.m, &err) == LOOM_OK);
        loom_model_set_prof(b.m, NULL);
        int64_t P = loom_model_num_params(a.m);
        CHECK(!memcmp(loom_model_grads(a.m), loom_model_grads(b.m), (size_t)P * sizeof(float)));
        loom_sparse_grad sa, sb;
        loom_model_sparse_grad(a.m, 0, &sa);
        loom_model_sparse_grad(b.m, 0, &sb);
        CHECK(sa.n == sb.n && !memcmp(sa.ids, sb.ids, (size_t)sa.n * sizeof *sa.ids) &&
              !memcmp(sa.values, sb.values, (size_t)sa.n * sa.dim * sizeof *sa.values));
        CHECK(prof.fwd[0] > 0 && prof.pgrad[0] > 0 && prof.pgrad[1] == 0 && prof.pgrad[2] > 0);
        fixture_free(&a);
        fixture_free(&b);
    }
}

/* An id outside the table fails the step naming layer, example, column and
 * id; ids of a float input and an embedding not first are refused at build. */
static void test_bad_ids(void)
{
    fixture f;
    if (fixture_new(&f, 40, LOOM_COMBINER_SUM, 4, LOOM_I64, 19)) {
        CHECK(0);
        return;
    }
    ((int64_t *)f.x.data)[2 * 6 + 1 * 2 + 1] = 40; /* example 2, column 1 */
    double loss;
    int64_t correct;
    CHECK(loom_model_train_step(f.m, &f.x, &f.y, 4, 1, &loss, &correct, &err) == LOOM_EDATA);
    CHECK_CONTAINS(err.where, "test.cfg:10");
    CHECK_CONTAINS(err.msg, "example 2 of the batch, column 1: id 40 is outside [0, 40)");
    ((int64_t *)f.x.data)[13] = -2;
    CHECK(loom_model_evaluate(f.m, &f.x, &f.y, &loss, &correct, &err) == LOOM_EDATA);
    CHECK_CONTAINS(err.msg, "id -2");
    fixture_free(&f);

    loom_model *m = NULL;
    loom_layer_spec ls[2] = {L_emb(10, 3, LOOM_COMBINER_SUM), L_flat()};
    loom_shape in = {.rank = 1, .dim = {2}}, lab = {.rank = 1, .dim = {6}};
    CHECK(loom_model_new(&m, mk_ids(2, ls), &in, LOOM_F32, &lab, LOOM_F32, 2, &err) == LOOM_ESHAPE);
    CHECK_CONTAINS(err.msg, "needs int32 or int64 ids");
    loom_layer_spec ls2[2] = {L_flat(), L_emb(10, 3, LOOM_COMBINER_SUM)};
    CHECK(loom_model_new(&m, mk_ids(2, ls2), &in, LOOM_I64, &lab, LOOM_F32, 2, &err) != LOOM_OK);
    CHECK(m == NULL);
}

/* ---- sparse updates ------------------------------------------------------------ */

static loom_optimizer_spec opt_spec(loom_opt_kind k)
{
    loom_optimizer_spec s = {0};
    s.kind = k;
    s.learning_rate = 0.05;
    s.momentum = 0.9;
    s.beta1 = 0.9;
    s.beta2 = 0.999;
    s.epsilon = 1e-7;
    s.initial_accumulator = 0.1;
    s.schedule.kind = LOOM_SCHED_CONSTANT;
    return s;
}

/* Three steps of a model on changing ids, updated by a sparse optimizer
 * (rows from the backward, or scanned) and by a dense one on a copy of the
 * parameters: SGD and Adagrad give the same bits, tables and slots. */
static void test_sparse_equals_dense(void)
{
    const loom_opt_kind kinds[] = {LOOM_OPT_SGD, LOOM_OPT_ADAGRAD};
    for (int k = 0; k < 2; k++)
        for (int use_rows = 0; use_rows < 2; use_rows++) {
            fixture f;
            if (fixture_new(&f, 300, LOOM_COMBINER_MEAN, 8, LOOM_I64, 23)) {
                CHECK(0);
                return;
            }
            loom_model_set_sparse_owner(f.m, use_rows);
            int64_t P = loom_model_num_params(f.m);
            loom_optimizer_spec s = opt_spec(kinds[k]);
            loom_optimizer *sp = NULL, *dn = NULL;
            CHECK(loom_optimizer_new(&sp, &s, P, &err) == LOOM_OK && loom_optimizer_new(&dn, &s, P, &err) == LOOM_OK);
            loom_optimizer_set_tables(sp, f.m, use_rows);
            float *pd = malloc((size_t)P * sizeof *pd);
            memcpy(pd, loom_model_params(f.m), (size_t)P * sizeof *pd);
            for (int t = 0; t < 3; t++) {
                for (int64_t e = 0; e < f.B * 6; e++)
                    if (id_at(&f, e) >= 0) ((int64_t *)f.x.data)[e] = (e * 13 + t * 101) % 300;
                step(&f);
                loom_optimizer_apply(sp, loom_model_params(f.m), loom_model_grads(f.m), t);
                loom_optimizer_apply(dn, pd, loom_model_grads(f.m), t);
                /* the dense copy must see the same model next step */
                CHECK_MSG(!memcmp(pd, loom_model_params(f.m), (size_t)P * sizeof *pd), "%s, rows %d: step %d differs",
                          k ? "adagrad" : "sgd", use_rows, t);
                memcpy(loom_model_params(f.m), pd, (size_t)P * sizeof *pd);
            }
            CHECK(loom_optimizer_num_slots(sp) == k);
            if (k) CHECK(!memcmp(loom_optimizer_slots(sp), loom_optimizer_slots(dn), (size_t)P * sizeof(float)));
            free(pd);
            loom_optimizer_free(sp);
            loom_optimizer_free(dn);
            fixture_free(&f);
        }
}

/* Lazy Adam and momentum on a table of 4 rows x 2: step 0 touches rows 0
 * and 1, step 1 only row 1. Row 0 keeps its weights and slots at step 1
 * (a dense Adam would move it on its decaying moment), row 1 follows the
 * formula, rows 2 and 3 never move; apply_rows with pushed values does the
 * same as the model's path. */
static void test_lazy(void)
{
    const loom_opt_kind kinds[] = {LOOM_OPT_ADAM, LOOM_OPT_MOMENTUM};
    for (int k = 0; k < 2; k++) {
        loom_optimizer_spec s = opt_spec(kinds[k]);
        loom_optimizer *o = NULL;
        CHECK(loom_optimizer_new(&o, &s, 8, &err) == LOOM_OK);
        float p[8] = {1, 2, 3, 4, 5, 6, 7, 8}, ref[8];
        memcpy(ref, p, sizeof p);
        const int64_t ids0[2] = {0, 1}, ids1[1] = {1};
        const float v0[4] = {0.5f, -0.25f, 1.0f, 0.125f}, v1[2] = {-0.75f, 0.5f};
        loom_optimizer_apply_rows(o, p, NULL, 0, 0, 2, ids0, 2, v0);
        float after0[8], slots0[16];
        memcpy(after0, p, sizeof p);
        memcpy(slots0, loom_optimizer_slots(o), (size_t)loom_optimizer_num_slots(o) * 8 * sizeof(float));
        loom_optimizer_apply_rows(o, p, NULL, 1, 0, 2, ids1, 1, v1);
        /* row 0 (elements 0, 1): unchanged at step 1, weights and slots */
        CHECK(p[0] == after0[0] && p[1] == after0[1]);
        CHECK(loom_optimizer_slots(o)[0] == slots0[0] && loom_optimizer_slots(o)[1] == slots0[1]);
        /* rows 2, 3: never touched */
        for (int i = 4; i < 8; i++) CHECK(p[i] == ref[i]);
        /* row 1 by hand: two updates */
        for (int j = 0; j < 2; j++) {
            double g0 = v0[2 + j], g1 = v1[j], w = ref[2 + j];
            if (k == 0) {
                double m = 0.1 * g0, v = 0.001 * g0 * g0;
                w -= 0.05 * sqrt(1 - 0.999) / (1 - 0.9) * m / (sqrt(v) + 1e-7);
                m = 0.9 * m + 0.1 * g1;
                v = 0.999 * v + 0.001 * g1 * g1;
                w -= 0.05 * sqrt(1 - 0.999 * 0.999) / (1 - 0.9 * 0.9) * m / (sqrt(v) + 1e-7);
            } else {
                double vel = -0.05 * g0;
                w += vel;
                vel = 0.9 * vel - 0.05 * g1;
                w += vel;
            }
            CHECK_NEAR(p[2 + j], w, 1e-5);
        }
        /* the same through set_tables on a dense gradient buffer holding the rows */
        loom_optimizer *o2 = NULL;
        CHECK(loom_optimizer_new(&o2, &s, 8, &err) == LOOM_OK);
        float p2[8] = {1, 2, 3, 4, 5, 6, 7, 8}, g[8] = {0};
        memcpy(g, v0, sizeof v0);
        loom_optimizer_apply_rows(o2, p2, g, 0, 0, 2, ids0, 2, NULL);
        CHECK(!memcmp(p2, after0, sizeof p2));
        loom_optimizer_free(o);
        loom_optimizer_free(o2);
    }
}

/* AdamW and RMSprop are lazy on tables too: a row not looked up keeps its
 * weights and slots, a looked-up one moves. */
static void test_lazy_more(void)
{
    const loom_opt_kind kinds[] = {LOOM_OPT_ADAMW, LOOM_OPT_RMSPROP, LOOM_OPT_ADAGRAD};
    for (int k = 0; k < 3; k++) {
        loom_optimizer_spec s = opt_spec(kinds[k]);
        s.weight_decay = 0.004;
        s.rho = 0.9;
        loom_optimizer *o = NULL;
        CHECK(loom_optimizer_new(&o, &s, 8, &err) == LOOM_OK);
        float p[8] = {1, 2, 3, 4, 5, 6, 7, 8};
        const int64_t ids0[2] = {0, 1}, ids1[1] = {1};
        const float v0[4] = {0.5f, -0.25f, 1.0f, 0.125f}, v1[2] = {-0.75f, 0.5f};
        loom_optimizer_apply_rows(o, p, NULL, 0, 0, 2, ids0, 2, v0);
        float after0[8], s0[8];
        memcpy(after0, p, sizeof p);
        memcpy(s0, loom_optimizer_slots(o), sizeof s0);
        loom_optimizer_apply_rows(o, p, NULL, 1, 0, 2, ids1, 1, v1);
        CHECK_MSG(p[0] == after0[0] && p[1] == after0[1] && !memcmp(loom_optimizer_slots(o), s0, 2 * sizeof(float)),
                  "optimizer %d: row 0 moved at step 1", (int)kinds[k]);
        CHECK(p[2] != after0[2] && p[3] != after0[3]);
        for (int i = 4; i < 8; i++) CHECK(p[i] == (float)(i + 1));
        loom_optimizer_free(o);
    }
}

/* Dense Adagrad against Keras' ResourceApplyAdagradV2 numbers. */
static void test_adagrad(void)
{
    loom_optimizer_spec s = opt_spec(LOOM_OPT_ADAGRAD);
    s.learning_rate = 0.1;
    loom_optimizer *o = NULL;
    CHECK(loom_optimizer_new(&o, &s, 2, &err) == LOOM_OK);
    CHECK(loom_optimizer_num_slots(o) == 1 && !strcmp(loom_optimizer_slot_name(o, 0), "accumulator"));
    CHECK(loom_optimizer_slots(o)[0] == 0.1f);
    float p[2] = {1.f, -2.f}, g[2] = {0.5f, -1.f};
    loom_optimizer_apply(o, p, g, 0);
    loom_optimizer_apply(o, p, g, 1);
    double a = 0.1, w = 1.0, a2 = 0.1, w2 = -2.0;
    for (int t = 0; t < 2; t++) {
        a += 0.25;
        w -= 0.1 * 0.5 / (sqrt(a) + 1e-7);
        a2 += 1.0;
        w2 -= 0.1 * -1.0 / (sqrt(a2) + 1e-7);
    }
    CHECK_NEAR(p[0], w, 1e-6);
    CHECK_NEAR(p[1], w2, 1e-6);
    CHECK_NEAR(loom_optimizer_slots(o)[1], a2, 1e-6);
    loom_optimizer_free(o);
}

/* ---- the synthetic ctr source --------------------------------------------------- */

static int64_t ctr_offset;

static int open_ctr(loom_iter **it, uint64_t seed, int64_t count, int k)
{
    static loom_dataset_spec ds;
    memset(&ds, 0, sizeof ds);
    ds.present = true;
    ds.source.kind = LOOM_SRC_SYNTHETIC;
    ds.source.synthetic.count = count;
    ds.source.synthetic.ctr = (loom_syn_ctr){.on = true, .columns = 8, .ids_per_column = k, .id_space = 1 << 16,
                                   .vocab = 500, .zipf = 1.1, .weight_std = 0.8, .bias = -1.0,
                                   .offset = ctr_offset};
    loom_data_ctx ctx = {.seed = seed, .name = "train"};
    int rc = loom_data_open(it, &ds, &ctx, &err);
    if (rc) printf("# data_open: %s: %s\n", err.where, err.msg);
    return rc;
}

/* Features and shapes; the same seed gives the same elements, another seed
 * other labels but the same hashed ids for the same values; the click rate
 * matches the true probabilities; ids in range; popular values repeat. */
static void test_ctr_source(void)
{
    loom_iter *a = NULL, *b = NULL, *c = NULL;
    if (open_ctr(&a, 1, 4000, 1) || open_ctr(&b, 1, 4000, 1) || open_ctr(&c, 2, 4000, 3)) {
        CHECK(0);
        goto done;
    }
    const loom_elem_spec *es = loom_iter_spec(a);
    CHECK(es->n == 3 && !strcmp(es->name[0], "ids") && !strcmp(es->name[1], "label") && !strcmp(es->name[2], "prob"));
    CHECK(es->dtype[0] == LOOM_I64 && es->shape[0].rank == 1 && es->shape[0].dim[0] == 8);
    CHECK(es->dtype[1] == LOOM_F32 && es->shape[1].rank == 0);
    const loom_elem_spec *ec = loom_iter_spec(c);
    CHECK(ec->shape[0].rank == 2 && ec->shape[0].dim[0] == 8 && ec->shape[0].dim[1] == 3);
    double clicks = 0, psum = 0;
    int64_t same = 0, n = 0;
    static int count[1 << 16];
    memset(count, 0, sizeof count);
    loom_elem *ea, *eb, *ecc;
    while (loom_iter_next(a, &ea, &err) == LOOM_OK) {
        CHECK(loom_iter_next(b, &eb, &err) == LOOM_OK);
        CHECK(loom_iter_next(c, &ecc, &err) == LOOM_OK);
        CHECK(!memcmp(ea->t[0].data, eb->t[0].data, 8 * sizeof(int64_t)));
        CHECK(*(float *)ea->t[1].data == *(float *)eb->t[1].data);
        const int64_t *ids = ea->t[0].data;
        for (int j = 0; j < 8; j++) {
            CHECK(ids[j] >= 0 && ids[j] < (1 << 16));
            count[ids[j]]++;
        }
        float y = *(float *)ea->t[1].data, p = *(float *)ea->t[2].data;
        CHECK(y == 0.f || y == 1.f);
        clicks += y;
        psum += p;
        same += *(float *)ecc->t[1].data == y;
        n++;
    }
    CHECK(n == 4000);
    printf("# click rate %.4f, mean true probability %.4f\n", clicks / n, psum / n);
    CHECK(fabs(clicks - psum) < 4 * sqrt(psum)); /* Bernoulli(p) draws around their sum */
    CHECK(psum / n > 0.15 && psum / n < 0.6);
    CHECK(same < n); /* another seed, other clicks */
    int maxc = 0, distinct = 0;
    for (int i = 0; i < (1 << 16); i++) maxc = count[i] > maxc ? count[i] : maxc, distinct += count[i] > 0;
    printf("# %d distinct ids of 32000 lookups, the most popular %d times\n", distinct, maxc);
    CHECK(maxc > 300);         /* Zipf: value 0 of a column is common */
    CHECK(distinct > 1000);
    /* offset 3000: element i is element 3000 + i of the set (a held-out split) */
    loom_iter_close(b);
    ctr_offset = 3000;
    b = NULL;
    if (open_ctr(&b, 1, 10, 1) == LOOM_OK) {
        loom_iter_rewind(a, 1, &err);
        for (int i = 0; i < 3000; i++) loom_iter_next(a, &ea, &err);
        for (int i = 0; i < 10; i++) {
            CHECK(loom_iter_next(a, &ea, &err) == LOOM_OK && loom_iter_next(b, &eb, &err) == LOOM_OK);
            CHECK(!memcmp(ea->t[0].data, eb->t[0].data, 8 * sizeof(int64_t)));
            CHECK(!memcmp(ea->t[2].data, eb->t[2].data, sizeof(float)));
        }
        CHECK(loom_iter_next(b, &eb, &err) == LOOM_EEOF);
    }
    ctr_offset = 0;
done:
    loom_iter_close(a);
    loom_iter_close(b);
    loom_iter_close(c);
}

static const loom_test tests[] = {
    {"forward", test_forward},
    {"gradcheck", test_gradcheck},
    {"sparse_grad", test_sparse_grad},
    {"threads", test_threads},
    {"bad_ids", test_bad_ids},
    {"profiled", test_profiled},
    {"sparse_equals_dense", test_sparse_equals_dense},
    {"lazy", test_lazy},
    {"lazy_more", test_lazy_more},
    {"adagrad", test_adagrad},
    {"ctr_source", test_ctr_source},
    {0},
};

int main(void)
{
    if (loom_blas_init(1, &err) != LOOM_OK) {
        printf("Bail out! %s\n", err.msg);
        return 1;
    }
    return loom_test_run(tests);
}
