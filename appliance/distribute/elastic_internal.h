/* elastic_internal.h - between multi_worker.c and elastic.c: the membership
 * of an elastic multi_worker_mirrored job (strategy.elastic).
 * Threads: the train thread, between collectives (never while the
 * communicator thread drives the group). */
#ifndef LOOM_ELASTIC_INTERNAL_H
#define LOOM_ELASTIC_INTERNAL_H

#include "distribute.h"

typedef struct loom_elastic loom_elastic;

/* Makes g (opened with loom_group_open_elastic) elastic (its peers tolerated),
 * declares the membership messages and forms the ring: every task asks the
 * chief to join; at the start the chief admits those connected (the first
 * ring: at least min_workers, else it waits wait_timeout, then an error),
 * in a running job at a step boundary (loom_elastic_want_join_,
 * loom_elastic_admit_), or refuses politely (max_workers). task: this
 * task's name, for messages; model_dir: where the chief appends the
 * membership records of metrics.jsonl. Free with loom_elastic_free_. */
int  loom_elastic_open_(loom_elastic **out, loom_group *g, const loom_cluster *c, const loom_elastic_spec *spec,
                        const char *task, const char *model_dir, loom_err *err);
void loom_elastic_free_(loom_elastic *e); /* NULL is a no-op */
/* The membership messages' types, for loom_group_open_bare: declared as the
 * group opens, since a quicker peer's join request may come before
 * loom_elastic_open_ runs (it was dropped as an unread type). */
uint64_t loom_elastic_reads_(void);

/* Before step `step` (0-based) of this task: LOOM_TEST_MEMBERSHIP's scripted
 * departures ("leave worker:2 at 300"): the named task dies here; true: a
 * scripted stop request ("interrupt worker:0 at 300") rides this step, as a
 * SIGINT caught while it runs would. e NULL: nothing (false). */
bool loom_elastic_step_(loom_elastic *e, int64_t step);
/* A worker (not the chief) asked to leave (SIGTERM), before step `step`
 * (0-based): a step boundary, so no collective is half done; it says so and
 * exits 0; its connections close and the members re-form at once without
 * it (loom_elastic_recover_). The chief, or e NULL: nothing. */
void loom_elastic_leave_(loom_elastic *e, int64_t step);

/* After step `step` (0-based) counted: LOOM_TEST_EXAMPLE_IDS=PREFIX appends
 * "STEP CRC" for each example of b (this member's slice; CRC-32C of its
 * feature `feature`) to PREFIX.<task>, so a test can check an epoch's
 * multiset of examples. Unset: nothing. */
void loom_elastic_trained_(loom_elastic *e, const loom_elem *b, int feature, int64_t step);

/* What the job does after a membership change. */
typedef struct loom_elastic_outcome {
    bool redo;  /* this task's step is the one to take again over the new members */
    bool stop;  /* fewer than min_workers are left: stop after this step (with a checkpoint) */
    bool join;  /* (the chief) below min_workers, tasks asked to join within wait_timeout: admit them after this step */
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

/* This task entered a running job (false: it formed the first ring): the
 * steps the job had completed and the chief's trainer state (borrowed). It
 * then calls loom_elastic_enter_ to receive the variables and slots. */
bool loom_elastic_joined_(const loom_elastic *e, int64_t *step, const loom_buf **state);
/* The members' broadcast of the chief's variables (P floats) and optimizer
 * slots (n_slots floats) to the members that joined (every member calls it). */
int  loom_elastic_enter_(loom_elastic *e, float *params, int64_t P, float *slots, int64_t n_slots, loom_err *err);

/* The chief, before step `step` (0-based): whether a task waits to be
 * admitted after this step (the step's agreement tells every member). A
 * scripted join ("join worker:2 at 500") holds step 499 until that task
 * asks; a request beyond max_workers is refused here. Others: false. */
bool loom_elastic_want_join_(loom_elastic *e, int64_t step);
/* After the step whose agreement said a task waits (every member, with
 * `done` steps complete): the chief admits the waiting tasks (state: the
 * trainer's, for them), every member learns the membership, the ring
 * re-forms over the members in task order and the chief's variables and
 * slots go to every member. *workers: the members now. */
int  loom_elastic_admit_(loom_elastic *e, int64_t done, const loom_buf *state, float *params, int64_t P, float *slots,
                         int64_t n_slots, int *workers, loom_err *err);

#endif
