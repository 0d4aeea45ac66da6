/* checkpoint.c - the checkpoint file format, atomic writes, pruning.
 *
 * Layout (little-endian):
 *   "LOOMCKPT" u32 version=1 u32 records
 *   records: u32 kind (1 float32 tensor, 2 blob) | u32 name length | name |
 *            u32 rank | i64 dim[rank] | u64 raw bytes | u64 stored bytes |
 *            u32 crc32c(raw) | stored bytes (zstd frame)
 *   "LOOMEND\0" u32 crc32c(every byte before this trailer)
 * The trailer makes a truncated file detectable before anything is read. */
#include "train.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>
#include <time.h>
#include <zstd.h>

enum { KIND_TENSOR = 1, KIND_BLOB = 2, CKPT_VERSION = 1 };
static const char MAGIC[8] = "LOOMCKPT", TRAILER[8] = "LOOMEND";

static int put_record(loom_buf *b, int kind, const char *name, const loom_shape *shape, const void *raw, size_t n,
                      loom_err *err)
{
    size_t bound = ZSTD_compressBound(n);
    void *z = loom_alloc(bound);
    if (!z) return loom_err_set(err, LOOM_ENOMEM, name, "cannot allocate %zu bytes to compress", bound);
    size_t zn = ZSTD_compress(z, bound, raw, n, 1);
    if (ZSTD_isError(zn)) {
        loom_free(z);
        return loom_err_set(err, LOOM_EIO, name, "zstd compression failed: %s", ZSTD_getErrorName(zn));
    }
    loom_buf_put_u32(b, (uint32_t)kind);
    loom_buf_put_str(b, name);
    loom_buf_put_u32(b, shape ? (uint32_t)shape->rank : 0);
    for (int i = 0; shape && i < shape->rank; i++) loom_buf_put_i64(b, shape->dim[i]);
    loom_buf_put_u64(b, n);
    loom_buf_put_u64(b, zn);
    loom_buf_put_u32(b, loom_crc32c(raw, n));
    loom_buf_put(b, z, zn);
    loom_free(z);
    return b->failed ? loom_err_set(err, LOOM_ENOMEM, name, "out of memory writing a checkpoint") : LOOM_OK;
}

/* The step of a checkpoint file name: "ckpt-" digits ".loom", the digits a
 * step in [0, LOOM_CKPT_MAX_STEP] without a sign or leading zeros. 1 when it
 * is one, 0 when the name is not a checkpoint's, -1 when it looks like one
 * but its step is not valid (the caller warns and ignores it). */
static int step_of(const char *fname, int64_t *step)
{
    if (strncmp(fname, "ckpt-", 5) != 0) return 0;
    const char *p = fname + 5, *q = p;
    size_t n = strlen(p);
    if (n < 6 || strcmp(p + n - 5, ".loom") != 0) return 0;
    uint64_t s = 0;
    for (; q < p + n - 5; q++) {
        if (*q < '0' || *q > '9') return -1;
        if (s > (LOOM_CKPT_MAX_STEP - (uint64_t)(*q - '0')) / 10) return -1;
        s = s * 10 + (uint64_t)(*q - '0');
    }
    if (q == p || (p[0] == '0' && q - p > 1)) return -1;
    *step = (int64_t)s;
    return 1;
}

typedef struct ckpt_entry {
    int64_t step;
    char name[256];
} ckpt_entry;

static int cmp_entry(const void *a, const void *b)
{
    int64_t x = ((const ckpt_entry *)a)->step, y = ((const ckpt_entry *)b)->step;
    return x < y ? -1 : x > y;
}

