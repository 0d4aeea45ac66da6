/* model.c - building a model from its spec (shape checks, the flat parameter
 * and gradient buffers, preallocated activations), initialisers, and the
 * train/evaluate/predict steps. A step allocates nothing.
 * A softmax that is the model's last op under sparse softmax cross-entropy
 * is fused into the loss: the last layer keeps logits and the loss applies a
 * stable log-sum-exp (predict still returns probabilities). */
#include "nn_internal.h"

#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <string.h>

/* im2col scratch per chunk: about half a typical L2, so the chunk's columns
 * stay in cache between im2col and the product that reads them. */
#define NN_COL_BYTES ((int64_t)1 << 20)

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
    if (in->rank != 1) {
        loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\" (dense) needs a rank-1 input (features,), got %s",
                     s->name, loom_shape_str(in, a, sizeof a));
        loom_shape flat;
        shape_of(&flat, 1, loom_shape_numel(in), 0, 0);
        return loom_err_hint(err, "add a flatten layer before it (%s -> %s)", a, loom_shape_str(&flat, b, sizeof b));
    }
    if (s->units < 1)
        return loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\": units = %d, must be >= 1", s->name, s->units);
    shape_of(&l->out, 1, s->units, 0, 0);
    l->act = s->activation;
    loom_shape ks;
    shape_of(&ks, 2, in->dim[0], s->units, 0);
    l->kernel_off = add_param(m, l, "kernel", &ks, s->kernel_init, (double)in->dim[0], (double)s->units);
    if (s->use_bias) {
        shape_of(&ks, 1, s->units, 0, 0);
        l->bias_off = add_param(m, l, "bias", &ks, LOOM_INIT_ZEROS, 0, 0);
    }
    m->flops += 2.0 * (double)in->dim[0] * s->units;
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
    [LOOM_LAYER_PLUGIN] = nn_plugin_shapes_,
};

/* The kinds with a kernel of their own and an activation. */
static bool kernel_kind(loom_layer_kind k)
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
    if (!kernel_kind(s->kind)) return LOOM_OK;
    if (l->act == LOOM_ACT_LEAKY_RELU || l->act == LOOM_ACT_GELU)
        return loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\" (%s): activation \"%s\" is an activation layer "
                            "of its own", s->name, nn_layer_kind_name_(s->kind), nn_activation_name_(l->act)),
               loom_err_hint(err, "set activation = \"none\" here and add { type = \"activation\"; activation = \"%s\"; } "
                                  "after it", nn_activation_name_(l->act));
    if (l->act == LOOM_ACT_SOFTMAX && l->out.rank != 1)
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
    if (m->loss == LOOM_LOSS_SPARSE_SOFTMAX_CE) {
        if (out.rank != 1)
            return loom_err_set(err, LOOM_ESHAPE, where,
                                "sparse_softmax_cross_entropy needs a rank-1 model output (classes,), got %s",
                                loom_shape_str(&out, a, sizeof a)),
                   loom_err_hint(err, "end the model with a flatten and a dense layer with one unit per class");
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

static int model_build(loom_model **out, const loom_model_spec *spec, const loom_shape *input, loom_dtype input_dtype,
                       const loom_shape *label, loom_dtype label_dtype, int64_t max_batch, bool shapes_only,
                       const more_inputs *more, loom_err *err);

int loom_model_new(loom_model **out, const loom_model_spec *spec, const loom_shape *input, loom_dtype input_dtype,
                   const loom_shape *label, loom_dtype label_dtype, int64_t max_batch, loom_err *err)
{
    return model_build(out, spec, input, input_dtype, label, label_dtype, max_batch, false, NULL, err);
}

int loom_model_new_inputs(loom_model **out, const loom_model_spec *spec, int n, const loom_shape *inputs,
                          const loom_dtype *dtypes, const loom_shape *label, loom_dtype label_dtype,
                          int64_t max_batch, loom_err *err)
{
    more_inputs more = {n, inputs, dtypes};
    return model_build(out, spec, &inputs[0], dtypes[0], label, label_dtype, max_batch, false, &more, err);
}

int loom_model_num_inputs(const loom_model *m) { return m->n_inputs; }

void loom_model_set_inputs(loom_model *m, const loom_tensor *const *xs, int n)
{
    for (int f = 1; f < m->n_inputs; f++) m->xs[f] = xs && f - 1 < n ? xs[f - 1] : NULL;
}

int loom_model_param_list(const loom_model_spec *spec, const loom_shape *input, loom_dtype input_dtype,
                          const loom_shape *label, loom_dtype label_dtype, loom_param_info **out, int *n,
                          int64_t *n_params, loom_sparse_grad *table, loom_err *err)
{
    *out = NULL;
    *n = 0;
    loom_model *m;
    int rc = model_build(&m, spec, input, input_dtype, label, label_dtype, 1, true, NULL, err);
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
 * gradient on), read by this layer alone, not a head; the add's input 0 has the output's shape. */
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
static int64_t conv_chunk(nn_layer_ *l, int64_t max_batch)
{
    int64_t colmax = 0;
    int64_t per = (int64_t)l->oh * l->ow * l->kh * l->kw * l->cin * (int64_t)sizeof(float);
    int64_t c = NN_COL_BYTES / per;
    l->chunk = (int)(c < 1 ? 1 : c > max_batch ? max_batch : c);
    int pointwise = l->kh == 1 && l->kw == 1 && l->sh == 1 && l->sw == 1 && l->pad_t == 0 && l->pad_l == 0;
    if (pointwise) l->chunk = (int)max_batch;
    else colmax = l->chunk * per / (int64_t)sizeof(float);
    /* cin = 1 runs direct (layers.c): a padded plane and a kernel-sized sum */
    int64_t direct = ((int64_t)(l->oh - 1) * l->sh + l->kh) * ((int64_t)(l->ow - 1) * l->sw + l->kw) +
                     (int64_t)l->kh * l->kw * l->cout;
    if (l->cin == 1 && !pointwise && direct > colmax) colmax = direct;
    /* kernels by the CPU's features, read at start: 2 = 512 bits wide, 1 = AVX2+FMA, 0 = generic */
    l->fma = loom_cpu()->level >= LOOM_CPU_AVX512 ? 2 : loom_cpu()->level >= LOOM_CPU_AVX2_FMA;
    if (nn_conv3_ok_(l) && nn_conv3_scratch_(l) > colmax) colmax = nn_conv3_scratch_(l); /* conv_fast.c */
    return colmax;
}

/* A layer's own buffers, all sized for max_batch; false when one cannot be allocated. */
static bool layer_buffers(nn_layer_ *l, int64_t max_batch)
{
    loom_layer_kind k = l->spec.kind;
    int norm = k == LOOM_LAYER_BATCH_NORM || k == LOOM_LAYER_LAYER_NORM;
    int owns_y = kernel_kind(k) || k == LOOM_LAYER_MAX_POOL2D || k == LOOM_LAYER_ZERO_PADDING2D ||
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
    if (owns_y && !l->inplace && !(l->y = loom_alloc_aligned(outs * sizeof(float)))) return false;
    if ((k == LOOM_LAYER_MAX_POOL2D || k == LOOM_LAYER_GLOBAL_MAX_POOL2D) &&
        !(l->argmax = loom_alloc_aligned(outs * sizeof(int32_t))))
        return false;
    if (k == LOOM_LAYER_SEPARABLE_CONV2D) {
        size_t mid = (size_t)(max_batch * l->oh * l->ow) * (size_t)(l->cin * l->mult) * sizeof(float);
        if (!(l->mid = loom_alloc_aligned(mid)) || !(l->dmid = loom_alloc_aligned(mid))) return false;
    }
    if ((kernel_kind(k) || l->fused) &&
        !(l->dz = loom_alloc_aligned(outs * sizeof(float))))
        return false;
    if (k == LOOM_LAYER_EMBEDDING && !embedding_buffers(l, max_batch)) return false;
    if (k == LOOM_LAYER_PLUGIN && !nn_plugin_buffers_(l, max_batch)) return false;
    if (l->gacc && !(l->dgy = loom_alloc_aligned(outs * sizeof(float)))) return false;
    if (k == LOOM_LAYER_DROPOUT && l->spec.rate > 0 && !(l->mask = loom_alloc_aligned(outs))) return false;
    return true;
}

/* The layers' buffers, then the model's: parameters, gradients, the two
 * gradient ping-pong buffers, labels, sample weights, targets. */
static bool model_buffers(loom_model *m)
{
    int64_t max_batch = m->max_batch, gmax = 1, colmax = 0;
    for (int i = 0; i < m->n_layers; i++) {
        nn_layer_ *l = &m->layer[i];
        gmax = l->n_in > gmax ? l->n_in : gmax;
        gmax = l->n_out > gmax ? l->n_out : gmax;
        if (l->inplace) l->y = m->layer[l->src[0]].y; /* its input's, allocated before it (topological order) */
        if (!layer_buffers(l, max_batch)) return false;
        if (l->spec.kind == LOOM_LAYER_CONV2D && !l->direct) {
            int64_t col = conv_chunk(l, max_batch);
            colmax = col > colmax ? col : colmax;
        }
    }
    size_t pbytes = (size_t)(m->n_params ? m->n_params : 1) * sizeof(float);
    if (!(m->params = loom_alloc_aligned(pbytes)) || !(m->grads = loom_alloc_aligned(pbytes))) return false;
    memset(m->params, 0, pbytes);
    memset(m->grads, 0, pbytes);
    m->gmax = gmax;
    m->colmax = colmax;
    for (int k = 0; k < 2; k++)
        if (!(m->gbuf[k] = loom_alloc_aligned((size_t)(max_batch * gmax) * sizeof(float)))) return false;
    if (!(m->labels = loom_alloc_aligned((size_t)max_batch * sizeof(int32_t)))) return false;
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

/* The model for loom_model_new, or (shapes_only) its variable list alone. */
static int model_build(loom_model **out, const loom_model_spec *spec, const loom_shape *input, loom_dtype input_dtype,
                       const loom_shape *label, loom_dtype label_dtype, int64_t max_batch, bool shapes_only,
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
        loom_err_hint(err, "several model inputs train under one_device and mirrored (strategy.type); or join the "
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
    if (shapes_only) { /* loom_model_param_list: no buffer */
        *out = m;
        return LOOM_OK;
    }
    if ((rc = check_memory(m, err))) goto fail;
    if (!model_buffers(m)) {
        rc = loom_err_set(err, LOOM_ENOMEM, m->where, "cannot allocate the model's buffers for batch %lld",
                          (long long)max_batch);
        goto fail;
    }
    if ((rc = loom_model_set_threads(m, 1, err))) goto fail;
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
        if (!m->layer[i].inplace) loom_free(m->layer[i].y);
        loom_free(m->layer[i].argmax);
        loom_free(m->layer[i].mask);
        loom_free(m->layer[i].dz);
        loom_free(m->layer[i].sp_ids);
        loom_free(m->layer[i].sp_val);
        loom_free(m->layer[i].hkey);
        loom_free(m->layer[i].hval);
        loom_free(m->layer[i].xhat);
        loom_free(m->layer[i].stat);
        loom_free(m->layer[i].mid);
        loom_free(m->layer[i].dmid);
        loom_free(m->layer[i].dgy);
    }
    free_chunks(m->pool, m->chunk, m->threads);
    loom_free(m->params);
    loom_free(m->grads);
    loom_free(m->gbuf[0]);
    loom_free(m->gbuf[1]);
    loom_free(m->labels);
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
        case NN_INIT_CONST_:
            for (int64_t k = 0; k < n; k++) p[k] = (float)fin;
            break;
        default:
            memset(p, 0, (size_t)n * sizeof *p);
            break;
        }
    }
}

