/* test_data.c - the input pipeline: IDX and catalog sources (with their
 * errors), shuffle against a reference of tf.data's algorithm,
 * shuffle by index (random-access sources) equal to shuffle by element, element
 * for element, across buffers, seeds, epochs, repeat and resume,
 * batch/repeat/take/skip, prefetch equivalence, exact save/restore, stats,
 * and a throughput figure on Fashion-MNIST (a TAP comment, not a check).
 * The map ops are in test_data_maps.c; the fixtures in data_fixtures.h.
 * Fixtures are written to a temporary directory at run time.
 * LOOM_DATA_SKIP_CATALOG=1 skips the tests that read the real dataset
 * (for valgrind runs). */
#include "data_fixtures.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

/* ---- sources -------------------------------------------------------------- */

static void test_idx_source(void)
{
    setup();
    for (int gz = 0; gz < 2; gz++) {
        loom_dataset_spec *s = spec_small(gz);
        loom_iter *it = open_ok(s);
        if (!it) {
            free(s);
            continue;
        }
        char buf[256];
        CHECK_CONTAINS(loom_elem_spec_str(loom_iter_spec(it), buf, sizeof buf), "image: uint8 (4, 3); label: uint8 ()");
        CHECK(loom_iter_cardinality(it) == N_ITEMS);
        for (int epoch = 0; epoch < 2; epoch++) {
            loom_elem *e;
            loom_err err = {0};
            int i = 0, bad = 0;
            while (loom_iter_next(it, &e, &err) == LOOM_OK) {
                bad += e->n != 2 || e->t[0].dtype != LOOM_U8 || e->t[0].shape.rank != 2 || e->t[1].shape.rank != 0;
                for (int k = 0; k < 12; k++) bad += ((uint8_t *)e->t[0].data)[k] != i * 16 + k;
                bad += *(uint8_t *)e->t[1].data != i;
                i++;
            }
            CHECK(bad == 0);
            CHECK(i == N_ITEMS);
            CHECK(loom_iter_next(it, &e, &err) == LOOM_EEOF); /* sticky */
            CHECK(loom_iter_rewind(it, epoch + 1, &err) == LOOM_OK);
        }
        loom_iter_close(it);
        free(s);
    }
}

static void test_idx_dtypes(void)
{
    setup();
    uint32_t d[2] = {3, 2};
    int8_t i8[6] = {-1, 2, -3, 4, -128, 127};
    int16_t i16[6] = {-1000, 2, 3, 4, 5, 32767};
    int32_t i32[6] = {-100000, 1, 2, 3, 4, 2147483647};
    float f32[6] = {1.5f, -2.25f, 3, 4, 5, 1e-3f};
    double f64[6] = {1.5, -2.25, 3, 4, 5, 1e-300};
    write_idx(tpath("i8.idx"), 0, 0x09, 2, d, i8, 0);
    write_idx(tpath("i16.idx"), 1, 0x0B, 2, d, i16, 0);
    write_idx(tpath("i32.idx"), 0, 0x0C, 2, d, i32, 0);
    write_idx(tpath("f32.idx"), 1, 0x0D, 2, d, f32, 0);
    write_idx(tpath("f64.idx"), 0, 0x0E, 2, d, f64, 0);
    loom_dataset_spec *s = spec_new();
    spec_feature(s, "a", tpath("i8.idx"));
    spec_feature(s, "b", tpath("i16.idx"));
    spec_feature(s, "c", tpath("i32.idx"));
    spec_feature(s, "d", tpath("f32.idx"));
    spec_feature(s, "e", tpath("f64.idx"));
    loom_iter *it = open_ok(s);
    if (it) {
        const loom_elem_spec *sp = loom_iter_spec(it);
        CHECK(sp->dtype[0] == LOOM_I32 && sp->dtype[1] == LOOM_I32 && sp->dtype[2] == LOOM_I32);
        CHECK(sp->dtype[3] == LOOM_F32 && sp->dtype[4] == LOOM_F64);
        CHECK(sp->shape[0].rank == 1 && sp->shape[0].dim[0] == 2);
        loom_elem *e;
        loom_err err;
        for (int i = 0; i < 3; i++) {
            CHECK(loom_iter_next(it, &e, &err) == LOOM_OK);
            for (int k = 0; k < 2; k++) {
                CHECK(loom_tensor_get(&e->t[0], k) == i8[i * 2 + k]);
                CHECK(loom_tensor_get(&e->t[1], k) == i16[i * 2 + k]);
                CHECK(loom_tensor_get(&e->t[2], k) == i32[i * 2 + k]);
                CHECK(loom_tensor_get(&e->t[3], k) == f32[i * 2 + k]);
                CHECK(loom_tensor_get(&e->t[4], k) == f64[i * 2 + k]);
            }
        }
        CHECK(loom_iter_next(it, &e, &err) == LOOM_EEOF);
        loom_iter_close(it);
    }
    free(s);
}

static void test_idx_errors(void)
{
    setup();
    loom_err err;
    /* missing file */
    loom_dataset_spec *s = spec_new();
    spec_feature(s, "image", tpath("nope.idx.gz"));
    CHECK(open_fail(s, &err) == LOOM_EIO);
    CHECK_CONTAINS(err.where, "nope.idx.gz");
    free(s);
    /* wrong magic */
    FILE *f = fopen(tpath("zip.idx"), "wb");
    fwrite("PK\x03\x04 not idx at all", 1, 20, f);
    fclose(f);
    s = spec_new();
    spec_feature(s, "image", tpath("zip.idx"));
    CHECK(open_fail(s, &err) == LOOM_EDATA);
    CHECK_CONTAINS(err.where, "zip.idx");
    CHECK_CONTAINS(err.msg, "50 4b 03 04");
    free(s);
    /* truncated, plain and gzip: checked on the decompressed content */
    uint8_t v[24] = {0};
    uint32_t d[2] = {6, 4};
    write_idx(tpath("trunc.idx"), 0, 0x08, 2, d, v, 5);
    write_idx(tpath("trunc.idx.gz"), 1, 0x08, 2, d, v, 5);
    for (int gz = 0; gz < 2; gz++) {
        s = spec_new();
        spec_feature(s, "x", tpath(gz ? "trunc.idx.gz" : "trunc.idx"));
        CHECK(open_fail(s, &err) == LOOM_EDATA);
        CHECK_CONTAINS(err.where, gz ? "trunc.idx.gz" : "trunc.idx");
        CHECK_CONTAINS(err.msg, "truncated");
        CHECK_CONTAINS(err.msg, "36 bytes"); /* 4 + 8 + 24 expected */
        CHECK_CONTAINS(err.msg, "found 31");
        free(s);
    }
    /* a gzip stream cut short */
    {
        FILE *in = fopen(tpath("img.idx.gz"), "rb");
        uint8_t buf[4096];
        size_t n = fread(buf, 1, sizeof buf, in);
        fclose(in);
        FILE *out = fopen(tpath("cut.idx.gz"), "wb");
        fwrite(buf, 1, n / 2, out);
        fclose(out);
        s = spec_new();
        spec_feature(s, "x", tpath("cut.idx.gz"));
        CHECK(open_fail(s, &err) != LOOM_OK);
        CHECK_CONTAINS(err.where, "cut.idx.gz");
        free(s);
    }
    /* different item counts */
    uint8_t l9[9] = {0};
    uint32_t d9[1] = {9};
    write_idx(tpath("lbl9.idx"), 0, 0x08, 1, d9, l9, 0);
    s = spec_new();
    spec_feature(s, "image", tpath("img.idx"));
    spec_feature(s, "label", tpath("lbl9.idx"));
    CHECK(open_fail(s, &err) == LOOM_EDATA);
    CHECK_CONTAINS(err.msg, "img.idx");
    CHECK_CONTAINS(err.msg, "lbl9.idx");
    CHECK_CONTAINS(err.msg, "10 items");
    CHECK_CONTAINS(err.msg, "has 9");
    free(s);
}

