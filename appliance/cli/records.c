/* records.c - `loom records convert|count|verify|head`: the command line of
 * the conversion of IDX or CSV data into sharded TFRecord files of
 * tf.train.Examples (data/format/convert.c does it), and counts, verifies and
 * shows TFRecord files (compression detected from each file's leading bytes).
 * Part of the cli module, so it prints: results on stdout, errors on stderr
 * ("loom: where: what"), and returns the exit status: 0 ok, 1 runtime failure
 * (a missing, unreadable or damaged input file, a failed write), 2 usage. */
#include "cli.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define MAX_SHARDS LOOM_MAX_SHARDS
#define HEAD_VALUES 8    /* values shown per feature by `head` */
#define HEAD_HEX 16      /* leading bytes shown of a binary string */
#define HEAD_TEXT 48     /* leading characters shown of a printable string */

/* ---- options and subcommands --------------------------------------------- */

enum { R_IMAGES = 1, R_LABELS = 2, R_CSV = 4, R_LABEL_COLUMN = 8, R_OUTPUT = 16, R_SHARDS = 32, R_COMPRESSION = 64,
       R_N = 128, R_CONFIG = 256, R_COUNT = 512 };

typedef struct rec_opts {
    const char      *images, *labels, *csv, *label_column, *output, *config;
    long             count;   /* convert --config: elements written; 0 = the source's all */
    long             shards;  /* convert: 1..MAX_SHARDS */
    loom_compression comp;    /* convert: NONE, GZIP, ZLIB or ZSTD */
    long             n;       /* head: records shown per file */
    char           **files;   /* positional FILE arguments (count, verify, head) */
    int              n_files;
    double           start;
} rec_opts;

typedef struct subcommand {
    const char *name, *summary, *usage, *help;
    unsigned    accepts;   /* R_* bits */
    bool        takes_files;
    int (*run)(const rec_opts *o); /* returns the exit status */
} subcommand;

static int run_convert(const rec_opts *o);
static int run_count(const rec_opts *o);
static int run_verify(const rec_opts *o);
static int run_head(const rec_opts *o);

static const subcommand subcommands[] = {
    {"convert", "write IDX or CSV data as sharded TFRecord files of tf.train.Examples",
     "loom records convert (--images IDX --labels IDX | --csv FILE [--label-column NAME] |\n"
     "                      --config CFG [--count N])\n"
     "                     --output PREFIX [--shards N] [--compression none|gzip|zlib|zstd]",
     "Writes N files PREFIX-00000-of-0000N.tfrecord (TensorFlow's shard naming), with the\n"
     "suffix .gz, .zz or .zst when compressed, one tf.train.Example per item or row.\n"
     "Sharding is contiguous: shard i holds items [i*total/N, (i+1)*total/N), so reading\n"
     "the shards in order gives the input order.\n"
     "\n"
     "From IDX (plain or gzip): `image` is a bytes_list holding the item's raw bytes\n"
     "(uint8 files byte for byte; other types as little-endian values of the loaded\n"
     "dtype, int8/int16 widened to int32, as tf.io.decode_raw reads them) and `label`\n"
     "an int64_list of the item's label value(s).\n"
     "\n"
     "From CSV (plain or gzip; a header row is required): one feature per column, named\n"
     "after it and typed from all rows: int64_list when every non-empty value is an\n"
     "integer, float_list when every non-empty value is a number, else bytes_list. An\n"
     "empty field of a numeric column gives an empty list. Fields follow RFC 4180:\n"
     "quoted fields may hold commas, line breaks and doubled quotes (\"\"). Blank lines\n"
     "are skipped. --label-column NAME stores that column, which must be numeric and\n"
     "never empty, as the feature `label`.\n"
     "\n"
     "From a config (--config CFG): the elements of data.train's source, in order, its\n"
     "transforms not applied (a synthetic source draws from run.seed): integer features\n"
     "as int64_list, float features as float_list, uint8 features of rank >= 1 as one\n"
     "bytes value. --count N writes the first N (needed for an infinite source).\n"
     "\n"
     "Each shard is written to PATH.tmp and renamed when complete; when a shard fails,\n"
     "the shards this run already wrote are removed; PREFIX's directory is created\n"
     "when missing. zstd is a Loom extension that stock TensorFlow cannot read; gzip\n"
     "and zlib are its GZIP and ZLIB.\n",
     R_IMAGES | R_LABELS | R_CSV | R_LABEL_COLUMN | R_OUTPUT | R_SHARDS | R_COMPRESSION | R_CONFIG | R_COUNT, false,
     run_convert},
    {"count", "count the records of TFRecord files", "loom records count FILE...",
     "Prints the number of records of each file (and its compression, detected from the\n"
     "leading bytes) and the total. Every CRC is checked on the way: a damaged or\n"
     "unreadable file is reported, the others are still counted, and the exit status is 1.\n",
     0, true, run_count},
    {"verify", "check every CRC of TFRecord files", "loom records verify FILE...",
     "Reads every record of each file, checking the length and payload CRCs and the\n"
     "integrity of the compressed stream, and prints one line per file. Exit status 0\n"
     "when all files are sound; otherwise 1, with each bad file named together with the\n"
     "byte offset of its first bad record (offsets count bytes of the uncompressed\n"
     "stream). Checking goes on with the next file after a bad one.\n",
     0, true, run_verify},
    {"head", "show the first records of TFRecord files as tf.train.Examples", "loom records head FILE... [-n N]",
     "Decodes the first N records (default 3) of each file as tf.train.Examples and prints\n"
     "each feature (sorted by name) with its kind, its number of values and the first\n"
     "values; a bytes_list string shows as text when printable, else as its length and\n"
     "its first bytes in hex. A record that is not an Example is shown as bytes.\n",
     R_N, true, run_head},
};
#define N_SUB (int)(sizeof subcommands / sizeof subcommands[0])

