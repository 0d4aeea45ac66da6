/* text.c - the text source (tf.data.TextLineDataset without a string
 * dtype): files streamed line by line, each line an element of two features,
 * "line" uint8 (max_length) holding its bytes zero-padded, and "length" int64 ()
 * the number of bytes kept. The line end ('\n', and a '\r' before it) is
 * removed; empty lines are elements of length 0; a last line without '\n'
 * counts. A line longer than max_length is an error naming file:line, or cut
 * to max_length with truncate = true. State = (epoch, file, byte offset,
 * line), so resuming mid-file reopens the file at that byte. Cardinality is
 * unknown (-2). With record_separator (fortune files' "%"), an element is a
 * record: the lines up to a line equal to the separator (or the file's end),
 * joined with '\n'; empty records are skipped; max_length bounds the record.
 * Threads: one thread at a time drives the stage (see data_internal.h). */
#include "data/data_internal.h"

#include <string.h>

typedef struct text_source {
    dstage     s;
    src_cursor cur;
    int64_t    max_length;
    bool       truncate;
    uint8_t   *line;   /* (max_length + 1): the lent "line" */
    int64_t   *length; /* the lent "length" */
    int64_t   *file;   /* file_feature: the lent index of the element's file, NULL without */
    char       sep[16]; /* record_separator, sep_len bytes; 0: lines */
    int64_t    sep_len;
    int64_t    rec_fi;  /* the file and byte offset the last element began at (text_source_where_) */
    uint64_t   rec_off;
    int64_t   *cr;      /* record mode: where in the last record a '\r' was dropped (before a '\n' join) */
    int64_t    n_cr, cap_cr;
} text_source;

static const dstage_ops text_ops;

static int open_file(dstage *st, uint64_t offset, int64_t line, loom_err *err)
{
    return src_cursor_open_(&((text_source *)st)->cur, offset, line, err);
}

/* Reads one line (from its first byte c) onto t->line at n (bytes past
 * max_length + 1 are counted, not kept); its first bytes also into head (for
 * the separator test). Returns the byte after it: '\n', or -1 at the end. */
static int read_line(text_source *t, int c, int64_t *n, char *head, int64_t *len)
{
    src_file *in = &t->cur.in;
    int64_t cap = t->max_length + 1, start = *n; /* one more byte: room for a '\r' to drop */
    int last = -1;
    for (; c >= 0 && c != '\n'; c = src_file_getc_(in)) {
        if (*n < cap) t->line[*n] = (uint8_t)c;
        if (*n - start < (int64_t)sizeof t->sep) head[*n - start] = (char)c;
        (*n)++;
        last = c;
    }
    if (last == '\r') { /* CRLF: the file offsets of the bytes after it are one more (text_source_where_) */
        (*n)--;
        if (t->sep_len && t->n_cr < t->cap_cr) t->cr[t->n_cr++] = *n;
    }
    *len = *n - start;
    return c;
}

static int text_next(dstage *st, loom_elem **out, loom_err *err)
{
    text_source *t = (text_source *)st;
    src_cursor *cur = &t->cur;
    for (;;) {
        int rc = src_cursor_file_(cur, st, open_file, err);
        if (rc) return rc;
        int c = src_file_getc_(&cur->in);
        if (c < 0) {
            if (cur->in.error)
                return src_file_read_err_(&cur->in, cur->files[cur->fi], err);
            src_cursor_next_file_(cur);
            continue;
        }
        int64_t at = cur->line, n = 0, len;
        t->rec_fi = cur->fi;
        t->rec_off = cur->in.offset - 1;
        t->n_cr = 0;
        char head[sizeof t->sep];
        bool empty = false;
        for (;;) { /* the lines of a record (one without a separator) */
            int64_t start = n;
            c = read_line(t, c, &n, head, &len);
            if (c < 0 && cur->in.error)
                return src_file_read_err_(&cur->in, cur->files[cur->fi], err);
            cur->line++;
            if (!t->sep_len) break;
            if (len == t->sep_len && !memcmp(head, t->sep, (size_t)len)) { /* the separator ends the record */
                empty = start == 0;
                n = start ? start - 1 : 0; /* without the newline that joined it */
                break;
            }
            if (c < 0 || (c = src_file_getc_(&cur->in)) < 0) { /* the file's end ends it too */
                if (cur->in.error) return src_file_read_err_(&cur->in, cur->files[cur->fi], err);
                break;
            }
            if (n < t->max_length + 1) t->line[n] = '\n';
            n++;
        }
        if (empty) continue; /* two separators in a row, or one at a file's start: no record */
        if (n > t->max_length) {
            if (!t->truncate) {
                char where[LOOM_PATH_MAX + 32];
                snprintf(where, sizeof where, "%s:%lld", cur->files[cur->fi], (long long)at);
                loom_err_set(err, LOOM_EDATA, where, "%s of %lld bytes is longer than max_length = %lld",
                             t->sep_len ? "record" : "line", (long long)n, (long long)t->max_length);
                return loom_err_hint(err, "raise max_length (at %s) or set truncate = true", st->where);
            }
            n = t->max_length;
        }
        memset(t->line + n, 0, (size_t)(t->max_length - n));
        *t->length = n;
        if (t->file) *t->file = t->rec_fi;
        *out = &st->out;
        return LOOM_OK;
    }
}

