/* model_device.c - a model's steps run through a device backend (device.h):
 * every layer's forward and backward as the backend's ops on device memory,
 * on a GPU (plugins/cuda) or, to test this same path on any machine, on the
 * built-in CPU reference backend.
 *
 * Design. The host keeps the master variables and the optimizer: the model
 * still owns the flat params and grads buffers that checkpoints, the
 * strategies' reductions and their sharded, element-wise optimizer use
 * unchanged. A train step uploads the batch (a loom_dev_stager: pinned
 * staging, copy stream, an event before compute), runs forward, loss and
 * backward on the compute stream in device buffers sized for the model's
 * max_batch at open (parameters, gradients, activations, deltas, im2col
 * scratch, pool argmax, dropout masks, labels) and downloads the gradients
 * into the host grads buffer; after the host update the caller uploads the
 * parameters (loom_model_dev_upload_params). A strategy whose cross-device
 * op reduces device memory (nccl) keeps the gradients there instead
 * (loom_model_dev_backward_keep: the one flat device buffer d->grads, laid out
 * as the host's, so one collective covers every layer), reduces them in place
 * and downloads only the range it applies (loom_model_dev_download_grads).
 * Gradients down and parameters up are 2 x P floats over PCIe per step
 * (2 x 0.9 MiB for the 784-256-128-10 MLP, about 0.06 ms each way at
 * 16 GB/s: more than the MLP's compute on a modern GPU); a replica that
 * downloads only its 1/N shard moves (1 + 1/N) x P. An optimizer on the
 * device (slots in device memory, the update as one kernel) would save both
 * copies: with NCCL reducing device buffers nothing would then cross PCIe
 * but the batch.
 * Dropout masks are drawn on the host with nn's keyed Philox stream (the
 * host path's mask for the same key and example positions) and uploaded as
 * floats, 0 or 1 / (1 - rate), that multiply. Softmax cross-entropy runs on
 * the device (softmax_xent); mean squared error runs on the host with nn's
 * own loss on the downloaded outputs, and its gradient is uploaded.
 * Convolutions run on the whole batch: the im2col scratch holds max_batch
 * examples. A softmax activation other than the one fused into sparse
 * softmax cross-entropy has no device op: open refuses it, naming the layer.
 * Results equal the host path's up to float rounding: the CPU reference
 * computes convolutions by im2col where nn has direct kernels, and its
 * per-example losses in float.
 * Threads: an executor is used by one thread at a time. */
#include "nn_internal.h"
#include "tensor/tensor.h"

#include <math.h>
#include <string.h>

#define TRY(call)                      \
    do {                               \
        int rc_ = (call);              \
        if (rc_) return rc_;           \
    } while (0)

/* Device memory and pinned host memory of one layer. */
typedef struct dev_layer {
    float          *y;      /* (max_batch, n_out) owned output; NULL: the layer passes its input on */
    int32_t        *argmax; /* max_pool2d: (max_batch, n_out) */
    float          *mask;   /* dropout: (max_batch, n_out) 0 or 1 / (1 - rate) */
    float          *h_mask; /* dropout: its pinned host staging */
    float          *db;     /* conv2d without bias: scratch for the bias gradient the op always writes */
    float          *dg;     /* a graph's gacc layer: (max_batch, n_out) its output's gradient, over its consumers */
    loom_dev_window win;    /* conv2d, max_pool2d; batch set per step */
} dev_layer;

#define MAX_ALLOCS (4 * LOOM_MAX_LAYERS + 16)

struct loom_model_dev {
    loom_model            *m;
    const loom_device_ops *ops;
    loom_device           *dev;
    float                 *params, *grads;                 /* (P,) device */
    dev_layer              layer[LOOM_MAX_LAYERS];
    const float           *act[LOOM_MAX_LAYERS + 1];       /* this batch: act[i] is layer i's input */
    float                 *gbuf[2];                        /* (max_batch, gmax) device, ping-pong deltas */
    float                 *col;                            /* im2col scratch, device; NULL without conv */
    float                 *ones;                           /* activation layers: y = x * 1, then in place */
    float                 *zeros;                          /* graphs: (max_batch, max n_out) zeros, to copy and negate */
    const float           *in0;                            /* graphs: this batch's model input */
    float                 *xin[LOOM_MAX_MODEL_INPUTS];     /* model.inputs 1..: (max_batch, its shape) device */
    const float           *yo[LOOM_MAX_LAYERS];            /* graphs: each layer's output this batch */
    uint8_t                ginit[LOOM_MAX_LAYERS];         /* graphs: dg of the layer holds a first gradient */
    int32_t               *labels;                         /* (max_batch,) device */
    float                 *loss;                           /* (max_batch,) device: softmax_xent's losses */
    int32_t               *hit;                            /* (max_batch,) device */
    float                 *h_loss;                         /* pinned host copies */
    int32_t               *h_hit;
    float                 *h_out, *h_grad;                 /* (max_batch, outputs) pinned: MSE's outputs, gradient */
    uint8_t               *h_keep;                         /* (max_batch, max dropout n_out) host */
    loom_dev_stager       *stage;                          /* input batches */
    int64_t                B;                              /* examples of the current batch */
    int                    part_done;                      /* as loom_model's: 0, 1 (forward), 2 (loss) */
    void                  *dmem[MAX_ALLOCS], *hmem[MAX_ALLOCS];
    int                    n_dmem, n_hmem;
};

static loom_dev_act dev_act(loom_activation a)
{
    switch (a) {
    case LOOM_ACT_RELU: return LOOM_DEV_ACT_RELU;
    case LOOM_ACT_SIGMOID: return LOOM_DEV_ACT_SIGMOID;
    case LOOM_ACT_TANH: return LOOM_DEV_ACT_TANH;
    default: return LOOM_DEV_ACT_NONE;
    }
}