static const char exit_text[] =
    "\nexit status: 0 success, 1 runtime failure (a missing, unreadable or damaged input\n"
    "file, a failed write), 2 usage\n";

static void records_usage(FILE *f)
{
    fprintf(f, "usage: loom records SUBCOMMAND [options] [FILE...]\n\nsubcommands:\n");
    for (int i = 0; i < N_SUB; i++) fprintf(f, "  %-8s %s\n", subcommands[i].name, subcommands[i].summary);
    fprintf(f, "\nloom records SUBCOMMAND --help for a subcommand's options%s", exit_text);
}

static void sub_help(const subcommand *sc)
{
    printf("usage: %s\n\nrecords %s: %s.\n\n%s\noptions:\n", sc->usage, sc->name, sc->summary, sc->help);
    if (sc->accepts & R_IMAGES) printf("  --images IDX          images (one item per record)\n");
    if (sc->accepts & R_LABELS) printf("  --labels IDX          labels, as many items as --images\n");
    if (sc->accepts & R_CSV) printf("  --csv FILE            a CSV file with a header row, instead of IDX\n");
    if (sc->accepts & R_LABEL_COLUMN) printf("  --label-column NAME   CSV column stored as the feature `label`\n");
    if (sc->accepts & R_CONFIG) printf("  --config CFG          write data.train's source of this config instead\n");
    if (sc->accepts & R_COUNT) printf("  --count N             --config: the first N elements (default all)\n");
    if (sc->accepts & R_OUTPUT) printf("  --output PREFIX       path prefix of the shards\n");
    if (sc->accepts & R_SHARDS) printf("  --shards N            number of files, 1..%d (default 1)\n", MAX_SHARDS);
    if (sc->accepts & R_COMPRESSION) printf("  --compression NAME    none (default), gzip, zlib or zstd\n");
    if (sc->accepts & R_N) printf("  -n N                  records shown per file (default 3)\n");
    printf("  -q, --quiet           only warnings and errors on stderr\n  -h, --help            this help\n%s", exit_text);
}

static int usage_error(const subcommand *sc, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int usage_error(const subcommand *sc, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "loom records %s: %s\nusage: %s\n", sc->name, msg, sc->usage);
    return LOOM_EXIT_USAGE;
}

/* Prints err as "loom: where: msg" (+ hint) and returns its exit status. */
static int report(const loom_err *err)
{
    loom_cli_print_err_(err);
    return err->code == LOOM_EUSAGE || err->code == LOOM_ECONFIG ? LOOM_EXIT_USAGE : LOOM_EXIT_RUNTIME;
}

static bool is_opt(const char *arg, const char *name)
{
    size_t n = strlen(name);
    return !strncmp(arg, name, n) && (arg[n] == 0 || arg[n] == '=');
}

/* A whole-string decimal integer in [lo, hi]. */
static bool parse_long(const char *s, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return false;
    *out = v;
    return true;
}

