/* test_ps.c - parameter_server's placement (TF's partitioner arithmetic and
 * round-robin, tf_semantics 5.8) and its message codec (whole shards and row
 * subsets; every malformed message refused). The multi-process behaviour is
 * tests/integration/parameter_server.sh. */
#include "distribute/ps_internal.h"
#include "harness.h"

static loom_partitioner_spec part(loom_partitioner_kind k, int64_t num, int64_t min_b, int64_t max_b, int64_t max_s)
{
    loom_partitioner_spec p = {.kind = k, .num_shards = num, .min_shard_bytes = min_b, .max_shard_bytes = max_b,
                               .max_shards = max_s};
    return p;
}

/* TF's docstring examples (tf.distribute.experimental.partitioners) and the 13-over-5 split. */
static void test_partitioner_numbers(void)
{
    loom_partitioner_spec fixed2 = part(LOOM_PARTITIONER_FIXED, 2, 0, 0, 0);
    CHECK(loom_ps_num_shards_(&fixed2, 10, 30) == 2);            /* FixedShardsPartitioner(2)([10, 3]) = [2, 1] */
    loom_partitioner_spec fixed5 = part(LOOM_PARTITIONER_FIXED, 5, 0, 0, 0);
    CHECK(loom_ps_num_shards_(&fixed5, 13, 13) == 5);
    CHECK(loom_ps_num_shards_(&fixed5, 3, 3) == 3);              /* capped at the rows */
    loom_partitioner_spec min4 = part(LOOM_PARTITIONER_MIN_SIZE, 0, 4, 0, 2);
    CHECK(loom_ps_num_shards_(&min4, 6, 6) == 2);                /* MinSizePartitioner(4, 2)([6, 1]) = [2, 1] */
    loom_partitioner_spec min256 = part(LOOM_PARTITIONER_MIN_SIZE, 0, 256 << 10, 0, 4);
    CHECK(loom_ps_num_shards_(&min256, 1000, 128000) == 2);      /* 512000 bytes over 256 KiB */
    CHECK(loom_ps_num_shards_(&min256, 100, 1000) == 1);
    loom_partitioner_spec max4 = part(LOOM_PARTITIONER_MAX_SIZE, 0, 0, 4, 0);
    CHECK(loom_ps_num_shards_(&max4, 6, 6) == 6);                /* MaxSizePartitioner(4)([6, 1]) = [6, 1] */
    loom_partitioner_spec max4_2 = part(LOOM_PARTITIONER_MAX_SIZE, 0, 0, 4, 2);
    CHECK(loom_ps_num_shards_(&max4_2, 6, 6) == 2);              /* ... max_shards = 2: [2, 1] */
    loom_partitioner_spec max1k = part(LOOM_PARTITIONER_MAX_SIZE, 0, 0, 1024, 0);
    CHECK(loom_ps_num_shards_(&max1k, 6, 6) == 1);               /* MaxSizePartitioner(1024)([6, 1]) = [1, 1] */
    CHECK(loom_ps_num_shards_(NULL, 784, 784 * 64) == 1);
    int64_t want[5] = {3, 3, 3, 2, 2}, next = 0;
    for (int i = 0; i < 5; i++) {
        int64_t r0, n;
        loom_ps_shard_rows_(13, 5, i, &r0, &n);
        CHECK_MSG(n == want[i] && r0 == next, "shard %d: rows %lld from %lld", i, (long long)n, (long long)r0);
        next += n;
    }
}

static loom_param_info pinfo(const char *name, int64_t off, int rank, int64_t d0, int64_t d1)
{
    loom_param_info p = {.offset = off};
    snprintf(p.name, sizeof p.name, "%s", name);
    int64_t dims[2] = {d0, d1};
    p.shape = loom_shape_make(rank, dims);
    return p;
}

/* The MLP's four variables over 2 ps: whole ones round-robin; split ones
 * take the ps in turn shard after shard, the counter running on. */
