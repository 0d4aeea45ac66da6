/* config_hooks.c - the hooks section: Lua callbacks ("file.lua:function"),
 * a custom training step, the Lua sandbox's limits.
 * Threads: none. */
#include "config/config_internal.h"

#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static void parse_hook_callbacks(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_hook_train_step(cfg_ctx *c, const config_setting_t *s, void *base);

/* ---- hooks ----------------------------------------------------------------- */

static const cfg_opt hooks_opts[] = {
    O_CUSTOM("callbacks", parse_hook_callbacks, ALL, 0,
             "a list of \"file.lua:function\" or { fn = ...; args = { ... }; }, each function returning a table of "
             "callbacks"),
    O_CUSTOM("train_step", parse_hook_train_step, ALL, 0,
             "\"file.lua:function\" or { fn = ...; args = { ... }; }: train_step(ctx, batch, args) replaces the "
             "built-in step"),
    O_INT(loom_hooks_spec, "step_interval", step_interval, 1, 1, INT64_MAX, ALL, 0, "on_step_end every N steps"),
    O_BOOL(loom_hooks_spec, "unsafe", unsafe, 0, ALL, "the whole Lua standard library, file writes anywhere"),
    O_INT(loom_hooks_spec, "memory_limit", memory_limit, 0, -1, INT64_MAX, ALL, 0,
          "bytes per Lua state; 0 = 64 MiB, -1 = no cap"),
    O_INT(loom_hooks_spec, "instruction_limit", instruction_limit, 0, -1, INT64_MAX, ALL, 0,
          "Lua VM instructions per call; 0 = 100 million, -1 = no budget"),
    O_END,
};

/* "file.lua:function" whose file exists (relative to the config's directory). */
static bool hook_ref_string(cfg_ctx *c, const config_setting_t *s, loom_hook_ref *h)
{
    char v[300];
    if (config_setting_type(s) != CONFIG_TYPE_STRING) {
        cfg_err_(c, s, "expected \"file.lua:function\", got %s", cfg_value_str_(s, v, sizeof v));
        return false;
    }
    const char *ref = config_setting_get_string(s);
    const char *colon = strrchr(ref, ':');
    if (!colon || colon == ref || !colon[1] || strlen(ref) >= sizeof h->ref) {
        loom_err *e = cfg_err_(c, s, "expected \"file.lua:function\", got \"%s\"", ref);
        if (e) loom_err_hint(e, "e.g. \"../lua/early_stopping.lua:early_stopping\" (the file relative to the config's "
                                "directory)");
        return false;
    }
    char full[LOOM_PATH_MAX + 8];
    int n = (int)(colon - ref);
    int w = ref[0] == '/' ? snprintf(full, sizeof full, "%.*s", n, ref)
                          : snprintf(full, sizeof full, "%s/%.*s", c->dir, n, ref);
    struct stat st;
    if (w < 0 || w >= (int)sizeof full || stat(full, &st) != 0 || !S_ISREG(st.st_mode)) {
        loom_err *e = cfg_err_(c, s, "cannot read the Lua file \"%.*s\" (resolved to %s)", n, ref, full);
        if (e) loom_err_hint(e, "the file is relative to the config file's directory");
        return false;
    }
    snprintf(h->ref, sizeof h->ref, "%s", ref);
    cfg_loc_of_(c, s, &h->loc);
    return true;
}

/* A map's or filter's `lua`: checked as a hook's reference, then stored with
 * the file resolved against the config's directory ("/abs/lua/augment.lua:cutout"),
 * so the data module needs no directory. */
void cfg_resolve_lua_ref_(cfg_ctx *c, const config_setting_t *s, char *out, size_t n)
{
    loom_hook_ref h;
    if (!hook_ref_string(c, s, &h)) return;
    const char *colon = strrchr(h.ref, ':');
    int len = (int)(colon - h.ref);
    int w = h.ref[0] == '/' ? snprintf(out, n, "%s", h.ref) : snprintf(out, n, "%s/%.*s%s", c->dir, len, h.ref, colon);
    if (w < 0 || (size_t)w >= n) cfg_err_(c, s, "the Lua file's path is too long (at most %zu characters)", n - 1);
}

