/* test_tfrecord_source.c - the tfrecord source: Fashion-MNIST-like Examples
 * written with the records.h writer in every compression and read back
 * through loom_data_open (shuffle, batch, prefetch), glob expansion over
 * shards, shuffle_files, errors that name file/record/offset/feature, corrupt
 * files in error and skip mode, exact mid-epoch save/restore, the files
 * TensorFlow wrote (tests/fixtures/tf), the config grammar
 * (tests/configs/good_tfrecord.cfg; the bad_tfrecord_*.cfg goldens run in
 * test_config) and allocation failures. Fixtures go to a temporary directory. */
#include "harness.h"
#include "test_util.h"
#include "data/data.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>

/* ---- fixtures: Fashion-MNIST-like Examples -------------------------------- */

#define IMG 784
#define MAXTOK 16
#define DIGEST_GOLDEN 0xfc7252fa5b4dc4f1ull /* see test_batch_digest */

static uint8_t img_byte(int64_t id, int k) { return (uint8_t)(id * 7 + k * 3 + (k >> 5)); }
static bool has_weight(int64_t id) { return id % 3 != 0; } /* else the default 1.0 */
static float weight_of(int64_t id) { return (float)id * 0.5f - 3.0f; }
static int ntok(int64_t id) { return (int)(id % (MAXTOK + 1)); } /* 0..16, var_len */
static int64_t tok(int64_t id, int j) { return id * 1000 + j - (j & 1) * 5000000000LL; }

/* Faults to plant in a file: record `at` gets them. */
enum { F_NONE, F_LABEL_FLOAT, F_NO_LABEL, F_SHORT_IMAGE, F_LONG_TOKENS, F_GARBAGE, F_NAN_WEIGHT, F_INF_WEIGHT };

/* Writes Examples id = first .. first+n-1 to path; record `bad_at` (file-relative) gets `fault`. */
static void write_examples(const char *path, loom_compression c, int64_t first, int n, int bad_at, int fault)
{
    loom_err err = {0};
    loom_tfrecord_writer *w = NULL;
    int rc = loom_tfrecord_writer_open(&w, path, c, &err);
    CHECK_MSG(rc == LOOM_OK, "%s", err.msg);
    if (rc) return;
    loom_example_builder b;
    loom_example_builder_init(&b);
    for (int i = 0; i < n; i++) {
        int64_t id = first + i;
        int f = i == bad_at ? fault : F_NONE;
        uint8_t img[IMG];
        for (int k = 0; k < IMG; k++) img[k] = img_byte(id, k);
        loom_example_builder_reset(&b);
        loom_bytes_view iv = {img, f == F_SHORT_IMAGE ? IMG - 1 : IMG};
        loom_example_add_bytes(&b, "image", &iv, 1);
        float fl = (float)id;
        if (f == F_LABEL_FLOAT)
            loom_example_add_floats(&b, "label", &fl, 1);
        else if (f != F_NO_LABEL)
            loom_example_add_int64s(&b, "label", &id, 1);
        float wt = f == F_NAN_WEIGHT ? NAN : f == F_INF_WEIGHT ? -INFINITY : weight_of(id);
        if (has_weight(id) || f == F_NAN_WEIGHT || f == F_INF_WEIGHT) loom_example_add_floats(&b, "weight", &wt, 1);
        int64_t toks[MAXTOK + 1];
        int nt = f == F_LONG_TOKENS ? MAXTOK + 1 : ntok(id);
        for (int j = 0; j < nt; j++) toks[j] = tok(id, j);
        loom_example_add_int64s(&b, "tokens", toks, nt);
        const uint8_t *d;
        size_t len;
        CHECK(loom_example_finish(&b, &d, &len, &err) == LOOM_OK);
        if (f == F_GARBAGE) {
            static const uint8_t junk[] = {0x0a, 0x05, 0x0a, 0x03}; /* a length that runs past the end */
            d = junk;
            len = sizeof junk;
        }
        CHECK(loom_tfrecord_writer_write(w, d, len, &err) == LOOM_OK);
    }
    loom_example_builder_fini(&b);
    CHECK_MSG(loom_tfrecord_writer_close(w, &err) == LOOM_OK, "%s", err.msg);
}

/* ---- spec builders ---------------------------------------------------------- */

static loom_dataset_spec *spec_new(void)
{
    loom_dataset_spec *s = calloc(1, sizeof *s);
    s->present = true;
    s->source.kind = LOOM_SRC_TFRECORD;
    snprintf(s->source.loc.file, sizeof s->source.loc.file, "test.cfg");
    s->source.loc.line = 4;
    snprintf(s->source.loc.path, sizeof s->source.loc.path, "data.train.source");
    return s;
}

static void spec_files(loom_dataset_spec *s, const char *pattern)
{
    snprintf(s->source.pattern[s->source.n_patterns++], LOOM_PATH_MAX, "%s", pattern);
}

static loom_tfr_feature *spec_feat(loom_dataset_spec *s, const char *name, loom_tfr_dtype dt, int rank,
                                   const int64_t *dims)
{
    loom_source_spec *src = &s->source;
    loom_tfr_feature *f = &src->tfrecord.features[src->n_features];
    snprintf(src->feature[src->n_features++], LOOM_NAME_MAX, "%s", name);
    f->dtype = dt;
    f->rank = rank;
    for (int i = 0; i < rank; i++) f->shape[i] = dims[i];
    return f;
}

/* image uint8 (28, 28), label int64 (), weight float32 () default 1, tokens int64 (16) var_len pad -7 */
static loom_dataset_spec *spec_fmnist(const char *pattern)
{
    loom_dataset_spec *s = spec_new();
    spec_files(s, pattern);
    int64_t hw[2] = {28, 28}, nt[1] = {MAXTOK};
    spec_feat(s, "image", LOOM_TFR_UINT8, 2, hw);
    spec_feat(s, "label", LOOM_TFR_INT64, 0, NULL);
    loom_tfr_feature *w = spec_feat(s, "weight", LOOM_TFR_FLOAT32, 0, NULL);
    w->has_default = true;
    w->default_value = 1.0;
    loom_tfr_feature *t = spec_feat(s, "tokens", LOOM_TFR_INT64, 1, nt);
    t->var_len = true;
    t->pad = -7;
    return s;
}

static const loom_data_ctx ctx2 = {.seed = 42, .threads = 2, .name = "train"};

static loom_iter *open_ok(const loom_dataset_spec *s) { return iter_open_ok(s, &ctx2); }

/* Checks every value of one unbatched or batched element against the generator;
 * appends the ids to ids[*n]. Returns the number of wrong values. */
static int check_elem(const loom_elem *e, int64_t *ids, int *n, int max)
{
    int bad = 0;
    const loom_tensor *im = &e->t[0], *lb = &e->t[1], *wt = &e->t[2], *tk = &e->t[3];
    bool batched = lb->shape.rank == 1;
    int64_t B = batched ? lb->shape.dim[0] : 1;
    bad += im->dtype != LOOM_U8 || lb->dtype != LOOM_I64 || wt->dtype != LOOM_F32 || tk->dtype != LOOM_I64;
    bad += im->shape.rank != (batched ? 3 : 2) || im->shape.dim[batched] != 28 || tk->shape.dim[batched] != MAXTOK;
    if (bad) return bad;
    for (int64_t b = 0; b < B; b++) {
        int64_t id = ((const int64_t *)lb->data)[b];
        if (*n < max) ids[(*n)++] = id;
        const uint8_t *px = (const uint8_t *)im->data + b * IMG;
        for (int k = 0; k < IMG; k++) bad += px[k] != img_byte(id, k);
        float w = ((const float *)wt->data)[b];
        bad += w != (has_weight(id) ? weight_of(id) : 1.0f);
        const int64_t *t = (const int64_t *)tk->data + b * MAXTOK;
        for (int j = 0; j < MAXTOK; j++) bad += t[j] != (j < ntok(id) ? tok(id, j) : -7);
    }
    return bad;
}

