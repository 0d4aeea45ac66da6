/* net_internal.h - the transport's wire format, shared by net.c, group.c and
 * the fuzzers (tests/fuzz/fuzz_net_frame.c, fuzz_net_handshake.c).
 *
 * A frame is a 20-byte header and a payload:
 *   u32 magic "LOOM" (0x4d4f4f4c)  u16 version (1)  u16 flags (0)
 *   u32 type                       u32 payload length
 *   u32 CRC-32C of the header's first 16 bytes and the payload
 * all little-endian. The decoder never trusts a length beyond the caller's
 * bound (4 MiB while a connection is unauthenticated) and names what was wrong.
 *
 * The handshake (type LOOM_MSG_HELLO; the payload's first byte is the phase):
 *   1 dialer -> acceptor: its task, the task it means to reach, nonce_d
 *   2 acceptor -> dialer: its task, nonce_a, mac_a = HMAC(secret, "loom-a" nonce_d nonce_a ids)
 *   3 dialer -> acceptor: mac_d = HMAC(secret, "loom-d" nonce_a nonce_d ids), its config digest
 *   4 acceptor -> dialer: 0 = accepted, or 1 = configs differ + its config text
 *   5 dialer -> acceptor: (configs differ) its config text
 * Each side proves the secret on the other's fresh nonce, so a recorded
 * exchange proves nothing; the config digests are compared only between
 * authenticated peers, and config texts only go to them. */
#ifndef LOOM_NET_INTERNAL_H
#define LOOM_NET_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cluster/cluster.h"
#include "core/core.h"

#define LOOM_NET_MAGIC 0x4d4f4f4cu
#define LOOM_NET_VERSION 1
#define LOOM_NET_HDR 20
/* Largest frame an unauthenticated connection may send (the handshake's config text fits). */
#define LOOM_NET_HANDSHAKE_MAX (4u << 20)
/* Largest frame after the handshake. */
#define LOOM_NET_FRAME_MAX (1u << 30)

/* Types the transport's users share (>= LOOM_MSG_USER). */
enum {
    LOOM_MSG_GROUP_HELLO = LOOM_MSG_USER, /* group: my data port and token */
    LOOM_MSG_GROUP_ABORT,                 /* group: a rank failed a collective; the text says why */
    LOOM_MSG_GROUP_FIRST_FREE = LOOM_MSG_USER + 16,
};

typedef struct loom_net_frame {
    uint32_t       type;
    uint32_t       len;
    const uint8_t *payload; /* into the decoded bytes */
} loom_net_frame;

/* Writes a frame header for (type, payload) into hdr. */
void loom_net_frame_header_(uint8_t hdr[LOOM_NET_HDR], uint32_t type, const void *payload, uint32_t len);
/* Decodes one frame from the avail bytes at p: returns the bytes it takes
 * (> 0) with *f filled, 0 when more bytes are needed (*need, may be NULL,
 * gets how many in all), or -1 with err naming the fault (bad magic, version,
 * a length above max_len, a checksum mismatch). */
long loom_net_frame_decode_(const uint8_t *p, size_t avail, uint32_t max_len, loom_net_frame *f, size_t *need,
                            loom_err *err);

/* The handshake as a pure state machine, so the fuzzer drives it without
 * sockets. One per connection. */
enum { LOOM_HS_NONCE = 32, LOOM_HS_MAC = 32 };
typedef struct loom_hs {
    bool     dialer;
    int      phase;          /* the next phase expected from the other side */
    loom_role my_role, peer_role;
    int      my_index, peer_index;
    bool     peer_known;     /* peer_role/index are set (from phase 1 or the dial target) */
    uint8_t  my_nonce[LOOM_HS_NONCE], peer_nonce[LOOM_HS_NONCE];
    const uint8_t *secret;
    size_t   secret_len;
    const uint8_t *digest;   /* 32 bytes */
    const char *config_text; /* may be NULL */
    bool     done;           /* authenticated and configs agree */
    bool     mismatch;       /* configs differ: err names the first differing setting */
    char     peer_config_diff[512];
    /* Which (role, index) this acceptor will accept (returns true); NULL = any. */
    bool   (*accept_peer)(void *arg, loom_role role, int index);
    void    *accept_arg;
} loom_hs;

