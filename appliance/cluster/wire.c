/* wire.c - the transport's frame codec and handshake state machine (see
 * net_internal.h): pure functions over bytes, no sockets, so the fuzzers can
 * drive them. HMAC-SHA256 and nonces from OpenSSL's libcrypto. */
#include "cluster/net_internal.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <stdio.h>
#include <string.h>

static void put32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8), p[2] = (uint8_t)(v >> 16), p[3] = (uint8_t)(v >> 24);
}
static uint32_t get32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

void loom_net_frame_header_(uint8_t hdr[LOOM_NET_HDR], uint32_t type, const void *payload, uint32_t len)
{
    put32(hdr, LOOM_NET_MAGIC);
    hdr[4] = LOOM_NET_VERSION, hdr[5] = 0, hdr[6] = 0, hdr[7] = 0;
    put32(hdr + 8, type);
    put32(hdr + 12, len);
    uint32_t crc = loom_crc32c(hdr, 16);
    if (len) crc = loom_crc32c_extend(crc, payload, len);
    put32(hdr + 16, crc);
}

long loom_net_frame_decode_(const uint8_t *p, size_t avail, uint32_t max_len, loom_net_frame *f, size_t *need,
                            loom_err *err)
{
    /* Check the magic and version as soon as their bytes arrive, so a client
     * that sends a few garbage bytes and waits is dropped at once. */
    size_t m = avail < 4 ? avail : 4;
    static const uint8_t magic[4] = {'L', 'O', 'O', 'M'};
    if (memcmp(p, magic, m) != 0)
        return loom_err_set(err, LOOM_ENET, NULL, "not a loom frame (bad magic bytes %02x %02x %02x %02x)",
                            p[0], avail > 1 ? p[1] : 0, avail > 2 ? p[2] : 0, avail > 3 ? p[3] : 0), -1;
    if (avail >= 6) {
        unsigned v = p[4] | (unsigned)p[5] << 8;
        if (v != LOOM_NET_VERSION)
            return loom_err_set(err, LOOM_ENET, NULL, "frame version %u, this loom speaks %d", v, LOOM_NET_VERSION),
                   -1;
    }
    if (avail >= 8 && (p[6] || p[7])) /* reserved: a frame is only ever read as it was written */
        return loom_err_set(err, LOOM_ENET, NULL, "frame with reserved header bytes set (%02x %02x)", p[6], p[7]), -1;
    if (avail < LOOM_NET_HDR) {
        if (need) *need = LOOM_NET_HDR;
        return 0;
    }
    uint32_t len = get32(p + 12);
    if (len > max_len)
        return loom_err_set(err, LOOM_ENET, NULL, "frame of %u bytes, above the limit of %u", len, max_len), -1;
    if (avail - LOOM_NET_HDR < len) {
        if (need) *need = LOOM_NET_HDR + (size_t)len;
        return 0;
    }
    uint32_t crc = loom_crc32c(p, 16);
    if (len) crc = loom_crc32c_extend(crc, p + LOOM_NET_HDR, len);
    if (crc != get32(p + 16))
        return loom_err_set(err, LOOM_ENET, NULL, "frame checksum mismatch (CRC-32C %08x, header says %08x)", crc,
                            get32(p + 16)), -1;
    f->type = get32(p + 8);
    f->len = len;
    f->payload = p + LOOM_NET_HDR;
    return (long)(LOOM_NET_HDR + len);
}

char *loom_net_task_name_(loom_role role, int index, char *buf, size_t n)
{
    static const char *const names[] = {"chief", "worker", "ps", "evaluator"};
    snprintf(buf, n, "%s:%d", (unsigned)role < LOOM_ROLE_COUNT ? names[role] : "?", index);
    return buf;
}

/* Copies line k (0-based) of s into out, "" past the end; returns whether it exists. */
static bool line_of(const char *s, const char **start, size_t *len, int k)
{
    if (!s) return false;
    for (int i = 0; i < k; i++) {
        s = strchr(s, '\n');
        if (!s) return false;
        s++;
    }
    if (!*s) return false;
    const char *e = strchr(s, '\n');
    *start = s;
    *len = e ? (size_t)(e - s) : strlen(s);
    return true;
}

