/* abi_v1.c - a plugin fixture as one built against loom_plugin.h of ABI 1
 * (elements of at most 8 features): ABI 2 widened loom_elem_spec and
 * loom_elem, so the loader must refuse it, naming both versions, before
 * reading anything else of it. */
#include "loom_plugin.h"

#include <stdlib.h>

static int init(const loom_host *h, loom_err *err)
{
    (void)h, (void)err;
    abort(); /* never reached: the ABI check comes first */
}

static const loom_plugin plugin = {.abi = 1, .size = sizeof(loom_plugin), .name = "abi_v1", .init = init};

const loom_plugin *loom_plugin_entry(void) { return &plugin; }
