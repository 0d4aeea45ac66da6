/* synthetic.c - the synthetic source, for benchmarks and tests: element
 * i holds random tensors drawn from the counter-based RNG keyed by (run seed,
 * element index, feature index), so an element is a pure function of its
 * index, the same in every epoch and whatever the threads, prefetching or
 * resume point. Floats: uniform in [min, max) or normal(mean, std); integers:
 * uniform in [min, max). Cardinality = count, or -1 (infinite) for count = -1.
 * State = (epoch, index).
 * ctr = { ... } (config.h loom_syn_ctr) adds three features before the
 * declared ones: "ids" int64 (columns[, k]), "label" float32 () and "prob"
 * float32 (), the true click probability the label was drawn with, so tests
 * can compare a model with the best possible one (its AUC, its log loss).
 * Threads: one thread at a time drives the stage (see data_internal.h). */
#include "data/data_internal.h"

#include <math.h>
#include <string.h>

#define SYN_RNG_LABEL 0x636974656874796eull /* "nythetic": the synthetic source's stream */
#define SYN_CTR_LABEL 0x7274632d6e7973ull     /* "syn-ctr": the ctr examples */
#define SYN_CTR_WEIGHT 0x746867696577ull      /* "weight": the true model's weights */
#define SYN_CTR_HASH 0x68736168ull            /* "hash": column values into ids */

typedef struct syn_source {
    dstage           s;
    loom_syn_feature f[LOOM_MAX_FEATURES];
    void            *buf[LOOM_MAX_FEATURES]; /* the lent element's data */
    int64_t          numel[LOOM_MAX_FEATURES];
    uint64_t         seed;
    int64_t          count; /* -1 = infinite */
    loom_syn_ctr     ctr;
    int              nctr;  /* features the ctr mode adds first: 3, or 0 */
    int64_t          epoch, pos;
} syn_source;

