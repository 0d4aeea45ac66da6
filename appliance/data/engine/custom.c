/* custom.c - map and filter stages whose function comes from a provider in
 * the registry (custom.h), such as a Lua function (`lua = "file.lua:fn"`).
 * A custom map maps the whole element: its output spec is the provider's,
 * and every output feature is written into the stage's buffer (or a parallel
 * map slot's), at offsets fixed at open from the output's max shapes.
 * Randomness: each call gets the key (run seed, stage id, epoch, position of
 * the element in this pass), so results do not depend on threads.
 * Threads: the stage is driven by one thread; for a parallel map, custom_apply_
 * runs on pool workers concurrently (the provider is thread-safe up to the
 * max_calls it was opened with). */
#include "data/data_internal.h"

#include <stdio.h>
#include <string.h>

typedef struct custst {
    dstage                 s;
    int64_t                epoch, pos;   /* pos: input elements consumed this pass: the key's index */
    const loom_custom_ops *ops;
    void                  *inst;
    int                    filter;
    uint64_t               seed;
    size_t                 off[LOOM_MAX_FEATURES], total; /* map: where each output feature goes in a buffer */
    uint8_t               *buf;          /* map: the sequential output buffer */
    char                   ref[LOOM_PATH_MAX + LOOM_NAME_MAX];
    char                   label[LOOM_PATH_MAX + 2 * LOOM_NAME_MAX]; /* the setting, for messages: lua = "...", plugin = "..." */
    loom_options           args;         /* the transform's args, pointing into map.args and argw */
    char                   argw[LOOM_MAX_OPTIONS][LOOM_PATH_MAX + 48];
} custst;
DCURSOR_STAGE_CHECK(custst);

static const dstage_ops custom_map_ops, custom_filter_ops;

bool custom_is_(const dstage *st) { return st->ops == &custom_map_ops; }

size_t custom_scratch_(const dstage *st) { return ((const custst *)st)->total; }

size_t custom_offset_(const dstage *st, int f, size_t *cap)
{
    const custst *s = (const custst *)st;
    size_t end = f + 1 < st->spec.n ? s->off[f + 1] : s->total;
    *cap = end - s->off[f];
    return s->off[f];
}

/* Prefixes a failed call's message with the transform and the element. */
static int call_failed(const custst *s, int64_t epoch, int64_t pos, loom_err *err)
{
    if (!err) return LOOM_ELUA;
    char at[LOOM_PATH_MAX + 16] = "";
    if (s->s.where[0]) snprintf(at, sizeof at, " (%.400s)", s->s.where);
    loom_err_prefix(err, "%s %.260s%s, element %lld of epoch %lld", s->filter ? "filter" : "map", s->label, at,
                    (long long)pos, (long long)epoch);
    return err->code;
}

int custom_apply_(const dstage *st, loom_elem *e, uint8_t *buf, int64_t epoch, int64_t pos, loom_err *err)
{
    const custst *s = (const custst *)st;
    loom_elem out;
    out.n = st->spec.n;
    for (int f = 0; f < out.n; f++) {
        out.t[f].owns = 0;
        out.t[f].dtype = st->spec.dtype[f];
        out.t[f].shape = st->maxshape[f];
        out.t[f].data = buf + s->off[f];
    }
    loom_custom_key k = {.seed = s->seed, .stage = st->id, .epoch = epoch, .index = pos};
    int rc = s->ops->map(s->inst, e, &out, &k, err);
    if (rc) return call_failed(s, epoch, pos, err);
    elem_copy_(e, &out);
    return LOOM_OK;
}

static int cmap_next(dstage *st, loom_elem **out, loom_err *err)
{
    custst *s = (custst *)st;
    loom_elem *e;
    int rc = dstage_next_(st->in, &e, err);
    if (rc) return rc;
    elem_copy_(&st->out, e);
    rc = custom_apply_(st, &st->out, s->buf, s->epoch, s->pos, err);
    if (rc) return rc;
    s->pos++;
    memset(st->mut, 1, sizeof st->mut); /* our own buffer */
    *out = &st->out;
    return LOOM_OK;
}

