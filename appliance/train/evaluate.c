/* evaluate.c - loom evaluate (a checkpoint on data.eval) and the sidecar
 * evaluator (loom evaluate --watch, a cluster's evaluator task): each new
 * checkpoint of a model directory evaluated until training ends. Threads:
 * the caller's; the watch's signal handlers only set a flag. */
#include "run_internal.h"
#include "dir_lock_internal.h"

#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int loom_evaluate(const loom_spec *spec, const char *model_dir, const char *checkpoint, loom_eval_result *out,
                  loom_err *err)
{
    run r;
    memset(out, 0, sizeof *out);
    int rc = train_run_open_(&r, spec, model_dir, true, NULL, false, err);
    if (!rc) rc = train_metrics_open_(&r, err);
    if (!rc) rc = train_load_for_inference_(&r, checkpoint, out->checkpoint, &out->step, err);
    loom_step_result ev;
    if (!rc) rc = train_evaluate_all_(&r, r.eval, &ev, err);
    if (!rc) {
        out->examples = ev.examples;
        out->loss = ev.examples ? ev.loss_sum / (double)ev.examples : NAN;
        out->accuracy = ev.examples && r.has_acc ? (double)ev.correct / (double)ev.examples : NAN;
        loom_model *m = loom_strategy_model(r.strat);
        out->n_metrics = loom_model_num_metrics(m);
        for (int i = 0; i < out->n_metrics; i++) {
            snprintf(out->metric_name[i], sizeof out->metric_name[i], "%s", loom_metric_name(loom_model_metric(m, i)));
            out->metric[i] = ev.examples ? loom_model_metric_value(m, i, r.macc[1], ev.correct, ev.examples) : NAN;
        }
        for (int h = 0; h < loom_model_num_heads(m) && loom_model_num_heads(m) > 1; h++)
            for (int q = 0; q < 2; q++) {
                if (q && !loom_model_head_accuracy(m, h)) continue;
                int i = out->n_metrics++;
                snprintf(out->metric_name[i], sizeof out->metric_name[i], "%s_%s", loom_model_head_name(m, h),
                         q ? "accuracy" : "loss");
                out->metric[i] = loom_model_head_value(m, h, q, r.macc[1], ev.examples);
            }
    }
    train_run_close_(&r);
    return rc;
}

/* ---- the sidecar evaluator ---------------------------------------------------- */

/* The final step named by <dir>/final.json, or -1 while training goes on
 * (or when the marker was written before after_wall: an earlier run's). */
static int64_t final_step(const char *dir, double after_wall)
{
    char path[LOOM_PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/" LOOM_FINAL_MARKER, dir);
    uint8_t *d = NULL;
    size_t len;
    loom_err e;
    if (access(path, F_OK) || loom_read_file_max(path, &d, &len, 1 << 16, &e)) return -1;
    const char *k = strstr((const char *)d, "\"step\":");
    long long v = k ? strtoll(k + 7, NULL, 10) : -1;
    const char *w = strstr((const char *)d, "\"wall_time\":");
    double at = w ? strtod(w + 12, NULL) : 0;
    loom_free(d);
    if (after_wall > 0 && at < after_wall) return -1;
    return k && v >= 0 ? (int64_t)v : -1;
}

/* The evaluations an earlier watcher of this model_dir wrote (its "eval"
 * lines in metrics.jsonl): (step, wall_time) pairs, *n of them. */
typedef struct watched {
    int64_t step;
    double  at;
} watched;

static watched *read_watched(const char *metrics_path, int *n)
{
    *n = 0;
    loom_err e = {0};
    FILE *f = loom_fopen_regular(metrics_path, &e); /* a FIFO would block: the append below then says why */
    if (!f) return NULL;
    char line[4096];
    watched *w = NULL;
    int cap = 0;
    static const char key[] = "{\"event\": \"eval\", \"step\": ";
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, key, sizeof key - 1)) continue;
        const char *t = strstr(line, "\"wall_time\": ");
        if (!t) continue;
        if (*n == cap) {
            cap = cap ? 2 * cap : 16;
            watched *nw = loom_realloc(w, (size_t)cap * sizeof *w);
            if (!nw) break;
            w = nw;
        }
        w[*n].step = strtoll(line + sizeof key - 1, NULL, 10);
        w[(*n)++].at = strtod(t + 13, NULL);
    }
    fclose(f);
    return w;
}

