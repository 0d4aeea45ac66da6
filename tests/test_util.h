/* test_util.h - helpers the unit tests share: a per-test scratch directory
 * with paths under it, reading a whole file, a byte log and a hash for
 * comparing element sequences, builders for a dataset spec's IDX features and
 * transforms, opening a pipeline that must open; and for config tests the
 * path of a tests/configs fixture and an error list as loom prints it.
 * Included by one test file per executable; all static, nothing shared between tests. */
#ifndef LOOM_TEST_UTIL_H
#define LOOM_TEST_UTIL_H

#include "harness.h"
#include "data/data.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static char tmpdir[256]; /* set by each test's setup() */

/* tmpdir/name; the result lives until 8 more calls. */
static inline const char *tpath(const char *name)
{
    static char buf[8][512];
    static int k;
    char *p = buf[k++ % 8];
    snprintf(p, 512, "%s/%s", tmpdir, name);
    return p;
}

/* Removes tmpdir and everything in it (nothing when it was never set). */
static inline void tmpdir_remove(void)
{
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (tmpdir[0] && system(cmd) != 0) printf("# could not remove %s\n", tmpdir);
}

/* main() of a test that works in a fresh tmpdir /tmp/<prefix>.XXXXXX: runs the
 * tests there, then removes it. */
static inline int run_in_tmpdir(const char *prefix, const loom_test *tests)
{
    snprintf(tmpdir, sizeof tmpdir, "/tmp/%s.XXXXXX", prefix);
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 1;
    }
    int rc = loom_test_run(tests);
    tmpdir_remove();
    return rc;
}

/* $LOOM_SOURCE_ROOT/tests/configs/name (meson sets the root; "." otherwise); lives until the next call. */
static inline const char *cfg_path(const char *name)
{
    static char buf[1024];
    const char *root = getenv("LOOM_SOURCE_ROOT");
    snprintf(buf, sizeof buf, "%s/tests/configs/%s", root ? root : ".", name);
    return buf;
}

/* Every error of the list into buf (n bytes), formatted as loom prints them. */
static inline void errs_text(const loom_errlist *errs, char *buf, size_t n)
{
    size_t len = 0;
    buf[0] = 0;
    for (int i = 0; i < errs->n && len < n; i++) {
        loom_err_format(&errs->e[i], buf + len, n - len);
        len += strlen(buf + len);
    }
}

/* The whole file at path in a malloc'd buffer (one spare byte after it), its
 * size in *len; NULL (and *len 0) when it cannot be read. */
static inline uint8_t *slurp(const char *path, size_t *len)
{
    *len = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *d = malloc((size_t)n + 1);
    if (d && fread(d, 1, (size_t)n, f) != (size_t)n) {
        free(d);
        d = NULL;
    }
    fclose(f);
    if (d) *len = (size_t)n;
    return d;
}

/* A growable byte log of whole elements, to compare sequences (each test serialises its own way). */
typedef struct blob {
    uint8_t *p;
    size_t   n, cap;
    int      count;
} blob;

static inline void blob_put(blob *b, const void *p, size_t n)
{
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 1024;
        b->p = realloc(b->p, b->cap);
    }
    memcpy(b->p + b->n, p, n);
    b->n += n;
}

/* An uncompressed IDX file of uint8 (code 0x08) or int32 (0x0C) values. */
static inline void write_idx_file(const char *path, uint8_t code, int ndim, const uint32_t *dims, const void *vals)
{
    size_t n = 1, es = code == 0x0C ? 4 : 1;
    for (int d = 0; d < ndim; d++) n *= dims[d];
    FILE *f = fopen(path, "wb");
    uint8_t h[4] = {0, 0, code, (uint8_t)ndim};
    fwrite(h, 1, 4, f);
    for (int d = 0; d < ndim; d++) {
        uint8_t b[4] = {(uint8_t)(dims[d] >> 24), (uint8_t)(dims[d] >> 16), (uint8_t)(dims[d] >> 8), (uint8_t)dims[d]};
        fwrite(b, 1, 4, f);
    }
    for (size_t i = 0; i < n; i++)
        for (size_t j = 0; j < es; j++) fputc(((const uint8_t *)vals)[i * es + es - 1 - j], f);
    fclose(f);
}

/* Adds an IDX feature name read from file to s's source (located at test.cfg:3). */
static inline void spec_feature(loom_dataset_spec *s, const char *name, const char *file)
{
    loom_source_spec *src = &s->source;
    src->kind = LOOM_SRC_IDX;
    snprintf(src->loc.file, sizeof src->loc.file, "test.cfg");
    src->loc.line = 3;
    snprintf(src->feature[src->n_features], LOOM_NAME_MAX, "%s", name);
    snprintf(src->idx.file[src->n_features], LOOM_PATH_MAX, "%s", file);
    src->n_features++;
}

