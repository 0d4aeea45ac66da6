/* csv.c - the csv source: RFC 4180 files (quoted fields may hold the
 * delimiter, doubled quotes and newlines; CRLF or LF line ends) streamed
 * record by record through a buffered reader, never a whole file in memory.
 * Each declared column becomes a scalar feature of its dtype, selected by
 * header name (header = true; each file's first record) or by index;
 * undeclared columns are ignored. Errors name file:line:column and quote the
 * value. State = (epoch, file, byte offset, line): a restore reopens the file
 * at that byte, so resuming mid-file is exact without reading it again.
 * Cardinality is unknown (-2).
 * Threads: one thread at a time drives the stage (see data_internal.h). */
#include "data/data_internal.h"

#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- records --------------------------------------------------------------- */

void csv_record_fini_(csv_record *r)
{
    loom_free(r->text);
    loom_free(r->start);
    memset(r, 0, sizeof *r);
}

static int rec_putc(csv_record *r, char c)
{
    if (r->len == r->cap) {
        if (r->cap >= CSV_MAX_RECORD) return LOOM_EDATA;
        size_t nc = r->cap ? r->cap * 2 : 256;
        char *t = loom_realloc(r->text, nc);
        if (!t) return LOOM_ENOMEM;
        r->text = t;
        r->cap = nc;
    }
    r->text[r->len++] = c;
    return LOOM_OK;
}

/* Starts field n at the current end of text. */
static int rec_field(csv_record *r)
{
    if (r->n == r->fcap) {
        int nc = r->fcap ? r->fcap * 2 : 16;
        size_t *s = loom_realloc(r->start, (size_t)nc * sizeof *s);
        if (!s) return LOOM_ENOMEM;
        r->start = s;
        r->fcap = nc;
    }
    r->start[r->n++] = r->len;
    return LOOM_OK;
}

static int rec_err(int rc, const char *path, int64_t line, const csv_record *r, loom_err *err)
{
    char where[LOOM_PATH_MAX + 32];
    snprintf(where, sizeof where, "%s:%lld", path, (long long)line);
    if (rc == LOOM_ENOMEM) return loom_err_set(err, rc, where, "cannot allocate a CSV record of %zu bytes", r->cap);
    return loom_err_set(err, LOOM_EDATA, where, "CSV record is longer than %u bytes (an unterminated quote?)",
                        CSV_MAX_RECORD);
}

enum { ST_START, ST_PLAIN, ST_QUOTED, ST_AFTER_QUOTE };

