/* optimize.c - tf.data's static rewrites (tf_semantics 4.9) for
 * data.options.optimization: the plan (which transforms become which stage)
 * and the fused stages it needs. Every rewrite yields exactly the elements of
 * the plain pipeline, bit for bit: each fused map keeps its own stage id, and
 * so its own RNG stream, and the fused shuffle+repeat draws with the RNG of
 * each pass as the plain shuffle does. Threads: as any stage (one consumer). */
#include "data/data_internal.h"

#include <stdio.h>
#include <string.h>

/* ---- the plan ------------------------------------------------------------------ */

/* Whether t is the identity (take(-1), skip(0), ...): its entry says. An
 * unknown type is no no-op here: opening it reports it. */
static int is_noop(const loom_transform_spec *t)
{
    loom_err err = {0};
    const dxform *x = dxform_find_(t, "", &err);
    return x && x->noop && x->noop(t);
}

/* A map's parallelism under map_parallelization (sequential -> "auto"). */
static int eff_parallel(const loom_transform_spec *t, const loom_data_options *o)
{
    if (t->kind == LOOM_T_MAP && t->map.kind == LOOM_MAP_TOKENIZE) return 1; /* its own stage (text.c) */
    int p = t->parallel > 1 || t->parallel == LOOM_PARALLEL_AUTO ? t->parallel : 1;
    return p == 1 && o->map_parallelization && o->autotune ? LOOM_PARALLEL_AUTO : p;
}

static void add_step(dplan *p, dplan_kind kind, int first, int n, int parallel)
{
    p->step[p->n++] = (dplan_step){.kind = kind, .first = first, .n = n, .parallel = parallel};
}

/* A map that runs as a stage of its own: a Lua map (whole element, own interpreters), tokenize. */
static bool solo(const loom_transform_spec *t) { return t->map.kind == LOOM_MAP_LUA || t->map.kind == LOOM_MAP_TOKENIZE; }

void dplan_make_(dplan *p, const loom_dataset_spec *spec, const loom_data_options *o, int threads, int barrier)
{
    memset(p, 0, sizeof *p);
    const loom_transform_spec *t = spec->transform;
    int n = spec->n_transforms;
    for (int i = 0; i < n;) {
        if (o->noop_elimination && is_noop(&t[i])) {
            i++;
            continue;
        }
        if (t[i].kind == LOOM_T_MAP) {
            int par = eff_parallel(&t[i], o), j = i + 1;
            /* fuse a run of adjacent maps that run alike (ids stay consecutive) */
            /* a Lua map (whole element, own interpreters) runs alone */
            while (o->map_fusion && j < n && j != barrier && t[j].kind == LOOM_T_MAP && eff_parallel(&t[j], o) == par &&
                   !solo(&t[i]) && !solo(&t[j]) &&
                   (par == 1 || t[j].deterministic == t[i].deterministic))
                j++;
            if (o->map_and_batch_fusion && j < n && j != barrier && t[j].kind == LOOM_T_BATCH && !solo(&t[i])) {
                add_step(p, DPLAN_MAP_BATCH, i, j - i + 1, par);
                i = j + 1;
            } else {
                /* with map_fusion even a single map runs as a chain: it can write into a prefetch's slot */
                int chain = j - i > 1 || par != 1 || (o->map_fusion && !solo(&t[i]));
                add_step(p, chain ? DPLAN_MAPS : DPLAN_ONE, i, j - i, par);
                i = j;
            }
            continue;
        }
        if (o->shuffle_and_repeat_fusion && t[i].kind == LOOM_T_SHUFFLE && i + 1 < n && i + 1 != barrier &&
            t[i + 1].kind == LOOM_T_REPEAT) {
            add_step(p, DPLAN_SHUFFLE_REPEAT, i, 2, 1);
            i += 2;
            continue;
        }
        add_step(p, DPLAN_ONE, i, 1, 1);
        i++;
    }
    const dplan_step *last = p->n ? &p->step[p->n - 1] : NULL;
    int ends_in_prefetch = last && last->kind == DPLAN_ONE && t[last->first].kind == LOOM_T_PREFETCH &&
                           t[last->first].buffer != 0;
    if (o->inject_prefetch && threads > 0 && !ends_in_prefetch && p->n < LOOM_MAX_TRANSFORMS + 1) {
        loom_transform_spec *q = &p->injected;
        memset(q, 0, sizeof *q);
        q->kind = LOOM_T_PREFETCH;
        q->buffer = -1;
        snprintf(q->loc.file, sizeof q->loc.file, "%s", spec->loc.file);
        q->loc.line = spec->loc.line;
        snprintf(q->loc.path, sizeof q->loc.path, "data.options.optimization.inject_prefetch");
        add_step(p, DPLAN_ONE, -1, 1, 1);
    }
}

