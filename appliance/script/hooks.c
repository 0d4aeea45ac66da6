/* hooks.c - the config's Lua hooks: callback tables, the custom train_step
 * and the ctx both receive (see hooks.h). Misuse of a ctx method (a bad
 * argument, the parts of a step out of order) raises a Lua error at the
 * caller's line; a failure of the host (a checkpoint that cannot be written,
 * a loss that is not finite) is raised too and handed to the trainer as the
 * host reported it, so it keeps its own code and message. */
#include "script/hooks.h"

#include <lauxlib.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char *const hook_names[LOOM_NHOOKS_] = {"on_train_begin", "on_epoch_begin", "on_step_end",
                                                     "on_epoch_end", "on_train_end"};

#define STATE_MAGIC   0x4b4f4f48u /* "HOOK" */
#define STATE_MAX_KEYS 256

typedef struct callback {
    int     table;         /* registry reference of the table the factory returned */
    int64_t step_interval; /* on_step_end every N steps */
    unsigned has;          /* bit k: the table defines hook_names[k] */
    char    where[LOOM_PATH_MAX + 16]; /* the config's file:line */
} callback;

struct loom_hooks {
    loom_lua      *L;
    loom_hook_host host;
    int            n_cb;
    callback       cb[LOOM_MAX_CALLBACKS];
    int            step_fn, step_args; /* registry references; LUA_NOREF without a train_step */
    char           step_where[LOOM_PATH_MAX + 16];
    int            ctx;                /* registry reference of the ctx table */
    loom_err       host_err;           /* a host failure, raised in Lua as an error */
    bool           host_failed;
    /* the custom step in progress */
    bool           in_step;
    int            done;               /* the last part done in this step (loom_hook_part), -1: none */
    bool           reduced, applied;
    int            batch;              /* registry reference of the step's batch table */
};

static loom_hooks *self_of(lua_State *s) { return lua_touserdata(s, lua_upvalueindex(1)); }

/* Raises the host's failure (in h->host_err) as a Lua error. */
static int host_fail(lua_State *s, loom_hooks *h, const char *method)
{
    h->host_failed = true;
    return luaL_error(s, "ctx:%s(): %s", method, h->host_err.msg);
}

/* A table {v[0], ..., v[n-1]}: one value per replica. */
static void push_per_replica(lua_State *s, const double *v, int n)
{
    lua_createtable(s, n, 0);
    for (int r = 0; r < n; r++) {
        lua_pushnumber(s, v[r]);
        lua_rawseti(s, -2, r + 1);
    }
}

/* ---- callback methods ------------------------------------------------------ */

static int ctx_stop(lua_State *s)
{
    loom_hooks *h = self_of(s);
    h->host.stop(h->host.self);
    return 0;
}

static int ctx_set_learning_rate(lua_State *s)
{
    loom_hooks *h = self_of(s);
    double lr = luaL_checknumber(s, 2);
    luaL_argcheck(s, lr > 0 && isfinite(lr), 2, "the learning rate must be a finite number > 0");
    h->host.set_learning_rate(h->host.self, lr);
    return 0;
}

static int ctx_save_checkpoint(lua_State *s)
{
    loom_hooks *h = self_of(s);
    if (h->in_step) return luaL_error(s, "ctx:save_checkpoint() is for callbacks, not train_step (the step is half done)");
    char path[LOOM_PATH_MAX];
    if (h->host.save_checkpoint(h->host.self, path, &h->host_err)) return host_fail(s, h, "save_checkpoint");
    lua_pushstring(s, path);
    return 1;
}

static int ctx_log_scalar(lua_State *s)
{
    loom_hooks *h = self_of(s);
    const char *name = luaL_checkstring(s, 2);
    double v = luaL_checknumber(s, 3);
    size_t n = strlen(name);
    luaL_argcheck(s, n > 0 && n < LOOM_NAME_MAX && strspn(name, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                                                 "0123456789_./-") == n,
                  2, "a scalar's name is 1 to 63 of A-Z a-z 0-9 _ . / -");
    if (h->host.log_scalar(h->host.self, name, v, &h->host_err)) return host_fail(s, h, "log_scalar");
    return 0;
}

