/* tfrecord.c - the tfrecord source: files of serialized tf.train.Example
 * (tf_semantics §1), read file by file and record by record through the
 * streaming reader (never a whole file in memory), each Example parsed with the
 * declared features into the element's tensors (uint8 raw bytes, int64,
 * float32). The file list is the sorted union of the spec's glob patterns
 * (tf.data.Dataset.list_files with shuffle=False), optionally shuffled per
 * epoch. State = (epoch, file position, records consumed in that file): a
 * restore reopens the file and reads forward to the record, so resuming
 * mid-epoch is exact. Cardinality is unknown (-2): counting needs a full read.
 * Threads: one thread at a time drives the stage (see data_internal.h). */
#include "data/data_internal.h"

#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define FILES_RNG_LABEL 0x73656c6966726674ull /* "tfrfiles": the shuffle_files stream */

typedef struct tfr_source {
    dstage s;
    char **files; /* sorted, unique; owned */
    int64_t n_files;
    int64_t *order; /* this epoch's file order: indices into files */
    loom_compression comp;
    loom_on_corrupt on_corrupt;
    bool shuffle_files;
    uint64_t seed;
    int nf;
    loom_feature_spec fs[LOOM_MAX_FEATURES];
    loom_feature_out fo[LOOM_MAX_FEATURES];
    void *buf[LOOM_MAX_FEATURES]; /* the lent element's data */
    loom_example ex;
    loom_tfrecord *r; /* reader of files[order[fi]], NULL when none is open */
    int64_t epoch;
    int64_t fi;      /* position in order of the file being read */
    int64_t skipped; /* bad records skipped this pass (files done + Examples skipped) */
    bool done;       /* the pass ended */
} tfr_source;

/* ---- file list ------------------------------------------------------------ */

/* Expands every pattern (each must match a regular file) into t->files, sorted and unique. */
static int expand_files(tfr_source *t, const loom_source_spec *src, loom_err *err)
{
    int rc = source_files_expand_(&t->s, src, "tfrecord", &t->files, &t->n_files, err);
    if (rc) return rc;
    t->order = loom_calloc((size_t)t->n_files, sizeof *t->order);
    if (!t->order) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the tfrecord file order");
    return LOOM_OK;
}

/* The file order of an epoch: sorted, or a Fisher-Yates shuffle keyed by (seed, epoch). */
static void make_order(tfr_source *t, int64_t epoch)
{
    for (int64_t i = 0; i < t->n_files; i++) t->order[i] = i;
    if (!t->shuffle_files) return;
    loom_rng rng;
    loom_rng_init(&rng, t->seed, FILES_RNG_LABEL, (uint64_t)epoch, 0);
    for (int64_t i = t->n_files - 1; i > 0; i--) {
        int64_t j = (int64_t)loom_rng_below(&rng, (uint64_t)i + 1), x = t->order[i];
        t->order[i] = t->order[j];
        t->order[j] = x;
    }
}

/* ---- reading -------------------------------------------------------------- */

static const char *cur_file(const tfr_source *t) { return t->files[t->order[t->fi]]; }

/* Physical index in the file of the record the reader returned last. */
static int64_t last_record(const tfr_source *t) { return loom_tfrecord_count(t->r) + loom_tfrecord_skipped(t->r) - 1; }

/* err (from the reader or the Example codec) rewritten to name the file, the
 * record and its byte offset; msg is err's message without a leading "record N: ". */
static int record_err(const tfr_source *t, const char *file, int64_t record, uint64_t offset, loom_err *err)
{
    char msg[sizeof err->msg], hint[sizeof err->hint];
    const char *m = err->msg;
    if (!strncmp(m, "record ", 7)) {
        const char *colon = strstr(m, ": ");
        if (colon) m = colon + 2;
    }
    snprintf(msg, sizeof msg, "%s", m);
    snprintf(hint, sizeof hint, "%s", err->hint);
    int code = err->code ? err->code : LOOM_EDATA;
    loom_err_set(err, code, file, "record %lld at offset %llu: %s", (long long)record, (unsigned long long)offset, msg);
    if (hint[0]) return loom_err_hint(err, "%s", hint);
    if (code == LOOM_EDATA)
        return loom_err_hint(err, "the features declared at %s (%s.features) do not match this file", t->s.where,
                             t->s.path[0] ? t->s.path : "source");
    return code;
}

/* Parses a payload into the lent buffers. LOOM_EEOF-free: OK or an error
 * that names the file, record and offset. */
static int decode(tfr_source *t, const uint8_t *d, size_t len, const char *file, int64_t record, uint64_t offset,
                  bool *malformed, loom_err *err)
{
    *malformed = false;
    int rc = loom_example_parse(&t->ex, d, len, err);
    if (rc) {
        *malformed = rc == LOOM_EDATA;
        return record_err(t, file, record, offset, err);
    }
    rc = loom_example_extract(&t->ex, t->fs, t->nf, record, t->fo, err);
    if (rc) return record_err(t, file, record, offset, err);
    return LOOM_OK;
}

