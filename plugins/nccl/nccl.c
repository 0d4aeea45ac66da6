/* nccl.c - the nccl plugin: the cross-device op "nccl" over the GPUs of
 * this machine. bufs[i] is device memory of a distinct GPU (from the cuda
 * backend's alloc); which GPU each buffer lives on picks the device set, and
 * each device set gets one communicator per GPU (ncclCommInitAll), created
 * at its first use and kept until exit, as plugins are. One collective is
 * one ncclGroupStart/End over the set's GPUs, each on its own stream; the
 * call returns when every stream is done (the cross-device ops API is
 * synchronous), so callers synchronize their compute streams first.
 * Linked against libnccl and libcudart only: without a driver or a GPU it
 * loads and registers, and every collective says what is missing.
 * Threads: one collective at a time, from any one thread (mirrored and
 * central_storage call it from the replica thread that arrives last at
 * their rendezvous, with every replica's gradients complete on its device);
 * a lock guards the communicator cache anyway.
 *
 * Across the processes of a job (multi_worker_mirrored, strategy.
 * communication = "nccl"; the job entry points of cross-device ops version
 * 4): the chief creates the job's ncclUniqueId (which needs no device) and
 * Loom's bootstrap broadcast carries it over the cluster transport to every
 * task; then every task looks for its GPU and all of them learn the result
 * (bootstrap all-gather), so a task without one stops the whole job, named,
 * before ncclCommInitRank (which would wait forever for a rank that never
 * comes). Rank r uses gpu:(r mod the GPUs it sees), which gives distinct
 * GPUs to the ranks of one host when each host runs as many ranks as it has
 * GPUs, in consecutive ranks. The gradients are host memory there (the
 * strategy reduces its local replicas first): each all-reduce uploads them,
 * runs ncclAllReduce on the job's stream and downloads the result. Only the
 * exchange and the refusal without a device are tested on a machine without
 * a GPU (tests/integration/nccl_job.sh). */
#include "loom_plugin.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#define MAX_GPUS 16
#define MAX_SETS 8

static const loom_host *host;

typedef struct comm_set {
    int n;
    int dev[MAX_GPUS];
    ncclComm_t comm[MAX_GPUS];
    cudaStream_t stream[MAX_GPUS];
} comm_set;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static comm_set sets[MAX_SETS];
static int n_sets;

#define NCCL_TRY(call)                                                                                                 \
    do {                                                                                                               \
        ncclResult_t r_ = (call);                                                                                      \
        if (r_ != ncclSuccess)                                                                                         \
            return host->err_set(err, LOOM_ENCCL, NULL, "%s failed at nccl.c:%d: %s", #call, __LINE__,                 \
                                 ncclGetErrorString(r_));                                                              \
    } while (0)
#define CUDA_TRY(call)                                                                                                 \
    do {                                                                                                               \
        cudaError_t e_ = (call);                                                                                       \
        if (e_ != cudaSuccess)                                                                                         \
            return host->err_set(err, LOOM_ECUDA, NULL, "%s failed at nccl.c:%d: %s", #call, __LINE__,                 \
                                 cudaGetErrorString(e_));                                                              \
    } while (0)

/* The GPU of each buffer: all device memory, on distinct GPUs. */
static int devices_of(const float *const *bufs, int n, int *dev, loom_err *err)
{
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
        cudaGetLastError();
        return host->err_set(err, LOOM_ENCCL, NULL, "nccl: no CUDA device (%s)",
                             e == cudaErrorInsufficientDriver ? "no CUDA driver: libcuda.so.1 not found"
                                                              : cudaGetErrorString(e)),
               host->err_hint(err, "run where the NVIDIA driver and a GPU are, or use cross_device_ops = \"ring\"");
    }
    if (n < 1 || n > MAX_GPUS)
        return host->err_set(err, LOOM_ENCCL, NULL, "nccl: %d buffers (1 to %d GPUs)", n, MAX_GPUS);
    for (int i = 0; i < n; i++) {
        struct cudaPointerAttributes a;
        CUDA_TRY(cudaPointerGetAttributes(&a, bufs[i]));
        if (a.type != cudaMemoryTypeDevice)
            return host->err_set(err, LOOM_ENCCL, NULL, "nccl: buffer %d is not GPU memory", i),
                   host->err_hint(err, "the nccl op reduces GPU replicas; CPU replicas use ring, "
                                       "hierarchical_copy or reduce_to_one_device");
        dev[i] = a.device;
        for (int j = 0; j < i; j++)
            if (dev[j] == dev[i])
                return host->err_set(err, LOOM_ENCCL, NULL, "nccl: buffers %d and %d are both on gpu:%d", j, i, dev[i]);
    }
    return 0;
}

