/* train.h - the trainer: train / evaluate / predict / check, checkpoints,
 * metrics and progress.
 *
 * Checkpoints: <model_dir>/ckpt-<step>.loom, one file each, holding every
 * parameter tensor, every optimizer slot, the trainer's position (step, epoch,
 * running sums) and the training iterator's state, each record zstd-compressed
 * with a CRC-32C of its raw bytes, the file closed by a CRC of everything
 * before it. Written to a temporary name, fsynced and renamed, so the newest
 * complete file is always the latest; <model_dir>/checkpoint names it too
 * (TensorFlow's CheckpointState text format). The newest K are kept.
 *
 * Threads: call from the main thread. */
#ifndef LOOM_TRAIN_H
#define LOOM_TRAIN_H

#include "distribute/distribute.h"

typedef struct loom_train_opts {
    const char *model_dir;  /* NULL: spec->run.model_dir */
    bool        fresh;      /* start from scratch even if model_dir holds checkpoints */
    double      start_time; /* loom_now() at process start, for the first-step latency */
    /* This process's task in a cluster (cluster/cluster.h), resolved and
     * checked by the command line before anything opens; NULL = one process. */
    const struct loom_cluster *cluster;
} loom_train_opts;

/* Trains as the spec says, resuming from the latest checkpoint in model_dir.
 * A corrupt latest checkpoint is refused (LOOM_ECHECKPOINT) unless opts->fresh. */
int loom_train(const loom_spec *spec, const loom_train_opts *opts, loom_err *err);

typedef struct loom_eval_result {
    double  loss;      /* mean per-example loss */
    double  accuracy;  /* NaN when accuracy is not one of model.metrics */
    int64_t examples;
    int64_t step;      /* of the checkpoint evaluated */
    char    checkpoint[LOOM_PATH_MAX];
    int     n_metrics; /* model.metrics, in order (accuracy included), then with several heads each head's
                        * <layer>_loss and (when it reports one) <layer>_accuracy */
    char    metric_name[LOOM_MAX_METRICS + 2 * LOOM_MAX_HEADS][LOOM_NAME_MAX + 16];
    double  metric[LOOM_MAX_METRICS + 2 * LOOM_MAX_HEADS];
} loom_eval_result;

/* Evaluates data.eval with the given checkpoint file, or the latest in
 * model_dir when checkpoint is NULL. */
int loom_evaluate(const loom_spec *spec, const char *model_dir, const char *checkpoint, loom_eval_result *out,
                  loom_err *err);

/* The sidecar evaluator (a cluster's `evaluator` task, `loom evaluate
 * --watch`): evaluates data.eval on each new checkpoint of model_dir once,
 * the newest first when several came since the last look (the older ones are
 * skipped, as TensorFlow's checkpoints_iterator skips them), and stops after
 * the job's final checkpoint, which the chief names in <model_dir>/final.json
 * when training ends. Each evaluation appends an "eval" line to
 * <model_dir>/metrics.jsonl and loss, accuracy to an event file in
 * <model_dir>/eval (who: a cluster's evaluator task) or <model_dir>/eval_watch
 * (`loom evaluate --watch`), whose lock it holds; the eval lines already there tell a restarted watcher
 * which steps are done. SIGINT/SIGTERM stop it between evaluations
 * (LOOM_EIO naming the signal). *evaluated: how many it evaluated. */
typedef struct loom_watch_opts {
    const char *who;        /* "evaluator:0", or NULL for `loom evaluate --watch` */
    double      poll_secs;  /* between looks at model_dir; <= 0: 0.2 */
    double      idle_secs;  /* > 0: give up (LOOM_ETIMEOUT) after this long without a new checkpoint or the end */
    /* > 0: a final.json written before this wall time is an earlier run's
     * (a cluster's evaluator starts with the job: only this run's end counts) */
    double      after_wall;
} loom_watch_opts;
int loom_evaluate_watch(const loom_spec *spec, const char *model_dir, const loom_watch_opts *o, int *evaluated,
                        loom_err *err);
/* The name of the end-of-training marker in model_dir. */
#define LOOM_FINAL_MARKER "final.json"

/* Writes predictions as CSV (index,class,p0,...) for `input`: "train" or
 * "eval" (that dataset in order, without shuffle, repeat or random maps) or
 * the path of an IDX file of inputs (given the eval pipeline's maps of the
 * model input). */
int loom_predict(const loom_spec *spec, const char *model_dir, const char *checkpoint, const char *input,
                 const char *output, loom_err *err);

/* loom_predict with more: input may also be a file of the kind of the
 * config's csv, tfrecord or text source (the eval source's declaration, or
 * train's, reading that file: only the model input and the id features are
 * read, so a file without labels is fine; the maps of the model input, then
 * batch). id: comma-separated scalar features passed through to the output
 * after `index` (e.g. "id" or "id,label"); NULL or "" = none. Columns by task:
 * softmax cross-entropy "class,p0,...", mean squared error "prediction" (one
 * output) or "prediction_0,...". */