static int cfilter_next(dstage *st, loom_elem **out, loom_err *err)
{
    custst *s = (custst *)st;
    for (;;) {
        loom_elem *e;
        int rc = dstage_next_(st->in, &e, err);
        if (rc) return rc;
        loom_custom_key k = {.seed = s->seed, .stage = st->id, .epoch = s->epoch, .index = s->pos};
        int keep = 0;
        rc = s->ops->filter(s->inst, e, &keep, &k, err);
        if (rc) return call_failed(s, s->epoch, s->pos, err);
        s->pos++;
        if (!keep) continue;
        elem_copy_(&st->out, e);
        memcpy(st->mut, st->in->mut, sizeof st->mut);
        *out = &st->out;
        return LOOM_OK;
    }
}

static void cust_close(dstage *st)
{
    custst *s = (custst *)st;
    if (s->inst) s->ops->close(s->inst);
    loom_free(s->buf);
    loom_free(s);
}

static const dstage_ops custom_map_ops = {
    .next = cmap_next, .rewind = dcursor_stage_rewind_, .save = dcursor_stage_save_, .restore = dcursor_stage_restore_, .close = cust_close,
};
static const dstage_ops custom_filter_ops = {
    .next = cfilter_next, .rewind = dcursor_stage_rewind_, .save = dcursor_stage_save_, .restore = dcursor_stage_restore_, .close = cust_close,
};

/* The transform's args as loom_options, each with the file:line it came from. */
static void point_args(custst *s, const loom_transform_spec *t)
{
    const loom_plugin_opts *o = &t->map.args;
    s->args.n = o->n < LOOM_MAX_OPTIONS ? o->n : LOOM_MAX_OPTIONS;
    for (int i = 0; i < s->args.n; i++) {
        if (o->line[i] > 0)
            snprintf(s->argw[i], sizeof s->argw[i], "%s:%d", t->loc.file, o->line[i]);
        else
            snprintf(s->argw[i], sizeof s->argw[i], "--set ...args.%s", o->key[i]);
        s->args.key[i] = o->key[i];
        s->args.value[i] = o->value[i];
        s->args.where[i] = s->argw[i];
    }
}

/* Lays out the output features in a buffer, each 64-byte aligned. */
static int layout(custst *s, loom_err *err)
{
    dstage *st = &s->s;
    size_t at = 0;
    for (int f = 0; f < st->spec.n; f++) {
        const loom_shape *mx = &st->maxshape[f];
        int64_t n, bytes, end;
        if (mx->rank < 0 || mx->rank > LOOM_MAX_RANK || !loom_dims_ok(mx->dim, mx->rank, &n))
            return dstage_err_(st, err, LOOM_ESHAPE, "%s: output \"%s\" has no size", st->name, st->spec.name[f]);
        /* the provider's max shape: its product must not wrap into a small buffer */
        if (!loom_mul_ok(n, (int64_t)loom_dtype_size(st->spec.dtype[f]), &bytes) || !loom_add_ok(bytes, 63, &bytes) ||
            !loom_add_ok((int64_t)at, bytes & ~(int64_t)63, &end) || end > loom_phys_bytes())
            return dstage_err_(st, err, LOOM_ESHAPE, "%s: output \"%s\" is too large for memory (max shape of %d dims)",
                               st->name, st->spec.name[f], mx->rank);
        s->off[f] = at;
        at = (size_t)end;
    }
    s->total = at;
    return LOOM_OK;
}

