/* config.h - libconfig files into typed, validated specs.
 * Every string the user writes is resolved here to an enum or a number; no
 * module below carries a config string forward. Every spec records where it
 * was declared (file:line) so later checks (shapes, files) can point at it.
 * Ownership: loom_config_load returns a spec freed with loom_config_free.
 * Threads: none; call from the main thread. */
#ifndef LOOM_CONFIG_H
#define LOOM_CONFIG_H

#include "core/core.h"
#include <stdbool.h>
#include <stdio.h>

#define LOOM_MAX_FEATURES   256 /* features of an element (and declared columns of a source) */
#define LOOM_MAX_TRANSFORMS 32
#define LOOM_MAX_LAYERS     256
#define LOOM_MAX_BOUNDARIES 16
#define LOOM_MAX_DEVICES    16
#define LOOM_NAME_MAX       64
#define LOOM_PATH_MAX       512
/* Static bounds that keep products of sizes far from overflow; what memory
 * allows is checked again when the pipeline and the model are built. */
#define LOOM_MAX_BATCH      (1 << 24) /* batch and padded_batch size */
#define LOOM_MAX_UNITS      (1 << 24) /* dense units, conv2d filters */

/* Where a setting was declared. */
typedef struct loom_loc {
    char file[LOOM_PATH_MAX];
    int  line;
    char path[128]; /* setting path, "data.train.transforms.[2]" */
} loom_loc;

/* "file:line" (or "file" or "") into buf; returns buf. */
const char *loom_loc_str(const loom_loc *l, char *buf, size_t n);

/* dtypes as in tensor.h; config only names them. */
typedef enum { LOOM_CFG_U8, LOOM_CFG_I32, LOOM_CFG_I64, LOOM_CFG_F32, LOOM_CFG_F64 } loom_cfg_dtype;

/* ---- data ---------------------------------------------------------------- */

typedef enum { LOOM_SRC_IDX, LOOM_SRC_CATALOG, LOOM_SRC_TFRECORD, LOOM_SRC_CSV, LOOM_SRC_TEXT,
               LOOM_SRC_SYNTHETIC, LOOM_SRC_LIST_FILES,
               LOOM_SRC_PLUGIN /* any other type: a plugin's source, found by `plugin` once plugins are loaded */
} loom_source_kind;

/* Options a config hands a plugin's provider (a source's `options`, a
 * plugin map's or filter's `args`): scalars kept as text, in config order. */
#define LOOM_MAX_PLUGIN_OPTS 8
typedef struct loom_plugin_opts {
    int  n;
    char key[LOOM_MAX_PLUGIN_OPTS][LOOM_NAME_MAX];
    char value[LOOM_MAX_PLUGIN_OPTS][256];
    int  line[LOOM_MAX_PLUGIN_OPTS]; /* in the config file; 0 for --set */
} loom_plugin_opts;

#define LOOM_MAX_FILE_PATTERNS 16
#define LOOM_MAX_NORM 1024 /* a normalize map's per-element mean/std values (its feature's last axis) */

/* tfrecord: how a declared feature is read from a tf.train.Example. */
typedef enum {
    LOOM_TFR_UINT8,   /* one bytes_list value, its bytes as uint8 (tf.io.decode_raw); length = numel */
    LOOM_TFR_INT64,   /* int64_list -> int64 */
    LOOM_TFR_FLOAT32, /* float_list -> float32 */
} loom_tfr_dtype;
typedef enum { LOOM_TFR_COMP_AUTO, LOOM_TFR_COMP_NONE, LOOM_TFR_COMP_GZIP, LOOM_TFR_COMP_ZLIB,
               LOOM_TFR_COMP_ZSTD } loom_tfr_compression;
typedef enum { LOOM_TFR_CORRUPT_ERROR, LOOM_TFR_CORRUPT_SKIP } loom_tfr_on_corrupt;

/* One declared tfrecord feature (tf.io.FixedLenFeature; with var_len a
 * VarLenFeature densified to at most numel values). Its name is the source
 * spec's feature[i]. */
typedef struct loom_tfr_feature {
    loom_tfr_dtype dtype;
    int            rank;          /* 0 (scalar) to 8 */
    int64_t        shape[8];      /* each >= 1 */
    bool           has_default;   /* fixed-length only: a missing feature is filled with default_value; */
    double         default_value; /*   without a default a missing feature is an error */
    bool           var_len;       /* 0..numel values, the rest is pad; missing = all pad */
    double         pad;           /* var_len only, default 0 */
} loom_tfr_feature;

/* One declared csv column; its feature name is the source spec's feature[i]. */
#define LOOM_CSV_STRING 5 /* a csv column's dtype = "string", after the loom_cfg_dtype values */
#define LOOM_MAX_STRING 4096 /* a string column's max_length */
typedef struct loom_csv_column {
    loom_cfg_dtype dtype;         /* or LOOM_CSV_STRING: the field's bytes as uint8 (max_length,), zero-padded */
    int            max_length;    /* string: 1 to LOOM_MAX_STRING bytes, default 64; a longer field is an error */
    int            index;         /* 0-based field index; -1 = by header name (header = true only) */
    int            count;         /* index = "a-b": the fields a..b (0-based, inclusive) gathered into one
                                     vector feature of shape (count,); 0 = one field, a scalar feature */
    char           column[LOOM_NAME_MAX]; /* header name to select; default the feature name */
    bool           has_default;   /* an empty field takes default_value; without it an empty field is an error */
    double         default_value;
} loom_csv_column;

/* One synthetic feature. */
typedef enum { LOOM_SYN_UNIFORM, LOOM_SYN_NORMAL } loom_syn_dist;
typedef struct loom_syn_feature {
    loom_cfg_dtype dtype;
    int            rank;          /* 0 to 8 */
    int64_t        shape[8];      /* each >= 1 */
    loom_syn_dist  dist;          /* default uniform; normal only for float dtypes */
    double         min, max;      /* uniform: floats in [min, max), integers in [min, max - 1]; default 0, 1 */
    double         mean, std;     /* normal: default 0, 1 */
} loom_syn_feature;

/* A synthetic click-through-rate data set with known structure (synthetic
 * source, `ctr = { ... }`): features "ids" (int64 (columns,) or (columns,
 * ids_per_column)) and "label" (float32 (), 0 or 1). Column c's values v are
 * drawn from a Zipf(zipf) law over [0, vocab) and hashed with c into
 * [0, id_space); the click is Bernoulli(sigmoid(bias + sum over the
 * example's values of w(c, v))), w(c, v) ~ normal(0, weight_std) a pure
 * function of (seed, c, v). */
typedef struct loom_syn_ctr {
    bool    on;
    int     columns;        /* categorical columns, 1 to 1024 */
    int     ids_per_column; /* multi-hot width, default 1 */
    int64_t id_space;       /* hashed ids in [0, id_space), default 2^20 */
    int64_t vocab;          /* distinct values per column, default 10000 */
    double  zipf;           /* value popularity exponent, default 1.1; 0 = uniform */
    double  weight_std;     /* spread of the true logistic weights, default 0.5 */
    double  bias;           /* the true model's bias, default -1.5 */
    int64_t offset;         /* element i of the source is example offset + i of the set (a held-out split) */
} loom_syn_ctr;

/* The settings of each source kind: a source reads only its own kind's
 * member of loom_source_spec's union. */

/* idx: one IDX file per declared feature; all must hold the same number of items.
 *   source: { type = "idx"; features: { image = "x.gz"; label = "y.gz"; }; }; */
typedef struct loom_idx_source {
    char file[LOOM_MAX_FEATURES][LOOM_PATH_MAX]; /* feature[i]'s file, resolved relative to the config's directory */
} loom_idx_source;

