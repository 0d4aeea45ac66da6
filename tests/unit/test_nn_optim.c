/* test_nn_optim.c - optimizers and schedules against hand-computed values,
 * updates over a pool and by ranges equal to one pass bit for bit, the
 * gradient-ready hook, and the optimizer taken inside the step. */
#include "nn_fixtures.h"

/* ---- optimizers and schedules ------------------------------------------------ */


static void run_opt(loom_optimizer_spec s, float p[3], int steps)
{
    static const float g[3] = {0.1f, -0.2f, 0.3f};
    loom_optimizer *o = NULL;
    CHECK(loom_optimizer_new(&o, &s, 3, &err) == LOOM_OK);
    p[0] = 1, p[1] = 2, p[2] = 3;
    for (int t = 0; t < steps; t++) loom_optimizer_apply(o, p, g, t);
    loom_optimizer_free(o);
}

/* Each optimizer flags a NaN or infinite gradient in its update pass, at
 * any position (here the last of 37, past the vector loops' main part), and
 * clears the flag when read; a finite update leaves it clear. */
static void test_optimizer_nonfinite(void)
{
    const loom_opt_kind kinds[] = {LOOM_OPT_SGD, LOOM_OPT_MOMENTUM, LOOM_OPT_ADAM};
    const float bad[] = {NAN, INFINITY, -INFINITY};
    for (int k = 0; k < 3; k++)
        for (int b = 0; b < 3; b++) {
            loom_optimizer_spec s = opt_spec(kinds[k]);
            loom_optimizer *o = NULL;
            float p[37], g[37];
            for (int i = 0; i < 37; i++) p[i] = 1.f, g[i] = 0.01f * (float)i;
            CHECK(loom_optimizer_new(&o, &s, 37, &err) == LOOM_OK);
            loom_optimizer_apply(o, p, g, 0);
            CHECK_MSG(!loom_optimizer_take_nonfinite(o), "optimizer %d: finite update flagged", k);
            g[36] = bad[b];
            loom_optimizer_apply(o, p, g, 1);
            CHECK_MSG(loom_optimizer_take_nonfinite(o), "optimizer %d: gradient %g not flagged", k, (double)bad[b]);
            CHECK(!loom_optimizer_take_nonfinite(o));
            loom_optimizer_free(o);
        }
}

