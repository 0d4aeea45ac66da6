/* loader.c - finds plugins, checks each one (an ELF shared object, the entry
 * point, the ABI version, a unique name, a successful init) and commits what
 * it registered; resolves the provider names a config gives.
 * A refusal is recorded with its reason and never stops the other plugins.
 * Threads: main thread, at startup (the state below is written only then). */
#include "plugin/plugin_internal.h"
#include "plugin/elf_check_internal.h"

#include <dirent.h>
#include <dlfcn.h>
#include <elf.h>
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_DIRS (LOOM_MAX_PLUGIN_DIRS + 24)
#define MAX_PENDING 16
#define MAX_STRATEGY_OPTIONS 64

static loom_plugin_record records[LOOM_MAX_PLUGINS];
static char real_paths[LOOM_MAX_PLUGINS][PATH_MAX]; /* to load a file reached twice once */
static int n_records;
static char dirs[MAX_DIRS][LOOM_PATH_MAX];
static int n_dirs;
static bool loaded_once;

/* The keys each registered strategy accepts in strategy.options. */
static struct {
    const char *strategy;
    const char *const *options;
} strategy_options[MAX_STRATEGY_OPTIONS];
static int n_strategy_options;

/* Registrations of the plugin whose init is running. */
typedef struct pending {
    loom_reg_kind kind;
    const char *name;
    const void *vtable;
    const char *const *options;
} pending;
static struct {
    bool active;
    int n;
    pending p[MAX_PENDING];
    bool failed; /* a registration was refused: the plugin is too */
    loom_err why;
} cur;

int loom_plugin_register_(loom_reg_kind kind, const char *name, const void *vtable, const char *const *options,
                          loom_err *err)
{
    int rc = LOOM_OK;
    const char *origin = NULL;
    if (!cur.active)
        rc = loom_err_set(err, LOOM_EPLUGIN, NULL, "providers can only be registered from the plugin's init");
    else if (!name || !*name || strlen(name) >= LOOM_NAME_MAX)
        rc = loom_err_set(err, LOOM_EPLUGIN, NULL, "a %s without a name, or with one longer than %d characters",
                          loom_reg_kind_name(kind), LOOM_NAME_MAX - 1);
    else if (loom_registry_find(kind, name, &origin))
        rc = loom_err_set(err, LOOM_EPLUGIN, NULL, "%s \"%s\" is already registered by %s", loom_reg_kind_name(kind),
                          name, origin);
    else if (cur.n == MAX_PENDING)
        rc = loom_err_set(err, LOOM_EPLUGIN, NULL, "more than %d providers in one plugin", MAX_PENDING);
    for (int i = 0; !rc && i < cur.n; i++)
        if (cur.p[i].kind == kind && !strcmp(cur.p[i].name, name))
            rc = loom_err_set(err, LOOM_EPLUGIN, NULL, "%s \"%s\" is registered twice by this plugin",
                              loom_reg_kind_name(kind), name);
    if (rc) {
        if (cur.active && !cur.failed) cur.failed = true, cur.why = *err;
        return rc;
    }
    cur.p[cur.n++] = (pending){kind, name, vtable, options};
    return LOOM_OK;
}

/* ---- checking one file --------------------------------------------------------- */

/* The entry's fields other than the ABI version: present and sane. */
static int check_entry(const char *path, const loom_plugin *p, loom_err *err)
{
    if (p->size < sizeof(loom_plugin))
        return loom_err_set(err, LOOM_EPLUGIN, path, "loom_plugin is %u bytes, expected at least %zu", p->size,
                            sizeof(loom_plugin));
    if (!p->name || !p->name[0] || strlen(p->name) >= LOOM_NAME_MAX)
        return loom_err_set(err, LOOM_EPLUGIN, path, "the plugin has no name, or one longer than %d characters",
                            LOOM_NAME_MAX - 1);
    if (!p->init) return loom_err_set(err, LOOM_EPLUGIN, path, "plugin \"%s\" has no init function", p->name);
    for (int i = 0; i < n_records; i++)
        if (records[i].loaded && !strcmp(records[i].name, p->name))
            return loom_err_set(err, LOOM_EPLUGIN, path, "plugin name \"%s\" is already taken by %s", p->name,
                                records[i].path),
                   loom_err_hint(err, "two copies of one plugin? keep one of them");
    return LOOM_OK;
}

