/* pattern.c - string.find, string.match, string.gmatch and string.gsub for
 * the Lua states, with Lua 5.4's documented pattern syntax and results, and
 * every matching step charged to the instruction budget.
 *
 * Why our own matcher: Lua's patterns backtrack, so one call such as
 * string.find(string.rep("a", 40), string.rep("a*", 20) .. "b") can run for
 * hours inside C, where the count hook never runs. Here each step (entering
 * a pattern item, one more repetition tried, a character scanned by %b, a
 * back-reference or a plain search) counts; every STEP_BATCH steps the count
 * goes to the budget, which raises "instruction limit ..." at the Lua line
 * that called. Patterns and results are Lua 5.4's (tests/unit/test_lua_pattern.c
 * compares them with the stock library's on generated patterns).
 * Threads: as the lua_State. */
#include "script_internal.h"

#include <ctype.h>
#include <string.h>

#define MAX_CAPTURES 32           /* as Lua's LUA_MAXCAPTURES: "too many captures" beyond */
#define MAX_DEPTH    200          /* nested pattern items: "pattern too complex" beyond */
#define STEP_BATCH   1024         /* steps between charges to the budget */
#define CAP_OPEN     (-1)         /* a capture whose ')' is not reached yet */
#define CAP_POS      (-2)         /* a position capture "()" */
#define SPECIALS     "^$*+?.([%-"

typedef struct {
    lua_State        *L;
    loom_lua_charge_fn charge;
    const char       *s0, *se;    /* subject: [s0, se), *se == 0 (a Lua string) */
    const char       *pe;         /* end of the pattern */
    int               level;      /* captures open or closed */
    int               depth;      /* nested do_match calls left */
    lua_Integer       steps;      /* not charged yet */
    struct {
        const char *at;
        ptrdiff_t   len;          /* >= 0, CAP_OPEN or CAP_POS */
    } cap[MAX_CAPTURES];
} mstate;

/* n more steps: every STEP_BATCH, to the budget (which may raise). */
static inline void step(mstate *m, lua_Integer n)
{
    m->steps += n;
    if (m->steps >= STEP_BATCH) {
        lua_Integer k = m->steps;
        m->steps = 0;
        if (m->charge) m->charge(m->L, k);
    }
}

static void flush_steps(mstate *m)
{
    lua_Integer k = m->steps;
    m->steps = 0;
    if (k && m->charge) m->charge(m->L, k);
}

static void init_state(mstate *m, lua_State *L, const char *s, size_t ls, const char *p, size_t lp)
{
    m->L = L;
    m->charge = *(loom_lua_charge_fn *)lua_touserdata(L, lua_upvalueindex(1));
    m->s0 = s;
    m->se = s + ls;
    m->pe = p + lp;
    m->steps = 0;
}

static void restart(mstate *m)
{
    m->level = 0;
    m->depth = MAX_DEPTH;
}

/* ---- single characters ------------------------------------------------------------ */

/* Whether c is in class cl (the letter after '%'); an upper-case letter is the complement,
 * any other character stands for itself. */
static int in_class(int c, int cl)
{
    int yes;
    switch (tolower(cl)) {
    case 'a': yes = isalpha(c); break;
    case 'c': yes = iscntrl(c); break;
    case 'd': yes = isdigit(c); break;
    case 'g': yes = isgraph(c); break;
    case 'l': yes = islower(c); break;
    case 'p': yes = ispunct(c); break;
    case 's': yes = isspace(c); break;
    case 'u': yes = isupper(c); break;
    case 'w': yes = isalnum(c); break;
    case 'x': yes = isxdigit(c); break;
    case 'z': yes = c == 0; break; /* deprecated in Lua 5.2, still accepted */
    default: return cl == c;
    }
    if (isupper(cl)) yes = !yes;
    return yes != 0;
}