static void test_catalog_resolve(void)
{
    setup();
    char img[LOOM_PATH_MAX], lbl[LOOM_PATH_MAX];
    loom_err err = {0};
    const char *old = getenv("LOOM_DATASETS_DIR");
    char saved[512] = "";
    if (old) snprintf(saved, sizeof saved, "%s", old);
    setenv("LOOM_DATASETS_DIR", tpath("no-such-dir"), 1);
    CHECK(loom_catalog_resolve("fashion_mnist", "train", img, lbl, &err) == LOOM_EIO);
    CHECK_CONTAINS(err.hint, "apt-get install dataset-fashion-mnist");
    CHECK_CONTAINS(err.where, "fashion-mnist/train-images-idx3-ubyte");
    CHECK(loom_catalog_resolve("cifar", "train", img, lbl, &err) == LOOM_ECONFIG);
    CHECK_CONTAINS(err.msg, "fashion_mnist");
    CHECK(loom_catalog_resolve("fashion_mnist", "valid", img, lbl, &err) == LOOM_ECONFIG);
    /* a fake catalog tree: plain files are accepted too */
    char dir[600];
    snprintf(dir, sizeof dir, "%s/cat/fashion-mnist", tmpdir);
    mkdir(tpath("cat"), 0755);
    mkdir(dir, 0755);
    uint8_t im[3 * 784], lb[3] = {7, 1, 9};
    for (int i = 0; i < 3 * 784; i++) im[i] = (uint8_t)i;
    uint32_t di[3] = {3, 28, 28}, dl[1] = {3};
    write_idx(tpath("cat/fashion-mnist/t10k-images-idx3-ubyte.gz"), 1, 0x08, 3, di, im, 0);
    write_idx(tpath("cat/fashion-mnist/t10k-labels-idx1-ubyte"), 0, 0x08, 1, dl, lb, 0);
    setenv("LOOM_DATASETS_DIR", tpath("cat"), 1);
    CHECK(loom_catalog_resolve("fashion_mnist", "test", img, lbl, &err) == LOOM_OK);
    CHECK_CONTAINS(lbl, "t10k-labels-idx1-ubyte");
    loom_dataset_spec *s = spec_new();
    s->source.kind = LOOM_SRC_CATALOG;
    snprintf(s->source.catalog.name, sizeof s->source.catalog.name, "fashion_mnist");
    snprintf(s->source.catalog.split, sizeof s->source.catalog.split, "test");
    loom_iter *it = open_ok(s);
    if (it) {
        char buf[256];
        CHECK_CONTAINS(loom_elem_spec_str(loom_iter_spec(it), buf, sizeof buf), "image: uint8 (28, 28); label: uint8 ()");
        int64_t labels[8];
        CHECK(collect_labels(it, labels, 8) == 3);
        CHECK(labels[0] == 7 && labels[2] == 9);
        loom_iter_close(it);
    }
    snprintf(s->source.catalog.split, sizeof s->source.catalog.split, "train");
    CHECK(open_fail(s, &err) == LOOM_EIO);
    CHECK_CONTAINS(err.hint, "apt-get install dataset-fashion-mnist");
    free(s);
    if (old) setenv("LOOM_DATASETS_DIR", saved, 1);
    else unsetenv("LOOM_DATASETS_DIR");
}

static int skip_catalog(void)
{
    const char *e = getenv("LOOM_DATA_SKIP_CATALOG");
    if (e && *e == '1') {
        printf("# skipped: LOOM_DATA_SKIP_CATALOG\n");
        return 1;
    }
    return 0;
}

static void test_catalog_fashion_mnist(void)
{
    if (skip_catalog()) return;
    loom_dataset_spec *s = spec_new();
    s->source.kind = LOOM_SRC_CATALOG;
    snprintf(s->source.catalog.name, sizeof s->source.catalog.name, "fashion_mnist");
    snprintf(s->source.catalog.split, sizeof s->source.catalog.split, "train");
    loom_iter *it = open_ok(s);
    if (!it) {
        free(s);
        return;
    }
    CHECK(loom_iter_cardinality(it) == 60000);
    loom_elem *e;
    loom_err err;
    CHECK(loom_iter_next(it, &e, &err) == LOOM_OK);
    const uint8_t *px = e->t[0].data;
    CHECK(*(uint8_t *)e->t[1].data == 9); /* the first training item is an ankle boot */
    int64_t row[28] = {0}, total = 0;
    for (int r = 0; r < 28; r++)
        for (int c = 0; c < 28; c++) row[r] += px[r * 28 + c];
    for (int r = 0; r < 28; r++) total += row[r];
    CHECK(row[0] == 0 && row[1] == 0 && row[2] == 0 && row[3] == 94);
    CHECK(total == 76247);
    int n = 1, bad = 0;
    int counts[10] = {0};
    counts[9]++;
    while (loom_iter_next(it, &e, &err) == LOOM_OK) {
        uint8_t l = *(uint8_t *)e->t[1].data;
        if (l > 9) bad++;
        else counts[l]++;
        n++;
    }
    CHECK(n == 60000);
    CHECK(bad == 0);
    for (int c = 0; c < 10; c++) CHECK(counts[c] == 6000);
    loom_iter_close(it);
    snprintf(s->source.catalog.split, sizeof s->source.catalog.split, "test");
    it = open_ok(s);
    if (it) {
        CHECK(loom_iter_cardinality(it) == 10000);
        CHECK(loom_iter_next(it, &e, &err) == LOOM_OK && *(uint8_t *)e->t[1].data == 9);
        loom_iter_close(it);
    }
    free(s);
}

/* ---- shuffle -------------------------------------------------------------------- */

/* tf.data's ShuffleDataset with the same RNG draws: fill to `buffer`, pick j
 * uniformly among the buffered, emit it, move the oldest into the hole. */
static int ref_shuffle(int n, int64_t buffer, uint64_t seed, int stage, int64_t epoch, int64_t *out)
{
    int64_t *ring = malloc(sizeof(int64_t) * (size_t)(buffer < n ? buffer : n) + 8);
    int64_t cap = buffer < n ? buffer : n, start = 0, end = 0, next = 0;
    if (cap < 1) cap = 1;
    loom_rng r;
    loom_rng_init(&r, seed, (uint64_t)stage, (uint64_t)epoch, 0);
    int k = 0;
    for (;;) {
        while (next < n && end - start < buffer) ring[end++ % cap] = next++;
        if (end == start) break;
        int64_t j = (start + (int64_t)loom_rng_below(&r, (uint64_t)(end - start))) % cap;
        out[k++] = ring[j];
        ring[j] = ring[start % cap];
        start++;
    }
    free(ring);
    return k;
}

static loom_dataset_spec *spec_big(void)
{
    loom_dataset_spec *s = spec_new();
    spec_feature(s, "label", tpath("big.idx"));
    return s;
}

static void test_shuffle_reference(void)
{
    setup();
    static int64_t got[1000], want[1000];
    int64_t buffers[] = {1, 2, 3, 7, 100, 999, 1000, 5000};
    for (size_t b = 0; b < sizeof buffers / sizeof buffers[0]; b++) {
        loom_dataset_spec *s = spec_big();
        add_shuffle(s, buffers[b], 7, true);
        loom_iter *it = open_ok(s);
        if (!it) {
            free(s);
            continue;
        }
        for (int epoch = 0; epoch < 2; epoch++) {
            int n = collect_labels(it, got, 1000);
            int m = ref_shuffle(1000, buffers[b], 7, 1, epoch, want);
            CHECK(n == 1000 && m == 1000);
            CHECK_MSG(!memcmp(got, want, sizeof got), "buffer %lld epoch %d differs from the reference", (long long)buffers[b], epoch);
            /* a permutation */
            static char seen[1000];
            memset(seen, 0, sizeof seen);
            int dup = 0;
            for (int i = 0; i < n; i++) dup += got[i] < 0 || got[i] >= 1000 || seen[got[i]]++;
            CHECK(dup == 0);
            if (buffers[b] == 1)
                for (int i = 0; i < n; i++) CHECK(got[i] == i);
            loom_err err;
            loom_iter_rewind(it, epoch + 1, &err);
        }
        loom_iter_close(it);
        free(s);
    }
}

static void test_shuffle_epochs_and_seeds(void)
{
    setup();
    static int64_t a[1000], b[1000], c[1000];
    loom_err err;
    for (int reshuffle = 0; reshuffle < 2; reshuffle++) {
        loom_dataset_spec *s = spec_big();
        add_shuffle(s, 100, 1234, reshuffle);
        loom_iter *it = open_ok(s);
        loom_iter *it2 = open_ok(s);
        if (!it || !it2) {
            loom_iter_close(it);
            loom_iter_close(it2);
            free(s);
            continue;
        }
        collect_labels(it, a, 1000);
        collect_labels(it2, c, 1000);
        CHECK(!memcmp(a, c, sizeof a)); /* deterministic */
        loom_iter_rewind(it, 1, &err);
        collect_labels(it, b, 1000);
        if (reshuffle) CHECK(memcmp(a, b, sizeof a) != 0);
        else CHECK(!memcmp(a, b, sizeof a));
        loom_iter_close(it);
        loom_iter_close(it2);
        s->transform[0].seed = 1235;
        it = open_ok(s);
        if (it) {
            collect_labels(it, b, 1000);
            CHECK(memcmp(a, b, sizeof a) != 0); /* the seed matters */
            loom_iter_close(it);
        }
        free(s);
    }
    /* buffer 2 over 0..9: the first element is 0 or 1, each with p = 0.5 */
    loom_dataset_spec *s = spec_small(0);
    add_shuffle(s, 2, 0, true);
    int zeros = 0, other = 0, trials = 2000;
    loom_iter *it = open_ok(s);
    for (int t = 0; it && t < trials; t++) {
        loom_elem *e;
        loom_iter_rewind(it, t, &err);
        CHECK(loom_iter_next(it, &e, &err) == LOOM_OK);
        int l = *(uint8_t *)e->t[1].data;
        zeros += l == 0;
        other += l != 0 && l != 1;
    }
    loom_iter_close(it);
    CHECK(other == 0);
    CHECK_MSG(abs(zeros - trials / 2) < 4 * 23, "element 0 first in %d of %d passes", zeros, trials); /* 4 sigma */
    free(s);
}

