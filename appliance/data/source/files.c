/* files.c - what the file-list sources (tfrecord, csv, text) share:
 * expanding the spec's glob patterns into a sorted, duplicate-free file list
 * (tf.data.Dataset.list_files with shuffle=False), and a buffered reader of
 * one plain file that tracks its byte offset, so a stage can save "file,
 * offset" and reopen there; the cursor (files, position, saved state) of
 * the csv and text sources.
 * Threads: none of its own; a reader belongs to one stage. */
#include "data/data_internal.h"

#include <errno.h>
#include <glob.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define SRC_FILE_BUF (64u << 10)

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

void source_files_free_(char **files, int64_t n)
{
    for (int64_t i = 0; i < n; i++) loom_free(files[i]);
    loom_free(files);
}

int source_files_expand_(const dstage *st, const loom_source_spec *src, const char *what, char ***files, int64_t *n,
                         loom_err *err)
{
    int64_t cap = 0;
    *files = NULL;
    *n = 0;
    for (int p = 0; p < src->n_patterns; p++) {
        glob_t g;
        int rc = glob(src->pattern[p], GLOB_MARK, NULL, &g);
        if (rc && rc != GLOB_NOMATCH) {
            globfree(&g);
            return dstage_err_(st, err, rc == GLOB_NOSPACE ? LOOM_ENOMEM : LOOM_EIO, "cannot expand \"%s\"",
                               src->pattern[p]);
        }
        int64_t matched = 0;
        for (size_t i = 0; !rc && i < g.gl_pathc; i++) {
            const char *m = g.gl_pathv[i];
            size_t l = strlen(m);
            struct stat sb;
            if (!l || m[l - 1] == '/' || stat(m, &sb) != 0 || !S_ISREG(sb.st_mode)) continue;
            if (*n == cap) {
                int64_t nc = cap ? cap * 2 : 16;
                char **nf = loom_realloc(*files, (size_t)nc * sizeof *nf);
                if (!nf) {
                    globfree(&g);
                    return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the %s file list", what);
                }
                *files = nf;
                cap = nc;
            }
            if (!((*files)[*n] = loom_strdup(m))) {
                globfree(&g);
                return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the %s file list", what);
            }
            (*n)++;
            matched++;
        }
        globfree(&g);
        if (!matched) {
            dstage_err_(st, err, LOOM_EIO, "no files match \"%s\"", src->pattern[p]);
            return loom_err_hint(err, "the files existed when the config was loaded; were they moved or deleted?");
        }
    }
    qsort(*files, (size_t)*n, sizeof **files, cmp_str);
    int64_t k = 0; /* overlapping patterns: each file once */
    for (int64_t i = 0; i < *n; i++) {
        if (k && !strcmp((*files)[k - 1], (*files)[i])) {
            loom_free((*files)[i]);
            continue;
        }
        (*files)[k++] = (*files)[i];
    }
    *n = k;
    return dinput_keep_files_(st, src, *files, n, err);
}

uint64_t source_files_hash_(uint64_t h, char *const *files, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        const char *base = strrchr(files[i], '/');
        base = base ? base + 1 : files[i];
        for (size_t k = 0, len = strlen(base) + 1; k < len; k++) h = (h ^ (uint8_t)base[k]) * 0x100000001b3ull;
    }
    return h;
}

/* ---- buffered reader ------------------------------------------------------- */

int src_file_open_(src_file *r, const char *path, uint64_t offset, loom_err *err)
{
    memset(r, 0, sizeof *r);
    if (!(r->buf = loom_alloc(SRC_FILE_BUF))) return loom_err_set(err, LOOM_ENOMEM, path, "cannot allocate a read buffer");
    if (!(r->f = loom_fopen_regular(path, err))) { /* a regular file: a FIFO would block forever */
        src_file_close_(r);
        return err ? err->code : LOOM_EIO;
    }
    if (offset) {
        struct stat sb;
        if (fstat(fileno(r->f), &sb) != 0 || (uint64_t)sb.st_size < offset || fseeko(r->f, (off_t)offset, SEEK_SET)) {
            src_file_close_(r);
            return loom_err_set(err, LOOM_ECHECKPOINT, path,
                                "cannot seek to byte %llu: the file is shorter than when the state was saved",
                                (unsigned long long)offset);
        }
    }
    r->offset = offset;
    return LOOM_OK;
}

void src_file_mem_(src_file *r, const uint8_t *data, size_t n)
{
    memset(r, 0, sizeof *r);
    r->buf = (uint8_t *)data; /* never written: refill returns 0 without a file */
    r->len = n;
    r->mem = true;
}

