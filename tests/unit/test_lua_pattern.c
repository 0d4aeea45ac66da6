/* test_lua_pattern.c - appliance/script/pattern.c, the step-charged
 * string.find/match/gmatch/gsub: the same results and errors as the stock
 * Lua 5.4 string library on generated patterns and subjects (captures,
 * position captures, %b, %f, back-references, anchors, classes, sets,
 * quantifiers, malformed patterns; gsub with string, table and function
 * replacements and a count; gmatch with anchors, init and empty matches;
 * method calls), and the budget: backtracking bombs end in the charge
 * function, trimming 10 KB costs steps in proportion to its length. */
#include "harness.h"
#include "script/script_internal.h"

#include <lauxlib.h>
#include <lualib.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

/* The driver, run in both states: one call, its results (or error) as text. */
static const char DRIVER[] =
    "local function ser(ok, ...)\n"
    "  local t = {tostring(ok)}\n"
    "  for i = 1, select('#', ...) do local v = select(i, ...)\n"
    "    t[#t + 1] = (math.type(v) or type(v)) .. ':' .. tostring(v) end\n"
    "  return table.concat(t, '|')\n"
    "end\n"
    "local tab = {a = 'A', b = false, ab = 1, [1] = 'one', [2] = true, ['('] = 'P'}\n"
    "local function fun(...)\n"
    "  local a = ...\n"
    "  if a == 'a' then return nil elseif a == 'b' then return false elseif a == '' then return 7 end\n"
    "  local t = {} for i = 1, select('#', ...) do t[i] = tostring((select(i, ...))) end\n"
    "  return '[' .. table.concat(t, ',') .. ']'\n"
    "end\n"
    "local function badfun() return {} end\n"
    "function run(kind, s, p, init, r, n)\n"
    "  if kind == 0 then return ser(pcall(string.find, s, p, init))\n"
    "  elseif kind == 1 then return ser(pcall(string.find, s, p, init, true))\n"
    "  elseif kind == 2 then return ser(pcall(string.match, s, p, init))\n"
    "  elseif kind == 3 then\n"
    "    local out = {}\n"
    "    local ok, err = pcall(function()\n"
    "      for a, b, c in string.gmatch(s, p, init) do\n"
    "        out[#out + 1] = ser(true, a, b, c); if #out > 40 then break end end end)\n"
    "    return tostring(ok) .. tostring(err) .. table.concat(out, ';')\n"
    "  elseif kind == 4 then return ser(pcall(string.gsub, s, p, r, n))\n"
    "  elseif kind == 5 then return ser(pcall(string.gsub, s, p, tab, n))\n"
    "  elseif kind == 6 then return ser(pcall(string.gsub, s, p, fun, n))\n"
    "  elseif kind == 7 then return ser(pcall(function() return s:find(p, init) end))\n"
    "  elseif kind == 8 then return ser(pcall(function() return s:match(p) end), s:gsub(p, '<%0>'))\n"
    "  elseif kind == 9 then return ser(pcall(string.gsub, s, p, badfun, n))\n"
    "  end\n"
    "end\n";

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static unsigned rnd(unsigned n)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (unsigned)(rng % n);
}

static void add(char *buf, size_t *len, size_t cap, const char *s, size_t n)
{
    if (*len + n < cap) {
        memcpy(buf + *len, s, n);
        *len += n;
    }
}
#define ADDS(b, l, s) add(b, l, sizeof b, s, strlen(s))