/* All ckpt-*.loom in dir, oldest first; *out freed with loom_free. */
static int list_ckpts(const char *dir, ckpt_entry **out, int *n, bool warn, loom_err *err)
{
    *out = NULL;
    *n = 0;
    DIR *d = opendir(dir);
    if (!d) {
        if (errno == ENOENT) return LOOM_OK;
        return loom_err_set(err, LOOM_EIO, dir, "cannot list the model directory: %s", strerror(errno));
    }
    int cap = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        int64_t s;
        int k = step_of(e->d_name, &s);
        if (k < 0 && warn)
            loom_warn("%s/%s: ignored: not a checkpoint name (ckpt-<step>.loom, the step 0..%llu without leading zeros)",
                      dir, e->d_name, (unsigned long long)LOOM_CKPT_MAX_STEP);
        if (k <= 0) continue;
        if (*n == cap) {
            cap = cap ? cap * 2 : 16;
            ckpt_entry *nb = loom_realloc(*out, (size_t)cap * sizeof **out);
            if (!nb) {
                closedir(d);
                loom_free(*out);
                *out = NULL;
                return loom_err_set(err, LOOM_ENOMEM, dir, "listing checkpoints");
            }
            *out = nb;
        }
        (*out)[*n].step = s;
        snprintf((*out)[*n].name, sizeof(*out)[*n].name, "%s", e->d_name);
        (*n)++;
    }
    closedir(d);
    if (*n) qsort(*out, (size_t)*n, sizeof **out, cmp_entry);
    return LOOM_OK;
}

int loom_ckpt_latest(const char *dir, char path[LOOM_PATH_MAX], int64_t *step, loom_err *err)
{
    ckpt_entry *list;
    int n;
    int rc = list_ckpts(dir, &list, &n, true, err);
    if (rc) return rc;
    if (n == 0) return LOOM_EEOF;
    snprintf(path, LOOM_PATH_MAX, "%s/%s", dir, list[n - 1].name);
    *step = list[n - 1].step;
    loom_free(list);
    return LOOM_OK;
}

int loom_ckpt_newest_after(const char *dir, int64_t after, char path[LOOM_PATH_MAX], int64_t *step, int *n_newer,
                           loom_err *err)
{
    ckpt_entry *list;
    int n;
    *n_newer = 0;
    int rc = list_ckpts(dir, &list, &n, false, err);
    if (rc) return rc;
    for (int i = 0; i < n; i++) *n_newer += list[i].step > after;
    if (*n_newer) {
        snprintf(path, LOOM_PATH_MAX, "%s/%s", dir, list[n - 1].name);
        *step = list[n - 1].step;
    }
    loom_free(list);
    return *n_newer ? LOOM_OK : LOOM_EEOF;
}

