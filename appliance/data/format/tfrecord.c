/* tfrecord.c - TFRecord files: a streaming reader (none / GZIP / ZLIB / ZSTD,
 * refillable 256 KiB buffers, never the whole file in memory) with both CRCs
 * verified, and a writer that commits by rename (tf_semantics §1.1-1.5).
 * Threads: one reader or writer per thread at a time; no globals. */
#include "data/data.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>
#define ZSTD_STATIC_LINKING_ONLY /* ZSTD_c_literalCompressionMode (experimental: tried, its failure ignored) */
#include <zstd.h>

#define CHUNK (256 * 1024)   /* TF's default reader and zlib buffer size */
#define HEADER 12            /* u64 length + masked CRC of the length */
#define FOOTER 4             /* masked CRC of the payload */

/* ---- compression names and magic bytes ---------------------------------- */

static const char *const comp_names[] = {"NONE", "GZIP", "ZLIB", "ZSTD", "AUTO"};

const char *loom_compression_name(loom_compression c)
{
    return (unsigned)c <= LOOM_COMP_AUTO ? comp_names[c] : "?";
}

int loom_compression_parse(const char *name, loom_compression *out, loom_err *err)
{
    static const struct { const char *s; loom_compression c; } tab[] = {
        {"", LOOM_COMP_NONE},     {"NONE", LOOM_COMP_NONE}, {"none", LOOM_COMP_NONE},
        {"GZIP", LOOM_COMP_GZIP}, {"gzip", LOOM_COMP_GZIP}, {"ZLIB", LOOM_COMP_ZLIB},
        {"zlib", LOOM_COMP_ZLIB}, {"ZSTD", LOOM_COMP_ZSTD}, {"zstd", LOOM_COMP_ZSTD},
        {"AUTO", LOOM_COMP_AUTO}, {"auto", LOOM_COMP_AUTO},
    };
    for (size_t i = 0; name && i < sizeof tab / sizeof tab[0]; i++)
        if (!strcmp(name, tab[i].s)) {
            *out = tab[i].c;
            return LOOM_OK;
        }
    loom_err_set(err, LOOM_ECONFIG, NULL, "unknown TFRecord compression \"%s\" (expected one of: \"\", NONE, GZIP, ZLIB, ZSTD, AUTO)",
                 name ? name : "(null)");
    return loom_err_hint(err, "TensorFlow reads an unknown name as uncompressed; Loom refuses it. "
                              "Names are exact: upper or lower case, not mixed");
}

static uint32_t le32(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }
static uint64_t le64(const uint8_t *p) { return (uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32; }
static void put_le32(uint8_t *p, uint32_t v) { for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> 8 * i); }
static void put_le64(uint8_t *p, uint64_t v) { for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> 8 * i); }

static bool is_plain(const uint8_t *p, size_t n) { return n >= HEADER && loom_crc32c_mask(loom_crc32c(p, 8)) == le32(p + 8); }
static bool is_gzip(const uint8_t *p, size_t n) { return n >= 2 && p[0] == 0x1f && p[1] == 0x8b; }
static bool is_zstd(const uint8_t *p, size_t n) { return n >= 4 && p[0] == 0x28 && p[1] == 0xb5 && p[2] == 0x2f && p[3] == 0xfd; }
/* RFC 1950: method 8 (deflate), window <= 32 KiB, no preset dictionary,
 * (CMF*256 + FLG) a multiple of 31. */
static bool is_zlib(const uint8_t *p, size_t n)
{
    return n >= 2 && (p[0] & 0x0f) == 8 && (p[0] >> 4) <= 7 && !(p[1] & 0x20) && (p[0] * 256 + p[1]) % 31 == 0;
}

/* What the leading bytes look like, for messages. */
static const char *describe(const uint8_t *p, size_t n, char *buf, size_t cap)
{
    if (n == 0) return "nothing (empty file)";
    if (is_gzip(p, n)) return "the gzip magic 1f 8b";
    if (is_zstd(p, n)) return "the zstd magic 28 b5 2f fd";
    if (is_plain(p, n)) return "a valid uncompressed TFRecord header";
    int k = snprintf(buf, cap, "%s", is_zlib(p, n) ? "a zlib header" : "bytes");
    for (size_t i = 0; i < (n < 4 ? n : 4) && k > 0 && (size_t)k < cap; i++)
        k += snprintf(buf + k, cap - (size_t)k, " %02x", p[i]);
    return buf;
}

/* zlib allocates through loom_alloc too (so the test failure hook reaches it). */
static voidpf z_alloc(voidpf opaque, uInt n, uInt size)
{
    (void)opaque;
    return loom_calloc(n, size);
}
static void z_free(voidpf opaque, voidpf p)
{
    (void)opaque;
    loom_free(p);
}

/* ---- reader -------------------------------------------------------------- */

/* The reader decompresses into one window of stream bytes and hands out
 * records in place: a record's header, payload and footer are parsed where
 * they lie, and the payload pointer returned is into the window (no copy per
 * record). When the bytes left at the window's end are fewer than the next
 * record needs, they move to its start (a partial record, small) and more are
 * produced after them; a record larger than the window grows it, as bytes
 * arrive, so a lying length costs at most twice what the file really holds.
 * ZSTD frames whose content size is known and at most WHOLE_MAX (what our
 * writer writes: a frame per ZFRAME bytes) are decompressed in one call
 * straight into the window; other frames (another writer's single frame of
 * unknown size) stream through ZSTD_decompressStream, as gzip and zlib do. */
