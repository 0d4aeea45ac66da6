/* init_fails.c - a plugin fixture whose init registers a cross-device op and
 * then fails: the loader must refuse it with init's own message and leave
 * nothing of it in the registry. */
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
                                          .name = "never_registered",
                                          .all_reduce = all_reduce,
                                          .broadcast = broadcast};

static int init(const loom_host *h, loom_err *err)
{
    int rc = h->register_cross_device_ops(&ops, err);
    if (rc) return rc;
    h->err_set(err, LOOM_EPLUGIN, NULL, "libfoo.so.3 not found");
    return h->err_hint(err, "install libfoo3");
}

static const loom_plugin plugin = {
    .abi = LOOM_PLUGIN_ABI_VERSION, .size = sizeof(loom_plugin), .name = "init_fails", .init = init};

const loom_plugin *loom_plugin_entry(void) { return &plugin; }
