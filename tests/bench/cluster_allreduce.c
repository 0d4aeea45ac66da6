/* cluster_allreduce.c - all-reduce between processes over loopback through
 * loom_group (appliance/cluster/group.c), for tests/bench/cluster_bench.sh.
 *
 *   cluster_allreduce --ranks N --sizes B1,B2,... [--reps R] [--tls DIR]
 *       forks N ranks on 127.0.0.1 (free ports); for each size in bytes,
 *       R timed all-reduces (each after a barrier, timed on rank 0) after a
 *       warm-up; prints "SIZE_BYTES MEDIAN_SECONDS" per size.
 *   cluster_allreduce --hosts A1,A2,... --rank R --port P --sizes ... [--reps R] [--wire bf16|fp16]
 *       one rank of a job across hosts (tests/bench/netns_allreduce_bench.sh
 *       starts one per emulated host): rank i listens on Ai:P; with --wire,
 *       loom_group_all_reduce_wire (strategy.compression's all-reduce).
 *   cluster_allreduce --stream BYTES [--reps R]
 *       the loopback TCP bound: one process streams BYTES to another through
 *       one connection R times; prints "stream MEDIAN_BYTES_PER_SECOND". */
#include "cluster/cluster.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAXR 8

static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t l = sizeof a;
    if (bind(fd, (struct sockaddr *)&a, sizeof a) < 0 || getsockname(fd, (struct sockaddr *)&a, &l) < 0) return 0;
    close(fd);
    return ntohs(a.sin_port);
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* --tls DIR: cluster.tls with DIR/task.pem, task.key, ca.pem (tests/fixtures/tls): the ring's data
 * connections carry TLS (LOOM_RING_TLS=0: the control connections only). */
static const char *tls_dir;
/* --hosts: rank i's address (else 127.0.0.1); --wire: the format on the wire */
static char *hosts[MAXR];
static loom_wire_fmt wire = LOOM_WIRE_F32;

static int run_rank(int rank, int n, const int *ports, const long *sizes, int ns, int reps)
{
    loom_task_addr addrs[MAXR];
    loom_cluster c;
    memset(&c, 0, sizeof c);
    for (int i = 0; i < n; i++) {
        addrs[i].role = LOOM_ROLE_WORKER, addrs[i].index = i, addrs[i].port = ports[i];
        snprintf(addrs[i].host, sizeof addrs[i].host, "%s", hosts[i] ? hosts[i] : "127.0.0.1");
    }
    c.n_tasks[LOOM_ROLE_WORKER] = n;
    c.tasks[LOOM_ROLE_WORKER] = addrs;
    c.role = LOOM_ROLE_WORKER, c.index = rank, c.n_train_ranks = n, c.rank = rank;
    c.connect_timeout = 20, c.heartbeat_timeout = 30, c.heartbeat_interval = 1;
    memcpy(c.secret, "bench-secret", 12);
    c.secret_len = 12;
    c.config_text = (char *)"bench";
    if (tls_dir) {
        c.tls = true;
        snprintf(c.tls_cert, sizeof c.tls_cert, "%s/task.pem", tls_dir);
        snprintf(c.tls_key, sizeof c.tls_key, "%s/task.key", tls_dir);
        snprintf(c.tls_ca, sizeof c.tls_ca, "%s/ca.pem", tls_dir);
    }
    loom_group *g;
    loom_err err = {0};
    if (loom_group_open(&g, &c, 0, &err)) {
        fprintf(stderr, "rank %d: %s\n", rank, err.msg);
        return 1;
    }
    long maxb = 0;
    for (int i = 0; i < ns; i++) maxb = sizes[i] > maxb ? sizes[i] : maxb;
    float *buf = loom_alloc_aligned((size_t)maxb + 64);
    double *t = malloc(sizeof *t * (size_t)reps);
    for (int s = 0; s < ns; s++) {
        int64_t count = sizes[s] / 4;
        for (int64_t i = 0; i < count; i++) buf[i] = (float)(i % 7);
        int warm = sizes[s] >= (16 << 20) ? 1 : 3;
        for (int w = 0; w < warm; w++)
            if (loom_group_all_reduce_wire(g, buf, count, wire, &err)) goto fail;
        for (int r = 0; r < reps; r++) {
            if (loom_group_barrier(g, &err)) goto fail;
            double t0 = loom_now();
            if (loom_group_all_reduce_wire(g, buf, count, wire, &err)) goto fail;
            t[r] = loom_now() - t0;
        }
        qsort(t, (size_t)reps, sizeof *t, cmp);
        if (rank == 0) {
            printf("%ld %.9f\n", sizes[s], t[reps / 2]);
            fflush(stdout);
        }
    }
    loom_group_close(g);
    return 0;
fail:
    fprintf(stderr, "rank %d: %s\n", rank, err.msg);
    loom_group_close(g);
    return 1;
}

