/* group_internal.h - the group's state, shared by group.c (the collectives,
 * membership changes) and group_connect.c (connection setup: the control
 * plane's open, the ring's data connections and their handshake).
 * Private to appliance/cluster/. */
#ifndef LOOM_GROUP_INTERNAL_H
#define LOOM_GROUP_INTERNAL_H
#include "cluster/net_internal.h"

#include <openssl/ssl.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

typedef struct sender sender;
typedef struct step step;

struct loom_group {
    loom_net *net;
    int       rank, size;
    int       next_peer, prev_peer;  /* net peer indexes of the ring neighbours */
    int      *peer_rank;             /* net peer index -> rank */
    double   *waited;                /* net peer index -> seconds collectives blocked on it */
    int       send_fd, recv_fd, alert_fd;
    double    timeout;
    uint64_t  seq;
    int       broken;
    loom_err  broken_err;
    uint8_t  *tmp;
    size_t    tmp_cap;
    uint16_t *wire;                   /* the 16-bit formats' copy of the buffer, as it crosses the ring */
    size_t    wire_cap;               /* (elements) */
    char      names[16][32];          /* rank -> task name, for messages (first 16) */
    sender   *sender;                 /* sends of large collectives; NULL: the calling thread sends */
    bool      spin;                   /* every rank on this host has a core of its own */
    SSL_CTX  *ssl_ctx;                /* cluster.tls: the data connections' TLS (NULL: clear TCP) */
    SSL      *send_ssl, *recv_ssl;    /* on send_fd (we are the client), recv_fd (the server) */
    /* elastic (loom_group_elastic): the members are a subset of the cluster's
     * training ranks, renumbered 0 .. size-1 in their original order */
    const loom_cluster *cluster;      /* borrowed: outlives the group */
    bool      elastic;
    uint32_t  epoch;                  /* membership changes so far: an abort of an older one is stale */
    int       n_peers;                /* net peers: the cluster's training ranks but this one */
    int      *orig;                   /* rank -> the cluster's training rank */
    int      *peer_orig;              /* net peer index -> the cluster's training rank */
    bool      use_sender;             /* a sender thread with each ring (loom_group_reform starts it) */
};
static inline const char *loom_group_rname_(const loom_group *g, int r)
{
    return r >= 0 && r < 16 ? g->names[r] : "a rank";
}
static inline void loom_group_put32_(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); } /* little-endian hosts only */
static inline uint32_t loom_group_get32_(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Training rank r of cluster c as its (role, index): the chief is rank 0 when there is one. */
void loom_group_task_of_rank_(const loom_cluster *c, int r, loom_role *role, int *index);
/* The ring's data connections to this rank's neighbours in g's current membership (group_connect.c). */
int  loom_group_ring_connect_(loom_group *g, const loom_cluster *c, loom_err *err);
/* The members on this task's host (same host name, or both loopback; this task counted; an unlisted
 * member by the address the chief gave): g->spin is whether each has a core (group_connect.c). */
int  loom_group_local_ranks_(loom_group *g);
/* Starts the sender thread of large collectives (group.c); nonzero: none, the caller sends. */
int  loom_group_sender_start_(loom_group *g);

#endif
