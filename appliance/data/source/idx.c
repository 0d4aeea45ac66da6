/* idx.c - the IDX source (one IDX file per feature, plain or gzip) and
 * the catalog, which resolves a dataset name to the IDX files of its Debian
 * package. Files are loaded and checked whole at open; items are then lent
 * out as views into the loaded arrays (no copy per element).
 * IDX: bytes 0 0 <dtype> <ndim>, ndim big-endian u32 dims, then the values
 * big-endian; dim 0 counts the items. */
#include "data/data_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct idx_array {
    uint8_t   *raw;      /* the file as read (owned) */
    uint8_t   *data;     /* items: into raw (uint8) or a converted aligned copy (owned) */
    int        own_data;
    int64_t    items;
    size_t     item_bytes;
} idx_array;

typedef struct source {
    dstage    s;
    idx_array a[LOOM_MAX_FEATURES];
    int64_t   pos;       /* next item */
    int64_t   epoch;
} source;

static int idx_dtype(uint8_t code, loom_dtype *dt, size_t *file_size)
{
    switch (code) {
    case 0x08: *dt = LOOM_U8;  *file_size = 1; return 0;
    case 0x09: *dt = LOOM_I32; *file_size = 1; return 0; /* int8, widened */
    case 0x0B: *dt = LOOM_I32; *file_size = 2; return 0; /* int16, widened */
    case 0x0C: *dt = LOOM_I32; *file_size = 4; return 0;
    case 0x0D: *dt = LOOM_F32; *file_size = 4; return 0;
    case 0x0E: *dt = LOOM_F64; *file_size = 8; return 0;
    default: return -1;
    }
}

static uint32_t be32(const uint8_t *p) { return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3]; }

/* Converts n big-endian values of IDX type code into dst (host order, dtype as idx_dtype says). */
static void idx_convert(uint8_t code, const uint8_t *src, void *dst, size_t n)
{
    size_t i;
    switch (code) {
    case 0x09: for (i = 0; i < n; i++) ((int32_t *)dst)[i] = (int8_t)src[i]; break;
    case 0x0B: for (i = 0; i < n; i++) ((int32_t *)dst)[i] = (int16_t)(uint16_t)(src[2 * i] << 8 | src[2 * i + 1]); break;
    case 0x0C: for (i = 0; i < n; i++) ((uint32_t *)dst)[i] = be32(src + 4 * i); break;
    case 0x0D: for (i = 0; i < n; i++) ((uint32_t *)dst)[i] = be32(src + 4 * i); break;
    case 0x0E:
        for (i = 0; i < n; i++)
            ((uint64_t *)dst)[i] = (uint64_t)be32(src + 8 * i) << 32 | be32(src + 8 * i + 4);
        break;
    default: LOOM_ASSERT(!"bad idx code");
    }
}

/* Loads and checks one IDX file; fills the feature's dtype and per-item shape.
 * The header is read and checked first; only then is the body read, bounded
 * by the size the header declares (a gzip file is inflated as it is read, so
 * a bomb of zeros costs at most that size, never its whole expansion). */
