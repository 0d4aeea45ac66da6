/* test_config.c - the config module: a full good config, every golden
 * tests/configs/bad_*.cfg against its bad_*.expect, overrides, the error
 * limit, out-of-memory paths and the print -> load round trip. */
#include "harness.h"
#include "test_util.h"

#include "config/config.h"

#include <dirent.h>
#include <stdint.h>
#include <unistd.h>

static loom_spec *load_ok(const char *path, const char *const *ov, int n)
{
    loom_spec *s = NULL;
    loom_errlist errs;
    int rc = loom_config_load(&s, path, ov, n, &errs);
    char text[16384];
    errs_text(&errs, text, sizeof text);
    CHECK_MSG(rc == LOOM_OK && s, "loading %s: rc %d\n%s", path, rc, text);
    return s;
}

/* Loads expecting failure; returns the formatted errors (static buffer). */
static const char *load_fail(const char *path, const char *const *ov, int n, int *rc_out)
{
    static char text[16384];
    loom_spec *s = (loom_spec *)1;
    loom_errlist errs;
    int rc = loom_config_load(&s, path, ov, n, &errs);
    CHECK_MSG(rc != LOOM_OK, "%s loaded but should not have", path);
    CHECK(s == NULL);
    CHECK(errs.n >= 1);
    if (rc == LOOM_OK) loom_config_free(s);
    errs_text(&errs, text, sizeof text);
    if (rc_out) *rc_out = rc;
    return text;
}