static int write_index(const char *dir, const ckpt_entry *list, int n, loom_err *err)
{
    loom_buf b;
    loom_buf_init(&b);
    char line[320];
    snprintf(line, sizeof line, "model_checkpoint_path: \"%s\"\n", list[n - 1].name);
    loom_buf_put(&b, line, strlen(line));
    for (int i = 0; i < n; i++) {
        snprintf(line, sizeof line, "all_model_checkpoint_paths: \"%s\"\n", list[i].name);
        loom_buf_put(&b, line, strlen(line));
    }
    char path[LOOM_PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/checkpoint", dir);
    int rc = b.failed ? loom_err_set(err, LOOM_ENOMEM, path, "writing the checkpoint index")
                      : loom_write_file_atomic(path, b.data, b.len, err);
    loom_buf_fini(&b);
    return rc;
}

int loom_ckpt_save(const char *dir, int64_t step, loom_model *m, loom_optimizer *o, const loom_buf *trainer,
                   const loom_buf *iter, int keep, char path[LOOM_PATH_MAX], loom_err *err)
{
    return loom_ckpt_save_adapt(dir, step, m, o, trainer, iter, NULL, keep, path, err);
}

int loom_ckpt_save_adapt(const char *dir, int64_t step, loom_model *m, loom_optimizer *o, const loom_buf *trainer,
                         const loom_buf *iter, const loom_buf *adapt, int keep, char path[LOOM_PATH_MAX], loom_err *err)
{
    loom_buf b;
    loom_buf_init(&b);
    int nt = loom_model_num_param_tensors(m);
    int nslots = o ? loom_optimizer_num_slots(o) : 0;
    if (adapt && !adapt->len) adapt = NULL;
    uint32_t records = (uint32_t)(nt * (1 + nslots)) + (trainer != NULL) + (iter != NULL) + (adapt != NULL);
    loom_buf_put(&b, MAGIC, 8);
    loom_buf_put_u32(&b, CKPT_VERSION);
    loom_buf_put_u32(&b, records);
    int rc = LOOM_OK;
    const float *params = loom_model_params(m);
    int64_t P = loom_model_num_params(m);
    for (int i = 0; i < nt && !rc; i++) {
        const loom_param_info *pi = loom_model_param_tensor(m, i);
        size_t bytes = (size_t)loom_shape_numel(&pi->shape) * sizeof(float);
        rc = put_record(&b, KIND_TENSOR, pi->name, &pi->shape, params + pi->offset, bytes, err);
        for (int s = 0; s < nslots && !rc; s++) {
            char name[160];
            snprintf(name, sizeof name, "%s/%s", pi->name, loom_optimizer_slot_name(o, s));
            rc = put_record(&b, KIND_TENSOR, name, &pi->shape, loom_optimizer_slots(o) + (int64_t)s * P + pi->offset,
                            bytes, err);
        }
    }
    if (!rc && trainer) rc = put_record(&b, KIND_BLOB, "trainer", NULL, trainer->data, trainer->len, err);
    if (!rc && iter) rc = put_record(&b, KIND_BLOB, "iterator/train", NULL, iter->data, iter->len, err);
    if (!rc && adapt) rc = put_record(&b, KIND_BLOB, "adapt", NULL, adapt->data, adapt->len, err);
    if (!rc) {
        uint32_t crc = loom_crc32c(b.data, b.len);
        loom_buf_put(&b, TRAILER, 8);
        loom_buf_put_u32(&b, crc);
        snprintf(path, LOOM_PATH_MAX, "%s/ckpt-%lld.loom", dir, (long long)step);
        rc = b.failed ? loom_err_set(err, LOOM_ENOMEM, path, "out of memory writing a checkpoint")
                      : loom_write_file_atomic(path, b.data, b.len, err);
    }
    loom_buf_fini(&b);
    if (rc) return rc;

    ckpt_entry *list;
    int n;
    rc = list_ckpts(dir, &list, &n, false, err);
    if (rc) return rc;
    int first = keep > 0 && n > keep ? n - keep : 0;
    for (int i = 0; i < first; i++) {
        char old[LOOM_PATH_MAX + 80];
        snprintf(old, sizeof old, "%s/%s", dir, list[i].name);
        if (unlink(old) < 0 && errno != ENOENT)
            loom_warn("%s: cannot delete an old checkpoint: %s", old, strerror(errno));
    }
    if (n > first) rc = write_index(dir, list + first, n - first, err);
    loom_free(list);
    return rc;
}

/* One record's header, with its stored bytes still compressed. */
typedef struct record {
    uint32_t kind;
    char name[192];
    loom_shape shape;
    uint64_t raw, stored;
    uint32_t crc;
    const void *z;
} record;

static int next_record(loom_buf *b, uint32_t r, record *rec, const char *path, loom_err *err)
{
    memset(rec, 0, sizeof *rec);
    rec->kind = loom_buf_get_u32(b);
    loom_buf_get_str(b, rec->name, sizeof rec->name);
    rec->shape.rank = (int)loom_buf_get_u32(b);
    if (rec->shape.rank < 0 || rec->shape.rank > LOOM_MAX_RANK)
        return loom_err_set(err, LOOM_ECHECKPOINT, path, "record %u (%s): bad rank %d", r, rec->name, rec->shape.rank);
    for (int i = 0; i < rec->shape.rank; i++) rec->shape.dim[i] = loom_buf_get_i64(b);
    rec->raw = loom_buf_get_u64(b);
    rec->stored = loom_buf_get_u64(b);
    rec->crc = loom_buf_get_u32(b);
    rec->z = loom_buf_take(b, rec->stored);
    if (b->failed || !rec->z)
        return loom_err_set(err, LOOM_ECHECKPOINT, path, "record %u (%s) runs past the end of the file", r, rec->name);
    return LOOM_OK;
}

/* Decompresses a record into out (rec->raw bytes) and checks its CRC. */
static int unpack(const record *rec, void *out, const char *path, loom_err *err)
{
    size_t got = ZSTD_decompress(out, rec->raw, rec->z, rec->stored);
    if (ZSTD_isError(got) || got != rec->raw || loom_crc32c(out, rec->raw) != rec->crc)
        return loom_err_set(err, LOOM_ECHECKPOINT, path, "%s \"%s\" is corrupt (%s)",
                            rec->kind == KIND_TENSOR ? "tensor" : "record", rec->name,
                            ZSTD_isError(got) ? ZSTD_getErrorName(got) : "checksum mismatch");
    return LOOM_OK;
}

/* A checkpoint is read as it is, never inflated (it is not gzip): a regular
 * file only (a FIFO is refused, not waited on). */
static int read_plain(const char *path, uint8_t **data, size_t *len, loom_err *err)
{
    *data = NULL;
    int fd = loom_open_regular(path, err);
    if (fd < 0) return err ? err->code : LOOM_EIO;
    struct stat st;
    int rc = LOOM_OK;
    if (fstat(fd, &st) < 0) rc = loom_err_set(err, LOOM_EIO, path, "cannot stat: %s", strerror(errno));
    size_t n = rc ? 0 : (size_t)st.st_size, got = 0;
    if (!rc && !(*data = loom_alloc(n ? n : 1)))
        rc = loom_err_set(err, LOOM_ENOMEM, path, "cannot allocate %zu bytes to read a checkpoint", n);
    while (!rc && got < n) {
        ssize_t k = read(fd, *data + got, n - got);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) rc = loom_err_set(err, LOOM_EIO, path, "read failed: %s", k ? strerror(errno) : "the file shrank");
        else got += (size_t)k;
    }
    close(fd);
    if (rc) {
        loom_free(*data);
        *data = NULL;
        return rc;
    }
    *len = n;
    return LOOM_OK;
}

