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
 * a lock guards the communicator cache anyway. */
#include "loom_plugin.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <pthread.h>
#include <stdio.h>

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

static const loom_cross_device_ops nccl_ops = {
    .version = LOOM_CROSS_DEVICE_OPS_VERSION,
    .name = "nccl",
    .all_reduce = nccl_all_reduce,
    .broadcast = nccl_broadcast,
    .all_gather = nccl_all_gather,
    .caps = LOOM_XOPS_DEVICE_MEM, /* GPU buffers only: CPU replicas are refused when the strategy opens */
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
    snprintf(description, sizeof description, "NCCL %d.%d.%d: all-reduce, broadcast, all-gather over local GPUs",
             v / 10000, v / 100 % 100, v % 100);
    return &plugin;
}