/* Runs one pass; returns the element count (-1 on error, with err filled). */
static int run_pass(loom_iter *it, int64_t *ids, int *n, int max, int *bad, loom_err *err)
{
    loom_elem *e;
    int rc, count = 0;
    while ((rc = loom_iter_next(it, &e, err)) == LOOM_OK) {
        *bad += check_elem(e, ids, n, max);
        count++;
    }
    return rc == LOOM_EEOF ? count : -1;
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

/* ---- reading ---------------------------------------------------------------- */

static void test_all_compressions(void)
{
    const loom_compression cs[] = {LOOM_COMP_NONE, LOOM_COMP_GZIP, LOOM_COMP_ZLIB, LOOM_COMP_ZSTD};
    const loom_tfr_compression decl[] = {LOOM_TFR_COMP_NONE, LOOM_TFR_COMP_GZIP, LOOM_TFR_COMP_ZLIB,
                                         LOOM_TFR_COMP_ZSTD};
    for (int c = 0; c < 4; c++) {
        char name[64];
        snprintf(name, sizeof name, "all-%s.tfrecord", loom_compression_name(cs[c]));
        write_examples(tpath(name), cs[c], 100, 37, -1, F_NONE);
        for (int mode = 0; mode < 2; mode++) { /* declared, then auto */
            loom_dataset_spec *s = spec_fmnist(tpath(name));
            s->source.tfrecord.compression = mode ? LOOM_TFR_COMP_AUTO : decl[c];
            loom_iter *it = open_ok(s);
            if (it) {
                CHECK(loom_iter_cardinality(it) == -2);
                char buf[256];
                CHECK_CONTAINS(loom_elem_spec_str(loom_iter_spec(it), buf, sizeof buf),
                               "image: uint8 (28, 28); label: int64 (); weight: float32 (); tokens: int64 (16,)");
                int64_t ids[64];
                int n = 0, bad = 0;
                loom_err err = {0};
                int count = run_pass(it, ids, &n, 64, &bad, &err);
                CHECK_MSG(count == 37, "%s: %d elements: %s", name, count, err.msg);
                CHECK_MSG(bad == 0, "%s: %d wrong values", name, bad);
                for (int i = 0; i < n; i++) bad += ids[i] != 100 + i; /* file order */
                CHECK(bad == 0);
                /* a second epoch reads the same */
                CHECK(loom_iter_rewind(it, 1, &err) == LOOM_OK);
                n = 0;
                CHECK(run_pass(it, ids, &n, 64, &bad, &err) == 37 && bad == 0);
                loom_iter_close(it);
            }
            free(s);
        }
    }
}

/* 4 shards of 25 (ids 0..99), each in another compression, and a decoy file. */
static void make_shards(void)
{
    static bool made;
    if (made) return;
    made = true;
    const loom_compression cs[] = {LOOM_COMP_ZSTD, LOOM_COMP_GZIP, LOOM_COMP_NONE, LOOM_COMP_ZLIB};
    for (int k = 0; k < 4; k++) {
        char name[64];
        snprintf(name, sizeof name, "train-%05d-of-00004.tfrecord", k);
        write_examples(tpath(name), cs[k], 25 * k, 25, -1, F_NONE);
    }
    write_examples(tpath("test-00000-of-00001.tfrecord"), LOOM_COMP_NONE, 1000, 3, -1, F_NONE);
}

static void test_glob_shards(void)
{
    make_shards();
    /* written out of order on purpose: the source sorts; overlapping patterns read each file once */
    loom_dataset_spec *s = spec_fmnist(tpath("train-0000[23]-*"));
    spec_files(s, tpath("train-*.tfrecord"));
    spec_files(s, tpath("train-00000-of-00004.tfrecord"));
    loom_iter *it = open_ok(s);
    if (it) {
        int64_t ids[200];
        int n = 0, bad = 0;
        loom_err err = {0};
        CHECK(run_pass(it, ids, &n, 200, &bad, &err) == 100);
        CHECK(bad == 0);
        for (int i = 0; i < n; i++) bad += ids[i] != i;
        CHECK_MSG(bad == 0, "shards not read in sorted order");
        loom_iter_close(it);
    }
    free(s);

    /* shuffle_files: each epoch a permutation of whole files, keyed by (seed, epoch) */
    s = spec_fmnist(tpath("train-*.tfrecord"));
    s->source.shuffle_files = true;
    loom_iter *a = open_ok(s), *b = open_ok(s);
    int distinct = 0;
    for (int ep = 0; a && b && ep < 6; ep++) {
        loom_err err = {0};
        int64_t x[128], y[128];
        int nx = 0, ny = 0, bad = 0;
        if (ep) {
            loom_iter_rewind(a, ep, &err);
            loom_iter_rewind(b, ep, &err);
        }
        CHECK(run_pass(a, x, &nx, 128, &bad, &err) == 100 && run_pass(b, y, &ny, 128, &bad, &err) == 100);
        CHECK(bad == 0);
        CHECK_MSG(!memcmp(x, y, sizeof(int64_t) * 100), "epoch %d: not deterministic", ep);
        for (int i = 0; i < 100; i++) bad += i % 25 ? x[i] != x[i - 1] + 1 : x[i] % 25 != 0; /* whole files */
        CHECK_MSG(bad == 0, "epoch %d: files interleaved", ep);
        distinct += x[0] != 0 || x[25] != 25 || x[50] != 50;
        qsort(x, 100, sizeof x[0], cmp_i64);
        for (int i = 0; i < 100; i++) bad += x[i] != i;
        CHECK(bad == 0);
    }
    CHECK_MSG(distinct >= 3, "shuffle_files left the order sorted in %d of 6 epochs", 6 - distinct);
    loom_iter_close(a);
    loom_iter_close(b);
    free(s);
}

static void test_shuffle_batch_prefetch(void)
{
    make_shards();
    for (int threaded = 0; threaded < 2; threaded++) {
        loom_dataset_spec *s = spec_fmnist(tpath("train-*.tfrecord"));
        spec_shuffle(s, 30);
        spec_batch(s, 8);
        spec_prefetch(s, threaded ? 3 : 0);
        loom_iter *it = open_ok(s);
        if (it) {
            CHECK(loom_iter_cardinality(it) == -2);
            int64_t ids[128], prev[128];
            for (int ep = 0; ep < 2; ep++) {
                int n = 0, bad = 0;
                loom_err err = {0};
                if (ep) loom_iter_rewind(it, ep, &err);
                CHECK_MSG(run_pass(it, ids, &n, 128, &bad, &err) == 13, "%s", err.msg); /* 12 of 8 + 1 of 4 */
                CHECK(bad == 0 && n == 100);
                if (ep) CHECK_MSG(memcmp(ids, prev, sizeof prev[0] * 100), "reshuffle gave the same order");
                memcpy(prev, ids, sizeof prev[0] * 100);
                int in_order = 0;
                for (int i = 1; i < 100; i++) in_order += ids[i] == ids[i - 1] + 1;
                CHECK(in_order < 50);
                qsort(ids, 100, sizeof ids[0], cmp_i64);
                for (int i = 0; i < 100; i++) bad += ids[i] != i;
                CHECK_MSG(bad == 0, "not a permutation of the 100 records");
            }
            loom_iter_close(it);
        }
        free(s);
    }
}

/* ---- bit-identical output across reader changes ------------------------------ */

static uint64_t fnv_bytes(uint64_t h, const void *p, size_t n)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

/* FNV-1a of every batch (dtypes, shapes, bytes) of two epochs of a fixed
 * pipeline over 4 shards (zstd, zstd, plain, gzip; ~660 KiB each, so records
 * straddle the reader's 256 KiB chunks): normalize, flip, shuffle 500, batch 32,
 * prefetch auto. The golden value was computed by the reader before the
 * in-place framing, read-ahead and whole-frame zstd changes (commit a032c43);
 * the records and batches must stay identical bit for bit, whether the source
 * reads inline or on its read-ahead thread. */
/* The digests' pipeline: normalize, flip, shuffle 500, batch 32, prefetch
 * auto; rewritten as data.options' defaults do (the maps fused into one
 * stage that makes each element straight in its shuffle slot) or not at all
 * (separate maps, whose elements the shuffle copies into its slots). */
static loom_dataset_spec *spec_digest(const char *pattern, bool rewrites)
{
    loom_dataset_spec *s = spec_fmnist(pattern);
    loom_map_spec *m = spec_map(s, LOOM_MAP_NORMALIZE, "image", 0, true);
    m->mean = 72.94;
    m->std = 90.02;
    spec_map(s, LOOM_MAP_FLIP_LR, "image", 0, true);
    spec_shuffle(s, 500);
    spec_batch(s, 32);
    spec_prefetch(s, -1);
    if (rewrites)
        s->options = (loom_data_options){.present = true, .deterministic = true, .autotune = true, .ram_fraction = 0.5,
                                         .noop_elimination = true, .map_fusion = true, .map_and_batch_fusion = true,
                                         .shuffle_and_repeat_fusion = true, .inject_prefetch = true};
    return s;
}

static uint64_t pipeline_digest_of(const char *pattern, bool rewrites, int epochs, int *batches, loom_err *err)
{
    loom_dataset_spec *s = spec_digest(pattern, rewrites);
    uint64_t h = 0xcbf29ce484222325ull;
    *batches = 0;
    loom_iter *it = open_ok(s);
    if (it && rewrites) { /* the maps are one stage ahead of the shuffle */
        char plan[512] = "";
        FILE *f = fmemopen(plan, sizeof plan - 1, "w");
        if (f) {
            loom_iter_plan(it, f);
            fclose(f);
        }
        CHECK_CONTAINS(plan, "map(normalize+random_flip_left_right) -> shuffle -> batch");
    }
    for (int ep = 0; it && ep < epochs; ep++) {
        if (ep && loom_iter_rewind(it, ep, err)) break;
        loom_elem *e;
        int rc;
        while ((rc = loom_iter_next(it, &e, err)) == LOOM_OK) {
            for (int f = 0; f < e->n; f++) {
                int32_t dt = e->t[f].dtype;
                h = fnv_bytes(h, &dt, sizeof dt);
                h = fnv_bytes(h, e->t[f].shape.dim, (size_t)e->t[f].shape.rank * sizeof e->t[f].shape.dim[0]);
                h = fnv_bytes(h, e->t[f].data, loom_tensor_nbytes(&e->t[f]));
            }
            (*batches)++;
        }
        CHECK_MSG(rc == LOOM_EEOF, "epoch %d: %s", ep, err->msg);
    }
    loom_iter_close(it);
    free(s);
    return h;
}

static uint64_t pipeline_digest(const char *pattern, int *batches, loom_err *err)
{
    return pipeline_digest_of(pattern, false, 2, batches, err);
}

/* The digest of the batches left after `skip` of the first epoch, read from
 * the state saved there by one iterator and restored into a fresh one: of a
 * shuffle 100, batch 32, prefetch pipeline, or (digest spec) of spec_digest's. */
static uint64_t digest_rest_of(const char *pattern, int digest_spec, int skip, int *left, loom_err *err)
{
    loom_dataset_spec *s;
    if (digest_spec) {
        s = spec_digest(pattern, digest_spec > 1);
    } else {
        s = spec_fmnist(pattern);
        spec_shuffle(s, 100);
        spec_batch(s, 32);
        spec_prefetch(s, -1);
    }
    uint64_t h = 0xcbf29ce484222325ull;
    *left = 0;
    loom_iter *a = open_ok(s), *b = open_ok(s);
    loom_buf st;
    loom_buf_init(&st);
    loom_elem *e;
    int rc = LOOM_OK;
    for (int i = 0; a && i < skip && rc == LOOM_OK; i++) rc = loom_iter_next(a, &e, err);
    CHECK_MSG(rc == LOOM_OK, "%s", err->msg);
    if (a && b && rc == LOOM_OK && loom_iter_save(a, &st, err) == LOOM_OK && loom_iter_restore(b, &st, err) == LOOM_OK) {
        while ((rc = loom_iter_next(b, &e, err)) == LOOM_OK) {
            for (int f = 0; f < e->n; f++) h = fnv_bytes(h, e->t[f].data, loom_tensor_nbytes(&e->t[f]));
            (*left)++;
        }
        CHECK_MSG(rc == LOOM_EEOF, "%s", err->msg);
    }
    loom_buf_fini(&st);
    loom_iter_close(a);
    loom_iter_close(b);
    free(s);
    return h;
}

static uint64_t digest_rest(const char *pattern, int skip, int *left, loom_err *err)
{
    return digest_rest_of(pattern, 0, skip, left, err);
}

static void test_batch_digest(void)
{
    const loom_compression cs[] = {LOOM_COMP_ZSTD, LOOM_COMP_ZSTD, LOOM_COMP_NONE, LOOM_COMP_GZIP};
    for (int k = 0; k < 4; k++) {
        char name[64];
        snprintf(name, sizeof name, "digest-%05d-of-00004.tfrecord", k);
        write_examples(tpath(name), cs[k], 700 * k, 700, -1, F_NONE);
    }
    /* the autotuner's choice, then read-ahead and decompress-ahead forced off and on for the whole run */
    const char *modes[] = {NULL, "0", "1", "0", "1"}, *dmodes[] = {NULL, "0", "0", "1", "1"};
    uint64_t rest[5] = {0};
    for (int m = 0; m < 5; m++) {
        if (modes[m]) setenv("LOOM_DATA_READAHEAD", modes[m], 1);
        else unsetenv("LOOM_DATA_READAHEAD");
        if (dmodes[m]) setenv("LOOM_DATA_DECOMPRESS_AHEAD", dmodes[m], 1);
        else unsetenv("LOOM_DATA_DECOMPRESS_AHEAD");
        loom_err err = {0};
        int batches, left;
        char mode[64];
        snprintf(mode, sizeof mode, "read-ahead %s, decompress-ahead %s", modes[m] ? modes[m] : "auto",
                 dmodes[m] ? dmodes[m] : "auto");
        uint64_t h = pipeline_digest(tpath("digest-*.tfrecord"), &batches, &err);
        CHECK_MSG(batches == 2 * 88, "%s: %d batches", mode, batches); /* 2800 = 87 x 32 + 16, two epochs */
        CHECK_MSG(h == DIGEST_GOLDEN, "%s: batch digest %016llx, expected %016llx", mode, (unsigned long long)h,
                  (unsigned long long)DIGEST_GOLDEN);
        /* a state saved 40 batches in (the threads have read further) restores to the same rest */
        rest[m] = digest_rest(tpath("digest-*.tfrecord"), 40, &left, &err);
        CHECK_MSG(left == 88 - 40, "%s: %d batches after the restore", mode, left);
    }
    unsetenv("LOOM_DATA_READAHEAD");
    unsetenv("LOOM_DATA_DECOMPRESS_AHEAD");
    for (int m = 1; m < 5; m++)
        CHECK_MSG(rest[m] == rest[0], "restored rests differ: mode %d %016llx, auto %016llx", m,
                  (unsigned long long)rest[m], (unsigned long long)rest[0]);
}

/* The fused maps make each element straight in the shuffle's slot (no copy
 * of it): the batches of three epochs are those of the unfused pipeline (the
 * golden digest's two, then a third), also with decompress-ahead and
 * read-ahead forced, and a state saved mid-epoch (the buffer full of slots
 * made so) restores to the same rest as the unfused pipeline's. */
static void test_fused_shuffle_digest(void)
{
    const loom_compression cs[] = {LOOM_COMP_ZSTD, LOOM_COMP_ZSTD, LOOM_COMP_NONE, LOOM_COMP_GZIP};
    for (int k = 0; k < 4; k++) {
        char name[64];
        snprintf(name, sizeof name, "fdigest-%05d-of-00004.tfrecord", k);
        write_examples(tpath(name), cs[k], 700 * k, 700, -1, F_NONE);
    }
    const char *pat = tpath("fdigest-*.tfrecord");
    loom_err err = {0};
    int nb, nb3, left;
    CHECK(pipeline_digest_of(pat, true, 2, &nb, &err) == DIGEST_GOLDEN && nb == 2 * 88);
    uint64_t plain3 = pipeline_digest_of(pat, false, 3, &nb3, &err);
    CHECK_MSG(nb3 == 3 * 88, "%d batches", nb3);
    uint64_t rest_plain = digest_rest_of(pat, 1, 40, &left, &err);
    CHECK_MSG(left == 88 - 40, "%d batches after the restore", left);
    const char *modes[] = {NULL, "1", "0"};
    for (int m = 0; m < 3; m++) {
        if (modes[m]) setenv("LOOM_DATA_READAHEAD", modes[m], 1), setenv("LOOM_DATA_DECOMPRESS_AHEAD", modes[m], 1);
        uint64_t h = pipeline_digest_of(pat, true, 3, &nb, &err);
        CHECK_MSG(nb == nb3 && h == plain3, "ahead %s: fused digest %016llx (%d batches), unfused %016llx (%d)",
                  modes[m] ? modes[m] : "auto", (unsigned long long)h, nb, (unsigned long long)plain3, nb3);
        uint64_t r = digest_rest_of(pat, 2, 40, &left, &err);
        CHECK_MSG(left == 88 - 40 && r == rest_plain, "ahead %s: restored rest %016llx (%d batches), unfused %016llx",
                  modes[m] ? modes[m] : "auto", (unsigned long long)r, left, (unsigned long long)rest_plain);
    }
    unsetenv("LOOM_DATA_READAHEAD");
    unsetenv("LOOM_DATA_DECOMPRESS_AHEAD");
}

/* The read-ahead knob's start: compressed files start on the read-ahead
 * thread when the CPU budget holds it (2 of 2), uncompressed ones and a
 * budget of 1 inline, as before; forcing either env variable takes the knob
 * away. Each pass's elements under the start chosen are those read inline
 * (and a state saved 40 batches into it restores to the same rest). */
static void test_readahead_start(void)
{
    write_examples(tpath("start-z.tfrecord.zst"), LOOM_COMP_ZSTD, 0, 700, -1, F_NONE);
    write_examples(tpath("start-p.tfrecord"), LOOM_COMP_NONE, 0, 700, -1, F_NONE);
    static const struct { const char *file; int budget; const char *want; } cases[] = {
        {"start-z.tfrecord.zst", 2, "tfrecord: read-ahead 2 (of 3)"},
        {"start-z.tfrecord.zst", 1, "tfrecord: read-ahead 1 (of 3)"},
        {"start-p.tfrecord", 2, "tfrecord: read-ahead 1 (of 3)"},
    };
    unsetenv("LOOM_DATA_READAHEAD");
    unsetenv("LOOM_DATA_DECOMPRESS_AHEAD");
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        uint64_t h[2] = {0}, rest[2] = {0};
        int nb[2] = {0}, left[2] = {0};
        for (int forced = 0; forced < 2; forced++) { /* as the tuner starts, then inline throughout */
            if (forced) setenv("LOOM_DATA_READAHEAD", "0", 1);
            loom_dataset_spec *s = spec_fmnist(tpath(cases[c].file));
            spec_shuffle(s, 100);
            spec_batch(s, 32);
            spec_prefetch(s, -1);
            s->options = (loom_data_options){.present = true, .deterministic = true, .autotune = true,
                                             .cpu_budget = cases[c].budget, .ram_fraction = 0.5};
            loom_err err = {0};
            loom_iter *it = open_ok(s);
            if (it && !forced) { /* read before any next(): the tuner has nothing to act on yet (it would give
                                    the unit back only after a second without the consumer waiting) */
                char tuned[512] = "";
                (void)loom_iter_tuned(it, tuned, sizeof tuned);
                CHECK_MSG(strstr(tuned, cases[c].want), "%s, budget %d: tuned \"%s\", expected \"%s\"", cases[c].file,
                          cases[c].budget, tuned, cases[c].want);
            }
            loom_iter *b = open_ok(s);
            loom_buf st;
            loom_buf_init(&st);
            loom_elem *e;
            int rc = LOOM_EIO;
            h[forced] = 0xcbf29ce484222325ull;
            while (it && (rc = loom_iter_next(it, &e, &err)) == LOOM_OK) {
                for (int f = 0; f < e->n; f++) h[forced] = fnv_bytes(h[forced], e->t[f].data, loom_tensor_nbytes(&e->t[f]));
                if (++nb[forced] == 10 && loom_iter_save(it, &st, &err)) break;
            }
            CHECK_MSG(rc == LOOM_EEOF, "%s", err.msg);
            rest[forced] = 0xcbf29ce484222325ull;
            if (b && st.len && loom_iter_restore(b, &st, &err) == LOOM_OK) {
                while ((rc = loom_iter_next(b, &e, &err)) == LOOM_OK) {
                    for (int f = 0; f < e->n; f++)
                        rest[forced] = fnv_bytes(rest[forced], e->t[f].data, loom_tensor_nbytes(&e->t[f]));
                    left[forced]++;
                }
                CHECK_MSG(rc == LOOM_EEOF, "%s", err.msg);
            }
            loom_buf_fini(&st);
            loom_iter_close(it);
            loom_iter_close(b);
            free(s);
        }
        unsetenv("LOOM_DATA_READAHEAD");
        CHECK_MSG(nb[0] == 22 && nb[1] == 22 && h[0] == h[1], "%s, budget %d: %d/%d batches, digest %016llx vs inline %016llx",
                  cases[c].file, cases[c].budget, nb[0], nb[1], (unsigned long long)h[0], (unsigned long long)h[1]);
        CHECK_MSG(left[0] == 12 && left[1] == 12 && rest[0] == rest[1], "%s, budget %d: restored rest %d/%d batches, %016llx vs inline %016llx",
                  cases[c].file, cases[c].budget, left[0], left[1], (unsigned long long)rest[0], (unsigned long long)rest[1]);
    }
}

