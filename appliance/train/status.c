/* status.c - the training status endpoint: evhttp on its own thread and
 * event base; the train thread publishes copies of its figures under a
 * mutex (status_internal.h). Stopping: a byte on a pipe wakes the base, whose
 * callback breaks the loop, so no libevent locking is needed.
 *
 * Floods: open connections are bounded (conns_max: the descriptor limit /
 * 32, in [4, 64]); evhttp makes each connection's bufferevent through
 * new_bev, which keeps a reference to it, so it sees which are still open,
 * and at the bound closes the oldest (evhttp_connection_free: its socket
 * closes at once) for the newcomer. accept() failing for want of
 * descriptors sheds the pending connection through a reserve descriptor;
 * its warning is logged at most once a second. */
#include "status_internal.h"

#include "cluster/cluster.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/listener.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <event2/util.h>

typedef struct stage_copy {
    char             name[64];
    loom_stage_stats s;
} stage_copy;

struct loom_status {
    pthread_mutex_t     mu;       /* guards the copies below */
    loom_status_figures fig;
    int                 n_stages;
    stage_copy          stage[LOOM_STATUS_MAX_STAGES];
    int                 n_peers;
    loom_status_peer    peer[LOOM_STATUS_MAX_PEERS];
    double              started;  /* loom_now() at open */

    struct event_base  *base;     /* the server thread's */
    struct evhttp      *http;
    struct event       *wake;
    int                 pipe[2];
    pthread_t           thread;
    bool                running;
    int                 port;
    /* floods (server thread): see the file's comment */
    struct evconnlistener *lis;   /* evhttp's */
    struct event       *relisten;
    int                 reserve_fd;
    int                 conns_max, n_conns;
    struct bufferevent **conns;   /* a reference to each connection's bufferevent, oldest first */
    loom_ratelimit      accept_rl, evict_rl;
};

static const char *const state_names[] = {"starting", "training", "done", "failed"};