static void test_good_full(void)
{
    loom_spec *s = load_ok(cfg_path("good_full.cfg"), NULL, 0);
    if (!s) return;
    CHECK(s->version == 1);
    /* data.train */
    const loom_dataset_spec *d = &s->train;
    CHECK(d->present);
    CHECK(d->source.kind == LOOM_SRC_CATALOG);
    CHECK(!strcmp(d->source.catalog.name, "fashion_mnist"));
    CHECK(!strcmp(d->source.catalog.split, "train"));
    CHECK(d->source.loc.line == 6);
    CHECK_CONTAINS(d->source.loc.file, "good_full.cfg");
    CHECK(!strcmp(d->source.loc.path, "data.train.source"));
    CHECK(d->n_transforms == 12);
    const loom_transform_spec *t = d->transform;
    CHECK(t[0].kind == LOOM_T_MAP && t[0].map.kind == LOOM_MAP_CAST && t[0].map.dtype == LOOM_CFG_F32);
    CHECK(!strcmp(t[0].map.feature, "image"));
    CHECK(t[0].loc.line == 8);
    CHECK(!strcmp(t[0].loc.path, "data.train.transforms.[0]"));
    CHECK(t[1].map.kind == LOOM_MAP_SCALE);
    CHECK_NEAR(t[1].map.scale, 1.0 / 255, 1e-15);
    CHECK(t[1].map.offset == 0.0);
    CHECK(t[2].map.kind == LOOM_MAP_NORMALIZE);
    CHECK_NEAR(t[2].map.mean, 0.2860, 1e-15);
    CHECK_NEAR(t[2].map.std, 0.3530, 1e-15);
    CHECK(t[3].map.kind == LOOM_MAP_RESHAPE && t[3].map.rank == 3);
    CHECK(t[3].map.shape[0] == 28 && t[3].map.shape[1] == 28 && t[3].map.shape[2] == 1);
    CHECK(t[4].map.kind == LOOM_MAP_FLIP_LR);
    CHECK(t[5].map.kind == LOOM_MAP_ONE_HOT && t[5].map.depth == 10 && !strcmp(t[5].map.feature, "label"));
    CHECK(t[6].kind == LOOM_T_SKIP && t[6].count == 10);
    CHECK(t[7].kind == LOOM_T_TAKE && t[7].count == -1);
    CHECK(t[8].kind == LOOM_T_SHUFFLE && t[8].buffer == 10000 && t[8].reshuffle && !t[8].seed_set);
    CHECK(t[8].seed == 1234); /* the run's seed */
    CHECK(t[9].kind == LOOM_T_REPEAT && t[9].count == -1);
    CHECK(t[10].kind == LOOM_T_BATCH && t[10].batch_size == 64 && t[10].drop_remainder);
    CHECK(t[11].kind == LOOM_T_PREFETCH && t[11].buffer == 2);
    /* data.eval */
    d = &s->eval;
    CHECK(d->present && d->n_transforms == 4);
    CHECK(!strcmp(d->source.catalog.split, "test"));
    CHECK(d->transform[1].seed_set && d->transform[1].seed == 7 && !d->transform[1].reshuffle);
    CHECK(d->transform[2].batch_size == 256 && !d->transform[2].drop_remainder);
    CHECK(d->transform[3].kind == LOOM_T_PREFETCH && d->transform[3].buffer == -1);
    /* model */
    const loom_model_spec *m = &s->model;
    CHECK(!strcmp(m->input, "image") && !strcmp(m->label, "label"));
    CHECK(m->loss == LOOM_LOSS_MSE);
    CHECK(m->n_layers == 9);
    const loom_layer_spec *l = m->layer;
    CHECK(l[0].kind == LOOM_LAYER_CONV2D && l[0].filters == 32 && l[0].kernel[0] == 3 && l[0].kernel[1] == 3);
    CHECK(l[0].stride[0] == 1 && l[0].stride[1] == 1 && l[0].padding == LOOM_PAD_SAME);
    CHECK(l[0].activation == LOOM_ACT_RELU && l[0].kernel_init == LOOM_INIT_HE_NORMAL && l[0].use_bias);
    CHECK(!strcmp(l[0].name, "conv2d_0"));
    CHECK(l[1].kind == LOOM_LAYER_MAX_POOL2D && l[1].pool[0] == 2 && l[1].pool[1] == 2);
    CHECK(l[1].stride[0] == 2 && l[1].stride[1] == 2 && l[1].padding == LOOM_PAD_VALID);
    CHECK(!strcmp(l[1].name, "max_pool2d_1"));
    CHECK(l[2].kernel[0] == 5 && l[2].kernel[1] == 3 && l[2].stride[0] == 2 && l[2].stride[1] == 1);
    CHECK(!l[2].use_bias && l[2].activation == LOOM_ACT_NONE && l[2].kernel_init == LOOM_INIT_GLOROT_UNIFORM);
    CHECK(l[3].pool[0] == 3 && l[3].stride[0] == 1 && l[3].padding == LOOM_PAD_SAME);
    CHECK(l[4].kind == LOOM_LAYER_ACTIVATION && l[4].activation == LOOM_ACT_TANH);
    CHECK(l[5].kind == LOOM_LAYER_FLATTEN && !strcmp(l[5].name, "flatten_5"));
    CHECK(l[6].kind == LOOM_LAYER_DROPOUT && l[6].rate == 0.25);
    CHECK(l[7].kind == LOOM_LAYER_DENSE && l[7].units == 128 && !strcmp(l[7].name, "hidden"));
    CHECK(l[8].units == 10 && l[8].activation == LOOM_ACT_SOFTMAX && !strcmp(l[8].name, "dense_8"));
    CHECK(l[8].loc.line == 44 && !strcmp(l[8].loc.path, "model.layers.[8]"));
    /* optimizer */
    const loom_optimizer_spec *o = &s->optimizer;
    CHECK(o->kind == LOOM_OPT_MOMENTUM && o->learning_rate == 0.1 && o->momentum == 0.8 && o->nesterov);
    CHECK(o->schedule.kind == LOOM_SCHED_PIECEWISE_CONSTANT && o->schedule.n_boundaries == 2);
    CHECK(o->schedule.boundaries[0] == 1000 && o->schedule.boundaries[1] == 2000);
    CHECK(o->schedule.values[0] == 0.1 && o->schedule.values[1] == 0.01 && o->schedule.values[2] == 0.001);
    CHECK(!strcmp(o->schedule.loc.path, "optimizer.schedule") && o->schedule.loc.line == 53);
    /* strategy, run */
    CHECK(s->strategy.kind == LOOM_STRAT_ONE_DEVICE && !strcmp(s->strategy.device, "cpu:0"));
    const loom_run_spec *r = &s->run;
    /* relative to the config file's directory, like every path a config holds */
    size_t ml = strlen(r->model_dir), sl = strlen("/tests/configs/runs/fashion");
    CHECK(r->model_dir[0] == '/' && ml > sl && !strcmp(r->model_dir + ml - sl, "/tests/configs/runs/fashion"));
    CHECK(r->epochs == 3 && r->max_steps == 5000000000LL && r->seed == 1234);
    CHECK(r->checkpoint_steps == 500 && r->keep_checkpoints == 3 && r->log_steps == 50 && r->threads == 2);
    CHECK(r->eval_each_epoch && r->progress == LOOM_PROGRESS_PLAIN);
    char buf[600];
    CHECK_CONTAINS(loom_loc_str(&r->loc, buf, sizeof buf), "good_full.cfg:58");
    loom_config_free(s);
}

