/* config.c - a libconfig file (plus --set overrides) into a validated loom_spec.
 * Each option is declared once in a table (name, type, default, range, help,
 * and the kinds of its group it applies to); a group is parsed against its
 * table for the group's kind (layer type, transform op, ...), then cross-field
 * checks run. Every error carries file:line (or "--set key" for an override)
 * and the setting path, and quotes the offending value.
 * This file holds the name tables, the root of the config, and the load
 * itself; the engine is config_table.c, each section has its own file
 * (config_data.c, config_source.c, config_model.c, config_optimizer.c,
 * config_strategy.c, config_cluster.c, config_run.c, config_hooks.c,
 * config_plugins.c), overrides are config_override.c, printing
 * config_print.c.
 * Threads: none. Ownership: the spec is one allocation, plus the nested source
 * of each interleave and dataset of each zip; loom_config_free frees them all. */
#include "config/config.h"
#include "config/config_internal.h"

#include <libconfig.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

static void parse_version(cfg_ctx *c, const config_setting_t *s, void *base);

/* ---- names --------------------------------------------------------------- */

const char *const loom_cfg_dtype_names_[] = {"uint8", "int32", "int64", "float32", "float64", NULL};
const char *const loom_source_names_[] = {"idx", "catalog", "tfrecord", "csv", "text", "synthetic", "list_files", NULL};
const char *const loom_syn_dist_names_[] = {"uniform", "normal", NULL};
const char *const loom_tfr_dtype_names_[] = {"uint8", "int64", "float32", NULL};
const char *const loom_tfr_comp_names_[] = {"auto", "none", "gzip", "zlib", "zstd", NULL};
const char *const loom_tfr_corrupt_names_[] = {"error", "skip", NULL};
const char *const loom_nonfinite_names_[] = {"error", "skip", NULL};
const char *const loom_shard_policy_names_[] = {"auto", "file", "data", "off", NULL};
const char *const loom_map_names_[] = {"cast", "scale", "normalize", "one_hot", "reshape",
                                       "random_flip_left_right", "pad", "random_crop",
                                       "per_image_standardization", "sleep", "lua",
                                       "decode_image", "resize", "central_crop", "random_brightness", "random_contrast",
                                       "string_lookup", "tokenize", NULL};
const char *const loom_tok_mode_names_[] = {"bytes", "utf8_chars", "whitespace", "vocabulary", NULL};
const char *const loom_tok_std_names_[] = {"default", "none", "lower_and_strip_punctuation", "lower", "strip_punctuation",
                                           NULL};
const char *const loom_tok_invalid_names_[] = {"replace", "error", NULL};
const char *const loom_norm_mode_names_[] = {"mean_std", "min_max", NULL};
const char *const loom_csv_dtype_names_[] = {"uint8", "int32", "int64", "float32", "float64", "string", NULL};
const char *const loom_transform_names_[] = {"map", "shuffle", "batch", "repeat", "take", "skip", "prefetch",
                                             "filter", "shard", "enumerate", "unbatch", "padded_batch", "cache",
                                             "interleave", "zip", "split", "concat", "select",
                                             "window", "lm_pairs", "bucket_by_sequence_length", "flat_map", NULL};
const char *const loom_layer_names_[] = {"dense", "conv2d", "max_pool2d", "dropout", "flatten", "activation",
                                         "batch_normalization", "layer_normalization", "average_pooling2d",
                                         "global_average_pooling2d", "embedding", "zero_padding2d",
                                         "global_max_pooling2d", "reshape", "upsampling2d", "depthwise_conv2d",
                                         "separable_conv2d", "conv2d_transpose", "conv1d", "add", "subtract", "multiply",
                                         "average", "maximum", "concatenate", "lstm", "gru",
                                         "bidirectional", "multi_head_attention", "positional_embedding",
                                         "transformer_block", NULL};
const char *const loom_pos_mode_names_[] = {"learned", "sinusoidal", NULL};
const char *const loom_combiner_names_[] = {"sum", "mean", NULL};
const char *const loom_activation_names_[] = {"none", "relu", "sigmoid", "tanh", "softmax", "leaky_relu", "gelu",
                                              "swish", "hard_swish", "softplus", "elu", "silu", NULL};
