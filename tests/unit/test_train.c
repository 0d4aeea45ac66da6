/* test_train.c - the checkpoint module: bit-exact save/load round trips of
 * parameters, optimizer slots and blobs; file naming, latest and pruning with
 * the `checkpoint` index; truncated, bit-flipped and hand-crafted files;
 * checkpoints of another model or optimizer; unwritable directories; and
 * allocation failure at every point of save, load and latest.
 * Every test works in its own directory under one mkdtemp root, removed at exit. */
#include "harness.h"
#include "test_util.h"
#include "train/train.h"

#include <dirent.h>
#include <errno.h>
#include <float.h>
#include <math.h>
#include <ftw.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

static loom_err err;
static char root_[256];
static int dir_seq_;

/* ---- helpers ---------------------------------------------------------------- */

/* A fresh empty directory for one test. */
static void new_dir(char out[LOOM_PATH_MAX])
{
    snprintf(out, LOOM_PATH_MAX, "%s/d%03d", root_, dir_seq_++);
    if (mkdir(out, 0755) != 0) {
        printf("# mkdir %s: %s\n", out, strerror(errno));
        abort();
    }
}

static void touch(const char *dir, const char *name, const char *content)
{
    char p[LOOM_PATH_MAX + 64];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "wb");
    if (!f) abort();
    fputs(content, f);
    fclose(f);
}

static int exists(const char *dir, const char *name)
{
    char p[LOOM_PATH_MAX + 64];
    struct stat st;
    snprintf(p, sizeof p, "%s/%s", dir, name);
    return stat(p, &st) == 0;
}

/* Number of entries in dir whose name contains `part` (NULL: all but . and ..). */
static int count_entries(const char *dir, const char *part)
{
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") && (!part || strstr(e->d_name, part))) n++;
    closedir(d);
    return n;
}

static void spit(const char *path, const void *data, size_t len)
{
    FILE *f = fopen(path, "wb");
    if (!f) abort();
    if (len && fwrite(data, 1, len, f) != len) abort();
    fclose(f);
}

/* Overwrites one byte in place: rewriting a whole file with O_TRUNC makes
 * ext4 flush it on close (auto_da_alloc), which costs ms per call. */
static void poke(const char *path, size_t pos, uint8_t v)
{
    FILE *f = fopen(path, "r+b");
    if (!f || fseek(f, (long)pos, SEEK_SET) != 0 || fputc(v, f) == EOF) abort();
    fclose(f);
}

static void put_le32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get_le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Recomputes the file checksum in the trailer after a deliberate edit. */
static void reseal(uint8_t *d, size_t len) { put_le32(d + len - 4, loom_crc32c(d, len - 12)); }

/* A model spec as config.c would resolve it: flatten_0, then dense layers
 * dense_1.. with `units`, glorot_uniform kernels, biases unless no_bias_last. */
static loom_model *new_model_(const int *units, int n_dense, bool no_bias_last)
{
    loom_model_spec *s = calloc(1, sizeof *s);
    if (!s) abort();
    snprintf(s->loc.file, sizeof s->loc.file, "test_train.cfg");
    s->loc.line = 10;
    snprintf(s->loc.path, sizeof s->loc.path, "model");
    snprintf(s->input, sizeof s->input, "image");
    snprintf(s->label, sizeof s->label, "label");
    s->loss = LOOM_LOSS_SPARSE_SOFTMAX_CE;
    s->n_layers = 1 + n_dense;
    loom_layer_spec *l = &s->layer[0];
    l->kind = LOOM_LAYER_FLATTEN;
    snprintf(l->name, sizeof l->name, "flatten_0");
    snprintf(l->loc.file, sizeof l->loc.file, "test_train.cfg");
    l->loc.line = 12;
    snprintf(l->loc.path, sizeof l->loc.path, "model.layers.[0]");
    for (int i = 0; i < n_dense; i++) {
        l = &s->layer[1 + i];
        l->kind = LOOM_LAYER_DENSE;
        snprintf(l->name, sizeof l->name, "dense_%d", 1 + i);
        snprintf(l->loc.file, sizeof l->loc.file, "test_train.cfg");
        l->loc.line = 13 + i;
        snprintf(l->loc.path, sizeof l->loc.path, "model.layers.[%d]", 1 + i);
        l->units = units[i];
        l->activation = i + 1 < n_dense ? LOOM_ACT_RELU : LOOM_ACT_NONE;
        l->kernel_init = LOOM_INIT_GLOROT_UNIFORM;
        l->use_bias = !(no_bias_last && i + 1 == n_dense);
    }
    loom_shape in = {2, {4, 4}}, lab = {0, {0}};
    loom_model *m = NULL;
    int rc = loom_model_new(&m, s, &in, LOOM_F32, &lab, LOOM_U8, 2, &err);
    free(s);
    if (rc) {
        printf("# loom_model_new: %s: %s\n", err.where, err.msg);
        return NULL;
    }
    return m;
}

static loom_model *new_model(int u1, int u2)
{
    int u[2] = {u1, u2};
    return new_model_(u, 2, false);
}

static loom_optimizer *new_opt(loom_model *m, loom_opt_kind kind)
{
    loom_optimizer_spec s;
    memset(&s, 0, sizeof s);
    s.kind = kind;
    snprintf(s.loc.file, sizeof s.loc.file, "test_train.cfg");
    s.loc.line = 30;
    s.learning_rate = 0.01;
    s.momentum = 0.9;
    s.beta1 = 0.9;
    s.beta2 = 0.999;
    s.epsilon = 1e-7;
    s.schedule.kind = LOOM_SCHED_CONSTANT;
    loom_optimizer *o = NULL;
    if (loom_optimizer_new(&o, &s, loom_model_num_params(m), &err)) {
        printf("# loom_optimizer_new: %s\n", err.msg);
        return NULL;
    }
    return o;
}

/* Normal floats, plus the finite values a lossy path would mangle: -0, a
 * denormal, the largest float and the smallest normal one. (A NaN or an
 * infinity is refused on load: test_nonfinite_weights.) */
