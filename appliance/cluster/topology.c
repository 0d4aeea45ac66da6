/* topology.c - who plays which task, and where every task listens: the
 * config's cluster section, --task, TF_CONFIG (Kubeflow's TFJob), Slurm's
 * srun environment and Open MPI / PMIx / Hydra ranks, into one immutable
 * loom_cluster. Every check runs here, before any socket opens; names are
 * only checked for syntax (the transport resolves them).
 * Threads: none. Ownership: loom_cluster_resolve's result is freed with
 * loom_cluster_free. */
#include "cluster/cluster.h"
#include "cluster/topology_internal.h"

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <openssl/evp.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

extern char **environ;

/* ---- names --------------------------------------------------------------- */

static const char *const role_names[] = {"chief", "worker", "ps", "evaluator", NULL};

const char *loom_role_name(loom_role r) { return r >= 0 && r < LOOM_ROLE_COUNT ? role_names[r] : "?"; }

int loom_role_parse(const char *name)
{
    for (int i = 0; i < LOOM_ROLE_COUNT; i++)
        if (!strcmp(name, role_names[i])) return i;
    return -1;
}

char *loom_task_name(loom_role role, int index, char *buf, size_t n)
{
    snprintf(buf, n, "%s:%d", loom_role_name(role), index);
    return buf;
}

const char *loom_cluster_from_name(loom_cluster_from f)
{
    switch (f) {
    case LOOM_FROM_NONE: return "none";
    case LOOM_FROM_CONFIG: return "the config's cluster section";
    case LOOM_FROM_FLAG: return "--task";
    case LOOM_FROM_TF_CONFIG: return "TF_CONFIG";
    case LOOM_FROM_SLURM: return "Slurm";
    case LOOM_FROM_MPI: return "MPI";
    case LOOM_FROM_LAUNCH: return "loom launch";
    }
    return "?";
}

int loom_cluster_train_slots(const loom_cluster *c)
{
    return c->n_train_slots > c->n_train_ranks ? c->n_train_slots : c->n_train_ranks;
}

const loom_task_addr *loom_cluster_rank_task(const loom_cluster *c, int rank)
{
    LOOM_ASSERT(c && rank >= 0 && rank < loom_cluster_train_slots(c));
    int chiefs = c->n_tasks[LOOM_ROLE_CHIEF];
    if (rank < chiefs) return &c->tasks[LOOM_ROLE_CHIEF][rank];
    return &c->tasks[LOOM_ROLE_WORKER][rank - chiefs];
}

/* ---- small parsers ------------------------------------------------------- */

/* "did you mean" for a role name. */
static const char *near_role(const char *s)
{
    const char *best = NULL;
    int bd = 3;
    for (int i = 0; role_names[i]; i++) {
        int d = loom_edit_distance(s, role_names[i]);
        if (d < bd && d < (int)strlen(s)) bd = d, best = role_names[i];
    }
    return best;
}

int loom_task_parse_(const char *s, loom_role *role, int *index, char *why, size_t why_n)
{
    const char *colon = strchr(s, ':');
    char name[32];
    if (!colon) {
        snprintf(why, why_n, "expected ROLE:INDEX such as \"worker:1\", got \"%s\"", s);
        return -1;
    }
    snprintf(name, sizeof name, "%.*s", (int)(colon - s) < 31 ? (int)(colon - s) : 31, s);
    int r = loom_role_parse(name);
    if (r < 0) {
        const char *near = near_role(name);
        snprintf(why, why_n, "unknown role \"%s\" in \"%s\" (expected chief, worker, ps or evaluator)%s%s%s", name, s,
                 near ? "; did you mean \"" : "", near ? near : "", near ? "\"?" : "");
        return -1;
    }
    char *end;
    errno = 0;
    long v = strtol(colon + 1, &end, 10);
    if (end == colon + 1 || *end || colon[1] == '+' || colon[1] == '-') {
        snprintf(why, why_n, "the index in \"%s\" must be an integer >= 0", s);
        return -1;
    }
    if (errno || v >= LOOM_MAX_CLUSTER_TASKS) { /* (a number strtol cannot hold is out of range too) */
        snprintf(why, why_n, "the index in \"%s\" is out of range: expected 0 to %d (a cluster has at most %d tasks "
                 "of a role)", s, LOOM_MAX_CLUSTER_TASKS - 1, LOOM_MAX_CLUSTER_TASKS);
        return -1;
    }
    *role = (loom_role)r;
    *index = (int)v;
    return 0;
}

bool loom_host_is_loopback_(const char *host)
{
    if (!strcasecmp(host, "localhost") || !strcasecmp(host, "localhost.localdomain") || !strcmp(host, "::1") ||
        !strcmp(host, "0:0:0:0:0:0:0:1"))
        return true;
    unsigned a, b, c, d;
    char tail;
    return sscanf(host, "%u.%u.%u.%u%c", &a, &b, &c, &d, &tail) == 4 && a == 127 && b < 256 && c < 256 && d < 256;
}

static bool host_char(char ch)
{
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '-' ||
           ch == '.' || ch == '_';
}

/* ---- Slurm --------------------------------------------------------------- */

typedef struct hostvec {
    loom_hostname *v;
    int            n, cap;
} hostvec;

static int hv_push(hostvec *h, const char *s, size_t len)
{
    if (h->n == LOOM_SLURM_MAX_HOSTS || len >= LOOM_HOST_MAX) return -1;
    if (h->n == h->cap) {
        int cap = h->cap ? h->cap * 2 : 16;
        loom_hostname *v = loom_realloc(h->v, (size_t)cap * sizeof *v);
        if (!v) return -1;
        h->v = v;
        h->cap = cap;
    }
    memcpy(h->v[h->n].s, s, len);
    h->v[h->n].s[len] = 0;
    h->n++;
    return 0;
}

/* Expands item[pos..end) after the already built prefix pre (plen bytes):
 * each [ranges] group multiplies the names, left to right. base is item's
 * offset in the whole list, for messages. */
static int expand_item(const char *list, int pos, int end, char *pre, size_t plen, hostvec *out, char *why,
                       size_t why_n)
{
    int lb = pos;
    while (lb < end && list[lb] != '[') lb++;
    for (int i = pos; i < lb; i++)
        if (!host_char(list[i])) {
            snprintf(why, why_n, "unexpected '%c' at byte %d (a host name has only letters, digits, '-', '_', '.')",
                     list[i], i);
            return -1;
        }
    size_t l0 = plen + (size_t)(lb - pos);
    if (l0 >= LOOM_HOST_MAX) {
        snprintf(why, why_n, "a host name longer than %d bytes at byte %d", LOOM_HOST_MAX - 1, pos);
        return -1;
    }
    memcpy(pre + plen, list + pos, (size_t)(lb - pos));
    if (lb == end) {
        if (l0 == 0) {
            snprintf(why, why_n, "empty host name at byte %d", pos);
            return -1;
        }
        if (hv_push(out, pre, l0)) {
            snprintf(why, why_n, "more than %d hosts (or out of memory)", LOOM_SLURM_MAX_HOSTS);
            return -1;
        }
        return 0;
    }
    int rb = lb + 1;
    while (rb < end && list[rb] != ']') {
        if (list[rb] == '[') {
            snprintf(why, why_n, "nested '[' at byte %d", rb);
            return -1;
        }
        rb++;
    }
    if (rb == end) {
        snprintf(why, why_n, "'[' at byte %d is never closed", lb);
        return -1;
    }
    if (rb == lb + 1) {
        snprintf(why, why_n, "empty range \"[]\" at byte %d", lb);
        return -1;
    }
    /* each comma-separated range of the group */
    for (int r = lb + 1; r < rb;) {
        int re = r;
        while (re < rb && list[re] != ',') re++;
        int dash = -1;
        for (int i = r; i < re; i++) {
            if (list[i] == '-' && dash < 0 && i > r) {
                dash = i;
            } else if (list[i] < '0' || list[i] > '9') {
                snprintf(why, why_n, "expected a number or a range like 01-04 at byte %d, got '%c'", i, list[i]);
                return -1;
            }
        }
        if (re == r || dash == re - 1) {
            snprintf(why, why_n, "empty number in the range at byte %d", re == r ? r : re);
            return -1;
        }
        int lo_end = dash < 0 ? re : dash;
        int width = lo_end - r;
        if (width > 9 || (dash >= 0 && re - dash - 1 > 9)) {
            snprintf(why, why_n, "a number longer than 9 digits at byte %d", r);
            return -1;
        }
        long lo = strtol(list + r, NULL, 10), hi = dash < 0 ? lo : strtol(list + dash + 1, NULL, 10);
        if (hi < lo) {
            snprintf(why, why_n, "range %.*s at byte %d runs backwards", re - r, list + r, r);
            return -1;
        }
        if (hi - lo >= LOOM_SLURM_MAX_HOSTS) {
            snprintf(why, why_n, "range %.*s at byte %d is longer than %d hosts", re - r, list + r, r,
                     LOOM_SLURM_MAX_HOSTS);
            return -1;
        }
        for (long v = lo; v <= hi; v++) {
            char num[16];
            int nl = snprintf(num, sizeof num, "%0*ld", width, v);
            if (l0 + (size_t)nl >= LOOM_HOST_MAX) {
                snprintf(why, why_n, "a host name longer than %d bytes at byte %d", LOOM_HOST_MAX - 1, lb);
                return -1;
            }
            memcpy(pre + l0, num, (size_t)nl);
            if (expand_item(list, rb + 1, end, pre, l0 + (size_t)nl, out, why, why_n)) return -1;
        }
        r = re + 1;
        if (re < rb && r == rb) {
            snprintf(why, why_n, "empty number in the range at byte %d", re);
            return -1;
        }
    }
    return 0;
}