const char *const loom_init_names_[] = {"glorot_uniform", "glorot_normal", "he_uniform", "he_normal", "zeros",
                                             "orthogonal", NULL};
const char *const loom_padding_names_[] = {"valid", "same", "causal", NULL};
const char *const loom_conv_algorithm_names_[] = {"auto", "direct", "winograd", NULL};
const char *const loom_loss_names_[] = {"sparse_softmax_cross_entropy", "mean_squared_error", "binary_cross_entropy",
                                        "mean_absolute_error", "huber", NULL};
const char *const loom_metric_names_[] = {"accuracy", "auc", "precision", "recall", "top_k_accuracy", "mae", "rmse",
                                          "perplexity", NULL};
const char *const loom_merge_mode_names_[] = {"concat", "sum", NULL};
const char *const loom_cell_names_[] = {"lstm", "gru", NULL};
const char *const loom_opt_names_[] = {"sgd", "momentum", "adam", "adamw", "rmsprop", "adagrad", NULL};
const char *const loom_sched_names_[] = {"constant", "exponential_decay", "piecewise_constant", "cosine", NULL};
const char *const loom_strategy_names_[] = {"one_device", "mirrored", "central_storage", "multi_worker_mirrored",
                                            "parameter_server", NULL};
const char *const loom_progress_names_[] = {"auto", "bar", "plain", "none", NULL};

const char *loom_cfg_name_(const char *const *names, int i)
{
    for (int k = 0; names[k]; k++)
        if (k == i) return names[k];
    return "?";
}

const char *loom_layer_kind_name(loom_layer_kind k)
{
    return k == LOOM_LAYER_PLUGIN ? "plugin" : loom_cfg_name_(loom_layer_names_, (int)k);
}
const char *loom_activation_name(loom_activation a) { return loom_cfg_name_(loom_activation_names_, (int)a); }
const char *loom_metric_name(loom_metric_kind k) { return loom_cfg_name_(loom_metric_names_, (int)k); }
const char *loom_loss_name(loom_loss_kind k) { return loom_cfg_name_(loom_loss_names_, (int)k); }
const char *loom_strategy_kind_name(loom_strategy_kind k) { return loom_cfg_name_(loom_strategy_names_, (int)k); }
const char *const loom_communication_names_[] = {"auto", "ring", "nccl", "mpi", NULL};
const char *const loom_partitioner_names_[] = {"none", "fixed", "min_size", "max_size", NULL};
const char *loom_partitioner_name(loom_partitioner_kind k) { return loom_cfg_name_(loom_partitioner_names_, (int)k); }
const char *loom_communication_name(loom_communication c) { return loom_cfg_name_(loom_communication_names_, (int)c); }
const char *const loom_grad_compression_names_[] = {"none", "bf16", "fp16", NULL};
const char *loom_grad_compression_name(loom_grad_compression c) { return loom_cfg_name_(loom_grad_compression_names_, (int)c); }
const char *loom_map_kind_name(loom_map_kind k) { return loom_cfg_name_(loom_map_names_, (int)k); }
const char *loom_tok_mode_name(loom_tok_mode m) { return loom_cfg_name_(loom_tok_mode_names_, (int)m); }
const char *loom_tok_std_name(loom_tok_std m) { return loom_cfg_name_(loom_tok_std_names_, (int)m); }
const char *loom_transform_kind_name(loom_transform_kind k) { return loom_cfg_name_(loom_transform_names_, (int)k); }

const char *loom_loc_str(const loom_loc *l, char *buf, size_t n)
{
    if (!buf || n == 0) return buf;
    if (!l || !l->file[0])
        buf[0] = 0;
    else if (l->line > 0)
        snprintf(buf, n, "%s:%d", l->file, l->line);
    else
        snprintf(buf, n, "%s", l->file);
    return buf;
}

static const cfg_opt root_opts[] = {
    O_CUSTOM("version", parse_version, ALL, ALL, "config format version; must be 1"),
    O_SUB("data", 0, ALL, "data.train (required) and data.eval (optional)"),
    O_SUB("model", 0, ALL, "the network: input, label, loss, layers"),
    O_SUB("optimizer", 0, ALL, "type, learning_rate, schedule"),
    O_SUB("strategy", 0, 0, "how the model is placed on devices"),
    O_SUB("run", 0, ALL, "model_dir, epochs, seed, checkpoints"),
    O_SUB("cluster", 0, 0, "the tasks of a multi-process job by role, timeouts, the secret, TLS"),
    O_SUB("hooks", 0, 0, "Lua callbacks, a custom training step, the Lua sandbox"),
    O_SUB("plugins", 0, 0, "plugin directories and plugins that must load"),
    O_END,
};

