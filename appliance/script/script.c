/* script.c - sandboxed Lua states: the capped allocator, the instruction
 * budget hook, the safe subset of the standard library, loading files into
 * their own environments, resolving "file.lua:function" references, and
 * protected calls whose errors become a loom_err with file:line + traceback.
 * Threads: a loom_lua is used by one thread at a time (see script.h). */
#include "script_internal.h"

#include <lauxlib.h>
#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <lualib.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#define FILES_KEY  "loom.files"   /* registry: path -> { env = ..., ret = ... } */
#define HOOK_EVERY 1000           /* instructions between budget checks */

/* ---- allocation -------------------------------------------------------------- */

/* Lua's allocator. The limit itself (S->soft) is enforced where a location is
 * known: by the hook every HOOK_EVERY instructions and by tensor allocations,
 * each raising a Lua error at the running line. The allocator only refuses to
 * grow past twice the limit (S->cap), a backstop for one huge allocation
 * between two checks (a memory error without a line). */
static void *capped_alloc(void *ud, void *ptr, size_t osize, size_t nsize)
{
    loom_lua *S = ud;
    size_t old = ptr ? osize : 0;
    if (nsize == 0) {
        loom_free(ptr);
        S->mem -= old;
        return NULL;
    }
    if (S->cap && nsize > old && S->mem - old + nsize > S->cap) {
        S->hit_cap = 1;
        return NULL;
    }
    void *p = loom_realloc(ptr, nsize);
    if (!p) return NULL;
    if (nsize > old && S->in_call) S->used += (int64_t)((nsize - old) >> 6); /* C loops that build big strings
                                                                     cost their bytes / 64 (the hook raises) */
    S->mem = S->mem - old + nsize;
    if (S->mem > S->peak) S->peak = S->mem;
    return p;
}

/* "64 MiB" */
static const char *bytes_str(size_t n, char *buf, size_t len)
{
    if (n >= (1u << 20) && n % (1u << 20) == 0) snprintf(buf, len, "%zu MiB", n >> 20);
    else if (n >= 1024 && n % 1024 == 0) snprintf(buf, len, "%zu KiB", n >> 10);
    else snprintf(buf, len, "%zu bytes", n);
    return buf;
}

static void budget_hook(lua_State *L, lua_Debug *ar);

/* Records a limit's error as fatal for the rest of the call and raises it:
 * pcall, xpcall and coroutine.resume re-raise it instead of returning it. */
static int fatal_error(lua_State *L, int level, const char *msg)
{
    loom_lua *S = loom_lua_from_state(L);
    lua_Debug ar;
    char where[LOOM_PATH_MAX + 24] = "";
    if (lua_getstack(L, level, &ar) && lua_getinfo(L, "Sl", &ar) && ar.currentline > 0)
        snprintf(where, sizeof where, "%s:%d: ", ar.short_src, ar.currentline);
    if (!S->fatal || !S->fatal_msg[0]) snprintf(S->fatal_msg, sizeof S->fatal_msg, "%s%s", where, msg);
    S->fatal = 1;
    /* from now on every instruction of this thread fails (others: at their next hook), so no handler runs long */
    if (S->in_call) lua_sethook(L, budget_hook, LUA_MASKCOUNT, 1);
    lua_pushstring(L, S->fatal_msg);
    return lua_error(L);
}

static int memory_error(lua_State *L, int level)
{
    loom_lua *S = loom_lua_from_state(L);
    char b[32], m[128];
    S->hit_cap = 1;
    snprintf(m, sizeof m, "memory limit of %s reached (hooks.memory_limit)", bytes_str(S->soft, b, sizeof b));
    return fatal_error(L, level, m);
}

int loom_lua_memory_error_(lua_State *L) { return memory_error(L, 1); }

void *loom_lua_alloc_(lua_State *L, size_t n)
{
    void *ud;
    lua_Alloc f = lua_getallocf(L, &ud);
    loom_lua *S = loom_lua_from_state(L);
    if (S->soft && (n > S->soft || S->mem + n > S->soft)) {
        lua_gc(L, LUA_GCCOLLECT);
        if (n > S->soft || S->mem + n > S->soft) loom_lua_memory_error_(L);
    }
    void *p = n ? f(ud, NULL, 0, n) : NULL;
    if (n && !p) loom_lua_memory_error_(L);
    return p;
}

void loom_lua_free_(lua_State *L, void *p, size_t n)
{
    void *ud;
    lua_Alloc f = lua_getallocf(L, &ud);
    if (p) f(ud, p, n, 0);
}

/* ---- the instruction budget ---------------------------------------------------- */

static void budget_hook(lua_State *L, lua_Debug *ar)
{
    (void)ar;
    loom_lua *S = loom_lua_from_state(L);
    if (S->fatal) { /* a limit was hit (maybe in another coroutine): fail at once, everywhere */
        lua_sethook(L, budget_hook, LUA_MASKCOUNT, 1);
        lua_pushstring(L, S->fatal_msg);
        lua_error(L);
    }
    if (S->soft && S->mem > S->soft) { /* garbage first: only live data counts */
        lua_gc(L, LUA_GCCOLLECT);
        if (S->mem > S->soft) memory_error(L, 0);
    }
    if (S->budget <= 0) return;
    int period = lua_gethookcount(L);
    S->used += period;
    if (period != S->every) /* a coroutine left at period 1 by an earlier call's limit */
        lua_sethook(L, budget_hook, LUA_MASKCOUNT, S->every);
    if (S->used > S->budget) {
        char m[200];
        snprintf(m, sizeof m, "instruction limit of %lld reached (hooks.instruction_limit): the function runs too long or "
                              "loops forever", (long long)S->budget);
        fatal_error(L, 0, m);
    }
}