static int ctx_param(lua_State *s)
{
    loom_hooks *h = self_of(s);
    const char *name = luaL_checkstring(s, 2);
    loom_tensor view;
    if (h->host.param(h->host.self, name, &view, &h->host_err))
        return luaL_error(s, "ctx:param(): %s", h->host_err.msg); /* a wrong name: the caller's mistake */
    loom_lua_push_view(s, &view, false);
    return 1;
}

static int ctx_param_names(lua_State *s)
{
    loom_hooks *h = self_of(s);
    lua_newtable(s);
    const char *name;
    for (int i = 0; (name = h->host.param_name(h->host.self, i)); i++) {
        lua_pushstring(s, name);
        lua_rawseti(s, -2, i + 1);
    }
    return 1;
}

/* ---- custom step methods ----------------------------------------------------- */

static const char *const part_names[] = {"forward", "loss", "backward", "all_reduce_gradients", "apply_gradients"};

/* Raises an error unless a train_step is running and `need` was the last part done. */
static loom_hooks *step_check(lua_State *s, const char *method, int need)
{
    loom_hooks *h = self_of(s);
    if (!h->in_step) luaL_error(s, "ctx:%s() runs only inside train_step", method);
    if (need >= 0 && h->done != need)
        luaL_error(s, "ctx:%s() needs ctx:%s() just before it in this step", method, part_names[need]);
    return h;
}

static int run_part(lua_State *s, loom_hooks *h, loom_hook_part part, double *per_replica)
{
    if (h->host.step_part(h->host.self, part, per_replica, &h->host_err)) return host_fail(s, h, part_names[part]);
    return 0;
}

static int ctx_forward(lua_State *s)
{
    loom_hooks *h = step_check(s, "forward", -1);
    if (!lua_isnoneornil(s, 2)) {
        lua_rawgeti(s, LUA_REGISTRYINDEX, h->batch);
        luaL_argcheck(s, lua_rawequal(s, 2, -1), 2, "ctx:forward() runs on the batch train_step received");
        lua_pop(s, 1);
    }
    run_part(s, h, LOOM_HOOK_FORWARD, NULL);
    h->done = LOOM_HOOK_FORWARD;
    return 0;
}

static int ctx_loss(lua_State *s)
{
    loom_hooks *h = step_check(s, "loss", LOOM_HOOK_FORWARD);
    double v[LOOM_HOOK_MAX_REPLICAS];
    run_part(s, h, LOOM_HOOK_LOSS, v);
    h->done = LOOM_HOOK_LOSS;
    push_per_replica(s, v, h->host.num_replicas);
    return 1;
}

static int ctx_backward(lua_State *s)
{
    loom_hooks *h = step_check(s, "backward", LOOM_HOOK_LOSS);
    run_part(s, h, LOOM_HOOK_BACKWARD, NULL);
    h->done = LOOM_HOOK_BACKWARD;
    h->reduced = false;
    return 0;
}

static int ctx_all_reduce_gradients(lua_State *s)
{
    loom_hooks *h = step_check(s, "all_reduce_gradients", LOOM_HOOK_BACKWARD);
    if (h->reduced) return luaL_error(s, "ctx:all_reduce_gradients(): the gradients are already all-reduced");
    run_part(s, h, LOOM_HOOK_ALL_REDUCE, NULL);
    h->reduced = true;
    return 0;
}

static int ctx_clip_gradients_by_norm(lua_State *s)
{
    loom_hooks *h = step_check(s, "clip_gradients_by_norm", LOOM_HOOK_BACKWARD);
    double max = luaL_checknumber(s, 2);
    luaL_argcheck(s, max > 0 && isfinite(max), 2, "the norm must be a finite number > 0");
    double v[LOOM_HOOK_MAX_REPLICAS];
    if (h->host.clip_gradients(h->host.self, max, v, &h->host_err)) return host_fail(s, h, "clip_gradients_by_norm");
    push_per_replica(s, v, h->host.num_replicas);
    return 1;
}