/* ---- shuffle by index ------------------------------------------------------------
 * The shuffle over a source with random access (get) buffers positions; over
 * the same source with get hidden it buffers copies of elements. Both must
 * yield the same elements in the same order, whatever the buffer, seed,
 * reshuffle, epoch, a repeat after it (or fused with it), and a resume. */

/* The source's ops without get: the same source, read only through next()
 * (one kind of source at a time has them hidden). */
static dstage_ops no_get_ops;
static void hide_get(dstage *src)
{
    no_get_ops = *src->ops;
    no_get_ops.get = NULL;
    src->ops = &no_get_ops;
}

/* Opens src (the synthetic or catalog source) and a shuffle of buffer over it
 * as transform 0 (by index unless hidden), then a repeat of rep when rep != 1
 * (fused: the shuffle+repeat stage). Returns the last stage; *first the source. */
static dstage *shuf_chain(const loom_source_spec *src, int64_t buffer, uint64_t seed, bool reshuffle, bool hidden,
                          int64_t rep, bool fused, dstage **first)
{
    static const loom_data_ctx ctx = {.seed = 42, .threads = 1, .name = "data"};
    loom_err err = {0};
    dstage *in = NULL, *sh = NULL, *out = NULL;
    int rc = src->kind == LOOM_SRC_SYNTHETIC ? synthetic_source_open_(&in, src, &ctx, &err)
                                             : source_open_(&in, src, &err);
    CHECK_MSG(rc == LOOM_OK, "source: %s", err.msg);
    if (rc) return NULL;
    if (hidden) hide_get(in);
    loom_transform_spec t[2] = {
        {.kind = LOOM_T_SHUFFLE, .buffer = buffer, .seed = seed, .seed_set = true, .reshuffle = reshuffle},
        {.kind = LOOM_T_REPEAT, .count = rep},
    };
    rc = fused && rep != 1 ? shufrep_open_(&sh, in, 1, t, &ctx, &err) : shuffle_open_(&sh, in, 1, t, &ctx, &err);
    CHECK_MSG(rc == LOOM_OK, "shuffle: %s", err.msg);
    if (rc) {
        in->ops->close(in);
        return NULL;
    }
    out = sh;
    if (rep != 1 && !fused) {
        rc = repeat_open_(&out, sh, 2, &t[1], &err);
        CHECK_MSG(rc == LOOM_OK, "repeat: %s", err.msg);
        if (rc) out = sh;
    }
    *first = in;
    return out;
}

static void chain_close(dstage *last)
{
    while (last) {
        dstage *in = last->in;
        last->ops->close(last);
        last = in;
    }
}

static bool same_elem(const loom_elem *a, const loom_elem *b)
{
    if (a->n != b->n) return false;
    for (int f = 0; f < a->n; f++) {
        const loom_tensor *x = &a->t[f], *y = &b->t[f];
        if (x->dtype != y->dtype || !loom_shape_eq(&x->shape, &y->shape) ||
            memcmp(x->data, y->data, (size_t)loom_shape_numel(&x->shape) * loom_dtype_size(x->dtype)))
            return false;
    }
    return true;
}

/* Pulls both until both end (at most max); the index of the first difference, or -1. */
static int64_t first_diff(dstage *a, dstage *b, int64_t max, int64_t *count)
{
    loom_err err = {0};
    int64_t i = 0;
    for (; i < max; i++) {
        loom_elem *x, *y;
        int ra = dstage_next_(a, &x, &err), rb = dstage_next_(b, &y, &err);
        if (ra != rb) return i;
        if (ra == LOOM_EEOF) break;
        if (ra || !same_elem(x, y)) return i;
    }
    *count = i;
    return -1;
}

static loom_source_spec syn_spec(int64_t count)
{
    loom_source_spec src = {.kind = LOOM_SRC_SYNTHETIC, .n_features = 2, .synthetic.count = count};
    snprintf(src.feature[0], LOOM_NAME_MAX, "x");
    snprintf(src.feature[1], LOOM_NAME_MAX, "y");
    src.synthetic.features[0] =
        (loom_syn_feature){.dtype = LOOM_CFG_U8, .rank = 2, .shape = {3, 2}, .min = 0, .max = 256};
    src.synthetic.features[1] = (loom_syn_feature){.dtype = LOOM_CFG_I64, .rank = 0, .min = 0, .max = 1000000};
    return src;
}

