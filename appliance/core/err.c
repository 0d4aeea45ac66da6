/* err.c - error values, logging, assertions. */
#include "core.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static const char *const err_names[] = {
#define X_(name, msg) #name,
    LOOM_ERRORS(X_)
#undef X_
};
static const char *const err_strings[] = {
#define X_(name, msg) msg,
    LOOM_ERRORS(X_)
#undef X_
};

const char *loom_err_name(int code)
{
    return code >= 0 && code < LOOM_ENUM_ERRORS_ ? err_names[code] : "UNKNOWN";
}

const char *loom_err_string(int code)
{
    return code >= 0 && code < LOOM_ENUM_ERRORS_ ? err_strings[code] : "unknown error";
}

int loom_err_set(loom_err *err, int code, const char *where, const char *fmt, ...)
{
    if (!err) return code;
    err->code = code;
    snprintf(err->where, sizeof err->where, "%s", where ? where : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    err->hint[0] = 0;
    return code;
}

int loom_err_hint(loom_err *err, const char *fmt, ...)
{
    if (!err) return LOOM_EOK;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->hint, sizeof err->hint, fmt, ap);
    va_end(ap);
    return err->code;
}

int loom_err_prefix(loom_err *err, const char *fmt, ...)
{
    if (!err) return LOOM_EOK;
    char pre[256], old[sizeof err->msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(pre, sizeof pre, fmt, ap);
    va_end(ap);
    memcpy(old, err->msg, sizeof old);
    size_t a = strlen(pre), b = strlen(old);
    if (a + 2 >= sizeof err->msg) a = sizeof err->msg - 3;
    if (a + 2 + b >= sizeof err->msg) b = sizeof err->msg - 3 - a;
    memcpy(err->msg, pre, a);
    memcpy(err->msg + a, ": ", 2);
    memcpy(err->msg + a + 2, old, b);
    err->msg[a + 2 + b] = 0;
    return err->code;
}

/* set from the thread that turns a caught signal into an error, read by main */
static volatile sig_atomic_t stop_signal_;
void loom_stop_signal_note(int sig) { stop_signal_ = sig; }
int  loom_stop_signal(void) { return stop_signal_; }

void loom_err_clear(loom_err *err)
{
    if (err) memset(err, 0, sizeof *err);
}

void loom_err_format(const loom_err *err, char *buf, size_t n)
{
    int k = 0;
    if (err->where[0])
        k = snprintf(buf, n, "%s: %s\n", err->where, err->msg);
    else
        k = snprintf(buf, n, "%s\n", err->msg);
    if (err->hint[0] && k >= 0 && (size_t)k < n) snprintf(buf + k, n - (size_t)k, "  hint: %s\n", err->hint);
}

_Noreturn void loom_assert_fail_(const char *cond, const char *file, int line)
{
    fprintf(stderr, "loom: internal error: assertion `%s` failed at %s:%d\n", cond, file, line);
    abort();
}

static loom_log_level log_level = LOOM_LOG_INFO;
static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;

void loom_log_set_level(loom_log_level lvl) { log_level = lvl; }

static char log_name[64];
void loom_log_set_name(const char *name) { snprintf(log_name, sizeof log_name, "%s", name ? name : ""); }
loom_log_level loom_log_get_level(void) { return log_level; }

void loom_log(loom_log_level lvl, const char *fmt, ...)
{
    if (lvl < log_level) return;
    static const char *const tag[] = {"debug", "info", "warning", "error"};
    char line[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&log_lock);
    const char *o = log_name[0] ? "[" : "", *c = log_name[0] ? "]" : "";
    if (lvl == LOOM_LOG_INFO)
        fprintf(stderr, "loom%s%s%s: %s\n", o, log_name, c, line);
    else
        fprintf(stderr, "loom%s%s%s: %s: %s\n", o, log_name, c, tag[lvl], line);
    pthread_mutex_unlock(&log_lock);
}

double loom_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

double loom_wall_time(void)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int loom_edit_distance(const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b);
    if (la > 63 || lb > 63) return 64;
    int d[64][64];
    for (size_t i = 0; i <= la; i++) d[i][0] = (int)i;
    for (size_t j = 0; j <= lb; j++) d[0][j] = (int)j;
    for (size_t i = 1; i <= la; i++)
        for (size_t j = 1; j <= lb; j++) {
            int c = d[i - 1][j - 1] + (a[i - 1] != b[j - 1]);
            if (d[i - 1][j] + 1 < c) c = d[i - 1][j] + 1;
            if (d[i][j - 1] + 1 < c) c = d[i][j - 1] + 1;
            /* adjacent transposition */
            if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] && d[i - 2][j - 2] + 1 < c)
                c = d[i - 2][j - 2] + 1;
            d[i][j] = c;
        }
    return d[la][lb];
}
