/* data_internal.h - private to appliance/data: the stage vtable every
 * iterator implements, slot pools for stages that hold copies of elements
 * (shuffle, prefetch), and the constructors pipeline.c chains together.
 * Threads: a stage is driven by one thread at a time (the train thread, or
 * the producer thread of the prefetch stage downstream of it); the stats
 * counters are atomics so loom_iter_stats may read them from any thread. */
#ifndef LOOM_DATA_INTERNAL_H
#define LOOM_DATA_INTERNAL_H

#include "data.h"

#include <string.h>

/* Copies an element: its n tensors only. A loom_elem holds room for
 * LOOM_MAX_FEATURES (256) tensors, 24 KiB, so a struct assignment per
 * element would copy mostly nothing at a high price. */
static inline void elem_copy_(loom_elem *dst, const loom_elem *src)
{
    dst->n = src->n;
    memcpy(dst->t, src->t, (size_t)src->n * sizeof src->t[0]);
}

typedef struct dstage dstage;
typedef struct dtuner dtuner;

typedef struct dstage_ops {
    int  (*next)(dstage *s, loom_elem **out, loom_err *err);     /* LOOM_EEOF at the end of a pass, sticky */
    int  (*rewind)(dstage *s, int64_t epoch, loom_err *err);     /* starts pass `epoch`, rewinding the input */
    void (*save)(dstage *s, loom_buf *b);                        /* this stage's own state only */
    int  (*restore)(dstage *s, loom_buf *b, loom_err *err);      /* this stage's own state only */
    void (*pause)(dstage *s);                                    /* (optional) quiesce background work */
    void (*resume)(dstage *s);                                   /* (optional) undo pause */
    void (*close)(dstage *s);                                    /* frees s */
    /* (optional) next() writing the element into dst's buffers (views sized for
     * the stage's max shapes), setting dst's shapes: saves a copy downstream */
    int  (*next_into)(dstage *s, loom_elem *dst, loom_err *err);
    void (*tune)(dstage *s, dtuner *t);                          /* (optional) registers "auto" knobs (engine/autotune.c) */
    /* (optional) random access: element `index` (0 <= index < card, card known
     * and finite), exactly as next() yields it at that position in every pass
     * (only stages whose passes are all alike offer it); lent like next()'s
     * element until the next get or next. It moves no cursor: a stage read only
     * through get keeps the state rewind gave it. Offered only where it is exact
     * and cheap (an in-memory or computed source, take and skip over one). */
    int  (*get)(dstage *s, int64_t index, loom_elem **out, loom_err *err);
    /* (optional) next() as positions, for a batch's gather: fills pos with the
     * next up to n elements, each as its index in ddraw_from_(s)'s get, exactly
     * those next() would yield, moving s's state as that many next() calls do
     * (the call that would have returned LOOM_EEOF included); *got < n only at
     * the pass's end. No stats: the caller counts them. Offered where it is
     * exact and cheap: an index-mode shuffle (or shuffle+repeat), a source with rows. */
    int  (*draw)(dstage *s, int64_t *pos, int64_t n, int64_t *got, loom_err *err);
    /* (optional) the in-memory arrays get lends views of: element i's feature f
     * is the item_bytes[f] bytes at base[f] + i * item_bytes[f], of the spec's
     * shape (fixed), valid while s is open. */
    void (*rows)(const dstage *s, const uint8_t **base, size_t *item_bytes);
} dstage_ops;


/* The part every stage shares; each kind embeds it as its first member. */
struct dstage {
    const dstage_ops *ops;
    dstage        *in;            /* upstream stage, NULL for the source */
    int            id;            /* 0 = source, k = transform k-1: keys the RNG streams */
    char           name[48];      /* "map(cast)", for stats */
    char           desc[160];     /* kind + parameters, for the state fingerprint */
    char           where[LOOM_PATH_MAX + 16]; /* "file:line" of the spec, may be "" */
    char           path[128];     /* "data.train.transforms.[2]", may be "" */
    loom_elem_spec spec;          /* what next() yields */
    loom_shape     maxshape[LOOM_MAX_FEATURES]; /* spec with every -1 replaced by its largest value */
    int            batch_dims;    /* leading dims added by batch stages */
    int64_t        card;          /* elements per pass, -1 infinite, -2 unknown */
    loom_elem      out;           /* the element lent out by next() */
    uint8_t        mut[LOOM_MAX_FEATURES]; /* last element's feature buffer may be modified in place downstream */
    /* stats, accessed with __atomic builtins */
    int64_t st_elements, st_busy_ns, st_wait_ns, st_buffered, st_capacity;
    int64_t st_parallel;          /* parallel map: calls allowed in flight now (0 = not parallel) */
    int64_t st_bytes;             /* buffer memory held by this stage (slot pools, outputs) */
    int64_t st_work_ns;           /* parallel stages: time inside calls on any thread (their CPU-side load) */
};

/* The stage whose get a draw's positions index: the input, or a source itself. */
static inline dstage *ddraw_from_(dstage *s) { return s->in ? s->in : s; }