static void end_pass(tfr_source *t)
{
    if (t->done) return;
    t->done = true;
    if (t->skipped)
        loom_warn("%s: tfrecord source: %lld bad record%s skipped in epoch %lld (on_corrupt = skip)", t->s.where,
                  (long long)t->skipped, t->skipped == 1 ? "" : "s", (long long)t->epoch);
}

static void close_file(tfr_source *t)
{
    if (!t->r) return;
    t->skipped += loom_tfrecord_skipped(t->r);
    loom_tfrecord_close(t->r);
    t->r = NULL;
}

static int open_file(tfr_source *t, loom_err *err)
{
    return loom_tfrecord_open(&t->r, cur_file(t), t->comp, t->on_corrupt, err);
}

static int tfr_next(dstage *st, loom_elem **out, loom_err *err)
{
    tfr_source *t = (tfr_source *)st;
    for (;;) {
        if (t->done) return LOOM_EEOF;
        if (t->fi >= t->n_files) {
            end_pass(t);
            return LOOM_EEOF;
        }
        int rc;
        if (!t->r && (rc = open_file(t, err))) return rc;
        const uint8_t *d;
        size_t len;
        rc = loom_tfrecord_next(t->r, &d, &len, err);
        if (rc == LOOM_EEOF) {
            close_file(t);
            t->fi++;
            continue;
        }
        if (rc) {
            /* the reader's message already says which offset; add the record index */
            int64_t rec = loom_tfrecord_count(t->r) + loom_tfrecord_skipped(t->r);
            char msg[sizeof err->msg];
            snprintf(msg, sizeof msg, "%s", err->msg);
            snprintf(err->msg, sizeof err->msg, "record %lld: %.480s", (long long)rec, msg);
            return rc;
        }
        /* where this record starts (skipped bad records may lie before it): 12 header + 4 footer bytes */
        uint64_t rec_at = loom_tfrecord_offset(t->r) - (uint64_t)len - 16;
        bool malformed;
        rc = decode(t, d, len, cur_file(t), last_record(t), rec_at, &malformed, err);
        if (rc && malformed && t->on_corrupt == LOOM_CORRUPT_SKIP) {
            loom_warn("%s: %s; skipping it", err->where, err->msg);
            t->skipped++;
            continue;
        }
        if (rc) return rc;
        *out = &st->out;
        return LOOM_OK;
    }
}

static int tfr_rewind(dstage *st, int64_t epoch, loom_err *err)
{
    (void)err;
    tfr_source *t = (tfr_source *)st;
    close_file(t);
    t->epoch = epoch;
    t->fi = 0;
    t->skipped = 0;
    t->done = false;
    make_order(t, epoch);
    return LOOM_OK;
}

/* State: epoch, file position, records consumed from that file (good ones and
 * skipped malformed Examples: what the reader returned) and the offset reached,
 * to check on restore that the file is still the one read. */
static void tfr_save(dstage *st, loom_buf *b)
{
    tfr_source *t = (tfr_source *)st;
    loom_buf_put_i64(b, t->epoch);
    loom_buf_put_i64(b, t->fi);
    loom_buf_put_i64(b, t->r ? loom_tfrecord_count(t->r) : 0);
    loom_buf_put_u64(b, t->r ? loom_tfrecord_offset(t->r) : 0);
    loom_buf_put_i64(b, t->skipped);
    loom_buf_put_u32(b, t->done);
}

