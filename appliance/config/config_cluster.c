/* config_cluster.c - the cluster section: the tasks by role ("host:port"),
 * timeouts, the secret and TLS files.
 * Threads: none. */
#include "config/config_internal.h"

#include <errno.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

static void parse_cluster_role(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_cluster_path(cfg_ctx *c, const config_setting_t *s, void *base);

const char *const loom_cluster_role_keys[LOOM_CLUSTER_ROLES + 1] = {"chief", "worker", "ps", "evaluator", NULL};

static const cfg_opt cluster_opts[] = {
    O_CUSTOM("chief", parse_cluster_role, ALL, 0, "[\"host:port\"]: at most one task that coordinates"),
    O_CUSTOM("worker", parse_cluster_role, ALL, 0, "[\"host:port\", ...]: the tasks that train"),
    O_CUSTOM("ps", parse_cluster_role, ALL, 0, "[\"host:port\", ...]: parameter servers"),
    O_CUSTOM("evaluator", parse_cluster_role, ALL, 0, "[\"host:port\"]: a task that evaluates checkpoints"),
    O_F64(loom_cluster_spec, "connect_timeout", connect_timeout, 60.0, 0.0, 0, F_LO_OPEN | F_NO_HI, ALL, 0,
          "seconds to keep retrying a peer that is not up yet"),
    O_F64(loom_cluster_spec, "heartbeat_timeout", heartbeat_timeout, 30.0, 0.0, 0, F_LO_OPEN | F_NO_HI, ALL, 0,
          "seconds of silence after which a peer is declared lost"),
    O_F64(loom_cluster_spec, "heartbeat_interval", heartbeat_interval, 0.0, 0.0, 0, F_NO_HI, ALL, 0,
          "seconds between heartbeats; 0 = heartbeat_timeout / 5"),
    O_CUSTOM("secret_file", parse_cluster_path, ALL, 0, "file holding the shared secret (or $LOOM_CLUSTER_SECRET)"),
    O_BOOL(loom_cluster_spec, "tls", tls, 0, ALL, "TLS on every connection (needs tls_cert, tls_key, tls_ca)"),
    O_CUSTOM("tls_cert", parse_cluster_path, ALL, 0, "this task's certificate (PEM)"),
    O_CUSTOM("tls_key", parse_cluster_path, ALL, 0, "this task's private key (PEM)"),
    O_CUSTOM("tls_ca", parse_cluster_path, ALL, 0, "the CA that signed every task's certificate (PEM)"),
    O_BOOL(loom_cluster_spec, "insecure", insecure, 0, ALL, "allow non-loopback addresses without a secret"),
    O_INT(loom_cluster_spec, "port_base", port_base, 8888, 1, 65535, ALL, 0,
          "Slurm: the k-th task on a node listens on port_base + k"),
    O_END,
};

/* ---- cluster --------------------------------------------------------------- */

int loom_addr_parse(const char *addr, char *host, size_t n, int *port, const char **why)
{
    const char *colon, *h = addr;
    size_t hl;
    if (addr[0] == '[') {
        const char *close = strchr(addr, ']');
        if (!close) return *why = "an IPv6 address needs its closing ']'", -1;
        h = addr + 1;
        hl = (size_t)(close - h);
        if (hl == 0) return *why = "empty IPv6 address in [...]", -1;
        for (size_t i = 0; i < hl; i++)
            if (!strchr("0123456789abcdefABCDEF:.", h[i]))
                return *why = "an IPv6 address in [...] has only hex digits, ':' and '.'", -1;
        if (close[1] != ':') return *why = "expected \"[address]:port\"", -1;
        colon = close + 1;
    } else {
        colon = strrchr(addr, ':');
        if (!colon) return *why = "missing \":port\" (expected \"host:port\")", -1;
        if (memchr(addr, ':', (size_t)(colon - addr)))
            return *why = "several ':' (write an IPv6 address as \"[addr]:port\")", -1;
        hl = (size_t)(colon - addr);
        if (hl == 0) return *why = "empty host (expected \"host:port\")", -1;
        if (hl > 253) return *why = "host name longer than 253 characters", -1;
        for (size_t i = 0; i < hl; i++) {
            char ch = addr[i];
            bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '-' ||
                      ch == '.' || ch == '_';
            if (!ok) return *why = "a host name has only letters, digits, '-', '_' and '.'", -1;
        }
        if (addr[0] == '-' || addr[0] == '.') return *why = "a host name cannot start with '-' or '.'", -1;
    }
    const char *p = colon + 1;
    long v = 0;
    if (!*p) return *why = "empty port (expected \"host:port\")", -1;
    for (; *p; p++) {
        if (*p < '0' || *p > '9') return *why = "the port is not a decimal number", -1;
        v = v * 10 + (*p - '0');
        if (v > 65535) break;
    }
    if (v < 1 || v > 65535) return *why = "the port must be in [1, 65535]", -1;
    if (hl >= n) return *why = "host name too long", -1;
    if (host) {
        memcpy(host, h, hl);
        host[hl] = 0;
    }
    if (port) *port = (int)v;
    return 0;
}

/* cluster.chief / worker / ps / evaluator: a list of "host:port" strings. */
static void parse_cluster_role(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_cluster_spec *cl = base;
    int role = cfg_find_name_(loom_cluster_role_keys, config_setting_name(s));
    LOOM_ASSERT(role >= 0);
    cfg_loc_of_(c, s, &cl->role_loc[role]);
    int n = cfg_string_list_(c, s, LOOM_MAX_CLUSTER_TASKS, "addresses \"host:port\"");
    bool one = config_setting_type(s) == CONFIG_TYPE_STRING;
    if (n > 1 && role == 0) {
        loom_err *e = cfg_err_(c, s, "a cluster has at most one chief, got %d", n);
        if (e) loom_err_hint(e, "list the others under worker");
        return;
    }
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = one ? s : config_setting_get_elem(s, i);
        const char *a = config_setting_get_string(e), *why = NULL;
        if (strlen(a) >= LOOM_ADDR_MAX || loom_addr_parse(a, NULL, 256, NULL, &why)) {
            loom_err *er = cfg_err_(c, e, "bad address \"%s\": %s", a, why ? why : "too long");
            if (er) loom_err_hint(er, "e.g. \"10.0.0.2:2222\", \"node01:2222\" or \"[::1]:2222\"");
            continue;
        }
        int k = cl->n_tasks[role]++;
        snprintf(cl->addr[role][k], sizeof cl->addr[role][k], "%s", a);
        char where[300];
        cfg_where_of_(c, e, where, sizeof where, &cl->addr_line[role][k]);
    }
}

