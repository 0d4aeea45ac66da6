/* model_build.c - building a model from its spec (shape checks, the flat
 * parameter and gradient buffers, preallocated activations), its intra-op
 * threads, its accessors, and the initialisers; model.c runs the steps.
 * A softmax that is the model's last op under sparse softmax cross-entropy
 * is fused into the loss: the last layer keeps logits and the loss applies a
 * stable log-sum-exp (predict still returns probabilities). */
#include "nn_internal.h"

#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

/* im2col scratch per chunk: about half a typical L2, so the chunk's columns
 * stay in cache between im2col and the product that reads them. */
#define NN_COL_BYTES ((int64_t)1 << 20)
/* ... but at least this many output pixels per chunk's product: a wide layer's columns (3x3 on 512 channels: 18 KB
 * a pixel) fill that budget with one example of 49 pixels, and BLAS then packs the whole kernel (9.4 MB) again for
 * every 49 rows, in the forward and the input gradient, and the weight gradient loads and stores its rows of dW
 * once per chunk. */
#define NN_COL_ROWS 1024

/* An embedding table's initialiser, as Keras': uniform in [-0.05, 0.05). */
#define NN_INIT_EMBEDDING 101 /* (100 is NN_INIT_ONES_) */

static void shape_of(loom_shape *s, int rank, int64_t d0, int64_t d1, int64_t d2)
{
    memset(s, 0, sizeof *s);
    s->rank = rank;
    s->dim[0] = d0;
    s->dim[1] = d1;
    s->dim[2] = d2;
}

/* Output size along one axis, TF rules: VALID (in - k) / s + 1, SAME ceil(in / s)
 * with pad_total = max((out - 1) * s + k - in, 0) and pad_before = pad_total / 2. */
static int64_t out_dim(int64_t in, int k, int s, loom_padding p, int *pad_before)
{
    if (p == LOOM_PAD_SAME) {
        int64_t out = (in + s - 1) / s;
        int64_t tot = (out - 1) * s + k - in;
        *pad_before = tot > 0 ? (int)(tot / 2) : 0;
        return out;
    }
    *pad_before = 0;
    return in >= k ? (in - k) / s + 1 : 0;
}

static int add_param(loom_model *m, const nn_layer_ *l, const char *suffix, const loom_shape *shape, int init,
                     double fan_in, double fan_out)
{
    int64_t numel, total;
    if (!loom_dims_ok(shape->dim, shape->rank, &numel) || !loom_add_ok(m->n_params, numel, &total) || total > INT_MAX) {
        m->params_overflow = 1; /* reported by loom_model_new at the layer */
        return -1;
    }
    int i = m->n_ptensors++;
    loom_param_info *p = &m->pinfo[i];
    snprintf(p->name, sizeof p->name, "%s/%s", l->spec.name, suffix);
    p->offset = m->n_params;
    p->shape = *shape;
    m->pinit[i] = init;
    m->pfan_in[i] = fan_in;
    m->pfan_out[i] = fan_out;
    m->n_params = total;
    return (int)p->offset;
}

int nn_add_param_(loom_model *m, const nn_layer_ *l, const char *suffix, const loom_shape *shape, int init,
                  double fan_in, double fan_out)
{
    return add_param(m, l, suffix, shape, init, fan_in, fan_out);
}

/* ---- the shape rules: one function per layer kind -------------------------
 * Each sets l->out (and the kind's geometry in l) from l->in, adds the
 * layer's parameters, counts its flops, and refuses a shape it cannot take. */

static int dense_shapes(loom_model *m, nn_layer_ *l, int li, loom_err *err)
{
    (void)li;
    char a[96], b[96];
    const loom_layer_spec *s = &l->spec;
    const loom_shape *in = &l->in;
    if (in->rank < 1) {
        loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\" (dense) needs an input of rank 1 or more, got %s",
                     s->name, loom_shape_str(in, a, sizeof a));
        loom_shape flat;
        shape_of(&flat, 1, loom_shape_numel(in), 0, 0);
        return loom_err_hint(err, "add a flatten layer before it (%s -> %s)", a, loom_shape_str(&flat, b, sizeof b));
    }
    if (s->units < 1)
        return loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\": units = %d, must be >= 1", s->name, s->units);
    /* on the last axis (Keras): (..., D) -> (..., units), the same kernel for every row */
    const int64_t D = in->dim[in->rank - 1];
    l->out = *in;
    l->out.dim[in->rank - 1] = s->units;
    l->steps = D ? loom_shape_numel(in) / D : 0;
    l->act = s->activation;
    loom_shape ks;
    shape_of(&ks, 2, D, s->units, 0);
    l->kernel_off = add_param(m, l, "kernel", &ks, s->kernel_init, (double)D, (double)s->units);
    if (s->use_bias) {
        shape_of(&ks, 1, s->units, 0, 0);
        l->bias_off = add_param(m, l, "bias", &ks, LOOM_INIT_ZEROS, 0, 0);
    }
    m->flops += 2.0 * (double)loom_shape_numel(in) * s->units;
    return LOOM_OK;
}

/* conv2d's kernel and bias, once its window is placed (window_shapes) */
static int conv_params(loom_model *m, nn_layer_ *l, loom_err *err)
{
    const loom_layer_spec *s = &l->spec;
    if (s->filters < 1)
        return loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\": filters = %d, must be >= 1", s->name,
                            s->filters);
    l->cout = s->filters;
    l->act = s->activation;
    if (s->algorithm == LOOM_CONV_WINOGRAD && !nn_convw_shape_ok_(l))
        return loom_err_set(err, LOOM_ESHAPE, l->where,
                            "layer \"%s\": algorithm = \"winograd\" needs a 3x3 or 5x5 kernel, strides 1, padding "
                            "\"same\" and input and output channels multiples of 16 up to 256; got %dx%d, strides %dx%d, "
                            "%d -> %d channels",
                            s->name, l->kh, l->kw, l->sh, l->sw, l->cin, l->cout),
               loom_err_hint(err, "use algorithm = \"auto\" (Winograd where the shape allows it)");
    loom_shape ks = {.rank = 4, .dim = {l->kh, l->kw, l->cin, l->cout}};
    double rf = (double)l->kh * l->kw;
    l->kernel_off = add_param(m, l, "kernel", &ks, s->kernel_init, rf * l->cin, rf * l->cout);
    if (s->use_bias) {
        shape_of(&ks, 1, l->cout, 0, 0);
        l->bias_off = add_param(m, l, "bias", &ks, LOOM_INIT_ZEROS, 0, 0);
    }
    m->flops += 2.0 * l->oh * l->ow * rf * l->cin * l->cout;
    return LOOM_OK;
}

/* conv2d, max_pool2d and average_pooling2d: a window slid over (H, W, C) */
static int window_shapes(loom_model *m, nn_layer_ *l, int li, loom_err *err)
{
    (void)li;
    char a[96];
    const loom_layer_spec *s = &l->spec;
    const char *kind = nn_layer_kind_name_(s->kind);
    const loom_shape *in = &l->in;
    if (s->kind == LOOM_LAYER_CONV2D && (s->groups > 1 || s->dilation[0] > 1 || s->dilation[1] > 1))
        return nn_more_shapes_(m, l, li, err); /* conv_more.c's direct loops */
    if (in->rank != 3) {
        loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\" (%s) needs an (H, W, C) input, got %s", s->name, kind,
                     loom_shape_str(in, a, sizeof a));
        if (in->rank == 2)
            return loom_err_hint(err,
                                 "for (H, W) images add a reshape map with shape = [%lld, %lld, 1] to the "
                                 "input transforms",
                                 (long long)in->dim[0], (long long)in->dim[1]);
        return err->code;
    }
    int conv = s->kind == LOOM_LAYER_CONV2D;
    l->kh = conv ? s->kernel[0] : s->pool[0];
    l->kw = conv ? s->kernel[1] : s->pool[1];
    l->sh = s->stride[0] > 0 ? s->stride[0] : (conv ? 1 : l->kh);
    l->sw = s->stride[1] > 0 ? s->stride[1] : (conv ? 1 : l->kw);
    if (l->kh < 1 || l->kw < 1 || l->sh < 1 || l->sw < 1)
        return loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\": window %dx%d stride %dx%d must be >= 1",
                            s->name, l->kh, l->kw, l->sh, l->sw);
    l->ih = (int)in->dim[0];
    l->iw = (int)in->dim[1];
    l->cin = (int)in->dim[2];
    l->oh = (int)out_dim(l->ih, l->kh, l->sh, s->padding, &l->pad_t);
    l->ow = (int)out_dim(l->iw, l->kw, l->sw, s->padding, &l->pad_l);
    if (l->oh < 1 || l->ow < 1)
        return loom_err_set(err, LOOM_ESHAPE, l->where,
                            "layer \"%s\" (%s): a %dx%d window with valid padding does not fit the input %s", s->name,
                            kind, l->kh, l->kw, loom_shape_str(in, a, sizeof a)),
               loom_err_hint(err, "use padding = \"same\" or a smaller window");
    int rc = conv ? conv_params(m, l, err) : LOOM_OK;
    if (rc) return rc;
    if (!conv) l->cout = l->cin;
    shape_of(&l->out, 3, l->oh, l->ow, l->cout);
    return LOOM_OK;
}

