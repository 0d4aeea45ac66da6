/* test_ckpt_shards.c - sharded checkpoints (train/checkpoint.c, as the
 * parameter_server strategy writes them): shard files written per ps, an
 * index committed over them; loom_ckpt_load assembles the variables and
 * slots bit for bit; latest, pruning (old shards go with their index, orphan
 * shards too), --fresh's archive and inspect; and each broken set a named
 * LOOM_ECHECKPOINT that leaves the model untouched: a corrupt index, a
 * missing shard, a shard replaced after the commit (wrong CRC: a mixed set),
 * a shard of another step, an index renamed to another step, parts that do
 * not cover a variable, another model.
 * Every test works in its own directory under one mkdtemp root, removed at exit. */
#include "harness.h"
#include "train/train.h"

#include <dirent.h>
#include <errno.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

static loom_err err;
static char root_[256];
static int dir_seq_;

static void new_dir(char out[LOOM_PATH_MAX])
{
    snprintf(out, LOOM_PATH_MAX, "%s/d%03d", root_, dir_seq_++);
    if (mkdir(out, 0755) != 0) abort();
}

static int exists(const char *dir, const char *name)
{
    char p[LOOM_PATH_MAX + 64];
    struct stat st;
    snprintf(p, sizeof p, "%s/%s", dir, name);
    return stat(p, &st) == 0;
}

static int count_entries(const char *dir, const char *part)
{
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") && strstr(e->d_name, part)) n++;
    closedir(d);
    return n;
}

static void copy_file(const char *from, const char *to)
{
    FILE *a = fopen(from, "rb"), *b = fopen(to, "wb");
    if (!a || !b) abort();
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, a)) > 0)
        if (fwrite(buf, 1, n, b) != n) abort();
    fclose(a);
    fclose(b);
}

/* flatten (4x4) -> dense_1 (u1) -> dense_2 (3): kernels (16, u1) and (u1, 3). */
static loom_model *new_model(int u1)
{
    loom_model_spec *s = calloc(1, sizeof *s);
    if (!s) abort();
    snprintf(s->loc.file, sizeof s->loc.file, "test_ckpt_shards.cfg");
    snprintf(s->input, sizeof s->input, "image");
    snprintf(s->label, sizeof s->label, "label");
    s->loss = LOOM_LOSS_SPARSE_SOFTMAX_CE;
    s->n_layers = 3;
    s->layer[0].kind = LOOM_LAYER_FLATTEN;
    snprintf(s->layer[0].name, sizeof s->layer[0].name, "flatten_0");
    for (int i = 1; i < 3; i++) {
        loom_layer_spec *l = &s->layer[i];
        l->kind = LOOM_LAYER_DENSE;
        snprintf(l->name, sizeof l->name, "dense_%d", i);
        l->units = i == 1 ? u1 : 3;
        l->kernel_init = LOOM_INIT_GLOROT_UNIFORM;
        l->use_bias = true;
    }
    loom_shape in = {2, {4, 4}}, lab = {0, {0}};
    loom_model *m = NULL;
    int rc = loom_model_new(&m, s, &in, LOOM_F32, &lab, LOOM_U8, 2, &err);
    free(s);
    if (rc) printf("# loom_model_new: %s\n", err.msg);
    return m;
}

static loom_optimizer *new_opt(loom_model *m)
{
    loom_optimizer_spec s;
    memset(&s, 0, sizeof s);
    s.kind = LOOM_OPT_ADAM;
    s.learning_rate = 0.01;
    s.beta1 = 0.9;
    s.beta2 = 0.999;
    s.epsilon = 1e-7;
    s.schedule.kind = LOOM_SCHED_CONSTANT;
    loom_optimizer *o = NULL;
    if (loom_optimizer_new(&o, &s, loom_model_num_params(m), &err)) return NULL;
    return o;
}

static void fill(loom_model *m, loom_optimizer *o, uint64_t seed)
{
    loom_rng r;
    loom_rng_init(&r, seed, 1, 2, 3);
    int64_t P = loom_model_num_params(m);
    for (int64_t i = 0; i < P; i++) loom_model_params(m)[i] = loom_rng_normal(&r);
    for (int64_t i = 0; o && i < P * loom_optimizer_num_slots(o); i++) loom_optimizer_slots(o)[i] = loom_rng_normal(&r);
}