static void test_defaults(void)
{
    loom_spec *s = load_ok(cfg_path("good_minimal.cfg"), NULL, 0);
    if (!s) return;
    CHECK(s->train.source.kind == LOOM_SRC_IDX && s->train.source.n_features == 2);
    CHECK(!strcmp(s->train.source.feature[0], "image") && !strcmp(s->train.source.feature[1], "label"));
    CHECK(s->train.source.idx.file[0][0] == '/'); /* resolved against the config's directory */
    CHECK_CONTAINS(s->train.source.idx.file[0], "tests/configs/data/tiny-images-idx3-ubyte");
    CHECK(access(s->train.source.idx.file[1], R_OK) == 0);
    CHECK(!s->eval.present);
    CHECK(s->train.transform[0].buffer == 3 && s->train.transform[0].reshuffle && s->train.transform[0].seed == 42);
    CHECK(!s->train.transform[1].drop_remainder);
    CHECK(!strcmp(s->model.input, "image") && !strcmp(s->model.label, "label"));
    CHECK(s->model.loss == LOOM_LOSS_SPARSE_SOFTMAX_CE);
    const loom_layer_spec *d = &s->model.layer[1];
    CHECK(d->activation == LOOM_ACT_NONE && d->kernel_init == LOOM_INIT_GLOROT_UNIFORM && d->use_bias);
    CHECK(!strcmp(d->name, "dense_1"));
    const loom_optimizer_spec *o = &s->optimizer;
    CHECK(o->kind == LOOM_OPT_ADAM && o->learning_rate == 1.0); /* an int where a float is expected */
    CHECK(o->beta1 == 0.9 && o->beta2 == 0.999 && o->epsilon == 1e-7);
    CHECK(o->schedule.kind == LOOM_SCHED_CONSTANT);
    CHECK(s->strategy.kind == LOOM_STRAT_ONE_DEVICE && !strcmp(s->strategy.device, "cpu:0"));
    const loom_run_spec *r = &s->run;
    CHECK(r->epochs == 1 && r->max_steps == 0 && r->seed == 42 && r->checkpoint_steps == 0);
    CHECK(r->keep_checkpoints == 5 && r->log_steps == 100 && r->threads == 0);
    CHECK(!r->eval_each_epoch); /* no data.eval */
    CHECK(r->progress == LOOM_PROGRESS_AUTO);
    loom_config_free(s);
}

/* Every bad_*.cfg fails, and every line of its bad_*.expect appears in the errors. */
static void test_bad_fixtures(void)
{
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", cfg_path(""));
    DIR *dh = opendir(dir);
    CHECK_MSG(dh != NULL, "cannot open %s", dir);
    if (!dh) return;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(dh))) {
        size_t len = strlen(de->d_name);
        if (strncmp(de->d_name, "bad_", 4) || len < 8 || strcmp(de->d_name + len - 4, ".cfg")) continue;
        n++;
        char cfg[1400], exp[1400];
        snprintf(cfg, sizeof cfg, "%s%s", dir, de->d_name);
        snprintf(exp, sizeof exp, "%s%.*s.expect", dir, (int)(len - 4), de->d_name);
        int rc = 0;
        const char *text = load_fail(cfg, NULL, 0, &rc);
        CHECK_MSG(rc == LOOM_ECONFIG, "%s: rc %d", de->d_name, rc);
        FILE *f = fopen(exp, "r");
        CHECK_MSG(f != NULL, "%s has no .expect file", de->d_name);
        if (!f) continue;
        char line[1024];
        int lines = 0;
        while (fgets(line, sizeof line, f)) {
            line[strcspn(line, "\n")] = 0;
            if (!line[0]) continue;
            lines++;
            CHECK_MSG(strstr(text, line) != NULL, "%s: expected\n#   %s\n# in\n%s", de->d_name, line, text);
        }
        fclose(f);
        CHECK_MSG(lines > 0, "%s is empty", exp);
    }
    closedir(dh);
    CHECK(n >= 10);
}