int loom_slurm_hostlist_(const char *list, loom_hostname **hosts, int *n, char *why, size_t why_n)
{
    hostvec out = {0};
    char pre[LOOM_HOST_MAX];
    int len = (int)strlen(list);
    *hosts = NULL;
    *n = 0;
    if (len == 0) {
        snprintf(why, why_n, "empty node list");
        return -1;
    }
    for (int i = 0; i <= len;) {
        int e = i, depth = 0;
        while (e < len && (list[e] != ',' || depth)) {
            if (list[e] == '[') depth++;
            if (list[e] == ']') {
                if (!depth) {
                    snprintf(why, why_n, "']' at byte %d without its '['", e);
                    loom_free(out.v);
                    return -1;
                }
                depth--;
            }
            e++;
        }
        if (e == i) {
            snprintf(why, why_n, "empty host name at byte %d", i);
            loom_free(out.v);
            return -1;
        }
        if (expand_item(list, i, e, pre, 0, &out, why, why_n)) {
            loom_free(out.v);
            return -1;
        }
        if (e == len) break;
        i = e + 1;
        if (i == len) {
            snprintf(why, why_n, "empty host name at byte %d (a trailing ',')", i);
            loom_free(out.v);
            return -1;
        }
    }
    *hosts = out.v;
    *n = out.n;
    return 0;
}

int loom_slurm_tasks_per_node_(const char *s, int *counts, int max, char *why, size_t why_n)
{
    int n = 0;
    const char *p = s;
    if (!*p) {
        snprintf(why, why_n, "empty");
        return -1;
    }
    while (*p) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v < 1 || v > 65536 || *p == '-' || *p == '+') {
            snprintf(why, why_n, "expected a task count at byte %d", (int)(p - s));
            return -1;
        }
        long rep = 1;
        p = end;
        if (*p == '(') {
            if (p[1] != 'x') {
                snprintf(why, why_n, "expected \"(xN)\" at byte %d", (int)(p - s));
                return -1;
            }
            rep = strtol(p + 2, &end, 10);
            if (end == p + 2 || *end != ')' || rep < 1 || rep > LOOM_SLURM_MAX_HOSTS) {
                snprintf(why, why_n, "expected \"(xN)\" at byte %d", (int)(p - s));
                return -1;
            }
            p = end + 1;
        }
        for (long k = 0; k < rep; k++) {
            if (n == max) {
                snprintf(why, why_n, "more than %d nodes", max);
                return -1;
            }
            counts[n++] = (int)v;
        }
        if (*p == ',') {
            p++;
            if (!*p) {
                snprintf(why, why_n, "a trailing ','");
                return -1;
            }
        } else if (*p) {
            snprintf(why, why_n, "unexpected '%c' at byte %d", *p, (int)(p - s));
            return -1;
        }
    }
    return n;
}

/* ---- the environment ----------------------------------------------------- */

static const char *env_get(char *const *envp, const char *name)
{
    if (!envp) envp = environ;
    size_t n = strlen(name);
    for (char *const *e = envp; e && *e; e++)
        if (!strncmp(*e, name, n) && (*e)[n] == '=') return *e + n + 1;
    return NULL;
}

/* An environment integer in [lo, hi]; -1 with an error when malformed. */
static int env_int(char *const *envp, const char *name, long lo, long hi, long *out, loom_err *err)
{
    const char *v = env_get(envp, name);
    if (!v) return 0;
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (end == v || *end || errno || x < lo || x > hi) {
        loom_err_set(err, LOOM_ECONFIG, name, "expected an integer in [%ld, %ld], got \"%s\"", lo, hi, v);
        return -1;
    }
    *out = x;
    return 1;
}

/* ---- building the task table --------------------------------------------- */

/* Appends one task of role from "host:port" (already checked when it came
 * from the config); where names the source for an error. */
static int add_task(loom_cluster *c, loom_role role, const char *addr, const char *where, const char *what,
                    loom_err *err)
{
    char host[LOOM_HOST_MAX];
    int port;
    const char *why = NULL;
    if (strlen(addr) >= LOOM_ADDR_MAX || loom_addr_parse(addr, host, sizeof host, &port, &why)) {
        loom_err_set(err, LOOM_ECONFIG, where, "%s: bad address \"%s\": %s", what, addr, why ? why : "too long");
        return loom_err_hint(err, "e.g. \"10.0.0.2:2222\", \"node01:2222\" or \"[::1]:2222\"");
    }
    int k = c->n_tasks[role];
    loom_task_addr *t = loom_realloc(c->tasks[role], (size_t)(k + 1) * sizeof *t);
    if (!t) return loom_err_set(err, LOOM_ENOMEM, where, "out of memory");
    c->tasks[role] = t;
    t[k] = (loom_task_addr){.role = role, .index = k, .port = port};
    snprintf(t[k].host, sizeof t[k].host, "%s", host);
    c->n_tasks[role] = k + 1;
    return LOOM_OK;
}

static int total_tasks(const loom_cluster *c)
{
    int n = 0;
    for (int r = 0; r < LOOM_ROLE_COUNT; r++) n += c->n_tasks[r];
    return n;
}

/* The r-th task in the order chief, workers, ps, evaluators (the rank order
 * of Slurm and MPI). */
static void nth_task(const loom_cluster *c, int r, loom_role *role, int *index)
{
    for (int k = 0; k < LOOM_ROLE_COUNT; k++) {
        if (r < c->n_tasks[k]) {
            *role = (loom_role)k;
            *index = r;
            return;
        }
        r -= c->n_tasks[k];
    }
    LOOM_ASSERT(!"rank past the cluster");
}

/* "host:port" of a task as it would be written. */
static const char *addr_str(const loom_task_addr *t, char *buf, size_t n)
{
    snprintf(buf, n, strchr(t->host, ':') ? "[%s]:%d" : "%s:%d", t->host, t->port);
    return buf;
}

/* "configs/x.cfg:8" for the config's role list entry i (or the section). */
static const char *cfg_where(const loom_cluster_spec *cs, int role, int i, char *buf, size_t n)
{
    int line = i >= 0 && i < cs->n_tasks[role] ? cs->addr_line[role][i] : 0;
    if (line > 0) {
        snprintf(buf, n, "%s:%d", cs->role_loc[role].file, line);
        return buf;
    }
    return loom_loc_str(&cs->role_loc[role], buf, n);
}

/* ---- TF_CONFIG ----------------------------------------------------------- */

typedef struct tf_config {
    bool    has_cluster, has_task;
    int     n[LOOM_ROLE_COUNT];
    json_t *list[LOOM_ROLE_COUNT]; /* borrowed from root */
    int     role, index;
    json_t *root;
} tf_config;

/* Parses TF_CONFIG as TensorFlow reads it: {"cluster": {ROLE: ["host:port", ...]},
 * "task": {"type": ROLE, "index": I}, "environment": ..., "rpc_layer": ...}.
 * "master" is the old name of the chief. Unset, "" and "{}" are no TF_CONFIG. */
