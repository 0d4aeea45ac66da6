/* test_core.c - errors, buffers, RNG, CRC-32C, the CPUID probe, pool, files. */
#include "core/core.h"
#include "harness.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <sched.h>
#include <stdatomic.h>
#include <unistd.h>
#include <zlib.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

static void test_crc32c(void)
{
    uint8_t zeros[32] = {0};
    CHECK(loom_crc32c(zeros, 32) == 0x8A9136AAu);
    CHECK(loom_crc32c("123456789", 9) == 0xE3069283u);
    /* extending in pieces equals one pass, across the 8-byte fast path */
    const char *s = "The quick brown fox jumps over the lazy dog";
    uint32_t whole = loom_crc32c(s, strlen(s));
    uint32_t part = loom_crc32c_extend(loom_crc32c(s, 5), s + 5, strlen(s) - 5);
    CHECK(whole == part);
    CHECK(loom_crc32c_mask(0) == 0xa282ead8u);
}

/* CRC-32C a bit at a time: the definition, to hold the fast paths to */
static uint32_t crc32c_bitwise(uint32_t crc, const uint8_t *p, size_t n)
{
    uint32_t c = ~crc;
    while (n--) {
        c ^= *p++;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    }
    return ~c;
}

/* Every length from 0 to past four rounds of the three-chain path (768 bytes a
 * round), at every alignment mod 8, from a non-zero starting CRC, equals the
 * definition; and a 1 MiB buffer split anywhere extends to the whole. */
static void test_crc32c_lengths(void)
{
    enum { MAX = 3300 };
    static uint8_t buf[MAX + 8];
    uint64_t x = 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < sizeof buf; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        buf[i] = (uint8_t)x;
    }
    int bad = 0;
    for (size_t off = 0; off < 8; off++)
        for (size_t n = 0; n <= MAX; n += off == 0 ? 1 : 97) {
            uint32_t seed = (uint32_t)(n * 2654435761u + off);
            if (loom_crc32c_extend(seed, buf + off, n) != crc32c_bitwise(seed, buf + off, n)) bad++;
        }
    CHECK_MSG(bad == 0, "%d lengths/alignments differ from the bitwise CRC-32C", bad);
    size_t big = (size_t)1 << 20;
    uint8_t *b = malloc(big);
    CHECK(b != NULL);
    if (!b) return;
    for (size_t i = 0; i < big; i++) b[i] = (uint8_t)(i * 131 + (i >> 9));
    uint32_t whole = loom_crc32c(b, big);
    CHECK(whole == crc32c_bitwise(0, b, big));
    size_t cuts[] = {1, 767, 768, 769, 4096, big / 2 + 3, big - 1};
    for (size_t k = 0; k < sizeof cuts / sizeof cuts[0]; k++)
        CHECK(loom_crc32c_extend(loom_crc32c(b, cuts[k]), b + cuts[k], big - cuts[k]) == whole);
    free(b);
}

static void test_philox_known_answer(void)
{
    /* Random123's Philox4x32-10 known answer for key 0, counter 0 */
    uint32_t out[4];
    loom_philox4x32(0, 0, out);
    CHECK(out[0] == 0x6627e8d5u && out[1] == 0xe169c58du && out[2] == 0xbc57ac4cu && out[3] == 0x9b00dbd8u);
}

static void test_rng_streams(void)
{
    loom_rng a, b, c;
    loom_rng_init(&a, 42, 1, 2, 3);
    loom_rng_init(&b, 42, 1, 2, 3);
    loom_rng_init(&c, 42, 1, 2, 4);
    int same = 1, differ = 0;
    for (int i = 0; i < 100; i++) {
        uint32_t x = loom_rng_u32(&a), y = loom_rng_u32(&b), z = loom_rng_u32(&c);
        same &= x == y;
        differ += x != z;
    }
    CHECK(same);
    CHECK(differ > 90);
    /* uniform: mean near 1/2; below: in range and every value hit */
    double sum = 0;
    int hits[7] = {0};
    for (int i = 0; i < 70000; i++) {
        float u = loom_rng_uniform(&a);
        CHECK(u >= 0 && u < 1);
        sum += u;
        uint64_t k = loom_rng_below(&a, 7);
        CHECK(k < 7);
        hits[k]++;
    }
    CHECK_NEAR(sum / 70000, 0.5, 0.01);
    for (int k = 0; k < 7; k++) CHECK_NEAR(hits[k], 10000, 500);
    /* save and restore mid-block continues the same sequence */
    loom_rng_u32(&a);
    loom_buf buf;
    loom_buf_init(&buf);
    loom_rng_save(&a, &buf);
    uint32_t next = loom_rng_u32(&a);
    loom_rng r;
    CHECK(loom_rng_restore(&r, &buf) == 0);
    CHECK(loom_rng_u32(&r) == next);
    loom_buf_fini(&buf);
}

