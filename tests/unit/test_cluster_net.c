/* test_cluster_net.c - the cluster transport and collectives between real
 * processes over 127.0.0.1: frames and the handshake in memory, then 2 and 3
 * forked ranks: messages, all-reduce of 1 to 1M floats against a serial sum
 * (and bit-identical across ranks), the wire formats and error feedback,
 * broadcast, all_gather_bytes, barrier, shards, a group of one. What goes
 * wrong (refusals, lost peers, queues, timeouts, TLS) is in
 * test_cluster_net_faults.c; the fixtures in cluster_net_fixtures.h.
 * The cluster is filled by hand (the topology resolver is tested elsewhere).
 * Every child runs under a deadline and is reaped; each child's stderr (where
 * loom_log writes) goes to a file the parent reads back. */
#include "cluster_net_fixtures.h"

/* ---- in memory: frames and the handshake ------------------------------------ */

static void test_frames(void)
{
    uint8_t buf[LOOM_NET_HDR + 5];
    loom_net_frame_header_(buf, 42, "hello", 5);
    memcpy(buf + LOOM_NET_HDR, "hello", 5);
    loom_net_frame f;
    loom_err err = {0};
    size_t need = 0;
    CHECK(loom_net_frame_decode_(buf, sizeof buf, 1024, &f, &need, &err) == (long)sizeof buf);
    CHECK(f.type == 42 && f.len == 5 && !memcmp(f.payload, "hello", 5));
    /* Every prefix asks for more. */
    for (size_t k = 1; k < sizeof buf; k++) {
        need = 0;
        long r = loom_net_frame_decode_(buf, k, 1024, &f, &need, &err);
        CHECK_MSG(r == 0 && need >= k, "prefix %zu: %ld", k, r);
    }
    /* A flipped bit anywhere is caught. */
    for (size_t k = 0; k < sizeof buf; k++) {
        uint8_t b[sizeof buf];
        memcpy(b, buf, sizeof b);
        b[k] ^= 0x10;
        /* (a flip in the length asks for more bytes, or exceeds the bound) */
        CHECK_MSG(loom_net_frame_decode_(b, sizeof b, 1024, &f, NULL, &err) <= 0, "flip at byte %zu passed", k);
    }
    /* Bad magic at once, a length above the bound, another version. */
    CHECK(loom_net_frame_decode_((const uint8_t *)"GET ", 4, 1024, &f, NULL, &err) < 0);
    CHECK_CONTAINS(err.msg, "not a loom frame");
    CHECK(loom_net_frame_decode_(buf, sizeof buf, 4, &f, NULL, &err) < 0);
    CHECK_CONTAINS(err.msg, "above the limit");
    uint8_t v2[sizeof buf];
    memcpy(v2, buf, sizeof v2);
    v2[4] = 2;
    CHECK(loom_net_frame_decode_(v2, sizeof v2, 1024, &f, NULL, &err) < 0);
    CHECK_CONTAINS(err.msg, "version 2");
}

/* Drives two handshakes against each other in memory; returns each side's rc. */
static void handshake_pair(const char *sa, const char *sb, uint8_t da, uint8_t db, const char *ta, const char *tb,
                           int *rca, int *rcb, loom_err *ea, loom_err *eb, bool *done)
{
    uint8_t dga[32], dgb[32];
    memset(dga, da, 32), memset(dgb, db, 32);
    loom_hs a, b; /* a dials (worker:1), b accepts (worker:0) */
    loom_buf qa, qb;  /* frames a sent, frames b sent */
    loom_buf_init(&qa), loom_buf_init(&qb);
    loom_hs_init_(&a, true, LOOM_ROLE_WORKER, 1, LOOM_ROLE_WORKER, 0, (const uint8_t *)sa, strlen(sa), dga, ta, &qa);
    loom_buf tmp;
    loom_buf_init(&tmp);
    loom_hs_init_(&b, false, LOOM_ROLE_WORKER, 0, 0, 0, (const uint8_t *)sb, strlen(sb), dgb, tb, &tmp);
    *rca = *rcb = 0;
    for (int round = 0; round < 10 && !(*rca && *rcb) && !(a.done && b.done); round++) {
        /* b reads what a sent */
        loom_buf in = qa;
        loom_buf_init(&qa);
        for (size_t off = 0; off < in.len && !*rcb;) {
            loom_net_frame f;
            long r = loom_net_frame_decode_(in.data + off, in.len - off, LOOM_NET_HANDSHAKE_MAX, &f, NULL, eb);
            if (r <= 0) break;
            *rcb = loom_hs_feed_(&b, f.payload, f.len, &qb, eb);
            off += (size_t)r;
        }
        loom_buf_fini(&in);
        in = qb;
        loom_buf_init(&qb);
        for (size_t off = 0; off < in.len && !*rca;) {
            loom_net_frame f;
            long r = loom_net_frame_decode_(in.data + off, in.len - off, LOOM_NET_HANDSHAKE_MAX, &f, NULL, ea);
            if (r <= 0) break;
            *rca = loom_hs_feed_(&a, f.payload, f.len, &qa, ea);
            off += (size_t)r;
        }
        loom_buf_fini(&in);
        if (*rca && !qa.len) break;
    }
    *done = a.done && b.done;
    loom_buf_fini(&qa), loom_buf_fini(&qb), loom_buf_fini(&tmp);
}

