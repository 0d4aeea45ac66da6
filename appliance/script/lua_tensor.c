/* lua_tensor.c - the `loom` Lua module: "loom.tensor" userdata (shape, dtype,
 * element access, and ops that run in C, reusing the data module's kernels)
 * and "loom.rng" userdata over the keyed counter-based RNG.
 * Indices seen from Lua are 1-based, as Lua's own are. Ops return new tensors;
 * only set, fill and fill_rect modify a tensor in place (and return it). */
#include "script_internal.h"

#include <math.h>
#include <string.h>

/* ---- the userdata ---------------------------------------------------------------- */

static ltensor *check_lt(lua_State *L, int idx)
{
    ltensor *lt = luaL_checkudata(L, idx, TENSOR_MT);
    if (!loom_lua_view_live_(loom_lua_from_state(L), lt->gen))
        luaL_error(L, "this tensor was lent for a call that has returned; keep t:copy() to use it later");
    return lt;
}

/* The tensor, made writable: a read-only view is copied into Lua memory first. */
static loom_tensor *writable(lua_State *L, ltensor *lt)
{
    if (lt->ro) {
        size_t n = loom_tensor_nbytes(&lt->t);
        void *p = loom_lua_alloc_(L, n);
        if (n) memcpy(p, lt->t.data, n);
        lt->own = p;
        lt->own_bytes = n;
        lt->t.data = n ? p : (void *)lt;
        lt->ro = 0;
        lt->gen = 0; /* owns its data now: outlives the call */
    }
    return &lt->t;
}

static int lt_gc(lua_State *L)
{
    ltensor *lt = luaL_checkudata(L, 1, TENSOR_MT);
    loom_lua_free_(L, lt->own, lt->own_bytes);
    lt->own = NULL;
    lt->t.data = NULL;
    return 0;
}

/* Bounds on a Lua-made tensor: any one dim and the element count (so
 * index arithmetic, H + 2 * pad and the byte count never overflow). The
 * memory limit (hooks.memory_limit) is what usually stops a big tensor. */
#define MAX_ELEMS ((int64_t)1 << 40)

/* The element count of a shape, raising a Lua error when it is invalid: a
 * negative dim, a dim or a product above MAX_ELEMS, or an int64 overflow. */
static int64_t checked_numel(lua_State *L, const loom_shape *s)
{
    int64_t n;
    int bad = loom_shape_numel_checked(s, MAX_ELEMS, &n);
    for (int d = 0; !bad && d < s->rank; d++) bad = s->dim[d] > MAX_ELEMS;
    if (bad) {
        char b[200];
        luaL_error(L, "shape %s is too large (at most 2^40 elements, and 2^40 along any dim)", loom_shape_str(s, b, sizeof b));
    }
    return n;
}

/* A new Lua-owned tensor; its data is zeroed only when zero is set (ops overwrite it all). */
static ltensor *new_lt_(lua_State *L, loom_dtype dt, const loom_shape *shape, int zero)
{
    size_t bytes;
    checked_numel(L, shape);
    if (loom_shape_nbytes_checked(shape, dt, (size_t)MAX_ELEMS * 8, &bytes)) {
        char b[200];
        luaL_error(L, "tensor %s %s is too large", loom_dtype_name(dt), loom_shape_str(shape, b, sizeof b));
    }
    ltensor *lt = lua_newuserdatauv(L, sizeof *lt, 0);
    memset(lt, 0, sizeof *lt);
    luaL_setmetatable(L, TENSOR_MT);
    lt->t.dtype = dt;
    lt->t.shape = *shape;
    lt->own = loom_lua_alloc_(L, bytes);
    lt->own_bytes = bytes;
    if (bytes && zero) memset(lt->own, 0, bytes);
    lt->t.data = bytes ? lt->own : (void *)lt; /* never NULL: kernels memcpy/memset 0 bytes from it */
    return lt;
}
#define new_lt(L, dt, shape) new_lt_(L, dt, shape, 0)