void dmaps_name_(char *out, size_t n, dstage *const *map, int nmap, const char *suffix)
{
    char kinds[256];
    size_t k = 0;
    kinds[0] = 0;
    for (int i = 0; i < nmap && k < sizeof kinds; i++) { /* a map's name is "map(<fn>)" */
        const char *kind = map[i]->name;
        int len = (int)strlen(kind);
        if (!strncmp(kind, "map(", 4) && len > 5) kind += 4, len -= 5;
        k += (size_t)snprintf(kinds + k, sizeof kinds - k, "%s%.*s", i ? "+" : "", len, kind);
    }
    size_t room = n > strlen(suffix) + 8 ? n - strlen(suffix) - 8 : 0; /* "map(" ")" and ".." */
    if (strlen(kinds) > room) snprintf(out, n, "map(%.*s..)%s", (int)room, kinds, suffix);
    else snprintf(out, n, "map(%s)%s", kinds, suffix);
}

/* ---- sequential fused maps ---------------------------------------------------------
 * The maps of a chain are opened on each other (map k's input is map k-1) for
 * their specs and buffers, but are never pulled: the chain pulls the real
 * input once and applies them in turn, each with its own id. */

typedef struct chainst {
    dstage  s;
    int64_t epoch, pos;   /* RNG position, shared: every map of a chain sees the same elements */
    int     nmap;
    dstage *map[LOOM_MAX_TRANSFORMS];
    uint8_t norm_flip[LOOM_MAX_TRANSFORMS]; /* map k and k + 1 run as one pass (map_norm_flip_) */
    uint8_t pad_crop[LOOM_MAX_TRANSFORMS];  /* maps k.. run as one pass (map_pad_crop_len_), 0: none */
    int     fused;   /* map[0] is a scale fused into the gathering batch the chain reads (map_fuse_into_batch_) */
} chainst;
DCURSOR_STAGE_CHECK(chainst);

static void chain_close(dstage *st)
{
    chainst *s = (chainst *)st;
    for (int k = s->nmap - 1; k >= 0; k--) s->map[k]->ops->close(s->map[k]);
    loom_free(s);
}

/* Opens maps t[0..n-1] on in into s (fills name and desc as "a+b+c");
 * fuse: a scale first, on a gathering batch, may run in its row copies
 * (a chain that pulls its input through chain_pull_fused). */
static int open_chain(chainst *s, dstage *in, int id, const loom_transform_spec *t, int n, const loom_data_ctx *ctx,
                      bool fuse, loom_err *err)
{
    for (int k = 0; k < n; k++) {
        int rc = map_open_(&s->map[k], k ? s->map[k - 1] : in, id + k, &t[k], ctx, err);
        if (rc) return rc;
        s->nmap++;
        __atomic_fetch_add(&s->s.st_bytes, dstage_load_(&s->map[k]->st_bytes), __ATOMIC_RELAXED);
    }
    for (int k = 0; k + 1 < n; k++) s->norm_flip[k] = map_norm_flip_ok_(s->map[k], s->map[k + 1]);
    for (int k = 0; k < n; k++) s->pad_crop[k] = (uint8_t)map_pad_crop_len_(s->map + k, n - k);
    dstage *st = &s->s;
    s->fused = fuse && map_fuse_into_batch_(s->map[0]);
    size_t b = 0;
    for (int k = 0; k < n && b < sizeof st->desc; k++)
        b += (size_t)snprintf(st->desc + b, sizeof st->desc - b, "%s%s", k ? "+" : "", s->map[k]->desc);
    dmaps_name_(st->name, sizeof st->name, s->map, n, "");
    return LOOM_OK;
}

