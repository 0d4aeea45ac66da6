/* test_summary.c - the TensorBoard event writer (train/summary.c): the bytes
 * of the version and scalar events against tf_semantics §2.5's worked
 * vectors, every record's CRCs checked by an independent reader
 * (fixtures/events_read.h) and by data/'s strict TFRecord reader, histograms
 * (TF's default buckets, statistics, empty runs merged), text summaries as
 * TF 2 writes them, SessionLog START on resume, file naming, and an
 * unwritable directory. */
#include "harness.h"
#include "test_util.h"
#include "fixtures/events_read.h"
#include "data/format/records.h"
#include "train/summary_internal.h"

#include <dirent.h>
#include <float.h>
#include <sys/stat.h>
#include <unistd.h>

static loom_err err;

/* the one event file in dir */
static int event_file(const char *dir, char out[1024])
{
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)))
        if (strstr(e->d_name, "tfevents")) snprintf(out, 1024, "%s/%s", dir, e->d_name), n++;
    if (d) closedir(d);
    return n;
}

static uint8_t *record(const uint8_t *data, size_t size, int index, size_t *len)
{
    size_t off = 0;
    for (int i = 0; off + 12 <= size; i++) {
        uint64_t l = ev_le64(data + off);
        if (i == index) { *len = (size_t)l; return (uint8_t *)data + off + 12; }
        off += 16 + (size_t)l;
    }
    return NULL;
}

static void test_name_and_version_record(void)
{
    const char *dir = tpath("a");
    loom_summary *s;
    CHECK(loom_summary_open(&s, dir, -1, &err) == LOOM_OK);
    char want[300], host[256] = "";
    gethostname(host, sizeof host);
    snprintf(want, sizeof want, ".%s.%ld.0", host, (long)getpid());
    char p[1024];
    snprintf(p, sizeof p, "%s", loom_summary_path(s));
    const char *base = strrchr(p, '/') + 1;
    CHECK(!strncmp(base, "events.out.tfevents.", 20));
    CHECK(strspn(base + 20, "0123456789") == 10); /* seconds, 10 digits */
    CHECK_CONTAINS(base + 30, want);
    CHECK(strlen(base + 30) == strlen(want));
    /* a second writer in the same directory and second takes the next n */
    loom_summary *s2;
    CHECK(loom_summary_open(&s2, dir, -1, &err) == LOOM_OK);
    CHECK(strcmp(p, loom_summary_path(s2)) != 0);
    char f[1024];
    CHECK(event_file(dir, f) == 2);
    CHECK(loom_summary_close(s2, &err) == LOOM_OK);
    CHECK(loom_summary_scalar(s, "loss", 1, 0.5, &err) == LOOM_OK);
    /* the version record is on disk before any flush (TF flushes it at once) */
    size_t size;
    uint8_t *data = slurp(p, &size);
    CHECK(data && size == 24 + 16);
    size_t len;
    uint8_t *pl = record(data, size, 0, &len);
    static const uint8_t tail[] = {0x1a, 0x0d, 'b', 'r', 'a', 'i', 'n', '.', 'E', 'v', 'e', 'n', 't', ':', '2'};
    CHECK(pl && len == 24 && pl[0] == 0x09 && !memcmp(pl + 9, tail, sizeof tail));
    double wt;
    memcpy(&wt, pl + 1, 8);
    CHECK(fabs(wt - loom_wall_time()) < 60);
    free(data);
    CHECK(loom_summary_close(s, &err) == LOOM_OK);
    data = slurp(p, &size);
    pl = record(data, size, 1, &len);
    /* §2.5: Event{wall_time, step=1, summary{value{tag:"loss", simple_value:0.5}}} after the 9 bytes of wall_time */
    static const uint8_t scalar[] = {0x10, 0x01, 0x2a, 0x0d, 0x0a, 0x0b, 0x0a, 0x04, 'l', 'o', 's', 's', 0x15, 0, 0, 0, 0x3f};
    CHECK(pl && len == 9 + sizeof scalar && !memcmp(pl + 9, scalar, sizeof scalar));
    free(data);
}

/* the worked record of §2.5, framed by the writer's code path: only the
 * wall time differs, so check the length header's CRC bytes exactly */
static void test_length_crc_vector(void)
{
    const char *dir = tpath("v");
    loom_summary *s;
    CHECK(loom_summary_open(&s, dir, -1, &err) == LOOM_OK);
    char p[1024];
    snprintf(p, sizeof p, "%s", loom_summary_path(s));
    loom_summary_close(s, &err);
    size_t size;
    uint8_t *data = slurp(p, &size);
    static const uint8_t hdr[] = {0x18, 0, 0, 0, 0, 0, 0, 0, 0xa3, 0x7f, 0x4b, 0x22};
    CHECK(data && size == 40 && !memcmp(data, hdr, sizeof hdr));
    free(data);
}

typedef struct seen {
    int     n, scalars, hist, text, start;
    int64_t start_step;
    ev_value last_hist;
    ev_value text_v;
    float    vals[8];
} seen;

