/* lua_pattern_bench.c - appliance/script/pattern.c (string.find/match/gmatch/
 * gsub with every step charged to the instruction budget) against the stock
 * Lua 5.4 string library on a typical text-preprocessing map: trim, strip
 * punctuation, squeeze spaces, tokenize, pick fields, plain find.
 *
 *   lua_pattern_bench [stock|ours|both] [LINES] [RUNS]
 *
 * both (default): RUNS alternating runs of each over LINES generated lines,
 * medians in ns per line and ours/stock. stock or ours: one run of one (for
 * callgrind: valgrind --tool=callgrind --toggle-collect=lua_pattern_pass
 * lua_pattern_bench ours 2000, the map's instructions alone). */
#include "script/script_internal.h"

#include <lauxlib.h>
#include <lualib.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static const char MAP[] =
    "local words = {'alpha', 'Beta', 'gamma42', 'delta', 'the', 'of', 'http://x.org/a', 'x-y', '3-14', 'q.e.d.'}\n"
    "lines = {}\n"
    "local seed = 1\n"
    "for i = 1, N do\n"
    "  local t = {}\n"
    "  for j = 1, 12 do seed = (seed * 1103515245 + 12345) % 2147483648; t[j] = words[seed % #words + 1] end\n"
    "  lines[i] = '  ' .. table.concat(t, (seed % 3 == 0) and ',  ' or ' ') .. '.  '\n"
    "end\n"
    "function map(line)\n"
    "  local s = line:match('^%s*(.-)%s*$')\n"
    "  local url = s:find('http://', 1, true)\n"
    "  s = s:lower():gsub('%p', ' '):gsub('%s+', ' ')\n"
    "  local n = 0\n"
    "  for w in s:gmatch('%a+') do n = n + #w end\n"
    "  local a, b = line:match('(%d+)-(%d+)')\n"
    "  return n + (url or 0) + (a and 1 or 0)\n"
    "end\n"
    "function run() local k = 0 for i = 1, #lines do k = k + map(lines[i]) end return k end\n";

static void no_charge(lua_State *L, lua_Integer n) { (void)L; (void)n; }

static lua_State *state(int ours, int lines)
{
    lua_State *L = luaL_newstate();
    luaL_openlibs(L);
    if (ours) loom_lua_open_patterns_(L, no_charge);
    lua_pushinteger(L, lines);
    lua_setglobal(L, "N");
    if (luaL_dostring(L, MAP) != LUA_OK) {
        fprintf(stderr, "lua_pattern_bench: %s\n", lua_tostring(L, -1));
        exit(1);
    }
    return L;
}

/* ns per line of one pass; the checksum in *sum */
__attribute__((noinline)) double lua_pattern_pass(lua_State *L, int lines, lua_Integer *sum)
{
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    lua_getglobal(L, "run");
    if (lua_pcall(L, 0, 1, 0) != LUA_OK) {
        fprintf(stderr, "lua_pattern_bench: %s\n", lua_tostring(L, -1));
        exit(1);
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    *sum = lua_tointeger(L, -1);
    lua_pop(L, 1);
    return ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / lines;
}

static int cmp(const void *x, const void *y)
{
    double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

int main(int argc, char **argv)
{
    const char *which = argc > 1 ? argv[1] : "both";
    int lines = argc > 2 ? atoi(argv[2]) : 20000, runs = argc > 3 ? atoi(argv[3]) : 5;
    if (lines < 1 || runs < 1 || runs > 100) return 2;
    lua_Integer s1 = 0, s2 = 0;
    if (strcmp(which, "both")) {
        lua_State *L = state(!strcmp(which, "ours"), lines);
        printf("%s: %.0f ns/line\n", which, lua_pattern_pass(L, lines, &s1));
        lua_close(L);
        return 0;
    }
    lua_State *A = state(0, lines), *B = state(1, lines);
    double ta[100], tb[100];
    for (int r = 0; r < runs; r++) {
        ta[r] = lua_pattern_pass(A, lines, &s1);
        tb[r] = lua_pattern_pass(B, lines, &s2);
        if (s1 != s2) {
            fprintf(stderr, "lua_pattern_bench: results differ (%lld, %lld)\n", (long long)s1, (long long)s2);
            return 1;
        }
    }
    qsort(ta, (size_t)runs, sizeof *ta, cmp);
    qsort(tb, (size_t)runs, sizeof *tb, cmp);
    printf("stock %.0f ns/line, ours %.0f ns/line, ours/stock %.2f (medians of %d runs, %d lines)\n", ta[runs / 2],
           tb[runs / 2], tb[runs / 2] / ta[runs / 2], runs, lines);
    printf("json: {\"stock_ns_per_line\": %.0f, \"ours_ns_per_line\": %.0f, \"ratio\": %.3f}\n", ta[runs / 2],
           tb[runs / 2], tb[runs / 2] / ta[runs / 2]);
    lua_close(A);
    lua_close(B);
    return 0;
}