static int ctx_apply_gradients(lua_State *s)
{
    loom_hooks *h = step_check(s, "apply_gradients", LOOM_HOOK_BACKWARD);
    if (!h->reduced)
        return luaL_error(s, "ctx:apply_gradients() needs ctx:all_reduce_gradients() first, so that every replica "
                             "applies the same update");
    if (h->applied) return luaL_error(s, "ctx:apply_gradients(): already applied in this step");
    run_part(s, h, LOOM_HOOK_APPLY, NULL);
    h->applied = true;
    return 0;
}

/* ctx:reduce("SUM" | "MEAN", v): v is one value per replica (a table) or a
 * number, which stands for the same value on every replica. */
static int ctx_reduce(lua_State *s)
{
    loom_hooks *h = self_of(s);
    static const char *const ops[] = {"SUM", "MEAN", NULL};
    int op = luaL_checkoption(s, 2, NULL, ops);
    int n = h->host.num_replicas;
    double sum = 0;
    if (lua_type(s, 3) == LUA_TNUMBER) {
        sum = lua_tonumber(s, 3) * n;
    } else {
        luaL_checktype(s, 3, LUA_TTABLE);
        luaL_argcheck(s, (int)luaL_len(s, 3) == n, 3, "expected one value per replica (ctx.num_replicas of them)");
        for (int r = 1; r <= n; r++) {
            lua_rawgeti(s, 3, r);
            int ok;
            double x = lua_tonumberx(s, -1, &ok);
            luaL_argcheck(s, ok, 3, "per-replica values must be numbers");
            sum += x;
            lua_pop(s, 1);
        }
    }
    lua_pushnumber(s, op == 0 ? sum : sum / n);
    return 1;
}

static const luaL_Reg ctx_methods[] = {
    {"stop", ctx_stop},
    {"set_learning_rate", ctx_set_learning_rate},
    {"save_checkpoint", ctx_save_checkpoint},
    {"log_scalar", ctx_log_scalar},
    {"param", ctx_param},
    {"param_names", ctx_param_names},
    {"forward", ctx_forward},
    {"loss", ctx_loss},
    {"backward", ctx_backward},
    {"all_reduce_gradients", ctx_all_reduce_gradients},
    {"clip_gradients_by_norm", ctx_clip_gradients_by_norm},
    {"apply_gradients", ctx_apply_gradients},
    {"reduce", ctx_reduce},
    {NULL, NULL},
};

/* ---- calling Lua ------------------------------------------------------------ */

static void set_num(lua_State *s, const char *k, double v)
{
    if (isnan(v)) lua_pushnil(s);
    else lua_pushnumber(s, v);
    lua_setfield(s, -2, k);
}

/* Pushes ctx with step, epoch and a fresh logs table (which the callbacks of
 * one event then share, as Keras's do: one may add a value for the next). */
static void push_ctx(loom_hooks *h, const loom_hook_logs *g, bool fresh)
{
    lua_State *s = loom_lua_state(h->L);
    lua_rawgeti(s, LUA_REGISTRYINDEX, h->ctx);
    if (!fresh) return;
    lua_pushinteger(s, g->step);
    lua_setfield(s, -2, "step");
    lua_pushinteger(s, g->epoch);
    lua_setfield(s, -2, "epoch");
    lua_createtable(s, 0, 8);
    set_num(s, "loss", g->loss);
    set_num(s, "accuracy", g->accuracy);
    set_num(s, "eval_loss", g->eval_loss);
    set_num(s, "eval_accuracy", g->eval_accuracy);
    set_num(s, "samples_per_sec", g->samples_per_sec);
    set_num(s, "learning_rate", g->learning_rate);
    for (int i = 0; i < g->n_metrics && i < LOOM_HOOK_MAX_METRICS; i++) {
        char k[64];
        set_num(s, g->metric_name[i], g->metric[i]);
        snprintf(k, sizeof k, "eval_%s", g->metric_name[i]);
        set_num(s, k, g->eval_metric[i]);
    }
    lua_setfield(s, -2, "logs");
}