/* ---- steps ------------------------------------------------------------------ */

static loom_shape batch_of(int64_t B, const loom_shape *s)
{
    loom_shape r = {.rank = s->rank + 1};
    r.dim[0] = B;
    for (int i = 0; i < s->rank; i++) r.dim[i + 1] = s->dim[i];
    return r;
}

int nn_check_batch_(loom_model *m, const loom_tensor *x, const loom_tensor *label, int64_t *B, loom_err *err)
{
    char a[96], b[96];
    if (x->dtype != m->input_dtype)
        return loom_err_set(err, LOOM_ESHAPE, m->where, "input batch is %s, the model needs %s",
                            loom_dtype_name(x->dtype), loom_dtype_name(m->input_dtype)),
               loom_err_hint(err, "add a cast or scale map to the input transforms");
    int ok = x->shape.rank == m->input.rank + 1;
    for (int i = 0; ok && i < m->input.rank; i++) ok = x->shape.dim[i + 1] == m->input.dim[i];
    loom_shape want = {.rank = m->input.rank + 1};
    want.dim[0] = x->shape.rank > 0 ? x->shape.dim[0] : 0;
    for (int i = 0; i < m->input.rank; i++) want.dim[i + 1] = m->input.dim[i];
    if (!ok)
        return loom_err_set(err, LOOM_ESHAPE, m->where, "input batch has shape %s, the model was built for %s",
                            loom_shape_str(&x->shape, a, sizeof a), loom_shape_str(&want, b, sizeof b));
    *B = x->shape.dim[0];
    if (*B < 1 || *B > m->max_batch)
        return loom_err_set(err, LOOM_ESHAPE, m->where, "batch of %lld examples; the model takes 1 to %lld",
                            (long long)*B, (long long)m->max_batch);
    int rc;
    if (m->layer[0].spec.kind == LOOM_LAYER_EMBEDDING && (rc = nn_embedding_check_ids_(m, 0, x->data, *B, err)))
        return rc;
    for (int f = 1; f < m->n_inputs; f++) { /* model.inputs: each (B, its shape), float32 */
        const loom_tensor *t = m->xs[f];
        if (!t)
            return loom_err_set(err, LOOM_ESHAPE, m->where, "model input \"%s\" was not given with the batch",
                                m->in_name[f]);
        bool same = t->dtype == LOOM_F32 && t->shape.rank == m->in_shape[f].rank + 1 && t->shape.dim[0] == *B;
        for (int d = 0; same && d < m->in_shape[f].rank; d++) same = t->shape.dim[d + 1] == m->in_shape[f].dim[d];
        if (!same) {
            loom_shape w = batch_of(*B, &m->in_shape[f]);
            return loom_err_set(err, LOOM_ESHAPE, m->where, "model input \"%s\" has shape %s (%s), the model was "
                                "built for %s float32", m->in_name[f], loom_shape_str(&t->shape, a, sizeof a),
                                loom_dtype_name(t->dtype), loom_shape_str(&w, b, sizeof b));
        }
    }
    return label ? nn_check_label_(m, label, *B, err) : LOOM_OK;
}

int nn_loss_error_(const loom_model *m, double loss, int64_t B, loom_err *err)
{
    return loom_err_set(err, LOOM_ENUMERIC, m->where, "the loss is %g on a batch of %lld examples", loss, (long long)B),
           loom_err_hint(err, "lower the learning rate, or check the inputs are scaled (e.g. to [0, 1])");
}

int nn_check_label_(loom_model *m, const loom_tensor *label, int64_t B, loom_err *err)
{
    char a[96], b[96];
    int ok = label->shape.rank == m->label.rank + 1 && label->shape.dim[0] == B;
    for (int i = 0; ok && i < m->label.rank; i++) ok = label->shape.dim[i + 1] == m->label.dim[i];
    if (!ok) {
        loom_shape lw = {.rank = m->label.rank + 1};
        lw.dim[0] = B;
        for (int i = 0; i < m->label.rank; i++) lw.dim[i + 1] = m->label.dim[i];
        return loom_err_set(err, LOOM_ESHAPE, m->where, "label batch has shape %s, expected %s",
                            loom_shape_str(&label->shape, a, sizeof a), loom_shape_str(&lw, b, sizeof b));
    }
    return LOOM_OK;
}

