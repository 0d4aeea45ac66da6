/* ps_wire.c - parameter_server's messages: encoders and the decoders that
 * check every count against the plan and the bytes given (ps_internal.h).
 * Pure functions; no threads. */
#include "ps_internal.h"

#include <string.h>

static uint32_t rd32(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }
static uint64_t rd64(const uint8_t *p) { return (uint64_t)rd32(p) | (uint64_t)rd32(p + 4) << 32; }

uint32_t loom_ps_row_(const loom_ps_range *r, uint32_t i) { return rd32(r->rows + 4 * (size_t)i); }

void loom_ps_put_hdr_(loom_buf *b, const loom_ps_hdr *h)
{
    loom_buf_put_u64(b, h->req);
    loom_buf_put_u64(b, h->nonce);
    loom_buf_put_i64(b, h->step);
    loom_buf_put_u32(b, h->flags);
    loom_buf_put_u32(b, h->n_ranges);
}

void loom_ps_put_range_(loom_buf *b, uint32_t shard, uint32_t n_rows, const uint32_t *rows)
{
    loom_buf_put_u32(b, shard);
    loom_buf_put_u32(b, n_rows);
    if (n_rows != LOOM_PS_WHOLE)
        for (uint32_t i = 0; i < n_rows; i++) loom_buf_put_u32(b, rows[i]);
}

void loom_ps_msg_fini_(loom_ps_msg *m)
{
    if (!m) return;
    loom_free(m->r);
    m->r = NULL;
    m->n = 0;
}

int loom_ps_decode_(const uint8_t *p, size_t len, const loom_ps_plan *plan, int ps, int n_slots, bool with_values,
                    loom_ps_msg *m, loom_err *err)
{
    memset(m, 0, sizeof *m);
    if (len < LOOM_PS_HDR)
        return loom_err_set(err, LOOM_EDATA, NULL, "a parameter-server message of %zu bytes is shorter than its "
                            "%d-byte header", len, LOOM_PS_HDR);
    m->h.req = rd64(p);
    m->h.nonce = rd64(p + 8);
    m->h.step = (int64_t)rd64(p + 16);
    m->h.flags = rd32(p + 24);
    m->h.n_ranges = rd32(p + 28);
    if (m->h.step < 0) return loom_err_set(err, LOOM_EDATA, NULL, "negative step %lld", (long long)m->h.step);
    if (m->h.flags & ~(LOOM_PS_F_SLOTS | LOOM_PS_F_ACCEPTED | LOOM_PS_F_PULL))
        return loom_err_set(err, LOOM_EDATA, NULL, "unknown flags 0x%x", m->h.flags);
    if (m->h.n_ranges > (uint32_t)plan->n_shards)
        return loom_err_set(err, LOOM_EDATA, NULL, "%u ranges, but the plan has %d shards", m->h.n_ranges,
                            plan->n_shards);
    int blocks = 1 + ((m->h.flags & LOOM_PS_F_SLOTS) ? n_slots : 0);
    if (m->h.n_ranges) {
        m->r = loom_calloc(m->h.n_ranges, sizeof *m->r);
        if (!m->r) return loom_err_set(err, LOOM_ENOMEM, NULL, "decoding %u ranges", m->h.n_ranges);
    }
    size_t pos = LOOM_PS_HDR;
    for (uint32_t i = 0; i < m->h.n_ranges; i++) {
        loom_ps_range *r = &m->r[i];
        if (len - pos < 8) goto short_msg;
        r->shard = rd32(p + pos);
        r->n_rows = rd32(p + pos + 4);
        pos += 8;
        if (r->shard >= (uint32_t)plan->n_shards) {
            loom_err_set(err, LOOM_EDATA, NULL, "range %u: shard %u does not exist (the plan has %d)", i, r->shard,
                         plan->n_shards);
            goto fail;
        }
        const loom_ps_shard *s = &plan->shard[r->shard];
        if (ps >= 0 && s->ps != ps) {
            loom_err_set(err, LOOM_EDATA, NULL, "range %u: shard %u is held by ps:%d, not ps:%d", i, r->shard, s->ps, ps);
            goto fail;
        }
        int64_t n_rows = r->n_rows == LOOM_PS_WHOLE ? s->rows : (int64_t)r->n_rows;
        if (r->n_rows != LOOM_PS_WHOLE) {
            if ((int64_t)r->n_rows > s->rows) {
                loom_err_set(err, LOOM_EDATA, NULL, "range %u: %u row ids for a shard of %lld rows", i, r->n_rows,
                             (long long)s->rows);
                goto fail;
            }
            if ((len - pos) / 4 < r->n_rows) goto short_msg;
            r->rows = p + pos;
            for (uint32_t k = 0; k < r->n_rows; k++)
                if ((int64_t)loom_ps_row_(r, k) >= s->rows) {
                    loom_err_set(err, LOOM_EDATA, NULL, "range %u: row %u is outside the shard's %lld rows", i,
                                 loom_ps_row_(r, k), (long long)s->rows);
                    goto fail;
                }
            pos += 4 * (size_t)r->n_rows;
        }
        if (with_values) {
            r->n_vals = n_rows * s->row_size;
            size_t need = (size_t)r->n_vals * sizeof(float) * (size_t)blocks;
            if (len - pos < need) goto short_msg;
            r->vals = p + pos;
            pos += need;
        }
    }
    m->n = (int)m->h.n_ranges;
    if (pos != len) {
        loom_err_set(err, LOOM_EDATA, NULL, "%zu bytes left over after %u ranges", len - pos, m->h.n_ranges);
        goto fail;
    }
    return LOOM_OK;
short_msg:
    loom_err_set(err, LOOM_EDATA, NULL, "the message ends inside its ranges (%zu bytes)", len);
fail:
    loom_ps_msg_fini_(m);
    return LOOM_EDATA;
}

