/* config_table.c - the option-table engine every section is parsed with:
 * the load context and its errors (file:line or "--set key", the setting's
 * path, the offending value quoted), integer literals re-read beyond 32 bits,
 * and an option table's defaults, types, ranges and unknown-key checks.
 * Threads: none. */
#include "config/config_internal.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- load context and error reporting ------------------------------------ */

/* "--set key" when s (or a group holding it) came from an override, else "file:line". */
void cfg_where_of_(const cfg_ctx *c, const config_setting_t *s, char *buf, size_t n, int *line_out)
{
    if (line_out) *line_out = 0;
    for (const config_setting_t *p = s; p; p = config_setting_parent(p))
        if (config_setting_get_hook(p)) {
            snprintf(buf, n, "--set %s", (const char *)config_setting_get_hook(p));
            return;
        }
    const char *file = s ? config_setting_source_file(s) : NULL;
    unsigned line = s ? config_setting_source_line(s) : 0;
    if (!file) file = c->path;
    /* an @include'd file is named relative to the config's directory: say where it is */
    const char *pre = file[0] != '/' && strcmp(file, c->path) ? c->pdir : "";
    if (line_out) *line_out = (int)line;
    int w = line ? snprintf(buf, n, "%s%s:%u", pre, file, line) : snprintf(buf, n, "%s%s", pre, file);
    if (w >= (int)n && n > 4) memcpy(buf + n - 4, "...", 4); /* a very long path: cut, visibly */
}

/* The setting's path from the root: "data.train.transforms.[2].size". */
static void path_of(const config_setting_t *s, char *buf, size_t n)
{
    const config_setting_t *chain[64];
    int k = 0;
    for (const config_setting_t *p = s; p && config_setting_parent(p) && k < 64; p = config_setting_parent(p))
        chain[k++] = p;
    size_t len = 0;
    buf[0] = 0;
    for (int i = k - 1; i >= 0 && len < n; i--) {
        const config_setting_t *p = chain[i], *par = config_setting_parent(p);
        int w;
        if (config_setting_is_group(par))
            w = snprintf(buf + len, n - len, "%s%s", len ? "." : "", config_setting_name(p));
        else
            w = snprintf(buf + len, n - len, "%s[%d]", len ? "." : "", config_setting_index(p));
        if (w < 0) break;
        len += (size_t)w;
    }
}

void cfg_loc_of_(const cfg_ctx *c, const config_setting_t *s, loom_loc *l)
{
    char where[LOOM_PATH_MAX];
    const config_setting_t *p = s;
    cfg_where_of_(c, s, where, sizeof where, &l->line);
    /* cfg_where_of_ gives "file:line"; keep the file part only */
    if (l->line > 0) {
        char *colon = strrchr(where, ':');
        if (colon) *colon = 0;
    }
    snprintf(l->file, sizeof l->file, "%s", where);
    path_of(p, l->path, sizeof l->path);
}

/* Records an error about setting s (its path prefixes the message); returns
 * the entry so a hint can be added, or NULL once the list is full. */
__attribute__((format(printf, 3, 4)))
loom_err *cfg_err_(cfg_ctx *c, const config_setting_t *s, const char *fmt, ...)
{
    if (c->errs->n >= LOOM_MAX_ERRORS) return NULL;
    loom_err *e = &c->errs->e[c->errs->n++];
    char where[256], path[256], msg[512];
    cfg_where_of_(c, s, where, sizeof where, NULL);
    if (s)
        path_of(s, path, sizeof path);
    else
        path[0] = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (path[0] && !(!strncmp(where, "--set ", 6) && !strcmp(where + 6, path)))
        loom_err_set(e, LOOM_ECONFIG, where, "%s: %s", path, msg);
    else
        loom_err_set(e, LOOM_ECONFIG, where, "%s", msg);
    return e;
}

/* An error not tied to a setting (override syntax, the file itself). */
__attribute__((format(printf, 4, 5)))
loom_err *cfg_rawerr_(cfg_ctx *c, int code, const char *where, const char *fmt, ...)
{
    if (c->errs->n >= LOOM_MAX_ERRORS) return NULL;
    loom_err *e = &c->errs->e[c->errs->n++];
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    loom_err_set(e, code, where, "%s", msg);
    return e;
}