static void test_handshake(void)
{
    const char *cfg = "version = 1;\nmodel = \"mlp\";\noptimizer.learning_rate = 0.1;\n";
    const char *cfg2 = "version = 1;\nmodel = \"mlp\";\noptimizer.learning_rate = 0.2;\n";
    int ra, rb;
    loom_err ea = {0}, eb = {0};
    bool done;
    handshake_pair("s3cret", "s3cret", 1, 1, cfg, cfg, &ra, &rb, &ea, &eb, &done);
    CHECK(ra == 0 && rb == 0 && done);
    handshake_pair("s3cret", "other", 1, 1, cfg, cfg, &ra, &rb, &ea, &eb, &done);
    CHECK(ra == LOOM_ENET && rb == LOOM_ENET && !done);
    CHECK_CONTAINS(ea.msg, "worker:0 failed to prove the shared secret");
    CHECK_CONTAINS(eb.msg, "worker:1 failed to prove the shared secret");
    handshake_pair("s3cret", "s3cret", 1, 2, cfg, cfg2, &ra, &rb, &ea, &eb, &done);
    CHECK(ra == LOOM_ECONFIG && rb == LOOM_ECONFIG && !done);
    CHECK_CONTAINS(ea.msg, "optimizer.learning_rate = 0.1;` here, `optimizer.learning_rate = 0.2;` there");
    CHECK_CONTAINS(eb.msg, "optimizer.learning_rate = 0.2;` here, `optimizer.learning_rate = 0.1;` there");
}

/* ---- messages ------------------------------------------------------------- */


static void test_net_messages(void)
{
    new_ports(2);
    int st[MAXR];
    run_ranks(2, net_msgs_rank, 30, st);
    check_all_ok(2, st);
}

/* ---- collectives ------------------------------------------------------------ */



static int all_reduce_wire_rank(int rank, int n);

static void test_all_reduce_2(void)
{
    new_ports(2);
    int st[MAXR];
    run_ranks(2, all_reduce_rank, 60, st);
    check_all_ok(2, st);
}

static void test_all_reduce_3(void)
{
    new_ports(3);
    int st[MAXR];
    run_ranks(3, all_reduce_rank, 60, st);
    check_all_ok(3, st);
}

/* strategy.compression's all-reduce (bf16, fp16 on the wire), on the small
 * path and the ring: within the format's rounding of the float32 sum (one
 * rounding per hop, at most n), bit-identical on every rank, and sums of
 * small integers exact. */
