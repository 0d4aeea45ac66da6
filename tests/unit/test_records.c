/* test_records.c - TFRecord reader/writer (all compressions, corruption,
 * truncation, detection) and the tf.train.Example codec, including fixtures
 * written by real TensorFlow (tests/fixtures/tf, see make_tf_fixtures.py). */
#include "data/data.h"
#include "harness.h"
#include "test_util.h"

#include <stdint.h>
#include <zstd.h>
#include <sys/stat.h>
#include <unistd.h>

static void write_all(const char *path, const void *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (n) fwrite(p, 1, n, f);
    fclose(f);
}

/* The whole file into b (appended); false when it cannot be read. */
static bool read_file_buf(const char *path, loom_buf *b)
{
    FILE *f = fopen(path, "rb");
    if (!f) return false;
    uint8_t chunk[65536];
    size_t k;
    while ((k = fread(chunk, 1, sizeof chunk, f)) > 0) loom_buf_put(b, chunk, k);
    fclose(f);
    return !b->failed;
}

static bool exists(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0;
}

/* ---- CRC ----------------------------------------------------------------- */

static void test_crc_vectors(void)
{
    uint8_t b[32];
    memset(b, 0, 32);
    CHECK(loom_crc32c(b, 32) == 0x8A9136AAu);
    memset(b, 0xff, 32);
    CHECK(loom_crc32c(b, 32) == 0x62A8AB43u);
    for (int i = 0; i < 32; i++) b[i] = (uint8_t)i;
    CHECK(loom_crc32c(b, 32) == 0x46DD794Eu);
    for (int i = 0; i < 32; i++) b[i] = (uint8_t)(31 - i);
    CHECK(loom_crc32c(b, 32) == 0x113FDB5Cu);
    CHECK(loom_crc32c("123456789", 9) == 0xE3069283u);
    CHECK(loom_crc32c_mask(loom_crc32c("\x1a\x11" "CRC test, one two", 19)) == 0x5794D08Au);
    /* unmask = rotate left by 15 after subtracting the delta */
    uint32_t c = 0x8A9136AAu, m = loom_crc32c_mask(c) - 0xa282ead8u;
    CHECK(((m << 15) | (m >> 17)) == c);
}

static void test_compression_names(void)
{
    loom_compression c;
    loom_err err = {0};
    const char *ok[] = {"", "NONE", "none", "GZIP", "gzip", "ZLIB", "zlib", "ZSTD", "zstd", "AUTO"};
    const loom_compression want[] = {LOOM_COMP_NONE, LOOM_COMP_NONE, LOOM_COMP_NONE, LOOM_COMP_GZIP, LOOM_COMP_GZIP,
                                     LOOM_COMP_ZLIB, LOOM_COMP_ZLIB, LOOM_COMP_ZSTD, LOOM_COMP_ZSTD, LOOM_COMP_AUTO};
    for (int i = 0; i < 10; i++) CHECK(loom_compression_parse(ok[i], &c, &err) == LOOM_OK && c == want[i]);
    const char *bad[] = {"Gzip", "gzip ", "SNAPPY", "zst", "ZLIB\n"};
    for (int i = 0; i < 5; i++) {
        CHECK(loom_compression_parse(bad[i], &c, &err) == LOOM_ECONFIG);
        CHECK_CONTAINS(err.msg, "unknown TFRecord compression");
    }
    CHECK(!strcmp(loom_compression_name(LOOM_COMP_ZSTD), "ZSTD"));
}

/* ---- reader / writer ----------------------------------------------------- */

static size_t rec_size(int i)
{
    return i == 0 ? 0 : i == 1 ? (size_t)1 << 20 : i == 2 ? 300000 : i == 5 ? 0 : (size_t)(i * 37) % 1000;
}
static uint8_t rec_byte(int i, size_t j) { return (uint8_t)(i * 131 + j * 7 + (j >> 8)); }

static int write_file(const char *path, loom_compression c, int n)
{
    loom_err err = {0};
    loom_tfrecord_writer *w;
    bool existed = exists(path);
    if (loom_tfrecord_writer_open(&w, path, c, &err)) return -1;
    uint8_t *buf = malloc((size_t)1 << 20);
    for (int i = 0; i < n; i++) {
        size_t L = rec_size(i);
        for (size_t j = 0; j < L; j++) buf[j] = rec_byte(i, j);
        if (loom_tfrecord_writer_write(w, buf, L, &err)) {
            free(buf);
            loom_tfrecord_writer_abort(w);
            return -1;
        }
    }
    free(buf);
    CHECK(existed || !exists(path)); /* committed only on close */
    return loom_tfrecord_writer_close(w, &err);
}

/* Reads path and checks records 0..n-1; returns records read. */
static int read_check(const char *path, loom_compression c, int n, loom_compression *detected)
{
    loom_err err = {0};
    loom_tfrecord *r;
    int rc = loom_tfrecord_open(&r, path, c, LOOM_CORRUPT_ERROR, &err);
    CHECK_MSG(rc == LOOM_OK, "%s", err.msg);
    if (rc) return -1;
    if (detected) *detected = loom_tfrecord_compression(r);
    const uint8_t *d;
    size_t L;
    int i = 0;
    uint64_t off = 0;
    while ((rc = loom_tfrecord_next(r, &d, &L, &err)) == LOOM_OK) {
        CHECK(i < n);
        if (i >= n) break;
        CHECK(L == rec_size(i));
        size_t bad = 0;
        for (size_t j = 0; j < L; j++) bad += d[j] != rec_byte(i, j);
        CHECK(bad == 0);
        off += L + 16;
        CHECK(loom_tfrecord_offset(r) == off);
        i++;
    }
    CHECK_MSG(rc == LOOM_EEOF, "%s", err.msg);
    CHECK(loom_tfrecord_next(r, &d, &L, &err) == LOOM_EEOF); /* EOF is sticky */
    CHECK(loom_tfrecord_count(r) == i);
    loom_tfrecord_close(r);
    return i;
}

static void test_roundtrip_all(void)
{
    const loom_compression cs[] = {LOOM_COMP_NONE, LOOM_COMP_GZIP, LOOM_COMP_ZLIB, LOOM_COMP_ZSTD};
    for (int k = 0; k < 4; k++) {
        char name[32];
        snprintf(name, sizeof name, "rt.%s", loom_compression_name(cs[k]));
        const char *path = tpath(name);
        int n = 120;
        CHECK(write_file(path, cs[k], n) == LOOM_OK);
        char tmp[600];
        snprintf(tmp, sizeof tmp, "%s.tmp", path);
        CHECK(exists(path) && !exists(tmp));
        loom_compression det = LOOM_COMP_AUTO;
        CHECK(read_check(path, cs[k], n, NULL) == n);
        CHECK(read_check(path, LOOM_COMP_AUTO, n, &det) == n);
        CHECK_MSG(det == cs[k], "%s detected as %s", name, loom_compression_name(det));
        unlink(path);
    }
}

static void test_empty_files(void)
{
    const char *path = tpath("empty");
    write_all(path, "", 0);
    const loom_compression cs[] = {LOOM_COMP_NONE, LOOM_COMP_GZIP, LOOM_COMP_ZLIB, LOOM_COMP_ZSTD, LOOM_COMP_AUTO};
    for (int k = 0; k < 5; k++) CHECK(read_check(path, cs[k], 0, NULL) == 0);
    /* a writer with no records still makes a valid (compressed) stream */
    for (int k = 0; k < 4; k++) {
        CHECK(write_file(path, cs[k], 0) == LOOM_OK);
        loom_compression det;
        CHECK(read_check(path, LOOM_COMP_AUTO, 0, &det) == 0);
        CHECK(read_check(path, cs[k], 0, NULL) == 0);
    }
    unlink(path);
}

/* A small plain file of records with these sizes. */
static const size_t small_sizes[] = {0, 5, 17, 3};

static size_t make_small(const char *path, loom_compression c)
{
    loom_err err = {0};
    loom_tfrecord_writer *w;
    CHECK(loom_tfrecord_writer_open(&w, path, c, &err) == LOOM_OK);
    uint8_t buf[32];
    for (int i = 0; i < 4; i++) {
        for (size_t j = 0; j < small_sizes[i]; j++) buf[j] = rec_byte(i, j);
        /* an empty record from NULL, as callers with no payload write it (UBSan: memcpy from NULL) */
        CHECK(loom_tfrecord_writer_write(w, small_sizes[i] ? buf : NULL, small_sizes[i], &err) == LOOM_OK);
    }
    CHECK(loom_tfrecord_writer_close(w, &err) == LOOM_OK);
    size_t n = 0;
    free(slurp(path, &n));
    return n;
}