static bool parse_compression(const char *s, loom_compression *out)
{
    static const struct { const char *name; loom_compression c; } tab[] = {
        {"none", LOOM_COMP_NONE}, {"gzip", LOOM_COMP_GZIP}, {"zlib", LOOM_COMP_ZLIB}, {"zstd", LOOM_COMP_ZSTD}};
    for (size_t i = 0; i < sizeof tab / sizeof tab[0]; i++)
        if (!strcasecmp(s, tab[i].name)) {
            *out = tab[i].c;
            return true;
        }
    return false;
}

/* An option's value into o; -1 when it is good, else the exit status
 * (the usage error reported). */
static int set_value(const subcommand *sc, rec_opts *o, unsigned bit, const char *v)
{
    switch (bit) {
    case R_IMAGES: o->images = v; return -1;
    case R_LABELS: o->labels = v; return -1;
    case R_CSV: o->csv = v; return -1;
    case R_LABEL_COLUMN: o->label_column = v; return -1;
    case R_OUTPUT: o->output = v; return -1;
    case R_CONFIG: o->config = v; return -1;
    case R_COUNT:
        if (!parse_long(v, 1, 4000000000000000000L, &o->count))
            return usage_error(sc, "--count \"%s\": expected a number of records (1 or more)", v);
        return -1;
    case R_SHARDS:
        if (!parse_long(v, 1, MAX_SHARDS, &o->shards))
            return usage_error(sc, "--shards \"%s\": expected an integer from 1 to %d", v, MAX_SHARDS);
        return -1;
    case R_COMPRESSION:
        if (!parse_compression(v, &o->comp))
            return usage_error(sc, "unknown --compression \"%s\" (expected one of: none, gzip, zlib, zstd)", v);
        return -1;
    case R_N:
        if (!parse_long(v, 0, 1000000000L, &o->n))
            return usage_error(sc, "-n \"%s\": expected a number of records (0 or more)", v);
        return -1;
    }
    return -1;
}

int loom_cli_records_(int argc, char **argv, double start_time)
{
    if (argc < 2) {
        fprintf(stderr, "loom records: missing subcommand\n");
        records_usage(stderr);
        return LOOM_EXIT_USAGE;
    }
    if (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "help")) {
        records_usage(stdout);
        return LOOM_EXIT_OK;
    }
    const subcommand *sc = NULL;
    for (int i = 0; i < N_SUB; i++)
        if (!strcmp(argv[1], subcommands[i].name)) sc = &subcommands[i];
    if (!sc) {
        const char *best = NULL;
        int bd = 3;
        for (int i = 0; i < N_SUB; i++) {
            int d = loom_edit_distance(argv[1], subcommands[i].name);
            if (d < bd) bd = d, best = subcommands[i].name;
        }
        fprintf(stderr, "loom records: unknown subcommand \"%s\"%s%s%s\n", argv[1], best ? " (did you mean \"" : "",
                best ? best : "", best ? "\"?)" : "");
        records_usage(stderr);
        return LOOM_EXIT_USAGE;
    }
    rec_opts o = {.shards = 1, .comp = LOOM_COMP_NONE, .n = 3, .start = start_time};
    char **files = calloc((size_t)argc, sizeof *files);
    if (!files) {
        fprintf(stderr, "loom: out of memory\n");
        return LOOM_EXIT_RUNTIME;
    }
    o.files = files;
    int status = -1;
    bool quiet = false, verbose = false, only_files = false;
    for (int i = 2; i < argc && status < 0; i++) {
        const char *a = argv[i];
        if (only_files || a[0] != '-' || !a[1]) {
            if (!sc->takes_files) status = usage_error(sc, "unexpected argument \"%s\"", a);
            else files[o.n_files++] = argv[i];
            continue;
        }
        if (!strcmp(a, "--")) {
            only_files = true;
            continue;
        }
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            sub_help(sc);
            status = LOOM_EXIT_OK;
            continue;
        }
        if (!strcmp(a, "-q") || !strcmp(a, "--quiet")) {
            quiet = true;
            continue;
        }
        if (!strcmp(a, "-v") || !strcmp(a, "--verbose")) {
            verbose = true;
            continue;
        }
        static const struct { const char *name; unsigned bit; } valued[] = {
            {"--images", R_IMAGES}, {"--labels", R_LABELS}, {"--csv", R_CSV}, {"--label-column", R_LABEL_COLUMN},
            {"--output", R_OUTPUT}, {"--shards", R_SHARDS}, {"--compression", R_COMPRESSION}, {"-n", R_N},
            {"--config", R_CONFIG}, {"--count", R_COUNT},
        };
        int k = -1;
        for (int j = 0; j < (int)(sizeof valued / sizeof valued[0]); j++)
            if (is_opt(a, valued[j].name)) k = j;
        if (k < 0 && !strncmp(a, "-n", 2) && a[2] >= '0' && a[2] <= '9') k = 7; /* -n5 */
        if (k < 0) {
            status = usage_error(sc, "unknown option %s", a);
            continue;
        }
        if (!(sc->accepts & valued[k].bit)) {
            status = usage_error(sc, "option %s does not apply to this subcommand", valued[k].name);
            continue;
        }
        size_t nl = strlen(valued[k].name);
        const char *v;
        if (a[nl] == '=') v = a + nl + 1;
        else if (a[nl]) v = a + nl; /* -n5 */
        else if (i + 1 < argc) v = argv[++i];
        else {
            status = usage_error(sc, "%s needs a value", valued[k].name);
            continue;
        }
        status = set_value(sc, &o, valued[k].bit, v);
    }
    if (status < 0 && sc->takes_files && o.n_files == 0) status = usage_error(sc, "missing FILE");
    if (status < 0) {
        if (quiet) loom_log_set_level(LOOM_LOG_WARN);
        if (verbose) loom_log_set_level(LOOM_LOG_DEBUG);
        status = sc->run(&o);
    }
    free(files);
    return status;
}

