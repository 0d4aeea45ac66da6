/* synthetic.c - the synthetic source, for benchmarks and tests: element
 * i holds random tensors drawn from the counter-based RNG keyed by (run seed,
 * element index, feature index), so an element is a pure function of its
 * index, the same in every epoch and whatever the threads, prefetching or
 * resume point. Floats: uniform in [min, max) or normal(mean, std); integers:
 * uniform in [min, max). Cardinality = count, or -1 (infinite) for count = -1.
 * State = (epoch, index).
 * Threads: one thread at a time drives the stage (see data_internal.h). */
#include "data/data_internal.h"

#include <string.h>

#define SYN_RNG_LABEL 0x636974656874796eull /* "nythetic": the synthetic source's stream */

typedef struct syn_source {
    dstage           s;
    loom_syn_feature f[LOOM_MAX_FEATURES];
    void            *buf[LOOM_MAX_FEATURES]; /* the lent element's data */
    int64_t          numel[LOOM_MAX_FEATURES];
    uint64_t         seed;
    int64_t          count; /* -1 = infinite */
    int64_t          epoch, pos;
} syn_source;

static void fill(const syn_source *t, int f, int64_t index)
{
    const loom_syn_feature *s = &t->f[f];
    loom_rng r;
    loom_rng_init(&r, t->seed, SYN_RNG_LABEL, (uint64_t)index, (uint64_t)f);
    int64_t n = t->numel[f];
    double lo = s->min, span = s->max - s->min;
    bool normal = s->dist == LOOM_SYN_NORMAL;
    switch (s->dtype) {
    case LOOM_CFG_F32: {
        float *o = t->buf[f];
        for (int64_t i = 0; i < n; i++)
            o[i] = normal ? (float)s->mean + (float)s->std * loom_rng_normal(&r) : (float)(lo + span * loom_rng_uniform(&r));
        break;
    }
    case LOOM_CFG_F64: {
        double *o = t->buf[f];
        for (int64_t i = 0; i < n; i++)
            o[i] = normal ? s->mean + s->std * (double)loom_rng_normal(&r) : lo + span * loom_rng_uniform64(&r);
        break;
    }
    default: { /* integers in [min, max) */
        int64_t ilo = (int64_t)s->min;
        uint64_t range = (uint64_t)((int64_t)s->max - ilo);
        if (range == 0) range = 1;
        for (int64_t i = 0; i < n; i++) {
            int64_t v = ilo + (int64_t)loom_rng_below(&r, range);
            if (s->dtype == LOOM_CFG_U8) ((uint8_t *)t->buf[f])[i] = (uint8_t)v;
            else if (s->dtype == LOOM_CFG_I32) ((int32_t *)t->buf[f])[i] = (int32_t)v;
            else ((int64_t *)t->buf[f])[i] = v;
        }
    }
    }
}

static int syn_next(dstage *st, loom_elem **out, loom_err *err)
{
    (void)err;
    syn_source *t = (syn_source *)st;
    if (t->count >= 0 && t->pos >= t->count) return LOOM_EEOF;
    for (int f = 0; f < st->out.n; f++) fill(t, f, t->pos);
    t->pos++;
    *out = &st->out;
    return LOOM_OK;
}

/* An element is a pure function of its index: random access is next() without the cursor. */
static int syn_get(dstage *st, int64_t index, loom_elem **out, loom_err *err)
{
    (void)err;
    syn_source *t = (syn_source *)st;
    LOOM_ASSERT(index >= 0 && t->count >= 0 && index < t->count);
    for (int f = 0; f < st->out.n; f++) fill(t, f, index);
    *out = &st->out;
    return LOOM_OK;
}

static int syn_rewind(dstage *st, int64_t epoch, loom_err *err)
{
    syn_source *t = (syn_source *)st;
    return dcursor_rewind_(st, &t->epoch, &t->pos, epoch, err);
}

static void syn_save(dstage *st, loom_buf *b)
{
    syn_source *t = (syn_source *)st;
    dcursor_save_(b, t->epoch, t->pos);
}

static int syn_restore(dstage *st, loom_buf *b, loom_err *err)
{
    syn_source *t = (syn_source *)st;
    int64_t epoch, pos;
    if (!dcursor_load_(b, &epoch, &pos) || epoch < 0 || pos < 0 || (t->count >= 0 && pos > t->count))
        return loom_err_set(err, LOOM_ECHECKPOINT, NULL,
                            "iterator state is corrupt: synthetic position %lld out of range (count %lld)",
                            (long long)pos, (long long)t->count);
    t->epoch = epoch;
    t->pos = pos;
    return LOOM_OK;
}

