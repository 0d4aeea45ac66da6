/* group.c - collectives among the training ranks of a cluster: ring
 * all-reduce (chunked, pipelined reduce-scatter + all-gather), pipelined
 * chain broadcast, all-gather of byte strings, barrier.
 *
 * Two planes. The control plane is a loom_net among all ranks (libevent,
 * authenticated handshake, config digests, heartbeats, lost-peer reports):
 * it carries the group's setup, abort notices and what each rank is doing.
 * The data plane is one plain TCP connection from each rank to the next in
 * the ring, driven from the calling thread with nonblocking send/recv and a
 * poll loop: a libevent bufferevent would copy every byte once more through
 * an evbuffer and hop to the loop thread and back per chunk, which on
 * loopback costs more than the wire; a poll loop in the caller sends and
 * receives at once, reduces each received piece as it lands and forwards it
 * in the same iteration (the pipelining), with no thread handoff. The data
 * connections are set up after the control plane is authenticated: each
 * rank listens on an ephemeral port, sends (port, random token) to its ring
 * predecessor over the authenticated control connection, and accepts only
 * the connection that presents that token (anything else is dropped and
 * logged); the listener closes once the ring stands. With cluster.tls the
 * data connections carry TLS too (after the token, a handshake with the
 * cluster's certificates, both ends verified, then every byte in TLS
 * records through the same poll loops; LOOM_RING_TLS=0 keeps them clear,
 * for a trusted network: docs/cluster-transport.md has the cost).
 *
 * Every collective starts with a 32-byte header sent to the next rank
 * (kind, sequence number, count, root): a rank whose predecessor entered a
 * different collective stops with LOOM_EUSAGE naming both and tells every
 * rank through the control plane. Data frames carry no CRC-32C of their
 * own: TCP's checksum covers them and a CRC would cost a third of the
 * loopback bandwidth; the control plane's frames carry one.
 *
 * Bit-identical results: in the reduce-scatter each segment is summed in
 * the ring's fixed order by one rank, and the all-gather copies that rank's
 * bytes to every other; no rank re-sums. The two halves also run on their
 * own (loom_group_reduce_scatter, loom_group_all_gather: a sharded update
 * between them), each with a few floats summed on every rank in the same
 * round trips. The 16-bit wire formats (loom_group_all_reduce_wire) keep
 * this: a hop adds in float32 and rounds what it forwards, the owner rounds
 * the segment's sum once, and every rank widens those same 16 bits. */
#include "cluster/group_internal.h"
#include "cluster/wire16_internal.h"

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
#include <pthread.h>
#include <stdatomic.h>
#include <sys/eventfd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

enum { K_ALL_REDUCE = 1, K_BROADCAST, K_ALL_GATHER, K_BARRIER, K_REDUCE_SCATTER, K_ALL_GATHER_SHARDS, K_KINDS };
static const char *const kind_names[] = {"?", "all_reduce", "broadcast", "all_gather_bytes", "barrier",
                                         "reduce_scatter", "all_gather_shards"};

#define HDR_MAGIC 0x4f434d4cu /* "LMCO" */
/* Receive buffer of a reducing step: small enough to stay in L2. */
#define CHUNK (256u << 10)
/* All-reduces up to this many bytes gather every rank's whole buffer and sum
 * them in rank order on every rank: n - 1 hops instead of 2(n - 1). */
#define SMALL (64u << 10)
/* Schedules that send at least this many bytes use the sender thread (when there is one). */
#define THREAD_MIN (256u << 10)
/* How long a small collective polls before it sleeps, when every local rank has a core. */
#define SPIN_S 50e-6

typedef struct coll_hdr {
    uint32_t magic, kind;
    uint64_t seq, count;
    uint32_t aux, pad;
} coll_hdr;

static void sender_stop(sender *sd);

/* I/O on a data connection, clear or through TLS (ssl): bytes moved (> 0),
 * 0 at the end of the stream (receiving), or -1 with errno (EAGAIN: poll,
 * then again; TLS records buffered in ssl are always drained first, so a
 * poll after EAGAIN never sleeps on bytes already read). */
static ssize_t d_send(SSL *ssl, int fd, const void *p, size_t n)
{
    if (!ssl) return send(fd, p, n, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n == 0) return 0;
    size_t w = 0;
    ERR_clear_error();
    errno = 0;
    int r = SSL_write_ex(ssl, p, n, &w);
    if (r == 1) return (ssize_t)w;
    int e = SSL_get_error(ssl, r);
    if (e == SSL_ERROR_WANT_WRITE || e == SSL_ERROR_WANT_READ) errno = EAGAIN;
    else if (e != SSL_ERROR_SYSCALL || !errno) errno = EPIPE;
    return -1;
}

static ssize_t d_recv(SSL *ssl, int fd, void *p, size_t n)
{
    if (!ssl) return recv(fd, p, n, MSG_DONTWAIT);
    size_t got = 0;
    ERR_clear_error();
    errno = 0;
    int r = SSL_read_ex(ssl, p, n, &got);
    if (r == 1) return (ssize_t)got;
    int e = SSL_get_error(ssl, r);
    if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) {
        errno = EAGAIN;
        return -1;
    }
    if (e == SSL_ERROR_ZERO_RETURN || (e == SSL_ERROR_SYSCALL && !errno)) return 0;
    if (e != SSL_ERROR_SYSCALL) errno = EPROTO; /* a bad record: the connection is done for */
    return -1;
}

int loom_group_rank(const loom_group *g) { return g->rank; }
int loom_group_size(const loom_group *g) { return g->size; }
loom_net *loom_group_net(loom_group *g) { return g->net; }

void loom_group_close(loom_group *g)
{
    if (!g) return;
    sender_stop(g->sender);
    SSL_free(g->send_ssl);
    SSL_free(g->recv_ssl);
    SSL_CTX_free(g->ssl_ctx);
    if (g->send_fd >= 0) close(g->send_fd);
    if (g->recv_fd >= 0) close(g->recv_fd);
    loom_net_close(g->net);
    loom_free(g->tmp);
    loom_free(g->wire);
    loom_free(g->peer_rank);
    loom_free(g->waited);
    loom_free(g->orig);
    loom_free(g->peer_orig);
    loom_free(g);
}

int loom_group_data_fd_(loom_group *g, bool recv_side) { return recv_side ? g->recv_fd : g->send_fd; }

int loom_group_peers(loom_group *g, loom_peer_info *out, int max)
{
    loom_peer_info all[64];
    int k = loom_net_peers(g->net, all, g->n_peers < 64 ? g->n_peers : 64), m = 0;
    /* net peers are in rank order without this rank (loom_group_open lists them so); an
     * elastic group's former members are left out: the list is the membership */
    for (int p = 0; p < k && m < max; p++) {
        if (g->peer_rank[p] < 0) continue;
        out[m] = all[p];
        out[m++].collective_wait_sec = g->waited[p];
    }
    return m;
}

static int group_fail(loom_group *g, loom_err *err, bool tell);

/* ---- elastic membership ----------------------------------------------------- */

