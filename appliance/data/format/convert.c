/* convert.c - IDX or CSV data into sharded TFRecord files of
 * tf.train.Examples (`loom records convert`; the command line and the report
 * it prints stay in cli/records.c). Shards are written contiguously and
 * committed (renamed) one at a time; a failed conversion removes the shards
 * it wrote. CSV files are read with the csv source's RFC 4180 reader
 * (source/csv.c), over the file's bytes (gzip inflated): two passes, the
 * first to infer each column's feature kind, the second to write.
 * Threads: none of its own; one conversion per call. */
#include "data/data_internal.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- shards ---------------------------------------------------------------- */

/* Writes `total` records into `shards` files, contiguously. Shards are
 * committed (renamed) one at a time; sharder_abort removes them again. */
typedef struct sharder {
    const char          *prefix, *ext;
    loom_compression     comp;
    int                  shards, cur;   /* cur: shard open in w, -1 before the first */
    int64_t              total, written;
    loom_tfrecord_writer *w;
    char               (*path)[LOOM_PATH_MAX];
    int64_t             *records;       /* per shard */
    int64_t             *bytes;         /* per shard, the file's size once committed */
    int                  committed;     /* shards 0..committed-1 are in place */
} sharder;

static const char *comp_ext(loom_compression c)
{
    switch (c) {
    case LOOM_COMP_GZIP: return ".tfrecord.gz";
    case LOOM_COMP_ZLIB: return ".tfrecord.zz";
    case LOOM_COMP_ZSTD: return ".tfrecord.zst";
    default: return ".tfrecord";
    }
}

static int sharder_init(sharder *s, const loom_convert_opts *o, loom_err *err)
{
    memset(s, 0, sizeof *s);
    s->prefix = o->output;
    s->ext = comp_ext(o->comp);
    s->comp = o->comp;
    s->shards = o->shards;
    s->cur = -1;
    s->path = loom_calloc((size_t)s->shards, sizeof *s->path);
    s->records = loom_calloc((size_t)s->shards, sizeof *s->records);
    s->bytes = loom_calloc((size_t)s->shards, sizeof *s->bytes);
    if (!s->path || !s->records || !s->bytes) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate %d shard names", s->shards);
    for (int i = 0; i < s->shards; i++) {
        int k = snprintf(s->path[i], LOOM_PATH_MAX, "%s-%05d-of-%05d%s", s->prefix, i, s->shards, s->ext);
        if (k < 0 || k >= LOOM_PATH_MAX - 8) /* room for ".tmp" */
            return loom_err_set(err, LOOM_EUSAGE, NULL, "--output \"%s\": the shard names would be too long (limit %d bytes)",
                                s->prefix, LOOM_PATH_MAX - 8);
    }
    /* every shard's path before the first is written: a FIFO, a device or a
     * directory among them is refused with nothing written */
    for (int i = 0; i < s->shards; i++) {
        char target[LOOM_PATH_MAX];
        int rc = loom_output_target(s->path[i], target, sizeof target, err);
        if (rc) return rc;
    }
    return LOOM_OK;
}

static void sharder_fini(sharder *s)
{
    loom_tfrecord_writer_abort(s->w);
    s->w = NULL;
    loom_free(s->path);
    loom_free(s->records);
    loom_free(s->bytes);
}

/* Commits the open shard and records its size. */
static int sharder_commit(sharder *s, loom_err *err)
{
    loom_tfrecord_writer *w = s->w;
    s->w = NULL;
    int rc = loom_tfrecord_writer_close(w, err);
    if (rc) return rc;
    s->committed = s->cur + 1;
    struct stat st;
    s->bytes[s->cur] = stat(s->path[s->cur], &st) == 0 ? (int64_t)st.st_size : 0;
    return LOOM_OK;
}

/* Moves on until the open shard is the one record `written` belongs in
 * (all shards when written == total), committing the ones passed. */