/* A double printed so that it reads back exactly, always with a '.' or an exponent. */
const char *cfg_fmt_double_(double v, char *buf, size_t n)
{
    snprintf(buf, n, "%.15g", v);
    if (strtod(buf, NULL) != v) snprintf(buf, n, "%.17g", v);
    if (!strpbrk(buf, ".eEni")) {
        size_t l = strlen(buf);
        if (l + 2 < n) memcpy(buf + l, ".0", 3);
    }
    return buf;
}

/* The value of s for a message: 5, -3.5, "abc", true, a group, a list. */
const char *cfg_value_str_(const config_setting_t *s, char *buf, size_t n)
{
    switch (config_setting_type(s)) {
    case CONFIG_TYPE_INT: snprintf(buf, n, "%d", config_setting_get_int(s)); break;
    case CONFIG_TYPE_INT64: snprintf(buf, n, "%lld", config_setting_get_int64(s)); break;
    case CONFIG_TYPE_FLOAT: cfg_fmt_double_(config_setting_get_float(s), buf, n); break;
    case CONFIG_TYPE_STRING: snprintf(buf, n, "\"%s\"", config_setting_get_string(s)); break;
    case CONFIG_TYPE_BOOL: snprintf(buf, n, "%s", config_setting_get_bool(s) ? "true" : "false"); break;
    case CONFIG_TYPE_GROUP: snprintf(buf, n, "a group { ... }"); break;
    case CONFIG_TYPE_ARRAY: snprintf(buf, n, "an array [ ... ]"); break;
    case CONFIG_TYPE_LIST: snprintf(buf, n, "a list ( ... )"); break;
    default: snprintf(buf, n, "nothing"); break;
    }
    return buf;
}

/* "a, b, c" */
static const char *join_names(const char *const *names, char *buf, size_t n)
{
    size_t len = 0;
    buf[0] = 0;
    for (int i = 0; names[i] && len < n; i++) {
        int w = snprintf(buf + len, n - len, "%s%s", i ? ", " : "", names[i]);
        if (w < 0) break;
        len += (size_t)w;
    }
    return buf;
}

int cfg_find_name_(const char *const *names, const char *s)
{
    for (int i = 0; names[i]; i++)
        if (!strcmp(names[i], s)) return i;
    return -1;
}

/* The closest name within edit distance 2 (and shorter than s), or NULL. */
const char *cfg_closest_(const char *const *names, const char *s)
{
    const char *best = NULL;
    int bd = 3;
    for (int i = 0; names[i]; i++) {
        int d = loom_edit_distance(s, names[i]);
        if (d < bd && d < (int)strlen(s)) bd = d, best = names[i];
    }
    return best;
}

bool cfg_is_int_(const config_setting_t *s)
{
    int t = config_setting_type(s);
    return t == CONFIG_TYPE_INT || t == CONFIG_TYPE_INT64;
}

bool cfg_is_number_(const config_setting_t *s) { return cfg_is_int_(s) || config_setting_type(s) == CONFIG_TYPE_FLOAT; }

double cfg_get_number_(const config_setting_t *s)
{
    return config_setting_type(s) == CONFIG_TYPE_FLOAT ? config_setting_get_float(s)
                                                       : (double)config_setting_get_int64(s);
}

/* ---- integer literals beyond 32 bits -------------------------------------
 * libconfig 1.5 reads an integer literal without an L suffix into an int,
 * so 5000000000 becomes 705032704 and 4294967297 becomes 1; later versions
 * read it as an int64. To get the written value whatever the version, the
 * text is lexed here: its integer literals, in order, pair one to one with
 * the tree's integer settings in depth-first order. A literal that did not
 * fit an int is stored into its setting as an int64; one beyond 64 bits is
 * remembered (ctx.huge) and refused by cfg_get_int_in_ with the setting's range. */

