/* cluster_net_fixtures.h - what test_cluster_net.c and
 * test_cluster_net_faults.c share: a hand-made cluster of up to MAXR workers
 * on 127.0.0.1 (ephemeral ports, per-test knobs) and ranks forked under a
 * deadline, each child's log read back by the parent. Included by one test
 * file per executable; all static. */
#ifndef LOOM_CLUSTER_NET_FIXTURES_H
#define LOOM_CLUSTER_NET_FIXTURES_H

#include "cluster/cluster.h"
#include "cluster/net_internal.h"
#include "test_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAXR 4

/* ---- a hand-made cluster of n workers on 127.0.0.1 ------------------------ */

static int ports[MAXR];

/* Per-test variations, reset by new_ports(). */
static struct {
    const char *secret[MAXR];      /* NULL: the common one */
    uint8_t     digest[MAXR];      /* 0: the common one */
    const char *config[MAXR];
    double      connect_timeout, hb_timeout, hb_interval;
    int         tls[MAXR];
    bool        no_secret;         /* 1: TLS with the CA-signed cert, 2: with one the CA did not sign */
    int         stop_rank;         /* run_ranks kills this one once the others are done */
} knob;


static inline int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t l = sizeof a;
    if (bind(fd, (struct sockaddr *)&a, sizeof a) < 0 || getsockname(fd, (struct sockaddr *)&a, &l) < 0) {
        close(fd);
        return 0;
    }
    close(fd);
    return ntohs(a.sin_port);
}

static inline void new_ports(int n)
{
    for (int i = 0; i < n; i++) ports[i] = free_port();
    for (int i = 0; i < MAXR; i++) { /* an earlier test's rank notes: a rank that wrote none must not be read as one */
        char path[600];
        snprintf(path, sizeof path, "%s/rank%d.out", tmpdir, i);
        unlink(path);
    }
    memset(&knob, 0, sizeof knob);
    knob.stop_rank = -1;
}

typedef struct tcl {
    loom_cluster   c;
    loom_task_addr addrs[MAXR];
} tcl;

static inline void mk_cluster(tcl *t, int n, int rank)
{
    memset(t, 0, sizeof *t);
    for (int i = 0; i < n; i++) {
        t->addrs[i].role = LOOM_ROLE_WORKER;
        t->addrs[i].index = i;
        snprintf(t->addrs[i].host, sizeof t->addrs[i].host, "127.0.0.1");
        t->addrs[i].port = ports[i];
    }
    t->c.n_tasks[LOOM_ROLE_WORKER] = n;
    t->c.tasks[LOOM_ROLE_WORKER] = t->addrs;
    t->c.role = LOOM_ROLE_WORKER;
    t->c.index = rank;
    t->c.n_train_ranks = n;
    t->c.rank = rank;
    t->c.connect_timeout = knob.connect_timeout > 0 ? knob.connect_timeout : 10;
    t->c.heartbeat_timeout = knob.hb_timeout > 0 ? knob.hb_timeout : 3;
    t->c.heartbeat_interval = knob.hb_interval > 0 ? knob.hb_interval : 0.2;
    const char *sec = knob.secret[rank] ? knob.secret[rank] : "test-secret-0123456789";
    if (knob.no_secret) sec = "";
    t->c.secret_len = strlen(sec);
    memcpy(t->c.secret, sec, t->c.secret_len);
    memset(t->c.config_digest, knob.digest[rank] ? knob.digest[rank] : 7, 32);
    if (knob.tls[rank]) {
        const char *root = getenv("LOOM_SOURCE_ROOT") ? getenv("LOOM_SOURCE_ROOT") : ".";
        const char *who = knob.tls[rank] == 1 ? "task" : "other";
        t->c.tls = true;
        snprintf(t->c.tls_cert, sizeof t->c.tls_cert, "%s/tests/fixtures/tls/%s.pem", root, who);
        snprintf(t->c.tls_key, sizeof t->c.tls_key, "%s/tests/fixtures/tls/%s.key", root, who);
        snprintf(t->c.tls_ca, sizeof t->c.tls_ca, "%s/tests/fixtures/tls/ca.pem", root);
    }
    t->c.config_text = (char *)(knob.config[rank] ? knob.config[rank]
                                                  : "version = 1;\nmodel = \"mlp\";\noptimizer.learning_rate = 0.1;\n");
}