/* ---- opening ------------------------------------------------------------------ */

/* Device (host = 0) or pinned host (host = 1) memory, freed at close. */
static int mem(loom_model_dev *d, int host, void **out, int64_t bytes, loom_err *err)
{
    size_t n = (size_t)(bytes > 0 ? bytes : 1);
    LOOM_ASSERT(d->n_dmem < MAX_ALLOCS && d->n_hmem < MAX_ALLOCS);
    TRY(host ? d->ops->host_alloc(d->dev, out, n, err) : d->ops->alloc(d->dev, out, n, err));
    if (host) d->hmem[d->n_hmem++] = *out;
    else d->dmem[d->n_dmem++] = *out;
    return LOOM_OK;
}

/* dst = device (DALLOC) or pinned host (HALLOC) memory of bytes, in a function with d and err. */
#define ALLOC_(host, dst, bytes)                       \
    do {                                               \
        void *p_;                                      \
        TRY(mem(d, (host), &p_, (bytes), err));        \
        (dst) = p_;                                    \
    } while (0)
#define DALLOC(dst, bytes) ALLOC_(0, dst, bytes)
#define HALLOC(dst, bytes) ALLOC_(1, dst, bytes)

/* What to do about something the backend named cannot run. */
static void dev_hint(const char *backend, loom_err *err)
{
    if (!strcmp(backend, "cpu"))
        loom_err_hint(err, "remove strategy.device_backend (\"\": nn's host code runs every layer), or remove the "
                      "layer");
    else
        loom_err_hint(err, "use cpu devices (one_device without device = \"gpu:N\", or strategy.devices = "
                      "[\"cpu:0\", ...]): nn's host code runs every layer; or remove the layer");
}

/* A layer kind or activation no device backend runs yet: refused at the
 * layer's file:line (where: "file:line" of the layer). */
static int check_kind(const loom_layer_spec *s, loom_activation act, const char *where, const char *backend,
                      loom_err *err)
{
    bool direct = s->kind == LOOM_LAYER_CONV2D && (s->groups > 1 || s->dilation[0] > 1 || s->dilation[1] > 1);
    if (s->kind <= LOOM_LAYER_ACTIVATION && act != LOOM_ACT_LEAKY_RELU && act != LOOM_ACT_GELU && act < LOOM_ACT_SWISH &&
        !direct)
        return LOOM_OK;
    if (s->kind >= LOOM_LAYER_ADD && s->kind <= LOOM_LAYER_CONCATENATE && s->kind != LOOM_LAYER_MAXIMUM)
        return LOOM_OK; /* a graph's merges (shapes checked at open: check_merge) */
    if (s->kind == LOOM_LAYER_EMBEDDING)
        loom_err_set(err, LOOM_EUNSUPPORTED, where,
                     "layer \"%s\" (embedding): the \"%s\" device backend has no embedding lookup", s->name, backend);
    else if (direct)
        loom_err_set(err, LOOM_EUNSUPPORTED, where, "layer \"%s\" (conv2d with groups or dilation_rate) is not "
                     "implemented on the \"%s\" device backend", s->name, backend);
    else
        loom_err_set(err, LOOM_EUNSUPPORTED, where, "layer \"%s\" (%s%s%s) is not implemented on the \"%s\" device "
                     "backend", s->name, nn_layer_kind_name_(s->kind), act ? ", " : "", act ? nn_activation_name_(act) : "",
                     backend);
    dev_hint(backend, err);
    return LOOM_EUNSUPPORTED;
}

int loom_model_spec_dev_check(const loom_model_spec *ms, const char *backend, loom_err *err)
{
    char w[LOOM_PATH_MAX + 16];
    if (ms->n_heads > 1) {
        loom_err_set(err, LOOM_EUNSUPPORTED, nn_loc_str_(&ms->head[1].loc, w, sizeof w),
                     "model.outputs has %d heads; the \"%s\" device backend trains one output", ms->n_heads, backend);
        dev_hint(backend, err);
        return LOOM_EUNSUPPORTED;
    }
    for (int i = 0; i < ms->n_layers; i++) {
        const loom_layer_spec *l = &ms->layer[i];
        int rc = check_kind(l, l->activation, nn_loc_str_(&l->loc, w, sizeof w), backend, err);
        if (rc) return rc;
    }
    nn_loc_str_(&ms->loc, w, sizeof w);
    const char *what = ms->l2 > 0                                                          ? "model.l2"
                       : ms->n_class_weights && ms->loss == LOOM_LOSS_SPARSE_SOFTMAX_CE    ? "model.class_weight"
                       : ms->sample_weight[0] && ms->loss == LOOM_LOSS_SPARSE_SOFTMAX_CE ? "model.sample_weight"
                                                                                           : NULL;
    if (!what) return LOOM_OK;
    loom_err_set(err, LOOM_EUNSUPPORTED, w, "%s%s is not implemented on the \"%s\" device backend", what,
                 ms->l2 > 0 ? "" : " with sparse_softmax_cross_entropy (its fused softmax_xent is unweighted)", backend);
    if (ms->l2 > 0)
        return loom_err_hint(err, "use optimizer type \"adamw\" (decoupled weight decay), or train on cpu devices "
                             "without strategy.device_backend"), LOOM_EUNSUPPORTED;
    dev_hint(backend, err);
    return LOOM_EUNSUPPORTED;
}

/* A merge the device ops cannot run: broadcasting, or a concatenate on another axis than the last or
 * on a backend without copy2d (a version-1 table). */
