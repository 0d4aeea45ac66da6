/* dir_lock_internal.h - the model_dir lock: two jobs must not write one model_dir.
 * The chief of a job (or a process training alone) holds an flock on
 * <model_dir>/.lock naming its pid, host and task; the other tasks of its
 * job share the directory without it, as TensorFlow's tasks do. A sidecar
 * evaluator holds its event directory's lock the same way. */
#ifndef LOOM_DIR_LOCK_H
#define LOOM_DIR_LOCK_H

#include "cluster/cluster.h"

/* Takes the lock (never waits): *fd holds it until loom_dir_unlock_. Held by
 * another process: LOOM_EIO naming the holder (pid, host, task, since). */
int  loom_dir_lock_(const char *dir, const loom_cluster *cluster, int *fd, loom_err *err);
/* The same for an event directory (<model_dir>/eval_watch, or /eval for a
 * cluster's evaluator task) and its one writer, `who` ("evaluate --watch"):
 * held by another process, LOOM_EIO naming it. */
int  loom_events_lock_(const char *dir, const char *who, int *fd, loom_err *err);
void loom_dir_unlock_(int fd); /* -1 is a no-op; for either lock */

#endif
