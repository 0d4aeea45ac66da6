/* records.h - TFRecord files (read and write; uncompressed, GZIP, ZLIB and
 * our ZSTD extension) and the tf.train.Example codec (tf_semantics §1).
 * Private to the project: included by data.h; not yet wired into configs.
 * Threads: a reader, writer, loom_example or builder belongs to one thread at
 * a time; nothing here keeps global state.
 * Ownership: pointers handed out by a reader are borrowed until its next
 * call; a parsed loom_example borrows the serialized bytes it was parsed from. */
#ifndef LOOM_DATA_RECORDS_H
#define LOOM_DATA_RECORDS_H

#include "config/config.h" /* LOOM_PATH_MAX */
#include "core/core.h"
#include "tensor/tensor.h"
#include <stdbool.h>

/* ---- compression --------------------------------------------------------- */

/* The whole stream is compressed (framing and CRCs live inside it). AUTO is
 * for readers only: detect from the leading bytes (see loom_tfrecord_open). */
typedef enum {
    LOOM_COMP_NONE,
    LOOM_COMP_GZIP,
    LOOM_COMP_ZLIB,
    LOOM_COMP_ZSTD, /* EXT: not readable by stock TensorFlow */
    LOOM_COMP_AUTO
} loom_compression;

/* Exact names: "" / "NONE" / "GZIP" / "ZLIB" / "ZSTD" / "AUTO" or the same in
 * lowercase. Unknown names are LOOM_ECONFIG (TF would silently read such a
 * file as uncompressed; we refuse). */
int loom_compression_parse(const char *name, loom_compression *out, loom_err *err);
const char *loom_compression_name(loom_compression c); /* "NONE", "GZIP", ... */

/* ---- reader -------------------------------------------------------------- */

/* What to do with a bad record.
 *  ERROR: a corrupt length CRC, payload CRC, truncated record or corrupt
 *         compressed stream is LOOM_EDATA naming the file and the byte offset
 *         of the record in the uncompressed stream.
 *  SKIP:  a record whose payload CRC fails is skipped (its length is trusted,
 *         having passed the length CRC) and reading goes on. Anything that
 *         loses the framing (length CRC mismatch, truncated record, corrupt
 *         compressed stream) cannot be resynchronised: it counts as one bad
 *         record and ends the file (LOOM_EEOF) with a warning. */
typedef enum { LOOM_CORRUPT_ERROR, LOOM_CORRUPT_SKIP } loom_on_corrupt;

typedef struct loom_tfrecord loom_tfrecord; /* opaque */

/* Opens path for reading; free with loom_tfrecord_close. Reads in 256 KiB
 * chunks and decompresses as it goes into a window (1 MiB, larger only for a
 * larger record), never the whole file at once; records are handed out where
 * they lie in the window.
 * AUTO detection: a file whose first 12 bytes form a valid plain record
 * header is uncompressed; else 1f 8b is GZIP, 28 b5 2f fd is ZSTD, and a
 * valid zlib header (CMF 0x78, (CMF*256+FLG) % 31 == 0) is ZLIB; anything else
 * is read as uncompressed (and fails at offset 0). A declared compression
 * whose magic does not match the file is LOOM_EDATA ("declared ZSTD but
 * starts with the gzip magic 1f 8b"). An empty file has zero records. */
int  loom_tfrecord_open(loom_tfrecord **out, const char *path, loom_compression c,
                        loom_on_corrupt on_corrupt, loom_err *err);
/* The next record's payload, borrowed until the next call; LOOM_EEOF at the
 * clean end of the file. */
