/* test_util.h - helpers the data unit tests share: a per-test scratch
 * directory with paths under it, a byte log and a hash for comparing element
 * sequences, and builders for a dataset spec's IDX features and transforms.
 * Included by one test file per executable; all static, nothing shared between tests. */
#ifndef LOOM_TEST_UTIL_H
#define LOOM_TEST_UTIL_H

#include "harness.h"
#include "data/data.h"

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
    snprintf(src->file[src->n_features], LOOM_PATH_MAX, "%s", file);
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