/* Whether c is in the set [lo, close): lo at '[', close at its ']'. */
static int in_set(mstate *m, int c, const char *lo, const char *close)
{
    int want = 1;
    const char *q = lo + 1;
    if (*q == '^') {
        want = 0;
        q++;
    }
    step(m, (close - lo) >> 3);
    for (; q < close; q++) {
        unsigned char a = (unsigned char)*q;
        if (a == '%') { /* item_end saw to it that a character follows */
            q++;
            if (in_class(c, (unsigned char)*q)) return want;
        } else if (q[1] == '-' && q + 2 < close) {
            if (a <= c && c <= (unsigned char)q[2]) return want;
            q += 2;
        } else if (a == c) {
            return want;
        }
    }
    return !want;
}

/* The end of the single-character item starting at p. */
static const char *item_end(mstate *m, const char *p)
{
    char c = *p++;
    if (c == '%') {
        if (p == m->pe) luaL_error(m->L, "malformed pattern (ends with '%%')");
        return p + 1;
    }
    if (c == '[') {
        if (*p == '^') p++;
        do { /* the first character is in the set even when it is ']' */
            if (p == m->pe) luaL_error(m->L, "malformed pattern (missing ']')");
            c = *p++;
            if (c == '%' && p < m->pe) p++;
        } while (*p != ']');
        return p + 1;
    }
    return p;
}

/* Whether the character at s matches the item [p, ep). */
static int item_matches(mstate *m, const char *s, const char *p, const char *ep)
{
    if (s >= m->se) return 0;
    int c = (unsigned char)*s;
    switch (*p) {
    case '.': return 1;
    case '%': return in_class(c, (unsigned char)p[1]);
    case '[': return in_set(m, c, p, ep - 1);
    default: return (unsigned char)*p == c;
    }
}

/* ---- matching ----------------------------------------------------------------------- */

static const char *do_match(mstate *m, const char *s, const char *p);

/* Longest run of the item first, then shorter ones until the rest matches. */
static const char *greedy(mstate *m, const char *s, const char *p, const char *ep)
{
    ptrdiff_t n = 0;
    while (item_matches(m, s + n, p, ep)) {
        n++;
        step(m, 1);
    }
    for (; n >= 0; n--) {
        const char *r = do_match(m, s + n, ep + 1);
        if (r) return r;
    }
    return NULL;
}

/* Shortest run of the item first, one more until the rest matches. */
static const char *lazy(mstate *m, const char *s, const char *p, const char *ep)
{
    for (;;) {
        const char *r = do_match(m, s, ep + 1);
        if (r) return r;
        if (!item_matches(m, s, p, ep)) return NULL;
        s++;
    }
}

static const char *open_capture(mstate *m, const char *s, const char *p, ptrdiff_t what)
{
    if (m->level >= MAX_CAPTURES) luaL_error(m->L, "too many captures");
    m->cap[m->level].at = s;
    m->cap[m->level].len = what;
    m->level++;
    const char *r = do_match(m, s, p);
    if (!r) m->level--;
    return r;
}

static const char *close_capture(mstate *m, const char *s, const char *p)
{
    int i = m->level - 1;
    while (i >= 0 && m->cap[i].len != CAP_OPEN) i--;
    if (i < 0) luaL_error(m->L, "invalid pattern capture");
    m->cap[i].len = s - m->cap[i].at;
    const char *r = do_match(m, s, p);
    if (!r) m->cap[i].len = CAP_OPEN;
    return r;
}

/* %bxy at p (p at 'x'): from an x at s to its balancing y. */
static const char *balanced(mstate *m, const char *s, const char *p)
{
    if (p >= m->pe - 1) luaL_error(m->L, "malformed pattern (missing arguments to '%%b')");
    if (s >= m->se || *s != *p) return NULL;
    char open = p[0], close = p[1];
    int depth = 1;
    const char *from = s;
    while (++s < m->se) {
        if (*s == close) {
            if (--depth == 0) {
                step(m, s - from);
                return s + 1;
            }
        } else if (*s == open) {
            depth++;
        }
    }
    step(m, s - from);
    return NULL;
}

/* %1..%9: the text of capture d again. */
static const char *back_reference(mstate *m, const char *s, int d)
{
    int i = d - '1';
    if (i < 0 || i >= m->level || m->cap[i].len == CAP_OPEN)
        luaL_error(m->L, "invalid capture index %%%d", i + 1);
    ptrdiff_t len = m->cap[i].len;
    if (len < 0) return NULL; /* a position capture has no text */
    step(m, len >> 4);
    if (m->se - s >= len && memcmp(m->cap[i].at, s, (size_t)len) == 0) return s + len;
    return NULL;
}

