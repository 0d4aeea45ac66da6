/* pipeline.c - builds the chain source -> transforms from a loom_dataset_spec
 * and implements the public loom_iter API on top of it: next, rewind,
 * cardinality, stats, and save/restore of the whole chain behind a
 * fingerprint of its structure. */
#include "data/data_internal.h"

#include <stdio.h>
#include <string.h>

#define ITER_STATE_MAGIC   0x5254494cu /* "LITR" */
#define ITER_STATE_VERSION 1u

struct loom_iter {
    int      n;
    dstage  *st[LOOM_MAX_TRANSFORMS + 3]; /* st[0] is the source; + a DATA auto-shard stage, an injected prefetch */
    int64_t  epoch;
    char     fp[4096]; /* structure fingerprint: stage descriptions and the element spec */
    dpool   *pool;     /* workers shared by the parallel maps; NULL when there are none */
    dtuner  *tuner;    /* the autotuner of the "auto" knobs; NULL when autotuning is off */
    char     tuned[512]; /* the last settled choice reported by loom_iter_tuned */
};

/* A spec built in code without data.options: no rewrites, autotuning on. */
static const loom_data_options no_options = {.deterministic = true, .autotune = true};

static dstage *last(const loom_iter *it) { return it->st[it->n - 1]; }

dstage *iter_last_(loom_iter *it) { return last(it); }

void loom_iter_close(loom_iter *it)
{
    if (!it) return;
    dtuner_stop_(it->tuner); /* first: it reads the stages; they read its knobs until closed */
    for (int i = it->n - 1; i >= 0; i--) it->st[i]->ops->close(it->st[i]);
    dtuner_free_(it->tuner);
    dpool_free_(it->pool); /* after the stages: each waits for its own calls */
    loom_free(it);
}

/* "6800 bytes", or "188160000 bytes (179.4 MiB)". */
static const char *bytes_str(int64_t n, char *buf, size_t len)
{
    if (n < (1 << 20)) snprintf(buf, len, "%lld bytes", (long long)n);
    else snprintf(buf, len, "%lld bytes (%.1f MiB)", (long long)n, (double)n / 1048576.0);
    return buf;
}

/* A buffer of need bytes when only left of the budget remain: LOOM_ECONFIG at t. */
static int over_budget(const loom_transform_spec *t, const char *what, int64_t need, int64_t left, int64_t budget,
                       loom_err *err)
{
    char where[LOOM_PATH_MAX + 16], a[48], b[48], c[48];
    loom_loc_str(&t->loc, where, sizeof where);
    loom_err_set(err, LOOM_ECONFIG, where, "%s%s%s needs %s, more than the %s left of the RAM budget of %s", t->loc.path,
                 t->loc.path[0] ? ": " : "", what, bytes_str(need, a, sizeof a), bytes_str(left, b, sizeof b),
                 bytes_str(budget, c, sizeof c));
    return loom_err_hint(err, "lower the buffer, or raise data.options.autotune.ram_budget (bytes, \"4GiB\" or \"80%%\"; "
                         "default 50%% of physical memory)");
}

/* x's load-time check and RAM budget for t over in, before anything of it is allocated. */
static int budget_check(const dxform *x, const dstage *in, const dxform_args *a, loom_err *err)
{
    int rc = x->check ? x->check(in, a, err) : LOOM_OK;
    int64_t need = !rc && x->max_bytes ? x->max_bytes(in, a->t) : 0;
    if (rc || need <= a->ram_left) return rc;
    char what[128];
    x->what(what, sizeof what, in, a->t);
    return over_budget(a->t, what, need, a->ram_left, a->ram, err);
}

/* Opens the stage of plan step ps over the pipeline's last stage: a
 * transform through its registry entry (*x, NULL for a fused step), a fused
 * step through the fused stage it names. */