/* Labels, targets and sample weights come in any numeric dtype: value i
 * of a tensor's data as a double (exact for every dtype here). */
typedef double (*number_at)(const void *data, int64_t i);
static double u8_at(const void *d, int64_t i) { return ((const uint8_t *)d)[i]; }
static double i32_at(const void *d, int64_t i) { return ((const int32_t *)d)[i]; }
static double i64_at(const void *d, int64_t i) { return (double)((const int64_t *)d)[i]; }
static double f32_at(const void *d, int64_t i) { return ((const float *)d)[i]; }
static double f64_at(const void *d, int64_t i) { return ((const double *)d)[i]; }

/* The reader of dtype's values; NULL for a dtype that is not a number. */
static number_at number_reader(loom_dtype dt)
{
    switch (dt) {
    case LOOM_U8: return u8_at;
    case LOOM_I32: return i32_at;
    case LOOM_I64: return i64_at;
    case LOOM_F32: return f32_at;
    case LOOM_F64: return f64_at;
    default: return NULL;
    }
}

static int bad_label(loom_err *err, const loom_model *m, int64_t b, double v, int64_t n)
{
    return loom_err_set(err, LOOM_EDATA, m->where, "label of example %lld in the batch is %.17g, not a class in [0, %lld)",
                        (long long)b, v, (long long)n),
           loom_err_hint(err, "the last layer has %lld units; labels must be integers from 0 to %lld", (long long)n,
                         (long long)(n - 1));
}

int nn_read_labels_(loom_model *m, const loom_tensor *label, int64_t B, loom_err *err)
{
    const int64_t n = m->layer[m->n_layers - 1].n_out;
    number_at at = number_reader(label->dtype);
    if (!at) return loom_err_set(err, LOOM_ESHAPE, m->where, "label dtype %d is not known", (int)label->dtype);
    for (int64_t b = 0; b < B; b++) {
        double x = at(label->data, b);
        if (!(x >= 0 && x < (double)n && x == (double)(int64_t)x)) return bad_label(err, m, b, x, n);
        m->labels[b] = (int32_t)x;
    }
    return LOOM_OK;
}

static int bad_target(loom_err *err, const loom_model *m, int64_t b, int64_t j, int64_t n, double v)
{
    char at[48] = "";
    if (n > 1) snprintf(at, sizeof at, " (output %lld)", (long long)j);
    if (m->loss == LOOM_LOSS_BCE && isfinite(v))
        return loom_err_set(err, LOOM_EDATA, m->where,
                            "label of example %lld in the batch%s is %.9g, outside [0, 1] for binary_cross_entropy",
                            (long long)b, at, v),
               loom_err_hint(err, "binary labels are 0 or 1 (or a probability between); for more classes use "
                                  "sparse_softmax_cross_entropy with one output unit per class");
    return loom_err_set(err, LOOM_EDATA, m->where, "label of example %lld in the batch%s is %g, not a finite number",
                        (long long)b, at, v),
           loom_err_hint(err, "filter or fix the records with missing targets");
}

void loom_model_set_sample_weights(loom_model *m, const loom_tensor *w) { m->sw = w; }

/* The sample weights of a batch of B into m->swb. */
static int read_weights(loom_model *m, int64_t B, loom_err *err)
{
    char a[96];
    const loom_tensor *w = m->sw;
    if (w->shape.rank < 1 || w->shape.dim[0] != B || loom_shape_numel(&w->shape) != B)
        return loom_err_set(err, LOOM_ESHAPE, m->where, "sample weights of shape %s for a batch of %lld examples",
                            loom_shape_str(&w->shape, a, sizeof a), (long long)B),
               loom_err_hint(err, "model.sample_weight names a feature with one number per example");
    number_at at = number_reader(w->dtype);
    if (!at) return loom_err_set(err, LOOM_ESHAPE, m->where, "sample weight dtype %d is not a number", (int)w->dtype);
    for (int64_t b = 0; b < B; b++) {
        double x = at(w->data, b);
        if (!(x >= 0) || !isfinite(x))
            return loom_err_set(err, LOOM_EDATA, m->where,
                                "sample weight of example %lld in the batch is %g, not a finite number >= 0",
                                (long long)b, x);
        m->swb[b] = (float)x;
    }
    return LOOM_OK;
}

/* The labels of heads 1.. (loom_model_set_head_labels) into their buffers, checked as head 0's. */
static int read_head_labels(loom_model *m, int64_t B, loom_err *err)
{
    for (int h = 1; h < m->n_heads; h++) {
        struct nn_head_ *hd = &m->head[h];
        const int64_t n = m->layer[hd->layer].n_out;
        const bool sparse = hd->loss == LOOM_LOSS_SPARSE_SOFTMAX_CE;
        const loom_tensor *t = hd->label;
        if (!t)
            return loom_err_set(err, LOOM_ESHAPE, m->where, "head \"%s\" has no labels for this step", hd->name),
                   loom_err_hint(err, "give each head's label feature (model.outputs' label) with the batch");
        if (t->shape.rank < 1 || t->shape.dim[0] != B || loom_shape_numel(&t->shape) != B * (sparse ? 1 : n))
            return loom_err_set(err, LOOM_ESHAPE, m->where, "head \"%s\": its labels hold %lld values for a batch "
                                "of %lld and %lld outputs", hd->name, (long long)loom_shape_numel(&t->shape),
                                (long long)B, (long long)n),
                   loom_err_hint(err, sparse ? "sparse_softmax_cross_entropy takes one class per example"
                                             : "the other losses take one target per output");
        number_at at = number_reader(t->dtype);
        if (!at) return loom_err_set(err, LOOM_ESHAPE, m->where, "head \"%s\": label dtype %d is not known",
                                     hd->name, (int)t->dtype);
        for (int64_t e = 0; e < B * (sparse ? 1 : n); e++) {
            double x = at(t->data, e);
            bool ok = sparse ? x == floor(x) && x >= 0 && x < (double)n
                             : isfinite(x) && (hd->loss != LOOM_LOSS_BCE || (x >= 0 && x <= 1));
            if (!ok)
                return loom_err_set(err, LOOM_EDATA, m->where, "head \"%s\": example %lld's label is %g", hd->name,
                                    (long long)(sparse ? e : e / n), x),
                       loom_err_hint(err, sparse ? "classes run from 0 to the head's outputs - 1"
                                                 : "binary_cross_entropy takes targets in [0, 1]; others finite");
            if (sparse) hd->labels[e] = (int32_t)x;
            else hd->targets[e] = (float)x;
        }
    }
    return LOOM_OK;
}

void loom_model_set_head_labels(loom_model *m, const loom_tensor *const *labels, int n)
{
    for (int h = 1; h < m->n_heads; h++) m->head[h].label = labels && h - 1 < n ? labels[h - 1] : NULL;
}

int loom_model_num_heads(const loom_model *m) { return m->n_heads; }
const char *loom_model_head_name(const loom_model *m, int h) { return m->head[h].name; }
float loom_model_head_weight(const loom_model *m, int h) { return m->head[h].weight; }
loom_loss_kind loom_model_head_loss_kind(const loom_model *m, int h) { return m->head[h].loss; }
int loom_model_head_layer(const loom_model *m, int h) { return m->head[h].layer; }

bool loom_model_head_accuracy(const loom_model *m, int h) { return h > 0 && m->head[h].accuracy; }

double loom_model_head_value(const loom_model *m, int h, int which, const double *acc, int64_t examples)
{
    if (m->n_heads < 2 || !acc || examples <= 0) return NAN;
    return acc[m->hoff + 2 * h + (which ? 1 : 0)] / (double)examples;
}

void loom_model_head_results(const loom_model *m, int h, double *loss_sum, int64_t *correct)
{
    if (loss_sum) *loss_sum = m->hloss[h];
    if (correct) *correct = m->hcorrect[h];
}

