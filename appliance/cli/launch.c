/* launch.c - `loom launch --local`: every task of a cluster as a child
 * process of this one, over loopback. Launch picks a free port per task,
 * passes each child its task and the addresses as `--task ROLE:I --set
 * cluster.ROLE=[...]` (so the config's own addresses are replaced, and every
 * other cluster setting applies as written), prefixes each line a child
 * prints with its name, forwards SIGINT and SIGTERM, stops the others when
 * one task fails and exits with that task's status, and restarts the whole
 * group up to --restarts times (training resumes from the last checkpoint);
 * once the job is done it ends every task still running (job_end).
 * strategy.elastic: a worker that dies is dropped by the job; --elastic
 * starts it again alone and it joins; --discover CMD sets the number of
 * workers running from CMD's host list (discover_tick), up to
 * strategy.elastic.max_workers: workers past --workers are unlisted (they
 * get no address in the lists; each listens on an ephemeral port and tells
 * the chief) and join the running job when discovery wants them.
 * Children die with it (PR_SET_PDEATHSIG), even when it is killed.
 * Also the hidden `loom cluster-selftest` task, a stand-in child for the
 * launch tests (tests/integration/cluster_topo.sh).
 * Threads: one; signals only set a flag the supervision loop reads. */
#include "cli.h"
#include "cluster/cluster.h"
#include "distribute/distribute.h"
#include "plugin/plugin.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

#define MAX_ARGS     256
#define MAX_TASKS    256
#define LINE_MAX_    65536

typedef struct child {
    loom_role role;
    int       index;
    char      name[32];   /* "worker:1" */
    pid_t     pid;        /* 0 once reaped */
    int       fd[2];      /* its stdout and stderr pipes; -1 at EOF */
    char     *buf[2];     /* a partial line of each */
    size_t    len[2];
    int       status;     /* exit status once reaped (128 + signal when killed) */
    bool      reaped, stopped_by_us;
    bool      resumed_at_end; /* it was stopped when the job ended; launch sent SIGCONT */
    char    **argv;       /* how it was started (this attempt's), for a respawn */
    char      threads[32]; /* "run.threads=K", its share of the cores (share_cores); "" none */
    int       respawns;   /* times it was started again alone */
    bool      discovered_out; /* --discover wanted fewer workers: launch ended it (or an unlisted one not started) */
    bool      unlisted;   /* strategy.elastic: a worker past the listed ones (up to max_workers), started by --discover */
    bool      ever;       /* (unlisted) started once */
    double    leave_kill_at;  /* --discover: when it gets SIGKILL if SIGTERM did not make it leave (0: none) */
} child;

/* A strategy whose lost workers rejoin (LOOM_ROLES_REJOIN: parameter_server):
 * a worker that fails is started again alone (it rejoins the job, which went
 * on without it), up to `limit` times; the rest of the group keeps running. */
typedef struct respawn_ctx {
    bool        on;
    bool        elastic;  /* strategy.elastic: a worker but the chief that fails is dropped, the others go on */
    bool        respawn;  /* --elastic: such a worker is started again alone (up to limit) and joins */
    const char *strategy; /* its name, for the messages */
    int         limit;
    const char *exe;
    char      **env;
    const char *discover; /* --discover CMD: the workers wanted, every discover_interval s (NULL: none) */
    double      discover_interval;
    int         max_workers; /* strategy.elastic.max_workers (0: every training task) */
} respawn_ctx;

typedef struct launch_opts {
    const char *config;
    const char *command;  /* "train" (default) or "cluster-selftest" */
    int         n[LOOM_ROLE_COUNT];
    bool        shape_given;
    int         restarts;
    double      grace;    /* s between SIGTERM and SIGKILL when stopping tasks */
    const char *sets[MAX_ARGS];
    int         n_sets;
    const char *model_dir;
    bool        fresh, quiet, verbose;
    bool        elastic;            /* --elastic */
    const char *discover;           /* --discover CMD */
    double      discover_interval;  /* --discover-interval SECONDS (default 5) */
} launch_opts;

static volatile sig_atomic_t got_signal;
static void on_signal(int sig) { got_signal = sig; }

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("[launch] ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    fflush(stderr);
}

static const char usage_text[] =
    "usage: loom launch --local CONFIG [--workers N] [--ps N] [--evaluator] [--chief] [--restarts K]\n"
    "                   [--grace SECONDS] [--set key.path=value ...] [--model-dir DIR] [--fresh]\n"
    "                   [--elastic] [--discover CMD [--discover-interval SECONDS]]\n";

static void help(void)
{
    printf("%s\n"
           "Starts every task of a cluster on this machine, over loopback, each as `loom train CONFIG\n"
           "--task ROLE:I`. The tasks are the config's cluster section, or --workers/--ps/--evaluator/\n"
           "--chief (--workers N alone: N workers of multi_worker_mirrored, worker 0 the chief). Launch\n"
           "chooses a free port per task and passes the addresses as --set cluster.ROLE=[...], which\n"
           "replace the config's; other cluster settings (--set cluster.heartbeat_timeout=5) apply as\n"
           "written. Each line a task prints is prefixed with its name, \"[worker:1] ...\".\n\n"
           "SIGINT and SIGTERM are forwarded to every task (each saves a checkpoint and stops). When a\n"
           "task fails, the others get SIGTERM (SIGKILL after --grace seconds, default 30) and launch\n"
           "exits with the failed task's status (128 + N for a task killed by signal N); with\n"
           "--restarts K the whole group is started again, up to K times, on new ports, and training\n"
           "resumes from the latest checkpoint (--fresh applies to the first start only); status 2 (a\n"
           "bad config or usage) is not restarted. Under parameter_server (which always gets its chief,\n"
           "the coordinator), a worker that fails is started again alone, up to K times, and rejoins;\n"
           "the job goes on without it meanwhile (and for good once K is spent). Once the job is done\n"
           "(its chief exited 0, or named the final checkpoint in final.json), a task still running\n"
           "(stopped, hung) gets SIGCONT, then SIGTERM after up to 5 s, then SIGKILL after --grace,\n"
           "and launch says so; it exits 0. A stopped task gets SIGCONT before any SIGTERM. Every task\n"
           "is killed if launch itself dies. Only --local exists: on several machines, use srun,\n"
           "mpirun or TF_CONFIG (docs/cluster.md).\n\n"
           "options:\n"
           "  --local               start the tasks on this machine (required)\n"
           "  --workers N           N worker tasks\n"
           "  --ps N                N parameter-server tasks\n"
           "  --evaluator           one evaluator task\n"
           "  --chief               one chief task besides the workers\n"
           "  --restarts K          restart the whole group up to K times after a failure (default 0)\n"
           "  --grace SECONDS       between SIGTERM and SIGKILL when stopping tasks (default 30)\n"
           "  --elastic             strategy.elastic: a worker that dies is started again alone (up to\n"
           "                        --restarts times each) and joins the running job\n"
           "  --discover CMD        strategy.elastic: runs CMD (sh -c) every --discover-interval seconds\n"
           "                        (default 5); its lines \"host[:slots]\" add up to the workers wanted\n"
           "                        (at most max_workers, or --workers): launch ends or starts workers\n"
           "                        to match, the last ones first; they leave (SIGTERM: at a step\n"
           "                        boundary; SIGKILL after --grace) and join the running job\n"
           "  --set key.path=value  a config override for every task (repeatable)\n"
           "  --model-dir DIR       the model directory every task shares\n"
           "  --fresh               ignore existing checkpoints (the first start only)\n"
           "  --quiet, --verbose    passed to every task\n",
           usage_text);
}