loom_tensor *loom_lua_push_tensor(lua_State *L, loom_dtype dt, const loom_shape *shape) { return &new_lt_(L, dt, shape, 1)->t; }

void loom_lua_push_view(lua_State *L, const loom_tensor *t, bool writable_view)
{
    ltensor *lt = lua_newuserdatauv(L, sizeof *lt, 0);
    memset(lt, 0, sizeof *lt);
    luaL_setmetatable(L, TENSOR_MT);
    lt->t = *t;
    lt->t.owns = 0;
    lt->gen = loom_lua_from_state(L)->gen;
    lt->ro = !writable_view;
}

const loom_tensor *loom_lua_to_tensor(lua_State *L, int idx)
{
    ltensor *lt = luaL_testudata(L, idx, TENSOR_MT);
    if (!lt || !loom_lua_view_live_(loom_lua_from_state(L), lt->gen)) return NULL;
    return &lt->t;
}

const loom_tensor *loom_lua_check_tensor(lua_State *L, int idx) { return &check_lt(L, idx)->t; }

void loom_lua_push_elem(lua_State *L, const loom_elem_spec *spec, const loom_elem *e, bool writable_view)
{
    lua_createtable(L, 0, e->n);
    for (int i = 0; i < e->n; i++) {
        loom_lua_push_view(L, &e->t[i], writable_view);
        lua_setfield(L, -2, spec->name[i]);
    }
}

/* ---- arguments --------------------------------------------------------------------- */

static loom_dtype check_dtype(lua_State *L, int idx)
{
    const char *s = luaL_checkstring(L, idx);
    int d = loom_dtype_parse(s);
    if (d < 0) luaL_argerror(L, idx, lua_pushfstring(L, "unknown dtype \"%s\" (uint8, int32, int64, float32, float64)", s));
    return (loom_dtype)d;
}

static loom_shape check_shape(lua_State *L, int idx)
{
    luaL_checktype(L, idx, LUA_TTABLE);
    loom_shape s = {0};
    lua_Integer n = luaL_len(L, idx);
    if (n > LOOM_MAX_RANK) luaL_argerror(L, idx, "more than 8 dimensions");
    s.rank = (int)n;
    for (int d = 0; d < s.rank; d++) {
        lua_geti(L, idx, d + 1);
        int ok;
        lua_Integer v = lua_tointegerx(L, -1, &ok);
        if (!ok || v < 0) luaL_argerror(L, idx, "dimensions must be integers >= 0");
        s.dim[d] = v;
        lua_pop(L, 1);
    }
    checked_numel(L, &s);
    return s;
}

static void push_shape(lua_State *L, const loom_shape *s)
{
    lua_createtable(L, s->rank, 0);
    for (int d = 0; d < s->rank; d++) {
        lua_pushinteger(L, s->dim[d]);
        lua_rawseti(L, -2, d + 1);
    }
}

static void set_value(loom_tensor *t, int64_t i, double v)
{
    size_t es = loom_dtype_size(t->dtype);
    loom_data_convert(&v, LOOM_F64, (uint8_t *)t->data + (size_t)i * es, t->dtype, 1);
}

static void push_value(lua_State *L, const loom_tensor *t, int64_t i)
{
    double v = loom_tensor_get(t, i);
    if (t->dtype == LOOM_F32 || t->dtype == LOOM_F64) lua_pushnumber(L, v);
    else lua_pushinteger(L, (lua_Integer)v);
}

/* The 0-based flat index given by n 1-based indices from argument first on:
 * one flat index, or one per dimension. */