static void test_buf(void)
{
    loom_buf b;
    loom_buf_init(&b);
    loom_buf_put_u32(&b, 0xdeadbeef);
    loom_buf_put_i64(&b, -5);
    loom_buf_put_f64(&b, 3.25);
    loom_buf_put_str(&b, "hello");
    for (int i = 0; i < 1000; i++) loom_buf_put_u32(&b, (uint32_t)i);
    CHECK(!b.failed);
    CHECK(loom_buf_get_u32(&b) == 0xdeadbeef);
    CHECK(loom_buf_get_i64(&b) == -5);
    CHECK(loom_buf_get_f64(&b) == 3.25);
    char s[8];
    CHECK(loom_buf_get_str(&b, s, sizeof s) == 0 && !strcmp(s, "hello"));
    for (int i = 0; i < 1000; i++) CHECK(loom_buf_get_u32(&b) == (uint32_t)i);
    CHECK(!b.failed);
    loom_buf_get_u32(&b); /* past the end */
    CHECK(b.failed);
    loom_buf_fini(&b);
    /* an allocation failure is sticky, never a crash */
    loom_buf_init(&b);
    loom_alloc_fail_after(0);
    loom_buf_put_u32(&b, 1);
    loom_alloc_fail_after(-1);
    CHECK(b.failed);
    loom_buf_fini(&b);
}

/* loom_alloc_zeroed: zeroed and 64-byte aligned, small (the heap) and big
 * (fresh pages), writable to the last byte, and the failure hook. */
static void test_alloc_zeroed(void)
{
    const size_t sizes[] = {1, 100, 4096, ((size_t)1 << 20) - 8, (size_t)1 << 20, ((size_t)3 << 20) + 5};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        size_t n = sizes[k];
        unsigned char *p = loom_alloc_zeroed(n);
        CHECK(p && ((uintptr_t)p & 63) == 0);
        if (!p) continue;
        size_t nz = 0;
        for (size_t i = 0; i < n; i++) nz += p[i] != 0;
        CHECK(nz == 0);
        memset(p, 0xab, n);
        loom_free_zeroed(p);
    }
    loom_free_zeroed(NULL);
    loom_alloc_fail_after(0);
    CHECK(loom_alloc_zeroed((size_t)2 << 20) == NULL);
    loom_alloc_fail_after(-1);
}

static void test_errors(void)
{
    loom_err e = {0};
    CHECK(loom_err_set(&e, LOOM_ECONFIG, "a.cfg:3", "bad value %d", 7) == LOOM_ECONFIG);
    loom_err_hint(&e, "use %s", "8");
    loom_err_prefix(&e, "run.epochs");
    char buf[1024];
    loom_err_format(&e, buf, sizeof buf);
    CHECK(!strcmp(buf, "a.cfg:3: run.epochs: bad value 7\n  hint: use 8\n"));
    CHECK(!strcmp(loom_err_name(LOOM_EIO), "IO"));
    CHECK(loom_edit_distance("epocs", "epochs") == 1);
    CHECK(loom_edit_distance("rleu", "relu") == 1);
    CHECK(loom_edit_distance("abc", "abc") == 0);
}

static atomic_int pool_hits[1000];
static void pool_fn(void *arg, int i)
{
    (void)arg;
    atomic_fetch_add(&pool_hits[i], 1);
}

static void test_pool(void)
{
    for (int threads = 1; threads <= 4; threads++) {
        loom_pool *p;
        loom_err e;
        CHECK(loom_pool_new(&p, threads, &e) == LOOM_OK);
        CHECK(loom_pool_size(p) == threads);
        for (int round = 0; round < 20; round++) {
            for (int i = 0; i < 1000; i++) atomic_store(&pool_hits[i], 0);
            loom_pool_run(p, 1000, pool_fn, NULL);
            int ok = 1;
            for (int i = 0; i < 1000; i++) ok &= atomic_load(&pool_hits[i]) == 1;
            CHECK(ok);
        }
        loom_pool_free(p);
    }
    CHECK(loom_num_cores() >= 1);
}

/* loom_pool_set_spin: back-to-back jobs reach the worker without its
 * sleeping on the condition variable (before it, every job put it to sleep
 * and woke it with a futex call), the results stay right, and an idle pool
 * still goes to sleep once the bounded wait is over. The window is 50 ms
 * so that a worker descheduled on a loaded machine still finds the next
 * job; the counts are structure, not timing. */
