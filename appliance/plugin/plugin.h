/* plugin.h - finding, loading and checking plugins (plugins/loom_plugin.h
 * is their whole ABI), and resolving the provider names a config gives.
 *
 * Dependency direction: this module sits above distribute (core ... nn,
 * data <- distribute <- plugin <- cli), not below it as the other
 * extension points do, because the ABI carries distribute's vtables
 * (cross-device ops, strategies; data's sources and transforms too) and
 * the host table hands a strategy plugin the model and optimizer functions
 * of nn. Nothing below needs to know plugins exist: the registry lives in
 * core, so distribute, data and the trainer find a plugin's provider
 * exactly as they find a built-in one.
 *
 * Threads: everything here runs on the main thread at startup. Loaded
 * plugins are never unloaded; the records below live until exit. */
#ifndef LOOM_PLUGIN_MODULE_H
#define LOOM_PLUGIN_MODULE_H

#include "distribute/distribute.h"

#include <stdio.h>

#define LOOM_MAX_PLUGINS 64

/* One provider a plugin registered. */
typedef struct loom_plugin_provider {
    loom_reg_kind kind;
    const char *name; /* the plugin's static storage */
} loom_plugin_provider;

/* One *.so that was looked at. */
typedef struct loom_plugin_record {
    char path[LOOM_PATH_MAX]; /* as found: "<dir>/<file>.so" */
    bool loaded;              /* false: refused, see why */
    char name[LOOM_NAME_MAX]; /* loaded: the plugin's declared name */
    char version[32];
    char description[160];
    int n_providers;
    loom_plugin_provider provider[16];
    loom_err why; /* refused: where = the file, msg = the reason */
} loom_plugin_record;

/* Loads, once per process, every *.so (sorted by name) of: plugins/ next to
 * the binary (build/plugins in the build tree; for an installed loom
 * without one, <libdir>/loom/plugins), the config's
 * plugins.path (spec may be NULL), then each directory of $LOOM_PLUGIN_PATH.
 * The same file reached twice loads once. A refused plugin is recorded and
 * logged as a warning and does not stop the others. Built-in providers are
 * registered first (loom_distribute_init), so a plugin cannot take their
 * names. Then every name in plugins.require must have loaded: otherwise
 * LOOM_ECONFIG naming the config's file:line and why it did not load. Later
 * calls only repeat the require check for their spec. */
int loom_plugins_load(const loom_spec *spec, loom_err *err);

/* Loads one file now (tests, and the loop above). Returns LOOM_OK or
 * LOOM_EPLUGIN; the record (refused or not) is kept either way and, when
 * rec is not NULL, *rec points at it. */
int loom_plugin_load_file(const char *path, const loom_plugin_record **rec, loom_err *err);

/* The names a config gives providers, checked against the registry once
 * plugins are loaded: strategy.type, strategy.cross_device_ops and the keys
 * of strategy.options (against what the strategy declared), a plugin
 * source's data.*.source.type and the providers of map/filter `plugin`
 * settings (a source's option keys and a function's args are checked when
 * the pipeline opens). Each problem is
 * appended to errs as "file:line: setting: message" with the known names;
 * returns LOOM_ECONFIG when there was any. */
int loom_plugins_check_spec(const loom_spec *spec, loom_errlist *errs);

/* The records in load order; NULL past the end. */
const loom_plugin_record *loom_plugin_record_at(int i);
/* The directories searched (for `loom plugins`); NULL past the end. */
const char *loom_plugin_dir_at(int i);

/* `loom plugins`: directories searched, loaded plugins with what each
 * provides, refused files with the reason, and the built-in providers. */
void loom_plugins_report(FILE *f);

/* The keys a registered strategy accepts in strategy.options (NULL-
 * terminated), NULL when it declared none or is unknown. */
const char *const *loom_plugin_strategy_options(const char *strategy);

#endif