static int check_merge(const loom_device_ops *ops, const nn_layer_ *l, loom_err *err)
{
    const char *why = NULL;
    for (int k = 0; k < l->n_src && !why; k++)
        if (l->spec.kind != LOOM_LAYER_CONCATENATE && l->bstride[k][0] >= 0) why = "broadcasts an input";
    if (l->spec.kind == LOOM_LAYER_CONCATENATE && l->C != l->out.rank - 1) why = "joins along another than the last axis";
    if (l->spec.kind == LOOM_LAYER_CONCATENATE && !why && (ops->version < 2 || !ops->copy2d))
        why = "needs the backend's copy2d";
    if (!why) return LOOM_OK;
    return loom_err_set(err, LOOM_EUNSUPPORTED, l->where, "layer \"%s\" (%s) %s: not implemented on the \"%s\" "
                        "device backend", l->spec.name, nn_layer_kind_name_(l->spec.kind), why, ops->name),
           dev_hint(ops->name, err), LOOM_EUNSUPPORTED;
}

static bool is_merge(const nn_layer_ *l)
{
    return l->spec.kind >= LOOM_LAYER_ADD && l->spec.kind <= LOOM_LAYER_CONCATENATE;
}

/* A layer the device ops cannot run: named at its file:line. */
static int check_layer(const loom_device_ops *ops, const nn_layer_ *l, loom_err *err)
{
    int rc = check_kind(&l->spec, l->act, l->where, ops->name, err);
    if (rc) return rc;
    if (is_merge(l)) return check_merge(ops, l, err);
    if (l->spec.kind == LOOM_LAYER_DENSE && l->steps > 1)
        return loom_err_set(err, LOOM_EUNSUPPORTED, l->where, "layer \"%s\" (dense on the last axis of a %dD "
                            "input): the \"%s\" device backend runs dense on a (features,) input only", l->spec.name,
                            l->in.rank, ops->name),
               dev_hint(ops->name, err), LOOM_EUNSUPPORTED;
    if (l->act != LOOM_ACT_SOFTMAX) return LOOM_OK;
    return loom_err_set(err, LOOM_EUNSUPPORTED, l->where,
                        "layer \"%s\" (%s): the \"%s\" device backend has no softmax activation; only the softmax "
                        "of the last layer under sparse_softmax_cross_entropy (fused into the loss) runs on a device",
                        l->spec.name, nn_layer_kind_name_(l->spec.kind), ops->name),
           loom_err_hint(err, "end the model with a linear dense layer and use loss = "
                         "\"sparse_softmax_cross_entropy\", or train on the host (strategy.device_backend = \"\")");
}

static loom_dev_window window_of(const nn_layer_ *l)
{
    return (loom_dev_window){.h = l->ih, .w = l->iw, .c = l->cin, .kh = l->kh, .kw = l->kw, .sh = l->sh,
                             .sw = l->sw, .pad_t = l->pad_t, .pad_l = l->pad_l, .oh = l->oh, .ow = l->ow,
                             .cout = l->cout};
}

/* Layer li's buffers; *col, *ones and *keep grow to what it needs (elements per batch). */
static int open_layer(loom_model_dev *d, int li, int64_t *col, int64_t *ones, int64_t *keep, loom_err *err)
{
    const nn_layer_ *l = &d->m->layer[li];
    dev_layer *dl = &d->layer[li];
    const int64_t mb = d->m->max_batch, out = mb * l->n_out;
    if (d->m->graph && l->gacc) DALLOC(dl->dg, out * (int64_t)sizeof(float));
    if (is_merge(l)) {
        DALLOC(dl->y, out * (int64_t)sizeof(float));
        return LOOM_OK;
    }
    switch (l->spec.kind) {
    case LOOM_LAYER_DENSE:
        DALLOC(dl->y, out * (int64_t)sizeof(float));
        return LOOM_OK;
    case LOOM_LAYER_CONV2D: {
        dl->win = window_of(l);
        int64_t c = mb * l->oh * l->ow * (int64_t)l->kh * l->kw * l->cin;
        *col = c > *col ? c : *col;
        DALLOC(dl->y, out * (int64_t)sizeof(float));
        if (l->bias_off < 0) DALLOC(dl->db, l->cout * (int64_t)sizeof(float));
        return LOOM_OK;
    }
    case LOOM_LAYER_MAX_POOL2D:
        dl->win = window_of(l);
        DALLOC(dl->y, out * (int64_t)sizeof(float));
        DALLOC(dl->argmax, out * (int64_t)sizeof(int32_t));
        return LOOM_OK;
    case LOOM_LAYER_DROPOUT:
        if (l->spec.rate <= 0) return LOOM_OK;
        *keep = out > *keep ? out : *keep;
        DALLOC(dl->y, out * (int64_t)sizeof(float));
        DALLOC(dl->mask, out * (int64_t)sizeof(float));
        HALLOC(dl->h_mask, out * (int64_t)sizeof(float));
        return LOOM_OK;
    case LOOM_LAYER_ACTIVATION:
        if (l->act == LOOM_ACT_NONE) return LOOM_OK;
        *ones = out > *ones ? out : *ones;
        DALLOC(dl->y, out * (int64_t)sizeof(float));
        return LOOM_OK;
    default: /* flatten */
        return LOOM_OK;
    }
}

