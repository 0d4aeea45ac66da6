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
 * Threads: the train thread alone calls MPI (MPI_THREAD_SERIALIZED). */
#include "loom_plugin.h"

#include <dlfcn.h>
#include <limits.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

static const loom_host *host;

typedef struct job {
    MPI_Comm comm;      /* a duplicate of MPI_COMM_WORLD, errors returned */
    int      size;
    int      finalize;  /* MPI was initialised here: finalize at close */
} job;

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
    if (j->comm != MPI_COMM_NULL) MPI_Comm_free(&j->comm);
    if (j->finalize) {
        int done = 0;
        MPI_Finalized(&done);
        if (!done) MPI_Finalize();
    }
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
    if (rank != a->rank || j->size != a->ranks)
        return host->err_set(err, LOOM_ECONFIG, a->where, "communication = \"mpi\": this process is MPI rank %d of "
                             "%d, but %s is rank %d of the job's %d training tasks", rank, j->size, a->task, a->rank,
                             a->ranks),
               host->err_hint(err, "start one MPI process per training task, in rank order (chief first): `mpirun "
                              "-np %d loom train CONFIG` and let the topology come from mpirun's environment",
                              a->ranks);
    host->log(LOOM_LOG_INFO, "mpi: %s is MPI rank %d of %d; gradients all-reduce with MPI_Allreduce", a->task, rank,
              j->size);
    return 0;
}

/* In pieces of at most INT_MAX floats (MPI counts are ints). */
static int mpi_job_all_reduce(void *comm, float *buf, int64_t count, loom_redop op, loom_err *err)
{
    job *j = comm;
    MPI_Op mop = op == LOOM_REDUCE_MAX ? MPI_MAX : MPI_SUM;
    for (int64_t at = 0; at < count; at += INT_MAX) {
        int n = count - at < INT_MAX ? (int)(count - at) : INT_MAX;
        MPI_TRY(MPI_Allreduce(MPI_IN_PLACE, buf + at, n, MPI_FLOAT, mop, j->comm), NULL);
    }
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
