/* embedding.c - the embedding layer: id checks, the lookup with its combiner,
 * the sparse gradient of the rows a batch touched.
 * Moved out of layers.c; its file comment (chunks, threads, no allocation) holds. */
#include "nn_internal.h"
#include "kernel_internal.h"

#include <float.h>
#include <math.h>
#include <string.h>

/* ---- embedding ------------------------------------------------------------ */

/* Id e of a batch of ids (int32 or int64, by the model's input dtype). */
static inline int64_t emb_id(const loom_model *m, const void *x, int64_t e)
{
    return m->input_dtype == LOOM_I32 ? (int64_t)((const int32_t *)x)[e] : ((const int64_t *)x)[e];
}

int nn_embedding_check_ids_(const loom_model *m, int li, const void *x, int64_t B, loom_err *err)
{
    const nn_layer_ *l = &m->layer[li];
    const int64_t per = (int64_t)l->cols * l->k;
    for (int64_t e = 0; e < B * per; e++) {
        int64_t id = emb_id(m, x, e);
        if (id >= -1 && id < l->rows) continue;
        return loom_err_set(err, LOOM_EDATA, l->where,
                            "layer \"%s\" (embedding): example %lld of the batch, column %lld: id %lld is outside "
                            "[0, %lld) (input_dim)",
                            l->spec.name, (long long)(e / per), (long long)(e % per / l->k), (long long)id,
                            (long long)l->rows),
               loom_err_hint(err, "hash the ids into [0, input_dim) in the data, or raise input_dim; -1 means no id");
    }
    return LOOM_OK;
}

/* y (B, cols, dim): row c of example b = the sum (or mean) of the table rows
 * of the example's k ids of column c; -1 ids are skipped. */
static inline LOOM_CLONE_BODY void embedding_forward_body(const loom_model *m, const nn_layer_ *l, const void *x,
                                                          int64_t e0, float *restrict y, int64_t B)
{
    const float *T = m->params + l->kernel_off;
    const int D = l->dim, K = l->k;
    for (int64_t r = 0; r < B * l->cols; r++) {
        float *restrict yr = y + r * D;
        int n = 0;
        zero_short(yr, D);
        for (int k = 0; k < K; k++) {
            int64_t id = emb_id(m, x, e0 + r * K + k);
            if (id < 0) continue;
            const float *restrict t = T + id * D;
            for (int j = 0; j < D; j++) yr[j] += t[j];
            n++;
        }
        if (l->spec.combiner == LOOM_COMBINER_MEAN && n > 1) {
            float inv = 1.f / (float)n;
            for (int j = 0; j < D; j++) yr[j] *= inv;
        }
    }
}
LOOM_CLONES(, void, embedding_forward,
            (const loom_model *m, const nn_layer_ *l, const void *x, int64_t e0, float *restrict y, int64_t B),
            (m, l, x, e0, y, B))

/* (the exported name; the clones and their dispatch stay static) */
void nn_embedding_forward_(const loom_model *m, const nn_layer_ *l, const void *x, int64_t e0, float *restrict y,
                           int64_t B)
{
    embedding_forward(m, l, x, e0, y, B);
}

/* The slot of id in the layer's map, inserting it (its gradient row zeroed) when new. */
static int64_t emb_slot(nn_layer_ *l, int64_t id)
{
    uint64_t h = (uint64_t)id * 0x9e3779b97f4a7c15ull;
    int64_t mask = l->hsize - 1;
    for (int64_t i = (int64_t)(h >> 20) & mask;; i = (i + 1) & mask) {
        if (l->hkey[i] == id) return l->hval[i];
        if (l->hkey[i] < 0) {
            int64_t u = l->sp_n++;
            l->hkey[i] = id;
            l->hval[i] = (int32_t)u;
            l->sp_ids[u] = id;
            memset(l->sp_val + u * l->dim, 0, (size_t)l->dim * sizeof(float));
            return u;
        }
    }
}

void nn_embedding_param_grads_(loom_model *m, int li, const void *x, int64_t B)
{
    nn_layer_ *l = &m->layer[li];
    const int D = l->dim, K = l->k;
    float *G = m->grads + l->kernel_off;
    /* the previous batch's rows out of the map and the dense buffer */
    int64_t mask = l->hsize - 1;
    for (int64_t u = 0; u < l->sp_n; u++) {
        uint64_t h = (uint64_t)l->sp_ids[u] * 0x9e3779b97f4a7c15ull;
        for (int64_t i = (int64_t)(h >> 20) & mask;; i = (i + 1) & mask)
            if (l->hkey[i] == l->sp_ids[u]) {
                l->hkey[i] = -1;
                break;
            }
        if (m->sparse_owner) memset(G + l->sp_ids[u] * D, 0, (size_t)D * sizeof *G);
    }
    if (!m->sparse_owner) memset(G, 0, (size_t)(l->rows * D) * sizeof *G);
    /* (each removal probes until it finds its key, so earlier removals never hide a later one) */
    l->sp_n = 0;
    for (int64_t r = 0; r < B * l->cols; r++) {
        const float *restrict g = l->dz + r * D;
        int n = 0;
        if (l->spec.combiner == LOOM_COMBINER_MEAN)
            for (int k = 0; k < K; k++) n += emb_id(m, x, r * K + k) >= 0;
        float scale = n > 1 ? 1.f / (float)n : 1.f;
        for (int k = 0; k < K; k++) {
            int64_t id = emb_id(m, x, r * K + k);
            if (id < 0) continue;
            float *restrict v = l->sp_val + emb_slot(l, id) * D;
            if (scale == 1.f)
                for (int j = 0; j < D; j++) v[j] += g[j];
            else
                for (int j = 0; j < D; j++) v[j] += scale * g[j];
        }
    }
    for (int64_t u = 0; u < l->sp_n; u++)
        memcpy(G + l->sp_ids[u] * D, l->sp_val + u * D, (size_t)D * sizeof *G);
}

/* The time mask of the rows [b0, b0 + B) from their ids x (the chunk's own):
 * id 0 (or -1) is padding (embedding mask_zero). */
void nn_embedding_tmask_(const loom_model *m, const nn_layer_ *l, const void *x, int64_t b0, int64_t B)
{
    for (int64_t e = 0; e < B * l->cols; e++) m->tmask[b0 * l->cols + e] = emb_id(m, x, e) > 0;
}