static int64_t check_index(lua_State *L, const loom_tensor *t, int first, int n)
{
    int64_t numel = checked_numel(L, &t->shape);
    if (numel == 0) luaL_error(L, "the tensor is empty: it has no element to index");
    if (n == 1) {
        lua_Integer i = luaL_checkinteger(L, first);
        if (i < 1 || i > numel)
            luaL_error(L, "index %I is out of range [1, %I]", (lua_Integer)i, (lua_Integer)numel);
        return i - 1;
    }
    if (n != t->shape.rank)
        luaL_error(L, "%d indices for a tensor of rank %d (give one flat index or one per dimension)", n, t->shape.rank);
    int64_t flat = 0;
    for (int d = 0; d < n; d++) {
        lua_Integer i = luaL_checkinteger(L, first + d);
        if (i < 1 || i > t->shape.dim[d])
            luaL_error(L, "index %I of dimension %d is out of range [1, %I]", (lua_Integer)i, d + 1, (lua_Integer)t->shape.dim[d]);
        flat = flat * t->shape.dim[d] + (i - 1);
    }
    return flat;
}

/* An image: (H, W) or (H, W, C); *px = bytes per pixel. */
static void image_dims(lua_State *L, const loom_tensor *t, const char *op, int64_t *H, int64_t *W, size_t *px)
{
    if (t->shape.rank != 2 && t->shape.rank != 3) {
        char b[96];
        luaL_error(L, "%s needs an image (H, W) or (H, W, C), got shape %s", op, loom_shape_str(&t->shape, b, sizeof b));
    }
    *H = t->shape.dim[0];
    *W = t->shape.dim[1];
    *px = (size_t)(t->shape.rank == 3 ? t->shape.dim[2] : 1) * loom_dtype_size(t->dtype);
}

/* ---- methods ------------------------------------------------------------------------ */

static int m_shape(lua_State *L) { push_shape(L, &check_lt(L, 1)->t.shape); return 1; }
static int m_dtype(lua_State *L) { lua_pushstring(L, loom_dtype_name(check_lt(L, 1)->t.dtype)); return 1; }
static int m_numel(lua_State *L) { lua_pushinteger(L, checked_numel(L, &check_lt(L, 1)->t.shape)); return 1; }
static int m_rank(lua_State *L) { lua_pushinteger(L, check_lt(L, 1)->t.shape.rank); return 1; }

static int m_dim(lua_State *L)
{
    const loom_tensor *t = &check_lt(L, 1)->t;
    lua_Integer d = luaL_checkinteger(L, 2);
    luaL_argcheck(L, d >= 1 && d <= t->shape.rank, 2, "dimension out of range");
    lua_pushinteger(L, t->shape.dim[d - 1]);
    return 1;
}

static int m_get(lua_State *L)
{
    const loom_tensor *t = &check_lt(L, 1)->t;
    push_value(L, t, check_index(L, t, 2, lua_gettop(L) - 1));
    return 1;
}

static int m_set(lua_State *L)
{
    ltensor *lt = check_lt(L, 1);
    int n = lua_gettop(L) - 2;
    if (n < 1) return luaL_error(L, "set needs an index and a value: t:set(i, v) or t:set(i, j, ..., v)");
    int64_t i = check_index(L, &lt->t, 2, n);
    double v = luaL_checknumber(L, n + 2);
    set_value(writable(L, lt), i, v);
    lua_settop(L, 1);
    return 1;
}

static int m_copy(lua_State *L)
{
    const loom_tensor *t = &check_lt(L, 1)->t;
    ltensor *o = new_lt(L, t->dtype, &t->shape);
    if (o->own_bytes) memcpy(o->t.data, t->data, o->own_bytes);
    return 1;
}

static int m_cast(lua_State *L)
{
    const loom_tensor *t = &check_lt(L, 1)->t;
    loom_dtype dt = check_dtype(L, 2);
    ltensor *o = new_lt(L, dt, &t->shape);
    loom_data_convert(t->data, t->dtype, o->t.data, dt, (size_t)checked_numel(L, &t->shape));
    return 1;
}

static int m_reshape(lua_State *L)
{
    const loom_tensor *t = &check_lt(L, 1)->t;
    loom_shape s = check_shape(L, 2);
    if (checked_numel(L, &s) != checked_numel(L, &t->shape)) {
        char a[96], b[96];
        return luaL_error(L, "cannot reshape %s to %s: element counts differ", loom_shape_str(&t->shape, a, sizeof a),
                          loom_shape_str(&s, b, sizeof b));
    }
    ltensor *o = new_lt(L, t->dtype, &s);
    if (o->own_bytes) memcpy(o->t.data, t->data, o->own_bytes);
    return 1;
}

