/* ps_ckpt.c - parameter_server's checkpoints and restore on the chief: the
 * iterator state that records the ps count and the partitioning (a restore
 * onto another is refused), and the sharded checkpoints, where each ps writes
 * its own shard file and the chief commits the index (ps_internal.h,
 * "Checkpoints"; the seams distribute.c calls). */
#include "ps_internal.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define ITER_MAGIC  0x53505350u /* "PSPS": the chief's iterator state with the ps count */
#define ITER_MAGIC2 0x32505350u /* "PSP2": ... the ps count, the shard count and the plan id */

/* A checkpoint: the variables back from the ps tasks (and their slots,
 * when the chief writes the checkpoint whole; with sharded checkpoints each
 * ps writes its own), then the chief's iterator state with the ps count and
 * the partitioning. */
int loom_ps_gather_iter_state_(loom_strategy *s, const loom_buf *mine, loom_buf *stored, loom_err *err)
{
    ps_strategy *ps = s->impl;
    loom_buf_init(stored);
    if (ps->net && !ps->need_init) {
        int rc = loom_ps_fetch_(ps, !ps->write_ckpt, err);
        if (rc) return rc;
    }
    loom_buf_put_u32(stored, ITER_MAGIC2);
    loom_buf_put_u32(stored, (uint32_t)ps->n_ps);
    loom_buf_put_u32(stored, (uint32_t)ps->plan.n_shards);
    loom_buf_put_u64(stored, ps->plan_id);
    loom_buf_put(stored, mine->data, mine->len);
    return stored->failed ? loom_err_set(err, LOOM_ENOMEM, NULL, "packing the iterator state") : LOOM_OK;
}

int loom_ps_pick_iter_state_(loom_strategy *s, const loom_buf *stored, loom_buf *mine, loom_err *err)
{
    ps_strategy *ps = s->impl;
    loom_buf_init(mine);
    loom_buf b = *stored;
    b.pos = 0;
    b.failed = 0;
    uint32_t magic = stored->len >= 8 ? loom_buf_get_u32(&b) : 0;
    if (magic != ITER_MAGIC && !(magic == ITER_MAGIC2 && stored->len >= 20))
        return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "the checkpoint was not written by parameter_server training: "
                            "it holds no ps count"),
               loom_err_hint(err, "resume it with the strategy that wrote it, or pass --fresh");
    uint32_t n = loom_buf_get_u32(&b);
    if ((int)n != ps->n_ps)
        return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "the checkpoint was written by a job of %u ps task%s, this job "
                            "has %d: its shards restore only onto the same number of ps tasks", n, n == 1 ? "" : "s",
                            ps->n_ps),
               loom_err_hint(err, "run the job with %u ps task%s (loom launch --ps %u), or pass --fresh to start over",
                             n, n == 1 ? "" : "s", n);
    if (magic == ITER_MAGIC2) { /* the partitioning too (TF: the shard count must not change) */
        uint32_t shards = loom_buf_get_u32(&b);
        uint64_t id = loom_buf_get_u64(&b);
        if (id != ps->plan_id)
            return loom_err_set(err, LOOM_ECHECKPOINT, NULL, "the checkpoint's variables were cut into %u shard%s over "
                                "%u ps task%s by another partitioning (plan %016llx); this job cuts them into %d over %d "
                                "(plan %016llx): shards restore only onto the partitioning that wrote them", shards,
                                shards == 1 ? "" : "s", n, n == 1 ? "" : "s", (unsigned long long)id, ps->plan.n_shards,
                                ps->n_ps, (unsigned long long)ps->plan_id),
                   loom_err_hint(err, "run it with the model and strategy.variable_partitioner that wrote it (loom "
                                 "check prints the shards), or pass --fresh to start over");
    }
    loom_buf_put(mine, b.data + b.pos, b.len - b.pos);
    return mine->failed ? loom_err_set(err, LOOM_ENOMEM, NULL, "copying the iterator state") : LOOM_OK;
}

/* ---- sharded checkpoints (distribute.h; the seams distribute.c calls) ---- */

bool loom_ps_saves_shards_(loom_strategy *s)
{
    ps_strategy *ps = s->impl;
    return ps->net && ps->write_ckpt && ps->role == LOOM_ROLE_CHIEF;
}

void loom_ps_set_ckpt_writer_(loom_strategy *s, loom_ckpt_write_fn fn) { ((ps_strategy *)s->impl)->write_ckpt = fn; }

