/* train_hooks.c - the host of the Lua hooks: what each ctx method does to the
 * run (see train_hooks_internal.h). */
#include "train_hooks_internal.h"
#include "summary_internal.h"

#include <math.h>
#include <string.h>

_Static_assert((int)LOOM_HOOK_FORWARD == (int)LOOM_PART_FORWARD && (int)LOOM_HOOK_LOSS == (int)LOOM_PART_LOSS &&
                   (int)LOOM_HOOK_BACKWARD == (int)LOOM_PART_BACKWARD &&
                   (int)LOOM_HOOK_ALL_REDUCE == (int)LOOM_PART_ALL_REDUCE && (int)LOOM_HOOK_APPLY == (int)LOOM_PART_APPLY,
               "hooks.h and distribute.h list the parts of a step in the same order");

static void h_stop(void *self) { ((train_hooks_ *)self)->stop = true; }

static void h_set_learning_rate(void *self, double lr)
{
    loom_optimizer_set_lr(loom_strategy_optimizer(((train_hooks_ *)self)->strat), lr);
}

static int h_save_checkpoint(void *self, char path[LOOM_PATH_MAX], loom_err *err)
{
    train_hooks_ *t = self;
    if (!t->save) return loom_err_set(err, LOOM_EUSAGE, NULL, "no checkpoints are written here (loom check)");
    return t->save(t->save_arg, path, err);
}

static int h_log_scalar(void *self, const char *name, double value, loom_err *err)
{
    train_hooks_ *t = self;
    if (!t->metrics) return loom_err_set(err, LOOM_EUSAGE, NULL, "no metrics are written here (loom check)");
    fprintf(t->metrics, "{\"event\": \"scalar\", \"step\": %lld, \"epoch\": %lld, \"name\": \"%s\", \"value\": ",
            (long long)t->step, (long long)t->epoch, name);
    if (isfinite(value)) fprintf(t->metrics, "%.9g", value);
    else fputs("null", t->metrics);
    fprintf(t->metrics, ", \"wall_time\": %.3f}\n", loom_wall_time());
    fflush(t->metrics);
    return t->summary ? loom_summary_scalar(t->summary, name, t->step, value, err) : LOOM_OK;
}

static const char *h_param_name(void *self, int i)
{
    const loom_param_info *p = loom_model_param_tensor(loom_strategy_model(((train_hooks_ *)self)->strat), i);
    return p ? p->name : NULL;
}

static int h_param(void *self, const char *name, loom_tensor *view, loom_err *err)
{
    train_hooks_ *t = self;
    loom_model *m = loom_strategy_model(t->strat);
    char names[400] = "";
    size_t len = 0;
    for (int i = 0; i < loom_model_num_param_tensors(m); i++) {
        const loom_param_info *p = loom_model_param_tensor(m, i);
        if (!strcmp(p->name, name)) {
            memset(view, 0, sizeof *view);
            view->dtype = LOOM_F32;
            view->shape = p->shape;
            view->data = loom_model_params(m) + p->offset;
            return LOOM_OK;
        }
        int w = snprintf(names + len, sizeof names - len, "%s%s", i ? ", " : "", p->name);
        if (w > 0 && len + (size_t)w < sizeof names) len += (size_t)w;
    }
    return loom_err_set(err, LOOM_EUSAGE, NULL, "the model has no parameter \"%s\" (it has: %s)", name, names);
}

static int h_step_part(void *self, loom_hook_part part, double *per_replica, loom_err *err)
{
    train_hooks_ *t = self;
    loom_step_result r[LOOM_HOOK_MAX_REPLICAS];
    memset(r, 0, sizeof r);
    int n = loom_strategy_num_replicas(t->strat);
    int rc = loom_strategy_step_part(t->strat, (loom_step_part)part, t->batch, t->step, r, err);
    if (part == LOOM_HOOK_BACKWARD || part == LOOM_HOOK_ALL_REDUCE) t->reduced = part == LOOM_HOOK_ALL_REDUCE && !rc;
    if (!rc && part == LOOM_HOOK_ALL_REDUCE && r[0].examples > 0) { /* the job's result, agreed across processes */
        t->result = r[0];
        return LOOM_OK;
    }
    if (rc || part != LOOM_HOOK_LOSS) return rc;
    memset(&t->result, 0, sizeof t->result);
    for (int i = 0; i < n; i++) {
        per_replica[i] = r[i].loss_sum;
        t->result.loss_sum += r[i].loss_sum;
        t->result.correct += r[i].correct;
        t->result.examples += r[i].examples;
    }
    return LOOM_OK;
}

