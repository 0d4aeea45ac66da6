/* fuzz_csv.c - libFuzzer target for the streaming CSV reader of the csv
 * source (RFC 4180 records: quotes, doubled quotes, newlines in quotes, CRLF)
 * and its value parser for every dtype. The input's first byte picks the
 * delimiter; the rest is the file, handed over through a memfd as
 * /proc/self/fd/N. Built and run by tests/fuzz/run.sh, or by hand from the
 * repository root:
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined -D_GNU_SOURCE -I appliance \
 *     tests/fuzz/fuzz_csv.c appliance/data/source/csv.c appliance/data/source/files.c appliance/data/engine/elem.c \
 *     appliance/core/[a-z]*.c appliance/tensor/{tensor,blas}.c -lz -lm -ldl -lpthread -o /tmp/fuzz_csv
 *   /tmp/fuzz_csv -max_total_time=30 /tmp/corpus_csv tests/fuzz/corpus/csv
 * Invariants checked: no over-read (ASan); every record has >= 1 field, each
 * inside the record's text; offsets and lines only grow; reading a record
 * again from its saved (offset, line) gives the same record (the restore path). */
#include "data/data_internal.h"

#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define CHECK(c) do { if (!(c)) __builtin_trap(); } while (0)

static int memfd = -1;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    if (memfd < 0 && (memfd = memfd_create("fuzz_csv", 0)) < 0) return 0;
    static const char delims[] = {',', ';', '\t', '|', ' ', 'a', '\0', '\'' };
    char delim = delims[data[0] % sizeof delims];
    if (ftruncate(memfd, 0) < 0 || pwrite(memfd, data + 1, size - 1, 0) != (ssize_t)(size - 1)) return 0;
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", memfd);

    loom_err err = {0};
    src_file in;
    if (src_file_open_(&in, path, 0, &err)) return 0;
    csv_record rec = {0}, again = {0};
    int64_t line = 1;
    uint64_t last_off = 0;
    for (int n = 0; n < 10000; n++) {
        uint64_t off = in.offset;
        int64_t at = line;
        int rc = csv_read_record_(&in, "fuzz.csv", delim, &line, &rec, &err);
        if (rc == LOOM_EEOF) break;
        if (rc) {
            CHECK(rc == LOOM_EDATA && err.where[0]);
            break;
        }
        CHECK(rec.n >= 1 && rec.line >= at && line >= rec.line && in.offset > last_off);
        last_off = in.offset;
        for (int i = 0; i < rec.n; i++) {
            CHECK(rec.start[i] < rec.len);
            const char *f = rec.text + rec.start[i];
            CHECK(f + strlen(f) < rec.text + rec.len);
            union { uint8_t u; int32_t i; int64_t l; float f; double d; } v;
            const loom_dtype dts[] = {LOOM_U8, LOOM_I32, LOOM_I64, LOOM_F32, LOOM_F64};
            for (int k = 0; k < 5; k++) (void)csv_parse_value_(f, dts[k], &v);
        }
        if (n < 4) { /* the restore path: reopen at the record's offset and read it again */
            src_file r2;
            int64_t l2 = at;
            if (src_file_open_(&r2, path, off, &err) == LOOM_OK) {
                CHECK(csv_read_record_(&r2, "fuzz.csv", delim, &l2, &again, &err) == LOOM_OK);
                CHECK(again.n == rec.n && again.len == rec.len && !memcmp(again.text, rec.text, rec.len));
                CHECK(l2 == line && r2.offset == in.offset);
                src_file_close_(&r2);
            }
        }
    }
    csv_record_fini_(&again);
    csv_record_fini_(&rec);
    src_file_close_(&in);
    return 0;
}