/* Runs init and commits its registrations. */
static int run_init(const char *path, const loom_plugin *p, loom_plugin_record *rec, loom_err *err)
{
    loom_err ie = {0};
    memset(&cur, 0, sizeof cur);
    cur.active = true;
    int rc = p->init(loom_plugin_host_(), &ie);
    cur.active = false;
    if (cur.failed) { /* a refused registration refuses the plugin, whatever init returned */
        loom_err_set(err, LOOM_EPLUGIN, path, "%s", cur.why.msg);
        return loom_err_hint(err, "%s",
                             cur.why.hint[0] ? cur.why.hint
                                             : "rename the provider, or remove one of the "
                                               "two plugins");
    }
    if (rc) {
        if (ie.msg[0])
            loom_err_set(err, LOOM_EPLUGIN, path, "init failed: %s", ie.msg);
        else
            loom_err_set(err, LOOM_EPLUGIN, path, "plugin \"%s\"'s init returned failure (%d) without a message", p->name,
                         rc);
        if (ie.hint[0]) loom_err_hint(err, "%s", ie.hint);
        return LOOM_EPLUGIN;
    }
    for (int i = 0; i < cur.n; i++) {
        pending *q = &cur.p[i];
        rc = q->kind == LOOM_REG_STRATEGY           ? loom_register_strategy_from(q->vtable, path, err)
             : q->kind == LOOM_REG_CROSS_DEVICE_OPS ? loom_register_cross_device_ops_from(q->vtable, path, err)
                                                    : loom_registry_add(q->kind, q->name, q->vtable, path, err);
        if (rc) return rc; /* only a full registry can fail here: host.c checked the rest */
        if (q->kind == LOOM_REG_STRATEGY && q->options && n_strategy_options < MAX_STRATEGY_OPTIONS)
            strategy_options[n_strategy_options].strategy = q->name,
            strategy_options[n_strategy_options++].options = q->options;
        if (rec->n_providers < (int)(sizeof rec->provider / sizeof rec->provider[0]))
            rec->provider[rec->n_providers++] = (loom_plugin_provider){q->kind, q->name};
    }
    return LOOM_OK;
}

static int load_checked(const char *path, loom_plugin_record *rec, loom_err *err)
{
    int rc = loom_plugin_elf_check_(path, "loom_plugin_entry", err);
    if (rc) return rc;
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) return loom_err_set(err, LOOM_EPLUGIN, path, "cannot load: %s", dlerror());
    const loom_plugin *(*entry)(void);
    *(void **)&entry = dlsym(h, "loom_plugin_entry");
    if (!entry) {
        dlclose(h);
        loom_err_set(err, LOOM_EPLUGIN, path, "no loom_plugin_entry function: not a Loom plugin");
        return loom_err_hint(err,
                             "a plugin defines `const loom_plugin *loom_plugin_entry(void)` (plugins/loom_plugin.h)");
    }
    const loom_plugin *p = entry();
    if (!p) {
        rc = loom_err_set(err, LOOM_EPLUGIN, path, "loom_plugin_entry() returned NULL");
    } else if (p->abi != LOOM_PLUGIN_ABI_VERSION) { /* read nothing else of p: its layout may differ */
        loom_err_set(err, LOOM_EPLUGIN, path, "built for plugin ABI %u, this loom speaks %u", p->abi,
                     LOOM_PLUGIN_ABI_VERSION);
        rc = loom_err_hint(err, "rebuild it against the loom_plugin.h of this loom");
    } else if (!(rc = check_entry(path, p, err))) {
        snprintf(rec->name, sizeof rec->name, "%s", p->name);
        snprintf(rec->version, sizeof rec->version, "%s", p->version ? p->version : "");
        snprintf(rec->description, sizeof rec->description, "%s", p->description ? p->description : "");
        rc = run_init(path, p, rec, err);
    }
    if (rc) dlclose(h); /* loaded plugins stay: their vtables are in the registry */
    return rc;
}