/* Appends a zeroed transform of kind to s, located at test.cfg:(20 + its index) with its setting path. */
static inline loom_transform_spec *spec_add(loom_dataset_spec *s, loom_transform_kind kind)
{
    loom_transform_spec *t = &s->transform[s->n_transforms];
    memset(t, 0, sizeof *t);
    t->kind = kind;
    snprintf(t->loc.file, sizeof t->loc.file, "test.cfg");
    t->loc.line = 20 + s->n_transforms;
    snprintf(t->loc.path, sizeof t->loc.path, "data.train.transforms.[%d]", s->n_transforms);
    s->n_transforms++;
    return t;
}

/* A reshuffling shuffle with seed 7. */
static inline void spec_shuffle(loom_dataset_spec *s, int64_t buffer)
{
    loom_transform_spec *t = spec_add(s, LOOM_T_SHUFFLE);
    t->buffer = buffer;
    t->seed = 7;
    t->seed_set = true;
    t->reshuffle = true;
}

/* take/skip/repeat (k) with count, a batch, a prefetch. */
static inline void spec_count(loom_dataset_spec *s, loom_transform_kind k, int64_t count) { spec_add(s, k)->count = count; }
static inline void spec_batch(loom_dataset_spec *s, int64_t size) { spec_add(s, LOOM_T_BATCH)->batch_size = size; }
static inline void spec_prefetch(loom_dataset_spec *s, int64_t buffer) { spec_add(s, LOOM_T_PREFETCH)->buffer = buffer; }

/* A map of kind k on feature (scale and std 1: the identity until set) with
 * parallel = par and deterministic = det. */
static inline loom_map_spec *spec_map(loom_dataset_spec *s, loom_map_kind k, const char *feature, int par, bool det)
{
    loom_transform_spec *t = spec_add(s, LOOM_T_MAP);
    t->map.kind = k;
    snprintf(t->map.feature, sizeof t->map.feature, "%s", feature);
    t->map.scale = 1.0;
    t->map.std = 1.0;
    t->parallel = par;
    t->deterministic = det;
    return &t->map;
}

/* Opens s with ctx (NULL: the defaults); a failure is a failed check quoting
 * the error and its hint, and NULL. */
static inline loom_iter *iter_open_ok(const loom_dataset_spec *s, const loom_data_ctx *ctx)
{
    loom_iter *it = NULL;
    loom_err err = {0};
    int rc = loom_data_open(&it, s, ctx, &err);
    CHECK_MSG(rc == LOOM_OK, "open: %s: %s (hint: %s)", err.where, err.msg, err.hint);
    return rc == LOOM_OK ? it : NULL;
}

/* Loads tests/configs/name with overrides and opens its training pipeline on
 * one thread; on failure returns the code with *err set (a config's first error). */
static inline int train_pipeline_open(loom_spec **spec, loom_iter **it, const char *name, const char *const *sets,
                                      int n_sets, loom_err *err)
{
    loom_errlist *errs = calloc(1, sizeof *errs);
    if (!errs) return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating an error list");
    int rc = loom_config_load(spec, cfg_path(name), sets, n_sets, errs);
    if (rc) *err = errs->e[0];
    free(errs);
    if (rc) return rc;
    loom_data_ctx ctx = {.seed = (*spec)->run.seed, .threads = 1, .name = "train"};
    return loom_data_open(it, &(*spec)->train, &ctx, err);
}

/* ||a - b|| / ||a|| in double (||a - b|| when a is all zeros). */
static inline double rel_diff(const float *a, const float *b, int64_t n)
{
    double d = 0, s = 0;
    for (int64_t i = 0; i < n; i++) {
        d += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        s += (double)a[i] * a[i];
    }
    return s > 0 ? sqrt(d / s) : sqrt(d);
}

/* FNV-1a over every feature's dtype, shape and bytes: one number per element to compare sequences. */
static inline uint64_t elem_hash(const loom_elem *e)
{
    uint64_t h = 1469598103934665603ull;
#define MIX_(p, n)                                                             \
    for (size_t i_ = 0; i_ < (n); i_++) h = (h ^ ((const uint8_t *)(p))[i_]) * 1099511628211ull
    for (int f = 0; f < e->n; f++) {
        const loom_tensor *t = &e->t[f];
        MIX_(&t->dtype, sizeof t->dtype);
        MIX_(&t->shape.rank, sizeof t->shape.rank);
        MIX_(t->shape.dim, (size_t)t->shape.rank * sizeof t->shape.dim[0]);
        MIX_(t->data, loom_tensor_nbytes(t));
    }
#undef MIX_
    return h;
}

#endif