static void test_optimizers(void)
{
    float p[3];
    run_opt(opt_spec(LOOM_OPT_SGD), p, 1);
    CHECK_NEAR(p[0], 0.99, 1e-6);
    CHECK_NEAR(p[1], 2.02, 1e-6);
    CHECK_NEAR(p[2], 2.97, 1e-6);
    /* momentum: v1 = -lr g, p1 = p0 + v1; v2 = 0.9 v1 - lr g = -1.9 lr g */
    loom_optimizer_spec ms = opt_spec(LOOM_OPT_MOMENTUM);
    run_opt(ms, p, 1);
    CHECK_NEAR(p[0], 0.99, 1e-6);
    run_opt(ms, p, 2);
    CHECK_NEAR(p[0], 1 - 0.01 - 0.019, 1e-6);
    CHECK_NEAR(p[1], 2 + 0.02 + 0.038, 1e-6);
    CHECK_NEAR(p[2], 3 - 0.03 - 0.057, 1e-6);
    /* nesterov: p += 0.9 v - lr g: step 1 -0.019 g/0.1, step 2 0.9 * -0.019 - 0.01 = -0.0271 (per unit g/0.1) */
    ms.nesterov = true;
    run_opt(ms, p, 2);
    CHECK_NEAR(p[0], 1 - 0.019 - 0.0271, 1e-6);
    CHECK_NEAR(p[1], 2 + 0.038 + 0.0542, 1e-6);
    CHECK_NEAR(p[2], 3 - 0.057 - 0.0813, 1e-6);
    /* adam, t = 1: m = 0.1 g, v = 0.001 g^2, lr_t = 0.1 sqrt(0.001) / 0.1, so
     * the step is lr_t * 0.1 g / (sqrt(0.001) |g| + 1e-7) = 0.1 sign(g) * (1 - ~3e-6/|g|) */
    loom_optimizer_spec as = opt_spec(LOOM_OPT_ADAM);
    run_opt(as, p, 1);
    double s1 = 0.1 * sqrt(0.001) / 0.1 * 0.01 / (sqrt(0.001) * 0.1 + 1e-7);
    CHECK_NEAR(p[0], 1 - s1, 1e-6);
    CHECK_NEAR(p[0], 0.9000031623, 1e-6);
    /* t = 2, same g: m = 0.19 g, v = 0.001999 g^2, lr_t = 0.1 sqrt(1 - 0.999^2) / (1 - 0.81) */
    run_opt(as, p, 2);
    double lr2 = 0.1 * sqrt(1 - 0.999 * 0.999) / (1 - 0.81);
    for (int i = 0; i < 3; i++) {
        double g = (double[]){0.1, -0.2, 0.3}[i];
        double m1 = 0.1 * g, v1 = 0.001 * g * g, lr1 = 0.1 * sqrt(0.001) / 0.1;
        double p1 = (i + 1) - lr1 * m1 / (sqrt(v1) + 1e-7);
        double m2 = 0.9 * m1 + 0.1 * g, v2 = 0.999 * v1 + 0.001 * g * g;
        CHECK_NEAR(p[i], p1 - lr2 * m2 / (sqrt(v2) + 1e-7), 2e-6);
    }
    /* slots, names, lr override */
    loom_optimizer *o = NULL;
    CHECK(loom_optimizer_new(&o, &as, 3, &err) == LOOM_OK);
    CHECK(loom_optimizer_num_slots(o) == 2);
    CHECK(!strcmp(loom_optimizer_slot_name(o, 0), "m") && !strcmp(loom_optimizer_slot_name(o, 1), "v"));
    float pp[3] = {0}, gg[3] = {1, 1, 1};
    loom_optimizer_apply(o, pp, gg, 0);
    CHECK_NEAR(loom_optimizer_slots(o)[0], 0.1, 1e-7);
    CHECK_NEAR(loom_optimizer_slots(o)[3], 0.001, 1e-7);
    loom_optimizer_set_lr(o, 0.5);
    CHECK(loom_optimizer_lr(o, 10) == 0.5);
    loom_optimizer_set_lr(o, 0);
    CHECK(loom_optimizer_lr(o, 10) == 0.1);
    loom_optimizer_free(o);
    loom_optimizer_spec mo = opt_spec(LOOM_OPT_MOMENTUM), sg = opt_spec(LOOM_OPT_SGD);
    CHECK(loom_optimizer_new(&o, &mo, 3, &err) == LOOM_OK);
    CHECK(loom_optimizer_num_slots(o) == 1 && !strcmp(loom_optimizer_slot_name(o, 0), "momentum"));
    loom_optimizer_free(o);
    CHECK(loom_optimizer_new(&o, &sg, 3, &err) == LOOM_OK);
    CHECK(loom_optimizer_num_slots(o) == 0);
    loom_optimizer_free(o);
    loom_optimizer_free(NULL);
}

static void test_schedules(void)
{
    loom_schedule_spec s = {0};
    s.kind = LOOM_SCHED_CONSTANT;
    CHECK(loom_schedule_lr(&s, 0.1, 12345) == 0.1);
    /* exponential_decay: lr * rate^(step / decay_steps) */
    s.kind = LOOM_SCHED_EXPONENTIAL_DECAY;
    s.decay_steps = 10;
    s.decay_rate = 0.5;
    CHECK_NEAR(loom_schedule_lr(&s, 0.1, 0), 0.1, 1e-12);
    CHECK_NEAR(loom_schedule_lr(&s, 0.1, 5), 0.1 * sqrt(0.5), 1e-12);
    CHECK_NEAR(loom_schedule_lr(&s, 0.1, 25), 0.1 * pow(0.5, 2.5), 1e-12);
    s.staircase = true;
    CHECK_NEAR(loom_schedule_lr(&s, 0.1, 9), 0.1, 1e-12);
    CHECK_NEAR(loom_schedule_lr(&s, 0.1, 25), 0.025, 1e-12);
    /* piecewise_constant: v0 while step <= b0 */
    loom_schedule_spec p = {0};
    p.kind = LOOM_SCHED_PIECEWISE_CONSTANT;
    p.n_boundaries = 2;
    p.boundaries[0] = 10;
    p.boundaries[1] = 20;
    p.values[0] = 1.0;
    p.values[1] = 0.5;
    p.values[2] = 0.1;
    CHECK(loom_schedule_lr(&p, 9, 0) == 1.0);
    CHECK(loom_schedule_lr(&p, 9, 10) == 1.0);
    CHECK(loom_schedule_lr(&p, 9, 11) == 0.5);
    CHECK(loom_schedule_lr(&p, 9, 20) == 0.5);
    CHECK(loom_schedule_lr(&p, 9, 21) == 0.1);
    /* cosine: lr ((1 - alpha) 0.5 (1 + cos(pi min(step, D) / D)) + alpha) */
    loom_schedule_spec c = {0};
    c.kind = LOOM_SCHED_COSINE;
    c.decay_steps = 100;
    c.alpha = 0.1;
    CHECK_NEAR(loom_schedule_lr(&c, 0.2, 0), 0.2, 1e-12);
    CHECK_NEAR(loom_schedule_lr(&c, 0.2, 50), 0.2 * 0.55, 1e-12);
    CHECK_NEAR(loom_schedule_lr(&c, 0.2, 25), 0.2 * (0.9 * 0.5 * (1 + cos(M_PI / 4)) + 0.1), 1e-12);
    CHECK_NEAR(loom_schedule_lr(&c, 0.2, 100), 0.02, 1e-12);
    CHECK_NEAR(loom_schedule_lr(&c, 0.2, 1000), 0.02, 1e-12);
    /* the optimizer follows its schedule */
    loom_optimizer_spec os = opt_spec(LOOM_OPT_SGD);
    os.schedule = c;
    loom_optimizer *o = NULL;
    CHECK(loom_optimizer_new(&o, &os, 1, &err) == LOOM_OK);
    CHECK_NEAR(loom_optimizer_lr(o, 50), 0.055, 1e-12);
    float pv = 0, gv = 1;
    loom_optimizer_apply(o, &pv, &gv, 50);
    CHECK_NEAR(pv, -0.055, 1e-7);
    loom_optimizer_free(o);
}