int csv_read_record_(src_file *in, const char *path, char delim, int64_t *line, csv_record *rec, loom_err *err)
{
    char where[LOOM_PATH_MAX + 32];
    int rc, c;
    rec->len = 0;
    rec->n = 0;
    bool lone_cr = false; /* a blank-line skip consumed a '\r' that is data */
    for (;;) {            /* blank lines (LF or CRLF) hold no record */
        c = src_file_peek_(in);
        if (c < 0) {
            if (in->error)
                return src_file_read_err_(in, path, err);
            return LOOM_EEOF;
        }
        if (c == '\n') {
            src_file_getc_(in);
            (*line)++;
            continue;
        }
        if (c == '\r') {
            src_file_getc_(in);
            if (src_file_peek_(in) == '\n') {
                src_file_getc_(in);
                (*line)++;
                continue;
            }
            lone_cr = true;
        }
        break;
    }
    rec->line = *line;
    if ((rc = rec_field(rec))) return rec_err(rc, path, *line, rec, err);
    int st = ST_START;
    int64_t qline = 0;
    if (lone_cr) {
        st = ST_PLAIN;
        if ((rc = rec_putc(rec, '\r'))) return rec_err(rc, path, *line, rec, err);
    }
    for (;;) {
        c = src_file_getc_(in);
        if (c < 0) {
            if (in->error)
                return src_file_read_err_(in, path, err);
            if (st == ST_QUOTED) {
                snprintf(where, sizeof where, "%s:%lld", path, (long long)qline);
                loom_err_set(err, LOOM_EDATA, where, "unterminated quoted field (field %d): its opening quote is here and it is never closed",
                             rec->n);
                return loom_err_hint(err, "a '\"' inside a quoted field is written as \"\"");
            }
            break; /* the last record may lack a line end */
        }
        if (st == ST_START) {
            if (c == '"') {
                st = ST_QUOTED;
                qline = *line;
                continue;
            }
            st = ST_PLAIN;
        }
        if (st == ST_QUOTED) {
            if (c == '"') {
                if (src_file_peek_(in) == '"') {
                    src_file_getc_(in);
                } else {
                    st = ST_AFTER_QUOTE;
                    continue;
                }
            } else if (c == '\n') {
                (*line)++;
            }
            if ((rc = rec_putc(rec, (char)c))) return rec_err(rc, path, rec->line, rec, err);
            continue;
        }
        /* ST_PLAIN or ST_AFTER_QUOTE */
        if (c == delim) {
            if ((rc = rec_putc(rec, 0)) || (rc = rec_field(rec))) return rec_err(rc, path, rec->line, rec, err);
            st = ST_START;
            continue;
        }
        if (c == '\n' || (c == '\r' && src_file_peek_(in) == '\n')) {
            if (c == '\r') src_file_getc_(in);
            (*line)++;
            break;
        }
        if (st == ST_AFTER_QUOTE) {
            snprintf(where, sizeof where, "%s:%lld", path, (long long)*line);
            char shown[8];
            snprintf(shown, sizeof shown, c >= 0x20 && c < 0x7f ? "'%c'" : "0x%02x", c);
            loom_err_set(err, LOOM_EDATA, where, "field %d: %s after the closing quote (expected the delimiter or "
                         "a line end)", rec->n, shown);
            return loom_err_hint(err, "quote the whole field, and write a '\"' inside it as \"\"");
        }
        if ((rc = rec_putc(rec, (char)c))) return rec_err(rc, path, rec->line, rec, err);
    }
    if ((rc = rec_putc(rec, 0))) return rec_err(rc, path, rec->line, rec, err);
    return LOOM_OK;
}

static bool is_space(char c) { return c == ' ' || c == '\t'; }

bool csv_parse_value_(const char *s, loom_dtype dt, void *out)
{
    while (is_space(*s)) s++;
    if (!*s) return false;
    char *end;
    errno = 0;
    if (dt == LOOM_F32 || dt == LOOM_F64) {
        double v = strtod(s, &end);
        if (end == s) return false;
        while (is_space(*end)) end++;
        if (*end) return false;
        if (dt == LOOM_F32) {
            if (isfinite(v) && fabs(v) > FLT_MAX) return false;
            *(float *)out = (float)v;
        } else {
            if (errno == ERANGE && isinf(v)) return false;
            *(double *)out = v;
        }
        return true;
    }
    long long v = strtoll(s, &end, 10);
    if (end == s || errno == ERANGE) return false;
    while (is_space(*end)) end++;
    if (*end) return false;
    switch (dt) {
    case LOOM_U8:
        if (v < 0 || v > 255) return false;
        *(uint8_t *)out = (uint8_t)v;
        return true;
    case LOOM_I32:
        if (v < INT32_MIN || v > INT32_MAX) return false;
        *(int32_t *)out = (int32_t)v;
        return true;
    case LOOM_I64: *(int64_t *)out = v; return true;
    default: return false;
    }
}

/* ---- the source stage ------------------------------------------------------ */

