/* net.c - the cluster transport on libevent 2.1: one connection per pair of
 * tasks, framed and checksummed messages (net_internal.h), an authenticated
 * handshake that also compares the config digests, heartbeats, and lost-peer
 * detection. Opening and closing it are net_open.c; what the two share,
 * net_loop_internal.h.
 *
 * Threads: the event loop runs on a thread of its own. The caller's thread
 * (loom_net_send/recv) shares with it the message queue and the peer states
 * under n->mu; it writes to a connection through its thread-safe
 * bufferevent, holding a reference instead of n->mu (libevent calls our
 * callbacks with the bufferevent's lock held, and they take n->mu: the
 * opposite order would deadlock). Who dials: of two tasks, the later in
 * (role, index) order dials the earlier, so each pair has one connection.
 *
 * Bounds: an unauthenticated connection may send frames of at most
 * LOOM_NET_HANDSHAKE_MAX bytes and must finish the handshake within
 * min(connect_timeout, 10) s; anything else (bad magic, checksum, order,
 * secret) drops it with a log line naming its address. The messages of one
 * peer waiting for loom_net_recv are bounded (recvq_max bytes): above it the
 * loop stops reading that peer's connection (TCP pushes back on the sender)
 * until loom_net_recv takes the queue back under it, and the peer's silence
 * meanwhile is ours, not its (no heartbeat_timeout).
 *
 * Floods: accepted connections waiting for their handshake are bounded
 * (pending_max: the descriptor limit / 16, in [8, 256], and never under the
 * number of peers that dial us + 8); at the bound the oldest is closed for
 * the newcomer, and the listener pauses for a loop turn so closed sockets
 * are released before more are accepted. accept() failing for want of
 * descriptors (EMFILE) sheds the pending connection through a reserve
 * descriptor (loom_fd_reserve_shed) instead of waking the loop for ever.
 * Log lines about connections that fail before their handshake are rate
 * limited per address (5 at once, then one a second, with a count of the
 * others), as are the accept errors (one a second). */
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


static pthread_once_t evthread_once = PTHREAD_ONCE_INIT;

/* libevent's own lines ("Error from accept() call" and the like) go to
 * loom_log, one a second with the count of those held back. */
static pthread_mutex_t evlog_mu = PTHREAD_MUTEX_INITIALIZER;
static loom_ratelimit evlog_rl = {.interval = 1, .burst = 1};
static void evlog(int severity, const char *msg)
{
    if (severity < EVENT_LOG_WARN) return;
    uint64_t skipped = 0;
    pthread_mutex_lock(&evlog_mu);
    bool pass = loom_ratelimit_pass(&evlog_rl, &skipped);
    pthread_mutex_unlock(&evlog_mu);
    if (!pass) return;
    if (skipped)
        loom_log(LOOM_LOG_WARN, "libevent: %s (%llu more libevent lines not logged since the last)", msg,
                 (unsigned long long)skipped);
    else
        loom_log(LOOM_LOG_WARN, "libevent: %s", msg);
}

/* Once per process: libevent's locks and log, and SIGPIPE ignored: a write
 * to a peer that has just closed (a parameter-server worker leaving while
 * its ps answers) must come back as a closed connection, not kill this task. */
static void evthread_init(void)
{
    evthread_use_pthreads();
    event_set_log_callback(evlog);
    signal(SIGPIPE, SIG_IGN);
}

void loom_net_process_init(void) { pthread_once(&evthread_once, evthread_init); }

static void conn_close_soon(conn *c);

static void alert(loom_net *n)
{
    uint64_t one = 1;
    if (n->alert_fd >= 0 && write(n->alert_fd, &one, sizeof one) < 0) { /* a full counter still reads */
    }
}

/* ---- lines an outsider can trigger (loop thread) --------------------------- */

/* The rate limit of addr's host ("127.0.0.1:40312" -> "127.0.0.1"); hosts
 * beyond the table's 16 (unused for a minute frees a slot) share one. */
static loom_ratelimit *addr_limit(loom_net *n, const char *addr)
{
    char host[64];
    snprintf(host, sizeof host, "%s", addr);
    char *colon = strrchr(host, ':');
    if (colon && colon != host) *colon = 0;
    double now = loom_now();
    struct addr_lim *slot = NULL;
    for (int i = 0; i < (int)(sizeof n->lims / sizeof n->lims[0]); i++) {
        struct addr_lim *a = &n->lims[i];
        if (a->host[0] && !strcmp(a->host, host)) {
            a->used = now;
            return &a->rl;
        }
        if (!slot && (!a->host[0] || now - a->used > 60)) slot = a;
    }
    if (!slot) return &n->other_rl;
    snprintf(slot->host, sizeof slot->host, "%s", host);
    slot->rl = (loom_ratelimit){.interval = 1, .burst = 5};
    slot->used = now;
    return &slot->rl;
}

/* Logs a line about a connection from or to addr that failed before its
 * handshake ended: 5 at once, then one a second per address; the next line
 * that passes says how many did not. */
