/* conv_more.c - the layers real vision models need beside conv2d (issue 23):
 * zero_padding2d, global_max_pooling2d, reshape, upsampling2d, and the
 * convolutions conv2d's im2col path does not run: conv2d with groups or
 * dilation, depthwise_conv2d, separable_conv2d, conv2d_transpose, conv1d.
 * Keras's semantics: shapes, "same" padding (TF's: pad_total / 2 before),
 * kernel layouts and parameter counts (NHWC; a conv1d's input (T, C)).
 *
 * The convolutions are straightforward loops (correctness first). Each runs
 * on a chunk's rows of the batch; a parameter gradient element is one sum
 * over the whole batch in (example, row, column) order, so a split of the
 * gradient pass into parts (threads) gives the same bits. Nothing here
 * allocates: a separable's depthwise output and its gradient have their
 * (max_batch) buffers from loom_model_new. */
#include "nn_internal.h"

#include <string.h>

/* ---- geometry ------------------------------------------------------------- */

/* A grouped, dilated convolution (H, W, cin) -> (OH, OW, cout), kernel
 * (kh, kw, cin / groups, cout): output channel co of group g = co / (cout /
 * groups) reads input channels [g cg, (g + 1) cg). A depthwise convolution is
 * the case groups = cin (its Keras kernel (kh, kw, cin, mult) has the same
 * layout). A transposed one runs the same geometry backwards (tconv_*). */
typedef struct geom {
    int ih, iw, cin, oh, ow, cout, kh, kw, sh, sw, dh, dw, pt, pl, groups;
} geom;

static geom geom_of(const nn_layer_ *l)
{
    geom g = {l->ih, l->iw, l->cin, l->oh, l->ow, l->cout, l->kh, l->kw, l->sh, l->sw, l->dh, l->dw, l->pad_t, l->pad_l,
              l->groups};
    if (l->spec.kind == LOOM_LAYER_SEPARABLE_CONV2D) g.cout = l->cin * l->mult; /* its depthwise half */
    return g;
}

static void shape3(loom_shape *s, int rank, int64_t d0, int64_t d1, int64_t d2)
{
    memset(s, 0, sizeof *s);
    s->rank = rank;
    s->dim[0] = d0, s->dim[1] = d1, s->dim[2] = d2;
}

/* Output length along one axis for an effective window k (dilated), TF's
 * rules: valid (in - k) / s + 1, same ceil(in / s) with pad_total / 2
 * before, causal (in - 1) / s + 1 with k - 1 before. */
static int out_len(int in, int k, int s, loom_padding p, int *before)
{
    if (p == LOOM_PAD_SAME) {
        int out = (in + s - 1) / s, tot = (out - 1) * s + k - in;
        *before = tot > 0 ? tot / 2 : 0;
        return out;
    }
    if (p == LOOM_PAD_CAUSAL) {
        *before = k - 1;
        return (in - 1) / s + 1;
    }
    *before = 0;
    return in >= k ? (in - k) / s + 1 : 0;
}

/* ---- grouped, dilated convolution ------------------------------------------ */

/* y (nb, OH, OW, cout) = conv(x) (no bias). */
static void gconv_forward(const geom *q, const float *restrict W, const float *restrict x, float *restrict y,
                          int64_t nb)
{
    const int G = q->groups, cg = q->cin / G, og = q->cout / G, CO = q->cout;
    const int64_t nin = (int64_t)q->ih * q->iw * q->cin, nout = (int64_t)q->oh * q->ow * CO;
    for (int64_t b = 0; b < nb; b++)
        for (int oy = 0; oy < q->oh; oy++)
            for (int ox = 0; ox < q->ow; ox++) {
                float *restrict yo = y + b * nout + ((int64_t)oy * q->ow + ox) * CO;
                for (int co = 0; co < CO; co++) yo[co] = 0.f;
                for (int i = 0; i < q->kh; i++) {
                    int yy = oy * q->sh - q->pt + i * q->dh;
                    if (yy < 0 || yy >= q->ih) continue;
                    for (int j = 0; j < q->kw; j++) {
                        int xx = ox * q->sw - q->pl + j * q->dw;
                        if (xx < 0 || xx >= q->iw) continue;
                        const float *restrict xp = x + b * nin + ((int64_t)yy * q->iw + xx) * q->cin;
                        const float *restrict wt = W + (int64_t)(i * q->kw + j) * cg * CO;
                        if (cg == 1 && og == 1) { /* depthwise, multiplier 1 */
                            for (int c = 0; c < CO; c++) yo[c] += xp[c] * wt[c];
                            continue;
                        }
                        for (int g = 0; g < G; g++)
                            for (int ci = 0; ci < cg; ci++) {
                                const float v = xp[g * cg + ci];
                                const float *restrict wr = wt + (int64_t)ci * CO + g * og;
                                float *restrict yg = yo + g * og;
                                for (int o = 0; o < og; o++) yg[o] += v * wr[o];
                            }
                    }
                }
            }
}

