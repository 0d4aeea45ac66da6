/* data.h - the input pipeline: a source, then transforms, as a chain of
 * iterators (the dataset graph), with per-stage statistics and exact
 * save/restore of every stage's state.
 *
 * An element is a fixed set of named tensors described by a loom_elem_spec;
 * after `batch` every tensor gains a leading batch dimension (the last batch
 * of an epoch may be short unless drop_remainder). There is no string dtype:
 * a text line, or a file name (list_files, whose elements interleave opens),
 * is uint8 (max) zero-padded plus an int64 () "length".
 *
 * Epochs: an iterator runs one pass of its dataset and then returns
 * LOOM_EEOF; loom_iter_rewind(it, epoch) starts the next pass, as Keras
 * re-creates the iterator per epoch (so a shuffle with reshuffle draws a new
 * order, keyed by (seed, epoch)). A pipeline with an infinite `repeat` never
 * returns EOF.
 *
 * Randomness: every random choice is keyed by (seed, stage, epoch, element
 * index) through the counter-based RNG, so results do not depend on threads
 * or timing.
 *
 * Threads: an iterator is used from one thread (the train thread); stages
 * such as prefetch run their own background thread internally. */
#ifndef LOOM_DATA_H
#define LOOM_DATA_H

#include "config/config.h"
#include "tensor/tensor.h"

typedef struct loom_elem_spec {
    int        n;
    char       name[LOOM_MAX_FEATURES][LOOM_NAME_MAX];
    loom_dtype dtype[LOOM_MAX_FEATURES];
    loom_shape shape[LOOM_MAX_FEATURES]; /* batched: dim[0] is the batch size, -1 if the last batch may be short */
} loom_elem_spec;

/* Index of a feature by name, -1 when absent. */
int loom_elem_spec_find(const loom_elem_spec *s, const char *name);
/* "image: float32 (28, 28); label: uint8 ()" into buf. */
char *loom_elem_spec_str(const loom_elem_spec *s, char *buf, size_t n);

/* An element: tensors in the order of the spec. Borrowed from the iterator
 * that produced it, valid until the next call on that iterator. */
typedef struct loom_elem {
    int         n;
    loom_tensor t[LOOM_MAX_FEATURES];
} loom_elem;

/* Statistics of one stage, for logs and `loom profile`. */
typedef struct loom_stage_stats {
    const char *name;        /* "idx", "map(normalize)", "shuffle", "batch", "prefetch" */
    int64_t     elements;    /* produced so far */
    double      busy_sec;    /* time inside this stage's next(), including its input's */
    double      wait_sec;    /* prefetch: time the consumer waited for a ready element */
    int64_t     buffered;    /* shuffle/prefetch: elements held now */
    int64_t     capacity;    /* shuffle/prefetch: the limit */
    int64_t     parallel;    /* parallel map: calls allowed at once now; parallel interleave: files read ahead at
                                once (the tuned value for "auto"); 0 otherwise */
    int64_t     bytes;       /* buffer memory the stage holds */
} loom_stage_stats;

typedef struct loom_iter loom_iter;

/* Which of several input pipelines is being built (tf.distribute.InputContext,
 * tf_semantics 5.3): a multi-worker run builds one pipeline per worker, and the
 * dataset's shard_policy (4.11) decides what each one reads. All zero = one
 * pipeline feeding one replica. */
typedef struct loom_input_ctx {
    int num_input_pipelines;  /* pipelines (workers) of the run; 0 = 1 */
    int input_pipeline_id;    /* this one, 0 .. num_input_pipelines - 1 */
    int num_replicas_in_sync; /* replicas over all workers; 0 = 1 */
    /* (appended) nonzero: this pipeline draws its randomness (shuffles,
     * random maps) from a seed of its own, loom_rng_mix(run.seed, seed_key),
     * instead of the run's seed (parameter_server workers: each its own
     * pipeline, as create_per_worker_dataset), while its source keeps the
     * run's seed (the same data set); 0: the run's seed. */
    uint64_t seed_key;
} loom_input_ctx;

