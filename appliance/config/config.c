/* config.c - a libconfig file (plus --set overrides) into a validated loom_spec.
 * Each option is declared once in a table (name, type, default, range, help,
 * and the kinds of its group it applies to); a group is parsed against its
 * table for the group's kind (layer type, transform op, ...), then cross-field
 * checks run. Every error carries file:line (or "--set key" for an override)
 * and the setting path, and quotes the offending value.
 * Threads: none. Ownership: the spec is one allocation, plus the nested source
 * of each interleave and dataset of each zip; loom_config_free frees them all. */
#include "config/config.h"
#include "config/config_internal.h"

#include <ctype.h>
#include <arpa/inet.h>
#include <errno.h>
#include <glob.h>
#include <libconfig.h>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

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
                                       NULL};
const char *const loom_transform_names_[] = {"map", "shuffle", "batch", "repeat", "take", "skip", "prefetch",
                                             "filter", "shard", "enumerate", "unbatch", "padded_batch", "cache",
                                             "interleave", "zip", "split", "concat", "select", NULL};
const char *const loom_layer_names_[] = {"dense", "conv2d", "max_pool2d", "dropout", "flatten", "activation",
                                         "batch_normalization", "layer_normalization", "average_pooling2d",
                                         "global_average_pooling2d", "embedding", NULL};
const char *const loom_combiner_names_[] = {"sum", "mean", NULL};
const char *const loom_activation_names_[] = {"none", "relu", "sigmoid", "tanh", "softmax", "leaky_relu", "gelu", NULL};
const char *const loom_init_names_[] = {"glorot_uniform", "glorot_normal", "he_uniform", "he_normal", "zeros", NULL};
const char *const loom_padding_names_[] = {"valid", "same", NULL};
const char *const loom_loss_names_[] = {"sparse_softmax_cross_entropy", "mean_squared_error", "binary_cross_entropy",
                                        "mean_absolute_error", "huber", NULL};
const char *const loom_metric_names_[] = {"accuracy", "auc", "precision", "recall", "top_k_accuracy", "mae", "rmse",
                                          NULL};
const char *const loom_opt_names_[] = {"sgd", "momentum", "adam", "adamw", "rmsprop", "adagrad", NULL};
const char *const loom_sched_names_[] = {"constant", "exponential_decay", "piecewise_constant", "cosine", NULL};
const char *const loom_strategy_names_[] = {"one_device", "mirrored", "central_storage", "multi_worker_mirrored",
                                            "parameter_server", NULL};
const char *const loom_progress_names_[] = {"auto", "bar", "plain", "none", NULL};
static const char *const catalog_names[] = {"fashion_mnist", "mnist", NULL};
static const char *const split_names[] = {"train", "test", NULL};
static const char *const split_part_names[] = {"train", "eval", NULL};

const char *loom_cfg_name_(const char *const *names, int i)
{
    for (int k = 0; names[k]; k++)
        if (k == i) return names[k];
    return "?";
}

const char *loom_layer_kind_name(loom_layer_kind k) { return loom_cfg_name_(loom_layer_names_, (int)k); }
const char *loom_activation_name(loom_activation a) { return loom_cfg_name_(loom_activation_names_, (int)a); }
const char *loom_metric_name(loom_metric_kind k) { return loom_cfg_name_(loom_metric_names_, (int)k); }
const char *loom_loss_name(loom_loss_kind k) { return loom_cfg_name_(loom_loss_names_, (int)k); }
const char *loom_strategy_kind_name(loom_strategy_kind k) { return loom_cfg_name_(loom_strategy_names_, (int)k); }
static const char *const loom_communication_names_[] = {"auto", "ring", "nccl", "mpi", NULL};
static const char *const loom_partitioner_names_[] = {"none", "fixed", "min_size", "max_size", NULL};
const char *loom_partitioner_name(loom_partitioner_kind k) { return loom_cfg_name_(loom_partitioner_names_, (int)k); }
const char *loom_communication_name(loom_communication c) { return loom_cfg_name_(loom_communication_names_, (int)c); }
const char *loom_map_kind_name(loom_map_kind k) { return loom_cfg_name_(loom_map_names_, (int)k); }
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

/* ---- load context and error reporting ------------------------------------ */

typedef struct ctx {
    const char   *path;                /* the config file as given */
    char          pdir[LOOM_PATH_MAX]; /* its directory as given: "" or "configs/" */
    char          dir[LOOM_PATH_MAX];  /* its directory, absolute when it can be resolved */
    loom_errlist *errs;
    const char   *skip_key;            /* parse_opts neither reads nor requires this key (an interleave's source files) */
    int           depth;               /* datasets nested by zip */
    const config_setting_t *huge[16];  /* integers written beyond 64 bits (see fix_wide_ints) */
    char          huge_text[16][32];   /* ... as written */
    int           n_huge;
} ctx;

/* "--set key" when s (or a group holding it) came from an override, else "file:line". */
static void where_of(const ctx *c, const config_setting_t *s, char *buf, size_t n, int *line_out)
{
    if (line_out) *line_out = 0;
    for (const config_setting_t *p = s; p; p = config_setting_parent(p))
        if (config_setting_get_hook(p)) {
            snprintf(buf, n, "--set %s", (const char *)config_setting_get_hook(p));
            return;
        }
    const char *file = s ? config_setting_source_file(s) : NULL;
    unsigned line = s ? config_setting_source_line(s) : 0;
    if (!file) file = c->path;
    /* an @include'd file is named relative to the config's directory: say where it is */
    const char *pre = file[0] != '/' && strcmp(file, c->path) ? c->pdir : "";
    if (line_out) *line_out = (int)line;
    int w = line ? snprintf(buf, n, "%s%s:%u", pre, file, line) : snprintf(buf, n, "%s%s", pre, file);
    if (w >= (int)n && n > 4) memcpy(buf + n - 4, "...", 4); /* a very long path: cut, visibly */
}

/* The setting's path from the root: "data.train.transforms.[2].size". */
static void path_of(const config_setting_t *s, char *buf, size_t n)
{
    const config_setting_t *chain[64];
    int k = 0;
    for (const config_setting_t *p = s; p && config_setting_parent(p) && k < 64; p = config_setting_parent(p))
        chain[k++] = p;
    size_t len = 0;
    buf[0] = 0;
    for (int i = k - 1; i >= 0 && len < n; i--) {
        const config_setting_t *p = chain[i], *par = config_setting_parent(p);
        int w;
        if (config_setting_is_group(par))
            w = snprintf(buf + len, n - len, "%s%s", len ? "." : "", config_setting_name(p));
        else
            w = snprintf(buf + len, n - len, "%s[%d]", len ? "." : "", config_setting_index(p));
        if (w < 0) break;
        len += (size_t)w;
    }
}

static void loc_of(const ctx *c, const config_setting_t *s, loom_loc *l)
{
    char where[LOOM_PATH_MAX];
    const config_setting_t *p = s;
    where_of(c, s, where, sizeof where, &l->line);
    /* where_of gives "file:line"; keep the file part only */
    if (l->line > 0) {
        char *colon = strrchr(where, ':');
        if (colon) *colon = 0;
    }
    snprintf(l->file, sizeof l->file, "%s", where);
    path_of(p, l->path, sizeof l->path);
}

/* Records an error about setting s (its path prefixes the message); returns
 * the entry so a hint can be added, or NULL once the list is full. */
__attribute__((format(printf, 3, 4)))
static loom_err *cerr(ctx *c, const config_setting_t *s, const char *fmt, ...)
{
    if (c->errs->n >= LOOM_MAX_ERRORS) return NULL;
    loom_err *e = &c->errs->e[c->errs->n++];
    char where[256], path[256], msg[512];
    where_of(c, s, where, sizeof where, NULL);
    if (s)
        path_of(s, path, sizeof path);
    else
        path[0] = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (path[0] && !(!strncmp(where, "--set ", 6) && !strcmp(where + 6, path)))
        loom_err_set(e, LOOM_ECONFIG, where, "%s: %s", path, msg);
    else
        loom_err_set(e, LOOM_ECONFIG, where, "%s", msg);
    return e;
}

/* An error not tied to a setting (override syntax, the file itself). */
__attribute__((format(printf, 4, 5)))
static loom_err *rawerr(ctx *c, int code, const char *where, const char *fmt, ...)
{
    if (c->errs->n >= LOOM_MAX_ERRORS) return NULL;
    loom_err *e = &c->errs->e[c->errs->n++];
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    loom_err_set(e, code, where, "%s", msg);
    return e;
}

/* A double printed so that it reads back exactly, always with a '.' or an exponent. */
static const char *fmt_double(double v, char *buf, size_t n)
{
    snprintf(buf, n, "%.15g", v);
    if (strtod(buf, NULL) != v) snprintf(buf, n, "%.17g", v);
    if (!strpbrk(buf, ".eEni")) {
        size_t l = strlen(buf);
        if (l + 2 < n) memcpy(buf + l, ".0", 3);
    }
    return buf;
}

/* The value of s for a message: 5, -3.5, "abc", true, a group, a list. */
static const char *value_str(const config_setting_t *s, char *buf, size_t n)
{
    switch (config_setting_type(s)) {
    case CONFIG_TYPE_INT: snprintf(buf, n, "%d", config_setting_get_int(s)); break;
    case CONFIG_TYPE_INT64: snprintf(buf, n, "%lld", config_setting_get_int64(s)); break;
    case CONFIG_TYPE_FLOAT: fmt_double(config_setting_get_float(s), buf, n); break;
    case CONFIG_TYPE_STRING: snprintf(buf, n, "\"%s\"", config_setting_get_string(s)); break;
    case CONFIG_TYPE_BOOL: snprintf(buf, n, "%s", config_setting_get_bool(s) ? "true" : "false"); break;
    case CONFIG_TYPE_GROUP: snprintf(buf, n, "a group { ... }"); break;
    case CONFIG_TYPE_ARRAY: snprintf(buf, n, "an array [ ... ]"); break;
    case CONFIG_TYPE_LIST: snprintf(buf, n, "a list ( ... )"); break;
    default: snprintf(buf, n, "nothing"); break;
    }
    return buf;
}

/* "a, b, c" */
static const char *join_names(const char *const *names, char *buf, size_t n)
{
    size_t len = 0;
    buf[0] = 0;
    for (int i = 0; names[i] && len < n; i++) {
        int w = snprintf(buf + len, n - len, "%s%s", i ? ", " : "", names[i]);
        if (w < 0) break;
        len += (size_t)w;
    }
    return buf;
}

static int find_name(const char *const *names, const char *s)
{
    for (int i = 0; names[i]; i++)
        if (!strcmp(names[i], s)) return i;
    return -1;
}

/* The closest name within edit distance 2 (and shorter than s), or NULL. */
static const char *closest(const char *const *names, const char *s)
{
    const char *best = NULL;
    int bd = 3;
    for (int i = 0; names[i]; i++) {
        int d = loom_edit_distance(s, names[i]);
        if (d < bd && d < (int)strlen(s)) bd = d, best = names[i];
    }
    return best;
}

static bool is_int(const config_setting_t *s)
{
    int t = config_setting_type(s);
    return t == CONFIG_TYPE_INT || t == CONFIG_TYPE_INT64;
}

static bool is_number(const config_setting_t *s) { return is_int(s) || config_setting_type(s) == CONFIG_TYPE_FLOAT; }

static double get_number(const config_setting_t *s)
{
    return config_setting_type(s) == CONFIG_TYPE_FLOAT ? config_setting_get_float(s)
                                                       : (double)config_setting_get_int64(s);
}

/* ---- integer literals beyond 32 bits -------------------------------------
 * libconfig 1.5 reads an integer literal without an L suffix into an int,
 * so 5000000000 becomes 705032704 and 4294967297 becomes 1; later versions
 * read it as an int64. To get the written value whatever the version, the
 * text is lexed here: its integer literals, in order, pair one to one with
 * the tree's integer settings in depth-first order. A literal that did not
 * fit an int is stored into its setting as an int64; one beyond 64 bits is
 * remembered (ctx.huge) and refused by get_int_in with the setting's range. */

typedef struct int_lit {
    int64_t v;         /* the value written (clamped when huge) */
    bool    suffix;    /* ends in L: libconfig read it as an int64 */
    bool    huge;      /* beyond the 64-bit range */
    char    text[32];  /* as written, cut */
} int_lit;

typedef struct int_lits {
    int_lit *v;
    int      n, cap;
    bool     bad;      /* out of memory, or an include that could not be read */
} int_lits;

static void lits_push(int_lits *L, const int_lit *x)
{
    if (L->n == L->cap) {
        int cap = L->cap ? 2 * L->cap : 64;
        int_lit *p = loom_realloc(L->v, (size_t)cap * sizeof *p);
        if (!p) {
            L->bad = true;
            return;
        }
        L->v = p;
        L->cap = cap;
    }
    L->v[L->n++] = *x;
}

static void lex_file(const char *path, const char *dir, int_lits *L, int depth);

/* One integer literal at p ("-12", "0x1F", "5L"), or a float (skipped); returns the end. */
static const char *lex_number(const char *p, int_lits *L)
{
    const char *s = p;
    bool neg = false;
    if (*p == '+' || *p == '-') neg = *p++ == '-';
    int_lit x = {0};
    if (p[0] == '0' && (p[1] == 'x' || p[1] == 'X') && isxdigit((unsigned char)p[2])) {
        uint64_t u = 0;
        for (p += 2; isxdigit((unsigned char)*p); p++) {
            int d = isdigit((unsigned char)*p) ? *p - '0' : (tolower((unsigned char)*p) - 'a' + 10);
            if (u > (UINT64_MAX >> 4)) x.huge = true;
            u = (u << 4) | (uint64_t)d;
        }
        /* libconfig reads hex as unsigned: 0xFFFFFFFF is -1 as an int, 0xFFFFFFFFFFFFFFFFL -1 as an int64 */
        x.v = (int64_t)u;
        if (!x.huge && neg) x.v = -x.v;
    } else {
        const char *d = p;
        while (isdigit((unsigned char)*p)) p++;
        bool digits = p > d;
        if (*p == '.' || ((*p == 'e' || *p == 'E') && digits)) { /* a float: skip it */
            if (*p == '.') p++;
            while (isdigit((unsigned char)*p)) p++;
            if (*p == 'e' || *p == 'E') {
                p++;
                if (*p == '+' || *p == '-') p++;
                while (isdigit((unsigned char)*p)) p++;
            }
            return p;
        }
        if (!digits) return p;
        errno = 0;
        char *end;
        long long v = strtoll(s, &end, 10);
        x.huge = errno == ERANGE;
        x.v = (int64_t)v;
    }
    if (*p == 'L') {
        x.suffix = true;
        p++;
        if (*p == 'L') p++;
    }
    snprintf(x.text, sizeof x.text, "%.*s%s", (int)(p - s > 24 ? 24 : p - s), s, p - s > 24 ? "..." : "");
    lits_push(L, &x);
    return p;
}

/* The integer literals of text, in order; @include'd files (relative to dir) in place. */
static void lex_text(const char *t, const char *dir, int_lits *L, int depth)
{
    const char *p = t;
    while (*p && !L->bad) {
        unsigned char ch = (unsigned char)*p;
        if (ch == '#' || (ch == '/' && p[1] == '/')) {
            while (*p && *p != '\n') p++;
        } else if (ch == '/' && p[1] == '*') {
            const char *e = strstr(p + 2, "*/");
            p = e ? e + 2 : p + strlen(p);
        } else if (ch == '"') {
            for (p++; *p && *p != '"'; p++)
                if (*p == '\\' && p[1]) p++;
            if (*p) p++;
        } else if (ch == '@' && !strncmp(p, "@include", 8)) {
            p += 8;
            while (*p == ' ' || *p == '\t') p++;
            if (*p != '"') continue;
            const char *q = ++p;
            while (*q && *q != '"' && *q != '\n') q++;
            char name[LOOM_PATH_MAX], full[2 * LOOM_PATH_MAX + 2];
            snprintf(name, sizeof name, "%.*s", (int)(q - p), p);
            if (name[0] == '/' || !dir[0])
                snprintf(full, sizeof full, "%s", name);
            else
                snprintf(full, sizeof full, "%s/%s", dir, name);
            if (!dir) { /* an override's value includes nothing */
                L->bad = true;
                return;
            }
            lex_file(full, dir, L, depth + 1);
            p = *q ? q + 1 : q;
        } else if (isalpha(ch) || ch == '*' || ch == '_') { /* a name, or true/false */
            while (isalnum((unsigned char)*p) || *p == '-' || *p == '_' || *p == '*') p++;
        } else if (isdigit(ch) || ((ch == '-' || ch == '+' || ch == '.') && (isdigit((unsigned char)p[1]) || p[1] == '.'))) {
            const char *e = lex_number(p, L);
            p = e > p ? e : p + 1;
        } else {
            p++;
        }
    }
}

static void lex_file(const char *path, const char *dir, int_lits *L, int depth)
{
    if (depth > 10) { /* libconfig refuses deeper includes itself */
        L->bad = true;
        return;
    }
    /* through core's reader, which refuses what is not a regular file (an
     * @include of a directory read as a file of LONG_MAX bytes; a FIFO would
     * block) and bounds the size */
    uint8_t *text = NULL;
    size_t len = 0;
    loom_err e;
    if (loom_read_file_max(path, &text, &len, (uint64_t)1 << 30, &e) == LOOM_OK)
        lex_text((char *)text, dir, L, depth);
    else
        L->bad = true;
    loom_free(text);
}

/* The tree's integer settings in depth-first order, paired with lits from *k. */
static bool fix_ints(ctx *c, config_setting_t *s, const int_lits *L, int *k, bool apply)
{
    int t = config_setting_type(s);
    if (t == CONFIG_TYPE_INT || t == CONFIG_TYPE_INT64) {
        if (*k >= L->n) return false;
        const int_lit *x = &L->v[(*k)++];
        if (!apply) return true;
        if (x->huge) {
            if (c->n_huge < (int)(sizeof c->huge / sizeof c->huge[0])) {
                c->huge[c->n_huge] = s;
                snprintf(c->huge_text[c->n_huge], sizeof c->huge_text[0], "%s", x->text);
                c->n_huge++;
            }
        } else if (t == CONFIG_TYPE_INT && (x->v < INT_MIN || x->v > INT_MAX) &&
                   (int32_t)(uint32_t)(uint64_t)x->v == config_setting_get_int(s)) {
            /* the struct is public in every libconfig; its line and file stay */
            s->type = CONFIG_TYPE_INT64;
            s->value.llval = x->v;
        }
        return true;
    }
    if (!config_setting_is_aggregate(s)) return true;
    int n = config_setting_length(s);
    for (int i = 0; i < n; i++)
        if (!fix_ints(c, config_setting_get_elem(s, (unsigned)i), L, k, apply)) return false;
    return true;
}

/* Pairs the literals with root's integers; does nothing unless the counts agree. */
static void fix_wide_ints(ctx *c, config_setting_t *root, int_lits *L)
{
    int k = 0;
    if (!L->bad && fix_ints(c, root, L, &k, false) && k == L->n) {
        k = 0;
        fix_ints(c, root, L, &k, true);
    }
    loom_free(L->v);
    L->v = NULL;
    L->n = L->cap = 0;
}

/* Forgets the huge literals inside s, which an override is about to remove. */
static void forget_huge(ctx *c, const config_setting_t *s)
{
    for (int i = 0; i < c->n_huge; i++)
        for (const config_setting_t *p = c->huge[i]; p; p = config_setting_parent(p))
            if (p == s) {
                c->huge[i] = NULL;
                break;
            }
}

static const char *huge_text(const ctx *c, const config_setting_t *s)
{
    for (int i = 0; i < c->n_huge; i++)
        if (c->huge[i] == s) return c->huge_text[i];
    return NULL;
}

/* ---- option tables ------------------------------------------------------- */

enum {
    OT_INT,    /* int or int64_t/uint64_t field (by size); libconfig int or int64 */
    OT_F64,    /* double; libconfig int or float */
    OT_BOOL,   /* bool */
    OT_ENUM,   /* int-sized enum; a string among names */
    OT_STR,    /* char[]; non-empty; among names when names is set */
    OT_PAIR,   /* int[2]; an int (both) or [h, w] */
    OT_CUSTOM, /* parsed by parse() */
    OT_SUB,    /* a sub-group or list, parsed by the caller */
};