static int usage_error(const char *fmt, const char *arg)
{
    fputs("loom launch: ", stderr);
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n%s", usage_text);
    return LOOM_EXIT_USAGE;
}

static bool parse_count(const char *v, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (end == v || *end || errno || x < lo || x > hi) return false;
    *out = x;
    return true;
}

static int parse_args(int argc, char **argv, launch_opts *o)
{
    bool local = false;
    memset(o, 0, sizeof *o);
    o->command = "train";
    o->grace = 30;
    o->discover_interval = 5;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        long x;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            help();
            return -1;
        } else if (!strcmp(a, "--local")) {
            local = true;
        } else if (!strcmp(a, "--workers") || !strcmp(a, "--ps")) {
            if (!v || !parse_count(v, a[2] == 'w' ? 1 : 0, LOOM_MAX_CLUSTER_TASKS, &x))
                return usage_error("%s expects a count in [1, 64]", a);
            o->n[a[2] == 'w' ? LOOM_ROLE_WORKER : LOOM_ROLE_PS] = (int)x;
            o->shape_given = true;
            i++;
        } else if (!strcmp(a, "--evaluator") || !strcmp(a, "--chief")) {
            o->n[a[2] == 'e' ? LOOM_ROLE_EVALUATOR : LOOM_ROLE_CHIEF] = 1;
            o->shape_given = true;
        } else if (!strcmp(a, "--restarts")) {
            if (!v || !parse_count(v, 0, 1000, &x)) return usage_error("%s expects a count in [0, 1000]", a);
            o->restarts = (int)x;
            i++;
        } else if (!strcmp(a, "--grace")) {
            char *end;
            double g = v ? strtod(v, &end) : -1;
            if (!v || *end || !(g >= 0 && g <= 3600)) return usage_error("%s expects seconds in [0, 3600]", a);
            o->grace = g;
            i++;
        } else if (!strcmp(a, "--set")) {
            if (!v || !strchr(v, '=')) return usage_error("%s expects key.path=value", a);
            if (o->n_sets == MAX_ARGS / 2) return usage_error("too many %s options", a);
            o->sets[o->n_sets++] = v;
            i++;
        } else if (!strcmp(a, "--model-dir")) {
            if (!v) return usage_error("%s needs a directory", a);
            o->model_dir = v;
            i++;
        } else if (!strcmp(a, "--command")) { /* hidden: the task command, for the launch tests */
            if (!v || (strcmp(v, "train") && strcmp(v, "cluster-selftest")))
                return usage_error("%s expects train or cluster-selftest", a);
            o->command = v;
            i++;
        } else if (!strcmp(a, "--elastic")) {
            o->elastic = true;
        } else if (!strcmp(a, "--discover")) {
            if (!v || !*v) return usage_error("%s expects a command", a);
            o->discover = v;
            i++;
        } else if (!strcmp(a, "--discover-interval")) {
            char *end;
            double g = v ? strtod(v, &end) : -1;
            if (!v || *end || !(g >= 0.1 && g <= 3600)) return usage_error("%s expects seconds in [0.1, 3600]", a);
            o->discover_interval = g;
            i++;
        } else if (!strcmp(a, "--fresh")) {
            o->fresh = true;
        } else if (!strcmp(a, "--quiet") || !strcmp(a, "-q")) {
            o->quiet = true;
        } else if (!strcmp(a, "--verbose") || !strcmp(a, "-v")) {
            o->verbose = true;
        } else if (!strcmp(a, "--task")) {
            return usage_error("%s is chosen by launch for each task; drop it", a);
        } else if (a[0] == '-' && a[1]) {
            return usage_error("unknown option %s", a);
        } else if (!o->config) {
            o->config = a;
        } else {
            return usage_error("unexpected argument \"%s\"", a);
        }
    }
    if (!local)
        return usage_error("%s", "only --local is supported: on several machines start the tasks with srun, mpirun "
                           "or TF_CONFIG (docs/cluster.md)");
    if (!o->config) return usage_error("%s", "missing CONFIG");
    if (o->shape_given && o->n[LOOM_ROLE_WORKER] == 0 && o->n[LOOM_ROLE_CHIEF] == 0)
        return usage_error("%s", "--ps and --evaluator need --workers N (or --chief)");
    return 0;
}

/* A port nobody listens on now: bound to 127.0.0.1:0 and released just
 * before the tasks start (a port taken in between fails that task's listen,
 * and the group restarts or fails with its message). */
static int free_ports(int *ports, int n, loom_err *err)
{
    int fds[MAX_TASKS];
    int rc = LOOM_OK, k = 0;
    for (; k < n; k++) {
        fds[k] = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        socklen_t sl = sizeof sa;
        if (fds[k] < 0 || bind(fds[k], (struct sockaddr *)&sa, sizeof sa) ||
            getsockname(fds[k], (struct sockaddr *)&sa, &sl)) {
            rc = loom_err_set(err, LOOM_ENET, "127.0.0.1", "bind(127.0.0.1:0) for a free port failed: %s",
                              strerror(errno));
            if (fds[k] >= 0) close(fds[k]);
            break;
        }
        ports[k] = ntohs(sa.sin_port);
    }
    for (int i = 0; i < k; i++) close(fds[i]);
    return rc;
}

/* The environment of every task: launch's own, without TF_CONFIG (the
 * addresses come from launch), with LOOM_LAUNCH saying who started it,
 * LOOM_LAUNCH_ATTEMPT which start of the group this is and, when the user
 * gave none, a secret of this job's own in LOOM_CLUSTER_SECRET (so the
 * tasks authenticate each other without any setup; cluster.secret_file
 * still wins). */
static char **task_env(int attempt, const char *secret, char *mark, size_t mark_n, char *attempt_var, size_t attempt_n)
{
    int n = 0;
    for (char **e = environ; *e; e++) n++;
    char **env = loom_calloc((size_t)n + 4, sizeof *env);
    if (!env) return NULL;
    int k = 0;
    for (char **e = environ; *e; e++)
        if (strncmp(*e, "TF_CONFIG=", 10) && strncmp(*e, "LOOM_LAUNCH=", 12) && strncmp(*e, "LOOM_LAUNCH_ATTEMPT=", 20))
            env[k++] = *e;
    snprintf(mark, mark_n, "LOOM_LAUNCH=loom launch --local (pid %d)", (int)getpid());
    snprintf(attempt_var, attempt_n, "LOOM_LAUNCH_ATTEMPT=%d", attempt);
    env[k++] = mark;
    env[k++] = attempt_var;
    if (secret) env[k++] = (char *)secret;
    env[k] = NULL;
    return env;
}

/* "LOOM_CLUSTER_SECRET=<64 hex digits>" from the kernel's random source,
 * unless the environment has one; false when none could be made. */
static bool job_secret(char *out, size_t n)
{
    if (getenv("LOOM_CLUSTER_SECRET")) {
        out[0] = 0;
        return true;
    }
    uint8_t r[32];
    FILE *f = fopen("/dev/urandom", "rb");
    bool ok = f && fread(r, 1, sizeof r, f) == sizeof r;
    if (f) fclose(f);
    if (!ok) return false;
    size_t len = (size_t)snprintf(out, n, "LOOM_CLUSTER_SECRET=");
    for (int i = 0; i < 32 && len + 3 <= n; i++) len += (size_t)snprintf(out + len, n - len, "%02x", r[i]);
    return true;
}

