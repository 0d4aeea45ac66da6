/* core.h - the base every module stands on: errors with provenance, logging,
 * allocation (with a failure hook for tests), byte buffers for state,
 * the counter-based RNG, CRC-32C, clocks and a fixed worker pool.
 * Threads: everything here is thread-safe except a loom_buf, which belongs to
 * one thread at a time. Depends on nothing but libc and pthreads. */
#ifndef LOOM_CORE_H
#define LOOM_CORE_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define LOOM_VERSION "0.1.0"

/* ---- errors -------------------------------------------------------------- */

#define LOOM_ERRORS(X)                                   \
    X(OK, "ok")                                          \
    X(NOMEM, "out of memory")                            \
    X(CONFIG, "invalid configuration")                   \
    X(USAGE, "invalid usage")                            \
    X(IO, "i/o error")                                   \
    X(DATA, "bad input data")                            \
    X(SHAPE, "shape or dtype mismatch")                  \
    X(CHECKPOINT, "bad checkpoint")                      \
    X(NUMERIC, "non-finite value")                       \
    X(UNSUPPORTED, "not supported yet")                  \
    X(CUDA, "CUDA error")                                \
    X(NCCL, "NCCL error")                                \
    X(NET, "network error")                              \
    X(LUA, "Lua hook error")                             \
    X(PLUGIN, "plugin error")                            \
    X(EOF, "end of data")                                \
    X(TIMEOUT, "timed out")

typedef enum {
#define LOOM_ERR_ENUM_(name, msg) LOOM_E##name,
    LOOM_ERRORS(LOOM_ERR_ENUM_)
#undef LOOM_ERR_ENUM_
    LOOM_ENUM_ERRORS_
} loom_errcode;

#define LOOM_OK LOOM_EOK

/* Detail of a failure; caller-owned, filled by the callee. */
typedef struct loom_err {
    int  code;        /* LOOM_E* */
    char where[256];  /* "configs/fashion_mlp.cfg:42", "data/train-images.gz" */
    char msg[512];    /* what failed, quoting the offending value */
    char hint[256];   /* what to do about it; may be empty */
} loom_err;

const char *loom_err_name(int code);    /* "CONFIG" */
const char *loom_err_string(int code);  /* "invalid configuration" */

/* Fills err (may be NULL) and returns code, so callers can `return loom_err_set(...)`.
 * where may be NULL or "". */
