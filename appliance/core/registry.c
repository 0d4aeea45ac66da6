/* registry.c - the one table of named providers (cross-device ops,
 * strategies, sources, transforms, devices) that built-ins and plugins
 * register into alike. A provider is an opaque pointer to its vtable; the
 * module that defines the vtable type casts it back. */
#include "core/core.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#define REG_MAX 256

typedef struct reg_entry {
    loom_reg_kind kind;
    const char   *name;     /* owned by the provider (static storage in it) */
    const void   *provider;
    char          origin[256];
} reg_entry;

static pthread_mutex_t reg_lock = PTHREAD_MUTEX_INITIALIZER;
static reg_entry       reg[REG_MAX];
static int             n_reg;

static const char *const kind_names[LOOM_REG_KINDS] = {
    [LOOM_REG_CROSS_DEVICE_OPS] = "cross-device ops",
    [LOOM_REG_STRATEGY] = "strategy",
    [LOOM_REG_SOURCE] = "dataset source",
    [LOOM_REG_TRANSFORM] = "transform",
    [LOOM_REG_DEVICE] = "device backend",
    [LOOM_REG_LAYER] = "layer",
};

const char *loom_reg_kind_name(loom_reg_kind kind)
{
    return (unsigned)kind < LOOM_REG_KINDS ? kind_names[kind] : "?";
}

static const reg_entry *find_locked(loom_reg_kind kind, const char *name)
{
    for (int i = 0; i < n_reg; i++)
        if (reg[i].kind == kind && strcmp(reg[i].name, name) == 0) return &reg[i];
    return NULL;
}

int loom_registry_add(loom_reg_kind kind, const char *name, const void *provider, const char *origin, loom_err *err)
{
    if ((unsigned)kind >= LOOM_REG_KINDS || !name || !*name || !provider)
        return loom_err_set(err, LOOM_EPLUGIN, origin, "registering a provider without a kind, name or vtable");
    if (!origin) origin = "built-in";
    pthread_mutex_lock(&reg_lock);
    const reg_entry *old = find_locked(kind, name);
    if (old) {
        char prev[256];
        snprintf(prev, sizeof prev, "%s", old->origin);
        pthread_mutex_unlock(&reg_lock);
        loom_err_set(err, LOOM_EPLUGIN, origin, "%s \"%s\" is already registered by %s", kind_names[kind], name,
                     prev);
        return loom_err_hint(err, "rename the provider, or remove one of the two from the plugin path");
    }
    if (n_reg == REG_MAX) {
        pthread_mutex_unlock(&reg_lock);
        return loom_err_set(err, LOOM_EPLUGIN, origin, "too many registered providers (at most %d)", REG_MAX);
    }
    reg_entry *e = &reg[n_reg++];
    e->kind = kind;
    e->name = name;
    e->provider = provider;
    snprintf(e->origin, sizeof e->origin, "%s", origin);
    pthread_mutex_unlock(&reg_lock);
    return LOOM_OK;
}

const void *loom_registry_find(loom_reg_kind kind, const char *name, const char **origin)
{
    pthread_mutex_lock(&reg_lock);
    const reg_entry *e = name ? find_locked(kind, name) : NULL;
    pthread_mutex_unlock(&reg_lock);
    if (origin) *origin = e ? e->origin : NULL;
    return e ? e->provider : NULL;
}

int loom_registry_count(loom_reg_kind kind)
{
    int k = 0;
    pthread_mutex_lock(&reg_lock);
    for (int i = 0; i < n_reg; i++) k += reg[i].kind == kind;
    pthread_mutex_unlock(&reg_lock);
    return k;
}

int loom_registry_entry(loom_reg_kind kind, int idx, const char **name, const void **provider, const char **origin)
{
    int k = 0, rc = -1;
    pthread_mutex_lock(&reg_lock);
    for (int i = 0; i < n_reg; i++) {
        if (reg[i].kind != kind) continue;
        if (k++ != idx) continue;
        if (name) *name = reg[i].name;
        if (provider) *provider = reg[i].provider;
        if (origin) *origin = reg[i].origin;
        rc = 0;
        break;
    }
    pthread_mutex_unlock(&reg_lock);
    return rc;
}

char *loom_registry_names(loom_reg_kind kind, char *buf, size_t n)
{
    size_t k = 0;
    if (n) buf[0] = '\0';
    pthread_mutex_lock(&reg_lock);
    for (int i = 0; i < n_reg && k < n; i++) {
        if (reg[i].kind != kind) continue;
        int w = snprintf(buf + k, n - k, "%s%s", k ? ", " : "", reg[i].name);
        if (w < 0) break;
        k += (size_t)w;
    }
    pthread_mutex_unlock(&reg_lock);
    return buf;
}
