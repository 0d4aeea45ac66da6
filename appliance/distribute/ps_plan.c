/* ps_plan.c - parameter_server's variable placement: partitioners and the
 * round-robin over ps tasks (see ps_internal.h; TF's arithmetic in
 * tf_semantics 5.8). Pure functions; no threads. */
#include "ps_internal.h"

#include <stdio.h>
#include <string.h>

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

int64_t loom_ps_num_shards_(const loom_partitioner_spec *p, int64_t rows, int64_t elems)
{
    if (!p || rows <= 1) return 1;
    int64_t bytes = elems * (int64_t)sizeof(float);
    switch (p->kind) {
    case LOOM_PARTITIONER_FIXED: /* FixedShardsPartitioner: min(num_shards, rows) */
        return max64(1, min64(p->num_shards, rows));
    case LOOM_PARTITIONER_MIN_SIZE: { /* MinSizePartitioner: max(1, min(rows, max_shards, ceil(bytes / min))) */
        int64_t k = ceil_div(bytes, p->min_shard_bytes);
        k = min64(k, rows);
        if (p->max_shards > 0) k = min64(k, p->max_shards);
        return max64(1, k);
    }
    case LOOM_PARTITIONER_MAX_SIZE: { /* MaxSizePartitioner: rows per shard from the bytes of one row */
        int64_t row_bytes = (elems / rows) * (int64_t)sizeof(float);
        int64_t per = max64(1, p->max_shard_bytes / max64(1, row_bytes));
        int64_t k = ceil_div(rows, per);
        if (p->max_shards > 0) k = min64(k, p->max_shards);
        return max64(1, k);
    }
    default: return 1;
    }
}

void loom_ps_shard_rows_(int64_t rows, int64_t k, int64_t i, int64_t *row0, int64_t *n)
{
    int64_t base = rows / k, extra = rows % k;
    *n = base + (i < extra ? 1 : 0);
    *row0 = i * base + min64(i, extra);
}

static int64_t elems_of(const loom_shape *s)
{
    int64_t e = 1;
    for (int d = 0; d < s->rank; d++) e *= s->dim[d];
    return e;
}

int loom_ps_plan_make_(loom_ps_plan *out, const loom_param_info *params, int n, int n_ps,
                       const loom_partitioner_spec *p, const char *where, loom_err *err)
{
    memset(out, 0, sizeof *out);
    LOOM_ASSERT(n_ps >= 1);
    if (p && p->kind == LOOM_PARTITIONER_FIXED) {
        int64_t most = 0;
        int at = 0;
        for (int v = 0; v < n; v++) {
            int64_t rows = params[v].shape.rank ? params[v].shape.dim[0] : 1;
            if (rows > most) most = rows, at = v;
        }
        if (p->num_shards > most)
            return loom_err_set(err, LOOM_ECONFIG, where, "strategy.variable_partitioner.num_shards = %lld, but the "
                                "largest variable, %s, has %lld rows: no variable could have that many shards",
                                (long long)p->num_shards, n ? params[at].name : "(none)", (long long)most),
                   loom_err_hint(err, "use num_shards <= %lld (a shard holds whole rows of axis 0)", (long long)most);
    }
    int64_t total_shards = 0;
    for (int v = 0; v < n; v++) {
        const loom_shape *s = &params[v].shape;
        total_shards += loom_ps_num_shards_(p, s->rank ? s->dim[0] : 1, elems_of(s));
    }
    out->n_ps = n_ps;
    out->shard = loom_calloc((size_t)(total_shards ? total_shards : 1), sizeof *out->shard);
    out->ps_floats = loom_calloc((size_t)n_ps, sizeof *out->ps_floats);
    if (!out->shard || !out->ps_floats) {
        loom_ps_plan_free_(out);
        return loom_err_set(err, LOOM_ENOMEM, NULL, "planning %lld shards", (long long)total_shards);
    }
    int rr = 0; /* the round-robin counter: every variable or shard takes the next ps */
    for (int v = 0; v < n; v++) {
        const loom_shape *s = &params[v].shape;
        int64_t rows = s->rank ? s->dim[0] : 1, elems = elems_of(s);
        int64_t k = loom_ps_num_shards_(p, rows, elems);
        if (p && p->kind == LOOM_PARTITIONER_FIXED && k < p->num_shards) out->n_capped++;
        int64_t row_size = rows ? elems / rows : 0;
        for (int64_t i = 0; i < k; i++) {
            loom_ps_shard *sh = &out->shard[out->n_shards++];
            sh->var = v;
            sh->index = (int)i;
            sh->of = (int)k;
            loom_ps_shard_rows_(rows, k, i, &sh->row0, &sh->rows);
            sh->row_size = row_size;
            sh->offset = params[v].offset + sh->row0 * row_size;
            sh->count = sh->rows * row_size;
            sh->ps = rr++ % n_ps;
            sh->local = out->ps_floats[sh->ps];
            out->ps_floats[sh->ps] += sh->count;
        }
    }
    return LOOM_OK;
}

