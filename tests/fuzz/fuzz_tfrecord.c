/* fuzz_tfrecord.c - libFuzzer target for the TFRecord reader (all
 * compressions, both on_corrupt modes) and the Example parser on every record.
 * Built and run by tests/fuzz/run.sh (meson test --suite fuzz), or by hand from the repository root:
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined -D_GNU_SOURCE -I appliance \
 *     tests/fuzz/fuzz_tfrecord.c appliance/data/format/tfrecord.c appliance/data/format/example.c \
 *     appliance/core/[a-z]*.c appliance/tensor/{tensor,blas}.c -lz -lzstd -lm -ldl -lpthread -o /tmp/fuzz_tfrecord
 *   /tmp/fuzz_tfrecord -max_total_time=30 /tmp/corpus_tfrecord tests/fixtures/tf
 * The input's first byte picks the declared compression and the mode; the rest
 * is the file, handed over through a memfd as /proc/self/fd/N. */
#include "data/data.h"

#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>

static int memfd = -1;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    if (memfd < 0) {
        loom_log_set_level(LOOM_LOG_ERROR); /* skip mode warns on every bad record */
        memfd = memfd_create("fuzz_tfrecord", 0);
        if (memfd < 0) return 0;
    }
    const loom_compression comps[] = {LOOM_COMP_AUTO, LOOM_COMP_NONE, LOOM_COMP_GZIP, LOOM_COMP_ZLIB, LOOM_COMP_ZSTD};
    loom_compression c = comps[data[0] % 5];
    loom_on_corrupt mode = (data[0] / 5) % 2 ? LOOM_CORRUPT_SKIP : LOOM_CORRUPT_ERROR;
    if (ftruncate(memfd, 0) < 0 || pwrite(memfd, data + 1, size - 1, 0) != (ssize_t)(size - 1)) return 0;
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", memfd);

    loom_err err = {0};
    loom_tfrecord *r;
    if (loom_tfrecord_open(&r, path, c, mode, &err)) return 0;
    loom_example ex;
    loom_example_init(&ex);
    const uint8_t *rec;
    size_t len;
    uint64_t last = 0;
    while (loom_tfrecord_next(r, &rec, &len, &err) == LOOM_OK) {
        if (loom_tfrecord_offset(r) <= last) __builtin_trap(); /* offsets strictly grow */
        last = loom_tfrecord_offset(r);
        if (loom_example_parse(&ex, rec, len, &err) == LOOM_OK)
            for (int i = 0; i < ex.n; i++) {
                float f[4];
                int64_t v[4];
                loom_bytes_view b[4];
                loom_example_floats(&ex.f[i], f, 4);
                loom_example_int64s(&ex.f[i], v, 4);
                loom_example_bytes(&ex.f[i], b, 4);
            }
    }
    loom_example_fini(&ex);
    loom_tfrecord_close(r);
    return 0;
}
