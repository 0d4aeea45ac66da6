/* image.c - the pixel work of the image maps: PNG (libpng) and JPEG
 * (libjpeg-turbo) decoding into (H, W, C) uint8 or float32, bilinear resize
 * with tf.image.resize's half-pixel centres, tf.image.central_crop's box, and
 * tf.image's brightness and contrast adjustments. Each follows TensorFlow's
 * kernel (tensorflow/core/lib/png/png_io.cc, jpeg_mem.cc, resize_bilinear_op.cc,
 * image_ops.py) so a pipeline moved from tf.data sees the same values.
 * Reentrant: libpng and libjpeg state lives within one call, so data workers
 * decode at the same time; nothing here allocates except inside the libraries. */
#include "data/data_internal.h"

#include <math.h>
#include <setjmp.h>
#include <stdio.h>
#include <string.h>

#include <jerror.h>
#include <jpeglib.h>
#include <png.h>

const char *image_format_(const uint8_t *p, size_t n)
{
    static const uint8_t png_sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
    if (n >= 8 && !memcmp(p, png_sig, 8)) return "PNG";
    if (n >= 3 && p[0] == 0xFF && p[1] == 0xD8 && p[2] == 0xFF) return "JPEG";
    return NULL;
}

/* n values of `bits` (8 or 16, 16 in host order) at the end of out's n*4
 * bytes, widened in place to float32 in [0, 1] as tf.image.convert_image_dtype
 * does (x * (1 / max) in float). Forward is safe: value i is read before the
 * write of float i reaches it. */
static void widen_to_f32(uint8_t *out, size_t n, int bits)
{
    float *o = (float *)out;
    if (bits == 8) {
        const uint8_t *s = out + n * 3;
        const float k = (float)(1.0 / 255.0);
        for (size_t i = 0; i < n; i++) o[i] = (float)s[i] * k;
    } else {
        const uint8_t *s = out + n * 2;
        const float k = (float)(1.0 / 65535.0);
        for (size_t i = 0; i < n; i++) {
            uint16_t v;
            memcpy(&v, s + 2 * i, 2);
            o[i] = (float)v * k;
        }
    }
}

/* ---- PNG ------------------------------------------------------------------ */

typedef struct png_src {
    const uint8_t *p;
    size_t         n, pos;
    char          *why;
    size_t         whyn;
} png_src;

static void png_err_cb(png_structp png, png_const_charp msg)
{
    png_src *s = png_get_error_ptr(png);
    snprintf(s->why, s->whyn, "corrupt PNG: %s", msg);
    png_longjmp(png, 1);
}

static void png_warn_cb(png_structp png, png_const_charp msg) { (void)png, (void)msg; } /* ancillary trouble: decode on */

static void png_read_cb(png_structp png, png_bytep out, size_t k)
{
    png_src *s = png_get_io_ptr(png);
    if (k > s->n - s->pos) png_error(png, "the data ends inside the image (truncated)");
    memcpy(out, s->p + s->pos, k);
    s->pos += k;
}