/* Reads a checkpoint file whole and checks its magic, end marker, file
 * checksum and version; on success b reads the records and *records says how
 * many. *data is freed with loom_free. */
static int open_checkpoint(const char *path, uint8_t **data, loom_buf *b, uint32_t *records, loom_err *err)
{
    size_t len = 0;
    int rc = read_plain(path, data, &len, err);
    if (rc) return rc;
    const char *hint = "delete it to resume from the previous checkpoint, or pass --fresh to start over";
    uint32_t stored_crc = 0;
    if (len >= 12) memcpy(&stored_crc, *data + len - 4, 4);
    if (len >= 2 && (*data)[0] == 0x1f && (*data)[1] == 0x8b)
        rc = loom_err_set(err, LOOM_ECHECKPOINT, path, "a gzip file, not a Loom checkpoint (checkpoints are not gzipped)");
    else if (len < 16 + 12 || memcmp(*data, MAGIC, 8) != 0)
        rc =
            loom_err_set(err, LOOM_ECHECKPOINT, path, "not a Loom checkpoint (bad magic or too short: %zu bytes)", len);
    else if (memcmp(*data + len - 12, TRAILER, 8) != 0)
        rc = loom_err_set(err, LOOM_ECHECKPOINT, path, "checkpoint is truncated (%zu bytes, no end marker)", len);
    else if (loom_crc32c(*data, len - 12) != stored_crc)
        rc = loom_err_set(err, LOOM_ECHECKPOINT, path, "checkpoint is corrupt (file checksum mismatch)");
    if (!rc) {
        loom_buf_wrap(b, *data, len - 12);
        loom_buf_take(b, 8);
        uint32_t version = loom_buf_get_u32(b);
        *records = loom_buf_get_u32(b);
        if (version != CKPT_VERSION)
            rc = loom_err_set(err, LOOM_ECHECKPOINT, path, "checkpoint format version %u, this build reads %d", version,
                              CKPT_VERSION);
    }
    if (rc) {
        loom_err_hint(err, "%s", hint);
        loom_free(*data);
        *data = NULL;
    }
    return rc;
}

/* A record's kind and name, where the name lies in the file (16 bytes a
 * record: a hostile file of many tiny records costs little to check). */
typedef struct rec_key {
    uint32_t kind, len;
    size_t off;
} rec_key;
static _Thread_local const uint8_t *sort_base; /* for cmp_key: qsort has no context argument */

static int cmp_key(const void *x, const void *y)
{
    const rec_key *a = x, *b = y;
    if (a->kind != b->kind) return a->kind < b->kind ? -1 : 1;
    int c = memcmp(sort_base + a->off, sort_base + b->off, a->len < b->len ? a->len : b->len);
    if (c) return c;
    if (a->len != b->len) return a->len < b->len ? -1 : 1;
    return a < b ? -1 : 1;
}

/* The structure of the records, before any is used: each header whole and
 * in the file, a known kind, a name, no (kind, name) twice, nothing after
 * the last record. CRCs only prove the bytes are the writer's; a forged or
 * buggy writer's file must still be refused, naming the record. */