/* ---- errors ------------------------------------------------------------------ */

/* Opens (expecting success unless open_fails) and reads to the first error; returns rc, err filled. */
static int read_until_error(const loom_dataset_spec *s, int *count, loom_err *err)
{
    loom_iter *it = NULL;
    memset(err, 0, sizeof *err);
    *count = 0;
    int rc = loom_data_open(&it, s, &ctx2, err);
    if (rc) return rc;
    loom_elem *e;
    while ((rc = loom_iter_next(it, &e, err)) == LOOM_OK) (*count)++;
    loom_iter_close(it);
    return rc;
}

/* A NaN or infinite float32 value (float_list): on_nonfinite error names the
 * file, the record and the feature, whether the record goes through the fast
 * path (record 5, after a good first record) or the general one (record 0,
 * met at open by the probe); skip drops the record and reads the rest. */
static void test_nonfinite(void)
{
    loom_log_set_level(LOOM_LOG_ERROR); /* the skip warnings are expected */
    static const struct { int at, fault; const char *text; } cases[] = {
        {5, F_NAN_WEIGHT, "record 5 at offset "}, {0, F_INF_WEIGHT, "record 0 at offset "},
        {7, F_INF_WEIGHT, "record 7 at offset "}};
    for (int c = 0; c < 3; c++) {
        char name[64];
        snprintf(name, sizeof name, "nonfinite%d.tfrecord%s", c, c == 2 ? ".zst" : "");
        const char *path = tpath(name);
        write_examples(path, c == 2 ? LOOM_COMP_ZSTD : LOOM_COMP_NONE, 0, 8, cases[c].at, cases[c].fault);
        loom_dataset_spec *s = spec_fmnist(path);
        int count;
        loom_err err;
        CHECK(read_until_error(s, &count, &err) == LOOM_EDATA);
        CHECK_MSG(count == (cases[c].at ? cases[c].at : 0), "case %d: %d elements before the error", c, count);
        CHECK_CONTAINS(err.where, name);
        CHECK_CONTAINS(err.msg, cases[c].text);
        CHECK_CONTAINS(err.msg, cases[c].fault == F_NAN_WEIGHT ? "feature \"weight\": non-finite value nan at offset 0"
                                                                 : "feature \"weight\": non-finite value -inf at offset 0");
        CHECK_CONTAINS(err.hint, "on_nonfinite = \"skip\"");
        s->on_nonfinite = LOOM_NONFINITE_SKIP;
        s->source.on_nonfinite = LOOM_NONFINITE_SKIP;
        loom_iter *it = open_ok(s);
        if (it) {
            int64_t ids[16];
            int n = 0, bad = 0;
            CHECK(run_pass(it, ids, &n, 16, &bad, &err) == 7 && bad == 0);
            for (int i = 0; i < n; i++) bad += ids[i] != (i < cases[c].at ? i : i + 1);
            CHECK_MSG(bad == 0, "case %d: the other 7 records in order", c);
            loom_iter_close(it);
        }
        free(s);
    }
}