static int tf_config_parse(const char *text, tf_config *tf, loom_err *err)
{
    memset(tf, 0, sizeof *tf);
    tf->role = tf->index = -1;
    json_error_t je;
    json_t *root = json_loads(text, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        loom_err_set(err, LOOM_ECONFIG, "TF_CONFIG", "invalid JSON at byte %d (line %d, column %d): %s", je.position,
                     je.line, je.column, je.text);
        return loom_err_hint(err, "TF_CONFIG is JSON: {\"cluster\": {\"worker\": [\"h1:2222\", \"h2:2222\"]}, "
                                  "\"task\": {\"type\": \"worker\", \"index\": 0}}");
    }
    tf->root = root;
    if (!json_is_object(root)) {
        json_decref(root);
        tf->root = NULL;
        return loom_err_set(err, LOOM_ECONFIG, "TF_CONFIG", "expected a JSON object {\"cluster\": ..., \"task\": ...}");
    }
    json_t *cl = json_object_get(root, "cluster");
    if (cl && !json_is_object(cl))
        return loom_err_set(err, LOOM_ECONFIG, "TF_CONFIG", "\"cluster\" must be an object {\"worker\": [...], ...}");
    if (cl && json_object_size(cl) > 0) {
        tf->has_cluster = true;
        const char *key;
        json_t *v;
        json_object_foreach(cl, key, v)
        {
            int r = !strcmp(key, "master") ? LOOM_ROLE_CHIEF : loom_role_parse(key);
            if (r < 0) {
                const char *near = near_role(key);
                loom_err_set(err, LOOM_ECONFIG, "TF_CONFIG", "cluster: unknown role \"%s\" (expected chief, worker, ps "
                             "or evaluator)", key);
                return near ? loom_err_hint(err, "did you mean \"%s\"?", near) : LOOM_ECONFIG;
            }
            if (tf->list[r])
                return loom_err_set(err, LOOM_ECONFIG, "TF_CONFIG", "cluster: \"%s\" and \"%s\" both name the chief",
                                    "chief", "master");
            if (!json_is_array(v))
                return loom_err_set(err, LOOM_ECONFIG, "TF_CONFIG", "cluster.%s must be a list of \"host:port\"", key);
            for (size_t i = 0; i < json_array_size(v); i++)
                if (!json_is_string(json_array_get(v, i)))
                    return loom_err_set(err, LOOM_ECONFIG, "TF_CONFIG", "cluster.%s[%zu] must be a string \"host:port\"",
                                        key, i);
            tf->list[r] = v;
            tf->n[r] = (int)json_array_size(v);
        }
    }
    json_t *task = json_object_get(root, "task");
    if (task && !json_is_object(task))
        return loom_err_set(err, LOOM_ECONFIG, "TF_CONFIG", "\"task\" must be an object {\"type\": ..., \"index\": ...}");
    if (task && json_object_size(task) > 0) {
        json_t *ty = json_object_get(task, "type"), *ix = json_object_get(task, "index");
        if (!json_is_string(ty))
            return loom_err_set(err, LOOM_ECONFIG, "TF_CONFIG", "task.type must be a string (chief, worker, ps or "
                                "evaluator)");
        const char *tn = json_string_value(ty);
        int r = !strcmp(tn, "master") ? LOOM_ROLE_CHIEF : loom_role_parse(tn);
        if (r < 0) {
            const char *near = near_role(tn);
            loom_err_set(err, LOOM_ECONFIG, "TF_CONFIG", "task.type: unknown role \"%s\" (expected chief, worker, ps or "
                         "evaluator)", tn);
            return near ? loom_err_hint(err, "did you mean \"%s\"?", near) : LOOM_ECONFIG;
        }
        json_int_t idx = 0;
        if (ix && !json_is_integer(ix))
            return loom_err_set(err, LOOM_ECONFIG, "TF_CONFIG", "task.index must be an integer >= 0");
        if (ix) idx = json_integer_value(ix);
        if (idx < 0)
            return loom_err_set(err, LOOM_ECONFIG, "TF_CONFIG", "task.index must be an integer >= 0, got %lld",
                                (long long)idx);
        if (idx >= LOOM_MAX_CLUSTER_TASKS)
            return loom_err_set(err, LOOM_ECONFIG, "TF_CONFIG", "task.index %lld is out of range: expected 0 to %d (a "
                                "cluster has at most %d tasks of a role)", (long long)idx, LOOM_MAX_CLUSTER_TASKS - 1,
                                LOOM_MAX_CLUSTER_TASKS);
        tf->has_task = true;
        tf->role = r;
        tf->index = (int)idx;
    }
    return LOOM_OK;
}

/* TF_CONFIG's cluster and the config's role lists must be the same tasks. */
static int tf_vs_config(const tf_config *tf, const loom_cluster_spec *cs, loom_err *err)
{
    char w[LOOM_PATH_MAX + 16];
    for (int r = 0; r < LOOM_ROLE_COUNT; r++) {
        if (tf->n[r] != cs->n_tasks[r]) {
            loom_err_set(err, LOOM_ECONFIG, cfg_where(cs, r, -1, w, sizeof w),
                         "the config's cluster.%s lists %d task%s but TF_CONFIG's cluster.%s has %d", role_names[r],
                         cs->n_tasks[r], cs->n_tasks[r] == 1 ? "" : "s", role_names[r], tf->n[r]);
            return loom_err_hint(err, "TF_CONFIG and the config disagree: drop the cluster lists from the config "
                                      "(TF_CONFIG gives them) or make them equal");
        }
        for (int i = 0; i < tf->n[r]; i++) {
            const char *a = json_string_value(json_array_get(tf->list[r], (size_t)i));
            if (strcasecmp(a, cs->addr[r][i])) {
                loom_err_set(err, LOOM_ECONFIG, cfg_where(cs, r, i, w, sizeof w),
                             "cluster.%s[%d] is \"%s\" here but \"%s\" in TF_CONFIG", role_names[r], i, cs->addr[r][i],
                             a);
                return loom_err_hint(err, "TF_CONFIG and the config disagree: drop the cluster lists from the config "
                                          "(TF_CONFIG gives them) or make them equal");
            }
        }
    }
    return LOOM_OK;
}

/* ---- Slurm and MPI -------------------------------------------------------- */

typedef struct rank_env {
    bool  present;
    long  rank, size;
    char  where[96];   /* "SLURM_PROCID=3" */
} rank_env;

/* srun sets SLURM_PROCID, SLURM_NTASKS (or SLURM_STEP_NUM_TASKS) and
 * SLURM_STEP_NODELIST; a batch script's own environment has no step node
 * list, so it is not mistaken for task 0 of a job. */
static int slurm_env(char *const *envp, rank_env *s, loom_err *err)
{
    memset(s, 0, sizeof *s);
    if (!env_get(envp, "SLURM_PROCID") || !env_get(envp, "SLURM_STEP_NODELIST")) return LOOM_OK;
    long rank = 0, size = 0;
    if (env_int(envp, "SLURM_PROCID", 0, INT_MAX, &rank, err) < 0) return LOOM_ECONFIG;
    int got = env_int(envp, "SLURM_NTASKS", 1, INT_MAX, &size, err);
    if (got == 0) got = env_int(envp, "SLURM_STEP_NUM_TASKS", 1, INT_MAX, &size, err);
    if (got < 0) return LOOM_ECONFIG;
    if (got == 0)
        return loom_err_set(err, LOOM_ECONFIG, "SLURM_PROCID", "Slurm's environment has SLURM_PROCID but neither "
                            "SLURM_NTASKS nor SLURM_STEP_NUM_TASKS");
    if (rank >= size)
        return loom_err_set(err, LOOM_ECONFIG, "SLURM_PROCID", "SLURM_PROCID=%ld is not below SLURM_NTASKS=%ld", rank,
                            size);
    s->present = true;
    s->rank = rank;
    s->size = size;
    snprintf(s->where, sizeof s->where, "SLURM_PROCID=%ld of SLURM_NTASKS=%ld", rank, size);
    return LOOM_OK;
}

/* Open MPI (OMPI_COMM_WORLD_RANK/SIZE), PMIx (PMIX_RANK, with Open MPI's
 * size) and MPICH's Hydra (PMI_RANK/PMI_SIZE). */