static void sentinel(loom_model *m, loom_optimizer *o)
{
    int64_t P = loom_model_num_params(m);
    for (int64_t i = 0; i < P; i++) loom_model_params(m)[i] = 1234.5f;
    for (int64_t i = 0; o && i < P * loom_optimizer_num_slots(o); i++) loom_optimizer_slots(o)[i] = -77.25f;
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

static int same(loom_model *a, loom_optimizer *oa, loom_model *b, loom_optimizer *ob)
{
    int64_t P = loom_model_num_params(a);
    if (P != loom_model_num_params(b) || memcmp(loom_model_params(a), loom_model_params(b), (size_t)P * 4)) return 0;
    return !oa || !memcmp(loom_optimizer_slots(oa), loom_optimizer_slots(ob),
                          (size_t)(P * loom_optimizer_num_slots(oa)) * 4);
}

/* As the parameter_server does: every variable split along axis 0 into
 * `k` parts (fewer when it has fewer rows), parts round-robin over n_ps
 * files; each ps's file written, then the index committed. */
static int save_sharded(const char *dir, int64_t step, loom_model *m, loom_optimizer *o, int n_ps, int k, int keep,
                        char path[LOOM_PATH_MAX])
{
    loom_ckpt_shards sh = {.n_ps = n_ps, .n_files = n_ps, .plan_id = 0x1234 + (uint64_t)k};
    sh.file = calloc((size_t)n_ps, sizeof *sh.file);
    sh.part = calloc(64, sizeof *sh.part);
    int nt = loom_model_num_param_tensors(m), ns = loom_optimizer_num_slots(o), rr = 0;
    for (int v = 0; v < nt; v++) {
        const loom_param_info *pi = loom_model_param_tensor(m, v);
        int64_t rows = pi->shape.dim[0], parts = rows < k ? rows : k;
        for (int64_t i = 0; i < parts; i++) {
            loom_ckpt_part *p = &sh.part[sh.n_parts++];
            snprintf(p->var, sizeof p->var, "%s", pi->name);
            if (parts == 1) snprintf(p->record, sizeof p->record, "%s", pi->name);
            else snprintf(p->record, sizeof p->record, "%s/part_%d", pi->name, (int)i);
            p->rows = rows / parts + (i < rows % parts);
            p->row0 = i * (rows / parts) + (i < rows % parts ? i : rows % parts);
            p->file = rr++ % n_ps;
        }
    }
    int64_t P = loom_model_num_params(m);
    int rc = LOOM_OK;
    for (int q = 0; q < n_ps && !rc; q++) {
        loom_ckpt_tensor t[64 * 3];
        char names[64 * 3][200];
        int n = 0;
        for (int i = 0; i < sh.n_parts; i++) {
            const loom_ckpt_part *p = &sh.part[i];
            if (p->file != q) continue;
            const loom_param_info *pi = NULL;
            for (int v = 0; v < nt; v++)
                if (!strcmp(loom_model_param_tensor(m, v)->name, p->var)) pi = loom_model_param_tensor(m, v);
            int64_t row = loom_shape_numel(&pi->shape) / pi->shape.dim[0];
            loom_shape s = pi->shape;
            s.dim[0] = p->rows;
            for (int b = 0; b <= ns; b++, n++) {
                if (b == 0) snprintf(names[n], sizeof names[n], "%s", p->record);
                else snprintf(names[n], sizeof names[n], "%s/%s", p->record, loom_optimizer_slot_name(o, b - 1));
                const float *base = b == 0 ? loom_model_params(m) : loom_optimizer_slots(o) + (b - 1) * P;
                t[n] = (loom_ckpt_tensor){names[n], s, base + pi->offset + p->row0 * row};
            }
        }
        snprintf(sh.file[q].name, sizeof sh.file[q].name, "ckpt-%lld.data-%05d-of-%05d", (long long)step, q, n_ps);
        sh.file[q].ps = q;
        char fp[LOOM_PATH_MAX + 64];
        snprintf(fp, sizeof fp, "%s/%s", dir, sh.file[q].name);
        loom_ckpt_shard_meta meta = {.step = step, .ps = q, .n_ps = n_ps, .plan_id = sh.plan_id};
        rc = loom_ckpt_write_shard(fp, &meta, t, n, &sh.file[q].size, &sh.file[q].crc, &err);
    }
    loom_buf tr, it;
    loom_buf_init(&tr);
    loom_buf_init(&it);
    loom_buf_put_i64(&tr, step);
    loom_buf_put_str(&it, "iterator");
    if (!rc) rc = loom_ckpt_save_index(dir, step, &sh, &tr, &it, keep, path, &err);
    if (rc) printf("# save_sharded: %s: %s\n", err.where, err.msg);
    loom_buf_fini(&tr);
    loom_buf_fini(&it);
    free(sh.file);
    free(sh.part);
    return rc;
}

typedef struct fx {
    char            dir[LOOM_PATH_MAX], path[LOOM_PATH_MAX];
    loom_model     *m, *m2;
    loom_optimizer *o, *o2;
} fx;

static void fx_init(fx *x, int64_t step)
{
    memset(x, 0, sizeof *x);
    new_dir(x->dir);
    x->m = new_model(5);
    x->o = new_opt(x->m);
    x->m2 = new_model(5);
    x->o2 = new_opt(x->m2);
    fill(x->m, x->o, 77 + (uint64_t)step + 1000 * (uint64_t)dir_seq_); /* every fixture's values its own */
    CHECK(save_sharded(x->dir, step, x->m, x->o, 2, 3, 0, x->path) == LOOM_OK);
    sentinel(x->m2, x->o2);
}

static void fx_fini(fx *x)
{
    loom_model_free(x->m);
    loom_model_free(x->m2);
    loom_optimizer_free(x->o);
    loom_optimizer_free(x->o2);
}

/* Loading x->path must fail with LOOM_ECHECKPOINT naming `what`, leaving x->m2 untouched. */
static void expect_refused(fx *x, const char *path, const char *what)
{
    loom_buf tr, it;
    int rc = loom_ckpt_load(path, x->m2, x->o2, &tr, &it, &err);
    CHECK_MSG(rc == LOOM_ECHECKPOINT, "rc %d: %s", rc, err.msg);
    char all[1400];
    snprintf(all, sizeof all, "%s: %s (hint: %s)", err.where, err.msg, err.hint);
    CHECK_CONTAINS(all, what);
    CHECK(all_sentinel(x->m2, x->o2));
    CHECK(tr.len == 0 && it.len == 0);
    loom_buf_fini(&tr);
    loom_buf_fini(&it);
}

static void test_roundtrip(void)
{
    fx x;
    fx_init(&x, 20);
    CHECK(count_entries(x.dir, ".data-") == 2);
    loom_buf tr, it;
    CHECK(loom_ckpt_load(x.path, x.m2, x.o2, &tr, &it, &err) == LOOM_OK);
    CHECK(same(x.m, x.o, x.m2, x.o2));
    loom_buf r = tr;
    r.pos = 0;
    CHECK(tr.len == 8 && loom_buf_get_i64(&r) == 20);
    CHECK(it.len > 0);
    loom_buf_fini(&tr);
    loom_buf_fini(&it);
    /* without an optimizer (evaluate, export, predict): the variables alone */
    loom_model *m3 = new_model(5);
    sentinel(m3, NULL);
    CHECK(loom_ckpt_load(x.path, m3, NULL, NULL, NULL, &err) == LOOM_OK && same(x.m, NULL, m3, NULL));
    loom_model_free(m3);
    /* latest names the index; inspect checks and lists every shard */
    char latest[LOOM_PATH_MAX];
    int64_t step = -1;
    CHECK(loom_ckpt_latest(x.dir, latest, &step, &err) == LOOM_OK && step == 20 && !strcmp(latest, x.path));
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    CHECK(loom_ckpt_inspect(x.path, f, &err) == LOOM_OK);
    fclose(f);
    CHECK_CONTAINS(text, "the index of a sharded checkpoint: step 20, 2 shard files of 2 ps tasks");
    CHECK_CONTAINS(text, "dense_1/kernel/part_2");
    CHECK_CONTAINS(text, "matches the index");
    free(text);
    fx_fini(&x);
}

static void test_prune_and_orphans(void)
{
    char dir[LOOM_PATH_MAX], path[LOOM_PATH_MAX];
    new_dir(dir);
    loom_model *m = new_model(5);
    loom_optimizer *o = new_opt(m);
    for (int s = 10; s <= 40; s += 10) {
        fill(m, o, (uint64_t)s);
        CHECK(save_sharded(dir, s, m, o, 2, 3, 2, path) == LOOM_OK);
    }
    CHECK(!exists(dir, "ckpt-10.loom") && !exists(dir, "ckpt-20.loom") && exists(dir, "ckpt-40.loom"));
    CHECK(!exists(dir, "ckpt-20.data-00000-of-00002") && exists(dir, "ckpt-30.data-00001-of-00002"));
    CHECK(count_entries(dir, ".data-") == 4);
    /* a save that never committed its index leaves shard files: the next commit removes them */
    char orphan[LOOM_PATH_MAX + 64], from[LOOM_PATH_MAX + 64];
    snprintf(from, sizeof from, "%s/ckpt-40.data-00000-of-00002", dir);
    snprintf(orphan, sizeof orphan, "%s/ckpt-45.data-00000-of-00002", dir);
    copy_file(from, orphan);
    CHECK(save_sharded(dir, 50, m, o, 2, 3, 2, path) == LOOM_OK);
    CHECK(!exists(dir, "ckpt-45.data-00000-of-00002") && count_entries(dir, ".data-") == 4);
    /* --fresh: the shard files move aside with their indexes */
    char moved[LOOM_PATH_MAX];
    CHECK(loom_ckpt_archive(dir, moved, &err) == LOOM_OK);
    CHECK(count_entries(dir, "ckpt-") == 0 && count_entries(moved, ".data-") == 4);
    loom_model_free(m);
    loom_optimizer_free(o);
}

static void test_corrupt_index(void)
{
    fx x;
    fx_init(&x, 20);
    FILE *f = fopen(x.path, "r+b");
    CHECK(f && fseek(f, 40, SEEK_SET) == 0);
    int c = fgetc(f);
    fseek(f, 40, SEEK_SET);
    fputc(c ^ 0x10, f);
    fclose(f);
    expect_refused(&x, x.path, "file checksum mismatch");
    fx_fini(&x);
}

static void test_missing_shard(void)
{
    fx x;
    fx_init(&x, 20);
    char p[LOOM_PATH_MAX + 64];
    snprintf(p, sizeof p, "%s/ckpt-20.data-00001-of-00002", x.dir);
    CHECK(unlink(p) == 0);
    expect_refused(&x, x.path, "shard of ps:1, ");
    expect_refused(&x, x.path, "cannot be read");
    FILE *null = fopen("/dev/null", "w");
    CHECK(loom_ckpt_inspect(x.path, null, &err) == LOOM_ECHECKPOINT);
    fclose(null);
    fx_fini(&x);
}

static void test_mixed_set(void)
{
    /* the same step saved twice (two runs), one shard of the other save copied in: wrong CRC */
    fx x, y;
    fx_init(&x, 20);
    fx_init(&y, 20);
    char a[LOOM_PATH_MAX + 64], b[LOOM_PATH_MAX + 64];
    snprintf(a, sizeof a, "%s/ckpt-20.data-00000-of-00002", y.dir);
    snprintf(b, sizeof b, "%s/ckpt-20.data-00000-of-00002", x.dir);
    copy_file(a, b);
    expect_refused(&x, x.path, "not the shard the index");
    expect_refused(&x, x.path, "a mixed set");
    /* a bit flipped in a shard: the same */
    fx_fini(&x);
    fx_init(&x, 20);
    snprintf(b, sizeof b, "%s/ckpt-20.data-00000-of-00002", x.dir);
    FILE *f = fopen(b, "r+b");
    CHECK(f && fseek(f, 30, SEEK_SET) == 0);
    fputc(0x5a, f);
    fclose(f);
    expect_refused(&x, x.path, "CRC-32C");
    fx_fini(&x);
    fx_fini(&y);
}

static void test_shard_of_another_step(void)
{
    /* an index for step 30 that names (with their true sizes and CRCs) the shard files of step 20 */
    fx x;
    fx_init(&x, 20);
    loom_ckpt_shards sh = {.n_ps = 2, .n_files = 2, .plan_id = 0x1234 + 3};
    loom_ckpt_shard_file files[2];
    for (int q = 0; q < 2; q++) {
        snprintf(files[q].name, sizeof files[q].name, "ckpt-20.data-%05d-of-00002", q);
        char p[LOOM_PATH_MAX + 300];
        snprintf(p, sizeof p, "%s/%s", x.dir, files[q].name);
        FILE *f = fopen(p, "rb");
        uint8_t buf[1 << 16];
        size_t n = f ? fread(buf, 1, sizeof buf, f) : 0;
        if (f) fclose(f);
        files[q].size = n;
        files[q].crc = loom_crc32c(buf, n);
        files[q].ps = q;
    }
    loom_ckpt_part part = {.var = "dense_2/bias", .record = "dense_2/bias", .file = 0, .row0 = 0, .rows = 3};
    sh.file = files;
    sh.part = &part;
    sh.n_parts = 1;
    char path[LOOM_PATH_MAX];
    CHECK(loom_ckpt_save_index(x.dir, 30, &sh, NULL, NULL, 0, path, &err) == LOOM_OK);
    expect_refused(&x, path, "a shard of the checkpoint of step 20, but the index");
    /* an index renamed to another step */
    char moved[LOOM_PATH_MAX + 16];
    snprintf(moved, sizeof moved, "%s/ckpt-40.loom", x.dir);
    CHECK(rename(x.path, moved) == 0);
    expect_refused(&x, moved, "the index of step 40 names the shards of step 20");
    fx_fini(&x);
}

static void test_parts_and_models(void)
{
    fx x;
    fx_init(&x, 20);
    /* another model (dense_1 of 6 units): the shard's shape names the difference */
    loom_model *m6 = new_model(6);
    sentinel(m6, NULL);
    CHECK(loom_ckpt_load(x.path, m6, NULL, NULL, NULL, &err) == LOOM_ECHECKPOINT);
    CHECK_CONTAINS(err.msg, "has shape");
    loom_model_free(m6);
    /* the same variables cut otherwise (4 parts) load alike: the index says where each row goes */
    char dir[LOOM_PATH_MAX], path[LOOM_PATH_MAX];
    new_dir(dir);
    CHECK(save_sharded(dir, 20, x.m, x.o, 3, 4, 0, path) == LOOM_OK);
    CHECK(loom_ckpt_load(path, x.m2, x.o2, NULL, NULL, &err) == LOOM_OK && same(x.m, x.o, x.m2, x.o2));
    /* one ps's file, indexed with parts that leave a variable out, or overlap */
    new_dir(dir);
    CHECK(save_sharded(dir, 20, x.m, x.o, 1, 1, 0, path) == LOOM_OK);
    loom_ckpt_shard_file file = {.ps = 0};
    snprintf(file.name, sizeof file.name, "ckpt-20.data-00000-of-00001");
    char p[LOOM_PATH_MAX + 160];
    snprintf(p, sizeof p, "%s/%s", dir, file.name);
    struct stat st;
    CHECK(stat(p, &st) == 0);
    FILE *f = fopen(p, "rb");
    uint8_t *buf = malloc((size_t)st.st_size);
    CHECK(f && buf && fread(buf, 1, (size_t)st.st_size, f) == (size_t)st.st_size);
    if (f) fclose(f);
    file.size = (uint64_t)st.st_size;
    file.crc = loom_crc32c(buf, (size_t)st.st_size);
    free(buf);
    loom_ckpt_part parts[4] = {{"dense_1/kernel", "dense_1/kernel", 0, 0, 16}, {"dense_1/bias", "dense_1/bias", 0, 0, 5},
                               {"dense_2/kernel", "dense_2/kernel", 0, 0, 5}, {"dense_2/bias", "dense_2/bias", 0, 0, 3}};
    loom_ckpt_shards sh = {.n_ps = 1, .n_files = 1, .plan_id = 0x1234 + 1, .file = &file, .part = parts, .n_parts = 3};
    char ipath[LOOM_PATH_MAX];
    CHECK(loom_ckpt_save_index(dir, 20, &sh, NULL, NULL, 0, ipath, &err) == LOOM_OK);
    sentinel(x.m2, x.o2);
    expect_refused(&x, ipath, "checkpoint holds 3 of the model's 4 variables: \"dense_2/bias\" is in no shard");
    sh.n_parts = 4;
    parts[3].rows = 2; /* rows 0..1 of 3 */
    CHECK(loom_ckpt_save_index(dir, 20, &sh, NULL, NULL, 0, ipath, &err) == LOOM_OK);
    expect_refused(&x, ipath, "the parts of \"dense_2/bias\" do not cover its 3 rows");
    parts[3].rows = 3;
    CHECK(loom_ckpt_save_index(dir, 20, &sh, NULL, NULL, 0, ipath, &err) == LOOM_OK);
    CHECK(loom_ckpt_load(ipath, x.m2, x.o2, NULL, NULL, &err) == LOOM_OK && same(x.m, x.o, x.m2, x.o2));
    fx_fini(&x);
}

static int rm_one(const char *p, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st, (void)flag, (void)ftw;
    return remove(p);
}

static const loom_test tests[] = {
    {"roundtrip", test_roundtrip},
    {"prune_and_orphans", test_prune_and_orphans},
    {"corrupt_index", test_corrupt_index},
    {"missing_shard", test_missing_shard},
    {"mixed_set", test_mixed_set},
    {"shard_of_another_step", test_shard_of_another_step},
    {"parts_and_models", test_parts_and_models},
    {0},
};

int main(void)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(root_, sizeof root_, "%s/loom-test-shards-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(root_)) {
        printf("Bail out! mkdtemp %s: %s\n", root_, strerror(errno));
        return 1;
    }
    loom_log_set_level(LOOM_LOG_ERROR);
    int rc = loom_test_run(tests);
    if (!getenv("LOOM_TEST_KEEP")) nftw(root_, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    return rc;
}