bool text_source_where_(const dstage *st, int64_t byte, char *file, size_t n, uint64_t *offset)
{
    if (!st || st->ops != &text_ops) return false;
    const text_source *t = (const text_source *)st;
    if (t->rec_fi < 0 || t->rec_fi >= t->cur.n_files || (t->n_cr >= t->cap_cr && t->sep_len)) return false;
    snprintf(file, n, "%s", t->cur.files[t->rec_fi]);
    int64_t skipped = 0; /* the '\r's dropped before byte */
    for (int64_t i = 0; i < t->n_cr && t->cr[i] <= byte; i++) skipped++;
    *offset = t->rec_off + (uint64_t)(byte + skipped);
    return true;
}

static int text_rewind(dstage *st, int64_t epoch, loom_err *err)
{
    (void)err;
    src_cursor_rewind_(&((text_source *)st)->cur, epoch);
    return LOOM_OK;
}

static void text_save(dstage *st, loom_buf *b) { src_cursor_save_(&((text_source *)st)->cur, b); }

/* A saved open file is past its first line (min_line 2): a line is read whole. */
static int text_restore(dstage *st, loom_buf *b, loom_err *err)
{
    return src_cursor_restore_(&((text_source *)st)->cur, b, "text", 2, st, open_file, err);
}

static void text_close(dstage *st)
{
    text_source *t = (text_source *)st;
    src_cursor_fini_(&t->cur);
    loom_free(t->line);
    loom_free(t->length);
    loom_free(t->file);
    loom_free(t->cr);
    loom_free(t);
}

static const dstage_ops text_ops = {
    .next = text_next, .rewind = text_rewind, .save = text_save, .restore = text_restore, .close = text_close,
};

int text_source_open_(dstage **out, const loom_source_spec *src, loom_err *err)
{
    *out = NULL;
    text_source *t = loom_calloc(1, sizeof *t);
    if (!t) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the text source");
    dstage *st = &t->s;
    dstage_init_(st, &text_ops, NULL, 0, &src->loc);
    snprintf(st->name, sizeof st->name, "text");
    int rc = LOOM_OK;
    t->max_length = src->text.max_length;
    t->truncate = src->text.truncate;
    t->rec_fi = -1;
    snprintf(t->sep, sizeof t->sep, "%s", src->text.record_separator);
    t->sep_len = (int64_t)strlen(t->sep);
    if (t->max_length < 1 || t->max_length > (1 << 24) || src->n_patterns < 1 ||
        src->n_patterns > LOOM_MAX_FILE_PATTERNS) {
        rc = dstage_err_(st, err, LOOM_ECONFIG, "text source needs max_length in [1, %d] and 1 to %d file patterns, "
                         "got %lld and %d", 1 << 24, LOOM_MAX_FILE_PATTERNS, (long long)t->max_length, src->n_patterns);
        goto fail;
    }
    t->cap_cr = t->sep_len ? 4096 : 0; /* a record of more CRLF lines than this: errors name the element instead */
    if (t->cap_cr && !(t->cr = loom_alloc((size_t)t->cap_cr * sizeof *t->cr))) {
        rc = loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the text source");
        goto fail;
    }
    t->line = loom_alloc_aligned((size_t)t->max_length + 1);
    t->length = loom_alloc_aligned(sizeof *t->length);
    if (!t->line || !t->length) {
        rc = loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a line of %lld bytes", (long long)t->max_length);
        goto fail;
    }
    st->spec.n = st->out.n = 2;
    snprintf(st->spec.name[0], LOOM_NAME_MAX, "line");
    snprintf(st->spec.name[1], LOOM_NAME_MAX, "length");
    st->spec.dtype[0] = LOOM_U8;
    st->spec.dtype[1] = LOOM_I64;
    st->spec.shape[0] = loom_shape_make(1, &t->max_length);
    st->spec.shape[1] = (loom_shape){0};
    if (src->text.file_feature[0]) { /* "which file": the index in the sorted list */
        if (!strcmp(src->text.file_feature, "line") || !strcmp(src->text.file_feature, "length")) {
            rc = dstage_err_(st, err, LOOM_ECONFIG, "text source: file_feature = \"%s\" clashes with the source's "
                             "own feature of that name", src->text.file_feature);
            goto fail;
        }
        if (!(t->file = loom_alloc_aligned(sizeof *t->file))) {
            rc = loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the text source");
            goto fail;
        }
        st->spec.n = st->out.n = 3;
        snprintf(st->spec.name[2], LOOM_NAME_MAX, "%s", src->text.file_feature);
        st->spec.dtype[2] = LOOM_I64;
        st->spec.shape[2] = (loom_shape){0};
        st->out.t[2] = (loom_tensor){.dtype = LOOM_I64, .shape = st->spec.shape[2], .data = t->file};
    }
    for (int f = 0; f < st->spec.n; f++) {
        st->maxshape[f] = st->spec.shape[f];
        st->mut[f] = 1;
    }
    st->out.t[0] = (loom_tensor){.dtype = LOOM_U8, .shape = st->spec.shape[0], .data = t->line};
    st->out.t[1] = (loom_tensor){.dtype = LOOM_I64, .shape = st->spec.shape[1], .data = t->length};
    if ((rc = source_files_expand_(st, src, "text", &t->cur.files, &t->cur.n_files, err))) goto fail;
    uint64_t h = source_files_hash_(0xcbf29ce484222325ull, t->cur.files, t->cur.n_files);
    st->card = -2;
    snprintf(st->desc, sizeof st->desc, "text(%lld files,max_length %lld,%s,%016llx%s%s)", (long long)t->cur.n_files,
             (long long)t->max_length, t->truncate ? "truncate" : "error", (unsigned long long)h,
             t->sep_len ? ",records " : "", t->sep);
    if (t->file) snprintf(st->desc + strlen(st->desc), sizeof st->desc - strlen(st->desc), "+file");
    *out = st;
    return LOOM_OK;
fail:
    text_close(st);
    return rc;
}