#define WIN       (1024 * 1024)     /* the window's first size */
#define ZIN       (512 * 1024)      /* zstd's raw-byte buffer: holds a whole compressed ZFRAME frame */
#define WHOLE_MAX (4 * 1024 * 1024) /* the largest frame decompressed in one call */
#define ZFRAME    (256 * 1024)      /* the writer's zstd frames: stream bytes per frame */
#define ZLEVEL    9                 /* the writer's zstd level (with raw literals and ZMINMATCH: see the writer) */
#define ZMINMATCH 7                 /* the writer's shortest match: fewer, longer sequences to decode */

struct loom_tfrecord {
    char            *path;
    int              fd;
    loom_compression comp;
    loom_on_corrupt  on_corrupt;
    uint8_t         *in;              /* raw file bytes, in_cap (unused after open when uncompressed) */
    size_t           in_cap, in_pos, in_len;
    bool             in_eof;
    uint8_t         *win;             /* decompressed stream bytes [win_pos, win_len) not yet consumed */
    size_t           win_cap, win_pos, win_len;
    z_stream         z;
    bool             z_ready;
    ZSTD_DStream    *zd;
    ZSTD_DCtx       *zdc;             /* whole frames */
    bool             stream_end;      /* the compressed stream ended cleanly (or the plain file's end) */
    bool             zstd_frame_open; /* inside a streamed zstd frame (0 after a frame's last byte) */
    uint64_t         offset;          /* of the next record, uncompressed */
    int64_t          count, skipped;
    bool             done;            /* ended (clean EOF or SKIP after lost framing) */
    int              failed;          /* sticky error code after an error */
    struct ahead    *ah;              /* decompress-ahead, NULL until loom_tfrecord_set_ahead */
    int              pend_rc;         /* a stream error met after some bytes: reported once they are read */
    char             pend_what[200]; /* WHAT_MAX */
    loom_err         pend_err;
};

static int sys_err(loom_tfrecord *r, const char *call, int e, loom_err *err)
{
    return loom_err_set(err, LOOM_EIO, r->path, "%s(%s) failed: %s", call, r->path, strerror(e));
}

/* Reads raw bytes into in[] after what is left; in_eof at the end. */
static int refill_in(loom_tfrecord *r, loom_err *err)
{
    if (r->in_pos > 0 && r->in_pos < r->in_len) memmove(r->in, r->in + r->in_pos, r->in_len - r->in_pos);
    r->in_len -= r->in_pos;
    r->in_pos = 0;
    while (r->in_len < r->in_cap && !r->in_eof) {
        ssize_t k = read(r->fd, r->in + r->in_len, r->in_cap - r->in_len);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) return sys_err(r, "read", errno, err);
        if (k == 0) r->in_eof = true;
        r->in_len += (size_t)k;
        if (k > 0 && r->comp != LOOM_COMP_AUTO) break; /* one read per refill once streaming */
    }
    return LOOM_OK;
}

/* A corrupt compressed stream; the message names the record it was in. */
static int stream_corrupt(loom_tfrecord *r, const char *what, loom_err *err)
{
    loom_err_set(err, LOOM_EDATA, r->path, "corrupt %s stream in the record at offset %llu (uncompressed): %s",
                 loom_compression_name(r->comp), (unsigned long long)r->offset, what);
    return loom_err_hint(err, "the file is damaged or truncated: copy or convert it again (`loom records verify FILE` "
                              "checks it); on_corrupt = skip ends this file at the damage and reads the next");
}

/* inflate's error text in words a user can act on: which check of the
 * stream failed (zlib's own text kept in parentheses, for searching). */
static void inflate_what(const loom_tfrecord *r, char *what, size_t n)
{
    const char *m = r->z.msg ? r->z.msg : "inflate failed";
    bool gz = r->comp == LOOM_COMP_GZIP;
    if (!strcmp(m, "incorrect data check"))
        snprintf(what, n, "the %s trailer's %s does not match the decompressed bytes (%s)", gz ? "gzip member" : "zlib stream",
                 gz ? "CRC-32" : "Adler-32", m);
    else if (!strcmp(m, "incorrect length check"))
        snprintf(what, n, "the gzip member trailer's size (ISIZE) does not match the decompressed length (%s)", m);
    else if (gz && (!strcmp(m, "incorrect header check") || !strcmp(m, "unknown compression method") ||
                    !strcmp(m, "unknown header flags set") || !strcmp(m, "header crc mismatch")))
        snprintf(what, n, "a gzip member header is damaged, or bytes that are not gzip follow the last member (%s)", m);
    else
        snprintf(what, n, "damaged deflate data (%s)", m);
}

/* Inside produce_into (which may run on the decompress-ahead thread, where
 * the record being read is not known): what went wrong, for stream_corrupt
 * once the bytes before it are consumed. */
#define WHAT_MAX 200
#define CORRUPT(msg) (snprintf(what, WHAT_MAX, "%s", (msg)), LOOM_EDATA)

/* At a zstd frame boundary: when the next frame is whole in in[] (reading
 * more if it fits), declares its content size, at most WHOLE_MAX, and that
 * fits in room, decompresses it into dst in one call (*got > 0 or an empty
 * frame: *took). Otherwise leaves it to the streaming decoder. */
