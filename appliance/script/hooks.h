/* hooks.h - Lua callbacks and custom training steps (the config's `hooks`).
 *
 * A callback is a table of functions (on_train_begin, on_train_end,
 * on_epoch_begin, on_epoch_end, on_step_end) returned by a factory the config
 * names, called once with the config's args. train_step(ctx, batch, args)
 * replaces the trainer's built-in step. Both receive a ctx whose methods act
 * on the run through a loom_hook_host the trainer provides: script sits below
 * nn, distribute and train, so it reaches them only through that table.
 *
 * Threads: the train thread only; all hooks share one sandboxed lua_State.
 * Ownership: loom_hooks_open returns hooks freed with loom_hooks_close. */
#ifndef LOOM_HOOKS_H
#define LOOM_HOOKS_H

#include "script/script.h"

typedef struct loom_hooks loom_hooks;

#define LOOM_HOOK_MAX_REPLICAS 64

/* The callbacks, in the order a run calls them. */
typedef enum {
    LOOM_HOOK_TRAIN_BEGIN, LOOM_HOOK_EPOCH_BEGIN, LOOM_HOOK_STEP_END, LOOM_HOOK_EPOCH_END, LOOM_HOOK_TRAIN_END,
    LOOM_NHOOKS_
} loom_hook_kind;

/* The parts of a custom step, in the order train_step must call them (the
 * same order as distribute.h's loom_step_part). */
typedef enum { LOOM_HOOK_FORWARD, LOOM_HOOK_LOSS, LOOM_HOOK_BACKWARD, LOOM_HOOK_ALL_REDUCE, LOOM_HOOK_APPLY } loom_hook_part;

/* ctx.step, ctx.epoch and ctx.logs for one call; NAN fields become nil. */
#define LOOM_HOOK_MAX_METRICS 8
typedef struct loom_hook_logs {
    int64_t step;                     /* updates applied so far */
    int64_t epoch;                    /* 1-based, as in metrics.jsonl */
    double  loss, accuracy;           /* the epoch's running means (train) */
    double  eval_loss, eval_accuracy; /* the latest evaluation */
    double  samples_per_sec;
    double  learning_rate;            /* of the next update */
    /* model.metrics other than accuracy: ctx.logs[name] (the epoch's training
     * steps so far) and ctx.logs["eval_" .. name] (the latest evaluation) */
    int         n_metrics;
    const char *metric_name[LOOM_HOOK_MAX_METRICS];
    double      metric[LOOM_HOOK_MAX_METRICS], eval_metric[LOOM_HOOK_MAX_METRICS];
} loom_hook_logs;

/* What the ctx methods do, provided by the trainer. Each returns LOOM_OK or
 * fills err (raised in Lua as the method's error; the trainer gets err). */
typedef struct loom_hook_host {
    void *self;
    int   num_replicas;
    void (*stop)(void *self);
    void (*set_learning_rate)(void *self, double lr);
    int  (*save_checkpoint)(void *self, char path[LOOM_PATH_MAX], loom_err *err);
    int  (*log_scalar)(void *self, const char *name, double value, loom_err *err);
    /* A view of parameter `name` (float32, data borrowed from the model). */
    int  (*param)(void *self, const char *name, loom_tensor *view, loom_err *err);
    /* The name of parameter tensor i, NULL past the last. */
    const char *(*param_name)(void *self, int i);
    /* (optional) custom steps; NULL when the strategy cannot run one.
     * LOSS fills per_replica[r], the sum of replica r's per-example losses. */
    int  (*step_part)(void *self, loom_hook_part part, double *per_replica, loom_err *err);
    /* Scales each replica's gradients so that their norm is at most max_norm;
     * per_replica[r] = replica r's norm before. */
    int  (*clip_gradients)(void *self, double max_norm, double *per_replica, loom_err *err);
} loom_hook_host;

/* Opens the sandbox (hooks.unsafe, memory_limit, instruction_limit; files
 * writable only under model_dir), loads every file the config names, finds
 * every function (a missing one is an error naming the config line, the file
 * and the functions it has) and calls each callback factory. spec->hooks must
 * be present. The host is copied; host->self must outlive the hooks. */
int  loom_hooks_open(loom_hooks **out, const loom_spec *spec, const char *model_dir, const loom_hook_host *host,
                     loom_err *err);
void loom_hooks_close(loom_hooks *h); /* NULL is a no-op */

int  loom_hooks_num_callbacks(const loom_hooks *h);
bool loom_hooks_has_train_step(const loom_hooks *h);

/* Calls `kind` of every callback that defines it, in config order (on_step_end
 * only when logs->step is a multiple of the callback's step_interval). A Lua
 * error is LOOM_ELUA: where = the Lua file:line, msg = hook, message and
 * traceback. */
int  loom_hooks_call(loom_hooks *h, loom_hook_kind kind, const loom_hook_logs *logs, loom_err *err);

/* Runs train_step(ctx, batch, args) on a batch (its tensors as read-only
 * views). *applied tells whether it applied an update. */
int  loom_hooks_train_step(loom_hooks *h, const loom_elem_spec *es, const loom_elem *batch, const loom_hook_logs *logs,
                           bool *applied, loom_err *err);

/* Each callback table's `state` field (a table of string keys to numbers,
 * strings and booleans) into b, and back before on_train_begin of a resumed
 * run. Anything else a callback keeps (locals, upvalues) starts afresh. */
int  loom_hooks_save(loom_hooks *h, loom_buf *b, loom_err *err);
int  loom_hooks_restore(loom_hooks *h, loom_buf *b, loom_err *err);

#endif