typedef struct csv_source {
    dstage          s;
    src_cursor      cur;
    char            delim;
    bool            header;
    int             nf;
    loom_csv_column col[LOOM_MAX_FEATURES];
    int             field[LOOM_MAX_FEATURES]; /* each column's field index in the open file */
    void           *buf[LOOM_MAX_FEATURES];   /* the lent element's data */
    csv_record      rec;
    uint64_t        body;      /* offset of the first record after the header */
    int             on_nonfinite; /* loom_on_nonfinite */
    int64_t         skipped;      /* records with a non-finite value dropped this pass (on_nonfinite = skip) */
} csv_source;

/* Logs the pass's skipped records once, and starts a new count. */
static void report_skipped(csv_source *t)
{
    if (t->skipped)
        loom_warn("%s: csv source: %lld record%s with a NaN or infinite value skipped (on_nonfinite = skip)",
                  t->s.where, (long long)t->skipped, t->skipped == 1 ? "" : "s");
    t->skipped = 0;
}

static const loom_dtype csv_dtypes[] = {[LOOM_CFG_U8] = LOOM_U8, [LOOM_CFG_I32] = LOOM_I32, [LOOM_CFG_I64] = LOOM_I64,
                                        [LOOM_CFG_F32] = LOOM_F32, [LOOM_CFG_F64] = LOOM_F64, [LOOM_CSV_STRING] = LOOM_U8};

/* Opens files[fi], reads its header (resolving columns by name), then moves to
 * byte offset at `line` when offset is past the header (a restore). */
static int open_file(dstage *st, uint64_t offset, int64_t line, loom_err *err)
{
    csv_source *t = (csv_source *)st;
    src_cursor *cur = &t->cur;
    const char *path = cur->files[cur->fi];
    int rc = src_cursor_open_(cur, 0, 1, err);
    if (rc) return rc;
    for (int f = 0; f < t->nf; f++) t->field[f] = t->col[f].index;
    if (t->header) {
        rc = csv_read_record_(&cur->in, path, t->delim, &cur->line, &t->rec, err);
        if (rc == LOOM_EEOF) rc = LOOM_OK, t->rec.n = 0; /* an empty file: no records either */
        if (rc) goto fail;
        for (int f = 0; f < t->nf && t->rec.n > 0; f++) {
            int last = t->col[f].index + (t->col[f].count > 0 ? t->col[f].count : 1) - 1;
            if (t->col[f].index < 0 || last < t->rec.n) continue;
            char where[LOOM_PATH_MAX + 32];
            snprintf(where, sizeof where, "%s:%lld", path, (long long)t->rec.line);
            if (t->col[f].count > 0)
                rc = loom_err_set(err, LOOM_EDATA, where, "feature \"%s\" gathers fields %d-%d (0-based), but the "
                                  "header has only %d field%s (0-%d)", t->s.spec.name[f], t->col[f].index, last,
                                  t->rec.n, t->rec.n == 1 ? "" : "s", t->rec.n - 1);
            else
                rc = loom_err_set(err, LOOM_EDATA, where, "feature \"%s\" is field %d (0-based), but the header has "
                                  "only %d field%s (0-%d)", t->s.spec.name[f], last, t->rec.n, t->rec.n == 1 ? "" : "s",
                                  t->rec.n - 1);
            loom_err_hint(err, "the columns are declared at %s (%s.columns); fields are counted from 0", t->s.where,
                          t->s.path[0] ? t->s.path : "source");
            goto fail;
        }
        for (int f = 0; f < t->nf; f++) {
            if (t->col[f].index >= 0) continue;
            for (int i = 0; i < t->rec.n && t->field[f] < 0; i++) {
                const char *name = t->rec.text + t->rec.start[i];
                if (i == 0 && !strncmp(name, "\xef\xbb\xbf", 3)) name += 3; /* a UTF-8 byte order mark */
                if (!strcmp(name, t->col[f].column)) t->field[f] = i;
            }
            if (t->field[f] >= 0 || t->rec.n == 0) continue;
            char where[LOOM_PATH_MAX + 32], names[256];
            size_t k = 0;
            names[0] = 0;
            for (int i = 0; i < t->rec.n && k < sizeof names; i++)
                k += (size_t)snprintf(names + k, sizeof names - k, "%s\"%s\"", i ? ", " : "", t->rec.text + t->rec.start[i]);
            snprintf(where, sizeof where, "%s:%lld", path, (long long)t->rec.line);
            rc = loom_err_set(err, LOOM_EDATA, where, "column \"%s\" (feature \"%s\") is not in the header: %s",
                              t->col[f].column, t->s.spec.name[f], names);
            loom_err_hint(err, "the columns are declared at %s (%s.columns); names are case-sensitive", t->s.where,
                          t->s.path[0] ? t->s.path : "source");
            goto fail;
        }
    }
    t->body = cur->in.offset;
    if (offset > t->body) {
        src_cursor_close_file_(cur);
        if ((rc = src_cursor_open_(cur, offset, line, err))) goto fail;
    } else if (offset && offset < t->body) {
        rc = loom_err_set(err, LOOM_ECHECKPOINT, path, "the iterator state is at byte %llu, inside the header (%llu bytes)",
                          (unsigned long long)offset, (unsigned long long)t->body);
        goto fail;
    }
    return LOOM_OK;
fail:
    src_cursor_close_file_(cur);
    return rc;
}

