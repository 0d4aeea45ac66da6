/* ps_internal.h - parameter_server's parts shared by parameter_server.c,
 * ps_coord.c, ps_worker.c, ps_task.c, ps_ckpt.c, ps_plan.c, ps_wire.c, the
 * unit tests and the fuzzer (tests/fuzz/fuzz_ps_wire.c).
 *
 * Placement (ps_plan.c): every parameter tensor of the model is a variable;
 * a partitioner (tf.distribute.experimental.partitioners) splits it along
 * axis 0 into shards of whole rows, the first rows % k shards one row
 * longer (13 rows over 5: 3,3,3,2,2); variables, and each shard of a split
 * variable, take the ps tasks round-robin in model order (TF2's
 * ParameterServerStrategyV2 and replica_device_setter). A shard is a
 * contiguous range of the model's flat buffer; a ps keeps its shards back to
 * back in a local buffer (and its optimizer's slots in the same layout), so
 * the element-wise optimizer runs there on its own shards.
 *
 * Messages (ps_wire.c), all little-endian, types from LOOM_PS_MSG_FIRST:
 *   header (32 bytes): u64 req, u64 nonce, i64 step, u32 flags, u32 n_ranges
 *   then n_ranges ranges: u32 shard, u32 n_rows (LOOM_PS_WHOLE = the whole
 *   shard), n_rows u32 row ids (rows of the shard, 0-based, each < its rows),
 *   and, in messages that carry values, the floats: the whole shard's, or
 *   n_rows * row_size in the order of the ids; with LOOM_PS_F_SLOTS the
 *   optimizer's slots follow the same way, slot after slot.
 *   INIT    chief -> ps: every shard of the ps whole, with slots; step = the
 *           applied updates so far; nonce = the job's incarnation
 *   PULL    -> ps: the ranges wanted (no values); step = the least applied
 *           count to answer with (synchronous mode: wait for the update)
 *   VALUES  ps ->: the values of a PULL's ranges; step = applied updates
 *   PUSH    worker -> ps: gradients of ranges; step = the applied count the
 *           worker read (synchronous mode: the step they are for); nonce
 *   PUSHED  ps -> worker: step = applied updates; flags ACCEPTED (or stale);
 *           a PUSH with flag PULL is answered with VALUES (flag ACCEPTED): one
 *           round trip per step instead of two
 *   RUN     chief -> worker: u64 fn, u64 nonce, i64 first step, u32 steps, u32 flags
 *   RESULT  worker -> chief: u64 fn, u32 n, then per step i64 step,
 *           u32 accepted, f64 loss_sum, i64 correct, i64 examples; then
 *           u64 bytes, u64 rows: what those steps moved (loom_ps_traffic)
 * Sparse updates: a worker's PULL and PUSH name a table's shard by the rows
 * its batch looks up (n_rows ids, distinct); a shard none of them falls in
 * is left out. The other shards go whole, as ever.
 *   END     chief -> every task: the job is done
 *   REFUSED ps -> sender: u32 length + text saying why a message was refused
 *   SAVE    chief -> ps: header (step = the checkpoint's), u32 length + the
 *           directory (absolute) to write the shard file in
 *   SAVED   ps -> chief: header (step), u64 size, u32 crc32c, u32 length +
 *           the file's name (in that directory)
 * Decoders never trust a count beyond the plan or the bytes given.
 *
 * Checkpoints: on SAVE each ps writes every shard it holds, with its
 * optimizer slots, to <dir>/ckpt-<step>.data-<ps>-of-<n_ps> (the
 * trainer's writer: written to a temporary name, synced, renamed) and
 * answers with its size and CRC; the chief commits the index ckpt-<step>.loom
 * naming them only when every ps has answered (train/checkpoint.c). */
#ifndef LOOM_PS_INTERNAL_H
#define LOOM_PS_INTERNAL_H

#include "distribute.h"

/* ---- placement ----------------------------------------------------------- */

typedef struct loom_ps_shard {
    int     var;            /* the parameter tensor (model order) */
    int     index, of;      /* shard index of `of` shards of the variable */
    int64_t row0, rows;     /* rows [row0, row0 + rows) of the variable */
    int64_t row_size;       /* floats per row */
    int64_t offset, count;  /* floats in the model's flat buffer */
    int     ps;             /* the ps task that holds it */
    int64_t local;          /* its offset in that ps's local buffer */
} loom_ps_shard;

typedef struct loom_ps_plan {
    int            n_ps, n_shards;
    loom_ps_shard *shard;     /* n_shards, in model order */
    int64_t       *ps_floats; /* per ps: floats it holds */
    int            n_capped;  /* variables whose shard count was capped at their rows */
} loom_ps_plan;

