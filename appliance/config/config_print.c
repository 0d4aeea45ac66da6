/* config_print.c - a loom_spec back into libconfig syntax, every default
 * filled in, so that loom_config_load reads it back to an equal spec
 * (idx files and tfrecord patterns are printed as the absolute paths they
 * were resolved to).
 * Threads: none. */
#include "config/config_internal.h"

#include <ctype.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static void put_str(FILE *f, const char *s)
{
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\')
            fprintf(f, "\\%c", *p);
        else if (*p == '\n')
            fputs("\\n", f);
        else if (*p == '\t')
            fputs("\\t", f);
        else if (*p < 0x20)
            fprintf(f, "\\x%02x", *p);
        else
            fputc(*p, f);
    }
    fputc('"', f);
}

/* Exact: reads back to the same double; always a float literal for libconfig. */
static void put_f64(FILE *f, double v)
{
    char buf[64];
    snprintf(buf, sizeof buf, "%.15g", v);
    if (strtod(buf, NULL) != v) snprintf(buf, sizeof buf, "%.17g", v);
    if (!strpbrk(buf, ".eE")) strcat(buf, ".0");
    fputs(buf, f);
}

static bool big(int64_t v) { return v > INT32_MAX || v < INT32_MIN; }

/* libconfig needs the L suffix beyond 32 bits (long forces it, for arrays,
 * whose elements must all be of one type). */
static void put_int(FILE *f, int64_t v, bool lng)
{
    fprintf(f, lng || big(v) ? "%lldL" : "%lld", (long long)v);
}

static void put_i64(FILE *f, int64_t v) { put_int(f, v, false); }

/* [a, b, c] */
static void put_i64_array(FILE *f, const int64_t *v, int n)
{
    bool lng = false;
    for (int i = 0; i < n; i++) lng = lng || big(v[i]);
    fputc('[', f);
    for (int i = 0; i < n; i++) {
        if (i) fputs(", ", f);
        put_int(f, v[i], lng);
    }
    fputc(']', f);
}

static void ind(FILE *f, int depth) { fprintf(f, "%*s", depth * 2, ""); }

static void kv_str(FILE *f, int d, const char *k, const char *v)
{
    ind(f, d);
    fprintf(f, "%s = ", k);
    put_str(f, v);
    fputs(";\n", f);
}

static void kv_f64(FILE *f, int d, const char *k, double v)
{
    ind(f, d);
    fprintf(f, "%s = ", k);
    put_f64(f, v);
    fputs(";\n", f);
}

static void kv_i64(FILE *f, int d, const char *k, int64_t v)
{
    ind(f, d);
    fprintf(f, "%s = ", k);
    put_i64(f, v);
    fputs(";\n", f);
}

static void kv_bool(FILE *f, int d, const char *k, bool v)
{
    ind(f, d);
    fprintf(f, "%s = %s;\n", k, v ? "true" : "false");
}

static void kv_pair(FILE *f, int d, const char *k, const int v[2])
{
    ind(f, d);
    fprintf(f, "%s = [%d, %d];\n", k, v[0], v[1]);
}

/* An integer dtype's value reads back as an integer, a float dtype's as a float. */
static void put_value(FILE *f, loom_cfg_dtype dt, double v)
{
    if (dt == LOOM_CFG_F32 || dt == LOOM_CFG_F64)
        put_f64(f, v);
    else
        put_i64(f, (int64_t)v);
}

/* The csv, text and synthetic sources' settings. */
static void print_csv_text_synthetic(FILE *f, const loom_source_spec *src)
{
    if ((src->kind == LOOM_SRC_CSV || src->kind == LOOM_SRC_TEXT) && src->n_patterns) {
        fputs("      files = [", f);
        for (int i = 0; i < src->n_patterns; i++) {
            if (i) fputs(", ", f);
            put_str(f, src->pattern[i]);
        }
        fputs("];\n", f);
    }
    if (src->kind == LOOM_SRC_CSV) {
        char d[2] = {src->csv.delimiter, 0};
        kv_bool(f, 3, "header", src->csv.header);
        kv_str(f, 3, "delimiter", d);
        fputs("      columns: {\n", f);
        for (int i = 0; i < src->n_features; i++) {
            const loom_csv_column *c = &src->csv.columns[i];
            fprintf(f, "        %s = { dtype = ", src->feature[i]);
            put_str(f, loom_cfg_name_(loom_csv_dtype_names_, (int)c->dtype));
            if ((int)c->dtype == LOOM_CSV_STRING) fprintf(f, "; max_length = %d", c->max_length);
            if (c->index >= 0 && c->count > 0) {
                fprintf(f, "; index = \"%d-%d\"", c->index, c->index + c->count - 1);
            } else if (c->index >= 0) {
                fprintf(f, "; index = %d", c->index);
            } else if (strcmp(c->column, src->feature[i])) {
                fputs("; column = ", f);
                put_str(f, c->column);
            }
            if (c->has_default) {
                fputs("; default = ", f);
                put_value(f, c->dtype, c->default_value);
            }
            fputs("; };\n", f);
        }
        fputs("      };\n", f);
    } else if (src->kind == LOOM_SRC_TEXT) {
        kv_i64(f, 3, "max_length", src->text.max_length);
        kv_bool(f, 3, "truncate", src->text.truncate);
        if (src->text.record_separator[0]) kv_str(f, 3, "record_separator", src->text.record_separator);
        if (src->text.file_feature[0]) kv_str(f, 3, "file_feature", src->text.file_feature);
    } else if (src->kind == LOOM_SRC_SYNTHETIC) {
        kv_i64(f, 3, "count", src->synthetic.count);
        if (src->synthetic.ctr.on) {
            const loom_syn_ctr *k = &src->synthetic.ctr;
            fputs("      ctr: {\n", f);
            kv_i64(f, 4, "columns", k->columns);
            kv_i64(f, 4, "ids_per_column", k->ids_per_column);
            kv_i64(f, 4, "id_space", k->id_space);
            kv_i64(f, 4, "vocab", k->vocab);
            kv_f64(f, 4, "zipf", k->zipf);
            kv_f64(f, 4, "weight_std", k->weight_std);
            kv_f64(f, 4, "bias", k->bias);
            kv_i64(f, 4, "offset", k->offset);
            fputs("      };\n", f);
        }
        if (src->n_features) fputs("      features: {\n", f);
        for (int i = 0; i < src->n_features; i++) {
            const loom_syn_feature *s = &src->synthetic.features[i];
            fprintf(f, "        %s = { dtype = ", src->feature[i]);
            put_str(f, loom_cfg_name_(loom_cfg_dtype_names_, (int)s->dtype));
            fputs("; shape = ", f);
            put_i64_array(f, s->shape, s->rank);
            fputs("; distribution = ", f);
            put_str(f, loom_cfg_name_(loom_syn_dist_names_, (int)s->dist));
            if (s->dist == LOOM_SYN_UNIFORM) {
                fputs("; min = ", f);
                put_value(f, s->dtype, s->min);
                fputs("; max = ", f);
                put_value(f, s->dtype, s->max);
            } else {
                fputs("; mean = ", f);
                put_f64(f, s->mean);
                fputs("; std = ", f);
                put_f64(f, s->std);
            }
            fputs("; };\n", f);
        }
        if (src->n_features) fputs("      };\n", f);
    }
}

