/* fdlimit.c - what a process that listens needs to survive a connection
 * flood: the descriptor limit raised to the hard limit, connection bounds
 * derived from it, the reserve-descriptor trick for EMFILE, and a rate
 * limit for the log lines an outsider can trigger. Thread-safe except a
 * loom_ratelimit, which belongs to its owner. */
#include "core.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

bool loom_ratelimit_pass(loom_ratelimit *r, uint64_t *suppressed)
{
    double now = loom_now(), interval = r->interval > 0 ? r->interval : 1.0;
    int burst = r->burst > 0 ? r->burst : 1;
    if (!r->started) r->started = true, r->tokens = burst, r->last = now;
    r->tokens += (now - r->last) / interval;
    if (r->tokens > burst) r->tokens = burst;
    r->last = now;
    if (r->tokens < 1.0) {
        r->suppressed++;
        return false;
    }
    r->tokens -= 1.0;
    if (suppressed) *suppressed = r->suppressed;
    r->suppressed = 0;
    return true;
}

long loom_fd_limit_raise(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return loom_fd_limit();
    if (rl.rlim_cur < rl.rlim_max) {
        rlim_t was = rl.rlim_cur;
        rl.rlim_cur = rl.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &rl) != 0) loom_debug("cannot raise the descriptor limit from %llu to %llu: %s",
                                                           (unsigned long long)was, (unsigned long long)rl.rlim_max,
                                                           strerror(errno));
    }
    return loom_fd_limit();
}

long loom_fd_limit(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return 1024;
    return rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur > (1u << 20) ? 1L << 20 : (long)rl.rlim_cur;
}

int loom_fd_bound(int div, int lo, int hi)
{
    long b = loom_fd_limit() / (div > 0 ? div : 1);
    return (int)(b < lo ? lo : b > hi ? hi : b);
}

int loom_fd_reserve_open(void) { return open("/dev/null", O_RDONLY | O_CLOEXEC); }

int loom_fd_reserve_shed(int *reserve, int lfd)
{
    if (*reserve >= 0) close(*reserve);
    *reserve = -1;
    int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd >= 0) close(fd);
    *reserve = loom_fd_reserve_open();
    return fd >= 0 && *reserve >= 0;
}
