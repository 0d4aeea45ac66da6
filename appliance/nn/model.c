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

static int layer_shapes(loom_model *m, nn_layer_ *l, int li, loom_err *err)
{
    char a[96], b[96];
    const loom_layer_spec *s = &l->spec;
    const char *kind = nn_layer_kind_name_(s->kind);
    const loom_shape *in = &l->in;
    l->kernel_off = l->bias_off = -1;
    l->act = LOOM_ACT_NONE;
    switch (s->kind) {
    case LOOM_LAYER_DENSE: {
        if (in->rank != 1) {
            loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\" (dense) needs a rank-1 input (features,), got %s",
                         s->name, loom_shape_str(in, a, sizeof a));
            loom_shape flat;
            shape_of(&flat, 1, loom_shape_numel(in), 0, 0);
            return loom_err_hint(err, "add a flatten layer before it (%s -> %s)", a,
                                 loom_shape_str(&flat, b, sizeof b));
        }
        if (s->units < 1)
            return loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\": units = %d, must be >= 1", s->name,
                                s->units);
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
        break;
    }
    case LOOM_LAYER_CONV2D:
    case LOOM_LAYER_MAX_POOL2D: {
        if (in->rank != 3) {
            loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\" (%s) needs an (H, W, C) input, got %s", s->name,
                         kind, loom_shape_str(in, a, sizeof a));
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
                                "layer \"%s\" (%s): a %dx%d window with valid padding does not fit the input %s",
                                s->name, kind, l->kh, l->kw, loom_shape_str(in, a, sizeof a)),
                   loom_err_hint(err, "use padding = \"same\" or a smaller window");
        if (conv) {
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
        } else {
            l->cout = l->cin;
        }
        shape_of(&l->out, 3, l->oh, l->ow, l->cout);
        break;
    }
    case LOOM_LAYER_DROPOUT:
        if (!(s->rate >= 0 && s->rate < 1))
            return loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\": rate = %g, must be in [0, 1)", s->name,
                                s->rate);
        l->out = *in;
        break;
    case LOOM_LAYER_FLATTEN:
        shape_of(&l->out, 1, loom_shape_numel(in), 0, 0);
        break;
    case LOOM_LAYER_ACTIVATION:
        l->out = *in;
        l->act = s->activation;
        if (l->act == LOOM_ACT_SOFTMAX && in->rank != 1)
            return loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\": softmax needs a rank-1 input, got %s",
                                s->name, loom_shape_str(in, a, sizeof a)),
                   loom_err_hint(err, "add a flatten layer before it");
        break;
    default:
        return loom_err_set(err, LOOM_ESHAPE, l->where, "layer %d: unknown kind %d", li, (int)s->kind);
    }
    if ((s->kind == LOOM_LAYER_DENSE || s->kind == LOOM_LAYER_CONV2D) && l->act == LOOM_ACT_SOFTMAX &&
        l->out.rank != 1)
        return loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\": softmax needs a rank-1 output, got %s",
                            s->name, loom_shape_str(&l->out, a, sizeof a));
    l->n_in = loom_shape_numel(in);
    l->n_out = loom_shape_numel(&l->out);
    return LOOM_OK;
}

static int check_loss(loom_model *m, const loom_shape *label, loom_dtype label_dtype, loom_err *err)
{
    char a[96], b[96];
    const loom_shape out = m->layer[m->n_layers - 1].out;
    const char *where = m->layer[m->n_layers - 1].where;
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
        if ((unsigned)label_dtype >= LOOM_NDTYPES_)
            return loom_err_set(err, LOOM_ESHAPE, m->where, "label dtype %d is not known", (int)label_dtype);
    } else {
        if (!loom_shape_eq(label, &out))
            return loom_err_set(err, LOOM_ESHAPE, where,
                                "mean_squared_error needs labels of the output's shape: label %s, model output %s",
                                loom_shape_str(label, a, sizeof a), loom_shape_str(&out, b, sizeof b)),
                   loom_err_hint(err, out.rank == 1 && label->rank == 0
                                          ? "add a one_hot map with depth = %lld to the label"
                                          : "change the last layer or the label transforms so the shapes agree",
                                 (long long)out.dim[0]);
        if (label_dtype != LOOM_F32)
            return loom_err_set(err, LOOM_ESHAPE, m->where, "mean_squared_error needs float32 labels, got %s",
                                loom_dtype_name(label_dtype)),
                   loom_err_hint(err, "add a cast map with dtype = \"float32\" to the label");
    }
    return LOOM_OK;
}

