/* test_strategies.c - mirrored and central_storage on real Fashion-MNIST
 * (tests/configs/strategy_mlp.cfg: a 784-64-10 MLP, Adam, batch 64):
 * after 100 steps their weights match one_device's with the same global
 * batch (relative difference <= 1e-5), for even and uneven splits, partial
 * last batches and empty replicas; mirrored replicas stay bit-equal; two runs
 * are bit-identical; every cross-device op gives the same training; eval and
 * predict agree with one_device; a restore reaches every replica; bad devices
 * and ops are refused with the config's file:line. */
#include "harness.h"
#include "test_util.h"
#include "train/train.h"

#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdint.h>

static loom_err err;


/* A strategy over the config's training pipeline, as the trainer builds it. */
typedef struct rig {
    loom_spec         *spec;
    loom_iter         *train, *eval;
    loom_strategy_args args;
    loom_strategy     *s;
    int64_t            step, epoch;
} rig;

static void rig_close(rig *g)
{
    loom_strategy_close(g->s);
    loom_iter_close(g->train);
    loom_iter_close(g->eval);
    loom_config_free(g->spec);
    memset(g, 0, sizeof *g);
}

/* Opens the config with overrides; on failure returns the code with err set. */
static int rig_open(rig *g, const char *const *sets, int n_sets)
{
    memset(g, 0, sizeof *g);
    int rc = train_pipeline_open(&g->spec, &g->train, "strategy_mlp.cfg", sets, n_sets, &err);
    if (rc) return rc;
    loom_data_ctx ctx = {.seed = g->spec->run.seed, .threads = 1, .name = "eval"};
    if ((rc = loom_data_open(&g->eval, &g->spec->eval, &ctx, &err))) return rc;
    const loom_elem_spec *es = loom_iter_spec(g->train);
    g->args.spec = g->spec;
    g->args.input = es;
    g->args.input_idx = loom_elem_spec_find(es, "image");
    g->args.label_idx = loom_elem_spec_find(es, "label");
    g->args.max_batch = 250;
    return loom_strategy_open(&g->s, &g->args, &err);
}

static int rig_open_ok(rig *g, const char *const *sets, int n_sets)
{
    int rc = rig_open(g, sets, n_sets);
    CHECK_MSG(rc == LOOM_OK, "%s: %s", err.where, err.msg);
    return rc == LOOM_OK;
}

/* Trains `steps` steps, starting a new epoch at the end of one; the summed
 * loss of all steps into *loss (may be NULL). */
static int train(rig *g, int steps, double *loss)
{
    double l = 0;
    for (int i = 0; i < steps; i++) {
        loom_elem *b;
        int rc = loom_iter_next(g->train, &b, &err);
        if (rc == LOOM_EEOF) {
            if ((rc = loom_iter_rewind(g->train, ++g->epoch, &err))) return rc;
            rc = loom_iter_next(g->train, &b, &err);
        }
        if (rc) return rc;
        loom_step_result res;
        if ((rc = loom_strategy_train_step(g->s, b, g->step++, &res, &err))) return rc;
        l += res.loss_sum;
    }
    if (loss) *loss = l;
    return LOOM_OK;
}

static float *params(rig *g) { return loom_model_params(loom_strategy_model(g->s)); }
static int64_t nparams(rig *g) { return loom_model_num_params(loom_strategy_model(g->s)); }

/* The weights of one_device after `steps` steps with these overrides. */
static float *reference(const char *const *sets, int n_sets, int steps)
{
    rig g;
    if (!rig_open_ok(&g, sets, n_sets)) return NULL;
    CHECK(train(&g, steps, NULL) == LOOM_OK);
    float *w = malloc((size_t)nparams(&g) * sizeof *w);
    memcpy(w, params(&g), (size_t)nparams(&g) * sizeof *w);
    rig_close(&g);
    return w;
}

/* Trains the strategy the overrides select and compares with one_device
 * trained on the same batches (same extra overrides). */
static void match_one_device(const char *const *sets, int n_sets, const char *const *base, int n_base, int steps)
{
    float *ref = reference(base, n_base, steps);
    const char *all[16];
    for (int i = 0; i < n_base; i++) all[i] = base[i];
    for (int i = 0; i < n_sets; i++) all[n_base + i] = sets[i];
    rig g;
    if (!ref || !rig_open_ok(&g, all, n_base + n_sets)) {
        free(ref);
        return;
    }
    CHECK(train(&g, steps, NULL) == LOOM_OK);
    double d = rel_diff(ref, params(&g), nparams(&g));
    CHECK_MSG(d <= 1e-5, "%s: relative weight difference %.3g after %d steps", sets[n_sets - 1], d, steps);
    printf("# %s, %d replicas: relative difference to one_device %.3g\n", all[n_base], loom_strategy_num_replicas(g.s),
           d);
    rig_close(&g);
    free(ref);
}