static int decode_png(const uint8_t *data, size_t len, int channels, loom_dtype dt, int64_t max_h, int64_t max_w,
                      uint8_t *out, image_info *info, char *why, size_t whyn)
{
    png_src src = {data, len, 0, why, whyn};
    png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &src, png_err_cb, png_warn_cb);
    png_infop pi = png ? png_create_info_struct(png) : NULL;
    if (!pi) {
        png_destroy_read_struct(&png, NULL, NULL);
        snprintf(why, whyn, "out of memory starting libpng");
        return -1;
    }
    volatile int rc = -1;
    if (setjmp(png_jmpbuf(png))) goto done;
    png_set_read_fn(png, &src, png_read_cb);
    png_set_chunk_malloc_max(png, 1 << 20); /* text and other ancillary chunks: a hostile file stays small */
    png_read_info(png, pi);
    png_uint_32 W, H;
    int depth, ctype;
    png_get_IHDR(png, pi, &W, &H, &depth, &ctype, NULL, NULL, NULL);
    bool trns = png_get_valid(png, pi, PNG_INFO_tRNS) != 0, alpha = (ctype & PNG_COLOR_MASK_ALPHA) != 0;
    int c = channels;
    if (!c) c = ctype == PNG_COLOR_TYPE_PALETTE ? (trns ? 4 : 3) : png_get_channels(png, pi);
    info->h = H, info->w = W, info->c = c;
    if ((int64_t)H > max_h || (int64_t)W > max_w) {
        snprintf(why, whyn, "the PNG is %u x %u (H x W), larger than %lld x %lld", (unsigned)H, (unsigned)W,
                 (long long)max_h, (long long)max_w);
        goto done;
    }
    int bits = depth == 16 && dt == LOOM_F32 ? 16 : 8;
    /* the transformations png_io.cc asks for, in its order */
    if (!(c & 1)) {
        if (!alpha && trns) png_set_tRNS_to_alpha(png);
        else if (!alpha) png_set_add_alpha(png, bits == 16 ? 0xffff : 0xff, PNG_FILLER_AFTER);
    } else if (alpha || trns) {
        png_set_strip_alpha(png);
    }
    if (depth == 16 && bits == 8) png_set_strip_16(png);
    png_set_packing(png);
    int passes = png_set_interlace_handling(png);
    if (bits == 16) {
        uint16_t one = 1;
        if (*(uint8_t *)&one) png_set_swap(png); /* PNG is big-endian */
    }
    if (ctype == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(png);
    bool gray = !(ctype & PNG_COLOR_MASK_COLOR);
    if (gray && depth < 8) png_set_expand_gray_1_2_4_to_8(png);
    if (c < 3 && !gray) png_set_rgb_to_gray(png, 1, 0.299, 0.587);
    else if (c >= 3 && gray) png_set_gray_to_rgb(png);
    png_read_update_info(png, pi);
    size_t row = (size_t)W * (size_t)c * (size_t)(bits / 8);
    if (png_get_rowbytes(png, pi) != row) png_error(png, "unexpected row size after conversion");
    size_t n = (size_t)H * W * (size_t)c;
    uint8_t *base = dt == LOOM_F32 ? out + n * 4 - n * (size_t)(bits / 8) : out;
    for (int p = 0; p < passes; p++)
        for (png_uint_32 y = 0; y < H; y++) png_read_row(png, base + (size_t)y * row, NULL);
    if (dt == LOOM_F32) widen_to_f32(out, n, bits);
    rc = 0;
done:
    png_destroy_read_struct(&png, &pi, NULL);
    return rc;
}

/* ---- JPEG ----------------------------------------------------------------- */

typedef struct jpg_err {
    struct jpeg_error_mgr       pub;
    struct jpeg_progress_mgr    prog;
    jmp_buf                     jb;
    char                       *why;
    size_t                      whyn;
} jpg_err;

static void jpg_fail(j_common_ptr ci)
{
    jpg_err *e = (jpg_err *)ci->err;
    char m[JMSG_LENGTH_MAX];
    ci->err->format_message(ci, m);
    snprintf(e->why, e->whyn, "corrupt JPEG: %s", m);
    longjmp(e->jb, 1);
}

/* Warnings are corrupt data libjpeg would paper over (a truncated file
 * decodes as grey): an error here, as in tf.io.decode_jpeg, except stray
 * bytes between markers, which leave the pixels intact. */
static void jpg_emit(j_common_ptr ci, int level)
{
    if (level < 0 && ci->err->msg_code != JWRN_EXTRANEOUS_DATA) jpg_fail(ci);
}

/* A progressive file may hold thousands of tiny scans, each a pass over the
 * image: past 1000 it is hostile, not a photograph. */
static void jpg_progress(j_common_ptr ci)
{
    if (ci->is_decompressor && ((j_decompress_ptr)ci)->input_scan_number > 1000) {
        jpg_err *e = (jpg_err *)ci->err;
        snprintf(e->why, e->whyn, "corrupt JPEG: more than 1000 scans");
        longjmp(e->jb, 1);
    }
}

