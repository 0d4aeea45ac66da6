/* provider.c - the "lua" custom element-function provider (data/engine/custom.h):
 * `map` and `filter` transforms that call a Lua function.
 *
 * A map function is called as fn(elem, rng) and returns the element (a table
 * of tensors, the input table modified or a new one); a filter function as
 * fn(elem, rng) and returns true to keep the element. elem's tensors are views
 * of the pipeline's buffers, copied on first write. rng draws from
 * (run seed, stage, epoch, element index), so results do not depend on the
 * thread that runs the call.
 *
 * The output spec of a map is found at open by calling the function once on
 * an element of zeros of the input's shapes (rng keyed by stage and index -1):
 * every later call must return the same features, dtypes and shapes (a
 * leading batch dim may be shorter when the input's is).
 *
 * Threads: one loom_lua per concurrent call (max_calls of them), handed out
 * under a mutex; a state is never used by two threads at once. */
#include "script_internal.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct lslot {
    loom_lua *S;
    int       fn;   /* registry reference of the function */
    int       busy;
} lslot;

typedef struct lprov {
    int             n;
    lslot          *sl;
    pthread_mutex_t mu;
    pthread_cond_t  cv;
    int             filter;
    char            ref[LOOM_PATH_MAX];
    loom_elem_spec  in, out;
    loom_shape      out_max[LOOM_MAX_FEATURES];
} lprov;

static lslot *acquire(lprov *p)
{
    pthread_mutex_lock(&p->mu);
    for (;;) {
        for (int i = 0; i < p->n; i++)
            if (!p->sl[i].busy) {
                p->sl[i].busy = 1;
                pthread_mutex_unlock(&p->mu);
                return &p->sl[i];
            }
        pthread_cond_wait(&p->cv, &p->mu);
    }
}