static int scan_records(loom_buf *b, uint32_t records, const char *path, loom_err *err)
{
    size_t first = b->pos;
    /* each record takes at least 32 bytes: a count beyond that is a lie */
    if (records > (b->len - b->pos) / 32 + 1)
        return loom_err_set(err, LOOM_ECHECKPOINT, path,
                            "checkpoint claims %u records in %zu bytes: the last runs past the end of the file", records,
                            b->len - b->pos);
    int rc = LOOM_OK;
    rec_key *key = records ? loom_alloc(records * sizeof *key) : NULL;
    if (records && !key) return loom_err_set(err, LOOM_ENOMEM, path, "checking %u records", records);
    for (uint32_t r = 0; r < records && !rc; r++) {
        record rec;
        size_t at = b->pos;
        rc = next_record(b, r, &rec, path, err);
        if (rc) break;
        uint32_t nl;
        memcpy(&nl, b->data + at + 4, 4);
        key[r] = (rec_key){rec.kind, nl, at + 8};
        if (rec.kind != KIND_TENSOR && rec.kind != KIND_BLOB)
            rc = loom_err_set(err, LOOM_ECHECKPOINT, path, "record %u has unknown kind %u", r, rec.kind);
        else if (!rec.name[0])
            rc = loom_err_set(err, LOOM_ECHECKPOINT, path, "record %u has no name", r);
        /* what a record may claim to inflate to (and be allocated for):
         * zstd's best case is an RLE block, 4 bytes for 128 KB */
        if (!rc && rec.raw / 32768 > rec.stored)
            rc = loom_err_set(err, LOOM_ECHECKPOINT, path,
                              "record %u (%s) claims %llu bytes, which its %llu compressed bytes cannot hold", r,
                              rec.name, (unsigned long long)rec.raw, (unsigned long long)rec.stored);
        for (int i = 0; i < rec.shape.rank && !rc; i++)
            if (rec.shape.dim[i] < 0 || rec.shape.dim[i] > ((int64_t)1 << 40))
                rc = loom_err_set(err, LOOM_ECHECKPOINT, path, "record %u (%s): dimension %d is %lld", r, rec.name, i,
                                  (long long)rec.shape.dim[i]);
    }
    if (!rc && records > 1) { /* sorted by (kind, name, index), twins are neighbours */
        sort_base = b->data;
        qsort(key, records, sizeof *key, cmp_key);
        for (uint32_t i = 1; i < records && !rc; i++) {
            const rec_key *x = &key[i - 1], *y = &key[i];
            if (x->kind == y->kind && x->len == y->len && !memcmp(b->data + x->off, b->data + y->off, x->len))
                rc = loom_err_set(err, LOOM_ECHECKPOINT, path, "%s \"%.*s\" appears twice",
                                  y->kind == KIND_TENSOR ? "tensor" : "record", (int)(y->len > 200 ? 200 : y->len),
                                  (const char *)b->data + y->off);
        }
    }
    if (!rc && b->pos != b->len)
        rc = loom_err_set(err, LOOM_ECHECKPOINT, path, "%zu bytes after the last of the %u records", b->len - b->pos,
                          records);
    loom_free(key);
    b->pos = first;
    if (rc) loom_err_hint(err, "the file was not written by loom, or by a broken writer; delete it to resume from the "
                               "previous checkpoint, or pass --fresh");
    return rc;
}

/* The index of the first non-finite float among n, or -1. */
static int64_t first_nonfinite(const float *v, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(v[i])) return i;
    return -1;
}

/* Where a tensor record belongs: a parameter, or slot "<param>/<slot>". */
static float *locate(loom_model *m, loom_optimizer *o, const char *name, const loom_param_info **pi, int *slot_of_param)
{
    int64_t P = loom_model_num_params(m);
    for (int i = 0; i < loom_model_num_param_tensors(m); i++) {
        const loom_param_info *p = loom_model_param_tensor(m, i);
        size_t pl = strlen(p->name);
        if (!strcmp(name, p->name)) {
            *pi = p;
            return loom_model_params(m) + p->offset;
        }
        if (strncmp(name, p->name, pl) != 0 || name[pl] != '/') continue;
        *slot_of_param = 1;
        for (int s = 0; o && s < loom_optimizer_num_slots(o); s++)
            if (!strcmp(name + pl + 1, loom_optimizer_slot_name(o, s))) {
                *pi = p;
                return loom_optimizer_slots(o) + (int64_t)s * P + p->offset;
            }
    }
    return NULL;
}

