/* train.c - the trainer (loom train: resume, the step loop, the end-of-epoch evaluation, checkpoint
 * cadence, the metrics sink). run_open.c opens the run, check.c holds loom check; evaluate.c,
 * predict.c and profile.c hold loom evaluate (and its sidecar), loom predict and loom profile
 * --train; run_internal.h what they share with it. */
#include "train.h"
#include "run_internal.h"
#include "dir_lock_internal.h"
#include "progress_internal.h"
#include "summary_internal.h"
#include "status_internal.h"
#include "train_hooks_internal.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#define TRAINER_STATE_VERSION 1

/* The trainer's position, saved in every checkpoint. */
typedef struct trainer_state {
    int64_t step;          /* updates applied */
    int64_t epoch;         /* the epoch in progress (0-based) */
    int64_t step_in_epoch;
    double  loss_sum;      /* this epoch so far */
    int64_t correct, examples;
} trainer_state;

static void state_save(const trainer_state *s, loom_buf *b)
{
    loom_buf_put_u32(b, TRAINER_STATE_VERSION);
    loom_buf_put_i64(b, s->step);
    loom_buf_put_i64(b, s->epoch);
    loom_buf_put_i64(b, s->step_in_epoch);
    loom_buf_put_f64(b, s->loss_sum);
    loom_buf_put_i64(b, s->correct);
    loom_buf_put_i64(b, s->examples);
}

static int state_restore(trainer_state *s, loom_buf *b, const char *path, loom_err *err)
{
    uint32_t v = loom_buf_get_u32(b);
    s->step = loom_buf_get_i64(b);
    s->epoch = loom_buf_get_i64(b);
    s->step_in_epoch = loom_buf_get_i64(b);
    s->loss_sum = loom_buf_get_f64(b);
    s->correct = loom_buf_get_i64(b);
    s->examples = loom_buf_get_i64(b);
    if (b->failed || v != TRAINER_STATE_VERSION)
        return loom_err_set(err, LOOM_ECHECKPOINT, path, "the trainer state in the checkpoint is unreadable");
    /* the CRCs prove only who wrote the bytes: every value must be one a run can reach */
    const int64_t max = (int64_t)LOOM_CKPT_MAX_STEP;
    const char *bad = s->step < 0 || s->step > max                       ? "step"
                      : s->epoch < 0 || s->epoch > s->step                ? "epoch"
                      : s->step_in_epoch < 0 || s->step_in_epoch > s->step ? "step_in_epoch"
                      : !isfinite(s->loss_sum)                            ? "loss_sum"
                      : s->examples < 0                                   ? "examples"
                      : s->correct < 0 || s->correct > s->examples        ? "correct"
                                                                          : NULL;
    if (bad) {
        loom_err_set(err, LOOM_ECHECKPOINT, path,
                     "the trainer state is impossible: step %lld, epoch %lld, step_in_epoch %lld, loss_sum %g, "
                     "correct %lld of %lld examples (%s is out of range)",
                     (long long)s->step, (long long)s->epoch, (long long)s->step_in_epoch, s->loss_sum,
                     (long long)s->correct, (long long)s->examples, bad);
        return loom_err_hint(err, "the file was altered or written by a broken writer; delete it to resume from the "
                                  "previous checkpoint, or pass --fresh");
    }
    return LOOM_OK;
}

/* ---- model.metrics ---- */

/* Adds every replica's metric state into acc and clears them (a strategy
 * without replica(): its model, replica 0). */
static void take_metrics(run *r, double *acc) { loom_strategy_metrics_take(r->strat, acc); }

/* The state of model.metrics (zeroed); LOOM_ENOMEM. */
int train_metrics_open_(run *r, loom_err *err)
{
    loom_model *m = loom_strategy_model(r->strat);
    int64_t n = loom_model_metrics_size(m);
    r->has_acc = false;
    for (int i = 0; i < loom_model_num_metrics(m); i++) r->has_acc |= loom_model_metric(m, i) == LOOM_METRIC_ACCURACY;
    r->hooks.has_acc = r->has_acc;
    for (int k = 0; k < 2; k++)
        if (!(r->macc[k] = loom_calloc((size_t)(n ? n : 1), sizeof(double))))
            return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the metrics' state");
    /* several heads: macc[0] as the last summary left it (window_heads) */
    if (loom_model_num_heads(m) > 1 && !(r->msnap = loom_calloc((size_t)(n ? n : 1), sizeof(double))))
        return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the metrics' state");
    r->hooks.n_metrics = 0;
    for (int i = 0; i < loom_model_num_metrics(m) && r->hooks.n_metrics < LOOM_HOOK_MAX_METRICS; i++)
        if (loom_model_metric(m, i) != LOOM_METRIC_ACCURACY)
            r->hooks.metric_name[r->hooks.n_metrics++] = loom_metric_name(loom_model_metric(m, i));
    for (int i = 0; i < LOOM_HOOK_MAX_METRICS; i++) r->hooks.metric[i] = r->hooks.eval_metric[i] = NAN;
    return LOOM_OK;
}

static void metrics_clear(run *r, int k)
{
    loom_model *m = loom_strategy_model(r->strat);
    int64_t n = loom_model_metrics_size(m);
    /* a summary window across the epoch's end keeps the steps before it */
    for (int64_t i = 0; k == 0 && r->msnap && r->macc[0] && i < n; i++) r->msnap[i] -= r->macc[0][i];
    if (r->macc[k]) memset(r->macc[k], 0, (size_t)n * sizeof(double));
}

/* Several heads: each head's "<layer>_loss" and "<layer>_accuracy" over the
 * summary window's examples into tag and v (LOOM_MAX_HEADS * 2 each); their
 * count. */
static int window_heads(run *r, int64_t examples, char (*tag)[LOOM_NAME_MAX + 16], double *v)
{
    loom_model *m = loom_strategy_model(r->strat);
    if (!r->msnap || loom_model_num_heads(m) < 2) return 0;
    take_metrics(r, r->macc[0]);
    int64_t n = loom_model_metrics_size(m);
    double *d = loom_calloc((size_t)n, sizeof *d);
    if (!d) return 0;
    for (int64_t i = 0; i < n; i++) d[i] = r->macc[0][i] - r->msnap[i], r->msnap[i] = r->macc[0][i];
    int k = 0;
    for (int h = 0; h < loom_model_num_heads(m); h++)
        for (int q = 0; q < 2; q++) {
            if (q && !loom_model_head_accuracy(m, h)) continue;
            snprintf(tag[k], sizeof tag[k], "%s_%s", loom_model_head_name(m, h), q ? "accuracy" : "loss");
            v[k++] = loom_model_head_value(m, h, q, d, examples);
        }
    loom_free(d);
    return k;
}

/* ", accuracy 0.9123, auc 0.9500" (state k, with the steps' correct and examples) into buf. */
static char *metrics_text(run *r, int k, int64_t correct, int64_t examples, char *buf, size_t n)
{
    loom_model *m = loom_strategy_model(r->strat);
    size_t len = 0;
    buf[0] = 0;
    for (int i = 0; i < loom_model_num_metrics(m); i++) {
        double v = loom_model_metric_value(m, i, r->macc[k], correct, examples);
        int w = snprintf(buf + len, n - len, ", %s %.4f", loom_metric_name(loom_model_metric(m, i)), v);
        if (w < 0 || len + (size_t)w >= n) break;
        len += (size_t)w;
    }
    for (int h = 0, q = 0; h < loom_model_num_heads(m) && loom_model_num_heads(m) > 1; h++)
        for (q = 0; q < 2; q++) {
            if (q && !loom_model_head_accuracy(m, h)) continue;
            int w = snprintf(buf + len, n - len, ", %s_%s %.4f", loom_model_head_name(m, h), q ? "accuracy" : "loss",
                             loom_model_head_value(m, h, q, r->macc[k], examples));
            if (w < 0 || len + (size_t)w >= n) return buf;
            len += (size_t)w;
        }
    return buf;
}

/* Head h's "<layer>_loss" (q = 0) or "<layer>_accuracy" (1) of state k, after prefix. */
static double head_metric(run *r, int k, int h, int q, int64_t examples, const char *prefix, char *key, size_t n)
{
    loom_model *m = loom_strategy_model(r->strat);
    snprintf(key, n, "%s%s_%s", prefix, loom_model_head_name(m, h), q ? "accuracy" : "loss");
    return loom_model_head_value(m, h, q, r->macc[k], examples);
}

/* "train_accuracy": ..., "train_auc": ... of state k into a metrics.jsonl line. */
static void metrics_json(run *r, FILE *f, const char *prefix, int k, int64_t correct, int64_t examples)
{
    loom_model *m = loom_strategy_model(r->strat);
    for (int i = 0; i < loom_model_num_metrics(m); i++) {
        char key[64];
        snprintf(key, sizeof key, "%s%s", prefix, loom_metric_name(loom_model_metric(m, i)));
        train_json_num_(f, key, examples ? loom_model_metric_value(m, i, r->macc[k], correct, examples) : NAN, 0);
    }
    for (int h = 0; h < loom_model_num_heads(m) && loom_model_num_heads(m) > 1; h++)
        for (int q = 0; q < 2; q++) {
            char key[LOOM_NAME_MAX + 32];
            if (q && !loom_model_head_accuracy(m, h)) continue;
            double v = head_metric(r, k, h, q, examples, prefix, key, sizeof key);
            train_json_num_(f, key, v, 0);
        }
}

