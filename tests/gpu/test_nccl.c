/* test_nccl.c - the nccl plugin's cross-device op on every local GPU (up to
 * 8): all-reduce SUM, MEAN and MAX against a float64 reference on buffers
 * of odd sizes, broadcast from the last GPU, all-gather onto gpu:0, and a
 * host buffer refused with a message. GPU memory comes from the cuda
 * plugin's backend. Without a usable GPU it checks that a collective fails
 * with "no CUDA device" instead of crashing, then exits 77 (skip). */
#include "harness.h"
#include "plugin/plugin.h"
#include "tensor/device.h"

#include <stdlib.h>

#define MAX_DEV 8

static const loom_device_ops *cuda;
static const loom_cross_device_ops *nccl;
static loom_device *dev[MAX_DEV];
static int ndev;

static float value(int rank, int64_t i) { return (float)((rank * 7919 + i * 104729) % 1009) / 64.f - 7.f; }

/* Per GPU r, count floats value(r, i) on the device; returned in bufs. */
static void fill(float **bufs, int64_t count)
{
    float *h = malloc(sizeof(float) * (size_t)count);
    for (int r = 0; r < ndev; r++) {
        loom_err err = {0};
        for (int64_t i = 0; i < count; i++) h[i] = value(r, i);
        void *d = NULL;
        int rc = cuda->alloc(dev[r], &d, sizeof(float) * (size_t)count, &err);
        if (!rc) rc = cuda->upload(dev[r], LOOM_DEV_STREAM_COMPUTE, d, h, sizeof(float) * (size_t)count, &err);
        if (!rc) rc = cuda->synchronize(dev[r], -1, &err);
        CHECK_MSG(rc == 0, "gpu:%d: %s", r, err.msg);
        bufs[r] = d;
    }
    free(h);
}

static float *fetch(int r, const float *d, int64_t count)
{
    loom_err err = {0};
    float *h = malloc(sizeof(float) * (size_t)count);
    int rc = cuda->download(dev[r], LOOM_DEV_STREAM_COMPUTE, h, d, sizeof(float) * (size_t)count, &err);
    if (!rc) rc = cuda->synchronize(dev[r], -1, &err);
    CHECK_MSG(rc == 0, "gpu:%d: %s", r, err.msg);
    return h;
}

static void release(float **bufs)
{
    for (int r = 0; r < ndev; r++) cuda->free(dev[r], bufs[r]);
}

static void test_all_reduce(void)
{
    static const int64_t sizes[] = {1, 7919, 1 << 20};
    static const char *const names[] = {"SUM", "MEAN", "MAX"};
    for (int k = 0; k < 3; k++)
        for (int op = LOOM_REDUCE_SUM; op <= LOOM_REDUCE_MAX; op++) {
            int64_t count = sizes[k];
            float *bufs[MAX_DEV];
            fill(bufs, count);
            loom_err err = {0};
            CHECK_MSG(nccl->all_reduce(bufs, ndev, count, op, &err) == 0, "%s: %s", names[op], err.msg);
            for (int r = 0; r < ndev; r++) {
                float *h = fetch(r, bufs[r], count);
                int64_t bad = 0;
                for (int64_t i = 0; i < count; i++) {
                    double want = op == LOOM_REDUCE_MAX ? -1e300 : 0;
                    for (int q = 0; q < ndev; q++)
                        want = op == LOOM_REDUCE_MAX ? fmax(want, value(q, i)) : want + value(q, i);
                    if (op == LOOM_REDUCE_MEAN) want /= ndev;
                    bad += !(fabs(h[i] - want) <= 1e-5 * (1 + fabs(want)));
                }
                CHECK_MSG(!bad, "all_reduce %s of %lld floats: gpu:%d has %lld wrong", names[op], (long long)count, r,
                          (long long)bad);
                free(h);
            }
            release(bufs);
        }
}