static int stream(long bytes, int reps)
{
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t l = sizeof a;
    if (bind(lfd, (struct sockaddr *)&a, sizeof a) || listen(lfd, 1) || getsockname(lfd, (struct sockaddr *)&a, &l))
        return 1;
    char *buf = malloc(1 << 20);
    memset(buf, 1, 1 << 20);
    pid_t pid = fork();
    if (pid == 0) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(fd, (struct sockaddr *)&a, sizeof a)) _exit(1);
        for (int r = 0; r < reps; r++) {
            char go;
            if (read(fd, &go, 1) != 1) _exit(1);
            for (long left = bytes; left > 0;) {
                ssize_t w = write(fd, buf, left < (1 << 20) ? (size_t)left : (1 << 20));
                if (w <= 0) _exit(1);
                left -= w;
            }
        }
        _exit(0);
    }
    int fd = accept(lfd, NULL, NULL);
    double *t = malloc(sizeof *t * (size_t)reps);
    for (int r = 0; r < reps; r++) {
        double t0 = loom_now();
        if (write(fd, "g", 1) != 1) return 1;
        for (long left = bytes; left > 0;) {
            ssize_t n = read(fd, buf, 1 << 20);
            if (n <= 0) return 1;
            left -= n;
        }
        t[r] = loom_now() - t0;
    }
    waitpid(pid, NULL, 0);
    qsort(t, (size_t)reps, sizeof *t, cmp);
    printf("stream %.0f\n", (double)bytes / t[reps / 2]);
    return 0;
}

int main(int argc, char **argv)
{
    int n = 2, reps = 5, ns = 0, one_rank = -1, port = 0, nh = 0;
    long sizes[64], stream_bytes = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--ranks") && i + 1 < argc) n = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--stream") && i + 1 < argc) stream_bytes = atol(argv[++i]);
        else if (!strcmp(argv[i], "--tls") && i + 1 < argc) tls_dir = argv[++i];
        else if (!strcmp(argv[i], "--rank") && i + 1 < argc) one_rank = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--port") && i + 1 < argc) port = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--wire") && i + 1 < argc) {
            i++;
            wire = !strcmp(argv[i], "bf16") ? LOOM_WIRE_BF16 : !strcmp(argv[i], "fp16") ? LOOM_WIRE_FP16 : LOOM_WIRE_F32;
        } else if (!strcmp(argv[i], "--hosts") && i + 1 < argc) {
            for (char *p = strtok(argv[++i], ","); p && nh < MAXR; p = strtok(NULL, ",")) hosts[nh++] = p;
        }
        else if (!strcmp(argv[i], "--sizes") && i + 1 < argc) {
            for (char *p = strtok(argv[++i], ","); p && ns < 64; p = strtok(NULL, ",")) sizes[ns++] = atol(p);
        } else {
            fprintf(stderr, "usage: cluster_allreduce --ranks N --sizes B1,B2,... [--reps R] [--tls DIR] [--wire bf16|fp16]\n"
                            "       | --hosts A1,A2,... --rank R --port P --sizes ... | --stream BYTES\n");
            return 2;
        }
    }
    if (reps < 1) reps = 1;
    loom_log_set_level(LOOM_LOG_ERROR);
    signal(SIGPIPE, SIG_IGN);
    if (stream_bytes) return stream(stream_bytes, reps);
    if (n < 1 || n > MAXR || ns == 0) return 2;
    int ports[MAXR];
    if (nh > 0) { /* one rank of a job across hosts */
        if (one_rank < 0 || one_rank >= nh || port <= 0) return 2;
        for (int i = 0; i < nh; i++) ports[i] = port;
        alarm(600);
        return run_rank(one_rank, nh, ports, sizes, ns, reps);
    }
    for (int i = 0; i < n; i++) ports[i] = free_port();
    fflush(stdout);
    pid_t pid[MAXR];
    for (int r = 0; r < n; r++) {
        pid[r] = fork();
        if (pid[r] == 0) {
            alarm(600);
            _exit(run_rank(r, n, ports, sizes, ns, reps));
        }
    }
    int bad = 0;
    for (int r = 0; r < n; r++) {
        int st;
        waitpid(pid[r], &st, 0);
        if (!WIFEXITED(st) || WEXITSTATUS(st)) bad = 1;
    }
    return bad;
}
