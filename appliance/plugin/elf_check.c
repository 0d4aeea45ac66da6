/* elf_check.c - reads a plugin's ELF headers and dynamic symbols with pread,
 * bounds-checking every offset against the file size, so that a truncated or
 * forged file, or a shared object that is not a plugin, is refused before
 * dlopen maps it or runs its constructors. Threads: any; no state. */
#include "plugin/elf_check_internal.h"

#include <elf.h>
#include <errno.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__x86_64__)
#define HOST_MACHINE EM_X86_64
#elif defined(__aarch64__)
#define HOST_MACHINE EM_AARCH64
#elif defined(__powerpc64__)
#define HOST_MACHINE EM_PPC64
#elif defined(__riscv)
#define HOST_MACHINE EM_RISCV
#elif defined(__s390x__)
#define HOST_MACHINE EM_S390
#endif

#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define HOST_DATA ELFDATA2LSB
#else
#define HOST_DATA ELFDATA2MSB
#endif

#define MAX_TABLE ((uint64_t)64 << 20) /* symbol and string tables larger than this are refused */

/* [off, off + len) lies inside a file of size bytes (no wrap). */
static int inside(uint64_t off, uint64_t len, uint64_t size) { return off <= size && len <= size - off; }

static int get(int fd, void *buf, uint64_t len, uint64_t off)
{
    uint8_t *p = buf;
    while (len) {
        ssize_t k = pread(fd, p, len, (off_t)off);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        p += k, off += (uint64_t)k, len -= (uint64_t)k;
    }
    return 0;
}

static int bad(loom_err *err, const char *path, const char *what)
{
    loom_err_set(err, LOOM_EPLUGIN, path, "not a usable shared object: %s", what);
    return loom_err_hint(err, "the file is truncated or damaged: rebuild the plugin (cc -shared -fPIC) and copy it "
                              "again");
}

/* The program headers, what dlopen maps: each segment inside the file, a
 * loadable segment and a dynamic section among them. */
static int check_segments(int fd, const char *path, const Elf64_Ehdr *h, uint64_t size, loom_err *err)
{
    if (h->e_phentsize != sizeof(Elf64_Phdr) || h->e_phnum == 0 || h->e_phnum == PN_XNUM)
        return bad(err, path, "bad program header table (size or count)");
    uint64_t phlen = (uint64_t)h->e_phnum * sizeof(Elf64_Phdr);
    if (!inside(h->e_phoff, phlen, size)) return bad(err, path, "the program headers lie past the end of the file");
    Elf64_Phdr ph[64];
    int has_load = 0, has_dynamic = 0;
    for (uint64_t i = 0; i < h->e_phnum; i += 64) {
        uint64_t k = h->e_phnum - i < 64 ? h->e_phnum - i : 64;
        if (get(fd, ph, k * sizeof *ph, h->e_phoff + i * sizeof *ph)) return bad(err, path, "cannot read the program headers");
        for (uint64_t j = 0; j < k; j++) {
            if (ph[j].p_type == PT_NULL) continue;
            if (!inside(ph[j].p_offset, ph[j].p_filesz, size)) {
                char m[128];
                snprintf(m, sizeof m, "segment %llu (bytes %llu..%llu) lies past the end of the file (%llu bytes)",
                         (unsigned long long)(i + j), (unsigned long long)ph[j].p_offset,
                         (unsigned long long)ph[j].p_offset + ph[j].p_filesz, (unsigned long long)size);
                return bad(err, path, m);
            }
            if (ph[j].p_type == PT_LOAD) {
                has_load = 1;
                if (ph[j].p_filesz > ph[j].p_memsz) return bad(err, path, "a segment's file size exceeds its memory size");
            }
            if (ph[j].p_type == PT_DYNAMIC) has_dynamic = 1;
        }
    }
    if (!has_load || !has_dynamic) return bad(err, path, "no loadable segment or no dynamic section");
    return LOOM_OK;
}