static void arm_hook(loom_lua *S)
{
    S->used = 0;
    S->fatal = 0;
    S->fatal_msg[0] = 0;
    S->every = S->budget > 0 && S->budget < HOOK_EVERY ? (int)S->budget : HOOK_EVERY;
    lua_sethook(S->L, budget_hook, LUA_MASKCOUNT, S->every);
}

/* ---- the sandbox ------------------------------------------------------------------ */

static int refused(lua_State *L)
{
    return luaL_error(L, "%s is not available in the sandbox (set hooks.unsafe = true to allow it)",
                      lua_tostring(L, lua_upvalueindex(1)));
}

static void refuse(lua_State *L, const char *lib, const char *name)
{
    lua_getglobal(L, lib);
    lua_pushfstring(L, "%s.%s", lib, name);
    lua_pushcclosure(L, refused, 1);
    lua_setfield(L, -2, name);
    lua_pop(L, 1);
}

static int no_math_random(lua_State *L)
{
    return luaL_error(L, "math.random is not reproducible across data threads: use the rng argument "
                         "(rng:uniform(), rng:int(lo, hi), rng:normal())");
}

/* Absolute, symlink-free form of path, which need not exist (its directory must). */
static int real_target(const char *path, char out[PATH_MAX])
{
    if (realpath(path, out)) return 0;
    struct stat st;
    if (lstat(path, &st) == 0) return -1; /* a dangling symlink: its target is unknown, never its parent */
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    const char *base = slash ? slash + 1 : path;
    if (slash == dir) snprintf(dir, sizeof dir, "/");
    else if (slash) *slash = 0;
    else snprintf(dir, sizeof dir, ".");
    char rd[PATH_MAX];
    if (!realpath(dir, rd) || !*base || !strcmp(base, "..") || !strcmp(base, ".")) return -1;
    if ((size_t)snprintf(out, PATH_MAX, "%s/%s", strcmp(rd, "/") ? rd : "", base) >= PATH_MAX) return -1;
    return 0;
}

int loom_lua_write_allowed_(loom_lua *S, const char *path)
{
    if (S->opts.unsafe) return 1;
    if (!S->model_dir[0]) return 0;
    char md[PATH_MAX], tg[PATH_MAX];
    if (!realpath(S->model_dir, md) || real_target(path, tg)) return 0;
    size_t n = strlen(md);
    return !strncmp(tg, md, n) && tg[n] == '/';
}

static int check_regular(lua_State *L, const char *fn, const char *path);

static int stream_close(lua_State *L)
{
    luaL_Stream *p = luaL_checkudata(L, 1, LUA_FILEHANDLE);
    int ok = fclose(p->f) == 0;
    return luaL_fileresult(L, ok, NULL);
}

/* Opens path for writing inside the model directory md without following a
 * symbolic link in its last component (openat on the resolved parent with
 * O_NOFOLLOW), so a link planted there, dangling or not, cannot carry the
 * write outside; a link whose target resolves inside md is followed once.
 * Pushes a Lua file handle, or raises an error naming the path. */