enum { UPDATE_N = 100003, RANGE_CUT = 70001 }; /* parameters; odd cut: ranges not on cache lines */

/* Checks that another way to update (way, through optimizer b on p2) equals
 * loom_optimizer_apply (a on p1) for each optimizer, params and slots, bit
 * for bit, over 3 steps: g from seed, the parameters from seed + 1. way runs
 * after a has done step t, so it may compare p2 with p1. */
typedef void (*update_way)(loom_optimizer *b, loom_pool *pool, float *p2, const float *g, int t, const float *p1,
                           loom_opt_kind kind);
static void check_update_way(update_way way, int threads, uint64_t seed, const char *what)
{
    const int64_t n = UPDATE_N;
    loom_pool *pool = NULL;
    CHECK(loom_pool_new(&pool, threads, &err) == LOOM_OK);
    float *g = malloc((size_t)n * sizeof *g), *p1 = malloc((size_t)n * sizeof *p1), *p2 = malloc((size_t)n * sizeof *p2);
    loom_rng r;
    loom_rng_init(&r, seed, 0, 0, 0);
    fill_normal(g, n, &r, 1.f);
    loom_opt_kind kinds[] = {LOOM_OPT_SGD, LOOM_OPT_MOMENTUM, LOOM_OPT_ADAM};
    for (int k = 0; k < 3; k++) {
        loom_optimizer_spec s = opt_spec(kinds[k]);
        loom_optimizer *a = NULL, *b = NULL;
        CHECK(loom_optimizer_new(&a, &s, n, &err) == LOOM_OK);
        CHECK(loom_optimizer_new(&b, &s, n, &err) == LOOM_OK);
        if (!a || !b) break;
        loom_rng_init(&r, seed + 1, 0, 0, 0);
        fill_normal(p1, n, &r, 1.f);
        memcpy(p2, p1, (size_t)n * sizeof *p1);
        for (int t = 0; t < 3; t++) {
            loom_optimizer_apply(a, p1, g, t);
            way(b, pool, p2, g, t, p1, kinds[k]);
        }
        CHECK_MSG(!memcmp(p1, p2, (size_t)n * sizeof *p1), "optimizer %d: %s change the update", k, what);
        int ns = loom_optimizer_num_slots(a);
        CHECK(!ns || !memcmp(loom_optimizer_slots(a), loom_optimizer_slots(b), (size_t)(ns * n) * sizeof(float)));
        loom_optimizer_free(a);
        loom_optimizer_free(b);
    }
    free(g);
    free(p1);
    free(p2);
    loom_pool_free(pool);
}

static void update_pooled(loom_optimizer *b, loom_pool *pool, float *p2, const float *g, int t, const float *p1,
                          loom_opt_kind kind)
{
    (void)p1, (void)kind;
    loom_optimizer_set_pool(b, pool);
    loom_optimizer_apply(b, p2, g, t);
}