/* A pattern of up to `items` items, captures nested up to `depth`. */
static void gen_items(char *buf, size_t *len, size_t cap, int items, int depth)
{
    static const char *const singles[] = {"a", "b", "x", "1", " ", ".", "%a", "%d", "%s", "%w", "%l", "%u", "%p",
                                          "%x", "%c", "%g", "%z", "%A", "%D", "%S", "%W", "%.", "%%", "%(", "%]", "%-",
                                          "[ab]", "[^ab]", "[a-c]", "[%d%s]", "[]a]", "[^]]", "[a-]", "[%a-]", "[-x]",
                                          "[.]", "[%]]", "[^%s%d]", "[b-a]", "A", "(", ")", "-", "]", "$", "^"};
    static const char *const quants[] = {"", "", "", "*", "+", "-", "?"};
    static const char *const specials[] = {"%b()", "%bab", "%baa", "%f[%a]", "%f[^%s]", "%f[%w]", "%1", "%2",
                                           "%0", "()", "%b", "%f", "%fa", "%", "[", "[^", "[a", "%3"};
    int n = (int)rnd((unsigned)items + 1);
    for (int i = 0; i < n; i++) {
        unsigned k = rnd(20);
        if (k < 13) {
            const char *s = singles[rnd(sizeof singles / sizeof *singles)];
            if (!strcmp(s, "(") || !strcmp(s, ")") || !strcmp(s, "]") || !strcmp(s, "^")) { /* rarely: malformed */
                if (rnd(4)) s = "a";
            }
            add(buf, len, cap, s, strlen(s));
            const char *q = quants[rnd(sizeof quants / sizeof *quants)];
            add(buf, len, cap, q, strlen(q));
        } else if (k < 17 && depth > 0) {
            add(buf, len, cap, "(", 1);
            gen_items(buf, len, cap, 3, depth - 1);
            if (rnd(30)) add(buf, len, cap, ")", 1);
        } else {
            const char *s = specials[rnd(sizeof specials / sizeof *specials)];
            if (strlen(s) <= 2 && strcmp(s, "%1") && strcmp(s, "%2") && strcmp(s, "()") && rnd(4)) s = "%%";
            add(buf, len, cap, s, strlen(s));
        }
    }
}

static void gen_subject(char *buf, size_t *len, size_t cap)
{
    static const char alpha[] = "aaabbbx1 ()A.%-]\0z";
    int n = (int)rnd(14);
    for (int i = 0; i < n; i++) {
        char c = alpha[rnd(sizeof alpha - 1)];
        add(buf, len, cap, &c, 1);
    }
}

/* Calls run(...) in L; its text into out. */
static void call_run(lua_State *L, int kind, const char *s, size_t ls, const char *p, size_t lp, int init, int has_init,
                     const char *r, int n, char *out, size_t cap)
{
    lua_getglobal(L, "run");
    lua_pushinteger(L, kind);
    lua_pushlstring(L, s, ls);
    lua_pushlstring(L, p, lp);
    if (has_init) lua_pushinteger(L, init);
    else lua_pushnil(L);
    lua_pushstring(L, r);
    if (n >= 0) lua_pushinteger(L, n);
    else lua_pushnil(L);
    if (lua_pcall(L, 6, 1, 0) != LUA_OK) {
        snprintf(out, cap, "driver error: %s", lua_tostring(L, -1));
    } else {
        size_t l;
        const char *t = lua_tolstring(L, -1, &l);
        if (l >= cap) l = cap - 1;
        memcpy(out, t, l);
        out[l] = 0;
    }
    lua_pop(L, 1);
}

static lua_Integer counted;
static void count_steps(lua_State *L, lua_Integer n)
{
    (void)L;
    counted += n;
}

static lua_State *state(int ours)
{
    lua_State *L = luaL_newstate();
    luaL_openlibs(L);
    if (ours) loom_lua_open_patterns_(L, count_steps);
    if (luaL_dostring(L, DRIVER) != LUA_OK) {
        printf("# driver: %s\n", lua_tostring(L, -1));
        return NULL;
    }
    return L;
}

static void show(const char *what, const char *s, size_t n)
{
    printf("#   %s \"", what);
    for (size_t i = 0; i < n; i++) {
        if (s[i] == 0) printf("\\0");
        else putchar(s[i]);
    }
    printf("\"\n");
}