static int idx_load(const char *path, idx_array *a, loom_dtype *dt, loom_shape *item, loom_err *err)
{
    loom_rfile *f;
    int rc = loom_rfile_open(&f, path, err);
    if (rc) return rc;
    uint8_t r[4 + 4 * (LOOM_MAX_RANK + 1)];
    size_t len = 0;
    if ((rc = loom_rfile_read(f, r, 4, &len, err))) goto fail;
    size_t esz = 0;
    if (len < 4 || r[0] != 0 || r[1] != 0 || idx_dtype(r[2], dt, &esz) || r[3] < 1 || r[3] > LOOM_MAX_RANK + 1) {
        char got[64] = "";
        size_t k = 0;
        for (size_t i = 0; i < len && i < 4; i++) k += (size_t)snprintf(got + k, sizeof got - k, "%s%02x", i ? " " : "", r[i]);
        if (!len) snprintf(got, sizeof got, "nothing (empty file)");
        if (len >= 4 && r[0] == 0 && r[1] == 0 && idx_dtype(r[2], dt, &esz))
            rc = loom_err_set(err, LOOM_EDATA, path, "IDX file has unsupported type code 0x%02x (expected 0x08 uint8, 0x09 int8, "
                              "0x0B int16, 0x0C int32, 0x0D float32 or 0x0E float64)", r[2]);
        else
            rc = loom_err_set(err, LOOM_EDATA, path, "not an IDX file: the first bytes are %s, expected 00 00 <type> <ndim> "
                              "(ndim 1..%d)", got, LOOM_MAX_RANK + 1);
        goto fail;
    }
    int ndim = r[3];
    size_t header = 4 + 4 * (size_t)ndim, hgot = 0;
    if ((rc = loom_rfile_read(f, r + 4, header - 4, &hgot, err))) goto fail;
    len += hgot;
    if (len < header) {
        rc = loom_err_set(err, LOOM_EDATA, path, "truncated IDX file: expected at least %zu header bytes, found %zu", header, len);
        goto fail;
    }
    /* nonzero: the product of the dims that are not 0, so that a 0 anywhere
     * cannot hide huge others (whose partial products would overflow later) */
    uint64_t count = 1, nonzero = 1;
    int64_t dims[LOOM_MAX_RANK + 1];
    for (int d = 0; d < ndim; d++) {
        dims[d] = be32(r + 4 + 4 * d);
        if (dims[d] && nonzero > ((uint64_t)1 << 40) / (uint64_t)dims[d]) { /* checked before multiplying: no wrap */
            rc = loom_err_set(err, LOOM_EDATA, path, "IDX header claims an absurd size");
            goto fail;
        }
        count *= (uint64_t)dims[d];
        if (dims[d]) nonzero *= (uint64_t)dims[d];
    }
    uint64_t expect = header + count * esz;
    /* a plain file's size is known: refuse a mismatch before allocating; a
     * gzip file cannot inflate to more than 1032 times its size (deflate's
     * limit), so a tiny file declaring gigabytes is refused before allocating too */
    struct stat st;
    bool gz = loom_rfile_is_gzip(f);
    if (gz && stat(path, &st) == 0 && expect > (uint64_t)st.st_size * 1032 + 64) {
        rc = loom_err_set(err, LOOM_EDATA, path, "truncated IDX file: the header (%d dims, %lld items) implies %llu bytes, "
                          "more than %llu gzip bytes can hold", ndim, (long long)dims[0], (unsigned long long)expect,
                          (unsigned long long)st.st_size);
        goto fail;
    }
    if (!gz && stat(path, &st) == 0 && (uint64_t)st.st_size != expect) {
        rc = loom_err_set(err, LOOM_EDATA, path, "%s IDX file: the header (%d dims, %lld items) implies %llu bytes, found %llu",
                          (uint64_t)st.st_size < expect ? "truncated" : "oversized", ndim, (long long)dims[0],
                          (unsigned long long)expect, (unsigned long long)st.st_size);
        goto fail;
    }
    a->raw = loom_alloc((size_t)expect + 1);
    if (!a->raw) {
        rc = loom_err_set(err, LOOM_ENOMEM, path, "cannot allocate %llu bytes for an IDX file", (unsigned long long)expect);
        goto fail;
    }
    memcpy(a->raw, r, header);
    size_t body = 0;
    /* one byte more than declared: finding it means the file is oversized */
    if ((rc = loom_rfile_read(f, a->raw + header, (size_t)(expect - header) + 1, &body, err))) goto fail;
    len += body;
    loom_rfile_close(f);
    f = NULL;
    if ((uint64_t)len != expect)
        return loom_err_set(err, LOOM_EDATA, path, "%s IDX file: the header (%d dims, %lld items) implies %llu bytes, found %s%zu",
                            (uint64_t)len < expect ? "truncated" : "oversized", ndim, (long long)dims[0],
                            (unsigned long long)expect, (uint64_t)len < expect ? "" : "more than ", len - ((uint64_t)len > expect));
    r[0] = a->raw[2]; /* the type code, for what follows */
    a->items = dims[0];
    *item = loom_shape_make(ndim - 1, dims + 1);
    a->item_bytes = (size_t)loom_shape_numel(item) * loom_dtype_size(*dt);
    if (r[0] == 0x08) {
        a->data = a->raw + header;
        return LOOM_OK;
    }
    size_t n = (size_t)count * loom_dtype_size(*dt);
    a->data = loom_alloc_aligned(n ? n : 1);
    if (!a->data) return loom_err_set(err, LOOM_ENOMEM, path, "cannot allocate %zu bytes", n);
    a->own_data = 1;
    idx_convert(r[0], a->raw + header, a->data, (size_t)count);
    loom_free(a->raw); /* the converted copy is all we need */
    a->raw = NULL;
    return LOOM_OK;
fail:
    loom_rfile_close(f);
    return rc;
}

