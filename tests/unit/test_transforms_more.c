/* test_transforms_more.c - filter, shard, enumerate, unbatch, padded_batch and
 * cache (memory and file) against hand-computed expectations; exact
 * save/restore through each of them; the file cache across iterators and
 * processes, its lock and its refusal of a cache from another pipeline; and
 * their config options (load, print round trip). Fixtures live in a
 * temporary directory made at run time. */
#include "harness.h"
#include "test_util.h"
#include "data/data.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define N 10

/* An uncompressed IDX file of uint8 values. */
static void write_idx_u8(const char *path, int ndim, const uint32_t *dims, const uint8_t *vals)
{
    size_t n = 1;
    for (int d = 0; d < ndim; d++) n *= dims[d];
    FILE *f = fopen(path, "wb");
    uint8_t h[4] = {0, 0, 0x08, (uint8_t)ndim};
    fwrite(h, 1, 4, f);
    for (int d = 0; d < ndim; d++) {
        uint8_t b[4] = {(uint8_t)(dims[d] >> 24), (uint8_t)(dims[d] >> 16), (uint8_t)(dims[d] >> 8), (uint8_t)dims[d]};
        fwrite(b, 1, 4, f);
    }
    fwrite(vals, 1, n, f);
    fclose(f);
}

static void setup(void)
{
    if (tmpdir[0]) return;
    snprintf(tmpdir, sizeof tmpdir, "/tmp/loom_test_tmore_%ld", (long)getpid());
    mkdir(tmpdir, 0755);
    /* image i: (4, 3) with value i*16 + k; label i: i */
    uint8_t im[N * 12], lb[N];
    for (int i = 0; i < N; i++) {
        lb[i] = (uint8_t)i;
        for (int k = 0; k < 12; k++) im[i * 12 + k] = (uint8_t)(i * 16 + k);
    }
    uint32_t di[3] = {N, 4, 3}, dl[1] = {N};
    write_idx_u8(tpath("img.idx"), 3, di, im);
    write_idx_u8(tpath("lbl.idx"), 1, dl, lb);
}

static loom_dataset_spec *spec_new(void)
{
    loom_dataset_spec *s = calloc(1, sizeof *s);
    s->present = true;
    loom_source_spec *src = &s->source;
    src->kind = LOOM_SRC_IDX;
    snprintf(src->loc.file, sizeof src->loc.file, "test.cfg");
    src->loc.line = 3;
    src->n_features = 2;
    snprintf(src->feature[0], LOOM_NAME_MAX, "image");
    snprintf(src->idx.file[0], LOOM_PATH_MAX, "%s", tpath("img.idx"));
    snprintf(src->feature[1], LOOM_NAME_MAX, "label");
    snprintf(src->idx.file[1], LOOM_PATH_MAX, "%s", tpath("lbl.idx"));
    return s;
}

static loom_transform_spec *add_filter(loom_dataset_spec *s, const char *feature, loom_filter_kind k, int n, const double *v)
{
    loom_transform_spec *t = spec_add(s, LOOM_T_FILTER);
    snprintf(t->feature, sizeof t->feature, "%s", feature);
    t->filter = k;
    t->n_values = n;
    for (int i = 0; i < n; i++) t->values[i] = v[i];
    t->min = -INFINITY;
    t->max = INFINITY;
    return t;
}

static void add_shuffle(loom_dataset_spec *s, int64_t buffer, uint64_t seed)
{
    loom_transform_spec *t = spec_add(s, LOOM_T_SHUFFLE);
    t->buffer = buffer;
    t->seed = seed;
    t->seed_set = true;
    t->reshuffle = true;
}

static void add_batch(loom_dataset_spec *s, loom_transform_kind k, int64_t size, bool drop)
{
    loom_transform_spec *t = spec_add(s, k);
    t->batch_size = size;
    t->drop_remainder = drop;
}

static void add_cache(loom_dataset_spec *s, const char *file)
{
    loom_transform_spec *t = spec_add(s, LOOM_T_CACHE);
    if (file) snprintf(t->cache_file, sizeof t->cache_file, "%s", file);
}

static const loom_data_ctx ctx1 = {.seed = 42, .threads = 1, .name = "train"};

static loom_iter *open_ok(const loom_dataset_spec *s) { return iter_open_ok(s, &ctx1); }

/* Opens expecting failure; the formatted error goes to buf. */
static int open_fail(const loom_dataset_spec *s, char *buf, size_t n)
{
    loom_iter *it = NULL;
    loom_err err = {0};
    int rc = loom_data_open(&it, s, &ctx1, &err);
    CHECK(rc != LOOM_OK);
    CHECK(it == NULL);
    loom_iter_close(it);
    loom_err_format(&err, buf, n);
    return rc;
}

/* Values of feature `name` over one pass (all values of batched tensors); count, or -1 on error. */
static int collect(loom_iter *it, const char *name, int64_t *out, int max, char *errbuf, size_t errn)
{
    int n = 0, f = loom_elem_spec_find(loom_iter_spec(it), name);
    loom_elem *e;
    loom_err err = {0};
    int rc;
    while ((rc = loom_iter_next(it, &e, &err)) == LOOM_OK) {
        int64_t k = loom_shape_numel(&e->t[f].shape);
        for (int64_t i = 0; i < k && n < max; i++) out[n++] = (int64_t)loom_tensor_get(&e->t[f], i);
    }
    if (errbuf) loom_err_format(&err, errbuf, errn);
    else CHECK_MSG(rc == LOOM_EEOF, "%s: %s", err.where, err.msg);
    return rc == LOOM_EEOF ? n : -1;
}

