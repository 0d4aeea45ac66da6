/* test_plugin.c - the plugin loader and the plugins that ship: each refusal
 * with its exact message (not an ELF file, no entry point, another ABI, a
 * failing init, a taken name), halving_doubling against a float64 reference
 * for 1 to 8 buffers of odd sizes, and local_sgd on real batches (it averages
 * every average_every steps and leaves the replicas equal, matches
 * synchronous SGD with average_every = 1, is deterministic whatever its
 * thread count, and checks its options); image_ops: the npy source on .npy
 * files written here (values, dtypes, cardinality, mid-epoch save/restore,
 * each bad file named), the option keys Loom checks for a source, cutout
 * (one clipped square per image, the same with parallel calls, new squares
 * each epoch), gaussian_noise and min_std, and the errors of bad functions, arguments and
 * providers at their file:line. Needs LOOM_BUILD_ROOT (set by meson) to find the .so files. */
#include "harness.h"
#include "plugin/plugin.h"

#include "loom_plugin.h" /* after Loom's headers: only what they lack */

#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

static char build_so[3][1024]; /* scratch for so_path */

/* LOOM_BUILD_ROOT/dir/name */
static const char *so_path(const char *dir, const char *name)
{
    static int k;
    char *p = build_so[k++ % 3];
    const char *root = getenv("LOOM_BUILD_ROOT");
    snprintf(p, sizeof build_so[0], "%s/%s/%s", root ? root : "build", dir, name);
    return p;
}

static const loom_cross_device_ops *load_hd(void)
{
    loom_err err = {0};
    int rc = loom_plugin_load_file(so_path("plugins", "halving_doubling.so"), NULL, &err);
    CHECK_MSG(rc == LOOM_OK, "%s: %s", err.where, err.msg);
    return loom_find_cross_device_ops("halving_doubling");
}

/* ---- refusals -------------------------------------------------------------- */

static void expect_refused(const char *path, const char *msg, const char *hint)
{
    loom_err err = {0};
    const loom_plugin_record *rec = NULL;
    int rc = loom_plugin_load_file(path, &rec, &err);
    CHECK(rc == LOOM_EPLUGIN);
    CHECK(rec && !rec->loaded && rec->n_providers == 0);
    CHECK_MSG(!strcmp(err.where, path), "where = %s", err.where);
    CHECK_MSG(!strcmp(err.msg, msg), "msg = %s", err.msg);
    if (hint) CHECK_MSG(!strcmp(err.hint, hint), "hint = %s", err.hint);
}

static void test_refuses_text_file(void)
{
    char path[] = "/tmp/loom_plugin_XXXXXX.so";
    int fd = mkstemps(path, 3);
    CHECK(fd >= 0);
    CHECK(write(fd, "not a plugin\n", 13) == 13);
    close(fd);
    expect_refused(path, "not a shared object (no ELF header)",
                   "a plugin is built with cc -shared -fPIC; remove other files from the plugin directories");
    unlink(path);
}

static void test_refuses_other_abi(void)
{
    char msg[128];
    snprintf(msg, sizeof msg, "built for plugin ABI %d, this loom speaks %d", LOOM_PLUGIN_ABI_VERSION + 98,
             LOOM_PLUGIN_ABI_VERSION);
    expect_refused(so_path("tests/plugins", "abi_mismatch.so"), msg,
                   "rebuild it against the loom_plugin.h of this loom");
}

/* A plugin built before the feature cap went from 8 to 256 (ABI 1) is stale. */
static void test_refuses_abi_1(void)
{
    char msg[128];
    snprintf(msg, sizeof msg, "built for plugin ABI 1, this loom speaks %d", LOOM_PLUGIN_ABI_VERSION);
    CHECK(LOOM_PLUGIN_ABI_VERSION >= 2);
    expect_refused(so_path("tests/plugins", "abi_v1.so"), msg, "rebuild it against the loom_plugin.h of this loom");
}

static void test_refuses_missing_entry(void)
{
    /* refused from its dynamic symbols, before dlopen: its constructor never runs */
    char mark[] = "/tmp/loom_plugin_ctor_XXXXXX";
    int fd = mkstemp(mark);
    CHECK(fd >= 0);
    close(fd);
    unlink(mark);
    setenv("LOOM_TEST_CTOR_MARK", mark, 1);
    expect_refused(so_path("tests/plugins", "no_entry.so"), "no loom_plugin_entry function: not a Loom plugin",
                   "a plugin defines `const loom_plugin *loom_plugin_entry(void)` (plugins/loom_plugin.h)");
    unsetenv("LOOM_TEST_CTOR_MARK");
    CHECK_MSG(access(mark, F_OK) != 0, "the refused shared object's constructor ran");
    unlink(mark);
}

static void test_refuses_silent_init(void)
{
    expect_refused(so_path("tests/plugins", "init_silent.so"),
                   "plugin \"init_silent\"'s init returned failure (1) without a message", NULL);
}

/* A truncated copy of a real plugin, at every kind of cut, and forged
 * headers: refused naming what is wrong, never a SIGBUS inside dlopen. */
static void test_refuses_truncated(void)
{
    FILE *f = fopen(so_path("plugins", "halving_doubling.so"), "rb");
    CHECK(f != NULL);
    if (!f) return;
    static uint8_t so[1 << 22];
    size_t n = fread(so, 1, sizeof so, f);
    fclose(f);
    CHECK(n > 8192 && n < sizeof so);
    size_t cuts[] = {3, 17, 18, 63, 64, 100, 1000, 3000, 5000, n / 2, n - 4096, n - 100, n - 1};
    char dir[] = "/tmp/loom_plugin_cut_XXXXXX", path[64];
    CHECK(mkdtemp(dir) != NULL);
    int k = 0; /* a new name each time: the loader loads (or refuses) a path once */
    for (size_t i = 0; i < sizeof cuts / sizeof *cuts; i++) {
        snprintf(path, sizeof path, "%s/%d.so", dir, k++);
        FILE *w = fopen(path, "wb");
        fwrite(so, 1, cuts[i], w);
        fclose(w);
        loom_err err = {0};
        CHECK_MSG(loom_plugin_load_file(path, NULL, &err) == LOOM_EPLUGIN, "cut at %zu loaded", cuts[i]);
        printf("# cut at %zu: %s\n", cuts[i], err.msg);
        CHECK_MSG(!strcmp(err.where, path), "where = %s", err.where);
        CHECK_MSG(strstr(err.msg, "not a usable shared object") || strstr(err.msg, "no ELF header"),
                  "cut at %zu: %s", cuts[i], err.msg);
    }
    /* forged: program headers past the end, a section table past the end, a 32-bit class */
    struct { size_t off; uint8_t val; const char *want; } forged[] = {
        {32 + 5, 0x7f, "program headers lie past the end"},
        {40 + 5, 0x7f, "section table lies past the end"},
        {4, 1, "32-bit"},
    };
    for (size_t i = 0; i < sizeof forged / sizeof *forged; i++) {
        uint8_t keep = so[forged[i].off];
        so[forged[i].off] = forged[i].val;
        snprintf(path, sizeof path, "%s/%d.so", dir, k++);
        FILE *w = fopen(path, "wb");
        fwrite(so, 1, n, w);
        fclose(w);
        so[forged[i].off] = keep;
        loom_err err = {0};
        CHECK(loom_plugin_load_file(path, NULL, &err) == LOOM_EPLUGIN);
        CHECK_CONTAINS(err.msg, forged[i].want);
    }
    while (k--) {
        snprintf(path, sizeof path, "%s/%d.so", dir, k);
        unlink(path);
    }
    rmdir(dir);
    /* a FIFO in a plugin directory is refused, not waited on */
    char fifo[] = "/tmp/loom_plugin_fifo_XXXXXX";
    CHECK(mkdtemp(fifo) != NULL);
    char fp[64];
    snprintf(fp, sizeof fp, "%s/p.so", fifo);
    CHECK(mkfifo(fp, 0644) == 0);
    loom_err err = {0};
    alarm(20);
    CHECK(loom_plugin_load_file(fp, NULL, &err) == LOOM_EPLUGIN);
    alarm(0);
    CHECK_CONTAINS(err.msg, "is a FIFO");
    unlink(fp);
    rmdir(fifo);
}