/* Whether no map of s after map k maps feature f. */
static bool last_of(const chainst *s, int k, int f)
{
    for (int j = k + 1; j < s->nmap; j++)
        if (map_feature_(s->map[j]) == f) return false;
    return true;
}

/* Applies maps k0.. of the chain to e; the last map of feature f writes into dst[f] when given (else its own buffer). */
static int apply_chain(chainst *s, loom_elem *e, uint8_t *mut, uint8_t *const *dst, int k0, loom_err *err)
{
    for (int k = k0; k < s->nmap; k++) {
        int f = map_feature_(s->map[k]), last = 1, m, rc;
        int pair = s->norm_flip[k]; /* maps k and k + 1 at once: k + 1 is the one that may write into dst */
        int pc = s->pad_crop[k];     /* pad, random_crop (and a flip) at once */
        for (int j = k + (pc ? pc : 1 + pair); j < s->nmap; j++) last &= map_feature_(s->map[j]) != f;
        int into = dst && last;
        if (pc) {
            rc = map_pad_crop_(s->map + k, pc, e, into ? dst[f] : NULL, s->epoch, s->pos, &m, err);
            k += pc - 1;
        } else if (pair) {
            rc = map_norm_flip_(s->map[k], s->map[k + 1], e, mut[f], into ? dst[f] : NULL, s->epoch, s->pos, &m, err);
            k++;
        } else {
            uint8_t *buf, *flags;
            map_buffers_(s->map[k], &buf, &flags);
            rc = map_apply_(s->map[k], e, into ? 0 : mut[f], into ? dst[f] : buf, flags, s->epoch, s->pos, &m, err);
        }
        if (rc) return rc;
        mut[f] = (uint8_t)m;
    }
    s->pos += map_count_(s->map[0], e);
    return LOOM_OK;
}

/* A fused chain's pull: map 0 (the scale) runs in the batch's row copies;
 * a feature no map of the chain touches is gathered into dst[f] (when
 * given), the scale's into dst[f] when no later map maps it; then maps 1..
 * (e: the element; mut: its features' writability). */
static int chain_pull_fused(chainst *s, loom_elem *e, uint8_t *mut, uint8_t *const *dst, loom_err *err)
{
    dstage *st = &s->s;
    uint8_t *to[LOOM_MAX_FEATURES];
    for (int f = 0; f < st->spec.n; f++) to[f] = dst && last_of(s, -1, f) ? dst[f] : NULL;
    int f0 = map_feature_(s->map[0]);
    to[f0] = dst && last_of(s, 0, f0) ? dst[f0] : NULL;
    int rc = map_fused_pull_(s->map[0], e, to, err);
    if (rc) return rc;
    memcpy(mut, st->in->mut, LOOM_MAX_FEATURES);
    mut[f0] = !to[f0]; /* the scale's own buffer (as map_apply_ into its buf says) */
    return apply_chain(s, e, mut, dst, 1, err);
}

static int chain_next(dstage *st, loom_elem **out, loom_err *err)
{
    chainst *s = (chainst *)st;
    if (s->fused) {
        int rc = chain_pull_fused(s, &st->out, st->mut, NULL, err);
        if (rc) return rc;
        *out = &st->out;
        return LOOM_OK;
    }
    loom_elem *e;
    int rc = dstage_next_(st->in, &e, err);
    if (rc) return rc;
    elem_copy_(&st->out, e);
    memcpy(st->mut, st->in->mut, sizeof st->mut);
    rc = apply_chain(s, &st->out, st->mut, NULL, 0, err);
    if (rc) return rc;
    *out = &st->out;
    return LOOM_OK;
}

/* next() into dst (a prefetch's slot): each feature's last map writes there,
 * the other features are copied. */
