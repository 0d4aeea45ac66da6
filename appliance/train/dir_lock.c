/* dir_lock.c - the model_dir lock and the event directories' writer locks
 * (dir_lock_internal.h). flock, not a pid file: the kernel drops it when the
 * holder dies (kill -9 included), so a stale lock never blocks a restart; the
 * file's text only names the holder. */
#include "dir_lock_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <time.h>
#include <unistd.h>

/* Takes <dir>/.lock for `task`: LOOM_OK, or 1 when another process holds
 * it (holder: its text), or an error. */
static int lock_take(const char *dir, const char *task, int *fd, char holder[512], loom_err *err)
{
    char path[LOOM_PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/.lock", dir);
    *fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (*fd < 0) return loom_err_set(err, LOOM_EIO, path, "cannot open the lock: %s", strerror(errno));
    if (flock(*fd, LOCK_EX | LOCK_NB) != 0) {
        int e = errno;
        ssize_t n = pread(*fd, holder, 511, 0);
        holder[n > 0 ? n : 0] = 0;
        holder[strcspn(holder, "\n")] = 0;
        if (!holder[0]) snprintf(holder, 512, "(unknown holder)");
        close(*fd);
        *fd = -1;
        if (e != EWOULDBLOCK) return loom_err_set(err, LOOM_EIO, path, "flock failed: %s", strerror(e));
        return 1;
    }
    char host[256] = "?", line[512];
    gethostname(host, sizeof host);
    host[sizeof host - 1] = 0;
    time_t now = time(NULL);
    struct tm tm;
    char when[64];
    strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", gmtime_r(&now, &tm));
    int len = snprintf(line, sizeof line, "pid %ld on host %s (%s), since %s\n", (long)getpid(), host, task, when);
    if (ftruncate(*fd, 0) != 0 || pwrite(*fd, line, (size_t)len, 0) != len)
        loom_warn("%s: cannot write the lock holder's name: %s", path, strerror(errno));
    return LOOM_OK;
}

int loom_dir_lock_(const char *dir, const loom_cluster *cluster, int *fd, loom_err *err)
{
    char task[64] = "the only process", who[80], holder[512];
    if (cluster) loom_task_name(cluster->role, cluster->index, task, sizeof task);
    snprintf(who, sizeof who, "task %s", task);
    int rc = lock_take(dir, who, fd, holder, err);
    if (rc != 1) return rc;
    loom_err_set(err, LOOM_EIO, dir, "model_dir is in use by another job: %s", holder);
    return loom_err_hint(err, "two jobs must not share a model_dir: wait for that one to end, stop it, or set "
                         "run.model_dir (or --model-dir) to another directory");
}

int loom_events_lock_(const char *dir, const char *who, int *fd, loom_err *err)
{
    char holder[512];
    int rc = lock_take(dir, who, fd, holder, err);
    if (rc != 1) return rc;
    loom_err_set(err, LOOM_EIO, dir, "the event files here are written by another process: %s", holder);
    return loom_err_hint(err, "one writer per event directory, so that TensorBoard draws one curve: wait for that "
                         "one to end, or stop it");
}

void loom_dir_unlock_(int fd)
{
    if (fd >= 0) close(fd); /* closing drops the flock */
}