static double grad_norm(loom_model *m)
{
    const float *g = loom_model_grads(m);
    double ss = 0;
    for (int64_t i = 0, n = loom_model_num_params(m); i < n; i++) ss += (double)g[i] * g[i];
    return sqrt(ss);
}

/* Scales gradients to a norm of at most max_norm (tf.clip_by_global_norm
 * over the whole buffer: g * max_norm / norm). Before the all-reduce each
 * replica's own gradient; after it the reduced one, whose norm replica 0's
 * buffer gives (central_storage reduces into replica 0 alone), and every
 * replica scales by the same factor. */
static int h_clip_gradients(void *self, double max_norm, double *per_replica, loom_err *err)
{
    (void)err;
    train_hooks_ *t = self;
    int n = loom_strategy_num_replicas(t->strat);
    double reduced_norm = t->reduced ? grad_norm(loom_strategy_replica(t->strat, 0)) : 0;
    for (int r = 0; r < n; r++) {
        loom_model *m = loom_strategy_replica(t->strat, r);
        double norm = t->reduced ? reduced_norm : grad_norm(m);
        per_replica[r] = norm;
        if (norm > max_norm) {
            float scale = (float)(max_norm / norm), *g = loom_model_grads(m);
            for (int64_t i = 0, np = loom_model_num_params(m); i < np; i++) g[i] *= scale;
        }
    }
    return LOOM_OK;
}

int train_hooks_open_(train_hooks_ *t, const loom_spec *spec, const char *model_dir, loom_strategy *s, loom_err *err)
{
    memset(t, 0, sizeof *t);
    t->strat = s;
    if (!spec->hooks.present) return LOOM_OK;
    bool parts = loom_strategy_has_parts(s);
    loom_hook_host host = {
        .self = t,
        .num_replicas = loom_strategy_num_replicas(s),
        .stop = h_stop,
        .set_learning_rate = h_set_learning_rate,
        .save_checkpoint = h_save_checkpoint,
        .log_scalar = h_log_scalar,
        .param = h_param,
        .param_name = h_param_name,
        .step_part = parts ? h_step_part : NULL,
        .clip_gradients = parts ? h_clip_gradients : NULL,
    };
    return loom_hooks_open(&t->hooks, spec, model_dir, &host, err);
}

void train_hooks_close_(train_hooks_ *t)
{
    loom_hooks_close(t->hooks);
    t->hooks = NULL;
}

int train_hooks_call_(train_hooks_ *t, loom_hook_kind kind, const loom_hook_logs *logs, loom_err *err)
{
    if (!t->hooks) return LOOM_OK;
    t->step = logs->step;
    t->epoch = logs->epoch;
    loom_hook_logs g = *logs;
    if (!t->has_acc) g.accuracy = g.eval_accuracy = NAN;
    g.n_metrics = t->n_metrics;
    for (int i = 0; i < t->n_metrics; i++) {
        g.metric_name[i] = t->metric_name[i];
        g.metric[i] = t->metric[i];
        g.eval_metric[i] = t->eval_metric[i];
    }
    return loom_hooks_call(t->hooks, kind, &g, err);
}

int train_hooks_step_(train_hooks_ *t, const loom_elem_spec *es, const loom_elem *batch, const loom_hook_logs *logs,
                      loom_step_result *out, bool *applied, loom_err *err)
{
    t->step = logs->step;
    t->epoch = logs->epoch;
    t->batch = batch;
    memset(&t->result, 0, sizeof t->result);
    int rc = loom_hooks_train_step(t->hooks, es, batch, logs, applied, err);
    t->batch = NULL;
    *out = t->result;
    return rc;
}