/* ---- catalog ------------------------------------------------------------- */

int loom_catalog_resolve(const char *name, const char *split, char images[LOOM_PATH_MAX], char labels[LOOM_PATH_MAX],
                         loom_err *err)
{
    static const struct { const char *name, *dir, *package; } cat[] = {
        {"fashion_mnist", "fashion-mnist", "dataset-fashion-mnist"},
        {"mnist", "mnist", NULL},
    };
    int k = -1;
    for (int i = 0; i < (int)(sizeof cat / sizeof cat[0]); i++)
        if (!strcmp(name, cat[i].name)) k = i;
    if (k < 0)
        return loom_err_set(err, LOOM_ECONFIG, NULL, "unknown catalog dataset \"%s\" (expected one of: fashion_mnist, mnist)", name);
    const char *prefix = !strcmp(split, "train") ? "train" : !strcmp(split, "test") ? "t10k" : NULL;
    if (!prefix)
        return loom_err_set(err, LOOM_ECONFIG, NULL, "catalog dataset %s: unknown split \"%s\" (expected one of: train, test)",
                            name, split);
    const char *root = getenv("LOOM_DATASETS_DIR");
    if (!root || !*root) root = "/usr/share/datasets";
    char *out[2] = {images, labels};
    const char *what[2] = {"images-idx3", "labels-idx1"};
    for (int j = 0; j < 2; j++) {
        snprintf(out[j], LOOM_PATH_MAX, "%s/%s/%s-%s-ubyte.gz", root, cat[k].dir, prefix, what[j]);
        if (access(out[j], R_OK) == 0) continue;
        char plain[LOOM_PATH_MAX];
        snprintf(plain, sizeof plain, "%s/%s/%s-%s-ubyte", root, cat[k].dir, prefix, what[j]);
        if (access(plain, R_OK) == 0) {
            memcpy(out[j], plain, LOOM_PATH_MAX);
            continue;
        }
        loom_err_set(err, LOOM_EIO, out[j], "catalog dataset %s (%s split) is not installed: file not found", name, split);
        if (cat[k].package)
            return loom_err_hint(err, "apt-get install %s (or set LOOM_DATASETS_DIR to a directory holding %s/)", cat[k].package,
                                 cat[k].dir);
        return loom_err_hint(err, "put the %s IDX files (gzip or plain) under %s/%s/ or set LOOM_DATASETS_DIR", name, root,
                             cat[k].dir);
    }
    return LOOM_OK;
}

/* ---- the source stage ------------------------------------------------------ */

static int source_next(dstage *st, loom_elem **out, loom_err *err)
{
    (void)err;
    source *s = (source *)st;
    if (s->pos >= st->card) return LOOM_EEOF;
    for (int f = 0; f < st->out.n; f++) st->out.t[f].data = s->a[f].data + (size_t)s->pos * s->a[f].item_bytes;
    s->pos++;
    *out = &st->out;
    return LOOM_OK;
}

static int source_get(dstage *st, int64_t index, loom_elem **out, loom_err *err)
{
    (void)err;
    source *s = (source *)st;
    LOOM_ASSERT(index >= 0 && index < st->card);
    for (int f = 0; f < st->out.n; f++) st->out.t[f].data = s->a[f].data + (size_t)index * s->a[f].item_bytes;
    *out = &st->out;
    return LOOM_OK;
}

/* Plain order as positions (a batch's gather): the next n items. */
static int source_draw(dstage *st, int64_t *pos, int64_t n, int64_t *got, loom_err *err)
{
    (void)err;
    source *s = (source *)st;
    int64_t k = 0;
    while (k < n && s->pos < st->card) pos[k++] = s->pos++;
    *got = k;
    return LOOM_OK;
}

/* The loaded arrays, whose views get lends. */
static void source_rows(const dstage *st, const uint8_t **base, size_t *item_bytes)
{
    const source *s = (const source *)st;
    for (int f = 0; f < st->spec.n; f++) {
        base[f] = s->a[f].data;
        item_bytes[f] = s->a[f].item_bytes;
    }
}

static int source_rewind(dstage *st, int64_t epoch, loom_err *err)
{
    source *s = (source *)st;
    return dcursor_rewind_(st, &s->epoch, &s->pos, epoch, err);
}