static int open_step(loom_iter *it, const dplan *dp, const dplan_step *ps, const loom_dataset_spec *spec,
                     const loom_data_ctx *ctx, int *threads_left, int64_t ram_left, int64_t ram, dstage **out,
                     const dxform **x, loom_err *err)
{
    const loom_transform_spec *t = ps->first >= 0 ? &spec->transform[ps->first] : &dp->injected;
    dstage *in = last(it), *s = NULL;
    int id = ps->first >= 0 ? ps->first + 1 : spec->n_transforms + 1, rc;
    dxform_args a = {.id = id, .index = ps->first, .t = t, .spec = spec, .ctx = ctx, .pool = &it->pool,
                     .threads = threads_left, .ram_left = ram_left, .ram = ram};
    char where[LOOM_PATH_MAX + 16] = "";
    if (t->loc.file[0]) snprintf(where, sizeof where, "%s:%d", t->loc.file, t->loc.line);
    *x = NULL;
    switch (ps->kind) {
    case DPLAN_MAPS:
        rc = ps->parallel == 1 ? mapchain_open_(&s, in, id, t, ps->n, ctx, err)
                               : parmap_open_(&s, in, id, t, ps->n, ps->parallel, 0, ctx, &it->pool, ram_left, err);
        break;
    case DPLAN_MAP_BATCH:
        rc = ps->parallel == 1 ? mapbatch_open_(&s, in, id, t, ps->n, ctx, err)
                               : parmap_open_(&s, in, id, t, ps->n - 1, ps->parallel, 1, ctx, &it->pool, ram_left, err);
        break;
    case DPLAN_SHUFFLE_REPEAT: { /* the shuffle's budget, as a plain shuffle's */
        const dxform *sx = dxform_find_(t, where, err);
        rc = !sx ? err->code : budget_check(sx, in, &a, err);
        if (!rc) rc = shufrep_open_(&s, in, id, t, ctx, err);
        break;
    }
    default: /* one transform: the built-in its type names */
        *x = dxform_find_(t, where, err);
        rc = !*x ? err->code : budget_check(*x, in, &a, err);
        if (!rc) rc = (*x)->open(&s, in, &a, err);
    }
    *out = s;
    return rc;
}

/* Bytes stage s may come to hold: what it holds now, or what its buffer grows to (x: its transform's entry). */
static int64_t stage_max_bytes(const dstage *s, const dxform *x, const loom_transform_spec *t)
{
    int64_t b = dstage_load_(&s->st_bytes), m = x && x->max_bytes ? x->max_bytes(s->in, t) : 0;
    return m > b ? m : b;
}

/* Appends s; its "auto" knobs join the tuner at once, before a stage opened
 * after it (a prefetch's producer) can pull from it. */
static void append(loom_iter *it, dstage *s)
{
    it->st[it->n++] = s;
    if (it->tuner && s->ops->tune) s->ops->tune(s, it->tuner);
}