/* A plugin provider's options group (values as the text the plugin gets). */
static void print_plugin_opts(FILE *f, int level, const char *name, const loom_plugin_opts *o)
{
    ind(f, level);
    fprintf(f, "%s: {\n", name);
    for (int i = 0; i < o->n; i++) kv_str(f, level + 1, o->key[i], o->value[i]);
    ind(f, level);
    fputs("};\n", f);
}

/* A plugin map's or filter's function: plugin and args, or lua. */
static void print_custom_fn(FILE *f, const loom_map_spec *m)
{
    if (!m->provider[0]) {
        kv_str(f, 4, "lua", m->lua);
        return;
    }
    char ref[sizeof m->provider + sizeof m->lua + 1];
    snprintf(ref, sizeof ref, "%s:%s", m->provider, m->lua);
    kv_str(f, 4, "plugin", ref);
    print_plugin_opts(f, 4, "args", &m->args);
}

/* The settings of a source group (its braces are the caller's). An
 * interleave's source has no patterns: files are then left out. */
static void print_source(FILE *f, const loom_source_spec *src)
{
    if (src->kind == LOOM_SRC_PLUGIN) {
        kv_str(f, 3, "type", src->plugin.name);
        print_plugin_opts(f, 3, "options", &src->plugin.options);
        return;
    }
    kv_str(f, 3, "type", loom_cfg_name_(loom_source_names_, (int)src->kind));
    if (src->kind == LOOM_SRC_LIST_FILES) {
        fputs("      files = [", f);
        for (int i = 0; i < src->n_patterns; i++) {
            if (i) fputs(", ", f);
            put_str(f, src->pattern[i]);
        }
        fputs("];\n", f);
        kv_bool(f, 3, "shuffle", src->shuffle_files);
        if (src->list_files.seed_set) kv_i64(f, 3, "seed", (int64_t)src->list_files.seed);
    } else if (src->kind == LOOM_SRC_IDX) {
        fputs("      features: {\n", f);
        for (int i = 0; i < src->n_features; i++) kv_str(f, 4, src->feature[i], src->idx.file[i]);
        fputs("      };\n", f);
    } else if (src->kind == LOOM_SRC_TFRECORD) {
        if (src->n_patterns) {
            fputs("      files = [", f);
            for (int i = 0; i < src->n_patterns; i++) {
                if (i) fputs(", ", f);
                put_str(f, src->pattern[i]);
            }
            fputs("];\n", f);
        }
        kv_str(f, 3, "compression", loom_cfg_name_(loom_tfr_comp_names_, (int)src->tfrecord.compression));
        kv_str(f, 3, "on_corrupt", loom_cfg_name_(loom_tfr_corrupt_names_, (int)src->tfrecord.on_corrupt));
        kv_bool(f, 3, "shuffle_files", src->shuffle_files);
        fputs("      features: {\n", f);
        for (int i = 0; i < src->n_features; i++) {
            const loom_tfr_feature *t = &src->tfrecord.features[i];
            bool integral = t->dtype != LOOM_TFR_FLOAT32; /* default and pad read back as integers */
            fprintf(f, "        %s = { dtype = ", src->feature[i]);
            put_str(f, loom_cfg_name_(loom_tfr_dtype_names_, (int)t->dtype));
            fputs("; shape = ", f);
            put_i64_array(f, t->shape, t->rank);
            if (t->has_default) {
                fputs("; default = ", f);
                if (integral) put_i64(f, (int64_t)t->default_value);
                else put_f64(f, t->default_value);
            }
            fprintf(f, "; var_len = %s", t->var_len ? "true" : "false");
            if (t->var_len) {
                fputs("; pad = ", f);
                if (integral) put_i64(f, (int64_t)t->pad);
                else put_f64(f, t->pad);
            }
            fputs("; };\n", f);
        }
        fputs("      };\n", f);
    } else if (src->kind == LOOM_SRC_CSV || src->kind == LOOM_SRC_TEXT || src->kind == LOOM_SRC_SYNTHETIC) {
        print_csv_text_synthetic(f, src);
    } else {
        kv_str(f, 3, "name", src->catalog.name);
        kv_str(f, 3, "split", src->catalog.split);
    }
}

static void print_dataset(FILE *f, const char *name, const loom_dataset_spec *ds);

