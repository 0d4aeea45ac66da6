/* status_internal.h - the training status endpoint (run.status_port): an HTTP server
 * on libevent's evhttp, on a thread of its own, serving
 *   /metrics  Prometheus' text exposition format (version 0.0.4)
 *   /healthz  200 "ok" while training, 503 with the state otherwise
 *   /status   the same figures as one JSON object
 * Private to train/ (train.c opens it).
 *
 * Threads: the train thread publishes figures with loom_status_update and
 * loom_status_stages (copies taken under a mutex, no allocation); the server
 * thread only reads those copies, never the trainer's structures, so a
 * request cannot slow or break a step beyond the mutex. evhttp parses the
 * requests, with limits on header and body sizes and a timeout; anything
 * malformed is answered (400) or dropped by evhttp without reaching the
 * handlers, which look at the method and the decoded path alone. */
#ifndef LOOM_TRAIN_STATUS_H
#define LOOM_TRAIN_STATUS_H

#include "data/data.h"

typedef struct loom_status loom_status;

typedef enum { LOOM_STATUS_STARTING, LOOM_STATUS_TRAINING, LOOM_STATUS_DONE, LOOM_STATUS_FAILED } loom_status_state;

/* The trainer's figures, published at each execution boundary. */
typedef struct loom_status_figures {
    loom_status_state state;
    int64_t step, epoch;            /* epoch: 1-based, the one in progress */
    double  loss, accuracy;         /* running means over the epoch so far (NaN before its first step) */
    double  samples_per_sec;        /* this epoch's */
    double  input_wait_fraction;    /* of this epoch's step time spent waiting for input */
    double  learning_rate;
    double  eval_loss, eval_accuracy; /* the last evaluation (NaN before one) */
    int64_t examples_total;         /* examples trained on by this process since it started */
} loom_status_figures;

/* A cluster peer, as the cluster layer sees it (filled through
 * loom_status_peers: the trainer publishes the strategy's peers, once a
 * second, in a job across processes; none in one process). */
typedef struct loom_status_peer {
    char    task[32];               /* "worker:1" */
    int     alive;                  /* 1 while its heartbeats arrive */
    double  last_seen_sec;          /* seconds since its last heartbeat */
    double  collective_wait_sec;    /* total time this process waited on it in collectives */
} loom_status_peer;

#define LOOM_STATUS_MAX_STAGES 32
#define LOOM_STATUS_MAX_PEERS  64

/* Binds bind:port and starts the server thread. A port in use, or an
 * address that is not this host's, is LOOM_EIO naming the address and what
 * to do, before training starts. where: the config location to name.
 * Close with loom_status_close. */
int  loom_status_open(loom_status **out, const char *bind, int port, const char *where, loom_err *err);
/* Stops the thread (in-flight requests are dropped) and frees. NULL is a no-op. */
void loom_status_close(loom_status *s);
/* The port bound (the configured one, or the kernel's choice for 0). */
int  loom_status_port(const loom_status *s);

void loom_status_update(loom_status *s, const loom_status_figures *f);   /* NULL s: no-op */
/* The input pipeline's per-stage figures (loom_iter_stats), copied; stage
 * names are copied too, so the iterator may go away afterwards. */
void loom_status_stages(loom_status *s, const loom_stage_stats *st, int n); /* NULL s: no-op */
/* The hook for the cluster layer: its peers' liveness and wait times. */
void loom_status_peers(loom_status *s, const loom_status_peer *p, int n);   /* NULL s: no-op */

/* The bodies the server sends, into b (for tests and the fuzzer): path is
 * the request's path; returns the HTTP status (200, 404, 503) and sets
 * *content_type. */
int  loom_status_render(loom_status *s, const char *path, loom_buf *b, const char **content_type);

#endif