/* Whether checkpoint `path` (of `step`) was evaluated by an earlier watcher:
 * an eval line of its step written after the file (a --fresh run writes a
 * new ckpt-<step>.loom, which is evaluated again). */
static bool watched_before(const watched *w, int n, const char *path, int64_t step)
{
    struct stat sb;
    if (stat(path, &sb)) return false;
    double mtime = (double)sb.st_mtim.tv_sec + sb.st_mtim.tv_nsec * 1e-9;
    for (int i = 0; i < n; i++)
        if (w[i].step == step && w[i].at >= mtime) return true;
    return false;
}

static volatile sig_atomic_t watch_signal;
static void on_watch_signal(int sig) { watch_signal = sig; }

/* One evaluation of checkpoint `path` (its step) by the watcher `who`: the
 * log, a JSON line on stdout, an "eval" line appended to metrics.jsonl and
 * the scalars in the event file of eval_dir (the watcher's own, locked:
 * *tb, opened on first use). */
static int watch_report(run *r, const char *who, const char *eval_dir, const char *path, int64_t step,
                        const loom_step_result *ev, loom_summary **tb, loom_err *err)
{
    char metrics_path[LOOM_PATH_MAX + 16];
    snprintf(metrics_path, sizeof metrics_path, "%s/metrics.jsonl", r->model_dir);
    double loss = ev->examples ? ev->loss_sum / (double)ev->examples : NAN,
           acc = ev->examples ? (double)ev->correct / (double)ev->examples : NAN;
    loom_info("%s: %s (step %lld): eval loss %.4f, accuracy %.4f on %lld examples", who, path, (long long)step,
              loss, acc, (long long)ev->examples);
    printf("{\"checkpoint\": \"%s\", \"step\": %lld, \"examples\": %lld, \"eval_loss\": %.6g, \"eval_accuracy\": "
           "%.6g}\n", path, (long long)step, (long long)ev->examples, loss, acc);
    fflush(stdout);
    FILE *m = loom_fopen_append_regular(metrics_path, err);
    if (!m) return err->code;
    /* one line, one write (O_APPEND): the chief appends to the same file */
    char line[LOOM_PATH_MAX + 512];
    FILE *lf = fmemopen(line, sizeof line, "w");
    fprintf(lf, "{\"event\": \"eval\", \"step\": %lld, \"evaluator\": \"%s\"", (long long)step, who);
    train_json_num_(lf, "eval_loss", loss, 0);
    train_json_num_(lf, "eval_accuracy", acc, 0);
    fprintf(lf, ", \"examples\": %lld", (long long)ev->examples);
    train_json_time_(lf, "wall_time", loom_wall_time());
    fprintf(lf, "}\n");
    long ll = ftell(lf);
    fclose(lf);
    setvbuf(m, NULL, _IONBF, 0);
    int rc = LOOM_OK;
    if (ll <= 0 || fwrite(line, 1, (size_t)ll, m) != (size_t)ll)
        rc = loom_err_set(err, LOOM_EIO, metrics_path, "cannot append the eval line: %s", strerror(errno));
    fclose(m);
    if (!rc && !*tb && r->spec->run.summary_steps > 0) rc = loom_summary_open(tb, eval_dir, -1, err);
    if (!rc) rc = train_log_eval_(r, *tb, step, loss, ev, err);
    return rc;
}

static void adapted_free(loom_spec *cp);
static int watch_adapt(run *r, const char *path, loom_spec **own, bool *said, loom_err *err);

