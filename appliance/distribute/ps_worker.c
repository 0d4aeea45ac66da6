/* ps_worker.c - parameter_server's worker: runs the step functions the chief
 * sends (RUN): for each step it pulls the variables (the rows its batch looks
 * up, with sparse updates) from every ps, computes the gradients of one batch
 * of its own input pipeline and pushes them (parameter_server.c says how the
 * roles fit together; ps_internal.h the messages). Runs on the train thread. */
#include "ps_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- the worker ------------------------------------------------------------- */

static int next_batch(loom_iter *it, int64_t *epoch, loom_elem **out, loom_err *err)
{
    int rc = loom_iter_next(it, out, err);
    if (rc != LOOM_EEOF) return rc;
    if ((rc = loom_iter_rewind(it, ++*epoch, err))) return rc; /* repeat: the next pass */
    rc = loom_iter_next(it, out, err);
    if (rc == LOOM_EEOF)
        return loom_err_set(err, LOOM_EDATA, NULL, "data.train yielded no batch on this worker"),
               loom_err_hint(err, "the dataset is empty after take/skip/batch(drop_remainder)");
    return rc;
}

/* The table rows the batch's ids x look up, per shard of the table, into
 * sel_n and sel_rows (distinct, in first-seen order). An id of -1 adds
 * nothing (padding); an id outside the table is not pulled: the step that
 * follows fails naming it, as on one machine. */