static void test_unreadable(void)
{
    int rc = 0;
    const char *text = load_fail(cfg_path("no_such_config.cfg"), NULL, 0, &rc);
    CHECK(rc == LOOM_EIO);
    CHECK_CONTAINS(text, "no_such_config.cfg: cannot read the config file: No such file or directory");
}

/* A config with 30 problems reports the first 20. */
static void test_error_limit(void)
{
    char path[] = "/tmp/loom_test_config_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    if (fd < 0) return;
    FILE *f = fdopen(fd, "w");
    fprintf(f, "version = 1;\nrun: {\n  model_dir = \"x\";\n");
    for (int i = 0; i < 30; i++) fprintf(f, "  bogus_%d = %d;\n", i, i);
    fprintf(f, "};\n");
    fclose(f);
    loom_spec *s = NULL;
    loom_errlist errs;
    int rc = loom_config_load(&s, path, NULL, 0, &errs);
    CHECK(rc == LOOM_ECONFIG && !s);
    CHECK(errs.n == LOOM_MAX_ERRORS);
    CHECK_CONTAINS(errs.e[0].msg, "missing required setting `data`"); /* at the file: no line */
    CHECK_CONTAINS(errs.e[3].msg, "run.bogus_0: unknown setting `bogus_0`");
    CHECK_CONTAINS(errs.e[3].where, ":4");
    CHECK_CONTAINS(errs.e[19].msg, "bogus_16");
    unlink(path);
}