int loom_data_open(loom_iter **out, const loom_dataset_spec *spec, const loom_data_ctx *ctx, loom_err *err)
{
    static const loom_data_ctx defaults = {.seed = 42, .threads = 1, .name = "data"};
    if (!ctx) ctx = &defaults;
    *out = NULL;
    if (spec->n_transforms < 0 || spec->n_transforms > LOOM_MAX_TRANSFORMS)
        return loom_err_set(err, LOOM_ECONFIG, NULL, "%s: %d transforms (at most %d)", ctx->name ? ctx->name : "data",
                            spec->n_transforms, LOOM_MAX_TRANSFORMS);
    loom_iter *it = loom_calloc(1, sizeof *it);
    if (!it) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate an iterator");
    dinput_plan plan; /* this pipeline's share when ctx->input names one of several */
    int rc = dinput_plan_(&plan, spec, ctx, true, err);
    if (rc) goto fail;
    const loom_source_spec *src = plan.source ? plan.source : &spec->source;
    if ((rc = dsource_open_(&it->st[0], src, ctx, err))) goto fail; /* built-in or plugin, through the registry */
    it->n = 1;
    const loom_data_options *opts = spec->options.present ? &spec->options : &no_options;
    int threads = ctx->threads, sharded = 0;
    if (opts->autotune &&
        (rc = dtuner_new_(&it->tuner, opts->present && opts->cpu_budget > 0 ? opts->cpu_budget : loom_num_cores(), err)))
        goto fail;
    if (it->tuner && it->st[0]->ops->tune) it->st[0]->ops->tune(it->st[0], it->tuner); /* the source's knobs */
    dplan dp; /* the transforms after data.options.optimization's rewrites */
    dplan_make_(&dp, spec, opts, threads, plan.data_at);
    int64_t ram = dtuner_ram_budget_(opts), used = stage_max_bytes(it->st[0], NULL, NULL);
    for (int si = 0; si <= dp.n; si++) {
        int i = si == dp.n ? spec->n_transforms + 1 : dp.step[si].first >= 0 ? dp.step[si].first : spec->n_transforms;
        if (!sharded && plan.data_at >= 0 && i >= plan.data_at) {
            if ((rc = dinput_shard_open_(&it->st[it->n], last(it), &plan, spec, err))) goto fail;
            it->n++;
            sharded = 1;
        }
        if (si == dp.n) break;
        dstage *s;
        const dxform *x;
        rc = open_step(it, &dp, &dp.step[si], spec, ctx, &threads, ram - used, ram, &s, &x, err);
        if (rc) goto fail;
        append(it, s);
        used += stage_max_bytes(s, i < spec->n_transforms ? x : NULL, i < spec->n_transforms ? &spec->transform[i] : NULL);
    }
    dtuner_output_(it->tuner, last(it));
    if (it->tuner && (rc = dtuner_start_(it->tuner, err))) goto fail;
    size_t k = 0;
    for (int i = 0; i < it->n && k < sizeof it->fp; i++)
        k += (size_t)snprintf(it->fp + k, sizeof it->fp - k, "%s%s", i ? " | " : "", it->st[i]->desc);
    if (k < sizeof it->fp) {
        k += (size_t)snprintf(it->fp + k, sizeof it->fp - k, " => ");
        if (k < sizeof it->fp) loom_elem_spec_str(&last(it)->spec, it->fp + k, sizeof it->fp - k);
    }
    dinput_plan_fini_(&plan);
    *out = it;
    return LOOM_OK;
fail:
    dinput_plan_fini_(&plan);
    loom_iter_close(it);
    return rc;
}

const loom_elem_spec *loom_iter_spec(const loom_iter *it) { return &last(it)->spec; }

int loom_iter_next(loom_iter *it, loom_elem **out, loom_err *err) { return dstage_next_(last(it), out, err); }

int loom_iter_rewind(loom_iter *it, int64_t epoch, loom_err *err)
{
    if (epoch < 0) return loom_err_set(err, LOOM_EUSAGE, NULL, "rewind to a negative epoch %lld", (long long)epoch);
    it->epoch = epoch;
    return last(it)->ops->rewind(last(it), epoch, err);
}

int64_t loom_iter_cardinality(const loom_iter *it) { return last(it)->card; }

/* Background stages are quiesced downstream first (a downstream producer
 * pulls from the stages above it) and resumed upstream first. */
static void pause_all(loom_iter *it)
{
    for (int i = it->n - 1; i >= 0; i--)
        if (it->st[i]->ops->pause) it->st[i]->ops->pause(it->st[i]);
}

static void resume_all(loom_iter *it)
{
    for (int i = 0; i < it->n; i++)
        if (it->st[i]->ops->resume) it->st[i]->ops->resume(it->st[i]);
}

int loom_iter_save(loom_iter *it, loom_buf *b, loom_err *err)
{
    pause_all(it);
    loom_buf_put_u32(b, ITER_STATE_MAGIC);
    loom_buf_put_u32(b, ITER_STATE_VERSION);
    loom_buf_put_str(b, it->fp);
    loom_buf_put_i64(b, it->epoch);
    loom_buf_put_u32(b, (uint32_t)it->n);
    for (int i = 0; i < it->n; i++) it->st[i]->ops->save(it->st[i], b);
    loom_buf_put_u32(b, ITER_STATE_MAGIC);
    resume_all(it);
    if (b->failed) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot grow the buffer for the iterator state");
    return LOOM_OK;
}

/* Whether saved is cur with each index-mode shuffle in element mode: a state
 * from before index shuffling, which holds elements where cur expects positions. */
static bool element_shuffle_state(const char *saved, const char *cur)
{
    static const char ix[] = "shuffle(indices,", el[] = "shuffle(";
    bool any = false;
    while (*cur) {
        if (!strncmp(cur, ix, sizeof ix - 1)) {
            if (strncmp(saved, el, sizeof el - 1)) return false;
            cur += sizeof ix - 1;
            saved += sizeof el - 1;
            any = true;
        } else if (*saved++ != *cur++) {
            return false;
        }
    }
    return any && !*saved;
}

