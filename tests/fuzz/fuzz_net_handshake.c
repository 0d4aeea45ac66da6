/* fuzz_net_handshake.c - libFuzzer target for the cluster handshake
 * (appliance/cluster/wire.c's loom_hs state machine, driven as net.c drives
 * it, without sockets).
 * Built and run by tests/fuzz/run.sh (meson test --suite fuzz), or by hand from the repository root:
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined -D_GNU_SOURCE -I appliance \
 *     tests/fuzz/fuzz_net_handshake.c appliance/cluster/wire.c appliance/core/[a-z]*.c \
 *     -lcrypto -lz -lm -ldl -lpthread -o /tmp/fuzz_net_handshake
 *   /tmp/fuzz_net_handshake -max_total_time=30 /tmp/corpus_hs tests/fuzz/corpus/net_handshake
 * The first byte picks a mode:
 *   0: the input is a stream of frames from a stranger to an acceptor;
 *   1: the same, to a dialer (the acceptor's replies);
 *   2: an honest dialer and acceptor talk, and the input tampers with the
 *      exchange: per message a control byte passes it, flips a byte, cuts it,
 *      or replaces it with input bytes; the configs may differ.
 * Invariants: no crash or over-read (ASan); a stranger never completes the
 * handshake (it cannot know the secret); an untampered exchange completes
 * exactly when the configs agree, and otherwise both sides refuse naming the
 * differing line; a tampered one never completes on one side with a wrong peer. */
#include "cluster/net_internal.h"

#include <stdlib.h>
#include <string.h>

#define CHECK(c) do { if (!(c)) __builtin_trap(); } while (0)

static const char *cfg_a = "version = 1;\nmodel = \"mlp\";\nseed = 1;\n";
static const char *cfg_b = "version = 1;\nmodel = \"mlp\";\nseed = 2;\n";

/* Feeds every whole frame in in[0..n) to h; returns the first error (0 if none). */
static int feed(loom_hs *h, const uint8_t *in, size_t n, loom_buf *out, loom_err *err)
{
    size_t off = 0;
    while (off < n) {
        loom_net_frame f;
        long r = loom_net_frame_decode_(in + off, n - off, LOOM_NET_HANDSHAKE_MAX, &f, NULL, err);
        if (r <= 0) return r < 0 ? LOOM_ENET : 0;
        if (f.type != LOOM_MSG_HELLO) /* as net.c refuses any other frame before the handshake ends */
            return loom_err_set(err, LOOM_ENET, NULL, "frame of type %u before the handshake ended", f.type);
        int rc = loom_hs_feed_(h, f.payload, f.len, out, err);
        if (rc) return rc;
        off += (size_t)r;
    }
    return 0;
}

static void stranger(const uint8_t *data, size_t size, bool to_dialer)
{
    uint8_t digest[32] = {1};
    loom_hs h;
    loom_buf out, junk;
    loom_buf_init(&out), loom_buf_init(&junk);
    loom_hs_init_(&h, to_dialer, LOOM_ROLE_WORKER, 1, LOOM_ROLE_WORKER, 0, (const uint8_t *)"secret", 6, digest, cfg_a,
                  &junk);
    uint8_t *buf = malloc(size ? size : 1);
    memcpy(buf, data, size);
    loom_err err = {0};
    int rc = feed(&h, buf, size, &out, &err);
    CHECK(!h.done); /* the MACs are over fresh nonces and the secret */
    if (rc) CHECK(err.msg[0]);
    free(buf);
    loom_buf_fini(&out), loom_buf_fini(&junk);
}

static void tampered(const uint8_t *data, size_t size)
{
    if (size < 1) return;
    bool differ = data[0] & 1;
    data++, size--;
    uint8_t da[32], db[32];
    memset(da, 3, 32), memset(db, differ ? 4 : 3, 32);
    loom_hs a, b;
    loom_buf qa, qb, tmp;
    loom_buf_init(&qa), loom_buf_init(&qb), loom_buf_init(&tmp);
    loom_hs_init_(&a, true, LOOM_ROLE_WORKER, 1, LOOM_ROLE_WORKER, 0, (const uint8_t *)"k", 1, da, cfg_a, &qa);
    loom_hs_init_(&b, false, LOOM_ROLE_WORKER, 0, 0, 0, (const uint8_t *)"k", 1, db, differ ? cfg_b : cfg_a, &tmp);
    loom_err ea = {0}, eb = {0};
    int ra = 0, rb = 0;
    bool touched = false;
    size_t pos = 0;
    for (int turn = 0; turn < 8 && !(ra || rb) && !(a.done && b.done); turn++) {
        loom_buf *q = turn % 2 ? &qb : &qa; /* what the sender of this turn queued */
        loom_buf msg = *q;
        loom_buf_init(q);
        uint8_t ctl = pos < size ? data[pos++] : 0;
        switch (ctl % 4) {
        case 1:
            if (msg.len && pos < size) msg.data[data[pos++] % msg.len] ^= 1 + (ctl >> 2), touched = true;
            break;
        case 2:
            if (msg.len) msg.len = (ctl >> 2) % msg.len, touched = true;
            break;
        case 3: {
            size_t l = pos < size ? data[pos++] : 0;
            if (l > size - pos) l = size - pos;
            loom_buf_fini(&msg);
            loom_buf_init(&msg);
            loom_buf_put(&msg, data + pos, l);
            pos += l;
            touched = true;
            break;
        }
        default:
            break;
        }
        uint8_t *copy = malloc(msg.len ? msg.len : 1);
        if (msg.len) memcpy(copy, msg.data, msg.len);
        if (turn % 2) ra = feed(&a, copy, msg.len, &qa, &ea);
        else rb = feed(&b, copy, msg.len, &qb, &eb);
        free(copy);
        loom_buf_fini(&msg);
    }
    if (!touched) {
        /* Honest: done on both sides iff the configs agree; otherwise a named refusal. */
        if (!differ) CHECK(a.done && b.done && !ra && !rb);
        else {
            CHECK(!a.done && !b.done);
            if (ra) CHECK(ra == LOOM_ECONFIG && strstr(ea.msg, "seed = "));
            if (rb) CHECK(rb == LOOM_ECONFIG && strstr(eb.msg, "seed = "));
        }
    }
    if (a.done) CHECK(a.peer_role == LOOM_ROLE_WORKER && a.peer_index == 0);
    if (b.done) CHECK(b.peer_role == LOOM_ROLE_WORKER && b.peer_index == 1 && !differ);
    loom_buf_fini(&qa), loom_buf_fini(&qb), loom_buf_fini(&tmp);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    switch (data[0] % 3) {
    case 0: stranger(data + 1, size - 1, false); break;
    case 1: stranger(data + 1, size - 1, true); break;
    default: tampered(data + 1, size - 1); break;
    }
    return 0;
}