/* Reads all of path; returns records, *rc_out the final code, err filled. */
static int read_all_records(const char *path, loom_compression c, loom_on_corrupt mode, int *rc_out, loom_err *err,
                            int64_t *skipped, size_t *lens)
{
    loom_tfrecord *r;
    int rc = loom_tfrecord_open(&r, path, c, mode, err);
    if (rc) {
        *rc_out = rc;
        return -1;
    }
    const uint8_t *d;
    size_t L;
    int n = 0;
    while ((rc = loom_tfrecord_next(r, &d, &L, err)) == LOOM_OK) {
        if (lens && n < 16) lens[n] = L;
        n++;
    }
    *rc_out = rc;
    if (skipped) *skipped = loom_tfrecord_skipped(r);
    loom_tfrecord_close(r);
    return n;
}

static void test_gzip_members(void)
{
    /* concatenated gzip members are one stream (RFC 1952), as gzip(1) reads them */
    const char *a = tpath("m1"), *b = tpath("m2");
    size_t na, nb;
    make_small(a, LOOM_COMP_GZIP);
    make_small(b, LOOM_COMP_GZIP);
    uint8_t *pa = slurp(a, &na), *pb = slurp(b, &nb);
    uint8_t *cat = malloc(na + nb);
    memcpy(cat, pa, na);
    memcpy(cat + na, pb, nb);
    write_all(a, cat, na + nb);
    loom_err err = {0};
    int rc;
    size_t lens[16];
    CHECK(read_all_records(a, LOOM_COMP_AUTO, LOOM_CORRUPT_ERROR, &rc, &err, NULL, lens) == 8 && rc == LOOM_EEOF);
    CHECK(lens[4] == 0 && lens[6] == 17);
    /* but trailing bytes after a zlib stream are an error */
    make_small(a, LOOM_COMP_ZLIB);
    free(pa);
    pa = slurp(a, &na);
    memcpy(cat, pa, na);
    cat[na] = 0x78;
    write_all(a, cat, na + 1);
    CHECK(read_all_records(a, LOOM_COMP_ZLIB, LOOM_CORRUPT_ERROR, &rc, &err, NULL, NULL) == 4 && rc == LOOM_EDATA);
    CHECK_CONTAINS(err.msg, "trailing bytes after the end of the zlib stream");
    free(pa);
    free(pb);
    free(cat);
}

static void test_corrupt_length_crc(void)
{
    const char *path = tpath("badlen");
    size_t n = make_small(path, LOOM_COMP_NONE);
    uint8_t *b = slurp(path, &n);
    if (!b) return;
    size_t rec1 = 16 + small_sizes[0];  /* offset of record 1 */
    b[rec1 + 1] ^= 0x01;                /* its length */
    write_all(path, b, n);
    free(b);
    loom_err err = {0};
    int rc;
    int64_t skipped = -1;
    CHECK(read_all_records(path, LOOM_COMP_NONE, LOOM_CORRUPT_ERROR, &rc, &err, NULL, NULL) == 1);
    CHECK(rc == LOOM_EDATA);
    CHECK_CONTAINS(err.msg, "length CRC mismatch");
    CHECK_CONTAINS(err.msg, "at offset 16 (uncompressed stream)");
    CHECK_CONTAINS(err.where, "badlen");
    loom_log_level lvl = loom_log_get_level();
    loom_log_set_level(LOOM_LOG_ERROR); /* the skip warning is expected */
    CHECK(read_all_records(path, LOOM_COMP_NONE, LOOM_CORRUPT_SKIP, &rc, &err, &skipped, NULL) == 1);
    loom_log_set_level(lvl);
    CHECK(rc == LOOM_EEOF && skipped == 1);
    unlink(path);
}

static void test_corrupt_data_crc(void)
{
    const char *path = tpath("baddata");
    size_t n = make_small(path, LOOM_COMP_NONE);
    uint8_t *b = slurp(path, &n);
    if (!b) return;
    size_t rec2 = 16 + small_sizes[0] + 16 + small_sizes[1]; /* offset of record 2 */
    b[rec2 + 12 + 4] ^= 0x80;                                /* a payload byte */
    write_all(path, b, n);
    free(b);
    loom_err err = {0};
    int rc;
    int64_t skipped = -1;
    size_t lens[16];
    CHECK(read_all_records(path, LOOM_COMP_NONE, LOOM_CORRUPT_ERROR, &rc, &err, NULL, NULL) == 2);
    CHECK(rc == LOOM_EDATA);
    CHECK_CONTAINS(err.msg, "data CRC mismatch");
    char want[64];
    snprintf(want, sizeof want, "at offset %zu ", rec2);
    CHECK_CONTAINS(err.msg, want);
    loom_log_level lvl = loom_log_get_level();
    loom_log_set_level(LOOM_LOG_ERROR);
    CHECK(read_all_records(path, LOOM_COMP_NONE, LOOM_CORRUPT_SKIP, &rc, &err, &skipped, lens) == 3);
    loom_log_set_level(lvl);
    CHECK(rc == LOOM_EEOF && skipped == 1);
    CHECK(lens[0] == 0 && lens[1] == 5 && lens[2] == 3); /* record 2 (17 bytes) dropped */
    unlink(path);
}

static void test_truncation_every_offset(void)
{
    const char *path = tpath("trunc.src"), *cut = tpath("trunc");
    size_t n = make_small(path, LOOM_COMP_NONE);
    uint8_t *b = slurp(path, &n);
    if (!b) return;
    size_t bounds[5] = {0};
    for (int i = 0; i < 4; i++) bounds[i + 1] = bounds[i] + small_sizes[i] + 16;
    CHECK(bounds[4] == n);
    loom_log_level lvl = loom_log_get_level();
    loom_log_set_level(LOOM_LOG_ERROR);
    for (size_t k = 0; k < n; k++) {
        write_all(cut, b, k);
        int whole = 0;
        bool boundary = false;
        for (int i = 0; i <= 4; i++) {
            if (bounds[i] <= k) whole = i;
            if (bounds[i] == k) boundary = true;
        }
        loom_err err = {0};
        int rc;
        int64_t skipped = -1;
        int got = read_all_records(cut, LOOM_COMP_NONE, LOOM_CORRUPT_ERROR, &rc, &err, NULL, NULL);
        CHECK_MSG(got == whole, "cut at %zu: %d records, expected %d", k, got, whole);
        if (boundary) {
            CHECK(rc == LOOM_EEOF);
        } else {
            CHECK_MSG(rc == LOOM_EDATA, "cut at %zu: rc %d", k, rc);
            CHECK_CONTAINS(err.msg, "truncated record");
        }
        got = read_all_records(cut, LOOM_COMP_NONE, LOOM_CORRUPT_SKIP, &rc, &err, &skipped, NULL);
        CHECK(got == whole && rc == LOOM_EEOF && skipped == (boundary ? 0 : 1));
    }
    /* compressed: any cut is an error or a correct prefix, never a crash */
    const loom_compression cs[] = {LOOM_COMP_GZIP, LOOM_COMP_ZLIB, LOOM_COMP_ZSTD};
    for (int c = 0; c < 3; c++) {
        make_small(path, cs[c]);
        free(b);
        b = slurp(path, &n);
        int errors = 0;
        for (size_t k = 1; k < n; k++) {
            write_all(cut, b, k);
            loom_err err = {0};
            int rc;
            size_t lens[16];
            int got = read_all_records(cut, cs[c], LOOM_CORRUPT_ERROR, &rc, &err, NULL, lens);
            CHECK(got <= 4);
            for (int i = 0; i < got && i < 4; i++) CHECK(lens[i] == small_sizes[i]);
            if (rc != LOOM_EEOF) {
                CHECK_MSG(rc == LOOM_EDATA, "%s cut at %zu: rc %d %s", loom_compression_name(cs[c]), k, rc, err.msg);
                errors++;
            }
            got = read_all_records(cut, cs[c], LOOM_CORRUPT_SKIP, &rc, &err, NULL, NULL);
            /* a cut inside the magic fails at open, in either mode */
            CHECK_MSG(got <= 4 && (rc == LOOM_EEOF || (got == -1 && rc == LOOM_EDATA)), "%s cut at %zu: rc %d %s",
                      loom_compression_name(cs[c]), k, rc, err.msg);
        }
        CHECK_MSG(errors == (int)n - 1, "%s: %d of %zu cuts not reported", loom_compression_name(cs[c]), (int)n - 1 - errors, n - 1);
    }
    loom_log_set_level(lvl);
    free(b);
    unlink(path);
    unlink(cut);
}

/* ---- the in-place window and whole zstd frames --------------------------- */

