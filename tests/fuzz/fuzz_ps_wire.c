/* fuzz_ps_wire.c - libFuzzer target for parameter_server's message decoders
 * (appliance/distribute/ps_wire.c): the range messages (PULL, PUSH, VALUES,
 * INIT) against a fixed plan, the step function (RUN) and its RESULT, a
 * checkpoint's SAVE and SAVED (mode 3 with bit 7 set; bit 6: SAVED).
 * Built and run by tests/fuzz/run.sh (meson test --suite fuzz).
 * The input's first byte picks the decoder and its settings (which ps reads
 * it, values or not, how many slots); the rest is the message.
 * Invariants: no read past the bytes (ASan); an accepted range message names
 * only shards of the plan (held by that ps), rows inside them, and exactly
 * as many value bytes as it has; it re-encodes to the same bytes. An
 * accepted result re-encodes to the same bytes. */
#include "distribute/ps_internal.h"

#include <stdlib.h>
#include <string.h>

#define CHECK(c) do { if (!(c)) __builtin_trap(); } while (0)

static loom_ps_plan plan;
static int plan_ready;

static void make_plan(void)
{
    /* a (13, 4) kernel, its (4,) bias and a (7, 3) table, 5 fixed shards, 3 ps */
    loom_param_info v[3];
    memset(v, 0, sizeof v);
    int64_t d0[2] = {13, 4}, d1[1] = {4}, d2[2] = {7, 3};
    v[0].shape = loom_shape_make(2, d0), v[0].offset = 0;
    v[1].shape = loom_shape_make(1, d1), v[1].offset = 52;
    v[2].shape = loom_shape_make(2, d2), v[2].offset = 56;
    loom_partitioner_spec p = {.kind = LOOM_PARTITIONER_FIXED, .num_shards = 5};
    loom_err err;
    CHECK(loom_ps_plan_make_(&plan, v, 3, 3, &p, "fuzz", &err) == LOOM_OK);
    plan_ready = 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!plan_ready) make_plan();
    if (size < 1) return 0;
    uint8_t mode = data[0];
    data++, size--;
    uint8_t *buf = malloc(size ? size : 1); /* exact size: ASan sees any over-read */
    memcpy(buf, data, size);
    loom_err err = {0};
    if ((mode & 3) == 0 || (mode & 3) == 1) {
        int ps = (int)((mode >> 2) & 3) - 1; /* -1 .. 2 */
        bool values = mode & 16;
        int slots = (mode >> 5) & 3;
        loom_ps_msg m;
        int rc = loom_ps_decode_(buf, size, &plan, ps, slots, values, &m, &err);
        if (rc) {
            CHECK(err.msg[0]);
        } else {
            loom_buf b;
            loom_buf_init(&b);
            loom_ps_hdr h = m.h;
            loom_ps_put_hdr_(&b, &h);
            int blocks = 1 + ((m.h.flags & LOOM_PS_F_SLOTS) ? slots : 0);
            for (int i = 0; i < m.n; i++) {
                const loom_ps_range *r = &m.r[i];
                CHECK(r->shard < (uint32_t)plan.n_shards);
                const loom_ps_shard *s = &plan.shard[r->shard];
                CHECK(ps < 0 || s->ps == ps);
                uint32_t *rows = NULL;
                if (r->n_rows != LOOM_PS_WHOLE) {
                    CHECK((int64_t)r->n_rows <= s->rows);
                    rows = malloc((r->n_rows ? r->n_rows : 1) * sizeof *rows);
                    for (uint32_t k = 0; k < r->n_rows; k++) {
                        rows[k] = loom_ps_row_(r, k);
                        CHECK((int64_t)rows[k] < s->rows);
                    }
                }
                loom_ps_put_range_(&b, r->shard, r->n_rows, rows);
                free(rows);
                if (values) {
                    CHECK(r->n_vals == (r->n_rows == LOOM_PS_WHOLE ? s->count : (int64_t)r->n_rows * s->row_size));
                    loom_buf_put(&b, r->vals, (size_t)r->n_vals * sizeof(float) * (size_t)blocks);
                } else {
                    CHECK(!r->vals);
                }
            }
            CHECK(!b.failed && b.len == size && !memcmp(b.data, buf, size));
            loom_buf_fini(&b);
            loom_ps_msg_fini_(&m);
        }
    } else if ((mode & 3) == 2) {
        loom_ps_run r;
        if (loom_ps_decode_run_(buf, size, &r, &err) == LOOM_OK) {
            CHECK(r.steps >= 1 && r.steps <= LOOM_PS_MAX_STEPS && r.first >= 0);
            loom_buf b;
            loom_buf_init(&b);
            loom_ps_put_run_(&b, &r);
            CHECK(b.len == size && !memcmp(b.data, buf, size));
            loom_buf_fini(&b);
        }
    } else if (mode & 0x80) { /* a checkpoint's SAVE (bit 6 clear) or SAVED */
        loom_ps_hdr h;
        char text[512];
        uint64_t fsize;
        uint32_t crc;
        loom_buf b;
        loom_buf_init(&b);
        if (!(mode & 0x40) && loom_ps_decode_save_(buf, size, &h, text, sizeof text, &err) == LOOM_OK) {
            CHECK(text[0] == '/' && h.step >= 0);
            loom_ps_put_save_(&b, &h, text);
            CHECK(b.len == size && !memcmp(b.data, buf, size));
        } else if ((mode & 0x40) &&
                   loom_ps_decode_saved_(buf, size, &h, &fsize, &crc, text, sizeof text, &err) == LOOM_OK) {
            CHECK(text[0] && !strchr(text, '/') && text[0] != '.');
            loom_ps_put_saved_(&b, &h, fsize, crc, text);
            CHECK(b.len == size && !memcmp(b.data, buf, size));
        } else {
            CHECK(err.msg[0]);
        }
        loom_buf_fini(&b);
    } else {
        uint64_t fn;
        loom_ps_step_out *o;
        uint32_t n;
        if (loom_ps_decode_result_(buf, size, &fn, &o, &n, &err) == LOOM_OK) {
            loom_buf b;
            loom_buf_init(&b);
            loom_ps_put_result_(&b, fn, o, n);
            CHECK(b.len == size && !memcmp(b.data, buf, size));
            for (uint32_t i = 0; i < n; i++) CHECK(o[i].correct <= o[i].examples);
            loom_buf_fini(&b);
            loom_free(o);
        } else {
            CHECK(err.msg[0]);
        }
    }
    free(buf);
    return 0;
}