static int embedding_shapes(loom_model *m, nn_layer_ *l, int li, loom_err *err)
{
    char a[96];
    const loom_layer_spec *s = &l->spec;
    const loom_shape *in = &l->in;
    if (li != 0 || l->src[0] != -1)
        return loom_err_set(err, LOOM_ESHAPE, l->where,
                            "layer \"%s\" (embedding) is layer %d; an embedding looks up the model's input ids, "
                            "so it must be the first layer and read the (first) model input", s->name, li),
               loom_err_hint(err, "move it to the top of model.layers; with model.inputs, list the ids first");
    if (in->rank > 2)
        return loom_err_set(err, LOOM_ESHAPE, l->where,
                            "layer \"%s\" (embedding) needs ids of shape (), (columns,) or (columns, k), got %s",
                            s->name, loom_shape_str(in, a, sizeof a));
    if (s->input_dim < 1 || s->output_dim < 1)
        return loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\": input_dim = %lld and output_dim = %d "
                            "must be >= 1", s->name, (long long)s->input_dim, s->output_dim);
    l->rows = s->input_dim;
    l->dim = s->output_dim;
    l->cols = in->rank >= 1 ? (int)in->dim[0] : 1;
    l->k = in->rank == 2 ? (int)in->dim[1] : 1;
    if (in->rank == 0) shape_of(&l->out, 1, l->dim, 0, 0);
    else shape_of(&l->out, 2, l->cols, l->dim, 0);
    loom_shape ks;
    shape_of(&ks, 2, l->rows, l->dim, 0);
    l->kernel_off = add_param(m, l, "embeddings", &ks, NN_INIT_EMBEDDING, 0, 0);
    if (s->mask_zero) {
        if (in->rank != 1)
            return loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\" (embedding): mask_zero needs ids of shape "
                                "(T,), a sequence, got %s", s->name, loom_shape_str(in, a, sizeof a));
        m->mask_T = l->cols; /* (a model holds one mask: one embedding sets it) */
    }
    m->flops += (double)l->cols * l->k * l->dim;
    return LOOM_OK;
}

static int global_pool_shapes(loom_model *m, nn_layer_ *l, int li, loom_err *err)
{
    (void)m, (void)li;
    char a[96];
    const loom_shape *in = &l->in;
    if (in->rank != 3)
        return loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\" (%s) needs an (H, W, C) input, got %s",
                            l->spec.name, nn_layer_kind_name_(l->spec.kind), loom_shape_str(in, a, sizeof a));
    l->ih = (int)in->dim[0], l->iw = (int)in->dim[1], l->cin = l->cout = (int)in->dim[2];
    shape_of(&l->out, 1, in->dim[2], 0, 0);
    return LOOM_OK;
}

/* batch_normalization and layer_normalization: gamma and beta over the last axis */
static int norm_shapes(loom_model *m, nn_layer_ *l, int li, loom_err *err)
{
    (void)li;
    const loom_layer_spec *s = &l->spec;
    const loom_shape *in = &l->in;
    bool bn = s->kind == LOOM_LAYER_BATCH_NORM;
    if (in->rank < 1)
        return loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\" (%s) needs features, got a scalar", s->name,
                            nn_layer_kind_name_(s->kind));
    l->out = *in;
    l->C = in->dim[in->rank - 1];
    loom_shape cs;
    shape_of(&cs, 1, l->C, 0, 0);
    l->kernel_off = add_param(m, l, "gamma", &cs, NN_INIT_ONES_, 0, 0);
    l->bias_off = add_param(m, l, "beta", &cs, LOOM_INIT_ZEROS, 0, 0);
    if (bn) {
        l->mm_off = add_param(m, l, "moving_mean", &cs, LOOM_INIT_ZEROS, 0, 0);
        l->mv_off = add_param(m, l, "moving_variance", &cs, NN_INIT_ONES_, 0, 0);
        m->n_bn++;
        m->n_sync_bn += s->sync;
    }
    if (!(s->epsilon > 0)) l->spec.epsilon = 1e-3;
    if (bn && !(s->momentum >= 0 && s->momentum < 1)) l->spec.momentum = 0.99;
    m->flops += 4.0 * (double)loom_shape_numel(in);
    return LOOM_OK;
}

static int dropout_shapes(loom_model *m, nn_layer_ *l, int li, loom_err *err)
{
    (void)m, (void)li;
    if (!(l->spec.rate >= 0 && l->spec.rate < 1))
        return loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\": rate = %g, must be in [0, 1)", l->spec.name,
                            l->spec.rate);
    l->out = l->in;
    return LOOM_OK;
}

static int flatten_shapes(loom_model *m, nn_layer_ *l, int li, loom_err *err)
{
    (void)m, (void)li, (void)err;
    shape_of(&l->out, 1, loom_shape_numel(&l->in), 0, 0);
    return LOOM_OK;
}

static int activation_shapes(loom_model *m, nn_layer_ *l, int li, loom_err *err)
{
    (void)m, (void)li;
    char a[96];
    const loom_layer_spec *s = &l->spec;
    l->out = l->in;
    l->act = s->activation;
    if (l->act == LOOM_ACT_LEAKY_RELU && !(s->alpha >= 0)) l->spec.alpha = 0.3;
    if (l->act == LOOM_ACT_SOFTMAX && l->in.rank != 1)
        return loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\": softmax needs a rank-1 input, got %s", s->name,
                            loom_shape_str(&l->in, a, sizeof a)),
               loom_err_hint(err, "add a flatten layer before it");
    return LOOM_OK;
}

/* The shape rule of each layer kind, by loom_layer_kind. */
static int (*const kind_shapes[])(loom_model *m, nn_layer_ *l, int li, loom_err *err) = {
    [LOOM_LAYER_DENSE] = dense_shapes,
    [LOOM_LAYER_CONV2D] = window_shapes,
    [LOOM_LAYER_MAX_POOL2D] = window_shapes,
    [LOOM_LAYER_AVG_POOL2D] = window_shapes,
    [LOOM_LAYER_DROPOUT] = dropout_shapes,
    [LOOM_LAYER_FLATTEN] = flatten_shapes,
    [LOOM_LAYER_ACTIVATION] = activation_shapes,
    [LOOM_LAYER_BATCH_NORM] = norm_shapes,
    [LOOM_LAYER_LAYER_NORM] = norm_shapes,
    [LOOM_LAYER_GLOBAL_AVG_POOL2D] = global_pool_shapes,
    [LOOM_LAYER_EMBEDDING] = embedding_shapes,
    [LOOM_LAYER_ZERO_PADDING2D] = nn_more_shapes_,
    [LOOM_LAYER_GLOBAL_MAX_POOL2D] = nn_more_shapes_,
    [LOOM_LAYER_RESHAPE] = nn_more_shapes_,
    [LOOM_LAYER_UPSAMPLING2D] = nn_more_shapes_,
    [LOOM_LAYER_DEPTHWISE_CONV2D] = nn_more_shapes_,
    [LOOM_LAYER_SEPARABLE_CONV2D] = nn_more_shapes_,
    [LOOM_LAYER_CONV2D_TRANSPOSE] = nn_more_shapes_,
    [LOOM_LAYER_CONV1D] = nn_more_shapes_,
    [LOOM_LAYER_ADD] = nn_merge_shapes_,
    [LOOM_LAYER_SUBTRACT] = nn_merge_shapes_,
    [LOOM_LAYER_MULTIPLY] = nn_merge_shapes_,
    [LOOM_LAYER_AVERAGE] = nn_merge_shapes_,
    [LOOM_LAYER_MAXIMUM] = nn_merge_shapes_,
    [LOOM_LAYER_CONCATENATE] = nn_merge_shapes_,
    [LOOM_LAYER_LSTM] = nn_rnn_shapes_,
    [LOOM_LAYER_GRU] = nn_rnn_shapes_,
    [LOOM_LAYER_BIDIRECTIONAL] = nn_rnn_shapes_,
    [LOOM_LAYER_MULTI_HEAD_ATTENTION] = nn_attn_shapes_,
    [LOOM_LAYER_POSITIONAL_EMBEDDING] = nn_attn_shapes_,
    [LOOM_LAYER_PLUGIN] = nn_plugin_shapes_,
};

