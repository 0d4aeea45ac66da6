/* test_model_cuda.c - training on a GPU through the strategies against the
 * host path: one_device on gpu:0, and mirrored and central_storage on gpu:0
 * and gpu:1 when there are two, train 30 steps of the MLP (tests/configs/strategy_mlp.cfg) and the
 * CNN with every layer kind (device_cnn.cfg) on real Fashion-MNIST and end
 * within 1e-4 (relative, whole buffer) of nn's native weights; evaluate
 * agrees. On two GPUs mirrored and central_storage also run with their
 * gradients reduced in device memory by the nccl op (LOOM_BUILD_ROOT/
 * plugins/nccl.so). The backend is the cuda plugin (LOOM_BUILD_ROOT/plugins/cuda.so);
 * without a usable GPU the test exits 77 (skip) saying why. With
 * LOOM_DEVICE_UNDER_TEST=cpu the same runs go through the CPU reference
 * backend (strategy.device_backend = "cpu"), which checks this test's own
 * plumbing on machines without a GPU, and the device-memory reduction uses
 * the dev_mem_sum fixture (LOOM_BUILD_ROOT/tests/plugins) instead of nccl. */
#include "harness.h"
#include "test_util.h"
#include "plugin/plugin.h"
#include "train/train.h"

#include <math.h>

static loom_err err;
static int use_cpu; /* LOOM_DEVICE_UNDER_TEST=cpu */
static int gpus;
static const char *dev_op; /* the op of device memory loaded ("nccl", "dev_mem_sum"); NULL: none */

typedef struct rig {
    loom_spec         *spec;
    loom_iter         *train;
    loom_strategy_args args;
    loom_strategy     *s;
    int64_t            epoch;
} rig;

static void rig_close(rig *g)
{
    loom_strategy_close(g->s);
    loom_iter_close(g->train);
    loom_config_free(g->spec);
    memset(g, 0, sizeof *g);
}

static int rig_open(rig *g, const char *cfg, const char *const *sets, int n_sets)
{
    memset(g, 0, sizeof *g);
    int rc = train_pipeline_open(&g->spec, &g->train, cfg, sets, n_sets, &err);
    if (rc) return rc;
    const loom_elem_spec *es = loom_iter_spec(g->train);
    g->args = (loom_strategy_args){.spec = g->spec, .input = es, .input_idx = loom_elem_spec_find(es, "image"),
                                   .label_idx = loom_elem_spec_find(es, "label"), .max_batch = 64};
    return loom_strategy_open(&g->s, &g->args, &err);
}

/* Trains steps steps; the last batch stays in *last (borrowed until the next). */
static int train(rig *g, int steps, loom_elem **last)
{
    for (int i = 0; i < steps; i++) {
        int rc = loom_iter_next(g->train, last, &err);
        if (rc == LOOM_EEOF && !(rc = loom_iter_rewind(g->train, ++g->epoch, &err)))
            rc = loom_iter_next(g->train, last, &err);
        loom_step_result res;
        if (rc || (rc = loom_strategy_train_step(g->s, *last, i, &res, &err))) return rc;
    }
    return LOOM_OK;
}

