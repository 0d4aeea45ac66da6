/* custom.h - custom element functions: the interface through which a `map` or
 * `filter` transform calls code the data module does not know (Lua functions
 * from the script module, plugin code), dataset sources from plugins, and
 * the built-in tensor ops such code may reuse. Included by data.h;
 * plugins/loom_plugin.h restates the provider types (abi_check.c checks).
 *
 * A provider is registered by name in the shared registry (LOOM_REG_TRANSFORM,
 * e.g. "lua" by loom_script_register) as a loom_custom_ops. The data module
 * finds it when a transform names it (`lua = "lua/augment.lua:cutout"` asks
 * for provider "lua" with reference "lua/augment.lua:cutout"; `plugin =
 * "image_ops:cutout"` for provider "image_ops" with reference "cutout").
 *
 * Threads: open and close run on the thread that builds/closes the pipeline;
 * map and filter may run on several threads at once (at most max_calls calls
 * at a time, each on its own in/out buffers), so a provider keeps one
 * interpreter per concurrent call. Plain C, versioned: fields are appended. */
#ifndef LOOM_DATA_CUSTOM_H
#define LOOM_DATA_CUSTOM_H

#define LOOM_CUSTOM_OPS_VERSION 1

/* Options a config gives a provider (a plugin map's `args`, a plugin
 * source's `options`): scalars as text, in config order. */
#define LOOM_MAX_OPTIONS 8
typedef struct loom_options {
    int         n;
    const char *key[LOOM_MAX_OPTIONS];
    const char *value[LOOM_MAX_OPTIONS];
    const char *where[LOOM_MAX_OPTIONS]; /* "configs/x.cfg:12" (or "--set ..."), for messages */
} loom_options;

/* What a provider is opened with. */
typedef struct loom_custom_args {
    uint32_t              size;       /* sizeof(loom_custom_args) at the caller's build */
    const char           *ref;        /* the reference as written, "lua/augment.lua:cutout" */
    const char           *base_dir;   /* the config's directory (references are relative to it) */
    const char           *where;      /* "configs/x.cfg:31", the transform, for messages */
    const loom_elem_spec *in;         /* the elements it receives (may be batched) */
    const loom_shape     *in_max;     /* in's shapes with every -1 at its largest value */
    int                   filter;     /* 1: a predicate (no output spec), 0: a map */
    int                   max_calls;  /* most calls in flight at once (>= 1) */
    uint64_t              seed;       /* the run's seed, for the keyed RNG */
    const void           *options;    /* loom_data_ctx.custom_options, provider-specific ("lua": a
                                         loom_lua_opts, script.h); may be NULL = the provider's defaults */
    /* ---- appended; read only when size reaches them ---- */
    const loom_options   *args;       /* the transform's `args` (plugin providers); never NULL */
} loom_custom_args;

/* The RNG key of one call: the stream is loom_rng_init(seed, stage, epoch, index). */
typedef struct loom_custom_key {
    uint64_t seed;
    int64_t  stage;  /* the transform's position in the pipeline */
    int64_t  epoch;
    int64_t  index;  /* the element's position in this pass of the stage's input */
} loom_custom_key;

typedef struct loom_custom_ops {
    uint32_t    version; /* LOOM_CUSTOM_OPS_VERSION */
    const char *name;    /* "lua" */
    /* Opens an instance for args; a map fills *out with the spec of what it
     * returns (features, dtypes, max shapes; a dim that varies is -1 and
     * out_max gives its largest value). Errors name the file and line. */
    int  (*open)(void **inst, const loom_custom_args *args, loom_elem_spec *out, loom_shape *out_max, loom_err *err);
    /* Maps in to out. out's tensors arrive with the output spec's dtypes and
     * data buffers of the max shape; the provider writes the data and the
     * actual shapes. in is read-only. */
    int  (*map)(void *inst, const loom_elem *in, loom_elem *out, const loom_custom_key *key, loom_err *err);
    /* Sets *keep for in. */
    int  (*filter)(void *inst, const loom_elem *in, int *keep, const loom_custom_key *key, loom_err *err);
    void (*close)(void *inst); /* NULL is never passed */
} loom_custom_ops;

