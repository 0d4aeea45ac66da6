/* tfrecord.c - the tfrecord source: files of serialized tf.train.Example
 * (tf_semantics §1), read file by file and record by record through the
 * streaming reader (never a whole file in memory), each Example parsed with the
 * declared features into the element's tensors (uint8 raw bytes, int64,
 * float32). The file list is the sorted union of the spec's glob patterns
 * (tf.data.Dataset.list_files with shuffle=False), optionally shuffled per
 * epoch. State = (epoch, file position, records consumed in that file): a
 * restore reopens the file and reads forward to the record, so resuming
 * mid-epoch is exact. Cardinality is unknown (-2): counting needs a full read.
 * Read-ahead: under autotuning the source has a knob of threads (1 = read
 * inline, 2 = a thread of its own, 3 = and decompress-ahead); when its
 * consumer spends time waiting on it the tuner (CPU budget permitting)
 * raises it. The read-ahead thread reads, checks, decompresses and parses
 * the next records, across file boundaries, into a ring of decoded elements
 * (up to RA_SLOTS, and RA_BYTES in all) while the pipeline works on earlier
 * ones; decompress-ahead gives the file's reader a thread that decompresses
 * the frames after the one being parsed (loom_tfrecord_set_ahead). On 2
 * cores the tuner stops at 2: with the fast Example path the read-ahead
 * thread's work (decompress, check, parse) about equals the rest of the
 * Fashion-MNIST pipeline's, and a third busy thread only shares the cores.
 * The elements, their order and the saved state are those of inline reading:
 * each slot carries the position after its record, and save writes the
 * position of the last element handed out. LOOM_DATA_READAHEAD=0|1 and
 * LOOM_DATA_DECOMPRESS_AHEAD=0|1 force them off or on (tests, and the
 * benchmark's before/after; setting either one forces both, the other off
 * unless set).
 * Parsing: records go through loom_example_fast_extract in the order learned
 * from a good record, the general parse + extract (and their errors) only
 * for records it refuses.
 * Threads: one thread at a time drives the stage (see data_internal.h); the
 * read-ahead thread alone touches the reader and the position fields while
 * it runs (ra_on), the consumer only the ring under ra_mu. */
#include "data/data_internal.h"

#include <glob.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define FILES_RNG_LABEL 0x73656c6966726674ull /* "tfrfiles": the shuffle_files stream */
#define RA_SLOTS 1024              /* decoded elements the read-ahead thread may hold */
#define RA_BYTES (4 * 1024 * 1024) /* ... and their bytes, at most (but 2 elements) */
#define DROP_NONFINITE (-1000)     /* decode: a record with a NaN or infinite float dropped (on_nonfinite = skip) */

/* Where the source stands after an element: what save writes. */
typedef struct tfr_pos {
    int64_t  fi, count, skipped;
    uint64_t offset;
    uint32_t done;
} tfr_pos;

typedef struct ra_slot {
    int     rc;  /* LOOM_OK, or the EOF/error that ends the pass (sticky; its text in ra_err) */
    tfr_pos pos; /* after this element */
} ra_slot;