static void test_overrides(void)
{
    const char *good[] = {
        "run.epochs=5",
        "optimizer.learning_rate=0.5",
        "strategy.type=one_device",               /* bare string */
        "run.model_dir=/tmp/loom-runs/x",         /* bare string with slashes */
        "model.input=\"pixels\"",                 /* quoted string */
        "data.train.transforms.[10].size=32",     /* list index */
        "model.layers.[8].units=7",
        "run.checkpoint_steps=7L",                /* int64 */
        "data.eval.transforms.[1].seed=99",
        "optimizer.schedule.boundaries.[1]=3000", /* array element */
        "optimizer.schedule.values.[0]=1",        /* int into a float array */
        "strategy.device=cpu:1",
    };
    loom_spec *s = load_ok(cfg_path("good_full.cfg"), good, (int)(sizeof good / sizeof *good));
    if (s) {
        CHECK(s->run.epochs == 5);
        CHECK(s->optimizer.learning_rate == 0.5);
        CHECK(s->strategy.kind == LOOM_STRAT_ONE_DEVICE && !strcmp(s->strategy.device, "cpu:1"));
        CHECK(!strcmp(s->run.model_dir, "/tmp/loom-runs/x"));
        CHECK(!strcmp(s->model.input, "pixels"));
        CHECK(s->train.transform[10].batch_size == 32 && s->train.transform[10].drop_remainder);
        CHECK(s->model.layer[8].units == 7);
        CHECK(s->run.checkpoint_steps == 7);
        CHECK(s->eval.transform[1].seed == 99);
        CHECK(s->optimizer.schedule.boundaries[1] == 3000);
        CHECK(s->optimizer.schedule.values[0] == 1.0);
        loom_config_free(s);
    }

    /* creating missing keys and groups */
    const char *create[] = {
        "run.max_steps=10",
        "optimizer.schedule.type=cosine",
        "optimizer.schedule.decay_steps=100",
        "data.eval.source={ type = \"catalog\"; name = \"mnist\"; split = \"test\"; }",
        "strategy.type=\"one_device\"",
    };
    s = load_ok(cfg_path("good_minimal.cfg"), create, 5);
    if (s) {
        CHECK(s->run.max_steps == 10);
        CHECK(s->optimizer.schedule.kind == LOOM_SCHED_COSINE && s->optimizer.schedule.decay_steps == 100);
        CHECK(s->optimizer.schedule.alpha == 0.0);
        CHECK(s->eval.present && s->eval.source.kind == LOOM_SRC_CATALOG &&
              !strcmp(s->eval.source.catalog.name, "mnist"));
        CHECK(s->eval.n_transforms == 0);
        CHECK(s->run.eval_each_epoch);
        CHECK_CONTAINS(s->optimizer.schedule.loc.file, "--set optimizer.schedule.type");
        loom_config_free(s);
    }

    /* errors name --set */
    const char *bad[] = {
        "run.epochs=abc",
        "run.epocs=3",
        "data.train.transforms.[7].count=-5",
        "model.layers.[20].units=3",
        "run.epochs",
        "optimizer.type=adamax",
        "run.model_dir.x=1",
    };
    int rc = 0;
    const char *text = load_fail(cfg_path("good_full.cfg"), bad, 7, &rc);
    CHECK(rc == LOOM_ECONFIG);
    CHECK_CONTAINS(text, "--set run.epochs: expected an integer >= 0, got \"abc\"");
    CHECK_CONTAINS(text, "--set run.epocs: unknown setting `epocs` (did you mean `epochs`?)");
    CHECK_CONTAINS(text, "--set data.train.transforms.[7].count: expected an integer >= -1, got -5");
    CHECK_CONTAINS(text, "--set model.layers.[20].units: index [20] is out of range (the list has 9 elements)");
    CHECK_CONTAINS(text, "--set run.epochs: expected key=value, got \"run.epochs\"");
    CHECK_CONTAINS(text, "--set optimizer.type: unknown value \"adamax\"");
    CHECK_CONTAINS(text, "--set run.model_dir.x: model_dir is not a group");
}

/* Every field but the locations and the path. */
static void strip_locs(loom_spec *s)
{
    memset(s->path, 0, sizeof s->path);
    loom_dataset_spec *ds[2] = {&s->train, &s->eval};
    for (int i = 0; i < 2; i++) {
        memset(&ds[i]->loc, 0, sizeof ds[i]->loc);
        memset(&ds[i]->source.loc, 0, sizeof ds[i]->source.loc);
        memset(&ds[i]->options.loc, 0, sizeof ds[i]->options.loc);
        for (int j = 0; j < LOOM_MAX_TRANSFORMS; j++) memset(&ds[i]->transform[j].loc, 0, sizeof(loom_loc));
    }
    memset(&s->model.loc, 0, sizeof(loom_loc));
    memset(&s->model.metrics_loc, 0, sizeof(loom_loc));
    for (int j = 0; j < LOOM_MAX_LAYERS; j++) memset(&s->model.layer[j].loc, 0, sizeof(loom_loc));
    memset(&s->optimizer.loc, 0, sizeof(loom_loc));
    memset(&s->optimizer.schedule.loc, 0, sizeof(loom_loc));
    memset(&s->strategy.loc, 0, sizeof(loom_loc));
    memset(&s->strategy.device_loc, 0, sizeof(loom_loc));
    memset(&s->strategy.device_backend_loc, 0, sizeof(loom_loc));
    memset(&s->strategy.devices_loc, 0, sizeof(loom_loc));
    memset(&s->strategy.cross_device_ops_loc, 0, sizeof(loom_loc));
    memset(&s->strategy.communication_loc, 0, sizeof(loom_loc));
    memset(&s->strategy.collective_timeout_loc, 0, sizeof(loom_loc));
    memset(&s->strategy.compression_loc, 0, sizeof(loom_loc));
    memset(&s->run.loc, 0, sizeof(loom_loc));
    memset(&s->plugins.loc, 0, sizeof(loom_loc));
    memset(&s->cluster.loc, 0, sizeof(loom_loc));
    memset(s->cluster.role_loc, 0, sizeof s->cluster.role_loc);
    memset(s->cluster.addr_line, 0, sizeof s->cluster.addr_line);
}