/* catalog: source: { type = "catalog"; name = "fashion_mnist"; split = "train"; };
 * yields features "image" (uint8 (28, 28)) and "label" (uint8 ()). */
typedef struct loom_catalog_source {
    char name[LOOM_NAME_MAX]; /* "fashion_mnist" (also "mnist" when its package is present) */
    char split[16];           /* "train" | "test" */
} loom_catalog_source;

/* tfrecord: files (the spec's patterns) of serialized tf.train.Example, streamed record by record.
 *   source: { type = "tfrecord"; files = ["data/train-*.tfrecord.zst"];
 *             features: { image = { dtype = "uint8"; shape = [28, 28]; }; ... }; }; */
typedef struct loom_tfrecord_source {
    loom_tfr_compression compression;                 /* default auto: detected per file from its leading bytes */
    loom_tfr_on_corrupt  on_corrupt;                  /* default error */
    loom_tfr_feature     features[LOOM_MAX_FEATURES]; /* feature[i]'s type */
} loom_tfrecord_source;

/* csv: files (the spec's patterns) of RFC 4180 records, streamed.
 *   source: { type = "csv"; files = ["a.csv"]; header = true; delimiter = ",";
 *             columns: { x1 = { dtype = "float32"; }; label = { dtype = "int64"; }; }; };
 * Each declared column is a feature named feature[i]; undeclared columns are ignored. */
typedef struct loom_csv_source {
    bool            header;                     /* default true: each file's first record names the columns */
    char            delimiter;                  /* default ','; one byte, not '"', '\r' or '\n' */
    loom_csv_column columns[LOOM_MAX_FEATURES]; /* feature[i]'s column */
} loom_csv_source;

/* text: files (the spec's patterns), one element per line: "line" uint8 (max_length), zero-padded,
 * and "length" int64 () (bytes of the line, '\n' and a trailing '\r' removed). */
typedef struct loom_text_source {
    int64_t max_length; /* >= 1 */
    bool    truncate;   /* default false: a longer line is an error; true: cut to max_length */
    /* record_separator = "%": an element is a record of the lines between two
     * lines equal to it (fortune files), joined with '\n'; "" (default): one line */
    char    record_separator[16];
    /* file_feature = "file": an int64 () feature of that name, the index of the element's file in the
     * sorted list of files (a label for "which file is this from"); "" (default): none */
    char    file_feature[LOOM_NAME_MAX];
} loom_text_source;

/* synthetic: seeded random tensors, element i a pure function of (run seed, i).
 *   source: { type = "synthetic"; count = 100000;
 *             features: { image = { dtype = "float32"; shape = [28, 28]; };
 *                         label = { dtype = "int64"; max = 10; }; }; }; */
typedef struct loom_synthetic_source {
    int64_t          count;                       /* elements per pass, >= 1, or -1 = infinite */
    loom_syn_feature features[LOOM_MAX_FEATURES]; /* feature[i]'s distribution */
    loom_syn_ctr     ctr;                         /* CTR data, before the declared features (which may then
                                                     be absent) */
} loom_synthetic_source;

/* list_files: the file names matching `files` (the spec's patterns), sorted, one element each:
 * "filename" uint8 (LOOM_PATH_MAX) zero-padded and "length" int64 (), as the text source's lines.
 *   source: { type = "list_files"; files = ["data/train-*.tfrecord"]; shuffle = false; };
 * shuffle (the spec's shuffle_files, default true here) reorders them each epoch by (seed, epoch). */
typedef struct loom_list_files_source {
    uint64_t seed; /* the run's seed unless set */
    bool     seed_set;
} loom_list_files_source;

/* plugin: a source a plugin registered (LOOM_REG_SOURCE) under its type.
 *   source: { type = "npy"; options: { image = "x.npy"; label = "y.npy"; }; }; */
typedef struct loom_plugin_source {
    char             name[LOOM_NAME_MAX]; /* the type, as written */
    loom_plugin_opts options;
} loom_plugin_source;

typedef struct loom_source_spec {
    loom_source_kind kind;
    loom_loc         loc;
    /* The features a source declares (idx, tfrecord, csv, synthetic): their
     * names, in config order; the kind's own array (idx.file, tfrecord.features,
     * csv.columns, synthetic.features) holds feature i's settings at index i. */
    int  n_features;
    char feature[LOOM_MAX_FEATURES][LOOM_NAME_MAX];
    /* The file-list sources (tfrecord, csv, text, list_files): `files`. Each
     * pattern is absolute (relative ones are resolved against the config's
     * directory, whose glob metacharacters are escaped) and matched at least one
     * regular file at load; the source expands them again at open, sorted and
     * without duplicates. An interleave's nested source has none (n_patterns 0). */
    int  n_patterns;
    char pattern[LOOM_MAX_FILE_PATTERNS][LOOM_PATH_MAX];
    bool shuffle_files; /* tfrecord's shuffle_files, list_files' shuffle: reorder the files each epoch by
                           (run seed, epoch) */
    /* Not a config key: FILE auto-sharding (data/engine/distribute_input.c) sets them
     * on the pipeline's copy of the spec, and every file-list source then keeps
     * file i of its sorted list only when i % file_shards == file_shard.
     * 0 (the loaded value) = all files. */
    int file_shards, file_shard;
    /* Not a config key: the dataset's on_nonfinite (csv, idx, tfrecord and plugin sources' float features). */
    int on_nonfinite; /* loom_on_nonfinite */
    /* The kind's own settings; read and write only the member of the spec's
     * kind (the others share its bytes). The spec is copied by value (a
     * predict copy, the sharded copy, an interleave's nested copy), so the
     * file lists stay fixed arrays rather than allocations the copies would share. */
    union {
        loom_idx_source        idx;        /* IDX */
        loom_catalog_source    catalog;    /* CATALOG */
        loom_tfrecord_source   tfrecord;   /* TFRECORD */
        loom_csv_source        csv;        /* CSV */
        loom_text_source       text;       /* TEXT */
        loom_synthetic_source  synthetic;  /* SYNTHETIC */
        loom_list_files_source list_files; /* LIST_FILES */
        loom_plugin_source     plugin;     /* PLUGIN */
    };
} loom_source_spec;

typedef enum {
    LOOM_MAP_CAST,        /* dtype */
    LOOM_MAP_SCALE,       /* x * scale + offset */
    LOOM_MAP_NORMALIZE,   /* (x - mean) / std */
    LOOM_MAP_ONE_HOT,     /* depth; int feature -> float32 (depth,) */
    LOOM_MAP_RESHAPE,     /* shape; same element count */
    LOOM_MAP_FLIP_LR,     /* random_flip_left_right: (H, W) or (H, W, C), probability 0.5 */
    LOOM_MAP_PAD,         /* pad: (H, W[, C]) -> (H + 2p, W + 2p[, C]) filled with value; unbatched only */
    LOOM_MAP_RANDOM_CROP, /* random_crop: (H, W[, C]) -> (h, w[, C]) at uniform offsets; unbatched only */
    LOOM_MAP_STANDARDIZE, /* per_image_standardization: (x - mean) / max(std, 1/sqrt(N)), float32; unbatched only */
    LOOM_MAP_SLEEP,       /* sleep: ms per element, values unchanged; for benchmarks and autotune tests */
    LOOM_MAP_LUA,         /* lua (or plugin): a custom function maps the whole element (data/engine/custom.h); fn may be omitted */
    /* images (data/transform/image.c); all unbatched only */
    LOOM_MAP_DECODE_IMAGE,      /* decode_image: PNG/JPEG bytes (uint8 [N]) -> (H, W, C) uint8 or float32 in [0, 1] */
    LOOM_MAP_RESIZE,            /* resize: (H, W[, C]) -> (h, w[, C]) float32, bilinear, half-pixel centres */
    LOOM_MAP_CENTRAL_CROP,      /* central_crop: the central fraction of H and W, as tf.image.central_crop */
    LOOM_MAP_RANDOM_BRIGHTNESS, /* random_brightness: + delta, delta uniform in [-max_delta, max_delta) */
    LOOM_MAP_RANDOM_CONTRAST,   /* random_contrast: (x - mean) * f + mean per channel, f uniform in [lower, upper) */
    LOOM_MAP_STRING_LOOKUP,     /* string_lookup: strings (uint8 (..., max_length), zero-padded) -> int64 ids (...) */
    LOOM_MAP_TOKENIZE,          /* tokenize: a string (uint8 (L,)) -> int64 ids (n,) or (output_sequence_length,) (data/transform/text.c) */
} loom_map_kind;