/* ---- custom options ------------------------------------------------------ */

static void parse_version(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_spec *spec = base;
    char v[300];
    if (!cfg_is_int_(s) || config_setting_get_int64(s) != 1) {
        loom_err *e = cfg_err_(c, s, "unsupported config version %s (this loom reads version = 1)",
                           cfg_value_str_(s, v, sizeof v));
        if (e) loom_err_hint(e, "write `version = 1;`");
        return;
    }
    spec->version = 1;
}

static void validate(cfg_ctx *c, const config_setting_t *root, loom_spec *spec)
{
    cfg_parse_opts_(c, root, root_opts, 0, spec);
    cfg_scope sr = {root_opts, 0, NULL};
    cfg_check_keys_(c, root, &sr, 1);

    cfg_parse_data_(c, root, spec);
    cfg_parse_model_(c, root, &spec->model);
    cfg_parse_optimizer_(c, root, &spec->optimizer);
    cfg_parse_strategy_(c, root, &spec->strategy);
    cfg_check_replicas_batch_(c, root, spec);
    cfg_parse_plugins_(c, root, &spec->plugins);
    cfg_parse_hooks_(c, root, &spec->hooks);
    cfg_parse_cluster_(c, root, &spec->cluster);
    cfg_parse_run_(c, root, spec);
}

/* ---- load ---------------------------------------------------------------- */

/* Orders by file, then line: "--set" errors after the file's, in their order. */
static bool err_before(const loom_err *a, const loom_err *b)
{
    bool sa = !strncmp(a->where, "--set ", 6), sb = !strncmp(b->where, "--set ", 6);
    if (sa || sb) return !sa && sb;
    const char *ca = strrchr(a->where, ':'), *cb = strrchr(b->where, ':');
    size_t fa = ca ? (size_t)(ca - a->where) : strlen(a->where);
    size_t fb = cb ? (size_t)(cb - b->where) : strlen(b->where);
    int c = strncmp(a->where, b->where, fa < fb ? fa : fb);
    if (c || fa != fb) return c ? c < 0 : fa < fb;
    return (ca ? atol(ca + 1) : 0) < (cb ? atol(cb + 1) : 0);
}

static void sort_errors(loom_errlist *errs)
{
    for (int i = 1; i < errs->n; i++) { /* insertion sort: stable */
        loom_err e = errs->e[i];
        int j = i;
        for (; j > 0 && err_before(&e, &errs->e[j - 1]); j--) errs->e[j] = errs->e[j - 1];
        errs->e[j] = e;
    }
}

/* libconfig 1.5 opens the config and its @include'd files itself, with a
 * blocking fopen: each is opened first through loom_open_regular, so a FIFO
 * or a directory is refused by name instead of hanging the parse. from is
 * "file:line" of the @include (NULL for the config itself). */
