/* test_sources_more.c - the csv, text and synthetic sources: RFC 4180 quoting
 * (through the record reader and the source), every dtype, defaults, columns by
 * header name or index, errors naming file:line:column and the value, exact
 * mid-file save/restore; text lines (CRLF, empty, unterminated, too long,
 * truncate); synthetic determinism with and without prefetch, ranges and
 * cardinality; and the config grammar (tests/configs/good_sources.cfg,
 * good_text.cfg; the bad_csv/bad_synthetic goldens run in test_config).
 * Fixtures go to a temporary directory. */
#include "harness.h"
#include "test_util.h"
#include "data/data_internal.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void write_file(const char *name, const char *text)
{
    FILE *f = fopen(tpath(name), "wb");
    CHECK(f != NULL);
    if (!f) return;
    fputs(text, f);
    fclose(f);
}

static loom_dataset_spec *new_spec(loom_source_kind kind, const char *pattern)
{
    loom_dataset_spec *d = calloc(1, sizeof *d);
    d->present = true;
    d->source.kind = kind;
    snprintf(d->source.loc.file, sizeof d->source.loc.file, "test.cfg");
    d->source.loc.line = 7;
    snprintf(d->source.loc.path, sizeof d->source.loc.path, "data.train.source");
    if (pattern) {
        d->source.n_patterns = 1;
        snprintf(d->source.pattern[0], LOOM_PATH_MAX, "%s", tpath(pattern));
    }
    if (kind == LOOM_SRC_CSV) {
        d->source.csv.header = true;
        d->source.csv.delimiter = ',';
    }
    return d;
}

static void add_col(loom_dataset_spec *d, const char *name, loom_cfg_dtype dt, int index)
{
    loom_source_spec *s = &d->source;
    int k = s->n_features++;
    snprintf(s->feature[k], LOOM_NAME_MAX, "%s", name);
    s->csv.columns[k].dtype = dt;
    s->csv.columns[k].index = index;
    if (index < 0) snprintf(s->csv.columns[k].column, LOOM_NAME_MAX, "%s", name);
}

static loom_iter *open_ok(const loom_dataset_spec *d) { return iter_open_ok(d, NULL); }

/* ---- csv ------------------------------------------------------------------- */