typedef struct loom_predict_opts {
    const char *model_dir, *checkpoint; /* NULL: spec->run.model_dir, the latest checkpoint */
    const char *input;                  /* "train", "eval", an IDX file, or a file for the config's source */
    const char *output;                 /* a file, or "-" for stdout */
    const char *id;
} loom_predict_opts;
int loom_predict_run(const loom_spec *spec, const loom_predict_opts *o, loom_err *err);

/* `loom generate` (generate.c): samples a language model (nn.h
 * loom_decoder_new says what that is) from a checkpoint: the prompt is
 * tokenised by data.train's first tokenize map (after loom_data_adapt:
 * its adapted vocabulary), then max_tokens tokens are drawn one at a time
 * (loom_decode_sample, never padding id 0), each detokenised (words with a
 * space before each) and written to out and flushed as it is drawn; then a
 * newline. Prompt tokens outside the vocabulary map to the OOV id, with a
 * warning saying how many. Same seed, config and checkpoint: same text. */
typedef struct loom_generate_opts {
    const char *model_dir, *checkpoint; /* NULL: spec->run.model_dir, the latest checkpoint */
    const char *prompt;
    int64_t     max_tokens;             /* >= 0, per sample */
    int64_t     samples;                /* continuations of the prompt, one a line, the draws going on (<= 0: 1) */
    double      temperature;            /* 0: greedy (argmax) */
    int64_t     top_k;                  /* 0: every id */
    uint64_t    seed;
    bool        generic;                /* never the incremental path (tests compare the two) */
    FILE       *out;                    /* NULL: stdout */
} loom_generate_opts;
int loom_generate(const loom_spec *spec, const loom_generate_opts *o, loom_err *err);

/* Opens every pipeline and builds the model without training, so that missing
 * files and shape mismatches surface; prints the plan to f. */
/* cluster: this process's task (NULL: one process); the strategy builds its
 * replicas and prints its plan but opens no socket. */
int loom_check(const loom_spec *spec, const struct loom_cluster *cluster, FILE *f, loom_err *err);
/* `loom check --gradcheck`: the model loom check builds, each layer's
 * backward against central differences (loom_model_gradcheck), the table to
 * f; LOOM_ENUMERIC (at the model's file:line) when a layer fails. */
int loom_gradcheck(const loom_spec *spec, const struct loom_cluster *cluster, FILE *f, loom_err *err);

/* ---- export (export.c) ------------------------------------------------------ */

typedef enum { LOOM_EXPORT_ONNX, LOOM_EXPORT_NPZ } loom_export_format;

typedef struct loom_export_opts {
    loom_export_format format;
    const char *output;             /* the file to write (atomically) */
    const char *model_dir;          /* NULL: spec->run.model_dir */
    const char *checkpoint;         /* NULL: the latest in the model directory */
    bool        include_preprocessing; /* onnx: fold the eval pipeline's maps of the input into the graph */
} loom_export_opts;

/* Writes the model of spec with a checkpoint's weights: ONNX (opset 17, input
 * "input" and output "output" with a dynamic batch dimension; probabilities
 * under softmax cross-entropy, as loom predict) or npz (one float32 array per
 * variable, named as loom inspect names them). A layer or map with no ONNX
 * form is LOOM_EUNSUPPORTED naming it; a checkpoint of another model is
 * LOOM_ECHECKPOINT naming both shapes; an unwritable output LOOM_EIO. */
int loom_export(const loom_spec *spec, const loom_export_opts *opts, loom_err *err);

/* ---- checkpoints ----------------------------------------------------------- */

/* The largest step a checkpoint may hold (2^53: every step is exact as a
 * double in metrics.jsonl); larger steps in a file name or the trainer state
 * are refused as forged. */
#define LOOM_CKPT_MAX_STEP ((uint64_t)1 << 53)

/* Newest checkpoint in dir: LOOM_OK with path and step, LOOM_EEOF when none.
 * A name that looks like a checkpoint's but whose step is not a valid one
 * (signs, leading zeros, out of range) is ignored with a warning. */
int loom_ckpt_latest(const char *dir, char path[LOOM_PATH_MAX], int64_t *step, loom_err *err);
/* The newest checkpoint in dir whose step is above `after`: LOOM_OK with
 * path, step and how many checkpoints are above `after` (the newest
 * included), LOOM_EEOF when none is. Names that are not checkpoints' are
 * skipped silently (a watcher looks often). */
int loom_ckpt_newest_after(const char *dir, int64_t after, char path[LOOM_PATH_MAX], int64_t *step, int *n_newer,
                           loom_err *err);
