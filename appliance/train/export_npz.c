/* export_npz.c - `loom export --format npz`: the model's variables as an .npz, a zip (stored,
 * no compression) of one .npy (v1.0, little-endian float32, C order) per parameter tensor, named
 * as `loom inspect` lists them: np.load(path)["dense_1/kernel"].
 * Kept apart from export.c's ONNX writer, with which it shares nothing but the command.
 *
 * Threads: the main thread. */
#include "train.h"
#include "export_internal.h"

#include <stdio.h>
#include <zlib.h>

static void put_u16(loom_buf *b, uint16_t v) { loom_buf_put(b, (uint8_t[]){v & 0xff, v >> 8}, 2); }
static void put_u32le(loom_buf *b, uint32_t v) { loom_buf_put_u32(b, v); } /* loom_buf is little-endian */

int loom_export_npz_(loom_model *m, const char *output, loom_err *err)
{
    loom_buf zip, cdir, npy;
    loom_buf_init(&zip), loom_buf_init(&cdir), loom_buf_init(&npy);
    int n = loom_model_num_param_tensors(m);
    const float *params = loom_model_params(m);
    for (int i = 0; i < n; i++) {
        const loom_param_info *p = loom_model_param_tensor(m, i);
        /* .npy v1.0: magic, version, header length, a dict padded to 64 bytes with a newline */
        char hdr[256], shape[160] = "";
        size_t sl = 0;
        for (int d = 0; d < p->shape.rank; d++)
            sl += (size_t)snprintf(shape + sl, sizeof shape - sl, "%lld,%s", (long long)p->shape.dim[d],
                                   p->shape.rank > 1 && d < p->shape.rank - 1 ? " " : "");
        if (p->shape.rank > 1) shape[sl - 1] = 0; /* "(784, 128)" but "(128,)" */
        int hl = snprintf(hdr, sizeof hdr, "{'descr': '<f4', 'fortran_order': False, 'shape': (%s), }", shape);
        int total = 10 + hl + 1;
        int pad = (64 - total % 64) % 64;
        npy.len = 0;
        loom_buf_put(&npy, "\x93NUMPY\x01\x00", 8);
        put_u16(&npy, (uint16_t)(hl + pad + 1));
        loom_buf_put(&npy, hdr, (size_t)hl);
        for (int k = 0; k < pad; k++) loom_buf_put(&npy, " ", 1);
        loom_buf_put(&npy, "\n", 1);
        loom_buf_put(&npy, params + p->offset, (size_t)loom_shape_numel(&p->shape) * sizeof(float));
        if (npy.len > 0xffffffffu) {
            loom_buf_fini(&zip), loom_buf_fini(&cdir), loom_buf_fini(&npy);
            return loom_err_set(err, LOOM_EUNSUPPORTED, p->name, "over 4 GiB: npz without zip64 cannot hold it");
        }
        char name[128];
        int nl = snprintf(name, sizeof name, "%s.npy", p->name);
        uint32_t crc = (uint32_t)crc32(0L, npy.data, (uInt)npy.len);
        uint32_t off = (uint32_t)zip.len;
        /* local file header: stored, no data descriptor; DOS time 1980-01-01 */
        put_u32le(&zip, 0x04034b50);
        put_u16(&zip, 20), put_u16(&zip, 0), put_u16(&zip, 0), put_u16(&zip, 0), put_u16(&zip, 0x21);
        put_u32le(&zip, crc), put_u32le(&zip, (uint32_t)npy.len), put_u32le(&zip, (uint32_t)npy.len);
        put_u16(&zip, (uint16_t)nl), put_u16(&zip, 0);
        loom_buf_put(&zip, name, (size_t)nl);
        loom_buf_put(&zip, npy.data, npy.len);
        /* its central directory entry */
        put_u32le(&cdir, 0x02014b50);
        put_u16(&cdir, 20), put_u16(&cdir, 20), put_u16(&cdir, 0), put_u16(&cdir, 0), put_u16(&cdir, 0),
            put_u16(&cdir, 0x21);
        put_u32le(&cdir, crc), put_u32le(&cdir, (uint32_t)npy.len), put_u32le(&cdir, (uint32_t)npy.len);
        put_u16(&cdir, (uint16_t)nl), put_u16(&cdir, 0), put_u16(&cdir, 0), put_u16(&cdir, 0), put_u16(&cdir, 0);
        put_u32le(&cdir, 0), put_u32le(&cdir, off);
        loom_buf_put(&cdir, name, (size_t)nl);
    }
    uint32_t cd_off = (uint32_t)zip.len;
    loom_buf_put(&zip, cdir.data, cdir.len);
    put_u32le(&zip, 0x06054b50);
    put_u16(&zip, 0), put_u16(&zip, 0), put_u16(&zip, (uint16_t)n), put_u16(&zip, (uint16_t)n);
    put_u32le(&zip, (uint32_t)cdir.len), put_u32le(&zip, cd_off), put_u16(&zip, 0);
    int rc = zip.failed || cdir.failed || npy.failed ? loom_err_set(err, LOOM_ENOMEM, NULL, "building the npz")
                                                     : loom_write_file_atomic(output, zip.data, zip.len, err);
    loom_buf_fini(&zip), loom_buf_fini(&cdir), loom_buf_fini(&npy);
    return rc;
}
