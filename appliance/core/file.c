/* file.c - whole-file reads (plain or gzip), atomic writes, mkdir -p. */
#include "core.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

static int read_plain(const char *path, uint8_t **out, size_t *len, loom_err *err)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return loom_err_set(err, LOOM_EIO, path, "cannot open: %s", strerror(errno));
    struct stat st;
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return loom_err_set(err, LOOM_EIO, path, "not a regular file");
    }
    uint8_t *buf = loom_alloc((size_t)st.st_size + 1);
    if (!buf) {
        close(fd);
        return loom_err_set(err, LOOM_ENOMEM, path, "cannot allocate %lld bytes", (long long)st.st_size);
    }
    size_t got = 0;
    while (got < (size_t)st.st_size) {
        ssize_t k = read(fd, buf + got, (size_t)st.st_size - got);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            int e = errno;
            close(fd);
            loom_free(buf);
            return loom_err_set(err, LOOM_EIO, path, "read failed: %s", k == 0 ? "file shrank" : strerror(e));
        }
        got += (size_t)k;
    }
    close(fd);
    *out = buf;
    *len = got;
    return LOOM_OK;
}

static int gunzip(const char *path, const uint8_t *in, size_t n, uint8_t **out, size_t *len, loom_err *err)
{
    /* ISIZE (last 4 bytes) is the size mod 2^32: a good first guess. */
    size_t cap = n >= 4 ? (size_t)in[n - 4] | (size_t)in[n - 3] << 8 | (size_t)in[n - 2] << 16 | (size_t)in[n - 1] << 24 : 0;
    /* ISIZE is untrusted: deflate cannot expand more than about 1032:1 */
    if (cap < n) cap = n * 4;
    if (cap / 1032 > n) cap = n * 1032;
    uint8_t *buf = loom_alloc(cap + 1);
    if (!buf) return loom_err_set(err, LOOM_ENOMEM, path, "cannot allocate %zu bytes for decompression", cap);
    z_stream z = {0};
    if (inflateInit2(&z, 15 + 32) != Z_OK) {
        loom_free(buf);
        return loom_err_set(err, LOOM_ENOMEM, path, "inflateInit2 failed");
    }
    z.next_in = (Bytef *)in;
    z.avail_in = (uInt)n;
    size_t got = 0;
    int rc;
    for (;;) {
        if (got == cap) {
            uint8_t *nb = loom_realloc(buf, cap * 2 + 1);
            if (!nb) {
                inflateEnd(&z);
                loom_free(buf);
                return loom_err_set(err, LOOM_ENOMEM, path, "cannot allocate %zu bytes for decompression", cap * 2);
            }
            buf = nb;
            cap *= 2;
        }
        z.next_out = buf + got;
        z.avail_out = (uInt)(cap - got);
        rc = inflate(&z, Z_NO_FLUSH);
        got = cap - z.avail_out;
        if (rc == Z_STREAM_END) {
            /* concatenated gzip members are legal */
            if (z.avail_in == 0) break;
            inflateReset(&z);
            continue;
        }
        if (rc == Z_BUF_ERROR && z.avail_in == 0) {
            inflateEnd(&z);
            loom_free(buf);
            return loom_err_set(err, LOOM_EDATA, path, "gzip stream is truncated after %zu decompressed bytes", got);
        }
        if (rc != Z_OK && rc != Z_BUF_ERROR) {
            const char *m = z.msg ? z.msg : "corrupt data";
            loom_err_set(err, LOOM_EDATA, path, "gzip stream is corrupt at byte %lu: %s", (unsigned long)z.total_in, m);
            inflateEnd(&z);
            loom_free(buf);
            return LOOM_EDATA;
        }
    }
    inflateEnd(&z);
    *out = buf;
    *len = got;
    return LOOM_OK;
}

int loom_read_file(const char *path, uint8_t **out, size_t *len, loom_err *err)
{
    uint8_t *raw = NULL;
    size_t n = 0;
    int rc = read_plain(path, &raw, &n, err);
    if (rc) return rc;
    if (n >= 2 && raw[0] == 0x1f && raw[1] == 0x8b) {
        rc = gunzip(path, raw, n, out, len, err);
        loom_free(raw);
        return rc;
    }
    *out = raw;
    *len = n;
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

int loom_write_file_atomic(const char *path, const void *data, size_t len, loom_err *err)
{
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
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