static int open_inside(lua_State *L, const char *path, const char *mode, const char *md)
{
    char dir[PATH_MAX], rd[PATH_MAX], tg[2][PATH_MAX];
    const char *asked = path;
    struct stat st;
    /* follow the links of the last component by hand (their targets may not
     * exist yet); each target's directory is checked below like any path */
    for (int hop = 0; lstat(path, &st) == 0 && S_ISLNK(st.st_mode); hop++) {
        char link[PATH_MAX];
        ssize_t k = hop < 8 ? readlink(path, link, sizeof link - 1) : -1;
        if (k < 0)
            return luaL_error(L, "io.open(\"%s\", \"%s\"): a symbolic link that cannot be followed is refused", asked,
                              mode);
        link[k] = 0;
        const char *slash = strrchr(path, '/');
        char *next = tg[hop & 1];
        int w = link[0] == '/' || !slash ? snprintf(next, PATH_MAX, "%s", link)
                                         : snprintf(next, PATH_MAX, "%.*s/%.*s", (int)(slash - path), path,
                                                    (int)(PATH_MAX - 2 - (slash - path)), link);
        if (w < 0 || w >= PATH_MAX)
            return luaL_error(L, "io.open(\"%s\", \"%s\"): a symbolic link with a too long target is refused", asked,
                              mode);
        path = next;
    }
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    const char *base = slash ? path + (slash - dir) + 1 : path;
    if (slash == dir) snprintf(dir, sizeof dir, "/");
    else if (slash) *slash = 0;
    else snprintf(dir, sizeof dir, ".");
    size_t n = strlen(md);
    if (!*base || !strcmp(base, ".") || !strcmp(base, "..") || !realpath(dir, rd) ||
        (strcmp(rd, md) && (strncmp(rd, md, n) || rd[n] != '/'))) {
        if (path != asked)
            return luaL_error(L, "io.open(\"%s\", \"%s\"): a symbolic link whose target (%s) is outside the model "
                                 "directory (%s) is refused", asked, mode, path, md);
        return luaL_error(L, "io.open(\"%s\", \"%s\"): writing outside the model directory (%s) is refused "
                             "(set hooks.unsafe = true to allow it)", path, mode, md);
    }
    int plus = strchr(mode, '+') != NULL;
    int flags = (plus ? O_RDWR : O_WRONLY) | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY;
    if (mode[0] == 'w') flags |= O_CREAT | O_TRUNC;
    else if (mode[0] == 'a') flags |= O_CREAT | O_APPEND;
    else if (mode[0] == 'r') flags = (flags & ~O_WRONLY) | O_RDWR;
    int dfd = open(rd, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    int fd = dfd < 0 ? -1 : openat(dfd, base, flags, 0644);
    int e = errno;
    if (dfd >= 0) close(dfd);
    if (fd >= 0 && (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode))) {
        close(fd);
        return luaL_error(L, "io.open(\"%s\", \"%s\"): not a regular file: refused", path, mode);
    }
    if (fd < 0) {
        if (e == ELOOP)
            return luaL_error(L, "io.open(\"%s\", \"%s\"): it became a symbolic link while opening: refused", path, mode);
        lua_pushnil(L);
        lua_pushfstring(L, "%s: %s", path, strerror(e));
        lua_pushinteger(L, e);
        return 3;
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    luaL_Stream *p = lua_newuserdatauv(L, sizeof(luaL_Stream), 0);
    p->closef = NULL;
    luaL_setmetatable(L, LUA_FILEHANDLE);
    char fm[4] = {mode[0], plus ? '+' : 0, 0, 0};
    if (!(p->f = fdopen(fd, fm))) {
        close(fd);
        return luaL_error(L, "io.open(\"%s\", \"%s\"): fdopen failed", path, mode);
    }
    p->closef = stream_close;
    return 1;
}

/* io.open that refuses writes outside the model directory. */
static int safe_open(lua_State *L)
{
    const char *path = luaL_checkstring(L, 1);
    const char *mode = luaL_optstring(L, 2, "r");
    loom_lua *S = loom_lua_from_state(L);
    if (strpbrk(mode, "wa+") && !S->opts.unsafe) {
        char md[PATH_MAX];
        if (!S->model_dir[0] || !realpath(S->model_dir, md))
            return luaL_error(L, "io.open(\"%s\", \"%s\"): writing outside the model directory (%s) is refused "
                                 "(set hooks.unsafe = true to allow it)", path, mode, S->model_dir[0] ? S->model_dir : "none");
        return open_inside(L, path, mode, md);
    }
    check_regular(L, "io.open", path);
    lua_pushvalue(L, lua_upvalueindex(1));
    lua_insert(L, 1);
    lua_call(L, lua_gettop(L) - 1, LUA_MULTRET);
    return lua_gettop(L);
}

/* load() for text chunks only: a binary chunk can crash the VM. */
static int safe_load(lua_State *L)
{
    int n = lua_gettop(L);
    if (n < 3) lua_settop(L, 3);
    lua_pushliteral(L, "t");
    lua_replace(L, 3);
    lua_pushvalue(L, lua_upvalueindex(1));
    lua_insert(L, 1);
    lua_call(L, lua_gettop(L) - 1, LUA_MULTRET);
    return lua_gettop(L);
}

/* ---- limits nothing may catch --------------------------------------------------------- */

/* After a failed protected call: a limit (or a memory error, which Lua
 * reports with its own status) goes on up; any other error is returned as
 * pcall returns it. */
static void reraise_limit(lua_State *L, int status)
{
    loom_lua *S = loom_lua_from_state(L);
    if (status == LUA_ERRMEM && !S->fatal) memory_error(L, 1);
    if (S->fatal) {
        lua_pushstring(L, S->fatal_msg);
        lua_error(L);
    }
}

static int pcall_done(lua_State *L, int status, lua_KContext extra)
{
    if (status != LUA_OK && status != LUA_YIELD) {
        reraise_limit(L, status);
        lua_pushboolean(L, 0);
        lua_pushvalue(L, -2);
        return 2;
    }
    return lua_gettop(L) - (int)extra;
}

/* pcall(f, ...) as the base library's, but a limit error is not caught. */
static int limited_pcall(lua_State *L)
{
    luaL_checkany(L, 1);
    lua_pushboolean(L, 1);
    lua_insert(L, 1); /* true f args... */
    int status = lua_pcallk(L, lua_gettop(L) - 2, LUA_MULTRET, 0, 0, pcall_done);
    return pcall_done(L, status, 0);
}

/* xpcall(f, handler, ...) likewise. */
static int limited_xpcall(lua_State *L)
{
    int n = lua_gettop(L);
    luaL_checktype(L, 2, LUA_TFUNCTION);
    lua_pushboolean(L, 1);
    lua_pushvalue(L, 1);
    lua_rotate(L, 3, 2); /* f handler true f args... */
    int status = lua_pcallk(L, n - 2, LUA_MULTRET, 2, 2, pcall_done);
    return pcall_done(L, status, 2);
}

/* coroutine.resume / coroutine.close: the original (upvalue 1), then a
 * coroutine that died of a limit re-raises it in the resumer. */
static int limited_co(lua_State *L)
{
    lua_State *co = lua_tothread(L, 1);
    lua_pushvalue(L, lua_upvalueindex(1));
    lua_insert(L, 1);
    lua_call(L, lua_gettop(L) - 1, LUA_MULTRET);
    if (lua_gettop(L) >= 1 && lua_isboolean(L, 1) && !lua_toboolean(L, 1)) reraise_limit(L, co ? lua_status(co) : LUA_OK);
    return lua_gettop(L);
}

/* Charges n units of work done by a C function to the instruction budget
 * (the count hook never sees a loop inside C). */
static void charge(lua_State *L, lua_Integer n)
{
    loom_lua *S = loom_lua_from_state(L);
    if (S->budget <= 0 || !S->in_call) return;
    if (n > S->budget - S->used) {
        S->used = S->budget + 1;
        char m[200];
        snprintf(m, sizeof m, "instruction limit of %lld reached (hooks.instruction_limit): the function runs too long or "
                              "loops forever", (long long)S->budget);
        fatal_error(L, 1, m);
    }
    S->used += n;
}

/* Calls the original function (upvalue 1) with the arguments as they are. */
static int call_original(lua_State *L)
{
    lua_pushvalue(L, lua_upvalueindex(1));
    lua_insert(L, 1);
    lua_call(L, lua_gettop(L) - 1, LUA_MULTRET);
    return lua_gettop(L);
}

/* string.rep(s, n[, sep]): n copies cost n (string.rep("", 1e18) loops 1e18 times in C). */
static int limited_rep(lua_State *L)
{
    size_t l, ls = 0;
    luaL_checklstring(L, 1, &l);
    lua_Integer n = luaL_checkinteger(L, 2);
    luaL_optlstring(L, 3, "", &ls);
    if (n > 0) charge(L, n);
    return call_original(L);
}

/* table.move(a1, f, e, t[, a2]): e - f + 1 moves. */
static int limited_move(lua_State *L)
{
    lua_Integer f = luaL_checkinteger(L, 2), e = luaL_checkinteger(L, 3);
    if (e >= f) charge(L, f > 0 || e < LUA_MAXINTEGER + f ? e - f + 1 : LUA_MAXINTEGER);
    return call_original(L);
}

/* table.insert/remove/sort/concat: a C loop over argument 1, a table, costs
 * its length (sort: n log n). string.find/match/gmatch/gsub are pattern.c's,
 * which charge each matching step. */
static int limited_len1(lua_State *L)
{
    int t = lua_type(L, 1);
    if (t == LUA_TSTRING || t == LUA_TTABLE) {
        lua_Integer n = (lua_Integer)lua_rawlen(L, 1), k = 1;
        if (lua_toboolean(L, lua_upvalueindex(2)))
            for (lua_Integer m = n; m > 1; m >>= 1) k++;
        charge(L, n * k);
    }
    return call_original(L);
}

static void wrap_field(lua_State *L, const char *lib, const char *name, lua_CFunction f)
{
    lua_getglobal(L, lib);
    lua_getfield(L, -1, name);
    lua_pushcclosure(L, f, 1);
    lua_setfield(L, -2, name);
    lua_pop(L, 1);
}

static int safe_setmetatable(lua_State *L);
static int no_sethook(lua_State *L);

/* Installed in every state, unsafe ones included: the limits bound every hook. */
static void install_limits(lua_State *L)
{
    /* hooks.unsafe opens files and the OS to hooks, not unbounded loops: no
     * finalizers (they run with the instruction hook off), and (debug is
     * there only when unsafe) no replacing the hook that counts */
    wrap_field(L, LUA_GNAME, "setmetatable", safe_setmetatable);
    if (lua_getglobal(L, "debug") == LUA_TTABLE) {
        lua_pop(L, 1);
        wrap_field(L, "debug", "setmetatable", safe_setmetatable);
        wrap_field(L, "debug", "sethook", no_sethook);
    } else {
        lua_pop(L, 1);
    }
    lua_pushcfunction(L, limited_pcall);
    lua_setglobal(L, "pcall");
    lua_pushcfunction(L, limited_xpcall);
    lua_setglobal(L, "xpcall");
    wrap_field(L, "coroutine", "resume", limited_co);
    wrap_field(L, "coroutine", "close", limited_co);
    wrap_field(L, "string", "rep", limited_rep);
    wrap_field(L, "table", "move", limited_move);
    loom_lua_open_patterns_(L, charge);
    static const char *const len1[][2] = {{"table", "insert"}, {"table", "remove"}, {"table", "concat"},
                                          {"table", "sort"}};
    for (size_t i = 0; i < sizeof len1 / sizeof len1[0]; i++) {
        lua_getglobal(L, len1[i][0]);
        lua_getfield(L, -1, len1[i][1]);
        lua_pushboolean(L, !strcmp(len1[i][1], "sort"));
        lua_pushcclosure(L, limited_len1, 2);
        lua_setfield(L, -2, len1[i][1]);
        lua_pop(L, 1);
    }
}

/* ---- files, stdin, finalizers, require ------------------------------------------------------ */

/* Opening a FIFO, a terminal or a device (/dev/stdin, /proc/self/fd/0) can
 * block forever; hooks read and write regular files only. */
static int check_regular(lua_State *L, const char *fn, const char *path)
{
    struct stat st;
    if (stat(path, &st) == 0 && !S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode))
        return luaL_error(L, "%s(\"%s\"): not a regular file (hooks read and write regular files only; stdin, "
                             "FIFOs and devices are refused)", fn, path);
    return 0;
}

