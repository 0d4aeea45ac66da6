/* list_files.c - the list_files source (tf.data.Dataset.list_files,
 * tf_semantics §4.2): the spec's glob patterns expanded into a sorted,
 * duplicate-free list of file names, one element per file, optionally
 * shuffled each epoch by (seed, epoch). There is no string dtype: a name is
 * "filename" uint8 (LOOM_PATH_MAX) zero-padded plus "length" int64 (), as the
 * text source holds a line. Its consumer is the interleave transform, which
 * opens a source on each name. State = (epoch, position in the order).
 * Threads: one thread at a time drives the stage (see data_internal.h). */
#include "data/data_internal.h"

#include <string.h>

#define LIST_RNG_LABEL 0x73656c69665f736cull /* "ls_files": the shuffle stream */

typedef struct list_source {
    dstage   s;
    char   **files; /* sorted, unique; owned */
    int64_t  n_files;
    int64_t *order; /* this epoch's order: indices into files */
    bool     shuffle;
    uint64_t seed;
    uint8_t *name;   /* (LOOM_PATH_MAX): the lent "filename" */
    int64_t *length; /* the lent "length" */
    int64_t  epoch, pos;
} list_source;

static void make_order(list_source *t, int64_t epoch)
{
    for (int64_t i = 0; i < t->n_files; i++) t->order[i] = i;
    if (!t->shuffle) return;
    loom_rng rng;
    loom_rng_init(&rng, t->seed, LIST_RNG_LABEL, (uint64_t)epoch, 0);
    for (int64_t i = t->n_files - 1; i > 0; i--) {
        int64_t j = (int64_t)loom_rng_below(&rng, (uint64_t)i + 1), x = t->order[i];
        t->order[i] = t->order[j];
        t->order[j] = x;
    }
}

static int list_next(dstage *st, loom_elem **out, loom_err *err)
{
    (void)err;
    list_source *t = (list_source *)st;
    if (t->pos >= t->n_files) return LOOM_EEOF;
    const char *f = t->files[t->order[t->pos++]];
    size_t n = strlen(f); /* < LOOM_PATH_MAX, checked at open */
    memset(t->name, 0, LOOM_PATH_MAX);
    memcpy(t->name, f, n);
    *t->length = (int64_t)n;
    *out = &st->out;
    return LOOM_OK;
}

static int list_rewind(dstage *st, int64_t epoch, loom_err *err)
{
    list_source *t = (list_source *)st;
    make_order(t, epoch);
    return dcursor_rewind_(st, &t->epoch, &t->pos, epoch, err);
}

static void list_save(dstage *st, loom_buf *b)
{
    list_source *t = (list_source *)st;
    dcursor_save_(b, t->epoch, t->pos);
}

static int list_restore(dstage *st, loom_buf *b, loom_err *err)
{
    list_source *t = (list_source *)st;
    int64_t epoch, pos;
    if (!dcursor_load_(b, &epoch, &pos) || epoch < 0 || pos < 0 || pos > t->n_files)
        return loom_err_set(err, LOOM_ECHECKPOINT, NULL,
                            "iterator state is corrupt: list_files position %lld out of range (%lld files)",
                            (long long)pos, (long long)t->n_files);
    t->epoch = epoch;
    make_order(t, epoch);
    t->pos = pos;
    return LOOM_OK;
}

static void list_close(dstage *st)
{
    list_source *t = (list_source *)st;
    source_files_free_(t->files, t->n_files);
    loom_free(t->order);
    loom_free(t->name);
    loom_free(t->length);
    loom_free(t);
}

static const dstage_ops list_ops = {
    .next = list_next,
    .rewind = list_rewind,
    .save = list_save,
    .restore = list_restore,
    .close = list_close,
};

const char *list_files_first_(const dstage *s)
{
    if (s->ops != &list_ops) return NULL;
    const list_source *t = (const list_source *)s;
    return t->n_files ? t->files[0] : NULL;
}

int list_files_source_open_(dstage **out, const loom_source_spec *src, loom_err *err)
{
    *out = NULL;
    list_source *t = loom_calloc(1, sizeof *t);
    if (!t) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the list_files source");
    dstage *st = &t->s;
    dstage_init_(st, &list_ops, NULL, 0, &src->loc);
    snprintf(st->name, sizeof st->name, "list_files");
    t->shuffle = src->shuffle_files;
    t->seed = src->list_files.seed;
    int rc;
    if (src->n_patterns < 1 || src->n_patterns > LOOM_MAX_FILE_PATTERNS) {
        rc = dstage_err_(st, err, LOOM_ECONFIG, "list_files needs 1 to %d file patterns, got %d", LOOM_MAX_FILE_PATTERNS,
                         src->n_patterns);
        goto fail;
    }
    if ((rc = source_files_expand_(st, src, "list_files", &t->files, &t->n_files, err))) goto fail;
    for (int64_t i = 0; i < t->n_files; i++) {
        if (strlen(t->files[i]) >= LOOM_PATH_MAX) {
            rc = dstage_err_(st, err, LOOM_ECONFIG, "file name %.200s... is longer than %d bytes", t->files[i],
                             LOOM_PATH_MAX - 1);
            loom_err_hint(err, "move the files to a directory with a shorter path");
            goto fail;
        }
    }
    uint64_t h = source_files_hash_(0xcbf29ce484222325ull, t->files, t->n_files);
    t->order = loom_calloc((size_t)t->n_files, sizeof *t->order);
    t->name = loom_alloc_aligned(LOOM_PATH_MAX);
    t->length = loom_alloc_aligned(sizeof *t->length);
    if (!t->order || !t->name || !t->length) {
        rc = loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the list_files source");
        goto fail;
    }
    st->spec.n = st->out.n = 2;
    snprintf(st->spec.name[0], LOOM_NAME_MAX, "filename");
    snprintf(st->spec.name[1], LOOM_NAME_MAX, "length");
    st->spec.dtype[0] = LOOM_U8;
    st->spec.dtype[1] = LOOM_I64;
    int64_t width = LOOM_PATH_MAX;
    st->spec.shape[0] = loom_shape_make(1, &width);
    st->spec.shape[1] = loom_shape_make(0, NULL);
    for (int f = 0; f < 2; f++) {
        st->maxshape[f] = st->spec.shape[f];
        st->mut[f] = 1; /* rewritten by every next() */
    }
    st->out.t[0] = (loom_tensor){.dtype = LOOM_U8, .shape = st->spec.shape[0], .data = t->name};
    st->out.t[1] = (loom_tensor){.dtype = LOOM_I64, .shape = st->spec.shape[1], .data = t->length};
    __atomic_fetch_add(&st->st_bytes, (int64_t)(LOOM_PATH_MAX + sizeof *t->length), __ATOMIC_RELAXED);
    st->card = t->n_files;
    snprintf(st->desc, sizeof st->desc, "list_files(%lld files,%s%llu,%016llx)", (long long)t->n_files,
             t->shuffle ? "shuffle," : "", t->shuffle ? (unsigned long long)t->seed : 0ull, (unsigned long long)h);
    make_order(t, 0);
    *out = st;
    return LOOM_OK;
fail:
    list_close(st);
    return rc;
}
