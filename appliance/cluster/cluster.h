/* cluster.h - training across processes and machines: the topology (who
 * plays which task, and where each setting came from), the transport between
 * tasks (libevent; framed, checksummed, authenticated messages; heartbeats),
 * and the collectives that synchronous training runs over it.
 *
 * A cluster is a set of `loom` processes started with the same config, each
 * playing one task: chief, worker, ps or evaluator, with an index, as in
 * TensorFlow's ClusterSpec. Which task a process plays comes from, in this
 * order: `--task ROLE:I`, TF_CONFIG (as Kubeflow's TFJob sets it), Slurm
 * (SLURM_PROCID ...), Open MPI / PMIx (OMPI_COMM_WORLD_RANK, PMIX_RANK);
 * the addresses come from the config's `cluster` section, TF_CONFIG or
 * Slurm's node list. Everything is resolved and checked before any socket
 * opens.
 *
 * Module order: core, config, tensor, data, nn, script, cluster, distribute,
 * plugin, train. cluster uses only core and config.
 *
 * Threads: a loom_cluster is immutable once resolved. A loom_net runs its
 * event loop on a thread of its own; its functions may be called from any
 * one thread at a time (the train thread), except loom_net_lost_peer which
 * any thread may call. A loom_group belongs to the thread that drives it. */
#ifndef LOOM_CLUSTER_H
#define LOOM_CLUSTER_H

#include <stdbool.h>
#include <stdio.h>

#include "config/config.h"
#include "core/core.h"

/* ---- topology ------------------------------------------------------------ */

typedef enum { LOOM_ROLE_CHIEF, LOOM_ROLE_WORKER, LOOM_ROLE_PS, LOOM_ROLE_EVALUATOR, LOOM_ROLE_COUNT } loom_role;

const char *loom_role_name(loom_role r); /* "chief" */
/* "worker" -> LOOM_ROLE_WORKER; -1 for an unknown name. */
int loom_role_parse(const char *name);

#define LOOM_HOST_MAX 256

typedef struct loom_task_addr {
    loom_role role;
    int       index;
    char      host[LOOM_HOST_MAX]; /* as written: a name or a numeric address */
    int       port;
} loom_task_addr;

/* Where a resolved fact came from, for `loom check` and for errors. */
typedef enum {
    LOOM_FROM_NONE,    /* no cluster: a single process */
    LOOM_FROM_CONFIG,  /* the config's cluster section (or --set cluster.*) */
    LOOM_FROM_FLAG,    /* --task */
    LOOM_FROM_TF_CONFIG,
    LOOM_FROM_SLURM,
    LOOM_FROM_MPI,
    LOOM_FROM_LAUNCH,  /* `loom launch --local` (it sets --task and the addresses) */
} loom_cluster_from;
const char *loom_cluster_from_name(loom_cluster_from f); /* "TF_CONFIG" */

typedef struct loom_cluster {
    int               n_tasks[LOOM_ROLE_COUNT];
    loom_task_addr   *tasks[LOOM_ROLE_COUNT]; /* tasks[role][index] */
    loom_cluster_from addrs_from;             /* where the addresses came from */
    loom_role         role;                   /* this process's task */
    int               index;
    loom_cluster_from task_from;              /* where the task came from */
    /* The tasks that train in lock-step under multi_worker_mirrored, in rank
     * order: the chief (if any) is rank 0, then worker 0, 1, ... (with no
     * chief, worker 0 is rank 0 and is the chief). rank = -1 for a task that
     * is not one of them (ps, evaluator). */
    int               n_train_ranks;
    int               rank;
    /* Settings of the cluster section, defaults filled in. */
    double            connect_timeout;   /* s: keep retrying a peer this long (default 60) */
    double            heartbeat_timeout; /* s: a silent peer is lost after this (default 30) */
    double            heartbeat_interval;/* s: default heartbeat_timeout / 5 */
    uint8_t           secret[64];        /* from cluster.secret_file or LOOM_CLUSTER_SECRET */
    size_t            secret_len;        /* 0 = none: loopback only, with a warning */
    bool              tls;               /* cluster.tls */
    char              tls_cert[LOOM_PATH_MAX], tls_key[LOOM_PATH_MAX], tls_ca[LOOM_PATH_MAX];
    bool              insecure;          /* cluster.insecure: allow non-loopback without a secret */
    /* Bytes loom_net_send may hold queued for one peer (0 = LOOM_NET_SENDQ_MAX).
     * Not a config setting: tests lower it. */
    size_t            send_queue_max;
    /* Bytes of received messages the transport may hold for one peer until
     * loom_net_recv takes them (0 = LOOM_NET_RECVQ_MAX). Not a config
     * setting: tests lower it. */
    size_t            recv_queue_max;
    /* SHA-256 of the resolved config as loom_config_print prints it, with
     * the per-task keys excluded (cluster addresses are kept; --task,
     * model_dir overrides of one task are not), and that text itself, so a
     * handshake between tasks started with different configs can name the
     * first setting that differs. */
    uint8_t           config_digest[32];
    char             *config_text; /* owned */
    /* For `loom check` and messages: where exactly each fact came from,
     * e.g. "configs/x.cfg:20", "TF_CONFIG", "SLURM_STEP_NODELIST=node[01-02]";
     * "--task worker:1", "SLURM_PROCID=3"; "cluster.secret_file (/etc/loom/secret)". */
    char              addrs_detail[LOOM_PATH_MAX];
    char              task_detail[LOOM_PATH_MAX];
    char              secret_from[LOOM_PATH_MAX + 32]; /* "" when there is no secret */
    /* The training ranks a job may grow to: n_train_ranks, or under
     * strategy.elastic max(n_train_ranks, max_workers). Ranks from
     * n_train_ranks up are unlisted workers (tasks[worker][i] past
     * n_tasks[worker], host "" and port 0): they have no address until they
     * connect and say where they listen (this task's own unlisted entry
     * listens on an ephemeral port of 127.0.0.1, or of every interface when
     * the chief's address is not loopback). Appended; read it with
     * loom_cluster_train_slots, which takes a cluster built without it. */
    int               n_train_slots;
} loom_cluster;

