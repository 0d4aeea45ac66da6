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

#endif