/* tokenize's unit (Keras TextVectorization with split and a vocabulary, or raw bytes / code points) */
typedef enum { LOOM_TOK_BYTES, LOOM_TOK_UTF8_CHARS, LOOM_TOK_WHITESPACE, LOOM_TOK_VOCABULARY } loom_tok_mode;
/* tokenize's standardize (Keras TextVectorization; ASCII letters and punctuation) */
typedef enum { LOOM_STD_DEFAULT, LOOM_STD_NONE, LOOM_STD_LOWER_AND_STRIP, LOOM_STD_LOWER, LOOM_STD_STRIP } loom_tok_std;
typedef enum { LOOM_INVALID_REPLACE, LOOM_INVALID_ERROR } loom_tok_invalid;

/* normalize's mode: what adapt = true computes (both applied as (x - mean_v) / std_v). */
typedef enum {
    LOOM_NORM_MEAN_STD, /* mean and standard deviation (Keras Normalization) */
    LOOM_NORM_MIN_MAX,  /* min and max - min (scikit-learn MinMaxScaler): values of data.train into [0, 1] */
} loom_norm_mode;

/* A string_lookup map's vocabulary (one allocation, freed with loom_free by
 * its owner): token i (id num_oov_indices + i) is the bytes
 * data[off[i] .. off[i + 1]), most frequent in data.train first. */
typedef struct loom_vocab {
    int64_t   n;
    uint64_t *off;    /* n + 1 offsets into data */
    int64_t  *count;  /* each token's count in data.train (0 when not known) */
    char     *data;
    uint64_t  digest; /* FNV-1a of the tokens, for the stage's identity */
} loom_vocab;

typedef struct loom_map_spec {
    loom_map_kind  kind;
    char           feature[LOOM_NAME_MAX]; /* the feature it applies to */
    loom_cfg_dtype dtype;                  /* cast; decode_image (uint8 or float32) */
    double         scale, offset;          /* scale */
    double         mean, std;              /* normalize (std > 0) */
    /* normalize per index of the feature's last axis (Keras Normalization, axis -1):
     * mean = [...] and/or std = [...] in the config, or adapt = true (filled by
     * loom_data_adapt from the training data). 0 = the scalars above. */
    int            n_norm;                 /* 0, or 1 to LOOM_MAX_NORM */
    float          mean_v[LOOM_MAX_NORM], std_v[LOOM_MAX_NORM];
    bool           adapt;                  /* normalize, string_lookup: numbers/vocabulary from data.train (data.h) */
    loom_norm_mode norm_mode;              /* normalize: mean_std (default) or min_max (adapt only) */
    /* string_lookup (Keras StringLookup, output_mode "int", no mask token): ids
     * [0, num_oov_indices) for strings outside the vocabulary (a hash of the
     * bytes when there are several; none: such a string is an error), then the
     * vocabulary's tokens. max_tokens bounds num_oov_indices + the vocabulary (0: no bound). */
    int64_t        max_tokens;
    int            num_oov_indices;        /* 0 to 1024, default 1 */
    loom_vocab    *vocab;                  /* filled by adapt (tokenize: or read from vocabulary_file at open); owned by the spec when vocab_owned */
    bool           vocab_owned;
    int            depth;                  /* one_hot (>= 1) */
    int            rank;                   /* reshape: target shape; one dim may be -1 */
    int64_t        shape[8];
    int            padding;                /* pad (>= 0), on every side of H and W */
    double         value;                  /* pad: the fill value */
    int            size[2];                /* random_crop, resize, decode_image: [h, w] */
    double         ms;                     /* sleep: milliseconds per element (>= 0) */
    int            channels;               /* decode_image: 0 (as stored), 1 to 4 */
    int            max_size[2];            /* decode_image: [h, w] bound when images vary (0: use size) */
    double         fraction;               /* central_crop: (0, 1] */
    double         max_delta;              /* random_brightness (>= 0) */
    double         lower, upper;           /* random_contrast (0 <= lower < upper) */
    char           lua[LOOM_PATH_MAX + LOOM_NAME_MAX]; /* lua, and a filter's lua: "file.lua:function", the file
                                                          resolved against the config's directory at load */
    /* plugin, and a filter's plugin: `plugin = "provider:function"` selects a
     * transform provider a plugin registered; lua then holds "function" and
     * provider its name ("" = the Lua provider, "lua"). args: its `args`. */
    char             provider[LOOM_NAME_MAX];
    loom_plugin_opts args;
    /* tokenize (data/transform/text.c): ids 0 = padding, 1 .. num_oov_indices =
     * out of vocabulary, then the vocabulary (a vocabulary_file or adapt); bytes
     * and utf8_chars without a vocabulary: byte or code point + 1 */
    loom_tok_mode    tok_mode;
    loom_tok_std     standardize;                    /* default: none for bytes/utf8_chars, else lower_and_strip_punctuation */
    char             vocabulary_file[LOOM_PATH_MAX]; /* one token a line; resolved against the config's directory */
    int64_t          output_sequence_length;         /* 0: ragged (n,), else padded with 0 / truncated to it */
    bool             ragged;                         /* ragged = true (Keras): no output_sequence_length */
    loom_tok_invalid on_invalid;                     /* utf8_chars: invalid UTF-8 replaced with U+FFFD (counted) or an error */
} loom_map_spec;

typedef enum {
    LOOM_T_MAP, LOOM_T_SHUFFLE, LOOM_T_BATCH, LOOM_T_REPEAT, LOOM_T_TAKE, LOOM_T_SKIP, LOOM_T_PREFETCH,
    LOOM_T_FILTER, LOOM_T_SHARD, LOOM_T_ENUMERATE, LOOM_T_UNBATCH, LOOM_T_PADDED_BATCH, LOOM_T_CACHE,
    LOOM_T_INTERLEAVE, LOOM_T_ZIP, LOOM_T_SPLIT, LOOM_T_CONCAT, LOOM_T_SELECT,
    LOOM_T_WINDOW, LOOM_T_LM_PAIRS, LOOM_T_BUCKET, LOOM_T_FLAT_MAP,
} loom_transform_kind;
#define LOOM_MAX_BUCKETS 64

#define LOOM_MAX_FILTER_VALUES 64
/* filter: which predicate the group gave (exactly one of in, not_in, min/max). */
typedef enum { LOOM_FILTER_IN, LOOM_FILTER_NOT_IN, LOOM_FILTER_RANGE, LOOM_FILTER_LUA /* map.lua */ } loom_filter_kind;

/* concat, select: the features joined (concat) or kept (select), in order. */
typedef struct loom_feature_list {
    int  n;
    char name[LOOM_MAX_FEATURES][LOOM_NAME_MAX];
    char output[LOOM_NAME_MAX];                   /* concat: the added feature */
} loom_feature_list;