/* The record reader on its own: quoting, CRLF, blank lines, line numbers. */
static void test_csv_records(void)
{
    write_file("q.csv", "a,\"b,c\",\"say \"\"hi\"\"\"\r\n"
                        "\n"
                        "\"multi\nline\",,x\n"
                        "\r\n"
                        "\"\",last");
    src_file in;
    loom_err err = {0};
    CHECK(src_file_open_(&in, tpath("q.csv"), 0, &err) == LOOM_OK);
    csv_record r = {0};
    int64_t line = 1;
    CHECK(csv_read_record_(&in, "q.csv", ',', &line, &r, &err) == LOOM_OK);
    CHECK(r.n == 3 && r.line == 1);
    if (r.n == 3) {
        CHECK(!strcmp(r.text + r.start[0], "a"));
        CHECK(!strcmp(r.text + r.start[1], "b,c"));
        CHECK(!strcmp(r.text + r.start[2], "say \"hi\""));
    }
    CHECK(csv_read_record_(&in, "q.csv", ',', &line, &r, &err) == LOOM_OK);
    CHECK(r.n == 3 && r.line == 3);
    if (r.n == 3) {
        CHECK(!strcmp(r.text + r.start[0], "multi\nline"));
        CHECK(!strcmp(r.text + r.start[1], ""));
        CHECK(!strcmp(r.text + r.start[2], "x"));
    }
    CHECK(csv_read_record_(&in, "q.csv", ',', &line, &r, &err) == LOOM_OK);
    CHECK(r.n == 2 && r.line == 6);
    if (r.n == 2) CHECK(!strcmp(r.text + r.start[0], "") && !strcmp(r.text + r.start[1], "last"));
    CHECK(csv_read_record_(&in, "q.csv", ',', &line, &r, &err) == LOOM_EEOF);
    src_file_close_(&in);

    write_file("bad1.csv", "a,\"b\"x,c\n");
    CHECK(src_file_open_(&in, tpath("bad1.csv"), 0, &err) == LOOM_OK);
    line = 1;
    CHECK(csv_read_record_(&in, "bad1.csv", ',', &line, &r, &err) == LOOM_EDATA);
    CHECK_CONTAINS(err.where, "bad1.csv:1");
    CHECK_CONTAINS(err.msg, "'x' after the closing quote");
    src_file_close_(&in);

    write_file("bad2.csv", "a,b\n1,\"open\nstill open\n");
    CHECK(src_file_open_(&in, tpath("bad2.csv"), 0, &err) == LOOM_OK);
    line = 1;
    CHECK(csv_read_record_(&in, "bad2.csv", ',', &line, &r, &err) == LOOM_OK);
    CHECK(csv_read_record_(&in, "bad2.csv", ',', &line, &r, &err) == LOOM_EDATA);
    CHECK_CONTAINS(err.where, "bad2.csv:2");
    CHECK_CONTAINS(err.msg, "never closed");
    src_file_close_(&in);
    csv_record_fini_(&r);

    union { float f; double d; int64_t i; int32_t i32; uint8_t u; } v;
    CHECK(csv_parse_value_(" 2.5 ", LOOM_F32, &v) && v.f == 2.5f);
    CHECK(!csv_parse_value_("1e39", LOOM_F32, &v));
    CHECK(csv_parse_value_("1e39", LOOM_F64, &v) && v.d == 1e39);
    CHECK(csv_parse_value_("-9000000000", LOOM_I64, &v) && v.i == -9000000000LL);
    CHECK(!csv_parse_value_("-9000000000", LOOM_I32, &v));
    CHECK(!csv_parse_value_("256", LOOM_U8, &v) && csv_parse_value_("255", LOOM_U8, &v) && v.u == 255);
    CHECK(!csv_parse_value_("3.0", LOOM_I64, &v));
    CHECK(!csv_parse_value_("12abc", LOOM_F64, &v));
}

/* The source: header names (also quoted, and selected via column =), every dtype, defaults, ignored columns. */
static void test_csv_source(void)
{
    write_file("t1.csv", "\"x 1\",u8,i32,i64,f64,name,skip\n"
                         "1.5,7,-3,9000000000,0.25,\"a, \"\"b\"\"\",zzz\n"
                         "-2,,5,1,1e-3,\"two\nlines\",\n");
    loom_dataset_spec *d = new_spec(LOOM_SRC_CSV, "t1.csv");
    add_col(d, "x", LOOM_CFG_F32, -1);
    snprintf(d->source.csv.columns[0].column, LOOM_NAME_MAX, "x 1");
    add_col(d, "u8", LOOM_CFG_U8, -1);
    d->source.csv.columns[1].has_default = true;
    d->source.csv.columns[1].default_value = 42;
    add_col(d, "i32", LOOM_CFG_I32, -1);
    add_col(d, "i64", LOOM_CFG_I64, -1);
    add_col(d, "f64", LOOM_CFG_F64, 4);
    loom_iter *it = open_ok(d);
    if (!it) goto out;
    const loom_elem_spec *es = loom_iter_spec(it);
    char buf[256];
    CHECK_CONTAINS(loom_elem_spec_str(es, buf, sizeof buf),
                   "x: float32 (); u8: uint8 (); i32: int32 (); i64: int64 (); f64: float64 ()");
    CHECK(loom_iter_cardinality(it) == -2);
    loom_elem *e;
    loom_err err = {0};
    CHECK(loom_iter_next(it, &e, &err) == LOOM_OK);
    CHECK(*(float *)e->t[0].data == 1.5f && *(uint8_t *)e->t[1].data == 7 && *(int32_t *)e->t[2].data == -3);
    CHECK(*(int64_t *)e->t[3].data == 9000000000LL && *(double *)e->t[4].data == 0.25);
    CHECK(loom_iter_next(it, &e, &err) == LOOM_OK);
    CHECK(*(float *)e->t[0].data == -2.0f && *(uint8_t *)e->t[1].data == 42 && *(int32_t *)e->t[2].data == 5);
    CHECK(loom_iter_next(it, &e, &err) == LOOM_EEOF);
    CHECK(loom_iter_rewind(it, 1, &err) == LOOM_OK);
    CHECK(loom_iter_next(it, &e, &err) == LOOM_OK && *(float *)e->t[0].data == 1.5f);
    loom_iter_close(it);

    /* no header, by index, another delimiter */
    write_file("t2.tsv", "1\t2\t3\n4\t5\t6\n");
    loom_dataset_spec *d2 = new_spec(LOOM_SRC_CSV, "t2.tsv");
    d2->source.csv.header = false;
    d2->source.csv.delimiter = '\t';
    add_col(d2, "c", LOOM_CFG_I64, 2);
    add_col(d2, "a", LOOM_CFG_F32, 0);
    it = open_ok(d2);
    if (it) {
        CHECK(loom_iter_next(it, &e, &err) == LOOM_OK);
        CHECK(*(int64_t *)e->t[0].data == 3 && *(float *)e->t[1].data == 1.0f);
        CHECK(loom_iter_next(it, &e, &err) == LOOM_OK);
        CHECK(*(int64_t *)e->t[0].data == 6 && *(float *)e->t[1].data == 4.0f);
        CHECK(loom_iter_next(it, &e, &err) == LOOM_EEOF);
        loom_iter_close(it);
    }
    free(d2);
out:
    free(d);
}