static int open_buffers(loom_model_dev *d, loom_err *err)
{
    loom_model *m = d->m;
    const int64_t mb = m->max_batch, P = m->n_params, n = m->layer[m->n_layers - 1].n_out;
    const int64_t F = (int64_t)sizeof(float);
    int64_t col = 0, ones = 0, keep = 0;
    for (int i = 0; i < m->n_layers; i++) TRY(open_layer(d, i, &col, &ones, &keep, err));
    for (int f = 1; f < m->n_inputs; f++) DALLOC(d->xin[f], mb * loom_shape_numel(&m->in_shape[f]) * F);
    DALLOC(d->params, P * F);
    DALLOC(d->grads, P * F);
    for (int k = 0; k < 2; k++) DALLOC(d->gbuf[k], mb * m->gmax * F);
    if (col) DALLOC(d->col, col * F);
    if (ones) {
        DALLOC(d->ones, ones * F);
        float *h;
        HALLOC(h, ones * F);
        for (int64_t e = 0; e < ones; e++) h[e] = 1.f;
        TRY(d->ops->upload(d->dev, LOOM_DEV_STREAM_COMPUTE, d->ones, h, (size_t)(ones * F), err));
        TRY(d->ops->synchronize(d->dev, LOOM_DEV_STREAM_COMPUTE, err));
    }
    if (m->graph) { /* zeros as long as any layer's output: a gathered gradient's first copy, a negation */
        int64_t z = 0;
        for (int i = 0; i < m->n_layers; i++) z = mb * m->layer[i].n_out > z ? mb * m->layer[i].n_out : z;
        DALLOC(d->zeros, z * F);
        float *h;
        HALLOC(h, z * F);
        memset(h, 0, (size_t)(z * F));
        TRY(d->ops->upload(d->dev, LOOM_DEV_STREAM_COMPUTE, d->zeros, h, (size_t)(z * F), err));
        TRY(d->ops->synchronize(d->dev, LOOM_DEV_STREAM_COMPUTE, err));
    }
    if (keep && !(d->h_keep = loom_alloc((size_t)keep)))
        return loom_err_set(err, LOOM_ENOMEM, m->where, "cannot allocate the dropout masks for batch %lld",
                            (long long)mb);
    DALLOC(d->labels, mb * (int64_t)sizeof(int32_t));
    DALLOC(d->loss, mb * F);
    DALLOC(d->hit, mb * (int64_t)sizeof(int32_t));
    HALLOC(d->h_loss, mb * F);
    HALLOC(d->h_hit, mb * (int64_t)sizeof(int32_t));
    HALLOC(d->h_out, mb * n * F);
    HALLOC(d->h_grad, mb * n * F);
    return loom_dev_stager_open(&d->stage, d->ops, d->dev, (size_t)(mb * m->layer[0].n_in * F), err);
}

int loom_model_dev_open(loom_model_dev **out, loom_model *m, const loom_device_ops *ops, int device, loom_err *err)
{
    *out = NULL;
    if (m->n_heads > 1) {
        loom_err_set(err, LOOM_EUNSUPPORTED, m->where, "model.outputs has several heads: the \"%s\" device backend "
                     "runs a graph of one output", ops->name);
        dev_hint(ops->name, err);
        return LOOM_EUNSUPPORTED;
    }
    for (int i = 0; i < m->n_layers; i++) TRY(check_layer(ops, &m->layer[i], err));
    if (m->l2 > 0)
        return loom_err_set(err, LOOM_EUNSUPPORTED, m->where,
                            "model.l2 does not run on the \"%s\" device backend yet", ops->name),
               loom_err_hint(err, "train on the host (strategy.device_backend = \"\"), or use optimizer type "
                                  "\"adamw\" (decoupled weight decay)");
    if (m->n_cw && m->loss == LOOM_LOSS_SPARSE_SOFTMAX_CE)
        return loom_err_set(err, LOOM_EUNSUPPORTED, m->where,
                            "model.class_weight with sparse_softmax_cross_entropy does not run on the \"%s\" device "
                            "backend (its fused softmax_xent is unweighted)", ops->name),
               loom_err_hint(err, "train on the host (strategy.device_backend = \"\"), or drop class_weight");
    loom_model_dev *d = loom_calloc(1, sizeof *d);
    if (!d) return loom_err_set(err, LOOM_ENOMEM, m->where, "cannot allocate a device executor");
    d->m = m;
    d->ops = ops;
    int rc = ops->open(&d->dev, device, err);
    if (!rc) rc = open_buffers(d, err);
    if (!rc) rc = loom_model_dev_upload_params(d, err);
    if (rc) {
        if (!err->where[0]) snprintf(err->where, sizeof err->where, "%.200s", m->where);
        loom_model_dev_close(d);
        return rc;
    }
    *out = d;
    return LOOM_OK;
}

void loom_model_dev_close(loom_model_dev *d)
{
    if (!d) return;
    loom_dev_stager_close(d->stage);
    if (d->dev) {
        loom_err ignored;
        d->ops->synchronize(d->dev, -1, &ignored);
        for (int i = 0; i < d->n_dmem; i++) d->ops->free(d->dev, d->dmem[i]);
        for (int i = 0; i < d->n_hmem; i++) d->ops->host_free(d->dev, d->hmem[i]);
        d->ops->close(d->dev);
    }
    loom_free(d->h_keep);
    loom_free(d);
}

int loom_model_dev_upload_params(loom_model_dev *d, loom_err *err)
{
    size_t bytes = (size_t)d->m->n_params * sizeof(float);
    if (bytes) TRY(d->ops->upload(d->dev, LOOM_DEV_STREAM_COMPUTE, d->params, d->m->params, bytes, err));
    /* the host may change its parameters again as soon as this returns */
    return d->ops->synchronize(d->dev, LOOM_DEV_STREAM_COMPUTE, err);
}

/* ---- forward ------------------------------------------------------------------ */

/* Dropout layer li's mask for this batch, drawn on the host as nn draws it. */
static int upload_mask(loom_model_dev *d, int li, int64_t n, uint64_t rng_key, loom_err *err)
{
    const nn_layer_ *l = &d->m->layer[li];
    dev_layer *dl = &d->layer[li];
    const float scale = (float)(1.0 / (1.0 - l->spec.rate));
    nn_dropout_mask_(l, li, d->h_keep, 0, n, rng_key);
    for (int64_t e = 0; e < n; e++) dl->h_mask[e] = d->h_keep[e] ? scale : 0.f;
    return d->ops->upload(d->dev, LOOM_DEV_STREAM_COMPUTE, dl->mask, dl->h_mask, (size_t)n * sizeof(float), err);
}