static void roundtrip(const char *name, const char *const *ov, int n)
{
    loom_spec *a = load_ok(cfg_path(name), ov, n);
    if (!a) return;
    char path[] = "/tmp/loom_test_print_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    FILE *f = fdopen(fd, "w");
    loom_config_print(a, f);
    fclose(f);
    loom_spec *b = load_ok(path, NULL, 0);
    if (b) {
        CHECK(b->model.n_layers == a->model.n_layers && b->train.n_transforms == a->train.n_transforms);
        CHECK(!strcmp(b->train.source.idx.file[0], a->train.source.idx.file[0]));
        strip_locs(a);
        strip_locs(b);
        CHECK_MSG(memcmp(a, b, sizeof *a) == 0, "%s: printed config loads back different", name);
        if (memcmp(a, b, sizeof *a)) {
            loom_config_print(a, stdout);
            loom_config_print(b, stdout);
        }
        loom_config_free(b);
    } else {
        FILE *g = fopen(path, "r");
        char line[512];
        while (g && fgets(line, sizeof line, g)) printf("# %s", line);
        if (g) fclose(g);
    }
    unlink(path);
    loom_config_free(a);
}

static void test_print_roundtrip(void)
{
    roundtrip("good_full.cfg", NULL, 0);
    roundtrip("good_minimal.cfg", NULL, 0);
    const char *ov[] = {"optimizer.type=momentum", "optimizer.schedule={ type = \"exponential_decay\"; decay_steps = 10; "
                                                   "decay_rate = 0.96; staircase = true; }",
                        "model.input=\"a \\\"quoted\\\" name\"", "run.seed=9000000000"};
    roundtrip("good_minimal.cfg", ov, 4);
    const char *dev[] = {"strategy.device=\"gpu:1\"", "strategy.device_backend=cpu"};
    roundtrip("good_minimal.cfg", dev, 2);
    const char *timeout[] = {"strategy.type=mirrored", "strategy.replicas=2", "strategy.collective_timeout=0.3"};
    roundtrip("good_minimal.cfg", timeout, 3);
    const char *cluster[] = {"strategy.type=multi_worker_mirrored", "strategy.replicas=2",
                             "cluster.chief=[\"127.0.0.1:2222\"]", "cluster.worker=[\"127.0.0.1:2223\", \"[::1]:2224\"]",
                             "cluster.heartbeat_timeout=5", "cluster.port_base=9000", "cluster.insecure=true"};
    roundtrip("good_minimal.cfg", cluster, 7);
    const char *comp[] = {"strategy.type=multi_worker_mirrored", "strategy.compression=fp16",
                          "strategy.compression_error_feedback=true"};
    roundtrip("good_minimal.cfg", comp, 3);
}

static void test_include(void)
{
    loom_spec *s = load_ok(cfg_path("good_include.cfg"), NULL, 0);
    if (!s) return;
    CHECK(s->train.source.kind == LOOM_SRC_IDX && s->train.source.n_features == 2);
    CHECK_CONTAINS(s->train.source.idx.file[0], "tests/configs/data/tiny-images-idx3-ubyte");
    CHECK_CONTAINS(s->train.source.loc.file, "tests/configs/include/data.cfg");
    CHECK(s->train.source.loc.line == 3);
    CHECK(s->model.layer[0].loc.line == 3);
    loom_config_free(s);
}

/* Integers past 32 bits keep the value written, in the file and in --set
 * (libconfig 1.5 reads 4294967297 as 1); past 64 bits, or past a setting's
 * range, they are refused with the range; one assignment per --set. */