static int zstd_whole(loom_tfrecord *r, uint8_t *dst, size_t room, size_t *got, bool *took, char *what, loom_err *err)
{
    *took = false;
    size_t csize;
    for (;;) {
        size_t avail = r->in_len - r->in_pos;
        csize = avail ? ZSTD_findFrameCompressedSize(r->in + r->in_pos, avail) : (size_t)-1;
        if (avail && !ZSTD_isError(csize)) break;
        if (r->in_eof || (r->in_pos == 0 && r->in_len == r->in_cap)) return LOOM_OK; /* truncated, or too big */
        int rc = refill_in(r, err);
        if (rc) return rc;
    }
    unsigned long long fcs = ZSTD_getFrameContentSize(r->in + r->in_pos, csize);
    if (fcs == ZSTD_CONTENTSIZE_UNKNOWN || fcs == ZSTD_CONTENTSIZE_ERROR || fcs > WHOLE_MAX || fcs > room)
        return LOOM_OK;
    size_t n = ZSTD_decompressDCtx(r->zdc, dst, (size_t)fcs, r->in + r->in_pos, csize);
    if (ZSTD_isError(n)) return CORRUPT(ZSTD_getErrorName(n));
    if (n != fcs) return CORRUPT("a frame's content is shorter than its header says");
    r->in_pos += csize;
    *got = n;
    *took = true;
    return LOOM_OK;
}

/* Decompresses the next stream bytes (GZIP, ZLIB, ZSTD) into dst (room > 0
 * bytes): LOOM_OK with *got > 0, LOOM_EEOF at the end of the stream, or an
 * error (a corrupt stream: LOOM_EDATA with only `what` set). Touches the
 * raw-input side of r alone (in[], the decoders, stream_end), so the
 * decompress-ahead thread can run it while the reader parses records. */
static int produce_into(loom_tfrecord *r, uint8_t *dst, size_t room, size_t *got, char *what, loom_err *err)
{
    *got = 0;
    what[0] = 0;
    if (room > (1u << 30)) room = 1u << 30; /* zlib's counts are 32-bit */
    for (;;) {
        if (r->in_pos == r->in_len && !r->in_eof) {
            int rc = refill_in(r, err);
            if (rc) return rc;
        }
        bool exhausted = r->in_pos == r->in_len && r->in_eof;
        if (r->stream_end) {
            if (exhausted) return LOOM_EEOF;
            if (r->comp != LOOM_COMP_GZIP) return CORRUPT("trailing bytes after the end of the zlib stream");
            if (inflateReset(&r->z) != Z_OK) return CORRUPT("inflateReset failed");
            r->stream_end = false; /* concatenated gzip members are legal (RFC 1952) */
        }
        if (r->comp == LOOM_COMP_ZSTD) {
            if (exhausted && !r->zstd_frame_open) return LOOM_EEOF;
            if (!r->zstd_frame_open && !exhausted) {
                bool took;
                int rc = zstd_whole(r, dst, room, got, &took, what, err);
                if (rc) return rc;
                if (took) {
                    if (*got) return LOOM_OK;
                    continue; /* an empty frame */
                }
                exhausted = r->in_pos == r->in_len && r->in_eof;
            }
            ZSTD_inBuffer ib = {r->in, r->in_len, r->in_pos};
            ZSTD_outBuffer ob = {dst, room, 0};
            size_t ret = ZSTD_decompressStream(r->zd, &ob, &ib);
            r->in_pos = ib.pos;
            if (ZSTD_isError(ret)) return CORRUPT(ZSTD_getErrorName(ret));
            r->zstd_frame_open = ret != 0;
            *got = ob.pos;
            if (ob.pos == 0 && exhausted) return CORRUPT("the zstd stream is truncated (file ends inside a frame)");
        } else {
            /* called even when the input is exhausted: inflate may hold output */
            r->z.next_in = r->in + r->in_pos;
            r->z.avail_in = (uInt)(r->in_len - r->in_pos);
            r->z.next_out = dst;
            r->z.avail_out = (uInt)room;
            int zr = inflate(&r->z, Z_NO_FLUSH);
            r->in_pos = r->in_len - r->z.avail_in;
            *got = room - r->z.avail_out;
            if (zr == Z_STREAM_END) r->stream_end = true;
            else if (zr == Z_NEED_DICT) return CORRUPT("needs a preset dictionary");
            else if (zr == Z_BUF_ERROR && exhausted)
                return CORRUPT("the compressed stream is truncated (file ends before its end marker)");
            else if (zr != Z_OK && zr != Z_BUF_ERROR) return inflate_what(r, what, WHAT_MAX), LOOM_EDATA;
        }
        if (*got) return LOOM_OK;
    }
}

/* ---- decompress-ahead ------------------------------------------------------
 * A thread of the reader's own runs produce_into ahead of the records being
 * parsed: each call's output (with our writer's files, one whole zstd frame)
 * goes to the next of AH_SLOTS slots of AH_SLOT bytes, and produce() copies
 * the slots into the window in order. The bytes, and so the records, their
 * offsets and the reader's counts, are those of decompressing inline; an
 * error or the end of the stream travels in its slot, after the bytes before
 * it, and is reported when the reader gets there (with that record's offset,
 * as inline). Threads: the helper alone touches the raw-input side while it
 * runs; the slots' ring (head, len) is under mu. */
#define AH_SLOTS 4
#define AH_SLOT  ZFRAME

typedef struct ah_slot {
    uint8_t *data;
    size_t   len, pos;       /* bytes produced, bytes copied out */
    int      rc;             /* LOOM_OK, or what ended the stream (sticky) */
    char     what[WHAT_MAX]; /* rc == LOOM_EDATA from a corrupt stream: what (else err) */
    loom_err err;
} ah_slot;

struct ahead {
    pthread_t       th;
    pthread_mutex_t mu;
    pthread_cond_t  cv;             /* either side waits on it for the other */
    bool            on;             /* the thread runs (started, not yet joined) */
    bool            stop, ended;    /* stop requested; a slot with rc != OK was pushed */
    int             head, len;      /* the ring of filled slots */
    ah_slot         slot[AH_SLOTS];
};