/* Shards a partitioner gives a variable of `rows` rows and `elems` floats
 * (TF's arithmetic, tf_semantics 5.8); 1 without a partitioner. Never more
 * than rows (TF caps fixed shards the same way). */
int64_t loom_ps_num_shards_(const loom_partitioner_spec *p, int64_t rows, int64_t elems);
/* Shard i of k over rows: the first rows % k shards get one extra row. */
void loom_ps_shard_rows_(int64_t rows, int64_t k, int64_t i, int64_t *row0, int64_t *n);
/* The plan for n parameter tensors (tiling [0, total)) over n_ps tasks.
 * A fixed partitioner asking more shards than the largest variable has
 * rows is LOOM_ECONFIG naming it (where: the partitioner's file:line). */
int  loom_ps_plan_make_(loom_ps_plan *out, const loom_param_info *params, int n, int n_ps,
                        const loom_partitioner_spec *p, const char *where, loom_err *err);
void loom_ps_plan_free_(loom_ps_plan *p);
/* `loom check`: which ps holds which variable or shard, and bytes per ps. */
/* "296 B", "198.5 KiB", "64.0 MiB" */
void loom_ps_bytes_str_(int64_t b, char *buf, size_t n);
void loom_ps_plan_print_(const loom_ps_plan *p, const loom_param_info *params, int n_slots, FILE *f);

/* A hash of the partitioning (each shard's variable name, shape, index,
 * rows and ps): two plans agree when their ids do. */
uint64_t loom_ps_plan_id_(const loom_ps_plan *p, const loom_param_info *params);
/* Record name of shard i in a checkpoint: the variable's name when it is
 * whole, "<name>/part_<index>" (TF's) when split. */
void loom_ps_record_name_(const loom_ps_plan *p, const loom_param_info *params, int i, char *buf, size_t n);

/* ---- messages ------------------------------------------------------------ */

enum {
    LOOM_PS_MSG_FIRST = LOOM_MSG_USER + 32,
    LOOM_PS_MSG_INIT = LOOM_PS_MSG_FIRST,
    LOOM_PS_MSG_INIT_OK,
    LOOM_PS_MSG_PULL,
    LOOM_PS_MSG_VALUES,
    LOOM_PS_MSG_PUSH,
    LOOM_PS_MSG_PUSHED,
    LOOM_PS_MSG_RUN,
    LOOM_PS_MSG_RESULT,
    LOOM_PS_MSG_END,
    LOOM_PS_MSG_REFUSED,
    LOOM_PS_MSG_SAVE,   /* sharded checkpoints (ps_internal.h's "Checkpoints" below) */
    LOOM_PS_MSG_SAVED,
    LOOM_PS_MSG_LAST = LOOM_PS_MSG_SAVED,
};

#define LOOM_PS_WHOLE      0xffffffffu
#define LOOM_PS_F_SLOTS    1u /* ranges carry the optimizer's slots after the values */
#define LOOM_PS_F_ACCEPTED 2u /* PUSHED: the gradients were applied (or aggregated) */
#define LOOM_PS_F_PULL     4u /* PUSH (asynchronous): answer with the ranges' new values (VALUES) instead of PUSHED */
#define LOOM_PS_HDR        32

typedef struct loom_ps_hdr {
    uint64_t req, nonce;
    int64_t  step;
    uint32_t flags, n_ranges;
} loom_ps_hdr;

typedef struct loom_ps_range {
    uint32_t       shard;
    uint32_t       n_rows;  /* LOOM_PS_WHOLE: the whole shard */
    const uint8_t *rows;    /* n_rows u32 (unaligned; loom_ps_row_) */
    const uint8_t *vals;    /* n_vals floats (unaligned; memcpy), NULL without values */
    int64_t        n_vals;  /* per block: values, then each slot */
} loom_ps_range;

typedef struct loom_ps_msg {
    loom_ps_hdr    h;
    int            n;
    loom_ps_range *r;       /* n; free with loom_ps_msg_fini_ */
} loom_ps_msg;

/* Decodes a range message (INIT, PULL, VALUES, PUSH) of len bytes against
 * the plan: each shard must exist and (ps >= 0) belong to ps; row ids below
 * the shard's rows; values present exactly when with_values, sized by the
 * rows and (LOOM_PS_F_SLOTS) n_slots; no byte left over. LOOM_EDATA naming
 * what is wrong. m borrows p. */
int  loom_ps_decode_(const uint8_t *p, size_t len, const loom_ps_plan *plan, int ps, int n_slots, bool with_values,
                     loom_ps_msg *m, loom_err *err);