/* select(i): the i-th sub-tensor along the first dim (1-based), copied: an image of a batch. */
static int m_select(lua_State *L)
{
    const loom_tensor *t = &check_lt(L, 1)->t;
    lua_Integer i = luaL_checkinteger(L, 2);
    if (t->shape.rank < 1) return luaL_error(L, "select needs a tensor of rank >= 1 (a scalar has no rows)");
    if (i < 1 || i > t->shape.dim[0])
        return luaL_error(L, "select(%I) is out of range [1, %I]", (lua_Integer)i, (lua_Integer)t->shape.dim[0]);
    loom_shape s = {.rank = t->shape.rank - 1};
    memcpy(s.dim, t->shape.dim + 1, sizeof s.dim[0] * (size_t)s.rank);
    ltensor *o = new_lt(L, t->dtype, &s);
    if (o->own_bytes) memcpy(o->t.data, (const uint8_t *)t->data + (size_t)(i - 1) * o->own_bytes, o->own_bytes);
    return 1;
}

static int m_fill(lua_State *L)
{
    ltensor *lt = check_lt(L, 1);
    double v = luaL_checknumber(L, 2);
    loom_tensor *t = writable(L, lt);
    int64_t n = checked_numel(L, &t->shape);
    for (int64_t i = 0; i < n; i++) set_value(t, i, v);
    lua_settop(L, 1);
    return 1;
}

/* [*lo, *hi): the 0-based part of the 1-based span start..start+len-1 that
 * lies in [0, n); any Lua integers, without overflow. */
static void clip_span(lua_Integer start, lua_Integer len, int64_t n, int64_t *lo, int64_t *hi)
{
    *lo = *hi = 0;
    if (len <= 0 || start > n) return;
    lua_Integer end; /* 1-based, inclusive */
    if (__builtin_add_overflow(start, len - 1, &end) || end > n) end = n;
    if (end < 1) return;
    *lo = start < 1 ? 0 : start - 1;
    *hi = end;
}

/* fill_rect(y, x, h, w, v): rows y..y+h-1, columns x..x+w-1 (1-based), clipped to the image (cutout). */
static int m_fill_rect(lua_State *L)
{
    ltensor *lt = check_lt(L, 1);
    lua_Integer y = luaL_checkinteger(L, 2), x = luaL_checkinteger(L, 3);
    lua_Integer h = luaL_checkinteger(L, 4), w = luaL_checkinteger(L, 5);
    double v = luaL_checknumber(L, 6);
    int64_t H, W;
    size_t px;
    image_dims(L, &lt->t, "fill_rect", &H, &W, &px);
    int64_t y0, y1, x0, x1;
    if (!px || !checked_numel(L, &lt->t.shape)) {
        lua_settop(L, 1);
        return 1; /* empty: nothing to fill, and no loop over up to 2^40 empty rows */
    }
    clip_span(y, h, H, &y0, &y1);
    clip_span(x, w, W, &x0, &x1);
    loom_tensor *t = writable(L, lt);
    size_t es = loom_dtype_size(t->dtype), cpp = px / es;
    uint8_t one[8];
    loom_data_convert(&v, LOOM_F64, one, t->dtype, 1);
    for (int64_t r = y0; r < y1; r++)
        for (int64_t c = x0; c < x1; c++)
            for (size_t k = 0; k < cpp; k++) memcpy((uint8_t *)t->data + ((size_t)(r * W + c) * cpp + k) * es, one, es);
    lua_settop(L, 1);
    return 1;
}

static int m_flip_lr(lua_State *L)
{
    const loom_tensor *t = &check_lt(L, 1)->t;
    int64_t H, W;
    size_t px;
    image_dims(L, t, "flip_left_right", &H, &W, &px);
    ltensor *o = new_lt(L, t->dtype, &t->shape);
    if (!o->own_bytes) return 1; /* empty: no row loops over dims of up to 2^40 */
    loom_data_flip_image(t->data, o->t.data, H, W, px);
    return 1;
}