static int labels(loom_iter *it, int64_t *out) { return collect(it, "label", out, 64, NULL, 0); }

static int eq(const int64_t *a, int n, const int64_t *b, int m)
{
    if (n != m) return 0;
    for (int i = 0; i < n; i++)
        if (a[i] != b[i]) return 0;
    return 1;
}

/* Logs rank, dims and bytes of every feature of e. */
static void blob_elem(blob *b, const loom_elem *e)
{
    for (int f = 0; f < e->n; f++) {
        const loom_tensor *t = &e->t[f];
        blob_put(b, &t->dtype, sizeof t->dtype);
        blob_put(b, &t->shape.rank, sizeof t->shape.rank);
        blob_put(b, t->shape.dim, (size_t)t->shape.rank * sizeof t->shape.dim[0]);
        blob_put(b, t->data, loom_tensor_nbytes(t));
    }
}

/* Pulls `count` elements (or everything when count < 0) across epochs up to
 * epochs, rewinding at each end of pass; *epoch tracks the pass. Returns the
 * number of elements pulled. */
static int drive(loom_iter *it, blob *b, int count, int64_t *epoch, int64_t epochs)
{
    int k = 0;
    loom_elem *e;
    loom_err err = {0};
    while ((count < 0 || k < count) && *epoch < epochs) {
        int rc = loom_iter_next(it, &e, &err);
        if (rc == LOOM_EEOF) {
            if (++*epoch < epochs) {
                rc = loom_iter_rewind(it, *epoch, &err);
                CHECK_MSG(rc == LOOM_OK, "rewind: %s", err.msg);
            }
            continue;
        }
        if (rc) {
            CHECK_MSG(0, "next: %s: %s", err.where, err.msg);
            break;
        }
        blob_elem(b, e);
        k++;
    }
    return k;
}

/* Save at every cut in [0, total) (stride), restore into a fresh iterator, and
 * check the concatenated sequence equals an uninterrupted run over `epochs`. */
static void check_restore(const loom_dataset_spec *s, int64_t epochs, int stride, void (*between)(void))
{
    blob ref = {0};
    int64_t ep = 0;
    loom_iter *it = open_ok(s);
    if (!it) return;
    int total = drive(it, &ref, -1, &ep, epochs);
    loom_iter_close(it);
    if (between) between();
    for (int cut = 0; cut < total; cut += stride) {
        blob got = {0};
        loom_buf st;
        loom_buf_init(&st);
        loom_err err = {0};
        ep = 0;
        loom_iter *a = open_ok(s);
        if (!a) break;
        drive(a, &got, cut, &ep, epochs);
        CHECK(loom_iter_save(a, &st, &err) == LOOM_OK);
        loom_iter_close(a);
        if (between) between();
        loom_iter *b = open_ok(s);
        if (!b) break;
        int rc = loom_iter_restore(b, &st, &err);
        CHECK_MSG(rc == LOOM_OK, "restore at %d: %s: %s", cut, err.where, err.msg);
        drive(b, &got, -1, &ep, epochs);
        loom_iter_close(b);
        CHECK_MSG(got.n == ref.n && !memcmp(got.p, ref.p, ref.n), "cut %d: %zu bytes vs %zu", cut, got.n, ref.n);
        free(got.p);
        loom_buf_fini(&st);
    }
    free(ref.p);
}

/* ---- filter ---------------------------------------------------------------- */

static void test_filter(void)
{
    setup();
    int64_t got[64];
    char msg[1024];
    double in[] = {8, 1, 5, 3};
    loom_dataset_spec *s = spec_new();
    add_filter(s, "label", LOOM_FILTER_IN, 4, in);
    loom_iter *it = open_ok(s);
    if (it) {
        int64_t want[] = {1, 3, 5, 8};
        CHECK(loom_iter_cardinality(it) == -2);
        CHECK(eq(got, labels(it, got), want, 4)); /* input order, not the order of `in` */
        CHECK(loom_iter_rewind(it, 1, &(loom_err){0}) == LOOM_OK);
        CHECK(eq(got, labels(it, got), want, 4));
        loom_iter_close(it);
    }
    s->transform[0].filter = LOOM_FILTER_NOT_IN;
    if ((it = open_ok(s))) {
        int64_t want[] = {0, 2, 4, 6, 7, 9};
        CHECK(eq(got, labels(it, got), want, 6));
        loom_iter_close(it);
    }
    s->transform[0].filter = LOOM_FILTER_RANGE;
    s->transform[0].min = 2;
    s->transform[0].max = 4;
    if ((it = open_ok(s))) {
        int64_t want[] = {2, 3, 4};
        CHECK(eq(got, labels(it, got), want, 3));
        loom_iter_close(it);
    }
    s->transform[0].max = INFINITY;
    s->transform[0].min = 7.5;
    if ((it = open_ok(s))) {
        int64_t want[] = {8, 9};
        CHECK(eq(got, labels(it, got), want, 2));
        loom_iter_close(it);
    }
    /* the image is not a scalar; an unknown feature lists the others */
    snprintf(s->transform[0].feature, LOOM_NAME_MAX, "image");
    open_fail(s, msg, sizeof msg);
    CHECK_CONTAINS(msg, "test.cfg:20: data.train.transforms.[0]: filter: feature \"image\" has shape (4, 3), the predicate needs "
                        "a scalar");
    snprintf(s->transform[0].feature, LOOM_NAME_MAX, "lable");
    open_fail(s, msg, sizeof msg);
    CHECK_CONTAINS(msg, "test.cfg:20: data.train.transforms.[0]: filter: no feature \"lable\" (available: image, label)");
    free(s);
}

/* ---- shard ------------------------------------------------------------------- */