static void syn_close(dstage *st)
{
    syn_source *t = (syn_source *)st;
    for (int f = 0; f < LOOM_MAX_FEATURES; f++) loom_free(t->buf[f]);
    loom_free(t);
}

static const dstage_ops syn_ops = {
    .next = syn_next, .rewind = syn_rewind, .save = syn_save, .restore = syn_restore, .close = syn_close,
    .get = syn_get,
};

int synthetic_source_open_(dstage **out, const loom_source_spec *src, const loom_data_ctx *ctx, loom_err *err)
{
    static const loom_dtype tdt[] = {[LOOM_CFG_U8] = LOOM_U8, [LOOM_CFG_I32] = LOOM_I32, [LOOM_CFG_I64] = LOOM_I64,
                                     [LOOM_CFG_F32] = LOOM_F32, [LOOM_CFG_F64] = LOOM_F64};
    *out = NULL;
    syn_source *t = loom_calloc(1, sizeof *t);
    if (!t) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the synthetic source");
    dstage *st = &t->s;
    dstage_init_(st, &syn_ops, NULL, 0, &src->loc);
    snprintf(st->name, sizeof st->name, "synthetic");
    t->seed = ctx ? ctx->seed : 42;
    t->count = src->count;
    int rc = LOOM_OK, nf = src->n_features;
    if (nf < 1 || nf > LOOM_MAX_FEATURES || t->count < -1) {
        rc = dstage_err_(st, err, LOOM_ECONFIG, "synthetic source needs 1 to %d features and count >= -1, got %d and %lld",
                         LOOM_MAX_FEATURES, nf, (long long)t->count);
        goto fail;
    }
    uint64_t h = 0xcbf29ce484222325ull;
    st->spec.n = st->out.n = nf;
    for (int f = 0; f < nf; f++) {
        const loom_syn_feature *c = &src->syn[f];
        bool integer = c->dtype == LOOM_CFG_U8 || c->dtype == LOOM_CFG_I32 || c->dtype == LOOM_CFG_I64;
        if ((unsigned)c->dtype > LOOM_CFG_F64 || c->rank < 0 || c->rank > LOOM_MAX_RANK ||
            (integer && (c->dist != LOOM_SYN_UNIFORM || !(c->max > c->min)))) {
            rc = dstage_err_(st, err, LOOM_ECONFIG, "feature \"%s\": bad dtype %d, rank %d or range [%g, %g)",
                             src->feature[f], (int)c->dtype, c->rank, c->min, c->max);
            goto fail;
        }
        for (int g = 0; g < f; g++)
            if (!strcmp(src->feature[g], src->feature[f])) {
                rc = dstage_err_(st, err, LOOM_ECONFIG, "feature \"%s\" is declared twice", src->feature[f]);
                goto fail;
            }
        t->f[f] = *c;
        snprintf(st->spec.name[f], LOOM_NAME_MAX, "%s", src->feature[f]);
        st->spec.dtype[f] = tdt[c->dtype];
        st->spec.shape[f] = loom_shape_make(c->rank, c->shape);
        st->maxshape[f] = st->spec.shape[f];
        t->numel[f] = loom_shape_numel(&st->spec.shape[f]);
        size_t bytes = (size_t)t->numel[f] * loom_dtype_size(st->spec.dtype[f]);
        if (!(t->buf[f] = loom_alloc_aligned(bytes ? bytes : 1))) {
            rc = loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate %zu bytes for feature \"%s\"", bytes,
                              src->feature[f]);
            goto fail;
        }
        st->out.t[f] = (loom_tensor){.dtype = st->spec.dtype[f], .shape = st->spec.shape[f], .data = t->buf[f]};
        st->mut[f] = 1; /* refilled by every next() */
        for (const char *p = src->feature[f]; *p; p++) h = (h ^ (uint8_t)*p) * 0x100000001b3ull;
        double params[6] = {(double)c->dtype, (double)c->dist, c->min, c->max, c->mean, c->std};
        const uint8_t *b = (const uint8_t *)params;
        for (size_t i = 0; i < sizeof params; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    }
    st->card = t->count;
    snprintf(st->desc, sizeof st->desc, "synthetic(%lld,seed %llu,%016llx)", (long long)t->count,
             (unsigned long long)t->seed, (unsigned long long)h);
    *out = st;
    return LOOM_OK;
fail:
    syn_close(st);
    return rc;
}