/* loom_lua_call, with a host failure raised inside reported as the host's. */
static int call(loom_hooks *h, int nargs, int nresults, const char *what, loom_err *err)
{
    h->host_failed = false;
    int rc = loom_lua_call(h->L, nargs, nresults, err);
    if (rc && h->host_failed) {
        char where[sizeof err->where];
        snprintf(where, sizeof where, "%s", err->where);
        *err = h->host_err;
        if (!err->where[0]) snprintf(err->where, sizeof err->where, "%s", where);
    } else if (rc) {
        loom_err_prefix(err, "%s", what);
    }
    return rc;
}

/* A table of the config's args: { name = value, ... }. */
static void push_args(lua_State *s, const loom_hook_ref *r)
{
    lua_createtable(s, 0, r->n_args);
    for (int i = 0; i < r->n_args; i++) {
        switch (r->arg_type[i]) {
        case LOOM_HOOK_ARG_INT: lua_pushinteger(s, (lua_Integer)r->arg_num[i]); break;
        case LOOM_HOOK_ARG_BOOL: lua_pushboolean(s, r->arg_num[i] != 0); break;
        case LOOM_HOOK_ARG_STRING: lua_pushstring(s, r->arg_str[i]); break;
        default: lua_pushnumber(s, r->arg_num[i]); break;
        }
        lua_setfield(s, -2, r->arg_name[i]);
    }
}

/* Finds the function r names; errors say which config line named it and,
 * being found before anything runs (also by loom check), are config errors. */
static int resolve(loom_hooks *h, const loom_hook_ref *r, const char *base_dir, const char *what, int *fn,
                   loom_err *err)
{
    loom_lua_ref ref;
    char w[LOOM_PATH_MAX + 16];
    int rc = loom_lua_parse_ref(r->ref, base_dir, &ref, err);
    if (!rc) rc = loom_lua_resolve(h->L, &ref, fn, err);
    if (rc && rc != LOOM_ELUA) { /* the file itself: a config problem */
        loom_err_prefix(err, "%s", what);
        snprintf(err->where, sizeof err->where, "%s", loom_loc_str(&r->loc, w, sizeof w));
    } else if (rc) {
        loom_err_prefix(err, "%s (%s)", what, loom_loc_str(&r->loc, w, sizeof w));
    }
    if (rc && rc != LOOM_ENOMEM) err->code = rc = LOOM_ECONFIG;
    return rc;
}

/* Checks the table a factory returned (on top of the stack): known callback
 * names hold functions, step_interval is an integer >= 1, state a table. */