static void test_shuffle_by_index(void)
{
    loom_err err = {0};
    loom_source_spec syn = syn_spec(100);
    int64_t buffers[] = {1, 2, 7, 99, 100, 101, 1000};
    int cases = 0;
    for (size_t b = 0; b < sizeof buffers / sizeof buffers[0]; b++)
        for (uint64_t seed = 1; seed <= 2; seed++)
            for (int re = 0; re < 2; re++)
                /* rep 0: shuffle alone; 1: then repeat(3); 2: fused shuffle+repeat(3) */
                for (int rep = 0; rep < 3; rep++) {
                    dstage *sa, *sb;
                    dstage *a = shuf_chain(&syn, buffers[b], seed, re, false, rep ? 3 : 1, rep == 2, &sa);
                    dstage *e = shuf_chain(&syn, buffers[b], seed, re, true, rep ? 3 : 1, rep == 2, &sb);
                    if (!a || !e) {
                        chain_close(a);
                        chain_close(e);
                        continue;
                    }
                    /* the index shuffle is the shuffle stage itself, or under the repeat */
                    const dstage *ash = rep == 1 ? a->in : a;
                    if (rep < 2) {
                        CHECK(!strcmp(ash->name, "shuffle(indices)") && !strcmp((rep ? e->in : e)->name, "shuffle"));
                        CHECK(dstage_load_(&ash->st_bytes) == 8 * (buffers[b] < 100 ? buffers[b] : 100));
                    } else {
                        CHECK(!strcmp(a->name, "shuffle(indices)+repeat") && !strcmp(e->name, "shuffle+repeat"));
                    }
                    for (int64_t epoch = 0; epoch < 3; epoch++) {
                        CHECK(a->ops->rewind(a, epoch, &err) == LOOM_OK && e->ops->rewind(e, epoch, &err) == LOOM_OK);
                        int64_t n = 0, d = first_diff(a, e, 1000, &n);
                        CHECK_MSG(d < 0 && n == (rep ? 300 : 100),
                                  "buffer %lld seed %llu reshuffle %d repeat %d epoch %lld: element %lld of %lld",
                                  (long long)buffers[b], (unsigned long long)seed, re, rep, (long long)epoch,
                                  (long long)d, (long long)n);
                        cases++;
                    }
                    chain_close(a);
                    chain_close(e);
                }
    printf("# synthetic(100): %d passes equal by index and by element\n", cases);

    /* resume mid-pass in index mode: the rest equals the uninterrupted run (and element mode); also
     * the fused shuffle+repeat(3) (300 elements), its slices of passes 0 and 1 both live at 95 */
    int64_t at[] = {0, 1, 37, 99, 100, 0, 95, 150, 299};
    for (size_t k = 0; k < sizeof at / sizeof at[0]; k++) {
        dstage *sa, *sb, *sc;
        bool fused = k >= 5;
        int64_t rep = fused ? 3 : 1, len = 100 * rep;
        dstage *a = shuf_chain(&syn, 40, 9, true, false, rep, fused, &sa);
        dstage *e = shuf_chain(&syn, 40, 9, true, true, rep, fused, &sb);
        dstage *r = shuf_chain(&syn, 40, 9, true, false, rep, fused, &sc);
        if (a && e && r) {
            loom_elem *x;
            a->ops->rewind(a, 1, &err);
            e->ops->rewind(e, 1, &err);
            for (int64_t i = 0; i < at[k]; i++) {
                dstage_next_(a, &x, &err);
                dstage_next_(e, &x, &err);
            }
            loom_buf buf;
            loom_buf_init(&buf);
            sa->ops->save(sa, &buf);
            a->ops->save(a, &buf);
            loom_buf rb;
            loom_buf_wrap(&rb, buf.data, buf.len);
            CHECK(sc->ops->restore(sc, &rb, &err) == LOOM_OK && r->ops->restore(r, &rb, &err) == LOOM_OK);
            int64_t n = 0, d = first_diff(r, e, 1000, &n);
            CHECK_MSG(d < 0 && n == len - at[k], "resumed at %lld (fused %d): element %lld differs", (long long)at[k],
                      fused, (long long)d);
            /* the next pass too (the source's state stayed valid) */
            r->ops->rewind(r, 2, &err);
            e->ops->rewind(e, 2, &err);
            d = first_diff(r, e, 1000, &n);
            CHECK(d < 0 && n == len);
            /* a corrupt position is refused */
            loom_buf_wrap(&rb, buf.data, buf.len);
            sc->ops->restore(sc, &rb, &err);
            size_t off = rb.pos;
            memset(buf.data + buf.len - 8, 0x7f, 8); /* the last buffered position (or the count, none left) */
            loom_buf_wrap(&rb, buf.data + off, buf.len - off);
            CHECK(r->ops->restore(r, &rb, &err) == LOOM_ECHECKPOINT);
            CHECK_CONTAINS(err.msg, "iterator state is corrupt (shuffle");
            loom_buf_fini(&buf);
        }
        chain_close(a);
        chain_close(e);
        chain_close(r);
    }

    /* take and skip before the shuffle pass random access through: positions 5..72 */
    int64_t tbuf[] = {1, 10, 68, 100};
    for (size_t b = 0; b < sizeof tbuf / sizeof tbuf[0]; b++) {
        static const loom_data_ctx ctx = {.seed = 42, .threads = 1, .name = "data"};
        loom_transform_spec tt = {.kind = LOOM_T_TAKE, .count = 73}, ts = {.kind = LOOM_T_SKIP, .count = 5};
        loom_transform_spec sh = {.kind = LOOM_T_SHUFFLE, .buffer = tbuf[b], .seed = 3, .seed_set = true,
                                  .reshuffle = true};
        dstage *c[2][4] = {{0}};
        for (int m = 0; m < 2; m++) {
            int ok = synthetic_source_open_(&c[m][0], &syn, &ctx, &err) == LOOM_OK;
            if (ok && m) hide_get(c[m][0]);
            ok = ok && take_open_(&c[m][1], c[m][0], 1, &tt, &err) == LOOM_OK;
            ok = ok && skip_open_(&c[m][2], c[m][1], 2, &ts, &err) == LOOM_OK;
            ok = ok && shuffle_open_(&c[m][3], c[m][2], 3, &sh, &ctx, &err) == LOOM_OK;
            CHECK_MSG(ok, "open: %s", err.msg);
        }
        if (c[0][3] && c[1][3]) {
            CHECK(!strcmp(c[0][3]->name, "shuffle(indices)") && !strcmp(c[1][3]->name, "shuffle"));
            for (int64_t epoch = 0; epoch < 2; epoch++) {
                c[0][3]->ops->rewind(c[0][3], epoch, &err);
                c[1][3]->ops->rewind(c[1][3], epoch, &err);
                int64_t n = 0, d = first_diff(c[0][3], c[1][3], 1000, &n);
                CHECK_MSG(d < 0 && n == 68, "take+skip, buffer %lld epoch %lld: element %lld differs (%lld)",
                          (long long)tbuf[b], (long long)epoch, (long long)d, (long long)n);
            }
        }
        for (int m = 0; m < 2; m++)
            for (int k = 3; k >= 0; k--)
                if (c[m][k]) {
                    chain_close(c[m][k]);
                    break;
                }
    }

    /* a source with get but an infinite pass buffers elements */
    loom_source_spec inf = syn_spec(-1);
    dstage *si, *i = shuf_chain(&inf, 10, 1, true, false, 1, false, &si);
    if (i) CHECK(!strcmp(i->name, "shuffle"));
    chain_close(i);

    /* real Fashion-MNIST: buffers below, at and above 60000, two epochs */
    if (skip_catalog()) return;
    loom_source_spec cat = {.kind = LOOM_SRC_CATALOG};
    snprintf(cat.catalog.name, sizeof cat.catalog.name, "fashion_mnist");
    snprintf(cat.catalog.split, sizeof cat.catalog.split, "train");
    int64_t cbuf[] = {1000, 60000, 100000};
    for (size_t b = 0; b < sizeof cbuf / sizeof cbuf[0]; b++) {
        dstage *sa, *sb;
        dstage *a = shuf_chain(&cat, cbuf[b], 42, true, false, 1, false, &sa);
        dstage *e = shuf_chain(&cat, cbuf[b], 42, true, true, 1, false, &sb);
        if (a && e) {
            CHECK(!strcmp(a->name, "shuffle(indices)"));
            CHECK(dstage_load_(&a->st_bytes) == 8 * (cbuf[b] < 60000 ? cbuf[b] : 60000));
            for (int64_t epoch = 0; epoch < 2; epoch++) {
                a->ops->rewind(a, epoch, &err);
                e->ops->rewind(e, epoch, &err);
                int64_t n = 0, d = first_diff(a, e, 70000, &n);
                CHECK_MSG(d < 0 && n == 60000, "fashion_mnist buffer %lld epoch %lld: element %lld differs",
                          (long long)cbuf[b], (long long)epoch, (long long)d);
            }
            printf("# fashion_mnist shuffle(%lld): 2 epochs equal by index (%lld bytes) and by element (%lld bytes)\n",
                   (long long)cbuf[b], (long long)dstage_load_(&a->st_bytes), (long long)dstage_load_(&e->st_bytes));
        }
        chain_close(a);
        chain_close(e);
    }
}

/* The plan names the index shuffle; a state saved by an element shuffle (an
 * older build) is refused saying why and what to do. */
static void test_shuffle_by_index_state(void)
{
    if (skip_catalog()) return;
    loom_dataset_spec *s = spec_new();
    s->source.kind = LOOM_SRC_CATALOG;
    snprintf(s->source.catalog.name, sizeof s->source.catalog.name, "fashion_mnist");
    snprintf(s->source.catalog.split, sizeof s->source.catalog.split, "train");
    add_shuffle(s, 60000, 42, true);
    add_batch(s, 128, false);
    loom_iter *it = open_ok(s);
    if (!it) {
        free(s);
        return;
    }
    loom_stage_stats st[4];
    CHECK(loom_iter_stats(it, st, 4) == 3);
    CHECK(!strcmp(st[1].name, "shuffle(indices)") && st[1].capacity == 60000 && st[1].bytes == 480000);
    loom_err err = {0};
    loom_elem *e;
    CHECK(loom_iter_next(it, &e, &err) == LOOM_OK);
    CHECK(loom_iter_stats(it, st, 4) == 3 && st[1].buffered == 60000 - 128 && st[0].elements == 128);
    loom_buf b;
    loom_buf_init(&b);
    CHECK(loom_iter_save(it, &b, &err) == LOOM_OK);
    /* the same state's header with the fingerprint an element shuffle wrote */
    loom_buf rb;
    loom_buf_wrap(&rb, b.data, b.len);
    uint32_t magic = loom_buf_get_u32(&rb), version = loom_buf_get_u32(&rb);
    char fp[4096], old[4096];
    loom_buf_get_str(&rb, fp, sizeof fp);
    const char *p = strstr(fp, "shuffle(indices,");
    CHECK(p != NULL);
    if (p) {
        snprintf(old, sizeof old, "%.*sshuffle(%s", (int)(p - fp), fp, p + strlen("shuffle(indices,"));
        loom_buf ob;
        loom_buf_init(&ob);
        loom_buf_put_u32(&ob, magic);
        loom_buf_put_u32(&ob, version);
        loom_buf_put_str(&ob, old);
        loom_buf_put_i64(&ob, 0);
        loom_buf wb;
        loom_buf_wrap(&wb, ob.data, ob.len);
        CHECK(loom_iter_restore(it, &wb, &err) == LOOM_ECHECKPOINT);
        CHECK_CONTAINS(err.msg, "iterator state was saved by a shuffle that buffered elements");
        CHECK_CONTAINS(err.msg, "shuffle(60000,42,1)");
        CHECK_CONTAINS(err.hint, "--fresh");
        loom_buf_fini(&ob);
    }
    /* the index state itself restores, and the iterator goes on as before */
    loom_iter *r = open_ok(s);
    if (r) {
        loom_buf_wrap(&rb, b.data, b.len);
        CHECK(loom_iter_restore(r, &rb, &err) == LOOM_OK);
        loom_elem *x;
        int same = 1;
        for (int i = 0; i < 20; i++) {
            CHECK(loom_iter_next(it, &e, &err) == LOOM_OK && loom_iter_next(r, &x, &err) == LOOM_OK);
            same &= same_elem(e, x);
        }
        CHECK(same);
        loom_iter_close(r);
    }
    loom_buf_fini(&b);
    loom_iter_close(it);
    free(s);
}

/* ---- batch, repeat, take, skip ------------------------------------------------ */