static void test_shard(void)
{
    setup();
    int64_t got[64];
    int seen[N] = {0};
    char msg[1024];
    for (int64_t i = 0; i < 3; i++) {
        loom_dataset_spec *s = spec_new();
        loom_transform_spec *t = spec_add(s, LOOM_T_SHARD);
        t->num_shards = 3;
        t->index = i;
        loom_iter *it = open_ok(s);
        if (it) {
            CHECK(loom_iter_cardinality(it) == (i == 0 ? 4 : 3));
            int n = labels(it, got);
            CHECK(n == (i == 0 ? 4 : 3));
            for (int k = 0; k < n; k++) {
                CHECK(got[k] == i + 3 * k); /* position p with p % 3 == i, in order */
                if (got[k] >= 0 && got[k] < N) seen[got[k]]++;
            }
            loom_iter_close(it);
        }
        free(s);
    }
    for (int i = 0; i < N; i++) CHECK_MSG(seen[i] == 1, "element %d in %d shards", i, seen[i]); /* a partition */
    /* positions count after a filter: shard of the kept elements */
    loom_dataset_spec *s = spec_new();
    double odd[] = {1, 3, 5, 7, 9};
    add_filter(s, "label", LOOM_FILTER_IN, 5, odd);
    loom_transform_spec *t = spec_add(s, LOOM_T_SHARD);
    t->num_shards = 2;
    t->index = 1;
    loom_iter *it = open_ok(s);
    if (it) {
        int64_t want[] = {3, 7};
        CHECK(eq(got, labels(it, got), want, 2));
        loom_iter_close(it);
    }
    t->index = 2;
    open_fail(s, msg, sizeof msg);
    CHECK_CONTAINS(msg, "test.cfg:21: data.train.transforms.[1]: shard: index 2 is out of range: expected 0 <= index < num_shards (2)");
    free(s);
}

/* ---- enumerate --------------------------------------------------------------- */

static void test_enumerate(void)
{
    setup();
    int64_t idx[64];
    char msg[1024];
    loom_dataset_spec *s = spec_new();
    add_shuffle(s, 4, 7);
    loom_transform_spec *t = spec_add(s, LOOM_T_ENUMERATE);
    snprintf(t->feature, sizeof t->feature, "index");
    t->start = 5;
    loom_iter *it = open_ok(s);
    if (it) {
        const loom_elem_spec *sp = loom_iter_spec(it);
        int f = loom_elem_spec_find(sp, "index");
        CHECK(f == 2 && sp->dtype[f] == LOOM_I64 && sp->shape[f].rank == 0);
        CHECK(loom_iter_cardinality(it) == N);
        for (int ep = 0; ep < 2; ep++) {
            if (ep) CHECK(loom_iter_rewind(it, ep, &(loom_err){0}) == LOOM_OK);
            int n = collect(it, "index", idx, 64, NULL, 0);
            CHECK(n == N);
            for (int i = 0; i < n; i++) CHECK(idx[i] == 5 + i); /* the position, not the shuffled label */
        }
        loom_iter_close(it);
    }
    /* enumerate then filter: the indices of the kept elements */
    loom_dataset_spec *s2 = spec_new();
    spec_add(s2, LOOM_T_ENUMERATE);
    snprintf(s2->transform[0].feature, LOOM_NAME_MAX, "i");
    double v[] = {2, 6};
    add_filter(s2, "label", LOOM_FILTER_IN, 2, v);
    if ((it = open_ok(s2))) {
        CHECK(collect(it, "i", idx, 64, NULL, 0) == 2 && idx[0] == 2 && idx[1] == 6);
        loom_iter_close(it);
    }
    snprintf(t->feature, sizeof t->feature, "label");
    open_fail(s, msg, sizeof msg);
    CHECK_CONTAINS(msg, "test.cfg:21: data.train.transforms.[1]: enumerate: the element already has a feature \"label\"");
    free(s);
    free(s2);
}

/* ---- concat, select, split ------------------------------------------------------ */

/* image (4, 3) uint8 i*16+k and label i: concat [label, image] is (13,) uint8,
 * row i = i, i*16+0, ..., i*16+11; batched the same per example; select keeps
 * the listed features in order. */
static void test_concat_select(void)
{
    setup();
    char msg[1024];
    for (int batched = 0; batched < 2; batched++) {
        loom_dataset_spec *s = spec_new();
        if (batched) add_batch(s, LOOM_T_BATCH, 3, false);
        loom_transform_spec *t = spec_add(s, LOOM_T_CONCAT);
        t->features.n = 2;
        snprintf(t->features.name[0], LOOM_NAME_MAX, "label");
        snprintf(t->features.name[1], LOOM_NAME_MAX, "image");
        snprintf(t->features.output, LOOM_NAME_MAX, "all");
        t = spec_add(s, LOOM_T_SELECT);
        t->features.n = 2;
        snprintf(t->features.name[0], LOOM_NAME_MAX, "all");
        snprintf(t->features.name[1], LOOM_NAME_MAX, "label");
        loom_iter *it = open_ok(s);
        if (it) {
            const loom_elem_spec *sp = loom_iter_spec(it);
            CHECK(sp->n == 2 && !strcmp(sp->name[0], "all") && !strcmp(sp->name[1], "label"));
            CHECK(sp->dtype[0] == LOOM_U8 && sp->shape[0].rank == 1 + batched && sp->shape[0].dim[batched] == 13);
            int64_t v[N * 13];
            CHECK(collect(it, "all", v, N * 13, NULL, 0) == N * 13);
            int bad = 0;
            for (int i = 0; i < N; i++) {
                bad += v[i * 13] != i;
                for (int k = 0; k < 12; k++) bad += v[i * 13 + 1 + k] != i * 16 + k;
            }
            CHECK_MSG(bad == 0, "batched %d: %d values out of place", batched, bad);
            loom_iter_close(it);
        }
        free(s);
    }
    loom_dataset_spec *s = spec_new();
    loom_transform_spec *t = spec_add(s, LOOM_T_SELECT);
    t->features.n = 1;
    snprintf(t->features.name[0], LOOM_NAME_MAX, "lable");
    open_fail(s, msg, sizeof msg);
    CHECK_CONTAINS(msg, "select: no feature \"lable\" (the element has image: uint8 (4, 3); label: uint8 ())");
    free(s);
}

