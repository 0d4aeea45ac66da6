/* device.c - finding device backends in the registry, and the stager: the
 * double-buffered upload of batches that overlaps the copy of batch k+1
 * (copy stream) with the compute on batch k (compute stream), ordered by
 * stream_wait events both ways, never by a host wait on compute. */
#include "tensor/device.h"

#include <string.h>

const loom_device_ops *loom_device_backend(const char *name) { return loom_registry_find(LOOM_REG_DEVICE, name, NULL); }

int loom_device_gpus(char *why, size_t why_n)
{
    const char *origin = NULL;
    const loom_device_ops *cuda = loom_registry_find(LOOM_REG_DEVICE, "cuda", &origin);
    if (!cuda) {
        snprintf(why, why_n,
                 "no GPU backend: the cuda plugin is not loaded (it is built only where the CUDA toolkit "
                 "is found; `loom plugins` lists the files refused and why)");
        return 0;
    }
    char reason[400] = "";
    int n = cuda->probe(reason, sizeof reason);
    if (n <= 0) snprintf(why, why_n, "the cuda plugin (%s) is loaded but %s", origin, reason);
    return n > 0 ? n : 0;
}

/* ---- the stager ------------------------------------------------------------ */

struct loom_dev_stager {
    const loom_device_ops *ops;
    loom_device *dev;
    size_t bytes;  /* capacity of each slot */
    void *host[2]; /* pinned staging buffers */
    void *buf[2];  /* device buffers */
    int64_t puts, takes;
};

int loom_dev_stager_open(loom_dev_stager **out, const loom_device_ops *ops, loom_device *dev, size_t bytes,
                         loom_err *err)
{
    loom_dev_stager *s = loom_calloc(1, sizeof *s);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, NULL, "out of memory for a device stager");
    *s = (loom_dev_stager){.ops = ops, .dev = dev, .bytes = bytes};
    int rc = LOOM_OK;
    for (int i = 0; i < 2 && !rc; i++) {
        rc = ops->host_alloc(dev, &s->host[i], bytes, err);
        if (!rc) rc = ops->alloc(dev, &s->buf[i], bytes, err);
    }
    if (rc) {
        loom_dev_stager_close(s);
        return rc;
    }
    *out = s;
    return LOOM_OK;
}

void loom_dev_stager_close(loom_dev_stager *s)
{
    if (!s) return;
    loom_err ignored;
    s->ops->synchronize(s->dev, -1, &ignored); /* no copy may still read or write the buffers */
    for (int i = 0; i < 2; i++) {
        if (s->host[i]) s->ops->host_free(s->dev, s->host[i]);
        if (s->buf[i]) s->ops->free(s->dev, s->buf[i]);
    }
    loom_free(s);
}

int loom_dev_stager_put(loom_dev_stager *s, const void *host, size_t bytes, loom_err *err)
{
    LOOM_ASSERT(bytes <= s->bytes && s->puts - s->takes < 2);
    int slot = (int)(s->puts & 1);
    /* the staging buffer's previous upload must be done before it is overwritten */
    int rc = s->ops->synchronize(s->dev, LOOM_DEV_STREAM_COPY, err);
    if (rc) return rc;
    memcpy(s->host[slot], host, bytes);
    /* the device buffer's previous batch may still be read by queued compute */
    rc = s->ops->stream_wait(s->dev, LOOM_DEV_STREAM_COPY, LOOM_DEV_STREAM_COMPUTE, err);
    if (!rc) rc = s->ops->upload(s->dev, LOOM_DEV_STREAM_COPY, s->buf[slot], s->host[slot], bytes, err);
    if (!rc) s->puts++;
    return rc;
}

int loom_dev_stager_take(loom_dev_stager *s, void **dev_buf, loom_err *err)
{
    LOOM_ASSERT(s->takes < s->puts);
    int rc = s->ops->stream_wait(s->dev, LOOM_DEV_STREAM_COMPUTE, LOOM_DEV_STREAM_COPY, err);
    if (rc) return rc;
    *dev_buf = s->buf[s->takes++ & 1];
    return LOOM_OK;
}