static void lits_push(cfg_int_lits *L, const cfg_int_lit *x)
{
    if (L->n == L->cap) {
        int cap = L->cap ? 2 * L->cap : 64;
        cfg_int_lit *p = loom_realloc(L->v, (size_t)cap * sizeof *p);
        if (!p) {
            L->bad = true;
            return;
        }
        L->v = p;
        L->cap = cap;
    }
    L->v[L->n++] = *x;
}

/* One integer literal at p ("-12", "0x1F", "5L"), or a float (skipped); returns the end. */
static const char *lex_number(const char *p, cfg_int_lits *L)
{
    const char *s = p;
    bool neg = false;
    if (*p == '+' || *p == '-') neg = *p++ == '-';
    cfg_int_lit x = {0};
    if (p[0] == '0' && (p[1] == 'x' || p[1] == 'X') && isxdigit((unsigned char)p[2])) {
        uint64_t u = 0;
        for (p += 2; isxdigit((unsigned char)*p); p++) {
            int d = isdigit((unsigned char)*p) ? *p - '0' : (tolower((unsigned char)*p) - 'a' + 10);
            if (u > (UINT64_MAX >> 4)) x.huge = true;
            u = (u << 4) | (uint64_t)d;
        }
        /* libconfig reads hex as unsigned: 0xFFFFFFFF is -1 as an int, 0xFFFFFFFFFFFFFFFFL -1 as an int64 */
        x.v = (int64_t)u;
        if (!x.huge && neg) x.v = -x.v;
    } else {
        const char *d = p;
        while (isdigit((unsigned char)*p)) p++;
        bool digits = p > d;
        if (*p == '.' || ((*p == 'e' || *p == 'E') && digits)) { /* a float: skip it */
            if (*p == '.') p++;
            while (isdigit((unsigned char)*p)) p++;
            if (*p == 'e' || *p == 'E') {
                p++;
                if (*p == '+' || *p == '-') p++;
                while (isdigit((unsigned char)*p)) p++;
            }
            return p;
        }
        if (!digits) return p;
        errno = 0;
        char *end;
        long long v = strtoll(s, &end, 10);
        x.huge = errno == ERANGE;
        x.v = (int64_t)v;
    }
    if (*p == 'L') {
        x.suffix = true;
        p++;
        if (*p == 'L') p++;
    }
    snprintf(x.text, sizeof x.text, "%.*s%s", (int)(p - s > 24 ? 24 : p - s), s, p - s > 24 ? "..." : "");
    lits_push(L, &x);
    return p;
}

/* The integer literals of text, in order; @include'd files (relative to dir) in place. */
void cfg_lex_text_(const char *t, const char *dir, cfg_int_lits *L, int depth)
{
    const char *p = t;
    while (*p && !L->bad) {
        unsigned char ch = (unsigned char)*p;
        if (ch == '#' || (ch == '/' && p[1] == '/')) {
            while (*p && *p != '\n') p++;
        } else if (ch == '/' && p[1] == '*') {
            const char *e = strstr(p + 2, "*/");
            p = e ? e + 2 : p + strlen(p);
        } else if (ch == '"') {
            for (p++; *p && *p != '"'; p++)
                if (*p == '\\' && p[1]) p++;
            if (*p) p++;
        } else if (ch == '@' && !strncmp(p, "@include", 8)) {
            p += 8;
            while (*p == ' ' || *p == '\t') p++;
            if (*p != '"') continue;
            const char *q = ++p;
            while (*q && *q != '"' && *q != '\n') q++;
            char name[LOOM_PATH_MAX], full[2 * LOOM_PATH_MAX + 2];
            snprintf(name, sizeof name, "%.*s", (int)(q - p), p);
            if (name[0] == '/' || !dir[0])
                snprintf(full, sizeof full, "%s", name);
            else
                snprintf(full, sizeof full, "%s/%s", dir, name);
            if (!dir) { /* an override's value includes nothing */
                L->bad = true;
                return;
            }
            cfg_lex_file_(full, dir, L, depth + 1);
            p = *q ? q + 1 : q;
        } else if (isalpha(ch) || ch == '*' || ch == '_') { /* a name, or true/false */
            while (isalnum((unsigned char)*p) || *p == '-' || *p == '_' || *p == '*') p++;
        } else if (isdigit(ch) || ((ch == '-' || ch == '+' || ch == '.') && (isdigit((unsigned char)p[1]) || p[1] == '.'))) {
            const char *e = lex_number(p, L);
            p = e > p ? e : p + 1;
        } else {
            p++;
        }
    }
}