static int new_set(comm_set *s, const int *dev, int n, loom_err *err)
{
    s->n = n;
    for (int i = 0; i < n; i++) s->dev[i] = dev[i];
    NCCL_TRY(ncclCommInitAll(s->comm, n, s->dev));
    for (int i = 0; i < n; i++) {
        CUDA_TRY(cudaSetDevice(dev[i]));
        CUDA_TRY(cudaStreamCreateWithFlags(&s->stream[i], cudaStreamNonBlocking));
    }
    return 0;
}

/* The communicators of this device set (in this order), made at first use. */
static int comms_for(const int *dev, int n, comm_set **out, loom_err *err)
{
    for (int k = 0; k < n_sets; k++) {
        bool same = sets[k].n == n;
        for (int i = 0; same && i < n; i++) same = sets[k].dev[i] == dev[i];
        if (same) return *out = &sets[k], 0;
    }
    if (n_sets == MAX_SETS)
        return host->err_set(err, LOOM_ENCCL, NULL, "nccl: more than %d different device sets", MAX_SETS);
    int rc = new_set(&sets[n_sets], dev, n, err);
    if (rc) return rc;
    *out = &sets[n_sets++];
    return 0;
}

static int wait_all(const comm_set *s, loom_err *err)
{
    for (int i = 0; i < s->n; i++) {
        CUDA_TRY(cudaSetDevice(s->dev[i]));
        CUDA_TRY(cudaStreamSynchronize(s->stream[i]));
    }
    return 0;
}

typedef enum { OP_ALL_REDUCE, OP_BROADCAST, OP_ALL_GATHER } coll;

/* One grouped collective; out (all-gather) is GPU memory of one of the set's GPUs. */
static int run_group(comm_set *s, coll c, float *const *bufs, int64_t count, loom_redop op, int root, float *out,
                     loom_err *err)
{
    ncclRedOp_t rop = op == LOOM_REDUCE_SUM ? ncclSum : op == LOOM_REDUCE_MEAN ? ncclAvg : ncclMax;
    int dst = 0;
    if (c == OP_ALL_GATHER) {
        struct cudaPointerAttributes a;
        CUDA_TRY(cudaPointerGetAttributes(&a, out));
        while (dst < s->n && (a.type != cudaMemoryTypeDevice || s->dev[dst] != a.device)) dst++;
        if (dst == s->n)
            return host->err_set(err, LOOM_ENCCL, NULL, "nccl: all_gather's output is not memory of one of the GPUs");
    }
    size_t n = (size_t)count;
    NCCL_TRY(ncclGroupStart());
    for (int i = 0; i < s->n; i++) {
        CUDA_TRY(cudaSetDevice(s->dev[i]));
        if (c == OP_ALL_REDUCE) {
            NCCL_TRY(ncclAllReduce(bufs[i], bufs[i], n, ncclFloat, rop, s->comm[i], s->stream[i]));
        } else if (c == OP_BROADCAST) {
            NCCL_TRY(ncclBroadcast(bufs[i], bufs[i], n, ncclFloat, root, s->comm[i], s->stream[i]));
        } else if (i == dst) {
            CUDA_TRY(cudaMemcpyAsync(out + (size_t)i * n, bufs[i], n * sizeof(float), cudaMemcpyDeviceToDevice,
                                     s->stream[i]));
        } else {
            NCCL_TRY(ncclSend(bufs[i], n, ncclFloat, dst, s->comm[i], s->stream[i]));
            NCCL_TRY(ncclRecv(out + (size_t)i * n, n, ncclFloat, i, s->comm[dst], s->stream[dst]));
        }
    }
    NCCL_TRY(ncclGroupEnd());
    return wait_all(s, err);
}

static int collective(coll c, float *const *bufs, int n, int64_t count, loom_redop op, int root, float *out,
                      loom_err *err)
{
    int dev[MAX_GPUS];
    int rc = devices_of((const float *const *)bufs, n, dev, err);
    if (rc || count == 0) return rc;
    pthread_mutex_lock(&lock);
    comm_set *s = NULL;
    rc = comms_for(dev, n, &s, err);
    if (!rc) rc = run_group(s, c, bufs, count, op, root, out, err);
    pthread_mutex_unlock(&lock);
    return rc;
}

static int nccl_all_reduce(float *const *bufs, int n, int64_t count, loom_redop op, loom_err *err)
{
    return collective(OP_ALL_REDUCE, bufs, n, count, op, 0, NULL, err);
}