/* ---- convert (the work is data/format/convert.c's) --------------------------- */

static const char *comp_lower(loom_compression c)
{
    switch (c) {
    case LOOM_COMP_GZIP: return "gzip";
    case LOOM_COMP_ZLIB: return "zlib";
    case LOOM_COMP_ZSTD: return "zstd";
    default: return "none";
    }
}

/* The columns a CSV conversion found, as pass 1 saw them. */
static void print_columns(const rec_opts *o, const loom_convert_result *r)
{
    printf("%s: %lld rows; features:", o->csv, (long long)r->rows);
    for (int j = 0; j < r->ncols; j++) {
        printf("%s %s %s", j ? "," : "", r->col_name[j], loom_feature_kind_name(r->col_kind[j]));
        if (j == r->label) printf(" (from column \"%s\")", o->label_column);
    }
    printf("\n");
}

static void print_summary(const loom_convert_result *r, loom_compression comp, double seconds)
{
    int64_t bytes = 0;
    for (int i = 0; i < r->shards; i++) {
        printf("%s: %lld records, %lld bytes\n", r->path[i], (long long)r->records[i], (long long)r->bytes[i]);
        bytes += r->bytes[i];
    }
    printf("converted %lld records into %d %s shard%s, %lld bytes, in %.2f s\n", (long long)r->total, r->shards,
           comp == LOOM_COMP_NONE ? "uncompressed" : comp_lower(comp), r->shards == 1 ? "" : "s", (long long)bytes, seconds);
}

static int run_convert(const rec_opts *o)
{
    const subcommand *sc = &subcommands[0];
    if (o->config && (o->csv || o->images || o->labels))
        return usage_error(sc, "--config, --csv and --images/--labels are alternatives: give one");
    if (o->count && !o->config) return usage_error(sc, "--count applies to --config only");
    if (o->csv && (o->images || o->labels)) return usage_error(sc, "--csv and --images/--labels are alternatives: give one");
    if (!o->config && !o->csv && (!o->images || !o->labels))
        return usage_error(sc, "needs --images IDX and --labels IDX, or --csv FILE (or --config CFG)");
    if (o->label_column && !o->csv) return usage_error(sc, "--label-column applies to --csv only");
    if (!o->output) return usage_error(sc, "missing --output PREFIX");
    size_t n = strlen(o->output);
    if (!n || o->output[n - 1] == '/')
        return usage_error(sc, "--output \"%s\": expected a path prefix such as data/train (shards are PREFIX-00000-of-0000N...)",
                           o->output);
    double t0 = loom_now();
    loom_err err = {0};
    loom_convert_opts co = {.images = o->images, .labels = o->labels, .csv = o->csv, .label_column = o->label_column,
                            .output = o->output, .shards = (int)o->shards, .comp = o->comp};
    loom_spec *spec = NULL;
    if (o->config) {
        loom_errlist errs = {0};
        if (loom_config_load(&spec, o->config, NULL, 0, &errs)) {
            for (int i = 0; i < errs.n; i++) report(&errs.e[i]);
            return LOOM_EXIT_USAGE;
        }
        co.dataset = &spec->train;
        co.seed = spec->run.seed;
        co.count = o->count;
    }
    loom_convert_result res;
    int rc = loom_records_convert(&co, &res, &err);
    loom_config_free(spec);
    if (res.ncols) print_columns(o, &res);
    if (!rc) print_summary(&res, o->comp, loom_now() - t0);
    loom_convert_result_fini(&res);
    return rc ? report(&err) : LOOM_EXIT_OK;
}