/* The hooks' ctx.logs values of the metrics beside accuracy: state k into metric (k = 0) or eval_metric. */
static void metrics_to_hooks(run *r, int k, int64_t correct, int64_t examples)
{
    loom_model *m = loom_strategy_model(r->strat);
    for (int i = 0, h = 0; i < loom_model_num_metrics(m) && h < LOOM_HOOK_MAX_METRICS; i++) {
        if (loom_model_metric(m, i) == LOOM_METRIC_ACCURACY) continue;
        double v = examples ? loom_model_metric_value(m, i, r->macc[k], correct, examples) : NAN;
        if (k == 0) r->hooks.metric[h++] = v;
        else r->hooks.eval_metric[h++] = v;
    }
}

/* Evaluates data.eval; its metric state ends in r->macc[1] (the training
 * steps' state so far is first added to r->macc[0]). */
int train_evaluate_all_(run *r, loom_iter *it, loom_step_result *total, loom_err *err)
{
    memset(total, 0, sizeof *total);
    take_metrics(r, r->macc[0]);
    metrics_clear(r, 1);
    int rc = loom_iter_rewind(it, 0, err);
    if (rc) return rc;
    int64_t limit = r->spec->run.eval_steps;
    for (int64_t n = 0; limit <= 0 || n < limit; n++) {
        loom_elem *b;
        rc = loom_iter_next(it, &b, err);
        if (rc == LOOM_EEOF) break;
        if (rc) return rc;
        loom_step_result s;
        rc = loom_strategy_eval_step(r->strat, b, &s, err);
        if (rc == LOOM_EDATA) loom_err_prefix(err, "data.eval batch %lld", (long long)n + 1);
        if (rc) return rc;
        total->loss_sum += s.loss_sum;
        total->correct += s.correct;
        total->examples += s.examples;
    }
    take_metrics(r, r->macc[1]);
    metrics_to_hooks(r, 1, total->correct, total->examples);
    return LOOM_OK;
}

static double peak_rss_mb(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_maxrss / 1024.0;
}

void train_json_time_(FILE *f, const char *key, double v) { fprintf(f, ", \"%s\": %.3f", key, v); }

void train_json_num_(FILE *f, const char *key, double v, int first)
{
    if (isfinite(v))
        fprintf(f, "%s\"%s\": %.9g", first ? "" : ", ", key, v);
    else
        fprintf(f, "%s\"%s\": null", first ? "" : ", ", key);
}

static volatile sig_atomic_t stop_signal;
static void on_signal(int sig) { stop_signal = sig; }

static int save_ckpt(run *r, const trainer_state *st, char path[LOOM_PATH_MAX], loom_err *err)
{
    loom_buf ts, is;
    loom_buf_init(&ts);
    loom_buf_init(&is);
    state_save(st, &ts);
    /* the Lua callbacks' state follows the trainer's fields; when a callback
     * keeps something unsaveable there, the checkpoint is written without it
     * (rather than not at all) and the callback's error reported */
    loom_err herr;
    size_t mark = ts.len;
    int hrc = r->hooks.hooks ? loom_hooks_save(r->hooks.hooks, &ts, &herr) : LOOM_OK;
    if (hrc) ts.len = mark;
    int rc = r->no_iter ? LOOM_OK : loom_iter_save(r->train, &is, err);
    if (!rc && !r->no_iter) { /* every task's position (a collective in a job across processes) */
        loom_buf all;
        rc = loom_strategy_gather_iter_state(r->strat, &is, &all, err);
        loom_buf_fini(&is);
        is = all;
    }
    if (!rc && !r->chief) { /* the chief writes it */
        char name[LOOM_PATH_MAX + 32];
        snprintf(name, sizeof name, "%s/ckpt-%lld.loom", r->model_dir, (long long)st->step);
        snprintf(path, LOOM_PATH_MAX, "%.*s", LOOM_PATH_MAX - 1, name);
    }
    else if (!rc && loom_strategy_saves_shards(r->strat)) { /* parameter_server: each ps writes its shards, then the index */
        loom_ckpt_shards sh;
        rc = loom_strategy_save_shards(r->strat, r->model_dir, st->step, &sh, err);
        if (!rc) rc = loom_ckpt_save_index(r->model_dir, st->step, &sh, &ts, &is, r->spec->run.keep_checkpoints, path, err);
        loom_ckpt_shards_fini(&sh);
    }
    else if (!rc) { /* with the numbers adapted at start: evaluate, predict and export need no adapt.txt */
        loom_buf ad;
        loom_buf_init(&ad);
        loom_data_adapt_text(r->spec, &ad);
        rc = ad.failed ? loom_err_set(err, LOOM_ENOMEM, r->model_dir, "cannot hold the adapted numbers")
                       : loom_ckpt_save_adapt(r->model_dir, st->step, loom_strategy_model(r->strat),
                                              loom_strategy_optimizer(r->strat), &ts, &is, &ad,
                                              r->spec->run.keep_checkpoints, path, err);
        loom_buf_fini(&ad);
    }
    if (!rc && hrc) {
        *err = herr;
        loom_err_hint(err, "saved %s without the callbacks' state; fix the hook, then run the same command to resume",
                      path);
        rc = hrc;
    }
    loom_buf_fini(&ts);
    loom_buf_fini(&is);
    return rc;
}

/* ctx:save_checkpoint() of a Lua hook. */
typedef struct hook_save_arg {
    run                 *r;
    const trainer_state *st;
} hook_save_arg;

static int hook_save(void *arg, char path[LOOM_PATH_MAX], loom_err *err)
{
    hook_save_arg *a = arg;
    return save_ckpt(a->r, a->st, path, err);
}

/* ctx.step, ctx.epoch and ctx.logs of a hook call. */
static loom_hook_logs hook_logs(const trainer_state *st, int64_t epoch, loom_optimizer *opt, double sps,
                                double eval_loss, double eval_acc)
{
    loom_hook_logs g = {.step = st->step, .epoch = epoch, .eval_loss = eval_loss, .eval_accuracy = eval_acc,
                        .samples_per_sec = sps, .learning_rate = loom_optimizer_lr(opt, st->step)};
    g.loss = st->examples ? st->loss_sum / (double)st->examples : NAN;
    g.accuracy = st->examples ? (double)st->correct / (double)st->examples : NAN;
    return g; /* train_hooks_call_ adds model.metrics (and drops accuracy when it is not one) */
}

/* A hook failed (err): save a checkpoint, which is whole because hooks run
 * between steps (or after a custom step's update, counted in st), and say
 * where it is. */
static int hook_failed(run *r, const trainer_state *st, loom_err *err)
{
    char path[LOOM_PATH_MAX];
    loom_err e2;
    if (r->multi) /* one task's failure: the others are not at a checkpoint, which is a collective */
        loom_err_hint(err, "fix it, then run the job again: it resumes from the last checkpoint");
    else if (save_ckpt(r, st, path, &e2) == LOOM_OK)
        loom_err_hint(err, "saved %s; fix the hook, then run the same command to resume", path);
    else if (e2.code == LOOM_ELUA) /* saved, without the callbacks' state */
        loom_err_hint(err, "%s", e2.hint);
    else
        loom_err_hint(err, "no checkpoint could be saved: %s", e2.msg);
    return err->code;
}

/* A Lua map or filter in data.train failed (LOOM_ELUA from the pipeline).
 * The pipeline is past where the model is, and its read-ahead stages
 * (prefetch, parallel maps) may hold the error, so the checkpoint is saved
 * without data.train's state: resuming replays the pipeline to the model's
 * step (replay_data), running the Lua function as it is by then. */
/* Publishes the trainer's figures to the status endpoint (if any); the
 * pipeline's stages at most once a second (loom_iter_stats walks them). */
static void publish(run *r, const trainer_state *st, loom_status_state state, loom_optimizer *opt, double sps,
                    double input_wait, double eval_loss, double eval_acc, int64_t examples_total)
{
    if (!r->status) return;
    loom_status_figures f = {
        .state = state, .step = st->step, .epoch = st->epoch + 1,
        .loss = st->examples ? st->loss_sum / (double)st->examples : NAN,
        .accuracy = st->examples && r->has_acc ? (double)st->correct / (double)st->examples : NAN,
        .samples_per_sec = sps, .input_wait_fraction = input_wait, .learning_rate = loom_optimizer_lr(opt, st->step),
        .eval_loss = eval_loss, .eval_accuracy = eval_acc, .examples_total = examples_total};
    loom_status_update(r->status, &f);
    double now = loom_now();
    if (now - r->status_stages_at >= 1.0 || state != LOOM_STATUS_TRAINING) {
        loom_stage_stats ss[LOOM_STATUS_MAX_STAGES];
        loom_status_stages(r->status, ss, loom_iter_stats(r->train, ss, LOOM_STATUS_MAX_STAGES));
        /* the job's other tasks, when the strategy spans processes */
        loom_peer_info pi[LOOM_STATUS_MAX_PEERS];
        loom_status_peer sp[LOOM_STATUS_MAX_PEERS];
        int np = loom_strategy_peers(r->strat, pi, LOOM_STATUS_MAX_PEERS);
        for (int i = 0; i < np; i++) {
            _Static_assert(sizeof sp[i].task == sizeof pi[i].task, "task names");
            memcpy(sp[i].task, pi[i].task, sizeof sp[i].task);
            sp[i].alive = pi[i].alive, sp[i].last_seen_sec = pi[i].last_seen_sec;
            sp[i].collective_wait_sec = pi[i].collective_wait_sec;
        }
        if (np > 0) loom_status_peers(r->status, sp, np);
        r->status_stages_at = now;
    }
}

static int data_hook_failed(run *r, const trainer_state *st, loom_err *err)
{
    r->no_iter = true;
    int rc = hook_failed(r, st, err);
    r->no_iter = false;
    return rc;
}

