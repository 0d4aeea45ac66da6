/* summary.c - TensorBoard event files (see summary_internal.h).
 *
 * The protos are encoded by hand: an Event with a Summary holds at most a
 * handful of fields (tf_semantics §2.3-2.5), so a dozen lines of varint and
 * length-delimited writers cover it; protobuf-c plus generated code for
 * event.proto/summary.proto would be a build dependency for less than a page.
 *
 * Framing is TFRecord's (length, masked CRC-32C of the length, payload,
 * masked CRC-32C of the payload; §1.1). data/'s TFRecord writer commits its
 * file by rename at close, but TensorBoard must read an event file while the
 * run is still writing it, so the records are framed here and appended. */
#include "summary_internal.h"
#include "protobuf_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

struct loom_summary {
    int      fd;
    char     path[LOOM_PATH_MAX];
    loom_buf pending;          /* framed records not yet written */
    loom_buf ev, val, sub;     /* scratch: the Event, its Summary.Value, a nested message */
    double   limits[LOOM_SUMMARY_BUCKETS];
    double   counts[LOOM_SUMMARY_BUCKETS];
    /* a float's sign, exponent and top 4 mantissa bits (a cell 1/16 of an
     * octave wide, narrower than a bucket's factor 1.1) -> the bucket of the
     * cell's lowest value; from there the first limit above the value is at
     * most a step or two on */
    int16_t  cell[2][4096];
};

/* ---- protobuf wire format (§1.6) ---------------------------------------- */

static void pb_double(loom_buf *b, int field, double v)
{
    uint64_t u;
    memcpy(&u, &v, 8);
    uint8_t le[8];
    for (int i = 0; i < 8; i++) le[i] = (uint8_t)(u >> (8 * i));
    pb_key(b, field, WT_I64);
    loom_buf_put(b, le, 8);
}

static void pb_float(loom_buf *b, int field, float v)
{
    uint32_t u;
    memcpy(&u, &v, 4);
    uint8_t le[4] = {(uint8_t)u, (uint8_t)(u >> 8), (uint8_t)(u >> 16), (uint8_t)(u >> 24)};
    pb_key(b, field, WT_I32);
    loom_buf_put(b, le, 4);
}

/* packed repeated double */
static void pb_packed_doubles(loom_buf *b, int field, const double *v, int n)
{
    pb_key(b, field, WT_LEN);
    pb_varint(b, (uint64_t)n * 8);
    for (int i = 0; i < n; i++) {
        uint64_t u;
        memcpy(&u, &v[i], 8);
        uint8_t le[8];
        for (int k = 0; k < 8; k++) le[k] = (uint8_t)(u >> (8 * k));
        loom_buf_put(b, le, 8);
    }
}

/* ---- records ------------------------------------------------------------- */

