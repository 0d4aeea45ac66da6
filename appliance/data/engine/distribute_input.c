/* distribute_input.c - distributed input hooks (tf_semantics 4.11, 5.3): the
 * per-replica batch size and the per-replica split of a global batch, and the
 * auto-sharding of one of several input pipelines by its dataset's
 * shard_policy: FILE gives pipeline i the files i, i + N, ... of the source's
 * sorted list (tfrecord, csv, text, list_files; before any file shuffle, so
 * each pipeline shuffles its own files); DATA keeps the final elements p with p % N == i, placed as TF does
 * before any trailing prefetch; AUTO is FILE when there are at least as many
 * files as pipelines, else DATA; OFF gives every pipeline everything. A
 * pipeline that would get nothing is an error naming it, never an empty pass.
 * Threads: none of its own; the DATA stage runs on whichever thread drives it. */
#include "data/data_internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static int n_pipelines(const loom_input_ctx *ic) { return ic->num_input_pipelines > 0 ? ic->num_input_pipelines : 1; }
static int n_replicas(const loom_input_ctx *ic) { return ic->num_replicas_in_sync > 0 ? ic->num_replicas_in_sync : 1; }

static int check_ctx(const loom_input_ctx *ic, loom_err *err)
{
    if (ic->num_input_pipelines < 0 || ic->num_replicas_in_sync < 0 || ic->input_pipeline_id < 0 ||
        ic->input_pipeline_id >= n_pipelines(ic))
        return loom_err_set(err, LOOM_EUSAGE, NULL,
                            "input context out of range: pipeline id %d of %d pipelines, %d replicas in sync "
                            "(expected 0 <= id < pipelines)",
                            ic->input_pipeline_id, ic->num_input_pipelines, ic->num_replicas_in_sync);
    return LOOM_OK;
}

int loom_input_per_replica_batch(const loom_input_ctx *ic, int64_t global_batch, int64_t *out, loom_err *err)
{
    int rc = check_ctx(ic, err);
    if (rc) return rc;
    int64_t r = n_replicas(ic);
    if (global_batch < 1 || global_batch % r) {
        loom_err_set(err, LOOM_ECONFIG, NULL,
                     "the global batch size %lld is not divisible by the number of replicas in sync (%lld)",
                     (long long)global_batch, (long long)r);
        return loom_err_hint(err, "use a global batch size that is a multiple of %lld, e.g. %lld", (long long)r,
                             (long long)(global_batch > r ? global_batch / r * r : r));
    }
    *out = global_batch / r;
    return LOOM_OK;
}

int loom_batch_split(const loom_elem *b, int replicas, int r, loom_elem *out, loom_err *err)
{
    if (replicas < 1 || r < 0 || r >= replicas)
        return loom_err_set(err, LOOM_EUSAGE, NULL, "replica %d of %d is out of range", r, replicas);
    if (b->n < 1 || b->t[0].shape.rank < 1)
        return loom_err_set(err, LOOM_ESHAPE, NULL, "only a batch can be split among replicas (got an unbatched element)");
    int64_t n = b->t[0].shape.dim[0];
    for (int f = 1; f < b->n; f++)
        if (b->t[f].shape.rank < 1 || b->t[f].shape.dim[0] != n)
            return loom_err_set(err, LOOM_ESHAPE, NULL, "tensor %d of the batch has a leading dim other than %lld", f,
                                (long long)n);
    int64_t c = (n + replicas - 1) / replicas, lo = c * r, hi = lo + c;
    if (lo > n) lo = n;
    if (hi > n) hi = n;
    out->n = b->n;
    for (int f = 0; f < b->n; f++) {
        const loom_tensor *t = &b->t[f];
        size_t row = (size_t)(loom_shape_numel(&t->shape) / (n > 0 ? n : 1)) * loom_dtype_size(t->dtype);
        out->t[f] = (loom_tensor){.dtype = t->dtype, .shape = t->shape, .owns = 0};
        out->t[f].shape.dim[0] = hi - lo;
        out->t[f].data = n > 0 ? (uint8_t *)t->data + (size_t)lo * row : t->data;
    }
    return LOOM_OK;
}