static int watch_loop(run *r, const loom_watch_opts *o, const char *who, const char *eval_dir, int *evaluated,
                      loom_err *err)
{
    char metrics_path[LOOM_PATH_MAX + 16], path[LOOM_PATH_MAX];
    snprintf(metrics_path, sizeof metrics_path, "%s/metrics.jsonl", r->model_dir);
    double poll = o && o->poll_secs > 0 ? o->poll_secs : 0.2, idle = o ? o->idle_secs : 0;
    int n_before = 0;
    watched *before = read_watched(metrics_path, &n_before);
    int64_t last = -1;
    loom_summary *tb = NULL;
    int rc = LOOM_OK;
    double idle_since = loom_now();
    bool waiting_said = false, said = false;
    loom_spec *own = NULL; /* data.eval's adapted numbers when a checkpoint brought others (watch_adapt) */
    while (!rc) {
        if (watch_signal) {
            rc = loom_err_set(err, LOOM_EIO, NULL, "%s: stopped by signal %d after %d evaluation%s", who,
                              (int)watch_signal, *evaluated, *evaluated == 1 ? "" : "s");
            loom_stop_signal_note(watch_signal); /* exit 128 + signal */
            break;
        }
        int64_t fin = final_step(r->model_dir, o ? o->after_wall : 0), step, top;
        int newer = 0;
        loom_err lerr;
        if (last >= 0 && loom_ckpt_newest_after(r->model_dir, -1, path, &top, &newer, &lerr) == LOOM_OK && top < last) {
            loom_info("%s: the checkpoints start over (newest step %lld, after step %lld: a --fresh run): watching "
                      "them anew", who, (long long)top, (long long)last);
            last = -1;
        }
        rc = loom_ckpt_newest_after(r->model_dir, last, path, &step, &newer, err);
        if (rc == LOOM_EEOF) {
            rc = LOOM_OK;
            if (fin >= 0 && fin <= last) {
                loom_info("%s: training ended at step %lld, evaluated: done (%d evaluation%s here)", who,
                          (long long)fin, *evaluated, *evaluated == 1 ? "" : "s");
                break;
            }
            if (fin > last) {
                rc = loom_err_set(err, LOOM_EIO, r->model_dir, "%s: training ended at step %lld, but its checkpoint "
                                  "is not in the model directory (newest evaluated: step %lld)", who, (long long)fin,
                                  (long long)last);
                loom_err_hint(err, "was it deleted? evaluate what is there with loom evaluate --checkpoint FILE");
                break;
            }
            if (!waiting_said) loom_info("%s: waiting for checkpoints in %s", who, r->model_dir);
            waiting_said = true;
            if (idle > 0 && loom_now() - idle_since > idle) {
                rc = loom_err_set(err, LOOM_ETIMEOUT, r->model_dir, "%s: no new checkpoint for %g s and training has "
                                  "not ended (no %s)", who, idle, LOOM_FINAL_MARKER);
                break;
            }
            usleep((useconds_t)(poll * 1e6));
            continue;
        }
        if (rc) break;
        if (watched_before(before, n_before, path, step)) {
            loom_info("%s: %s (step %lld) was evaluated before (metrics.jsonl)%s", who, path, (long long)step,
                      newer > 1 ? "; so were, or are skipped, the older ones" : "");
            last = step;
            continue;
        }
        if (newer > 1)
            loom_info("%s: %d new checkpoints: evaluating the newest (step %lld), skipping %d older", who, newer,
                      (long long)step, newer - 1);
        int64_t loaded = -1;
        loom_step_result ev;
        char used[LOOM_PATH_MAX];
        rc = train_load_for_inference_(r, path, used, &loaded, err);
        if (rc && access(path, F_OK)) { /* pruned (keep_checkpoints) between the listing and the load: look again */
            loom_warn("%s: %s went away before it was read; looking again", who, path);
            rc = LOOM_OK;
            continue;
        }
        if (!rc) rc = watch_adapt(r, path, &own, &said, err);
        if (!rc) rc = train_evaluate_all_(r, r->eval, &ev, err);
        if (rc) break;
        last = step;
        idle_since = loom_now();
        waiting_said = false;
        (*evaluated)++;
        rc = watch_report(r, who, eval_dir, path, step, &ev, &tb, err);
    }
    loom_free(before);
    adapted_free(own);
    loom_err cerr;
    if (loom_summary_close(tb, &cerr) && !rc) *err = cerr, rc = cerr.code;
    return rc;
}

/* A spec copy whose adapt maps hold other numbers than the config's spec
 * (shares everything else with it): freed with adapted_free. */
static void adapted_free(loom_spec *cp)
{
    for (int d = 0; cp && d < 2; d++) {
        loom_dataset_spec *ds = d ? &cp->eval : &cp->train;
        for (int i = 0; i < ds->n_transforms; i++) /* (map is a union member: only a map's is one) */
            if (ds->transform[i].kind == LOOM_T_MAP && ds->transform[i].map.vocab_owned)
                loom_free(ds->transform[i].map.vocab);
    }
    loom_free(cp);
}

/* The sidecar evaluator evaluates each checkpoint with the numbers adapted
 * at its start (its "adapt" record): when they are not those data.eval runs
 * with (a --fresh run adapted anew), data.eval is opened again with them;
 * *own keeps the spec copy they live in. */