static int check_files(cfg_ctx *c, const char *path, const char *from, int depth)
{
    loom_err e = {0};
    uint8_t *text;
    size_t len;
    if (loom_read_file_max(path, &text, &len, (uint64_t)64 << 20, &e)) {
        if (e.code == LOOM_ENOMEM) {
            cfg_rawerr_(c, LOOM_ENOMEM, path, "%s", e.msg);
            return LOOM_ENOMEM;
        }
        const char *why = strncmp(e.msg, "cannot open: ", 13) ? e.msg : e.msg + 13;
        loom_err *o = cfg_rawerr_(c, LOOM_EIO, from ? from : path,
                                  from ? "@include \"%s\": %s" : "cannot read the config file: %s%s", from ? path : why,
                                  from ? why : "");
        if (o && e.hint[0]) loom_err_hint(o, "%s", e.hint);
        return LOOM_EIO;
    }
    int rc = 0, line = 1;
    const uint8_t *nul = memchr(text, 0, len);
    if (nul) { /* libconfig's flex scanner exits the process on a NUL byte */
        for (const uint8_t *q = text; q < nul; q++) line += *q == '\n';
        char where[LOOM_PATH_MAX + 16];
        snprintf(where, sizeof where, "%s:%d", path, line);
        loom_err *o = cfg_rawerr_(c, LOOM_ECONFIG, where, "a NUL byte (byte %zu): a config file is text",
                                  (size_t)(nul - text) + 1);
        if (o) loom_err_hint(o, "is this the right file? configs are libconfig text (docs/config.md)");
        loom_free(text);
        return LOOM_ECONFIG;
    }
    for (char *p = (char *)text; !rc && depth < 10 && p < (char *)text + len; line++) {
        char *nl = strchr(p, '\n'), *q = p;
        if (nl) *nl = 0;
        while (*q == ' ' || *q == '\t') q++;
        if (!strncmp(q, "@include", 8)) {
            char *a = strchr(q + 8, '"'), *b = a ? strchr(a + 1, '"') : NULL;
            if (a && !b) { /* libconfig's scanner exits the process on a file name that runs past the line */
                char where[LOOM_PATH_MAX + 16];
                snprintf(where, sizeof where, "%s:%d", path, line);
                loom_err *o = cfg_rawerr_(c, LOOM_ECONFIG, where, "@include: the file name's closing quote is missing");
                if (o) loom_err_hint(o, "write @include \"file.cfg\" on one line");
                rc = LOOM_ECONFIG;
            } else if (a && b) {
                char inc[LOOM_PATH_MAX * 2 + 2], where[LOOM_PATH_MAX * 2 + 32];
                snprintf(inc, sizeof inc, "%s%s%.*s", a[1] == '/' ? "" : c->dir, a[1] == '/' || !c->dir[0] ? "" : "/",
                         (int)(b - a - 1), a + 1);
                snprintf(where, sizeof where, "%s:%d", path, line);
                rc = check_files(c, inc, where, depth + 1);
            }
        }
        if (!nl) break;
        p = nl + 1;
    }
    loom_free(text);
    return rc;
}

static void config_dir(const char *path, char *dir, size_t n)
{
    char tmp[LOOM_PATH_MAX];
    snprintf(tmp, sizeof tmp, "%s", path);
    char *slash = strrchr(tmp, '/');
    if (!slash)
        snprintf(tmp, sizeof tmp, ".");
    else if (slash == tmp)
        tmp[1] = 0;
    else
        *slash = 0;
    char abs[PATH_MAX];
    if (!realpath(tmp, abs) || snprintf(dir, n, "%s", abs) >= (int)n)
        snprintf(dir, n, "%s", tmp); /* unresolvable or too long: relative to the working directory */
}