static void source_save(dstage *st, loom_buf *b)
{
    source *s = (source *)st;
    dcursor_save_(b, s->epoch, s->pos);
}

static int source_restore(dstage *st, loom_buf *b, loom_err *err)
{
    source *s = (source *)st;
    if (!dcursor_load_(b, &s->epoch, &s->pos) || s->pos < 0 || s->pos > st->card)
        return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "iterator state is corrupt: source position %lld out of range",
                            (long long)s->pos);
    return LOOM_OK;
}

static void source_close(dstage *st)
{
    source *s = (source *)st;
    for (int f = 0; f < LOOM_MAX_FEATURES; f++) {
        if (s->a[f].own_data) loom_free(s->a[f].data);
        loom_free(s->a[f].raw);
    }
    loom_free(s);
}

/* NaN or infinite values in the float features, checked once at open:
 * on_nonfinite error names the file and the item; skip drops the item from
 * every feature (the arrays are compacted in place) and logs the count. */
static int check_nonfinite(source *s, dstage *st, char files[][LOOM_PATH_MAX], int nf, int mode, loom_err *err)
{
    int any = 0;
    for (int f = 0; f < nf; f++) any |= st->spec.dtype[f] == LOOM_F32 || st->spec.dtype[f] == LOOM_F64;
    if (!any) return LOOM_OK;
    int64_t items = s->a[0].items, kept = 0;
    for (int64_t i = 0; i < items; i++) {
        int bad = -1;
        int64_t at = 0;
        double v = 0;
        for (int f = 0; f < nf && bad < 0; f++) {
            loom_dtype dt = st->spec.dtype[f];
            if (dt != LOOM_F32 && dt != LOOM_F64) continue;
            int64_t n = (int64_t)(s->a[f].item_bytes / loom_dtype_size(dt));
            const uint8_t *p = s->a[f].data + (size_t)i * s->a[f].item_bytes;
            for (int64_t k = 0; k < n; k++) {
                double x = dt == LOOM_F32 ? (double)((const float *)p)[k] : ((const double *)p)[k];
                if (!isfinite(x)) {
                    bad = f, at = k, v = x;
                    break;
                }
            }
        }
        if (bad >= 0 && mode != LOOM_NONFINITE_SKIP) {
            loom_err_set(err, LOOM_EDATA, files[bad], "item %lld (0-based) of feature \"%s\": non-finite value %g at "
                         "offset %lld", (long long)i, st->spec.name[bad], v, (long long)at);
            return loom_err_hint(err, "fix or drop the item, or set on_nonfinite = \"skip\"; in the dataset's group "
                                      "(data.train / data.eval) to drop such items");
        }
        if (bad >= 0) continue;
        if (kept != i)
            for (int f = 0; f < nf; f++)
                memmove(s->a[f].data + (size_t)kept * s->a[f].item_bytes, s->a[f].data + (size_t)i * s->a[f].item_bytes,
                        s->a[f].item_bytes);
        kept++;
    }
    if (kept < items) {
        for (int f = 0; f < nf; f++) s->a[f].items = kept;
        loom_warn("%s: idx source: %lld item%s with a NaN or infinite value skipped (on_nonfinite = skip)", st->where,
                  (long long)(items - kept), items - kept == 1 ? "" : "s");
    }
    return LOOM_OK;
}

static const dstage_ops source_ops = {
    .next = source_next, .rewind = source_rewind, .save = source_save, .restore = source_restore, .close = source_close,
    .get = source_get, .draw = source_draw, .rows = source_rows,
};