/* Reads to the end; returns the error code and leaves the message in err. */
static int drain(loom_iter *it, loom_err *err, int64_t *n)
{
    loom_elem *e;
    int rc;
    *n = 0;
    while ((rc = loom_iter_next(it, &e, err)) == LOOM_OK) (*n)++;
    return rc;
}

static void test_csv_errors(void)
{
    write_file("e1.csv", "a,b\n1,2\n3,oops\n");
    loom_dataset_spec *d = new_spec(LOOM_SRC_CSV, "e1.csv");
    add_col(d, "a", LOOM_CFG_F32, -1);
    add_col(d, "b", LOOM_CFG_I64, -1);
    loom_err err = {0};
    int64_t n;
    loom_iter *it = open_ok(d);
    if (it) {
        CHECK(drain(it, &err, &n) == LOOM_EDATA && n == 1);
        CHECK_CONTAINS(err.where, "e1.csv:3:2");
        CHECK_CONTAINS(err.msg, "column 2 (feature \"b\"): cannot parse \"oops\" as int64");
        loom_iter_close(it);
    }
    /* an empty field without a default; a short record */
    write_file("e2.csv", "a,b\n1,\n");
    snprintf(d->source.pattern[0], LOOM_PATH_MAX, "%s", tpath("e2.csv"));
    if ((it = open_ok(d))) {
        CHECK(drain(it, &err, &n) == LOOM_EDATA);
        CHECK_CONTAINS(err.where, "e2.csv:2:2");
        CHECK_CONTAINS(err.msg, "empty value");
        CHECK_CONTAINS(err.hint, "default");
        loom_iter_close(it);
    }
    write_file("e3.csv", "a,b\n1,2\n\n5\n");
    snprintf(d->source.pattern[0], LOOM_PATH_MAX, "%s", tpath("e3.csv"));
    if ((it = open_ok(d))) {
        CHECK(drain(it, &err, &n) == LOOM_EDATA && n == 1);
        CHECK_CONTAINS(err.where, "e3.csv:4:2");
        CHECK_CONTAINS(err.msg, "the record has only 1 field");
        loom_iter_close(it);
    }
    /* a column missing from the header fails at open */
    write_file("e4.csv", "a,B\n1,2\n");
    snprintf(d->source.pattern[0], LOOM_PATH_MAX, "%s", tpath("e4.csv"));
    it = NULL;
    CHECK(loom_data_open(&it, d, NULL, &err) == LOOM_EDATA && !it);
    CHECK_CONTAINS(err.where, "e4.csv:1");
    CHECK_CONTAINS(err.msg, "column \"b\" (feature \"b\") is not in the header: \"a\", \"B\"");
    CHECK_CONTAINS(err.hint, "test.cfg:7");
    free(d);
}