/* The kinds with a kernel of their own and an activation (model.c's steps too). */
bool nn_kernel_kind_(loom_layer_kind k)
{
    return k == LOOM_LAYER_DENSE || k == LOOM_LAYER_CONV2D || k == LOOM_LAYER_DEPTHWISE_CONV2D ||
           k == LOOM_LAYER_SEPARABLE_CONV2D || k == LOOM_LAYER_CONV2D_TRANSPOSE || k == LOOM_LAYER_CONV1D;
}

/* A dense or conv2d layer's own activation: leaky_relu and gelu take a layer
 * of their own, and a softmax needs a rank-1 output. */
static int fused_activation_ok(const nn_layer_ *l, loom_err *err)
{
    char a[96];
    const loom_layer_spec *s = &l->spec;
    if (!nn_kernel_kind_(s->kind)) return LOOM_OK;
    if (l->act == LOOM_ACT_LEAKY_RELU || l->act == LOOM_ACT_GELU)
        return loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\" (%s): activation \"%s\" is an activation layer "
                            "of its own", s->name, nn_layer_kind_name_(s->kind), nn_activation_name_(l->act)),
               loom_err_hint(err, "set activation = \"none\" here and add { type = \"activation\"; activation = \"%s\"; } "
                                  "after it", nn_activation_name_(l->act));
    if (l->act == LOOM_ACT_SOFTMAX && l->out.rank != 1 && s->kind != LOOM_LAYER_DENSE)
        return loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\": softmax needs a rank-1 output, got %s",
                            s->name, loom_shape_str(&l->out, a, sizeof a));
    return LOOM_OK;
}

/* Layer li's output shape and parameters from its input shape, by its kind's rule. */
static int layer_shapes(loom_model *m, nn_layer_ *l, int li, loom_err *err)
{
    loom_layer_kind k = l->spec.kind;
    l->kernel_off = l->bias_off = l->mm_off = l->mv_off = l->pw_off = -1;
    l->act = LOOM_ACT_NONE;
    if ((unsigned)k >= sizeof kind_shapes / sizeof kind_shapes[0] || !kind_shapes[k])
        return loom_err_set(err, LOOM_ESHAPE, l->where, "layer %d: unknown kind %d", li, (int)k);
    int rc = kind_shapes[k](m, l, li, err);
    if (rc || (rc = fused_activation_ok(l, err))) return rc;
    l->n_in = loom_shape_numel(&l->in);
    l->n_out = loom_shape_numel(&l->out);
    return LOOM_OK;
}

static int check_loss(loom_model *m, const loom_shape *label, loom_dtype label_dtype, loom_err *err)
{
    char a[96], b[96];
    const loom_shape out = m->layer[m->n_layers - 1].out;
    const char *where = m->layer[m->n_layers - 1].where;
    const char *lname = loom_loss_name(m->loss);
    if ((unsigned)label_dtype >= LOOM_NDTYPES_)
        return loom_err_set(err, LOOM_ESHAPE, m->where, "label dtype %d is not known", (int)label_dtype);
    if (m->loss == LOOM_LOSS_SPARSE_SOFTMAX_CE && out.rank == 2 && label->rank == 1 && label->dim[0] == out.dim[0]) {
        /* per token: output (T, V), labels (T,) (a language model's targets) */
        if (m->n_cw)
            return loom_err_set(err, LOOM_EUNSUPPORTED, m->where, "model.class_weight with a per-token loss (output "
                                "%s) is not supported", loom_shape_str(&out, a, sizeof a)),
                   loom_err_hint(err, "drop model.class_weight; model.ignore_label masks tokens");
        m->seq_T = out.dim[0];
        return LOOM_OK;
    }
    if (m->loss == LOOM_LOSS_SPARSE_SOFTMAX_CE) {
        if (out.rank == 2 && label->rank == 1)
            return loom_err_set(err, LOOM_ESHAPE, where, "sparse_softmax_cross_entropy per token needs labels of "
                                "the output's steps: label %s, model output %s (steps, classes)",
                                loom_shape_str(label, a, sizeof a), loom_shape_str(&out, b, sizeof b)),
                   loom_err_hint(err, "make the targets as long as the input sequence (lm_pairs does)");
        if (out.rank == 1 && label->rank == 1)
            return loom_err_set(err, LOOM_ESHAPE, where, "sparse_softmax_cross_entropy: the labels %s are per token "
                                "but the model output %s has no time axis", loom_shape_str(label, a, sizeof a),
                                loom_shape_str(&out, b, sizeof b)),
                   loom_err_hint(err, "set return_sequences = true on the last lstm/gru, so the dense after it "
                                      "gives (steps, classes)");
        if (out.rank != 1)
            return loom_err_set(err, LOOM_ESHAPE, where,
                                "sparse_softmax_cross_entropy needs a rank-1 model output (classes,), got %s",
                                loom_shape_str(&out, a, sizeof a)),
                   loom_err_hint(err, "end the model with a flatten and a dense layer with one unit per class (for "
                                      "a class per time step: labels of shape (T,) and an output (T, classes))");
        if (label->rank != 0)
            return loom_err_set(err, LOOM_ESHAPE, m->where,
                                "sparse_softmax_cross_entropy needs an integer class label of shape () per "
                                "example, got %s (model output %s)",
                                loom_shape_str(label, a, sizeof a), loom_shape_str(&out, b, sizeof b)),
                   loom_err_hint(err, "for one-hot labels use loss = \"mean_squared_error\", or drop the one_hot map");
        if (m->n_cw && m->n_cw != out.dim[0])
            return loom_err_set(err, LOOM_ECONFIG, m->where, "model.class_weight has %d weights for %lld classes",
                                m->n_cw, (long long)out.dim[0]);
        return LOOM_OK;
    }
    int64_t n = loom_shape_numel(&out);
    /* a scalar label for a one-unit output: the usual regression or binary target */
    int scalar_ok = label->rank == 0 && n == 1;
    if (!scalar_ok && !loom_shape_eq(label, &out)) {
        loom_err_set(err, LOOM_ESHAPE, where, "%s needs labels of the output's shape: label %s, model output %s",
                     lname, loom_shape_str(label, a, sizeof a), loom_shape_str(&out, b, sizeof b));
        int ints = label_dtype == LOOM_U8 || label_dtype == LOOM_I32 || label_dtype == LOOM_I64;
        if (out.rank == 1 && label->rank == 0 && ints && m->loss != LOOM_LOSS_BCE)
            return loom_err_hint(err, "for class labels add a one_hot map with depth = %lld to the label, or use loss "
                                      "= \"sparse_softmax_cross_entropy\"",
                                 (long long)out.dim[0]);
        if (label->rank == 0)
            return loom_err_hint(err, "for a scalar target end the model with a dense layer with units = 1");
        return loom_err_hint(err, "change the last layer or the label transforms so the shapes agree");
    }
    if (m->n_cw && m->loss != LOOM_LOSS_BCE)
        return loom_err_set(err, LOOM_ECONFIG, m->where, "model.class_weight needs classes; the loss %s has none",
                            lname);
    if (m->n_cw && (m->n_cw != 2 || n != 1))
        return loom_err_set(err, LOOM_ECONFIG, m->where,
                            "model.class_weight for binary_cross_entropy is [negative, positive] with one output "
                            "unit; got %d weights for %lld outputs",
                            m->n_cw, (long long)n);
    return LOOM_OK;
}

