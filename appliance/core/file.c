/* file.c - the one way loom opens a user's file for reading (regular files
 * only, never blocking on a FIFO), streaming reads (plain or gzip), whole-file
 * reads, atomic writes, mkdir -p, stale temporary files. */
#include "core.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <signal.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>
#include <stdbool.h>

/* What a file of mode m is, for messages: "a FIFO (named pipe)", ... */
static const char *kind_of(mode_t m)
{
    return S_ISREG(m)    ? "a regular file"
           : S_ISFIFO(m) ? "a FIFO (named pipe)"
           : S_ISDIR(m)  ? "a directory"
           : S_ISCHR(m)  ? "a character device"
           : S_ISBLK(m)  ? "a block device"
           : S_ISSOCK(m) ? "a socket"
           : S_ISLNK(m)  ? "a symbolic link"
                         : "not a regular file";
}

/* Keeps fd, opened with O_NONBLOCK, if it is a regular file (and clears
 * O_NONBLOCK); otherwise closes it and says what path is instead. */
static int keep_regular(int fd, const char *path, const char *hint, loom_err *err)
{
    struct stat st;
    if (fstat(fd, &st) < 0) {
        int e = errno;
        close(fd);
        return loom_err_set(err, LOOM_EIO, path, "cannot stat: %s", strerror(e)), -1;
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        loom_err_set(err, LOOM_EIO, path, "is %s, not a regular file: refused", kind_of(st.st_mode));
        loom_err_hint(err, "%s", hint);
        return -1;
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0) fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    return fd;
}

/* fd as a FILE in mode; closes fd on failure. */
static FILE *file_of(int fd, const char *mode, const char *path, loom_err *err)
{
    if (fd < 0) return NULL;
    FILE *f = fdopen(fd, mode);
    if (!f) {
        int e = errno;
        close(fd);
        loom_err_set(err, LOOM_ENOMEM, path, "fdopen failed: %s", strerror(e));
    }
    return f;
}

int loom_open_regular(const char *path, loom_err *err)
{
    /* O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) return loom_err_set(err, LOOM_EIO, path, "cannot open: %s", strerror(errno)), -1;
    return keep_regular(fd, path, "loom reads configs, data, checkpoints, Lua files and plugins from regular files only",
                        err);
}

FILE *loom_fopen_regular(const char *path, loom_err *err)
{
    return file_of(loom_open_regular(path, err), "rb", path, err);
}

FILE *loom_fopen_append_regular(const char *path, loom_err *err)
{
    static const char hint[] = "loom appends its records to regular files only: remove it";
    /* O_NONBLOCK: a FIFO with no reader fails (ENXIO) instead of waiting; with one it is refused below */
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NONBLOCK | O_NOCTTY, 0644);
    struct stat st;
    if (fd < 0 && errno == ENXIO && stat(path, &st) == 0 && S_ISFIFO(st.st_mode)) {
        loom_err_set(err, LOOM_EIO, path, "is a FIFO (named pipe), not a regular file: refused");
        loom_err_hint(err, "%s", hint);
        return NULL;
    }
    if (fd < 0) return loom_err_set(err, LOOM_EIO, path, "cannot open for appending: %s", strerror(errno)), NULL;
    return file_of(keep_regular(fd, path, hint, err), "a", path, err);
}

/* ---- streaming reader: plain or gzip ---------------------------------------- */

#define RF_CHUNK 65536

struct loom_rfile {
    int fd;
    bool gz, eof, zdone;
    z_stream z;
    uint8_t *in; /* RF_CHUNK compressed bytes (gzip only) */
    uint64_t out_total;
    char path[4096];
};