void loom_group_elastic(loom_group *g)
{
    g->elastic = true;
    for (int p = 0; p < g->n_peers; p++) loom_net_tolerate(g->net, p);
}

int loom_group_member(const loom_group *g, int r) { return r >= 0 && r < g->size ? g->orig[r] : -1; }

void loom_group_set_epoch(loom_group *g, uint32_t epoch) { g->epoch = epoch; }
uint32_t loom_group_epoch(const loom_group *g) { return g->epoch; }

bool loom_group_task_up(loom_group *g, int task_rank)
{
    if (task_rank == g->cluster->rank) return true;
    for (int p = 0; p < g->n_peers; p++)
        if (g->peer_orig[p] == task_rank) return loom_net_peer_up_(g->net, p);
    return false;
}

static int peer_of_task(const loom_group *g, int task_rank)
{
    for (int p = 0; p < g->n_peers; p++)
        if (g->peer_orig[p] == task_rank) return p;
    return -1;
}

int loom_group_listen_port(loom_group *g) { return loom_net_listen_port_(g->net); }

int loom_group_task_ip(loom_group *g, int task_rank, char *buf, size_t len)
{
    int p = peer_of_task(g, task_rank);
    return p < 0 ? -1 : loom_net_peer_ip_(g->net, p, buf, len);
}

int loom_group_learn(loom_group *g, int task_rank, const char *host, int port, loom_err *err)
{
    int p = peer_of_task(g, task_rank);
    return p < 0 ? LOOM_OK : loom_net_learn_peer_(g->net, p, host, port, err);
}

int loom_group_reform(loom_group *g, const int *members, int n, loom_err *err)
{
    const char *who = loom_net_name_(g->net);
    int me = -1;
    for (int i = 0; i < n; i++)
        if (members[i] == g->cluster->rank) me = i;
    if (!g->elastic || me < 0 || n < 1 || n > loom_cluster_train_slots(g->cluster))
        return loom_err_set(err, LOOM_EUSAGE, who, "re-forming the ring: this task is not among the %d members", n);
    bool had_sender = g->sender != NULL || g->use_sender;
    sender_stop(g->sender);
    g->sender = NULL;
    SSL_free(g->send_ssl), SSL_free(g->recv_ssl);
    g->send_ssl = g->recv_ssl = NULL;
    if (g->send_fd >= 0) close(g->send_fd);
    if (g->recv_fd >= 0) close(g->recv_fd);
    g->send_fd = g->recv_fd = -1;
    g->rank = me, g->size = n, g->seq = 0, g->broken = 0, g->epoch++;
    for (int i = 0; i < n; i++) {
        g->orig[i] = members[i];
        loom_role role;
        int index;
        loom_group_task_of_rank_(g->cluster, members[i], &role, &index);
        if (i < 16) loom_net_task_name_(role, index, g->names[i], sizeof g->names[i]);
    }
    for (int p = 0; p < g->n_peers; p++) {
        g->peer_rank[p] = -1;
        for (int i = 0; i < n; i++)
            if (members[i] == g->peer_orig[p]) g->peer_rank[p] = i;
        if (g->peer_rank[p] == (me + 1) % n) g->next_peer = p;
        if (g->peer_rank[p] == (me + n - 1) % n) g->prev_peer = p;
    }
    if (n == 1) return LOOM_OK;
    g->spin = loom_group_local_ranks_(g) <= loom_num_cores(); /* (the members on this host changed) */
    /* a neighbour that joined (an unlisted worker dials another when it learns
     * its address) may still be connecting: the ring's hello goes over that connection */
    double t = g->cluster->connect_timeout > 0 ? g->cluster->connect_timeout : 60;
    for (double until = loom_now() + t; loom_now() < until;) {
        if (loom_net_peer_up_(g->net, g->prev_peer) && loom_net_peer_up_(g->net, g->next_peer)) break;
        usleep(10000);
    }
    int rc = loom_group_ring_connect_(g, g->cluster, err);
    if (rc) return group_fail(g, err, false);
    if (had_sender && loom_group_sender_start_(g)) loom_debug("%s: no sender thread; sending from the caller", who);
    return LOOM_OK;
}

/* ---- the engine ----------------------------------------------------------- */

/* One step of a schedule: send send_len bytes to the successor and receive
 * recv_len bytes from the predecessor, at once. A gated step's send may only
 * go as far as the previous step's receive has been processed (reduced or
 * copied), which pipelines the ring piece by piece. With acc set, the
 * received bytes are floats added into acc; else they land in recv as they
 * are. With wire set (a 16-bit format), acc's received values are 16-bit,
 * widened, added into acc, and the sums rounded into out16 (what the next
 * step forwards); on the last reducing step (own) acc then takes the
 * rounded sums back, and a gathering step (widen) widens what it receives
 * into float32 as it lands, so the conversions overlap the wire. */
struct step {
    const uint8_t *send;
    size_t         send_len;
    uint8_t       *recv;
    size_t         recv_len;
    float         *acc;
    bool           gate;
    uint8_t        wire;   /* loom_wire_fmt */
    uint16_t      *out16;  /* with wire and acc: the rounded sums */
    bool           own;    /* with wire and acc: acc := the rounded sums (this rank's segment, final) */
    float         *widen;  /* with wire and no acc: the received 16-bit values widened here */
};

static void describe(char *buf, size_t n, const coll_hdr *h)
{
    const char *k = h->kind < K_KINDS ? kind_names[h->kind] : "?";
    if (h->kind == K_ALL_REDUCE || h->kind == K_REDUCE_SCATTER || h->kind == K_ALL_GATHER_SHARDS)
        snprintf(buf, n, "%s #%llu (%llu floats)", k, (unsigned long long)h->seq, (unsigned long long)h->count);
    else if (h->kind == K_BROADCAST)
        snprintf(buf, n, "%s #%llu (%llu bytes from rank %u)", k, (unsigned long long)h->seq,
                 (unsigned long long)h->count, h->aux);
    else
        snprintf(buf, n, "%s #%llu", k, (unsigned long long)h->seq);
}

/* Tells every other rank why this group stopped (best effort) and keeps the error. */
static int group_fail(loom_group *g, loom_err *err, bool tell)
{
    g->broken = err->code ? err->code : LOOM_ENET;
    g->broken_err = *err;
    if (tell) {
        uint8_t msg[8 + sizeof err->msg];
        loom_group_put32_(msg, (uint32_t)err->code);
        loom_group_put32_(msg + 4, g->epoch);
        size_t l = strlen(err->msg);
        memcpy(msg + 8, err->msg, l);
        loom_err e2;
        for (int p = 0; p < g->n_peers; p++)
            if (g->peer_rank[p] >= 0) loom_net_send(g->net, p, LOOM_MSG_GROUP_ABORT, msg, 8 + l, &e2);
    }
    return g->broken;
}

/* The alert fd fired, or a data connection ended: an abort notice from
 * another rank, or a lost peer. A rank that left on purpose (BYE) is no
 * reason to stop: it may simply have finished this collective first; if we
 * still need it, its data connection ends and data_closed says so. */