static int chain_next_into(dstage *st, loom_elem *dst, loom_err *err)
{
    chainst *s = (chainst *)st;
    loom_elem e;
    uint8_t mut[LOOM_MAX_FEATURES], *to[LOOM_MAX_FEATURES];
    for (int f = 0; f < dst->n; f++) to[f] = dst->t[f].data;
    int rc;
    if (s->fused) {
        rc = chain_pull_fused(s, &e, mut, to, err);
    } else {
        loom_elem *in;
        rc = dstage_next_(st->in, &in, err);
        if (rc) return rc;
        elem_copy_(&e, in);
        memcpy(mut, st->in->mut, sizeof mut);
        rc = apply_chain(s, &e, mut, to, 0, err);
    }
    if (rc) return rc;
    for (int f = 0; f < dst->n; f++) {
        if (e.t[f].data != to[f]) memcpy(to[f], e.t[f].data, loom_tensor_nbytes(&e.t[f]));
        dst->t[f].shape = e.t[f].shape;
    }
    return LOOM_OK;
}

static const dstage_ops chain_ops = {
    .next = chain_next, .rewind = dcursor_stage_rewind_, .save = dcursor_stage_save_, .restore = dcursor_stage_restore_,
    .close = chain_close,
    .next_into = chain_next_into,
};

bool mapchain_fused_alone_(const dstage *st)
{
    return st->ops == &chain_ops && ((const chainst *)st)->fused && ((const chainst *)st)->nmap == 1;
}

int mapchain_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, int n, const loom_data_ctx *ctx,
                   loom_err *err)
{
    *out = NULL;
    chainst *s = loom_calloc(1, sizeof *s);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a map stage");
    dstage_init_(&s->s, &chain_ops, in, id, &t[0].loc);
    int rc = open_chain(s, in, id, t, n, ctx, true, err);
    if (rc) {
        chain_close(&s->s);
        return rc;
    }
    dstage *last = s->map[n - 1];
    s->s.spec = last->spec;
    memcpy(s->s.maxshape, last->maxshape, sizeof s->s.maxshape);
    s->s.card = last->card;
    *out = &s->s;
    return LOOM_OK;
}

/* ---- map + batch -------------------------------------------------------------------
 * The last map of each feature writes straight into the batch buffer at the
 * element's row; features no map writes (or ops that return a view) are
 * copied there, as batch does. A batch stage opened on the chain gives the
 * spec, the cardinality and the buffers; it is never pulled. */

typedef struct mbst {
    chainst chain;   /* first: the stage, and the maps */
    dstage *batch;
    int64_t size;
    int     drop;
} mbst;

static int mb_into(dstage *st, loom_elem *o, loom_err *err)
{
    mbst *s = (mbst *)st;
    loom_shape first[LOOM_MAX_FEATURES];
    size_t bytes[LOOM_MAX_FEATURES] = {0};
    int64_t i;
    for (i = 0; i < s->size; i++) {
        loom_elem *in;
        int rc = dstage_next_(st->in, &in, err);
        if (rc == LOOM_EEOF) break;
        if (rc) return rc;
        loom_elem e;
    elem_copy_(&e, in);
        uint8_t mut[LOOM_MAX_FEATURES], *row[LOOM_MAX_FEATURES];
        memcpy(mut, st->in->mut, sizeof mut);
        for (int f = 0; f < o->n; f++) row[f] = (uint8_t *)o->t[f].data + (size_t)i * bytes[f];
        rc = apply_chain(&s->chain, &e, mut, row, 0, err);
        if (rc) return rc;
        for (int f = 0; f < o->n; f++) {
            if (i == 0) {
                first[f] = e.t[f].shape;
                bytes[f] = loom_tensor_nbytes(&e.t[f]);
            } else if (!loom_shape_eq(&first[f], &e.t[f].shape)) {
                char a[128], b[128];
                return dstage_err_(s->batch, err, LOOM_ESHAPE, "batch: feature \"%s\" has shape %s in element %lld of the "
                                   "batch but %s in its first element (a batch needs equal shapes)", st->spec.name[f],
                                   loom_shape_str(&e.t[f].shape, a, sizeof a), (long long)i,
                                   loom_shape_str(&first[f], b, sizeof b));
            }
            if (e.t[f].data != row[f]) memcpy(row[f], e.t[f].data, bytes[f]);
        }
    }
    return dbatch_finish_(o, first, i, s->size, s->drop);
}