static int nccl_broadcast(float *const *bufs, int n, int64_t count, int root, loom_err *err)
{
    return collective(OP_BROADCAST, bufs, n, count, LOOM_REDUCE_SUM, root, NULL, err);
}

static int nccl_all_gather(float *const *bufs, int n, int64_t count, float *out, loom_err *err)
{
    return collective(OP_ALL_GATHER, bufs, n, count, LOOM_REDUCE_SUM, 0, out, err);
}

/* ---- across the processes of a job ------------------------------------------ */

#define BOOT_MAGIC 0x4c434e4cu /* "LNCL" */

/* What the chief broadcasts: its ncclGetUniqueId's result and the id. */
typedef struct boot_id {
    uint32_t     magic;
    int32_t      status;   /* ncclResult_t of ncclGetUniqueId on the chief */
    char         why[120]; /* its text when it failed */
    ncclUniqueId id;
} boot_id;

/* What every task tells every other once it looked for its GPU. */
typedef struct boot_ready {
    int32_t ok;
    char    task[32];
    char    why[120];
} boot_ready;

typedef struct nccl_job {
    int          dev;
    int          ranks;
    ncclComm_t   comm;
    cudaStream_t stream;
    float       *dbuf;  /* device copy of the buffer being reduced */
    size_t       cap;   /* its floats */
    void        *boot;
    int (*boot_failing)(void *boot); /* NULL from hosts before it */
} nccl_job;

/* FNV-1a of the id: the same number in every task's log shows the exchange worked. */
static uint32_t fingerprint(const ncclUniqueId *id)
{
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < sizeof id->internal; i++) h = (h ^ (uint8_t)id->internal[i]) * 16777619u;
    return h;
}

static void nccl_job_close(void *comm)
{
    nccl_job *j = comm;
    if (!j) return;
    /* A failing task must not wait for the others on its way out:
     * ncclCommDestroy flushes work that needs every rank, ncclCommAbort not. */
    if (j->comm) (j->boot_failing && j->boot_failing(j->boot) ? ncclCommAbort : ncclCommDestroy)(j->comm);
    if (j->dbuf) cudaFree(j->dbuf);
    if (j->stream) cudaStreamDestroy(j->stream);
    host->free(j);
}

/* This task's GPU, into ready (ok or why not). */
static void find_gpu(nccl_job *j, int rank, boot_ready *ready)
{
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
        cudaGetLastError();
        snprintf(ready->why, sizeof ready->why, "no CUDA device: %s",
                 e == cudaErrorInsufficientDriver ? "no CUDA driver (libcuda.so.1 not found or too old)"
                 : e == cudaSuccess               ? "the driver sees no GPU"
                                                  : cudaGetErrorString(e));
        return;
    }
    j->dev = rank % count;
    e = cudaSetDevice(j->dev);
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&j->stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        cudaGetLastError();
        snprintf(ready->why, sizeof ready->why, "gpu:%d: %s", j->dev, cudaGetErrorString(e));
        return;
    }
    ready->ok = 1;
}

