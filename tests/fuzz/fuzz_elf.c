/* fuzz_elf.c - libFuzzer target for the plugin file check that runs before
 * dlopen (loom_plugin_elf_check_: the ELF header, program headers, segments,
 * section table and sections against the file size, then loom_plugin_entry
 * in .dynsym/.dynstr). The input is the file, through a memfd. Built and run
 * by tests/fuzz/run.sh; by hand:
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined -D_GNU_SOURCE -I appliance \
 *     tests/fuzz/fuzz_elf.c appliance/plugin/elf_check.c appliance/core/[a-z]*.c \
 *     -lz -lm -ldl -lpthread -o /tmp/fuzz_elf
 *   /tmp/fuzz_elf -max_total_time=30 /tmp/corpus_elf tests/fuzz/corpus/elf
 * Invariants: no over-read (ASan: every table is read with pread into a
 * buffer of its checked size); a refusal says why and names the file; an
 * accepted file has a whole ELF header and program headers. */
#include "plugin/elf_check_internal.h"

#include <elf.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define CHECK(c) do { if (!(c)) __builtin_trap(); } while (0)

static int memfd = -1;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (memfd < 0 && (memfd = memfd_create("fuzz_elf", 0)) < 0) return 0;
    if (ftruncate(memfd, 0) < 0 || pwrite(memfd, data, size, 0) != (ssize_t)size) return 0;
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", memfd);
    loom_err err = {0};
    int rc = loom_plugin_elf_check_(path, "loom_plugin_entry", &err);
    if (rc == LOOM_OK) {
        Elf64_Ehdr h;
        CHECK(size >= sizeof h);
        memcpy(&h, data, sizeof h);
        CHECK(h.e_type == ET_DYN && h.e_phoff + (uint64_t)h.e_phnum * sizeof(Elf64_Phdr) <= size);
    } else {
        CHECK(err.msg[0] && !strcmp(err.where, path));
    }
    return 0;
}
