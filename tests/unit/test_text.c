/* test_text.c - issue 24's input pipeline against tf.data's documented
 * behaviour: window (the Dataset.window docstring's examples on range(7)),
 * lm_pairs, padded_batch's mask, bucket_by_sequence_length (tf's bucketing
 * rule and end-of-input flush), tokenize (bytes, code points, words through a
 * vocabulary file with Keras' standardize, output_sequence_length), the text
 * source's records and file_feature, the bad inputs (invalid UTF-8, a vocabulary with a
 * duplicate or an empty line, a window larger than the data), and exact
 * save/restore at every cut through each of them. Fixtures are written to a
 * temporary directory at run time. */
#include "harness.h"
#include "test_util.h"
#include "data/data.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static const loom_data_ctx ctx1 = {.seed = 42, .threads = 0, .name = "train"};

static void write_file(const char *path, const char *text, size_t n)
{
    FILE *f = fopen(path, "wb");
    fwrite(text, 1, n, f);
    fclose(f);
}

/* range(n) as an IDX source of scalar uint8 elements "x". */
static loom_dataset_spec *range_spec(int n)
{
    uint8_t v[256];
    for (int i = 0; i < n; i++) v[i] = (uint8_t)i;
    uint32_t d[1] = {(uint32_t)n};
    char name[32];
    snprintf(name, sizeof name, "range%d.idx", n);
    write_idx_file(tpath(name), 0x08, 1, d, v);
    loom_dataset_spec *s = calloc(1, sizeof *s);
    s->present = true;
    spec_feature(s, "x", tpath(name));
    return s;
}

/* A text source over file (lines, or records split at sep). */
static loom_dataset_spec *text_spec(const char *file, const char *sep, int64_t max_length)
{
    loom_dataset_spec *s = calloc(1, sizeof *s);
    s->present = true;
    loom_source_spec *src = &s->source;
    src->kind = LOOM_SRC_TEXT;
    snprintf(src->loc.file, sizeof src->loc.file, "test.cfg");
    src->loc.line = 3;
    src->n_patterns = 1;
    snprintf(src->pattern[0], LOOM_PATH_MAX, "%s", file);
    src->text.max_length = max_length;
    if (sep) snprintf(src->text.record_separator, sizeof src->text.record_separator, "%s", sep);
    return s;
}

static loom_transform_spec *add_window(loom_dataset_spec *s, int64_t size, int64_t shift, int64_t stride, bool drop)
{
    loom_transform_spec *t = spec_add(s, LOOM_T_WINDOW);
    t->batch_size = size;
    t->shift = shift;
    t->stride = stride;
    t->drop_remainder = drop;
    return t;
}

static void check_restore(const loom_dataset_spec *s, const char *what);

static loom_map_spec *add_tokenize(loom_dataset_spec *s, loom_tok_mode mode)
{
    loom_map_spec *m = spec_map(s, LOOM_MAP_TOKENIZE, "line", 1, true);
    m->tok_mode = mode;
    m->num_oov_indices = 1;
    return m;
}

/* Every element of one pass as text: "[a b c] [d e] ..." of feature name
 * (rows of a batched feature joined by '|'); NULL error text on success. */