static int sharder_advance(sharder *s, loom_err *err)
{
    for (;;) {
        if (s->cur >= 0 && s->written < s->total * (s->cur + 1) / s->shards) return LOOM_OK;
        if (s->w) {
            int rc = sharder_commit(s, err);
            if (rc) return rc;
        }
        if (s->cur + 1 >= s->shards) return LOOM_OK;
        if (s->cur < 0) { /* the first shard: create PREFIX's directory, as train creates the model dir */
            char dir[LOOM_PATH_MAX];
            snprintf(dir, sizeof dir, "%s", s->path[0]);
            char *slash = strrchr(dir, '/');
            if (slash && slash != dir) {
                *slash = 0;
                int rc = loom_mkdirs(dir, err);
                if (rc) return rc;
            }
        }
        s->cur++;
        int rc = loom_tfrecord_writer_open(&s->w, s->path[s->cur], s->comp, err);
        if (rc) return rc;
    }
}

static int sharder_put(sharder *s, const uint8_t *data, size_t len, loom_err *err)
{
    int rc = sharder_advance(s, err);
    if (rc) return rc;
    LOOM_ASSERT(s->w && s->written < s->total);
    if ((rc = loom_tfrecord_writer_write(s->w, data, len, err))) return rc;
    s->records[s->cur]++;
    s->written++;
    return LOOM_OK;
}

/* Commits the remaining shards (empty ones too). */
static int sharder_finish(sharder *s, loom_err *err)
{
    LOOM_ASSERT(s->written == s->total);
    return sharder_advance(s, err);
}

/* Removes the open shard's .tmp and the shards this run committed. */
static void sharder_abort(sharder *s)
{
    loom_tfrecord_writer_abort(s->w);
    s->w = NULL;
    for (int i = 0; i < s->committed; i++) unlink(s->path[i]);
    s->committed = 0;
}

/* ---- IDX ------------------------------------------------------------------- */

static bool host_is_little_endian(void)
{
    const uint16_t one = 1;
    uint8_t b;
    memcpy(&b, &one, 1);
    return b == 1;
}

static int convert_idx(const loom_convert_opts *o, sharder *sh, loom_err *err)
{
    loom_tensor img = {0}, lab = {0};
    loom_example_builder b;
    loom_example_builder_init(&b);
    int64_t *lv = NULL;
    uint8_t *swap = NULL;
    int rc = loom_idx_load(o->images, &img, err);
    if (!rc) rc = loom_idx_load(o->labels, &lab, err);
    if (rc) goto done;
    int64_t n = img.shape.dim[0];
    if (lab.shape.dim[0] != n) {
        rc = loom_err_set(err, LOOM_EDATA, o->labels, "holds %lld labels but %s holds %lld images", (long long)lab.shape.dim[0],
                          o->images, (long long)n);
        goto done;
    }
    size_t item_bytes = n ? loom_tensor_nbytes(&img) / (size_t)n : 0;
    int64_t per = n ? loom_shape_numel(&lab.shape) / n : 0;
    size_t esz = loom_dtype_size(img.dtype);
    bool need_swap = esz > 1 && !host_is_little_endian();
    lv = loom_alloc((size_t)(per ? per : 1) * sizeof *lv);
    swap = need_swap ? loom_alloc(item_bytes ? item_bytes : 1) : NULL;
    if (!lv || (need_swap && !swap)) {
        rc = loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a record buffer");
        goto done;
    }
    bool float_labels = lab.dtype == LOOM_F32 || lab.dtype == LOOM_F64;
    sh->total = n;
    for (int64_t i = 0; i < n; i++) {
        for (int64_t j = 0; j < per; j++) {
            double v = loom_tensor_get(&lab, i * per + j);
            if (float_labels && (!(v == floor(v)) || fabs(v) > 9.0e18)) {
                rc = loom_err_set(err, LOOM_EDATA, o->labels, "label of item %lld is %g, not an integer", (long long)i, v);
                goto done;
            }
            lv[j] = (int64_t)v;
        }
        const uint8_t *item = (const uint8_t *)img.data + (size_t)i * item_bytes;
        if (need_swap) { /* tf.io.decode_raw reads little-endian by default */
            for (size_t e = 0; e < item_bytes; e += esz)
                for (size_t k = 0; k < esz; k++) swap[e + k] = item[e + esz - 1 - k];
            item = swap;
        }
        loom_bytes_view view = {item, item_bytes};
        loom_example_builder_reset(&b);
        loom_example_add_bytes(&b, "image", &view, 1);
        loom_example_add_int64s(&b, "label", lv, per);
        const uint8_t *data;
        size_t len;
        if ((rc = loom_example_finish(&b, &data, &len, err))) goto done;
        if ((rc = sharder_put(sh, data, len, err))) goto done;
    }
    rc = sharder_finish(sh, err);
done:
    loom_free(lv);
    loom_free(swap);
    loom_example_builder_fini(&b);
    loom_tensor_fini(&img);
    loom_tensor_fini(&lab);
    return rc;
}

