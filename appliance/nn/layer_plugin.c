/* layer_plugin.c - plugin layer kinds (nn/layer_plugin.h): the registry's
 * LOOM_REG_LAYER entries, which host->register_layer fills. */
#include "nn/nn.h"

const loom_layer_ops *loom_layer_plugin_find(const char *type, const char **origin)
{
    if (!type || !*type) return NULL;
    return (const loom_layer_ops *)loom_registry_find(LOOM_REG_LAYER, type, origin);
}