/* A map's fn and settings (an op = "map" transform t). */
static void print_map(FILE *f, const loom_transform_spec *t)
{
    const loom_map_spec *m = &t->map;
    if (!m->provider[0]) kv_str(f, 4, "fn", loom_map_kind_name(m->kind)); /* a plugin map has no fn */
    if (m->kind != LOOM_MAP_LUA) kv_str(f, 4, "feature", m->feature);
    switch (m->kind) {
    case LOOM_MAP_CAST: kv_str(f, 4, "dtype", loom_cfg_name_(loom_cfg_dtype_names_, (int)m->dtype)); break;
    case LOOM_MAP_SCALE:
        kv_f64(f, 4, "scale", m->scale);
        kv_f64(f, 4, "offset", m->offset);
        break;
    case LOOM_MAP_NORMALIZE:
        if (m->adapt) {
            kv_bool(f, 4, "adapt", true);
            kv_str(f, 4, "mode", loom_cfg_name_(loom_norm_mode_names_, (int)m->norm_mode));
        } else if (m->n_norm) {
            for (int k = 0; k < 2; k++) {
                ind(f, 4);
                fputs(k ? "std = [" : "mean = [", f);
                for (int j = 0; j < m->n_norm; j++) {
                    if (j) fputs(", ", f);
                    put_f64(f, (double)(k ? m->std_v[j] : m->mean_v[j]));
                }
                fputs("];\n", f);
            }
        } else {
            kv_f64(f, 4, "mean", m->mean);
            kv_f64(f, 4, "std", m->std);
        }
        break;
    case LOOM_MAP_ONE_HOT: kv_i64(f, 4, "depth", m->depth); break;
    case LOOM_MAP_STRING_LOOKUP:
        kv_bool(f, 4, "adapt", m->adapt);
        kv_i64(f, 4, "max_tokens", m->max_tokens);
        kv_i64(f, 4, "num_oov_indices", m->num_oov_indices);
        break;
    case LOOM_MAP_RESHAPE:
        ind(f, 4);
        fputs("shape = ", f);
        put_i64_array(f, m->shape, m->rank);
        fputs(";\n", f);
        break;
    case LOOM_MAP_FLIP_LR: break;
    case LOOM_MAP_PAD:
        kv_i64(f, 4, "padding", m->padding);
        kv_f64(f, 4, "value", m->value);
        break;
    case LOOM_MAP_RANDOM_CROP:
        ind(f, 4);
        fprintf(f, "size = [%d, %d];\n", m->size[0], m->size[1]);
        break;
    case LOOM_MAP_STANDARDIZE: break;
    case LOOM_MAP_SLEEP: kv_f64(f, 4, "ms", m->ms); break;
    case LOOM_MAP_LUA: print_custom_fn(f, m); break;
    case LOOM_MAP_DECODE_IMAGE:
        kv_i64(f, 4, "channels", m->channels);
        kv_str(f, 4, "dtype", loom_cfg_name_(loom_cfg_dtype_names_, (int)m->dtype));
        ind(f, 4);
        if (m->max_size[0]) fprintf(f, "max_size = [%d, %d];\n", m->max_size[0], m->max_size[1]);
        else fprintf(f, "size = [%d, %d];\n", m->size[0], m->size[1]);
        break;
    case LOOM_MAP_RESIZE:
        ind(f, 4);
        fprintf(f, "size = [%d, %d];\n", m->size[0], m->size[1]);
        break;
    case LOOM_MAP_CENTRAL_CROP: kv_f64(f, 4, "fraction", m->fraction); break;
    case LOOM_MAP_RANDOM_BRIGHTNESS: kv_f64(f, 4, "max_delta", m->max_delta); break;
    case LOOM_MAP_RANDOM_CONTRAST:
        kv_f64(f, 4, "lower", m->lower);
        kv_f64(f, 4, "upper", m->upper);
        break;
    case LOOM_MAP_TOKENIZE:
        kv_str(f, 4, "mode", loom_cfg_name_(loom_tok_mode_names_, (int)m->tok_mode));
        kv_str(f, 4, "standardize", loom_cfg_name_(loom_tok_std_names_, (int)m->standardize));
        if (m->vocabulary_file[0]) kv_str(f, 4, "vocabulary_file", m->vocabulary_file);
        kv_bool(f, 4, "adapt", m->adapt);
        kv_i64(f, 4, "max_tokens", m->max_tokens);
        kv_i64(f, 4, "num_oov_indices", m->num_oov_indices);
        if (m->output_sequence_length) kv_i64(f, 4, "output_sequence_length", m->output_sequence_length);
        kv_str(f, 4, "on_invalid", loom_cfg_name_(loom_tok_invalid_names_, (int)m->on_invalid));
        break;
    }
    if (t->parallel == LOOM_PARALLEL_AUTO) kv_str(f, 4, "parallel", "auto");
    else kv_i64(f, 4, "parallel", t->parallel > 0 ? t->parallel : 1);
    kv_bool(f, 4, "deterministic", t->deterministic);
}

/* A filter's predicate: a custom function, a range or a list of values. */
static void print_filter(FILE *f, const loom_transform_spec *t)
{
    if (t->filter == LOOM_FILTER_LUA) {
        print_custom_fn(f, &t->map);
        return;
    }
    kv_str(f, 4, "feature", t->feature);
    if (t->filter == LOOM_FILTER_RANGE) {
        if (isfinite(t->min)) kv_f64(f, 4, "min", t->min);
        if (isfinite(t->max)) kv_f64(f, 4, "max", t->max);
    } else {
        ind(f, 4);
        fputs(t->filter == LOOM_FILTER_IN ? "in = [" : "not_in = [", f);
        for (int j = 0; j < t->n_values; j++) {
            if (j) fputs(", ", f);
            put_f64(f, t->values[j]);
        }
        fputs("];\n", f);
    }
}

static void print_padded_batch(FILE *f, const loom_transform_spec *t)
{
    kv_bool(f, 4, "drop_remainder", t->drop_remainder);
    if (t->padded.mask[0]) kv_str(f, 4, "mask", t->padded.mask);
    if (t->kind == LOOM_T_BUCKET) {
        kv_str(f, 4, "feature", t->feature);
        ind(f, 4);
        fputs("bucket_boundaries = ", f);
        put_i64_array(f, t->padded.boundary, t->padded.n_boundaries);
        fputs(";\n", f);
        ind(f, 4);
        fputs("bucket_batch_sizes = ", f);
        put_i64_array(f, t->padded.bucket_size, t->padded.n_boundaries + 1);
        fputs(";\n", f);
        kv_bool(f, 4, "pad_to_bucket_boundary", t->padded.pad_to_bucket_boundary);
    } else {
        kv_i64(f, 4, "size", t->batch_size);
        ind(f, 4);
        fputs("padded_shapes: {", f);
        for (int j = 0; j < t->padded.n_shapes; j++) {
            fprintf(f, " %s = ", t->padded.shape_name[j]);
            put_i64_array(f, t->padded.shape[j], t->padded.rank[j]);
            fputc(';', f);
        }
        fputs(" };\n", f);
    }
    ind(f, 4);
    fputs("padding_values: {", f);
    for (int j = 0; j < t->padded.n_values; j++) {
        fprintf(f, " %s = ", t->padded.value_name[j]);
        put_f64(f, t->padded.value[j]);
        fputc(';', f);
    }
    fputs(" };\n", f);
}