/* ---- CSV (RFC 4180, through the csv source's reader) ------------------------ */

typedef struct csv_reader {
    const char    *path;
    const uint8_t *text;
    size_t         len;
    src_file       in;
    int64_t        line; /* of the next byte */
    csv_record     rec;  /* the current row */
} csv_reader;

/* To the first row, past a UTF-8 byte order mark. */
static void csv_rewind(csv_reader *c)
{
    src_file_close_(&c->in);
    size_t bom = c->len >= 3 && !memcmp(c->text, "\xef\xbb\xbf", 3) ? 3 : 0;
    src_file_mem_(&c->in, c->text + bom, c->len - bom);
    c->line = 1;
}

static void csv_init(csv_reader *c, const char *path, const uint8_t *text, size_t len)
{
    memset(c, 0, sizeof *c);
    c->path = path;
    c->text = text;
    c->len = len;
    csv_rewind(c);
}

static void csv_fini(csv_reader *c)
{
    src_file_close_(&c->in);
    csv_record_fini_(&c->rec);
}

/* Reads the next row; LOOM_EEOF when none is left (blank lines are skipped). */
static int csv_next(csv_reader *c, loom_err *err)
{
    return csv_read_record_(&c->in, c->path, ',', &c->line, &c->rec, err);
}

static const char *csv_field(const csv_reader *c, int j) { return c->rec.text + c->rec.start[j]; }

/* The field's length in bytes (it may hold NULs, unlike what strlen sees). */
static size_t csv_field_len(const csv_reader *c, int j)
{
    size_t end = j + 1 < c->rec.n ? c->rec.start[j + 1] : c->rec.len;
    return end - c->rec.start[j] - 1;
}

static const char *skip_blanks(const char *s)
{
    while (*s == ' ' || *s == '\t') s++;
    return s;
}

/* A finite decimal number within float range; not "nan", "inf" or hex. */
static bool csv_num(const char *s, double *out)
{
    s = skip_blanks(s);
    char c0 = s[0] == '+' || s[0] == '-' ? s[1] : s[0];
    if (!((c0 >= '0' && c0 <= '9') || c0 == '.') || strpbrk(s, "xX")) return false;
    char *end;
    double v = strtod(s, &end);
    if (end == s || *skip_blanks(end) || !isfinite(v) || fabs(v) > 3.4028234663852886e38) return false;
    *out = v;
    return true;
}

typedef struct csv_col {
    char             *name;     /* the feature's name (owned) */
    bool              all_int, all_num;
    int64_t           nonempty; /* non-empty values seen */
    loom_feature_kind kind;
} csv_col;

/* The columns found by pass 1, into res (names copied). */
static int report_columns(loom_convert_result *res, const csv_col *cols, int ncols, int label, int64_t rows, loom_err *err)
{
    res->col_name = loom_calloc((size_t)ncols, sizeof *res->col_name);
    res->col_kind = loom_calloc((size_t)ncols, sizeof *res->col_kind);
    if (!res->col_name || !res->col_kind) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate %d columns", ncols);
    for (int j = 0; j < ncols; j++) {
        if (!(res->col_name[j] = loom_strdup(cols[j].name)))
            return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a column name");
        res->col_kind[j] = cols[j].kind;
    }
    res->ncols = ncols;
    res->label = label;
    res->rows = rows;
    return LOOM_OK;
}