static int pass_text(const loom_dataset_spec *s, const char *name, char *out, size_t n, char *errbuf, size_t en)
{
    loom_iter *it = NULL;
    loom_err err = {0};
    out[0] = 0;
    if (errbuf) errbuf[0] = 0;
    int rc = loom_data_open(&it, s, &ctx1, &err);
    if (rc) {
        if (errbuf) loom_err_format(&err, errbuf, en);
        return rc;
    }
    int f = loom_elem_spec_find(loom_iter_spec(it), name);
    size_t k = 0;
    loom_elem *e;
    while ((rc = loom_iter_next(it, &e, &err)) == LOOM_OK && f >= 0) {
        const loom_tensor *t = &e->t[f];
        int64_t numel = loom_shape_numel(&t->shape), row = t->shape.rank ? numel / (t->shape.dim[0] ? t->shape.dim[0] : 1) : 1;
        k += (size_t)snprintf(out + k, n - k, "%s[", k ? " " : "");
        for (int64_t i = 0; i < numel && k < n; i++)
            k += (size_t)snprintf(out + k, n - k, "%s%g", i == 0 ? "" : (t->shape.rank > 1 && i % row == 0) ? "|" : " ",
                                  loom_tensor_get(t, i));
        if (k < n) k += (size_t)snprintf(out + k, n - k, "]");
    }
    if (rc != LOOM_EEOF && errbuf) loom_err_format(&err, errbuf, en);
    loom_iter_close(it);
    return rc == LOOM_EEOF ? LOOM_OK : rc;
}

static void expect_pass(const loom_dataset_spec *s, const char *name, const char *want)
{
    char got[4096], errbuf[1024];
    int rc = pass_text(s, name, got, sizeof got, errbuf, sizeof errbuf);
    CHECK_MSG(rc == LOOM_OK, "%s", errbuf);
    CHECK_MSG(!strcmp(got, want), "%s: got %s, want %s", name, got, want);
}

/* ---- window: tf.data.Dataset.window's docstring, range(7) and range(5) ------- */

static void test_window(void)
{
    loom_dataset_spec *s = range_spec(7);
    add_window(s, 3, 2, 1, false);
    expect_pass(s, "x", "[0 1 2] [2 3 4] [4 5 6] [6]");
    s->transform[0].drop_remainder = true;
    expect_pass(s, "x", "[0 1 2] [2 3 4] [4 5 6]");
    s->transform[0] = (loom_transform_spec){0};
    s->n_transforms = 0;
    add_window(s, 3, 1, 2, false);
    expect_pass(s, "x", "[0 2 4] [1 3 5] [2 4 6] [3 5] [4 6] [5] [6]");
    s->transform[0].drop_remainder = true;
    expect_pass(s, "x", "[0 2 4] [1 3 5] [2 4 6]");
    /* shift beyond the span skips elements (tf: window(2, shift=3) on range(7)) */
    s->n_transforms = 0;
    add_window(s, 2, 3, 1, false);
    expect_pass(s, "x", "[0 1] [3 4] [6]");
    free(s);
    s = range_spec(5);
    add_window(s, 3, 3, 1, false); /* window(3): shift defaults to size */
    expect_pass(s, "x", "[0 1 2] [3 4]");
    s->transform[0].drop_remainder = true;
    expect_pass(s, "x", "[0 1 2]");
    /* a window larger than the data: no windows with drop_remainder (tf too), one short one without */
    s->transform[0].batch_size = 8;
    s->transform[0].shift = 8;
    expect_pass(s, "x", "");
    s->transform[0].drop_remainder = false;
    expect_pass(s, "x", "[0 1 2 3 4]");
    /* the cardinality tf computes: drop ? (n - span) / shift + 1 : ceil(n / shift) */
    s->transform[0].batch_size = 2;
    s->transform[0].shift = 2;
    loom_iter *it = iter_open_ok(s, &ctx1);
    if (it) CHECK_MSG(loom_iter_cardinality(it) == 3, "card %lld", (long long)loom_iter_cardinality(it));
    loom_iter_close(it);
    free(s);
}

/* ---- lm_pairs: input = w[:-1], target = w[1:] (or w[-1]) ------------------------ */

static void test_lm_pairs(void)
{
    loom_dataset_spec *s = range_spec(9);
    add_window(s, 4, 3, 1, true);
    loom_transform_spec *t = spec_add(s, LOOM_T_LM_PAIRS);
    snprintf(t->feature, sizeof t->feature, "x");
    snprintf(t->input_name, sizeof t->input_name, "input");
    snprintf(t->target_name, sizeof t->target_name, "target");
    expect_pass(s, "input", "[0 1 2] [3 4 5]");
    expect_pass(s, "target", "[1 2 3] [4 5 6]");
    t->target_last = true;
    expect_pass(s, "target", "[3] [6]");
    spec_batch(s, 2);
    expect_pass(s, "input", "[0 1 2|3 4 5]");
    free(s);
}

