/* builtin.c - the built-in transforms (map, shuffle, batch, ..., zip) as
 * entries of the shared registry (LOOM_REG_TRANSFORM), under the names the
 * config spells their type with, beside the built-in map functions
 * (transforms.c, dmapfn_register_) and the element-map providers ("lua",
 * plugins' loom_custom_ops): the pipeline opens a transform by looking its
 * name up, `loom plugins` lists them all, and a plugin cannot take a
 * built-in's name. An entry begins as loom_custom_ops does (version, name)
 * with a version no plugin's can have. The names are config's
 * (loom_transform_kind_name): one list. Threads: registration happens once,
 * under loom_data_init's lock; afterwards the entries are read-only. */
#include "data/data_internal.h"

#include <stdio.h>
#include <string.h>

static int open_map(dstage **out, dstage *in, const dxform_args *a, loom_err *err)
{
    int rc = map_open_(out, in, a->id, a->t, a->ctx, err);
    if (!rc) (void)map_fuse_into_batch_(*out); /* a scale right after a gathering batch runs in its row copies */
    return rc;
}

static int open_shuffle(dstage **out, dstage *in, const dxform_args *a, loom_err *err)
{
    return shuffle_open_(out, in, a->id, a->t, a->ctx, err);
}

/* Element or position buffer of a plain shuffle (shuffle_max_bytes_). */
static int64_t shuffle_bytes(const dstage *in, const loom_transform_spec *t)
{
    return shuffle_max_bytes_(in, t, shuffle_by_index_(in));
}

static void shuffle_what(char *buf, size_t n, const dstage *in, const loom_transform_spec *t)
{
    (void)in;
    snprintf(buf, n, "shuffle: a buffer of %lld elements", (long long)t->buffer);
}

/* The identities noop_elimination drops: take(-1), skip(0), repeat(1), prefetch(0), shard(1, 0). */
static bool take_noop(const loom_transform_spec *t) { return t->count == -1; }
static bool skip_noop(const loom_transform_spec *t) { return t->count == 0; }
static bool repeat_noop(const loom_transform_spec *t) { return t->count == 1; }
static bool prefetch_noop(const loom_transform_spec *t) { return t->buffer == 0; }
static bool shard_noop(const loom_transform_spec *t) { return t->num_shards == 1 && t->index == 0; }

static int open_batch(dstage **out, dstage *in, const dxform_args *a, loom_err *err)
{
    return batch_open_(out, in, a->id, a->t, err);
}

static int open_repeat(dstage **out, dstage *in, const dxform_args *a, loom_err *err)
{
    return repeat_open_(out, in, a->id, a->t, err);
}

static int open_take(dstage **out, dstage *in, const dxform_args *a, loom_err *err)
{
    return take_open_(out, in, a->id, a->t, err);
}

static int open_skip(dstage **out, dstage *in, const dxform_args *a, loom_err *err)
{
    return skip_open_(out, in, a->id, a->t, err);
}

/* A threaded prefetch takes one of the pipeline's threads (a buffer of 0 runs inline). */
static int open_prefetch(dstage **out, dstage *in, const dxform_args *a, loom_err *err)
{
    int threads = *a->threads;
    int rc = prefetch_open_(out, in, a->id, a->t, threads > 0, a->ctx->lazy_threads, a->ram_left, err);
    if (!rc && threads > 0 && a->t->buffer != 0) *a->threads = threads - 1;
    return rc;
}

static int open_filter(dstage **out, dstage *in, const dxform_args *a, loom_err *err)
{
    if (a->t->filter == LOOM_FILTER_LUA) return custom_filter_open_(out, in, a->id, a->t, a->ctx, err);
    return filter_open_(out, in, a->id, a->t, err);
}

static int open_shard(dstage **out, dstage *in, const dxform_args *a, loom_err *err) /* shard, split */
{
    return shard_open_(out, in, a->id, a->t, a->ctx->seed, err);
}

static int open_enumerate(dstage **out, dstage *in, const dxform_args *a, loom_err *err)
{
    return enumerate_open_(out, in, a->id, a->t, err);
}

static int open_concat(dstage **out, dstage *in, const dxform_args *a, loom_err *err)
{
    return concat_open_(out, in, a->id, a->t, err);
}

static int open_select(dstage **out, dstage *in, const dxform_args *a, loom_err *err)
{
    return select_open_(out, in, a->id, a->t, err);
}

static int open_unbatch(dstage **out, dstage *in, const dxform_args *a, loom_err *err)
{
    return unbatch_open_(out, in, a->id, a->t, err);
}

static int open_padded_batch(dstage **out, dstage *in, const dxform_args *a, loom_err *err)
{
    return padded_batch_open_(out, in, a->id, a->t, err);
}

/* A repeat(-1) upstream makes the pass endless even when the stages cannot
 * tell (a source of unknown length): the cache would grow without bound. */