/* ---- count, verify ---------------------------------------------------------- */

/* The reader's hint speaks of the config's on_corrupt; say what fits here. */
static int reader_failed(int rc, loom_err *err)
{
    if (rc == LOOM_EDATA) loom_err_hint(err, "the file is damaged, truncated or not a TFRecord file");
    return rc;
}

/* Reads every record of path (checking every CRC); *n records read. */
static int read_all(const char *path, int64_t *n, loom_compression *comp, loom_err *err)
{
    loom_tfrecord *r;
    *n = 0;
    *comp = LOOM_COMP_NONE;
    int rc = loom_tfrecord_open(&r, path, LOOM_COMP_AUTO, LOOM_CORRUPT_ERROR, err);
    if (rc) return reader_failed(rc, err);
    *comp = loom_tfrecord_compression(r);
    const uint8_t *data;
    size_t len;
    while ((rc = loom_tfrecord_next(r, &data, &len, err)) == LOOM_OK) {}
    *n = loom_tfrecord_count(r);
    loom_tfrecord_close(r);
    return rc == LOOM_EEOF ? LOOM_OK : reader_failed(rc, err);
}

static int run_count(const rec_opts *o)
{
    int64_t total = 0;
    int bad = 0;
    for (int i = 0; i < o->n_files; i++) {
        loom_err err = {0};
        int64_t n;
        loom_compression comp;
        if (read_all(o->files[i], &n, &comp, &err)) {
            report(&err);
            bad++;
            continue;
        }
        printf("%12lld  %-4s  %s\n", (long long)n, comp_lower(comp), o->files[i]);
        total += n;
    }
    printf("%12lld  total (%d file%s", (long long)total, o->n_files - bad, o->n_files - bad == 1 ? "" : "s");
    if (bad) printf("; %d unreadable or damaged, not counted", bad);
    printf(")\n");
    return bad ? LOOM_EXIT_RUNTIME : LOOM_EXIT_OK;
}

static int run_verify(const rec_opts *o)
{
    int bad = 0;
    for (int i = 0; i < o->n_files; i++) {
        loom_err err = {0};
        int64_t n;
        loom_compression comp;
        if (read_all(o->files[i], &n, &comp, &err)) {
            printf("%s: BAD: %s\n", o->files[i], err.msg);
            bad++;
            continue;
        }
        printf("%s: ok, %lld records (%s)\n", o->files[i], (long long)n, comp_lower(comp));
    }
    if (bad) {
        fprintf(stderr, "loom records verify: %d of %d file%s damaged or unreadable\n", bad, o->n_files, o->n_files == 1 ? "" : "s");
        return LOOM_EXIT_RUNTIME;
    }
    printf("all %d file%s sound\n", o->n_files, o->n_files == 1 ? "" : "s");
    return LOOM_EXIT_OK;
}

/* ---- head ---------------------------------------------------------------------- */

/* A string as "text" when printable ASCII (tabs and line breaks escaped),
 * else as its length and first bytes in hex. */
static void print_string(const uint8_t *s, size_t n)
{
    bool printable = true;
    for (size_t i = 0; i < n && printable; i++)
        printable = (s[i] >= 0x20 && s[i] < 0x7f) || s[i] == '\t' || s[i] == '\n' || s[i] == '\r';
    if (printable && n > 0) {
        putchar('"');
        for (size_t i = 0; i < n && i < HEAD_TEXT; i++) {
            if (s[i] == '\t' || s[i] == '\n' || s[i] == '\r') {
                printf("\\%c", s[i] == '\t' ? 't' : s[i] == '\n' ? 'n' : 'r');
                continue;
            }
            if (s[i] == '"' || s[i] == '\\') putchar('\\');
            putchar(s[i]);
        }
        if (n > HEAD_TEXT) printf("...\" (%zu bytes)", n);
        else putchar('"');
        return;
    }
    if (n == 0) {
        printf("\"\"");
        return;
    }
    printf("%zu bytes:", n);
    for (size_t i = 0; i < n && i < HEAD_HEX; i++) printf(" %02x", s[i]);
    if (n > HEAD_HEX) printf(" ...");
}