static int layer_forward(loom_model_dev *d, int li, int training, uint64_t rng_key, loom_err *err)
{
    const loom_device_ops *o = d->ops;
    const nn_layer_ *l = &d->m->layer[li];
    dev_layer *dl = &d->layer[li];
    const int64_t B = d->B, n = B * l->n_out;
    const float *x = d->act[li], *W = d->params + l->kernel_off;
    const float *b = l->bias_off >= 0 ? d->params + l->bias_off : NULL;
    float *y = dl->y;
    loom_dev_window win = dl->win;
    win.batch = (int32_t)B;
    d->act[li + 1] = y ? y : x;
    switch (l->spec.kind) {
    case LOOM_LAYER_DENSE: {
        int in = (int)l->n_in, out = (int)l->n_out;
        TRY(o->gemm(d->dev, false, false, (int)B, out, in, 1.f, x, in, W, out, 0.f, y, out, err));
        return b || l->act ? o->bias_act(d->dev, dev_act(l->act), B, out, b, y, err) : LOOM_OK;
    }
    case LOOM_LAYER_CONV2D:
        TRY(o->conv2d_forward(d->dev, &win, x, W, b, y, d->col, err));
        return l->act ? o->bias_act(d->dev, dev_act(l->act), B * l->oh * l->ow, l->cout, NULL, y, err) : LOOM_OK;
    case LOOM_LAYER_MAX_POOL2D:
        return o->maxpool_forward(d->dev, &win, x, y, dl->argmax, err);
    case LOOM_LAYER_DROPOUT:
        if (!y) return LOOM_OK;
        if (!training) {
            d->act[li + 1] = x;
            return LOOM_OK;
        }
        TRY(upload_mask(d, li, n, rng_key, err));
        return o->binary(d->dev, LOOM_DEV_MUL, n, x, dl->mask, y, err);
    case LOOM_LAYER_ACTIVATION:
        if (!y) return LOOM_OK;
        TRY(o->binary(d->dev, LOOM_DEV_MUL, n, x, d->ones, y, err));
        return o->bias_act(d->dev, dev_act(l->act), B, l->n_out, NULL, y, err);
    default: /* flatten: the same NHWC bytes */
        return LOOM_OK;
    }
}

/* ---- a graph's merges and gathered gradients (as graph.c on the host) ---------------- */

/* Layer (or model input) s's output this batch. */
static const float *src_ptr(const loom_model_dev *d, int s)
{
    return s >= 0 ? d->yo[s] : s == -1 ? d->in0 : d->xin[-1 - s];
}

/* Rows and columns of an output whose last axis is concatenated. */
static int64_t concat_rows(const loom_model_dev *d, const nn_layer_ *l)
{
    return d->B * l->n_out / l->out.dim[l->out.rank - 1];
}

static int merge_forward(loom_model_dev *d, int li, loom_err *err)
{
    const loom_device_ops *o = d->ops;
    const nn_layer_ *l = &d->m->layer[li];
    float *y = d->layer[li].y;
    const int64_t n = d->B * l->n_out;
    d->act[li + 1] = y;
    if (l->spec.kind == LOOM_LAYER_CONCATENATE) {
        const int64_t rows = concat_rows(d, l), cout = l->out.dim[l->out.rank - 1];
        int64_t off = 0;
        for (int k = 0; k < l->n_src; k++) {
            int64_t ck = l->src_shape[k].dim[l->src_shape[k].rank - 1];
            TRY(o->copy2d(d->dev, rows, ck, src_ptr(d, l->src[k]), ck, y + off, cout, err));
            off += ck;
        }
        return LOOM_OK;
    }
    loom_dev_binop op = l->spec.kind == LOOM_LAYER_SUBTRACT   ? LOOM_DEV_SUB
                        : l->spec.kind == LOOM_LAYER_MULTIPLY ? LOOM_DEV_MUL
                                                              : LOOM_DEV_ADD;
    TRY(o->binary(d->dev, op, n, src_ptr(d, l->src[0]), src_ptr(d, l->src[1]), y, err));
    for (int k = 2; k < l->n_src; k++) TRY(o->binary(d->dev, op, n, y, src_ptr(d, l->src[k]), y, err));
    return l->spec.kind == LOOM_LAYER_AVERAGE ? o->scale(d->dev, n, 1.f / (float)l->n_src, y, err) : LOOM_OK;
}

/* r (B, n_out of s) into layer s's gathered gradient: copied by the first consumer, added by the others. */
static int deliver(loom_model_dev *d, int s, const float *r, loom_err *err)
{
    float *dg = d->layer[s].dg;
    const int64_t n = d->B * d->m->layer[s].n_out;
    if (d->ginit[s]) return d->ops->axpy(d->dev, n, 1.f, r, dg, err);
    d->ginit[s] = 1;
    return d->ops->binary(d->dev, LOOM_DEV_ADD, n, r, d->zeros, dg, err);
}

static bool wants_grad(const loom_model *m, const nn_layer_ *l, int k)
{
    return l->src[k] >= 0 && m->layer[l->src[k]].need_out;
}