/* dx (nb, H, W, cin) = the input gradient of dz (nb, OH, OW, cout). */
static void gconv_backward(const geom *q, const float *restrict W, const float *restrict dz, float *restrict dx,
                           int64_t nb)
{
    const int G = q->groups, cg = q->cin / G, og = q->cout / G, CO = q->cout;
    const int64_t nin = (int64_t)q->ih * q->iw * q->cin, nout = (int64_t)q->oh * q->ow * CO;
    memset(dx, 0, (size_t)(nb * nin) * sizeof *dx);
    for (int64_t b = 0; b < nb; b++)
        for (int oy = 0; oy < q->oh; oy++)
            for (int ox = 0; ox < q->ow; ox++) {
                const float *restrict go = dz + b * nout + ((int64_t)oy * q->ow + ox) * CO;
                for (int i = 0; i < q->kh; i++) {
                    int yy = oy * q->sh - q->pt + i * q->dh;
                    if (yy < 0 || yy >= q->ih) continue;
                    for (int j = 0; j < q->kw; j++) {
                        int xx = ox * q->sw - q->pl + j * q->dw;
                        if (xx < 0 || xx >= q->iw) continue;
                        float *restrict dp = dx + b * nin + ((int64_t)yy * q->iw + xx) * q->cin;
                        const float *restrict wt = W + (int64_t)(i * q->kw + j) * cg * CO;
                        if (cg == 1 && og == 1) {
                            for (int c = 0; c < CO; c++) dp[c] += go[c] * wt[c];
                            continue;
                        }
                        for (int g = 0; g < G; g++)
                            for (int ci = 0; ci < cg; ci++) {
                                const float *restrict wr = wt + (int64_t)ci * CO + g * og;
                                const float *restrict gg = go + g * og;
                                float s = 0.f;
                                for (int o = 0; o < og; o++) s += gg[o] * wr[o];
                                dp[g * cg + ci] += s;
                            }
                    }
                }
            }
}

/* Kernel rows [r0, r1) of kh*kw*cg (each cout wide) = sum over the whole
 * batch of x * dz, each element summed in (example, row, column) order. */
static void gconv_kernel_grad(const geom *q, const float *restrict x, const float *restrict dz, int64_t B, int64_t r0,
                              int64_t r1, float *restrict dW)
{
    const int G = q->groups, cg = q->cin / G, og = q->cout / G, CO = q->cout;
    const int64_t nin = (int64_t)q->ih * q->iw * q->cin, nout = (int64_t)q->oh * q->ow * CO;
    memset(dW + r0 * CO, 0, (size_t)((r1 - r0) * CO) * sizeof *dW);
    for (int64_t b = 0; b < B; b++)
        for (int oy = 0; oy < q->oh; oy++)
            for (int ox = 0; ox < q->ow; ox++) {
                const float *restrict go = dz + b * nout + ((int64_t)oy * q->ow + ox) * CO;
                for (int64_t r = r0; r < r1; r++) {
                    int tap = (int)(r / cg), ci = (int)(r % cg), i = tap / q->kw, j = tap % q->kw;
                    int yy = oy * q->sh - q->pt + i * q->dh, xx = ox * q->sw - q->pl + j * q->dw;
                    if (yy < 0 || yy >= q->ih || xx < 0 || xx >= q->iw) continue;
                    const float *restrict xp = x + b * nin + ((int64_t)yy * q->iw + xx) * q->cin;
                    float *restrict dw = dW + r * CO;
                    if (cg == 1 && og == 1) {
                        for (int c = 0; c < CO; c++) dw[c] += xp[c] * go[c];
                        continue;
                    }
                    for (int g = 0; g < G; g++) {
                        const float v = xp[g * cg + ci];
                        for (int o = 0; o < og; o++) dw[g * og + o] += v * go[g * og + o];
                    }
                }
            }
}

/* ---- transposed convolution: input (H, W, cin), output (OH, OW, cout), -----
 * kernel (kh, kw, cout, cin) as Keras's Conv2DTranspose: input pixel (iy,
 * ix) adds W[i, j] x to output pixel (iy sh - pt + i dh, ix sw - pl + j dw). */