/* Resuming from a checkpoint without data.train's state (data_hook_failed):
 * the pipeline is deterministic, so the pass the model was in is started
 * again and the batches it had trained on are pulled and dropped. */
static int replay_data(run *r, const trainer_state *st, loom_err *err)
{
    loom_elem *b;
    int rc = loom_iter_rewind(r->train, st->epoch, err);
    for (int64_t i = 0; !rc && i < st->step_in_epoch; i++) rc = loom_iter_next(r->train, &b, err);
    if (rc == LOOM_EEOF)
        rc = loom_err_set(err, LOOM_ECHECKPOINT, NULL, "data.train ends before step %lld of epoch %lld: it is not the "
                          "pipeline the checkpoint was trained on", (long long)st->step_in_epoch, (long long)st->epoch + 1);
    return rc;
}

/* The steps since the last summary (run.summary_steps): their means go to
 * TensorBoard and to a "summary" line of metrics.jsonl, the same values. */
typedef struct summary_window {
    double  loss_sum, sec, input_sec;
    int64_t correct, examples;
} summary_window;

static int log_summary(run *r, FILE *metrics, loom_summary *tb, summary_window *w, int64_t step, double lr,
                       bool has_acc, loom_err *err)
{
    char htag[LOOM_MAX_HEADS * 2][LOOM_NAME_MAX + 16];
    double hv[LOOM_MAX_HEADS * 2];
    int nh = window_heads(r, w->examples, htag, hv); /* several heads: each one's loss and accuracy */
    const char *tag[] = {"loss", "accuracy", "learning_rate", "samples_per_sec", "input_wait_fraction"};
    double v[] = {w->examples ? w->loss_sum / (double)w->examples : NAN,
                  w->examples && has_acc ? (double)w->correct / (double)w->examples : NAN, lr,
                  w->sec > 0 ? (double)w->examples / w->sec : 0, w->sec > 0 ? w->input_sec / w->sec : 0};
    memset(w, 0, sizeof *w);
    fprintf(metrics, "{\"event\": \"summary\", \"step\": %lld", (long long)step);
    for (int i = 0; i < 5; i++)
        if (i != 1 || has_acc) train_json_num_(metrics, tag[i], v[i], 0); /* a regression has no accuracy */
    for (int i = 0; i < nh; i++) train_json_num_(metrics, htag[i], hv[i], 0);
    train_json_time_(metrics, "wall_time", loom_wall_time());
    fprintf(metrics, "}\n");
    int rc = LOOM_OK;
    for (int i = 0; i < 5 && !rc; i++)
        if (isfinite(v[i])) rc = loom_summary_scalar(tb, tag[i], step, v[i], err);
    for (int i = 0; i < nh && !rc; i++)
        if (isfinite(hv[i])) rc = loom_summary_scalar(tb, htag[i], step, hv[i], err);
    return rc ? rc : loom_summary_flush(tb, err);
}

/* Histograms of every parameter tensor, tagged with its name. */
static int log_histograms(loom_summary *tb, loom_model *m, int64_t step, loom_err *err)
{
    const float *p = loom_model_params(m);
    int rc = LOOM_OK;
    for (int i = 0; i < loom_model_num_param_tensors(m) && !rc; i++) {
        const loom_param_info *t = loom_model_param_tensor(m, i);
        rc = loom_summary_histogram(tb, t->name, step, p + t->offset, loom_shape_numel(&t->shape), err);
    }
    return rc ? rc : loom_summary_flush(tb, err);
}

/* An evaluation (ev, its metrics in r->macc[1]) to TensorBoard: loss and each metric. */
int train_log_eval_(run *r, loom_summary *tb, int64_t step, double loss, const loom_step_result *ev, loom_err *err)
{
    if (!tb || !isfinite(loss)) return LOOM_OK;
    int rc = loom_summary_scalar(tb, "loss", step, loss, err);
    loom_model *m = loom_strategy_model(r->strat);
    for (int i = 0; i < loom_model_num_metrics(m) && !rc; i++) {
        double v = loom_model_metric_value(m, i, r->macc[1], ev->correct, ev->examples);
        if (isfinite(v)) rc = loom_summary_scalar(tb, loom_metric_name(loom_model_metric(m, i)), step, v, err);
    }
    for (int h = 0; h < loom_model_num_heads(m) && loom_model_num_heads(m) > 1 && !rc; h++)
        for (int q = 0; q < 2 && !rc; q++) {
            char key[LOOM_NAME_MAX + 32];
            if (q && !loom_model_head_accuracy(m, h)) continue;
            double v = head_metric(r, 1, h, q, ev->examples, "", key, sizeof key);
            if (isfinite(v)) rc = loom_summary_scalar(tb, key, step, v, err);
        }
    return rc ? rc : loom_summary_flush(tb, err);
}

/* The event files of <model_dir> and <model_dir>/eval (when there is eval
 * data), opened before training starts, with the resolved config as text. */
static int open_summaries(run *r, int64_t resume_step, loom_summary **train, loom_summary **eval, loom_err *err)
{
    *train = *eval = NULL;
    if (r->spec->run.summary_steps <= 0 || !r->chief) return LOOM_OK; /* the chief writes the job's */
    char dir[LOOM_PATH_MAX + 8];
    snprintf(dir, sizeof dir, "%s/eval", r->model_dir);
    int rc = loom_summary_open(train, r->model_dir, resume_step, err);
    if (!rc && r->eval && !r->sidecar_eval) rc = loom_summary_open(eval, dir, resume_step, err);
    char *text = NULL;
    size_t len = 0;
    FILE *f = rc ? NULL : open_memstream(&text, &len);
    if (f) {
        fputs("```\n", f); /* Markdown: keep the config's layout */
        loom_config_print(r->spec, f);
        fputs("```\n", f);
        fclose(f);
        rc = loom_summary_text(*train, "config", resume_step > 0 ? resume_step : 0, text, len, err);
        if (!rc) rc = loom_summary_flush(*train, err);
    }
    free(text);
    if (rc) {
        loom_summary_close(*train, NULL);
        loom_summary_close(*eval, NULL);
        *train = *eval = NULL;
    }
    return rc;
}

/* <model_dir>/final.json: training ended (not stopped by a signal or a
 * failure) with this checkpoint, for the sidecar evaluator and for a rerun.
 * reason: "finished" (run.epochs or run.max_steps reached) or "stopped" (a
 * hook's ctx:stop()); epochs and max_steps are the run's, so that a rerun
 * of a stopped run with the same ones has nothing to do, and one with other
 * ones trains on (stopped_marker). */
static int write_final_marker(const char *dir, int64_t step, const char *ckpt, bool stopped, const loom_run_spec *rs,
                              loom_err *err)
{
    char path[LOOM_PATH_MAX + 16], text[LOOM_PATH_MAX + 224];
    const char *base = strrchr(ckpt, '/');
    snprintf(path, sizeof path, "%s/" LOOM_FINAL_MARKER, dir);
    int n = snprintf(text, sizeof text,
                     "{\"step\": %lld, \"checkpoint\": \"%s\", \"reason\": \"%s\", \"epochs\": %lld, "
                     "\"max_steps\": %lld, \"wall_time\": %.3f}\n",
                     (long long)step, base ? base + 1 : ckpt, stopped ? "stopped" : "finished", (long long)rs->epochs,
                     (long long)rs->max_steps, loom_wall_time());
    return loom_write_file_atomic(path, text, (size_t)n, err);
}

/* The integer after "key": in a final.json's text, or def. */
static long long marker_int(const char *text, const char *key, long long def)
{
    char k[32];
    snprintf(k, sizeof k, "\"%s\":", key);
    const char *p = strstr(text, k);
    return p ? strtoll(p + strlen(k), NULL, 10) : def;
}

/* <model_dir>/final.json says a hook stopped the run at `step` (the
 * checkpoint resumed from), under the same run.epochs and run.max_steps as
 * now: the run is finished, as one that reached them is. */