/* split: the train and eval parts of one seed are disjoint, cover the input,
 * and are the same in every pass; another seed gives other parts. */
static void test_split(void)
{
    setup();
    int64_t tr[64], ev[64], tr2[64], other[64];
    int nt = 0, ne = 0, n2 = 0, no = 0;
    for (int part = 0; part < 2; part++)
        for (uint64_t seed = 3; seed <= 4; seed++) {
            loom_dataset_spec *s = spec_new();
            loom_transform_spec *t = spec_add(s, LOOM_T_SPLIT);
            t->fraction = 0.6;
            t->part = part;
            t->seed = seed;
            t->seed_set = true;
            loom_iter *it = open_ok(s);
            if (!it) continue;
            if (seed == 4 && part == 0) no = labels(it, other);
            if (seed == 3 && part == 1) ne = labels(it, ev);
            if (seed == 3 && part == 0) {
                nt = labels(it, tr);
                CHECK(loom_iter_rewind(it, 1, &(loom_err){0}) == LOOM_OK);
                n2 = labels(it, tr2);
            }
            loom_iter_close(it);
            free(s);
        }
    CHECK(nt + ne == N && nt > 0 && ne > 0);
    CHECK(n2 == nt && !memcmp(tr, tr2, sizeof tr[0] * (size_t)nt));
    int seen[N] = {0};
    for (int i = 0; i < nt; i++) seen[tr[i]]++;
    for (int i = 0; i < ne; i++) seen[ev[i]]++;
    for (int i = 0; i < N; i++) CHECK_MSG(seen[i] == 1, "label %d is in %d parts", i, seen[i]);
    CHECK(no != nt || memcmp(other, tr, sizeof tr[0] * (size_t)nt));
    /* the draw is splitmix64 of (seed, position): the documented value for (3, 0) */
    CHECK(loom_split_u(3, 0) >= 0 && loom_split_u(3, 0) < 1 && loom_split_u(3, 0) != loom_split_u(3, 1));
}

/* ---- unbatch ----------------------------------------------------------------- */

static void test_unbatch(void)
{
    setup();
    char msg[1024];
    for (int drop = 0; drop < 2; drop++) {
        for (int64_t bs = 1; bs <= 4; bs++) {
            loom_dataset_spec *ref = spec_new(), *s = spec_new();
            add_batch(s, LOOM_T_BATCH, bs, drop);
            spec_add(s, LOOM_T_UNBATCH);
            loom_iter *a = open_ok(ref), *b = open_ok(s);
            if (a && b) {
                blob x = {0}, y = {0};
                int64_t ea = 0, eb = 0;
                int na = drive(a, &x, -1, &ea, 2), nb = drive(b, &y, -1, &eb, 2);
                int64_t want = drop ? (N / bs) * bs : N;
                CHECK_MSG(nb == 2 * want, "bs %lld drop %d: %d elements", (long long)bs, drop, nb);
                if (!drop) CHECK(na == nb && x.n == y.n && !memcmp(x.p, y.p, x.n)); /* unbatch(batch(ds)) == ds */
                if (drop) CHECK(y.n <= x.n && !memcmp(x.p, y.p, y.n / 2)); /* a prefix of ds */
                int64_t c = loom_iter_cardinality(b);
                CHECK_MSG(c == (drop || N % bs == 0 ? want : -2), "bs %lld drop %d: cardinality %lld", (long long)bs, drop,
                          (long long)c);
                CHECK(loom_iter_spec(b)->shape[0].rank == 2 && loom_iter_spec(b)->shape[1].rank == 0);
                free(x.p);
                free(y.p);
            }
            loom_iter_close(a);
            loom_iter_close(b);
            free(ref);
            free(s);
        }
    }
    loom_dataset_spec *s = spec_new();
    spec_add(s, LOOM_T_UNBATCH);
    open_fail(s, msg, sizeof msg);
    CHECK_CONTAINS(msg, "test.cfg:20: data.train.transforms.[0]: unbatch: feature \"label\" is a scalar");
    free(s);
}

/* ---- padded_batch ------------------------------------------------------------- */