static int cust_open(dstage **out, dstage *in, int id, const loom_transform_spec *t, const loom_data_ctx *ctx, int filter,
                     int max_calls, loom_err *err)
{
    *out = NULL;
    custst *s = loom_calloc(1, sizeof *s);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a custom %s stage", filter ? "filter" : "map");
    dstage *st = &s->s;
    dstage_init_(st, filter ? &custom_filter_ops : &custom_map_ops, in, id, &t->loc);
    s->filter = filter;
    s->seed = ctx->seed;
    snprintf(s->ref, sizeof s->ref, "%s", t->map.lua);
    const char *provider = t->map.provider[0] ? t->map.provider : "lua"; /* `plugin` or `lua` */
    if (t->map.provider[0])
        snprintf(s->label, sizeof s->label, "plugin = \"%s:%.200s\"", provider, s->ref);
    else
        snprintf(s->label, sizeof s->label, "lua = \"%.200s\"", s->ref);
    s->ops = loom_registry_find(LOOM_REG_TRANSFORM, provider, NULL);
    if (loom_data_transform_builtin(s->ops)) s->ops = NULL; /* a built-in transform or map fn, not a provider */
    if (!s->ops || s->ops->version < 1 || !s->ops->open || (filter ? !s->ops->filter : !s->ops->map)) {
        char all[256];
        loom_err_set(err, LOOM_ECONFIG, st->where, "%s: no %s provider \"%s\" is registered (have: %s)",
                     filter ? "filter" : "map", filter ? "filter" : "map", provider, loom_data_providers(all, sizeof all));
        s->ops = NULL;
        cust_close(st);
        if (t->map.provider[0])
            return loom_err_hint(err, "a plugin's transform provider is available once its .so is in plugins/ or a "
                                      "plugins.path directory (`loom plugins` lists them)");
        return loom_err_hint(err, "this build lacks Lua support, or loom_script_register() was not called at startup");
    }
    const char *fn = strrchr(s->ref, ':'), *base = strrchr(s->ref, '/');
    snprintf(st->name, sizeof st->name, "%s(%.16s:%.20s)", filter ? "filter" : "map", provider, fn ? fn + 1 : s->ref);
    /* the state fingerprint names the file without its directory: a moved checkout still resumes */
    snprintf(st->desc, sizeof st->desc, "%s(%.16s,%.130s)", filter ? "filter" : "map", provider, base ? base + 1 : s->ref);
    loom_custom_args a = { /* the config resolved the reference's file */
        .size = sizeof a, .ref = s->ref, .base_dir = "", .where = st->where, .in = &in->spec, .in_max = in->maxshape,
        .filter = filter, .max_calls = max_calls, .seed = ctx->seed, .options = ctx->custom_options,
        .args = &s->args,
    };
    point_args(s, t);
    loom_elem_spec ospec;
    loom_shape omax[LOOM_MAX_FEATURES];
    int rc = s->ops->open(&s->inst, &a, &ospec, omax, err);
    if (rc) { /* a syntax error, a missing function, a bad first result: the config's to fix (exit 2) */
        loom_err_prefix(err, "%s %.260s (%s)", filter ? "filter" : "map", s->label, st->where);
        if (err && rc == LOOM_ELUA) rc = err->code = LOOM_ECONFIG;
        cust_close(st);
        return rc;
    }
    if (filter) {
        st->card = in->card == 0 ? 0 : -2; /* tf.data: unknown */
    } else {
        st->spec = ospec;
        memcpy(st->maxshape, omax, sizeof st->maxshape);
        if ((rc = layout(s, err)) != LOOM_OK) {
            cust_close(st);
            return rc;
        }
        s->buf = loom_alloc_aligned(s->total ? s->total : 64);
        if (!s->buf) {
            cust_close(st);
            return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate %zu bytes for %s", s->total, st->name);
        }
        dstage_gauge_(&st->st_bytes, (int64_t)s->total);
    }
    *out = st;
    return LOOM_OK;
}

int custom_map_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, const loom_data_ctx *ctx,
                     loom_err *err)
{
    /* a parallel map may run it from every pool thread and the consumer, whatever t->parallel
     * says (map_parallelization): one interpreter each, created up front */
    int threads = ctx->threads > 0 ? ctx->threads : 1;
    int calls = t->parallel > threads + 1 ? t->parallel : threads + 1;
    return cust_open(out, in, id, t, ctx, 0, calls, err);
}

int custom_filter_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, const loom_data_ctx *ctx,
                        loom_err *err)
{
    return cust_open(out, in, id, t, ctx, 1, 1, err);
}