/* Context for building a pipeline. */
typedef struct loom_data_ctx {
    uint64_t seed;        /* the run's seed: default for shuffles and random maps */
    bool     source_seed_set; /* the synthetic source draws its data with source_seed, not seed: a */
    uint64_t source_seed;     /* parameter_server worker shuffles with its own seed, but sees the same data */
    int      threads;     /* threads the pipeline may use besides the train thread (>= 0) */
    const char *name;     /* "train", "eval", for messages */
    loom_input_ctx input; /* zero: the only pipeline, nothing is sharded */
    const void *custom_options; /* handed to custom element-function providers (custom.h); "lua": a
                                   loom_lua_opts (script.h), sandbox and limits; NULL = defaults */
    bool        lazy_threads;   /* a prefetch starts its thread at the first pull, not at open: `loom check`,
                                   which may never pull (a synthetic source's copy) */
} loom_data_ctx;

/* get_per_replica_batch_size: global_batch / num_replicas_in_sync into *out.
 * A global batch that does not divide evenly is LOOM_ECONFIG saying so (as
 * TensorFlow's ValueError), and so is a context out of range. */
int loom_input_per_replica_batch(const loom_input_ctx *ic, int64_t global_batch, int64_t *out, loom_err *err);

/* Replica r's part of a global batch b for R replicas, as tf.distribute
 * splits it (experimental_distribute_dataset, tf_semantics 5.3): with n =
 * b's leading dim, each replica takes c = ceil(n / R) consecutive examples,
 * replica r rows [r*c, min((r+1)*c, n)). A full global batch divisible by R
 * thus splits evenly; a short last batch splits unevenly (range(6).batch(4)
 * over 2 replicas: [0,1],[2,3], then [4],[5]); and with more replicas than
 * examples the last replicas get empty batches, leading dim 0
 * (range(4).batch(4) over 5: [0],[1],[2],[3],[]). out's tensors are views
 * into b's buffers, no copy: valid while b is, owning nothing (out->t[i].owns
 * = 0). Every tensor of b must have rank >= 1 and the same leading dim; else,
 * or with r outside [0, R), LOOM_ESHAPE / LOOM_EUSAGE. */
int loom_batch_split(const loom_elem *b, int replicas, int r, loom_elem *out, loom_err *err);

/* Builds the pipeline of spec. Opens and checks the source files (a missing
 * file, a wrong magic, a truncated file or features of different lengths are
 * errors naming the file), and checks every transform against the element
 * spec it receives (an unknown feature, a reshape of the wrong size...),
 * naming the transform's file:line. Free with loom_iter_close. */
int  loom_data_open(loom_iter **out, const loom_dataset_spec *spec, const loom_data_ctx *ctx, loom_err *err);
/* Registers the built-in sources (idx, catalog, tfrecord, csv, text,
 * synthetic, list_files) in the registry (LOOM_REG_SOURCE) under their
 * source.type names, and the built-in transforms (map, shuffle, ...) and
 * map fns (cast, normalize, ...) in LOOM_REG_TRANSFORM under their config
 * names, as plugins register theirs; once, thread-safe. loom_data_open does
 * it; the plugin loader does it first, so that a plugin cannot take a
 * built-in's name. */
int  loom_data_init(loom_err *err);
/* What a LOOM_REG_TRANSFORM entry is: an element-map provider (a
 * loom_custom_ops: "lua", a plugin's), a built-in transform (a config
 * type: "shuffle") or a built-in map fn ("normalize"). */
typedef enum { LOOM_XFORM_PROVIDER, LOOM_XFORM_BUILTIN, LOOM_XFORM_MAP_FN } loom_xform_entry;
loom_xform_entry loom_data_transform_entry(const void *entry);
/* Whether the entry is a built-in transform or map fn rather than a provider. */
bool loom_data_transform_builtin(const void *entry);
/* "lua, image_ops": the element-map providers registered (LOOM_REG_TRANSFORM
 * without the built-in transforms and map fns), into buf; returns buf. */
char *loom_data_providers(char *buf, size_t n);