int loom_model_new(loom_model **out, const loom_model_spec *spec, const loom_shape *input, loom_dtype input_dtype,
                   const loom_shape *label, loom_dtype label_dtype, int64_t max_batch, loom_err *err)
{
    char a[96];
    *out = NULL;
    loom_model *m = loom_calloc(1, sizeof *m);
    if (!m) return loom_err_set(err, LOOM_ENOMEM, "", "cannot allocate the model");
    nn_loc_str_(&spec->loc, m->where, sizeof m->where);
    m->loss = spec->loss;
    m->input = *input;
    m->label = *label;
    m->label_dtype = label_dtype;
    m->max_batch = max_batch;
    int rc = LOOM_OK;
    if (input_dtype != LOOM_F32) {
        rc = loom_err_set(err, LOOM_ESHAPE, m->where, "model input \"%s\" is %s %s; layers need float32",
                          spec->input, loom_dtype_name(input_dtype), loom_shape_str(input, a, sizeof a));
        loom_err_hint(err,
                      "add a cast map (dtype = \"float32\") or a scale map (scale = 0.00392156862745098, i.e. "
                      "1/255) for \"%s\" to the data transforms",
                      spec->input);
        goto fail;
    }
    if (spec->n_layers < 1 || spec->n_layers > LOOM_MAX_LAYERS) {
        rc = loom_err_set(err, LOOM_ESHAPE, m->where, "model has %d layers (expected 1 to %d)", spec->n_layers,
                          LOOM_MAX_LAYERS);
        goto fail;
    }
    if (max_batch < 1) {
        rc = loom_err_set(err, LOOM_ESHAPE, m->where, "max_batch = %lld, must be >= 1", (long long)max_batch);
        goto fail;
    }
    m->n_layers = spec->n_layers;
    loom_shape cur = *input;
    int has_params = 0;
    for (int i = 0; i < m->n_layers; i++) {
        nn_layer_ *l = &m->layer[i];
        l->spec = spec->layer[i];
        if (!l->spec.name[0]) snprintf(l->spec.name, sizeof l->spec.name, "%s_%d", nn_layer_kind_name_(l->spec.kind), i);
        nn_loc_str_(&l->spec.loc, l->where, sizeof l->where);
        if (!l->where[0]) snprintf(l->where, sizeof l->where, "%s", m->where);
        l->in = cur;
        if ((rc = layer_shapes(m, l, i, err))) goto fail;
        if (m->params_overflow) {
            rc = loom_err_set(err, LOOM_ECONFIG, l->where,
                              "layer \"%s\" (%s) takes the model past %d parameters (its input is %s)", l->spec.name,
                              nn_layer_kind_name_(l->spec.kind), INT_MAX, loom_shape_str(&l->in, a, sizeof a));
            loom_err_hint(err, "use fewer units or filters, or a smaller kernel");
            goto fail;
        }
        l->needs_dx = has_params;
        has_params |= l->kernel_off >= 0;
        cur = l->out;
    }
    if ((rc = check_loss(m, label, label_dtype, err))) goto fail;
    nn_layer_ *last = &m->layer[m->n_layers - 1];
    if (m->loss == LOOM_LOSS_SPARSE_SOFTMAX_CE && last->act == LOOM_ACT_SOFTMAX) last->act = LOOM_ACT_NONE;

    /* what the buffers below take, checked before any is allocated: a layer
     * or a batch that cannot fit is the config's error, not an allocation's */
    int64_t phys = loom_phys_bytes(), need = 0;
    if (!loom_mul_ok(m->n_params, 2 * (int64_t)sizeof(float), &need)) need = INT64_MAX;
    for (int i = 0; i < m->n_layers; i++) {
        nn_layer_ *l = &m->layer[i];
        int64_t act = 0;
        bool ok = loom_mul_ok(max_batch, l->n_out > l->n_in ? l->n_out : l->n_in, &act) &&
                  loom_mul_ok(act, 3 * (int64_t)sizeof(float), &act) && loom_add_ok(need, act, &need);
        if (!ok || need > phys) {
            char b[48];
            snprintf(b, sizeof b, ok ? "%lld" : "more than 2^63", (long long)need);
            rc = loom_err_set(err, LOOM_ECONFIG, l->where,
                              "layer \"%s\" (%s, output %s) needs %s bytes of parameters and activations for batch "
                              "%lld, more than this machine's %lld bytes of memory",
                              l->spec.name, nn_layer_kind_name_(l->spec.kind), loom_shape_str(&l->out, a, sizeof a), b,
                              (long long)max_batch, (long long)phys);
            loom_err_hint(err, "use fewer units or filters, or a smaller batch size");
            goto fail;
        }
    }

    /* buffers, all sized for max_batch */
    int64_t gmax = 1, colmax = 0;
    for (int i = 0; i < m->n_layers; i++) {
        nn_layer_ *l = &m->layer[i];
        gmax = l->n_in > gmax ? l->n_in : gmax;
        gmax = l->n_out > gmax ? l->n_out : gmax;
        loom_layer_kind k = l->spec.kind;
        int owns_y = k == LOOM_LAYER_DENSE || k == LOOM_LAYER_CONV2D || k == LOOM_LAYER_MAX_POOL2D ||
                     (k == LOOM_LAYER_DROPOUT && l->spec.rate > 0) || (k == LOOM_LAYER_ACTIVATION && l->act);
        if (owns_y && !(l->y = loom_alloc_aligned((size_t)(max_batch * l->n_out) * sizeof(float)))) goto nomem;
        if (k == LOOM_LAYER_MAX_POOL2D &&
            !(l->argmax = loom_alloc_aligned((size_t)(max_batch * l->n_out) * sizeof(int32_t))))
            goto nomem;
        if ((k == LOOM_LAYER_DENSE || k == LOOM_LAYER_CONV2D) && !(l->dz = loom_alloc_aligned((size_t)(max_batch * l->n_out) * sizeof(float))))
            goto nomem;
        if (k == LOOM_LAYER_DROPOUT && l->spec.rate > 0 && !(l->mask = loom_alloc_aligned((size_t)(max_batch * l->n_out))))
            goto nomem;
        if (k == LOOM_LAYER_CONV2D) {
            int64_t per = (int64_t)l->oh * l->ow * l->kh * l->kw * l->cin * (int64_t)sizeof(float);
            int64_t c = NN_COL_BYTES / per;
            l->chunk = (int)(c < 1 ? 1 : c > max_batch ? max_batch : c);
            int pointwise = l->kh == 1 && l->kw == 1 && l->sh == 1 && l->sw == 1 && l->pad_t == 0 && l->pad_l == 0;
            if (pointwise) l->chunk = (int)max_batch;
            else colmax = l->chunk * per / (int64_t)sizeof(float) > colmax ? l->chunk * per / (int64_t)sizeof(float)
                                                                           : colmax;
            /* cin = 1 runs direct (layers.c): a padded plane and a kernel-sized sum */
            int64_t direct = ((int64_t)(l->oh - 1) * l->sh + l->kh) * ((int64_t)(l->ow - 1) * l->sw + l->kw) +
                             (int64_t)l->kh * l->kw * l->cout;
            if (l->cin == 1 && !pointwise && direct > colmax) colmax = direct;
        }
    }
    size_t pbytes = (size_t)(m->n_params ? m->n_params : 1) * sizeof(float);
    if (!(m->params = loom_alloc_aligned(pbytes)) || !(m->grads = loom_alloc_aligned(pbytes))) goto nomem;
    memset(m->params, 0, pbytes);
    memset(m->grads, 0, pbytes);
    m->gmax = gmax;
    m->colmax = colmax;
    for (int k = 0; k < 2; k++)
        if (!(m->gbuf[k] = loom_alloc_aligned((size_t)(max_batch * gmax) * sizeof(float)))) goto nomem;
    if (!(m->labels = loom_alloc_aligned((size_t)max_batch * sizeof(int32_t)))) goto nomem;
    if ((rc = loom_model_set_threads(m, 1, err))) goto fail;
    *out = m;
    return LOOM_OK;
nomem:
    rc = loom_err_set(err, LOOM_ENOMEM, m->where, "cannot allocate the model's buffers for batch %lld",
                      (long long)max_batch);
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
        loom_free(m->layer[i].y);
        loom_free(m->layer[i].argmax);
        loom_free(m->layer[i].mask);
        loom_free(m->layer[i].dz);
    }
    free_chunks(m->pool, m->chunk, m->threads);
    loom_free(m->params);
    loom_free(m->grads);
    loom_free(m->gbuf[0]);
    loom_free(m->gbuf[1]);
    loom_free(m->labels);
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