/* ---- the roles a strategy uses ---------------------------------------------
 * Plain data: the caller fills it from the strategy's own description
 * (distribute's loom_strategy_roles; cluster sits below distribute and does
 * not know strategies), and loom_cluster_resolve checks the cluster against
 * it before anything opens. The same struct is the plugin ABI's (a plugin's
 * strategy declares its roles in its ops, version 5). */
typedef enum { LOOM_ROLE_ALLOWED, LOOM_ROLE_REFUSED, LOOM_ROLE_REQUIRED } loom_role_use;
#define LOOM_ROLES_ONE_PROCESS 1u /* runs in one process: a cluster of several tasks is ignored (use[] unread) */
#define LOOM_ROLES_REJOIN      2u /* a worker that fails is started again alone and rejoins (loom launch) */
typedef struct loom_cluster_roles {
    unsigned    flags;                  /* LOOM_ROLES_* */
    /* by loom_role: whether a cluster may declare tasks of the role (ALLOWED),
     * must not (REFUSED) or must (REQUIRED: at least one; the chief: one).
     * When neither the chief nor the worker role is REQUIRED nor REFUSED,
     * the cluster needs one of them. */
    uint8_t     use[LOOM_ROLE_COUNT];
    /* by loom_role: what the role is for, following its name in the error
     * that it is missing ("to hold the variables" for ps tasks, "(the
     * coordinator)" for one chief); NULL: nothing. */
    const char *why[LOOM_ROLE_COUNT];
    /* by loom_role: the hint of an error about the role (the chief's for a
     * missing chief or worker); NULL: none. */
    const char *hint[LOOM_ROLE_COUNT];
    /* (optional) the strategy's own settings against the cluster's shape,
     * after the roles pass: n_tasks by loom_role; cluster_from names where
     * the addresses came from, for messages. */
    int (*check)(const loom_spec *spec, const int *n_tasks, const char *cluster_from, loom_err *err);
} loom_cluster_roles;

/* Resolves the cluster from the spec's cluster section, task_flag (the
 * `--task ROLE:I` argument, or NULL) and the environment (envp: NULL = the
 * process's environ; tests pass their own). A spec with no cluster section
 * and no cluster environment is a single process: *out = NULL, LOOM_OK.
 * Errors (LOOM_ECONFIG, naming the config's file:line, the flag or the
 * variable and, for JSON, the byte offset): unknown role, index out of range,
 * duplicate address, malformed TF_CONFIG, two sources that disagree, a role
 * the strategy cannot use (roles: the strategy's description; NULL: any
 * cluster, the strategy checks when it opens), a non-loopback address
 * without a secret (unless cluster.insecure), an unreadable secret file.
 * Opens no socket. Free with loom_cluster_free. */
int  loom_cluster_resolve(loom_cluster **out, const loom_spec *spec, const loom_cluster_roles *roles,
                          const char *task_flag, char *const *envp, loom_err *err);
