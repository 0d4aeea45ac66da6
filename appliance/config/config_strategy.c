/* config_strategy.c - the strategy section: devices and replicas, the
 * parameter-server settings (partitioner, sync), plugin strategies, and the
 * check of the global batch against the replicas.
 * Threads: none. */
#include "config/config_internal.h"

#include <string.h>

static void parse_strategy_options(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_strategy_devices(cfg_ctx *c, const config_setting_t *s, void *base);
static void check_compression(cfg_ctx *c, const config_setting_t *g, loom_strategy_spec *st);

#define STRAT_MWM K(LOOM_STRAT_MULTI_WORKER_MIRRORED)
#define STRAT_REPLICATED (K(LOOM_STRAT_MIRRORED) | K(LOOM_STRAT_CENTRAL_STORAGE) | K(LOOM_STRAT_PLUGIN) | \
                          K(LOOM_STRAT_MULTI_WORKER_MIRRORED))
/* Strategies whose replicas are local devices (multi_worker_mirrored: each worker's). */
#define STRAT_LOCAL_DEVICES (K(LOOM_STRAT_MIRRORED) | K(LOOM_STRAT_CENTRAL_STORAGE) | K(LOOM_STRAT_MULTI_WORKER_MIRRORED))
static const cfg_opt strategy_opts[] = {
    O_KIND(loom_strategy_spec, "type", kind, LOOM_STRAT_ONE_DEVICE, loom_strategy_names_, 0, "strategy"),
    O_INT(loom_strategy_spec, "replicas", replicas, 1, 1, 64, STRAT_REPLICATED, 0,
          "replicas cpu:0..cpu:N-1; mirrored, central_storage: default one per core"),
    O_CUSTOM("devices", parse_strategy_devices, STRAT_LOCAL_DEVICES, 0,
             "[\"cpu:0\", \"cpu:1\"], one replica each; or [\"gpu:*\"]"),
    O_STR(loom_strategy_spec, "cross_device_ops", cross_device_ops, "reduce_to_one_device", NULL,
          STRAT_REPLICATED, 0, "cross-device op by name, built in or from a plugin"),
    O_INT(loom_strategy_spec, "bytes_per_pack", bytes_per_pack, 0, 0, INT64_MAX, K(LOOM_STRAT_MIRRORED) | STRAT_MWM, 0,
          "all-reduce gradients in packs of at least N bytes, last layers first; 0 = one pack"),
    O_INT(loom_strategy_spec, "num_packs", num_packs, 1, 0, 4096, K(LOOM_STRAT_MIRRORED) | STRAT_MWM, 0,
          "all-reduce gradients in N equal packs; 0 = one per parameter tensor"),
    O_F64(loom_strategy_spec, "collective_timeout", collective_timeout, 0, 0.0, 0, F_NO_HI, STRAT_LOCAL_DEVICES, 0,
          "seconds a replica waits in a collective before the step fails with a stall report; 0 = forever"),
    O_ENUM(loom_strategy_spec, "communication", communication, LOOM_COMM_AUTO, loom_communication_names_, STRAT_MWM, 0,
           "how gradients cross workers: \"ring\" (the cluster transport), \"nccl\", \"mpi\" (plugins), \"auto\" (ring on CPU)"),
    O_ENUM(loom_strategy_spec, "compression", compression, LOOM_COMPRESS_NONE, loom_grad_compression_names_, STRAT_MWM, 0,
           "gradients across workers as \"bf16\" or \"fp16\" (half the bytes, summed in float32 at each hop); \"none\""),
    O_BOOL(loom_strategy_spec, "compression_error_feedback", compression_error_feedback, 0, STRAT_MWM,
           "with compression: add each worker's rounding error to its next step's gradients"),
    O_CUSTOM("options", parse_strategy_options, K(LOOM_STRAT_PLUGIN), 0,
             "a plugin strategy's own settings: KEY = value; ..."),
    {.name = "variable_partitioner", .type = OT_SUB, .applies = K(LOOM_STRAT_PARAMETER_SERVER),
     .help = "split variables along axis 0 over the ps tasks: type = \"fixed\" | \"min_size\" | \"max_size\""},
    {.name = "sync", .type = OT_SUB, .applies = K(LOOM_STRAT_PARAMETER_SERVER),
     .help = "synchronous updates: replicas_to_aggregate = N; total_replicas = M"},
    {.name = "elastic", .type = OT_SUB, .applies = STRAT_MWM,
     .help = "survivors go on when a worker is lost: min_workers = N; max_workers = M"},
    O_STR(loom_strategy_spec, "device", device, "cpu:0", NULL, K(LOOM_STRAT_ONE_DEVICE), 0, "\"cpu:0\" or \"gpu:N\""),
    O_STR(loom_strategy_spec, "device_backend", device_backend, "", NULL,
          K(LOOM_STRAT_ONE_DEVICE) | STRAT_LOCAL_DEVICES, 0,
          "device backend running the replicas: \"\" native (cuda for gpu), \"cpu\" the reference, a plugin's"),
    O_END,
};