static int no_stdin(lua_State *L)
{
    return luaL_error(L, "%s: hooks have no standard input (open a file with io.open(path) or io.lines(path))",
                      lua_tostring(L, lua_upvalueindex(1)));
}

/* io.lines(path, ...) of a regular file; io.lines() (stdin) is refused. */
static int safe_lines(lua_State *L)
{
    if (lua_isnoneornil(L, 1))
        return luaL_error(L, "io.lines(): hooks have no standard input (give a file: io.lines(path))");
    check_regular(L, "io.lines", luaL_checkstring(L, 1));
    lua_pushvalue(L, lua_upvalueindex(1));
    lua_insert(L, 1);
    lua_call(L, lua_gettop(L) - 1, LUA_MULTRET);
    return lua_gettop(L);
}

/* setmetatable (and, in an unsafe state, debug.setmetatable) that refuses a
 * __gc field: Lua runs finalizers with hooks off (in lua_close too), so one
 * that loops would never be stopped, not even by SIGTERM. Every state,
 * hooks.unsafe too: unsafe is about files and the OS, not about hangs. */
static int safe_setmetatable(lua_State *L)
{
    if (lua_istable(L, 2)) {
        lua_pushliteral(L, "__gc");
        int has_gc = lua_rawget(L, 2) != LUA_TNIL;
        lua_pop(L, 1);
        if (has_gc)
            return luaL_error(L, "setmetatable: __gc finalizers are not available in the sandbox, nor with "
                                 "hooks.unsafe = true (they run outside the instruction limit, so one that loops "
                                 "would hang loom; release resources explicitly, or use a to-be-closed variable)");
    }
    return call_original(L);
}

