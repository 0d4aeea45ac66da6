/* data_internal.h - private to appliance/data: the stage vtable every
 * iterator implements, slot pools for stages that hold copies of elements
 * (shuffle, prefetch), and the constructors pipeline.c chains together.
 * Threads: a stage is driven by one thread at a time (the train thread, or
 * the producer thread of the prefetch stage downstream of it); the stats
 * counters are atomics so loom_iter_stats may read them from any thread. */
#ifndef LOOM_DATA_INTERNAL_H
#define LOOM_DATA_INTERNAL_H

#include "data.h"

typedef struct dstage dstage;

typedef struct dstage_ops {
    int  (*next)(dstage *s, loom_elem **out, loom_err *err);     /* LOOM_EEOF at the end of a pass, sticky */
    int  (*rewind)(dstage *s, int64_t epoch, loom_err *err);     /* starts pass `epoch`, rewinding the input */
    void (*save)(dstage *s, loom_buf *b);                        /* this stage's own state only */
    int  (*restore)(dstage *s, loom_buf *b, loom_err *err);      /* this stage's own state only */
    void (*pause)(dstage *s);                                    /* (optional) quiesce background work */
    void (*resume)(dstage *s);                                   /* (optional) undo pause */
    void (*close)(dstage *s);                                    /* frees s */
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
};

/* Pulls the next element from s, accounting its stats. */
int  dstage_next_(dstage *s, loom_elem **out, loom_err *err);
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

/* ---- element slot pools (elem.c) ---------------------------------------- */

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
} elem_pool;

int  elem_pool_init_(elem_pool *p, const dstage *s, int64_t cap, loom_err *err);
int  elem_pool_grow_(elem_pool *p, int64_t cap, loom_err *err);   /* keeps slot contents */
void elem_pool_fini_(elem_pool *p);
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
int shuffle_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, const loom_data_ctx *ctx, loom_err *err);
int batch_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err);
int repeat_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err);
int take_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err);
int skip_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err);
/* threaded == 0: runs inline (no background thread). */
int prefetch_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, int threaded, loom_err *err);
/* transforms_more.c; cache takes the source spec for its file fingerprint. */
int filter_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err);
int shard_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err);
int enumerate_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err);
int unbatch_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err);
int padded_batch_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err);
int cache_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, const loom_source_spec *src, loom_err *err);

/* ---- parallel map (parmap.c) ------------------------------------------------
 * One worker pool per pipeline, shared by every parallel map (no thread per
 * element or per batch). A task runs fn(arg) on a worker; tasks must not
 * block on each other. With 0 threads, submit runs the task inline. */
typedef struct dtask {
    void        (*fn)(void *arg);
    void         *arg;
    struct dtask *next;
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
void    map_scratch_(const dstage *map, size_t *buf_bytes, size_t *flag_bytes);
/* t->parallel > 1 or LOOM_PARALLEL_AUTO: a map over *pool (created on first use, sized from ctx->threads). */
int parmap_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, const loom_data_ctx *ctx, dpool **pool,
                 loom_err *err);

/* ---- file-list sources (source_files.c) ------------------------------------ */

/* Expands src's patterns (each must still match a regular file) into *files,
 * sorted and unique, *n of them; what ("tfrecord", "csv") names the list in
 * messages. On failure *files may hold some entries: free with source_files_free_. */
int  source_files_expand_(const dstage *st, const loom_source_spec *src, const char *what, char ***files, int64_t *n,
                          loom_err *err);
void source_files_free_(char **files, int64_t n);

/* A buffered reader of one plain file that knows its byte offset. */
typedef struct src_file {
    FILE    *f;        /* NULL when closed */
    uint8_t *buf;      /* SRC_FILE_BUF bytes */
    size_t   len, pos; /* valid bytes in buf, next byte */
    uint64_t offset;   /* file offset of buf[pos] */
    int      error;    /* errno of a failed read, sticky */
} src_file;
/* Opens path positioned at byte offset (an offset past the end is LOOM_ECHECKPOINT). */
int  src_file_open_(src_file *r, const char *path, uint64_t offset, loom_err *err);
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

/* The state of a line-oriented file-list source (csv, text): epoch, file
 * index, and in the open file the byte offset and line of the next read
 * (both 0 when no file is open). */
typedef struct src_pos {
    int64_t  epoch, fi;
    uint64_t offset;
    int64_t  line;
    bool     done;
} src_pos;
void src_pos_save_(loom_buf *b, const src_pos *p);
/* Reads what src_pos_save_ wrote and checks it against n_files; an open file
 * (offset > 0) must be at line >= min_line. what ("csv", "text") names the
 * source in the LOOM_ECHECKPOINT message. */
int  src_pos_restore_(loom_buf *b, const char *what, int64_t n_files, int64_t min_line, src_pos *p, loom_err *err);

/* ---- CSV records (source_csv.c; also driven by tests/fuzz/fuzz_csv.c) ------- */

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

int tfrecord_source_open_(dstage **out, const loom_source_spec *src, const loom_data_ctx *ctx, loom_err *err);
int csv_source_open_(dstage **out, const loom_source_spec *src, loom_err *err);
int text_source_open_(dstage **out, const loom_source_spec *src, loom_err *err);
int synthetic_source_open_(dstage **out, const loom_source_spec *src, const loom_data_ctx *ctx, loom_err *err);

#endif
