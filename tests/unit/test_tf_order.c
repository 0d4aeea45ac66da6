/* test_tf_order.c - Loom's element order against real tf.data: each case of
 * tests/fixtures/tf/order/expected.txt (written by make_tf_order_fixtures.py
 * with TensorFlow) is built as a Loom pipeline over the same TFRecord files
 * and its elements printed the same way, "f1;f2" per element with each
 * feature's values row-major, then compared as one line: list_files order,
 * the interleave doc example, interleave over files (sequential and parallel,
 * deterministic), zip, batch, padded_batch, unbatch, filter, shard,
 * enumerate, skip/take/repeat and cache. TensorFlow is not needed here. */
#include "harness.h"
#include "data/data_internal.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static char fixdir[512];

static const char *fpath(const char *name)
{
    static char buf[4][600];
    static int k;
    char *p = buf[k++ % 4];
    snprintf(p, 600, "%s/%s", fixdir, name);
    return p;
}

/* The expected elements of case name (the text after "name [features] "), or NULL. */
static char *expected(const char *name)
{
    FILE *f = fopen(fpath("expected.txt"), "r");
    CHECK_MSG(f != NULL, "cannot read %s", fpath("expected.txt"));
    if (!f) return NULL;
    static char line[8192];
    char *found = NULL;
    size_t nl = strlen(name);
    while (!found && fgets(line, sizeof line, f)) {
        if (strncmp(line, name, nl) || line[nl] != ' ') continue;
        char *p = strstr(line, "] ");
        if (!p) continue;
        found = p + 2;
        found[strcspn(found, "\n")] = 0;
    }
    fclose(f);
    CHECK_MSG(found != NULL, "no case %s in expected.txt", name);
    return found;
}

/* ---- specs ------------------------------------------------------------------ */

static void loc(loom_loc *l, const char *path, int line)
{
    snprintf(l->file, sizeof l->file, "order.cfg");
    l->line = line;
    snprintf(l->path, sizeof l->path, "%s", path);
}

/* A tfrecord source (without files when pattern is NULL) of int64 features: "id" or "v" scalars, "pair" (2). */
static void tfr_source(loom_source_spec *s, const char *pattern, const char *const *feats)
{
    memset(s, 0, sizeof *s);
    s->kind = LOOM_SRC_TFRECORD;
    loc(&s->loc, "data.train.source", 2);
    if (pattern) {
        s->n_patterns = 1;
        snprintf(s->pattern[0], LOOM_PATH_MAX, "%s", fpath(pattern));
    }
    for (int i = 0; feats[i]; i++) {
        snprintf(s->feature[i], LOOM_NAME_MAX, "%s", feats[i]);
        s->tfrecord.features[i].dtype = LOOM_TFR_INT64;
        if (!strcmp(feats[i], "pair")) {
            s->tfrecord.features[i].rank = 1;
            s->tfrecord.features[i].shape[0] = 2;
        }
        s->n_features++;
    }
}

static loom_dataset_spec *ids_spec(void)
{
    static const char *const f[] = {"id", "pair", NULL};
    loom_dataset_spec *d = calloc(1, sizeof *d);
    d->present = true;
    tfr_source(&d->source, "ids.tfrecord", f);
    return d;
}

static loom_transform_spec *add(loom_dataset_spec *d, loom_transform_kind kind)
{
    loom_transform_spec *t = &d->transform[d->n_transforms++];
    t->kind = kind;
    loc(&t->loc, "data.train.transforms", 10 + d->n_transforms);
    t->count = -1;
    t->parallel = 1;
    t->deterministic = true;
    return t;
}

/* list_files(pattern, shuffle = false) interleaved over tfrecord files of feature feat. */
static loom_dataset_spec *interleave_spec(const char *pattern, const char *feat, int cycle, int block, int parallel,
                                          loom_source_spec *nested)
{
    const char *const f[] = {feat, NULL};
    loom_dataset_spec *d = calloc(1, sizeof *d);
    d->present = true;
    d->source.kind = LOOM_SRC_LIST_FILES;
    loc(&d->source.loc, "data.train.source", 2);
    d->source.n_patterns = 1;
    snprintf(d->source.pattern[0], LOOM_PATH_MAX, "%s", fpath(pattern));
    tfr_source(nested, NULL, f);
    loom_transform_spec *t = add(d, LOOM_T_INTERLEAVE);
    t->cycle_length = cycle;
    t->block_length = block;
    t->parallel = parallel;
    t->source = nested;
    return d;
}