/* The model's inputs beyond the first, for model_build (loom_model_new_inputs). */
typedef struct more_inputs {
    int               n;      /* all inputs, the first included; 0: loom_model_new's one */
    const loom_shape *shapes;
    const loom_dtype *dtypes;
} more_inputs;

/* What model_build makes: the model with its step's buffers, without them (loom_model_new_plan), or the
 * variable list alone (loom_model_param_list). */
enum { BUILD_FULL, BUILD_PLAN, BUILD_SHAPES };
static int model_build(loom_model **out, const loom_model_spec *spec, const loom_shape *input, loom_dtype input_dtype,
                       const loom_shape *label, loom_dtype label_dtype, int64_t max_batch, int mode,
                       const more_inputs *more, loom_err *err);

int loom_model_new(loom_model **out, const loom_model_spec *spec, const loom_shape *input, loom_dtype input_dtype,
                   const loom_shape *label, loom_dtype label_dtype, int64_t max_batch, loom_err *err)
{
    return model_build(out, spec, input, input_dtype, label, label_dtype, max_batch, BUILD_FULL, NULL, err);
}

int loom_model_new_inputs(loom_model **out, const loom_model_spec *spec, int n, const loom_shape *inputs,
                          const loom_dtype *dtypes, const loom_shape *label, loom_dtype label_dtype,
                          int64_t max_batch, loom_err *err)
{
    more_inputs more = {n, inputs, dtypes};
    return model_build(out, spec, &inputs[0], dtypes[0], label, label_dtype, max_batch, BUILD_FULL, &more, err);
}

int loom_model_new_plan(loom_model **out, const loom_model_spec *spec, int n, const loom_shape *inputs,
                        const loom_dtype *dtypes, const loom_shape *label, loom_dtype label_dtype, int64_t max_batch,
                        loom_err *err)
{
    more_inputs more = {n, inputs, dtypes};
    return model_build(out, spec, &inputs[0], dtypes[0], label, label_dtype, max_batch, BUILD_PLAN,
                       n > 1 ? &more : NULL, err);
}

int loom_model_num_inputs(const loom_model *m) { return m->n_inputs; }

void loom_model_set_inputs(loom_model *m, const loom_tensor *const *xs, int n)
{
    for (int f = 1; f < m->n_inputs; f++) m->xs[f] = xs && f - 1 < n ? xs[f - 1] : NULL;
}

int loom_model_param_list(const loom_model_spec *spec, int n_in, const loom_shape *inputs, const loom_dtype *dtypes,
                          const loom_shape *label, loom_dtype label_dtype, loom_param_info **out, int *n,
                          int64_t *n_params, loom_sparse_grad *table, loom_err *err)
{
    *out = NULL;
    *n = 0;
    loom_model *m;
    more_inputs more = {n_in, inputs, dtypes};
    int rc = model_build(&m, spec, &inputs[0], dtypes[0], label, label_dtype, 1, BUILD_SHAPES, n_in > 1 ? &more : NULL, err);
    if (rc) return rc;
    *out = loom_calloc((size_t)(m->n_ptensors ? m->n_ptensors : 1), sizeof **out);
    if (!*out) rc = loom_err_set(err, LOOM_ENOMEM, m->where, "listing %d variables", m->n_ptensors);
    else memcpy(*out, m->pinfo, (size_t)m->n_ptensors * sizeof **out), *n = m->n_ptensors;
    *n_params = m->n_params;
    if (table) {
        memset(table, 0, sizeof *table);
        table->param = -1;
        if (loom_model_num_sparse(m) == 1) loom_model_sparse_grad(m, 0, table);
    }
    loom_model_free(m);
    return rc;
}

/* ---- the build, stage by stage ----------------------------------------------
 * model_build runs the stages in order (the input, the layers and their
 * shapes, the loss's checks, the fusions, the memory bound checked before any
 * allocation, then the buffers); each reads and fills the model the previous
 * one left, and model_build frees it in one place when one fails. */

/* The model's input: float32 features, or int32/int64 ids for an embedding;
 * a layer count and a batch in range. */
static int check_input(const loom_model *m, const loom_model_spec *spec, loom_err *err)
{
    char a[96];
    int ids_in = spec->n_layers >= 1 && spec->layer[0].kind == LOOM_LAYER_EMBEDDING;
    if (ids_in && m->input_dtype != LOOM_I32 && m->input_dtype != LOOM_I64)
        return loom_err_set(err, LOOM_ESHAPE, m->where, "model input \"%s\" is %s %s; an embedding layer needs "
                            "int32 or int64 ids", spec->input, loom_dtype_name(m->input_dtype),
                            loom_shape_str(&m->input, a, sizeof a)),
               loom_err_hint(err, "add a cast map (dtype = \"int64\") for \"%s\" to the data transforms", spec->input);
    if (!ids_in && m->input_dtype != LOOM_F32)
        return loom_err_set(err, LOOM_ESHAPE, m->where, "model input \"%s\" is %s %s; layers need float32",
                            spec->input, loom_dtype_name(m->input_dtype), loom_shape_str(&m->input, a, sizeof a)),
               loom_err_hint(err,
                             "add a cast map (dtype = \"float32\") or a scale map (scale = 0.00392156862745098, i.e. "
                             "1/255) for \"%s\" to the data transforms",
                             spec->input);
    if (spec->n_layers < 1 || spec->n_layers > LOOM_MAX_LAYERS)
        return loom_err_set(err, LOOM_ESHAPE, m->where, "model has %d layers (expected 1 to %d)", spec->n_layers,
                            LOOM_MAX_LAYERS);
    if (m->max_batch < 1)
        return loom_err_set(err, LOOM_ESHAPE, m->where, "max_batch = %lld, must be >= 1", (long long)m->max_batch);
    return LOOM_OK;
}

/* Every layer's shapes and parameters, in the graph's order (graph.c), each
 * layer's input the output of the layer it names (default the previous one). */