/* Decompress-ahead meets a damaged zstd stream several frames ahead of the
 * record being parsed: the elements before it, the error (file, record,
 * offset, text) and, in skip mode, what is read are those of inline reading. */
static void test_ahead_errors(void)
{
    static const loom_compression cs[] = {LOOM_COMP_ZSTD, LOOM_COMP_GZIP};
    static const char *ext[] = {"zst", "gz"}, *ra[] = {"0", "0", "1"}, *da[] = {"0", "1", "1"};
    int differ = 0, cases = 0, stream_errors = 0;
    loom_log_set_level(LOOM_LOG_ERROR); /* the skip warnings are expected */
    for (int c = 0; c < 2; c++) {
        char path[64], bad[64];
        snprintf(path, sizeof path, "ahead.tfrecord.%s", ext[c]);
        snprintf(bad, sizeof bad, "ahead-bad.tfrecord.%s", ext[c]);
        write_examples(tpath(path), cs[c], 0, 2400, -1, F_NONE); /* ~2.2 MB of stream: 9 zstd frames */
        size_t n = 0;
        uint8_t *b = slurp(tpath(path), &n); /* as stored: loom_read_file would inflate the gzip file */
        CHECK(b != NULL);
        for (size_t at = n / 3; b && at < n - 64; at += n / 5) { /* from the third frame on: the thread is ahead */
            uint8_t junk[64]; /* invalid codes for the decompressor too, not only wrong bytes */
            for (int k = 0; k < 64; k++) junk[k] = (uint8_t)(k * 37 + 11);
            FILE *f = fopen(tpath(bad), "wb");
            fwrite(b, 1, at, f);
            fwrite(junk, 1, sizeof junk, f);
            fwrite(b + at + sizeof junk, 1, n - at - sizeof junk, f);
            fclose(f);
            for (int skip = 0; skip < 2; skip++) {
                int count[3], rc[3];
                loom_err err[3];
                for (int m = 0; m < 3; m++) {
                    setenv("LOOM_DATA_READAHEAD", ra[m], 1);
                    setenv("LOOM_DATA_DECOMPRESS_AHEAD", da[m], 1);
                    loom_dataset_spec *s = spec_fmnist(tpath(bad));
                    if (skip) s->source.tfrecord.on_corrupt = LOOM_TFR_CORRUPT_SKIP;
                    rc[m] = read_until_error(s, &count[m], &err[m]);
                    free(s);
                    if (m && (rc[m] != rc[0] || count[m] != count[0] ||
                              (rc[0] != LOOM_EEOF && (strcmp(err[m].msg, err[0].msg) || strcmp(err[m].where, err[0].where))))) {
                        differ++;
                        printf("#   %s offset %zu, skip %d, mode %d: rc %d after %d elements (%s: %s); inline rc %d after %d (%s: %s)\n",
                               ext[c], at, skip, m, rc[m], count[m], err[m].where, err[m].msg, rc[0], count[0], err[0].where,
                               err[0].msg);
                    }
                }
                CHECK_MSG(skip ? rc[0] == LOOM_EEOF : rc[0] == LOOM_EDATA, "%s offset %zu skip %d: rc %d", ext[c], at, skip, rc[0]);
                CHECK_MSG(count[0] > 300 && count[0] < 2400, "%s offset %zu skip %d: %d elements", ext[c], at, skip, count[0]);
                if (!skip) CHECK_CONTAINS(err[0].where, bad);
                if (!skip) stream_errors += strstr(err[0].msg, " stream in the record at offset ") != NULL;
                cases++;
            }
        }
        free(b);
    }
    unsetenv("LOOM_DATA_READAHEAD");
    unsetenv("LOOM_DATA_DECOMPRESS_AHEAD");
    loom_log_set_level(LOOM_LOG_INFO);
    CHECK(cases >= 12 && differ == 0);
    CHECK_MSG(stream_errors >= 2, "%d of the damages were found by the decompressor", stream_errors); /* not only CRCs */
}