static void test_round_robin(void)
{
    loom_param_info v[4] = {pinfo("d1/kernel", 0, 2, 13, 4), pinfo("d1/bias", 52, 1, 4, 0),
                            pinfo("d2/kernel", 56, 2, 4, 3), pinfo("d2/bias", 68, 1, 3, 0)};
    loom_ps_plan p;
    loom_err err = {0};
    CHECK(loom_ps_plan_make_(&p, v, 4, 2, NULL, "x", &err) == LOOM_OK);
    CHECK(p.n_shards == 4);
    for (int i = 0; i < 4; i++) CHECK(p.shard[i].ps == i % 2 && p.shard[i].of == 1);
    CHECK(p.ps_floats[0] == 52 + 12 && p.ps_floats[1] == 4 + 3);
    CHECK(p.shard[2].local == 52); /* d2/kernel after d1/kernel on ps:0 */
    loom_ps_plan_free_(&p);

    loom_partitioner_spec f5 = part(LOOM_PARTITIONER_FIXED, 5, 0, 0, 0);
    CHECK(loom_ps_plan_make_(&p, v, 4, 3, &f5, "x", &err) == LOOM_OK);
    /* d1/kernel: 5 shards (3,3,3,2,2 rows); d1/bias 4, d2/kernel 4, d2/bias 3 (capped) */
    CHECK(p.n_shards == 5 + 4 + 4 + 3);
    CHECK(p.n_capped == 3);
    int64_t rows[5] = {3, 3, 3, 2, 2};
    for (int i = 0; i < 5; i++) {
        CHECK(p.shard[i].rows == rows[i] && p.shard[i].row_size == 4);
        CHECK(p.shard[i].ps == i % 3);
    }
    CHECK(p.shard[5].ps == 5 % 3); /* the counter runs on into the next variable */
    CHECK(p.shard[3].offset == 9 * 4 && p.shard[3].count == 2 * 4);
    int64_t total = 0;
    for (int q = 0; q < 3; q++) total += p.ps_floats[q];
    CHECK(total == 71);
    char buf[4096] = "";
    FILE *f = fmemopen(buf, sizeof buf, "w");
    loom_ps_plan_print_(&p, v, 1, f);
    fclose(f);
    CHECK_CONTAINS(buf, "d1/kernel (13, 4) shard 4/5: rows 9..10 (2 rows)");
    CHECK_CONTAINS(buf, "ps:0 holds");
    CHECK_CONTAINS(buf, "optimizer slots beside them");
    loom_ps_plan_free_(&p);

    loom_partitioner_spec f20 = part(LOOM_PARTITIONER_FIXED, 20, 0, 0, 0);
    CHECK(loom_ps_plan_make_(&p, v, 4, 2, &f20, "cfg.cfg:7", &err) == LOOM_ECONFIG);
    CHECK_CONTAINS(err.msg, "num_shards = 20, but the largest variable, d1/kernel, has 13 rows");
    CHECK_CONTAINS(err.where, "cfg.cfg:7");
}

/* A plan of one variable (5 rows of 2) in 2 shards on 2 ps. */
static void small_plan(loom_ps_plan *p)
{
    loom_param_info v = pinfo("emb", 0, 2, 5, 2);
    loom_partitioner_spec f2 = part(LOOM_PARTITIONER_FIXED, 2, 0, 0, 0);
    loom_err err;
    LOOM_ASSERT(loom_ps_plan_make_(p, &v, 1, 2, &f2, "x", &err) == LOOM_OK);
}