static void put_le32(loom_buf *b, uint32_t v)
{
    uint8_t le[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    loom_buf_put(b, le, 4);
}

static void frame(loom_buf *out, const loom_buf *payload)
{
    uint8_t len[8];
    for (int i = 0; i < 8; i++) len[i] = (uint8_t)((uint64_t)payload->len >> (8 * i));
    loom_buf_put(out, len, 8);
    put_le32(out, loom_crc32c_mask(loom_crc32c(len, 8)));
    loom_buf_put(out, payload->data, payload->len);
    put_le32(out, loom_crc32c_mask(loom_crc32c(payload->data, payload->len)));
}

/* Event header: wall_time = 1 (double), step = 2 (int64, omitted when 0). */
static void event_begin(loom_summary *s, int64_t step)
{
    s->ev.len = 0;
    pb_double(&s->ev, 1, loom_wall_time());
    if (step) {
        pb_key(&s->ev, 2, WT_VARINT);
        pb_varint(&s->ev, (uint64_t)step);
    }
}

/* Event.summary = 5 holding one Summary.value = 1 (s->val), then framed. */
static int event_end_value(loom_summary *s, loom_err *err)
{
    s->sub.len = 0;
    pb_bytes(&s->sub, 1, s->val.data, s->val.len);  /* Summary{ value } */
    pb_bytes(&s->ev, 5, s->sub.data, s->sub.len);   /* Event{ summary } */
    frame(&s->pending, &s->ev);
    if (s->ev.failed || s->val.failed || s->sub.failed || s->pending.failed)
        return loom_err_set(err, LOOM_ENOMEM, s->path, "out of memory encoding a summary");
    return LOOM_OK;
}

int loom_summary_default_buckets(double *out)
{
    /* positive limits 1e-12 * 1.1^k below 1e20, then DBL_MAX; the negatives
     * mirror them; 0 in the middle (TF's InitDefaultBuckets) */
    double pos[LOOM_SUMMARY_BUCKETS];
    int n = 0;
    for (double v = 1e-12; v < 1e20; v *= 1.1) pos[n++] = v;
    pos[n++] = DBL_MAX;
    if (out) {
        for (int i = 0; i < n; i++) out[i] = -pos[n - 1 - i];
        out[n] = 0.0;
        for (int i = 0; i < n; i++) out[n + 1 + i] = pos[i];
    }
    return 2 * n + 1;
}

static void build_cells(loom_summary *s);

/* ---- the API ------------------------------------------------------------- */

int loom_summary_open(loom_summary **out, const char *dir, int64_t resume_step, loom_err *err)
{
    *out = NULL;
    if (loom_mkdirs(dir, err) != LOOM_OK)
        return loom_err_hint(err, "TensorBoard summaries go to the model directory and its eval/; make %s writable, "
                                  "or set run.summary_steps = 0 to write none", dir);
    loom_summary *s = loom_calloc(1, sizeof *s);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, dir, "allocating a summary writer");
    s->fd = -1;
    loom_buf_init(&s->pending);
    loom_buf_init(&s->ev);
    loom_buf_init(&s->val);
    loom_buf_init(&s->sub);
    int nb = loom_summary_default_buckets(s->limits);
    LOOM_ASSERT(nb == LOOM_SUMMARY_BUCKETS);
    build_cells(s);
    char host[256];
    if (gethostname(host, sizeof host) != 0 || !host[0]) snprintf(host, sizeof host, "localhost");
    host[sizeof host - 1] = 0;
    long secs = (long)loom_wall_time();
    /* TensorBoard's writer: <secs, 10 digits>.<host>.<pid>.<per-process n>; the
     * n that is free here (O_EXCL), so two writers never share a file */
    for (int n = 0; n < 1000 && s->fd < 0; n++) {
        int w = snprintf(s->path, sizeof s->path, "%s/events.out.tfevents.%010ld.%s.%ld.%d", dir, secs, host,
                         (long)getpid(), n);
        if (w < 0 || (size_t)w >= sizeof s->path) {
            loom_summary_close(s, NULL);
            return loom_err_set(err, LOOM_EIO, dir, "the event file's path is longer than %d bytes", LOOM_PATH_MAX - 1);
        }
        s->fd = open(s->path, O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0644);
        if (s->fd < 0 && errno != EEXIST) {
            int e = errno;
            loom_summary_close(s, NULL);
            loom_err_set(err, LOOM_EIO, dir, "cannot create the event file %s: %s", s->path, strerror(e));
            return loom_err_hint(err, "make the directory writable, or set run.summary_steps = 0 to write no "
                                      "TensorBoard summaries");
        }
    }
    if (s->fd < 0) {
        loom_summary_close(s, NULL);
        return loom_err_set(err, LOOM_EIO, dir, "cannot create an event file: 1000 names taken");
    }
    /* Event{wall_time, file_version = 3 "brain.Event:2"}, flushed at once as TF does */
    event_begin(s, 0);
    pb_str(&s->ev, 3, "brain.Event:2");
    frame(&s->pending, &s->ev);
    if (resume_step >= 0) {
        /* Event{step, session_log = 7 {status = 1 START}}. TensorBoard's
         * Python loader drops every point at or after a START's step; the
         * points at the checkpoint's own step were written before that
         * checkpoint was committed, so they stay: START at resume_step + 1 */
        event_begin(s, resume_step + 1);
        const uint8_t start[] = {0x08, 0x01};
        pb_bytes(&s->ev, 7, start, sizeof start);
        frame(&s->pending, &s->ev);
    }
    int rc = loom_summary_flush(s, err);
    if (rc) {
        unlink(s->path);
        loom_summary_close(s, NULL);
        return rc;
    }
    *out = s;
    return LOOM_OK;
}