static void test_feature_errors(void)
{
    static const struct {
        int fault;
        const char *want[3];
    } cases[] = {
        {F_LABEL_FLOAT, {"feature \"label\": expected int64_list (int64 ()), found float_list with 1 values"}},
        {F_NO_LABEL, {"feature \"label\": required but missing (expected int64_list int64 ())"}},
        {F_SHORT_IMAGE, {"feature \"image\": expected 784 bytes for uint8 (raw bytes), found 783"}},
        {F_LONG_TOKENS, {"feature \"tokens\": expected at most 16 values of int64, found 17"}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        for (int at = 0; at < 2; at++) { /* record 0: caught at open by the probe; record 5: while reading */
            int rec = at ? 5 : 0;
            const char *path = tpath("bad-feature.tfrecord.gz");
            write_examples(path, LOOM_COMP_GZIP, 0, 8, rec, cases[i].fault);
            loom_dataset_spec *s = spec_fmnist(path);
            int count;
            loom_err err;
            int rc = read_until_error(s, &count, &err);
            CHECK_MSG(rc == LOOM_EDATA, "case %zu: rc %d: %s", i, rc, err.msg);
            CHECK(count == rec);
            CHECK_CONTAINS(err.where, "bad-feature.tfrecord.gz");
            char want[64];
            snprintf(want, sizeof want, "record %d at offset ", rec);
            CHECK_CONTAINS(err.msg, want);
            CHECK_CONTAINS(err.msg, cases[i].want[0]);
            CHECK_CONTAINS(err.hint, "features declared at test.cfg:4");
            if (rec == 0) CHECK_CONTAINS(err.msg, "record 0 at offset 0: ");
            free(s);
        }
    }
    /* a pattern whose files went away after the config was loaded */
    loom_dataset_spec *s = spec_fmnist(tpath("gone-*.tfrecord"));
    loom_iter *it = NULL;
    loom_err err = {0};
    CHECK(loom_data_open(&it, s, &ctx2, &err) == LOOM_EIO && !it);
    CHECK_CONTAINS(err.where, "test.cfg:4");
    CHECK_CONTAINS(err.msg, "data.train.source: no files match \"");
    free(s);
}

static void test_corrupt(void)
{
    const char *path = tpath("corrupt.tfrecord");
    write_examples(path, LOOM_COMP_NONE, 0, 10, -1, F_NONE);
    /* flip a payload byte of record 3, found with the reader */
    loom_tfrecord *rd;
    loom_err e0 = {0};
    const uint8_t *d;
    size_t len;
    CHECK(loom_tfrecord_open(&rd, path, LOOM_COMP_NONE, LOOM_CORRUPT_ERROR, &e0) == LOOM_OK);
    for (int i = 0; i < 3; i++) CHECK(loom_tfrecord_next(rd, &d, &len, &e0) == LOOM_OK);
    long rec3 = (long)loom_tfrecord_offset(rd), off3 = rec3 + 12 + 40;
    loom_tfrecord_close(rd);
    FILE *f = fopen(path, "r+b");
    fseek(f, off3, SEEK_SET);
    int ch = fgetc(f);
    fseek(f, off3, SEEK_SET);
    fputc(ch ^ 0x55, f);
    fclose(f);
    loom_log_set_level(LOOM_LOG_ERROR); /* the skip warnings are expected */
    loom_dataset_spec *s = spec_fmnist(path);
    int count;
    loom_err err;
    CHECK(read_until_error(s, &count, &err) == LOOM_EDATA);
    CHECK(count == 3);
    CHECK_CONTAINS(err.where, "corrupt.tfrecord");
    char want[96];
    snprintf(want, sizeof want, "record 3: corrupted record: data CRC mismatch");
    CHECK_CONTAINS(err.msg, want);
    snprintf(want, sizeof want, "at offset %ld (uncompressed stream)", rec3);
    CHECK_CONTAINS(err.msg, want);
    /* skip: the other 9, in order */
    s->source.tfrecord.on_corrupt = LOOM_TFR_CORRUPT_SKIP;
    loom_iter *it = open_ok(s);
    if (it) {
        int64_t ids[16];
        int n = 0, bad = 0;
        CHECK(run_pass(it, ids, &n, 16, &bad, &err) == 9 && bad == 0);
        for (int i = 0; i < n; i++) bad += ids[i] != (i < 3 ? i : i + 1);
        CHECK(bad == 0);
        loom_iter_close(it);
    }
    free(s);

    /* a record with valid CRCs whose payload is no Example: an error, or skipped */
    path = tpath("garbage.tfrecord.zst");
    write_examples(path, LOOM_COMP_ZSTD, 0, 6, 4, F_GARBAGE);
    s = spec_fmnist(path);
    CHECK(read_until_error(s, &count, &err) == LOOM_EDATA);
    CHECK(count == 4);
    CHECK_CONTAINS(err.msg, "record 4 at offset ");
    s->source.tfrecord.on_corrupt = LOOM_TFR_CORRUPT_SKIP;
    CHECK(read_until_error(s, &count, &err) == LOOM_EEOF);
    CHECK(count == 5);
    free(s);

    /* a truncated shard in skip mode ends that file; the next shard is read */
    make_shards();
    size_t n = 0;
    uint8_t *raw = NULL;
    loom_err e2 = {0};
    CHECK(loom_read_file(tpath("train-00002-of-00004.tfrecord"), &raw, &n, &e2) == LOOM_OK);
    FILE *g = fopen(tpath("cut-a.tfrecord"), "wb");
    fwrite(raw, 1, n * 2 / 3, g);
    fclose(g);
    loom_free(raw);
    write_examples(tpath("cut-b.tfrecord"), LOOM_COMP_NONE, 500, 4, -1, F_NONE);
    s = spec_fmnist(tpath("cut-*.tfrecord"));
    CHECK(read_until_error(s, &count, &err) == LOOM_EDATA);
    CHECK_CONTAINS(err.where, "cut-a.tfrecord");
    int first = count;
    CHECK(first > 0 && first < 25);
    s->source.tfrecord.on_corrupt = LOOM_TFR_CORRUPT_SKIP;
    CHECK(read_until_error(s, &count, &err) == LOOM_EEOF);
    CHECK_MSG(count == first + 4, "%d elements, expected %d", count, first + 4);
    free(s);
    loom_log_set_level(LOOM_LOG_INFO);
}

/* ---- save / restore ------------------------------------------------------------- */

/* One element, or EOF + rewind to the next epoch first; returns false after `epochs`. */
static bool step(loom_iter *it, int *epoch, int epochs, blob *b)
{
    loom_elem *e;
    loom_err err = {0};
    for (;;) {
        int rc = loom_iter_next(it, &e, &err);
        if (rc == LOOM_OK) break;
        CHECK_MSG(rc == LOOM_EEOF, "%s: %s", err.where, err.msg);
        if (rc != LOOM_EEOF || ++*epoch >= epochs) return false;
        CHECK(loom_iter_rewind(it, *epoch, &err) == LOOM_OK);
    }
    for (int f = 0; f < e->n; f++) {
        blob_put(b, &e->t[f].shape, sizeof e->t[f].shape);
        blob_put(b, e->t[f].data, loom_tensor_nbytes(&e->t[f]));
    }
    b->count++;
    return true;
}

static void test_save_restore(void)
{
    make_shards();
    for (int variant = 0; variant < 3; variant++) {
        loom_dataset_spec *s = spec_fmnist(tpath("train-*.tfrecord"));
        s->source.shuffle_files = variant > 0;
        if (variant == 2) {
            spec_shuffle(s, 10);
            spec_batch(s, 7);
            spec_prefetch(s, 2);
        }
        const int epochs = 2;
        blob ref = {0};
        loom_iter *it = open_ok(s);
        int ep = 0;
        size_t off[256];
        int total = 0;
        while (it && total < 255) {
            off[total] = ref.n;
            if (!step(it, &ep, epochs, &ref)) break;
            total++;
        }
        off[total] = ref.n;
        loom_iter_close(it);
        CHECK(total == (variant == 2 ? 2 * 15 : 200));
        /* cuts: start, inside a file, at a file boundary, into the second epoch, the end */
        int cuts[] = {0, 1, 13, 25, 26, 60, 99, 100, 101, 160, total};
        for (size_t c = 0; c < sizeof cuts / sizeof cuts[0]; c++) {
            int k = cuts[c];
            if (k > total) continue;
            loom_iter *a = open_ok(s);
            if (!a) continue;
            blob head = {0}, rest = {0};
            int ea = 0;
            for (int i = 0; i < k; i++) step(a, &ea, epochs, &head);
            loom_buf b;
            loom_buf_init(&b);
            loom_err err = {0};
            CHECK(loom_iter_save(a, &b, &err) == LOOM_OK);
            loom_iter_close(a);
            loom_iter *r = open_ok(s);
            if (r) {
                loom_buf rb;
                loom_buf_wrap(&rb, b.data, b.len);
                int rc = loom_iter_restore(r, &rb, &err);
                CHECK_MSG(rc == LOOM_OK, "restore: %s: %s", err.where, err.msg);
                int er = ea;
                while (!rc && step(r, &er, epochs, &rest)) {
                }
                loom_iter_close(r);
            }
            size_t tail = ref.n - off[k];
            CHECK_MSG(rest.n == tail && (!tail || !memcmp(rest.p, ref.p + off[k], tail)),
                      "variant %d cut %d: the restored run differs (%zu vs %zu bytes)", variant, k, rest.n, tail);
            free(head.p);
            free(rest.p);
            loom_buf_fini(&b);
        }
        free(ref.p);
        free(s);
    }
}

static void test_restore_refused(void)
{
    make_shards();
    loom_dataset_spec *s = spec_fmnist(tpath("train-*.tfrecord"));
    loom_iter *a = open_ok(s);
    if (!a) {
        free(s);
        return;
    }
    loom_elem *e;
    loom_err err = {0};
    for (int i = 0; i < 30; i++) CHECK(loom_iter_next(a, &e, &err) == LOOM_OK);
    loom_buf b;
    loom_buf_init(&b);
    CHECK(loom_iter_save(a, &b, &err) == LOOM_OK);
    loom_iter_close(a);
    /* another feature spec, or another file list: another fingerprint */
    for (int v = 0; v < 3; v++) {
        loom_dataset_spec *o = spec_fmnist(tpath(v == 2 ? "train-0000[012]-*" : "train-*.tfrecord"));
        if (v == 0) o->source.tfrecord.features[3].pad = 0;
        if (v == 1) o->source.tfrecord.features[2].default_value = 2.0;
        loom_iter *r = open_ok(o);
        if (r) {
            loom_buf rb;
            loom_buf_wrap(&rb, b.data, b.len);
            CHECK(loom_iter_restore(r, &rb, &err) == LOOM_ECHECKPOINT);
            CHECK_CONTAINS(err.msg, "iterator state was saved by a different pipeline");
            loom_iter_close(r);
        }
        free(o);
    }
    /* the same names, but the file being read changed: found out while reading forward */
    const char *p1 = tpath("train-00001-of-00004.tfrecord");
    size_t n;
    uint8_t *orig = NULL;
    CHECK(loom_read_file(p1, &orig, &n, &err) == LOOM_OK);
    write_examples(p1, LOOM_COMP_GZIP, 25, 3, -1, F_NONE);
    loom_iter *r = open_ok(s);
    if (r) {
        loom_buf rb;
        loom_buf_wrap(&rb, b.data, b.len);
        CHECK(loom_iter_restore(r, &rb, &err) == LOOM_ECHECKPOINT);
        CHECK_CONTAINS(err.where, "train-00001-of-00004.tfrecord");
        CHECK_CONTAINS(err.msg, "the iterator state is 5 records into this file, but it holds only 3 now");
        loom_iter_close(r);
    }
    /* restore the shard as it was (gzip), for the other tests */
    FILE *f = fopen(p1, "wb");
    fwrite(orig, 1, n, f);
    fclose(f);
    loom_free(orig);
    loom_buf_fini(&b);
    free(s);
}

/* ---- the files TensorFlow wrote --------------------------------------------------- */

static char *read_text(const char *path)
{
    size_t n = 0;
    uint8_t *raw = NULL;
    loom_err err = {0};
    if (loom_read_file(path, &raw, &n, &err)) return NULL;
    char *t = malloc(n + 1);
    memcpy(t, raw, n);
    t[n] = 0;
    loom_free(raw);
    return t;
}

static const char *jkey(const char *p, const char *key)
{
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\": ", key);
    const char *q = p ? strstr(p, pat) : NULL;
    return q ? q + strlen(pat) : NULL;
}