static void test_padded_batch(void)
{
    setup();
    char msg[1024];
    /* padded_shapes larger than the element: pad up with the padding value */
    loom_dataset_spec *s = spec_new();
    add_batch(s, LOOM_T_PADDED_BATCH, 4, false);
    loom_transform_spec *t = &s->transform[0];
    t->padded.n_shapes = 1;
    snprintf(t->padded.shape_name[0], LOOM_NAME_MAX, "image");
    t->padded.rank[0] = 2;
    t->padded.shape[0][0] = 5;
    t->padded.shape[0][1] = -1;
    t->padded.n_values = 1;
    snprintf(t->padded.value_name[0], LOOM_NAME_MAX, "image");
    t->padded.value[0] = 200;
    loom_iter *it = open_ok(s);
    if (it) {
        const loom_elem_spec *sp = loom_iter_spec(it);
        CHECK(sp->shape[0].rank == 3 && sp->shape[0].dim[0] == -1 && sp->shape[0].dim[1] == 5 && sp->shape[0].dim[2] == 3);
        CHECK(loom_iter_cardinality(it) == 3);
        loom_elem *e;
        loom_err err = {0};
        int b = 0, ok = 1;
        while (loom_iter_next(it, &e, &err) == LOOM_OK) {
            const loom_tensor *im = &e->t[0], *lb = &e->t[1];
            int64_t bn = b < 2 ? 4 : 2;
            CHECK(im->shape.rank == 3 && im->shape.dim[0] == bn && im->shape.dim[1] == 5 && im->shape.dim[2] == 3);
            CHECK(lb->shape.rank == 1 && lb->shape.dim[0] == bn);
            const uint8_t *p = im->data;
            for (int64_t j = 0; j < bn; j++)
                for (int h = 0; h < 5; h++)
                    for (int w = 0; w < 3; w++) {
                        int i = b * 4 + (int)j;
                        uint8_t want = h < 4 ? (uint8_t)(i * 16 + h * 3 + w) : 200;
                        ok &= p[(j * 5 + h) * 3 + w] == want;
                    }
            b++;
        }
        CHECK(ok && b == 3);
        loom_iter_close(it);
    }
    /* a padded shape smaller than a known dim: refused at open */
    t->padded.shape[0][0] = 3;
    open_fail(s, msg, sizeof msg);
    CHECK_CONTAINS(msg, "test.cfg:20: data.train.transforms.[0]: padded_batch: feature \"image\" has shape (4, 3), larger than "
                        "padded_shapes.image = (3, -1)");
    free(s);

    /* elements whose dim 0 varies (batches of 3, 3, 3, 1): pad to the largest in each padded batch */
    s = spec_new();
    add_batch(s, LOOM_T_BATCH, 3, false);
    add_batch(s, LOOM_T_PADDED_BATCH, 2, false);
    t = &s->transform[1];
    t->padded.n_values = 1;
    snprintf(t->padded.value_name[0], LOOM_NAME_MAX, "label");
    t->padded.value[0] = 99;
    if ((it = open_ok(s))) {
        int64_t got[64];
        int64_t want[] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 99, 99};
        CHECK(eq(got, labels(it, got), want, 12));
        CHECK(loom_iter_spec(it)->shape[1].rank == 2 && loom_iter_spec(it)->shape[1].dim[1] == -1);
        loom_iter_close(it);
    }
    /* an element larger than its fixed padded shape: an error naming the element */
    t->padded.n_shapes = 1;
    snprintf(t->padded.shape_name[0], LOOM_NAME_MAX, "label");
    t->padded.rank[0] = 1;
    t->padded.shape[0][0] = 2;
    if ((it = open_ok(s))) {
        int64_t got[64];
        CHECK(collect(it, "label", got, 64, msg, sizeof msg) < 0);
        CHECK_CONTAINS(msg, "test.cfg:21: data.train.transforms.[1]: padded_batch: element 0: feature \"label\" has shape (3,), larger "
                            "than its padded shape (2,)");
        loom_iter_close(it);
    }
    /* a padding value the dtype cannot hold */
    t->padded.n_shapes = 0;
    t->padded.value[0] = 300;
    open_fail(s, msg, sizeof msg);
    CHECK_CONTAINS(msg, "padded_batch: padding_values.label = 300 does not fit the feature's dtype uint8");
    free(s);

    /* a feature already of rank LOOM_MAX_RANK: refused at open by either batch, naming it */
    for (int k = 0; k < 2; k++) {
        s = spec_new();
        for (int i = 0; i < 6; i++) add_batch(s, LOOM_T_BATCH, 1, false); /* image (4, 3) -> rank 8 */
        add_batch(s, k ? LOOM_T_PADDED_BATCH : LOOM_T_BATCH, 1, false);
        open_fail(s, msg, sizeof msg);
        CHECK_CONTAINS(msg, k ? "transforms.[6]: padded_batch: feature \"image\" already has rank 8"
                              : "transforms.[6]: batch: feature \"image\" already has rank 8");
        free(s);
    }
}

/* ---- cache (memory) ------------------------------------------------------------ */

/* shuffle (reshuffled each epoch) then cache: every pass replays the first. */
static void test_cache_memory(void)
{
    setup();
    int64_t e0[64], e1[64];
    loom_dataset_spec *s = spec_new();
    add_shuffle(s, 10, 3);
    /* reference orders of epochs 0 and 1 without the cache */
    loom_iter *it = open_ok(s);
    if (!it) return;
    CHECK(labels(it, e0) == N);
    CHECK(loom_iter_rewind(it, 1, &(loom_err){0}) == LOOM_OK);
    CHECK(labels(it, e1) == N);
    loom_iter_close(it);
    CHECK(!eq(e0, N, e1, N)); /* the shuffle differs per epoch */
    add_cache(s, NULL);
    if ((it = open_ok(s))) {
        int64_t got[64];
        CHECK(loom_iter_cardinality(it) == N);
        for (int ep = 0; ep < 3; ep++) {
            if (ep) CHECK(loom_iter_rewind(it, ep, &(loom_err){0}) == LOOM_OK);
            CHECK_MSG(eq(got, labels(it, got), e0, N), "epoch %d replays epoch 0", ep);
        }
        loom_stage_stats st[8];
        int ns = loom_iter_stats(it, st, 8);
        CHECK(ns == 3 && !strcmp(st[2].name, "cache(memory)") && st[2].elements == 3 * N && st[2].buffered == N);
        CHECK(st[1].elements == N); /* the shuffle ran once */
        loom_iter_close(it);
    }
    /* a partial first pass is discarded: pass 1 fills from the input's epoch 1 and is then replayed */
    if ((it = open_ok(s))) {
        loom_elem *e;
        loom_err err = {0};
        for (int i = 0; i < 3; i++) CHECK(loom_iter_next(it, &e, &err) == LOOM_OK);
        int level = loom_log_get_level();
        loom_log_set_level(LOOM_LOG_ERROR); /* the expected warning */
        CHECK(loom_iter_rewind(it, 1, &err) == LOOM_OK);
        loom_log_set_level(level);
        int64_t got[64];
        CHECK(eq(got, labels(it, got), e1, N));
        CHECK(loom_iter_rewind(it, 2, &err) == LOOM_OK);
        CHECK(eq(got, labels(it, got), e1, N));
        loom_iter_close(it);
    }
    free(s);
}