/* padded_batch (with the transform's batch_size and drop_remainder). */
typedef struct loom_padded_spec {
    int     n_shapes;                             /* padded_shapes: feature, rank, dims (-1 = max in batch) */
    char    shape_name[LOOM_MAX_FEATURES][LOOM_NAME_MAX];
    int     rank[LOOM_MAX_FEATURES];
    int64_t shape[LOOM_MAX_FEATURES][8];
    int     n_values;                             /* padding_values (default 0) */
    char    value_name[LOOM_MAX_FEATURES][LOOM_NAME_MAX];
    double  value[LOOM_MAX_FEATURES];
    char    mask[LOOM_NAME_MAX];                  /* "" or a padded feature: adds "<it>_mask" float32, 1 = real, 0 = padding */
    /* bucket_by_sequence_length (the transform's `feature` is the sequence) */
    int     n_boundaries;                         /* bucket_boundaries, increasing, >= 1 */
    int64_t boundary[LOOM_MAX_BUCKETS];
    int64_t bucket_size[LOOM_MAX_BUCKETS + 1];    /* bucket_batch_sizes: n_boundaries + 1 */
    bool    pad_to_bucket_boundary;
} loom_padded_spec;

typedef struct loom_transform_spec {
    loom_transform_kind kind;
    loom_loc            loc;
    /* the large settings of one kind each share their bytes: read only the
     * member of the transform's kind */
    union {
        loom_map_spec     map;      /* MAP; FILTER with a custom function (its lua, provider, args) */
        loom_feature_list features; /* CONCAT, SELECT */
        loom_padded_spec  padded;   /* PADDED_BATCH */
    };
    int64_t             buffer;         /* SHUFFLE: >= 1; PREFETCH: >= 0, -1 = auto */
    uint64_t            seed;           /* SHUFFLE: the run's seed unless set */
    bool                seed_set;
    bool                reshuffle;      /* SHUFFLE: reshuffle_each_iteration, default true */
    int64_t             batch_size;     /* BATCH, PADDED_BATCH: >= 1 */
    bool                drop_remainder; /* BATCH, PADDED_BATCH */
    int64_t             count;          /* REPEAT (-1 = forever), TAKE (-1 = all), SKIP (-1 = all) */
    /* FILTER, SHARD, ENUMERATE, CACHE */
    char                feature[LOOM_NAME_MAX]; /* FILTER: the scalar feature tested; ENUMERATE: the added int64 feature */
    loom_filter_kind    filter;                 /* FILTER */
    int                 n_values;               /* FILTER in / not_in: 1 to LOOM_MAX_FILTER_VALUES */
    double              values[LOOM_MAX_FILTER_VALUES];
    double              min, max;               /* FILTER range, inclusive; -inf / +inf when not given */
    int64_t             num_shards, index;      /* SHARD: 0 <= index < num_shards */
    double              fraction;               /* SPLIT: the training part's share, in (0, 1) */
    int                 part;                   /* SPLIT: LOOM_SPLIT_TRAIN or LOOM_SPLIT_EVAL */
    int64_t             start;                  /* ENUMERATE: first index, default 0 */
    char                cache_file[LOOM_PATH_MAX]; /* CACHE: "" = in memory; else a path prefix, resolved against the config's directory */
    int                 parallel;               /* MAP, INTERLEAVE: >= 1, LOOM_PARALLEL_AUTO = tuned; 0 (unset) = 1 */
    bool                deterministic;          /* MAP, INTERLEAVE with parallel != 1: the sequential order (default true) */
    /* INTERLEAVE (with parallel, deterministic): each input element's "filename" opened with *source */
    int64_t             cycle_length;           /* INTERLEAVE: files read at once, >= 1 */
    int64_t             block_length;           /* INTERLEAVE: elements from one file before the next, >= 1 */
    struct loom_source_spec  *source;           /* INTERLEAVE: tfrecord, csv or text without files; owned by the spec */
    struct loom_dataset_spec *dataset;          /* ZIP: the dataset zipped with this one; owned by the spec */
    /* WINDOW (size in batch_size, drop_remainder): tf.data window(size, shift, stride) */
    int64_t             shift, stride;          /* >= 1; shift defaults to size */
    /* LM_PAIRS: `feature` (T + 1,) -> input = w[:-1], target = w[1:] */
    char                input_name[LOOM_NAME_MAX], target_name[LOOM_NAME_MAX];
    bool                target_last;            /* LM_PAIRS: target = w[-1] (a scalar: next-token models without sequence outputs) */
} loom_transform_spec;

#define LOOM_PARALLEL_AUTO (-1)

/* split: element p of the pass belongs to the training part when
 * loom_split_u(seed, p) < fraction, else to the eval part; the same
 * (seed, fraction) on the same source gives disjoint parts that cover it. */
enum { LOOM_SPLIT_TRAIN, LOOM_SPLIT_EVAL };

/* How a pipeline built for one of several workers is auto-sharded
 * (tf.data.experimental.AutoShardPolicy, tf_semantics 4.11): FILE splits the
 * source's sorted file list, DATA keeps every num_input_pipelines-th final
 * element, AUTO is FILE when there are at least as many files as pipelines and
 * DATA otherwise, OFF gives every worker everything. */
/* data.<split>.on_nonfinite: a NaN or infinite float value in a source's element */
typedef enum { LOOM_NONFINITE_ERROR, LOOM_NONFINITE_SKIP } loom_on_nonfinite;
typedef enum { LOOM_SHARD_AUTO, LOOM_SHARD_FILE, LOOM_SHARD_DATA, LOOM_SHARD_OFF } loom_shard_policy;

/* data.options (tf.data.Options): one group for data.train and data.eval.
 * A spec built in code without it (present == false) gets no static rewrites,
 * autotuning on and the default budgets. */
typedef struct loom_data_options {
    bool     present;
    loom_loc loc;
    bool     deterministic;             /* default for a map's `deterministic` (true) */
    bool     autotune;                  /* autotune.enabled (true): tune "auto" values while running */
    int      cpu_budget;                /* autotune.cpu_budget: threads for tuned parallelism; 0 = the cores */
    int64_t  ram_budget;                /* autotune.ram_budget in bytes; 0 = ram_fraction of physical memory */
    double   ram_fraction;              /* (0, 1], default 0.5 (tf.data's kRamBudgetShare) */
    bool     noop_elimination;          /* optimization.*: tf.data's defaults where they pay here */
    bool     map_and_batch_fusion;
    bool     map_fusion;
    bool     shuffle_and_repeat_fusion;
    bool     map_parallelization;
    bool     inject_prefetch;
} loom_data_options;

typedef struct loom_dataset_spec {
    bool                present;
    loom_loc            loc;
    loom_source_spec    source;
    int                 n_transforms;
    loom_transform_spec transform[LOOM_MAX_TRANSFORMS];
    loom_shard_policy   shard_policy;   /* default auto; applies only with several input pipelines */
    loom_on_nonfinite   on_nonfinite;   /* default error; copied to source.on_nonfinite */
    loom_data_options   options;        /* data.options, the same for train and eval */
} loom_dataset_spec;

/* ---- model --------------------------------------------------------------- */