void loom_net_config_diff_(const char *mine, const char *theirs, char *out, size_t n)
{
    for (int k = 0;; k++) {
        const char *a = NULL, *b = NULL;
        size_t la = 0, lb = 0;
        bool ha = line_of(mine, &a, &la, k), hb = line_of(theirs, &b, &lb, k);
        if (!ha && !hb) {
            snprintf(out, n, "the config texts are equal but their digests differ");
            return;
        }
        if (ha != hb || la != lb || memcmp(a, b, la) != 0) {
            /* Trim leading blanks so the setting reads as in the config. */
            while (ha && la && (*a == ' ' || *a == '\t')) a++, la--;
            while (hb && lb && (*b == ' ' || *b == '\t')) b++, lb--;
            snprintf(out, n, "first difference at line %d of the resolved config: `%.*s` here, `%.*s` there", k + 1,
                     ha ? (int)(la > 200 ? 200 : la) : 7, ha ? a : "(none)", hb ? (int)(lb > 200 ? 200 : lb) : 7,
                     hb ? b : "(none)");
            return;
        }
    }
}

static void frame_out(loom_buf *out, const void *payload, size_t len)
{
    uint8_t hdr[LOOM_NET_HDR];
    loom_net_frame_header_(hdr, LOOM_MSG_HELLO, payload, (uint32_t)len);
    loom_buf_put(out, hdr, sizeof hdr);
    loom_buf_put(out, payload, len);
}

/* HMAC(secret, label | first nonce | second nonce | dialer id | acceptor id). */
static void mac(const loom_hs *h, const char *label, const uint8_t *n1, const uint8_t *n2, uint8_t out[32])
{
    uint8_t msg[8 + 2 * LOOM_HS_NONCE + 16];
    memset(msg, 0, 8);
    memcpy(msg, label, strlen(label) < 8 ? strlen(label) : 8);
    memcpy(msg + 8, n1, LOOM_HS_NONCE);
    memcpy(msg + 8 + LOOM_HS_NONCE, n2, LOOM_HS_NONCE);
    uint8_t *ids = msg + 8 + 2 * LOOM_HS_NONCE;
    loom_role dr = h->dialer ? h->my_role : h->peer_role, ar = h->dialer ? h->peer_role : h->my_role;
    int di = h->dialer ? h->my_index : h->peer_index, ai = h->dialer ? h->peer_index : h->my_index;
    put32(ids, (uint32_t)dr), put32(ids + 4, (uint32_t)di), put32(ids + 8, (uint32_t)ar), put32(ids + 12, (uint32_t)ai);
    static const uint8_t nokey[1] = {0};
    unsigned int olen = 32;
    HMAC(EVP_sha256(), h->secret_len ? h->secret : nokey, (int)h->secret_len, msg, sizeof msg, out, &olen);
}

static void nonce(uint8_t *p)
{
    if (RAND_bytes(p, LOOM_HS_NONCE) != 1) {
        /* No entropy from OpenSSL: fall back on the clock and the address
         * space, still fresh per connection (the secret is what protects). */
        uint64_t t = (uint64_t)(loom_wall_time() * 1e9) ^ (uint64_t)(uintptr_t)p;
        for (int i = 0; i < LOOM_HS_NONCE / 8; i++) {
            uint64_t v = loom_rng_mix(t, (uint64_t)i);
            memcpy(p + 8 * i, &v, 8);
        }
    }
}

void loom_hs_init_(loom_hs *h, bool dialer, loom_role my_role, int my_index, loom_role peer_role, int peer_index,
                   const uint8_t *secret, size_t secret_len, const uint8_t digest[32], const char *config_text,
                   loom_buf *out)
{
    memset(h, 0, sizeof *h);
    h->dialer = dialer;
    h->my_role = my_role, h->my_index = my_index;
    h->peer_role = peer_role, h->peer_index = peer_index;
    h->peer_known = dialer;
    h->secret = secret, h->secret_len = secret_len;
    h->digest = digest;
    h->config_text = config_text;
    nonce(h->my_nonce);
    if (dialer) {
        uint8_t p[1 + 20 + LOOM_HS_NONCE];
        p[0] = 1;
        put32(p + 1, LOOM_NET_VERSION);
        put32(p + 5, (uint32_t)my_role), put32(p + 9, (uint32_t)my_index);
        put32(p + 13, (uint32_t)peer_role), put32(p + 17, (uint32_t)peer_index);
        memcpy(p + 21, h->my_nonce, LOOM_HS_NONCE);
        frame_out(out, p, sizeof p);
        h->phase = 2;
    } else {
        h->phase = 1;
    }
}