int loom_rfile_open(loom_rfile **out, const char *path, loom_err *err)
{
    *out = NULL;
    loom_rfile *f = loom_alloc(sizeof *f);
    if (!f) return loom_err_set(err, LOOM_ENOMEM, path, "cannot allocate a file reader");
    memset(f, 0, sizeof *f);
    snprintf(f->path, sizeof f->path, "%s", path);
    if ((f->fd = loom_open_regular(path, err)) < 0) {
        loom_free(f);
        return err ? err->code : LOOM_EIO;
    }
    uint8_t magic[2];
    ssize_t k;
    do k = pread(f->fd, magic, 2, 0);
    while (k < 0 && errno == EINTR);
    if (k == 2 && magic[0] == 0x1f && magic[1] == 0x8b) {
        f->gz = true;
        f->in = loom_alloc(RF_CHUNK);
        if (!f->in || inflateInit2(&f->z, 15 + 32) != Z_OK) {
            close(f->fd);
            loom_free(f->in);
            loom_free(f);
            return loom_err_set(err, LOOM_ENOMEM, path, "cannot set up gzip decompression");
        }
    }
    *out = f;
    return LOOM_OK;
}

bool loom_rfile_is_gzip(const loom_rfile *f) { return f->gz; }

static int raw_read(loom_rfile *f, uint8_t *buf, size_t n, size_t *got, loom_err *err)
{
    *got = 0;
    while (*got < n) {
        ssize_t k = read(f->fd, buf + *got, n - *got);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) return loom_err_set(err, LOOM_EIO, f->path, "read failed: %s", strerror(errno));
        if (k == 0) break;
        *got += (size_t)k;
    }
    return LOOM_OK;
}

int loom_rfile_read(loom_rfile *f, void *buf, size_t n, size_t *got, loom_err *err)
{
    if (!f->gz) return raw_read(f, buf, n, got, err);
    *got = 0;
    uint8_t *o = buf;
    while (*got < n && !f->zdone) {
        if (f->z.avail_in == 0 && !f->eof) {
            size_t k;
            int rc = raw_read(f, f->in, RF_CHUNK, &k, err);
            if (rc) return rc;
            if (k == 0) f->eof = true;
            f->z.next_in = f->in;
            f->z.avail_in = (uInt)k;
        }
        size_t want = n - *got;
        if (want > (1u << 30)) want = 1u << 30;
        f->z.next_out = o + *got;
        f->z.avail_out = (uInt)want;
        int zr = inflate(&f->z, Z_NO_FLUSH);
        *got += want - f->z.avail_out;
        f->out_total += want - f->z.avail_out;
        if (zr == Z_STREAM_END) {
            /* concatenated gzip members are legal: go on if more input follows */
            if (f->z.avail_in == 0 && !f->eof) {
                size_t k;
                int rc = raw_read(f, f->in, RF_CHUNK, &k, err);
                if (rc) return rc;
                if (k == 0) f->eof = true;
                f->z.next_in = f->in;
                f->z.avail_in = (uInt)k;
            }
            if (f->z.avail_in == 0) f->zdone = true;
            else inflateReset(&f->z);
            continue;
        }
        if (zr == Z_BUF_ERROR && f->z.avail_in == 0 && f->eof)
            return loom_err_set(err, LOOM_EDATA, f->path, "gzip stream is truncated after %llu decompressed bytes",
                                (unsigned long long)f->out_total);
        if (zr != Z_OK && zr != Z_BUF_ERROR)
            return loom_err_set(err, LOOM_EDATA, f->path, "gzip stream is corrupt at byte %lu: %s",
                                (unsigned long)f->z.total_in, f->z.msg ? f->z.msg : "corrupt data");
    }
    return LOOM_OK;
}

void loom_rfile_close(loom_rfile *f)
{
    if (!f) return;
    if (f->gz) inflateEnd(&f->z);
    close(f->fd);
    loom_free(f->in);
    loom_free(f);
}

