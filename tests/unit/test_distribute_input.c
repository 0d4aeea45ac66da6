/* test_distribute_input.c - distributed input hooks (data/engine/distribute_input.c):
 * get_per_replica_batch_size, the per-replica split of a global batch with
 * tf.distribute's partial-batch semantics (views, no copies), and auto-sharding
 * of N input pipelines over real TFRecord shards: FILE, DATA (placed before a
 * trailing prefetch, refused on a non-deterministic order), AUTO (FILE or DATA
 * by file count) and OFF pick exactly the right files/elements, the N
 * pipelines together cover every element once, FILE also on text files,
 * list_files names and with shuffle_files, the no-data errors (at open, and at
 * the end of a pass whose size was unknown), and save/restore through the DATA
 * stage. Fixtures go to a temporary directory. */
#include "harness.h"
#include "test_util.h"
#include "data/data.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define FILES 4
#define PER_FILE 25
#define TOTAL (FILES * PER_FILE)

/* ---- fixtures --------------------------------------------------------------- */

/* FILES TFRecord shards of Examples {id: int64, image: 4 bytes of id}; file k holds ids k*PER_FILE.. */
static void make_shards(void)
{
    static bool made;
    if (made) return;
    made = true;
    loom_example_builder b;
    loom_example_builder_init(&b);
    for (int k = 0; k < FILES; k++) {
        char name[64];
        snprintf(name, sizeof name, "train-%05d-of-%05d.tfrecord", k, FILES);
        loom_err err = {0};
        loom_tfrecord_writer *w = NULL;
        CHECK(loom_tfrecord_writer_open(&w, tpath(name), k % 2 ? LOOM_COMP_ZSTD : LOOM_COMP_NONE, &err) == LOOM_OK);
        for (int64_t id = k * PER_FILE; w && id < (k + 1) * PER_FILE; id++) {
            uint8_t img[4] = {(uint8_t)id, (uint8_t)(id >> 8), 7, 9};
            loom_bytes_view iv = {img, 4};
            loom_example_builder_reset(&b);
            loom_example_add_int64s(&b, "id", &id, 1);
            loom_example_add_bytes(&b, "image", &iv, 1);
            const uint8_t *d;
            size_t len;
            CHECK(loom_example_finish(&b, &d, &len, &err) == LOOM_OK);
            CHECK(loom_tfrecord_writer_write(w, d, len, &err) == LOOM_OK);
        }
        if (w) CHECK_MSG(loom_tfrecord_writer_close(w, &err) == LOOM_OK, "%s", err.msg);
    }
    loom_example_builder_fini(&b);
    for (int k = 0; k < 3; k++) { /* text: file k holds lines "k0".."k4" */
        char name[32];
        snprintf(name, sizeof name, "lines-%d.txt", k);
        FILE *f = fopen(tpath(name), "w");
        for (int j = 0; f && j < 5; j++) fprintf(f, "%d%d\n", k, j);
        if (f) fclose(f);
    }
}

static loom_dataset_spec *spec_new(loom_source_kind kind, const char *pattern)
{
    loom_dataset_spec *s = calloc(1, sizeof *s);
    s->present = true;
    snprintf(s->loc.file, sizeof s->loc.file, "test.cfg");
    s->loc.line = 2;
    snprintf(s->loc.path, sizeof s->loc.path, "data.train");
    loom_source_spec *src = &s->source;
    src->kind = kind;
    snprintf(src->loc.file, sizeof src->loc.file, "test.cfg");
    src->loc.line = 3;
    snprintf(src->loc.path, sizeof src->loc.path, "data.train.source");
    if (pattern) snprintf(src->pattern[src->n_patterns++], LOOM_PATH_MAX, "%s", tpath(pattern));
    if (kind == LOOM_SRC_TFRECORD) {
        snprintf(src->feature[0], LOOM_NAME_MAX, "id");
        src->tfrecord.features[0].dtype = LOOM_TFR_INT64;
        snprintf(src->feature[1], LOOM_NAME_MAX, "image");
        src->tfrecord.features[1] = (loom_tfr_feature){.dtype = LOOM_TFR_UINT8, .rank = 1, .shape = {4}};
        src->n_features = 2;
    } else if (kind == LOOM_SRC_TEXT) {
        src->text.max_length = 8;
    } else if (kind == LOOM_SRC_SYNTHETIC) {
        snprintf(src->feature[0], LOOM_NAME_MAX, "x");
        src->synthetic.features[0] = (loom_syn_feature){.dtype = LOOM_CFG_F32, .max = 1};
        src->n_features = 1;
    }
    return s;
}

