/* abi_mismatch.c - a plugin fixture built for another ABI version: the
 * loader must refuse it naming both versions, without calling init. */
#include "loom_plugin.h"

#include <stdlib.h>

static int init(const loom_host *h, loom_err *err)
{
    (void)h, (void)err;
    abort(); /* never reached: the ABI check comes first */
}

static const loom_plugin plugin = {
    .abi = LOOM_PLUGIN_ABI_VERSION + 98, .size = sizeof(loom_plugin), .name = "abi_mismatch", .init = init};

const loom_plugin *loom_plugin_entry(void) { return &plugin; }
