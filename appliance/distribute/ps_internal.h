/* ps_internal.h - parameter_server's parts shared by parameter_server.c,
 * ps_plan.c, ps_wire.c, the unit tests and the fuzzer
 * (tests/fuzz/fuzz_ps_wire.c).
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
 *           u32 accepted, f64 loss_sum, i64 correct, i64 examples
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
void loom_ps_put_result_(loom_buf *b, uint64_t fn, const loom_ps_step_out *s, uint32_t n);
/* *out (n steps, at most LOOM_PS_MAX_STEPS) is freed by the caller with loom_free. */
int  loom_ps_decode_result_(const uint8_t *p, size_t len, uint64_t *fn, loom_ps_step_out **out, uint32_t *n,
                            loom_err *err);

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

#endif