/* The optimizers' update split over a pool equals the single-threaded one, bit for bit. */
static void test_optimizer_pool(void) { check_update_way(update_pooled, 3, 4, "a pool does"); }

static void update_ranges(loom_optimizer *b, loom_pool *pool, float *p2, const float *g, int t, const float *p1,
                          loom_opt_kind kind)
{
    const int64_t n = UPDATE_N, cut = RANGE_CUT;
    loom_optimizer_apply_range(b, NULL, p2, g, t, cut, n);
    loom_optimizer_apply_range(b, pool, p2, g, t, 5, 5);
    if (t == 0) /* half done: the rest is untouched */
        CHECK_MSG(p2[cut - 1] != p1[cut - 1] && (kind == LOOM_OPT_SGD || loom_optimizer_slots(b)[0] == 0),
                  "optimizer %d: a range changed parameters outside it", (int)kind);
    loom_optimizer_apply_range(b, pool, p2, g, t, 0, cut);
}

/* Updates applied range by range (a partition of the parameters, in any
 * order, with or without a pool) equal the whole update, params and slots,
 * bit for bit, and leave everything outside the range alone. */
static void test_optimizer_ranges(void) { check_update_way(update_ranges, 2, 6, "ranges"); }

/* Every optimizer's update is its formula as the C source writes it, element
 * by element and bit for bit, wherever the element falls in the vector loops
 * (whole-range, or ranges starting off a cache line): the reference below is
 * plain scalar C, and the build keeps gcc from fusing a product and a sum
 * into an FMA (-ffp-contract=off). With fusing, the AVX-512 clones fused
 * some products in the main vector loop and not in its epilogue, and chose
 * which product to fuse differently in the sanitized build, whose native
 * training drifted 5% from the release build's in 100 steps. */
static void test_update_formulas(void)
{
    enum { N = 1037, STEPS = 3 };
    float *g = malloc(N * sizeof *g), *p = malloc(N * sizeof *p), *q = malloc(N * sizeof *q);
    float *m = calloc(N, sizeof *m), *v = calloc(N, sizeof *v);
    loom_rng r;
    loom_rng_init(&r, 7, 0, 0, 0);
    fill_normal(g, N, &r, 1.f);
    const char *names[] = {"sgd", "momentum", "nesterov", "adam"};
    for (int k = 0; k < 4; k++) {
        loom_optimizer_spec s = opt_spec(k == 0 ? LOOM_OPT_SGD : k < 3 ? LOOM_OPT_MOMENTUM : LOOM_OPT_ADAM);
        s.nesterov = k == 2;
        for (int split = 0; split < 2; split++) {
            loom_optimizer *o = NULL;
            CHECK(loom_optimizer_new(&o, &s, N, &err) == LOOM_OK);
            if (!o) break;
            loom_rng_init(&r, 8, 0, 0, 0);
            fill_normal(p, N, &r, 1.f);
            memcpy(q, p, N * sizeof *p);
            memset(m, 0, N * sizeof *m);
            memset(v, 0, N * sizeof *v);
            const float mu = (float)s.momentum, b1 = (float)s.beta1, b2 = (float)s.beta2, eps = (float)s.epsilon;
            for (int t = 0; t < STEPS; t++) {
                if (split) { /* three ranges, two starting mid cache line */
                    loom_optimizer_apply_range(o, NULL, p, g, t, 0, 5);
                    loom_optimizer_apply_range(o, NULL, p, g, t, 5, 523);
                    loom_optimizer_apply_range(o, NULL, p, g, t, 523, N);
                } else {
                    loom_optimizer_apply(o, p, g, t);
                }
                double lrd = s.learning_rate;
                if (k == 3) lrd = lrd * sqrt(1.0 - pow(s.beta2, t + 1.0)) / (1.0 - pow(s.beta1, t + 1.0));
                const float lr = (float)lrd;
                for (int i = 0; i < N; i++) {
                    if (k == 0) {
                        q[i] = q[i] - lr * g[i];
                    } else if (k < 3) {
                        v[i] = mu * v[i] - lr * g[i];
                        q[i] = k == 2 ? q[i] + (mu * v[i] - lr * g[i]) : q[i] + v[i];
                    } else {
                        m[i] = b1 * m[i] + (1.f - b1) * g[i];
                        v[i] = b2 * v[i] + (1.f - b2) * g[i] * g[i];
                        q[i] = q[i] - lr * m[i] / (sqrtf(v[i]) + eps);
                    }
                }
            }
            int bad = -1;
            for (int i = 0; i < N && bad < 0; i++)
                if (memcmp(&p[i], &q[i], sizeof *p)) bad = i;
            CHECK_MSG(bad < 0, "%s%s: parameter %d is %.9g, the formula gives %.9g", names[k],
                      split ? " (by ranges)" : "", bad, bad < 0 ? 0. : (double)p[bad], bad < 0 ? 0. : (double)q[bad]);
            loom_optimizer_free(o);
        }
    }
    free(g);
    free(p);
    free(q);
    free(m);
    free(v);
}