void src_file_close_(src_file *r)
{
    if (r->f) fclose(r->f);
    if (!r->mem) loom_free(r->buf);
    memset(r, 0, sizeof *r);
}

int src_file_refill_(src_file *r)
{
    if (!r->f || r->error) return 0;
    r->pos = 0;
    r->len = fread(r->buf, 1, SRC_FILE_BUF, r->f);
    if (r->len == 0 && ferror(r->f)) r->error = errno ? errno : EIO;
    return r->len > 0;
}

int src_file_read_err_(const src_file *r, const char *path, loom_err *err)
{
    return loom_err_set(err, LOOM_EIO, path, "read() failed at byte %llu: %s", (unsigned long long)r->offset,
                        strerror(r->error));
}

/* ---- the cursor of the line sources --------------------------------------- */

int src_cursor_open_(src_cursor *c, uint64_t offset, int64_t line, loom_err *err)
{
    int rc = src_file_open_(&c->in, c->files[c->fi], offset, err);
    if (rc) return rc;
    c->open = true;
    c->line = line;
    return LOOM_OK;
}

int src_cursor_file_(src_cursor *c, dstage *st, src_cursor_open_fn open, loom_err *err)
{
    if (c->done) return LOOM_EEOF;
    if (c->fi >= c->n_files) {
        c->done = true;
        return LOOM_EEOF;
    }
    return c->open ? LOOM_OK : open(st, 0, 1, err);
}

void src_cursor_next_file_(src_cursor *c)
{
    src_cursor_close_file_(c);
    c->fi++;
}

void src_cursor_close_file_(src_cursor *c)
{
    src_file_close_(&c->in);
    c->open = false;
}

void src_cursor_rewind_(src_cursor *c, int64_t epoch)
{
    src_cursor_close_file_(c);
    c->epoch = epoch;
    c->fi = 0;
    c->done = false;
}

void src_cursor_save_(const src_cursor *c, loom_buf *b)
{
    loom_buf_put_i64(b, c->epoch);
    loom_buf_put_i64(b, c->fi);
    loom_buf_put_u64(b, c->open ? c->in.offset : 0);
    loom_buf_put_i64(b, c->open ? c->line : 0);
    loom_buf_put_u32(b, c->done);
}

int src_cursor_restore_(src_cursor *c, loom_buf *b, const char *what, int64_t min_line, dstage *st,
                        src_cursor_open_fn open, loom_err *err)
{
    int64_t epoch = loom_buf_get_i64(b), fi = loom_buf_get_i64(b);
    uint64_t offset = loom_buf_get_u64(b);
    int64_t line = loom_buf_get_i64(b);
    uint32_t done = loom_buf_get_u32(b);
    if (b->failed || epoch < 0 || fi < 0 || fi > c->n_files || line < 0 || done > 1 || (fi == c->n_files && offset) ||
        (offset && line < min_line))
        return loom_err_set(err, LOOM_ECHECKPOINT, NULL,
                            "iterator state is corrupt: %s position (file %lld, byte %llu, line %lld) out of range "
                            "(%lld files)",
                            what, (long long)fi, (unsigned long long)offset, (long long)line, (long long)c->n_files);
    src_cursor_close_file_(c);
    c->epoch = epoch;
    c->fi = fi;
    c->done = done;
    if (!offset) return LOOM_OK;
    int rc = open(st, offset, line, err);
    if (rc) loom_err_hint(err, "restart the input from the beginning of an epoch, or restore the original files");
    return rc;
}

void src_cursor_fini_(src_cursor *c)
{
    src_file_close_(&c->in);
    source_files_free_(c->files, c->n_files);
}

/* FILE sharding (distribute_input.c plans it): keeps every file_shards-th file,
 * starting at file_shard, of the sorted list. */
int dinput_keep_files_(const dstage *st, const loom_source_spec *src, char **files, int64_t *n, loom_err *err)
{
    if (src->file_shards <= 1) return LOOM_OK;
    int64_t k = 0, all = *n;
    for (int64_t i = 0; i < all; i++) {
        if (i % src->file_shards == src->file_shard) files[k++] = files[i];
        else loom_free(files[i]);
    }
    *n = k;
    if (!k) /* the files changed since the plan counted them */
        return dstage_err_(st, err, LOOM_EIO, "input pipeline %d of %d: no files left to read (%lld match now)",
                           src->file_shard, src->file_shards, (long long)all);
    return LOOM_OK;
}