static uint8_t win_byte(int rec, size_t k) { return (uint8_t)(rec * 31 + k * 7 + (k >> 9)); }

/* Records of 10 B, 1.5 MiB (larger than the 1 MiB window: it grows), three
 * of 300 KiB (straddling windows, chunks and zstd frames), 0 B and 5 B, in
 * every compression, and for zstd also as one frame of unknown size (another
 * writer's way, streamed by the reader): read back byte for byte. Our zstd
 * writer's frames each declare their content size, 256 KiB but the last. */
static void test_window_and_frames(void)
{
    static const size_t sizes[] = {10, 1536 * 1024, 300 * 1024, 300 * 1024, 300 * 1024, 0, 5};
    const int n = (int)(sizeof sizes / sizeof sizes[0]);
    uint8_t *buf = malloc(sizes[1]);
    const loom_compression cs[] = {LOOM_COMP_NONE, LOOM_COMP_GZIP, LOOM_COMP_ZLIB, LOOM_COMP_ZSTD};
    loom_err err = {0};
    for (int c = 0; c < 5; c++) {
        const char *path = tpath("window.tfrecord");
        if (c < 4) {
            loom_tfrecord_writer *w = NULL;
            CHECK(loom_tfrecord_writer_open(&w, path, cs[c], &err) == LOOM_OK);
            for (int i = 0; w && i < n; i++) {
                for (size_t k = 0; k < sizes[i]; k++) buf[k] = win_byte(i, k);
                CHECK(loom_tfrecord_writer_write(w, buf, sizes[i], &err) == LOOM_OK);
            }
            CHECK_MSG(loom_tfrecord_writer_close(w, &err) == LOOM_OK, "%s", err.msg);
        } else { /* the plain file, as one streamed zstd frame without a content size */
            loom_buf plain;
            loom_buf_init(&plain);
            CHECK(read_file_buf(tpath("window.plain"), &plain));
            ZSTD_CCtx *z = ZSTD_createCCtx();
            size_t cap = ZSTD_compressBound(plain.len);
            uint8_t *zb = malloc(cap);
            ZSTD_inBuffer ib = {plain.data, plain.len / 2, 0}; /* in two calls: the size is not known up front */
            ZSTD_outBuffer ob = {zb, cap, 0};
            while (ib.pos < ib.size) CHECK(!ZSTD_isError(ZSTD_compressStream2(z, &ob, &ib, ZSTD_e_continue)));
            ib.size = plain.len;
            size_t left;
            while ((left = ZSTD_compressStream2(z, &ob, &ib, ZSTD_e_end)) != 0 && !ZSTD_isError(left)) {}
            CHECK(left == 0);
            CHECK(ZSTD_getFrameContentSize(zb, ob.pos) == ZSTD_CONTENTSIZE_UNKNOWN);
            write_all(path, zb, ob.pos);
            free(zb);
            ZSTD_freeCCtx(z);
            loom_buf_fini(&plain);
        }
        if (c == 0) { /* keep the plain stream for the single-frame case */
            loom_buf plain;
            loom_buf_init(&plain);
            CHECK(read_file_buf(path, &plain));
            write_all(tpath("window.plain"), plain.data, plain.len);
            loom_buf_fini(&plain);
        }
        if (c == 3) { /* our writer: frames that declare 256 KiB each (the last: the rest) */
            loom_buf z;
            loom_buf_init(&z);
            CHECK(read_file_buf(path, &z));
            size_t at = 0, frames = 0, total = 0;
            bool sizes_ok = true;
            while (at < z.len) {
                size_t fc = ZSTD_findFrameCompressedSize(z.data + at, z.len - at);
                unsigned long long fs = ZSTD_getFrameContentSize(z.data + at, z.len - at);
                if (ZSTD_isError(fc) || fs == ZSTD_CONTENTSIZE_UNKNOWN || fs == ZSTD_CONTENTSIZE_ERROR) {
                    sizes_ok = false;
                    break;
                }
                total += fs;
                if (at + fc < z.len && fs != 256 * 1024) sizes_ok = false;
                at += fc;
                frames++;
            }
            size_t stream = 0;
            for (int i = 0; i < n; i++) stream += sizes[i] + 16;
            CHECK_MSG(sizes_ok && total == stream && frames == (stream + 256 * 1024 - 1) / (256 * 1024),
                      "%zu frames declaring %zu bytes of a %zu-byte stream", frames, total, stream);
            loom_buf_fini(&z);
        }
        loom_tfrecord *r = NULL;
        CHECK_MSG(loom_tfrecord_open(&r, path, c < 4 ? cs[c] : LOOM_COMP_ZSTD, LOOM_CORRUPT_ERROR, &err) == LOOM_OK,
                  "%s", err.msg);
        int got = 0, bad = 0;
        const uint8_t *d;
        size_t len;
        int rc;
        while (r && (rc = loom_tfrecord_next(r, &d, &len, &err)) == LOOM_OK) {
            if (got < n && len == sizes[got])
                for (size_t k = 0; k < len; k++) bad += d[k] != win_byte(got, k);
            else bad++;
            got++;
        }
        CHECK_MSG(r && rc == LOOM_EEOF && got == n && bad == 0, "case %d: %d of %d records, %d wrong bytes: %s", c, got, n,
                  bad, err.msg);
        loom_tfrecord_close(r);
    }
    free(buf);
}

static void test_corrupt_compressed(void)
{
    const char *path = tpath("cz");
    const loom_compression cs[] = {LOOM_COMP_GZIP, LOOM_COMP_ZLIB, LOOM_COMP_ZSTD};
    loom_log_level lvl = loom_log_get_level();
    loom_log_set_level(LOOM_LOG_ERROR);
    for (int c = 0; c < 3; c++) {
        CHECK(write_file(path, cs[c], 8) == LOOM_OK);
        size_t n = 0;
        uint8_t *b = slurp(path, &n);
        for (size_t k = 4; k < n; k += n / 7 + 1) {
            b[k] ^= 0x5a;
            write_all(path, b, n);
            b[k] ^= 0x5a;
            loom_err err = {0};
            int rc;
            read_all_records(path, cs[c], LOOM_CORRUPT_ERROR, &rc, &err, NULL, NULL);
            CHECK_MSG(rc == LOOM_EDATA || rc == LOOM_EEOF, "rc %d: %s", rc, err.msg);
            read_all_records(path, cs[c], LOOM_CORRUPT_SKIP, &rc, &err, NULL, NULL);
            CHECK(rc == LOOM_EEOF);
        }
        free(b);
    }
    loom_log_set_level(lvl);
    unlink(path);
}

/* A plain file whose first record has length L (so it starts with L's bytes). */
static void write_plain_len(const char *path, size_t L)
{
    loom_err err = {0};
    loom_tfrecord_writer *w;
    uint8_t *buf = calloc(1, L);
    CHECK(loom_tfrecord_writer_open(&w, path, LOOM_COMP_NONE, &err) == LOOM_OK);
    CHECK(loom_tfrecord_writer_write(w, buf, L, &err) == LOOM_OK);
    CHECK(loom_tfrecord_writer_close(w, &err) == LOOM_OK);
    free(buf);
}