void loom_model_summary(const loom_model *m, FILE *f)
{
    char a[96], b[112];
    fprintf(f, "%-32s %-22s %12s\n", "Layer (type)", "Output Shape", "Param #");
    fprintf(f, "%.*s\n", 68, "====================================================================");
    for (int i = 0; i < m->n_layers; i++) {
        const nn_layer_ *l = &m->layer[i];
        int64_t np = 0;
        for (int k = 0; k < m->n_ptensors; k++)
            if (m->pinfo[k].offset == l->kernel_off || m->pinfo[k].offset == l->bias_off)
                np += loom_shape_numel(&m->pinfo[k].shape);
        snprintf(b, sizeof b, "%s (%s)", l->spec.name, nn_layer_kind_name_(l->spec.kind));
        loom_shape_str(&l->out, a, sizeof a);
        char ob[120];
        snprintf(ob, sizeof ob, "(None, %s", a + 1);
        if (l->out.rank == 1) snprintf(ob, sizeof ob, "(None, %lld)", (long long)l->out.dim[0]);
        fprintf(f, "%-32s %-22s %12lld\n", b, ob, (long long)np);
    }
    fprintf(f, "%.*s\n", 68, "====================================================================");
    fprintf(f, "Total params: %lld (%.2f KB)\n", (long long)m->n_params, (double)m->n_params * 4 / 1024);
}

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
        default:
            memset(p, 0, (size_t)n * sizeof *p);
            break;
        }
    }
}