static int build_layers(loom_model *m, const loom_model_spec *spec, loom_err *err)
{
    char a[96];
    int order[LOOM_MAX_LAYERS], src[LOOM_MAX_LAYERS][LOOM_MAX_LAYER_INPUTS], n_src[LOOM_MAX_LAYERS], n = 0;
    loom_model_spec *named = loom_alloc(sizeof *named); /* the spec with every layer named, as the config names them */
    if (!named) return loom_err_set(err, LOOM_ENOMEM, m->where, "cannot allocate the model's spec");
    memcpy(named, spec, sizeof *named);
    for (int i = 0; i < spec->n_layers; i++)
        if (!named->layer[i].name[0])
            snprintf(named->layer[i].name, sizeof named->layer[i].name, "%s_%d",
                     nn_layer_kind_name_(named->layer[i].kind), i);
    int rc = nn_graph_order_(m, named, order, &n, src, n_src, err);
    if (rc) {
        loom_free(named);
        return rc;
    }
    m->n_layers = n;
    for (int i = 0; i < m->n_layers; i++) {
        nn_layer_ *l = &m->layer[i];
        l->spec = named->layer[order[i]];
        nn_loc_str_(&l->spec.loc, l->where, sizeof l->where);
        if (!l->where[0]) snprintf(l->where, sizeof l->where, "%s", m->where);
        l->n_src = n_src[i];
        for (int k = 0; k < l->n_src; k++) {
            l->src[k] = src[i][k];
            l->src_shape[k] = l->src[k] >= 0 ? m->layer[l->src[k]].out : m->in_shape[-1 - l->src[k]];
        }
        l->in = l->src_shape[0];
        rc = layer_shapes(m, l, i, err);
        if (rc) break;
        if (m->params_overflow) {
            loom_free(named);
            return loom_err_set(err, LOOM_ECONFIG, l->where,
                                "layer \"%s\" (%s) takes the model past %d parameters (its input is %s)", l->spec.name,
                                nn_layer_kind_name_(l->spec.kind), INT_MAX, loom_shape_str(&l->in, a, sizeof a)),
                   loom_err_hint(err, "use fewer units or filters, or a smaller kernel");
        }
        /* the input gradient is needed when a layer upstream has parameters (a chain: an earlier one) */
        l->needs_dx = 0;
        for (int k = 0; k < l->n_src; k++) l->needs_dx |= l->src[k] >= 0 && m->layer[l->src[k]].need_out;
        l->need_out = l->kernel_off >= 0 || l->needs_dx;
    }
    loom_free(named);
    if (rc) return rc;
    m->n_heads = spec->n_heads > 1 ? spec->n_heads : 1;
    m->head[0].layer = m->n_layers - 1;
    m->head[0].loss = m->loss;
    m->head[0].weight = spec->n_heads ? (float)spec->head[0].weight : 1.f;
    snprintf(m->head[0].name, sizeof m->head[0].name, "%s", m->layer[m->n_layers - 1].spec.name);
    for (int h = 1; h < m->n_heads; h++) {
        const struct loom_head_spec *hs = &spec->head[h];
        struct nn_head_ *hd = &m->head[h];
        char w[LOOM_PATH_MAX + 16];
        nn_loc_str_(&hs->loc, w, sizeof w);
        if (!w[0]) snprintf(w, sizeof w, "%s", m->where);
        hd->layer = -1;
        for (int i = 0; i < m->n_layers; i++)
            if (!strcmp(m->layer[i].spec.name, hs->layer)) hd->layer = i;
        for (int g = 0; g < h; g++)
            if (hd->layer >= 0 && m->head[g].layer == hd->layer)
                return loom_err_set(err, LOOM_ECONFIG, w, "model.outputs: layer \"%s\" is head %d and head %d",
                                    hs->layer, g, h),
                       loom_err_hint(err, "each head names a layer of its own");
        hd->loss = hs->loss;
        hd->weight = (float)hs->weight;
        hd->accuracy = hs->accuracy;
        snprintf(hd->name, sizeof hd->name, "%s", hs->layer);
        const nn_layer_ *l = &m->layer[hd->layer];
        if (hd->loss == LOOM_LOSS_HUBER)
            return loom_err_set(err, LOOM_EUNSUPPORTED, w, "model.outputs: head \"%s\": huber is the first head's "
                                "loss only", hs->layer),
                   loom_err_hint(err, "use mean_squared_error or mean_absolute_error on this head");
        if (hd->loss == LOOM_LOSS_SPARSE_SOFTMAX_CE && (l->out.rank != 1 || l->n_out < 2))
            return loom_err_set(err, LOOM_ESHAPE, w, "model.outputs: head \"%s\": sparse_softmax_cross_entropy "
                                "needs a (classes,) output of 2 or more; the layer's is %s", hs->layer,
                                loom_shape_str(&l->out, a, sizeof a)),
                   loom_err_hint(err, "end the head with a dense layer of one unit per class");
    }
    nn_graph_links_(m);
    return LOOM_OK;
}

/* Activations and adds over their input's buffer (nn_internal.h, inplace): the input is a batch
 * normalization (its backward recomputes xhat from its own input) or an add (its backward passes the
 * gradient on), read by this layer alone, not a head; the add's input 0 has the output's shape. A relu
 * over a batch normalization goes into the batch normalization's passes (bn_relu, relu_in_bn). */
static void fuse_inplace(loom_model *m)
{
    for (int i = 0; i < m->n_layers; i++) {
        nn_layer_ *l = &m->layer[i];
        int s = l->src[0];
        loom_layer_kind k = l->spec.kind;
        bool act_y = k == LOOM_LAYER_ACTIVATION && l->act != LOOM_ACT_NONE && l->act != LOOM_ACT_LEAKY_RELU &&
                     l->act != LOOM_ACT_GELU && !nn_act_needs_x_(l->act);
        if (s < 0 || !(act_y || (k == LOOM_LAYER_ADD && l->bstride[0][0] < 0))) continue;
        const nn_layer_ *p = &m->layer[s];
        bool head = false;
        for (int h = 0; h < m->n_heads; h++) head |= m->head[h].layer == s;
        if (head || p->n_cons != 1 || (p->spec.kind != LOOM_LAYER_BATCH_NORM && p->spec.kind != LOOM_LAYER_ADD)) continue;
        l->inplace = 1;
        if (l->act == LOOM_ACT_RELU && p->spec.kind == LOOM_LAYER_BATCH_NORM)
            l->relu_in_bn = m->layer[s].bn_relu = 1;
    }
}

static void fuse(loom_model *m)
{
    nn_layer_ *last = &m->layer[m->n_layers - 1];
    /* the loss takes logits: a softmax (sigmoid) ending the model is fused into softmax (binary) cross-entropy */
    if (m->loss == LOOM_LOSS_SPARSE_SOFTMAX_CE && last->act == LOOM_ACT_SOFTMAX) last->act = LOOM_ACT_NONE;
    if (m->loss == LOOM_LOSS_BCE && last->act == LOOM_ACT_SIGMOID) last->act = LOOM_ACT_NONE;
    /* conv2d (none or relu) + a max_pool2d tiling its output: fused (nn_internal.h, fuse_pool) */
    for (int i = 0; i + 1 < m->n_layers; i++) {
        nn_layer_ *l = &m->layer[i], *p = &m->layer[i + 1];
        if (l->spec.kind != LOOM_LAYER_CONV2D || l->direct || p->spec.kind != LOOM_LAYER_MAX_POOL2D) continue;
        if (l->gacc || l->n_cons != 1 || p->src[0] != i) continue; /* a graph: the pool alone reads the conv */
        if (l->act != LOOM_ACT_NONE && l->act != LOOM_ACT_RELU) continue;
        if (p->sh != p->kh || p->sw != p->kw || p->pad_t || p->pad_l || p->oh * p->kh != p->ih || p->ow * p->kw != p->iw)
            continue;
        l->fuse_pool = p->fused = 1;
    }
    /* a batch normalization's input gradient into its conv's dz rows (bn_dx_dz) */
    for (int i = 1; i < m->n_layers; i++) {
        nn_layer_ *l = &m->layer[i];
        const nn_layer_ *p = &m->layer[i - 1];
        l->bn_dx_dz = l->spec.kind == LOOM_LAYER_BATCH_NORM && l->n_src == 1 && l->src[0] == i - 1 && !p->gacc &&
                      p->spec.kind == LOOM_LAYER_CONV2D && !p->direct && !p->fuse_pool && p->act == LOOM_ACT_NONE &&
                      p->kernel_off >= 0;
    }
    fuse_inplace(m);
}

/* What the buffers take, checked before any is allocated: a layer or a batch
 * that cannot fit is the config's error, not an allocation's. */
static int check_memory(const loom_model *m, loom_err *err)
{
    char a[96];
    int64_t max_batch = m->max_batch, phys = loom_phys_bytes(), need = 0;
    if (!loom_mul_ok(m->n_params, 2 * (int64_t)sizeof(float), &need)) need = INT64_MAX;
    for (int i = 0; i < m->n_layers; i++) {
        const nn_layer_ *l = &m->layer[i];
        int64_t act = 0;
        bool ok = loom_mul_ok(max_batch, l->n_out > l->n_in ? l->n_out : l->n_in, &act) &&
                  loom_mul_ok(act, 3 * (int64_t)sizeof(float), &act) && loom_add_ok(need, act, &need);
        if (!ok || need > phys) {
            char b[48];
            snprintf(b, sizeof b, ok ? "%lld" : "more than 2^63", (long long)need);
            return loom_err_set(err, LOOM_ECONFIG, l->where,
                                "layer \"%s\" (%s, output %s) needs %s bytes of parameters and activations for batch "
                                "%lld, more than this machine's %lld bytes of memory",
                                l->spec.name, nn_layer_kind_name_(l->spec.kind), loom_shape_str(&l->out, a, sizeof a),
                                b, (long long)max_batch, (long long)phys),
                   loom_err_hint(err, "use fewer units or filters, or a smaller batch size");
        }
    }
    return LOOM_OK;
}