static void tconv_forward(const geom *q, const float *restrict W, const float *restrict x, float *restrict y,
                          int64_t nb)
{
    const int CI = q->cin, CO = q->cout;
    const int64_t nin = (int64_t)q->ih * q->iw * CI, nout = (int64_t)q->oh * q->ow * CO;
    memset(y, 0, (size_t)(nb * nout) * sizeof *y);
    for (int64_t b = 0; b < nb; b++)
        for (int iy = 0; iy < q->ih; iy++)
            for (int ix = 0; ix < q->iw; ix++) {
                const float *restrict xp = x + b * nin + ((int64_t)iy * q->iw + ix) * CI;
                for (int i = 0; i < q->kh; i++) {
                    int oy = iy * q->sh - q->pt + i * q->dh;
                    if (oy < 0 || oy >= q->oh) continue;
                    for (int j = 0; j < q->kw; j++) {
                        int ox = ix * q->sw - q->pl + j * q->dw;
                        if (ox < 0 || ox >= q->ow) continue;
                        float *restrict yo = y + b * nout + ((int64_t)oy * q->ow + ox) * CO;
                        const float *restrict wt = W + (int64_t)(i * q->kw + j) * CO * CI;
                        for (int co = 0; co < CO; co++) {
                            const float *restrict wr = wt + (int64_t)co * CI;
                            float s = 0.f;
                            for (int ci = 0; ci < CI; ci++) s += xp[ci] * wr[ci];
                            yo[co] += s;
                        }
                    }
                }
            }
}

static void tconv_backward(const geom *q, const float *restrict W, const float *restrict dz, float *restrict dx,
                           int64_t nb)
{
    const int CI = q->cin, CO = q->cout;
    const int64_t nin = (int64_t)q->ih * q->iw * CI, nout = (int64_t)q->oh * q->ow * CO;
    for (int64_t b = 0; b < nb; b++)
        for (int iy = 0; iy < q->ih; iy++)
            for (int ix = 0; ix < q->iw; ix++) {
                float *restrict dp = dx + b * nin + ((int64_t)iy * q->iw + ix) * CI;
                for (int ci = 0; ci < CI; ci++) dp[ci] = 0.f;
                for (int i = 0; i < q->kh; i++) {
                    int oy = iy * q->sh - q->pt + i * q->dh;
                    if (oy < 0 || oy >= q->oh) continue;
                    for (int j = 0; j < q->kw; j++) {
                        int ox = ix * q->sw - q->pl + j * q->dw;
                        if (ox < 0 || ox >= q->ow) continue;
                        const float *restrict go = dz + b * nout + ((int64_t)oy * q->ow + ox) * CO;
                        const float *restrict wt = W + (int64_t)(i * q->kw + j) * CO * CI;
                        for (int co = 0; co < CO; co++) {
                            const float gv = go[co];
                            const float *restrict wr = wt + (int64_t)co * CI;
                            for (int ci = 0; ci < CI; ci++) dp[ci] += gv * wr[ci];
                        }
                    }
                }
            }
}

/* Kernel rows [r0, r1) of kh*kw*cout (each cin wide), over the whole batch. */
static void tconv_kernel_grad(const geom *q, const float *restrict x, const float *restrict dz, int64_t B, int64_t r0,
                              int64_t r1, float *restrict dW)
{
    const int CI = q->cin, CO = q->cout;
    const int64_t nin = (int64_t)q->ih * q->iw * CI, nout = (int64_t)q->oh * q->ow * CO;
    memset(dW + r0 * CI, 0, (size_t)((r1 - r0) * CI) * sizeof *dW);
    for (int64_t b = 0; b < B; b++)
        for (int iy = 0; iy < q->ih; iy++)
            for (int ix = 0; ix < q->iw; ix++) {
                const float *restrict xp = x + b * nin + ((int64_t)iy * q->iw + ix) * CI;
                for (int64_t r = r0; r < r1; r++) {
                    int tap = (int)(r / CO), co = (int)(r % CO), i = tap / q->kw, j = tap % q->kw;
                    int oy = iy * q->sh - q->pt + i * q->dh, ox = ix * q->sw - q->pl + j * q->dw;
                    if (oy < 0 || oy >= q->oh || ox < 0 || ox >= q->ow) continue;
                    const float gv = dz[b * nout + ((int64_t)oy * q->ow + ox) * CO + co];
                    float *restrict dw = dW + r * CI;
                    for (int ci = 0; ci < CI; ci++) dw[ci] += gv * xp[ci];
                }
            }
}

/* ---- shapes ------------------------------------------------------------------ */

static int need_image(const nn_layer_ *l, loom_err *err)
{
    char a[96];
    if (l->in.rank == 3) return LOOM_OK;
    return loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\" (%s) needs an (H, W, C) input, got %s", l->spec.name,
                        nn_layer_kind_name_(l->spec.kind), loom_shape_str(&l->in, a, sizeof a)),
           loom_err_hint(err, "put it after a layer with an image output, or add a reshape layer before it");
}

/* A convolution's kernel (shape ks, Keras's layout), bias and flops; the
 * activation. fan_in/out as Keras's for that layout: receptive field times
 * its last two dims. */