/* ---- steps ------------------------------------------------------------------ */

int nn_check_batch_(loom_model *m, const loom_tensor *x, const loom_tensor *label, int64_t *B, loom_err *err)
{
    char a[96], b[96];
    if (x->dtype != LOOM_F32)
        return loom_err_set(err, LOOM_ESHAPE, m->where, "input batch is %s, the model needs float32",
                            loom_dtype_name(x->dtype)),
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
    if (m->loss == LOOM_LOSS_MSE && label->dtype != LOOM_F32)
        return loom_err_set(err, LOOM_ESHAPE, m->where, "mean_squared_error needs float32 labels, got %s",
                            loom_dtype_name(label->dtype));
    return LOOM_OK;
}

#define LABEL_LOOP(T)                                                                            \
    do {                                                                                         \
        const T *v = label->data;                                                                \
        for (int64_t b = 0; b < B; b++) {                                                        \
            if (!((double)v[b] >= 0 && (double)v[b] < (double)n && (double)v[b] == (double)(int64_t)v[b])) \
                return bad_label(err, m, b, (double)v[b], n);                                    \
            m->labels[b] = (int32_t)v[b];                                                        \
        }                                                                                        \
    } while (0)

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
    switch (label->dtype) {
    case LOOM_U8: LABEL_LOOP(uint8_t); break;
    case LOOM_I32: LABEL_LOOP(int32_t); break;
    case LOOM_I64: LABEL_LOOP(int64_t); break;
    case LOOM_F32: LABEL_LOOP(float); break;
    case LOOM_F64: LABEL_LOOP(double); break;
    default: return loom_err_set(err, LOOM_ESHAPE, m->where, "label dtype %d is not known", (int)label->dtype);
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
    uint64_t           rng_key;
    float             *out;       /* predict: (B, n) */
    int64_t            B;         /* examples in the batch */
    int                nchunks;   /* chunks of the batch, and parts of the gradient pass */
} step_job;