static void test_refuses_failing_init(void)
{
    expect_refused(so_path("tests/plugins", "init_fails.so"), "init failed: libfoo.so.3 not found", "install libfoo3");
    /* what it registered before failing was never committed */
    CHECK(loom_find_cross_device_ops("never_registered") == NULL);
}

static void test_refuses_taken_name(void)
{
    CHECK(load_hd() != NULL);
    char real[PATH_MAX], msg[PATH_MAX + 100];
    CHECK(realpath(so_path("plugins", "halving_doubling.so"), real) != NULL);
    const char *origin = NULL;
    loom_registry_find(LOOM_REG_CROSS_DEVICE_OPS, "halving_doubling", &origin);
    snprintf(msg, sizeof msg, "cross-device ops \"halving_doubling\" is already registered by %s", origin);
    expect_refused(so_path("tests/plugins", "dup_provider.so"), msg, NULL);
    CHECK_CONTAINS(origin, "plugins/halving_doubling.so");
    /* the same file reached again is the same record, not a second load */
    const loom_plugin_record *a = NULL, *b = NULL;
    CHECK(loom_plugin_load_file(so_path("plugins", "halving_doubling.so"), &a, NULL) == LOOM_OK);
    CHECK(loom_plugin_load_file(real, &b, NULL) == LOOM_OK);
    CHECK(a && a == b && a->n_providers == 1 && !strcmp(a->name, "halving_doubling"));
}

/* ---- halving_doubling ---------------------------------------------------------- */

static float value(int r, int64_t i, uint64_t salt)
{
    loom_rng g;
    loom_rng_init(&g, salt, (uint64_t)r, (uint64_t)i, 0);
    return loom_rng_uniform(&g) * 2.0f - 1.0f;
}

static void check_all_reduce(const loom_cross_device_ops *x, int n, int64_t count, loom_redop op)
{
    float *bufs[8];
    double *ref = calloc((size_t)count, sizeof *ref);
    for (int r = 0; r < n; r++) {
        bufs[r] = malloc((size_t)count * sizeof(float));
        for (int64_t i = 0; i < count; i++) {
            float v = value(r, i, (uint64_t)op);
            bufs[r][i] = v;
            ref[i] = op == LOOM_REDUCE_MAX ? (r == 0 || v > ref[i] ? v : ref[i]) : ref[i] + v;
        }
    }
    loom_err err = {0};
    CHECK(x->all_reduce(bufs, n, count, op, &err) == LOOM_OK);
    int bad = 0, unequal = 0;
    for (int64_t i = 0; i < count; i++) {
        double want = op == LOOM_REDUCE_MEAN ? ref[i] / n : ref[i];
        bad += fabs(bufs[0][i] - want) > 1e-5 * (1 + fabs(want));
        for (int r = 1; r < n; r++) unequal += bufs[r][i] != bufs[0][i];
    }
    CHECK_MSG(bad == 0 && unequal == 0, "n = %d, count = %lld, op %d: %d wrong, %d differ between buffers", n,
              (long long)count, op, bad, unequal);
    for (int r = 0; r < n; r++) free(bufs[r]);
    free(ref);
}

static void test_halving_doubling_all_reduce(void)
{
    const loom_cross_device_ops *x = load_hd();
    if (!x) return;
    static const int64_t counts[] = {1, 2, 3, 7, 13, 64, 1009, 65537};
    for (int n = 1; n <= 8; n++)
        for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++)
            for (int op = LOOM_REDUCE_SUM; op <= LOOM_REDUCE_MAX; op++) check_all_reduce(x, n, counts[c], op);
}

static void test_halving_doubling_broadcast(void)
{
    const loom_cross_device_ops *x = load_hd();
    if (!x) return;
    float data[8][5];
    float *bufs[8];
    for (int n = 1; n <= 8; n++)
        for (int root = 0; root < n; root++) {
            for (int r = 0; r < n; r++) {
                bufs[r] = data[r];
                for (int i = 0; i < 5; i++) data[r][i] = (float)(r * 10 + i);
            }
            loom_err err = {0};
            CHECK(x->broadcast(bufs, n, 5, root, &err) == LOOM_OK);
            for (int r = 0; r < n; r++)
                CHECK(!memcmp(data[r], data[root], sizeof data[r]) && data[r][1] == root * 10 + 1);
        }
}

/* ---- local_sgd ------------------------------------------------------------------- */

static int cfg_threads = 2; /* run.threads of the next config() */

/* A config over 512 synthetic examples of 8 features in 4 classes; strategy
 * is the text of the strategy group. Returns the loaded spec. */
static loom_spec *config(const char *strategy)
{
    char path[] = "/tmp/loom_plugin_cfg_XXXXXX";
    int fd = mkstemp(path);
    FILE *f = fdopen(fd, "w");
    fprintf(f,
            "version = 1;\n"
            "data: { train: { source: { type = \"synthetic\"; count = 512; features: {\n"
            "  image = { dtype = \"float32\"; shape = [8]; }; label = { dtype = \"int64\"; max = 4; }; }; };\n"
            "  transforms = ({ op = \"batch\"; size = 32; }); }; };\n"
            "model: { layers = ({ type = \"dense\"; units = 16; activation = \"relu\"; },\n"
            "                   { type = \"dense\"; units = 4; }); };\n"
            "optimizer: { type = \"sgd\"; learning_rate = 0.1; };\n"
            "strategy: { %s };\n"
            "run: { model_dir = \"/tmp/loom_plugin_unused\"; seed = 7; threads = %d; };\n",
            strategy, cfg_threads);
    fclose(f);
    loom_spec *spec = NULL;
    loom_errlist errs = {0};
    int rc = loom_config_load(&spec, path, NULL, 0, &errs);
    CHECK_MSG(rc == LOOM_OK, "%s", errs.n ? errs.e[0].msg : "?");
    unlink(path);
    return spec;
}

/* Counts the averagings of the strategy under test and checks, around each,
 * that the replicas differed before and are bit-identical after. */
static struct {
    int calls, differed, equal;
    int64_t step, last_step;
    int n;
} rec;

static int recording_all_reduce(float *const *bufs, int n, int64_t count, loom_redop op, loom_err *err)
{
    rec.calls++;
    rec.n = n;
    rec.last_step = rec.step;
    bool differ = false;
    for (int r = 1; r < n; r++) differ = differ || memcmp(bufs[r], bufs[0], (size_t)count * sizeof(float));
    rec.differed += differ && op == LOOM_REDUCE_MEAN;
    int rc = loom_find_cross_device_ops("reduce_to_one_device")->all_reduce(bufs, n, count, op, err);
    bool equal = true;
    for (int r = 1; r < n; r++) equal = equal && !memcmp(bufs[r], bufs[0], (size_t)count * sizeof(float));
    rec.equal += equal;
    return rc;
}

static int recording_broadcast(float *const *bufs, int n, int64_t count, int root, loom_err *err)
{
    return loom_find_cross_device_ops("reduce_to_one_device")->broadcast(bufs, n, count, root, err);
}