static void fill(float *p, int64_t n, uint64_t seed)
{
    loom_rng r;
    loom_rng_init(&r, seed, 7, 8, 9);
    for (int64_t i = 0; i < n; i++) p[i] = loom_rng_normal(&r);
    if (n >= 4) {
        p[0] = -0.0f;
        p[1] = 1e-40f;
        p[2] = FLT_MAX;
        p[3] = -FLT_MIN;
    }
}

static void randomize(loom_model *m, loom_optimizer *o, uint64_t seed)
{
    int64_t P = loom_model_num_params(m);
    fill(loom_model_params(m), P, seed);
    if (o && loom_optimizer_num_slots(o)) fill(loom_optimizer_slots(o), P * loom_optimizer_num_slots(o), seed + 1);
}

/* Sentinel contents, so "unchanged" and "overwritten" are both visible. */
static void sentinel(loom_model *m, loom_optimizer *o)
{
    int64_t P = loom_model_num_params(m);
    for (int64_t i = 0; i < P; i++) loom_model_params(m)[i] = 1234.5f;
    for (int64_t i = 0; o && i < P * loom_optimizer_num_slots(o); i++) loom_optimizer_slots(o)[i] = -77.25f;
}

static int params_eq(loom_model *a, loom_model *b)
{
    int64_t P = loom_model_num_params(a);
    return P == loom_model_num_params(b) && !memcmp(loom_model_params(a), loom_model_params(b), (size_t)P * 4);
}

static int slots_eq(loom_model *m, loom_optimizer *a, loom_optimizer *b)
{
    int64_t n = loom_model_num_params(m) * loom_optimizer_num_slots(a);
    return loom_optimizer_num_slots(a) == loom_optimizer_num_slots(b) &&
           !memcmp(loom_optimizer_slots(a), loom_optimizer_slots(b), (size_t)n * 4);
}

static int all_sentinel(loom_model *m, loom_optimizer *o)
{
    int64_t P = loom_model_num_params(m);
    for (int64_t i = 0; i < P; i++)
        if (loom_model_params(m)[i] != 1234.5f) return 0;
    for (int64_t i = 0; o && i < P * loom_optimizer_num_slots(o); i++)
        if (loom_optimizer_slots(o)[i] != -77.25f) return 0;
    return 1;
}

/* The trainer's and the iterator's state as the trainer would hand them over. */
static void make_blobs(loom_buf *tr, loom_buf *it)
{
    loom_buf_init(tr);
    loom_buf_init(it);
    loom_buf_put_i64(tr, 1234);      /* step */
    loom_buf_put_i64(tr, 3);         /* epoch */
    loom_buf_put_f64(tr, 0.4321);    /* running loss */
    loom_buf_put_str(tr, "trainer");
    loom_rng r;
    loom_rng_init(&r, 99, 1, 2, 3);
    for (int i = 0; i < 3000; i++) {
        uint8_t b = (uint8_t)(i < 1500 ? loom_rng_u32(&r) : (uint32_t)(i % 7)); /* half noise, half compressible */
        loom_buf_put(it, &b, 1);
    }
}

static int buf_eq(const loom_buf *a, const loom_buf *b)
{
    return a->len == b->len && (a->len == 0 || !memcmp(a->data, b->data, a->len));
}

/* A saved momentum-or-adam model with blobs, ready for loading elsewhere. */
typedef struct saved {
    char            dir[LOOM_PATH_MAX];
    char            path[LOOM_PATH_MAX];
    loom_model     *m;
    loom_optimizer *o;
    loom_buf        tr, it;
} saved;

static int save_fixture(saved *s, int u1, int u2, loom_opt_kind kind, int64_t step)
{
    memset(s, 0, sizeof *s);
    new_dir(s->dir);
    s->m = new_model(u1, u2);
    if (!s->m) return -1;
    s->o = new_opt(s->m, kind);
    if (!s->o) return -1;
    randomize(s->m, s->o, 1000 + (uint64_t)step);
    make_blobs(&s->tr, &s->it);
    int rc = loom_ckpt_save(s->dir, step, s->m, s->o, &s->tr, &s->it, 5, s->path, &err);
    if (rc) printf("# loom_ckpt_save: %s: %s\n", err.where, err.msg);
    return rc;
}

static void saved_fini(saved *s)
{
    loom_model_free(s->m);
    loom_optimizer_free(s->o);
    loom_buf_fini(&s->tr);
    loom_buf_fini(&s->it);
}

/* A checkpoint to damage: one saved (5, 3 units, optimizer kind, step 3), its
 * bytes, bad = name in its directory for the damaged copies, and a fresh
 * model + optimizer of the same kind to load them into. */
typedef struct damaged {
    saved           s;
    uint8_t        *d;
    size_t          len;
    char            bad[LOOM_PATH_MAX + 16];
    loom_model     *m;
    loom_optimizer *o;
} damaged;

static bool damaged_init(damaged *x, loom_opt_kind kind, const char *name)
{
    memset(x, 0, sizeof *x);
    CHECK(save_fixture(&x->s, 5, 3, kind, 3) == LOOM_OK);
    x->d = slurp(x->s.path, &x->len);
    CHECK(x->d && x->len > 100);
    if (!x->d) {
        saved_fini(&x->s);
        return false;
    }
    snprintf(x->bad, sizeof x->bad, "%s/%s", x->s.dir, name);
    x->m = new_model(5, 3);
    x->o = new_opt(x->m, kind);
    return true;
}

static void damaged_fini(damaged *x)
{
    free(x->d);
    loom_model_free(x->m);
    loom_optimizer_free(x->o);
    saved_fini(&x->s);
}

/* Load `path` into a fresh model (u1, u2) + optimizer of `kind` (or none);
 * returns the code, err filled. */