int loom_plugin_load_file(const char *path, const loom_plugin_record **out, loom_err *err)
{
    if (out) *out = NULL;
    char real[PATH_MAX];
    if (!realpath(path, real)) snprintf(real, sizeof real, "%s", path);
    for (int i = 0; i < n_records; i++)
        if (!strcmp(real_paths[i], real)) {
            if (out) *out = &records[i];
            if (!records[i].loaded && err) *err = records[i].why;
            return records[i].loaded ? LOOM_OK : LOOM_EPLUGIN;
        }
    if (n_records == LOOM_MAX_PLUGINS)
        return loom_err_set(err, LOOM_EPLUGIN, path, "too many plugin files (at most %d)", LOOM_MAX_PLUGINS);
    int rc = loom_distribute_init(err); /* built-ins first: their names are taken */
    if (!rc) rc = loom_data_init(err);
    if (rc) return rc;
    loom_plugin_record *rec = &records[n_records];
    memset(rec, 0, sizeof *rec);
    snprintf(rec->path, sizeof rec->path, "%s", path);
    snprintf(real_paths[n_records], sizeof real_paths[n_records], "%s", real);
    n_records++;
    loom_err e = {0};
    rc = load_checked(path, rec, &e);
    rec->loaded = rc == LOOM_OK;
    if (rc) {
        rec->n_providers = 0;
        rec->why = e;
        if (err) *err = e;
    }
    if (out) *out = rec;
    return rc ? LOOM_EPLUGIN : LOOM_OK;
}

/* ---- directories ---------------------------------------------------------------- */

static void add_dir(const char *dir)
{
    if (!dir[0] || n_dirs == MAX_DIRS) return;
    for (int i = 0; i < n_dirs; i++)
        if (!strcmp(dirs[i], dir)) return;
    snprintf(dirs[n_dirs++], LOOM_PATH_MAX, "%s", dir);
}

static int name_cmp(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Every *.so of dir, sorted; a missing directory has none. */
static void load_dir(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) return;
    char *names[LOOM_MAX_PLUGINS];
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < LOOM_MAX_PLUGINS) {
        size_t l = strlen(e->d_name);
        if (l > 3 && !strcmp(e->d_name + l - 3, ".so") && (names[n] = loom_strdup(e->d_name))) n++;
    }
    closedir(d);
    qsort(names, (size_t)n, sizeof names[0], name_cmp);
    for (int i = 0; i < n; i++) {
        char path[LOOM_PATH_MAX];
        struct stat st;
        if (snprintf(path, sizeof path, "%s/%s", dir, names[i]) < (int)sizeof path && stat(path, &st) == 0 &&
            S_ISREG(st.st_mode)) {
            const loom_plugin_record *rec;
            loom_err err = {0};
            if (loom_plugin_load_file(path, &rec, &err) && rec && !rec->loaded)
                loom_warn("plugin refused: %s: %s", err.where, err.msg);
        }
        loom_free(names[i]);
    }
}

/* plugins/ next to the binary: build/plugins in the build tree. */
static void exe_plugin_dir(char *out, size_t n)
{
    char exe[PATH_MAX];
    out[0] = 0;
    ssize_t l = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (l <= 0) return;
    exe[l] = 0;
    char *slash = strrchr(exe, '/');
    if (!slash) return;
    *slash = 0;
    if (strlen(exe) + sizeof "/plugins" <= n) snprintf(out, n, "%.*s/plugins", (int)(n - sizeof "/plugins"), exe);
}

