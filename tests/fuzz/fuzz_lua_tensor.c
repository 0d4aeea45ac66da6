/* fuzz_lua_tensor.c - libFuzzer target for the Lua tensor API (lua_tensor.c):
 * the input is a little program of tensor operations (loom.tensor with any
 * dtype name, rank and dims, fills; get/set with flat and per-dim indices,
 * reshape, select, crop, pad, fill_rect, flips, casts, elementwise ops,
 * reductions, loom.stack) whose integer arguments are drawn from edge values
 * (0, -1, 2^31, 2^32, 2^40, 2^62 + 1, INT64_MAX, INT64_MIN...). Each call runs
 * protected in a sandboxed state with a 16 MiB memory limit, as a hook does;
 * a Lua error is fine, a crash or an over-read is not. Built and run by
 * tests/fuzz/run.sh, or by hand from the repository root:
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined -D_GNU_SOURCE -I appliance -I/usr/include/lua5.4 \
 *     tests/fuzz/fuzz_lua_tensor.c appliance/script/{script,lua_tensor}.c appliance/data/transform/transforms.c \
 *     appliance/core/[a-z]*.c appliance/tensor/{tensor,blas}.c -llua5.4 -lz -lzstd -lm -ldl -lpthread -o /tmp/fuzz_lua
 *   /tmp/fuzz_lua -max_total_time=30 /tmp/corpus_lua tests/fuzz/corpus/lua_tensor
 * Invariants checked: every tensor Lua holds has a valid shape (its checked
 * element count exists) and owns at least that many bytes (every byte is read
 * under ASan); a failed call leaves a message. */
#include "script/script.h"

#include <lauxlib.h>
#include <stdint.h>
#include <string.h>

#define CHECK(c) do { if (!(c)) __builtin_trap(); } while (0)
#define SLOTS 4

typedef struct {
    const uint8_t *p;
    size_t         n;
} input;

static unsigned byte(input *in)
{
    if (!in->n) return 0;
    in->n--;
    return *in->p++;
}

/* An integer argument: mostly small, sometimes an edge value. */
static int64_t integer(input *in)
{
    static const int64_t edge[] = {0, 1, -1, 2, 3, 4, 255, 256, 65536, (int64_t)1 << 31, (int64_t)1 << 32,
                                   (int64_t)1 << 40, ((int64_t)1 << 40) + 1, (int64_t)1 << 41, (int64_t)1 << 62,
                                   ((int64_t)1 << 62) + 1, INT64_MAX, INT64_MIN, INT64_MAX - 1, -((int64_t)1 << 62)};
    unsigned b = byte(in);
    if (b < 192) return (int64_t)(b % 12) - 1; /* -1 .. 10 */
    return edge[(b - 192) % (sizeof edge / sizeof edge[0])];
}

static void push_shape(lua_State *L, input *in)
{
    int rank = (int)(byte(in) % 10); /* 9: one too many */
    lua_createtable(L, rank, 0);
    for (int d = 0; d < rank; d++) {
        lua_pushinteger(L, integer(in));
        lua_rawseti(L, -2, d + 1);
    }
}

static const char *const dtypes[] = {"uint8", "int32", "int64", "float32", "float64", "bfloat16"};

/* Reads every byte of every tensor in the slots: ASan checks each buffer is as large as its shape says. */
static void check_slots(lua_State *L)
{
    lua_getglobal(L, "T");
    for (int s = 1; s <= SLOTS; s++) {
        lua_rawgeti(L, -1, s);
        const loom_tensor *t = loom_lua_to_tensor(L, -1);
        if (t) {
            int64_t n;
            CHECK(loom_shape_numel_checked(&t->shape, -1, &n) == 0);
            size_t bytes = (size_t)n * loom_dtype_size(t->dtype);
            volatile uint8_t x = 0;
            for (size_t i = 0; i < bytes; i++) x ^= ((const uint8_t *)t->data)[i];
            (void)x;
        }
        lua_pop(L, 1);
    }
    lua_pop(L, 1);
}

/* One operation: pushes a function and its arguments, calls it protected, and keeps a tensor result in a slot. */
static void step(loom_lua *S, input *in)
{
    lua_State *L = loom_lua_state(S);
    static const char *const methods[] = {"get", "set", "reshape", "select", "crop", "pad", "fill_rect", "flip_left_right",
                                          "flip_up_down", "cast", "add", "clamp", "sum", "max", "copy", "numel", "dim",
                                          "scale", "per_image_standardization", "fill"};
    unsigned op = byte(in), dst = byte(in) % SLOTS + 1;
    int nargs = 0;
    lua_getglobal(L, "T");
    int tab = lua_gettop(L);
    if (op % 4 == 0) { /* loom.tensor(dtype, shape[, fill]) */
        lua_getglobal(L, "loom");
        lua_getfield(L, -1, "tensor");
        lua_remove(L, -2);
        lua_pushstring(L, dtypes[byte(in) % 6]);
        push_shape(L, in);
        nargs = 2;
        unsigned f = byte(in) % 3;
        if (f == 1) {
            lua_pushinteger(L, integer(in));
            nargs++;
        } else if (f == 2) {
            int k = (int)(byte(in) % 8);
            lua_createtable(L, k, 0);
            for (int i = 0; i < k; i++) {
                lua_pushinteger(L, integer(in));
                lua_rawseti(L, -2, i + 1);
            }
            nargs++;
        }
    } else if (op % 16 == 1) { /* loom.stack({T[a], T[b]}) */
        lua_getglobal(L, "loom");
        lua_getfield(L, -1, "stack");
        lua_remove(L, -2);
        lua_createtable(L, 2, 0);
        for (int i = 1; i <= 2; i++) {
            lua_rawgeti(L, tab, (lua_Integer)(byte(in) % SLOTS + 1));
            lua_rawseti(L, -2, i);
        }
        nargs = 1;
    } else { /* T[src]:method(args...) */
        const char *m = methods[byte(in) % (sizeof methods / sizeof methods[0])];
        lua_rawgeti(L, tab, (lua_Integer)(byte(in) % SLOTS + 1));
        if (!loom_lua_to_tensor(L, -1)) {
            lua_settop(L, tab - 1);
            return;
        }
        lua_getfield(L, -1, m);
        lua_insert(L, -2); /* method self */
        nargs = 1;
        if (!strcmp(m, "reshape")) {
            push_shape(L, in);
            nargs++;
        } else if (!strcmp(m, "cast")) {
            lua_pushstring(L, dtypes[byte(in) % 6]);
            nargs++;
        } else {
            int k = (int)(byte(in) % 7);
            for (int i = 0; i < k; i++, nargs++) lua_pushinteger(L, integer(in));
        }
    }
    loom_err err = {0};
    if (loom_lua_call(S, nargs, 1, &err) == LOOM_OK) {
        if (loom_lua_to_tensor(L, -1)) lua_rawseti(L, tab, dst);
    } else {
        CHECK(err.msg[0]);
    }
    lua_settop(L, tab - 1);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    loom_lua_opts o = {.memory_limit = 16 << 20, .instruction_limit = 100000};
    loom_lua *S;
    loom_err err;
    if (loom_lua_open(&S, &o, &err)) return 0;
    lua_State *L = loom_lua_state(S);
    lua_createtable(L, SLOTS, 0);
    lua_setglobal(L, "T");
    input in = {data, size};
    for (int i = 0; in.n && i < 64; i++) {
        step(S, &in);
        check_slots(L);
    }
    loom_lua_close(S);
    return 0;
}