/* Pulls the next element from s, accounting its stats. */
int  dstage_next_(dstage *s, loom_elem **out, loom_err *err);
/* s->ops->next_into (which must exist) into dst's buffers, accounting its stats as dstage_next_ does. */
int  dstage_next_into_(dstage *s, loom_elem *dst, loom_err *err);
/* s->ops->get (which must exist), accounting its stats as dstage_next_ does. */
int  dstage_get_(dstage *s, int64_t index, loom_elem **out, loom_err *err);
/* Fills the common fields; where/path from loc (may be NULL). */
void dstage_init_(dstage *s, const dstage_ops *ops, dstage *in, int id, const loom_loc *loc);
/* Sets a stats gauge / reads a counter (relaxed atomics). */
void dstage_gauge_(int64_t *field, int64_t v);
int64_t dstage_load_(const int64_t *field);
/* Error located at the stage's spec: where = file:line, message prefixed with the setting path. */
int  dstage_err_(const dstage *s, loom_err *err, int code, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
/* Ready-made ops for stateless stages: rewind only the input, no state of their own, a close that frees s alone. */
int  dstage_pass_rewind_(dstage *s, int64_t epoch, loom_err *err);
void dstage_no_save_(dstage *s, loom_buf *b);
int  dstage_no_restore_(dstage *s, loom_buf *b, loom_err *err);
void dstage_free_(dstage *s);
/* The (epoch, pos) cursor of map stages and simple sources. rewind: *epoch = to,
 * *pos = 0, then rewinds the input (if any). save writes epoch then pos as i64;
 * load reads them back, false when the state is truncated (callers check the range). */
int  dcursor_rewind_(dstage *s, int64_t *epoch, int64_t *pos, int64_t to, loom_err *err);
void dcursor_save_(loom_buf *b, int64_t epoch, int64_t pos);
bool dcursor_load_(loom_buf *b, int64_t *epoch, int64_t *pos);
/* A stage whose whole state is that cursor, kept right after the stage
 * (map, fused maps, custom maps: struct { dstage s; int64_t epoch, pos; ...}),
 * checked by DCURSOR_STAGE_CHECK: its rewind, save and restore (a truncated
 * state or a negative pos is LOOM_ECHECKPOINT naming the stage). */
typedef struct dcursor_stage {
    dstage  s;
    int64_t epoch, pos;
} dcursor_stage;
#define DCURSOR_STAGE_CHECK(T)                                                                                  \
    _Static_assert(offsetof(T, epoch) == offsetof(dcursor_stage, epoch) &&                                      \
                   offsetof(T, pos) == offsetof(dcursor_stage, pos), #T " keeps its cursor right after its stage")
/* A batch of n elements (of shapes first[f]) gathered into o, of size
 * wanted: LOOM_EEOF when none, or when short and drop_remainder; else o's
 * shapes (n, first[f]...) set and LOOM_OK. The batch stage's and the fused
 * map+batch stage's last step. */
int  dbatch_finish_(loom_elem *o, const loom_shape *first, int64_t n, int64_t size, int drop);
int  dcursor_stage_rewind_(dstage *st, int64_t epoch, loom_err *err);
void dcursor_stage_save_(dstage *st, loom_buf *b);
int  dcursor_stage_restore_(dstage *st, loom_buf *b, loom_err *err);
/* CLOCK_MONOTONIC in nanoseconds, for the stats timers. */
int64_t dnow_ns_(void);

/* ---- element slot pools (engine/elem.c) ---------------------------------------- */

/* cap slots, each able to hold one element of the pool's max shapes; stored
 * per feature as one contiguous array so a copy is a memcpy per feature. */
typedef struct elem_pool {
    int         nf;
    loom_dtype  dtype[LOOM_MAX_FEATURES];
    size_t      slot_bytes[LOOM_MAX_FEATURES];  /* bytes of the largest element */
    int         varshape;                       /* some dim can vary: keep per-slot shapes */
    int64_t     cap;
    uint8_t    *data[LOOM_MAX_FEATURES];        /* cap * slot_bytes, 64-byte aligned */
    loom_shape *shape;                          /* cap * nf when varshape, else the fixed shapes (nf) */
    int64_t    *bytes_gauge;                    /* the owning stage's st_bytes, kept up to date */
    int64_t     reserved;                       /* slots data[] has room for (>= cap): growing within is free */
} elem_pool;

int  elem_pool_init_(elem_pool *p, const dstage *s, int64_t cap, loom_err *err);
int  elem_pool_grow_(elem_pool *p, int64_t cap, loom_err *err);   /* keeps slot contents */
/* Allocates room for max slots at once (fixed shapes only; else a no-op), so
 * later grows up to max neither copy nor reallocate. The pages are left
 * untouched (they become resident as slots fill; large buffers are advised
 * as transparent huge pages), and the bytes gauge still follows cap. */
int  elem_pool_reserve_(elem_pool *p, int64_t max, loom_err *err);
void elem_pool_fini_(elem_pool *p);
/* Counts p's bytes (from now on) in owner's stats rather than in the stage
 * whose spec it was made from (elem_pool_init_'s s, an input stage). */
void elem_pool_own_(elem_pool *p, dstage *owner);
/* Copies e into slot i; LOOM_ESHAPE when e does not fit the pool. */
int  elem_pool_put_(elem_pool *p, int64_t i, const loom_elem *e, loom_err *err);
/* Points e's tensors at slot i (borrowed views). */
void elem_pool_view_(const elem_pool *p, int64_t i, loom_elem *e);
/* Serialises slot i (shapes + bytes) / reads one back into slot i. */
void elem_pool_save_(const elem_pool *p, int64_t i, loom_buf *b);
int  elem_pool_load_(elem_pool *p, int64_t i, loom_buf *b, loom_err *err);

/* ---- constructors --------------------------------------------------------- */

int source_open_(dstage **out, const loom_source_spec *src, loom_err *err);
int map_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, const loom_data_ctx *ctx, loom_err *err);
/* string_lookup's hash of a string's bytes (FNV-1a 64): table slots, and the out-of-vocabulary id (hash % num_oov_indices). */
uint64_t loom_data_str_hash(const uint8_t *p, size_t n);
int shuffle_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, const loom_data_ctx *ctx, loom_err *err);
int batch_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err);
/* A map stage st (map_open_, a stage of its own) that scales one feature
 * right after a gathering batch is fused into it: the batch writes that
 * feature once, scaled, as float32 (the map's own loop per row: the same
 * floats), instead of a uint8 batch the map then reads. Both stages stay in
 * the plan and the stats ("batch(gather+scale)" holds the scale's time; the
 * map's own is ~0); the map keeps its cursor and state. Else a no-op. */