/* ---- loading everything once, then the require check ------------------------------- */

static const loom_plugin_record *find_loaded(const char *name)
{
    for (int i = 0; i < n_records; i++)
        if (records[i].loaded && !strcmp(records[i].name, name)) return &records[i];
    return NULL;
}

static const loom_plugin_record *find_refused(const char *name)
{
    for (int i = 0; i < n_records; i++)
        if (!records[i].loaded && !strcmp(records[i].name, name)) return &records[i];
    return NULL;
}

static int check_required(const loom_spec *spec, loom_err *err)
{
    const loom_plugins_spec *ps = &spec->plugins;
    for (int i = 0; i < ps->n_require; i++) {
        const char *name = ps->require[i];
        if (find_loaded(name)) continue;
        char where[LOOM_PATH_MAX + 16];
        snprintf(where, sizeof where, ps->require_line[i] > 0 ? "%s:%d" : "%s", ps->loc.file, ps->require_line[i]);
        const loom_plugin_record *r = find_refused(name);
        if (r) {
            loom_err_set(err, LOOM_ECONFIG, where, "plugins.require: plugin \"%s\" was refused: %s: %s", name,
                         r->why.where, r->why.msg);
            return r->why.hint[0] ? loom_err_hint(err, "%s", r->why.hint) : LOOM_ECONFIG;
        }
        char list[1024];
        size_t k = 0;
        list[0] = 0;
        for (int d = 0; d < n_dirs && k < sizeof list; d++) {
            int w = snprintf(list + k, sizeof list - k, "%s%s", d ? ", " : "", dirs[d]);
            if (w > 0) k += (size_t)w;
        }
        loom_err_set(err, LOOM_ECONFIG, where, "plugins.require: plugin \"%s\" is not loaded (searched: %s)", name,
                     list);
        return loom_err_hint(err, "put its .so in one of those directories, or add its directory to plugins.path; "
                                  "`loom plugins` lists what loaded and what was refused");
    }
    return LOOM_OK;
}

int loom_plugins_load(const loom_spec *spec, loom_err *err)
{
    if (!loaded_once) {
        loaded_once = true;
        int rc = loom_distribute_init(err);
        if (!rc) rc = loom_data_init(err);
        if (rc) return rc;
        char exe_dir[LOOM_PATH_MAX];
        struct stat st;
        exe_plugin_dir(exe_dir, sizeof exe_dir);
        /* an installed loom has no plugins/ beside it: the shipped ones are in <libdir>/loom/plugins */
        add_dir(stat(exe_dir, &st) == 0 && S_ISDIR(st.st_mode) ? exe_dir : LOOM_PLUGIN_INSTALL_DIR);
        for (int i = 0; spec && i < spec->plugins.n_path; i++) add_dir(spec->plugins.path[i]);
        const char *env = getenv("LOOM_PLUGIN_PATH");
        while (env && *env) {
            const char *colon = strchr(env, ':');
            size_t l = colon ? (size_t)(colon - env) : strlen(env);
            char dir[LOOM_PATH_MAX];
            if (l < sizeof dir) {
                memcpy(dir, env, l);
                dir[l] = 0;
                add_dir(dir);
            }
            env = colon ? colon + 1 : NULL;
        }
        for (int i = 0; i < n_dirs; i++) load_dir(dirs[i]);
    }
    return spec ? check_required(spec, err) : LOOM_OK;
}

const loom_plugin_record *loom_plugin_record_at(int i) { return i >= 0 && i < n_records ? &records[i] : NULL; }
const char *loom_plugin_dir_at(int i) { return i >= 0 && i < n_dirs ? dirs[i] : NULL; }

const char *const *loom_plugin_strategy_options(const char *strategy)
{
    for (int i = 0; i < n_strategy_options; i++)
        if (!strcmp(strategy_options[i].strategy, strategy)) return strategy_options[i].options;
    return NULL;
}

