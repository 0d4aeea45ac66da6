/* plugin.c - a source stage whose elements come from a provider in
 * the registry (LOOM_REG_SOURCE, custom.h): a plugin's source selected by
 * source.type with source.options. The stage lends the provider buffers of
 * the max shapes for each element (or the provider points at its own
 * memory, then the element is read-only downstream); the provider's state
 * is saved as opaque bytes.
 * Threads: one thread at a time drives the stage (see data_internal.h). */
#include "data/data_internal.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

typedef struct plug_source {
    dstage                 s;
    const loom_source_ops *ops;
    void                  *inst;
    uint8_t               *buf[LOOM_MAX_FEATURES]; /* the lent buffers, max shapes */
    loom_options           opts;
    char                   optw[LOOM_MAX_OPTIONS][LOOM_PATH_MAX + 48];
    int                    on_nonfinite; /* loom_on_nonfinite */
    int64_t                elem;         /* elements the provider returned this pass (dropped ones included),
                                            counted from the pass's start, across a save/restore */
    bool                   elem_known;   /* false after restoring a state that did not record elem */
    int64_t                dropped;      /* ... dropped for a NaN or infinite value (on_nonfinite = skip) */
} plug_source;

/* Logs the pass's dropped elements once, and starts a new count. */
static void report_dropped(plug_source *p)
{
    if (p->dropped)
        loom_warn("%s: source \"%s\": %lld element%s with a NaN or infinite value skipped (on_nonfinite = skip)",
                  p->s.where, p->ops->name, (long long)p->dropped, p->dropped == 1 ? "" : "s");
    p->dropped = 0;
}

/* The first NaN or infinite value of a float feature of the element: its feature (offset in *at, value in *v), or -1. */
static int first_nonfinite(const dstage *st, int64_t *at, double *v)
{
    for (int f = 0; f < st->out.n; f++) {
        const loom_tensor *t = &st->out.t[f];
        if (t->dtype != LOOM_F32 && t->dtype != LOOM_F64) continue;
        int64_t n = loom_shape_numel(&t->shape);
        if (t->dtype == LOOM_F32) {
            const uint32_t *u = t->data;
            uint32_t bad = 0;
            for (int64_t i = 0; i < n; i++) bad |= (u[i] & 0x7f800000u) == 0x7f800000u; /* exponent all ones */
            if (!bad) continue;
        }
        for (int64_t i = 0; i < n; i++) {
            double x = t->dtype == LOOM_F32 ? (double)((const float *)t->data)[i] : ((const double *)t->data)[i];
            if (!isfinite(x)) {
                *at = i;
                *v = x;
                return f;
            }
        }
    }
    return -1;
}

static int ps_next(dstage *st, loom_elem **out, loom_err *err)
{
    plug_source *p = (plug_source *)st;
again:
    for (int f = 0; f < st->out.n; f++) {
        st->out.t[f] = (loom_tensor){.dtype = st->spec.dtype[f], .shape = st->maxshape[f], .data = p->buf[f]};
    }
    int rc = p->ops->next(p->inst, &st->out, err);
    if (rc == LOOM_EEOF) {
        report_dropped(p);
        return rc;
    }
    if (rc) {
        if (err) loom_err_prefix(err, "source \"%s\" (%s)", p->ops->name, st->where);
        return rc;
    }
    for (int f = 0; f < st->out.n; f++) {
        loom_tensor *t = &st->out.t[f];
        st->mut[f] = t->data == p->buf[f]; /* the provider's own memory is read-only */
        if (t->dtype != st->spec.dtype[f] || t->shape.rank != st->spec.shape[f].rank || !t->data)
            return dstage_err_(st, err, LOOM_EDATA, "source \"%s\" returned feature \"%s\" with another dtype or rank "
                               "than it declared", p->ops->name, st->spec.name[f]);
        for (int d = 0; d < t->shape.rank; d++)
            if (t->shape.dim[d] < 0 || t->shape.dim[d] > st->maxshape[f].dim[d])
                return dstage_err_(st, err, LOOM_EDATA, "source \"%s\" returned feature \"%s\" larger than its max "
                                   "shape", p->ops->name, st->spec.name[f]);
    }
    int64_t at;
    double v;
    int bad = first_nonfinite(st, &at, &v);
    p->elem++;
    if (bad >= 0) {
        if (p->on_nonfinite == LOOM_NONFINITE_SKIP) {
            p->dropped++;
            goto again;
        }
        if (p->elem_known)
            dstage_err_(st, err, LOOM_EDATA, "source \"%s\": element %lld of the pass (0-based, in the source's order), "
                        "feature \"%s\": non-finite value %g at offset %lld", p->ops->name, (long long)(p->elem - 1),
                        st->spec.name[bad], v, (long long)at);
        else /* resumed from a checkpoint written before the state held the count */
            dstage_err_(st, err, LOOM_EDATA, "source \"%s\": element %lld after the resume point (0-based; the checkpoint "
                        "does not record the pass's position), feature \"%s\": non-finite value %g at offset %lld",
                        p->ops->name, (long long)(p->elem - 1), st->spec.name[bad], v, (long long)at);
        return loom_err_hint(err, "fix the source, or set on_nonfinite = \"skip\"; in the dataset's group "
                                  "(data.train / data.eval) to drop such elements");
    }
    *out = &st->out;
    return LOOM_OK;
}