/* Where a CSV row's errors point: path:line. */
static int row_err(const csv_reader *c, int code, loom_err *err, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static int row_err(const csv_reader *c, int code, loom_err *err, const char *fmt, ...)
{
    char where[LOOM_PATH_MAX + 32], msg[512];
    snprintf(where, sizeof where, "%s:%lld", c->path, (long long)c->rec.line);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return loom_err_set(err, code, where, "%s", msg);
}

/* One CSV conversion: the reader, the columns, what pass 1 found. */
typedef struct csv_conv {
    const loom_convert_opts *o;
    csv_reader               c;
    csv_col                 *cols;  /* ncols of them, owned */
    int                      ncols, label;
    int64_t                  rows;
} csv_conv;

/* The header row: every column named, once; the label column found. */
static int csv_header(csv_conv *cv, loom_err *err)
{
    int rc = csv_next(&cv->c, err);
    if (rc == LOOM_EEOF) rc = loom_err_set(err, LOOM_EDATA, cv->o->csv, "empty CSV file: a header row naming the columns is required");
    if (rc) return rc;
    cv->ncols = cv->c.rec.n;
    if (!(cv->cols = loom_calloc((size_t)cv->ncols, sizeof *cv->cols)))
        return loom_err_set(err, LOOM_ENOMEM, cv->o->csv, "cannot allocate %d columns", cv->ncols);
    for (int j = 0; j < cv->ncols; j++) {
        const char *name = csv_field(&cv->c, j);
        if (csv_field_len(&cv->c, j) == 0 || strlen(name) != csv_field_len(&cv->c, j)) {
            return row_err(&cv->c, LOOM_EDATA, err, "column %d of the header has %s name (the first row must name every column)",
                           j + 1, csv_field_len(&cv->c, j) ? "a NUL byte in its" : "an empty");
        }
        for (int k = 0; k < j; k++)
            if (!strcmp(cv->cols[k].name, name)) {
                return row_err(&cv->c, LOOM_EDATA, err, "column \"%s\" appears twice in the header (columns %d and %d)", name,
                               k + 1, j + 1);
            }
        if (!(cv->cols[j].name = loom_strdup(name))) {
            return loom_err_set(err, LOOM_ENOMEM, cv->o->csv, "cannot allocate a column name");
        }
        cv->cols[j].all_int = cv->cols[j].all_num = true;
        if (cv->o->label_column && !strcmp(name, cv->o->label_column)) cv->label = j;
    }
    if (cv->o->label_column) {
        if (cv->label < 0) {
            char list[400];
            size_t k = 0;
            for (int j = 0; j < cv->ncols && k < sizeof list - 8; j++)
                k += (size_t)snprintf(list + k, sizeof list - k, "%s%s", j ? ", " : "", cv->cols[j].name);
            if (k >= sizeof list - 8) snprintf(list + sizeof list - 8, 8, ", ...");
            return loom_err_set(err, LOOM_EUSAGE, cv->o->csv, "--label-column \"%s\": no such column (columns: %s)", cv->o->label_column, list);
        }
        for (int j = 0; j < cv->ncols; j++)
            if (j != cv->label && !strcmp(cv->cols[j].name, "label")) {
                rc = loom_err_set(err, LOOM_EUSAGE, cv->o->csv, "--label-column \"%s\" would be stored as the feature \"label\", "
                                  "but column %d is already named \"label\"", cv->o->label_column, j + 1);
                loom_err_hint(err, "omit --label-column to keep every column's own name");
                return rc;
            }
    }
    return LOOM_OK;
}

/* Pass 1: every row, to infer each column's kind (and check the label's). */
static int csv_infer(csv_conv *cv, loom_err *err)
{
    int rc;
    while ((rc = csv_next(&cv->c, err)) == LOOM_OK) {
        if (cv->c.rec.n != cv->ncols) {
            return row_err(&cv->c, LOOM_EDATA, err, "row has %d field%s but the header has %d columns", cv->c.rec.n,
                           cv->c.rec.n == 1 ? "" : "s", cv->ncols);
        }
        for (int j = 0; j < cv->ncols; j++) {
            const char *f = csv_field(&cv->c, j);
            size_t fl = csv_field_len(&cv->c, j);
            if (fl == 0) {
                if (j == cv->label) {
                    return row_err(&cv->c, LOOM_EDATA, err, "empty label (column \"%s\")", cv->o->label_column);
                }
                continue;
            }
            bool nul = strlen(f) != fl;
            int64_t iv;
            double dv;
            cv->cols[j].nonempty++;
            if (cv->cols[j].all_int && (nul || !csv_parse_value_(f, LOOM_I64, &iv))) cv->cols[j].all_int = false;
            if (cv->cols[j].all_num && !cv->cols[j].all_int && (nul || !csv_num(f, &dv))) cv->cols[j].all_num = false;
            if (j == cv->label && !cv->cols[j].all_num) {
                return row_err(&cv->c, LOOM_EDATA, err, "label \"%.64s\" (column \"%s\") is not a number", f, cv->o->label_column);
            }
        }
        cv->rows++;
    }
    if (rc != LOOM_EEOF) return rc;
    for (int j = 0; j < cv->ncols; j++) {
        cv->cols[j].kind = !cv->cols[j].nonempty ? LOOM_FEATURE_BYTES
                           : cv->cols[j].all_int ? LOOM_FEATURE_INT64
                           : cv->cols[j].all_num ? LOOM_FEATURE_FLOAT
                                                 : LOOM_FEATURE_BYTES;
        if (j == cv->label) {
            loom_free(cv->cols[j].name);
            if (!(cv->cols[j].name = loom_strdup("label"))) {
                return loom_err_set(err, LOOM_ENOMEM, cv->o->csv, "cannot allocate a column name");
            }
        }
    }
    return LOOM_OK;
}

/* Pass 2: one Example per row, into sh. */
static int csv_write(csv_conv *cv, sharder *sh, loom_err *err)
{
    loom_example_builder b;
    loom_example_builder_init(&b);
    sh->total = cv->rows;
    csv_rewind(&cv->c);
    int rc = csv_next(&cv->c, err); /* the header */
    while (!rc && (rc = csv_next(&cv->c, err)) == LOOM_OK) {
        loom_example_builder_reset(&b);
        for (int j = 0; j < cv->ncols; j++) {
            const char *f = csv_field(&cv->c, j);
            size_t fl = csv_field_len(&cv->c, j);
            int64_t iv;
            double dv;
            float fv;
            loom_bytes_view view = {(const uint8_t *)f, fl};
            switch (cv->cols[j].kind) {
            case LOOM_FEATURE_INT64:
                if (fl && !csv_parse_value_(f, LOOM_I64, &iv)) LOOM_ASSERT(!"integer column changed between passes");
                loom_example_add_int64s(&b, cv->cols[j].name, &iv, fl ? 1 : 0);
                break;
            case LOOM_FEATURE_FLOAT:
                if (fl && !csv_num(f, &dv)) LOOM_ASSERT(!"number column changed between passes");
                fv = fl ? (float)dv : 0.0f;
                loom_example_add_floats(&b, cv->cols[j].name, &fv, fl ? 1 : 0);
                break;
            default: loom_example_add_bytes(&b, cv->cols[j].name, &view, 1); break;
            }
        }
        const uint8_t *data;
        size_t n;
        if (!(rc = loom_example_finish(&b, &data, &n, err))) rc = sharder_put(sh, data, n, err);
    }
    loom_example_builder_fini(&b);
    return rc == LOOM_EEOF ? sharder_finish(sh, err) : rc;
}

static int convert_csv(const loom_convert_opts *o, sharder *sh, loom_convert_result *res, loom_err *err)
{
    uint8_t *text = NULL;
    size_t len = 0;
    int rc = loom_read_file(o->csv, &text, &len, err); /* plain or gzip */
    if (rc) return rc;
    csv_conv cv = {.o = o, .label = -1};
    csv_init(&cv.c, o->csv, text, len);
    if (!(rc = csv_header(&cv, err)) && !(rc = csv_infer(&cv, err)) &&
        !(rc = report_columns(res, cv.cols, cv.ncols, cv.label, cv.rows, err)))
        rc = csv_write(&cv, sh, err);
    for (int j = 0; cv.cols && j < cv.ncols; j++) loom_free(cv.cols[j].name);
    loom_free(cv.cols);
    csv_fini(&cv.c);
    loom_free(text);
    return rc;
}

/* ---- the conversion --------------------------------------------------------- */

/* ---- a dataset's source ---------------------------------------------------- */

/* The elements of o->dataset's source, one Example each: integer features as
 * int64_list, float features as float_list, uint8 features of rank >= 1 as
 * one bytes value (as IDX images), all in the source's order. */
static int convert_dataset(const loom_convert_opts *o, sharder *sh, loom_err *err)
{
    loom_dataset_spec *ds = loom_calloc(1, sizeof *ds);
    if (!ds) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a dataset spec");
    ds->present = true;
    ds->loc = o->dataset->loc;
    ds->source = o->dataset->source;
    ds->shard_policy = o->dataset->shard_policy;
    ds->on_nonfinite = o->dataset->on_nonfinite;
    ds->options = o->dataset->options;
    loom_data_ctx ctx = {.seed = o->seed, .threads = 0, .name = "records"};
    loom_iter *it = NULL;
    loom_example_builder b;
    loom_example_builder_init(&b);
    int64_t *iv = NULL;
    float *fv = NULL;
    int rc = loom_data_open(&it, ds, &ctx, err);
    if (rc) goto done;
    int64_t card = loom_iter_cardinality(it), n = o->count > 0 ? o->count : card;
    if (n < 0) {
        char w[LOOM_PATH_MAX + 16];
        rc = loom_err_set(err, LOOM_EUSAGE, loom_loc_str(&ds->source.loc, w, sizeof w),
                          "the source of data.train is infinite (or of unknown length)");
        loom_err_hint(err, "give --count N, the number of records to write");
        goto done;
    }
    if (card >= 0 && card < n) n = card;
    const loom_elem_spec *es = loom_iter_spec(it);
    int64_t maxel = 1;
    for (int f = 0; f < es->n; f++) maxel = loom_shape_numel(&es->shape[f]) > maxel ? loom_shape_numel(&es->shape[f]) : maxel;
    if (!(iv = loom_alloc((size_t)maxel * sizeof *iv)) || !(fv = loom_alloc((size_t)maxel * sizeof *fv))) {
        rc = loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a record buffer");
        goto done;
    }
    sh->total = n;
    for (int64_t i = 0; i < n; i++) {
        loom_elem *e;
        if ((rc = loom_iter_next(it, &e, err))) {
            if (rc == LOOM_EEOF) rc = loom_err_set(err, LOOM_EDATA, NULL, "the source ended after %lld elements", (long long)i);
            goto done;
        }
        loom_example_builder_reset(&b);
        for (int f = 0; f < e->n; f++) {
            const loom_tensor *t = &e->t[f];
            int64_t m = loom_shape_numel(&t->shape);
            if (t->dtype == LOOM_U8 && t->shape.rank >= 1) {
                loom_bytes_view v = {t->data, (size_t)m};
                loom_example_add_bytes(&b, es->name[f], &v, 1);
            } else if (t->dtype == LOOM_F32 || t->dtype == LOOM_F64) {
                for (int64_t j = 0; j < m; j++) fv[j] = (float)loom_tensor_get(t, j);
                loom_example_add_floats(&b, es->name[f], fv, m);
            } else {
                for (int64_t j = 0; j < m; j++)
                    iv[j] = t->dtype == LOOM_I64 ? ((const int64_t *)t->data)[j] : (int64_t)loom_tensor_get(t, j);
                loom_example_add_int64s(&b, es->name[f], iv, m);
            }
        }
        const uint8_t *data;
        size_t len;
        if ((rc = loom_example_finish(&b, &data, &len, err))) goto done;
        if ((rc = sharder_put(sh, data, len, err))) goto done;
    }
    rc = sharder_finish(sh, err);
done:
    loom_free(iv);
    loom_free(fv);
    loom_example_builder_fini(&b);
    loom_iter_close(it);
    loom_free(ds);
    return rc;
}

int loom_records_convert(const loom_convert_opts *o, loom_convert_result *res, loom_err *err)
{
    memset(res, 0, sizeof *res);
    res->label = -1;
    sharder sh;
    int rc = sharder_init(&sh, o, err);
    if (!rc) rc = o->dataset ? convert_dataset(o, &sh, err) : o->csv ? convert_csv(o, &sh, res, err) : convert_idx(o, &sh, err);
    if (rc) sharder_abort(&sh);
    /* the shards' names, records and sizes move to res */
    res->shards = sh.shards;
    res->total = sh.total;
    res->path = sh.path;
    res->records = sh.records;
    res->bytes = sh.bytes;
    sh.path = NULL;
    sh.records = sh.bytes = NULL;
    sharder_fini(&sh);
    return rc;
}

void loom_convert_result_fini(loom_convert_result *res)
{
    for (int j = 0; res->col_name && j < res->ncols; j++) loom_free(res->col_name[j]);
    loom_free(res->col_name);
    loom_free(res->col_kind);
    loom_free(res->path);
    loom_free(res->records);
    loom_free(res->bytes);
    memset(res, 0, sizeof *res);
}