#define PART(k) K(LOOM_PARTITIONER_##k)
static const cfg_opt partitioner_opts[] = {
    O_KIND(loom_partitioner_spec, "type", kind, 0, loom_partitioner_names_, ALL, "partitioner"),
    O_INT(loom_partitioner_spec, "num_shards", num_shards, 0, 1, 1 << 20, PART(FIXED), PART(FIXED),
          "shards per variable (at most its rows)"),
    O_INT(loom_partitioner_spec, "min_shard_bytes", min_shard_bytes, 256 << 10, 1, INT64_MAX, PART(MIN_SIZE), 0,
          "smallest shard in bytes (default 256 KiB)"),
    O_INT(loom_partitioner_spec, "max_shard_bytes", max_shard_bytes, 0, 1, INT64_MAX, PART(MAX_SIZE), PART(MAX_SIZE),
          "largest shard in bytes"),
    O_INT(loom_partitioner_spec, "max_shards", max_shards, 0, 0, 1 << 20, PART(MIN_SIZE) | PART(MAX_SIZE), 0,
          "at most this many shards (min_size: default 1; max_size: 0 = no cap)"),
    O_END,
};

static const cfg_opt ps_sync_opts[] = {
    O_INT(loom_ps_sync_spec, "replicas_to_aggregate", replicas_to_aggregate, 0, 1, 4096, ALL, ALL,
          "gradients aggregated per step (the first N to arrive)"),
    O_INT(loom_ps_sync_spec, "total_replicas", total_replicas, 0, 0, 4096, ALL, 0,
          "workers taking part (M - N are backups); 0 = the number of workers"),
    O_END,
};

static const cfg_opt elastic_opts[] = {
    O_INT(loom_elastic_spec, "min_workers", min_workers, 1, 1, 4096, ALL, 0,
          "fewest workers the job trains with; below it the job stops with a checkpoint"),
    O_INT(loom_elastic_spec, "max_workers", max_workers, 0, 0, 4096, ALL, 0,
          "most workers the job trains with; 0 = the cluster's training tasks"),
    O_F64(loom_elastic_spec, "wait_timeout", wait_timeout, 60, 0.0, 0, F_NO_HI, ALL, 0,
          "below min_workers: seconds the job waits for workers to join before it stops with a checkpoint"),
    O_F64(loom_elastic_spec, "start_timeout", start_timeout, 10, 0.0, 0, F_NO_HI, ALL, 0,
          "seconds the start waits for every listed task; then the job starts with those connected (at least "
          "min_workers) and the others join when they come"),
    O_END,
};