void loom_ps_put_run_(loom_buf *b, const loom_ps_run *r)
{
    loom_buf_put_u64(b, r->fn);
    loom_buf_put_u64(b, r->nonce);
    loom_buf_put_i64(b, r->first);
    loom_buf_put_u32(b, r->steps);
    loom_buf_put_u32(b, r->flags);
}

int loom_ps_decode_run_(const uint8_t *p, size_t len, loom_ps_run *r, loom_err *err)
{
    if (len != 32) return loom_err_set(err, LOOM_EDATA, NULL, "a step function message of %zu bytes (expected 32)", len);
    r->fn = rd64(p);
    r->nonce = rd64(p + 8);
    r->first = (int64_t)rd64(p + 16);
    r->steps = rd32(p + 24);
    r->flags = rd32(p + 28);
    if (r->first < 0 || r->steps == 0 || r->steps > LOOM_PS_MAX_STEPS)
        return loom_err_set(err, LOOM_EDATA, NULL, "a step function of %u steps from step %lld", r->steps,
                            (long long)r->first);
    return LOOM_OK;
}

void loom_ps_put_result_(loom_buf *b, uint64_t fn, const loom_ps_step_out *s, uint32_t n)
{
    loom_buf_put_u64(b, fn);
    loom_buf_put_u32(b, n);
    for (uint32_t i = 0; i < n; i++) {
        loom_buf_put_i64(b, s[i].step);
        loom_buf_put_u32(b, s[i].accepted);
        loom_buf_put_f64(b, s[i].loss_sum);
        loom_buf_put_i64(b, s[i].correct);
        loom_buf_put_i64(b, s[i].examples);
    }
}

int loom_ps_decode_result_(const uint8_t *p, size_t len, uint64_t *fn, loom_ps_step_out **out, uint32_t *n,
                           loom_err *err)
{
    *out = NULL;
    *n = 0;
    if (len < 12) return loom_err_set(err, LOOM_EDATA, NULL, "a step result of %zu bytes", len);
    *fn = rd64(p);
    uint32_t k = rd32(p + 8);
    if (k > LOOM_PS_MAX_STEPS || len != 12 + (size_t)k * 36)
        return loom_err_set(err, LOOM_EDATA, NULL, "a step result of %zu bytes for %u steps", len, k);
    loom_ps_step_out *s = loom_calloc(k ? k : 1, sizeof *s);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, NULL, "decoding %u step results", k);
    const uint8_t *q = p + 12;
    for (uint32_t i = 0; i < k; i++, q += 36) {
        uint64_t d = rd64(q + 12);
        s[i].step = (int64_t)rd64(q);
        s[i].accepted = rd32(q + 8);
        memcpy(&s[i].loss_sum, &d, sizeof d);
        s[i].correct = (int64_t)rd64(q + 20);
        s[i].examples = (int64_t)rd64(q + 28);
        if (s[i].step < 0 || s[i].examples < 0 || s[i].correct < 0 || s[i].correct > s[i].examples) {
            loom_err_set(err, LOOM_EDATA, NULL, "step result %u is out of range (step %lld, %lld of %lld correct)", i,
                         (long long)s[i].step, (long long)s[i].correct, (long long)s[i].examples);
            loom_free(s);
            return LOOM_EDATA;
        }
    }
    *out = s;
    *n = k;
    return LOOM_OK;
}

