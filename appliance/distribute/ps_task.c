/* ps_task.c - parameter_server's ps task: the variable service. It holds its
 * shards and their optimizer slots (INIT), answers pulls (VALUES), applies
 * pushed gradients (asynchronous, or aggregated per step when synchronous),
 * writes its shard file of a checkpoint (SAVE) and refuses what it does not
 * expect (REFUSED); see parameter_server.c and ps_internal.h. Runs on the
 * train thread until the chief ends the job. */
#include "ps_internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* This process's resident memory, bytes ("VmRSS": now, "VmHWM": its
 * peak), from /proc/self/status; 0 when unknown. */
static int64_t resident(const char *key)
{
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return 0;
    char line[256], fmt[32];
    long long kb = 0;
    snprintf(fmt, sizeof fmt, "%s: %%lld kB", key);
    while (fgets(line, sizeof line, f))
        if (sscanf(line, fmt, &kb) == 1) break;
    fclose(f);
    return (int64_t)kb * 1024;
}

/* ---- the ps ------------------------------------------------------------------ */

typedef struct pending_pull {
    int       from;
    loom_buf  msg;
    int64_t   min_step;
} pending_pull;

typedef struct ps_state {
    ps_strategy    *ps;
    int             q;
    int64_t         L;
    float          *params, *grads, *acc, *slots;
    loom_optimizer *opt;
    int64_t         step, stale, refused, pushes;
    int64_t         alloc_bytes; /* its variables, gradients, sums and slots: what it allocated to serve */
    int64_t         rss_ready;   /* resident bytes with those allocated, before any message */
    int             acc_n;
    bool            inited;
    pending_pull   *pend;
    int             n_pend, cap_pend;
    /* rows of table shards: the ids of a push (and 0..rows-1 for a whole
     * shard) as the optimizer takes them; sync: per shard, the rows the
     * step's accepted pushes touched (acc is zero elsewhere) */
    int64_t        *ids, *iota;
    bool           *acc_whole;   /* per shard: pushed whole into acc */
    int64_t       **acc_rows;    /* per table shard of this ps: rows in acc, first-touched order */
    int64_t        *acc_nrows;
    uint8_t       **acc_mark;    /* per table shard of this ps: row in acc_rows already */
} ps_state;

