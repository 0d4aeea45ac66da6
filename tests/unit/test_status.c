/* test_status.c - the status endpoint (train/status.c) without training:
 * rendering of every path, quoting of names, the peers hook, a port in use,
 * a real GET over loopback, and the cost of a publish on the train thread. */
#include "harness.h"
#include "train/status_internal.h"

#include <arpa/inet.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

static loom_status *open_any(void)
{
    loom_err err = {0};
    loom_status *s = NULL;
    int rc = loom_status_open(&s, "127.0.0.1", 0, "test.cfg:3", &err);
    CHECK_MSG(rc == LOOM_OK, "%s", err.msg);
    return s;
}

static char *render(loom_status *s, const char *path, int *code)
{
    loom_buf b;
    loom_buf_init(&b);
    const char *ct;
    *code = loom_status_render(s, path, &b, &ct);
    loom_buf_put(&b, "", 1);
    return (char *)b.data; /* freed by the caller */
}

static void test_render(void)
{
    loom_status *s = open_any();
    if (!s) return;
    int code;
    char *t = render(s, "/healthz", &code);
    CHECK(code == 503);
    CHECK_CONTAINS(t, "starting");
    free(t);
    loom_status_figures f = {.state = LOOM_STATUS_TRAINING, .step = 42, .epoch = 2, .loss = 0.25, .accuracy = 0.5,
                             .samples_per_sec = 1000, .input_wait_fraction = 0.125, .learning_rate = 0.1,
                             .eval_loss = NAN, .eval_accuracy = NAN, .examples_total = 5376};
    loom_status_update(s, &f);
    loom_stage_stats st[2] = {{.name = "tfrecord", .elements = 10}, {.name = "map(\"q\"\\\n)", .elements = 9, .buffered = 3}};
    loom_status_stages(s, st, 2);
    t = render(s, "/healthz", &code);
    CHECK(code == 200 && !strcmp(t, "ok\n"));
    free(t);
    t = render(s, "/metrics", &code);
    CHECK(code == 200);
    CHECK_CONTAINS(t, "# TYPE loom_step counter\nloom_step 42\n");
    CHECK_CONTAINS(t, "loom_train_loss 0.25\n");
    CHECK_CONTAINS(t, "loom_eval_loss NaN\n");
    CHECK_CONTAINS(t, "loom_input_wait_fraction 0.125\n");
    CHECK_CONTAINS(t, "loom_pipeline_stage_elements_total{index=\"0\",stage=\"tfrecord\"} 10\n");
    CHECK_CONTAINS(t, "loom_pipeline_stage_buffered{index=\"1\",stage=\"map(\\\"q\\\"\\\\\\n)\"} 3\n");
    free(t);
    t = render(s, "/status", &code);
    CHECK(code == 200);
    CHECK_CONTAINS(t, "{\"state\": \"training\", ");
    CHECK_CONTAINS(t, "\"step\": 42, \"epoch\": 2, ");
    CHECK_CONTAINS(t, "\"eval_loss\": null, ");
    CHECK_CONTAINS(t, "{\"stage\": \"map(\\\"q\\\"\\\\\\n)\", \"elements\": 9, ");
    free(t);
    t = render(s, "/nope", &code);
    CHECK(code == 404);
    free(t);
    /* the cluster hook */
    loom_status_peer p[2] = {{.task = "worker:1", .alive = 1, .last_seen_sec = 0.5, .collective_wait_sec = 2},
                             {.task = "worker:2", .alive = 0, .last_seen_sec = 31}};
    loom_status_peers(s, p, 2);
    t = render(s, "/metrics", &code);
    CHECK_CONTAINS(t, "loom_cluster_peer_up{task=\"worker:1\"} 1\nloom_cluster_peer_up{task=\"worker:2\"} 0\n");
    CHECK_CONTAINS(t, "loom_cluster_collective_wait_seconds_total{task=\"worker:1\"} 2\n");
    free(t);
    t = render(s, "/status", &code);
    CHECK_CONTAINS(t, "\"peers\": [{\"task\": \"worker:1\", \"alive\": true, ");
    free(t);
    loom_status_close(s);
}

static void test_http_and_port_in_use(void)
{
    loom_status *s = open_any();
    if (!s) return;
    int port = loom_status_port(s);
    CHECK(port > 0);
    loom_err err = {0};
    loom_status *t = NULL;
    CHECK(loom_status_open(&t, "127.0.0.1", port, "test.cfg:3", &err) == LOOM_EIO && !t);
    CHECK_CONTAINS(err.where, "test.cfg:3");
    CHECK_CONTAINS(err.msg, "status endpoint: bind(127.0.0.1:");
    CHECK_CONTAINS(err.msg, "Address already in use");
    CHECK_CONTAINS(err.hint, "choose another run.status_port");
    /* a real request */
    loom_status_update(s, &(loom_status_figures){.state = LOOM_STATUS_TRAINING, .step = 9});
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    CHECK(connect(fd, (struct sockaddr *)&a, sizeof a) == 0);
    const char *req = "GET /metrics HTTP/1.0\r\n\r\n";
    CHECK(write(fd, req, strlen(req)) == (ssize_t)strlen(req));
    char buf[16384];
    size_t len = 0;
    struct pollfd p = {.fd = fd, .events = POLLIN};
    while (len < sizeof buf - 1 && poll(&p, 1, 5000) > 0) {
        ssize_t k = read(fd, buf + len, sizeof buf - 1 - len);
        if (k <= 0) break;
        len += (size_t)k;
    }
    buf[len] = 0;
    close(fd);
    CHECK_CONTAINS(buf, " 200 OK\r\n");
    CHECK_CONTAINS(buf, "Content-Type: text/plain; version=0.0.4");
    CHECK_CONTAINS(buf, "\nloom_step 9\n");
    loom_status_close(s);
    /* the address is free again */
    CHECK(loom_status_open(&t, "127.0.0.1", port, "x", &err) == LOOM_OK);
    loom_status_close(t);
    /* not this host's address */
    CHECK(loom_status_open(&t, "192.0.2.1", port, "x", &err) == LOOM_EIO);
    CHECK_CONTAINS(err.hint, "must be an address of this host");
}

/* The train thread's cost: one publish per step. The MLP's step takes about
 * 2 ms (60k samples/s at batch 128): 1% of it is 20 us. */
static void test_publish_cost(void)
{
    loom_status *s = open_any();
    if (!s) return;
    loom_status_figures f = {.state = LOOM_STATUS_TRAINING};
    const int N = 200000;
    double t0 = loom_now();
    for (int i = 0; i < N; i++) {
        f.step = i;
        loom_status_update(s, &f);
    }
    double per = (loom_now() - t0) / N;
    printf("# loom_status_update: %.0f ns per call\n", per * 1e9);
    CHECK_MSG(per < 2e-6, "%.3g s per update", per);
    loom_status_close(s);
}

static const loom_test tests[] = {
    {"render: /metrics, /healthz, /status, 404, quoting, peers", test_render},
    {"a real GET over loopback; a port in use; a foreign address", test_http_and_port_in_use},
    {"a publish costs well under 1% of a step", test_publish_cost},
    {0},
};

int main(void) { return loom_test_run(tests); }
