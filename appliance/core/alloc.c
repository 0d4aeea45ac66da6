/* alloc.c - the one allocation path, with a failure hook for OOM tests,
 * and the byte buffer used for iterator, RNG and optimizer state. */
#include "core.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>
#include <string.h>
#include <sys/mman.h>

static _Atomic long fail_countdown = -1;

void loom_alloc_fail_after(long n) { atomic_store(&fail_countdown, n); }

static int should_fail(void)
{
    long c = atomic_load(&fail_countdown);
    if (c < 0) return 0;
    return atomic_fetch_sub(&fail_countdown, 1) == 0;
}

void *loom_alloc(size_t n)
{
    if (should_fail()) return NULL;
    return malloc(n ? n : 1);
}

void *loom_calloc(size_t count, size_t size)
{
    if (should_fail()) return NULL;
    return calloc(count ? count : 1, size ? size : 1);
}

void *loom_realloc(void *p, size_t n)
{
    if (should_fail()) return NULL;
    return realloc(p, n ? n : 1);
}

void *loom_alloc_aligned(size_t n)
{
    if (should_fail()) return NULL;
    void *p = NULL;
    if (posix_memalign(&p, 64, (n + 63) & ~(size_t)63)) return NULL;
    return p;
}

void loom_free(void *p) { free(p); }

/* The bytes before the pointer: a 64-byte header (small) or a page (mapped)
 * whose last word is the size asked for. */
#define ZERO_MAP_MIN ((size_t)1 << 20)
#define ZERO_PAGE ((size_t)4096)

void *loom_alloc_zeroed(size_t n)
{
    if (should_fail()) return NULL;
    if (n >= ZERO_MAP_MIN) {
        void *m = mmap(NULL, n + ZERO_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) return NULL;
        char *p = (char *)m + ZERO_PAGE;
        ((size_t *)p)[-1] = n;
        return p;
    }
    void *b = NULL;
    if (posix_memalign(&b, 64, 64 + ((n + 63) & ~(size_t)63))) return NULL;
    memset(b, 0, 64 + n);
    char *p = (char *)b + 64;
    ((size_t *)p)[-1] = n;
    return p;
}

void loom_free_zeroed(void *p)
{
    if (!p) return;
    size_t n = ((size_t *)p)[-1];
    if (n >= ZERO_MAP_MIN) munmap((char *)p - ZERO_PAGE, n + ZERO_PAGE);
    else free((char *)p - 64);
}

char *loom_strdup(const char *s)
{
    size_t n = strlen(s) + 1;
    char *d = loom_alloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

void loom_buf_init(loom_buf *b) { memset(b, 0, sizeof *b); }

void loom_buf_fini(loom_buf *b)
{
    if (b->cap) loom_free(b->data);
    memset(b, 0, sizeof *b);
}

void loom_buf_wrap(loom_buf *b, const void *data, size_t len)
{
    memset(b, 0, sizeof *b);
    b->data = (uint8_t *)data;
    b->len = len;
}

void loom_buf_put(loom_buf *b, const void *p, size_t n)
{
    if (b->failed) return;
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n) cap *= 2;
        uint8_t *d = loom_realloc(b->cap ? b->data : NULL, cap);
        if (!d) {
            b->failed = 1;
            return;
        }
        if (!b->cap && b->len) memcpy(d, b->data, b->len);
        b->data = d;
        b->cap = cap;
    }
    if (n) memcpy(b->data + b->len, p, n);
    b->len += n;
}

void loom_buf_put_u32(loom_buf *b, uint32_t v)
{
    uint8_t x[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    loom_buf_put(b, x, 4);
}

void loom_buf_put_u64(loom_buf *b, uint64_t v)
{
    loom_buf_put_u32(b, (uint32_t)v);
    loom_buf_put_u32(b, (uint32_t)(v >> 32));
}

void loom_buf_put_i64(loom_buf *b, int64_t v) { loom_buf_put_u64(b, (uint64_t)v); }

void loom_buf_put_f64(loom_buf *b, double v)
{
    uint64_t u;
    memcpy(&u, &v, 8);
    loom_buf_put_u64(b, u);
}

void loom_buf_put_str(loom_buf *b, const char *s)
{
    size_t n = strlen(s);
    loom_buf_put_u32(b, (uint32_t)n);
    loom_buf_put(b, s, n);
}

const void *loom_buf_take(loom_buf *b, size_t n)
{
    if (b->failed || n > b->len - b->pos) {
        b->failed = 1;
        return NULL;
    }
    const void *p = b->data + b->pos;
    b->pos += n;
    return p;
}

int loom_buf_get(loom_buf *b, void *p, size_t n)
{
    const void *s = loom_buf_take(b, n);
    if (!s) {
        memset(p, 0, n);
        return -1;
    }
    memcpy(p, s, n);
    return 0;
}

uint32_t loom_buf_get_u32(loom_buf *b)
{
    uint8_t x[4];
    loom_buf_get(b, x, 4);
    return (uint32_t)x[0] | (uint32_t)x[1] << 8 | (uint32_t)x[2] << 16 | (uint32_t)x[3] << 24;
}

uint64_t loom_buf_get_u64(loom_buf *b)
{
    uint64_t lo = loom_buf_get_u32(b);
    return lo | (uint64_t)loom_buf_get_u32(b) << 32;
}

int64_t loom_buf_get_i64(loom_buf *b) { return (int64_t)loom_buf_get_u64(b); }

double loom_buf_get_f64(loom_buf *b)
{
    uint64_t u = loom_buf_get_u64(b);
    double v;
    memcpy(&v, &u, 8);
    return v;
}

int loom_buf_get_str(loom_buf *b, char *dst, size_t n)
{
    uint32_t len = loom_buf_get_u32(b);
    const char *s = loom_buf_take(b, len);
    if (!s) {
        if (n) dst[0] = 0;
        return -1;
    }
    size_t k = len < n - 1 ? len : n - 1;
    memcpy(dst, s, k);
    dst[k] = 0;
    return 0;
}

int64_t loom_phys_bytes(void)
{
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    int64_t n;
    if (pages <= 0 || psz <= 0 || !loom_mul_ok(pages, psz, &n)) return INT64_MAX;
    return n;
}