/* strategy.elastic (multi_worker_mirrored). */
static void parse_elastic(cfg_ctx *c, const config_setting_t *g, loom_strategy_spec *st)
{
    loom_elastic_spec *el = &st->elastic;
    const config_setting_t *eg = config_setting_get_member(g, "elastic");
    if (!eg) return;
    if (!config_setting_is_group(eg)) {
        cfg_err_(c, eg, "expected a group { min_workers = 2; max_workers = 3; }");
        return;
    }
    el->enabled = true;
    cfg_loc_of_(c, eg, &el->loc);
    cfg_parse_opts_(c, eg, elastic_opts, 0, el);
    cfg_scope sc = {elastic_opts, 0, NULL};
    cfg_check_keys_(c, eg, &sc, 1);
    if (el->max_workers > 0 && el->min_workers > el->max_workers) {
        loom_err *e = cfg_err_(c, config_setting_get_member(eg, "min_workers"), "min_workers = %d is more than "
                               "max_workers = %d", el->min_workers, el->max_workers);
        if (e) loom_err_hint(e, "min_workers is the fewest workers the job trains with: at most max_workers");
    }
}

/* A strategy type that is not built in names a plugin's strategy: kept as
 * text (kind LOOM_STRAT_PLUGIN) and found in the registry once plugins are
 * loaded, where an unknown name is reported. Returns the kind, or -1 when t
 * is absent, not a string, or a built-in name (cfg_parse_kind_ handles those). */
static int plugin_strategy_type(cfg_ctx *c, const config_setting_t *t, loom_strategy_spec *st)
{
    if (!t || config_setting_type(t) != CONFIG_TYPE_STRING) return -1;
    const char *name = config_setting_get_string(t);
    if (cfg_find_name_(loom_strategy_names_, name) >= 0) return -1;
    if (!name[0] || strlen(name) >= sizeof st->name)
        cfg_err_(c, t, "bad strategy name \"%s\" (empty or longer than %zu characters)", name, sizeof st->name - 1);
    snprintf(st->name, sizeof st->name, "%s", name);
    st->kind = LOOM_STRAT_PLUGIN;
    return LOOM_STRAT_PLUGIN;
}

/* strategy.options: scalars only, each kept as text for the plugin. */
static void parse_strategy_options(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_strategy_spec *st = base;
    char v[300];
    if (!config_setting_is_group(s)) {
        cfg_err_(c, s, "expected a group { KEY = value; ... }, got %s", cfg_value_str_(s, v, sizeof v));
        return;
    }
    int n = config_setting_length(s);
    if (n > LOOM_MAX_STRATEGY_OPTIONS) {
        cfg_err_(c, s, "too many options: %d (at most %d)", n, LOOM_MAX_STRATEGY_OPTIONS);
        return;
    }
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = config_setting_get_elem(s, i);
        const char *key = config_setting_name(e);
        int type = config_setting_type(e);
        if (config_setting_is_aggregate(e)) {
            cfg_err_(c, e, "expected a number, a string or true/false, got %s", cfg_value_str_(e, v, sizeof v));
            continue;
        }
        if (type == CONFIG_TYPE_STRING)
            snprintf(v, sizeof v, "%s", config_setting_get_string(e));
        else
            cfg_value_str_(e, v, sizeof v);
        if (strlen(key) >= LOOM_NAME_MAX || strlen(v) >= LOOM_NAME_MAX) {
            cfg_err_(c, e, "key or value too long (at most %d characters each)", LOOM_NAME_MAX - 1);
            continue;
        }
        int k = st->n_options++;
        snprintf(st->option_key[k], sizeof st->option_key[k], "%s", key);
        snprintf(st->option_value[k], sizeof st->option_value[k], "%s", v);
        char where[300];
        cfg_where_of_(c, e, where, sizeof where, &st->option_line[k]);
    }
}

/* strategy.devices = ["cpu:0", "cpu:1"] or ["gpu:*"]: the syntax and
 * distinctness here; whether each exists is known only at strategy open. */