const loom_elem_spec *loom_iter_spec(const loom_iter *it);
/* Next element, borrowed until the next call; LOOM_EEOF at the end of a pass. */
int  loom_iter_next(loom_iter *it, loom_elem **out, loom_err *err);
/* Starts pass `epoch` (0-based) from the beginning. */
int  loom_iter_rewind(loom_iter *it, int64_t epoch, loom_err *err);
/* Elements in one pass, or -1 when infinite, -2 when unknown. */
int64_t loom_iter_cardinality(const loom_iter *it);
/* Appends the whole pipeline's state (positions, buffers, RNG, epoch). */
int  loom_iter_save(loom_iter *it, loom_buf *b, loom_err *err);
/* Restores a state saved by the same pipeline; refuses state from another
 * pipeline with a clear error. */
int  loom_iter_restore(loom_iter *it, loom_buf *b, loom_err *err);
/* The consumer of it computes on pool's threads (the caller's included),
 * which take every core (loom_pool_size(pool) >= loom_num_cores()). When all
 * the pipeline does in the background is gather in-memory rows into batches
 * (a prefetch right after a batch over an index shuffle or a source in plain
 * order, a map(scale) fused in: memory-bound, a few us a batch), the
 * prefetch's thread would take a core from the compute for each batch, and
 * the other compute thread would wait for it at the phase's end: the
 * prefetch then runs inline, inside loom_iter_next, its row copies split
 * over pool. Returns true when it did; false, changing nothing, for any
 * other pipeline (a Lua map, a file read, a parallel map: work worth its
 * thread). The elements, their order and the iterator state stay the same.
 * pool must outlive it, and only the thread calling loom_iter_next may run
 * it. */
bool loom_iter_share_pool(loom_iter *it, loom_pool *pool);
/* The stages as built, after data.options.optimization's rewrites, as one
 * line: "idx -> map(cast+scale)+batch -> prefetch(auto)". */
void loom_iter_plan(const loom_iter *it, FILE *f);
/* What the autotuner chose ("map(scale): parallel 2 (of 2); prefetch(auto):
 * buffer 3 (of 16)") into buf; returns 1 when the values have settled (no
 * change for a few tuning periods) and differ from the last time it returned
 * 1, else 0. From the thread that uses it. */
int  loom_iter_tuned(loom_iter *it, char *buf, size_t n);
/* Per-stage stats, source first; returns the number of stages (<= max). */
int  loom_iter_stats(const loom_iter *it, loom_stage_stats *out, int max);
/* A per-stage table for `loom profile` on f: elements/s over `seconds` of
 * wall time, time per element (own = busy minus the input's busy), buffer
 * occupancy, parallelism, memory held, then a "bottleneck:" line naming the
 * stage with the highest own time. Returns LOOM_OK. */
int  loom_iter_report(const loom_iter *it, double seconds, FILE *f);
/* Prints which share of ds the pipeline of ctx->input reads (the policy
 * applied and, for FILE, its files; for DATA, which final elements), one
 * "input pipeline ..." line per fact. Errors as loom_data_open's. */
int  loom_data_input_report(const loom_dataset_spec *ds, const loom_data_ctx *ctx, FILE *f, loom_err *err);
/* `loom profile`: builds the pipeline of ds, pulls `steps` elements (batches
 * after a batch; <= 0: one pass, at most 500) with no model, then prints the
 * throughput and loom_iter_report to f. */
int  loom_data_profile(const loom_dataset_spec *ds, const loom_data_ctx *ctx, int64_t steps, FILE *f, loom_err *err);
void loom_iter_close(loom_iter *it); /* NULL is a no-op */

/* Maps with adapt = true (normalize: mean/std or min/range per index of the
 * last axis, in mean_v, std_v, n_norm; string_lookup: the vocabulary) get
 * their numbers in spec->train, and data.eval's adapt maps those of train's
 * map of the same kind on the same feature. TRAIN reads
 * <model_dir>/adapt.txt when it fits the config, else adapts (one pass over
 * data.train up to the map) and writes it; FRESH always adapts and writes;
 * LOAD only reads it (evaluate, predict, export: an error when absent);
 * CHECK reads it or adapts without writing. No adapt map: nothing happens. */