static void test_batch(void)
{
    setup();
    for (int drop = 0; drop < 2; drop++) {
        loom_dataset_spec *s = spec_small(0);
        add_batch(s, 4, drop);
        loom_iter *it = open_ok(s);
        if (!it) {
            free(s);
            continue;
        }
        const loom_elem_spec *sp = loom_iter_spec(it);
        CHECK(sp->shape[0].rank == 3 && sp->shape[0].dim[0] == (drop ? 4 : -1) && sp->shape[0].dim[1] == 4);
        CHECK(sp->shape[1].rank == 1);
        CHECK(loom_iter_cardinality(it) == (drop ? 2 : 3));
        loom_elem *e;
        loom_err err;
        int nb = 0, item = 0, bad = 0;
        while (loom_iter_next(it, &e, &err) == LOOM_OK) {
            int64_t b = e->t[0].shape.dim[0];
            bad += b != (nb < 2 ? 4 : 2);
            bad += e->t[1].shape.dim[0] != b;
            for (int64_t i = 0; i < b; i++, item++) {
                bad += ((uint8_t *)e->t[1].data)[i] != item;
                for (int k = 0; k < 12; k++) bad += ((uint8_t *)e->t[0].data)[i * 12 + k] != item * 16 + k;
            }
            nb++;
        }
        CHECK(nb == (drop ? 2 : 3));
        CHECK(bad == 0);
        loom_iter_close(it);
        free(s);
    }
    /* batch 5 divides 10: the leading dim is static */
    loom_dataset_spec *s = spec_small(0);
    add_batch(s, 5, false);
    add_batch(s, 2, false); /* batch of batches */
    loom_iter *it = open_ok(s);
    if (it) {
        CHECK(loom_iter_spec(it)->shape[0].rank == 4);
        CHECK(loom_iter_spec(it)->shape[0].dim[0] == 2 && loom_iter_spec(it)->shape[0].dim[1] == 5);
        CHECK(loom_iter_cardinality(it) == 1);
        int64_t l[16];
        CHECK(collect_labels(it, l, 16) == 10);
        loom_iter_close(it);
    }
    free(s);
}

static void test_repeat_take_skip(void)
{
    setup();
    int64_t l[64];
    /* expected label i: first + i % period (period 0: (first + i) % 10) */
    struct { int ops[3][2]; int64_t card; int n; int first; int period; } cases[] = {
        {{{LOOM_T_REPEAT, 3}, {-1, 0}, {-1, 0}}, 30, 30, 0, 0},
        {{{LOOM_T_REPEAT, 0}, {-1, 0}, {-1, 0}}, 0, 0, 0, 0},
        {{{LOOM_T_REPEAT, -1}, {LOOM_T_TAKE, 25}, {-1, 0}}, 25, 25, 0, 0},
        {{{LOOM_T_TAKE, 4}, {-1, 0}, {-1, 0}}, 4, 4, 0, 0},
        {{{LOOM_T_TAKE, -1}, {-1, 0}, {-1, 0}}, 10, 10, 0, 0},
        {{{LOOM_T_TAKE, 20}, {-1, 0}, {-1, 0}}, 10, 10, 0, 0},
        {{{LOOM_T_TAKE, 0}, {-1, 0}, {-1, 0}}, 0, 0, 0, 0},
        {{{LOOM_T_SKIP, 3}, {-1, 0}, {-1, 0}}, 7, 7, 3, 0},
        {{{LOOM_T_SKIP, -1}, {-1, 0}, {-1, 0}}, 0, 0, 0, 0},
        {{{LOOM_T_SKIP, 20}, {-1, 0}, {-1, 0}}, 0, 0, 0, 0},
        {{{LOOM_T_SKIP, 8}, {LOOM_T_REPEAT, 2}, {-1, 0}}, 4, 4, 8, 2},
        {{{LOOM_T_SKIP, -1}, {LOOM_T_REPEAT, -1}, {-1, 0}}, 0, 0, 0, 0}, /* an empty infinite repeat ends */
        {{{LOOM_T_REPEAT, 2}, {LOOM_T_SKIP, 5}, {LOOM_T_TAKE, 12}}, 12, 12, 5, 0},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        loom_dataset_spec *s = spec_small(0);
        for (int k = 0; k < 3; k++)
            if (cases[c].ops[k][0] >= 0) spec_count(s, (loom_transform_kind)cases[c].ops[k][0], cases[c].ops[k][1]);
        loom_iter *it = open_ok(s);
        if (it) {
            CHECK_MSG(loom_iter_cardinality(it) == cases[c].card, "case %zu: cardinality %lld", c,
                      (long long)loom_iter_cardinality(it));
            int n = collect_labels(it, l, 64);
            CHECK_MSG(n == cases[c].n, "case %zu: %d elements", c, n);
            int bad = 0;
            for (int i = 0; i < n; i++)
                bad += l[i] != (cases[c].period ? cases[c].first + i % cases[c].period : (cases[c].first + i) % 10);
            CHECK_MSG(bad == 0, "case %zu: wrong order", c);
            loom_iter_close(it);
        }
        free(s);
    }
    /* repeat(-1) alone is infinite; skip(-1) after it is refused */
    loom_dataset_spec *s = spec_small(0);
    spec_count(s, LOOM_T_REPEAT, -1);
    loom_iter *it = open_ok(s);
    if (it) {
        CHECK(loom_iter_cardinality(it) == -1);
        loom_elem *e;
        loom_err err;
        int ok = 0;
        for (int i = 0; i < 1000; i++) ok += loom_iter_next(it, &e, &err) == LOOM_OK;
        CHECK(ok == 1000);
        loom_iter_close(it);
    }
    spec_count(s, LOOM_T_SKIP, -1);
    loom_err err;
    CHECK(open_fail(s, &err) == LOOM_ECONFIG);
    CHECK_CONTAINS(err.where, "test.cfg:21");
    free(s);
    /* shuffle then repeat: every pass is a permutation, and passes differ */
    s = spec_big();
    add_shuffle(s, 50, 9, true);
    spec_count(s, LOOM_T_REPEAT, 2);
    it = open_ok(s);
    if (it) {
        static int64_t two[2000];
        CHECK(collect_labels(it, two, 2000) == 2000);
        long sa = 0, sb = 0;
        for (int i = 0; i < 1000; i++) {
            sa += two[i];
            sb += two[1000 + i];
        }
        CHECK(sa == 499500 && sb == 499500);
        CHECK(memcmp(two, two + 1000, 1000 * sizeof two[0]) != 0);
        loom_iter_close(it);
    }
    free(s);
}

/* ---- prefetch ------------------------------------------------------------------- */

/* shuffle + flip + batch (+ prefetch), the shape of a training pipeline */
static loom_dataset_spec *spec_train(int64_t prefetch, int64_t batch)
{
    loom_dataset_spec *s = spec_small(1);
    add_map(s, LOOM_MAP_CAST, "image")->dtype = LOOM_CFG_F32;
    add_shuffle(s, 4, 3, true);
    add_map(s, LOOM_MAP_FLIP_LR, "image");
    add_batch(s, batch, false);
    if (prefetch != -2) spec_prefetch(s, prefetch);
    return s;
}

static void test_prefetch_same_sequence(void)
{
    setup();
    loom_dataset_spec *s0 = spec_train(-2, 3);
    loom_iter *it0 = open_ok(s0);
    blob ref = {0};
    loom_err err;
    for (int ep = 0; it0 && ep < 3; ep++) {
        run_into(it0, &ref, -1);
        loom_iter_rewind(it0, ep + 1, &err);
    }
    loom_iter_close(it0);
    CHECK(ref.count == 12);
    int64_t bufs[] = {1, 2, -1, 0, 8};
    for (size_t b = 0; b < sizeof bufs / sizeof bufs[0]; b++) {
        loom_dataset_spec *s = spec_train(bufs[b], 3);
        spec_prefetch(s, 2); /* two in a row */
        loom_iter *it = open_ok(s);
        blob got = {0};
        for (int ep = 0; it && ep < 3; ep++) {
            CHECK(run_into(it, &got, -1) == LOOM_EEOF);
            loom_iter_rewind(it, ep + 1, &err);
        }
        CHECK_MSG(got.n == ref.n && !memcmp(got.p, ref.p, ref.n), "prefetch %lld changes the sequence", (long long)bufs[b]);
        /* rewinding mid-epoch restarts cleanly */
        blob again = {0};
        if (it) {
            run_into(it, &again, 2);
            loom_iter_rewind(it, 0, &err);
            blob fresh = {0};
            run_into(it, &fresh, -1);
            CHECK(fresh.count == 4 && !memcmp(fresh.p, ref.p, fresh.n));
            free(fresh.p);
        }
        free(again.p);
        free(got.p);
        loom_iter_close(it);
        free(s);
    }
    free(ref.p);
    free(s0);
    /* close mid-epoch, with the producer blocked on a full queue */
    loom_dataset_spec *s = spec_big();
    spec_count(s, LOOM_T_REPEAT, -1);
    spec_prefetch(s, 2);
    for (int k = 0; k < 20; k++) {
        loom_iter *it = open_ok(s);
        loom_elem *e;
        if (it && k % 2) loom_iter_next(it, &e, &err);
        loom_iter_close(it);
    }
    free(s);
    /* upstream errors arrive in order */
    s = spec_small(0);
    add_map(s, LOOM_MAP_ONE_HOT, "label")->depth = 6;
    spec_prefetch(s, 3);
    loom_iter *it = open_ok(s);
    if (it) {
        loom_elem *e;
        int n = 0, rc;
        memset(&err, 0, sizeof err);
        while ((rc = loom_iter_next(it, &e, &err)) == LOOM_OK) n++;
        CHECK(n == 6);
        CHECK(rc == LOOM_EDATA);
        CHECK_CONTAINS(err.msg, "element 6");
        CHECK(loom_iter_next(it, &e, &err) == LOOM_EDATA); /* sticky until rewind */
        CHECK(loom_iter_rewind(it, 1, &err) == LOOM_OK);
        CHECK(loom_iter_next(it, &e, &err) == LOOM_OK);
        loom_iter_close(it);
    }
    free(s);
}