static atomic_int spin_sum;
static void spin_fn(void *arg, int i)
{
    (void)arg;
    atomic_fetch_add(&spin_sum, i + 1);
}

static void test_pool_spin(void)
{
    loom_pool *p;
    loom_err e;
    CHECK(loom_pool_new(&p, 2, &e) == LOOM_OK);
    /* the two threads on two cores: sharing one, a spinning thread waits
     * for one that cannot run, and the window rightly collapses */
    const int cores[2] = {0, 1};
    bool two = loom_num_cores() >= 2 && loom_pool_pin(p, cores, &e) == LOOM_OK;
    const int jobs = 1000;
    int64_t slept = 0, bad = 0;
    /* the window adapts to the machine's load: up to 3 attempts, each from the full window */
    for (int attempt = 0; attempt < 3; attempt++) {
        loom_pool_set_spin(p, 50000);
        int64_t s0 = loom_pool_sleeps(p);
        for (int k = 0; k < jobs; k++) {
            int n = 2 + k % 3;
            atomic_store(&spin_sum, 0);
            loom_pool_run(p, n, spin_fn, NULL);
            bad += atomic_load(&spin_sum) != n * (n + 1) / 2;
        }
        slept = loom_pool_sleeps(p) - s0;
        printf("# attempt %d: %lld condition-variable waits in %d back-to-back jobs (spinning)\n", attempt + 1,
               (long long)slept, jobs);
        if (slept < jobs / 10) break;
    }
    CHECK_MSG(bad == 0, "%lld jobs lost or repeated an item", (long long)bad);
    if (two)
        CHECK_MSG(slept < jobs / 10, "%lld condition-variable waits in %d back-to-back jobs (spinning: expected few)",
                  (long long)slept, jobs);
    else
        printf("# one core: spinning cannot help, the wait count is not checked\n");
    /* bounded: a pool left idle longer than its window sleeps (the count read
     * before the job: the worker may go to sleep before run returns) */
    loom_pool_set_spin(p, 1000);
    int64_t s1 = loom_pool_sleeps(p);
    loom_pool_run(p, 2, spin_fn, NULL);
    for (int k = 0; k < 200 && loom_pool_sleeps(p) == s1; k++) usleep(5000);
    CHECK_MSG(loom_pool_sleeps(p) > s1, "the worker still spun 1 s after a job with a 1 ms window");
    loom_pool_free(p); /* joins a sleeping worker */
    /* a pool of one (no workers) runs inline, spin or not */
    CHECK(loom_pool_new(&p, 1, &e) == LOOM_OK);
    loom_pool_set_spin(p, 100);
    atomic_store(&spin_sum, 0);
    loom_pool_run(p, 4, spin_fn, NULL);
    CHECK(atomic_load(&spin_sum) == 10 && loom_pool_sleeps(p) == 0);
    loom_pool_free(p);
}

/* Each item waits until every thread holds one, then records the CPU set it
 * may run on: with n items on a pool of n, every thread runs exactly one. */
typedef struct pin_probe {
    pthread_barrier_t bar;
    cpu_set_t         seen[2];
} pin_probe;

static void pin_fn(void *arg, int i)
{
    pin_probe *pp = arg;
    pthread_barrier_wait(&pp->bar);
    pthread_getaffinity_np(pthread_self(), sizeof pp->seen[i], &pp->seen[i]);
}

/* The k-th CPU this process may run on. */
static int nth_cpu(const cpu_set_t *set, int k)
{
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, set) && k-- == 0) return c;
    return -1;
}