static void release(lprov *p, lslot *s)
{
    lua_settop(loom_lua_state(s->S), 0);
    pthread_mutex_lock(&p->mu);
    s->busy = 0;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

static void prov_close(void *inst)
{
    lprov *p = inst;
    for (int i = 0; p->sl && i < p->n; i++) loom_lua_close(p->sl[i].S);
    loom_free(p->sl);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    loom_free(p);
}

/* Pushes fn, elem, rng for one call on slot s. */
static int push_call(lprov *p, lslot *s, const loom_elem *in, const loom_custom_key *k, loom_err *err)
{
    lua_State *L = loom_lua_state(s->S);
    if (!lua_checkstack(L, 8)) return loom_err_set(err, LOOM_ENOMEM, NULL, "Lua stack overflow");
    loom_lua_push_fn(s->S, s->fn);
    loom_lua_push_elem(L, &p->in, in, false);
    loom_lua_push_rng(L, k->seed, (uint64_t)k->stage, (uint64_t)k->epoch, (uint64_t)k->index);
    return LOOM_OK;
}

static void describe_shape(const loom_tensor *t, char *b, size_t n)
{
    char s[96];
    snprintf(b, n, "%s %s", loom_dtype_name(t->dtype), loom_shape_str(&t->shape, s, sizeof s));
}

/* Reads the result table at the top of L into out: the features of p->out,
 * each checked against its dtype and shape, copied into out's buffers. */
static int take_result(lprov *p, lua_State *L, loom_elem *out, loom_err *err)
{
    if (!lua_istable(L, -1))
        return loom_err_set(err, LOOM_ELUA, NULL, "the map function returned %s, expected the element (a table of tensors)",
                            luaL_typename(L, -1));
    int n = 0;
    lua_pushnil(L);
    while (lua_next(L, -2)) {
        lua_pop(L, 1);
        n++;
    }
    if (n != p->out.n) {
        char b[512];
        return loom_err_set(err, LOOM_ELUA, NULL, "the map function returned %d features; it must return the same ones "
                            "every time (%s)", n, loom_elem_spec_str(&p->out, b, sizeof b));
    }
    for (int f = 0; f < p->out.n; f++) {
        lua_getfield(L, -1, p->out.name[f]);
        const loom_tensor *t = loom_lua_to_tensor(L, -1);
        if (!t) {
            loom_err_set(err, LOOM_ELUA, NULL, "the map function's result has no tensor \"%s\" (got %s)", p->out.name[f],
                         luaL_typename(L, -1));
            lua_pop(L, 1);
            return LOOM_ELUA;
        }
        const loom_shape *want = &p->out.shape[f];
        bool ok = t->dtype == p->out.dtype[f] && t->shape.rank == want->rank;
        for (int d = 0; ok && d < want->rank; d++)
            ok = want->dim[d] < 0 ? t->shape.dim[d] <= p->out_max[f].dim[d] : t->shape.dim[d] == want->dim[d];
        if (!ok) {
            char got[128], exp[128];
            loom_tensor w = {.dtype = p->out.dtype[f], .shape = *want};
            describe_shape(t, got, sizeof got);
            describe_shape(&w, exp, sizeof exp);
            loom_err_set(err, LOOM_ELUA, NULL, "the map function returned \"%s\" as %s, but as %s on its first call; it must "
                         "return the same dtype and shape every time", p->out.name[f], got, exp);
            lua_pop(L, 1);
            return LOOM_ELUA;
        }
        out->t[f].dtype = t->dtype;
        out->t[f].shape = t->shape;
        size_t nb = loom_tensor_nbytes(t);
        if (nb && out->t[f].data != t->data) memcpy(out->t[f].data, t->data, nb);
        lua_pop(L, 1);
    }
    out->n = p->out.n;
    return LOOM_OK;
}

/* The result of the probe defines the output spec: input features in input
 * order, then new ones by name. */
static int define_output(lprov *p, lua_State *L, loom_shape *out_max, loom_err *err)
{
    if (!lua_istable(L, -1))
        return loom_err_set(err, LOOM_ELUA, NULL, "the map function returned %s, expected the element (a table of tensors)",
                            luaL_typename(L, -1));
    char names[LOOM_MAX_FEATURES * 2][LOOM_NAME_MAX];
    int n = 0;
    lua_pushnil(L);
    while (lua_next(L, -2)) {
        lua_pop(L, 1);
        if (lua_type(L, -1) != LUA_TSTRING) {
            lua_pop(L, 1);
            return loom_err_set(err, LOOM_ELUA, NULL, "the map function's result has a key that is not a feature name");
        }
        if (n == LOOM_MAX_FEATURES || strlen(lua_tostring(L, -1)) >= LOOM_NAME_MAX) {
            lua_pop(L, 1);
            return loom_err_set(err, LOOM_ELUA, NULL, "the map function returned more than %d features or a name over %d "
                                "characters", LOOM_MAX_FEATURES, LOOM_NAME_MAX - 1);
        }
        snprintf(names[n++], LOOM_NAME_MAX, "%.*s", LOOM_NAME_MAX - 1, lua_tostring(L, -1));
    }
    /* order: input order first, then the new names sorted */
    memset(&p->out, 0, sizeof p->out);
    for (int i = 0; i < p->in.n; i++)
        for (int k = 0; k < n; k++)
            if (!strcmp(names[k], p->in.name[i])) memcpy(p->out.name[p->out.n++], names[k], LOOM_NAME_MAX);
    int first_new = p->out.n;
    for (int k = 0; k < n; k++)
        if (loom_elem_spec_find(&p->in, names[k]) < 0) {
            int j = p->out.n++;
            while (j > first_new && strcmp(p->out.name[j - 1], names[k]) > 0) {
                memcpy(p->out.name[j], p->out.name[j - 1], LOOM_NAME_MAX);
                j--;
            }
            memcpy(p->out.name[j], names[k], LOOM_NAME_MAX);
        }
    for (int f = 0; f < p->out.n; f++) {
        lua_getfield(L, -1, p->out.name[f]);
        const loom_tensor *t = loom_lua_to_tensor(L, -1);
        if (!t) {
            loom_err_set(err, LOOM_ELUA, NULL, "the map function's result \"%s\" is %s, expected a tensor", p->out.name[f],
                         luaL_typename(L, -1));
            lua_pop(L, 1);
            return LOOM_ELUA;
        }
        p->out.dtype[f] = t->dtype;
        p->out.shape[f] = t->shape;
        out_max[f] = t->shape;
        /* a leading dim equal to a varying input batch dim varies too */
        int i = loom_elem_spec_find(&p->in, p->out.name[f]);
        if (i < 0) i = 0;
        if (p->in.n && p->in.shape[i].rank > 0 && p->in.shape[i].dim[0] < 0 && t->shape.rank > 0) p->out.shape[f].dim[0] = -1;
        lua_pop(L, 1);
    }
    memcpy(p->out_max, out_max, sizeof p->out_max);
    return LOOM_OK;
}

/* Calls the map function once on zeros of the input's max shapes. */
static int probe(lprov *p, const loom_custom_args *a, loom_elem_spec *out, loom_shape *out_max, loom_err *err)
{
    loom_elem z = {.n = a->in->n};
    int rc = LOOM_OK;
    for (int f = 0; f < z.n && !rc; f++) {
        loom_shape s = a->in_max ? a->in_max[f] : a->in->shape[f];
        rc = loom_tensor_init(&z.t[f], a->in->dtype[f], &s, err);
    }
    lslot *s = &p->sl[0];
    loom_custom_key k = {.seed = a->seed, .stage = -1, .epoch = 0, .index = -1};
    if (!rc) rc = push_call(p, s, &z, &k, err);
    if (!rc) rc = loom_lua_call(s->S, 2, 1, err);
    if (!rc) {
        rc = define_output(p, loom_lua_state(s->S), out_max, err);
    }
    if (rc && err) {
        if (!err->where[0]) snprintf(err->where, sizeof err->where, "%.*s", (int)sizeof err->where - 1, a->ref);
        loom_err_prefix(err, "first call (on an element of zeros, to learn the output spec)");
    }
    lua_settop(loom_lua_state(s->S), 0);
    for (int f = 0; f < z.n; f++) loom_tensor_fini(&z.t[f]);
    if (!rc) *out = p->out;
    return rc;
}

static int prov_open(void **inst, const loom_custom_args *a, loom_elem_spec *out, loom_shape *out_max, loom_err *err)
{
    *inst = NULL;
    loom_lua_ref ref;
    int rc = loom_lua_parse_ref(a->ref, a->base_dir, &ref, err);
    if (rc) return rc;
    lprov *p = loom_calloc(1, sizeof *p);
    if (!p) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a Lua map");
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->filter = a->filter;
    p->in = *a->in;
    snprintf(p->ref, sizeof p->ref, "%s", a->ref);
    p->n = a->max_calls > 0 ? a->max_calls : 1;
    p->sl = loom_calloc((size_t)p->n, sizeof *p->sl);
    if (!p->sl) {
        prov_close(p);
        return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate %d Lua states", p->n);
    }
    loom_lua_opts o = {0};
    if (a->options) o = *(const loom_lua_opts *)a->options;
    char dir[LOOM_PATH_MAX]; /* require() finds modules next to the function's file */
    snprintf(dir, sizeof dir, "%s", ref.file);
    char *slash = strrchr(dir, '/');
    if (slash) *slash = 0;
    o.base_dir = slash ? dir : a->base_dir;
    for (int i = 0; i < p->n && !rc; i++) {
        p->sl[i].fn = LUA_NOREF;
        rc = loom_lua_open(&p->sl[i].S, &o, err);
        if (!rc) rc = loom_lua_resolve(p->sl[i].S, &ref, &p->sl[i].fn, err);
    }
    if (!rc && !p->filter) rc = probe(p, a, out, out_max, err);
    if (rc) {
        prov_close(p);
        return rc;
    }
    *inst = p;
    return LOOM_OK;
}

static int prov_map(void *inst, const loom_elem *in, loom_elem *out, const loom_custom_key *k, loom_err *err)
{
    lprov *p = inst;
    lslot *s = acquire(p);
    int rc = push_call(p, s, in, k, err);
    if (!rc) rc = loom_lua_call(s->S, 2, 1, err);
    if (!rc) rc = take_result(p, loom_lua_state(s->S), out, err);
    if (rc && err && !err->where[0]) snprintf(err->where, sizeof err->where, "%.*s", (int)sizeof err->where - 1, p->ref);
    release(p, s);
    return rc;
}

static int prov_filter(void *inst, const loom_elem *in, int *keep, const loom_custom_key *k, loom_err *err)
{
    lprov *p = inst;
    lslot *s = acquire(p);
    int rc = push_call(p, s, in, k, err);
    if (!rc) rc = loom_lua_call(s->S, 2, 1, err);
    if (!rc) {
        lua_State *L = loom_lua_state(s->S);
        if (lua_type(L, -1) != LUA_TBOOLEAN)
            rc = loom_err_set(err, LOOM_ELUA, NULL, "the filter function returned %s, expected true (keep) or false (drop)",
                              luaL_typename(L, -1));
        else *keep = lua_toboolean(L, -1);
    }
    if (rc && err && !err->where[0]) snprintf(err->where, sizeof err->where, "%.*s", (int)sizeof err->where - 1, p->ref);
    release(p, s);
    return rc;
}

static const loom_custom_ops lua_ops = {
    .version = LOOM_CUSTOM_OPS_VERSION, .name = "lua",
    .open = prov_open, .map = prov_map, .filter = prov_filter, .close = prov_close,
};

int loom_script_register(loom_err *err)
{
    if (loom_registry_find(LOOM_REG_TRANSFORM, "lua", NULL) == &lua_ops) return LOOM_OK;
    return loom_registry_add(LOOM_REG_TRANSFORM, "lua", &lua_ops, NULL, err);
}