static void test_wide_ints(void)
{
    char path[] = "/tmp/loom_test_wide_XXXXXX.cfg";
    int fd = mkstemps(path, 4);
    CHECK(fd >= 0);
    if (fd < 0) return;
    const char *text = "version = 1;\n"
                       "# 99999999999999999999 in a comment, \"4294967297\" in a string\n"
                       "data: { train: { source: { type = \"catalog\"; name = \"fashion_mnist\"; split = \"train\"; }; }; };\n"
                       "model: { layers = ( { type = \"flatten\"; }, { type = \"dense\"; units = 10; } ); };\n"
                       "optimizer: { type = \"sgd\"; learning_rate = 1.5e3; };\n"
                       "run: { model_dir = \"runs/x\"; max_steps = 5000000000; checkpoint_steps = 0x100000001;\n"
                       "       seed = 4294967297; log_steps = 2147483648; eval_steps = 7L; };\n";
    CHECK(write(fd, text, strlen(text)) == (ssize_t)strlen(text));
    close(fd);
    loom_spec *s = load_ok(path, NULL, 0);
    if (s) {
        CHECK(s->run.max_steps == 5000000000LL);
        CHECK(s->run.checkpoint_steps == 4294967297LL);
        CHECK(s->run.seed == 4294967297ULL);
        CHECK(s->run.log_steps == 2147483648LL);
        CHECK(s->run.eval_steps == 7);
        loom_config_free(s);
    }
    const char *ov[] = {"run.max_steps=4294967297", "run.seed=0"};
    s = load_ok(path, ov, 2);
    if (s) {
        CHECK(s->run.max_steps == 4294967297LL);
        loom_config_free(s);
    }
    const char *bad[] = {
        "run.max_steps=99999999999999999999999",
        "run.keep_checkpoints=4294967297",
        "run.epochs=3; version=2",
        "run.threads=5000000000",
    };
    int rc = 0;
    const char *t = load_fail(path, bad, 4, &rc);
    CHECK(rc == LOOM_ECONFIG);
    CHECK_CONTAINS(t, "--set run.max_steps: expected an integer >= 0, got 99999999999999999999999 (beyond the 64-bit range)");
    CHECK_CONTAINS(t, "--set run.keep_checkpoints: expected an integer in [1, 2147483647], got 4294967297");
    CHECK_CONTAINS(t, "--set run.epochs: one assignment per --set: the value is followed by another setting, `version`");
    CHECK_CONTAINS(t, "--set run.threads: expected an integer in [0, 4096], got 5000000000");
    unlink(path);
}

static void test_names(void)
{
    CHECK(!strcmp(loom_layer_kind_name(LOOM_LAYER_MAX_POOL2D), "max_pool2d"));
    CHECK(!strcmp(loom_activation_name(LOOM_ACT_SOFTMAX), "softmax"));
    CHECK(!strcmp(loom_strategy_kind_name(LOOM_STRAT_MULTI_WORKER_MIRRORED), "multi_worker_mirrored"));
    CHECK(!strcmp(loom_map_kind_name(LOOM_MAP_FLIP_LR), "random_flip_left_right"));
    CHECK(!strcmp(loom_transform_kind_name(LOOM_T_PREFETCH), "prefetch"));
    CHECK(!strcmp(loom_layer_kind_name((loom_layer_kind)99), "?"));
    loom_loc l = {.file = "a.cfg", .line = 3};
    char buf[64];
    CHECK(!strcmp(loom_loc_str(&l, buf, sizeof buf), "a.cfg:3"));
    l.line = 0;
    CHECK(!strcmp(loom_loc_str(&l, buf, sizeof buf), "a.cfg"));
    l.file[0] = 0;
    CHECK(!strcmp(loom_loc_str(&l, buf, sizeof buf), ""));
}

/* Every allocation failing in turn gives LOOM_ENOMEM (or success), never a crash or a leak. */
static void test_oom(void)
{
    const char *ov[] = {"run.epochs=2", "optimizer.schedule.type=cosine", "optimizer.schedule.decay_steps=5"};
    int nomem = 0;
    for (long k = 0; k < 20; k++) {
        loom_spec *s = NULL;
        loom_errlist errs;
        loom_alloc_fail_after(k);
        int rc = loom_config_load(&s, cfg_path("good_minimal.cfg"), ov, 3, &errs);
        loom_alloc_fail_after(-1);
        CHECK(rc == LOOM_OK || rc == LOOM_ENOMEM);
        CHECK((rc == LOOM_OK) == (s != NULL));
        nomem += rc == LOOM_ENOMEM;
        loom_config_free(s);
    }
    CHECK(nomem >= 3);
}