/* Integers of a JSON array (exact, unlike strtod) or numbers as doubles. */
static int jints(const char *p, int64_t *out, int max)
{
    int n = 0;
    if (!p || *p != '[') return -1;
    for (p++; *p && *p != ']' && n < max;) {
        char *e;
        out[n++] = strtoll(p, &e, 10);
        if (e == p) return -1;
        for (p = e; *p == ',' || *p == ' ';) p++;
    }
    return n;
}

static int jnums(const char *p, double *out, int max)
{
    int n = 0;
    if (!p || *p != '[') return -1;
    for (p++; *p && *p != ']' && n < max;) {
        char *e;
        out[n++] = strtod(p, &e);
        if (e == p) return -1;
        for (p = e; *p == ',' || *p == ' ';) p++;
    }
    return n;
}

static char *fixture_dir(void)
{
    static char dir[512];
    const char *root = getenv("LOOM_SOURCE_ROOT");
    snprintf(dir, sizeof dir, "%s/tests/fixtures/tf", root ? root : ".");
    return dir;
}

/* Checks one element (image, label, weights, tokens (8) pad -1) against record r of expected.json; returns wrong
 * values. */
static int check_tf_elem(const loom_elem *e, const char *json, int r)
{
    const char *cur = strstr(json, "\"records\"");
    for (int i = 0; cur && i <= r; i++) cur = strstr(cur + 1, "{\"label\"");
    if (!cur) return 1;
    const char *next = strstr(cur + 1, "{\"label\"");
    int bad = *(const int64_t *)e->t[1].data != strtoll(jkey(cur, "label"), NULL, 10);
    double w[8];
    bad += jnums(jkey(cur, "weights"), w, 8) != 3;
    for (int k = 0; k < 3; k++) bad += ((const float *)e->t[2].data)[k] != (float)w[k];
    int64_t toks[8];
    const char *tp = jkey(cur, "tokens");
    int nt = tp && (!next || tp < next) ? jints(tp, toks, 8) : -1;
    bad += nt < 0;
    for (int k = 0; k < 8; k++) bad += ((const int64_t *)e->t[3].data)[k] != (k < nt ? toks[k] : -1);
    const char *hex = jkey(cur, "image_hex");
    for (int k = 0; hex && k < IMG; k++) {
        unsigned v;
        if (sscanf(hex + 1 + 2 * k, "%2x", &v) != 1) return bad + 1;
        bad += ((const uint8_t *)e->t[0].data)[k] != v;
    }
    return bad + !hex;
}

