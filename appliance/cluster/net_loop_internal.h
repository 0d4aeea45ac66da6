/* net_loop_internal.h - net.c's connections, peers and the transport's
 * state, shared by net.c (the event loop: frames, the handshake, accepting
 * and dialing, timers; sending and receiving) and net_open.c (opening and
 * closing the transport). Private to those two; the locking rules are
 * net.c's file comment. */
#ifndef LOOM_NET_LOOP_INTERNAL_H
#define LOOM_NET_LOOP_INTERNAL_H

#include "cluster/net_internal.h"

#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/listener.h>
#include <openssl/ssl.h>
#include <pthread.h>
#include <sys/socket.h>

typedef struct conn conn;

enum { P_WAIT, P_UP, P_LOST, P_GONE };

typedef struct net_peer {
    loom_role role;
    int       index;
    char      name[32];
    char      addr[LOOM_HOST_MAX + 16];  /* host:port as written */
    struct sockaddr_storage sa;
    socklen_t salen;
    bool      dial;          /* we connect to it (else it connects to us) */
    int       state;         /* P_*; under mu */
    conn     *c;             /* its authenticated connection (loop thread; under mu) */
    struct bufferevent *bev; /* c's, with a reference of its own held until net_free, so the
                                caller's thread can write to it without locking it under mu */
    double    last_heard;    /* loom_now() of its last frame */
    char      status[160];   /* what its last heartbeat said it was doing; under mu */
    char      gone_reason[160];
    int       attempts;
    char      last_error[700];
    struct event *retry_ev;
    bool      tolerated;     /* may leave and come back (loom_net_tolerate) */
    bool      left;          /* a tolerated peer's last departure was on purpose (BYE) */
    size_t    rq_bytes;      /* bytes of its messages queued for loom_net_recv; under mu */
    bool      paused;        /* rq_bytes passed recvq_max: its connection is not read; under mu */
    bool      resume;        /* rq_bytes fell back under recvq_max: read it again (on_resume); under mu */
    uint64_t  reads;         /* user types read from it (loom_net_reads; 0: any, none declared); under mu */
    bool      unlisted;      /* (elastic) no address in the cluster: not waited for at open; dialed once
                                loom_net_learn_peer_ gives its address; under mu */
    char      host[LOOM_HOST_MAX]; /* where it listens ("" while unlisted): the ring dials its data port there */
} net_peer;

struct conn {
    loom_net           *n;
    struct bufferevent *bev;
    char                addr[LOOM_HOST_MAX + 16]; /* the other end, "127.0.0.1:40312" */
    int                 peer;     /* index into n->peers once known, else -1 */
    bool                dialer, authed, closing;
    bool                pending;  /* accepted, handshake not done: counted in n->n_pending */
    bool                connected; /* (dialer) the TCP connection was made */
    double              t_open;
    loom_hs             hs;
    struct event       *timer;    /* handshake deadline, then (closing) the flush bound */
    conn               *next;     /* n->conns */
};

typedef struct qmsg {
    struct qmsg *next;
    int          from;
    uint32_t     type;
    uint8_t     *data;
    size_t       len;
} qmsg;

struct loom_net {
    struct event_base     *base;
    struct evconnlistener *lis;
    pthread_t              thread;
    bool                   running;
    pthread_mutex_t        mu;
    pthread_cond_t         cv;
    loom_role              role;
    int                    index;
    char                   name[32];
    char                   listen_addr[LOOM_HOST_MAX + 16];
    int                    listen_port; /* as bound (an unlisted task's is ephemeral) */
    uint8_t                secret[64];
    size_t                 secret_len;
    uint8_t                digest[32];
    char                  *config_text;
    double                 connect_timeout, hb_timeout, hb_interval, hs_timeout;
    size_t                 sendq_max;  /* bytes queued to one peer at most (loom_net_send waits) */
    size_t                 recvq_max;  /* bytes received from one peer held for loom_net_recv before its
                                          connection stops being read */
    SSL_CTX               *ssl;
    net_peer              *peers;
    int                    n_peers, n_up;
    double                 t_open;
    int                    fatal;    /* open failed (loop thread found it); under mu */
    loom_err               fatal_err;
    int                    lost;     /* first lost peer, -1 none; under mu */
    loom_err               lost_err;
    qmsg                  *qhead, *qtail;
    char                   status[160];
    conn                  *conns;
    struct event          *hb_ev, *deadline_ev, *close_ev;
    struct event          *resume_ev; /* activated by loom_net_recv: read paused peers again */
    bool                   open_done, closing;
    /* loom_net_open_partial_: every peer tolerated from the start; the open returns once all are up,
     * or after partial_after s with peer `need` up (-1: none needed) */
    bool                   partial;
    double                 partial_after;
    int                    need;
    double                 close_started;
    int                    alert_fd; /* eventfd: readable when a peer is lost or gone, or an alert message came */
    uint32_t               alert_type;
    struct bufferevent   **retired;  /* tolerated peers' earlier connections, referenced until net_free */
    int                    n_retired;
    /* floods (loop thread): see the file's comment */
    int                    n_pending, pending_max;
    int                    reserve_fd;  /* an open /dev/null, given up to shed a connection on EMFILE */
    struct event          *relisten_ev; /* enables the paused listener again */
    loom_ratelimit         accept_rl, evict_rl, other_rl;
    struct addr_lim {
        char           host[64];
        loom_ratelimit rl;
        double         used;
    } lims[16];
};

/* Whether every peer with an address in the cluster is up (an unlisted one, under strategy.elastic,
 * is not waited for). mu held, or before the loop runs. */
static inline bool net_listed_up_(const loom_net *n)
{
    for (int i = 0; i < n->n_peers; i++)
        if (!n->peers[i].unlisted && n->peers[i].state != P_UP) return false;
    return true;
}

/* A dial's retry timer argument: the transport and the peer. */
typedef struct dial_arg { loom_net *n; int p; } dial_arg;

/* The loop's functions net_open.c wires up (net.c). */
int net_bev_send_(struct bufferevent *bev, uint32_t type, const void *buf, size_t len);
/* host:port to a socket address (the first getaddrinfo gives); err names `who` (net_open.c) */
int net_resolve_(const char *host, int port, struct sockaddr_storage *sa, socklen_t *len, const char *who,
                 loom_err *err);
void net_conn_free_(conn *c);
void net_dial_cb_(evutil_socket_t fd, short what, void *arg);
void net_drain_input_(struct bufferevent *bev);
void *net_loop_main_(void *arg);
void net_on_accept_(struct evconnlistener *l, evutil_socket_t fd, struct sockaddr *sa, int salen, void *arg);
void net_on_accept_error_(struct evconnlistener *l, void *arg);
void net_on_close_(evutil_socket_t fd, short what, void *arg);
void net_on_deadline_(evutil_socket_t fd, short what, void *arg);
void net_on_heartbeat_(evutil_socket_t fd, short what, void *arg);
void net_on_relisten_(evutil_socket_t fd, short what, void *arg);
void net_on_resume_(evutil_socket_t fd, short what, void *arg);

#endif