static int nccl_job_open(void **comm, const loom_job_args *a, loom_err *err)
{
    *comm = NULL;
    nccl_job *j = host->calloc(1, sizeof *j);
    if (!j) return host->err_set(err, LOOM_ENOMEM, NULL, "nccl: allocating the job's communicator");
    *comm = j;
    j->ranks = a->ranks;
    j->boot = a->boot;
    if (a->size >= offsetof(loom_job_args, boot_failing) + sizeof a->boot_failing) j->boot_failing = a->boot_failing;
    /* 1. the chief's unique id to every task, over Loom's transport */
    boot_id b;
    memset(&b, 0, sizeof b);
    if (a->rank == 0) {
        ncclResult_t r = ncclGetUniqueId(&b.id);
        b.magic = BOOT_MAGIC;
        b.status = (int32_t)r;
        if (r != ncclSuccess) snprintf(b.why, sizeof b.why, "%s", ncclGetErrorString(r));
    }
    int rc = a->boot_broadcast(a->boot, &b, sizeof b, 0, err);
    if (rc) return rc;
    if (b.magic != BOOT_MAGIC)
        return host->err_set(err, LOOM_ENCCL, a->where, "nccl: the unique id %s received from the chief is not one",
                             a->task);
    if (b.status != ncclSuccess)
        return host->err_set(err, LOOM_ENCCL, a->where, "nccl: ncclGetUniqueId failed on the chief: %s", b.why);
    if (a->rank == 0)
        host->log(LOOM_LOG_INFO, "nccl: %s created the job's unique id (fingerprint %08x) and sent it to %d task%s",
                  a->task, fingerprint(&b.id), a->ranks - 1, a->ranks == 2 ? "" : "s");
    else
        host->log(LOOM_LOG_INFO, "nccl: %s received the job's unique id from the chief (fingerprint %08x)", a->task,
                  fingerprint(&b.id));
    /* 2. every task's GPU, known to all before anyone waits inside NCCL */
    boot_ready mine, *all = host->calloc((size_t)a->ranks, sizeof *all);
    if (!all) return host->err_set(err, LOOM_ENOMEM, NULL, "nccl: gathering %d tasks' devices", a->ranks);
    memset(&mine, 0, sizeof mine);
    snprintf(mine.task, sizeof mine.task, "%s", a->task);
    find_gpu(j, a->rank, &mine);
    rc = a->boot_all_gather(a->boot, &mine, sizeof mine, all, err);
    char missing[480] = "";
    size_t len = 0;
    for (int r = 0; !rc && r < a->ranks && len < sizeof missing; r++)
        if (!all[r].ok)
            len += (size_t)snprintf(missing + len, sizeof missing - len, "%s%.32s (%.120s)", len ? "; " : "",
                                    all[r].task, all[r].why);
    host->free(all);
    if (rc) return rc;
    if (missing[0])
        return host->err_set(err, LOOM_ENCCL, a->where, "nccl: no usable GPU on %s", missing),
               host->err_hint(err, "run every task where the NVIDIA driver and a GPU are, or use communication = "
                              "\"ring\" (the cluster transport's all-reduce on the CPU)");
    /* 3. the communicator (every task has a GPU: all of them come) */
    NCCL_TRY(ncclCommInitRank(&j->comm, a->ranks, b.id, a->rank));
    host->log(LOOM_LOG_INFO, "nccl: %s is NCCL rank %d of %d on gpu:%d", a->task, a->rank, a->ranks, j->dev);
    return 0;
}

static int nccl_job_all_reduce(void *comm, float *buf, int64_t count, loom_redop op, loom_err *err)
{
    nccl_job *j = comm;
    if (count <= 0) return 0;
    size_t n = (size_t)count;
    CUDA_TRY(cudaSetDevice(j->dev));
    if (n > j->cap) {
        if (j->dbuf) CUDA_TRY(cudaFree(j->dbuf));
        j->dbuf = NULL;
        j->cap = 0;
        CUDA_TRY(cudaMalloc((void **)&j->dbuf, n * sizeof(float)));
        j->cap = n;
    }
    ncclRedOp_t rop = op == LOOM_REDUCE_SUM ? ncclSum : op == LOOM_REDUCE_MEAN ? ncclAvg : ncclMax;
    CUDA_TRY(cudaMemcpyAsync(j->dbuf, buf, n * sizeof(float), cudaMemcpyHostToDevice, j->stream));
    NCCL_TRY(ncclAllReduce(j->dbuf, j->dbuf, n, ncclFloat, rop, j->comm, j->stream));
    CUDA_TRY(cudaMemcpyAsync(buf, j->dbuf, n * sizeof(float), cudaMemcpyDeviceToHost, j->stream));
    CUDA_TRY(cudaStreamSynchronize(j->stream));
    return 0;
}

static const loom_cross_device_ops nccl_ops = {
    .version = LOOM_CROSS_DEVICE_OPS_VERSION,
    .name = "nccl",
    .all_reduce = nccl_all_reduce,
    .broadcast = nccl_broadcast,
    .all_gather = nccl_all_gather,
    .caps = LOOM_XOPS_DEVICE_MEM, /* GPU buffers only: CPU replicas are refused when the strategy opens */
    .job_open = nccl_job_open,
    .job_close = nccl_job_close,
    .job_all_reduce = nccl_job_all_reduce,
};

static int nccl_init(const loom_host *h, loom_err *err)
{
    host = h;
    return h->register_cross_device_ops(&nccl_ops, err);
}

/* The description names the NCCL library actually loaded (`loom devices`). */
static char description[160];

static loom_plugin plugin = {
    .abi = LOOM_PLUGIN_ABI_VERSION,
    .size = sizeof(loom_plugin),
    .name = "nccl",
    .version = "0.1.0",
    .description = description,
    .init = nccl_init,
};

LOOM_PLUGIN_EXPORT const loom_plugin *loom_plugin_entry(void)
{
    int v = 0;
    ncclGetVersion(&v);
    snprintf(description, sizeof description, "NCCL %d.%d.%d: all-reduce, broadcast, all-gather over local GPUs; all-reduce across a job's hosts",
             v / 10000, v / 100 % 100, v % 100);
    return &plugin;
}