static int load_into(const char *path, int u1, int u2, int kind /* -1: o = NULL */)
{
    loom_model *m = new_model(u1, u2);
    loom_optimizer *o = kind >= 0 ? new_opt(m, (loom_opt_kind)kind) : NULL;
    loom_err_clear(&err);
    int rc = loom_ckpt_load(path, m, o, NULL, NULL, &err);
    loom_model_free(m);
    loom_optimizer_free(o);
    return rc;
}

/* ---- round trips -------------------------------------------------------------- */

static void roundtrip(loom_opt_kind kind)
{
    saved s;
    CHECK(save_fixture(&s, 5, 3, kind, 7) == LOOM_OK);
    char want[LOOM_PATH_MAX + 16];
    snprintf(want, sizeof want, "%s/ckpt-7.loom", s.dir);
    CHECK_MSG(!strcmp(s.path, want), "path %s", s.path);
    CHECK(exists(s.dir, "ckpt-7.loom"));
    CHECK(exists(s.dir, "checkpoint"));
    CHECK(count_entries(s.dir, ".tmp") == 0);
    CHECK(count_entries(s.dir, NULL) == 2);
    CHECK(loom_model_num_param_tensors(s.m) == 4);
    CHECK(loom_model_num_params(s.m) == 16 * 5 + 5 + 5 * 3 + 3);

    loom_model *m = new_model(5, 3);
    loom_optimizer *o = new_opt(m, kind);
    sentinel(m, o);
    loom_buf tr, it;
    memset(&tr, 0xab, sizeof tr); /* the loader initialises the blobs itself (train.c relies on it) */
    memset(&it, 0xab, sizeof it);
    int rc = loom_ckpt_load(s.path, m, o, &tr, &it, &err);
    CHECK_MSG(rc == LOOM_OK, "%s: %s", err.where, err.msg);
    CHECK(params_eq(s.m, m));
    CHECK(slots_eq(m, s.o, o));
    CHECK(buf_eq(&tr, &s.tr));
    CHECK(buf_eq(&it, &s.it));
    CHECK(tr.pos == 0 && !tr.failed && it.pos == 0 && !it.failed);
    /* the blob reads back as the trainer wrote it */
    CHECK(loom_buf_get_i64(&tr) == 1234);
    CHECK(loom_buf_get_i64(&tr) == 3);
    CHECK(loom_buf_get_f64(&tr) == 0.4321);
    char name[16];
    CHECK(loom_buf_get_str(&tr, name, sizeof name) == 0 && !strcmp(name, "trainer"));
    loom_buf_fini(&tr);
    loom_buf_fini(&it);

    /* the source is untouched by saving; a second load overwrites everything again */
    randomize(m, o, 5);
    CHECK(loom_ckpt_load(s.path, m, o, NULL, NULL, &err) == LOOM_OK);
    CHECK(params_eq(s.m, m));
    CHECK(slots_eq(m, s.o, o));

    /* saving the loaded model again gives the same bytes */
    char dir2[LOOM_PATH_MAX], path2[LOOM_PATH_MAX];
    new_dir(dir2);
    CHECK(loom_ckpt_save(dir2, 7, m, o, &s.tr, &s.it, 5, path2, &err) == LOOM_OK);
    size_t n1, n2;
    uint8_t *a = slurp(s.path, &n1), *b = slurp(path2, &n2);
    CHECK(a && b && n1 == n2 && !memcmp(a, b, n1));
    free(a);
    free(b);

    loom_model_free(m);
    loom_optimizer_free(o);
    saved_fini(&s);
}

static void test_roundtrip_momentum(void) { roundtrip(LOOM_OPT_MOMENTUM); }
static void test_roundtrip_adam(void) { roundtrip(LOOM_OPT_ADAM); }

static void test_roundtrip_sgd_empty_blob(void)
{
    char dir[LOOM_PATH_MAX], path[LOOM_PATH_MAX];
    new_dir(dir);
    loom_model *m = new_model(5, 3), *m2 = new_model(5, 3);
    loom_optimizer *o = new_opt(m, LOOM_OPT_SGD), *o2 = new_opt(m2, LOOM_OPT_SGD);
    CHECK(loom_optimizer_num_slots(o) == 0);
    randomize(m, o, 3);
    loom_buf empty;
    loom_buf_init(&empty);
    /* an empty trainer blob, no iterator blob */
    CHECK(loom_ckpt_save(dir, 0, m, o, &empty, NULL, 3, path, &err) == LOOM_OK);
    CHECK(exists(dir, "ckpt-0.loom"));
    sentinel(m2, o2);
    loom_buf tr, it;
    memset(&tr, 0xab, sizeof tr);
    memset(&it, 0xab, sizeof it);
    int rc = loom_ckpt_load(path, m2, o2, &tr, &it, &err);
    CHECK_MSG(rc == LOOM_OK, "%s", err.msg);
    CHECK(params_eq(m, m2));
    CHECK(tr.len == 0);
    /* absent from the file: left empty, safe to fini */
    CHECK(it.len == 0 && it.cap == 0 && it.data == NULL);
    loom_buf_fini(&tr);
    loom_buf_fini(&it);
    loom_model_free(m);
    loom_model_free(m2);
    loom_optimizer_free(o);
    loom_optimizer_free(o2);
}

/* evaluate/predict: no optimizer; the slots in the file are skipped. */
static void test_load_without_optimizer(void)
{
    for (int k = LOOM_OPT_MOMENTUM; k <= LOOM_OPT_ADAM; k++) {
        saved s;
        CHECK(save_fixture(&s, 5, 3, (loom_opt_kind)k, 11) == LOOM_OK);
        loom_model *m = new_model(5, 3);
        sentinel(m, NULL);
        loom_buf tr;
        int rc = loom_ckpt_load(s.path, m, NULL, &tr, NULL, &err);
        CHECK_MSG(rc == LOOM_OK, "%s", err.msg);
        CHECK(params_eq(s.m, m));
        CHECK(buf_eq(&tr, &s.tr));
        loom_buf_fini(&tr);
        /* and with no blobs wanted at all */
        sentinel(m, NULL);
        CHECK(loom_ckpt_load(s.path, m, NULL, NULL, NULL, &err) == LOOM_OK);
        CHECK(params_eq(s.m, m));
        loom_model_free(m);
        saved_fini(&s);
    }
}