/* debug.sethook (unsafe states only have debug): the count hook is the
 * instruction limit's; replacing or clearing it would unbound the hook. */
static int no_sethook(lua_State *L)
{
    return luaL_error(L, "debug.sethook is not available, even with hooks.unsafe = true (the instruction limit "
                         "uses the hook; raise hooks.instruction_limit instead)");
}

/* require's one file searcher: "?.lua", "lua/?.lua", "?/init.lua" under the
 * config's directory, fixed when the state opens (package.path is only
 * informative: changing it changes nothing), text chunks only, and never a
 * file in the model directory, which hooks may write. */
static int script_searcher(lua_State *L)
{
    loom_lua *S = loom_lua_from_state(L);
    const char *name = luaL_checkstring(L, 1);
    for (const char *p = name; *p; p++)
        if (!(*p == '_' || *p == '.' || *p == '-' || (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') ||
              (*p >= '0' && *p <= '9')))
            return luaL_error(L, "require(\"%s\"): a module name has letters, digits, '_', '-' and '.' only", name);
    if (!name[0] || name[0] == '.') return luaL_error(L, "require(\"%s\"): bad module name", name);
    char mod[LOOM_PATH_MAX];
    snprintf(mod, sizeof mod, "%s", name);
    for (char *p = mod; *p; p++)
        if (*p == '.') *p = '/';
    const char *b = S->base_dir[0] ? S->base_dir : ".";
    static const char *const tmpl[] = {"%s/%s.lua", "%s/lua/%s.lua", "%s/%s/init.lua"};
    luaL_Buffer tried;
    luaL_buffinit(L, &tried);
    for (int i = 0; i < 3; i++) {
        char path[2 * LOOM_PATH_MAX + 16];
        snprintf(path, sizeof path, tmpl[i], b, mod);
        struct stat st;
        if (stat(path, &st) == 0 && !S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode)) {
            /* a FIFO or a device would block or feed endless bytes: refused by name */
            loom_err oe = {0};
            int fd = loom_open_regular(path, &oe);
            if (fd >= 0) close(fd);
            return luaL_error(L, "error loading module '%s' from file '%s': %s", name, path,
                              oe.msg[0] ? oe.msg : "not a regular file");
        }
        if (stat(path, &st) != 0 || !S_ISREG(st.st_mode)) {
            luaL_addstring(&tried, "\n\tno file '");
            luaL_addstring(&tried, path);
            luaL_addstring(&tried, "'");
            continue;
        }
        if (S->model_dir[0] && loom_lua_write_allowed_(S, path))
            return luaL_error(L, "require(\"%s\"): %s is in the model directory, which hooks may write; modules load "
                                 "only from the config's directory", name, path);
        if (luaL_loadfilex(L, path, "t") != LUA_OK)
            return luaL_error(L, "error loading module '%s' from file '%s':\n\t%s", name, path, lua_tostring(L, -1));
        lua_pushstring(L, path);
        return 2;
    }
    luaL_pushresult(&tried);
    return 1;
}