static void test_agrees_with_stock(void)
{
    lua_State *A = state(0), *B = state(1);
    CHECK(A && B);
    if (!A || !B) return;
    static const char *const repls[] = {"<%0>", "%1-%2", "%%", "x", "%", "%9", "%1", "", "a%2b", "%z"};
    int cases = 0, differ = 0;
    int seen_kind[10] = {0};
    for (int i = 0; i < 20000; i++) {
        char p[256], s[64], ra[4096], rb[4096];
        size_t lp = 0, ls = 0;
        if (rnd(5) == 0) ADDS(p, &lp, "^");
        gen_items(p, &lp, sizeof p, 5, 2);
        if (rnd(5) == 0) ADDS(p, &lp, "$");
        gen_subject(s, &ls, sizeof s);
        int kind = (int)rnd(10), has_init = rnd(3) == 0, init = (int)rnd(20) - 5, n = rnd(4) == 0 ? (int)rnd(4) : -1;
        const char *r = repls[rnd(sizeof repls / sizeof *repls)];
        call_run(A, kind, s, ls, p, lp, init, has_init, r, n, ra, sizeof ra);
        call_run(B, kind, s, ls, p, lp, init, has_init, r, n, rb, sizeof rb);
        cases++;
        if (strcmp(ra, rb)) {
            if (++differ <= 8) {
                printf("#   case %d kind %d init %d (%d) repl \"%s\" n %d\n", i, kind, init, has_init, r, n);
                show("pattern", p, lp);
                show("subject", s, ls);
                printf("#   stock: %s\n#   ours:  %s\n", ra, rb);
            }
        } else if (strncmp(ra, "true", 4) == 0 && strncmp(ra, "true|nil", 8) != 0) {
            seen_kind[kind]++; /* agreed on a result that is not just "no match" */
        }
    }
    printf("# %d cases, %d differ; matched results by kind:", cases, differ);
    for (int k = 0; k < 10; k++) printf(" %d", seen_kind[k]);
    printf("\n");
    CHECK(differ == 0);
    for (int k = 0; k < 10; k++) CHECK_MSG(seen_kind[k] >= 20, "kind %d: only %d cases with a match", k, seen_kind[k]);
    lua_close(A);
    lua_close(B);
}

