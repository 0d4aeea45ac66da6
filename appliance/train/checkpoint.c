/* checkpoint.c - the checkpoint file format, atomic writes, pruning.
 *
 * Layout (little-endian):
 *   "LOOMCKPT" u32 version=1 u32 records
 *   records: u32 kind (1 float32 tensor, 2 blob) | u32 name length | name |
 *            u32 rank | i64 dim[rank] | u64 raw bytes | u64 stored bytes |
 *            u32 crc32c(raw) | stored bytes (zstd frame)
 *   "LOOMEND\0" u32 crc32c(every byte before this trailer)
 * The trailer makes a truncated file detectable before anything is read.
 *
 * Sharded checkpoints (parameter_server: the variables live on ps tasks):
 * each ps writes ckpt-<step>.data-<ps>-of-<n_ps> in this format, holding its
 * shards' tensors (and slots) and a blob "shard" (u32 version=1 | i64 step |
 * u32 ps | u32 n_ps | u64 plan id); then the chief commits the index
 * ckpt-<step>.loom, again this format, holding the blobs "trainer" and
 * "iterator/train" and a blob "shards": u32 version=1 | i64 step | u32 n_ps
 * | u64 plan id | u32 files, each: str name, u64 size, u32 crc32c(the whole
 * file), u32 ps | u32 parts, each: str variable, str record, u32 file,
 * i64 row0, i64 rows. The index is renamed into place last, so the newest
 * index always names a complete set; loom_ckpt_load reads an index like a
 * whole checkpoint, assembling every variable from its shards. */
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

/* The step of a shard file's name (ckpt-<step>.data-...); false: not one. */
static bool shard_step_of(const char *fname, int64_t *step)
{
    if (strncmp(fname, "ckpt-", 5) != 0) return false;
    const char *p = fname + 5, *q = p;
    while (*q >= '0' && *q <= '9' && q - p < 17) q++;
    if (q == p || strncmp(q, ".data-", 6) != 0) return false;
    *step = strtoll(p, NULL, 10);
    return true;
}

/* Keeps the newest `keep` checkpoints (0: all), deleting the older ones with
 * their shard files, and shard files that no kept index names (left by a
 * save that never committed its index); rewrites the `checkpoint` file. */
static int prune(const char *dir, int keep, loom_err *err)
{
    ckpt_entry *list;
    int n;
    int rc = list_ckpts(dir, &list, &n, false, err);
    if (rc) return rc;
    int first = keep > 0 && n > keep ? n - keep : 0;
    for (int i = 0; i < first; i++) {
        char old[LOOM_PATH_MAX + 80];
        snprintf(old, sizeof old, "%s/%s", dir, list[i].name);
        if (unlink(old) < 0 && errno != ENOENT)
            loom_warn("%s: cannot delete an old checkpoint: %s", old, strerror(errno));
    }
    DIR *d = opendir(dir);
    struct dirent *e;
    while (d && (e = readdir(d))) {
        int64_t st;
        if (!shard_step_of(e->d_name, &st) || strstr(e->d_name, ".tmp.")) continue;
        bool kept = false;
        for (int i = first; i < n && !kept; i++) kept = list[i].step == st;
        char old[LOOM_PATH_MAX + 300];
        snprintf(old, sizeof old, "%s/%s", dir, e->d_name);
        if (!kept && unlink(old) < 0 && errno != ENOENT)
            loom_warn("%s: cannot delete an old checkpoint shard: %s", old, strerror(errno));
    }
    if (d) closedir(d);
    if (n > first) rc = write_index(dir, list + first, n - first, err);
    loom_free(list);
    return rc;
}

/* Header, then (after the caller's records) the trailer; written atomically. */
static void begin_file(loom_buf *b, uint32_t records)
{
    loom_buf_put(b, MAGIC, 8);
    loom_buf_put_u32(b, CKPT_VERSION);
    loom_buf_put_u32(b, records);
}