typedef enum { LOOM_LAYER_DENSE, LOOM_LAYER_CONV2D, LOOM_LAYER_MAX_POOL2D, LOOM_LAYER_DROPOUT, LOOM_LAYER_FLATTEN,
               LOOM_LAYER_ACTIVATION, LOOM_LAYER_BATCH_NORM, LOOM_LAYER_LAYER_NORM, LOOM_LAYER_AVG_POOL2D,
               LOOM_LAYER_GLOBAL_AVG_POOL2D, LOOM_LAYER_EMBEDDING,
               /* appended (issue 23): Keras's layers of those names */
               LOOM_LAYER_ZERO_PADDING2D, LOOM_LAYER_GLOBAL_MAX_POOL2D, LOOM_LAYER_RESHAPE, LOOM_LAYER_UPSAMPLING2D,
               LOOM_LAYER_DEPTHWISE_CONV2D, LOOM_LAYER_SEPARABLE_CONV2D, LOOM_LAYER_CONV2D_TRANSPOSE,
               LOOM_LAYER_CONV1D,
               /* merge layers (several inputs, Keras' merging layers) */
               LOOM_LAYER_ADD, LOOM_LAYER_SUBTRACT, LOOM_LAYER_MULTIPLY, LOOM_LAYER_AVERAGE, LOOM_LAYER_MAXIMUM,
               LOOM_LAYER_CONCATENATE,
               /* appended (issue 24): recurrent layers (appliance/nn/recurrent.c) */
               LOOM_LAYER_LSTM, LOOM_LAYER_GRU, LOOM_LAYER_BIDIRECTIONAL,
               /* sequence layers (issue 24, attention.c); transformer_block expands at load into its parts */
               LOOM_LAYER_MULTI_HEAD_ATTENTION, LOOM_LAYER_POSITIONAL_EMBEDDING, LOOM_LAYER_TRANSFORMER_BLOCK,
               /* appended: a plugin's layer kind, `type` naming it (loom_layer_spec.plugin) */
               LOOM_LAYER_PLUGIN } loom_layer_kind;
/* inputs of one layer (merge layers take 2 or more), and model.inputs */
#define LOOM_MAX_LAYER_INPUTS 8
#define LOOM_MAX_MODEL_INPUTS 8
/* model.outputs: output heads (head 0 is the model's output, its last layer) */
#define LOOM_MAX_HEADS 8
typedef enum { LOOM_POS_LEARNED, LOOM_POS_SINUSOIDAL } loom_pos_mode;
typedef enum { LOOM_COMBINER_SUM, LOOM_COMBINER_MEAN } loom_combiner;
/* leaky_relu and gelu only as activation layers (their gradients need the input); swish, hard_swish,
 * softplus and elu (Keras's definitions) also on the layers that take an activation. silu is swish's
 * other name: the config reads it as swish (it never reaches a model). */
typedef enum { LOOM_ACT_NONE, LOOM_ACT_RELU, LOOM_ACT_SIGMOID, LOOM_ACT_TANH, LOOM_ACT_SOFTMAX, LOOM_ACT_LEAKY_RELU,
               LOOM_ACT_GELU, LOOM_ACT_SWISH, LOOM_ACT_HARD_SWISH, LOOM_ACT_SOFTPLUS, LOOM_ACT_ELU,
               LOOM_ACT_SILU } loom_activation;
typedef enum { LOOM_INIT_GLOROT_UNIFORM, LOOM_INIT_GLOROT_NORMAL, LOOM_INIT_HE_UNIFORM, LOOM_INIT_HE_NORMAL,
               LOOM_INIT_ZEROS, LOOM_INIT_ORTHOGONAL } loom_init;
typedef enum { LOOM_PAD_VALID, LOOM_PAD_SAME, LOOM_PAD_CAUSAL /* conv1d only */ } loom_padding;
/* conv2d: the kernels it may take; auto: the fastest the shape and CPU allow (docs/config.md) */
typedef enum { LOOM_CONV_AUTO, LOOM_CONV_DIRECT, LOOM_CONV_WINOGRAD } loom_conv_algorithm;
typedef enum { LOOM_LOSS_SPARSE_SOFTMAX_CE, LOOM_LOSS_MSE, LOOM_LOSS_BCE, LOOM_LOSS_MAE, LOOM_LOSS_HUBER } loom_loss_kind;
/* model.metrics: Keras' metrics of those names (see nn.h for each one's definition) */
typedef enum { LOOM_METRIC_ACCURACY, LOOM_METRIC_AUC, LOOM_METRIC_PRECISION, LOOM_METRIC_RECALL,
               LOOM_METRIC_TOP_K_ACCURACY, LOOM_METRIC_MAE, LOOM_METRIC_RMSE, LOOM_METRIC_PERPLEXITY,
               LOOM_NMETRICS_ } loom_metric_kind;
#define LOOM_MAX_METRICS       LOOM_NMETRICS_
#define LOOM_MAX_CLASS_WEIGHTS 256

typedef struct loom_layer_spec {
    loom_layer_kind kind;
    loom_loc        loc;
    char            name[LOOM_NAME_MAX]; /* default "<kind>_<index>", e.g. "dense_1" */
    loom_activation activation;          /* dense, conv2d (default none); activation layer */
    int             units;               /* dense */
    int             filters;             /* conv2d */
    int             kernel[2];           /* conv2d (h, w); kernel_size = 5 or [5, 5] */
    int             stride[2];           /* conv2d, max_pool2d; default 1 (conv) or pool size */
    int             pool[2];             /* max_pool2d; default 2 */
    loom_padding    padding;             /* conv2d, max_pool2d; default valid */
    double          rate;                /* dropout, [0, 1) */
    /* ---- appended ---- */
    double          alpha;               /* activation leaky_relu: slope below 0, default 0.3 (Keras LeakyReLU) */
    double          momentum;            /* batch_normalization: of the moving statistics, default 0.99 */
    double          epsilon;             /* batch_ and layer_normalization: default 0.001 (Keras) */
    loom_init       kernel_init;         /* default glorot_uniform (he_normal is common for relu) */
    bool            use_bias;            /* default true; biases start at zero */
    /* embedding: a table (input_dim, output_dim) looked up by integer ids
     * (the model input, int32 or int64); see nn.h for the shapes */
    int64_t         input_dim;           /* rows of the table */
    int             output_dim;          /* columns: the embedding width */
    loom_combiner   combiner;            /* several ids per column: sum (default) or mean */
    /* batch_normalization: the batch statistics over the global batch of
     * every replica (and worker) in sync, as TF's SyncBatchNormalization;
     * a no-op for one_device and parameter_server (nn.h: loom_model_set_bn_sync) */
    bool            sync;
    /* ---- appended (issue 23) ---- */
    int             dilation[2];         /* conv2d, depthwise_, separable_conv2d, conv2d_transpose, conv1d ([1]); default 1 */
    int             groups;              /* conv2d, conv1d: filters and input channels split in groups; default 1 */
    loom_conv_algorithm algorithm;       /* conv2d: auto (default), direct (no Winograd) or winograd */
    int             depth_multiplier;    /* depthwise_ and separable_conv2d: outputs per input channel; default 1 */
    int             pad[4];              /* zero_padding2d: top, bottom, left, right */
    int             size[2];             /* upsampling2d: (h, w) repeats, default 2 */
    int             n_target;            /* reshape: target_shape's rank (1 to 3) */
    int64_t         target[3];           /* reshape: its dims, one may be -1 */
    /* ---- the graph (appended) ---- */
    int             n_inputs;            /* 0: the previous layer (the first layer: the model input) */
    char            inputs[LOOM_MAX_LAYER_INPUTS][LOOM_NAME_MAX]; /* layer names or model inputs (features) */
    int             axis;                /* concatenate: the axis, counting the batch as 0; default -1 (the last) */
    /* ---- a plugin's layer kind (appended) ---- */
    char            plugin[LOOM_NAME_MAX]; /* the registered layer type (kind LOOM_LAYER_PLUGIN) */
    loom_plugin_opts settings;             /* its keys other than type, name and inputs, as text */
    /* ---- sequences (appended, issue 24) ---- */
    bool            mask_zero;           /* embedding: id 0 is padding; its time steps are masked below (nn.h) */
    bool            return_sequences;    /* lstm, gru, bidirectional: output (T, units) rather than the last step's */
    loom_init       recurrent_init;      /* lstm, gru: the recurrent kernel's initialiser; default orthogonal (Keras) */
    bool            unit_forget_bias;    /* lstm: the forget gate's bias starts at 1 (Keras' default, Jozefowicz 2015) */
    bool            reset_after;         /* gru: the reset gate after the recurrent product (Keras 2, cuDNN); default true */
    loom_activation recurrent_activation; /* lstm, gru: the gates' activation, default sigmoid */
    int             cell;                /* bidirectional: `layer`, 0 lstm, 1 gru */
    int             merge_mode;          /* bidirectional: 0 concat, 1 sum */
    /* ---- sequence layers (appended, issue 24) ---- */
    int             num_heads;           /* multi_head_attention, transformer_block */
    int             key_dim;             /* per head: query and key width */
    int             value_dim;           /* per head; 0: key_dim */
    bool            causal;              /* multi_head_attention: query t attends to keys <= t */
    int             max_length;          /* positional_embedding: the longest sequence */
    loom_pos_mode   pos_mode;            /* positional_embedding: learned (a trained table) or sinusoidal (fixed) */
    int             ff_dim;              /* transformer_block: the feed-forward's hidden width */
    bool            norm_first;          /* transformer_block: pre-norm (GPT-2) rather than post-norm (Vaswani) */
    /* ---- final states (appended, issue 24) ---- */
    bool            return_state;        /* lstm, gru: the final h (and lstm's c) as the layers "<name>/h", "<name>/c" */
    int             state_of;            /* made at load: 1 the h, 2 the c of the lstm or gru named in inputs[0] */
} loom_layer_spec;