/* ---- cache (file) ----------------------------------------------------------------- */

/* A forked child reports through a file rather than its exit status, which
 * valgrind may replace (its leak check also runs in children). */
static void child_done(int ok)
{
    FILE *f = fopen(tpath("child.ok"), "w");
    if (f && ok) fputs("ok", f);
    if (f) fclose(f);
    _exit(0);
}

static int child_ok(pid_t pid)
{
    int status = 0;
    waitpid(pid, &status, 0);
    char buf[8] = "";
    FILE *f = fopen(tpath("child.ok"), "r");
    if (f) {
        if (!fgets(buf, sizeof buf, f)) buf[0] = 0;
        fclose(f);
    }
    unlink(tpath("child.ok"));
    return !strcmp(buf, "ok");
}

static int exists(const char *path) { return access(path, F_OK) == 0; }

static void rm_cache(const char *prefix)
{
    char p[600];
    const char *ext[] = {".data", ".index", ".lock"};
    for (int i = 0; i < 3; i++) {
        snprintf(p, sizeof p, "%s%s", prefix, ext[i]);
        unlink(p);
    }
}

static void test_cache_file(void)
{
    setup();
    char msg[1024];
    char prefix[512];
    snprintf(prefix, sizeof prefix, "%s", tpath("cache/sub/train"));
    char data[600], index[600], lock[600];
    snprintf(data, sizeof data, "%s.data", prefix);
    snprintf(index, sizeof index, "%s.index", prefix);
    snprintf(lock, sizeof lock, "%s.lock", prefix);
    loom_dataset_spec *s = spec_new();
    add_shuffle(s, 10, 3);
    add_cache(s, prefix);
    int64_t e0[64], got[64];
    loom_iter *it = open_ok(s);
    if (!it) return;
    CHECK(exists(lock) && !exists(index));
    /* a second writer, in this process or another, is refused while the first holds the lock */
    open_fail(s, msg, sizeof msg);
    CHECK_CONTAINS(msg, "test.cfg:21: data.train.transforms.[1]: cache: ");
    CHECK_CONTAINS(msg, "is being written by another iterator (process ");
    CHECK_CONTAINS(msg, "hint: let that run finish writing the cache");
    fflush(NULL); /* nothing buffered for a child to write twice */
    pid_t pid = fork();
    if (pid == 0) {
        loom_iter *x = NULL;
        loom_err err = {0};
        int rc = loom_data_open(&x, s, &ctx1, &err);
        child_done(rc == LOOM_EIO && strstr(err.msg, "is being written by another iterator"));
    }
    CHECK(child_ok(pid));
    /* the first pass writes; the files appear only at its end */
    loom_elem *e;
    loom_err err = {0};
    for (int i = 0; i < 5; i++) CHECK(loom_iter_next(it, &e, &err) == LOOM_OK);
    CHECK(!exists(index) && !exists(data));
    int rest = labels(it, got);
    CHECK(rest == N - 5);
    CHECK(exists(index) && exists(data) && !exists(lock));
    CHECK(loom_iter_rewind(it, 1, &err) == LOOM_OK);
    CHECK(labels(it, got) == N);
    loom_iter_close(it);
    /* the reference: epoch 0 of the shuffle */
    loom_dataset_spec *r = spec_new();
    add_shuffle(r, 10, 3);
    if ((it = open_ok(r))) {
        CHECK(labels(it, got) == N);
        loom_iter_close(it);
    }
    if ((it = open_ok(r))) {
        collect(it, "label", e0, 64, NULL, 0);
        loom_iter_close(it);
    }
    /* a new iterator replays the file (epoch 3 too), as does another process */
    if ((it = open_ok(s))) {
        CHECK(eq(got, labels(it, got), e0, N));
        CHECK(loom_iter_rewind(it, 3, &err) == LOOM_OK);
        CHECK(eq(got, labels(it, got), e0, N));
        loom_stage_stats st[4];
        CHECK(loom_iter_stats(it, st, 4) == 3 && st[1].elements == 0); /* the shuffle never ran */
        loom_iter_close(it);
    }
    fflush(NULL); /* nothing buffered for a child to write twice */
    pid = fork();
    if (pid == 0) {
        loom_iter *x = NULL;
        loom_err err2 = {0};
        int64_t v[64];
        int ok = loom_data_open(&x, s, &ctx1, &err2) == LOOM_OK;
        int n = 0;
        loom_elem *el;
        while (ok && loom_iter_next(x, &el, &err2) == LOOM_OK) v[n++] = (int64_t)loom_tensor_get(&el->t[1], 0);
        loom_iter_close(x);
        child_done(ok && eq(v, n, e0, N));
    }
    CHECK(child_ok(pid));
    /* a different pipeline (another shuffle seed) is refused, naming the files */
    s->transform[0].seed = 4;
    open_fail(s, msg, sizeof msg);
    CHECK_CONTAINS(msg, "test.cfg:21: data.train.transforms.[1]: cache: ");
    CHECK_CONTAINS(msg, "train.index was written by a different pipeline");
    CHECK_CONTAINS(msg, "hint: delete ");
    /* after deleting it, the new pipeline writes its own */
    rm_cache(prefix);
    if ((it = open_ok(s))) {
        CHECK(labels(it, got) == N);
        loom_iter_close(it);
    }
    CHECK(exists(index));
    /* a partial pass leaves no files behind */
    rm_cache(prefix);
    if ((it = open_ok(s))) {
        for (int i = 0; i < 3; i++) CHECK(loom_iter_next(it, &e, &err) == LOOM_OK);
        loom_iter_close(it);
    }
    CHECK(!exists(index) && !exists(data) && !exists(lock));
    char cmd[700];
    snprintf(cmd, sizeof cmd, "ls %s/cache/sub | grep -q tmp", tmpdir);
    CHECK(system(cmd) != 0);
    rm_cache(prefix);
    free(s);
    free(r);
}