bool map_fuse_into_batch_(dstage *st);
/* The batch a fused map st reads, pulled (with the batch's stats) into e:
 * feature f into to[f] where given, else the batch's own buffer, and the
 * map's feature, scaled, into to[f] or else the map's own buffer. The map's
 * cursor does not move (a chain keeps its own). */
int  map_fused_pull_(dstage *st, loom_elem *e, uint8_t *const *to, loom_err *err);
/* Whether st is a batch stage that gathers (batch(gather), batch(gather+scale)). */
bool batch_is_gather_(dstage *st);
/* Splits a gathering batch's row copies over pool from now on (loom_iter_share_pool). */
void batch_share_pool_(dstage *st, loom_pool *pool);
/* A map stage fused into its gathering batch (map_fuse_into_batch_). */
bool map_is_fused_(const dstage *st);
/* A chain of maps (map_fusion) that is one scale fused into its gathering batch. */
bool mapchain_fused_alone_(const dstage *st);
int repeat_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err);
int take_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err);
int skip_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err);
/* threaded == 0: runs inline (no background thread); lazy: its thread
 * starts at the first pull, not here. ram_left: bytes the
 * queue may take at most (buffer "auto" is capped to fit, a fixed buffer that
 * does not fit is LOOM_ECONFIG naming the transform). */
int prefetch_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, int threaded, bool lazy,
                   int64_t ram_left, loom_err *err);
/* A threaded prefetch stage st runs inline from now on: its producer thread
 * is stopped (what it queued is delivered first), and next() pulls its
 * input on the caller's thread. False (nothing done) for any other stage. */
bool prefetch_inline_(dstage *st);
/* transform/transforms_more.c; cache takes the source spec for its file fingerprint. */
int filter_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err);
int shard_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, uint64_t run_seed, loom_err *err); /* shard, split */
int enumerate_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err);
int concat_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err);
int select_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err);
int unbatch_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err);
int padded_batch_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err);

/* ---- text, windows, buckets (transform/text.c, window.c, padded.c) ------------------ */
/* map(tokenize) (map_open_ hands it here): its own stage, never fused or parallel. */
int tokenize_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err);
/* One token of a string: its bytes, and (bytes, utf8_chars) the byte or code point; nonzero stops the split. */
typedef int (*tok_emit_fn)(void *ctx, const uint8_t *tok, size_t n, uint32_t cp);
/* m's standardize of p[0..n) into out (n bytes of room, may be p); its length. */
size_t tokenize_standardize_(const loom_map_spec *m, const uint8_t *p, size_t n, uint8_t *out);
/* Splits the standardized p[0..n) into m's tokens, in order; invalid UTF-8
 * (utf8_chars) is emitted as U+FFFD and counted in *invalid (may be NULL). */
int tokenize_split_(const loom_map_spec *m, const uint8_t *p, size_t n, tok_emit_fn emit, void *ctx, int64_t *invalid);
/* tf.data window(size, shift, stride, drop_remainder): each window one element of (n, ...) tensors. */
int window_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err);
int64_t window_max_bytes_(const dstage *in, const loom_transform_spec *t);
/* lm_pairs: feature (T + 1, ...) -> input = w[:-1], target = w[1:] (views). */
int lm_pairs_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err);
/* bucket_by_sequence_length (tf.data.experimental), with padded_batch's padding and mask. */
int bucket_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err);
int64_t bucket_max_bytes_(const dstage *in, const loom_transform_spec *t);
/* padded_batch's helpers (transforms_more.c), shared with bucket. */
void dfill_value_(void *dst, loom_dtype dt, size_t n, double v);
void dcopy_padded_(uint8_t *dst, const loom_shape *t, const uint8_t *src, const loom_shape *s, size_t es);
/* ram_left / ram: the RAM budget left for it and the whole budget (bytes); a
 * memory cache of unknown length is refused when it would outgrow ram_left,
 * and a cache of an infinite input (card -1) at open. */