/* ---- printing ----------------------------------------------------------------- */

/* Every element of one pass as the fixture prints it: features names[] of each. */
static void run(const char *name, const loom_dataset_spec *d, const char *const *names, int threads)
{
    const char *want = expected(name);
    loom_data_ctx ctx = {.seed = 42, .threads = threads, .name = "order"};
    loom_iter *it = NULL;
    loom_err err = {0};
    int rc = loom_data_open(&it, d, &ctx, &err);
    CHECK_MSG(rc == LOOM_OK, "%s: %s: %s", name, err.where, err.msg);
    if (rc || !want) {
        loom_iter_close(it);
        return;
    }
    static char got[8192];
    size_t k = 0;
    got[0] = 0;
    const loom_elem_spec *sp = loom_iter_spec(it);
    loom_elem *e;
    while ((rc = loom_iter_next(it, &e, &err)) == LOOM_OK && k < sizeof got - 512) {
        if (k) got[k++] = ' ';
        for (int j = 0; names[j]; j++) {
            int f = loom_elem_spec_find(sp, names[j]);
            CHECK_MSG(f >= 0, "%s: no feature %s", name, names[j]);
            if (f < 0) break;
            const loom_tensor *t = &e->t[f];
            if (j) got[k++] = ';';
            if (t->dtype == LOOM_U8) { /* a file name: its base name */
                const char *s = t->data, *slash = strrchr(s, '/');
                k += (size_t)snprintf(got + k, sizeof got - k, "%s", slash ? slash + 1 : s);
                continue;
            }
            int64_t n = loom_shape_numel(&t->shape);
            for (int64_t i = 0; i < n; i++)
                k += (size_t)snprintf(got + k, sizeof got - k, "%s%lld", i ? "," : "", (long long)((int64_t *)t->data)[i]);
        }
    }
    CHECK_MSG(rc == LOOM_EEOF, "%s: %s: %s", name, err.where, err.msg);
    CHECK_MSG(!strcmp(got, want), "%s:\n#   loom: %s\n#   tf:   %s", name, got, want);
    loom_iter_close(it);
}

static const char *const ID[] = {"id", NULL}, *const V[] = {"v", NULL}, *const ID_PAIR[] = {"id", "pair", NULL};

/* ---- cases ---------------------------------------------------------------------- */

static void test_list_files(void)
{
    loom_dataset_spec *d = calloc(1, sizeof *d);
    d->source.kind = LOOM_SRC_LIST_FILES;
    loc(&d->source.loc, "data.train.source", 2);
    d->source.n_patterns = 1;
    snprintf(d->source.pattern[0], LOOM_PATH_MAX, "%s", fpath("part-*.tfrecord"));
    static const char *const names[] = {"filename", NULL};
    run("list_files", d, names, 1);
    free(d);
}

/* 1111 2222 11 22 3333 4444 33 44 5555 55: sequential, and parallel with 1 and 2 workers. */
static void test_doc_example(void)
{
    loom_source_spec nested;
    for (int par = 1; par <= 2; par++)
        for (int threads = 1; threads <= 2; threads++) {
            loom_dataset_spec *d = interleave_spec("doc-*.tfrecord", "v", 2, 4, par, &nested);
            run("doc_range", d, V, threads);
            run("doc_files", d, V, threads);
            free(d);
        }
}

static void test_interleave_files(void)
{
    static const struct { const char *name; int c, b, par; } cases[] = {
        {"interleave_c1_b1", 1, 1, 1}, {"interleave_c2_b1", 2, 1, 1}, {"interleave_c3_b4", 3, 4, 1},
        {"interleave_c2_b4", 2, 4, 1}, {"interleave_c4_b2", 4, 2, 1}, {"interleave_c3_b2_par", 3, 2, 3},
        /* parallel deterministic gives the sequential order */
        {"interleave_c2_b1", 2, 1, 2}, {"interleave_c3_b4", 3, 4, 3}, {"interleave_c4_b2", 4, 2, LOOM_PARALLEL_AUTO},
        {"interleave_c3_b2_par", 3, 2, 1},
    };
    loom_source_spec nested;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        loom_dataset_spec *d = interleave_spec("part-*.tfrecord", "id", cases[i].c, cases[i].b, cases[i].par, &nested);
        run(cases[i].name, d, ID, 2);
        free(d);
    }
}