static void conv_params(loom_model *m, nn_layer_ *l, const loom_shape *ks, int64_t bias_n, double macs)
{
    const loom_layer_spec *s = &l->spec;
    int r = ks->rank;
    double rf = 1;
    for (int i = 0; i < r - 2; i++) rf *= (double)ks->dim[i];
    const char *kname = s->kind == LOOM_LAYER_DEPTHWISE_CONV2D || s->kind == LOOM_LAYER_SEPARABLE_CONV2D
                            ? "depthwise_kernel"
                            : "kernel";
    l->kernel_off = nn_add_param_(m, l, kname, ks, s->kernel_init, rf * (double)ks->dim[r - 2],
                                  rf * (double)ks->dim[r - 1]);
    if (s->kind == LOOM_LAYER_SEPARABLE_CONV2D) {
        loom_shape pw = {.rank = 4, .dim = {1, 1, (int64_t)l->cin * l->mult, l->cout}};
        l->pw_off = nn_add_param_(m, l, "pointwise_kernel", &pw, s->kernel_init, (double)l->cin * l->mult, l->cout);
    }
    if (s->use_bias) {
        loom_shape bs;
        shape3(&bs, 1, bias_n, 0, 0);
        l->bias_off = nn_add_param_(m, l, "bias", &bs, LOOM_INIT_ZEROS, 0, 0);
    }
    l->act = s->activation;
    m->flops += 2.0 * macs;
}