/* The merge's input gradients from g, delivered to the layers it names; scratch holds any of them. */
static int merge_backward(loom_model_dev *d, int li, const float *g, float *scratch, loom_err *err)
{
    const loom_device_ops *o = d->ops;
    const nn_layer_ *l = &d->m->layer[li];
    const int64_t n = d->B * l->n_out;
    int64_t off = 0;
    for (int k = 0; k < l->n_src; k++) {
        const int64_t ck = l->src_shape[k].dim[l->src_shape[k].rank - 1];
        off += k ? l->src_shape[k - 1].dim[l->src_shape[k - 1].rank - 1] : 0;
        if (!wants_grad(d->m, l, k)) continue;
        const float *v = scratch;
        switch (l->spec.kind) {
        case LOOM_LAYER_CONCATENATE:
            TRY(o->copy2d(d->dev, concat_rows(d, l), ck, g + off, l->out.dim[l->out.rank - 1], scratch, ck, err));
            break;
        case LOOM_LAYER_SUBTRACT:
            if (k == 0) v = g;
            else TRY(o->binary(d->dev, LOOM_DEV_SUB, n, d->zeros, g, scratch, err));
            break;
        case LOOM_LAYER_AVERAGE:
            TRY(o->binary(d->dev, LOOM_DEV_ADD, n, g, d->zeros, scratch, err));
            TRY(o->scale(d->dev, n, 1.f / (float)l->n_src, scratch, err));
            break;
        case LOOM_LAYER_MULTIPLY: { /* g times the other inputs, in input order (as the host) */
            const float *a = g;
            for (int q = 0; q < l->n_src; q++) {
                if (q == k) continue;
                TRY(o->binary(d->dev, LOOM_DEV_MUL, n, a, src_ptr(d, l->src[q]), scratch, err));
                a = scratch;
            }
            break;
        }
        default: /* add */
            v = g;
            break;
        }
        if (!d->m->layer[l->src[k]].gacc) continue; /* an add's input below it: g goes down the chain (add_link) */
        TRY(deliver(d, l->src[k], v, err));
    }
    return LOOM_OK;
}

/* Uploads the batch and runs every layer; B was checked. */
static int forward(loom_model_dev *d, const loom_tensor *x, int64_t B, int training, uint64_t rng_key, loom_err *err)
{
    d->part_done = 0;
    d->B = B;
    void *buf;
    TRY(loom_dev_stager_put(d->stage, x->data, loom_tensor_nbytes(x), err));
    TRY(loom_dev_stager_take(d->stage, &buf, err));
    d->act[0] = d->in0 = buf;
    const loom_model *m = d->m;
    for (int f = 1; f < m->n_inputs; f++) /* model.inputs (float32, checked with the batch): on the compute stream */
        TRY(d->ops->upload(d->dev, LOOM_DEV_STREAM_COMPUTE, d->xin[f], m->xs[f]->data,
                           (size_t)(B * loom_shape_numel(&m->in_shape[f])) * sizeof(float), err));
    for (int i = 0; i < m->n_layers; i++) {
        if (!m->graph) {
            TRY(layer_forward(d, i, training, rng_key, err));
            continue;
        }
        const nn_layer_ *l = &m->layer[i];
        d->act[i] = src_ptr(d, l->src[0]);
        if (is_merge(l)) TRY(merge_forward(d, i, err));
        else TRY(layer_forward(d, i, training, rng_key, err));
        d->yo[i] = d->act[i + 1];
    }
    return LOOM_OK;
}

/* ---- the loss ------------------------------------------------------------------ */

/* The loss of the outputs of the batch (labels already read into m->labels
 * for softmax cross-entropy) and, when grad, its gradient into gbuf[0]. */
static int loss(loom_model_dev *d, const loom_tensor *label, float inv_gb, int grad, double *loss_sum,
                int64_t *correct, loom_err *err)
{
    const loom_device_ops *o = d->ops;
    const loom_model *m = d->m;
    const int64_t B = d->B, n = m->layer[m->n_layers - 1].n_out;
    const float *z = d->act[m->n_layers];
    double l = 0;
    int64_t ok = 0;
    (void)label; /* read into m->labels or m->targets by nn_read_label_ */
    if (m->sw && m->loss == LOOM_LOSS_SPARSE_SOFTMAX_CE)
        return loom_err_set(err, LOOM_EUNSUPPORTED, m->where,
                            "model.sample_weight with sparse_softmax_cross_entropy does not run on the \"%s\" device "
                            "backend (its fused softmax_xent is unweighted)", o->name),
               loom_err_hint(err, "train on the host (strategy.device_backend = \"\")");
    if (m->loss == LOOM_LOSS_SPARSE_SOFTMAX_CE) {
        TRY(o->upload(d->dev, LOOM_DEV_STREAM_COMPUTE, d->labels, m->labels, (size_t)B * sizeof(int32_t), err));
        TRY(o->softmax_xent(d->dev, B, n, z, d->labels, inv_gb, d->loss, d->hit, grad ? d->gbuf[0] : NULL, err));
        TRY(o->download(d->dev, LOOM_DEV_STREAM_COMPUTE, d->h_loss, d->loss, (size_t)B * sizeof(float), err));
        TRY(o->download(d->dev, LOOM_DEV_STREAM_COMPUTE, d->h_hit, d->hit, (size_t)B * sizeof(int32_t), err));
        TRY(o->synchronize(d->dev, LOOM_DEV_STREAM_COMPUTE, err));
        for (int64_t b = 0; b < B; b++) { /* in example order, in double, as nn sums */
            l += (double)d->h_loss[b];
            ok += d->h_hit[b];
        }
        if (loom_model_metrics_size(m)) { /* the metrics read the outputs on the host */
            TRY(o->download(d->dev, LOOM_DEV_STREAM_COMPUTE, d->h_out, z, (size_t)(B * n) * sizeof(float), err));
            TRY(o->synchronize(d->dev, LOOM_DEV_STREAM_COMPUTE, err));
            nn_metrics_update_(d->m, d->h_out, B);
        }
    } else {
        size_t bytes = (size_t)(B * n) * sizeof(float);
        TRY(o->download(d->dev, LOOM_DEV_STREAM_COMPUTE, d->h_out, z, bytes, err));
        TRY(o->synchronize(d->dev, LOOM_DEV_STREAM_COMPUTE, err));
        l = nn_loss_(m, d->h_out, 0, B, inv_gb, grad ? d->h_grad : NULL, &ok);
        nn_metrics_update_(d->m, d->h_out, B);
        if (grad && isfinite(l)) TRY(o->upload(d->dev, LOOM_DEV_STREAM_COMPUTE, d->gbuf[0], d->h_grad, bytes, err));
    }
    if (loss_sum) *loss_sum = l;
    if (correct) *correct = ok;
    return isfinite(l) ? LOOM_OK : nn_loss_error_(m, l, B, err);
}