/* The three phases of a chunk's step. chunk_step runs them back to back;
 * loom_model_forward / _loss / _backward run one each over all chunks, and
 * since a phase reads only what the previous one left in the chunk's own
 * rows and buffers, the result is the same bit for bit. */
static void chunk_forward(const step_job *j, nn_chunk_ *c)
{
    const loom_model *m = j->m;
    c->act[0] = j->x + c->b0 * m->layer[0].n_in;
    for (int i = 0; i < m->n_layers; i++) nn_layer_forward_(m, i, c, j->kind == JOB_TRAIN, j->rng_key);
}

/* The loss of the chunk's outputs and, for a train step, its gradient into gbuf[0]. */
static void chunk_loss(const step_job *j, nn_chunk_ *c)
{
    const loom_model *m = j->m;
    const int64_t n = m->layer[m->n_layers - 1].n_out;
    const float *z = c->act[m->n_layers];
    float *g = j->kind == JOB_TRAIN ? c->gbuf[0] : NULL;
    if (m->loss == LOOM_LOSS_SPARSE_SOFTMAX_CE)
        c->loss = nn_loss_sparse_ce_(z, m->labels + c->b0, c->B, n, j->inv_gb, g, &c->correct);
    else
        c->loss = nn_loss_mse_(z, (const float *)j->label->data + c->b0 * n, c->B, n, j->inv_gb, g, &c->correct);
}

/* The index of layer i's first parameter tensor (its kernel), or -1. */
static int first_tensor(const loom_model *m, const nn_layer_ *l)
{
    for (int t = 0; t < m->n_ptensors && l->kernel_off >= 0; t++)
        if (m->pinfo[t].offset == l->kernel_off) return t;
    return -1;
}

static void layer_param_grads(const step_job *j, int i, int part, int parts)
{
    const loom_model *m = j->m;
    const nn_layer_ *l = &m->layer[i];
    /* chunk 0 starts at example 0: its input pointer is the whole batch's */
    if (l->spec.kind == LOOM_LAYER_DENSE) nn_dense_param_grads_(m, i, m->chunk[0].act[i], j->B, part, parts);
    else nn_conv_param_grads_(m, i, m->chunk[0].act[i], j->B, part, parts, m->chunk[part].col);
}

/* with_hook: one chunk (the whole batch) and a gradient hook: each layer's
 * kernel and bias gradients right after its backward, then the hook. */
static void chunk_backward_(const step_job *j, nn_chunk_ *c, bool with_hook)
{
    const loom_model *m = j->m;
    float *g = c->gbuf[0], *other = c->gbuf[1];
    /* a non-finite loss fails the step (the caller checks the sum), so its gradient is never used */
    if (!isfinite(c->loss)) return;
    for (int i = m->n_layers - 1; i >= 0; i--) {
        const nn_layer_ *l = &m->layer[i];
        if (!l->needs_dx && l->kernel_off < 0) break;
        float *r = nn_layer_backward_(m, i, c, g, other);
        if (with_hook && l->kernel_off >= 0) {
            layer_param_grads(j, i, 0, 1);
            m->grad_hook(m->grad_hook_arg, first_tensor(m, l));
        }
        if (!r) break;
        if (r == other) {
            other = g;
            g = r;
        }
    }
}