/* As loom_cluster_resolve, but a process whose task nothing names (no
 * --task, TF_CONFIG task, Slurm or MPI rank) is not an error: *out has
 * index = -1, rank = -1 and task_from = LOOM_FROM_NONE (`loom check` and
 * `loom evaluate` without --task: the cluster is checked and printed). */
int  loom_cluster_resolve_any(loom_cluster **out, const loom_spec *spec, const loom_cluster_roles *roles,
                              const char *task_flag, char *const *envp, loom_err *err);
void loom_cluster_free(loom_cluster *c); /* NULL is a no-op */
/* "worker:1" into buf. */
char *loom_task_name(loom_role role, int index, char *buf, size_t n);
/* n_train_slots (n_train_ranks when unset, as in a loom_cluster built by hand). */
int  loom_cluster_train_slots(const loom_cluster *c);
/* The train rank's task (rank in [0, loom_cluster_train_slots)). */
const loom_task_addr *loom_cluster_rank_task(const loom_cluster *c, int rank);
/* `loom check`: the resolved cluster, this process's task and where each came from. */
void loom_cluster_print(const loom_cluster *c, FILE *f);

/* ---- transport ----------------------------------------------------------- */

/* Message types: the transport's own (below 16) and its users'. */
enum {
    LOOM_MSG_HELLO = 1,     /* handshake (challenge, response, config digest) */
    LOOM_MSG_HEARTBEAT = 2,
    LOOM_MSG_BYE = 3,       /* a task leaving on purpose (with a reason) */
    LOOM_MSG_PEER_DOWN = 4, /* (queued, empty) a tolerated peer was lost or left; from = the peer */
    LOOM_MSG_PEER_UP = 5,   /* (queued, empty) a tolerated peer connected again */
    LOOM_MSG_USER = 16,     /* first type free for users (collectives, ps RPCs) */
};

typedef struct loom_net loom_net;

/* Once per process, before any event base (loom_net_open calls it; so does
 * the status endpoint): libevent's pthread locks, its own log lines routed
 * through loom_log at most one a second (with a count of the others: a
 * flood must not flood the log), SIGPIPE ignored. Thread-safe. */
void loom_net_process_init(void);

/* Opens this task's listener on its address, then connects to every task in
 * peers (a list of (role, index)), retrying with back-off up to
 * connect_timeout; every connection proves the shared secret (HMAC-SHA256
 * challenge-response) and compares config digests; a mismatch is refused on
 * both sides naming the first differing setting. A peer that never comes
 * is LOOM_ETIMEOUT naming it. Starts heartbeats. */
typedef struct loom_net_peer { loom_role role; int index; } loom_net_peer;
int  loom_net_open(loom_net **out, const loom_cluster *c, const loom_net_peer *peers, int n_peers, loom_err *err);
void loom_net_close(loom_net *n); /* says BYE to every peer; NULL is a no-op */
/* Sends one message (copied; returns once queued) to peer p (an index into
 * the peers given to loom_net_open). The queue to one peer is bounded
 * (LOOM_NET_SENDQ_MAX bytes, or loom_cluster.send_queue_max): a send that
 * would pass the bound waits until the peer has read enough (back-pressure;
 * a message larger than the bound waits for an empty queue). A peer that
 * reads nothing for heartbeat_timeout ends the wait with LOOM_ENET naming it
 * and the bytes it left unread (a stopped peer is also declared lost by its
 * silence), so a stalled reader never makes a sender grow without bound. */
#define LOOM_NET_SENDQ_MAX ((size_t)64 << 20)
/* The receiving side is bounded too (LOOM_NET_RECVQ_MAX bytes per peer, or
 * loom_cluster.recv_queue_max): while more than that of one peer's messages
 * wait for loom_net_recv, the transport stops reading that peer's
 * connection (its heartbeats wait too, and do not count as silence), so TCP
 * pushes back on the sender, whose own bounded queue then names this task;
 * reading resumes once loom_net_recv has taken the queue below the bound. */
#define LOOM_NET_RECVQ_MAX ((size_t)64 << 20)
int  loom_net_send(loom_net *n, int p, uint32_t type, const void *buf, size_t len, loom_err *err);
/* Waits up to timeout_s (< 0: forever, still ended by a lost peer) for the
 * next message of a type in [type_lo, type_hi] from peer p (p = -1: any
 * peer; *from gets which). The message is in *msg (reset first). A lost
 * peer ends the wait with LOOM_ENET naming it and what it last did (with
 * p >= 0, only p's loss or departure does; messages that came before it
 * are still delivered). */
int  loom_net_recv(loom_net *n, int p, uint32_t type_lo, uint32_t type_hi, int *from, uint32_t *type, loom_buf *msg,
                   double timeout_s, loom_err *err);
