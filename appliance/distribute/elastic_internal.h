/* elastic_internal.h - between multi_worker.c and elastic.c: the membership
 * of an elastic multi_worker_mirrored job (strategy.elastic).
 * Threads: the train thread, between collectives (never while the
 * communicator thread drives the group). */
#ifndef LOOM_ELASTIC_INTERNAL_H
#define LOOM_ELASTIC_INTERNAL_H

#include "distribute.h"

typedef struct loom_elastic loom_elastic;

/* Makes g elastic (its peers tolerated) and declares the membership
 * messages. task: this task's name, for messages; model_dir: where the
 * chief appends the membership records of metrics.jsonl. Free with
 * loom_elastic_free_. */
int  loom_elastic_open_(loom_elastic **out, loom_group *g, const loom_cluster *c, const loom_elastic_spec *spec,
                        const char *task, const char *model_dir, loom_err *err);
void loom_elastic_free_(loom_elastic *e); /* NULL is a no-op */

/* Before step `step` (0-based) of this task: LOOM_TEST_MEMBERSHIP's scripted
 * departures ("leave worker:2 at 300"): the named task dies here. e NULL: nothing. */
void loom_elastic_step_(loom_elastic *e, int64_t step);

/* After step `step` (0-based) counted: LOOM_TEST_EXAMPLE_IDS=PREFIX appends
 * "STEP CRC" for each example of b (this member's slice; CRC-32C of its
 * feature `feature`) to PREFIX.<task>, so a test can check an epoch's
 * multiset of examples. Unset: nothing. */
void loom_elastic_trained_(loom_elastic *e, const loom_elem *b, int feature, int64_t step);

/* What the job does after a membership change. */
typedef struct loom_elastic_outcome {
    bool redo;  /* this task's step is the one to take again over the new members */
    bool stop;  /* fewer than min_workers are left: stop after this step (with a checkpoint) */
    int  workers;
} loom_elastic_outcome;

/* After a collective of step `step` (0-based: `step` steps were complete
 * here) failed with LOOM_ENET (fail: that error): every member left reports
 * to the chief, which decides the new membership and tells them; the ring
 * re-forms over them and the member that got furthest broadcasts its state
 * (params, P floats; slots, n_slots floats), so every member continues from
 * the last step any of them completed. Returns the original error when this
 * task cannot go on (the chief was lost, or this task was dropped). */
int  loom_elastic_recover_(loom_elastic *e, int64_t step, float *params, int64_t P, float *slots, int64_t n_slots,
                           const loom_err *fail, loom_elastic_outcome *out, loom_err *err);

#endif