static void test_zip(void)
{
    static const char *const v[] = {"v", NULL}, *const names[] = {"id", "pair", "v", NULL};
    loom_dataset_spec *d = ids_spec(), *other = calloc(1, sizeof *other);
    other->present = true;
    tfr_source(&other->source, "doc-3.tfrecord", v);
    add(d, LOOM_T_ZIP)->dataset = other;
    run("zip", d, names, 1);
    free(other);
    free(d);
}

static void test_batching(void)
{
    loom_dataset_spec *d = ids_spec();
    add(d, LOOM_T_BATCH)->batch_size = 3;
    run("batch_3", d, ID_PAIR, 1);
    d->transform[0].drop_remainder = true;
    run("batch_3_drop", d, ID_PAIR, 1);
    free(d);

    d = ids_spec();
    loom_transform_spec *t = add(d, LOOM_T_PADDED_BATCH);
    t->batch_size = 4;
    t->padded.n_shapes = 1;
    snprintf(t->padded.shape_name[0], LOOM_NAME_MAX, "pair");
    t->padded.rank[0] = 1;
    t->padded.shape[0][0] = 3;
    t->padded.n_values = 1;
    snprintf(t->padded.value_name[0], LOOM_NAME_MAX, "pair");
    t->padded.value[0] = -1;
    run("padded_batch_4", d, ID_PAIR, 1);
    free(d);

    d = ids_spec();
    add(d, LOOM_T_BATCH)->batch_size = 4;
    add(d, LOOM_T_UNBATCH);
    run("unbatch", d, ID_PAIR, 1);
    free(d);
}

static void test_selection(void)
{
    loom_dataset_spec *d = ids_spec();
    loom_transform_spec *t = add(d, LOOM_T_FILTER);
    snprintf(t->feature, LOOM_NAME_MAX, "id");
    t->filter = LOOM_FILTER_RANGE;
    t->min = 2;
    t->max = 6;
    run("filter", d, ID, 1);
    free(d);

    d = ids_spec();
    t = add(d, LOOM_T_SHARD);
    t->num_shards = 3;
    t->index = 1;
    run("shard_3_1", d, ID, 1);
    free(d);

    d = ids_spec();
    t = add(d, LOOM_T_ENUMERATE);
    snprintf(t->feature, LOOM_NAME_MAX, "index");
    t->start = 5;
    static const char *const ei[] = {"id", "index", NULL};
    run("enumerate_5", d, ei, 1);
    free(d);

    d = ids_spec();
    add(d, LOOM_T_SKIP)->count = 2;
    add(d, LOOM_T_TAKE)->count = 5;
    add(d, LOOM_T_REPEAT)->count = 2;
    run("skip_take_repeat", d, ID, 1);
    free(d);

    d = ids_spec();
    add(d, LOOM_T_TAKE)->count = -1;
    add(d, LOOM_T_SKIP)->count = 0;
    run("take_all_skip_none", d, ID, 1);
    free(d);

    d = ids_spec();
    add(d, LOOM_T_CACHE);
    add(d, LOOM_T_REPEAT)->count = 2;
    run("cache_repeat", d, ID, 1);
    free(d);
}

static void setup(void)
{
    const char *root = getenv("LOOM_SOURCE_ROOT");
    snprintf(fixdir, sizeof fixdir, "%s/tests/fixtures/tf/order", root ? root : ".");
}

static const loom_test tests[] = {
    {"list_files", test_list_files},
    {"doc_example", test_doc_example},
    {"interleave_files", test_interleave_files},
    {"zip", test_zip},
    {"batching", test_batching},
    {"selection", test_selection},
    {0},
};

int main(void)
{
    setup();
    return loom_test_run(tests);
}