void loom_ps_msg_fini_(loom_ps_msg *m);
uint32_t loom_ps_row_(const loom_ps_range *r, uint32_t i);

void loom_ps_put_hdr_(loom_buf *b, const loom_ps_hdr *h);
/* A range: shard, rows (NULL with n_rows = LOOM_PS_WHOLE), then n_vals
 * floats from each of the n_blocks buffers (NULL: none). */
void loom_ps_put_range_(loom_buf *b, uint32_t shard, uint32_t n_rows, const uint32_t *rows);

typedef struct loom_ps_run { uint64_t fn, nonce; int64_t first; uint32_t steps, flags; } loom_ps_run;
typedef struct loom_ps_step_out { int64_t step; uint32_t accepted; double loss_sum; int64_t correct, examples; } loom_ps_step_out;
#define LOOM_PS_MAX_STEPS 65536 /* steps of one step function (run.steps_per_execution) */

void loom_ps_put_run_(loom_buf *b, const loom_ps_run *r);
int  loom_ps_decode_run_(const uint8_t *p, size_t len, loom_ps_run *r, loom_err *err);
/* What a worker's steps moved: the bytes of its pull and push messages
 * (both ways) and the table rows it selected (sparse updates), for the
 * steps of one RESULT. */
typedef struct loom_ps_traffic { uint64_t bytes, rows; } loom_ps_traffic;
void loom_ps_put_result_(loom_buf *b, uint64_t fn, const loom_ps_step_out *s, uint32_t n, const loom_ps_traffic *t);
/* *out (n steps, at most LOOM_PS_MAX_STEPS) is freed by the caller with loom_free. */
int  loom_ps_decode_result_(const uint8_t *p, size_t len, uint64_t *fn, loom_ps_step_out **out, uint32_t *n,
                            loom_ps_traffic *t, loom_err *err);

/* SAVE / SAVED bodies after the header (LOOM_EDATA when malformed). */
void loom_ps_put_save_(loom_buf *b, const loom_ps_hdr *h, const char *dir);
int  loom_ps_decode_save_(const uint8_t *p, size_t len, loom_ps_hdr *h, char *dir, size_t n, loom_err *err);
void loom_ps_put_saved_(loom_buf *b, const loom_ps_hdr *h, uint64_t size, uint32_t crc, const char *name);
int  loom_ps_decode_saved_(const uint8_t *p, size_t len, loom_ps_hdr *h, uint64_t *size, uint32_t *crc, char *name,
                           size_t n, loom_err *err);

/* ---- seams for distribute.c (sharded checkpoints; see distribute.h) ---- */
bool loom_ps_saves_shards_(loom_strategy *s);
void loom_ps_set_ckpt_writer_(loom_strategy *s, loom_ckpt_write_fn fn);
int  loom_ps_save_shards_(loom_strategy *s, const char *dir, int64_t step, loom_ckpt_shards *out, loom_err *err);

/* ---- the strategy: parameter_server.c and its parts ---------------------
 * parameter_server.c (open, close, the range messages, the vtable),
 * ps_coord.c (the chief), ps_worker.c (a worker), ps_task.c (a ps task),
 * ps_ckpt.c (checkpoints and restore) share the strategy's state. */

typedef struct fn_slot {
    uint64_t fn;
    int64_t  first;
    uint32_t steps;
    int      worker;   /* running on; -1 queued */
} fn_slot;