/* An embedding's lookup buffers: the batch's distinct rows and their hash. */
static bool embedding_buffers(nn_layer_ *l, int64_t max_batch)
{
    int64_t per = (int64_t)l->cols * l->k, mx = max_batch * per;
    l->sp_max = mx < l->rows ? mx : l->rows;
    for (l->hsize = 16; l->hsize < 2 * l->sp_max;) l->hsize *= 2;
    if (!(l->y = loom_alloc_aligned((size_t)(max_batch * l->n_out) * sizeof(float))) ||
        !(l->dz = loom_alloc_aligned((size_t)(max_batch * l->n_out) * sizeof(float))) ||
        !(l->sp_ids = loom_alloc_aligned((size_t)l->sp_max * sizeof(int64_t))) ||
        !(l->sp_val = loom_alloc_aligned((size_t)(l->sp_max * l->dim) * sizeof(float))) ||
        !(l->hkey = loom_alloc_aligned((size_t)l->hsize * sizeof(int64_t))) ||
        !(l->hval = loom_alloc_aligned((size_t)l->hsize * sizeof(int32_t))))
        return false;
    memset(l->hkey, 0xff, (size_t)l->hsize * sizeof(int64_t)); /* all -1: empty */
    return true;
}

/* A conv2d's examples per im2col chunk and its kernels; returns the floats of
 * column scratch it needs (0 for a pointwise conv, which needs none). */
static int64_t conv_chunk(nn_layer_ *l, int64_t max_batch, int m_row_q)
{
    int64_t colmax = 0;
    int64_t per = (int64_t)l->oh * l->ow * l->kh * l->kw * l->cin * (int64_t)sizeof(float);
    int64_t c = NN_COL_BYTES / per, pix = (int64_t)l->oh * l->ow;
    if (c * pix < NN_COL_ROWS) c = (NN_COL_ROWS + pix - 1) / pix;
    /* the chunk's rows (c * pix) a multiple of the BLAS's row quantum, so that
     * calls start at the same tiles however the batch is split (blas.c) */
    int64_t q = m_row_q, g = pix;
    for (int64_t a = q; a;) { int64_t t = g % a; g = a; a = t; } /* g = gcd(q, pix) */
    if (q > 1) c = (c + q / g - 1) / (q / g) * (q / g);
    l->chunk = (int)(c < 1 ? 1 : c > max_batch ? max_batch : c);
    int pointwise = nn_conv_pointwise_(l);
    if (pointwise) l->chunk = (int)max_batch;
    else colmax = l->chunk * per / (int64_t)sizeof(float);
    /* cin = 1 runs direct (layers.c): a padded plane and a kernel-sized sum */
    int64_t direct = ((int64_t)(l->oh - 1) * l->sh + l->kh) * ((int64_t)(l->ow - 1) * l->sw + l->kw) +
                     (int64_t)l->kh * l->kw * l->cout;
    if (l->cin == 1 && !pointwise && direct > colmax) colmax = direct;
    /* kernels by the CPU's features, read at start: 2 = 512 bits wide, 1 = AVX2+FMA, 0 = generic */
    l->fma = loom_cpu()->level >= LOOM_CPU_AVX512 ? 2 : loom_cpu()->level >= LOOM_CPU_AVX2_FMA;
    if (nn_conv3_ok_(l) && nn_conv3_scratch_(l) > colmax) colmax = nn_conv3_scratch_(l); /* conv_fast.c */
    if (nn_convd_ok_(l) && nn_convd_scratch_(l) > colmax) colmax = nn_convd_scratch_(l); /* conv_direct.c */
    if (nn_convw_ok_(l) && nn_convw_scratch_(l) > colmax) colmax = nn_convw_scratch_(l); /* conv_winograd.c */
    return colmax;
}

/* A layer's own buffers, all sized for max_batch; false when one cannot be allocated. */
static bool layer_buffers(nn_layer_ *l, int64_t max_batch)
{
    loom_layer_kind k = l->spec.kind;
    int norm = k == LOOM_LAYER_BATCH_NORM || k == LOOM_LAYER_LAYER_NORM;
    int owns_y = nn_kernel_kind_(k) || k == LOOM_LAYER_MAX_POOL2D || k == LOOM_LAYER_ZERO_PADDING2D ||
                 k == LOOM_LAYER_GLOBAL_MAX_POOL2D || k == LOOM_LAYER_UPSAMPLING2D ||
                 (k == LOOM_LAYER_DROPOUT && l->spec.rate > 0) || (k == LOOM_LAYER_ACTIVATION && l->act) || norm ||
                 k == LOOM_LAYER_AVG_POOL2D || k == LOOM_LAYER_GLOBAL_AVG_POOL2D ||
                 (k >= LOOM_LAYER_ADD && k <= LOOM_LAYER_CONCATENATE);
    size_t outs = (size_t)(max_batch * l->n_out);
    if (k == LOOM_LAYER_LAYER_NORM && !(l->xhat = loom_alloc_aligned(outs * sizeof(float)))) return false;
    if (norm && !(l->stat = loom_alloc_aligned(
                      (size_t)(k == LOOM_LAYER_BATCH_NORM ? nn_bn_stat_floats_(l->C) : max_batch * l->n_out / l->C) * sizeof(float))))
        return false;
    if (k == LOOM_LAYER_LAYER_NORM && !(l->dz = loom_alloc_aligned(outs * sizeof(float)))) return false;
    if (owns_y && !l->inplace && !(l->arena & NN_ARENA_Y) && !(l->y = loom_alloc_aligned(outs * sizeof(float)))) return false;
    if ((k == LOOM_LAYER_MAX_POOL2D || k == LOOM_LAYER_GLOBAL_MAX_POOL2D) &&
        !(l->argmax = loom_alloc_aligned(outs * sizeof(int32_t))))
        return false;
    if (k == LOOM_LAYER_SEPARABLE_CONV2D) {
        size_t mid = (size_t)(max_batch * l->oh * l->ow) * (size_t)(l->cin * l->mult) * sizeof(float);
        if (!(l->mid = loom_alloc_aligned(mid)) || !(l->dmid = loom_alloc_aligned(mid))) return false;
    }
    if ((nn_kernel_kind_(k) || l->fused) && !(l->arena & NN_ARENA_DZ) &&
        !(l->dz = loom_alloc_aligned(outs * sizeof(float))))
        return false;
    if (k == LOOM_LAYER_EMBEDDING && !embedding_buffers(l, max_batch)) return false;
    if (k == LOOM_LAYER_PLUGIN && !nn_plugin_buffers_(l, max_batch)) return false;
    if (nn_is_rnn_kind_(k) && !nn_rnn_buffers_(l, max_batch)) return false;
    if (nn_is_attn_kind_(k) && !nn_attn_buffers_(l, max_batch)) return false;
    if (l->gacc && !(l->arena & NN_ARENA_DGY) && !(l->dgy = loom_alloc_aligned(outs * sizeof(float)))) return false;
    if (k == LOOM_LAYER_DROPOUT && l->spec.rate > 0 && !(l->mask = loom_alloc_aligned(outs))) return false;
    return true;
}

/* Whether layer l's products over a chunk's rows all go through
 * loom_sgemm_rows (dense, conv2d's im2col and pointwise products) or it
 * has none; *pad: the tile scratch they need, in floats, for a quantum q.
 * The others (recurrent, attention, the conv_more.c kinds, plugins) call
 * BLAS on a chunk's rows directly: their chunks must start on tiles. */
static bool rows_anywhere(const nn_layer_ *l, int64_t q, int64_t *pad)
{
    switch (l->spec.kind) {
    case LOOM_LAYER_DENSE: {
        *pad = q * (l->n_in / l->steps + l->n_out / l->steps);
        return true;
    }
    case LOOM_LAYER_CONV2D:
        *pad = q * ((int64_t)l->kh * l->kw * l->cin + l->cout);
        return !l->direct;
    case LOOM_LAYER_BATCH_NORM:
    case LOOM_LAYER_LAYER_NORM:
    case LOOM_LAYER_ACTIVATION:
    case LOOM_LAYER_DROPOUT:
    case LOOM_LAYER_FLATTEN:
    case LOOM_LAYER_RESHAPE:
    case LOOM_LAYER_MAX_POOL2D:
    case LOOM_LAYER_AVG_POOL2D:
    case LOOM_LAYER_GLOBAL_AVG_POOL2D:
    case LOOM_LAYER_GLOBAL_MAX_POOL2D:
    case LOOM_LAYER_ZERO_PADDING2D:
    case LOOM_LAYER_UPSAMPLING2D:
    case LOOM_LAYER_ADD:
    case LOOM_LAYER_SUBTRACT:
    case LOOM_LAYER_MULTIPLY:
    case LOOM_LAYER_AVERAGE:
    case LOOM_LAYER_MAXIMUM:
    case LOOM_LAYER_CONCATENATE:
    case LOOM_LAYER_EMBEDDING:
        *pad = 0;
        return true;
    default:
        *pad = 0;
        return false;
    }
}