int loom_iter_restore(loom_iter *it, loom_buf *b, loom_err *err)
{
    uint32_t magic = loom_buf_get_u32(b), version = loom_buf_get_u32(b);
    if (b->failed || magic != ITER_STATE_MAGIC)
        return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "not an input iterator state (bad magic 0x%08x)", magic);
    if (version != ITER_STATE_VERSION)
        return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "input iterator state has version %u, this build reads %u", version,
                            ITER_STATE_VERSION);
    char fp[sizeof it->fp];
    loom_buf_get_str(b, fp, sizeof fp);
    if (b->failed) return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "input iterator state is truncated");
    if (strcmp(fp, it->fp) && element_shuffle_state(fp, it->fp)) {
        loom_err_set(err, LOOM_ECHECKPOINT, NULL, "iterator state was saved by a shuffle that buffered elements "
                     "(a build before index shuffling); this build's shuffle(indices) buffers the positions of a "
                     "random-access input instead, and cannot resume from that state (saved: %.200s)", fp);
        return loom_err_hint(err, "finish the run with the build that wrote this checkpoint, or pass --fresh to start "
                             "over (the model restarts too)");
    }
    if (strcmp(fp, it->fp)) {
        loom_err_set(err, LOOM_ECHECKPOINT, NULL, "iterator state was saved by a different pipeline (saved: %.200s; this one: %.200s)",
                     fp, it->fp);
        return loom_err_hint(err, "restore into a pipeline built from the same data config, or restart the input from the "
                             "beginning of an epoch");
    }
    int64_t epoch = loom_buf_get_i64(b);
    uint32_t n = loom_buf_get_u32(b);
    if (b->failed || n != (uint32_t)it->n) return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "input iterator state is corrupt");
    pause_all(it);
    int rc = LOOM_OK;
    for (int i = 0; i < it->n && !rc; i++) {
        rc = it->st[i]->ops->restore(it->st[i], b, err);
        if (rc && !err->where[0]) snprintf(err->where, sizeof err->where, "%.255s", it->st[i]->where);
    }
    if (!rc && loom_buf_get_u32(b) != ITER_STATE_MAGIC)
        rc = loom_err_set(err, LOOM_ECHECKPOINT, NULL, "input iterator state is corrupt (bad trailer)");
    if (!rc) it->epoch = epoch;
    resume_all(it);
    return rc;
}

int loom_iter_tuned(loom_iter *it, char *buf, size_t n)
{
    int settled = dtuner_summary_(it->tuner, buf, n);
    if (!settled || !strcmp(buf, it->tuned)) return 0;
    snprintf(it->tuned, sizeof it->tuned, "%s", buf);
    return 1;
}

bool loom_iter_share_pool(loom_iter *it, loom_pool *pool)
{
    dstage *p = last(it), *b = p->in;
    if (!pool || !b) return false;
    if (map_is_fused_(b) || mapchain_fused_alone_(b)) b = b->in; /* map(scale) in the batch's row copies */
    if (!batch_is_gather_(b) || !prefetch_inline_(p)) return false;
    batch_share_pool_(b, pool);
    return true;
}

void loom_iter_plan(const loom_iter *it, FILE *f)
{
    for (int i = 0; i < it->n; i++) fprintf(f, "%s%s", i ? " -> " : "", it->st[i]->name);
    fputc('\n', f);
}

int loom_iter_stats(const loom_iter *it, loom_stage_stats *out, int max)
{
    int k = 0;
    for (int i = 0; i < it->n && k < max; i++, k++) {
        const dstage *s = it->st[i];
        out[k].name = s->name;
        out[k].elements = dstage_load_(&s->st_elements);
        out[k].busy_sec = (double)dstage_load_(&s->st_busy_ns) * 1e-9;
        out[k].wait_sec = (double)dstage_load_(&s->st_wait_ns) * 1e-9;
        out[k].buffered = dstage_load_(&s->st_buffered);
        out[k].capacity = dstage_load_(&s->st_capacity);
        out[k].parallel = dstage_load_(&s->st_parallel);
        out[k].bytes = dstage_load_(&s->st_bytes);
    }
    return k;
}
