/* mpi.c - the mpi plugin: the cross-device op "mpi", whose collectives run
 * across the processes of a job through MPI (Open MPI's tuned collectives
 * and transports), for sites that start their jobs with mpirun:
 * multi_worker_mirrored with strategy.communication = "mpi" all-reduces the
 * gradients with MPI_Allreduce instead of Loom's ring; everything else of
 * the job (its topology from mpirun's environment, the variables' broadcast,
 * heartbeats) stays on Loom's own transport.
 * It reduces across processes only (no entry points for the replicas of one
 * process). MPI is initialised at job_open, never at load: a loom process
 * that does not select it only maps the library.
 * MPI_Allreduce cannot time out, and a rank that is stopped or dead (mpirun
 * may not notice a SIGSTOPped one) leaves the others inside it for ever. So
 * a watchdog thread per job looks at the all-reduce in progress every 0.1 s:
 * when it has lasted strategy.collective_timeout (if set), or Loom's
 * transport has lost a task of the job (its heartbeats stopped for
 * cluster.heartbeat_timeout, or its connection closed), it logs an error
 * naming the all-reduce, the setting's file:line and what to do, and ends
 * the whole job with MPI_Abort (mpirun then stops every rank).
 * A task whose run fails anywhere else (a checkpoint it cannot write, a
 * collective of Loom's own transport that lost a rank) leaves without
 * MPI_Finalize: Open MPI's finalize waits for every rank, and the others are
 * inside MPI_Allreduce (or stopped), so it would never return; a process
 * that exits non-zero without it makes mpirun stop the whole job.
 * Threads: the train thread alone calls MPI (MPI_THREAD_SERIALIZED), except
 * the watchdog's MPI_Abort, the last call of the process.
 * For tests only: LOOM_MPI_TEST_MISMATCH=R makes the task of rank R see an
 * MPI size one larger than the job's at job_open (the refusal of a process
 * whose MPI rank or size disagrees with its task), while the others open. */
#include "loom_plugin.h"

#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <mpi.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static const loom_host *host;

typedef struct job {
    MPI_Comm comm;      /* a duplicate of MPI_COMM_WORLD, errors returned */
    int      size;
    int      finalize;  /* MPI was initialised here: finalize at close */
    /* the watchdog (see the top); fields from `entered` on under mu */
    pthread_t       wd;
    bool            wd_running;
    pthread_mutex_t mu;
    pthread_cond_t  cv;
    bool            stop;
    double          entered;   /* mono_now() when the all-reduce in progress began; 0: none */
    long long       seq;       /* all-reduces so far, the one in progress included */
    int64_t         count;
    loom_redop      op;
    double          timeout_s;
    char            timeout_where[300], task[64];
    void           *boot;
    int (*boot_lost)(void *boot, loom_err *err);
    int (*boot_failing)(void *boot);
} job;

static double mono_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static const char *op_name(loom_redop op) { return op == LOOM_REDUCE_MAX ? "max" : op == LOOM_REDUCE_MEAN ? "mean" : "sum"; }

/* Ends the job: the error, then MPI_Abort (which does not return; _exit if it does). */
static void wd_abort(job *j, const char *why, const char *hint)
{
    host->log(LOOM_LOG_ERROR, "%s", why);
    host->log(LOOM_LOG_ERROR, "  hint: %s", hint);
    host->log(LOOM_LOG_ERROR, "%s: ending the job (MPI_Abort): every rank stops", j->task);
    fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
    _exit(1);
}

static void *watchdog(void *arg)
{
    job *j = arg;
    pthread_mutex_lock(&j->mu);
    while (!j->stop) {
        struct timespec until;
        clock_gettime(CLOCK_MONOTONIC, &until);
        until.tv_nsec += 100 * 1000 * 1000;
        if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&j->cv, &j->mu, &until);
        if (j->stop || j->entered <= 0) continue;
        double waited = mono_now() - j->entered;
        char why[1400], what[160];
        snprintf(what, sizeof what, "all_reduce #%lld (%lld floats, %s) through MPI_Allreduce", j->seq,
                 (long long)j->count, op_name(j->op));
        if (j->timeout_s > 0 && waited >= j->timeout_s) {
            snprintf(why, sizeof why, "%s: %s's %s has not returned after %.1f s (strategy.collective_timeout = %g s): "
                     "a rank of the job is stopped, dead or stuck elsewhere, and MPI cannot tell", j->timeout_where,
                     j->task, what, waited, j->timeout_s);
            wd_abort(j, why, "see the other ranks' logs for the one that stopped; raise strategy.collective_timeout "
                     "if such a wait is legitimate; restart the job to resume from the last checkpoint");
        }
        loom_err e;
        memset(&e, 0, sizeof e);
        if (j->boot_lost && j->boot_lost(j->boot, &e)) {
            snprintf(why, sizeof why, "%s's %s has waited %.1f s for a task Loom's transport has lost: %s", j->task,
                     what, waited, e.msg);
            wd_abort(j, why, "the job stops: restart it (loom launch --restarts K does) to resume from the last "
                     "checkpoint; strategy.collective_timeout bounds the wait too");
        }
    }
    pthread_mutex_unlock(&j->mu);
    return NULL;
}