static int m_flip_ud(lua_State *L)
{
    const loom_tensor *t = &check_lt(L, 1)->t;
    int64_t H, W;
    size_t px;
    image_dims(L, t, "flip_up_down", &H, &W, &px);
    ltensor *o = new_lt(L, t->dtype, &t->shape);
    if (!o->own_bytes) return 1; /* empty: no row loops over dims of up to 2^40 */
    size_t row = (size_t)W * px;
    for (int64_t r = 0; r < H; r++) memcpy((uint8_t *)o->t.data + (size_t)r * row, (uint8_t *)t->data + (size_t)(H - 1 - r) * row, row);
    return 1;
}

/* crop(y, x, h, w): the window at 1-based (y, x); it must lie inside the image. */
static int m_crop(lua_State *L)
{
    const loom_tensor *t = &check_lt(L, 1)->t;
    lua_Integer y = luaL_checkinteger(L, 2), x = luaL_checkinteger(L, 3);
    lua_Integer h = luaL_checkinteger(L, 4), w = luaL_checkinteger(L, 5);
    int64_t H, W;
    size_t px;
    image_dims(L, t, "crop", &H, &W, &px);
    if (y < 1 || x < 1 || h < 1 || w < 1 || y > H || x > W || h > H - (y - 1) || w > W - (x - 1))
        return luaL_error(L, "crop(%I, %I, %I, %I) does not fit in a %I x %I image", (lua_Integer)y, (lua_Integer)x,
                          (lua_Integer)h, (lua_Integer)w, (lua_Integer)H, (lua_Integer)W);
    loom_shape s = t->shape;
    s.dim[0] = h;
    s.dim[1] = w;
    ltensor *o = new_lt(L, t->dtype, &s);
    if (!o->own_bytes) return 1; /* empty: no row loops over dims of up to 2^40 */
    size_t row = (size_t)w * px;
    for (int64_t r = 0; r < h; r++)
        memcpy((uint8_t *)o->t.data + (size_t)r * row, (uint8_t *)t->data + ((size_t)(y - 1 + r) * (size_t)W + (size_t)(x - 1)) * px, row);
    return 1;
}

static int m_pad(lua_State *L)
{
    const loom_tensor *t = &check_lt(L, 1)->t;
    lua_Integer p = luaL_checkinteger(L, 2);
    double v = luaL_optnumber(L, 3, 0);
    luaL_argcheck(L, p >= 0 && p <= (1 << 20), 2, "padding must be in [0, 1048576]");
    int64_t H, W;
    size_t px;
    image_dims(L, t, "pad", &H, &W, &px);
    loom_shape s = t->shape;
    s.dim[0] = H + 2 * p;
    s.dim[1] = W + 2 * p;
    ltensor *o = new_lt(L, t->dtype, &s);
    if (!o->own_bytes) return 1; /* empty: no row loops over dims of up to 2^40 */
    uint8_t fill[8];
    loom_data_convert(&v, LOOM_F64, fill, t->dtype, 1);
    loom_data_pad_image(t->data, o->t.data, H, W, p, px, fill, loom_dtype_size(t->dtype));
    return 1;
}

static int m_scale(lua_State *L)
{
    const loom_tensor *t = &check_lt(L, 1)->t;
    double sc = luaL_checknumber(L, 2), off = luaL_optnumber(L, 3, 0);
    ltensor *o = new_lt(L, LOOM_F32, &t->shape);
    loom_data_scale(t->data, t->dtype, o->t.data, (size_t)checked_numel(L, &t->shape), (float)sc, (float)off);
    return 1;
}

static int m_normalize(lua_State *L)
{
    const loom_tensor *t = &check_lt(L, 1)->t;
    double mean = luaL_checknumber(L, 2), sd = luaL_checknumber(L, 3);
    luaL_argcheck(L, sd > 0, 3, "std must be > 0");
    ltensor *o = new_lt(L, LOOM_F32, &t->shape);
    loom_data_normalize(t->data, t->dtype, o->t.data, (size_t)checked_numel(L, &t->shape), (float)mean, (float)sd);
    return 1;
}

