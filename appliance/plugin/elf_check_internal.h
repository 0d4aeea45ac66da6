/* elf_check_internal.h - checks a plugin file before dlopen: a whole, well-formed ELF
 * shared object for this machine that exports the entry point. Private to
 * plugin/ (and its fuzzer: it needs only core/). */
#ifndef LOOM_PLUGIN_ELF_CHECK_H
#define LOOM_PLUGIN_ELF_CHECK_H
#include "core/core.h"

/* LOOM_OK when path is a regular file holding an ELF shared object of this
 * machine's class, byte order and architecture whose header, program headers,
 * segments, section table and sections all lie inside the file (dlopen maps
 * them: a truncated file would fault, SIGBUS), and whose dynamic symbol table
 * defines the function `entry`. LOOM_EPLUGIN naming what is wrong otherwise.
 * Nothing of the file runs: its constructors run only at dlopen, after this. */
int loom_plugin_elf_check_(const char *path, const char *entry, loom_err *err);

#endif
