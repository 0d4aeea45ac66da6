/* fuzz_status.c - libFuzzer target for the status endpoint (train/status.c):
 * the input is sent as raw bytes to the real server (evhttp on its own
 * thread, bound to 127.0.0.1 on a port the kernel picks), the connection
 * half-closed and whatever comes back read for at most 50 ms. The input's
 * first line (up to 63 bytes) is also published as a pipeline stage name and
 * a cluster peer's task, then /metrics and /status are rendered directly.
 * Built and run by tests/fuzz/run.sh.
 * Invariants: no crash or leak in either thread (ASan); after every input a
 * well-formed GET /healthz is still answered with an HTTP/1.1 status line;
 * in the /metrics body every line is a comment or starts with "loom_" (a
 * name cannot break out of its quoted label), and /status has no raw control
 * byte (every one is escaped in its JSON strings). */
#include "train/status_internal.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define CHECK(c) do { if (!(c)) __builtin_trap(); } while (0)

static loom_status *server;

/* A connection to the server. Its close resets it (SO_LINGER 0), leaving no
 * TIME_WAIT behind: a fast machine runs ~5,000 inputs a second, two
 * connections each, and 60 s of TIME_WAIT would use up the 28,000 local
 * ports (connect fails EADDRNOTAVAIL, which is the harness's limit, not the
 * server's: that one is still waited out, up to 2 s). The server's side of
 * a closed connection does wait in TIME_WAIT, and a new connection from a
 * reused port can meet it: the SYN is answered by an ACK and retried a
 * second later, long enough for libFuzzer's timer signal to interrupt the
 * connect (EINTR): then it is tried again on a new socket. */
static int dial(void)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)loom_status_port(server))};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    for (int t = 0;; t++) {
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        CHECK(fd >= 0);
        struct linger l = {.l_onoff = 1, .l_linger = 0};
        CHECK(setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l) == 0);
        if (connect(fd, (struct sockaddr *)&a, sizeof a) == 0) return fd;
        if ((errno != EADDRNOTAVAIL && errno != EINTR) || t >= 200) {
            fprintf(stderr, "fuzz_status: connect to the status server: %s (try %d)\n", strerror(errno), t + 1);
            __builtin_trap();
        }
        close(fd);
        usleep(10000);
    }
}

/* Reads what the server sends within ms into buf (NUL-terminated); returns the length. */
static size_t drain(int fd, char *buf, size_t n, int ms)
{
    size_t len = 0;
    for (;;) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, ms) <= 0) break;
        char tmp[4096];
        ssize_t k = read(fd, tmp, sizeof tmp);
        if (k <= 0) break;
        size_t c = (size_t)k < n - 1 - len ? (size_t)k : n - 1 - len;
        memcpy(buf + len, tmp, c);
        len += c;
    }
    buf[len] = 0;
    return len;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!server) {
        loom_err err = {0};
        CHECK(loom_status_open(&server, "127.0.0.1", 0, "fuzz", &err) == LOOM_OK);
        loom_status_figures f = {.state = LOOM_STATUS_TRAINING, .step = 7, .epoch = 1, .loss = 0.5};
        loom_status_update(server, &f);
    }
    /* the raw request */
    int fd = dial();
    size_t off = 0;
    while (off < size) {
        ssize_t k = write(fd, data + off, size - off);
        if (k <= 0) break; /* the server may close early (a bad request) */
        off += (size_t)k;
    }
    shutdown(fd, SHUT_WR);
    char resp[8192];
    drain(fd, resp, sizeof resp, 50);
    close(fd);

    /* the server still answers */
    /* (three tries of 5 s: on a loaded machine one answer can be late;
     * a server that stopped answering fails all three) */
    const char *get = "GET /healthz HTTP/1.1\r\nHost: fuzz\r\nConnection: close\r\n\r\n";
    size_t n = 0;
    resp[0] = 0;
    for (int t = 0; t < 3 && !(n >= 12 && !memcmp(resp, "HTTP/1.1 200", 12)); t++) {
        fd = dial();
        CHECK(write(fd, get, strlen(get)) == (ssize_t)strlen(get));
        n = drain(fd, resp, sizeof resp, 5000);
        close(fd);
    }
    CHECK(n >= 12 && !memcmp(resp, "HTTP/1.1 200", 12));

    /* names from the input, through both renderings */
    char name[64];
    size_t nl = 0;
    while (nl < size && nl < sizeof name - 1 && data[nl] != 0) name[nl] = (char)data[nl], nl++;
    name[nl] = 0;
    loom_stage_stats st = {.name = name, .elements = 3};
    loom_status_stages(server, &st, 1);
    loom_status_peer peer = {.alive = 1};
    snprintf(peer.task, sizeof peer.task, "%s", name);
    loom_status_peers(server, &peer, 1);
    loom_buf b;
    loom_buf_init(&b);
    const char *ct;
    CHECK(loom_status_render(server, "/metrics", &b, &ct) == 200);
    CHECK(!b.failed && b.len > 0 && b.data[b.len - 1] == '\n');
    for (size_t i = 0; i < b.len;) {
        CHECK(b.data[i] == '#' || (b.len - i > 5 && !memcmp(b.data + i, "loom_", 5)));
        while (i < b.len && b.data[i] != '\n') i++;
        i++;
    }
    b.len = 0;
    CHECK(loom_status_render(server, "/status", &b, &ct) == 200);
    for (size_t i = 0; i + 1 < b.len; i++) CHECK(b.data[i] >= 0x20 || b.data[i] >= 0x80);
    loom_buf_fini(&b);
    return 0;
}
