/* config_override.c - `--set key=value` overrides applied to the parsed
 * libconfig tree before validation; each keeps its key so errors name it.
 * Threads: none. */
#include "config/config_internal.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

/* ---- overrides ----------------------------------------------------------- */

/* Copies src's value (recursively for groups, lists and arrays) into dst of the same type. */
static bool copy_value(config_setting_t *dst, const config_setting_t *src)
{
    switch (config_setting_type(src)) {
    case CONFIG_TYPE_INT: return config_setting_set_int(dst, config_setting_get_int(src)) == CONFIG_TRUE;
    case CONFIG_TYPE_INT64: return config_setting_set_int64(dst, config_setting_get_int64(src)) == CONFIG_TRUE;
    case CONFIG_TYPE_FLOAT: return config_setting_set_float(dst, config_setting_get_float(src)) == CONFIG_TRUE;
    case CONFIG_TYPE_STRING: return config_setting_set_string(dst, config_setting_get_string(src)) == CONFIG_TRUE;
    case CONFIG_TYPE_BOOL: return config_setting_set_bool(dst, config_setting_get_bool(src)) == CONFIG_TRUE;
    default: break;
    }
    int n = config_setting_length(src);
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = config_setting_get_elem(src, i);
        config_setting_t *d = config_setting_add(dst, config_setting_is_group(src) ? config_setting_name(e) : NULL,
                                                 config_setting_type(e));
        if (!d || !copy_value(d, e)) return false;
    }
    return true;
}

/* Splits "a.b.[2].c" (also "b[2]") into components; an index is stored as "[2]". */
static int split_key(const char *key, char comp[][LOOM_NAME_MAX], int max)
{
    int n = 0;
    const char *p = key;
    while (*p) {
        const char *end = p;
        if (*p == '[') {
            end = strchr(p, ']');
            if (!end) return -1;
            end++;
        } else {
            while (*end && *end != '.' && *end != '[') end++;
        }
        size_t len = (size_t)(end - p);
        if (len == 0 || len >= LOOM_NAME_MAX || n == max) return -1;
        memcpy(comp[n], p, len);
        comp[n][len] = 0;
        n++;
        p = end;
        if (*p == '.') {
            p++;
            if (!*p) return -1;
        }
    }
    return n;
}

static bool parse_index(const char *comp, int *out)
{
    char *end;
    if (comp[0] != '[') return false;
    long v = strtol(comp + 1, &end, 10);
    if (end == comp + 1 || *end != ']' || end[1] || v < 0 || v > INT_MAX) return false;
    *out = (int)v;
    return true;
}

/* The value of an override, read in libconfig syntax as the setting "x" of
 * vc (else kept as a bare string); its integer literals into lits. Returns
 * the setting, or NULL after reporting why. The caller destroys vc. */
static const config_setting_t *read_value(cfg_ctx *c, const char *where, const char *key, const char *val, config_t *vc,
                                          cfg_int_lits *lits)
{
    size_t vl = strlen(val);
    char *buf = loom_alloc(vl + 16);
    if (!buf) {
        cfg_rawerr_(c, LOOM_ENOMEM, where, "out of memory");
        return NULL;
    }
    snprintf(buf, vl + 16, "x = %s;", val);
    const config_setting_t *v = NULL;
    if (config_read_string(vc, buf) == CONFIG_TRUE) {
        v = config_lookup(vc, "x");
        if (config_setting_length(config_root_setting(vc)) > 1) {
            /* "run.epochs=3; version=2" reads as two settings: the second would be lost */
            const config_setting_t *extra = config_setting_get_elem(config_root_setting(vc), 1);
            const char *en = extra && config_setting_name(extra) ? config_setting_name(extra) : "?";
            loom_err *e = cfg_rawerr_(c, LOOM_ECONFIG, where,
                                 "one assignment per --set: the value is followed by another setting, `%s`", en);
            if (e) loom_err_hint(e, "give each setting its own --set: --set %s=... --set %s=...", key, en);
            loom_free(buf);
            return NULL;
        }
        cfg_lex_text_(buf, NULL, lits, 0);
    }
    loom_free(buf);
    if (!v) {
        config_destroy(vc);
        config_init(vc);
        config_setting_t *sv = config_setting_add(config_root_setting(vc), "x", CONFIG_TYPE_STRING);
        if (sv) config_setting_set_string(sv, val);
        v = sv;
    }
    if (!v) cfg_rawerr_(c, LOOM_ENOMEM, where, "out of memory");
    return v;
}

/* The last component of the path is [idx] of the list cur (named list):
 * element idx is replaced by v (of the same type, or an integer into a
 * float), or v is appended when idx is the list's length. */