/* ---- names, latest, pruning, index ------------------------------------------ */

static void test_latest(void)
{
    char dir[LOOM_PATH_MAX], path[LOOM_PATH_MAX];
    int64_t step = -1;
    new_dir(dir);
    /* empty and missing directories */
    CHECK(loom_ckpt_latest(dir, path, &step, &err) == LOOM_EEOF);
    char missing[LOOM_PATH_MAX + 16];
    snprintf(missing, sizeof missing, "%s/nope", dir);
    CHECK(loom_ckpt_latest(missing, path, &step, &err) == LOOM_EEOF);

    loom_model *m = new_model(5, 3);
    loom_optimizer *o = new_opt(m, LOOM_OPT_MOMENTUM);
    randomize(m, o, 1);
    /* numeric, not lexical, order; saved out of order */
    const int64_t steps[] = {9, 100, 2, 10};
    for (int i = 0; i < 4; i++) {
        CHECK(loom_ckpt_save(dir, steps[i], m, o, NULL, NULL, 0, path, &err) == LOOM_OK);
        CHECK(loom_ckpt_latest(dir, path, &step, &err) == LOOM_OK);
        CHECK(step == (i == 0 ? 9 : 100));
    }
    char want[LOOM_PATH_MAX + 16];
    snprintf(want, sizeof want, "%s/ckpt-100.loom", dir);
    CHECK_MSG(!strcmp(path, want), "%s", path);

    /* names that are not checkpoints, several with higher "steps" */
    touch(dir, "ckpt-5000.loom.tmp.4242", "partial");
    touch(dir, "ckpt-5001.loom.tmp", "partial");
    touch(dir, "ckpt-abc.loom", "x");
    touch(dir, "ckpt-5002.loom.bak", "x");
    touch(dir, "ckpt-.loom", "x");
    touch(dir, "ckpt--5003.loom", "x");
    touch(dir, "xckpt-5004.loom", "x");
    touch(dir, "ckpt-5005.loomx", "x");
    touch(dir, "ckpt-5006", "x");
    touch(dir, "CKPT-5007.loom", "x");
    touch(dir, "ckpt-12x.loom", "x");
    touch(dir, "checkpoint.tmp.1", "x");
    /* digits out of range, leading zeros and signs: strtoll saturated the first to INT64_MAX (latest forever) */
    touch(dir, "ckpt-99999999999999999999999.loom", "x");
    touch(dir, "ckpt-9223372036854775807.loom", "x");
    touch(dir, "ckpt-9007199254740993.loom", "x");
    touch(dir, "ckpt-0500.loom", "x");
    touch(dir, "ckpt-+600.loom", "x");
    touch(dir, "ckpt- 700.loom", "x");
    step = -1;
    CHECK(loom_ckpt_latest(dir, path, &step, &err) == LOOM_OK);
    CHECK(step == 100);
    CHECK_MSG(!strcmp(path, want), "%s", path);

    /* a directory is never a checkpoint dir's "file"; a regular file is not a directory */
    char file[LOOM_PATH_MAX + 16];
    snprintf(file, sizeof file, "%s/ckpt-9.loom", dir);
    loom_err_clear(&err);
    int rc = loom_ckpt_latest(file, path, &step, &err);
    CHECK(rc != LOOM_OK && rc != LOOM_EEOF);
    CHECK_CONTAINS(err.where, "ckpt-9.loom");

    loom_model_free(m);
    loom_optimizer_free(o);
}

/* The `checkpoint` file, read back line by line. */
static int read_index(const char *dir, char lines[16][128])
{
    char p[LOOM_PATH_MAX + 16];
    snprintf(p, sizeof p, "%s/checkpoint", dir);
    FILE *f = fopen(p, "r");
    if (!f) return -1;
    int n = 0;
    while (n < 16 && fgets(lines[n], 128, f)) n++;
    fclose(f);
    return n;
}

static void test_keep_prunes_oldest(void)
{
    char dir[LOOM_PATH_MAX], path[LOOM_PATH_MAX], lines[16][128];
    new_dir(dir);
    loom_model *m = new_model(5, 3);
    loom_optimizer *o = new_opt(m, LOOM_OPT_ADAM);
    randomize(m, o, 2);
    for (int step = 1; step <= 6; step++) {
        CHECK(loom_ckpt_save(dir, step * 10, m, o, NULL, NULL, 3, path, &err) == LOOM_OK);
        int kept = step < 3 ? step : 3;
        CHECK(count_entries(dir, "ckpt-") == kept);
        int n = read_index(dir, lines);
        CHECK(n == 1 + kept);
        char want[128];
        snprintf(want, sizeof want, "model_checkpoint_path: \"ckpt-%d.loom\"\n", step * 10);
        CHECK_MSG(n > 0 && !strcmp(lines[0], want), "%s", n > 0 ? lines[0] : "");
        for (int i = 0; i < kept && 1 + i < n; i++) {
            snprintf(want, sizeof want, "all_model_checkpoint_paths: \"ckpt-%d.loom\"\n", (step - kept + 1 + i) * 10);
            CHECK_MSG(!strcmp(lines[1 + i], want), "line %d: %s", 1 + i, lines[1 + i]);
        }
    }
    CHECK(!exists(dir, "ckpt-10.loom") && !exists(dir, "ckpt-30.loom"));
    CHECK(exists(dir, "ckpt-40.loom") && exists(dir, "ckpt-50.loom") && exists(dir, "ckpt-60.loom"));
    CHECK(count_entries(dir, ".tmp") == 0);
    CHECK(count_entries(dir, NULL) == 4);
    /* a foreign file in the directory is neither pruned nor listed */
    touch(dir, "notes.txt", "keep me");
    CHECK(loom_ckpt_save(dir, 70, m, o, NULL, NULL, 1, path, &err) == LOOM_OK);
    CHECK(exists(dir, "notes.txt"));
    CHECK(count_entries(dir, "ckpt-") == 1 && exists(dir, "ckpt-70.loom"));
    CHECK(read_index(dir, lines) == 2);
    CHECK(!strcmp(lines[1], "all_model_checkpoint_paths: \"ckpt-70.loom\"\n"));

    /* keep = 0 keeps everything */
    char dir2[LOOM_PATH_MAX];
    new_dir(dir2);
    for (int step = 1; step <= 7; step++) CHECK(loom_ckpt_save(dir2, step, m, o, NULL, NULL, 0, path, &err) == LOOM_OK);
    CHECK(count_entries(dir2, "ckpt-") == 7);
    CHECK(read_index(dir2, lines) == 8);
    CHECK(!strcmp(lines[0], "model_checkpoint_path: \"ckpt-7.loom\"\n"));
    CHECK(!strcmp(lines[1], "all_model_checkpoint_paths: \"ckpt-1.loom\"\n"));
    loom_model_free(m);
    loom_optimizer_free(o);
}

