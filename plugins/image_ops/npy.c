/* npy.c - the dataset source "npy": NumPy .npy files (np.save), one per
 * feature, element i being row i of every array.
 *
 *   source: { type = "npy"; options: { image = "x_train.npy"; label = "y_train.npy"; }; };
 *
 * Each option names a feature and its file (relative to the config's
 * directory). An array of shape (N, d1, ...) yields a feature of shape
 * (d1, ...); every array must have the same N, which is the cardinality.
 * dtypes: uint8, int32, int64, float32, float64, little-endian, C order
 * (what np.save writes for a plain array; anything else is refused with the
 * conversion to make). Files are read whole at open; elements point into
 * them (no copy). State = (epoch, position). */
#include "image_ops.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct npy_array {
    uint8_t   *file;    /* the whole file */
    size_t     offset;  /* of the data */
    size_t     row;     /* bytes of one element */
    loom_dtype dtype;
    loom_shape shape;   /* of one element */
} npy_array;

typedef struct npy_source {
    int       n;
    npy_array a[LOOM_MAX_FEATURES];
    int64_t   count, epoch, pos;
} npy_source;

/* ---- the .npy header ------------------------------------------------------------ */

/* The value after 'key': in the header dict, or NULL. */
static const char *dict_value(const char *h, const char *key)
{
    char k[32];
    snprintf(k, sizeof k, "'%s':", key);
    const char *p = strstr(h, k);
    if (!p) return NULL;
    for (p += strlen(k); *p == ' '; p++) {}
    return p;
}

static int parse_descr(const char *v, loom_dtype *dt)
{
    static const struct { const char *descr; loom_dtype dt; } known[] = {
        {"'|u1'", LOOM_U8}, {"'<u1'", LOOM_U8}, {"'<i4'", LOOM_I32}, {"'<i8'", LOOM_I64},
        {"'<f4'", LOOM_F32}, {"'<f8'", LOOM_F64},
    };
    for (size_t i = 0; v && i < sizeof known / sizeof known[0]; i++)
        if (!strncmp(v, known[i].descr, strlen(known[i].descr))) return *dt = known[i].dt, 0;
    return -1;
}

/* "(60000, 28, 28)" into *n and the element shape. */
static int parse_shape(const char *v, int64_t *n, loom_shape *s)
{
    if (!v || *v != '(') return -1;
    int64_t dims[LOOM_MAX_RANK + 1];
    int rank = 0;
    for (v++;;) {
        while (*v == ' ' || *v == ',') v++;
        if (*v == ')') break;
        char *end;
        long long d = strtoll(v, &end, 10);
        if (end == v || d < 0 || rank > LOOM_MAX_RANK) return -1;
        dims[rank++] = d, v = end;
    }
    if (rank < 1) return -1;
    *n = dims[0];
    s->rank = rank - 1;
    for (int i = 1; i < rank; i++) s->dim[i - 1] = dims[i];
    return 0;
}

/* Reads path whole and parses its header into *a and *n. */
static int load(const char *path, const char *where, npy_array *a, int64_t *n, loom_err *err)
{
    /* a regular file only: O_NONBLOCK so that a FIFO (which would wait for a writer) or a device is refused, not read */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) return img_host->err_set(err, LOOM_EIO, where, "cannot open %s: %s", path, strerror(errno));
    struct stat st = {0};
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        img_host->err_set(err, LOOM_EIO, where, "%s is %s, not a regular file: refused", path,
                          S_ISFIFO(st.st_mode) ? "a FIFO (named pipe)" : S_ISDIR(st.st_mode) ? "a directory"
                          : S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) ? "a device" : "not a regular file");
        return img_host->err_hint(err, "give the source a .npy file (np.save writes one)");
    }
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        close(fd);
        return img_host->err_set(err, LOOM_EIO, where, "cannot open %s: %s", path, strerror(errno));
    }
    long size = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
    rewind(f);
    a->file = size > 0 ? img_host->alloc_aligned((size_t)size) : NULL;
    size_t got = a->file ? fread(a->file, 1, (size_t)size, f) : 0;
    fclose(f);
    if (!a->file || got != (size_t)size)
        return img_host->err_set(err, size > 0 && !a->file ? LOOM_ENOMEM : LOOM_EIO, path, "cannot read %ld bytes", size);
    const uint8_t *b = a->file;
    if (size < 10 || memcmp(b, "\x93NUMPY", 6) || b[6] < 1 || b[6] > 3)
        return img_host->err_set(err, LOOM_EDATA, path, "not a NumPy .npy file (no \\x93NUMPY magic of version 1 to 3)");
    size_t hlen = b[6] == 1 ? (size_t)(b[8] | b[9] << 8) : (size_t)b[8] | (size_t)b[9] << 8 | (size_t)b[10] << 16 | (size_t)b[11] << 24;
    size_t hoff = b[6] == 1 ? 10 : 12;
    if (hoff + hlen > (size_t)size || hlen > 65536)
        return img_host->err_set(err, LOOM_EDATA, path, "the .npy header (%zu bytes) runs past the end of the file", hlen);
    char h[65537];
    memcpy(h, b + hoff, hlen);
    h[hlen] = 0;
    a->offset = hoff + hlen;
    const char *fo = dict_value(h, "fortran_order");
    if (parse_descr(dict_value(h, "descr"), &a->dtype) || !fo || strncmp(fo, "False", 5)) {
        img_host->err_set(err, LOOM_EDATA, path, "unsupported array: %s", h);
        return img_host->err_hint(err, "save a C-order array of uint8, int32, int64, float32 or float64, "
                                       "e.g. np.save(path, np.ascontiguousarray(a, dtype='<f4'))");
    }
    if (parse_shape(dict_value(h, "shape"), n, &a->shape))
        return img_host->err_set(err, LOOM_EDATA, path, "bad or unsupported shape (1 to %d dims) in %s", LOOM_MAX_RANK + 1, h);
    size_t esz = a->dtype == LOOM_U8 ? 1 : a->dtype == LOOM_I32 || a->dtype == LOOM_F32 ? 4 : 8;
    a->row = esz;
    for (int d = 0; d < a->shape.rank; d++) a->row *= (size_t)a->shape.dim[d];
    if ((size_t)size - a->offset != a->row * (size_t)*n)
        return img_host->err_set(err, LOOM_EDATA, path, "holds %zu bytes of data, the header's shape needs %zu",
                                 (size_t)size - a->offset, a->row * (size_t)*n);
    return LOOM_EOK;
}