static int collect(const ev_event *e, void *arg)
{
    seen *s = arg;
    s->n++;
    if (e->session_status == 1) s->start++, s->start_step = e->step;
    if (!e->has_summary) return 0;
    if (e->v.kind == 1 && s->scalars < 8) s->vals[s->scalars++] = e->v.simple;
    if (e->v.kind == 2) s->hist++, s->last_hist = e->v;
    if (e->v.kind == 3) s->text++, s->text_v = e->v;
    return 0;
}

static void test_every_crc_and_values(void)
{
    const char *dir = tpath("b");
    loom_summary *s;
    CHECK(loom_summary_open(&s, dir, 40, &err) == LOOM_OK); /* resumed at step 40 */
    for (int i = 0; i < 5; i++) CHECK(loom_summary_scalar(s, "loss", 41 + i, 1.0 / (i + 1), &err) == LOOM_OK);
    CHECK(loom_summary_text(s, "config", 40, "run: { epochs = 2; };", 21, &err) == LOOM_OK);
    CHECK(loom_summary_flush(s, &err) == LOOM_OK);
    char p[1024];
    snprintf(p, sizeof p, "%s", loom_summary_path(s));
    CHECK(loom_summary_close(s, &err) == LOOM_OK);
    seen sn = {0};
    char why[256] = "";
    long n = ev_read_file(p, collect, &sn, why, sizeof why);
    CHECK_MSG(n == 8, "%ld records: %s", n, why);
    CHECK(sn.start == 1 && sn.start_step == 41); /* points at the checkpoint's step stay */
    CHECK(sn.scalars == 5);
    for (int i = 0; i < 5; i++) CHECK(sn.vals[i] == (float)(1.0 / (i + 1)));
    CHECK(sn.text == 1 && sn.text_v.dtype == 7 && sn.text_v.rank == 0 && !strcmp(sn.text_v.plugin, "text"));
    CHECK(!strcmp(sn.text_v.text, "run: { epochs = 2; };"));
    /* data/'s strict reader agrees on every CRC */
    loom_tfrecord *r;
    CHECK(loom_tfrecord_open(&r, p, LOOM_COMP_NONE, LOOM_CORRUPT_ERROR, &err) == LOOM_OK);
    const uint8_t *d;
    size_t len;
    int k = 0;
    while (loom_tfrecord_next(r, &d, &len, &err) == LOOM_OK) k++;
    CHECK(err.code == LOOM_OK || k == 8);
    CHECK(k == 8);
    loom_tfrecord_close(r);
    /* a flipped payload byte is caught */
    size_t size;
    uint8_t *data = slurp(p, &size);
    data[size - 6] ^= 1;
    FILE *f = fopen(p, "wb");
    fwrite(data, 1, size, f);
    fclose(f);
    free(data);
    CHECK(ev_read_file(p, NULL, NULL, why, sizeof why) < 0);
    CHECK_CONTAINS(why, "payload CRC mismatch");
}

static void test_default_buckets(void)
{
    double b[LOOM_SUMMARY_BUCKETS];
    CHECK(loom_summary_default_buckets(NULL) == LOOM_SUMMARY_BUCKETS);
    CHECK(loom_summary_default_buckets(b) == LOOM_SUMMARY_BUCKETS);
    int mid = LOOM_SUMMARY_BUCKETS / 2;
    CHECK(b[0] == -DBL_MAX && b[LOOM_SUMMARY_BUCKETS - 1] == DBL_MAX && b[mid] == 0.0);
    CHECK(b[mid + 1] == 1e-12 && b[mid - 1] == -1e-12);
    CHECK_NEAR(b[mid + 2], 1.1e-12, 1e-24);
    CHECK(b[LOOM_SUMMARY_BUCKETS - 2] < 1e20 && b[LOOM_SUMMARY_BUCKETS - 2] * 1.1 >= 1e20);
    for (int i = 1; i < LOOM_SUMMARY_BUCKETS; i++) CHECK(b[i] > b[i - 1]);
}

