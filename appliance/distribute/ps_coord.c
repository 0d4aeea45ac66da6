/* ps_coord.c - parameter_server's chief, the coordinator: sends the ps tasks
 * their variables (INIT), schedules step functions into the queue free workers
 * take from, follows the workers (results, losses and returns), brings the
 * variables to rest and back for evaluation and checkpoints, and hands the
 * trainer one applied update per train_step (parameter_server.c). */
#include "ps_internal.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- the chief (coordinator) -------------------------------------------------- */

/* Where the trainer next needs the variables at rest, after `step`. */
static int64_t horizon(const ps_strategy *ps, const loom_strategy_args *a, int64_t step)
{
    const loom_run_spec *rs = &a->spec->run;
    int64_t h = INT64_MAX;
    if (rs->max_steps > 0) h = rs->max_steps;
    if (rs->checkpoint_steps > 0) {
        int64_t c = (step / rs->checkpoint_steps + 1) * rs->checkpoint_steps;
        if (c < h) h = c;
    }
    if (a->steps_per_epoch > 0) {
        int64_t e = (step / a->steps_per_epoch + 1) * a->steps_per_epoch;
        if (e < h) h = e;
    }
    (void)ps;
    return h;
}

int loom_ps_init_tasks_(ps_strategy *ps, int64_t step, loom_err *err)
{
    loom_buf b;
    loom_buf_init(&b);
    int rc = LOOM_OK;
    uint64_t req = ++ps->req;
    const float *slots = ps->n_slots ? loom_optimizer_slots(ps->opt) : NULL;
    for (int q = 0; q < ps->n_ps && !rc; q++) {
        b.len = 0;
        loom_ps_hdr h = {.req = req, .nonce = ps->nonce, .step = step, .flags = slots ? LOOM_PS_F_SLOTS : 0};
        if (loom_ps_put_shards_(&b, ps, q, &h, loom_model_params(ps->model), slots))
            rc = loom_err_set(err, LOOM_ENOMEM, NULL, "building the variables of ps:%d", q);
        else
            rc = loom_net_send(ps->net, ps->peer_ps[q], LOOM_PS_MSG_INIT, b.data, b.len, err);
    }
    for (int q = 0; q < ps->n_ps && !rc; q++) {
        int from;
        uint32_t type;
        do /* a late answer to an abandoned pull or push is skipped: the INIT_OK (or a refusal) is this q's */
            rc = loom_net_recv(ps->net, ps->peer_ps[q], LOOM_PS_MSG_INIT_OK, LOOM_PS_MSG_REFUSED, &from, &type, &b, -1, err);
        while (!rc && type != LOOM_PS_MSG_INIT_OK && type != LOOM_PS_MSG_REFUSED);
        if (!rc && type == LOOM_PS_MSG_REFUSED) rc = loom_ps_refused_(ps, from, &b, err);
        if (!rc && type == LOOM_PS_MSG_INIT_OK && b.len >= LOOM_PS_HDR + 24) { /* what the ps holds, and its memory */
            loom_buf r = b;
            r.pos = LOOM_PS_HDR;
            r.failed = 0;
            uint64_t alloc = loom_buf_get_u64(&r), ready = loom_buf_get_u64(&r), hwm = loom_buf_get_u64(&r);
            const double MiB = 1048576.0;
            loom_info("ps:%d holds %lld of the model's %lld floats: %.1f MiB allocated for them (variables, gradients, "
                      "%s%d slot%s); resident %.1f MiB when it was ready to serve, %.1f MiB at most so far (the "
                      "whole model's variables alone are %.1f MiB)", q, (long long)ps->plan.ps_floats[q],
                      (long long)ps->P, (double)alloc / MiB, ps->sync ? "sums, " : "", ps->n_slots,
                      ps->n_slots == 1 ? "" : "s", (double)ready / MiB, (double)hwm / MiB,
                      (double)ps->P * sizeof(float) / MiB);
        }
    }
    if (!rc && getenv("LOOM_TEST_PS_FORGE_PUSH")) { /* tests: a push from a task that is no worker is refused */
        b.len = 0;
        loom_ps_hdr h = {.req = ++ps->req, .nonce = ps->nonce, .step = step};
        if (!loom_ps_put_shards_(&b, ps, 0, &h, loom_model_grads(ps->model), NULL))
            rc = loom_net_send(ps->net, ps->peer_ps[0], LOOM_PS_MSG_PUSH, b.data, b.len, err);
        loom_warn("LOOM_TEST_PS_FORGE_PUSH: the coordinator pushed gradients to ps:0 itself");
    }
    loom_buf_fini(&b);
    if (!rc) {
        ps->need_init = false;
        ps->ps_step = step;
    }
    if (!rc && ps->restored) { /* a restore: read it back, every bit must be the checkpoint's */
        ps->restored = false;
        size_t nb = (size_t)ps->P * sizeof(float) * (size_t)(1 + ps->n_slots);
        float *back = loom_alloc_aligned(nb ? nb : 1), *want = loom_alloc_aligned(nb ? nb : 1);
        if (!back || !want) rc = loom_err_set(err, LOOM_ENOMEM, NULL, "checking the restored variables");
        int64_t got = 0;
        if (!rc) {
            memcpy(want, loom_model_params(ps->model), (size_t)ps->P * sizeof(float));
            if (ps->n_slots)
                memcpy(want + ps->P, loom_optimizer_slots(ps->opt), (size_t)ps->P * ps->n_slots * sizeof(float));
            rc = loom_ps_pull_all_(ps, back, ps->n_slots ? back + ps->P : NULL, 0, &got, err);
        }
        if (!rc && (memcmp(back, want, nb) || got != step))
            rc = loom_err_set(err, LOOM_ECHECKPOINT, ps->task, "the ps tasks do not hold the restored checkpoint's "
                              "variables (step %lld, they report %lld)", (long long)step, (long long)got);
        if (!rc)
            loom_info("the %d ps task%s hold the checkpoint's %lld variables and %d slot%s exactly, at step %lld",
                      ps->n_ps, ps->n_ps == 1 ? "" : "s", (long long)ps->P, ps->n_slots, ps->n_slots == 1 ? "" : "s",
                      (long long)step);
        loom_free(back);
        loom_free(want);
    }
    return rc;
}