/* per_image_standardization, as the built-in map: (x - mean) / max(std, 1/sqrt(N)). */
static int m_standardize(lua_State *L)
{
    const loom_tensor *t = &check_lt(L, 1)->t;
    size_t n = (size_t)checked_numel(L, &t->shape);
    double mean, sd;
    loom_data_moments(t->data, t->dtype, n, &mean, &sd);
    double floor_sd = n ? 1.0 / sqrt((double)n) : 1.0;
    ltensor *o = new_lt(L, LOOM_F32, &t->shape);
    loom_data_normalize(t->data, t->dtype, o->t.data, n, (float)mean, (float)(sd > floor_sd ? sd : floor_sd));
    return 1;
}

/* add(v), mul(v), clamp(lo, hi): elementwise in the tensor's dtype (integers saturate). */
static int elementwise(lua_State *L, int op)
{
    const loom_tensor *t = &check_lt(L, 1)->t;
    double a = luaL_checknumber(L, 2), b = op == 2 ? luaL_checknumber(L, 3) : 0;
    ltensor *o = new_lt(L, t->dtype, &t->shape);
    int64_t n = checked_numel(L, &t->shape);
    if (t->dtype == LOOM_F32) { /* one loop per op, so each vectorizes */
        const float *x = t->data;
        float *y = o->t.data, fa = (float)a, fb = (float)b;
        if (op == 0)
            for (int64_t i = 0; i < n; i++) y[i] = x[i] + fa;
        else if (op == 1)
            for (int64_t i = 0; i < n; i++) y[i] = x[i] * fa;
        else
            for (int64_t i = 0; i < n; i++) y[i] = x[i] < fa ? fa : x[i] > fb ? fb : x[i];
        return 1;
    }
    for (int64_t i = 0; i < n; i++) {
        double x = loom_tensor_get(t, i);
        set_value(&o->t, i, op == 0 ? x + a : op == 1 ? x * a : fmin(fmax(x, a), b));
    }
    return 1;
}
static int m_add(lua_State *L) { return elementwise(L, 0); }
static int m_mul(lua_State *L) { return elementwise(L, 1); }
static int m_clamp(lua_State *L) { return elementwise(L, 2); }

static int reduce(lua_State *L, int op)
{
    const loom_tensor *t = &check_lt(L, 1)->t;
    int64_t n = checked_numel(L, &t->shape);
    if (n == 0 && op >= 2) return luaL_error(L, "%s of an empty tensor", op == 2 ? "min" : "max");
    double acc = op >= 2 ? loom_tensor_get(t, 0) : 0;
    for (int64_t i = 0; i < n; i++) {
        double x = loom_tensor_get(t, i);
        if (op < 2) acc += x;
        else if (op == 2 ? x < acc : x > acc) acc = x;
    }
    lua_pushnumber(L, op == 1 ? (n ? acc / (double)n : 0) : acc);
    return 1;
}
static int m_sum(lua_State *L) { return reduce(L, 0); }
static int m_mean(lua_State *L) { return reduce(L, 1); }
static int m_min(lua_State *L) { return reduce(L, 2); }
static int m_max(lua_State *L) { return reduce(L, 3); }

static int m_tostring(lua_State *L)
{
    ltensor *lt = luaL_checkudata(L, 1, TENSOR_MT);
    char b[96];
    if (!loom_lua_view_live_(loom_lua_from_state(L), lt->gen)) lua_pushliteral(L, "tensor(expired view)");
    else lua_pushfstring(L, "tensor(%s, %s)", loom_dtype_name(lt->t.dtype), loom_shape_str(&lt->t.shape, b, sizeof b));
    return 1;
}