/* Where the match of pattern p (to m->pe) at s ends, or NULL. */
static const char *do_match(mstate *m, const char *s, const char *p)
{
    if (m->depth-- == 0) luaL_error(m->L, "pattern too complex");
    while (p != m->pe) {
        step(m, 1);
        const char *ep;
        switch (*p) {
        case '(':
            s = p[1] == ')' ? open_capture(m, s, p + 2, CAP_POS) : open_capture(m, s, p + 1, CAP_OPEN);
            goto done;
        case ')':
            s = close_capture(m, s, p + 1);
            goto done;
        case '$':
            if (p + 1 == m->pe) {
                if (s != m->se) s = NULL;
                goto done;
            }
            goto single;
        case '%':
            if (p[1] == 'b') {
                s = balanced(m, s, p + 2);
                if (!s) goto done;
                p += 4;
                continue;
            }
            if (p[1] == 'f') {
                p += 2;
                if (*p != '[') luaL_error(m->L, "missing '[' after '%%f' in pattern");
                ep = item_end(m, p);
                int before = s == m->s0 ? 0 : (unsigned char)s[-1];
                int at = s < m->se ? (unsigned char)*s : 0;
                if (!in_set(m, before, p, ep - 1) && in_set(m, at, p, ep - 1)) {
                    p = ep;
                    continue;
                }
                s = NULL;
                goto done;
            }
            if (isdigit((unsigned char)p[1])) {
                s = back_reference(m, s, (unsigned char)p[1]);
                if (!s) goto done;
                p += 2;
                continue;
            }
            goto single;
        default:
        single:
            ep = item_end(m, p);
            if (!item_matches(m, s, p, ep)) {
                if (*ep == '*' || *ep == '?' || *ep == '-') { /* zero repetitions are fine */
                    p = ep + 1;
                    continue;
                }
                s = NULL;
                goto done;
            }
            switch (*ep) {
            case '?': {
                const char *r = do_match(m, s + 1, ep + 1);
                if (r) {
                    s = r;
                    goto done;
                }
                p = ep + 1;
                continue;
            }
            case '+': s = greedy(m, s + 1, p, ep); goto done;
            case '*': s = greedy(m, s, p, ep); goto done;
            case '-': s = lazy(m, s, p, ep); goto done;
            default:
                s++;
                p = ep;
                continue;
            }
        }
    }
done:
    m->depth++;
    return s;
}

/* ---- results --------------------------------------------------------------------------- */

/* Pushes capture i of the match [s, e) (i == 0 without captures: the whole match). */
static void push_capture(mstate *m, int i, const char *s, const char *e)
{
    if (i >= m->level) {
        if (i != 0) luaL_error(m->L, "invalid capture index %%%d", i + 1);
        lua_pushlstring(m->L, s, (size_t)(e - s));
        return;
    }
    ptrdiff_t len = m->cap[i].len;
    if (len == CAP_OPEN) luaL_error(m->L, "unfinished capture");
    if (len == CAP_POS) lua_pushinteger(m->L, (m->cap[i].at - m->s0) + 1);
    else lua_pushlstring(m->L, m->cap[i].at, (size_t)len);
}

/* Pushes the captures (or the whole match when there are none and s is given). */
static int push_captures(mstate *m, const char *s, const char *e)
{
    int n = m->level == 0 && s ? 1 : m->level;
    luaL_checkstack(m->L, n, "too many captures");
    for (int i = 0; i < n; i++) push_capture(m, i, s, e);
    return n;
}

/* The 1-based start position argument: negative counts from the end, past the start is 1. */
static size_t start_pos(lua_Integer pos, size_t len)
{
    if (pos > 0) return (size_t)pos;
    if (pos == 0 || pos < -(lua_Integer)len) return 1;
    return len + (size_t)pos + 1;
}

static int has_specials(const char *p, size_t lp)
{
    for (size_t i = 0; i < lp; i++)
        if (p[i] && strchr(SPECIALS, p[i])) return 1;
    return 0;
}