/* Save after every element count k, restore into a fresh pipeline: the rest is identical. Two files. */
static void test_csv_save_restore(void)
{
    write_file("s-a.csv", "v,w\n0,\"x\ny\"\n1,a\r\n\n2,b\n");
    write_file("s-b.csv", "v,w\n3,c\n4,\"d,\"\"\"\n5,e");
    loom_dataset_spec *d = new_spec(LOOM_SRC_CSV, "s-*.csv");
    add_col(d, "v", LOOM_CFG_I64, -1);
    for (int k = 0; k <= 6; k++) {
        loom_iter *a = open_ok(d), *b = open_ok(d);
        if (!a || !b) break;
        loom_elem *e;
        loom_err err = {0};
        for (int i = 0; i < k; i++) CHECK(loom_iter_next(a, &e, &err) == LOOM_OK && *(int64_t *)e->t[0].data == i);
        loom_buf buf;
        loom_buf_init(&buf);
        CHECK(loom_iter_save(a, &buf, &err) == LOOM_OK);
        loom_buf rd;
        loom_buf_wrap(&rd, buf.data, buf.len);
        CHECK_MSG(loom_iter_restore(b, &rd, &err) == LOOM_OK, "%s", err.msg);
        for (int i = k; i < 6; i++) {
            CHECK(loom_iter_next(b, &e, &err) == LOOM_OK && *(int64_t *)e->t[0].data == i);
            CHECK(loom_iter_next(a, &e, &err) == LOOM_OK && *(int64_t *)e->t[0].data == i);
        }
        CHECK(loom_iter_next(b, &e, &err) == LOOM_EEOF);
        /* error lines stay right after a restore */
        loom_buf_fini(&buf);
        loom_iter_close(a);
        loom_iter_close(b);
    }
    /* line numbers after a restore in the middle of a file */
    write_file("s-b.csv", "v,w\n3,c\n4,\"d\n\"\nbad,e\n");
    loom_iter *a = open_ok(d), *b = open_ok(d);
    if (a && b) {
        loom_elem *e;
        loom_err err = {0};
        for (int i = 0; i < 4; i++) CHECK(loom_iter_next(a, &e, &err) == LOOM_OK);
        loom_buf buf;
        loom_buf_init(&buf);
        CHECK(loom_iter_save(a, &buf, &err) == LOOM_OK);
        loom_buf rd;
        loom_buf_wrap(&rd, buf.data, buf.len);
        CHECK(loom_iter_restore(b, &rd, &err) == LOOM_OK);
        CHECK(loom_iter_next(b, &e, &err) == LOOM_OK && *(int64_t *)e->t[0].data == 4);
        CHECK(loom_iter_next(b, &e, &err) == LOOM_EDATA);
        CHECK_CONTAINS(err.where, "s-b.csv:5:1");
        loom_buf_fini(&buf);
    }
    loom_iter_close(a);
    loom_iter_close(b);
    free(d);
}

/* ---- text ------------------------------------------------------------------ */

