/* config_data.c - the data section: data.options (deterministic, autotune,
 * static rewrites), each dataset (data.train, data.eval, and those nested by
 * zip and interleave), its transforms and the map functions.
 * The sources are in config_source.c.
 * Threads: none. */
#include "config/config_internal.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char *const split_part_names[] = {"train", "eval", NULL};

static void parse_shape(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_norm_values(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_feature_names(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_filter_values(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_padded_shapes(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_padding_values(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_parallel(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_map_plugin(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_map_args(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_filter_plugin(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_filter_args(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_prefetch_buffer(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_ram_budget(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_bucket_ints(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_vocabulary_file(cfg_ctx *c, const config_setting_t *s, void *base);

static const cfg_opt data_opts[] = {
    O_SUB("train", 0, ALL, "the training dataset"),
    O_SUB("eval", 0, 0, "the evaluation dataset"),
    O_SUB("options", 0, 0, "tf.data.Options for both datasets: deterministic, autotune, optimization"),
    O_END,
};

/* data.options and its two sub-groups */
static const cfg_opt options_opts[] = {
    O_BOOL(loom_data_options, "deterministic", deterministic, 1, ALL, "default of every map's `deterministic`"),
    O_SUB("autotune", 0, 0, "enabled, cpu_budget, ram_budget"),
    O_SUB("optimization", 0, 0, "static rewrites of the pipeline"),
    O_END,
};

static const cfg_opt autotune_opts[] = {
    O_BOOL(loom_data_options, "enabled", autotune, 1, ALL, "tune \"auto\" parallelism and buffers while running"),
    O_INT(loom_data_options, "cpu_budget", cpu_budget, 0, 0, 4096, ALL, 0, "threads for tuned parallelism; 0 = the cores"),
    O_CUSTOM("ram_budget", parse_ram_budget, ALL, 0, "bytes, \"4GiB\"-style, or \"50%\" of physical memory (default)"),
    O_END,
};

static const cfg_opt optimization_opts[] = {
    O_BOOL(loom_data_options, "noop_elimination", noop_elimination, 1, ALL,
           "drop take(-1), skip(0), repeat(1), prefetch(0), shard(1, 0)"),
    O_BOOL(loom_data_options, "map_and_batch_fusion", map_and_batch_fusion, 1, ALL, "map straight into the batch buffer"),
    O_BOOL(loom_data_options, "map_fusion", map_fusion, 1, ALL, "run consecutive maps as one stage"),
    O_BOOL(loom_data_options, "shuffle_and_repeat_fusion", shuffle_and_repeat_fusion, 1, ALL,
           "shuffle then repeat as one stage that fills from the next pass"),
    O_BOOL(loom_data_options, "map_parallelization", map_parallelization, 0, ALL,
           "run sequential maps as parallel = \"auto\" (needs autotune)"),
    O_BOOL(loom_data_options, "inject_prefetch", inject_prefetch, 1, ALL,
           "append prefetch(\"auto\") when the last transform is not a prefetch"),
    O_END,
};

static const cfg_opt dataset_opts[] = {
    O_SUB("source", 0, ALL, "where elements come from"),
    O_SUB("transforms", 0, 0, "a list of transforms applied in order"),
    O_ENUM(loom_dataset_spec, "shard_policy", shard_policy, LOOM_SHARD_AUTO, loom_shard_policy_names_, ALL, 0,
           "how each of several input pipelines takes its share: auto, file, data or off"),
    O_ENUM(loom_dataset_spec, "on_nonfinite", on_nonfinite, LOOM_NONFINITE_ERROR, loom_nonfinite_names_, ALL, 0,
           "a NaN or infinite float in a csv or idx source: error (naming the record) or skip (drop it, count it)"),
    O_END,
};

#define TR(k) K(LOOM_T_##k)
static const cfg_opt transform_opts[] = {
    O_KIND(loom_transform_spec, "op", kind, 0, loom_transform_names_, ALL, "transform op"),
    O_INT(loom_transform_spec, "buffer", buffer, 0, 1, INT64_MAX, TR(SHUFFLE), TR(SHUFFLE), "shuffle buffer"),
    O_CUSTOM("buffer", parse_prefetch_buffer, TR(PREFETCH), 0, "prefetch queue depth; \"auto\" or -1 (default), 0 disables"),
    O_INT(loom_transform_spec, "seed", seed, 0, 0, INT64_MAX, TR(SHUFFLE), 0, "shuffle seed; default run.seed"),
    O_CUSTOM("features", parse_feature_names, TR(CONCAT) | TR(SELECT), TR(CONCAT) | TR(SELECT),
             "[\"a\", \"b\", ...]: concat joins them (each flattened per example) into `output`; select keeps only them"),
    O_STR(loom_transform_spec, "output", features.output, NULL, NULL, TR(CONCAT), TR(CONCAT), "the feature concat adds"),
    O_F64(loom_transform_spec, "fraction", fraction, 0.8, 0.0, 1.0, F_LO_OPEN | F_HI_OPEN, TR(SPLIT), TR(SPLIT),
          "share of the elements in the training part, in (0, 1)"),
    O_ENUM(loom_transform_spec, "part", part, LOOM_SPLIT_TRAIN, split_part_names, TR(SPLIT), TR(SPLIT),
           "which part this pipeline keeps: train or eval"),
    O_INT(loom_transform_spec, "seed", seed, 0, 0, INT64_MAX, TR(SPLIT), 0,
          "which elements go where; default run.seed (give the same seed in data.train and data.eval)"),
    O_BOOL(loom_transform_spec, "reshuffle", reshuffle, 1, TR(SHUFFLE), "reshuffle each epoch"),
    O_INT(loom_transform_spec, "size", batch_size, 0, 1, LOOM_MAX_BATCH, TR(BATCH), TR(BATCH), "batch size"),
    O_BOOL(loom_transform_spec, "drop_remainder", drop_remainder, 0, TR(BATCH), "drop a short last batch"),
    O_INT(loom_transform_spec, "count", count, -1, -1, INT64_MAX, TR(REPEAT) | TR(TAKE) | TR(SKIP),
          TR(TAKE) | TR(SKIP), "element or repeat count; -1 = all / forever"),
    O_STR(loom_transform_spec, "feature", feature, NULL, NULL, TR(FILTER), 0, "the scalar feature tested"),
    O_STR(loom_transform_spec, "lua", map.lua, "", NULL, TR(FILTER), 0,
          "\"file.lua:function\": fn(elem, rng) returns true to keep the element (instead of feature and a predicate)"),
    O_CUSTOM("plugin", parse_filter_plugin, TR(FILTER), 0,
             "\"provider:function\": a plugin's predicate keeps the element (instead of feature and a predicate)"),
    O_CUSTOM("args", parse_filter_args, TR(FILTER), 0, "the plugin predicate's arguments: KEY = scalar, at most 8"),
    O_CUSTOM("in", parse_filter_values, TR(FILTER), 0, "keep elements whose feature is one of these values"),
    O_CUSTOM("not_in", parse_filter_values, TR(FILTER), 0, "keep elements whose feature is none of these values"),
    O_F64(loom_transform_spec, "min", min, -INFINITY, 0, 0, F_NO_LO | F_NO_HI, TR(FILTER), 0,
          "keep elements whose feature is >= min"),
    O_F64(loom_transform_spec, "max", max, INFINITY, 0, 0, F_NO_LO | F_NO_HI, TR(FILTER), 0,
          "keep elements whose feature is <= max"),
    O_INT(loom_transform_spec, "num_shards", num_shards, 1, 1, INT64_MAX, TR(SHARD), TR(SHARD), "number of shards"),
    O_INT(loom_transform_spec, "index", index, 0, 0, INT64_MAX, TR(SHARD), TR(SHARD), "this shard, < num_shards"),
    O_STR(loom_transform_spec, "feature", feature, "index", NULL, TR(ENUMERATE), 0, "name of the added int64 feature"),
    O_INT(loom_transform_spec, "start", start, 0, INT64_MIN, INT64_MAX, TR(ENUMERATE), 0, "first index"),
    O_INT(loom_transform_spec, "size", batch_size, 0, 1, LOOM_MAX_BATCH, TR(PADDED_BATCH), TR(PADDED_BATCH), "batch size"),
    O_BOOL(loom_transform_spec, "drop_remainder", drop_remainder, 0, TR(PADDED_BATCH) | TR(BUCKET),
           "drop a short last batch"),
    O_STR(loom_transform_spec, "mask", padded.mask, "", NULL, TR(PADDED_BATCH) | TR(BUCKET), 0,
          "a padded feature: adds \"<feature>_mask\" float32 of its padded shape, 1 = value, 0 = padding"),
    O_INT(loom_transform_spec, "size", batch_size, 0, 1, INT32_MAX, TR(WINDOW), TR(WINDOW),
          "elements in a window (the new leading dim)"),
    O_INT(loom_transform_spec, "shift", shift, 0, 1, INT32_MAX, TR(WINDOW), 0,
          "elements between the starts of two windows; default size"),
    O_INT(loom_transform_spec, "stride", stride, 1, 1, INT32_MAX, TR(WINDOW), 0,
          "step between the elements of one window"),
    O_BOOL(loom_transform_spec, "drop_remainder", drop_remainder, 0, TR(WINDOW),
           "drop the short windows at the end of the pass"),
    O_STR(loom_transform_spec, "feature", feature, NULL, NULL, TR(LM_PAIRS) | TR(BUCKET), TR(LM_PAIRS) | TR(BUCKET),
          "lm_pairs: the (T + 1,) window split; bucket_by_sequence_length: the sequence whose dim 0 is its length"),
    O_STR(loom_transform_spec, "input", input_name, "input", NULL, TR(LM_PAIRS), 0, "lm_pairs: the feature w[:-1]"),
    O_STR(loom_transform_spec, "target", target_name, "target", NULL, TR(LM_PAIRS), 0, "lm_pairs: the feature w[1:]"),
    O_BOOL(loom_transform_spec, "target_last", target_last, 0, TR(LM_PAIRS),
           "lm_pairs: target = w[-1], the next token after input (a scalar), instead of w[1:]"),
    O_CUSTOM("bucket_boundaries", parse_bucket_ints, TR(BUCKET), TR(BUCKET),
             "[b0, b1, ...], increasing lengths >= 1: bucket i holds lengths in [b(i-1), b(i))"),
    O_CUSTOM("bucket_batch_sizes", parse_bucket_ints, TR(BUCKET), TR(BUCKET),
             "one batch size per bucket: len(bucket_boundaries) + 1 of them"),
    O_BOOL(loom_transform_spec, "pad_to_bucket_boundary", padded.pad_to_bucket_boundary, 0, TR(BUCKET),
           "pad the sequence to its bucket's boundary - 1 (else to the longest in the batch)"),
    O_CUSTOM("padded_shapes", parse_padded_shapes, TR(PADDED_BATCH), 0,
             "feature = [d0, ...] per feature, -1 = the largest in the batch"),
    O_CUSTOM("padding_values", parse_padding_values, TR(PADDED_BATCH) | TR(BUCKET), 0, "feature = value per feature, default 0"),
    O_STR(loom_transform_spec, "file", cache_file, "", NULL, TR(CACHE), 0,
          "cache file prefix (relative to the working directory); in memory when absent"),
    O_CUSTOM("parallel", parse_parallel, TR(MAP) | TR(INTERLEAVE), 0,
             "concurrent map calls / files read ahead: an int >= 1 or \"auto\"; default 1"),
    O_BOOL(loom_transform_spec, "deterministic", deterministic, 1, TR(MAP) | TR(INTERLEAVE),
           "parallel map/interleave: emit in the sequential order (true) or as ready (false)"),
    O_INT(loom_transform_spec, "cycle_length", cycle_length, 0, 1, 1024, TR(INTERLEAVE), TR(INTERLEAVE),
          "files read at once"),
    O_INT(loom_transform_spec, "block_length", block_length, 1, 1, INT64_MAX, TR(INTERLEAVE), 0,
          "elements taken from one file before moving to the next"),
    {.name = "source", .type = OT_SUB, .applies = TR(INTERLEAVE) | TR(FLAT_MAP), .required = TR(INTERLEAVE) | TR(FLAT_MAP),
     .help = "the tfrecord, csv or text source opened on each input file name (without files)"},
    {.name = "dataset", .type = OT_SUB, .applies = TR(ZIP), .required = TR(ZIP),
     .help = "the dataset { source: ...; transforms: ...; } zipped with this one"},
    O_END,
};

#define MAP(k) K(LOOM_MAP_##k)
static const cfg_opt map_opts[] = {
    O_KIND(loom_map_spec, "fn", kind, 0, loom_map_names_, ALL, "map function"),
    O_STR(loom_map_spec, "feature", feature, NULL, NULL, ALL & ~MAP(LUA), ALL & ~MAP(LUA), "the feature it applies to"),
    O_ENUM(loom_map_spec, "dtype", dtype, 0, loom_cfg_dtype_names_, MAP(CAST) | MAP(DECODE_IMAGE), MAP(CAST),
           "target dtype (decode_image: uint8, or float32 in [0, 1])"),
    O_F64(loom_map_spec, "scale", scale, 1.0, 0, 0, F_NO_LO | F_NO_HI, MAP(SCALE), 0, "x * scale + offset"),
    O_F64(loom_map_spec, "offset", offset, 0.0, 0, 0, F_NO_LO | F_NO_HI, MAP(SCALE), 0, "x * scale + offset"),
    O_CUSTOM("mean", parse_norm_values, MAP(NORMALIZE), 0,
             "(x - mean) / std: a number, or one per index of the feature's last axis [m0, m1, ...]"),
    O_CUSTOM("std", parse_norm_values, MAP(NORMALIZE), 0, "(x - mean) / std: a number > 0, or one per index [s0, ...]"),
    O_ENUM(loom_map_spec, "mode", tok_mode, LOOM_TOK_BYTES, loom_tok_mode_names_, MAP(TOKENIZE), MAP(TOKENIZE),
           "bytes, utf8_chars, whitespace (words) or vocabulary (words, a vocabulary required)"),
    O_ENUM(loom_map_spec, "standardize", standardize, LOOM_STD_DEFAULT, loom_tok_std_names_, MAP(TOKENIZE), 0,
           "none, lower_and_strip_punctuation, lower or strip_punctuation (ASCII); default: none for bytes and "
           "utf8_chars, lower_and_strip_punctuation for words"),
    O_CUSTOM("vocabulary_file", parse_vocabulary_file, MAP(TOKENIZE), 0,
             "one token a line (ids from num_oov_indices + 1 in file order), relative to the config's directory"),
    O_INT(loom_map_spec, "output_sequence_length", output_sequence_length, 0, 1, 1 << 24, MAP(TOKENIZE), 0,
          "pad with 0 or truncate to this many ids (truncations counted); absent: ragged (n,)"),
    O_BOOL(loom_map_spec, "ragged", ragged, 0, MAP(TOKENIZE), "variable-length ids (n,) (the default without output_sequence_length)"),
    O_ENUM(loom_map_spec, "on_invalid", on_invalid, LOOM_INVALID_REPLACE, loom_tok_invalid_names_, MAP(TOKENIZE), 0,
           "utf8_chars: invalid UTF-8 becomes U+FFFD (counted) or an error naming file and byte offset"),
    O_BOOL(loom_map_spec, "adapt", adapt, 0, MAP(NORMALIZE) | MAP(STRING_LOOKUP) | MAP(TOKENIZE),
           "normalize: mean and std (or min and max) per index of the last axis, string_lookup: the vocabulary, from "
           "one pass over data.train at start (kept in model_dir/adapt.txt and in every checkpoint)"),
    O_ENUM(loom_map_spec, "mode", norm_mode, LOOM_NORM_MEAN_STD, loom_norm_mode_names_, MAP(NORMALIZE), 0,
           "with adapt = true: \"mean_std\" ((x - mean) / std) or \"min_max\" ((x - min) / (max - min), into [0, 1])"),
    O_INT(loom_map_spec, "max_tokens", max_tokens, 0, 0, 1 << 24, MAP(STRING_LOOKUP) | MAP(TOKENIZE), 0,
          "ids in [0, max_tokens): the out-of-vocabulary ids, then the most frequent strings; 0 = every string seen "
          "(tokenize: padding id 0 counts too)"),
    O_INT(loom_map_spec, "num_oov_indices", num_oov_indices, 1, 0, 1024, MAP(STRING_LOOKUP) | MAP(TOKENIZE), 0,
          "ids 0 .. n-1 for strings outside the vocabulary (hashed when n > 1); 0: such a string is an error"),
    O_INT(loom_map_spec, "depth", depth, 0, 1, INT_MAX, MAP(ONE_HOT), MAP(ONE_HOT), "number of classes"),
    O_CUSTOM("shape", parse_shape, MAP(RESHAPE), MAP(RESHAPE), "target shape, one dim may be -1"),
    O_INT(loom_map_spec, "padding", padding, 0, 0, 1 << 20, MAP(PAD), MAP(PAD), "added on every side of H and W"),
    O_F64(loom_map_spec, "value", value, 0.0, 0, 0, F_NO_LO | F_NO_HI, MAP(PAD), 0, "fill value of the padding"),
    O_PAIR(loom_map_spec, "size", size, 0, 1, INT_MAX, MAP(RANDOM_CROP) | MAP(RESIZE) | MAP(DECODE_IMAGE),
           MAP(RANDOM_CROP) | MAP(RESIZE), "crop size: int or [h, w] (resize: output size; decode_image: every image's)"),
    O_INT(loom_map_spec, "channels", channels, 0, 0, 4, MAP(DECODE_IMAGE), 0,
          "0: as stored, 1: gray, 2: gray + alpha, 3: RGB, 4: RGBA"),
    O_PAIR(loom_map_spec, "max_size", max_size, 0, 1, 65535, MAP(DECODE_IMAGE), 0,
           "images of any size up to [h, w] (instead of size)"),
    O_F64(loom_map_spec, "fraction", fraction, 1.0, 0.0, 1.0, F_LO_OPEN, MAP(CENTRAL_CROP), MAP(CENTRAL_CROP),
          "the central fraction of height and width kept"),
    O_F64(loom_map_spec, "max_delta", max_delta, 0.0, 0.0, 0, F_NO_HI, MAP(RANDOM_BRIGHTNESS), MAP(RANDOM_BRIGHTNESS),
          "delta uniform in [-max_delta, max_delta), on the [0, 1] scale"),
    O_F64(loom_map_spec, "lower", lower, 0.0, 0.0, 0, F_NO_HI, MAP(RANDOM_CONTRAST), MAP(RANDOM_CONTRAST),
          "contrast factor uniform in [lower, upper)"),
    O_F64(loom_map_spec, "upper", upper, 0.0, 0.0, 0, F_NO_HI, MAP(RANDOM_CONTRAST), MAP(RANDOM_CONTRAST),
          "contrast factor uniform in [lower, upper)"),
    O_F64(loom_map_spec, "ms", ms, 0.0, 0.0, 60000.0, 0, MAP(SLEEP), MAP(SLEEP), "milliseconds to sleep per element"),
    O_STR(loom_map_spec, "lua", lua, NULL, NULL, MAP(LUA), 0,
          "\"file.lua:function\": fn(elem, rng) returns the element (fn = \"lua\" may be omitted)"),
    O_CUSTOM("plugin", parse_map_plugin, MAP(LUA), 0,
             "\"provider:function\": a plugin's function maps the element (instead of lua)"),
    O_CUSTOM("args", parse_map_args, MAP(LUA), 0, "the plugin function's arguments: KEY = scalar, at most 8"),
    O_END,
};

static void parse_shape(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_map_spec *m = base;
    char v[300];
    if (!config_setting_is_array(s) && !config_setting_is_list(s)) {
        cfg_err_(c, s, "expected a shape such as [28, 28, 1], got %s", cfg_value_str_(s, v, sizeof v));
        return;
    }
    int n = config_setting_length(s);
    if (n < 1 || n > 8) {
        cfg_err_(c, s, "expected 1 to 8 dimensions, got %d", n);
        return;
    }
    int unknown = 0;
    bool ok = true;
    for (int i = 0; i < n; i++) {
        const config_setting_t *d = config_setting_get_elem(s, i);
        int64_t x;
        if (!cfg_get_int_in_(c, d, -1, INT32_MAX, &x)) {
            ok = false;
            continue;
        }
        if (x == 0) {
            cfg_err_(c, d, "expected a dimension >= 1 (or -1 once), got 0");
            ok = false;
        }
        if (x == -1 && ++unknown == 2) {
            cfg_err_(c, s, "only one dimension may be -1");
            ok = false;
        }
        m->shape[i] = x;
    }
    int64_t numel = 1;
    for (int i = 0; ok && i < n; i++)
        if (m->shape[i] > 0 && (!loom_mul_ok(numel, m->shape[i], &numel) || numel > (1 << 30))) {
            cfg_err_(c, s, "more than %d values per element is too many", 1 << 30);
            ok = false;
        }
    if (ok) m->rank = n;
}

/* map parallel: an int >= 1 or "auto" (LOOM_PARALLEL_AUTO). */
static void parse_parallel(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_transform_spec *t = base;
    char v[300];
    if (config_setting_type(s) == CONFIG_TYPE_STRING) {
        if (!strcmp(config_setting_get_string(s), "auto"))
            t->parallel = LOOM_PARALLEL_AUTO;
        else
            cfg_err_(c, s, "expected an integer >= 1 or \"auto\", got %s", cfg_value_str_(s, v, sizeof v));
        return;
    }
    if (!cfg_is_int_(s)) {
        cfg_err_(c, s, "expected an integer >= 1 or \"auto\", got %s", cfg_value_str_(s, v, sizeof v));
        return;
    }
    int64_t x;
    if (cfg_get_int_in_(c, s, 1, 1024, &x)) t->parallel = (int)x;
}

/* prefetch buffer: an int >= -1 or "auto" (-1). */
static void parse_prefetch_buffer(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_transform_spec *t = base;
    char v[300];
    if (config_setting_type(s) == CONFIG_TYPE_STRING) {
        if (!strcmp(config_setting_get_string(s), "auto"))
            t->buffer = -1;
        else
            cfg_err_(c, s, "expected an integer >= 0 or \"auto\", got %s", cfg_value_str_(s, v, sizeof v));
        return;
    }
    int64_t x;
    if (cfg_get_int_in_(c, s, -1, INT64_MAX, &x)) t->buffer = x;
}

/* autotune.ram_budget: bytes (an integer, or "512MiB", "4GiB", "1.5GB", "800kB"),
 * or a share of physical memory ("50%"); 0 means the default share. */
static void parse_ram_budget(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_data_options *o = base;
    char v[300];
    if (cfg_is_int_(s)) {
        int64_t x;
        if (cfg_get_int_in_(c, s, 0, INT64_MAX, &x)) o->ram_budget = x;
        return;
    }
    static const struct { const char *suffix; double mul; } units[] = {
        {"", 1}, {"B", 1}, {"kB", 1e3}, {"KB", 1e3}, {"KiB", 1024.0}, {"MB", 1e6}, {"MiB", 1048576.0},
        {"GB", 1e9}, {"GiB", 1073741824.0}, {"TB", 1e12}, {"TiB", 1099511627776.0},
    };
    const char *str = config_setting_type(s) == CONFIG_TYPE_STRING ? config_setting_get_string(s) : NULL;
    if (str) {
        char *end;
        double x = strtod(str, &end);
        while (*end == ' ') end++;
        if (end != str && isfinite(x) && x > 0 && !strcmp(end, "%") && x <= 100) {
            o->ram_budget = 0;
            o->ram_fraction = x / 100.0;
            return;
        }
        for (size_t i = 0; end != str && isfinite(x) && x > 0 && i < sizeof units / sizeof units[0]; i++)
            if (!strcmp(end, units[i].suffix) && x * units[i].mul < 9.2e18) {
                o->ram_budget = (int64_t)(x * units[i].mul);
                return;
            }
    }
    loom_err *e = cfg_err_(c, s, "expected bytes (an integer, or a string such as \"4GiB\" or \"512MB\") or a share of "
                       "memory (\"50%%\"), got %s", cfg_value_str_(s, v, sizeof v));
    if (e) loom_err_hint(e, "units: B, kB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, TiB (powers of 1024)");
}

/* filter: in = [...] or not_in = [...]; which one is given decides the predicate. */
static void parse_feature_names(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_transform_spec *t = base;
    char v[300];
    int n = (config_setting_is_array(s) || config_setting_is_list(s)) ? config_setting_length(s) : -1;
    if (n < 1 || n > LOOM_MAX_FEATURES) {
        cfg_err_(c, s, "expected a list of 1 to %d feature names, got %s", LOOM_MAX_FEATURES,
                 cfg_value_str_(s, v, sizeof v));
        return;
    }
    t->features.n = 0;
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = config_setting_get_elem(s, i);
        const char *str = config_setting_type(e) == CONFIG_TYPE_STRING ? config_setting_get_string(e) : NULL;
        if (!str || !str[0] || strlen(str) >= LOOM_NAME_MAX) {
            cfg_err_(c, e, "expected a feature name (1 to %d characters), got %s", LOOM_NAME_MAX - 1,
                     cfg_value_str_(e, v, sizeof v));
            continue;
        }
        for (int j = 0; j < t->features.n; j++)
            if (!strcmp(t->features.name[j], str)) cfg_err_(c, e, "\"%s\" is listed twice", str);
        snprintf(t->features.name[t->features.n++], LOOM_NAME_MAX, "%s", str);
    }
}

static void parse_filter_values(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_transform_spec *t = base;
    char v[300];
    if (!config_setting_is_array(s) && !config_setting_is_list(s)) {
        cfg_err_(c, s, "expected an array of numbers such as [0, 1, 2], got %s", cfg_value_str_(s, v, sizeof v));
        return;
    }
    int n = config_setting_length(s);
    if (n < 1 || n > LOOM_MAX_FILTER_VALUES) {
        cfg_err_(c, s, "expected 1 to %d values, got %d", LOOM_MAX_FILTER_VALUES, n);
        return;
    }
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = config_setting_get_elem(s, i);
        if (!cfg_is_number_(e) || !isfinite(cfg_get_number_(e))) {
            cfg_err_(c, e, "expected a number, got %s", cfg_value_str_(e, v, sizeof v));
            return;
        }
        t->values[i] = cfg_get_number_(e);
    }
    t->n_values = n;
    t->filter = strcmp(config_setting_name(s), "in") ? LOOM_FILTER_NOT_IN : LOOM_FILTER_IN;
}

/* padded_batch: padded_shapes: { NAME = [d0, ...]; ... }; each dim >= 1, or -1 for the largest in the batch. */
static void parse_padded_shapes(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_transform_spec *t = base;
    char v[300];
    if (!config_setting_is_group(s)) {
        cfg_err_(c, s, "expected a group { feature = [d0, ...]; ... }, got %s", cfg_value_str_(s, v, sizeof v));
        return;
    }
    int n = config_setting_length(s);
    for (int i = 0; i < n && t->padded.n_shapes < LOOM_MAX_FEATURES; i++) {
        const config_setting_t *e = config_setting_get_elem(s, i);
        if (!config_setting_is_array(e) && !config_setting_is_list(e)) {
            cfg_err_(c, e, "expected a shape such as [16] or [-1, 8], got %s", cfg_value_str_(e, v, sizeof v));
            continue;
        }
        int r = config_setting_length(e);
        if (r > 8) {
            cfg_err_(c, e, "expected at most 8 dimensions, got %d", r);
            continue;
        }
        int k = t->padded.n_shapes;
        bool ok = true;
        for (int d = 0; d < r; d++) {
            const config_setting_t *x = config_setting_get_elem(e, d);
            int64_t dim;
            if (!cfg_get_int_in_(c, x, -1, INT32_MAX, &dim)) {
                ok = false;
                continue;
            }
            if (dim == 0) {
                cfg_err_(c, x, "expected a dimension >= 1 (or -1: the largest in the batch), got 0");
                ok = false;
            }
            t->padded.shape[k][d] = dim;
        }
        if (!ok) continue;
        snprintf(t->padded.shape_name[k], LOOM_NAME_MAX, "%s", config_setting_name(e));
        t->padded.rank[k] = r;
        t->padded.n_shapes++;
    }
}

/* padded_batch: padding_values: { NAME = number; ... }. */
static void parse_padding_values(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_transform_spec *t = base;
    char v[300];
    if (!config_setting_is_group(s)) {
        cfg_err_(c, s, "expected a group { feature = value; ... }, got %s", cfg_value_str_(s, v, sizeof v));
        return;
    }
    int n = config_setting_length(s);
    for (int i = 0; i < n && t->padded.n_values < LOOM_MAX_FEATURES; i++) {
        const config_setting_t *e = config_setting_get_elem(s, i);
        if (!cfg_is_number_(e) || !isfinite(cfg_get_number_(e))) {
            cfg_err_(c, e, "expected a number, got %s", cfg_value_str_(e, v, sizeof v));
            continue;
        }
        snprintf(t->padded.value_name[t->padded.n_values], LOOM_NAME_MAX, "%s", config_setting_name(e));
        t->padded.value[t->padded.n_values++] = cfg_get_number_(e);
    }
}

/* Cross-field checks of the transforms added with filter..cache. */
static void check_transform_more(cfg_ctx *c, const config_setting_t *g, loom_transform_spec *t, int op)
{
    const config_setting_t *in = config_setting_get_member(g, "in"), *nin = config_setting_get_member(g, "not_in");
    const config_setting_t *lo = config_setting_get_member(g, "min"), *hi = config_setting_get_member(g, "max");
    const config_setting_t *lua = config_setting_get_member(g, "lua"), *feat = config_setting_get_member(g, "feature");
    const config_setting_t *plug = config_setting_get_member(g, "plugin");
    if (op == LOOM_T_FILTER && (lua || plug)) {
        if (lua && plug)
            cfg_err_(c, plug, "a filter takes either `lua` or `plugin`, not both");
        else if (feat || in || nin || lo || hi)
            cfg_err_(c, lua ? lua : plug, "a filter takes either `%s` or `feature` with a predicate, not both",
                 lua ? "lua" : "plugin");
        t->filter = LOOM_FILTER_LUA;
        if (lua) cfg_resolve_lua_ref_(c, lua, t->map.lua, sizeof t->map.lua);
    } else if (op == LOOM_T_FILTER) {
        int given = (in != NULL) + (nin != NULL) + (lo || hi);
        if (!feat)
            cfg_err_(c, g,
                     "missing required setting `feature` (the scalar feature tested), or `lua` (a Lua predicate)");
        if (given == 0)
            cfg_err_(c, g, "filter needs a predicate: one of `in`, `not_in`, or `min`/`max`");
        else if (given > 1)
            cfg_err_(c, in && nin ? nin : (lo ? lo : hi),
                     "filter takes one predicate: `in`, `not_in`, or `min`/`max`, not several");
        else if (lo || hi)
            t->filter = LOOM_FILTER_RANGE;
        if (lo && hi && t->min > t->max) {
            char a[40], b[40];
            cfg_err_(c, hi, "max (%s) is below min (%s): the filter would drop every element",
                     cfg_fmt_double_(t->max, a, sizeof a), cfg_fmt_double_(t->min, b, sizeof b));
        }
    }
    if (op == LOOM_T_SHARD && t->index >= t->num_shards && config_setting_get_member(g, "num_shards"))
        cfg_err_(c, config_setting_get_member(g, "index"),
                 "index %lld is out of range: expected 0 <= index < num_shards (%lld)", (long long)t->index,
                 (long long)t->num_shards);
}

/* normalize's mean or std: a number, or an array of numbers (one per index of
 * the feature's last axis); arrays go to mean_v/std_v, the other side repeated. */
static void parse_norm_values(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_map_spec *m = base;
    bool is_std = !strcmp(config_setting_name(s), "std");
    double *scalar = is_std ? &m->std : &m->mean;
    char v[300];
    if (cfg_is_number_(s)) {
        double d = cfg_get_number_(s);
        if (!isfinite(d) || (is_std && !(d > 0))) {
            cfg_err_(c, s, "expected a number%s, got %s", is_std ? " > 0.0" : "", cfg_value_str_(s, v, sizeof v));
            return;
        }
        *scalar = d;
        return;
    }
    int n = (config_setting_is_array(s) || config_setting_is_list(s)) ? config_setting_length(s) : -1;
    if (n < 1 || n > LOOM_MAX_NORM) {
        cfg_err_(c, s, "expected a number or an array of 1 to %d numbers, got %s", LOOM_MAX_NORM,
                 cfg_value_str_(s, v, sizeof v));
        return;
    }
    if (m->n_norm && m->n_norm != n) {
        cfg_err_(c, s, "mean has %d values and std %d: give both the same length (one per index of the last axis), or "
             "one of them as a number", is_std ? m->n_norm : n, is_std ? n : m->n_norm);
        return;
    }
    float *dst = is_std ? m->std_v : m->mean_v, *other = is_std ? m->mean_v : m->std_v;
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = config_setting_get_elem(s, i);
        double d = cfg_is_number_(e) ? cfg_get_number_(e) : NAN;
        if (!isfinite(d) || (is_std && !(d > 0))) {
            cfg_err_(c, e, "expected a number%s, got %s", is_std ? " > 0.0" : "", cfg_value_str_(e, v, sizeof v));
            return;
        }
        dst[i] = (float)d;
        if (!m->n_norm) other[i] = (float)(is_std ? m->mean : m->std); /* the other side so far: a number or its default */
    }
    m->n_norm = n;
}

/* ---- groups -------------------------------------------------------------- */

/* The image maps' cross-field checks: decode_image's size or max_size, random_contrast's range. */
static void check_image_map(cfg_ctx *c, const config_setting_t *g, const loom_map_spec *m, int fn)
{
    const config_setting_t *size = config_setting_get_member(g, "size"), *max = config_setting_get_member(g, "max_size");
    if (fn == LOOM_MAP_DECODE_IMAGE) {
        if (!size && !max)
            cfg_err_(c, g,
                     "decode_image needs `size = [h, w]` (every image that size) or `max_size = [h, w]` (images up to "
                     "that size, for a resize after it)");
        else if (size && max)
            cfg_err_(c, max,
                     "decode_image takes `size` (every image that size) or `max_size` (up to that size), not both");
        const config_setting_t *dt = config_setting_get_member(g, "dtype");
        if (dt && m->dtype != LOOM_CFG_U8 && m->dtype != LOOM_CFG_F32)
            cfg_err_(c, dt, "decode_image decodes to \"uint8\" or \"float32\" (values in [0, 1]), not \"%s\"",
                 loom_cfg_name_(loom_cfg_dtype_names_, (int)m->dtype));
    }
    if (fn == LOOM_MAP_RANDOM_CONTRAST && config_setting_get_member(g, "upper") && !(m->lower < m->upper)) {
        char a[40], b[40];
        cfg_err_(c, config_setting_get_member(g, "upper"), "upper (%s) must be above lower (%s)",
                 cfg_fmt_double_(m->upper, a, sizeof a), cfg_fmt_double_(m->lower, b, sizeof b));
    }
}

/* tokenize's cross-field checks: where the ids come from, and its length. */
static void check_tokenize(cfg_ctx *c, const config_setting_t *g, loom_map_spec *m)
{
    bool words = m->tok_mode == LOOM_TOK_WHITESPACE || m->tok_mode == LOOM_TOK_VOCABULARY;
    bool file = m->vocabulary_file[0] != 0;
    const config_setting_t *vf = config_setting_get_member(g, "vocabulary_file");
    if (m->standardize == LOOM_STD_DEFAULT) m->standardize = words ? LOOM_STD_LOWER_AND_STRIP : LOOM_STD_NONE;
    if (m->tok_mode == LOOM_TOK_BYTES && (file || m->adapt))
        cfg_err_(c, vf ? vf : config_setting_get_member(g, "adapt"),
                 "mode = \"bytes\" maps each byte to byte + 1 and takes no vocabulary; use mode = \"utf8_chars\" "
                 "or \"whitespace\" with a vocabulary");
    if (file && m->adapt)
        cfg_err_(c, vf, "tokenize takes its vocabulary from vocabulary_file or from data.train (adapt = true), not both");
    if (words && !file && !m->adapt) {
        loom_err *e = cfg_err_(c, g, "mode = \"%s\" maps words through a vocabulary: it needs vocabulary_file or adapt = true",
                               loom_cfg_name_(loom_tok_mode_names_, (int)m->tok_mode));
        if (e) loom_err_hint(e, "add adapt = true; (max_tokens and num_oov_indices bound and shape the ids)");
    }
    if (m->max_tokens && m->max_tokens <= m->num_oov_indices + 1)
        cfg_err_(c, config_setting_get_member(g, "max_tokens"),
                 "max_tokens (%lld) must be above num_oov_indices + 1 (%d): the ids hold padding (0), the "
                 "out-of-vocabulary ids, then the vocabulary", (long long)m->max_tokens, m->num_oov_indices + 1);
    if (m->ragged && m->output_sequence_length)
        cfg_err_(c, config_setting_get_member(g, "ragged"),
                 "ragged = true gives variable-length ids; output_sequence_length pads them to one length: not both");
}

static void parse_map(cfg_ctx *c, const config_setting_t *g, loom_transform_spec *t, int op)
{
    int fn = -1;
    if (op == LOOM_T_MAP) {
        /* `lua = ...` or `plugin = ...` without `fn` is a custom map */
        const config_setting_t *lua = config_setting_get_member(g, "lua"), *plug = config_setting_get_member(g, "plugin");
        bool custom_only = !config_setting_get_member(g, "fn") && (lua || plug);
        fn = custom_only ? (int)(t->map.kind = LOOM_MAP_LUA) : cfg_parse_kind_(c, g, map_opts, &t->map);
        if (fn == LOOM_MAP_NORMALIZE) t->map.mean = 0, t->map.std = 1; /* before mean/std, which may be arrays */
        cfg_parse_opts_(c, g, map_opts, fn, &t->map);
        if (fn == LOOM_MAP_LUA && lua && plug)
            cfg_err_(c, plug, "a map takes either `lua` or `plugin`, not both");
        else if (fn == LOOM_MAP_LUA && lua)
            cfg_resolve_lua_ref_(c, lua, t->map.lua, sizeof t->map.lua);
        else if (fn == LOOM_MAP_LUA && !plug)
            cfg_err_(c, g,
                     "missing required setting `lua` (\"file.lua:function\") or `plugin` (\"provider:function\")");
        if (fn == LOOM_MAP_LUA && lua && config_setting_get_member(g, "args"))
            cfg_err_(c, config_setting_get_member(g, "args"), "`args` go to a plugin's function; a Lua map takes none");
        if (fn == LOOM_MAP_NORMALIZE) {
            const config_setting_t *mn = config_setting_get_member(g, "mean"), *sd = config_setting_get_member(g, "std");
            if (t->map.adapt && (mn || sd))
                cfg_err_(c, mn ? mn : sd, "adapt = true computes mean and std from data.train; remove `%s` or adapt",
                     mn ? "mean" : "std");
            const config_setting_t *md = config_setting_get_member(g, "mode");
            if (md && t->map.norm_mode == LOOM_NORM_MIN_MAX && !t->map.adapt) {
                loom_err *e =
                    cfg_err_(c, md, "mode = \"min_max\" takes min and max from data.train: it needs adapt = true");
                if (e) loom_err_hint(e, "add adapt = true; (or give mean = min and std = max - min yourself)");
            }
            for (int i = 0; i < t->map.n_norm; i++) { /* a number given beside an array applies to every index */
                if (mn && cfg_is_number_(mn)) t->map.mean_v[i] = (float)t->map.mean;
                if (sd && cfg_is_number_(sd)) t->map.std_v[i] = (float)t->map.std;
            }
        }
        if (fn == LOOM_MAP_STRING_LOOKUP && !t->map.adapt) {
            loom_err *e = cfg_err_(c, g, "string_lookup takes its vocabulary from data.train: it needs adapt = true");
            if (e) loom_err_hint(e, "add adapt = true; (max_tokens and num_oov_indices bound and shape the ids)");
        }
        if (fn == LOOM_MAP_STRING_LOOKUP && t->map.max_tokens && t->map.max_tokens <= t->map.num_oov_indices)
            cfg_err_(c, config_setting_get_member(g, "max_tokens"),
                     "max_tokens (%lld) must be above num_oov_indices (%d): "
                     "the ids hold the out-of-vocabulary ids, then the vocabulary",
                     (long long)t->map.max_tokens, t->map.num_oov_indices);
        check_image_map(c, g, &t->map, fn);
        if (fn == LOOM_MAP_TOKENIZE) check_tokenize(c, g, &t->map);
        if (fn == LOOM_MAP_TOKENIZE && config_setting_get_member(g, "parallel") && t->parallel != 1)
            cfg_err_(c, config_setting_get_member(g, "parallel"),
                     "tokenize runs as a stage of its own, sequentially (its output length varies per element); "
                     "remove `parallel`");
    }
    cfg_scope sc[2] = {{transform_opts, op, NULL}, {map_opts, fn, NULL}};
    if (op >= 0 && op != LOOM_T_MAP) sc[1].gate = "op = \"map\"";
    cfg_check_keys_(c, g, sc, 2);
}

/* data.options (g may be NULL: every default) into *o. */
static void parse_data_options(cfg_ctx *c, const config_setting_t *g, loom_data_options *o)
{
    memset(o, 0, sizeof *o);
    o->present = true;
    o->ram_fraction = 0.5;
    cfg_opts_default_(options_opts, o);
    cfg_opts_default_(autotune_opts, o);
    cfg_opts_default_(optimization_opts, o);
    if (!g) return;
    cfg_loc_of_(c, g, &o->loc);
    cfg_parse_opts_(c, g, options_opts, 0, o);
    cfg_scope sc = {options_opts, 0, NULL};
    cfg_check_keys_(c, g, &sc, 1);
    static const struct { const char *key; const cfg_opt *tbl; } subs[] = {{"autotune", autotune_opts},
                                                                       {"optimization", optimization_opts}};
    for (size_t i = 0; i < sizeof subs / sizeof subs[0]; i++) {
        const config_setting_t *sg = cfg_sub_group_(c, g, subs[i].key);
        if (!sg) continue;
        cfg_parse_opts_(c, sg, subs[i].tbl, 0, o);
        cfg_scope ss = {subs[i].tbl, 0, NULL};
        cfg_check_keys_(c, sg, &ss, 1);
    }
    const config_setting_t *og = config_setting_get_member(g, "optimization");
    const config_setting_t *mp = og && config_setting_is_group(og) ? config_setting_get_member(og, "map_parallelization") : NULL;
    if (o->map_parallelization && !o->autotune && mp)
        cfg_err_(c, mp, "map_parallelization makes maps parallel = \"auto\", which needs autotune.enabled = true");
}

static void parse_dataset(cfg_ctx *c, const config_setting_t *g, loom_dataset_spec *d);

/* A cache (transforms.[i], the setting e) after a repeat with count = -1
 * would cache a pass that never ends (the pipeline refuses it too, for specs
 * built in code, in the same words: at the cache's line, naming the dataset). */
static void check_cache_after_repeat(cfg_ctx *c, const config_setting_t *e, const loom_dataset_spec *d, int i)
{
    for (int k = 0; k < i; k++)
        if (d->transform[k].kind == LOOM_T_REPEAT && d->transform[k].count < 0) {
            char where[LOOM_PATH_MAX + 16];
            cfg_where_of_(c, e, where, sizeof where, NULL);
            loom_err *o = cfg_rawerr_(c, LOOM_ECONFIG, where,
                                      "%s: cache: the repeat before it (transforms.[%d]) has count "
                                      "= -1, so the pass it caches never ends and the cache would grow without bound",
                                      d->loc.path[0] ? d->loc.path : "data", k);
            if (o) loom_err_hint(o, "put cache before repeat, so that it holds one finite pass");
            return;
        }
}

/* An interleave's source: a tfrecord, csv or text source whose files are the
 * interleave's input elements, so `files` is refused rather than required. */
static void parse_interleave_source(cfg_ctx *c, const config_setting_t *e, loom_transform_spec *t)
{
    const config_setting_t *g = cfg_sub_group_(c, e, "source");
    if (!g) return;
    if (!(t->source = loom_calloc(1, sizeof *t->source))) {
        cfg_rawerr_(c, LOOM_ENOMEM, "", "out of memory");
        return;
    }
    cfg_loc_of_(c, g, &t->source->loc);
    int k = cfg_parse_kind_(c, g, cfg_source_opts_, t->source);
    if (k >= 0 && k != LOOM_SRC_TFRECORD && k != LOOM_SRC_CSV && k != LOOM_SRC_TEXT) {
        loom_err *er = cfg_err_(c, config_setting_get_member(g, "type"),
                            "an interleave opens a tfrecord, csv or text source on each input file, not \"%s\"",
                            loom_cfg_name_(loom_source_names_, k));
        if (er) loom_err_hint(er, "write type = \"tfrecord\", \"csv\" or \"text\"");
        return;
    }
    const config_setting_t *files = config_setting_get_member(g, "files");
    if (files) {
        loom_err *er =
            cfg_err_(c, files, "an interleave's source reads the files its input names; remove `files` here");
        if (er) loom_err_hint(er, "give the file patterns to a list_files source: source: { type = \"list_files\"; files = [...]; }");
    }
    c->skip_key = "files";
    cfg_parse_opts_(c, g, cfg_source_opts_, k, t->source);
    c->skip_key = NULL;
    if (t->source->shuffle_files)
        cfg_err_(c, config_setting_get_member(g, "shuffle_files"),
             "an interleave's source reads one file at a time: shuffle the list_files source instead");
    cfg_scope ss = {cfg_source_opts_, k, NULL};
    if (!files) cfg_check_keys_(c, g, &ss, 1);
}

/* A zip's dataset: a whole dataset of its own, with the options of the one it is zipped into. */
static void parse_zip_dataset(cfg_ctx *c, const config_setting_t *e, loom_transform_spec *t, const loom_dataset_spec *d)
{
    const config_setting_t *g = cfg_sub_group_(c, e, "dataset");
    if (!g) return;
    if (c->depth >= 4) {
        cfg_err_(c, g, "datasets nested more than 4 deep by zip");
        return;
    }
    if (!(t->dataset = loom_calloc(1, sizeof *t->dataset))) {
        cfg_rawerr_(c, LOOM_ENOMEM, "", "out of memory");
        return;
    }
    t->dataset->options = d->options;
    c->depth++;
    parse_dataset(c, g, t->dataset);
    c->depth--;
}

static void parse_dataset(cfg_ctx *c, const config_setting_t *g, loom_dataset_spec *d)
{
    d->present = true;
    cfg_loc_of_(c, g, &d->loc);
    cfg_parse_opts_(c, g, dataset_opts, 0, d);
    cfg_scope sc = {dataset_opts, 0, NULL};
    cfg_check_keys_(c, g, &sc, 1);

    const config_setting_t *src = cfg_sub_group_(c, g, "source");
    if (src) {
        cfg_loc_of_(c, src, &d->source.loc);
        int k = cfg_plugin_source_type_(c, config_setting_get_member(src, "type"), &d->source);
        if (k < 0) k = cfg_parse_kind_(c, src, cfg_source_opts_, &d->source);
        cfg_parse_opts_(c, src, cfg_source_opts_, k, &d->source);
        if (k == LOOM_SRC_LIST_FILES) d->source.list_files.seed_set = config_setting_get_member(src, "seed") != NULL;
        if (k == LOOM_SRC_SYNTHETIC && !config_setting_get_member(src, "features") && !d->source.synthetic.ctr.on) {
            loom_err *e =
                cfg_err_(c, src, "missing required setting `features` (a synthetic source needs features, or ctr)");
            if (e) loom_err_hint(e, "e.g. features: { x = { dtype = \"float32\"; shape = [4]; }; }; or ctr = { columns = 26; };");
        }
        cfg_scope ss = {cfg_source_opts_, k, NULL};
        cfg_check_keys_(c, src, &ss, 1);
    }
    d->source.on_nonfinite = (int)d->on_nonfinite;
    const config_setting_t *tl = cfg_sub_list_(c, g, "transforms");
    if (!tl) return;
    int n = config_setting_length(tl);
    if (n > LOOM_MAX_TRANSFORMS) {
        cfg_err_(c, tl, "too many transforms: %d (at most %d)", n, LOOM_MAX_TRANSFORMS);
        n = LOOM_MAX_TRANSFORMS;
    }
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = config_setting_get_elem(tl, i);
        loom_transform_spec *t = &d->transform[d->n_transforms++];
        cfg_loc_of_(c, e, &t->loc);
        if (!config_setting_is_group(e)) {
            char v[300];
            cfg_err_(c, e, "expected a group { op = ...; }, got %s", cfg_value_str_(e, v, sizeof v));
            continue;
        }
        int op = cfg_parse_kind_(c, e, transform_opts, t);
        cfg_parse_opts_(c, e, transform_opts, op, t);
        if (op == LOOM_T_SHUFFLE || op == LOOM_T_SPLIT) t->seed_set = config_setting_get_member(e, "seed") != NULL;
        if (op == LOOM_T_MAP && t->parallel == 0) t->parallel = 1; /* parallel's default (a custom option has none) */
        if (op == LOOM_T_MAP && !config_setting_get_member(e, "deterministic")) t->deterministic = d->options.deterministic;
        if (op == LOOM_T_PREFETCH && !config_setting_get_member(e, "buffer")) t->buffer = -1;
        if (op >= LOOM_T_FILTER) check_transform_more(c, e, t, op);
        if (op == LOOM_T_FLAT_MAP) { /* tf: flat_map is interleave with cycle_length 1 */
            t->cycle_length = t->block_length = t->parallel = 1;
            t->deterministic = true;
            parse_interleave_source(c, e, t);
        }
        if (op == LOOM_T_WINDOW && !config_setting_get_member(e, "shift")) t->shift = t->batch_size;
        if (op == LOOM_T_INTERLEAVE) {
            if (t->parallel == 0) t->parallel = 1;
            if (!config_setting_get_member(e, "deterministic")) t->deterministic = d->options.deterministic;
            parse_interleave_source(c, e, t);
        }
        if (op == LOOM_T_ZIP) parse_zip_dataset(c, e, t, d);
        if (op == LOOM_T_CACHE) check_cache_after_repeat(c, e, d, i);
        parse_map(c, e, t, op);
    }
}

/* `plugin = "provider:function"` into m->provider and m->lua (the function). */
static void plugin_ref(cfg_ctx *c, const config_setting_t *s, loom_map_spec *m)
{
    const char *ref = config_setting_type(s) == CONFIG_TYPE_STRING ? config_setting_get_string(s) : NULL;
    const char *colon = ref ? strchr(ref, ':') : NULL;
    if (!colon || colon == ref || !colon[1] || colon - ref >= LOOM_NAME_MAX || strlen(colon + 1) >= LOOM_NAME_MAX) {
        char v[300];
        loom_err *e = cfg_err_(c, s, "expected \"provider:function\", got %s", cfg_value_str_(s, v, sizeof v));
        if (e) loom_err_hint(e, "e.g. plugin = \"image_ops:cutout\"; `loom plugins` lists the transform providers");
        return;
    }
    snprintf(m->provider, sizeof m->provider, "%.*s", (int)(colon - ref), ref);
    snprintf(m->lua, sizeof m->lua, "%s", colon + 1);
}

static void parse_map_plugin(cfg_ctx *c, const config_setting_t *s, void *base) { plugin_ref(c, s, base); }
static void parse_map_args(cfg_ctx *c, const config_setting_t *s, void *base)
{
    cfg_plugin_opts_group_(c, s, &((loom_map_spec *)base)->args);
}
static void parse_filter_plugin(cfg_ctx *c, const config_setting_t *s, void *base)
{
    plugin_ref(c, s, &((loom_transform_spec *)base)->map);
}
static void parse_filter_args(cfg_ctx *c, const config_setting_t *s, void *base)
{
    cfg_plugin_opts_group_(c, s, &((loom_transform_spec *)base)->map.args);
}

/* data: options (shared by both datasets), train, eval. */
void cfg_parse_data_(cfg_ctx *c, const config_setting_t *root, loom_spec *spec)
{
    const config_setting_t *g;
    if ((g = cfg_sub_group_(c, root, "data"))) {
        cfg_parse_opts_(c, g, data_opts, 0, NULL);
        cfg_scope sc = {data_opts, 0, NULL};
        cfg_check_keys_(c, g, &sc, 1);
        const config_setting_t *d;
        parse_data_options(c, cfg_sub_group_(c, g, "options"), &spec->train.options);
        spec->eval.options = spec->train.options;
        if ((d = cfg_sub_group_(c, g, "train"))) parse_dataset(c, d, &spec->train);
        if ((d = cfg_sub_group_(c, g, "eval"))) parse_dataset(c, d, &spec->eval);
    }
}

/* bucket_by_sequence_length: bucket_boundaries (increasing, >= 1) or
 * bucket_batch_sizes (>= 1; checked against the boundaries' count after). */
static void parse_bucket_ints(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_transform_spec *t = base;
    bool sizes = !strcmp(config_setting_name(s), "bucket_batch_sizes");
    char v[300];
    int n = (config_setting_is_array(s) || config_setting_is_list(s)) ? config_setting_length(s) : -1;
    int cap = sizes ? LOOM_MAX_BUCKETS + 1 : LOOM_MAX_BUCKETS;
    if (n < 1 || n > cap) {
        cfg_err_(c, s, "expected an array of 1 to %d integers, got %s", cap, cfg_value_str_(s, v, sizeof v));
        return;
    }
    int64_t *dst = sizes ? t->padded.bucket_size : t->padded.boundary;
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = config_setting_get_elem(s, i);
        int64_t x;
        if (!cfg_get_int_in_(c, e, 1, sizes ? LOOM_MAX_BATCH : INT32_MAX, &x)) return;
        if (!sizes && i > 0 && x <= dst[i - 1]) {
            cfg_err_(c, e, "bucket_boundaries must increase: %lld follows %lld", (long long)x, (long long)dst[i - 1]);
            return;
        }
        dst[i] = x;
    }
    if (!sizes) t->padded.n_boundaries = n;
    /* the sizes may come before the boundaries: their count is checked by whichever is parsed second */
    const config_setting_t *other = config_setting_get_member(config_setting_parent(s), sizes ? "bucket_boundaries" : "bucket_batch_sizes");
    int nb = sizes ? (other && (config_setting_is_array(other) || config_setting_is_list(other)) ? config_setting_length(other) : -1) : n;
    int ns = sizes ? n : (other && (config_setting_is_array(other) || config_setting_is_list(other)) ? config_setting_length(other) : -1);
    if (nb >= 0 && ns >= 0 && ns != nb + 1 && sizes)
        cfg_err_(c, s, "expected %d batch sizes (one per bucket: len(bucket_boundaries) + 1), got %d", nb + 1, ns);
}

/* tokenize: vocabulary_file, resolved against the config's directory. */
static void parse_vocabulary_file(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_map_spec *m = base;
    const char *p = config_setting_type(s) == CONFIG_TYPE_STRING ? config_setting_get_string(s) : NULL;
    char v[300];
    if (!p || !p[0]) {
        cfg_err_(c, s, "expected a file name, got %s", cfg_value_str_(s, v, sizeof v));
        return;
    }
    int w = p[0] == '/' ? snprintf(m->vocabulary_file, sizeof m->vocabulary_file, "%s", p)
                        : snprintf(m->vocabulary_file, sizeof m->vocabulary_file, "%s/%s", c->dir, p);
    if (w < 0 || (size_t)w >= sizeof m->vocabulary_file) cfg_err_(c, s, "the path %s is too long", p);
}