/* data.options: tf.data's defaults where they pay here, one group for both datasets, budgets in bytes or shares. */
static void test_data_options(void)
{
    loom_spec *s = load_ok(cfg_path("good_minimal.cfg"), NULL, 0);
    if (s) {
        const loom_data_options *o = &s->train.options;
        CHECK(o->present && o->deterministic && o->autotune && o->cpu_budget == 0 && o->ram_budget == 0);
        CHECK(o->ram_fraction == 0.5 && o->noop_elimination && o->map_and_batch_fusion && o->map_fusion);
        CHECK(o->shuffle_and_repeat_fusion && !o->map_parallelization && o->inject_prefetch);
        CHECK(!memcmp(&s->eval.options, o, sizeof *o));
        loom_config_free(s);
    }
    const char *ov[] = {"data.options.autotune.ram_budget=\"4GiB\"", "data.options.deterministic=false",
                        "data.options.optimization.map_fusion=false", "data.train.transforms=({ op = \"map\"; fn = \"sleep\"; "
                        "feature = \"image\"; ms = 2; parallel = \"auto\"; }, { op = \"prefetch\"; buffer = \"auto\"; })"};
    s = load_ok(cfg_path("good_minimal.cfg"), ov, 4);
    if (s) {
        const loom_data_options *o = &s->train.options;
        CHECK(o->ram_budget == 4294967296LL && !o->deterministic && !o->map_fusion);
        const loom_transform_spec *t = s->train.transform;
        CHECK(t[0].map.kind == LOOM_MAP_SLEEP && t[0].map.ms == 2.0 && t[0].parallel == LOOM_PARALLEL_AUTO);
        CHECK(!t[0].deterministic); /* from data.options.deterministic */
        CHECK(t[1].kind == LOOM_T_PREFETCH && t[1].buffer == -1);
        loom_config_free(s);
    }
    const char *pct[] = {"data.options.autotune.ram_budget=\"80%\""};
    s = load_ok(cfg_path("good_minimal.cfg"), pct, 1);
    if (s) CHECK(s->train.options.ram_budget == 0 && s->train.options.ram_fraction == 0.8);
    loom_config_free(s);
}

/* A config whose pipelines run alone but give the model no batches loads,
 * and loom_config_check_training names each dataset at its file:line; a
 * config that batches passes it (issue 12: found at load, not when the run
 * opens its pipelines). */
static void test_check_training(void)
{
    loom_spec *s = load_ok(cfg_path("train_no_batch.cfg"), NULL, 0);
    if (!s) return;
    loom_errlist errs = {0};
    CHECK(loom_config_check_training(s, &errs) == LOOM_ECONFIG);
    char text[8192];
    errs_text(&errs, text, sizeof text);
    CHECK(errs.n == 2);
    CHECK_CONTAINS(text, "train_no_batch.cfg:6: data.train.transforms: no batch transform");
    CHECK_CONTAINS(text, "add { op = \"batch\"; size = 128; } to data.train.transforms");
    CHECK_CONTAINS(text, "train_no_batch.cfg:10: data.eval.transforms: no batch transform");
    loom_config_free(s);
    const char *ov[] = {"data.train.transforms=({op=\"batch\"; size=32;})", "data.eval.transforms=({op=\"batch\"; size=32;})"};
    s = load_ok(cfg_path("train_no_batch.cfg"), ov, 2);
    errs.n = 0;
    if (s) CHECK(loom_config_check_training(s, &errs) == LOOM_OK && errs.n == 0);
    loom_config_free(s);
}

static const loom_test tests[] = {
    {"check_training", test_check_training},
    {"good_full", test_good_full},
    {"data_options", test_data_options},
    {"defaults", test_defaults},
    {"bad_fixtures", test_bad_fixtures},
    {"unreadable", test_unreadable},
    {"error_limit", test_error_limit},
    {"overrides", test_overrides},
    {"print_roundtrip", test_print_roundtrip},
    {"include", test_include},
    {"names", test_names},
    {"wide_ints", test_wide_ints},
    {"oom", test_oom},
    {0},
};

int main(void) { return loom_test_run(tests); }