static void test_text(void)
{
    write_file("a.txt", "hello\r\n\nworld!\nlast");
    loom_dataset_spec *d = new_spec(LOOM_SRC_TEXT, "a.txt");
    d->source.text.max_length = 6;
    loom_iter *it = open_ok(d);
    if (!it) goto out;
    char buf[256];
    CHECK_CONTAINS(loom_elem_spec_str(loom_iter_spec(it), buf, sizeof buf), "line: uint8 (6,); length: int64 ()");
    static const char *want[] = {"hello", "", "world!", "last"};
    loom_elem *e;
    loom_err err = {0};
    for (int i = 0; i < 4; i++) {
        CHECK(loom_iter_next(it, &e, &err) == LOOM_OK);
        int64_t len = *(int64_t *)e->t[1].data;
        CHECK(len == (int64_t)strlen(want[i]));
        uint8_t exp[6] = {0};
        memcpy(exp, want[i], strlen(want[i]));
        CHECK(!memcmp(e->t[0].data, exp, 6));
        if (i == 1) { /* save after two lines, restore: the rest is the same */
            loom_buf b;
            loom_buf_init(&b);
            CHECK(loom_iter_save(it, &b, &err) == LOOM_OK);
            loom_iter *it2 = open_ok(d);
            loom_buf rd;
            loom_buf_wrap(&rd, b.data, b.len);
            if (it2) {
                CHECK(loom_iter_restore(it2, &rd, &err) == LOOM_OK);
                CHECK(loom_iter_next(it2, &e, &err) == LOOM_OK && *(int64_t *)e->t[1].data == 6);
                CHECK(loom_iter_next(it2, &e, &err) == LOOM_OK && !memcmp(e->t[0].data, "last\0\0", 6));
                CHECK(loom_iter_next(it2, &e, &err) == LOOM_EEOF);
                loom_iter_close(it2);
            }
            loom_buf_fini(&b);
        }
    }
    CHECK(loom_iter_next(it, &e, &err) == LOOM_EEOF);
    loom_iter_close(it);

    write_file("b.txt", "short\nthis one is too long\n");
    snprintf(d->source.pattern[0], LOOM_PATH_MAX, "%s", tpath("b.txt"));
    if ((it = open_ok(d))) {
        int64_t n;
        CHECK(drain(it, &err, &n) == LOOM_EDATA && n == 1);
        CHECK_CONTAINS(err.where, "b.txt:2");
        CHECK_CONTAINS(err.msg, "line of 20 bytes is longer than max_length = 6");
        CHECK_CONTAINS(err.hint, "truncate = true");
        loom_iter_close(it);
    }
    d->source.text.truncate = true;
    if ((it = open_ok(d))) {
        CHECK(loom_iter_next(it, &e, &err) == LOOM_OK);
        CHECK(loom_iter_next(it, &e, &err) == LOOM_OK);
        CHECK(*(int64_t *)e->t[1].data == 6 && !memcmp(e->t[0].data, "this o", 6));
        loom_iter_close(it);
    }
out:
    free(d);
}

/* ---- synthetic ------------------------------------------------------------- */

static loom_dataset_spec *syn_spec(int64_t count, bool prefetch)
{
    loom_dataset_spec *d = new_spec(LOOM_SRC_SYNTHETIC, NULL);
    loom_source_spec *s = &d->source;
    s->synthetic.count = count;
    s->n_features = 3;
    snprintf(s->feature[0], LOOM_NAME_MAX, "image");
    s->synthetic.features[0] =
        (loom_syn_feature){.dtype = LOOM_CFG_F32, .rank = 2, .shape = {4, 3}, .min = -1, .max = 1};
    snprintf(s->feature[1], LOOM_NAME_MAX, "label");
    s->synthetic.features[1] = (loom_syn_feature){.dtype = LOOM_CFG_I64, .rank = 0, .min = 0, .max = 10};
    snprintf(s->feature[2], LOOM_NAME_MAX, "noise");
    s->synthetic.features[2] = (loom_syn_feature){
        .dtype = LOOM_CFG_F64, .rank = 1, .shape = {5}, .dist = LOOM_SYN_NORMAL, .mean = 100, .std = 0.5};
    if (prefetch) {
        d->n_transforms = 1;
        d->transform[0].kind = LOOM_T_PREFETCH;
        d->transform[0].buffer = 3;
    }
    return d;
}