int cache_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, const loom_source_spec *src,
                int64_t ram_left, int64_t ram, loom_err *err);

/* ---- parallel map (engine/parmap.c) ------------------------------------------------
 * One worker pool per pipeline, shared by every parallel map (no thread per
 * element or per batch). A task runs fn(arg) on a worker; tasks must not
 * block on each other. With 0 threads, submit runs the task inline. */
typedef struct dtask {
    void        (*fn)(void *arg);
    void         *arg;
    struct dtask *next;
    const void   *owner; /* (optional) the stage waiting for it, for dpool_help_ */
} dtask;
typedef struct dpool dpool;
int  dpool_new_(dpool **out, int threads, loom_err *err); /* free with dpool_free_ */
void dpool_free_(dpool *p);                               /* NULL is a no-op; tasks must be finished */
int  dpool_size_(const dpool *p);                         /* worker threads */

/* The map op as a reentrant call, for the parallel map: maps feature f of e
 * in place of e's tensor. writable: e's feature-f buffer may be overwritten;
 * buf, flags: this call's scratch (sizes from map_scratch_); pos: the RNG
 * index of e's first element. *mut: whether tensor f is writable afterwards. */
int     map_apply_(const dstage *map, loom_elem *e, int writable, uint8_t *buf, uint8_t *flags, int64_t epoch, int64_t pos,
                   int *mut, loom_err *err);
int64_t map_count_(const dstage *map, const loom_elem *e);  /* RNG indices e consumes */
/* Whether maps a then b (b opened on a) are normalize with one mean and std
 * then random_flip_left_right of the same feature, which map_norm_flip_ runs
 * as one pass: e as map_apply_(a) then map_apply_(b) leave it, bit for bit,
 * with dst (may be NULL) where b would have written as the feature's last map. */
bool    map_norm_flip_ok_(const dstage *a, const dstage *b);
int     map_norm_flip_(const dstage *a, const dstage *b, loom_elem *e, int writable, uint8_t *dst, int64_t epoch,
                       int64_t pos, int *mut, loom_err *err);
/* How many of map[0..n) run as one pass from map[0] (0: none): 2 for pad
 * then random_crop of the same unbatched feature, 3 with a
 * random_flip_left_right of it after them. map_pad_crop_ runs them so:
 * e as map_apply_ of each in turn leaves it, bit for bit, with dst (may be
 * NULL: the crop's own buffer) where the last would have written. */
int     map_pad_crop_len_(dstage *const *map, int n);
int     map_pad_crop_(dstage *const *map, int len, loom_elem *e, uint8_t *dst, int64_t epoch, int64_t pos, int *mut,
                      loom_err *err);
int     map_feature_(const dstage *map);                     /* the feature index it maps */
void    map_buffers_(const dstage *map, uint8_t **buf, uint8_t **flags); /* its own scratch (may be NULL) */
void    map_scratch_(const dstage *map, size_t *buf_bytes, size_t *flag_bytes);
/* Runs the oldest queued task on the calling thread; 0 when none is queued. */
int  dpool_help_(dpool *p);
/* The same for the tasks of owner only. A consumer waiting for its results
 * calls it rather than sleeping: its own tasks it needs next anyway, while
 * another stage's could be long and delay it. */
int  dpool_help_own_(dpool *p, const void *owner);
/* Queues t to run fn(arg) on a worker (inline when the pool has no threads). */
void dpool_submit_(dpool *p, dtask *t);
/* Maps t[0..n-1] (consecutive maps with the same parallel and deterministic
 * settings, n > 1 when fused) as one stage over *pool (created on first use,
 * sized from ctx->threads): parallel = N, or LOOM_PARALLEL_AUTO for a window
 * the autotuner sizes within ram_left bytes; the maps' own `parallel` is
 * ignored (map_parallelization may have changed it). batch != 0: t[n] is a
 * batch fused in, each call mapping a whole batch into its buffer. */
int parmap_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, int n, int parallel, int batch,
                 const loom_data_ctx *ctx, dpool **pool, int64_t ram_left, loom_err *err);


/* ---- custom maps and filters (engine/custom.c) -------------------------------------
 * Through a provider registered by name (custom.h): map_open_ hands a
 * LOOM_MAP_LUA map to custom_map_open_, and map_apply_ & co. to the custom_*
 * functions below for such a stage. A custom map maps the whole element: its
 * scratch buffer holds every output feature, custom_offset_ says where (and
 * *cap how many bytes fit), and its map_feature_ is 0. */
int    custom_map_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, const loom_data_ctx *ctx,
                        loom_err *err);
int    custom_filter_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, const loom_data_ctx *ctx,
                           loom_err *err);
bool   custom_is_(const dstage *st);   /* a custom map stage */
int    custom_apply_(const dstage *st, loom_elem *e, uint8_t *buf, int64_t epoch, int64_t pos, loom_err *err);
size_t custom_scratch_(const dstage *st);
size_t custom_offset_(const dstage *st, int f, size_t *cap);