static int mpi_env(char *const *envp, rank_env *m, long *local_size, loom_err *err)
{
    static const char *const ranks[] = {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"};
    static const char *const sizes[] = {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"};
    static const char *const locals[] = {"OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"};
    memset(m, 0, sizeof *m);
    *local_size = 0;
    for (int i = 0; i < 3; i++) {
        if (!env_get(envp, ranks[i])) continue;
        long rank = 0, size = 0;
        if (env_int(envp, ranks[i], 0, INT_MAX, &rank, err) < 0) return LOOM_ECONFIG;
        int got = env_int(envp, sizes[i], 1, INT_MAX, &size, err);
        if (got < 0) return LOOM_ECONFIG;
        if (got == 0)
            return loom_err_set(err, LOOM_ECONFIG, ranks[i], "%s is set but %s is not: cannot tell the job's size",
                                ranks[i], sizes[i]);
        if (rank >= size)
            return loom_err_set(err, LOOM_ECONFIG, ranks[i], "%s=%ld is not below %s=%ld", ranks[i], rank, sizes[i],
                                size);
        if (env_int(envp, locals[i], 1, INT_MAX, local_size, err) < 0) return LOOM_ECONFIG;
        m->present = true;
        m->rank = rank;
        m->size = size;
        snprintf(m->where, sizeof m->where, "%s=%ld of %s=%ld", ranks[i], rank, sizes[i], size);
        return LOOM_OK;
    }
    return LOOM_OK;
}

/* Every task of the step as a worker: the nodes of SLURM_STEP_NODELIST
 * with SLURM_STEP_TASKS_PER_NODE tasks each (srun's default block
 * distribution), task k of a node on port_base + k. */
static int slurm_addresses(loom_cluster *c, char *const *envp, const rank_env *s, int port_base, loom_err *err)
{
    const char *list = env_get(envp, "SLURM_STEP_NODELIST");
    char why[256], where[LOOM_PATH_MAX];
    loom_hostname *hosts = NULL;
    int nh = 0;
    snprintf(where, sizeof where, "SLURM_STEP_NODELIST=%s", list);
    if (loom_slurm_hostlist_(list, &hosts, &nh, why, sizeof why)) {
        loom_err_set(err, LOOM_ECONFIG, "SLURM_STEP_NODELIST", "malformed node list \"%s\": %s", list, why);
        return loom_err_hint(err, "Slurm's hostlist syntax: \"node[01-04,07]\", \"h[1-2]-ib,x\"");
    }
    int *per = loom_calloc((size_t)nh, sizeof *per);
    if (!per) {
        loom_free(hosts);
        return loom_err_set(err, LOOM_ENOMEM, "SLURM_STEP_NODELIST", "out of memory");
    }
    const char *tpn_name = env_get(envp, "SLURM_STEP_TASKS_PER_NODE") ? "SLURM_STEP_TASKS_PER_NODE" : NULL;
    const char *tpn = tpn_name ? env_get(envp, tpn_name) : NULL;
    int rc = LOOM_OK;
    if (tpn) {
        int nn = loom_slurm_tasks_per_node_(tpn, per, nh, why, sizeof why);
        long sum = 0;
        for (int i = 0; i < (nn > 0 ? nn : 0); i++) sum += per[i];
        if (nn < 0)
            rc = loom_err_set(err, LOOM_ECONFIG, tpn_name, "malformed \"%s\": %s (expected e.g. \"2(x3),1\")", tpn, why);
        else if (nn != nh)
            rc = loom_err_set(err, LOOM_ECONFIG, tpn_name, "\"%s\" gives %d nodes but SLURM_STEP_NODELIST \"%s\" has %d",
                              tpn, nn, list, nh);
        else if (sum != s->size)
            rc = loom_err_set(err, LOOM_ECONFIG, tpn_name, "\"%s\" adds up to %ld tasks but SLURM_NTASKS is %ld", tpn,
                              sum, s->size);
    } else { /* block distribution: the first nodes get one more */
        if (s->size < nh) nh = (int)s->size;
        for (int i = 0; i < nh; i++) per[i] = (int)(s->size / nh + (i < s->size % nh ? 1 : 0));
    }
    for (int i = 0; !rc && i < nh; i++)
        for (int k = 0; !rc && k < per[i]; k++) {
            if (port_base + k > 65535) {
                rc = loom_err_set(err, LOOM_ECONFIG, "cluster.port_base", "port_base %d + %d tasks on node %s runs past "
                                  "port 65535", port_base, per[i], hosts[i].s);
                break;
            }
            char a[LOOM_ADDR_MAX];
            snprintf(a, sizeof a, "%s:%d", hosts[i].s, port_base + k);
            rc = add_task(c, LOOM_ROLE_WORKER, a, where, "SLURM_STEP_NODELIST", err);
        }
    /* srun --distribution=cyclic places ranks differently: catch it */
    long node = -1, local = -1;
    if (!rc && env_int(envp, "SLURM_NODEID", 0, INT_MAX, &node, err) > 0 &&
        env_int(envp, "SLURM_LOCALID", 0, INT_MAX, &local, err) > 0) {
        long r = s->rank;
        int ni = 0;
        while (ni < nh && r >= per[ni]) r -= per[ni++];
        if (ni != node || r != local)
            rc = loom_err_set(err, LOOM_ECONFIG, "SLURM_PROCID", "rank %ld runs as task %ld of node %ld, but block "
                              "distribution puts it at task %ld of node %d", s->rank, local, node, r, ni);
        if (rc) loom_err_hint(err, "run srun with --distribution=block (the default)");
    }
    loom_free(per);
    loom_free(hosts);
    if (!rc) {
        c->addrs_from = LOOM_FROM_SLURM;
        snprintf(c->addrs_detail, sizeof c->addrs_detail, "%.400s, port_base %d", where, port_base);
    }
    return rc;
}

/* ---- checks --------------------------------------------------------------- */

static int check_duplicates(const loom_cluster *c, loom_err *err)
{
    char a[LOOM_ADDR_MAX], n1[32], n2[32];
    for (int r = 0; r < LOOM_ROLE_COUNT; r++)
        for (int i = 0; i < c->n_tasks[r]; i++)
            for (int r2 = 0; r2 <= r; r2++)
                for (int j = 0; j < (r2 == r ? i : c->n_tasks[r2]); j++) {
                    const loom_task_addr *x = &c->tasks[r][i], *y = &c->tasks[r2][j];
                    if (x->port != y->port || strcasecmp(x->host, y->host)) continue;
                    loom_err_set(err, LOOM_ECONFIG, c->addrs_detail, "duplicate address %s: %s and %s both listen on it",
                                 addr_str(x, a, sizeof a), loom_task_name(y->role, y->index, n1, sizeof n1),
                                 loom_task_name(x->role, x->index, n2, sizeof n2));
                    return loom_err_hint(err, "every task listens on an address of its own");
                }
    if (c->n_tasks[LOOM_ROLE_CHIEF] > 1)
        return loom_err_set(err, LOOM_ECONFIG, c->addrs_detail, "a cluster has at most one chief, got %d",
                            c->n_tasks[LOOM_ROLE_CHIEF]);
    return LOOM_OK;
}

/* The training roles: the chief and the workers the strategy requires, or,
 * requiring neither and refusing neither, one of them. */
static int check_trainers(const loom_cluster *c, const loom_cluster_roles *roles, const char *strategy, const char *w,
                          loom_err *err)
{
    int nc = c->n_tasks[LOOM_ROLE_CHIEF], nw = c->n_tasks[LOOM_ROLE_WORKER];
    bool need_c = roles->use[LOOM_ROLE_CHIEF] == LOOM_ROLE_REQUIRED;
    bool need_w = roles->use[LOOM_ROLE_WORKER] == LOOM_ROLE_REQUIRED;
    const char *hint = roles->hint[LOOM_ROLE_CHIEF] ? roles->hint[LOOM_ROLE_CHIEF] : roles->hint[LOOM_ROLE_WORKER];
    if (!need_c && !need_w) {
        if (nc + nw > 0 || roles->use[LOOM_ROLE_CHIEF] == LOOM_ROLE_REFUSED ||
            roles->use[LOOM_ROLE_WORKER] == LOOM_ROLE_REFUSED)
            return LOOM_OK;
        loom_err_set(err, LOOM_ECONFIG, w, "%s needs a chief or a worker, but the cluster (from %s) has none", strategy,
                     c->addrs_detail);
        return hint ? loom_err_hint(err, "%s", hint) : LOOM_ECONFIG;
    }
    if ((!need_c || nc == 1) && (!need_w || nw > 0)) return LOOM_OK;
    const char *wc = roles->why[LOOM_ROLE_CHIEF], *ww = roles->why[LOOM_ROLE_WORKER];
    char needs[256];
    snprintf(needs, sizeof needs, "%s%s%s%s%s%s%s", need_c ? "one chief" : "", need_c && wc ? " " : "",
             need_c && wc ? wc : "", need_c && need_w ? " and " : "", need_w ? "at least one worker" : "",
             need_w && ww ? " " : "", need_w && ww ? ww : "");
    loom_err_set(err, LOOM_ECONFIG, w, "%s needs %s, but the cluster (from %s) has %d chief%s and %d worker%s", strategy,
                 needs, c->addrs_detail, nc, nc == 1 ? "" : "s", nw, nw == 1 ? "" : "s");
    return hint ? loom_err_hint(err, "%s", hint) : LOOM_ECONFIG;
}

/* The strategy can use every role the cluster has (roles: its description;
 * NULL: a strategy that describes none decides for itself when it opens).
 * In order: one process; a role it refuses; a role other than the chief and
 * the workers it requires; the chief and the workers; its own check. */
static int check_roles(const loom_cluster *c, const loom_spec *spec, const loom_cluster_roles *roles, loom_err *err)
{
    if (!roles) return LOOM_OK;
    const loom_strategy_spec *st = &spec->strategy;
    char w[LOOM_PATH_MAX + 16];
    loom_loc_str(&st->loc, w, sizeof w);
    if (roles->flags & LOOM_ROLES_ONE_PROCESS) return LOOM_OK; /* one task at most: see ignore_for_one_process */
    for (int r = 0; r < LOOM_ROLE_COUNT; r++)
        if (roles->use[r] == LOOM_ROLE_REFUSED && c->n_tasks[r] > 0) {
            loom_err_set(err, LOOM_ECONFIG, w, "%s has no use for %s tasks, but the cluster (from %s) has %d", st->name,
                         role_names[r], c->addrs_detail, c->n_tasks[r]);
            return roles->hint[r] ? loom_err_hint(err, "%s", roles->hint[r]) : LOOM_ECONFIG;
        }
    for (int r = LOOM_ROLE_PS; r < LOOM_ROLE_COUNT; r++)
        if (roles->use[r] == LOOM_ROLE_REQUIRED && c->n_tasks[r] == 0) {
            loom_err_set(err, LOOM_ECONFIG, w, "%s needs %s tasks%s%s, but the cluster (from %s) has none", st->name,
                         role_names[r], roles->why[r] ? " " : "", roles->why[r] ? roles->why[r] : "", c->addrs_detail);
            return roles->hint[r] ? loom_err_hint(err, "%s", roles->hint[r]) : LOOM_ECONFIG;
        }
    int rc = check_trainers(c, roles, st->name, w, err);
    if (!rc && roles->check) rc = roles->check(spec, c->n_tasks, c->addrs_detail, err);
    return rc;
}

/* The secret: cluster.secret_file, else $LOOM_CLUSTER_SECRET; one trailing
 * newline dropped; a secret longer than HMAC-SHA256's block is its SHA-256,
 * as HMAC itself would use. */
/* Below this many bytes a secret is warned about (HMAC-SHA256 resists a
 * guess only as well as the secret's own entropy). */
#define LOOM_SECRET_MIN 16

static int read_secret(loom_cluster *c, const loom_cluster_spec *cs, char *const *envp, loom_err *err)
{
    uint8_t *data = NULL;
    size_t len = 0;
    if (cs->secret_file[0]) {
        char w[LOOM_PATH_MAX + 16];
        loom_loc_str(&cs->loc, w, sizeof w);
        loom_err e = {0};
        FILE *f = loom_fopen_regular(cs->secret_file, &e); /* a FIFO would block forever */
        if (!f)
            return loom_err_set(err, LOOM_ECONFIG, w, "cluster.secret_file: cannot read %s: %s", cs->secret_file,
                                strncmp(e.msg, "cannot open: ", 13) ? e.msg : e.msg + 13);
        struct stat st;
        if (fstat(fileno(f), &st) == 0 && (st.st_mode & 077))
            loom_warn("cluster.secret_file %s can be read by other users (mode %03o); chmod 600 it",
                      cs->secret_file, (unsigned)(st.st_mode & 0777));
        data = loom_alloc(4096);
        if (!data) {
            fclose(f);
            return loom_err_set(err, LOOM_ENOMEM, w, "out of memory");
        }
        len = fread(data, 1, 4096, f);
        bool more = fgetc(f) != EOF;
        fclose(f);
        if (more) {
            loom_free(data);
            return loom_err_set(err, LOOM_ECONFIG, w, "cluster.secret_file %s is longer than 4096 bytes",
                                cs->secret_file);
        }
        snprintf(c->secret_from, sizeof c->secret_from, "cluster.secret_file (%s)", cs->secret_file);
    } else {
        const char *v = env_get(envp, "LOOM_CLUSTER_SECRET");
        if (!v) return LOOM_OK;
        len = strlen(v);
        data = (uint8_t *)loom_strdup(v);
        if (!data) return loom_err_set(err, LOOM_ENOMEM, "LOOM_CLUSTER_SECRET", "out of memory");
        snprintf(c->secret_from, sizeof c->secret_from, "LOOM_CLUSTER_SECRET");
    }
    if (len && data[len - 1] == '\n') len--;
    if (len && data[len - 1] == '\r') len--;
    int rc = LOOM_OK;
    if (len == 0) {
        rc = loom_err_set(err, LOOM_ECONFIG, cs->secret_file[0] ? cs->secret_file : "LOOM_CLUSTER_SECRET",
                          "the cluster secret is empty");
        loom_err_hint(err, "put a long random string there, e.g. `openssl rand -hex 32`");
    } else if (len > sizeof c->secret) {
        unsigned int dl = 0;
        EVP_Digest(data, len, c->secret, &dl, EVP_sha256(), NULL);
        c->secret_len = dl;
    } else {
        memcpy(c->secret, data, len);
        c->secret_len = len;
    }
    if (len && len < LOOM_SECRET_MIN)
        loom_warn("the cluster secret from %s is %zu byte%s long: a short secret is guessed; use at least %d random "
                  "bytes, e.g. `openssl rand -hex 32 > FILE; chmod 600 FILE` and cluster.secret_file = FILE",
                  c->secret_from, len, len == 1 ? "" : "s", LOOM_SECRET_MIN);
    memset(data, 0, len);
    loom_free(data);
    return rc;
}

static int check_security(const loom_cluster *c, loom_err *err)
{
    if (c->secret_len || c->insecure) return LOOM_OK;
    for (int r = 0; r < LOOM_ROLE_COUNT; r++)
        for (int i = 0; i < c->n_tasks[r]; i++) {
            const loom_task_addr *t = &c->tasks[r][i];
            if (loom_host_is_loopback_(t->host)) continue;
            char a[LOOM_ADDR_MAX], nm[32];
            loom_err_set(err, LOOM_ECONFIG, c->addrs_detail, "%s listens on %s, which is not loopback, and the cluster "
                         "has no secret", loom_task_name(t->role, t->index, nm, sizeof nm), addr_str(t, a, sizeof a));
            return loom_err_hint(err, "set cluster.secret_file (or LOOM_CLUSTER_SECRET) to a file every task can "
                                      "read; cluster.insecure = true accepts an unauthenticated cluster");
        }
    return LOOM_OK;
}

/* The config as loom_config_print prints it, with the resolved addresses
 * and without the per-task keys (model_dir, the secret's and TLS files'
 * paths), and its SHA-256. */
static int digest_config(loom_cluster *c, const loom_spec *spec, loom_err *err)
{
    loom_spec *cp = loom_alloc(sizeof *cp);
    if (!cp) return loom_err_set(err, LOOM_ENOMEM, spec->path, "out of memory");
    memcpy(cp, spec, sizeof *cp); /* shallow: printing only reads the nested datasets */
    loom_cluster_spec *cs = &cp->cluster;
    cs->present = true;
    /* strategy.elastic: the worker list (its length, its addresses) is not
     * compared: a job grows past it (a worker started later may list more) */
    bool elastic = spec->strategy.elastic.enabled;
    for (int r = 0; r < LOOM_ROLE_COUNT; r++) {
        cs->n_tasks[r] = c->n_tasks[r] < LOOM_MAX_CLUSTER_TASKS ? c->n_tasks[r] : LOOM_MAX_CLUSTER_TASKS;
        if (elastic && r == LOOM_ROLE_WORKER) cs->n_tasks[r] = 0;
        for (int i = 0; i < cs->n_tasks[r]; i++) addr_str(&c->tasks[r][i], cs->addr[r][i], sizeof cs->addr[r][i]);
    }
    cp->run.model_dir[0] = 0;
    cs->secret_file[0] = cs->tls_cert[0] = cs->tls_key[0] = cs->tls_ca[0] = 0;
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) {
        loom_free(cp);
        return loom_err_set(err, LOOM_ENOMEM, spec->path, "out of memory");
    }
    loom_config_print(cp, f);
    /* the past cap of the role lists (Slurm's big jobs) still counts */
    for (int r = 0; r < LOOM_ROLE_COUNT; r++)
        for (int i = LOOM_MAX_CLUSTER_TASKS; i < c->n_tasks[r] && !(elastic && r == LOOM_ROLE_WORKER); i++) {
            char a[LOOM_ADDR_MAX];
            fprintf(f, "# %s:%d %s\n", role_names[r], i, addr_str(&c->tasks[r][i], a, sizeof a));
        }
    fclose(f);
    loom_free(cp);
    /* drop the header line: it names the config file, which may differ per task */
    char *body = strchr(text, '\n');
    body = body ? body + 1 : text;
    c->config_text = loom_strdup(body);
    free(text);
    if (!c->config_text) return loom_err_set(err, LOOM_ENOMEM, spec->path, "out of memory");
    unsigned int dl = 0;
    if (!EVP_Digest(c->config_text, strlen(c->config_text), c->config_digest, &dl, EVP_sha256(), NULL) || dl != 32)
        return loom_err_set(err, LOOM_ENOMEM, spec->path, "SHA-256 of the config failed (OpenSSL)");
    return LOOM_OK;
}

/* ---- resolve -------------------------------------------------------------- */

void loom_cluster_free(loom_cluster *c)
{
    if (!c) return;
    for (int r = 0; r < LOOM_ROLE_COUNT; r++) loom_free(c->tasks[r]);
    loom_free(c->config_text);
    memset(c->secret, 0, sizeof c->secret);
    loom_free(c);
}

/* The sources of a cluster's facts, each parsed and checked on its own. */
typedef struct sources {
    loom_role   flag_role;  /* --task's, when given */
    int         flag_index;
    tf_config   tf;         /* TF_CONFIG; tf.root is freed with json_decref */
    rank_env    slurm, mpi;
    long        mpi_local;  /* MPI ranks on this host */
    const char *launched;   /* LOOM_LAUNCH: set by `loom launch --local` in the tasks it starts; NULL: not */
} sources;

static int parse_sources(sources *src, const char *task_flag, char *const *envp, loom_err *err)
{
    memset(src, 0, sizeof *src);
    src->flag_role = LOOM_ROLE_WORKER;
    src->flag_index = -1;
    int rc;
    if (task_flag) {
        char why[300];
        if (loom_task_parse_(task_flag, &src->flag_role, &src->flag_index, why, sizeof why))
            return loom_err_set(err, LOOM_EUSAGE, "--task", "%s", why);
    }
    const char *tfc = env_get(envp, "TF_CONFIG");
    if (tfc && tfc[strspn(tfc, " \t\r\n")] && (rc = tf_config_parse(tfc, &src->tf, err))) return rc;
    if ((rc = slurm_env(envp, &src->slurm, err)) || (rc = mpi_env(envp, &src->mpi, &src->mpi_local, err))) return rc;
    src->launched = env_get(envp, "LOOM_LAUNCH");
    if (src->launched && !src->launched[0]) src->launched = NULL;
    return LOOM_OK;
}

/* The addresses from the config's cluster section (cluster.* of --set, or
 * of loom launch). */
static int addresses_from_config(loom_cluster *c, const loom_cluster_spec *cs, const sources *src, loom_err *err)
{
    char w[LOOM_PATH_MAX + 16];
    int rc = src->tf.has_cluster ? tf_vs_config(&src->tf, cs, err) : LOOM_OK;
    for (int r = 0; !rc && r < LOOM_ROLE_COUNT; r++)
        for (int i = 0; !rc && i < cs->n_tasks[r]; i++) {
            char what[64];
            snprintf(what, sizeof what, "cluster.%s[%d]", role_names[r], i);
            rc = add_task(c, (loom_role)r, cs->addr[r][i], cfg_where(cs, r, i, w, sizeof w), what, err);
        }
    c->addrs_from = LOOM_FROM_CONFIG;
    for (int r = 0; r < LOOM_ROLE_COUNT; r++)
        if (cs->n_tasks[r]) {
            snprintf(c->addrs_detail, sizeof c->addrs_detail, "%s", cfg_where(cs, r, -1, w, sizeof w));
            break;
        }
    if (src->launched) { /* loom launch --local chose the ports and passed them as --set cluster.* */
        c->addrs_from = LOOM_FROM_LAUNCH;
        snprintf(c->addrs_detail, sizeof c->addrs_detail, "%s", src->launched);
    }
    return rc;
}

static int addresses_from_tf_config(loom_cluster *c, const tf_config *tf, loom_err *err)
{
    int rc = LOOM_OK;
    for (int r = 0; !rc && r < LOOM_ROLE_COUNT; r++)
        for (int i = 0; !rc && i < tf->n[r]; i++) {
            char what[64];
            snprintf(what, sizeof what, "cluster.%s[%d]", role_names[r], i);
            rc = add_task(c, (loom_role)r, json_string_value(json_array_get(tf->list[r], (size_t)i)), "TF_CONFIG",
                          what, err);
        }
    c->addrs_from = LOOM_FROM_TF_CONFIG;
    snprintf(c->addrs_detail, sizeof c->addrs_detail, "TF_CONFIG");
    return rc;
}

/* Under MPI on one host: one worker per rank on 127.0.0.1 from port_base. */
static int addresses_from_mpi(loom_cluster *c, const loom_cluster_spec *cs, const sources *src, loom_err *err)
{
    const rank_env *mpi = &src->mpi;
    int rc = LOOM_OK;
    if (src->mpi_local != mpi->size) {
        rc = loom_err_set(err, LOOM_ECONFIG, mpi->where, "under MPI on several hosts the addresses come from the "
                          "config's cluster section, and it has none");
        loom_err_hint(err, "list the tasks in cluster { worker = [\"host:port\", ...]; }, one per MPI rank in rank "
                           "order");
    }
    for (int i = 0; !rc && i < mpi->size; i++) {
        char a[LOOM_ADDR_MAX];
        if (cs->port_base + i > 65535) {
            rc = loom_err_set(err, LOOM_ECONFIG, "cluster.port_base", "port_base %d + %ld ranks runs past port "
                              "65535", cs->port_base, mpi->size);
            break;
        }
        snprintf(a, sizeof a, "127.0.0.1:%d", cs->port_base + i);
        rc = add_task(c, LOOM_ROLE_WORKER, a, mpi->where, "MPI rank", err);
    }
    c->addrs_from = LOOM_FROM_MPI;
    snprintf(c->addrs_detail, sizeof c->addrs_detail, "%s, all on this host: 127.0.0.1, port_base %d", mpi->where,
             cs->port_base);
    return rc;
}

/* The addresses, from the first source that has them: the config, TF_CONFIG,
 * Slurm's node list, one host under MPI. None: *single (one process), or an
 * error when --task or TF_CONFIG's task names a task anyway. */
static int resolve_addresses(loom_cluster *c, const loom_cluster_spec *cs, const sources *src, char *const *envp,
                             const char *task_flag, bool *single, loom_err *err)
{
    bool cfg_tasks = false;
    for (int r = 0; r < LOOM_ROLE_COUNT; r++) cfg_tasks = cfg_tasks || cs->n_tasks[r] > 0;
    if (cfg_tasks) return addresses_from_config(c, cs, src, err);
    if (src->tf.has_cluster) return addresses_from_tf_config(c, &src->tf, err);
    if (src->slurm.present) return slurm_addresses(c, envp, &src->slurm, cs->port_base, err);
    if (src->mpi.present) return addresses_from_mpi(c, cs, src, err);
    if (task_flag) {
        loom_err_set(err, LOOM_EUSAGE, "--task", "--task %s, but there is no cluster: the config has no cluster "
                     "tasks and TF_CONFIG, Slurm and MPI give none", task_flag);
        loom_err_hint(err, "add cluster { worker = [\"host:port\", ...]; } to the config, or drop --task");
        return LOOM_EUSAGE;
    }
    if (src->tf.has_task)
        return loom_err_set(err, LOOM_ECONFIG, "TF_CONFIG", "TF_CONFIG has a task but no cluster, and the config "
                            "has no cluster tasks");
    *single = true;
    return LOOM_OK;
}

/* This process's task, from the first source that names it: --task,
 * TF_CONFIG, Slurm, MPI; a one-task cluster needs none; without need_task,
 * none is index -1. */
/* Under strategy.elastic with max_workers above the listed training tasks:
 * how many workers the job may have (the chief counts among max_workers);
 * else the listed workers. */
static int worker_slots(const loom_cluster *c, const loom_spec *spec)
{
    const loom_elastic_spec *el = &spec->strategy.elastic;
    int listed = c->n_tasks[LOOM_ROLE_WORKER], most = el->max_workers - c->n_tasks[LOOM_ROLE_CHIEF];
    return el->enabled && most > listed ? most : listed;
}

static int resolve_task(loom_cluster *c, const sources *src, const char *task_flag, bool need_task, int slots,
                        loom_err *err)
{
    int n = total_tasks(c);
    char nm[32];
    const tf_config *tf = &src->tf;
    if (task_flag && tf->has_task && (src->flag_role != (loom_role)tf->role || src->flag_index != tf->index)) {
        loom_err_set(err, LOOM_EUSAGE, "--task", "--task %s disagrees with TF_CONFIG's task %s", task_flag,
                     loom_task_name((loom_role)tf->role, tf->index, nm, sizeof nm));
        return loom_err_hint(err, "drop --task (TF_CONFIG says which task this is) or make them equal");
    }
    if (task_flag) {
        c->role = src->flag_role;
        c->index = src->flag_index;
        c->task_from = src->launched ? LOOM_FROM_LAUNCH : LOOM_FROM_FLAG;
        snprintf(c->task_detail, sizeof c->task_detail, "--task %s", task_flag);
    } else if (tf->has_task) {
        c->role = (loom_role)tf->role;
        c->index = tf->index;
        c->task_from = LOOM_FROM_TF_CONFIG;
        snprintf(c->task_detail, sizeof c->task_detail, "TF_CONFIG task");
    } else if (src->slurm.present || src->mpi.present) {
        const rank_env *e = src->slurm.present ? &src->slurm : &src->mpi;
        if (e->size != n) {
            loom_err_set(err, LOOM_ECONFIG, e->where, "%s starts %ld tasks but the cluster (from %s) has %d",
                         src->slurm.present ? "Slurm" : "MPI", e->size, c->addrs_detail, n);
            return loom_err_hint(err, "start one task per cluster task (%s -n %d), or drop the cluster lists",
                                 src->slurm.present ? "srun" : "mpirun", n);
        }
        nth_task(c, (int)e->rank, &c->role, &c->index);
        c->task_from = src->slurm.present ? LOOM_FROM_SLURM : LOOM_FROM_MPI;
        snprintf(c->task_detail, sizeof c->task_detail, "%s", e->where);
    } else if (n == 1) {
        nth_task(c, 0, &c->role, &c->index);
        c->task_from = c->addrs_from;
        snprintf(c->task_detail, sizeof c->task_detail, "the only task of the cluster");
    } else if (!need_task) {
        c->index = -1;
        c->task_from = LOOM_FROM_NONE;
        snprintf(c->task_detail, sizeof c->task_detail, "none given");
    } else {
        loom_err_set(err, LOOM_EUSAGE, c->addrs_detail, "the cluster has %d tasks; which one is this process?", n);
        return loom_err_hint(err, "pass --task ROLE:INDEX (e.g. --task %s), or set TF_CONFIG, or start it under srun "
                             "or mpirun", loom_task_name(c->n_tasks[0] ? LOOM_ROLE_CHIEF : LOOM_ROLE_WORKER, 0, nm,
                                                         sizeof nm));
    }
    if (c->index >= 0 && c->role == LOOM_ROLE_WORKER && c->index < slots) return LOOM_OK; /* (elastic: unlisted) */
    if (c->index >= 0 && c->role == LOOM_ROLE_WORKER && slots > c->n_tasks[LOOM_ROLE_WORKER]) {
        loom_err_set(err, LOOM_ECONFIG, c->task_detail, "%s is beyond strategy.elastic.max_workers = %d: the job may "
                     "have worker:0 to worker:%d (the cluster, from %s, lists %d)",
                     loom_task_name(c->role, c->index, nm, sizeof nm), slots + c->n_tasks[LOOM_ROLE_CHIEF],
                     slots - 1, c->addrs_detail, c->n_tasks[LOOM_ROLE_WORKER]);
        return loom_err_hint(err, "raise strategy.elastic.max_workers (every task's config), or start it when a "
                             "worker has left");
    }
    if (c->index >= 0 && c->n_tasks[c->role] == 0)
        return loom_err_set(err, LOOM_ECONFIG, c->task_detail, "this task is %s, but the cluster (from %s) has no %s "
                            "tasks", loom_task_name(c->role, c->index, nm, sizeof nm), c->addrs_detail,
                            role_names[c->role]);
    if (c->index >= 0 && c->index >= c->n_tasks[c->role])
        return loom_err_set(err, LOOM_ECONFIG, c->task_detail, "task index out of range: %s, but the cluster (from "
                            "%s) has %d %s task%s (%s:0 to %s:%d)", loom_task_name(c->role, c->index, nm, sizeof nm),
                            c->addrs_detail, c->n_tasks[c->role], role_names[c->role],
                            c->n_tasks[c->role] == 1 ? "" : "s", role_names[c->role], role_names[c->role],
                            c->n_tasks[c->role] - 1);
    return LOOM_OK;
}

/* strategy.elastic: the worker entries past the listed ones, up to slots,
 * unlisted (host "", port 0: their addresses come when they connect); this
 * task's own, if unlisted, listens on an ephemeral port: on loopback when
 * the chief's address is loopback, else on every interface. */
static int add_unlisted(loom_cluster *c, int slots, loom_err *err)
{
    int k = c->n_tasks[LOOM_ROLE_WORKER];
    if (slots <= k) return LOOM_OK;
    loom_task_addr *t = loom_realloc(c->tasks[LOOM_ROLE_WORKER], (size_t)slots * sizeof *t);
    if (!t) return loom_err_set(err, LOOM_ENOMEM, c->addrs_detail, "out of memory");
    c->tasks[LOOM_ROLE_WORKER] = t;
    const loom_task_addr *chief = c->n_tasks[LOOM_ROLE_CHIEF] ? &c->tasks[LOOM_ROLE_CHIEF][0] : &t[0];
    bool lo = !strcmp(chief->host, "localhost") || !strncmp(chief->host, "127.", 4), lo6 = !strcmp(chief->host, "::1");
    for (int i = k; i < slots; i++) {
        t[i] = (loom_task_addr){.role = LOOM_ROLE_WORKER, .index = i, .port = 0};
        if (c->role == LOOM_ROLE_WORKER && c->index == i)
            snprintf(t[i].host, sizeof t[i].host, "%s", lo ? "127.0.0.1" : lo6 ? "::1" : "0.0.0.0");
    }
    return LOOM_OK;
}

/* The training ranks (the chief, then the workers) and the transport's settings. */
static void settle(loom_cluster *c, const loom_cluster_spec *cs, int slots)
{
    int chiefs = c->n_tasks[LOOM_ROLE_CHIEF];
    c->n_train_ranks = chiefs + c->n_tasks[LOOM_ROLE_WORKER];
    c->n_train_slots = chiefs + (slots > c->n_tasks[LOOM_ROLE_WORKER] ? slots : c->n_tasks[LOOM_ROLE_WORKER]);
    c->rank = c->index < 0 ? -1 : c->role == LOOM_ROLE_CHIEF ? 0 : c->role == LOOM_ROLE_WORKER ? chiefs + c->index : -1;
    c->connect_timeout = cs->connect_timeout;
    c->heartbeat_timeout = cs->heartbeat_timeout;
    c->heartbeat_interval = cs->heartbeat_interval > 0 ? cs->heartbeat_interval : cs->heartbeat_timeout / 5;
    c->tls = cs->tls;
    snprintf(c->tls_cert, sizeof c->tls_cert, "%s", cs->tls_cert);
    snprintf(c->tls_key, sizeof c->tls_key, "%s", cs->tls_key);
    snprintf(c->tls_ca, sizeof c->tls_ca, "%s", cs->tls_ca);
    c->insecure = cs->insecure;
}

/* A one-process strategy (one_device, mirrored, central_storage, a
 * plugin's that says so) on a cluster of several tasks: the cluster is
 * ignored with one warning and the process trains alone, as TensorFlow
 * ignores TF_CONFIG for OneDeviceStrategy and MirroredStrategy (a config
 * written for a cluster can be tried on one machine by changing
 * strategy.type). True when it is ignored. */
static bool ignore_for_one_process(const loom_cluster *c, const loom_spec *spec, const loom_cluster_roles *roles,
                                   const char *task_flag)
{
    int n = total_tasks(c);
    if (!roles || !(roles->flags & LOOM_ROLES_ONE_PROCESS) || n <= 1) return false;
    char w[LOOM_PATH_MAX + 16];
    loom_loc_str(&spec->strategy.loc, w, sizeof w);
    loom_warn("%s: strategy \"%s\" runs in one process: the cluster's %d tasks (from %s)%s%s are ignored and this "
              "process trains alone; use strategy.type = \"multi_worker_mirrored\" or \"parameter_server\" to train "
              "on the cluster", w, spec->strategy.name, n, c->addrs_detail, task_flag ? " and --task " : "",
              task_flag ? task_flag : "");
    return true;
}

/* The precedence of the sources, first for the addresses, then for this
 * task; each part names where its value came from, which is what
 * `loom check --task` prints. Then the checks, every one before a socket. */
static int resolve(loom_cluster *c, const loom_spec *spec, const loom_cluster_roles *roles, const char *task_flag,
                   char *const *envp, bool need_task, bool *single, loom_err *err)
{
    const loom_cluster_spec *cs = &spec->cluster;
    *single = false;
    sources src;
    int rc = parse_sources(&src, task_flag, envp, err);
    if (!rc) rc = resolve_addresses(c, cs, &src, envp, task_flag, single, err);
    if (!rc && !*single) *single = ignore_for_one_process(c, spec, roles, task_flag);
    if (!rc && !*single) rc = check_duplicates(c, err);
    int slots = rc || *single ? 0 : worker_slots(c, spec);
    if (!rc && !*single) rc = resolve_task(c, &src, task_flag, need_task, slots, err);
    json_decref(src.tf.root);
    if (rc || *single) return rc;
    settle(c, cs, slots);
    if ((rc = add_unlisted(c, slots, err))) return rc;
    if ((rc = check_roles(c, spec, roles, err))) return rc;
    if ((rc = read_secret(c, cs, envp, err))) return rc;
    if ((rc = check_security(c, err))) return rc;
    return digest_config(c, spec, err);
}

static int resolve_new(loom_cluster **out, const loom_spec *spec, const loom_cluster_roles *roles,
                       const char *task_flag, char *const *envp, bool need_task, loom_err *err)
{
    *out = NULL;
    loom_cluster *c = loom_calloc(1, sizeof *c);
    if (!c) return loom_err_set(err, LOOM_ENOMEM, spec->path, "out of memory");
    bool single = false;
    int rc = resolve(c, spec, roles, task_flag, envp, need_task, &single, err);
    if (rc || single) {
        loom_cluster_free(c);
        return rc;
    }
    *out = c;
    return LOOM_OK;
}

int loom_cluster_resolve(loom_cluster **out, const loom_spec *spec, const loom_cluster_roles *roles,
                         const char *task_flag, char *const *envp, loom_err *err)
{
    return resolve_new(out, spec, roles, task_flag, envp, true, err);
}

int loom_cluster_resolve_any(loom_cluster **out, const loom_spec *spec, const loom_cluster_roles *roles,
                             const char *task_flag, char *const *envp, loom_err *err)
{
    return resolve_new(out, spec, roles, task_flag, envp, false, err);
}

/* ---- print ---------------------------------------------------------------- */

void loom_cluster_print(const loom_cluster *c, FILE *f)
{
    if (!c) {
        fprintf(f, "cluster: none (one process)\n");
        return;
    }
    char nm[32], a[LOOM_ADDR_MAX];
    const char *from = loom_cluster_from_name(c->addrs_from);
    fprintf(f, "cluster: %d task%s, addresses from %s", total_tasks(c), total_tasks(c) == 1 ? "" : "s", from);
    fprintf(f, strcmp(from, c->addrs_detail) ? " (%s)\n" : "\n", c->addrs_detail);
    for (int r = 0; r < LOOM_ROLE_COUNT; r++)
        for (int i = 0; i < c->n_tasks[r]; i++) {
            const loom_task_addr *t = &c->tasks[r][i];
            int rank = r == LOOM_ROLE_CHIEF ? 0 : r == LOOM_ROLE_WORKER ? c->n_tasks[LOOM_ROLE_CHIEF] + i : -1;
            fprintf(f, "  %-12s %-24s", loom_task_name(t->role, t->index, nm, sizeof nm), addr_str(t, a, sizeof a));
            if (rank >= 0) fprintf(f, " rank %d%s", rank, rank == 0 ? " (chief)" : "");
            if (c->index >= 0 && (int)c->role == r && c->index == i) fprintf(f, "  <- this task");
            fputc('\n', f);
        }
    int slots = loom_cluster_train_slots(c), w0 = c->n_train_ranks - c->n_tasks[LOOM_ROLE_CHIEF];
    int w1 = slots - 1 - c->n_tasks[LOOM_ROLE_CHIEF];
    if (slots > c->n_train_ranks) {
        char span[64];
        snprintf(span, sizeof span, w1 > w0 ? "worker:%d to worker:%d" : "worker:%d", w0, w1);
        fprintf(f, "  %s: unlisted (strategy.elastic.max_workers = %d): %s from an ephemeral port%s\n", span,
                slots, w1 > w0 ? "each joins" : "joins",
                c->rank < c->n_train_ranks ? "" : w1 > w0 ? "  <- this task among them" : "  <- this task");
    }
    if (c->index < 0) {
        fprintf(f, "task: none given (pass --task ROLE:I, or set TF_CONFIG, or start it under srun or mpirun)\n");
    } else {
        fprintf(f, "task: %s from %s (%s)", loom_task_name(c->role, c->index, nm, sizeof nm),
                loom_cluster_from_name(c->task_from), c->task_detail);
        if (c->rank >= c->n_train_ranks)
            fprintf(f, ", training rank %d, past the %d listed\n", c->rank, c->n_train_ranks);
        else if (c->rank >= 0)
            fprintf(f, ", training rank %d of %d\n", c->rank, c->n_train_ranks);
        else
            fprintf(f, ", not a training rank\n");
    }
    fprintf(f, "timeouts: connect %g s, heartbeat %g s (one every %g s)\n", c->connect_timeout, c->heartbeat_timeout,
            c->heartbeat_interval);
    if (c->secret_len)
        fprintf(f, "security: a shared secret from %s (HMAC-SHA256)%s\n", c->secret_from, c->tls ? ", TLS" : "");
    else
        fprintf(f, "security: no secret (%s)%s\n",
                c->insecure ? "cluster.insecure = true" : "every address is loopback: allowed with a warning",
                c->tls ? ", TLS" : "");
    fprintf(f, "config digest: sha256 ");
    for (int i = 0; i < 32; i++) fprintf(f, "%02x", c->config_digest[i]);
    fprintf(f, " (per-task keys excluded)\n");
}