/* A tensor record checked against the model (and optimizer, when loaded):
 * *dst = where its floats go; NULL with LOOM_OK: skipped (an optimizer slot
 * while no optimizer is loaded). found: the tensors matched so far, for
 * naming the model's tensor at the record's position. */
static int match_tensor(loom_model *m, loom_optimizer *o, const record *rec, int found, float **dst, const char *path,
                        loom_err *err)
{
    int nt = loom_model_num_param_tensors(m), nslots = o ? loom_optimizer_num_slots(o) : 0;
    const loom_param_info *pi = NULL;
    int slot_of_param = 0;
    *dst = locate(m, o, rec->name, &pi, &slot_of_param);
    if (!*dst && slot_of_param && !o) return LOOM_OK; /* slots are skipped when no optimizer is loaded */
    if (!*dst) {
        /* both shapes: the record's, and the model's tensor at the same position (records alternate
         * parameter and slots in layer order, so "the same position" counts parameters alone) */
        char a[64], c[96] = "";
        int at = found / (1 + nslots);
        if (at >= nt) at = nt - 1;
        if (!slot_of_param && at >= 0) {
            const loom_param_info *mp = loom_model_param_tensor(m, at);
            char s2[64];
            snprintf(c, sizeof c, "; the model's tensor %d is \"%.40s\" %s", at, mp->name,
                     loom_shape_str(&mp->shape, s2, sizeof s2));
        }
        loom_err_set(err, LOOM_ECHECKPOINT, path,
                     slot_of_param ? "checkpoint holds optimizer slot \"%s\" that this optimizer does not have"
                                   : "checkpoint holds tensor \"%s\" that this model does not have (shape %s%s)",
                     rec->name, loom_shape_str(&rec->shape, a, sizeof a), c);
        return loom_err_hint(err, "the checkpoint was written by a different %s; use a new model_dir or --fresh",
                             slot_of_param ? "optimizer" : "model");
    }
    if (!loom_shape_eq(&rec->shape, &pi->shape)) {
        char a[64], c[64];
        loom_err_set(err, LOOM_ECHECKPOINT, path, "tensor \"%s\" has shape %s in the checkpoint, the model expects %s",
                     rec->name, loom_shape_str(&rec->shape, a, sizeof a), loom_shape_str(&pi->shape, c, sizeof c));
        return loom_err_hint(err, "the checkpoint was written by a different model; use a new model_dir or --fresh");
    }
    if (rec->raw != (uint64_t)loom_shape_numel(&rec->shape) * sizeof(float))
        return loom_err_set(err, LOOM_ECHECKPOINT, path, "tensor \"%s\": %llu bytes for shape of %lld floats",
                            rec->name, (unsigned long long)rec->raw, (long long)loom_shape_numel(&rec->shape));
    return LOOM_OK;
}

/* A record's bytes into a tensor (dst) or a blob. A tensor goes through a
 * scratch copy: one with a NaN or an infinity must not reach the model. */
static int load_record(const record *rec, float *dst, loom_buf *blob, const char *path, loom_err *err)
{
    void *out = loom_alloc(rec->raw ? rec->raw : 1);
    if (!out) return loom_err_set(err, LOOM_ENOMEM, path, "loading %s", rec->name);
    int rc = unpack(rec, out, path, err);
    if (rc || dst) {
        int64_t bad = rc ? -1 : first_nonfinite(out, (int64_t)(rec->raw / sizeof(float)));
        if (bad >= 0) {
            rc = loom_err_set(err, LOOM_ECHECKPOINT, path, "tensor \"%s\" holds %g at index %lld", rec->name,
                              (double)((float *)out)[bad], (long long)bad);
            loom_err_hint(err, "the run that wrote it diverged, or the file was altered; resume from an earlier "
                               "checkpoint or pass --fresh");
        }
        if (!rc) memcpy(dst, out, rec->raw);
        loom_free(out);
        return rc;
    }
    loom_buf_fini(blob); /* the buffer becomes the blob's: no second copy that could fail */
    blob->data = out;
    blob->len = rec->raw;
    blob->cap = rec->raw ? rec->raw : 1;
    return LOOM_OK;
}