static int decode_jpeg(const uint8_t *data, size_t len, int channels, loom_dtype dt, int64_t max_h, int64_t max_w,
                       uint8_t *out, image_info *info, char *why, size_t whyn)
{
    struct jpeg_decompress_struct ci;
    jpg_err e;
    memset(&ci, 0, sizeof ci);
    ci.err = jpeg_std_error(&e.pub);
    e.pub.error_exit = jpg_fail;
    e.pub.emit_message = jpg_emit;
    e.prog.progress_monitor = jpg_progress;
    e.why = why;
    e.whyn = whyn;
    if (setjmp(e.jb)) {
        jpeg_destroy_decompress(&ci);
        return -1;
    }
    jpeg_create_decompress(&ci);
    ci.progress = &e.prog;
    jpeg_mem_src(&ci, data, (unsigned long)len);
    jpeg_read_header(&ci, TRUE);
    if (ci.num_components != 1 && ci.num_components != 3) {
        snprintf(why, whyn, "JPEG with %d colour components (CMYK?): only grey and YCbCr/RGB JPEGs decode",
                 ci.num_components);
        longjmp(e.jb, 1);
    }
    int c = channels ? channels : ci.num_components;
    info->h = ci.image_height, info->w = ci.image_width, info->c = c;
    if ((int64_t)ci.image_height > max_h || (int64_t)ci.image_width > max_w) {
        snprintf(why, whyn, "the JPEG is %u x %u (H x W), larger than %lld x %lld", (unsigned)ci.image_height,
                 (unsigned)ci.image_width, (long long)max_h, (long long)max_w);
        longjmp(e.jb, 1);
    }
    ci.out_color_space = c <= 2 ? JCS_GRAYSCALE : c == 3 ? JCS_RGB : JCS_EXT_RGBA; /* RGBA: alpha 255 */
    ci.dct_method = JDCT_IFAST; /* tf.io.decode_jpeg's default (dct_method ""), so the pixels are TensorFlow's */
    jpeg_start_decompress(&ci);
    size_t W = ci.output_width, H = ci.output_height, n = H * W * (size_t)c, row = W * (size_t)c;
    uint8_t *base = dt == LOOM_F32 ? out + n * 3 : out;
    while (ci.output_scanline < H) {
        JSAMPROW r = base + (size_t)ci.output_scanline * row;
        if (jpeg_read_scanlines(&ci, &r, 1) != 1) {
            snprintf(why, whyn, "corrupt JPEG: no data for row %u", (unsigned)ci.output_scanline);
            longjmp(e.jb, 1);
        }
        if (c == 2) /* grey + alpha: spread the row in place, from its end */
            for (size_t x = W; x-- > 0;) {
                r[2 * x + 1] = 255;
                r[2 * x] = r[x];
            }
    }
    jpeg_finish_decompress(&ci);
    jpeg_destroy_decompress(&ci);
    if (dt == LOOM_F32) widen_to_f32(out, n, 8);
    return 0;
}

int image_decode_(const uint8_t *data, size_t len, int channels, loom_dtype dt, int64_t max_h, int64_t max_w,
                  void *out, image_info *info, char *why, size_t whyn)
{
    LOOM_ASSERT(channels >= 0 && channels <= 4 && (dt == LOOM_U8 || dt == LOOM_F32));
    memset(info, 0, sizeof *info);
    const char *fmt = image_format_(data, len);
    if (fmt && fmt[0] == 'P') return decode_png(data, len, channels, dt, max_h, max_w, out, info, why, whyn);
    if (fmt) return decode_jpeg(data, len, channels, dt, max_h, max_w, out, info, why, whyn);
    char hex[40] = "";
    for (size_t i = 0, k = 0; i < len && i < 8; i++) k += (size_t)snprintf(hex + k, sizeof hex - k, " %02x", data[i]);
    snprintf(why, whyn, "not a PNG or JPEG image (%zu bytes, starting%s)", len, len ? hex : " empty");
    return -1;
}

/* ---- resize --------------------------------------------------------------- */

/* resize_bilinear_op.cc with half_pixel_centers: in = (out + 0.5) * scale - 0.5
 * in float, the lower source index clamped at 0, the upper at size - 1, the
 * weight in - floor(in); a row of lerps, then the lerp of the rows. */
typedef struct lerp_at {
    int64_t lo, hi;
    float   f;
} lerp_at;

static lerp_at lerp_of(int64_t o, float scale, int64_t in_size)
{
    float in = ((float)o + 0.5f) * scale - 0.5f;
    float fl = floorf(in);
    lerp_at l = {(int64_t)fl, (int64_t)ceilf(in), in - fl};
    if (l.lo < 0) l.lo = 0;
    if (l.hi > in_size - 1) l.hi = in_size - 1;
    return l;
}