/* ---- forking ranks ----------------------------------------------------------- */

typedef int (*rank_fn)(int rank, int n);

static const char *log_path(int rank)
{
    static char buf[MAXR][600];
    snprintf(buf[rank], sizeof buf[rank], "%s/rank%d.log", tmpdir, rank);
    return buf[rank];
}

static char *read_log(int rank)
{
    size_t len;
    uint8_t *d = slurp(log_path(rank), &len);
    if (!d) return strdup("");
    char *s = malloc(len + 1);
    memcpy(s, d, len);
    s[len] = 0;
    free(d);
    return s;
}

/* Runs fn(rank, n) in n forked children (stderr to rank<r>.log), reaps them
 * all within deadline seconds (killing the late ones); status[r] = the
 * child's exit code (0 = its checks passed), 128 + signal when killed. */
static inline void run_ranks(int n, rank_fn fn, double deadline, int *status)
{
    pid_t pid[MAXR];
    fflush(stdout);
    fflush(stderr);
    for (int r = 0; r < n; r++) {
        pid[r] = fork();
        if (pid[r] == 0) {
            FILE *f = freopen(log_path(r), "w", stderr);
            (void)f;
            setvbuf(stderr, NULL, _IONBF, 0);
            alarm((unsigned)deadline + 2); /* never outlive the parent's patience */
            int before = harness_failures_;
            int rc = fn(r, n);
            fflush(stdout);
            _exit(rc ? rc : harness_failures_ != before ? 1 : 0);
        }
    }
    double t0 = loom_now();
    for (int r = 0; r < n; r++) status[r] = -1;
    int left = n;
    while (left > 0) {
        for (int r = 0; r < n; r++) {
            if (status[r] != -1) continue;
            int st;
            pid_t w = waitpid(pid[r], &st, WNOHANG);
            if (w == pid[r]) {
                status[r] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
                left--;
            }
        }
        if (left == 1 && knob.stop_rank >= 0 && status[knob.stop_rank] == -1) kill(pid[knob.stop_rank], SIGKILL);
        if (left && loom_now() - t0 > deadline) {
            for (int r = 0; r < n; r++)
                if (status[r] == -1) {
                    printf("# rank %d still running after %.0f s: killed\n", r, deadline);
                    kill(pid[r], SIGKILL);
                }
            deadline += 5;
        }
        if (left) usleep(5000);
    }
}

static inline void check_all_ok(int n, const int *status)
{
    for (int r = 0; r < n; r++) {
        CHECK_MSG(status[r] == 0, "rank %d exited with %d", r, status[r]);
        if (status[r] != 0) {
            char *l = read_log(r);
            printf("# rank %d's log:\n# %s\n", r, l);
            free(l);
        }
    }
}

static inline loom_group *open_group(int rank, int n, double timeout)
{
    tcl t;
    mk_cluster(&t, n, rank);
    loom_group *g = NULL;
    loom_err err = {0};
    int rc = loom_group_open(&g, &t.c, timeout, &err);
    CHECK_MSG(rc == LOOM_OK, "rank %d: open: %s", rank, err.msg);
    return rc ? NULL : g;
}

/* Rank `rank` of a 2-rank cluster t (mk_cluster) opens its connection to the
 * other; NULL (the failure checked) if it cannot. */
