/* dev_mem_sum.c - a plugin fixture registering the cross-device op
 * "dev_mem_sum" for device memory only (caps LOOM_XOPS_DEVICE_MEM), as the
 * nccl plugin's is, that really reduces: each element is summed over the
 * buffers in buffer order, in float (the bits of reduce_to_one_device), so
 * replicas on the CPU reference backend (strategy.device_backend = "cpu"),
 * whose device memory is host memory, train with it as GPU replicas would
 * with nccl (integration/device_path.sh). With LOOM_TEST_DEV_MEM_SUM_LOG set,
 * every call appends one line to that file ("all_reduce n=2 count=235146"),
 * so a test can tell the op ran on the device buffers rather than the host
 * path. Threads: the strategy calls it from one replica thread at a time. */
#include "loom_plugin.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const loom_host *host;

/* One line per call into $LOOM_TEST_DEV_MEM_SUM_LOG, when set. */
static int note(const char *what, int n, int64_t count, loom_err *err)
{
    const char *path = getenv("LOOM_TEST_DEV_MEM_SUM_LOG");
    if (!path || !path[0]) return 0;
    FILE *f = fopen(path, "a");
    if (!f) return host->err_set(err, LOOM_EIO, path, "dev_mem_sum: cannot append to the call log");
    fprintf(f, "%s n=%d count=%lld\n", what, n, (long long)count);
    return fclose(f) ? host->err_set(err, LOOM_EIO, path, "dev_mem_sum: cannot write the call log") : 0;
}

static int all_reduce(float *const *bufs, int n, int64_t count, loom_redop op, loom_err *err)
{
    for (int k = 1; k < n; k++)
        if (bufs[k] == bufs[0])
            return host->err_set(err, LOOM_EUSAGE, NULL, "dev_mem_sum: buffers 0 and %d are the same", k);
    for (int64_t i = 0; i < count; i++) {
        float s = bufs[0][i];
        for (int k = 1; k < n; k++) s = op == LOOM_REDUCE_MAX ? (bufs[k][i] > s ? bufs[k][i] : s) : s + bufs[k][i];
        if (op == LOOM_REDUCE_MEAN) s /= (float)n;
        for (int k = 0; k < n; k++) bufs[k][i] = s;
    }
    return note("all_reduce", n, count, err);
}

static int broadcast(float *const *bufs, int n, int64_t count, int root, loom_err *err)
{
    for (int k = 0; k < n; k++)
        if (k != root) memcpy(bufs[k], bufs[root], (size_t)count * sizeof(float));
    return note("broadcast", n, count, err);
}

static const loom_cross_device_ops ops = {.version = LOOM_CROSS_DEVICE_OPS_VERSION,
                                          .name = "dev_mem_sum",
                                          .all_reduce = all_reduce,
                                          .broadcast = broadcast,
                                          .caps = LOOM_XOPS_DEVICE_MEM};

static int init(const loom_host *h, loom_err *err)
{
    host = h;
    return h->register_cross_device_ops(&ops, err);
}

static const loom_plugin plugin = {.abi = LOOM_PLUGIN_ABI_VERSION,
                                   .size = sizeof(loom_plugin),
                                   .name = "dev_mem_sum",
                                   .version = "1.0",
                                   .description = "test fixture: a summing cross-device op for device memory only",
                                   .init = init};

LOOM_PLUGIN_EXPORT const loom_plugin *loom_plugin_entry(void) { return &plugin; }