static void *ah_main(void *arg)
{
    loom_tfrecord *r = arg;
    struct ahead *a = r->ah;
    pthread_mutex_lock(&a->mu);
    for (;;) {
        while (!a->stop && a->len == AH_SLOTS) pthread_cond_wait(&a->cv, &a->mu);
        if (a->stop) break;
        ah_slot *sl = &a->slot[(a->head + a->len) % AH_SLOTS];
        pthread_mutex_unlock(&a->mu);
        sl->pos = 0;
        sl->err = (loom_err){0};
        sl->rc = produce_into(r, sl->data, AH_SLOT, &sl->len, sl->what, &sl->err);
        pthread_mutex_lock(&a->mu);
        a->len++;
        pthread_cond_signal(&a->cv);
        if (sl->rc) {
            a->ended = true; /* nothing after the end or an error */
            break;
        }
    }
    pthread_mutex_unlock(&a->mu);
    return NULL;
}

static void ah_halt(loom_tfrecord *r)
{
    struct ahead *a = r->ah;
    if (!a || !a->on) return;
    pthread_mutex_lock(&a->mu);
    a->stop = true;
    pthread_cond_broadcast(&a->cv);
    pthread_mutex_unlock(&a->mu);
    pthread_join(a->th, NULL);
    a->on = false;
}

static void ah_free(loom_tfrecord *r)
{
    struct ahead *a = r->ah;
    if (!a) return;
    ah_halt(r);
    pthread_mutex_destroy(&a->mu);
    pthread_cond_destroy(&a->cv);
    for (int i = 0; i < AH_SLOTS; i++) loom_free(a->slot[i].data);
    loom_free(a);
    r->ah = NULL;
}

size_t loom_tfrecord_ahead_bytes(void) { return (size_t)AH_SLOTS * AH_SLOT; }

int loom_tfrecord_set_ahead(loom_tfrecord *r, bool on, loom_err *err)
{
    if (!on) {
        ah_halt(r); /* the slots filled stay and are read first */
        return LOOM_OK;
    }
    if (r->comp == LOOM_COMP_NONE || r->done || r->failed || r->pend_rc) return LOOM_OK; /* nothing to decompress */
    struct ahead *a = r->ah;
    if (!a) {
        if (!(a = loom_calloc(1, sizeof *a))) goto nomem;
        r->ah = a;
        pthread_mutex_init(&a->mu, NULL);
        pthread_cond_init(&a->cv, NULL);
        for (int i = 0; i < AH_SLOTS; i++)
            if (!(a->slot[i].data = loom_alloc(AH_SLOT))) goto nomem;
    }
    if (a->on || a->ended) return LOOM_OK;
    a->stop = false;
    if (pthread_create(&a->th, NULL, ah_main, r) != 0)
        return loom_err_set(err, LOOM_ENOMEM, r->path, "cannot start the decompress-ahead thread");
    a->on = true;
    return LOOM_OK;
nomem:
    ah_free(r);
    return loom_err_set(err, LOOM_ENOMEM, r->path, "cannot allocate %zu bytes for decompress-ahead",
                        loom_tfrecord_ahead_bytes());
}

/* produce() from the slots: LOOM_OK with bytes copied, *none when the ring
 * is empty and the thread stopped (decompress inline), or what ended it. */
static int ah_take(loom_tfrecord *r, uint8_t *dst, size_t room, size_t *got, bool *none, loom_err *err)
{
    struct ahead *a = r->ah;
    *got = 0;
    *none = false;
    pthread_mutex_lock(&a->mu);
    while (a->len == 0 && a->on) pthread_cond_wait(&a->cv, &a->mu);
    if (a->len == 0) {
        pthread_mutex_unlock(&a->mu);
        *none = true;
        return LOOM_OK;
    }
    ah_slot *sl = &a->slot[a->head];
    pthread_mutex_unlock(&a->mu);
    if (sl->pos == sl->len && sl->rc) { /* after its bytes; stays at the head: repeats as inline would */
        if (sl->rc == LOOM_EDATA && sl->what[0]) return stream_corrupt(r, sl->what, err);
        if (err) *err = sl->err;
        return sl->rc;
    }
    size_t k = sl->len - sl->pos < room ? sl->len - sl->pos : room;
    memcpy(dst, sl->data + sl->pos, k);
    sl->pos += k;
    *got = k;
    if (sl->pos == sl->len && !sl->rc) {
        pthread_mutex_lock(&a->mu);
        a->head = (a->head + 1) % AH_SLOTS;
        a->len--;
        pthread_cond_signal(&a->cv);
        pthread_mutex_unlock(&a->mu);
    }
    return LOOM_OK;
}

/* Appends the next stream bytes to the window (which has free room).
 * LOOM_OK with win_len grown, LOOM_EEOF at the end of the stream, or an error. */