static inline loom_net *open_peer_net(tcl *t, int rank, loom_err *err)
{
    loom_net_peer peer = {LOOM_ROLE_WORKER, 1 - rank};
    loom_net *net = NULL;
    int rc = loom_net_open(&net, &t->c, &peer, 1, err);
    CHECK_MSG(rc == 0, "open: %s", err->msg);
    return rc ? NULL : net;
}

/* ---- ranks both files run ---------------------------------------------------- */

static inline int net_msgs_rank(int rank, int n)
{
    (void)n;
    tcl t;
    mk_cluster(&t, 2, rank);
    loom_err err = {0};
    loom_net *net = open_peer_net(&t, rank, &err);
    if (!net) return 1;
    int rc = 0;
    /* Nothing of these types will come (the peer waits for ours): a short wait times out. */
    loom_buf m;
    loom_buf_init(&m);
    rc = loom_net_recv(net, 0, LOOM_MSG_USER + 50, LOOM_MSG_USER + 60, NULL, NULL, &m, 0.1, &err);
    CHECK_MSG(rc == LOOM_ETIMEOUT, "%d %s", rc, err.msg);
    size_t sizes[] = {0, 1, 1000, 3 << 20};
    uint8_t *big = malloc(3 << 20);
    for (size_t i = 0; i < (3u << 20); i++) big[i] = (uint8_t)(i * 7 + (size_t)rank);
    for (int k = 0; k < 4; k++) CHECK(loom_net_send(net, 0, LOOM_MSG_USER + 1 + (uint32_t)k, big, sizes[k], &err) == 0);
    /* Received in the order asked, whatever the arrival order. */
    for (int k = 3; k >= 0; k--) {
        int from = -1;
        uint32_t type = 0;
        rc = loom_net_recv(net, -1, LOOM_MSG_USER + 1 + (uint32_t)k, LOOM_MSG_USER + 1 + (uint32_t)k, &from, &type, &m,
                           10, &err);
        CHECK_MSG(rc == 0, "recv %d: %s", k, err.msg);
        CHECK(from == 0 && type == LOOM_MSG_USER + 1 + (uint32_t)k && m.len == sizes[k]);
        bool same = true;
        for (size_t i = 0; i < m.len && i < sizes[k]; i++) same &= m.data[i] == (uint8_t)(i * 7 + (size_t)(1 - rank));
        CHECK(same);
    }
    CHECK(loom_net_lost_peer(net, &err) == -1);
    loom_buf_fini(&m);
    free(big);
    loom_net_close(net);
    return 0;
}

static inline float val(int rank, int64_t i) { return (float)((i * 2654435761u + (uint64_t)rank * 97) % 1000) / 7.0f - 50.0f; }

static inline int all_reduce_rank(int rank, int n)
{
    loom_group *g = open_group(rank, n, 30);
    if (!g) return 1;
    CHECK(loom_group_rank(g) == rank && loom_group_size(g) == n);
    static const int64_t counts[] = {0, 1, 2, 3, 7, 100, 1000, 4097, 16385, 65539, 1 << 20};
    for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++) {
        int64_t c = counts[k];
        float *b = malloc((size_t)c * 4 + 4), *want = malloc((size_t)c * 4 + 4);
        for (int64_t i = 0; i < c; i++) {
            b[i] = val(rank, i);
            want[i] = 0;
            for (int r = 0; r < n; r++) want[i] += val(r, i);
        }
        loom_err err = {0};
        int rc = loom_group_all_reduce(g, b, c, &err);
        CHECK_MSG(rc == 0, "rank %d, %lld floats: %s", rank, (long long)c, err.msg);
        double worst = 0;
        for (int64_t i = 0; i < c; i++) {
            double d = fabs((double)b[i] - (double)want[i]);
            if (d > worst) worst = d;
        }
        CHECK_MSG(worst <= 1e-4, "%lld floats: off the serial sum by %g", (long long)c, worst);
        /* Bit-identical on every rank: compare checksums of the results. */
        uint32_t crc = loom_crc32c(b, (size_t)c * 4);
        loom_buf out[MAXR];
        for (int r = 0; r < n; r++) loom_buf_init(&out[r]);
        rc = loom_group_all_gather_bytes(g, &crc, 4, out, &err);
        CHECK_MSG(rc == 0, "gather: %s", err.msg);
        for (int r = 0; r < n && !rc; r++) {
            CHECK(out[r].len == 4);
            CHECK_MSG(out[r].len == 4 && !memcmp(out[r].data, &crc, 4), "%lld floats: rank %d's result differs",
                      (long long)c, r);
        }
        for (int r = 0; r < n; r++) loom_buf_fini(&out[r]);
        free(b), free(want);
    }
    /* Integer-valued sums are exact. */
    float e[5];
    for (int i = 0; i < 5; i++) e[i] = (float)(rank + 1) * (float)(i + 1);
    loom_err err = {0};
    CHECK_MSG(loom_group_all_reduce(g, e, 5, &err) == 0, "rank %d: %s", rank, err.msg);
    for (int i = 0; i < 5; i++) CHECK(e[i] == (float)(n * (n + 1) / 2 * (i + 1)));
    loom_group_close(g);
    return 0;
}