static const loom_cross_device_ops recording = {
    .version = 1, .name = "recording", .all_reduce = recording_all_reduce, .broadcast = recording_broadcast};

typedef struct run {
    loom_spec *spec;
    loom_iter *it;
    loom_strategy *s;
    loom_strategy_args args;
} run;

static int run_open(run *r, const char *strategy)
{
    memset(r, 0, sizeof *r);
    loom_err err = {0};
    CHECK(loom_plugin_load_file(so_path("plugins", "local_sgd.so"), NULL, &err) == LOOM_OK);
    if (!loom_find_cross_device_ops("recording")) CHECK(loom_register_cross_device_ops(&recording, &err) == LOOM_OK);
    if (!(r->spec = config(strategy))) return -1;
    loom_data_ctx ctx = {.seed = 7, .threads = 0, .name = "train"};
    CHECK(loom_data_open(&r->it, &r->spec->train, &ctx, &err) == LOOM_OK);
    const loom_elem_spec *in = loom_iter_spec(r->it);
    r->args = (loom_strategy_args){.spec = r->spec,
                                   .input = in,
                                   .input_idx = loom_elem_spec_find(in, "image"),
                                   .label_idx = loom_elem_spec_find(in, "label"),
                                   .max_batch = 32};
    int rc = loom_strategy_open(&r->s, &r->args, &err);
    if (rc) printf("# %s: %s\n", err.where, err.msg);
    return rc;
}

/* Trains `steps` steps; returns the sum of losses. */
static double run_steps(run *r, int steps)
{
    double loss = 0;
    for (int step = 0; step < steps; step++) {
        loom_elem *b;
        loom_err err = {0};
        CHECK(loom_iter_next(r->it, &b, &err) == LOOM_OK);
        loom_step_result res = {0};
        rec.step = step;
        CHECK_MSG(loom_strategy_train_step(r->s, b, step, &res, &err) == LOOM_OK, "%s", err.msg);
        CHECK(res.examples == 32);
        loss += res.loss_sum;
    }
    return loss;
}

static void run_close(run *r)
{
    loom_strategy_close(r->s);
    loom_iter_close(r->it);
    loom_config_free(r->spec);
}

static void test_local_sgd_averages(void)
{
    run r;
    memset(&rec, 0, sizeof rec);
    if (run_open(&r, "type = \"local_sgd\"; replicas = 3; cross_device_ops = \"recording\"; "
                     "options: { average_every = 2; };"))
        return;
    CHECK(loom_strategy_num_replicas(r.s) == 3);
    run_steps(&r, 6);
    /* after steps 1, 3 and 5 (0-based), over all 3 replicas, which had drifted apart and then agree */
    CHECK_MSG(rec.calls == 3 && rec.last_step == 5 && rec.n == 3, "calls %d, last at step %lld", rec.calls,
              (long long)rec.last_step);
    CHECK(rec.differed == 3 && rec.equal == 3);
    run_close(&r);
}

static void test_local_sgd_matches_sync_sgd(void)
{
    run a, b;
    if (run_open(&a, "type = \"local_sgd\"; replicas = 2; options: { average_every = 1; };")) return;
    if (run_open(&b, "type = \"one_device\";")) return;
    run_steps(&a, 4);
    run_steps(&b, 4);
    loom_model *ma = loom_strategy_model(a.s), *mb = loom_strategy_model(b.s);
    const float *pa = loom_model_params(ma), *pb = loom_model_params(mb);
    double diff = 0, norm = 0;
    for (int64_t i = 0; i < loom_model_num_params(ma); i++) diff += fabs(pa[i] - pb[i]), norm += fabs(pb[i]);
    CHECK_MSG(diff <= 1e-5 * norm, "relative difference %g", diff / norm);
    run_close(&a);
    run_close(&b);
}

static void test_local_sgd_deterministic(void)
{
    const char *st = "type = \"local_sgd\"; replicas = 3; cross_device_ops = \"halving_doubling\"; "
                     "options: { average_every = 3; };";
    run a, b;
    load_hd();
    /* the second on one thread: the replicas' results do not depend on the pool */
    if (run_open(&a, st)) return;
    cfg_threads = 1;
    int rc = run_open(&b, st);
    cfg_threads = 2;
    if (rc) return;
    double la = run_steps(&a, 7), lb = run_steps(&b, 7);
    loom_model *ma = loom_strategy_model(a.s), *mb = loom_strategy_model(b.s);
    CHECK(la == lb);
    CHECK(!memcmp(loom_model_params(ma), loom_model_params(mb), (size_t)loom_model_num_params(ma) * sizeof(float)));
    run_close(&a);
    run_close(&b);
}

static void test_local_sgd_options(void)
{
    loom_err err = {0};
    CHECK(loom_plugin_load_file(so_path("plugins", "local_sgd.so"), NULL, &err) == LOOM_OK);
    /* an unknown key: found before training, naming its line and the valid ones */
    loom_spec *spec = config("type = \"local_sgd\"; replicas = 2;\n  options: { average_evry = 2; };");
    loom_errlist errs = {0};
    CHECK(loom_plugins_check_spec(spec, &errs) == LOOM_ECONFIG);
    CHECK(errs.n == 1);
    CHECK_CONTAINS(errs.e[0].where, ":9");
    CHECK_MSG(!strcmp(errs.e[0].msg, "strategy.options.average_evry: unknown option of strategy \"local_sgd\" "
                                     "(valid: average_every)"),
              "%s", errs.e[0].msg);
    CHECK(!strcmp(errs.e[0].hint, "did you mean `average_every`?"));
    loom_config_free(spec);
    /* a strategy or an op nobody registered */
    spec = config("type = \"local_sdg\"; cross_device_ops = \"ring_of_fire\";");
    errs.n = 0;
    CHECK(loom_plugins_check_spec(spec, &errs) == LOOM_ECONFIG && errs.n == 2);
    CHECK_CONTAINS(errs.e[0].msg, "strategy.type: unknown strategy \"local_sdg\" (available: one_device");
    CHECK(!strcmp(errs.e[0].hint, "did you mean \"local_sgd\"?"));
    CHECK_CONTAINS(errs.e[1].msg, "strategy.cross_device_ops: unknown cross-device ops \"ring_of_fire\"");
    loom_config_free(spec);
    /* a bad value: refused when the strategy opens (loom check does) */
    run r;
    CHECK(run_open(&r, "type = \"local_sgd\"; replicas = 2;\n  options: { average_every = 0; };") == LOOM_ECONFIG);
    run_close(&r);
}

static void test_require(void)
{
    loom_spec *spec = config("type = \"one_device\";");
    if (!spec) return;
    spec->plugins.n_require = 2;
    snprintf(spec->plugins.require[0], LOOM_NAME_MAX, "local_sgd");
    snprintf(spec->plugins.require[1], LOOM_NAME_MAX, "abi_mismatch");
    spec->plugins.require_line[1] = 12;
    loom_err err = {0};
    CHECK(loom_plugin_load_file(so_path("plugins", "local_sgd.so"), NULL, &err) == LOOM_OK);
    CHECK(loom_plugins_load(spec, &err) == LOOM_ECONFIG);
    CHECK_CONTAINS(err.where, ":12");
    /* its name was never read (the ABI check comes first), so it is "not loaded" */
    CHECK_CONTAINS(err.msg, "plugins.require: plugin \"abi_mismatch\" is not loaded (searched: ");
    spec->plugins.n_require = 1;
    CHECK(loom_plugins_load(spec, &err) == LOOM_OK);
    loom_config_free(spec);
}


/* ---- image_ops: a transform provider and the npy source ---------------------------- */

static char npy_dir[] = "/tmp/loom_plugin_npy_XXXXXX";

