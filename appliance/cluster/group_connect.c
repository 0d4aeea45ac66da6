/* group_connect.c - a group's connection setup: the control plane's open
 * among the training ranks (loom_group_open, loom_group_open_bare) and the
 * ring's data connections (listen on an ephemeral port, tell the predecessor
 * the port and a token over the authenticated control plane, dial the
 * successor, accept only the predecessor's token; TLS on top with
 * cluster.tls). group.c's header comment describes the two planes.
 * Threads: the caller's, as the group's. */
#include "cluster/group_internal.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/rand.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define DATA_MAGIC "LOOMDATA"
#define TOKEN 32

void loom_group_task_of_rank_(const loom_cluster *c, int r, loom_role *role, int *index)
{
    if (c->n_tasks[LOOM_ROLE_CHIEF] > 0) {
        if (r == 0) *role = LOOM_ROLE_CHIEF, *index = 0;
        else *role = LOOM_ROLE_WORKER, *index = r - 1;
    } else
        *role = LOOM_ROLE_WORKER, *index = r;
}

static bool is_loopback_name(const char *h)
{
    return !strcmp(h, "localhost") || !strncmp(h, "127.", 4) || !strcmp(h, "::1");
}

static int set_sock(int fd)
{
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    /* Socket buffers stay with the kernel's autotuning: fixed sizes from 256 KiB
     * to 4 MiB measured no better on loopback, and fixing them turns the tuning off. */
    int fl = fcntl(fd, F_GETFL);
    return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

/* Reads exactly n bytes from a blocking-or-not fd within deadline (loom_now()). */
static int read_full(int fd, void *p, size_t n, double deadline)
{
    size_t got = 0;
    while (got < n) {
        ssize_t r = recv(fd, (uint8_t *)p + got, n - got, MSG_DONTWAIT);
        if (r > 0) {
            got += (size_t)r;
            continue;
        }
        if (r == 0) return -1;
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return -1;
        double left = deadline - loom_now();
        if (left <= 0) return -1;
        struct pollfd pf = {fd, POLLIN, 0};
        poll(&pf, 1, (int)(left * 1000) + 1);
    }
    return 0;
}

static int write_full(int fd, const void *p, size_t n, double deadline)
{
    size_t put = 0;
    while (put < n) {
        ssize_t r = send(fd, (const uint8_t *)p + put, n - put, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (r > 0) {
            put += (size_t)r;
            continue;
        }
        if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return -1;
        double left = deadline - loom_now();
        if (left <= 0) return -1;
        struct pollfd pf = {fd, POLLOUT, 0};
        poll(&pf, 1, (int)(left * 1000) + 1);
    }
    return 0;
}

/* cluster.tls: a TLS handshake on both data connections at once (each
 * rank is the client towards its successor and the server of its
 * predecessor; one after the other would wait round the ring forever),
 * bounded by the connect deadline. No session tickets: after the handshake
 * each connection carries data one way only. */
static int data_tls(loom_group *g, const loom_cluster *c, double deadline, loom_err *err)
{
    const char *who = loom_net_name_(g->net);
    int rc = loom_net_tls_ctx_(c, &g->ssl_ctx, err);
    if (rc) return rc;
    SSL_CTX_set_num_tickets(g->ssl_ctx, 0);
    SSL *s[2] = {g->send_ssl = SSL_new(g->ssl_ctx), g->recv_ssl = SSL_new(g->ssl_ctx)};
    int fd[2] = {g->send_fd, g->recv_fd};
    if (!s[0] || !s[1]) return loom_err_set(err, LOOM_ENOMEM, who, "cannot create the data connections' TLS");
    for (int k = 0; k < 2; k++) {
        SSL_set_fd(s[k], fd[k]);
        SSL_set_mode(s[k], SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    }
    SSL_set_connect_state(s[0]);
    SSL_set_accept_state(s[1]);
    bool done[2] = {false, false};
    int peer[2] = {(g->rank + 1) % g->size, (g->rank + g->size - 1) % g->size};
    while (!done[0] || !done[1]) {
        struct pollfd pf[2];
        int np = 0;
        for (int k = 0; k < 2; k++) {
            if (done[k]) continue;
            ERR_clear_error();
            int r = SSL_do_handshake(s[k]);
            if (r == 1) {
                done[k] = true;
                continue;
            }
            int e = SSL_get_error(s[k], r);
            if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) {
                pf[np++] = (struct pollfd){fd[k], (short)(e == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT), 0};
                continue;
            }
            char eb[256] = "the connection closed";
            unsigned long le = ERR_get_error();
            if (le) ERR_error_string_n(le, eb, sizeof eb);
            return loom_err_set(err, LOOM_ENET, who, "the TLS handshake of the ring's data connection %s %s failed: %s",
                                k ? "from" : "to", loom_group_rname_(g, peer[k]), eb),
                   loom_err_hint(err, "every task needs a certificate signed by cluster.tls_ca");
        }
        if (!np) continue;
        double left = deadline - loom_now();
        if (left <= 0)
            return loom_err_set(err, LOOM_ETIMEOUT, who, "the TLS handshake of the ring's data connections (to %s, "
                                "from %s) did not finish within cluster.connect_timeout = %g s",
                                loom_group_rname_(g, peer[0]), loom_group_rname_(g, peer[1]), c->connect_timeout);
        poll(pf, (nfds_t)np, left > 0.1 ? 100 : (int)(left * 1000) + 1);
        if ((rc = loom_net_peer_down_(g->net, -1, err))) return rc;
    }
    loom_debug("%s: the ring's data connections are encrypted (%s)", who, SSL_get_version(s[0]));
    return LOOM_OK;
}

/* A listening socket for the ring's data connection on this task's host
 * (every interface when that is not loopback), its port into *port. */
static int ring_listen(loom_group *g, const loom_cluster *c, int *lfd_out, int *port, loom_err *err)
{
    loom_role role;
    int index;
    loom_group_task_of_rank_(c, g->orig[g->rank], &role, &index);
    const loom_task_addr *me = &c->tasks[role][index];
    const char *who = loom_net_name_(g->net);
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(me->host, "0", &hints, &res) || !res)
        return loom_err_set(err, LOOM_ENET, who, "cannot resolve this task's host \"%s\"", me->host);
    struct sockaddr_storage sa;
    memcpy(&sa, res->ai_addr, res->ai_addrlen);
    socklen_t salen = res->ai_addrlen;
    freeaddrinfo(res);
    bool lo = sa.ss_family == AF_INET ? (ntohl(((struct sockaddr_in *)&sa)->sin_addr.s_addr) >> 24) == 127
                                      : IN6_IS_ADDR_LOOPBACK(&((struct sockaddr_in6 *)&sa)->sin6_addr);
    if (!lo) {
        if (sa.ss_family == AF_INET) ((struct sockaddr_in *)&sa)->sin_addr.s_addr = htonl(INADDR_ANY);
        else ((struct sockaddr_in6 *)&sa)->sin6_addr = in6addr_any;
    }
    int lfd = socket(sa.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&sa, salen) < 0 || listen(lfd, 8) < 0) {
        int e = errno;
        if (lfd >= 0) close(lfd);
        return loom_err_set(err, LOOM_ENET, who, "cannot listen for the ring's data connection on %s: %s", me->host,
                            strerror(e));
    }
    struct sockaddr_storage bound;
    socklen_t bl = sizeof bound;
    getsockname(lfd, (struct sockaddr *)&bound, &bl);
    *port = ntohs(bound.ss_family == AF_INET ? ((struct sockaddr_in *)&bound)->sin_port
                                             : ((struct sockaddr_in6 *)&bound)->sin6_port);
    *lfd_out = lfd;
    return LOOM_OK;
}

