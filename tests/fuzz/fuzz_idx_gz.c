/* fuzz_idx_gz.c - libFuzzer target for the IDX reader behind gzip: the
 * input is the IDX content, gzip-compressed here (zlib) before it is handed
 * over through a memfd, so the fuzzer explores headers and bodies of gzip IDX
 * files (streamed: header checked first, body bounded by it), which raw
 * inputs to fuzz_idx rarely reach. The input's first byte picks the cut: 0
 * keeps the stream whole, k > 0 drops the last k bytes of the gzip stream.
 * Built and run by tests/fuzz/run.sh (sources as fuzz_idx).
 * Invariants: no over-read, a loaded tensor's bytes agree with its shape and
 * with the IDX header, a failure leaves the tensor zeroed with a message. */
#include "data/data.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <zlib.h>

#define CHECK(c) do { if (!(c)) __builtin_trap(); } while (0)

static int memfd = -1;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size > (1 << 20)) return 0;
    if (memfd < 0 && (memfd = memfd_create("fuzz_idx_gz", 0)) < 0) return 0;
    unsigned cut = data[0];
    data++, size--;
    uLong cap = compressBound(size) + 32;
    uint8_t *gz = malloc(cap);
    z_stream z;
    memset(&z, 0, sizeof z);
    CHECK(deflateInit2(&z, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) == Z_OK);
    z.next_in = (Bytef *)data;
    z.avail_in = (uInt)size;
    z.next_out = gz;
    z.avail_out = (uInt)cap;
    CHECK(deflate(&z, Z_FINISH) == Z_STREAM_END);
    size_t gn = z.total_out;
    deflateEnd(&z);
    if (cut) gn = cut < gn ? gn - cut : 0;
    int ok = ftruncate(memfd, 0) == 0 && pwrite(memfd, gz, gn, 0) == (ssize_t)gn;
    free(gz);
    if (!ok) return 0;
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", memfd);
    loom_tensor t;
    loom_err err = {0};
    int rc = loom_idx_load(path, &t, &err);
    if (rc == LOOM_OK) {
        CHECK(t.shape.rank >= 1 && t.shape.rank <= LOOM_MAX_RANK);
        CHECK(size >= 4 && data[0] == 0 && data[1] == 0 && data[3] == t.shape.rank);
        size_t nb = loom_tensor_nbytes(&t);
        CHECK(nb == (size_t)loom_shape_numel(&t.shape) * loom_dtype_size(t.dtype));
        volatile uint8_t sum = 0;
        for (size_t i = 0; i < nb; i++) sum ^= ((const uint8_t *)t.data)[i];
        (void)sum;
        loom_tensor_fini(&t);
    } else {
        CHECK(t.data == NULL && err.msg[0]);
    }
    return 0;
}