typedef struct loom_model_spec {
    loom_loc        loc;
    char            input[LOOM_NAME_MAX]; /* feature fed to the first layer, default "image" */
    char            label[LOOM_NAME_MAX]; /* feature holding the target, default "label" */
    loom_loss_kind  loss;                 /* default sparse_softmax_cross_entropy */
    int             n_layers;
    /* ---- metrics and weights (appended) ---- */
    bool             metrics_set;         /* model.metrics given; else accuracy for a classification, none for a regression */
    int              n_metrics;
    loom_metric_kind metric[LOOM_MAX_METRICS];
    loom_loc         metrics_loc;         /* of model.metrics (or the model block) */
    int              auc_thresholds;      /* auc: num_thresholds, default 200 (Keras) */
    bool             multi_label;         /* auc: one curve per output, averaged (Keras multi_label) */
    int              top_k;               /* top_k_accuracy: k, default 5 */
    double           huber_delta;         /* huber: delta, default 1.0 */
    int              n_class_weights;     /* 0: none; else one weight per class (binary: [negative, positive]) */
    float            class_weight[LOOM_MAX_CLASS_WEIGHTS];
    char             sample_weight[LOOM_NAME_MAX]; /* feature of per-example loss weights; "" = none */
    double           l2;                  /* kernel_regularizer l2: loss += l2 * sum(kernel^2), every dense and conv kernel */
    loom_layer_spec layer[LOOM_MAX_LAYERS];
    /* ---- the graph (appended) ---- */
    int             n_inputs;             /* model.inputs given: the features fed to the model; 0: model.input alone */
    char            inputs[LOOM_MAX_MODEL_INPUTS][LOOM_NAME_MAX];
    /* ---- output heads (appended; model.outputs) ---- */
    int             n_heads;              /* 0: one output, the last layer, with model.label and model.loss */
    struct loom_head_spec {
        char           layer[LOOM_NAME_MAX]; /* the layer whose output the head is; head 0's is the last layer */
        char           label[LOOM_NAME_MAX]; /* the feature holding its target */
        loom_loss_kind loss;
        double         weight;               /* its loss's weight in the total (Keras' loss_weights), default 1 */
        loom_loc       loc;
        bool           accuracy;             /* heads 1..: report <layer>_accuracy (their one metric) */
    } head[LOOM_MAX_HEADS];
    /* ---- sequences (appended, issue 24) ---- */
    int64_t         ignore_label;         /* per-token sparse_softmax_cross_entropy: labels equal to it are masked (default -100, torch's ignore_index) */
} loom_model_spec;

/* ---- optimizer ----------------------------------------------------------- */

typedef enum { LOOM_OPT_SGD, LOOM_OPT_MOMENTUM, LOOM_OPT_ADAM, LOOM_OPT_ADAMW, LOOM_OPT_RMSPROP,
               LOOM_OPT_ADAGRAD } loom_opt_kind;
typedef enum { LOOM_SCHED_CONSTANT, LOOM_SCHED_EXPONENTIAL_DECAY, LOOM_SCHED_PIECEWISE_CONSTANT,
               LOOM_SCHED_COSINE } loom_sched_kind;

typedef struct loom_schedule_spec {
    loom_sched_kind kind;
    loom_loc        loc;
    int64_t decay_steps;   /* exponential_decay, cosine (>= 1) */
    double  decay_rate;    /* exponential_decay: lr * rate^(step / decay_steps) */
    bool    staircase;     /* exponential_decay: integer division */
    double  alpha;         /* cosine: floor as a fraction of lr, default 0 */
    int     n_boundaries;  /* piecewise_constant: values has n_boundaries + 1 entries */
    int64_t boundaries[LOOM_MAX_BOUNDARIES];
    double  values[LOOM_MAX_BOUNDARIES + 1];
} loom_schedule_spec;

typedef struct loom_optimizer_spec {
    loom_opt_kind      kind;
    loom_loc           loc;
    double             learning_rate; /* > 0 */
    double             momentum;      /* momentum: [0, 1), default 0.9 */
    bool               nesterov;      /* momentum */
    double             beta1, beta2, epsilon; /* adam: 0.9, 0.999, 1e-7 (Keras defaults); adagrad: epsilon */
    double             weight_decay;  /* adamw: decoupled, p -= lr wd p (Keras AdamW, default 0.004) */
    double             rho;           /* rmsprop: 0.9 (Keras) */
    double             clip_norm;     /* > 0: gradients scaled to this global norm at most (tf.clip_by_global_norm) */
    double             initial_accumulator; /* adagrad: the accumulator's start, default 0.1 (Keras) */
    loom_schedule_spec schedule;
} loom_optimizer_spec;

/* ---- strategy ------------------------------------------------------------ */

typedef enum { LOOM_STRAT_ONE_DEVICE, LOOM_STRAT_MIRRORED, LOOM_STRAT_CENTRAL_STORAGE,
               LOOM_STRAT_MULTI_WORKER_MIRRORED, LOOM_STRAT_PARAMETER_SERVER,
               LOOM_STRAT_PLUGIN /* any other type: a plugin's strategy, found by `name` once plugins are loaded */
} loom_strategy_kind;

#define LOOM_MAX_STRATEGY_OPTIONS 16

/* multi_worker_mirrored: how gradients cross workers (tf CommunicationImplementation). */
typedef enum { LOOM_COMM_AUTO, LOOM_COMM_RING, LOOM_COMM_NCCL, LOOM_COMM_MPI } loom_communication;
const char *loom_communication_name(loom_communication c); /* "ring" */
/* multi_worker_mirrored: the gradients' wire format across workers (16-bit, summed in float32 at each hop) */
typedef enum { LOOM_COMPRESS_NONE, LOOM_COMPRESS_BF16, LOOM_COMPRESS_FP16 } loom_grad_compression;
/* strategy.num_packs when compression is set and neither num_packs nor
 * bytes_per_pack is: the packs' all-reduces overlap the backward pass */
#define LOOM_COMPRESS_NUM_PACKS 8
const char *loom_grad_compression_name(loom_grad_compression c); /* "bf16" */