/* ---- the plan: what this pipeline reads ------------------------------------------- */

static const char *policy_name(loom_shard_policy p)
{
    static const char *const names[] = {"auto", "file", "data", "off"};
    return (unsigned)p < 4 ? names[p] : "?";
}

/* Sources whose files source_files_expand_ lists (and dinput_keep_files_ shards). */
static bool file_based(loom_source_kind k)
{
    return k == LOOM_SRC_TFRECORD || k == LOOM_SRC_CSV || k == LOOM_SRC_TEXT || k == LOOM_SRC_LIST_FILES;
}

/* An error located at the dataset (data.train), naming this pipeline. */
static int plan_err(const loom_dataset_spec *spec, const loom_input_ctx *ic, loom_err *err, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int plan_err(const loom_dataset_spec *spec, const loom_input_ctx *ic, loom_err *err, const char *fmt, ...)
{
    char msg[400], where[LOOM_PATH_MAX + 16];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return loom_err_set(err, LOOM_ECONFIG, loom_loc_str(&spec->loc, where, sizeof where), "%s: input pipeline %d of %d %s",
                        spec->loc.path[0] ? spec->loc.path : "data", ic->input_pipeline_id, n_pipelines(ic), msg);
}

/* DATA needs every pipeline to see the same order (TF's requirement too, unchecked
 * there): a map or interleave with deterministic = false would make the shares
 * overlap and miss elements. */
static int check_deterministic(const loom_dataset_spec *spec, const loom_input_ctx *ic, loom_err *err)
{
    for (int i = 0; i < spec->n_transforms; i++) {
        const loom_transform_spec *t = &spec->transform[i];
        if ((t->kind != LOOM_T_MAP && t->kind != LOOM_T_INTERLEAVE) || t->parallel == 1 || t->parallel == 0 ||
            t->deterministic)
            continue;
        plan_err(spec, ic, err, "cannot shard by DATA: transforms.[%d] has deterministic = false, so the pipelines "
                 "would not see one order and their shares would overlap", i);
        return loom_err_hint(err, "set deterministic = true there, or use shard_policy = \"file\" (more files than "
                             "pipelines) or \"off\"");
    }
    return LOOM_OK;
}

/* "pipeline 4 gets none" / "pipelines 3 to 4 get none" for pipelines have..n-1, into buf. */
static const char *starved_str(int64_t have, int n, char *buf, size_t len)
{
    if (have == n - 1) snprintf(buf, len, "pipeline %d gets none", n - 1);
    else snprintf(buf, len, "pipelines %lld to %d get none", (long long)have, n - 1);
    return buf;
}

int dinput_plan_(dinput_plan *p, const loom_dataset_spec *spec, const loom_data_ctx *ctx, bool warn, loom_err *err)
{
    memset(p, 0, sizeof *p);
    p->policy = LOOM_SHARD_OFF;
    p->data_at = -1;
    p->n_files = -1;
    if (!ctx) return LOOM_OK;
    const loom_input_ctx *ic = &ctx->input;
    int rc = check_ctx(ic, err);
    if (rc) return rc;
    p->n = n_pipelines(ic);
    p->id = ic->input_pipeline_id;
    if (p->n == 1 || spec->shard_policy == LOOM_SHARD_OFF) return LOOM_OK;
    const loom_source_spec *src = &spec->source;
    const char *path = spec->loc.path[0] ? spec->loc.path : "data";
    if (!file_based(src->kind)) {
        if (spec->shard_policy == LOOM_SHARD_FILE) {
            plan_err(spec, ic, err, "cannot be sharded by FILE: this source has no list of files to split");
            return loom_err_hint(err, "set %s.shard_policy = \"data\" (each pipeline keeps 1 element in %d) or \"off\"",
                                 path, p->n);
        }
        if (spec->shard_policy == LOOM_SHARD_AUTO && warn)
            loom_warn("%s: shard_policy auto: the source has no file list, so each of the %d input pipelines reads "
                      "everything and keeps 1 element in %d (DATA)", path, p->n, p->n);
    } else if (spec->shard_policy != LOOM_SHARD_DATA) {
        dstage probe;
        memset(&probe, 0, sizeof probe);
        dstage_init_(&probe, NULL, NULL, 0, &src->loc);
        char **files;
        rc = source_files_expand_(&probe, src, "input", &files, &p->n_files, err);
        source_files_free_(files, p->n_files);
        if (rc) return rc;
        if (p->n_files >= p->n) {
            p->policy = LOOM_SHARD_FILE;
            if (!(p->source = loom_alloc(sizeof *p->source)))
                return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the sharded source spec");
            *p->source = *src;
            p->source->file_shards = p->n;
            p->source->file_shard = p->id;
            return LOOM_OK;
        }
        if (spec->shard_policy == LOOM_SHARD_FILE) {
            char starved[64];
            plan_err(spec, ic, err, "would receive no data: shard_policy \"file\" splits %lld file%s among %d pipelines, so %s",
                     (long long)p->n_files, p->n_files == 1 ? "" : "s", p->n, starved_str(p->n_files, p->n, starved, 64));
            return loom_err_hint(err, "write at least %d files (loom records convert --shards %d), or set "
                                 "%s.shard_policy = \"data\" or \"off\"", p->n, p->n, path);
        }
        if (warn)
            loom_warn("%s: shard_policy auto: %lld file%s for %d input pipelines, so each reads every file and keeps "
                      "1 element in %d (DATA)", path, (long long)p->n_files, p->n_files == 1 ? "" : "s", p->n, p->n);
    }
    /* DATA: before the trailing prefetches, so each keeps prefetching whole shares (auto_shard.cc) */
    p->policy = LOOM_SHARD_DATA;
    p->data_at = spec->n_transforms;
    while (p->data_at > 0 && spec->transform[p->data_at - 1].kind == LOOM_T_PREFETCH) p->data_at--;
    return check_deterministic(spec, ic, err);
}

void dinput_plan_fini_(dinput_plan *p) { loom_free(p->source); }


/* ---- DATA: the shard stage ------------------------------------------------------------ */

typedef struct datashard {
    dstage  s;
    int64_t n, index;
    int64_t pos;   /* input elements consumed this pass */
    int64_t kept;  /* elements given out this pass */
    int64_t epoch;
    char    what[200]; /* "data.train: input pipeline 3 of 4", for errors */
} datashard;

static int ds_next(dstage *st, loom_elem **out, loom_err *err)
{
    datashard *s = (datashard *)st;
    for (;;) {
        loom_elem *e;
        int rc = dstage_next_(st->in, &e, err);
        if (rc == LOOM_EEOF && !s->kept && s->pos > 0) {
            loom_err_set(err, LOOM_EDATA, st->where,
                         "%s received no data in epoch %lld: shard_policy \"data\" keeps 1 element in %lld and "
                         "the dataset ended after %lld",
                         s->what, (long long)s->epoch, (long long)s->n, (long long)s->pos);
            return loom_err_hint(err, "give the dataset at least %lld elements (batches), e.g. a smaller batch size or "
                                 "more data", (long long)s->n);
        }
        if (rc) return rc;
        if (s->pos++ % s->n != s->index) continue;
        s->kept++;
        memcpy(st->mut, st->in->mut, sizeof st->mut);
        *out = e;
        return LOOM_OK;
    }
}

static int ds_rewind(dstage *st, int64_t epoch, loom_err *err)
{
    datashard *s = (datashard *)st;
    s->pos = s->kept = 0;
    s->epoch = epoch;
    return st->in->ops->rewind(st->in, epoch, err);
}

static void ds_save(dstage *st, loom_buf *b)
{
    datashard *s = (datashard *)st;
    loom_buf_put_i64(b, s->pos);
    loom_buf_put_i64(b, s->kept);
    loom_buf_put_i64(b, s->epoch);
}

static int ds_restore(dstage *st, loom_buf *b, loom_err *err)
{
    datashard *s = (datashard *)st;
    int64_t pos = loom_buf_get_i64(b), kept = loom_buf_get_i64(b), epoch = loom_buf_get_i64(b);
    if (b->failed || pos < 0 || kept < 0 || kept > pos || epoch < 0)
        return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "iterator state is corrupt: auto-shard position %lld, kept %lld",
                            (long long)pos, (long long)kept);
    s->pos = pos;
    s->kept = kept;
    s->epoch = epoch;
    return LOOM_OK;
}