/* flags */
#define F_KIND        0x01u /* the entry that selects the group's kind; read first */
#define F_LO_OPEN     0x02u /* F64: > lo rather than >= lo */
#define F_HI_OPEN     0x04u /* F64: < hi rather than <= hi */
#define F_NO_HI       0x08u /* F64: no upper bound */
#define F_NO_LO       0x10u /* F64: no lower bound */
#define F_UNSUPPORTED 0x20u /* SUB: recognised, refused as not supported yet */

#define ALL  0xffffffffu
#define K(x) (1u << (x))

typedef struct opt opt;
typedef void (*opt_parse_fn)(ctx *c, const config_setting_t *s, void *base);

struct opt {
    const char         *name;
    int                 type;
    size_t              off, size;       /* the field in the group's struct */
    unsigned            applies;         /* kinds of the group it applies to */
    unsigned            required;        /* kinds where it must be given */
    unsigned            flags;
    int64_t             ilo, ihi, idef;  /* INT, PAIR; idef also ENUM and BOOL */
    double              flo, fhi, fdef;  /* F64 */
    const char         *sdef;            /* STR */
    const char *const  *names;           /* ENUM, STR */
    opt_parse_fn        parse;           /* CUSTOM */
    const char         *help;
};

#define FLD(T, f) .off = offsetof(T, f), .size = sizeof(((T *)0)->f)
#define O_KIND(T, key, f, def, nm, req, h) \
    {.name = key, .type = OT_ENUM, FLD(T, f), .applies = ALL, .required = req, .flags = F_KIND, .idef = def, \
     .names = nm, .help = h}
#define O_INT(T, key, f, def, lo, hi, app, req, h) \
    {.name = key, .type = OT_INT, FLD(T, f), .applies = app, .required = req, .idef = def, .ilo = lo, .ihi = hi, \
     .help = h}
#define O_F64(T, key, f, def, lo, hi, fl, app, req, h) \
    {.name = key, .type = OT_F64, FLD(T, f), .applies = app, .required = req, .flags = fl, .fdef = def, \
     .flo = lo, .fhi = hi, .help = h}
#define O_BOOL(T, key, f, def, app, h) \
    {.name = key, .type = OT_BOOL, FLD(T, f), .applies = app, .idef = def, .help = h}
#define O_ENUM(T, key, f, def, nm, app, req, h) \
    {.name = key, .type = OT_ENUM, FLD(T, f), .applies = app, .required = req, .idef = def, .names = nm, .help = h}
#define O_STR(T, key, f, def, nm, app, req, h) \
    {.name = key, .type = OT_STR, FLD(T, f), .applies = app, .required = req, .sdef = def, .names = nm, .help = h}
#define O_PAIR(T, key, f, def, lo, hi, app, req, h) \
    {.name = key, .type = OT_PAIR, FLD(T, f), .applies = app, .required = req, .idef = def, .ilo = lo, \
     .ihi = hi, .help = h}
#define O_CUSTOM(key, fn, app, req, h) \
    {.name = key, .type = OT_CUSTOM, .applies = app, .required = req, .parse = fn, .help = h}
#define O_SUB(key, fl, req, h) {.name = key, .type = OT_SUB, .applies = ALL, .required = req, .flags = fl, .help = h}
#define O_END {.name = NULL}

static void parse_version(ctx *c, const config_setting_t *s, void *base);
static void parse_features(ctx *c, const config_setting_t *s, void *base);
static void parse_shape(ctx *c, const config_setting_t *s, void *base);
static void parse_boundaries(ctx *c, const config_setting_t *s, void *base);
static void parse_values(ctx *c, const config_setting_t *s, void *base);
static void parse_files(ctx *c, const config_setting_t *s, void *base);
static void parse_tfr_features(ctx *c, const config_setting_t *s, void *base);
static void parse_tfr_shape(ctx *c, const config_setting_t *s, void *base);
static void parse_delimiter(ctx *c, const config_setting_t *s, void *base);
static void parse_csv_columns(ctx *c, const config_setting_t *s, void *base);
static void parse_csv_index(ctx *c, const config_setting_t *s, void *base);
static void parse_norm_values(ctx *c, const config_setting_t *s, void *base);
static void parse_feature_names(ctx *c, const config_setting_t *s, void *base);
static void parse_syn_features(ctx *c, const config_setting_t *s, void *base);
static void parse_syn_ctr(ctx *c, const config_setting_t *s, void *base);
static void parse_syn_shape(ctx *c, const config_setting_t *s, void *base);
static void parse_filter_values(ctx *c, const config_setting_t *s, void *base);
static void parse_padded_shapes(ctx *c, const config_setting_t *s, void *base);
static void parse_padding_values(ctx *c, const config_setting_t *s, void *base);
static void resolve_lua_ref(ctx *c, const config_setting_t *s, char *out, size_t n);
static void parse_parallel(ctx *c, const config_setting_t *s, void *base);
static void parse_strategy_options(ctx *c, const config_setting_t *s, void *base);
static void parse_source_options(ctx *c, const config_setting_t *s, void *base);
static int plugin_source_type(ctx *c, const config_setting_t *t, loom_source_spec *src);
static void parse_map_plugin(ctx *c, const config_setting_t *s, void *base);
static void parse_map_args(ctx *c, const config_setting_t *s, void *base);
static void parse_filter_plugin(ctx *c, const config_setting_t *s, void *base);
static void parse_filter_args(ctx *c, const config_setting_t *s, void *base);
static void parse_strategy_devices(ctx *c, const config_setting_t *s, void *base);
static void parse_plugin_path(ctx *c, const config_setting_t *s, void *base);
static void parse_plugin_require(ctx *c, const config_setting_t *s, void *base);
static void parse_prefetch_buffer(ctx *c, const config_setting_t *s, void *base);
static void parse_ram_budget(ctx *c, const config_setting_t *s, void *base);
static void parse_cluster_role(ctx *c, const config_setting_t *s, void *base);
static void parse_cluster_path(ctx *c, const config_setting_t *s, void *base);
static void parse_metrics(ctx *c, const config_setting_t *s, void *base);
static void parse_class_weight(ctx *c, const config_setting_t *s, void *base);

