/* config_plugins.c - the plugins section (directories, required plugins) and
 * the KEY = scalar argument groups handed to plugin sources, maps, filters
 * and strategies.
 * Threads: none. */
#include "config/config_internal.h"

#include <string.h>
#include <sys/stat.h>

static void parse_plugin_path(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_plugin_require(cfg_ctx *c, const config_setting_t *s, void *base);

static const cfg_opt plugins_opts[] = {
    O_CUSTOM("path", parse_plugin_path, ALL, 0,
             "directories searched for plugins (*.so), relative to the config's directory"),
    O_CUSTOM("require", parse_plugin_require, ALL, 0, "names of plugins that must load"),
    O_END,
};

/* A group of scalars for a plugin's provider, each kept as text with its line. */
void cfg_plugin_opts_group_(cfg_ctx *c, const config_setting_t *s, loom_plugin_opts *o)
{
    char v[300];
    o->n = 0;
    if (!config_setting_is_group(s)) {
        cfg_err_(c, s, "expected a group { KEY = value; ... }, got %s", cfg_value_str_(s, v, sizeof v));
        return;
    }
    int n = config_setting_length(s);
    if (n > LOOM_MAX_PLUGIN_OPTS) {
        cfg_err_(c, s, "too many options: %d (at most %d)", n, LOOM_MAX_PLUGIN_OPTS);
        return;
    }
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = config_setting_get_elem(s, i);
        const char *key = config_setting_name(e);
        if (config_setting_is_group(e)) {
            cfg_err_(c, e, "expected a number, a string, true/false or an array of them, got %s",
                     cfg_value_str_(e, v, sizeof v));
            continue;
        }
        if (config_setting_is_aggregate(e)) { /* an array: its values as text, joined by commas ("1,2,3") */
            size_t len = 0;
            bool ok = true;
            v[0] = 0;
            for (int j = 0; j < config_setting_length(e) && ok; j++) {
                const config_setting_t *x = config_setting_get_elem(e, j);
                char one[300];
                if (config_setting_is_aggregate(x)) ok = false;
                else if (config_setting_type(x) == CONFIG_TYPE_STRING) snprintf(one, sizeof one, "%s", config_setting_get_string(x));
                else cfg_value_str_(x, one, sizeof one);
                if (ok && strchr(one, ',')) ok = false;
                if (ok) len += (size_t)snprintf(v + len, sizeof v - len, "%s%s", j ? "," : "", one);
                if (len >= sizeof v) len = sizeof v - 1;
            }
            if (!ok) {
                cfg_err_(c, e, "an array argument holds numbers, true/false or strings without commas (it reaches the "
                           "plugin as its values joined by commas)");
                continue;
            }
        } else if (config_setting_type(e) == CONFIG_TYPE_STRING)
            snprintf(v, sizeof v, "%s", config_setting_get_string(e));
        else
            cfg_value_str_(e, v, sizeof v);
        if (strlen(key) >= sizeof o->key[0] || strlen(v) >= sizeof o->value[0]) {
            cfg_err_(c, e, "key or value too long (at most %zu and %zu characters)", sizeof o->key[0] - 1,
                 sizeof o->value[0] - 1);
            continue;
        }
        int k = o->n++;
        snprintf(o->key[k], sizeof o->key[k], "%s", key);
        snprintf(o->value[k], sizeof o->value[k], "%s", v);
        char where[300];
        cfg_where_of_(c, e, where, sizeof where, &o->line[k]);
    }
}

static void parse_plugin_path(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_plugins_spec *p = base;
    int n = cfg_string_list_(c, s, LOOM_MAX_PLUGIN_DIRS, "directories");
    bool one = config_setting_type(s) == CONFIG_TYPE_STRING;
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = one ? s : config_setting_get_elem(s, i);
        const char *dir = config_setting_get_string(e);
        char full[LOOM_PATH_MAX + 8];
        int w = dir[0] == '/' ? snprintf(full, sizeof full, "%s", dir) : snprintf(full, sizeof full, "%s/%s", c->dir, dir);
        struct stat st;
        if (w < 0 || w >= LOOM_PATH_MAX) {
            cfg_err_(c, e, "directory name \"%s\" is too long", dir);
        } else if (stat(full, &st) != 0 || !S_ISDIR(st.st_mode)) {
            loom_err *er = cfg_err_(c, e, "\"%s\" (resolved to %s) is not a directory", dir, full);
            if (er) loom_err_hint(er, "relative paths are relative to the config file's directory");
        } else {
            memcpy(p->path[p->n_path++], full, (size_t)w + 1);
        }
    }
}

static void parse_plugin_require(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_plugins_spec *p = base;
    int n = cfg_string_list_(c, s, LOOM_MAX_PLUGIN_REQUIRES, "plugin names");
    bool one = config_setting_type(s) == CONFIG_TYPE_STRING;
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = one ? s : config_setting_get_elem(s, i);
        const char *name = config_setting_get_string(e);
        if (strlen(name) >= LOOM_NAME_MAX) {
            cfg_err_(c, e, "plugin name \"%s\" is too long (at most %d characters)", name, LOOM_NAME_MAX - 1);
            continue;
        }
        int k = p->n_require++;
        snprintf(p->require[k], sizeof p->require[k], "%s", name);
        char where[300];
        cfg_where_of_(c, e, where, sizeof where, &p->require_line[k]);
    }
}

/* plugins = { path = [...]; require = [...]; }: the directories are checked
 * here, the names once plugins are loaded (plugin/plugin.c). */
void cfg_parse_plugins_(cfg_ctx *c, const config_setting_t *root, loom_plugins_spec *p)
{
    const config_setting_t *g = cfg_sub_group_(c, root, "plugins");
    if (!g) {
        snprintf(p->loc.file, sizeof p->loc.file, "%s", c->path);
        snprintf(p->loc.path, sizeof p->loc.path, "plugins");
        return;
    }
    cfg_loc_of_(c, g, &p->loc);
    cfg_parse_opts_(c, g, plugins_opts, 0, p);
    cfg_scope sc = {plugins_opts, 0, NULL};
    cfg_check_keys_(c, g, &sc, 1);
}