static int check_callbacks(loom_hooks *h, callback *cb, const char *what, int64_t interval, loom_err *err)
{
    lua_State *s = loom_lua_state(h->L);
    if (!lua_istable(s, -1))
        return loom_err_set(err, LOOM_ECONFIG, cb->where, "%s returned %s, not a table of callbacks", what,
                            luaL_typename(s, -1)),
               loom_err_hint(err, "end the factory with `return { on_epoch_end = function(ctx) ... end }`");
    cb->step_interval = interval;
    lua_pushnil(s);
    while (lua_next(s, -2)) {
        const char *key = lua_type(s, -2) == LUA_TSTRING ? lua_tostring(s, -2) : NULL;
        int t = lua_type(s, -1);
        if (key && !strcmp(key, "step_interval")) {
            int ok;
            lua_Integer v = lua_tointegerx(s, -1, &ok);
            if (!ok || v < 1)
                return lua_pop(s, 2), loom_err_set(err, LOOM_ECONFIG, cb->where, "%s: step_interval must be an integer >= 1",
                                                   what);
            cb->step_interval = v;
        } else if (key && !strcmp(key, "state") && t != LUA_TTABLE) {
            return lua_pop(s, 2), loom_err_set(err, LOOM_ECONFIG, cb->where, "%s: state must be a table", what);
        } else if (key && t == LUA_TFUNCTION) {
            int known = -1, best = -1, bd = 3;
            for (int i = 0; i < LOOM_NHOOKS_; i++) {
                if (!strcmp(key, hook_names[i])) known = i;
                int d = loom_edit_distance(key, hook_names[i]);
                if (d < bd) bd = d, best = i;
            }
            if (known < 0) {
                loom_err_set(err, LOOM_ECONFIG, cb->where, "%s: `%s` is not a callback (callbacks: on_train_begin, "
                             "on_epoch_begin, on_step_end, on_epoch_end, on_train_end)", what, key);
                if (best >= 0) loom_err_hint(err, "did you mean `%s`?", hook_names[best]);
                lua_pop(s, 2);
                return err->code;
            }
        }
        lua_pop(s, 1);
    }
    for (int i = 0; i < LOOM_NHOOKS_; i++) {
        lua_pushstring(s, hook_names[i]);
        int t = lua_rawget(s, -2); /* raw: no metamethod runs outside a protected call */
        lua_pop(s, 1);
        if (t == LUA_TFUNCTION) cb->has |= 1u << i;
        if (t != LUA_TNIL && t != LUA_TFUNCTION)
            return loom_err_set(err, LOOM_ECONFIG, cb->where, "%s: %s is a %s, not a function", what, hook_names[i],
                                lua_typename(s, t));
    }
    cb->table = luaL_ref(s, LUA_REGISTRYINDEX);
    return LOOM_OK;
}

/* Loads callback i: finds its factory, calls it with its args. */
static int open_callback(loom_hooks *h, const loom_hooks_spec *hs, int i, const char *base_dir, loom_err *err)
{
    lua_State *s = loom_lua_state(h->L);
    callback *cb = &h->cb[i];
    char what[64];
    snprintf(what, sizeof what, "hooks.callbacks.[%d]", i);
    loom_loc_str(&hs->callback[i].loc, cb->where, sizeof cb->where);
    int fn;
    int rc = resolve(h, &hs->callback[i], base_dir, what, &fn, err);
    if (rc) return rc;
    loom_lua_push_fn(h->L, fn);
    loom_lua_unref(h->L, fn);
    push_args(s, &hs->callback[i]);
    if ((rc = call(h, 1, 1, what, err))) return rc;
    rc = check_callbacks(h, cb, what, hs->step_interval, err);
    if (rc) lua_pop(s, 1);
    return rc;
}

/* The ctx table every hook receives: fields set per call, methods in its metatable. */
static void make_ctx(loom_hooks *h)
{
    lua_State *s = loom_lua_state(h->L);
    lua_newtable(s);
    lua_pushinteger(s, h->host.num_replicas);
    lua_setfield(s, -2, "num_replicas");
    lua_createtable(s, 0, 1); /* the metatable: methods are closures over h */
    lua_createtable(s, 0, (int)(sizeof ctx_methods / sizeof ctx_methods[0]));
    lua_pushlightuserdata(s, h);
    luaL_setfuncs(s, ctx_methods, 1);
    lua_setfield(s, -2, "__index");
    lua_setmetatable(s, -2);
    h->ctx = luaL_ref(s, LUA_REGISTRYINDEX);
}