int  loom_tfrecord_next(loom_tfrecord *r, const uint8_t **data, size_t *len, loom_err *err);
/* Byte offset, in the uncompressed stream, of the next record to read. */
uint64_t loom_tfrecord_offset(const loom_tfrecord *r);
/* Records read so far, and bad records skipped (SKIP mode). */
int64_t  loom_tfrecord_count(const loom_tfrecord *r);
int64_t  loom_tfrecord_skipped(const loom_tfrecord *r);
/* The compression in use (after AUTO detection). */
loom_compression loom_tfrecord_compression(const loom_tfrecord *r);
/* Decompress-ahead (compressed files only; a no-op on plain ones): on, a
 * thread of the reader's own decompresses the stream ahead of the records
 * being read, into a ring of loom_tfrecord_ahead_bytes() (allocated at the
 * first call, freed by close), so decompression and record parsing run on
 * two cores. Records, offsets, counts and errors are exactly those of
 * reading without it (an error the thread meets is reported when the reader
 * reaches it, naming the record as inline). Off stops the thread (what it
 * decompressed is read first). LOOM_ENOMEM when neither memory nor a thread
 * can be had: the reader goes on inline. */
int  loom_tfrecord_set_ahead(loom_tfrecord *r, bool on, loom_err *err);
size_t loom_tfrecord_ahead_bytes(void);
void loom_tfrecord_close(loom_tfrecord *r); /* NULL is a no-op */

/* ---- writer -------------------------------------------------------------- */

typedef struct loom_tfrecord_writer loom_tfrecord_writer; /* opaque */

/* Writes to "<path>.tmp"; loom_tfrecord_writer_close finishes the stream,
 * fsyncs and renames it to path. GZIP = deflate level 6 with a gzip wrapper
 * (windowBits 31) as TF writes it, ZLIB = windowBits 15, ZSTD = level 6, raw literals, in frames
 * of 256 KiB of stream bytes that declare their content size (any zstd
 * reader reads the concatenation; ours decompresses such a frame in one call). */
int  loom_tfrecord_writer_open(loom_tfrecord_writer **out, const char *path, loom_compression c,
                               loom_err *err);
int  loom_tfrecord_writer_write(loom_tfrecord_writer *w, const void *data, size_t len, loom_err *err);
/* Commits the file and frees w (also on failure, which leaves no file at
 * path and removes the .tmp). */
int  loom_tfrecord_writer_close(loom_tfrecord_writer *w, loom_err *err);
/* Discards: removes the .tmp and frees w. NULL is a no-op. */
void loom_tfrecord_writer_abort(loom_tfrecord_writer *w);

/* ---- tf.train.Example: decoding ------------------------------------------ */

typedef enum {
    LOOM_FEATURE_NONE,  /* a Feature with no kind set: treated as missing */
    LOOM_FEATURE_BYTES,
    LOOM_FEATURE_FLOAT,
    LOOM_FEATURE_INT64
} loom_feature_kind;

const char *loom_feature_kind_name(loom_feature_kind k); /* "bytes_list", ... */

typedef struct loom_bytes_view {
    const uint8_t *data; /* borrowed from the serialized Example */
    size_t         len;
} loom_bytes_view;

/* One feature of a parsed Example. */
typedef struct loom_example_feature {
    loom_bytes_view   name;        /* the map key, not NUL-terminated */
    loom_feature_kind kind;
    int64_t           count;       /* values in the list (bytes: strings) */
    int64_t           bytes_total; /* bytes_list: sum of the strings' lengths */
    loom_bytes_view   entry_;      /* the map entry, walked again to extract values */
} loom_example_feature;

/* A parsed Example: the features by name, borrowing the serialized bytes.
 * Caller-allocated; init once, parse many times (memory is reused). */
typedef struct loom_example {
    int                   n, cap;
    loom_example_feature *f;
    int32_t              *hash_;   /* open addressing over f, hcap_ slots */
    int                   hcap_;
} loom_example;

void loom_example_init(loom_example *ex);
void loom_example_fini(loom_example *ex);
/* Parses and fully validates one serialized Example (any field order, packed
 * or unpacked lists, duplicate keys: last wins; sub-messages seen twice are
 * merged; unknown fields skipped by wire type). Malformed input is
 * LOOM_EDATA describing what and where (byte offset in the Example). */