/* Peer p may leave and come back (a parameter-server worker, which launch
 * restarts alone): its loss ends no wait and sets no lost peer; instead a
 * LOOM_MSG_PEER_DOWN message from it is queued, and LOOM_MSG_PEER_UP when
 * it connects again (a dialed peer is dialed again with back-off, an
 * accepted one may connect again). Call after loom_net_open. */
void loom_net_tolerate(loom_net *n, int p);
/* Declares the user message types (LOOM_MSG_USER .. LOOM_MSG_USER + 63, a
 * bit each: LOOM_NET_TYPE_BIT) this task reads from peer p (-1: from every
 * peer); calls add up. Once any is declared for a peer, a message of
 * another user type from it is never queued (where nothing would ever read
 * it, it would pile up until the receive bound stops the connection): the
 * connection is dropped and the peer declared lost (a tolerated one:
 * LOOM_MSG_PEER_DOWN), with an error naming the peer and the type, so every
 * wait on it ends at once. Call after loom_net_open. */
#define LOOM_NET_TYPE_BIT(t) ((uint64_t)1 << ((t) - LOOM_MSG_USER))
void loom_net_reads(loom_net *n, int p, uint64_t types);
/* Whether a peer was declared lost (heartbeat timeout, closed connection);
 * -1 when none, else its index, with a message naming it in err. */
int  loom_net_lost_peer(loom_net *n, loom_err *err);

/* ---- collectives among the training ranks ------------------------------- */

/* The n_train_ranks tasks of a cluster, for synchronous training. Every rank
 * calls the same collectives in the same order with the same sizes; a
 * mismatch is LOOM_EUSAGE on every rank naming both, a lost rank is
 * LOOM_ENET naming it, a wait longer than collective_timeout (0 = none) is
 * LOOM_ETIMEOUT with a report of which ranks have not arrived and what each
 * last entered. All results are bit-identical on every rank. */
typedef struct loom_group loom_group;
int  loom_group_open(loom_group **out, const loom_cluster *c, double collective_timeout, loom_err *err);
void loom_group_close(loom_group *g); /* NULL is a no-op */
int  loom_group_rank(const loom_group *g);
int  loom_group_size(const loom_group *g);
/* buf (count floats) becomes the elementwise SUM over the ranks (chunked,
 * pipelined ring: reduce-scatter + all-gather). */
int  loom_group_all_reduce(loom_group *g, float *buf, int64_t count, loom_err *err);
/* The gradients' wire format (strategy.compression): float32, or 16 bits
 * (bfloat16, IEEE half) with round-to-nearest-even. */
typedef enum { LOOM_WIRE_F32, LOOM_WIRE_BF16, LOOM_WIRE_FP16 } loom_wire_fmt;
/* loom_group_all_reduce with half the bytes on the wire: every hop converts
 * the received 16-bit partial sums to float32, adds them to its own float32
 * values and sends them on rounded; each segment's owner rounds the final sum
 * once and every rank ends with the float32 of those same 16 bits (results
 * bit-identical on every rank, as with float32). LOOM_WIRE_F32 is
 * loom_group_all_reduce. Every rank must pass the same fmt (else LOOM_EUSAGE). */
int  loom_group_all_reduce_wire(loom_group *g, float *buf, int64_t count, loom_wire_fmt fmt, loom_err *err);
/* x[i] := its value rounded to fmt's 16 bits (and back to float32), in place. */
void loom_wire_round(loom_wire_fmt fmt, float *x, int64_t n);
/* Error feedback, in one pass: v = g[i] + e[i]; g[i] := v rounded as
 * loom_wire_round; e[i] := v - g[i] (the rounding error, for the next step). */
void loom_wire_feedback(loom_wire_fmt fmt, float *g, float *e, int64_t n);
/* root's len bytes are copied into every other rank's buf. */
int  loom_group_broadcast(loom_group *g, void *buf, size_t len, int root, loom_err *err);
/* Every rank's bytes (lengths may differ) gathered at every rank, in rank
 * order: out[r] for r < size, each reset first and freed by the caller. */
int  loom_group_all_gather_bytes(loom_group *g, const void *buf, size_t len, loom_buf *out, loom_err *err);
int  loom_group_barrier(loom_group *g, loom_err *err);
/* The halves of a sharded update (ZeRO-1 across the ranks). off (size + 1
 * offsets from off[0] = 0 to off[size] = count, the same on every rank) cuts
 * buf into the ranks' shards. reduce_scatter: rank r's shard [off[r],
 * off[r + 1]) of buf becomes the elementwise SUM over the ranks (the rest of
 * buf is left partly summed); all_gather: every rank's shard of buf is copied
 * into every other's. With either, small (small_n <= 16 floats; NULL, 0:
 * none) becomes its SUM over the ranks, in rank order, on every rank, in the
 * same round trips. With 2 ranks the shards hold the bits of
 * loom_group_all_reduce. */
