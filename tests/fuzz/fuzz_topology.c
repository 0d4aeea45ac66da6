/* fuzz_topology.c - libFuzzer target for what the cluster topology parses
 * from the environment and the command line: TF_CONFIG (through
 * loom_cluster_resolve, so every check after the JSON runs too), Slurm's
 * hostlist and tasks-per-node syntax, and --task. The input's first byte
 * picks the parser; the rest is the text. Built and run by tests/fuzz/run.sh,
 * or by hand from the repository root:
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined -D_GNU_SOURCE -I appliance \
 *     tests/fuzz/fuzz_topology.c appliance/cluster/topology.c appliance/config/config.c \
 *     appliance/config/config_print.c appliance/core/[a-z]*.c -lconfig -ljansson -lcrypto -lz -lm -lpthread \
 *     -o /tmp/fuzz_topology
 *   /tmp/fuzz_topology -max_total_time=30 /tmp/corpus_topology tests/fuzz/corpus/topology
 * Invariants checked: no over-read or leak (ASan); a resolved cluster has
 * its task inside it and a rank consistent with its role; expanded host
 * names are non-empty and NUL-terminated within LOOM_HOST_MAX. */
#include "cluster/topology_internal.h"

#include <stdlib.h>
#include <string.h>

#define CHECK(c) do { if (!(c)) __builtin_trap(); } while (0)

static loom_spec *spec;
/* multi_worker_mirrored's roles (distribute describes them; the fuzzer links the cluster alone) */
static const loom_cluster_roles mwm_roles = {.use = {[LOOM_ROLE_PS] = LOOM_ROLE_REFUSED}};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size > 8192) return 0;
    if (!spec) {
        spec = calloc(1, sizeof *spec);
        if (!spec) return 0;
        spec->strategy.kind = LOOM_STRAT_MULTI_WORKER_MIRRORED;
        snprintf(spec->strategy.name, sizeof spec->strategy.name, "multi_worker_mirrored");
        spec->cluster.connect_timeout = 60;
        spec->cluster.heartbeat_timeout = 30;
        spec->cluster.port_base = 8888;
        spec->cluster.insecure = true;
    }
    char *text = malloc(size);
    if (!text) return 0;
    memcpy(text, data + 1, size - 1);
    text[size - 1] = 0;
    char why[512];
    switch (data[0] % 4) {
    case 0: {
        loom_hostname *h = NULL;
        int n = 0;
        if (loom_slurm_hostlist_(text, &h, &n, why, sizeof why) == 0) {
            CHECK(n >= 1 && h);
            for (int i = 0; i < n; i++) CHECK(h[i].s[0] && memchr(h[i].s, 0, LOOM_HOST_MAX));
        } else {
            CHECK(!h && why[0]);
        }
        loom_free(h);
        break;
    }
    case 1: {
        int counts[64];
        int n = loom_slurm_tasks_per_node_(text, counts, 64, why, sizeof why);
        CHECK(n == -1 || (n >= 1 && n <= 64));
        for (int i = 0; i < n; i++) CHECK(counts[i] >= 1);
        break;
    }
    case 2: {
        loom_role r;
        int idx;
        if (loom_task_parse_(text, &r, &idx, why, sizeof why) == 0) CHECK(r >= 0 && r < LOOM_ROLE_COUNT && idx >= 0);
        break;
    }
    default: {
        size_t len = strlen(text);
        char *var = malloc(len + 16);
        if (!var) break;
        snprintf(var, len + 16, "TF_CONFIG=%s", text);
        char *env[] = {var, NULL};
        loom_cluster *c = NULL;
        loom_err err = {0};
        if (loom_cluster_resolve_any(&c, spec, &mwm_roles, NULL, env, &err) == LOOM_OK && c) {
            CHECK(c->index < 0 || c->index < c->n_tasks[c->role]);
            CHECK(c->rank < c->n_train_ranks);
            CHECK(c->config_text != NULL);
        }
        loom_cluster_free(c);
        free(var);
        break;
    }
    }
    free(text);
    return 0;
}