/* The strategy of `sets` natively and on the device under test (extra). */
static void compare(const char *cfg, const char *const *sets, int n_sets, const char *const *extra, int n_extra)
{
    const char *all[8];
    for (int i = 0; i < n_sets; i++) all[i] = sets[i];
    for (int i = 0; i < n_extra; i++) all[n_sets + i] = extra[i];
    rig a, b;
    int ra = rig_open(&a, cfg, sets, n_sets);
    CHECK_MSG(ra == LOOM_OK, "native: %s: %s", err.where, err.msg);
    int rb = ra ? ra : rig_open(&b, cfg, all, n_sets + n_extra);
    CHECK_MSG(rb == LOOM_OK, "device: %s: %s", err.where, err.msg);
    loom_elem *la = NULL, *lb = NULL;
    if (!ra && !rb) {
        CHECK_MSG(train(&a, 30, &la) == LOOM_OK, "%s", err.msg);
        CHECK_MSG(train(&b, 30, &lb) == LOOM_OK, "%s", err.msg);
        loom_model *ma = loom_strategy_model(a.s), *mb = loom_strategy_model(b.s);
        double r = rel_diff(loom_model_params(ma), loom_model_params(mb), loom_model_num_params(ma));
        CHECK_MSG(r <= 1e-4, "%s: weights after 30 steps differ by %g", cfg, r);
        printf("# %s, %s%s%s: weights %.2g apart after 30 steps\n", cfg, n_sets ? sets[0] : "one_device",
               n_extra > 1 ? ", " : "", n_extra > 1 ? extra[1] : "", r);
        loom_step_result ea, eb;
        CHECK(loom_strategy_eval_step(a.s, la, &ea, &err) == LOOM_OK);
        CHECK(loom_strategy_eval_step(b.s, lb, &eb, &err) == LOOM_OK);
        CHECK_NEAR(eb.loss_sum, ea.loss_sum, 1e-4 * fabs(ea.loss_sum));
    }
    if (!ra) rig_close(&a);
    if (!ra && !rb) rig_close(&b);
}

static void run(const char *cfg)
{
    const char *dev_cpu[] = {"strategy.device_backend=\"cpu\""}, *one_gpu[] = {"strategy.device=\"gpu:0\""};
    compare(cfg, NULL, 0, use_cpu ? dev_cpu : one_gpu, 1);
    const char *two_gpus[] = {"strategy.devices=[\"gpu:0\", \"gpu:1\"]"};
    for (int central = 0; central < 2; central++) {
        const char *rep[] = {central ? "strategy.type=central_storage" : "strategy.type=mirrored",
                             "strategy.replicas=2"};
        if (use_cpu) compare(cfg, rep, 2, dev_cpu, 1);
        else if (gpus >= 2) compare(cfg, rep, 2, two_gpus, 1);
        else printf("# %s on two GPUs: skipped, one GPU\n", rep[0]);
        /* the gradients reduced in device memory */
        char op[64];
        snprintf(op, sizeof op, "strategy.cross_device_ops=\"%s\"", dev_op ? dev_op : "");
        const char *dev_cpu_op[] = {dev_cpu[0], op}, *two_gpus_op[] = {two_gpus[0], op};
        if (!dev_op) printf("# %s, gradients in device memory: skipped, no op of device memory loaded\n", rep[0]);
        else if (use_cpu) compare(cfg, rep, 2, dev_cpu_op, 2);
        else if (gpus >= 2) compare(cfg, rep, 2, two_gpus_op, 2);
    }
}

static void test_mlp(void) { run("strategy_mlp.cfg"); }
static void test_cnn(void) { run("device_cnn.cfg"); }

static const loom_test tests[] = {
    {"mlp", test_mlp},
    {"cnn", test_cnn},
    {0},
};

int main(void)
{
    const char *which = getenv("LOOM_DEVICE_UNDER_TEST"), *root = getenv("LOOM_BUILD_ROOT");
    if (loom_blas_init(1, &err)) {
        printf("Bail out! %s\n", err.msg);
        return 1;
    }
    use_cpu = which && !strcmp(which, "cpu");
    if (root) { /* the op of device memory, when built */
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", root, use_cpu ? "tests/plugins/dev_mem_sum.so" : "plugins/nccl.so");
        if (!loom_plugin_load_file(path, NULL, &err)) dev_op = use_cpu ? "dev_mem_sum" : "nccl";
        else printf("# %s: %s\n", path, err.msg);
    }
    if (!use_cpu) {
        char path[4096], why[600];
        snprintf(path, sizeof path, "%s/plugins/cuda.so", root ? root : "build");
        if (loom_plugin_load_file(path, NULL, &err)) {
            printf("1..0 # SKIP %s: %s\n", path, err.msg);
            return 77;
        }
        if ((gpus = loom_device_gpus(why, sizeof why)) == 0) {
            printf("1..0 # SKIP %s\n", why);
            return 77;
        }
    }
    return loom_test_run(tests);
}