int loom_config_load(loom_spec **out, const char *path, const char *const *overrides, int n_overrides,
                     loom_errlist *errs)
{
    loom_errlist local;
    if (!errs) errs = &local;
    errs->n = 0;
    *out = NULL;
    cfg_ctx c = {.path = path, .errs = errs};

    if (strlen(path) >= LOOM_PATH_MAX) {
        cfg_rawerr_(&c, LOOM_ECONFIG, path, "config path is too long");
        return LOOM_ECONFIG;
    }
    config_dir(path, c.dir, sizeof c.dir);
    /* the file by its absolute name, so every file:line in a message shows where it is */
    char apath[LOOM_PATH_MAX];
    const char *base = strrchr(path, '/');
    if (c.dir[0] == '/' && snprintf(apath, sizeof apath, "%s/%s", c.dir, base ? base + 1 : path) < (int)sizeof apath)
        path = apath;
    c.path = path;
    int frc = check_files(&c, path, NULL, 0);
    if (frc) return frc;
    const char *slash = strrchr(path, '/');
    snprintf(c.pdir, sizeof c.pdir, "%.*s", slash ? (int)(slash - path + 1) : 0, path);

    config_t cfg;
    config_init(&cfg);
    config_set_include_dir(&cfg, c.dir);
    if (config_read_file(&cfg, path) != CONFIG_TRUE) {
        const char *ef = config_error_file(&cfg);
        char where[LOOM_PATH_MAX + 16];
        if (config_error_type(&cfg) == CONFIG_ERR_FILE_IO) {
            cfg_rawerr_(&c, LOOM_EIO, ef ? ef : path, "cannot read the config file");
            config_destroy(&cfg);
            return LOOM_EIO;
        }
        snprintf(where, sizeof where, "%s:%d", ef ? ef : path, config_error_line(&cfg));
        cfg_rawerr_(&c, LOOM_ECONFIG, where, "syntax error: %s",
               config_error_text(&cfg) ? config_error_text(&cfg) : "unparsable");
        config_destroy(&cfg);
        return LOOM_ECONFIG;
    }

    {
        cfg_int_lits lits = {0};
        cfg_lex_file_(path, c.dir, &lits, 0);
        cfg_fix_wide_ints_(&c, config_root_setting(&cfg), &lits);
    }

    /* the keys of the overrides, kept as hooks on the settings they set */
    char **keys = n_overrides > 0 ? loom_calloc((size_t)n_overrides, sizeof *keys) : NULL;
    if (n_overrides > 0 && !keys) {
        config_destroy(&cfg);
        cfg_rawerr_(&c, LOOM_ENOMEM, "", "out of memory");
        return LOOM_ENOMEM;
    }
    for (int i = 0; i < n_overrides; i++) {
        const char *eq = strchr(overrides[i], '=');
        size_t kl = eq ? (size_t)(eq - overrides[i]) : strlen(overrides[i]);
        keys[i] = loom_alloc(kl + 1);
        if (!keys[i]) {
            cfg_rawerr_(&c, LOOM_ENOMEM, "", "out of memory");
            break;
        }
        memcpy(keys[i], overrides[i], kl);
        keys[i][kl] = 0;
        cfg_apply_override_(&c, &cfg, overrides[i], keys[i]);
    }

    loom_spec *spec = loom_calloc(1, sizeof *spec);
    if (!spec) cfg_rawerr_(&c, LOOM_ENOMEM, "", "out of memory");
    if (spec) {
        snprintf(spec->path, sizeof spec->path, "%s", path);
        validate(&c, config_root_setting(&cfg), spec);
    }
    config_destroy(&cfg);
    for (int i = 0; i < n_overrides; i++) loom_free(keys[i]);
    loom_free(keys);

    if (errs->n) {
        sort_errors(errs);
        loom_config_free(spec);
        for (int i = 0; i < errs->n; i++)
            if (errs->e[i].code == LOOM_ENOMEM) return LOOM_ENOMEM;
        return LOOM_ECONFIG;
    }
    *out = spec;
    return LOOM_OK;
}

/* data.<name> (d) has no batch transform: the error train.c gives when the
 * run opens, here at load. */
static void no_batch(const loom_dataset_spec *d, const char *name, int example, loom_errlist *errs)
{
    for (int i = 0; i < d->n_transforms; i++)
        if (d->transform[i].kind == LOOM_T_BATCH) return;
    if (errs->n >= LOOM_MAX_ERRORS) return;
    char where[LOOM_PATH_MAX + 16];
    loom_err *e = &errs->e[errs->n++];
    loom_err_set(e, LOOM_ECONFIG, loom_loc_str(&d->loc, where, sizeof where), "data.%s.transforms: no batch transform",
                 name);
    loom_err_hint(e, "add { op = \"batch\"; size = %d; } to data.%s.transforms", example, name);
}

int loom_config_check_training(const loom_spec *spec, loom_errlist *errs)
{
    int before = errs->n;
    no_batch(&spec->train, "train", 128, errs);
    if (spec->eval.present) no_batch(&spec->eval, "eval", 256, errs);
    return errs->n > before ? LOOM_ECONFIG : LOOM_OK;
}

/* What zip and interleave transforms hold outside the spec's own allocation. */
static void free_nested(loom_dataset_spec *d)
{
    for (int i = 0; i < d->n_transforms; i++) {
        loom_transform_spec *t = &d->transform[i];
        loom_free(t->source);
        if (t->kind == LOOM_T_MAP && t->map.vocab_owned) { /* string_lookup's adapted vocabulary */
            loom_free(t->map.vocab);
            t->map.vocab = NULL;
            t->map.vocab_owned = false;
        }
        if (t->dataset) free_nested(t->dataset);
        loom_free(t->dataset);
        t->source = NULL;
        t->dataset = NULL;
    }
}

void loom_config_free(loom_spec *s)
{
    if (!s) return;
    free_nested(&s->train);
    free_nested(&s->eval);
    loom_free(s);
}