/* ---- save / restore ------------------------------------------------------------- */

static void test_save_restore(void)
{
    setup();
    loom_err err;
    int64_t prefetches[] = {-2, 2, -1};
    for (size_t p = 0; p < sizeof prefetches / sizeof prefetches[0]; p++) {
        loom_dataset_spec *s = spec_train(prefetches[p], 2);
        /* the uninterrupted run: 2 epochs of 5 batches */
        loom_iter *it = open_ok(s);
        if (!it) {
            free(s);
            continue;
        }
        blob ref = {0};
        run_into(it, &ref, -1);
        loom_iter_rewind(it, 1, &err);
        run_into(it, &ref, -1);
        loom_iter_close(it);
        CHECK(ref.count == 10);
        size_t *off = calloc((size_t)ref.count + 1, sizeof *off);
        {
            /* element boundaries in ref: every element has the same header layout */
            loom_iter *t = open_ok(s);
            blob one = {0};
            size_t at = 0;
            for (int i = 0; t && i < ref.count; i++) {
                one.n = 0;
                if (run_into(t, &one, 1) == LOOM_EEOF) {
                    loom_iter_rewind(t, 1, &err);
                    run_into(t, &one, 1);
                }
                off[i] = at;
                at += one.n;
            }
            off[ref.count] = at;
            free(one.p);
            loom_iter_close(t);
        }
        int cuts[] = {0, 1, 2, 4, 5, 6, 9, 10};
        for (size_t c = 0; c < sizeof cuts / sizeof cuts[0]; c++) {
            int k = cuts[c];
            loom_iter *a = open_ok(s);
            if (!a) continue;
            blob head = {0};
            int epoch = 0;
            for (int i = 0; i < k; i++) {
                if (run_into(a, &head, 1) == LOOM_EEOF) {
                    loom_iter_rewind(a, ++epoch, &err);
                    run_into(a, &head, 1);
                }
            }
            loom_buf b;
            loom_buf_init(&b);
            CHECK(loom_iter_save(a, &b, &err) == LOOM_OK);
            /* the saved iterator goes on unchanged */
            blob rest_a = {0};
            int ep_a = epoch;
            while (ep_a < 2) {
                if (run_into(a, &rest_a, -1) == LOOM_EEOF && ++ep_a < 2) loom_iter_rewind(a, ep_a, &err);
            }
            loom_iter_close(a);
            /* a fresh pipeline restored from the state */
            loom_iter *r = open_ok(s);
            blob rest_r = {0};
            if (r) {
                loom_buf rb;
                loom_buf_wrap(&rb, b.data, b.len);
                int rc = loom_iter_restore(r, &rb, &err);
                CHECK_MSG(rc == LOOM_OK, "restore: %s", err.msg);
                int ep_r = epoch;
                while (ep_r < 2) {
                    if (run_into(r, &rest_r, -1) == LOOM_EEOF && ++ep_r < 2) loom_iter_rewind(r, ep_r, &err);
                }
                loom_iter_close(r);
            }
            size_t tail = ref.n - off[k];
            CHECK_MSG(rest_a.n == tail && (!tail || !memcmp(rest_a.p, ref.p + off[k], tail)), "prefetch %lld cut %d: saving disturbed the run",
                      (long long)prefetches[p], k);
            CHECK_MSG(rest_r.n == tail && (!tail || !memcmp(rest_r.p, ref.p + off[k], tail)),
                      "prefetch %lld cut %d: restored run differs (%zu vs %zu bytes)", (long long)prefetches[p], k, rest_r.n, tail);
            free(head.p);
            free(rest_a.p);
            free(rest_r.p);
            loom_buf_fini(&b);
        }
        free(off);
        free(ref.p);
        free(s);
    }
}

static void test_restore_refused(void)
{
    setup();
    loom_err err;
    loom_dataset_spec *s = spec_train(2, 2);
    loom_iter *a = open_ok(s);
    loom_buf b;
    loom_buf_init(&b);
    loom_elem *e;
    if (a) {
        loom_iter_next(a, &e, &err);
        CHECK(loom_iter_save(a, &b, &err) == LOOM_OK);
        loom_iter_close(a);
    }
    s->transform[3].batch_size = 3;
    loom_iter *r = open_ok(s);
    if (r) {
        loom_buf rb;
        loom_buf_wrap(&rb, b.data, b.len);
        CHECK(loom_iter_restore(r, &rb, &err) == LOOM_ECHECKPOINT);
        CHECK_CONTAINS(err.msg, "iterator state was saved by a different pipeline");
        CHECK_CONTAINS(err.msg, "batch(2,0)");
        /* still usable */
        CHECK(loom_iter_next(r, &e, &err) == LOOM_OK);
        /* garbage */
        uint8_t junk[16] = {1, 2, 3};
        loom_buf_wrap(&rb, junk, sizeof junk);
        CHECK(loom_iter_restore(r, &rb, &err) == LOOM_ECHECKPOINT);
        /* truncated state */
        loom_iter_close(r);
    }
    s->transform[3].batch_size = 2;
    r = open_ok(s);
    if (r) {
        loom_buf rb;
        loom_buf_wrap(&rb, b.data, b.len - 9);
        CHECK(loom_iter_restore(r, &rb, &err) == LOOM_ECHECKPOINT);
        loom_iter_close(r);
    }
    loom_buf_fini(&b);
    free(s);
}

/* ---- normalize + random_flip_left_right as one pass --------------------------------- */

/* The hashes of every element of two epochs of s, opened with the data.options
 * defaults (rewrites on: adjacent maps fused) or without options (no rewrite). */
static int norm_flip_run(loom_dataset_spec *s, bool rewrites, uint64_t *h, int max)
{
    if (rewrites)
        s->options = (loom_data_options){.present = true, .deterministic = true, .autotune = true, .ram_fraction = 0.5,
                                         .noop_elimination = true, .map_fusion = true, .map_and_batch_fusion = true,
                                         .shuffle_and_repeat_fusion = true, .inject_prefetch = true};
    else
        memset(&s->options, 0, sizeof s->options);
    loom_iter *it = open_ok(s);
    int n = 0;
    loom_err err = {0};
    for (int ep = 0; it && ep < 2; ep++) {
        if (ep) CHECK(loom_iter_rewind(it, ep, &err) == LOOM_OK);
        loom_elem *e;
        int rc;
        while (n < max && (rc = loom_iter_next(it, &e, &err)) == LOOM_OK) h[n++] = elem_hash(e);
        CHECK_MSG(n == max || rc == LOOM_EEOF, "%s", err.msg);
    }
    loom_iter_close(it);
    return n;
}

/* The fused chain's normalize+flip pass (uint8 rows reversed, then one
 * vectorised normalize) against the two maps run apart, element for element:
 * grey and 3-channel images, uint8 and float32 input (a cast before it: in
 * place), one mean or adapted mean_v, written into a shuffle slot, a prefetch
 * slot or a batch row (map+batch), and on batched images. */