static void conn_log(loom_net *n, loom_log_level lvl, const char *addr, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void conn_log(loom_net *n, loom_log_level lvl, const char *addr, const char *fmt, ...)
{
    uint64_t skipped = 0;
    if (!loom_ratelimit_pass(addr_limit(n, addr), &skipped)) return;
    char line[1400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (skipped)
        loom_log(lvl, "%s (%llu more such lines about this address not logged: at most one a second)", line,
                 (unsigned long long)skipped);
    else
        loom_log(lvl, "%s", line);
}

/* ---- peers and losses (loop thread, mu held) ------------------------------ */

/* Queues an empty message of type from peer p (news of a tolerated peer). */
static void queue_news(loom_net *n, int p, uint32_t type)
{
    qmsg *q = loom_alloc(sizeof *q);
    uint8_t *d = loom_alloc(1);
    if (!q || !d) {
        loom_free(q), loom_free(d);
        return;
    }
    q->next = NULL, q->from = p, q->type = type, q->data = d, q->len = 0;
    if (n->qtail) n->qtail->next = q;
    else n->qhead = q;
    n->qtail = q;
    pthread_cond_broadcast(&n->cv);
}

/* A tolerated peer went away: news, and (if we dial it) a dial again. */
static void tolerated_down(loom_net *n, int p, const char *why)
{
    net_peer *pe = &n->peers[p];
    /* a departure on purpose (BYE) is routine; a loss is worth a warning */
    loom_log(strcmp(why, "it left") ? LOOM_LOG_WARN : LOOM_LOG_DEBUG, "%s: lost %s (%s): %s; it may come back",
             n->name, pe->name, pe->addr, why);
    pe->state = pe->dial ? P_WAIT : P_LOST;
    pe->left = !strcmp(why, "it left");
    pe->attempts = 0;
    queue_news(n, p, LOOM_MSG_PEER_DOWN);
    alert(n); /* a collective waiting on it (an elastic group) looks at once */
    if (pe->dial && pe->retry_ev) {
        struct timeval tv = {0, 200000};
        evtimer_add(pe->retry_ev, &tv);
    }
}

/* Whether peer pe (connected once) said nothing after its handshake: its
 * first heartbeat goes out with the handshake, while it may still wait for
 * the rest of the cluster ("connecting"), and may not even have left when
 * it died (the status net_resolve set). */
static bool hs_only(const net_peer *pe)
{
    return !pe->status[0] || !strcmp(pe->status, "connecting") || !strcmp(pe->status, "starting (no heartbeat yet)");
}

/* What peer pe (connected once) was doing, as its last heartbeat said. */
static const char *peer_doing(const net_peer *pe)
{
    if (!strcmp(pe->status, "connecting"))
        return "waiting for the rest of the cluster (no heartbeat since its handshake with this task)";
    return hs_only(pe) ? "just past its handshake with this task (no heartbeat yet)" : pe->status;
}

static void declare_lost(loom_net *n, int p, const char *why)
{
    net_peer *pe = &n->peers[p];
    if (pe->state != P_UP) return;
    if (n->closing) { /* we are leaving ourselves: the others' departures are no news */
        pe->state = P_GONE;
        return;
    }
    if (pe->tolerated && (n->open_done || n->partial)) {
        tolerated_down(n, p, why);
        return;
    }
    pe->state = P_LOST;
    double ago = loom_now() - pe->last_heard;
    char msg[700];
    snprintf(msg, sizeof msg, "lost %s (%s)%s: %s; last heard %.1f s ago, it was %s", pe->name, pe->addr,
             hs_only(pe) ? " after it had connected" : "", why, ago, peer_doing(pe));
    loom_log(LOOM_LOG_ERROR, "%s: %s", n->name, msg);
    if (n->lost < 0) {
        n->lost = p;
        loom_err_set(&n->lost_err, LOOM_ENET, n->name, "%s", msg);
        loom_err_hint(&n->lost_err, "the job stops: restart it (loom launch --restarts K does) to resume from the "
                                    "last checkpoint");
    }
    pthread_cond_broadcast(&n->cv);
    alert(n);
}

static void set_fatal(loom_net *n, int code, const char *where, const char *msg, const char *hint)
{
    if (n->fatal) return;
    n->fatal = code;
    loom_err_set(&n->fatal_err, code, where, "%s", msg);
    if (hint && hint[0]) loom_err_hint(&n->fatal_err, "%s", hint);
    pthread_cond_broadcast(&n->cv);
}

static int find_peer(const loom_net *n, loom_role role, int index)
{
    for (int i = 0; i < n->n_peers; i++)
        if (n->peers[i].role == role && n->peers[i].index == index) return i;
    return -1;
}

static bool accept_peer_cb(void *arg, loom_role role, int index)
{
    loom_net *n = arg;
    int p = find_peer(n, role, index);
    return p >= 0 && !n->peers[p].dial;
}

/* ---- sending -------------------------------------------------------------- */

int net_bev_send_(struct bufferevent *bev, uint32_t type, const void *buf, size_t len)
{
    uint8_t hdr[LOOM_NET_HDR];
    loom_net_frame_header_(hdr, type, buf, (uint32_t)len);
    bufferevent_lock(bev);
    struct evbuffer *out = bufferevent_get_output(bev);
    int rc = evbuffer_add(out, hdr, sizeof hdr);
    if (!rc && len) rc = evbuffer_add(out, buf, len);
    bufferevent_unlock(bev);
    return rc;
}

/* ---- frames --------------------------------------------------------------- */

/* One frame of an authenticated connection; true when its peer's queue for
 * loom_net_recv is past the bound (stop reading the connection). *unread:
 * a user type this task declared it never reads from that peer (not queued). */
static bool handle_authed(conn *c, const loom_net_frame *f, bool *unread)
{
    loom_net *n = c->n;
    net_peer *pe = &n->peers[c->peer];
    bool pause = false;
    pthread_mutex_lock(&n->mu);
    pe->last_heard = loom_now();
    if (f->type == LOOM_MSG_HEARTBEAT) {
        size_t l = f->len < sizeof pe->status - 1 ? f->len : sizeof pe->status - 1;
        memcpy(pe->status, f->payload, l);
        pe->status[l] = 0;
    } else if (f->type == LOOM_MSG_BYE) {
        size_t l = f->len < sizeof pe->gone_reason - 1 ? f->len : sizeof pe->gone_reason - 1;
        memcpy(pe->gone_reason, f->payload, l);
        pe->gone_reason[l] = 0;
        if (pe->state == P_UP && pe->tolerated && (n->open_done || n->partial) && !n->closing)
            tolerated_down(n, c->peer, "it left");
        else if (pe->state == P_UP) pe->state = P_GONE;
        pthread_cond_broadcast(&n->cv);
        alert(n);
    } else if (f->type >= LOOM_MSG_USER && pe->reads &&
               (f->type - LOOM_MSG_USER >= 64 || !(pe->reads & LOOM_NET_TYPE_BIT(f->type)))) {
        *unread = true; /* nothing here reads it: the caller drops the connection */
    } else if (f->type >= LOOM_MSG_USER) {
        qmsg *q = loom_alloc(sizeof *q);
        uint8_t *d = loom_alloc(f->len ? f->len : 1);
        if (!q || !d) {
            loom_free(q), loom_free(d);
            pthread_mutex_unlock(&n->mu);
            loom_log(LOOM_LOG_ERROR, "%s: out of memory for a %u-byte message from %s; dropping the connection",
                     n->name, f->len, pe->name);
            pthread_mutex_lock(&n->mu);
            declare_lost(n, c->peer, "out of memory for its message");
        } else {
            memcpy(d, f->payload, f->len);
            q->next = NULL, q->from = c->peer, q->type = f->type, q->data = d, q->len = f->len;
            if (n->qtail) n->qtail->next = q;
            else n->qhead = q;
            n->qtail = q;
            pe->rq_bytes += f->len;
            if (pe->rq_bytes > n->recvq_max && !pe->paused) {
                pe->paused = pause = true;
                pe->resume = false;
                loom_debug("%s: %.1f MiB from %s wait for loom_net_recv (bound %.0f MiB): not reading it until "
                           "they are taken", n->name, (double)pe->rq_bytes / (1 << 20), pe->name,
                           (double)n->recvq_max / (1 << 20));
            }
            pthread_cond_broadcast(&n->cv);
            if (n->alert_type && f->type == n->alert_type) alert(n);
        }
    } /* HELLO after the handshake, or a reserved type: ignored */
    pause = pe->paused; /* (also when it was paused before: a connection of a tolerated peer back) */
    pthread_mutex_unlock(&n->mu);
    return pause;
}

/* A handshake failed or a frame was garbage: log it with the address and drop. */
static void drop(conn *c, const loom_err *e)
{
    loom_net *n = c->n;
    char claim[48] = "";
    if (c->hs.peer_known) {
        char nm[32];
        snprintf(claim, sizeof claim, " (%s %s)", c->dialer ? "dialed as" : "claims to be",
                 loom_net_task_name_(c->hs.peer_role, c->hs.peer_index, nm, sizeof nm));
    }
    if (c->authed)
        loom_log(LOOM_LOG_WARN, "%s: dropped the connection %s %s%s: %s", n->name, c->dialer ? "to" : "from", c->addr,
                 claim, e->msg);
    else
        conn_log(n, LOOM_LOG_WARN, c->addr, "%s: dropped the connection %s %s%s: %s%s%s", n->name,
                 c->dialer ? "to" : "from", c->addr, claim, e->msg, e->hint[0] ? "; " : "", e->hint);
    pthread_mutex_lock(&n->mu);
    if (c->authed && c->peer >= 0) {
        declare_lost(n, c->peer, e->msg);
    } else if (c->hs.peer_known) {
        int p = find_peer(n, c->hs.peer_role, c->hs.peer_index);
        if (p >= 0 && n->peers[p].state == P_WAIT) {
            /* (an accepted connection only claims the name: its own address is the one to report) */
            if (c->dialer)
                snprintf(n->peers[p].last_error, sizeof n->peers[p].last_error, "a connection to %.280s failed: %.380s",
                         c->addr, e->msg);
            else
                snprintf(n->peers[p].last_error, sizeof n->peers[p].last_error,
                         "it never connected; %.100s claimed to be it and failed: %.380s", c->addr, e->msg);
            /* Refusals between authenticated peers (configs differ) and a
             * dialed peer that cannot prove the secret end the open at once;
             * a stranger claiming a name is only logged. */
            if (!n->open_done && (e->code == LOOM_ECONFIG || c->dialer)) {
                char m[600];
                snprintf(m, sizeof m, "%s", e->msg);
                set_fatal(n, e->code, c->dialer ? n->peers[p].addr : c->addr, m, e->hint);
            }
        }
    }
    pthread_mutex_unlock(&n->mu);
    conn_close_soon(c);
}

/* A peer sent a user type this task never reads from it (loom_net_reads):
 * nothing would take it off the queue, so instead of keeping it the peer's
 * connection is dropped and every wait on the peer ends naming the type. */
static void unread_type(conn *c, uint32_t type)
{
    loom_net *n = c->n;
    int p = c->peer;
    char why[200];
    snprintf(why, sizeof why, "it sent a message of type %u, which %s never reads from it", type, n->name);
    loom_log(LOOM_LOG_ERROR, "%s: dropped the connection %s %s (%s): %s", n->name, c->dialer ? "to" : "from", c->addr,
             n->peers[p].name, why);
    pthread_mutex_lock(&n->mu);
    bool first = n->lost < 0;
    declare_lost(n, p, why);
    if (first && n->lost == p) /* a restart runs the same builds again: that is not the cure */
        loom_err_hint(&n->lost_err, "every task of a job must run the same loom build (and plugins); a type no task "
                                    "of this build reads is a peer of another build, or a bug to report");
    pthread_mutex_unlock(&n->mu);
    conn_close_soon(c);
}

/* The handshake of c is done: c becomes its peer's connection (false, e
 * set: the peer is unknown, already connected or lost). */
static bool hs_accept(conn *c, struct bufferevent *bev, loom_err *e)
{
    loom_net *n = c->n;
    pthread_mutex_lock(&n->mu);
    int pi = find_peer(n, c->hs.peer_role, c->hs.peer_index);
    bool back = pi >= 0 && n->peers[pi].tolerated && (n->open_done || n->partial) && !n->closing &&
                n->peers[pi].state != P_UP; /* a tolerated peer coming back */
    if (pi < 0 || (n->peers[pi].state != P_WAIT && !back)) {
        pthread_mutex_unlock(&n->mu);
        loom_err_set(e, LOOM_ENET, NULL, "a second connection for a task already connected or lost");
        return false;
    }
    c->authed = true;
    c->peer = pi;
    if (c->pending) c->pending = false, n->n_pending--;
    net_peer *pe = &n->peers[pi];
    pe->state = P_UP;
    pe->left = false;
    pe->c = c;
    bufferevent_incref(bev);
    bool again = pe->bev != NULL; /* (partial open: a peer's first connection may come after the others') */
    if (pe->bev) { /* its earlier connection's: the caller's thread may still hold it */
        struct bufferevent **r = loom_realloc(n->retired, (size_t)(n->n_retired + 1) * sizeof *r);
        if (r) n->retired = r, n->retired[n->n_retired++] = pe->bev;
    }
    pe->bev = bev;
    pe->last_heard = loom_now();
    n->n_up++;
    if (back && again) {
        queue_news(n, pi, LOOM_MSG_PEER_UP);
        loom_log(LOOM_LOG_INFO, "%s: %s is back (%s)", n->name, pe->name, c->addr);
    } else if (back && n->open_done)
        loom_log(LOOM_LOG_INFO, "%s: %s connected (%s), after the job started", n->name, pe->name, c->addr);
    /* A first heartbeat at once, so the peer knows what we are doing from the start. */
    net_bev_send_(bev, LOOM_MSG_HEARTBEAT, n->status, strlen(n->status));
    pthread_cond_broadcast(&n->cv);
    pthread_mutex_unlock(&n->mu);
    evtimer_del(c->timer);
    loom_debug("%s: connected to %s (%s)", n->name, pe->name, c->addr);
    return true;
}

static void on_read(struct bufferevent *bev, void *arg)
{
    conn *c = arg;
    loom_net *n = c->n;
    struct evbuffer *in = bufferevent_get_input(bev);
    if (c->authed) { /* (a trigger after a resume may find the peer paused again) */
        pthread_mutex_lock(&n->mu);
        bool paused = n->peers[c->peer].paused;
        pthread_mutex_unlock(&n->mu);
        if (paused) {
            bufferevent_disable(bev, EV_READ);
            return;
        }
    }
    for (;;) {
        bool pause = false;
        if (c->closing) {
            evbuffer_drain(in, evbuffer_get_length(in));
            return;
        }
        size_t avail = evbuffer_get_length(in);
        if (!avail) return;
        size_t want = avail < LOOM_NET_HDR ? avail : LOOM_NET_HDR;
        uint8_t *p = evbuffer_pullup(in, (ssize_t)want);
        loom_net_frame f;
        size_t need = 0;
        loom_err e = {0};
        uint32_t max = c->authed ? LOOM_NET_FRAME_MAX : LOOM_NET_HANDSHAKE_MAX;
        if (!c->authed && !n->ssl && want >= 2 && p[0] == 0x16 && p[1] == 0x03) { /* a TLS handshake record */
            loom_err_set(&e, LOOM_ENET, NULL, "a TLS handshake on a plaintext connection: %s uses cluster.tls and "
                         "this task (%s) does not", c->dialer ? "the task it dialed" : "the peer", n->name);
            loom_err_hint(&e, "set cluster.tls (with tls_cert, tls_key and tls_ca) the same on every task: both ends "
                              "of a connection must agree");
            drop(c, &e);
            return;
        }
        long r = loom_net_frame_decode_(p, want, max, &f, &need, &e);
        if (r == 0 && want == LOOM_NET_HDR) {
            if (avail < need) {
                /* Wait for the whole frame. */
                bufferevent_setwatermark(bev, EV_READ, need, 0);
                return;
            }
            p = evbuffer_pullup(in, (ssize_t)need);
            r = loom_net_frame_decode_(p, need, max, &f, NULL, &e);
        }
        if (r == 0) return; /* fewer than a header */
        bufferevent_setwatermark(bev, EV_READ, 0, 0);
        if (r < 0) {
            drop(c, &e);
            return;
        }
        if (c->authed) {
            bool unread = false;
            pause = handle_authed(c, &f, &unread);
            if (unread) {
                evbuffer_drain(in, (size_t)r);
                unread_type(c, f.type);
                return;
            }
        } else if (f.type != LOOM_MSG_HELLO) {
            loom_err_set(&e, LOOM_ENET, NULL, "a type-%u message before the handshake", f.type);
            drop(c, &e);
            return;
        } else {
            loom_buf out;
            loom_buf_init(&out);
            int rc = loom_hs_feed_(&c->hs, f.payload, f.len, &out, &e);
            if (out.len) bufferevent_write(bev, out.data, out.len);
            loom_buf_fini(&out);
            if (rc) {
                evbuffer_drain(in, (size_t)r);
                drop(c, &e);
                return;
            }
            if (c->hs.done && !hs_accept(c, bev, &e)) {
                evbuffer_drain(in, (size_t)r);
                drop(c, &e);
                return;
            }
        }
        evbuffer_drain(in, (size_t)r);
        if (pause) { /* the rest stays in the input buffer; net_on_resume_ reads on */
            bufferevent_disable(bev, EV_READ);
            return;
        }
    }
}

/* loom_net_recv took a paused peer's queue back under the bound: read its
 * connection again, starting with what is already in its input buffer. In
 * the loop thread, which alone frees connections. */
void net_on_resume_(evutil_socket_t fd, short what, void *arg)
{
    (void)fd, (void)what;
    loom_net *n = arg;
    for (int i = 0; i < n->n_peers; i++) {
        pthread_mutex_lock(&n->mu);
        net_peer *pe = &n->peers[i];
        conn *c = pe->resume && !pe->paused ? pe->c : NULL;
        pe->resume = false;
        if (c) pe->last_heard = loom_now(); /* its silence while unread was ours */
        pthread_mutex_unlock(&n->mu);
        if (!c || c->closing) continue;
        bufferevent_enable(c->bev, EV_READ);
        bufferevent_trigger(c->bev, EV_READ, BEV_TRIG_IGNORE_WATERMARKS);
    }
}

static void on_write_closing(struct bufferevent *bev, void *arg)
{
    (void)bev;
    net_conn_free_(arg);
}

static void on_event(struct bufferevent *bev, short what, void *arg)
{
    conn *c = arg;
    loom_net *n = c->n;
    if (what & BEV_EVENT_CONNECTED) {
        c->connected = true;
        evutil_socket_t fd = bufferevent_getfd(bev);
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        return;
    }
    if (c->closing) {
        net_conn_free_(c);
        return;
    }
    char why[300];
    int e = EVUTIL_SOCKET_ERROR();
    if (what & BEV_EVENT_EOF)
        snprintf(why, sizeof why, "connection closed");
    else {
        unsigned long se = bufferevent_get_openssl_error(bev);
        if (se && !c->authed && ERR_GET_REASON(se) == SSL_R_WRONG_VERSION_NUMBER)
            /* what came first was not a TLS record: the loom handshake's plaintext, as a rule */
            snprintf(why, sizeof why, "it speaks plaintext to this task's TLS (cluster.tls is on here, off there%s); "
                     "set cluster.tls (with tls_cert, tls_key and tls_ca) the same on both ends",
                     c->dialer ? ", or that is not a loom task" : "");
        else if (se) {
            char sb[200];
            ERR_error_string_n(se, sb, sizeof sb);
            snprintf(why, sizeof why, "TLS error: %s", sb);
        } else
            snprintf(why, sizeof why, "connection closed (%s)", e ? evutil_socket_error_to_string(e) : "error");
    }
    pthread_mutex_lock(&n->mu);
    if (c->authed) {
        net_peer *pe = &n->peers[c->peer];
        if (pe->c == c) { /* (a tolerated peer may already be back on another connection) */
            pe->c = NULL;
            if (pe->state == P_UP) declare_lost(n, c->peer, why);
        }
        pthread_mutex_unlock(&n->mu);
        net_conn_free_(c);
        return;
    }
    if (c->dialer && c->peer >= 0 && (!n->open_done || n->peers[c->peer].tolerated) && !n->closing &&
        n->peers[c->peer].state == P_WAIT) {
        /* A dial that failed (refused: the peer is not up yet): retry with back-off. */
        net_peer *pe = &n->peers[c->peer];
        unsigned long se = (what & BEV_EVENT_ERROR) ? bufferevent_get_openssl_error(bev) : 0;
        bool tls_fail = se != 0;
        /* closed or reset after the connect, before any answer to our hello:
         * a TLS listener meeting plaintext closes without a word */
        bool unanswered = c->connected && !n->ssl && c->hs.phase == 2;
        snprintf(pe->last_error, sizeof pe->last_error, "connect(%.270s) failed: %.200s (attempt %d)%s", pe->addr, why,
                 pe->attempts,
                 unanswered ? "; it closed the connection without answering the handshake: if it uses cluster.tls, "
                              "set cluster.tls the same on both ends"
                            : "");
        if (tls_fail)
            set_fatal(n, LOOM_ENET, pe->addr, pe->last_error,
                      ERR_GET_REASON(se) == SSL_R_WRONG_VERSION_NUMBER ||
                              ERR_GET_REASON(se) == SSL_R_UNEXPECTED_EOF_WHILE_READING
                          ? "the peer did not speak TLS: set cluster.tls (with tls_cert, tls_key and tls_ca) the same "
                            "on both ends"
                          : "check cluster.tls_cert, tls_key and tls_ca (the same CA on both ends), and that both "
                            "ends set cluster.tls");
        double back = 0.02 * (double)(1 << (pe->attempts < 6 ? pe->attempts : 6));
        if (back > 1.0) back = 1.0;
        struct timeval tv = {(time_t)back, (suseconds_t)((back - (double)(time_t)back) * 1e6)};
        pthread_mutex_unlock(&n->mu);
        net_conn_free_(c);
        evtimer_add(pe->retry_ev, &tv);
        return;
    }
    pthread_mutex_unlock(&n->mu);
    if (!c->dialer && !c->hs.peer_known && !(what & BEV_EVENT_EOF))
        conn_log(n, LOOM_LOG_WARN, c->addr, "%s: dropped the connection from %s: %s", n->name, c->addr, why);
    else if (!c->dialer && c->hs.phase > 1)
        conn_log(n, LOOM_LOG_WARN, c->addr, "%s: the connection from %s closed during the handshake", n->name, c->addr);
    else if (!c->dialer && c->hs.phase == 1)
        conn_log(n, LOOM_LOG_WARN, c->addr, "%s: the connection from %s closed before the handshake", n->name,
                 c->addr);
    net_conn_free_(c);
}

static void on_conn_timer(evutil_socket_t fd, short what, void *arg)
{
    (void)fd, (void)what;
    conn *c = arg;
    if (c->closing) {
        net_conn_free_(c);
        return;
    }
    loom_err e = {0};
    loom_err_set(&e, LOOM_ENET, NULL, "no handshake within %.1f s", c->n->hs_timeout);
    drop(c, &e);
}

static conn *conn_new(loom_net *n, struct bufferevent *bev, bool dialer, int peer)
{
    conn *c = loom_calloc(1, sizeof *c);
    if (!c) return NULL;
    c->n = n, c->bev = bev, c->dialer = dialer, c->peer = peer;
    c->timer = evtimer_new(n->base, on_conn_timer, c);
    if (!c->timer) {
        loom_free(c);
        return NULL;
    }
    struct timeval tv = {(time_t)n->hs_timeout, (suseconds_t)((n->hs_timeout - (double)(time_t)n->hs_timeout) * 1e6)};
    evtimer_add(c->timer, &tv);
    c->next = n->conns;
    n->conns = c;
    bufferevent_setcb(bev, on_read, NULL, on_event, c);
    bufferevent_enable(bev, EV_READ | EV_WRITE);
    return c;
}

/* Bytes written on this connection's socket that the peer's kernel has not
 * acknowledged yet (0 once the connection is closed or reset). */
static int unacked(struct bufferevent *bev)
{
    int fd = (int)bufferevent_getfd(bev), q = 0;
    struct tcp_info ti;
    socklen_t len = sizeof ti;
    if (fd < 0 || getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) != 0 || ti.tcpi_state == TCP_CLOSE) return 0;
    return ioctl(fd, SIOCOUTQ, &q) == 0 ? q : 0;
}

/* Reads and drops what the peer sent that nobody will read: a socket closed
 * with unread bytes sends a reset instead of a FIN, and a reset discards
 * whatever of ours the kernel had not sent yet. */
void net_drain_input_(struct bufferevent *bev)
{
    int fd = (int)bufferevent_getfd(bev);
    char buf[4096];
    if (fd >= 0)
        for (int i = 0; i < 1024 && recv(fd, buf, sizeof buf, MSG_DONTWAIT) > 0; i++) {
        }
}

void net_conn_free_(conn *c)
{
    loom_net *n = c->n;
    if (c->pending) c->pending = false, n->n_pending--;
    for (conn **pp = &n->conns; *pp; pp = &(*pp)->next)
        if (*pp == c) {
            *pp = c->next;
            break;
        }
    pthread_mutex_lock(&n->mu);
    if (c->authed && c->peer >= 0 && n->peers[c->peer].c == c) n->peers[c->peer].c = NULL;
    pthread_mutex_unlock(&n->mu);
    /* The peer's reference keeps the bufferevent (and its socket) until
     * net_free: close the connection now, so the other side sees it. */
    if (c->authed) {
        net_drain_input_(c->bev);
        shutdown(bufferevent_getfd(c->bev), SHUT_RDWR);
    }
    event_free(c->timer);
    bufferevent_free(c->bev);
    loom_free(c);
}

/* Stops reading, lets what is queued go out (bounded by 1 s), then frees. */
static void conn_close_soon(conn *c)
{
    c->closing = true;
    bufferevent_disable(c->bev, EV_READ);
    if (evbuffer_get_length(bufferevent_get_output(c->bev)) == 0) {
        net_conn_free_(c);
        return;
    }
    bufferevent_setcb(c->bev, NULL, on_write_closing, on_event, c);
    struct timeval tv = {1, 0};
    evtimer_add(c->timer, &tv);
}

static void sa_text(const struct sockaddr *sa, char *buf, size_t n)
{
    char h[INET6_ADDRSTRLEN] = "?";
    int port = 0;
    if (sa->sa_family == AF_INET) {
        const struct sockaddr_in *s = (const struct sockaddr_in *)sa;
        inet_ntop(AF_INET, &s->sin_addr, h, sizeof h);
        port = ntohs(s->sin_port);
        snprintf(buf, n, "%s:%d", h, port);
    } else if (sa->sa_family == AF_INET6) {
        const struct sockaddr_in6 *s = (const struct sockaddr_in6 *)sa;
        inet_ntop(AF_INET6, &s->sin6_addr, h, sizeof h);
        port = ntohs(s->sin6_port);
        snprintf(buf, n, "[%s]:%d", h, port);
    } else
        snprintf(buf, n, "?");
}

static struct bufferevent *bev_new(loom_net *n, evutil_socket_t fd, bool dialer)
{
    int opts = BEV_OPT_CLOSE_ON_FREE | BEV_OPT_THREADSAFE;
    if (!n->ssl) return bufferevent_socket_new(n->base, fd, opts);
    SSL *s = SSL_new(n->ssl);
    if (!s) return NULL;
    struct bufferevent *b = bufferevent_openssl_socket_new(
        n->base, fd, s, dialer ? BUFFEREVENT_SSL_CONNECTING : BUFFEREVENT_SSL_ACCEPTING, opts);
    if (!b) SSL_free(s);
    return b;
}

/* Pauses the listener until the next turn of the loop (after `secs`), so
 * the sockets just closed are released before more are accepted. */
static void pause_listener(loom_net *n, double secs)
{
    evconnlistener_disable(n->lis);
    struct timeval tv = {(time_t)secs, (suseconds_t)((secs - (double)(time_t)secs) * 1e6)};
    evtimer_add(n->relisten_ev, &tv);
}

void net_on_relisten_(evutil_socket_t fd, short what, void *arg)
{
    (void)fd, (void)what;
    loom_net *n = arg;
    if (!n->closing) evconnlistener_enable(n->lis);
}

/* At the bound of connections waiting for a handshake: closes the oldest. */
static void evict_oldest(loom_net *n, const char *newcomer)
{
    conn *old = NULL;
    for (conn *c = n->conns; c; c = c->next)
        if (c->pending && (!old || c->t_open < old->t_open)) old = c;
    if (!old) return;
    uint64_t skipped = 0;
    if (loom_ratelimit_pass(&n->evict_rl, &skipped)) {
        char more[80] = "";
        if (skipped) snprintf(more, sizeof more, " (%llu more closed since the last line)", (unsigned long long)skipped);
        loom_log(LOOM_LOG_WARN, "%s: %d connections wait for a handshake, the bound (from the descriptor limit %ld): "
                 "closed the oldest (from %s, %.1f s old) for one from %s%s", n->name, n->n_pending, loom_fd_limit(),
                 old->addr, loom_now() - old->t_open, newcomer, more);
    }
    net_conn_free_(old);
}

/* accept() failed: for want of descriptors, shed the pending connection
 * through the reserve descriptor (else the loop wakes for it for ever);
 * if even that fails, pause the listener a little. One line a second. */
void net_on_accept_error_(struct evconnlistener *l, void *arg)
{
    loom_net *n = arg;
    int e = EVUTIL_SOCKET_ERROR();
    int shed = (e == EMFILE || e == ENFILE) ? loom_fd_reserve_shed(&n->reserve_fd, evconnlistener_get_fd(l)) : 0;
    uint64_t skipped = 0;
    if (loom_ratelimit_pass(&n->accept_rl, &skipped)) {
        char more[80] = "";
        if (skipped) snprintf(more, sizeof more, " (%llu more since the last line)", (unsigned long long)skipped);
        loom_log(LOOM_LOG_WARN, "%s: accept() on %s failed: %s (descriptor limit %ld)%s%s", n->name, n->listen_addr,
                 strerror(e), loom_fd_limit(), shed ? "; the connection was closed at once" : "", more);
    }
    if (!shed) pause_listener(n, 0.1);
}

void net_on_accept_(struct evconnlistener *l, evutil_socket_t fd, struct sockaddr *sa, int salen, void *arg)
{
    (void)l, (void)salen;
    loom_net *n = arg;
    char addr[80];
    sa_text(sa, addr, sizeof addr);
    if (n->closing) {
        evutil_closesocket(fd);
        return;
    }
    if (n->n_pending >= n->pending_max) evict_oldest(n, addr);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    struct bufferevent *bev = bev_new(n, fd, false);
    conn *c = bev ? conn_new(n, bev, false, -1) : NULL;
    if (!c) {
        conn_log(n, LOOM_LOG_WARN, addr, "%s: dropped the connection from %s: out of memory", n->name, addr);
        if (bev) bufferevent_free(bev);
        else evutil_closesocket(fd);
        return;
    }
    c->pending = true, c->t_open = loom_now();
    n->n_pending++;
    if (n->n_pending >= n->pending_max) pause_listener(n, 0);
    snprintf(c->addr, sizeof c->addr, "%s", addr);
    loom_buf out;
    loom_buf_init(&out);
    loom_hs_init_(&c->hs, false, n->role, n->index, 0, 0, n->secret, n->secret_len, n->digest, n->config_text, &out);
    c->hs.accept_peer = accept_peer_cb;
    c->hs.accept_arg = n;
    loom_buf_fini(&out);
}

/* A retry event's argument: the transport and the peer to dial. */

void net_dial_cb_(evutil_socket_t fd, short what, void *arg)
{
    (void)fd, (void)what;
    dial_arg *da = arg;
    loom_net *n = da->n;
    net_peer *pe = &n->peers[da->p];
    if ((n->open_done && !pe->tolerated) || n->closing || pe->state != P_WAIT || n->fatal) return;
    pe->attempts++;
    struct bufferevent *bev = bev_new(n, -1, true);
    conn *c = bev ? conn_new(n, bev, true, da->p) : NULL;
    if (!c) {
        if (bev) bufferevent_free(bev);
        pthread_mutex_lock(&n->mu);
        set_fatal(n, LOOM_ENOMEM, pe->addr, "out of memory for a connection", NULL);
        pthread_mutex_unlock(&n->mu);
        return;
    }
    snprintf(c->addr, sizeof c->addr, "%s", pe->addr);
    loom_buf out;
    loom_buf_init(&out);
    loom_hs_init_(&c->hs, true, n->role, n->index, pe->role, pe->index, n->secret, n->secret_len, n->digest,
                  n->config_text, &out);
    bufferevent_write(bev, out.data, out.len); /* queued until connected */
    loom_buf_fini(&out);
    if (bufferevent_socket_connect(bev, (struct sockaddr *)&pe->sa, (int)pe->salen) < 0) {
        /* An immediate failure is reported through on_event by libevent 2.1
         * only sometimes; treat it as a refused attempt here. */
        int e = EVUTIL_SOCKET_ERROR();
        pthread_mutex_lock(&n->mu);
        snprintf(pe->last_error, sizeof pe->last_error, "connect(%s) failed: %s (attempt %d)", pe->addr,
                 evutil_socket_error_to_string(e), pe->attempts);
        pthread_mutex_unlock(&n->mu);
        net_conn_free_(c);
        struct timeval tv = {0, 200000};
        evtimer_add(pe->retry_ev, &tv);
    }
}

/* ---- timers --------------------------------------------------------------- */

void net_on_heartbeat_(evutil_socket_t fd, short what, void *arg)
{
    (void)fd, (void)what;
    loom_net *n = arg;
    double now = loom_now();
    /* Each send happens with mu released: libevent runs the read callbacks
     * holding a bufferevent's lock, and they take mu. */
    char st[sizeof n->status];
    pthread_mutex_lock(&n->mu);
    memcpy(st, n->status, sizeof st);
    pthread_mutex_unlock(&n->mu);
    for (int i = 0; i < n->n_peers; i++) {
        struct bufferevent *to = NULL;
        pthread_mutex_lock(&n->mu);
        net_peer *pe = &n->peers[i];
        if (pe->state == P_UP && !pe->paused && now - pe->last_heard > n->hb_timeout) {
            char why[160];
            snprintf(why, sizeof why, "silent for %.1f s (cluster.heartbeat_timeout = %g s)", now - pe->last_heard,
                     n->hb_timeout);
            declare_lost(n, i, why);
        } else if (pe->state == P_UP && pe->c)
            to = pe->bev; /* (lives until net_free) */
        pthread_mutex_unlock(&n->mu);
        if (to) net_bev_send_(to, LOOM_MSG_HEARTBEAT, st, strlen(st));
    }
}

void net_on_deadline_(evutil_socket_t fd, short what, void *arg)
{
    (void)fd, (void)what;
    loom_net *n = arg;
    pthread_mutex_lock(&n->mu);
    bool partial_ok = n->partial && (n->need < 0 || n->peers[n->need].state == P_UP);
    if (!n->open_done && !n->fatal && !net_listed_up_(n) && !partial_ok) {
        char msg[900] = "";
        size_t k = 0;
        int first = -1;
        for (int i = 0; i < n->n_peers; i++) {
            net_peer *pe = &n->peers[i];
            if (pe->state == P_UP || pe->unlisted) continue;
            if (first < 0) first = i;
            k += (size_t)snprintf(msg + k, k < sizeof msg ? sizeof msg - k : 0, "%s%s at %s (%s)", k ? "; " : "",
                                  pe->name, pe->addr,
                                  pe->last_error[0] ? pe->last_error
                                                    : (pe->dial ? "no attempt finished" : "it never connected"));
            if (k >= sizeof msg) break;
        }
        loom_err_set(&n->fatal_err, LOOM_ETIMEOUT, n->peers[first].addr,
                     "%s: no connection within cluster.connect_timeout = %g s: %s", n->name, n->connect_timeout, msg);
        loom_err_hint(&n->fatal_err, "start every task of the cluster (loom launch --local does), or raise "
                                     "cluster.connect_timeout");
        n->fatal = LOOM_ETIMEOUT;
        pthread_cond_broadcast(&n->cv);
    }
    pthread_mutex_unlock(&n->mu);
}

void net_on_close_(evutil_socket_t fd, short what, void *arg)
{
    (void)fd, (void)what;
    loom_net *n = arg;
    /* Drained: every byte queued to a peer has left our buffers and reached the
     * peer's kernel (acknowledged), so closing cannot lose it. Bounded by the
     * heartbeat timeout (a peer silent that long is lost anyway), at least 1 s. */
    bool drained = true;
    for (conn *c = n->conns; c; c = c->next)
        if (evbuffer_get_length(bufferevent_get_output(c->bev)) || unacked(c->bev) > 0) drained = false;
    double bound = n->hb_timeout > 1.0 ? n->hb_timeout : 1.0;
    if (drained || loom_now() - n->close_started > bound) {
        event_base_loopbreak(n->base);
        return;
    }
    struct timeval tv = {0, 5000};
    evtimer_add(n->close_ev, &tv);
}

void *net_loop_main_(void *arg)
{
    loom_net *n = arg;
    event_base_loop(n->base, EVLOOP_NO_EXIT_ON_EMPTY);
    return NULL;
}

/* ---- public (opening and closing: net_open.c) ------------------------------ */

static int peer_down(loom_net *n, int p, loom_err *err);

static size_t queued(struct bufferevent *bev)
{
    bufferevent_lock(bev);
    size_t q = evbuffer_get_length(bufferevent_get_output(bev));
    bufferevent_unlock(bev);
    return q;
}

size_t loom_net_recv_queued_(loom_net *n, int p)
{
    pthread_mutex_lock(&n->mu);
    size_t b = p >= 0 && p < n->n_peers ? n->peers[p].rq_bytes : 0;
    pthread_mutex_unlock(&n->mu);
    return b;
}

size_t loom_net_queued_(loom_net *n, int p)
{
    pthread_mutex_lock(&n->mu);
    struct bufferevent *bev = p >= 0 && p < n->n_peers ? n->peers[p].bev : NULL;
    pthread_mutex_unlock(&n->mu);
    return bev ? queued(bev) : 0;
}

/* Back-pressure: waits until `add` more bytes fit in the queue to peer p
 * (or the queue is empty), sleeping 0.1 to 10 ms between looks (the loop
 * thread drains it; this is the rare path of a peer that reads slower than
 * we write). Ends with the peer's loss, or after heartbeat_timeout without
 * the queue shrinking. */
static int wait_for_room(loom_net *n, int p, struct bufferevent *bev, size_t add, loom_err *err)
{
    size_t q = queued(bev), last = q;
    if (q == 0 || q + add <= n->sendq_max) return LOOM_OK;
    double t_moved = loom_now();
    useconds_t nap = 100;
    for (;;) {
        pthread_mutex_lock(&n->mu);
        int rc = peer_down(n, p, err);
        pthread_mutex_unlock(&n->mu);
        if (rc) return rc;
        usleep(nap);
        if (nap < 10000) nap *= 2;
        q = queued(bev);
        if (q == 0 || q + add <= n->sendq_max) return LOOM_OK;
        if (q < last) t_moved = loom_now(), last = q;
        if (loom_now() - t_moved > n->hb_timeout) {
            loom_err_set(err, LOOM_ENET, n->name, "%s (%s) has read none of the %.1f MiB queued to it for %g s "
                         "(cluster.heartbeat_timeout): the send queue is full (%.0f MiB at most per peer)",
                         n->peers[p].name, n->peers[p].addr, (double)q / (1 << 20), n->hb_timeout,
                         (double)n->sendq_max / (1 << 20));
            return loom_err_hint(err, "the peer is stuck or its network is; see its log");
        }
    }
}

int loom_net_send(loom_net *n, int p, uint32_t type, const void *buf, size_t len, loom_err *err)
{
    if (p < 0 || p >= n->n_peers) return loom_err_set(err, LOOM_EUSAGE, n->name, "no peer %d", p);
    if (len > LOOM_NET_FRAME_MAX)
        return loom_err_set(err, LOOM_EUSAGE, n->name, "a %zu-byte message is above the limit of %u", len,
                            LOOM_NET_FRAME_MAX);
    pthread_mutex_lock(&n->mu);
    net_peer *pe = &n->peers[p];
    if (pe->state != P_UP || !pe->c) {
        int rc;
        if (pe->state == P_LOST && n->lost == p)
            *err = n->lost_err, rc = LOOM_ENET;
        else
            rc = loom_err_set(err, LOOM_ENET, n->name, "cannot send to %s: %s", pe->name,
                              pe->state == P_GONE ? "it left" : pe->state == P_LOST ? "it was lost" : "not connected");
        pthread_mutex_unlock(&n->mu);
        return rc;
    }
    struct bufferevent *bev = pe->bev;
    pthread_mutex_unlock(&n->mu);
    int rc = wait_for_room(n, p, bev, len + LOOM_NET_HDR, err);
    if (rc) return rc;
    rc = net_bev_send_(bev, type, buf, len);
    if (rc) return loom_err_set(err, LOOM_ENOMEM, n->name, "no memory to queue a %zu-byte message", len);
    return LOOM_OK;
}

/* The error that ends a wait on peer p (-1: any): a lost or departed peer. mu held. */
static int peer_down(loom_net *n, int p, loom_err *err)
{
    if (n->lost >= 0 && (p < 0 || p == n->lost)) {
        *err = n->lost_err;
        return LOOM_ENET;
    }
    for (int i = 0; i < n->n_peers; i++) {
        if (p >= 0 && i != p) continue;
        net_peer *pe = &n->peers[i];
        if (pe->tolerated && n->open_done) continue; /* its losses are news (LOOM_MSG_PEER_DOWN) */
        if (pe->state == P_GONE)
            return loom_err_set(err, LOOM_ENET, n->name, "%s left (%s); last heard it was %s", pe->name,
                                pe->gone_reason, peer_doing(pe));
        if (pe->state == P_LOST)
            return loom_err_set(err, LOOM_ENET, n->name, "%s was lost; it was %s", pe->name, peer_doing(pe));
    }
    return LOOM_OK;
}

int loom_net_recv(loom_net *n, int p, uint32_t type_lo, uint32_t type_hi, int *from, uint32_t *type, loom_buf *msg,
                  double timeout_s, loom_err *err)
{
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    if (timeout_s >= 0) {
        double s = (double)until.tv_sec + until.tv_nsec * 1e-9 + timeout_s;
        until.tv_sec = (time_t)s;
        until.tv_nsec = (long)((s - (double)(time_t)s) * 1e9);
    }
    pthread_mutex_lock(&n->mu);
    for (;;) {
        qmsg *prev = NULL;
        for (qmsg *q = n->qhead; q; prev = q, q = q->next) {
            if ((p >= 0 && q->from != p) || q->type < type_lo || q->type > type_hi) continue;
            if (prev) prev->next = q->next;
            else n->qhead = q->next;
            if (n->qtail == q) n->qtail = prev;
            net_peer *pe = &n->peers[q->from];
            pe->rq_bytes -= q->len < pe->rq_bytes ? q->len : pe->rq_bytes;
            bool resume = pe->paused && pe->rq_bytes <= n->recvq_max;
            if (resume) pe->paused = false, pe->resume = true;
            pthread_mutex_unlock(&n->mu);
            if (resume) event_active(n->resume_ev, EV_READ, 0); /* (thread-safe) */
            if (from) *from = q->from;
            if (type) *type = q->type;
            loom_buf_fini(msg);
            /* (cap >= 1: an empty message still owns its 1-byte block, which loom_buf_fini frees) */
            msg->data = q->data, msg->len = q->len, msg->cap = q->len ? q->len : 1, msg->pos = 0, msg->failed = 0;
            loom_free(q);
            return LOOM_OK;
        }
        int rc = peer_down(n, p, err);
        if (rc) {
            pthread_mutex_unlock(&n->mu);
            return rc;
        }
        if (timeout_s < 0)
            pthread_cond_wait(&n->cv, &n->mu);
        else if (pthread_cond_timedwait(&n->cv, &n->mu, &until) == ETIMEDOUT) {
            pthread_mutex_unlock(&n->mu);
            return loom_err_set(err, LOOM_ETIMEOUT, n->name, "no message from %s within %g s",
                                p >= 0 ? n->peers[p].name : "any peer", timeout_s);
        }
    }
}

void loom_net_reads(loom_net *n, int p, uint64_t types)
{
    pthread_mutex_lock(&n->mu);
    for (int i = 0; i < n->n_peers; i++)
        if (p < 0 || i == p) n->peers[i].reads |= types;
    pthread_mutex_unlock(&n->mu);
}

void loom_net_tolerate(loom_net *n, int p)
{
    if (p < 0 || p >= n->n_peers) return;
    pthread_mutex_lock(&n->mu);
    n->peers[p].tolerated = true;
    pthread_mutex_unlock(&n->mu);
}

int loom_net_lost_peer(loom_net *n, loom_err *err)
{
    pthread_mutex_lock(&n->mu);
    int p = n->lost;
    if (p >= 0 && err) *err = n->lost_err;
    pthread_mutex_unlock(&n->mu);
    return p;
}

/* ---- for the collectives (net_internal.h) ---------------------------------- */

int loom_net_alert_fd_(loom_net *n, uint32_t alert_type)
{
    pthread_mutex_lock(&n->mu);
    n->alert_type = alert_type;
    pthread_mutex_unlock(&n->mu);
    return n->alert_fd;
}

void loom_net_set_status_(loom_net *n, const char *fmt, ...)
{
    char buf[sizeof n->status];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&n->mu);
    memcpy(n->status, buf, sizeof buf);
    pthread_mutex_unlock(&n->mu);
}