int loom_read_file_max(const char *path, uint8_t **out, size_t *len, uint64_t max, loom_err *err)
{
    *out = NULL;
    *len = 0;
    loom_rfile *f;
    int rc = loom_rfile_open(&f, path, err);
    if (rc) return rc;
    size_t cap = 0;
    if (!f->gz) {
        struct stat st;
        if (fstat(f->fd, &st) == 0) cap = (size_t)st.st_size + 1; /* + 1: the end is seen without growing */
    }
    if (cap < 4096) cap = 4096;
    if (max && cap > max) cap = (size_t)max + 1;
    uint8_t *buf = loom_alloc(cap + 1);
    size_t n = 0;
    while (buf) {
        if (n == cap) {
            if (max && cap > max) break;
            size_t nc = cap * 2;
            if (max && nc > max) nc = (size_t)max + 1;
            uint8_t *nb = loom_realloc(buf, nc + 1);
            if (!nb) {
                loom_free(buf);
                buf = NULL;
                break;
            }
            buf = nb;
            cap = nc;
        }
        size_t got;
        if ((rc = loom_rfile_read(f, buf + n, cap - n, &got, err))) break;
        n += got;
        if (n < cap) break; /* end of file */
    }
    loom_rfile_close(f);
    if (!buf) return loom_err_set(err, LOOM_ENOMEM, path, "cannot allocate %zu bytes to read the file", cap * 2);
    if (!rc && max && n > max)
        rc = loom_err_set(err, LOOM_EDATA, path, "file is larger than the %llu bytes expected here", (unsigned long long)max);
    if (rc) {
        loom_free(buf);
        return rc;
    }
    buf[n] = 0;
    *out = buf;
    *len = n;
    return LOOM_OK;
}

int loom_read_file(const char *path, uint8_t **out, size_t *len, loom_err *err)
{
    return loom_read_file_max(path, out, len, 0, err);
}

/* ---- writing a user's path ----------------------------------------------------- */

#define OUTPUT_HINT                                                                                                  \
    "loom writes to a new path or over a regular file (a symbolic link to one is written through): name another "    \
    "path, or remove this one"

int loom_output_target(const char *path, char *target, size_t n, loom_err *err)
{
    struct stat st;
    if (lstat(path, &st) < 0) {
        if (errno != ENOENT && errno != ENOTDIR)
            return loom_err_set(err, LOOM_EIO, path, "cannot stat the output: %s", strerror(errno));
        /* absent: created (a missing directory is the create's error, naming it) */
    } else if (S_ISLNK(st.st_mode)) {
        char *real = realpath(path, NULL);
        if (!real) {
            int e = errno;
            loom_err_set(err, LOOM_EIO, path, "is a symbolic link that does not resolve (%s): refused, nothing was "
                         "written", strerror(e));
            return loom_err_hint(err, "point it at a regular file or remove it; " OUTPUT_HINT);
        }
        struct stat rt;
        int bad = stat(real, &rt) < 0 ? errno : 0;
        if (bad || !S_ISREG(rt.st_mode)) {
            loom_err_set(err, LOOM_EIO, path, "is a symbolic link to %s, which is %s: refused, nothing was written",
                         real, bad ? strerror(bad) : kind_of(rt.st_mode));
            free(real);
            return loom_err_hint(err, "%s", OUTPUT_HINT);
        }
        int k = snprintf(target, n, "%s", real);
        free(real);
        if (k < 0 || (size_t)k >= n)
            return loom_err_set(err, LOOM_EIO, path, "the symbolic link's target is longer than %zu bytes", n - 1);
        return LOOM_OK;
    } else if (!S_ISREG(st.st_mode)) {
        loom_err_set(err, LOOM_EIO, path, "is %s, not a regular file: refused, nothing was written",
                     kind_of(st.st_mode));
        return loom_err_hint(err, "%s", OUTPUT_HINT);
    }
    int k = snprintf(target, n, "%s", path);
    if (k < 0 || (size_t)k >= n) return loom_err_set(err, LOOM_EIO, path, "the path is longer than %zu bytes", n - 1);
    return LOOM_OK;
}