typedef enum { LOOM_ADAPT_TRAIN, LOOM_ADAPT_FRESH, LOOM_ADAPT_LOAD, LOOM_ADAPT_CHECK } loom_adapt_mode;
int loom_data_adapt(loom_spec *spec, const char *model_dir, loom_adapt_mode mode, const loom_data_ctx *ctx,
                    loom_err *err);
/* The numbers a checkpoint holds (its "adapt" record, loom_data_adapt_text's
 * form). Given (text not NULL) in any mode but FRESH, they are used instead
 * of adapt.txt: a checkpoint that does not fit the config is an error; when
 * adapt.txt holds other numbers, a warning says so (once: *said, when not
 * NULL, is set), and TRAIN rewrites adapt.txt with the checkpoint's. */
typedef struct loom_adapt_source {
    const char *name;  /* the checkpoint's path, for messages */
    const void *text;
    size_t      len;
    bool       *said;
} loom_adapt_source;
int loom_data_adapt_from(loom_spec *spec, const char *model_dir, loom_adapt_mode mode, const loom_data_ctx *ctx,
                         const loom_adapt_source *ck, loom_err *err);
/* Appends the adapted numbers of spec->train's adapt maps to out as text (the
 * form of adapt.txt); returns how many maps (0: nothing appended). */
int loom_data_adapt_text(const loom_spec *spec, loom_buf *out);

/* A tokenize map's tokenizer outside a pipeline (loom generate: a prompt
 * into ids, generated ids back into text), with exactly the pipeline's
 * ids. m: a tokenize map of the spec after loom_data_adapt (an adapted
 * vocabulary is borrowed: keep the spec alive), or with a vocabulary_file
 * (read here). Free with loom_tokenizer_free. */
typedef struct loom_tokenizer loom_tokenizer;
int  loom_tokenizer_new(loom_tokenizer **out, const loom_map_spec *m, loom_err *err);
void loom_tokenizer_free(loom_tokenizer *t); /* NULL is a no-op */
/* text (n bytes) as ids (standardized and split as the map does; no
 * padding or truncation): *n_ids of them, the first cap in ids; *n_oov: how
 * many were out of the vocabulary (mapped to an OOV id). With
 * num_oov_indices = 0 an unknown token is LOOM_EDATA naming it. */
int  loom_tokenizer_encode(loom_tokenizer *t, const uint8_t *text, size_t n, int64_t *ids, int64_t cap, int64_t *n_ids,
                           int64_t *n_oov, loom_err *err);
/* The bytes id stands for into buf (at most cap; the length, or -1 for an id
 * with no text: padding 0, or outside the ids): a byte, a code point as
 * UTF-8, a vocabulary token ("[UNK]" for an OOV id). Words are not joined: the
 * caller puts the spaces in. */
int  loom_tokenizer_decode(const loom_tokenizer *t, int64_t id, char *buf, size_t cap);
int64_t loom_tokenizer_size(const loom_tokenizer *t); /* ids in use: an embedding's input_dim */

/* The transform `split`'s draw for element pos of a pass: uniform in [0, 1);
 * the element is in the training part when it is below the fraction. */
double loom_split_u(uint64_t seed, int64_t pos);

/* The Debian package and files a catalog dataset resolves to. Returns
 * LOOM_ECONFIG for an unknown name or split, LOOM_EIO with an install hint
 * when the package is absent. */
int loom_catalog_resolve(const char *name, const char *split, char images[LOOM_PATH_MAX],
                         char labels[LOOM_PATH_MAX], loom_err *err);

/* Loads a whole IDX file (plain or gzip) into *out: shape (items, ...) with
 * the file's dims, dtype uint8, int32 (int8/int16/int32 files, widened),
 * float32 or float64, values in host order. A file that is not IDX, is
 * truncated, or has more than LOOM_MAX_RANK dims is LOOM_EDATA naming it.
 * *out is zeroed on failure; free with loom_tensor_fini. */
int loom_idx_load(const char *path, loom_tensor *out, loom_err *err);

#include "data/format/records.h"
#include "data/engine/custom.h"

#endif