static void bprintf(loom_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void bprintf(loom_buf *b, const char *fmt, ...)
{
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    loom_buf_put(b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

/* s quoted for a Prometheus label value or a JSON string (both escape \ and
 * " and newlines; other control bytes become \u00XX in JSON, ? in labels). */
static void quoted(loom_buf *b, const char *s, bool json)
{
    loom_buf_put(b, "\"", 1);
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '\\' || ch == '"') bprintf(b, "\\%c", ch);
        else if (ch == '\n') loom_buf_put(b, "\\n", 2);
        else if (ch < 0x20) json ? bprintf(b, "\\u%04x", ch) : loom_buf_put(b, "?", 1);
        else loom_buf_put(b, s, 1);
    }
    loom_buf_put(b, "\"", 1);
}

/* A Prometheus sample value: NaN as Prometheus spells it. */
static void prom(loom_buf *b, const char *name, const char *type, const char *help, double v)
{
    bprintf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
    if (isnan(v)) bprintf(b, "%s NaN\n", name);
    else bprintf(b, "%s %.17g\n", name, v);
}

static void json_num(loom_buf *b, const char *key, double v, bool comma)
{
    if (isfinite(v)) bprintf(b, "\"%s\": %.17g%s", key, v, comma ? ", " : "");
    else bprintf(b, "\"%s\": null%s", key, comma ? ", " : "");
}

/* One labelled family over the stages: value_of picks the field. */
static void stage_family(loom_buf *b, const loom_status *s, const char *name, const char *type, const char *help,
                         double (*value_of)(const loom_stage_stats *))
{
    bprintf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
    for (int i = 0; i < s->n_stages; i++) {
        bprintf(b, "%s{index=\"%d\",stage=", name, i);
        quoted(b, s->stage[i].name, false);
        bprintf(b, "} %.17g\n", value_of(&s->stage[i].s));
    }
}
static double st_elements(const loom_stage_stats *t) { return (double)t->elements; }
static double st_busy(const loom_stage_stats *t) { return t->busy_sec; }
static double st_wait(const loom_stage_stats *t) { return t->wait_sec; }
static double st_buffered(const loom_stage_stats *t) { return (double)t->buffered; }
static double st_capacity(const loom_stage_stats *t) { return (double)t->capacity; }
static double st_parallel(const loom_stage_stats *t) { return (double)t->parallel; }
static double st_bytes(const loom_stage_stats *t) { return (double)t->bytes; }

static void render_metrics(const loom_status *s, loom_buf *b)
{
    const loom_status_figures *f = &s->fig;
    prom(b, "loom_up", "gauge", "1 while this process trains, 0 before and after", f->state == LOOM_STATUS_TRAINING);
    prom(b, "loom_uptime_seconds", "gauge", "seconds since the status endpoint opened", loom_now() - s->started);
    prom(b, "loom_step", "counter", "training steps applied (updates), including those before a resume",
         (double)f->step);
    prom(b, "loom_epoch", "gauge", "the epoch in progress, 1-based", (double)f->epoch);
    prom(b, "loom_train_loss", "gauge", "mean training loss over the epoch so far", f->loss);
    prom(b, "loom_train_accuracy", "gauge", "training accuracy over the epoch so far", f->accuracy);
    prom(b, "loom_samples_per_second", "gauge", "training examples per second of step time this epoch",
         f->samples_per_sec);
    prom(b, "loom_input_wait_fraction", "gauge", "fraction of step time spent waiting for the input pipeline",
         f->input_wait_fraction);
    prom(b, "loom_learning_rate", "gauge", "the learning rate of the next update", f->learning_rate);
    prom(b, "loom_eval_loss", "gauge", "mean loss of the last evaluation", f->eval_loss);
    prom(b, "loom_eval_accuracy", "gauge", "accuracy of the last evaluation", f->eval_accuracy);
    prom(b, "loom_examples_total", "counter", "examples trained on by this process", (double)f->examples_total);
    stage_family(b, s, "loom_pipeline_stage_elements_total", "counter", "elements a stage of data.train produced",
                 st_elements);
    stage_family(b, s, "loom_pipeline_stage_busy_seconds_total", "counter",
                 "time inside a stage's next(), its inputs' included", st_busy);
    stage_family(b, s, "loom_pipeline_stage_wait_seconds_total", "counter",
                 "prefetch: time the consumer waited for a ready element", st_wait);
    stage_family(b, s, "loom_pipeline_stage_buffered", "gauge", "elements a shuffle or prefetch holds", st_buffered);
    stage_family(b, s, "loom_pipeline_stage_capacity", "gauge", "a shuffle's or prefetch's limit", st_capacity);
    stage_family(b, s, "loom_pipeline_stage_parallelism", "gauge", "calls or files a parallel stage runs at once",
                 st_parallel);
    stage_family(b, s, "loom_pipeline_stage_bytes", "gauge", "buffer memory a stage holds", st_bytes);
    bprintf(b, "# HELP loom_cluster_peer_up 1 while a cluster peer's heartbeats arrive\n"
               "# TYPE loom_cluster_peer_up gauge\n");
    for (int i = 0; i < s->n_peers; i++) {
        bprintf(b, "loom_cluster_peer_up{task=");
        quoted(b, s->peer[i].task, false);
        bprintf(b, "} %d\n", s->peer[i].alive ? 1 : 0);
    }
    bprintf(b, "# HELP loom_cluster_peer_last_seen_seconds seconds since a peer's last heartbeat\n"
               "# TYPE loom_cluster_peer_last_seen_seconds gauge\n");
    for (int i = 0; i < s->n_peers; i++) {
        bprintf(b, "loom_cluster_peer_last_seen_seconds{task=");
        quoted(b, s->peer[i].task, false);
        bprintf(b, "} %.17g\n", s->peer[i].last_seen_sec);
    }
    bprintf(b, "# HELP loom_cluster_collective_wait_seconds_total time spent waiting on a peer in collectives\n"
               "# TYPE loom_cluster_collective_wait_seconds_total counter\n");
    for (int i = 0; i < s->n_peers; i++) {
        bprintf(b, "loom_cluster_collective_wait_seconds_total{task=");
        quoted(b, s->peer[i].task, false);
        bprintf(b, "} %.17g\n", s->peer[i].collective_wait_sec);
    }
}

static void render_json(const loom_status *s, loom_buf *b)
{
    const loom_status_figures *f = &s->fig;
    bprintf(b, "{\"state\": \"%s\", ", state_names[f->state]);
    json_num(b, "uptime_seconds", loom_now() - s->started, true);
    bprintf(b, "\"step\": %lld, \"epoch\": %lld, ", (long long)f->step, (long long)f->epoch);
    json_num(b, "train_loss", f->loss, true);
    json_num(b, "train_accuracy", f->accuracy, true);
    json_num(b, "samples_per_sec", f->samples_per_sec, true);
    json_num(b, "input_wait_fraction", f->input_wait_fraction, true);
    json_num(b, "learning_rate", f->learning_rate, true);
    json_num(b, "eval_loss", f->eval_loss, true);
    json_num(b, "eval_accuracy", f->eval_accuracy, true);
    bprintf(b, "\"examples_total\": %lld, \"pipeline\": [", (long long)f->examples_total);
    for (int i = 0; i < s->n_stages; i++) {
        const loom_stage_stats *t = &s->stage[i].s;
        bprintf(b, "%s{\"stage\": ", i ? ", " : "");
        quoted(b, s->stage[i].name, true);
        bprintf(b, ", \"elements\": %lld, ", (long long)t->elements);
        json_num(b, "busy_sec", t->busy_sec, true);
        json_num(b, "wait_sec", t->wait_sec, true);
        bprintf(b, "\"buffered\": %lld, \"capacity\": %lld, \"parallel\": %lld, \"bytes\": %lld}", (long long)t->buffered,
                (long long)t->capacity, (long long)t->parallel, (long long)t->bytes);
    }
    bprintf(b, "], \"peers\": [");
    for (int i = 0; i < s->n_peers; i++) {
        bprintf(b, "%s{\"task\": ", i ? ", " : "");
        quoted(b, s->peer[i].task, true);
        bprintf(b, ", \"alive\": %s, ", s->peer[i].alive ? "true" : "false");
        json_num(b, "last_seen_sec", s->peer[i].last_seen_sec, true);
        json_num(b, "collective_wait_sec", s->peer[i].collective_wait_sec, false);
        bprintf(b, "}");
    }
    bprintf(b, "]}\n");
}

int loom_status_render(loom_status *s, const char *path, loom_buf *b, const char **content_type)
{
    int code = 200;
    *content_type = "text/plain; charset=utf-8";
    pthread_mutex_lock(&s->mu);
    if (!strcmp(path, "/metrics")) {
        *content_type = "text/plain; version=0.0.4; charset=utf-8";
        render_metrics(s, b);
    } else if (!strcmp(path, "/healthz")) {
        if (s->fig.state == LOOM_STATUS_TRAINING) {
            bprintf(b, "ok\n");
        } else {
            code = 503;
            bprintf(b, "%s\n", state_names[s->fig.state]);
        }
    } else if (!strcmp(path, "/status")) {
        *content_type = "application/json";
        render_json(s, b);
    } else if (!strcmp(path, "/")) {
        bprintf(b, "loom status endpoint: /metrics (Prometheus), /healthz, /status (JSON)\n");
    } else {
        code = 404;
        bprintf(b, "not found; try /metrics, /healthz or /status\n");
    }
    pthread_mutex_unlock(&s->mu);
    return code;
}

/* ---- the server thread ---------------------------------------------------------- */

static void on_request(struct evhttp_request *req, void *arg)
{
    loom_status *s = arg;
    const struct evhttp_uri *uri = evhttp_request_get_evhttp_uri(req);
    const char *raw = uri ? evhttp_uri_get_path(uri) : NULL;
    char *path = raw ? evhttp_uridecode(raw, 0, NULL) : NULL;
    loom_buf b;
    loom_buf_init(&b);
    const char *ctype = "text/plain; charset=utf-8";
    int code = path ? loom_status_render(s, path, &b, &ctype) : 400;
    free(path);
    if (code == 400) bprintf(&b, "bad request\n");
    struct evbuffer *out = evbuffer_new();
    if (!out || b.failed) {
        evhttp_send_error(req, 500, NULL);
    } else {
        struct evkeyvalq *h = evhttp_request_get_output_headers(req);
        if (evhttp_request_get_command(req) == EVHTTP_REQ_HEAD) {
            /* the headers GET would send, no body (evhttp 2.1 would send it: the next
             * response on a keep-alive connection would start inside it) */
            char len[32];
            snprintf(len, sizeof len, "%zu", b.len);
            evhttp_add_header(h, "Content-Length", len);
        } else
            evbuffer_add(out, b.data, b.len);
        evhttp_add_header(h, "Content-Type", ctype);
        evhttp_add_header(h, "Cache-Control", "no-store");
        evhttp_send_reply(req, code, code == 200 ? "OK" : code == 404 ? "Not Found" : code == 503 ? "Service Unavailable"
                                                                                                 : "Bad Request", out);
    }
    if (out) evbuffer_free(out);
    loom_buf_fini(&b);
}

/* ---- the connection bound ------------------------------------------------------ */

/* Drops our reference to the connections evhttp has closed (it sets a
 * closed bufferevent's callbacks to NULL). */
static void sweep(loom_status *s)
{
    int k = 0;
    for (int i = 0; i < s->n_conns; i++) {
        bufferevent_event_cb ecb = NULL;
        bufferevent_getcb(s->conns[i], NULL, NULL, &ecb, NULL);
        if (ecb) s->conns[k++] = s->conns[i];
        else bufferevent_decref(s->conns[i]);
    }
    s->n_conns = k;
}

/* evhttp's bufferevent for each new connection (evhttp_set_bevcb): at the
 * bound, the oldest open connection is closed first. */
static struct bufferevent *new_bev(struct event_base *base, void *arg)
{
    loom_status *s = arg;
    sweep(s);
    if (s->n_conns >= s->conns_max) {
        struct bufferevent *old = s->conns[0];
        bufferevent_event_cb ecb = NULL;
        void *evcon = NULL;
        bufferevent_getcb(old, NULL, NULL, &ecb, &evcon);
        if (ecb && evcon) evhttp_connection_free(evcon); /* (its callbacks give evhttp's connection) */
        bufferevent_decref(old);
        memmove(s->conns, s->conns + 1, (size_t)(s->n_conns - 1) * sizeof *s->conns);
        s->n_conns--;
        uint64_t skipped = 0;
        char more[80] = "";
        if (loom_ratelimit_pass(&s->evict_rl, &skipped)) {
            if (skipped) snprintf(more, sizeof more, " (%llu more since the last line)", (unsigned long long)skipped);
            loom_log(LOOM_LOG_WARN, "status endpoint: %d connections open, the bound (from the descriptor limit "
                     "%ld): closed the oldest for a new one%s", s->conns_max, loom_fd_limit(), more);
        }
    }
    struct bufferevent *b = bufferevent_socket_new(base, -1, 0); /* (as evhttp makes them) */
    if (b) {
        bufferevent_incref(b);
        s->conns[s->n_conns++] = b;
    }
    return b;
}

static void on_relisten(evutil_socket_t fd, short what, void *arg)
{
    (void)fd, (void)what;
    evconnlistener_enable(((loom_status *)arg)->lis);
}

/* accept() failed: for want of descriptors, shed the pending connection
 * through the reserve (else the loop wakes for it for ever); if even that
 * fails, pause the listener a little. One line a second. */
static void on_accept_error(struct evconnlistener *l, void *arg)
{
    loom_status *s = arg;
    int e = EVUTIL_SOCKET_ERROR();
    int shed = (e == EMFILE || e == ENFILE) ? loom_fd_reserve_shed(&s->reserve_fd, evconnlistener_get_fd(l)) : 0;
    uint64_t skipped = 0;
    char more[80] = "";
    if (loom_ratelimit_pass(&s->accept_rl, &skipped)) {
        if (skipped) snprintf(more, sizeof more, " (%llu more since the last line)", (unsigned long long)skipped);
        loom_log(LOOM_LOG_WARN, "status endpoint: accept() on port %d failed: %s (descriptor limit %ld)%s%s", s->port,
                 strerror(e), loom_fd_limit(), shed ? "; the connection was closed at once" : "", more);
    }
    if (!shed) {
        evconnlistener_disable(l);
        struct timeval tv = {0, 100000};
        evtimer_add(s->relisten, &tv);
    }
}

static void on_wake(evutil_socket_t fd, short what, void *arg)
{
    (void)what;
    char c;
    while (read(fd, &c, 1) > 0) {}
    event_base_loopbreak(((loom_status *)arg)->base);
}

static void *serve(void *arg)
{
    loom_status *s = arg;
    event_base_dispatch(s->base);
    return NULL;
}

static void free_server(loom_status *s)
{
    if (s->http) evhttp_free(s->http); /* (closes its connections) */
    for (int i = 0; i < s->n_conns; i++) bufferevent_decref(s->conns[i]);
    loom_free(s->conns);
    if (s->relisten) event_free(s->relisten);
    if (s->reserve_fd >= 0) close(s->reserve_fd);
    if (s->wake) event_free(s->wake);
    if (s->base) event_base_free(s->base);
    for (int i = 0; i < 2; i++)
        if (s->pipe[i] >= 0) close(s->pipe[i]);
    pthread_mutex_destroy(&s->mu);
    loom_free(s);
}

int loom_status_open(loom_status **out, const char *bind, int port, const char *where, loom_err *err)
{
    *out = NULL;
    if (!bind || !*bind) bind = "127.0.0.1";
    loom_status *s = loom_calloc(1, sizeof *s);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating the status endpoint");
    loom_net_process_init(); /* (libevent's log, rate-limited) */
    pthread_mutex_init(&s->mu, NULL);
    s->pipe[0] = s->pipe[1] = -1;
    s->reserve_fd = -1;
    s->accept_rl = s->evict_rl = (loom_ratelimit){.interval = 1, .burst = 1};
    s->conns_max = loom_fd_bound(32, 4, 64);
    s->conns = loom_calloc((size_t)s->conns_max, sizeof *s->conns);
    s->started = loom_now();
    s->fig = (loom_status_figures){.state = LOOM_STATUS_STARTING, .loss = NAN, .accuracy = NAN, .eval_loss = NAN,
                                   .eval_accuracy = NAN, .learning_rate = NAN};
    if (pipe2(s->pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
        int e = errno;
        free_server(s);
        return loom_err_set(err, LOOM_EIO, where, "status endpoint: pipe() failed: %s", strerror(e));
    }
    s->base = event_base_new();
    s->http = s->base ? evhttp_new(s->base) : NULL;
    s->wake = s->base ? event_new(s->base, s->pipe[0], EV_READ | EV_PERSIST, on_wake, s) : NULL;
    s->relisten = s->base ? evtimer_new(s->base, on_relisten, s) : NULL;
    s->reserve_fd = loom_fd_reserve_open();
    if (!s->http || !s->wake || !s->relisten || !s->conns || event_add(s->wake, NULL) != 0) {
        free_server(s);
        return loom_err_set(err, LOOM_ENOMEM, where, "status endpoint: cannot set up libevent's HTTP server");
    }
    /* whatever a client sends, it costs bounded memory and time */
    evhttp_set_max_headers_size(s->http, 8192);
    evhttp_set_max_body_size(s->http, 0);
    evhttp_set_timeout(s->http, 10);
    evhttp_set_allowed_methods(s->http, EVHTTP_REQ_GET | EVHTTP_REQ_HEAD);
    evhttp_set_gencb(s->http, on_request, s);
    evhttp_set_bevcb(s->http, new_bev, s);
    struct evhttp_bound_socket *bs = evhttp_bind_socket_with_handle(s->http, bind, (ev_uint16_t)port);
    if (!bs) {
        int e = errno;
        char addr[96];
        snprintf(addr, sizeof addr, strchr(bind, ':') ? "[%s]:%d" : "%s:%d", bind, port);
        free_server(s);
        loom_err_set(err, LOOM_EIO, where, "status endpoint: bind(%s) failed: %s", addr,
                     e ? strerror(e) : "cannot listen there");
        return loom_err_hint(err, e == EADDRINUSE ? "another process listens on port %d; choose another run.status_port "
                                                    "(or --status-port), or 0 in the config to turn the endpoint off"
                                                  : "run.status_bind must be an address of this host (127.0.0.1, ::1, "
                                                    "0.0.0.0) and the port one you may use", port);
    }
    s->lis = evhttp_bound_socket_get_listener(bs);
    evconnlistener_set_error_cb(s->lis, on_accept_error);
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    s->port = port;
    if (getsockname(evhttp_bound_socket_get_fd(bs), (struct sockaddr *)&ss, &sl) == 0)
        s->port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                                 : ((struct sockaddr_in *)&ss)->sin_port);
    int rc = pthread_create(&s->thread, NULL, serve, s);
    if (rc) {
        free_server(s);
        return loom_err_set(err, LOOM_EIO, where, "status endpoint: pthread_create failed: %s", strerror(rc));
    }
    s->running = true;
    *out = s;
    return LOOM_OK;
}

void loom_status_close(loom_status *s)
{
    if (!s) return;
    if (s->running) {
        ssize_t k;
        do k = write(s->pipe[1], "x", 1);
        while (k < 0 && errno == EINTR);
        pthread_join(s->thread, NULL);
    }
    free_server(s);
}

int loom_status_port(const loom_status *s) { return s ? s->port : 0; }

void loom_status_update(loom_status *s, const loom_status_figures *f)
{
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    s->fig = *f;
    pthread_mutex_unlock(&s->mu);
}

void loom_status_stages(loom_status *s, const loom_stage_stats *st, int n)
{
    if (!s) return;
    if (n > LOOM_STATUS_MAX_STAGES) n = LOOM_STATUS_MAX_STAGES;
    pthread_mutex_lock(&s->mu);
    s->n_stages = n;
    for (int i = 0; i < n; i++) {
        s->stage[i].s = st[i];
        snprintf(s->stage[i].name, sizeof s->stage[i].name, "%s", st[i].name ? st[i].name : "?");
        s->stage[i].s.name = NULL; /* the copy's name is stage[i].name */
    }
    pthread_mutex_unlock(&s->mu);
}

void loom_status_peers(loom_status *s, const loom_status_peer *p, int n)
{
    if (!s) return;
    if (n > LOOM_STATUS_MAX_PEERS) n = LOOM_STATUS_MAX_PEERS;
    pthread_mutex_lock(&s->mu);
    s->n_peers = n;
    memcpy(s->peer, p, (size_t)n * sizeof *p);
    pthread_mutex_unlock(&s->mu);
}