static int cache_check(const dstage *in, const dxform_args *a, loom_err *err)
{
    (void)in;
    const loom_transform_spec *t = a->t;
    for (int k = 0; a->index >= 0 && k < a->index; k++)
        if (a->spec->transform[k].kind == LOOM_T_REPEAT && a->spec->transform[k].count < 0) {
            char where[LOOM_PATH_MAX + 16];
            loom_loc_str(&t->loc, where, sizeof where);
            loom_err_set(err, LOOM_ECONFIG, where,
                         "cache: the repeat before it (transforms.[%d]) has count = -1, so the pass it caches "
                         "never ends and the cache would grow without bound", k);
            return loom_err_hint(err, "put cache before repeat, so that it holds one finite pass");
        }
    return LOOM_OK;
}

/* Bytes a memory cache of t over in comes to hold: a whole pass (0 for a file
 * cache, or when the pass's length is unknown and cannot be bounded ahead). */
static int64_t cache_bytes(const dstage *in, const loom_transform_spec *t)
{
    if (t->cache_file[0] || in->card < 0) return 0;
    int64_t slot = 0;
    for (int f = 0; f < in->spec.n; f++) slot += loom_shape_numel(&in->maxshape[f]) * (int64_t)loom_dtype_size(in->spec.dtype[f]);
    return in->card * slot;
}

static void cache_what(char *buf, size_t n, const dstage *in, const loom_transform_spec *t)
{
    (void)t;
    snprintf(buf, n, "cache: a pass of %lld elements in memory", (long long)in->card);
}

static int open_cache(dstage **out, dstage *in, const dxform_args *a, loom_err *err)
{
    return cache_open_(out, in, a->id, a->t, &a->spec->source, a->ram_left, a->ram, err);
}

static int open_interleave(dstage **out, dstage *in, const dxform_args *a, loom_err *err)
{
    return interleave_open_(out, in, a->id, a->t, a->ctx, a->pool, err);
}

static int open_zip(dstage **out, dstage *in, const dxform_args *a, loom_err *err)
{
    return zip_open_(out, in, a->id, a->t, a->ctx, err);
}

static int open_window(dstage **out, dstage *in, const dxform_args *a, loom_err *err)
{
    return window_open_(out, in, a->id, a->t, err);
}

static void window_what(char *buf, size_t n, const dstage *in, const loom_transform_spec *t)
{
    (void)in;
    snprintf(buf, n, "window: a ring of %lld elements and the window", (long long)((t->batch_size - 1) * t->stride + 1));
}

static int open_lm_pairs(dstage **out, dstage *in, const dxform_args *a, loom_err *err)
{
    return lm_pairs_open_(out, in, a->id, a->t, err);
}

static int open_bucket(dstage **out, dstage *in, const dxform_args *a, loom_err *err)
{
    return bucket_open_(out, in, a->id, a->t, err);
}

static void bucket_what(char *buf, size_t n, const dstage *in, const loom_transform_spec *t)
{
    (void)in;
    snprintf(buf, n, "bucket_by_sequence_length: %d buckets of elements and a batch", t->padded.n_boundaries + 1);
}

/* flat_map: tf's interleave with cycle_length 1 (config sets it, and block_length and parallel 1). */
static int open_flat_map(dstage **out, dstage *in, const dxform_args *a, loom_err *err)
{
    loom_transform_spec t = *a->t; /* whatever a spec built in code says */
    t.cycle_length = t.block_length = t.parallel = 1;
    t.deterministic = true;
    int rc = interleave_open_(out, in, a->id, &t, a->ctx, a->pool, err);
    if (!rc) snprintf((*out)->name, sizeof (*out)->name, "flat_map");
    return rc;
}