/* ---- dataset sources from providers (source/plugin.c) ----------------------
 * A source registered by name (LOOM_REG_SOURCE) by a plugin, selected by
 * source.type with its options. Threads: every function runs on the thread
 * driving the pipeline, one call at a time per instance. */
#define LOOM_SOURCE_OPS_VERSION 1

typedef struct loom_source_args {
    uint32_t            size;     /* sizeof(loom_source_args) at the caller's build */
    const char         *type;     /* the registry name, "npy" */
    const char         *base_dir; /* the config's directory: relative paths in options are relative to it */
    const char         *where;    /* "configs/x.cfg:12", the source group, for messages */
    const loom_options *options;  /* source.options; keys already checked against ops->options */
    uint64_t            seed;     /* the run's seed, for sources that draw random numbers */
} loom_source_args;

typedef struct loom_source_ops {
    uint32_t           version; /* LOOM_SOURCE_OPS_VERSION; append fields only */
    const char        *name;    /* what source.type selects */
    const char *const *options; /* keys source.options accepts (NULL-terminated, static); NULL: none;
                                   a "*" entry: any key (keys that name features) */
    /* Opens an instance: fills *spec with the elements next() yields (a dim
     * that varies is -1, max gives its largest value). Errors name the file
     * (or the option's where). close() is called whenever *inst is not
     * NULL, also after a failed open. */
    int     (*open)(void **inst, const loom_source_args *a, loom_elem_spec *spec, loom_shape *max, loom_err *err);
    int64_t (*cardinality)(void *inst);                      /* per pass; -1 infinite, -2 unknown */
    int     (*rewind)(void *inst, int64_t epoch, loom_err *err); /* starts pass `epoch` (0, 1, ...) */
    /* The next element of the pass, LOOM_EEOF after the last. out's tensors
     * arrive with the spec's dtypes and buffers of the max shapes: write them
     * and set the actual shapes, or point data at the source's own memory,
     * read-only and valid until the next call. */
    int     (*next)(void *inst, loom_elem *out, loom_err *err);
    /* Writes the state (epoch and position) to buf when it fits in cap;
     * returns its size either way (Loom calls again with a larger buf). */
    size_t  (*save)(void *inst, void *buf, size_t cap);
    int     (*restore)(void *inst, const void *buf, size_t len, loom_err *err); /* corrupt: LOOM_ECHECKPOINT */
    void    (*close)(void *inst);
} loom_source_ops;

/* ---- built-in ops on raw buffers (transform/convert.c, transforms.c), for custom code ---------- */

/* n values of dtype sd at src to dd at dst: float to int truncates toward
 * zero and saturates, NaN becomes 0. src == dst is allowed when sizes agree. */
void loom_data_convert(const void *src, loom_dtype sd, void *dst, loom_dtype dd, size_t n);
/* dst[i] = src[i] * sc + off, as float32. */
void loom_data_scale(const void *src, loom_dtype sd, float *dst, size_t n, float sc, float off);
/* dst[i] = (src[i] - mean) / std, as float32. */
void loom_data_normalize(const void *src, loom_dtype sd, float *dst, size_t n, float mean, float std);
/* Mean and population standard deviation (in double). */
void loom_data_moments(const void *src, loom_dtype sd, size_t n, double *mean, double *std);
/* (H, W) pixels of px bytes at src -> (H + 2p, W + 2p) at dst, the border
 * filled with the esz-byte value at fill. */
void loom_data_pad_image(const uint8_t *src, uint8_t *dst, int64_t H, int64_t W, int64_t p, size_t px,
                         const uint8_t *fill, size_t esz);
/* Mirrors each row of an (H, W) image of px-byte pixels; src == dst allowed. */
void loom_data_flip_image(const uint8_t *src, uint8_t *dst, int64_t H, int64_t W, size_t px);

#endif