/* Starts a handshake; the dialer's first frame goes to out (framed). */
void loom_hs_init_(loom_hs *h, bool dialer, loom_role my_role, int my_index, loom_role peer_role, int peer_index,
                   const uint8_t *secret, size_t secret_len, const uint8_t digest[32], const char *config_text,
                   loom_buf *out);
/* Feeds one received HELLO payload; replies (framed) are appended to out.
 * Returns LOOM_OK (continue, or h->done), or an error (LOOM_ENET for a bad
 * message or a wrong secret, LOOM_ECONFIG for configs that differ) with err
 * set; after an error the connection is dropped. */
int loom_hs_feed_(loom_hs *h, const uint8_t *payload, size_t len, loom_buf *out, loom_err *err);

/* "worker:1" (static helpers so this module does not need the topology's code). */
char *loom_net_task_name_(loom_role role, int index, char *buf, size_t n);
/* The first line where two config texts differ, as "line N: `a` here, `b` there". */
void loom_net_config_diff_(const char *mine, const char *theirs, char *out, size_t n);

/* For the collectives (group.c). */
/* An eventfd that turns readable when a peer is lost or leaves, or a message
 * of alert_type arrives (read it to reset). */
int  loom_net_alert_fd_(loom_net *n, uint32_t alert_type);
/* What this task says it is doing, sent with every heartbeat. */
void loom_net_set_status_(loom_net *n, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* LOOM_ENET naming peer p (-1: any) when it was lost or left, else LOOM_OK. */
int  loom_net_peer_down_(loom_net *n, int p, loom_err *err);
/* Whether peer p is connected now (a tolerated peer may be down and back). */
bool loom_net_peer_up_(loom_net *n, int p);
/* loom_net_open for an elastic job: every peer tolerated from the start (it may come, leave and
 * come back); the open returns once all are up, or after start_timeout s with peer `need` up
 * (-1: none needed; the others keep being dialed and accepted). */
int  loom_net_open_partial_(loom_net **out, const loom_cluster *c, const loom_net_peer *peers, int n_peers,
                            double start_timeout, int need, loom_err *err);
/* strategy.elastic's unlisted workers (no address in the cluster): the
 * port this task's transport listens on (ephemeral when unlisted); where
 * peer p's connection comes from (its IP, into buf; -1: not connected);
 * where peer p listens ("" while unknown); and learning it: an unlisted
 * peer's address (host, port) is recorded and, when this task dials it,
 * dialed (a listed peer's is kept). */
int  loom_net_listen_port_(const loom_net *n);
int  loom_net_peer_ip_(loom_net *n, int p, char *buf, size_t len);
void loom_net_peer_host_(loom_net *n, int p, char *buf, size_t len);
int  loom_net_learn_peer_(loom_net *n, int p, const char *host, int port, loom_err *err);
/* Whether peer p (tolerated) is down without having said BYE: lost, not left on purpose. */
bool loom_net_peer_lost_(loom_net *n, int p);
/* Peer p's name, what its last heartbeat said, and how long ago it was heard. */
void loom_net_peer_info_(loom_net *n, int p, char *name, size_t name_n, char *status, size_t status_n, double *age);
const char *loom_net_name_(const loom_net *n);
/* Tests: the loop thread sleeps `seconds` at its next turn, as a thread
 * starved on a loaded machine does (callbacks, heartbeats, loss reports wait). */
void loom_net_stall_loop_(loom_net *n, double seconds);
/* cluster.heartbeat_timeout as the transport uses it (s). */
double loom_net_heartbeat_timeout_(const loom_net *n);
/* The TLS context of cluster.tls (cert, key, CA: both ends verified), for
 * the control connections and the ring's data connections. *out is set
 * (possibly) even on failure: SSL_CTX_free it. */
struct ssl_ctx_st;
int loom_net_tls_ctx_(const loom_cluster *c, struct ssl_ctx_st **out, loom_err *err);
/* The group's ring data connection: to the successor (recv_side false) or
 * from the predecessor (tests look at what crosses it). */
int loom_group_data_fd_(loom_group *g, bool recv_side);
/* Bytes queued to peer p, not yet written to its socket (tests). */
size_t loom_net_queued_(loom_net *n, int p);
/* Bytes of peer p's messages waiting for loom_net_recv (tests). */
size_t loom_net_recv_queued_(loom_net *n, int p);

#endif