/* ---- tokenize -------------------------------------------------------------------- */

static void test_tokenize(void)
{
    /* "Hi, yo" then "é€" (2- and 3-byte UTF-8) then a line with an invalid byte */
    const char text[] = "Hi, yo\n\xc3\xa9\xe2\x82\xac\nA\xff" "B\n";
    write_file(tpath("t.txt"), text, sizeof text - 1);
    loom_dataset_spec *s = text_spec(tpath("t.txt"), NULL, 16);
    loom_map_spec *m = add_tokenize(s, LOOM_TOK_BYTES);
    expect_pass(s, "line", "[73 106 45 33 122 112] [196 170 227 131 173] [66 256 67]");
    m->tok_mode = LOOM_TOK_UTF8_CHARS; /* raw code points + 1; 0xff -> U+FFFD (counted) */
    expect_pass(s, "line", "[73 106 45 33 122 112] [234 8365] [66 65534 67]");
    m->output_sequence_length = 4; /* padded with 0, truncated */
    expect_pass(s, "line", "[73 106 45 33] [234 8365 0 0] [66 65534 67 0]");
    m->output_sequence_length = 0;
    m->on_invalid = LOOM_INVALID_ERROR;
    char got[1024], errbuf[1024];
    CHECK(pass_text(s, "line", got, sizeof got, errbuf, sizeof errbuf) == LOOM_EDATA);
    char want[600];
    snprintf(want, sizeof want, "%s: byte offset 14: tokenize: invalid UTF-8 (byte 0xFF)", tpath("t.txt"));
    CHECK_CONTAINS(errbuf, want);
    free(s);

    /* words through a vocabulary file, Keras' default standardize (lower, strip punctuation) */
    const char words[] = "The cat, the HAT!\nA dog.\n";
    write_file(tpath("w.txt"), words, sizeof words - 1);
    write_file(tpath("vocab.txt"), "the\ncat\nhat\r\n", 13);
    s = text_spec(tpath("w.txt"), NULL, 32);
    m = add_tokenize(s, LOOM_TOK_WHITESPACE);
    snprintf(m->vocabulary_file, sizeof m->vocabulary_file, "%s", tpath("vocab.txt"));
    expect_pass(s, "line", "[2 3 2 4] [1 1]"); /* 0 padding, 1 [UNK], then the file's tokens */
    m->standardize = LOOM_STD_NONE;
    expect_pass(s, "line", "[1 1 2 1] [1 1]");
    m->standardize = LOOM_STD_LOWER_AND_STRIP;
    m->num_oov_indices = 0;
    CHECK(pass_text(s, "line", got, sizeof got, errbuf, sizeof errbuf) == LOOM_EDATA);
    CHECK_CONTAINS(errbuf, "\"a\" is not in the vocabulary");
    m->num_oov_indices = 1;
    /* a duplicate and an empty line: errors naming file:line */
    write_file(tpath("dup.txt"), "the\ncat\nthe\n", 12);
    snprintf(m->vocabulary_file, sizeof m->vocabulary_file, "%s", tpath("dup.txt"));
    CHECK(pass_text(s, "line", got, sizeof got, errbuf, sizeof errbuf) == LOOM_EDATA);
    snprintf(want, sizeof want, "%s:3: tokenize: vocabulary token \"the\" appears twice (lines 1 and 3)", tpath("dup.txt"));
    CHECK_CONTAINS(errbuf, want);
    write_file(tpath("empty.txt"), "the\n\ncat\n", 9);
    snprintf(m->vocabulary_file, sizeof m->vocabulary_file, "%s", tpath("empty.txt"));
    CHECK(pass_text(s, "line", got, sizeof got, errbuf, sizeof errbuf) == LOOM_EDATA);
    snprintf(want, sizeof want, "%s:2: tokenize: an empty line in the vocabulary", tpath("empty.txt"));
    CHECK_CONTAINS(errbuf, want);
    free(s);
}