static int all_reduce_wire_rank(int rank, int n)
{
    loom_group *g = open_group(rank, n, 30);
    if (!g) return 1;
    static const int64_t counts[] = {1, 5, 1000, 40000, 65539, 1 << 20};
    for (int f = LOOM_WIRE_BF16; f <= LOOM_WIRE_FP16; f++) {
        double ulp = f == LOOM_WIRE_BF16 ? 1.0 / 256 : 1.0 / 2048; /* relative spacing (at most) */
        for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++) {
            int64_t c = counts[k];
            float *b = malloc((size_t)c * 4 + 4);
            double worst = 0;
            for (int64_t i = 0; i < c; i++) b[i] = val(rank, i);
            loom_err err = {0};
            int rc = loom_group_all_reduce_wire(g, b, c, (loom_wire_fmt)f, &err);
            CHECK_MSG(rc == 0, "rank %d, %s, %lld values: %s", rank, f == LOOM_WIRE_BF16 ? "bf16" : "fp16",
                      (long long)c, err.msg);
            for (int64_t i = 0; i < c; i++) {
                double want = 0, mag = 0;
                for (int r = 0; r < n; r++) want += val(r, i), mag += fabs(val(r, i));
                double d = fabs((double)b[i] - want) / (mag + 1e-30);
                if (d > worst) worst = d;
            }
            CHECK_MSG(worst <= (n + 1) * ulp, "%s, %lld values: %g off (relative), above %g",
                      f == LOOM_WIRE_BF16 ? "bf16" : "fp16", (long long)c, worst, (n + 1) * ulp);
            uint32_t crc = loom_crc32c(b, (size_t)c * 4);
            loom_buf out[MAXR];
            for (int r = 0; r < n; r++) loom_buf_init(&out[r]);
            rc = loom_group_all_gather_bytes(g, &crc, 4, out, &err);
            CHECK_MSG(rc == 0, "gather: %s", err.msg);
            for (int r = 0; r < n && !rc; r++)
                CHECK_MSG(out[r].len == 4 && !memcmp(out[r].data, &crc, 4), "%s, %lld values: rank %d's result differs",
                          f == LOOM_WIRE_BF16 ? "bf16" : "fp16", (long long)c, r);
            for (int r = 0; r < n; r++) loom_buf_fini(&out[r]);
            /* small integers (at most 8 significant bits) sum exactly */
            for (int64_t i = 0; i < c; i++) b[i] = (float)((rank + 1) * (i % 16));
            CHECK(loom_group_all_reduce_wire(g, b, c, (loom_wire_fmt)f, &err) == 0);
            int bad = 0;
            for (int64_t i = 0; i < c; i++) bad += b[i] != (float)(n * (n + 1) / 2 * (i % 16));
            CHECK_MSG(!bad, "%lld values: %d integer sums inexact", (long long)c, bad);
            free(b);
        }
    }
    loom_group_close(g);
    return 0;
}

static void test_all_reduce_wire(void)
{
    for (int n = 2; n <= 3; n++) {
        new_ports(n);
        int st[MAXR];
        run_ranks(n, all_reduce_wire_rank, 60, st);
        check_all_ok(n, st);
    }
}

/* loom_wire_round: the vector path (8 at a time, F16C/AVX2 where the CPU
 * has them) gives the bits of the scalar one (a single value) on every
 * float pattern tried: random bits (normals, subnormals, infinities, NaNs),
 * the halves' rounding boundaries and overflow edges. Workers on machines
 * with and without the vector path must round alike. */
static void test_wire_round(void)
{
    enum { N = 1 << 20 };
    float *a = malloc(N * sizeof *a), *b = malloc(N * sizeof *b);
    uint64_t z = 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < N; i++) {
        z ^= z << 13, z ^= z >> 7, z ^= z << 17;
        uint32_t u = (uint32_t)z;
        if (i % 4 == 1) u = (u & 0x8000ffffu) | (0x387u << 20) | ((u >> 16) & 0xfffu) << 8; /* near the fp16 subnormals */
        if (i % 4 == 2) u = (u & 0x80000000u) | 0x477fe000u | (u & 0x1fffu);                /* near 65504 */
        if (i % 4 == 3) u = (u & 0x807fffffu) | (uint32_t)(100 + (int)(u >> 24) % 60) << 23;  /* ordinary gradients */
        memcpy(&a[i], &u, 4);
    }
    static const float edge[] = {0.0f, -0.0f, 65504.0f, 65519.99f, 65520.0f, 65536.0f, 5.9604645e-8f, 2.980232e-8f,
                                 2.9802326e-8f, 6.1035156e-5f, 1.0f + 1.0f / 4096, 1.0f + 3.0f / 4096, 3.3895314e38f};
    for (size_t i = 0; i < sizeof edge / sizeof edge[0]; i++) a[i] = edge[i];
    for (int f = LOOM_WIRE_BF16; f <= LOOM_WIRE_FP16; f++) {
        memcpy(b, a, N * sizeof *a);
        loom_wire_round((loom_wire_fmt)f, b, N);
        int bad = 0, first = -1;
        for (int i = 0; i < N; i++) {
            float one = a[i];
            loom_wire_round((loom_wire_fmt)f, &one, 1);
            if (memcmp(&one, &b[i], 4)) bad++, first = first < 0 ? i : first;
        }
        CHECK_MSG(!bad, "%s: %d of %d values round otherwise 8 at a time (first: %a)", f == LOOM_WIRE_BF16 ? "bf16" : "fp16",
                  bad, N, first >= 0 ? (double)a[first] : 0.0);
    }
    free(a), free(b);
}