static loom_data_ctx ctx_for(int id, int n)
{
    return (loom_data_ctx){.seed = 42, .threads = 2, .name = "train",
                           .input = {.num_input_pipelines = n, .input_pipeline_id = id, .num_replicas_in_sync = n}};
}

/* One pass of pipeline id of n; the first feature's values (ids; for text the
 * line's two digits as a number) go to out. Returns the count, or -1 with err. */
static int read_ids(const loom_dataset_spec *s, int id, int n, int64_t *out, int max, loom_err *err)
{
    loom_data_ctx ctx = ctx_for(id, n);
    loom_iter *it;
    if (loom_data_open(&it, s, &ctx, err)) return -1;
    loom_elem *e;
    int rc, k = 0;
    while ((rc = loom_iter_next(it, &e, err)) == LOOM_OK) {
        const loom_tensor *t = &e->t[0];
        int64_t rows = t->shape.rank && s->source.kind != LOOM_SRC_TEXT ? t->shape.dim[0] : 1;
        for (int64_t r = 0; r < rows && k < max; r++) {
            if (s->source.kind == LOOM_SRC_TEXT) {
                const char *c = t->data;
                out[k++] = (c[0] - '0') * 10 + (c[1] - '0');
            } else {
                out[k++] = ((const int64_t *)t->data)[r];
            }
        }
    }
    loom_iter_close(it);
    return rc == LOOM_EEOF ? k : -1;
}

/* Every pipeline of n reads; each id of 0..total-1 must come exactly once, and
 * pipeline p must read exactly want(p, i) for its i-th element. */
static void check_cover(const loom_dataset_spec *s, int n, int total, int64_t (*want)(int p, int n, int i))
{
    int seen[TOTAL] = {0};
    for (int p = 0; p < n; p++) {
        int64_t ids[TOTAL];
        loom_err err = {0};
        int k = read_ids(s, p, n, ids, TOTAL, &err);
        CHECK_MSG(k > 0, "pipeline %d of %d: %d elements: %s %s", p, n, k, err.where, err.msg);
        for (int i = 0; i < k; i++) {
            CHECK_MSG(ids[i] == want(p, n, i), "pipeline %d of %d, element %d: id %lld, expected %lld", p, n, i,
                      (long long)ids[i], (long long)want(p, n, i));
            if (ids[i] >= 0 && ids[i] < total) seen[ids[i]]++;
        }
    }
    for (int i = 0; i < total; i++) CHECK_MSG(seen[i] == 1, "id %d read %d times by %d pipelines", i, seen[i], n);
}

/* FILE: pipeline p reads files p, p + n, ... whole and in order. */
static int64_t want_file(int p, int n, int i) { return (int64_t)(p + i / PER_FILE * n) * PER_FILE + i % PER_FILE; }
/* DATA on unbatched elements: pipeline p keeps positions p, p + n, ... */
static int64_t want_data(int p, int n, int i) { return p + (int64_t)i * n; }
/* DATA after batch(10): pipeline p keeps batches p, p + n, ... */
static int64_t want_data_b10(int p, int n, int i) { return (p + (int64_t)(i / 10) * n) * 10 + i % 10; }

/* ---- per-replica batch size and split ------------------------------------------ */