static int check_alert(loom_group *g, loom_err *err, bool *from_abort)
{
    *from_abort = false;
    uint64_t v;
    if (read(g->alert_fd, &v, sizeof v) < 0) { /* nothing pending */
    }
    loom_buf m;
    loom_buf_init(&m);
    int from;
    loom_err e = {0};
    while (loom_net_recv(g->net, -1, LOOM_MSG_GROUP_ABORT, LOOM_MSG_GROUP_ABORT, &from, NULL, &m, 0, &e) == LOOM_OK) {
        /* an abort of an earlier membership (elastic), or from a rank no longer a member, is stale */
        if (m.len < 8 || loom_group_get32_(m.data + 4) != g->epoch || g->peer_rank[from] < 0) continue;
        int code = (int)loom_group_get32_(m.data);
        if (code <= 0 || code >= LOOM_ENUM_ERRORS_) code = LOOM_ENET;
        loom_err_set(err, code, loom_net_name_(g->net), "%s reports: %.*s", loom_group_rname_(g, g->peer_rank[from]),
                     (int)(m.len - 8 > 400 ? 400 : m.len - 8), (char *)m.data + 8);
        loom_buf_fini(&m);
        *from_abort = true;
        return code;
    }
    loom_buf_fini(&m);
    if (loom_net_lost_peer(g->net, err) >= 0) return LOOM_ENET;
    /* elastic: the peers are tolerated, so a lost member is no lost peer of
     * the transport; one not connected now is (a member that left on purpose
     * is not: it may have finished this collective first) */
    for (int p = 0; g->elastic && p < g->n_peers; p++)
        if (g->peer_rank[p] >= 0 && loom_net_peer_lost_(g->net, p))
            return loom_err_set(err, LOOM_ENET, loom_net_name_(g->net), "lost %s", loom_group_rname_(g, g->peer_rank[p]));
    return LOOM_OK;
}

static int timeout_report(loom_group *g, const coll_hdr *h, double waited, loom_err *err)
{
    char what[128], rep[400] = "";
    describe(what, sizeof what, h);
    char prefix[160];
    snprintf(prefix, sizeof prefix, "in %s", what);
    size_t k = 0;
    for (int p = 0; p < g->n_peers; p++) {
        char name[32], st[160];
        if (g->peer_rank[p] < 0) continue;
        double age;
        loom_net_peer_info_(g->net, p, name, sizeof name, st, sizeof st, &age);
        if (strncmp(st, prefix, strlen(prefix)) == 0) continue;
        k += (size_t)snprintf(rep + k, k < sizeof rep ? sizeof rep - k : 0, "%srank %d (%s): last heard %.1f s ago, %s",
                              k ? "; " : "", g->peer_rank[p], name, age, st);
        if (k >= sizeof rep) break;
    }
    loom_err_set(err, LOOM_ETIMEOUT, loom_net_name_(g->net), "%s waited %.1f s (collective timeout %g s); not arrived: %s",
                 what, waited, g->timeout, k ? rep : "none by their last heartbeats (the ring is stuck on a slow link)");
    return loom_err_hint(err, "a rank is stuck or much slower than the others; raise the collective timeout if it is "
                              "only slow");
}

static int data_closed(loom_group *g, const coll_hdr *h, bool sending, loom_err *err)
{
    /* The transport usually knows more (lost, or left on purpose): give it
     * time to say so. A peer that closed its data connection has closed
     * (or soon closes) its control connection too, or said BYE there; the
     * transport's loop thread says which within milliseconds on an idle
     * machine, but not within a fixed second on a loaded one (seen: at load
     * 14 a killed rank was reported as a closed data connection, without its
     * address and what it last did). Bounded by heartbeat_timeout (at least
     * 1 s), past which the transport declares a silent peer lost anyway. */
    double hb = loom_net_heartbeat_timeout_(g->net);
    double until = loom_now() + (hb > 1.0 ? hb : 1.0);
    int r = sending ? (g->rank + 1) % g->size : (g->rank + g->size - 1) % g->size;
    int p = sending ? g->next_peer : g->prev_peer;
    bool ab;
    while (loom_now() < until) {
        if (check_alert(g, err, &ab)) return group_fail(g, err, !ab);
        if (loom_net_peer_down_(g->net, p, err)) return group_fail(g, err, false);
        struct pollfd pf = {g->alert_fd, POLLIN, 0};
        poll(&pf, 1, 20);
    }
    char what[128];
    describe(what, sizeof what, h);
    loom_err_set(err, LOOM_ENET, loom_net_name_(g->net), "the ring's data connection %s %s closed during %s",
                 sending ? "to" : "from", loom_group_rname_(g, r), what);
    return group_fail(g, err, true);
}

static int check_header_from(loom_group *g, const coll_hdr *mine, const coll_hdr *theirs, int prev, loom_err *err)
{
    if (theirs->magic == mine->magic && theirs->kind == mine->kind && theirs->seq == mine->seq &&
        theirs->count == mine->count && theirs->aux == mine->aux)
        return LOOM_OK;
    char a[128], b[128];
    describe(a, sizeof a, mine);
    if (theirs->magic != HDR_MAGIC)
        snprintf(b, sizeof b, "sent bytes that are not a collective's header");
    else
        describe(b, sizeof b, theirs);
    loom_err_set(err, LOOM_EUSAGE, loom_net_name_(g->net),
                 "collectives differ: rank %d (%s) entered %s, rank %d (%s) entered %s", g->rank, loom_group_rname_(g, g->rank), a,
                 prev, loom_group_rname_(g, prev), b);
    loom_err_hint(err, "every rank must call the same collectives in the same order with the same sizes");
    return group_fail(g, err, true);
}

static int check_header(loom_group *g, const coll_hdr *mine, const coll_hdr *theirs, loom_err *err)
{
    return check_header_from(g, mine, theirs, (g->rank + g->size - 1) % g->size, err);
}

/* ---- the sender thread ------------------------------------------------------ */

/* Large collectives send from a thread of their own while the calling thread
 * receives and reduces: the kernel's send copy and receive copy then run at
 * once on two cores. The calling thread publishes how far its receiving has
 * got (recv_done, bytes over the whole schedule) and the sender goes as far
 * as each step's gate allows, sleeping on wake_fd when it must wait.
 * A receive may land in a segment whose send() call is still running (the
 * all-gather writes segments this rank sent earlier): each byte arriving
 * there was first sent by this rank and came back round the ring, so the
 * kernel had copied it out before the new one comes in (ThreadSanitizer
 * sees the two calls overlap, not the bytes). */
struct sender {
    pthread_t       th;
    pthread_mutex_t mu;
    pthread_cond_t  cv;
    int             wake_fd, done_fd;      /* eventfds: to the sender, from it */
    int             fd;                    /* the data connection to the successor */
    SSL            *ssl;                   /* its TLS, or NULL */
    /* the job (under mu) */
    const step     *steps;
    const uint64_t *recv_start;            /* receive offset where step k begins */
    int             ns;
    uint64_t        job, finished;         /* job numbers */
    int             failed_errno;          /* 0, or send()'s errno */
    bool            quit;
    _Atomic uint64_t recv_done;
    _Atomic int      waiting, abort;
};