static const opt root_opts[] = {
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

static const opt data_opts[] = {
    O_SUB("train", 0, ALL, "the training dataset"),
    O_SUB("eval", 0, 0, "the evaluation dataset"),
    O_SUB("options", 0, 0, "tf.data.Options for both datasets: deterministic, autotune, optimization"),
    O_END,
};

/* data.options and its two sub-groups */
static const opt options_opts[] = {
    O_BOOL(loom_data_options, "deterministic", deterministic, 1, ALL, "default of every map's `deterministic`"),
    O_SUB("autotune", 0, 0, "enabled, cpu_budget, ram_budget"),
    O_SUB("optimization", 0, 0, "static rewrites of the pipeline"),
    O_END,
};

static const opt autotune_opts[] = {
    O_BOOL(loom_data_options, "enabled", autotune, 1, ALL, "tune \"auto\" parallelism and buffers while running"),
    O_INT(loom_data_options, "cpu_budget", cpu_budget, 0, 0, 4096, ALL, 0, "threads for tuned parallelism; 0 = the cores"),
    O_CUSTOM("ram_budget", parse_ram_budget, ALL, 0, "bytes, \"4GiB\"-style, or \"50%\" of physical memory (default)"),
    O_END,
};

static const opt optimization_opts[] = {
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

static const opt dataset_opts[] = {
    O_SUB("source", 0, ALL, "where elements come from"),
    O_SUB("transforms", 0, 0, "a list of transforms applied in order"),
    O_ENUM(loom_dataset_spec, "shard_policy", shard_policy, LOOM_SHARD_AUTO, loom_shard_policy_names_, ALL, 0,
           "how each of several input pipelines takes its share: auto, file, data or off"),
    O_ENUM(loom_dataset_spec, "on_nonfinite", on_nonfinite, LOOM_NONFINITE_ERROR, loom_nonfinite_names_, ALL, 0,
           "a NaN or infinite float in a csv or idx source: error (naming the record) or skip (drop it, count it)"),
    O_END,
};

#define SRC(k) K(LOOM_SRC_##k)
static const opt source_opts[] = {
    O_KIND(loom_source_spec, "type", kind, 0, loom_source_names_, ALL, "source type"),
    O_CUSTOM("options", parse_source_options, SRC(PLUGIN), 0,
             "a plugin source's options: KEY = number, string or true/false, at most 8"),
    O_CUSTOM("features", parse_features, SRC(IDX), SRC(IDX), "feature name = \"file.idx[.gz]\", 1 to 256"),
    O_STR(loom_source_spec, "name", name, NULL, catalog_names, SRC(CATALOG), SRC(CATALOG), "catalog dataset"),
    O_STR(loom_source_spec, "split", split, NULL, split_names, SRC(CATALOG), SRC(CATALOG), "catalog split"),
    O_CUSTOM("files", parse_files, SRC(TFRECORD), SRC(TFRECORD),
             "TFRecord paths or glob patterns, 1 to 16, relative to the config's directory"),
    O_ENUM(loom_source_spec, "compression", compression, LOOM_TFR_COMP_AUTO, loom_tfr_comp_names_, SRC(TFRECORD), 0,
           "auto detects it per file from the leading bytes"),
    O_ENUM(loom_source_spec, "on_corrupt", on_corrupt, LOOM_TFR_CORRUPT_ERROR, loom_tfr_corrupt_names_, SRC(TFRECORD),
           0, "error, or skip (count and report) bad records"),
    O_BOOL(loom_source_spec, "shuffle_files", shuffle_files, 0, SRC(TFRECORD), "shuffle the file order each epoch"),
    O_CUSTOM("features", parse_tfr_features, SRC(TFRECORD), SRC(TFRECORD),
             "NAME = { dtype = ...; shape = [...]; }, 1 to 256"),
    O_CUSTOM("files", parse_files, SRC(CSV) | SRC(TEXT) | SRC(LIST_FILES), SRC(CSV) | SRC(TEXT) | SRC(LIST_FILES),
             "paths or glob patterns, 1 to 16, relative to the config's directory"),
    O_BOOL(loom_source_spec, "shuffle", shuffle_files, 1, SRC(LIST_FILES), "shuffle the file names each epoch"),
    O_INT(loom_source_spec, "seed", seed, 0, 0, INT64_MAX, SRC(LIST_FILES), 0, "shuffle seed; default run.seed"),
    O_BOOL(loom_source_spec, "header", header, 1, SRC(CSV), "the first record of each file names the columns"),
    O_CUSTOM("delimiter", parse_delimiter, SRC(CSV), 0, "one character, default \",\""),
    O_CUSTOM("columns", parse_csv_columns, SRC(CSV), SRC(CSV), "NAME = { dtype = ...; }, 1 to 256"),
    O_INT(loom_source_spec, "max_length", max_length, 0, 1, 1 << 24, SRC(TEXT), SRC(TEXT),
          "bytes of the line feature (zero-padded)"),
    O_BOOL(loom_source_spec, "truncate", truncate, 0, SRC(TEXT), "cut longer lines instead of failing"),
    O_INT(loom_source_spec, "count", count, 0, -1, INT64_MAX, SRC(SYNTHETIC), SRC(SYNTHETIC),
          "elements per pass; -1 = infinite"),
    O_CUSTOM("features", parse_syn_features, SRC(SYNTHETIC), 0,
             "NAME = { dtype = ...; shape = [...]; }, 1 to 256 (required without ctr)"),
    O_CUSTOM("ctr", parse_syn_ctr, SRC(SYNTHETIC), 0,
             "{ columns = 26; ... }: click-through-rate data (features ids and label) from a known logistic model"),
    O_END,
};

/* One column group of a csv source; the dtype selects the kind. */
static const opt csv_column_opts[] = {
    O_KIND(loom_csv_column, "dtype", dtype, 0, loom_cfg_dtype_names_, ALL, "uint8, int32, int64, float32 or float64"),
    O_CUSTOM("index", parse_csv_index, ALL, 0,
             "0-based field index, or a range \"a-b\" (inclusive) gathered into one vector feature of shape [b - a + 1]; "
             "required with header = false"),
    O_STR(loom_csv_column, "column", column, "", NULL, ALL, 0, "header name to select; default the feature's name"),
    O_F64(loom_csv_column, "default", default_value, 0.0, 0, 0, F_NO_LO | F_NO_HI, ALL, 0,
          "value of an empty field; without it an empty field is an error"),
    O_END,
};

static const opt syn_ctr_opts[] = {
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
static const opt syn_feature_opts[] = {
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
static const opt tfr_feature_opts[] = {
    O_KIND(loom_tfr_feature, "dtype", dtype, 0, loom_tfr_dtype_names_, ALL,
           "uint8 (one bytes value), int64 (int64_list) or float32 (float_list)"),
    O_CUSTOM("shape", parse_tfr_shape, ALL, ALL, "[] for a scalar, else [d0, d1, ...], each >= 1"),
    O_F64(loom_tfr_feature, "default", default_value, 0.0, 0, 0, F_NO_LO | F_NO_HI, ALL, 0,
          "fills a missing fixed-length feature; without it a missing feature is an error"),
    O_BOOL(loom_tfr_feature, "var_len", var_len, 0, ALL, "0 to numel values, padded with pad"),
    O_F64(loom_tfr_feature, "pad", pad, 0.0, 0, 0, F_NO_LO | F_NO_HI, ALL, 0, "fill after a var_len feature's values"),
    O_END,
};

#define TR(k) K(LOOM_T_##k)
static const opt transform_opts[] = {
    O_KIND(loom_transform_spec, "op", kind, 0, loom_transform_names_, ALL, "transform op"),
    O_INT(loom_transform_spec, "buffer", buffer, 0, 1, INT64_MAX, TR(SHUFFLE), TR(SHUFFLE), "shuffle buffer"),
    O_CUSTOM("buffer", parse_prefetch_buffer, TR(PREFETCH), 0, "prefetch queue depth; \"auto\" or -1 (default), 0 disables"),
    O_INT(loom_transform_spec, "seed", seed, 0, 0, INT64_MAX, TR(SHUFFLE), 0, "shuffle seed; default run.seed"),
    O_CUSTOM("features", parse_feature_names, TR(CONCAT) | TR(SELECT), TR(CONCAT) | TR(SELECT),
             "[\"a\", \"b\", ...]: concat joins them (each flattened per example) into `output`; select keeps only them"),
    O_STR(loom_transform_spec, "output", output, NULL, NULL, TR(CONCAT), TR(CONCAT), "the feature concat adds"),
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
    O_BOOL(loom_transform_spec, "drop_remainder", drop_remainder, 0, TR(PADDED_BATCH), "drop a short last batch"),
    O_CUSTOM("padded_shapes", parse_padded_shapes, TR(PADDED_BATCH), 0,
             "feature = [d0, ...] per feature, -1 = the largest in the batch"),
    O_CUSTOM("padding_values", parse_padding_values, TR(PADDED_BATCH), 0, "feature = value per feature, default 0"),
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
    {.name = "source", .type = OT_SUB, .applies = TR(INTERLEAVE), .required = TR(INTERLEAVE),
     .help = "the tfrecord, csv or text source opened on each input file name (without files)"},
    {.name = "dataset", .type = OT_SUB, .applies = TR(ZIP), .required = TR(ZIP),
     .help = "the dataset { source: ...; transforms: ...; } zipped with this one"},
    O_END,
};

#define MAP(k) K(LOOM_MAP_##k)
static const opt map_opts[] = {
    O_KIND(loom_map_spec, "fn", kind, 0, loom_map_names_, ALL, "map function"),
    O_STR(loom_map_spec, "feature", feature, NULL, NULL, ALL & ~MAP(LUA), ALL & ~MAP(LUA), "the feature it applies to"),
    O_ENUM(loom_map_spec, "dtype", dtype, 0, loom_cfg_dtype_names_, MAP(CAST) | MAP(DECODE_IMAGE), MAP(CAST),
           "target dtype (decode_image: uint8, or float32 in [0, 1])"),
    O_F64(loom_map_spec, "scale", scale, 1.0, 0, 0, F_NO_LO | F_NO_HI, MAP(SCALE), 0, "x * scale + offset"),
    O_F64(loom_map_spec, "offset", offset, 0.0, 0, 0, F_NO_LO | F_NO_HI, MAP(SCALE), 0, "x * scale + offset"),
    O_CUSTOM("mean", parse_norm_values, MAP(NORMALIZE), 0,
             "(x - mean) / std: a number, or one per index of the feature's last axis [m0, m1, ...]"),
    O_CUSTOM("std", parse_norm_values, MAP(NORMALIZE), 0, "(x - mean) / std: a number > 0, or one per index [s0, ...]"),
    O_BOOL(loom_map_spec, "adapt", adapt, 0, MAP(NORMALIZE),
           "mean and std per index of the last axis from one pass over data.train at start (cached in model_dir)"),
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

#define LY(k) K(LOOM_LAYER_##k)
static const opt layer_opts[] = {
    O_KIND(loom_layer_spec, "type", kind, 0, loom_layer_names_, ALL, "layer type"),
    O_STR(loom_layer_spec, "name", name, "", NULL, ALL, 0, "layer name; default <type>_<index>"),
    O_INT(loom_layer_spec, "units", units, 0, 1, LOOM_MAX_UNITS, LY(DENSE), LY(DENSE), "output units"),
    O_INT(loom_layer_spec, "filters", filters, 0, 1, LOOM_MAX_UNITS, LY(CONV2D), LY(CONV2D), "output channels"),
    O_PAIR(loom_layer_spec, "kernel_size", kernel, 0, 1, INT_MAX, LY(CONV2D), LY(CONV2D), "int or [h, w]"),
    O_PAIR(loom_layer_spec, "strides", stride, 1, 1, INT_MAX, LY(CONV2D) | LY(MAX_POOL2D) | LY(AVG_POOL2D), 0,
           "int or [h, w]; default 1 (conv2d) or pool_size (pooling)"),
    O_PAIR(loom_layer_spec, "pool_size", pool, 2, 1, INT_MAX, LY(MAX_POOL2D) | LY(AVG_POOL2D), 0, "int or [h, w]"),
    O_ENUM(loom_layer_spec, "padding", padding, LOOM_PAD_VALID, loom_padding_names_,
           LY(CONV2D) | LY(MAX_POOL2D) | LY(AVG_POOL2D), 0, "valid or same"),
    O_F64(loom_layer_spec, "alpha", alpha, 0.3, 0.0, 0, F_NO_HI, LY(ACTIVATION), 0, "leaky_relu: slope below 0"),
    O_F64(loom_layer_spec, "momentum", momentum, 0.99, 0.0, 1.0, F_HI_OPEN, LY(BATCH_NORM), 0,
          "moving statistics: m = momentum * m + (1 - momentum) * batch"),
    O_F64(loom_layer_spec, "epsilon", epsilon, 0.001, 0.0, 0, F_LO_OPEN | F_NO_HI, LY(BATCH_NORM) | LY(LAYER_NORM), 0,
          "added to the variance"),
    O_BOOL(loom_layer_spec, "sync", sync, 0, LY(BATCH_NORM),
           "batch statistics over the global batch of every replica and worker (SyncBatchNormalization)"),
    O_ENUM(loom_layer_spec, "activation", activation, LOOM_ACT_NONE, loom_activation_names_,
           LY(DENSE) | LY(CONV2D) | LY(ACTIVATION), LY(ACTIVATION), "activation function"),
    O_ENUM(loom_layer_spec, "kernel_init", kernel_init, LOOM_INIT_GLOROT_UNIFORM, loom_init_names_,
           LY(DENSE) | LY(CONV2D), 0, "kernel initialiser"),
    O_BOOL(loom_layer_spec, "use_bias", use_bias, 1, LY(DENSE) | LY(CONV2D), "add a bias"),
    O_F64(loom_layer_spec, "rate", rate, 0, 0.0, 1.0, F_HI_OPEN, LY(DROPOUT), LY(DROPOUT), "drop probability"),
    O_INT(loom_layer_spec, "input_dim", input_dim, 0, 1, (int64_t)1 << 31, LY(EMBEDDING), LY(EMBEDDING),
          "rows of the table: ids are in [0, input_dim)"),
    O_INT(loom_layer_spec, "output_dim", output_dim, 0, 1, 1 << 16, LY(EMBEDDING), LY(EMBEDDING),
          "the embedding width"),
    O_ENUM(loom_layer_spec, "combiner", combiner, LOOM_COMBINER_SUM, loom_combiner_names_, LY(EMBEDDING), 0,
           "several ids per column (input (columns, k)): sum or mean of their rows"),
    O_END,
};

static const opt model_opts[] = {
    O_STR(loom_model_spec, "input", input, "image", NULL, ALL, 0, "feature fed to the first layer"),
    O_STR(loom_model_spec, "label", label, "label", NULL, ALL, 0, "feature holding the target"),
    O_ENUM(loom_model_spec, "loss", loss, LOOM_LOSS_SPARSE_SOFTMAX_CE, loom_loss_names_, ALL, 0, "loss function"),
    O_CUSTOM("metrics", parse_metrics, ALL, 0,
             "list of: accuracy, auc, precision, recall, top_k_accuracy, mae, rmse (default: accuracy for a "
             "classification, none for a regression)"),
    O_INT(loom_model_spec, "auc_thresholds", auc_thresholds, 200, 2, 100000, ALL, 0, "auc: number of thresholds"),
    O_BOOL(loom_model_spec, "multi_label", multi_label, 0, ALL, "auc: one curve per output, averaged"),
    O_INT(loom_model_spec, "top_k", top_k, 5, 1, LOOM_MAX_UNITS, ALL, 0, "top_k_accuracy: k"),
    O_F64(loom_model_spec, "l2", l2, 0.0, 0.0, 0, F_NO_HI, ALL, 0,
          "L2 penalty on every dense and conv kernel: loss += l2 * sum(w^2)"),
    O_F64(loom_model_spec, "huber_delta", huber_delta, 1.0, 0.0, 0, F_LO_OPEN | F_NO_HI, ALL, 0,
          "huber: where the loss turns from quadratic to linear"),
    O_STR(loom_model_spec, "sample_weight", sample_weight, "", NULL, ALL, 0,
          "feature of per-example loss weights (Keras sample_weight), shape () or [1]"),
    O_CUSTOM("class_weight", parse_class_weight, ALL, 0,
             "one loss weight per class (binary_cross_entropy: [negative, positive])"),
    O_SUB("layers", 0, ALL, "a list of layer groups"),
    O_END,
};

#define OPT(k) K(LOOM_OPT_##k)
static const opt optimizer_opts[] = {
    O_KIND(loom_optimizer_spec, "type", kind, 0, loom_opt_names_, ALL, "optimizer"),
    O_F64(loom_optimizer_spec, "learning_rate", learning_rate, 0, 0.0, 0, F_LO_OPEN | F_NO_HI, ALL, ALL,
          "base learning rate"),
    O_F64(loom_optimizer_spec, "momentum", momentum, 0.9, 0.0, 1.0, F_HI_OPEN, OPT(MOMENTUM), 0, "momentum"),
    O_BOOL(loom_optimizer_spec, "nesterov", nesterov, 0, OPT(MOMENTUM), "Nesterov momentum"),
    O_F64(loom_optimizer_spec, "beta1", beta1, 0.9, 0.0, 1.0, F_HI_OPEN, OPT(ADAM) | OPT(ADAMW), 0, "adam beta1"),
    O_F64(loom_optimizer_spec, "beta2", beta2, 0.999, 0.0, 1.0, F_HI_OPEN, OPT(ADAM) | OPT(ADAMW), 0, "adam beta2"),
    O_F64(loom_optimizer_spec, "epsilon", epsilon, 1e-7, 0.0, 0, F_LO_OPEN | F_NO_HI,
          OPT(ADAM) | OPT(ADAMW) | OPT(RMSPROP) | OPT(ADAGRAD), 0, "adam, adamw, rmsprop, adagrad epsilon"),
    O_F64(loom_optimizer_spec, "weight_decay", weight_decay, 0.004, 0.0, 1.0, F_HI_OPEN, OPT(ADAMW), 0,
          "adamw: decoupled weight decay, p -= lr * weight_decay * p"),
    O_F64(loom_optimizer_spec, "rho", rho, 0.9, 0.0, 1.0, F_HI_OPEN, OPT(RMSPROP), 0, "rmsprop: decay of the mean square"),
    O_F64(loom_optimizer_spec, "clip_norm", clip_norm, 0.0, 0.0, 0, F_NO_HI, ALL, 0,
          "> 0: clip the gradients to this global norm (0 = off)"),
    O_F64(loom_optimizer_spec, "initial_accumulator_value", initial_accumulator, 0.1, 0.0, 0, F_NO_HI, OPT(ADAGRAD), 0,
          "adagrad: the accumulator's start"),
    O_SUB("schedule", 0, 0, "learning-rate schedule"),
    O_END,
};

#define SCH(k) K(LOOM_SCHED_##k)
static const opt schedule_opts[] = {
    O_KIND(loom_schedule_spec, "type", kind, LOOM_SCHED_CONSTANT, loom_sched_names_, 0, "schedule type"),
    O_INT(loom_schedule_spec, "decay_steps", decay_steps, 0, 1, INT64_MAX, SCH(EXPONENTIAL_DECAY) | SCH(COSINE),
          SCH(EXPONENTIAL_DECAY) | SCH(COSINE), "steps per decay period"),
    O_F64(loom_schedule_spec, "decay_rate", decay_rate, 0, 0.0, 0, F_LO_OPEN | F_NO_HI, SCH(EXPONENTIAL_DECAY),
          SCH(EXPONENTIAL_DECAY), "factor per decay period"),
    O_BOOL(loom_schedule_spec, "staircase", staircase, 0, SCH(EXPONENTIAL_DECAY), "integer division"),
    O_F64(loom_schedule_spec, "alpha", alpha, 0.0, 0.0, 1.0, 0, SCH(COSINE), 0, "floor as a fraction of lr"),
    O_CUSTOM("boundaries", parse_boundaries, SCH(PIECEWISE_CONSTANT), SCH(PIECEWISE_CONSTANT),
             "increasing step numbers"),
    O_CUSTOM("values", parse_values, SCH(PIECEWISE_CONSTANT), SCH(PIECEWISE_CONSTANT),
             "learning rates, one more than boundaries"),
    O_END,
};

#define STRAT_MWM K(LOOM_STRAT_MULTI_WORKER_MIRRORED)
#define STRAT_REPLICATED (K(LOOM_STRAT_MIRRORED) | K(LOOM_STRAT_CENTRAL_STORAGE) | K(LOOM_STRAT_PLUGIN) | \
                          K(LOOM_STRAT_MULTI_WORKER_MIRRORED))
/* Strategies whose replicas are local devices (multi_worker_mirrored: each worker's). */
#define STRAT_LOCAL_DEVICES (K(LOOM_STRAT_MIRRORED) | K(LOOM_STRAT_CENTRAL_STORAGE) | K(LOOM_STRAT_MULTI_WORKER_MIRRORED))
static const opt strategy_opts[] = {
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
    O_CUSTOM("options", parse_strategy_options, K(LOOM_STRAT_PLUGIN), 0,
             "a plugin strategy's own settings: KEY = value; ..."),
    {.name = "variable_partitioner", .type = OT_SUB, .applies = K(LOOM_STRAT_PARAMETER_SERVER),
     .help = "split variables along axis 0 over the ps tasks: type = \"fixed\" | \"min_size\" | \"max_size\""},
    {.name = "sync", .type = OT_SUB, .applies = K(LOOM_STRAT_PARAMETER_SERVER),
     .help = "synchronous updates: replicas_to_aggregate = N; total_replicas = M"},
    O_STR(loom_strategy_spec, "device", device, "cpu:0", NULL, K(LOOM_STRAT_ONE_DEVICE), 0, "\"cpu:0\" or \"gpu:N\""),
    O_STR(loom_strategy_spec, "device_backend", device_backend, "", NULL,
          K(LOOM_STRAT_ONE_DEVICE) | STRAT_LOCAL_DEVICES, 0,
          "device backend running the replicas: \"\" native (cuda for gpu), \"cpu\" the reference, a plugin's"),
    O_END,
};

#define PART(k) K(LOOM_PARTITIONER_##k)
static const opt partitioner_opts[] = {
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

static const opt ps_sync_opts[] = {
    O_INT(loom_ps_sync_spec, "replicas_to_aggregate", replicas_to_aggregate, 0, 1, 4096, ALL, ALL,
          "gradients aggregated per step (the first N to arrive)"),
    O_INT(loom_ps_sync_spec, "total_replicas", total_replicas, 0, 0, 4096, ALL, 0,
          "workers taking part (M - N are backups); 0 = the number of workers"),
    O_END,
};

static const opt plugins_opts[] = {
    O_CUSTOM("path", parse_plugin_path, ALL, 0,
             "directories searched for plugins (*.so), relative to the config's directory"),
    O_CUSTOM("require", parse_plugin_require, ALL, 0, "names of plugins that must load"),
    O_END,
};

static const opt run_opts[] = {
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

const char *const loom_cluster_role_keys[LOOM_CLUSTER_ROLES + 1] = {"chief", "worker", "ps", "evaluator", NULL};

static const opt cluster_opts[] = {
    O_CUSTOM("chief", parse_cluster_role, ALL, 0, "[\"host:port\"]: at most one task that coordinates"),
    O_CUSTOM("worker", parse_cluster_role, ALL, 0, "[\"host:port\", ...]: the tasks that train"),
    O_CUSTOM("ps", parse_cluster_role, ALL, 0, "[\"host:port\", ...]: parameter servers"),
    O_CUSTOM("evaluator", parse_cluster_role, ALL, 0, "[\"host:port\"]: a task that evaluates checkpoints"),
    O_F64(loom_cluster_spec, "connect_timeout", connect_timeout, 60.0, 0.0, 0, F_LO_OPEN | F_NO_HI, ALL, 0,
          "seconds to keep retrying a peer that is not up yet"),
    O_F64(loom_cluster_spec, "heartbeat_timeout", heartbeat_timeout, 30.0, 0.0, 0, F_LO_OPEN | F_NO_HI, ALL, 0,
          "seconds of silence after which a peer is declared lost"),
    O_F64(loom_cluster_spec, "heartbeat_interval", heartbeat_interval, 0.0, 0.0, 0, F_NO_HI, ALL, 0,
          "seconds between heartbeats; 0 = heartbeat_timeout / 5"),
    O_CUSTOM("secret_file", parse_cluster_path, ALL, 0, "file holding the shared secret (or $LOOM_CLUSTER_SECRET)"),
    O_BOOL(loom_cluster_spec, "tls", tls, 0, ALL, "TLS on every connection (needs tls_cert, tls_key, tls_ca)"),
    O_CUSTOM("tls_cert", parse_cluster_path, ALL, 0, "this task's certificate (PEM)"),
    O_CUSTOM("tls_key", parse_cluster_path, ALL, 0, "this task's private key (PEM)"),
    O_CUSTOM("tls_ca", parse_cluster_path, ALL, 0, "the CA that signed every task's certificate (PEM)"),
    O_BOOL(loom_cluster_spec, "insecure", insecure, 0, ALL, "allow non-loopback addresses without a secret"),
    O_INT(loom_cluster_spec, "port_base", port_base, 8888, 1, 65535, ALL, 0,
          "Slurm: the k-th task on a node listens on port_base + k"),
    O_END,
};

/* ---- the option engine --------------------------------------------------- */

static bool applies(const opt *o, int kind) { return kind < 0 ? o->applies == ALL : (o->applies & K(kind)) != 0; }
static bool required(const opt *o, int kind) { return kind >= 0 && (o->required & K(kind)) != 0; }

static void store_int(void *p, size_t size, int64_t v)
{
    if (size == sizeof(int))
        *(int *)p = (int)v;
    else
        *(int64_t *)p = v;
}

static void opt_default(const opt *o, void *base)
{
    char *p = (char *)base + o->off;
    switch (o->type) {
    case OT_INT: store_int(p, o->size, o->idef); break;
    case OT_F64: *(double *)p = o->fdef; break;
    case OT_BOOL: *(bool *)p = o->idef != 0; break;
    case OT_ENUM: *(int *)p = (int)o->idef; break;
    case OT_STR: snprintf(p, o->size, "%s", o->sdef ? o->sdef : ""); break;
    case OT_PAIR: ((int *)p)[0] = ((int *)p)[1] = (int)o->idef; break;
    default: break;
    }
}

static const char *irange_str(int64_t lo, int64_t hi, char *buf, size_t n)
{
    if (lo == INT64_MIN && hi == INT64_MAX)
        snprintf(buf, n, "an integer");
    else if (hi == INT64_MAX || (hi == INT_MAX && lo > INT_MIN))
        snprintf(buf, n, "an integer >= %lld", (long long)lo);
    else
        snprintf(buf, n, "an integer in [%lld, %lld]", (long long)lo, (long long)hi);
    return buf;
}

static const char *frange_str(const opt *o, char *buf, size_t n)
{
    char a[40], b[40];
    unsigned f = o->flags;
    if ((f & F_NO_LO) && (f & F_NO_HI))
        snprintf(buf, n, "a number");
    else if (f & F_NO_HI)
        snprintf(buf, n, "a number %s %s", (f & F_LO_OPEN) ? ">" : ">=", fmt_double(o->flo, a, sizeof a));
    else if (f & F_NO_LO)
        snprintf(buf, n, "a number %s %s", (f & F_HI_OPEN) ? "<" : "<=", fmt_double(o->fhi, b, sizeof b));
    else
        snprintf(buf, n, "a number in %s%s, %s%s", (f & F_LO_OPEN) ? "(" : "[", fmt_double(o->flo, a, sizeof a),
                 fmt_double(o->fhi, b, sizeof b), (f & F_HI_OPEN) ? ")" : "]");
    return buf;
}

/* An integer in [lo, hi] from s; false (with an error) otherwise. */
static bool get_int_in(ctx *c, const config_setting_t *s, int64_t lo, int64_t hi, int64_t *out)
{
    char r[80], v[300];
    const char *h = huge_text(c, s);
    if (h) {
        cerr(c, s, "expected %s, got %s (beyond the 64-bit range)", irange_str(lo, hi, r, sizeof r), h);
        return false;
    }
    if (!is_int(s)) {
        cerr(c, s, "expected %s, got %s", irange_str(lo, hi, r, sizeof r), value_str(s, v, sizeof v));
        return false;
    }
    int64_t x = config_setting_get_int64(s);
    if (x > hi && hi != INT64_MAX) { /* name the upper bound that "an integer >= lo" leaves out */
        cerr(c, s, "expected an integer in [%lld, %lld], got %lld", (long long)lo, (long long)hi, (long long)x);
        return false;
    }
    if (x < lo || x > hi) {
        cerr(c, s, "expected %s, got %lld", irange_str(lo, hi, r, sizeof r), (long long)x);
        return false;
    }
    *out = x;
    return true;
}

/* Resolves an enum string; -1 (with an error) when unknown. */
static int get_enum(ctx *c, const config_setting_t *s, const char *const *names)
{
    char all[512], v[300];
    join_names(names, all, sizeof all);
    if (config_setting_type(s) != CONFIG_TYPE_STRING) {
        cerr(c, s, "expected a string (one of: %s), got %s", all, value_str(s, v, sizeof v));
        return -1;
    }
    const char *str = config_setting_get_string(s);
    int i = find_name(names, str);
    if (i < 0) {
        loom_err *e = cerr(c, s, "unknown value \"%s\" (expected one of: %s)", str, all);
        const char *near = closest(names, str);
        if (e && near) loom_err_hint(e, "did you mean \"%s\"?", near);
    }
    return i;
}

/* Parses one present option into base. */
static void opt_parse(ctx *c, const opt *o, const config_setting_t *s, void *base)
{
    char *p = (char *)base + o->off;
    char r[120], v[300];
    int64_t x;
    switch (o->type) {
    case OT_INT: {
        int64_t hi = o->ihi;
        if (o->size == sizeof(int) && hi > INT_MAX) hi = INT_MAX;
        if (get_int_in(c, s, o->ilo, hi, &x)) store_int(p, o->size, x);
        break;
    }
    case OT_F64: {
        if (!is_number(s)) {
            cerr(c, s, "expected %s, got %s", frange_str(o, r, sizeof r), value_str(s, v, sizeof v));
            break;
        }
        double d = get_number(s);
        unsigned f = o->flags;
        bool ok = isfinite(d);
        if (!(f & F_NO_LO)) ok = ok && ((f & F_LO_OPEN) ? d > o->flo : d >= o->flo);
        if (!(f & F_NO_HI)) ok = ok && ((f & F_HI_OPEN) ? d < o->fhi : d <= o->fhi);
        if (!ok)
            cerr(c, s, "expected %s, got %s", frange_str(o, r, sizeof r), value_str(s, v, sizeof v));
        else
            *(double *)p = d;
        break;
    }
    case OT_BOOL:
        if (config_setting_type(s) != CONFIG_TYPE_BOOL)
            cerr(c, s, "expected true or false, got %s", value_str(s, v, sizeof v));
        else
            *(bool *)p = config_setting_get_bool(s) != 0;
        break;
    case OT_ENUM: {
        int i = get_enum(c, s, o->names);
        if (i >= 0) *(int *)p = i;
        break;
    }
    case OT_STR: {
        if (o->names) {
            if (get_enum(c, s, o->names) >= 0) snprintf(p, o->size, "%s", config_setting_get_string(s));
            break;
        }
        if (config_setting_type(s) != CONFIG_TYPE_STRING) {
            cerr(c, s, "expected a string, got %s", value_str(s, v, sizeof v));
            break;
        }
        const char *str = config_setting_get_string(s);
        if (!str[0])
            cerr(c, s, "expected a non-empty string, got \"\"");
        else if (strlen(str) >= o->size)
            cerr(c, s, "\"%s\" is too long (at most %zu characters)", str, o->size - 1);
        else
            snprintf(p, o->size, "%s", str);
        break;
    }
    case OT_PAIR: {
        int *pr = (int *)p;
        int64_t hi = o->ihi > INT_MAX ? INT_MAX : o->ihi;
        if (is_int(s)) {
            if (get_int_in(c, s, o->ilo, hi, &x)) pr[0] = pr[1] = (int)x;
        } else if ((config_setting_is_array(s) || config_setting_is_list(s)) && config_setting_length(s) == 2) {
            int64_t a, b;
            bool ok_a = get_int_in(c, config_setting_get_elem(s, 0), o->ilo, hi, &a);
            bool ok_b = get_int_in(c, config_setting_get_elem(s, 1), o->ilo, hi, &b);
            if (ok_a && ok_b) pr[0] = (int)a, pr[1] = (int)b;
        } else {
            cerr(c, s, "expected an integer or [h, w], got %s", value_str(s, v, sizeof v));
        }
        break;
    }
    case OT_CUSTOM: o->parse(c, s, base); break;
    default: break;
    }
}

/* Reads the kind entry (tbl[0], F_KIND) of group g; -1 when missing or bad. */
static int parse_kind(ctx *c, const config_setting_t *g, const opt *tbl, void *base)
{
    const opt *o = &tbl[0];
    LOOM_ASSERT(o->flags & F_KIND);
    const config_setting_t *s = config_setting_get_member(g, o->name);
    if (!s) {
        if (o->required) {
            char all[512];
            cerr(c, g, "missing required setting `%s` (one of: %s)", o->name, join_names(o->names, all, sizeof all));
            return -1;
        }
        opt_default(o, base);
        return (int)o->idef;
    }
    int k = get_enum(c, s, o->names);
    if (k >= 0) *(int *)((char *)base + o->off) = k;
    return k;
}

/* Parses every option of tbl (but the kind entry) that applies to kind:
 * the given value, or the default, or a "missing" error. SUB entries are
 * left to the caller, apart from the "missing" check. */
static void parse_opts(ctx *c, const config_setting_t *g, const opt *tbl, int kind, void *base)
{
    for (const opt *o = tbl; o->name; o++) {
        if ((o->flags & F_KIND) || !applies(o, kind) || (c->skip_key && !strcmp(o->name, c->skip_key))) continue;
        const config_setting_t *s = config_setting_get_member(g, o->name);
        if (!s) {
            if (required(o, kind) || (kind < 0 && o->required == ALL && o->applies == ALL))
                cerr(c, g, "missing required setting `%s` (%s)", o->name, o->help);
            else if (o->type != OT_SUB && o->type != OT_CUSTOM)
                opt_default(o, base);
            continue;
        }
        if (o->flags & F_UNSUPPORTED)
            cerr(c, s, "not supported yet (%s); remove this section", o->help);
        else if (o->type != OT_SUB)
            opt_parse(c, o, s, base);
    }
}

/* One table's view of a group when checking its keys. */
typedef struct scope {
    const opt  *tbl;
    int         kind; /* -1: unknown, so any key of the table is accepted */
    const char *gate; /* non-NULL: no key of this table applies here, e.g. "op = \"map\"" */
} scope;

/* Every key of g must be an option that applies to its kind. */
/* Whether some ungated scope has an entry named key that applies to its kind:
 * a key such as `feature` may belong to the transform table for one op and
 * to the map table for another, so every scope is asked before any complains. */
static bool key_applies(const char *key, const scope *sc, int n_sc)
{
    for (int j = 0; j < n_sc; j++)
        for (const opt *o = sc[j].tbl; o->name && !sc[j].gate; o++)
            if (!strcmp(o->name, key) && (sc[j].kind < 0 || applies(o, sc[j].kind))) return true;
    return false;
}

static void check_keys(ctx *c, const config_setting_t *g, const scope *sc, int n_sc)
{
    int len = config_setting_length(g);
    for (int i = 0; i < len; i++) {
        const config_setting_t *s = config_setting_get_elem(g, i);
        const char *key = config_setting_name(s);
        bool known = false, ok = key_applies(key, sc, n_sc);
        /* complain from the innermost ungated scope first: with op = "map" and fn = "pad",
         * `size` is a random_crop setting before it is a batch one */
        int order[8], no = 0;
        LOOM_ASSERT(n_sc <= 8);
        for (int j = n_sc - 1; j >= 0; j--)
            if (!sc[j].gate) order[no++] = j;
        for (int j = 0; j < n_sc; j++)
            if (sc[j].gate) order[no++] = j;
        for (int q = 0; q < n_sc && !ok; q++) {
            int j = order[q];
            unsigned mask = 0;
            bool here = false;
            for (const opt *o = sc[j].tbl; o->name; o++)
                if (!strcmp(o->name, key)) {
                    here = true;
                    mask |= o->applies;
                    if (!sc[j].gate && (sc[j].kind < 0 || applies(o, sc[j].kind))) ok = true;
                }
            if (!here || ok || known) continue;
            known = true;
            if (sc[j].gate) {
                cerr(c, s, "%s applies only to %s", key, sc[j].gate);
                continue;
            }
            /* applies only to other kinds of this group: list them */
            const opt *k0 = &sc[j].tbl[0];
            char kinds[256];
            size_t kl = 0;
            kinds[0] = 0;
            for (int b = 0; k0->names[b] && kl < sizeof kinds; b++)
                if (mask & K(b)) {
                    int w = snprintf(kinds + kl, sizeof kinds - kl, "%s\"%s\"", kl ? " or " : "", k0->names[b]);
                    if (w > 0) kl += (size_t)w;
                }
            /* the kind as written: a plugin's strategy has no name in the table */
            const config_setting_t *ks = config_setting_get_member(g, k0->name);
            const char *kind = ks && config_setting_type(ks) == CONFIG_TYPE_STRING ? config_setting_get_string(ks)
                                                                                   : loom_cfg_name_(k0->names, sc[j].kind);
            if (!kinds[0]) /* only to kinds without a name in the table */
                cerr(c, s, "%s does not apply to %s = \"%s\"", key, k0->name, kind);
            else
                cerr(c, s, "%s applies only to %s = %s (%s is \"%s\")", key, k0->name, kinds, k0->name, kind);
        }
        if (ok || known) continue;
        /* unknown: suggest the closest valid key of this group */
        const char *valid[64];
        int nv = 0;
        for (int j = 0; j < n_sc; j++) {
            if (sc[j].gate) continue;
            for (const opt *o = sc[j].tbl; o->name && nv < 63; o++) {
                if (sc[j].kind >= 0 && !applies(o, sc[j].kind)) continue;
                bool dup = false;
                for (int q = 0; q < nv; q++) dup = dup || !strcmp(valid[q], o->name);
                if (!dup) valid[nv++] = o->name;
            }
        }
        valid[nv] = NULL;
        const char *near = closest(valid, key);
        if (near) {
            cerr(c, s, "unknown setting `%s` (did you mean `%s`?)", key, near);
        } else {
            char all[512];
            cerr(c, s, "unknown setting `%s` (valid here: %s)", key, join_names(valid, all, sizeof all));
        }
    }
}

/* A group member that must itself be a group; NULL (with an error) when it is not. */
static const config_setting_t *sub_group(ctx *c, const config_setting_t *g, const char *key)
{
    const config_setting_t *s = config_setting_get_member(g, key);
    if (!s) return NULL;
    if (!config_setting_is_group(s)) {
        char v[300];
        cerr(c, s, "expected a group { ... }, got %s", value_str(s, v, sizeof v));
        return NULL;
    }
    return s;
}

/* A member that must be a list of groups (an empty array [] is accepted too). */
static const config_setting_t *sub_list(ctx *c, const config_setting_t *g, const char *key)
{
    const config_setting_t *s = config_setting_get_member(g, key);
    if (!s) return NULL;
    if (config_setting_is_list(s) || (config_setting_is_array(s) && config_setting_length(s) == 0)) return s;
    char v[300];
    cerr(c, s, "expected a list ( { ... }, ... ), got %s", value_str(s, v, sizeof v));
    return NULL;
}

/* ---- custom options ------------------------------------------------------ */

static void parse_version(ctx *c, const config_setting_t *s, void *base)
{
    loom_spec *spec = base;
    char v[300];
    if (!is_int(s) || config_setting_get_int64(s) != 1) {
        loom_err *e = cerr(c, s, "unsupported config version %s (this loom reads version = 1)",
                           value_str(s, v, sizeof v));
        if (e) loom_err_hint(e, "write `version = 1;`");
        return;
    }
    spec->version = 1;
}

static void parse_features(ctx *c, const config_setting_t *s, void *base)
{
    loom_source_spec *src = base;
    char v[300];
    if (!config_setting_is_group(s)) {
        cerr(c, s, "expected a group { NAME = \"file.idx\"; ... }, got %s", value_str(s, v, sizeof v));
        return;
    }
    int n = config_setting_length(s);
    if (n < 1 || n > LOOM_MAX_FEATURES) {
        cerr(c, s, "expected 1 to %d features, got %d", LOOM_MAX_FEATURES, n);
        return;
    }
    for (int i = 0; i < n; i++) {
        const config_setting_t *f = config_setting_get_elem(s, i);
        const char *name = config_setting_name(f);
        if (config_setting_type(f) != CONFIG_TYPE_STRING) {
            cerr(c, f, "expected a file name string, got %s", value_str(f, v, sizeof v));
            continue;
        }
        if (strlen(name) >= LOOM_NAME_MAX) {
            cerr(c, f, "feature name is too long (at most %d characters)", LOOM_NAME_MAX - 1);
            continue;
        }
        const char *file = config_setting_get_string(f);
        char full[LOOM_PATH_MAX + 8];
        int w = file[0] == '/' ? snprintf(full, sizeof full, "%s", file)
                               : snprintf(full, sizeof full, "%s/%s", c->dir, file);
        if (!file[0] || w < 0 || w >= LOOM_PATH_MAX) {
            cerr(c, f, "bad file name \"%s\" (empty or too long)", file);
            continue;
        }
        struct stat st;
        if (access(full, R_OK) != 0) {
            loom_err *e = cerr(c, f, "cannot read \"%s\" (resolved to %s): %s", file, full, strerror(errno));
            if (e) loom_err_hint(e, "relative paths are relative to the config file's directory");
            continue;
        }
        if (stat(full, &st) != 0 || !S_ISREG(st.st_mode)) {
            cerr(c, f, "\"%s\" (resolved to %s) is not a regular file", file, full);
            continue;
        }
        int k = src->n_features++;
        snprintf(src->feature[k], sizeof src->feature[k], "%s", name);
        memcpy(src->file[k], full, (size_t)w + 1); /* w < LOOM_PATH_MAX, checked above */
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

static void parse_files(ctx *c, const config_setting_t *s, void *base)
{
    loom_source_spec *src = base;
    char v[300];
    bool one = config_setting_type(s) == CONFIG_TYPE_STRING;
    if (!one && !config_setting_is_array(s) && !config_setting_is_list(s)) {
        cerr(c, s, "expected a list of paths or glob patterns [\"data/train-*.tfrecord\", ...], got %s",
             value_str(s, v, sizeof v));
        return;
    }
    int n = one ? 1 : config_setting_length(s);
    if (n < 1 || n > LOOM_MAX_FILE_PATTERNS) {
        cerr(c, s, "expected 1 to %d paths or patterns, got %d", LOOM_MAX_FILE_PATTERNS, n);
        return;
    }
    char edir[LOOM_PATH_MAX];
    if (loom_glob_escape(c->dir, edir, sizeof edir) < 0) {
        cerr(c, s, "the config's directory %s is too long", c->dir);
        return;
    }
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = one ? s : config_setting_get_elem(s, i);
        if (config_setting_type(e) != CONFIG_TYPE_STRING) {
            cerr(c, e, "expected a path or glob pattern string, got %s", value_str(e, v, sizeof v));
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
            cerr(c, e, "bad path \"%s\" (empty or too long)", pat);
            continue;
        }
        int m = count_matches(full);
        if (m < 0) {
            cerr(c, e, "cannot expand \"%s\" (resolved to %s): %s", pat, shown, strerror(errno));
            continue;
        }
        if (m == 0) {
            loom_err *er;
            if (!strpbrk(pat, "*?[") && access(shown, R_OK) != 0)
                er = cerr(c, e, "cannot read \"%s\" (resolved to %s): %s", pat, shown, strerror(errno));
            else if (!strpbrk(pat, "*?["))
                er = cerr(c, e, "\"%s\" (resolved to %s) is not a regular file", pat, shown);
            else
                er = cerr(c, e, "no files match \"%s\" (resolved to %s)", pat, shown);
            if (er) loom_err_hint(er, "relative paths are relative to the config file's directory");
            continue;
        }
        memcpy(src->pattern[src->n_patterns++], full, (size_t)w + 1); /* w < LOOM_PATH_MAX, checked above */
    }
}

static void parse_tfr_shape(ctx *c, const config_setting_t *s, void *base)
{
    loom_tfr_feature *f = base;
    char v[300];
    if (!config_setting_is_array(s) && !config_setting_is_list(s)) {
        cerr(c, s, "expected a shape such as [28, 28] ([] for a scalar), got %s", value_str(s, v, sizeof v));
        return;
    }
    int n = config_setting_length(s);
    if (n > 8) {
        cerr(c, s, "expected 0 to 8 dimensions, got %d", n);
        return;
    }
    int64_t numel = 1;
    bool fits = true;
    for (int i = 0; i < n; i++) {
        int64_t x;
        if (!get_int_in(c, config_setting_get_elem(s, i), 1, INT32_MAX, &x)) return;
        f->shape[i] = x;
        fits = fits && loom_mul_ok(numel, x, &numel);
    }
    if (!fits || numel > (1 << 30)) {
        if (fits)
            cerr(c, s, "%lld values per element is too many (at most %d)", (long long)numel, 1 << 30);
        else
            cerr(c, s, "more than 2^63 values per element is too many (at most %d)", 1 << 30);
        return;
    }
    f->rank = n;
}

/* A value for a feature of dtype dt (default or pad): integral for the
 * integer dtypes, in [0, 255] for uint8. */
static void check_fill(ctx *c, const config_setting_t *s, loom_tfr_dtype dt)
{
    char v[300];
    if (!s || !is_number(s)) return; /* a non-number was reported by the option engine */
    if (dt == LOOM_TFR_FLOAT32) return;
    int64_t x;
    if (!is_int(s)) {
        cerr(c, s, "expected an integer (the feature is %s), got %s", loom_tfr_dtype_names_[dt],
             value_str(s, v, sizeof v));
        return;
    }
    if (dt == LOOM_TFR_UINT8) get_int_in(c, s, 0, 255, &x);
}

/* One kind of NAME = { ... } group under a source (tfrecord features, csv
 * columns, synthetic features): the shared grammar is walked by
 * parse_feature_groups, the kind-specific cross-checks are left to check. */
typedef struct feature_kind {
    const char *noun;     /* "features" | "columns", in the count error */
    const char *body;     /* the entry's grammar in errors: "dtype = ...; shape = [...];" */
    const char *example;  /* the hint's entry body: "dtype = \"int64\"; shape = [];" */
    const opt  *opts;     /* the entry's option table; tbl[0] is its kind (dtype) */
    size_t      size;     /* sizeof one entry of items */
    void (*check)(ctx *c, const loom_source_spec *src, const config_setting_t *g, const char *name, void *item,
                  int k);
} feature_kind;

/* Parses group s into items[0..] (src->tfr, ->csv or ->syn) and src->feature,
 * counting them in src->n_features. */
static void parse_feature_groups(ctx *c, const config_setting_t *s, loom_source_spec *src, void *items,
                                 const feature_kind *fk)
{
    char v[300];
    if (!config_setting_is_group(s)) {
        cerr(c, s, "expected a group { NAME = { %s }; ... }, got %s", fk->body, value_str(s, v, sizeof v));
        return;
    }
    int n = config_setting_length(s);
    if (n < 1 || n > LOOM_MAX_FEATURES) {
        cerr(c, s, "expected 1 to %d %s, got %d", LOOM_MAX_FEATURES, fk->noun, n);
        return;
    }
    for (int i = 0; i < n; i++) {
        const config_setting_t *g = config_setting_get_elem(s, i);
        const char *name = config_setting_name(g);
        if (!config_setting_is_group(g)) {
            loom_err *e = cerr(c, g, "expected a group { %s }, got %s", fk->body, value_str(g, v, sizeof v));
            if (e) loom_err_hint(e, "e.g. %s = { %s };", name, fk->example);
            continue;
        }
        if (strlen(name) >= LOOM_NAME_MAX) {
            cerr(c, g, "feature name is too long (at most %d characters)", LOOM_NAME_MAX - 1);
            continue;
        }
        void *item = (char *)items + (size_t)src->n_features * fk->size;
        int k = parse_kind(c, g, fk->opts, item);
        parse_opts(c, g, fk->opts, k, item);
        scope sc = {fk->opts, k, NULL};
        check_keys(c, g, &sc, 1);
        fk->check(c, src, g, name, item, k);
        snprintf(src->feature[src->n_features], LOOM_NAME_MAX, "%s", name);
        src->n_features++;
    }
}

static void check_tfr_feature(ctx *c, const loom_source_spec *src, const config_setting_t *g, const char *name,
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
        cerr(c, def, "default applies only to fixed-length features (a missing var_len feature is all pad)");
    if (pad && !f->var_len) cerr(c, pad, "pad applies only with var_len = true");
    if (f->var_len && shp && f->rank == 0 && config_setting_length(shp) == 0)
        cerr(c, shp, "a var_len feature needs a shape with at least one dimension (its maximum length)");
}

static void parse_tfr_features(ctx *c, const config_setting_t *s, void *base)
{
    static const feature_kind fk = {"features", "dtype = ...; shape = [...];", "dtype = \"int64\"; shape = [];",
                                    tfr_feature_opts, sizeof(loom_tfr_feature), check_tfr_feature};
    loom_source_spec *src = base;
    parse_feature_groups(c, s, src, src->tfr, &fk);
}

/* ---- csv, text and synthetic sources -------------------------------------- */

static bool cfg_dtype_is_int(loom_cfg_dtype dt) { return dt == LOOM_CFG_U8 || dt == LOOM_CFG_I32 || dt == LOOM_CFG_I64; }

/* A number s (already checked to be one) that must fit dtype dt: integral and in range for the integer dtypes.
 * hi_excl: an exclusive upper bound (synthetic max), one past the dtype's range. */
static bool check_value(ctx *c, const config_setting_t *s, loom_cfg_dtype dt, bool hi_excl)
{
    char v[300];
    if (!s || !is_number(s) || !cfg_dtype_is_int(dt)) return true;
    if (!is_int(s)) {
        cerr(c, s, "expected an integer (the feature is %s), got %s", loom_cfg_dtype_names_[dt],
             value_str(s, v, sizeof v));
        return false;
    }
    int64_t x, ex = hi_excl ? 1 : 0;
    if (dt == LOOM_CFG_U8) return get_int_in(c, s, 0, 255 + ex, &x);
    if (dt == LOOM_CFG_I32) return get_int_in(c, s, INT32_MIN, (int64_t)INT32_MAX + ex, &x);
    return true;
}

static void parse_delimiter(ctx *c, const config_setting_t *s, void *base)
{
    loom_source_spec *src = base;
    char v[300];
    const char *d = config_setting_type(s) == CONFIG_TYPE_STRING ? config_setting_get_string(s) : NULL;
    if (!d || strlen(d) != 1 || strchr("\"\r\n", d[0])) {
        loom_err *e = cerr(c, s, "expected one character other than '\"', CR or LF, got %s", value_str(s, v, sizeof v));
        if (e) loom_err_hint(e, "e.g. delimiter = \";\"; or delimiter = \"\\t\";");
        return;
    }
    src->delimiter = d[0];
}

#define CSV_MAX_FIELDS_ (1 << 20) /* a range's last field: far beyond any real table, far from overflow */

/* index = 3 (one field, a scalar feature) or index = "1-30" (fields 1 to 30, a vector feature of shape [30]). */
static void parse_csv_index(ctx *c, const config_setting_t *s, void *base)
{
    loom_csv_column *col = base;
    char v[300];
    int64_t x;
    col->count = 0;
    if (is_int(s)) {
        if (get_int_in(c, s, 0, INT_MAX, &x)) col->index = (int)x;
        return;
    }
    const char *str = config_setting_type(s) == CONFIG_TYPE_STRING ? config_setting_get_string(s) : NULL;
    long long a = -1, b = -1;
    int used = 0;
    if (!str || sscanf(str, " %lld - %lld %n", &a, &b, &used) != 2 || str[used] || a < 0 || b < a ||
        b >= CSV_MAX_FIELDS_) {
        loom_err *e = cerr(c, s, "expected a field index >= 0 or a range \"first-last\" (0-based, inclusive, "
                                 "first <= last < %d), got %s", CSV_MAX_FIELDS_, value_str(s, v, sizeof v));
        if (e) loom_err_hint(e, "e.g. index = \"1-30\"; gathers fields 1 to 30 into one feature of shape [30]");
        return;
    }
    col->index = (int)a;
    col->count = (int)(b - a + 1);
}

static void check_csv_column(ctx *c, const loom_source_spec *src, const config_setting_t *g, const char *name,
                             void *item, int k)
{
    loom_csv_column *col = item;
    const config_setting_t *def = config_setting_get_member(g, "default");
    const config_setting_t *idx = config_setting_get_member(g, "index");
    const config_setting_t *cn = config_setting_get_member(g, "column");
    col->has_default = def != NULL;
    if (k >= 0) check_value(c, def, (loom_cfg_dtype)k, false);
    if (!src->header && !idx) {
        loom_err *e = cerr(c, g, "missing required setting `index` (with header = false columns are selected by "
                                 "position)");
        if (e) loom_err_hint(e, "e.g. %s = { dtype = \"%s\"; index = 0; };", name, loom_cfg_name_(loom_cfg_dtype_names_, k));
    }
    if (!idx) col->index = -1;
    if (idx && cn) cerr(c, cn, "give either index or column, not both");
    if (!src->header && cn) cerr(c, cn, "column (a header name) needs header = true");
    if (!col->column[0] && col->index < 0) snprintf(col->column, sizeof col->column, "%s", name);
}

static void parse_csv_columns(ctx *c, const config_setting_t *s, void *base)
{
    static const feature_kind fk = {"columns", "dtype = ...;", "dtype = \"float32\";", csv_column_opts,
                                    sizeof(loom_csv_column), check_csv_column};
    loom_source_spec *src = base;
    if (!src->delimiter) src->delimiter = ','; /* delimiter (parsed before, when given) is a custom option */
    parse_feature_groups(c, s, src, src->csv, &fk);
}

static void parse_syn_shape(ctx *c, const config_setting_t *s, void *base)
{
    loom_syn_feature *f = base;
    loom_tfr_feature t = {0};
    parse_tfr_shape(c, s, &t); /* the same grammar: [] or [d0, ...], each >= 1 */
    f->rank = t.rank;
    memcpy(f->shape, t.shape, sizeof f->shape);
}

static void check_syn_feature(ctx *c, const loom_source_spec *src, const config_setting_t *g, const char *name,
                              void *item, int k)
{
    (void)src;
    loom_syn_feature *f = item;
    const config_setting_t *lo = config_setting_get_member(g, "min");
    const config_setting_t *hi = config_setting_get_member(g, "max");
    const config_setting_t *ds = config_setting_get_member(g, "distribution");
    if (k >= 0 && cfg_dtype_is_int((loom_cfg_dtype)k)) {
        if (f->dist == LOOM_SYN_NORMAL && ds)
            cerr(c, ds, "normal applies only to float32 and float64 features (this one is %s)",
                 loom_cfg_dtype_names_[k]);
        if (!hi && f->dist == LOOM_SYN_UNIFORM) {
            loom_err *e = cerr(c, g, "missing required setting `max` (integer features draw from [min, max))");
            if (e) loom_err_hint(e, "e.g. %s = { dtype = \"%s\"; max = 10; };", name, loom_cfg_dtype_names_[k]);
        }
        bool ok = check_value(c, lo, (loom_cfg_dtype)k, false) && check_value(c, hi, (loom_cfg_dtype)k, true);
        if (ok && hi && !(f->max > f->min))
            cerr(c, hi, "max must be greater than min (%g), got %g", f->min, f->max);
    } else if (k >= 0 && f->dist == LOOM_SYN_UNIFORM && !(f->max > f->min)) {
        cerr(c, hi ? hi : g, "max must be greater than min (min = %g, max = %g)", f->min, f->max);
    }
}

static void parse_syn_features(ctx *c, const config_setting_t *s, void *base)
{
    static const feature_kind fk = {"features", "dtype = ...; shape = [...];",
                                    "dtype = \"float32\"; shape = [28, 28];", syn_feature_opts,
                                    sizeof(loom_syn_feature), check_syn_feature};
    loom_source_spec *src = base;
    parse_feature_groups(c, s, src, src->syn, &fk);
}

static void parse_syn_ctr(ctx *c, const config_setting_t *s, void *base)
{
    loom_source_spec *src = base;
    char v[300];
    if (!config_setting_is_group(s)) {
        cerr(c, s, "expected a group such as ctr = { columns = 26; }, got %s", value_str(s, v, sizeof v));
        return;
    }
    src->ctr.on = true;
    parse_opts(c, s, syn_ctr_opts, 0, &src->ctr);
    scope sc = {syn_ctr_opts, 0, NULL};
    check_keys(c, s, &sc, 1);
}

static void parse_shape(ctx *c, const config_setting_t *s, void *base)
{
    loom_map_spec *m = base;
    char v[300];
    if (!config_setting_is_array(s) && !config_setting_is_list(s)) {
        cerr(c, s, "expected a shape such as [28, 28, 1], got %s", value_str(s, v, sizeof v));
        return;
    }
    int n = config_setting_length(s);
    if (n < 1 || n > 8) {
        cerr(c, s, "expected 1 to 8 dimensions, got %d", n);
        return;
    }
    int unknown = 0;
    bool ok = true;
    for (int i = 0; i < n; i++) {
        const config_setting_t *d = config_setting_get_elem(s, i);
        int64_t x;
        if (!get_int_in(c, d, -1, INT32_MAX, &x)) {
            ok = false;
            continue;
        }
        if (x == 0) {
            cerr(c, d, "expected a dimension >= 1 (or -1 once), got 0");
            ok = false;
        }
        if (x == -1 && ++unknown == 2) {
            cerr(c, s, "only one dimension may be -1");
            ok = false;
        }
        m->shape[i] = x;
    }
    int64_t numel = 1;
    for (int i = 0; ok && i < n; i++)
        if (m->shape[i] > 0 && (!loom_mul_ok(numel, m->shape[i], &numel) || numel > (1 << 30))) {
            cerr(c, s, "more than %d values per element is too many", 1 << 30);
            ok = false;
        }
    if (ok) m->rank = n;
}

/* map parallel: an int >= 1 or "auto" (LOOM_PARALLEL_AUTO). */
static void parse_parallel(ctx *c, const config_setting_t *s, void *base)
{
    loom_transform_spec *t = base;
    char v[300];
    if (config_setting_type(s) == CONFIG_TYPE_STRING) {
        if (!strcmp(config_setting_get_string(s), "auto"))
            t->parallel = LOOM_PARALLEL_AUTO;
        else
            cerr(c, s, "expected an integer >= 1 or \"auto\", got %s", value_str(s, v, sizeof v));
        return;
    }
    if (!is_int(s)) {
        cerr(c, s, "expected an integer >= 1 or \"auto\", got %s", value_str(s, v, sizeof v));
        return;
    }
    int64_t x;
    if (get_int_in(c, s, 1, 1024, &x)) t->parallel = (int)x;
}

/* prefetch buffer: an int >= -1 or "auto" (-1). */
static void parse_prefetch_buffer(ctx *c, const config_setting_t *s, void *base)
{
    loom_transform_spec *t = base;
    char v[300];
    if (config_setting_type(s) == CONFIG_TYPE_STRING) {
        if (!strcmp(config_setting_get_string(s), "auto"))
            t->buffer = -1;
        else
            cerr(c, s, "expected an integer >= 0 or \"auto\", got %s", value_str(s, v, sizeof v));
        return;
    }
    int64_t x;
    if (get_int_in(c, s, -1, INT64_MAX, &x)) t->buffer = x;
}

/* autotune.ram_budget: bytes (an integer, or "512MiB", "4GiB", "1.5GB", "800kB"),
 * or a share of physical memory ("50%"); 0 means the default share. */
static void parse_ram_budget(ctx *c, const config_setting_t *s, void *base)
{
    loom_data_options *o = base;
    char v[300];
    if (is_int(s)) {
        int64_t x;
        if (get_int_in(c, s, 0, INT64_MAX, &x)) o->ram_budget = x;
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
    loom_err *e = cerr(c, s, "expected bytes (an integer, or a string such as \"4GiB\" or \"512MB\") or a share of "
                       "memory (\"50%%\"), got %s", value_str(s, v, sizeof v));
    if (e) loom_err_hint(e, "units: B, kB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, TiB (powers of 1024)");
}

static void parse_boundaries(ctx *c, const config_setting_t *s, void *base)
{
    loom_schedule_spec *sch = base;
    char v[300];
    if (!config_setting_is_array(s) && !config_setting_is_list(s)) {
        cerr(c, s, "expected an array of step numbers [b0, b1, ...], got %s", value_str(s, v, sizeof v));
        return;
    }
    int n = config_setting_length(s);
    if (n < 1 || n > LOOM_MAX_BOUNDARIES) {
        cerr(c, s, "expected 1 to %d boundaries, got %d", LOOM_MAX_BOUNDARIES, n);
        return;
    }
    for (int i = 0; i < n; i++) {
        const config_setting_t *b = config_setting_get_elem(s, i);
        int64_t x;
        if (!get_int_in(c, b, 0, INT64_MAX, &x)) return;
        if (i > 0 && x <= sch->boundaries[i - 1]) {
            cerr(c, b, "boundaries must be increasing: %lld follows %lld", (long long)x,
                 (long long)sch->boundaries[i - 1]);
            return;
        }
        sch->boundaries[i] = x;
    }
    sch->n_boundaries = n;
}

static void parse_metrics(ctx *c, const config_setting_t *s, void *base)
{
    loom_model_spec *m = base;
    char v[300];
    loc_of(c, s, &m->metrics_loc);
    if (!config_setting_is_array(s) && !config_setting_is_list(s)) {
        cerr(c, s, "expected a list of metric names [\"accuracy\", \"auc\", ...], got %s", value_str(s, v, sizeof v));
        return;
    }
    int n = config_setting_length(s);
    m->n_metrics = 0;
    m->metrics_set = true;
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = config_setting_get_elem(s, i);
        int k = get_enum(c, e, loom_metric_names_);
        if (k < 0) continue;
        bool dup = false;
        for (int j = 0; j < m->n_metrics; j++) dup |= (int)m->metric[j] == k;
        if (dup) {
            cerr(c, e, "metric \"%s\" is listed twice", loom_metric_names_[k]);
            continue;
        }
        m->metric[m->n_metrics++] = (loom_metric_kind)k;
    }
}

static void parse_class_weight(ctx *c, const config_setting_t *s, void *base)
{
    loom_model_spec *m = base;
    char v[300];
    if (!config_setting_is_array(s) && !config_setting_is_list(s)) {
        cerr(c, s, "expected an array of weights, one per class [w0, w1, ...], got %s", value_str(s, v, sizeof v));
        return;
    }
    int n = config_setting_length(s);
    if (n < 2 || n > LOOM_MAX_CLASS_WEIGHTS) {
        cerr(c, s, "expected 2 to %d class weights, got %d", LOOM_MAX_CLASS_WEIGHTS, n);
        return;
    }
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = config_setting_get_elem(s, i);
        if (!is_number(e) || !(get_number(e) >= 0) || !isfinite(get_number(e))) {
            cerr(c, e, "expected a class weight >= 0, got %s", value_str(e, v, sizeof v));
            return;
        }
        m->class_weight[i] = (float)get_number(e);
    }
    m->n_class_weights = n;
}

static void parse_values(ctx *c, const config_setting_t *s, void *base)
{
    loom_schedule_spec *sch = base;
    char v[300];
    if (!config_setting_is_array(s) && !config_setting_is_list(s)) {
        cerr(c, s, "expected an array of learning rates [v0, v1, ...], got %s", value_str(s, v, sizeof v));
        return;
    }
    int n = config_setting_length(s);
    if (n < 2 || n > LOOM_MAX_BOUNDARIES + 1) {
        cerr(c, s, "expected 2 to %d values, got %d", LOOM_MAX_BOUNDARIES + 1, n);
        return;
    }
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = config_setting_get_elem(s, i);
        if (!is_number(e) || !(get_number(e) > 0) || !isfinite(get_number(e))) {
            cerr(c, e, "expected a learning rate > 0, got %s", value_str(e, v, sizeof v));
            return;
        }
        sch->values[i] = get_number(e);
    }
}

/* filter: in = [...] or not_in = [...]; which one is given decides the predicate. */
static void parse_feature_names(ctx *c, const config_setting_t *s, void *base)
{
    loom_transform_spec *t = base;
    char v[300];
    int n = (config_setting_is_array(s) || config_setting_is_list(s)) ? config_setting_length(s) : -1;
    if (n < 1 || n > LOOM_MAX_FEATURES) {
        cerr(c, s, "expected a list of 1 to %d feature names, got %s", LOOM_MAX_FEATURES, value_str(s, v, sizeof v));
        return;
    }
    t->n_names = 0;
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = config_setting_get_elem(s, i);
        const char *str = config_setting_type(e) == CONFIG_TYPE_STRING ? config_setting_get_string(e) : NULL;
        if (!str || !str[0] || strlen(str) >= LOOM_NAME_MAX) {
            cerr(c, e, "expected a feature name (1 to %d characters), got %s", LOOM_NAME_MAX - 1, value_str(e, v, sizeof v));
            continue;
        }
        for (int j = 0; j < t->n_names; j++)
            if (!strcmp(t->names[j], str)) cerr(c, e, "\"%s\" is listed twice", str);
        snprintf(t->names[t->n_names++], LOOM_NAME_MAX, "%s", str);
    }
}

static void parse_filter_values(ctx *c, const config_setting_t *s, void *base)
{
    loom_transform_spec *t = base;
    char v[300];
    if (!config_setting_is_array(s) && !config_setting_is_list(s)) {
        cerr(c, s, "expected an array of numbers such as [0, 1, 2], got %s", value_str(s, v, sizeof v));
        return;
    }
    int n = config_setting_length(s);
    if (n < 1 || n > LOOM_MAX_FILTER_VALUES) {
        cerr(c, s, "expected 1 to %d values, got %d", LOOM_MAX_FILTER_VALUES, n);
        return;
    }
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = config_setting_get_elem(s, i);
        if (!is_number(e) || !isfinite(get_number(e))) {
            cerr(c, e, "expected a number, got %s", value_str(e, v, sizeof v));
            return;
        }
        t->values[i] = get_number(e);
    }
    t->n_values = n;
    t->filter = strcmp(config_setting_name(s), "in") ? LOOM_FILTER_NOT_IN : LOOM_FILTER_IN;
}

/* padded_batch: padded_shapes: { NAME = [d0, ...]; ... }; each dim >= 1, or -1 for the largest in the batch. */
static void parse_padded_shapes(ctx *c, const config_setting_t *s, void *base)
{
    loom_transform_spec *t = base;
    char v[300];
    if (!config_setting_is_group(s)) {
        cerr(c, s, "expected a group { feature = [d0, ...]; ... }, got %s", value_str(s, v, sizeof v));
        return;
    }
    int n = config_setting_length(s);
    for (int i = 0; i < n && t->n_padded < LOOM_MAX_FEATURES; i++) {
        const config_setting_t *e = config_setting_get_elem(s, i);
        if (!config_setting_is_array(e) && !config_setting_is_list(e)) {
            cerr(c, e, "expected a shape such as [16] or [-1, 8], got %s", value_str(e, v, sizeof v));
            continue;
        }
        int r = config_setting_length(e);
        if (r > 8) {
            cerr(c, e, "expected at most 8 dimensions, got %d", r);
            continue;
        }
        int k = t->n_padded;
        bool ok = true;
        for (int d = 0; d < r; d++) {
            const config_setting_t *x = config_setting_get_elem(e, d);
            int64_t dim;
            if (!get_int_in(c, x, -1, INT32_MAX, &dim)) {
                ok = false;
                continue;
            }
            if (dim == 0) {
                cerr(c, x, "expected a dimension >= 1 (or -1: the largest in the batch), got 0");
                ok = false;
            }
            t->padded_shape[k][d] = dim;
        }
        if (!ok) continue;
        snprintf(t->padded_name[k], LOOM_NAME_MAX, "%s", config_setting_name(e));
        t->padded_rank[k] = r;
        t->n_padded++;
    }
}

/* padded_batch: padding_values: { NAME = number; ... }. */
static void parse_padding_values(ctx *c, const config_setting_t *s, void *base)
{
    loom_transform_spec *t = base;
    char v[300];
    if (!config_setting_is_group(s)) {
        cerr(c, s, "expected a group { feature = value; ... }, got %s", value_str(s, v, sizeof v));
        return;
    }
    int n = config_setting_length(s);
    for (int i = 0; i < n && t->n_padding < LOOM_MAX_FEATURES; i++) {
        const config_setting_t *e = config_setting_get_elem(s, i);
        if (!is_number(e) || !isfinite(get_number(e))) {
            cerr(c, e, "expected a number, got %s", value_str(e, v, sizeof v));
            continue;
        }
        snprintf(t->padding_name[t->n_padding], LOOM_NAME_MAX, "%s", config_setting_name(e));
        t->padding_value[t->n_padding++] = get_number(e);
    }
}

/* Cross-field checks of the transforms added with filter..cache. */
static void check_transform_more(ctx *c, const config_setting_t *g, loom_transform_spec *t, int op)
{
    const config_setting_t *in = config_setting_get_member(g, "in"), *nin = config_setting_get_member(g, "not_in");
    const config_setting_t *lo = config_setting_get_member(g, "min"), *hi = config_setting_get_member(g, "max");
    const config_setting_t *lua = config_setting_get_member(g, "lua"), *feat = config_setting_get_member(g, "feature");
    const config_setting_t *plug = config_setting_get_member(g, "plugin");
    if (op == LOOM_T_FILTER && (lua || plug)) {
        if (lua && plug)
            cerr(c, plug, "a filter takes either `lua` or `plugin`, not both");
        else if (feat || in || nin || lo || hi)
            cerr(c, lua ? lua : plug, "a filter takes either `%s` or `feature` with a predicate, not both",
                 lua ? "lua" : "plugin");
        t->filter = LOOM_FILTER_LUA;
        if (lua) resolve_lua_ref(c, lua, t->map.lua, sizeof t->map.lua);
    } else if (op == LOOM_T_FILTER) {
        int given = (in != NULL) + (nin != NULL) + (lo || hi);
        if (!feat)
            cerr(c, g, "missing required setting `feature` (the scalar feature tested), or `lua` (a Lua predicate)");
        if (given == 0)
            cerr(c, g, "filter needs a predicate: one of `in`, `not_in`, or `min`/`max`");
        else if (given > 1)
            cerr(c, in && nin ? nin : (lo ? lo : hi), "filter takes one predicate: `in`, `not_in`, or `min`/`max`, not several");
        else if (lo || hi)
            t->filter = LOOM_FILTER_RANGE;
        if (lo && hi && t->min > t->max) {
            char a[40], b[40];
            cerr(c, hi, "max (%s) is below min (%s): the filter would drop every element", fmt_double(t->max, a, sizeof a),
                 fmt_double(t->min, b, sizeof b));
        }
    }
    if (op == LOOM_T_SHARD && t->index >= t->num_shards && config_setting_get_member(g, "num_shards"))
        cerr(c, config_setting_get_member(g, "index"), "index %lld is out of range: expected 0 <= index < num_shards (%lld)",
             (long long)t->index, (long long)t->num_shards);
}

/* normalize's mean or std: a number, or an array of numbers (one per index of
 * the feature's last axis); arrays go to mean_v/std_v, the other side repeated. */
static void parse_norm_values(ctx *c, const config_setting_t *s, void *base)
{
    loom_map_spec *m = base;
    bool is_std = !strcmp(config_setting_name(s), "std");
    double *scalar = is_std ? &m->std : &m->mean;
    char v[300];
    if (is_number(s)) {
        double d = get_number(s);
        if (!isfinite(d) || (is_std && !(d > 0))) {
            cerr(c, s, "expected a number%s, got %s", is_std ? " > 0.0" : "", value_str(s, v, sizeof v));
            return;
        }
        *scalar = d;
        return;
    }
    int n = (config_setting_is_array(s) || config_setting_is_list(s)) ? config_setting_length(s) : -1;
    if (n < 1 || n > LOOM_MAX_NORM) {
        cerr(c, s, "expected a number or an array of 1 to %d numbers, got %s", LOOM_MAX_NORM, value_str(s, v, sizeof v));
        return;
    }
    if (m->n_norm && m->n_norm != n) {
        cerr(c, s, "mean has %d values and std %d: give both the same length (one per index of the last axis), or "
             "one of them as a number", is_std ? m->n_norm : n, is_std ? n : m->n_norm);
        return;
    }
    float *dst = is_std ? m->std_v : m->mean_v, *other = is_std ? m->mean_v : m->std_v;
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = config_setting_get_elem(s, i);
        double d = is_number(e) ? get_number(e) : NAN;
        if (!isfinite(d) || (is_std && !(d > 0))) {
            cerr(c, e, "expected a number%s, got %s", is_std ? " > 0.0" : "", value_str(e, v, sizeof v));
            return;
        }
        dst[i] = (float)d;
        if (!m->n_norm) other[i] = (float)(is_std ? m->mean : m->std); /* the other side so far: a number or its default */
    }
    m->n_norm = n;
}

/* ---- groups -------------------------------------------------------------- */

/* The image maps' cross-field checks: decode_image's size or max_size, random_contrast's range. */
static void check_image_map(ctx *c, const config_setting_t *g, const loom_map_spec *m, int fn)
{
    const config_setting_t *size = config_setting_get_member(g, "size"), *max = config_setting_get_member(g, "max_size");
    if (fn == LOOM_MAP_DECODE_IMAGE) {
        if (!size && !max)
            cerr(c, g, "decode_image needs `size = [h, w]` (every image that size) or `max_size = [h, w]` (images up to "
                 "that size, for a resize after it)");
        else if (size && max)
            cerr(c, max, "decode_image takes `size` (every image that size) or `max_size` (up to that size), not both");
        const config_setting_t *dt = config_setting_get_member(g, "dtype");
        if (dt && m->dtype != LOOM_CFG_U8 && m->dtype != LOOM_CFG_F32)
            cerr(c, dt, "decode_image decodes to \"uint8\" or \"float32\" (values in [0, 1]), not \"%s\"",
                 loom_cfg_name_(loom_cfg_dtype_names_, (int)m->dtype));
    }
    if (fn == LOOM_MAP_RANDOM_CONTRAST && config_setting_get_member(g, "upper") && !(m->lower < m->upper)) {
        char a[40], b[40];
        cerr(c, config_setting_get_member(g, "upper"), "upper (%s) must be above lower (%s)", fmt_double(m->upper, a, sizeof a),
             fmt_double(m->lower, b, sizeof b));
    }
}

static void parse_map(ctx *c, const config_setting_t *g, loom_transform_spec *t, int op)
{
    int fn = -1;
    if (op == LOOM_T_MAP) {
        /* `lua = ...` or `plugin = ...` without `fn` is a custom map */
        const config_setting_t *lua = config_setting_get_member(g, "lua"), *plug = config_setting_get_member(g, "plugin");
        bool custom_only = !config_setting_get_member(g, "fn") && (lua || plug);
        fn = custom_only ? (int)(t->map.kind = LOOM_MAP_LUA) : parse_kind(c, g, map_opts, &t->map);
        if (fn == LOOM_MAP_NORMALIZE) t->map.mean = 0, t->map.std = 1; /* before mean/std, which may be arrays */
        parse_opts(c, g, map_opts, fn, &t->map);
        if (fn == LOOM_MAP_LUA && lua && plug)
            cerr(c, plug, "a map takes either `lua` or `plugin`, not both");
        else if (fn == LOOM_MAP_LUA && lua)
            resolve_lua_ref(c, lua, t->map.lua, sizeof t->map.lua);
        else if (fn == LOOM_MAP_LUA && !plug)
            cerr(c, g, "missing required setting `lua` (\"file.lua:function\") or `plugin` (\"provider:function\")");
        if (fn == LOOM_MAP_LUA && lua && config_setting_get_member(g, "args"))
            cerr(c, config_setting_get_member(g, "args"), "`args` go to a plugin's function; a Lua map takes none");
        if (fn == LOOM_MAP_NORMALIZE) {
            const config_setting_t *mn = config_setting_get_member(g, "mean"), *sd = config_setting_get_member(g, "std");
            if (t->map.adapt && (mn || sd))
                cerr(c, mn ? mn : sd, "adapt = true computes mean and std from data.train; remove `%s` or adapt",
                     mn ? "mean" : "std");
            for (int i = 0; i < t->map.n_norm; i++) { /* a number given beside an array applies to every index */
                if (mn && is_number(mn)) t->map.mean_v[i] = (float)t->map.mean;
                if (sd && is_number(sd)) t->map.std_v[i] = (float)t->map.std;
            }
        }
        check_image_map(c, g, &t->map, fn);
    }
    scope sc[2] = {{transform_opts, op, NULL}, {map_opts, fn, NULL}};
    if (op >= 0 && op != LOOM_T_MAP) sc[1].gate = "op = \"map\"";
    check_keys(c, g, sc, 2);
}

/* Defaults for the options of tbl (all of them when the group is absent). */
static void opts_default(const opt *tbl, void *base)
{
    for (const opt *o = tbl; o->name; o++) opt_default(o, base);
}

/* data.options (g may be NULL: every default) into *o. */
static void parse_data_options(ctx *c, const config_setting_t *g, loom_data_options *o)
{
    memset(o, 0, sizeof *o);
    o->present = true;
    o->ram_fraction = 0.5;
    opts_default(options_opts, o);
    opts_default(autotune_opts, o);
    opts_default(optimization_opts, o);
    if (!g) return;
    loc_of(c, g, &o->loc);
    parse_opts(c, g, options_opts, 0, o);
    scope sc = {options_opts, 0, NULL};
    check_keys(c, g, &sc, 1);
    static const struct { const char *key; const opt *tbl; } subs[] = {{"autotune", autotune_opts},
                                                                       {"optimization", optimization_opts}};
    for (size_t i = 0; i < sizeof subs / sizeof subs[0]; i++) {
        const config_setting_t *sg = sub_group(c, g, subs[i].key);
        if (!sg) continue;
        parse_opts(c, sg, subs[i].tbl, 0, o);
        scope ss = {subs[i].tbl, 0, NULL};
        check_keys(c, sg, &ss, 1);
    }
    const config_setting_t *og = config_setting_get_member(g, "optimization");
    const config_setting_t *mp = og && config_setting_is_group(og) ? config_setting_get_member(og, "map_parallelization") : NULL;
    if (o->map_parallelization && !o->autotune && mp)
        cerr(c, mp, "map_parallelization makes maps parallel = \"auto\", which needs autotune.enabled = true");
}

static void parse_dataset(ctx *c, const config_setting_t *g, loom_dataset_spec *d);

/* An interleave's source: a tfrecord, csv or text source whose files are the
 * interleave's input elements, so `files` is refused rather than required. */
static void parse_interleave_source(ctx *c, const config_setting_t *e, loom_transform_spec *t)
{
    const config_setting_t *g = sub_group(c, e, "source");
    if (!g) return;
    if (!(t->source = loom_calloc(1, sizeof *t->source))) {
        rawerr(c, LOOM_ENOMEM, "", "out of memory");
        return;
    }
    loc_of(c, g, &t->source->loc);
    int k = parse_kind(c, g, source_opts, t->source);
    if (k >= 0 && k != LOOM_SRC_TFRECORD && k != LOOM_SRC_CSV && k != LOOM_SRC_TEXT) {
        loom_err *er = cerr(c, config_setting_get_member(g, "type"),
                            "an interleave opens a tfrecord, csv or text source on each input file, not \"%s\"",
                            loom_cfg_name_(loom_source_names_, k));
        if (er) loom_err_hint(er, "write type = \"tfrecord\", \"csv\" or \"text\"");
        return;
    }
    const config_setting_t *files = config_setting_get_member(g, "files");
    if (files) {
        loom_err *er = cerr(c, files, "an interleave's source reads the files its input names; remove `files` here");
        if (er) loom_err_hint(er, "give the file patterns to a list_files source: source: { type = \"list_files\"; files = [...]; }");
    }
    c->skip_key = "files";
    parse_opts(c, g, source_opts, k, t->source);
    c->skip_key = NULL;
    if (t->source->shuffle_files)
        cerr(c, config_setting_get_member(g, "shuffle_files"),
             "an interleave's source reads one file at a time: shuffle the list_files source instead");
    scope ss = {source_opts, k, NULL};
    if (!files) check_keys(c, g, &ss, 1);
}

/* A zip's dataset: a whole dataset of its own, with the options of the one it is zipped into. */
static void parse_zip_dataset(ctx *c, const config_setting_t *e, loom_transform_spec *t, const loom_dataset_spec *d)
{
    const config_setting_t *g = sub_group(c, e, "dataset");
    if (!g) return;
    if (c->depth >= 4) {
        cerr(c, g, "datasets nested more than 4 deep by zip");
        return;
    }
    if (!(t->dataset = loom_calloc(1, sizeof *t->dataset))) {
        rawerr(c, LOOM_ENOMEM, "", "out of memory");
        return;
    }
    t->dataset->options = d->options;
    c->depth++;
    parse_dataset(c, g, t->dataset);
    c->depth--;
}

static void parse_dataset(ctx *c, const config_setting_t *g, loom_dataset_spec *d)
{
    d->present = true;
    loc_of(c, g, &d->loc);
    parse_opts(c, g, dataset_opts, 0, d);
    scope sc = {dataset_opts, 0, NULL};
    check_keys(c, g, &sc, 1);

    const config_setting_t *src = sub_group(c, g, "source");
    if (src) {
        loc_of(c, src, &d->source.loc);
        int k = plugin_source_type(c, config_setting_get_member(src, "type"), &d->source);
        if (k < 0) k = parse_kind(c, src, source_opts, &d->source);
        parse_opts(c, src, source_opts, k, &d->source);
        d->source.seed_set = k == LOOM_SRC_LIST_FILES && config_setting_get_member(src, "seed");
        if (k == LOOM_SRC_SYNTHETIC && !config_setting_get_member(src, "features") && !d->source.ctr.on) {
            loom_err *e = cerr(c, src, "missing required setting `features` (a synthetic source needs features, or ctr)");
            if (e) loom_err_hint(e, "e.g. features: { x = { dtype = \"float32\"; shape = [4]; }; }; or ctr = { columns = 26; };");
        }
        scope ss = {source_opts, k, NULL};
        check_keys(c, src, &ss, 1);
    }
    d->source.on_nonfinite = (int)d->on_nonfinite;
    const config_setting_t *tl = sub_list(c, g, "transforms");
    if (!tl) return;
    int n = config_setting_length(tl);
    if (n > LOOM_MAX_TRANSFORMS) {
        cerr(c, tl, "too many transforms: %d (at most %d)", n, LOOM_MAX_TRANSFORMS);
        n = LOOM_MAX_TRANSFORMS;
    }
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = config_setting_get_elem(tl, i);
        loom_transform_spec *t = &d->transform[d->n_transforms++];
        loc_of(c, e, &t->loc);
        if (!config_setting_is_group(e)) {
            char v[300];
            cerr(c, e, "expected a group { op = ...; }, got %s", value_str(e, v, sizeof v));
            continue;
        }
        int op = parse_kind(c, e, transform_opts, t);
        parse_opts(c, e, transform_opts, op, t);
        if (op == LOOM_T_SHUFFLE || op == LOOM_T_SPLIT) t->seed_set = config_setting_get_member(e, "seed") != NULL;
        if (op == LOOM_T_MAP && t->parallel == 0) t->parallel = 1; /* parallel's default (a custom option has none) */
        if (op == LOOM_T_MAP && !config_setting_get_member(e, "deterministic")) t->deterministic = d->options.deterministic;
        if (op == LOOM_T_PREFETCH && !config_setting_get_member(e, "buffer")) t->buffer = -1;
        if (op >= LOOM_T_FILTER) check_transform_more(c, e, t, op);
        if (op == LOOM_T_INTERLEAVE) {
            if (t->parallel == 0) t->parallel = 1;
            if (!config_setting_get_member(e, "deterministic")) t->deterministic = d->options.deterministic;
            parse_interleave_source(c, e, t);
        }
        if (op == LOOM_T_ZIP) parse_zip_dataset(c, e, t, d);
        parse_map(c, e, t, op);
    }
}

static void parse_layers(ctx *c, const config_setting_t *g, loom_model_spec *m)
{
    const config_setting_t *ll = sub_list(c, g, "layers");
    if (!ll) return;
    int n = config_setting_length(ll);
    if (n < 1) {
        cerr(c, ll, "expected at least one layer");
        return;
    }
    if (n > LOOM_MAX_LAYERS) {
        cerr(c, ll, "too many layers: %d (at most %d)", n, LOOM_MAX_LAYERS);
        n = LOOM_MAX_LAYERS;
    }
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = config_setting_get_elem(ll, i);
        loom_layer_spec *l = &m->layer[m->n_layers++];
        loc_of(c, e, &l->loc);
        if (!config_setting_is_group(e)) {
            char v[300];
            cerr(c, e, "expected a group { type = ...; }, got %s", value_str(e, v, sizeof v));
            continue;
        }
        int k = parse_kind(c, e, layer_opts, l);
        parse_opts(c, e, layer_opts, k, l);
        scope sc = {layer_opts, k, NULL};
        check_keys(c, e, &sc, 1);
        if ((k == LOOM_LAYER_MAX_POOL2D || k == LOOM_LAYER_AVG_POOL2D) && !config_setting_get_member(e, "strides"))
            l->stride[0] = l->pool[0], l->stride[1] = l->pool[1];
        if (!l->name[0] && k >= 0) snprintf(l->name, sizeof l->name, "%s_%d", loom_layer_names_[k], i);
    }
    for (int i = 0; i < m->n_layers; i++)
        for (int j = 0; j < i; j++)
            if (m->layer[i].name[0] && !strcmp(m->layer[i].name, m->layer[j].name)) {
                cerr(c, config_setting_get_elem(ll, i), "layer name \"%s\" is already used by %s",
                     m->layer[i].name, m->layer[j].loc.path);
                break;
            }
}

