/* net_open.c - opening the cluster transport (net.c): resolving the tasks'
 * addresses, TLS, the event base, listening and dialing each peer, waiting
 * for every peer's handshake within connect_timeout; and closing it (a BYE
 * to each peer, the loop stopped, everything freed). Threads: the caller's;
 * the loop thread it starts is net.c's. */
#include "cluster/net_loop_internal.h"


#include <arpa/inet.h>
#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/bufferevent_ssl.h>
#include <event2/event.h>
#include <event2/listener.h>
#include <event2/thread.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <linux/sockios.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* ---- opening and closing ---------------------------------------------------- */

static bool is_loopback(const struct sockaddr *sa)
{
    if (sa->sa_family == AF_INET)
        return (ntohl(((const struct sockaddr_in *)sa)->sin_addr.s_addr) >> 24) == 127;
    if (sa->sa_family == AF_INET6) {
        const struct in6_addr *a = &((const struct sockaddr_in6 *)sa)->sin6_addr;
        if (IN6_IS_ADDR_LOOPBACK(a)) return true;
        if (IN6_IS_ADDR_V4MAPPED(a)) return a->s6_addr[12] == 127;
    }
    return false;
}

int net_resolve_(const char *host, int port, struct sockaddr_storage *sa, socklen_t *len, const char *who,
                 loom_err *err)
{
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    int rc = getaddrinfo(host, ps, &hints, &res);
    if (rc || !res) {
        loom_err_set(err, LOOM_ENET, who, "cannot resolve host \"%s\": %s", host, rc ? gai_strerror(rc) : "no address");
        return loom_err_hint(err, "check the cluster section's addresses (or TF_CONFIG, or the Slurm node list)");
    }
    memcpy(sa, res->ai_addr, res->ai_addrlen);
    *len = res->ai_addrlen;
    freeaddrinfo(res);
    return LOOM_OK;
}

/* (strategy.elastic: the workers past the listed ones too, up to n_train_slots: unlisted, host "") */
static const loom_task_addr *task_addr(const loom_cluster *c, loom_role role, int index)
{
    int n = (unsigned)role < LOOM_ROLE_COUNT ? c->n_tasks[role] : 0;
    if (role == LOOM_ROLE_WORKER) n += loom_cluster_train_slots(c) - c->n_train_ranks;
    if ((unsigned)role >= LOOM_ROLE_COUNT || index < 0 || index >= n || !c->tasks[role]) return NULL;
    return &c->tasks[role][index];
}

int loom_net_tls_ctx_(const loom_cluster *c, SSL_CTX **out, loom_err *err)
{
    SSL_CTX *ctx = *out = SSL_CTX_new(TLS_method());
    if (!ctx) return loom_err_set(err, LOOM_ENET, NULL, "cannot create a TLS context");
    SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
    char eb[256];
    if (!c->tls_cert[0] || !c->tls_key[0])
        return loom_err_set(err, LOOM_ECONFIG, "cluster.tls", "cluster.tls needs cluster.tls_cert and cluster.tls_key");
    if (SSL_CTX_use_certificate_chain_file(ctx, c->tls_cert) != 1) {
        ERR_error_string_n(ERR_get_error(), eb, sizeof eb);
        return loom_err_set(err, LOOM_ECONFIG, c->tls_cert, "cannot load the TLS certificate: %s", eb);
    }
    if (SSL_CTX_use_PrivateKey_file(ctx, c->tls_key, SSL_FILETYPE_PEM) != 1 || SSL_CTX_check_private_key(ctx) != 1) {
        ERR_error_string_n(ERR_get_error(), eb, sizeof eb);
        return loom_err_set(err, LOOM_ECONFIG, c->tls_key, "cannot load the TLS key: %s", eb);
    }
    if (c->tls_ca[0]) {
        if (SSL_CTX_load_verify_locations(ctx, c->tls_ca, NULL) != 1) {
            ERR_error_string_n(ERR_get_error(), eb, sizeof eb);
            return loom_err_set(err, LOOM_ECONFIG, c->tls_ca, "cannot load the TLS CA: %s", eb);
        }
        /* Both ends present certificates signed by the CA (names are not
         * checked: tasks are addressed by IP as often as by name; the shared
         * secret binds the peer's identity). */
        SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, NULL);
    }
    return LOOM_OK;
}