static void chunk_backward(const step_job *j, nn_chunk_ *c) { chunk_backward_(j, c, false); }

static void chunk_step(void *arg, int t)
{
    step_job *j = arg;
    loom_model *m = j->m;
    nn_chunk_ *c = &m->chunk[t];
    chunk_forward(j, c);
    if (j->kind == JOB_PREDICT) {
        const int64_t n = m->layer[m->n_layers - 1].n_out;
        const float *z = c->act[m->n_layers];
        float *out = j->out + c->b0 * n;
        if (m->loss == LOOM_LOSS_SPARSE_SOFTMAX_CE) nn_softmax_rows_(z, out, c->B, n);
        else memcpy(out, z, (size_t)(c->B * n) * sizeof *out);
        return;
    }
    chunk_loss(j, c);
    if (j->kind == JOB_TRAIN) chunk_backward_(j, c, j->nchunks == 1 && m->grad_hook);
}

static void part_forward(void *arg, int t) { step_job *j = arg; chunk_forward(j, &j->m->chunk[t]); }
static void part_loss(void *arg, int t) { step_job *j = arg; chunk_loss(j, &j->m->chunk[t]); }
static void part_backward(void *arg, int t) { step_job *j = arg; chunk_backward(j, &j->m->chunk[t]); }

/* Part t of the gradients that wait for all chunks: dense and conv layers'
 * kernel rows and bias columns, each over the whole batch, so no gradient
 * element is a sum split at chunk boundaries: the same bits for any number
 * of threads. */
static void grad_part(void *arg, int t)
{
    const step_job *j = arg;
    const loom_model *m = j->m;
    for (int i = 0; i < m->n_layers; i++)
        if (m->layer[i].kernel_off >= 0) layer_param_grads(j, i, t, j->nchunks);
}

/* With a gradient hook and several chunks: the whole-batch gradient pass of
 * one layer (job->layer), split among the threads as grad_part splits it. */
typedef struct layer_job {
    const step_job *j;
    int             layer;
} layer_job;

static void grad_part_layer(void *arg, int t)
{
    const layer_job *lj = arg;
    layer_param_grads(lj->j, lj->layer, t, lj->j->nchunks);
}

/* Runs job over the batch's chunks, one per thread, and sums their results
 * in chunk order; a train step then finishes the gradients (grad_part). */
static void run_chunks(loom_model *m, step_job *j, int64_t B, double *loss, int64_t *correct)
{
    j->m = m;
    j->B = B;
    j->nchunks = split_batch(m, B);
    m->part_done = 0; /* the chunks' buffers no longer hold a step in parts */
    loom_pool_run(m->pool, j->nchunks, chunk_step, j);
    double l = 0;
    int64_t ok = 0;
    for (int t = 0; t < j->nchunks; t++) {
        l += m->chunk[t].loss;
        ok += m->chunk[t].correct;
    }
    if (loss) *loss = l;
    if (correct) *correct = ok;
    if (j->kind != JOB_TRAIN || !isfinite(l)) return;
    if (!m->grad_hook) {
        loom_pool_run(m->pool, j->nchunks, grad_part, j);
        return;
    }
    if (j->nchunks > 1) /* last layer first, the hook after each */
        for (int i = m->n_layers - 1; i >= 0; i--) {
            if (m->layer[i].kernel_off < 0) continue;
            layer_job lj = {j, i};
            loom_pool_run(m->pool, j->nchunks, grad_part_layer, &lj);
            m->grad_hook(m->grad_hook_arg, first_tensor(m, &m->layer[i]));
        }
    m->grad_hook(m->grad_hook_arg, 0); /* every gradient is final (layers without parameters below) */
}

