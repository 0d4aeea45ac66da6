/* script.h - the embedded Lua 5.4: sandboxed states with a memory cap and a
 * per-call instruction budget, "file.lua:function" references, protected
 * calls whose errors become a loom_err ("lua/augment.lua:12" + message +
 * traceback, LOOM_ELUA), and the "loom.tensor" / "loom.rng" userdata with the
 * `loom` Lua module (tensor ops that run in C).
 *
 * Threads: a loom_lua (one lua_State) belongs to one thread at a time and is
 * never shared; make one per thread that runs Lua (the train thread's for
 * callbacks, one per concurrent call of a data map or filter). Different
 * loom_lua may be used from different threads at once.
 *
 * Ownership: loom_lua_open returns a state freed with loom_lua_close; every
 * Lua allocation (tables, strings, tensor data) counts against its cap. */
#ifndef LOOM_SCRIPT_H
#define LOOM_SCRIPT_H

#include "data/data.h"

#include <lua.h>
#include <stdbool.h>

/* Defaults of hooks.memory_limit and hooks.instruction_limit. */
#define LOOM_LUA_DEFAULT_MEMORY       (64 * 1024 * 1024LL) /* bytes per state */
#define LOOM_LUA_DEFAULT_INSTRUCTIONS 100000000LL          /* VM instructions per call */

typedef struct loom_lua_opts {
    const char *model_dir;         /* the only place the sandbox's io.open may write; NULL/"" = nowhere */
    const char *base_dir;          /* the config's directory: file references and require() resolve against it;
                                      NULL/"" = the working directory */
    bool        unsafe;            /* hooks.unsafe: the whole standard library (os, io, debug, C modules) */
    int64_t     memory_limit;      /* bytes the state may hold; 0 = LOOM_LUA_DEFAULT_MEMORY, < 0 = no cap.
                                      Enforced at each tensor allocation and every 1000 instructions (a Lua
                                      error at the running line); the allocator refuses twice the limit */
    int64_t     instruction_limit; /* VM instructions per loom_lua_call; 0 = default, < 0 = no budget */
} loom_lua_opts;

typedef struct loom_lua loom_lua;

/* Creates a state: the standard libraries (safe subset unless opts->unsafe),
 * the global `loom` module, the capped allocator and the budget hook.
 * opts may be NULL (all defaults). Free with loom_lua_close. */
int  loom_lua_open(loom_lua **out, const loom_lua_opts *opts, loom_err *err);
void loom_lua_close(loom_lua *L); /* NULL is a no-op */
/* The raw state, for pushing arguments and reading results (borrowed). Never
 * call lua_call/lua_pcall on it directly: use loom_lua_call. */
lua_State *loom_lua_state(loom_lua *L);
/* The loom_lua that owns state s (also from a coroutine of it), or NULL. */
loom_lua  *loom_lua_from_state(lua_State *s);

/* A reference "lua/augment.lua:cutout" split into the file (resolved against
 * the base directory unless absolute) and the function name ("cutout", or a
 * dotted field path "M.cutout"). */
typedef struct loom_lua_ref {
    char file[LOOM_PATH_MAX];  /* the path as opened, and as error messages name it */
    char func[LOOM_NAME_MAX];
} loom_lua_ref;

/* Parses ref; base_dir may be NULL. A reference without ':' or with an empty
 * part is LOOM_ECONFIG with a hint showing the expected form. */
int  loom_lua_parse_ref(const char *ref, const char *base_dir, loom_lua_ref *out, loom_err *err);

/* Runs a Lua file once in its own environment (globals it defines stay in
 * that environment, which reads through to the shared globals); later calls
 * with the same path reuse it. A missing file is LOOM_EIO; a syntax error is
 * LOOM_ELUA with where = "file:line"; an error while the chunk runs is
 * LOOM_ELUA with its traceback. */
int  loom_lua_load(loom_lua *L, const char *path, loom_err *err);

/* Loads ref's file and finds its function: a field of the table the chunk
 * returned, else a global the chunk defined. Returns a registry reference
 * (luaL_ref) in *fn, released with loom_lua_unref. A function that is not
 * there is LOOM_ELUA naming the file and the function and listing the
 * functions the file does define. */