/* One transform's settings after its op. */
static void print_transform(FILE *f, const loom_transform_spec *t)
{
    switch (t->kind) {
    case LOOM_T_MAP: print_map(f, t); break;
    case LOOM_T_SHUFFLE:
        kv_i64(f, 4, "buffer", t->buffer);
        if (t->seed_set) kv_i64(f, 4, "seed", (int64_t)t->seed);
        kv_bool(f, 4, "reshuffle", t->reshuffle);
        break;
    case LOOM_T_BATCH:
        kv_i64(f, 4, "size", t->batch_size);
        kv_bool(f, 4, "drop_remainder", t->drop_remainder);
        break;
    case LOOM_T_REPEAT:
    case LOOM_T_TAKE:
    case LOOM_T_SKIP: kv_i64(f, 4, "count", t->count); break;
    case LOOM_T_PREFETCH: kv_i64(f, 4, "buffer", t->buffer); break;
    case LOOM_T_FILTER: print_filter(f, t); break;
    case LOOM_T_CONCAT:
    case LOOM_T_SELECT:
        ind(f, 4);
        fputs("features = [", f);
        for (int j = 0; j < t->features.n; j++) {
            if (j) fputs(", ", f);
            put_str(f, t->features.name[j]);
        }
        fputs("];\n", f);
        if (t->kind == LOOM_T_CONCAT) kv_str(f, 4, "output", t->features.output);
        break;
    case LOOM_T_SPLIT:
        kv_f64(f, 4, "fraction", t->fraction);
        kv_str(f, 4, "part", t->part == LOOM_SPLIT_EVAL ? "eval" : "train");
        if (t->seed_set) kv_i64(f, 4, "seed", (int64_t)t->seed);
        break;
    case LOOM_T_SHARD:
        kv_i64(f, 4, "num_shards", t->num_shards);
        kv_i64(f, 4, "index", t->index);
        break;
    case LOOM_T_ENUMERATE:
        kv_str(f, 4, "feature", t->feature);
        kv_i64(f, 4, "start", t->start);
        break;
    case LOOM_T_UNBATCH: break;
    case LOOM_T_PADDED_BATCH:
    case LOOM_T_BUCKET: print_padded_batch(f, t); break;
    case LOOM_T_WINDOW:
        kv_i64(f, 4, "size", t->batch_size);
        kv_i64(f, 4, "shift", t->shift);
        kv_i64(f, 4, "stride", t->stride);
        kv_bool(f, 4, "drop_remainder", t->drop_remainder);
        break;
    case LOOM_T_LM_PAIRS:
        kv_str(f, 4, "feature", t->feature);
        kv_str(f, 4, "input", t->input_name);
        kv_str(f, 4, "target", t->target_name);
        kv_bool(f, 4, "target_last", t->target_last);
        break;
    case LOOM_T_FLAT_MAP:
        fputs("        source: {\n", f);
        if (t->source) print_source(f, t->source);
        fputs("        };\n", f);
        break;
    case LOOM_T_CACHE:
        if (t->cache_file[0]) kv_str(f, 4, "file", t->cache_file);
        break;
    case LOOM_T_INTERLEAVE:
        kv_i64(f, 4, "cycle_length", t->cycle_length);
        kv_i64(f, 4, "block_length", t->block_length);
        if (t->parallel == LOOM_PARALLEL_AUTO) kv_str(f, 4, "parallel", "auto");
        else kv_i64(f, 4, "parallel", t->parallel > 0 ? t->parallel : 1);
        kv_bool(f, 4, "deterministic", t->deterministic);
        fputs("        source: {\n", f);
        if (t->source) print_source(f, t->source);
        fputs("        };\n", f);
        break;
    case LOOM_T_ZIP:
        if (t->dataset) print_dataset(f, "dataset", t->dataset); /* nested: indentation is cosmetic */
        break;
    }
}

static void print_dataset(FILE *f, const char *name, const loom_dataset_spec *ds)
{
    fprintf(f, "  %s: {\n    source: {\n", name);
    print_source(f, &ds->source);
    fputs("    };\n    transforms = (", f);
    for (int i = 0; i < ds->n_transforms; i++) {
        const loom_transform_spec *t = &ds->transform[i];
        fprintf(f, "%s\n      {\n", i ? "," : "");
        kv_str(f, 4, "op", loom_transform_kind_name(t->kind));
        print_transform(f, t);
        fputs("      }", f);
    }
    fputs(ds->n_transforms ? "\n    );\n" : ");\n", f);
    kv_str(f, 2, "shard_policy", loom_cfg_name_(loom_shard_policy_names_, (int)ds->shard_policy));
    if (ds->on_nonfinite != LOOM_NONFINITE_ERROR)
        kv_str(f, 2, "on_nonfinite", loom_cfg_name_(loom_nonfinite_names_, (int)ds->on_nonfinite));
    fputs("  };\n", f);
}

/* mirrored, central_storage: the devices as listed, or the replica count
 * (absent: one per core). */
