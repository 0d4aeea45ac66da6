/* fuzz_image.c - libFuzzer target for decode_image's decoders (libpng and
 * libjpeg-turbo behind image_decode_) and the pixel ops after them. The
 * input's first byte picks the channels (0 to 4) and the dtype (uint8 or
 * float32); the rest is the encoded image, decoded into a buffer for at most
 * 128 x 128 pixels. Built and run by tests/fuzz/run.sh.
 * Invariants checked: no over-read or over-write (ASan); a refusal says why;
 * a success stays inside the bounds (H, W <= 128, C the asked channels or 1
 * to 4), float pixels are in [0, 1]; resize and central_crop's box of the
 * result stay in range. Debian's libpng and libjpeg are not built with
 * coverage instrumentation, so libFuzzer's "cov" counts Loom's side only and
 * mutation is guided by it; the libraries' own memory errors are still caught
 * where they touch Loom's buffers (ASan), and their state is freed on every
 * path (LeakSanitizer). */
#include "data/data_internal.h"

#include <string.h>

#define CHECK(c) do { if (!(c)) __builtin_trap(); } while (0)
#define MAXD 128

static float out[MAXD * MAXD * 4];
static float small[7 * 5 * 4];

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    int channels = data[0] % 5;
    loom_dtype dt = (data[0] >> 3) & 1 ? LOOM_F32 : LOOM_U8;
    image_info ii;
    char why[256] = "";
    int rc = image_decode_(data + 1, size - 1, channels, dt, MAXD, MAXD, out, &ii, why, sizeof why);
    if (rc) {
        CHECK(why[0]);
        return 0;
    }
    CHECK(ii.h >= 1 && ii.h <= MAXD && ii.w >= 1 && ii.w <= MAXD && ii.c >= 1 && ii.c <= 4);
    CHECK(!channels || ii.c == channels);
    size_t n = (size_t)(ii.h * ii.w * ii.c);
    if (dt == LOOM_F32)
        for (size_t i = 0; i < n; i++) CHECK(out[i] >= 0.0f && out[i] <= 1.0f);
    image_resize_(out, dt, ii.h, ii.w, ii.c, small, 7, 5);
    int64_t box[4];
    image_central_box_(ii.h, ii.w, (data[0] >> 4) / 16.0 + 1.0 / 32, box);
    CHECK(box[0] >= 0 && box[1] >= 0 && box[2] >= 1 && box[3] >= 1 && box[0] + box[2] <= ii.h && box[1] + box[3] <= ii.w);
    return 0;
}