static void test_norm_flip_fused(void)
{
    setup();
    enum { N = 37 };
    static uint8_t g[N * 6 * 13], c3[N * 5 * 11 * 3];
    for (size_t i = 0; i < sizeof g; i++) g[i] = (uint8_t)(i * 37 + (i >> 3));
    for (size_t i = 0; i < sizeof c3; i++) c3[i] = (uint8_t)(i * 53 + (i >> 2) * 7);
    uint32_t dg[3] = {N, 6, 13}, dc[4] = {N, 5, 11, 3};
    write_idx(tpath("nf_grey.idx"), 0, 0x08, 3, dg, g, 0);
    write_idx(tpath("nf_rgb.idx"), 0, 0x08, 4, dc, c3, 0);
    static uint64_t ref[4 * N], got[4 * N];
    for (int img = 0; img < 2; img++)
        for (int v = 0; v < 7; v++) {
            loom_dataset_spec *s = spec_new();
            spec_feature(s, "image", tpath(img ? "nf_rgb.idx" : "nf_grey.idx"));
            if (v == 6) spec_batch(s, 4);
            if (v == 3) spec_map(s, LOOM_MAP_CAST, "image", 1, true)->dtype = LOOM_CFG_F32;
            loom_map_spec *m = spec_map(s, LOOM_MAP_NORMALIZE, "image", 1, true);
            m->mean = 72.94;
            m->std = 90.02;
            if (v == 4) {
                m->n_norm = 1;
                m->mean_v[0] = 101.5f;
                m->std_v[0] = 3.25f;
            }
            spec_map(s, LOOM_MAP_FLIP_LR, "image", 1, true);
            if (v == 1) spec_shuffle(s, 16);
            if (v == 2 || v == 3) spec_batch(s, 5);
            if (v == 5 || v == 6) spec_prefetch(s, 2);
            int a = norm_flip_run(s, false, ref, 4 * N), b = norm_flip_run(s, true, got, 4 * N);
            CHECK_MSG(a > 0 && a == b && !memcmp(ref, got, (size_t)a * sizeof *ref),
                      "%s images, variant %d: fused %d elements, apart %d, first differing at %d", img ? "rgb" : "grey", v,
                      b, a, a == b ? (int)(memcmp(ref, got, (size_t)a * sizeof *ref) != 0) : -1);
            free(s);
        }
}

/* The fused pad + random_crop (+ random_flip_left_right) pass against the
 * maps run apart, element for element over two epochs: grey and 3-channel
 * uint8 images and float32 ones (a cast before), zero and non-zero fill,
 * windows that take whole rows and columns of padding (a crop wider than
 * the image), with and without the flip, sequential (parallel 1) and
 * parallel maps, into a batch row (map+batch), a shuffle slot or a prefetch
 * slot; then the fused pipeline restored from a state saved 11 elements
 * (3 batches) in goes on as the run that saved it. */
static void test_pad_crop_fused(void)
{
    setup();
    enum { N = 29, MAX = 4 * N };
    static uint8_t g[N * 6 * 13], c3[N * 5 * 11 * 3];
    for (size_t i = 0; i < sizeof g; i++) g[i] = (uint8_t)(i * 41 + (i >> 3) + 1);
    for (size_t i = 0; i < sizeof c3; i++) c3[i] = (uint8_t)(i * 59 + (i >> 2) * 5 + 1);
    uint32_t dg[3] = {N, 6, 13}, dc[4] = {N, 5, 11, 3};
    write_idx(tpath("pc_grey.idx"), 0, 0x08, 3, dg, g, 0);
    write_idx(tpath("pc_rgb.idx"), 0, 0x08, 4, dc, c3, 0);
    static uint64_t ref[MAX], got[MAX], rest[MAX];
    for (int img = 0; img < 2; img++)
        for (int v = 0; v < 10; v++) {
            int par = v % 2 ? 2 : 1;
            loom_dataset_spec *s = spec_new();
            spec_feature(s, "image", tpath(img ? "pc_rgb.idx" : "pc_grey.idx"));
            if (v >= 8) spec_map(s, LOOM_MAP_CAST, "image", par, true)->dtype = LOOM_CFG_F32;
            loom_map_spec *m = spec_map(s, LOOM_MAP_PAD, "image", par, true);
            m->padding = v >= 6 ? 3 : 2;
            m->value = v == 2 || v == 3 || v == 9 ? 7.0 : 0.0;
            m = spec_map(s, LOOM_MAP_RANDOM_CROP, "image", par, true);
            m->size[0] = v >= 6 ? 9 : 5, m->size[1] = v >= 6 ? 16 : 10; /* 16 > 13 + 2: columns of padding on both sides */
            if (v != 4 && v != 5) spec_map(s, LOOM_MAP_FLIP_LR, "image", par, true);
            if (v == 6) spec_shuffle(s, 8);
            if (v <= 3 || v == 8) spec_batch(s, 4);
            if (v == 7 || v == 9) spec_prefetch(s, 2);
            int a = norm_flip_run(s, false, ref, MAX), b = norm_flip_run(s, true, got, MAX);
            CHECK_MSG(a > 0 && a == b && !memcmp(ref, got, (size_t)a * sizeof *ref),
                      "%s images, variant %d: fused %d elements, apart %d, first differing at %d", img ? "rgb" : "grey", v,
                      b, a, a == b ? (int)(memcmp(ref, got, (size_t)a * sizeof *ref) != 0) : -1);
            /* resume: a state saved 11 elements (3 batches) into the fused run's first epoch */
            const int cut = v <= 3 || v == 8 ? 3 : 11;
            loom_err err = {0};
            loom_iter *it = open_ok(s), *r = NULL;
            loom_elem *e;
            loom_buf st;
            loom_buf_init(&st);
            int k = 0, n = 0, rc = LOOM_OK;
            while (it && k < cut && loom_iter_next(it, &e, &err) == LOOM_OK) k++;
            CHECK(it && loom_iter_save(it, &st, &err) == LOOM_OK);
            loom_iter_close(it);
            if ((r = open_ok(s))) {
                loom_buf rb;
                loom_buf_wrap(&rb, st.data, st.len);
                CHECK_MSG(loom_iter_restore(r, &rb, &err) == LOOM_OK, "restore: %s", err.msg);
                for (int ep = 0; ep < 2 && n < MAX - k; ep++) {
                    if (ep) CHECK(loom_iter_rewind(r, ep, &err) == LOOM_OK);
                    while (n < MAX - k && (rc = loom_iter_next(r, &e, &err)) == LOOM_OK) rest[n++] = elem_hash(e);
                }
                loom_iter_close(r);
            }
            CHECK_MSG(k == cut && n == b - k && !memcmp(rest, got + k, (size_t)n * sizeof *rest),
                      "%s images, variant %d: restored after %d elements, %d follow of %d", img ? "rgb" : "grey", v, k, n,
                      b - k);
            loom_buf_fini(&st);
            free(s);
        }
}

/* ---- the stage timers' clock -------------------------------------------------------- */

static int64_t mono_now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* dnow_ns_ (the TSC on a line anchored at CLOCK_MONOTONIC every ms, where
 * the TSC is invariant) measures what CLOCK_MONOTONIC does: spans of busy
 * work and of sleeps from 50 us to 20 ms agree within 1% + 20 us, and it
 * never goes back. Retried (3 attempts) against a loaded machine preempting
 * a thread between the two clocks' reads. */
static void test_stage_clock(void)
{
    static const int64_t spans_us[] = {50, 300, 1000, 4000, 20000};
    for (size_t k = 0; k < sizeof spans_us / sizeof spans_us[0]; k++)
        for (int busy = 0; busy < 2; busy++) {
            int64_t a = 0, b = 0, err_ns = 0, lim = 0;
            int ok = 0;
            for (int attempt = 0; attempt < 3 && !ok; attempt++) {
                int64_t m0 = mono_now_ns(), d0 = dnow_ns_(), prev = d0;
                int mono = 1;
                if (busy) {
                    while (mono_now_ns() - m0 < spans_us[k] * 1000) {
                        int64_t v = dnow_ns_();
                        mono &= v >= prev;
                        prev = v;
                    }
                } else {
                    struct timespec ts = {0, (long)(spans_us[k] * 1000)};
                    nanosleep(&ts, NULL);
                }
                int64_t d1 = dnow_ns_(), m1 = mono_now_ns();
                CHECK_MSG(mono && d1 >= prev, "dnow_ns_ went back");
                a = d1 - d0;
                b = m1 - m0;
                err_ns = a > b ? a - b : b - a;
                lim = b / 100 + 20000;
                ok = err_ns <= lim;
            }
            CHECK_MSG(ok, "%s %lld us: dnow_ns_ measured %lld ns, CLOCK_MONOTONIC %lld ns (off by %lld, limit %lld)",
                      busy ? "busy" : "sleep", (long long)spans_us[k], (long long)a, (long long)b, (long long)err_ns,
                      (long long)lim);
        }
    /* the cost of a reading, for the record (a TAP comment, not a check) */
    enum { READS = 200000 };
    uint64_t sink = 0; /* unsigned: sums that wrap */
    int64_t t0 = mono_now_ns();
    for (int i = 0; i < READS; i++) sink += (uint64_t)dnow_ns_();
    int64_t t1 = mono_now_ns();
    for (int i = 0; i < READS; i++) sink += (uint64_t)mono_now_ns();
    int64_t t2 = mono_now_ns();
    printf("# stage clock: %.1f ns a reading, clock_gettime %.1f ns (%d)\n", (double)(t1 - t0) / READS,
           (double)(t2 - t1) / READS, (int)(sink & 1));
}