static int mb_next(dstage *st, loom_elem **out, loom_err *err)
{
    int rc = mb_into(st, &st->out, err);
    if (rc == LOOM_OK) *out = &st->out;
    return rc;
}

static void mb_close(dstage *st)
{
    mbst *s = (mbst *)st;
    if (s->batch) s->batch->ops->close(s->batch);
    s->batch = NULL;
    chain_close(st);
}

static const dstage_ops mb_ops = {
    .next = mb_next, .rewind = dcursor_stage_rewind_, .save = dcursor_stage_save_, .restore = dcursor_stage_restore_, .close = mb_close,
    .next_into = mb_into,
};

int mapbatch_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, int n, const loom_data_ctx *ctx,
                   loom_err *err)
{
    *out = NULL;
    mbst *s = loom_calloc(1, sizeof *s);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a map+batch stage");
    dstage *st = &s->chain.s;
    dstage_init_(st, &mb_ops, in, id, &t[0].loc);
    int rc = open_chain(&s->chain, in, id, t, n - 1, ctx, false, err);
    if (!rc) rc = batch_open_(&s->batch, s->chain.map[n - 2], id + n - 1, &t[n - 1], err);
    if (rc) {
        mb_close(st);
        return rc;
    }
    dstage *b = s->batch;
    s->size = t[n - 1].batch_size;
    s->drop = t[n - 1].drop_remainder;
    dmaps_name_(st->name, sizeof st->name, s->chain.map, n - 1, "+batch");
    size_t k = strlen(st->desc);
    snprintf(st->desc + k, sizeof st->desc - k, "+%s", b->desc);
    st->spec = b->spec;
    memcpy(st->maxshape, b->maxshape, sizeof st->maxshape);
    st->batch_dims = b->batch_dims;
    st->card = b->card;
    st->out = b->out; /* views of the batch stage's buffers */
    for (int f = 0; f < st->out.n; f++) st->out.t[f].owns = 0;
    memset(st->mut, 1, sizeof st->mut);
    __atomic_fetch_add(&st->st_bytes, dstage_load_(&b->st_bytes), __ATOMIC_RELAXED);
    *out = st;
    return LOOM_OK;
}

/* ---- shuffle + repeat ------------------------------------------------------------
 * tf.data's fused ShuffleAndRepeat (tf_semantics 4.1 step 5): while the
 * buffer drains at the end of a pass it already fills from the next one, as a
 * new slice; draws only ever come from the oldest slice, with the RNG the plain
 * shuffle would use for that pass, so epochs never mix and the elements are
 * exactly those of shuffle then repeat. Filling stops at SR_SLICES passes.
 * Over a random-access input (see the plain shuffle's index mode) the rings
 * hold positions of the input's pass, read with get when drawn, and no slot
 * pool exists: a pass's positions are 0..card-1 whatever the pass. */

#define SR_SLICES 4 /* the pass being drawn plus three ahead (tf.data's bound of 3 epochs) */

typedef struct srslice {
    int64_t  k;           /* the inner pass its elements come from */
    int64_t *ring;        /* pool.cap slot ids; positions [start, end) */
    int64_t  start, end;
    loom_rng rng;
} srslice;

typedef struct srst {
    dstage    s;
    int64_t   size, count;
    uint64_t  seed;
    int       reshuffle;
    int       by_index;    /* rings hold input positions; no pool, no free list */
    elem_pool pool;
    int64_t   cap;         /* ring size (pool.cap in element mode) */
    int64_t   next_in;     /* index mode: the next position of pass pull_k */
    int64_t  *freel, nfree, total;
    srslice   sl[SR_SLICES]; /* sl[0] is the oldest */
    int       nsl;
    int64_t   epoch, pull_k; /* pull_k: the inner pass being read from the input */
    int       produced, done;
    int64_t   lent;
} srst;

/* repeat's upstream epoch for inner pass k (as repeat_inner_epoch in transform/repeat.c). */
static int64_t sr_inner(const srst *s, int64_t k)
{
    return s->count > 0 ? s->epoch * s->count + k : (int64_t)((uint64_t)s->epoch << 32) + k;
}