static int produce(loom_tfrecord *r, loom_err *err)
{
    LOOM_ASSERT(r->win_len < r->win_cap);
    size_t room = r->win_cap - r->win_len, got = 0;
    if (r->comp == LOOM_COMP_NONE) {
        for (;;) {
            if (r->stream_end) return LOOM_EEOF;
            if (room > (1u << 30)) room = 1u << 30;
            ssize_t k = read(r->fd, r->win + r->win_len, room);
            if (k < 0 && errno == EINTR) continue;
            if (k < 0) return sys_err(r, "read", errno, err);
            if (k == 0) {
                r->stream_end = true;
                return LOOM_EEOF;
            }
            r->win_len += (size_t)k;
            return LOOM_OK;
        }
    }
    int rc;
    bool none = true;
    if (r->ah) {
        rc = ah_take(r, r->win + r->win_len, room, &got, &none, err);
        if (!none) {
            r->win_len += got;
            return rc;
        }
    }
    char what[WHAT_MAX];
    if (r->pend_rc) { /* the bytes before the damage were read: now the record that needs more */
        rc = r->pend_rc;
        snprintf(what, sizeof what, "%s", r->pend_what);
        if (err && !what[0]) *err = r->pend_err;
    } else {
        loom_err e = {0};
        rc = produce_into(r, r->win + r->win_len, room, &got, what, &e);
        r->win_len += got;
        if (rc && got) { /* (inflate) bytes, then the damage: it is reported where it lies, not earlier */
            r->pend_rc = rc;
            snprintf(r->pend_what, sizeof r->pend_what, "%s", what);
            r->pend_err = e;
            return LOOM_OK;
        }
        if (rc && err && !what[0]) *err = e;
    }
    if (rc == LOOM_EDATA && what[0]) return stream_corrupt(r, what, err);
    return rc;
}

/* Makes need bytes available at win_pos, or all that is left of the stream
 * (fewer only at its end). */
static int fill(loom_tfrecord *r, size_t need, loom_err *err)
{
    while (r->win_len - r->win_pos < need) {
        size_t have = r->win_len - r->win_pos;
        /* move the partial record to the front when the end has little room left */
        if (r->win_pos > 0 && (r->win_cap - r->win_len < r->win_cap / 2 || r->win_cap - r->win_pos < need)) {
            if (have) memmove(r->win, r->win + r->win_pos, have);
            r->win_len = have;
            r->win_pos = 0;
        }
        if (r->win_len == r->win_cap) { /* full of real bytes and still short: grow */
            size_t cap = r->win_cap * 2 < need ? r->win_cap * 2 : need;
            uint8_t *nb = loom_realloc(r->win, cap);
            if (!nb) return loom_err_set(err, LOOM_ENOMEM, r->path, "cannot allocate %zu bytes for the record at offset %llu",
                                         cap, (unsigned long long)r->offset);
            r->win = nb;
            r->win_cap = cap;
        }
        int rc = produce(r, err);
        if (rc == LOOM_EEOF) return LOOM_OK;
        if (rc) return rc;
    }
    return LOOM_OK;
}

int loom_tfrecord_open(loom_tfrecord **out, const char *path, loom_compression comp,
                       loom_on_corrupt on_corrupt, loom_err *err)
{
    *out = NULL;
    loom_tfrecord *r = loom_calloc(1, sizeof *r);
    if (!r) return loom_err_set(err, LOOM_ENOMEM, path, "cannot allocate a TFRecord reader");
    r->fd = -1;
    r->on_corrupt = on_corrupt;
    r->comp = LOOM_COMP_AUTO; /* refill_in fills a whole chunk while detecting */
    r->in_cap = CHUNK;
    r->win_cap = WIN;
    int rc = LOOM_OK;
    if (!(r->path = loom_strdup(path)) || !(r->in = loom_alloc(CHUNK)) || !(r->win = loom_alloc(WIN))) {
        rc = loom_err_set(err, LOOM_ENOMEM, path, "cannot allocate TFRecord reader buffers");
        goto fail;
    }
    r->fd = loom_open_regular(path, err); /* a regular file: a FIFO would block forever */
    if (r->fd < 0) {
        rc = err ? err->code : LOOM_EIO;
        goto fail;
    }
    struct stat st;
    if (fstat(r->fd, &st) == 0 && S_ISDIR(st.st_mode)) {
        rc = loom_err_set(err, LOOM_EIO, path, "is a directory, not a TFRecord file");
        goto fail;
    }
    while (r->in_len < HEADER && !r->in_eof)
        if ((rc = refill_in(r, err))) goto fail;

    const uint8_t *p = r->in;
    size_t n = r->in_len;
    char desc[64];
    if (comp == LOOM_COMP_AUTO) {
        if (n == 0 || is_plain(p, n)) comp = LOOM_COMP_NONE;
        else if (is_gzip(p, n)) comp = LOOM_COMP_GZIP;
        else if (is_zstd(p, n)) comp = LOOM_COMP_ZSTD;
        else if (is_zlib(p, n)) comp = LOOM_COMP_ZLIB;
        else comp = LOOM_COMP_NONE;
    } else if (n > 0) {
        bool ok = comp == LOOM_COMP_NONE ? is_plain(p, n) || !(is_gzip(p, n) || is_zstd(p, n) || is_zlib(p, n))
                : comp == LOOM_COMP_GZIP ? is_gzip(p, n)
                : comp == LOOM_COMP_ZLIB ? is_zlib(p, n)
                : comp == LOOM_COMP_ZSTD ? is_zstd(p, n) : false;
        if (!ok) {
            rc = loom_err_set(err, LOOM_EDATA, path, "declared %s but starts with %s", loom_compression_name(comp),
                              describe(p, n, desc, sizeof desc));
            loom_err_hint(err, "set the compression to match the file, or AUTO to detect it");
            goto fail;
        }
    }
    r->comp = comp;
    if (comp == LOOM_COMP_NONE) {
        /* the window is the read buffer: what detection read goes first */
        memcpy(r->win, r->in, r->in_len);
        r->win_len = r->in_len;
        r->stream_end = r->in_eof;
        r->in_len = 0;
    } else if (comp == LOOM_COMP_ZSTD) {
        uint8_t *zin = loom_realloc(r->in, ZIN); /* room for a whole compressed frame */
        if (!zin) {
            rc = loom_err_set(err, LOOM_ENOMEM, path, "cannot allocate TFRecord reader buffers");
            goto fail;
        }
        r->in = zin;
        r->in_cap = ZIN;
        if (!(r->zd = ZSTD_createDStream()) || ZSTD_isError(ZSTD_initDStream(r->zd)) || !(r->zdc = ZSTD_createDCtx())) {
            rc = loom_err_set(err, LOOM_ENOMEM, path, "ZSTD_createDStream failed");
            goto fail;
        }
    } else {
        r->z.zalloc = z_alloc;
        r->z.zfree = z_free;
        if (inflateInit2(&r->z, comp == LOOM_COMP_GZIP ? 16 + MAX_WBITS : MAX_WBITS) != Z_OK) {
            rc = loom_err_set(err, LOOM_ENOMEM, path, "inflateInit2 failed");
            goto fail;
        }
        r->z_ready = true;
    }
    if (n == 0) r->done = true; /* an empty file: zero records, whatever the compression */
    *out = r;
    return LOOM_OK;
fail:
    loom_tfrecord_close(r);
    return rc;
}