/* Writes DIR/name as np.save would: magic, version 1.0, the header dict padded to 64 bytes, the data. */
static void npy_write(const char *name, const char *descr, const char *shape, const void *data, size_t bytes)
{
    char path[256], h[256];
    snprintf(path, sizeof path, "%s/%s", npy_dir, name);
    int n = snprintf(h, sizeof h, "{'descr': '%s', 'fortran_order': False, 'shape': %s, }", descr, shape);
    while ((10 + n + 1) % 64) h[n++] = ' ';
    h[n++] = '\n';
    FILE *f = fopen(path, "wb");
    uint8_t pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, (uint8_t)(n & 0xff), (uint8_t)(n >> 8)};
    CHECK(f && fwrite(pre, 1, 10, f) == 10 && fwrite(h, 1, (size_t)n, f) == (size_t)n &&
          fwrite(data, 1, bytes, f) == bytes);
    if (f) fclose(f);
}

/* Five (2, 3) uint8 images (image i: 10 * i + pixel; odd images constant), int64 labels 0..4, float32 weights. */
static void npy_fixtures(void)
{
    static int made;
    if (made++) return;
    CHECK(mkdtemp(npy_dir) != NULL);
    uint8_t x[5][6];
    int64_t y[5];
    float w[5];
    for (int i = 0; i < 5; i++) {
        for (int p = 0; p < 6; p++) x[i][p] = (uint8_t)(i % 2 ? 100 : 10 * i + p);
        y[i] = i, w[i] = 0.5f * (float)i;
    }
    npy_write("x.npy", "|u1", "(5, 2, 3)", x, sizeof x);
    npy_write("y.npy", "<i8", "(5,)", y, sizeof y);
    npy_write("w.npy", "<f4", "(5,)", w, sizeof w);
    npy_write("y4.npy", "<i8", "(4,)", y, 4 * sizeof y[0]);
    float zeros[5][2][3] = {{{0}}};
    npy_write("xf.npy", "<f4", "(5, 2, 3)", zeros, sizeof zeros);
    npy_write("big.npy", ">f4", "(5,)", w, sizeof w);
    float wnan[5] = {0.5f, 1.0f, 1.5f, NAN, 2.5f}; /* element 3 */
    npy_write("wnan.npy", "<f4", "(5,)", wnan, sizeof wnan);
    npy_write("short.npy", "<i8", "(6,)", y, sizeof y);
    char path[256];
    snprintf(path, sizeof path, "%s/text.npy", npy_dir);
    FILE *f = fopen(path, "w");
    if (f) fputs("image,label\n1,2\n", f), fclose(f);
    loom_err err = {0};
    int rc = loom_plugin_load_file(so_path("plugins", "image_ops.so"), NULL, &err);
    CHECK_MSG(rc == LOOM_OK, "%s: %s", err.where, err.msg);
}

/* Writes npy_dir/name: a config whose data.train is `train` (line 2 on); false when it cannot. */
static bool npy_config_file(const char *train, const char *name, char *path, size_t n)
{
    npy_fixtures();
    snprintf(path, n, "%s/%s", npy_dir, name);
    FILE *f = fopen(path, "w");
    if (!f) return false;
    fprintf(f, "version = 1;\ndata: { train: {\n%s\n}; };\nmodel: { layers = ({ type = \"dense\"; units = 2; }); };\n"
               "optimizer: { type = \"sgd\"; learning_rate = 0.1; };\nrun: { model_dir = \"/tmp/loom_plugin_unused\"; };\n",
            train);
    return fclose(f) == 0;
}

/* Loads a config whose data.train is `train` (line 2 on), from npy_dir. */
static loom_spec *npy_config(const char *train)
{
    char path[256];
    if (!npy_config_file(train, "c.cfg", path, sizeof path)) return NULL;
    loom_spec *spec = NULL;
    loom_errlist errs = {0};
    int rc = loom_config_load(&spec, path, NULL, 0, &errs);
    CHECK_MSG(rc == LOOM_OK, "%s: %s", errs.n ? errs.e[0].where : "", errs.n ? errs.e[0].msg : "?");
    return spec;
}

/* Opens the train pipeline of a config; NULL with *err filled on failure. */
static loom_iter *npy_open(const char *train, int threads, loom_err *err)
{
    loom_spec *spec = npy_config(train);
    if (!spec) return NULL;
    loom_data_ctx ctx = {.seed = 11, .threads = threads, .name = "train"};
    loom_iter *it = NULL;
    if (loom_data_open(&it, &spec->train, &ctx, err)) it = NULL;
    loom_config_free(spec);
    return it;
}

#define NPY_SRC "source: { type = \"npy\"; options: { image = \"x.npy\"; label = \"y.npy\"; w = \"w.npy\"; }; };"

static void test_image_ops_registers(void)
{
    npy_fixtures();
    const loom_plugin_record *rec = NULL;
    for (int i = 0; (rec = loom_plugin_record_at(i)) != NULL; i++)
        if (rec->loaded && !strcmp(rec->name, "image_ops")) break;
    CHECK(rec && rec->n_providers == 2);
    CHECK(loom_registry_find(LOOM_REG_TRANSFORM, "image_ops", NULL) != NULL);
    CHECK(loom_registry_find(LOOM_REG_SOURCE, "npy", NULL) != NULL);
}

static void test_npy_source(void)
{
    loom_err err = {0};
    loom_iter *it = npy_open(NPY_SRC, 0, &err);
    CHECK_MSG(it, "%s: %s", err.where, err.msg);
    if (!it) return;
    CHECK(loom_iter_cardinality(it) == 5);
    loom_elem *e;
    loom_buf b;
    loom_buf_init(&b);
    for (int i = 0; i < 5; i++) {
        CHECK(loom_iter_next(it, &e, &err) == LOOM_OK);
        CHECK(e->n == 3 && e->t[0].dtype == LOOM_U8 && e->t[0].shape.rank == 2 && e->t[0].shape.dim[1] == 3);
        CHECK(((uint8_t *)e->t[0].data)[5] == (i % 2 ? 100 : 10 * i + 5));
        CHECK(e->t[1].dtype == LOOM_I64 && e->t[1].shape.rank == 0 && *(int64_t *)e->t[1].data == i);
        CHECK(e->t[2].dtype == LOOM_F32 && *(float *)e->t[2].data == 0.5f * (float)i);
        if (i == 1) CHECK(loom_iter_save(it, &b, &err) == LOOM_OK); /* mid-epoch: after element 1 */
    }
    CHECK(loom_iter_next(it, &e, &err) == LOOM_EEOF);
    CHECK(loom_iter_rewind(it, 1, &err) == LOOM_OK);
    CHECK(loom_iter_next(it, &e, &err) == LOOM_OK && *(int64_t *)e->t[1].data == 0);
    loom_iter_close(it);
    /* a new iterator restored from the state continues at element 2 */
    it = npy_open(NPY_SRC, 0, &err);
    loom_buf rb;
    loom_buf_wrap(&rb, b.data, b.len);
    CHECK(it && loom_iter_restore(it, &rb, &err) == LOOM_OK);
    CHECK(it && loom_iter_next(it, &e, &err) == LOOM_OK && *(int64_t *)e->t[1].data == 2);
    loom_iter_close(it);
    loom_buf_fini(&b);
}

/* The error of opening a pipeline over source options `opts`. */
static loom_err npy_error(const char *train)
{
    loom_err err = {0};
    loom_iter *it = npy_open(train, 0, &err);
    CHECK(it == NULL);
    loom_iter_close(it);
    return err;
}