/* Hand-written cases the generator rarely reaches. */
static void test_fixed_cases(void)
{
    lua_State *A = state(0), *B = state(1);
    CHECK(A && B);
    if (!A || !B) return;
    static const char *const cases[][3] = {
        {"  hello world  ", "^%s*(.-)%s*$", "%1"},
        {"THE (quick) fox", "%f[%a]%a+", "W"},
        {"x = (a(b)c) y", "%b()", ""},
        {"key=val, k2=v2", "(%w+)=(%w+)", "%2=%1"},
        {"abc", "()", "%1"},
        {"abc", "", "-"},
        {"hello", "(l)(l)", "%2%1"},
        {"aaa", "a-", "!"},
        {"a,b,,c", "([^,]*)", "<%1>"},
        {"abc", "^(a)(b)(c)$", "%3%2%1"},
        {"hello.world", "%.", "%%"},
        {"abcabc", "(abc)%1", "x"},
        {"[[x]]", "%[(.-)%]", "%1"},
        {"one two  three", "%s+", " "},
        {"f(a,b)", "(%w+)(%b())", "%2%1"},
        {"ab", ".-$", "x"},
        {"\0a\0", "%z", "Z"},
        {"\0a\0", "[\0]", "Z"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        for (int kind = 0; kind < 10; kind++) {
            char ra[4096], rb[4096];
            const char *s = cases[i][0], *p = cases[i][1];
            size_t ls = strlen(s), lp = strlen(p);
            if (i == sizeof cases / sizeof *cases - 2 || i == sizeof cases / sizeof *cases - 1) {
                ls = 3;
                lp = strlen(p) + (i == sizeof cases / sizeof *cases - 1 ? 2 : 0);
            }
            call_run(A, kind, s, ls, p, lp, 1, 1, cases[i][2], -1, ra, sizeof ra);
            call_run(B, kind, s, ls, p, lp, 1, 1, cases[i][2], -1, rb, sizeof rb);
            CHECK_MSG(!strcmp(ra, rb), "\"%s\" ~ \"%s\" kind %d: stock %s, ours %s", s, p, kind, ra, rb);
        }
    }
    /* nesting past 200 items ("pattern too complex") and 33 captures ("too many captures") */
    char deep[1024] = "", caps[256] = "";
    for (int i = 0; i < 250; i++) strcat(deep, "a?");
    for (int i = 0; i < 33; i++) strcat(caps, "(a)");
    const char *const big[] = {deep, caps};
    for (int i = 0; i < 2; i++) {
        char ra[4096], rb[4096], subj[300];
        memset(subj, 'a', sizeof subj);
        call_run(A, 0, subj, sizeof subj, big[i], strlen(big[i]), 1, 1, "", -1, ra, sizeof ra);
        call_run(B, 0, subj, sizeof subj, big[i], strlen(big[i]), 1, 1, "", -1, rb, sizeof rb);
        CHECK_MSG(!strcmp(ra, rb) && strstr(ra, i ? "too many captures" : "pattern too complex"), "stock %s, ours %s",
                  ra, rb);
    }
    lua_close(A);
    lua_close(B);
}

static lua_Integer limit;
static void limited_steps(lua_State *L, lua_Integer n)
{
    counted += n;
    if (counted > limit) luaL_error(L, "budget reached after %d steps", (int)counted);
}

static void test_bombs_are_charged(void)
{
    lua_State *L = luaL_newstate();
    luaL_openlibs(L);
    loom_lua_open_patterns_(L, limited_steps);
    static const char *const bombs[] = {
        "return string.find(string.rep('a', 40), string.rep('a*', 20) .. 'b')",
        "return string.match(string.rep('a', 40), string.rep('(.-)', 15) .. '$b')",
        "return ('x'):rep(60):gsub(string.rep('x?', 30) .. string.rep('x', 30) .. 'y', '')",
        "for a in string.gmatch(string.rep('a', 40), string.rep('a-', 20) .. 'b') do end",
        "return string.find(string.rep('a', 100000), string.rep('a', 5000) .. 'b', 1, true)",
    };
    for (size_t i = 0; i < sizeof bombs / sizeof *bombs; i++) {
        counted = 0;
        limit = 10 * 1000 * 1000;
        int rc = luaL_dostring(L, bombs[i]);
        CHECK_MSG(rc != LUA_OK, "bomb %zu finished", i);
        if (rc != LUA_OK) CHECK_CONTAINS(lua_tostring(L, -1), "budget reached");
        lua_settop(L, 0);
    }
    /* trimming 10 KB: steps in proportion to the length, not refused */
    counted = 0;
    limit = INT64_MAX;
    int rc = luaL_dostring(L, "local s = '  ' .. string.rep('word ', 2000) .. '  '\n"
                              "local t = s:match('^%s*(.-)%s*$') assert(#t == 9999, #t)\n"
                              "local n = select(2, s:gsub('%w+', '%0')) assert(n == 2000, n)\n"
                              "local k = 0 for w in s:gmatch('%a+') do k = k + 1 end assert(k == 2000, k)");
    CHECK_MSG(rc == LUA_OK, "%s", lua_tostring(L, -1));
    printf("# 10 KB trim, gsub and gmatch: %lld steps\n", (long long)counted);
    CHECK(counted > 10000 && counted < 400000);
    lua_close(L);
}

static const loom_test tests[] = {
    {"agrees_with_stock", test_agrees_with_stock},
    {"fixed_cases", test_fixed_cases},
    {"bombs_are_charged", test_bombs_are_charged},
    {0},
};

int main(void) { return loom_test_run(tests); }