static void sender_wake(sender *sd)
{
    uint64_t one = 1;
    if (write(sd->wake_fd, &one, sizeof one) < 0) { /* a full counter still wakes */
    }
}

static void drain(int fd)
{
    uint64_t v;
    if (read(fd, &v, sizeof v) < 0) { /* nothing pending */
    }
}

static int sender_job(sender *sd)
{
    for (int si = 0; si < sd->ns; si++) {
        const step *s = &sd->steps[si];
        size_t so = 0;
        while (so < s->send_len) {
            if (atomic_load(&sd->abort)) return 0;
            size_t allowed = s->send_len;
            if (s->gate) {
                uint64_t r = atomic_load(&sd->recv_done), start = sd->recv_start[si - 1];
                allowed = r <= start ? 0 : r - start < s->send_len ? (size_t)(r - start) : s->send_len;
            }
            if (allowed > so) {
                ssize_t w = d_send(sd->ssl, sd->fd, s->send + so, allowed - so);
                if (w > 0) {
                    so += (size_t)w;
                    continue;
                }
                if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return errno;
                struct pollfd pf[2] = {{sd->fd, POLLOUT, 0}, {sd->wake_fd, POLLIN, 0}};
                if (poll(pf, 2, 100) > 0 && (pf[1].revents & POLLIN)) drain(sd->wake_fd);
                continue;
            }
            /* Gated: wait for the receiver (flag first, then look again: no lost wake-up). */
            atomic_store(&sd->waiting, 1);
            uint64_t r = atomic_load(&sd->recv_done);
            if (r <= sd->recv_start[si - 1] + so && !atomic_load(&sd->abort)) {
                struct pollfd pf = {sd->wake_fd, POLLIN, 0};
                if (poll(&pf, 1, 100) > 0) drain(sd->wake_fd);
            }
            atomic_store(&sd->waiting, 0);
        }
    }
    return 0;
}

static void *sender_main(void *arg)
{
    sender *sd = arg;
    uint64_t done = 0;
    pthread_mutex_lock(&sd->mu);
    for (;;) {
        while (!sd->quit && sd->job == done) pthread_cond_wait(&sd->cv, &sd->mu);
        if (sd->quit) break;
        done = sd->job;
        pthread_mutex_unlock(&sd->mu);
        int e = sender_job(sd);
        pthread_mutex_lock(&sd->mu);
        sd->failed_errno = e;
        sd->finished = done;
        uint64_t one = 1;
        if (write(sd->done_fd, &one, sizeof one) < 0) { /* cannot fail on a fresh eventfd */
        }
    }
    pthread_mutex_unlock(&sd->mu);
    return NULL;
}

int loom_group_sender_start_(loom_group *g)
{
    sender *sd = loom_calloc(1, sizeof *sd);
    if (!sd) return -1;
    pthread_mutex_init(&sd->mu, NULL);
    pthread_cond_init(&sd->cv, NULL);
    sd->fd = g->send_fd;
    sd->ssl = g->send_ssl;
    sd->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    sd->done_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (sd->wake_fd < 0 || sd->done_fd < 0 || pthread_create(&sd->th, NULL, sender_main, sd) != 0) {
        if (sd->wake_fd >= 0) close(sd->wake_fd);
        if (sd->done_fd >= 0) close(sd->done_fd);
        loom_free(sd);
        return -1;
    }
    g->sender = sd;
    return 0;
}

static void sender_stop(sender *sd)
{
    if (!sd) return;
    pthread_mutex_lock(&sd->mu);
    sd->quit = true;
    pthread_cond_signal(&sd->cv);
    pthread_mutex_unlock(&sd->mu);
    pthread_join(sd->th, NULL);
    close(sd->wake_fd);
    close(sd->done_fd);
    pthread_mutex_destroy(&sd->mu);
    pthread_cond_destroy(&sd->cv);
    loom_free(sd);
}

/* ---- running a schedule ------------------------------------------------------ */

/* The state of one run of a schedule: the steps (the header's first), how
 * far the sends (si, so) and receives (ri, ro; rdone of them added in) got,
 * and the sender thread when it has the sends. */
typedef struct run_state {
    coll_hdr *hdr, in;          /* ours, and the predecessor's as received */
    step     *all;
    uint64_t *rstart;           /* receive offset of each step in the whole schedule */
    int       ns, si, ri;
    size_t    so, ro, rdone, allowed;
    sender   *sd;               /* NULL: this thread sends */
    bool      hdr_ok, sent_all;
} run_state;

/* Hands the schedule's sends to the sender thread. */
static void run_give_sender(sender *sd, step *all, uint64_t *rstart, int ns)
{
    atomic_store(&sd->recv_done, 0);
    atomic_store(&sd->abort, 0);
    atomic_store(&sd->waiting, 0);
    drain(sd->done_fd);
    pthread_mutex_lock(&sd->mu);
    sd->steps = all, sd->recv_start = rstart, sd->ns = ns;
    sd->job++;
    pthread_cond_signal(&sd->cv);
    pthread_mutex_unlock(&sd->mu);
}

/* Stops the sender (when it has not finished) before the buffers go back to the caller. */
static void run_stop_sender(sender *sd)
{
    atomic_store(&sd->abort, 1);
    sender_wake(sd);
    pthread_mutex_lock(&sd->mu);
    while (sd->finished != sd->job) {
        pthread_mutex_unlock(&sd->mu);
        struct pollfd pf = {sd->done_fd, POLLIN, 0};
        poll(&pf, 1, 100);
        drain(sd->done_fd);
        pthread_mutex_lock(&sd->mu);
    }
    pthread_mutex_unlock(&sd->mu);
}

/* Moves past the steps whose sends or receives are complete; the header,
 * once received, is checked before anything else. */
static int run_advance(loom_group *g, run_state *r, loom_err *err)
{
    int rc;
    while (r->si < r->ns && r->so == r->all[r->si].send_len) r->si++, r->so = 0;
    while (r->ri < r->ns && r->rdone == r->all[r->ri].recv_len) {
        if (r->ri == 0 && !r->hdr_ok) {
            if ((rc = check_header(g, r->hdr, &r->in, err))) return rc;
            r->hdr_ok = true;
        }
        r->ri++, r->ro = r->rdone = 0;
    }
    return LOOM_OK;
}

/* Sends what the gate allows of the current step (a gated step sends no
 * more than the previous step received). 1: some went, 0: none could, -1:
 * the connection failed (*rc). */
static int run_send(loom_group *g, run_state *r, int *rc, loom_err *err)
{
    r->allowed = 0;
    if (r->si >= r->ns) return 0;
    const step *s = &r->all[r->si];
    if (!s->gate || r->ri > r->si - 1) r->allowed = s->send_len;
    else if (r->ri == r->si - 1) r->allowed = r->rdone < s->send_len ? r->rdone : s->send_len;
    if (r->allowed <= r->so) return 0;
    ssize_t n = d_send(g->send_ssl, g->send_fd, s->send + r->so, r->allowed - r->so);
    if (n > 0) {
        r->so += (size_t)n;
        return 1;
    }
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        *rc = data_closed(g, r->hdr, true, err);
        return -1;
    }
    return 0;
}