/* The first occurrence of [p, p + lp) in [s, s + ls), charged to m. */
static const char *plain_find(mstate *m, const char *s, size_t ls, const char *p, size_t lp)
{
    if (lp == 0) return s;
    if (lp > ls) return NULL;
    const char *end = s + (ls - lp) + 1, *at = s; /* candidates: [s, end) */
    while (at < end) {
        const char *hit = memchr(at, p[0], (size_t)(end - at));
        step(m, ((hit ? hit : end) - at) >> 4);
        if (!hit) return NULL;
        step(m, 1 + (lua_Integer)(lp >> 4));
        if (memcmp(hit + 1, p + 1, lp - 1) == 0) return hit;
        at = hit + 1;
    }
    return NULL;
}

static int find_or_match(lua_State *L, int find)
{
    size_t ls, lp;
    const char *s = luaL_checklstring(L, 1, &ls);
    const char *p = luaL_checklstring(L, 2, &lp);
    size_t init = start_pos(luaL_optinteger(L, 3, 1), ls) - 1;
    if (init > ls) {
        luaL_pushfail(L);
        return 1;
    }
    mstate m;
    init_state(&m, L, s, ls, p, lp);
    if (find && (lua_toboolean(L, 4) || !has_specials(p, lp))) {
        const char *hit = plain_find(&m, s + init, ls - init, p, lp);
        flush_steps(&m);
        if (hit) {
            lua_pushinteger(L, (hit - s) + 1);
            lua_pushinteger(L, (hit - s) + (lua_Integer)lp);
            return 2;
        }
        luaL_pushfail(L);
        return 1;
    }
    int anchored = *p == '^';
    if (anchored) {
        p++;
        lp--;
    }
    m.pe = p + lp;
    const char *at = s + init;
    do {
        restart(&m);
        const char *e = do_match(&m, at, p);
        if (e) {
            flush_steps(&m);
            if (find) {
                lua_pushinteger(L, (at - s) + 1);
                lua_pushinteger(L, e - s);
                return push_captures(&m, NULL, NULL) + 2;
            }
            return push_captures(&m, at, e);
        }
    } while (at++ < m.se && !anchored);
    flush_steps(&m);
    luaL_pushfail(L);
    return 1;
}

static int p_find(lua_State *L) { return find_or_match(L, 1); }
static int p_match(lua_State *L) { return find_or_match(L, 0); }

/* ---- gmatch ------------------------------------------------------------------------------- */

typedef struct {
    size_t    at;        /* where the next attempt starts (offset into the subject) */
    ptrdiff_t last;      /* where the last match ended, -1 = none */
} gmatch_pos;

/* upvalues: charge, subject, pattern, gmatch_pos */
static int gmatch_next(lua_State *L)
{
    size_t ls, lp;
    const char *s = lua_tolstring(L, lua_upvalueindex(2), &ls);
    const char *p = lua_tolstring(L, lua_upvalueindex(3), &lp);
    gmatch_pos *g = lua_touserdata(L, lua_upvalueindex(4));
    if (g->at > ls) return 0; /* done, or an init past the end */
    mstate m;
    init_state(&m, L, s, ls, p, lp);
    for (const char *at = s + g->at; at <= m.se; at++) {
        restart(&m);
        const char *e = do_match(&m, at, p);
        if (e && e - s != g->last) {
            flush_steps(&m);
            g->at = (size_t)(e - s);
            g->last = e - s;
            return push_captures(&m, at, e);
        }
    }
    flush_steps(&m);
    g->at = ls + 1;
    return 0;
}

static int p_gmatch(lua_State *L)
{
    size_t ls;
    luaL_checklstring(L, 1, &ls);
    luaL_checkstring(L, 2);
    size_t init = start_pos(luaL_optinteger(L, 3, 1), ls) - 1;
    if (init > ls) init = ls + 1;
    lua_settop(L, 2);
    gmatch_pos *g = lua_newuserdatauv(L, sizeof *g, 0);
    g->at = init;
    g->last = -1;
    lua_pushvalue(L, lua_upvalueindex(1));
    lua_rotate(L, 1, 1); /* charge, subject, pattern, position */
    lua_pushcclosure(L, gmatch_next, 4);
    return 1;
}

