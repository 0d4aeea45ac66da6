/* progress_internal.h - private to train/: the progress display. */
#ifndef LOOM_TRAIN_PROGRESS_H
#define LOOM_TRAIN_PROGRESS_H

#include "config/config.h"

typedef struct loom_progress_state {
    loom_progress mode;     /* resolved: BAR, PLAIN or NONE */
    int64_t       log_steps;
    double        last;     /* last bar redraw */
    int           dirty;    /* a bar line is open */
    double        input_wait; /* share of the epoch's step time spent in loom_iter_next, set by the caller */
} loom_progress_state;

void loom_progress_init(loom_progress_state *p, loom_progress mode, int64_t log_steps);
/* epochs: the run's (< 0: unknown, shown as "?"); steps_per_epoch <= 0:
 * unknown; eta_sec < 0: unknown. */
void loom_progress_update(loom_progress_state *p, int64_t epoch, int64_t epochs, int64_t step_in_epoch,
                          int64_t steps_per_epoch, int64_t step, double loss, double acc, double samples_per_sec,
                          double eta_sec);
/* Ends an open bar line before other output. */
void loom_progress_break(loom_progress_state *p);

#endif