static void test_npy_errors(void)
{
    char cfg[300];
    snprintf(cfg, sizeof cfg, "%s/c.cfg:", npy_dir);
    loom_err e = npy_error("source: { type = \"npy\"; options: {\n image = \"x.npy\";\n label = \"y4.npy\"; }; };");
    CHECK_MSG(strstr(e.where, cfg) && strstr(e.where, ":5"), "where = %s", e.where);
    CHECK_CONTAINS(e.msg, "y4.npy holds 4 elements, x.npy holds 5: they must agree");
    e = npy_error("source: { type = \"npy\"; options: {\n image = \"missing.npy\"; }; };");
    CHECK_MSG(strstr(e.where, ":4"), "where = %s", e.where);
    CHECK_CONTAINS(e.msg, "missing.npy: No such file or directory");
    e = npy_error("source: { type = \"npy\"; options: { w = \"big.npy\"; }; };");
    CHECK_CONTAINS(e.where, "big.npy");
    CHECK_CONTAINS(e.msg, "unsupported array: {'descr': '>f4'");
    CHECK_CONTAINS(e.hint, "np.ascontiguousarray");
    e = npy_error("source: { type = \"npy\"; options: { w = \"short.npy\"; }; };");
    CHECK_CONTAINS(e.msg, "holds 40 bytes of data, the header's shape needs 48");
    e = npy_error("source: { type = \"npy\"; options: { w = \"text.npy\"; }; };");
    CHECK_CONTAINS(e.msg, "not a NumPy .npy file");
    e = npy_error("source: { type = \"npz\"; options: { w = \"w.npy\"; }; };");
    CHECK_CONTAINS(e.msg, "no source \"npz\" is registered (have: idx, catalog, tfrecord, csv, text, synthetic, list_files, npy");
}

/* The non-finite check names the element by its place in the source's pass,
 * also after a resume mid-pass (the count travels in the iterator state), so
 * a user can find it; a state written before the count was saved still
 * restores, and the message then says the index is counted from the resume. */
#define NPY_NAN "source: { type = \"npy\"; options: { label = \"y.npy\"; w = \"wnan.npy\"; }; };"

/* Reads the NaN element's error after restoring state (NULL: no restore); elements read before it in *got. */
static loom_err npy_nan_error(const loom_buf *state, int *got)
{
    loom_err err = {0};
    *got = 0;
    loom_iter *it = npy_open(NPY_NAN, 0, &err);
    CHECK_MSG(it, "%s", err.msg);
    if (!it) return err;
    if (state) {
        loom_buf rb;
        loom_buf_wrap(&rb, state->data, state->len);
        CHECK_MSG(loom_iter_restore(it, &rb, &err) == LOOM_OK, "%s", err.msg);
    }
    loom_elem *e;
    int rc;
    while ((rc = loom_iter_next(it, &e, &err)) == LOOM_OK) (*got)++;
    CHECK(rc == LOOM_EDATA);
    loom_iter_close(it);
    return err;
}

static void test_npy_nonfinite_after_resume(void)
{
    int got;
    loom_err e = npy_nan_error(NULL, &got);
    CHECK(got == 3);
    CHECK_CONTAINS(e.msg, "source \"npy\": element 3 of the pass (0-based, in the source's order), feature \"w\": "
                          "non-finite value nan at offset 0");
    CHECK_CONTAINS(e.hint, "on_nonfinite = \"skip\"");
    /* saved after elements 0 and 1, resumed: the NaN is still element 3, not the resume's element 1 */
    loom_err err = {0};
    loom_iter *it = npy_open(NPY_NAN, 0, &err);
    CHECK(it != NULL);
    if (!it) return;
    loom_elem *el;
    loom_buf b;
    loom_buf_init(&b);
    CHECK(loom_iter_next(it, &el, &err) == LOOM_OK && loom_iter_next(it, &el, &err) == LOOM_OK);
    CHECK(loom_iter_save(it, &b, &err) == LOOM_OK);
    loom_iter_close(it);
    e = npy_nan_error(&b, &got);
    CHECK(got == 1);
    CHECK_CONTAINS(e.msg, "source \"npy\": element 3 of the pass (0-based, in the source's order), feature \"w\"");
    /* the same state as an older build wrote it: the provider's size without the flag, no count */
    const uint64_t flagged = 16 | (1ull << 63), plain = 16;
    size_t at = b.len;
    for (size_t i = 0; i + 16 <= b.len && at == b.len; i++)
        if (!memcmp(b.data + i, &flagged, 8)) at = i;
    CHECK_MSG(at < b.len, "no flagged npy state in the %zu bytes", b.len);
    if (at < b.len) {
        memcpy(b.data + at, &plain, 8);
        memmove(b.data + at + 8, b.data + at + 16, b.len - at - 16);
        b.len -= 8;
        e = npy_nan_error(&b, &got);
        CHECK(got == 1);
        CHECK_CONTAINS(e.msg, "source \"npy\": element 1 after the resume point (0-based; the checkpoint does not record "
                              "the pass's position)");
    }
    loom_buf_fini(&b);
}

/* A counting source registered directly: its option keys are checked by Loom. */
static int cnt_open(void **inst, const loom_source_args *a, loom_elem_spec *spec, loom_shape *max, loom_err *err)
{
    (void)a, (void)err;
    *inst = calloc(1, sizeof(int64_t));
    spec->n = 1;
    snprintf(spec->name[0], LOOM_NAME_MAX, "i");
    spec->dtype[0] = LOOM_I64;
    spec->shape[0] = max[0] = (loom_shape){0};
    return LOOM_OK;
}
static int64_t cnt_card(void *inst) { (void)inst; return -1; }
static int cnt_rewind(void *inst, int64_t epoch, loom_err *err) { (void)epoch, (void)err; *(int64_t *)inst = 0; return 0; }
static int cnt_next(void *inst, loom_elem *out, loom_err *err)
{
    (void)err;
    *(int64_t *)out->t[0].data = (*(int64_t *)inst)++;
    return LOOM_OK;
}
static size_t cnt_save(void *inst, void *buf, size_t cap)
{
    if (cap >= 8) memcpy(buf, inst, 8);
    return 8;
}
static int cnt_restore(void *inst, const void *buf, size_t len, loom_err *err)
{
    (void)err;
    memcpy(inst, buf, 8);
    return len == 8 ? LOOM_OK : LOOM_ECHECKPOINT;
}
static const char *const cnt_options[] = {"count", NULL};
static const loom_source_ops counting = {
    .version = LOOM_SOURCE_OPS_VERSION, .name = "counting", .options = cnt_options, .open = cnt_open,
    .cardinality = cnt_card, .rewind = cnt_rewind, .next = cnt_next, .save = cnt_save, .restore = cnt_restore,
    .close = free,
};

/* The built-in sources are in the registry as a plugin's are (issue 12):
 * listed by name, their names taken (a plugin's "csv" is refused naming the
 * built-in), and a pipeline opens one by looking its type up. */
static void test_builtin_sources_registered(void)
{
    loom_err err = {0};
    CHECK(loom_data_init(&err) == LOOM_OK && loom_data_init(&err) == LOOM_OK); /* once, then a no-op */
    const char *origin = NULL;
    CHECK(loom_registry_find(LOOM_REG_SOURCE, "csv", &origin) != NULL && origin && !strcmp(origin, "built-in"));
    char names[512];
    CHECK_CONTAINS(loom_registry_names(LOOM_REG_SOURCE, names, sizeof names),
                   "idx, catalog, tfrecord, csv, text, synthetic, list_files");
    loom_source_ops fake = counting;
    fake.name = "csv";
    CHECK(loom_registry_add(LOOM_REG_SOURCE, "csv", &fake, "fake.so", &err) == LOOM_EPLUGIN);
    CHECK_CONTAINS(err.msg, "dataset source \"csv\" is already registered by built-in");
    loom_iter *it = npy_open("source: { type = \"synthetic\"; count = 5;\n features: { x = { dtype = \"int64\"; "
                             "shape = [2]; max = 9; }; }; };", 0, &err);
    CHECK_MSG(it != NULL, "%s: %s", err.where, err.msg);
    loom_elem *e;
    int n = 0;
    while (it && loom_iter_next(it, &e, &err) == LOOM_OK) n++;
    CHECK(n == 5);
    loom_iter_close(it);
}