int loom_net_peer_down_(loom_net *n, int p, loom_err *err)
{
    pthread_mutex_lock(&n->mu);
    int rc = peer_down(n, p, err);
    pthread_mutex_unlock(&n->mu);
    return rc;
}

bool loom_net_peer_up_(loom_net *n, int p)
{
    pthread_mutex_lock(&n->mu);
    bool up = n->peers[p].state == P_UP;
    pthread_mutex_unlock(&n->mu);
    return up;
}

int loom_net_listen_port_(const loom_net *n) { return n->listen_port; }

void loom_net_peer_host_(loom_net *n, int p, char *buf, size_t len)
{
    pthread_mutex_lock(&n->mu);
    snprintf(buf, len, "%s", n->peers[p].host);
    pthread_mutex_unlock(&n->mu);
}

int loom_net_peer_ip_(loom_net *n, int p, char *buf, size_t len)
{
    pthread_mutex_lock(&n->mu);
    struct bufferevent *bev = n->peers[p].state == P_UP ? n->peers[p].bev : NULL;
    evutil_socket_t fd = bev ? bufferevent_getfd(bev) : -1;
    struct sockaddr_storage sa;
    socklen_t sl = sizeof sa;
    int rc = fd >= 0 ? getpeername(fd, (struct sockaddr *)&sa, &sl) : -1;
    pthread_mutex_unlock(&n->mu);
    if (rc) return -1;
    const void *a = sa.ss_family == AF_INET6 ? (const void *)&((struct sockaddr_in6 *)&sa)->sin6_addr
                                              : (const void *)&((struct sockaddr_in *)&sa)->sin_addr;
    if (!inet_ntop(sa.ss_family, a, buf, (socklen_t)len)) return -1;
    if (sa.ss_family == AF_INET6 && !strncmp(buf, "::ffff:", 7)) memmove(buf, buf + 7, strlen(buf + 7) + 1);
    return 0;
}