static void test_detection(void)
{
    const char *path = tpath("det");
    loom_compression det;
    /* 0x8b1f = 35615: a plain file starting with the gzip magic */
    write_plain_len(path, 0x8b1f);
    loom_err err = {0};
    loom_tfrecord *r;
    CHECK(loom_tfrecord_open(&r, path, LOOM_COMP_AUTO, LOOM_CORRUPT_ERROR, &err) == LOOM_OK);
    CHECK(loom_tfrecord_compression(r) == LOOM_COMP_NONE);
    const uint8_t *d;
    size_t L;
    CHECK(loom_tfrecord_next(r, &d, &L, &err) == LOOM_OK && L == 0x8b1f);
    loom_tfrecord_close(r);
    CHECK(loom_tfrecord_open(&r, path, LOOM_COMP_NONE, LOOM_CORRUPT_ERROR, &err) == LOOM_OK);
    loom_tfrecord_close(r);
    /* 0x9c78: starts with 78 9c, a valid zlib header */
    write_plain_len(path, 0x9c78);
    CHECK(loom_tfrecord_open(&r, path, LOOM_COMP_AUTO, LOOM_CORRUPT_ERROR, &err) == LOOM_OK);
    CHECK(loom_tfrecord_compression(r) == LOOM_COMP_NONE);
    CHECK(loom_tfrecord_next(r, &d, &L, &err) == LOOM_OK && L == 0x9c78);
    loom_tfrecord_close(r);
    /* declared compression that does not match */
    CHECK(write_file(path, LOOM_COMP_GZIP, 3) == LOOM_OK);
    CHECK(loom_tfrecord_open(&r, path, LOOM_COMP_ZSTD, LOOM_CORRUPT_ERROR, &err) == LOOM_EDATA);
    CHECK_CONTAINS(err.msg, "declared ZSTD but starts with the gzip magic 1f 8b");
    CHECK(loom_tfrecord_open(&r, path, LOOM_COMP_NONE, LOOM_CORRUPT_ERROR, &err) == LOOM_EDATA);
    CHECK_CONTAINS(err.msg, "declared NONE but starts with the gzip magic 1f 8b");
    CHECK(loom_tfrecord_open(&r, path, LOOM_COMP_ZLIB, LOOM_CORRUPT_ERROR, &err) == LOOM_EDATA);
    CHECK(write_file(path, LOOM_COMP_NONE, 3) == LOOM_OK);
    CHECK(loom_tfrecord_open(&r, path, LOOM_COMP_GZIP, LOOM_CORRUPT_ERROR, &err) == LOOM_EDATA);
    CHECK_CONTAINS(err.msg, "declared GZIP but starts with a valid uncompressed TFRecord header");
    CHECK(write_file(path, LOOM_COMP_ZSTD, 3) == LOOM_OK);
    CHECK(loom_tfrecord_open(&r, path, LOOM_COMP_GZIP, LOOM_CORRUPT_ERROR, &err) == LOOM_EDATA);
    CHECK_CONTAINS(err.msg, "the zstd magic 28 b5 2f fd");
    CHECK(write_file(path, LOOM_COMP_ZLIB, 3) == LOOM_OK);
    CHECK(read_check(path, LOOM_COMP_AUTO, 3, &det) == 3 && det == LOOM_COMP_ZLIB);
    /* garbage: read as plain, fails at offset 0 */
    write_all(path, "hello, this is not a record", 27);
    CHECK(loom_tfrecord_open(&r, path, LOOM_COMP_AUTO, LOOM_CORRUPT_ERROR, &err) == LOOM_OK);
    CHECK(loom_tfrecord_next(r, &d, &L, &err) == LOOM_EDATA);
    CHECK_CONTAINS(err.msg, "at offset 0");
    CHECK(loom_tfrecord_next(r, &d, &L, &err) == LOOM_EDATA); /* sticky */
    loom_tfrecord_close(r);
    /* missing file, directory */
    CHECK(loom_tfrecord_open(&r, tpath("nope"), LOOM_COMP_AUTO, LOOM_CORRUPT_ERROR, &err) == LOOM_EIO);
    CHECK_CONTAINS(err.msg, "No such file");
    CHECK(loom_tfrecord_open(&r, tmpdir, LOOM_COMP_AUTO, LOOM_CORRUPT_ERROR, &err) == LOOM_EIO);
    unlink(path);
}

static void test_writer_errors(void)
{
    loom_err err = {0};
    loom_tfrecord_writer *w;
    CHECK(loom_tfrecord_writer_open(&w, "/nonexistent-dir/x.tfrecord", LOOM_COMP_GZIP, &err) == LOOM_EIO);
    CHECK_CONTAINS(err.msg, "open(/nonexistent-dir/x.tfrecord.tmp) failed");
    CHECK(loom_tfrecord_writer_open(&w, tpath("x"), LOOM_COMP_AUTO, &err) == LOOM_EUSAGE);
    /* abort leaves nothing behind */
    CHECK(loom_tfrecord_writer_open(&w, tpath("ab"), LOOM_COMP_ZSTD, &err) == LOOM_OK);
    CHECK(loom_tfrecord_writer_write(w, "abc", 3, &err) == LOOM_OK);
    loom_tfrecord_writer_abort(w);
    CHECK(!exists(tpath("ab")) && !exists(tpath("ab.tmp")));
    loom_tfrecord_writer_abort(NULL);
    loom_tfrecord_close(NULL);
}

/* ---- Example codec ------------------------------------------------------- */

static void test_example_worked_bytes(void)
{
    static const uint8_t want[] = {0x0a, 0x13, 0x0a, 0x11, 0x0a, 0x01, 0x78, 0x12, 0x0c, 0x12, 0x0a,
                                   0x0a, 0x08, 0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x00, 0x40};
    loom_example_builder b;
    loom_example_builder_init(&b);
    float v[] = {1.0f, 2.0f};
    loom_example_add_floats(&b, "x", v, 2);
    const uint8_t *d;
    size_t n;
    loom_err err = {0};
    CHECK(loom_example_finish(&b, &d, &n, &err) == LOOM_OK);
    CHECK(n == sizeof want && !memcmp(d, want, n));
    loom_example ex;
    loom_example_init(&ex);
    CHECK(loom_example_parse(&ex, want, sizeof want, &err) == LOOM_OK);
    const loom_example_feature *f = loom_example_find(&ex, "x");
    float got[4] = {0};
    CHECK(f && f->kind == LOOM_FEATURE_FLOAT && f->count == 2);
    CHECK(f && loom_example_floats(f, got, 4) == 2 && got[0] == 1.0f && got[1] == 2.0f);
    CHECK(loom_example_find(&ex, "y") == NULL);
    loom_example_fini(&ex);
    loom_example_builder_fini(&b);
}

static void test_example_roundtrip(void)
{
    loom_example_builder b;
    loom_example_builder_init(&b);
    loom_example ex;
    loom_example_init(&ex);
    loom_err err = {0};
    for (int round = 0; round < 3; round++) { /* reuse of builder and parser */
        loom_example_builder_reset(&b);
        uint8_t img[784];
        for (int i = 0; i < 784; i++) img[i] = (uint8_t)(i * 7 + round);
        loom_bytes_view bv[3] = {{img, 784}, {(const uint8_t *)"", 0}, {(const uint8_t *)"hello", 5}};
        int64_t iv[] = {0, 1, -1, 127, 128, -300, INT64_MAX, INT64_MIN, round};
        float fv[] = {0.0f, -0.0f, 1.5f, -3.25e-8f, 1e30f, INFINITY};
        loom_example_add_bytes(&b, "image", bv, 3);
        loom_example_add_int64s(&b, "ints", iv, 9);
        loom_example_add_floats(&b, "floats", fv, 6);
        loom_example_add_floats(&b, "empty_f", NULL, 0);
        loom_example_add_int64s(&b, "empty_i", NULL, 0);
        loom_example_add_bytes(&b, "", bv + 2, 1); /* an empty name is a valid key */
        const uint8_t *d;
        size_t n;
        CHECK(loom_example_finish(&b, &d, &n, &err) == LOOM_OK);
        CHECK(loom_example_parse(&ex, d, n, &err) == LOOM_OK);
        CHECK(ex.n == 6);
        const loom_example_feature *f = loom_example_find(&ex, "image");
        loom_bytes_view got[4];
        CHECK(f && f->kind == LOOM_FEATURE_BYTES && f->count == 3 && f->bytes_total == 789);
        CHECK(f && loom_example_bytes(f, got, 4) == 3 && got[0].len == 784 && !memcmp(got[0].data, img, 784) &&
              got[1].len == 0 && got[2].len == 5 && !memcmp(got[2].data, "hello", 5));
        f = loom_example_find(&ex, "ints");
        int64_t gi[9];
        CHECK(f && f->kind == LOOM_FEATURE_INT64 && loom_example_int64s(f, gi, 9) == 9 && !memcmp(gi, iv, sizeof iv));
        CHECK(f && loom_example_int64s(f, gi, 2) == 2); /* max respected */
        f = loom_example_find(&ex, "floats");
        float gf[6];
        CHECK(f && f->count == 6 && loom_example_floats(f, gf, 6) == 6 && !memcmp(gf, fv, sizeof fv));
        f = loom_example_find(&ex, "empty_f");
        CHECK(f && f->kind == LOOM_FEATURE_FLOAT && f->count == 0); /* empty list: present, not missing */
        f = loom_example_find(&ex, "empty_i");
        CHECK(f && f->kind == LOOM_FEATURE_INT64 && f->count == 0);
        f = loom_example_find(&ex, "");
        CHECK(f && f->kind == LOOM_FEATURE_BYTES && f->count == 1);
        /* asking for the wrong kind yields nothing */
        CHECK(loom_example_floats(loom_example_find(&ex, "ints"), gf, 6) == 0);
    }
    /* many features: the hash table grows */
    loom_example_builder_reset(&b);
    char name[32];
    for (int64_t i = 0; i < 500; i++) {
        snprintf(name, sizeof name, "f%lld", (long long)i);
        loom_example_add_int64s(&b, name, &i, 1);
    }
    const uint8_t *d;
    size_t n;
    CHECK(loom_example_finish(&b, &d, &n, &err) == LOOM_OK);
    CHECK(loom_example_parse(&ex, d, n, &err) == LOOM_OK && ex.n == 500);
    int bad = 0;
    for (int64_t i = 0; i < 500; i++) {
        snprintf(name, sizeof name, "f%lld", (long long)i);
        const loom_example_feature *f = loom_example_find(&ex, name);
        int64_t v = -1;
        bad += !f || loom_example_int64s(f, &v, 1) != 1 || v != i;
    }
    CHECK(bad == 0);
    loom_example_fini(&ex);
    loom_example_builder_fini(&b);
}