static void test_pool_pin(void)
{
    if (loom_num_cores() < 2) { /* a pool of one runs inline: nothing to pin */
        loom_pool *one;
        loom_err e;
        const int core0 = 0;
        CHECK(loom_pool_new(&one, 1, &e) == LOOM_OK && loom_pool_pin(one, &core0, &e) == LOOM_OK);
        loom_pool_free(one);
        printf("# one core: two threads cannot be pinned apart\n");
        return;
    }
    cpu_set_t before, after, allowed;
    CHECK(sched_getaffinity(0, sizeof allowed, &allowed) == 0);
    pthread_getaffinity_np(pthread_self(), sizeof before, &before);
    loom_pool *p;
    loom_err e;
    CHECK(loom_pool_new(&p, 2, &e) == LOOM_OK);
    const int cores[2] = {1, 0}; /* the caller on the second core, the worker on the first */
    CHECK(loom_pool_pin(p, cores, &e) == LOOM_OK);
    for (int round = 0; round < 3; round++) {
        pin_probe pp;
        pthread_barrier_init(&pp.bar, NULL, 2);
        loom_pool_run(p, 2, pin_fn, &pp);
        pthread_barrier_destroy(&pp.bar);
        int c1 = nth_cpu(&allowed, 1), c0 = nth_cpu(&allowed, 0), ok = 1;
        for (int i = 0; i < 2; i++) ok &= CPU_COUNT(&pp.seen[i]) == 1;
        /* one item ran on each thread: one on the caller's core, one on the worker's */
        ok &= (CPU_ISSET(c1, &pp.seen[0]) && CPU_ISSET(c0, &pp.seen[1])) ||
              (CPU_ISSET(c0, &pp.seen[0]) && CPU_ISSET(c1, &pp.seen[1]));
        CHECK_MSG(ok, "round %d: the two threads were not pinned to CPUs %d and %d", round, c1, c0);
        pthread_getaffinity_np(pthread_self(), sizeof after, &after);
        CHECK_MSG(CPU_EQUAL(&before, &after), "the caller's own CPU set was not restored after the run");
    }
    const int bad[2] = {0, loom_num_cores()};
    CHECK(loom_pool_pin(p, bad, &e) == LOOM_EUSAGE);
    CHECK_CONTAINS(e.msg, "this process may run on");
    loom_pool_free(p);
}

static void test_files(void)
{
    char dir[] = "/tmp/loom_test_core_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char plain[256], gz[256], trunc[256], sub[256];
    snprintf(plain, sizeof plain, "%s/a.bin", dir);
    snprintf(gz, sizeof gz, "%s/a.bin.gz", dir);
    snprintf(trunc, sizeof trunc, "%s/t.gz", dir);
    uint8_t data[5000];
    for (int i = 0; i < 5000; i++) data[i] = (uint8_t)(i * 7);
    loom_err e = {0};
    CHECK(loom_write_file_atomic(plain, data, sizeof data, &e) == LOOM_OK);
    gzFile g = gzopen(gz, "wb");
    gzwrite(g, data, sizeof data);
    gzclose(g);
    uint8_t *out;
    size_t n;
    CHECK(loom_read_file(plain, &out, &n, &e) == LOOM_OK && n == 5000 && !memcmp(out, data, n));
    loom_free(out);
    CHECK(loom_read_file(gz, &out, &n, &e) == LOOM_OK && n == 5000 && !memcmp(out, data, n));
    loom_free(out);
    /* a truncated gzip file is an error naming the file */
    uint8_t *raw;
    size_t rn;
    loom_read_file(plain, &raw, &rn, &e);
    loom_free(raw);
    FILE *f = fopen(gz, "rb");
    uint8_t zbuf[8192];
    size_t zn = fread(zbuf, 1, sizeof zbuf, f);
    fclose(f);
    CHECK(loom_write_file_atomic(trunc, zbuf, zn / 2, &e) == LOOM_OK);
    CHECK(loom_read_file(trunc, &out, &n, &e) == LOOM_EDATA);
    CHECK_CONTAINS(e.where, "t.gz");
    CHECK_CONTAINS(e.msg, "truncated");
    CHECK(loom_read_file("/nonexistent/x", &out, &n, &e) == LOOM_EIO);
    CHECK_CONTAINS(e.msg, "No such file");
    /* mkdirs: nested creation, and a file in the way */
    snprintf(sub, sizeof sub, "%s/x/y/z", dir);
    CHECK(loom_mkdirs(sub, &e) == LOOM_OK);
    snprintf(sub, sizeof sub, "%s/a.bin/sub", dir);
    CHECK(loom_mkdirs(sub, &e) == LOOM_EIO);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    CHECK(system(cmd) == 0);
}

/* A FIFO, a directory or a device given as a file is refused by name at
 * once: opening a FIFO for reading used to wait for a writer forever. */