/* ---- the gradient-ready hook (reductions overlapping backward) ------------ */

typedef struct hook_log {
    loom_model *m;
    int         calls, order_ok, t[64];
    float      *seen;  /* (P,): each gradient as it was when the hook first declared it final */
    bool       *taken;
} hook_log;

static void on_grads_ready(void *arg, int t)
{
    hook_log *h = arg;
    if (h->calls < 64) h->t[h->calls] = t;
    if (h->calls > 0 && t > h->t[h->calls - 1 < 63 ? h->calls - 1 : 63]) h->order_ok = 0;
    h->calls++;
    const loom_param_info *p = loom_model_param_tensor(h->m, t);
    int64_t from = p->offset, P = loom_model_num_params(h->m);
    for (int64_t i = from; i < P; i++)
        if (!h->taken[i]) h->seen[i] = loom_model_grads(h->m)[i], h->taken[i] = true;
}

/* With a hook the gradients are the same bits; the hook is called with
 * decreasing tensor indices ending at 0, and each gradient it declares final
 * already holds its final value then. 1 and 2 threads, MLP and CNN. */
static void check_hook(const char *what, const loom_layer_spec *ls, int n, loom_shape in, int64_t B)
{
    for (int threads = 1; threads <= 2; threads++) {
        fixture f;
        if (fixture_new(&f, mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, n, ls), in, LOOM_I32, B, 5) != LOOM_OK) {
            CHECK_MSG(0, "%s: cannot build", what);
            return;
        }
        CHECK(loom_model_set_threads(f.m, threads, &err) == LOOM_OK);
        int64_t P = loom_model_num_params(f.m);
        step_loss(&f, 11);
        float *plain = malloc((size_t)P * sizeof *plain);
        memcpy(plain, loom_model_grads(f.m), (size_t)P * sizeof *plain);
        memset(loom_model_grads(f.m), 0xff, (size_t)P * sizeof(float)); /* NaNs: stale values would show */
        hook_log h = {.m = f.m, .order_ok = 1, .seen = calloc((size_t)P, sizeof(float)),
                      .taken = calloc((size_t)P, sizeof(bool))};
        loom_model_set_grad_hook(f.m, on_grads_ready, &h);
        step_loss(&f, 11);
        loom_model_set_grad_hook(f.m, NULL, NULL);
        CHECK_MSG(!memcmp(plain, loom_model_grads(f.m), (size_t)P * sizeof(float)), "%s, %d thread(s): a hook changed "
                  "the gradients", what, threads);
        CHECK_MSG(h.calls >= 2 && h.order_ok && h.t[h.calls < 64 ? h.calls - 1 : 63] == 0, "%s, %d thread(s): hook "
                  "calls %d, decreasing %d", what, threads, h.calls, h.order_ok);
        CHECK_MSG(!memcmp(plain, h.seen, (size_t)P * sizeof(float)), "%s, %d thread(s): a gradient declared final "
                  "changed afterwards", what, threads);
        printf("# %s, %d thread(s): %d hook calls:", what, threads, h.calls);
        for (int i = 0; i < h.calls && i < 64; i++) printf(" %d", h.t[i]);
        printf("\n");
        free(plain), free(h.seen), free(h.taken);
        fixture_free(&f);
    }
}