int loom_ckpt_load(const char *path, loom_model *m, loom_optimizer *o, loom_buf *trainer, loom_buf *iter, loom_err *err)
{
    /* The blobs are outputs: empty unless the file holds them, and empty again
     * on failure, so callers may pass uninitialised buffers and fini them on
     * every path (train.c does). */
    if (trainer) loom_buf_init(trainer);
    if (iter) loom_buf_init(iter);
    uint8_t *data;
    loom_buf b;
    uint32_t records;
    int rc = open_checkpoint(path, &data, &b, &records, err);
    if (rc) return rc;
    if ((rc = scan_records(&b, records, path, err))) {
        loom_free(data);
        return rc;
    }
    int nt = loom_model_num_param_tensors(m);
    int nslots = o ? loom_optimizer_num_slots(o) : 0;
    int found = 0;
    size_t first_record = b.pos;
    /* Pass 0 checks every record's name, shape and size against the model;
     * only then does pass 1 decompress into it, so a checkpoint of another
     * model never leaves the model half-overwritten. */
    for (int pass = 0; pass < 2 && !rc; pass++) {
        b.pos = first_record;
        if (pass == 1 && found != nt * (1 + nslots)) {
            rc = loom_err_set(err, LOOM_ECHECKPOINT, path, "checkpoint holds %d of the model's %d tensors", found,
                              nt * (1 + nslots));
            loom_err_hint(
                err, "the checkpoint was written by a different model or optimizer; use a new model_dir or --fresh");
            break;
        }
        for (uint32_t r = 0; r < records && !rc; r++) {
            record rec;
            if ((rc = next_record(&b, r, &rec, path, err))) break;
            /* Where do the bytes go? */
            float *dst = NULL;
            loom_buf *blob = NULL;
            if (rec.kind == KIND_TENSOR) {
                if ((rc = match_tensor(m, o, &rec, found, &dst, path, err))) break;
                if (!dst) continue;
                if (pass == 0) found++;
            } else if (rec.kind == KIND_BLOB) {
                blob = !strcmp(rec.name, "trainer") ? trainer : !strcmp(rec.name, "iterator/train") ? iter : NULL;
                if (!blob) continue;
            } else {
                rc = loom_err_set(err, LOOM_ECHECKPOINT, path, "record %u has unknown kind %u", r, rec.kind);
                break;
            }
            if (pass == 1) rc = load_record(&rec, dst, blob, path, err);
        }
    }
    loom_free(data);
    if (rc) {
        if (trainer) loom_buf_fini(trainer);
        if (iter) loom_buf_fini(iter);
    }
    return rc;
}

int loom_ckpt_read_blob(const char *path, const char *name, loom_buf *out, loom_err *err)
{
    loom_buf_init(out);
    uint8_t *data;
    loom_buf b;
    uint32_t records;
    int rc = open_checkpoint(path, &data, &b, &records, err);
    if (rc) return rc;
    if ((rc = scan_records(&b, records, path, err))) {
        loom_free(data);
        return rc;
    }
    rc = LOOM_EEOF;
    for (uint32_t r = 0; r < records && rc == LOOM_EEOF; r++) {
        record rec;
        int e = next_record(&b, r, &rec, path, err);
        if (e) rc = e;
        else if (rec.kind == KIND_BLOB && !strcmp(rec.name, name)) rc = load_record(&rec, NULL, out, path, err);
    }
    loom_free(data);
    if (rc && rc != LOOM_EEOF) loom_buf_fini(out);
    return rc;
}