static int tls_setup(loom_net *n, const loom_cluster *c, loom_err *err) { return loom_net_tls_ctx_(c, &n->ssl, err); }

static void net_free(loom_net *n)
{
    if (!n) return;
    if (n->running) {
        pthread_mutex_lock(&n->mu);
        n->closing = true;
        pthread_mutex_unlock(&n->mu);
        n->close_started = loom_now();
        event_active(n->close_ev, EV_TIMEOUT, 0);
        pthread_join(n->thread, NULL);
    }
    while (n->conns) net_conn_free_(n->conns);
    for (int i = 0; i < n->n_peers; i++)
        if (n->peers[i].bev) {
            net_drain_input_(n->peers[i].bev); /* what came after net_conn_free_'s drain */
            bufferevent_decref(n->peers[i].bev);
        }
    for (int i = 0; i < n->n_retired; i++) bufferevent_decref(n->retired[i]);
    loom_free(n->retired);
    for (int i = 0; i < n->n_peers; i++)
        if (n->peers[i].retry_ev) {
            loom_free(event_get_callback_arg(n->peers[i].retry_ev));
            event_free(n->peers[i].retry_ev);
        }
    if (n->lis) evconnlistener_free(n->lis);
    if (n->hb_ev) event_free(n->hb_ev);
    if (n->deadline_ev) event_free(n->deadline_ev);
    if (n->close_ev) event_free(n->close_ev);
    if (n->resume_ev) event_free(n->resume_ev);
    if (n->relisten_ev) event_free(n->relisten_ev);
    if (n->reserve_fd >= 0) close(n->reserve_fd);
    if (n->base) event_base_free(n->base);
    if (n->ssl) SSL_CTX_free(n->ssl);
    for (qmsg *q = n->qhead, *nx; q; q = nx) {
        nx = q->next;
        loom_free(q->data);
        loom_free(q);
    }
    if (n->alert_fd >= 0) close(n->alert_fd);
    OPENSSL_cleanse(n->secret, sizeof n->secret);
    loom_free(n->config_text);
    loom_free(n->peers);
    pthread_mutex_destroy(&n->mu);
    pthread_cond_destroy(&n->cv);
    loom_free(n);
}

static struct timeval tv_of(double s)
{
    if (s < 0) s = 0;
    struct timeval tv = {(time_t)s, (suseconds_t)((s - (double)(time_t)s) * 1e6)};
    return tv;
}

/* A transport for task me (myname) of c with n_peers peers, its settings
 * taken from c; nothing opened yet. */
static int net_new(loom_net **out, const loom_cluster *c, const loom_task_addr *me, const char *myname, int n_peers,
                   loom_err *err)
{
    loom_net *n = loom_calloc(1, sizeof *n);
    if (!n) return loom_err_set(err, LOOM_ENOMEM, NULL, "no memory for the transport");
    pthread_mutex_init(&n->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&n->cv, &ca);
    pthread_condattr_destroy(&ca);
    n->alert_fd = -1;
    n->reserve_fd = -1;
    n->lost = -1;
    n->accept_rl = n->evict_rl = (loom_ratelimit){.interval = 1, .burst = 1};
    n->other_rl = (loom_ratelimit){.interval = 1, .burst = 5};
    n->role = c->role, n->index = c->index;
    snprintf(n->name, sizeof n->name, "%s", myname);
    snprintf(n->listen_addr, sizeof n->listen_addr, "%s:%d", me->host, me->port);
    memcpy(n->secret, c->secret, c->secret_len <= sizeof n->secret ? c->secret_len : sizeof n->secret);
    n->secret_len = c->secret_len <= sizeof n->secret ? c->secret_len : sizeof n->secret;
    memcpy(n->digest, c->config_digest, 32);
    n->config_text = loom_strdup(c->config_text ? c->config_text : "");
    n->connect_timeout = c->connect_timeout > 0 ? c->connect_timeout : 60;
    n->hb_timeout = c->heartbeat_timeout > 0 ? c->heartbeat_timeout : 30;
    n->sendq_max = c->send_queue_max > 0 ? c->send_queue_max : LOOM_NET_SENDQ_MAX;
    n->recvq_max = c->recv_queue_max > 0 ? c->recv_queue_max : LOOM_NET_RECVQ_MAX;
    n->hb_interval = c->heartbeat_interval > 0 ? c->heartbeat_interval : n->hb_timeout / 5;
    n->hs_timeout = n->connect_timeout < 10 ? n->connect_timeout : 10;
    if (n->hs_timeout < 1) n->hs_timeout = 1;
    n->peers = loom_calloc(n_peers > 0 ? (size_t)n_peers : 1, sizeof *n->peers);
    n->n_peers = n_peers;
    n->alert_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (!n->config_text || !n->peers || n->alert_fd < 0) {
        net_free(n);
        return loom_err_set(err, LOOM_ENOMEM, NULL, "no memory for the transport");
    }
    *out = n;
    return LOOM_OK;
}