int nn_read_label_(loom_model *m, const loom_tensor *label, int64_t B, loom_err *err)
{
    int rc;
    if (m->sw && (rc = read_weights(m, B, err))) return rc;
    if (m->n_heads > 1 && (rc = read_head_labels(m, B, err))) return rc;
    if (m->loss == LOOM_LOSS_SPARSE_SOFTMAX_CE) return nn_read_labels_(m, label, B, err);
    const int64_t n = m->layer[m->n_layers - 1].n_out;
    const int bce = m->loss == LOOM_LOSS_BCE;
    number_at at = number_reader(label->dtype);
    if (!at) return loom_err_set(err, LOOM_ESHAPE, m->where, "label dtype %d is not known", (int)label->dtype);
    for (int64_t e = 0; e < B * n; e++) {
        double x = at(label->data, e);
        if (!isfinite(x) || (bce && !(x >= 0 && x <= 1))) return bad_target(err, m, e / n, e % n, n, x);
        m->targets[e] = (float)x;
    }
    return LOOM_OK;
}

/* The chunks of a batch of B: n = min(threads, B) runs of contiguous
 * examples, sizes differing by at most one, fixed for a given (B, threads). */
static int split_batch(loom_model *m, int64_t B)
{
    int n = B < m->threads ? (int)B : m->threads;
    for (int t = 0; t < n; t++) {
        nn_chunk_ *c = &m->chunk[t];
        c->b0 = B * t / n;
        c->B = B * (t + 1) / n - c->b0;
        c->gbuf[0] = m->gbuf[0] + c->b0 * m->gmax;
        c->gbuf[1] = m->gbuf[1] + c->b0 * m->gmax;
        c->loss = 0;
        c->correct = 0;
    }
    return n;
}

enum { JOB_TRAIN, JOB_EVAL, JOB_PREDICT };

/* One step's work, shared by its chunks. */
typedef struct step_job {
    loom_model        *m;
    int                kind;      /* JOB_* */
    const float       *x;         /* (B, n_in) */
    const loom_tensor *label;     /* MSE targets (B, n) */
    float              inv_gb;    /* 1 / global batch */
    int64_t            gb;        /* the global batch (train) */
    uint64_t           rng_key;
    float             *out;       /* predict: (B, n) */
    int64_t            B;         /* examples in the batch */
    int                nchunks;   /* chunks of the batch, and parts of the gradient pass */
    int                l0, l1;    /* the layers [l0, l1) of a segment (between batch normalizations) */
    bool               timed;     /* a profiled phase: each chunk clocks its layers into c->pt (run_phase) */
} step_job;

/* With j->timed, a chunk's phase clocks layer i when it is done: the time
 * since the previous clock t, into c->pt[i]; returns the new clock. Reading
 * the clock changes no computation, so a profiled step has the same bits. */
static double clock_layer(nn_chunk_ *c, int i, double t)
{
    double now = loom_now();
    c->pt[i] = now - t;
    return now;
}

/* The three phases of a chunk's step. chunk_step runs them back to back;
 * loom_model_forward / _loss / _backward run one each over all chunks, and
 * since a phase reads only what the previous one left in the chunk's own
 * rows and buffers, the result is the same bit for bit. */
static void chunk_forward(const step_job *j, nn_chunk_ *c)
{
    const loom_model *m = j->m;
    /* the input may be ids (int32, int64) rather than floats: offset in bytes */
    if (j->l0 == 0)
        c->act[0] = (const float *)((const char *)j->x +
                                    c->b0 * m->layer[0].n_in * (int64_t)loom_dtype_size(m->input_dtype));
    if (j->l0 == 0)
        for (int f = 0; f < m->n_inputs; f++)
            c->xin[f] = f ? (const float *)m->xs[f]->data + c->b0 * loom_shape_numel(&m->in_shape[f]) : c->act[0];
    /* a graph's gathered gradients start with the step (the loss phase gives the heads' first) */
    if (j->l0 == 0 && m->graph) memset(c->ginit, 0, (size_t)m->n_layers);
    double t = j->timed ? loom_now() : 0;
    for (int i = j->l0; i < j->l1; i++) {
        if (m->graph) nn_graph_forward_(m, i, c, j->kind == JOB_TRAIN, j->rng_key);
        else nn_layer_forward_(m, i, c, j->kind == JOB_TRAIN, j->rng_key);
        if (j->timed) t = clock_layer(c, i, t);
    }
}

/* The loss of the chunk's outputs and, for a train step, its gradient into gbuf[0]. */
static void chunk_loss(const step_job *j, nn_chunk_ *c)
{
    const loom_model *m = j->m;
    const int64_t n = m->layer[m->n_layers - 1].n_out;
    const float *z = c->act[m->n_layers];
    float *g = j->kind == JOB_TRAIN ? c->gbuf[0] : NULL;
    (void)n;
    const float w0 = m->head[0].weight;
    c->hloss[0] = nn_loss_(m, z, c->b0, c->B, j->inv_gb * w0, g, &c->correct);
    c->hcorrect[0] = c->correct;
    c->loss = (double)w0 * c->hloss[0];
    for (int h = 1; h < m->n_heads; h++) {
        const struct nn_head_ *hd = &m->head[h];
        const nn_layer_ *l = &m->layer[hd->layer];
        const int64_t nh = l->n_out;
        float *gh = j->kind == JOB_TRAIN ? l->dgy + c->b0 * nh : NULL;
        c->hloss[h] = nn_head_loss_(hd->loss, c->yo[hd->layer], hd->labels + c->b0, hd->targets + c->b0 * nh, c->B,
                                    nh, j->inv_gb * hd->weight, gh, &c->hcorrect[h]);
        if (gh) c->ginit[hd->layer] = 1;
        c->loss += (double)hd->weight * c->hloss[h];
    }
}

/* The index of layer i's first parameter tensor (its kernel), or -1. */
static int first_tensor(const loom_model *m, const nn_layer_ *l)
{
    for (int t = 0; t < m->n_ptensors && l->kernel_off >= 0; t++)
        if (m->pinfo[t].offset == l->kernel_off) return t;
    return -1;
}

/* Part `part` of `parts` of layer i's whole-batch parameter gradients (dense,
 * conv2d, layer_normalization; an embedding's sparse rows in part 0; batch
 * normalization's come from nn_bn_backward_). */
static bool has_grad_pass(const nn_layer_ *l) { return l->kernel_off >= 0 && l->spec.kind != LOOM_LAYER_BATCH_NORM; }

static void layer_param_grads(const step_job *j, int i, int part, int parts)
{
    loom_model *m = j->m;
    const nn_layer_ *l = &m->layer[i];
    if (!has_grad_pass(l)) return;
    if (l->spec.kind == LOOM_LAYER_EMBEDDING) {
        if (part == 0) nn_embedding_param_grads_(m, i, m->chunk[0].act[0], j->B);
        return;
    }
    if (l->spec.kind == LOOM_LAYER_PLUGIN) {
        if (part == 0) nn_plugin_param_grads_(m, i, m->chunk[0].act[i], j->B);
        return;
    }
    /* chunk 0 starts at example 0: its input pointer is the whole batch's */
    if (nn_runs_more_(l)) nn_more_param_grads_(m, i, m->chunk[0].act[i], j->B, part, parts);
    else if (l->spec.kind == LOOM_LAYER_DENSE) nn_dense_param_grads_(m, i, m->chunk[0].act[i], j->B, part, parts);
    else if (l->spec.kind == LOOM_LAYER_LAYER_NORM) nn_ln_param_grads_(m, i, j->B, part, parts);
    else nn_conv_param_grads_(m, i, m->chunk[0].act[i], j->B, part, parts, m->chunk[part].col);
}

/* Whether a gradient hook can be told layer by layer: not with batch
 * normalization (its gradients come from a whole-batch pass between
 * segments), an embedding (its rows are gathered over the whole batch, and
 * its dense region is cleared and rewritten then) or model.l2 (its penalty
 * is added to the kernels' gradients after every layer's). Those models
 * compute their gradients as without a hook and tell it once (t = 0): the
 * same bits, no overlap. */
static bool hook_per_layer(const loom_model *m)
{
    if (m->n_bn || m->l2 > 0 || m->graph) return false;
    for (int i = 0; i < m->n_layers; i++)
        if (m->layer[i].spec.kind == LOOM_LAYER_EMBEDDING || m->layer[i].spec.kind == LOOM_LAYER_PLUGIN) return false;
    return true;
}