/* The first config error of data.train = `train` (from npy_dir), "" when it loads. */
static loom_err config_error(const char *train)
{
    loom_err out = {0};
    char path[256];
    if (!npy_config_file(train, "bad.cfg", path, sizeof path)) return out;
    loom_spec *spec = NULL;
    loom_errlist errs = {0};
    if (loom_config_load(&spec, path, NULL, 0, &errs) != LOOM_OK && errs.n) out = errs.e[0];
    loom_config_free(spec);
    return out;
}

/* Every name of `names` (config's list, "a, b, c") is a registered built-in
 * entry of version (a transform or a map fn), and the list names them all. */
static void check_names_registered(const char *names, loom_xform_entry kind, const char *what)
{
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", names);
    int n = 0, want = 0;
    for (char *save = NULL, *w = strtok_r(buf, ", ", &save); w; w = strtok_r(NULL, ", ", &save), n++) {
        const void *p = loom_registry_find(LOOM_REG_TRANSFORM, w, NULL);
        if (!strcmp(w, "lua")) { /* fn = "lua" is the Lua provider's ("lua" in the registry when script registered it) */
            CHECK_MSG(!p || !loom_data_transform_builtin(p), "\"lua\" is a provider, not a built-in map fn");
            n--;
            continue;
        }
        CHECK_MSG(p && loom_data_transform_entry(p) == kind, "%s \"%s\" is not registered",
                  what, w);
    }
    const char *name;
    const void *p;
    for (int i = 0; loom_registry_entry(LOOM_REG_TRANSFORM, i, &name, &p, NULL) == 0; i++)
        if (loom_data_transform_entry(p) == kind) want++;
    CHECK_MSG(n == want, "config names %d %ss, the registry holds %d built-in", n, what, want);
}

/* The built-in transforms and map fns are in the registry (issue 12), as
 * the element-map providers are: every transform type and map fn the
 * config accepts is registered under its name (config's list, the one list
 * of names), a plugin cannot take a built-in's name, a built-in is not a
 * provider, and the unknown-name messages list the built-ins. */
static void test_builtin_transforms_registered(void)
{
    loom_err err = {0};
    CHECK(loom_data_init(&err) == LOOM_OK && loom_data_init(&err) == LOOM_OK); /* once, then a no-op */
    const char *origin = NULL;
    CHECK(loom_registry_find(LOOM_REG_TRANSFORM, "shuffle", &origin) != NULL && origin && !strcmp(origin, "built-in"));
    CHECK(loom_registry_find(LOOM_REG_TRANSFORM, "normalize", &origin) != NULL && origin && !strcmp(origin, "built-in"));
    /* the config's lists, as its unknown-value errors give them */
    loom_err e = config_error(NPY_SRC " transforms = ({ op = \"shufle\"; buffer = 4; });");
    CHECK_CONTAINS(e.msg, "op: unknown value \"shufle\" (expected one of: map, shuffle, batch,");
    const char *l = strstr(e.msg, "expected one of: ");
    char names[1024] = "";
    if (l) snprintf(names, sizeof names, "%.*s", (int)(strlen(l) - 18), l + 17);
    check_names_registered(names, LOOM_XFORM_BUILTIN, "transform");
    e = config_error(NPY_SRC " transforms = ({ op = \"map\"; fn = \"normalise\"; feature = \"image\"; });");
    CHECK_CONTAINS(e.msg, "fn: unknown value \"normalise\" (expected one of: cast, scale, normalize,");
    l = strstr(e.msg, "expected one of: ");
    names[0] = 0;
    if (l) snprintf(names, sizeof names, "%.*s", (int)(strlen(l) - 18), l + 17);
    check_names_registered(names, LOOM_XFORM_MAP_FN, "map fn");
    /* a plugin's provider cannot take a built-in's name */
    loom_custom_ops fake = {.version = LOOM_CUSTOM_OPS_VERSION, .name = "shuffle"};
    CHECK(loom_registry_add(LOOM_REG_TRANSFORM, "shuffle", &fake, "fake.so", &err) == LOOM_EPLUGIN);
    CHECK_CONTAINS(err.msg, "transform \"shuffle\" is already registered by built-in");
    fake.name = "normalize";
    CHECK(loom_registry_add(LOOM_REG_TRANSFORM, "normalize", &fake, "fake.so", &err) == LOOM_EPLUGIN);
    CHECK_CONTAINS(err.msg, "transform \"normalize\" is already registered by built-in");
    /* a built-in is no provider: refused at check (naming the providers) and at open */
    char prov[512];
    CHECK_CONTAINS(loom_data_providers(prov, sizeof prov), "image_ops");
    CHECK(!strstr(prov, "shuffle") && !strstr(prov, "normalize"));
    const char *as_provider = NPY_SRC " transforms = ({ op = \"map\"; plugin = \"shuffle:cutout\"; });";
    loom_spec *spec = npy_config(as_provider);
    loom_errlist errs = {0};
    CHECK(spec && loom_plugins_check_spec(spec, &errs) == LOOM_ECONFIG && errs.n == 1);
    if (errs.n) {
        CHECK_CONTAINS(errs.e[0].msg, "transforms.[0].plugin: \"shuffle\" is a built-in transform or map fn, not a "
                                      "transform provider (available: ");
        CHECK_CONTAINS(errs.e[0].msg, "image_ops)");
    }
    loom_config_free(spec);
    e = npy_error(as_provider);
    CHECK_CONTAINS(e.msg, "no map provider \"shuffle\" is registered (have: ");
    CHECK(!strstr(e.msg, "normalize"));
    /* a pipeline opens its transforms through the entries */
    loom_iter *it = npy_open("source: { type = \"synthetic\"; count = 6;\n features: { x = { dtype = \"int64\"; "
                             "shape = [2]; max = 9; }; }; };\n transforms = ({ op = \"shuffle\"; buffer = 4; }, "
                             "{ op = \"map\"; fn = \"cast\"; feature = \"x\"; dtype = \"float32\"; }, "
                             "{ op = \"batch\"; size = 4; });", 0, &err);
    CHECK_MSG(it != NULL, "%s: %s", err.where, err.msg);
    loom_elem *b;
    int n = 0;
    while (it && loom_iter_next(it, &b, &err) == LOOM_OK) {
        CHECK(b->t[0].dtype == LOOM_F32 && b->t[0].shape.dim[0] == 4 - 2 * n);
        n++;
    }
    CHECK(n == 2);
    loom_iter_close(it);
}

