/* test_interleave.c - list_files, interleave and zip beyond the orders of
 * test_tf_order.c: list_files shuffling (per epoch, by seed, a permutation),
 * exact save/restore at every point of an epoch (sequential and parallel
 * interleave, with zip), parallel deterministic = false yielding the same
 * multiset, the parallelism in the stage stats, errors (interleave without
 * list_files, features that do not match a file, a zip name clash, a file
 * deleted after open), text files interleaved line by line, and the config grammar (tests/configs/good_interleave.cfg
 * loads, runs and round-trips through loom_config_print; bad_interleave.cfg
 * is checked by test_config). Fixtures: tests/fixtures/tf/order. */
#include "harness.h"
#include "data/data_internal.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char root[512], fixdir[600];

static const char *fpath(const char *name)
{
    static char buf[4][700];
    static int k;
    char *p = buf[k++ % 4];
    snprintf(p, 700, "%s/%s", fixdir, name);
    return p;
}

static void loc(loom_loc *l, const char *path, int line)
{
    snprintf(l->file, sizeof l->file, "ilv.cfg");
    l->line = line;
    snprintf(l->path, sizeof l->path, "%s", path);
}

static void id_source(loom_source_spec *s, const char *feat)
{
    memset(s, 0, sizeof *s);
    s->kind = LOOM_SRC_TFRECORD;
    loc(&s->loc, "data.train.transforms.[0].source", 5);
    s->n_features = 1;
    snprintf(s->feature[0], LOOM_NAME_MAX, "%s", feat);
    s->tfrecord.features[0].dtype = LOOM_TFR_INT64;
}

/* list_files(part-*, shuffle) | interleave(cycle, block, parallel, det) over "id". */
static loom_dataset_spec *ilv_spec(bool shuffle, int cycle, int block, int parallel, bool det, loom_source_spec *nested)
{
    loom_dataset_spec *d = calloc(1, sizeof *d);
    d->present = true;
    d->source.kind = LOOM_SRC_LIST_FILES;
    loc(&d->source.loc, "data.train.source", 2);
    d->source.n_patterns = 1;
    snprintf(d->source.pattern[0], LOOM_PATH_MAX, "%s", fpath("part-*.tfrecord"));
    d->source.shuffle_files = shuffle;
    d->source.list_files.seed = 11;
    id_source(nested, "id");
    loom_transform_spec *t = &d->transform[d->n_transforms++];
    t->kind = LOOM_T_INTERLEAVE;
    loc(&t->loc, "data.train.transforms.[0]", 4);
    t->cycle_length = cycle;
    t->block_length = block;
    t->parallel = parallel;
    t->deterministic = det;
    t->source = nested;
    return d;
}

static loom_iter *open_ok(const loom_dataset_spec *d, int threads)
{
    loom_data_ctx ctx = {.seed = 5, .threads = threads, .name = "ilv"};
    loom_iter *it = NULL;
    loom_err err = {0};
    int rc = loom_data_open(&it, d, &ctx, &err);
    CHECK_MSG(rc == LOOM_OK, "%s: %s (%s)", err.where, err.msg, err.hint);
    return it;
}

