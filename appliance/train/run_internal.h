/* run_internal.h - what every command of train/ opens first: the pipelines and
 * the strategy of a config (run_open.c's train_run_open_), and the checkpoint that
 * evaluate and predict load, and what the evaluators share with the trainer.
 * Private to train/ (train.c, run_open.c, check.c, evaluate.c, predict.c, profile.c). Threads: the caller's. */
#ifndef LOOM_TRAIN_RUN_H
#define LOOM_TRAIN_RUN_H

#include "train.h"
#include "status_internal.h"
#include "summary_internal.h"
#include "train_hooks_internal.h"

/* Everything a command needs: the pipelines and the strategy. */
typedef struct run {
    const loom_spec   *spec;
    char               model_dir[LOOM_PATH_MAX];
    loom_iter         *train, *eval;
    loom_strategy     *strat;
    loom_strategy_args args;
    double             decode_sec; /* opening the pipelines: reading and decompressing sources */
    train_hooks_       hooks;      /* the config's Lua hooks (loom_train, loom_check) */
    bool               no_iter;    /* save_ckpt: without data.train's state (data_hook_failed) */
    /* A job across processes (the strategy's input context has several
     * pipelines): every task trains in lock-step; the chief alone writes
     * checkpoints, metrics.jsonl and the log's progress, and evaluates. */
    bool               multi;
    bool               chief;
    loom_dataset_spec *train_spec; /* multi: data.train with this worker's share of the global batch (owned) */
    loom_input_ctx     ictx;       /* the strategy's input context of data.train (its sharding, its seed) */
    loom_status       *status;     /* run.status_port's endpoint (loom_train), or NULL */
    double            *macc[2];    /* model.metrics' state: [0] the epoch's training steps, [1] the last evaluation */
    double            *msnap;      /* several heads: macc[0] at the last summary (the window's heads: the change) */
    bool               has_acc;    /* "accuracy" is one of model.metrics */
    bool               sidecar_eval; /* the cluster has an evaluator task: it evaluates, the chief does not */
    double             status_stages_at; /* when the pipeline's stages were last published */
    bool               input_on_pool; /* data.train's batches are gathered on the model's pool (loom_iter_share_pool) */
} run;

/* Opens the pipelines and the strategy into r (which it clears first).
 * `need_eval`: fail if data.eval is absent. cluster: this process's task in a
 * job across processes (NULL: one process); plan_only: `loom check` (the
 * strategy opens no socket). Close r with run_close_ whether or not it fails. */
int  train_run_open_(run *r, const loom_spec *spec, const char *model_dir, bool need_eval, const loom_cluster *cluster,
                     bool plan_only, loom_err *err);
/* The same for loom train: resume_key/resume_text (loom_strategy_args) say
 * where this task resumes from, for a strategy to compare across its tasks. */
int  train_run_open_at_(run *r, const loom_spec *spec, const char *model_dir, const loom_cluster *cluster,
                        const char *resume_key, const char *resume_text, loom_err *err);
void train_run_close_(run *r);
/* The batch size of d: its last batch transform's, 0 without one. */
int64_t train_batch_size_of_(const loom_dataset_spec *d);
/* Loads the checkpoint to evaluate or predict with into the strategy's model:
 * `checkpoint`, or (NULL) the latest in r's model directory; path gets the
 * file's name, step its step (-1 when a file was named). */
int  train_load_for_inference_(run *r, const char *checkpoint, char path[LOOM_PATH_MAX], int64_t *step, loom_err *err);

/* Shared by the trainer and the evaluators (train.c, evaluate.c). */
int  train_metrics_open_(run *r, loom_err *err); /* the state of model.metrics, zeroed; LOOM_ENOMEM */
/* Evaluates data.eval (it) into total; its metric state ends in r->macc[1]
 * (the training steps' state so far is first added to r->macc[0]). */
int  train_evaluate_all_(run *r, loom_iter *it, loom_step_result *total, loom_err *err);
/* An evaluation (ev, its metrics in r->macc[1]) to TensorBoard: loss and each metric. */
int  train_log_eval_(run *r, loom_summary *tb, int64_t step, double loss, const loom_step_result *ev, loom_err *err);
/* A metrics.jsonl field: `, "key": v` (a number, or null when not finite; first: no comma) */
void train_json_num_(FILE *f, const char *key, double v, int first);
void train_json_time_(FILE *f, const char *key, double v); /* `, "key": v` to the millisecond */

#endif