static void parse_schedule(ctx *c, const config_setting_t *og, loom_optimizer_spec *o)
{
    loom_schedule_spec *sch = &o->schedule;
    const config_setting_t *g = sub_group(c, og, "schedule");
    if (!g) {
        sch->kind = LOOM_SCHED_CONSTANT;
        sch->loc = o->loc;
        snprintf(sch->loc.path, sizeof sch->loc.path, "optimizer.schedule");
        return;
    }
    loc_of(c, g, &sch->loc);
    int k = parse_kind(c, g, schedule_opts, sch);
    parse_opts(c, g, schedule_opts, k, sch);
    scope sc = {schedule_opts, k, NULL};
    check_keys(c, g, &sc, 1);
    if (k == LOOM_SCHED_PIECEWISE_CONSTANT) {
        const config_setting_t *b = config_setting_get_member(g, "boundaries");
        const config_setting_t *v = config_setting_get_member(g, "values");
        if (b && v && (config_setting_is_array(b) || config_setting_is_list(b)) &&
            (config_setting_is_array(v) || config_setting_is_list(v)) &&
            config_setting_length(v) != config_setting_length(b) + 1)
            cerr(c, v, "expected %d values (one more than the %d boundaries), got %d", config_setting_length(b) + 1,
                 config_setting_length(b), config_setting_length(v));
    }
}