static bool stopped_marker(const char *dir, int64_t step, const loom_run_spec *rs)
{
    char path[LOOM_PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/" LOOM_FINAL_MARKER, dir);
    uint8_t *d = NULL;
    size_t len;
    loom_err e;
    if (access(path, F_OK) || loom_read_file_max(path, &d, &len, 1 << 16, &e)) return false;
    const char *text = (const char *)d; /* loom_read_file_max ends it with a NUL */
    bool stopped = strstr(text, "\"reason\": \"stopped\"") && marker_int(text, "step", -1) == step &&
                   marker_int(text, "epochs", -1) == rs->epochs && marker_int(text, "max_steps", -1) == rs->max_steps;
    loom_free(d);
    return stopped;
}

/* ---- the trainer: loom_train as a loop with named seams ------------------
 *
 *   trainer_open     pipelines, strategy, hooks, status endpoint, model_dir and
 *                    its lock: everything is checked before anything is written
 *                    (a task that serves the job runs the strategy's loop instead)
 *   trainer_resume   the latest checkpoint (or --fresh's archive of the old ones)
 *   final_marker_clear  the sidecar evaluator's end marker goes while the job goes on
 *   sink_open        the metrics sink: the one way out for every figure, fanned
 *                    out to the log (and progress line), metrics.jsonl,
 *                    TensorBoard's event files and the status endpoint
 *   signals_catch    SIGINT / SIGTERM become a stop request (signals_restore)
 *   trainer_loop     the step loop and its named points:
 *     at_step_begin    the epoch's begin hook; a hook's or a signal's stop
 *     take_step        one batch through the strategy (or the Lua train_step)
 *     after_step       non-finite weights, the step's counts, a job's agreed stop
 *     at_epoch_end     evaluation, the epoch's figures, its end hook, next pass
 *     at_boundary      an execution's end: progress, summaries, checkpoint
 *                      cadence (checkpoint_due / checkpoint_now), step_end hook
 *   trainer_finish   the last checkpoint, the last evaluation, train_end, end line,
 *                    the sidecar evaluator's end marker
 *   trainer_close    the sink, the pipelines, the strategy, the lock
 *
 * The trainer reaches the model only through the strategy's interface
 * (loom_strategy_*), so a plugin's strategy and a built-in one are alike. */

/* Everything the metrics sink writes to (the chief's; elsewhere /dev/null and none). */
typedef struct metrics_sink {
    FILE               *jsonl;       /* <model_dir>/metrics.jsonl */
    loom_summary       *tb, *tb_eval; /* TensorBoard: <model_dir>, <model_dir>/eval; NULL: none */
    loom_progress_state prog;        /* the log's progress line */
    summary_window      win;         /* the steps since the last summary */
    double              summary_sec; /* spent writing TensorBoard summaries, for the end line */
} metrics_sink;

typedef struct trainer {
    run                    r;
    const loom_spec       *spec;
    const loom_run_spec   *rs;
    const loom_train_opts *opts;
    int                    lock_fd; /* the model_dir lock (the chief's), or -1 */
    bool                   serves;  /* a ps task or a parameter-server worker: the strategy serves the job */
    trainer_state          st;
    loom_model            *model;
    loom_optimizer        *opt;
    metrics_sink           sink;
    hook_save_arg          hsa;     /* ctx:save_checkpoint() */
    char                   ckpt[LOOM_PATH_MAX], last_ckpt[LOOM_PATH_MAX];
    int64_t                steps_per_epoch; /* data.train's cardinality; -1: unknown (a csv source, a filter) */
    int64_t                learned_spe;     /* unknown ahead: the steps of the last epoch that ended; -1: none yet */
    int64_t                start_step, last_saved, run_examples, last_eval_step;
    /* run.steps_per_execution = K: the steps of one execution run back to
     * back; the host-side work (signals, progress, checkpoints; callbacks
     * belong there too) happens only at its boundaries: after K steps, at an
     * epoch's end, at each multiple of run.checkpoint_steps (so checkpoints
     * land on them, whatever an epoch's end did to the count) and at the
     * last step (TPUEstimator's iterations_per_loop).
     * The steps themselves are the same, so the weights are too. */
    int64_t                K, in_exec, boundary_step; /* steps since the last boundary, and its step */
    double                 run_start, epoch_start, last_ckpt_time; /* run.checkpoint_secs counts from the last */
    double                 train_sec, run_train_sec, input_sec; /* input_sec: this epoch's inside loom_iter_next */
    double                 first_step_ms, last_eval_loss, last_eval_acc;
    loom_step_result       last_ev;     /* the last evaluation (its metrics in r.macc[1]) */
    bool                   epoch_open;  /* on_epoch_begin was called for the epoch in progress */
    bool                   input_ended; /* data.train ended this epoch; other tasks of the job may still have a step */
    bool                   stopped;     /* resumed where a hook stopped the run, under the same epochs and max_steps */
    sig_atomic_t           stop_asked;  /* the signal whose stop request the strategy carries to the other tasks */
    struct sigaction       old_int, old_term;
    char                   resume_key[320], resume_text[1280]; /* resume_point */
} trainer;

/* The steps of one epoch: data.train's cardinality, else (a source of
 * unknown length) those of the last epoch that ended; -1 before one did. */
static int64_t epoch_steps(const trainer *t)
{
    return t->steps_per_epoch > 0 ? t->steps_per_epoch : t->learned_spe > 0 ? t->learned_spe : -1;
}

/* The run's epochs, as every line that counts them says it ("epoch 2/4",
 * "after epoch 1 of 4"): run.epochs, or with run.max_steps (which overrides
 * it) the epochs those steps take; -1 while unknown. */
static int64_t run_epochs(const trainer *t)
{
    if (t->rs->max_steps <= 0) return t->rs->epochs;
    int64_t spe = epoch_steps(t);
    return spe > 0 ? (t->rs->max_steps + spe - 1) / spe : -1;
}

/* run_epochs as text into buf ("?" while unknown). */
static const char *run_epochs_str(const trainer *t, char *buf, size_t n)
{
    int64_t e = run_epochs(t);
    if (e >= 0) snprintf(buf, n, "%lld", (long long)e);
    else snprintf(buf, n, "?");
    return buf;
}

/* run.max_steps or run.epochs reached */
static bool trainer_reached(const trainer *t)
{
    return t->rs->max_steps > 0 ? t->st.step >= t->rs->max_steps : t->st.epoch >= t->rs->epochs;
}

/* reached, or stopped by a hook (ctx:stop()) with the same budget: a rerun
 * has nothing to do */
static bool trainer_done(const trainer *t)
{
    return t->stopped || trainer_reached(t);
}

/* The job goes on: a watcher (the sidecar evaluator) must not stop at an
 * earlier run's end marker. */
static void final_marker_clear(trainer *t)
{
    run *r = &t->r;
    if (!trainer_done(t) && r->chief) {
        char fin[LOOM_PATH_MAX + 16];
        snprintf(fin, sizeof fin, "%s/" LOOM_FINAL_MARKER, r->model_dir);
        unlink(fin);
    }
    if (r->sidecar_eval && r->chief && r->eval)
        loom_info("the cluster's evaluator task evaluates the checkpoints; the chief does not evaluate");
}

/* ---- the metrics sink ---- */

/* Opens the event files and metrics.jsonl (trimmed to the checkpoint's step
 * on resume); a finished run's rerun adds no event file. */
static int sink_open(trainer *t, loom_err *err)
{
    metrics_sink *s = &t->sink;
    run *r = &t->r;
    if (!trainer_done(t) && open_summaries(r, t->last_ckpt[0] ? t->st.step : -1, &s->tb, &s->tb_eval, err))
        return err->code;
    char path[LOOM_PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/metrics.jsonl", r->model_dir);
    if (r->chief && !t->opts->fresh && loom_metrics_trim(path, t->st.step, t->st.epoch, err) < 0) return err->code;
    /* the chief writes the job's (a regular file: a FIFO in its place would block the run) */
    s->jsonl = r->chief ? loom_fopen_append_regular(path, err) : fopen("/dev/null", "a");
    if (!s->jsonl)
        return r->chief ? err->code : loom_err_set(err, LOOM_EIO, "/dev/null", "cannot open for appending: %s", strerror(errno));
    loom_progress_init(&s->prog, r->chief ? t->rs->progress : LOOM_PROGRESS_NONE, t->rs->log_steps);
    r->hooks.metrics = s->jsonl; /* ctx:log_scalar writes beside the trainer's figures */
    r->hooks.summary = s->tb;
    return LOOM_OK;
}

/* The first error of closing wins over none (rc). */
static int sink_close(metrics_sink *s, int rc, loom_err *err)
{
    if (s->jsonl) fclose(s->jsonl);
    loom_err cerr;
    int crc = loom_summary_close(s->tb, &cerr);
    if (!crc) crc = loom_summary_close(s->tb_eval, &cerr);
    else loom_summary_close(s->tb_eval, NULL);
    if (crc && !rc) *err = cerr, rc = crc;
    memset(s, 0, sizeof *s);
    return rc;
}

/* The status endpoint's figures. */
static void sink_state(trainer *t, loom_status_state state, double sps, double input_wait)
{
    publish(&t->r, &t->st, state, t->opt, sps, input_wait, t->last_eval_loss, t->last_eval_acc, t->run_examples);
}

/* A step's counts into the summary window. */
static void sink_step(trainer *t, const loom_step_result *res, double dt, double t_input)
{
    summary_window *w = &t->sink.win;
    w->sec += dt;
    w->input_sec += t_input;
    w->loss_sum += res->loss_sum;
    w->correct += res->correct;
    w->examples += res->examples;
}

/* An execution's end: the progress line, the status endpoint, the autotuner's news. */
static void sink_progress(trainer *t, double sps)
{
    const trainer_state *st = &t->st;
    int64_t max_steps = t->rs->max_steps, epochs = t->rs->epochs, spe = epoch_steps(t);
    /* this process's pace over its run so far, evaluations and checkpoints
     * included, as the steps left will take them (a resumed run's earlier
     * steps took no time here) */
    double per_step = (loom_now() - t->run_start) / (double)(st->step - t->start_step);
    int64_t left = max_steps > 0 ? max_steps - st->step
                   : spe > 0     ? (epochs - st->epoch) * spe - st->step_in_epoch
                                 : -1;
    if (left < 0 && spe > 0) left = 0; /* an epoch longer than the last one's */
    loom_progress_update(&t->sink.prog, st->epoch, run_epochs(t), st->step_in_epoch, spe, st->step,
                         st->loss_sum / (double)st->examples,
                         t->r.has_acc ? (double)st->correct / (double)st->examples : NAN, sps,
                         left >= 0 ? per_step * (double)left : -1);
    sink_state(t, LOOM_STATUS_TRAINING, sps, t->sink.prog.input_wait);
    char tuned[512];
    /* once the autotuner's choice settles, and after a change */
    if (loom_iter_tuned(t->r.train, tuned, sizeof tuned)) {
        loom_progress_break(&t->sink.prog);
        loom_info("input pipeline tuned: %s", tuned);
    }
}

/* The summary window's means to TensorBoard and metrics.jsonl. */
static int sink_summary(trainer *t, loom_err *err)
{
    double ts = loom_now();
    int rc = log_summary(&t->r, t->sink.jsonl, t->sink.tb, &t->sink.win, t->st.step, loom_optimizer_lr(t->opt, t->st.step),
                         t->r.has_acc, err);
    t->sink.summary_sec += loom_now() - ts;
    return rc;
}

/* An evaluation's loss and model.metrics (ev, its state in r.macc[1]) to <model_dir>/eval's event file. */
static int sink_eval(trainer *t, const loom_step_result *ev, loom_err *err)
{
    double ts = loom_now();
    int rc = train_log_eval_(&t->r, t->sink.tb_eval, t->st.step, t->last_eval_loss, ev, err);
    t->sink.summary_sec += loom_now() - ts;
    return rc;
}

/* The parameters' histograms, every run.histogram_epochs epochs. */
static int sink_histograms(trainer *t, loom_err *err)
{
    if (!t->sink.tb || t->rs->histogram_epochs <= 0 || (t->st.epoch + 1) % t->rs->histogram_epochs) return LOOM_OK;
    double ts = loom_now();
    int rc = log_histograms(t->sink.tb, t->model, t->st.step, err);
    t->sink.summary_sec += loom_now() - ts;
    return rc;
}

/* An epoch's end (ev: its evaluation, none without examples): the log line,
 * metrics.jsonl's epoch line, the status endpoint. */
static void sink_epoch(trainer *t, const loom_step_result *ev, double sps, double input_wait, double ep_sec)
{
    const trainer_state *st = &t->st;
    FILE *m = t->sink.jsonl;
    run *r = &t->r;
    double train_loss = st->examples ? st->loss_sum / (double)st->examples : NAN;
    /* never a NaN in the log: metrics that were not measured are named as such */
    char tr[320], evs[320], mt[256];
    if (st->examples)
        snprintf(tr, sizeof tr, "train loss %.4f%s", train_loss,
                 metrics_text(r, 0, st->correct, st->examples, mt, sizeof mt));
    else
        snprintf(tr, sizeof tr, "no training examples this epoch");
    if (ev->examples)
        snprintf(evs, sizeof evs, "; eval loss %.4f%s", t->last_eval_loss,
                 metrics_text(r, 1, ev->correct, ev->examples, mt, sizeof mt));
    else
        snprintf(evs, sizeof evs, "%s", t->r.eval ? (t->rs->eval_each_epoch ? "; eval data yielded no batch" : "")
                                                  : "; no eval data");
    char of[24];
    loom_info("epoch %lld/%s: step %lld, %s%s, %.0f samples/s, input_wait %.1f%%, %.1f s", (long long)st->epoch + 1,
              run_epochs_str(t, of, sizeof of), (long long)st->step, tr, evs, sps, input_wait * 100, ep_sec);
    fprintf(m, "{\"event\": \"epoch\", \"epoch\": %lld, \"step\": %lld", (long long)st->epoch + 1, (long long)st->step);
    train_json_num_(m, "train_loss", train_loss, 0);
    metrics_json(r, m, "train_", 0, st->correct, st->examples);
    train_json_num_(m, "eval_loss", ev->examples ? t->last_eval_loss : NAN, 0);
    metrics_json(r, m, "eval_", 1, ev->correct, ev->examples);
    train_json_num_(m, "samples_per_sec", sps, 0);
    train_json_num_(m, "learning_rate", loom_optimizer_lr(t->opt, st->step), 0);
    train_json_num_(m, "epoch_seconds", ep_sec, 0);
    train_json_num_(m, "input_wait_fraction", input_wait, 0);
    train_json_time_(m, "wall_time", loom_wall_time());
    fprintf(m, "}\n");
    fflush(m);
    sink_state(t, LOOM_STATUS_TRAINING, sps, input_wait);
}

/* The run's end: the log's last line and metrics.jsonl's end line (a rerun
 * of a finished run adds no second one). */
static void sink_end(trainer *t)
{
    const trainer_state *st = &t->st;
    double total = loom_now() - t->run_start;
    char of[24];
    run_epochs_str(t, of, sizeof of);
    if (st->step == t->start_step && t->stopped)
        loom_info("nothing to do: the run in %s was stopped by a hook (ctx:stop()) at step %lld (epoch %lld of %s); "
                  "raise run.epochs or run.max_steps to train further, or pass --fresh to start over",
                  t->r.model_dir, (long long)st->step, (long long)st->epoch + (st->step_in_epoch > 0), of);
    else if (st->step == t->start_step && t->r.hooks.stop)
        ; /* a hook stopped the run before its first step, and said so */
    else if (st->step == t->start_step)
        loom_info("nothing to do: the run in %s is finished, at step %lld (epoch %lld of %s); raise run.epochs or "
                  "run.max_steps to train further",
                  t->r.model_dir, (long long)st->step, (long long)st->epoch, of);
    else {
        char evs[320], mt[256];
        if (!isnan(t->last_eval_acc))
            snprintf(evs, sizeof evs, "eval accuracy %.4f", t->last_eval_acc);
        else if (t->last_ev.examples) /* a regression, or metrics without accuracy */
            snprintf(evs, sizeof evs, "eval loss %.4f%s", t->last_eval_loss,
                     metrics_text(&t->r, 1, t->last_ev.correct, t->last_ev.examples, mt, sizeof mt));
        else
            snprintf(evs, sizeof evs, "%s", t->r.sidecar_eval ? "evaluated by the evaluator task"
                                            : t->r.eval         ? "not evaluated"
                                                                : "no eval data");
        loom_info("done: step %lld, %s, %.1f s, checkpoint %s", (long long)st->step, evs, total, t->last_ckpt);
    }
    if (st->step == t->start_step) return;
    FILE *m = t->sink.jsonl;
    fprintf(m, "{\"event\": \"end\", \"step\": %lld, \"epoch\": %lld", (long long)st->step, (long long)st->epoch);
    train_json_num_(m, "eval_loss", t->last_eval_loss, 0);
    metrics_json(&t->r, m, "eval_", 1, t->last_ev.correct, t->last_ev.examples);
    train_json_num_(m, "samples_per_sec", t->run_train_sec > 0 ? (double)t->run_examples / t->run_train_sec : 0, 0);
    train_json_num_(m, "seconds", total, 0);
    train_json_num_(m, "first_step_ms", t->first_step_ms, 0);
    train_json_num_(m, "decode_ms", t->r.decode_sec * 1e3, 0);
    train_json_num_(m, "peak_rss_mb", peak_rss_mb(), 0);
    train_json_num_(m, "summary_ms", t->sink.summary_sec * 1e3, 0);
    train_json_time_(m, "wall_time", loom_wall_time());
    fprintf(m, "}\n");
}

/* ---- opening, resuming, closing ---- */

/* A task that is not the chief logs only its warnings and errors, under its name. */
static void log_as_task(const loom_cluster *c)
{
    char task[64];
    loom_log_set_name(loom_task_name(c->role, c->index, task, sizeof task));
    if (loom_log_get_level() < LOOM_LOG_WARN) loom_log_set_level(LOOM_LOG_WARN);
}

/* Where a task of a job resumes from, as it finds its model_dir before the
 * strategy opens (a chief's --fresh sets the checkpoints aside only later),
 * for the strategy to compare across the tasks (loom_strategy_args): key
 * names the starting point ("scratch", or the checkpoint's name, step, size
 * and CRC-32C: its identity, also in a model_dir that is not shared), text
 * says it for the error that tasks disagree. */
static void resume_point(const char *dir, bool fresh, char *key, size_t kn, char *text, size_t tn)
{
    char path[LOOM_PATH_MAX], abs_dir[PATH_MAX];
    int64_t step = -1;
    loom_err e;
    int rc = loom_ckpt_latest(dir, path, &step, &e);
    if (!realpath(dir, abs_dir)) snprintf(abs_dir, sizeof abs_dir, "%s", dir);
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    if (fresh || rc == LOOM_EEOF) {
        snprintf(key, kn, "scratch");
        if (fresh)
            snprintf(text, tn, "step 0 (--fresh in %.900s%s%.200s)", abs_dir, rc ? "" : ", setting aside ", rc ? "" : base);
        else snprintf(text, tn, "step 0 (no checkpoint in %.900s)", abs_dir);
        return;
    }
    if (rc) { /* trainer_resume reports it; the tasks compare what they could read */
        snprintf(key, kn, "unreadable: %.200s", e.msg);
        snprintf(text, tn, "an unreadable model_dir %.900s (%.200s)", abs_dir, e.msg);
        return;
    }
    uint32_t crc = 0;
    uint64_t size = 0;
    FILE *f = fopen(path, "rb");
    static const size_t chunk = (size_t)1 << 20;
    char *buf = f ? loom_alloc(chunk) : NULL;
    size_t got;
    while (buf && (got = fread(buf, 1, chunk, f)) > 0) crc = loom_crc32c_extend(crc, buf, got), size += got;
    loom_free(buf);
    if (f) fclose(f);
    snprintf(key, kn, "%.200s step %lld size %llu crc %08x", base, (long long)step, (unsigned long long)size, crc);
    snprintf(text, tn, "step %lld (%.200s in %.900s, %llu bytes, CRC-32C %08x)", (long long)step, base, abs_dir,
             (unsigned long long)size, crc);
}

/* The pipelines, the strategy, the hooks, the status endpoint, model_dir and
 * its lock; for a task that serves the job (t->serves), the pipelines and the
 * strategy alone. */
static int trainer_open(trainer *t, const loom_spec *spec, const loom_train_opts *opts, loom_err *err)
{
    memset(t, 0, sizeof *t);
    t->spec = spec, t->rs = &spec->run, t->opts = opts, t->lock_fd = -1;
    run *r = &t->r;
    const char *dir = opts->model_dir ? opts->model_dir : spec->run.model_dir;
    if (opts->cluster)
        resume_point(dir, opts->fresh, t->resume_key, sizeof t->resume_key, t->resume_text, sizeof t->resume_text);
    int rc = train_run_open_at_(r, spec, dir, opts->cluster, opts->cluster ? t->resume_key : NULL,
                                opts->cluster ? t->resume_text : NULL, err);
    if (!rc && loom_strategy_serves(r->strat)) { /* a ps task or a parameter-server worker: trainer_serve */
        t->serves = true;
        log_as_task(opts->cluster);
        return LOOM_OK;
    }
    r->sidecar_eval = opts->cluster && opts->cluster->n_tasks[LOOM_ROLE_EVALUATOR] > 0;
    if (!rc && !r->chief) log_as_task(opts->cluster); /* the chief logs the job */
    if (!rc) rc = train_hooks_open_(&r->hooks, spec, r->model_dir, r->strat, err);
    if (!rc) rc = train_metrics_open_(r, err);
    if (!rc && spec->run.status_port && r->chief) { /* the chief reports the job; a port in use fails here, before anything is written */
        char w[600];
        rc = loom_status_open(&r->status, spec->run.status_bind, spec->run.status_port,
                              loom_loc_str(&spec->run.loc, w, sizeof w), err);
        if (!rc)
            loom_info("status endpoint: http://%s%s%s:%d/metrics (also /healthz, /status)",
                      strchr(spec->run.status_bind, ':') ? "[" : "", spec->run.status_bind,
                      strchr(spec->run.status_bind, ':') ? "]" : "", loom_status_port(r->status));
    }
    if (!rc && (rc = loom_mkdirs(dir, err)) != LOOM_OK)
        loom_err_hint(err, "set run.model_dir (or --model-dir) to a directory you can write");
    /* two jobs must not share a model_dir: the chief (or the one process)
     * holds its lock; the other tasks of the job share it */
    if (!rc && r->chief) rc = loom_dir_lock_(r->model_dir, opts->cluster, &t->lock_fd, err);
    if (rc) return rc;
    t->model = loom_strategy_model(r->strat);
    t->opt = loom_strategy_optimizer(r->strat);
    int64_t card = loom_iter_cardinality(r->train);
    t->steps_per_epoch = card > 0 ? card : -1;
    t->learned_spe = -1;
    return LOOM_OK;
}

/* strategy.elastic: the trainer's state for a task entering the running
 * job (the chief's, after `st->step` steps): u64 length and the trainer
 * state with the hooks' (as a checkpoint's), u64 length and data.train's
 * state (empty: replayed, as a resume does). */
static int join_state_save(void *arg, loom_buf *out, loom_err *err)
{
    trainer *t = arg;
    loom_buf ts, is;
    loom_buf_init(&ts);
    loom_buf_init(&is);
    state_save(&t->st, &ts);
    int rc = t->r.hooks.hooks ? loom_hooks_save(t->r.hooks.hooks, &ts, err) : LOOM_OK;
    if (!rc && !t->r.no_iter) rc = loom_iter_save(t->r.train, &is, err);
    if (!rc) {
        loom_buf_put_u64(out, ts.len);
        loom_buf_put(out, ts.data, ts.len);
        loom_buf_put_u64(out, is.len);
        loom_buf_put(out, is.data, is.len);
        if (out->failed) rc = loom_err_set(err, LOOM_ENOMEM, NULL, "packing the trainer's state for a joining worker");
    }
    loom_buf_fini(&ts);
    loom_buf_fini(&is);
    return rc;
}

/* A task admitted into a running job (strategy.elastic): the chief's state
 * instead of a checkpoint's; the variables and slots came with the admission. */
static int trainer_join(trainer *t, const loom_buf *blob, loom_err *err)
{
    run *r = &t->r;
    loom_buf b, ts, is;
    loom_buf_wrap(&b, blob->data, blob->len);
    uint64_t n = loom_buf_get_u64(&b);
    loom_buf_wrap(&ts, b.data + b.pos, !b.failed && n <= b.len - b.pos ? (size_t)n : 0);
    b.pos += ts.len;
    n = loom_buf_get_u64(&b);
    loom_buf_wrap(&is, b.data + b.pos, !b.failed && n <= b.len - b.pos ? (size_t)n : 0);
    int rc = b.failed ? loom_err_set(err, LOOM_ENET, NULL, "the chief's trainer state is truncated") : LOOM_OK;
    if (!rc) rc = state_restore(&t->st, &ts, "the chief's trainer state", err);
    if (!rc && r->hooks.hooks) rc = loom_hooks_restore(r->hooks.hooks, &ts, err);
    if (!rc) rc = is.len ? loom_iter_restore(r->train, &is, err) : replay_data(r, &t->st, err);
    if (rc) return loom_err_prefix(err, "entering the running job");
    if (t->st.epoch > 0) t->learned_spe = (t->st.step - t->st.step_in_epoch) / t->st.epoch;
    loom_info("joined the running job at step %lld (%lld step%s into epoch %lld)", (long long)t->st.step,
              (long long)t->st.step_in_epoch, t->st.step_in_epoch == 1 ? "" : "s", (long long)t->st.epoch + 1);
    return LOOM_OK;
}

/* The latest checkpoint's checkpointed state into the model, optimizer,
 * hooks and data.train (every task reads it from the shared model_dir, as
 * TF's do); with --fresh the chief moves the earlier ones aside. */
static int trainer_resume(trainer *t, loom_err *err)
{
    run *r = &t->r;
    int64_t ckpt_step = 0;
    char *ckpt = t->ckpt;
    const loom_buf *joined = loom_strategy_elastic_joined(r->strat, NULL);
    if (joined) return trainer_join(t, joined, err);
    if (r->chief) loom_remove_stale_tmp(r->model_dir); /* left by runs killed while writing (the chief holds it) */
    int rc = loom_ckpt_latest(r->model_dir, ckpt, &ckpt_step, err);
    if (rc == LOOM_EEOF) return LOOM_OK; /* none: a new run */
    if (rc) return rc;
    if (t->opts->fresh) {
        if (!r->chief) return LOOM_OK;
        char moved[LOOM_PATH_MAX];
        if ((rc = loom_ckpt_archive(r->model_dir, moved, err))) return rc;
        loom_info("--fresh: moved the earlier checkpoints to %s", moved);
        return LOOM_OK;
    }
    loom_buf ts, stored, is;
    loom_buf_init(&is);
    rc = loom_ckpt_load(ckpt, t->model, t->opt, &ts, &stored, err);
    if (!rc) rc = state_restore(&t->st, &ts, ckpt, err);
    if (!rc && t->st.step != ckpt_step)
        rc = loom_err_set(err, LOOM_ECHECKPOINT, ckpt, "the file is named for step %lld but holds step %lld",
                          (long long)ckpt_step, (long long)t->st.step);
    if (!rc && r->hooks.hooks) rc = loom_hooks_restore(r->hooks.hooks, &ts, err);
    if (!rc && stored.len) rc = loom_strategy_pick_iter_state(r->strat, &stored, &is, err); /* this task's */
    if (!rc) rc = is.len ? loom_iter_restore(r->train, &is, err) : replay_data(r, &t->st, err);
    if (!rc) rc = loom_strategy_sync(r->strat, err);
    loom_buf_fini(&ts);
    loom_buf_fini(&stored);
    loom_buf_fini(&is);
    if (rc) {
        if (!err->where[0]) snprintf(err->where, sizeof err->where, "%.*s", (int)sizeof err->where - 1, ckpt);
        if (!err->hint[0]) loom_err_hint(err, "pass --fresh to start from scratch, or use another model_dir");
        return rc;
    }
    snprintf(t->last_ckpt, sizeof t->last_ckpt, "%s", ckpt);
    t->stopped = stopped_marker(r->model_dir, t->st.step, t->rs);
    /* the finished epochs' size, for a source of unknown length (progress, ETA) */
    if (t->st.epoch > 0) t->learned_spe = (t->st.step - t->st.step_in_epoch) / t->st.epoch;
    /* st.epoch counts finished epochs, as "nothing to do" and the epoch lines do */
    char of[24];
    run_epochs_str(t, of, sizeof of);
    if (t->st.step_in_epoch == 0)
        loom_info("resuming from %s (step %lld, after epoch %lld of %s)", ckpt, (long long)t->st.step,
                  (long long)t->st.epoch, of);
    else
        loom_info("resuming from %s (step %lld, %lld step%s into epoch %lld of %s)", ckpt, (long long)t->st.step,
                  (long long)t->st.step_in_epoch, t->st.step_in_epoch == 1 ? "" : "s", (long long)t->st.epoch + 1, of);
    return LOOM_OK;
}

static int trainer_close(trainer *t, int rc, loom_err *err)
{
    rc = sink_close(&t->sink, rc, err);
    if (rc) loom_strategy_set_failing(t->r.strat);
    train_run_close_(&t->r);
    loom_dir_unlock_(t->lock_fd);
    return rc;
}

/* ---- the named points ---- */

static void signals_catch(trainer *t)
{
    struct sigaction sa = {0};
    sa.sa_handler = on_signal;
    stop_signal = 0;
    sigaction(SIGINT, &sa, &t->old_int);
    sigaction(SIGTERM, &sa, &t->old_term);
}

static void signals_restore(trainer *t)
{
    sigaction(SIGINT, &t->old_int, NULL);
    sigaction(SIGTERM, &t->old_term, NULL);
}

/* Calls the hooks of `kind` with ctx.epoch = epoch; a failing hook saves a
 * checkpoint (hook_failed) and its error ends the run. */
static int at_hook(trainer *t, loom_hook_kind kind, int64_t epoch, double sps, loom_err *err)
{
    loom_hook_logs hl = hook_logs(&t->st, epoch, t->opt, sps, t->last_eval_loss, t->last_eval_acc);
    int rc = train_hooks_call_(&t->r.hooks, kind, &hl, err);
    if (rc) hook_failed(&t->r, &t->st, err);
    return rc;
}

/* A checkpoint now, remembered as the last one. */
static int checkpoint_now(trainer *t, loom_err *err)
{
    int rc = save_ckpt(&t->r, &t->st, t->ckpt, err);
    if (rc) return rc;
    snprintf(t->last_ckpt, sizeof t->last_ckpt, "%s", t->ckpt);
    t->last_saved = t->st.step;
    t->last_ckpt_time = loom_now();
    return LOOM_OK;
}

/* A multiple of checkpoint_steps passed in this execution (with K = 1: this
 * step is one), or checkpoint_secs since the last checkpoint (Estimator's
 * save_checkpoints_secs). */
static bool checkpoint_due(const trainer *t)
{
    const loom_run_spec *rs = t->rs;
    return (rs->checkpoint_steps > 0 && t->st.step / rs->checkpoint_steps != t->boundary_step / rs->checkpoint_steps) ||
           (rs->checkpoint_secs > 0 && loom_now() - t->last_ckpt_time >= rs->checkpoint_secs);
}

/* A signal between executions: saves a checkpoint and ends the run with
 * the signal's error; in a job across processes the strategy carries the
 * request through the next step, so every task stops after the same one
 * (after_step). */
static int at_signal(trainer *t, loom_err *err)
{
    if (t->in_exec != 0 || !stop_signal || t->stop_asked) return LOOM_OK;
    loom_stop_signal_note(stop_signal); /* which one (strategy.elastic: a worker's SIGTERM leaves the job) */
    if (loom_strategy_request_stop(t->r.strat)) {
        t->stop_asked = stop_signal;
        return LOOM_OK;
    }
    loom_progress_break(&t->sink.prog);
    int rc = save_ckpt(&t->r, &t->st, t->ckpt, err);
    if (!rc) {
        rc = loom_err_set(err, LOOM_EIO, NULL, "interrupted by signal %d at step %lld; saved %s", (int)stop_signal,
                          (long long)t->st.step, t->ckpt),
        loom_err_hint(err, "run the same command again to resume");
        loom_stop_signal_note(stop_signal); /* exit 128 + signal */
    }
    return rc;
}

/* Before a step: *stop when the run is done or a hook asked to stop. */
static int at_step_begin(trainer *t, bool *stop, loom_err *err)
{
    *stop = trainer_done(t);
    if (*stop) return LOOM_OK;
    if (t->r.hooks.stop) {
        loom_info("stopped by a hook (ctx:stop()) at step %lld, epoch %lld", (long long)t->st.step,
                  (long long)t->st.epoch + (t->st.step_in_epoch > 0));
        *stop = true;
        return LOOM_OK;
    }
    int rc;
    if (!t->epoch_open) {
        t->epoch_open = true;
        if ((rc = at_hook(t, LOOM_HOOK_EPOCH_BEGIN, t->st.epoch + 1, NAN, err))) return rc;
    }
    return at_signal(t, err);
}

/* The step's error: a custom step's failure saves a checkpoint, but not
 * after a collective timed out (the replicas left it at different points,
 * so replica 0's variables may hold a half-gathered update); a non-finite
 * loss names the last good checkpoint. */
static int step_failed(trainer *t, int rc, bool custom, bool applied, loom_err *err)
{
    trainer_state *st = &t->st;
    if (rc != LOOM_ENUMERIC && rc != LOOM_ETIMEOUT && custom) {
        if (applied) { /* the step's update is in the weights: count it */
            st->step++;
            st->step_in_epoch++;
        }
        hook_failed(&t->r, st, err);
        return rc;
    }
    if (rc != LOOM_ENUMERIC) return rc;
    loom_progress_break(&t->sink.prog);
    loom_err_set(err, LOOM_ENUMERIC, NULL, "the loss is not finite at step %lld (epoch %lld); training stopped",
                 (long long)st->step + 1, (long long)st->epoch + 1);
    if (t->last_ckpt[0])
        loom_err_hint(err, "the last good checkpoint is %s; lower the learning rate and run again", t->last_ckpt);
    else
        loom_err_hint(err, "no checkpoint was written; lower the learning rate and run again");
    return rc;
}

/* One step: the next batch of data.train through the strategy (or the
 * config's Lua train_step). *epoch_ended: data.train ended the epoch for
 * every task of the job, and no step was taken. *t_input: the time from t0
 * spent waiting for the batch. */
static int take_step(trainer *t, double t0, loom_step_result *res, double *t_input, bool *epoch_ended,
                     loom_err *err)
{
    run *r = &t->r;
    loom_elem *batch;
    *epoch_ended = false;
    int rc = t->input_ended ? LOOM_EEOF : loom_iter_next(r->train, &batch, err);
    *t_input = loom_now() - t0;
    if (rc == LOOM_EEOF) { /* the other tasks may have a step left, which this one takes with no examples */
        bool all_ended = true;
        t->input_ended = true;
        rc = loom_strategy_end_of_data(r->strat, t->st.step, res, &all_ended, err);
        if (rc || !all_ended) return rc;
        t->input_ended = false;
        if (t->st.step_in_epoch == 0) {
            rc = loom_err_set(err, LOOM_EDATA, t->spec->path, "data.train yielded no batch in epoch %lld",
                              (long long)t->st.epoch + 1);
            return loom_err_hint(err, "the dataset is empty after take/skip/batch(drop_remainder)");
        }
        *epoch_ended = true;
        return LOOM_OK;
    }
    if (rc == LOOM_ELUA) data_hook_failed(r, &t->st, err);
    if (rc) return rc;
    bool custom = r->hooks.hooks && loom_hooks_has_train_step(r->hooks.hooks), applied = false;
    if (custom) {
        loom_hook_logs hl = hook_logs(&t->st, t->st.epoch + 1, t->opt, NAN, t->last_eval_loss, t->last_eval_acc);
        rc = train_hooks_step_(&r->hooks, loom_iter_spec(r->train), batch, &hl, res, &applied, err);
    } else {
        rc = loom_strategy_train_step(r->strat, batch, t->st.step, res, err);
        if (rc == LOOM_EDATA) /* a label or weight the loss cannot take: say which batch holds it */
            loom_err_prefix(err, "data.train batch %lld of epoch %lld (step %lld)", (long long)t->st.step_in_epoch + 1,
                            (long long)t->st.epoch + 1, (long long)t->st.step + 1);
    }
    return rc ? step_failed(t, rc, custom, applied, err) : LOOM_OK;
}

/* After a step (started at t0): a non-finite weight stops the run; the
 * step's counts; a stop that some task of the job asked for rode on this
 * step, so every task stops here. */
static int after_step(trainer *t, const loom_step_result *res, double t0, double t_input, loom_err *err)
{
    trainer_state *st = &t->st;
    run *r = &t->r;
    if (loom_optimizer_take_nonfinite(t->opt)) { /* the loss was finite, the update was not */
        char what[160];
        loom_progress_break(&t->sink.prog);
        loom_model_find_nonfinite(t->model, what, sizeof what);
        int rc = loom_err_set(err, LOOM_ENUMERIC, NULL,
                              "a weight is not finite after step %lld (epoch %lld): %s, from a non-finite update "
                              "(gradient or learning rate) with a finite loss; training stopped",
                              (long long)st->step + 1, (long long)st->epoch + 1, what[0] ? what : "(another replica's)");
        if (t->last_ckpt[0])
            loom_err_hint(err, "the last good checkpoint is %s; lower the learning rate (or clip gradients) and run "
                               "again", t->last_ckpt);
        else
            loom_err_hint(err, "no checkpoint was written; lower the learning rate (or clip gradients) and run again");
        return rc;
    }
    double dt = loom_now() - t0;
    t->train_sec += dt;
    t->run_train_sec += dt;
    t->input_sec += t_input;
    sink_step(t, res, dt, t_input);
    t->sink.prog.input_wait = t->train_sec > 0 ? t->input_sec / t->train_sec : 0;
    st->step++;
    st->step_in_epoch++;
    st->loss_sum += res->loss_sum;
    st->correct += res->correct;
    st->examples += res->examples;
    t->run_examples += res->examples;
    if (t->first_step_ms < 0)
        t->first_step_ms =
            ((loom_now() - (t->opts->start_time > 0 ? t->opts->start_time : t->run_start)) - r->decode_sec) * 1e3;
    if (!loom_strategy_stop_agreed(r->strat)) return LOOM_OK;
    loom_progress_break(&t->sink.prog);
    int rc = save_ckpt(r, st, t->ckpt, err);
    if (!rc && t->stop_asked)
        rc = loom_err_set(err, LOOM_EIO, NULL, "interrupted by signal %d at step %lld; %s %s", (int)t->stop_asked,
                          (long long)st->step, r->chief ? "saved" : "the chief saved", t->ckpt),
        loom_err_hint(err, "run the same command again to resume"), loom_stop_signal_note(t->stop_asked);
    else if (!rc)
        rc = loom_err_set(err, LOOM_EIO, NULL, "another task of the job was interrupted: stopped at step %lld; "
                          "%s %s", (long long)st->step, r->chief ? "saved" : "the chief saved", t->ckpt),
        loom_err_hint(err, "run the job again to resume");
    return rc;
}

/* data.eval (the chief's), its figures kept as the last evaluation's. */
static int evaluate_now(trainer *t, loom_step_result *ev, loom_err *err)
{
    int rc = train_evaluate_all_(&t->r, t->r.eval, ev, err);
    if (rc) return rc;
    t->last_eval_loss = ev->examples ? ev->loss_sum / (double)ev->examples : NAN;
    t->last_eval_acc = ev->examples && t->r.has_acc ? (double)ev->correct / (double)ev->examples : NAN;
    t->last_eval_step = t->st.step;
    t->last_ev = *ev;
    return LOOM_OK;
}

/* An epoch's end (an execution boundary): evaluate, report, call the
 * epoch_end hooks, start the next pass, checkpoint. */
static int at_epoch_end(trainer *t, loom_err *err)
{
    trainer_state *st = &t->st;
    t->in_exec = 0;
    t->boundary_step = st->step;
    loom_progress_break(&t->sink.prog);
    double ep_sec = loom_now() - t->epoch_start;
    loom_step_result ev = {0};
    int rc = LOOM_OK;
    if (t->r.eval && t->rs->eval_each_epoch && t->r.chief && !t->r.sidecar_eval) {
        if ((rc = evaluate_now(t, &ev, err)) || (rc = sink_eval(t, &ev, err))) return rc;
    }
    if ((rc = sink_histograms(t, err))) return rc;
    take_metrics(&t->r, t->r.macc[0]); /* the epoch's model.metrics, also for the hooks' ctx.logs */
    metrics_to_hooks(&t->r, 0, st->correct, st->examples);
    double sps = t->train_sec > 0 ? (double)st->examples / t->train_sec : 0;
    double input_wait = t->train_sec > 0 ? t->input_sec / t->train_sec : 0;
    sink_epoch(t, &ev, sps, input_wait, ep_sec);
    if ((rc = at_hook(t, LOOM_HOOK_EPOCH_END, st->epoch + 1, sps, err))) return rc;
    t->epoch_open = false;
    t->learned_spe = st->step_in_epoch;
    st->epoch++;
    st->step_in_epoch = 0;
    st->loss_sum = 0;
    st->correct = st->examples = 0;
    metrics_clear(&t->r, 0);
    t->train_sec = 0;
    t->input_sec = 0;
    if ((rc = loom_iter_rewind(t->r.train, st->epoch, err)) || (rc = checkpoint_now(t, err))) return rc;
    t->epoch_start = t->last_ckpt_time;
    return LOOM_OK;
}

/* An execution's end: progress, summaries, a checkpoint when one is due,
 * the step_end hooks. */
static int at_boundary(trainer *t, loom_err *err)
{
    t->in_exec = 0;
    double sps = t->train_sec > 0 ? (double)t->st.examples / t->train_sec : 0;
    sink_progress(t, sps);
    bool ckpt_due = checkpoint_due(t);
    bool summary_due = t->sink.tb && t->st.step / t->rs->summary_steps != t->boundary_step / t->rs->summary_steps;
    t->boundary_step = t->st.step;
    int rc = LOOM_OK;
    if (summary_due && (rc = sink_summary(t, err))) return rc;
    if (ckpt_due && (rc = checkpoint_now(t, err))) return rc;
    if (t->r.hooks.hooks && t->r.hooks.n_metrics) { /* ctx.logs: the metrics of the epoch so far */
        take_metrics(&t->r, t->r.macc[0]);
        metrics_to_hooks(&t->r, 0, t->st.correct, t->st.examples);
    }
    return at_hook(t, LOOM_HOOK_STEP_END, t->st.epoch + 1, sps, err);
}

/* The step loop, from the train_begin hooks to the last step (or the first
 * error, or a stop). */
static int trainer_loop(trainer *t, loom_err *err)
{
    t->run_start = t->epoch_start = loom_now();
    t->start_step = t->last_saved = t->boundary_step = t->st.step;
    t->first_step_ms = -1;
    t->last_eval_loss = t->last_eval_acc = NAN;
    t->last_eval_step = -1;
    t->last_ckpt_time = loom_now();
    t->K = t->rs->steps_per_execution > 0 ? t->rs->steps_per_execution : 1;
    t->hsa = (hook_save_arg){&t->r, &t->st};
    t->r.hooks.save = hook_save;
    t->r.hooks.save_arg = &t->hsa;
    int rc = at_hook(t, LOOM_HOOK_TRAIN_BEGIN, t->st.epoch + 1, NAN, err);
    sink_state(t, LOOM_STATUS_TRAINING, 0, 0);
    while (!rc) {
        bool stop = false, epoch_ended = false;
        if ((rc = at_step_begin(t, &stop, err)) || stop) break;
        double t0 = loom_now(), t_input;
        loom_step_result res;
        if ((rc = take_step(t, t0, &res, &t_input, &epoch_ended, err))) break;
        if (epoch_ended) {
            rc = at_epoch_end(t, err);
            continue;
        }
        if ((rc = after_step(t, &res, t0, t_input, err))) break;
        if (++t->in_exec < t->K && !(t->rs->max_steps > 0 && t->st.step >= t->rs->max_steps) &&
            !(t->rs->checkpoint_steps > 0 && t->st.step % t->rs->checkpoint_steps == 0))
            continue; /* inside an execution */
        rc = at_boundary(t, err);
        /* strategy.elastic: a worker waiting to join enters here, after the
         * boundary's checkpoint (a collective it was not part of) */
        if (!rc) rc = loom_strategy_elastic_admit(t->r.strat, t->st.step, join_state_save, t, err);
    }
    loom_progress_break(&t->sink.prog);
    return rc;
}

/* After the loop: the last checkpoint and evaluation, the train_end hooks,
 * the end line, the status endpoint's last state. */
static int trainer_finish(trainer *t, int rc, loom_err *err)
{
    trainer_state *st = &t->st;
    if (!rc && st->step != t->last_saved) rc = checkpoint_now(t, err);
    if (!rc && t->r.eval && t->r.chief && !t->r.sidecar_eval && t->last_eval_step != st->step &&
        st->step > t->start_step) {
        loom_step_result ev; /* an evaluation without examples leaves the last one's figures */
        rc = train_evaluate_all_(&t->r, t->r.eval, &ev, err);
        if (!rc) t->last_ev = ev;
        if (!rc && ev.examples) {
            t->last_eval_loss = ev.loss_sum / (double)ev.examples;
            t->last_eval_acc = t->r.has_acc ? (double)ev.correct / (double)ev.examples : NAN;
            rc = sink_eval(t, &ev, err);
        }
    }
    if (!rc) rc = at_hook(t, LOOM_HOOK_TRAIN_END, st->epoch + (st->step_in_epoch > 0), NAN, err);
    if (!rc) sink_end(t);
    if (!rc && t->r.chief && t->last_ckpt[0])
        rc = write_final_marker(t->r.model_dir, st->step, t->last_ckpt, !trainer_reached(t), t->rs, err);
    sink_state(t, rc ? LOOM_STATUS_FAILED : LOOM_STATUS_DONE, 0, 0);
    return rc;
}

int loom_train(const loom_spec *spec, const loom_train_opts *opts, loom_err *err)
{
    trainer tr, *t = &tr;
    int rc = trainer_open(t, spec, opts, err);
    if (!rc && t->serves) /* the strategy's own loop: parameter servers, and workers that only feed them */
        return trainer_close(t, loom_strategy_serve(t->r.strat, t->r.train, err), err);
    if (!rc) rc = trainer_resume(t, err);
    if (!rc) {
        char where[96], abs_dir[PATH_MAX] = "";
        if (!realpath(t->r.model_dir, abs_dir)) abs_dir[0] = 0; /* messages show where it really is */
        int th = loom_model_threads(t->model);
        loom_info("training %lld parameters on %s, %d thread%s; BLAS %s (%s), %d thread%s each; model_dir %s",
                  (long long)loom_model_num_params(t->model), loom_strategy_where(t->r.strat, where, sizeof where), th,
                  th == 1 ? "" : "s", loom_blas_core(), loom_blas_core_reason(), loom_blas_threads(),
                  loom_blas_threads() == 1 ? "" : "s", abs_dir[0] ? abs_dir : t->r.model_dir);
        final_marker_clear(t);
        rc = sink_open(t, err);
    }
    if (!rc) {
        signals_catch(t);
        rc = trainer_loop(t, err);
        signals_restore(t);
        rc = trainer_finish(t, rc, err);
    }
    return trainer_close(t, rc, err);
}

/* Loads the checkpoint to evaluate or predict with: the given file, or the latest. */
int train_load_for_inference_(run *r, const char *checkpoint, char path[LOOM_PATH_MAX], int64_t *step, loom_err *err)
{
    int rc;
    *step = -1;
    if (checkpoint) {
        snprintf(path, LOOM_PATH_MAX, "%s", checkpoint);
    } else {
        rc = loom_ckpt_latest(r->model_dir, path, step, err);
        if (rc == LOOM_EEOF)
            return loom_err_set(err, LOOM_EIO, r->model_dir, "no checkpoint in the model directory"),
                   loom_err_hint(err, "train first: loom train %s", r->spec->path);
        if (rc) return rc;
    }
    loom_buf ts;
    rc = loom_ckpt_load(path, loom_strategy_model(r->strat), NULL, &ts, NULL, err);
    if (rc) return rc;
    trainer_state st;
    rc = state_restore(&st, &ts, path, err);
    loom_buf_fini(&ts);
    if (rc) return rc;
    *step = st.step;
    return loom_strategy_sync(r->strat, err);
}