static void test_per_replica_batch(void)
{
    loom_input_ctx ic = {.num_input_pipelines = 2, .input_pipeline_id = 1, .num_replicas_in_sync = 4};
    int64_t b = 0;
    loom_err err = {0};
    CHECK(loom_input_per_replica_batch(&ic, 128, &b, &err) == LOOM_OK && b == 32);
    CHECK(loom_input_per_replica_batch(&ic, 130, &b, &err) == LOOM_ECONFIG);
    CHECK_CONTAINS(err.msg, "global batch size 130 is not divisible by the number of replicas in sync (4)");
    CHECK_CONTAINS(err.hint, "multiple of 4, e.g. 128");
    loom_input_ctx one = {0};
    CHECK(loom_input_per_replica_batch(&one, 7, &b, &err) == LOOM_OK && b == 7);
    loom_input_ctx bad = {.num_input_pipelines = 2, .input_pipeline_id = 2};
    CHECK(loom_input_per_replica_batch(&bad, 8, &b, &err) == LOOM_EUSAGE);
    CHECK_CONTAINS(err.msg, "pipeline id 2 of 2 pipelines");
}

/* A batch of n rows: "x" int64 (n) = first.., "y" float32 (n, 3). */
typedef struct fake_batch {
    int64_t   x[8];
    float     y[8][3];
    loom_elem e;
} fake_batch;

static void fake(fake_batch *f, int n, int64_t first)
{
    for (int i = 0; i < n; i++) {
        f->x[i] = first + i;
        for (int j = 0; j < 3; j++) f->y[i][j] = (float)(first + i) + 0.25f * (float)j;
    }
    f->e.n = 2;
    int64_t d1[1] = {n}, d2[2] = {n, 3};
    f->e.t[0] = (loom_tensor){.dtype = LOOM_I64, .shape = loom_shape_make(1, d1), .data = f->x};
    f->e.t[1] = (loom_tensor){.dtype = LOOM_F32, .shape = loom_shape_make(2, d2), .data = f->y};
}

/* Splits first..first+n-1 among R replicas and compares with want (rows per replica, -1 ends a part). */
static void check_split(int n, int R, const int *sizes)
{
    fake_batch f;
    fake(&f, n, 100);
    int64_t next = 100;
    for (int r = 0; r < R; r++) {
        loom_elem out;
        loom_err err = {0};
        CHECK(loom_batch_split(&f.e, R, r, &out, &err) == LOOM_OK);
        CHECK_MSG(out.t[0].shape.dim[0] == sizes[r] && out.t[1].shape.dim[0] == sizes[r] && out.t[1].shape.dim[1] == 3,
                  "n=%d R=%d replica %d: %lld rows, expected %d", n, R, r, (long long)out.t[0].shape.dim[0], sizes[r]);
        if (sizes[r] > 0) {
            CHECK_MSG(out.t[0].data == &f.x[next - 100] && out.t[1].data == f.y[next - 100], "replica %d: not a view", r);
            CHECK(((int64_t *)out.t[0].data)[0] == next && ((float(*)[3])out.t[1].data)[0][2] == (float)next + 0.5f);
        }
        CHECK(!out.t[0].owns && !out.t[1].owns);
        next += sizes[r];
    }
    CHECK(next == 100 + n);
}