/* A source type that is neither built in nor a likely misspelling of one
 * (edit distance <= 2: parse_kind reports those with did-you-mean) names a
 * plugin's source: kept as text (kind LOOM_SRC_PLUGIN) and found in the
 * registry once plugins are loaded, where an unknown name is reported.
 * Returns the kind, or -1 for parse_kind to handle. */
static int plugin_source_type(ctx *c, const config_setting_t *t, loom_source_spec *src)
{
    if (!t || config_setting_type(t) != CONFIG_TYPE_STRING) return -1;
    const char *name = config_setting_get_string(t);
    for (int i = 0; loom_source_names_[i]; i++)
        if (loom_edit_distance(name, loom_source_names_[i]) <= 2) return -1;
    if (!name[0] || strlen(name) >= sizeof src->plugin)
        cerr(c, t, "bad source type \"%s\" (empty or longer than %zu characters)", name, sizeof src->plugin - 1);
    snprintf(src->plugin, sizeof src->plugin, "%s", name);
    src->kind = LOOM_SRC_PLUGIN;
    return LOOM_SRC_PLUGIN;
}

/* A group of scalars for a plugin's provider, each kept as text with its line. */
static void plugin_opts_group(ctx *c, const config_setting_t *s, loom_plugin_opts *o)
{
    char v[300];
    o->n = 0;
    if (!config_setting_is_group(s)) {
        cerr(c, s, "expected a group { KEY = value; ... }, got %s", value_str(s, v, sizeof v));
        return;
    }
    int n = config_setting_length(s);
    if (n > LOOM_MAX_PLUGIN_OPTS) {
        cerr(c, s, "too many options: %d (at most %d)", n, LOOM_MAX_PLUGIN_OPTS);
        return;
    }
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = config_setting_get_elem(s, i);
        const char *key = config_setting_name(e);
        if (config_setting_is_group(e)) {
            cerr(c, e, "expected a number, a string, true/false or an array of them, got %s", value_str(e, v, sizeof v));
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
                else value_str(x, one, sizeof one);
                if (ok && strchr(one, ',')) ok = false;
                if (ok) len += (size_t)snprintf(v + len, sizeof v - len, "%s%s", j ? "," : "", one);
                if (len >= sizeof v) len = sizeof v - 1;
            }
            if (!ok) {
                cerr(c, e, "an array argument holds numbers, true/false or strings without commas (it reaches the "
                           "plugin as its values joined by commas)");
                continue;
            }
        } else if (config_setting_type(e) == CONFIG_TYPE_STRING)
            snprintf(v, sizeof v, "%s", config_setting_get_string(e));
        else
            value_str(e, v, sizeof v);
        if (strlen(key) >= sizeof o->key[0] || strlen(v) >= sizeof o->value[0]) {
            cerr(c, e, "key or value too long (at most %zu and %zu characters)", sizeof o->key[0] - 1,
                 sizeof o->value[0] - 1);
            continue;
        }
        int k = o->n++;
        snprintf(o->key[k], sizeof o->key[k], "%s", key);
        snprintf(o->value[k], sizeof o->value[k], "%s", v);
        char where[300];
        where_of(c, e, where, sizeof where, &o->line[k]);
    }
}