int loom_hooks_open(loom_hooks **out, const loom_spec *spec, const char *model_dir, const loom_hook_host *host,
                    loom_err *err)
{
    *out = NULL;
    const loom_hooks_spec *hs = &spec->hooks;
    loom_hooks *h = loom_calloc(1, sizeof *h);
    if (!h) return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating the hooks");
    if (host->num_replicas < 1 || host->num_replicas > LOOM_HOOK_MAX_REPLICAS) {
        loom_free(h);
        return loom_err_set(err, LOOM_EUNSUPPORTED, NULL, "Lua hooks run with 1 to %d replicas, not %d",
                            LOOM_HOOK_MAX_REPLICAS, host->num_replicas);
    }
    h->host = *host;
    h->step_fn = h->step_args = h->batch = LUA_NOREF;
    for (int i = 0; i < LOOM_MAX_CALLBACKS; i++) h->cb[i].table = LUA_NOREF;
    char base_dir[LOOM_PATH_MAX];
    const char *slash = strrchr(spec->path, '/');
    snprintf(base_dir, sizeof base_dir, "%.*s", slash ? (int)(slash - spec->path) : 1, slash ? spec->path : ".");
    loom_lua_opts o = {.model_dir = model_dir, .base_dir = base_dir, .unsafe = hs->unsafe,
                       .memory_limit = hs->memory_limit, .instruction_limit = hs->instruction_limit};
    int rc = loom_lua_open(&h->L, &o, err);
    if (!rc) make_ctx(h);
    for (int i = 0; !rc && i < hs->n_callbacks; i++) {
        rc = open_callback(h, hs, i, base_dir, err);
        if (!rc) h->n_cb++;
    }
    if (!rc && hs->has_train_step) {
        char w[LOOM_PATH_MAX + 16];
        loom_loc_str(&hs->train_step.loc, h->step_where, sizeof h->step_where);
        rc = resolve(h, &hs->train_step, base_dir, "hooks.train_step", &h->step_fn, err);
        if (!rc && !host->step_part)
            rc = loom_err_set(err, LOOM_ECONFIG, loom_loc_str(&hs->train_step.loc, w, sizeof w),
                              "hooks.train_step: strategy \"%s\" cannot run a custom training step",
                              spec->strategy.name),
            loom_err_hint(err, "use strategy.type = \"one_device\", or remove hooks.train_step");
        if (!rc) {
            lua_State *s = loom_lua_state(h->L);
            push_args(s, &hs->train_step);
            h->step_args = luaL_ref(s, LUA_REGISTRYINDEX);
        }
    }
    if (rc) {
        loom_hooks_close(h);
        return rc;
    }
    *out = h;
    return LOOM_OK;
}

void loom_hooks_close(loom_hooks *h)
{
    if (!h) return;
    loom_lua_close(h->L); /* the references go with the state */
    loom_free(h);
}

int  loom_hooks_num_callbacks(const loom_hooks *h) { return h->n_cb; }
bool loom_hooks_has_train_step(const loom_hooks *h) { return h->step_fn != LUA_NOREF; }

/* Work that touches the Lua state runs inside loom_lua_call (through
 * trampoline), so a memory error or a metamethod that raises is reported
 * like any Lua error instead of escaping an unprotected call. */
typedef struct job {
    loom_hooks            *h;
    int                  (*fn)(lua_State *s, struct job *j);
    loom_hook_kind         kind;
    int                    i;
    const loom_hook_logs  *logs;
    const loom_elem_spec  *es;
    const loom_elem       *batch;
    loom_buf              *b;
    bool                   fresh; /* the first callback of an event: new ctx.logs */
} job;

static int trampoline(lua_State *s)
{
    job *j = lua_touserdata(s, 1);
    lua_settop(s, 0);
    return j->fn(s, j);
}

static int run_job(job *j, const char *what, loom_err *err)
{
    lua_State *s = loom_lua_state(j->h->L);
    lua_pushcfunction(s, trampoline); /* a light C function and a light userdata: no allocation */
    lua_pushlightuserdata(s, j);
    return call(j->h, 1, 0, what, err);
}