static const dstage_ops datashard_ops = {
    .next = ds_next, .rewind = ds_rewind, .save = ds_save, .restore = ds_restore, .close = dstage_free_,
};

int dinput_shard_open_(dstage **out, dstage *in, const dinput_plan *p, const loom_dataset_spec *spec, loom_err *err)
{
    *out = NULL;
    int64_t c = in->card;
    if (c >= 0 && c < p->n) {
        const loom_input_ctx ic = {.num_input_pipelines = p->n, .input_pipeline_id = p->id};
        const char *path = spec->loc.path[0] ? spec->loc.path : "data";
        char starved[64];
        plan_err(spec, &ic, err,
                 "would receive no data: shard_policy \"%s\" keeps 1 element (batch) in %d and the dataset has only "
                 "%lld, so %s", policy_name(spec->shard_policy), p->n, (long long)c, starved_str(c, p->n, starved, 64));
        return loom_err_hint(err, "give the dataset at least %d elements (e.g. a smaller batch size), or set "
                             "%s.shard_policy = \"off\"%s", p->n, path,
                             file_based(spec->source.kind) ? " or split it into more files" : "");
    }
    datashard *s = loom_calloc(1, sizeof *s);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the auto-shard stage");
    dstage *st = &s->s;
    /* an id past every transform's: the stages after it keep their RNG streams */
    dstage_init_(st, &datashard_ops, in, LOOM_MAX_TRANSFORMS + 1, &spec->loc);
    s->n = p->n;
    s->index = p->id;
    snprintf(s->what, sizeof s->what, "%s: input pipeline %d of %d", spec->loc.path[0] ? spec->loc.path : "data", p->id,
             p->n);
    snprintf(st->name, sizeof st->name, "auto_shard(data %d/%d)", p->id, p->n);
    snprintf(st->desc, sizeof st->desc, "auto_shard(data,%d,%d)", p->n, p->id);
    st->card = c < 0 ? c : c / s->n + (s->index < c % s->n ? 1 : 0);
    *out = st;
    return LOOM_OK;
}