static void fill(const syn_source *t, int f, int64_t index)
{
    const loom_syn_feature *s = &t->f[f];
    loom_rng r;
    /* the declared features keep their streams (index f among them) whether or not ctr comes first */
    loom_rng_init(&r, t->seed, SYN_RNG_LABEL, (uint64_t)index, (uint64_t)(f - t->nctr));
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

/* A value of [0, vocab) with P(v) about proportional to (v + 1)^-s: the
 * bounded continuous power law's inverse CDF, floored (s = 0: uniform). */
static int64_t zipf_value(loom_rng *r, int64_t vocab, double s)
{
    double u = loom_rng_uniform64(r), n1 = (double)vocab + 1.0, x;
    if (s == 0) return (int64_t)(u * (double)vocab);
    if (fabs(s - 1.0) < 1e-9) x = pow(n1, u);
    else x = pow((pow(n1, 1.0 - s) - 1.0) * u + 1.0, 1.0 / (1.0 - s));
    int64_t v = (int64_t)x - 1;
    return v < 0 ? 0 : v >= vocab ? vocab - 1 : v;
}

/* The ctr features of element index into buffers 0 (ids), 1 (label), 2 (prob). */
static void fill_ctr(const syn_source *t, int64_t index)
{
    const loom_syn_ctr *k = &t->ctr;
    loom_rng r;
    loom_rng_init(&r, t->seed, SYN_CTR_LABEL, (uint64_t)(index + k->offset), 0);
    int64_t *ids = t->buf[0];
    double logit = k->bias;
    for (int c = 0; c < k->columns; c++) {
        double wsum = 0;
        for (int j = 0; j < k->ids_per_column; j++) {
            int64_t v = zipf_value(&r, k->vocab, k->zipf);
            /* feature hashing: (column, value) -> id, the same for every seed */
            uint64_t h = loom_rng_mix(loom_rng_mix(SYN_CTR_HASH, (uint64_t)c), (uint64_t)v);
            ids[(int64_t)c * k->ids_per_column + j] = (int64_t)(h % (uint64_t)k->id_space);
            loom_rng w;
            loom_rng_init(&w, t->seed, SYN_CTR_WEIGHT, (uint64_t)c, (uint64_t)v);
            wsum += k->weight_std * (double)loom_rng_normal(&w);
        }
        logit += wsum / k->ids_per_column;
    }
    double p = 1.0 / (1.0 + exp(-logit));
    ((float *)t->buf[1])[0] = loom_rng_uniform64(&r) < p ? 1.f : 0.f;
    ((float *)t->buf[2])[0] = (float)p;
}

static void fill_all(const syn_source *t, int n, int64_t index)
{
    if (t->nctr) fill_ctr(t, index);
    for (int f = t->nctr; f < n; f++) fill(t, f, index);
}

static int syn_next(dstage *st, loom_elem **out, loom_err *err)
{
    (void)err;
    syn_source *t = (syn_source *)st;
    if (t->count >= 0 && t->pos >= t->count) return LOOM_EEOF;
    fill_all(t, st->out.n, t->pos);
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
    fill_all(t, st->out.n, index);
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
    t->seed = !ctx ? 42 : ctx->source_seed_set ? ctx->source_seed : ctx->seed;
    t->count = src->synthetic.count;
    t->ctr = src->synthetic.ctr;
    t->nctr = src->synthetic.ctr.on ? 3 : 0;
    int rc = LOOM_OK, nf = src->n_features + t->nctr;
    const loom_syn_ctr *k = &src->synthetic.ctr;
    if (nf < 1 || nf > LOOM_MAX_FEATURES || t->count < -1) {
        rc = dstage_err_(st, err, LOOM_ECONFIG, "synthetic source needs 1 to %d features and count >= -1, got %d and %lld",
                         LOOM_MAX_FEATURES, nf, (long long)t->count);
        goto fail;
    }
    if (t->nctr && (k->columns < 1 || k->ids_per_column < 1 || k->id_space < 1 || k->vocab < 1)) {
        rc = dstage_err_(st, err, LOOM_ECONFIG, "synthetic ctr: columns, ids_per_column, id_space and vocab must be >= 1");
        goto fail;
    }
    uint64_t h = 0xcbf29ce484222325ull;
    st->spec.n = st->out.n = nf;
    static const char *const ctr_names[] = {"ids", "label", "prob"};
    for (int f = 0; f < t->nctr; f++) {
        snprintf(st->spec.name[f], LOOM_NAME_MAX, "%s", ctr_names[f]);
        int64_t dims[2] = {k->columns, k->ids_per_column};
        st->spec.dtype[f] = f == 0 ? LOOM_I64 : LOOM_F32;
        st->spec.shape[f] = f == 0 ? loom_shape_make(k->ids_per_column > 1 ? 2 : 1, dims) : loom_shape_make(0, dims);
        st->maxshape[f] = st->spec.shape[f];
        t->numel[f] = loom_shape_numel(&st->spec.shape[f]);
        size_t bytes = (size_t)t->numel[f] * loom_dtype_size(st->spec.dtype[f]);
        if (!(t->buf[f] = loom_alloc_aligned(bytes))) {
            rc = loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate %zu bytes for feature \"%s\"", bytes, ctr_names[f]);
            goto fail;
        }
        st->out.t[f] = (loom_tensor){.dtype = st->spec.dtype[f], .shape = st->spec.shape[f], .data = t->buf[f]};
        st->mut[f] = 1;
    }
    if (t->nctr) {
        double params[8] = {k->columns, k->ids_per_column, (double)k->id_space, (double)k->vocab, k->zipf,
                            k->weight_std, k->bias, (double)k->offset};
        const uint8_t *b = (const uint8_t *)params;
        for (size_t i = 0; i < sizeof params; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    }
    for (int f = t->nctr; f < nf; f++) {
        const loom_syn_feature *c = &src->synthetic.features[f - t->nctr];
        bool integer = c->dtype == LOOM_CFG_U8 || c->dtype == LOOM_CFG_I32 || c->dtype == LOOM_CFG_I64;
        if ((unsigned)c->dtype > LOOM_CFG_F64 || c->rank < 0 || c->rank > LOOM_MAX_RANK ||
            (integer && (c->dist != LOOM_SYN_UNIFORM || !(c->max > c->min)))) {
            rc = dstage_err_(st, err, LOOM_ECONFIG, "feature \"%s\": bad dtype %d, rank %d or range [%g, %g)",
                             src->feature[f - t->nctr], (int)c->dtype, c->rank, c->min, c->max);
            goto fail;
        }
        for (int g = 0; g < f; g++)
            if (!strcmp(st->spec.name[g], src->feature[f - t->nctr])) {
                rc = dstage_err_(st, err, LOOM_ECONFIG, "feature \"%s\" is declared twice", src->feature[f - t->nctr]);
                goto fail;
            }
        t->f[f] = *c; /* indexed as the element's features */
        snprintf(st->spec.name[f], LOOM_NAME_MAX, "%s", src->feature[f - t->nctr]);
        st->spec.dtype[f] = tdt[c->dtype];
        st->spec.shape[f] = loom_shape_make(c->rank, c->shape);
        st->maxshape[f] = st->spec.shape[f];
        t->numel[f] = loom_shape_numel(&st->spec.shape[f]);
        size_t bytes = (size_t)t->numel[f] * loom_dtype_size(st->spec.dtype[f]);
        if (!(t->buf[f] = loom_alloc_aligned(bytes ? bytes : 1))) {
            rc = loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate %zu bytes for feature \"%s\"", bytes,
                              src->feature[f - t->nctr]);
            goto fail;
        }
        st->out.t[f] = (loom_tensor){.dtype = st->spec.dtype[f], .shape = st->spec.shape[f], .data = t->buf[f]};
        st->mut[f] = 1; /* refilled by every next() */
        for (const char *p = src->feature[f - t->nctr]; *p; p++) h = (h ^ (uint8_t)*p) * 0x100000001b3ull;
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
