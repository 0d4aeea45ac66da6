/* plugin_internal.h - shared by the loader (loader.c) and the host table
 * (host.c) of the plugin module. */
#ifndef LOOM_PLUGIN_INTERNAL_H
#define LOOM_PLUGIN_INTERNAL_H

#include "plugin/plugin.h"
#include "tensor/tensor.h"

#include "nn/nn.h"
#include "loom_plugin.h" /* after distribute.h: its guards skip the types Loom defines */

/* The table handed to every plugin's init (static; never freed). */
const loom_host *loom_plugin_host_(void);

/* A registration made while a plugin's init runs: kept aside and committed
 * to the registry only when init succeeds, so a refused plugin leaves
 * nothing behind. A name already taken (in the registry or earlier in the
 * same init) is LOOM_EPLUGIN and refuses the plugin even if init ignores it.
 * Outside an init it is LOOM_EPLUGIN too. */
int loom_plugin_register_(loom_reg_kind kind, const char *name, const void *vtable, const char *const *options,
                          loom_err *err);

#endif