/* ---- damaged files ------------------------------------------------------------ */

static void test_truncated(void)
{
    damaged x;
    if (!damaged_init(&x, LOOM_OPT_MOMENTUM, "ckpt-4.loom")) return;
    const size_t len = x.len;
    const size_t cuts[] = {0, 1, 10, 16, 27, 28, 40, len / 2, len - 13, len - 12, len - 4, len - 1};
    for (size_t i = 0; i < sizeof cuts / sizeof *cuts; i++) {
        spit(x.bad, x.d, cuts[i]);
        sentinel(x.m, x.o);
        loom_buf tr, it;
        loom_err_clear(&err);
        int rc = loom_ckpt_load(x.bad, x.m, x.o, &tr, &it, &err);
        CHECK_MSG(rc == LOOM_ECHECKPOINT, "cut at %zu: rc %d %s", cuts[i], rc, err.msg);
        CHECK_MSG(!strcmp(err.where, x.bad), "cut at %zu: where %s", cuts[i], err.where);
        CHECK_MSG(strstr(err.msg, "truncated") || strstr(err.msg, "not a Loom checkpoint"), "cut at %zu: %s", cuts[i],
                  err.msg);
        CHECK(err.hint[0] != 0);
        CHECK_MSG(all_sentinel(x.m, x.o), "cut at %zu changed the model", cuts[i]);
        CHECK(tr.len == 0 && it.len == 0);
        loom_buf_fini(&tr);
        loom_buf_fini(&it);
    }
    /* the truncated file is still the latest by name: refusing it is the caller's call */
    int64_t step;
    char latest[LOOM_PATH_MAX];
    CHECK(loom_ckpt_latest(x.s.dir, latest, &step, &err) == LOOM_OK && step == 4);
    damaged_fini(&x);
}

static void test_flipped_bytes(void)
{
    damaged x;
    if (!damaged_init(&x, LOOM_OPT_ADAM, "bad.loom")) return;
    spit(x.bad, x.d, x.len);
    int failures = 0;
    /* every byte, one mask; a few more masks at some positions */
    for (size_t pos = 0; pos < x.len && failures < 5; pos++) {
        const uint8_t masks[] = {0xff, 0x01, 0x80};
        int nm = pos % 97 == 0 || pos < 20 || pos + 20 > x.len ? 3 : 1;
        for (int k = 0; k < nm; k++) {
            poke(x.bad, pos, x.d[pos] ^ masks[k]);
            sentinel(x.m, x.o);
            loom_buf tr;
            loom_err_clear(&err);
            int rc = loom_ckpt_load(x.bad, x.m, x.o, &tr, NULL, &err);
            const char *want = pos < 8                                ? "not a Loom checkpoint"
                               : pos >= x.len - 12 && pos < x.len - 4 ? "truncated"
                                                                      : "corrupt";
            int ok = rc == LOOM_ECHECKPOINT && !strcmp(err.where, x.bad) && strstr(err.msg, want) &&
                     all_sentinel(x.m, x.o) && tr.len == 0;
            if (!ok) {
                failures++;
                CHECK_MSG(ok, "byte %zu ^ 0x%02x: rc %d, %s: %s", pos, masks[k], rc, err.where, err.msg);
            }
            loom_buf_fini(&tr);
        }
        poke(x.bad, pos, x.d[pos]);
    }
    /* the intact file still loads */
    CHECK(loom_ckpt_load(x.s.path, x.m, x.o, NULL, NULL, &err) == LOOM_OK && params_eq(x.s.m, x.m) &&
          slots_eq(x.m, x.s.o, x.o));
    damaged_fini(&x);
}

/* Files with a valid file checksum but a bad inside: only a buggy or hostile
 * writer makes these, so each check behind the checksum is exercised here. */
