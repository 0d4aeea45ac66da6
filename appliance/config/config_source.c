/* config_source.c - a dataset's source: idx, catalog, tfrecord, csv, text,
 * synthetic, list_files and plugin sources, with their feature and column
 * groups.
 * Threads: none. */
#include "config/config_internal.h"

#include <errno.h>
#include <glob.h>
#include <limits.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *const catalog_names[] = {"fashion_mnist", "mnist", NULL};
static const char *const split_names[] = {"train", "test", NULL};

static void parse_features(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_files(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_tfr_features(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_tfr_shape(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_delimiter(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_csv_columns(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_csv_index(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_syn_features(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_syn_ctr(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_syn_shape(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_source_options(cfg_ctx *c, const config_setting_t *s, void *base);

#define SRC(k) K(LOOM_SRC_##k)
const cfg_opt cfg_source_opts_[] = {
    O_KIND(loom_source_spec, "type", kind, 0, loom_source_names_, ALL, "source type"),
    O_CUSTOM("options", parse_source_options, SRC(PLUGIN), 0,
             "a plugin source's options: KEY = number, string or true/false, at most 8"),
    O_CUSTOM("features", parse_features, SRC(IDX), SRC(IDX), "feature name = \"file.idx[.gz]\", 1 to 256"),
    O_STR(loom_source_spec, "name", catalog.name, NULL, catalog_names, SRC(CATALOG), SRC(CATALOG), "catalog dataset"),
    O_STR(loom_source_spec, "split", catalog.split, NULL, split_names, SRC(CATALOG), SRC(CATALOG), "catalog split"),
    O_CUSTOM("files", parse_files, SRC(TFRECORD), SRC(TFRECORD),
             "TFRecord paths or glob patterns, 1 to 16, relative to the config's directory"),
    O_ENUM(loom_source_spec, "compression", tfrecord.compression, LOOM_TFR_COMP_AUTO, loom_tfr_comp_names_,
           SRC(TFRECORD), 0, "auto detects it per file from the leading bytes"),
    O_ENUM(loom_source_spec, "on_corrupt", tfrecord.on_corrupt, LOOM_TFR_CORRUPT_ERROR, loom_tfr_corrupt_names_,
           SRC(TFRECORD), 0, "error, or skip (count and report) bad records"),
    O_BOOL(loom_source_spec, "shuffle_files", shuffle_files, 0, SRC(TFRECORD), "shuffle the file order each epoch"),
    O_CUSTOM("features", parse_tfr_features, SRC(TFRECORD), SRC(TFRECORD),
             "NAME = { dtype = ...; shape = [...]; }, 1 to 256"),
    O_CUSTOM("files", parse_files, SRC(CSV) | SRC(TEXT) | SRC(LIST_FILES), SRC(CSV) | SRC(TEXT) | SRC(LIST_FILES),
             "paths or glob patterns, 1 to 16, relative to the config's directory"),
    O_BOOL(loom_source_spec, "shuffle", shuffle_files, 1, SRC(LIST_FILES), "shuffle the file names each epoch"),
    O_INT(loom_source_spec, "seed", list_files.seed, 0, 0, INT64_MAX, SRC(LIST_FILES), 0,
          "shuffle seed; default run.seed"),
    O_BOOL(loom_source_spec, "header", csv.header, 1, SRC(CSV), "the first record of each file names the columns"),
    O_CUSTOM("delimiter", parse_delimiter, SRC(CSV), 0, "one character, default \",\""),
    O_CUSTOM("columns", parse_csv_columns, SRC(CSV), SRC(CSV), "NAME = { dtype = ...; }, 1 to 256"),
    O_INT(loom_source_spec, "max_length", text.max_length, 0, 1, 1 << 24, SRC(TEXT), SRC(TEXT),
          "bytes of the line feature (zero-padded)"),
    O_BOOL(loom_source_spec, "truncate", text.truncate, 0, SRC(TEXT), "cut longer lines instead of failing"),
    O_STR(loom_source_spec, "record_separator", text.record_separator, "", NULL, SRC(TEXT), 0,
          "a line equal to it ends a record (\"%\" for fortune files): one element per record, its lines joined "
          "with a newline; \"\" = one element per line"),
    O_STR(loom_source_spec, "file_feature", text.file_feature, "", NULL, SRC(TEXT), 0,
          "name of an int64 feature holding the index of the element's file in the sorted file list (a class "
          "label: which file it comes from); \"\" = none"),
    O_INT(loom_source_spec, "count", synthetic.count, 0, -1, INT64_MAX, SRC(SYNTHETIC), SRC(SYNTHETIC),
          "elements per pass; -1 = infinite"),
    O_CUSTOM("features", parse_syn_features, SRC(SYNTHETIC), 0,
             "NAME = { dtype = ...; shape = [...]; }, 1 to 256 (required without ctr)"),
    O_CUSTOM("ctr", parse_syn_ctr, SRC(SYNTHETIC), 0,
             "{ columns = 26; ... }: click-through-rate data (features ids and label) from a known logistic model"),
    O_END,
};

/* One column group of a csv source; the dtype selects the kind. */
static const cfg_opt csv_column_opts[] = {
    O_KIND(loom_csv_column, "dtype", dtype, 0, loom_csv_dtype_names_, ALL,
           "uint8, int32, int64, float32, float64, or string (the field's bytes, for map fn = \"string_lookup\")"),
    O_INT(loom_csv_column, "max_length", max_length, 64, 1, LOOM_MAX_STRING, K(LOOM_CSV_STRING), 0,
          "string: the longest field in bytes (a longer one is an error); the feature is uint8 [max_length]"),
    O_CUSTOM("index", parse_csv_index, ALL, 0,
             "0-based field index, or a range \"a-b\" (inclusive) gathered into one vector feature of shape [b - a + 1]; "
             "required with header = false"),
    O_STR(loom_csv_column, "column", column, "", NULL, ALL, 0, "header name to select; default the feature's name"),
    O_F64(loom_csv_column, "default", default_value, 0.0, 0, 0, F_NO_LO | F_NO_HI, ALL & ~K(LOOM_CSV_STRING), 0,
          "value of an empty field; without it an empty field is an error"),
    O_END,
};

static const cfg_opt syn_ctr_opts[] = {
    O_INT(loom_syn_ctr, "columns", columns, 26, 1, 1024, ALL, 0, "categorical columns"),
    O_INT(loom_syn_ctr, "ids_per_column", ids_per_column, 1, 1, 64, ALL, 0, "ids per column (multi-hot)"),
    O_INT(loom_syn_ctr, "id_space", id_space, (int64_t)1 << 20, 1, (int64_t)1 << 31, ALL, 0,
          "hashed ids fall in [0, id_space)"),
    O_INT(loom_syn_ctr, "vocab", vocab, 10000, 1, (int64_t)1 << 31, ALL, 0, "distinct values per column"),
    O_F64(loom_syn_ctr, "zipf", zipf, 1.1, 0.0, 4.0, 0, ALL, 0, "value popularity exponent; 0 = uniform"),
    O_F64(loom_syn_ctr, "weight_std", weight_std, 0.5, 0.0, 0, F_NO_HI, ALL, 0, "spread of the true weights"),
    O_F64(loom_syn_ctr, "bias", bias, -1.5, 0, 0, F_NO_LO | F_NO_HI, ALL, 0, "the true model's bias"),
    O_INT(loom_syn_ctr, "offset", offset, 0, 0, INT64_MAX / 2, ALL, 0,
          "the source starts at this example of the set (e.g. a held-out split after the training examples)"),
    O_END,
};

/* One feature group of a synthetic source; the dtype selects the kind. */
static const cfg_opt syn_feature_opts[] = {
    O_KIND(loom_syn_feature, "dtype", dtype, 0, loom_cfg_dtype_names_, ALL, "uint8, int32, int64, float32 or float64"),
    O_CUSTOM("shape", parse_syn_shape, ALL, 0, "[] (default) for a scalar, else [d0, d1, ...], each >= 1"),
    O_ENUM(loom_syn_feature, "distribution", dist, LOOM_SYN_UNIFORM, loom_syn_dist_names_, ALL, 0,
           "uniform, or normal (float dtypes)"),
    O_F64(loom_syn_feature, "min", min, 0.0, 0, 0, F_NO_LO | F_NO_HI, ALL, 0, "uniform: lower bound (inclusive)"),
    O_F64(loom_syn_feature, "max", max, 1.0, 0, 0, F_NO_LO | F_NO_HI, ALL, 0,
          "uniform: upper bound (exclusive); required for integer dtypes"),
    O_F64(loom_syn_feature, "mean", mean, 0.0, 0, 0, F_NO_LO | F_NO_HI, ALL, 0, "normal: mean"),
    O_F64(loom_syn_feature, "std", std, 1.0, 0.0, 0, F_LO_OPEN | F_NO_HI, ALL, 0, "normal: standard deviation"),
    O_END,
};

/* One feature group of a tfrecord source; the dtype selects the kind. */
static const cfg_opt tfr_feature_opts[] = {
    O_KIND(loom_tfr_feature, "dtype", dtype, 0, loom_tfr_dtype_names_, ALL,
           "uint8 (one bytes value), int64 (int64_list) or float32 (float_list)"),
    O_CUSTOM("shape", parse_tfr_shape, ALL, ALL, "[] for a scalar, else [d0, d1, ...], each >= 1"),
    O_F64(loom_tfr_feature, "default", default_value, 0.0, 0, 0, F_NO_LO | F_NO_HI, ALL, 0,
          "fills a missing fixed-length feature; without it a missing feature is an error"),
    O_BOOL(loom_tfr_feature, "var_len", var_len, 0, ALL, "0 to numel values, padded with pad"),
    O_F64(loom_tfr_feature, "pad", pad, 0.0, 0, 0, F_NO_LO | F_NO_HI, ALL, 0, "fill after a var_len feature's values"),
    O_END,
};

static void parse_features(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_source_spec *src = base;
    char v[300];
    if (!config_setting_is_group(s)) {
        cfg_err_(c, s, "expected a group { NAME = \"file.idx\"; ... }, got %s", cfg_value_str_(s, v, sizeof v));
        return;
    }
    int n = config_setting_length(s);
    if (n < 1 || n > LOOM_MAX_FEATURES) {
        cfg_err_(c, s, "expected 1 to %d features, got %d", LOOM_MAX_FEATURES, n);
        return;
    }
    for (int i = 0; i < n; i++) {
        const config_setting_t *f = config_setting_get_elem(s, i);
        const char *name = config_setting_name(f);
        if (config_setting_type(f) != CONFIG_TYPE_STRING) {
            cfg_err_(c, f, "expected a file name string, got %s", cfg_value_str_(f, v, sizeof v));
            continue;
        }
        if (strlen(name) >= LOOM_NAME_MAX) {
            cfg_err_(c, f, "feature name is too long (at most %d characters)", LOOM_NAME_MAX - 1);
            continue;
        }
        const char *file = config_setting_get_string(f);
        char full[LOOM_PATH_MAX + 8];
        int w = file[0] == '/' ? snprintf(full, sizeof full, "%s", file)
                               : snprintf(full, sizeof full, "%s/%s", c->dir, file);
        if (!file[0] || w < 0 || w >= LOOM_PATH_MAX) {
            cfg_err_(c, f, "bad file name \"%s\" (empty or too long)", file);
            continue;
        }
        struct stat st;
        if (access(full, R_OK) != 0) {
            loom_err *e = cfg_err_(c, f, "cannot read \"%s\" (resolved to %s): %s", file, full, strerror(errno));
            if (e) loom_err_hint(e, "relative paths are relative to the config file's directory");
            continue;
        }
        if (stat(full, &st) != 0 || !S_ISREG(st.st_mode)) {
            cfg_err_(c, f, "\"%s\" (resolved to %s) is not a regular file", file, full);
            continue;
        }
        int k = src->n_features++;
        snprintf(src->feature[k], sizeof src->feature[k], "%s", name);
        memcpy(src->idx.file[k], full, (size_t)w + 1); /* w < LOOM_PATH_MAX, checked above */
    }
}

/* ---- tfrecord source ------------------------------------------------------ */

/* Regular files matching pattern; -1 when glob itself fails. */
static int count_matches(const char *pattern)
{
    glob_t g;
    int rc = glob(pattern, GLOB_MARK, NULL, &g);
    if (rc == GLOB_NOMATCH) return 0;
    if (rc) return -1;
    int n = 0;
    struct stat st;
    for (size_t i = 0; i < g.gl_pathc; i++) {
        const char *m = g.gl_pathv[i];
        size_t l = strlen(m);
        if (l && m[l - 1] != '/' && stat(m, &st) == 0 && S_ISREG(st.st_mode)) n++;
    }
    globfree(&g);
    return n;
}

static void parse_files(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_source_spec *src = base;
    char v[300];
    bool one = config_setting_type(s) == CONFIG_TYPE_STRING;
    if (!one && !config_setting_is_array(s) && !config_setting_is_list(s)) {
        cfg_err_(c, s, "expected a list of paths or glob patterns [\"data/train-*.tfrecord\", ...], got %s",
             cfg_value_str_(s, v, sizeof v));
        return;
    }
    int n = one ? 1 : config_setting_length(s);
    if (n < 1 || n > LOOM_MAX_FILE_PATTERNS) {
        cfg_err_(c, s, "expected 1 to %d paths or patterns, got %d", LOOM_MAX_FILE_PATTERNS, n);
        return;
    }
    char edir[LOOM_PATH_MAX];
    if (loom_glob_escape(c->dir, edir, sizeof edir) < 0) {
        cfg_err_(c, s, "the config's directory %s is too long", c->dir);
        return;
    }
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = one ? s : config_setting_get_elem(s, i);
        if (config_setting_type(e) != CONFIG_TYPE_STRING) {
            cfg_err_(c, e, "expected a path or glob pattern string, got %s", cfg_value_str_(e, v, sizeof v));
            continue;
        }
        const char *pat = config_setting_get_string(e);
        char full[LOOM_PATH_MAX + 8], shown[LOOM_PATH_MAX + 8];
        int w =
            pat[0] == '/' ? snprintf(full, sizeof full, "%s", pat) : snprintf(full, sizeof full, "%s/%s", edir, pat);
        if (pat[0] == '/')
            snprintf(shown, sizeof shown, "%s", pat);
        else
            snprintf(shown, sizeof shown, "%s/%s", c->dir, pat);
        if (!pat[0] || w < 0 || w >= LOOM_PATH_MAX) {
            cfg_err_(c, e, "bad path \"%s\" (empty or too long)", pat);
            continue;
        }
        int m = count_matches(full);
        if (m < 0) {
            cfg_err_(c, e, "cannot expand \"%s\" (resolved to %s): %s", pat, shown, strerror(errno));
            continue;
        }
        if (m == 0) {
            loom_err *er;
            if (!strpbrk(pat, "*?[") && access(shown, R_OK) != 0)
                er = cfg_err_(c, e, "cannot read \"%s\" (resolved to %s): %s", pat, shown, strerror(errno));
            else if (!strpbrk(pat, "*?["))
                er = cfg_err_(c, e, "\"%s\" (resolved to %s) is not a regular file", pat, shown);
            else
                er = cfg_err_(c, e, "no files match \"%s\" (resolved to %s)", pat, shown);
            if (er) loom_err_hint(er, "relative paths are relative to the config file's directory");
            continue;
        }
        memcpy(src->pattern[src->n_patterns++], full, (size_t)w + 1); /* w < LOOM_PATH_MAX, checked above */
    }
}

static void parse_tfr_shape(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_tfr_feature *f = base;
    char v[300];
    if (!config_setting_is_array(s) && !config_setting_is_list(s)) {
        cfg_err_(c, s, "expected a shape such as [28, 28] ([] for a scalar), got %s", cfg_value_str_(s, v, sizeof v));
        return;
    }
    int n = config_setting_length(s);
    if (n > 8) {
        cfg_err_(c, s, "expected 0 to 8 dimensions, got %d", n);
        return;
    }
    int64_t numel = 1;
    bool fits = true;
    for (int i = 0; i < n; i++) {
        int64_t x;
        if (!cfg_get_int_in_(c, config_setting_get_elem(s, i), 1, INT32_MAX, &x)) return;
        f->shape[i] = x;
        fits = fits && loom_mul_ok(numel, x, &numel);
    }
    if (!fits || numel > (1 << 30)) {
        if (fits)
            cfg_err_(c, s, "%lld values per element is too many (at most %d)", (long long)numel, 1 << 30);
        else
            cfg_err_(c, s, "more than 2^63 values per element is too many (at most %d)", 1 << 30);
        return;
    }
    f->rank = n;
}

/* A value for a feature of dtype dt (default or pad): integral for the
 * integer dtypes, in [0, 255] for uint8. */
static void check_fill(cfg_ctx *c, const config_setting_t *s, loom_tfr_dtype dt)
{
    char v[300];
    if (!s || !cfg_is_number_(s)) return; /* a non-number was reported by the option engine */
    if (dt == LOOM_TFR_FLOAT32) return;
    int64_t x;
    if (!cfg_is_int_(s)) {
        cfg_err_(c, s, "expected an integer (the feature is %s), got %s", loom_tfr_dtype_names_[dt],
             cfg_value_str_(s, v, sizeof v));
        return;
    }
    if (dt == LOOM_TFR_UINT8) cfg_get_int_in_(c, s, 0, 255, &x);
}

/* One kind of NAME = { ... } group under a source (tfrecord features, csv
 * columns, synthetic features): the shared grammar is walked by
 * parse_feature_groups, the kind-specific cross-checks are left to check. */
typedef struct feature_kind {
    const char *noun;     /* "features" | "columns", in the count error */
    const char *body;     /* the entry's grammar in errors: "dtype = ...; shape = [...];" */
    const char *example;  /* the hint's entry body: "dtype = \"int64\"; shape = [];" */
    const cfg_opt *opts;  /* the entry's option table; tbl[0] is its kind (dtype) */
    size_t      size;     /* sizeof one entry of items */
    void (*check)(cfg_ctx *c, const loom_source_spec *src, const config_setting_t *g, const char *name, void *item,
                  int k);
} feature_kind;

/* Parses group s into items[0..] (the kind's array: tfrecord.features,
 * csv.columns or synthetic.features) and src->feature, counting them in
 * src->n_features. */
static void parse_feature_groups(cfg_ctx *c, const config_setting_t *s, loom_source_spec *src, void *items,
                                 const feature_kind *fk)
{
    char v[300];
    if (!config_setting_is_group(s)) {
        cfg_err_(c, s, "expected a group { NAME = { %s }; ... }, got %s", fk->body, cfg_value_str_(s, v, sizeof v));
        return;
    }
    int n = config_setting_length(s);
    if (n < 1 || n > LOOM_MAX_FEATURES) {
        cfg_err_(c, s, "expected 1 to %d %s, got %d", LOOM_MAX_FEATURES, fk->noun, n);
        return;
    }
    for (int i = 0; i < n; i++) {
        const config_setting_t *g = config_setting_get_elem(s, i);
        const char *name = config_setting_name(g);
        if (!config_setting_is_group(g)) {
            loom_err *e = cfg_err_(c, g, "expected a group { %s }, got %s", fk->body, cfg_value_str_(g, v, sizeof v));
            if (e) loom_err_hint(e, "e.g. %s = { %s };", name, fk->example);
            continue;
        }
        if (strlen(name) >= LOOM_NAME_MAX) {
            cfg_err_(c, g, "feature name is too long (at most %d characters)", LOOM_NAME_MAX - 1);
            continue;
        }
        void *item = (char *)items + (size_t)src->n_features * fk->size;
        int k = cfg_parse_kind_(c, g, fk->opts, item);
        cfg_parse_opts_(c, g, fk->opts, k, item);
        cfg_scope sc = {fk->opts, k, NULL};
        cfg_check_keys_(c, g, &sc, 1);
        fk->check(c, src, g, name, item, k);
        snprintf(src->feature[src->n_features], LOOM_NAME_MAX, "%s", name);
        src->n_features++;
    }
}

static void check_tfr_feature(cfg_ctx *c, const loom_source_spec *src, const config_setting_t *g, const char *name,
                              void *item, int k)
{
    (void)src;
    (void)name;
    loom_tfr_feature *f = item;
    const config_setting_t *def = config_setting_get_member(g, "default");
    const config_setting_t *pad = config_setting_get_member(g, "pad");
    const config_setting_t *shp = config_setting_get_member(g, "shape");
    f->has_default = def != NULL;
    if (k >= 0) {
        check_fill(c, def, (loom_tfr_dtype)k);
        check_fill(c, pad, (loom_tfr_dtype)k);
    }
    if (def && f->var_len)
        cfg_err_(c, def, "default applies only to fixed-length features (a missing var_len feature is all pad)");
    if (pad && !f->var_len) cfg_err_(c, pad, "pad applies only with var_len = true");
    if (f->var_len && shp && f->rank == 0 && config_setting_length(shp) == 0)
        cfg_err_(c, shp, "a var_len feature needs a shape with at least one dimension (its maximum length)");
}

static void parse_tfr_features(cfg_ctx *c, const config_setting_t *s, void *base)
{
    static const feature_kind fk = {"features", "dtype = ...; shape = [...];", "dtype = \"int64\"; shape = [];",
                                    tfr_feature_opts, sizeof(loom_tfr_feature), check_tfr_feature};
    loom_source_spec *src = base;
    parse_feature_groups(c, s, src, src->tfrecord.features, &fk);
}

/* ---- csv, text and synthetic sources -------------------------------------- */

static bool cfg_dtype_is_int(loom_cfg_dtype dt) { return dt == LOOM_CFG_U8 || dt == LOOM_CFG_I32 || dt == LOOM_CFG_I64; }

/* A number s (already checked to be one) that must fit dtype dt: integral and in range for the integer dtypes.
 * hi_excl: an exclusive upper bound (synthetic max), one past the dtype's range. */
static bool check_value(cfg_ctx *c, const config_setting_t *s, loom_cfg_dtype dt, bool hi_excl)
{
    char v[300];
    if (!s || !cfg_is_number_(s) || !cfg_dtype_is_int(dt)) return true;
    if (!cfg_is_int_(s)) {
        cfg_err_(c, s, "expected an integer (the feature is %s), got %s", loom_cfg_dtype_names_[dt],
             cfg_value_str_(s, v, sizeof v));
        return false;
    }
    int64_t x, ex = hi_excl ? 1 : 0;
    if (dt == LOOM_CFG_U8) return cfg_get_int_in_(c, s, 0, 255 + ex, &x);
    if (dt == LOOM_CFG_I32) return cfg_get_int_in_(c, s, INT32_MIN, (int64_t)INT32_MAX + ex, &x);
    return true;
}

static void parse_delimiter(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_source_spec *src = base;
    char v[300];
    const char *d = config_setting_type(s) == CONFIG_TYPE_STRING ? config_setting_get_string(s) : NULL;
    if (!d || strlen(d) != 1 || strchr("\"\r\n", d[0])) {
        loom_err *e =
            cfg_err_(c, s, "expected one character other than '\"', CR or LF, got %s", cfg_value_str_(s, v, sizeof v));
        if (e) loom_err_hint(e, "e.g. delimiter = \";\"; or delimiter = \"\\t\";");
        return;
    }
    src->csv.delimiter = d[0];
}

#define CSV_MAX_FIELDS_ (1 << 20) /* a range's last field: far beyond any real table, far from overflow */

/* index = 3 (one field, a scalar feature) or index = "1-30" (fields 1 to 30, a vector feature of shape [30]). */
static void parse_csv_index(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_csv_column *col = base;
    char v[300];
    int64_t x;
    col->count = 0;
    if (cfg_is_int_(s)) {
        if (cfg_get_int_in_(c, s, 0, INT_MAX, &x)) col->index = (int)x;
        return;
    }
    const char *str = config_setting_type(s) == CONFIG_TYPE_STRING ? config_setting_get_string(s) : NULL;
    long long a = -1, b = -1;
    int used = 0;
    if (!str || sscanf(str, " %lld - %lld %n", &a, &b, &used) != 2 || str[used] || a < 0 || b < a ||
        b >= CSV_MAX_FIELDS_) {
        loom_err *e = cfg_err_(c, s, "expected a field index >= 0 or a range \"first-last\" (0-based, inclusive, "
                                 "first <= last < %d), got %s", CSV_MAX_FIELDS_, cfg_value_str_(s, v, sizeof v));
        if (e) loom_err_hint(e, "e.g. index = \"1-30\"; gathers fields 1 to 30 into one feature of shape [30]");
        return;
    }
    col->index = (int)a;
    col->count = (int)(b - a + 1);
}

static void check_csv_column(cfg_ctx *c, const loom_source_spec *src, const config_setting_t *g, const char *name,
                             void *item, int k)
{
    loom_csv_column *col = item;
    const config_setting_t *def = config_setting_get_member(g, "default");
    const config_setting_t *idx = config_setting_get_member(g, "index");
    const config_setting_t *cn = config_setting_get_member(g, "column");
    col->has_default = def != NULL;
    if (k >= 0 && k != LOOM_CSV_STRING) check_value(c, def, (loom_cfg_dtype)k, false);
    if (k == LOOM_CSV_STRING && idx && col->count > 0)
        cfg_err_(c, idx, "a string column is one field: a range (\"a-b\") gathers numeric fields into a vector");
    if (!src->csv.header && !idx) {
        loom_err *e = cfg_err_(c, g, "missing required setting `index` (with header = false columns are selected by "
                                 "position)");
        if (e) loom_err_hint(e, "e.g. %s = { dtype = \"%s\"; index = 0; };", name, loom_cfg_name_(loom_cfg_dtype_names_, k));
    }
    if (!idx) col->index = -1;
    if (idx && cn) cfg_err_(c, cn, "give either index or column, not both");
    if (!src->csv.header && cn) cfg_err_(c, cn, "column (a header name) needs header = true");
    if (!col->column[0] && col->index < 0) snprintf(col->column, sizeof col->column, "%s", name);
}

static void parse_csv_columns(cfg_ctx *c, const config_setting_t *s, void *base)
{
    static const feature_kind fk = {"columns", "dtype = ...;", "dtype = \"float32\";", csv_column_opts,
                                    sizeof(loom_csv_column), check_csv_column};
    loom_source_spec *src = base;
    if (!src->csv.delimiter) src->csv.delimiter = ','; /* delimiter (parsed before, when given) is a custom option */
    parse_feature_groups(c, s, src, src->csv.columns, &fk);
}

static void parse_syn_shape(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_syn_feature *f = base;
    loom_tfr_feature t = {0};
    parse_tfr_shape(c, s, &t); /* the same grammar: [] or [d0, ...], each >= 1 */
    f->rank = t.rank;
    memcpy(f->shape, t.shape, sizeof f->shape);
}

static void check_syn_feature(cfg_ctx *c, const loom_source_spec *src, const config_setting_t *g, const char *name,
                              void *item, int k)
{
    (void)src;
    loom_syn_feature *f = item;
    const config_setting_t *lo = config_setting_get_member(g, "min");
    const config_setting_t *hi = config_setting_get_member(g, "max");
    const config_setting_t *ds = config_setting_get_member(g, "distribution");
    if (k >= 0 && cfg_dtype_is_int((loom_cfg_dtype)k)) {
        if (f->dist == LOOM_SYN_NORMAL && ds)
            cfg_err_(c, ds, "normal applies only to float32 and float64 features (this one is %s)",
                 loom_cfg_dtype_names_[k]);
        if (!hi && f->dist == LOOM_SYN_UNIFORM) {
            loom_err *e = cfg_err_(c, g, "missing required setting `max` (integer features draw from [min, max))");
            if (e) loom_err_hint(e, "e.g. %s = { dtype = \"%s\"; max = 10; };", name, loom_cfg_dtype_names_[k]);
        }
        bool ok = check_value(c, lo, (loom_cfg_dtype)k, false) && check_value(c, hi, (loom_cfg_dtype)k, true);
        if (ok && hi && !(f->max > f->min))
            cfg_err_(c, hi, "max must be greater than min (%g), got %g", f->min, f->max);
    } else if (k >= 0 && f->dist == LOOM_SYN_UNIFORM && !(f->max > f->min)) {
        cfg_err_(c, hi ? hi : g, "max must be greater than min (min = %g, max = %g)", f->min, f->max);
    }
}

static void parse_syn_features(cfg_ctx *c, const config_setting_t *s, void *base)
{
    static const feature_kind fk = {"features", "dtype = ...; shape = [...];",
                                    "dtype = \"float32\"; shape = [28, 28];", syn_feature_opts,
                                    sizeof(loom_syn_feature), check_syn_feature};
    loom_source_spec *src = base;
    parse_feature_groups(c, s, src, src->synthetic.features, &fk);
}

static void parse_syn_ctr(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_source_spec *src = base;
    char v[300];
    if (!config_setting_is_group(s)) {
        cfg_err_(c, s, "expected a group such as ctr = { columns = 26; }, got %s", cfg_value_str_(s, v, sizeof v));
        return;
    }
    src->synthetic.ctr.on = true;
    cfg_parse_opts_(c, s, syn_ctr_opts, 0, &src->synthetic.ctr);
    cfg_scope sc = {syn_ctr_opts, 0, NULL};
    cfg_check_keys_(c, s, &sc, 1);
}

/* A source type that is neither built in nor a likely misspelling of one
 * (edit distance <= 2: cfg_parse_kind_ reports those with did-you-mean) names a
 * plugin's source: kept as text (kind LOOM_SRC_PLUGIN) and found in the
 * registry once plugins are loaded, where an unknown name is reported.
 * Returns the kind, or -1 for cfg_parse_kind_ to handle. */
int cfg_plugin_source_type_(cfg_ctx *c, const config_setting_t *t, loom_source_spec *src)
{
    if (!t || config_setting_type(t) != CONFIG_TYPE_STRING) return -1;
    const char *name = config_setting_get_string(t);
    for (int i = 0; loom_source_names_[i]; i++)
        if (loom_edit_distance(name, loom_source_names_[i]) <= 2) return -1;
    if (!name[0] || strlen(name) >= sizeof src->plugin.name)
        cfg_err_(c, t, "bad source type \"%s\" (empty or longer than %zu characters)", name,
                 sizeof src->plugin.name - 1);
    snprintf(src->plugin.name, sizeof src->plugin.name, "%s", name);
    src->kind = LOOM_SRC_PLUGIN;
    return LOOM_SRC_PLUGIN;
}

static void parse_source_options(cfg_ctx *c, const config_setting_t *s, void *base)
{
    cfg_plugin_opts_group_(c, s, &((loom_source_spec *)base)->plugin.options);
}