static int alive_workers(const ps_strategy *ps)
{
    int n = 0;
    for (int w = 0; w < ps->n_workers; w++) n += ps->alive[w];
    return n;
}

static int running_fns(const ps_strategy *ps)
{
    int n = 0;
    for (int i = 0; i < ps->n_fns; i++) n += ps->fns[i].worker != -1;
    return n;
}

static int add_ready(ps_strategy *ps, const loom_ps_step_out *o)
{
    if (ps->ready_head > 0 && ps->ready_head == ps->n_ready) ps->ready_head = ps->n_ready = 0;
    if (ps->n_ready == ps->cap_ready) {
        int64_t nc = ps->cap_ready ? 2 * ps->cap_ready : 64;
        loom_ps_step_out *nr = loom_realloc(ps->ready, (size_t)nc * sizeof *nr);
        if (!nr) return LOOM_ENOMEM;
        ps->ready = nr, ps->cap_ready = nc;
    }
    ps->ready[ps->n_ready++] = *o;
    return LOOM_OK;
}

static int find_fn(const ps_strategy *ps, uint64_t fn)
{
    for (int i = 0; i < ps->n_fns; i++)
        if (ps->fns[i].fn == fn) return i;
    return -1;
}

static void drop_fn(ps_strategy *ps, int i)
{
    ps->fns[i] = ps->fns[--ps->n_fns];
}

static int send_run(ps_strategy *ps, int w, const fn_slot *f, loom_err *err)
{
    loom_ps_run r = {.fn = f->fn, .nonce = ps->nonce, .first = f->first, .steps = f->steps};
    loom_buf b;
    loom_buf_init(&b);
    loom_ps_put_run_(&b, &r);
    int rc = b.failed ? loom_err_set(err, LOOM_ENOMEM, NULL, "building a step function")
                      : loom_net_send(ps->net, ps->peer_worker[w], LOOM_PS_MSG_RUN, b.data, b.len, err);
    loom_buf_fini(&b);
    return rc;
}