static int end_file(loom_buf *b, const char *path, loom_err *err)
{
    uint32_t crc = loom_crc32c(b->data, b->len);
    loom_buf_put(b, TRAILER, 8);
    loom_buf_put_u32(b, crc);
    return b->failed ? loom_err_set(err, LOOM_ENOMEM, path, "out of memory writing a checkpoint")
                     : loom_write_file_atomic(path, b->data, b->len, err);
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
    return rc ? rc : prune(dir, keep, err);
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
static int check_bytes(const char *path, uint8_t **data, size_t len, loom_buf *b, uint32_t *records, loom_err *err);

static int open_checkpoint(const char *path, uint8_t **data, loom_buf *b, uint32_t *records, loom_err *err)
{
    size_t len = 0;
    int rc = read_plain(path, data, &len, err);
    return rc ? rc : check_bytes(path, data, len, b, records, err);
}

/* open_checkpoint's checks of the bytes read (*data, len: freed on failure). */
static int check_bytes(const char *path, uint8_t **data, size_t len, loom_buf *b, uint32_t *records, loom_err *err)
{
    int rc = LOOM_OK;
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

static int find_table(loom_buf *b, uint32_t records, record *out, const char *path, loom_err *err);
static int load_sharded(const char *path, loom_buf *b, uint32_t records, const record *tr, loom_model *m,
                        loom_optimizer *o, loom_buf *trainer, loom_buf *iter, loom_err *err);

/* A checkpoint file read and every record checked (loom_ckpt_load and
 * loom_ckpt_inspect): *data (free with loom_free) holds it, b reads its
 * records. LOOM_OK with *table when the file is an index of shard files,
 * LOOM_EEOF when it holds the records itself; on an error *data is freed. */
static int read_checkpoint(const char *path, uint8_t **data, loom_buf *b, uint32_t *records, record *table,
                           loom_err *err)
{
    int rc = open_checkpoint(path, data, b, records, err);
    if (rc) return rc;
    if ((rc = scan_records(b, *records, path, err)) == LOOM_OK) rc = find_table(b, *records, table, path, err);
    if (rc != LOOM_OK && rc != LOOM_EEOF) loom_free(*data);
    return rc;
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
    record table;
    int rc = read_checkpoint(path, &data, &b, &records, &table, err);
    if (rc != LOOM_OK && rc != LOOM_EEOF) return rc;
    if (rc == LOOM_OK) { /* an index: the shards make the model */
        rc = load_sharded(path, &b, records, &table, m, o, trainer, iter, err);
        loom_free(data);
        if (rc) {
            if (trainer) loom_buf_fini(trainer);
            if (iter) loom_buf_fini(iter);
        }
        return rc;
    }
    rc = LOOM_OK;
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

static int inspect_index(const char *path, const record *tr, FILE *f, loom_err *err);
static int inspect_file(const char *path, FILE *f, bool shard, loom_err *err);

int loom_ckpt_inspect(const char *path, FILE *f, loom_err *err) { return inspect_file(path, f, false, err); }

/* shard: a shard file named by an index, which must not be an index itself. */
static int inspect_file(const char *path, FILE *f, bool shard, loom_err *err)
{
    uint8_t *data;
    loom_buf b;
    uint32_t records;
    record table;
    int rc = read_checkpoint(path, &data, &b, &records, &table, err);
    if (rc != LOOM_OK && rc != LOOM_EEOF) return rc;
    if (rc == LOOM_OK) { /* an index: its shard files, each checked */
        if (shard) rc = loom_err_set(err, LOOM_ECHECKPOINT, path, "a shard file that is an index itself");
        if (!rc) rc = inspect_index(path, &table, f, err);
        if (rc) {
            loom_free(data);
            return rc;
        }
    }
    rc = LOOM_OK;
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

/* ---- sharded checkpoints ---------------------------------------------------- */

int loom_ckpt_write_shard(const char *path, const loom_ckpt_shard_meta *meta, const loom_ckpt_tensor *t, int n,
                          uint64_t *size, uint32_t *crc, loom_err *err)
{
    loom_buf b, mb;
    loom_buf_init(&b);
    loom_buf_init(&mb);
    begin_file(&b, (uint32_t)n + 1);
    int rc = LOOM_OK;
    for (int i = 0; i < n && !rc; i++)
        rc = put_record(&b, KIND_TENSOR, t[i].name, &t[i].shape, t[i].data,
                        (size_t)loom_shape_numel(&t[i].shape) * sizeof(float), err);
    loom_buf_put_u32(&mb, 1);
    loom_buf_put_i64(&mb, meta->step);
    loom_buf_put_u32(&mb, (uint32_t)meta->ps);
    loom_buf_put_u32(&mb, (uint32_t)meta->n_ps);
    loom_buf_put_u64(&mb, meta->plan_id);
    if (!rc) rc = mb.failed ? loom_err_set(err, LOOM_ENOMEM, path, "out of memory writing a checkpoint")
                            : put_record(&b, KIND_BLOB, "shard", NULL, mb.data, mb.len, err);
    if (!rc) rc = end_file(&b, path, err);
    if (!rc) {
        *size = b.len;
        *crc = loom_crc32c(b.data, b.len);
    }
    loom_buf_fini(&b);
    loom_buf_fini(&mb);
    return rc;
}

int loom_ckpt_save_index(const char *dir, int64_t step, const loom_ckpt_shards *sh, const loom_buf *trainer,
                         const loom_buf *iter, int keep, char path[LOOM_PATH_MAX], loom_err *err)
{
    loom_buf b, tb;
    loom_buf_init(&b);
    loom_buf_init(&tb);
    loom_buf_put_u32(&tb, 1);
    loom_buf_put_i64(&tb, step);
    loom_buf_put_u32(&tb, (uint32_t)sh->n_ps);
    loom_buf_put_u64(&tb, sh->plan_id);
    loom_buf_put_u32(&tb, (uint32_t)sh->n_files);
    for (int i = 0; i < sh->n_files; i++) {
        loom_buf_put_str(&tb, sh->file[i].name);
        loom_buf_put_u64(&tb, sh->file[i].size);
        loom_buf_put_u32(&tb, sh->file[i].crc);
        loom_buf_put_u32(&tb, (uint32_t)sh->file[i].ps);
    }
    loom_buf_put_u32(&tb, (uint32_t)sh->n_parts);
    for (int i = 0; i < sh->n_parts; i++) {
        loom_buf_put_str(&tb, sh->part[i].var);
        loom_buf_put_str(&tb, sh->part[i].record);
        loom_buf_put_u32(&tb, (uint32_t)sh->part[i].file);
        loom_buf_put_i64(&tb, sh->part[i].row0);
        loom_buf_put_i64(&tb, sh->part[i].rows);
    }
    begin_file(&b, 1 + (trainer != NULL) + (iter != NULL));
    snprintf(path, LOOM_PATH_MAX, "%s/ckpt-%lld.loom", dir, (long long)step);
    int rc = tb.failed ? loom_err_set(err, LOOM_ENOMEM, path, "out of memory writing a checkpoint index")
                       : put_record(&b, KIND_BLOB, "shards", NULL, tb.data, tb.len, err);
    if (!rc && trainer) rc = put_record(&b, KIND_BLOB, "trainer", NULL, trainer->data, trainer->len, err);
    if (!rc && iter) rc = put_record(&b, KIND_BLOB, "iterator/train", NULL, iter->data, iter->len, err);
    if (!rc) rc = end_file(&b, path, err); /* the commit: the shards it names are complete */
    loom_buf_fini(&b);
    loom_buf_fini(&tb);
    return rc ? rc : prune(dir, keep, err);
}

/* An index's "shards" blob, parsed and checked for sense. */
typedef struct shard_table {
    int64_t  step;
    uint32_t n_ps, n_files, n_parts;
    uint64_t plan_id;
    loom_ckpt_shard_file *file;
    loom_ckpt_part       *part;
} shard_table;

static void table_fini(shard_table *t)
{
    loom_free(t->file);
    loom_free(t->part);
    memset(t, 0, sizeof *t);
}

static int parse_table(const uint8_t *raw, size_t n, shard_table *t, const char *path, loom_err *err)
{
    memset(t, 0, sizeof *t);
    loom_buf b;
    loom_buf_wrap(&b, raw, n);
    uint32_t version = loom_buf_get_u32(&b);
    t->step = loom_buf_get_i64(&b);
    t->n_ps = loom_buf_get_u32(&b);
    t->plan_id = loom_buf_get_u64(&b);
    t->n_files = loom_buf_get_u32(&b);
    if (b.failed || version != 1 || t->step < 0 || (uint64_t)t->step > LOOM_CKPT_MAX_STEP || t->n_files > 65536 ||
        t->n_files > n / 20 || t->n_ps == 0 || t->n_files != t->n_ps)
        return loom_err_set(err, LOOM_ECHECKPOINT, path, "the index's shard table is malformed (version %u, step %lld, "
                            "%u files for %u ps tasks)", version, (long long)t->step, t->n_files, t->n_ps);
    t->file = loom_calloc(t->n_files ? t->n_files : 1, sizeof *t->file);
    if (!t->file) return loom_err_set(err, LOOM_ENOMEM, path, "reading a shard table");
    for (uint32_t i = 0; i < t->n_files && !b.failed; i++) {
        loom_ckpt_shard_file *f = &t->file[i];
        if (loom_buf_get_str(&b, f->name, sizeof f->name) || !f->name[0] || strchr(f->name, '/') || f->name[0] == '.')
            b.failed = 1;
        f->size = loom_buf_get_u64(&b);
        f->crc = loom_buf_get_u32(&b);
        f->ps = (int)loom_buf_get_u32(&b);
        if (f->ps < 0 || (uint32_t)f->ps >= t->n_ps) b.failed = 1;
    }
    t->n_parts = b.failed ? 0 : loom_buf_get_u32(&b);
    if (!b.failed && t->n_parts > (b.len - b.pos) / 28) b.failed = 1;
    if (!b.failed && !(t->part = loom_calloc(t->n_parts ? t->n_parts : 1, sizeof *t->part))) {
        table_fini(t);
        return loom_err_set(err, LOOM_ENOMEM, path, "reading a shard table");
    }
    for (uint32_t i = 0; i < t->n_parts && !b.failed; i++) {
        loom_ckpt_part *p = &t->part[i];
        if (loom_buf_get_str(&b, p->var, sizeof p->var) || loom_buf_get_str(&b, p->record, sizeof p->record))
            b.failed = 1;
        p->file = (int)loom_buf_get_u32(&b);
        p->row0 = loom_buf_get_i64(&b);
        p->rows = loom_buf_get_i64(&b);
        if (p->file < 0 || (uint32_t)p->file >= t->n_files || p->row0 < 0 || p->rows < 0 || p->rows > ((int64_t)1 << 40) ||
            p->row0 > ((int64_t)1 << 40))
            b.failed = 1;
    }
    if (b.failed || b.pos != b.len) {
        table_fini(t);
        return loom_err_set(err, LOOM_ECHECKPOINT, path, "the index's shard table is malformed (a file or part entry "
                            "out of range, or bytes left over)");
    }
    return LOOM_OK;
}

/* One shard file, read whole and checked against the index's entry: size,
 * CRC, format, and its "shard" blob (step, ps, ps count, plan). */
typedef struct shard_file {
    char     path[LOOM_PATH_MAX + 160];
    uint8_t *data;
    loom_buf b;
    uint32_t records;
    size_t   first;
} shard_file;

static int open_shard(const char *index, const char *dir, const shard_table *t, int i, shard_file *sf, loom_err *err)
{
    const loom_ckpt_shard_file *f = &t->file[i];
    snprintf(sf->path, sizeof sf->path, "%s/%s", dir, f->name);
    size_t len = 0;
    int rc = read_plain(sf->path, &sf->data, &len, err);
    if (rc) {
        char why[512];
        snprintf(why, sizeof why, "%s", err->msg);
        loom_err_set(err, LOOM_ECHECKPOINT, index, "the checkpoint's shard of ps:%d, %s, cannot be read: %s", f->ps,
                     sf->path, why);
        return loom_err_hint(err, "every task must write to and read from one shared model_dir; a missing shard "
                                  "means the set is incomplete: delete this index to resume from the previous one");
    }
    uint32_t crc = loom_crc32c(sf->data, len);
    if (len != f->size || crc != f->crc) {
        loom_err_set(err, LOOM_ECHECKPOINT, sf->path, "not the shard the index %s committed: %zu bytes with CRC-32C "
                     "%08x, the index recorded %llu bytes with %08x (a mixed set: the file was rewritten or replaced "
                     "after the index was committed)", index, len, crc, (unsigned long long)f->size, f->crc);
        loom_free(sf->data);
        sf->data = NULL;
        return loom_err_hint(err, "delete %s to resume from the previous checkpoint, or pass --fresh", index);
    }
    if ((rc = check_bytes(sf->path, &sf->data, len, &sf->b, &sf->records, err))) return rc;
    if ((rc = scan_records(&sf->b, sf->records, sf->path, err))) return rc;
    sf->first = sf->b.pos;
    /* the "shard" blob: which checkpoint and which ps it belongs to */
    rc = loom_err_set(err, LOOM_ECHECKPOINT, sf->path, "a shard file without its \"shard\" record");
    for (uint32_t r = 0; r < sf->records; r++) {
        record rec;
        if (next_record(&sf->b, r, &rec, sf->path, err)) break;
        if (rec.kind != KIND_BLOB || strcmp(rec.name, "shard")) continue;
        loom_buf blob;
        loom_buf_init(&blob);
        if ((rc = load_record(&rec, NULL, &blob, sf->path, err))) break;
        loom_buf m = blob;
        m.pos = 0;
        uint32_t version = loom_buf_get_u32(&m);
        int64_t step = loom_buf_get_i64(&m);
        uint32_t ps = loom_buf_get_u32(&m), n_ps = loom_buf_get_u32(&m);
        uint64_t plan = loom_buf_get_u64(&m);
        if (m.failed || version != 1)
            rc = loom_err_set(err, LOOM_ECHECKPOINT, sf->path, "its \"shard\" record is malformed");
        else if (step != t->step)
            rc = loom_err_set(err, LOOM_ECHECKPOINT, sf->path, "a shard of the checkpoint of step %lld, but the index %s "
                              "is for step %lld: the set is mixed", (long long)step, index, (long long)t->step);
        else if ((int)ps != f->ps || n_ps != t->n_ps)
            rc = loom_err_set(err, LOOM_ECHECKPOINT, sf->path, "written by ps:%u of %u ps tasks, but the index %s names "
                              "it as ps:%d's of %u", ps, n_ps, index, f->ps, t->n_ps);
        else if (plan != t->plan_id)
            rc = loom_err_set(err, LOOM_ECHECKPOINT, sf->path, "cut by another partitioning (plan %016llx) than the "
                              "index %s records (%016llx)", (unsigned long long)plan, index,
                              (unsigned long long)t->plan_id);
        loom_buf_fini(&blob);
        break;
    }
    sf->b.pos = sf->first;
    if (rc) loom_err_hint(err, "delete %s to resume from the previous checkpoint, or pass --fresh", index);
    return rc;
}

/* The record called name in a shard file (LOOM_EEOF: none). */
static int find_record(shard_file *sf, const char *name, record *out, loom_err *err)
{
    sf->b.pos = sf->first;
    for (uint32_t r = 0; r < sf->records; r++) {
        int rc = next_record(&sf->b, r, out, sf->path, err);
        if (rc) return rc;
        if (out->kind == KIND_TENSOR && !strcmp(out->name, name)) return LOOM_OK;
    }
    return LOOM_EEOF;
}

static const loom_param_info *param_named(loom_model *m, const char *name)
{
    for (int i = 0; i < loom_model_num_param_tensors(m); i++)
        if (!strcmp(loom_model_param_tensor(m, i)->name, name)) return loom_model_param_tensor(m, i);
    return NULL;
}

/* Every part of the table into the model (and slots, with o): pass 0
 * checks names, shapes and that the parts tile each variable; pass 1 loads. */
static int load_parts(const char *index, const shard_table *t, shard_file *sf, loom_model *m, loom_optimizer *o,
                      int pass, loom_err *err)
{
    int nslots = o ? loom_optimizer_num_slots(o) : 0, rc = LOOM_OK;
    int64_t P = loom_model_num_params(m);
    for (uint32_t i = 0; i < t->n_parts && !rc; i++) {
        const loom_ckpt_part *p = &t->part[i];
        const loom_param_info *pi = param_named(m, p->var);
        if (!pi) {
            rc = loom_err_set(err, LOOM_ECHECKPOINT, index, "checkpoint holds variable \"%s\" that this model does not "
                              "have", p->var);
            loom_err_hint(err, "the checkpoint was written by a different model; use a new model_dir or --fresh");
            break;
        }
        int64_t dim0 = pi->shape.rank ? pi->shape.dim[0] : 1, numel = loom_shape_numel(&pi->shape);
        int64_t row_size = dim0 ? numel / dim0 : 0;
        if (p->row0 + p->rows > dim0) {
            rc = loom_err_set(err, LOOM_ECHECKPOINT, index, "part \"%s\" holds rows %lld..%lld of \"%s\", which has %lld",
                              p->record, (long long)p->row0, (long long)(p->row0 + p->rows - 1), p->var, (long long)dim0);
            break;
        }
        if (pass == 0) { /* the parts of a variable tile its rows: they add up and never overlap */
            int64_t sum = 0;
            for (uint32_t j = 0; j < t->n_parts; j++) {
                const loom_ckpt_part *q = &t->part[j];
                if (strcmp(q->var, p->var)) continue;
                sum += q->rows;
                if (j != i && q->row0 < p->row0 + p->rows && p->row0 < q->row0 + q->rows) sum = -1, j = t->n_parts;
            }
            if (sum != dim0) {
                rc = loom_err_set(err, LOOM_ECHECKPOINT, index, "the parts of \"%s\" %s its %lld rows", p->var,
                                  sum < 0 ? "overlap within" : "do not cover", (long long)dim0);
                break;
            }
        }
        shard_file *f = &sf[p->file];
        for (int k = 0; k <= nslots && !rc; k++) {
            char name[300];
            if (k == 0) snprintf(name, sizeof name, "%s", p->record);
            else snprintf(name, sizeof name, "%s/%s", p->record, loom_optimizer_slot_name(o, k - 1));
            record rec;
            rc = find_record(f, name, &rec, err);
            if (rc == LOOM_EEOF) {
                rc = loom_err_set(err, LOOM_ECHECKPOINT, f->path, "the shard lacks %s \"%s\" that the index %s names",
                                  k ? "optimizer slot" : "tensor", name, index);
                loom_err_hint(err, k ? "the checkpoint was written with a different optimizer; use a new model_dir or "
                                       "--fresh" : "the shard file is not the one the index was written with");
                break;
            }
            if (rc) break;
            loom_shape want = pi->shape;
            if (want.rank) want.dim[0] = p->rows;
            if (!loom_shape_eq(&rec.shape, &want) || rec.raw != (uint64_t)(p->rows * row_size) * sizeof(float)) {
                char a[64], c[64];
                rc = loom_err_set(err, LOOM_ECHECKPOINT, f->path, "tensor \"%s\" has shape %s, the model's \"%s\" "
                                  "needs %s for rows %lld..%lld", name, loom_shape_str(&rec.shape, a, sizeof a), p->var,
                                  loom_shape_str(&want, c, sizeof c), (long long)p->row0,
                                  (long long)(p->row0 + p->rows - 1));
                loom_err_hint(err, "the checkpoint was written by a different model; use a new model_dir or --fresh");
                break;
            }
            if (pass == 1) {
                float *base = k == 0 ? loom_model_params(m) : loom_optimizer_slots(o) + (int64_t)(k - 1) * P;
                rc = load_record(&rec, base + pi->offset + p->row0 * row_size, NULL, f->path, err);
            }
        }
    }
    return rc;
}

/* loom_ckpt_load of an index (the index's bytes in b, its "shards" blob in tr). */
static int load_sharded(const char *path, loom_buf *b, uint32_t records, const record *tr, loom_model *m,
                        loom_optimizer *o, loom_buf *trainer, loom_buf *iter, loom_err *err)
{
    loom_buf raw;
    loom_buf_init(&raw);
    int rc = load_record(tr, NULL, &raw, path, err);
    shard_table t;
    if (rc) return rc;
    rc = parse_table(raw.data, raw.len, &t, path, err);
    loom_buf_fini(&raw);
    if (rc) return rc;
    const char *base = strrchr(path, '/');
    int64_t named;
    if (step_of(base ? base + 1 : path, &named) == 1 && named != t.step) {
        loom_err_set(err, LOOM_ECHECKPOINT, path, "the index of step %lld names the shards of step %lld",
                     (long long)named, (long long)t.step);
        table_fini(&t);
        return loom_err_hint(err, "an index is named for the step it commits; rename it back or delete it");
    }
    char dir[LOOM_PATH_MAX];
    snprintf(dir, sizeof dir, "%.*s", base ? (int)(base - path) : 1, base ? path : ".");
    shard_file *sf = loom_calloc(t.n_files, sizeof *sf);
    if (!sf) rc = loom_err_set(err, LOOM_ENOMEM, path, "reading %u shard files", t.n_files);
    for (uint32_t i = 0; i < t.n_files && !rc; i++) rc = open_shard(path, dir, &t, (int)i, &sf[i], err);
    /* every count and shape checked before a float moves: a bad set leaves the model untouched */
    if (!rc) rc = load_parts(path, &t, sf, m, o, 0, err);
    if (!rc) {
        int nt = loom_model_num_param_tensors(m), covered = 0;
        for (int v = 0; v < nt; v++) {
            bool any = false;
            for (uint32_t j = 0; j < t.n_parts && !any; j++) any = !strcmp(t.part[j].var, loom_model_param_tensor(m, v)->name);
            covered += any;
            if (!any && !rc) {
                rc = loom_err_set(err, LOOM_ECHECKPOINT, path, "checkpoint holds %d of the model's %d variables: "
                                  "\"%s\" is in no shard", covered, nt, loom_model_param_tensor(m, v)->name);
                loom_err_hint(err, "the checkpoint was written by a different model; use a new model_dir or --fresh");
            }
        }
    }
    if (!rc) rc = load_parts(path, &t, sf, m, o, 1, err);
    for (uint32_t r = 0; r < records && !rc; r++) { /* the index's own blobs */
        record rec;
        if ((rc = next_record(b, r, &rec, path, err))) break;
        loom_buf *blob = rec.kind != KIND_BLOB ? NULL : !strcmp(rec.name, "trainer") ? trainer
                         : !strcmp(rec.name, "iterator/train") ? iter : NULL;
        if (blob) rc = load_record(&rec, NULL, blob, path, err);
    }
    for (uint32_t i = 0; sf && i < t.n_files; i++) loom_free(sf[i].data);
    loom_free(sf);
    table_fini(&t);
    return rc;
}

/* The "shards" blob of a checkpoint (b at its first record): LOOM_EEOF when
 * it is a whole checkpoint. */
static int find_table(loom_buf *b, uint32_t records, record *out, const char *path, loom_err *err)
{
    size_t first = b->pos;
    int rc = LOOM_EEOF;
    for (uint32_t r = 0; r < records; r++) {
        record rec;
        if ((rc = next_record(b, r, &rec, path, err))) break;
        if (rec.kind == KIND_BLOB && !strcmp(rec.name, "shards")) {
            *out = rec;
            b->pos = first;
            return LOOM_OK;
        }
        rc = LOOM_EEOF;
    }
    b->pos = first;
    return rc;
}

/* loom_ckpt_inspect of an index: the table, then each shard file checked
 * against it and listed. */
static int inspect_index(const char *path, const record *tr, FILE *f, loom_err *err)
{
    loom_buf raw;
    loom_buf_init(&raw);
    shard_table t;
    int rc = load_record(tr, NULL, &raw, path, err);
    if (!rc) rc = parse_table(raw.data, raw.len, &t, path, err);
    loom_buf_fini(&raw);
    if (rc) return rc;
    fprintf(f, "%s: the index of a sharded checkpoint: step %lld, %u shard file%s of %u ps task%s, %u part%s "
            "(partitioning %016llx)\n", path, (long long)t.step, t.n_files, t.n_files == 1 ? "" : "s", t.n_ps,
            t.n_ps == 1 ? "" : "s", t.n_parts, t.n_parts == 1 ? "" : "s", (unsigned long long)t.plan_id);
    for (uint32_t i = 0; i < t.n_parts; i++)
        fprintf(f, "part   %-40s rows %lld..%lld of %s in %s\n", t.part[i].record, (long long)t.part[i].row0,
                (long long)(t.part[i].row0 + t.part[i].rows - 1), t.part[i].var, t.file[t.part[i].file].name);
    const char *base = strrchr(path, '/');
    char dir[LOOM_PATH_MAX];
    snprintf(dir, sizeof dir, "%.*s", base ? (int)(base - path) : 1, base ? path : ".");
    for (uint32_t i = 0; i < t.n_files && !rc; i++) {
        shard_file sf = {0};
        rc = open_shard(path, dir, &t, (int)i, &sf, err);
        if (!rc) fprintf(f, "shard  %-40s %10llu bytes  crc32c %08x (ps:%d; matches the index)\n", t.file[i].name,
                         (unsigned long long)t.file[i].size, t.file[i].crc, t.file[i].ps);
        loom_free(sf.data);
        if (!rc) rc = inspect_file(sf.path, f, true, err);
    }
    table_fini(&t);
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
    DIR *d = rc ? NULL : opendir(dir); /* the shard files of sharded checkpoints go with their indexes */
    struct dirent *e;
    while (d && !rc && (e = readdir(d))) {
        int64_t st;
        if (!shard_step_of(e->d_name, &st)) continue;
        snprintf(from, sizeof from, "%s/%s", dir, e->d_name);
        snprintf(to, sizeof to, "%s/%s", out, e->d_name);
        if (rename(from, to) < 0) rc = loom_err_set(err, LOOM_EIO, from, "cannot move to %s: %s", out, strerror(errno));
    }
    if (d) closedir(d);
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