static void sr_reset(srst *s, int64_t epoch)
{
    s->epoch = epoch;
    s->pull_k = 0;
    s->produced = 0;
    s->done = s->count == 0;
    s->nsl = 0;
    s->total = 0;
    s->lent = -1;
    s->next_in = 0;
    s->nfree = 0;
    if (!s->by_index)
        for (int64_t i = s->pool.cap - 1; i >= 0; i--) s->freel[s->nfree++] = i;
    dstage_gauge_(&s->s.st_buffered, 0);
}

static srslice *sr_new_slice(srst *s, int64_t k)
{
    srslice *x = &s->sl[s->nsl++];
    x->k = k;
    x->start = x->end = 0;
    loom_rng_init(&x->rng, s->seed, (uint64_t)s->s.id, s->reshuffle ? (uint64_t)sr_inner(s, k) : 0, 0);
    return x;
}

/* Tops the buffer up to size elements, across passes. */
static int sr_fill(srst *s, loom_err *err)
{
    dstage *st = &s->s;
    while (!s->done && s->total < s->size) {
        int newest = s->nsl > 0 && s->sl[s->nsl - 1].k == s->pull_k;
        if (!newest && s->nsl == SR_SLICES) break;
        loom_elem *e = NULL;
        int rc = !s->by_index ? dstage_next_(st->in, &e, err) : s->next_in < st->in->card ? LOOM_OK : LOOM_EEOF;
        if (rc == LOOM_EEOF) {
            /* as repeat: the last pass, or an empty pass of an infinite repeat, ends it */
            if ((s->count >= 0 && s->pull_k + 1 >= s->count) || (s->count < 0 && !s->produced)) {
                s->done = 1;
                break;
            }
            s->pull_k++;
            s->produced = 0;
            s->next_in = 0;
            rc = st->in->ops->rewind(st->in, sr_inner(s, s->pull_k), err);
            if (rc) return rc;
            continue;
        }
        if (rc) return rc;
        s->produced = 1;
        srslice *x = newest ? &s->sl[s->nsl - 1] : sr_new_slice(s, s->pull_k);
        if (s->by_index) {
            x->ring[x->end++ % s->cap] = s->next_in++;
            s->total++;
            continue;
        }
        LOOM_ASSERT(s->nfree > 0);
        int64_t slot = s->freel[--s->nfree];
        rc = elem_pool_put_(&s->pool, slot, e, err);
        if (rc) return dstage_err_(st, err, rc, "shuffle: %s", err->msg);
        x->ring[x->end++ % s->cap] = slot;
        s->total++;
    }
    return LOOM_OK;
}

static int sr_next(dstage *st, loom_elem **out, loom_err *err)
{
    srst *s = (srst *)st;
    if (s->lent >= 0) {
        s->freel[s->nfree++] = s->lent;
        s->lent = -1;
    }
    int rc = sr_fill(s, err);
    if (rc) return rc;
    while (s->nsl > 0 && s->sl[0].end == s->sl[0].start) { /* a drained pass: drop its slice, keeping the rings */
        srslice x = s->sl[0];
        memmove(&s->sl[0], &s->sl[1], (size_t)(s->nsl - 1) * sizeof s->sl[0]);
        s->sl[--s->nsl] = x;
    }
    if (s->nsl == 0) return LOOM_EEOF;
    srslice *x = &s->sl[0];
    int64_t live = x->end - x->start, cap = s->cap;
    int64_t j = (x->start + (int64_t)loom_rng_below(&x->rng, (uint64_t)live)) % cap;
    int64_t slot = x->ring[j];
    x->ring[j] = x->ring[x->start % cap];
    x->start++;
    s->total--;
    dstage_gauge_(&st->st_buffered, s->total);
    if (s->by_index) {
        rc = dstage_get_(st->in, slot, out, err);
        if (rc == LOOM_OK) memcpy(st->mut, st->in->mut, sizeof st->mut);
        return rc;
    }
    s->lent = slot;
    elem_pool_view_(&s->pool, slot, &st->out);
    *out = &st->out;
    return LOOM_OK;
}

/* Index mode's next() as positions (a batch's gather): sr_next's fill and
 * draws, without the get. */