/* The optimizer inside the step (m->upd): parameters [lo, hi) updated on
 * the calling thread, with the step's gradients there. */
static void update_range(const loom_model *m, int64_t lo, int64_t hi)
{
    if (hi > lo) loom_optimizer_apply_range(m->upd, NULL, m->params, m->grads, m->upd_step, lo, hi);
}

/* Layer l's parameters, kernel then bias: [*lo, *hi) of the flat buffer. */
static void layer_params(const loom_model *m, const nn_layer_ *l, int64_t *lo, int64_t *hi)
{
    *lo = *hi = l->kernel_off;
    for (int t = 0; t < m->n_ptensors; t++) {
        const loom_param_info *p = &m->pinfo[t];
        if (p->offset != l->kernel_off && p->offset != l->bias_off && p->offset != l->pw_off) continue;
        int64_t end = p->offset + loom_shape_numel(&p->shape);
        if (end > *hi) *hi = end;
    }
}

/* Whether each part of `parts` of layer l's gradient pass updates what it
 * wrote itself: a dense or conv2d layer's kernel rows (of n_in, or of
 * kh*kw*cin) and bias columns, the ranges nn_dense_param_grads_ and
 * nn_conv_param_grads_ write, or the whole layer when one part writes it. */
static bool updates_in_part(const nn_layer_ *l, int parts)
{
    return l->spec.kind == LOOM_LAYER_DENSE || (l->spec.kind == LOOM_LAYER_CONV2D && !l->direct) || parts == 1;
}

static void update_part(const loom_model *m, const nn_layer_ *l, int part, int parts)
{
    if (parts == 1) {
        int64_t lo, hi;
        layer_params(m, l, &lo, &hi);
        update_range(m, lo, hi);
        return;
    }
    const bool dense = l->spec.kind == LOOM_LAYER_DENSE;
    const int64_t K = dense ? l->n_in : (int64_t)l->kh * l->kw * l->cin, out = dense ? l->n_out : l->cout;
    update_range(m, l->kernel_off + K * part / parts * out, l->kernel_off + K * (part + 1) / parts * out);
    if (l->bias_off >= 0) update_range(m, l->bias_off + out * part / parts, l->bias_off + out * (part + 1) / parts);
}

/* After a gradient pass of `parts` parts: the in-step update of the layers
 * whose parts did not update what they wrote (layer normalization split in
 * parts), over the pool. prof: a profile's upd. */
static void update_rest(loom_model *m, int parts, double *prof)
{
    for (int i = 0; i < m->n_layers; i++) {
        const nn_layer_ *l = &m->layer[i];
        if (!has_grad_pass(l) || updates_in_part(l, parts)) continue;
        int64_t lo, hi;
        double t0 = prof ? loom_now() : 0;
        layer_params(m, l, &lo, &hi);
        loom_optimizer_apply_range(m->upd, m->pool, m->params, m->grads, m->upd_step, lo, hi);
        if (prof) prof[i] += loom_now() - t0;
    }
}

/* Layer i's backward on chunk c: the gradient rows in c->g, the other
 * buffer c->other (swapped when the layer writes there); sets c->bw_done
 * when no earlier layer needs anything. with_hook: then the layer's
 * parameter gradients, its in-step update (m->upd) and the hook (see
 * chunk_backward_). */
static void chunk_backward_layer(const step_job *j, nn_chunk_ *c, int i, bool with_hook)
{
    const loom_model *m = j->m;
    const nn_layer_ *l = &m->layer[i];
    float *r = NULL;
    if (l->needs_dx || l->kernel_off >= 0) r = nn_layer_backward_(m, i, c, c->g, c->other);
    if (with_hook && l->kernel_off >= 0) {
        layer_param_grads(j, i, 0, 1);
        if (m->upd && has_grad_pass(l)) update_part(m, l, 0, 1);
        if (m->grad_hook) m->grad_hook(m->grad_hook_arg, first_tensor(m, l));
    }
    if (!r) {
        c->bw_done = 1;
    } else if (r == c->other) {
        c->other = c->g;
        c->g = r;
    }
}

/* The backward of layers [l0, l1), from the top; the gradient buffers carry
 * over between segments in c->g and c->other (set by the top segment).
 * with_hook: one chunk (the whole batch), one segment, and a per-layer
 * gradient hook: each layer's parameter gradients right after its backward,
 * then the hook. */
static void chunk_backward_(const step_job *j, nn_chunk_ *c, bool with_hook)
{
    const loom_model *m = j->m;
    if (j->l1 == m->n_layers) {
        c->g = c->gbuf[0], c->other = c->gbuf[1];
        c->bw_done = 0;
    }
    /* a non-finite loss fails the step (the caller checks the sum), so its gradient is never used */
    if (!isfinite(c->loss)) return;
    double t = j->timed ? loom_now() : 0;
    for (int i = j->l1 - 1; i >= j->l0 && !c->bw_done; i--) {
        if (m->graph) nn_graph_backward_(m, i, c);
        else chunk_backward_layer(j, c, i, with_hook);
        if (j->timed) t = clock_layer(c, i, t);
    }
}

static void chunk_backward(const step_job *j, nn_chunk_ *c) { chunk_backward_(j, c, false); }

static void part_forward_(void *arg, int t) { step_job *j = arg; chunk_forward(j, &j->m->chunk[t]); }
static void part_backward_(void *arg, int t) { step_job *j = arg; chunk_backward(j, &j->m->chunk[t]); }

/* Runs fn over j's chunks. acc: a profile's phase (NULL: none); the chunks
 * clock the layers they run (j->timed) and acc gets each layer's mean over
 * the chunks. */
static void run_phase(loom_model *m, step_job *j, loom_pool_fn fn, double *acc)
{
    if (!acc) {
        loom_pool_run(m->pool, j->nchunks, fn, j);
        return;
    }
    for (int t = 0; t < j->nchunks; t++) {
        memset(m->chunk[t].pt, 0, sizeof m->chunk[t].pt);
        memset(m->chunk[t].pu, 0, sizeof m->chunk[t].pu);
    }
    j->timed = true;
    loom_pool_run(m->pool, j->nchunks, fn, j);
    j->timed = false;
    for (int i = 0; i < m->n_layers; i++) {
        double s = 0, u = 0;
        for (int t = 0; t < j->nchunks; t++) s += m->chunk[t].pt[i], u += m->chunk[t].pu[i];
        acc[i] += s / j->nchunks;
        if (m->prof && m->upd) m->prof->upd[i] += u / j->nchunks; /* the gradient pass's in-step update */
    }
}

/* The forward of every segment (whole-model job j, its chunks split): the
 * chunks run the layers between batch normalizations, which run once over
 * the whole batch. acc: a profile's forward (NULL: none); a batch
 * normalization is clocked whole, on this thread. */
static void forward_all(loom_model *m, step_job *j, double *acc)
{
    int l0 = 0;
    /* the input may be ids (int32, int64) rather than floats: offset in bytes */
    for (int t = 0; t < j->nchunks; t++) {
        nn_chunk_ *c = &m->chunk[t];
        c->xin[0] = c->act[0] = (const float *)((const char *)j->x + c->b0 * loom_shape_numel(&m->input) *
                                                                         (int64_t)loom_dtype_size(m->input_dtype));
        for (int f = 1; f < m->n_inputs; f++)
            c->xin[f] = (const float *)m->xs[f]->data + c->b0 * loom_shape_numel(&m->in_shape[f]);
    }
    for (int i = 0; i <= m->n_layers; i++) {
        if (i < m->n_layers && m->layer[i].spec.kind != LOOM_LAYER_BATCH_NORM) continue;
        j->l0 = l0, j->l1 = i;
        if (i > l0) run_phase(m, j, part_forward_, acc);
        if (i < m->n_layers) {
            double t0 = acc ? loom_now() : 0;
            if (m->graph) nn_graph_bn_in_(m, i, j->nchunks);
            nn_bn_forward_(m, i, m->chunk[0].act[i], j->B, j->kind == JOB_TRAIN);
            if (acc) acc[i] += loom_now() - t0;
            for (int t = 0; t < j->nchunks; t++) m->chunk[t].act[i + 1] = m->layer[i].y + m->chunk[t].b0 * m->layer[i].n_out;
            if (m->graph) nn_graph_bn_out_(m, i, j->nchunks);
        }
        l0 = i + 1;
    }
    j->l0 = 0, j->l1 = m->n_layers;
}