static void test_grad_hook(void)
{
    loom_layer_spec mlp[] = {L_dense(24, LOOM_ACT_RELU), L_kind(LOOM_LAYER_DROPOUT, 0.4, 0), L_dense(16, LOOM_ACT_TANH),
                             L_dense(5, LOOM_ACT_NONE)};
    check_hook("mlp + dropout", mlp, 4, shp(1, 13, 0, 0), 8);
    loom_layer_spec cnn[] = {L_conv(4, 3, 1, LOOM_PAD_SAME, LOOM_ACT_RELU), L_pool(2, 2, LOOM_PAD_VALID),
                             L_conv(6, 3, 2, LOOM_PAD_SAME, LOOM_ACT_RELU), L_pool(3, 2, LOOM_PAD_SAME),
                             L_kind(LOOM_LAYER_FLATTEN, 0, 0), L_dense(12, LOOM_ACT_RELU), L_dense(4, LOOM_ACT_NONE)};
    check_hook("cnn", cnn, 7, shp(3, 12, 10, 3), 7);
    check_hook("cnn cin 1", cnn, 7, shp(3, 12, 10, 1), 7);
}

/* ---- the optimizer inside the step ------------------------------------------ */

/* Steps of fixture a with the optimizer after them (loom_optimizer_apply on
 * the model's pool, as one_device did) and of b, built alike, with it inside
 * (loom_model_train_step_update; parts: forward, loss, backward_update under
 * a profile): params, grads and slots the same bits after every step, and
 * *taken whether b's steps took the update in. */
static void in_step_vs_after(const char *what, const loom_model_spec *spec, loom_shape in, int64_t B, int64_t step_B,
                             loom_optimizer_spec os, int threads, bool parts, int *taken)
{
    fixture a, b;
    loom_model_spec sp = *spec;
    if (fixture_new(&a, &sp, in, LOOM_I32, B, 5) != LOOM_OK || fixture_new(&b, &sp, in, LOOM_I32, B, 5) != LOOM_OK) {
        CHECK_MSG(0, "%s: cannot build", what);
        return;
    }
    CHECK(loom_model_set_threads(a.m, threads, &err) == LOOM_OK);
    CHECK(loom_model_set_threads(b.m, threads, &err) == LOOM_OK);
    int64_t P = loom_model_num_params(a.m);
    loom_optimizer *oa = NULL, *ob = NULL;
    CHECK(loom_optimizer_new(&oa, &os, P, &err) == LOOM_OK && loom_optimizer_new(&ob, &os, P, &err) == LOOM_OK);
    loom_optimizer_for_model(oa, a.m), loom_optimizer_for_model(ob, b.m);
    loom_optimizer_set_pool(oa, loom_model_pool(a.m)), loom_optimizer_set_pool(ob, loom_model_pool(b.m));
    loom_tensor xa = a.x, ya = a.y, xb = b.x, yb = b.y;
    xa.shape.dim[0] = ya.shape.dim[0] = xb.shape.dim[0] = yb.shape.dim[0] = step_B;
    *taken = 0;
    loom_model_prof prof = {0};
    for (int s = 0; s < 3; s++) {
        double la, lb;
        int64_t ca, cb;
        bool applied = false;
        CHECK(loom_model_train_step(a.m, &xa, &ya, step_B, 40 + s, &la, &ca, &err) == LOOM_OK);
        loom_optimizer_apply(oa, loom_model_params(a.m), loom_model_grads(a.m), s);
        if (parts) {
            loom_model_set_prof(b.m, &prof);
            CHECK(loom_model_profiled(b.m));
            CHECK(loom_model_forward(b.m, &xb, 40 + s, &err) == LOOM_OK);
            CHECK(loom_model_loss(b.m, &yb, step_B, &lb, &cb, &err) == LOOM_OK);
            CHECK(loom_model_backward_update(b.m, ob, s, &applied, &err) == LOOM_OK);
            loom_model_set_prof(b.m, NULL);
        } else {
            CHECK(loom_model_train_step_update(b.m, &xb, &yb, step_B, 40 + s, ob, s, &lb, &cb, &applied, &err) ==
                  LOOM_OK);
        }
        if (!applied) loom_optimizer_apply(ob, loom_model_params(b.m), loom_model_grads(b.m), s);
        *taken += applied;
        CHECK_MSG(la == lb && ca == cb, "%s, %d thread(s), step %d: loss %.9g vs %.9g", what, threads, s, la, lb);
        CHECK_MSG(!memcmp(loom_model_grads(a.m), loom_model_grads(b.m), (size_t)P * sizeof(float)),
                  "%s, %d thread(s), step %d: gradients differ", what, threads, s);
        CHECK_MSG(!memcmp(loom_model_params(a.m), loom_model_params(b.m), (size_t)P * sizeof(float)),
                  "%s, %d thread(s), step %d: weights differ", what, threads, s);
        int ns = loom_optimizer_num_slots(oa);
        CHECK_MSG(!ns || !memcmp(loom_optimizer_slots(oa), loom_optimizer_slots(ob), (size_t)(ns * P) * sizeof(float)),
                  "%s, %d thread(s), step %d: slots differ", what, threads, s);
        CHECK(!loom_optimizer_take_nonfinite(oa) && !loom_optimizer_take_nonfinite(ob));
    }
    if (parts && *taken) { /* the profile times the update of every layer with weights, and only those */
        for (int i = 0; i < loom_model_num_layers(b.m); i++) {
            bool w = loom_model_layer_gemm(b.m, i, 1, 0, &(loom_gemm_shape){0});
            CHECK_MSG(w ? prof.upd[i] > 0 : prof.upd[i] == 0, "%s: layer %d's update time %g", what, i, prof.upd[i]);
        }
    }
    loom_optimizer_free(oa), loom_optimizer_free(ob);
    fixture_free(&a), fixture_free(&b);
}