static void parse_source_options(ctx *c, const config_setting_t *s, void *base)
{
    plugin_opts_group(c, s, &((loom_source_spec *)base)->options);
}

/* `plugin = "provider:function"` into m->provider and m->lua (the function). */
static void plugin_ref(ctx *c, const config_setting_t *s, loom_map_spec *m)
{
    const char *ref = config_setting_type(s) == CONFIG_TYPE_STRING ? config_setting_get_string(s) : NULL;
    const char *colon = ref ? strchr(ref, ':') : NULL;
    if (!colon || colon == ref || !colon[1] || colon - ref >= LOOM_NAME_MAX || strlen(colon + 1) >= LOOM_NAME_MAX) {
        char v[300];
        loom_err *e = cerr(c, s, "expected \"provider:function\", got %s", value_str(s, v, sizeof v));
        if (e) loom_err_hint(e, "e.g. plugin = \"image_ops:cutout\"; `loom plugins` lists the transform providers");
        return;
    }
    snprintf(m->provider, sizeof m->provider, "%.*s", (int)(colon - ref), ref);
    snprintf(m->lua, sizeof m->lua, "%s", colon + 1);
}

static void parse_map_plugin(ctx *c, const config_setting_t *s, void *base) { plugin_ref(c, s, base); }
static void parse_map_args(ctx *c, const config_setting_t *s, void *base)
{
    plugin_opts_group(c, s, &((loom_map_spec *)base)->args);
}
static void parse_filter_plugin(ctx *c, const config_setting_t *s, void *base)
{
    plugin_ref(c, s, &((loom_transform_spec *)base)->map);
}
static void parse_filter_args(ctx *c, const config_setting_t *s, void *base)
{
    plugin_opts_group(c, s, &((loom_transform_spec *)base)->map.args);
}

/* A strategy type that is not built in names a plugin's strategy: kept as
 * text (kind LOOM_STRAT_PLUGIN) and found in the registry once plugins are
 * loaded, where an unknown name is reported. Returns the kind, or -1 when t
 * is absent, not a string, or a built-in name (parse_kind handles those). */
static int plugin_strategy_type(ctx *c, const config_setting_t *t, loom_strategy_spec *st)
{
    if (!t || config_setting_type(t) != CONFIG_TYPE_STRING) return -1;
    const char *name = config_setting_get_string(t);
    if (find_name(loom_strategy_names_, name) >= 0) return -1;
    if (!name[0] || strlen(name) >= sizeof st->name)
        cerr(c, t, "bad strategy name \"%s\" (empty or longer than %zu characters)", name, sizeof st->name - 1);
    snprintf(st->name, sizeof st->name, "%s", name);
    st->kind = LOOM_STRAT_PLUGIN;
    return LOOM_STRAT_PLUGIN;
}

/* strategy.options: scalars only, each kept as text for the plugin. */
static void parse_strategy_options(ctx *c, const config_setting_t *s, void *base)
{
    loom_strategy_spec *st = base;
    char v[300];
    if (!config_setting_is_group(s)) {
        cerr(c, s, "expected a group { KEY = value; ... }, got %s", value_str(s, v, sizeof v));
        return;
    }
    int n = config_setting_length(s);
    if (n > LOOM_MAX_STRATEGY_OPTIONS) {
        cerr(c, s, "too many options: %d (at most %d)", n, LOOM_MAX_STRATEGY_OPTIONS);
        return;
    }
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = config_setting_get_elem(s, i);
        const char *key = config_setting_name(e);
        int type = config_setting_type(e);
        if (config_setting_is_aggregate(e)) {
            cerr(c, e, "expected a number, a string or true/false, got %s", value_str(e, v, sizeof v));
            continue;
        }
        if (type == CONFIG_TYPE_STRING)
            snprintf(v, sizeof v, "%s", config_setting_get_string(e));
        else
            value_str(e, v, sizeof v);
        if (strlen(key) >= LOOM_NAME_MAX || strlen(v) >= LOOM_NAME_MAX) {
            cerr(c, e, "key or value too long (at most %d characters each)", LOOM_NAME_MAX - 1);
            continue;
        }
        int k = st->n_options++;
        snprintf(st->option_key[k], sizeof st->option_key[k], "%s", key);
        snprintf(st->option_value[k], sizeof st->option_value[k], "%s", v);
        char where[300];
        where_of(c, e, where, sizeof where, &st->option_line[k]);
    }
}

/* Checks that s is one non-empty string or a list of at most max; returns
 * how many, or -1 after reporting the problem. */
static int string_list(ctx *c, const config_setting_t *s, int max, const char *what)
{
    char v[300];
    bool one = config_setting_type(s) == CONFIG_TYPE_STRING;
    if (!one && !config_setting_is_array(s) && !config_setting_is_list(s)) {
        cerr(c, s, "expected a list of %s [\"...\", ...], got %s", what, value_str(s, v, sizeof v));
        return -1;
    }
    int n = one ? 1 : config_setting_length(s);
    if (n > max) {
        cerr(c, s, "expected at most %d %s, got %d", max, what, n);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = one ? s : config_setting_get_elem(s, i);
        if (config_setting_type(e) != CONFIG_TYPE_STRING || !config_setting_get_string(e)[0]) {
            cerr(c, e, "expected a non-empty string, got %s", value_str(e, v, sizeof v));
            return -1;
        }
    }
    return n;
}