/* Receives what has come for the current step. A reducing step receives
 * into a small buffer that stays in cache (its first ro - rdone < 4 bytes:
 * a value cut in two by the last read), adds it in, and goes on. 2: the
 * header just completed (check it first), 1: some came, 0: none, -1: the
 * connection failed (*rc). */
static int run_recv(loom_group *g, run_state *r, int *rc, loom_err *err)
{
    if (r->ri >= r->ns) return 0;
    step *s = &r->all[r->ri];
    size_t carry = r->ro - r->rdone, want = s->recv_len - r->ro;
    if (s->acc && want > CHUNK - carry) want = CHUNK - carry;
    ssize_t n = d_recv(g->recv_ssl, g->recv_fd, s->acc ? g->tmp + carry : s->recv + r->ro, want);
    if (n > 0) {
        r->ro += (size_t)n;
        if (s->acc) {
            size_t es = s->wire ? 2 : 4, nf = (r->ro - r->rdone) / es;
            if (s->wire) {
                loom_wire_add_((loom_wire_fmt)s->wire, s->acc + r->rdone / 2, s->out16 + r->rdone / 2, (const uint16_t *)g->tmp, nf);
                if (s->own) loom_wire_widen_((loom_wire_fmt)s->wire, s->acc + r->rdone / 2, s->out16 + r->rdone / 2, nf);
            } else {
                const float *src = (const float *)g->tmp;
                float *acc = s->acc + r->rdone / 4;
                for (size_t i = 0; i < nf; i++) acc[i] += src[i];
            }
            r->rdone += nf * es;
            if (r->ro > r->rdone) memmove(g->tmp, g->tmp + nf * es, r->ro - r->rdone);
        } else {
            if (s->widen && r->ro / 2 > r->rdone / 2) /* the values whose two bytes have come */
                loom_wire_widen_((loom_wire_fmt)s->wire, s->widen + r->rdone / 2, (const uint16_t *)s->recv + r->rdone / 2,
                                 r->ro / 2 - r->rdone / 2);
            r->rdone = r->ro;
        }
        if (r->sd) {
            atomic_store(&r->sd->recv_done, r->rstart[r->ri] + r->rdone);
            if (atomic_load(&r->sd->waiting)) sender_wake(r->sd);
        }
        return r->ri == 0 && r->rdone == s->recv_len ? 2 : 1;
    }
    if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        *rc = data_closed(g, r->hdr, false, err);
        return -1;
    }
    return 0;
}

/* Neither side could move: sleeps in poll (at most 200 ms) on the send
 * (when the gate allows one), the receive, the sender's end and the alert
 * pipe, then looks for a lost rank (at least once a second) and the
 * collective's timeout. */
static int run_wait(loom_group *g, run_state *r, double t0, double *last_check, loom_err *err)
{
    int rc;
    struct pollfd pf[4];
    int np = 0, i_recv = -1, i_done = -1;
    if (r->si < r->ns && r->allowed > r->so) pf[np++] = (struct pollfd){g->send_fd, POLLOUT, 0};
    if (r->ri < r->ns) i_recv = np, pf[np++] = (struct pollfd){g->recv_fd, POLLIN, 0};
    if (r->sd && !r->sent_all) i_done = np, pf[np++] = (struct pollfd){r->sd->done_fd, POLLIN, 0};
    pf[np++] = (struct pollfd){g->alert_fd, POLLIN, 0};
    /* Blocked: on the predecessor while a receive is due, else on the successor draining our sends. */
    double blocked_at = loom_now();
    int pr = poll(pf, (nfds_t)np, 200);
    g->waited[i_recv >= 0 ? g->prev_peer : g->next_peer] += loom_now() - blocked_at;
    if (i_done >= 0 && (pf[i_done].revents & POLLIN)) {
        sender *sd = r->sd;
        drain(sd->done_fd);
        pthread_mutex_lock(&sd->mu);
        bool fin = sd->finished == sd->job;
        int e = sd->failed_errno;
        pthread_mutex_unlock(&sd->mu);
        if (fin) {
            r->sent_all = true;
            if (e) {
                r->sd = NULL; /* it has stopped */
                return data_closed(g, r->hdr, true, err);
            }
        }
    }
    double now = loom_now();
    if ((pr > 0 && (pf[np - 1].revents & POLLIN)) || now - *last_check > 1.0) {
        *last_check = now;
        bool ab;
        if ((rc = check_alert(g, err, &ab))) /* A lost rank: tell the others, who may not talk to it (or not have noticed yet). */
            return group_fail(g, err, !ab);
    }
    if (g->timeout > 0 && now - t0 > g->timeout) {
        timeout_report(g, r->hdr, now - t0, err);
        return group_fail(g, err, true);
    }
    return LOOM_OK;
}

/* Runs the header step then st[0..ns). Small ones in one thread: a
 * nonblocking loop that sends what the gates allow and receives what has
 * come, sleeping in poll only when neither can move. Large ones hand the
 * sends to the sender thread. */
static int run(loom_group *g, coll_hdr *hdr, step *st, int ns, loom_err *err)
{
    step all[2 * 64 + 4];
    uint64_t rstart[2 * 64 + 4];
    LOOM_ASSERT(ns + 1 <= (int)(sizeof all / sizeof all[0]));
    run_state r = {.hdr = hdr, .all = all, .rstart = rstart, .ns = ns + 1};
    all[0] = (step){(const uint8_t *)hdr, sizeof *hdr, (uint8_t *)&r.in, sizeof r.in, NULL, false, 0, NULL, false, NULL};
    memcpy(all + 1, st, (size_t)ns * sizeof *st);
    uint64_t total_send = 0, total_recv = 0;
    for (int k = 0; k < r.ns; k++) rstart[k] = total_recv, total_recv += all[k].recv_len, total_send += all[k].send_len;
    r.sd = total_send >= THREAD_MIN ? g->sender : NULL;
    if (r.sd) run_give_sender(r.sd, all, rstart, r.ns);
    r.si = r.sd ? r.ns : 0;
    r.sent_all = !r.sd;
    int rc = LOOM_OK;
    double t0 = loom_now(), last_check = t0, idle_since = 0;
    bool spin = g->spin && total_send <= SMALL + 64;
    for (;;) {
        if ((rc = run_advance(g, &r, err))) break;
        if (r.si >= r.ns && r.ri >= r.ns && r.sent_all) break;
        int sent = run_send(g, &r, &rc, err);
        if (sent < 0) break;
        int got = run_recv(g, &r, &rc, err);
        if (got < 0) break;
        if (got == 2) continue; /* check the header before anything else */
        if (sent || got) {
            idle_since = 0;
            continue;
        }
        if (spin) {
            /* Small collectives with a core per local rank: poll a little before sleeping (a wake-up costs more). */
            double now = loom_now();
            if (!idle_since) idle_since = now;
            if (now - idle_since < SPIN_S) continue;
            idle_since = 0;
        }
        if ((rc = run_wait(g, &r, t0, &last_check, err))) break;
    }
    if (r.sd && !r.sent_all) run_stop_sender(r.sd);
    return rc;
}