void cfg_lex_file_(const char *path, const char *dir, cfg_int_lits *L, int depth)
{
    if (depth > 10) { /* libconfig refuses deeper includes itself */
        L->bad = true;
        return;
    }
    /* through core's reader, which refuses what is not a regular file (an
     * @include of a directory read as a file of LONG_MAX bytes; a FIFO would
     * block) and bounds the size */
    uint8_t *text = NULL;
    size_t len = 0;
    loom_err e;
    if (loom_read_file_max(path, &text, &len, (uint64_t)1 << 30, &e) == LOOM_OK)
        cfg_lex_text_((char *)text, dir, L, depth);
    else
        L->bad = true;
    loom_free(text);
}

/* The tree's integer settings in depth-first order, paired with lits from *k. */
static bool fix_ints(cfg_ctx *c, config_setting_t *s, const cfg_int_lits *L, int *k, bool apply)
{
    int t = config_setting_type(s);
    if (t == CONFIG_TYPE_INT || t == CONFIG_TYPE_INT64) {
        if (*k >= L->n) return false;
        const cfg_int_lit *x = &L->v[(*k)++];
        if (!apply) return true;
        if (x->huge) {
            if (c->n_huge < (int)(sizeof c->huge / sizeof c->huge[0])) {
                c->huge[c->n_huge] = s;
                snprintf(c->huge_text[c->n_huge], sizeof c->huge_text[0], "%s", x->text);
                c->n_huge++;
            }
        } else if (t == CONFIG_TYPE_INT && (x->v < INT_MIN || x->v > INT_MAX) &&
                   (int32_t)(uint32_t)(uint64_t)x->v == config_setting_get_int(s)) {
            /* the struct is public in every libconfig; its line and file stay */
            s->type = CONFIG_TYPE_INT64;
            s->value.llval = x->v;
        }
        return true;
    }
    if (!config_setting_is_aggregate(s)) return true;
    int n = config_setting_length(s);
    for (int i = 0; i < n; i++)
        if (!fix_ints(c, config_setting_get_elem(s, (unsigned)i), L, k, apply)) return false;
    return true;
}

/* Pairs the literals with root's integers; does nothing unless the counts agree. */
void cfg_fix_wide_ints_(cfg_ctx *c, config_setting_t *root, cfg_int_lits *L)
{
    int k = 0;
    if (!L->bad && fix_ints(c, root, L, &k, false) && k == L->n) {
        k = 0;
        fix_ints(c, root, L, &k, true);
    }
    loom_free(L->v);
    L->v = NULL;
    L->n = L->cap = 0;
}

/* Forgets the huge literals inside s, which an override is about to remove. */
void cfg_forget_huge_(cfg_ctx *c, const config_setting_t *s)
{
    for (int i = 0; i < c->n_huge; i++)
        for (const config_setting_t *p = c->huge[i]; p; p = config_setting_parent(p))
            if (p == s) {
                c->huge[i] = NULL;
                break;
            }
}

static const char *huge_text(const cfg_ctx *c, const config_setting_t *s)
{
    for (int i = 0; i < c->n_huge; i++)
        if (c->huge[i] == s) return c->huge_text[i];
    return NULL;
}

/* ---- the option engine --------------------------------------------------- */

bool cfg_applies_(const cfg_opt *o, int kind) { return kind < 0 ? o->applies == ALL : (o->applies & K(kind)) != 0; }
static bool required(const cfg_opt *o, int kind) { return kind >= 0 && (o->required & K(kind)) != 0; }

static void store_int(void *p, size_t size, int64_t v)
{
    if (size == sizeof(int))
        *(int *)p = (int)v;
    else
        *(int64_t *)p = v;
}