/* ---- tests ---------------------------------------------------------------------- */

static void test_mirrored_matches_one_device(void)
{
    const char *sets[] = {"strategy.type=mirrored", "strategy.devices=[\"cpu:0\", \"cpu:1\"]"};
    match_one_device(sets, 2, NULL, 0, 100);
}

static void test_central_storage_matches_one_device(void)
{
    const char *sets[] = {"strategy.type=central_storage", "strategy.replicas=2"};
    match_one_device(sets, 2, NULL, 0, 100);
}

/* 63 does not divide by 2 or 4: shares of 32 + 31 and 16 + 16 + 16 + 15; the
 * epoch's last batch (4096 = 65 * 63 + 1) has 1 example, so with 4 replicas
 * three of them get none. 70 steps cross that batch. */
static void test_uneven_and_empty_shares(void)
{
    const char *base[] = {"data.train.transforms.[2].size=63"};
    const char *m3[] = {"strategy.type=mirrored", "strategy.replicas=3"};
    const char *c4[] = {"strategy.type=central_storage", "strategy.replicas=4"};
    const char *m4[] = {"strategy.type=mirrored", "strategy.replicas=4"};
    match_one_device(m3, 2, base, 1, 70);
    match_one_device(c4, 2, base, 1, 70);
    match_one_device(m4, 2, base, 1, 70);
}

/* Every replica of mirrored holds the same bits after training. */
static void test_replicas_bit_equal(void)
{
    const char *sets[] = {"strategy.type=mirrored", "strategy.replicas=3"};
    rig g;
    if (!rig_open_ok(&g, sets, 2)) return;
    CHECK(train(&g, 30, NULL) == LOOM_OK);
    int64_t n = nparams(&g);
    for (int r = 1; r < 3; r++)
        CHECK_MSG(!memcmp(loom_model_params(loom_strategy_replica(g.s, 0)), loom_model_params(loom_strategy_replica(g.s, r)),
                          (size_t)n * sizeof(float)), "replica %d differs from replica 0", r);
    CHECK(loom_strategy_replica(g.s, 3) == NULL);
    rig_close(&g);
}

/* Same seed and config: bit-identical weights and losses, twice over. */
static void test_runs_bit_identical(void)
{
    const char *kinds[][2] = {{"strategy.type=mirrored", "strategy.replicas=2"},
                              {"strategy.type=central_storage", "strategy.replicas=2"}};
    for (int k = 0; k < 2; k++) {
        rig a, b;
        double la = 0, lb = 1;
        if (!rig_open_ok(&a, kinds[k], 2)) return;
        if (!rig_open_ok(&b, kinds[k], 2)) {
            rig_close(&a);
            return;
        }
        CHECK(train(&a, 80, &la) == LOOM_OK);
        CHECK(train(&b, 80, &lb) == LOOM_OK);
        CHECK_MSG(la == lb, "%s: losses %.17g vs %.17g", kinds[k][0], la, lb);
        CHECK_MSG(!memcmp(params(&a), params(&b), (size_t)nparams(&a) * sizeof(float)), "%s: weights differ", kinds[k][0]);
        rig_close(&a);
        rig_close(&b);
    }
}

/* Every registered cross-device op trains mirrored(3) to the same weights
 * (the ops may sum in different orders: within 1e-5), and for 2 replicas
 * to the same bits (a + b == b + a). */
static void test_every_cross_device_op(void)
{
    const char *name;
    float *first = NULL;
    int64_t n = 0;
    for (int i = 0; loom_registry_entry(LOOM_REG_CROSS_DEVICE_OPS, i, &name, NULL, NULL) == 0; i++) {
        char op[96];
        snprintf(op, sizeof op, "strategy.cross_device_ops=\"%s\"", name);
        const char *sets[] = {"strategy.type=mirrored", "strategy.replicas=2", op};
        rig g;
        if (!rig_open_ok(&g, sets, 3)) continue;
        CHECK(train(&g, 40, NULL) == LOOM_OK);
        n = nparams(&g);
        if (!first) {
            first = malloc((size_t)n * sizeof *first);
            memcpy(first, params(&g), (size_t)n * sizeof *first);
        } else {
            CHECK_MSG(!memcmp(first, params(&g), (size_t)n * sizeof *first), "%s differs from the first op", name);
        }
        printf("# cross_device_ops %s: trained\n", name);
        rig_close(&g);
    }
    CHECK(first != NULL);
    free(first);
    const char *sets3[] = {"strategy.type=mirrored", "strategy.replicas=3", "strategy.cross_device_ops=auto"};
    rig g;
    if (rig_open_ok(&g, sets3, 3)) {
        CHECK(g.s->xops != NULL); /* "auto" resolved to a registered op */
        CHECK(train(&g, 5, NULL) == LOOM_OK);
        rig_close(&g);
    }
}