static void config_frame(loom_hs *h, loom_buf *out, uint8_t phase, uint8_t status)
{
    size_t tl = h->config_text ? strlen(h->config_text) : 0;
    if (tl > LOOM_NET_HANDSHAKE_MAX - 64) tl = LOOM_NET_HANDSHAKE_MAX - 64;
    loom_buf b;
    loom_buf_init(&b);
    uint8_t head[2] = {phase, status};
    loom_buf_put(&b, head, 2);
    if (tl) loom_buf_put(&b, h->config_text, tl);
    if (!b.failed) frame_out(out, b.data, b.len);
    else out->failed = 1;
    loom_buf_fini(&b);
}

/* Copies a received config text (not NUL-terminated) and diffs it with ours. */
static int config_refuse(loom_hs *h, const uint8_t *text, size_t len, loom_err *err)
{
    char *t = loom_alloc(len + 1);
    if (!t) return loom_err_set(err, LOOM_ENOMEM, NULL, "no memory for the peer's config text (%zu bytes)", len);
    memcpy(t, text, len);
    t[len] = 0;
    for (size_t i = 0; i < len; i++)
        if (t[i] == 0) t[i] = ' ';
    loom_net_config_diff_(h->config_text, t, h->peer_config_diff, sizeof h->peer_config_diff);
    loom_free(t);
    h->mismatch = true;
    char name[32];
    loom_net_task_name_(h->peer_role, h->peer_index, name, sizeof name);
    loom_err_set(err, LOOM_ECONFIG, NULL, "%s was started with a different config: %s", name, h->peer_config_diff);
    return loom_err_hint(err, "start every task of the cluster with the same config and --set options");
}