/* ---- stats ------------------------------------------------------------------------ */

static void test_stats(void)
{
    setup();
    loom_dataset_spec *s = spec_train(2, 3);
    loom_iter *it = open_ok(s);
    if (!it) {
        free(s);
        return;
    }
    int64_t l[16];
    CHECK(collect_labels(it, l, 16) == 10);
    loom_stage_stats st[8];
    int n = loom_iter_stats(it, st, 8);
    CHECK(n == 6);
    CHECK(!strcmp(st[0].name, "idx") && !strcmp(st[1].name, "map(cast)") && !strcmp(st[2].name, "shuffle"));
    CHECK(!strcmp(st[3].name, "map(random_flip_left_right)") && !strcmp(st[4].name, "batch") && !strcmp(st[5].name, "prefetch"));
    CHECK(st[0].elements == 10 && st[2].elements == 10 && st[4].elements == 4 && st[5].elements == 4);
    CHECK(st[2].capacity == 4);
    CHECK(st[5].capacity == 2);
    CHECK(st[4].busy_sec > 0 && st[4].busy_sec >= st[3].busy_sec);
    for (int i = 0; i < n; i++)
        printf("#   stage %-28s elements %6lld busy %.6fs wait %.6fs buffered %lld/%lld\n", st[i].name, (long long)st[i].elements,
               st[i].busy_sec, st[i].wait_sec, (long long)st[i].buffered, (long long)st[i].capacity);
    CHECK(loom_iter_stats(it, st, 2) == 2);
    loom_iter_close(it);
    free(s);
}

/* ---- throughput --------------------------------------------------------------------- */

static void test_throughput(void)
{
    if (skip_catalog()) return;
    loom_dataset_spec *s = spec_new();
    s->source.kind = LOOM_SRC_CATALOG;
    snprintf(s->source.catalog.name, sizeof s->source.catalog.name, "fashion_mnist");
    snprintf(s->source.catalog.split, sizeof s->source.catalog.split, "train");
    add_map(s, LOOM_MAP_CAST, "image")->dtype = LOOM_CFG_F32;
    add_map(s, LOOM_MAP_SCALE, "image")->scale = 1.0 / 255.0;
    add_shuffle(s, 10000, 42, true);
    add_batch(s, 128, false);
    spec_prefetch(s, -1);
    double t0 = loom_now();
    loom_iter *it = open_ok(s);
    double t1 = loom_now();
    if (!it) {
        free(s);
        return;
    }
    loom_err err;
    for (int ep = 0; ep < 2; ep++) {
        double a = loom_now();
        loom_elem *e;
        int64_t n = 0;
        double sum = 0;
        while (loom_iter_next(it, &e, &err) == LOOM_OK) {
            n += e->t[0].shape.dim[0];
            sum += ((float *)e->t[0].data)[400];
        }
        double dt = loom_now() - a;
        CHECK(n == 60000);
        CHECK(sum > 0);
        printf("# throughput epoch %d: %lld samples in %.3f s = %.0f samples/s (open %.3f s; catalog->cast->scale->shuffle(10000)"
               "->batch(128)->prefetch(auto))\n", ep, (long long)n, dt, (double)n / dt, t1 - t0);
        loom_iter_rewind(it, ep + 1, &err);
    }
    loom_stage_stats st[8];
    int n = loom_iter_stats(it, st, 8);
    for (int i = 0; i < n; i++)
        printf("#   stage %-16s elements %7lld busy %.3fs wait %.3fs buffered %lld/%lld\n", st[i].name, (long long)st[i].elements,
               st[i].busy_sec, st[i].wait_sec, (long long)st[i].buffered, (long long)st[i].capacity);
    loom_iter_close(it);
    free(s);
}

static void test_cleanup(void) { tmpdir_remove(); }

/* The process's address-space size in bytes (VmSize), 0 when unknown. */
static uint64_t vm_size(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    uint64_t kb = 0;
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "VmSize:", 7)) kb = strtoull(line + 7, NULL, 10);
    if (f) fclose(f);
    return kb * 1024;
}

/* Loads path in a child whose address space may grow by at most 48 MB
 * (skipped under sanitizers, whose shadow memory is huge); returns the code
 * and the message. */
static int idx_load_bounded(const char *path, char *msg, size_t n)
{
    int fds[2];
    if (pipe(fds)) return -1;
    pid_t pid = fork();
    if (pid == 0) {
        close(fds[0]);
        uint64_t vm = vm_size();
        if (vm && vm < ((uint64_t)1 << 40)) {
            struct rlimit rl = {vm + (48u << 20), vm + (48u << 20)};
            setrlimit(RLIMIT_AS, &rl);
        }
        loom_tensor t;
        loom_err e = {0};
        int rc = loom_idx_load(path, &t, &e);
        if (!rc) loom_tensor_fini(&t);
        char out[600];
        int k = snprintf(out, sizeof out, "%d %s", rc, e.msg);
        if (write(fds[1], out, (size_t)k) < 0) _exit(2);
        _exit(0);
    }
    close(fds[1]);
    char buf[600] = "";
    ssize_t k = read(fds[0], buf, sizeof buf - 1);
    close(fds[0]);
    waitpid(pid, NULL, 0);
    if (k <= 0) return -1;
    buf[k] = 0;
    char *sp = strchr(buf, ' ');
    snprintf(msg, n, "%s", sp ? sp + 1 : "");
    return atoi(buf);
}

/* A gzip IDX file is checked by its header before the rest is inflated, and
 * inflated no further than the header declares: 64 MB of zeros behind a bad
 * type code, or behind a header declaring 16 bytes, cost no 64 MB buffer. */
static void test_idx_gzip_bounded(void)
{
    static uint8_t zeros[1 << 20];
    const uint8_t heads[2][12] = {{0, 0, 0x0A, 1, 0, 0, 1, 0}, {0, 0, 0x08, 2, 0, 0, 0, 1, 0, 0, 0, 16}};
    const size_t head_len[2] = {8, 12};
    const char *want[2] = {"unsupported type code 0x0a", "oversized IDX file: the header (2 dims, 1 items) implies 28 bytes"};
    for (int i = 0; i < 2; i++) {
        const char *path = tpath(i ? "bomb_oversized.idx.gz" : "bomb_type.idx.gz");
        gzFile f = gzopen(path, "wb9");
        gzwrite(f, heads[i], (unsigned)head_len[i]);
        for (int k = 0; k < 64; k++) gzwrite(f, zeros, sizeof zeros);
        gzclose(f);
        struct stat st;
        CHECK(stat(path, &st) == 0 && st.st_size < (1 << 20));
        char msg[600];
        double t0 = loom_now();
        int rc = idx_load_bounded(path, msg, sizeof msg);
        CHECK_MSG(rc == LOOM_EDATA, "rc %d: %s", rc, msg);
        CHECK_CONTAINS(msg, want[i]);
        printf("# gzip bomb (%s): refused in %.1f ms\n", i ? "oversized" : "bad type", (loom_now() - t0) * 1e3);
    }
    /* the same header, gzip and whole: still loads */
    const uint8_t ok[] = {0, 0, 0x08, 2, 0, 0, 0, 1, 0, 0, 0, 3, 7, 8, 9};
    gzFile f = gzopen(tpath("ok.idx.gz"), "wb");
    gzwrite(f, ok, sizeof ok);
    gzclose(f);
    loom_tensor t;
    loom_err e = {0};
    CHECK(loom_idx_load(tpath("ok.idx.gz"), &t, &e) == LOOM_OK && t.shape.rank == 2 && t.shape.dim[1] == 3 &&
          ((uint8_t *)t.data)[2] == 9);
    if (!e.code) loom_tensor_fini(&t);
}

static const loom_test tests[] = {
    {"idx_source", test_idx_source},
    {"idx_dtypes", test_idx_dtypes},
    {"idx_errors", test_idx_errors},
    {"idx_gzip_bounded", test_idx_gzip_bounded},
    {"catalog_resolve", test_catalog_resolve},
    {"catalog_fashion_mnist", test_catalog_fashion_mnist},
    {"shuffle_reference", test_shuffle_reference},
    {"shuffle_epochs_and_seeds", test_shuffle_epochs_and_seeds},
    {"shuffle_by_index", test_shuffle_by_index},
    {"shuffle_by_index_state", test_shuffle_by_index_state},
    {"batch", test_batch},
    {"repeat_take_skip", test_repeat_take_skip},
    {"prefetch_same_sequence", test_prefetch_same_sequence},
    {"save_restore", test_save_restore},
    {"restore_refused", test_restore_refused},
    {"norm_flip_fused", test_norm_flip_fused},
    {"pad_crop_fused", test_pad_crop_fused},
    {"stage_clock", test_stage_clock},
    {"stats", test_stats},
    {"throughput", test_throughput},
    {"cleanup", test_cleanup},
    {0},
};

int main(void) { return loom_test_run(tests); }