/* ---- gsub --------------------------------------------------------------------------------- */

/* Appends the replacement string (argument 3) with %0-%9 and %% expanded. */
static void add_template(mstate *m, luaL_Buffer *b, const char *s, const char *e)
{
    size_t l;
    const char *r = lua_tolstring(m->L, 3, &l), *pct;
    step(m, (lua_Integer)(l >> 4));
    while ((pct = memchr(r, '%', l)) != NULL) {
        luaL_addlstring(b, r, (size_t)(pct - r));
        char d = pct[1]; /* the string's terminating 0 after a final '%' */
        if (d == '%') {
            luaL_addchar(b, '%');
        } else if (d == '0') {
            luaL_addlstring(b, s, (size_t)(e - s));
        } else if (isdigit((unsigned char)d)) {
            push_capture(m, d - '1', s, e);
            luaL_addvalue(b); /* a position capture: its number as text */
        } else {
            luaL_error(m->L, "invalid use of '%%' in replacement string");
        }
        l -= (size_t)(pct + 2 - r);
        r = pct + 2;
    }
    luaL_addlstring(b, r, l);
}

/* Appends the replacement of the match [s, e); returns whether it changed the text. */
static int add_replacement(mstate *m, luaL_Buffer *b, const char *s, const char *e, int kind)
{
    lua_State *L = m->L;
    if (kind == LUA_TFUNCTION) {
        lua_pushvalue(L, 3);
        int n = push_captures(m, s, e);
        lua_call(L, n, 1);
    } else if (kind == LUA_TTABLE) {
        push_capture(m, 0, s, e);
        lua_gettable(L, 3);
    } else {
        add_template(m, b, s, e);
        return 1;
    }
    if (!lua_toboolean(L, -1)) { /* nil or false: the match stays */
        lua_pop(L, 1);
        luaL_addlstring(b, s, (size_t)(e - s));
        return 0;
    }
    if (!lua_isstring(L, -1)) return luaL_error(L, "invalid replacement value (a %s)", luaL_typename(L, -1));
    luaL_addvalue(b);
    return 1;
}

static int p_gsub(lua_State *L)
{
    size_t ls, lp;
    const char *s = luaL_checklstring(L, 1, &ls);
    const char *p = luaL_checklstring(L, 2, &lp);
    int kind = lua_type(L, 3);
    lua_Integer max = luaL_optinteger(L, 4, (lua_Integer)ls + 1);
    luaL_argexpected(L, kind == LUA_TNUMBER || kind == LUA_TSTRING || kind == LUA_TFUNCTION || kind == LUA_TTABLE,
                     3, "string/function/table");
    int anchored = *p == '^';
    if (anchored) {
        p++;
        lp--;
    }
    mstate m;
    init_state(&m, L, s, ls, p, lp);
    luaL_Buffer b;
    luaL_buffinit(L, &b);
    const char *at = s, *last = NULL;
    lua_Integer n = 0;
    int changed = 0;
    while (n < max) {
        restart(&m);
        const char *e = do_match(&m, at, p);
        if (e && e != last) {
            n++;
            changed |= add_replacement(&m, &b, at, e, kind);
            at = last = e;
        } else if (at < m.se) {
            luaL_addchar(&b, *at++);
        } else {
            break;
        }
        if (anchored) break;
    }
    flush_steps(&m);
    if (!changed) {
        lua_pushvalue(L, 1);
    } else {
        luaL_addlstring(&b, at, (size_t)(m.se - at));
        luaL_pushresult(&b);
    }
    lua_pushinteger(L, n);
    return 2;
}

/* ---- installing ------------------------------------------------------------------------------ */

void loom_lua_open_patterns_(lua_State *L, loom_lua_charge_fn charge)
{
    static const luaL_Reg fns[] = {{"find", p_find}, {"match", p_match}, {"gmatch", p_gmatch}, {"gsub", p_gsub},
                                   {NULL, NULL}};
    lua_getglobal(L, "string");
    *(loom_lua_charge_fn *)lua_newuserdatauv(L, sizeof charge, 0) = charge;
    luaL_setfuncs(L, fns, 1);
    lua_pop(L, 1);
}
