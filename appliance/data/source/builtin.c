/* builtin.c - the built-in dataset sources as providers in the shared
 * registry (LOOM_REG_SOURCE), under the names source.type gives them, beside
 * the sources plugins register there: a pipeline opens its source by looking
 * its type up, built-in or plugin alike; `loom plugins` lists both; an
 * unknown type's hint is drawn from the one list; and a plugin cannot take
 * a built-in's name. A built-in's vtable begins as loom_source_ops does
 * (version, name) with a version no plugin's can have. Threads: registration
 * happens once, under a lock; the registry itself is thread-safe. */
#include "data/data_internal.h"

#include <pthread.h>

/* version of a built-in source's vtable ("LOOM"): plugins register versions from 1 up */
#define DSOURCE_BUILTIN 0x4c4f4f4du

typedef struct dsource_builtin {
    uint32_t         version; /* DSOURCE_BUILTIN; where loom_source_ops has its version */
    const char      *name;    /* source.type, the registry's name; where loom_source_ops has its name */
    loom_source_kind kind;    /* what config resolved the name to */
    int (*open)(dstage **out, const loom_source_spec *src, const loom_data_ctx *ctx, loom_err *err);
} dsource_builtin;

static int open_idx(dstage **out, const loom_source_spec *src, const loom_data_ctx *ctx, loom_err *err)
{
    (void)ctx;
    return source_open_(out, src, err);
}

static int open_csv(dstage **out, const loom_source_spec *src, const loom_data_ctx *ctx, loom_err *err)
{
    (void)ctx;
    return csv_source_open_(out, src, err);
}

static int open_text(dstage **out, const loom_source_spec *src, const loom_data_ctx *ctx, loom_err *err)
{
    (void)ctx;
    return text_source_open_(out, src, err);
}

static int open_list_files(dstage **out, const loom_source_spec *src, const loom_data_ctx *ctx, loom_err *err)
{
    (void)ctx;
    return list_files_source_open_(out, src, err);
}

static const dsource_builtin builtins[] = {
    {DSOURCE_BUILTIN, "idx", LOOM_SRC_IDX, open_idx},
    {DSOURCE_BUILTIN, "catalog", LOOM_SRC_CATALOG, open_idx},
    {DSOURCE_BUILTIN, "tfrecord", LOOM_SRC_TFRECORD, tfrecord_source_open_},
    {DSOURCE_BUILTIN, "csv", LOOM_SRC_CSV, open_csv},
    {DSOURCE_BUILTIN, "text", LOOM_SRC_TEXT, open_text},
    {DSOURCE_BUILTIN, "synthetic", LOOM_SRC_SYNTHETIC, synthetic_source_open_},
    {DSOURCE_BUILTIN, "list_files", LOOM_SRC_LIST_FILES, open_list_files},
};
#define N_BUILTINS ((int)(sizeof builtins / sizeof builtins[0]))

static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;
static bool            inited;

int loom_data_init(loom_err *err)
{
    int rc = LOOM_OK;
    pthread_mutex_lock(&init_lock);
    for (int i = 0; !inited && !rc && i < N_BUILTINS; i++)
        if (loom_registry_find(LOOM_REG_SOURCE, builtins[i].name, NULL) != &builtins[i])
            rc = loom_registry_add(LOOM_REG_SOURCE, builtins[i].name, &builtins[i], NULL, err);
    if (!inited && !rc) rc = dxform_register_(err); /* the transforms and map fns (transform/builtin.c) */
    if (!inited && !rc) rc = dmapfn_register_(err);
    if (!rc) inited = true;
    pthread_mutex_unlock(&init_lock);
    return rc;
}

int dsource_open_(dstage **out, const loom_source_spec *src, const loom_data_ctx *ctx, loom_err *err)
{
    *out = NULL;
    int rc = loom_data_init(err);
    if (rc) return rc;
    const char *type = src->kind == LOOM_SRC_PLUGIN ? src->plugin.name : NULL;
    for (int i = 0; !type && i < N_BUILTINS; i++)
        if (builtins[i].kind == src->kind) type = builtins[i].name;
    if (!type) return loom_err_set(err, LOOM_ECONFIG, NULL, "source kind %d has no name", (int)src->kind);
    const dsource_builtin *b = loom_registry_find(LOOM_REG_SOURCE, type, NULL);
    if (b && b->version == DSOURCE_BUILTIN) return b->open(out, src, ctx, err);
    LOOM_ASSERT(src->kind == LOOM_SRC_PLUGIN); /* a built-in's name finds the built-in: it registers first */
    return plugin_source_open_(out, src, ctx, err); /* a plugin's (its own errors for an unknown type) */
}
