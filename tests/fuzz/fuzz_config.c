/* fuzz_config.c - libFuzzer target for the config loader: libconfig text plus
 * --set overrides, through parsing, the option tables, the wide-integer fixup
 * and the cross-field checks. The input is a config file; each line after a
 * line "#--set" is one override ("run.epochs=3"), at most 8. The file is
 * written to a scratch directory (so a relative @include stays inside it).
 * Built and run by tests/fuzz/run.sh, or by hand from the repository root:
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined -D_GNU_SOURCE -I appliance \
 *     tests/fuzz/fuzz_config.c appliance/config/config.c appliance/config/config_print.c \
 *     appliance/core/[a-z]*.c -lconfig -lz -lzstd -lm -ldl -lpthread -o /tmp/fuzz_config
 *   /tmp/fuzz_config -max_total_time=60 /tmp/corpus_config tests/fuzz/corpus/config
 * Invariants checked: no crash, leak or UB (sanitizers); a load either gives a
 * spec and no errors or no spec and 1 to LOOM_MAX_ERRORS errors, each naming
 * where ("file:line", "--set key" or the file) and saying what; a spec that
 * loads prints (loom check --print) to a config that loads again and prints
 * the same. */
#include "config/config.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define CHECK(c) do { if (!(c)) __builtin_trap(); } while (0)
#define MAX_SETS 8

static char dir[64], cfg[96], again[96];

static int write_file(const char *path, const uint8_t *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    int ok = fwrite(p, 1, n, f) == n;
    return fclose(f) == 0 && ok ? 0 : -1;
}

static void check_errs(int rc, const loom_spec *s, const loom_errlist *errs)
{
    if (rc == LOOM_OK) {
        CHECK(s && errs->n == 0);
        return;
    }
    CHECK(!s && errs->n >= 1 && errs->n <= LOOM_MAX_ERRORS);
    for (int i = 0; i < errs->n; i++) {
        CHECK(errs->e[i].code != LOOM_OK && errs->e[i].msg[0]);
        CHECK(errs->e[i].where[0] || errs->e[i].code == LOOM_ENOMEM);
    }
}

/* The printed form of s in a malloc'd string. */
static char *printed(const loom_spec *s, size_t *n)
{
    char *buf = NULL;
    FILE *f = open_memstream(&buf, n);
    if (!f) return NULL;
    loom_config_print(s, f);
    fclose(f);
    return buf;
}

static void cleanup(void)
{
    unlink(cfg);
    unlink(again);
    rmdir(dir);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!dir[0]) {
        snprintf(dir, sizeof dir, "/tmp/loom-fuzz-config.XXXXXX");
        if (!mkdtemp(dir)) abort();
        atexit(cleanup);
        snprintf(cfg, sizeof cfg, "%s/c.cfg", dir);
        snprintf(again, sizeof again, "%s/again.cfg", dir);
    }
    /* split off the overrides */
    char *text = malloc(size + 1);
    if (!text) return 0;
    memcpy(text, data, size);
    text[size] = 0;
    const char *sets[MAX_SETS];
    int n_sets = 0;
    size_t file_len = size;
    char *mark = strstr(text, "#--set\n");
    if (mark) {
        file_len = (size_t)(mark - text);
        char *p = mark + 7;
        while (*p && n_sets < MAX_SETS) {
            char *nl = strchr(p, '\n');
            if (nl) *nl = 0;
            sets[n_sets++] = p;
            if (!nl) break;
            p = nl + 1;
        }
    }
    if (write_file(cfg, (const uint8_t *)text, file_len)) {
        free(text);
        return 0;
    }

    loom_spec *s = NULL;
    loom_errlist errs;
    int rc = loom_config_load(&s, cfg, sets, n_sets, &errs);
    check_errs(rc, s, &errs);
    if (rc == LOOM_OK) {
        /* print -> load -> print is a fixed point */
        size_t n1 = 0, n2 = 0;
        char *p1 = printed(s, &n1);
        if (p1 && !write_file(again, (const uint8_t *)p1, n1)) {
            loom_spec *s2 = NULL;
            int rc2 = loom_config_load(&s2, again, NULL, 0, &errs);
            if (rc2 != LOOM_OK) {
                fprintf(stderr, "printed config does not load again:\n%s\n", p1);
                for (int i = 0; i < errs.n; i++) fprintf(stderr, "%s: %s\n", errs.e[i].where, errs.e[i].msg);
            }
            CHECK(rc2 == LOOM_OK);
            char *p2 = printed(s2, &n2);
            /* the first line names the file printed */
            const char *b1 = p1 ? strchr(p1, '\n') : NULL, *b2 = p2 ? strchr(p2, '\n') : NULL;
            bool same = b1 && b2 && !strcmp(b1, b2);
            if (p2 && !same) fprintf(stderr, "print is not a fixed point:\n%s\n----\n%s\n", p1, p2);
            CHECK(!p2 || same);
            free(p2);
            loom_config_free(s2);
        }
        free(p1);
        loom_config_free(s);
    }
    free(text);
    return 0;
}