const char *loom_summary_path(const loom_summary *s) { return s->path; }

int loom_summary_scalar(loom_summary *s, const char *tag, int64_t step, double value, loom_err *err)
{
    event_begin(s, step);
    s->val.len = 0;
    pb_str(&s->val, 1, tag);
    pb_float(&s->val, 2, (float)value); /* simple_value */
    return event_end_value(s, err);
}

/* The first limit above x (TF's upper_bound, clamped to the last bucket).
 * The limits are 1e-12 * 1.1^k, so a logarithm lands within a bucket or two
 * of it (the table was built by repeated multiplication, which rounds
 * differently), and the walk settles it exactly: several times faster than a
 * binary search over 1551 limits. */
static int bucket_of(const double *lim, double x)
{
    const int zero = LOOM_SUMMARY_BUCKETS / 2; /* lim[zero] = 0 */
    double a = fabs(x);
    int k = a < 1e-12 ? -1 : a >= 1e20 ? zero - 1 : (int)(log(a * 1e12) * 10.492058687257062); /* 1 / ln 1.1 */
    int i = x >= 0 ? zero + 1 + k : zero - 1 - k;
    if (i < 0) i = 0;
    if (i > LOOM_SUMMARY_BUCKETS - 1) i = LOOM_SUMMARY_BUCKETS - 1;
    while (i > 0 && lim[i - 1] > x) i--;
    while (i < LOOM_SUMMARY_BUCKETS - 1 && lim[i] <= x) i++; /* DBL_MAX itself counts in the last (TF clamps too) */
    return i;
}

static void build_cells(loom_summary *s)
{
    for (uint32_t key = 0; key < 4096; key++) {
        if ((key >> 4) == 0xff) { /* inf and NaN: never looked up */
            s->cell[0][key] = s->cell[1][key] = LOOM_SUMMARY_BUCKETS - 1;
            continue;
        }
        uint32_t lo = key << 19, hi = lo | 0x7ffffu;
        float flo, fhi;
        memcpy(&flo, &lo, 4);
        memcpy(&fhi, &hi, 4);
        s->cell[0][key] = (int16_t)bucket_of(s->limits, flo);
        s->cell[1][key] = (int16_t)bucket_of(s->limits, -(double)fhi);
    }
}

