/* dropout.c - inverted dropout: its mask from the Philox stream, forward and backward.
 * Moved out of layers.c; its file comment (chunks, threads, no allocation) holds. */
#include "nn_internal.h"
#include "kernel_internal.h"

#include <float.h>
#include <math.h>
#include <string.h>

/* ---- dropout ---------------------------------------------------------------- */

/* Inverted dropout: element e of the batch is kept when word e of the Philox
 * stream keyed by (rng_key, layer index) is >= rate * 2^32, and scaled by
 * 1 / (1 - rate). The mask depends only on (key, layer, position in the
 * whole batch): a chunk starting at element e0 of the batch draws words
 * e0.. of the stream, so the mask does not depend on the chunking. */
void nn_dropout_mask_(const nn_layer_ *l, int li, uint8_t *mk, int64_t e0, int64_t n, uint64_t rng_key)
{
    const uint64_t key = loom_rng_mix(rng_key, (uint64_t)li);
    const uint64_t thr = (uint64_t)(l->spec.rate * 4294967296.0);
    uint32_t w[4];
    for (int64_t e = 0; e < n;) {
        int64_t ge = e0 + e, k0 = ge & 3, lim = 4 - k0 < n - e ? 4 - k0 : n - e;
        loom_philox4x32(key, (uint64_t)ge >> 2, w);
        for (int64_t k = 0; k < lim; k++) mk[e + k] = (uint64_t)w[k0 + k] >= thr;
        e += lim;
    }
}

static inline LOOM_CLONE_BODY void dropout_forward_body(const nn_layer_ *l, int li, const float *restrict x,
                                                        float *restrict y, uint8_t *restrict mk, int64_t e0, int64_t n,
                                                        uint64_t rng_key)
{
    const float scale = (float)(1.0 / (1.0 - l->spec.rate));
    nn_dropout_mask_(l, li, mk, e0, n, rng_key);
    for (int64_t e = 0; e < n; e++) y[e] = mk[e] ? x[e] * scale : 0.f;
}
LOOM_CLONES(, void, dropout_forward,
            (const nn_layer_ *l, int li, const float *restrict x, float *restrict y, uint8_t *restrict mk, int64_t e0,
             int64_t n, uint64_t rng_key),
            (l, li, x, y, mk, e0, n, rng_key))

/* (the exported name; the clones and their dispatch stay static) */
void nn_dropout_forward_(const nn_layer_ *l, int li, const float *restrict x, float *restrict y, uint8_t *restrict mk,
                         int64_t e0, int64_t n, uint64_t rng_key)
{
    dropout_forward(l, li, x, y, mk, e0, n, rng_key);
}

static inline LOOM_CLONE_BODY float *dropout_backward_body(const nn_layer_ *l, const uint8_t *restrict mk,
                                                           float *restrict g, int64_t n)
{
    const float scale = (float)(1.0 / (1.0 - l->spec.rate));
    for (int64_t e = 0; e < n; e++) g[e] = mk[e] ? g[e] * scale : 0.f;
    return g;
}
LOOM_CLONES(, float *, dropout_backward, (const nn_layer_ *l, const uint8_t *restrict mk, float *restrict g, int64_t n),
            (l, mk, g, n))

/* (the exported name; the clones and their dispatch stay static) */
float *nn_dropout_backward_(const nn_layer_ *l, const uint8_t *restrict mk, float *restrict g, int64_t n)
{
    return dropout_backward(l, mk, g, n);
}