/* ---- the source --------------------------------------------------------------------- */

static void npy_close(void *inst)
{
    npy_source *s = inst;
    for (int i = 0; i < s->n; i++) img_host->free(s->a[i].file);
    img_host->free(s);
}

static int npy_open(void **inst, const loom_source_args *a, loom_elem_spec *spec, loom_shape *max, loom_err *err)
{
    const loom_options *o = a->options;
    if (o->n < 1)
        return img_host->err_set(err, LOOM_ECONFIG, a->where, "source \"npy\" needs options: { FEATURE = \"file.npy\"; ... }");
    npy_source *s = img_host->calloc(1, sizeof *s);
    if (!s) return img_host->err_set(err, LOOM_ENOMEM, NULL, "out of memory");
    *inst = s;
    spec->n = o->n;
    for (int i = 0; i < o->n; i++) {
        char path[1024];
        snprintf(path, sizeof path, "%s%s%s", o->value[i][0] == '/' ? "" : a->base_dir, o->value[i][0] == '/' ? "" : "/",
                 o->value[i]);
        int64_t n;
        int rc = load(path, o->where[i], &s->a[i], &n, err);
        s->n = i + 1;
        if (rc) return rc;
        if (i > 0 && n != s->count)
            return img_host->err_set(err, LOOM_EDATA, o->where[i], "%s holds %lld elements, %s holds %lld: they must agree",
                                     path, (long long)n, o->value[0], (long long)s->count);
        s->count = n;
        snprintf(spec->name[i], sizeof spec->name[i], "%s", o->key[i]);
        spec->dtype[i] = s->a[i].dtype;
        spec->shape[i] = max[i] = s->a[i].shape;
    }
    return LOOM_EOK;
}

static int64_t npy_cardinality(void *inst) { return ((npy_source *)inst)->count; }

static int npy_rewind(void *inst, int64_t epoch, loom_err *err)
{
    (void)err;
    npy_source *s = inst;
    s->epoch = epoch, s->pos = 0;
    return LOOM_EOK;
}

static int npy_next(void *inst, loom_elem *out, loom_err *err)
{
    (void)err;
    npy_source *s = inst;
    if (s->pos >= s->count) return LOOM_EEOF;
    for (int i = 0; i < s->n; i++) { /* a view into the file: no copy */
        out->t[i].data = s->a[i].file + s->a[i].offset + s->a[i].row * (size_t)s->pos;
        out->t[i].shape = s->a[i].shape;
    }
    s->pos++;
    return LOOM_EOK;
}

static size_t npy_save(void *inst, void *buf, size_t cap)
{
    npy_source *s = inst;
    int64_t st[2] = {s->epoch, s->pos};
    if (cap >= sizeof st) memcpy(buf, st, sizeof st);
    return sizeof st;
}

static int npy_restore(void *inst, const void *buf, size_t len, loom_err *err)
{
    npy_source *s = inst;
    int64_t st[2];
    if (len != sizeof st) return img_host->err_set(err, LOOM_ECHECKPOINT, NULL, "npy: iterator state of %zu bytes, expected 16", len);
    memcpy(st, buf, sizeof st);
    if (st[0] < 0 || st[1] < 0 || st[1] > s->count)
        return img_host->err_set(err, LOOM_ECHECKPOINT, NULL, "npy: iterator state is corrupt (position %lld of %lld)",
                                 (long long)st[1], (long long)s->count);
    s->epoch = st[0], s->pos = st[1];
    return LOOM_EOK;
}

/* Any key: each names a feature. */
static const char *const npy_options[] = {"*", NULL};

const loom_source_ops npy_source_ops = {
    .version = LOOM_SOURCE_OPS_VERSION,
    .name = "npy",
    .options = npy_options,
    .open = npy_open,
    .cardinality = npy_cardinality,
    .rewind = npy_rewind,
    .next = npy_next,
    .save = npy_save,
    .restore = npy_restore,
    .close = npy_close,
};