static int fsync_dir(const char *path)
{
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s", path);
    int fd = open(dirname(tmp), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return -1;
    int rc = fsync(fd);
    close(fd);
    return rc;
}

int loom_write_file_atomic(const char *user_path, const void *data, size_t len, loom_err *err)
{
    char path[4096], tmp[4096 + 128], sfx[128];
    int rc = loom_output_target(user_path, path, sizeof path, err);
    if (rc) return rc;
    snprintf(tmp, sizeof tmp, "%s%s", path, loom_tmp_suffix(sfx, sizeof sfx));
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return loom_err_set(err, LOOM_EIO, tmp, "cannot create: %s", strerror(errno));
    const uint8_t *p = data;
    size_t left = len;
    while (left) {
        ssize_t k = write(fd, p, left);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) {
            int e = errno;
            close(fd);
            unlink(tmp);
            return loom_err_set(err, LOOM_EIO, tmp, "write failed: %s", strerror(e));
        }
        p += k;
        left -= (size_t)k;
    }
    if (fsync(fd) < 0) {
        int e = errno;
        close(fd);
        unlink(tmp);
        return loom_err_set(err, LOOM_EIO, tmp, "fsync failed: %s", strerror(e));
    }
    close(fd);
    if (rename(tmp, path) < 0) {
        int e = errno;
        unlink(tmp);
        return loom_err_set(err, LOOM_EIO, path, "rename from %s failed: %s", tmp, strerror(e));
    }
    fsync_dir(path);
    return LOOM_OK;
}

struct loom_wfile {
    FILE *f;
    char  target[4096];       /* where it lands: the path, or its symbolic link's target */
    char  tmp[4096 + 128];    /* target.tmp.<host>.<pid> */
};

int loom_wfile_open(loom_wfile **out, const char *path, loom_err *err)
{
    *out = NULL;
    loom_wfile *w = loom_calloc(1, sizeof *w);
    if (!w) return loom_err_set(err, LOOM_ENOMEM, path, "cannot allocate a file writer");
    int rc = loom_output_target(path, w->target, sizeof w->target, err);
    if (rc) {
        loom_free(w);
        return rc;
    }
    char sfx[128];
    snprintf(w->tmp, sizeof w->tmp, "%s%s", w->target, loom_tmp_suffix(sfx, sizeof sfx));
    int fd = open(w->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0 || !(w->f = fdopen(fd, "w"))) {
        int e = errno;
        if (fd >= 0) close(fd), unlink(w->tmp);
        loom_err_set(err, LOOM_EIO, path, "cannot create %s: %s", w->tmp, strerror(e));
        loom_free(w);
        return LOOM_EIO;
    }
    *out = w;
    return LOOM_OK;
}

FILE *loom_wfile_stream(loom_wfile *w) { return w->f; }

int loom_wfile_commit(loom_wfile *w, loom_err *err)
{
    int rc = LOOM_OK;
    if (fflush(w->f) != 0 || ferror(w->f))
        rc = loom_err_set(err, LOOM_EIO, w->tmp, "write failed: %s", strerror(errno));
    else if (fsync(fileno(w->f)) < 0) rc = loom_err_set(err, LOOM_EIO, w->tmp, "fsync failed: %s", strerror(errno));
    if (fclose(w->f) != 0 && !rc) rc = loom_err_set(err, LOOM_EIO, w->tmp, "write failed: %s", strerror(errno));
    w->f = NULL;
    if (!rc && rename(w->tmp, w->target) < 0)
        rc = loom_err_set(err, LOOM_EIO, w->target, "rename from %s failed: %s", w->tmp, strerror(errno));
    if (rc) unlink(w->tmp);
    else fsync_dir(w->target);
    loom_free(w);
    return rc;
}

void loom_wfile_abort(loom_wfile *w)
{
    if (!w) return;
    if (w->f) fclose(w->f);
    unlink(w->tmp);
    loom_free(w);
}

int loom_mkdirs(const char *path, loom_err *err)
{
    char tmp[4096];
    size_t n = strlen(path);
    if (n == 0 || n >= sizeof tmp) return loom_err_set(err, LOOM_EIO, path, "bad directory path");
    memcpy(tmp, path, n + 1);
    for (char *p = tmp + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(tmp, 0755) < 0 && errno != EEXIST)
            return loom_err_set(err, LOOM_EIO, path, "cannot create directory %s: %s", tmp, strerror(errno));
        *p = '/';
    }
    if (mkdir(tmp, 0755) < 0 && errno != EEXIST)
        return loom_err_set(err, LOOM_EIO, path, "cannot create directory: %s", strerror(errno));
    struct stat st;
    if (stat(tmp, &st) < 0 || !S_ISDIR(st.st_mode)) return loom_err_set(err, LOOM_EIO, path, "exists and is not a directory");
    if (access(tmp, W_OK | X_OK) < 0) return loom_err_set(err, LOOM_EIO, path, "directory is not writable: %s", strerror(errno));
    return LOOM_OK;
}