void loom_model_set_grad_hook(loom_model *m, loom_grad_ready_fn fn, void *arg)
{
    m->grad_hook = fn;
    m->grad_hook_arg = arg;
}

int loom_model_train_step(loom_model *m, const loom_tensor *x, const loom_tensor *label, int64_t global_batch,
                          uint64_t rng_key, double *loss_sum, int64_t *correct, loom_err *err)
{
    int64_t B;
    int rc;
    if ((rc = nn_check_batch_(m, x, label, &B, err))) return rc;
    if (m->loss == LOOM_LOSS_SPARSE_SOFTMAX_CE && (rc = nn_read_labels_(m, label, B, err))) return rc;
    if (global_batch < 1) global_batch = B;
    step_job j = {.kind = JOB_TRAIN, .x = x->data, .label = label, .inv_gb = (float)(1.0 / (double)global_batch),
                  .rng_key = rng_key};
    double loss;
    run_chunks(m, &j, B, &loss, correct);
    if (loss_sum) *loss_sum = loss;
    return isfinite(loss) ? LOOM_OK : nn_loss_error_(m, loss, B, err);
}

/* ---- a train step in parts ------------------------------------------------ */

int loom_model_forward(loom_model *m, const loom_tensor *x, uint64_t rng_key, loom_err *err)
{
    int64_t B;
    int rc;
    m->part_done = 0;
    if ((rc = nn_check_batch_(m, x, NULL, &B, err))) return rc;
    step_job j = {.m = m, .kind = JOB_TRAIN, .x = x->data, .rng_key = rng_key, .B = B};
    j.nchunks = split_batch(m, B);
    for (int t = 0; t < j.nchunks; t++) m->chunk[t].loss = 0;
    loom_pool_run(m->pool, j.nchunks, part_forward, &j);
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
    if (m->loss == LOOM_LOSS_SPARSE_SOFTMAX_CE && (rc = nn_read_labels_(m, label, B, err))) return rc;
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
    if (loss_sum) *loss_sum = l;
    if (correct) *correct = ok;
    if (!isfinite(l))
        return loom_err_set(err, LOOM_ENUMERIC, m->where, "the loss is %g on a batch of %lld examples", l, (long long)B);
    m->part_done = 2;
    return LOOM_OK;
}

int loom_model_backward(loom_model *m, loom_err *err)
{
    if (m->part_done < 2)
        return loom_err_set(err, LOOM_EUSAGE, m->where, "backward needs the loss of a forward pass first");
    step_job j = {.m = m, .kind = JOB_TRAIN, .B = m->part_B};
    j.nchunks = j.B < m->threads ? (int)j.B : m->threads;
    loom_pool_run(m->pool, j.nchunks, part_backward, &j);
    loom_pool_run(m->pool, j.nchunks, grad_part, &j);
    m->part_done = 0;
    return LOOM_OK;
}

int loom_model_evaluate(loom_model *m, const loom_tensor *x, const loom_tensor *label, double *loss_sum,
                        int64_t *correct, loom_err *err)
{
    int64_t B;
    int rc;
    if ((rc = nn_check_batch_(m, x, label, &B, err))) return rc;
    if (m->loss == LOOM_LOSS_SPARSE_SOFTMAX_CE && (rc = nn_read_labels_(m, label, B, err))) return rc;
    step_job j = {.kind = JOB_EVAL, .x = x->data, .label = label, .inv_gb = 1.f};
    run_chunks(m, &j, B, loss_sum, correct);
    return LOOM_OK;
}

int loom_model_predict(loom_model *m, const loom_tensor *x, float *out, loom_err *err)
{
    int64_t B;
    int rc;
    if ((rc = nn_check_batch_(m, x, NULL, &B, err))) return rc;
    step_job j = {.kind = JOB_PREDICT, .x = x->data, .out = out};
    run_chunks(m, &j, B, NULL, NULL);
    return LOOM_OK;
}
