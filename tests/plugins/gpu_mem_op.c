/* gpu_mem_op.c - a plugin fixture registering the cross-device op
 * "gpu_mem_op" for GPU memory only (caps LOOM_XOPS_DEVICE_MEM), as the nccl
 * plugin's is, without needing CUDA: a strategy with CPU replicas must
 * refuse it when it opens, at strategy.cross_device_ops' file:line, and
 * "auto" must never pick it for them. Its collectives fail if ever called. */
#include "loom_plugin.h"

static const loom_host *host;

static int all_reduce(float *const *bufs, int n, int64_t count, loom_redop op, loom_err *err)
{
    (void)bufs, (void)n, (void)count, (void)op;
    return host->err_set(err, LOOM_EUSAGE, NULL, "gpu_mem_op: all_reduce called with CPU replicas' buffers");
}

static int broadcast(float *const *bufs, int n, int64_t count, int root, loom_err *err)
{
    (void)bufs, (void)n, (void)count, (void)root;
    return host->err_set(err, LOOM_EUSAGE, NULL, "gpu_mem_op: broadcast called with CPU replicas' buffers");
}

static const loom_cross_device_ops ops = {.version = LOOM_CROSS_DEVICE_OPS_VERSION,
                                          .name = "gpu_mem_op",
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
                                   .name = "gpu_mem_op",
                                   .version = "1.0",
                                   .description = "test fixture: a cross-device op for GPU memory only",
                                   .init = init};

LOOM_PLUGIN_EXPORT const loom_plugin *loom_plugin_entry(void) { return &plugin; }