/* The model's buffers at load: parameters, gradients, labels, sample
 * weights, targets (the layers' and the gradient ping-pong wait for the
 * first step: nn_model_ready_). */
static bool model_buffers(loom_model *m)
{
    int64_t max_batch = m->max_batch, gmax = 1, colmax = 0;
    m->row_q = loom_blas_row_quantum(); /* 1 before the BLAS is loaded (loom check): then only chunk sizes differ */
    int64_t padmax = 0;
    m->chunks_free = true;
    for (int i = 0; i < m->n_layers; i++) {
        nn_layer_ *l = &m->layer[i];
        int64_t pad = 0;
        m->chunks_free &= rows_anywhere(l, m->row_q, &pad);
        padmax = pad > padmax ? pad : padmax;
        gmax = l->n_in > gmax ? l->n_in : gmax;
        gmax = l->n_out > gmax ? l->n_out : gmax;
        if (l->spec.kind == LOOM_LAYER_CONV2D && !l->direct) {
            int64_t col = conv_chunk(l, max_batch, m->row_q);
            colmax = col > colmax ? col : colmax;
        }
    }
    size_t pbytes = (size_t)(m->n_params ? m->n_params : 1) * sizeof(float);
    if (!(m->params = loom_alloc_zeroed(pbytes)) || !(m->grads = loom_alloc_zeroed(pbytes))) return false;
    m->gmax = gmax;
    m->colmax = colmax;
    m->padmax = m->row_q > 1 && m->chunks_free ? padmax : 0; /* with a quantum of 1 no tile is split */
    const int64_t T = m->seq_T ? m->seq_T : 1;
    if (!(m->labels = loom_alloc_aligned((size_t)(max_batch * T) * sizeof(int32_t)))) return false;
    if (m->mask_T && !(m->tmask = loom_alloc_aligned((size_t)(max_batch * m->mask_T)))) return false;
    if (!(m->swb = loom_alloc_aligned((size_t)max_batch * sizeof(float)))) return false;
    if (m->loss != LOOM_LOSS_SPARSE_SOFTMAX_CE &&
        !(m->targets = loom_alloc_aligned((size_t)(max_batch * m->layer[m->n_layers - 1].n_out) * sizeof(float))))
        return false;
    for (int h = 1; h < m->n_heads; h++)
        if (!(m->head[h].labels = loom_alloc_aligned((size_t)max_batch * sizeof(int32_t))) ||
            !(m->head[h].targets = loom_alloc_aligned((size_t)(max_batch * m->layer[m->head[h].layer].n_out) *
                                                      sizeof(float))))
            return false;
    return true;
}

/* The step's buffers: the plan's arena (buffer_plan.c), then each layer's own, then the ping-pong. */
static bool step_buffers(loom_model *m)
{
    if (!nn_plan_buffers_(m)) return false;
    for (int i = 0; i < m->n_layers; i++) {
        nn_layer_ *l = &m->layer[i];
        if (l->inplace) l->y = m->layer[l->src[0]].y; /* its input's, allocated before it (topological order) */
        if (!layer_buffers(l, m->max_batch)) return false;
    }
    for (int k = 0; k < 2 && !m->gbuf_arena; k++)
        if (!(m->gbuf[k] = loom_alloc_aligned((size_t)(m->max_batch * m->gmax) * sizeof(float)))) return false;
    return true;
}

int nn_model_ready_(loom_model *m, loom_err *err)
{
    if (m->ready == 0) m->ready = step_buffers(m) ? 1 : -1; /* a failure stays (half the buffers may be there) */
    if (m->ready > 0) return LOOM_OK;
    return loom_err_set(err, LOOM_ENOMEM, m->where, "cannot allocate the model's buffers for batch %lld",
                        (long long)m->max_batch),
           loom_err_hint(err, "use a smaller batch size, or free memory for this process");
}

static int model_build(loom_model **out, const loom_model_spec *spec, const loom_shape *input, loom_dtype input_dtype,
                       const loom_shape *label, loom_dtype label_dtype, int64_t max_batch, int mode,
                       const more_inputs *more, loom_err *err)
{
    *out = NULL;
    loom_model *m = loom_calloc(1, sizeof *m);
    if (!m) return loom_err_set(err, LOOM_ENOMEM, "", "cannot allocate the model");
    nn_loc_str_(&spec->loc, m->where, sizeof m->where);
    m->loss = spec->loss;
    m->n_cw = spec->n_class_weights;
    memcpy(m->cw, spec->class_weight, sizeof m->cw);
    m->huber_delta = spec->huber_delta > 0 ? (float)spec->huber_delta : 1.f;
    m->l2 = (float)spec->l2;
    m->ignore_label = spec->ignore_label;
    m->input = *input;
    m->label = *label;
    m->label_dtype = label_dtype;
    m->max_batch = max_batch;
    m->input_dtype = input_dtype;
    m->n_inputs = 1;
    m->in_shape[0] = *input;
    snprintf(m->in_name[0], sizeof m->in_name[0], "%s", spec->n_inputs ? spec->inputs[0] : spec->input);
    int rc;
    int n_in = spec->n_inputs > 1 ? spec->n_inputs : 1;
    if (n_in > 1 && (!more || more->n != n_in)) {
        rc = loom_err_set(err, LOOM_EUNSUPPORTED, m->where, "model.inputs names %d features; here the model is given "
                          "%d", spec->n_inputs, more ? more->n : 1);
        loom_err_hint(err, "several model inputs train under the built-in strategies (strategy.type); or join the "
                           "features with a concat transform (op = \"concat\") into one input");
        goto fail;
    }
    m->n_inputs = n_in;
    for (int f = 1; f < n_in; f++) {
        char a[96];
        m->in_shape[f] = more->shapes[f];
        snprintf(m->in_name[f], sizeof m->in_name[f], "%s", spec->inputs[f]);
        if (more->dtypes[f] != LOOM_F32) {
            rc = loom_err_set(err, LOOM_ESHAPE, m->where, "model input \"%s\" is %s %s; layers need float32",
                              spec->inputs[f], loom_dtype_name(more->dtypes[f]), loom_shape_str(&more->shapes[f], a,
                              sizeof a));
            loom_err_hint(err, "add a cast map (dtype = \"float32\") for \"%s\" to the data transforms",
                          spec->inputs[f]);
            goto fail;
        }
    }
    if ((rc = check_input(m, spec, err)) || (rc = build_layers(m, spec, err)) ||
        (rc = check_loss(m, label, label_dtype, err)) || (rc = nn_metrics_init_(m, spec, err)))
        goto fail;
    fuse(m);
    if (mode == BUILD_SHAPES) { /* loom_model_param_list: no buffer */
        *out = m;
        return LOOM_OK;
    }
    if ((rc = check_memory(m, err))) goto fail;
    if (!model_buffers(m)) {
        rc = loom_err_set(err, LOOM_ENOMEM, m->where, "cannot allocate the model's buffers for batch %lld",
                          (long long)max_batch);
        goto fail;
    }
    if ((rc = loom_model_set_threads(m, 1, err)) || (mode == BUILD_FULL && (rc = nn_model_ready_(m, err))))
        goto fail;
    *out = m;
    return LOOM_OK;
fail:
    loom_model_free(m);
    return rc;
}

/* ---- intra-op threads ------------------------------------------------------ */

static void free_chunks(loom_pool *pool, nn_chunk_ *chunk, int threads)
{
    loom_pool_free(pool);
    for (int t = 0; chunk && t < threads; t++) {
        loom_free(chunk[t].col);
        loom_free(chunk[t].pad);
    }
    loom_free(chunk);
}