/* loom_wire_feedback (error feedback in one pass, 8 at a time where the
 * CPU can) gives the bits of the three passes it replaced: g += e, e = g,
 * round g, e -= g; on gradient-like values and residuals, n not a multiple
 * of 8 (the scalar tail), and values near 65504 (fp16's overflow). */
static void test_wire_feedback(void)
{
    enum { N = 100003 };
    float *g = malloc(N * sizeof *g), *e = malloc(N * sizeof *e), *g2 = malloc(N * sizeof *g), *e2 = malloc(N * sizeof *e);
    uint64_t z = 0x2545f4914f6cdd1dull;
    for (int i = 0; i < N; i++) {
        z ^= z << 13, z ^= z >> 7, z ^= z << 17;
        uint32_t u = ((uint32_t)z & 0x807fffffu) | (uint32_t)(100 + (int)((z >> 32) % 60)) << 23;
        memcpy(&g[i], &u, 4);
        e[i] = i % 3 ? g[i] * (float)((int)(z >> 40 & 255) - 128) / 65536.0f : 0.0f;
        if (i % 1000 == 7) g[i] = 65519.0f, e[i] = 1.5f;
    }
    for (int f = LOOM_WIRE_BF16; f <= LOOM_WIRE_FP16; f++) {
        memcpy(g2, g, N * sizeof *g), memcpy(e2, e, N * sizeof *e);
        for (int i = 0; i < N; i++) g2[i] += e2[i], e2[i] = g2[i];
        loom_wire_round((loom_wire_fmt)f, g2, N);
        for (int i = 0; i < N; i++) e2[i] -= g2[i];
        float *gf = malloc(N * sizeof *g), *ef = malloc(N * sizeof *e);
        memcpy(gf, g, N * sizeof *g), memcpy(ef, e, N * sizeof *e);
        loom_wire_feedback((loom_wire_fmt)f, gf, ef, N);
        CHECK_MSG(!memcmp(gf, g2, N * sizeof *g) && !memcmp(ef, e2, N * sizeof *e),
                  "%s: one pass differs from the three it replaced", f == LOOM_WIRE_BF16 ? "bf16" : "fp16");
        free(gf), free(ef);
    }
    free(g), free(e), free(g2), free(e2);
}

/* The same with large collectives sent from the sender thread (used by
 * default only where each local rank has two cores). */
static void test_all_reduce_sender_thread(void)
{
    setenv("LOOM_RING_SENDER", "1", 1);
    for (int n = 2; n <= 3; n++) {
        new_ports(n);
        int st[MAXR];
        run_ranks(n, all_reduce_rank, 60, st);
        check_all_ok(n, st);
        new_ports(n);
        run_ranks(n, bcast_gather_rank, 60, st);
        check_all_ok(n, st);
        new_ports(n); /* the 16-bit formats: the sender forwards what the receiving side has just rounded */
        run_ranks(n, all_reduce_wire_rank, 60, st);
        check_all_ok(n, st);
    }
    unsetenv("LOOM_RING_SENDER");
}


static void test_broadcast_gather_barrier(void)
{
    for (int n = 2; n <= 3; n++) {
        new_ports(n);
        int st[MAXR];
        run_ranks(n, bcast_gather_rank, 60, st);
        check_all_ok(n, st);
    }
}

/* The halves of a sharded update: after the reduce-scatter each rank's shard
 * is the sum (2 ranks: the all-reduce's bits), the small floats are the
 * sum in rank order on every rank; the all-gather hands every shard to all. */