/* ---- backward ------------------------------------------------------------------ */

/* Layer li's backward with g = d(loss)/d(output) (may be overwritten):
 * parameter gradients into d->grads, and the input gradient into g or
 * other, which *dx is set to (NULL when the layer needs none). */
static int layer_backward(loom_model_dev *d, int li, float *g, float *other, float **dx, loom_err *err)
{
    const loom_device_ops *o = d->ops;
    const nn_layer_ *l = &d->m->layer[li];
    dev_layer *dl = &d->layer[li];
    const int64_t B = d->B, n = B * l->n_out;
    const float *x = d->act[li], *y = d->act[li + 1], *W = d->params + l->kernel_off;
    float *dW = d->grads + l->kernel_off, *db = l->bias_off >= 0 ? d->grads + l->bias_off : dl->db;
    loom_dev_window win = dl->win;
    win.batch = (int32_t)B;
    *dx = l->needs_dx ? other : NULL;
    switch (l->spec.kind) {
    case LOOM_LAYER_DENSE: {
        int in = (int)l->n_in, out = (int)l->n_out;
        if (l->act) TRY(o->act_backward(d->dev, dev_act(l->act), n, y, g, err));
        TRY(o->gemm(d->dev, true, false, in, out, (int)B, 1.f, x, in, g, out, 0.f, dW, out, err));
        if (l->bias_off >= 0) TRY(o->bias_grad(d->dev, B, out, g, db, err));
        return *dx ? o->gemm(d->dev, false, true, (int)B, in, out, 1.f, g, out, W, out, 0.f, other, in, err)
                   : LOOM_OK;
    }
    case LOOM_LAYER_CONV2D:
        if (l->act) TRY(o->act_backward(d->dev, dev_act(l->act), n, y, g, err));
        return o->conv2d_backward(d->dev, &win, x, W, g, *dx, dW, db, d->col, err);
    case LOOM_LAYER_MAX_POOL2D:
        return *dx ? o->maxpool_backward(d->dev, &win, g, dl->argmax, other, err) : LOOM_OK;
    case LOOM_LAYER_DROPOUT:
        *dx = g;
        return y != x ? o->binary(d->dev, LOOM_DEV_MUL, n, g, dl->mask, g, err) : LOOM_OK;
    case LOOM_LAYER_ACTIVATION:
        *dx = g;
        return l->act ? o->act_backward(d->dev, dev_act(l->act), n, y, g, err) : LOOM_OK;
    default: /* flatten */
        *dx = g;
        return LOOM_OK;
    }
}

/* A graph's backward from gbuf[0]: in the reverse topological order, a chain
 * link's gradient in the ping-pong buffers as a plain stack's, a layer with
 * several consumers (or one that is not the next) from its gathered dg. */
static int graph_backward(loom_model_dev *d, loom_err *err)
{
    const loom_model *m = d->m;
    float *g = d->gbuf[0], *other = d->gbuf[1];
    memset(d->ginit, 0, sizeof d->ginit);
    for (int i = m->n_layers - 1; i >= 0; i--) {
        const nn_layer_ *l = &m->layer[i];
        if (!l->need_out) continue;
        if (l->gacc) {
            g = d->layer[i].dg, other = d->gbuf[0];
            if (!d->ginit[i]) TRY(d->ops->binary(d->dev, LOOM_DEV_ADD, d->B * l->n_out, d->zeros, d->zeros, g, err));
        }
        if (is_merge(l)) {
            TRY(merge_backward(d, i, g, other, err));
            continue;
        }
        d->act[i] = src_ptr(d, l->src[0]);
        d->act[i + 1] = d->yo[i];
        float *r;
        TRY(layer_backward(d, i, g, other, &r, err));
        if (!r) continue;
        g = r, other = r == d->gbuf[0] ? d->gbuf[1] : d->gbuf[0];
        if (wants_grad(m, l, 0) && m->layer[l->src[0]].gacc) TRY(deliver(d, l->src[0], r, err));
    }
    return LOOM_OK;
}

/* Backward from gbuf[0] down to the first layer with parameters; then, with
 * download, the gradients into the host model's grads buffer. Either way the
 * device is idle on return, so another thread or library (a collective on
 * streams of its own) may read d->grads at once. */
static int backward(loom_model_dev *d, int download, loom_err *err)
{
    loom_model *m = d->m;
    float *g = d->gbuf[0], *other = d->gbuf[1];
    if (m->graph) TRY(graph_backward(d, err));
    for (int i = m->n_layers - 1; i >= 0 && !m->graph; i--) {
        const nn_layer_ *l = &m->layer[i];
        if (!l->needs_dx && l->kernel_off < 0) break;
        float *r;
        TRY(layer_backward(d, i, g, other, &r, err));
        if (!r) break;
        if (r == other) {
            other = g;
            g = r;
        }
    }
    size_t bytes = (size_t)m->n_params * sizeof(float);
    if (bytes && download) TRY(d->ops->download(d->dev, LOOM_DEV_STREAM_COMPUTE, m->grads, d->grads, bytes, err));
    return d->ops->synchronize(d->dev, -1, err);
}