static void test_batch_split(void)
{
    /* range(6).batch(4) over 2 replicas: [0,1],[2,3] then [4],[5] */
    check_split(4, 2, (const int[]){2, 2});
    check_split(2, 2, (const int[]){1, 1});
    /* range(4).batch(4) over 5 replicas: [0],[1],[2],[3],[] */
    check_split(4, 5, (const int[]){1, 1, 1, 1, 0});
    check_split(8, 4, (const int[]){2, 2, 2, 2});
    check_split(7, 3, (const int[]){3, 3, 1});
    check_split(1, 3, (const int[]){1, 0, 0});
    check_split(5, 1, (const int[]){5});
    fake_batch f;
    fake(&f, 4, 0);
    loom_elem out;
    loom_err err = {0};
    CHECK(loom_batch_split(&f.e, 2, 2, &out, &err) == LOOM_EUSAGE);
    CHECK_CONTAINS(err.msg, "replica 2 of 2 is out of range");
    f.e.t[1].shape.dim[0] = 3;
    CHECK(loom_batch_split(&f.e, 2, 0, &out, &err) == LOOM_ESHAPE);
    f.e.t[0].shape.rank = 0;
    CHECK(loom_batch_split(&f.e, 2, 0, &out, &err) == LOOM_ESHAPE);
    CHECK_CONTAINS(err.msg, "only a batch can be split");

    /* through a real pipeline: 6 Examples, batch 4, 2 replicas */
    make_shards();
    loom_dataset_spec *s = spec_new(LOOM_SRC_TFRECORD, "train-00000-of-00004.tfrecord");
    spec_add(s, LOOM_T_TAKE)->count = 6;
    spec_add(s, LOOM_T_BATCH)->batch_size = 4;
    loom_iter *it;
    CHECK(loom_data_open(&it, s, NULL, &err) == LOOM_OK);
    const int64_t want[2][2][2] = {{{0, 1}, {2, 3}}, {{4, -1}, {5, -1}}};
    loom_elem *e;
    for (int b = 0; b < 2; b++) {
        CHECK(loom_iter_next(it, &e, &err) == LOOM_OK);
        for (int r = 0; r < 2; r++) {
            CHECK(loom_batch_split(e, 2, r, &out, &err) == LOOM_OK);
            int64_t rows = out.t[0].shape.dim[0];
            CHECK(rows == (b ? 1 : 2) && out.t[1].shape.dim[0] == rows && out.t[1].shape.dim[1] == 4);
            for (int64_t i = 0; i < rows; i++) CHECK(((int64_t *)out.t[0].data)[i] == want[b][r][i]);
        }
    }
    CHECK(loom_iter_next(it, &e, &err) == LOOM_EEOF);
    loom_iter_close(it);
    free(s);
}

/* ---- auto-sharding ----------------------------------------------------------------- */

static void test_file(void)
{
    make_shards();
    loom_dataset_spec *s = spec_new(LOOM_SRC_TFRECORD, "train-*.tfrecord");
    s->shard_policy = LOOM_SHARD_FILE;
    check_cover(s, 2, TOTAL, want_file);
    check_cover(s, 4, TOTAL, want_file);
    check_cover(s, 1, TOTAL, want_file);
    /* AUTO with 4 files: FILE for up to 4 pipelines */
    s->shard_policy = LOOM_SHARD_AUTO;
    check_cover(s, 3, TOTAL, want_file);
    /* the shard is taken from the sorted list, then shuffled: each pipeline
     * keeps the same files, whole, in an order that changes with the epoch */
    s->source.shuffle_files = true;
    s->shard_policy = LOOM_SHARD_FILE;
    for (int p = 0; p < 2; p++) {
        int64_t ids[TOTAL];
        loom_err err = {0};
        int k = read_ids(s, p, 2, ids, TOTAL, &err);
        CHECK(k == 2 * PER_FILE);
        int files = 0;
        for (int i = 0; i < k; i += PER_FILE) files |= 1 << (ids[i] / PER_FILE);
        CHECK_MSG(files == (p ? 0xa : 0x5), "pipeline %d read files 0x%x", p, files);
    }
    free(s);

    /* list_files (what an interleave reads): the file names are sharded, then shuffled */
    s = spec_new(LOOM_SRC_LIST_FILES, "train-*.tfrecord");
    s->source.shuffle_files = true;
    s->shard_policy = LOOM_SHARD_FILE;
    for (int p = 0; p < 2; p++) {
        loom_data_ctx ctx = ctx_for(p, 2);
        loom_iter *it;
        loom_err err = {0};
        CHECK(loom_data_open(&it, s, &ctx, &err) == LOOM_OK);
        loom_elem *e;
        int got = 0, n = 0;
        while (loom_iter_next(it, &e, &err) == LOOM_OK) {
            const char *name = strrchr((const char *)e->t[0].data, '/');
            got |= name ? 1 << (name[11] - '0') : 0; /* "/train-0000K-of-..." */
            n++;
        }
        CHECK_MSG(n == 2 && got == (p ? 0xa : 0x5), "list_files pipeline %d: %d names, files 0x%x", p, n, got);
        loom_iter_close(it);
    }
    free(s);

    /* text files: 3 files of 5 lines over 3 pipelines */
    s = spec_new(LOOM_SRC_TEXT, "lines-*.txt");
    s->shard_policy = LOOM_SHARD_FILE;
    for (int p = 0; p < 3; p++) {
        int64_t ids[16];
        loom_err err = {0};
        CHECK(read_ids(s, p, 3, ids, 16, &err) == 5);
        for (int j = 0; j < 5; j++) CHECK(ids[j] == p * 10 + j);
    }
    free(s);
}