static int do_callback(lua_State *s, job *j)
{
    loom_hooks *h = j->h;
    lua_rawgeti(s, LUA_REGISTRYINDEX, h->cb[j->i].table);
    lua_getfield(s, -1, hook_names[j->kind]);
    push_ctx(h, j->logs, j->fresh);
    lua_call(s, 1, 0);
    return 0;
}

int loom_hooks_call(loom_hooks *h, loom_hook_kind kind, const loom_hook_logs *logs, loom_err *err)
{
    bool fresh = true;
    for (int i = 0; i < h->n_cb; i++) {
        callback *cb = &h->cb[i];
        if (kind == LOOM_HOOK_STEP_END && logs->step % cb->step_interval != 0) continue;
        if (!(cb->has & (1u << kind))) continue;
        job j = {.h = h, .fn = do_callback, .kind = kind, .i = i, .logs = logs, .fresh = fresh};
        fresh = false;
        char what[LOOM_PATH_MAX + 64];
        snprintf(what, sizeof what, "%s (hooks.callbacks.[%d], %s)", hook_names[kind], i, cb->where);
        int rc = run_job(&j, what, err);
        if (rc) return rc;
    }
    return LOOM_OK;
}

static int do_train_step(lua_State *s, job *j)
{
    loom_hooks *h = j->h;
    lua_rawgeti(s, LUA_REGISTRYINDEX, h->step_fn);
    push_ctx(h, j->logs, true);
    loom_lua_push_elem(s, j->es, j->batch, false);
    lua_pushvalue(s, -1);
    h->batch = luaL_ref(s, LUA_REGISTRYINDEX);
    lua_rawgeti(s, LUA_REGISTRYINDEX, h->step_args);
    h->in_step = true;
    lua_call(s, 3, 0);
    return 0;
}

int loom_hooks_train_step(loom_hooks *h, const loom_elem_spec *es, const loom_elem *batch, const loom_hook_logs *logs,
                          bool *applied, loom_err *err)
{
    lua_State *s = loom_lua_state(h->L);
    h->done = -1;
    h->reduced = h->applied = false;
    job j = {.h = h, .fn = do_train_step, .logs = logs, .es = es, .batch = batch};
    char what[LOOM_PATH_MAX + 32];
    snprintf(what, sizeof what, "train_step (%s)", h->step_where);
    int rc = run_job(&j, what, err);
    h->in_step = false;
    luaL_unref(s, LUA_REGISTRYINDEX, h->batch); /* frees no memory: cannot raise */
    h->batch = LUA_NOREF;
    *applied = h->applied;
    return rc;
}

/* ---- state across a resume -------------------------------------------------- */

static int cmp_str(const void *a, const void *b) { return strcmp(*(const char *const *)a, *(const char *const *)b); }

/* Callback i's state table (on top of the stack) into b, keys sorted so the
 * bytes do not depend on Lua's hash order. */
static void save_state(lua_State *s, int i, loom_buf *b)
{
    const char *keys[STATE_MAX_KEYS];
    int n = 0;
    lua_pushnil(s);
    while (lua_next(s, -2)) {
        lua_pop(s, 1);
        if (lua_type(s, -1) != LUA_TSTRING || n == STATE_MAX_KEYS)
            luaL_error(s, "hooks.callbacks.[%d]: state keys must be strings, at most %d of them", i, STATE_MAX_KEYS);
        keys[n++] = lua_tostring(s, -1); /* kept alive by the table */
    }
    qsort(keys, (size_t)n, sizeof keys[0], cmp_str);
    loom_buf_put_u32(b, (uint32_t)n);
    for (int k = 0; k < n; k++) {
        lua_pushstring(s, keys[k]);
        int t = lua_rawget(s, -2);
        loom_buf_put_str(b, keys[k]);
        loom_buf_put_u32(b, (uint32_t)t);
        if (t == LUA_TNUMBER) loom_buf_put_f64(b, lua_tonumber(s, -1));
        else if (t == LUA_TBOOLEAN) loom_buf_put_u32(b, (uint32_t)lua_toboolean(s, -1));
        else if (t == LUA_TSTRING) loom_buf_put_str(b, lua_tostring(s, -1));
        else luaL_error(s, "hooks.callbacks.[%d]: state.%s is a %s; a checkpoint keeps numbers, strings and booleans",
                        i, keys[k], lua_typename(s, t));
        lua_pop(s, 1);
    }
}