/* A source from a provider in the registry (source/plugin.c): src->plugin.name
 * names it; an unknown name is LOOM_ECONFIG listing the registered ones. */
int plugin_source_open_(dstage **out, const loom_source_spec *src, const loom_data_ctx *ctx, loom_err *err);
/* source/builtin.c: the source src->kind names (a plugin's: src->plugin.name), looked up in the registry
 * (LOOM_REG_SOURCE) where the built-ins are registered (loom_data_init) as
 * the plugins' are: a built-in's open, else plugin_source_open_. */
int dsource_open_(dstage **out, const loom_source_spec *src, const loom_data_ctx *ctx, loom_err *err);

/* ---- file-list sources (source/files.c) ------------------------------------ */

/* Expands src's patterns (each must still match a regular file) into *files,
 * sorted and unique, *n of them; what ("tfrecord", "csv") names the list in
 * messages. On failure *files may hold some entries: free with source_files_free_. */
int  source_files_expand_(const dstage *st, const loom_source_spec *src, const char *what, char ***files, int64_t *n,
                          loom_err *err);
void source_files_free_(char **files, int64_t n);
/* h carried on (FNV-1a) over each file's name without its directory and its
 * NUL: the file list in a stage's fingerprint, which a moved dataset still matches. */
uint64_t source_files_hash_(uint64_t h, char *const *files, int64_t n);

/* A buffered reader of one plain file that knows its byte offset. */
typedef struct src_file {
    FILE    *f;        /* NULL when closed */
    uint8_t *buf;      /* SRC_FILE_BUF bytes */
    size_t   len, pos; /* valid bytes in buf, next byte */
    uint64_t offset;   /* file offset of buf[pos] */
    int      error;    /* errno of a failed read, sticky */
    bool     mem;      /* reads borrowed bytes (src_file_mem_), not a file */
} src_file;
/* Opens path positioned at byte offset (an offset past the end is LOOM_ECHECKPOINT). */
int  src_file_open_(src_file *r, const char *path, uint64_t offset, loom_err *err);
/* Reads the n bytes at data (borrowed, not copied) as if they were a file. */
void src_file_mem_(src_file *r, const uint8_t *data, size_t n);
void src_file_close_(src_file *r);                /* closes; a closed reader is a no-op */
int  src_file_refill_(src_file *r);               /* 1: bytes available, 0: end of file or error (see error) */
static inline int src_file_peek_(src_file *r) { return r->pos < r->len || src_file_refill_(r) ? r->buf[r->pos] : -1; }
static inline int src_file_getc_(src_file *r)
{
    if (r->pos >= r->len && !src_file_refill_(r)) return -1;
    r->offset++;
    return r->buf[r->pos++];
}
/* Records r's sticky read error (LOOM_EIO, where = path); returns LOOM_EIO. */
int  src_file_read_err_(const src_file *r, const char *path, loom_err *err);

/* Where a line-oriented file-list source (csv, text) reads: its files in
 * order, one epoch after another, the open one at a byte offset and line.
 * The state it saves: epoch, file index, and in the open file the byte
 * offset and line of the next read (both 0 when no file is open). Each
 * source opens its files with its own src_cursor_open_fn (a csv file starts
 * with a header to read), built on src_cursor_open_. */
typedef struct src_cursor {
    char   **files;   /* sorted, unique; owned */
    int64_t  n_files;
    src_file in;
    bool     open;    /* in reads files[fi] */
    int64_t  epoch, fi, line; /* line: of the next byte of in */
    bool     done;    /* past the last file of the epoch */
} src_cursor;
/* Opens the source st's files[fi] so that the next read is at byte offset,
 * on line `line` (0 and 1: its start); on failure no file is open. */
typedef int (*src_cursor_open_fn)(dstage *st, uint64_t offset, int64_t line, loom_err *err);
/* Opens files[fi] at offset and line, and does nothing else. */
int  src_cursor_open_(src_cursor *c, uint64_t offset, int64_t line, loom_err *err);
/* Makes c->in read the current file, opening it with open when none is
 * open; LOOM_EEOF once every file of the epoch is read. */
int  src_cursor_file_(src_cursor *c, dstage *st, src_cursor_open_fn open, loom_err *err);
void src_cursor_next_file_(src_cursor *c); /* the current file is read: close it, go on to the next */
void src_cursor_close_file_(src_cursor *c);
void src_cursor_rewind_(src_cursor *c, int64_t epoch); /* to the first file of epoch */
void src_cursor_save_(const src_cursor *c, loom_buf *b);
/* Reads what src_cursor_save_ wrote, checks it against n_files (an open file
 * must be at line >= min_line; what, "csv" or "text", names the source in the
 * LOOM_ECHECKPOINT message), then moves there, reopening the file with open. */
int  src_cursor_restore_(src_cursor *c, loom_buf *b, const char *what, int64_t min_line, dstage *st,
                         src_cursor_open_fn open, loom_err *err);
void src_cursor_fini_(src_cursor *c); /* closes the file, frees the list */