int loom_ps_save_shards_(loom_strategy *s, const char *dir, int64_t step, loom_ckpt_shards *out, loom_err *err)
{
    ps_strategy *ps = s->impl;
    memset(out, 0, sizeof *out);
    char abs[PATH_MAX];
    if (dir[0] != '/') { /* the ps tasks need the directory itself, whatever their working directory */
        if (!realpath(dir, abs))
            return loom_err_set(err, LOOM_EIO, dir, "cannot resolve the model directory: %s", strerror(errno));
        dir = abs;
    }
    if (strlen(dir) >= LOOM_PATH_MAX)
        return loom_err_set(err, LOOM_EIO, dir, "the model directory's path is longer than %d bytes", LOOM_PATH_MAX - 1);
    int rc = ps->need_init ? loom_ps_init_tasks_(ps, step, err) : loom_ps_quiesce_(ps, err); /* the variables at rest */
    if (rc) return rc;
    out->file = loom_calloc((size_t)ps->n_ps, sizeof *out->file);
    out->part = loom_calloc((size_t)(ps->plan.n_shards ? ps->plan.n_shards : 1), sizeof *out->part);
    if (!out->file || !out->part) {
        loom_ckpt_shards_fini(out);
        return loom_err_set(err, LOOM_ENOMEM, NULL, "listing the shards of a checkpoint");
    }
    out->n_ps = out->n_files = ps->n_ps;
    out->plan_id = ps->plan_id;
    loom_buf b;
    loom_buf_init(&b);
    uint64_t req = ++ps->req;
    loom_ps_hdr h = {.req = req, .nonce = ps->nonce, .step = step};
    loom_ps_put_save_(&b, &h, dir);
    for (int q = 0; q < ps->n_ps && !rc; q++)
        rc = b.failed ? loom_err_set(err, LOOM_ENOMEM, NULL, "building a checkpoint request")
                      : loom_net_send(ps->net, ps->peer_ps[q], LOOM_PS_MSG_SAVE, b.data, b.len, err);
    for (int q = 0; q < ps->n_ps && !rc; q++) {
        int from;
        uint32_t type;
        char who[32];
        for (;;) { /* (a late answer to an abandoned request is skipped) */
            rc = loom_net_recv(ps->net, ps->peer_ps[q], LOOM_PS_MSG_REFUSED, LOOM_PS_MSG_SAVED, &from, &type, &b, -1, err);
            if (rc) break;
            if (type == LOOM_PS_MSG_REFUSED) {
                rc = loom_ps_refused_(ps, from, &b, err);
                break;
            }
            if (type != LOOM_PS_MSG_SAVED) continue;
            loom_ckpt_shard_file *f = &out->file[q];
            loom_ps_hdr got;
            if ((rc = loom_ps_decode_saved_(b.data, b.len, &got, &f->size, &f->crc, f->name, sizeof f->name, err))) {
                loom_err_hint(err, "the answer of %s to a checkpoint request did not decode",
                              loom_ps_peer_name_(ps, from, who, sizeof who));
                break;
            }
            if (got.req != req) continue;
            f->ps = q;
            break;
        }
        if (rc) break;
        /* the index refers to the file by name in dir: this task must see it there */
        char path[PATH_MAX + 160];
        snprintf(path, sizeof path, "%s/%s", dir, out->file[q].name);
        struct stat sb;
        int missing = stat(path, &sb) < 0 ? errno : 0;
        if (missing || (uint64_t)sb.st_size != out->file[q].size) {
            rc = loom_err_set(err, LOOM_EIO, path, "ps:%d wrote its shard of the checkpoint of step %lld here (%llu "
                              "bytes), but the coordinator %s%s", q, (long long)step,
                              (unsigned long long)out->file[q].size, missing ? "cannot see it: " : "sees another size",
                              missing ? strerror(missing) : "");
            loom_err_hint(err, "run.model_dir must be one directory that every task of the job shares (the same "
                               "path on a shared file system); the index the chief writes names the ps tasks' files");
        }
    }
    loom_buf_fini(&b);
    for (int i = 0; i < ps->plan.n_shards && !rc; i++) {
        const loom_ps_shard *sh = &ps->plan.shard[i];
        loom_ckpt_part *p = &out->part[out->n_parts++];
        snprintf(p->var, sizeof p->var, "%s", ps->pi[sh->var].name);
        loom_ps_record_name_(&ps->plan, ps->pi, i, p->record, sizeof p->record);
        p->file = sh->ps;
        p->row0 = sh->row0;
        p->rows = sh->rows;
    }
    if (rc) loom_ckpt_shards_fini(out);
    if (!rc && loom_ps_test_save_die_now_(ps->task, "index", step)) _exit(137);
    return rc;
}