static int ps_rewind(dstage *st, int64_t epoch, loom_err *err)
{
    plug_source *p = (plug_source *)st;
    report_dropped(p);
    p->elem = 0;
    p->elem_known = true;
    int rc = p->ops->rewind(p->inst, epoch, err);
    if (rc && err) loom_err_prefix(err, "source \"%s\" (%s)", p->ops->name, st->where);
    return rc;
}

/* The state: u64 size of the provider's bytes, with STATE_ELEM set when the
 * pass's element count follows as an i64 (a state without it, from an older
 * build, restores with the count unknown), then the provider's bytes. */
#define STATE_ELEM (1ull << 63)

static void ps_save(dstage *st, loom_buf *b)
{
    plug_source *p = (plug_source *)st;
    uint8_t small[256], *big = NULL, *s = small;
    size_t n = p->ops->save(p->inst, small, sizeof small);
    if (n > sizeof small && (big = loom_alloc(n)) != NULL) n = p->ops->save(p->inst, s = big, n);
    if (n > sizeof small && !big) n = 0; /* out of memory: the restore will say the state is truncated */
    loom_buf_put_u64(b, n | (p->elem_known ? STATE_ELEM : 0));
    if (p->elem_known) loom_buf_put_i64(b, p->elem);
    loom_buf_put(b, s, n);
    loom_free(big);
}

static int ps_restore(dstage *st, loom_buf *b, loom_err *err)
{
    plug_source *p = (plug_source *)st;
    uint64_t n = loom_buf_get_u64(b);
    bool known = (n & STATE_ELEM) != 0;
    int64_t elem = known ? loom_buf_get_i64(b) : 0;
    n &= ~STATE_ELEM;
    if (b->failed || n == 0 || n > (1u << 20) || elem < 0)
        return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "iterator state is truncated (%s)", st->name);
    uint8_t *s = loom_alloc(n);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate %llu bytes of source state", (unsigned long long)n);
    int rc = loom_buf_get(b, s, n) ? loom_err_set(err, LOOM_ECHECKPOINT, NULL, "iterator state is truncated (%s)", st->name)
                                   : p->ops->restore(p->inst, s, n, err);
    loom_free(s);
    if (!rc) p->elem = elem, p->elem_known = known;
    return rc;
}

static void ps_close(dstage *st)
{
    plug_source *p = (plug_source *)st;
    if (p->inst) p->ops->close(p->inst);
    for (int f = 0; f < LOOM_MAX_FEATURES; f++) loom_free(p->buf[f]);
    loom_free(p);
}

static const dstage_ops plug_ops = {
    .next = ps_next, .rewind = ps_rewind, .save = ps_save, .restore = ps_restore, .close = ps_close,
};

/* Points p->opts at src's options and checks their keys against what the provider accepts. */
static int check_options(plug_source *p, const loom_source_spec *src, loom_err *err)
{
    const loom_plugin_opts *o = &src->plugin.options;
    p->opts.n = o->n < LOOM_MAX_OPTIONS ? o->n : LOOM_MAX_OPTIONS;
    for (int i = 0; i < p->opts.n; i++) {
        if (o->line[i] > 0)
            snprintf(p->optw[i], sizeof p->optw[i], "%s:%d", src->loc.file, o->line[i]);
        else
            snprintf(p->optw[i], sizeof p->optw[i], "--set ...source.options.%s", o->key[i]);
        p->opts.key[i] = o->key[i];
        p->opts.value[i] = o->value[i];
        p->opts.where[i] = p->optw[i];
        const char *const *valid = p->ops->options, *near = NULL;
        bool ok = false;
        char list[512] = "none";
        size_t k = 0;
        int bd = 3;
        for (int j = 0; valid && valid[j] && !ok; j++) {
            ok = !strcmp(valid[j], o->key[i]) || !strcmp(valid[j], "*");
            int w = snprintf(list + k, k < sizeof list ? sizeof list - k : 0, "%s%s", j ? ", " : "", valid[j]);
            if (w > 0) k += (size_t)w;
            int d = loom_edit_distance(o->key[i], valid[j]);
            if (d < bd && d < (int)strlen(o->key[i])) bd = d, near = valid[j];
        }
        if (ok) continue;
        loom_err_set(err, LOOM_ECONFIG, p->optw[i], "source.options.%s: unknown option of source \"%s\" (valid: %s)",
                     o->key[i], p->ops->name, list);
        return near ? loom_err_hint(err, "did you mean `%s`?", near) : LOOM_ECONFIG;
    }
    return LOOM_OK;
}