/* ---- CSV records (source/csv.c; also driven by tests/fuzz/fuzz_csv.c) ------- */

/* The fields of one record, each NUL-terminated in text (quotes removed). */
typedef struct csv_record {
    char   *text;        /* owned */
    size_t  len, cap;
    size_t *start;       /* owned: field i starts at text + start[i] */
    int     n, fcap;
    int64_t line;        /* 1-based line on which the record starts */
} csv_record;
#define CSV_MAX_RECORD (16u << 20) /* bytes of one record: a longer one is an error */
void csv_record_fini_(csv_record *r);
/* Reads one RFC 4180 record from in; *line is the line of the next byte and
 * advances over newlines (also quoted ones). Blank lines are skipped. Returns
 * LOOM_OK, LOOM_EEOF (nothing left), LOOM_EDATA (unterminated quote, a character
 * after a closing quote, a record over CSV_MAX_RECORD), LOOM_EIO or LOOM_ENOMEM;
 * where = path:line. */
int  csv_read_record_(src_file *in, const char *path, char delim, int64_t *line, csv_record *rec, loom_err *err);
/* Parses a field as dt into out (one value); false when it is not a number of
 * that dtype (in range, nothing after it but spaces). */
bool csv_parse_value_(const char *s, loom_dtype dt, void *out);

/* ---- distributed input (engine/distribute_input.c) -------------------------------------
 * What one of several input pipelines reads, decided before its stages open. */
typedef struct dinput_plan {
    loom_shard_policy policy; /* FILE, DATA, or OFF (nothing to shard) */
    int               n, id;  /* pipelines, this one */
    loom_source_spec *source; /* FILE: the source spec with file_shards set (owned); else NULL */
    int               data_at; /* DATA: index of the transform the shard stage goes before; -1 none */
    int64_t           n_files; /* files of the source before sharding; -1 not counted */
} dinput_plan;
/* Plans ctx->input's share of spec; a share with no data is LOOM_ECONFIG naming the pipeline.
 * warn: log AUTO's fallback to DATA. */
int  dinput_plan_(dinput_plan *p, const loom_dataset_spec *spec, const loom_data_ctx *ctx, bool warn, loom_err *err);
void dinput_plan_fini_(dinput_plan *p);
/* FILE: keeps files i % src->file_shards == src->file_shard of the sorted list (frees the rest). */
int  dinput_keep_files_(const dstage *st, const loom_source_spec *src, char **files, int64_t *n, loom_err *err);
/* DATA: the stage keeping p's share of in's elements; an empty share is an error. */
int  dinput_shard_open_(dstage **out, dstage *in, const dinput_plan *p, const loom_dataset_spec *spec, loom_err *err);

int tfrecord_source_open_(dstage **out, const loom_source_spec *src, const loom_data_ctx *ctx, loom_err *err);
int csv_source_open_(dstage **out, const loom_source_spec *src, loom_err *err);
int text_source_open_(dstage **out, const loom_source_spec *src, loom_err *err);
/* When st is a text source: the file, and the file offset of byte `byte` of its last element. */
bool text_source_where_(const dstage *st, int64_t byte, char *file, size_t n, uint64_t *offset);
int synthetic_source_open_(dstage **out, const loom_source_spec *src, const loom_data_ctx *ctx, loom_err *err);

/* ---- list_files, interleave, zip (source/list_files.c, transform/interleave.c, transform/zip.c) ----- */

int list_files_source_open_(dstage **out, const loom_source_spec *src, loom_err *err);
/* The first (sorted) file of a list_files stage; NULL for any other stage. */
const char *list_files_first_(const dstage *s);
/* t->source opened on each input element's "filename" (from a list_files
 * source upstream); t->parallel > 1 or "auto" reads ahead on *pool (created
 * on first use, sized from ctx->threads). */
int interleave_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, const loom_data_ctx *ctx,
                     dpool **pool, loom_err *err);
/* in zipped with the pipeline of t->dataset (built with ctx, unsharded). */
int zip_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, const loom_data_ctx *ctx, loom_err *err);
/* The last stage of it (pipeline.c): what zip reads the zipped pipeline's spec from. */
dstage *iter_last_(loom_iter *it);

/* ---- built-in transforms and map fns in the registry (transform/builtin.c) ---------------
 * Each built-in transform is a dxform registered in LOOM_REG_TRANSFORM under
 * the name its config type has (config's loom_transform_kind_name: one list),
 * each built-in map fn a dmapfn (transforms.c) under its fn name, beside the
 * element-map providers (loom_custom_ops: "lua", plugins'). Every entry
 * starts with (version, name); the built-ins' versions are magic numbers no
 * plugin's can have, which tells the three apart. The engine opens a
 * transform by its name, with no switch over kinds. */