static int conv_shapes(loom_model *m, nn_layer_ *l, loom_err *err)
{
    char a[96];
    const loom_layer_spec *s = &l->spec;
    const loom_layer_kind k = s->kind;
    const char *kind = nn_layer_kind_name_(k);
    const bool c1 = k == LOOM_LAYER_CONV1D;
    if (c1 && l->in.rank != 2)
        return loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\" (conv1d) needs a (steps, channels) input, got %s",
                            s->name, loom_shape_str(&l->in, a, sizeof a)),
               loom_err_hint(err, "add a reshape layer before it, e.g. target_shape = [-1, 1]");
    int rc = c1 ? LOOM_OK : need_image(l, err);
    if (rc) return rc;
    l->ih = c1 ? 1 : (int)l->in.dim[0];
    l->iw = (int)l->in.dim[c1 ? 0 : 1];
    l->cin = (int)l->in.dim[c1 ? 1 : 2];
    l->kh = c1 ? 1 : s->kernel[0];
    l->kw = s->kernel[1];
    l->sh = c1 ? 1 : (s->stride[0] > 0 ? s->stride[0] : 1);
    l->sw = s->stride[1] > 0 ? s->stride[1] : 1;
    l->dh = c1 ? 1 : (s->dilation[0] > 0 ? s->dilation[0] : 1);
    l->dw = s->dilation[1] > 0 ? s->dilation[1] : 1;
    l->mult = s->depth_multiplier > 0 ? s->depth_multiplier : 1;
    l->groups = s->groups > 0 ? s->groups : 1;
    l->direct = 1;
    if (l->kh < 1 || l->kw < 1)
        return loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\" (%s): kernel_size %dx%d must be >= 1", s->name,
                            kind, l->kh, l->kw);
    if (k == LOOM_LAYER_DEPTHWISE_CONV2D || k == LOOM_LAYER_SEPARABLE_CONV2D) l->groups = l->cin;
    if (k != LOOM_LAYER_DEPTHWISE_CONV2D && s->filters < 1)
        return loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\" (%s): filters = %d, must be >= 1", s->name, kind,
                            s->filters);
    l->cout = k == LOOM_LAYER_DEPTHWISE_CONV2D ? l->cin * l->mult : s->filters;
    if ((k == LOOM_LAYER_CONV2D || c1) && (l->cin % l->groups || l->cout % l->groups))
        return loom_err_set(err, LOOM_ESHAPE, l->where,
                            "layer \"%s\" (%s): groups = %d must divide the input's %d channels and filters = %d",
                            s->name, kind, l->groups, l->cin, l->cout),
               loom_err_hint(err, "pick groups among the common divisors of both");
    if ((int64_t)(l->kh - 1) * l->dh + 1 > (1 << 24) || (int64_t)(l->kw - 1) * l->dw + 1 > (1 << 24))
        return loom_err_set(err, LOOM_ESHAPE, l->where,
                            "layer \"%s\" (%s): kernel_size %dx%d dilated by %dx%d spans more than 2^24 pixels",
                            s->name, kind, l->kh, l->kw, l->dh, l->dw);
    const int keh = (l->kh - 1) * l->dh + 1, kew = (l->kw - 1) * l->dw + 1; /* dilated windows */
    if (s->padding == LOOM_PAD_CAUSAL && !c1)
        return loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\" (%s): padding \"causal\" is conv1d's", s->name,
                            kind);
    if (k == LOOM_LAYER_CONV2D_TRANSPOSE && ((int64_t)l->ih * l->sh + keh > (1 << 24) ||
                                            (int64_t)l->iw * l->sw + kew > (1 << 24)))
        return loom_err_set(err, LOOM_ESHAPE, l->where,
                            "layer \"%s\" (conv2d_transpose): strides %dx%d make an output past 2^24 pixels a side",
                            s->name, l->sh, l->sw);
    if (k == LOOM_LAYER_CONV2D_TRANSPOSE) {
        /* Keras deconv_output_length (output_padding unset): valid in s + max(k - s, 0), same in s; the padding
         * is the one of the forward convolution from the output back to the input */
        l->oh = s->padding == LOOM_PAD_SAME ? l->ih * l->sh : l->ih * l->sh + (keh > l->sh ? keh - l->sh : 0);
        l->ow = s->padding == LOOM_PAD_SAME ? l->iw * l->sw : l->iw * l->sw + (kew > l->sw ? kew - l->sw : 0);
        int th = (l->ih - 1) * l->sh + keh - l->oh, tw = (l->iw - 1) * l->sw + kew - l->ow;
        l->pad_t = th > 0 ? th / 2 : 0;
        l->pad_l = tw > 0 ? tw / 2 : 0;
    } else {
        l->oh = out_len(l->ih, keh, l->sh, c1 ? LOOM_PAD_VALID : s->padding, &l->pad_t);
        l->ow = out_len(l->iw, kew, l->sw, s->padding, &l->pad_l);
    }
    if (l->oh < 1 || l->ow < 1)
        return loom_err_set(err, LOOM_ESHAPE, l->where,
                            "layer \"%s\" (%s): a %dx%d window (dilated) with valid padding does not fit the input %s",
                            s->name, kind, keh, kew, loom_shape_str(&l->in, a, sizeof a)),
               loom_err_hint(err, "use padding = \"same\" or a smaller window");
    loom_shape ks = {.rank = 4, .dim = {l->kh, l->kw, l->cin / l->groups, l->cout}};
    int64_t bias_n = l->cout;
    double P = (double)l->oh * l->ow;
    double macs = P * l->kh * l->kw * (l->cin / l->groups) * l->cout;
    switch (k) {
    case LOOM_LAYER_CONV1D:
        ks = (loom_shape){.rank = 3, .dim = {l->kw, l->cin / l->groups, l->cout}};
        break;
    case LOOM_LAYER_DEPTHWISE_CONV2D:
        ks = (loom_shape){.rank = 4, .dim = {l->kh, l->kw, l->cin, l->mult}};
        break;
    case LOOM_LAYER_SEPARABLE_CONV2D:
        ks = (loom_shape){.rank = 4, .dim = {l->kh, l->kw, l->cin, l->mult}};
        macs = P * l->kh * l->kw * l->cin * l->mult + P * (double)l->cin * l->mult * l->cout;
        break;
    case LOOM_LAYER_CONV2D_TRANSPOSE:
        ks = (loom_shape){.rank = 4, .dim = {l->kh, l->kw, l->cout, l->cin}};
        macs = (double)l->ih * l->iw * l->kh * l->kw * l->cin * l->cout;
        break;
    default:
        break;
    }
    conv_params(m, l, &ks, bias_n, macs);
    if (c1) shape3(&l->out, 2, l->ow, l->cout, 0);
    else shape3(&l->out, 3, l->oh, l->ow, l->cout);
    return LOOM_OK;
}

static int reshape_shapes(nn_layer_ *l, loom_err *err)
{
    char a[96], b[96];
    const loom_layer_spec *s = &l->spec;
    int64_t n = loom_shape_numel(&l->in), known = 1;
    int unknown = -1;
    if (s->n_target < 1 || s->n_target > 3)
        return loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\" (reshape): target_shape has %d dims (1 to 3)",
                            s->name, s->n_target);
    memset(&l->out, 0, sizeof l->out);
    l->out.rank = s->n_target;
    for (int i = 0; i < s->n_target; i++) {
        l->out.dim[i] = s->target[i];
        if (s->target[i] == -1 && unknown < 0) unknown = i;
        else if (s->target[i] >= 1 && !__builtin_mul_overflow(known, s->target[i], &known)) continue;
        else
            return loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\" (reshape): target_shape dim %d is %lld (a size "
                                "is >= 1, one may be -1, and they multiply to less than 2^63)",
                                s->name, i, (long long)s->target[i]);
    }
    if (unknown >= 0 && known > 0 && n % known == 0) l->out.dim[unknown] = n / known;
    if ((unknown >= 0 && (known == 0 || n % known)) || loom_shape_numel(&l->out) != n) {
        loom_shape t = {.rank = s->n_target};
        for (int i = 0; i < s->n_target; i++) t.dim[i] = s->target[i];
        return loom_err_set(err, LOOM_ESHAPE, l->where,
                            "layer \"%s\" (reshape): the input %s (%lld elements) does not fit target_shape %s",
                            s->name, loom_shape_str(&l->in, a, sizeof a), (long long)n, loom_shape_str(&t, b, sizeof b)),
               loom_err_hint(err, "the target's dims must multiply to the input's element count (one may be -1)");
    }
    return LOOM_OK;
}