int  loom_group_reduce_scatter(loom_group *g, float *buf, const int64_t *off, float *small, int small_n, loom_err *err);
int  loom_group_all_gather(loom_group *g, float *buf, const int64_t *off, float *small, int small_n, loom_err *err);
/* The group's transport (borrowed): for messages beside the collectives,
 * with types from LOOM_MSG_USER + 16 up (the group uses the first 16);
 * declare the ones read with loom_net_reads (the group declares its own, so
 * an undeclared type is refused). */
loom_net *loom_group_net(loom_group *g);

/* Elastic membership (multi_worker_mirrored's strategy.elastic). After
 * loom_group_elastic the group's peers may be lost without ending every
 * wait (loom_net_tolerate): a collective that needs a lost member fails
 * with LOOM_ENET naming it, and the members left re-form the ring with
 * loom_group_reform (every member calls it with the same list: the
 * cluster's training ranks of the members, ascending; this task among
 * them). The ranks are renumbered 0 .. n-1 in that order; collectives
 * start over (an abort of an earlier membership is ignored). */
void loom_group_elastic(loom_group *g);
/* loom_group_open without the ring (an elastic job's members form it with
 * loom_group_reform once the chief has admitted them): collectives wait for it.
 * reads: the caller's user types (LOOM_NET_TYPE_BIT), declared with the
 * group's own before open returns: a peer quicker to start may send them at
 * once (a declaration after open would race it: the type dropped as unread). */
int  loom_group_open_bare(loom_group **out, const loom_cluster *c, double collective_timeout, uint64_t reads,
                          loom_err *err);
/* loom_group_open_bare for an elastic job that may start below its listed
 * size: returns once every training task is connected, or after
 * start_timeout s with those connected (a worker: the chief among them);
 * the others are dialed and accepted whenever they come (its peers are
 * tolerated from the start: loom_group_elastic). */
int  loom_group_open_elastic(loom_group **out, const loom_cluster *c, double collective_timeout, uint64_t reads,
                             double start_timeout, loom_err *err);
/* The membership changes the group counts (loom_group_reform adds one): a
 * task admitted into a running job takes the members' count before it re-forms. */
void     loom_group_set_epoch(loom_group *g, uint32_t epoch);
uint32_t loom_group_epoch(const loom_group *g);
int  loom_group_reform(loom_group *g, const int *members, int n, loom_err *err);
/* The cluster's training rank of member r (-1 when r is out of range). */
int  loom_group_member(const loom_group *g, int r);
/* Whether the training task of that cluster rank is connected now (this task: true). */
bool loom_group_task_up(loom_group *g, int task_rank);
/* strategy.elastic's unlisted workers (cluster ranks from n_train_ranks up:
 * no address in the cluster). The port this task's transport listens on
 * (an unlisted task's is ephemeral; it tells the chief in its request to
 * join); the IP the connection of the task of cluster rank task_rank comes
 * from (into buf; -1: not connected); and learning where that task listens
 * (host, port): recorded for the ring's data connection and, when this
 * task is the one that dials it, dialed. A listed task's address is kept. */
int  loom_group_listen_port(loom_group *g);
int  loom_group_task_ip(loom_group *g, int task_rank, char *buf, size_t len);
int  loom_group_learn(loom_group *g, int task_rank, const char *host, int port, loom_err *err);

/* ---- what this task knows of its peers (the status endpoint) ------------ */

/* One peer as this task sees it. */
typedef struct loom_peer_info {
    char   task[32];            /* "worker:1" */
    int    alive;               /* 1 while connected and its heartbeats arrive */
    double last_seen_sec;       /* seconds since its last frame (heartbeat or message); -1: never */
    double collective_wait_sec; /* total time this task's collectives blocked on it */
} loom_peer_info;
/* The transport's peers (up to max, in the order given to loom_net_open);
 * returns how many were written. collective_wait_sec is 0. Any thread. */
int  loom_net_peers(loom_net *n, loom_peer_info *out, int max);
/* The group's other ranks (an elastic group's current members), in rank order, with the time this rank waited
 * on each in collectives: a ring collective blocked on receiving counts
 * against its predecessor, blocked on sending against its successor. From
 * the thread that drives the group. */
int  loom_group_peers(loom_group *g, loom_peer_info *out, int max);

#endif