typedef struct tfr_source {
    dstage s;
    char **files; /* sorted, unique; owned */
    int64_t n_files;
    int64_t *order; /* this epoch's file order: indices into files */
    loom_compression comp;
    loom_compression first_comp; /* the first file's, as probe found it (comp resolved when AUTO) */
    loom_on_corrupt on_corrupt;
    bool shuffle_files;
    uint64_t seed;
    int nf;
    loom_feature_spec fs[LOOM_MAX_FEATURES];
    loom_feature_out fo[LOOM_MAX_FEATURES];
    void *buf[LOOM_MAX_FEATURES]; /* the lent element's data */
    loom_example ex;
    loom_example_fast fast; /* the wire order learned from the first good record */
    loom_tfrecord *r; /* reader of files[order[fi]], NULL when none is open */
    int64_t epoch;
    int64_t fi;      /* position in order of the file being read */
    int64_t skipped; /* bad records skipped this pass (files done + Examples skipped) */
    bool done;       /* the pass ended */
    int on_nonfinite;       /* loom_on_nonfinite */
    bool any_f32;           /* a float32 feature to check */
    int64_t nonfinite;      /* records with a NaN or infinite value dropped this pass (on_nonfinite = skip) */
    /* read-ahead (see the top of the file) */
    dknob *knob;                       /* 1 inline, 2 thread; NULL: inline unless forced */
    int ra_force;                      /* LOOM_DATA_READAHEAD: 0 never, 1 always, -1 (unset) the knob */
    bool ra_on;                        /* the thread runs (started, not yet joined) */
    pthread_t ra_th;
    pthread_mutex_t ra_mu;
    pthread_cond_t ra_prod, ra_cons;
    ra_slot ra[RA_SLOTS];
    loom_err ra_err;                   /* the error that ended the thread's pass */
    int64_t ra_n;                      /* slots in the ring: 2 to RA_SLOTS */
    uint8_t *ra_buf[LOOM_MAX_FEATURES]; /* ra_n element buffers per feature */
    size_t ra_bytes[LOOM_MAX_FEATURES]; /* one element's bytes per feature */
    int64_t ra_head, ra_len;           /* the ring, under ra_mu; ra_head is lent while ra_lent */
    bool ra_lent;                      /* the consumer holds ra[ra_head] */
    bool ra_stop, ra_idle;             /* stop requested; the thread ended its pass (EOF/error pushed) */
    bool ra_prod_waits, ra_cons_waits; /* a side sleeps on its condition: the other signals it */
    tfr_pos cur;                       /* the position after the last element the ring handed out */
    /* decompress-ahead: the reader's own thread (loom_tfrecord_set_ahead) */
    int da_force;                      /* LOOM_DATA_DECOMPRESS_AHEAD: 0 never, 1 always, -1 (unset) the knob */
    bool da_want;                      /* wanted (atomic: set by the consumer, applied by whoever reads) */
    bool da_cur;                       /* applied to t->r */
    bool da_counted;                   /* its ring is counted in the stage's memory */
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
/* A NaN or infinite value among the float32 values just decoded: on_nonfinite
 * error names the file, the record and the feature; skip drops the record
 * (DROP_NONFINITE). One pass over each float feature's values, in cache. */
static int check_floats(tfr_source *t, const char *file, int64_t record, uint64_t offset, loom_err *err)
{
    for (int f = 0; f < t->nf; f++) {
        if (t->fs[f].dtype != LOOM_PARSE_F32) continue;
        const uint32_t *u = t->fo[f].data;
        int64_t n = t->fo[f].length;
        uint32_t bad = 0;
        for (int64_t i = 0; i < n; i++) bad |= (u[i] & 0x7f800000u) == 0x7f800000u; /* exponent all ones */
        if (!bad) continue;
        if (t->on_nonfinite == LOOM_NONFINITE_SKIP) return DROP_NONFINITE;
        int64_t i = 0;
        while ((u[i] & 0x7f800000u) != 0x7f800000u) i++;
        loom_err_set(err, LOOM_EDATA, NULL, "feature \"%s\": non-finite value %g at offset %lld", t->fs[f].name,
                     (double)((const float *)t->fo[f].data)[i], (long long)i);
        loom_err_hint(err, "fix or drop the record, or set on_nonfinite = \"skip\"; in the dataset's group "
                           "(data.train / data.eval) to drop such records");
        return record_err(t, file, record, offset, err);
    }
    return LOOM_OK;
}

static int decode(tfr_source *t, const uint8_t *d, size_t len, const char *file, int64_t record, uint64_t offset,
                  bool *malformed, loom_err *err)
{
    *malformed = false;
    if (loom_example_fast_extract(&t->fast, d, len, t->fs, t->nf, t->fo))
        return t->any_f32 ? check_floats(t, file, record, offset, err) : LOOM_OK;
    int rc = loom_example_parse(&t->ex, d, len, err);
    if (rc) {
        *malformed = rc == LOOM_EDATA;
        return record_err(t, file, record, offset, err);
    }
    rc = loom_example_extract(&t->ex, t->fs, t->nf, record, t->fo, err);
    if (rc) return record_err(t, file, record, offset, err);
    (void)loom_example_fast_learn(&t->fast, &t->ex, t->fs, t->nf); /* a record the fast path refused may teach a new order */
    return t->any_f32 ? check_floats(t, file, record, offset, err) : LOOM_OK;
}

static void end_pass(tfr_source *t)
{
    if (t->done) return;
    t->done = true;
    if (t->skipped)
        loom_warn("%s: tfrecord source: %lld bad record%s skipped in epoch %lld (on_corrupt = skip)", t->s.where,
                  (long long)t->skipped, t->skipped == 1 ? "" : "s", (long long)t->epoch);
    if (t->nonfinite)
        loom_warn("%s: tfrecord source: %lld record%s with a NaN or infinite value skipped in epoch %lld "
                  "(on_nonfinite = skip)", t->s.where, (long long)t->nonfinite, t->nonfinite == 1 ? "" : "s",
                  (long long)t->epoch);
    t->nonfinite = 0;
}

static void close_file(tfr_source *t)
{
    t->da_cur = false;
    if (!t->r) return;
    t->skipped += loom_tfrecord_skipped(t->r);
    loom_tfrecord_close(t->r);
    t->r = NULL;
}

static int open_file(tfr_source *t, loom_err *err)
{
    return loom_tfrecord_open(&t->r, cur_file(t), t->comp, t->on_corrupt, err);
}

/* Reads the next record and decodes it into t->fo's buffers: LOOM_OK, or
 * LOOM_EEOF at the end of the pass, or an error. */
static int read_next(tfr_source *t, loom_err *err)
{
    for (;;) {
        if (t->done) return LOOM_EEOF;
        if (t->fi >= t->n_files) {
            end_pass(t);
            return LOOM_EEOF;
        }
        int rc;
        if (!t->r && (rc = open_file(t, err))) return rc;
        bool da = __atomic_load_n(&t->da_want, __ATOMIC_RELAXED);
        if (da != t->da_cur) { /* without memory or a thread the reader stays inline */
            loom_err e = {0};
            t->da_cur = da;
            if (loom_tfrecord_set_ahead(t->r, da, &e) == LOOM_OK && da && !t->da_counted) {
                t->da_counted = true;
                __atomic_fetch_add(&t->s.st_bytes, (int64_t)loom_tfrecord_ahead_bytes(), __ATOMIC_RELAXED);
            }
        }
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
        if (rc == DROP_NONFINITE) {
            t->nonfinite++;
            continue;
        }
        if (rc && malformed && t->on_corrupt == LOOM_CORRUPT_SKIP) {
            loom_warn("%s: %s; skipping it", err->where, err->msg);
            t->skipped++;
            continue;
        }
        return rc;
    }
}


static tfr_pos pos_now(const tfr_source *t)
{
    return (tfr_pos){.fi = t->fi, .count = t->r ? loom_tfrecord_count(t->r) : 0,
                     .offset = t->r ? loom_tfrecord_offset(t->r) : 0, .skipped = t->skipped, .done = t->done};
}

/* ---- read-ahead ------------------------------------------------------------ */

static void *ra_main(void *arg)
{
    tfr_source *t = arg;
    loom_err e = {0}; /* emptied per record by four stores: zeroing its 1 KiB cost ~200 instructions a record */
    pthread_mutex_lock(&t->ra_mu);
    for (;;) {
        if (!t->ra_stop && !t->ra_idle && t->ra_len == t->ra_n) {
            t->ra_prod_waits = true; /* woken once half the ring is free: one wake-up per ra_n / 2 elements */
            while (!t->ra_stop && !t->ra_idle && t->ra_len > t->ra_n / 2) pthread_cond_wait(&t->ra_prod, &t->ra_mu);
            t->ra_prod_waits = false;
        }
        if (t->ra_stop || t->ra_idle) break;
        int64_t k = (t->ra_head + t->ra_len) % t->ra_n;
        pthread_mutex_unlock(&t->ra_mu);
        ra_slot *sl = &t->ra[k];
        for (int f = 0; f < t->nf; f++) t->fo[f].data = t->ra_buf[f] + (size_t)k * t->ra_bytes[f];
        e.code = 0;
        e.where[0] = e.msg[0] = e.hint[0] = 0;
        sl->rc = read_next(t, &e);
        if (sl->rc) t->ra_err = e; /* the last slot the thread fills */
        sl->pos = pos_now(t);
        pthread_mutex_lock(&t->ra_mu);
        t->ra_len++;
        if (sl->rc) t->ra_idle = true; /* the pass ended: nothing more until rewind */
        if (t->ra_cons_waits) pthread_cond_signal(&t->ra_cons);
    }
    pthread_mutex_unlock(&t->ra_mu);
    return NULL;
}

/* Starts the thread from the current position (the ring is empty). */
static void ra_start(tfr_source *t)
{
    t->ra_head = t->ra_len = 0;
    t->ra_lent = t->ra_stop = t->ra_idle = false;
    t->cur = pos_now(t);
    if (pthread_create(&t->ra_th, NULL, ra_main, t) == 0) t->ra_on = true; /* else read inline */
}

/* Stops and joins the thread. The ring keeps what it read (the reader stands
 * after it): ra_next hands it out before reading goes on inline. */
static void ra_halt(tfr_source *t)
{
    if (!t->ra_on) return;
    pthread_mutex_lock(&t->ra_mu);
    t->ra_stop = true;
    pthread_cond_signal(&t->ra_prod);
    pthread_mutex_unlock(&t->ra_mu);
    pthread_join(t->ra_th, NULL);
    t->ra_on = false;
    for (int f = 0; f < t->nf; f++) t->fo[f].data = t->buf[f];
}

/* Stops the thread and forgets the ring (rewind, restore: the position is reset). */
static void ra_drop(tfr_source *t)
{
    ra_halt(t);
    t->ra_head = t->ra_len = 0;
    t->ra_lent = false;
}

/* Elements the thread read that are not yet handed out (or the one lent). */
static bool ra_pending(const tfr_source *t) { return t->ra_len > 0; }

/* Thread mode's next: the ring's head, waiting for it while the thread runs.
 * *drained when the thread has stopped and the ring is empty: read inline. */
static int ra_next(tfr_source *t, loom_elem **out, bool *drained, loom_err *err)
{
    dstage *st = &t->s;
    *drained = false;
    pthread_mutex_lock(&t->ra_mu);
    if (t->ra_lent) { /* the element handed out last is given back */
        t->ra_lent = false;
        t->ra_head = (t->ra_head + 1) % t->ra_n;
        t->ra_len--;
        if (t->ra_prod_waits && t->ra_len <= t->ra_n / 2) pthread_cond_signal(&t->ra_prod);
    }
    if (t->ra_len == 0 && !t->ra_on) {
        pthread_mutex_unlock(&t->ra_mu);
        *drained = true;
        return LOOM_OK;
    }
    if (t->ra_len == 0) {
        int64_t t0 = dnow_ns_();
        t->ra_cons_waits = true;
        while (t->ra_len == 0) pthread_cond_wait(&t->ra_cons, &t->ra_mu);
        t->ra_cons_waits = false;
        __atomic_fetch_add(&st->st_wait_ns, dnow_ns_() - t0, __ATOMIC_RELAXED);
    }
    int64_t k = t->ra_head;
    pthread_mutex_unlock(&t->ra_mu);
    ra_slot *sl = &t->ra[k];
    t->cur = sl->pos;
    if (sl->rc) { /* stays at the head: EOF or the error repeats until rewind */
        if (sl->rc != LOOM_EEOF && err) *err = t->ra_err;
        return sl->rc;
    }
    t->ra_lent = true;
    for (int f = 0; f < t->nf; f++) st->out.t[f].data = t->ra_buf[f] + (size_t)k * t->ra_bytes[f];
    *out = &st->out;
    return LOOM_OK;
}

static int tfr_next(dstage *st, loom_elem **out, loom_err *err)
{
    tfr_source *t = (tfr_source *)st;
    /* the knob's levels (threads): 1 inline, 2 the read-ahead thread, 3 and decompress-ahead too */
    int64_t level = t->knob ? dknob_get_(t->knob) : 1;
    __atomic_store_n(&t->da_want, t->da_force >= 0 ? t->da_force > 0 : level >= 3, __ATOMIC_RELAXED);
    int64_t want = t->ra_force > 0 ? 2 : t->ra_force < 0 && level >= 2 ? 2 : 1;
    if (t->ra_on && want <= 1) ra_halt(t); /* back to inline once the ring's elements are handed out */
    else if (!t->ra_on && want > 1 && !ra_pending(t) && !t->done && t->ra_buf[0]) ra_start(t);
    if (t->ra_on || ra_pending(t)) {
        bool drained;
        int rc = ra_next(t, out, &drained, err);
        if (!drained) return rc;
    }
    for (int f = 0; f < t->nf; f++) st->out.t[f].data = t->buf[f];
    int64_t t0 = t->knob ? dnow_ns_() : 0;
    int rc = read_next(t, err);
    if (t->knob) __atomic_fetch_add(&st->st_wait_ns, dnow_ns_() - t0, __ATOMIC_RELAXED); /* the consumer read it itself */
    if (rc) return rc;
    *out = &st->out;
    return LOOM_OK;
}

static int tfr_rewind(dstage *st, int64_t epoch, loom_err *err)
{
    (void)err;
    tfr_source *t = (tfr_source *)st;
    ra_drop(t);
    close_file(t);
    t->epoch = epoch;
    t->fi = 0;
    t->skipped = 0;
    t->nonfinite = 0;
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
    /* with read-ahead, where the consumer is, not the reader */
    tfr_pos p = t->ra_on || ra_pending(t) ? t->cur : pos_now(t);
    loom_buf_put_i64(b, t->epoch);
    loom_buf_put_i64(b, p.fi);
    loom_buf_put_i64(b, p.count);
    loom_buf_put_u64(b, p.offset);
    loom_buf_put_i64(b, p.skipped);
    loom_buf_put_u32(b, p.done);
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
    ra_drop(t);
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
    ra_halt(t);
    if (t->ra_buf[0]) {
        pthread_mutex_destroy(&t->ra_mu);
        pthread_cond_destroy(&t->ra_prod);
        pthread_cond_destroy(&t->ra_cons);
    }
    for (int f = 0; f < LOOM_MAX_FEATURES; f++) loom_free(t->ra_buf[f]);
    loom_tfrecord_close(t->r);
    loom_example_fini(&t->ex);
    for (int64_t i = 0; i < t->n_files; i++) loom_free(t->files[i]);
    loom_free(t->files);
    loom_free(t->order);
    for (int f = 0; f < LOOM_MAX_FEATURES; f++) loom_free(t->buf[f]);
    loom_free(t);
}

/* The read-ahead ring and its locks; false (the source stays inline) without the memory. */
static bool ra_alloc(tfr_source *t)
{
    if (t->ra_buf[0]) return true;
    size_t elem = 0;
    for (int f = 0; f < t->nf; f++) {
        t->ra_bytes[f] = ((size_t)loom_shape_numel(&t->fs[f].shape) * loom_dtype_size(t->s.spec.dtype[f]) + 63) & ~(size_t)63;
        elem += t->ra_bytes[f];
    }
    t->ra_n = elem ? (int64_t)(RA_BYTES / elem) : RA_SLOTS;
    t->ra_n = t->ra_n < 2 ? 2 : t->ra_n > RA_SLOTS ? RA_SLOTS : t->ra_n;
    for (int f = 0; f < t->nf; f++) {
        if (!(t->ra_buf[f] = loom_alloc_aligned((size_t)t->ra_n * (t->ra_bytes[f] ? t->ra_bytes[f] : 64)))) {
            for (int g = 0; g <= f; g++) {
                loom_free(t->ra_buf[g]);
                t->ra_buf[g] = NULL;
            }
            return false;
        }
    }
    pthread_mutex_init(&t->ra_mu, NULL);
    pthread_cond_init(&t->ra_prod, NULL);
    pthread_cond_init(&t->ra_cons, NULL);
    __atomic_fetch_add(&t->s.st_bytes, t->ra_n * (int64_t)elem, __ATOMIC_RELAXED); /* shown by loom profile */
    return true;
}

/* The read-ahead knob: a thread's worth of CPU, given when the consumer waits.
 * Compressed files start at 2 when the CPU budget holds it: every pass
 * starts with its consumer waiting (empty buffers: the first batch, a
 * shuffle's fill), and decompression is the larger half of the work, so the
 * thread is wanted from the first record; reading inline until the tuner's
 * first period (10 ms) ran the start of each pass on one core. The tuner
 * still gives it back after a second in which the consumer did not wait. */
static void tfr_tune(dstage *st, dtuner *tu)
{
    tfr_source *t = (tfr_source *)st;
    if (t->ra_force >= 0 || t->da_force >= 0 || !ra_alloc(t)) return;
    int64_t start = t->first_comp != LOOM_COMP_NONE && dtuner_cpu_spare_(tu) >= 2 ? 2 : 1;
    t->knob = dtuner_knob_(tu, st, "read-ahead", start, 1, 3, 1);
}

static const dstage_ops tfr_ops = {
    .tune = tfr_tune,
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
    t->first_comp = loom_tfrecord_compression(r);
    const uint8_t *d;
    size_t len;
    if (loom_tfrecord_next(r, &d, &len, &e2) == LOOM_OK) {
        bool malformed;
        uint64_t at = loom_tfrecord_offset(r) - (uint64_t)len - 16;
        rc = decode(t, d, len, t->files[0], 0, at, &malformed, err);
        if ((rc && malformed && t->on_corrupt == LOOM_CORRUPT_SKIP) || rc == DROP_NONFINITE) rc = LOOM_OK;
    }
    loom_tfrecord_close(r);
    return rc;
}

/* LOOM_DATA_READAHEAD and LOOM_DATA_DECOMPRESS_AHEAD (0|1): forcing one forces both (no knob), the other off unless set. */
static void force_from_env(tfr_source *t)
{
    const char *ra = getenv("LOOM_DATA_READAHEAD"), *da = getenv("LOOM_DATA_DECOMPRESS_AHEAD");
    t->ra_force = ra && !strcmp(ra, "1") ? 1 : ra && !strcmp(ra, "0") ? 0 : -1;
    t->da_force = da && !strcmp(da, "1") ? 1 : da && !strcmp(da, "0") ? 0 : -1;
    if (t->da_force >= 0 && t->ra_force < 0) t->ra_force = 0;
    if (t->ra_force >= 0 && t->da_force < 0) t->da_force = 0;
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
    if ((unsigned)src->tfrecord.compression > LOOM_TFR_COMP_ZSTD ||
        (unsigned)src->tfrecord.on_corrupt > LOOM_TFR_CORRUPT_SKIP) {
        rc = dstage_err_(st, err, LOOM_ECONFIG, "bad compression %d or on_corrupt %d", (int)src->tfrecord.compression,
                         (int)src->tfrecord.on_corrupt);
        goto fail;
    }
    t->comp = comps[src->tfrecord.compression];
    t->on_corrupt = src->tfrecord.on_corrupt == LOOM_TFR_CORRUPT_SKIP ? LOOM_CORRUPT_SKIP : LOOM_CORRUPT_ERROR;
    t->on_nonfinite = src->on_nonfinite;
    t->shuffle_files = src->shuffle_files;
    t->seed = ctx ? ctx->seed : 42;
    force_from_env(t);
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
        const loom_tfr_feature *c = &src->tfrecord.features[f];
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
        t->any_f32 |= s->dtype == LOOM_PARSE_F32;
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
    if (t->ra_force > 0 && !ra_alloc(t)) t->ra_force = -1;
    *out = st;
    return LOOM_OK;
fail:
    tfr_close(st);
    return rc;
}