static void set_nonblock(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

static int spawn(child *c, const char *exe, char **argv, char **env, loom_err *err)
{
    int out[2], errp[2];
    if (pipe2(out, O_CLOEXEC)) return loom_err_set(err, LOOM_EIO, c->name, "pipe failed: %s", strerror(errno));
    if (pipe2(errp, O_CLOEXEC)) {
        close(out[0]), close(out[1]);
        return loom_err_set(err, LOOM_EIO, c->name, "pipe failed: %s", strerror(errno));
    }
    pid_t parent = getpid();
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) {
        close(out[0]), close(out[1]), close(errp[0]), close(errp[1]);
        return loom_err_set(err, LOOM_EIO, c->name, "fork failed: %s", strerror(errno));
    }
    if (pid == 0) {
        /* its own process group: a terminal's Ctrl-C reaches it through launch, once */
        setpgid(0, 0);
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent) _exit(137); /* launch died before prctl */
        signal(SIGINT, SIG_DFL);
        signal(SIGTERM, SIG_DFL);
        dup2(out[1], 1);
        dup2(errp[1], 2);
        execve(exe, argv, env);
        dprintf(2, "loom launch: cannot run %s: %s\n", exe, strerror(errno));
        _exit(127);
    }
    close(out[1]);
    close(errp[1]);
    c->pid = pid;
    c->fd[0] = out[0];
    c->fd[1] = errp[0];
    set_nonblock(c->fd[0]);
    set_nonblock(c->fd[1]);
    c->len[0] = c->len[1] = 0;
    c->reaped = c->stopped_by_us = false;
    c->status = 0;
    return LOOM_OK;
}

/* Writes the complete lines of c's stream s with its prefix; at EOF also
 * the rest. */
static void flush_lines(child *c, int s, bool eof)
{
    FILE *f = s == 0 ? stdout : stderr;
    char *b = c->buf[s];
    size_t start = 0;
    for (size_t i = 0; i < c->len[s]; i++)
        if (b[i] == '\n') {
            fprintf(f, "[%s] %.*s\n", c->name, (int)(i - start), b + start);
            start = i + 1;
        }
    if (eof && start < c->len[s]) {
        fprintf(f, "[%s] %.*s\n", c->name, (int)(c->len[s] - start), b + start);
        start = c->len[s];
    }
    if (start == 0 && c->len[s] == LINE_MAX_) { /* one very long line: out it goes, cut */
        fprintf(f, "[%s] %.*s\n", c->name, (int)c->len[s], b);
        start = c->len[s];
    }
    memmove(b, b + start, c->len[s] - start);
    c->len[s] -= start;
    fflush(f);
}

static void drain(child *c, int s)
{
    for (;;) {
        ssize_t r = read(c->fd[s], c->buf[s] + c->len[s], LINE_MAX_ - c->len[s]);
        if (r > 0) {
            c->len[s] += (size_t)r;
            flush_lines(c, s, false);
            continue;
        }
        if (r < 0 && (errno == EINTR)) continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        flush_lines(c, s, true); /* EOF or error */
        close(c->fd[s]);
        c->fd[s] = -1;
        return;
    }
}

static int status_of(int ws) { return WIFEXITED(ws) ? WEXITSTATUS(ws) : WIFSIGNALED(ws) ? 128 + WTERMSIG(ws) : 1; }

/* sig to c; a stopped task (SIGSTOP, a debugger) gets SIGCONT first, so it
 * can act on SIGTERM or SIGINT rather than sit on it until SIGKILL. */
static void signal_one(child *c, int sig)
{
    if (c->pid <= 0 || c->reaped) return; /* (never kill(0): an unlisted worker not started has pid 0) */
    if (sig != SIGKILL) kill(c->pid, SIGCONT);
    kill(c->pid, sig);
}

static void signal_all(child *cs, int n, int sig, bool mark)
{
    for (int i = 0; i < n; i++)
        if (!cs[i].reaped && cs[i].pid > 0) {
            signal_one(&cs[i], sig);
            if (mark) cs[i].stopped_by_us = true;
        }
}

/* The end of the job: once the chief exited 0 (or named the final
 * checkpoint in this attempt's final.json) training is done, whatever a
 * task still running is doing: a worker stopped or hung past the
 * coordinator's heartbeat timeout, which the job went on without, would
 * otherwise keep launch waiting for ever. Each task still running gets
 * SIGCONT at once (a stopped one resumes and sees the end itself), up to
 * END_LINGER s to exit on its own, then SIGTERM, and SIGKILL after
 * --grace. */
#define END_LINGER 5.0
typedef struct job_end {
    const char *final_path; /* <model_dir>/final.json, or NULL */
    double      after_wall; /* a final.json written before this is an earlier attempt's */
    double      next_look;  /* when to look for final.json again */
    bool        done;
    double      term_at;    /* when the tasks still running get SIGTERM; 0: not yet due or done */
    char        why[96];    /* "chief:0 exited 0" */
} job_end;

typedef struct outcome {
    int  status;        /* of the job: 0, the first failed task's, or 128 + signal */
    bool failed;        /* a task failed on its own (restartable) */
    int  interrupted;   /* the signal launch forwarded, or 0 */
    char who[32];       /* the failed task */
} outcome;

/* The job's chief: the chief task, else worker 0 (multi_worker_mirrored's). */
static bool is_chief(const child *cs, int n, int i)
{
    if (cs[i].role == LOOM_ROLE_CHIEF) return true;
    for (int j = 0; j < n; j++)
        if (cs[j].role == LOOM_ROLE_CHIEF) return false;
    return cs[i].role == LOOM_ROLE_WORKER && cs[i].index == 0;
}

/* The step this attempt's final.json names, or -1 (none yet, an earlier
 * run's, or unreadable). */
static long long final_step(const job_end *je)
{
    uint8_t *d = NULL;
    size_t len;
    loom_err e = {0};
    if (!je->final_path || access(je->final_path, F_OK) || loom_read_file_max(je->final_path, &d, &len, 1 << 16, &e))
        return -1;
    const char *k = strstr((const char *)d, "\"step\":");
    const char *w = strstr((const char *)d, "\"wall_time\":");
    long long step = k ? strtoll(k + 7, NULL, 10) : -1;
    double at = w ? strtod(w + 12, NULL) : 0;
    loom_free(d);
    return at >= je->after_wall ? step : -1;
}

/* Whether process pid is stopped (SIGSTOP, a debugger): its state in
 * /proc/PID/stat, the character after the command's closing parenthesis. */
static bool is_stopped(pid_t pid)
{
    char path[48], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return false;
    size_t len = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[len] = 0;
    const char *p = strrchr(buf, ')');
    return p && p[1] == ' ' && (p[2] == 'T' || p[2] == 't');
}

/* The job is done (why): every task still running gets SIGCONT now and
 * SIGTERM after the linger (end_overdue). A stopped task is named: what it
 * does once resumed (exits on its own, or fails on a lost peer) is said
 * when it ends, and this line says why it ran again. */