static void test_source_options_checked(void)
{
    loom_err err = {0};
    if (!loom_registry_find(LOOM_REG_SOURCE, "counting", NULL))
        CHECK(loom_registry_add(LOOM_REG_SOURCE, "counting", &counting, "test", &err) == LOOM_OK);
    loom_err e = npy_error("source: { type = \"counting\"; options: {\n cont = 3; }; };");
    CHECK_MSG(strstr(e.where, "c.cfg:4"), "where = %s", e.where);
    CHECK_CONTAINS(e.msg, "source.options.cont: unknown option of source \"counting\" (valid: count)");
    CHECK_CONTAINS(e.hint, "did you mean `count`?");
    /* an infinite source with lent buffers: values written into Loom's buffers, state restored */
    loom_iter *it = npy_open("source: { type = \"counting\"; options: { count = 3; }; };", 0, &err);
    CHECK_MSG(it, "%s", err.msg);
    if (!it) return;
    loom_elem *el;
    CHECK(loom_iter_cardinality(it) == -1);
    for (int i = 0; i < 3; i++) CHECK(loom_iter_next(it, &el, &err) == LOOM_OK && *(int64_t *)el->t[0].data == i);
    loom_buf b;
    loom_buf_init(&b);
    CHECK(loom_iter_save(it, &b, &err) == LOOM_OK);
    loom_iter_close(it);
    it = npy_open("source: { type = \"counting\"; options: { count = 3; }; };", 0, &err);
    loom_buf rb;
    loom_buf_wrap(&rb, b.data, b.len);
    CHECK(it && loom_iter_restore(it, &rb, &err) == LOOM_OK);
    CHECK(it && loom_iter_next(it, &el, &err) == LOOM_OK && *(int64_t *)el->t[0].data == 3);
    loom_iter_close(it);
    loom_buf_fini(&b);
}

/* A source whose max shape's product wraps (2^32 * 2^32 = 0 mod 2^64), or is
 * past memory: refused at open, never a too-small buffer lent to next(). */
static int wrap_open(void **inst, const loom_source_args *a, loom_elem_spec *spec, loom_shape *max, loom_err *err)
{
    (void)err;
    *inst = calloc(1, sizeof(int64_t));
    spec->n = 1;
    snprintf(spec->name[0], LOOM_NAME_MAX, "x");
    spec->dtype[0] = LOOM_U8;
    int64_t d = a->options && a->options->n && strstr(a->options->value[0], "past_memory") ? INT64_C(1) << 31 : INT64_C(1) << 32;
    spec->shape[0] = max[0] = (loom_shape){2, {d, d}};
    return LOOM_OK;
}
static const char *const wrap_options[] = {"mode", NULL};
static const loom_source_ops wrapping = {
    .version = LOOM_SOURCE_OPS_VERSION, .name = "wrapping", .options = wrap_options, .open = wrap_open,
    .cardinality = cnt_card, .rewind = cnt_rewind, .next = cnt_next, .save = cnt_save, .restore = cnt_restore,
    .close = free,
};

static void test_source_max_shape_checked(void)
{
    loom_err err = {0};
    if (!loom_registry_find(LOOM_REG_SOURCE, "wrapping", NULL))
        CHECK(loom_registry_add(LOOM_REG_SOURCE, "wrapping", &wrapping, "test", &err) == LOOM_OK);
    loom_iter *it = npy_open("source: { type = \"wrapping\"; };", 0, &err);
    CHECK(it == NULL);
    CHECK_CONTAINS(err.msg, "source \"wrapping\": feature \"x\" has a bad dtype or max shape");
    loom_iter_close(it);
    it = npy_open("source: { type = \"wrapping\"; options: { mode = \"past_memory\"; }; };", 0, &err);
    CHECK(it == NULL);
    CHECK_CONTAINS(err.msg, "a max shape of 4611686018427387904 values of uint8 is too large for memory");
    loom_iter_close(it);
}

/* Every byte of every image of two epochs, through cutout with `parallel` calls. */
static int cutout_pass(int parallel, int threads, uint8_t out[2][5][6])
{
    char cfg[512];
    snprintf(cfg, sizeof cfg, "%s transforms = ({ op = \"map\"; plugin = \"image_ops:cutout\"; parallel = %d;\n"
                              " args: { size = 2; value = 255; }; });", NPY_SRC, parallel);
    loom_err err = {0};
    loom_iter *it = npy_open(cfg, threads, &err);
    CHECK_MSG(it, "%s: %s", err.where, err.msg);
    if (!it) return 0;
    int n = 0;
    for (int ep = 0; ep < 2; ep++) {
        loom_elem *e;
        if (ep) loom_iter_rewind(it, ep, &err);
        for (int i = 0; i < 5 && loom_iter_next(it, &e, &err) == LOOM_OK; i++, n++) memcpy(out[ep][i], e->t[0].data, 6);
    }
    loom_iter_close(it);
    return n;
}

static void test_cutout(void)
{
    uint8_t a[2][5][6], b[2][5][6];
    CHECK(cutout_pass(1, 0, a) == 10);
    CHECK(cutout_pass(3, 2, b) == 10);
    CHECK_MSG(!memcmp(a, b, sizeof a), "parallel 3 on 2 threads differs from parallel 1");
    int differs = 0;
    for (int ep = 0; ep < 2; ep++)
        for (int i = 0; i < 5; i++) {
            int erased = 0, kept = 0; /* a 2x2 square clipped at the border: 1 to 4 pixels, the rest unchanged */
            for (int p = 0; p < 6; p++) {
                int orig = i % 2 ? 100 : 10 * i + p;
                erased += a[ep][i][p] == 255, kept += a[ep][i][p] == orig;
            }
            CHECK_MSG(erased >= 1 && erased <= 4 && erased + kept == 6, "epoch %d image %d: %d erased", ep, i, erased);
            differs |= memcmp(a[0][i], a[1][i], 6) != 0;
        }
    CHECK_MSG(differs, "both epochs erased the same squares");
}

/* 30 float32 values of noise over zero images, with `parallel` calls. */
static void noise_pass(int parallel, float out[30])
{
    char cfg[512];
    snprintf(cfg, sizeof cfg, "source: { type = \"npy\"; options: { image = \"xf.npy\"; }; };\n"
                              "transforms = ({ op = \"map\"; plugin = \"image_ops:gaussian_noise\"; parallel = %d;"
                              " args: { std = 0.5; }; });", parallel);
    loom_err err = {0};
    loom_iter *it = npy_open(cfg, 2, &err);
    CHECK_MSG(it, "%s: %s", err.where, err.msg);
    loom_elem *e;
    for (int i = 0; it && i < 5 && loom_iter_next(it, &e, &err) == LOOM_OK; i++) memcpy(out + 6 * i, e->t[0].data, 24);
    loom_iter_close(it);
}

static void test_gaussian_noise(void)
{
    float a[30] = {0}, b[30] = {0};
    noise_pass(1, a);
    noise_pass(2, b);
    CHECK_MSG(!memcmp(a, b, sizeof a), "parallel 2 differs from parallel 1");
    double sq = 0;
    for (int i = 0; i < 30; i++) sq += (double)a[i] * a[i];
    double sd = sqrt(sq / 30);
    CHECK_MSG(sd > 0.3 && sd < 0.75, "noise of std 0.5 has sample std %g", sd);
}

static void test_min_std_filter(void)
{
    loom_err err = {0};
    loom_iter *it = npy_open(NPY_SRC " transforms = ({ op = \"filter\"; plugin = \"image_ops:min_std\"; "
                             "args: { min = 0.5; }; });", 0, &err);
    CHECK_MSG(it, "%s: %s", err.where, err.msg);
    if (!it) return;
    loom_elem *e;
    int64_t kept[5], n = 0;
    while (n < 5 && loom_iter_next(it, &e, &err) == LOOM_OK) kept[n++] = *(int64_t *)e->t[1].data;
    CHECK_MSG(n == 3 && kept[0] == 0 && kept[1] == 2 && kept[2] == 4, "kept %lld", (long long)n); /* odd ones are blank */
    loom_iter_close(it);
}