int loom_net_learn_peer_(loom_net *n, int p, const char *host, int port, loom_err *err)
{
    net_peer *pe = &n->peers[p];
    if (!pe->unlisted) return LOOM_OK; /* (set once, before the loop: read without mu) */
    struct sockaddr_storage sa;
    socklen_t salen;
    if (net_resolve_(host, port, &sa, &salen, pe->name, err))
        return loom_err_hint(err, "the address is the one the chief saw %s's connection come from", pe->name);
    pthread_mutex_lock(&n->mu);
    bool same = !strcmp(pe->host, host) && pe->salen == salen && !memcmp(&pe->sa, &sa, salen);
    if (!same) {
        memcpy(&pe->sa, &sa, salen);
        pe->salen = salen;
        snprintf(pe->host, sizeof pe->host, "%s", host);
        snprintf(pe->addr, sizeof pe->addr, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, port);
        pe->attempts = 0;
    }
    bool dial = !same && pe->dial && pe->state == P_WAIT && pe->retry_ev && !n->closing;
    pthread_mutex_unlock(&n->mu);
    if (dial) {
        struct timeval z = {0, 0};
        evtimer_add(pe->retry_ev, &z);
    }
    return LOOM_OK;
}

bool loom_net_peer_lost_(loom_net *n, int p)
{
    pthread_mutex_lock(&n->mu);
    int st = n->peers[p].state;
    bool lost = (st == P_LOST || st == P_WAIT) && !n->peers[p].left;
    pthread_mutex_unlock(&n->mu);
    return lost;
}