static void job_done(child *cs, int n, double grace, job_end *je, const char *why)
{
    if (je->done) return;
    je->done = true;
    snprintf(je->why, sizeof je->why, "%s", why);
    je->term_at = loom_now() + (grace < END_LINGER ? grace : END_LINGER);
    for (int i = 0; i < n; i++) {
        if (cs[i].reaped || cs[i].pid <= 0) continue;
        if (is_stopped(cs[i].pid)) {
            say("%s is stopped and the job is done (%s): SIGCONT, so it can end", cs[i].name, why);
            cs[i].resumed_at_end = true;
        }
        kill(cs[i].pid, SIGCONT);
    }
}

/* The linger after the job's end is over: the tasks still running (but an
 * evaluator, which finishes with the final checkpoint) get SIGCONT and
 * SIGTERM, said. Returns when they get SIGKILL, or 0 when none is left. */
static double end_overdue(child *cs, int n, double grace, job_end *je)
{
    char names[1024];
    size_t len = 0;
    int k = 0;
    je->term_at = 0;
    names[0] = 0;
    for (int i = 0; i < n; i++)
        if (!cs[i].reaped && cs[i].role != LOOM_ROLE_EVALUATOR) {
            signal_one(&cs[i], SIGTERM);
            cs[i].stopped_by_us = true;
            if (len < sizeof names)
                len += (size_t)snprintf(names + len, sizeof names - len, "%s%s", k ? ", " : "", cs[i].name);
            k++;
        }
    if (!k) return 0;
    say("the job is done (%s) but %s %s still running: SIGCONT and SIGTERM (SIGKILL after %g s)", je->why, names,
        k == 1 ? "is" : "are", grace);
    return loom_now() + grace;
}

/* The job's end, once a supervision round: this attempt's final.json
 * looked for (twice a second), the tasks still running after the linger
 * told to stop (*kill_at: when they get SIGKILL). */
static void end_tick(child *cs, int n, double grace, job_end *je, double *kill_at)
{
    if (!je->done && je->final_path && loom_now() >= je->next_look) {
        je->next_look = loom_now() + 0.5;
        long long fs = final_step(je);
        if (fs >= 0) {
            char why[96];
            snprintf(why, sizeof why, "final.json names step %lld", fs);
            job_done(cs, n, grace, je, why);
        }
    }
    if (je->done && je->term_at && loom_now() >= je->term_at) {
        double at = end_overdue(cs, n, grace, je);
        if (at > *kill_at) *kill_at = at;
    }
}

/* A task exited 0. Once every chief and worker has, training is done: ps
 * tasks (which serve for ever) are told to stop, an evaluator finishes with
 * the final checkpoint; once only (*stopping). Returns when stragglers get
 * SIGKILL, or 0 when nothing was stopped. */
static double stop_after_training(child *cs, int n, double grace, bool *stopping)
{
    for (int j = 0; j < n; j++)
        if ((cs[j].role == LOOM_ROLE_CHIEF || cs[j].role == LOOM_ROLE_WORKER) && (!cs[j].reaped || cs[j].status != 0))
            return 0;
    if (*stopping) return 0;
    *stopping = true;
    bool stopped = false;
    for (int j = 0; j < n; j++)
        if (!cs[j].reaped && cs[j].role == LOOM_ROLE_EVALUATOR) {
            say("training is done: %s finishes with the final checkpoint", cs[j].name);
        } else if (!cs[j].reaped) {
            say("training is done: stopping %s", cs[j].name);
            signal_one(&cs[j], SIGTERM);
            cs[j].stopped_by_us = true;
            stopped = true;
        }
    return stopped ? loom_now() + grace : 0;
}

/* Runs the group until every task has exited; see the file comment. */
/* c (a worker that ended: how, what) started again alone; false: it could not be. */
static bool respawn_one(child *c, const respawn_ctx *rs, const char *how, int what, const char *verb)
{
    for (int s = 0; s < 2; s++)
        if (c->fd[s] >= 0) {
            set_nonblock(c->fd[s]);
            drain(c, s);
            if (c->fd[s] >= 0) close(c->fd[s]), c->fd[s] = -1;
        }
    if (how) {
        c->respawns++;
        say("%s %s %d: %s goes on without it; starting it again alone (%d of %d), it %s", c->name, how, what,
            rs->strategy, c->respawns, rs->limit, verb);
    }
    loom_err se = {0};
    if (spawn(c, rs->exe, c->argv, rs->env, &se) == LOOM_OK) return true;
    say("%s: %s", se.where, se.msg);
    return false;
}

/* --discover: the workers wanted, the sum of the slots of CMD's lines
 * ("host" or "host:slots"; blank lines and # comments skipped); -1 when CMD
 * failed or printed an unreadable line (said). */
static int discover_wanted(const char *cmd)
{
    FILE *p = popen(cmd, "r");
    if (!p) {
        say("--discover: cannot run \"%s\": %s; keeping the workers as they are", cmd, strerror(errno));
        return -1;
    }
    char line[512], bad[80] = "";
    int want = 0;
    while (fgets(line, sizeof line, p)) {
        line[strcspn(line, "\r\n")] = 0;
        char *s = line + strspn(line, " \t");
        if (!*s || *s == '#') continue;
        char *colon = strrchr(s, ':'), *end = NULL;
        long slots = colon ? strtol(colon + 1, &end, 10) : 1;
        if ((colon && (end == colon + 1 || *end)) || slots < 1 || slots > LOOM_MAX_CLUSTER_TASKS) {
            if (!bad[0]) snprintf(bad, sizeof bad, "%s", s);
            continue;
        }
        want += (int)slots;
    }
    int st = pclose(p);
    if (st != 0 || bad[0]) {
        say("--discover: \"%s\" %s%s%s; keeping the workers as they are", cmd, bad[0] ? "printed \"" : "failed",
            bad[0] ? bad : "", bad[0] ? "\" (expected host or host:slots)" : "");
        return -1;
    }
    return want;
}

/* --discover: ends the training tasks beyond the number wanted (the last
 * ones first; never the chief) and starts again those within it that are
 * not running: they leave and join the running job (strategy.elastic). */
static void discover_tick(child *cs, int n, const respawn_ctx *rs, double grace, int *last)
{
    int want = discover_wanted(rs->discover), k = 0, total = 0;
    if (want < 0) return;
    for (int i = 0; i < n; i++) total += cs[i].role == LOOM_ROLE_WORKER || cs[i].role == LOOM_ROLE_CHIEF;
    int most = rs->max_workers > 0 && rs->max_workers < total ? rs->max_workers : total;
    want = want < 1 ? 1 : want > most ? most : want;
    if (want != *last) say("--discover: %d worker%s wanted (of at most %d)", want, want == 1 ? "" : "s", most);
    *last = want;
    for (int pass = 0; pass < 2; pass++) /* the chief first, then the workers in order */
        for (int i = 0; i < n; i++) {
            bool chief = is_chief(cs, n, i);
            if ((pass == 0) != chief || (cs[i].role != LOOM_ROLE_WORKER && !chief)) continue;
            if (k++ < want) {
                if (!cs[i].reaped || chief || !cs[i].discovered_out) continue;
                if (cs[i].unlisted && !cs[i].ever)
                    say("--discover: starting %s, past the listed workers (strategy.elastic.max_workers = %d); it "
                        "joins the running job", cs[i].name, rs->max_workers);
                else say("--discover: starting %s again; it joins the running job", cs[i].name);
                cs[i].ever = true;
                cs[i].discovered_out = !respawn_one(&cs[i], rs, NULL, 0, NULL);
            } else if (!cs[i].reaped && !chief) {
                say("--discover: ending %s (SIGTERM, SIGKILL after %g s); it leaves the running job", cs[i].name,
                    grace);
                signal_one(&cs[i], SIGTERM); /* strategy.elastic: it leaves at its next step boundary, exit 0 */
                cs[i].stopped_by_us = cs[i].discovered_out = true;
                cs[i].leave_kill_at = loom_now() + grace;
            }
        }
}