int loom_summary_histogram(loom_summary *s, const char *tag, int64_t step, const float *v, int64_t n, loom_err *err)
{
    /* TF's Histogram: min starts at DBL_MAX, max at -DBL_MAX; value x counts
     * in the first bucket whose limit is above it */
    double mn = DBL_MAX, mx = -DBL_MAX, num = 0, sum = 0, sum2 = 0;
    memset(s->counts, 0, sizeof s->counts);
    for (int64_t i = 0; i < n; i++) {
        double x = v[i];
        if (!isfinite(x)) continue;
        uint32_t bits;
        memcpy(&bits, &v[i], 4);
        int b = s->cell[bits >> 31][(bits >> 19) & 0xfff];
        while (b < LOOM_SUMMARY_BUCKETS - 1 && s->limits[b] <= x) b++; /* exact: cells start at or below */
        s->counts[b] += 1;
        if (x < mn) mn = x;
        if (x > mx) mx = x;
        num += 1;
        sum += x;
        sum2 += x * x;
    }
    /* HistogramProto: min 1, max 2, num 3, sum 4, sum_squares 5, bucket_limit 6, bucket 7 */
    s->sub.len = 0;
    pb_double(&s->sub, 1, mn);
    pb_double(&s->sub, 2, mx);
    pb_double(&s->sub, 3, num);
    pb_double(&s->sub, 4, sum);
    pb_double(&s->sub, 5, sum2);
    /* runs of empty buckets collapse into one, whose limit is the run's last
     * (EncodeToProto without preserve_zero_buckets) */
    double lim[LOOM_SUMMARY_BUCKETS], cnt[LOOM_SUMMARY_BUCKETS];
    int k = 0;
    for (int i = 0; i < LOOM_SUMMARY_BUCKETS;) {
        double end = s->limits[i], c = s->counts[i];
        i++;
        if (c <= 0)
            while (i < LOOM_SUMMARY_BUCKETS && s->counts[i] <= 0) end = s->limits[i], c = s->counts[i], i++;
        lim[k] = end;
        cnt[k++] = c;
    }
    pb_packed_doubles(&s->sub, 6, lim, k);
    pb_packed_doubles(&s->sub, 7, cnt, k);
    event_begin(s, step);
    s->val.len = 0;
    pb_str(&s->val, 1, tag);
    pb_bytes(&s->val, 5, s->sub.data, s->sub.len); /* Value.histo */
    return event_end_value(s, err);
}

int loom_summary_text(loom_summary *s, const char *tag, int64_t step, const char *text, size_t len, loom_err *err)
{
    event_begin(s, step);
    s->val.len = 0;
    pb_str(&s->val, 1, tag);
    /* SummaryMetadata{plugin_data = 1 {plugin_name = 1 "text"}} (content empty: TextPluginData version 0) */
    s->sub.len = 0;
    const uint8_t pd[] = {0x0a, 0x04, 't', 'e', 'x', 't'};
    pb_bytes(&s->sub, 1, pd, sizeof pd);
    pb_bytes(&s->val, 9, s->sub.data, s->sub.len);
    /* TensorProto{dtype = 1 DT_STRING (7), tensor_shape = 2 {} (rank 0), string_val = 8} */
    s->sub.len = 0;
    pb_key(&s->sub, 1, WT_VARINT);
    pb_varint(&s->sub, 7);
    pb_bytes(&s->sub, 2, "", 0);
    pb_bytes(&s->sub, 8, text, len);
    pb_bytes(&s->val, 8, s->sub.data, s->sub.len);
    return event_end_value(s, err);
}

int loom_summary_flush(loom_summary *s, loom_err *err)
{
    size_t off = 0;
    while (off < s->pending.len) {
        ssize_t w = write(s->fd, s->pending.data + off, s->pending.len - off);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            int e = w < 0 ? errno : EIO;
            s->pending.len = 0; /* a partial record is not repeated: the reader stops at it */
            return loom_err_set(err, LOOM_EIO, s->path, "write failed: %s", strerror(e));
        }
        off += (size_t)w;
    }
    s->pending.len = 0;
    return LOOM_OK;
}

int loom_summary_close(loom_summary *s, loom_err *err)
{
    if (!s) return LOOM_OK;
    int rc = LOOM_OK;
    if (s->fd >= 0) {
        loom_err tmp;
        rc = loom_summary_flush(s, err ? err : &tmp);
        if (close(s->fd) != 0 && !rc && err) rc = loom_err_set(err, LOOM_EIO, s->path, "close failed: %s", strerror(errno));
    }
    loom_buf_fini(&s->pending);
    loom_buf_fini(&s->ev);
    loom_buf_fini(&s->val);
    loom_buf_fini(&s->sub);
    loom_free(s);
    return rc;
}