/* ---- the tokenizer outside a pipeline (generation's prompts and output) ------------- */

static void test_tokenizer(void)
{
    write_file(tpath("tv.txt"), "the\ncat\n", 8);
    loom_map_spec m = {0};
    m.kind = LOOM_MAP_TOKENIZE;
    m.tok_mode = LOOM_TOK_WHITESPACE;
    m.num_oov_indices = 1;
    snprintf(m.vocabulary_file, sizeof m.vocabulary_file, "%s", tpath("tv.txt"));
    loom_tokenizer *t = NULL;
    loom_err err = {0};
    CHECK_MSG(loom_tokenizer_new(&t, &m, &err) == LOOM_OK, "%s", err.msg);
    if (!t) return;
    int64_t ids[8], n = 0, oov = 0;
    const char *text = "The cat, zz the";
    CHECK(loom_tokenizer_encode(t, (const uint8_t *)text, strlen(text), ids, 8, &n, &oov, &err) == LOOM_OK);
    CHECK_MSG(n == 4 && ids[0] == 2 && ids[1] == 3 && ids[2] == 1 && ids[3] == 2 && oov == 1, "n %lld oov %lld", (long long)n,
              (long long)oov);
    CHECK(loom_tokenizer_size(t) == 4);
    char buf[16];
    int k = loom_tokenizer_decode(t, 3, buf, sizeof buf);
    CHECK(k == 3 && !memcmp(buf, "cat", 3));
    k = loom_tokenizer_decode(t, 1, buf, sizeof buf);
    CHECK(k == 5 && !memcmp(buf, "[UNK]", 5));
    CHECK(loom_tokenizer_decode(t, 0, buf, sizeof buf) == -1 && loom_tokenizer_decode(t, 4, buf, sizeof buf) == -1);
    loom_tokenizer_free(t);
    m.tok_mode = LOOM_TOK_UTF8_CHARS; /* raw code points: id - 1 back as UTF-8 */
    m.vocabulary_file[0] = 0;
    CHECK(loom_tokenizer_new(&t, &m, &err) == LOOM_OK);
    if (!t) return;
    const char eur[] = "a\xe2\x82\xac";
    CHECK(loom_tokenizer_encode(t, (const uint8_t *)eur, 4, ids, 8, &n, &oov, &err) == LOOM_OK);
    CHECK(n == 2 && ids[0] == 98 && ids[1] == 8365 && oov == 0);
    k = loom_tokenizer_decode(t, 8365, buf, sizeof buf);
    CHECK(k == 3 && !memcmp(buf, "\xe2\x82\xac", 3));
    loom_tokenizer_free(t);
}

/* ---- the text source's records (fortune files) ------------------------------------ */

static void test_records(void)
{
    const char f[] = "one\ntwo\n%\n%\nthree\n%\nfour\nfive";
    write_file(tpath("f.txt"), f, sizeof f - 1);
    loom_dataset_spec *s = text_spec(tpath("f.txt"), "%", 32);
    expect_pass(s, "length", "[7] [5] [9]"); /* "one\ntwo", "three", "four\nfive"; the empty record skipped */
    add_tokenize(s, LOOM_TOK_BYTES);
    expect_pass(s, "line", "[112 111 102 11 117 120 112] [117 105 115 102 102] [103 112 118 115 11 103 106 119 102]");
    free(s);
    /* CRLF records: an invalid byte's offset counts the '\r's dropped before it */
    const char crlf[] = "%\r\nok\r\nx\xff\r\n%\r\n";
    write_file(tpath("crlf.txt"), crlf, sizeof crlf - 1);
    s = text_spec(tpath("crlf.txt"), "%", 32);
    loom_map_spec *m = add_tokenize(s, LOOM_TOK_UTF8_CHARS);
    m->on_invalid = LOOM_INVALID_ERROR;
    char got[256], errbuf[1024], want[600];
    CHECK(pass_text(s, "line", got, sizeof got, errbuf, sizeof errbuf) == LOOM_EDATA);
    snprintf(want, sizeof want, "%s: byte offset 8: tokenize: invalid UTF-8 (byte 0xFF)", tpath("crlf.txt"));
    CHECK_CONTAINS(errbuf, want);
    free(s);
}