/* A bad record at offset `at`. lost_framing: the reader cannot go on. */
static int bad_record(loom_tfrecord *r, uint64_t at, bool lost_framing, loom_err *err, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static int bad_record(loom_tfrecord *r, uint64_t at, bool lost_framing, loom_err *err, const char *fmt, ...)
{
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    if (r->on_corrupt == LOOM_CORRUPT_SKIP) {
        r->skipped++;
        if (!lost_framing) {
            loom_warn("%s: skipping the record at offset %llu (uncompressed): %s", r->path, (unsigned long long)at, what);
            return LOOM_OK;
        }
        loom_warn("%s: %s at offset %llu (uncompressed); cannot resynchronise, ending the file here "
                  "(%lld records read, %lld bad records skipped)", r->path, what, (unsigned long long)at,
                  (long long)r->count, (long long)r->skipped);
        r->done = true;
        return LOOM_EEOF;
    }
    r->failed = LOOM_EDATA;
    loom_err_set(err, LOOM_EDATA, r->path, "%s at offset %llu (uncompressed stream)", what, (unsigned long long)at);
    return loom_err_hint(err, "the file is damaged or not a %s TFRecord file; on_corrupt = skip drops bad records",
                         r->comp == LOOM_COMP_NONE ? "plain" : loom_compression_name(r->comp));
}

/* Stream-level failures (corrupt compressed data) lose the framing too. */
static int stream_failed(loom_tfrecord *r, int rc, loom_err *err)
{
    if (rc == LOOM_EDATA && r->on_corrupt == LOOM_CORRUPT_SKIP) {
        r->skipped++;
        loom_warn("%s: %s; ending the file here (%lld records read, %lld bad records skipped)", r->path,
                  err ? err->msg : "corrupt compressed stream", (long long)r->count, (long long)r->skipped);
        r->done = true;
        return LOOM_EEOF;
    }
    r->failed = rc;
    return rc;
}

int loom_tfrecord_next(loom_tfrecord *r, const uint8_t **data, size_t *len, loom_err *err)
{
    *data = NULL;
    *len = 0;
    if (r->failed) return loom_err_set(err, r->failed, r->path, "reading after an earlier error at offset %llu",
                                       (unsigned long long)r->offset);
    for (;;) {
        if (r->done) return LOOM_EEOF;
        uint64_t at = r->offset;
        int rc = fill(r, HEADER, err);
        if (rc) return stream_failed(r, rc, err);
        size_t got = r->win_len - r->win_pos;
        if (got == 0) {
            r->done = true;
            return LOOM_EEOF;
        }
        if (got < HEADER) return bad_record(r, at, true, err, "truncated record (%zu of %d header bytes)", got, HEADER);
        const uint8_t *hdr = r->win + r->win_pos;
        uint64_t L = le64(hdr);
        uint32_t want = le32(hdr + 8), have = loom_crc32c_mask(loom_crc32c(hdr, 8));
        if (want != have)
            return bad_record(r, at, true, err, "corrupted record: length CRC mismatch (stored 0x%08x, computed 0x%08x)", want, have);
        if (L > (uint64_t)SIZE_MAX - HEADER - FOOTER - 1 || L > ((uint64_t)1 << 48))
            return bad_record(r, at, true, err, "record length %llu is absurd", (unsigned long long)L);
        size_t need = HEADER + (size_t)L + FOOTER;
        if ((rc = fill(r, need, err))) return stream_failed(r, rc, err);
        got = r->win_len - r->win_pos;
        if (got < need)
            return bad_record(r, at, true, err, "truncated record (payload of %llu bytes + 4 CRC bytes, only %zu present)",
                              (unsigned long long)L, got - HEADER);
        const uint8_t *payload = r->win + r->win_pos + HEADER;
        want = le32(payload + L);
        have = loom_crc32c_mask(loom_crc32c(payload, (size_t)L));
        if (want != have) {
            rc = bad_record(r, at, false, err, "corrupted record: data CRC mismatch (stored 0x%08x, computed 0x%08x, %llu bytes)",
                            want, have, (unsigned long long)L);
            if (rc) return rc;
            r->win_pos += need;
            r->offset += need;
            continue;
        }
        r->win_pos += need;
        r->offset += need;
        r->count++;
        *data = payload;
        *len = (size_t)L;
        return LOOM_OK;
    }
}

uint64_t loom_tfrecord_offset(const loom_tfrecord *r) { return r->offset; }
int64_t loom_tfrecord_count(const loom_tfrecord *r) { return r->count; }
int64_t loom_tfrecord_skipped(const loom_tfrecord *r) { return r->skipped; }
loom_compression loom_tfrecord_compression(const loom_tfrecord *r) { return r->comp; }

void loom_tfrecord_close(loom_tfrecord *r)
{
    if (!r) return;
    ah_free(r); /* the thread uses the decoders and in[] */
    if (r->fd >= 0) close(r->fd);
    if (r->z_ready) inflateEnd(&r->z);
    ZSTD_freeDStream(r->zd);
    ZSTD_freeDCtx(r->zdc);
    loom_free(r->in);
    loom_free(r->win);
    loom_free(r->path);
    loom_free(r);
}

/* ---- writer -------------------------------------------------------------- */

struct loom_tfrecord_writer {
    char            *path, *tmp;
    int              fd;
    loom_compression comp;
    z_stream         z;
    bool             z_ready;
    ZSTD_CStream    *zc;
    uint8_t         *zin, *zout; /* zstd: ZFRAME stream bytes staged, and their frame */
    size_t           zlen;
    bool             zframes;    /* a zstd frame was written */
    uint8_t         *buf;   /* output staging, CHUNK */
    size_t           len;
    bool             created; /* tmp exists and is ours to remove */
    int              failed;
};

static int w_sys(loom_tfrecord_writer *w, const char *call, const char *arg, loom_err *err)
{
    w->failed = LOOM_EIO;
    return loom_err_set(err, LOOM_EIO, w->path, "%s(%s) failed: %s", call, arg, strerror(errno));
}

static int w_flush(loom_tfrecord_writer *w, const uint8_t *p, size_t n, loom_err *err)
{
    while (n > 0) {
        ssize_t k = write(w->fd, p, n);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) return w_sys(w, "write", w->tmp, err);
        p += k;
        n -= (size_t)k;
    }
    return LOOM_OK;
}