static void print_replicated_strategy(FILE *f, const loom_strategy_spec *st)
{
    if (st->devices_listed) {
        fputs("  devices = [", f);
        for (int i = 0; i < st->n_devices; i++) {
            if (i) fputs(", ", f);
            put_str(f, st->devices[i]);
        }
        fputs("];\n", f);
    } else if (st->replicas > 0) {
        kv_i64(f, 1, "replicas", st->replicas);
    }
    if (st->kind == LOOM_STRAT_MULTI_WORKER_MIRRORED) kv_str(f, 1, "communication", loom_communication_name(st->communication));
    if (st->kind == LOOM_STRAT_MULTI_WORKER_MIRRORED && st->compression != LOOM_COMPRESS_NONE) {
        kv_str(f, 1, "compression", loom_grad_compression_name(st->compression));
        if (st->compression_error_feedback) kv_bool(f, 1, "compression_error_feedback", true);
    }
    if (st->kind == LOOM_STRAT_MIRRORED || st->kind == LOOM_STRAT_MULTI_WORKER_MIRRORED) {
        kv_str(f, 1, "cross_device_ops", st->cross_device_ops);
        if (st->bytes_per_pack > 0)
            kv_i64(f, 1, "bytes_per_pack", st->bytes_per_pack);
        else
            kv_i64(f, 1, "num_packs", st->num_packs);
    } else if (strcmp(st->cross_device_ops, "reduce_to_one_device")) { /* central_storage: only an op it uses */
        kv_str(f, 1, "cross_device_ops", st->cross_device_ops);
    }
    if (st->collective_timeout > 0) kv_f64(f, 1, "collective_timeout", st->collective_timeout);
    if (st->elastic.enabled) {
        ind(f, 1);
        fputs("elastic = {\n", f);
        kv_i64(f, 2, "min_workers", st->elastic.min_workers);
        kv_i64(f, 2, "max_workers", st->elastic.max_workers);
        kv_f64(f, 2, "wait_timeout", st->elastic.wait_timeout);
        kv_f64(f, 2, "start_timeout", st->elastic.start_timeout);
        ind(f, 1);
        fputs("};\n", f);
    }
}

/* A plugin strategy's replicas, op and options; an option's text is printed
 * bare when it reads back as a number or a boolean, else quoted. */
static void print_plugin_strategy(FILE *f, const loom_strategy_spec *st)
{
    kv_i64(f, 1, "replicas", st->replicas);
    kv_str(f, 1, "cross_device_ops", st->cross_device_ops);
    fputs("  options: {\n", f);
    for (int i = 0; i < st->n_options; i++) {
        const char *v = st->option_value[i];
        char *end;
        (void)strtod(v, &end);
        bool bare = (*v && !*end && !isspace((unsigned char)*v)) || !strcmp(v, "true") || !strcmp(v, "false");
        fprintf(f, "    %s = ", st->option_key[i]);
        if (bare)
            fputs(v, f);
        else
            put_str(f, v);
        fputs(";\n", f);
    }
    fputs("  };\n", f);
}

/* plugins = { path = [...]; require = [...]; } with the directories resolved. */
static void print_plugins(FILE *f, const loom_plugins_spec *p)
{
    fputs("\nplugins: {\n  path = [", f);
    for (int i = 0; i < p->n_path; i++) {
        if (i) fputs(", ", f);
        put_str(f, p->path[i]);
    }
    fputs("];\n  require = [", f);
    for (int i = 0; i < p->n_require; i++) {
        if (i) fputs(", ", f);
        put_str(f, p->require[i]);
    }
    fputs("];\n};\n", f);
}

/* lstm, gru, bidirectional */
static void print_rnn(FILE *f, const loom_layer_spec *l)
{
    kv_i64(f, 3, "units", l->units);
    kv_bool(f, 3, "return_sequences", l->return_sequences);
    if (l->return_state) kv_bool(f, 3, "return_state", l->return_state);
    kv_str(f, 3, "activation", loom_activation_name(l->activation));
    kv_str(f, 3, "recurrent_activation", loom_activation_name(l->recurrent_activation));
    kv_str(f, 3, "kernel_init", loom_cfg_name_(loom_init_names_, (int)l->kernel_init));
    kv_str(f, 3, "recurrent_init", loom_cfg_name_(loom_init_names_, (int)l->recurrent_init));
    kv_bool(f, 3, "use_bias", l->use_bias);
    if (l->kind == LOOM_LAYER_GRU || (l->kind == LOOM_LAYER_BIDIRECTIONAL && l->cell == 1))
        kv_bool(f, 3, "reset_after", l->reset_after);
    else
        kv_bool(f, 3, "unit_forget_bias", l->unit_forget_bias);
    if (l->kind == LOOM_LAYER_BIDIRECTIONAL) {
        kv_str(f, 3, "layer", loom_cfg_name_(loom_cell_names_, l->cell));
        kv_str(f, 3, "merge_mode", loom_cfg_name_(loom_merge_mode_names_, l->merge_mode));
    }
}

/* multi_head_attention, positional_embedding (a transformer_block is printed as its parts) */
static void print_attention(FILE *f, const loom_layer_spec *l)
{
    if (l->kind == LOOM_LAYER_POSITIONAL_EMBEDDING) {
        kv_i64(f, 3, "max_length", l->max_length);
        kv_str(f, 3, "mode", loom_cfg_name_(loom_pos_mode_names_, (int)l->pos_mode));
        return;
    }
    kv_i64(f, 3, "num_heads", l->num_heads);
    kv_i64(f, 3, "key_dim", l->key_dim);
    if (l->value_dim) kv_i64(f, 3, "value_dim", l->value_dim);
    kv_f64(f, 3, "dropout", l->rate);
    kv_bool(f, 3, "causal", l->causal);
    kv_str(f, 3, "kernel_init", loom_cfg_name_(loom_init_names_, (int)l->kernel_init));
    kv_bool(f, 3, "use_bias", l->use_bias);
}