void loom_net_peer_info_(loom_net *n, int p, char *name, size_t name_n, char *status, size_t status_n, double *age)
{
    pthread_mutex_lock(&n->mu);
    net_peer *pe = &n->peers[p];
    if (name) snprintf(name, name_n, "%s", pe->name);
    if (status) snprintf(status, status_n, "%s", pe->status);
    if (age) *age = loom_now() - pe->last_heard;
    pthread_mutex_unlock(&n->mu);
}

const char *loom_net_name_(const loom_net *n) { return n->name; }

double loom_net_heartbeat_timeout_(const loom_net *n) { return n->hb_timeout; }

static void stall_cb(evutil_socket_t fd, short what, void *arg)
{
    (void)fd, (void)what;
    useconds_t us = (useconds_t)(uintptr_t)arg;
    usleep(us);
}

void loom_net_stall_loop_(loom_net *n, double seconds)
{
    struct timeval z = {0, 0};
    event_base_once(n->base, -1, EV_TIMEOUT, stall_cb, (void *)(uintptr_t)(seconds * 1e6), &z);
}

int loom_net_peers(loom_net *n, loom_peer_info *out, int max)
{
    pthread_mutex_lock(&n->mu);
    int k = n->n_peers < max ? n->n_peers : max;
    double now = loom_now();
    for (int p = 0; p < k; p++) {
        const net_peer *pe = &n->peers[p];
        snprintf(out[p].task, sizeof out[p].task, "%s", pe->name);
        out[p].alive = pe->state == P_UP;
        out[p].last_seen_sec = pe->last_heard > 0 ? now - pe->last_heard : -1;
        out[p].collective_wait_sec = 0;
    }
    pthread_mutex_unlock(&n->mu);
    return k < 0 ? 0 : k;
}