static int w_flush_buf(loom_tfrecord_writer *w, loom_err *err)
{
    int rc = w_flush(w, w->buf, w->len, err);
    w->len = 0;
    return rc;
}

/* Feeds n stream bytes through the compressor; finish ends the stream. */
static int w_emit(loom_tfrecord_writer *w, const uint8_t *p, size_t n, bool finish, loom_err *err)
{
    int rc;
    if (w->comp == LOOM_COMP_NONE) {
        if (w->len + n > CHUNK) {
            if ((rc = w_flush_buf(w, err))) return rc;
            if (n >= CHUNK) return w_flush(w, p, n, err);
        }
        if (n) memcpy(w->buf + w->len, p, n); /* p may be NULL when n == 0 (an empty record) */
        w->len += n;
        return finish ? w_flush_buf(w, err) : LOOM_OK;
    }
    if (w->comp == LOOM_COMP_ZSTD) {
        /* frames of ZFRAME stream bytes, each with its content size in its
         * header, so a reader can decompress a frame in one call (records
         * may straddle frames: a zstd stream is the concatenation) */
        for (;;) {
            size_t k = ZFRAME - w->zlen < n ? ZFRAME - w->zlen : n;
            if (k) { /* p may be NULL when n == 0 */
                memcpy(w->zin + w->zlen, p, k);
                w->zlen += k;
                p += k;
                n -= k;
            }
            if (w->zlen < ZFRAME && !(finish && (w->zlen || !w->zframes))) break;
            size_t c = ZSTD_compress2(w->zc, w->zout, ZSTD_compressBound(ZFRAME), w->zin, w->zlen);
            if (ZSTD_isError(c)) {
                w->failed = LOOM_EIO;
                return loom_err_set(err, LOOM_EIO, w->path, "ZSTD_compress2 failed: %s", ZSTD_getErrorName(c));
            }
            w->zlen = 0;
            w->zframes = true;
            if ((rc = w_flush(w, w->zout, c, err))) return rc;
            if (!n && !finish) break;
        }
        return LOOM_OK;
    }
    /* zlib's avail_in is 32-bit: feed at most 1 GiB at a time. */
    do {
        size_t part = n > (1u << 30) ? (1u << 30) : n;
        w->z.next_in = (Bytef *)p;
        w->z.avail_in = (uInt)part;
        int flush = finish && part == n ? Z_FINISH : Z_NO_FLUSH;
        for (;;) {
            w->z.next_out = w->buf + w->len;
            w->z.avail_out = (uInt)(CHUNK - w->len);
            int zr = deflate(&w->z, flush);
            w->len = CHUNK - w->z.avail_out;
            if (zr == Z_STREAM_ERROR) {
                w->failed = LOOM_EIO;
                return loom_err_set(err, LOOM_EIO, w->path, "deflate failed");
            }
            if (w->len == CHUNK && (rc = w_flush_buf(w, err))) return rc;
            if (flush == Z_FINISH ? zr == Z_STREAM_END : w->z.avail_in == 0) break;
        }
        p += part;
        n -= part;
    } while (n > 0);
    return finish ? w_flush_buf(w, err) : LOOM_OK;
}

