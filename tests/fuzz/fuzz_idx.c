/* fuzz_idx.c - libFuzzer target for the IDX reader (loom_idx_load: magic,
 * type code, dims, size checks, big-endian conversion; gzip detected from the
 * leading bytes by loom_read_file). The input is the file, handed over through
 * a memfd as /proc/self/fd/N. Built and run by tests/fuzz/run.sh, or by hand
 * from the repository root:
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined -D_GNU_SOURCE -I appliance \
 *     tests/fuzz/fuzz_idx.c appliance/data/source/idx.c appliance/data/engine/elem.c \
 *     appliance/core/[a-z]*.c appliance/tensor/{tensor,blas}.c -lz -lm -ldl -lpthread -o /tmp/fuzz_idx
 *   /tmp/fuzz_idx -max_total_time=30 /tmp/corpus_idx tests/fuzz/corpus/idx
 * Invariants checked: no over-read (ASan), a loaded tensor's bytes agree with
 * its shape, and a failure leaves the tensor zeroed with a message. */
#include "data/data.h"

#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define CHECK(c) do { if (!(c)) __builtin_trap(); } while (0)

static int memfd = -1;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (memfd < 0 && (memfd = memfd_create("fuzz_idx", 0)) < 0) return 0;
    if (ftruncate(memfd, 0) < 0 || pwrite(memfd, data, size, 0) != (ssize_t)size) return 0;
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", memfd);
    loom_tensor t;
    loom_err err = {0};
    int rc = loom_idx_load(path, &t, &err);
    if (rc == LOOM_OK) {
        CHECK(t.shape.rank >= 1 && t.shape.rank <= LOOM_MAX_RANK);
        size_t n = loom_tensor_nbytes(&t);
        CHECK(n == (size_t)loom_shape_numel(&t.shape) * loom_dtype_size(t.dtype));
        if (n) {
            volatile uint8_t sum = 0; /* touch every byte: ASan checks the buffer is that large */
            for (size_t i = 0; i < n; i++) sum ^= ((const uint8_t *)t.data)[i];
            (void)sum;
        }
        loom_tensor_fini(&t);
    } else {
        CHECK(t.data == NULL && err.msg[0]);
    }
    return 0;
}