static void test_synthetic(void)
{
    loom_dataset_spec *d1 = syn_spec(50, false), *d2 = syn_spec(50, true);
    loom_data_ctx c1 = {.seed = 7, .threads = 0, .name = "a"}, c2 = {.seed = 7, .threads = 2, .name = "b"};
    loom_iter *a = NULL, *b = NULL;
    loom_err err = {0};
    CHECK(loom_data_open(&a, d1, &c1, &err) == LOOM_OK);
    CHECK(loom_data_open(&b, d2, &c2, &err) == LOOM_OK);
    if (!a || !b) goto out;
    CHECK(loom_iter_cardinality(a) == 50 && loom_iter_cardinality(b) == 50);
    int hist[10] = {0};
    double sum = 0;
    float first[12];
    for (int i = 0; i < 50; i++) {
        loom_elem *ea, *eb;
        CHECK(loom_iter_next(a, &ea, &err) == LOOM_OK);
        CHECK(loom_iter_next(b, &eb, &err) == LOOM_OK);
        for (int f = 0; f < 3; f++) CHECK(!memcmp(ea->t[f].data, eb->t[f].data, loom_tensor_nbytes(&ea->t[f])));
        const float *im = ea->t[0].data;
        for (int k = 0; k < 12; k++) CHECK(im[k] >= -1.0f && im[k] < 1.0f);
        if (i == 0) memcpy(first, im, sizeof first);
        int64_t l = *(int64_t *)ea->t[1].data;
        CHECK(l >= 0 && l < 10);
        if (l >= 0 && l < 10) hist[l]++;
        for (int k = 0; k < 5; k++) sum += ((double *)ea->t[2].data)[k];
    }
    int seen = 0;
    for (int k = 0; k < 10; k++) seen += hist[k] > 0;
    CHECK(seen >= 8);
    CHECK_NEAR(sum / 250, 100.0, 0.2);
    loom_elem *e;
    CHECK(loom_iter_next(a, &e, &err) == LOOM_EEOF);
    /* the same element in the next epoch, and nothing else from another seed */
    CHECK(loom_iter_rewind(a, 1, &err) == LOOM_OK);
    CHECK(loom_iter_next(a, &e, &err) == LOOM_OK && !memcmp(e->t[0].data, first, sizeof first));
    loom_iter_close(b);
    b = NULL;
    loom_data_ctx c3 = {.seed = 8, .threads = 0, .name = "c"};
    CHECK(loom_data_open(&b, d1, &c3, &err) == LOOM_OK);
    if (b) {
        CHECK(loom_iter_next(b, &e, &err) == LOOM_OK && memcmp(e->t[0].data, first, sizeof first));
        loom_iter_close(b);
        b = NULL;
    }
    /* infinite */
    d1->source.synthetic.count = -1;
    loom_iter *inf = NULL;
    CHECK(loom_data_open(&inf, d1, &c1, &err) == LOOM_OK);
    if (inf) {
        CHECK(loom_iter_cardinality(inf) == -1);
        for (int i = 0; i < 100; i++) CHECK(loom_iter_next(inf, &e, &err) == LOOM_OK);
        loom_iter_close(inf);
    }
out:
    loom_iter_close(a);
    loom_iter_close(b);
    free(d1);
    free(d2);
}

/* ---- config ---------------------------------------------------------------- */