int loom_tfrecord_writer_open(loom_tfrecord_writer **out, const char *path, loom_compression comp, loom_err *err)
{
    *out = NULL;
    if ((unsigned)comp >= LOOM_COMP_AUTO)
        return loom_err_set(err, LOOM_EUSAGE, path, "a TFRecord writer needs an explicit compression, not %s",
                            loom_compression_name(comp));
    /* a new file, or a regular one, or a link to one (its target written):
     * never renamed over a FIFO, a device or a directory */
    char target[LOOM_PATH_MAX];
    int rc = loom_output_target(path, target, sizeof target, err);
    if (rc) return rc;
    path = target;
    loom_tfrecord_writer *w = loom_calloc(1, sizeof *w);
    size_t n = strlen(path) + 5;
    if (!w || !(w->path = loom_strdup(path)) || !(w->tmp = loom_alloc(n)) || !(w->buf = loom_alloc(CHUNK))) {
        if (w) {
            loom_free(w->path);
            loom_free(w->tmp);
        }
        loom_free(w);
        return loom_err_set(err, LOOM_ENOMEM, path, "cannot allocate a TFRecord writer");
    }
    snprintf(w->tmp, n, "%s.tmp", path);
    w->comp = comp;
    w->fd = -1;
    if (comp == LOOM_COMP_GZIP || comp == LOOM_COMP_ZLIB) {
        w->z.zalloc = z_alloc;
        w->z.zfree = z_free;
        if (deflateInit2(&w->z, Z_DEFAULT_COMPRESSION, Z_DEFLATED, comp == LOOM_COMP_GZIP ? 16 + MAX_WBITS : MAX_WBITS, 9,
                         Z_DEFAULT_STRATEGY) != Z_OK) {
            rc = loom_err_set(err, LOOM_ENOMEM, path, "deflateInit2 failed");
            goto fail;
        }
        w->z_ready = true;
    } else if (comp == LOOM_COMP_ZSTD) {
        if (!(w->zc = ZSTD_createCStream()) || ZSTD_isError(ZSTD_CCtx_setParameter(w->zc, ZSTD_c_compressionLevel, ZLEVEL)) ||
            !(w->zin = loom_alloc(ZFRAME)) || !(w->zout = loom_alloc(ZSTD_compressBound(ZFRAME)))) {
            rc = loom_err_set(err, LOOM_ENOMEM, path, "ZSTD_createCStream failed");
            goto fail;
        }
        /* literals stored raw: the reader's Huffman decoding was 40% of its
         * zstd instructions on Fashion-MNIST's pixels, and level 6's longer
         * matches make fewer sequences to decode; files 1% larger than level
         * 3 with Huffman literals, read with 54% fewer instructions. An older
         * libzstd that refuses the (experimental) switch writes Huffman literals. */
        (void)ZSTD_CCtx_setParameter(w->zc, ZSTD_c_literalCompressionMode, ZSTD_ps_disable);
        /* level 9 with matches of at least 7 bytes: the decoder's cost is per
         * sequence (~130 instructions each on Fashion-MNIST), and this makes
         * fewer, longer ones: its instructions for the 60,000 records 231M ->
         * 209M, shards 0.4% smaller, writing 1.5x slower (0.55 s for 50 MB).
         * Higher levels (12-19) find shorter matches and decode slower; the
         * frame size (128 KiB to 1 MiB) changes nothing. Any reader reads it. */
        (void)ZSTD_CCtx_setParameter(w->zc, ZSTD_c_minMatch, ZMINMATCH);
    }
    w->fd = open(w->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (w->fd < 0) {
        rc = w_sys(w, "open", w->tmp, err);
        goto fail;
    }
    w->created = true;
    *out = w;
    return LOOM_OK;
fail:
    loom_tfrecord_writer_abort(w);
    return rc;
}

int loom_tfrecord_writer_write(loom_tfrecord_writer *w, const void *data, size_t len, loom_err *err)
{
    if (w->failed) return loom_err_set(err, w->failed, w->path, "writing after an earlier error");
    uint8_t hdr[HEADER], ftr[FOOTER];
    put_le64(hdr, (uint64_t)len);
    put_le32(hdr + 8, loom_crc32c_mask(loom_crc32c(hdr, 8)));
    put_le32(ftr, loom_crc32c_mask(loom_crc32c(data, len)));
    int rc;
    if ((rc = w_emit(w, hdr, HEADER, false, err)) || (rc = w_emit(w, data, len, false, err)) ||
        (rc = w_emit(w, ftr, FOOTER, false, err)))
        return rc;
    return LOOM_OK;
}

int loom_tfrecord_writer_close(loom_tfrecord_writer *w, loom_err *err)
{
    if (!w) return LOOM_OK;
    int rc = w->failed ? loom_err_set(err, w->failed, w->path, "not committed after an earlier error") : LOOM_OK;
    if (!rc) rc = w_emit(w, NULL, 0, true, err);
    if (!rc && fsync(w->fd) < 0) rc = w_sys(w, "fsync", w->tmp, err);
    if (!rc) {
        int fd = w->fd;
        w->fd = -1;
        if (close(fd) < 0) rc = w_sys(w, "close", w->tmp, err);
    }
    if (!rc && rename(w->tmp, w->path) < 0) {
        char arg[2 * LOOM_PATH_MAX];
        snprintf(arg, sizeof arg, "%s, %s", w->tmp, w->path);
        rc = w_sys(w, "rename", arg, err);
    }
    if (!rc) {
        /* make the rename durable */
        char *dir = loom_strdup(w->path);
        if (dir) {
            char *slash = strrchr(dir, '/');
            if (slash == dir) slash[1] = 0;
            else if (slash) *slash = 0;
            int dfd = open(slash ? dir : ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
            if (dfd >= 0) {
                (void)fsync(dfd);
                close(dfd);
            }
            loom_free(dir);
        }
        w->created = false; /* nothing left to remove */
    }
    loom_tfrecord_writer_abort(w);
    return rc;
}

void loom_tfrecord_writer_abort(loom_tfrecord_writer *w)
{
    if (!w) return;
    if (w->fd >= 0) close(w->fd);
    if (w->created) unlink(w->tmp);
    if (w->z_ready) deflateEnd(&w->z);
    ZSTD_freeCStream(w->zc);
    loom_free(w->zin);
    loom_free(w->zout);
    loom_free(w->buf);
    loom_free(w->tmp);
    loom_free(w->path);
    loom_free(w);
}