/* eval_step and predict split the batch too, and agree with one_device. */
static void test_eval_and_predict(void)
{
    const char *sets[][2] = {{"strategy.type=mirrored", "strategy.replicas=3"},
                             {"strategy.type=central_storage", "strategy.replicas=2"}};
    rig ref;
    if (!rig_open_ok(&ref, NULL, 0)) return;
    CHECK(train(&ref, 30, NULL) == LOOM_OK);
    loom_elem *b;
    CHECK(loom_iter_next(ref.eval, &b, &err) == LOOM_OK);
    loom_step_result r0, r1;
    CHECK(loom_strategy_eval_step(ref.s, b, &r0, &err) == LOOM_OK);
    float *p0 = malloc(250 * 10 * sizeof *p0), *p1 = malloc(250 * 10 * sizeof *p1);
    CHECK(loom_strategy_predict(ref.s, b, p0, &err) == LOOM_OK);
    for (int k = 0; k < 2; k++) {
        rig g;
        if (!rig_open_ok(&g, sets[k], 2)) break;
        CHECK(train(&g, 30, NULL) == LOOM_OK);
        CHECK(loom_strategy_eval_step(g.s, b, &r1, &err) == LOOM_OK);
        CHECK(r1.examples == 250 && r0.examples == 250);
        CHECK_MSG(fabs(r1.loss_sum - r0.loss_sum) <= 1e-4 * fabs(r0.loss_sum), "%s: eval loss %.9g vs %.9g", sets[k][0],
                  r1.loss_sum, r0.loss_sum);
        CHECK_MSG(r1.correct == r0.correct, "%s: %lld vs %lld correct", sets[k][0], (long long)r1.correct,
                  (long long)r0.correct);
        memset(p1, 0, 250 * 10 * sizeof *p1);
        CHECK(loom_strategy_predict(g.s, b, p1, &err) == LOOM_OK);
        double worst = 0;
        for (int i = 0; i < 2500; i++) worst = fmax(worst, fabs((double)p1[i] - p0[i]));
        CHECK_MSG(worst <= 1e-4, "%s: predictions differ by %.3g", sets[k][0], worst);
        rig_close(&g);
    }
    free(p0);
    free(p1);
    rig_close(&ref);
}

/* After the trainer overwrites replica 0's variables and slots (a restore),
 * sync hands them to every replica, and training continues identically. */
static void test_sync_after_restore(void)
{
    const char *sets[] = {"strategy.type=mirrored", "strategy.replicas=2"};
    rig a, b;
    if (!rig_open_ok(&a, sets, 2)) return;
    if (!rig_open_ok(&b, sets, 2)) {
        rig_close(&a);
        return;
    }
    CHECK(train(&a, 40, NULL) == LOOM_OK);
    /* b: a's state copied into replica 0 only, then synced; then both train on */
    CHECK(train(&b, 40, NULL) == LOOM_OK);
    int64_t n = nparams(&a);
    loom_optimizer *oa = loom_strategy_optimizer(a.s), *ob = loom_strategy_optimizer(b.s);
    float *pb1 = loom_model_params(loom_strategy_replica(b.s, 1));
    pb1[0] += 1.0f; /* replica 1 drifted: sync must repair it */
    memcpy(params(&b), params(&a), (size_t)n * sizeof(float));
    memcpy(loom_optimizer_slots(ob), loom_optimizer_slots(oa), (size_t)(2 * n) * sizeof(float));
    CHECK(loom_strategy_sync(b.s, &err) == LOOM_OK);
    CHECK(!memcmp(pb1, params(&a), (size_t)n * sizeof(float)));
    CHECK(train(&a, 20, NULL) == LOOM_OK);
    CHECK(train(&b, 20, NULL) == LOOM_OK);
    CHECK(!memcmp(params(&a), params(&b), (size_t)n * sizeof(float)));
    rig_close(&a);
    rig_close(&b);
}