static const luaL_Reg tensor_methods[] = {
    {"shape", m_shape}, {"dtype", m_dtype}, {"numel", m_numel}, {"rank", m_rank}, {"dim", m_dim},
    {"get", m_get}, {"set", m_set}, {"copy", m_copy}, {"cast", m_cast}, {"reshape", m_reshape},
    {"select", m_select}, {"fill", m_fill}, {"fill_rect", m_fill_rect}, {"flip_left_right", m_flip_lr}, {"flip_up_down", m_flip_ud},
    {"crop", m_crop}, {"pad", m_pad}, {"scale", m_scale}, {"normalize", m_normalize},
    {"per_image_standardization", m_standardize}, {"add", m_add}, {"mul", m_mul}, {"clamp", m_clamp},
    {"sum", m_sum}, {"mean", m_mean}, {"min", m_min}, {"max", m_max},
    {NULL, NULL},
};

/* ---- rng ------------------------------------------------------------------------------ */

void loom_lua_push_rng(lua_State *L, uint64_t seed, uint64_t a, uint64_t b, uint64_t c)
{
    loom_rng *r = lua_newuserdatauv(L, sizeof *r, 0);
    loom_rng_init(r, seed, a, b, c);
    luaL_setmetatable(L, RNG_MT);
}

static loom_rng *check_rng(lua_State *L) { return luaL_checkudata(L, 1, RNG_MT); }

static int r_uniform(lua_State *L)
{
    loom_rng *r = check_rng(L);
    double lo = luaL_optnumber(L, 2, 0), hi = luaL_optnumber(L, 3, 1);
    lua_pushnumber(L, lo + (hi - lo) * loom_rng_uniform64(r));
    return 1;
}

static int r_normal(lua_State *L)
{
    loom_rng *r = check_rng(L);
    double mean = luaL_optnumber(L, 2, 0), sd = luaL_optnumber(L, 3, 1);
    lua_pushnumber(L, mean + sd * (double)loom_rng_normal(r));
    return 1;
}

static int r_int(lua_State *L)
{
    loom_rng *r = check_rng(L);
    lua_Integer lo = luaL_checkinteger(L, 2), hi = luaL_checkinteger(L, 3);
    luaL_argcheck(L, lo <= hi, 3, "empty range (hi < lo)");
    lua_pushinteger(L, lo + (lua_Integer)loom_rng_below(r, (uint64_t)(hi - lo) + 1));
    return 1;
}

static int r_bernoulli(lua_State *L)
{
    loom_rng *r = check_rng(L);
    double p = luaL_optnumber(L, 2, 0.5);
    lua_pushboolean(L, loom_rng_uniform64(r) < p);
    return 1;
}

static const luaL_Reg rng_methods[] = {
    {"uniform", r_uniform}, {"normal", r_normal}, {"int", r_int}, {"bernoulli", r_bernoulli}, {NULL, NULL},
};

/* ---- the module -------------------------------------------------------------------------- */

/* loom.tensor(dtype, shape[, init]): zeros, init (a number) everywhere, or the flat values of a table. */
static int l_tensor(lua_State *L)
{
    loom_dtype dt = check_dtype(L, 1);
    loom_shape s = check_shape(L, 2);
    lua_settop(L, 3); /* the fill is slot 3 even when absent: the new tensor goes above it */
    ltensor *o = new_lt_(L, dt, &s, 1);
    int64_t n = checked_numel(L, &s);
    if (lua_type(L, 3) == LUA_TNUMBER) {
        double v = lua_tonumber(L, 3);
        for (int64_t i = 0; i < n; i++) set_value(&o->t, i, v);
    } else if (lua_type(L, 3) == LUA_TTABLE) {
        if (luaL_len(L, 3) != n)
            return luaL_error(L, "loom.tensor: %I values for %I elements", (lua_Integer)luaL_len(L, 3), (lua_Integer)n);
        for (int64_t i = 0; i < n; i++) {
            lua_geti(L, 3, i + 1);
            int ok;
            double v = lua_tonumberx(L, -1, &ok);
            if (!ok) return luaL_error(L, "loom.tensor: value %I is not a number", (lua_Integer)i + 1);
            set_value(&o->t, i, v);
            lua_pop(L, 1);
        }
    } else if (!lua_isnoneornil(L, 3)) {
        return luaL_argerror(L, 3, "expected a number or a table of numbers");
    }
    return 1;
}