/* The backward of every segment, from the top (as forward_all). */
static void backward_all(loom_model *m, step_job *j, double *acc)
{
    int l1 = m->n_layers;
    for (int i = m->n_layers - 1; i >= -1; i--) {
        if (i >= 0 && m->layer[i].spec.kind != LOOM_LAYER_BATCH_NORM) continue;
        j->l0 = i + 1, j->l1 = l1;
        if (l1 > i + 1 || l1 == m->n_layers) run_phase(m, j, part_backward_, acc);
        if (i >= 0) {
            int done = 1;
            for (int t = 0; t < j->nchunks; t++) done &= m->chunk[t].bw_done || !isfinite(m->chunk[t].loss);
            if (m->graph) { /* bw_done does not end a graph's backward: the layer's own need */
                bool any = false;
                for (int t = 0; t < j->nchunks; t++) any |= isfinite(m->chunk[t].loss);
                done = !m->layer[i].need_out || !any;
            }
            double t0 = acc ? loom_now() : 0;
            if (!done && m->graph) nn_graph_bn_grad_in_(m, i, j->nchunks);
            if (!done) nn_bn_backward_(m, i, m->chunk, j->nchunks, j->B);
            if (!done && m->graph) nn_graph_bn_grad_out_(m, i, j->nchunks);
            if (acc) acc[i] += loom_now() - t0;
        }
        l1 = i;
    }
    j->l0 = 0, j->l1 = m->n_layers;
}

/* Chunk c's output rows of a predict job, from its last layer's logits:
 * probabilities under softmax (binary) cross-entropy, else the values. */
/* z (rows, n) as the head's loss reads it into out (row stride ld): softmax or sigmoid probabilities, else values. */
static void head_rows(loom_loss_kind loss, const float *z, int64_t rows, int64_t n, float *out, int64_t ld)
{
    for (int64_t b = 0; b < rows; b++) {
        const float *zr = z + b * n;
        float *o = out + b * ld;
        if (loss == LOOM_LOSS_SPARSE_SOFTMAX_CE) nn_softmax_rows_(zr, o, 1, n);
        else if (loss == LOOM_LOSS_BCE)
            for (int64_t e = 0; e < n; e++) o[e] = 1.f / (1.f + expf(-zr[e]));
        else memcpy(o, zr, (size_t)n * sizeof *o);
    }
}

int64_t loom_model_head_outputs(const loom_model *m, int h) { return m->layer[m->head[h].layer].n_out; }

int64_t loom_model_predict_width(const loom_model *m)
{
    int64_t w = 0;
    for (int h = 0; h < m->n_heads; h++) w += m->layer[m->head[h].layer].n_out;
    return w;
}

static void predict_rows(step_job *j, nn_chunk_ *c)
{
    const loom_model *m = j->m;
    const int64_t n = m->layer[m->n_layers - 1].n_out;
    const float *z = c->act[m->n_layers];
    if (m->n_heads > 1) { /* each example's row: head 0's outputs, then each other head's */
        const int64_t W = loom_model_predict_width(m);
        for (int h = 0, off = 0; h < m->n_heads; h++) {
            const nn_layer_ *l = &m->layer[m->head[h].layer];
            head_rows(m->head[h].loss, h ? c->yo[m->head[h].layer] : z, c->B, l->n_out, j->out + c->b0 * W + off, W);
            off += (int)l->n_out;
        }
        return;
    }
    float *out = j->out + c->b0 * n;
    if (m->loss == LOOM_LOSS_SPARSE_SOFTMAX_CE) nn_softmax_rows_(z, out, c->B, n);
    else if (m->loss == LOOM_LOSS_BCE)
        for (int64_t e = 0; e < c->B * n; e++) out[e] = 1.f / (1.f + expf(-z[e]));
    else memcpy(out, z, (size_t)(c->B * n) * sizeof *out);
}

static void chunk_step(void *arg, int t)
{
    step_job *j = arg;
    j->l0 = 0, j->l1 = j->m->n_layers;
    loom_model *m = j->m;
    nn_chunk_ *c = &m->chunk[t];
    chunk_forward(j, c);
    if (j->kind == JOB_PREDICT) {
        predict_rows(j, c);
        return;
    }
    chunk_loss(j, c);
    if (j->kind == JOB_TRAIN) chunk_backward_(j, c, j->nchunks == 1 && ((m->grad_hook && hook_per_layer(m)) || m->upd));
}

static void part_loss(void *arg, int t) { step_job *j = arg; chunk_loss(j, &j->m->chunk[t]); }
/* a predict job's output rows (after forward_all) */
static void part_predict(void *arg, int t)
{
    step_job *j = arg;
    predict_rows(j, &j->m->chunk[t]);
}

/* Part t of the gradients that wait for all chunks: dense and conv layers'
 * kernel rows and bias columns, each over the whole batch, so no gradient
 * element is a sum split at chunk boundaries: the same bits for any number
 * of threads. Timed, only the layers with such a pass are clocked (the
 * others' few instructions go to the next one's). */
static void grad_part(void *arg, int t)
{
    const step_job *j = arg;
    const loom_model *m = j->m;
    double t0 = j->timed ? loom_now() : 0;
    for (int i = 0; i < m->n_layers; i++) {
        const nn_layer_ *l = &m->layer[i];
        layer_param_grads(j, i, t, j->nchunks);
        if (j->timed && has_grad_pass(l)) t0 = clock_layer(&m->chunk[t], i, t0);
        if (m->upd && has_grad_pass(l) && updates_in_part(l, j->nchunks)) { /* what this part wrote, still in cache */
            update_part(m, l, t, j->nchunks);
            if (j->timed) {
                double now = loom_now();
                m->chunk[t].pu[i] = now - t0;
                t0 = now;
            }
        }
    }
}

/* With a per-layer gradient hook and several chunks: the whole-batch
 * gradient pass of one layer (job->layer), split among the threads as
 * grad_part splits it. */
typedef struct layer_job {
    const step_job *j;
    int             layer;
} layer_job;

static void grad_part_layer(void *arg, int t)
{
    const layer_job *lj = arg;
    layer_param_grads(lj->j, lj->layer, t, lj->j->nchunks);
}

/* model.l2 for a batch of B of a global batch gb: returns l2 * sum(kernel^2) * B
 * (the penalty's share of the batch's loss sum, so the mean loss carries it
 * once) and, when grads is set, adds its gradient 2 l2 w * B / gb there (the
 * replicas' shares add up to one penalty). */
static double l2_penalty(const loom_model *m, int64_t B, int64_t gb, float *grads)
{
    if (m->l2 <= 0) return 0;
    double ss = 0;
    const float k = 2.f * m->l2 * (float)B / (float)gb;
    for (int i = 0; i < m->n_layers; i++) {
        const nn_layer_ *l = &m->layer[i];
        if (!kernel_kind(l->spec.kind)) continue; /* kernels only (a separable's two) */
        for (int t = 0; t < m->n_ptensors; t++) {
            int64_t off = m->pinfo[t].offset;
            if (off != l->kernel_off && off != l->pw_off) continue;
            int64_t n = loom_shape_numel(&m->pinfo[t].shape);
            const float *w = m->params + off;
            for (int64_t e = 0; e < n; e++) {
                ss += (double)w[e] * w[e];
                if (grads) grads[off + e] += k * w[e];
            }
        }
    }
    return (double)m->l2 * ss * (double)B;
}