int source_open_(dstage **out, const loom_source_spec *src, loom_err *err)
{
    source *s = loom_calloc(1, sizeof *s);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the source");
    dstage *st = &s->s;
    dstage_init_(st, &source_ops, NULL, 0, &src->loc);
    char files[LOOM_MAX_FEATURES][LOOM_PATH_MAX];
    const char *names[LOOM_MAX_FEATURES];
    int nf = 0, rc = LOOM_OK;
    if (src->kind == LOOM_SRC_CATALOG) {
        rc = loom_catalog_resolve(src->catalog.name, src->catalog.split, files[0], files[1], err);
        if (rc) {
            if (rc == LOOM_ECONFIG) snprintf(err->where, sizeof err->where, "%.255s", st->where);
            goto fail;
        }
        names[0] = "image";
        names[1] = "label";
        nf = 2;
        snprintf(st->name, sizeof st->name, "catalog(%.32s)", src->catalog.name);
    } else {
        nf = src->n_features;
        if (nf < 1 || nf > LOOM_MAX_FEATURES) {
            rc = dstage_err_(st, err, LOOM_ECONFIG, "idx source needs 1 to %d features, got %d", LOOM_MAX_FEATURES, nf);
            goto fail;
        }
        for (int f = 0; f < nf; f++) {
            memcpy(files[f], src->idx.file[f], LOOM_PATH_MAX);
            names[f] = src->feature[f];
        }
        snprintf(st->name, sizeof st->name, "idx");
    }
    st->spec.n = nf;
    st->out.n = nf;
    for (int f = 0; f < nf; f++) {
        snprintf(st->spec.name[f], LOOM_NAME_MAX, "%s", names[f]);
        for (int g = 0; g < f; g++)
            if (!strcmp(names[g], names[f])) {
                rc = dstage_err_(st, err, LOOM_ECONFIG, "feature \"%s\" is declared twice", names[f]);
                goto fail;
            }
        rc = idx_load(files[f], &s->a[f], &st->spec.dtype[f], &st->spec.shape[f], err);
        if (rc) goto fail;
        st->maxshape[f] = st->spec.shape[f];
        st->out.t[f].dtype = st->spec.dtype[f];
        st->out.t[f].shape = st->spec.shape[f];
        if (f > 0 && s->a[f].items != s->a[0].items) {
            rc = loom_err_set(err, LOOM_EDATA, files[f], "features have different lengths: \"%s\" (%s) has %lld items but \"%s\" (%s) "
                              "has %lld", names[0], files[0], (long long)s->a[0].items, names[f], files[f],
                              (long long)s->a[f].items);
            goto fail;
        }
    }
    if (src->kind == LOOM_SRC_CATALOG) {
        int64_t img[2] = {28, 28};
        loom_shape want = loom_shape_make(2, img), scalar = {0};
        if (st->spec.dtype[0] != LOOM_U8 || !loom_shape_eq(&st->spec.shape[0], &want) || st->spec.dtype[1] != LOOM_U8 ||
            !loom_shape_eq(&st->spec.shape[1], &scalar)) {
            char buf[256];
            rc = loom_err_set(err, LOOM_EDATA, files[0], "catalog dataset %s does not hold uint8 (28, 28) images and uint8 labels: %s",
                              src->catalog.name, loom_elem_spec_str(&st->spec, buf, sizeof buf));
            goto fail;
        }
    }
    if ((rc = check_nonfinite(s, st, files, nf, src->on_nonfinite, err))) goto fail;
    st->card = s->a[0].items;
    memset(st->mut, 0, sizeof st->mut); /* views into the dataset: read-only */
    snprintf(st->desc, sizeof st->desc, "%s[%lld]", st->name, (long long)st->card);
    *out = st;
    return LOOM_OK;
fail:
    source_close(st);
    return rc;
}

/* ---- whole-file loading (loom records convert) ---------------------------- */

int loom_idx_load(const char *path, loom_tensor *out, loom_err *err)
{
    memset(out, 0, sizeof *out);
    idx_array a = {0};
    loom_dtype dt = LOOM_U8;
    loom_shape item = {0};
    int rc = idx_load(path, &a, &dt, &item, err);
    if (rc) goto done;
    if (item.rank + 1 > LOOM_MAX_RANK) {
        rc = loom_err_set(err, LOOM_EDATA, path, "IDX file has %d dims; at most %d are supported", item.rank + 1, LOOM_MAX_RANK);
        goto done;
    }
    int64_t dims[LOOM_MAX_RANK];
    dims[0] = a.items;
    for (int d = 0; d < item.rank; d++) dims[d + 1] = item.dim[d];
    loom_shape shape = loom_shape_make(item.rank + 1, dims);
    size_t n = (size_t)a.items * a.item_bytes;
    if (a.own_data) { /* already a converted, aligned copy: hand it over */
        out->dtype = dt;
        out->shape = shape;
        out->data = a.data;
        out->owns = 1;
        a.own_data = 0;
        a.data = NULL;
    } else if (n == 0) {
        out->dtype = dt;
        out->shape = shape;
    } else {
        if ((rc = loom_tensor_init(out, dt, &shape, err))) goto done;
        memcpy(out->data, a.data, n);
    }
done:
    if (a.own_data) loom_free(a.data);
    loom_free(a.raw);
    if (rc) memset(out, 0, sizeof *out);
    return rc;
}