static void test_open_regular(void)
{
    char dir[] = "/tmp/loom_test_core_XXXXXX", fifo[256], file[256];
    CHECK(mkdtemp(dir) != NULL);
    snprintf(fifo, sizeof fifo, "%s/pipe", dir);
    snprintf(file, sizeof file, "%s/f", dir);
    CHECK(mkfifo(fifo, 0644) == 0);
    loom_err e = {0};
    alarm(20); /* a regression hangs: fail the test instead */
    CHECK(loom_open_regular(fifo, &e) == -1 && e.code == LOOM_EIO);
    CHECK(!strcmp(e.where, fifo));
    CHECK_CONTAINS(e.msg, "is a FIFO (named pipe), not a regular file");
    uint8_t *out = NULL;
    size_t n;
    CHECK(loom_read_file(fifo, &out, &n, &e) == LOOM_EIO && out == NULL);
    CHECK_CONTAINS(e.msg, "FIFO");
    loom_rfile *rf;
    CHECK(loom_rfile_open(&rf, fifo, &e) == LOOM_EIO);
    CHECK(loom_fopen_regular(fifo, &e) == NULL);
    CHECK(loom_open_regular(dir, &e) == -1);
    CHECK_CONTAINS(e.msg, "is a directory");
    CHECK(loom_open_regular("/dev/null", &e) == -1);
    CHECK_CONTAINS(e.msg, "is a character device");
    alarm(0);
    /* a regular file opens blocking (the O_NONBLOCK of the probe is cleared) */
    CHECK(loom_write_file_atomic(file, "abc", 3, &e) == LOOM_OK);
    int fd = loom_open_regular(file, &e);
    CHECK(fd >= 0 && !(fcntl(fd, F_GETFL) & O_NONBLOCK));
    if (fd >= 0) close(fd);
    /* loom_read_file_max: within the bound, and beyond it */
    CHECK(loom_read_file_max(file, &out, &n, 3, &e) == LOOM_OK && n == 3 && !memcmp(out, "abc", 3));
    loom_free(out);
    CHECK(loom_read_file_max(file, &out, &n, 2, &e) == LOOM_EDATA);
    CHECK_CONTAINS(e.msg, "larger than the 2 bytes");
    unlink(fifo);
    unlink(file);
    rmdir(dir);
}

/* Writing a user's path (issue 22): a FIFO, a directory, a device or a link
 * to one is refused with nothing written; a link to a regular file is
 * written through, the link kept; the stream writer commits or leaves nothing. */
static void test_output_target(void)
{
    char dir[] = "/tmp/loom_test_core_XXXXXX", p[8][300];
    CHECK(mkdtemp(dir) != NULL);
    const char *names[] = {"pipe", "sub", "real", "link", "to_pipe", "dangling", "new", "stream"};
    for (int i = 0; i < 8; i++) snprintf(p[i], sizeof p[i], "%s/%s", dir, names[i]);
    CHECK(mkfifo(p[0], 0644) == 0 && mkdir(p[1], 0755) == 0);
    CHECK(symlink("real", p[3]) == 0 && symlink(p[0], p[4]) == 0 && symlink("nothing", p[5]) == 0);
    loom_err e = {0};
    char t[4096];
    alarm(20);
    CHECK(loom_write_file_atomic(p[0], "x", 1, &e) == LOOM_EIO && !strcmp(e.where, p[0]));
    CHECK_CONTAINS(e.msg, "is a FIFO (named pipe), not a regular file: refused, nothing was written");
    CHECK_CONTAINS(e.hint, "name another path");
    struct stat st;
    CHECK(lstat(p[0], &st) == 0 && S_ISFIFO(st.st_mode));
    CHECK(loom_write_file_atomic(p[1], "x", 1, &e) == LOOM_EIO);
    CHECK_CONTAINS(e.msg, "is a directory");
    CHECK(loom_output_target("/dev/null", t, sizeof t, &e) == LOOM_EIO);
    CHECK_CONTAINS(e.msg, "is a character device");
    CHECK(loom_write_file_atomic(p[4], "x", 1, &e) == LOOM_EIO);
    CHECK_CONTAINS(e.msg, "is a symbolic link to");
    CHECK_CONTAINS(e.msg, "which is a FIFO");
    CHECK(loom_write_file_atomic(p[5], "x", 1, &e) == LOOM_EIO);
    CHECK_CONTAINS(e.msg, "symbolic link that does not resolve");
    CHECK(lstat(p[5], &st) == 0 && S_ISLNK(st.st_mode));
    /* absent: the path itself; a link to a regular file: its target, written through */
    CHECK(loom_output_target(p[6], t, sizeof t, &e) == LOOM_OK && !strcmp(t, p[6]));
    CHECK(loom_write_file_atomic(p[2], "old", 3, &e) == LOOM_OK);
    CHECK(loom_write_file_atomic(p[3], "new!", 4, &e) == LOOM_OK);
    CHECK(lstat(p[3], &st) == 0 && S_ISLNK(st.st_mode));
    uint8_t *out = NULL;
    size_t n = 0;
    CHECK(loom_read_file(p[2], &out, &n, &e) == LOOM_OK && n == 4 && !memcmp(out, "new!", 4));
    loom_free(out);
    /* the stream writer: through the link too; abort leaves the target as it was */
    loom_wfile *w = NULL;
    CHECK(loom_wfile_open(&w, p[0], &e) == LOOM_EIO && w == NULL);
    CHECK(loom_wfile_open(&w, p[3], &e) == LOOM_OK && w);
    if (w) fputs("streamed", loom_wfile_stream(w));
    CHECK(w && loom_wfile_commit(w, &e) == LOOM_OK);
    CHECK(loom_read_file(p[2], &out, &n, &e) == LOOM_OK && n == 8 && !memcmp(out, "streamed", 8));
    loom_free(out);
    CHECK(lstat(p[3], &st) == 0 && S_ISLNK(st.st_mode));
    CHECK(loom_wfile_open(&w, p[7], &e) == LOOM_OK && w);
    if (w) fputs("half", loom_wfile_stream(w));
    loom_wfile_abort(w);
    CHECK(access(p[7], F_OK) < 0);
    alarm(0);
    DIR *d = opendir(dir);
    int left = 0;
    for (struct dirent *de; d && (de = readdir(d));) left += strstr(de->d_name, ".tmp.") != NULL;
    if (d) closedir(d);
    CHECK(left == 0);
    for (int i = 0; i < 8; i++) i == 1 ? rmdir(p[i]) : unlink(p[i]);
    rmdir(dir);
}