typedef struct ps_strategy {
    const loom_strategy_args *args;
    loom_role       role;
    int             index;
    char            task[32];
    int             n_workers, n_ps;
    loom_model     *model;      /* chief and workers; a ps builds none (ps_open) */
    loom_optimizer *opt;
    loom_param_info *pi;        /* the variables (nv), from the model or, on a ps, the config alone */
    loom_sparse_grad lean_table; /* on a ps without the model: its embedding table (param -1: none) */
    int             nv;
    loom_ps_plan    plan;
    uint64_t        plan_id;    /* loom_ps_plan_id_: checkpoints name the partitioning */
    loom_ckpt_write_fn write_ckpt; /* the trainer's shard-file writer */
    int             n_slots;
    int64_t         P;
    loom_net       *net;
    int             peer_chief, *peer_ps, *peer_worker; /* net peer indices; -1 none */
    int             n_peers;
    loom_role      *peer_role;
    int            *peer_index;
    uint64_t        nonce, seed;
    int64_t         K;
    unsigned        test_step_us; /* LOOM_TEST_PS_STEP_MS: tests slow the workers' steps down */
    bool            sync;
    int             sync_n;
    double          wait_s;     /* how long the chief waits for a lost worker to come back */
    /* ---- chief ---- */
    bool            need_init;  /* the ps tasks need the chief's variables (open, restore) */
    bool            fresh;      /* the chief's model holds the ps tasks' variables */
    bool            restored;   /* the next INIT carries a checkpoint: read it back */
    int64_t         dispatched; /* the step after the last one scheduled */
    uint64_t        next_fn;
    fn_slot        *fns;        /* queued or running */
    int             n_fns, cap_fns;
    bool           *busy;       /* per worker */
    bool           *alive;      /* per worker */
    loom_ps_step_out *ready;    /* results not yet handed to the trainer (FIFO) */
    int64_t         n_ready, ready_head, cap_ready;
    loom_step_result pool;      /* sync: accepted contributions reported late */
    int64_t         stale, lost_fns, requeued;
    uint64_t        req;
    int64_t         ps_step;    /* the ps tasks' applied count at the last fetch */
    /* ---- the embedding table: sparse pull and push (every role) ---- */
    int             table_var;  /* the table's parameter tensor; -1: the model has none */
    int64_t         table_rows, table_off, table_dim;
    double          clip_norm;  /* optimizer.clip_norm: the worker clips its gradients before a push */
    bool           *is_table;   /* per shard: a shard of the table (updated row-wise, lazily) */
    bool            sparse;     /* workers pull and push the table rows a batch looks up, not the table */
    /* ---- worker ---- */
    int64_t        *sel_n;      /* per shard: rows of this step (-1: the whole shard) */
    uint32_t      **sel_rows;   /* per table shard: those rows, shard-local (first-seen order; ascending with clip_norm) */
    uint8_t        *mark;       /* per table row: selected already (cleared after each selection) */
    loom_elem      *held;       /* a batch taken but not computed on (sync: the step function ended) */
    int64_t         sel_total;  /* rows selected for this step */
    int64_t         moved_bytes, moved_rows, moved_steps; /* chief: the workers' reports (loom_ps_traffic) */
    int64_t         bytes_pull, bytes_push, rows_sel, steps_run;
} ps_strategy;

/* parameter_server.c: helpers every role uses */
int  loom_ps_recv_or_stop_(ps_strategy *ps, int p, uint32_t lo, uint32_t hi, int *from, uint32_t *type, loom_buf *msg,
                           loom_err *err);
const char *loom_ps_peer_name_(const ps_strategy *ps, int p, char *buf, size_t n);
bool loom_ps_test_die_now_(const char *task, int64_t nth);
bool loom_ps_test_save_die_now_(const char *task, const char *phase, int64_t step);
int  loom_ps_put_shards_sel_(loom_buf *b, const ps_strategy *ps, int q, const loom_ps_hdr *h0, const float *base,
                             const float *slots, bool sel);
int  loom_ps_put_shards_(loom_buf *b, const ps_strategy *ps, int q, const loom_ps_hdr *h0, const float *base,
                         const float *slots);
void loom_ps_take_values_(const ps_strategy *ps, const loom_ps_msg *m, float *base, float *slots);
int  loom_ps_refused_(const ps_strategy *ps, int from, const loom_buf *msg, loom_err *err);
int  loom_ps_pull_sel_(ps_strategy *ps, float *base, float *slots, int64_t min_step, int64_t *step, bool sel,
                       loom_err *err);
int  loom_ps_pull_all_(ps_strategy *ps, float *base, float *slots, int64_t min_step, int64_t *step, loom_err *err);
/* ps_worker.c, ps_task.c: serving until the chief ends the job */
int  loom_ps_worker_serve_(ps_strategy *ps, const loom_strategy_args *a, loom_iter *it, loom_err *err);
int  loom_ps_serve_loop_(ps_strategy *ps, const loom_spec *spec, loom_err *err);
/* ps_coord.c: the chief */
void loom_ps_drain_workers_(ps_strategy *ps);
int  loom_ps_init_tasks_(ps_strategy *ps, int64_t step, loom_err *err);
int  loom_ps_quiesce_(ps_strategy *ps, loom_err *err);
int  loom_ps_fetch_(ps_strategy *ps, bool slots, loom_err *err);
int  loom_ps_train_step_(loom_strategy *s, const loom_elem *batch, int64_t step, loom_step_result *out, loom_err *err);
/* ps_ckpt.c: the iterator state (the vtable's gather / pick) */
int  loom_ps_gather_iter_state_(loom_strategy *s, const loom_buf *mine, loom_buf *stored, loom_err *err);
int  loom_ps_pick_iter_state_(loom_strategy *s, const loom_buf *stored, loom_buf *mine, loom_err *err);

#endif