static int check_fd(int fd, const char *path, const char *entry, loom_err *err)
{
    struct stat st;
    if (fstat(fd, &st) < 0) return loom_err_set(err, LOOM_EPLUGIN, path, "cannot stat: %s", strerror(errno));
    uint64_t size = (uint64_t)st.st_size;
    Elf64_Ehdr h;
    memset(&h, 0, sizeof h);
    if (size < SELFMAG || get(fd, h.e_ident, SELFMAG, 0) || memcmp(h.e_ident, ELFMAG, SELFMAG) != 0)
        return loom_err_set(err, LOOM_EPLUGIN, path, "not a shared object (no ELF header)"),
               loom_err_hint(err, "a plugin is built with cc -shared -fPIC; remove other files from the plugin "
                                  "directories");
    if (size < EI_NIDENT || get(fd, h.e_ident, EI_NIDENT, 0)) return bad(err, path, "the ELF header is truncated");
    if (h.e_ident[EI_CLASS] != ELFCLASS64)
        return loom_err_set(err, LOOM_EPLUGIN, path, "a %s ELF file; this loom loads 64-bit plugins only",
                            h.e_ident[EI_CLASS] == ELFCLASS32 ? "32-bit" : "bad-class"),
               loom_err_hint(err, "rebuild the plugin for this machine");
    if (h.e_ident[EI_DATA] != HOST_DATA)
        return loom_err_set(err, LOOM_EPLUGIN, path, "an ELF file of the other byte order"),
               loom_err_hint(err, "rebuild the plugin for this machine");
    if (size < sizeof h || get(fd, &h, sizeof h, 0)) return bad(err, path, "the ELF header is truncated");
    if (h.e_type != ET_DYN)
        return loom_err_set(err, LOOM_EPLUGIN, path, "an ELF file but not a shared object (e_type %u)", h.e_type),
               loom_err_hint(err, "build the plugin with cc -shared -fPIC");
#ifdef HOST_MACHINE
    if (h.e_machine != HOST_MACHINE)
        return loom_err_set(err, LOOM_EPLUGIN, path, "built for ELF machine %u, this loom runs on machine %u",
                            h.e_machine, HOST_MACHINE),
               loom_err_hint(err, "rebuild the plugin on (or for) this machine");
#endif
    int rc = check_segments(fd, path, &h, size, err);
    if (rc) return rc;
    /* section table: where the dynamic symbols are */
    if (h.e_shnum == 0 || h.e_shentsize != sizeof(Elf64_Shdr))
        return bad(err, path, "no section table (a plugin keeps its section headers: do not sstrip it)");
    uint64_t shlen = (uint64_t)h.e_shnum * sizeof(Elf64_Shdr);
    if (!inside(h.e_shoff, shlen, size)) return bad(err, path, "the section table lies past the end of the file");
    Elf64_Shdr *sh = loom_alloc(shlen);
    if (!sh) return loom_err_set(err, LOOM_ENOMEM, path, "cannot allocate %llu bytes", (unsigned long long)shlen);
    if (get(fd, sh, shlen, h.e_shoff)) rc = bad(err, path, "cannot read the section table");
    int dynsym = -1;
    for (int i = 0; !rc && i < h.e_shnum; i++) {
        if (sh[i].sh_type != SHT_NOBITS && sh[i].sh_type != SHT_NULL && !inside(sh[i].sh_offset, sh[i].sh_size, size))
            rc = bad(err, path, "a section lies past the end of the file");
        if (sh[i].sh_type == SHT_DYNSYM && dynsym < 0) dynsym = i;
    }
    if (!rc && dynsym < 0) rc = bad(err, path, "no dynamic symbol table");
    Elf64_Sym *syms = NULL;
    char *str = NULL;
    if (!rc) {
        const Elf64_Shdr *ds = &sh[dynsym];
        const Elf64_Shdr *ss = ds->sh_link < h.e_shnum ? &sh[ds->sh_link] : NULL;
        if (ds->sh_entsize != sizeof(Elf64_Sym) || !ss || ss->sh_type != SHT_STRTAB || ds->sh_size > MAX_TABLE ||
            ss->sh_size > MAX_TABLE || ss->sh_size == 0)
            rc = bad(err, path, "a malformed dynamic symbol table");
        else if (!(syms = loom_alloc(ds->sh_size + 1)) || !(str = loom_alloc(ss->sh_size + 1)))
            rc = loom_err_set(err, LOOM_ENOMEM, path, "cannot allocate the symbol tables");
        else if (get(fd, syms, ds->sh_size, ds->sh_offset) || get(fd, str, ss->sh_size, ss->sh_offset))
            rc = bad(err, path, "cannot read the dynamic symbol table");
        int found = 0;
        for (uint64_t i = 0; !rc && !found && i < ds->sh_size / sizeof(Elf64_Sym); i++) {
            const Elf64_Sym *s = &syms[i];
            if (s->st_name >= ss->sh_size || s->st_shndx == SHN_UNDEF || ELF64_ST_TYPE(s->st_info) != STT_FUNC ||
                (ELF64_ST_BIND(s->st_info) != STB_GLOBAL && ELF64_ST_BIND(s->st_info) != STB_WEAK))
                continue;
            size_t left = ss->sh_size - s->st_name;
            found = strnlen(str + s->st_name, left) == strlen(entry) && !memcmp(str + s->st_name, entry, strlen(entry));
        }
        if (!rc && !found) {
            loom_err_set(err, LOOM_EPLUGIN, path, "no %s function: not a Loom plugin",
                         entry);
            rc = loom_err_hint(err, "a plugin defines `const loom_plugin *%s(void)` (plugins/loom_plugin.h)", entry);
        }
    }
    loom_free(syms);
    loom_free(str);
    loom_free(sh);
    return rc;
}

int loom_plugin_elf_check_(const char *path, const char *entry, loom_err *err)
{
    loom_err oe = {0};
    int fd = loom_open_regular(path, &oe);
    if (fd < 0) {
        loom_err_set(err, LOOM_EPLUGIN, path, "%s", oe.msg);
        if (oe.hint[0]) loom_err_hint(err, "%s", oe.hint);
        return LOOM_EPLUGIN;
    }
    int rc = check_fd(fd, path, entry, err);
    close(fd);
    return rc;
}