static void open_safe_libs(loom_lua *S)
{
    lua_State *L = S->L;
    static const luaL_Reg libs[] = {
        {LUA_GNAME, luaopen_base}, {LUA_LOADLIBNAME, luaopen_package}, {LUA_COLIBNAME, luaopen_coroutine},
        {LUA_TABLIBNAME, luaopen_table}, {LUA_IOLIBNAME, luaopen_io}, {LUA_OSLIBNAME, luaopen_os},
        {LUA_STRLIBNAME, luaopen_string}, {LUA_MATHLIBNAME, luaopen_math}, {LUA_UTF8LIBNAME, luaopen_utf8},
        {NULL, NULL},
    };
    for (const luaL_Reg *l = libs; l->func; l++) {
        luaL_requiref(L, l->name, l->func, 1);
        lua_pop(L, 1);
    }
    static const char *const os_off[] = {"execute", "exit", "remove", "rename", "tmpname", "setlocale", NULL};
    static const char *const io_off[] = {"popen", "tmpfile", "output", NULL};
    static const char *const io_stdin[] = {"read", "input", NULL};
    for (int i = 0; os_off[i]; i++) refuse(L, "os", os_off[i]);
    for (int i = 0; io_off[i]; i++) refuse(L, "io", io_off[i]);
    refuse(L, "package", "loadlib");
    lua_getglobal(L, "io");
    for (int i = 0; io_stdin[i]; i++) {
        lua_pushfstring(L, "io.%s", io_stdin[i]);
        lua_pushcclosure(L, no_stdin, 1);
        lua_setfield(L, -2, io_stdin[i]);
    }
    lua_pushnil(L);
    lua_setfield(L, -2, "stdin");
    lua_pop(L, 1);
    wrap_field(L, "io", "lines", safe_lines);
    lua_getglobal(L, "io");
    lua_getfield(L, -1, "open");
    lua_pushcclosure(L, safe_open, 1);
    lua_setfield(L, -2, "open");
    lua_pop(L, 1);
    lua_getglobal(L, "load");
    lua_pushcclosure(L, safe_load, 1);
    lua_setglobal(L, "load");
    /* loadfile/dofile could read binary chunks; require covers loading Lua files */
    lua_pushliteral(L, "loadfile");
    lua_pushcclosure(L, refused, 1);
    lua_setglobal(L, "loadfile");
    lua_pushliteral(L, "dofile");
    lua_pushcclosure(L, refused, 1);
    lua_setglobal(L, "dofile");
    lua_getglobal(L, "math");
    lua_pushcfunction(L, no_math_random);
    lua_setfield(L, -2, "random");
    lua_pushcfunction(L, no_math_random);
    lua_setfield(L, -2, "randomseed");
    lua_pop(L, 1);
    /* require: Lua files only, from the config's directory; no C searchers */
    lua_getglobal(L, "package");
    lua_pushliteral(L, "");
    lua_setfield(L, -2, "cpath");
    lua_getfield(L, -1, "searchers");
    for (int i = (int)luaL_len(L, -1); i > 2; i--) {
        lua_pushnil(L);
        lua_rawseti(L, -2, i);
    }
    lua_pushcfunction(L, script_searcher);
    lua_rawseti(L, -2, 2);
    lua_pop(L, 2);
}

static void set_package_path(loom_lua *S)
{
    lua_State *L = S->L;
    const char *b = S->base_dir[0] ? S->base_dir : ".";
    lua_getglobal(L, "package");
    lua_pushfstring(L, "%s/?.lua;%s/lua/?.lua;%s/?/init.lua", b, b, b);
    lua_setfield(L, -2, "path");
    lua_pop(L, 1);
}

/* ---- open / close ---------------------------------------------------------------- */

int loom_lua_open(loom_lua **out, const loom_lua_opts *opts, loom_err *err)
{
    static const loom_lua_opts defaults;
    if (!opts) opts = &defaults;
    *out = NULL;
    loom_lua *S = loom_calloc(1, sizeof *S);
    if (!S) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a Lua state");
    S->opts = *opts;
    snprintf(S->model_dir, sizeof S->model_dir, "%s", opts->model_dir ? opts->model_dir : "");
    snprintf(S->base_dir, sizeof S->base_dir, "%s", opts->base_dir ? opts->base_dir : "");
    S->opts.model_dir = S->model_dir;
    S->opts.base_dir = S->base_dir;
    int64_t cap = opts->memory_limit ? opts->memory_limit : LOOM_LUA_DEFAULT_MEMORY;
    S->soft = cap > 0 ? (size_t)cap : 0;
    S->cap = S->soft > SIZE_MAX / 2 ? SIZE_MAX : 2 * S->soft;
    S->budget = opts->instruction_limit ? opts->instruction_limit : LOOM_LUA_DEFAULT_INSTRUCTIONS;
    S->gen = 1;
    S->L = lua_newstate(capped_alloc, S);
    if (!S->L) {
        loom_free(S);
        return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot create a Lua state (memory limit too small?)");
    }
    *(loom_lua **)lua_getextraspace(S->L) = S;
    lua_State *L = S->L;
    lua_pushcfunction(L, loom_lua_setup_);
    if (lua_pcall(L, 0, 0, 0) != LUA_OK) {
        loom_err_set(err, LOOM_ELUA, NULL, "cannot set up a Lua state: %s", lua_tostring(L, -1));
        loom_lua_close(S);
        return LOOM_ELUA;
    }
    *out = S;
    return LOOM_OK;
}

/* Runs protected: the libraries, the sandbox, the loom module, the file table. */
int loom_lua_setup_(lua_State *L)
{
    loom_lua *S = loom_lua_from_state(L);
    if (S->opts.unsafe) luaL_openlibs(L);
    else open_safe_libs(S);
    install_limits(L);
    set_package_path(S);
    loom_lua_open_module_(L);
    lua_newtable(L);
    lua_setfield(L, LUA_REGISTRYINDEX, FILES_KEY);
    return 0;
}

void loom_lua_close(loom_lua *S)
{
    if (!S) return;
    /* to-be-closed variables still open run in lua_close: under the budget too
       (finalizers run with hooks off, which is why the sandbox refuses __gc) */
    if (S->L) {
        arm_hook(S);
        lua_close(S->L);
    }
    loom_free(S);
}

lua_State *loom_lua_state(loom_lua *S) { return S->L; }
loom_lua *loom_lua_from_state(lua_State *s) { return s ? *(loom_lua **)lua_getextraspace(s) : NULL; }
size_t loom_lua_memory(const loom_lua *S) { return S->mem; }
size_t loom_lua_memory_peak(const loom_lua *S) { return S->peak; }
void loom_lua_drop_views(loom_lua *S) { S->gen++; }