static int do_save(lua_State *s, job *j)
{
    loom_hooks *h = j->h;
    loom_buf_put_u32(j->b, STATE_MAGIC);
    loom_buf_put_u32(j->b, (uint32_t)h->n_cb);
    for (int i = 0; i < h->n_cb; i++) {
        lua_rawgeti(s, LUA_REGISTRYINDEX, h->cb[i].table);
        lua_pushliteral(s, "state");
        int has = lua_rawget(s, -2) == LUA_TTABLE;
        loom_buf_put_u32(j->b, (uint32_t)has);
        if (has) save_state(s, i, j->b);
        lua_pop(s, 2);
    }
    return 0;
}

int loom_hooks_save(loom_hooks *h, loom_buf *b, loom_err *err)
{
    job j = {.h = h, .fn = do_save, .b = b};
    return run_job(&j, "saving the callbacks' state", err);
}

/* One saved state table, pushed; raises when the bytes are bad. */
static void restore_state(lua_State *s, loom_buf *b)
{
    uint32_t n = loom_buf_get_u32(b);
    if (b->failed || n > STATE_MAX_KEYS) luaL_error(s, "bad state table");
    lua_createtable(s, 0, (int)n);
    char key[LOOM_NAME_MAX * 4], str[LOOM_PATH_MAX];
    for (uint32_t k = 0; k < n; k++) {
        loom_buf_get_str(b, key, sizeof key);
        uint32_t t = loom_buf_get_u32(b);
        if (t == LUA_TNUMBER) {
            double v = loom_buf_get_f64(b);
            /* integers come back as integers: 3 and 3.0 print differently in Lua */
            if (v == floor(v) && fabs(v) < 9007199254740992.0) lua_pushinteger(s, (lua_Integer)v);
            else lua_pushnumber(s, v);
        } else if (t == LUA_TBOOLEAN) {
            lua_pushboolean(s, (int)loom_buf_get_u32(b));
        } else if (t == LUA_TSTRING) {
            loom_buf_get_str(b, str, sizeof str);
            lua_pushstring(s, str);
        } else {
            luaL_error(s, "bad value type %d", (int)t);
        }
        if (b->failed) luaL_error(s, "truncated state table");
        lua_setfield(s, -2, key);
    }
}

static int do_restore(lua_State *s, job *j)
{
    loom_hooks *h = j->h;
    for (int i = 0; i < h->n_cb; i++) {
        uint32_t has = loom_buf_get_u32(j->b);
        if (!has) continue;
        lua_rawgeti(s, LUA_REGISTRYINDEX, h->cb[i].table);
        lua_pushliteral(s, "state");
        restore_state(s, j->b);
        lua_rawset(s, -3);
        lua_pop(s, 1);
    }
    return 0;
}

int loom_hooks_restore(loom_hooks *h, loom_buf *b, loom_err *err)
{
    if (b->pos >= b->len) return LOOM_OK; /* written by a run without hooks */
    uint32_t magic = loom_buf_get_u32(b), n = loom_buf_get_u32(b);
    if (b->failed || magic != STATE_MAGIC)
        return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "the hooks' state in the checkpoint is unreadable");
    if ((int)n != h->n_cb) {
        loom_warn("the checkpoint holds the state of %u callbacks, the config has %d: their state starts afresh", n,
                  h->n_cb);
        return LOOM_OK;
    }
    job j = {.h = h, .fn = do_restore, .b = b};
    if (run_job(&j, "restoring the callbacks' state", err) == LOOM_OK) return LOOM_OK;
    return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "the hooks' state in the checkpoint is unreadable (%s)", err->msg);
}