/* ---- save / restore ------------------------------------------------------------------ */

static char restore_prefix[512];
static void remove_restore_cache(void) { rm_cache(restore_prefix); }

static void test_save_restore(void)
{
    setup();
    double v[] = {0, 2, 3, 5, 7, 8};
    loom_dataset_spec *s;

    s = spec_new(); /* filter + shard + enumerate after a shuffle */
    add_shuffle(s, 4, 11);
    add_filter(s, "label", LOOM_FILTER_NOT_IN, 2, v);
    loom_transform_spec *t = spec_add(s, LOOM_T_SHARD);
    t->num_shards = 2;
    t->index = 1;
    snprintf(spec_add(s, LOOM_T_ENUMERATE)->feature, LOOM_NAME_MAX, "index");
    check_restore(s, 3, 1, NULL);
    free(s);

    s = spec_new(); /* unbatch mid-element, after a shuffle of batches */
    add_batch(s, LOOM_T_BATCH, 3, false);
    add_shuffle(s, 2, 5);
    spec_add(s, LOOM_T_UNBATCH);
    check_restore(s, 3, 1, NULL);
    free(s);

    s = spec_new(); /* padded_batch of a var-length dim 0 */
    add_batch(s, LOOM_T_BATCH, 4, false);
    add_batch(s, LOOM_T_PADDED_BATCH, 2, false);
    check_restore(s, 2, 1, NULL);
    free(s);

    s = spec_new(); /* memory cache: restores during the fill and during replays */
    add_shuffle(s, 5, 9);
    add_filter(s, "label", LOOM_FILTER_IN, 6, v);
    add_cache(s, NULL);
    add_shuffle(s, 3, 2);
    check_restore(s, 3, 1, NULL);
    free(s);

    snprintf(restore_prefix, sizeof restore_prefix, "%s", tpath("rcache"));
    s = spec_new(); /* file cache: removed between save and restore (rebuilt) and kept (replayed) */
    add_shuffle(s, 5, 9);
    add_cache(s, restore_prefix);
    check_restore(s, 3, 2, remove_restore_cache);
    check_restore(s, 3, 2, NULL);
    rm_cache(restore_prefix);
    free(s);
}

/* ---- config ---------------------------------------------------------------------------- */

static const char *good_cfg =
    "version = 1;\n"
    "data: { train: {\n"
    "  source: { type = \"idx\"; features: { image = \"img.idx\"; label = \"lbl.idx\"; }; };\n"
    "  transforms = (\n"
    "    { op = \"filter\"; feature = \"label\"; in = [0, 1, 2]; },\n"
    "    { op = \"filter\"; feature = \"label\"; min = 1; },\n"
    "    { op = \"shard\"; num_shards = 2; index = 1; },\n"
    "    { op = \"enumerate\"; start = 3; },\n"
    "    { op = \"map\"; fn = \"cast\"; feature = \"image\"; dtype = \"float32\"; },\n"
    "    { op = \"cache\"; },\n"
    "    { op = \"cache\"; file = \"runs/cache/train\"; },\n"
    "    { op = \"padded_batch\"; size = 2; padded_shapes: { image = [5, -1]; }; padding_values: { label = 9; }; },\n"
    "    { op = \"unbatch\"; },\n"
    "    { op = \"split\"; fraction = 0.75; part = \"eval\"; seed = 5; },\n"
    "    { op = \"concat\"; features = [\"label\", \"image\"]; output = \"all\"; },\n"
    "    { op = \"select\"; features = [\"all\", \"label\"]; },\n"
    "    { op = \"map\"; fn = \"normalize\"; feature = \"all\"; mean = [1.0, 2.0, 3.0]; std = 2.0; }\n"
    "  );\n"
    "}; };\n"
    "model: { layers = ( { type = \"flatten\"; }, { type = \"dense\"; units = 3; } ); };\n"
    "optimizer: { type = \"sgd\"; learning_rate = 0.1; };\n"
    "run: { model_dir = \"runs/x\"; };\n";