/* Each head's loss and correct count of the step: its chunks' in chunk order. */
static void sum_heads(loom_model *m, int nchunks)
{
    for (int h = 0; h < m->n_heads; h++) {
        m->hloss[h] = 0;
        m->hcorrect[h] = 0;
        for (int t = 0; t < nchunks; t++) {
            m->hloss[h] += m->chunk[t].hloss[h];
            m->hcorrect[h] += m->chunk[t].hcorrect[h];
        }
        if (m->n_heads > 1) {
            m->mstate[m->hoff + 2 * h] += m->hloss[h];
            m->mstate[m->hoff + 2 * h + 1] += (double)m->hcorrect[h];
        }
    }
}

/* Runs job over the batch's chunks, one per thread, and sums their results
 * in chunk order; a train step then finishes the gradients (grad_part). */
static void run_chunks(loom_model *m, step_job *j, int64_t B, double *loss, int64_t *correct)
{
    j->m = m;
    j->B = B;
    j->nchunks = split_batch(m, B);
    m->part_done = 0; /* the chunks' buffers no longer hold a step in parts */
    if (!m->n_bn) {
        loom_pool_run(m->pool, j->nchunks, chunk_step, j);
    } else { /* batch normalization needs the whole batch between segments */
        int kind = j->kind;
        forward_all(m, j, NULL);
        if (kind == JOB_PREDICT) {
            loom_pool_run(m->pool, j->nchunks, part_predict, j);
            return;
        }
        loom_pool_run(m->pool, j->nchunks, part_loss, j);
        if (kind == JOB_TRAIN) backward_all(m, j, NULL);
    }
    double l = 0;
    int64_t ok = 0;
    for (int t = 0; t < j->nchunks; t++) {
        l += m->chunk[t].loss;
        ok += m->chunk[t].correct;
    }
    if (j->kind != JOB_PREDICT) sum_heads(m, j->nchunks);
    if (loss) *loss = l;
    if (correct) *correct = ok;
    if (j->kind != JOB_PREDICT) nn_metrics_update_(m, m->chunk[0].act[m->n_layers], B);
    if (j->kind == JOB_TRAIN && isfinite(l)) {
        bool per_layer = m->grad_hook && hook_per_layer(m);
        if (m->upd) { /* one chunk: chunk_backward_ did it all */
            if (j->nchunks > 1) {
                loom_pool_run(m->pool, j->nchunks, grad_part, j);
                update_rest(m, j->nchunks, NULL);
            }
        } else if (!per_layer) {
            loom_pool_run(m->pool, j->nchunks, grad_part, j);
        } else if (j->nchunks > 1) { /* last layer first, the hook after each (one chunk: chunk_backward_ did) */
            for (int i = m->n_layers - 1; i >= 0; i--) {
                if (m->layer[i].kernel_off < 0) continue;
                layer_job lj = {j, i};
                loom_pool_run(m->pool, j->nchunks, grad_part_layer, &lj);
                m->grad_hook(m->grad_hook_arg, first_tensor(m, &m->layer[i]));
            }
        }
    }
    if (j->kind != JOB_PREDICT && loss && isfinite(l)) /* Keras reports the loss with its regularisation */
        *loss += l2_penalty(m, B, j->gb > 0 ? j->gb : B, j->kind == JOB_TRAIN ? m->grads : NULL);
    /* every gradient is final (layers without parameters below, the l2 penalty added) */
    if (j->kind == JOB_TRAIN && isfinite(l) && m->grad_hook) m->grad_hook(m->grad_hook_arg, 0);
}

void loom_model_set_prof(loom_model *m, loom_model_prof *p) { m->prof = p; }
int loom_model_num_layers(const loom_model *m) { return m->n_layers; }

const loom_layer_spec *loom_model_layer_spec(const loom_model *m, int i, int *src, int *n_src)
{
    const nn_layer_ *l = &m->layer[i];
    for (int k = 0; k < l->n_src; k++) src[k] = l->src[k];
    *n_src = l->n_src;
    return &l->spec;
}

void loom_model_set_grad_hook(loom_model *m, loom_grad_ready_fn fn, void *arg)
{
    m->grad_hook = fn;
    m->grad_hook_arg = arg;
}

static int train_step(loom_model *m, const loom_tensor *x, const loom_tensor *label, int64_t global_batch,
                          uint64_t rng_key, double *loss_sum, int64_t *correct, loom_err *err)
{
    int64_t B;
    int rc;
    if ((rc = nn_check_batch_(m, x, label, &B, err))) return rc;
    if ((rc = nn_read_label_(m, label, B, err))) return rc;
    if (global_batch < 1) global_batch = B;
    step_job j = {.kind = JOB_TRAIN, .x = x->data, .label = label, .inv_gb = (float)(1.0 / (double)global_batch),
                  .gb = global_batch, .rng_key = rng_key};
    double loss;
    run_chunks(m, &j, B, &loss, correct);
    if (loss_sum) *loss_sum = loss;
    return isfinite(loss) ? LOOM_OK : nn_loss_error_(m, loss, B, err);
}

int loom_model_train_step(loom_model *m, const loom_tensor *x, const loom_tensor *label, int64_t global_batch,
                          uint64_t rng_key, double *loss_sum, int64_t *correct, loom_err *err)
{
    m->sync_k = 0, m->sync_rc = 0;
    int rc = train_step(m, x, label, global_batch, rng_key, loss_sum, correct, err);
    int src = nn_bn_sync_rest_(m, false, rc ? NULL : err); /* the calls a failed step did not make */
    if (__atomic_load_n(&m->plugin_rc, __ATOMIC_ACQUIRE)) return nn_plugin_error_(m, err); /* the cause of the rest */
    return rc ? rc : src;
}

/* Per layer needs no other gradient than the layer's own (hook_per_layer:
 * no batch normalization, model.l2 or embedding), no hook (a replica among
 * several reduces first), an update of a range that reads only the range. */
bool loom_model_can_update_in_step(const loom_model *m, const loom_optimizer *o)
{
    return o && hook_per_layer(m) && !m->grad_hook && !m->bn_sync && nn_optimizer_ranged_(o);
}

bool loom_model_profiled(const loom_model *m) { return m->prof != NULL; }

int loom_model_train_step_update(loom_model *m, const loom_tensor *x, const loom_tensor *label, int64_t global_batch,
                                 uint64_t rng_key, loom_optimizer *o, int64_t step, double *loss_sum,
                                 int64_t *correct, bool *applied, loom_err *err)
{
    bool in_step = loom_model_can_update_in_step(m, o);
    m->upd = in_step ? o : NULL;
    m->upd_step = step;
    int rc = loom_model_train_step(m, x, label, global_batch, rng_key, loss_sum, correct, err);
    m->upd = NULL;
    *applied = in_step && rc == LOOM_OK; /* a failed step (a bad batch, a non-finite loss) updated nothing */
    return rc;
}

void loom_model_set_bn_sync(loom_model *m, loom_bn_sync_fn fn, void *arg)
{
    m->bn_sync = m->n_sync_bn ? fn : NULL;
    m->bn_sync_arg = arg;
    m->sync_k = 0, m->sync_rc = 0;
}

int loom_model_num_sync_bn(const loom_model *m) { return m->n_sync_bn; }

int loom_model_bn_sync_idle(loom_model *m, int pass, loom_err *err)
{
    if (pass != LOOM_BN_SYNC_BACKWARD) m->sync_k = 0, m->sync_rc = 0; /* the backward's follow the forward's */
    return nn_bn_sync_rest_(m, pass == LOOM_BN_SYNC_FORWARD, err);
}

/* ---- a train step in parts ------------------------------------------------ */

int loom_model_forward(loom_model *m, const loom_tensor *x, uint64_t rng_key, loom_err *err)
{
    int64_t B;
    int rc;
    m->part_done = 0;
    m->sync_k = 0, m->sync_rc = 0;
    if ((rc = nn_check_batch_(m, x, NULL, &B, err))) {
        nn_bn_sync_rest_(m, true, NULL);
        return rc;
    }
    step_job j = {.m = m, .kind = JOB_TRAIN, .x = x->data, .rng_key = rng_key, .B = B};
    j.nchunks = split_batch(m, B);
    for (int t = 0; t < j.nchunks; t++) m->chunk[t].loss = 0;
    forward_all(m, &j, m->prof ? m->prof->fwd : NULL);
    if ((rc = nn_bn_sync_rest_(m, true, err))) return nn_plugin_error_(m, NULL), rc;
    if ((rc = nn_plugin_error_(m, err))) return rc;
    m->part_B = B;
    m->part_done = 1;
    return LOOM_OK;
}