static void test_broadcast(void)
{
    const int64_t count = 65537;
    float *bufs[MAX_DEV];
    fill(bufs, count);
    loom_err err = {0};
    int root = ndev - 1;
    CHECK_MSG(nccl->broadcast(bufs, ndev, count, root, &err) == 0, "%s", err.msg);
    for (int r = 0; r < ndev; r++) {
        float *h = fetch(r, bufs[r], count);
        int64_t bad = 0;
        for (int64_t i = 0; i < count; i++) bad += h[i] != value(root, i);
        CHECK_MSG(!bad, "broadcast: gpu:%d has %lld wrong", r, (long long)bad);
        free(h);
    }
    release(bufs);
}

static void test_all_gather(void)
{
    const int64_t count = 1001;
    float *bufs[MAX_DEV];
    void *out = NULL;
    loom_err err = {0};
    fill(bufs, count);
    CHECK(cuda->alloc(dev[0], &out, sizeof(float) * (size_t)(count * ndev), &err) == 0);
    CHECK_MSG(nccl->all_gather(bufs, ndev, count, out, &err) == 0, "%s", err.msg);
    float *h = fetch(0, out, count * ndev);
    int64_t bad = 0;
    for (int r = 0; r < ndev; r++)
        for (int64_t i = 0; i < count; i++) bad += h[r * count + i] != value(r, i);
    CHECK_MSG(!bad, "all_gather: %lld wrong", (long long)bad);
    free(h);
    cuda->free(dev[0], out);
    release(bufs);
}

static void test_host_buffer_refused(void)
{
    float host_buf[4] = {1, 2, 3, 4}, *bufs[1] = {host_buf};
    loom_err err = {0};
    CHECK(nccl->all_reduce(bufs, 1, 4, LOOM_REDUCE_SUM, &err) != 0);
    CHECK_CONTAINS(err.msg, "not GPU memory");
}

static const loom_test tests[] = {
    {"all_reduce", test_all_reduce},
    {"broadcast", test_broadcast},
    {"all_gather", test_all_gather},
    {"host_buffer_refused", test_host_buffer_refused},
    {0},
};

int main(void)
{
    const char *root = getenv("LOOM_BUILD_ROOT");
    static const char *const files[] = {"cuda.so", "nccl.so"};
    for (int i = 0; i < 2; i++) {
        char path[4096];
        loom_err err = {0};
        snprintf(path, sizeof path, "%s/plugins/%s", root ? root : "build", files[i]);
        if (loom_plugin_load_file(path, NULL, &err)) {
            printf("Bail out! %s: %s\n", path, err.msg);
            return 1;
        }
    }
    cuda = loom_device_backend("cuda");
    nccl = loom_find_cross_device_ops("nccl");
    if (!cuda || !nccl) {
        printf("Bail out! the plugins registered no \"cuda\" backend or \"nccl\" op\n");
        return 1;
    }
    char why[400];
    ndev = cuda->probe(why, sizeof why);
    if (ndev == 0) {
        /* without a device a collective must fail with a message, not crash */
        float host_buf[2] = {1, 2}, *bufs[1] = {host_buf};
        loom_err err = {0};
        int rc = nccl->all_reduce(bufs, 1, 2, LOOM_REDUCE_SUM, &err);
        if (rc != LOOM_ENCCL || !strstr(err.msg, "no CUDA device")) {
            printf("Bail out! without a device all_reduce gave %d \"%s\"\n", rc, err.msg);
            return 1;
        }
        printf("1..0 # SKIP %s\n", why);
        return 77;
    }
    if (ndev > MAX_DEV) ndev = MAX_DEV;
    for (int r = 0; r < ndev; r++) {
        loom_err err = {0};
        if (cuda->open(&dev[r], r, &err)) {
            printf("Bail out! gpu:%d: %s\n", r, err.msg);
            return 1;
        }
    }
    int rc = loom_test_run(tests);
    for (int r = 0; r < ndev; r++) cuda->close(dev[r]);
    return rc;
}