static int tfr_restore(dstage *st, loom_buf *b, loom_err *err)
{
    tfr_source *t = (tfr_source *)st;
    int64_t epoch = loom_buf_get_i64(b), fi = loom_buf_get_i64(b), count = loom_buf_get_i64(b);
    uint64_t offset = loom_buf_get_u64(b);
    int64_t skipped = loom_buf_get_i64(b);
    uint32_t done = loom_buf_get_u32(b);
    if (b->failed || epoch < 0 || fi < 0 || fi > t->n_files || count < 0 || skipped < 0 || done > 1 ||
        (fi == t->n_files && count))
        return loom_err_set(err, LOOM_ECHECKPOINT, NULL,
                            "iterator state is corrupt: tfrecord position (file %lld, record %lld) "
                            "out of range (%lld files)",
                            (long long)fi, (long long)count, (long long)t->n_files);
    close_file(t);
    t->epoch = epoch;
    make_order(t, epoch);
    t->fi = fi;
    t->done = done;
    int rc = LOOM_OK;
    if (count > 0) {
        if ((rc = open_file(t, err))) return rc;
        const uint8_t *d;
        size_t len;
        while (loom_tfrecord_count(t->r) < count) { /* read forward, CRCs checked, nothing parsed */
            rc = loom_tfrecord_next(t->r, &d, &len, err);
            if (rc == LOOM_EEOF) {
                loom_err_set(err, LOOM_ECHECKPOINT, cur_file(t),
                             "the iterator state is %lld records into this file, but it "
                             "holds only %lld now",
                             (long long)count, (long long)loom_tfrecord_count(t->r));
                rc = LOOM_ECHECKPOINT;
            }
            if (rc) break;
        }
        if (!rc && loom_tfrecord_offset(t->r) != offset)
            rc = loom_err_set(err, LOOM_ECHECKPOINT, cur_file(t),
                              "the iterator state is at offset %llu after %lld records, "
                              "the file now at %llu: it changed since the state was saved",
                              (unsigned long long)offset, (long long)count,
                              (unsigned long long)loom_tfrecord_offset(t->r));
        if (rc) {
            loom_err_hint(err, "restart the input from the beginning of an epoch, or restore the original files");
            close_file(t);
            return rc;
        }
    }
    t->skipped = skipped; /* after the read forward: its skips are counted again when the file ends */
    return LOOM_OK;
}

static void tfr_close(dstage *st)
{
    tfr_source *t = (tfr_source *)st;
    loom_tfrecord_close(t->r);
    loom_example_fini(&t->ex);
    for (int64_t i = 0; i < t->n_files; i++) loom_free(t->files[i]);
    loom_free(t->files);
    loom_free(t->order);
    for (int f = 0; f < LOOM_MAX_FEATURES; f++) loom_free(t->buf[f]);
    loom_free(t);
}

static const dstage_ops tfr_ops = {
    .next = tfr_next,
    .rewind = tfr_rewind,
    .save = tfr_save,
    .restore = tfr_restore,
    .close = tfr_close,
};

/* ---- open ----------------------------------------------------------------- */

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

/* Reads the first record of the first file and decodes it, so that a feature
 * spec that does not match the files fails at open (and in `loom check`).
 * Damage is left to the real read, which applies on_corrupt. */
static int probe(tfr_source *t, loom_err *err)
{
    loom_tfrecord *r;
    loom_err e2 = {0};
    int rc = loom_tfrecord_open(&r, t->files[0], t->comp, LOOM_CORRUPT_ERROR, err);
    if (rc) return rc == LOOM_EDATA ? LOOM_OK : rc; /* EDATA: a compression mismatch is reported on read */
    const uint8_t *d;
    size_t len;
    if (loom_tfrecord_next(r, &d, &len, &e2) == LOOM_OK) {
        bool malformed;
        uint64_t at = loom_tfrecord_offset(r) - (uint64_t)len - 16;
        rc = decode(t, d, len, t->files[0], 0, at, &malformed, err);
        if (rc && malformed && t->on_corrupt == LOOM_CORRUPT_SKIP) rc = LOOM_OK;
    }
    loom_tfrecord_close(r);
    return rc;
}

int tfrecord_source_open_(dstage **out, const loom_source_spec *src, const loom_data_ctx *ctx, loom_err *err);