/* strategy.elastic: worker c (not the chief) ended (wait status ws): the
 * job goes on without it; --elastic starts it again alone and it joins. */
static void elastic_lost(child *c, const respawn_ctx *rs, int ws)
{
    const char *how = WIFSIGNALED(ws) ? "was killed by signal" : "exited with status";
    int what = WIFSIGNALED(ws) ? WTERMSIG(ws) : c->status;
    /* (status 2: another config, or refused beyond max_workers: the same every time) */
    if (rs->respawn && c->status != LOOM_EXIT_USAGE && c->respawns < rs->limit &&
        respawn_one(c, rs, how, what, "joins"))
        return;
    if (rs->respawn)
        say("%s %s %d: %s goes on without it (strategy.elastic; no restarts left: --restarts %d)", c->name, how, what,
            rs->strategy, rs->limit);
    else
        say("%s %s %d: %s goes on without it (strategy.elastic)", c->name, how, what, rs->strategy);
}

/* launch got sig: every task gets it; under strategy.elastic a worker's
 * SIGTERM would make it leave the job, so the workers but the chief get
 * SIGINT (it stops the job with a checkpoint, as SIGTERM does elsewhere). */
static void forward_signal(child *cs, int n, const respawn_ctx *rs, int sig)
{
    for (int i = 0; i < n; i++)
        if (!cs[i].reaped && cs[i].pid > 0) {
            bool leaves = rs && rs->elastic && cs[i].role == LOOM_ROLE_WORKER && !is_chief(cs, n, i);
            signal_one(&cs[i], leaves && sig == SIGTERM ? SIGINT : sig);
            cs[i].stopped_by_us = true;
        }
}

/* --discover: a worker told to leave (SIGTERM) that did not within --grace gets SIGKILL. */
static void leave_overdue(child *cs, int n, double grace)
{
    for (int i = 0; i < n; i++)
        if (!cs[i].reaped && cs[i].leave_kill_at > 0 && loom_now() >= cs[i].leave_kill_at) {
            say("%s did not leave within %g s: SIGKILL", cs[i].name, grace);
            signal_one(&cs[i], SIGKILL);
            cs[i].leave_kill_at = 0;
        }
}

static void supervise(child *cs, int n, double grace, const respawn_ctx *rs, job_end *je, outcome *res)
{
    double next_discover = 0;
    int last_wanted = -1;
    memset(res, 0, sizeof *res);
    double kill_at = 0; /* when the stragglers get SIGKILL; 0 = not stopping */
    bool training_done_stop = false;
    for (;;) {
        int live = 0, open_fds = 0;
        struct pollfd pf[2 * MAX_TASKS];
        int owner[2 * MAX_TASKS], stream[2 * MAX_TASKS], np = 0;
        for (int i = 0; i < n; i++) {
            live += !cs[i].reaped;
            for (int s = 0; s < 2; s++)
                if (cs[i].fd[s] >= 0) {
                    pf[np] = (struct pollfd){.fd = cs[i].fd[s], .events = POLLIN};
                    owner[np] = i, stream[np] = s, np++, open_fds++;
                }
        }
        if (!live && !open_fds) break;
        int pr = poll(pf, (nfds_t)np, 100);
        for (int k = 0; pr > 0 && k < np; k++)
            if (pf[k].revents) drain(&cs[owner[k]], stream[k]);
        if (got_signal && !res->interrupted) {
            res->interrupted = got_signal;
            say("got %s: forwarding it to every task", got_signal == SIGINT ? "SIGINT" : "SIGTERM");
            forward_signal(cs, n, rs, got_signal);
            kill_at = loom_now() + grace;
        } else if (got_signal && got_signal != res->interrupted) { /* a second signal: no more waiting */
            kill_at = loom_now();
        }
        if (!res->interrupted && !res->failed) end_tick(cs, n, grace, je, &kill_at);
        if (rs && rs->discover && !kill_at && !je->done && !res->failed && loom_now() >= next_discover) {
            next_discover = loom_now() + rs->discover_interval;
            discover_tick(cs, n, rs, grace, &last_wanted);
        }
        leave_overdue(cs, n, grace);
        /* reap */
        for (int i = 0; i < n; i++) {
            if (cs[i].reaped) continue;
            int ws;
            pid_t p = waitpid(cs[i].pid, &ws, WNOHANG);
            if (p != cs[i].pid) continue;
            cs[i].reaped = true, cs[i].leave_kill_at = 0;
            cs[i].status = status_of(ws);
            if (cs[i].status == 0) {
                if (cs[i].discovered_out) say("%s left the running job (exit 0)", cs[i].name);
                if (cs[i].resumed_at_end) say("%s exited 0 after the job was done (%s)", cs[i].name, je->why);
                if (is_chief(cs, n, i) && !res->failed && !res->interrupted) {
                    char why[96];
                    snprintf(why, sizeof why, "%s exited 0", cs[i].name);
                    job_done(cs, n, grace, je, why);
                }
                if (!kill_at) kill_at = stop_after_training(cs, n, grace, &training_done_stop);
                continue;
            }
            if (je->done && !res->failed && !res->interrupted) { /* not a failure: the job is done */
                say("%s %s %d after the job was done (%s)", cs[i].name,
                    WIFSIGNALED(ws) ? "was ended by signal" : "exited with status",
                    WIFSIGNALED(ws) ? WTERMSIG(ws) : cs[i].status, je->why);
                continue;
            }
            if (cs[i].stopped_by_us || res->failed || res->interrupted) continue;
            if (rs && rs->elastic && cs[i].role == LOOM_ROLE_WORKER && !is_chief(cs, n, i) && !kill_at) {
                elastic_lost(&cs[i], rs, ws);
                continue;
            }
            if (rs && rs->on && cs[i].role == LOOM_ROLE_WORKER && !kill_at) {
                const char *how = WIFSIGNALED(ws) ? "was killed by signal" : "exited with status";
                int what = WIFSIGNALED(ws) ? WTERMSIG(ws) : cs[i].status;
                if (cs[i].respawns >= rs->limit) {
                    say("%s %s %d: %s goes on without it (no restarts left: --restarts %d)", cs[i].name, how, what,
                        rs->strategy, rs->limit);
                    continue;
                }
                if (respawn_one(&cs[i], rs, how, what, "rejoins")) continue;
            }
            res->failed = true;
            res->status = cs[i].status;
            snprintf(res->who, sizeof res->who, "%s", cs[i].name);
            if (WIFSIGNALED(ws))
                say("%s was killed by signal %d: stopping the other tasks", cs[i].name, WTERMSIG(ws));
            else
                say("%s exited with status %d: stopping the other tasks", cs[i].name, cs[i].status);
            signal_all(cs, n, SIGTERM, true);
            kill_at = loom_now() + grace;
        }
        if (kill_at && loom_now() >= kill_at) {
            for (int i = 0; i < n; i++)
                if (!cs[i].reaped) say("%s did not stop within %g s: SIGKILL", cs[i].name, grace);
            signal_all(cs, n, SIGKILL, true);
            kill_at = loom_now() + 3600;
        }
    }
    if (res->interrupted) res->status = 128 + res->interrupted;
}