#define DXFORM_BUILTIN 0x4c58464du /* "LXFM" */
#define DMAPFN_BUILTIN 0x4c4d4150u /* "LMAP" */
/* What a transform's open gets besides its input stage. */
typedef struct dxform_args {
    int                        id;        /* stage id: transform index + 1 (keys the RNG streams) */
    int                        index;     /* the transform's index in spec, -1 for an injected one */
    const loom_transform_spec *t;
    const loom_dataset_spec   *spec;      /* the whole pipeline (cache: its source, the transforms before it) */
    const loom_data_ctx       *ctx;
    dpool                    **pool;      /* the pipeline's worker pool, created on first use */
    int                       *threads;   /* threads left to stages that take one (prefetch) */
    int64_t                    ram_left, ram; /* bytes of the RAM budget left, and the whole budget */
} dxform_args;
typedef struct dxform {
    uint32_t            version; /* DXFORM_BUILTIN; where loom_custom_ops has its version */
    const char         *name;    /* the config's type name, the registry's; where loom_custom_ops has its name */
    loom_transform_kind kind;    /* what config resolved the name to */
    int  (*open)(dstage **out, dstage *in, const dxform_args *a, loom_err *err);
    /* (optional) a load-time check of t in its pipeline before anything is allocated */
    int  (*check)(const dstage *in, const dxform_args *a, loom_err *err);
    /* (optional) bytes the stage may grow to hold over in beyond what it holds
     * at open: checked against the RAM budget before open, and counted after */
    int64_t (*max_bytes)(const dstage *in, const loom_transform_spec *t);
    /* (with max_bytes) what that buffer is, for the over-budget message */
    void (*what)(char *buf, size_t n, const dstage *in, const loom_transform_spec *t);
    /* (optional) whether t is the identity, which noop_elimination drops from the plan */
    bool (*noop)(const loom_transform_spec *t);
} dxform;
/* Registers the built-in transforms and map fns (loom_data_init calls them once). */
int  dxform_register_(loom_err *err);
int  dmapfn_register_(loom_err *err);
/* The built-in entry for t's type; NULL with LOOM_ECONFIG at where listing the built-ins. */
const dxform *dxform_find_(const loom_transform_spec *t, const char *where, loom_err *err);
/* "map, shuffle, ..." (version DXFORM_BUILTIN) / "cast, scale, ..."
 * (DMAPFN_BUILTIN) / "lua, image_ops" (0: the element-map providers): the
 * names of those LOOM_REG_TRANSFORM entries, in registration order, into buf. */
char *dxform_names_(uint32_t version, char *buf, size_t n);

/* ---- static rewrites (engine/optimize.c) ------------------------------------------------
 * tf.data's graph rewrites (tf_semantics 4.9) on the transform list, then the
 * fused stages they need. Each rewrite yields exactly the elements of the plain
 * pipeline: stage ids (which key the RNG streams) stay those of the transforms. */
typedef enum { DPLAN_ONE, DPLAN_MAPS, DPLAN_MAP_BATCH, DPLAN_SHUFFLE_REPEAT } dplan_kind;
typedef struct dplan_step {
    dplan_kind kind;
    int        first, n; /* transforms [first, first + n) of the spec; an injected prefetch has first = -1 */
    int        parallel; /* DPLAN_MAPS, DPLAN_MAP_BATCH: N or LOOM_PARALLEL_AUTO (1: sequential) */
} dplan_step;
typedef struct dplan {
    int        n;
    dplan_step step[LOOM_MAX_TRANSFORMS + 1];
    loom_transform_spec injected; /* the prefetch appended by inject_prefetch */
} dplan;
/* The rewritten plan of spec under o (which rewrites apply); no fused step
 * spans transform index barrier (where a stage gets inserted; -1 none). */
void dplan_make_(dplan *p, const loom_dataset_spec *spec, const loom_data_options *o, int threads, int barrier);
/* Sequential fused stages: maps t[0..n-1] (n >= 2); maps t[0..n-2] then batch
 * t[n-1] (n >= 2), the last map writing into the batch buffer; shuffle t[0]
 * then repeat t[1]. */
int mapchain_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, int n, const loom_data_ctx *ctx,
                   loom_err *err);
int mapbatch_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, int n, const loom_data_ctx *ctx,
                   loom_err *err);
int shufrep_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, const loom_data_ctx *ctx, loom_err *err);
/* "map(cast+scale)" + suffix for the maps of a fused stage, shortened to fit n. */
void dmaps_name_(char *out, size_t n, dstage *const *map, int nmap, const char *suffix);
/* Bytes a shuffle of t over in may buffer at most (its buffer, or one pass
 * when smaller): elements, or 8-byte positions when by_index. */
int64_t shuffle_max_bytes_(const dstage *in, const loom_transform_spec *t, bool by_index);
/* Whether a plain shuffle over in buffers positions (index mode, transform/shuffle.c):
 * in has get and a known finite cardinality. */
bool shuffle_by_index_(const dstage *in);

/* ---- autotuning (engine/autotune.c) --------------------------------------------------------
 * Stages with "auto" settings register knobs (their .tune op); a tuner thread
 * per pipeline reads each knob's stage's st_wait_ns (the time its consumer
 * waited for it: keep it up to date) every period (10 ms, doubling to 2 s
 * while nothing changes) and raises the knob of the stage waited on most by
 * one while the CPU budget allows (tf.data's hill climb, measured rather than
 * modelled). Memory is settled at open: every buffer is allocated for its
 * knob's maximum, which the RAM budget caps. Stages read knob values with
 * dknob_get_ (relaxed atomics). An interleave registers its parallelism the
 * same way: dtuner_knob_(t, st, "parallel", 1, 1, cycle_length, 1) in .tune. */