/* Queues step functions up to the horizon, and gives queued ones to free workers. */
static int schedule(ps_strategy *ps, int64_t step, loom_err *err)
{
    int64_t h = horizon(ps, ps->args, step);
    if (ps->dispatched < step) ps->dispatched = step;
    int want = ps->sync ? 1 : alive_workers(ps);
    while (ps->dispatched < h && ps->n_fns < (want > 0 ? want : 1)) {
        if (ps->n_fns == ps->cap_fns) {
            int nc = ps->cap_fns ? 2 * ps->cap_fns : 8;
            fn_slot *nf = loom_realloc(ps->fns, (size_t)nc * sizeof *nf);
            if (!nf) return loom_err_set(err, LOOM_ENOMEM, NULL, "queueing a step function");
            ps->fns = nf, ps->cap_fns = nc;
        }
        int64_t n = h - ps->dispatched < ps->K ? h - ps->dispatched : ps->K;
        ps->fns[ps->n_fns++] = (fn_slot){.fn = ++ps->next_fn, .first = ps->dispatched, .steps = (uint32_t)n, .worker = -1};
        ps->dispatched += n;
    }
    for (int i = 0; i < ps->n_fns; i++) {
        fn_slot *f = &ps->fns[i];
        if (f->worker != -1) continue;
        if (ps->sync) { /* every worker takes part in every step */
            for (int w = 0; w < ps->n_workers; w++) {
                if (!ps->alive[w]) continue;
                loom_err e;
                if (send_run(ps, w, f, &e) == LOOM_OK) ps->busy[w] = true;
            }
            f->worker = -2; /* all */
            continue;
        }
        for (int w = 0; w < ps->n_workers; w++) {
            if (!ps->alive[w] || ps->busy[w]) continue;
            loom_err e;
            if (send_run(ps, w, f, &e)) { /* lost in between: its news comes */
                continue;
            }
            ps->busy[w] = true;
            f->worker = w;
            break;
        }
    }
    return LOOM_OK;
}

static int worker_of_peer(const ps_strategy *ps, int p)
{
    for (int w = 0; w < ps->n_workers; w++)
        if (ps->peer_worker[w] == p) return w;
    return -1;
}

/* News: worker w (who) was lost; the step functions it ran go back in the queue. */
static void news_down(ps_strategy *ps, int w, const char *who)
{
    ps->alive[w] = false;
    ps->busy[w] = false;
    for (int i = 0; i < ps->n_fns; i++)
        if (ps->fns[i].worker == w) {
            ps->fns[i].worker = -1;
            ps->requeued++;
            loom_warn("lost %s in the middle of step function %llu (steps %lld to %lld): put back in the queue for "
                      "another worker", who, (unsigned long long)ps->fns[i].fn, (long long)ps->fns[i].first + 1,
                      (long long)(ps->fns[i].first + ps->fns[i].steps));
        }
    if (ps->sync && alive_workers(ps) < ps->sync_n)
        loom_warn("only %d worker%s left, replicas_to_aggregate = %d: the job waits for a worker to come back",
                  alive_workers(ps), alive_workers(ps) == 1 ? "" : "s", ps->sync_n);
}

/* News: worker w (who) came back. */
static void news_up(ps_strategy *ps, int w, const char *who)
{
    ps->alive[w] = true;
    ps->busy[w] = false;
    loom_info("%s rejoined: it rebuilt its input pipeline and takes step functions again", who);
}

/* News: worker w's result of a step function (msg): its steps' sums become
 * ready, in order; a late report of a finished synchronous step adds its
 * accepted gradients' sums to the pool the next step reports. */