static void test_histogram(void)
{
    const char *dir = tpath("h");
    loom_summary *s;
    CHECK(loom_summary_open(&s, dir, -1, &err) == LOOM_OK);
    float v[] = {-2.0f, -0.5f, 0.0f, 0.0f, 0.25f, 0.25f, 3.0f, NAN};
    CHECK(loom_summary_histogram(s, "dense_0/kernel", 7, v, 8, &err) == LOOM_OK);
    char p[1024];
    snprintf(p, sizeof p, "%s", loom_summary_path(s));
    CHECK(loom_summary_close(s, &err) == LOOM_OK);
    static seen sn;
    memset(&sn, 0, sizeof sn);
    char why[256] = "";
    CHECK_MSG(ev_read_file(p, collect, &sn, why, sizeof why) == 2, "%s", why);
    const ev_value *h = &sn.last_hist;
    CHECK(sn.hist == 1 && !strcmp(h->tag, "dense_0/kernel"));
    CHECK(h->hmin == -2.0 && h->hmax == 3.0 && h->hnum == 7);
    CHECK_NEAR(h->hsum, 1.0, 1e-12);
    CHECK_NEAR(h->hsum2, 4 + 0.25 + 0.0625 * 2 + 9, 1e-12);
    /* counts add up; each value lies in the bucket whose limit is the first above it */
    double total = 0, b[LOOM_SUMMARY_BUCKETS];
    loom_summary_default_buckets(b);
    for (int i = 0; i < h->nb; i++) total += h->bucket[i];
    CHECK(total == 7);
    CHECK(h->limit[h->nb - 1] == DBL_MAX);
    for (int i = 1; i < h->nb; i++) CHECK(h->limit[i] > h->limit[i - 1]);
    /* non-empty buckets alternate with single merged empty runs: no two empty in a row */
    for (int i = 1; i < h->nb; i++) CHECK(h->bucket[i] > 0 || h->bucket[i - 1] > 0);
    int found0 = 0;
    for (int i = 0; i < h->nb; i++)
        if (h->bucket[i] == 2 && h->limit[i] == 1e-12) found0 = 1; /* 0 counts below 1e-12 */
    CHECK(found0);
}

/* values over every magnitude, both signs, and on the limits themselves:
 * each non-empty bucket holds what a linear scan of TF's limits puts there */
static void test_histogram_buckets_exact(void)
{
    static double lim[LOOM_SUMMARY_BUCKETS], ref[LOOM_SUMMARY_BUCKETS];
    loom_summary_default_buckets(lim);
    memset(ref, 0, sizeof ref);
    enum { N = 6000 };
    static float v[N];
    uint64_t x = 88172645463325252ull;
    for (int i = 0; i < N; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        double mag = pow(10.0, (double)(x % 6400) / 100.0 - 32.0); /* 1e-32 .. 1e32 */
        v[i] = (float)((x >> 20) & 1 ? mag : -mag);
        if (i % 10 == 0) v[i] = (float)lim[(x >> 24) % LOOM_SUMMARY_BUCKETS]; /* exactly on a limit (as a float) */
        if (i % 97 == 0) v[i] = 0.0f;
        if (!isfinite(v[i])) v[i] = 1.0f;
        int b = 0;
        while (b < LOOM_SUMMARY_BUCKETS - 1 && lim[b] <= (double)v[i]) b++;
        ref[b] += 1;
    }
    const char *dir = tpath("hx");
    loom_summary *s;
    CHECK(loom_summary_open(&s, dir, -1, &err) == LOOM_OK);
    CHECK(loom_summary_histogram(s, "w", 1, v, N, &err) == LOOM_OK);
    char p[1024];
    snprintf(p, sizeof p, "%s", loom_summary_path(s));
    CHECK(loom_summary_close(s, &err) == LOOM_OK);
    static seen sn;
    memset(&sn, 0, sizeof sn);
    char why[256] = "";
    CHECK_MSG(ev_read_file(p, collect, &sn, why, sizeof why) == 2, "%s", why);
    const ev_value *h = &sn.last_hist;
    int bad = 0, nonempty = 0;
    for (int i = 0, j = 0; i < h->nb; i++) {
        while (j < LOOM_SUMMARY_BUCKETS && lim[j] != h->limit[i]) j++;
        if (j == LOOM_SUMMARY_BUCKETS) { bad++; break; }
        if (h->bucket[i] > 0) nonempty++, bad += h->bucket[i] != ref[j];
    }
    int ref_nonempty = 0;
    for (int j = 0; j < LOOM_SUMMARY_BUCKETS; j++) ref_nonempty += ref[j] > 0;
    CHECK_MSG(bad == 0 && nonempty == ref_nonempty, "%d buckets differ; %d non-empty, want %d", bad, nonempty, ref_nonempty);
    CHECK(h->hnum == N);
}

static void test_unwritable_dir(void)
{
    const char *f = tpath("file");
    FILE *fp = fopen(f, "w");
    fputs("x", fp);
    fclose(fp);
    char dir[600];
    snprintf(dir, sizeof dir, "%s/eval", f);
    loom_summary *s = (loom_summary *)1;
    CHECK(loom_summary_open(&s, dir, -1, &err) != LOOM_OK);
    CHECK(s == NULL);
    CHECK_CONTAINS(err.where, "file");
    CHECK_CONTAINS(err.hint, "summary_steps = 0");
    CHECK(loom_summary_close(NULL, &err) == LOOM_OK);
}

static const loom_test tests[] = {
    {"event file name and brain.Event:2 first record", test_name_and_version_record},
    {"length CRC matches tf_semantics' worked record", test_length_crc_vector},
    {"every CRC checked, scalars, text, SessionLog START", test_every_crc_and_values},
    {"TF's default histogram buckets", test_default_buckets},
    {"histogram statistics and buckets", test_histogram},
    {"histogram buckets equal a linear scan of TF's limits", test_histogram_buckets_exact},
    {"unwritable summary directory", test_unwritable_dir},
    {0},
};

int main(void) { return run_in_tmpdir("loom_summary", tests); }