static void test_config(void)
{
    setup();
    const char *path = tpath("good.cfg");
    FILE *f = fopen(path, "w");
    fputs(good_cfg, f);
    fclose(f);
    loom_spec *sp = NULL;
    loom_errlist errs;
    memset(&errs, 0, sizeof errs);
    int rc = loom_config_load(&sp, path, NULL, 0, &errs);
    CHECK_MSG(rc == LOOM_OK, "%s: %s", errs.n ? errs.e[0].where : "", errs.n ? errs.e[0].msg : "");
    if (rc) return;
    const loom_transform_spec *t = sp->train.transform;
    CHECK(sp->train.n_transforms == 13);
    CHECK(t[0].kind == LOOM_T_FILTER && t[0].filter == LOOM_FILTER_IN && t[0].n_values == 3 && t[0].values[2] == 2.0 &&
          !strcmp(t[0].feature, "label"));
    CHECK(t[1].filter == LOOM_FILTER_RANGE && t[1].min == 1.0 && isinf(t[1].max));
    CHECK(t[2].kind == LOOM_T_SHARD && t[2].num_shards == 2 && t[2].index == 1);
    CHECK(t[3].kind == LOOM_T_ENUMERATE && !strcmp(t[3].feature, "index") && t[3].start == 3);
    CHECK(t[4].kind == LOOM_T_MAP && !strcmp(t[4].map.feature, "image")); /* map's own `feature` still works */
    size_t cl = strlen(t[6].cache_file), sl = strlen("/runs/cache/train"); /* relative to the config's directory */
    CHECK(t[5].kind == LOOM_T_CACHE && !t[5].cache_file[0] && t[6].cache_file[0] == '/' && cl > sl &&
          !strcmp(t[6].cache_file + cl - sl, "/runs/cache/train"));
    CHECK(t[7].kind == LOOM_T_PADDED_BATCH && t[7].batch_size == 2 && t[7].padded.n_shapes == 1 && t[7].padded.rank[0] == 2 &&
          t[7].padded.shape[0][0] == 5 && t[7].padded.shape[0][1] == -1 && t[7].padded.n_values == 1 && t[7].padded.value[0] == 9.0);
    CHECK(t[8].kind == LOOM_T_UNBATCH);
    CHECK(t[9].kind == LOOM_T_SPLIT && t[9].fraction == 0.75 && t[9].part == LOOM_SPLIT_EVAL && t[9].seed == 5 &&
          t[9].seed_set);
    CHECK(t[10].kind == LOOM_T_CONCAT && t[10].features.n == 2 && !strcmp(t[10].features.name[1], "image") &&
          !strcmp(t[10].features.output, "all"));
    CHECK(t[11].kind == LOOM_T_SELECT && t[11].features.n == 2 && !strcmp(t[11].features.name[0], "all"));
    CHECK(t[12].map.kind == LOOM_MAP_NORMALIZE && t[12].map.n_norm == 3 && t[12].map.mean_v[2] == 3.0f &&
          t[12].map.std_v[0] == 2.0f && t[12].map.std_v[2] == 2.0f && !t[12].map.adapt);
    /* print, reload: the same transforms */
    const char *p2 = tpath("printed.cfg");
    f = fopen(p2, "w");
    loom_config_print(sp, f);
    fclose(f);
    loom_spec *sp2 = NULL;
    memset(&errs, 0, sizeof errs);
    rc = loom_config_load(&sp2, p2, NULL, 0, &errs);
    CHECK_MSG(rc == LOOM_OK, "%s: %s", errs.n ? errs.e[0].where : "", errs.n ? errs.e[0].msg : "");
    if (!rc) {
        for (int i = 0; i < 13; i++) {
            const loom_transform_spec *a = &sp->train.transform[i], *b = &sp2->train.transform[i];
            /* map, features and padded share their bytes: each is compared for its kinds */
            bool feats = a->kind == LOOM_T_CONCAT || a->kind == LOOM_T_SELECT, map = a->kind == LOOM_T_MAP;
            bool padded = a->kind == LOOM_T_PADDED_BATCH;
            CHECK_MSG(a->fraction == b->fraction && a->part == b->part &&
                      (!feats || (a->features.n == b->features.n &&
                                  !memcmp(a->features.name, b->features.name, sizeof a->features.name) &&
                                  !strcmp(a->features.output, b->features.output))) &&
                      (!map || (a->map.n_norm == b->map.n_norm && !memcmp(a->map.mean_v, b->map.mean_v, sizeof a->map.mean_v) &&
                                !memcmp(a->map.std_v, b->map.std_v, sizeof a->map.std_v))),
                      "transform %d's new settings differ after print and reload", i);
            CHECK_MSG(a->kind == b->kind && a->filter == b->filter && a->n_values == b->n_values &&
                      !memcmp(a->values, b->values, sizeof a->values) && a->min == b->min && a->max == b->max &&
                      a->num_shards == b->num_shards && a->index == b->index && a->start == b->start &&
                      !strcmp(a->feature, b->feature) && !strcmp(a->cache_file, b->cache_file) &&
                      (!padded || (a->padded.n_shapes == b->padded.n_shapes &&
                                   !memcmp(a->padded.shape, b->padded.shape, sizeof a->padded.shape) &&
                                   a->padded.n_values == b->padded.n_values &&
                                   !memcmp(a->padded.value, b->padded.value, sizeof a->padded.value))),
                      "transform %d differs after print and reload", i);
        }
    }
    loom_config_free(sp);
    loom_config_free(sp2);
}

static void test_cleanup(void) { tmpdir_remove(); }

static const loom_test tests[] = {
    {"filter", test_filter},
    {"shard", test_shard},
    {"enumerate", test_enumerate},
    {"concat_select", test_concat_select},
    {"split", test_split},
    {"unbatch", test_unbatch},
    {"padded_batch", test_padded_batch},
    {"cache_memory", test_cache_memory},
    {"cache_file", test_cache_file},
    {"save_restore", test_save_restore},
    {"config", test_config},
    {"cleanup", test_cleanup},
    {NULL, NULL},
};

int main(void) { return loom_test_run(tests); }