/* ---- calls and their errors -------------------------------------------------------- */

static int traceback(lua_State *L)
{
    const char *msg = lua_tostring(L, 1);
    if (!msg) {
        if (luaL_callmeta(L, 1, "__tostring") && lua_type(L, -1) == LUA_TSTRING) return 1;
        msg = lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
    }
    luaL_traceback(L, L, msg, 1);
    return 1;
}

/* Splits "file:line: message..." into where and the rest; returns the rest. */
static const char *split_where(const char *s, char *where, size_t n)
{
    where[0] = 0;
    for (const char *p = s; *p && *p != '\n'; p++) {
        if (*p != ':' || p[1] < '0' || p[1] > '9') continue;
        const char *q = p + 1;
        while (*q >= '0' && *q <= '9') q++;
        if (q[0] != ':' || q[1] != ' ') continue;
        snprintf(where, n, "%.*s", (int)(q - s), s);
        return q + 2;
    }
    return s;
}

/* The traceback, tabs as two spaces, without the frames of loom's own C glue. */
static void append_traceback(char *dst, size_t n, const char *tb)
{
    size_t k = strlen(dst);
    for (const char *p = tb; *p && k + 1 < n; p++) {
        if (*p == '\t') {
            if (k + 2 < n) dst[k++] = ' ', dst[k++] = ' ';
            continue;
        }
        dst[k++] = *p;
    }
    dst[k] = 0;
    while (k > 0 && dst[k - 1] == '\n') dst[--k] = 0;
}

static void call_error(loom_lua *S, int rc, const char *fallback_where, loom_err *err)
{
    lua_State *L = S->L;
    const char *s = lua_tostring(L, -1);
    if (rc == LUA_ERRMEM || !s) {
        char b[32];
        loom_err_set(err, LOOM_ELUA, fallback_where, "memory limit of %s reached (hooks.memory_limit)",
                     bytes_str(S->soft, b, sizeof b));
        loom_err_hint(err, "allocate less per call, or raise hooks.memory_limit (bytes)");
        return;
    }
    char where[sizeof err->where];
    const char *rest = split_where(s, where, sizeof where);
    const char *tb = strstr(rest, "\nstack traceback:");
    loom_err_set(err, LOOM_ELUA, where[0] ? where : fallback_where, "%.*s", tb ? (int)(tb - rest) : (int)strlen(rest), rest);
    if (tb) append_traceback(err->msg, sizeof err->msg, tb);
    if (strstr(rest, "hooks.instruction_limit"))
        loom_err_hint(err, "make the function finish sooner, or raise hooks.instruction_limit");
    else if (strstr(rest, "hooks.memory_limit"))
        loom_err_hint(err, "allocate less per call, or raise hooks.memory_limit (bytes)");
}

int loom_lua_call(loom_lua *S, int nargs, int nresults, loom_err *err)
{
    lua_State *L = S->L;
    int fidx = lua_gettop(L) - nargs;
    char fallback[LOOM_PATH_MAX + 16] = "";
    lua_Debug ar;
    lua_pushvalue(L, fidx);
    if (lua_getinfo(L, ">S", &ar) && ar.source[0] == '@')
        snprintf(fallback, sizeof fallback, "%s:%d", ar.short_src, ar.linedefined);
    lua_pushcfunction(L, traceback);
    lua_insert(L, fidx);
    S->hit_cap = 0;
    arm_hook(S);
    S->in_call++;
    int rc = lua_pcall(L, nargs, nresults, fidx);
    S->in_call--;
    lua_sethook(L, NULL, 0, 0);
    S->gen++;
    lua_remove(L, fidx);
    if (rc == LUA_OK) return LOOM_OK;
    call_error(S, rc, fallback, err);
    lua_pop(L, 1);
    if (S->mem > S->soft) lua_gc(L, LUA_GCCOLLECT);
    return LOOM_ELUA;
}

/* ---- files and references ----------------------------------------------------------- */