int loom_model_set_threads(loom_model *m, int threads, loom_err *err)
{
    if (threads <= 0) threads = loom_num_cores();
    if (threads > m->max_batch) threads = (int)m->max_batch; /* every chunk has an example */
    if (threads == m->threads) return LOOM_OK;
    loom_pool *pool = NULL;
    nn_chunk_ *chunk = loom_alloc_aligned((size_t)threads * sizeof *chunk);
    if (!chunk) goto nomem;
    memset(chunk, 0, (size_t)threads * sizeof *chunk);
    for (int t = 0; t < threads; t++) {
        nn_chunk_ *c = &chunk[t];
        if (t == 0) c->grads = m->grads;
        if (m->colmax && !(c->col = loom_alloc_aligned((size_t)m->colmax * sizeof(float)))) goto nomem;
        if (m->padmax && !(c->pad = loom_alloc_aligned((size_t)m->padmax * sizeof(float)))) goto nomem;
    }
    if (threads > 1) {
        int rc = loom_pool_new(&pool, threads, err);
        if (rc) {
            free_chunks(NULL, chunk, threads);
            return rc;
        }
        /* the chunks call BLAS concurrently; BLAS threads on top would oversubscribe the cores */
        loom_blas_set_threads(1);
        /* a step's phases (chunks, gradient pass, optimizer, the next step
         * after the input hand-off) come back to back: keep the workers hot */
        loom_pool_set_spin(pool, NN_POOL_SPIN_US);
    }
    free_chunks(m->pool, m->chunk, m->threads);
    m->pool = pool;
    m->chunk = chunk;
    m->threads = threads;
    return LOOM_OK;
nomem:
    free_chunks(NULL, chunk, threads);
    return loom_err_set(err, LOOM_ENOMEM, m->where, "cannot allocate the buffers of %d threads", threads);
}

int loom_model_threads(const loom_model *m) { return m->threads; }

int64_t loom_model_find_nonfinite(const loom_model *m, char *buf, size_t n)
{
    for (int64_t e = 0; e < m->n_params; e++) {
        if (isfinite(m->params[e])) continue;
        for (int i = 0; i < m->n_ptensors; i++) {
            const loom_param_info *p = &m->pinfo[i];
            if (e >= p->offset && e < p->offset + loom_shape_numel(&p->shape)) {
                snprintf(buf, n, "%s[%lld] = %g", p->name, (long long)(e - p->offset), m->params[e]);
                return e;
            }
        }
        snprintf(buf, n, "parameter %lld = %g", (long long)e, m->params[e]);
        return e;
    }
    if (n) buf[0] = 0;
    return -1;
}
loom_pool *loom_model_pool(loom_model *m) { return m->pool; }

void loom_model_free(loom_model *m)
{
    if (!m) return;
    for (int i = 0; i < m->n_layers; i++) {
        if (m->layer[i].spec.kind == LOOM_LAYER_PLUGIN) nn_plugin_free_(&m->layer[i]);
        if (nn_is_attn_kind_(m->layer[i].spec.kind)) nn_attn_free_(&m->layer[i]);
        if (!m->layer[i].inplace && !(m->layer[i].arena & NN_ARENA_Y)) loom_free(m->layer[i].y);
        loom_free(m->layer[i].argmax);
        loom_free(m->layer[i].mask);
        if (!(m->layer[i].arena & NN_ARENA_DZ)) loom_free(m->layer[i].dz);
        loom_free(m->layer[i].sp_ids);
        loom_free(m->layer[i].sp_val);
        loom_free(m->layer[i].hkey);
        loom_free(m->layer[i].hval);
        loom_free(m->layer[i].xhat);
        loom_free(m->layer[i].stat);
        loom_free(m->layer[i].mid);
        loom_free(m->layer[i].dmid);
        loom_free(m->layer[i].rs);
        if (!(m->layer[i].arena & NN_ARENA_DGY)) loom_free(m->layer[i].dgy);
    }
    loom_free(m->arena);
    free_chunks(m->pool, m->chunk, m->threads);
    loom_free_zeroed(m->params);
    loom_free_zeroed(m->grads);
    if (!m->gbuf_arena) loom_free(m->gbuf[0]), loom_free(m->gbuf[1]);
    loom_free(m->labels);
    loom_free(m->tmask);
    loom_free(m->targets);
    for (int h = 1; h < m->n_heads; h++) {
        loom_free(m->head[h].labels);
        loom_free(m->head[h].targets);
    }
    loom_free(m->swb);
    loom_free(m->mstate);
    loom_free(m);
}

int64_t loom_model_num_params(const loom_model *m) { return m->n_params; }
float *loom_model_params(loom_model *m) { return m->params; }
float *loom_model_grads(loom_model *m) { return m->grads; }
int loom_model_num_param_tensors(const loom_model *m) { return m->n_ptensors; }
double loom_model_forward_flops(const loom_model *m) { return m->flops; }
loom_shape loom_model_output_shape(const loom_model *m) { return m->layer[m->n_layers - 1].out; }

const loom_param_info *loom_model_param_tensor(const loom_model *m, int i)
{
    return i >= 0 && i < m->n_ptensors ? &m->pinfo[i] : NULL;
}

/* loom_model_summary: graph.c */

/* ---- initialisers -------------------------------------------------------- */

/* Keras VarianceScaling: uniform in [-limit, limit] with limit = sqrt(3 s / n),
 * or a normal truncated at 2 stddev whose stddev is sqrt(s / n) / 0.8796...
 * (the truncation's variance correction), s = 1 (glorot, n = (fan_in +
 * fan_out) / 2) or 2 (he, n = fan_in). */
void loom_model_init_params(loom_model *m, uint64_t seed)
{
    for (int i = 0; i < m->n_ptensors; i++) {
        float *p = m->params + m->pinfo[i].offset;
        int64_t n = loom_shape_numel(&m->pinfo[i].shape);
        loom_rng r;
        loom_rng_init(&r, seed, 0x696e6974u /* "init" */, (uint64_t)i, 0);
        int init = m->pinit[i];
        double fin = m->pfan_in[i], fout = m->pfan_out[i], scale, fan;
        if (init == LOOM_INIT_GLOROT_UNIFORM || init == LOOM_INIT_GLOROT_NORMAL) {
            scale = 1.0;
            fan = (fin + fout) / 2;
        } else {
            scale = 2.0;
            fan = fin;
        }
        if (fan < 1) fan = 1;
        switch (init) {
        case NN_INIT_EMBEDDING:
            for (int64_t k = 0; k < n; k++) p[k] = (float)((2.0 * loom_rng_uniform64(&r) - 1.0) * 0.05);
            break;
        case LOOM_INIT_GLOROT_UNIFORM:
        case LOOM_INIT_HE_UNIFORM: {
            double limit = sqrt(3.0 * scale / fan);
            for (int64_t k = 0; k < n; k++) p[k] = (float)((2.0 * loom_rng_uniform64(&r) - 1.0) * limit);
            break;
        }
        case LOOM_INIT_GLOROT_NORMAL:
        case LOOM_INIT_HE_NORMAL: {
            double sd = sqrt(scale / fan) / 0.87962566103423978;
            for (int64_t k = 0; k < n; k++) {
                float z;
                do z = loom_rng_normal(&r);
                while (z < -2.f || z > 2.f);
                p[k] = (float)(z * sd);
            }
            break;
        }
        case NN_INIT_ONES_:
            for (int64_t k = 0; k < n; k++) p[k] = 1.f;
            break;
        case LOOM_INIT_ORTHOGONAL:
            if (!nn_init_orthogonal_(p, &m->pinfo[i].shape, &r)) {
                fprintf(stderr, "loom: %s: out of memory for the orthogonal initialiser; starting it at zero\n",
                        m->pinfo[i].name);
                memset(p, 0, (size_t)n * sizeof *p);
            }
            break;
        case NN_INIT_FORGET_BIAS_:
            for (int64_t k = 0; k < n; k++) p[k] = k / (int64_t)fin == 1 ? 1.f : 0.f;
            break;
        case NN_INIT_CONST_:
            for (int64_t k = 0; k < n; k++) p[k] = (float)fin;
            break;
        default:
            memset(p, 0, (size_t)n * sizeof *p);
            break;
        }
    }
}