static int field_err(const csv_source *t, int f, int idx, loom_err *err, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static int field_err(const csv_source *t, int f, int idx, loom_err *err, const char *fmt, ...)
{
    char where[LOOM_PATH_MAX + 48], msg[400];
    snprintf(where, sizeof where, "%s:%lld:%d", t->cur.files[t->cur.fi], (long long)t->rec.line, idx + 1);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return loom_err_set(err, LOOM_EDATA, where, "column %d (feature \"%s\"): %s", idx + 1, t->s.spec.name[f], msg);
}

/* Field idx of the current record into dst as feature f's dtype; *bad = 1 for a
 * non-finite value under on_nonfinite = skip. */
static int parse_field(csv_source *t, int f, int idx, void *dst, int *bad, loom_err *err)
{
    loom_dtype dt = t->s.spec.dtype[f];
    const char *v = t->rec.text + t->rec.start[idx];
    if ((int)t->col[f].dtype == LOOM_CSV_STRING) { /* the bytes as they are, zero-padded */
        size_t n = strlen(v), cap = (size_t)t->col[f].max_length;
        if (n > cap) {
            field_err(t, f, idx, err, "a string of %zu bytes (\"%.40s...\"), longer than max_length = %zu", n, v, cap);
            return loom_err_hint(err, "raise the column's max_length (at most %d)", LOOM_MAX_STRING);
        }
        memcpy(dst, v, n);
        memset((char *)dst + n, 0, cap - n);
        return LOOM_OK;
    }
    const char *p = v;
    while (is_space(*p)) p++;
    if (!*p) {
        if (!t->col[f].has_default) {
            field_err(t, f, idx, err, "empty value \"%s\"", v);
            return loom_err_hint(err, "give the column a default (default = 0;) to fill empty fields");
        }
        double d = t->col[f].default_value;
        switch (dt) {
        case LOOM_U8: *(uint8_t *)dst = (uint8_t)d; break;
        case LOOM_I32: *(int32_t *)dst = (int32_t)d; break;
        case LOOM_I64: *(int64_t *)dst = (int64_t)d; break;
        case LOOM_F32: *(float *)dst = (float)d; break;
        default: *(double *)dst = d; break;
        }
        return LOOM_OK;
    }
    if (!csv_parse_value_(v, dt, dst))
        return field_err(t, f, idx, err, "cannot parse \"%.200s\" as %s", v, loom_dtype_name(dt));
    double x = dt == LOOM_F32 ? *(float *)dst : dt == LOOM_F64 ? *(double *)dst : 0;
    if (!isfinite(x)) {
        if (t->on_nonfinite == LOOM_NONFINITE_SKIP) {
            *bad = 1;
            return LOOM_OK;
        }
        field_err(t, f, idx, err, "non-finite value \"%.200s\"", v);
        return loom_err_hint(err, "fix or drop the record, or set on_nonfinite = \"skip\"; in the dataset's "
                                  "group (data.train / data.eval) to drop such records");
    }
    return LOOM_OK;
}

static int csv_next(dstage *st, loom_elem **out, loom_err *err)
{
    csv_source *t = (csv_source *)st;
    src_cursor *cur = &t->cur;
    for (;;) {
        int rc = src_cursor_file_(cur, st, open_file, err);
        if (rc) return rc;
        rc = csv_read_record_(&cur->in, cur->files[cur->fi], t->delim, &cur->line, &t->rec, err);
        if (rc == LOOM_EEOF) {
            src_cursor_next_file_(cur);
            continue;
        }
        if (rc) return rc;
        int bad = 0;
        for (int f = 0; f < t->nf && !bad; f++) {
            int n = t->col[f].count > 0 ? t->col[f].count : 1;
            size_t esz = loom_dtype_size(st->spec.dtype[f]);
            if (t->field[f] + n - 1 >= t->rec.n) {
                int idx = t->field[f] + n - 1;
                if (n > 1) {
                    field_err(t, f, idx, err, "fields %d-%d (0-based) are declared, but the record has only %d field%s",
                              t->field[f], idx, t->rec.n, t->rec.n == 1 ? "" : "s");
                    return loom_err_hint(err, "the column range is at %s; fields are counted from 0", t->s.where);
                }
                return field_err(t, f, idx, err, "the record has only %d field%s", t->rec.n, t->rec.n == 1 ? "" : "s");
            }
            for (int k = 0; k < n && !bad; k++) {
                rc = parse_field(t, f, t->field[f] + k, (char *)t->buf[f] + (size_t)k * esz, &bad, err);
                if (rc) return rc;
            }
        }
        if (bad) {
            t->skipped++;
            continue;
        }
        *out = &st->out;
        return LOOM_OK;
    }
}

static int csv_rewind(dstage *st, int64_t epoch, loom_err *err)
{
    (void)err;
    report_skipped((csv_source *)st);
    src_cursor_rewind_(&((csv_source *)st)->cur, epoch);
    return LOOM_OK;
}

/* State: the cursor's (the open file's byte offset and line are of the next record). */
static void csv_save(dstage *st, loom_buf *b) { src_cursor_save_(&((csv_source *)st)->cur, b); }

static int csv_restore(dstage *st, loom_buf *b, loom_err *err)
{
    return src_cursor_restore_(&((csv_source *)st)->cur, b, "csv", 1, st, open_file, err);
}

static void csv_close(dstage *st)
{
    csv_source *t = (csv_source *)st;
    report_skipped(t);
    src_cursor_fini_(&t->cur);
    csv_record_fini_(&t->rec);
    for (int f = 0; f < LOOM_MAX_FEATURES; f++) loom_free(t->buf[f]);
    loom_free(t);
}

static const dstage_ops csv_ops = {
    .next = csv_next, .rewind = csv_rewind, .save = csv_save, .restore = csv_restore, .close = csv_close,
};

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

int csv_source_open_(dstage **out, const loom_source_spec *src, loom_err *err)
{
    *out = NULL;
    csv_source *t = loom_calloc(1, sizeof *t);
    if (!t) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the csv source");
    dstage *st = &t->s;
    dstage_init_(st, &csv_ops, NULL, 0, &src->loc);
    snprintf(st->name, sizeof st->name, "csv");
    int rc = LOOM_OK;
    t->nf = src->n_features;
    t->header = src->csv.header;
    t->on_nonfinite = src->on_nonfinite;
    t->delim = src->csv.delimiter ? src->csv.delimiter : ',';
    if (t->nf < 1 || t->nf > LOOM_MAX_FEATURES || src->n_patterns < 1 || src->n_patterns > LOOM_MAX_FILE_PATTERNS ||
        t->delim == '"' || t->delim == '\n' || t->delim == '\r') {
        rc = dstage_err_(st, err, LOOM_ECONFIG,
                         "csv source needs 1 to %d columns, 1 to %d file patterns and a delimiter other than a quote "
                         "or line end; got %d, %d and 0x%02x",
                         LOOM_MAX_FEATURES, LOOM_MAX_FILE_PATTERNS, t->nf, src->n_patterns, (unsigned char)t->delim);
        goto fail;
    }
    uint64_t h = 0xcbf29ce484222325ull;
    st->spec.n = st->out.n = t->nf;
    for (int f = 0; f < t->nf; f++) {
        const loom_csv_column *c = &src->csv.columns[f];
        bool str = (int)c->dtype == LOOM_CSV_STRING;
        if ((unsigned)c->dtype > LOOM_CSV_STRING || (str && (c->count > 0 || c->max_length < 1 || c->max_length > LOOM_MAX_STRING)) || (c->index < 0 && (!t->header || !c->column[0])) || c->count < 0 ||
            (c->count > 0 && c->index < 0)) {
            rc = dstage_err_(st, err, LOOM_ECONFIG, "column \"%s\": bad dtype %d, or no index (needed when header = false)",
                             src->feature[f], (int)c->dtype);
            goto fail;
        }
        for (int g = 0; g < f; g++)
            if (!strcmp(src->feature[g], src->feature[f])) {
                rc = dstage_err_(st, err, LOOM_ECONFIG, "feature \"%s\" is declared twice", src->feature[f]);
                goto fail;
            }
        t->col[f] = *c;
        snprintf(st->spec.name[f], LOOM_NAME_MAX, "%s", src->feature[f]);
        st->spec.dtype[f] = csv_dtypes[c->dtype];
        st->spec.shape[f] = str ? (loom_shape){.rank = 1, .dim = {c->max_length}}
                          : c->count > 0 ? (loom_shape){.rank = 1, .dim = {c->count}} : (loom_shape){0};
        st->maxshape[f] = st->spec.shape[f];
        if (!(t->buf[f] = loom_alloc_aligned(str ? (size_t)c->max_length : (size_t)(c->count > 0 ? c->count : 1) * 8))) {
            rc = loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate feature \"%s\"", src->feature[f]);
            goto fail;
        }
        st->out.t[f] = (loom_tensor){.dtype = st->spec.dtype[f], .shape = st->spec.shape[f], .data = t->buf[f]};
        st->mut[f] = 1; /* refilled by every next() */
        h = fnv(h, src->feature[f], strlen(src->feature[f]) + 1);
        h = fnv(h, c->column, strlen(c->column) + 1);
        int64_t fields[5] = {c->dtype, c->index, c->has_default, c->count, str ? c->max_length : 0};
        h = fnv(h, fields, sizeof fields);
        h = fnv(h, &c->default_value, sizeof c->default_value);
    }
    if ((rc = source_files_expand_(st, src, "csv", &t->cur.files, &t->cur.n_files, err))) goto fail;
    h = source_files_hash_(h, t->cur.files, t->cur.n_files);
    st->card = -2;
    snprintf(st->desc, sizeof st->desc, "csv(%lld files,delim 0x%02x,%s,%016llx)", (long long)t->cur.n_files,
             (unsigned char)t->delim, t->header ? "header" : "no header", (unsigned long long)h);
    /* the first file's header, so that a column missing from it fails at open (and in `loom check`) */
    if ((rc = open_file(st, 0, 1, err))) goto fail;
    src_cursor_close_file_(&t->cur);
    *out = st;
    return LOOM_OK;
fail:
    csv_close(st);
    return rc;
}