void cfg_opt_default_(const cfg_opt *o, void *base)
{
    char *p = (char *)base + o->off;
    switch (o->type) {
    case OT_INT: store_int(p, o->size, o->idef); break;
    case OT_F64: *(double *)p = o->fdef; break;
    case OT_BOOL: *(bool *)p = o->idef != 0; break;
    case OT_ENUM: *(int *)p = (int)o->idef; break;
    case OT_STR: snprintf(p, o->size, "%s", o->sdef ? o->sdef : ""); break;
    case OT_PAIR: ((int *)p)[0] = ((int *)p)[1] = (int)o->idef; break;
    default: break;
    }
}

static const char *irange_str(int64_t lo, int64_t hi, char *buf, size_t n)
{
    if (lo == INT64_MIN && hi == INT64_MAX)
        snprintf(buf, n, "an integer");
    else if (hi == INT64_MAX || (hi == INT_MAX && lo > INT_MIN))
        snprintf(buf, n, "an integer >= %lld", (long long)lo);
    else
        snprintf(buf, n, "an integer in [%lld, %lld]", (long long)lo, (long long)hi);
    return buf;
}

static const char *frange_str(const cfg_opt *o, char *buf, size_t n)
{
    char a[40], b[40];
    unsigned f = o->flags;
    if ((f & F_NO_LO) && (f & F_NO_HI))
        snprintf(buf, n, "a number");
    else if (f & F_NO_HI)
        snprintf(buf, n, "a number %s %s", (f & F_LO_OPEN) ? ">" : ">=", cfg_fmt_double_(o->flo, a, sizeof a));
    else if (f & F_NO_LO)
        snprintf(buf, n, "a number %s %s", (f & F_HI_OPEN) ? "<" : "<=", cfg_fmt_double_(o->fhi, b, sizeof b));
    else
        snprintf(buf, n, "a number in %s%s, %s%s", (f & F_LO_OPEN) ? "(" : "[", cfg_fmt_double_(o->flo, a, sizeof a),
                 cfg_fmt_double_(o->fhi, b, sizeof b), (f & F_HI_OPEN) ? ")" : "]");
    return buf;
}

/* An integer in [lo, hi] from s; false (with an error) otherwise. */
bool cfg_get_int_in_(cfg_ctx *c, const config_setting_t *s, int64_t lo, int64_t hi, int64_t *out)
{
    char r[80], v[300];
    const char *h = huge_text(c, s);
    if (h) {
        cfg_err_(c, s, "expected %s, got %s (beyond the 64-bit range)", irange_str(lo, hi, r, sizeof r), h);
        return false;
    }
    if (!cfg_is_int_(s)) {
        cfg_err_(c, s, "expected %s, got %s", irange_str(lo, hi, r, sizeof r), cfg_value_str_(s, v, sizeof v));
        return false;
    }
    int64_t x = config_setting_get_int64(s);
    if (x > hi && hi != INT64_MAX) { /* name the upper bound that "an integer >= lo" leaves out */
        cfg_err_(c, s, "expected an integer in [%lld, %lld], got %lld", (long long)lo, (long long)hi, (long long)x);
        return false;
    }
    if (x < lo || x > hi) {
        cfg_err_(c, s, "expected %s, got %lld", irange_str(lo, hi, r, sizeof r), (long long)x);
        return false;
    }
    *out = x;
    return true;
}

/* Resolves an enum string; -1 (with an error) when unknown. */
int cfg_get_enum_(cfg_ctx *c, const config_setting_t *s, const char *const *names)
{
    char all[512], v[300];
    join_names(names, all, sizeof all);
    if (config_setting_type(s) != CONFIG_TYPE_STRING) {
        cfg_err_(c, s, "expected a string (one of: %s), got %s", all, cfg_value_str_(s, v, sizeof v));
        return -1;
    }
    const char *str = config_setting_get_string(s);
    int i = cfg_find_name_(names, str);
    if (i < 0) {
        loom_err *e = cfg_err_(c, s, "unknown value \"%s\" (expected one of: %s)", str, all);
        const char *near = cfg_closest_(names, str);
        if (e && near) loom_err_hint(e, "did you mean \"%s\"?", near);
    }
    return i;
}