int  loom_example_parse(loom_example *ex, const uint8_t *data, size_t len, loom_err *err);
/* Feature by name (NUL-terminated), NULL when absent. Borrowed from ex. */
const loom_example_feature *loom_example_find(const loom_example *ex, const char *name);
/* Copies up to max values of a float_list / int64_list feature into out;
 * returns the number of values copied (the feature must be of that kind). */
int64_t loom_example_floats(const loom_example_feature *f, float *out, int64_t max);
int64_t loom_example_int64s(const loom_example_feature *f, int64_t *out, int64_t max);
/* Views of up to max strings of a bytes_list feature; returns the number. */
int64_t loom_example_bytes(const loom_example_feature *f, loom_bytes_view *out, int64_t max);

/* ---- tf.train.Example: parse spec ---------------------------------------- */

typedef enum {
    LOOM_PARSE_F32,      /* float_list -> float */
    LOOM_PARSE_I64,      /* int64_list -> int64_t */
    LOOM_PARSE_U8_BYTES, /* one bytes value -> its bytes as uint8_t (tf.io.decode_raw) */
    LOOM_PARSE_BYTES     /* bytes_list -> loom_bytes_view per string */
} loom_parse_dtype;

/* One declared feature (tf.io.FixedLenFeature, or with var_len a
 * VarLenFeature densified to a fixed maximum). */
typedef struct loom_feature_spec {
    const char      *name;
    loom_parse_dtype dtype;
    loom_shape       shape;         /* values expected = numel (var_len: the maximum) */
    bool             required;      /* missing -> error; else filled with the default */
    double           default_value; /* fill for a missing numeric feature */
    const void      *default_data;  /* (optional) numel values of the output type, instead */
    bool             var_len;       /* 0..numel values; the rest is pad_value */
    double           pad_value;
} loom_feature_spec;

/* Where one feature goes: caller-owned storage of numel elements of the
 * output type (float, int64_t, uint8_t or loom_bytes_view). */
typedef struct loom_feature_out {
    void   *data;
    int64_t length; /* set: values found (0 when missing and defaulted) */
} loom_feature_out;

/* Extracts n declared features from a parsed Example. A missing required
 * feature, a wrong kind or a wrong number of values is LOOM_EDATA naming the
 * feature, the record index and what was expected vs found. */
int loom_example_extract(const loom_example *ex, const loom_feature_spec *spec, int n,
                         int64_t record, loom_feature_out *out, loom_err *err);
/* The common case without the general parser: Examples written the way TF
 * and Loom write them (one Features message, its entries key then value,
 * each Feature one packed list) whose entries come in the order learned from
 * an earlier record. loom_example_fast_extract walks such a record once,
 * checking every tag, length and key against that order and writing the
 * values straight into out; anything else (another order, a missing or
 * extra feature, unpacked values, a wrong count, damage) makes it return
 * false having decided nothing, and the caller parses and extracts the
 * record the general way (with its exact error messages). When it returns
 * true, out holds exactly what loom_example_parse + loom_example_extract
 * would have written. Zero-initialize (nothing learned: every record goes
 * the general way). Not for LOOM_PARSE_BYTES features. */
typedef struct loom_example_fast {
    int     n;                          /* entries in the learned order; 0: nothing learned */
    int16_t order[LOOM_MAX_FEATURES];   /* the spec index of each entry, in wire order */
    int64_t numel[LOOM_MAX_FEATURES];   /* per spec index: values expected */
    size_t  name_len[LOOM_MAX_FEATURES]; /* per spec index: strlen(name) */
} loom_example_fast;

/* Learns ex's order (ex parsed and extracted with spec without error);
 * false, fp unchanged, when ex does not qualify (an entry not declared or
 * missing, a bytes feature). */