static void open_fails(const loom_dataset_spec *s, int id, int n, int code, const char *msg, const char *hint)
{
    loom_data_ctx ctx = ctx_for(id, n);
    loom_iter *it = NULL;
    loom_err err = {0};
    int rc = loom_data_open(&it, s, &ctx, &err);
    CHECK_MSG(rc == code, "pipeline %d of %d: rc %d, expected %d", id, n, rc, code);
    CHECK_CONTAINS(err.msg, msg);
    if (hint) CHECK_CONTAINS(err.hint, hint);
    CHECK(!it);
    loom_iter_close(it);
}

static void test_data(void)
{
    make_shards();
    loom_dataset_spec *s = spec_new(LOOM_SRC_TFRECORD, "train-*.tfrecord");
    s->shard_policy = LOOM_SHARD_DATA;
    check_cover(s, 3, TOTAL, want_data);
    check_cover(s, 4, TOTAL, want_data);
    /* AUTO with more pipelines than files: DATA */
    s->shard_policy = LOOM_SHARD_AUTO;
    check_cover(s, 5, TOTAL, want_data);
    check_cover(s, 7, TOTAL, want_data);
    /* placed as TF does: on the final elements (batches), before the trailing prefetch */
    s->shard_policy = LOOM_SHARD_DATA;
    spec_add(s, LOOM_T_BATCH)->batch_size = 10;
    spec_add(s, LOOM_T_PREFETCH)->buffer = 2;
    spec_add(s, LOOM_T_PREFETCH)->buffer = 1;
    check_cover(s, 3, TOTAL, want_data_b10);
    loom_data_ctx ctx = ctx_for(1, 3);
    loom_iter *it;
    loom_err err = {0};
    CHECK(loom_data_open(&it, s, &ctx, &err) == LOOM_OK);
    loom_stage_stats st[8];
    int n = loom_iter_stats(it, st, 8);
    CHECK_MSG(n == 5 && !strcmp(st[2].name, "auto_shard(data 1/3)") && !strncmp(st[3].name, "prefetch", 8),
              "stages: %d, [2] = %s", n, n > 2 ? st[2].name : "");
    loom_iter_close(it);
    /* OFF: everything, everywhere */
    s->shard_policy = LOOM_SHARD_OFF;
    for (int p = 0; p < 3; p++) {
        int64_t ids[TOTAL];
        CHECK(read_ids(s, p, 3, ids, TOTAL, &err) == TOTAL);
        for (int i = 0; i < TOTAL; i++) CHECK(ids[i] == i);
    }
    free(s);
}