static void test_tf_fixtures(void)
{
    char path[400];
    snprintf(path, sizeof path, "%.380s/expected.json", fixture_dir());
    char *json = read_text(path);
    CHECK_MSG(json, "cannot read %s", path);
    if (!json) return;
    /* the three files (none, gzip, zlib; detected) through one glob, each 20 records in file order */
    snprintf(path, sizeof path, "%.380s/examples.tfrecord*", fixture_dir());
    loom_dataset_spec *s = spec_new();
    spec_files(s, path);
    int64_t hw[2] = {28, 28}, three[1] = {3}, eight[1] = {8};
    spec_feat(s, "image", LOOM_TFR_UINT8, 2, hw);
    spec_feat(s, "label", LOOM_TFR_INT64, 0, NULL);
    spec_feat(s, "weights", LOOM_TFR_FLOAT32, 1, three);
    loom_tfr_feature *t = spec_feat(s, "tokens", LOOM_TFR_INT64, 1, eight);
    t->var_len = true;
    t->pad = -1;
    spec_prefetch(s, 2);
    loom_iter *it = open_ok(s);
    if (it) {
        loom_elem *e;
        loom_err err = {0};
        int rc, n = 0, bad = 0;
        while ((rc = loom_iter_next(it, &e, &err)) == LOOM_OK) bad += check_tf_elem(e, json, n++ % 20);
        CHECK_MSG(rc == LOOM_EEOF, "%s: %s", err.where, err.msg);
        CHECK_MSG(n == 60, "%d records", n);
        CHECK_MSG(bad == 0, "%d values differ from expected.json", bad);
        loom_iter_close(it);
    }
    free(s);
    free(json);
}

/* ---- config ------------------------------------------------------------------------ */

static void test_config_good(void)
{
    loom_spec *spec = NULL;
    loom_errlist errs;
    char text[8192];
    int rc = loom_config_load(&spec, cfg_path("good_tfrecord.cfg"), NULL, 0, &errs);
    errs_text(&errs, text, sizeof text);
    CHECK_MSG(rc == LOOM_OK, "%s", text);
    if (rc) return;
    const loom_source_spec *src = &spec->train.source;
    CHECK(src->kind == LOOM_SRC_TFRECORD && src->n_patterns == 1 && src->n_features == 5);
    CHECK(src->pattern[0][0] == '/');
    CHECK_CONTAINS(src->pattern[0], "tests/configs/../fixtures/tf/examples.tfrecord*");
    CHECK(src->tfrecord.compression == LOOM_TFR_COMP_AUTO && src->tfrecord.on_corrupt == LOOM_TFR_CORRUPT_ERROR &&
          src->shuffle_files);
    CHECK(!strcmp(src->feature[0], "image") && src->tfrecord.features[0].dtype == LOOM_TFR_UINT8 &&
          src->tfrecord.features[0].rank == 2 && src->tfrecord.features[0].shape[1] == 28 &&
          !src->tfrecord.features[0].has_default && !src->tfrecord.features[0].var_len);
    CHECK(!strcmp(src->feature[1], "label") && src->tfrecord.features[1].dtype == LOOM_TFR_INT64 &&
          src->tfrecord.features[1].rank == 0);
    CHECK(src->tfrecord.features[3].var_len && src->tfrecord.features[3].pad == -1 &&
          src->tfrecord.features[3].shape[0] == 8);
    CHECK(src->tfrecord.features[4].has_default && src->tfrecord.features[4].default_value == 0.5 &&
          src->tfrecord.features[4].dtype == LOOM_TFR_FLOAT32);
    CHECK(spec->eval.source.n_patterns == 2 && spec->eval.source.tfrecord.on_corrupt == LOOM_TFR_CORRUPT_SKIP);

    /* print -> load gives the same spec (locations aside) */
    char path[] = "/tmp/loom_test_tfr_print_XXXXXX";
    int fd = mkstemp(path);
    FILE *f = fdopen(fd, "w");
    loom_config_print(spec, f);
    fclose(f);
    loom_spec *back = NULL;
    rc = loom_config_load(&back, path, NULL, 0, &errs);
    errs_text(&errs, text, sizeof text);
    CHECK_MSG(rc == LOOM_OK, "printed config does not load: %s", text);
    if (!rc) {
        loom_dataset_spec *d[4] = {&spec->train, &spec->eval, &back->train, &back->eval};
        for (int i = 0; i < 4; i++) {
            memset(&d[i]->loc, 0, sizeof d[i]->loc);
            memset(&d[i]->source.loc, 0, sizeof d[i]->source.loc);
            memset(&d[i]->options.loc, 0, sizeof d[i]->options.loc);
            for (int j = 0; j < LOOM_MAX_TRANSFORMS; j++) memset(&d[i]->transform[j].loc, 0, sizeof(loom_loc));
        }
        CHECK_MSG(!memcmp(&spec->train, &back->train, sizeof spec->train) &&
                      !memcmp(&spec->eval, &back->eval, sizeof spec->eval),
                  "printed tfrecord sources load back different");
        loom_config_free(back);
    }
    unlink(path);

    /* the pipeline of the loaded spec reads the TensorFlow files: 60 records in batches of 8 */
    loom_data_ctx ctx = {.seed = spec->run.seed, .threads = 1, .name = "train"};
    loom_iter *it = NULL;
    loom_err err = {0};
    rc = loom_data_open(&it, &spec->train, &ctx, &err);
    CHECK_MSG(rc == LOOM_OK, "%s: %s", err.where, err.msg);
    if (!rc) {
        loom_elem *e;
        int n = 0, batches = 0, bad = 0;
        while ((rc = loom_iter_next(it, &e, &err)) == LOOM_OK) {
            n += (int)e->t[1].shape.dim[0];
            batches++;
            for (int64_t i = 0; i < e->t[4].shape.dim[0] * 2; i++) bad += ((const float *)e->t[4].data)[i] != 0.5f;
        }
        CHECK_MSG(rc == LOOM_EEOF && n == 60 && batches == 8 && bad == 0, "rc %d n %d batches %d bad %d: %s", rc, n,
                  batches, bad, err.msg);
        loom_iter_close(it);
    }
    rc = loom_data_open(&it, &spec->eval, &ctx, &err);
    CHECK_MSG(rc == LOOM_OK, "%s: %s", err.where, err.msg);
    if (!rc) {
        loom_elem *e;
        int n = 0;
        while (loom_iter_next(it, &e, &err) == LOOM_OK) n++;
        CHECK(n == 40);
        loom_iter_close(it);
    }
    loom_config_free(spec);
}