int tfrecord_source_open_(dstage **out, const loom_source_spec *src, const loom_data_ctx *ctx, loom_err *err)
{
    *out = NULL;
    tfr_source *t = loom_calloc(1, sizeof *t);
    if (!t) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the tfrecord source");
    dstage *st = &t->s;
    dstage_init_(st, &tfr_ops, NULL, 0, &src->loc);
    loom_example_init(&t->ex);
    snprintf(st->name, sizeof st->name, "tfrecord");
    static const loom_compression comps[] = {
        [LOOM_TFR_COMP_AUTO] = LOOM_COMP_AUTO, [LOOM_TFR_COMP_NONE] = LOOM_COMP_NONE,
        [LOOM_TFR_COMP_GZIP] = LOOM_COMP_GZIP, [LOOM_TFR_COMP_ZLIB] = LOOM_COMP_ZLIB,
        [LOOM_TFR_COMP_ZSTD] = LOOM_COMP_ZSTD,
    };
    static const loom_parse_dtype pdt[] = {
        [LOOM_TFR_UINT8] = LOOM_PARSE_U8_BYTES, [LOOM_TFR_INT64] = LOOM_PARSE_I64, [LOOM_TFR_FLOAT32] = LOOM_PARSE_F32};
    static const loom_dtype tdt[] = {
        [LOOM_TFR_UINT8] = LOOM_U8, [LOOM_TFR_INT64] = LOOM_I64, [LOOM_TFR_FLOAT32] = LOOM_F32};
    int rc = LOOM_OK;
    if ((unsigned)src->compression > LOOM_TFR_COMP_ZSTD || (unsigned)src->on_corrupt > LOOM_TFR_CORRUPT_SKIP) {
        rc = dstage_err_(st, err, LOOM_ECONFIG, "bad compression %d or on_corrupt %d", (int)src->compression,
                         (int)src->on_corrupt);
        goto fail;
    }
    t->comp = comps[src->compression];
    t->on_corrupt = src->on_corrupt == LOOM_TFR_CORRUPT_SKIP ? LOOM_CORRUPT_SKIP : LOOM_CORRUPT_ERROR;
    t->shuffle_files = src->shuffle_files;
    t->seed = ctx ? ctx->seed : 42;
    t->nf = src->n_features;
    if (t->nf < 1 || t->nf > LOOM_MAX_FEATURES || src->n_patterns < 1 || src->n_patterns > LOOM_MAX_FILE_PATTERNS) {
        rc = dstage_err_(st, err, LOOM_ECONFIG,
                         "tfrecord source needs 1 to %d features and 1 to %d file patterns, got %d and %d",
                         LOOM_MAX_FEATURES, LOOM_MAX_FILE_PATTERNS, t->nf, src->n_patterns);
        goto fail;
    }
    /* the fingerprint: file names (not directories, so a moved dataset still
     * resumes), the read options and every feature's full spec */
    uint64_t h = 0xcbf29ce484222325ull;
    st->spec.n = st->out.n = t->nf;
    for (int f = 0; f < t->nf; f++) {
        const loom_tfr_feature *c = &src->tfr[f];
        if ((unsigned)c->dtype > LOOM_TFR_FLOAT32 || c->rank < 0 || c->rank > LOOM_MAX_RANK) {
            rc = dstage_err_(st, err, LOOM_ECONFIG, "feature \"%s\": bad dtype %d or rank %d", src->feature[f],
                             (int)c->dtype, c->rank);
            goto fail;
        }
        for (int g = 0; g < f; g++)
            if (!strcmp(src->feature[g], src->feature[f])) {
                rc = dstage_err_(st, err, LOOM_ECONFIG, "feature \"%s\" is declared twice", src->feature[f]);
                goto fail;
            }
        snprintf(st->spec.name[f], LOOM_NAME_MAX, "%s", src->feature[f]);
        st->spec.dtype[f] = tdt[c->dtype];
        st->spec.shape[f] = loom_shape_make(c->rank, c->shape);
        st->maxshape[f] = st->spec.shape[f];
        loom_feature_spec *s = &t->fs[f];
        s->name = st->spec.name[f];
        s->dtype = pdt[c->dtype];
        s->shape = st->spec.shape[f];
        s->var_len = c->var_len;
        s->required = !c->var_len && !c->has_default;
        s->default_value = c->default_value;
        s->pad_value = c->pad;
        size_t bytes = (size_t)loom_shape_numel(&s->shape) * loom_dtype_size(tdt[c->dtype]);
        if (!(t->buf[f] = loom_alloc_aligned(bytes ? bytes : 1))) {
            rc = loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate %zu bytes for feature \"%s\"", bytes,
                              src->feature[f]);
            goto fail;
        }
        t->fo[f].data = t->buf[f];
        st->out.t[f] = (loom_tensor){.dtype = tdt[c->dtype], .shape = st->spec.shape[f], .data = t->buf[f]};
        st->mut[f] = 1; /* refilled by every next(): downstream may work in place */
        h = fnv(h, src->feature[f], strlen(src->feature[f]) + 1);
        int64_t fields[3] = {c->dtype, c->rank, (c->var_len ? 1 : 0) | (c->has_default ? 2 : 0)};
        h = fnv(h, fields, sizeof fields);
        h = fnv(h, c->shape, (size_t)c->rank * sizeof c->shape[0]);
        double fill = c->var_len ? c->pad : c->has_default ? c->default_value : 0;
        h = fnv(h, &fill, sizeof fill);
    }
    if ((rc = expand_files(t, src, err))) goto fail;
    h = source_files_hash_(h, t->files, t->n_files);
    int64_t opts[4] = {t->comp, t->on_corrupt, t->shuffle_files, t->shuffle_files ? (int64_t)t->seed : 0};
    h = fnv(h, opts, sizeof opts);
    make_order(t, 0);
    st->card = -2;
    snprintf(st->desc, sizeof st->desc, "tfrecord(%lld files,%s,%s%s,%016llx)", (long long)t->n_files,
             loom_compression_name(t->comp), t->on_corrupt == LOOM_CORRUPT_SKIP ? "skip" : "error",
             t->shuffle_files ? ",shuffle_files" : "", (unsigned long long)h);
    if ((rc = probe(t, err))) goto fail;
    *out = st;
    return LOOM_OK;
fail:
    tfr_close(st);
    return rc;
}