/* cluster.secret_file, tls_cert, tls_key, tls_ca: a file, relative to the
 * config's directory, that must exist and be readable. */
static void parse_cluster_path(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_cluster_spec *cl = base;
    const char *key = config_setting_name(s);
    char *dst = !strcmp(key, "secret_file") ? cl->secret_file
                : !strcmp(key, "tls_cert")  ? cl->tls_cert
                : !strcmp(key, "tls_key")   ? cl->tls_key
                                            : cl->tls_ca;
    char v[300];
    if (config_setting_type(s) != CONFIG_TYPE_STRING || !config_setting_get_string(s)[0]) {
        cfg_err_(c, s, "expected a file name, got %s", cfg_value_str_(s, v, sizeof v));
        return;
    }
    const char *f = config_setting_get_string(s);
    int w = f[0] == '/' ? snprintf(dst, LOOM_PATH_MAX, "%s", f) : snprintf(dst, LOOM_PATH_MAX, "%s/%s", c->dir, f);
    if (w < 0 || w >= LOOM_PATH_MAX) {
        dst[0] = 0;
        cfg_err_(c, s, "file name \"%s\" is too long", f);
    } else if (access(dst, R_OK) != 0) {
        loom_err *e = cfg_err_(c, s, "cannot read \"%s\" (resolved to %s): %s", f, dst, strerror(errno));
        if (e) loom_err_hint(e, "relative paths are relative to the config file's directory");
    }
}

/* Two tasks on one address: compared as written, host names without case. */
static void check_cluster_duplicates(cfg_ctx *c, const config_setting_t *g, const loom_cluster_spec *cl)
{
    for (int r = 0; r < LOOM_CLUSTER_ROLES; r++)
        for (int i = 0; i < cl->n_tasks[r]; i++)
            for (int r2 = 0; r2 <= r; r2++)
                for (int j = 0; j < (r2 == r ? i : cl->n_tasks[r2]); j++) {
                    if (strcasecmp(cl->addr[r][i], cl->addr[r2][j])) continue;
                    const config_setting_t *lst = config_setting_get_member(g, loom_cluster_role_keys[r]);
                    const config_setting_t *e = lst && config_setting_type(lst) != CONFIG_TYPE_STRING
                                                    ? config_setting_get_elem(lst, (unsigned)i) : lst;
                    loom_err *er = cfg_err_(c, e ? e : g, "duplicate address \"%s\": %s:%d has it too (line %d)",
                                        cl->addr[r][i], loom_cluster_role_keys[r2], j, cl->addr_line[r2][j]);
                    if (er) loom_err_hint(er, "every task listens on an address of its own");
                    goto next;
                }
next:;
}

void cfg_parse_cluster_(cfg_ctx *c, const config_setting_t *root, loom_cluster_spec *cl)
{
    const config_setting_t *g = cfg_sub_group_(c, root, "cluster");
    cfg_opts_default_(cluster_opts, cl);
    if (!g) {
        snprintf(cl->loc.file, sizeof cl->loc.file, "%s", c->path);
        snprintf(cl->loc.path, sizeof cl->loc.path, "cluster");
        return;
    }
    cl->present = true;
    cfg_loc_of_(c, g, &cl->loc);
    for (int r = 0; r < LOOM_CLUSTER_ROLES; r++) cl->role_loc[r] = cl->loc;
    cfg_parse_opts_(c, g, cluster_opts, 0, cl);
    cfg_scope sc = {cluster_opts, 0, NULL};
    cfg_check_keys_(c, g, &sc, 1);
    check_cluster_duplicates(c, g, cl);
    if (cl->tls) {
        const char *need[] = {"tls_cert", "tls_key", "tls_ca"};
        for (int i = 0; i < 3; i++)
            if (!config_setting_get_member(g, need[i])) {
                loom_err *e = cfg_err_(c, config_setting_get_member(g, "tls"), "tls = true needs %s", need[i]);
                if (e) loom_err_hint(e, "give tls_cert, tls_key and tls_ca (PEM files), or set tls = false");
            }
    }
    const config_setting_t *hi = config_setting_get_member(g, "heartbeat_interval");
    if (hi && cl->heartbeat_interval >= cl->heartbeat_timeout)
        cfg_err_(c, hi, "heartbeat_interval (%g s) must be shorter than heartbeat_timeout (%g s)",
                 cl->heartbeat_interval, cl->heartbeat_timeout);
}