/* Paths in messages normalised lexically (issue 22: "/a/j6/../j5/ckpt"). */
static void test_path_normalize(void)
{
    static const char *const cases[][2] = {
        {"/a/j6/../j5/ckpt", "/a/j5/ckpt"}, {"/", "/"}, {"//", "/"}, {"/..", "/"}, {"/../a", "/a"}, {"a/..", "."},
        {"a/../..", ".."}, {"../a/../b", "../b"}, {"./a/./b/", "a/b"}, {"a//b///c/", "a/b/c"}, {"", "."},
        {".", "."}, {"..", ".."}, {"/a/b/c/../../d", "/a/d"}, {"a/b/../../../c", "../c"},
        {"/w/configs/../runs/x", "/w/runs/x"}, {"/a/.../b/..x/.x", "/a/.../b/..x/.x"}, {"/a/b/..", "/a"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char b[64];
        snprintf(b, sizeof b, "%s", cases[i][0]);
        CHECK_MSG(!strcmp(loom_path_normalize(b), cases[i][1]), "\"%s\" -> \"%s\", expected \"%s\"", cases[i][0], b,
                  cases[i][1]);
    }
}

/* Temporary files of writers that died are removed; a live writer's stay. */
static void test_stale_tmp(void)
{
    char dir[] = "/tmp/loom_test_core_XXXXXX", p[300];
    CHECK(mkdtemp(dir) != NULL);
    pid_t dead = fork();
    if (dead == 0) _exit(0);
    waitpid(dead, NULL, 0);
    const char *names[] = {"ckpt-5.loom.tmp.%ld", "checkpoint.tmp.%ld", "metrics.jsonl.tmp.%ld", "keep.tmp.%ld",
                           "keep.tmp.x%ld", "ckpt-5.loom"};
    long pids[] = {dead, dead, dead, (long)getpid(), dead, 0};
    loom_err e = {0};
    for (int i = 0; i < 6; i++) {
        char name[64];
        snprintf(name, sizeof name, names[i], pids[i]);
        snprintf(p, sizeof p, "%s/%s", dir, name);
        CHECK(loom_write_file_atomic(p, "x", 1, &e) == LOOM_OK);
    }
    CHECK(loom_remove_stale_tmp(dir) == 3);
    int left = 0;
    for (int i = 0; i < 6; i++) {
        char name[64];
        snprintf(name, sizeof name, names[i], pids[i]);
        snprintf(p, sizeof p, "%s/%s", dir, name);
        left += access(p, F_OK) == 0;
        if (i >= 3) CHECK_MSG(access(p, F_OK) == 0, "%s was removed", name);
        unlink(p);
    }
    CHECK(left == 3);
    CHECK(loom_remove_stale_tmp("/nonexistent/dir") == 0);
    rmdir(dir);
}

/* A model_dir shared between hosts: temporary files carry the host; only this
 * host's, of a process gone, are removed (another host's pid says nothing here). */
static void test_stale_tmp_hosts(void)
{
    char dir[] = "/tmp/loom_test_core_XXXXXX", p[1300], sfx[128], host[80];
    CHECK(mkdtemp(dir) != NULL);
    pid_t dead = fork();
    if (dead == 0) _exit(0);
    waitpid(dead, NULL, 0);
    loom_tmp_suffix(sfx, sizeof sfx);
    char want[64];
    snprintf(want, sizeof want, ".%ld", (long)getpid());
    CHECK_MSG(!strncmp(sfx, ".tmp.", 5) && strlen(sfx) > strlen(want) + 5 &&
              !strcmp(sfx + strlen(sfx) - strlen(want), want), "suffix %s", sfx);
    snprintf(host, sizeof host, "%.*s", (int)(strlen(sfx) - strlen(want) - 5), sfx + 5);
    CHECK_MSG(host[0] && !strchr(host, '.') && !strchr(host, '/'), "host part \"%s\"", host);
    struct { char name[200]; int stays; } f[5];
    snprintf(f[0].name, sizeof f[0].name, "ckpt-5.loom.tmp.%s.%ld", host, (long)dead), f[0].stays = 0;
    snprintf(f[1].name, sizeof f[1].name, "ckpt-5.loom.tmp.%s_other.%ld", host, (long)dead), f[1].stays = 1;
    snprintf(f[2].name, sizeof f[2].name, "checkpoint.tmp.elsewhere.%ld", (long)dead), f[2].stays = 1;
    snprintf(f[3].name, sizeof f[3].name, "checkpoint.tmp.%s.%ld", host, (long)getpid()), f[3].stays = 1;
    snprintf(f[4].name, sizeof f[4].name, "metrics.jsonl.tmp.%ld", (long)dead), f[4].stays = 0; /* the older form */
    for (int i = 0; i < 5; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, f[i].name);
        FILE *w = fopen(p, "w");
        CHECK(w != NULL);
        if (w) fclose(w);
    }
    CHECK(loom_remove_stale_tmp(dir) == 2);
    for (int i = 0; i < 5; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, f[i].name);
        CHECK_MSG((access(p, F_OK) == 0) == f[i].stays, "%s %s", f[i].name, f[i].stays ? "was removed" : "stayed");
        unlink(p);
    }
    /* an atomic write leaves no temporary file of its own */
    loom_err e = {0};
    snprintf(p, sizeof p, "%s/out", dir);
    CHECK(loom_write_file_atomic(p, "x", 1, &e) == LOOM_OK);
    CHECK(loom_remove_stale_tmp(dir) == 0);
    unlink(p);
    rmdir(dir);
}