typedef struct dknob {
    dstage     *stage;
    const char *what;        /* "parallel", "buffer" */
    int64_t     value;       /* atomic */
    int64_t     min, max;
    int         cpu;         /* a unit is a thread's worth of work: counts against the CPU budget */
    void      (*changed)(dstage *s); /* (optional) called on the tuner thread after value changes */
    int         inert;       /* atomic: the stage no longer has what the knob tunes (a prefetch gone
                                inline): never moved, left out of the summary */
} dknob;
static inline int64_t dknob_get_(const dknob *k) { return __atomic_load_n(&k->value, __ATOMIC_RELAXED); }
/* Registers a knob starting at value; NULL when the tuner is full (the stage keeps value). */
dknob *dtuner_knob_(dtuner *t, dstage *s, const char *what, int64_t value, int64_t min, int64_t max, int cpu);
/* CPU units of the budget not yet held by the knobs registered so far (their
 * start values): a stage may start a knob above its minimum within them. */
int64_t dtuner_cpu_spare_(const dtuner *t);
/* A tuner whose knobs of cpu units sum to at most cpu_budget. Free with dtuner_free_. */
int  dtuner_new_(dtuner **out, int cpu_budget, loom_err *err);
/* Names the pipeline's last stage: CPU knobs then rise only while its
 * consumer spends time in it (its busy time) and fall back after a second
 * without (autotune.c). Before dtuner_start_; NULL t is a no-op. */
void dtuner_output_(dtuner *t, dstage *last);
/* Starts the thread once the knobs are registered (none: no thread). */
int  dtuner_start_(dtuner *t, loom_err *err);
void dtuner_stop_(dtuner *t); /* stops the thread, the knobs stay readable; NULL is a no-op */
void dtuner_free_(dtuner *t); /* stops and frees, knobs included; NULL is a no-op */
/* "map(scale): parallel 3; prefetch(auto): buffer 2" into buf; whether the values have settled. */
int  dtuner_summary_(dtuner *t, char *buf, size_t n);
/* The RAM budget of o in bytes (its share of physical memory when not given). */
int64_t dtuner_ram_budget_(const loom_data_options *o);

/* batch and padded_batch: the batches a pass of c input elements (c < 0: the
 * input's INFINITE / UNKNOWN, passed through) gives, and in *dim0 the static
 * leading dimension: size when every batch is full (drop_remainder, an
 * infinite pass, or c divisible by size), else -1. */
int64_t dbatch_card_(int64_t c, int64_t size, bool drop, int64_t *dim0);
/* batch and padded_batch: gives feature f of st a leading batch dimension,
 * dim0 in its spec and size in its maxshape, and allocates its output tensor
 * at that maxshape; a feature already of rank LOOM_MAX_RANK is LOOM_ESHAPE,
 * what ("batch") naming the stage. */
int dbatch_feature_(dstage *st, int f, int64_t dim0, int64_t size, const char *what, loom_err *err);

/* ---- image pixel work (transform/image.c) ------------------------------------------ */

/* "PNG" or "JPEG" when the n bytes at p start with that format's signature, else NULL. */
const char *image_format_(const uint8_t *p, size_t n);
typedef struct image_info {
    int64_t h, w; /* from the header, 0 until it is read */
    int     c;    /* channels of the output */
} image_info;
/* Decodes the PNG or JPEG in the len bytes at data (bytes after the image's
 * end are ignored, so a zero-padded var_len feature decodes) into out as
 * (H, W, C) of dt: LOOM_U8, or LOOM_F32 in [0, 1] (16-bit PNGs keep their
 * precision). C = channels, or as stored when 0 (PNG 1 to 4, JPEG 1 or 3).
 * out holds max_h * max_w * C values of dt (C = 4 when channels is 0); an
 * image larger is refused from its header. 0, or -1 with why (whyn bytes)
 * saying what is wrong ("corrupt PNG: IDAT: CRC error"); info is filled
 * once the header is read. Reentrant. */
int  image_decode_(const uint8_t *data, size_t len, int channels, loom_dtype dt, int64_t max_h, int64_t max_w,
                   void *out, image_info *info, char *why, size_t whyn);
/* (H, W, C) of sd at src -> (h, w, C) float32 at dst: bilinear, half-pixel centres, as tf.image.resize. */
void image_resize_(const void *src, loom_dtype sd, int64_t H, int64_t W, int64_t C, float *dst, int64_t h, int64_t w);
/* tf.image.central_crop's box of an H x W image: box = {y0, x0, h, w}. */
void image_central_box_(int64_t H, int64_t W, double fraction, int64_t box[4]);
/* tf.image.adjust_brightness / adjust_contrast of n (hw * C) values of dt
 * (uint8 through [0, 1] floats, float32, float64); src == dst is allowed. */
void image_brightness_(const void *src, void *dst, loom_dtype dt, size_t n, double delta);
void image_contrast_(const void *src, void *dst, loom_dtype dt, int64_t hw, int64_t C, double factor);

#endif