static int shards_rank(int rank, int n)
{
    loom_group *g = open_group(rank, n, 30);
    if (!g) return 1;
    static const int64_t counts[] = {0, 5, 100, 4097, (1 << 20) + 7};
    for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++) {
        int64_t c = counts[k], off[MAXR + 1], lines = (c + 15) / 16;
        for (int r = 0; r <= n; r++) off[r] = lines * r / n * 16 < c ? lines * r / n * 16 : c;
        float *b = malloc((size_t)c * 4 + 4), *ref = malloc((size_t)c * 4 + 4), small[3], want[3];
        for (int64_t i = 0; i < c; i++) b[i] = ref[i] = val(rank, i);
        for (int i = 0; i < 3; i++) {
            small[i] = val(rank, 7 * i) / 3.0f, want[i] = val(0, 7 * i) / 3.0f;
            for (int r = 1; r < n; r++) want[i] += val(r, 7 * i) / 3.0f;
        }
        loom_err err = {0};
        CHECK_MSG(loom_group_all_reduce(g, ref, c, &err) == 0, "all-reduce: %s", err.msg);
        CHECK_MSG(loom_group_reduce_scatter(g, b, off, small, 3, &err) == 0, "reduce-scatter: %s", err.msg);
        bool same = true, close = true;
        for (int64_t i = off[rank]; i < off[rank + 1]; i++)
            same &= b[i] == ref[i], close &= fabsf(b[i] - ref[i]) <= 1e-4f;
        CHECK_MSG(n == 2 ? same : close, "rank %d, %lld floats: its shard is not the sum", rank, (long long)c);
        CHECK_MSG(!memcmp(small, want, sizeof want), "rank %d: the small floats are not the sum in rank order", rank);
        for (int64_t i = 0; i < c; i++) b[i] = i >= off[rank] && i < off[rank + 1] ? val(rank, i) : -1;
        float flag = rank == n - 1 ? 1.0f : 0.0f;
        CHECK_MSG(loom_group_all_gather(g, b, off, &flag, 1, &err) == 0, "all-gather: %s", err.msg);
        same = flag == 1.0f;
        for (int r = 0; r < n; r++)
            for (int64_t i = off[r]; i < off[r + 1]; i++) same &= b[i] == val(r, i);
        CHECK_MSG(same, "rank %d, %lld floats: the gathered shards differ", rank, (long long)c);
        free(b), free(ref);
    }
    loom_group_close(g);
    return 0;
}

static void test_shards(void)
{
    for (int n = 2; n <= 3; n++)
        for (int sender = 0; sender <= 1; sender++) {
            if (sender) setenv("LOOM_RING_SENDER", "1", 1);
            new_ports(n);
            int st[MAXR];
            run_ranks(n, shards_rank, 60, st);
            check_all_ok(n, st);
            unsetenv("LOOM_RING_SENDER");
        }
}

/* A group of one: every collective returns at once with the caller's data. */
static void test_group_of_one(void)
{
    new_ports(1);
    tcl t;
    mk_cluster(&t, 1, 0);
    loom_group *g = NULL;
    loom_err err = {0};
    CHECK_MSG(loom_group_open(&g, &t.c, 0, &err) == 0, "%s", err.msg);
    if (!g) return;
    float b[3] = {1, 2, 3};
    CHECK(loom_group_all_reduce(g, b, 3, &err) == 0 && b[0] == 1 && b[2] == 3);
    CHECK(loom_group_broadcast(g, b, sizeof b, 0, &err) == 0 && b[1] == 2);
    CHECK(loom_group_broadcast(g, b, sizeof b, 1, &err) == LOOM_EUSAGE);
    loom_buf out[1];
    loom_buf_init(&out[0]);
    CHECK(loom_group_all_gather_bytes(g, "abc", 3, out, &err) == 0 && out[0].len == 3 && !memcmp(out[0].data, "abc", 3));
    loom_buf_fini(&out[0]);
    CHECK(loom_group_barrier(g, &err) == 0);
    CHECK(loom_group_size(g) == 1 && loom_group_rank(g) == 0);
    loom_group_close(g);
}

static const loom_test tests[] = {
    {"frames", test_frames},
    {"handshake", test_handshake},
    {"net_messages", test_net_messages},
    {"all_reduce_2", test_all_reduce_2},
    {"all_reduce_3", test_all_reduce_3},
    {"all_reduce_wire", test_all_reduce_wire},
    {"wire_round", test_wire_round},
    {"wire_feedback", test_wire_feedback},
    {"broadcast_gather_barrier", test_broadcast_gather_barrier},
    {"all_reduce_sender_thread", test_all_reduce_sender_thread},
    {"shards", test_shards},
    {"group_of_one", test_group_of_one},
    {0},
};

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    return run_in_tmpdir("loom-cluster-net", tests);
}