/* A u32 length and that many bytes of text (no NUL inside) at p + *pos, into dst. */
static int get_text(const uint8_t *p, size_t len, size_t *pos, char *dst, size_t n, const char *what, loom_err *err)
{
    if (len - *pos < 4) return loom_err_set(err, LOOM_EDATA, NULL, "a %s message ends before its %s", "checkpoint", what);
    uint32_t l = rd32(p + *pos);
    *pos += 4;
    if (l == 0 || l >= n || len - *pos < l || memchr(p + *pos, 0, l))
        return loom_err_set(err, LOOM_EDATA, NULL, "a checkpoint message's %s of %u bytes (%zu left, at most %zu)", what,
                            l, len - *pos, n - 1);
    memcpy(dst, p + *pos, l);
    dst[l] = 0;
    *pos += l;
    return LOOM_OK;
}

static int get_hdr(const uint8_t *p, size_t len, loom_ps_hdr *h, loom_err *err)
{
    if (len < LOOM_PS_HDR) return loom_err_set(err, LOOM_EDATA, NULL, "a checkpoint message of %zu bytes", len);
    h->req = rd64(p);
    h->nonce = rd64(p + 8);
    h->step = (int64_t)rd64(p + 16);
    h->flags = rd32(p + 24);
    h->n_ranges = rd32(p + 28);
    if (h->step < 0 || h->flags || h->n_ranges)
        return loom_err_set(err, LOOM_EDATA, NULL, "a checkpoint message for step %lld with flags 0x%x and %u ranges",
                            (long long)h->step, h->flags, h->n_ranges);
    return LOOM_OK;
}

void loom_ps_put_save_(loom_buf *b, const loom_ps_hdr *h, const char *dir)
{
    loom_ps_put_hdr_(b, h);
    loom_buf_put_str(b, dir);
}

int loom_ps_decode_save_(const uint8_t *p, size_t len, loom_ps_hdr *h, char *dir, size_t n, loom_err *err)
{
    size_t pos = LOOM_PS_HDR;
    int rc = get_hdr(p, len, h, err);
    if (!rc) rc = get_text(p, len, &pos, dir, n, "directory", err);
    if (!rc && pos != len) rc = loom_err_set(err, LOOM_EDATA, NULL, "%zu bytes after a SAVE message", len - pos);
    if (!rc && dir[0] != '/') rc = loom_err_set(err, LOOM_EDATA, NULL, "SAVE into \"%s\", not an absolute path", dir);
    return rc;
}

void loom_ps_put_saved_(loom_buf *b, const loom_ps_hdr *h, uint64_t size, uint32_t crc, const char *name)
{
    loom_ps_put_hdr_(b, h);
    loom_buf_put_u64(b, size);
    loom_buf_put_u32(b, crc);
    loom_buf_put_str(b, name);
}

int loom_ps_decode_saved_(const uint8_t *p, size_t len, loom_ps_hdr *h, uint64_t *size, uint32_t *crc, char *name,
                          size_t n, loom_err *err)
{
    int rc = get_hdr(p, len, h, err);
    if (rc) return rc;
    if (len < LOOM_PS_HDR + 12) return loom_err_set(err, LOOM_EDATA, NULL, "a SAVED message of %zu bytes", len);
    *size = rd64(p + LOOM_PS_HDR);
    *crc = rd32(p + LOOM_PS_HDR + 8);
    size_t pos = LOOM_PS_HDR + 12;
    if ((rc = get_text(p, len, &pos, name, n, "file name", err))) return rc;
    if (pos != len) return loom_err_set(err, LOOM_EDATA, NULL, "%zu bytes after a SAVED message", len - pos);
    if (strchr(name, '/') || name[0] == '.')
        return loom_err_set(err, LOOM_EDATA, NULL, "SAVED names \"%s\", not a file of the model directory", name);
    return LOOM_OK;
}