/* name: filled from config's list at registration. Not const for that one write. */
static dxform builtins[] = {
    {DXFORM_BUILTIN, NULL, LOOM_T_MAP, open_map, NULL, NULL, NULL, NULL},
    {DXFORM_BUILTIN, NULL, LOOM_T_SHUFFLE, open_shuffle, NULL, shuffle_bytes, shuffle_what, NULL},
    {DXFORM_BUILTIN, NULL, LOOM_T_BATCH, open_batch, NULL, NULL, NULL, NULL},
    {DXFORM_BUILTIN, NULL, LOOM_T_REPEAT, open_repeat, NULL, NULL, NULL, repeat_noop},
    {DXFORM_BUILTIN, NULL, LOOM_T_TAKE, open_take, NULL, NULL, NULL, take_noop},
    {DXFORM_BUILTIN, NULL, LOOM_T_SKIP, open_skip, NULL, NULL, NULL, skip_noop},
    {DXFORM_BUILTIN, NULL, LOOM_T_PREFETCH, open_prefetch, NULL, NULL, NULL, prefetch_noop},
    {DXFORM_BUILTIN, NULL, LOOM_T_FILTER, open_filter, NULL, NULL, NULL, NULL},
    {DXFORM_BUILTIN, NULL, LOOM_T_SHARD, open_shard, NULL, NULL, NULL, shard_noop},
    {DXFORM_BUILTIN, NULL, LOOM_T_ENUMERATE, open_enumerate, NULL, NULL, NULL, NULL},
    {DXFORM_BUILTIN, NULL, LOOM_T_UNBATCH, open_unbatch, NULL, NULL, NULL, NULL},
    {DXFORM_BUILTIN, NULL, LOOM_T_PADDED_BATCH, open_padded_batch, NULL, NULL, NULL, NULL},
    {DXFORM_BUILTIN, NULL, LOOM_T_CACHE, open_cache, cache_check, cache_bytes, cache_what, NULL},
    {DXFORM_BUILTIN, NULL, LOOM_T_INTERLEAVE, open_interleave, NULL, NULL, NULL, NULL},
    {DXFORM_BUILTIN, NULL, LOOM_T_ZIP, open_zip, NULL, NULL, NULL, NULL},
    {DXFORM_BUILTIN, NULL, LOOM_T_SPLIT, open_shard, NULL, NULL, NULL, NULL},
    {DXFORM_BUILTIN, NULL, LOOM_T_CONCAT, open_concat, NULL, NULL, NULL, NULL},
    {DXFORM_BUILTIN, NULL, LOOM_T_SELECT, open_select, NULL, NULL, NULL, NULL},
    {DXFORM_BUILTIN, NULL, LOOM_T_WINDOW, open_window, NULL, window_max_bytes_, window_what, NULL},
    {DXFORM_BUILTIN, NULL, LOOM_T_LM_PAIRS, open_lm_pairs, NULL, NULL, NULL, NULL},
    {DXFORM_BUILTIN, NULL, LOOM_T_BUCKET, open_bucket, NULL, bucket_max_bytes_, bucket_what, NULL},
    {DXFORM_BUILTIN, NULL, LOOM_T_FLAT_MAP, open_flat_map, NULL, NULL, NULL, NULL},
};
#define N_BUILTINS ((int)(sizeof builtins / sizeof builtins[0]))

int dxform_register_(loom_err *err)
{
    int rc = LOOM_OK;
    for (int i = 0; !rc && i < N_BUILTINS; i++) {
        if (!builtins[i].name) builtins[i].name = loom_transform_kind_name(builtins[i].kind);
        LOOM_ASSERT(strcmp(builtins[i].name, "?")); /* config names every kind this table has */
        if (loom_registry_find(LOOM_REG_TRANSFORM, builtins[i].name, NULL) != &builtins[i])
            rc = loom_registry_add(LOOM_REG_TRANSFORM, builtins[i].name, &builtins[i], NULL, err);
    }
    return rc;
}

loom_xform_entry loom_data_transform_entry(const void *entry)
{
    const uint32_t *version = entry; /* every LOOM_REG_TRANSFORM entry starts with its version */
    if (entry && *version == DXFORM_BUILTIN) return LOOM_XFORM_BUILTIN;
    if (entry && *version == DMAPFN_BUILTIN) return LOOM_XFORM_MAP_FN;
    return LOOM_XFORM_PROVIDER;
}

bool loom_data_transform_builtin(const void *entry) { return loom_data_transform_entry(entry) != LOOM_XFORM_PROVIDER; }

char *dxform_names_(uint32_t version, char *buf, size_t n)
{
    size_t k = 0;
    const char *name;
    const void *p;
    buf[0] = 0;
    for (int i = 0; loom_registry_entry(LOOM_REG_TRANSFORM, i, &name, &p, NULL) == 0 && k < n; i++) {
        uint32_t v = loom_data_transform_builtin(p) ? *(const uint32_t *)p : 0;
        if (v != version) continue;
        int w = snprintf(buf + k, n - k, "%s%s", k ? ", " : "", name);
        if (w > 0) k += (size_t)w;
    }
    return buf;
}

char *loom_data_providers(char *buf, size_t n) { return dxform_names_(0, buf, n); }

const dxform *dxform_find_(const loom_transform_spec *t, const char *where, loom_err *err)
{
    int rc = loom_data_init(err);
    if (rc) return NULL;
    const char *name = loom_transform_kind_name(t->kind);
    const dxform *x = loom_registry_find(LOOM_REG_TRANSFORM, name, NULL);
    if (x && x->version == DXFORM_BUILTIN) return x;
    char names[512];
    if (!strcmp(name, "?"))
        loom_err_set(err, LOOM_ECONFIG, where, "transform kind %d has no name (built in: %s)", (int)t->kind,
                     dxform_names_(DXFORM_BUILTIN, names, sizeof names));
    else
        loom_err_set(err, LOOM_ECONFIG, where, "transform \"%s\" is not a registered built-in (built in: %s)", name,
                     dxform_names_(DXFORM_BUILTIN, names, sizeof names));
    return NULL;
}