static void parse_strategy_devices(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_strategy_spec *st = base;
    char v[300];
    cfg_loc_of_(c, s, &st->devices_loc);
    if (!config_setting_is_array(s) && !config_setting_is_list(s)) {
        cfg_err_(c, s, "expected a list of devices [\"cpu:0\", \"cpu:1\"], got %s", cfg_value_str_(s, v, sizeof v));
        return;
    }
    int n = config_setting_length(s);
    if (n < 1 || n > LOOM_MAX_DEVICES) {
        cfg_err_(c, s, "expected 1 to %d devices, got %d", LOOM_MAX_DEVICES, n);
        return;
    }
    int cpus = 0;
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = config_setting_get_elem(s, i);
        const char *d = config_setting_type(e) == CONFIG_TYPE_STRING ? config_setting_get_string(e) : NULL;
        unsigned idx;
        char kind[4], tail;
        bool ok = d && strlen(d) < sizeof st->devices[0] &&
                  (!strcmp(d, "gpu:*") || (sscanf(d, "%3[a-z]:%u%c", kind, &idx, &tail) == 2 &&
                                           (!strcmp(kind, "cpu") || !strcmp(kind, "gpu"))));
        if (!ok) {
            loom_err *er = cfg_err_(c, e, "unknown device %s (expected \"cpu:N\", \"gpu:N\" or \"gpu:*\")",
                                cfg_value_str_(e, v, sizeof v));
            if (er) loom_err_hint(er, "cpu:N is replica N on the host's cores, e.g. devices = [\"cpu:0\", \"cpu:1\"];");
            return;
        }
        for (int j = 0; j < i; j++)
            if (!strcmp(st->devices[j], d)) {
                cfg_err_(c, e, "device \"%s\" is listed twice", d);
                return;
            }
        if (!strcmp(d, "gpu:*") && n > 1) {
            cfg_err_(c, e, "\"gpu:*\" (every GPU) must be the only device");
            return;
        }
        cpus += d[0] == 'c';
        snprintf(st->devices[i], sizeof st->devices[i], "%s", d);
    }
    if (cpus && cpus < n) {
        cfg_err_(c, s, "devices mix cpu and gpu; list devices of one kind");
        return;
    }
    st->n_devices = n;
    st->devices_listed = true;
}

/* mirrored, central_storage: replicas and devices agree (either may be
 * given; neither = one replica per core, resolved at strategy open). */
static void resolve_replicas(cfg_ctx *c, const config_setting_t *g, loom_strategy_spec *st)
{
    const config_setting_t *r = config_setting_get_member(g, "replicas");
    const config_setting_t *x = config_setting_get_member(g, "cross_device_ops");
    if (x)
        cfg_loc_of_(c, x, &st->cross_device_ops_loc);
    else
        st->cross_device_ops_loc = st->loc;
    bool all_gpus = st->devices_listed && !strcmp(st->devices[0], "gpu:*");
    if (r && st->devices_listed && !all_gpus && st->replicas != st->n_devices) {
        cfg_err_(c, r, "replicas = %d but %d devices are listed; give one of the two", st->replicas, st->n_devices);
        return;
    }
    if (st->devices_listed) {
        st->replicas = all_gpus ? 0 : st->n_devices;
    } else if (r) {
        cfg_loc_of_(c, r, &st->devices_loc);
    } else {
        st->devices_loc = st->loc;
        st->replicas = 0;
    }
}

/* More replicas than the global batch would leave a replica without an
 * example in every step. */
void cfg_check_replicas_batch_(cfg_ctx *c, const config_setting_t *root, const loom_spec *spec)
{
    const loom_strategy_spec *st = &spec->strategy;
    const config_setting_t *g = config_setting_get_member(root, "strategy");
    if (!g || !config_setting_is_group(g) || st->replicas < 2 || st->kind == LOOM_STRAT_ONE_DEVICE) return;
    const config_setting_t *r = config_setting_get_member(g, st->devices_listed ? "devices" : "replicas");
    const loom_dataset_spec *d = &spec->train;
    for (int i = d->n_transforms - 1; i >= 0; i--) {
        const loom_transform_spec *t = &d->transform[i];
        if (t->kind != LOOM_T_BATCH && t->kind != LOOM_T_PADDED_BATCH) continue;
        if (t->batch_size < st->replicas) {
            loom_err *e = cfg_err_(c, r ? r : g, "%d replicas but the global batch (data.train, line %d) is %lld: each "
                               "replica needs at least one example", st->replicas, t->loc.line, (long long)t->batch_size);
            if (e)
                loom_err_hint(e, "the batch size is the global batch, split among the replicas; raise it to >= %d or "
                              "use fewer replicas", st->replicas);
        }
        return;
    }
}