/* Hand-assembled protobuf. */
typedef struct pbw {
    uint8_t b[4096];
    size_t  n;
} pbw;
static void pw_byte(pbw *w, uint8_t x) { w->b[w->n++] = x; }
static void pw_varint(pbw *w, uint64_t v)
{
    while (v >= 0x80) {
        pw_byte(w, (uint8_t)(v | 0x80));
        v >>= 7;
    }
    pw_byte(w, (uint8_t)v);
}
static void pw_bytes(pbw *w, const void *p, size_t n)
{
    memcpy(w->b + w->n, p, n);
    w->n += n;
}
static void pw_sub(pbw *w, uint8_t tag, const pbw *sub)
{
    pw_byte(w, tag);
    pw_varint(w, sub->n);
    pw_bytes(w, sub->b, sub->n);
}
static void pw_float(pbw *w, float f) { pw_bytes(w, &f, 4); }
/* unknown fields of every wire type: 15 varint, 16 fixed64, 17 bytes, 18 fixed32 */
static void pw_unknowns(pbw *w)
{
    pw_varint(w, 15 << 3 | 0);
    pw_varint(w, 300);
    pw_varint(w, 16 << 3 | 1);
    pw_bytes(w, "12345678", 8);
    pw_varint(w, 17 << 3 | 2);
    pw_varint(w, 3);
    pw_bytes(w, "abc", 3);
    pw_varint(w, 18 << 3 | 5);
    pw_bytes(w, "1234", 4);
}

/* entry {value, then key} (reverse order), with unknowns everywhere */
static void entry(pbw *feats, const char *key, const pbw *feature)
{
    pbw e = {0};
    pw_unknowns(&e);
    pw_sub(&e, 0x12, feature);
    pw_byte(&e, 0x0a);
    pw_varint(&e, strlen(key));
    pw_bytes(&e, key, strlen(key));
    pw_sub(feats, 0x0a, &e);
}

static void test_example_unpacked_and_odd(void)
{
    pbw feats = {0}, list, feat;
    /* floats: unpacked 1.5, packed [2, 3], unpacked -4 (all concatenate) */
    list = (pbw){0};
    pw_byte(&list, 0x0d), pw_float(&list, 1.5f);
    pw_unknowns(&list);
    pbw packed = {0};
    pw_float(&packed, 2.0f), pw_float(&packed, 3.0f);
    pw_sub(&list, 0x0a, &packed);
    pw_byte(&list, 0x0d), pw_float(&list, -4.0f);
    feat = (pbw){0};
    pw_unknowns(&feat);
    pw_sub(&feat, 0x12, &list);
    entry(&feats, "f", &feat);
    /* int64: unpacked -1 (10-byte varint), packed [5, -2], unpacked 2^63-1 */
    list = (pbw){0};
    pw_byte(&list, 0x08), pw_varint(&list, (uint64_t)-1);
    packed = (pbw){0};
    pw_varint(&packed, 5), pw_varint(&packed, (uint64_t)-2);
    pw_sub(&list, 0x0a, &packed);
    pw_byte(&list, 0x08), pw_varint(&list, INT64_MAX);
    feat = (pbw){0};
    pw_sub(&feat, 0x1a, &list);
    entry(&feats, "i", &feat);
    /* duplicate key: "d" first int64 [1], then float [9]: last wins */
    list = (pbw){0};
    pw_byte(&list, 0x08), pw_varint(&list, 1);
    feat = (pbw){0};
    pw_sub(&feat, 0x1a, &list);
    entry(&feats, "d", &feat);
    list = (pbw){0};
    pw_byte(&list, 0x0d), pw_float(&list, 9.0f);
    feat = (pbw){0};
    pw_sub(&feat, 0x12, &list);
    entry(&feats, "d", &feat);
    /* oneof: bytes_list then int64_list [7] in one Feature -> int64 [7] */
    feat = (pbw){0};
    list = (pbw){0};
    pw_byte(&list, 0x0a), pw_varint(&list, 2), pw_bytes(&list, "zz", 2);
    pw_sub(&feat, 0x0a, &list);
    list = (pbw){0};
    pw_byte(&list, 0x08), pw_varint(&list, 7);
    pw_sub(&feat, 0x1a, &list);
    entry(&feats, "o", &feat);
    /* an empty Feature: no kind -> missing */
    feat = (pbw){0};
    entry(&feats, "none", &feat);

    /* Example: unknown field, then features split in two Features messages (merged) */
    pbw ex_bytes = {0};
    pw_unknowns(&ex_bytes);
    pw_sub(&ex_bytes, 0x0a, &feats);
    pbw more = {0};
    list = (pbw){0};
    pw_byte(&list, 0x0a), pw_varint(&list, 1), pw_bytes(&list, "q", 1);
    feat = (pbw){0};
    pw_sub(&feat, 0x0a, &list);
    entry(&more, "b", &feat);
    pw_sub(&ex_bytes, 0x0a, &more);

    loom_example ex;
    loom_example_init(&ex);
    loom_err err = {0};
    CHECK_MSG(loom_example_parse(&ex, ex_bytes.b, ex_bytes.n, &err) == LOOM_OK, "%s", err.msg);
    const loom_example_feature *f = loom_example_find(&ex, "f");
    float fv[8];
    CHECK(f && f->kind == LOOM_FEATURE_FLOAT && f->count == 4);
    CHECK(f && loom_example_floats(f, fv, 8) == 4 && fv[0] == 1.5f && fv[1] == 2.0f && fv[2] == 3.0f && fv[3] == -4.0f);
    f = loom_example_find(&ex, "i");
    int64_t iv[8];
    CHECK(f && f->count == 4 && loom_example_int64s(f, iv, 8) == 4 && iv[0] == -1 && iv[1] == 5 && iv[2] == -2 &&
          iv[3] == INT64_MAX);
    f = loom_example_find(&ex, "d");
    CHECK(f && f->kind == LOOM_FEATURE_FLOAT && f->count == 1 && loom_example_floats(f, fv, 1) == 1 && fv[0] == 9.0f);
    f = loom_example_find(&ex, "o");
    CHECK(f && f->kind == LOOM_FEATURE_INT64 && f->count == 1 && loom_example_int64s(f, iv, 8) == 1 && iv[0] == 7);
    f = loom_example_find(&ex, "none");
    CHECK(f && f->kind == LOOM_FEATURE_NONE);
    f = loom_example_find(&ex, "b");
    loom_bytes_view bv;
    CHECK(f && loom_example_bytes(f, &bv, 1) == 1 && bv.len == 1 && bv.data[0] == 'q');
    CHECK(ex.n == 6);

    /* the same via the parse spec: "none" is missing -> default */
    loom_feature_spec spec[] = {
        {.name = "none", .dtype = LOOM_PARSE_F32, .shape = {1, {2}}, .default_value = 0.5},
        {.name = "i", .dtype = LOOM_PARSE_I64, .shape = {1, {4}}},
    };
    float o0[2];
    int64_t o1[4];
    loom_feature_out out[2] = {{o0, 0}, {o1, 0}};
    CHECK(loom_example_extract(&ex, spec, 2, 0, out, &err) == LOOM_OK);
    CHECK(o0[0] == 0.5f && o0[1] == 0.5f && out[0].length == 0 && out[1].length == 4 && o1[0] == -1);
    loom_example_fini(&ex);
}