static void test_codec_roundtrip(void)
{
    loom_ps_plan p;
    small_plan(&p); /* shard 0: rows 0-2 on ps:0; shard 1: rows 3-4 on ps:1 */
    loom_buf b;
    loom_buf_init(&b);
    loom_ps_hdr h = {.req = 7, .nonce = 0xabcdef, .step = 12, .flags = LOOM_PS_F_SLOTS, .n_ranges = 1};
    loom_ps_put_hdr_(&b, &h);
    uint32_t rows[2] = {2, 0};
    loom_ps_put_range_(&b, 0, 2, rows); /* rows 2 and 0 of shard 0, values then one slot */
    float vals[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    loom_buf_put(&b, vals, sizeof vals);
    loom_ps_msg m;
    loom_err err = {0};
    CHECK(loom_ps_decode_(b.data, b.len, &p, 0, 1, true, &m, &err) == LOOM_OK);
    CHECK(m.h.req == 7 && m.h.nonce == 0xabcdef && m.h.step == 12 && m.n == 1);
    CHECK(m.r[0].shard == 0 && m.r[0].n_rows == 2 && loom_ps_row_(&m.r[0], 0) == 2 && m.r[0].n_vals == 4);
    float got[8];
    memcpy(got, m.r[0].vals, sizeof got);
    CHECK(!memcmp(got, vals, sizeof got));
    loom_ps_msg_fini_(&m);
    /* the same message read as ps:1's: refused */
    CHECK(loom_ps_decode_(b.data, b.len, &p, 1, 1, true, &m, &err) == LOOM_EDATA);
    CHECK_CONTAINS(err.msg, "held by ps:0, not ps:1");
    /* one byte short, one byte more */
    CHECK(loom_ps_decode_(b.data, b.len - 1, &p, 0, 1, true, &m, &err) == LOOM_EDATA);
    loom_buf_put(&b, "x", 1);
    CHECK(loom_ps_decode_(b.data, b.len, &p, 0, 1, true, &m, &err) == LOOM_EDATA);
    CHECK_CONTAINS(err.msg, "left over");
    loom_buf_fini(&b);

    /* a whole-shard pull without values; a row outside the shard */
    loom_buf_init(&b);
    h = (loom_ps_hdr){.req = 1, .n_ranges = 1};
    loom_ps_put_hdr_(&b, &h);
    loom_ps_put_range_(&b, 1, LOOM_PS_WHOLE, NULL);
    CHECK(loom_ps_decode_(b.data, b.len, &p, 1, 0, false, &m, &err) == LOOM_OK);
    CHECK(m.n == 1 && m.r[0].n_rows == LOOM_PS_WHOLE && !m.r[0].vals);
    loom_ps_msg_fini_(&m);
    CHECK(loom_ps_decode_(b.data, b.len, &p, 1, 0, true, &m, &err) == LOOM_EDATA); /* values missing */
    loom_buf_fini(&b);
    loom_buf_init(&b);
    loom_ps_put_hdr_(&b, &h);
    uint32_t bad = 2; /* shard 1 has rows 0..1 */
    loom_ps_put_range_(&b, 1, 1, &bad);
    CHECK(loom_ps_decode_(b.data, b.len, &p, 1, 0, false, &m, &err) == LOOM_EDATA);
    CHECK_CONTAINS(err.msg, "row 2 is outside the shard's 2 rows");
    loom_buf_fini(&b);
    /* more ranges than shards, a shard that does not exist */
    loom_buf_init(&b);
    h.n_ranges = 3;
    loom_ps_put_hdr_(&b, &h);
    CHECK(loom_ps_decode_(b.data, b.len, &p, -1, 0, false, &m, &err) == LOOM_EDATA);
    loom_buf_fini(&b);
    loom_buf_init(&b);
    h.n_ranges = 1;
    loom_ps_put_hdr_(&b, &h);
    loom_ps_put_range_(&b, 9, LOOM_PS_WHOLE, NULL);
    CHECK(loom_ps_decode_(b.data, b.len, &p, -1, 0, false, &m, &err) == LOOM_EDATA);
    CHECK_CONTAINS(err.msg, "shard 9 does not exist");
    loom_buf_fini(&b);
    loom_ps_plan_free_(&p);
}

static void test_run_and_result(void)
{
    loom_buf b;
    loom_buf_init(&b);
    loom_ps_run r = {.fn = 3, .nonce = 99, .first = 40, .steps = 5}, r2;
    loom_ps_put_run_(&b, &r);
    loom_err err;
    CHECK(loom_ps_decode_run_(b.data, b.len, &r2, &err) == LOOM_OK);
    CHECK(r2.fn == 3 && r2.nonce == 99 && r2.first == 40 && r2.steps == 5);
    CHECK(loom_ps_decode_run_(b.data, b.len - 1, &r2, &err) == LOOM_EDATA);
    loom_buf_fini(&b);
    loom_buf_init(&b);
    loom_ps_step_out s[2] = {{.step = 40, .accepted = 1, .loss_sum = 12.5, .correct = 30, .examples = 64},
                             {.step = 41, .accepted = 0, .loss_sum = 11.0, .correct = 31, .examples = 64}};
    loom_ps_put_result_(&b, 3, s, 2);
    uint64_t fn;
    loom_ps_step_out *o;
    uint32_t n;
    CHECK(loom_ps_decode_result_(b.data, b.len, &fn, &o, &n, &err) == LOOM_OK);
    CHECK(fn == 3 && n == 2 && o[1].step == 41 && !o[1].accepted && o[0].loss_sum == 12.5 && o[1].correct == 31);
    loom_free(o);
    CHECK(loom_ps_decode_result_(b.data, b.len - 3, &fn, &o, &n, &err) == LOOM_EDATA);
    b.data[12 + 20] = 0xff; /* correct > examples */
    b.data[12 + 27] = 0x7f;
    CHECK(loom_ps_decode_result_(b.data, b.len, &fn, &o, &n, &err) == LOOM_EDATA);
    loom_buf_fini(&b);
}

static void test_save_messages(void)
{
    loom_buf b;
    loom_buf_init(&b);
    loom_ps_hdr h = {.req = 7, .nonce = 99, .step = 50}, h2;
    loom_ps_put_save_(&b, &h, "/runs/ps");
    loom_err err;
    char text[64];
    CHECK(loom_ps_decode_save_(b.data, b.len, &h2, text, sizeof text, &err) == LOOM_OK);
    CHECK(h2.req == 7 && h2.nonce == 99 && h2.step == 50 && !strcmp(text, "/runs/ps"));
    CHECK(loom_ps_decode_save_(b.data, b.len - 1, &h2, text, sizeof text, &err) == LOOM_EDATA);
    CHECK(loom_ps_decode_save_(b.data, b.len, &h2, text, 4, &err) == LOOM_EDATA); /* longer than the buffer */
    loom_buf_fini(&b);
    loom_buf_init(&b);
    loom_ps_put_save_(&b, &h, "runs/ps");
    CHECK(loom_ps_decode_save_(b.data, b.len, &h2, text, sizeof text, &err) == LOOM_EDATA);
    CHECK_CONTAINS(err.msg, "not an absolute path");
    loom_buf_fini(&b);
    loom_buf_init(&b);
    loom_ps_put_saved_(&b, &h, 12345, 0xdeadbeef, "ckpt-50.data-00001-of-00002");
    uint64_t size;
    uint32_t crc;
    CHECK(loom_ps_decode_saved_(b.data, b.len, &h2, &size, &crc, text, sizeof text, &err) == LOOM_OK);
    CHECK(size == 12345 && crc == 0xdeadbeef && !strcmp(text, "ckpt-50.data-00001-of-00002") && h2.step == 50);
    loom_buf_fini(&b);
    loom_buf_init(&b);
    loom_ps_put_saved_(&b, &h, 1, 2, "../etc/passwd"); /* a ps names a file of the model directory, nothing else */
    CHECK(loom_ps_decode_saved_(b.data, b.len, &h2, &size, &crc, text, sizeof text, &err) == LOOM_EDATA);
    loom_buf_fini(&b);
}

static const loom_test tests[] = {
    {"save_messages", test_save_messages},
    {"partitioner_numbers", test_partitioner_numbers},
    {"round_robin", test_round_robin},
    {"codec_roundtrip", test_codec_roundtrip},
    {"run_and_result", test_run_and_result},
    {0},
};

int main(void) { return loom_test_run(tests); }