/* Resolves this task's address (into my_sa) and every peer's, before any
 * socket opens; then the secret rule (non-loopback needs one, unless
 * cluster.insecure) and the TLS context. */
static int net_resolve(loom_net *n, const loom_cluster *c, const loom_task_addr *me, const loom_net_peer *peers,
                       struct sockaddr_storage *my_sa, socklen_t *my_len, loom_err *err)
{
    int rc = net_resolve_(me->host, me->port, my_sa, my_len, n->listen_addr, err);
    bool all_loopback = is_loopback((struct sockaddr *)my_sa);
    for (int i = 0; !rc && i < n->n_peers; i++) {
        net_peer *pe = &n->peers[i];
        const loom_task_addr *t = task_addr(c, peers[i].role, peers[i].index);
        pe->role = peers[i].role, pe->index = peers[i].index;
        loom_net_task_name_(pe->role, pe->index, pe->name, sizeof pe->name);
        if (!t) return loom_err_set(err, LOOM_EUSAGE, NULL, "peer %s is not in the cluster", pe->name);
        if (pe->role == c->role && pe->index == c->index)
            return loom_err_set(err, LOOM_EUSAGE, NULL, "%s lists itself as a peer", pe->name);
        pe->dial = ((int)c->role * 1000000 + c->index) > ((int)pe->role * 1000000 + pe->index);
        snprintf(pe->status, sizeof pe->status, "starting (no heartbeat yet)");
        pe->unlisted = !t->host[0]; /* (elastic) its address comes when it connects: loom_net_learn_peer_ */
        if (pe->unlisted) {
            snprintf(pe->addr, sizeof pe->addr, "(unlisted: address not known yet)");
            continue;
        }
        snprintf(pe->host, sizeof pe->host, "%s", t->host);
        snprintf(pe->addr, sizeof pe->addr, "%s:%d", t->host, t->port);
        rc = net_resolve_(t->host, t->port, &pe->sa, &pe->salen, pe->addr, err);
        if (!rc && !is_loopback((struct sockaddr *)&pe->sa)) all_loopback = false;
    }
    if (!rc && c->secret_len == 0) {
        if (!all_loopback && !c->insecure) {
            rc = loom_err_set(err, LOOM_ECONFIG, "cluster.secret_file",
                              "%s: the cluster has non-loopback addresses and no shared secret", n->name);
            loom_err_hint(err, "set cluster.secret_file or LOOM_CLUSTER_SECRET on every task (or cluster.insecure "
                               "= true on a trusted network)");
        } else
            loom_warn("%s: no cluster secret (cluster.secret_file, LOOM_CLUSTER_SECRET): connections are %s",
                      n->name, all_loopback ? "authenticated by nothing but loopback" : "unauthenticated (insecure)");
    }
    if (!rc && c->tls) rc = tls_setup(n, c, err);
    return rc;
}

/* The event base, the listener, the timers and one dial event per peer
 * (armed now for the peers this task dials). Listens on the task's address
 * when it is a loopback one; on every interface otherwise (a name in the
 * cluster section may resolve to an address this host does not own, as a
 * Kubernetes service's does). */