/* The roles the strategy the spec names describes: a built-in's, else a
 * plugin's once the plugins load (a plugin that does not load is reported by
 * the tasks, which load it again); NULL: it describes none. */
static const loom_cluster_roles *strategy_roles(const loom_spec *spec)
{
    const loom_cluster_roles *roles = loom_strategy_roles(spec);
    loom_err err = {0};
    if (!roles && !loom_find_strategy(spec->strategy.name) && loom_plugins_load(spec, &err) == LOOM_OK)
        roles = loom_strategy_roles(spec);
    return roles;
}

/* The config loaded as every task will load it, and the cluster resolved
 * for the first task: every error any task would hit at startup is found
 * here, before anything starts. *rejoin: the strategy's lost workers rejoin
 * (its name into strategy); *elastic: strategy.elastic (lost workers are dropped); final_path: the job's end marker; *threads_set:
 * run.threads is given (the config or --set). */
static int validate(const launch_opts *o, const char *const *sets, int n_sets, const char *task, char **env,
                    bool *rejoin, bool *elastic, char *strategy, size_t strategy_n, char *final_path,
                    size_t final_n, bool *threads_set, int *max_workers)
{
    loom_spec *spec = NULL;
    loom_errlist *errs = loom_calloc(1, sizeof *errs);
    if (!errs) return LOOM_EXIT_RUNTIME;
    int rc = loom_config_load(&spec, o->config, sets, n_sets, errs);
    bool trainable = !rc && !loom_config_check_training(spec, errs); /* every task trains */
    loom_cli_print_errlist_(errs);
    loom_free(errs);
    if (rc) return LOOM_EXIT_USAGE;
    int status = trainable ? LOOM_EXIT_OK : LOOM_EXIT_USAGE;
    const loom_cluster_roles *roles = strategy_roles(spec);
    *rejoin = roles && (roles->flags & LOOM_ROLES_REJOIN);
    *elastic = spec->strategy.elastic.enabled; /* (parsed for multi_worker_mirrored only) */
    *max_workers = spec->strategy.elastic.max_workers;
    if (!*elastic && (o->elastic || o->discover)) {
        fprintf(stderr, "loom: %s: launch %s needs strategy.elastic (multi_worker_mirrored): without it a worker "
                        "cannot join a running job\n  hint: add strategy.elastic = { min_workers = 1; } (or --set "
                        "strategy.elastic.min_workers=1)\n", o->config, o->elastic ? "--elastic" : "--discover");
        loom_config_free(spec);
        return LOOM_EXIT_USAGE;
    }
    *threads_set = spec->run.threads > 0;
    snprintf(strategy, strategy_n, "%s", spec->strategy.name);
    snprintf(final_path, final_n, "%s/" LOOM_FINAL_MARKER, o->model_dir ? o->model_dir : spec->run.model_dir);
    if (roles && (roles->flags & LOOM_ROLES_ONE_PROCESS)) {
        char w[LOOM_PATH_MAX + 16];
        fprintf(stderr, "loom: %s: launch starts a cluster, but strategy \"%s\" runs in one process\n"
                        "  hint: use --set strategy.type=multi_worker_mirrored (or loom train for one process)\n",
                loom_loc_str(&spec->strategy.loc, w, sizeof w), spec->strategy.name);
        status = LOOM_EXIT_USAGE;
    }
    loom_cluster *c = NULL;
    loom_err err = {0};
    if (!status && (rc = loom_cluster_resolve(&c, spec, roles, task, env, &err))) {
        loom_cli_print_err_(&err);
        status = rc == LOOM_ENOMEM ? LOOM_EXIT_RUNTIME : LOOM_EXIT_USAGE;
    }
    loom_cluster_free(c);
    loom_config_free(spec);
    return status;
}

/* The job's tasks per role into o->n: the flags, else the config's cluster
 * section; a strategy that requires a chief (parameter_server's coordinator)
 * always has one, even when the flags name none. Returns the number of
 * tasks, or minus the exit status (reported). */
static int job_shape(launch_opts *o)
{
    if (o->shape_given && o->n[LOOM_ROLE_CHIEF] == 0) {
        loom_spec *spec = NULL;
        loom_errlist *errs = loom_calloc(1, sizeof *errs);
        if (!errs) return -LOOM_EXIT_RUNTIME;
        const loom_cluster_roles *roles = NULL;
        if (loom_config_load(&spec, o->config, o->sets, o->n_sets, errs) == LOOM_OK && (roles = strategy_roles(spec)) &&
            roles->use[LOOM_ROLE_CHIEF] == LOOM_ROLE_REQUIRED && !(roles->flags & LOOM_ROLES_ONE_PROCESS))
            o->n[LOOM_ROLE_CHIEF] = 1; /* (a bad config is reported below, by validate) */
        loom_config_free(spec);
        loom_free(errs);
    }
    if (!o->shape_given) {
        loom_spec *spec = NULL;
        loom_errlist *errs = loom_calloc(1, sizeof *errs);
        if (!errs) return -LOOM_EXIT_RUNTIME;
        int rc = loom_config_load(&spec, o->config, o->sets, o->n_sets, errs);
        loom_cli_print_errlist_(errs);
        loom_free(errs);
        if (rc) return -LOOM_EXIT_USAGE;
        for (int r = 0; r < LOOM_ROLE_COUNT; r++) o->n[r] = spec->cluster.n_tasks[r];
        loom_config_free(spec);
    }
    int n = 0;
    for (int r = 0; r < LOOM_ROLE_COUNT; r++) n += o->n[r];
    if (n == 0) {
        fprintf(stderr, "loom launch: %s has no cluster tasks: give --workers N (or a cluster section)\n%s", o->config,
                usage_text);
        return -LOOM_EXIT_USAGE;
    }
    if (n > MAX_TASKS) {
        fprintf(stderr, "loom launch: %d tasks: at most %d on one machine\n", n, MAX_TASKS);
        return -LOOM_EXIT_USAGE;
    }
    return n;
}

/* Each task's share of this machine's cores (the CPUs launch may run on),
 * unless run.threads is given: the tasks that compute (the workers, and a
 * chief but a parameter-server job's coordinator) split them evenly, at
 * least one each, as mirrored splits its run.threads among its replicas,
 * so N one-replica workers run mirrored(N)'s threads (and bits) and the
 * cores are not oversubscribed; a ps, the coordinator and an evaluator get
 * one. */
static void share_cores(child *cs, int n)
{
    int cores = loom_num_cores(), compute = 0;
    bool ps = false;
    for (int i = 0; i < n; i++) ps |= cs[i].role == LOOM_ROLE_PS;
    for (int i = 0; i < n; i++) compute += cs[i].role == LOOM_ROLE_WORKER || (cs[i].role == LOOM_ROLE_CHIEF && !ps);
    int share = compute && cores / compute > 1 ? cores / compute : 1;
    for (int i = 0; i < n; i++) {
        bool computes = cs[i].role == LOOM_ROLE_WORKER || (cs[i].role == LOOM_ROLE_CHIEF && !ps);
        snprintf(cs[i].threads, sizeof cs[i].threads, "run.threads=%d", computes ? share : 1);
    }
    say("%d core%s for %d task%s computing: run.threads = %d each%s (set run.threads to choose)", cores,
        cores == 1 ? "" : "s", compute, compute == 1 ? "" : "s", share, compute < n ? ", 1 for the others" : "");
}