/* Up to max elements' first feature (int64 or a file name's hash) into out; returns how many. */
static int pull(loom_iter *it, int64_t *out, int max)
{
    loom_err err = {0};
    loom_elem *e;
    int n = 0, rc;
    while (n < max && (rc = loom_iter_next(it, &e, &err)) == LOOM_OK) {
        int64_t v = 0;
        if (e->t[0].dtype == LOOM_U8) {
            uint64_t h = 0;
            for (const char *p = e->t[0].data; *p; p++) h = h * 31 + (uint8_t)*p;
            v = (int64_t)(h >> 1);
        } else
            v = *(int64_t *)e->t[0].data;
        if (e->n > 1 && e->t[1].dtype == LOOM_I64 && e->t[0].dtype == LOOM_I64) v = v * 1000 + ((int64_t *)e->t[1].data)[1];
        out[n++] = v;
    }
    if (n < max) CHECK_MSG(rc == LOOM_EEOF, "%s: %s", err.where, err.msg);
    return n;
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* ---- list_files -------------------------------------------------------------- */

static void test_list_files_shuffle(void)
{
    loom_dataset_spec *d = calloc(1, sizeof *d);
    d->source.kind = LOOM_SRC_LIST_FILES;
    d->source.n_patterns = 1;
    snprintf(d->source.pattern[0], LOOM_PATH_MAX, "%s", fpath("*.tfrecord"));
    d->source.shuffle_files = true;
    d->source.list_files.seed = 3;
    loom_iter *a = open_ok(d, 0), *b = open_ok(d, 0);
    if (!a || !b) goto out;
    CHECK(loom_iter_cardinality(a) == 10);
    int64_t e0[16], e1[16], again[16], sorted0[16], sorted1[16];
    loom_err err = {0};
    CHECK(pull(a, e0, 16) == 10);
    CHECK(loom_iter_rewind(a, 1, &err) == LOOM_OK);
    CHECK(pull(a, e1, 16) == 10);
    CHECK(loom_iter_rewind(b, 1, &err) == LOOM_OK);
    CHECK(pull(b, again, 16) == 10);
    CHECK_MSG(memcmp(e0, e1, sizeof e0[0] * 10) != 0, "epochs 0 and 1 give the same order");
    CHECK_MSG(!memcmp(e1, again, sizeof e1[0] * 10), "epoch 1 differs between two iterators of one seed");
    memcpy(sorted0, e0, sizeof sorted0);
    memcpy(sorted1, e1, sizeof sorted1);
    qsort(sorted0, 10, sizeof sorted0[0], cmp_i64);
    qsort(sorted1, 10, sizeof sorted1[0], cmp_i64);
    CHECK_MSG(!memcmp(sorted0, sorted1, sizeof sorted0[0] * 10), "the epochs are not permutations of one list");
    loom_stage_stats st;
    CHECK(loom_iter_stats(a, &st, 1) == 1 && !strcmp(st.name, "list_files") && st.elements == 20);
out:
    loom_iter_close(a);
    loom_iter_close(b);
    free(d);
}

/* ---- save / restore -------------------------------------------------------------- */

/* Saving after every k elements of epoch 1 and restoring into a fresh iterator
 * continues with exactly the rest of the uninterrupted epoch. */
static void check_resume(const loom_dataset_spec *d, int threads, const char *what)
{
    loom_iter *ref = open_ok(d, threads);
    if (!ref) return;
    loom_err err = {0};
    int64_t want[64], got[64];
    CHECK(loom_iter_rewind(ref, 1, &err) == LOOM_OK);
    int n = pull(ref, want, 64);
    CHECK_MSG(n == 16, "%s: %d elements", what, n);
    loom_iter_close(ref);
    for (int k = 0; k <= n; k++) {
        loom_iter *a = open_ok(d, threads), *b = open_ok(d, threads);
        if (!a || !b) {
            loom_iter_close(a);
            loom_iter_close(b);
            return;
        }
        CHECK(loom_iter_rewind(a, 1, &err) == LOOM_OK);
        int m = pull(a, got, k);
        loom_buf buf, rd;
        loom_buf_init(&buf);
        CHECK_MSG(loom_iter_save(a, &buf, &err) == LOOM_OK, "%s", err.msg);
        loom_buf_wrap(&rd, buf.data, buf.len);
        int rc = loom_iter_restore(b, &rd, &err);
        CHECK_MSG(rc == LOOM_OK, "%s at %d: %s: %s", what, k, err.where, err.msg);
        m += pull(b, got + m, 64 - m);
        CHECK_MSG(m == n && !memcmp(got, want, (size_t)n * sizeof got[0]), "%s: resume after %d differs", what, k);
        loom_buf_fini(&buf);
        loom_iter_close(a);
        loom_iter_close(b);
    }
}

static void test_resume(void)
{
    loom_source_spec nested;
    loom_dataset_spec *d = ilv_spec(true, 3, 2, 1, true, &nested);
    check_resume(d, 1, "sequential");
    d->transform[0].parallel = 3;
    check_resume(d, 2, "parallel");
    d->transform[0].parallel = LOOM_PARALLEL_AUTO;
    check_resume(d, 2, "parallel auto");
    /* zipped with a shuffled dataset of its own: both sides resume */
    loom_dataset_spec *other = calloc(1, sizeof *other);
    other->source.kind = LOOM_SRC_TFRECORD;
    loc(&other->source.loc, "data.train.transforms.[1].dataset.source", 9);
    other->source.n_patterns = 1;
    snprintf(other->source.pattern[0], LOOM_PATH_MAX, "%s", fpath("ids.tfrecord"));
    other->source.n_features = 1;
    snprintf(other->source.feature[0], LOOM_NAME_MAX, "pair");
    other->source.tfrecord.features[0] = (loom_tfr_feature){.dtype = LOOM_TFR_INT64, .rank = 1, .shape = {2}};
    other->source.tfrecord.features[0].shape[0] = 2;
    other->n_transforms = 2;
    other->transform[0] = (loom_transform_spec){.kind = LOOM_T_REPEAT, .count = -1};
    other->transform[1] = (loom_transform_spec){.kind = LOOM_T_SHUFFLE, .buffer = 5, .seed = 9, .reshuffle = true};
    loom_transform_spec *z = &d->transform[d->n_transforms++];
    memset(z, 0, sizeof *z);
    z->kind = LOOM_T_ZIP;
    z->dataset = other;
    check_resume(d, 2, "interleave + zip");
    free(other);
    free(d);
}

/* ---- parallel ------------------------------------------------------------------------ */

static void test_parallel(void)
{
    loom_source_spec nested;
    loom_dataset_spec *d = ilv_spec(false, 4, 1, 1, true, &nested);
    loom_iter *it = open_ok(d, 2);
    int64_t seq[32], got[32];
    int n = it ? pull(it, seq, 32) : 0;
    CHECK(n == 16);
    loom_iter_close(it);
    d->transform[0].parallel = 4;
    d->transform[0].deterministic = false;
    for (int rep = 0; rep < 5; rep++) {
        it = open_ok(d, 2);
        if (!it) break;
        int m = pull(it, got, 32);
        loom_stage_stats st[2];
        CHECK(loom_iter_stats(it, st, 2) == 2 && st[1].parallel == 4 && !strcmp(st[1].name, "interleave(tfrecord)"));
        loom_iter_close(it);
        qsort(got, (size_t)m, sizeof got[0], cmp_i64);
        int64_t s2[32];
        memcpy(s2, seq, sizeof s2);
        qsort(s2, (size_t)n, sizeof s2[0], cmp_i64);
        CHECK_MSG(m == n && !memcmp(got, s2, (size_t)n * sizeof got[0]), "deterministic = false lost or repeated elements");
    }
    /* a sequential interleave reports no parallelism, a cardinality unknown */
    d->transform[0].parallel = 1;
    it = open_ok(d, 2);
    if (it) {
        loom_stage_stats st[2];
        CHECK(loom_iter_stats(it, st, 2) == 2 && st[1].parallel == 0);
        CHECK(loom_iter_cardinality(it) == -2);
    }
    loom_iter_close(it);
    free(d);
}

/* ---- errors --------------------------------------------------------------------------- */

static const char *open_fail(const loom_dataset_spec *d, int threads)
{
    static char text[1200];
    loom_data_ctx ctx = {.seed = 5, .threads = threads, .name = "ilv"};
    loom_iter *it = NULL;
    loom_err err = {0};
    int rc = loom_data_open(&it, d, &ctx, &err);
    CHECK(rc != LOOM_OK && it == NULL);
    snprintf(text, sizeof text, "%s: %s\n  hint: %s", err.where, err.msg, err.hint);
    return text;
}

static void test_errors(void)
{
    loom_source_spec nested;
    /* the input must be a list_files source: a uint8 "filename" of another source is refused */
    loom_dataset_spec *d = ilv_spec(false, 2, 1, 1, true, &nested);
    d->source.kind = LOOM_SRC_SYNTHETIC;
    d->source.synthetic.count = 3;
    d->source.n_features = 1;
    snprintf(d->source.feature[0], LOOM_NAME_MAX, "filename");
    d->source.synthetic.features[0] = (loom_syn_feature){.dtype = LOOM_CFG_U8, .rank = 1, .shape = {4}, .max = 100};
    CHECK_CONTAINS(open_fail(d, 1), "ilv.cfg:4: data.train.transforms.[0]: interleave reads the file names of a "
                                    "list_files source, and this pipeline's source is \"synthetic\"");
    /* and names of files: an input without "filename" */
    d->source.kind = LOOM_SRC_LIST_FILES;
    d->transform[1] = d->transform[0];
    memset(&d->transform[0], 0, sizeof d->transform[0]);
    d->transform[0].kind = LOOM_T_BATCH;
    d->transform[0].batch_size = 2;
    d->n_transforms = 2;
    CHECK_CONTAINS(open_fail(d, 1), "interleave needs file names as input (\"filename\" uint8 (n)), got filename: uint8 (2, 512)");

    free(d);
    /* features the files do not have: the first file is probed at open */
    d = ilv_spec(false, 2, 1, 2, true, &nested);
    snprintf(nested.feature[0], LOOM_NAME_MAX, "nope");
    const char *t = open_fail(d, 1);
    CHECK_CONTAINS(t, "part-B.tfrecord: record 0");
    CHECK_CONTAINS(t, "nope");
    free(d);
    /* zip: a feature on both sides */
    d = ilv_spec(false, 2, 1, 1, true, &nested);
    loom_dataset_spec *other = calloc(1, sizeof *other);
    other->source.kind = LOOM_SRC_TFRECORD;
    other->source.n_patterns = 1;
    snprintf(other->source.pattern[0], LOOM_PATH_MAX, "%s", fpath("ids.tfrecord"));
    other->source.n_features = 1;
    snprintf(other->source.feature[0], LOOM_NAME_MAX, "id");
    other->source.tfrecord.features[0].dtype = LOOM_TFR_INT64;
    loom_transform_spec *z = &d->transform[d->n_transforms++];
    z->kind = LOOM_T_ZIP;
    loc(&z->loc, "data.train.transforms.[1]", 8);
    z->dataset = other;
    CHECK_CONTAINS(open_fail(d, 1), "ilv.cfg:8: data.train.transforms.[1]: feature \"id\" is in both the pipeline "
                                    "zipped into (id: int64 ()) and the zipped dataset (id: int64 ())");
    free(other);
    free(d);
    /* a file deleted after open: the read names it, and the interleave goes on with the others */
    char dir[] = "/tmp/loom_ilv_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char a[600], b[600], cmd[1400];
    snprintf(a, sizeof a, "%s/a.tfrecord", dir);
    snprintf(b, sizeof b, "%s/b.tfrecord", dir);
    snprintf(cmd, sizeof cmd, "cp '%s' '%s' && cp '%s' '%s'", fpath("part-a.tfrecord"), a, fpath("part-c10.tfrecord"), b);
    CHECK(system(cmd) == 0);
    d = ilv_spec(false, 1, 1, 2, true, &nested);
    snprintf(d->source.pattern[0], LOOM_PATH_MAX, "%s/*.tfrecord", dir);
    loom_iter *it = open_ok(d, 1);
    unlink(b);
    if (it) {
        int64_t got[16];
        CHECK(pull(it, got, 5) == 5);
        loom_err err = {0};
        loom_elem *e;
        int rc = loom_iter_next(it, &e, &err);
        CHECK(rc == LOOM_EIO);
        CHECK_CONTAINS(err.msg, "b.tfrecord");
        CHECK(loom_iter_next(it, &e, &err) == LOOM_EEOF);
    }
    loom_iter_close(it);
    free(d);
    unlink(a);
    rmdir(dir);
}

/* Text files interleaved line by line, in parallel: "line" and "length" as the text source gives them. */
static void test_text(void)
{
    char dir[] = "/tmp/loom_ilv_text_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char a[600], b[600];
    snprintf(a, sizeof a, "%s/a.txt", dir);
    snprintf(b, sizeof b, "%s/b.txt", dir);
    FILE *f = fopen(a, "w");
    if (f) fputs("a1\na2\na3\n", f), fclose(f);
    f = fopen(b, "w");
    if (f) fputs("b1\r\nb22\n", f), fclose(f);
    loom_source_spec nested;
    loom_dataset_spec *d = ilv_spec(false, 2, 1, 2, true, &nested);
    snprintf(d->source.pattern[0], LOOM_PATH_MAX, "%s/*.txt", dir);
    memset(&nested, 0, sizeof nested);
    nested.kind = LOOM_SRC_TEXT;
    nested.text.max_length = 8;
    loom_iter *it = open_ok(d, 2);
    if (it) {
        char got[64] = "";
        loom_err err = {0};
        loom_elem *e;
        while (loom_iter_next(it, &e, &err) == LOOM_OK) {
            size_t k = strlen(got);
            snprintf(got + k, sizeof got - k, "%s%.*s", k ? " " : "", (int)*(int64_t *)e->t[1].data, (char *)e->t[0].data);
        }
        CHECK_MSG(!strcmp(got, "a1 b1 a2 b22 a3"), "got \"%s\"", got);
    }
    loom_iter_close(it);
    free(d);
    unlink(a);
    unlink(b);
    rmdir(dir);
}

/* ---- config ------------------------------------------------------------------------------- */

static void test_config(void)
{
    char path[700], printed[2][700];
    snprintf(path, sizeof path, "%s/tests/configs/good_interleave.cfg", root);
    loom_spec *s = NULL;
    loom_errlist errs = {0};
    int rc = loom_config_load(&s, path, NULL, 0, &errs);
    CHECK_MSG(rc == LOOM_OK, "%s: %s", errs.n ? errs.e[0].where : "", errs.n ? errs.e[0].msg : "");
    if (rc) return;
    const loom_transform_spec *t = &s->train.transform[0];
    CHECK(s->train.source.kind == LOOM_SRC_LIST_FILES && s->train.source.shuffle_files &&
          s->train.source.list_files.seed == 7);
    CHECK(s->eval.source.kind == LOOM_SRC_LIST_FILES && !s->eval.source.shuffle_files &&
          s->eval.source.list_files.seed == 42);
    CHECK(t->kind == LOOM_T_INTERLEAVE && t->cycle_length == 2 && t->block_length == 2 &&
          t->parallel == LOOM_PARALLEL_AUTO && !t->deterministic && t->source && t->source->n_patterns == 0);
    CHECK(s->eval.transform[0].block_length == 4 && s->eval.transform[0].parallel == 1 && s->eval.transform[0].deterministic);
    const loom_transform_spec *z = &s->train.transform[1];
    CHECK(z->kind == LOOM_T_ZIP && z->dataset && z->dataset->n_transforms == 1 &&
          z->dataset->transform[0].seed == 42);
    /* it runs: batches of (id, pair) */
    loom_iter *it = open_ok(&s->train, 2);
    if (it) {
        int64_t got[16];
        CHECK(pull(it, got, 16) == 5); /* 10 pairs zipped with 16 ids, in batches of 2 */
        loom_iter_close(it);
    }
    for (int k = 0; k < 2; k++) {
        snprintf(printed[k], sizeof printed[k], "%s/tests/configs/.printed_interleave_%d_%d.cfg", root, k, (int)getpid());
        FILE *f = fopen(printed[k], "w");
        CHECK(f != NULL);
        if (!f) break;
        loom_config_print(s, f);
        fclose(f);
        loom_config_free(s);
        s = NULL;
        rc = loom_config_load(&s, printed[k], NULL, 0, &errs);
        CHECK_MSG(rc == LOOM_OK, "printed config: %s: %s", errs.n ? errs.e[0].where : "", errs.n ? errs.e[0].msg : "");
        if (rc) break;
    }
    if (s) {
        FILE *a = fopen(printed[0], "r"), *b = fopen(printed[1], "r");
        char la[1024], lb[1024];
        int same = a && b;
        while (same && fgets(la, sizeof la, a)) /* the header comment names the file printed */
            same = fgets(lb, sizeof lb, b) && (la[0] == '#' || !strcmp(la, lb));
        CHECK_MSG(same, "printing the printed config gives a different text");
        if (a) fclose(a);
        if (b) fclose(b);
        CHECK(s->train.transform[1].dataset && s->train.transform[0].source &&
              s->train.transform[0].source->kind == LOOM_SRC_TFRECORD);
    }
    loom_config_free(s);
    unlink(printed[0]);
    unlink(printed[1]);
}

static void setup(void)
{
    const char *r = getenv("LOOM_SOURCE_ROOT");
    snprintf(root, sizeof root, "%s", r ? r : ".");
    snprintf(fixdir, sizeof fixdir, "%s/tests/fixtures/tf/order", root);
}

static const loom_test tests[] = {
    {"list_files_shuffle", test_list_files_shuffle},
    {"resume", test_resume},
    {"parallel", test_parallel},
    {"errors", test_errors},
    {"text", test_text},
    {"config", test_config},
    {0},
};

int main(void)
{
    setup();
    return loom_test_run(tests);
}
