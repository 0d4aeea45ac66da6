/* data_fixtures.h - what test_data.c and test_data_maps.c share: small IDX
 * files written to a per-run scratch directory (setup), dataset specs over
 * them, and helpers that open a pipeline and run it into a byte log.
 * Included by one test file per executable; all static. */
#ifndef LOOM_DATA_FIXTURES_H
#define LOOM_DATA_FIXTURES_H

#include "harness.h"
#include "test_util.h"
#include "data/data_internal.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

/* ---- fixtures ------------------------------------------------------------- */

static inline size_t idx_esize(uint8_t code)
{
    switch (code) {
    case 0x08: case 0x09: return 1;
    case 0x0B: return 2;
    case 0x0C: case 0x0D: return 4;
    case 0x0E: return 8;
    default: return 0;
    }
}

/* Writes an IDX file: vals are host-order values of the IDX type; truncate_by drops trailing bytes. */
static inline void write_idx(const char *path, int gz, uint8_t code, int ndim, const uint32_t *dims, const void *vals, size_t truncate_by)
{
    size_t n = 1;
    for (int d = 0; d < ndim; d++) n *= dims[d];
    size_t es = idx_esize(code), len = 4 + 4 * (size_t)ndim + n * es;
    uint8_t *b = malloc(len);
    b[0] = 0;
    b[1] = 0;
    b[2] = code;
    b[3] = (uint8_t)ndim;
    for (int d = 0; d < ndim; d++)
        for (int j = 0; j < 4; j++) b[4 + 4 * d + j] = (uint8_t)(dims[d] >> (24 - 8 * j));
    uint8_t *o = b + 4 + 4 * ndim;
    for (size_t i = 0; i < n; i++)
        for (size_t j = 0; j < es; j++) o[i * es + j] = ((const uint8_t *)vals)[i * es + es - 1 - j]; /* little -> big endian */
    len -= truncate_by;
    if (gz) {
        gzFile f = gzopen(path, "wb");
        gzwrite(f, b, (unsigned)len);
        gzclose(f);
    } else {
        FILE *f = fopen(path, "wb");
        fwrite(b, 1, len, f);
        fclose(f);
    }
    free(b);
}

#define N_ITEMS 10
/* image i: uint8 (4, 3) with value i*16 + h*3 + w; label i: i */
static inline void make_fixture(const char *img, const char *lbl, int gz, int n)
{
    uint8_t im[256 * 12], lb[256];
    for (int i = 0; i < n; i++) {
        lb[i] = (uint8_t)i;
        for (int k = 0; k < 12; k++) im[i * 12 + k] = (uint8_t)(i * 16 + k);
    }
    uint32_t di[3] = {(uint32_t)n, 4, 3}, dl[1] = {(uint32_t)n};
    write_idx(tpath(img), gz, 0x08, 3, di, im, 0);
    write_idx(tpath(lbl), gz, 0x08, 1, dl, lb, 0);
}

static inline void setup(void)
{
    if (tmpdir[0]) return;
    snprintf(tmpdir, sizeof tmpdir, "/tmp/loom_test_data_%ld", (long)getpid());
    mkdir(tmpdir, 0755);
    make_fixture("img.idx", "lbl.idx", 0, N_ITEMS);
    make_fixture("img.idx.gz", "lbl.idx.gz", 1, N_ITEMS);
    /* a larger set with int32 labels 0..999 for shuffle statistics */
    int32_t lab[1000];
    for (int i = 0; i < 1000; i++) lab[i] = i;
    uint32_t d[1] = {1000};
    write_idx(tpath("big.idx"), 0, 0x0C, 1, d, lab, 0);
}

/* ---- spec builders -------------------------------------------------------- */

static inline loom_dataset_spec *spec_new(void) { return calloc(1, sizeof(loom_dataset_spec)); }

/* the small fixture: image (4, 3) u8, label u8 */
static inline loom_dataset_spec *spec_small(int gz)
{
    loom_dataset_spec *s = spec_new();
    s->present = true;
    spec_feature(s, "image", tpath(gz ? "img.idx.gz" : "img.idx"));
    spec_feature(s, "label", tpath(gz ? "lbl.idx.gz" : "lbl.idx"));
    return s;
}

/* A sequential map (parallel and deterministic unset). */
static inline loom_map_spec *add_map(loom_dataset_spec *s, loom_map_kind k, const char *feature)
{
    return spec_map(s, k, feature, 0, false);
}

static inline void add_shuffle(loom_dataset_spec *s, int64_t buffer, uint64_t seed, bool reshuffle)
{
    loom_transform_spec *t = spec_add(s, LOOM_T_SHUFFLE);
    t->buffer = buffer;
    t->seed = seed;
    t->seed_set = true;
    t->reshuffle = reshuffle;
}

static inline void add_batch(loom_dataset_spec *s, int64_t size, bool drop)
{
    loom_transform_spec *t = spec_add(s, LOOM_T_BATCH);
    t->batch_size = size;
    t->drop_remainder = drop;
}

static const loom_data_ctx ctx2 = {.seed = 42, .threads = 2, .name = "train"};

static inline loom_iter *open_ok(const loom_dataset_spec *s) { return iter_open_ok(s, &ctx2); }

static inline int open_fail(const loom_dataset_spec *s, loom_err *err)
{
    loom_iter *it = NULL;
    memset(err, 0, sizeof *err);
    int rc = loom_data_open(&it, s, &ctx2, err);
    CHECK(rc != LOOM_OK);
    CHECK(it == NULL);
    loom_iter_close(it);
    return rc;
}

/* Labels of one pass (feature "label", any int dtype, batched or not), up to max; returns the count or -1 on error. */
static inline int collect_labels(loom_iter *it, int64_t *out, int max)
{
    int n = 0, f = loom_elem_spec_find(loom_iter_spec(it), "label");
    loom_elem *e;
    loom_err err = {0};
    int rc;
    while ((rc = loom_iter_next(it, &e, &err)) == LOOM_OK) {
        int64_t k = loom_shape_numel(&e->t[f].shape);
        for (int64_t i = 0; i < k && n < max; i++) out[n++] = (int64_t)loom_tensor_get(&e->t[f], i);
    }
    CHECK_MSG(rc == LOOM_EEOF, "%s", err.msg);
    return rc == LOOM_EEOF ? n : -1;
}

/* Logs shapes and bytes of every feature of e. */
static inline void blob_elem(blob *b, const loom_elem *e)
{
    for (int f = 0; f < e->n; f++) {
        blob_put(b, &e->t[f].dtype, sizeof e->t[f].dtype);
        blob_put(b, &e->t[f].shape, sizeof e->t[f].shape);
        blob_put(b, e->t[f].data, loom_tensor_nbytes(&e->t[f]));
    }
    b->count++;
}

/* Runs up to max elements (or to EOF when max < 0) into b; returns the last rc. */
static inline int run_into(loom_iter *it, blob *b, int max)
{
    loom_elem *e;
    loom_err err = {0};
    int rc = LOOM_OK;
    for (int i = 0; max < 0 || i < max; i++) {
        rc = loom_iter_next(it, &e, &err);
        if (rc) break;
        blob_elem(b, e);
    }
    if (rc && rc != LOOM_EEOF) printf("# run_into: %s: %s\n", err.where, err.msg);
    return rc;
}

#endif