/* The settings every task gets: the command line's --set, then one
 * cluster.<role>=[...] list per role on the ports chosen (ports[k] for the
 * k-th task in role order); returns how many. */
static int task_sets(const launch_opts *o, const int *ports, const char **sets)
{
    /* the role lists: big enough for 64 tasks of 22 bytes */
    static char lists[LOOM_ROLE_COUNT][64 * 24 + 64];
    int ns = 0, k = 0;
    for (int i = 0; i < o->n_sets; i++) sets[ns++] = o->sets[i];
    for (int r = 0; r < LOOM_ROLE_COUNT; r++) {
        size_t len = (size_t)snprintf(lists[r], sizeof lists[r], "cluster.%s=[", loom_role_name((loom_role)r));
        for (int i = 0; i < o->n[r]; i++, k++)
            len += (size_t)snprintf(lists[r] + len, sizeof lists[r] - len, "%s\"127.0.0.1:%d\"", i ? ", " : "",
                                    ports[k]);
        snprintf(lists[r] + len, sizeof lists[r] - len, "]");
        sets[ns++] = lists[r];
    }
    return ns;
}

/* Starts the n tasks of one attempt, each as
 * loom COMMAND CONFIG --task T --set ... [--model-dir D] [--fresh]; stops at
 * the first that cannot start (reported). Returns how many started. */
static int start_tasks(child *cs, int n, int n_all, const launch_opts *o, int attempt, char *exe, const char **sets,
                       int ns, char **env, const int *ports)
{
    loom_err err = {0};
        int started = 0;
    for (int i = 0; i < n_all; i++) {
        char *argv_c[MAX_ARGS + 32]; /* 2 per --set (the user's, at most MAX_ARGS / 2, and launch's 6), 10 more */
        int na = 0;
        argv_c[na++] = exe;
        argv_c[na++] = (char *)o->command;
        argv_c[na++] = (char *)o->config;
        argv_c[na++] = "--task";
        argv_c[na++] = cs[i].name;
        for (int s = 0; s < ns; s++) argv_c[na++] = "--set", argv_c[na++] = (char *)sets[s];
        if (cs[i].threads[0]) argv_c[na++] = "--set", argv_c[na++] = cs[i].threads;
        if (o->model_dir) argv_c[na++] = "--model-dir", argv_c[na++] = (char *)o->model_dir;
        if (o->fresh && attempt == 0) argv_c[na++] = "--fresh";
        if (o->quiet) argv_c[na++] = "--quiet";
        if (o->verbose) argv_c[na++] = "--verbose";
        argv_c[na] = NULL;
        loom_free(cs[i].argv);
        cs[i].argv = loom_calloc((size_t)na + 1, sizeof *cs[i].argv);
        if (cs[i].argv) memcpy(cs[i].argv, argv_c, (size_t)(na + 1) * sizeof *argv_c);
        if (i >= n) { /* an unlisted worker: --discover starts it when it wants it */
            cs[i].pid = 0, cs[i].reaped = cs[i].discovered_out = true, cs[i].ever = false, cs[i].status = 0;
            continue;
        }
        if (spawn(&cs[i], exe, argv_c, env, &err)) {
            fprintf(stderr, "loom launch: %s: %s\n", err.where, err.msg);
            break;
        }
        started++;
    }
    if (started == n) {
        char all[2048];
        size_t al = 0;
        all[0] = 0;
        for (int i = 0; i < n && al < sizeof all; i++)
            al += (size_t)snprintf(all + al, sizeof all - al, "%s%s 127.0.0.1:%d", i ? ", " : "", cs[i].name,
                                   ports[i]);
        say("started %d task%s (loom %s%s): %s", n, n == 1 ? "" : "s", o->command,
            attempt ? ", resuming from the latest checkpoint" : "", all);
    }
    return started;
}

/* strategy.elastic with --elastic or --discover: room for max_workers: the
 * unlisted workers past the listed ones, after the n tasks (NULL: out of
 * memory; cs is freed). They are not started until --discover wants them. */
static child *children_grow(child *cs, const launch_opts *o, int n, int extra)
{
    child *g = loom_realloc(cs, (size_t)(n + extra) * sizeof *cs);
    if (!g) {
        loom_free(cs);
        return NULL;
    }
    for (int j = 0; j < extra; j++) {
        child *c = &g[n + j];
        *c = (child){.role = LOOM_ROLE_WORKER, .index = o->n[LOOM_ROLE_WORKER] + j, .fd = {-1, -1}, .unlisted = true,
                     .reaped = true, .discovered_out = true};
        loom_task_name(c->role, c->index, c->name, sizeof c->name);
        c->buf[0] = loom_alloc(LINE_MAX_);
        c->buf[1] = loom_alloc(LINE_MAX_);
        if (!c->buf[0] || !c->buf[1]) return NULL; /* (the process exits at once) */
    }
    return g;
}

/* strategy.elastic, with --elastic or --discover: the tasks with room for
 * max_workers (children_grow); returns how many (-1: out of memory). */
static int children_room(child **cs, const launch_opts *o, int n, int max_workers)
{
    int train = o->n[LOOM_ROLE_CHIEF] + o->n[LOOM_ROLE_WORKER], extra = max_workers - train;
    if (!(o->elastic || o->discover) || extra <= 0) return n;
    if (n + extra > MAX_TASKS) extra = MAX_TASKS - n;
    if (!(*cs = children_grow(*cs, o, n, extra))) return -1;
    if (o->discover)
        say("strategy.elastic.max_workers = %d: room for %d unlisted worker%s past --workers %d, started when "
            "--discover wants them", max_workers, extra, extra == 1 ? "" : "s", o->n[LOOM_ROLE_WORKER]);
    return n + extra;
}

/* The n tasks of the job, in role order, not started; NULL: out of memory. */
static child *children_new(const launch_opts *o, int n)
{
    child *cs = loom_calloc((size_t)n, sizeof *cs);
    if (!cs) return NULL;
    int k = 0;
    for (int r = 0; r < LOOM_ROLE_COUNT; r++)
        for (int i = 0; i < o->n[r]; i++, k++) {
            cs[k].role = (loom_role)r;
            cs[k].index = i;
            loom_task_name((loom_role)r, i, cs[k].name, sizeof cs[k].name);
            cs[k].buf[0] = loom_alloc(LINE_MAX_);
            cs[k].buf[1] = loom_alloc(LINE_MAX_);
            cs[k].fd[0] = cs[k].fd[1] = -1;
            if (!cs[k].buf[0] || !cs[k].buf[1]) return NULL; /* (the process exits at once) */
        }
    return cs;
}