/* A learning rate set on the strategy's optimizer reaches every replica. */
static void test_lr_override_reaches_replicas(void)
{
    const char *sets[] = {"strategy.type=mirrored", "strategy.replicas=2"};
    rig g;
    if (!rig_open_ok(&g, sets, 2)) return;
    loom_optimizer_set_lr(loom_strategy_optimizer(g.s), 0.05);
    CHECK(train(&g, 10, NULL) == LOOM_OK);
    CHECK(!memcmp(loom_model_params(loom_strategy_replica(g.s, 0)), loom_model_params(loom_strategy_replica(g.s, 1)),
                  (size_t)nparams(&g) * sizeof(float)));
    rig_close(&g);
}

/* Devices that do not exist, GPUs without the CUDA plugin, unknown ops. */
static void test_bad_devices_and_ops(void)
{
    struct {
        const char *sets[3];
        int         code;
        const char *msg;
    } cases[] = {
        {{"strategy.type=mirrored", "strategy.devices=[\"cpu:0\", \"cpu:4095\"]"}, LOOM_ECONFIG,
         "device \"cpu:4095\" does not exist: this machine has cpu:0 to cpu:"},
        {{"strategy.type=mirrored", "strategy.devices=[\"gpu:*\"]"}, LOOM_ECONFIG,
         "device \"gpu:*\" is not usable: no GPU backend: the cuda plugin is not loaded"},
        {{"strategy.type=central_storage", "strategy.devices=[\"gpu:0\", \"gpu:1\"]"}, LOOM_ECONFIG,
         "device \"gpu:0\" is not usable: "},
        {{"strategy.type=mirrored", "strategy.replicas=2", "strategy.cross_device_ops=\"nccl_x\""}, LOOM_ECONFIG,
         "unknown cross-device op \"nccl_x\" (available: reduce_to_one_device"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        rig g;
        int n = cases[i].sets[2] ? 3 : 2;
        int rc = rig_open(&g, cases[i].sets, n);
        CHECK_MSG(rc == cases[i].code, "case %zu: rc %d (%s)", i, rc, err.msg);
        CHECK_CONTAINS(err.msg, cases[i].msg);
        CHECK_CONTAINS(err.where, "--set strategy."); /* the setting that named it */
        rig_close(&g);
    }
}

/* multi_worker_mirrored with one worker (no cluster: TF's MWMS without
 * TF_CONFIG) runs mirrored's replicas: it matches one_device, including the
 * 1-example last batch (the losses over the global batch, rescaled by 63 / 1
 * for that step). */
static void test_multi_worker_alone_matches_one_device(void)
{
    const char *base[] = {"data.train.transforms.[2].size=63"};
    const char *mw[] = {"strategy.type=multi_worker_mirrored", "strategy.replicas=3"};
    match_one_device(mw, 2, base, 1, 70);
}

/* The version-2 descriptions, and their defaults for a version-1 strategy
 * (a plugin built before them): no kind switch in the trainer needs them. */
static loom_strategy_ops v1_ops;
static void test_strategies_describe_themselves(void)
{
    const char *od[] = {"strategy.type=one_device"};
    const char *mw[] = {"strategy.type=multi_worker_mirrored", "strategy.replicas=2"};
    rig g;
    char buf[200];
    if (rig_open_ok(&g, od, 1)) {
        CHECK(!strcmp(loom_strategy_where(g.s, buf, sizeof buf), "cpu:0"));
        CHECK(loom_strategy_caps(g.s) & LOOM_STRATEGY_OWN_THREADS);
        CHECK(loom_strategy_is_chief(g.s) && !loom_strategy_request_stop(g.s));
        rig_close(&g);
    }
    if (rig_open_ok(&g, mw, 2)) {
        CHECK_CONTAINS(loom_strategy_where(g.s, buf, sizeof buf), "1 worker x 2 replicas (multi_worker_mirrored");
        loom_input_ctx ic;
        CHECK(loom_strategy_input_context(&g.args, &ic, &err) == LOOM_OK);
        CHECK(ic.num_input_pipelines == 1 && ic.input_pipeline_id == 0 && ic.num_replicas_in_sync == 2);
        CHECK(loom_strategy_is_chief(g.s));
        CHECK(loom_strategy_request_stop(g.s) && !loom_strategy_stop_agreed(g.s)); /* carried by the next step */
        CHECK(train(&g, 1, NULL) == LOOM_OK && loom_strategy_stop_agreed(g.s));
        loom_buf mine, stored, back;
        loom_buf_init(&mine);
        loom_buf_put_u32(&mine, 1234);
        CHECK(loom_strategy_gather_iter_state(g.s, &mine, &stored, &err) == LOOM_OK && stored.len == mine.len);
        CHECK(loom_strategy_pick_iter_state(g.s, &stored, &back, &err) == LOOM_OK && back.len == 4 &&
              !memcmp(back.data, mine.data, 4));
        loom_buf_fini(&mine);
        loom_buf_fini(&stored);
        loom_buf_fini(&back);
        rig_close(&g);
    }
    /* mirrored's vtable as a version-1 plugin would register it */
    v1_ops = *loom_find_strategy("mirrored");
    v1_ops.version = 1;
    v1_ops.name = "mirrored_v1";
    memset(&v1_ops.caps, 0, sizeof v1_ops - offsetof(loom_strategy_ops, caps)); /* fields it never had */
    CHECK(loom_register_strategy(&v1_ops, &err) == LOOM_OK);
    const char *v1[] = {"strategy.type=\"mirrored_v1\"", "strategy.replicas=2"};
    if (rig_open_ok(&g, v1, 2)) {
        CHECK(!strcmp(loom_strategy_where(g.s, buf, sizeof buf), "2 mirrored_v1 replicas, each"));
        CHECK(loom_strategy_caps(g.s) == 0 && loom_strategy_is_chief(g.s) && !loom_strategy_request_stop(g.s));
        loom_input_ctx ic = {.num_input_pipelines = 7};
        CHECK(loom_strategy_input_context(&g.args, &ic, &err) == LOOM_OK && ic.num_input_pipelines == 0);
        bool all = false;
        loom_step_result res;
        CHECK(loom_strategy_end_of_data(g.s, 0, &res, &all, &err) == LOOM_OK && all);
        char *text = NULL;
        size_t len = 0;
        FILE *f = open_memstream(&text, &len);
        loom_strategy_print_plan(g.s, 64, f);
        fclose(f);
        CHECK_CONTAINS(text, "strategy: mirrored_v1 (from built-in), 2 replicas, global batch 64");
        free(text);
        rig_close(&g);
    }
}

/* A strategy's input context may give a pipeline a seed of its own
 * (seed_key): parameter_server gives each worker its own (the trainer no
 * longer asks which strategy runs); the chief and one_device use the run's. */
static void test_pipeline_seed_from_the_strategy(void)
{
    const char *od[] = {"strategy.type=one_device"};
    rig g;
    if (!rig_open_ok(&g, od, 1)) return;
    loom_input_ctx ic;
    CHECK(loom_strategy_input_context(&g.args, &ic, &err) == LOOM_OK && ic.seed_key == 0);
    snprintf(g.spec->strategy.name, sizeof g.spec->strategy.name, "parameter_server");
    loom_cluster c = {.role = LOOM_ROLE_WORKER, .index = 1};
    loom_strategy_args a = g.args;
    a.cluster = &c;
    CHECK(loom_strategy_input_context(&a, &ic, &err) == LOOM_OK);
    CHECK(ic.seed_key == 0x7073776bu + 1 && ic.num_input_pipelines == 0); /* its own seed, not sharded */
    c.index = 0;
    CHECK(loom_strategy_input_context(&a, &ic, &err) == LOOM_OK && ic.seed_key == 0x7073776bu);
    c.role = LOOM_ROLE_CHIEF;
    CHECK(loom_strategy_input_context(&a, &ic, &err) == LOOM_OK && ic.seed_key == 0);
    snprintf(g.spec->strategy.name, sizeof g.spec->strategy.name, "one_device");
    rig_close(&g);
}

static const loom_test tests[] = {
    {"mirrored_matches_one_device", test_mirrored_matches_one_device},
    {"central_storage_matches_one_device", test_central_storage_matches_one_device},
    {"uneven_and_empty_shares", test_uneven_and_empty_shares},
    {"replicas_bit_equal", test_replicas_bit_equal},
    {"runs_bit_identical", test_runs_bit_identical},
    {"every_cross_device_op", test_every_cross_device_op},
    {"eval_and_predict", test_eval_and_predict},
    {"sync_after_restore", test_sync_after_restore},
    {"lr_override_reaches_replicas", test_lr_override_reaches_replicas},
    {"bad_devices_and_ops", test_bad_devices_and_ops},
    {"multi_worker_alone_matches_one_device", test_multi_worker_alone_matches_one_device},
    {"strategies_describe_themselves", test_strategies_describe_themselves},
    {"pipeline_seed_from_the_strategy", test_pipeline_seed_from_the_strategy},
    {0},
};

int main(void)
{
    loom_log_set_level(LOOM_LOG_WARN);
    if (loom_blas_init(1, &err)) {
        printf("# loom_blas_init: %s\n", err.msg);
        return 1;
    }
    return loom_test_run(tests);
}