int loom_ckpt_inspect(const char *path, FILE *f, loom_err *err)
{
    uint8_t *data;
    loom_buf b;
    uint32_t records;
    int rc = open_checkpoint(path, &data, &b, &records, err);
    if (rc) return rc;
    if ((rc = scan_records(&b, records, path, err))) {
        loom_free(data);
        return rc;
    }
    fprintf(f, "%s: Loom checkpoint version %d, %u records\n", path, CKPT_VERSION, records);
    for (uint32_t r = 0; r < records && !rc; r++) {
        record rec;
        rc = next_record(&b, r, &rec, path, err);
        void *out = rc ? NULL : loom_alloc(rec.raw ? rec.raw : 1);
        if (!rc && !out) rc = loom_err_set(err, LOOM_ENOMEM, path, "record %u (%s)", r, rec.name);
        if (!rc) rc = unpack(&rec, out, path, err);
        if (!rc && rec.kind == KIND_TENSOR) {
            int64_t bad = rec.raw % sizeof(float) ? 0 : first_nonfinite(out, (int64_t)(rec.raw / sizeof(float)));
            if (bad >= 0)
                rc = loom_err_set(err, LOOM_ECHECKPOINT, path, "tensor \"%s\" %s", rec.name,
                                  rec.raw % sizeof(float) ? "is not a whole number of floats" : "holds a NaN or an infinity");
        }
        if (!rc && rec.kind == KIND_TENSOR) {
            char shape_s[128];
            fprintf(f, "tensor %-40s %-16s crc32c %08x\n", rec.name,
                    loom_shape_str(&rec.shape, shape_s, sizeof shape_s), rec.crc);
        } else if (!rc) {
            fprintf(f, "blob   %-40s %10llu bytes  crc32c %08x\n", rec.name, (unsigned long long)rec.raw, rec.crc);
        }
        loom_free(out);
    }
    loom_free(data);
    return rc;
}

int loom_ckpt_archive(const char *dir, char out[LOOM_PATH_MAX], loom_err *err)
{
    ckpt_entry *list;
    int n;
    int rc = list_ckpts(dir, &list, &n, false, err);
    if (rc) return rc;
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    char stamp[32];
    strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", &tm);
    snprintf(out, LOOM_PATH_MAX, "%s/superseded-%s", dir, stamp);
    for (int k = 1; mkdir(out, 0755) < 0; k++) {
        if (errno != EEXIST || k > 100) {
            rc = loom_err_set(err, LOOM_EIO, out, "cannot create: %s", strerror(errno));
            loom_free(list);
            return rc;
        }
        snprintf(out, LOOM_PATH_MAX, "%s/superseded-%s-%d", dir, stamp, k);
    }
    char from[LOOM_PATH_MAX + 300], to[LOOM_PATH_MAX + 300];
    for (int i = 0; i <= n && !rc; i++) {
        const char *name = i < n ? list[i].name : "checkpoint";
        snprintf(from, sizeof from, "%s/%s", dir, name);
        snprintf(to, sizeof to, "%s/%s", out, name);
        if (rename(from, to) < 0 && !(i == n && errno == ENOENT))
            rc = loom_err_set(err, LOOM_EIO, from, "cannot move to %s: %s", out, strerror(errno));
    }
    loom_free(list);
    return rc;
}

int loom_metrics_trim(const char *path, int64_t max_step, int64_t max_epoch, loom_err *err)
{
    uint8_t *text;
    size_t len;
    struct stat st;
    if (lstat(path, &st) < 0 && errno == ENOENT) return 0;
    int rc = loom_read_file_max(path, &text, &len, (uint64_t)1 << 30, err);
    if (rc) return -1;
    /* kept: whole lines whose "step" is at most max_step (or that have none) */
    size_t keep = 0;
    int dropped = 0;
    for (size_t i = 0; i < len;) {
        char *nl = memchr(text + i, '\n', len - i);
        if (!nl) { /* a line cut short by a kill */
            dropped++;
            break;
        }
        size_t n = (size_t)((uint8_t *)nl - text) + 1 - i;
        *nl = 0;
        const char *sp = strstr((char *)text + i, "\"step\":");
        long long s = sp ? strtoll(sp + 7, NULL, 10) : 0;
        /* an epoch line: {"event": "epoch", "epoch": N, ...} (N counts completed epochs) */
        const char *ep = strstr((char *)text + i, "\"event\": \"epoch\"") ? strstr((char *)text + i, "\"epoch\": ") : NULL;
        long long e = ep ? strtoll(ep + 9, NULL, 10) : 0;
        *nl = '\n';
        if (s <= max_step && e <= max_epoch) {
            memmove(text + keep, text + i, n);
            keep += n;
        } else {
            dropped++;
        }
        i += n;
    }
    if (dropped) {
        rc = loom_write_file_atomic(path, text, keep, err);
        if (!rc)
            loom_info("%s: removed %d line%s written after the checkpoint of step %lld (the run stopped before "
                      "committing it)", path, dropped, dropped == 1 ? "" : "s", (long long)max_step);
    }
    loom_free(text);
    return rc ? -1 : dropped;
}