/* Parses one present option into base. */
static void opt_parse(cfg_ctx *c, const cfg_opt *o, const config_setting_t *s, void *base)
{
    char *p = (char *)base + o->off;
    char r[120], v[300];
    int64_t x;
    switch (o->type) {
    case OT_INT: {
        int64_t hi = o->ihi;
        if (o->size == sizeof(int) && hi > INT_MAX) hi = INT_MAX;
        if (cfg_get_int_in_(c, s, o->ilo, hi, &x)) store_int(p, o->size, x);
        break;
    }
    case OT_F64: {
        if (!cfg_is_number_(s)) {
            cfg_err_(c, s, "expected %s, got %s", frange_str(o, r, sizeof r), cfg_value_str_(s, v, sizeof v));
            break;
        }
        double d = cfg_get_number_(s);
        unsigned f = o->flags;
        bool ok = isfinite(d);
        if (!(f & F_NO_LO)) ok = ok && ((f & F_LO_OPEN) ? d > o->flo : d >= o->flo);
        if (!(f & F_NO_HI)) ok = ok && ((f & F_HI_OPEN) ? d < o->fhi : d <= o->fhi);
        if (!ok)
            cfg_err_(c, s, "expected %s, got %s", frange_str(o, r, sizeof r), cfg_value_str_(s, v, sizeof v));
        else
            *(double *)p = d;
        break;
    }
    case OT_BOOL:
        if (config_setting_type(s) != CONFIG_TYPE_BOOL)
            cfg_err_(c, s, "expected true or false, got %s", cfg_value_str_(s, v, sizeof v));
        else
            *(bool *)p = config_setting_get_bool(s) != 0;
        break;
    case OT_ENUM: {
        int i = cfg_get_enum_(c, s, o->names);
        if (i >= 0) *(int *)p = i;
        break;
    }
    case OT_STR: {
        if (o->names) {
            if (cfg_get_enum_(c, s, o->names) >= 0) snprintf(p, o->size, "%s", config_setting_get_string(s));
            break;
        }
        if (config_setting_type(s) != CONFIG_TYPE_STRING) {
            cfg_err_(c, s, "expected a string, got %s", cfg_value_str_(s, v, sizeof v));
            break;
        }
        const char *str = config_setting_get_string(s);
        if (!str[0])
            cfg_err_(c, s, "expected a non-empty string, got \"\"");
        else if (strlen(str) >= o->size)
            cfg_err_(c, s, "\"%s\" is too long (at most %zu characters)", str, o->size - 1);
        else
            snprintf(p, o->size, "%s", str);
        break;
    }
    case OT_PAIR: {
        int *pr = (int *)p;
        int64_t hi = o->ihi > INT_MAX ? INT_MAX : o->ihi;
        if (cfg_is_int_(s)) {
            if (cfg_get_int_in_(c, s, o->ilo, hi, &x)) pr[0] = pr[1] = (int)x;
        } else if ((config_setting_is_array(s) || config_setting_is_list(s)) && config_setting_length(s) == 2) {
            int64_t a, b;
            bool ok_a = cfg_get_int_in_(c, config_setting_get_elem(s, 0), o->ilo, hi, &a);
            bool ok_b = cfg_get_int_in_(c, config_setting_get_elem(s, 1), o->ilo, hi, &b);
            if (ok_a && ok_b) pr[0] = (int)a, pr[1] = (int)b;
        } else {
            cfg_err_(c, s, "expected an integer or [h, w], got %s", cfg_value_str_(s, v, sizeof v));
        }
        break;
    }
    case OT_CUSTOM: o->parse(c, s, base); break;
    default: break;
    }
}