static void parse_plugin_path(ctx *c, const config_setting_t *s, void *base)
{
    loom_plugins_spec *p = base;
    int n = string_list(c, s, LOOM_MAX_PLUGIN_DIRS, "directories");
    bool one = config_setting_type(s) == CONFIG_TYPE_STRING;
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = one ? s : config_setting_get_elem(s, i);
        const char *dir = config_setting_get_string(e);
        char full[LOOM_PATH_MAX + 8];
        int w = dir[0] == '/' ? snprintf(full, sizeof full, "%s", dir) : snprintf(full, sizeof full, "%s/%s", c->dir, dir);
        struct stat st;
        if (w < 0 || w >= LOOM_PATH_MAX) {
            cerr(c, e, "directory name \"%s\" is too long", dir);
        } else if (stat(full, &st) != 0 || !S_ISDIR(st.st_mode)) {
            loom_err *er = cerr(c, e, "\"%s\" (resolved to %s) is not a directory", dir, full);
            if (er) loom_err_hint(er, "relative paths are relative to the config file's directory");
        } else {
            memcpy(p->path[p->n_path++], full, (size_t)w + 1);
        }
    }
}

static void parse_plugin_require(ctx *c, const config_setting_t *s, void *base)
{
    loom_plugins_spec *p = base;
    int n = string_list(c, s, LOOM_MAX_PLUGIN_REQUIRES, "plugin names");
    bool one = config_setting_type(s) == CONFIG_TYPE_STRING;
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = one ? s : config_setting_get_elem(s, i);
        const char *name = config_setting_get_string(e);
        if (strlen(name) >= LOOM_NAME_MAX) {
            cerr(c, e, "plugin name \"%s\" is too long (at most %d characters)", name, LOOM_NAME_MAX - 1);
            continue;
        }
        int k = p->n_require++;
        snprintf(p->require[k], sizeof p->require[k], "%s", name);
        char where[300];
        where_of(c, e, where, sizeof where, &p->require_line[k]);
    }
}

/* strategy.devices = ["cpu:0", "cpu:1"] or ["gpu:*"]: the syntax and
 * distinctness here; whether each exists is known only at strategy open. */
static void parse_strategy_devices(ctx *c, const config_setting_t *s, void *base)
{
    loom_strategy_spec *st = base;
    char v[300];
    loc_of(c, s, &st->devices_loc);
    if (!config_setting_is_array(s) && !config_setting_is_list(s)) {
        cerr(c, s, "expected a list of devices [\"cpu:0\", \"cpu:1\"], got %s", value_str(s, v, sizeof v));
        return;
    }
    int n = config_setting_length(s);
    if (n < 1 || n > LOOM_MAX_DEVICES) {
        cerr(c, s, "expected 1 to %d devices, got %d", LOOM_MAX_DEVICES, n);
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
            loom_err *er = cerr(c, e, "unknown device %s (expected \"cpu:N\", \"gpu:N\" or \"gpu:*\")",
                                value_str(e, v, sizeof v));
            if (er) loom_err_hint(er, "cpu:N is replica N on the host's cores, e.g. devices = [\"cpu:0\", \"cpu:1\"];");
            return;
        }
        for (int j = 0; j < i; j++)
            if (!strcmp(st->devices[j], d)) {
                cerr(c, e, "device \"%s\" is listed twice", d);
                return;
            }
        if (!strcmp(d, "gpu:*") && n > 1) {
            cerr(c, e, "\"gpu:*\" (every GPU) must be the only device");
            return;
        }
        cpus += d[0] == 'c';
        snprintf(st->devices[i], sizeof st->devices[i], "%s", d);
    }
    if (cpus && cpus < n) {
        cerr(c, s, "devices mix cpu and gpu; list devices of one kind");
        return;
    }
    st->n_devices = n;
    st->devices_listed = true;
}

/* ---- cluster --------------------------------------------------------------- */

int loom_addr_parse(const char *addr, char *host, size_t n, int *port, const char **why)
{
    const char *colon, *h = addr;
    size_t hl;
    if (addr[0] == '[') {
        const char *close = strchr(addr, ']');
        if (!close) return *why = "an IPv6 address needs its closing ']'", -1;
        h = addr + 1;
        hl = (size_t)(close - h);
        if (hl == 0) return *why = "empty IPv6 address in [...]", -1;
        for (size_t i = 0; i < hl; i++)
            if (!strchr("0123456789abcdefABCDEF:.", h[i]))
                return *why = "an IPv6 address in [...] has only hex digits, ':' and '.'", -1;
        if (close[1] != ':') return *why = "expected \"[address]:port\"", -1;
        colon = close + 1;
    } else {
        colon = strrchr(addr, ':');
        if (!colon) return *why = "missing \":port\" (expected \"host:port\")", -1;
        if (memchr(addr, ':', (size_t)(colon - addr)))
            return *why = "several ':' (write an IPv6 address as \"[addr]:port\")", -1;
        hl = (size_t)(colon - addr);
        if (hl == 0) return *why = "empty host (expected \"host:port\")", -1;
        if (hl > 253) return *why = "host name longer than 253 characters", -1;
        for (size_t i = 0; i < hl; i++) {
            char ch = addr[i];
            bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '-' ||
                      ch == '.' || ch == '_';
            if (!ok) return *why = "a host name has only letters, digits, '-', '_' and '.'", -1;
        }
        if (addr[0] == '-' || addr[0] == '.') return *why = "a host name cannot start with '-' or '.'", -1;
    }
    const char *p = colon + 1;
    long v = 0;
    if (!*p) return *why = "empty port (expected \"host:port\")", -1;
    for (; *p; p++) {
        if (*p < '0' || *p > '9') return *why = "the port is not a decimal number", -1;
        v = v * 10 + (*p - '0');
        if (v > 65535) break;
    }
    if (v < 1 || v > 65535) return *why = "the port must be in [1, 65535]", -1;
    if (hl >= n) return *why = "host name too long", -1;
    if (host) {
        memcpy(host, h, hl);
        host[hl] = 0;
    }
    if (port) *port = (int)v;
    return 0;
}

/* cluster.chief / worker / ps / evaluator: a list of "host:port" strings. */
static void parse_cluster_role(ctx *c, const config_setting_t *s, void *base)
{
    loom_cluster_spec *cl = base;
    int role = find_name(loom_cluster_role_keys, config_setting_name(s));
    LOOM_ASSERT(role >= 0);
    loc_of(c, s, &cl->role_loc[role]);
    int n = string_list(c, s, LOOM_MAX_CLUSTER_TASKS, "addresses \"host:port\"");
    bool one = config_setting_type(s) == CONFIG_TYPE_STRING;
    if (n > 1 && role == 0) {
        loom_err *e = cerr(c, s, "a cluster has at most one chief, got %d", n);
        if (e) loom_err_hint(e, "list the others under worker");
        return;
    }
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = one ? s : config_setting_get_elem(s, i);
        const char *a = config_setting_get_string(e), *why = NULL;
        if (strlen(a) >= LOOM_ADDR_MAX || loom_addr_parse(a, NULL, 256, NULL, &why)) {
            loom_err *er = cerr(c, e, "bad address \"%s\": %s", a, why ? why : "too long");
            if (er) loom_err_hint(er, "e.g. \"10.0.0.2:2222\", \"node01:2222\" or \"[::1]:2222\"");
            continue;
        }
        int k = cl->n_tasks[role]++;
        snprintf(cl->addr[role][k], sizeof cl->addr[role][k], "%s", a);
        char where[300];
        where_of(c, e, where, sizeof where, &cl->addr_line[role][k]);
    }
}

/* cluster.secret_file, tls_cert, tls_key, tls_ca: a file, relative to the
 * config's directory, that must exist and be readable. */
static void parse_cluster_path(ctx *c, const config_setting_t *s, void *base)
{
    loom_cluster_spec *cl = base;
    const char *key = config_setting_name(s);
    char *dst = !strcmp(key, "secret_file") ? cl->secret_file
                : !strcmp(key, "tls_cert")  ? cl->tls_cert
                : !strcmp(key, "tls_key")   ? cl->tls_key
                                            : cl->tls_ca;
    char v[300];
    if (config_setting_type(s) != CONFIG_TYPE_STRING || !config_setting_get_string(s)[0]) {
        cerr(c, s, "expected a file name, got %s", value_str(s, v, sizeof v));
        return;
    }
    const char *f = config_setting_get_string(s);
    int w = f[0] == '/' ? snprintf(dst, LOOM_PATH_MAX, "%s", f) : snprintf(dst, LOOM_PATH_MAX, "%s/%s", c->dir, f);
    if (w < 0 || w >= LOOM_PATH_MAX) {
        dst[0] = 0;
        cerr(c, s, "file name \"%s\" is too long", f);
    } else if (access(dst, R_OK) != 0) {
        loom_err *e = cerr(c, s, "cannot read \"%s\" (resolved to %s): %s", f, dst, strerror(errno));
        if (e) loom_err_hint(e, "relative paths are relative to the config file's directory");
    }
}

/* Two tasks on one address: compared as written, host names without case. */
static void check_cluster_duplicates(ctx *c, const config_setting_t *g, const loom_cluster_spec *cl)
{
    for (int r = 0; r < LOOM_CLUSTER_ROLES; r++)
        for (int i = 0; i < cl->n_tasks[r]; i++)
            for (int r2 = 0; r2 <= r; r2++)
                for (int j = 0; j < (r2 == r ? i : cl->n_tasks[r2]); j++) {
                    if (strcasecmp(cl->addr[r][i], cl->addr[r2][j])) continue;
                    const config_setting_t *lst = config_setting_get_member(g, loom_cluster_role_keys[r]);
                    const config_setting_t *e = lst && config_setting_type(lst) != CONFIG_TYPE_STRING
                                                    ? config_setting_get_elem(lst, (unsigned)i) : lst;
                    loom_err *er = cerr(c, e ? e : g, "duplicate address \"%s\": %s:%d has it too (line %d)",
                                        cl->addr[r][i], loom_cluster_role_keys[r2], j, cl->addr_line[r2][j]);
                    if (er) loom_err_hint(er, "every task listens on an address of its own");
                    goto next;
                }
next:;
}

static void parse_cluster(ctx *c, const config_setting_t *root, loom_cluster_spec *cl)
{
    const config_setting_t *g = sub_group(c, root, "cluster");
    opts_default(cluster_opts, cl);
    if (!g) {
        snprintf(cl->loc.file, sizeof cl->loc.file, "%s", c->path);
        snprintf(cl->loc.path, sizeof cl->loc.path, "cluster");
        return;
    }
    cl->present = true;
    loc_of(c, g, &cl->loc);
    for (int r = 0; r < LOOM_CLUSTER_ROLES; r++) cl->role_loc[r] = cl->loc;
    parse_opts(c, g, cluster_opts, 0, cl);
    scope sc = {cluster_opts, 0, NULL};
    check_keys(c, g, &sc, 1);
    check_cluster_duplicates(c, g, cl);
    if (cl->tls) {
        const char *need[] = {"tls_cert", "tls_key", "tls_ca"};
        for (int i = 0; i < 3; i++)
            if (!config_setting_get_member(g, need[i])) {
                loom_err *e = cerr(c, config_setting_get_member(g, "tls"), "tls = true needs %s", need[i]);
                if (e) loom_err_hint(e, "give tls_cert, tls_key and tls_ca (PEM files), or set tls = false");
            }
    }
    const config_setting_t *hi = config_setting_get_member(g, "heartbeat_interval");
    if (hi && cl->heartbeat_interval >= cl->heartbeat_timeout)
        cerr(c, hi, "heartbeat_interval (%g s) must be shorter than heartbeat_timeout (%g s)", cl->heartbeat_interval,
             cl->heartbeat_timeout);
}

/* mirrored, central_storage: replicas and devices agree (either may be
 * given; neither = one replica per core, resolved at strategy open). */
static void resolve_replicas(ctx *c, const config_setting_t *g, loom_strategy_spec *st)
{
    const config_setting_t *r = config_setting_get_member(g, "replicas");
    const config_setting_t *x = config_setting_get_member(g, "cross_device_ops");
    if (x)
        loc_of(c, x, &st->cross_device_ops_loc);
    else
        st->cross_device_ops_loc = st->loc;
    bool all_gpus = st->devices_listed && !strcmp(st->devices[0], "gpu:*");
    if (r && st->devices_listed && !all_gpus && st->replicas != st->n_devices) {
        cerr(c, r, "replicas = %d but %d devices are listed; give one of the two", st->replicas, st->n_devices);
        return;
    }
    if (st->devices_listed) {
        st->replicas = all_gpus ? 0 : st->n_devices;
    } else if (r) {
        loc_of(c, r, &st->devices_loc);
    } else {
        st->devices_loc = st->loc;
        st->replicas = 0;
    }
}

/* More replicas than the global batch would leave a replica without an
 * example in every step. */
static void check_replicas_batch(ctx *c, const config_setting_t *root, const loom_spec *spec)
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
            loom_err *e = cerr(c, r ? r : g, "%d replicas but the global batch (data.train, line %d) is %lld: each "
                               "replica needs at least one example", st->replicas, t->loc.line, (long long)t->batch_size);
            if (e)
                loom_err_hint(e, "the batch size is the global batch, split among the replicas; raise it to >= %d or "
                              "use fewer replicas", st->replicas);
        }
        return;
    }
}

/* strategy.variable_partitioner and strategy.sync (parameter_server). */
static void parse_ps_settings(ctx *c, const config_setting_t *g, loom_strategy_spec *st)
{
    loom_partitioner_spec *p = &st->partitioner;
    const config_setting_t *pg = config_setting_get_member(g, "variable_partitioner");
    if (pg && config_setting_is_group(pg)) {
        loc_of(c, pg, &p->loc);
        int k = parse_kind(c, pg, partitioner_opts, p);
        parse_opts(c, pg, partitioner_opts, k, p);
        scope sc = {partitioner_opts, k, NULL};
        check_keys(c, pg, &sc, 1);
        if (k == LOOM_PARTITIONER_MIN_SIZE && !config_setting_get_member(pg, "max_shards")) p->max_shards = 1;
    } else if (pg) {
        cerr(c, pg, "expected a group { type = \"fixed\"; num_shards = 2; }");
    }
    loom_ps_sync_spec *y = &st->sync;
    const config_setting_t *yg = config_setting_get_member(g, "sync");
    if (yg && config_setting_is_group(yg)) {
        y->enabled = true;
        loc_of(c, yg, &y->loc);
        parse_opts(c, yg, ps_sync_opts, 0, y);
        scope sc = {ps_sync_opts, 0, NULL};
        check_keys(c, yg, &sc, 1);
        if (y->total_replicas > 0 && y->replicas_to_aggregate > y->total_replicas) {
            loom_err *e = cerr(c, config_setting_get_member(yg, "replicas_to_aggregate"),
                               "replicas_to_aggregate = %d is more than total_replicas = %d: a step could never "
                               "gather that many gradients", y->replicas_to_aggregate, y->total_replicas);
            if (e) loom_err_hint(e, "aggregate at most total_replicas gradients; total_replicas - replicas_to_aggregate "
                                    "workers are backups");
        }
    } else if (yg) {
        cerr(c, yg, "expected a group { replicas_to_aggregate = 2; total_replicas = 3; }");
    }
}