/* The one CPUID probe: what CPUID and the compiler's feature test say, asked
 * once (the same pointer every call, from every thread); LOOM_TEST_CPU only
 * hides features. The stage clock's TSC check reads tsc_invariant here. */
static void *probe_thread(void *arg)
{
    (void)arg;
    return (void *)loom_cpu_probe();
}

static void test_cpu_probe(void)
{
    const loom_cpu_features *f = loom_cpu_probe();
    pthread_t th[4];
    for (int i = 0; i < 4; i++) CHECK(pthread_create(&th[i], NULL, probe_thread, NULL) == 0);
    for (int i = 0; i < 4; i++) {
        void *r = NULL;
        pthread_join(th[i], &r);
        CHECK(r == f);
    }
#if defined(__x86_64__) && defined(__GNUC__)
    unsigned a = 0, b = 0, c = 0, d = 0;
    CHECK(__get_cpuid(0, &a, &b, &c, &d));
    char vendor[13];
    memcpy(vendor, &b, 4), memcpy(vendor + 4, &d, 4), memcpy(vendor + 8, &c, 4), vendor[12] = 0;
    CHECK(!strcmp(f->vendor, vendor));
    bool inv = __get_cpuid_max(0x80000000, NULL) >= 0x80000007 && __get_cpuid(0x80000007, &a, &b, &c, &d) && (d >> 8 & 1u);
    CHECK(f->tsc_invariant == inv);
    CHECK(f->sse42 == !!__builtin_cpu_supports("sse4.2"));
    const char *cap = getenv("LOOM_TEST_CPU");
    bool hide512 = cap && (!strcmp(cap, "avx2") || !strcmp(cap, "baseline")), hide2 = cap && !strcmp(cap, "baseline");
    CHECK(f->capped == NULL ? !hide512 : !strcmp(f->capped, cap));
    CHECK(f->avx2 == (!hide2 && __builtin_cpu_supports("avx2")) && f->fma == (!hide2 && __builtin_cpu_supports("fma")));
    CHECK(f->avx512f == (!hide512 && __builtin_cpu_supports("avx512f")) &&
          f->avx512bw == (!hide512 && __builtin_cpu_supports("avx512bw")) &&
          f->avx512vl == (!hide512 && __builtin_cpu_supports("avx512vl")) &&
          f->avx512dq == (!hide512 && __builtin_cpu_supports("avx512dq")));
    printf("# %s family %d model %d, tsc_invariant %d, sse4.2 %d, avx2 %d, avx512f %d%s%s\n", f->vendor, f->family, f->model,
           f->tsc_invariant, f->sse42, f->avx2, f->avx512f, f->capped ? ", capped at " : "", f->capped ? f->capped : "");
#else
    CHECK(!f->avx2 && !f->avx512f && !f->tsc_invariant);
#endif
}