/* Reads the kind entry (tbl[0], F_KIND) of group g; -1 when missing or bad. */
int cfg_parse_kind_(cfg_ctx *c, const config_setting_t *g, const cfg_opt *tbl, void *base)
{
    const cfg_opt *o = &tbl[0];
    LOOM_ASSERT(o->flags & F_KIND);
    const config_setting_t *s = config_setting_get_member(g, o->name);
    if (!s) {
        if (o->required) {
            char all[512];
            cfg_err_(c, g, "missing required setting `%s` (one of: %s)", o->name,
                     join_names(o->names, all, sizeof all));
            return -1;
        }
        cfg_opt_default_(o, base);
        return (int)o->idef;
    }
    int k = cfg_get_enum_(c, s, o->names);
    if (k >= 0) *(int *)((char *)base + o->off) = k;
    return k;
}

/* Parses every option of tbl (but the kind entry) that applies to kind:
 * the given value, or the default, or a "missing" error. SUB entries are
 * left to the caller, apart from the "missing" check. */
void cfg_parse_opts_(cfg_ctx *c, const config_setting_t *g, const cfg_opt *tbl, int kind, void *base)
{
    for (const cfg_opt *o = tbl; o->name; o++) {
        if ((o->flags & F_KIND) || !cfg_applies_(o, kind) || (c->skip_key && !strcmp(o->name, c->skip_key))) continue;
        const config_setting_t *s = config_setting_get_member(g, o->name);
        if (!s) {
            if (required(o, kind) || (kind < 0 && o->required == ALL && o->applies == ALL))
                cfg_err_(c, g, "missing required setting `%s` (%s)", o->name, o->help);
            else if (o->type != OT_SUB && o->type != OT_CUSTOM)
                cfg_opt_default_(o, base);
            continue;
        }
        if (o->flags & F_UNSUPPORTED)
            cfg_err_(c, s, "not supported yet (%s); remove this section", o->help);
        else if (o->type != OT_SUB)
            opt_parse(c, o, s, base);
    }
}

/* Every key of g must be an option that applies to its kind. */
/* Whether some ungated scope has an entry named key that applies to its kind:
 * a key such as `feature` may belong to the transform table for one op and
 * to the map table for another, so every scope is asked before any complains. */
static bool key_applies(const char *key, const cfg_scope *sc, int n_sc)
{
    for (int j = 0; j < n_sc; j++)
        for (const cfg_opt *o = sc[j].tbl; o->name && !sc[j].gate; o++)
            if (!strcmp(o->name, key) && (sc[j].kind < 0 || cfg_applies_(o, sc[j].kind))) return true;
    return false;
}

void cfg_check_keys_(cfg_ctx *c, const config_setting_t *g, const cfg_scope *sc, int n_sc)
{
    int len = config_setting_length(g);
    for (int i = 0; i < len; i++) {
        const config_setting_t *s = config_setting_get_elem(g, i);
        const char *key = config_setting_name(s);
        bool known = false, ok = key_applies(key, sc, n_sc);
        /* complain from the innermost ungated scope first: with op = "map" and fn = "pad",
         * `size` is a random_crop setting before it is a batch one */
        int order[8], no = 0;
        LOOM_ASSERT(n_sc <= 8);
        for (int j = n_sc - 1; j >= 0; j--)
            if (!sc[j].gate) order[no++] = j;
        for (int j = 0; j < n_sc; j++)
            if (sc[j].gate) order[no++] = j;
        for (int q = 0; q < n_sc && !ok; q++) {
            int j = order[q];
            unsigned mask = 0;
            bool here = false;
            for (const cfg_opt *o = sc[j].tbl; o->name; o++)
                if (!strcmp(o->name, key)) {
                    here = true;
                    mask |= o->applies;
                    if (!sc[j].gate && (sc[j].kind < 0 || cfg_applies_(o, sc[j].kind))) ok = true;
                }
            if (!here || ok || known) continue;
            known = true;
            if (sc[j].gate) {
                cfg_err_(c, s, "%s applies only to %s", key, sc[j].gate);
                continue;
            }
            /* applies only to other kinds of this group: list them */
            const cfg_opt *k0 = &sc[j].tbl[0];
            char kinds[256];
            size_t kl = 0;
            kinds[0] = 0;
            for (int b = 0; k0->names[b] && kl < sizeof kinds; b++)
                if (mask & K(b)) {
                    int w = snprintf(kinds + kl, sizeof kinds - kl, "%s\"%s\"", kl ? " or " : "", k0->names[b]);
                    if (w > 0) kl += (size_t)w;
                }
            /* the kind as written: a plugin's strategy has no name in the table */
            const config_setting_t *ks = config_setting_get_member(g, k0->name);
            const char *kind = ks && config_setting_type(ks) == CONFIG_TYPE_STRING ? config_setting_get_string(ks)
                                                                                   : loom_cfg_name_(k0->names, sc[j].kind);
            if (!kinds[0]) /* only to kinds without a name in the table */
                cfg_err_(c, s, "%s does not apply to %s = \"%s\"", key, k0->name, kind);
            else
                cfg_err_(c, s, "%s applies only to %s = %s (%s is \"%s\")", key, k0->name, kinds, k0->name, kind);
        }
        if (ok || known) continue;
        /* unknown: suggest the closest valid key of this group */
        const char *valid[64];
        int nv = 0;
        for (int j = 0; j < n_sc; j++) {
            if (sc[j].gate) continue;
            for (const cfg_opt *o = sc[j].tbl; o->name && nv < 63; o++) {
                if (sc[j].kind >= 0 && !cfg_applies_(o, sc[j].kind)) continue;
                bool dup = false;
                for (int q = 0; q < nv; q++) dup = dup || !strcmp(valid[q], o->name);
                if (!dup) valid[nv++] = o->name;
            }
        }
        valid[nv] = NULL;
        const char *near = cfg_closest_(valid, key);
        if (near) {
            cfg_err_(c, s, "unknown setting `%s` (did you mean `%s`?)", key, near);
        } else {
            char all[512];
            cfg_err_(c, s, "unknown setting `%s` (valid here: %s)", key, join_names(valid, all, sizeof all));
        }
    }
}