static inline int bcast_gather_rank(int rank, int n)
{
    loom_group *g = open_group(rank, n, 30);
    if (!g) return 1;
    loom_err err = {0};
    size_t sizes[] = {0, 1, 13, 100000, 5 << 20};
    for (int root = 0; root < n; root++)
        for (size_t k = 0; k < 5; k++) {
            uint8_t *b = malloc(sizes[k] + 1);
            for (size_t i = 0; i < sizes[k]; i++) b[i] = rank == root ? (uint8_t)(i * 13 + (size_t)root) : 0xee;
            int rc = loom_group_broadcast(g, b, sizes[k], root, &err);
            CHECK_MSG(rc == 0, "broadcast from %d: %s", root, err.msg);
            bool same = true;
            for (size_t i = 0; i < sizes[k]; i++) same &= b[i] == (uint8_t)(i * 13 + (size_t)root);
            CHECK_MSG(same, "rank %d: broadcast of %zu bytes from %d differs", rank, sizes[k], root);
            free(b);
        }
    /* Lengths differ per rank; rank 1 sends nothing. */
    loom_buf out[MAXR];
    for (int r = 0; r < n; r++) loom_buf_init(&out[r]);
    for (int round = 0; round < 3; round++) {
        size_t len = rank == 1 ? 0 : (size_t)(rank + 1) * 1000 * (size_t)(round * 300 + 1);
        uint8_t *b = malloc(len + 1);
        for (size_t i = 0; i < len; i++) b[i] = (uint8_t)(i + (size_t)rank * 31);
        int rc = loom_group_all_gather_bytes(g, b, len, out, &err);
        CHECK_MSG(rc == 0, "gather: %s", err.msg);
        for (int r = 0; r < n && !rc; r++) {
            size_t want = r == 1 ? 0 : (size_t)(r + 1) * 1000 * (size_t)(round * 300 + 1);
            CHECK_MSG(out[r].len == want, "rank %d got %zu bytes from %d, want %zu", rank, out[r].len, r, want);
            bool same = out[r].len == want;
            for (size_t i = 0; same && i < want; i++) same = out[r].data[i] == (uint8_t)(i + (size_t)r * 31);
            CHECK(same);
        }
        free(b);
    }
    for (int r = 0; r < n; r++) loom_buf_fini(&out[r]);
    /* A barrier holds everyone until the last arrives. */
    if (rank == n - 1) usleep(300000);
    double t0 = loom_now();
    CHECK(loom_group_barrier(g, &err) == 0);
    if (rank != n - 1) CHECK_MSG(loom_now() - t0 > 0.2, "rank %d left the barrier after %.3f s", rank, loom_now() - t0);
    loom_group_close(g);
    return 0;
}

#endif
