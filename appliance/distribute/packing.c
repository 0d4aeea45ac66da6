/* packing.c - gradient packing as tf.distribute does it: which ranges of the
 * flat gradient buffer are all-reduced together. The parameters of a model
 * tile one flat buffer in layer order, so every pack is a contiguous range
 * and needs no concatenation: the strategy all-reduces the range in place.
 * Splitting into packs changes nothing in an element's result for
 * reduce_to_one_device and hierarchical_copy; for the ring it moves the
 * segment boundaries, so the summation order of some elements (still fixed
 * per plan, so runs stay bit-identical). */
#include "distribute.h"

#include <string.h>

/* Appends a pack, or (tensor ranges) extends the last one downwards. */
static loom_pack *add_pack(loom_pack *p, int *n, int64_t offset, int64_t count, int first, int last)
{
    p[*n] = (loom_pack){.offset = offset, .count = count, .first = first, .last = last};
    return &p[(*n)++];
}

/* The tensor holding float `at` (the tensors tile the buffer in order). */
static int tensor_at(const int64_t *start, int n, int64_t at)
{
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (start[mid] <= at)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

int loom_pack_plan(const loom_param_info *params, int n, int64_t bytes_per_pack, int num_packs, loom_pack **out,
                   int *n_out, loom_err *err)
{
    *out = NULL;
    *n_out = 0;
    LOOM_ASSERT(n >= 1 && bytes_per_pack >= 0 && num_packs >= 0);
    int64_t *start = loom_alloc((size_t)n * sizeof *start);
    /* at most one pack per tensor, or num_packs */
    loom_pack *p = loom_calloc((size_t)(n > num_packs ? n : num_packs), sizeof *p);
    if (!start || !p) {
        loom_free(start);
        loom_free(p);
        return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating a pack plan of %d tensors", n);
    }
    int64_t total = 0;
    for (int i = 0; i < n; i++) {
        if (params[i].offset != total) {
            loom_free(start);
            loom_free(p);
            return loom_err_set(err, LOOM_ESHAPE, params[i].name,
                                "parameter tensor at offset %lld, expected %lld: tensors must tile the flat buffer",
                                (long long)params[i].offset, (long long)total);
        }
        start[i] = total;
        total += loom_shape_numel(&params[i].shape);
    }
    int np = 0;
    if (bytes_per_pack > 0) {
        int64_t bytes = 0;
        loom_pack *cur = NULL;
        for (int i = n - 1; i >= 0; i--) { /* reversed: the gradients backprop finishes first */
            int64_t m = loom_shape_numel(&params[i].shape);
            if (!cur || bytes > bytes_per_pack) {
                cur = add_pack(p, &np, start[i] + m, 0, i, i);
                bytes = 0;
            }
            cur->offset -= m;
            cur->count += m;
            cur->first = i;
            bytes += m * (int64_t)sizeof(float);
        }
    } else if (num_packs == 0) {
        for (int i = n - 1; i >= 0; i--) add_pack(p, &np, start[i], loom_shape_numel(&params[i].shape), i, i);
    } else {
        int64_t chunk = total / num_packs;
        for (int k = num_packs - 1; k >= 0; k--) {
            int64_t off = chunk * k, m = k == num_packs - 1 ? total - chunk * k : chunk;
            if (m > 0) add_pack(p, &np, off, m, tensor_at(start, n, off), tensor_at(start, n, off + m - 1));
        }
    }
    loom_free(start);
    *out = p;
    *n_out = np;
    return LOOM_OK;
}