int loom_cli_launch_(int argc, char **argv, double start)
{
    (void)start;
    launch_opts o;
    int prc = parse_args(argc, argv, &o);
    if (prc) return prc < 0 ? LOOM_EXIT_OK : prc;
    if (o.quiet) loom_log_set_level(LOOM_LOG_WARN);

    int n = job_shape(&o);
    if (n < 0) return -n;

    char exe[PATH_MAX];
    ssize_t el = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (el <= 0) {
        fprintf(stderr, "loom launch: cannot find the loom binary (/proc/self/exe): %s\n", strerror(errno));
        return LOOM_EXIT_RUNTIME;
    }
    exe[el] = 0;

    child *cs = children_new(&o, n);
    if (!cs) return LOOM_EXIT_RUNTIME;

    struct sigaction sa = {0}, old_int, old_term;
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);

    int status = LOOM_EXIT_OK;
    char secret[128];
    if (!job_secret(secret, sizeof secret)) {
        fprintf(stderr, "loom launch: cannot read /dev/urandom for the job's secret: %s\n", strerror(errno));
        return LOOM_EXIT_RUNTIME;
    }
    bool rejoin = false, elastic = false, threads_set = false;
    int max_workers = 0, n_all = n; /* n_all: with the unlisted workers --discover may start (children_grow) */
    char strategy[LOOM_NAME_MAX + 64] = "", final_path[LOOM_PATH_MAX + 16] = "";
    for (int attempt = 0; attempt <= o.restarts; attempt++) {
        int ports[MAX_TASKS];
        loom_err err = {0};
        if (free_ports(ports, n, &err)) {
            fprintf(stderr, "loom launch: %s: %s\n", err.where, err.msg);
            status = LOOM_EXIT_RUNTIME;
            break;
        }
        const char *sets[MAX_ARGS];
        int ns = task_sets(&o, ports, sets);
        char mark[128], attempt_var[64];
        char **env = task_env(attempt, secret[0] ? secret : NULL, mark, sizeof mark, attempt_var, sizeof attempt_var);
        if (!env) {
            status = LOOM_EXIT_RUNTIME;
            break;
        }
        if (attempt == 0 && (status = validate(&o, sets, ns, cs[0].name, env, &rejoin, &elastic, strategy, sizeof strategy,
                                               final_path, sizeof final_path, &threads_set, &max_workers))) {
            loom_free(env);
            break;
        }
        if (attempt == 0 && elastic && (n_all = children_room(&cs, &o, n, max_workers)) < 0) {
            loom_free(env);
            return LOOM_EXIT_RUNTIME;
        }
        if (attempt == 0 && !threads_set) share_cores(cs, n_all);
        if (attempt > 0) say("restart %d of %d: starting every task again on new ports", attempt, o.restarts);
        /* (the selftest's tasks write no end marker) */
        job_end je = {.final_path = strcmp(o.command, "train") || !final_path[0] ? NULL : final_path,
                      .after_wall = loom_wall_time()};
        int started = start_tasks(cs, n, n_all, &o, attempt, exe, sets, ns, env, ports);
        outcome res;
        if (started < n) signal_all(cs, started, SIGKILL, true);
        respawn_ctx rs = {.on = rejoin, .elastic = elastic, .respawn = o.elastic, .strategy = strategy,
                          .limit = o.restarts, .exe = exe, .env = env, .discover = o.discover,
                          .discover_interval = o.discover_interval, .max_workers = max_workers};
        supervise(cs, started == n ? n_all : started, o.grace, &rs, &je, &res);
        loom_free(env);
        if (started < n) {
            status = LOOM_EXIT_RUNTIME;
            break;
        }
        status = res.status;
        if (res.interrupted) {
            say("stopped by %s; run the same command again to resume", res.interrupted == SIGINT ? "SIGINT" : "SIGTERM");
            break;
        }
        if (!res.failed) break;
        if (status == LOOM_EXIT_USAGE && attempt < o.restarts) { /* a bad config fails the same way every time */
            say("%s failed with status 2 (a bad config or usage): not restarting", res.who);
            break;
        }
        if (attempt == o.restarts) {
            if (o.restarts) say("%s failed and no restarts are left (--restarts %d): exit status %d", res.who,
                                o.restarts, status);
            else say("%s failed: exit status %d", res.who, status);
        }
    }
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);
    for (int i = 0; i < n_all; i++) loom_free(cs[i].buf[0]), loom_free(cs[i].buf[1]), loom_free(cs[i].argv);
    loom_free(cs);
    return status;
}

/* ---- loom cluster-selftest ------------------------------------------------ */

static bool rule_matches(const char *rule, size_t len, const char *name)
{
    return (len == 1 && rule[0] == '*') || (strlen(name) == len && !strncmp(rule, name, len));
}

int loom_cli_selftest_(const loom_cluster *c, const char *model_dir, bool fresh)
{
    char name[32];
    if (!c) {
        fprintf(stderr, "cluster-selftest: not in a cluster\n");
        return 2;
    }
    loom_task_name(c->role, c->index, name, sizeof name);
    const char *attempt_s = getenv("LOOM_LAUNCH_ATTEMPT");
    int attempt = attempt_s ? atoi(attempt_s) : 0;
    printf("task %s (pid %d) of %d, rank %d, addresses from %s, task from %s, attempt %d\n", name, (int)getpid(),
           c->n_tasks[0] + c->n_tasks[1] + c->n_tasks[2] + c->n_tasks[3], c->rank, loom_cluster_from_name(c->addrs_from),
           loom_cluster_from_name(c->task_from), attempt);
    printf("heartbeat_timeout %g, model_dir %s, fresh %s\n", c->heartbeat_timeout, model_dir ? model_dir : "(config)",
           fresh ? "yes" : "no");
    printf("first line\nsecond line, no newline yet...");
    fflush(stdout);
    fprintf(stderr, "a line on stderr\n");
    fflush(stderr);
    printf(" done\n");
    fflush(stdout);
    /* LOOM_SELFTEST="worker:1=exit:3:0.5;*=sleep:20": the first rule naming this task (or *) says what
     * it does; LOOM_SELFTEST_ATTEMPTS=K applies the rules to the first K starts only (then exit 0) */
    const char *rules = getenv("LOOM_SELFTEST");
    const char *lim = getenv("LOOM_SELFTEST_ATTEMPTS");
    if (!rules || (lim && attempt >= atoi(lim))) return 0;
    const char *p = rules;
    while (*p) {
        const char *end = strchr(p, ';');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        const char *eq = memchr(p, '=', len);
        if (eq && rule_matches(p, (size_t)(eq - p), name)) {
            const char *act = eq + 1;
            if (!strncmp(act, "exit:", 5)) { /* exit:N or exit:N:SECONDS (after that long) */
                const char *delay = memchr(act + 5, ':', len - (size_t)(act + 5 - p)); /* (in this rule) */
                if (delay) {
                    double secs = atof(delay + 1);
                    struct timespec ts = {(time_t)secs, (long)((secs - (double)(time_t)secs) * 1e9)};
                    while (nanosleep(&ts, &ts) && errno == EINTR) {
                    }
                }
                printf("%s: exiting with status %d as told\n", name, atoi(act + 5));
                return atoi(act + 5);
            }
            if (!strncmp(act, "sleep:", 6) || !strncmp(act, "hang:", 5)) {
                bool hang = act[0] == 'h';
                double secs = atof(act + (hang ? 5 : 6));
                struct sigaction sa = {0};
                sa.sa_handler = hang ? SIG_IGN : on_signal;
                got_signal = 0;
                sigaction(SIGINT, &sa, NULL);
                sigaction(SIGTERM, &sa, NULL);
                double t_end = loom_now() + secs;
                while (loom_now() < t_end && !got_signal) {
                    struct timespec ts = {0, 20 * 1000 * 1000};
                    nanosleep(&ts, NULL);
                }
                if (got_signal) {
                    printf("%s: got signal %d, stopping\n", name, (int)got_signal);
                    return 1;
                }
                printf("%s: slept %g s\n", name, secs);
                return 0;
            }
        }
        if (!end) break;
        p = end + 1;
    }
    return 0;
}