int loom_lua_parse_ref(const char *ref, const char *base_dir, loom_lua_ref *out, loom_err *err)
{
    memset(out, 0, sizeof *out);
    const char *colon = ref ? strrchr(ref, ':') : NULL;
    if (!colon || colon == ref || !colon[1] || strlen(colon + 1) >= sizeof out->func) {
        loom_err_set(err, LOOM_ECONFIG, NULL, "bad Lua function reference \"%s\"", ref ? ref : "");
        return loom_err_hint(err, "write \"FILE.lua:FUNCTION\", e.g. \"lua/augment.lua:cutout\" (relative to the config's directory)");
    }
    for (const char *p = colon + 1; *p; p++)
        if (!(*p == '_' || *p == '.' || (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9'))) {
            loom_err_set(err, LOOM_ECONFIG, NULL, "bad Lua function name \"%s\" in \"%s\"", colon + 1, ref);
            return loom_err_hint(err, "a function name is a Lua identifier, or a dotted path such as M.cutout");
        }
    int flen = (int)(colon - ref);
    int n = ref[0] == '/' || !base_dir || !base_dir[0] || !strcmp(base_dir, ".")
                ? snprintf(out->file, sizeof out->file, "%.*s", flen, ref)
                : snprintf(out->file, sizeof out->file, "%s/%.*s", base_dir, flen, ref);
    if (n >= (int)sizeof out->file) return loom_err_set(err, LOOM_ECONFIG, NULL, "Lua file path too long in \"%s\"", ref);
    snprintf(out->func, sizeof out->func, "%s", colon + 1);
    return LOOM_OK;
}

/* Pushes the entry of path in the file table, or nil. */
static int push_file_entry(lua_State *L, const char *path)
{
    lua_getfield(L, LUA_REGISTRYINDEX, FILES_KEY);
    int t = lua_getfield(L, -1, path);
    lua_remove(L, -2);
    return t;
}

int loom_lua_load(loom_lua *S, const char *path, loom_err *err)
{
    lua_State *L = S->L;
    int t = push_file_entry(L, path);
    lua_pop(L, 1);
    if (t != LUA_TNIL) return LOOM_OK;
    if (!lua_checkstack(L, 8)) return loom_err_set(err, LOOM_ENOMEM, path, "Lua stack overflow");
    loom_err oe = {0};
    int fd = loom_open_regular(path, &oe);
    if (fd < 0) {
        loom_err_set(err, LOOM_EIO, path, "cannot open Lua file: %s",
                     strncmp(oe.msg, "cannot open: ", 13) ? oe.msg : oe.msg + 13);
        return loom_err_hint(err, "Lua paths are relative to the config's directory");
    }
    close(fd);
    int rc = luaL_loadfilex(L, path, "t");
    if (rc != LUA_OK) {
        const char *m = lua_tostring(L, -1);
        char where[sizeof err->where];
        const char *rest = split_where(m ? m : "", where, sizeof where);
        loom_err_set(err, rc == LUA_ERRSYNTAX ? LOOM_ELUA : LOOM_EIO, where[0] ? where : path, "%s%s",
                     rc == LUA_ERRSYNTAX ? "syntax error: " : "", rest);
        lua_pop(L, 1);
        return err ? err->code : LOOM_ELUA;
    }
    /* own environment, reading through to the globals */
    lua_newtable(L);
    lua_newtable(L);
    lua_pushglobaltable(L);
    lua_setfield(L, -2, "__index");
    lua_setmetatable(L, -2);
    lua_pushvalue(L, -1);
    lua_setupvalue(L, -3, 1); /* chunk's _ENV; stack: chunk env */
    lua_insert(L, -2);        /* env chunk */
    rc = loom_lua_call(S, 0, 1, err);
    if (rc) {
        lua_pop(L, 1);
        return rc;
    }
    lua_newtable(L); /* env ret entry */
    lua_insert(L, -3);
    lua_setfield(L, -3, "ret");
    lua_setfield(L, -2, "env");
    lua_getfield(L, LUA_REGISTRYINDEX, FILES_KEY);
    lua_insert(L, -2);
    lua_setfield(L, -2, path);
    lua_pop(L, 1);
    return LOOM_OK;
}

/* Looks up a dotted path in the table at the top, replacing it with the value. */
static void get_path(lua_State *L, const char *name)
{
    char part[LOOM_NAME_MAX];
    while (*name) {
        const char *dot = strchr(name, '.');
        size_t n = dot ? (size_t)(dot - name) : strlen(name);
        snprintf(part, sizeof part, "%.*s", (int)n, name);
        if (lua_istable(L, -1)) lua_getfield(L, -1, part);
        else lua_pushnil(L);
        lua_remove(L, -2);
        name += n + (dot != NULL);
    }
}

/* "a, b, c": the functions a file defines (its globals and returned table). */
static void list_functions(lua_State *L, int entry, char *buf, size_t n)
{
    size_t k = 0;
    buf[0] = 0;
    static const char *const fields[] = {"ret", "env"};
    for (int i = 0; i < 2; i++) {
        lua_getfield(L, entry, fields[i]);
        if (lua_istable(L, -1)) {
            lua_pushnil(L);
            while (lua_next(L, -2)) {
                if (lua_isfunction(L, -1) && lua_type(L, -2) == LUA_TSTRING && k < n)
                    k += (size_t)snprintf(buf + k, n - k, "%s%s", k ? ", " : "", lua_tostring(L, -2));
                lua_pop(L, 1);
            }
        }
        lua_pop(L, 1);
    }
}

int loom_lua_resolve(loom_lua *S, const loom_lua_ref *ref, int *fn, loom_err *err)
{
    lua_State *L = S->L;
    *fn = LUA_NOREF;
    int rc = loom_lua_load(S, ref->file, err);
    if (rc) return rc;
    push_file_entry(L, ref->file);
    int entry = lua_gettop(L);
    lua_getfield(L, entry, "ret");
    get_path(L, ref->func);
    if (!lua_isfunction(L, -1)) {
        lua_pop(L, 1);
        lua_getfield(L, entry, "env");
        get_path(L, ref->func);
    }
    if (!lua_isfunction(L, -1)) {
        char have[300];
        list_functions(L, entry, have, sizeof have);
        loom_err_set(err, LOOM_ELUA, ref->file, "no function \"%s\" in %s (it defines: %s)", ref->func, ref->file,
                     have[0] ? have : "no functions");
        loom_err_hint(err, "define `function %s(...)` in %s, or fix the name after ':' in the config", ref->func, ref->file);
        lua_settop(L, entry - 1);
        return LOOM_ELUA;
    }
    *fn = luaL_ref(L, LUA_REGISTRYINDEX);
    lua_settop(L, entry - 1);
    return LOOM_OK;
}

void loom_lua_unref(loom_lua *S, int fn) { luaL_unref(S->L, LUA_REGISTRYINDEX, fn); }
void loom_lua_push_fn(loom_lua *S, int fn) { lua_rawgeti(S->L, LUA_REGISTRYINDEX, fn); }