/* Connects to the successor's data port (hello: its port and token, as its
 * GROUP_HELLO said), on the host the cluster names for it, bounded by
 * connect_timeout as the control connections are, and presents its token. */
static int ring_dial(loom_group *g, const loom_cluster *c, const uint8_t *hello, double deadline, int *sfd_out,
                     loom_err *err)
{
    const char *who = loom_net_name_(g->net);
    (void)c;
    char host[LOOM_HOST_MAX]; /* the cluster's, or (an unlisted worker, elastic) where it said it listens */
    loom_net_peer_host_(g->net, g->next_peer, host, sizeof host);
    char ps[16];
    snprintf(ps, sizeof ps, "%u", loom_group_get32_(hello));
    struct addrinfo hints = {0}, *r2 = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    if (!host[0] || getaddrinfo(host, ps, &hints, &r2) || !r2)
        return loom_err_set(err, LOOM_ENET, who, "cannot resolve \"%s\" (%s's address)", host,
                            loom_group_rname_(g, (g->rank + 1) % g->size));
    int sfd = socket(r2->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    int e = sfd < 0 ? errno : 0;
    if (sfd >= 0 && connect(sfd, r2->ai_addr, r2->ai_addrlen) < 0) {
        e = errno;
        if (e == EINPROGRESS) {
            struct pollfd pf = {sfd, POLLOUT, 0};
            double left = deadline - loom_now();
            socklen_t el = sizeof e;
            if (left <= 0 || poll(&pf, 1, (int)(left * 1000) + 1) <= 0) e = ETIMEDOUT;
            else if (getsockopt(sfd, SOL_SOCKET, SO_ERROR, &e, &el) < 0) e = errno;
        }
    }
    freeaddrinfo(r2);
    *sfd_out = sfd;
    if (e)
        return loom_err_set(err, LOOM_ENET, who, "connect(%s:%s) for the ring's data failed: %s", host, ps,
                            strerror(e));
    uint8_t pres[8 + 4 + TOKEN];
    memcpy(pres, DATA_MAGIC, 8);
    loom_group_put32_(pres + 8, (uint32_t)g->rank);
    memcpy(pres + 12, hello + 4, TOKEN);
    set_sock(sfd);
    if (write_full(sfd, pres, sizeof pres, deadline))
        return loom_err_set(err, LOOM_ENET, who, "the ring's data connection to %s closed",
                            loom_group_rname_(g, (g->rank + 1) % g->size));
    return LOOM_OK;
}

/* Accepts the predecessor on lfd: only the connection that shows our token
 * (any other is dropped and logged with its address); a lost predecessor or
 * the deadline ends the wait. */
static int ring_accept(loom_group *g, const loom_cluster *c, int lfd, const uint8_t *token, double deadline,
                       int *rfd_out, loom_err *err)
{
    const char *who = loom_net_name_(g->net);
    int prev = (g->rank + g->size - 1) % g->size;
    int rc;
    for (;;) {
        double left = deadline - loom_now();
        struct pollfd pf = {lfd, POLLIN, 0};
        if (left <= 0 || poll(&pf, 1, left > 0.1 ? 100 : (int)(left * 1000) + 1) <= 0) {
            if ((rc = loom_net_peer_down_(g->net, g->prev_peer, err))) return rc;
            if (g->elastic && !loom_net_peer_up_(g->net, g->prev_peer))
                return loom_err_set(err, LOOM_ENET, who, "lost %s while the ring re-formed", loom_group_rname_(g, prev));
            if (deadline - loom_now() > 0) continue;
            return loom_err_set(err, LOOM_ETIMEOUT, who, "%s did not open its ring data connection within %g s",
                                loom_group_rname_(g, prev), c->connect_timeout);
        }
        struct sockaddr_storage from;
        socklen_t fl = sizeof from;
        int fd = accept4(lfd, (struct sockaddr *)&from, &fl, SOCK_CLOEXEC);
        if (fd < 0) continue;
        set_sock(fd);
        uint8_t pres[8 + 4 + TOKEN];
        double dl = loom_now() + 5 < deadline ? loom_now() + 5 : deadline;
        char addr[INET6_ADDRSTRLEN] = "?";
        if (from.ss_family == AF_INET) inet_ntop(AF_INET, &((struct sockaddr_in *)&from)->sin_addr, addr, sizeof addr);
        else inet_ntop(AF_INET6, &((struct sockaddr_in6 *)&from)->sin6_addr, addr, sizeof addr);
        if (read_full(fd, pres, sizeof pres, dl) || memcmp(pres, DATA_MAGIC, 8) != 0 ||
            loom_group_get32_(pres + 8) != (uint32_t)prev || CRYPTO_memcmp(pres + 12, token, TOKEN) != 0) {
            loom_log(LOOM_LOG_WARN, "%s: dropped a connection to the ring's data port from %s: it did not present "
                                    "the token",
                     who, addr);
            close(fd);
            continue;
        }
        *rfd_out = fd;
        return LOOM_OK;
    }
}

/* The data plane, in order: listen, tell the predecessor where (GROUP_HELLO:
 * the port and a fresh token), connect to the successor, accept the
 * predecessor; every failure closes what the earlier steps opened. */
int loom_group_ring_connect_(loom_group *g, const loom_cluster *c, loom_err *err)
{
    double deadline = loom_now() + (c->connect_timeout > 0 ? c->connect_timeout : 60);
    const char *who = loom_net_name_(g->net);
    int lfd = -1, port = 0;
    int rc = ring_listen(g, c, &lfd, &port, err);
    if (rc) return rc;
    uint8_t token[TOKEN], hello[4 + TOKEN];
    if (RAND_bytes(token, TOKEN) != 1) {
        close(lfd);
        return loom_err_set(err, LOOM_ENET, who, "no random bytes for the ring's token");
    }
    loom_group_put32_(hello, (uint32_t)port);
    memcpy(hello + 4, token, TOKEN);
    rc = loom_net_send(g->net, g->prev_peer, LOOM_MSG_GROUP_HELLO, hello, sizeof hello, err);
    loom_buf m;
    loom_buf_init(&m);
    if (!rc)
        rc = loom_net_recv(g->net, g->next_peer, LOOM_MSG_GROUP_HELLO, LOOM_MSG_GROUP_HELLO, NULL, NULL, &m,
                           deadline - loom_now(), err);
    if (!rc && m.len != sizeof hello) rc = loom_err_set(err, LOOM_ENET, who, "bad ring hello from %s", loom_group_rname_(g, (g->rank + 1) % g->size));
    int sfd = -1, rfd = -1;
    if (!rc) rc = ring_dial(g, c, m.data, deadline, &sfd, err);
    loom_buf_fini(&m);
    if (!rc) rc = ring_accept(g, c, lfd, token, deadline, &rfd, err);
    close(lfd);
    if (rc) {
        if (sfd >= 0) close(sfd);
        if (rfd >= 0) close(rfd);
        return rc;
    }
    g->send_fd = sfd, g->recv_fd = rfd;
    const char *clear = getenv("LOOM_RING_TLS");
    if (c->tls && !(clear && !strcmp(clear, "0"))) return data_tls(g, c, deadline, err);
    if (c->tls) loom_warn("%s: LOOM_RING_TLS=0: the ring's data connections are not encrypted (cluster.tls covers "
                          "the control connections only)", who);
    return LOOM_OK;
}

int loom_group_local_ranks_(loom_group *g)
{
    const loom_cluster *c = g->cluster;
    loom_role mr;
    int mi, local = 0;
    loom_group_task_of_rank_(c, g->orig[g->rank], &mr, &mi);
    const char *mh = c->tasks[mr][mi].host;
    for (int r = 0; r < g->size; r++) {
        char h[LOOM_HOST_MAX] = "";
        for (int p = 0; p < g->n_peers && r != g->rank; p++)
            if (g->peer_orig[p] == g->orig[r]) loom_net_peer_host_(g->net, p, h, sizeof h);
        if (r == g->rank || !strcmp(h, mh) || (is_loopback_name(h) && is_loopback_name(mh))) local++;
    }
    return local;
}

static int group_open(loom_group **out, const loom_cluster *c, double collective_timeout, bool ring, uint64_t reads,
                      double start_timeout, loom_err *err)
{
    *out = NULL;
    if (c->rank < 0 || c->rank >= loom_cluster_train_slots(c))
        return loom_err_set(err, LOOM_EUSAGE, NULL, "this task is not one of the %d training ranks",
                            loom_cluster_train_slots(c));
    loom_group *g = loom_calloc(1, sizeof *g);
    int n = loom_cluster_train_slots(c); /* (elastic: the unlisted workers too; the first ring is formed by the chief) */
    loom_net_peer *peers = loom_calloc((size_t)n, sizeof *peers);
    if (g) g->peer_rank = loom_calloc((size_t)n, sizeof *g->peer_rank);
    if (g) g->waited = loom_calloc((size_t)n, sizeof *g->waited);
    if (g) g->orig = loom_calloc((size_t)n, sizeof *g->orig), g->peer_orig = loom_calloc((size_t)n, sizeof *g->peer_orig);
    if (!g || !peers || !g->peer_rank || !g->waited || !g->orig || !g->peer_orig) {
        if (g) loom_free(g->peer_rank), loom_free(g->waited), loom_free(g->orig), loom_free(g->peer_orig);
        loom_free(g), loom_free(peers);
        return loom_err_set(err, LOOM_ENOMEM, NULL, "no memory for the group");
    }
    g->rank = c->rank, g->size = n, g->timeout = collective_timeout;
    g->send_fd = g->recv_fd = g->alert_fd = -1;
    g->cluster = c;
    int np = 0;
    for (int r = 0; r < n; r++) {
        g->orig[r] = r;
        loom_role role;
        int index;
        loom_group_task_of_rank_(c, r, &role, &index);
        if (r < 16) loom_net_task_name_(role, index, g->names[r], sizeof g->names[r]);
        if (r == g->rank) continue;
        if (r == (g->rank + 1) % n) g->next_peer = np;
        if (r == (g->rank + n - 1) % n) g->prev_peer = np;
        g->peer_rank[np] = r;
        g->peer_orig[np] = r;
        peers[np].role = role, peers[np++].index = index;
    }
    g->n_peers = np;
    /* elastic: the chief (rank 0, the first peer of the others) is the one needed */
    int rc = start_timeout >= 0 ? loom_net_open_partial_(&g->net, c, peers, np, start_timeout, g->rank ? 0 : -1, err)
                                : loom_net_open(&g->net, c, peers, np, err);
    loom_free(peers);
    if (!rc && n > 1) {
        /* the group's own types; a user of loom_group_net declares its own */
        loom_net_reads(g->net, -1,
                       LOOM_NET_TYPE_BIT(LOOM_MSG_GROUP_HELLO) | LOOM_NET_TYPE_BIT(LOOM_MSG_GROUP_ABORT) | reads);
        g->alert_fd = loom_net_alert_fd_(g->net, LOOM_MSG_GROUP_ABORT);
        if (ring) rc = loom_group_ring_connect_(g, c, err);
    }
    if (rc) {
        loom_group_close(g);
        return rc;
    }
    if (n > 1) {
        /* The ranks on this host (same host name, or both loopback), against its cores: a
         * sender thread when each rank has two cores, polling before sleeping when it has one. */
        int local = loom_group_local_ranks_(g), cores = loom_num_cores();
        const char *e = getenv("LOOM_RING_SENDER");
        bool use_sender = e && *e ? atoi(e) != 0 : cores >= 2 * local;
        g->spin = local <= cores;
        g->use_sender = use_sender;
        if (use_sender && ring && loom_group_sender_start_(g))
            loom_debug("%s: no sender thread; sending from the caller", loom_net_name_(g->net));
    }
    loom_net_set_status_(g->net, ring ? "ready, before the first collective" : "connected, the ring not formed");
    *out = g;
    return LOOM_OK;
}

int loom_group_open(loom_group **out, const loom_cluster *c, double collective_timeout, loom_err *err)
{
    return group_open(out, c, collective_timeout, true, 0, -1, err);
}

int loom_group_open_bare(loom_group **out, const loom_cluster *c, double collective_timeout, uint64_t reads,
                         loom_err *err)
{
    return group_open(out, c, collective_timeout, false, reads, -1, err);
}

int loom_group_open_elastic(loom_group **out, const loom_cluster *c, double collective_timeout, uint64_t reads,
                            double start_timeout, loom_err *err)
{
    return group_open(out, c, collective_timeout, false, reads, start_timeout > 0 ? start_timeout : 0, err);
}