static int news_result(ps_strategy *ps, int w, const char *who, const loom_buf *msg, loom_err *err)
{
    uint64_t fn;
    loom_ps_step_out *out;
    uint32_t n;
    loom_ps_traffic tr;
    int rc = loom_ps_decode_result_(msg->data, msg->len, &fn, &out, &n, &tr, err);
    if (rc) return loom_err_hint(err, "a step result from %s did not decode", who);
    ps->moved_bytes += (int64_t)tr.bytes;
    ps->moved_rows += (int64_t)tr.rows;
    ps->moved_steps += n;
    int i = find_fn(ps, fn);
    if (!ps->sync) ps->busy[w] = false;
    else if (ps->fns && i < 0) ps->busy[w] = false;
    for (uint32_t k = 0; k < n; k++)
        if (!out[k].accepted && ++ps->stale <= 3) /* the first few named; all counted, in the end line */
            loom_info("the gradient %s computed for step %lld was stale: dropped%s", who,
                      (long long)out[k].step + 1, ps->stale == 3 ? " (further ones are counted, not logged)" : "");
    if (i >= 0) {
        fn_slot f = ps->fns[i];
        drop_fn(ps, i);
        if (ps->sync) ps->busy[w] = false;
        for (uint32_t k = 0; k < f.steps && !rc; k++) {
            loom_ps_step_out o = {.step = f.first + k, .accepted = 1};
            for (uint32_t j = 0; j < n; j++)
                if (out[j].step == o.step && out[j].accepted) {
                    o.loss_sum += out[j].loss_sum;
                    o.correct += out[j].correct;
                    o.examples += out[j].examples;
                }
            if (!ps->sync) o = out[k < n ? k : 0], o.step = f.first + k;
            if (k == 0 && ps->pool.examples) {
                o.loss_sum += ps->pool.loss_sum;
                o.correct += ps->pool.correct;
                o.examples += ps->pool.examples;
                memset(&ps->pool, 0, sizeof ps->pool);
            }
            if (add_ready(ps, &o)) rc = loom_err_set(err, LOOM_ENOMEM, NULL, "keeping step results");
        }
    } else if (ps->sync) { /* a late report of a finished step: its accepted gradients count */
        ps->busy[w] = false;
        for (uint32_t j = 0; j < n; j++)
            if (out[j].accepted) {
                ps->pool.loss_sum += out[j].loss_sum;
                ps->pool.correct += out[j].correct;
                ps->pool.examples += out[j].examples;
            }
    }
    loom_free(out);
    return rc;
}

/* News: a task refused a message of the coordinator (msg: why). */
static void news_refused(const char *who, const loom_buf *msg)
{
    char text[400];
    size_t l = msg->len < sizeof text - 1 ? msg->len : sizeof text - 1;
    memcpy(text, msg->data, l);
    text[l] = 0;
    loom_warn("%s refused a message of the coordinator: %s", who, text);
}

/* Waits (wait_s; < 0: as long as workers may still come back) for one
 * piece of news from the workers (a loss, a return, a result, a refusal)
 * and acts on it. */
static int pump_for(ps_strategy *ps, double wait_s, loom_err *err)
{
    loom_buf msg;
    loom_buf_init(&msg);
    int from;
    uint32_t type;
    int alive = alive_workers(ps);
    bool starved = alive == 0 || (ps->sync && alive < ps->sync_n); /* no step can complete until one is back */
    int rc = loom_net_recv(ps->net, -1, LOOM_MSG_PEER_DOWN, LOOM_PS_MSG_LAST, &from, &type, &msg,
                           wait_s >= 0 ? wait_s : starved ? ps->wait_s : -1, err);
    if (rc == LOOM_ETIMEOUT && wait_s >= 0) return rc;
    if (rc == LOOM_ETIMEOUT) {
        if (alive)
            loom_err_set(err, LOOM_ENET, ps->task, "only %d worker%s left, fewer than replicas_to_aggregate = %d, and "
                         "none came back within %g s (cluster.connect_timeout)", alive, alive == 1 ? "" : "s",
                         ps->sync_n, ps->wait_s);
        else
            loom_err_set(err, LOOM_ENET, ps->task, "every worker was lost and none came back within %g s "
                         "(cluster.connect_timeout)", ps->wait_s);
        loom_err_hint(err, "the job stops; restart it (loom launch --restarts K) to resume from the last checkpoint");
        return LOOM_ENET;
    }
    if (rc) {
        loom_err_hint(err, "a ps task holds variables no other task has: the job stops; loom launch --restarts K "
                           "restarts it from the last checkpoint");
        return rc;
    }
    int w = worker_of_peer(ps, from);
    char who[32];
    loom_ps_peer_name_(ps, from, who, sizeof who);
    if (type == LOOM_MSG_PEER_DOWN && w >= 0) news_down(ps, w, who);
    else if (type == LOOM_MSG_PEER_UP && w >= 0) news_up(ps, w, who);
    else if (type == LOOM_PS_MSG_RESULT && w >= 0) rc = news_result(ps, w, who, &msg, err);
    else if (type == LOOM_PS_MSG_REFUSED) news_refused(who, &msg);
    /* anything else (late VALUES of an abandoned pull): ignored */
    loom_buf_fini(&msg);
    return rc;
}