/* DATA needs one order everywhere: a non-deterministic parallel map is refused. */
static void test_data_deterministic(void)
{
    make_shards();
    loom_dataset_spec *s = spec_new(LOOM_SRC_TFRECORD, "train-*.tfrecord");
    s->shard_policy = LOOM_SHARD_DATA;
    loom_transform_spec *m = spec_add(s, LOOM_T_MAP);
    m->map = (loom_map_spec){.kind = LOOM_MAP_CAST, .dtype = LOOM_CFG_F32};
    snprintf(m->map.feature, sizeof m->map.feature, "image");
    m->parallel = 2;
    m->deterministic = false;
    open_fails(s, 0, 3, LOOM_ECONFIG, "input pipeline 0 of 3 cannot shard by DATA: transforms.[0] has deterministic = false",
               "set deterministic = true there");
    s->shard_policy = LOOM_SHARD_FILE; /* FILE does not care: its own files, in any order */
    for (int p = 0; p < 2; p++) {
        int64_t ids[TOTAL];
        loom_err err = {0};
        CHECK(read_ids(s, p, 2, ids, TOTAL, &err) == 2 * PER_FILE);
        int bad = 0;
        for (int i = 0; i < 2 * PER_FILE; i++) bad += ids[i] / PER_FILE % 2 != p;
        CHECK_MSG(!bad, "pipeline %d of 2: %d ids from another pipeline's files", p, bad);
    }
    s->shard_policy = LOOM_SHARD_DATA;
    m->deterministic = true;
    check_cover(s, 3, TOTAL, want_data);
    free(s);
}

/* DATA through save/restore: a restored iterator continues with the same elements. */
static void test_data_save_restore(void)
{
    make_shards();
    loom_dataset_spec *s = spec_new(LOOM_SRC_TFRECORD, "train-*.tfrecord");
    s->shard_policy = LOOM_SHARD_DATA;
    spec_add(s, LOOM_T_PREFETCH)->buffer = 4;
    loom_data_ctx ctx = ctx_for(2, 3);
    loom_iter *a, *b;
    loom_err err = {0};
    CHECK(loom_data_open(&a, s, &ctx, &err) == LOOM_OK);
    CHECK(loom_data_open(&b, s, &ctx, &err) == LOOM_OK);
    loom_elem *e;
    for (int i = 0; i < 10; i++) CHECK(loom_iter_next(a, &e, &err) == LOOM_OK);
    loom_buf buf;
    loom_buf_init(&buf);
    CHECK(loom_iter_save(a, &buf, &err) == LOOM_OK);
    CHECK_MSG(loom_iter_restore(b, &buf, &err) == LOOM_OK, "%s", err.msg);
    int64_t i = 10;
    int rc;
    while ((rc = loom_iter_next(b, &e, &err)) == LOOM_OK) CHECK(((int64_t *)e->t[0].data)[0] == want_data(2, 3, (int)i++));
    CHECK(rc == LOOM_EEOF && i == 33);
    /* a state from another pipeline id is refused */
    loom_iter *c;
    loom_data_ctx other = ctx_for(1, 3);
    CHECK(loom_data_open(&c, s, &other, &err) == LOOM_OK);
    buf.pos = 0;
    CHECK(loom_iter_restore(c, &buf, &err) == LOOM_ECHECKPOINT);
    CHECK_CONTAINS(err.msg, "different pipeline");
    loom_iter_close(a);
    loom_iter_close(b);
    loom_iter_close(c);
    loom_buf_fini(&buf);
    free(s);
}

