/* config_run.c - the run section: model_dir, epochs, steps, checkpoints,
 * summaries, the status endpoint, and the seed shuffles default to.
 * Threads: none. */
#include "config/config_internal.h"

#include <arpa/inet.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>

static const cfg_opt run_opts[] = {
    O_STR(loom_run_spec, "model_dir", model_dir, NULL, NULL, ALL, ALL, "checkpoints and metrics directory"),
    O_INT(loom_run_spec, "epochs", epochs, 1, 0, INT64_MAX, ALL, 0, "passes over data.train"),
    O_INT(loom_run_spec, "max_steps", max_steps, 0, 0, INT64_MAX, ALL, 0, "total steps; 0 = use epochs"),
    O_INT(loom_run_spec, "seed", seed, 42, 0, INT64_MAX, ALL, 0, "root of every random stream"),
    O_INT(loom_run_spec, "checkpoint_steps", checkpoint_steps, 0, 0, INT64_MAX, ALL, 0, "also every N steps"),
    O_F64(loom_run_spec, "checkpoint_secs", checkpoint_secs, 0.0, 0.0, 0, F_NO_HI, ALL, 0,
          "also when N seconds passed since the last checkpoint (0 = off)"),
    O_INT(loom_run_spec, "summary_steps", summary_steps, 100, 0, INT64_MAX, ALL, 0,
          "TensorBoard scalars every N steps (0 = no event files)"),
    O_INT(loom_run_spec, "histogram_epochs", histogram_epochs, 0, 0, INT64_MAX, ALL, 0,
          "TensorBoard histograms of every variable every N epochs (0 = off)"),
    O_INT(loom_run_spec, "keep_checkpoints", keep_checkpoints, 5, 1, INT_MAX, ALL, 0, "newest K are kept"),
    O_INT(loom_run_spec, "log_steps", log_steps, 100, 1, INT64_MAX, ALL, 0, "progress line every N steps"),
    O_INT(loom_run_spec, "threads", threads, 0, 0, 4096, ALL, 0, "compute threads; 0 = all cores"),
    O_INT(loom_run_spec, "steps_per_execution", steps_per_execution, 1, 1, 1 << 20, ALL, 0,
          "training steps per trip through the host loop (logging, checkpoints, signals)"),
    O_INT(loom_run_spec, "eval_steps", eval_steps, 0, 0, INT64_MAX, ALL, 0, "evaluate at most N batches (0 = all)"),
    O_BOOL(loom_run_spec, "eval_each_epoch", eval_each_epoch, 1, ALL, "evaluate data.eval at each epoch end"),
    O_ENUM(loom_run_spec, "progress", progress, LOOM_PROGRESS_AUTO, loom_progress_names_, ALL, 0,
           "auto, bar, plain or none"),
    O_INT(loom_run_spec, "status_port", status_port, 0, 0, 65535, ALL, 0,
          "HTTP status endpoint (/metrics, /healthz, /status) on this port while training; 0 = off"),
    O_STR(loom_run_spec, "status_bind", status_bind, "127.0.0.1", NULL, ALL, 0,
          "address of the status endpoint: an IPv4 or IPv6 literal (0.0.0.0 = every interface)"),
    O_END,
};

/* Shuffles and list_files sources without a seed of their own, also in zipped datasets, take the run's. */
static void default_seeds(loom_dataset_spec *d, uint64_t seed)
{
    if (d->source.kind == LOOM_SRC_LIST_FILES && !d->source.list_files.seed_set) d->source.list_files.seed = seed;
    for (int j = 0; j < d->n_transforms; j++) {
        loom_transform_spec *t = &d->transform[j];
        if ((t->kind == LOOM_T_SHUFFLE || t->kind == LOOM_T_SPLIT) && !t->seed_set) t->seed = seed;
        if (t->kind == LOOM_T_ZIP && t->dataset) default_seeds(t->dataset, seed);
    }
}

/* One rule for every relative path a config holds (data files, Lua files,
 * plugin directories, cluster files, and here run.model_dir and cache files):
 * relative to the config file's directory (c->dir, absolute), so a config
 * means the same wherever loom is started, and messages show where a path
 * really is. Paths on the command line (--model-dir, --output, ...) stay
 * relative to the working directory, as shells expect. */
static void absolute_in_config_dir(cfg_ctx *c, const config_setting_t *at, char *p, size_t n)
{
    if (!p[0] || p[0] == '/' || !c->dir[0]) return;
    char full[2 * LOOM_PATH_MAX + 2];
    const char *rel = p[0] == '.' && p[1] == '/' ? p + 2 : p;
    int w = snprintf(full, sizeof full, "%s/%s", c->dir, rel);
    if (w < 0 || (size_t)w >= n) {
        cfg_err_(c, at, "\"%s\" resolved against the config's directory is longer than %zu bytes", p, n - 1);
        return;
    }
    memcpy(p, loom_path_normalize(full), strlen(full) + 1); /* "configs/../runs/x" is "runs/x" */
}

static void absolute_cache_files(cfg_ctx *c, const config_setting_t *at, loom_dataset_spec *d)
{
    for (int i = 0; i < d->n_transforms; i++) {
        loom_transform_spec *t = &d->transform[i];
        if (t->kind == LOOM_T_CACHE) absolute_in_config_dir(c, at, t->cache_file, sizeof t->cache_file);
        if (t->kind == LOOM_T_ZIP && t->dataset) absolute_cache_files(c, at, t->dataset);
    }
}

/* run; read last: eval_each_epoch defaults to whether data.eval is given, and
 * shuffles without a seed of their own take the run's. */
void cfg_parse_run_(cfg_ctx *c, const config_setting_t *root, loom_spec *spec)
{
    const config_setting_t *g;
    if ((g = cfg_sub_group_(c, root, "run"))) {
        loom_run_spec *r = &spec->run;
        cfg_loc_of_(c, g, &r->loc);
        cfg_parse_opts_(c, g, run_opts, 0, r);
        cfg_scope sc = {run_opts, 0, NULL};
        cfg_check_keys_(c, g, &sc, 1);
        if (!config_setting_get_member(g, "eval_each_epoch")) r->eval_each_epoch = spec->eval.present;
        if (r->epochs < 1 && r->max_steps < 1)
            cfg_err_(c, g, "nothing to train: set epochs >= 1 or max_steps >= 1 (epochs = %lld, max_steps = %lld)",
                 (long long)r->epochs, (long long)r->max_steps);
        unsigned char ab[16];
        const config_setting_t *sb = config_setting_get_member(g, "status_bind");
        if (sb && inet_pton(AF_INET, r->status_bind, ab) != 1 && inet_pton(AF_INET6, r->status_bind, ab) != 1)
            cfg_err_(c, sb, "run.status_bind: \"%s\" is not an IPv4 or IPv6 address (a literal, not a host name)",
                 r->status_bind);
        /* shuffles without a seed of their own use the run's */
        default_seeds(&spec->train, r->seed);
        default_seeds(&spec->eval, r->seed);
        absolute_in_config_dir(c, config_setting_get_member(g, "model_dir"), r->model_dir, sizeof r->model_dir);
    }
    absolute_cache_files(c, root, &spec->train);
    absolute_cache_files(c, root, &spec->eval);
}