static void print_layer(FILE *f, const loom_layer_spec *l)
{
    /* a plugin's layer: its registered type and its own settings, as text (they reach the plugin so) */
    kv_str(f, 3, "type", l->kind == LOOM_LAYER_PLUGIN ? l->plugin : loom_layer_kind_name(l->kind));
    kv_str(f, 3, "name", l->name);
    switch (l->kind) {
    case LOOM_LAYER_PLUGIN:
        for (int i = 0; i < l->settings.n; i++) kv_str(f, 3, l->settings.key[i], l->settings.value[i]);
        break;
    case LOOM_LAYER_DENSE: kv_i64(f, 3, "units", l->units); break;
    case LOOM_LAYER_CONV2D:
        kv_i64(f, 3, "filters", l->filters);
        kv_pair(f, 3, "kernel_size", l->kernel);
        kv_pair(f, 3, "strides", l->stride);
        kv_str(f, 3, "padding", loom_cfg_name_(loom_padding_names_, (int)l->padding));
        kv_pair(f, 3, "dilation_rate", l->dilation);
        kv_i64(f, 3, "groups", l->groups);
        if (l->algorithm) kv_str(f, 3, "algorithm", loom_cfg_name_(loom_conv_algorithm_names_, (int)l->algorithm));
        break;
    case LOOM_LAYER_MAX_POOL2D:
    case LOOM_LAYER_AVG_POOL2D:
        kv_pair(f, 3, "pool_size", l->pool);
        kv_pair(f, 3, "strides", l->stride);
        kv_str(f, 3, "padding", loom_cfg_name_(loom_padding_names_, (int)l->padding));
        break;
    case LOOM_LAYER_DROPOUT: kv_f64(f, 3, "rate", l->rate); break;
    case LOOM_LAYER_FLATTEN: break;
    case LOOM_LAYER_ACTIVATION:
        if (l->activation == LOOM_ACT_LEAKY_RELU) kv_f64(f, 3, "alpha", l->alpha);
        break;
    case LOOM_LAYER_BATCH_NORM:
        kv_f64(f, 3, "momentum", l->momentum);
        kv_f64(f, 3, "epsilon", l->epsilon);
        if (l->sync) kv_bool(f, 3, "sync", l->sync);
        break;
    case LOOM_LAYER_LAYER_NORM: kv_f64(f, 3, "epsilon", l->epsilon); break;
    case LOOM_LAYER_DEPTHWISE_CONV2D:
    case LOOM_LAYER_SEPARABLE_CONV2D:
    case LOOM_LAYER_CONV2D_TRANSPOSE:
        if (l->kind != LOOM_LAYER_DEPTHWISE_CONV2D) kv_i64(f, 3, "filters", l->filters);
        if (l->kind != LOOM_LAYER_CONV2D_TRANSPOSE) kv_i64(f, 3, "depth_multiplier", l->depth_multiplier);
        kv_pair(f, 3, "kernel_size", l->kernel);
        kv_pair(f, 3, "strides", l->stride);
        kv_pair(f, 3, "dilation_rate", l->dilation);
        kv_str(f, 3, "padding", loom_cfg_name_(loom_padding_names_, (int)l->padding));
        break;
    case LOOM_LAYER_CONV1D:
        kv_i64(f, 3, "filters", l->filters);
        kv_i64(f, 3, "kernel_size", l->kernel[1]);
        kv_i64(f, 3, "strides", l->stride[1]);
        kv_i64(f, 3, "dilation_rate", l->dilation[1]);
        kv_i64(f, 3, "groups", l->groups);
        kv_str(f, 3, "padding", loom_cfg_name_(loom_padding_names_, (int)l->padding));
        break;
    case LOOM_LAYER_ZERO_PADDING2D:
        ind(f, 3);
        fprintf(f, "padding = ([%d, %d], [%d, %d]);\n", l->pad[0], l->pad[1], l->pad[2], l->pad[3]);
        break;
    case LOOM_LAYER_UPSAMPLING2D: kv_pair(f, 3, "size", l->size); break;
    case LOOM_LAYER_RESHAPE:
        ind(f, 3);
        fputs("target_shape = [", f);
        for (int i = 0; i < l->n_target; i++) fprintf(f, "%s%lld", i ? ", " : "", (long long)l->target[i]);
        fputs("];\n", f);
        break;
    case LOOM_LAYER_EMBEDDING:
        kv_i64(f, 3, "input_dim", l->input_dim);
        kv_i64(f, 3, "output_dim", l->output_dim);
        kv_str(f, 3, "combiner", loom_cfg_name_(loom_combiner_names_, (int)l->combiner));
        if (l->mask_zero) kv_bool(f, 3, "mask_zero", l->mask_zero);
        break;
    case LOOM_LAYER_LSTM:
    case LOOM_LAYER_GRU:
    case LOOM_LAYER_BIDIRECTIONAL: print_rnn(f, l); break;
    case LOOM_LAYER_CONCATENATE: kv_i64(f, 3, "axis", l->axis); break;
    case LOOM_LAYER_MULTI_HEAD_ATTENTION:
    case LOOM_LAYER_POSITIONAL_EMBEDDING: print_attention(f, l); break;
    default: break;
    }
    if (l->n_inputs) {
        fputs("      inputs = [", f);
        for (int i = 0; i < l->n_inputs; i++) {
            fputs(i ? ", " : "", f);
            put_str(f, l->inputs[i]);
        }
        fputs("];\n", f);
    }
    bool kernel = l->kind == LOOM_LAYER_DENSE || l->kind == LOOM_LAYER_CONV2D || l->kind == LOOM_LAYER_CONV1D ||
                  l->kind == LOOM_LAYER_DEPTHWISE_CONV2D || l->kind == LOOM_LAYER_SEPARABLE_CONV2D ||
                  l->kind == LOOM_LAYER_CONV2D_TRANSPOSE;
    if (kernel || l->kind == LOOM_LAYER_ACTIVATION) kv_str(f, 3, "activation", loom_activation_name(l->activation));
    if (kernel) {
        kv_str(f, 3, "kernel_init", loom_cfg_name_(loom_init_names_, (int)l->kernel_init));
        kv_bool(f, 3, "use_bias", l->use_bias);
    }
}

static void print_options(FILE *f, const loom_data_options *o)
{
    fputs("  options: {\n", f);
    kv_bool(f, 2, "deterministic", o->deterministic);
    fputs("    autotune: {\n", f);
    kv_bool(f, 3, "enabled", o->autotune);
    kv_i64(f, 3, "cpu_budget", o->cpu_budget);
    if (o->ram_budget > 0) {
        ind(f, 3);
        fputs("ram_budget = ", f);
        put_int(f, o->ram_budget, o->ram_budget > INT32_MAX);
        fputs(";\n", f);
    } else {
        char pct[40];
        snprintf(pct, sizeof pct, "%.15g%%", o->ram_fraction * 100.0);
        kv_str(f, 3, "ram_budget", pct);
    }
    fputs("    };\n    optimization: {\n", f);
    kv_bool(f, 3, "noop_elimination", o->noop_elimination);
    kv_bool(f, 3, "map_and_batch_fusion", o->map_and_batch_fusion);
    kv_bool(f, 3, "map_fusion", o->map_fusion);
    kv_bool(f, 3, "shuffle_and_repeat_fusion", o->shuffle_and_repeat_fusion);
    kv_bool(f, 3, "map_parallelization", o->map_parallelization);
    kv_bool(f, 3, "inject_prefetch", o->inject_prefetch);
    fputs("    };\n  };\n", f);
}