/* ---- the names a config gives providers ------------------------------------------ */

static loom_err *add_err(loom_errlist *errs) { return errs->n < LOOM_MAX_ERRORS ? &errs->e[errs->n++] : NULL; }

/* The registered name of kind closest to s (edit distance <= 2), or NULL. */
static const char *closest(loom_reg_kind kind, const char *s)
{
    const char *best = NULL, *name;
    int bd = 3;
    const void *p;
    for (int i = 0; loom_registry_entry(kind, i, &name, &p, NULL) == 0; i++) {
        if (kind == LOOM_REG_TRANSFORM && loom_data_transform_builtin(p)) continue; /* not a provider */
        int d = loom_edit_distance(s, name);
        if (d < bd && d < (int)strlen(s)) bd = d, best = name;
    }
    return best;
}

static void unknown_name(loom_errlist *errs, const char *where, loom_reg_kind kind, const char *setting,
                         const char *name)
{
    loom_err *e = add_err(errs);
    if (!e) return;
    char names[512];
    /* the transforms' entries: only the element-map providers are named by `plugin` */
    if (kind == LOOM_REG_TRANSFORM) loom_data_providers(names, sizeof names);
    else loom_registry_names(kind, names, sizeof names);
    if (kind == LOOM_REG_TRANSFORM && loom_registry_find(kind, name, NULL)) {
        loom_err_set(e, LOOM_ECONFIG, where, "%s: \"%s\" is a built-in transform or map fn, not a transform provider "
                     "(available: %s)", setting, name, names);
        loom_err_hint(e, "a built-in is used as a transform's type or a map's fn; `plugin` names a plugin's provider, "
                         "\"provider:function\"");
        return;
    }
    loom_err_set(e, LOOM_ECONFIG, where, "%s: unknown %s \"%s\" (available: %s)", setting, loom_reg_kind_name(kind),
                 name, names);
    const char *near = closest(kind, name);
    if (near)
        loom_err_hint(e, "did you mean \"%s\"?", near);
    else
        loom_err_hint(e,
                      "a plugin's %s is available once its .so is in plugins/ or a plugins.path directory "
                      "(`loom plugins` lists them)",
                      loom_reg_kind_name(kind));
}

static void check_options(const loom_strategy_spec *st, loom_errlist *errs)
{
    const char *const *valid = loom_plugin_strategy_options(st->name);
    for (int i = 0; i < st->n_options; i++) {
        const char *key = st->option_key[i];
        bool ok = false;
        for (int j = 0; valid && valid[j] && !ok; j++) ok = !strcmp(valid[j], key);
        if (ok) continue;
        loom_err *e = add_err(errs);
        if (!e) return;
        char where[LOOM_PATH_MAX + 80], list[512] = "none";
        if (st->option_line[i] > 0)
            snprintf(where, sizeof where, "%s:%d", st->loc.file, st->option_line[i]);
        else
            snprintf(where, sizeof where, "--set strategy.options.%s", key);
        size_t k = 0;
        const char *near = NULL;
        int bd = 3;
        for (int j = 0; valid && valid[j] && k < sizeof list; j++) {
            int w = snprintf(list + k, sizeof list - k, "%s%s", j ? ", " : "", valid[j]);
            if (w > 0) k += (size_t)w;
            int d = loom_edit_distance(key, valid[j]);
            if (d < bd && d < (int)strlen(key)) bd = d, near = valid[j];
        }
        loom_err_set(e, LOOM_ECONFIG, where, "strategy.options.%s: unknown option of strategy \"%s\" (valid: %s)", key,
                     st->name, list);
        if (near) loom_err_hint(e, "did you mean `%s`?", near);
    }
}

/* A dataset's plugin source type and plugin transform providers (what
 * config.c kept as text) against the registry. */