/* ---- report ------------------------------------------------------------------------------ */

int loom_data_input_report(const loom_dataset_spec *ds, const loom_data_ctx *ctx, FILE *f, loom_err *err)
{
    dinput_plan p;
    int rc = dinput_plan_(&p, ds, ctx, false, err);
    if (rc) return rc;
    fprintf(f, "input pipeline %d of %d: shard_policy \"%s\" applies %s\n", p.id, p.n ? p.n : 1,
            policy_name(ds->shard_policy), p.n > 1 ? policy_name(p.policy) : "nothing (one pipeline)");
    if (p.policy == LOOM_SHARD_FILE) {
        dstage probe;
        memset(&probe, 0, sizeof probe);
        dstage_init_(&probe, NULL, NULL, 0, &p.source->loc);
        char **files;
        int64_t n;
        rc = source_files_expand_(&probe, p.source, "input", &files, &n, err);
        if (!rc) {
            fprintf(f, "input pipeline %d of %d: %lld of %lld files:\n", p.id, p.n, (long long)n, (long long)p.n_files);
            for (int64_t i = 0; i < n; i++) fprintf(f, "  %s\n", files[i]);
        }
        source_files_free_(files, n);
    } else if (p.policy == LOOM_SHARD_DATA) {
        const char *at = p.data_at < ds->n_transforms ? "before the trailing prefetch" : "after the last transform";
        fprintf(f, "input pipeline %d of %d: the final elements p with p %% %d == %d (%s)\n", p.id, p.n, p.n, p.id, at);
    }
    dinput_plan_fini_(&p);
    return rc;
}