/* { fn = "file.lua:function"; args = { ... }; } */
static void print_hook_ref(FILE *f, const loom_hook_ref *h)
{
    fputs("{ fn = ", f);
    put_str(f, h->ref);
    fputs("; args = {", f);
    for (int i = 0; i < h->n_args; i++) {
        fprintf(f, " %s = ", h->arg_name[i]);
        if (h->arg_type[i] == LOOM_HOOK_ARG_STRING) put_str(f, h->arg_str[i]);
        else if (h->arg_type[i] == LOOM_HOOK_ARG_BOOL) fputs(h->arg_num[i] != 0 ? "true" : "false", f);
        else if (h->arg_type[i] == LOOM_HOOK_ARG_INT) put_i64(f, (int64_t)h->arg_num[i]);
        else put_f64(f, h->arg_num[i]);
        fputc(';', f);
    }
    fputs(" }; }", f);
}

static void print_hooks(FILE *f, const loom_hooks_spec *h)
{
    fputs("\nhooks: {\n  callbacks = (", f);
    for (int i = 0; i < h->n_callbacks; i++) {
        fputs(i ? ",\n    " : "\n    ", f);
        print_hook_ref(f, &h->callback[i]);
    }
    fputs(h->n_callbacks ? "\n  );\n" : ");\n", f);
    if (h->has_train_step) {
        fputs("  train_step = ", f);
        print_hook_ref(f, &h->train_step);
        fputs(";\n", f);
    }
    kv_i64(f, 1, "step_interval", h->step_interval);
    kv_bool(f, 1, "unsafe", h->unsafe);
    kv_i64(f, 1, "memory_limit", h->memory_limit);
    kv_i64(f, 1, "instruction_limit", h->instruction_limit);
    fputs("};\n", f);
}

/* The cluster section, when the config has one: role lists as written,
 * files as resolved. */
static void print_cluster(FILE *f, const loom_cluster_spec *c)
{
    fputs("\ncluster: {\n", f);
    for (int r = 0; r < LOOM_CLUSTER_ROLES; r++) {
        fprintf(f, "  %s = [", loom_cluster_role_keys[r]);
        for (int i = 0; i < c->n_tasks[r]; i++) {
            if (i) fputs(", ", f);
            put_str(f, c->addr[r][i]);
        }
        fputs("];\n", f);
    }
    kv_f64(f, 1, "connect_timeout", c->connect_timeout);
    kv_f64(f, 1, "heartbeat_timeout", c->heartbeat_timeout);
    kv_f64(f, 1, "heartbeat_interval", c->heartbeat_interval);
    if (c->secret_file[0]) kv_str(f, 1, "secret_file", c->secret_file);
    kv_bool(f, 1, "tls", c->tls);
    if (c->tls_cert[0]) kv_str(f, 1, "tls_cert", c->tls_cert);
    if (c->tls_key[0]) kv_str(f, 1, "tls_key", c->tls_key);
    if (c->tls_ca[0]) kv_str(f, 1, "tls_ca", c->tls_ca);
    kv_bool(f, 1, "insecure", c->insecure);
    kv_i64(f, 1, "port_base", c->port_base);
    fputs("};\n", f);
}

static void print_model(FILE *f, const loom_model_spec *m)
{
    fputs("model: {\n", f);
    if (m->n_inputs) {
        fputs("  inputs = [", f);
        for (int i = 0; i < m->n_inputs; i++) {
            fputs(i ? ", " : "", f);
            put_str(f, m->inputs[i]);
        }
        fputs("];\n", f);
    } else {
        kv_str(f, 1, "input", m->input);
    }
    if (!m->n_heads) {
        kv_str(f, 1, "label", m->label);
        kv_str(f, 1, "loss", loom_cfg_name_(loom_loss_names_, (int)m->loss));
    } else { /* the first head's label and loss are the model's */
        fputs("  outputs = (", f);
        for (int h = 0; h < m->n_heads; h++) {
            const struct loom_head_spec *hs = &m->head[h];
            fprintf(f, "%s\n    { layer = ", h ? "," : "");
            put_str(f, hs->layer);
            fputs("; label = ", f);
            put_str(f, hs->label);
            fputs("; loss = ", f);
            put_str(f, loom_cfg_name_(loom_loss_names_, (int)hs->loss));
            fputs("; weight = ", f);
            put_f64(f, hs->weight);
            if (h) fputs(hs->accuracy ? "; metrics = [\"accuracy\"]" : "; metrics = []", f);
            fputs("; }", f);
        }
        fputs("\n  );\n", f);
    }
    if (m->metrics_set) {
        fputs("  metrics = [", f);
        for (int i = 0; i < m->n_metrics; i++) {
            fputs(i ? ", " : "", f);
            put_str(f, loom_cfg_name_(loom_metric_names_, (int)m->metric[i]));
        }
        fputs("];\n", f);
    }
    kv_i64(f, 1, "auc_thresholds", m->auc_thresholds);
    kv_bool(f, 1, "multi_label", m->multi_label);
    kv_i64(f, 1, "top_k", m->top_k);
    kv_f64(f, 1, "huber_delta", m->huber_delta);
    kv_f64(f, 1, "l2", m->l2);
    if (m->ignore_label != -100) kv_i64(f, 1, "ignore_label", m->ignore_label);
    if (m->sample_weight[0]) kv_str(f, 1, "sample_weight", m->sample_weight);
    if (m->n_class_weights) {
        fputs("  class_weight = [", f);
        for (int i = 0; i < m->n_class_weights; i++) {
            fputs(i ? ", " : "", f);
            put_f64(f, m->class_weight[i]);
        }
        fputs("];\n", f);
    }
    fputs("  layers = (", f);
    for (int i = 0; i < m->n_layers; i++) {
        if (m->layer[i].state_of) continue; /* made again from its lstm's or gru's return_state */
        fprintf(f, "%s\n    {\n", i ? "," : "");
        print_layer(f, &m->layer[i]);
        fputs("    }", f);
    }
    fputs("\n  );\n};\n\n", f);
}

