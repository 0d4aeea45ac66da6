/* test_util.h - helpers the data unit tests share: a per-test scratch
 * directory with paths under it, a byte log for comparing element sequences,
 * and an IDX source feature for a dataset spec.
 * Included by one test file per executable; all static, nothing shared between tests. */
#ifndef LOOM_TEST_UTIL_H
#define LOOM_TEST_UTIL_H

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

#endif
