/* summary_internal.h - TensorBoard event files, written as TensorFlow writes them
 * (tf_semantics §2): <dir>/events.out.tfevents.<secs>.<host>.<pid>.<n>, a
 * TFRecord stream of Event protos opening with file_version "brain.Event:2".
 * Scalars (simple_value), histograms (HistogramProto with TF's default
 * buckets) and text (a DT_STRING tensor with plugin "text", as TF 2 writes).
 *
 * One writer per directory per process, from one thread (the trainer's; in a
 * cluster only the chief opens one). A new file per open: a resumed run adds
 * a file beside the old ones and never appends to another process's file.
 * Events are buffered; loom_summary_flush writes them (the trainer flushes at
 * each summary point), loom_summary_close flushes and closes. */
#ifndef LOOM_SUMMARY_H
#define LOOM_SUMMARY_H

#include "config/config.h" /* LOOM_PATH_MAX */

typedef struct loom_summary loom_summary; /* opaque */

/* Creates dir (and its parents) and a new event file in it, then writes and
 * flushes the file_version event. When resume_step >= 0 (the checkpoint's
 * step) it then writes a SessionLog START at resume_step + 1, which makes
 * TensorBoard drop the points a killed run wrote after its last checkpoint,
 * so the curve stays one line.
 * Errors name the directory and say what to do. Free with loom_summary_close. */
int loom_summary_open(loom_summary **out, const char *dir, int64_t resume_step, loom_err *err);

/* The event file's path (borrowed). */
const char *loom_summary_path(const loom_summary *s);

/* Event{wall_time, step, summary{value{tag, simple_value=(float)value}}}. */
int loom_summary_scalar(loom_summary *s, const char *tag, int64_t step, double value, loom_err *err);

/* Event{..., summary{value{tag, histo=HistogramProto}}} of n values (min, max,
 * num, sum, sum_squares and TF's default exponential buckets, runs of empty
 * buckets merged as TF's Histogram::EncodeToProto does). Non-finite values
 * are left out of the histogram. */
int loom_summary_histogram(loom_summary *s, const char *tag, int64_t step, const float *v, int64_t n, loom_err *err);

/* A text summary: Value{tag, metadata{plugin_data{plugin_name "text"}},
 * tensor{dtype DT_STRING, shape [] , string_val text}}; TensorBoard renders
 * it as Markdown. */
int loom_summary_text(loom_summary *s, const char *tag, int64_t step, const char *text, size_t len, loom_err *err);

/* Writes the buffered events to the file. */
int loom_summary_flush(loom_summary *s, loom_err *err);

/* Flushes and closes; returns the first error of the flush or close.
 * NULL is a no-op (LOOM_OK). */
int loom_summary_close(loom_summary *s, loom_err *err);

/* TF's default histogram bucket limits (-DBL_MAX, ..., -1e-12, 0, 1e-12, ...,
 * DBL_MAX: powers of 1.1 from 1e-12 below 1e20, both signs) into out (NULL:
 * only count); returns how many there are (LOOM_SUMMARY_BUCKETS). */
#define LOOM_SUMMARY_BUCKETS 1551
int loom_summary_default_buckets(double *out);

#endif