static void select_rows(ps_strategy *ps, const loom_tensor *x)
{
    if (!ps->sparse || !ps->sel_n) return;
    if (x->dtype != LOOM_I32 && x->dtype != LOOM_I64) return; /* (refused when the model was built) */
    int first = -1, k = 0;
    for (int i = 0; i < ps->plan.n_shards; i++)
        if (ps->is_table[i]) {
            if (first < 0) first = i;
            k++;
            ps->sel_n[i] = 0;
        }
    int64_t n = 1, rows = ps->table_rows;
    for (int d = 0; d < x->shape.rank; d++) n *= x->shape.dim[d];
    /* shard j of k holds rows [j*base + min(j, extra), ...): the first extra shards one row longer */
    int64_t base = rows / k, extra = rows % k, cut = extra * (base + 1);
    for (int64_t e = 0; e < n; e++) {
        int64_t id = x->dtype == LOOM_I64 ? ((const int64_t *)x->data)[e] : ((const int32_t *)x->data)[e];
        if (id < 0 || id >= rows || ps->mark[id]) continue;
        ps->mark[id] = 1;
        int64_t j = id < cut ? id / (base + 1) : extra + (id - cut) / base;
        const loom_ps_shard *sh = &ps->plan.shard[first + j];
        LOOM_ASSERT(id >= sh->row0 && id < sh->row0 + sh->rows);
        ps->sel_rows[first + j][ps->sel_n[first + j]++] = (uint32_t)(id - sh->row0);
    }
    ps->sel_total = 0;
    for (int i = first; i < first + k; i++) {
        for (int64_t j = 0; j < ps->sel_n[i]; j++) ps->mark[ps->plan.shard[i].row0 + ps->sel_rows[i][j]] = 0;
        ps->sel_total += ps->sel_n[i];
    }
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

/* optimizer.clip_norm (tf.clip_by_global_norm) under parameter_server: no
 * ps holds every gradient, so the worker scales its own by their global
 * norm before pushing them, as a TF worker's step function clips before
 * the update, and the ps tasks apply them unclipped. The norm sums the
 * squares in the flat buffer's order (a sparse step: the dense part, then
 * the table's selected rows in ascending order, the other table rows being
 * zero) and the scaled gradients are g * factor in float, so the update's
 * bits are those of one_device's optimizer clipping the same gradients. */
static void clip_grads(ps_strategy *ps)
{
    float *g = loom_model_grads(ps->model);
    bool rows = ps->table_var >= 0 && ps->sparse && ps->sel_n;
    int64_t lo = rows ? ps->table_off : ps->P, hi = rows ? ps->table_off + ps->table_rows * ps->table_dim : ps->P;
    double ss = 0;
    for (int64_t i = 0; i < lo; i++) ss += (double)g[i] * g[i];
    for (int i = 0; rows && i < ps->plan.n_shards; i++) { /* the table's shards ascend */
        if (!ps->is_table[i] || ps->sel_n[i] <= 0) continue;
        qsort(ps->sel_rows[i], (size_t)ps->sel_n[i], sizeof(uint32_t), cmp_u32);
        for (int64_t j = 0; j < ps->sel_n[i]; j++) {
            const float *r = g + ps->table_off + (ps->plan.shard[i].row0 + ps->sel_rows[i][j]) * ps->table_dim;
            for (int64_t e = 0; e < ps->table_dim; e++) ss += (double)r[e] * r[e];
        }
    }
    for (int64_t i = hi; i < ps->P; i++) ss += (double)g[i] * g[i];
    double norm = sqrt(ss);
    if (!(norm > ps->clip_norm)) return;
    float c = (float)(ps->clip_norm / norm);
    for (int64_t i = 0; i < lo; i++) g[i] = g[i] * c;
    for (int i = 0; rows && i < ps->plan.n_shards; i++) {
        if (!ps->is_table[i] || ps->sel_n[i] <= 0) continue;
        for (int64_t j = 0; j < ps->sel_n[i]; j++) {
            float *r = g + ps->table_off + (ps->plan.shard[i].row0 + ps->sel_rows[i][j]) * ps->table_dim;
            for (int64_t e = 0; e < ps->table_dim; e++) r[e] = r[e] * c;
        }
    }
    for (int64_t i = hi; i < ps->P; i++) g[i] = g[i] * c;
}

/* Pushes the model's gradients (flat) to every ps; *accepted: all took them.
 * pull: the ps tasks answer with the new values, into the model (async). */
static int push_all(ps_strategy *ps, int64_t tag, bool pull, bool *accepted, int64_t *applied, loom_err *err)
{
    loom_buf b;
    loom_buf_init(&b);
    uint64_t req = ++ps->req;
    const float *g = loom_model_grads(ps->model);
    int rc = LOOM_OK;
    for (int q = 0; q < ps->n_ps && !rc; q++) {
        b.len = 0;
        loom_ps_hdr h = {.req = req, .nonce = ps->nonce, .step = tag, .flags = pull ? LOOM_PS_F_PULL : 0};
        if (loom_ps_put_shards_sel_(&b, ps, q, &h, g, NULL, true))
            rc = loom_err_set(err, LOOM_ENOMEM, NULL, "building a push");
        else rc = loom_net_send(ps->net, ps->peer_ps[q], LOOM_PS_MSG_PUSH, b.data, b.len, err);
        ps->bytes_push += (int64_t)b.len;
    }
    *accepted = true;
    *applied = INT64_MAX;
    for (int q = 0; q < ps->n_ps && !rc; q++) {
        uint32_t type;
        int from;
        for (;;) {
            rc = loom_net_recv(ps->net, ps->peer_ps[q], LOOM_PS_MSG_VALUES, LOOM_PS_MSG_REFUSED, &from, &type, &b, -1, err);
            if (rc) break;
            if (type == LOOM_PS_MSG_REFUSED) {
                rc = loom_ps_refused_(ps, from, &b, err);
                break;
            }
            if (type != LOOM_PS_MSG_PUSHED && type != LOOM_PS_MSG_VALUES) continue;
            loom_ps_msg m;
            if ((rc = loom_ps_decode_(b.data, b.len, &ps->plan, q, ps->n_slots, type == LOOM_PS_MSG_VALUES, &m, err)))
                break;
            bool mine = m.h.req == req;
            if (mine) ps->bytes_push += (int64_t)b.len;
            if (mine && type == LOOM_PS_MSG_VALUES) loom_ps_take_values_(ps, &m, loom_model_params(ps->model), NULL);
            if (mine) {
                if (!(m.h.flags & LOOM_PS_F_ACCEPTED)) *accepted = false;
                if (m.h.step < *applied) *applied = m.h.step;
            }
            loom_ps_msg_fini_(&m);
            if (mine) break;
        }
    }
    loom_buf_fini(&b);
    return rc;
}

/* One step function: r->steps steps (async), or (sync) the steps of the
 * job from r->first until the ps tasks reach r->first + r->steps. */
static int run_fn(ps_strategy *ps, const loom_strategy_args *a, loom_iter *it, int64_t *epoch, const loom_ps_run *r,
                  loom_ps_step_out *out, uint32_t *n_out, loom_err *err)
{
    float *params = loom_model_params(ps->model);
    *n_out = 0;
    int64_t end = r->first + r->steps, t = r->first;
    bool have = false; /* (async) the last push brought the new values back */
    for (uint32_t i = 0; i < r->steps || ps->sync; i++) {
        int64_t seen = 0;
        int rc;
        /* sparse: the batch first, to pull the rows it looks up; one the
         * function ends without computing on is held for the next */
        loom_elem *batch = ps->held;
        ps->held = NULL;
        if (ps->sparse && !batch && (rc = next_batch(it, epoch, &batch, err))) return rc;
        if (batch) select_rows(ps, &batch->t[a->input_idx]);
        rc = have ? LOOM_OK : loom_ps_pull_sel_(ps, params, NULL, ps->sync ? t : 0, &seen, true, err);
        if (rc) return rc;
        if (ps->sync && seen >= end) {
            ps->held = batch;
            break;
        }
        if (!ps->sync) seen = r->first + i;
        if (!batch && (rc = next_batch(it, epoch, &batch, err))) return rc;
        const loom_tensor *x = &batch->t[a->input_idx], *y = &batch->t[a->label_idx];
        int64_t B = x->shape.dim[0];
        loom_ps_step_out *o = &out[*n_out];
        memset(o, 0, sizeof *o);
        o->step = seen;
        o->examples = B;
        uint64_t key = loom_rng_mix(loom_rng_mix(ps->seed, 0x50530000u + (uint64_t)ps->index), (uint64_t)seen);
        loom_strategy_weights_(a, ps->model, batch); /* sample weights, other inputs, other heads' labels */
        rc = loom_model_train_step(ps->model, x, y, B, key, &o->loss_sum, &o->correct, err);
        if (rc) return rc;
        if (ps->clip_norm > 0) clip_grads(ps);
        if (ps->test_step_us) usleep(ps->test_step_us); /* tests: a slower worker */
        bool accepted;
        int64_t applied;
        ps->steps_run++;
        ps->rows_sel += ps->sparse ? ps->sel_total : 0;
        have = !ps->sync && !ps->sparse && i + 1 < r->steps; /* (sparse: the next batch wants other rows) */
        if ((rc = push_all(ps, seen, have, &accepted, &applied, err))) return rc;
        o->accepted = accepted;
        (*n_out)++;
        t = seen + 1;
        if (*n_out >= LOOM_PS_MAX_STEPS) break;
    }
    return LOOM_OK;
}

int loom_ps_worker_serve_(ps_strategy *ps, const loom_strategy_args *a, loom_iter *it, loom_err *err)
{
    loom_buf msg;
    loom_buf_init(&msg);
    loom_ps_step_out *out = loom_calloc(LOOM_PS_MAX_STEPS, sizeof *out);
    if (!out) return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating step results");
    int64_t epoch = 0, runs = 0;
    int rc;
    for (;;) {
        int from;
        uint32_t type;
        rc = loom_ps_recv_or_stop_(ps, ps->peer_chief, LOOM_PS_MSG_RUN, LOOM_PS_MSG_END, &from, &type, &msg, err);
        if (rc) break;
        if (type == LOOM_PS_MSG_END) break;
        if (type != LOOM_PS_MSG_RUN) continue;
        loom_ps_run r;
        if ((rc = loom_ps_decode_run_(msg.data, msg.len, &r, err))) break;
        ps->nonce = r.nonce;
        uint32_t n = 0;
        int64_t bytes0 = ps->bytes_pull + ps->bytes_push, rows0 = ps->rows_sel;
        if (loom_ps_test_die_now_(ps->task, ++runs)) { /* in the middle of the function: some of its steps pushed */
            loom_ps_run half = r;
            half.steps = r.steps > 1 ? r.steps / 2 : 1;
            if (!ps->sync) run_fn(ps, a, it, &epoch, &half, out, &n, err);
            _exit(137);
        }
        if ((rc = run_fn(ps, a, it, &epoch, &r, out, &n, err))) break;
        loom_buf_fini(&msg);
        loom_buf_init(&msg);
        loom_ps_traffic tr = {.bytes = (uint64_t)(ps->bytes_pull + ps->bytes_push - bytes0),
                              .rows = (uint64_t)(ps->rows_sel - rows0)};
        loom_ps_put_result_(&msg, r.fn, out, n, &tr);
        if (msg.failed) {
            rc = loom_err_set(err, LOOM_ENOMEM, NULL, "building a step result");
            break;
        }
        if ((rc = loom_net_send(ps->net, ps->peer_chief, LOOM_PS_MSG_RESULT, msg.data, msg.len, err))) break;
    }
    loom_buf_fini(&msg);
    loom_free(out);
    return rc;
}