static void test_transform_errors(void)
{
    loom_err e = npy_error(NPY_SRC "\n transforms = ({ op = \"map\"; plugin = \"image_ops:cutot\"; });");
    CHECK_MSG(strstr(e.where, "c.cfg:4"), "where = %s", e.where); /* the transform's line */
    CHECK_CONTAINS(e.msg, "image_ops has no map function \"cutot\" (maps: cutout, gaussian_noise)");
    e = npy_error(NPY_SRC " transforms = ({ op = \"map\"; plugin = \"image_ops:cutout\";\n args: {\n size = 0; }; });");
    CHECK_MSG(strstr(e.where, "c.cfg:5"), "where = %s", e.where);
    CHECK_CONTAINS(e.msg, "args.size: expected a number in [1, 1.04858e+06], got \"0\"");
    e = npy_error(NPY_SRC " transforms = ({ op = \"map\"; plugin = \"image_ops:cutout\";\n args: { sise = 2; }; });");
    CHECK_MSG(strstr(e.where, "c.cfg:4"), "where = %s", e.where);
    CHECK_CONTAINS(e.msg, "args.sise: unknown argument of image_ops:cutout (valid: feature, size, p, value)");
    e = npy_error(NPY_SRC " transforms = ({ op = \"map\"; plugin = \"image_ops:gaussian_noise\"; });");
    CHECK_CONTAINS(e.msg, "feature \"image\" must be one unbatched image (H, W) or (H, W, C) of float32");
    e = npy_error(NPY_SRC " transforms = ({ op = \"map\"; plugin = \"image_opz:cutout\"; });");
    CHECK_CONTAINS(e.msg, "no map provider \"image_opz\" is registered (have: ");
    CHECK_CONTAINS(e.msg, "image_ops");
}


/* ---- layer_prelu: the example plugin layer ---------------------------------- */

static loom_layer_args prelu_args(const char *type, const loom_shape *in, loom_layer_settings *st)
{
    return (loom_layer_args){.size = sizeof(loom_layer_args), .type = type, .name = "prelu_1",
                             .where = "c.cfg:7", .settings = st, .n_in = 1, .in = in, .max_batch = 8};
}

static void test_layer_prelu(void)
{
    loom_err err = {0};
    int rc = loom_plugin_load_file(so_path("plugins", "layer_prelu.so"), NULL, &err);
    CHECK_MSG(rc == LOOM_OK, "%s: %s", err.where, err.msg);
    const char *origin = NULL;
    const loom_layer_ops *ops = loom_layer_plugin_find("prelu", &origin);
    CHECK(ops && origin && strstr(origin, "layer_prelu.so"));
    if (!ops) return;
    /* gradcheck passes: dx and d alpha match central differences, the same bits on chunks */
    loom_shape in = {.rank = 2, .dim = {3, 4}};
    loom_layer_settings st = {.n = 1, .key = {"alpha_init"}, .value = {"0.3"}, .where = {"c.cfg:8"}};
    loom_layer_args a = prelu_args("prelu", &in, &st);
    double e = 1;
    rc = loom_layer_plugin_check(ops, &a, 5, 42, 1e-2, &e, &err);
    CHECK_MSG(rc == LOOM_OK && e < 1e-2, "rc %d err %g: %s", rc, e, err.msg);
    /* its settings and shapes are checked, naming the config line */
    loom_layer_settings bad = {.n = 1, .key = {"alpha_init"}, .value = {"x"}, .where = {"c.cfg:9"}};
    a = prelu_args("prelu", &in, &bad);
    void *inst = NULL;
    loom_layer_plan plan = {0};
    CHECK(ops->build(&inst, &a, &plan, &err) == LOOM_ECONFIG && !strcmp(err.where, "c.cfg:9") &&
          !strcmp(err.msg, "alpha_init = x is not a number"));
    loom_shape scalar = {.rank = 0};
    a = prelu_args("prelu", &scalar, &st);
    CHECK(ops->build(&inst, &a, &plan, &err) == LOOM_ESHAPE && strstr(err.msg, "rank 0"));
    /* a broken backward fails gradcheck, naming the layer and the value */
    rc = loom_plugin_load_file(so_path("tests/plugins", "layer_prelu_broken.so"), NULL, &err);
    CHECK_MSG(rc == LOOM_OK, "%s: %s", err.where, err.msg);
    const loom_layer_ops *broken = loom_layer_plugin_find("prelu_broken", NULL);
    CHECK(broken != NULL);
    if (broken) {
        a = prelu_args("prelu_broken", &in, &st);
        rc = loom_layer_plugin_check(broken, &a, 5, 42, 1e-2, &e, &err);
        CHECK_MSG(rc == LOOM_ENUMERIC && e > 0.5 && !strcmp(err.where, "c.cfg:7") &&
                      strstr(err.msg, "layer \"prelu_1\" (prelu_broken) fails gradcheck") &&
                      strstr(err.msg, "d/d input 0"),
                  "rc %d err %g: %s", rc, e, err.msg);
    }
    /* a layer vtable of another version is refused, naming both */
    rc = loom_plugin_load_file(so_path("tests/plugins", "layer_prelu_v99.so"), NULL, &err);
    CHECK_MSG(rc == LOOM_EPLUGIN && strstr(err.msg, "layer \"prelu_v99\": version 99, this loom speaks 1"), "%s", err.msg);
    CHECK(loom_layer_plugin_find("prelu_v99", NULL) == NULL);
}

static const loom_test tests[] = {
    {"layer_prelu", test_layer_prelu},
    {"refuses_text_file", test_refuses_text_file},
    {"refuses_other_abi", test_refuses_other_abi},
    {"refuses_abi_1", test_refuses_abi_1},
    {"refuses_missing_entry", test_refuses_missing_entry},
    {"refuses_failing_init", test_refuses_failing_init},
    {"refuses_silent_init", test_refuses_silent_init},
    {"refuses_truncated", test_refuses_truncated},
    {"refuses_taken_name", test_refuses_taken_name},
    {"halving_doubling_all_reduce", test_halving_doubling_all_reduce},
    {"halving_doubling_broadcast", test_halving_doubling_broadcast},
    {"local_sgd_averages", test_local_sgd_averages},
    {"local_sgd_matches_sync_sgd", test_local_sgd_matches_sync_sgd},
    {"local_sgd_deterministic", test_local_sgd_deterministic},
    {"local_sgd_options", test_local_sgd_options},
    {"require", test_require},
    {"image_ops_registers", test_image_ops_registers},
    {"npy_source", test_npy_source},
    {"npy_errors", test_npy_errors},
    {"npy_nonfinite_after_resume", test_npy_nonfinite_after_resume},
    {"source_options_checked", test_source_options_checked},
    {"source_max_shape_checked", test_source_max_shape_checked},
    {"builtin_sources_registered", test_builtin_sources_registered},
    {"builtin_transforms_registered", test_builtin_transforms_registered},
    {"cutout", test_cutout},
    {"gaussian_noise", test_gaussian_noise},
    {"min_std_filter", test_min_std_filter},
    {"transform_errors", test_transform_errors},
    {0},
};

int main(void)
{
    loom_log_set_level(LOOM_LOG_WARN);
    loom_err err = {0};
    if (loom_blas_init(1, &err)) {
        printf("Bail out! %s\n", err.msg);
        return 1;
    }
    int rc = loom_test_run(tests);
    if (strcmp(npy_dir + strlen(npy_dir) - 6, "XXXXXX")) { /* made: remove the fixtures */
        const char *files[] = {"x.npy", "y.npy", "w.npy", "y4.npy", "xf.npy", "big.npy", "short.npy", "text.npy", "c.cfg"};
        char path[256];
        for (size_t i = 0; i < sizeof files / sizeof files[0]; i++)
            snprintf(path, sizeof path, "%s/%s", npy_dir, files[i]), unlink(path);
        rmdir(npy_dir);
    }
    return rc;
}