int loom_model_loss(loom_model *m, const loom_tensor *label, int64_t global_batch, double *loss_sum, int64_t *correct,
                    loom_err *err)
{
    if (m->part_done < 1)
        return loom_err_set(err, LOOM_EUSAGE, m->where, "the loss needs a forward pass on the batch first");
    int64_t B = m->part_B;
    int rc;
    if ((rc = nn_check_label_(m, label, B, err))) return rc;
    if ((rc = nn_read_label_(m, label, B, err))) return rc;
    if (global_batch < 1) global_batch = B;
    step_job j = {.m = m, .kind = JOB_TRAIN, .label = label, .inv_gb = (float)(1.0 / (double)global_batch), .B = B};
    j.nchunks = B < m->threads ? (int)B : m->threads;
    loom_pool_run(m->pool, j.nchunks, part_loss, &j);
    double l = 0;
    int64_t ok = 0;
    for (int t = 0; t < j.nchunks; t++) {
        l += m->chunk[t].loss;
        ok += m->chunk[t].correct;
    }
    sum_heads(m, j.nchunks);
    if (loss_sum) *loss_sum = l;
    if (isfinite(l)) l += l2_penalty(m, B, global_batch, NULL);
    m->part_gb = global_batch;
    if (correct) *correct = ok;
    nn_metrics_update_(m, m->chunk[0].act[m->n_layers], B);
    if (!isfinite(l))
        return loom_err_set(err, LOOM_ENUMERIC, m->where, "the loss is %g on a batch of %lld examples", l, (long long)B);
    m->part_done = 2;
    return LOOM_OK;
}

int loom_model_backward(loom_model *m, loom_err *err)
{
    if (m->part_done < 2) {
        nn_bn_sync_rest_(m, false, NULL); /* the synchronised layers' calls all the same */
        return loom_err_set(err, LOOM_EUSAGE, m->where, "backward needs the loss of a forward pass first");
    }
    step_job j = {.m = m, .kind = JOB_TRAIN, .B = m->part_B};
    j.nchunks = j.B < m->threads ? (int)j.B : m->threads;
    backward_all(m, &j, m->prof ? m->prof->bwd : NULL);
    run_phase(m, &j, grad_part, m->prof ? m->prof->pgrad : NULL);
    if (m->upd) update_rest(m, j.nchunks, m->prof ? m->prof->upd : NULL);
    l2_penalty(m, j.B, m->part_gb, m->grads);
    m->part_done = 0;
    int src = nn_bn_sync_rest_(m, false, err);
    int prc = nn_plugin_error_(m, src ? NULL : err);
    return src ? src : prc;
}

int loom_model_backward_update(loom_model *m, loom_optimizer *o, int64_t step, bool *applied, loom_err *err)
{
    bool in_step = m->part_done >= 2 && loom_model_can_update_in_step(m, o);
    m->upd = in_step ? o : NULL;
    m->upd_step = step;
    int rc = loom_model_backward(m, err);
    m->upd = NULL;
    *applied = in_step && rc == LOOM_OK;
    return rc;
}

int loom_model_evaluate(loom_model *m, const loom_tensor *x, const loom_tensor *label, double *loss_sum,
                        int64_t *correct, loom_err *err)
{
    int64_t B;
    int rc;
    if ((rc = nn_check_batch_(m, x, label, &B, err))) return rc;
    if ((rc = nn_read_label_(m, label, B, err))) return rc;
    step_job j = {.kind = JOB_EVAL, .x = x->data, .label = label, .inv_gb = 1.f};
    run_chunks(m, &j, B, loss_sum, correct);
    return nn_plugin_error_(m, err);
}

int loom_model_predict(loom_model *m, const loom_tensor *x, float *out, loom_err *err)
{
    int64_t B;
    int rc;
    if ((rc = nn_check_batch_(m, x, NULL, &B, err))) return rc;
    step_job j = {.kind = JOB_PREDICT, .x = x->data, .out = out};
    run_chunks(m, &j, B, NULL, NULL);
    return nn_plugin_error_(m, err);
}

/* ---- sparse gradients ------------------------------------------------------ */

int loom_model_num_sparse(const loom_model *m)
{
    int n = 0;
    for (int i = 0; i < m->n_layers; i++) n += m->layer[i].spec.kind == LOOM_LAYER_EMBEDDING;
    return n;
}

void loom_model_sparse_grad(const loom_model *m, int i, loom_sparse_grad *out)
{
    memset(out, 0, sizeof *out);
    out->param = -1;
    for (int li = 0; li < m->n_layers; li++) {
        const nn_layer_ *l = &m->layer[li];
        if (l->spec.kind != LOOM_LAYER_EMBEDDING || i-- > 0) continue;
        for (int p = 0; p < m->n_ptensors; p++)
            if (m->pinfo[p].offset == l->kernel_off) out->param = p;
        *out = (loom_sparse_grad){.param = out->param, .offset = l->kernel_off, .rows = l->rows, .dim = l->dim,
                                  .n = l->sp_n, .ids = l->sp_ids, .values = l->sp_val};
        return;
    }
    LOOM_ASSERT(!"loom_model_sparse_grad: no such table");
}

void loom_model_set_sparse_owner(loom_model *m, int on) { m->sparse_owner = on != 0; }

/* ---- describing layers for a profile ---------------------------------------- */

const char *loom_model_layer_describe(const loom_model *m, int i, char *buf, size_t n)
{
    const nn_layer_ *l = &m->layer[i];
    const char *kind = nn_layer_kind_name_(l->spec.kind), *act = l->act ? nn_activation_name_(l->act) : "";
    switch (l->spec.kind) {
    case LOOM_LAYER_DENSE:
        snprintf(buf, n, "%s %s %lld->%lld%s%s", l->spec.name, kind, (long long)l->n_in, (long long)l->n_out,
                 *act ? " " : "", act);
        break;
    case LOOM_LAYER_CONV2D:
        snprintf(buf, n, "%s %s %dx%d %d->%d%s%s", l->spec.name, kind, l->kh, l->kw, l->cin, l->cout, *act ? " " : "",
                 act);
        break;
    case LOOM_LAYER_MAX_POOL2D:
        snprintf(buf, n, "%s %s %dx%d", l->spec.name, kind, l->kh, l->kw);
        break;
    default:
        snprintf(buf, n, "%s %s%s%s", l->spec.name, kind, *act ? " " : "", act);
        break;
    }
    return buf;
}

int loom_model_layer_gemm(const loom_model *m, int i, int64_t B, int which, loom_gemm_shape *out)
{
    const nn_layer_ *l = &m->layer[i];
    int64_t rows, in, outn; /* the product's batch rows, its inner and outer widths */
    if (l->spec.kind == LOOM_LAYER_DENSE) {
        rows = B, in = l->n_in, outn = l->n_out;
    } else if (l->spec.kind == LOOM_LAYER_CONV2D && !l->direct) {
        rows = B * l->oh * l->ow, in = (int64_t)l->kh * l->kw * l->cin, outn = l->cout;
    } else {
        return 0;
    }
    if (rows > INT_MAX || in > INT_MAX) return 0;
    switch (which) {
    case 0: *out = (loom_gemm_shape){false, false, (int)rows, (int)outn, (int)in}; return 1; /* y = x W */
    case 1: /* dx = dz W^T */
        if (!l->needs_dx) return 0;
        *out = (loom_gemm_shape){false, true, (int)rows, (int)in, (int)outn};
        return 1;
    case 2: *out = (loom_gemm_shape){true, false, (int)in, (int)outn, (int)rows}; return 1; /* dW = x^T dz */
    }
    return 0;
}