bool loom_example_fast_learn(loom_example_fast *fp, const loom_example *ex, const loom_feature_spec *spec, int n);
bool loom_example_fast_extract(const loom_example_fast *fp, const uint8_t *data, size_t len,
                               const loom_feature_spec *spec, int n, loom_feature_out *out);
/* The tensor dtype of a spec (BYTES has none: LOOM_EUNSUPPORTED), and a
 * zeroed tensor of that dtype and shape (free with loom_tensor_fini). */
int loom_feature_spec_tensor(const loom_feature_spec *s, loom_tensor *t, loom_err *err);

/* ---- tf.train.Example: encoding ------------------------------------------ */

/* Builds one Example from named features, written as TF writes them
 * (packed floats and int64s). Caller-allocated; reset between examples. */
typedef struct loom_example_builder {
    loom_buf body; /* the Features message's map entries */
    loom_buf out;  /* the finished Example */
} loom_example_builder;

void loom_example_builder_init(loom_example_builder *b);
void loom_example_builder_fini(loom_example_builder *b);
void loom_example_builder_reset(loom_example_builder *b);
void loom_example_add_bytes(loom_example_builder *b, const char *name, const loom_bytes_view *v, int64_t n);
void loom_example_add_floats(loom_example_builder *b, const char *name, const float *v, int64_t n);
void loom_example_add_int64s(loom_example_builder *b, const char *name, const int64_t *v, int64_t n);
/* The serialized Example, borrowed until the next call on b; LOOM_ENOMEM if
 * any add ran out of memory. */
int  loom_example_finish(loom_example_builder *b, const uint8_t **data, size_t *len, loom_err *err);

/* ---- conversion into sharded TFRecord files (format/convert.c) ------------ */

#define LOOM_MAX_SHARDS 99999 /* TF's shard names have 5 digits */

/* What `loom records convert` converts: IDX images and labels, a CSV file, or a dataset's source. */
typedef struct loom_convert_opts {
    const char      *images, *labels;    /* IDX files (plain or gzip), both */
    const char      *csv;                /* or a CSV file (plain or gzip) whose first row names the columns */
    const char      *label_column;       /* (optional, CSV) the column stored as the feature "label" */
    const char      *output;             /* shards are OUTPUT-00000-of-0000N.tfrecord[.gz|.zz|.zst] */
    int              shards;             /* 1..LOOM_MAX_SHARDS */
    loom_compression comp;               /* NONE, GZIP, ZLIB or ZSTD */
    /* ---- or a dataset's source (a config's data.train, e.g. synthetic ctr data) ---- */
    const loom_dataset_spec *dataset;    /* its source alone is read (transforms are not applied) */
    uint64_t                 seed;       /* the run's seed, for the source */
    int64_t                  count;      /* > 0: at most this many elements (needed for an infinite source) */
} loom_convert_opts;

/* What a conversion found and wrote; owned, free with loom_convert_result_fini. */
typedef struct loom_convert_result {
    int                ncols, label;  /* CSV: columns once the first pass is done (0 before); label's, or -1 */
    char             **col_name;      /* each column's feature name ("label" for the label column) */
    loom_feature_kind *col_kind;      /* each column's feature kind, inferred from all rows */
    int64_t            rows;          /* CSV: data rows */
    int                shards;
    char             (*path)[LOOM_PATH_MAX]; /* per shard */
    int64_t           *records, *bytes;      /* per shard: records written, the file's size */
    int64_t            total;                /* records */
} loom_convert_result;

/* Converts o's input into o->shards files, contiguously, one tf.train.Example
 * per item (IDX: "image" bytes, "label" int64s) or row (CSV: one feature per
 * column, int64_list, float_list or bytes_list). On failure the shards
 * written are removed; res holds what was found (the CSV columns). Errors
 * name file:line; LOOM_EUSAGE for an option that cannot apply. */
int  loom_records_convert(const loom_convert_opts *o, loom_convert_result *res, loom_err *err);
void loom_convert_result_fini(loom_convert_result *res);

#endif
