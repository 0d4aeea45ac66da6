/* tensor.c - dtypes, shapes, host tensors, the CPU backend. */
#include "tensor.h"

#include <stdio.h>
#include <string.h>

static const struct {
    const char *name;
    size_t      size;
} dtypes[LOOM_NDTYPES_] = {
    [LOOM_U8] = {"uint8", 1}, [LOOM_I32] = {"int32", 4}, [LOOM_I64] = {"int64", 8},
    [LOOM_F32] = {"float32", 4}, [LOOM_F64] = {"float64", 8},
};

size_t loom_dtype_size(loom_dtype t) { return (unsigned)t < LOOM_NDTYPES_ ? dtypes[t].size : 0; }
const char *loom_dtype_name(loom_dtype t) { return (unsigned)t < LOOM_NDTYPES_ ? dtypes[t].name : "?"; }

int loom_dtype_parse(const char *s)
{
    for (int i = 0; i < LOOM_NDTYPES_; i++)
        if (!strcmp(s, dtypes[i].name)) return i;
    return -1;
}

int loom_shape_numel_checked(const loom_shape *s, int64_t max, int64_t *numel)
{
    int64_t n = 1;
    *numel = -1;
    if (s->rank < 0 || s->rank > LOOM_MAX_RANK) return -1;
    for (int i = 0; i < s->rank; i++) {
        int64_t d = s->dim[i];
        if (d < 0) return -1;
        /* checked in order, so a product that overflows before a zero dim is refused too */
        if (d && n > INT64_MAX / d) return -1;
        n *= d;
    }
    if (max >= 0 && n > max) return -1;
    *numel = n;
    return 0;
}

int loom_shape_nbytes_checked(const loom_shape *s, loom_dtype dt, size_t max_bytes, size_t *nbytes)
{
    int64_t n;
    size_t es = loom_dtype_size(dt);
    *nbytes = 0;
    if (!es || loom_shape_numel_checked(s, -1, &n)) return -1;
    if ((uint64_t)n > SIZE_MAX / es || (size_t)n * es > max_bytes) return -1;
    *nbytes = (size_t)n * es;
    return 0;
}

int64_t loom_shape_numel(const loom_shape *s)
{
    int64_t n;
    return loom_shape_numel_checked(s, -1, &n) ? -1 : n;
}

bool loom_shape_eq(const loom_shape *a, const loom_shape *b)
{
    if (a->rank != b->rank) return false;
    for (int i = 0; i < a->rank; i++)
        if (a->dim[i] != b->dim[i]) return false;
    return true;
}

char *loom_shape_str(const loom_shape *s, char *buf, size_t n)
{
    size_t k = 0;
    k += (size_t)snprintf(buf + k, n - k, "(");
    for (int i = 0; i < s->rank && k < n; i++)
        k += (size_t)snprintf(buf + k, n - k, i ? ", %lld" : "%lld", (long long)s->dim[i]);
    if (k < n) snprintf(buf + k, n - k, s->rank == 1 ? ",)" : ")");
    return buf;
}

loom_shape loom_shape_make(int rank, const int64_t *dims)
{
    loom_shape s = {0};
    LOOM_ASSERT(rank >= 0 && rank <= LOOM_MAX_RANK);
    s.rank = rank;
    for (int i = 0; i < rank; i++) s.dim[i] = dims[i];
    return s;
}

int loom_tensor_init(loom_tensor *t, loom_dtype dt, const loom_shape *s, loom_err *err)
{
    t->dtype = dt;
    t->shape = *s;
    size_t n = (size_t)loom_shape_numel(s) * loom_dtype_size(dt);
    t->data = loom_alloc_aligned(n);
    t->owns = 1;
    if (!t->data) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a tensor of %zu bytes", n);
    memset(t->data, 0, n);
    return LOOM_OK;
}

void loom_tensor_fini(loom_tensor *t)
{
    if (t->owns) loom_free(t->data);
    t->data = NULL;
    t->owns = 0;
}

size_t loom_tensor_nbytes(const loom_tensor *t) { return (size_t)loom_shape_numel(&t->shape) * loom_dtype_size(t->dtype); }

double loom_tensor_get(const loom_tensor *t, int64_t i)
{
    switch (t->dtype) {
    case LOOM_U8: return ((const uint8_t *)t->data)[i];
    case LOOM_I32: return ((const int32_t *)t->data)[i];
    case LOOM_I64: return (double)((const int64_t *)t->data)[i];
    case LOOM_F32: return ((const float *)t->data)[i];
    case LOOM_F64: return ((const double *)t->data)[i];
    default: LOOM_ASSERT(!"bad dtype");
    }
}
