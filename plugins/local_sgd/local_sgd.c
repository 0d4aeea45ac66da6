/* local_sgd.c - a plugin providing the strategy "local_sgd": periodic model
 * averaging (local SGD, as Darknet and Caffe users know it from
 * multi-GPU training with averaged weights).
 *
 * strategy.replicas replicas start from the same initial variables; each
 * step every replica takes its share of the global batch (contiguous rows,
 * ceil(B / N) each, as tf.distribute splits) and applies its own optimizer
 * to the gradient of the MEAN loss over its share, with no communication.
 * Every `average_every` steps the parameters and the optimizer slots
 * (momentum, Adam moments) are averaged with strategy.cross_device_ops
 * (all-reduce MEAN; "auto" takes reduce_to_one_device), so all replicas
 * are identical again.
 * With average_every = 1 and plain SGD this is synchronous data parallelism
 * (the average of the replicas' updates is the update of the mean gradient).
 *
 * Options: strategy.options = { average_every = 4; } (default 4, >= 1).
 * Evaluation, prediction and checkpoints use replica 0; after a restore
 * every replica takes replica 0's variables and slots. A checkpoint written
 * right after an averaging (its step a multiple of average_every) thus holds
 * the whole state and a resumed run continues bit-exactly; one written in
 * between continues from replica 0 alone.
 * Threads: replicas run in parallel on a pool of min(N, run.threads)
 * threads, each single-threaded; results do not depend on the pool size. */
#include "loom_plugin.h"

#include <string.h>

static const loom_host *host;

typedef struct replica {
    loom_model *model;
    loom_optimizer *opt;
    loom_step_result res;
    int rc;
    loom_err err;
} replica;

typedef struct local_sgd {
    int n;
    replica *rep;   /* (n,) */
    float **params; /* (n,) each replica's flat parameters */
    float **slots;  /* (n,) each replica's optimizer slots, num_slots * P floats */
    int num_slots;
    loom_pool *pool;
    int64_t average_every;
    uint64_t seed;
    /* the step being run, for the pool's tasks */
    const loom_strategy_args *args;
    const loom_elem *batch;
    int64_t step, rows;
} local_sgd;

static void ls_close(loom_strategy *s)
{
    local_sgd *ls = s->impl;
    if (!ls) return;
    for (int r = 0; ls->rep && r < ls->n; r++) {
        host->model_free(ls->rep[r].model);
        host->optimizer_free(ls->rep[r].opt);
    }
    host->pool_free(ls->pool);
    host->free(ls->rep);
    host->free(ls->params);
    host->free(ls->slots);
    host->free(ls);
    s->impl = NULL;
}

static int ls_open(loom_strategy *s, const loom_strategy_args *a, loom_err *err)
{
    local_sgd *ls = host->calloc(1, sizeof *ls);
    if (!ls) return host->err_set(err, LOOM_ENOMEM, NULL, "allocating the local_sgd strategy");
    s->impl = ls;
    ls->n = host->replicas(a);
    ls->seed = host->seed(a);
    int rc = host->option_int(a, "average_every", 4, 1, 1000000000, &ls->average_every, err);
    if (rc) return rc;
    ls->rep = host->calloc((size_t)ls->n, sizeof *ls->rep);
    ls->params = host->calloc((size_t)ls->n, sizeof *ls->params);
    ls->slots = host->calloc((size_t)ls->n, sizeof *ls->slots);
    if (!ls->rep || !ls->params || !ls->slots)
        return host->err_set(err, LOOM_ENOMEM, NULL, "allocating %d replicas", ls->n);
    for (int r = 0; r < ls->n; r++) {
        replica *p = &ls->rep[r];
        if ((rc = host->model_new(&p->model, a, err))) return rc;
        int64_t P = host->model_num_params(p->model);
        if ((rc = host->optimizer_new(&p->opt, a, P, err))) return rc;
        ls->params[r] = host->model_params(p->model);
        ls->slots[r] = host->optimizer_slots(p->opt, &ls->num_slots);
    }
    if (!s->xops) /* "auto": averaging is rare, so the simplest op does */
        s->xops = host->find_cross_device_ops("reduce_to_one_device");
    int threads = host->threads(a);
    if ((rc = host->pool_new(&ls->pool, threads < ls->n ? threads : ls->n, err))) return rc;
    if (host->pool_size(ls->pool) > 1) host->blas_set_threads(1); /* the replicas are the parallelism */
    host->log(LOOM_LOG_INFO, "local_sgd: %d replicas averaged every %lld steps with %s, %d threads", ls->n,
              (long long)ls->average_every, s->xops->name, host->pool_size(ls->pool));
    return LOOM_EOK;
}

/* Replica r's rows of the current batch. */
static void share(const local_sgd *ls, int r, int64_t *lo, int64_t *hi)
{
    int64_t c = (ls->rows + ls->n - 1) / ls->n;
    *lo = r * c < ls->rows ? r * c : ls->rows;
    *hi = *lo + c < ls->rows ? *lo + c : ls->rows;
}

