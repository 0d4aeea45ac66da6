/* progress.c - a progress bar with ETA on a terminal, plain lines otherwise. */
#include "progress_internal.h"

#include <math.h>

#include <stdio.h>
#include <string.h>
#include <unistd.h>

void loom_progress_init(loom_progress_state *p, loom_progress mode, int64_t log_steps)
{
    memset(p, 0, sizeof *p);
    if (mode == LOOM_PROGRESS_AUTO) mode = isatty(STDERR_FILENO) ? LOOM_PROGRESS_BAR : LOOM_PROGRESS_PLAIN;
    p->mode = mode;
    p->log_steps = log_steps > 0 ? log_steps : 100;
}

static void fmt_time(double s, char *buf, size_t n)
{
    if (s < 0 || s > 1e7) {
        snprintf(buf, n, "?");
        return;
    }
    long t = (long)(s + 0.5);
    if (t >= 3600)
        snprintf(buf, n, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
    else
        snprintf(buf, n, "%ld:%02ld", t / 60, t % 60);
}

void loom_progress_update(loom_progress_state *p, int64_t epoch, int64_t epochs, int64_t step_in_epoch,
                          int64_t steps_per_epoch, int64_t step, double loss, double acc, double samples_per_sec,
                          double eta_sec)
{
    if (p->mode == LOOM_PROGRESS_NONE) return;
    double now = loom_now();
    char eta[32], ac[32] = "";
    fmt_time(eta_sec, eta, sizeof eta);
    if (isfinite(acc)) snprintf(ac, sizeof ac, "  acc %.4f", acc); /* a regression has none */
    char of[24] = "?"; /* the run's epochs; "?" while unknown */
    if (epochs >= 0) snprintf(of, sizeof of, "%lld", (long long)epochs);
    if (p->mode == LOOM_PROGRESS_BAR) {
        /* at most 10 redraws a second, but always an epoch's last step and the run's (nothing left) */
        if (now - p->last < 0.1 && step_in_epoch != steps_per_epoch && eta_sec != 0) return;
        p->last = now;
        char bar[32];
        int width = 24, fill = 0;
        if (steps_per_epoch > 0) fill = (int)(width * step_in_epoch / steps_per_epoch);
        if (fill > width) fill = width;
        for (int i = 0; i < width; i++) bar[i] = i < fill ? '=' : (i == fill ? '>' : ' ');
        bar[width] = 0;
        char total[32] = "?";
        if (steps_per_epoch > 0) snprintf(total, sizeof total, "%lld", (long long)steps_per_epoch);
        fprintf(stderr, "\r\033[Kepoch %lld/%s [%s] %lld/%s  loss %.4f%s  %.0f samples/s  ETA %s",
                (long long)epoch + 1, of, bar, (long long)step_in_epoch, total, loss, ac,
                samples_per_sec, eta);
        fflush(stderr);
        p->dirty = 1;
        return;
    }
    if (step % p->log_steps != 0) return;
    fprintf(stderr, "loom: epoch %lld/%s step %lld (%lld in epoch): loss %.4f%s, %.0f samples/s, input_wait %.1f%%, ETA %s\n",
            (long long)epoch + 1, of, (long long)step, (long long)step_in_epoch, loss, ac + 1,
            samples_per_sec, p->input_wait * 100, eta);
}

void loom_progress_break(loom_progress_state *p)
{
    if (p->dirty) {
        fputc('\n', stderr);
        p->dirty = 0;
    }
}