static int sr_draw(dstage *st, int64_t *pos, int64_t n, int64_t *got, loom_err *err)
{
    srst *s = (srst *)st;
    LOOM_ASSERT(s->by_index);
    int64_t k = 0, cap = s->cap;
    int rc = LOOM_OK;
    for (; k < n; k++) {
        if ((rc = sr_fill(s, err))) break;
        while (s->nsl > 0 && s->sl[0].end == s->sl[0].start) {
            srslice x = s->sl[0];
            memmove(&s->sl[0], &s->sl[1], (size_t)(s->nsl - 1) * sizeof s->sl[0]);
            s->sl[--s->nsl] = x;
        }
        if (s->nsl == 0) break;
        srslice *x = &s->sl[0];
        int64_t live = x->end - x->start;
        int64_t j = (x->start + (int64_t)loom_rng_below(&x->rng, (uint64_t)live)) % cap;
        pos[k] = x->ring[j];
        x->ring[j] = x->ring[x->start % cap];
        x->start++;
        s->total--;
    }
    dstage_gauge_(&st->st_buffered, s->total);
    *got = k;
    return rc;
}

static int sr_rewind(dstage *st, int64_t epoch, loom_err *err)
{
    srst *s = (srst *)st;
    sr_reset(s, epoch);
    return st->in->ops->rewind(st->in, sr_inner(s, 0), err);
}

static void sr_save(dstage *st, loom_buf *b)
{
    srst *s = (srst *)st;
    loom_buf_put_i64(b, s->epoch);
    loom_buf_put_i64(b, s->pull_k);
    loom_buf_put_u32(b, (uint32_t)s->produced);
    loom_buf_put_u32(b, (uint32_t)s->done);
    if (s->by_index) loom_buf_put_i64(b, s->next_in);
    loom_buf_put_u32(b, (uint32_t)s->nsl);
    for (int i = 0; i < s->nsl; i++) {
        const srslice *x = &s->sl[i];
        loom_buf_put_i64(b, x->k);
        loom_rng_save(&x->rng, b);
        loom_buf_put_i64(b, x->end - x->start);
        for (int64_t j = x->start; j < x->end; j++) {
            if (s->by_index) loom_buf_put_i64(b, x->ring[j % s->cap]);
            else elem_pool_save_(&s->pool, x->ring[j % s->cap], b);
        }
    }
}

static int sr_restore(dstage *st, loom_buf *b, loom_err *err)
{
    srst *s = (srst *)st;
    sr_reset(s, loom_buf_get_i64(b));
    s->pull_k = loom_buf_get_i64(b);
    s->produced = (int)loom_buf_get_u32(b);
    s->done = (int)loom_buf_get_u32(b);
    if (s->by_index) s->next_in = loom_buf_get_i64(b);
    uint32_t nsl = loom_buf_get_u32(b);
    if (b->failed || nsl > SR_SLICES || s->pull_k < 0 || (s->by_index && (s->next_in < 0 || s->next_in > st->in->card)))
        goto bad;
    int64_t next = 0;
    for (uint32_t i = 0; i < nsl; i++) {
        srslice *x = sr_new_slice(s, loom_buf_get_i64(b));
        int bad_rng = loom_rng_restore(&x->rng, b);
        int64_t live = loom_buf_get_i64(b);
        if (bad_rng || b->failed || live < 0 || next + live > s->cap) goto bad;
        for (int64_t j = 0; j < live; j++, next++) {
            if (s->by_index) {
                int64_t pos = loom_buf_get_i64(b);
                if (b->failed || pos < 0 || pos >= st->in->card) goto bad;
                x->ring[x->end++] = pos;
                continue;
            }
            int rc = elem_pool_load_(&s->pool, next, b, err);
            if (rc) return rc;
            x->ring[x->end++] = next;
        }
        s->total += live;
    }
    s->nfree = 0;
    if (!s->by_index)
        for (int64_t i = s->pool.cap - 1; i >= next; i--) s->freel[s->nfree++] = i;
    dstage_gauge_(&st->st_buffered, s->total);
    return LOOM_OK;
bad:
    return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "iterator state is corrupt (shuffle+repeat buffer)");
}