bool nn_is_more_kind_(loom_layer_kind k) { return k >= LOOM_LAYER_ZERO_PADDING2D && k <= LOOM_LAYER_CONV1D; }

bool nn_runs_more_(const nn_layer_ *l) { return nn_is_more_kind_(l->spec.kind) || l->direct; }

int nn_more_shapes_(loom_model *m, nn_layer_ *l, int li, loom_err *err)
{
    (void)li;
    const loom_layer_spec *s = &l->spec;
    char a[96];
    int rc;
    for (int i = 0; i < l->in.rank; i++) /* the loops index a row with int */
        if (l->in.dim[i] > (1 << 28))
            return loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\" (%s): input %s has a dim past 2^28",
                                s->name, nn_layer_kind_name_(s->kind), loom_shape_str(&l->in, a, sizeof a));
    switch (s->kind) {
    case LOOM_LAYER_ZERO_PADDING2D:
        if ((rc = need_image(l, err))) return rc;
        l->ih = (int)l->in.dim[0], l->iw = (int)l->in.dim[1], l->cin = l->cout = (int)l->in.dim[2];
        l->pad_t = s->pad[0], l->pad_b = s->pad[1], l->pad_l = s->pad[2], l->pad_r = s->pad[3];
        if (l->pad_t < 0 || l->pad_b < 0 || l->pad_l < 0 || l->pad_r < 0 ||
            (int64_t)l->ih + l->pad_t + l->pad_b > (1 << 24) || (int64_t)l->iw + l->pad_l + l->pad_r > (1 << 24))
            return loom_err_set(err, LOOM_ESHAPE, l->where,
                                "layer \"%s\" (zero_padding2d): padding %d, %d, %d, %d must be >= 0 and keep the "
                                "output under 2^24 pixels a side", s->name, l->pad_t, l->pad_b, l->pad_l, l->pad_r);
        l->oh = l->ih + l->pad_t + l->pad_b, l->ow = l->iw + l->pad_l + l->pad_r;
        shape3(&l->out, 3, l->oh, l->ow, l->cout);
        return LOOM_OK;
    case LOOM_LAYER_GLOBAL_MAX_POOL2D:
        if ((rc = need_image(l, err))) return rc;
        l->ih = (int)l->in.dim[0], l->iw = (int)l->in.dim[1], l->cin = l->cout = (int)l->in.dim[2];
        shape3(&l->out, 1, l->cin, 0, 0);
        return LOOM_OK;
    case LOOM_LAYER_RESHAPE:
        return reshape_shapes(l, err);
    case LOOM_LAYER_UPSAMPLING2D:
        if ((rc = need_image(l, err))) return rc;
        l->ih = (int)l->in.dim[0], l->iw = (int)l->in.dim[1], l->cin = l->cout = (int)l->in.dim[2];
        l->sh = s->size[0] > 0 ? s->size[0] : 2, l->sw = s->size[1] > 0 ? s->size[1] : 2;
        if ((int64_t)l->ih * l->sh > (1 << 24) || (int64_t)l->iw * l->sw > (1 << 24))
            return loom_err_set(err, LOOM_ESHAPE, l->where,
                                "layer \"%s\" (upsampling2d): size %dx%d makes an output past 2^24 pixels a side",
                                s->name, l->sh, l->sw);
        l->oh = l->ih * l->sh, l->ow = l->iw * l->sw;
        shape3(&l->out, 3, l->oh, l->ow, l->cout);
        return LOOM_OK;
    default: /* the convolutions */
        return conv_shapes(m, l, err);
    }
}

/* ---- the simple layers ------------------------------------------------------ */

static void zpad_forward(const nn_layer_ *l, const float *restrict x, float *restrict y, int64_t B)
{
    const int C = l->cin;
    memset(y, 0, (size_t)(B * l->n_out) * sizeof *y);
    for (int64_t b = 0; b < B; b++)
        for (int r = 0; r < l->ih; r++)
            memcpy(y + b * l->n_out + ((int64_t)(r + l->pad_t) * l->ow + l->pad_l) * C,
                   x + b * l->n_in + (int64_t)r * l->iw * C, (size_t)l->iw * C * sizeof *y);
}