/* ---- steps ------------------------------------------------------------------------ */

/* 1 / the global batch (< 1: this batch alone), as nn scales the loss gradient. */
static float inv_batch(int64_t global_batch, int64_t B)
{
    return (float)(1.0 / (double)(global_batch < 1 ? B : global_batch));
}

int loom_model_dev_train_step(loom_model_dev *d, const loom_tensor *x, const loom_tensor *label, int64_t global_batch,
                              uint64_t rng_key, double *loss_sum, int64_t *correct, loom_err *err)
{
    TRY(loom_model_dev_forward(d, x, rng_key, err));
    TRY(loom_model_dev_loss(d, label, global_batch, loss_sum, correct, err));
    return loom_model_dev_backward(d, err);
}

int loom_model_dev_train_step_keep(loom_model_dev *d, const loom_tensor *x, const loom_tensor *label,
                                   int64_t global_batch, uint64_t rng_key, double *loss_sum, int64_t *correct,
                                   loom_err *err)
{
    TRY(loom_model_dev_forward(d, x, rng_key, err));
    TRY(loom_model_dev_loss(d, label, global_batch, loss_sum, correct, err));
    return loom_model_dev_backward_keep(d, err);
}

int loom_model_dev_forward(loom_model_dev *d, const loom_tensor *x, uint64_t rng_key, loom_err *err)
{
    int64_t B;
    d->part_done = 0;
    TRY(nn_check_batch_(d->m, x, NULL, &B, err));
    TRY(forward(d, x, B, 1, rng_key, err));
    d->part_done = 1;
    return LOOM_OK;
}

int loom_model_dev_loss(loom_model_dev *d, const loom_tensor *label, int64_t global_batch, double *loss_sum,
                        int64_t *correct, loom_err *err)
{
    loom_model *m = d->m;
    if (d->part_done < 1)
        return loom_err_set(err, LOOM_EUSAGE, m->where, "the loss needs a forward pass on the batch first");
    TRY(nn_check_label_(m, label, d->B, err));
    TRY(nn_read_label_(m, label, d->B, err));
    TRY(loss(d, label, inv_batch(global_batch, d->B), 1, loss_sum, correct, err));
    d->part_done = 2;
    return LOOM_OK;
}

static int backward_part(loom_model_dev *d, int download, loom_err *err)
{
    if (d->part_done < 2)
        return loom_err_set(err, LOOM_EUSAGE, d->m->where, "backward needs the loss of a forward pass first");
    d->part_done = 0;
    return backward(d, download, err);
}

int loom_model_dev_backward(loom_model_dev *d, loom_err *err) { return backward_part(d, 1, err); }
int loom_model_dev_backward_keep(loom_model_dev *d, loom_err *err) { return backward_part(d, 0, err); }

/* ---- the device gradients, for reductions in device memory ---------------------- */

float *loom_model_dev_grads(loom_model_dev *d) { return d->grads; }

int loom_model_dev_download_grads(loom_model_dev *d, int64_t lo, int64_t hi, loom_err *err)
{
    LOOM_ASSERT(0 <= lo && lo <= hi && hi <= d->m->n_params);
    if (lo == hi) return LOOM_OK;
    TRY(d->ops->download(d->dev, LOOM_DEV_STREAM_COMPUTE, d->m->grads + lo, d->grads + lo,
                         (size_t)(hi - lo) * sizeof(float), err));
    return d->ops->synchronize(d->dev, LOOM_DEV_STREAM_COMPUTE, err);
}

int loom_model_dev_upload_grads(loom_model_dev *d, loom_err *err)
{
    size_t bytes = (size_t)d->m->n_params * sizeof(float);
    if (bytes) TRY(d->ops->upload(d->dev, LOOM_DEV_STREAM_COMPUTE, d->grads, d->m->grads, bytes, err));
    /* the device is idle on return, as after backward: the buffer may be reduced at once */
    return d->ops->synchronize(d->dev, -1, err);
}

int loom_model_dev_evaluate(loom_model_dev *d, const loom_tensor *x, const loom_tensor *label, double *loss_sum,
                            int64_t *correct, loom_err *err)
{
    loom_model *m = d->m;
    int64_t B;
    d->part_done = 0;
    TRY(nn_check_batch_(m, x, label, &B, err));
    TRY(nn_read_label_(m, label, B, err));
    TRY(forward(d, x, B, 0, 0, err));
    /* evaluation reports a non-finite loss as a value, as the host path does */
    int rc = loss(d, label, 1.f, 0, loss_sum, correct, err);
    return rc == LOOM_ENUMERIC ? LOOM_OK : rc;
}

int loom_model_dev_predict(loom_model_dev *d, const loom_tensor *x, float *out, loom_err *err)
{
    loom_model *m = d->m;
    int64_t B;
    d->part_done = 0;
    TRY(nn_check_batch_(m, x, NULL, &B, err));
    TRY(forward(d, x, B, 0, 0, err));
    const int64_t n = m->layer[m->n_layers - 1].n_out;
    TRY(d->ops->download(d->dev, LOOM_DEV_STREAM_COMPUTE, out, d->act[m->n_layers], (size_t)(B * n) * sizeof(float),
                         err));
    TRY(d->ops->synchronize(d->dev, LOOM_DEV_STREAM_COMPUTE, err));
    if (m->loss == LOOM_LOSS_SPARSE_SOFTMAX_CE) nn_softmax_rows_(out, out, B, n);
    if (m->loss == LOOM_LOSS_BCE)
        for (int64_t e = 0; e < B * n; e++) out[e] = 1.f / (1.f + expf(-out[e]));
    return LOOM_OK;
}