static void print_optimizer(FILE *f, const loom_optimizer_spec *o)
{
    fputs("optimizer: {\n", f);
    kv_str(f, 1, "type", loom_cfg_name_(loom_opt_names_, (int)o->kind));
    kv_f64(f, 1, "learning_rate", o->learning_rate);
    if (o->kind == LOOM_OPT_MOMENTUM) {
        kv_f64(f, 1, "momentum", o->momentum);
        kv_bool(f, 1, "nesterov", o->nesterov);
    }
    if (o->kind == LOOM_OPT_ADAM || o->kind == LOOM_OPT_ADAMW) {
        kv_f64(f, 1, "beta1", o->beta1);
        kv_f64(f, 1, "beta2", o->beta2);
    }
    if (o->kind == LOOM_OPT_ADAM || o->kind == LOOM_OPT_ADAMW || o->kind == LOOM_OPT_RMSPROP || o->kind == LOOM_OPT_ADAGRAD)
        kv_f64(f, 1, "epsilon", o->epsilon);
    if (o->kind == LOOM_OPT_ADAMW) kv_f64(f, 1, "weight_decay", o->weight_decay);
    if (o->kind == LOOM_OPT_RMSPROP) kv_f64(f, 1, "rho", o->rho);
    if (o->kind == LOOM_OPT_ADAGRAD) kv_f64(f, 1, "initial_accumulator_value", o->initial_accumulator);
    kv_f64(f, 1, "clip_norm", o->clip_norm);
    const loom_schedule_spec *sch = &o->schedule;
    fputs("  schedule: {\n", f);
    kv_str(f, 2, "type", loom_cfg_name_(loom_sched_names_, (int)sch->kind));
    switch (sch->kind) {
    case LOOM_SCHED_CONSTANT: break;
    case LOOM_SCHED_EXPONENTIAL_DECAY:
        kv_i64(f, 2, "decay_steps", sch->decay_steps);
        kv_f64(f, 2, "decay_rate", sch->decay_rate);
        kv_bool(f, 2, "staircase", sch->staircase);
        break;
    case LOOM_SCHED_PIECEWISE_CONSTANT:
        fputs("    boundaries = ", f);
        put_i64_array(f, sch->boundaries, sch->n_boundaries);
        fputs(";\n    values = [", f);
        for (int i = 0; i <= sch->n_boundaries; i++) {
            if (i) fputs(", ", f);
            put_f64(f, sch->values[i]);
        }
        fputs("];\n", f);
        break;
    case LOOM_SCHED_COSINE:
        kv_i64(f, 2, "decay_steps", sch->decay_steps);
        kv_f64(f, 2, "alpha", sch->alpha);
        break;
    }
    fputs("  };\n};\n\n", f);
}

static void print_strategy(FILE *f, const loom_strategy_spec *st)
{
    fputs("strategy: {\n", f);
    kv_str(f, 1, "type", st->name);
    if (st->kind == LOOM_STRAT_ONE_DEVICE) kv_str(f, 1, "device", st->device);
    if (st->kind == LOOM_STRAT_PLUGIN) print_plugin_strategy(f, st);
    if (st->kind == LOOM_STRAT_MIRRORED || st->kind == LOOM_STRAT_CENTRAL_STORAGE ||
        st->kind == LOOM_STRAT_MULTI_WORKER_MIRRORED)
        print_replicated_strategy(f, st);
    if (st->device_backend[0]) kv_str(f, 1, "device_backend", st->device_backend);
    fputs("};\n\n", f);
}

static void print_run(FILE *f, const loom_run_spec *r)
{
    fputs("run: {\n", f);
    kv_str(f, 1, "model_dir", r->model_dir);
    kv_i64(f, 1, "epochs", r->epochs);
    kv_i64(f, 1, "max_steps", r->max_steps);
    kv_i64(f, 1, "seed", (int64_t)r->seed);
    kv_i64(f, 1, "checkpoint_steps", r->checkpoint_steps);
    kv_f64(f, 1, "checkpoint_secs", r->checkpoint_secs);
    kv_i64(f, 1, "summary_steps", r->summary_steps);
    kv_i64(f, 1, "histogram_epochs", r->histogram_epochs);
    kv_i64(f, 1, "keep_checkpoints", r->keep_checkpoints);
    kv_i64(f, 1, "log_steps", r->log_steps);
    kv_i64(f, 1, "threads", r->threads);
    kv_i64(f, 1, "steps_per_execution", r->steps_per_execution);
    kv_i64(f, 1, "eval_steps", r->eval_steps);
    kv_bool(f, 1, "eval_each_epoch", r->eval_each_epoch);
    kv_str(f, 1, "progress", loom_cfg_name_(loom_progress_names_, (int)r->progress));
    kv_i64(f, 1, "status_port", r->status_port);
    kv_str(f, 1, "status_bind", r->status_bind);
    fputs("};\n", f);
}

void loom_config_print(const loom_spec *s, FILE *f)
{
    fprintf(f, "# %s, resolved by loom %s: every default filled in\n", s->path, LOOM_VERSION);
    fputs("version = 1;\n\ndata: {\n", f);
    print_options(f, &s->train.options);
    print_dataset(f, "train", &s->train);
    if (s->eval.present) print_dataset(f, "eval", &s->eval);
    fputs("};\n\n", f);
    print_model(f, &s->model);
    print_optimizer(f, &s->optimizer);
    print_strategy(f, &s->strategy);
    print_run(f, &s->run);
    print_plugins(f, &s->plugins);
    if (s->hooks.present) print_hooks(f, &s->hooks);
    if (s->cluster.present) print_cluster(f, &s->cluster);
}