int loom_err_set(loom_err *err, int code, const char *where, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Sets the hint of an already filled error; returns err->code. */
int loom_err_hint(loom_err *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Prepends "prefix: " to the message, keeping where and hint. Returns err->code. */
int loom_err_prefix(loom_err *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void loom_err_clear(loom_err *err);
/* "where: msg\n  hint: ...\n" into buf. */
void loom_err_format(const loom_err *err, char *buf, size_t n);
/* The signal (SIGINT, SIGTERM) that stopped this process's command once it
 * had saved what it had to: the trainer and the sidecar evaluator note it
 * as they turn the signal into their error, and main exits 128 + it (130,
 * 143), the status a shell gives a process the signal killed. 0: none. */
void loom_stop_signal_note(int sig);
int  loom_stop_signal(void);

#define LOOM_ASSERT(cond)                                                   \
    do {                                                                    \
        if (!(cond)) loom_assert_fail_(#cond, __FILE__, __LINE__);          \
    } while (0)
_Noreturn void loom_assert_fail_(const char *cond, const char *file, int line);

/* ---- logging ------------------------------------------------------------- */

typedef enum { LOOM_LOG_DEBUG, LOOM_LOG_INFO, LOOM_LOG_WARN, LOOM_LOG_ERROR } loom_log_level;
void loom_log_set_level(loom_log_level lvl);
/* A name put in every log line, "loom[worker:1]: ...", for processes of one
 * job whose logs interleave; NULL or "" = none. Set before threads log. */
void loom_log_set_name(const char *name);
loom_log_level loom_log_get_level(void);
void loom_log(loom_log_level lvl, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define loom_info(...)  loom_log(LOOM_LOG_INFO, __VA_ARGS__)
#define loom_warn(...)  loom_log(LOOM_LOG_WARN, __VA_ARGS__)
#define loom_debug(...) loom_log(LOOM_LOG_DEBUG, __VA_ARGS__)

/* A rate limit for a log line that an outsider can trigger at will (a
 * connection flood, a storm of bad handshakes): at most `burst` lines at
 * once, then one per `interval` seconds; the lines that do not pass are
 * counted, and the next line that passes reports the count. One per source
 * of such lines; not thread-safe (its owner's thread, or under its lock).
 * A zeroed struct is a limit of 1 line a second, burst 1. */
typedef struct loom_ratelimit {
    double   interval;   /* seconds per line after the burst (0: 1 s) */
    int      burst;      /* lines passed at once (0: 1) */
    double   tokens, last;
    uint64_t suppressed; /* lines refused since the last one that passed */
    bool     started;
} loom_ratelimit;
/* True when a line may be logged now; *suppressed (may be NULL) gets how many
 * were refused since the last that passed (then reset). */
bool loom_ratelimit_pass(loom_ratelimit *r, uint64_t *suppressed);

/* ---- descriptors (servers under a connection flood) ----------------------- */

/* Raises the soft RLIMIT_NOFILE to the hard limit (main does, at start);
 * returns the soft limit in force afterwards. */
long loom_fd_limit_raise(void);
/* The soft RLIMIT_NOFILE now (1024 when unknown; at most 2^20). */
long loom_fd_limit(void);
/* A listener's connection bound derived from the descriptor limit: limit /
 * div, clamped to [lo, hi]. Bounds from it leave the rest of the limit to
 * checkpoints, data files and the other connections. */
int  loom_fd_bound(int div, int lo, int hi);
/* The reserve-descriptor trick for a listener that hit EMFILE/ENFILE: an
 * open /dev/null kept in *reserve is closed, one pending connection of the
 * listening socket lfd is accepted and closed at once (so the backlog
 * drains instead of waking the loop for ever), and the reserve reopened.
 * Returns 1 when a connection was shed, 0 when none was pending or the
 * reserve could not be reopened (*reserve is then -1; call again to retry). */
int  loom_fd_reserve_open(void);  /* an fd for *reserve, or -1 */
int  loom_fd_reserve_shed(int *reserve, int lfd);

/* ---- allocation ---------------------------------------------------------- */

/* All allocations go through these. They return NULL on failure (never abort);
 * loom_alloc_fail_after(n) makes the n-th next allocation fail (tests). */
void *loom_alloc(size_t n);
void *loom_calloc(size_t count, size_t size);
void *loom_realloc(void *p, size_t n);
void *loom_alloc_aligned(size_t n);  /* 64-byte aligned; free with loom_free */
/* n zeroed bytes, 64-byte aligned; free with loom_free_zeroed. From 1 MiB
 * they are fresh anonymous pages, zeroed by the kernel when first touched:
 * a model's parameters, gradients and optimizer slots cost nothing until
 * used (`loom check` of ResNet-50 built 300 MB of them with memset). */
void *loom_alloc_zeroed(size_t n);
void  loom_free_zeroed(void *p);
void  loom_free(void *p);
char *loom_strdup(const char *s);
void  loom_alloc_fail_after(long n); /* -1 disables */

/* ---- byte buffers (state serialisation) ---------------------------------- */

/* A growable byte buffer for writing, and a cursor for reading back.
 * Integers are little-endian, fixed width. */
typedef struct loom_buf {
    uint8_t *data;
    size_t   len, cap;
    size_t   pos;     /* read cursor */
    int      failed;  /* sticky: an append ran out of memory or a read ran past the end */
} loom_buf;

void loom_buf_init(loom_buf *b);
void loom_buf_fini(loom_buf *b);
/* Wraps existing bytes for reading (not owned, not freed by fini). */
void loom_buf_wrap(loom_buf *b, const void *data, size_t len);
void loom_buf_put(loom_buf *b, const void *p, size_t n);
void loom_buf_put_u32(loom_buf *b, uint32_t v);
void loom_buf_put_u64(loom_buf *b, uint64_t v);
void loom_buf_put_i64(loom_buf *b, int64_t v);
void loom_buf_put_f64(loom_buf *b, double v);
void loom_buf_put_str(loom_buf *b, const char *s);  /* u32 length + bytes */
int  loom_buf_get(loom_buf *b, void *p, size_t n);  /* 0 ok, -1 short (sets failed) */
uint32_t loom_buf_get_u32(loom_buf *b);
uint64_t loom_buf_get_u64(loom_buf *b);
int64_t  loom_buf_get_i64(loom_buf *b);
double   loom_buf_get_f64(loom_buf *b);
/* Reads a string written by put_str into dst (NUL-terminated, cut at n-1). */
int  loom_buf_get_str(loom_buf *b, char *dst, size_t n);
/* Pointer to the next n bytes, advancing the cursor; NULL when short. */
const void *loom_buf_take(loom_buf *b, size_t n);

/* ---- RNG ----------------------------------------------------------------- */

/* Philox4x32-10: counter-based, so a stream is a pure function of
 * (key, counter). Streams are split by hashing labels into the key, so every
 * consumer of randomness (initialiser, shuffle, dropout, augmentation) has its
 * own reproducible stream, independent of thread count and scheduling. */
typedef struct loom_rng {
    uint64_t key;      /* seed mixed with the stream labels */
    uint64_t counter;  /* blocks consumed */
    uint32_t buf[4];
    int      avail;    /* unused words left in buf */
} loom_rng;

/* Stream derived from seed and up to three labels (e.g. purpose, epoch, index). */
void     loom_rng_init(loom_rng *r, uint64_t seed, uint64_t a, uint64_t b, uint64_t c);
uint64_t loom_rng_mix(uint64_t seed, uint64_t label);  /* a splitting hash */
uint32_t loom_rng_u32(loom_rng *r);
uint64_t loom_rng_u64(loom_rng *r);
float    loom_rng_uniform(loom_rng *r);                 /* [0, 1) with 24 bits */
double   loom_rng_uniform64(loom_rng *r);               /* [0, 1) with 53 bits */
float    loom_rng_normal(loom_rng *r);                  /* N(0,1), Box-Muller */
uint64_t loom_rng_below(loom_rng *r, uint64_t n);       /* uniform in [0, n), unbiased */
/* The raw block function: 4 words for (key, counter). */
void     loom_philox4x32(uint64_t key, uint64_t counter, uint32_t out[4]);
void     loom_rng_save(const loom_rng *r, loom_buf *b);
int      loom_rng_restore(loom_rng *r, loom_buf *b);

/* ---- CRC-32C ------------------------------------------------------------- */

uint32_t loom_crc32c_extend(uint32_t crc, const void *data, size_t n);
static inline uint32_t loom_crc32c(const void *data, size_t n) { return loom_crc32c_extend(0, data, n); }
/* TFRecord's masking: rotate right by 15 and add 0xa282ead8. */
static inline uint32_t loom_crc32c_mask(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

/* ---- clocks -------------------------------------------------------------- */

double loom_now(void);       /* monotonic seconds */
double loom_wall_time(void); /* seconds since the epoch */

/* ---- the CPU (cpuid.c) ---------------------------------------------------- */

/* What the CPU can do, asked of CPUID once per process; every kernel or clock
 * choice reads it here (tensor's loom_cpu() adds the kernel level). */
typedef struct loom_cpu_features {
    char        vendor[13];    /* "GenuineIntel", "AuthenticAMD"; "unknown" off x86 */
    char        brand[49];     /* "AMD EPYC 9R14 96-Core Processor"; may be empty */
    int         family, model; /* as CPUID leaf 1 gives them, extended fields folded in */
    bool        sse42, avx2, fma, avx512f, avx512bw, avx512vl, avx512dq; /* supported by the CPU and saved by the OS */
    bool        f16c;          /* CPUID leaf 1 ECX bit 29, with AVX (clang's __builtin_cpu_supports does not know it) */
    bool        tsc_invariant; /* CPUID 0x80000007 EDX bit 8: the TSC runs at a constant rate, never stops */
    const char *capped;        /* tests only: "avx2" or "baseline" when LOOM_TEST_CPU hid the features above it */
} loom_cpu_features;
/* Read once (thread-safe); borrowed for the process's life. */
const loom_cpu_features *loom_cpu_probe(void);

/* ---- thread pool --------------------------------------------------------- */

/* A fixed pool started once. loom_pool_run runs fn(arg, i) for i in [0, n)
 * across the pool and the calling thread and returns when all are done. */
typedef struct loom_pool loom_pool;
typedef void (*loom_pool_fn)(void *arg, int i);
int  loom_pool_new(loom_pool **out, int threads, loom_err *err); /* free with loom_pool_free */
void loom_pool_free(loom_pool *p);                               /* NULL is a no-op */
int  loom_pool_size(const loom_pool *p);                         /* threads incl. caller */
void loom_pool_run(loom_pool *p, int n, loom_pool_fn fn, void *arg);
/* Between jobs a worker busy-waits up to usec for the next one before it
 * sleeps, and loom_pool_run's caller as long for the workers to finish
 * (0, the default: both sleep at once). For pools whose jobs come back to
 * back (a training step's phases): a futex wake-up costs 5-50 us on a VM,
 * more than a small phase. Bounded, so an idle pool still sleeps; and
 * adaptive (halved after a wait that timed out, doubled after one that did
 * not), so on an oversubscribed machine the pool sleeps nearly at once
 * instead of burning the CPU share its computing threads need. */
void loom_pool_set_spin(loom_pool *p, int usec);
int64_t loom_pool_sleeps(const loom_pool *p); /* condition-variable waits of the pool's threads and callers so far */

/* Number of cores this process may run on (sched_getaffinity). */
int loom_num_cores(void);

/* Pins a pool's threads to cores, each cores[i] an index in [0,
 * loom_num_cores()) into the CPUs this process may run on: worker i to
 * cores[i + 1] at once, and the calling thread to cores[0] for the length of
 * each loom_pool_run (its own mask comes back after, so threads it starts
 * between runs are not pinned). cores has loom_pool_size(p) entries.
 * Collectives between the threads need this: unpinned, the scheduler now
 * and then puts two of them on one core, which halves a ring all-reduce's
 * bandwidth for that call (tests/bench/allreduce_bench). */
int loom_pool_pin(loom_pool *p, const int *cores, loom_err *err);

/* ---- checked arithmetic ---------------------------------------------------- */

/* *out = a * b (or a + b); 0 when it does not fit an int64_t, *out then unspecified.
 * Every product of dimensions (a shape's element count, times a batch, times a
 * dtype's size) goes through these. */
static inline int loom_mul_ok(int64_t a, int64_t b, int64_t *out) { return !__builtin_mul_overflow(a, b, out); }
static inline int loom_add_ok(int64_t a, int64_t b, int64_t *out) { return !__builtin_add_overflow(a, b, out); }
/* The product of n dims (1 for n == 0); 0 when a dim is negative or it overflows. */
static inline int loom_dims_ok(const int64_t *dim, int n, int64_t *out)
{
    int64_t p = 1;
    for (int i = 0; i < n; i++)
        if (dim[i] < 0 || !loom_mul_ok(p, dim[i], &p)) return 0;
    *out = p;
    return 1;
}
/* Physical memory in bytes (INT64_MAX when unknown). */
int64_t loom_phys_bytes(void);

/* ---- files --------------------------------------------------------------- */

/* Opens a user's file for reading: without blocking (a FIFO would wait for a
 * writer forever), then refuses anything but a regular file, naming what it
 * is. Every file loom reads from the user (configs, includes, data,
 * checkpoints, Lua files, plugins) is opened through it. Returns the fd
 * (blocking again, close with close()) or -1 with err set. */
int   loom_open_regular(const char *path, loom_err *err);
/* The same as a stdio stream; fclose it. NULL with err set on failure. */
FILE *loom_fopen_regular(const char *path, loom_err *err);
/* Opens a user's file for appending (created 0644 when missing) the same way:
 * a FIFO (opening it for writing waits for a reader), a device or a directory
 * is refused naming what it is. A stdio stream; NULL with err set. */
FILE *loom_fopen_append_regular(const char *path, loom_err *err);

/* A streaming reader of a regular file, plain or gzip (detected from the
 * magic bytes): callers read a header, check it, and bound what follows by
 * what the header declares, so a gzip bomb is refused before it inflates. */
typedef struct loom_rfile loom_rfile; /* opaque; close with loom_rfile_close */
int  loom_rfile_open(loom_rfile **out, const char *path, loom_err *err);
/* Reads up to n bytes into buf; *got < n only at the end of the data. */
int  loom_rfile_read(loom_rfile *f, void *buf, size_t n, size_t *got, loom_err *err);
bool loom_rfile_is_gzip(const loom_rfile *f);
void loom_rfile_close(loom_rfile *f); /* NULL is a no-op */

/* Reads a whole file (plain or gzip, detected from the magic bytes) into
 * memory, NUL-terminated. *out is freed with loom_free. */
int loom_read_file(const char *path, uint8_t **out, size_t *len, loom_err *err);
/* The same, refusing (LOOM_EDATA) a file whose content exceeds max bytes
 * (0: no limit) without reading or inflating more than max + 1 of them. */
int loom_read_file_max(const char *path, uint8_t **out, size_t *len, uint64_t max, loom_err *err);
/* Removes path.tmp.<host>.<pid> files in dir (loom_write_file_atomic's)
 * written on this host by a process no longer alive, logging each; returns
 * how many. Files of other hosts (a model_dir on NFS shared by several
 * machines) are left to their host: their pid says nothing here. The older
 * form path.tmp.<pid> counts as this host's. */
int loom_remove_stale_tmp(const char *dir);
/* Where loom may write a path the user named (--output, a model directory's
 * files): absent (created), a regular file (replaced), or a symbolic link
 * (chain) to a regular file, whose target is written and the link kept;
 * target gets that path (n bytes). Anything else (a FIFO, a device, a
 * directory, a socket, a link to one of them or to nothing) is LOOM_EIO
 * naming the path and what it is, with a hint, before anything is written.
 * Every writer of a user's path goes through it. */
int loom_output_target(const char *path, char *target, size_t n, loom_err *err);
/* Writes data to path atomically: target.tmp.<host>.<pid> beside the
 * target (loom_output_target's: refused unless absent or regular, a link
 * written through), fsync, rename onto the target, fsync dir. */
int loom_write_file_atomic(const char *path, const void *data, size_t len, loom_err *err);
/* The same for an output written as a stream (loom predict's CSV): open
 * checks path and creates the temporary file; commit flushes, syncs and
 * renames it onto the target, abort removes it; either frees w. */
typedef struct loom_wfile loom_wfile; /* opaque */
int   loom_wfile_open(loom_wfile **out, const char *path, loom_err *err);
FILE *loom_wfile_stream(loom_wfile *w); /* borrowed until commit/abort */
int   loom_wfile_commit(loom_wfile *w, loom_err *err);
void  loom_wfile_abort(loom_wfile *w); /* NULL is a no-op */
/* ".tmp.<host>.<pid>": the suffix of this process's temporary files, which
 * loom_remove_stale_tmp recognises (host: the hostname, characters other
 * than letters, digits, '-' and '_' as '_'). Returns buf. */
char *loom_tmp_suffix(char *buf, size_t n);
/* path normalised lexically, in place: "//" and "/./" become "/", "x/.."
 * goes ("/a/j6/../j5/ckpt" is "/a/j5/ckpt"), no trailing '/'; a relative
 * path keeps its leading ".."s; "" is ".". The file system is not asked (a
 * symbolic link before a ".." is taken as a directory). Returns path. */
char *loom_path_normalize(char *path);
/* mkdir -p; fails with a clear error when the directory is not writable. */
int loom_mkdirs(const char *path, loom_err *err);
/* s with glob's metacharacters (*?[]\) backslash-escaped into out (n bytes),
 * so that only a pattern appended to it globs. Returns its length, -1 when it does not fit. */
int loom_glob_escape(const char *s, char *out, size_t n);

/* ---- registry ------------------------------------------------------------ */

/* Named providers shared by built-ins and plugins: each is a pointer to a
 * vtable whose type belongs to the module that uses it (loom_cross_device_ops
 * and loom_strategy_ops in distribute.h, ...). Names are unique per kind; a
 * second registration of a taken name is LOOM_EPLUGIN naming both origins.
 * origin says who registered it: "built-in" (NULL) or the plugin's path.
 * The name string and the vtable must outlive the process (static storage).
 * Thread-safe. */
typedef enum {
    LOOM_REG_CROSS_DEVICE_OPS,
    LOOM_REG_STRATEGY,
    LOOM_REG_SOURCE,
    LOOM_REG_TRANSFORM,
    LOOM_REG_DEVICE,
    LOOM_REG_LAYER, /* appended: plugin layer kinds (nn/layer_plugin.h) */
    LOOM_REG_KINDS
} loom_reg_kind;

const char *loom_reg_kind_name(loom_reg_kind kind); /* "cross-device ops" */
int         loom_registry_add(loom_reg_kind kind, const char *name, const void *provider, const char *origin,
                              loom_err *err);
/* The provider registered under name, NULL when none; *origin (may be NULL) its origin. */
const void *loom_registry_find(loom_reg_kind kind, const char *name, const char **origin);
int         loom_registry_count(loom_reg_kind kind);
/* The idx-th provider of kind in registration order; -1 past the end. */
int         loom_registry_entry(loom_reg_kind kind, int idx, const char **name, const void **provider,
                                const char **origin);
/* "a, b, c" into buf; returns buf. */
char       *loom_registry_names(loom_reg_kind kind, char *buf, size_t n);

/* Levenshtein distance, for "did you mean" suggestions. */
int loom_edit_distance(const char *a, const char *b);

#endif