static void train_replica(void *arg, int r)
{
    local_sgd *ls = arg;
    replica *p = &ls->rep[r];
    int64_t lo, hi;
    share(ls, r, &lo, &hi);
    memset(&p->res, 0, sizeof p->res);
    if (lo == hi) { /* a short batch left this replica nothing: no update */
        p->rc = LOOM_EOK;
        return;
    }
    uint64_t key = host->rng_mix(host->rng_mix(ls->seed, (uint64_t)ls->step), (uint64_t)r);
    p->rc = host->model_train_step(p->model, ls->args, ls->batch, lo, hi, hi - lo, key, &p->res, &p->err);
    if (!p->rc) host->optimizer_apply(p->opt, ls->params[r], host->model_grads(p->model), ls->step);
}

static int ls_train_step(loom_strategy *s, const loom_elem *batch, int64_t step, loom_step_result *out, loom_err *err)
{
    local_sgd *ls = s->impl;
    ls->args = s->args;
    ls->batch = batch;
    ls->step = step;
    ls->rows = host->batch_size(s->args, batch);
    host->pool_run(ls->pool, ls->n, train_replica, ls);
    memset(out, 0, sizeof *out);
    for (int r = 0; r < ls->n; r++) { /* in replica order: the sums do not depend on scheduling */
        replica *p = &ls->rep[r];
        if (p->rc) {
            *err = p->err;
            return p->rc;
        }
        out->loss_sum += p->res.loss_sum;
        out->correct += p->res.correct;
        out->examples += p->res.examples;
    }
    if ((step + 1) % ls->average_every) return LOOM_EOK;
    int64_t P = host->model_num_params(ls->rep[0].model);
    int rc = s->xops->all_reduce(ls->params, ls->n, P, LOOM_REDUCE_MEAN, err);
    if (!rc && ls->num_slots) rc = s->xops->all_reduce(ls->slots, ls->n, ls->num_slots * P, LOOM_REDUCE_MEAN, err);
    return rc;
}

static int ls_eval_step(loom_strategy *s, const loom_elem *batch, loom_step_result *out, loom_err *err)
{
    local_sgd *ls = s->impl;
    memset(out, 0, sizeof *out);
    return host->model_evaluate(ls->rep[0].model, s->args, batch, 0, host->batch_size(s->args, batch), out, err);
}

static int ls_predict(loom_strategy *s, const loom_elem *batch, float *out, loom_err *err)
{
    local_sgd *ls = s->impl;
    return host->model_predict(ls->rep[0].model, s->args, batch, 0, host->batch_size(s->args, batch), out, err);
}

static loom_model *ls_model(loom_strategy *s) { return ((local_sgd *)s->impl)->rep[0].model; }
static loom_optimizer *ls_optimizer(loom_strategy *s) { return ((local_sgd *)s->impl)->rep[0].opt; }
static int ls_num_replicas(loom_strategy *s) { return ((local_sgd *)s->impl)->n; }

/* Every replica takes replica 0's variables and optimizer slots. */
static int ls_sync(loom_strategy *s, loom_err *err)
{
    local_sgd *ls = s->impl;
    int64_t P = host->model_num_params(ls->rep[0].model);
    int rc = s->xops->broadcast(ls->params, ls->n, P, 0, err);
    if (!rc && ls->num_slots) rc = s->xops->broadcast(ls->slots, ls->n, ls->num_slots * P, 0, err);
    return rc;
}

/* Its replicas are threads of this process: a cluster of several tasks would
 * train several unrelated jobs, so `loom check`, train and launch refuse one. */
static const loom_cluster_roles local_sgd_roles = {.flags = LOOM_ROLES_ONE_PROCESS};

static const loom_strategy_ops local_sgd_ops = {
    .version = LOOM_STRATEGY_OPS_VERSION,
    .name = "local_sgd",
    .open = ls_open,
    .close = ls_close,
    .train_step = ls_train_step,
    .eval_step = ls_eval_step,
    .predict = ls_predict,
    .model = ls_model,
    .optimizer = ls_optimizer,
    .sync = ls_sync,
    .num_replicas = ls_num_replicas,
    .roles = &local_sgd_roles,
};

static const char *const options[] = {"average_every", NULL};

static int init(const loom_host *h, loom_err *err)
{
    host = h;
    return h->register_strategy(&local_sgd_ops, options, err);
}

static const loom_plugin plugin = {
    .abi = LOOM_PLUGIN_ABI_VERSION,
    .size = sizeof(loom_plugin),
    .name = "local_sgd",
    .version = "1.0",
    .description = "strategy: local SGD, replicas train independently and average their parameters periodically",
    .init = init,
};

const loom_plugin *loom_plugin_entry(void) { return &plugin; }