int loom_hs_feed_(loom_hs *h, const uint8_t *p, size_t len, loom_buf *out, loom_err *err)
{
    if (h->done) return loom_err_set(err, LOOM_ENET, NULL, "handshake message after the handshake ended");
    if (len < 1 || p[0] != h->phase)
        return loom_err_set(err, LOOM_ENET, NULL, "handshake out of order (phase %d, expected %d)", len ? p[0] : -1,
                            h->phase);
    char name[32];
    switch (h->phase) {
    case 1: { /* acceptor: the dialer's task and nonce */
        if (len != 1 + 20 + LOOM_HS_NONCE) return loom_err_set(err, LOOM_ENET, NULL, "bad hello (%zu bytes)", len);
        uint32_t ver = get32(p + 1), role = get32(p + 5), idx = get32(p + 9), trole = get32(p + 13),
                 tidx = get32(p + 17);
        if (ver != LOOM_NET_VERSION)
            return loom_err_set(err, LOOM_ENET, NULL, "peer speaks protocol %u, this loom %d", ver, LOOM_NET_VERSION);
        if (role >= LOOM_ROLE_COUNT || idx > 1000000)
            return loom_err_set(err, LOOM_ENET, NULL, "hello names no task (role %u, index %u)", role, idx);
        if (trole != (uint32_t)h->my_role || tidx != (uint32_t)h->my_index) {
            char want[32];
            loom_net_task_name_((loom_role)(trole < LOOM_ROLE_COUNT ? trole : 0), (int)tidx, want, sizeof want);
            return loom_err_set(err, LOOM_ENET, NULL, "peer meant to reach %s, this is %s", want,
                                loom_net_task_name_(h->my_role, h->my_index, name, sizeof name));
        }
        h->peer_role = (loom_role)role, h->peer_index = (int)idx;
        h->peer_known = true;
        if (h->accept_peer && !h->accept_peer(h->accept_arg, h->peer_role, h->peer_index))
            return loom_err_set(err, LOOM_ENET, NULL, "%s is not a peer this task expects",
                                loom_net_task_name_(h->peer_role, h->peer_index, name, sizeof name));
        memcpy(h->peer_nonce, p + 21, LOOM_HS_NONCE);
        uint8_t r[1 + 8 + LOOM_HS_NONCE + LOOM_HS_MAC];
        r[0] = 2;
        put32(r + 1, (uint32_t)h->my_role), put32(r + 5, (uint32_t)h->my_index);
        memcpy(r + 9, h->my_nonce, LOOM_HS_NONCE);
        mac(h, "loom-a", h->peer_nonce, h->my_nonce, r + 9 + LOOM_HS_NONCE);
        frame_out(out, r, sizeof r);
        h->phase = 3;
        return LOOM_OK;
    }
    case 2: { /* dialer: the acceptor's proof */
        if (len != 1 + 8 + LOOM_HS_NONCE + LOOM_HS_MAC)
            return loom_err_set(err, LOOM_ENET, NULL, "bad hello reply (%zu bytes)", len);
        if (get32(p + 1) != (uint32_t)h->peer_role || get32(p + 5) != (uint32_t)h->peer_index)
            return loom_err_set(err, LOOM_ENET, NULL, "the task at this address is not %s",
                                loom_net_task_name_(h->peer_role, h->peer_index, name, sizeof name));
        memcpy(h->peer_nonce, p + 9, LOOM_HS_NONCE);
        uint8_t want[32], r[1 + LOOM_HS_MAC + 32];
        mac(h, "loom-a", h->my_nonce, h->peer_nonce, want);
        /* Our proof goes out even when theirs failed, so both sides log the refusal. */
        r[0] = 3;
        mac(h, "loom-d", h->peer_nonce, h->my_nonce, r + 1);
        memcpy(r + 1 + LOOM_HS_MAC, h->digest, 32);
        frame_out(out, r, sizeof r);
        h->phase = 4;
        if (CRYPTO_memcmp(want, p + 9 + LOOM_HS_NONCE, 32) != 0) {
            loom_err_set(err, LOOM_ENET, NULL, "%s failed to prove the shared secret",
                         loom_net_task_name_(h->peer_role, h->peer_index, name, sizeof name));
            return loom_err_hint(err, "give every task the same cluster.secret_file or LOOM_CLUSTER_SECRET");
        }
        return LOOM_OK;
    }
    case 3: { /* acceptor: the dialer's proof and config digest */
        if (len != 1 + LOOM_HS_MAC + 32) return loom_err_set(err, LOOM_ENET, NULL, "bad proof (%zu bytes)", len);
        uint8_t want[32];
        mac(h, "loom-d", h->my_nonce, h->peer_nonce, want);
        if (CRYPTO_memcmp(want, p + 1, 32) != 0) { /* (it only claims the name: the caller gives its address) */
            loom_err_set(err, LOOM_ENET, NULL, "the peer claiming to be %s failed to prove the shared secret",
                         loom_net_task_name_(h->peer_role, h->peer_index, name, sizeof name));
            return loom_err_hint(err, "give every task the same cluster.secret_file or LOOM_CLUSTER_SECRET");
        }
        if (memcmp(h->digest, p + 1 + LOOM_HS_MAC, 32) == 0) {
            uint8_t r[2] = {4, 0};
            frame_out(out, r, 2);
            h->done = true;
            return LOOM_OK;
        }
        config_frame(h, out, 4, 1);
        h->phase = 5;
        return LOOM_OK;
    }
    case 4: /* dialer: accepted, or their config text */
        if (len < 2 || p[1] > 1) return loom_err_set(err, LOOM_ENET, NULL, "bad handshake verdict");
        if (p[1] == 0) {
            if (len != 2) return loom_err_set(err, LOOM_ENET, NULL, "bad handshake verdict");
            h->done = true;
            return LOOM_OK;
        }
        config_frame(h, out, 5, 1);
        return config_refuse(h, p + 2, len - 2, err);
    case 5: /* acceptor: the dialer's config text */
        if (len < 2) return loom_err_set(err, LOOM_ENET, NULL, "bad config text");
        return config_refuse(h, p + 2, len - 2, err);
    default:
        return loom_err_set(err, LOOM_ENET, NULL, "handshake in an unknown phase");
    }
}
