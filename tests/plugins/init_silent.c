/* init_silent.c - a plugin fixture whose init fails without setting a
 * message: the loader must say so, not report the return code's meaning. */
#include "loom_plugin.h"

static int init(const loom_host *h, loom_err *err)
{
    (void)h, (void)err;
    return LOOM_ENOMEM;
}

static const loom_plugin plugin = {
    .abi = LOOM_PLUGIN_ABI_VERSION, .size = sizeof(loom_plugin), .name = "init_silent", .init = init};

const loom_plugin *loom_plugin_entry(void) { return &plugin; }