static void zpad_backward(const nn_layer_ *l, const float *restrict g, float *restrict dx, int64_t B)
{
    const int C = l->cin;
    for (int64_t b = 0; b < B; b++)
        for (int r = 0; r < l->ih; r++)
            memcpy(dx + b * l->n_in + (int64_t)r * l->iw * C,
                   g + b * l->n_out + ((int64_t)(r + l->pad_t) * l->ow + l->pad_l) * C, (size_t)l->iw * C * sizeof *dx);
}

/* The max over H x W per channel; ties keep the first position. */
static void gmp_forward(const nn_layer_ *l, const float *restrict x, float *restrict y, int32_t *restrict am, int64_t B)
{
    const int64_t P = (int64_t)l->ih * l->iw, C = l->cin;
    for (int64_t b = 0; b < B; b++) {
        const float *xb = x + b * l->n_in;
        float *yb = y + b * C;
        int32_t *ab = am + b * C;
        for (int64_t c = 0; c < C; c++) yb[c] = xb[c], ab[c] = 0;
        for (int64_t p = 1; p < P; p++)
            for (int64_t c = 0; c < C; c++)
                if (xb[p * C + c] > yb[c]) yb[c] = xb[p * C + c], ab[c] = (int32_t)p;
    }
}

static void gmp_backward(const nn_layer_ *l, const int32_t *restrict am, const float *restrict g, float *restrict dx,
                         int64_t B)
{
    const int64_t C = l->cin;
    memset(dx, 0, (size_t)(B * l->n_in) * sizeof *dx);
    for (int64_t b = 0; b < B; b++)
        for (int64_t c = 0; c < C; c++) dx[b * l->n_in + am[b * C + c] * C + c] = g[b * C + c];
}

/* nearest: output (oy, ox) is input (oy / sh, ox / sw) */
static void up_forward(const nn_layer_ *l, const float *restrict x, float *restrict y, int64_t B)
{
    const int C = l->cin;
    for (int64_t b = 0; b < B; b++)
        for (int oy = 0; oy < l->oh; oy++)
            for (int ox = 0; ox < l->ow; ox++)
                memcpy(y + b * l->n_out + ((int64_t)oy * l->ow + ox) * C,
                       x + b * l->n_in + ((int64_t)(oy / l->sh) * l->iw + ox / l->sw) * C, (size_t)C * sizeof *y);
}

static void up_backward(const nn_layer_ *l, const float *restrict g, float *restrict dx, int64_t B)
{
    const int C = l->cin;
    for (int64_t b = 0; b < B; b++)
        for (int iy = 0; iy < l->ih; iy++)
            for (int ix = 0; ix < l->iw; ix++) {
                float *restrict d = dx + b * l->n_in + ((int64_t)iy * l->iw + ix) * C;
                for (int c = 0; c < C; c++) d[c] = 0.f;
                for (int i = 0; i < l->sh; i++)
                    for (int j = 0; j < l->sw; j++) {
                        const float *restrict gp =
                            g + b * l->n_out + ((int64_t)(iy * l->sh + i) * l->ow + ix * l->sw + j) * C;
                        for (int c = 0; c < C; c++) d[c] += gp[c];
                    }
            }
}

/* ---- dispatch ------------------------------------------------------------------ */

void nn_more_forward_(const loom_model *m, int li, nn_chunk_ *c)
{
    const nn_layer_ *l = &m->layer[li];
    const int64_t B = c->B, row0 = c->b0 * l->n_out;
    const float *x = c->act[li];
    float *y = l->y ? l->y + row0 : NULL;
    c->act[li + 1] = y;
    const float *W = l->kernel_off >= 0 ? m->params + l->kernel_off : NULL;
    const float *bias = l->bias_off >= 0 ? m->params + l->bias_off : NULL;
    const int64_t P = (int64_t)l->oh * l->ow;
    geom q = geom_of(l);
    switch (l->spec.kind) {
    case LOOM_LAYER_ZERO_PADDING2D: zpad_forward(l, x, y, B); return;
    case LOOM_LAYER_GLOBAL_MAX_POOL2D: gmp_forward(l, x, y, l->argmax + row0, B); return;
    case LOOM_LAYER_RESHAPE: c->act[li + 1] = x; return;
    case LOOM_LAYER_UPSAMPLING2D: up_forward(l, x, y, B); return;
    case LOOM_LAYER_CONV2D_TRANSPOSE:
        tconv_forward(&q, W, x, y, B);
        nn_layer_act_(l, y, bias, B * P, l->cout);
        return;
    case LOOM_LAYER_SEPARABLE_CONV2D: {
        const int cm = l->cin * l->mult;
        float *mid = l->mid + c->b0 * P * cm;
        gconv_forward(&q, W, x, mid, B);
        loom_sgemm(false, false, (int)(B * P), l->cout, cm, 1.f, mid, cm, m->params + l->pw_off, l->cout, 0.f, y,
                   l->cout);
        nn_layer_act_(l, y, bias, B * P, l->cout);
        return;
    }
    default: /* conv2d (groups, dilation), depthwise_conv2d, conv1d */
        gconv_forward(&q, W, x, y, B);
        nn_layer_act_(l, y, bias, B * P, l->cout);
        return;
    }
}