/* strategy.variable_partitioner and strategy.sync (parameter_server). */
static void parse_ps_settings(cfg_ctx *c, const config_setting_t *g, loom_strategy_spec *st)
{
    loom_partitioner_spec *p = &st->partitioner;
    const config_setting_t *pg = config_setting_get_member(g, "variable_partitioner");
    if (pg && config_setting_is_group(pg)) {
        cfg_loc_of_(c, pg, &p->loc);
        int k = cfg_parse_kind_(c, pg, partitioner_opts, p);
        cfg_parse_opts_(c, pg, partitioner_opts, k, p);
        cfg_scope sc = {partitioner_opts, k, NULL};
        cfg_check_keys_(c, pg, &sc, 1);
        if (k == LOOM_PARTITIONER_MIN_SIZE && !config_setting_get_member(pg, "max_shards")) p->max_shards = 1;
    } else if (pg) {
        cfg_err_(c, pg, "expected a group { type = \"fixed\"; num_shards = 2; }");
    }
    loom_ps_sync_spec *y = &st->sync;
    const config_setting_t *yg = config_setting_get_member(g, "sync");
    if (yg && config_setting_is_group(yg)) {
        y->enabled = true;
        cfg_loc_of_(c, yg, &y->loc);
        cfg_parse_opts_(c, yg, ps_sync_opts, 0, y);
        cfg_scope sc = {ps_sync_opts, 0, NULL};
        cfg_check_keys_(c, yg, &sc, 1);
        if (y->total_replicas > 0 && y->replicas_to_aggregate > y->total_replicas) {
            loom_err *e = cfg_err_(c, config_setting_get_member(yg, "replicas_to_aggregate"),
                               "replicas_to_aggregate = %d is more than total_replicas = %d: a step could never "
                               "gather that many gradients", y->replicas_to_aggregate, y->total_replicas);
            if (e) loom_err_hint(e, "aggregate at most total_replicas gradients; total_replicas - replicas_to_aggregate "
                                    "workers are backups");
        }
    } else if (yg) {
        cfg_err_(c, yg, "expected a group { replicas_to_aggregate = 2; total_replicas = 3; }");
    }
}

