/* script_internal.h - private to appliance/script: the state behind a
 * loom_lua, the tensor userdata layout, and the glue between the files. */
#ifndef LOOM_SCRIPT_INTERNAL_H
#define LOOM_SCRIPT_INTERNAL_H

#include "script.h"

#include <lauxlib.h>

struct loom_lua {
    lua_State    *L;
    loom_lua_opts opts;                    /* strings point at the copies below */
    char          model_dir[LOOM_PATH_MAX];
    char          base_dir[LOOM_PATH_MAX];
    size_t        mem, peak;               /* bytes held by Lua now / at most */
    size_t        soft, cap;               /* the limit (hook, tensors: with a location), the allocator's backstop
                                              (twice the limit); 0 = none */
    int           hit_cap;                 /* the last failure was the memory cap */
    int64_t       budget, used;            /* instructions per call (<= 0: none), used in this call */
    int           every;                   /* hook period */
    uint64_t      gen;                     /* view generation: views of older generations are dead */
    int           in_call;                 /* inside loom_lua_call */
    int           fatal;                   /* a limit was hit in this call: nothing may catch it (pcall, xpcall,
                                              coroutine.resume); cleared when the next call starts */
    char          fatal_msg[512];          /* "file:line: instruction limit of ..." re-raised by those */
};

/* Whether a view (gen != 0) may be used: during a call, only its own views;
 * between calls, also those of the call that just returned (its results). */
static inline int loom_lua_view_live_(const loom_lua *S, uint64_t gen)
{
    return !gen || gen == S->gen || (!S->in_call && gen + 1 == S->gen);
}

#define TENSOR_MT "loom.tensor"
#define RNG_MT    "loom.rng"

/* The "loom.tensor" userdata. */
typedef struct ltensor {
    loom_tensor t;      /* t.data: own, or the viewed memory */
    void       *own;    /* Lua-allocated data (capped), freed by __gc */
    size_t      own_bytes;
    uint64_t    gen;    /* views: the generation they belong to; 0 for owned tensors */
    int         ro;     /* a read-only view: copied on first write */
} ltensor;

int   loom_lua_setup_(lua_State *L);
void  loom_lua_open_module_(lua_State *L);             /* the global `loom` and the metatables */
int   loom_lua_memory_error_(lua_State *L);            /* raises the memory-limit error */
void *loom_lua_alloc_(lua_State *L, size_t n);         /* capped; raises on failure */
void  loom_lua_free_(lua_State *L, void *p, size_t n);
int   loom_lua_write_allowed_(loom_lua *S, const char *path);

/* pattern.c: string.find/match/gmatch/gsub whose matching steps go to charge (which may raise;
 * NULL: not counted), replacing the string library's in the state's `string` table. */
typedef void (*loom_lua_charge_fn)(lua_State *L, lua_Integer steps);
void loom_lua_open_patterns_(lua_State *L, loom_lua_charge_fn charge);

#endif