float *nn_more_backward_(const loom_model *m, int li, nn_chunk_ *c, float *g, float *other)
{
    const nn_layer_ *l = &m->layer[li];
    const int64_t B = c->B, row0 = c->b0 * l->n_out;
    const float *y = c->act[li + 1];
    const float *W = l->kernel_off >= 0 ? m->params + l->kernel_off : NULL;
    const int64_t P = (int64_t)l->oh * l->ow;
    geom q = geom_of(l);
    switch (l->spec.kind) {
    case LOOM_LAYER_RESHAPE: return g;
    case LOOM_LAYER_ZERO_PADDING2D:
        if (!l->needs_dx) return NULL;
        zpad_backward(l, g, other, B);
        return other;
    case LOOM_LAYER_GLOBAL_MAX_POOL2D:
        if (!l->needs_dx) return NULL;
        gmp_backward(l, l->argmax + row0, g, other, B);
        return other;
    case LOOM_LAYER_UPSAMPLING2D:
        if (!l->needs_dx) return NULL;
        up_backward(l, g, other, B);
        return other;
    default:
        break;
    }
    /* the convolutions: dz rows (kept for the whole-batch parameter gradients), then the input gradient */
    float *dz = l->dz + row0;
    nn_layer_act_grad_(l, dz, g, y, B * P, l->cout);
    if (l->spec.kind == LOOM_LAYER_SEPARABLE_CONV2D) {
        const int cm = l->cin * l->mult;
        float *dmid = l->dmid + c->b0 * P * cm; /* the depthwise kernel's gradient needs it even without dx */
        loom_sgemm(false, true, (int)(B * P), cm, l->cout, 1.f, dz, l->cout, m->params + l->pw_off, l->cout, 0.f, dmid,
                   cm);
        if (!l->needs_dx) return NULL;
        gconv_backward(&q, W, dmid, other, B);
        return other;
    }
    if (!l->needs_dx) return NULL;
    if (l->spec.kind == LOOM_LAYER_CONV2D_TRANSPOSE) tconv_backward(&q, W, dz, other, B);
    else gconv_backward(&q, W, dz, other, B);
    return other;
}

/* Columns [n part / parts, n (part + 1) / parts) of db = the column sums of dz (rows, n), in row order. */
static void bias_cols(const float *restrict dz, int64_t rows, int64_t n, int part, int parts, float *restrict db)
{
    int64_t c0 = n * part / parts, c1 = n * (part + 1) / parts;
    for (int64_t j = c0; j < c1; j++) db[j] = 0.f;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = c0; j < c1; j++) db[j] += dz[r * n + j];
}

void nn_more_param_grads_(const loom_model *m, int li, const float *x, int64_t B, int part, int parts)
{
    const nn_layer_ *l = &m->layer[li];
    if (l->kernel_off < 0) return;
    const int64_t P = (int64_t)l->oh * l->ow;
    geom q = geom_of(l);
    float *dW = m->grads + l->kernel_off;
    if (l->spec.kind == LOOM_LAYER_CONV2D_TRANSPOSE) {
        int64_t K = (int64_t)l->kh * l->kw * l->cout;
        tconv_kernel_grad(&q, x, l->dz, B, K * part / parts, K * (part + 1) / parts, dW);
    } else {
        int64_t K = (int64_t)l->kh * l->kw * (q.cin / q.groups);
        const float *dz = l->spec.kind == LOOM_LAYER_SEPARABLE_CONV2D ? l->dmid : l->dz;
        gconv_kernel_grad(&q, x, dz, B, K * part / parts, K * (part + 1) / parts, dW);
    }
    if (l->spec.kind == LOOM_LAYER_SEPARABLE_CONV2D) {
        /* pointwise rows [r0, r1) of cm = mid[:, r0:r1]^T dz over the whole batch */
        const int64_t cm = (int64_t)l->cin * l->mult, r0 = nn_part_row_(m, cm, part, parts);
        const int64_t r1 = nn_part_row_(m, cm, part + 1, parts);
        if (r1 > r0)
            loom_sgemm(true, false, (int)(r1 - r0), l->cout, (int)(B * P), 1.f, l->mid + r0, (int)cm, l->dz, l->cout,
                       0.f, m->grads + l->pw_off + r0 * l->cout, l->cout);
    }
    if (l->bias_off >= 0) bias_cols(l->dz, B * P, l->cout, part, parts, m->grads + l->bias_off);
}