static void check_dataset(const loom_dataset_spec *d, const char *setting, loom_errlist *errs)
{
    char where[LOOM_PATH_MAX + 16], what[160];
    if (!d->present) return;
    if (d->source.kind == LOOM_SRC_PLUGIN && !loom_registry_find(LOOM_REG_SOURCE, d->source.plugin.name, NULL)) {
        loom_loc_str(&d->source.loc, where, sizeof where);
        snprintf(what, sizeof what, "%s.source.type", setting);
        unknown_name(errs, where, LOOM_REG_SOURCE, what, d->source.plugin.name); /* built-ins and plugins' alike */
    }
    for (int i = 0; i < d->n_transforms; i++) {
        const loom_transform_spec *t = &d->transform[i];
        bool custom = (t->kind == LOOM_T_MAP && t->map.kind == LOOM_MAP_LUA) ||
                      (t->kind == LOOM_T_FILTER && t->filter == LOOM_FILTER_LUA);
        const void *p = custom && t->map.provider[0] ? loom_registry_find(LOOM_REG_TRANSFORM, t->map.provider, NULL) : NULL;
        if (!custom || !t->map.provider[0] || (p && !loom_data_transform_builtin(p))) continue;
        loom_loc_str(&t->loc, where, sizeof where);
        snprintf(what, sizeof what, "%s.transforms.[%d].plugin", setting, i);
        unknown_name(errs, where, LOOM_REG_TRANSFORM, what, t->map.provider);
    }
}

/* A model layer's type that is neither built in nor a loaded plugin's: the
 * config's "unknown value" message, listing both, with the nearest name. */
static void unknown_layer(loom_errlist *errs, const loom_layer_spec *l, int i)
{
    loom_err *e = add_err(errs);
    if (!e) return;
    char where[LOOM_PATH_MAX + 16], list[1024], names[512];
    size_t k = 0;
    const char *near = NULL;
    int bd = 3;
    for (int t = 0; t < (int)LOOM_LAYER_PLUGIN && k < sizeof list; t++) {
        const char *nm = loom_layer_kind_name((loom_layer_kind)t);
        int w = snprintf(list + k, sizeof list - k, "%s%s", t ? ", " : "", nm);
        if (w > 0) k += (size_t)w;
        int d = loom_edit_distance(l->plugin, nm);
        if (d < bd && d < (int)strlen(l->plugin)) bd = d, near = nm;
    }
    loom_registry_names(LOOM_REG_LAYER, names, sizeof names);
    const char *pl = closest(LOOM_REG_LAYER, l->plugin);
    loom_err_set(e, LOOM_ECONFIG, loom_loc_str(&l->loc, where, sizeof where),
                 "model.layers.[%d].type: unknown value \"%s\" (plugins' layers: %s; expected one of: %s)", i,
                 l->plugin, names[0] ? names : "none loaded", list); /* the plugins' first: the list may be cut */
    if (pl || near) loom_err_hint(e, "did you mean \"%s\"?", near ? near : pl);
}

int loom_plugins_check_spec(const loom_spec *spec, loom_errlist *errs)
{
    int before = errs->n;
    check_dataset(&spec->train, "data.train", errs);
    check_dataset(&spec->eval, "data.eval", errs);
    for (int i = 0; i < spec->model.n_layers; i++) { /* a layer type no built-in has: a plugin's */
        const loom_layer_spec *l = &spec->model.layer[i];
        if (l->kind != LOOM_LAYER_PLUGIN || loom_layer_plugin_find(l->plugin, NULL)) continue;
        unknown_layer(errs, l, i);
    }
    const loom_strategy_spec *st = &spec->strategy;
    char where[LOOM_PATH_MAX + 16];
    loom_loc_str(&st->loc, where, sizeof where);
    /* a built-in strategy's name, options and op were checked by the config;
     * any other name is a plugin's, known only now (the registry tells which) */
    const loom_strategy_ops *ops = loom_find_strategy(st->name);
    if (!loom_strategy_builtin(ops)) {
        if (!ops)
            unknown_name(errs, where, LOOM_REG_STRATEGY, "strategy.type", st->name);
        else
            check_options(st, errs);
        if (strcmp(st->cross_device_ops, "auto") && !loom_find_cross_device_ops(st->cross_device_ops))
            unknown_name(errs, where, LOOM_REG_CROSS_DEVICE_OPS, "strategy.cross_device_ops", st->cross_device_ops);
    }
    return errs->n > before ? LOOM_ECONFIG : LOOM_OK;
}