/* file_feature: each element's file as its index in the sorted list (files given out of order), restored exactly */
static void test_file_feature(void)
{
    write_file(tpath("fa.txt"), "x\ny\n", 4);
    write_file(tpath("fb.txt"), "z\n", 2);
    loom_dataset_spec *s = text_spec(tpath("fb.txt"), NULL, 8);
    snprintf(s->source.pattern[1], LOOM_PATH_MAX, "%s", tpath("fa.txt"));
    s->source.n_patterns = 2;
    snprintf(s->source.text.file_feature, sizeof s->source.text.file_feature, "topic");
    expect_pass(s, "topic", "[0] [0] [1]");
    expect_pass(s, "length", "[1] [1] [1]");
    check_restore(s, "file_feature");
    snprintf(s->source.text.file_feature, sizeof s->source.text.file_feature, "line");
    char got[256], errbuf[1024];
    CHECK(pass_text(s, "line", got, sizeof got, errbuf, sizeof errbuf) == LOOM_ECONFIG);
    CHECK_CONTAINS(errbuf, "file_feature = \"line\" clashes with the source's own feature");
    free(s);
}

/* ---- flat_map: interleave with cycle_length 1 (tf_semantics 4.5) ------------------------ */

static void test_flat_map(void)
{
    write_file(tpath("fa.txt"), "a\nbb\n", 5);
    write_file(tpath("fb.txt"), "c\n", 2);
    loom_dataset_spec *s = calloc(1, sizeof *s);
    s->present = true;
    s->source.kind = LOOM_SRC_LIST_FILES;
    snprintf(s->source.loc.file, sizeof s->source.loc.file, "test.cfg");
    s->source.n_patterns = 1;
    snprintf(s->source.pattern[0], LOOM_PATH_MAX, "%s", tpath("f?.txt"));
    loom_transform_spec *t = spec_add(s, LOOM_T_FLAT_MAP);
    loom_source_spec nested = {0};
    nested.kind = LOOM_SRC_TEXT;
    nested.text.max_length = 4;
    t->source = &nested;
    add_tokenize(s, LOOM_TOK_BYTES);
    expect_pass(s, "line", "[98] [99 99] [100]"); /* fa's lines, then fb's: the files in sorted order */
    check_restore(s, "flat_map");
    free(s);
}

/* ---- padded_batch's mask, bucket_by_sequence_length ----------------------------- */

static void test_padded_mask(void)
{
    write_file(tpath("p.txt"), "ab\nc\nabcd\n", 10);
    loom_dataset_spec *s = text_spec(tpath("p.txt"), NULL, 8);
    add_tokenize(s, LOOM_TOK_BYTES);
    loom_transform_spec *t = spec_add(s, LOOM_T_PADDED_BATCH);
    t->batch_size = 2;
    snprintf(t->padded.mask, sizeof t->padded.mask, "line");
    expect_pass(s, "line", "[98 99|100 0] [98 99 100 101]");
    expect_pass(s, "line_mask", "[1 1|1 0] [1 1 1 1]");
    free(s);
}