/* parameter_server: strategy.variable_partitioner = { type = ...; ... } */
typedef enum { LOOM_PARTITIONER_NONE, LOOM_PARTITIONER_FIXED, LOOM_PARTITIONER_MIN_SIZE, LOOM_PARTITIONER_MAX_SIZE } loom_partitioner_kind;
typedef struct loom_partitioner_spec {
    loom_partitioner_kind kind;       /* NONE: whole variables */
    loom_loc              loc;
    int64_t               num_shards;      /* fixed: >= 1 */
    int64_t               min_shard_bytes; /* min_size: default 256 KiB */
    int64_t               max_shard_bytes; /* max_size: required */
    int64_t               max_shards;      /* min_size: default 1; max_size: 0 = no cap */
} loom_partitioner_spec;
/* parameter_server: strategy.sync = { replicas_to_aggregate = N; total_replicas = M; } */
typedef struct loom_ps_sync_spec {
    bool     enabled;
    loom_loc loc;
    int      replicas_to_aggregate; /* N >= 1 */
    int      total_replicas;        /* M >= N; 0 = the number of workers */
} loom_ps_sync_spec;
const char *loom_partitioner_name(loom_partitioner_kind k); /* "fixed" */

/* multi_worker_mirrored: strategy.elastic = { min_workers; max_workers; }:
 * a lost worker is dropped at the next step boundary and the survivors go
 * on (distribute/elastic.c); below min_workers the job stops with a checkpoint. */
typedef struct loom_elastic_spec {
    bool     enabled;
    loom_loc loc;
    int      min_workers; /* >= 1 */
    int      max_workers; /* >= min_workers; 0 = the cluster's training tasks */
    double   wait_timeout; /* below min_workers: seconds the job waits for workers to join (default 60) */
    double   start_timeout; /* s the start waits for every listed task before it goes on with those there (10) */
} loom_elastic_spec;

typedef struct loom_strategy_spec {
    loom_strategy_kind kind;
    loom_loc           loc;
    char               device[16];  /* one_device: "cpu:0" or "gpu:N" */
    loom_loc           device_loc;  /* one_device: strategy.device (or the strategy), for later errors */
    /* one_device, mirrored, central_storage: the device backend (tensor/device.h)
     * that runs the replicas: "" = nn's native host code for cpu devices and
     * "cuda" for gpu devices; "cpu" = the built-in CPU reference backend (to
     * test the device path); else a plugin's. Checked at strategy open, where
     * plugins are known. */
    char               device_backend[LOOM_NAME_MAX];
    loom_loc           device_backend_loc;
    /* mirrored, central_storage: strategy.replicas = N (devices cpu:0..cpu:N-1,
     * which may outnumber the cores) or strategy.devices = ["cpu:0", ...]
     * (each must exist: checked at strategy open); neither = one per core:
     * replicas = 0 and n_devices = 0 until the strategy resolves them. */
    int                replicas;
    int                n_devices;
    char               devices[LOOM_MAX_DEVICES][16]; /* "cpu:N", "gpu:N" or "gpu:*" */
    bool               devices_listed;                /* they came from strategy.devices */
    loom_loc           devices_loc;                   /* strategy.devices or .replicas, for later errors */
    char               cross_device_ops[LOOM_NAME_MAX]; /* mirrored: a registered op; "" = the default */
    loom_loc           cross_device_ops_loc;          /* checked at strategy open, where plugins are known */
    /* mirrored: gradient packing (tf_semantics 5.5, 5.7; loom_pack_plan in distribute.h) */
    int64_t            bytes_per_pack; /* > 0: packs of at least this many bytes, last layers first; 0 = unset */
    int                num_packs;      /* with bytes_per_pack = 0: 1 (default) one pack, N equal packs, 0 per tensor */
    double             collective_timeout; /* s a replica waits in a collective (loom_xcomm_set_timeouts); 0 = forever */
    char               name[LOOM_NAME_MAX]; /* `type` as written, for every kind: the registry's name */
    /* plugin strategies: strategy.options = { KEY = value; ... }, scalars kept as
     * text (strings unquoted); the plugin declares and parses its keys */
    int                n_options;
    char               option_key[LOOM_MAX_STRATEGY_OPTIONS][LOOM_NAME_MAX];
    char               option_value[LOOM_MAX_STRATEGY_OPTIONS][LOOM_NAME_MAX];
    int                option_line[LOOM_MAX_STRATEGY_OPTIONS]; /* in loc.file; 0 for --set */
    /* multi_worker_mirrored: the reduction across workers ("auto" = the ring on CPU) */
    loom_communication communication;
    loom_loc           communication_loc;
    /* multi_worker_mirrored over the ring: gradients cross the workers as bf16/fp16
     * (the step's loss and counts stay float32); error feedback keeps each
     * worker's rounding error and adds it to the next step's gradients */
    loom_grad_compression   compression;
    bool               compression_error_feedback;
    loom_loc           compression_loc;
    loom_loc           collective_timeout_loc; /* (the strategy's own loc when it is not set) */
    /* parameter_server: how variables are split along axis 0 over the ps
     * tasks (tf.distribute.experimental.partitioners; none = whole variables
     * round-robin), and synchronous updates (SyncReplicasOptimizer) */
    loom_partitioner_spec partitioner;
    loom_ps_sync_spec     sync;
    loom_elastic_spec     elastic; /* multi_worker_mirrored */
} loom_strategy_spec;

/* ---- plugins ------------------------------------------------------------- */

#define LOOM_MAX_PLUGIN_DIRS     8
#define LOOM_MAX_PLUGIN_REQUIRES 16

/* plugins = { path = ["dir", ...]; require = ["name", ...]; }; */
typedef struct loom_plugins_spec {
    loom_loc loc;                                        /* the plugins group (or the file) */
    int      n_path;                                     /* directories searched for *.so, in order */
    char     path[LOOM_MAX_PLUGIN_DIRS][LOOM_PATH_MAX];  /* resolved against the config's directory */
    int      n_require;                                  /* plugins that must load, by their declared name */
    char     require[LOOM_MAX_PLUGIN_REQUIRES][LOOM_NAME_MAX];
    int      require_line[LOOM_MAX_PLUGIN_REQUIRES];     /* in loc.file; 0 for --set */
} loom_plugins_spec;

/* ---- run ----------------------------------------------------------------- */

typedef enum { LOOM_PROGRESS_AUTO, LOOM_PROGRESS_BAR, LOOM_PROGRESS_PLAIN, LOOM_PROGRESS_NONE } loom_progress;

typedef struct loom_run_spec {
    loom_loc      loc;
    char          model_dir[LOOM_PATH_MAX]; /* a relative one resolved against the config file's directory at load */
    int64_t       epochs;           /* >= 1 unless max_steps is set; default 1 */
    int64_t       max_steps;        /* 0 = unset: train for `epochs` */
    uint64_t      seed;             /* default 42 */
    int64_t       checkpoint_steps; /* 0 = only at epoch ends and at the end */
    double        checkpoint_secs;  /* also when this many seconds passed since the last one; 0 = off */
    int64_t       summary_steps;    /* TensorBoard scalars every N steps; 0 = no event files; default 100 */
    int64_t       histogram_epochs; /* histograms of every variable every N epochs; 0 = off (default) */
    int           keep_checkpoints; /* default 5 */
    int64_t       log_steps;        /* default 100 */
    int           threads;          /* compute threads; 0 = all cores */
    int64_t       steps_per_execution; /* training steps per trip through the host loop; default 1 */
    int64_t       eval_steps;       /* evaluate at most this many batches; 0 = the whole eval set */
    bool          eval_each_epoch;  /* default true when data.eval is present */
    loom_progress progress;
    int           status_port;      /* HTTP status endpoint (/metrics, /healthz, /status); 0 = off */
    char          status_bind[64];  /* its address, an IPv4 or IPv6 literal; default "127.0.0.1" */
} loom_run_spec;

/* ---- hooks (Lua) --------------------------------------------------------- */