static int watch_adapt(run *r, const char *path, loom_spec **own, bool *said, loom_err *err)
{
    loom_buf ck, cur;
    loom_buf_init(&cur);
    int rc = loom_ckpt_read_blob(path, "adapt", &ck, err);
    if (rc == LOOM_EEOF) return LOOM_OK; /* an older checkpoint: the numbers of adapt.txt */
    if (rc) return rc;
    loom_data_adapt_text(*own ? *own : r->spec, &cur);
    loom_spec *cp = NULL;
    if (cur.len != ck.len || memcmp(cur.data, ck.data, ck.len)) {
        if (!(cp = loom_alloc(sizeof *cp))) rc = loom_err_set(err, LOOM_ENOMEM, path, "cannot copy the config");
        if (cp) {
            *cp = *r->spec;
            for (int d = 0; d < 2; d++) {
                loom_dataset_spec *ds = d ? &cp->eval : &cp->train;
                for (int i = 0; i < ds->n_transforms; i++)
                    if (ds->transform[i].kind == LOOM_T_MAP) ds->transform[i].map.vocab_owned = false;
            }
            loom_adapt_source src = {.name = path, .text = ck.data, .len = ck.len, .said = said};
            loom_data_ctx none = {0};
            rc = loom_data_adapt_from(cp, r->model_dir, LOOM_ADAPT_LOAD, &none, &src, err);
        }
        loom_lua_opts lua = {.model_dir = r->model_dir, .unsafe = r->spec->hooks.unsafe,
                             .memory_limit = r->spec->hooks.memory_limit,
                             .instruction_limit = r->spec->hooks.instruction_limit};
        loom_data_ctx ectx = {.seed = r->spec->run.seed, .name = "eval", .custom_options = &lua,
                              .threads = r->spec->run.threads > 0 ? r->spec->run.threads : loom_num_cores()};
        loom_iter *it = NULL;
        if (!rc) rc = loom_data_open(&it, &cp->eval, &ectx, err);
        if (!rc) {
            loom_info("%s was adapted anew: data.eval now runs with its numbers", path);
            loom_iter_close(r->eval);
            r->eval = it;
            adapted_free(*own);
            *own = cp;
            cp = NULL;
        }
    }
    adapted_free(cp);
    loom_buf_fini(&ck);
    loom_buf_fini(&cur);
    return rc;
}

int loom_evaluate_watch(const loom_spec *spec, const char *model_dir, const loom_watch_opts *o, int *evaluated,
                        loom_err *err)
{
    run r;
    *evaluated = 0;
    int rc = train_run_open_(&r, spec, model_dir, true, NULL, false, err);
    if (!rc) rc = train_metrics_open_(&r, err);
    if (rc) {
        train_run_close_(&r);
        return rc;
    }
    const char *who = o && o->who ? o->who : "evaluate --watch";
    struct sigaction sa = {0}, old_int, old_term;
    sa.sa_handler = on_watch_signal;
    sigemptyset(&sa.sa_mask);
    watch_signal = 0;
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
    /* One writer per event directory, so that TensorBoard draws one curve
     * per run: a cluster's evaluator task writes eval/ (its chief does not
     * evaluate), `loom evaluate --watch` its own eval_watch/ (beside a run
     * that evaluates itself into eval/), as TF's evaluate(name="watch")
     * writes eval_watch/; a second watcher of either is refused. */
    char eval_dir[LOOM_PATH_MAX + 16];
    snprintf(eval_dir, sizeof eval_dir, "%s/%s", r.model_dir, o && o->who ? "eval" : "eval_watch");
    int lock_fd = -1;
    if (spec->run.summary_steps > 0) {
        rc = loom_mkdirs(eval_dir, err);
        if (!rc) rc = loom_events_lock_(eval_dir, who, &lock_fd, err);
    }
    if (!rc) {
        loom_info("%s: evaluating each new checkpoint of %s until training ends (%s)%s%s", who, r.model_dir,
                  LOOM_FINAL_MARKER, lock_fd >= 0 ? "; TensorBoard: " : "", lock_fd >= 0 ? eval_dir : "");
        rc = watch_loop(&r, o, who, eval_dir, evaluated, err);
    }
    loom_dir_unlock_(lock_fd);
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);
    train_run_close_(&r);
    return rc;
}