/* ---- `loom plugins` ----------------------------------------------------------------- */

void loom_plugins_report(FILE *f)
{
    fprintf(f, "provider kinds a plugin may register (plugin ABI %d):", LOOM_PLUGIN_ABI_VERSION);
    for (int k = 0; k < LOOM_REG_KINDS; k++) fprintf(f, "%s %s", k ? "," : "", loom_reg_kind_name((loom_reg_kind)k));
    fprintf(f, "\nplugin directories (in search order):\n");
    for (int i = 0; i < n_dirs; i++) {
        struct stat st;
        fprintf(f, "  %s%s\n", dirs[i], stat(dirs[i], &st) == 0 && S_ISDIR(st.st_mode) ? "" : "  (absent)");
    }
    int loaded = 0, refused = 0;
    for (int i = 0; i < n_records; i++) records[i].loaded ? loaded++ : refused++;
    fprintf(f, "loaded: %d\n", loaded);
    for (int i = 0; i < n_records; i++) {
        const loom_plugin_record *r = &records[i];
        if (!r->loaded) continue;
        fprintf(f, "  %s %s  %s\n", r->name, r->version, r->path);
        if (r->description[0]) fprintf(f, "    %s\n", r->description);
        for (int j = 0; j < r->n_providers; j++) {
            fprintf(f, "    provides %s \"%s\"", loom_reg_kind_name(r->provider[j].kind), r->provider[j].name);
            const loom_cross_device_ops *x = r->provider[j].kind == LOOM_REG_CROSS_DEVICE_OPS
                                                 ? loom_find_cross_device_ops(r->provider[j].name) : NULL;
            unsigned m = x ? loom_xops_memory(x) : 0;
            if (x) fprintf(f, " (%s)", m & LOOM_XOPS_DEVICE_MEM ? m & LOOM_XOPS_HOST_MEM ? "host or GPU memory"
                                                                                          : "GPU memory only"
                                                                : "host memory");
            if (x && loom_xops_job(x))
                fprintf(f, "%s", x->all_reduce ? " (also across processes: strategy.communication)"
                                               : " (across processes only: strategy.communication)");
            fputc('\n', f);
        }
    }
    fprintf(f, "refused: %d\n", refused);
    for (int i = 0; i < n_records; i++) {
        const loom_plugin_record *r = &records[i];
        if (r->loaded) continue;
        fprintf(f, "  %s: %s\n", r->why.where, r->why.msg);
        if (r->why.hint[0]) fprintf(f, "    hint: %s\n", r->why.hint);
    }
    fprintf(f, "built in:\n");
    for (int k = 0; k < LOOM_REG_KINDS; k++) {
        const char *name, *origin;
        const void *p;
        for (int i = 0; loom_registry_entry((loom_reg_kind)k, i, &name, &p, &origin) == 0; i++) {
            if (strcmp(origin, "built-in")) continue;
            loom_xform_entry x = k == LOOM_REG_TRANSFORM ? loom_data_transform_entry(p) : LOOM_XFORM_PROVIDER;
            fprintf(f, "  %s \"%s\"%s\n", loom_reg_kind_name((loom_reg_kind)k), name,
                    x == LOOM_XFORM_BUILTIN ? " (op)" : x == LOOM_XFORM_MAP_FN ? " (map fn)" : "");
        }
    }
}