static int enter(loom_group *g, coll_hdr *h, int kind, uint64_t count, uint32_t aux, loom_err *err)
{
    if (g->broken) {
        *err = g->broken_err;
        return loom_err_prefix(err, "the group stopped earlier");
    }
    memset(h, 0, sizeof *h);
    h->magic = HDR_MAGIC, h->kind = (uint32_t)kind, h->seq = ++g->seq, h->count = count, h->aux = aux;
    char what[128];
    describe(what, sizeof what, h);
    loom_net_set_status_(g->net, "in %s", what);
    return LOOM_OK;
}

static void leave(loom_group *g, const coll_hdr *h)
{
    char what[128];
    describe(what, sizeof what, h);
    loom_net_set_status_(g->net, "between collectives, after %s", what);
}

static int tmp_reserve(loom_group *g, size_t n, loom_err *err)
{
    if (g->tmp_cap >= n) return LOOM_OK;
    uint8_t *t = loom_alloc_aligned(n);
    if (!t) return loom_err_set(err, LOOM_ENOMEM, loom_net_name_(g->net), "no memory for a %zu-byte buffer", n);
    loom_free(g->tmp);
    g->tmp = t, g->tmp_cap = n;
    return LOOM_OK;
}

/* Segment k of count floats split n ways. */
static void seg(int64_t count, int n, int k, int64_t *off, int64_t *len)
{
    int64_t a = count * k / n, b = count * (k + 1) / n;
    *off = a, *len = b - a;
}

/* Ring all-gather of n pieces (piece r starts at this rank when r == rank). */
static int gather_pieces(loom_group *g, coll_hdr *h, uint8_t **piece, const size_t *plen, loom_err *err)
{
    int n = g->size, r = g->rank;
    step st[64];
    for (int t = 0; t < n - 1; t++) {
        int s = ((r - t) % n + n) % n, q = ((r - t - 1) % n + n) % n;
        st[t] = (step){piece[s], plen[s], piece[q], plen[q], NULL, t > 0, 0, NULL, false, NULL};
    }
    return run(g, h, st, n - 1, err);
}

/* A small all-reduce among 3 ranks in one hop: the ring's connections are
 * full duplex, so each rank sends its header and buffer both ways (to its
 * successor and, backwards, to its predecessor) and receives the other two
 * ranks' at once; then every rank sums the three in rank order, as the
 * n - 1 hop path does. */
static int small3(loom_group *g, coll_hdr *hdr, const float *buf, size_t bytes, loom_err *err)
{
    int r = g->rank, next = (r + 1) % 3, prev = (r + 2) % 3;
    if (g->tmp + (size_t)r * bytes != (const uint8_t *)buf) memcpy(g->tmp + (size_t)r * bytes, buf, bytes);
    coll_hdr in[2]; /* from prev (on recv_fd), from next (on send_fd) */
    memset(in, 0, sizeof in);
    int fd[2] = {g->recv_fd, g->send_fd};
    SSL *ssl[2] = {g->recv_ssl, g->send_ssl};
    uint8_t *dst[2] = {g->tmp + (size_t)prev * bytes, g->tmp + (size_t)next * bytes};
    size_t out_n[2] = {0, 0}, in_n[2] = {0, 0}, total = sizeof *hdr + bytes;
    bool checked[2] = {false, false};
    double t0 = loom_now(), last_check = t0, idle_since = 0;
    for (;;) {
        bool progress = false, done = true;
        for (int k = 0; k < 2; k++) {
            if (out_n[k] < total) {
                struct iovec iov[2];
                int ni = 0;
                if (out_n[k] < sizeof *hdr)
                    iov[ni++] = (struct iovec){(uint8_t *)hdr + out_n[k], sizeof *hdr - out_n[k]};
                size_t d0 = out_n[k] > sizeof *hdr ? out_n[k] - sizeof *hdr : 0;
                if (bytes > d0) iov[ni++] = (struct iovec){g->tmp + (size_t)r * bytes + d0, bytes - d0};
                struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)ni};
                ssize_t w = ssl[k] ? d_send(ssl[k], fd[k], iov[0].iov_base, iov[0].iov_len)
                                   : sendmsg(fd[k], &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
                if (w > 0) out_n[k] += (size_t)w, progress = true;
                else if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                    return data_closed(g, hdr, k == 1, err);
            }
            if (in_n[k] < total) {
                struct iovec iov[2];
                int ni = 0;
                if (in_n[k] < sizeof *hdr) iov[ni++] = (struct iovec){(uint8_t *)&in[k] + in_n[k], sizeof *hdr - in_n[k]};
                size_t d0 = in_n[k] > sizeof *hdr ? in_n[k] - sizeof *hdr : 0;
                if (bytes > d0) iov[ni++] = (struct iovec){dst[k] + d0, bytes - d0};
                struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)ni};
                ssize_t rd = ssl[k] ? d_recv(ssl[k], fd[k], iov[0].iov_base, iov[0].iov_len) : recvmsg(fd[k], &mh, MSG_DONTWAIT);
                if (rd > 0) in_n[k] += (size_t)rd, progress = true;
                else if (rd == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
                    return data_closed(g, hdr, k == 1, err);
            }
            if (!checked[k] && in_n[k] >= sizeof *hdr) {
                int rc = check_header_from(g, hdr, &in[k], k == 0 ? prev : next, err);
                if (rc) return rc;
                checked[k] = true;
            }
            if (out_n[k] < total || in_n[k] < total) done = false;
        }
        if (done) return LOOM_OK;
        if (progress) {
            idle_since = 0;
            continue;
        }
        if (g->spin) {
            double now = loom_now();
            if (!idle_since) idle_since = now;
            if (now - idle_since < SPIN_S) continue;
            idle_since = 0;
        }
        struct pollfd pf[3];
        for (int k = 0; k < 2; k++)
            pf[k] = (struct pollfd){fd[k], (short)((out_n[k] < total ? POLLOUT : 0) | (in_n[k] < total ? POLLIN : 0)), 0};
        pf[2] = (struct pollfd){g->alert_fd, POLLIN, 0};
        double blocked_at = loom_now();
        int pr = poll(pf, 3, 200);
        double now = loom_now();
        g->waited[in_n[0] < total ? g->prev_peer : g->next_peer] += now - blocked_at;
        if ((pr > 0 && (pf[2].revents & POLLIN)) || now - last_check > 1.0) {
            last_check = now;
            bool ab;
            int rc = check_alert(g, err, &ab);
            if (rc) return group_fail(g, err, !ab);
        }
        if (g->timeout > 0 && now - t0 > g->timeout) {
            timeout_report(g, hdr, now - t0, err);
            return group_fail(g, err, true);
        }
    }
}

/* All-reduces of up to SMALL bytes on the wire: every rank's buffer (as
 * float32, or narrowed to 16 bits) to every rank, then the same float32 sum
 * in rank order everywhere. */