static int refuse(ps_state *st, int from, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int refuse(ps_state *st, int from, const char *fmt, ...)
{
    char text[400], who[32];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    st->refused++;
    loom_warn("%s: refused a message from %s: %s", st->ps->task, loom_ps_peer_name_(st->ps, from, who, sizeof who),
              text);
    loom_err e;
    return loom_net_send(st->ps->net, from, LOOM_PS_MSG_REFUSED, text, strlen(text), &e) ? LOOM_OK : LOOM_OK;
}

/* Answers a PULL (already decoded as m), or a PUSH asking for the new values. */
static int answer_pull(ps_state *st, int from, const loom_ps_msg *m, bool pushed, loom_err *err)
{
    ps_strategy *ps = st->ps;
    bool slots = (m->h.flags & LOOM_PS_F_SLOTS) && ps->n_slots > 0 && !pushed;
    loom_buf b;
    loom_buf_init(&b);
    loom_ps_hdr h = {.req = m->h.req, .nonce = ps->nonce, .step = st->step,
                     .flags = (slots ? LOOM_PS_F_SLOTS : 0) | (pushed ? LOOM_PS_F_ACCEPTED : 0),
                     .n_ranges = (uint32_t)m->n};
    loom_ps_put_hdr_(&b, &h);
    for (int i = 0; i < m->n; i++) {
        const loom_ps_range *r = &m->r[i];
        const loom_ps_shard *sh = &ps->plan.shard[r->shard];
        uint32_t *rows = NULL;
        if (r->n_rows != LOOM_PS_WHOLE) {
            rows = loom_alloc((size_t)(r->n_rows ? r->n_rows : 1) * sizeof *rows);
            if (!rows) {
                loom_buf_fini(&b);
                return loom_err_set(err, LOOM_ENOMEM, NULL, "answering a pull");
            }
            for (uint32_t j = 0; j < r->n_rows; j++) rows[j] = loom_ps_row_(r, j);
        }
        loom_ps_put_range_(&b, r->shard, r->n_rows, rows);
        for (int k = 0; k < 1 + (slots ? ps->n_slots : 0); k++) {
            const float *src = k == 0 ? st->params : st->slots + (size_t)(k - 1) * (size_t)st->L;
            if (!rows)
                loom_buf_put(&b, src + sh->local, (size_t)sh->count * sizeof(float));
            else
                for (uint32_t j = 0; j < r->n_rows; j++)
                    loom_buf_put(&b, src + sh->local + (int64_t)rows[j] * sh->row_size,
                                 (size_t)sh->row_size * sizeof(float));
        }
        loom_free(rows);
    }
    int rc = b.failed ? loom_err_set(err, LOOM_ENOMEM, NULL, "answering a pull")
                      : loom_net_send(ps->net, from, LOOM_PS_MSG_VALUES, b.data, b.len, err);
    loom_buf_fini(&b);
    return rc;
}

static int flush_pulls(ps_state *st, loom_err *err)
{
    int keep = 0, rc = LOOM_OK;
    for (int i = 0; i < st->n_pend; i++) {
        pending_pull *pp = &st->pend[i];
        if (!rc && pp->min_step <= st->step) {
            loom_ps_msg m;
            rc = loom_ps_decode_(pp->msg.data, pp->msg.len, &st->ps->plan, st->q, st->ps->n_slots, false, &m, err);
            if (!rc) rc = answer_pull(st, pp->from, &m, false, err);
            loom_ps_msg_fini_(&m);
            loom_buf_fini(&pp->msg);
        } else {
            st->pend[keep++] = *pp;
        }
    }
    st->n_pend = keep;
    return rc;
}

/* Gradients of a push (m) into buf at the local layout (rows: only theirs),
 * added when add, else copied. */
static void take_grads(ps_state *st, const loom_ps_msg *m, float *buf, bool add)
{
    for (int i = 0; i < m->n; i++) {
        const loom_ps_range *r = &m->r[i];
        const loom_ps_shard *sh = &st->ps->plan.shard[r->shard];
        int64_t nrows = r->n_rows == LOOM_PS_WHOLE ? sh->rows : r->n_rows;
        for (int64_t j = 0; j < nrows; j++) {
            int64_t row = r->n_rows == LOOM_PS_WHOLE ? j : (int64_t)loom_ps_row_(r, (uint32_t)j);
            float *dst = buf + sh->local + row * sh->row_size;
            const uint8_t *src = r->vals + (size_t)j * (size_t)sh->row_size * sizeof(float);
            for (int64_t k = 0; k < sh->row_size; k++) {
                float v;
                memcpy(&v, src + (size_t)k * sizeof(float), sizeof v);
                dst[k] = add ? dst[k] + v : v;
            }
        }
    }
}

/* The update of shard i (its rows ids[0..n), or ids NULL: all of it) from
 * st->grads. A table's shard is updated as one machine updates the table
 * (loom_optimizer_set_tables): lazily, only the elements with a gradient,
 * so moving the table whole or by rows gives the same bits. */
static void apply_shard(ps_state *st, int i, const int64_t *ids, int64_t n)
{
    const loom_ps_shard *sh = &st->ps->plan.shard[i];
    if (st->ps->is_table[i]) {
        if (!ids) ids = st->iota, n = sh->rows;
        loom_optimizer_apply_rows(st->opt, st->params, st->grads, st->step, sh->local, sh->row_size, ids, n, NULL);
    } else if (!ids) {
        loom_optimizer_apply_range(st->opt, NULL, st->params, st->grads, st->step, sh->local, sh->local + sh->count);
    } else {
        for (int64_t j = 0; j < n; j++) {
            int64_t lo = sh->local + ids[j] * sh->row_size;
            loom_optimizer_apply_range(st->opt, NULL, st->params, st->grads, st->step, lo, lo + sh->row_size);
        }
    }
}

/* A range's row ids as the optimizer takes them (st->ids); NULL: whole. */
static const int64_t *range_ids(ps_state *st, const loom_ps_range *r)
{
    if (r->n_rows == LOOM_PS_WHOLE) return NULL;
    for (uint32_t j = 0; j < r->n_rows; j++) st->ids[j] = loom_ps_row_(r, j);
    return st->ids;
}

/* Synchronous: the push m added into acc; note what it touched. */
static void note_acc(ps_state *st, const loom_ps_msg *m)
{
    for (int i = 0; i < m->n; i++) {
        const loom_ps_range *r = &m->r[i];
        int s = (int)r->shard;
        if (r->n_rows == LOOM_PS_WHOLE || !st->acc_mark[s]) {
            st->acc_whole[s] = true;
            continue;
        }
        for (uint32_t j = 0; j < r->n_rows; j++) {
            uint32_t row = loom_ps_row_(r, j);
            if (st->acc_mark[s][row]) continue;
            st->acc_mark[s][row] = 1;
            st->acc_rows[s][st->acc_nrows[s]++] = row;
        }
    }
}

/* Synchronous: the mean of the step's accepted gradients (acc / acc_n)
 * applied where they touched (a dense shard whole, as ever; a table's
 * shard by its rows, summed by id over the pushes), and acc zeroed there. */
static void apply_acc(ps_state *st)
{
    const ps_strategy *ps = st->ps;
    float k = 1.0f / (float)st->acc_n;
    for (int i = 0; i < ps->plan.n_shards; i++) {
        const loom_ps_shard *sh = &ps->plan.shard[i];
        if (sh->ps != st->q) continue;
        if (st->acc_whole[i] || !ps->is_table[i]) {
            for (int64_t e = sh->local; e < sh->local + sh->count; e++) st->grads[e] = st->acc[e] * k;
            apply_shard(st, i, NULL, 0);
            memset(st->acc + sh->local, 0, (size_t)sh->count * sizeof(float));
        } else if (st->acc_nrows[i]) {
            for (int64_t j = 0; j < st->acc_nrows[i]; j++) {
                int64_t lo = sh->local + st->acc_rows[i][j] * sh->row_size;
                for (int64_t e = lo; e < lo + sh->row_size; e++) st->grads[e] = st->acc[e] * k;
            }
            apply_shard(st, i, st->acc_rows[i], st->acc_nrows[i]);
            for (int64_t j = 0; j < st->acc_nrows[i]; j++) {
                int64_t lo = sh->local + st->acc_rows[i][j] * sh->row_size;
                memset(st->acc + lo, 0, (size_t)sh->row_size * sizeof(float));
            }
        }
        if (st->acc_mark[i])
            for (int64_t j = 0; j < st->acc_nrows[i]; j++) st->acc_mark[i][st->acc_rows[i][j]] = 0;
        st->acc_nrows[i] = 0;
        st->acc_whole[i] = false;
    }
}

static int handle_push(ps_state *st, int from, const loom_buf *msg, loom_err *err)
{
    ps_strategy *ps = st->ps;
    char who[32];
    loom_ps_peer_name_(ps, from, who, sizeof who);
    if (ps->peer_role[from] != LOOM_ROLE_WORKER)
        return refuse(st, from, "a gradient push from %s, which is not a worker of this job: only workers push", who);
    if (!st->inited) return refuse(st, from, "a gradient push before the coordinator sent the variables");
    loom_ps_msg m;
    loom_err e;
    if (loom_ps_decode_(msg->data, msg->len, &ps->plan, st->q, ps->n_slots, true, &m, &e))
        return refuse(st, from, "a gradient push that does not decode: %s", e.msg);
    if (loom_ps_test_die_now_(ps->task, ++st->pushes)) _exit(137);
    if (m.h.nonce != ps->nonce) {
        loom_ps_msg_fini_(&m);
        return refuse(st, from, "a gradient push for another run of the job (nonce %016llx, this run's is %016llx)",
                      (unsigned long long)m.h.nonce, (unsigned long long)ps->nonce);
    }
    bool accepted = true;
    if (!ps->sync) {
        take_grads(st, &m, st->grads, false);
        for (int i = 0; i < m.n; i++) {
            const loom_ps_range *r = &m.r[i];
            apply_shard(st, (int)r->shard, range_ids(st, r), r->n_rows == LOOM_PS_WHOLE ? 0 : r->n_rows);
        }
        st->step++;
        if (m.h.flags & LOOM_PS_F_PULL) { /* the new values back at once: one round trip a step */
            int rc = answer_pull(st, from, &m, true, err);
            loom_ps_msg_fini_(&m);
            return rc == LOOM_ENET ? LOOM_OK : rc;
        }
    } else if (m.h.step < st->step) { /* a gradient for a step already applied: stale */
        accepted = false;
        st->stale++;
        loom_debug("%s: dropped a stale gradient from %s for step %lld (now at step %lld; %lld dropped so far)",
                   ps->task, who, (long long)m.h.step + 1, (long long)st->step + 1, (long long)st->stale);
    } else if (m.h.step > st->step) {
        loom_ps_msg_fini_(&m);
        return refuse(st, from, "a gradient for step %lld, but this ps is at step %lld", (long long)m.h.step + 1,
                      (long long)st->step + 1);
    } else {
        take_grads(st, &m, st->acc, true);
        note_acc(st, &m);
        if (++st->acc_n >= ps->sync_n) { /* the mean of the first N, applied */
            apply_acc(st);
            st->step++;
            st->acc_n = 0;
        }
    }
    loom_ps_msg_fini_(&m);
    loom_buf b;
    loom_buf_init(&b);
    loom_ps_hdr h = {.req = m.h.req, .nonce = ps->nonce, .step = st->step, .flags = accepted ? LOOM_PS_F_ACCEPTED : 0};
    loom_ps_put_hdr_(&b, &h);
    int rc = b.failed ? loom_err_set(err, LOOM_ENOMEM, NULL, "answering a push")
                      : loom_net_send(ps->net, from, LOOM_PS_MSG_PUSHED, b.data, b.len, err);
    loom_buf_fini(&b);
    if (!rc && ps->sync) rc = flush_pulls(st, err);
    return rc == LOOM_ENET ? LOOM_OK : rc; /* the worker may be gone: its loss comes as news */
}

/* No gradient in acc (a new run of the job: a step's pushes start over). */
static void acc_reset(ps_state *st)
{
    if (st->acc) memset(st->acc, 0, (size_t)(st->L ? st->L : 1) * sizeof(float)); /* (synchronous only) */
    for (int i = 0; i < st->ps->plan.n_shards; i++) {
        if (st->acc_mark[i]) memset(st->acc_mark[i], 0, (size_t)st->ps->plan.shard[i].rows);
        st->acc_nrows[i] = 0;
        st->acc_whole[i] = false;
    }
}

static int handle_init(ps_state *st, int from, const loom_buf *msg, loom_err *err)
{
    ps_strategy *ps = st->ps;
    char who[32];
    if (ps->peer_role[from] != LOOM_ROLE_CHIEF)
        return refuse(st, from, "variables from %s: only the coordinator (chief) initialises a ps",
                      loom_ps_peer_name_(ps, from, who, sizeof who));
    loom_ps_msg m;
    int rc = loom_ps_decode_(msg->data, msg->len, &ps->plan, st->q, ps->n_slots, true, &m, err);
    if (rc) return loom_err_hint(err, "the coordinator's INIT message did not decode");
    for (int i = 0; i < m.n; i++) {
        const loom_ps_range *r = &m.r[i];
        const loom_ps_shard *sh = &ps->plan.shard[r->shard];
        int blocks = 1 + ((m.h.flags & LOOM_PS_F_SLOTS) ? ps->n_slots : 0);
        for (int k = 0; k < blocks && r->n_rows == LOOM_PS_WHOLE; k++) {
            float *dst = k == 0 ? st->params : st->slots + (size_t)(k - 1) * (size_t)st->L;
            memcpy(dst + sh->local, r->vals + (size_t)k * (size_t)r->n_vals * sizeof(float),
                   (size_t)sh->count * sizeof(float));
        }
    }
    st->step = m.h.step;
    ps->nonce = m.h.nonce;
    st->acc_n = 0;
    acc_reset(st);
    st->inited = true;
    loom_ps_hdr h = {.req = m.h.req, .nonce = ps->nonce, .step = st->step};
    loom_ps_msg_fini_(&m);
    loom_buf b;
    loom_buf_init(&b);
    loom_ps_put_hdr_(&b, &h);
    loom_buf_put_u64(&b, (uint64_t)st->alloc_bytes); /* what this ps holds, for the coordinator's log */
    loom_buf_put_u64(&b, (uint64_t)st->rss_ready);
    loom_buf_put_u64(&b, (uint64_t)resident("VmHWM"));
    rc = loom_net_send(ps->net, from, LOOM_PS_MSG_INIT_OK, b.data, b.len, err);
    loom_buf_fini(&b);
    return rc ? rc : flush_pulls(st, err);
}

/* SAVE: every shard this ps holds, with its slots, into its file of the
 * checkpoint (ps_internal.h), then SAVED with the file's size and CRC. */
static int handle_save(ps_state *st, int from, const loom_buf *msg, loom_err *err)
{
    ps_strategy *ps = st->ps;
    char who[32], dir[LOOM_PATH_MAX];
    loom_ps_peer_name_(ps, from, who, sizeof who);
    if (ps->peer_role[from] != LOOM_ROLE_CHIEF)
        return refuse(st, from, "a checkpoint request from %s: only the coordinator (chief) saves", who);
    if (!st->inited) return refuse(st, from, "a checkpoint request before the coordinator sent the variables");
    loom_ps_hdr h;
    loom_err e;
    if (loom_ps_decode_save_(msg->data, msg->len, &h, dir, sizeof dir, &e))
        return refuse(st, from, "a checkpoint request that does not decode: %s", e.msg);
    if (h.nonce != ps->nonce)
        return refuse(st, from, "a checkpoint request of another run of the job (nonce %016llx, this run's is %016llx)",
                      (unsigned long long)h.nonce, (unsigned long long)ps->nonce);
    LOOM_ASSERT(ps->write_ckpt);
    if (loom_ps_test_save_die_now_(ps->task, "before", h.step)) _exit(137);
    int per = 1 + ps->n_slots, n = 0;
    for (int i = 0; i < ps->plan.n_shards; i++) n += (ps->plan.shard[i].ps == st->q) * per;
    loom_ckpt_tensor *t = loom_calloc((size_t)(n ? n : 1), sizeof *t);
    char (*names)[160] = loom_calloc((size_t)(n ? n : 1), sizeof *names);
    if (!t || !names) {
        loom_free(t);
        loom_free(names);
        return loom_err_set(err, LOOM_ENOMEM, ps->task, "listing the %d tensors of a checkpoint", n);
    }
    int k = 0;
    for (int i = 0; i < ps->plan.n_shards; i++) {
        const loom_ps_shard *sh = &ps->plan.shard[i];
        if (sh->ps != st->q) continue;
        loom_shape shape = ps->pi[sh->var].shape;
        if (shape.rank) shape.dim[0] = sh->rows;
        char rec[128];
        loom_ps_record_name_(&ps->plan, ps->pi, i, rec, sizeof rec);
        for (int b = 0; b < per; b++, k++) {
            if (b == 0) snprintf(names[k], sizeof names[k], "%s", rec);
            else snprintf(names[k], sizeof names[k], "%s/%s", rec, loom_optimizer_slot_name(st->opt, b - 1));
            t[k] = (loom_ckpt_tensor){.name = names[k], .shape = shape,
                                      .data = (b == 0 ? st->params : st->slots + (size_t)(b - 1) * (size_t)st->L) + sh->local};
        }
    }
    char name[128], path[LOOM_PATH_MAX + 160];
    snprintf(name, sizeof name, "ckpt-%lld.data-%05d-of-%05d", (long long)h.step, st->q, ps->n_ps);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    loom_ckpt_shard_meta meta = {.step = h.step, .ps = st->q, .n_ps = ps->n_ps, .plan_id = ps->plan_id};
    uint64_t size = 0;
    uint32_t crc = 0;
    int rc = ps->write_ckpt(path, &meta, t, n, &size, &crc, &e);
    loom_free(t);
    loom_free(names);
    if (rc) return refuse(st, from, "cannot write its shard of the checkpoint of step %lld: %s: %s", (long long)h.step,
                          e.where, e.msg);
    if (loom_ps_test_save_die_now_(ps->task, "after", h.step)) _exit(137);
    loom_buf b;
    loom_buf_init(&b);
    loom_ps_hdr out = {.req = h.req, .nonce = ps->nonce, .step = h.step};
    loom_ps_put_saved_(&b, &out, size, crc, name);
    rc = b.failed ? loom_err_set(err, LOOM_ENOMEM, NULL, "answering a checkpoint request")
                  : loom_net_send(ps->net, from, LOOM_PS_MSG_SAVED, b.data, b.len, err);
    loom_buf_fini(&b);
    return rc;
}

static void ps_state_fini(ps_state *st)
{
    for (int i = 0; i < st->ps->plan.n_shards; i++) {
        if (st->acc_rows) loom_free(st->acc_rows[i]);
        if (st->acc_mark) loom_free(st->acc_mark[i]);
    }
    loom_free(st->acc_rows);
    loom_free(st->acc_mark);
    loom_free(st->acc_nrows);
    loom_free(st->acc_whole);
    loom_free(st->ids);
    loom_free(st->iota);
    loom_free(st->params);
    loom_free(st->grads);
    loom_free(st->acc);
    loom_optimizer_free(st->opt);
    for (int i = 0; i < st->n_pend; i++) loom_buf_fini(&st->pend[i].msg);
    loom_free(st->pend);
}

/* The row lists of a ps: ids and iota as long as its longest shard (a
 * table's), and (sync) the rows each table shard's acc holds. */
static int ps_rows_alloc(ps_state *st, loom_err *err)
{
    const ps_strategy *ps = st->ps;
    int n = ps->plan.n_shards ? ps->plan.n_shards : 1;
    int64_t most = 1;
    for (int i = 0; i < ps->plan.n_shards; i++)
        if (ps->plan.shard[i].ps == st->q && ps->plan.shard[i].rows > most) most = ps->plan.shard[i].rows;
    st->ids = loom_alloc((size_t)most * sizeof *st->ids);
    st->iota = loom_alloc((size_t)most * sizeof *st->iota);
    st->acc_whole = loom_calloc((size_t)n, sizeof *st->acc_whole);
    st->acc_nrows = loom_calloc((size_t)n, sizeof *st->acc_nrows);
    st->acc_rows = loom_calloc((size_t)n, sizeof *st->acc_rows);
    st->acc_mark = loom_calloc((size_t)n, sizeof *st->acc_mark);
    if (!st->ids || !st->iota || !st->acc_whole || !st->acc_nrows || !st->acc_rows || !st->acc_mark)
        return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating the row lists of %s", ps->task);
    for (int64_t j = 0; j < most; j++) st->iota[j] = j;
    for (int i = 0; i < ps->plan.n_shards && ps->sync; i++) {
        const loom_ps_shard *sh = &ps->plan.shard[i];
        if (sh->ps != st->q || !ps->is_table[i]) continue;
        st->acc_rows[i] = loom_alloc((size_t)(sh->rows ? sh->rows : 1) * sizeof **st->acc_rows);
        st->acc_mark[i] = loom_calloc((size_t)(sh->rows ? sh->rows : 1), 1);
        if (!st->acc_rows[i] || !st->acc_mark[i])
            return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating the row lists of %s", ps->task);
    }
    return LOOM_OK;
}

int loom_ps_serve_loop_(ps_strategy *ps, const loom_spec *spec, loom_err *err)
{
    ps_state st = {.ps = ps, .q = ps->index};
    st.L = ps->plan.ps_floats[st.q];
    size_t L = (size_t)(st.L ? st.L : 1);
    st.params = loom_alloc_aligned(L * sizeof(float));
    st.grads = loom_alloc_aligned(L * sizeof(float));
    st.acc = ps->sync ? loom_alloc_aligned(L * sizeof(float)) : NULL; /* the sum of a synchronous step's gradients */
    loom_optimizer_spec os = spec->optimizer;
    os.clip_norm = 0; /* the workers clip their gradients (clip_grads): no ps sees them all */
    int rc = loom_optimizer_new(&st.opt, &os, st.L ? st.L : 1, err);
    if (!rc && (!st.params || !st.grads || (ps->sync && !st.acc)))
        rc = loom_err_set(err, LOOM_ENOMEM, NULL, "allocating %lld floats of variables on %s", (long long)st.L, ps->task);
    if (rc) {
        ps_state_fini(&st);
        return rc;
    }
    if ((rc = ps_rows_alloc(&st, err))) {
        ps_state_fini(&st);
        return rc;
    }
    memset(st.params, 0, L * sizeof(float));
    memset(st.grads, 0, L * sizeof(float));
    acc_reset(&st);
    st.slots = ps->n_slots ? loom_optimizer_slots(st.opt) : NULL;
    st.alloc_bytes = (int64_t)L * (int64_t)sizeof(float) * (2 + ps->sync + ps->n_slots);
    st.rss_ready = resident("VmRSS");
    loom_buf msg;
    loom_buf_init(&msg);
    for (;;) {
        int from;
        uint32_t type;
        rc = loom_ps_recv_or_stop_(ps, -1, LOOM_MSG_PEER_DOWN, LOOM_PS_MSG_LAST, &from, &type, &msg, err);
        if (rc) break;
        char who[32];
        loom_ps_peer_name_(ps, from, who, sizeof who);
        if (type == LOOM_MSG_PEER_DOWN) {
            loom_info("%s: lost %s; its pulls are dropped, it may come back", ps->task, who);
            int keep = 0;
            for (int i = 0; i < st.n_pend; i++)
                if (st.pend[i].from == from) loom_buf_fini(&st.pend[i].msg);
                else st.pend[keep++] = st.pend[i];
            st.n_pend = keep;
            continue;
        }
        if (type == LOOM_MSG_PEER_UP) {
            loom_info("%s: %s is back", ps->task, who);
            continue;
        }
        if (type == LOOM_PS_MSG_END) {
            if (ps->peer_role[from] == LOOM_ROLE_CHIEF) break;
            refuse(&st, from, "END from %s: only the coordinator ends the job", who);
            continue;
        }
        if (type == LOOM_PS_MSG_INIT) {
            if ((rc = handle_init(&st, from, &msg, err))) break;
        } else if (type == LOOM_PS_MSG_PUSH) {
            if ((rc = handle_push(&st, from, &msg, err))) break;
        } else if (type == LOOM_PS_MSG_SAVE) {
            if ((rc = handle_save(&st, from, &msg, err))) break;
        } else if (type == LOOM_PS_MSG_PULL) {
            loom_ps_msg m;
            loom_err e;
            if (loom_ps_decode_(msg.data, msg.len, &ps->plan, st.q, ps->n_slots, false, &m, &e)) {
                refuse(&st, from, "a pull that does not decode: %s", e.msg);
                continue;
            }
            if (!st.inited || m.h.step > st.step) { /* wait for the variables, or for the step's update */
                loom_ps_msg_fini_(&m);
                if (st.n_pend == st.cap_pend) {
                    int nc = st.cap_pend ? 2 * st.cap_pend : 8;
                    pending_pull *np = loom_realloc(st.pend, (size_t)nc * sizeof *np);
                    if (!np) {
                        rc = loom_err_set(err, LOOM_ENOMEM, NULL, "queueing a pull");
                        break;
                    }
                    st.pend = np, st.cap_pend = nc;
                }
                pending_pull *pp = &st.pend[st.n_pend++];
                pp->from = from;
                pp->min_step = m.h.step;
                pp->msg = msg;
                loom_buf_init(&msg); /* handed over */
                continue;
            }
            rc = answer_pull(&st, from, &m, false, err);
            loom_ps_msg_fini_(&m);
            if (rc == LOOM_ENET) rc = LOOM_OK; /* the puller is gone */
            if (rc) break;
        } else {
            refuse(&st, from, "an unexpected message of type %u", type);
        }
    }
    if (st.refused) /* (stale gradients are a synchronous job's routine: the coordinator reports them) */
        loom_warn("%s: %lld message%s refused (see above), %lld stale gradient%s dropped", ps->task,
                  (long long)st.refused, st.refused == 1 ? "" : "s", (long long)st.stale, st.stale == 1 ? "" : "s");
    loom_buf_fini(&msg);
    ps_state_fini(&st);
    return rc;
}