/* Writes ckpt-<step>.loom with the model's parameters, the optimizer's slots
 * and the given blobs (may be NULL), then prunes to `keep`. */
int loom_ckpt_save(const char *dir, int64_t step, loom_model *m, loom_optimizer *o, const loom_buf *trainer,
                   const loom_buf *iter, int keep, char path[LOOM_PATH_MAX], loom_err *err);
/* The same, with the numbers adapted at start (data.h loom_data_adapt_text)
 * as the record "adapt" (none when adapt is NULL or empty). */
int loom_ckpt_save_adapt(const char *dir, int64_t step, loom_model *m, loom_optimizer *o, const loom_buf *trainer,
                         const loom_buf *iter, const loom_buf *adapt, int keep, char path[LOOM_PATH_MAX], loom_err *err);
/* The bytes of a checkpoint's blob record `name` ("adapt") into out (freed
 * with loom_buf_fini), after checking the whole file as loom_ckpt_load does:
 * LOOM_EEOF when it has no such record. */
int loom_ckpt_read_blob(const char *path, const char *name, loom_buf *out, loom_err *err);
/* Moves every checkpoint of dir (and its index) into a new
 * dir/superseded-<UTC time>/, named in out; for --fresh, which must neither
 * resume from nor destroy what an earlier run wrote. */
int loom_ckpt_archive(const char *dir, char out[LOOM_PATH_MAX], loom_err *err);

/* Sharded checkpoints (parameter_server; the layout in checkpoint.c). A
 * task holding shards writes its file with loom_ckpt_write_shard (a
 * loom_ckpt_write_fn); the chief then commits ckpt-<step>.loom, the index
 * naming every shard file with its size and CRC-32C, and prunes to `keep`
 * (old indexes with their shard files, and shard files no index names).
 * loom_ckpt_load, loom_ckpt_latest and loom_ckpt_inspect read an index as
 * they read a whole checkpoint: the variables come from its shard files,
 * found in the index's directory, each checked against the index (a
 * missing, replaced or other step's shard is LOOM_ECHECKPOINT naming it). */
int loom_ckpt_write_shard(const char *path, const loom_ckpt_shard_meta *meta, const loom_ckpt_tensor *t, int n,
                          uint64_t *size, uint32_t *crc, loom_err *err);
int loom_ckpt_save_index(const char *dir, int64_t step, const loom_ckpt_shards *shards, const loom_buf *trainer,
                         const loom_buf *iter, int keep, char path[LOOM_PATH_MAX], loom_err *err);

/* Verifies every checksum, then loads parameters (and slots when o is given)
 * and the blobs (when non-NULL; buffers freed by the caller with
 * loom_buf_fini). A checkpoint of a different model is refused naming the
 * first tensor that differs. */
int loom_ckpt_load(const char *path, loom_model *m, loom_optimizer *o, loom_buf *trainer, loom_buf *iter,
                   loom_err *err);

/* Moves every checkpoint of dir (and its index) into a new
 * dir/superseded-<UTC time>/, named in out; for --fresh, which must neither
 * resume from nor destroy what an earlier run wrote. */
int loom_ckpt_archive(const char *dir, char out[LOOM_PATH_MAX], loom_err *err);

/* Makes metrics.jsonl (path) agree with the checkpoint a run resumes from:
 * removes the lines whose "step" is above max_step (written after that
 * checkpoint, by a run killed before it committed the next one), the epoch
 * lines of epochs past max_epoch (the epochs the checkpoint has completed:
 * a checkpoint taken at an epoch's last step, before its end, has the step
 * of that epoch's line but not the epoch), and a last line cut short.
 * Returns how many lines it removed, -1 with err set. */
int loom_metrics_trim(const char *path, int64_t max_step, int64_t max_epoch, loom_err *err);

/* Verifies every checksum of a checkpoint and lists its records (tensor
 * name, shape and CRC-32C; blob name and size) without needing the model. */
int loom_ckpt_inspect(const char *path, FILE *f, loom_err *err);

/* ---- profile (`loom profile --train`) --------------------------------------- */

/* Trains `steps` steps (after `warmup` unmeasured ones) from a fresh model on
 * data.train, writing nothing, and prints to f where a step goes: the input
 * hand-off, each layer's forward, the loss, each layer's backward and
 * kernel/bias gradients, the gradient reduction, the optimizer, and the
 * rest; each in microseconds per step, as a share of the step (the rows add
 * up to it: they are read off one run of contiguous clock readings) and,
 * for the products, against the GEMM-only time of that phase at the same
 * shapes on all the cores (the bound tests/bench/gemm_peak computes). Then
 * the same batches through the strategy's whole train step, unprofiled, for
 * the cost of profiling. A strategy without step parts is timed whole. */
int loom_train_profile(const loom_spec *spec, int64_t steps, int64_t warmup, FILE *f, loom_err *err);

#endif