static void test_bucket(void)
{
    /* lengths 1 4 2 6 3 1 5 2; boundaries [3, 5]: buckets [0,3) [3,5) [5,inf), batch sizes 2 2 2 */
    write_file(tpath("b.txt"), "a\nbbbb\ncc\ndddddd\neee\nf\nggggg\nhh\n", 32);
    loom_dataset_spec *s = text_spec(tpath("b.txt"), NULL, 8);
    add_tokenize(s, LOOM_TOK_BYTES);
    loom_transform_spec *t = spec_add(s, LOOM_T_BUCKET);
    snprintf(t->feature, sizeof t->feature, "line");
    t->padded.n_boundaries = 2;
    t->padded.boundary[0] = 3;
    t->padded.boundary[1] = 5;
    t->padded.bucket_size[0] = t->padded.bucket_size[1] = t->padded.bucket_size[2] = 2;
    snprintf(t->padded.mask, sizeof t->padded.mask, "line");
    /* a(1) -> b0; bbbb(4) -> b1; cc(2) -> b0 full: [a, cc]; dddddd -> b2; eee -> b1 full: [bbbb, eee];
     * f -> b0; ggggg -> b2 full: [dddddd, ggggg]; hh -> b0 full: [f, hh]; nothing left */
    expect_pass(s, "line_mask", "[1 0|1 1] [1 1 1 1|1 1 1 0] [1 1 1 1 1 1|1 1 1 1 1 0] [1 0|1 1]");
    /* batch sizes 3: the end flushes the partial buckets in bucket order (tf's group_by_window) */
    t->padded.bucket_size[0] = t->padded.bucket_size[1] = t->padded.bucket_size[2] = 3;
    expect_pass(s, "line", "[98 0|100 100|103 0] [105 105] [99 99 99 99|102 102 102 0] "
                           "[101 101 101 101 101 101|104 104 104 104 104 0]");
    t->drop_remainder = true; /* each bucket's partial batch dropped */
    expect_pass(s, "line", "[98 0|100 100|103 0]");
    /* pad_to_bucket_boundary: lengths padded to boundary - 1; the last bucket is an error, as tf asserts */
    t->drop_remainder = false;
    t->padded.pad_to_bucket_boundary = true;
    t->padded.bucket_size[0] = 2;
    char got[2048], errbuf[1024];
    CHECK(pass_text(s, "line", got, sizeof got, errbuf, sizeof errbuf) == LOOM_EDATA);
    CHECK_MSG(!strncmp(got, "[98 0|100 100]", 14), "got %s", got);
    CHECK_CONTAINS(errbuf, "element 3 has length 6, not below the largest boundary 5");
    free(s);
}

/* ---- exact resume --------------------------------------------------------------------- */

static void blob_elem(blob *b, const loom_elem *e)
{
    for (int f = 0; f < e->n; f++) {
        const loom_tensor *t = &e->t[f];
        blob_put(b, &t->shape.rank, sizeof t->shape.rank);
        blob_put(b, t->shape.dim, (size_t)t->shape.rank * sizeof t->shape.dim[0]);
        blob_put(b, t->data, loom_tensor_nbytes(t));
    }
}

/* n elements (all when n < 0) over two epochs into b; the count. */
static int drive(loom_iter *it, blob *b, int n, int64_t *epoch)
{
    int k = 0;
    loom_elem *e;
    loom_err err = {0};
    while ((n < 0 || k < n) && *epoch < 2) {
        int rc = loom_iter_next(it, &e, &err);
        if (rc == LOOM_EEOF) {
            if (++*epoch < 2) CHECK(loom_iter_rewind(it, *epoch, &err) == LOOM_OK);
            continue;
        }
        CHECK_MSG(rc == LOOM_OK, "%s: %s", err.where, err.msg);
        if (rc) break;
        blob_elem(b, e);
        k++;
    }
    return k;
}