static int cmp_feature(const void *a, const void *b)
{
    const loom_example_feature *x = *(const loom_example_feature *const *)a, *y = *(const loom_example_feature *const *)b;
    size_t n = x->name.len < y->name.len ? x->name.len : y->name.len;
    int c = n ? memcmp(x->name.data, y->name.data, n) : 0;
    return c ? c : (x->name.len > y->name.len) - (x->name.len < y->name.len);
}

static void print_values(const loom_example_feature *f)
{
    int64_t k = 0;
    putchar('[');
    if (f->kind == LOOM_FEATURE_INT64) {
        int64_t v[HEAD_VALUES];
        k = loom_example_int64s(f, v, HEAD_VALUES);
        for (int64_t i = 0; i < k; i++) printf("%s%lld", i ? ", " : "", (long long)v[i]);
    } else if (f->kind == LOOM_FEATURE_FLOAT) {
        float v[HEAD_VALUES];
        k = loom_example_floats(f, v, HEAD_VALUES);
        for (int64_t i = 0; i < k; i++) printf("%s%.7g", i ? ", " : "", (double)v[i]);
    } else if (f->kind == LOOM_FEATURE_BYTES) {
        loom_bytes_view v[HEAD_VALUES];
        k = loom_example_bytes(f, v, HEAD_VALUES);
        for (int64_t i = 0; i < k; i++) {
            if (i) printf(", ");
            print_string(v[i].data, v[i].len);
        }
    }
    if (f->count > k) printf(", ... (%lld more)", (long long)(f->count - k));
    putchar(']');
}

static void print_record(int64_t index, uint64_t at, const uint8_t *data, size_t len, loom_example *ex)
{
    loom_err perr = {0};
    printf("record %lld (offset %llu, %zu bytes): ", (long long)index, (unsigned long long)at, len);
    if (loom_example_parse(ex, data, len, &perr)) {
        printf("not a tf.train.Example (%s): ", perr.msg);
        print_string(data, len);
        putchar('\n');
        return;
    }
    printf("%d feature%s\n", ex->n, ex->n == 1 ? "" : "s");
    const loom_example_feature **order = loom_alloc((size_t)(ex->n ? ex->n : 1) * sizeof *order);
    if (!order) {
        printf("  (out of memory listing the features)\n");
        return;
    }
    int width = 0;
    for (int i = 0; i < ex->n; i++) {
        order[i] = &ex->f[i];
        if ((int)ex->f[i].name.len > width) width = (int)ex->f[i].name.len;
    }
    if (width > 32) width = 32;
    qsort(order, (size_t)ex->n, sizeof *order, cmp_feature);
    for (int i = 0; i < ex->n; i++) {
        const loom_example_feature *f = order[i];
        printf("  %-*.*s  ", width, (int)f->name.len, (const char *)f->name.data);
        if (f->kind == LOOM_FEATURE_NONE) {
            printf("(no kind set: read as missing)\n");
            continue;
        }
        printf("%-10s  length %-4lld ", loom_feature_kind_name(f->kind), (long long)f->count);
        print_values(f);
        putchar('\n');
    }
    loom_free(order);
}

static int head_file(const char *path, int64_t n, loom_example *ex, loom_err *err)
{
    loom_tfrecord *r;
    int rc = loom_tfrecord_open(&r, path, LOOM_COMP_AUTO, LOOM_CORRUPT_ERROR, err);
    if (rc) return reader_failed(rc, err);
    printf("%s (%s)\n", path, comp_lower(loom_tfrecord_compression(r)));
    for (int64_t i = 0; i < n; i++) {
        uint64_t at = loom_tfrecord_offset(r);
        const uint8_t *data;
        size_t len;
        rc = loom_tfrecord_next(r, &data, &len, err);
        if (rc == LOOM_EEOF) {
            if (i == 0) printf("(no records)\n");
            rc = LOOM_OK;
            break;
        }
        if (rc) break;
        print_record(i, at, data, len, ex);
    }
    loom_tfrecord_close(r);
    return reader_failed(rc, err);
}

static int run_head(const rec_opts *o)
{
    loom_example ex;
    loom_example_init(&ex);
    int status = LOOM_EXIT_OK;
    for (int i = 0; i < o->n_files; i++) {
        loom_err err = {0};
        if (i) putchar('\n');
        if (head_file(o->files[i], o->n, &ex, &err)) {
            fflush(stdout);
            report(&err);
            status = LOOM_EXIT_RUNTIME;
        }
    }
    loom_example_fini(&ex);
    return status;
}
