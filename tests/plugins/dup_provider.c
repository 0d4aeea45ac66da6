/* dup_provider.c - a plugin fixture registering the cross-device op name
 * "halving_doubling", which the shipped plugin of that name already took:
 * the loader must refuse it saying who has the name. */
#include "loom_plugin.h"

static int all_reduce(float *const *bufs, int n, int64_t count, loom_redop op, loom_err *err)
{
    (void)bufs, (void)n, (void)count, (void)op, (void)err;
    return LOOM_EOK;
}

static int broadcast(float *const *bufs, int n, int64_t count, int root, loom_err *err)
{
    (void)bufs, (void)n, (void)count, (void)root, (void)err;
    return LOOM_EOK;
}

static const loom_cross_device_ops ops = {.version = LOOM_CROSS_DEVICE_OPS_VERSION,
                                          .name = "halving_doubling",
                                          .all_reduce = all_reduce,
                                          .broadcast = broadcast};

static int init(const loom_host *h, loom_err *err) { return h->register_cross_device_ops(&ops, err); }

static const loom_plugin plugin = {
    .abi = LOOM_PLUGIN_ABI_VERSION, .size = sizeof(loom_plugin), .name = "dup_provider", .init = init};

const loom_plugin *loom_plugin_entry(void) { return &plugin; }