static void check_restore(const loom_dataset_spec *s, const char *what)
{
    blob ref = {0};
    int64_t ep = 0;
    loom_iter *it = iter_open_ok(s, &ctx1);
    if (!it) return;
    int total = drive(it, &ref, -1, &ep);
    loom_iter_close(it);
    CHECK_MSG(total > 4, "%s: %d elements", what, total);
    for (int cut = 0; cut < total; cut++) {
        blob got = {0};
        loom_buf st;
        loom_buf_init(&st);
        loom_err err = {0};
        ep = 0;
        loom_iter *a = iter_open_ok(s, &ctx1), *b = NULL;
        if (!a) break;
        drive(a, &got, cut, &ep);
        CHECK(loom_iter_save(a, &st, &err) == LOOM_OK);
        loom_iter_close(a);
        if (!(b = iter_open_ok(s, &ctx1))) break;
        int rc = loom_iter_restore(b, &st, &err);
        CHECK_MSG(rc == LOOM_OK, "%s: restore at %d: %s", what, cut, err.msg);
        drive(b, &got, -1, &ep);
        loom_iter_close(b);
        CHECK_MSG(got.n == ref.n && !memcmp(got.p, ref.p, ref.n), "%s: cut %d differs", what, cut);
        free(got.p);
        loom_buf_fini(&st);
    }
    free(ref.p);
}

static void test_resume(void)
{
    const char f[] = "one two\n%\nthree\n%\nfour five six\nseven\n%\nA\n%\nBC D\n";
    write_file(tpath("r.txt"), f, sizeof f - 1);
    /* records -> tokenize -> unbatch -> window(5, 2, stride 2) -> lm_pairs -> shuffle -> batch */
    loom_dataset_spec *s = text_spec(tpath("r.txt"), "%", 64);
    add_tokenize(s, LOOM_TOK_BYTES);
    loom_transform_spec *sel = spec_add(s, LOOM_T_SELECT); /* "length" is a scalar: unbatch splits "line" alone */
    sel->features.n = 1;
    snprintf(sel->features.name[0], LOOM_NAME_MAX, "line");
    spec_add(s, LOOM_T_UNBATCH);
    add_window(s, 4, 3, 2, true);
    loom_transform_spec *t = spec_add(s, LOOM_T_LM_PAIRS);
    snprintf(t->feature, sizeof t->feature, "line");
    snprintf(t->input_name, sizeof t->input_name, "input");
    snprintf(t->target_name, sizeof t->target_name, "target");
    spec_shuffle(s, 4);
    spec_batch(s, 3);
    check_restore(s, "window");
    free(s);
    /* records -> tokenize -> bucket_by_sequence_length (partial buckets held across the cut) */
    s = text_spec(tpath("r.txt"), "%", 64);
    add_tokenize(s, LOOM_TOK_BYTES);
    t = spec_add(s, LOOM_T_BUCKET);
    snprintf(t->feature, sizeof t->feature, "line");
    t->padded.n_boundaries = 1;
    t->padded.boundary[0] = 6;
    t->padded.bucket_size[0] = 2;
    t->padded.bucket_size[1] = 2;
    snprintf(t->padded.mask, sizeof t->padded.mask, "line");
    check_restore(s, "bucket");
    free(s);
}

static void test_cleanup(void) { tmpdir_remove(); }

static const loom_test tests[] = {
    {"window", test_window},
    {"lm_pairs", test_lm_pairs},
    {"tokenize", test_tokenize},
    {"tokenizer", test_tokenizer},
    {"records", test_records},
    {"file_feature", test_file_feature},
    {"flat_map", test_flat_map},
    {"padded_mask", test_padded_mask},
    {"bucket", test_bucket},
    {"resume", test_resume},
    {"cleanup", test_cleanup},
    {NULL, NULL},
};

int main(void)
{
    snprintf(tmpdir, sizeof tmpdir, "/tmp/loom_test_text.XXXXXX");
    if (!mkdtemp(tmpdir)) return 1;
    return loom_test_run(tests);
}