char *loom_path_normalize(char *path)
{
    bool abs = path[0] == '/';
    char *out = path, *seg = path; /* out: where the next component goes; seg: reads */
    size_t kept = 0;                  /* components kept that a ".." may remove */
    while (*seg) {
        while (*seg == '/') seg++;
        if (!*seg) break;
        char *end = seg;
        while (*end && *end != '/') end++;
        size_t len = (size_t)(end - seg);
        if (len == 1 && seg[0] == '.') {
            /* "." adds nothing */
        } else if (len == 2 && seg[0] == '.' && seg[1] == '.' && kept > 0) {
            out--; /* back over the last component and the '/' before it */
            while (out > path && *out != '/') out--;
            if (out == path && !abs) *out = 0;
            kept--;
        } else if (len == 2 && seg[0] == '.' && seg[1] == '.' && abs) {
            /* "/.." is "/" */
        } else {
            if (out > path || abs) *out++ = '/';
            memmove(out, seg, len);
            out += len;
            kept += !(len == 2 && seg[0] == '.' && seg[1] == '.'); /* a leading ".." of a relative path stays */
        }
        seg = end;
    }
    if (out == path) {
        if (abs) *out++ = '/';
        else *out++ = '.';
    }
    *out = 0;
    return path;
}

int loom_glob_escape(const char *s, char *out, size_t n)
{
    size_t k = 0;
    for (const char *p = s; *p; p++) {
        if (strchr("*?[]\\", *p)) {
            if (k + 1 >= n) return -1;
            out[k++] = '\\';
        }
        if (k + 1 >= n) return -1;
        out[k++] = *p;
    }
    out[k] = 0;
    return (int)k;
}

/* This host's name as it appears in temporary file names. */
static void tmp_host(char *out, size_t n)
{
    char h[256] = "";
    if (gethostname(h, sizeof h - 1) < 0 || !h[0]) snprintf(h, sizeof h, "localhost");
    size_t k = 0;
    for (const char *p = h; *p && k + 1 < n && k < 64; p++)
        out[k++] = (isalnum((unsigned char)*p) || *p == '-' || *p == '_') ? *p : '_';
    out[k] = 0;
}

char *loom_tmp_suffix(char *buf, size_t n)
{
    char host[80];
    tmp_host(host, sizeof host);
    snprintf(buf, n, ".tmp.%s.%ld", host, (long)getpid());
    return buf;
}

int loom_remove_stale_tmp(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) return 0;
    int removed = 0;
    char host[80];
    tmp_host(host, sizeof host);
    size_t hl = strlen(host);
    struct dirent *e;
    while ((e = readdir(d))) {
        const char *t = strstr(e->d_name, ".tmp.");
        if (!t || t == e->d_name) continue;
        const char *p = t + 5;
        while (strstr(p, ".tmp.")) p = strstr(p, ".tmp.") + 5; /* the last ".tmp." */
        const char *dot = strrchr(p, '.');
        if (dot) { /* <host>.<pid>: another host's process may be alive, whatever its pid is here */
            if ((size_t)(dot - p) != hl || strncmp(p, host, hl)) continue;
            p = dot + 1;
        }
        char *end;
        errno = 0;
        long pid = strtol(p, &end, 10);
        if (*p < '0' || *p > '9' || *end || errno || pid <= 0 || pid > INT32_MAX) continue;
        if (pid == (long)getpid() || kill((pid_t)pid, 0) == 0 || errno == EPERM) continue; /* alive */
        char path[4096 + 300];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        struct stat st;
        if (lstat(path, &st) < 0 || !S_ISREG(st.st_mode)) continue;
        if (unlink(path) == 0) {
            loom_info("%s: removed a temporary file left by process %ld, which is gone", path, pid);
            removed++;
        } else {
            loom_warn("%s: cannot remove a stale temporary file: %s", path, strerror(errno));
        }
    }
    closedir(d);
    return removed;
}
