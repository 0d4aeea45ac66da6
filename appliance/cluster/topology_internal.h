/* topology_internal.h - the parsers inside loom_cluster_resolve, exposed for
 * the unit tests (tests/unit/test_cluster_topo.c) and for launch.
 * Ownership: arrays returned here are freed with loom_free. Threads: none. */
#ifndef LOOM_TOPOLOGY_INTERNAL_H
#define LOOM_TOPOLOGY_INTERNAL_H

#include "cluster/cluster.h"

#define LOOM_SLURM_MAX_HOSTS 65536

typedef struct loom_hostname { char s[LOOM_HOST_MAX]; } loom_hostname;

/* Expands a Slurm hostlist ("node[01-04,07]", "h[1-2]-ib,x", "r[1-2]n[1-3]")
 * into *hosts (*n names, in order; free with loom_free). Zero-padding
 * follows each range's lower bound, as Slurm's. Returns 0, or -1 with why
 * saying what is wrong at which byte offset. */
int loom_slurm_hostlist_(const char *list, loom_hostname **hosts, int *n, char *why, size_t why_n);

/* Parses SLURM_STEP_TASKS_PER_NODE ("2(x3),1" = 2, 2, 2, 1) into counts
 * (at most max). Returns the number of nodes, or -1 with why. */
int loom_slurm_tasks_per_node_(const char *s, int *counts, int max, char *why, size_t why_n);

/* Parses "ROLE:I" (--task) into role and index; -1 with why. */
int loom_task_parse_(const char *s, loom_role *role, int *index, char *why, size_t why_n);

/* Whether host (as written, brackets removed) is a loopback address by its
 * syntax: "localhost", 127.x.y.z, ::1. Names are not looked up. */
bool loom_host_is_loopback_(const char *host);

#endif