/* A group member that must itself be a group; NULL (with an error) when it is not. */
const config_setting_t *cfg_sub_group_(cfg_ctx *c, const config_setting_t *g, const char *key)
{
    const config_setting_t *s = config_setting_get_member(g, key);
    if (!s) return NULL;
    if (!config_setting_is_group(s)) {
        char v[300];
        cfg_err_(c, s, "expected a group { ... }, got %s", cfg_value_str_(s, v, sizeof v));
        return NULL;
    }
    return s;
}

/* A member that must be a list of groups (an empty array [] is accepted too). */
const config_setting_t *cfg_sub_list_(cfg_ctx *c, const config_setting_t *g, const char *key)
{
    const config_setting_t *s = config_setting_get_member(g, key);
    if (!s) return NULL;
    if (config_setting_is_list(s) || (config_setting_is_array(s) && config_setting_length(s) == 0)) return s;
    char v[300];
    cfg_err_(c, s, "expected a list ( { ... }, ... ), got %s", cfg_value_str_(s, v, sizeof v));
    return NULL;
}

/* Defaults for the options of tbl (all of them when the group is absent). */
void cfg_opts_default_(const cfg_opt *tbl, void *base)
{
    for (const cfg_opt *o = tbl; o->name; o++) cfg_opt_default_(o, base);
}

/* Checks that s is one non-empty string or a list of at most max; returns
 * how many, or -1 after reporting the problem. */
int cfg_string_list_(cfg_ctx *c, const config_setting_t *s, int max, const char *what)
{
    char v[300];
    bool one = config_setting_type(s) == CONFIG_TYPE_STRING;
    if (!one && !config_setting_is_array(s) && !config_setting_is_list(s)) {
        cfg_err_(c, s, "expected a list of %s [\"...\", ...], got %s", what, cfg_value_str_(s, v, sizeof v));
        return -1;
    }
    int n = one ? 1 : config_setting_length(s);
    if (n > max) {
        cfg_err_(c, s, "expected at most %d %s, got %d", max, what, n);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = one ? s : config_setting_get_elem(s, i);
        if (config_setting_type(e) != CONFIG_TYPE_STRING || !config_setting_get_string(e)[0]) {
            cfg_err_(c, e, "expected a non-empty string, got %s", cfg_value_str_(e, v, sizeof v));
            return -1;
        }
    }
    return n;
}