/* The buffers lent to next(), and the state fingerprint. */
static int setup(plug_source *p, const loom_source_spec *src, loom_err *err)
{
    dstage *st = &p->s;
    uint64_t h = 0xcbf29ce484222325ull;
    for (int i = 0; i < src->plugin.options.n; i++) {
        for (const char *c = src->plugin.options.key[i]; *c; c++) h = (h ^ (uint8_t)*c) * 0x100000001b3ull;
        for (const char *c = src->plugin.options.value[i]; *c; c++) h = (h ^ (uint8_t)*c) * 0x100000001b3ull;
    }
    snprintf(st->desc, sizeof st->desc, "%.40s(%016llx)", p->ops->name, (unsigned long long)h);
    if (st->spec.n < 1 || st->spec.n > LOOM_MAX_FEATURES)
        return dstage_err_(st, err, LOOM_EPLUGIN, "source \"%s\" declared %d features (1 to %d)", p->ops->name,
                           st->spec.n, LOOM_MAX_FEATURES);
    st->out.n = st->spec.n;
    for (int f = 0; f < st->spec.n; f++) {
        const loom_shape *mx = &st->maxshape[f];
        int64_t n, nb;
        if ((unsigned)st->spec.dtype[f] >= LOOM_NDTYPES_ || mx->rank < 0 || mx->rank > LOOM_MAX_RANK ||
            mx->rank != st->spec.shape[f].rank || !loom_dims_ok(mx->dim, mx->rank, &n))
            return dstage_err_(st, err, LOOM_EPLUGIN, "source \"%s\": feature \"%s\" has a bad dtype or max shape",
                               p->ops->name, st->spec.name[f]);
        /* the plugin's max shape sizes the buffer it writes into: a wrapped product would be an overrun */
        if (!loom_mul_ok(n, (int64_t)loom_dtype_size(st->spec.dtype[f]), &nb) || nb > loom_phys_bytes())
            return dstage_err_(st, err, LOOM_EPLUGIN, "source \"%s\": feature \"%s\": a max shape of %lld values "
                               "of %s is too large for memory", p->ops->name, st->spec.name[f], (long long)n,
                               loom_dtype_name(st->spec.dtype[f]));
        size_t bytes = (size_t)nb;
        if (!(p->buf[f] = loom_alloc_aligned(bytes ? bytes : 1)))
            return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate %zu bytes for feature \"%s\"", bytes,
                                st->spec.name[f]);
        dstage_gauge_(&st->st_bytes, dstage_load_(&st->st_bytes) + (int64_t)bytes);
    }
    st->card = p->ops->cardinality(p->inst);
    if (st->card < -2) st->card = -2;
    return LOOM_OK;
}

int plugin_source_open_(dstage **out, const loom_source_spec *src, const loom_data_ctx *ctx, loom_err *err)
{
    *out = NULL;
    plug_source *p = loom_calloc(1, sizeof *p);
    if (!p) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a plugin source");
    dstage *st = &p->s;
    dstage_init_(st, &plug_ops, NULL, 0, &src->loc);
    snprintf(st->name, sizeof st->name, "%.47s", src->plugin.name);
    p->on_nonfinite = src->on_nonfinite;
    p->elem_known = true;
    p->ops = loom_registry_find(LOOM_REG_SOURCE, src->plugin.name, NULL);
    if (!p->ops) {
        char all[256];
        loom_err_set(err, LOOM_ECONFIG, st->where, "source.type: no source \"%s\" is registered (have: %s)",
                     src->plugin.name, loom_registry_names(LOOM_REG_SOURCE, all, sizeof all));
        ps_close(st);
        return loom_err_hint(err, "a plugin's source is available once its .so is in plugins/ or a plugins.path "
                                  "directory (`loom plugins` lists them)");
    }
    int rc = check_options(p, src, err);
    if (rc) {
        ps_close(st);
        return rc;
    }
    char dir[LOOM_PATH_MAX];
    const char *slash = strrchr(src->loc.file, '/');
    snprintf(dir, sizeof dir, "%.*s", slash ? (int)(slash - src->loc.file) : 1, slash ? src->loc.file : ".");
    loom_source_args a = {.size = sizeof a, .type = src->plugin.name, .base_dir = dir, .where = st->where,
                          .options = &p->opts, .seed = ctx ? ctx->seed : 42};
    if ((rc = p->ops->open(&p->inst, &a, &st->spec, st->maxshape, err)) != LOOM_OK) {
        if (err && !err->where[0]) snprintf(err->where, sizeof err->where, "%.255s", st->where);
        if (err) loom_err_prefix(err, "source \"%s\"", src->plugin.name);
        ps_close(st);
        return rc;
    }
    if ((rc = setup(p, src, err)) != LOOM_OK) {
        ps_close(st);
        return rc;
    }
    *out = st;
    return LOOM_OK;
}