static int net_listen(loom_net *n, const struct sockaddr_storage *my_sa, socklen_t my_len, loom_err *err)
{
    n->base = event_base_new();
    if (!n->base) return loom_err_set(err, LOOM_ENET, NULL, "event_base_new failed");
    struct sockaddr_storage bind_sa = *my_sa;
    if (!is_loopback((const struct sockaddr *)my_sa)) {
        if (my_sa->ss_family == AF_INET)
            ((struct sockaddr_in *)&bind_sa)->sin_addr.s_addr = htonl(INADDR_ANY);
        else
            ((struct sockaddr_in6 *)&bind_sa)->sin6_addr = in6addr_any;
    }
    n->lis = evconnlistener_new_bind(n->base, net_on_accept_, n,
                                     LEV_OPT_CLOSE_ON_FREE | LEV_OPT_REUSEABLE | LEV_OPT_THREADSAFE |
                                         LEV_OPT_CLOSE_ON_EXEC,
                                     64, (struct sockaddr *)&bind_sa, (int)my_len);
    if (!n->lis) {
        int e = errno;
        loom_err_set(err, LOOM_ENET, n->listen_addr, "%s: listen(%s) failed: %s", n->name, n->listen_addr, strerror(e));
        return loom_err_hint(err, e == EADDRINUSE ? "another process holds this port: stop it or give the task another "
                                                    "port"
                                                  : "check this task's address in the cluster section");
    }
    evconnlistener_set_error_cb(n->lis, net_on_accept_error_);
    struct sockaddr_storage bound;
    socklen_t bl = sizeof bound;
    if (getsockname(evconnlistener_get_fd(n->lis), (struct sockaddr *)&bound, &bl) == 0)
        n->listen_port = ntohs(bound.ss_family == AF_INET ? ((struct sockaddr_in *)&bound)->sin_port
                                                          : ((struct sockaddr_in6 *)&bound)->sin6_port);
    n->reserve_fd = loom_fd_reserve_open();
    int dialers = 0;
    for (int i = 0; i < n->n_peers; i++) dialers += !n->peers[i].dial;
    n->pending_max = loom_fd_bound(16, 8, 256);
    if (n->pending_max < dialers + 8) n->pending_max = dialers + 8;
    n->relisten_ev = evtimer_new(n->base, net_on_relisten_, n);
    n->hb_ev = event_new(n->base, -1, EV_PERSIST, net_on_heartbeat_, n);
    n->deadline_ev = evtimer_new(n->base, net_on_deadline_, n);
    n->close_ev = evtimer_new(n->base, net_on_close_, n);
    n->resume_ev = event_new(n->base, -1, 0, net_on_resume_, n);
    if (!n->hb_ev || !n->deadline_ev || !n->close_ev || !n->resume_ev || !n->relisten_ev)
        return loom_err_set(err, LOOM_ENOMEM, NULL, "no memory for the transport's timers");
    for (int i = 0; i < n->n_peers; i++) {
        dial_arg *da = loom_alloc(sizeof *da);
        if (!da) return loom_err_set(err, LOOM_ENOMEM, NULL, "no memory for the transport");
        da->n = n, da->p = i;
        n->peers[i].retry_ev = evtimer_new(n->base, net_dial_cb_, da);
        if (!n->peers[i].retry_ev) {
            loom_free(da);
            return loom_err_set(err, LOOM_ENOMEM, NULL, "no memory for the transport");
        }
        if (n->peers[i].dial && !n->peers[i].unlisted) {
            struct timeval z = {0, 0};
            evtimer_add(n->peers[i].retry_ev, &z);
        }
    }
    return LOOM_OK;
}

/* Starts the event loop's thread and waits until every peer is up (the
 * connections with retry and the handshakes run there), one is lost, a
 * fatal error, or connect_timeout (+5 s) passes. */