static void watchdog_stop(job *j)
{
    if (!j->wd_running) return;
    pthread_mutex_lock(&j->mu);
    j->stop = true;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    pthread_join(j->wd, NULL);
    j->wd_running = false;
}

/* The MPI error's text into err. */
static int mpi_fail(loom_err *err, const char *where, const char *call, int rc)
{
    char text[MPI_MAX_ERROR_STRING] = "";
    int len = 0;
    if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) snprintf(text, sizeof text, "MPI error %d", rc);
    return host->err_set(err, LOOM_ENET, where, "mpi: %s failed: %s", call, text);
}

#define MPI_TRY(call, where)                                                                                           \
    do {                                                                                                               \
        int r_ = (call);                                                                                               \
        if (r_ != MPI_SUCCESS) return mpi_fail(err, where, #call, r_);                                                \
    } while (0)

/* The launcher's variables: Open MPI's, PMIx's, MPICH Hydra's. */
static const char *launcher_var(void)
{
    static const char *const vars[] = {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE"};
    for (size_t i = 0; i < sizeof vars / sizeof *vars; i++)
        if (getenv(vars[i])) return vars[i];
    return NULL;
}

/* This plugin is loaded RTLD_LOCAL; Open MPI's components are shared
 * objects of their own that it dlopens, and resolve symbols of libmpi and
 * libopen-pal through the global scope. Promote the loaded library to it. */
static void make_mpi_global(void)
{
    Dl_info info;
    if (dladdr((void *)MPI_Init_thread, &info) && info.dli_fname) {
        void *h = dlopen(info.dli_fname, RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD);
        (void)h; /* kept open on purpose: MPI stays loaded until exit */
    }
}

static void mpi_job_close(void *comm)
{
    job *j = comm;
    if (!j) return;
    watchdog_stop(j);
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->cv);
    int done = 0;
    MPI_Finalized(&done);
    if (done) {
        host->free(j);
        return;
    }
    if (j->boot_failing && j->boot_failing(j->boot)) {
        host->log(LOOM_LOG_WARN, "mpi: %s fails, so it leaves without MPI_Finalize (which would wait for every rank); "
                  "mpirun then stops the others", j->task);
        host->free(j);
        return;
    }
    if (j->comm != MPI_COMM_NULL) MPI_Comm_free(&j->comm);
    if (j->finalize) MPI_Finalize();
    host->free(j);
}

static int mpi_job_open(void **comm, const loom_job_args *a, loom_err *err)
{
    *comm = NULL;
    if (!launcher_var())
        return host->err_set(err, LOOM_ECONFIG, a->where, "communication = \"mpi\": %s was not started by mpirun "
                             "(none of OMPI_COMM_WORLD_SIZE, PMIX_RANK, PMI_SIZE is set)", a->task),
               host->err_hint(err, "start every task with `mpirun -np N loom train CONFIG` (docs/cluster.md, "
                              "\"Under mpirun\"), or use communication = \"ring\"");
    job *j = host->calloc(1, sizeof *j);
    if (!j) return host->err_set(err, LOOM_ENOMEM, NULL, "mpi: allocating the job's communicator");
    j->comm = MPI_COMM_NULL;
    pthread_mutex_init(&j->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&j->cv, &ca);
    pthread_condattr_destroy(&ca);
    snprintf(j->task, sizeof j->task, "%s", a->task);
    j->timeout_s = a->timeout_s;
    bool ext = a->size >= offsetof(loom_job_args, boot_lost) + sizeof a->boot_lost;
    snprintf(j->timeout_where, sizeof j->timeout_where, "%s",
             ext && a->timeout_where ? a->timeout_where : "strategy.collective_timeout");
    j->boot = a->boot;
    j->boot_lost = ext ? a->boot_lost : NULL;
    j->boot_failing = a->size >= offsetof(loom_job_args, boot_failing) + sizeof a->boot_failing ? a->boot_failing
                                                                                                  : NULL;
    *comm = j;
    int inited = 0, provided = 0;
    MPI_TRY(MPI_Initialized(&inited), a->where);
    if (!inited) {
        make_mpi_global();
        MPI_TRY(MPI_Init_thread(NULL, NULL, MPI_THREAD_SERIALIZED, &provided), a->where);
        j->finalize = 1;
        if (provided < MPI_THREAD_SERIALIZED)
            host->log(LOOM_LOG_WARN, "mpi: the MPI library gives thread level %d (asked %d); loom calls it from "
                      "its train thread only", provided, MPI_THREAD_SERIALIZED);
    }
    MPI_TRY(MPI_Comm_dup(MPI_COMM_WORLD, &j->comm), a->where);
    MPI_TRY(MPI_Comm_set_errhandler(j->comm, MPI_ERRORS_RETURN), a->where);
    int rank = -1;
    MPI_TRY(MPI_Comm_rank(j->comm, &rank), a->where);
    MPI_TRY(MPI_Comm_size(j->comm, &j->size), a->where);
    int size = j->size;
    const char *tm = getenv("LOOM_MPI_TEST_MISMATCH");
    if (tm && *tm && atoi(tm) == a->rank) size++; /* (tests: see the top) */
    if (rank != a->rank || size != a->ranks)
        return host->err_set(err, LOOM_ECONFIG, a->where, "communication = \"mpi\": this process is MPI rank %d of "
                             "%d, but %s is rank %d of the job's %d training tasks", rank, size, a->task, a->rank,
                             a->ranks),
               host->err_hint(err, "start one MPI process per training task, in rank order (chief first): `mpirun "
                              "-np %d loom train CONFIG` and let the topology come from mpirun's environment",
                              a->ranks);
    if (pthread_create(&j->wd, NULL, watchdog, j) != 0)
        return host->err_set(err, LOOM_ENET, a->where, "mpi: cannot start the all-reduce's watchdog thread");
    j->wd_running = true;
    host->log(LOOM_LOG_INFO, "mpi: %s is MPI rank %d of %d; gradients all-reduce with MPI_Allreduce", a->task, rank,
              j->size);
    return 0;
}

/* In pieces of at most INT_MAX floats (MPI counts are ints). */
static int mpi_job_all_reduce(void *comm, float *buf, int64_t count, loom_redop op, loom_err *err)
{
    job *j = comm;
    MPI_Op mop = op == LOOM_REDUCE_MAX ? MPI_MAX : MPI_SUM;
    pthread_mutex_lock(&j->mu);
    j->entered = mono_now(), j->seq++, j->count = count, j->op = op;
    pthread_mutex_unlock(&j->mu);
    int rc = MPI_SUCCESS;
    const char *call = "MPI_Allreduce";
    for (int64_t at = 0; at < count && rc == MPI_SUCCESS; at += INT_MAX) {
        int n = count - at < INT_MAX ? (int)(count - at) : INT_MAX;
        rc = MPI_Allreduce(MPI_IN_PLACE, buf + at, n, MPI_FLOAT, mop, j->comm);
    }
    pthread_mutex_lock(&j->mu);
    j->entered = 0;
    pthread_mutex_unlock(&j->mu);
    if (rc != MPI_SUCCESS) return mpi_fail(err, NULL, call, rc);
    if (op == LOOM_REDUCE_MEAN)
        for (int64_t i = 0; i < count; i++) buf[i] /= (float)j->size;
    return 0;
}

static const loom_cross_device_ops mpi_ops = {
    .version = LOOM_CROSS_DEVICE_OPS_VERSION,
    .name = "mpi",
    .caps = LOOM_XOPS_HOST_MEM,
    .job_open = mpi_job_open,
    .job_close = mpi_job_close,
    .job_all_reduce = mpi_job_all_reduce,
};

static int mpi_init(const loom_host *h, loom_err *err)
{
    host = h;
    return h->register_cross_device_ops(&mpi_ops, err);
}

/* The description names the MPI library actually loaded (`loom plugins`). */
static char description[200];

static loom_plugin plugin = {
    .abi = LOOM_PLUGIN_ABI_VERSION,
    .size = sizeof(loom_plugin),
    .name = "mpi",
    .version = "0.1.0",
    .description = description,
    .init = mpi_init,
};

LOOM_PLUGIN_EXPORT const loom_plugin *loom_plugin_entry(void)
{
    int major = 0, minor = 0;
    MPI_Get_version(&major, &minor); /* callable before MPI_Init */
    char lib[64] = "";
#if defined(OMPI_MAJOR_VERSION)
    snprintf(lib, sizeof lib, ", Open MPI %d.%d.%d", OMPI_MAJOR_VERSION, OMPI_MINOR_VERSION, OMPI_RELEASE_VERSION);
#endif
    snprintf(description, sizeof description, "MPI %d.%d%s: all-reduce across the processes of a job started by "
             "mpirun (strategy.communication = \"mpi\")", major, minor, lib);
    return &plugin;
}
