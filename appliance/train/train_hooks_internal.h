/* train_hooks_internal.h - the trainer's side of the Lua hooks (script/hooks.h): the
 * host their ctx acts through (stop, learning rate, checkpoints, scalars,
 * parameters, the parts of a step) and the calls the train loop makes.
 * Private to train/. Threads: the train thread. */
#ifndef LOOM_TRAIN_HOOKS_H
#define LOOM_TRAIN_HOOKS_H

#include "distribute/distribute.h"
#include "script/script.h"

/* The trainer's checkpoint writer, for ctx:save_checkpoint(). */
typedef int (*train_save_fn_)(void *arg, char path[LOOM_PATH_MAX], loom_err *err);

typedef struct train_hooks_ {
    loom_hooks      *hooks;    /* NULL: the config has no hooks */
    loom_strategy   *strat;
    FILE            *metrics;  /* metrics.jsonl for ctx:log_scalar; NULL: refused (loom check) */
    struct loom_summary *summary; /* and the TensorBoard event file; NULL: none */
    train_save_fn_   save;     /* NULL: refused (loom check) */
    void            *save_arg;
    const loom_elem *batch;    /* the custom step's batch */
    int64_t          step, epoch;
    bool             stop;     /* a hook called ctx:stop() */
    bool             reduced;  /* the custom step's gradients are all-reduced */
    loom_step_result result;   /* the custom step's ctx:loss(), summed over replicas */
    /* model.metrics beside accuracy, added to every call's ctx.logs (the trainer keeps them current) */
    bool             has_acc;  /* accuracy is one of them; else ctx.logs has no accuracy */
    int              n_metrics;
    const char      *metric_name[LOOM_HOOK_MAX_METRICS];
    double           metric[LOOM_HOOK_MAX_METRICS], eval_metric[LOOM_HOOK_MAX_METRICS];
} train_hooks_;

/* Opens the hooks the spec declares (none: t->hooks stays NULL, and every
 * call below does nothing). metrics and save may be set afterwards. */
int  train_hooks_open_(train_hooks_ *t, const loom_spec *spec, const char *model_dir, loom_strategy *s, loom_err *err);
void train_hooks_close_(train_hooks_ *t);
/* Calls the callbacks of `kind`. */
int  train_hooks_call_(train_hooks_ *t, loom_hook_kind kind, const loom_hook_logs *logs, loom_err *err);
/* Runs the custom train_step on a batch; out = its ctx:loss() (zero if it
 * computed none); *applied = whether it applied an update. */
int  train_hooks_step_(train_hooks_ *t, const loom_elem_spec *es, const loom_elem *batch, const loom_hook_logs *logs,
                       loom_step_result *out, bool *applied, loom_err *err);

#endif