/* loom.stack({t1, t2, ...}): tensors of one dtype and shape -> (n, shape...): a batch of images. */
static int l_stack(lua_State *L)
{
    luaL_checktype(L, 1, LUA_TTABLE);
    lua_Integer n = luaL_len(L, 1);
    if (n < 1) return luaL_argerror(L, 1, "expected a non-empty list of tensors");
    lua_geti(L, 1, 1);
    const loom_tensor *first = loom_lua_check_tensor(L, -1);
    if (first->shape.rank >= LOOM_MAX_RANK) return luaL_error(L, "loom.stack: tensors of rank %d have no room for a new dim", first->shape.rank);
    loom_shape s = {.rank = first->shape.rank + 1, .dim = {n}};
    memcpy(s.dim + 1, first->shape.dim, sizeof s.dim[0] * (size_t)first->shape.rank);
    loom_dtype dt = first->dtype;
    loom_shape one = first->shape;
    lua_pop(L, 1);
    ltensor *o = new_lt(L, dt, &s);
    size_t bytes = loom_tensor_nbytes(first);
    for (lua_Integer i = 1; i <= n; i++) {
        lua_geti(L, 1, i);
        const loom_tensor *t = loom_lua_to_tensor(L, -1);
        if (!t || t->dtype != dt || !loom_shape_eq(&t->shape, &one)) {
            char a[96], b[96];
            return luaL_error(L, "loom.stack: item %I is %s %s, item 1 is %s %s", i, t ? loom_dtype_name(t->dtype) : "a",
                              t ? loom_shape_str(&t->shape, a, sizeof a) : luaL_typename(L, -1), loom_dtype_name(dt),
                              loom_shape_str(&one, b, sizeof b));
        }
        if (bytes) memcpy((uint8_t *)o->t.data + (size_t)(i - 1) * bytes, t->data, bytes);
        lua_pop(L, 1);
    }
    return 1;
}

static int l_rng(lua_State *L)
{
    lua_Integer seed = luaL_checkinteger(L, 1);
    lua_Integer a = luaL_optinteger(L, 2, 0), b = luaL_optinteger(L, 3, 0), c = luaL_optinteger(L, 4, 0);
    loom_lua_push_rng(L, (uint64_t)seed, (uint64_t)a, (uint64_t)b, (uint64_t)c);
    return 1;
}

static int l_is_tensor(lua_State *L)
{
    lua_pushboolean(L, luaL_testudata(L, 1, TENSOR_MT) != NULL);
    return 1;
}

static const luaL_Reg module_fns[] = {
    {"tensor", l_tensor}, {"stack", l_stack}, {"rng", l_rng}, {"is_tensor", l_is_tensor}, {NULL, NULL},
};

static void new_metatable(lua_State *L, const char *name, const luaL_Reg *methods)
{
    luaL_newmetatable(L, name);
    lua_newtable(L);
    luaL_setfuncs(L, methods, 0);
    lua_setfield(L, -2, "__index");
    lua_pushliteral(L, "locked");
    lua_setfield(L, -2, "__metatable");
}

void loom_lua_open_module_(lua_State *L)
{
    new_metatable(L, TENSOR_MT, tensor_methods);
    lua_pushcfunction(L, lt_gc);
    lua_setfield(L, -2, "__gc");
    lua_pushcfunction(L, m_tostring);
    lua_setfield(L, -2, "__tostring");
    lua_pushcfunction(L, m_numel);
    lua_setfield(L, -2, "__len");
    lua_pop(L, 1);
    new_metatable(L, RNG_MT, rng_methods);
    lua_pop(L, 1);
    luaL_newlib(L, module_fns);
    lua_pushliteral(L, LOOM_VERSION);
    lua_setfield(L, -2, "version");
    lua_setglobal(L, "loom");
}