static void test_crafted_records(void)
{
    damaged x;
    if (!damaged_init(&x, LOOM_OPT_MOMENTUM, "crafted.loom")) return;
    const uint8_t *d = x.d;
    const size_t len = x.len;
    uint8_t *c = malloc(len);
    /* first record: kind@16 namelen@20 name@24 ("dense_1/kernel", 14) rank@38 dims@42 raw@58 stored@66 crc@74 frame@78 */
    CHECK(get_le32(d + 16) == 1 && get_le32(d + 20) == 14 && !memcmp(d + 24, "dense_1/kernel", 14));
    CHECK(get_le32(d + 38) == 2 && get_le32(d + 42) == 16 && get_le32(d + 50) == 5);
    struct {
        size_t      off;
        uint32_t    val;   /* written as u32 at off (xor 0xff into one byte when flip) */
        int         flip;
        const char *want;
    } cases[] = {
        {8, 2, 0, "version 2"},
        {12, get_le32(d + 12) + 1, 0, "runs past the end"},
        {12, 0xffffffffu, 0, "runs past the end"},
        {16, 7, 0, "unknown kind 7"},
        {38, 9, 0, "bad rank 9"},
        {38, 0x80000000u, 0, "bad rank"},
        {42, 17, 0, "has shape (17, 5) in the checkpoint, the model expects (16, 5)"},
        {58, 16 * 5 * 4 + 4, 0, "bytes for shape"},
        {74, 0, 1, "tensor \"dense_1/kernel\" is corrupt"},
        {80, 0, 1, "tensor \"dense_1/kernel\" is corrupt"},
        {100, 0, 1, "tensor \"dense_1/kernel\" is corrupt"},
        {24, 'x', 2, "tensor \"xense_1/kernel\" that this model does not have"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        memcpy(c, d, len);
        if (cases[i].flip == 1) c[cases[i].off] ^= 0xff;
        else if (cases[i].flip == 2) c[cases[i].off] = (uint8_t)cases[i].val;
        else put_le32(c + cases[i].off, cases[i].val);
        reseal(c, len);
        spit(x.bad, c, len);
        loom_buf tr, it;
        loom_err_clear(&err);
        int rc = loom_ckpt_load(x.bad, x.m, x.o, &tr, &it, &err);
        CHECK_MSG(rc == LOOM_ECHECKPOINT, "case %zu: rc %d", i, rc);
        CHECK_MSG(!strcmp(err.where, x.bad), "case %zu: where %s", i, err.where);
        CHECK_CONTAINS(err.msg, cases[i].want);
        CHECK(tr.len == 0 && it.len == 0);
        loom_buf_fini(&tr);
        loom_buf_fini(&it);
    }
    /* a resealed copy of the intact bytes is fine */
    memcpy(c, d, len);
    reseal(c, len);
    spit(x.bad, c, len);
    CHECK(loom_ckpt_load(x.bad, x.m, x.o, NULL, NULL, &err) == LOOM_OK && params_eq(x.s.m, x.m));
    /* gzip magic: read as gzip, refused as a checkpoint, naming the file
     * (ISIZE, the last 4 bytes, kept small: gunzip sizes its first buffer by it) */
    const uint8_t gz[] = {0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 0, 1, 0, 0};
    spit(x.bad, gz, sizeof gz);
    loom_err_clear(&err);
    CHECK(loom_ckpt_load(x.bad, x.m, x.o, NULL, NULL, &err) == LOOM_ECHECKPOINT);
    CHECK(!strcmp(err.where, x.bad));
    CHECK_CONTAINS(err.msg, "gzip");
    free(c);
    damaged_fini(&x);
}

/* A checkpoint whose bytes are the writer's (CRCs valid) but whose content
 * is impossible: a NaN or an infinity in a tensor, a record twice. */
static void test_nonfinite_and_duplicates(void)
{
    const float bad[] = {NAN, INFINITY, -INFINITY};
    for (int i = 0; i < 3; i++) {
        saved s;
        CHECK(save_fixture(&s, 5, 3, LOOM_OPT_MOMENTUM, 4) == LOOM_OK);
        loom_model_params(s.m)[7] = bad[i];
        char path[LOOM_PATH_MAX];
        CHECK(loom_ckpt_save(s.dir, 5, s.m, s.o, &s.tr, &s.it, 5, path, &err) == LOOM_OK);
        loom_model *m = new_model(5, 3);
        loom_optimizer *o = new_opt(m, LOOM_OPT_MOMENTUM);
        sentinel(m, o);
        loom_err_clear(&err);
        CHECK(loom_ckpt_load(path, m, o, NULL, NULL, &err) == LOOM_ECHECKPOINT);
        CHECK(!strcmp(err.where, path));
        CHECK_CONTAINS(err.msg, "tensor \"dense_1/kernel\" holds");
        CHECK_CONTAINS(err.msg, "at index 7");
        /* nothing of it reached the model */
        CHECK(loom_model_params(m)[7] == 1234.5f);
        loom_err_clear(&err);
        FILE *null = fopen("/dev/null", "w");
        CHECK(null && loom_ckpt_inspect(path, null, &err) == LOOM_ECHECKPOINT);
        if (null) fclose(null);
        CHECK_CONTAINS(err.msg, "holds a NaN or an infinity");
        loom_model_free(m);
        loom_optimizer_free(o);
        saved_fini(&s);
    }
}

static void test_missing_file(void)
{
    char dir[LOOM_PATH_MAX], p[LOOM_PATH_MAX + 32];
    new_dir(dir);
    snprintf(p, sizeof p, "%s/ckpt-1.loom", dir);
    loom_model *m = new_model(5, 3);
    loom_buf tr;
    loom_err_clear(&err);
    CHECK(loom_ckpt_load(p, m, NULL, &tr, NULL, &err) == LOOM_EIO);
    CHECK(!strcmp(err.where, p));
    CHECK_CONTAINS(err.msg, "cannot open");
    CHECK(tr.len == 0);
    loom_buf_fini(&tr);
    /* a directory where the file should be */
    loom_err_clear(&err);
    CHECK(loom_ckpt_load(dir, m, NULL, NULL, NULL, &err) == LOOM_EIO);
    CHECK(!strcmp(err.where, dir));
    loom_model_free(m);
}

/* ---- another model or optimizer ---------------------------------------------- */

static void test_different_units(void)
{
    saved s;
    CHECK(save_fixture(&s, 5, 3, LOOM_OPT_MOMENTUM, 3) == LOOM_OK);
    CHECK(load_into(s.path, 6, 3, LOOM_OPT_MOMENTUM) == LOOM_ECHECKPOINT);
    CHECK(!strcmp(err.where, s.path));
    CHECK_CONTAINS(err.msg, "tensor \"dense_1/kernel\" has shape (16, 5) in the checkpoint, the model expects (16, 6)");
    CHECK_CONTAINS(err.hint, "different model");
    CHECK(load_into(s.path, 5, 4, -1) == LOOM_ECHECKPOINT);
    CHECK_CONTAINS(err.msg, "tensor \"dense_2/kernel\" has shape (5, 3) in the checkpoint, the model expects (5, 4)");
    saved_fini(&s);
}

static void test_extra_layer(void)
{
    saved s;
    CHECK(save_fixture(&s, 5, 3, LOOM_OPT_MOMENTUM, 3) == LOOM_OK);
    int u3[3] = {5, 3, 3};
    /* model with one more layer than the checkpoint */
    loom_model *m = new_model_(u3, 3, false);
    loom_optimizer *o = new_opt(m, LOOM_OPT_MOMENTUM);
    loom_err_clear(&err);
    CHECK(loom_ckpt_load(s.path, m, NULL, NULL, NULL, &err) == LOOM_ECHECKPOINT);
    CHECK(!strcmp(err.where, s.path));
    CHECK_CONTAINS(err.msg, "checkpoint holds 4 of the model's 6 tensors");
    CHECK(err.hint[0]);
    CHECK(loom_ckpt_load(s.path, m, o, NULL, NULL, &err) == LOOM_ECHECKPOINT);
    CHECK_CONTAINS(err.msg, "checkpoint holds 8 of the model's 12 tensors");

    /* checkpoint with one more layer than the model */
    char dir[LOOM_PATH_MAX], path[LOOM_PATH_MAX];
    new_dir(dir);
    randomize(m, o, 4);
    CHECK(loom_ckpt_save(dir, 1, m, o, NULL, NULL, 0, path, &err) == LOOM_OK);
    CHECK(load_into(path, 5, 3, LOOM_OPT_MOMENTUM) == LOOM_ECHECKPOINT);
    CHECK_CONTAINS(err.msg, "checkpoint holds tensor \"dense_3/kernel\" that this model does not have");
    CHECK_CONTAINS(err.hint, "different model");
    CHECK(load_into(path, 5, 3, -1) == LOOM_ECHECKPOINT);
    CHECK_CONTAINS(err.msg, "\"dense_3/kernel\" that this model does not have");

    /* the same layers but the last without a bias */
    int u2[2] = {5, 3};
    loom_model *nb = new_model_(u2, 2, true);
    CHECK(loom_model_num_param_tensors(nb) == 3);
    loom_err_clear(&err);
    CHECK(loom_ckpt_load(s.path, nb, NULL, NULL, NULL, &err) == LOOM_ECHECKPOINT);
    CHECK_CONTAINS(err.msg, "\"dense_2/bias\" that this model does not have");
    loom_model_free(nb);

    loom_model_free(m);
    loom_optimizer_free(o);
    saved_fini(&s);
}

static void test_optimizer_mismatch(void)
{
    saved a, mo, sg;
    CHECK(save_fixture(&a, 5, 3, LOOM_OPT_ADAM, 1) == LOOM_OK);
    CHECK(save_fixture(&mo, 5, 3, LOOM_OPT_MOMENTUM, 1) == LOOM_OK);
    CHECK(save_fixture(&sg, 5, 3, LOOM_OPT_SGD, 1) == LOOM_OK);
    /* adam -> momentum: a slot the optimizer lacks */
    CHECK(load_into(a.path, 5, 3, LOOM_OPT_MOMENTUM) == LOOM_ECHECKPOINT);
    CHECK(!strcmp(err.where, a.path));
    CHECK_CONTAINS(err.msg, "optimizer slot \"dense_1/kernel/m\" that this optimizer does not have");
    CHECK_CONTAINS(err.hint, "different optimizer");
    /* adam -> sgd */
    CHECK(load_into(a.path, 5, 3, LOOM_OPT_SGD) == LOOM_ECHECKPOINT);
    CHECK_CONTAINS(err.msg, "optimizer slot \"dense_1/kernel/m\"");
    /* momentum -> adam: slots missing */
    CHECK(load_into(mo.path, 5, 3, LOOM_OPT_ADAM) == LOOM_ECHECKPOINT);
    CHECK_CONTAINS(err.msg, "\"dense_1/kernel/momentum\" that this optimizer does not have");
    /* sgd -> momentum: no slots at all in the file */
    CHECK(load_into(sg.path, 5, 3, LOOM_OPT_MOMENTUM) == LOOM_ECHECKPOINT);
    CHECK_CONTAINS(err.msg, "checkpoint holds 4 of the model's 8 tensors");
    /* each into its own kind, and all without an optimizer */
    CHECK(load_into(a.path, 5, 3, LOOM_OPT_ADAM) == LOOM_OK);
    CHECK(load_into(mo.path, 5, 3, LOOM_OPT_MOMENTUM) == LOOM_OK);
    CHECK(load_into(sg.path, 5, 3, LOOM_OPT_SGD) == LOOM_OK);
    CHECK(load_into(a.path, 5, 3, -1) == LOOM_OK);
    CHECK(load_into(mo.path, 5, 3, -1) == LOOM_OK);
    CHECK(load_into(sg.path, 5, 3, -1) == LOOM_OK);
    saved_fini(&a);
    saved_fini(&mo);
    saved_fini(&sg);
}

/* ---- environment --------------------------------------------------------------- */

static void test_unwritable_dir(void)
{
    char dir[LOOM_PATH_MAX], file[LOOM_PATH_MAX + 16], under[LOOM_PATH_MAX + 32], path[LOOM_PATH_MAX];
    new_dir(dir);
    touch(dir, "plain", "I am a file");
    snprintf(file, sizeof file, "%s/plain", dir);
    snprintf(under, sizeof under, "%s/plain/models", dir);
    loom_model *m = new_model(5, 3);
    loom_optimizer *o = new_opt(m, LOOM_OPT_ADAM);
    randomize(m, o, 1);
    loom_buf tr, it;
    make_blobs(&tr, &it);
    const char *dirs[] = {under, file};
    for (int i = 0; i < 2; i++) {
        loom_err_clear(&err);
        int rc = loom_ckpt_save(dirs[i], 5, m, o, &tr, &it, 2, path, &err);
        CHECK(rc == LOOM_EIO);
        CHECK_CONTAINS(err.where, dirs[i]);
        CHECK(err.msg[0] != 0);
        int64_t step;
        char latest[LOOM_PATH_MAX];
        rc = loom_ckpt_latest(dirs[i], latest, &step, &err);
        CHECK(rc != LOOM_OK);
    }
    CHECK(count_entries(dir, NULL) == 1);
    loom_buf_fini(&tr);
    loom_buf_fini(&it);
    loom_model_free(m);
    loom_optimizer_free(o);
}

/* ---- allocation failure -------------------------------------------------------- */

static void test_oom_save(void)
{
    char dir[LOOM_PATH_MAX], path[LOOM_PATH_MAX];
    new_dir(dir);
    loom_model *m = new_model(5, 3), *m2 = new_model(5, 3);
    loom_optimizer *o = new_opt(m, LOOM_OPT_ADAM), *o2 = new_opt(m2, LOOM_OPT_ADAM);
    randomize(m, o, 8);
    loom_buf tr, it;
    make_blobs(&tr, &it);
    int n, rc = -1, fails = 0;
    for (n = 0; n < 1000; n++) {
        loom_err_clear(&err);
        loom_alloc_fail_after(n);
        rc = loom_ckpt_save(dir, 1 + n % 4, m, o, &tr, &it, 2, path, &err);
        loom_alloc_fail_after(-1);
        if (rc == LOOM_OK && n >= 30) break;
        if (rc != LOOM_OK) {
            fails++;
            CHECK_MSG(rc == LOOM_ENOMEM, "n = %d: rc %d: %s", n, rc, err.msg);
            CHECK(err.msg[0] != 0);
        }
        CHECK(count_entries(dir, ".tmp") == 0);
    }
    CHECK(rc == LOOM_OK);
    CHECK(fails > 0);
    printf("# save: %d of the first %d allocations failed cleanly\n", fails, n);
    /* what is there loads */
    int64_t step;
    char latest[LOOM_PATH_MAX];
    CHECK(loom_ckpt_latest(dir, latest, &step, &err) == LOOM_OK);
    CHECK(loom_ckpt_load(latest, m2, o2, NULL, NULL, &err) == LOOM_OK);
    CHECK(params_eq(m, m2) && slots_eq(m, o, o2));
    loom_buf_fini(&tr);
    loom_buf_fini(&it);
    loom_model_free(m);
    loom_model_free(m2);
    loom_optimizer_free(o);
    loom_optimizer_free(o2);
}

static void test_oom_load(void)
{
    saved s;
    CHECK(save_fixture(&s, 5, 3, LOOM_OPT_ADAM, 3) == LOOM_OK);
    loom_model *m = new_model(5, 3);
    loom_optimizer *o = new_opt(m, LOOM_OPT_ADAM);
    int n, rc = -1, fails = 0;
    for (n = 0; n < 1000; n++) {
        sentinel(m, o);
        loom_buf tr, it;
        loom_err_clear(&err);
        loom_alloc_fail_after(n);
        rc = loom_ckpt_load(s.path, m, o, &tr, &it, &err);
        loom_alloc_fail_after(-1);
        if (rc == LOOM_OK) {
            CHECK_MSG(params_eq(s.m, m) && slots_eq(m, s.o, o), "n = %d: loaded wrong values", n);
            CHECK_MSG(buf_eq(&tr, &s.tr) && buf_eq(&it, &s.it), "n = %d: blobs %zu/%zu bytes, want %zu/%zu", n,
                      tr.len, it.len, s.tr.len, s.it.len);
        } else {
            fails++;
            CHECK_MSG(rc == LOOM_ENOMEM, "n = %d: rc %d (%s): %s", n, rc, loom_err_name(rc), err.msg);
            CHECK(!strcmp(err.where, s.path));
            CHECK(tr.len == 0 && it.len == 0);
        }
        loom_buf_fini(&tr);
        loom_buf_fini(&it);
        if (rc == LOOM_OK && n >= 30) break;
    }
    CHECK(rc == LOOM_OK);
    CHECK(fails > 0);
    printf("# load: %d of the first %d allocations failed cleanly\n", fails, n);

    /* latest: one allocation (the listing) */
    for (n = 0; n < 30; n++) {
        char latest[LOOM_PATH_MAX];
        int64_t step;
        loom_alloc_fail_after(n);
        rc = loom_ckpt_latest(s.dir, latest, &step, &err);
        loom_alloc_fail_after(-1);
        CHECK(rc == LOOM_OK || rc == LOOM_ENOMEM);
        if (rc == LOOM_OK) CHECK(step == 3);
    }
    loom_model_free(m);
    loom_optimizer_free(o);
    saved_fini(&s);
}

/* ---- main ------------------------------------------------------------------------- */

static int rm_one(const char *p, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st, (void)flag, (void)ftw;
    return remove(p);
}

static const loom_test tests[] = {
    {"roundtrip_momentum", test_roundtrip_momentum},
    {"roundtrip_adam", test_roundtrip_adam},
    {"roundtrip_sgd_empty_blob", test_roundtrip_sgd_empty_blob},
    {"load_without_optimizer", test_load_without_optimizer},
    {"latest", test_latest},
    {"keep_prunes_oldest", test_keep_prunes_oldest},
    {"truncated", test_truncated},
    {"flipped_bytes", test_flipped_bytes},
    {"crafted_records", test_crafted_records},
    {"nonfinite_and_duplicates", test_nonfinite_and_duplicates},
    {"missing_file", test_missing_file},
    {"different_units", test_different_units},
    {"extra_layer", test_extra_layer},
    {"optimizer_mismatch", test_optimizer_mismatch},
    {"unwritable_dir", test_unwritable_dir},
    {"oom_save", test_oom_save},
    {"oom_load", test_oom_load},
    {0},
};

int main(void)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(root_, sizeof root_, "%s/loom-test-train-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(root_)) {
        printf("Bail out! mkdtemp %s: %s\n", root_, strerror(errno));
        return 1;
    }
    loom_log_set_level(LOOM_LOG_ERROR);
    int rc = loom_test_run(tests);
    if (!getenv("LOOM_TEST_KEEP")) nftw(root_, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    return rc;
}