static void test_update_in_step(void)
{
    loom_layer_spec mlp[] = {L_kind(LOOM_LAYER_FLATTEN, 0, 0), L_dense(40, LOOM_ACT_RELU),
                             L_kind(LOOM_LAYER_DROPOUT, 0.3, 0), L_dense(17, LOOM_ACT_TANH), L_dense(5, LOOM_ACT_NONE)};
    loom_layer_spec cnn[] = {L_conv(4, 3, 1, LOOM_PAD_SAME, LOOM_ACT_RELU), L_pool(2, 2, LOOM_PAD_VALID),
                             L_conv(6, 3, 2, LOOM_PAD_SAME, LOOM_ACT_RELU), L_kind(LOOM_LAYER_FLATTEN, 0, 0),
                             L_dense(12, LOOM_ACT_RELU), L_dense(4, LOOM_ACT_NONE)};
    loom_layer_spec ln[] = {L_kind(LOOM_LAYER_FLATTEN, 0, 0), L_dense(9, LOOM_ACT_NONE),
                            L_kind(LOOM_LAYER_LAYER_NORM, 0, 0), L_dense(3, LOOM_ACT_NONE)};
    const loom_opt_kind kinds[] = {LOOM_OPT_SGD, LOOM_OPT_MOMENTUM, LOOM_OPT_ADAM, LOOM_OPT_ADAMW, LOOM_OPT_RMSPROP,
                                   LOOM_OPT_ADAGRAD};
    int taken;
    for (int threads = 1; threads <= 3; threads++) {
        for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
            loom_optimizer_spec os = opt_spec(kinds[k]);
            os.nesterov = true;
            os.rho = 0.9, os.weight_decay = 0.004, os.initial_accumulator = 0.1;
            os.schedule.kind = LOOM_SCHED_COSINE, os.schedule.decay_steps = 5;
            char what[64];
            snprintf(what, sizeof what, "mlp, optimizer %d", (int)kinds[k]);
            in_step_vs_after(what, mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 5, mlp), shp(2, 7, 9, 0), 11, 11, os, threads,
                             false, &taken);
            CHECK_MSG(taken == 3, "%s, %d thread(s): taken in %d of 3 steps", what, threads, taken);
        }
        loom_optimizer_spec os = opt_spec(LOOM_OPT_MOMENTUM);
        os.nesterov = true;
        /* a batch smaller than the threads: one chunk, each layer after its backward */
        in_step_vs_after("mlp, batch 1", mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 5, mlp), shp(2, 7, 9, 0), 11, 1, os, threads,
                         false, &taken);
        CHECK(taken == 3);
        /* conv layers: updated after their gradient pass when it is split */
        in_step_vs_after("cnn", mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 6, cnn), shp(3, 12, 10, 3), 7, 7, opt_spec(LOOM_OPT_ADAM),
                         threads, false, &taken);
        CHECK(taken == 3);
        in_step_vs_after("cnn cin 1", mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 6, cnn), shp(3, 12, 10, 1), 7, 7, os, threads,
                         false, &taken);
        CHECK(taken == 3);
        in_step_vs_after("layer norm", mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 4, ln), shp(2, 7, 9, 0), 6, 6, os, threads,
                         false, &taken);
        CHECK(taken == 3);
        /* the profile's parts take it too (loom profile --train times where it runs) */
        in_step_vs_after("mlp, parts", mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 5, mlp), shp(2, 7, 9, 0), 11, 11, os, threads,
                         true, &taken);
        CHECK(taken == 3);
        in_step_vs_after("cnn, parts", mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 6, cnn), shp(3, 12, 10, 1), 7, 7, os, threads,
                         true, &taken);
        CHECK(taken == 3);
        /* not taken where something needs every gradient first; then the caller's update, the same bits */
        loom_optimizer_spec clip = os;
        clip.clip_norm = 0.01;
        in_step_vs_after("clip_norm", mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 5, mlp), shp(2, 7, 9, 0), 11, 11, clip, threads,
                         false, &taken);
        CHECK_MSG(taken == 0, "clip_norm: taken in %d steps", taken);
        loom_model_spec l2 = *mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 5, mlp);
        l2.l2 = 0.01;
        in_step_vs_after("model.l2", &l2, shp(2, 7, 9, 0), 11, 11, os, threads, false, &taken);
        CHECK_MSG(taken == 0, "model.l2: taken in %d steps", taken);
        loom_layer_spec bn[] = {L_kind(LOOM_LAYER_FLATTEN, 0, 0), L_dense(9, LOOM_ACT_NONE),
                                L_kind(LOOM_LAYER_BATCH_NORM, 0, 0), L_dense(3, LOOM_ACT_NONE)};
        in_step_vs_after("batch norm", mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 4, bn), shp(2, 7, 9, 0), 6, 6, os, threads, true,
                         &taken);
        CHECK_MSG(taken == 0, "batch norm: taken in %d steps", taken);
    }
    /* a replica with a gradient hook (it reduces first), no optimizer, a
     * non-finite loss: nothing updated in the step */
    fixture f;
    if (fixture_new(&f, mk(LOOM_LOSS_SPARSE_SOFTMAX_CE, 5, mlp), shp(2, 7, 9, 0), LOOM_I32, 4, 5) != LOOM_OK) {
        CHECK(0);
        return;
    }
    int64_t P = loom_model_num_params(f.m);
    loom_optimizer_spec os = opt_spec(LOOM_OPT_SGD);
    loom_optimizer *o = NULL;
    CHECK(loom_optimizer_new(&o, &os, P, &err) == LOOM_OK);
    CHECK(loom_model_can_update_in_step(f.m, o) && !loom_model_can_update_in_step(f.m, NULL));
    hook_log h = {.m = f.m, .order_ok = 1, .seen = calloc((size_t)P, sizeof(float)), .taken = calloc((size_t)P, sizeof(bool))};
    loom_model_set_grad_hook(f.m, on_grads_ready, &h);
    CHECK(!loom_model_can_update_in_step(f.m, o));
    loom_model_set_grad_hook(f.m, NULL, NULL);
    free(h.seen), free(h.taken);
    float *before = malloc((size_t)P * sizeof *before);
    memcpy(before, loom_model_params(f.m), (size_t)P * sizeof *before);
    ((float *)f.x.data)[3] = INFINITY;
    double loss;
    int64_t correct;
    bool applied = true;
    CHECK(loom_model_train_step_update(f.m, &f.x, &f.y, 4, 1, o, 0, &loss, &correct, &applied, &err) == LOOM_ENUMERIC);
    CHECK(!applied && !memcmp(before, loom_model_params(f.m), (size_t)P * sizeof *before));
    CHECK(!loom_optimizer_take_nonfinite(o));
    /* a finite loss, a non-finite learning rate: flagged as loom_optimizer_apply flags it */
    ((float *)f.x.data)[3] = 0.5f;
    loom_optimizer_set_lr(o, INFINITY);
    CHECK(loom_model_train_step_update(f.m, &f.x, &f.y, 4, 1, o, 0, &loss, &correct, &applied, &err) == LOOM_OK);
    CHECK(applied && loom_optimizer_take_nonfinite(o));
    char where[160];
    CHECK(loom_model_find_nonfinite(f.m, where, sizeof where) >= 0);
    printf("# non-finite after an update in the step: %s\n", where);
    free(before);
    loom_optimizer_free(o);
    fixture_free(&f);
}



static const loom_test tests[] = {
    {"optimizers", test_optimizers},
    {"optimizers flag non-finite updates", test_optimizer_nonfinite},
    {"schedules", test_schedules},
    {"optimizer over a pool", test_optimizer_pool},
    {"optimizer applied by ranges", test_optimizer_ranges},
    {"updates are the C formulas, bit for bit", test_update_formulas},
    {"gradient-ready hook: same bits, final when called", test_grad_hook},
    {"optimizer in the step: same bits as after it, taken where it may be", test_update_in_step},
    {0},
};

int main(void) { return nn_test_main(tests); }