static int small_all_reduce(loom_group *g, coll_hdr *h, float *buf, int64_t count, loom_wire_fmt fmt, loom_err *err)
{
    int n = g->size, r = g->rank, rc;
    size_t es = fmt == LOOM_WIRE_F32 ? 4 : 2, bytes = (size_t)count * es;
    if ((rc = tmp_reserve(g, bytes * (size_t)n + 64, err))) return rc;
    uint8_t *pp[64] = {g->tmp};
    size_t pl[64];
    for (int k = 0; k < n; k++) pp[k] = g->tmp + (size_t)k * bytes, pl[k] = bytes;
    if (fmt == LOOM_WIRE_F32) memcpy(pp[r], buf, bytes);
    else loom_wire_narrow_(fmt, (uint16_t *)pp[r], buf, (size_t)count);
    if (n == 3)
        rc = small3(g, h, (const float *)pp[r], bytes, err); /* (it copies the bytes, whatever they hold) */
    else
        rc = gather_pieces(g, h, pp, pl, err);
    if (rc) return rc;
    for (int k = 0; k < n; k++) {
        if (fmt == LOOM_WIRE_F32) {
            const float *xk = (const float *)pp[k];
            if (!k) memcpy(buf, xk, bytes);
            else
                for (int64_t i = 0; i < count; i++) buf[i] += xk[i];
        } else {
            const uint16_t *xk = (const uint16_t *)pp[k];
            if (!k) loom_wire_widen_(fmt, buf, xk, (size_t)count);
            else loom_wire_add_(fmt, buf, NULL, xk, (size_t)count);
        }
    }
    return LOOM_OK;
}

/* The 16-bit copy of count values (the wire buffer). */
static int wire_reserve(loom_group *g, int64_t count, loom_err *err)
{
    if (g->wire_cap >= (size_t)count) return LOOM_OK;
    uint16_t *w = loom_alloc_aligned((size_t)count * 2 + 64);
    if (!w) return loom_err_set(err, LOOM_ENOMEM, loom_net_name_(g->net), "no memory for a %lld-value wire buffer",
                                (long long)count);
    loom_free(g->wire);
    g->wire = w, g->wire_cap = (size_t)count;
    return LOOM_OK;
}

/* The ring: reduce-scatter (step t < n - 1 adds segment q into buf) then
 * all-gather. In float32 the steps send and receive buf itself; in 16 bits
 * they send and receive the wire copy w: a reducing step adds the received
 * values into buf and rounds the sums into w, which the next step forwards;
 * the owner's last one also takes the rounded sums into buf, and the
 * gathering steps widen the owners' rounded sums into buf as they arrive. */
static int ring_all_reduce(loom_group *g, coll_hdr *h, float *buf, int64_t count, loom_wire_fmt fmt, loom_err *err)
{
    int n = g->size, r = g->rank, rc;
    if ((rc = tmp_reserve(g, CHUNK, err))) return rc;
    uint16_t *w = NULL;
    size_t es = 4;
    if (fmt != LOOM_WIRE_F32) {
        if ((rc = wire_reserve(g, count, err))) return rc;
        w = g->wire, es = 2;
        int64_t o, l;
        seg(count, n, r, &o, &l);
        loom_wire_narrow_(fmt, w + o, buf + o, (size_t)l); /* the first step sends this rank's own segment */
    }
    uint8_t *base = w ? (uint8_t *)w : (uint8_t *)buf;
    step st[128];
    int k = 0;
    for (int t = 0; t < 2 * (n - 1); t++) {
        int s = ((r - t) % n + n) % n, q = ((r - t - 1) % n + n) % n;
        int64_t so, sl, qo, ql;
        seg(count, n, s, &so, &sl);
        seg(count, n, q, &qo, &ql);
        memset(&st[k], 0, sizeof st[k]);
        st[k].send = base + (size_t)so * es, st[k].send_len = (size_t)sl * es;
        st[k].recv = base + (size_t)qo * es, st[k].recv_len = (size_t)ql * es;
        st[k].acc = t < n - 1 ? buf + qo : NULL;
        st[k].gate = t > 0;
        st[k].wire = (uint8_t)fmt;
        st[k].out16 = w && st[k].acc ? w + qo : NULL;
        st[k].own = w && t == n - 2;
        st[k].widen = w && !st[k].acc ? buf + qo : NULL;
        k++;
    }
    return run(g, h, st, k, err);
}

int loom_group_all_reduce_wire(loom_group *g, float *buf, int64_t count, loom_wire_fmt fmt, loom_err *err)
{
    if (fmt != LOOM_WIRE_F32 && fmt != LOOM_WIRE_BF16 && fmt != LOOM_WIRE_FP16)
        return loom_err_set(err, LOOM_EUSAGE, NULL, "unknown wire format %d", (int)fmt);
    coll_hdr h;
    int rc = enter(g, &h, K_ALL_REDUCE, (uint64_t)count, (uint32_t)fmt, err); /* (a rank on another format differs in aux) */
    if (rc) return rc;
    if (g->size == 1) {
        loom_wire_round(fmt, buf, count); /* the same values as a ring of several would give */
        return LOOM_OK;
    }
    if (g->size > 64) return loom_err_set(err, LOOM_EUSAGE, NULL, "the ring supports up to 64 ranks");
    if (count < 0) return loom_err_set(err, LOOM_EUSAGE, NULL, "negative count");
    size_t es = fmt == LOOM_WIRE_F32 ? 4 : 2;
    if ((size_t)count * es <= SMALL) rc = small_all_reduce(g, &h, buf, count, fmt, err);
    else rc = ring_all_reduce(g, &h, buf, count, fmt, err);
    if (!rc) leave(g, &h);
    return rc;
}

int loom_group_all_reduce(loom_group *g, float *buf, int64_t count, loom_err *err)
{
    return loom_group_all_reduce_wire(g, buf, count, LOOM_WIRE_F32, err);
}

int loom_group_broadcast(loom_group *g, void *buf, size_t len, int root, loom_err *err)
{
    if (root < 0 || root >= g->size)
        return loom_err_set(err, LOOM_EUSAGE, NULL, "broadcast root %d is not a rank (size %d)", root, g->size);
    coll_hdr h;
    int rc = enter(g, &h, K_BROADCAST, len, (uint32_t)root, err);
    if (rc || g->size == 1) return rc;
    int n = g->size, d = (g->rank - root + n) % n;
    step st[2];
    memset(st, 0, sizeof st);
    int k = 0;
    if (d > 0) st[k].recv = buf, st[k].recv_len = len, k++;
    if (d < n - 1) st[k].send = buf, st[k].send_len = len, st[k].gate = d > 0, k++;
    rc = run(g, &h, st, k, err);
    if (!rc) leave(g, &h);
    return rc;
}