/* The rate limit: a burst, then one per interval, the others counted. */
static void test_ratelimit(void)
{
    loom_ratelimit r = {.interval = 0.2, .burst = 3};
    uint64_t skipped = 99;
    int passed = 0;
    for (int i = 0; i < 10; i++) passed += loom_ratelimit_pass(&r, &skipped);
    CHECK_MSG(passed == 3, "%d of 10 passed at once (burst 3)", passed);
    CHECK(skipped == 0);
    usleep(250000);
    CHECK(loom_ratelimit_pass(&r, &skipped));
    CHECK_MSG(skipped == 7, "%llu counted as held back", (unsigned long long)skipped);
    CHECK(!loom_ratelimit_pass(&r, NULL));
    loom_ratelimit z = {0}; /* zeroed: one a second, burst 1 */
    CHECK(loom_ratelimit_pass(&z, NULL) && !loom_ratelimit_pass(&z, NULL));
}

/* The descriptor limit raised to the hard one, the bounds from it, and the
 * reserve descriptor shedding a pending connection when none is left (in a
 * child: it lowers its own limits). */
static void test_fd_reserve(void)
{
    pid_t pid = fork();
    if (pid == 0) {
        alarm(20);
        struct rlimit rl = {64, 128};
        if (setrlimit(RLIMIT_NOFILE, &rl) != 0) _exit(10);
        if (loom_fd_limit_raise() != 128 || loom_fd_limit() != 128) _exit(11);
        if (loom_fd_bound(16, 8, 256) != 8 || loom_fd_bound(32, 4, 64) != 4 || loom_fd_bound(1, 8, 100) != 100) _exit(12);
        rl.rlim_cur = 64;
        if (setrlimit(RLIMIT_NOFILE, &rl) != 0) _exit(13);
        int lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        socklen_t al = sizeof a;
        if (bind(lfd, (struct sockaddr *)&a, sizeof a) || listen(lfd, 8) || getsockname(lfd, (struct sockaddr *)&a, &al))
            _exit(14);
        int reserve = loom_fd_reserve_open();
        int cl = socket(AF_INET, SOCK_STREAM, 0);
        if (reserve < 0 || connect(cl, (struct sockaddr *)&a, sizeof a)) _exit(15);
        while (open("/dev/null", O_RDONLY) >= 0) {} /* every descriptor taken */
        if (accept(lfd, NULL, NULL) >= 0 || errno != EMFILE) _exit(16);
        if (loom_fd_reserve_shed(&reserve, lfd) != 1 || reserve < 0) _exit(17); /* shed, reserve back */
        char c;
        struct timeval tv = {5, 0};
        setsockopt(cl, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        if (recv(cl, &c, 1, 0) != 0) _exit(18); /* the client sees its connection closed */
        if (loom_fd_reserve_shed(&reserve, lfd) != 0 || reserve < 0) _exit(19); /* nothing pending */
        _exit(0);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the child failed at step %d", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
}

static const loom_test tests[] = {
    {"crc32c", test_crc32c},
    {"crc32c_lengths", test_crc32c_lengths},
    {"cpu_probe", test_cpu_probe},
    {"philox_known_answer", test_philox_known_answer},
    {"rng_streams", test_rng_streams},
    {"buf", test_buf},
    {"alloc_zeroed", test_alloc_zeroed},
    {"errors", test_errors},
    {"pool", test_pool},
    {"pool pinned to cores", test_pool_pin},
    {"pool spins between back-to-back jobs", test_pool_spin},
    {"files", test_files},
    {"open_regular", test_open_regular},
    {"output_target", test_output_target},
    {"path_normalize", test_path_normalize},
    {"stale_tmp", test_stale_tmp},
    {"stale_tmp_hosts", test_stale_tmp_hosts},
    {"ratelimit", test_ratelimit},
    {"fd_reserve", test_fd_reserve},
    {0},
};

int main(void) { return loom_test_run(tests); }