static int net_connect(loom_net *n, loom_err *err)
{
    snprintf(n->status, sizeof n->status, "connecting");
    n->t_open = loom_now();
    struct timeval hb = tv_of(n->hb_interval), dl = tv_of(n->connect_timeout);
    event_add(n->hb_ev, &hb);
    evtimer_add(n->deadline_ev, &dl);
    if (pthread_create(&n->thread, NULL, net_loop_main_, n) != 0)
        return loom_err_set(err, LOOM_ENET, NULL, "cannot start the transport's thread");
    n->running = true;

    pthread_mutex_lock(&n->mu);
    double bound = n->connect_timeout + 5, t_part = n->partial ? n->t_open + n->partial_after : -1;
    if (n->partial && n->partial_after + 5 > bound) bound = n->partial_after + 5;
    while (!n->fatal && !net_listed_up_(n) && n->lost < 0) {
        double now = loom_now();
        /* partial: past partial_after with the needed peer (the chief) up, the missing ones come later */
        if (n->partial && now >= t_part && (n->need < 0 || n->peers[n->need].state == P_UP)) break;
        if (now >= n->t_open + bound) break;
        double wake = n->partial && now < t_part ? t_part : n->t_open + bound;
        if (n->partial && now >= t_part && wake > now + 0.2) wake = now + 0.2;
        struct timespec until;
        clock_gettime(CLOCK_MONOTONIC, &until);
        double dt = wake - now;
        until.tv_sec += (time_t)dt;
        until.tv_nsec += (long)((dt - (double)(time_t)dt) * 1e9);
        if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&n->cv, &n->mu, &until);
    }
    bool partial_ok = n->partial && (n->need < 0 || n->peers[n->need].state == P_UP);
    int rc = LOOM_OK;
    if (n->fatal) {
        *err = n->fatal_err;
        rc = n->fatal;
    } else if (n->lost >= 0) {
        *err = n->lost_err;
        rc = LOOM_ENET;
    } else if (!net_listed_up_(n) && !partial_ok) {
        rc = loom_err_set(err, LOOM_ETIMEOUT, n->listen_addr, "%s: the transport did not connect in time", n->name);
    }
    if (!rc) {
        n->open_done = true;
        snprintf(n->status, sizeof n->status, "connected");
    }
    pthread_mutex_unlock(&n->mu);
    return rc;
}

/* The transport's start in order (settings, addresses, listener and timers,
 * the thread and the connections); a failure at any step unwinds what the
 * earlier ones made (net_free), here. */
static int net_open(loom_net **out, const loom_cluster *c, const loom_net_peer *peers, int n_peers,
                    double partial_after, int need, loom_err *err)
{
    *out = NULL;
    loom_net_process_init();
    const loom_task_addr *me = task_addr(c, c->role, c->index);
    char myname[32];
    loom_net_task_name_(c->role, c->index, myname, sizeof myname);
    if (!me) return loom_err_set(err, LOOM_EUSAGE, NULL, "this task (%s) is not in the cluster", myname);
    loom_net *n = NULL;
    int rc = net_new(&n, c, me, myname, n_peers, err);
    if (rc) return rc;
    if (partial_after >= 0) {
        n->partial = true, n->partial_after = partial_after, n->need = need < n_peers ? need : -1;
        for (int i = 0; i < n_peers; i++) n->peers[i].tolerated = true;
    }
    struct sockaddr_storage my_sa;
    socklen_t my_len = 0;
    if (!rc) rc = net_resolve(n, c, me, peers, &my_sa, &my_len, err);
    if (!rc) rc = net_listen(n, &my_sa, my_len, err);
    if (!rc) rc = net_connect(n, err);
    if (rc) {
        net_free(n);
        return rc;
    }
    evtimer_del(n->deadline_ev); /* thread-safe after evthread_use_pthreads */
    *out = n;
    return LOOM_OK;
}

int loom_net_open(loom_net **out, const loom_cluster *c, const loom_net_peer *peers, int n_peers, loom_err *err)
{
    return net_open(out, c, peers, n_peers, -1, -1, err);
}

int loom_net_open_partial_(loom_net **out, const loom_cluster *c, const loom_net_peer *peers, int n_peers,
                           double start_timeout, int need, loom_err *err)
{
    return net_open(out, c, peers, n_peers, start_timeout > 0 ? start_timeout : 0, need, err);
}

void loom_net_close(loom_net *n)
{
    if (!n) return;
    pthread_mutex_lock(&n->mu);
    n->closing = true;
    pthread_mutex_unlock(&n->mu);
    /* Say BYE to every peer (queued on each connection, flushed by net_on_close_). */
    for (int i = 0; i < n->n_peers; i++) {
        pthread_mutex_lock(&n->mu);
        net_peer *pe = &n->peers[i];
        struct bufferevent *to = (pe->state == P_UP || pe->state == P_GONE) && pe->c ? pe->bev : NULL;
        pthread_mutex_unlock(&n->mu);
        if (to) net_bev_send_(to, LOOM_MSG_BYE, "closed", 6);
    }
    net_free(n);
}