static void set_elem(cfg_ctx *c, const char *where, char *key, config_setting_t *cur, int idx, const char *comp,
                     const char *list, const config_setting_t *v, const char *val, cfg_int_lits *lits)
{
    int len = config_setting_length(cur);
    config_setting_t *e = config_setting_get_elem(cur, (unsigned)idx);
    if (!e && idx != len) {
        cfg_rawerr_(c, LOOM_ECONFIG, where, "index %s is out of range (the list has %d elements)", comp, len);
        return;
    }
    if (!e) { /* append */
        e = config_setting_add(cur, NULL, config_setting_type(v));
        if (!e || !copy_value(e, v)) {
            cfg_rawerr_(c, LOOM_ECONFIG, where, "cannot append this value to %s", list);
            return;
        }
    } else if (config_setting_type(e) == config_setting_type(v) ||
               (config_setting_type(e) == CONFIG_TYPE_FLOAT && cfg_is_int_(v))) {
        cfg_forget_huge_(c, e);
        while (config_setting_is_aggregate(e) && config_setting_length(e) > 0)
            config_setting_remove_elem(e, 0);
        bool ok = config_setting_type(e) == CONFIG_TYPE_FLOAT && cfg_is_int_(v)
                      ? config_setting_set_float(e, (double)config_setting_get_int64(v)) == CONFIG_TRUE
                      : copy_value(e, v);
        if (!ok) {
            cfg_rawerr_(c, LOOM_ECONFIG, where, "cannot set element %s to this value", comp);
            return;
        }
    } else {
        char a[300];
        cfg_rawerr_(c, LOOM_ECONFIG, where, "cannot replace element %s (%s) with a value of another type: %s",
               comp, cfg_value_str_(e, a, sizeof a), val);
        return;
    }
    cfg_fix_wide_ints_(c, e, lits);
    config_setting_set_hook(e, key);
}

/* Walks the n components of the path from the root of cfg, adding the groups
 * that are missing, and sets the last one to v. */
static void set_path(cfg_ctx *c, const char *where, char *key, config_t *cfg, char comp[][LOOM_NAME_MAX], int n,
                     const config_setting_t *v, const char *val, cfg_int_lits *lits)
{
    config_setting_t *cur = config_root_setting(cfg);
    for (int i = 0; i < n; i++) {
        bool last = i == n - 1;
        int idx;
        if (parse_index(comp[i], &idx)) {
            if (!config_setting_is_list(cur) && !config_setting_is_array(cur)) {
                cfg_rawerr_(c, LOOM_ECONFIG, where, "%s: not a list, so it has no element %s",
                       i ? comp[i - 1] : "(top level)", comp[i]);
                return;
            }
            if (last) {
                set_elem(c, where, key, cur, idx, comp[i], i ? comp[i - 1] : "", v, val, lits);
                return;
            }
            config_setting_t *e = config_setting_get_elem(cur, (unsigned)idx);
            if (!e) {
                cfg_rawerr_(c, LOOM_ECONFIG, where, "index %s is out of range (the list has %d elements)", comp[i],
                       config_setting_length(cur));
                return;
            }
            cur = e;
            continue;
        }
        if (!config_setting_is_group(cur)) {
            cfg_rawerr_(c, LOOM_ECONFIG, where, "%s is not a group, so it has no setting `%s`",
                   i ? comp[i - 1] : "(top level)", comp[i]);
            return;
        }
        config_setting_t *s = config_setting_get_member(cur, comp[i]);
        if (!last) {
            if (!s) {
                s = config_setting_add(cur, comp[i], CONFIG_TYPE_GROUP);
                if (!s) {
                    cfg_rawerr_(c, LOOM_ECONFIG, where, "bad setting name `%s`", comp[i]);
                    return;
                }
                config_setting_set_hook(s, key);
            }
            cur = s;
            continue;
        }
        if (s) {
            cfg_forget_huge_(c, s);
            config_setting_remove(cur, comp[i]);
        }
        s = config_setting_add(cur, comp[i], config_setting_type(v));
        if (!s) {
            cfg_rawerr_(c, LOOM_ECONFIG, where, "bad setting name `%s`", comp[i]);
            return;
        }
        if (!copy_value(s, v)) {
            cfg_rawerr_(c, LOOM_ECONFIG, where, "cannot set this value: %s", val);
            return;
        }
        cfg_fix_wide_ints_(c, s, lits);
        config_setting_set_hook(s, key);
    }
}

/* Applies one "a.b.c=value" to the tree; key is kept (as the setting's hook)
 * so that errors about the setting say "--set a.b.c". */
void cfg_apply_override_(cfg_ctx *c, config_t *cfg, const char *text, char *key)
{
    char where[300];
    const char *eq = strchr(text, '=');
    snprintf(where, sizeof where, "--set %s", key);
    if (!eq || eq == text) {
        loom_err *e = cfg_rawerr_(c, LOOM_ECONFIG, where, "expected key=value, got \"%s\"", text);
        if (e) loom_err_hint(e, "e.g. --set run.epochs=2");
        return;
    }
    char comp[16][LOOM_NAME_MAX];
    int n = split_key(key, comp, 16);
    if (n <= 0) {
        cfg_rawerr_(c, LOOM_ECONFIG, where, "bad setting path \"%s\" (expected a.b.c or a.list.[2].c)", key);
        return;
    }
    /* the value, in libconfig syntax, else a bare string */
    config_t vc;
    config_init(&vc);
    cfg_int_lits lits = {0};
    const config_setting_t *v = read_value(c, where, key, eq + 1, &vc, &lits);
    if (v) set_path(c, where, key, cfg, comp, n, v, eq + 1, &lits);
    loom_free(lits.v);
    config_destroy(&vc);
}
