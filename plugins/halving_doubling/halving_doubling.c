/* halving_doubling.c - a plugin providing the cross-device op
 * "halving_doubling": Rabenseifner's all-reduce between n in-process
 * buffers, a recursive-halving reduce-scatter followed by a recursive-
 * doubling all-gather. Each buffer is read and written about 2 (p-1)/p
 * times its size, against n times for reduce-to-one, and every exchange of
 * a round touches disjoint halves.
 *
 * Any n: with p the largest power of two <= n and r = n - p, the first 2r
 * buffers are folded pairwise (buffer 2j takes in 2j+1) so that p take part
 * in the halving and doubling, then 2j is copied back into 2j+1.
 * Summation order is fixed by (n, count), so results are deterministic.
 * Threads: called from the train thread; no state between calls. */
#include "loom_plugin.h"

#include <string.h>

static const loom_host *host;

/* dst[i] = dst[i] op src[i] */
static void combine(float *dst, const float *src, int64_t n, loom_redop op)
{
    if (op == LOOM_REDUCE_MAX)
        for (int64_t i = 0; i < n; i++) dst[i] = src[i] > dst[i] ? src[i] : dst[i];
    else
        for (int64_t i = 0; i < n; i++) dst[i] += src[i];
}

/* The buffer of participant v: the folded pairs first, then the rest. */
static int rank_of(int v, int r) { return v < r ? 2 * v : v + r; }

#define MAX_BUFS 1024

static int hd_all_reduce(float *const *bufs, int n, int64_t count, loom_redop op, loom_err *err)
{
    if (n > MAX_BUFS)
        return host->err_set(err, LOOM_EUNSUPPORTED, NULL, "halving_doubling: %d buffers (at most %d)", n, MAX_BUFS);
    int p = 1;
    while (p * 2 <= n) p *= 2;
    int r = n - p;
    for (int j = 0; j < r; j++) combine(bufs[2 * j], bufs[2 * j + 1], count, op);

    /* reduce-scatter: participants v and v|mask share a segment and split it */
    int64_t lo[MAX_BUFS], hi[MAX_BUFS];
    for (int v = 0; v < p; v++) lo[v] = 0, hi[v] = count;
    for (int mask = p / 2; mask >= 1; mask /= 2)
        for (int v = 0; v < p; v++) {
            if (v & mask) continue;
            int w = v | mask;
            float *a = bufs[rank_of(v, r)], *b = bufs[rank_of(w, r)];
            int64_t mid = lo[v] + (hi[v] - lo[v]) / 2;
            combine(a + lo[v], b + lo[v], mid - lo[v], op); /* v keeps [lo, mid) */
            combine(b + mid, a + mid, hi[v] - mid, op);     /* w keeps [mid, hi) */
            hi[v] = mid;
            lo[w] = mid;
        }
    if (op == LOOM_REDUCE_MEAN) {
        float inv = 1.0f / (float)n;
        for (int v = 0; v < p; v++) {
            float *a = bufs[rank_of(v, r)];
            for (int64_t i = lo[v]; i < hi[v]; i++) a[i] *= inv;
        }
    }
    /* all-gather: the same pairs in reverse order swap their reduced segments */
    for (int mask = 1; mask < p; mask *= 2)
        for (int v = 0; v < p; v++) {
            if (v & mask) continue;
            int w = v | mask;
            float *a = bufs[rank_of(v, r)], *b = bufs[rank_of(w, r)];
            memcpy(b + lo[v], a + lo[v], (size_t)(hi[v] - lo[v]) * sizeof(float));
            memcpy(a + lo[w], b + lo[w], (size_t)(hi[w] - lo[w]) * sizeof(float));
            hi[v] = hi[w];
            lo[w] = lo[v];
        }
    for (int j = 0; j < r; j++) memcpy(bufs[2 * j + 1], bufs[2 * j], (size_t)count * sizeof(float));
    return LOOM_EOK;
}

/* Binomial tree from root: round k copies to the 2^k buffers 2^k away. */
static int hd_broadcast(float *const *bufs, int n, int64_t count, int root, loom_err *err)
{
    if (root < 0 || root >= n)
        return host->err_set(err, LOOM_EPLUGIN, NULL, "halving_doubling: root %d of %d", root, n);
    for (int mask = 1; mask < n; mask *= 2)
        for (int v = 0; v < mask && v + mask < n; v++)
            memcpy(bufs[(v + mask + root) % n], bufs[(v + root) % n], (size_t)count * sizeof(float));
    return LOOM_EOK;
}

static const loom_cross_device_ops halving_doubling = {
    .version = LOOM_CROSS_DEVICE_OPS_VERSION,
    .name = "halving_doubling",
    .all_reduce = hd_all_reduce,
    .broadcast = hd_broadcast,
};

static int init(const loom_host *h, loom_err *err)
{
    host = h;
    return h->register_cross_device_ops(&halving_doubling, err);
}

static const loom_plugin plugin = {
    .abi = LOOM_PLUGIN_ABI_VERSION,
    .size = sizeof(loom_plugin),
    .name = "halving_doubling",
    .version = "1.0",
    .description = "cross-device op: recursive-halving reduce-scatter + recursive-doubling all-gather (Rabenseifner)",
    .init = init,
};

const loom_plugin *loom_plugin_entry(void) { return &plugin; }