void cfg_parse_strategy_(cfg_ctx *c, const config_setting_t *root, loom_strategy_spec *st)
{
    const config_setting_t *g = cfg_sub_group_(c, root, "strategy");
    if (!g) {
        for (const cfg_opt *o = strategy_opts; o->name; o++)
            if (cfg_applies_(o, (int)strategy_opts[0].idef)) cfg_opt_default_(o, st);
        snprintf(st->loc.file, sizeof st->loc.file, "%s", c->path);
        snprintf(st->loc.path, sizeof st->loc.path, "strategy");
    } else {
        cfg_loc_of_(c, g, &st->loc);
        const config_setting_t *t = config_setting_get_member(g, "type");
        int k = plugin_strategy_type(c, t, st);
        if (k < 0) k = cfg_parse_kind_(c, g, strategy_opts, st);
        cfg_parse_opts_(c, g, strategy_opts, k, st);
        cfg_scope sc = {strategy_opts, k, NULL};
        cfg_check_keys_(c, g, &sc, 1);
        if (k == LOOM_STRAT_PARAMETER_SERVER) parse_ps_settings(c, g, st);
        if (k == LOOM_STRAT_MULTI_WORKER_MIRRORED) parse_elastic(c, g, st);
        const config_setting_t *np = config_setting_get_member(g, "num_packs");
        if (np && st->bytes_per_pack > 0 && (k == LOOM_STRAT_MIRRORED || k == LOOM_STRAT_MULTI_WORKER_MIRRORED)) {
            loom_err *e = cfg_err_(c, np, "num_packs and bytes_per_pack both set; they are two ways to pack gradients");
            if (e) loom_err_hint(e, "keep one: bytes_per_pack (packs of at least N bytes) or num_packs (N packs)");
        }
        const config_setting_t *d = config_setting_get_member(g, "device");
        unsigned idx;
        char tail;
        if (d && k == LOOM_STRAT_ONE_DEVICE && st->device[0] &&
            sscanf(st->device, "cpu:%u%c", &idx, &tail) != 1 && sscanf(st->device, "gpu:%u%c", &idx, &tail) != 1)
            cfg_err_(c, d, "unknown device \"%s\" (expected \"cpu:0\" or \"gpu:N\")", st->device);
        if (d) cfg_loc_of_(c, d, &st->device_loc);
        else st->device_loc = st->loc;
        const config_setting_t *cm = config_setting_get_member(g, "communication");
        if (cm) cfg_loc_of_(c, cm, &st->communication_loc);
        else st->communication_loc = st->loc;
        check_compression(c, g, st);
        const config_setting_t *ct = config_setting_get_member(g, "collective_timeout");
        if (ct) cfg_loc_of_(c, ct, &st->collective_timeout_loc);
        else st->collective_timeout_loc = st->loc;
        const config_setting_t *db = config_setting_get_member(g, "device_backend");
        if (db) cfg_loc_of_(c, db, &st->device_backend_loc);
        else st->device_backend_loc = st->loc;
    }
    if (g && (st->kind == LOOM_STRAT_MIRRORED || st->kind == LOOM_STRAT_CENTRAL_STORAGE ||
              st->kind == LOOM_STRAT_MULTI_WORKER_MIRRORED)) {
        resolve_replicas(c, g, st);
        /* multi_worker_mirrored: one replica per worker unless told (TF: one per GPU, else the CPU) */
        if (st->kind == LOOM_STRAT_MULTI_WORKER_MIRRORED && !st->devices_listed && st->replicas == 0) st->replicas = 1;
        snprintf(st->name, sizeof st->name, "%s", loom_strategy_kind_name(st->kind));
        return;
    }
    if (st->kind != LOOM_STRAT_PLUGIN) {
        st->replicas = 1;
        snprintf(st->name, sizeof st->name, "%s", loom_strategy_kind_name(st->kind));
    }
    const config_setting_t *x = g ? config_setting_get_member(g, "cross_device_ops") : NULL;
    if (x) cfg_loc_of_(c, x, &st->cross_device_ops_loc); /* a plugin strategy's, for errors at strategy open */
    st->n_devices = 1;
    snprintf(st->devices[0], sizeof st->devices[0], "%s", st->device);
}

/* compression is the ring's (the nccl and mpi plugins reduce float32), and
 * error feedback needs a compression to feed back. */
static void check_compression(cfg_ctx *c, const config_setting_t *g, loom_strategy_spec *st)
{
    const config_setting_t *cp = config_setting_get_member(g, "compression");
    const config_setting_t *ef = config_setting_get_member(g, "compression_error_feedback");
    if (cp) cfg_loc_of_(c, cp, &st->compression_loc);
    else st->compression_loc = st->loc;
    if (cp && st->compression != LOOM_COMPRESS_NONE &&
        (st->communication == LOOM_COMM_NCCL || st->communication == LOOM_COMM_MPI)) {
        loom_err *e = cfg_err_(c, cp, "compression = \"%s\" needs communication = \"ring\" (it is \"%s\")",
                               loom_grad_compression_name(st->compression), loom_communication_name(st->communication));
        if (e) loom_err_hint(e, "drop compression, or use communication = \"ring\" (or \"auto\" on CPU)");
    }
    /* compressed gradients overlap the backward pass by default: the wire
     * is what they save, so it should not wait for the whole backward (one
     * pack) nor hold up the compute after it (tests/bench/netns_allreduce_bench.sh) */
    if (st->compression != LOOM_COMPRESS_NONE && !config_setting_get_member(g, "num_packs") &&
        !config_setting_get_member(g, "bytes_per_pack"))
        st->num_packs = LOOM_COMPRESS_NUM_PACKS;
    if (ef && st->compression_error_feedback && st->compression == LOOM_COMPRESS_NONE) {
        loom_err *e = cfg_err_(c, ef, "compression_error_feedback = true without a compression");
        if (e) loom_err_hint(e, "set compression = \"bf16\" or \"fp16\", or drop compression_error_feedback");
    }
}