int loom_group_all_gather_bytes(loom_group *g, const void *buf, size_t len, loom_buf *out, loom_err *err)
{
    coll_hdr h;
    int rc = enter(g, &h, K_ALL_GATHER, 0, 0, err);
    if (rc) return rc;
    int n = g->size;
    if (n > 64) return loom_err_set(err, LOOM_EUSAGE, NULL, "the ring supports up to 64 ranks");
    uint64_t lens[64];
    uint8_t *lp[64];
    size_t ll[64];
    for (int i = 0; i < n; i++) lens[i] = 0, lp[i] = (uint8_t *)&lens[i], ll[i] = 8;
    lens[g->rank] = len;
    if (n > 1 && (rc = gather_pieces(g, &h, lp, ll, err))) return rc;
    uint8_t *pp[64];
    for (int i = 0; i < n; i++) {
        if (lens[i] > LOOM_NET_FRAME_MAX * 4ull) {
            loom_err_set(err, LOOM_EUSAGE, NULL, "rank %d gathers %llu bytes, above the limit", i,
                         (unsigned long long)lens[i]);
            return group_fail(g, err, true);
        }
        out[i].len = out[i].pos = 0;
        out[i].failed = 0;
        if (out[i].cap < lens[i] || !out[i].data) {
            uint8_t *d = loom_realloc(out[i].data, lens[i] ? lens[i] : 1);
            if (!d) {
                loom_err_set(err, LOOM_ENOMEM, NULL, "no memory for rank %d's %llu bytes", i,
                             (unsigned long long)lens[i]);
                return group_fail(g, err, true);
            }
            out[i].data = d, out[i].cap = lens[i] ? lens[i] : 1;
        }
        out[i].len = lens[i];
        pp[i] = out[i].data;
        ll[i] = lens[i];
    }
    if (len) memcpy(out[g->rank].data, buf, len);
    if (n > 1) {
        /* The second pass runs under the same header (the count is now each rank's length). */
        coll_hdr h2 = h;
        h2.count = 1;
        if ((rc = gather_pieces(g, &h2, pp, ll, err))) return rc;
    }
    leave(g, &h);
    return LOOM_OK;
}

int loom_group_barrier(loom_group *g, loom_err *err)
{
    coll_hdr h;
    int rc = enter(g, &h, K_BARRIER, 0, 0, err);
    if (rc || g->size == 1) return rc;
    uint64_t v[64] = {0};
    uint8_t *lp[64];
    size_t ll[64];
    for (int i = 0; i < g->size; i++) lp[i] = (uint8_t *)&v[i], ll[i] = 8;
    rc = gather_pieces(g, &h, lp, ll, err);
    if (!rc) leave(g, &h);
    return rc;
}

/* ---- the halves of a sharded update ------------------------------------------ */

#define SMALL_N_MAX 16

/* The steps that gather every rank's small floats into pieces (n - 1 of
 * them, before the shards' steps: the first shard step is not gated, so it
 * is not held up by them), and their sum in rank order. */
static int small_steps(const loom_group *g, step *st, float (*pieces)[SMALL_N_MAX], const float *small, int small_n)
{
    int n = g->size, r = g->rank;
    if (small_n <= 0) return 0;
    memcpy(pieces[r], small, (size_t)small_n * sizeof(float));
    for (int t = 0; t < n - 1; t++) {
        int s = ((r - t) % n + n) % n, q = ((r - t - 1) % n + n) % n;
        st[t] = (step){.send = (const uint8_t *)pieces[s], .send_len = (size_t)small_n * 4,
                       .recv = (uint8_t *)pieces[q], .recv_len = (size_t)small_n * 4, .gate = t > 0};
    }
    return n - 1;
}

static void small_sum(const loom_group *g, float (*pieces)[SMALL_N_MAX], float *small, int small_n)
{
    for (int i = 0; i < small_n; i++) {
        small[i] = pieces[0][i];
        for (int k = 1; k < g->size; k++) small[i] += pieces[k][i];
    }
}

/* Shared by both halves: checks, the header, the small floats' steps. */
static int shards_enter(loom_group *g, coll_hdr *h, int kind, const int64_t *off, int small_n, loom_err *err)
{
    int rc = enter(g, h, kind, (uint64_t)off[g->size], (uint32_t)small_n, err);
    if (rc) return rc;
    if (g->size > 64) return loom_err_set(err, LOOM_EUSAGE, NULL, "the ring supports up to 64 ranks");
    if (small_n < 0 || small_n > SMALL_N_MAX)
        return loom_err_set(err, LOOM_EUSAGE, NULL, "%d small floats (at most %d)", small_n, SMALL_N_MAX);
    for (int k = 0; k < g->size; k++)
        if (off[0] != 0 || off[k + 1] < off[k])
            return loom_err_set(err, LOOM_EUSAGE, NULL, "the shards' offsets do not rise from 0");
    return LOOM_OK;
}

int loom_group_reduce_scatter(loom_group *g, float *buf, const int64_t *off, float *small, int small_n, loom_err *err)
{
    coll_hdr h;
    int rc = shards_enter(g, &h, K_REDUCE_SCATTER, off, small_n, err);
    if (rc || g->size == 1) return rc;
    if ((rc = tmp_reserve(g, CHUNK, err))) return rc;
    int n = g->size, r = g->rank;
    float pieces[64][SMALL_N_MAX];
    step st[128];
    int k = small_steps(g, st, pieces, small, small_n);
    /* step t sends segment r - t - 1 (this rank's own at t = 0) and adds in
     * segment r - t - 2: after n - 1 steps segment r is whole here */
    for (int t = 0; t < n - 1; t++, k++) {
        int s = ((r - t - 1) % n + 2 * n) % n, q = ((r - t - 2) % n + 2 * n) % n;
        st[k] = (step){.send = (const uint8_t *)(buf + off[s]), .send_len = (size_t)(off[s + 1] - off[s]) * 4,
                       .recv = (uint8_t *)(buf + off[q]), .recv_len = (size_t)(off[q + 1] - off[q]) * 4,
                       .acc = buf + off[q], .gate = t > 0};
    }
    if ((rc = run(g, &h, st, k, err))) return rc;
    small_sum(g, pieces, small, small_n);
    leave(g, &h);
    return LOOM_OK;
}

int loom_group_all_gather(loom_group *g, float *buf, const int64_t *off, float *small, int small_n, loom_err *err)
{
    coll_hdr h;
    int rc = shards_enter(g, &h, K_ALL_GATHER_SHARDS, off, small_n, err);
    if (rc || g->size == 1) return rc;
    int n = g->size, r = g->rank;
    float pieces[64][SMALL_N_MAX];
    step st[128];
    int k = small_steps(g, st, pieces, small, small_n);
    for (int t = 0; t < n - 1; t++, k++) {
        int s = ((r - t) % n + n) % n, q = ((r - t - 1) % n + n) % n;
        st[k] = (step){.send = (const uint8_t *)(buf + off[s]), .send_len = (size_t)(off[s + 1] - off[s]) * 4,
                       .recv = (uint8_t *)(buf + off[q]), .recv_len = (size_t)(off[q + 1] - off[q]) * 4, .gate = t > 0};
    }
    if ((rc = run(g, &h, st, k, err))) return rc;
    small_sum(g, pieces, small, small_n);
    leave(g, &h);
    return LOOM_OK;
}