static void test_no_data(void)
{
    make_shards();
    /* FILE with fewer files than pipelines: every pipeline refuses, named */
    loom_dataset_spec *s = spec_new(LOOM_SRC_TFRECORD, "train-*.tfrecord");
    s->shard_policy = LOOM_SHARD_FILE;
    for (int p = 0; p < 5; p++) {
        char msg[200];
        snprintf(msg, sizeof msg, "data.train: input pipeline %d of 5 would receive no data: shard_policy \"file\" "
                 "splits 4 files among 5 pipelines, so pipeline 4 gets none", p);
        open_fails(s, p, 5, LOOM_ECONFIG, msg, "write at least 5 files (loom records convert --shards 5)");
    }
    loom_data_ctx ctx = ctx_for(4, 5);
    loom_err err = {0};
    loom_iter *it;
    CHECK(loom_data_open(&it, s, &ctx, &err) == LOOM_ECONFIG && !strcmp(err.where, "test.cfg:2"));
    /* a bad context */
    ctx = ctx_for(5, 5);
    CHECK(loom_data_open(&it, s, &ctx, &err) == LOOM_EUSAGE);
    free(s);

    /* FILE on a source without files; DATA with a known, too small cardinality */
    s = spec_new(LOOM_SRC_SYNTHETIC, NULL);
    s->source.synthetic.count = 3;
    s->shard_policy = LOOM_SHARD_FILE;
    open_fails(s, 0, 2, LOOM_ECONFIG, "input pipeline 0 of 2 cannot be sharded by FILE", "shard_policy = \"data\"");
    s->shard_policy = LOOM_SHARD_AUTO;
    open_fails(s, 1, 4, LOOM_ECONFIG,
               "input pipeline 1 of 4 would receive no data: shard_policy \"auto\" keeps 1 element (batch) in 4 "
               "and the dataset has only 3, so pipeline 3 gets none",
               "at least 4 elements");
    int64_t ids[4];
    CHECK(read_ids(s, 2, 3, ids, 4, &err) == 1); /* 3 elements for 3 pipelines is enough */
    free(s);

    /* DATA with an unknown cardinality: the starved pipeline fails at the end of its pass */
    s = spec_new(LOOM_SRC_TFRECORD, "train-00000-of-00004.tfrecord");
    s->shard_policy = LOOM_SHARD_DATA;
    spec_add(s, LOOM_T_BATCH)->batch_size = 10; /* 3 batches */
    CHECK(read_ids(s, 2, 3, ids, 4, &err) == 4);
    CHECK(read_ids(s, 3, 4, ids, 4, &err) == -1);
    CHECK_CONTAINS(err.msg, "data.train: input pipeline 3 of 4 received no data in epoch 0: shard_policy \"data\" "
                            "keeps 1 element in 4 and the dataset ended after 3");
    CHECK_CONTAINS(err.where, "test.cfg:2");
    free(s);
}

static void test_report(void)
{
    make_shards();
    loom_dataset_spec *s = spec_new(LOOM_SRC_TFRECORD, "train-*.tfrecord");
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    loom_data_ctx ctx = ctx_for(1, 2);
    loom_err err = {0};
    CHECK(loom_data_input_report(s, &ctx, f, &err) == LOOM_OK);
    ctx = ctx_for(1, 8);
    CHECK(loom_data_input_report(s, &ctx, f, &err) == LOOM_OK);
    fclose(f);
    CHECK_CONTAINS(text, "input pipeline 1 of 2: shard_policy \"auto\" applies file\n"
                         "input pipeline 1 of 2: 2 of 4 files:\n");
    CHECK_CONTAINS(text, "train-00001-of-00004.tfrecord\n");
    CHECK_CONTAINS(text, "train-00003-of-00004.tfrecord\ninput pipeline 1 of 8");
    CHECK(!strstr(text, "train-00002"));
    CHECK_CONTAINS(text, "input pipeline 1 of 8: the final elements p with p % 8 == 1 (after the last transform)");
    free(text);
    free(s);
}

static const loom_test tests[] = {
    {"per_replica_batch", test_per_replica_batch},
    {"batch_split", test_batch_split},
    {"file", test_file},
    {"data", test_data},
    {"data_deterministic", test_data_deterministic},
    {"data_save_restore", test_data_save_restore},
    {"no_data", test_no_data},
    {"report", test_report},
    {0},
};

int main(void)
{
    loom_log_set_level(LOOM_LOG_ERROR); /* AUTO's fallback warnings */
    return run_in_tmpdir("loom_test_distribute_input", tests);
}