void loom_ps_plan_free_(loom_ps_plan *p)
{
    if (!p) return;
    loom_free(p->shard);
    loom_free(p->ps_floats);
    memset(p, 0, sizeof *p);
}

static void bytes_str(int64_t b, char *buf, size_t n)
{
    if (b >= 10 << 20) snprintf(buf, n, "%.1f MiB", (double)b / (1 << 20));
    else if (b >= 10 << 10) snprintf(buf, n, "%.1f KiB", (double)b / (1 << 10));
    else snprintf(buf, n, "%lld B", (long long)b);
}

void loom_ps_plan_print_(const loom_ps_plan *p, const loom_param_info *params, int n_slots, FILE *f)
{
    for (int q = 0; q < p->n_ps; q++) {
        char b[32], bs[32];
        bytes_str(p->ps_floats[q] * (int64_t)sizeof(float), b, sizeof b);
        bytes_str(p->ps_floats[q] * (int64_t)sizeof(float) * n_slots, bs, sizeof bs);
        fprintf(f, "  ps:%d holds %s of variables", q, b);
        if (n_slots) fprintf(f, " and %s of optimizer slots beside them", bs);
        fprintf(f, " (%lld floats):\n", (long long)p->ps_floats[q]);
        for (int i = 0; i < p->n_shards; i++) {
            const loom_ps_shard *s = &p->shard[i];
            if (s->ps != q) continue;
            const loom_param_info *v = &params[s->var];
            char shape[64];
            loom_shape_str(&v->shape, shape, sizeof shape);
            if (s->of == 1)
                fprintf(f, "    %s %s\n", v->name, shape);
            else
                fprintf(f, "    %s %s shard %d/%d: rows %lld..%lld (%lld rows)\n", v->name, shape, s->index + 1, s->of,
                        (long long)s->row0, (long long)(s->row0 + s->rows - 1), (long long)s->rows);
        }
    }
    if (p->n_capped)
        fprintf(f, "  %d variable%s had fewer rows than num_shards: split into one shard per row, as TF caps them\n",
                p->n_capped, p->n_capped == 1 ? "" : "s");
}

/* FNV-1a, 64 bits: a stable id of the partitioning, written in checkpoints. */
static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

uint64_t loom_ps_plan_id_(const loom_ps_plan *p, const loom_param_info *params)
{
    uint64_t h = 0xcbf29ce484222325ull;
    int64_t nps = p->n_ps;
    h = fnv(h, &nps, sizeof nps);
    for (int i = 0; i < p->n_shards; i++) {
        const loom_ps_shard *s = &p->shard[i];
        const loom_param_info *v = &params[s->var];
        h = fnv(h, v->name, strlen(v->name) + 1);
        int64_t f[5 + LOOM_MAX_RANK] = {v->shape.rank, s->index, s->of, s->row0, s->rows};
        for (int d = 0; d < v->shape.rank && d < LOOM_MAX_RANK; d++) f[5 + d] = v->shape.dim[d];
        f[4] |= (int64_t)s->ps << 48; /* (rows < 2^48) */
        h = fnv(h, f, sizeof f);
    }
    return h;
}

void loom_ps_record_name_(const loom_ps_plan *p, const loom_param_info *params, int i, char *buf, size_t n)
{
    const loom_ps_shard *s = &p->shard[i];
    if (s->of == 1) snprintf(buf, n, "%s", params[s->var].name);
    else snprintf(buf, n, "%s/part_%d", params[s->var].name, s->index);
}