static void parse_strategy(ctx *c, const config_setting_t *root, loom_strategy_spec *st)
{
    const config_setting_t *g = sub_group(c, root, "strategy");
    if (!g) {
        for (const opt *o = strategy_opts; o->name; o++)
            if (applies(o, (int)strategy_opts[0].idef)) opt_default(o, st);
        snprintf(st->loc.file, sizeof st->loc.file, "%s", c->path);
        snprintf(st->loc.path, sizeof st->loc.path, "strategy");
    } else {
        loc_of(c, g, &st->loc);
        const config_setting_t *t = config_setting_get_member(g, "type");
        int k = plugin_strategy_type(c, t, st);
        if (k < 0) k = parse_kind(c, g, strategy_opts, st);
        parse_opts(c, g, strategy_opts, k, st);
        scope sc = {strategy_opts, k, NULL};
        check_keys(c, g, &sc, 1);
        if (k == LOOM_STRAT_PARAMETER_SERVER) parse_ps_settings(c, g, st);
        const config_setting_t *np = config_setting_get_member(g, "num_packs");
        if (np && st->bytes_per_pack > 0 && (k == LOOM_STRAT_MIRRORED || k == LOOM_STRAT_MULTI_WORKER_MIRRORED)) {
            loom_err *e = cerr(c, np, "num_packs and bytes_per_pack both set; they are two ways to pack gradients");
            if (e) loom_err_hint(e, "keep one: bytes_per_pack (packs of at least N bytes) or num_packs (N packs)");
        }
        const config_setting_t *d = config_setting_get_member(g, "device");
        unsigned idx;
        char tail;
        if (d && k == LOOM_STRAT_ONE_DEVICE && st->device[0] &&
            sscanf(st->device, "cpu:%u%c", &idx, &tail) != 1 && sscanf(st->device, "gpu:%u%c", &idx, &tail) != 1)
            cerr(c, d, "unknown device \"%s\" (expected \"cpu:0\" or \"gpu:N\")", st->device);
        if (d) loc_of(c, d, &st->device_loc);
        else st->device_loc = st->loc;
        const config_setting_t *cm = config_setting_get_member(g, "communication");
        if (cm) loc_of(c, cm, &st->communication_loc);
        else st->communication_loc = st->loc;
        const config_setting_t *db = config_setting_get_member(g, "device_backend");
        if (db) loc_of(c, db, &st->device_backend_loc);
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
    if (x) loc_of(c, x, &st->cross_device_ops_loc); /* a plugin strategy's, for errors at strategy open */
    st->n_devices = 1;
    snprintf(st->devices[0], sizeof st->devices[0], "%s", st->device);
}

/* plugins = { path = [...]; require = [...]; }: the directories are checked
 * here, the names once plugins are loaded (plugin/plugin.c). */
static void parse_plugins(ctx *c, const config_setting_t *root, loom_plugins_spec *p)
{
    const config_setting_t *g = sub_group(c, root, "plugins");
    if (!g) {
        snprintf(p->loc.file, sizeof p->loc.file, "%s", c->path);
        snprintf(p->loc.path, sizeof p->loc.path, "plugins");
        return;
    }
    loc_of(c, g, &p->loc);
    parse_opts(c, g, plugins_opts, 0, p);
    scope sc = {plugins_opts, 0, NULL};
    check_keys(c, g, &sc, 1);
}

/* ---- hooks ----------------------------------------------------------------- */

static void parse_hook_callbacks(ctx *c, const config_setting_t *s, void *base);
static void parse_hook_train_step(ctx *c, const config_setting_t *s, void *base);

static const opt hooks_opts[] = {
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
static bool hook_ref_string(ctx *c, const config_setting_t *s, loom_hook_ref *h)
{
    char v[300];
    if (config_setting_type(s) != CONFIG_TYPE_STRING) {
        cerr(c, s, "expected \"file.lua:function\", got %s", value_str(s, v, sizeof v));
        return false;
    }
    const char *ref = config_setting_get_string(s);
    const char *colon = strrchr(ref, ':');
    if (!colon || colon == ref || !colon[1] || strlen(ref) >= sizeof h->ref) {
        loom_err *e = cerr(c, s, "expected \"file.lua:function\", got \"%s\"", ref);
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
        loom_err *e = cerr(c, s, "cannot read the Lua file \"%.*s\" (resolved to %s)", n, ref, full);
        if (e) loom_err_hint(e, "the file is relative to the config file's directory");
        return false;
    }
    snprintf(h->ref, sizeof h->ref, "%s", ref);
    loc_of(c, s, &h->loc);
    return true;
}

/* A map's or filter's `lua`: checked as a hook's reference, then stored with
 * the file resolved against the config's directory ("/abs/lua/augment.lua:cutout"),
 * so the data module needs no directory. */
static void resolve_lua_ref(ctx *c, const config_setting_t *s, char *out, size_t n)
{
    loom_hook_ref h;
    if (!hook_ref_string(c, s, &h)) return;
    const char *colon = strrchr(h.ref, ':');
    int len = (int)(colon - h.ref);
    int w = h.ref[0] == '/' ? snprintf(out, n, "%s", h.ref) : snprintf(out, n, "%s/%.*s%s", c->dir, len, h.ref, colon);
    if (w < 0 || (size_t)w >= n) cerr(c, s, "the Lua file's path is too long (at most %zu characters)", n - 1);
}

/* A hook: "file.lua:function", or { fn = "file.lua:function"; args = { name = value; ... }; }. */
static bool parse_hook_ref(ctx *c, const config_setting_t *s, loom_hook_ref *h)
{
    memset(h, 0, sizeof *h);
    if (!config_setting_is_group(s)) return hook_ref_string(c, s, h);
    static const char *const keys[] = {"fn", "args", NULL};
    int len = config_setting_length(s);
    for (int i = 0; i < len; i++) {
        const config_setting_t *k = config_setting_get_elem(s, i);
        if (find_name(keys, config_setting_name(k)) >= 0) continue;
        const char *near = closest(keys, config_setting_name(k));
        if (near) cerr(c, k, "unknown setting `%s` (did you mean `%s`?)", config_setting_name(k), near);
        else cerr(c, k, "unknown setting `%s` (valid here: fn, args)", config_setting_name(k));
    }
    const config_setting_t *fn = config_setting_get_member(s, "fn");
    if (!fn) {
        cerr(c, s, "missing required setting `fn` (\"file.lua:function\")");
        return false;
    }
    bool ok = hook_ref_string(c, fn, h);
    const config_setting_t *a = config_setting_get_member(s, "args");
    if (!a) return ok;
    char v[300];
    if (!config_setting_is_group(a)) {
        cerr(c, a, "expected a group { name = value; ... }, got %s", value_str(a, v, sizeof v));
        return false;
    }
    int na = config_setting_length(a);
    if (na > LOOM_MAX_HOOK_ARGS) {
        cerr(c, a, "expected at most %d arguments, got %d", LOOM_MAX_HOOK_ARGS, na);
        return false;
    }
    for (int i = 0; i < na; i++) {
        const config_setting_t *e = config_setting_get_elem(a, i);
        int k = h->n_args;
        snprintf(h->arg_name[k], sizeof h->arg_name[k], "%s", config_setting_name(e));
        if (is_number(e)) {
            h->arg_type[k] = is_int(e) ? LOOM_HOOK_ARG_INT : LOOM_HOOK_ARG_NUMBER;
            h->arg_num[k] = get_number(e);
        } else if (config_setting_type(e) == CONFIG_TYPE_BOOL) {
            h->arg_type[k] = LOOM_HOOK_ARG_BOOL;
            h->arg_num[k] = config_setting_get_bool(e);
        } else if (config_setting_type(e) == CONFIG_TYPE_STRING &&
                   strlen(config_setting_get_string(e)) < sizeof h->arg_str[k]) {
            h->arg_type[k] = LOOM_HOOK_ARG_STRING;
            snprintf(h->arg_str[k], sizeof h->arg_str[k], "%s", config_setting_get_string(e));
        } else {
            cerr(c, e, "expected a number, a string (at most %d characters) or a boolean, got %s", LOOM_NAME_MAX - 1,
                 value_str(e, v, sizeof v));
            ok = false;
            continue;
        }
        h->n_args++;
    }
    return ok;
}

static void parse_hook_callbacks(ctx *c, const config_setting_t *s, void *base)
{
    loom_hooks_spec *h = base;
    char v[300];
    if (!config_setting_is_array(s) && !config_setting_is_list(s)) {
        cerr(c, s, "expected a list [\"file.lua:function\", ...] or ( { fn = ...; args = { ... }; }, ... ), got %s",
             value_str(s, v, sizeof v));
        return;
    }
    int n = config_setting_length(s);
    if (n > LOOM_MAX_CALLBACKS) {
        cerr(c, s, "expected at most %d callbacks, got %d", LOOM_MAX_CALLBACKS, n);
        return;
    }
    for (int i = 0; i < n; i++)
        if (parse_hook_ref(c, config_setting_get_elem(s, i), &h->callback[h->n_callbacks])) h->n_callbacks++;
}

static void parse_hook_train_step(ctx *c, const config_setting_t *s, void *base)
{
    loom_hooks_spec *h = base;
    h->has_train_step = parse_hook_ref(c, s, &h->train_step);
}

/* hooks = { callbacks = [...]; train_step = "..."; step_interval = N; ... }; */
static void parse_hooks(ctx *c, const config_setting_t *root, loom_hooks_spec *h)
{
    const config_setting_t *g = sub_group(c, root, "hooks");
    for (const opt *o = hooks_opts; o->name; o++) opt_default(o, h);
    if (!g) return;
    h->present = true;
    loc_of(c, g, &h->loc);
    parse_opts(c, g, hooks_opts, 0, h);
    scope sc = {hooks_opts, 0, NULL};
    check_keys(c, g, &sc, 1);
}

/* Shuffles and list_files sources without a seed of their own, also in zipped datasets, take the run's. */
static void default_seeds(loom_dataset_spec *d, uint64_t seed)
{
    if (d->source.kind == LOOM_SRC_LIST_FILES && !d->source.seed_set) d->source.seed = seed;
    for (int j = 0; j < d->n_transforms; j++) {
        loom_transform_spec *t = &d->transform[j];
        if ((t->kind == LOOM_T_SHUFFLE || t->kind == LOOM_T_SPLIT) && !t->seed_set) t->seed = seed;
        if (t->kind == LOOM_T_ZIP && t->dataset) default_seeds(t->dataset, seed);
    }
}

static void validate(ctx *c, const config_setting_t *root, loom_spec *spec)
{
    parse_opts(c, root, root_opts, 0, spec);
    scope sr = {root_opts, 0, NULL};
    check_keys(c, root, &sr, 1);

    const config_setting_t *g;
    if ((g = sub_group(c, root, "data"))) {
        parse_opts(c, g, data_opts, 0, NULL);
        scope sc = {data_opts, 0, NULL};
        check_keys(c, g, &sc, 1);
        const config_setting_t *d;
        parse_data_options(c, sub_group(c, g, "options"), &spec->train.options);
        spec->eval.options = spec->train.options;
        if ((d = sub_group(c, g, "train"))) parse_dataset(c, d, &spec->train);
        if ((d = sub_group(c, g, "eval"))) parse_dataset(c, d, &spec->eval);
    }
    if ((g = sub_group(c, root, "model"))) {
        loom_model_spec *m = &spec->model;
        loc_of(c, g, &m->loc);
        m->metrics_loc = m->loc;
        parse_opts(c, g, model_opts, 0, m);
        scope sc = {model_opts, 0, NULL};
        check_keys(c, g, &sc, 1);
        parse_layers(c, g, m);
    }
    if ((g = sub_group(c, root, "optimizer"))) {
        loom_optimizer_spec *o = &spec->optimizer;
        loc_of(c, g, &o->loc);
        int k = parse_kind(c, g, optimizer_opts, o);
        parse_opts(c, g, optimizer_opts, k, o);
        scope sc = {optimizer_opts, k, NULL};
        check_keys(c, g, &sc, 1);
        parse_schedule(c, g, o);
    }
    parse_strategy(c, root, &spec->strategy);
    check_replicas_batch(c, root, spec);
    parse_plugins(c, root, &spec->plugins);
    parse_hooks(c, root, &spec->hooks);
    parse_cluster(c, root, &spec->cluster);
    if ((g = sub_group(c, root, "run"))) {
        loom_run_spec *r = &spec->run;
        loc_of(c, g, &r->loc);
        parse_opts(c, g, run_opts, 0, r);
        scope sc = {run_opts, 0, NULL};
        check_keys(c, g, &sc, 1);
        if (!config_setting_get_member(g, "eval_each_epoch")) r->eval_each_epoch = spec->eval.present;
        if (r->epochs < 1 && r->max_steps < 1)
            cerr(c, g, "nothing to train: set epochs >= 1 or max_steps >= 1 (epochs = %lld, max_steps = %lld)",
                 (long long)r->epochs, (long long)r->max_steps);
        unsigned char ab[16];
        const config_setting_t *sb = config_setting_get_member(g, "status_bind");
        if (sb && inet_pton(AF_INET, r->status_bind, ab) != 1 && inet_pton(AF_INET6, r->status_bind, ab) != 1)
            cerr(c, sb, "run.status_bind: \"%s\" is not an IPv4 or IPv6 address (a literal, not a host name)",
                 r->status_bind);
        /* shuffles without a seed of their own use the run's */
        default_seeds(&spec->train, r->seed);
        default_seeds(&spec->eval, r->seed);
    }
}

/* ---- overrides ----------------------------------------------------------- */

/* Copies src's value (recursively for groups, lists and arrays) into dst of the same type. */
static bool copy_value(config_setting_t *dst, const config_setting_t *src)
{
    switch (config_setting_type(src)) {
    case CONFIG_TYPE_INT: return config_setting_set_int(dst, config_setting_get_int(src)) == CONFIG_TRUE;
    case CONFIG_TYPE_INT64: return config_setting_set_int64(dst, config_setting_get_int64(src)) == CONFIG_TRUE;
    case CONFIG_TYPE_FLOAT: return config_setting_set_float(dst, config_setting_get_float(src)) == CONFIG_TRUE;
    case CONFIG_TYPE_STRING: return config_setting_set_string(dst, config_setting_get_string(src)) == CONFIG_TRUE;
    case CONFIG_TYPE_BOOL: return config_setting_set_bool(dst, config_setting_get_bool(src)) == CONFIG_TRUE;
    default: break;
    }
    int n = config_setting_length(src);
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = config_setting_get_elem(src, i);
        config_setting_t *d = config_setting_add(dst, config_setting_is_group(src) ? config_setting_name(e) : NULL,
                                                 config_setting_type(e));
        if (!d || !copy_value(d, e)) return false;
    }
    return true;
}

/* Splits "a.b.[2].c" (also "b[2]") into components; an index is stored as "[2]". */
static int split_key(const char *key, char comp[][LOOM_NAME_MAX], int max)
{
    int n = 0;
    const char *p = key;
    while (*p) {
        const char *end = p;
        if (*p == '[') {
            end = strchr(p, ']');
            if (!end) return -1;
            end++;
        } else {
            while (*end && *end != '.' && *end != '[') end++;
        }
        size_t len = (size_t)(end - p);
        if (len == 0 || len >= LOOM_NAME_MAX || n == max) return -1;
        memcpy(comp[n], p, len);
        comp[n][len] = 0;
        n++;
        p = end;
        if (*p == '.') {
            p++;
            if (!*p) return -1;
        }
    }
    return n;
}

static bool parse_index(const char *comp, int *out)
{
    char *end;
    if (comp[0] != '[') return false;
    long v = strtol(comp + 1, &end, 10);
    if (end == comp + 1 || *end != ']' || end[1] || v < 0 || v > INT_MAX) return false;
    *out = (int)v;
    return true;
}

/* Applies one "a.b.c=value" to the tree; key is kept (as the setting's hook)
 * so that errors about the setting say "--set a.b.c". */
static void apply_override(ctx *c, config_t *cfg, const char *text, char *key)
{
    char where[300];
    const char *eq = strchr(text, '=');
    snprintf(where, sizeof where, "--set %s", key);
    if (!eq || eq == text) {
        loom_err *e = rawerr(c, LOOM_ECONFIG, where, "expected key=value, got \"%s\"", text);
        if (e) loom_err_hint(e, "e.g. --set run.epochs=2");
        return;
    }
    char comp[16][LOOM_NAME_MAX];
    int n = split_key(key, comp, 16);
    if (n <= 0) {
        rawerr(c, LOOM_ECONFIG, where, "bad setting path \"%s\" (expected a.b.c or a.list.[2].c)", key);
        return;
    }
    /* the value, in libconfig syntax, else a bare string */
    const char *val = eq + 1;
    config_t vc;
    config_init(&vc);
    size_t vl = strlen(val);
    char *buf = loom_alloc(vl + 16);
    if (!buf) {
        config_destroy(&vc);
        rawerr(c, LOOM_ENOMEM, where, "out of memory");
        return;
    }
    snprintf(buf, vl + 16, "x = %s;", val);
    const config_setting_t *v = NULL;
    int_lits lits = {0};
    if (config_read_string(&vc, buf) == CONFIG_TRUE) {
        v = config_lookup(&vc, "x");
        if (config_setting_length(config_root_setting(&vc)) > 1) {
            /* "run.epochs=3; version=2" reads as two settings: the second would be lost */
            const config_setting_t *extra = config_setting_get_elem(config_root_setting(&vc), 1);
            const char *en = extra && config_setting_name(extra) ? config_setting_name(extra) : "?";
            loom_err *e = rawerr(c, LOOM_ECONFIG, where,
                                 "one assignment per --set: the value is followed by another setting, `%s`", en);
            if (e) loom_err_hint(e, "give each setting its own --set: --set %s=... --set %s=...", key, en);
            loom_free(buf);
            config_destroy(&vc);
            return;
        }
        lex_text(buf, NULL, &lits, 0);
    }
    loom_free(buf);
    if (!v) {
        config_destroy(&vc);
        config_init(&vc);
        config_setting_t *sv = config_setting_add(config_root_setting(&vc), "x", CONFIG_TYPE_STRING);
        if (sv) config_setting_set_string(sv, val);
        v = sv;
    }
    if (!v) {
        rawerr(c, LOOM_ENOMEM, where, "out of memory");
        config_destroy(&vc);
        return;
    }

    config_setting_t *cur = config_root_setting(cfg);
    for (int i = 0; i < n; i++) {
        bool last = i == n - 1;
        int idx;
        if (parse_index(comp[i], &idx)) {
            if (!config_setting_is_list(cur) && !config_setting_is_array(cur)) {
                rawerr(c, LOOM_ECONFIG, where, "%s: not a list, so it has no element %s",
                       i ? comp[i - 1] : "(top level)", comp[i]);
                break;
            }
            int len = config_setting_length(cur);
            config_setting_t *e = config_setting_get_elem(cur, (unsigned)idx);
            if (!e && !(last && idx == len)) {
                rawerr(c, LOOM_ECONFIG, where, "index %s is out of range (the list has %d elements)", comp[i], len);
                break;
            }
            if (!last) {
                cur = e;
                continue;
            }
            if (!e) { /* append */
                e = config_setting_add(cur, NULL, config_setting_type(v));
                if (!e || !copy_value(e, v)) {
                    rawerr(c, LOOM_ECONFIG, where, "cannot append this value to %s", comp[i - 1]);
                    break;
                }
            } else if (config_setting_type(e) == config_setting_type(v) ||
                       (config_setting_type(e) == CONFIG_TYPE_FLOAT && is_int(v))) {
                forget_huge(c, e);
                while (config_setting_is_aggregate(e) && config_setting_length(e) > 0)
                    config_setting_remove_elem(e, 0);
                bool ok = config_setting_type(e) == CONFIG_TYPE_FLOAT && is_int(v)
                              ? config_setting_set_float(e, (double)config_setting_get_int64(v)) == CONFIG_TRUE
                              : copy_value(e, v);
                if (!ok) {
                    rawerr(c, LOOM_ECONFIG, where, "cannot set element %s to this value", comp[i]);
                    break;
                }
            } else {
                char a[300];
                rawerr(c, LOOM_ECONFIG, where, "cannot replace element %s (%s) with a value of another type: %s",
                       comp[i], value_str(e, a, sizeof a), val);
                break;
            }
            fix_wide_ints(c, e, &lits);
            config_setting_set_hook(e, key);
            break;
        }
        if (!config_setting_is_group(cur)) {
            rawerr(c, LOOM_ECONFIG, where, "%s is not a group, so it has no setting `%s`",
                   i ? comp[i - 1] : "(top level)", comp[i]);
            break;
        }
        config_setting_t *s = config_setting_get_member(cur, comp[i]);
        if (!last) {
            if (!s) {
                s = config_setting_add(cur, comp[i], CONFIG_TYPE_GROUP);
                if (!s) {
                    rawerr(c, LOOM_ECONFIG, where, "bad setting name `%s`", comp[i]);
                    break;
                }
                config_setting_set_hook(s, key);
            }
            cur = s;
            continue;
        }
        if (s) {
            forget_huge(c, s);
            config_setting_remove(cur, comp[i]);
        }
        s = config_setting_add(cur, comp[i], config_setting_type(v));
        if (!s) {
            rawerr(c, LOOM_ECONFIG, where, "bad setting name `%s`", comp[i]);
            break;
        }
        if (!copy_value(s, v)) {
            rawerr(c, LOOM_ECONFIG, where, "cannot set this value: %s", val);
            break;
        }
        fix_wide_ints(c, s, &lits);
        config_setting_set_hook(s, key);
    }
    loom_free(lits.v);
    config_destroy(&vc);
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
static int check_files(ctx *c, const char *path, const char *from, int depth)
{
    loom_err e = {0};
    uint8_t *text;
    size_t len;
    if (loom_read_file_max(path, &text, &len, (uint64_t)64 << 20, &e)) {
        if (e.code == LOOM_ENOMEM) {
            rawerr(c, LOOM_ENOMEM, path, "%s", e.msg);
            return LOOM_ENOMEM;
        }
        const char *why = strncmp(e.msg, "cannot open: ", 13) ? e.msg : e.msg + 13;
        loom_err *o = rawerr(c, LOOM_EIO, from ? from : path, from ? "@include \"%s\": %s" : "cannot read the config file: %s%s",
                             from ? path : why, from ? why : "");
        if (o && e.hint[0]) loom_err_hint(o, "%s", e.hint);
        return LOOM_EIO;
    }
    int rc = 0, line = 1;
    const uint8_t *nul = memchr(text, 0, len);
    if (nul) { /* libconfig's flex scanner exits the process on a NUL byte */
        for (const uint8_t *q = text; q < nul; q++) line += *q == '\n';
        char where[LOOM_PATH_MAX + 16];
        snprintf(where, sizeof where, "%s:%d", path, line);
        loom_err *o = rawerr(c, LOOM_ECONFIG, where, "a NUL byte (byte %zu): a config file is text", (size_t)(nul - text) + 1);
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
                loom_err *o = rawerr(c, LOOM_ECONFIG, where, "@include: the file name's closing quote is missing");
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
    ctx c = {.path = path, .errs = errs};

    if (strlen(path) >= LOOM_PATH_MAX) {
        rawerr(&c, LOOM_ECONFIG, path, "config path is too long");
        return LOOM_ECONFIG;
    }
    config_dir(path, c.dir, sizeof c.dir);
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
            rawerr(&c, LOOM_EIO, ef ? ef : path, "cannot read the config file");
            config_destroy(&cfg);
            return LOOM_EIO;
        }
        snprintf(where, sizeof where, "%s:%d", ef ? ef : path, config_error_line(&cfg));
        rawerr(&c, LOOM_ECONFIG, where, "syntax error: %s",
               config_error_text(&cfg) ? config_error_text(&cfg) : "unparsable");
        config_destroy(&cfg);
        return LOOM_ECONFIG;
    }

    {
        int_lits lits = {0};
        lex_file(path, c.dir, &lits, 0);
        fix_wide_ints(&c, config_root_setting(&cfg), &lits);
    }

    /* the keys of the overrides, kept as hooks on the settings they set */
    char **keys = n_overrides > 0 ? loom_calloc((size_t)n_overrides, sizeof *keys) : NULL;
    if (n_overrides > 0 && !keys) {
        config_destroy(&cfg);
        rawerr(&c, LOOM_ENOMEM, "", "out of memory");
        return LOOM_ENOMEM;
    }
    for (int i = 0; i < n_overrides; i++) {
        const char *eq = strchr(overrides[i], '=');
        size_t kl = eq ? (size_t)(eq - overrides[i]) : strlen(overrides[i]);
        keys[i] = loom_alloc(kl + 1);
        if (!keys[i]) {
            rawerr(&c, LOOM_ENOMEM, "", "out of memory");
            break;
        }
        memcpy(keys[i], overrides[i], kl);
        keys[i][kl] = 0;
        apply_override(&c, &cfg, overrides[i], keys[i]);
    }

    loom_spec *spec = loom_calloc(1, sizeof *spec);
    if (!spec) rawerr(&c, LOOM_ENOMEM, "", "out of memory");
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

/* What zip and interleave transforms hold outside the spec's own allocation. */
static void free_nested(loom_dataset_spec *d)
{
    for (int i = 0; i < d->n_transforms; i++) {
        loom_transform_spec *t = &d->transform[i];
        loom_free(t->source);
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