static void test_config(void)
{
    loom_spec *s = NULL;
    loom_errlist errs;
    int rc = loom_config_load(&s, cfg_path("good_sources.cfg"), NULL, 0, &errs);
    CHECK_MSG(rc == LOOM_OK, "%s: %s", errs.n ? errs.e[0].where : "", errs.n ? errs.e[0].msg : "");
    if (!s) return;
    const loom_source_spec *c = &s->train.source;
    CHECK(c->kind == LOOM_SRC_CSV && c->csv.header && c->csv.delimiter == ',' && c->n_features == 3 &&
          c->n_patterns == 1);
    CHECK(c->csv.columns[1].dtype == LOOM_CFG_I64 && c->csv.columns[1].has_default &&
          c->csv.columns[1].default_value == -1);
    CHECK(!strcmp(c->csv.columns[2].column, "x1") && c->csv.columns[2].index == -1);
    const loom_source_spec *y = &s->eval.source;
    CHECK(y->kind == LOOM_SRC_SYNTHETIC && y->synthetic.count == 100 && y->n_features == 3);
    CHECK(y->synthetic.features[0].dist == LOOM_SYN_NORMAL && y->synthetic.features[0].rank == 2 &&
          y->synthetic.features[0].std == 2.0);
    CHECK(y->synthetic.features[1].max == 10 && y->synthetic.features[2].min == 10);
    /* the csv pipeline from the config */
    loom_iter *it = NULL;
    loom_err err = {0};
    CHECK_MSG(loom_data_open(&it, &s->train, NULL, &err) == LOOM_OK, "%s: %s", err.where, err.msg);
    if (it) {
        loom_elem *e;
        CHECK(loom_iter_next(it, &e, &err) == LOOM_OK);
        CHECK(e->t[0].shape.rank == 1 && ((float *)e->t[0].data)[1] == -2.0f);
        CHECK(((int64_t *)e->t[1].data)[0] == 3 && ((double *)e->t[2].data)[0] == 1.5);
        loom_iter_close(it);
    }
    /* print, load again: the same spec */
    char tmp[] = "/tmp/loom_sources_cfg_XXXXXX";
    int fd = mkstemp(tmp);
    FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
    CHECK(f != NULL);
    if (f) {
        loom_config_print(s, f);
        fclose(f);
        loom_spec *s2 = NULL;
        rc = loom_config_load(&s2, tmp, NULL, 0, &errs);
        CHECK_MSG(rc == LOOM_OK, "%s: %s", errs.n ? errs.e[0].where : "", errs.n ? errs.e[0].msg : "");
        if (s2) {
            CHECK(!memcmp(&s2->train.source.csv, &c->csv, sizeof c->csv));
            CHECK(!memcmp(&s2->eval.source.synthetic.features, &y->synthetic.features, sizeof y->synthetic.features));
            CHECK(s2->train.source.csv.header == c->csv.header &&
                  s2->eval.source.synthetic.count == y->synthetic.count);
            CHECK(!strcmp(s2->train.source.pattern[0], c->pattern[0]));
        }
        loom_config_free(s2);
        unlink(tmp);
    }
    loom_config_free(s);

    s = NULL;
    rc = loom_config_load(&s, cfg_path("good_text.cfg"), NULL, 0, &errs);
    CHECK_MSG(rc == LOOM_OK, "%s: %s", errs.n ? errs.e[0].where : "", errs.n ? errs.e[0].msg : "");
    if (!s) return;
    CHECK(s->train.source.kind == LOOM_SRC_TEXT && s->train.source.text.max_length == 16 &&
          s->train.source.text.truncate);
    CHECK(s->eval.source.csv.delimiter == '\t' && !s->eval.source.csv.header &&
          s->eval.source.csv.columns[0].index == 1);
    CHECK(s->eval.source.csv.columns[0].dtype == LOOM_CFG_U8 && s->eval.source.csv.columns[0].default_value == 255);
    it = NULL;
    CHECK_MSG(loom_data_open(&it, &s->train, NULL, &err) == LOOM_OK, "%s: %s", err.where, err.msg);
    if (it) {
        loom_elem *e;
        CHECK(loom_iter_next(it, &e, &err) == LOOM_OK && *(int64_t *)e->t[1].data == 5);
        CHECK(!memcmp(e->t[0].data, "hello", 6));
        loom_iter_close(it);
    }
    loom_config_free(s);
}

static const loom_test tests[] = {
    {"csv_records", test_csv_records},
    {"csv_source", test_csv_source},
    {"csv_errors", test_csv_errors},
    {"csv_save_restore", test_csv_save_restore},
    {"text", test_text},
    {"synthetic", test_synthetic},
    {"config", test_config},
    {0},
};

int main(void)
{
    return run_in_tmpdir("loom_sources", tests);
}
