/* pipeline.c - builds the chain source -> transforms from a loom_dataset_spec
 * and implements the public loom_iter API on top of it: next, rewind,
 * cardinality, stats, and save/restore of the whole chain behind a
 * fingerprint of its structure. */
#include "data_internal.h"

#include <stdio.h>
#include <string.h>

#define ITER_STATE_MAGIC   0x5254494cu /* "LITR" */
#define ITER_STATE_VERSION 1u

struct loom_iter {
    int      n;
    dstage  *st[LOOM_MAX_TRANSFORMS + 1]; /* st[0] is the source */
    int64_t  epoch;
    char     fp[4096]; /* structure fingerprint: stage descriptions and the element spec */
    dpool   *pool;     /* workers shared by the parallel maps; NULL when there are none */
};

/* source_tfrecord.c (declared here rather than in data_internal.h, which
 * this change leaves alone: move it there with the next edit of that header) */
int tfrecord_source_open_(dstage **out, const loom_source_spec *src, const loom_data_ctx *ctx, loom_err *err);

static dstage *last(const loom_iter *it) { return it->st[it->n - 1]; }

void loom_iter_close(loom_iter *it)
{
    if (!it) return;
    for (int i = it->n - 1; i >= 0; i--) it->st[i]->ops->close(it->st[i]);
    dpool_free_(it->pool); /* after the stages: each waits for its own calls */
    loom_free(it);
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
    int rc;
    switch (spec->source.kind) {
    case LOOM_SRC_TFRECORD: rc = tfrecord_source_open_(&it->st[0], &spec->source, ctx, err); break;
    case LOOM_SRC_CSV: rc = csv_source_open_(&it->st[0], &spec->source, err); break;
    case LOOM_SRC_TEXT: rc = text_source_open_(&it->st[0], &spec->source, err); break;
    case LOOM_SRC_SYNTHETIC: rc = synthetic_source_open_(&it->st[0], &spec->source, ctx, err); break;
    default: rc = source_open_(&it->st[0], &spec->source, err); break;
    }
    if (rc) goto fail;
    it->n = 1;
    int threads = ctx->threads;
    for (int i = 0; i < spec->n_transforms; i++) {
        const loom_transform_spec *t = &spec->transform[i];
        dstage *in = last(it), *s = NULL;
        int id = i + 1;
        switch (t->kind) {
        case LOOM_T_MAP:
            rc = t->parallel > 1 || t->parallel == LOOM_PARALLEL_AUTO ? parmap_open_(&s, in, id, t, ctx, &it->pool, err)
                                                                     : map_open_(&s, in, id, t, ctx, err);
            break;
        case LOOM_T_SHUFFLE: rc = shuffle_open_(&s, in, id, t, ctx, err); break;
        case LOOM_T_BATCH: rc = batch_open_(&s, in, id, t, err); break;
        case LOOM_T_REPEAT: rc = repeat_open_(&s, in, id, t, err); break;
        case LOOM_T_TAKE: rc = take_open_(&s, in, id, t, err); break;
        case LOOM_T_SKIP: rc = skip_open_(&s, in, id, t, err); break;
        case LOOM_T_PREFETCH:
            rc = prefetch_open_(&s, in, id, t, threads > 0, err);
            if (!rc && threads > 0 && t->buffer != 0) threads--;
            break;
        case LOOM_T_FILTER: rc = filter_open_(&s, in, id, t, err); break;
        case LOOM_T_SHARD: rc = shard_open_(&s, in, id, t, err); break;
        case LOOM_T_ENUMERATE: rc = enumerate_open_(&s, in, id, t, err); break;
        case LOOM_T_UNBATCH: rc = unbatch_open_(&s, in, id, t, err); break;
        case LOOM_T_PADDED_BATCH: rc = padded_batch_open_(&s, in, id, t, err); break;
        case LOOM_T_CACHE: rc = cache_open_(&s, in, id, t, &spec->source, err); break;
        default: {
            char where[LOOM_PATH_MAX + 16] = "";
            if (t->loc.file[0]) snprintf(where, sizeof where, "%s:%d", t->loc.file, t->loc.line);
            rc = loom_err_set(err, LOOM_ECONFIG, where, "unknown transform kind %d", (int)t->kind);
        }
        }
        if (rc) goto fail;
        it->st[it->n++] = s;
    }
    size_t k = 0;
    for (int i = 0; i < it->n && k < sizeof it->fp; i++)
        k += (size_t)snprintf(it->fp + k, sizeof it->fp - k, "%s%s", i ? " | " : "", it->st[i]->desc);
    if (k < sizeof it->fp) {
        k += (size_t)snprintf(it->fp + k, sizeof it->fp - k, " => ");
        if (k < sizeof it->fp) loom_elem_spec_str(&last(it)->spec, it->fp + k, sizeof it->fp - k);
    }
    *out = it;
    return LOOM_OK;
fail:
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