#define RESIZE_LOOP_(ST)                                                                                 \
    {                                                                                                    \
        const ST *s = src;                                                                               \
        for (int64_t y = 0; y < h; y++) {                                                                \
            lerp_at ly = lerp_of(y, sy, H);                                                              \
            const ST *r0 = s + ly.lo * W * C, *r1 = s + ly.hi * W * C;                                   \
            for (int64_t x = 0; x < w; x++) {                                                            \
                lerp_at lx = lerp_of(x, sx, W);                                                          \
                for (int64_t c = 0; c < C; c++) {                                                        \
                    float tl = (float)r0[lx.lo * C + c], tr = (float)r0[lx.hi * C + c];                  \
                    float bl = (float)r1[lx.lo * C + c], br = (float)r1[lx.hi * C + c];                  \
                    float top = tl + (tr - tl) * lx.f, bot = bl + (br - bl) * lx.f;                      \
                    *dst++ = top + (bot - top) * ly.f;                                                   \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        return;                                                                                          \
    }

void image_resize_(const void *src, loom_dtype sd, int64_t H, int64_t W, int64_t C, float *dst, int64_t h, int64_t w)
{
    float sy = (float)H / (float)h, sx = (float)W / (float)w;
    switch (sd) {
    case LOOM_U8: RESIZE_LOOP_(uint8_t)
    case LOOM_I32: RESIZE_LOOP_(int32_t)
    case LOOM_I64: RESIZE_LOOP_(int64_t)
    case LOOM_F32: RESIZE_LOOP_(float)
    case LOOM_F64: RESIZE_LOOP_(double)
    default: LOOM_ASSERT(!"bad dtype");
    }
}
#undef RESIZE_LOOP_

/* ---- central crop, brightness, contrast ----------------------------------------- */

void image_central_box_(int64_t H, int64_t W, double fraction, int64_t box[4])
{
    /* image_ops.py: start = int((size - size * fraction) / 2), kept size - 2 * start */
    int64_t y0 = fraction >= 1 ? 0 : (int64_t)(((double)H - (double)H * fraction) / 2);
    int64_t x0 = fraction >= 1 ? 0 : (int64_t)(((double)W - (double)W * fraction) / 2);
    box[0] = y0, box[1] = x0, box[2] = H - 2 * y0, box[3] = W - 2 * x0;
}

/* uint8 through float as tf.image does: x * (1/255), the op, then a saturating
 * cast of y * 255.5 (convert_image_dtype's rounding guard), truncating. */
static inline uint8_t u8_back(float y)
{
    float v = y * 255.5f;
    return v != v ? 0 : v <= 0.0f ? 0 : v >= 255.0f ? 255 : (uint8_t)v;
}

void image_brightness_(const void *src, void *dst, loom_dtype dt, size_t n, double delta)
{
    if (dt == LOOM_U8) {
        const uint8_t *a = src;
        uint8_t *b = dst;
        const float k = (float)(1.0 / 255.0), d = (float)delta;
        for (size_t i = 0; i < n; i++) b[i] = u8_back((float)a[i] * k + d);
    } else if (dt == LOOM_F32) {
        const float *a = src;
        float *b = dst, d = (float)delta;
        for (size_t i = 0; i < n; i++) b[i] = a[i] + d;
    } else {
        LOOM_ASSERT(dt == LOOM_F64);
        const double *a = src;
        double *b = dst;
        for (size_t i = 0; i < n; i++) b[i] = a[i] + delta;
    }
}

/* adjust_contrast: per channel, the mean over H and W, then (x - mean) * f + mean. */
void image_contrast_(const void *src, void *dst, loom_dtype dt, int64_t hw, int64_t C, double factor)
{
    const float k = (float)(1.0 / 255.0), f = (float)factor;
    for (int64_t c = 0; c < C; c++) {
        double sum = 0;
        for (int64_t i = 0; i < hw; i++) {
            size_t at = (size_t)(i * C + c);
            sum += dt == LOOM_U8 ? (double)((float)((const uint8_t *)src)[at] * k)
                   : dt == LOOM_F32 ? (double)((const float *)src)[at] : ((const double *)src)[at];
        }
        double mean = hw ? sum / (double)hw : 0;
        float m = (float)mean;
        for (int64_t i = 0; i < hw; i++) {
            size_t at = (size_t)(i * C + c);
            if (dt == LOOM_U8) {
                float x = (float)((const uint8_t *)src)[at] * k;
                ((uint8_t *)dst)[at] = u8_back((x - m) * f + m);
            } else if (dt == LOOM_F32) {
                float x = ((const float *)src)[at];
                ((float *)dst)[at] = (x - m) * f + m;
            } else {
                double x = ((const double *)src)[at];
                ((double *)dst)[at] = (x - mean) * factor + mean;
            }
        }
    }
}