#define LOOM_MAX_CALLBACKS 8
#define LOOM_MAX_HOOK_ARGS 16

/* A Lua function named "file.lua:function" (the file relative to the config's
 * directory), with arguments from the config: a string, or a group
 * { fn = "file.lua:function"; args = { name = value; ... }; } whose values are
 * numbers, strings or booleans. The file is checked to exist at load; the
 * function is looked up when the hooks are opened (loom check does). */
typedef struct loom_hook_ref {
    loom_loc loc;
    char     ref[LOOM_PATH_MAX + LOOM_NAME_MAX]; /* as written */
    int      n_args;
    char     arg_name[LOOM_MAX_HOOK_ARGS][LOOM_NAME_MAX];
    int      arg_type[LOOM_MAX_HOOK_ARGS];   /* LOOM_HOOK_ARG_* */
    double   arg_num[LOOM_MAX_HOOK_ARGS];
    char     arg_str[LOOM_MAX_HOOK_ARGS][LOOM_NAME_MAX];
} loom_hook_ref;
enum { LOOM_HOOK_ARG_NUMBER, LOOM_HOOK_ARG_INT, LOOM_HOOK_ARG_STRING, LOOM_HOOK_ARG_BOOL };

typedef struct loom_hooks_spec {
    bool          present;
    loom_loc      loc;
    int           n_callbacks;   /* each names a factory: fn(args) returns a table of callbacks */
    loom_hook_ref callback[LOOM_MAX_CALLBACKS];
    bool          has_train_step;
    loom_hook_ref train_step;    /* train_step(ctx, batch, args) replaces the built-in step */
    int64_t       step_interval; /* on_step_end every N steps (default 1); a callback table may set its own */
    bool          unsafe;            /* the whole standard library, file writes anywhere */
    int64_t       memory_limit;      /* bytes per Lua state; 0 = the default */
    int64_t       instruction_limit; /* VM instructions per call; 0 = the default */
} loom_hooks_spec;

/* ---- cluster ------------------------------------------------------------- */

/* cluster: { chief = ["h0:2222"]; worker = ["h1:2222", "h2:2222"]; ps = [...]; evaluator = [...];
 *            connect_timeout = 60.0; heartbeat_timeout = 30.0; secret_file = "secret"; ... };
 * The role lists are TensorFlow's ClusterSpec; roles are indexed as
 * loom_role in cluster/cluster.h: chief, worker, ps, evaluator. Addresses are
 * checked for syntax ("host:port", "[v6]:port") and duplicates here; names
 * are resolved only when the transport opens. Which task this process plays,
 * and addresses from TF_CONFIG or Slurm, are resolved by loom_cluster_resolve. */
#define LOOM_CLUSTER_ROLES     4
#define LOOM_MAX_CLUSTER_TASKS 64  /* per role */
#define LOOM_ADDR_MAX          272 /* "host:port": a 255-byte name, brackets, the port */

typedef struct loom_cluster_spec {
    bool     present;                   /* the config (or --set cluster.*) has a cluster section */
    loom_loc loc;                       /* the section (or the file) */
    int      n_tasks[LOOM_CLUSTER_ROLES];
    char     addr[LOOM_CLUSTER_ROLES][LOOM_MAX_CLUSTER_TASKS][LOOM_ADDR_MAX]; /* "host:port" as written */
    int      addr_line[LOOM_CLUSTER_ROLES][LOOM_MAX_CLUSTER_TASKS];           /* in loc.file; 0 for --set */
    loom_loc role_loc[LOOM_CLUSTER_ROLES];                                    /* each list, for later errors */
    double   connect_timeout;           /* s, > 0; default 60 */
    double   heartbeat_timeout;         /* s, > 0; default 30 */
    double   heartbeat_interval;        /* s, > 0; 0 (default) = heartbeat_timeout / 5 */
    char     secret_file[LOOM_PATH_MAX];/* resolved against the config's directory; "" = none */
    bool     tls;                       /* TLS on every connection (libevent's OpenSSL bufferevents) */
    char     tls_cert[LOOM_PATH_MAX], tls_key[LOOM_PATH_MAX], tls_ca[LOOM_PATH_MAX]; /* resolved like secret_file */
    bool     insecure;                  /* allow non-loopback addresses without a secret */
    int      port_base;                 /* Slurm: task k of a node listens on port_base + k; default 8888 */
} loom_cluster_spec;

/* "chief", "worker", "ps", "evaluator": the cluster section's role keys. */
extern const char *const loom_cluster_role_keys[LOOM_CLUSTER_ROLES + 1];
/* Splits "host:port" or "[v6addr]:port" into host (brackets removed; n
 * bytes) and port, checking the syntax only (a name is not looked up).
 * Returns 0, or -1 with *why (static text) saying what is wrong. */
int loom_addr_parse(const char *addr, char *host, size_t n, int *port, const char **why);

/* ---- the whole config ---------------------------------------------------- */

typedef struct loom_spec {
    char                path[LOOM_PATH_MAX]; /* the config file */
    int                 version;             /* 1 */
    loom_dataset_spec   train, eval;         /* data.train required; data.eval optional */
    loom_model_spec     model;
    loom_optimizer_spec optimizer;
    loom_strategy_spec  strategy;
    loom_run_spec       run;
    loom_plugins_spec   plugins;
    loom_hooks_spec     hooks;
    loom_cluster_spec   cluster;
} loom_spec;

/* Up to LOOM_MAX_ERRORS problems are collected before giving up. */
#define LOOM_MAX_ERRORS 20
typedef struct loom_errlist {
    int      n;
    loom_err e[LOOM_MAX_ERRORS];
} loom_errlist;

/* Loads and validates path, applying overrides ("run.epochs=2",
 * "strategy.type=one_device"; values in libconfig syntax, quotes optional for
 * strings) on top of the file with the same validation. On failure returns
 * LOOM_ECONFIG (or LOOM_EIO for an unreadable file) with every problem in
 * errs. *out is freed with loom_config_free. */
int  loom_config_load(loom_spec **out, const char *path, const char *const *overrides, int n_overrides,
                      loom_errlist *errs);
void loom_config_free(loom_spec *s); /* NULL is a no-op */

/* What training, evaluation and prediction need of a loaded spec beyond what
 * loom_config_load checks (a pipeline run alone, as `loom profile` and
 * `loom records convert --config` run data.train, needs none of it):
 * data.train, and data.eval when declared, end in batches. The commands that
 * build a model call it right after loading, so the error comes before any
 * pipeline, plugin or task starts. Appends each problem to errs (at the
 * dataset's file:line); returns LOOM_ECONFIG if there was one. */
int loom_config_check_training(const loom_spec *spec, loom_errlist *errs);

/* Prints the fully resolved config, defaults filled in, in libconfig syntax
 * that loom_config_load reads back to an equal spec. */
void loom_config_print(const loom_spec *s, FILE *f);

/* The first layer of ms that makes it a graph rather than a chain (inputs
 * other than the previous layer, or a merge layer; layer 0 with several
 * model inputs), or -1 for a plain stack of layers. */
int loom_model_spec_graph_layer(const loom_model_spec *ms);

/* Names, for messages and printing. */
const char *loom_layer_kind_name(loom_layer_kind k);
const char *loom_activation_name(loom_activation a);
const char *loom_metric_name(loom_metric_kind k); /* "auc" */
const char *loom_loss_name(loom_loss_kind k);     /* "binary_cross_entropy" */
const char *loom_strategy_kind_name(loom_strategy_kind k);
const char *loom_tok_mode_name(loom_tok_mode m);  /* "bytes", ... */
const char *loom_tok_std_name(loom_tok_std m);    /* "none", ... */
const char *loom_map_kind_name(loom_map_kind k);
const char *loom_transform_kind_name(loom_transform_kind k);

#endif