int  loom_lua_resolve(loom_lua *L, const loom_lua_ref *ref, int *fn, loom_err *err);
void loom_lua_unref(loom_lua *L, int fn);
/* Pushes the function held by a reference from loom_lua_resolve. */
void loom_lua_push_fn(loom_lua *L, int fn);

/* Calls the function below nargs arguments on the stack (as lua_pcall does)
 * with a fresh instruction budget, leaving nresults results (LUA_MULTRET
 * allowed). On failure the function and arguments are popped, nothing is
 * pushed, and err is LOOM_ELUA with where = "file:line" of the failing Lua
 * line (the Lua file, not the config), msg = the message followed by the
 * stack traceback, or a budget / memory message naming hooks.instruction_limit
 * / hooks.memory_limit. The state stays usable after an error. Tensor views
 * pushed for this call (loom_lua_push_view) die with it (see there). */
int  loom_lua_call(loom_lua *L, int nargs, int nresults, loom_err *err);

/* Bytes the state holds now / the most it held. */
size_t loom_lua_memory(const loom_lua *L);
size_t loom_lua_memory_peak(const loom_lua *L);

/* ---- tensors in Lua ("loom.tensor" userdata) ------------------------------
 * Lua sees a tensor t with t:shape(), t:dtype(), t:numel(), t:get(i...),
 * t:set(i..., v) (1-based, flat index or one index per dim) and C ops (see
 * docs/lua.md). A tensor either owns its data (allocated through the capped
 * allocator, freed by the GC) or is a view of memory the caller owns. */

/* Pushes a new zeroed tensor owned by Lua; returns it (valid while it is
 * reachable from Lua), or raises a Lua memory error. Call only inside a
 * protected call or with the stack room to handle the error (as any Lua API). */
loom_tensor *loom_lua_push_tensor(lua_State *s, loom_dtype dt, const loom_shape *shape);
/* Pushes a view of t's data (not copied). writable = false: a write first
 * copies the data into Lua-owned memory (copy on write), so t is never
 * modified. A view lives for the loom_lua_call it is an argument of: Lua
 * code that keeps it and uses it in a later call gets a Lua error instead of
 * touching freed memory; C may still read a view returned by that call
 * (loom_lua_to_tensor) until the next loom_lua_call or loom_lua_drop_views.
 * The tensor struct t may go away after the push; its data must not until
 * then. */
void loom_lua_push_view(lua_State *s, const loom_tensor *t, bool writable);
/* Invalidates every view pushed so far (each loom_lua_call does this for its
 * arguments when it returns, bar reading its results). */
void loom_lua_drop_views(loom_lua *L);
/* The tensor at idx, or NULL when the value is not a live tensor. The
 * returned struct is borrowed: its data is valid while the value is. */
const loom_tensor *loom_lua_to_tensor(lua_State *s, int idx);
/* As loom_lua_to_tensor but raises a Lua argument error (for C functions). */
const loom_tensor *loom_lua_check_tensor(lua_State *s, int idx);

/* Pushes a "loom.rng" userdata drawing from loom_rng_init(seed, a, b, c):
 * rng:uniform([lo, hi]), rng:normal([mean, std]), rng:int(lo, hi) (inclusive),
 * rng:bernoulli(p). */
void loom_lua_push_rng(lua_State *s, uint64_t seed, uint64_t a, uint64_t b, uint64_t c);

/* Pushes the element as a table { name = tensor view, ... } (views as by
 * loom_lua_push_view, writable or copy on write). */
void loom_lua_push_elem(lua_State *s, const loom_elem_spec *spec, const loom_elem *e, bool writable);

/* ---- the data provider -------------------------------------------------- */

/* Registers the "lua" custom element-function provider (data/engine/custom.h) in the
 * shared registry, so `map` and `filter` transforms may name a Lua function.
 * Idempotent; call once at startup before any loom_data_open. */
int  loom_script_register(loom_err *err);

/* Lua callbacks and custom training steps (the config's `hooks`): the second
 * part of this header, kept in its own file. */
#include "script/hooks.h"

#endif