static void sr_close(dstage *st)
{
    srst *s = (srst *)st;
    elem_pool_fini_(&s->pool);
    loom_free(s->freel);
    for (int i = 0; i < SR_SLICES; i++) loom_free(s->sl[i].ring);
    loom_free(s);
}

static const dstage_ops sr_ops = {
    .next = sr_next, .rewind = sr_rewind, .save = sr_save, .restore = sr_restore, .close = sr_close,
};
static const dstage_ops sr_index_ops = { /* index mode: draws positions for a batch's gather too */
    .next = sr_next, .rewind = sr_rewind, .save = sr_save, .restore = sr_restore, .close = sr_close,
    .draw = sr_draw,
};

int64_t shuffle_max_bytes_(const dstage *in, const loom_transform_spec *t, bool by_index)
{
    int64_t slot = 0, n = t->buffer;
    for (int f = 0; f < in->spec.n; f++) slot += loom_shape_numel(&in->maxshape[f]) * (int64_t)loom_dtype_size(in->spec.dtype[f]);
    if (by_index) slot = (int64_t)sizeof(int64_t);
    if (in->card >= 0 && in->card < n) n = in->card;
    return n * slot;
}

int shufrep_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, const loom_data_ctx *ctx, loom_err *err)
{
    *out = NULL;
    srst *s = loom_calloc(1, sizeof *s);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a shuffle+repeat stage");
    dstage *st = &s->s;
    dstage_init_(st, &sr_ops, in, id, &t[0].loc);
    s->size = t[0].buffer;
    s->seed = t[0].seed_set ? t[0].seed : ctx->seed;
    s->reshuffle = t[0].reshuffle;
    s->count = t[1].count;
    s->by_index = shuffle_by_index_(in);
    if (s->by_index) st->ops = &sr_index_ops;
    snprintf(st->name, sizeof st->name, s->by_index ? "shuffle(indices)+repeat" : "shuffle+repeat");
    snprintf(st->desc, sizeof st->desc, "shuffle(%s%lld,%llu,%d)+repeat(%lld)", s->by_index ? "indices," : "",
             (long long)s->size, (unsigned long long)s->seed, s->reshuffle, (long long)s->count);
    int rc = LOOM_OK;
    if (s->size < 1 || s->count < -1) {
        rc = dstage_err_(st, err, LOOM_ECONFIG, "shuffle+repeat: buffer %lld must be >= 1 and count %lld >= -1",
                         (long long)s->size, (long long)s->count);
        goto fail;
    }
    /* the buffer holds at most size elements, and at most SR_SLICES passes */
    int64_t c = in->card, n = s->count;
    int64_t cap = c >= 0 && c * SR_SLICES < s->size ? c * SR_SLICES : s->size;
    st->card = n == 0 || c == 0 ? 0 : n < 0 ? (c == -2 ? -2 : -1) : c < 0 ? c : c * n;
    s->cap = cap < 1 ? 1 : cap;
    if (!s->by_index) {
        rc = elem_pool_init_(&s->pool, st, s->cap, err);
        if (rc) goto fail;
    }
    /* index mode: the rings alone (a position per element); element mode: rings and free list over the pool */
    int nrings = s->by_index ? SR_SLICES : SR_SLICES + 1;
    s->freel = s->by_index ? NULL : loom_alloc((size_t)s->cap * sizeof *s->freel);
    int ok = s->by_index || s->freel != NULL;
    for (int i = 0; i < SR_SLICES; i++) {
        s->sl[i].ring = loom_alloc((size_t)s->cap * sizeof *s->sl[i].ring);
        ok = ok && s->sl[i].ring;
    }
    if (!ok) {
        rc = loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the shuffle+repeat buffer of %lld elements", (long long)cap);
        goto fail;
    }
    __atomic_fetch_add(&st->st_bytes, (int64_t)nrings * s->cap * (int64_t)sizeof(int64_t), __ATOMIC_RELAXED);
    dstage_gauge_(&st->st_capacity, s->size);
    sr_reset(s, 0);
    if (s->by_index) memcpy(st->mut, in->mut, sizeof st->mut);
    else memset(st->mut, 1, sizeof st->mut);
    *out = st;
    return LOOM_OK;
fail:
    sr_close(st);
    return rc;
}