static void test_example_malformed(void)
{
    loom_example ex;
    loom_example_init(&ex);
    loom_err err = {0};
    /* truncate a real Example at every length: an error or a valid prefix, never a crash */
    loom_example_builder b;
    loom_example_builder_init(&b);
    uint8_t img[200];
    memset(img, 3, sizeof img);
    loom_bytes_view bv = {img, sizeof img};
    int64_t iv[] = {-5, 300, 1};
    float fv[] = {1, 2};
    loom_example_add_bytes(&b, "image", &bv, 1);
    loom_example_add_int64s(&b, "label", iv, 3);
    loom_example_add_floats(&b, "w", fv, 2);
    const uint8_t *d;
    size_t n;
    CHECK(loom_example_finish(&b, &d, &n, &err) == LOOM_OK);
    int ok = 0;
    for (size_t k = 0; k < n; k++) {
        uint8_t *cp = malloc(k ? k : 1); /* exact-size copy: valgrind/asan see any over-read */
        memcpy(cp, d, k);
        int rc = loom_example_parse(&ex, cp, k, &err);
        CHECK(rc == LOOM_OK || rc == LOOM_EDATA);
        if (rc == LOOM_OK) ok++;
        else CHECK_CONTAINS(err.msg, "malformed tf.train.Example");
        free(cp);
    }
    CHECK(ok == 1); /* only the empty prefix */
    loom_example_builder_fini(&b);

    struct { const char *bytes; size_t n; const char *msg; } bad[] = {
        {"\x0a\x05\x0a\x03", 4, "runs past the end"},
        {"\x0a\x80", 2, "truncated varint"},
        {"\x08\x01", 2, "Example.features has wire type 0"},
        {"\x0a\x02\x08\x01", 4, "Features.feature has wire type 0"},
        {"\x0a\x04\x0a\x02\x10\x01", 6, "Features.feature value has wire type 0"},
        {"\x0a\x06\x0a\x04\x12\x02\x10\x01", 8, "Feature.float_list has wire type 0"},
        {"\x0a\x08\x0a\x06\x12\x04\x12\x02\x08\x01", 10, "FloatList.value has wire type 0"},
        {"\x0a\x0b\x0a\x09\x12\x07\x12\x05\x0a\x03\x00\x00\x00", 13, "not a multiple of 4"},
        {"\x0a\x09\x0a\x07\x12\x05\x1a\x03\x0a\x01\x80", 11, "truncated varint"},
        {"\x1b", 1, "wire type 3"},
        {"\x00", 1, "invalid field number 0"},
        {"\x10\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 12, "longer than 10 bytes"},
        {"\x15\x01\x02", 3, "truncated fixed32"},
        {"\x11\x01\x02", 3, "truncated fixed64"},
        {"\x0a\x08\x0a\x06\x12\x04\x12\x02\x0d\x01", 10, "truncated float"},
        {"\x0a\x07\x0a\x05\x12\x03\x0a\x01\x08", 9, "BytesList.value has wire type 0"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        uint8_t *cp = malloc(bad[i].n);
        memcpy(cp, bad[i].bytes, bad[i].n);
        CHECK_MSG(loom_example_parse(&ex, cp, bad[i].n, &err) == LOOM_EDATA, "case %zu", i);
        CHECK_CONTAINS(err.msg, bad[i].msg);
        free(cp);
    }
    loom_example_fini(&ex);
}

static void test_parse_spec(void)
{
    loom_example_builder b;
    loom_example_builder_init(&b);
    uint8_t img[784];
    for (int i = 0; i < 784; i++) img[i] = (uint8_t)i;
    loom_bytes_view bv = {img, 784}, name = {(const uint8_t *)"shirt", 5};
    int64_t label = 3, toks[] = {-7, 8};
    float w[] = {0.25f, 0.5f, 0.75f};
    loom_example_add_bytes(&b, "image", &bv, 1);
    loom_example_add_int64s(&b, "label", &label, 1);
    loom_example_add_floats(&b, "w", w, 3);
    loom_example_add_int64s(&b, "tokens", toks, 2);
    loom_example_add_bytes(&b, "name", &name, 1);
    const uint8_t *d;
    size_t n;
    loom_err err = {0};
    CHECK(loom_example_finish(&b, &d, &n, &err) == LOOM_OK);
    loom_example ex;
    loom_example_init(&ex);
    CHECK(loom_example_parse(&ex, d, n, &err) == LOOM_OK);

    loom_feature_spec spec[] = {
        {.name = "image", .dtype = LOOM_PARSE_U8_BYTES, .shape = {2, {28, 28}}, .required = true},
        {.name = "label", .dtype = LOOM_PARSE_I64, .shape = {0, {0}}, .required = true},
        {.name = "w", .dtype = LOOM_PARSE_F32, .shape = {1, {3}}, .required = true},
        {.name = "tokens", .dtype = LOOM_PARSE_I64, .shape = {1, {4}}, .var_len = true, .pad_value = -1},
        {.name = "name", .dtype = LOOM_PARSE_BYTES, .shape = {0, {0}}},
        {.name = "absent", .dtype = LOOM_PARSE_F32, .shape = {1, {2}}, .default_value = 7.5},
    };
    loom_tensor t[6];
    CHECK(loom_feature_spec_tensor(&spec[0], &t[0], &err) == LOOM_OK && t[0].dtype == LOOM_U8);
    CHECK(loom_feature_spec_tensor(&spec[1], &t[1], &err) == LOOM_OK && t[1].dtype == LOOM_I64);
    CHECK(loom_feature_spec_tensor(&spec[2], &t[2], &err) == LOOM_OK && t[2].dtype == LOOM_F32);
    CHECK(loom_feature_spec_tensor(&spec[3], &t[3], &err) == LOOM_OK);
    CHECK(loom_feature_spec_tensor(&spec[4], &t[4], &err) == LOOM_EUNSUPPORTED);
    CHECK(loom_feature_spec_tensor(&spec[5], &t[5], &err) == LOOM_OK);
    loom_bytes_view nameout;
    loom_feature_out out[6] = {{t[0].data, 0}, {t[1].data, 0}, {t[2].data, 0}, {t[3].data, 0}, {&nameout, 0}, {t[5].data, 0}};
    CHECK_MSG(loom_example_extract(&ex, spec, 6, 0, out, &err) == LOOM_OK, "%s", err.msg);
    CHECK(!memcmp(t[0].data, img, 784));
    CHECK(((int64_t *)t[1].data)[0] == 3);
    CHECK(!memcmp(t[2].data, w, sizeof w));
    int64_t *tk = t[3].data;
    CHECK(out[3].length == 2 && tk[0] == -7 && tk[1] == 8 && tk[2] == -1 && tk[3] == -1);
    CHECK(nameout.len == 5 && !memcmp(nameout.data, "shirt", 5));
    float *ab = t[5].data;
    CHECK(out[5].length == 0 && ab[0] == 7.5f && ab[1] == 7.5f);
    /* default_data instead of a scalar */
    float dflt[2] = {1, 2};
    loom_feature_spec s2 = spec[5];
    s2.default_data = dflt;
    CHECK(loom_example_extract(&ex, &s2, 1, 0, &out[5], &err) == LOOM_OK && ab[0] == 1 && ab[1] == 2);

    /* errors name the feature, the record and expected vs found */
    loom_feature_spec e = {.name = "zzz", .dtype = LOOM_PARSE_F32, .shape = {0, {0}}, .required = true};
    CHECK(loom_example_extract(&ex, &e, 1, 5, &out[2], &err) == LOOM_EDATA);
    CHECK_CONTAINS(err.msg, "record 5: feature \"zzz\": required but missing (expected float_list float32 ()");
    e = (loom_feature_spec){.name = "label", .dtype = LOOM_PARSE_F32, .shape = {0, {0}}};
    CHECK(loom_example_extract(&ex, &e, 1, 6, &out[2], &err) == LOOM_EDATA);
    CHECK_CONTAINS(err.msg, "record 6: feature \"label\": expected float_list (float32 ()), found int64_list with 1 values");
    e = (loom_feature_spec){.name = "w", .dtype = LOOM_PARSE_F32, .shape = {1, {2}}};
    CHECK(loom_example_extract(&ex, &e, 1, 7, &out[2], &err) == LOOM_EDATA);
    CHECK_CONTAINS(err.msg, "record 7: feature \"w\": expected 2 values of float32, found 3");
    e = (loom_feature_spec){.name = "tokens", .dtype = LOOM_PARSE_I64, .shape = {1, {1}}, .var_len = true};
    CHECK(loom_example_extract(&ex, &e, 1, 8, &out[3], &err) == LOOM_EDATA);
    CHECK_CONTAINS(err.msg, "expected at most 1 values of int64, found 2");
    e = (loom_feature_spec){.name = "image", .dtype = LOOM_PARSE_U8_BYTES, .shape = {1, {783}}};
    CHECK(loom_example_extract(&ex, &e, 1, 9, &out[0], &err) == LOOM_EDATA);
    CHECK_CONTAINS(err.msg, "expected 783 bytes for uint8 (raw bytes), found 784");
    /* a shape whose product wraps (2^32 * 2^32 = 0 mod 2^64) is refused, never read as 0 values */
    e = (loom_feature_spec){.name = "absent", .dtype = LOOM_PARSE_F32, .shape = {2, {INT64_C(1) << 32, INT64_C(1) << 32}}};
    CHECK(loom_example_extract(&ex, &e, 1, 10, &out[5], &err) == LOOM_ESHAPE);
    CHECK_CONTAINS(err.msg, "feature \"absent\": shape (4294967296, 4294967296) has no size that fits in memory");
    e.shape = (loom_shape){3, {1 << 21, 1 << 21, 1 << 22}};
    CHECK(loom_feature_spec_tensor(&e, &t[5], &err) == LOOM_ESHAPE);
    e.shape = (loom_shape){1, {-3}};
    CHECK(loom_example_extract(&ex, &e, 1, 10, &out[5], &err) == LOOM_ESHAPE);
    e = (loom_feature_spec){.name = "image", .dtype = LOOM_PARSE_U8_BYTES, .shape = {1, {1000}}, .var_len = true, .pad_value = 9};
    uint8_t big[1000];
    loom_feature_out bo = {big, 0};
    CHECK(loom_example_extract(&ex, &e, 1, 9, &bo, &err) == LOOM_OK && bo.length == 784 && big[783] == img[783] && big[999] == 9);
    for (int i = 0; i < 6; i++)
        if (i != 4) loom_tensor_fini(&t[i]);
    loom_example_fini(&ex);
    loom_example_builder_fini(&b);
}

/* The fast path: true only when its output is exactly the general path's. */
typedef struct fast_bufs {
    uint8_t img[784];
    int64_t label, tokens[4];
    float   w[3];
    loom_feature_out out[4];
} fast_bufs;

static void fast_bufs_init(fast_bufs *f)
{
    memset(f, 0xee, sizeof *f);
    f->out[0] = (loom_feature_out){f->img, -1};
    f->out[1] = (loom_feature_out){&f->label, -1};
    f->out[2] = (loom_feature_out){f->w, -1};
    f->out[3] = (loom_feature_out){f->tokens, -1};
}

static bool fast_same(const fast_bufs *a, const fast_bufs *b)
{
    for (int i = 0; i < 4; i++)
        if (a->out[i].length != b->out[i].length) return false;
    return !memcmp(a->img, b->img, sizeof a->img) && a->label == b->label && !memcmp(a->w, b->w, sizeof a->w) &&
           !memcmp(a->tokens, b->tokens, sizeof a->tokens);
}

/* Runs both paths on (d, n); returns whether the fast one took it (then checks they agree). */
static bool fast_vs_general(const loom_example_fast *fp, const loom_feature_spec *spec, const uint8_t *d, size_t n)
{
    fast_bufs g, f;
    fast_bufs_init(&g);
    fast_bufs_init(&f);
    loom_example ex;
    loom_example_init(&ex);
    loom_err err = {0};
    bool general_ok = loom_example_parse(&ex, d, n, &err) == LOOM_OK && loom_example_extract(&ex, spec, 4, 0, g.out, &err) == LOOM_OK;
    bool took = loom_example_fast_extract(fp, d, n, spec, 4, f.out);
    CHECK_MSG(!took || (general_ok && fast_same(&g, &f)), "fast path took a record the general path %s",
              general_ok ? "read differently" : "refuses");
    loom_example_fini(&ex);
    return took;
}

static void build_fast_example(loom_example_builder *b, bool reorder, int img_len, const char *extra)
{
    static uint8_t img[785];
    for (int i = 0; i < 785; i++) img[i] = (uint8_t)(i * 13 + 1);
    loom_bytes_view bv = {img, (size_t)img_len};
    int64_t label = 7, toks[] = {-5, 300};
    float w[] = {0.5f, -2.0f, 1e-3f};
    loom_example_builder_reset(b);
    if (reorder) loom_example_add_int64s(b, "label", &label, 1);
    loom_example_add_bytes(b, "image", &bv, 1);
    if (!reorder) loom_example_add_int64s(b, "label", &label, 1);
    loom_example_add_floats(b, "w", w, 3);
    loom_example_add_int64s(b, "tokens", toks, 2);
    if (extra) loom_example_add_int64s(b, extra, &label, 1);
}

static void test_example_fast(void)
{
    const loom_feature_spec spec[4] = {
        {.name = "image", .dtype = LOOM_PARSE_U8_BYTES, .shape = {2, {28, 28}}, .required = true},
        {.name = "label", .dtype = LOOM_PARSE_I64, .shape = {0, {0}}, .required = true},
        {.name = "w", .dtype = LOOM_PARSE_F32, .shape = {1, {3}}, .required = true},
        {.name = "tokens", .dtype = LOOM_PARSE_I64, .shape = {1, {4}}, .var_len = true, .pad_value = -1},
    };
    loom_example_builder b;
    loom_example_builder_init(&b);
    loom_example ex;
    loom_example_init(&ex);
    loom_err err = {0};
    const uint8_t *d;
    size_t n;
    loom_example_fast fp = {0};
    build_fast_example(&b, false, 784, NULL);
    CHECK(loom_example_finish(&b, &d, &n, &err) == LOOM_OK);
    CHECK(!fast_vs_general(&fp, spec, d, n)); /* nothing learned yet */
    CHECK(loom_example_parse(&ex, d, n, &err) == LOOM_OK);
    CHECK(loom_example_fast_learn(&fp, &ex, spec, 4) && fp.n == 4);
    CHECK(fast_vs_general(&fp, spec, d, n)); /* the common case is taken, and agrees */
    /* every truncation is refused; every single-byte change is refused or read as the general path reads it */
    uint8_t buf[1024];
    CHECK(n <= sizeof buf);
    memcpy(buf, d, n);
    int trunc_taken = 0, flips_taken = 0;
    for (size_t k = 0; k < n; k++) trunc_taken += fast_vs_general(&fp, spec, buf, k);
    for (size_t k = 0; k < n; k++)
        for (int bit = 0; bit < 8; bit++) {
            buf[k] ^= (uint8_t)(1 << bit);
            flips_taken += fast_vs_general(&fp, spec, buf, n);
            buf[k] ^= (uint8_t)(1 << bit);
        }
    CHECK(trunc_taken == 0);
    CHECK(flips_taken > 0); /* pixel bytes: still valid records, read by the fast path */
    /* another order, a wrong size, an undeclared feature, a missing one: the general path's */
    build_fast_example(&b, true, 784, NULL);
    CHECK(loom_example_finish(&b, &d, &n, &err) == LOOM_OK && !fast_vs_general(&fp, spec, d, n));
    build_fast_example(&b, false, 783, NULL);
    CHECK(loom_example_finish(&b, &d, &n, &err) == LOOM_OK && !fast_vs_general(&fp, spec, d, n));
    build_fast_example(&b, false, 785, NULL);
    CHECK(loom_example_finish(&b, &d, &n, &err) == LOOM_OK && !fast_vs_general(&fp, spec, d, n));
    build_fast_example(&b, false, 784, "extra");
    CHECK(loom_example_finish(&b, &d, &n, &err) == LOOM_OK && !fast_vs_general(&fp, spec, d, n));
    build_fast_example(&b, false, 784, "image"); /* a duplicate key (last wins in the general path) */
    CHECK(loom_example_finish(&b, &d, &n, &err) == LOOM_OK && !fast_vs_general(&fp, spec, d, n));
    loom_example_builder_reset(&b);
    int64_t one = 1;
    loom_example_add_int64s(&b, "label", &one, 1);
    CHECK(loom_example_finish(&b, &d, &n, &err) == LOOM_OK && !fast_vs_general(&fp, spec, d, n));
    /* learning the reordered layout makes it the fast one */
    build_fast_example(&b, true, 784, NULL);
    CHECK(loom_example_finish(&b, &d, &n, &err) == LOOM_OK && loom_example_parse(&ex, d, n, &err) == LOOM_OK);
    loom_example_fast_learn(&fp, &ex, spec, 4);
    CHECK(fast_vs_general(&fp, spec, d, n));
    /* an Example with a feature not declared teaches nothing: the order learned stays */
    build_fast_example(&b, false, 784, "extra");
    CHECK(loom_example_finish(&b, &d, &n, &err) == LOOM_OK && loom_example_parse(&ex, d, n, &err) == LOOM_OK);
    CHECK(!loom_example_fast_learn(&fp, &ex, spec, 4) && fp.n == 4 && !fast_vs_general(&fp, spec, d, n));
    build_fast_example(&b, true, 784, NULL);
    CHECK(loom_example_finish(&b, &d, &n, &err) == LOOM_OK && fast_vs_general(&fp, spec, d, n));
    loom_example_fini(&ex);
    loom_example_builder_fini(&b);
}

/* ---- fixtures written by real TensorFlow --------------------------------- */

/* Pointer just after "key": in p, or NULL. */
static const char *jkey(const char *p, const char *key)
{
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\": ", key);
    const char *q = strstr(p, pat);
    return q ? q + strlen(pat) : NULL;
}

static int jnums(const char *p, double *out, int max)
{
    int n = 0;
    if (!p || *p != '[') return -1;
    p++;
    while (*p && *p != ']' && n < max) {
        char *e;
        out[n++] = strtod(p, &e);
        p = e;
        while (*p == ',' || *p == ' ') p++;
    }
    return n;
}

static void test_tf_fixtures(void)
{
    const char *root = getenv("LOOM_SOURCE_ROOT");
    char dir[512], path[600];
    snprintf(dir, sizeof dir, "%s/tests/fixtures/tf", root ? root : ".");
    snprintf(path, sizeof path, "%s/expected.json", dir);
    size_t jn;
    char *json = (char *)slurp(path, &jn);
    CHECK_MSG(json, "cannot read %s", path);
    if (!json) return;
    json[jn] = 0;
    const char *files[] = {"examples.tfrecord", "examples.tfrecord.gz", "examples.tfrecord.zlib"};
    const loom_compression comps[] = {LOOM_COMP_NONE, LOOM_COMP_GZIP, LOOM_COMP_ZLIB};
    loom_example ex;
    loom_example_init(&ex);
    for (int fi = 0; fi < 3; fi++) {
        for (int mode = 0; mode < 2; mode++) {
            snprintf(path, sizeof path, "%s/%s", dir, files[fi]);
            loom_err err = {0};
            loom_tfrecord *r;
            CHECK(loom_tfrecord_open(&r, path, mode ? LOOM_COMP_AUTO : comps[fi], LOOM_CORRUPT_ERROR, &err) == LOOM_OK);
            CHECK(loom_tfrecord_compression(r) == comps[fi]);
            const char *cur = strstr(json, "\"records\"");
            const uint8_t *d;
            size_t L;
            int rec = 0, rc, bad = 0;
            while ((rc = loom_tfrecord_next(r, &d, &L, &err)) == LOOM_OK) {
                cur = strstr(cur + 1, "{\"label\"");
                if (!cur) break;
                CHECK_MSG(loom_example_parse(&ex, d, L, &err) == LOOM_OK, "%s", err.msg);
                double want[64];
                int64_t label;
                float wts[3];
                int64_t toks[8];
                uint8_t image[784];
                loom_bytes_view name;
                loom_feature_spec spec[] = {
                    {.name = "image", .dtype = LOOM_PARSE_U8_BYTES, .shape = {2, {28, 28}}, .required = true},
                    {.name = "label", .dtype = LOOM_PARSE_I64, .shape = {0, {0}}, .required = true},
                    {.name = "weights", .dtype = LOOM_PARSE_F32, .shape = {1, {3}}, .required = true},
                    {.name = "tokens", .dtype = LOOM_PARSE_I64, .shape = {1, {8}}, .var_len = true},
                    {.name = "name", .dtype = LOOM_PARSE_BYTES, .shape = {0, {0}}, .required = true},
                };
                loom_feature_out out[] = {{image, 0}, {&label, 0}, {wts, 0}, {toks, 0}, {&name, 0}};
                CHECK_MSG(loom_example_extract(&ex, spec, 5, rec, out, &err) == LOOM_OK, "%s", err.msg);
                bad += label != strtoll(jkey(cur, "label"), NULL, 10);
                bad += jnums(jkey(cur, "weights"), want, 64) != 3;
                for (int k = 0; k < 3; k++) bad += wts[k] != (float)want[k];
                /* int64 values > 2^53 would lose precision through strtod: read them as integers */
                const char *tp = jkey(cur, "tokens");
                int nt = 0;
                for (tp = tp ? tp + 1 : ""; *tp && *tp != ']';) {
                    char *e;
                    long long v = strtoll(tp, &e, 10);
                    if (e == tp) break;
                    bad += nt >= out[3].length || toks[nt] != v;
                    nt++;
                    for (tp = e; *tp == ',' || *tp == ' ';) tp++;
                }
                bad += nt != out[3].length;
                const char *nm = jkey(cur, "name");
                bad += !nm || name.len == 0 || strncmp(nm + 1, (const char *)name.data, name.len) || nm[1 + name.len] != '"';
                const char *hex = jkey(cur, "image_hex");
                for (int k = 0; hex && k < 784; k++) {
                    unsigned v;
                    sscanf(hex + 1 + 2 * k, "%2x", &v);
                    bad += image[k] != v;
                }
                /* the generic accessors agree */
                const loom_example_feature *f = loom_example_find(&ex, "tokens");
                bad += !f || f->kind != LOOM_FEATURE_INT64 || f->count != out[3].length;
                rec++;
            }
            CHECK_MSG(rc == LOOM_EEOF, "%s: %s", files[fi], err.msg);
            CHECK_MSG(rec == 20, "%s: %d records", files[fi], rec);
            CHECK_MSG(bad == 0, "%s: %d values differ", files[fi], bad);
            loom_tfrecord_close(r);
        }
    }
    loom_example_fini(&ex);
    free(json);
}

/* Every allocation failing in turn: LOOM_ENOMEM or success, no crash, no leak. */
static void test_out_of_memory(void)
{
    const char *path = tpath("oom");
    const loom_compression cs[] = {LOOM_COMP_NONE, LOOM_COMP_GZIP, LOOM_COMP_ZSTD};
    int nomem = 0, ok = 0;
    for (int c = 0; c < 3; c++) {
        for (long k = 0; k < 40; k++) {
            loom_err err = {0};
            loom_tfrecord_writer *w = NULL;
            loom_example_builder b;
            loom_example ex;
            loom_example_builder_init(&b);
            loom_example_init(&ex);
            int64_t v[3] = {1, -2, 3};
            loom_alloc_fail_after(k);
            int rc = loom_tfrecord_writer_open(&w, path, cs[c], &err);
            for (int i = 0; !rc && i < 40; i++) {
                char name[16];
                snprintf(name, sizeof name, "f%d", i);
                loom_example_add_int64s(&b, name, v, 3);
            }
            const uint8_t *d;
            size_t n;
            if (!rc) rc = loom_example_finish(&b, &d, &n, &err);
            if (!rc) rc = loom_tfrecord_writer_write(w, d, n, &err);
            if (!rc) rc = loom_tfrecord_writer_close(w, &err);
            else loom_tfrecord_writer_abort(w);
            loom_tfrecord *r = NULL;
            if (!rc) rc = loom_tfrecord_open(&r, path, LOOM_COMP_AUTO, LOOM_CORRUPT_ERROR, &err);
            if (!rc) rc = loom_tfrecord_next(r, &d, &n, &err);
            if (!rc) rc = loom_example_parse(&ex, d, n, &err);
            loom_alloc_fail_after(-1);
            CHECK_MSG(rc == LOOM_OK || rc == LOOM_ENOMEM, "rc %d: %s", rc, err.msg);
            if (rc == LOOM_OK) CHECK(ex.n == 40);
            nomem += rc == LOOM_ENOMEM;
            ok += rc == LOOM_OK;
            loom_tfrecord_close(r);
            loom_example_fini(&ex);
            loom_example_builder_fini(&b);
        }
    }
    CHECK(nomem > 0 && ok > 0);
    unlink(path);
}

static const loom_test tests[] = {
    {"crc_vectors", test_crc_vectors},
    {"compression_names", test_compression_names},
    {"roundtrip_all_compressions", test_roundtrip_all},
    {"empty_files", test_empty_files},
    {"gzip_members", test_gzip_members},
    {"corrupt_length_crc", test_corrupt_length_crc},
    {"corrupt_data_crc", test_corrupt_data_crc},
    {"truncation_every_offset", test_truncation_every_offset},
    {"window_and_zstd_frames", test_window_and_frames},
    {"corrupt_compressed_stream", test_corrupt_compressed},
    {"compression_detection", test_detection},
    {"writer_errors", test_writer_errors},
    {"example_worked_bytes", test_example_worked_bytes},
    {"example_roundtrip", test_example_roundtrip},
    {"example_unpacked_and_odd", test_example_unpacked_and_odd},
    {"example_malformed", test_example_malformed},
    {"parse_spec", test_parse_spec},
    {"example_fast_path", test_example_fast},
    {"tf_fixtures", test_tf_fixtures},
    {"out_of_memory", test_out_of_memory},
    {0},
};

int main(void) { return run_in_tmpdir("loom_test_records", tests); }