static int pump(ps_strategy *ps, loom_err *err) { return pump_for(ps, -1, err); }

/* The end of the job: waits (at most 10 s) for every worker still busy
 * (a synchronous backup finishing a stale step) to report, so none is
 * cut off from the ps tasks in the middle of a push. */
void loom_ps_drain_workers_(ps_strategy *ps)
{
    double until = loom_now() + 10;
    for (;;) {
        bool any = false;
        for (int w = 0; w < ps->n_workers; w++) any |= ps->alive[w] && ps->busy[w];
        double left = until - loom_now();
        if (!any || left <= 0) return;
        loom_err e;
        if (pump_for(ps, left, &e)) return;
    }
}

/* Waits until no step function runs (the variables at rest on the ps tasks). */
int loom_ps_quiesce_(ps_strategy *ps, loom_err *err)
{
    /* queued, not started: dropped (their steps were never counted) */
    for (int i = 0; i < ps->n_fns;)
        if (ps->fns[i].worker == -1) {
            ps->dispatched -= ps->fns[i].steps;
            drop_fn(ps, i);
        } else
            i++;
    while (running_fns(ps)) {
        int rc = pump(ps, err);
        if (rc) return rc;
        for (int i = 0; i < ps->n_fns;)
            if (ps->fns[i].worker == -1) { /* requeued after a loss: never mind, the next schedule redoes it */
                ps->dispatched -= ps->fns[i].steps;
                drop_fn(ps, i);
            } else
                i++;
    }
    return LOOM_OK;
}

/* The ps tasks' variables (and slots) into the chief's model. */
int loom_ps_fetch_(ps_strategy *ps, bool slots, loom_err *err)
{
    if (ps->fresh && !slots) return LOOM_OK;
    int rc = loom_ps_quiesce_(ps, err);
    if (!rc)
        rc = loom_ps_pull_all_(ps, loom_model_params(ps->model), slots && ps->n_slots ? loom_optimizer_slots(ps->opt) : NULL,
                               0, &ps->ps_step, err);
    if (!rc) ps->fresh = true;
    return rc;
}

int loom_ps_train_step_(loom_strategy *s, const loom_elem *batch, int64_t step, loom_step_result *out, loom_err *err)
{
    (void)batch; /* the workers compute on their own pipelines */
    ps_strategy *ps = s->impl;
    memset(out, 0, sizeof *out);
    if (!ps->net) {
        char w[600];
        return loom_err_set(err, LOOM_ECONFIG, loom_loc_str(&s->args->spec->strategy.loc, w, sizeof w),
                            "parameter_server trains across processes, but this one has no task of a cluster: it needs "
                            "a chief, workers and ps tasks"),
               loom_err_hint(err, "run it with loom launch --local CONFIG --workers 2 --ps 1 (or --task ROLE:I for "
                                  "each task); for one process use one_device or mirrored");
    }
    int rc;
    if (ps->need_init && (rc = loom_ps_init_tasks_(ps, step, err))) return rc;
    if (loom_ps_test_die_now_(ps->task, step + 1)) _exit(137); /* tests: the coordinator lost */
    ps->fresh = false;
    while (ps->ready_head == ps->n_ready) {
        if ((rc = schedule(ps, step, err))) return rc;
        if (ps->ready_head < ps->n_ready) break;
        if (ps->n_fns == 0)
            return loom_err_set(err, LOOM_EUSAGE, ps->task, "nothing to schedule at step %lld", (long long)step + 1);
        if ((rc = pump(ps, err))) return rc;
    }
    loom_ps_step_out *o = &ps->ready[ps->ready_head++];
    out->loss_sum = o->loss_sum;
    out->correct = o->correct;
    out->examples = o->examples;
    return LOOM_OK;
}