/* A hook: "file.lua:function", or { fn = "file.lua:function"; args = { name = value; ... }; }. */
static bool parse_hook_ref(cfg_ctx *c, const config_setting_t *s, loom_hook_ref *h)
{
    memset(h, 0, sizeof *h);
    if (!config_setting_is_group(s)) return hook_ref_string(c, s, h);
    static const char *const keys[] = {"fn", "args", NULL};
    int len = config_setting_length(s);
    for (int i = 0; i < len; i++) {
        const config_setting_t *k = config_setting_get_elem(s, i);
        if (cfg_find_name_(keys, config_setting_name(k)) >= 0) continue;
        const char *near = cfg_closest_(keys, config_setting_name(k));
        if (near) cfg_err_(c, k, "unknown setting `%s` (did you mean `%s`?)", config_setting_name(k), near);
        else cfg_err_(c, k, "unknown setting `%s` (valid here: fn, args)", config_setting_name(k));
    }
    const config_setting_t *fn = config_setting_get_member(s, "fn");
    if (!fn) {
        cfg_err_(c, s, "missing required setting `fn` (\"file.lua:function\")");
        return false;
    }
    bool ok = hook_ref_string(c, fn, h);
    const config_setting_t *a = config_setting_get_member(s, "args");
    if (!a) return ok;
    char v[300];
    if (!config_setting_is_group(a)) {
        cfg_err_(c, a, "expected a group { name = value; ... }, got %s", cfg_value_str_(a, v, sizeof v));
        return false;
    }
    int na = config_setting_length(a);
    if (na > LOOM_MAX_HOOK_ARGS) {
        cfg_err_(c, a, "expected at most %d arguments, got %d", LOOM_MAX_HOOK_ARGS, na);
        return false;
    }
    for (int i = 0; i < na; i++) {
        const config_setting_t *e = config_setting_get_elem(a, i);
        int k = h->n_args;
        snprintf(h->arg_name[k], sizeof h->arg_name[k], "%s", config_setting_name(e));
        if (cfg_is_number_(e)) {
            h->arg_type[k] = cfg_is_int_(e) ? LOOM_HOOK_ARG_INT : LOOM_HOOK_ARG_NUMBER;
            h->arg_num[k] = cfg_get_number_(e);
        } else if (config_setting_type(e) == CONFIG_TYPE_BOOL) {
            h->arg_type[k] = LOOM_HOOK_ARG_BOOL;
            h->arg_num[k] = config_setting_get_bool(e);
        } else if (config_setting_type(e) == CONFIG_TYPE_STRING &&
                   strlen(config_setting_get_string(e)) < sizeof h->arg_str[k]) {
            h->arg_type[k] = LOOM_HOOK_ARG_STRING;
            snprintf(h->arg_str[k], sizeof h->arg_str[k], "%s", config_setting_get_string(e));
        } else {
            cfg_err_(c, e, "expected a number, a string (at most %d characters) or a boolean, got %s",
                     LOOM_NAME_MAX - 1, cfg_value_str_(e, v, sizeof v));
            ok = false;
            continue;
        }
        h->n_args++;
    }
    return ok;
}

static void parse_hook_callbacks(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_hooks_spec *h = base;
    char v[300];
    if (!config_setting_is_array(s) && !config_setting_is_list(s)) {
        cfg_err_(c, s, "expected a list [\"file.lua:function\", ...] or ( { fn = ...; args = { ... }; }, ... ), got %s",
             cfg_value_str_(s, v, sizeof v));
        return;
    }
    int n = config_setting_length(s);
    if (n > LOOM_MAX_CALLBACKS) {
        cfg_err_(c, s, "expected at most %d callbacks, got %d", LOOM_MAX_CALLBACKS, n);
        return;
    }
    for (int i = 0; i < n; i++)
        if (parse_hook_ref(c, config_setting_get_elem(s, i), &h->callback[h->n_callbacks])) h->n_callbacks++;
}

static void parse_hook_train_step(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_hooks_spec *h = base;
    h->has_train_step = parse_hook_ref(c, s, &h->train_step);
}

/* hooks = { callbacks = [...]; train_step = "..."; step_interval = N; ... }; */
void cfg_parse_hooks_(cfg_ctx *c, const config_setting_t *root, loom_hooks_spec *h)
{
    const config_setting_t *g = cfg_sub_group_(c, root, "hooks");
    for (const cfg_opt *o = hooks_opts; o->name; o++) cfg_opt_default_(o, h);
    if (!g) return;
    h->present = true;
    cfg_loc_of_(c, g, &h->loc);
    cfg_parse_opts_(c, g, hooks_opts, 0, h);
    cfg_scope sc = {hooks_opts, 0, NULL};
    cfg_check_keys_(c, g, &sc, 1);
}