/* More checks than the bad_tfrecord_*.cfg goldens, as overrides of the good config. */
static void test_config_errors(void)
{
    static const struct {
        const char *set, *want;
    } cases[] = {
        {"data.train.source.features.label.pad=3",
         "--set data.train.source.features.label.pad: pad applies only with var_len = true"},
        {"data.train.source.features.tokens.default=3", "default applies only to fixed-length features"},
        {"data.train.source.features.image.default=300",
         "features.image.default: expected an integer in [0, 255], got 300"},
        {"data.train.source.features.label.default=1.5",
         "features.label.default: expected an integer (the feature is int64), got 1.5"},
        {"data.train.source.features.label.shape=[0]", "features.label.shape.[0]: expected an integer >= 1, got 0"},
        {"data.train.source.features.label.shape=[1,2,3,4,5,6,7,8,9]", "expected 0 to 8 dimensions, got 9"},
        {"data.train.source.features.tokens.shape=[]", "a var_len feature needs a shape with at least one dimension"},
        {"data.train.source.features.label.dtype=\"int32\"",
         "unknown value \"int32\" (expected one of: uint8, int64, float32)"},
        {"data.train.source.features.label.shape=7", "expected a shape such as [28, 28] ([] for a scalar), got 7"},
        {"data.train.source.compression=\"GZIP\"",
         "unknown value \"GZIP\" (expected one of: auto, none, gzip, zlib, zstd)"},
        {"data.train.source.on_corrupt=\"skp\"", "did you mean \"skip\"?"},
        {"data.train.source.files=[]", "expected 1 to 16 paths or patterns, got 0"},
        {"data.train.source.files=5", "expected a list of paths or glob patterns"},
        {"data.train.source.files=\"/nonexistent/x.tfrecord\"", "cannot read \"/nonexistent/x.tfrecord\""},
        {"data.train.source.shufle_files=true", "unknown setting `shufle_files` (did you mean `shuffle_files`?)"},
        {"data.train.source.split=\"train\"", "split applies only to type = \"catalog\" (type is \"tfrecord\")"},
        {"data.train.source.features.label.size=3", "unknown setting `size`"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        loom_spec *spec = NULL;
        loom_errlist errs;
        char text[8192];
        const char *ov[1] = {cases[i].set};
        int rc = loom_config_load(&spec, cfg_path("good_tfrecord.cfg"), ov, 1, &errs);
        errs_text(&errs, text, sizeof text);
        CHECK_MSG(rc == LOOM_ECONFIG, "%s: rc %d", cases[i].set, rc);
        CHECK_MSG(strstr(text, cases[i].want), "%s: expected\n#   %s\n# in\n%s", cases[i].set, cases[i].want, text);
        loom_config_free(spec);
    }
    /* a single string is one pattern */
    loom_spec *spec = NULL;
    loom_errlist errs;
    const char *ov[1] = {"data.train.source.files=\"../fixtures/tf/examples.tfrecord.gz\""};
    CHECK(loom_config_load(&spec, cfg_path("good_tfrecord.cfg"), ov, 1, &errs) == LOOM_OK);
    if (spec) CHECK(spec->train.source.n_patterns == 1);
    loom_config_free(spec);
}

/* ---- allocation failures ----------------------------------------------------------- */

static void test_out_of_memory(void)
{
    make_shards();
    loom_dataset_spec *s = spec_fmnist(tpath("train-0000[01]-*"));
    spec_batch(s, 10);
    int nomem = 0, ok = 0;
    for (long k = 0; k < 200; k++) {
        loom_iter *it = NULL;
        loom_err err = {0};
        loom_alloc_fail_after(k);
        int rc = loom_data_open(&it, s, &ctx2, &err);
        loom_elem *e;
        int n = 0;
        while (!rc && (rc = loom_iter_next(it, &e, &err)) == LOOM_OK) n++;
        loom_alloc_fail_after(-1);
        if (rc == LOOM_EEOF) rc = n == 5 ? LOOM_OK : -1;
        CHECK_MSG(rc == LOOM_OK || rc == LOOM_ENOMEM, "fail after %ld: rc %d: %s", k, rc, err.msg);
        nomem += rc == LOOM_ENOMEM;
        ok += rc == LOOM_OK;
        loom_iter_close(it);
    }
    CHECK(nomem > 0 && ok > 0);
    free(s);
}

/* A damaged compressed shard, read through the source: gzip with bad deflate
 * data mid-file, a damaged member header, a member trailer whose CRC-32 or
 * size is wrong, a truncated member, bytes after the last member; zstd with a
 * damaged frame mid-file and truncated. Each is an error naming the file, the
 * record and its offset, with a hint saying what to do; never a short epoch:
 * the records before the damage come first (all of a member whose trailer
 * alone is bad), and in skip mode the file ends there, with a warning. The
 * gzip file is two members of N/2 records (as `cat a.gz b.gz` makes), so the
 * damage lies mid-file at a known record. */
static void put(FILE *f, const uint8_t *b, size_t from, size_t to)
{
    if (to > from) fwrite(b + from, 1, to - from, f);
}

static void test_damaged_streams(void)
{
    enum { N = 400 };
    loom_log_set_level(LOOM_LOG_ERROR); /* the skip warnings are expected */
    const char *bad[] = {"damaged.tfrecord.gz", "damaged.tfrecord.zst"};
    write_examples(tpath("half-a.gz"), LOOM_COMP_GZIP, 0, N / 2, -1, F_NONE);
    write_examples(tpath("half-b.gz"), LOOM_COMP_GZIP, N / 2, N / 2, -1, F_NONE);
    write_examples(tpath("whole.zst"), LOOM_COMP_ZSTD, 0, N, -1, F_NONE);
    size_t na = 0, nb = 0, nz = 0;
    uint8_t *ga = slurp(tpath("half-a.gz"), &na), *gb = slurp(tpath("half-b.gz"), &nb); /* the bytes as stored */
    uint8_t *z = slurp(tpath("whole.zst"), &nz);
    CHECK(ga && gb && z && na > 40 && nb > 40);
    if (!ga || !gb || !z || na <= 40 || nb <= 40) goto out;
    size_t z1 = ZSTD_findFrameCompressedSize(z, nz); /* the writer's first frame; the second starts there */
    CHECK_MSG(!ZSTD_isError(z1) && z1 + 16 < nz, "the zstd file is one frame (%zu of %zu bytes)", z1, nz);
    if (ZSTD_isError(z1) || z1 + 16 >= nz) goto out;
    static const struct {
        const char *name;
        int zstd, lo, hi; /* records delivered before the error: lo..hi */
        const char *text;
    } cases[] = {
        {"deflate data mid-file", 0, N / 2, N / 2, "damaged deflate data (invalid block type)"},
        {"second member's header", 0, N / 2, N / 2, "a gzip member header is damaged"},
        {"first member's trailer CRC-32", 0, N / 2, N / 2,
         "the gzip member trailer's CRC-32 does not match the decompressed bytes (incorrect data check)"},
        {"last member's trailer size", 0, N, N, "the gzip member trailer's size (ISIZE) does not match the decompressed length"},
        {"truncated member", 0, N / 2 + 1, N - 1, "the compressed stream is truncated (file ends before its end marker)"},
        {"bytes after the last member", 0, N, N, "bytes that are not gzip follow the last member"},
        {"zstd frame mid-file", 1, 1, N - 1, "corrupt ZSTD stream"},
        {"truncated zstd", 1, 1, N - 1, "the zstd stream is truncated (file ends inside a frame)"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *path = tpath(bad[cases[i].zstd]);
        FILE *f = fopen(path, "wb");
        static const uint8_t junk[] = {0x00, 0x01, 0x02, 'j', 'u', 'n', 'k'};
        uint8_t x;
        switch (i) {
        case 0: /* the second member's first deflate block: BTYPE 11 is reserved */
            put(f, ga, 0, na), put(f, gb, 0, 10), x = gb[10] | 0x06, fwrite(&x, 1, 1, f), put(f, gb, 11, nb);
            break;
        case 1: /* its FLG byte with reserved bits set */
            put(f, ga, 0, na), put(f, gb, 0, 3), x = 0xe0, fwrite(&x, 1, 1, f), put(f, gb, 4, nb);
            break;
        case 2:
            put(f, ga, 0, na - 8), x = ga[na - 8] ^ 0xff, fwrite(&x, 1, 1, f), put(f, ga, na - 7, na), put(f, gb, 0, nb);
            break;
        case 3:
            put(f, ga, 0, na), put(f, gb, 0, nb - 2), x = gb[nb - 2] ^ 0xff, fwrite(&x, 1, 1, f), put(f, gb, nb - 1, nb);
            break;
        case 4: put(f, ga, 0, na), put(f, gb, 0, nb / 2); break;
        case 5: put(f, ga, 0, na), put(f, gb, 0, nb), fwrite(junk, 1, sizeof junk, f); break;
        case 6: /* the second frame's magic */
            put(f, z, 0, z1), x = z[z1] ^ 0xff, fwrite(&x, 1, 1, f), put(f, z, z1 + 1, nz);
            break;
        case 7: put(f, z, 0, z1 + (nz - z1) / 2); break;
        }
        fclose(f);
        loom_dataset_spec *s = spec_fmnist(path);
        int count;
        loom_err err;
        int rc = read_until_error(s, &count, &err);
        CHECK_MSG(rc == LOOM_EDATA, "%s: rc %d after %d elements", cases[i].name, rc, count);
        CHECK_MSG(count >= cases[i].lo && count <= cases[i].hi, "%s: %d elements before the error", cases[i].name, count);
        CHECK_CONTAINS(err.where, bad[cases[i].zstd]);
        char want[64];
        snprintf(want, sizeof want, "record %d: corrupt ", count); /* the first record not delivered */
        CHECK_CONTAINS(err.msg, want);
        CHECK_CONTAINS(err.msg, " stream in the record at offset ");
        CHECK_CONTAINS(err.msg, cases[i].text);
        CHECK_CONTAINS(err.hint, "the file is damaged or truncated");
        CHECK_CONTAINS(err.hint, "on_corrupt = skip");
        int first = count;
        s->source.tfrecord.on_corrupt = LOOM_TFR_CORRUPT_SKIP; /* the file ends at the damage, with a warning */
        rc = read_until_error(s, &count, &err);
        CHECK_MSG(rc == LOOM_EEOF && count == first, "%s, skip: rc %d after %d elements (error mode: %d)", cases[i].name, rc,
                  count, first);
        free(s);
    }
out:
    free(ga);
    free(gb);
    free(z);
    loom_log_set_level(LOOM_LOG_INFO);
}

static const loom_test tests[] = {
    {"all_compressions", test_all_compressions},
    {"glob_shards", test_glob_shards},
    {"shuffle_batch_prefetch", test_shuffle_batch_prefetch},
    {"batch_digest", test_batch_digest},
    {"fused_shuffle_digest", test_fused_shuffle_digest},
    {"decompress_ahead_errors", test_ahead_errors},
    {"readahead_start", test_readahead_start},
    {"feature_errors", test_feature_errors},
    {"corrupt_error_and_skip", test_corrupt},
    {"damaged_streams", test_damaged_streams},
    {"nonfinite_error_and_skip", test_nonfinite},
    {"save_restore", test_save_restore},
    {"restore_refused", test_restore_refused},
    {"tf_fixtures", test_tf_fixtures},
    {"config_good", test_config_good},
    {"config_errors", test_config_errors},
    {"out_of_memory", test_out_of_memory},
    {0},
};

int main(void)
{
    return run_in_tmpdir("loom_test_tfrecord_source", tests);
}
