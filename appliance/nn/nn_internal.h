/* nn_internal.h - the model's private layout shared by model.c and layers.c.
 * A layer is a small record of its resolved geometry plus the buffers it owns
 * (output activations, pooling argmax, dropout mask), all sized for max_batch
 * at loom_model_new so a step never allocates. Not thread-safe: one model,
 * one thread at a time. */
#ifndef LOOM_NN_INTERNAL_H
#define LOOM_NN_INTERNAL_H

#include "nn.h"

typedef struct nn_layer_ {
    loom_layer_spec spec;          /* copied from the model spec */
    char            where[LOOM_PATH_MAX + 16]; /* "file:line" of the layer, for errors */
    loom_shape      in, out;       /* per example */
    int64_t         n_in, n_out;   /* elements per example */
    loom_activation act;           /* applied after the layer's op; a softmax fused into the loss becomes NONE */
    int64_t         kernel_off;    /* into params/grads, -1 when absent */
    int64_t         bias_off;      /* -1 when absent (use_bias = false or no parameters) */
    int             needs_dx;      /* some earlier layer has parameters, so the input gradient is needed */
    /* conv2d, max_pool2d geometry */
    int ih, iw, cin, oh, ow, cout, kh, kw, sh, sw, pad_t, pad_l;
    int chunk;                     /* conv2d: examples per im2col chunk */
    float         *y;              /* (max_batch, n_out) owned output; NULL for flatten */
    const float   *x;              /* (B, n_in) this step's input (borrowed) */
    const float   *yout;           /* (B, n_out) this step's output: y, or x for flatten / dropout off */
    int32_t       *argmax;         /* max_pool2d: (max_batch, n_out) input index within the example */
    uint8_t       *mask;           /* dropout: (max_batch, n_out) 1 = kept */
} nn_layer_;

struct loom_model {
    int              n_layers;
    nn_layer_        layer[LOOM_MAX_LAYERS];
    loom_loss_kind   loss;
    char             where[LOOM_PATH_MAX + 16]; /* the model block's file:line */
    loom_shape       input, label;  /* per example */
    loom_dtype       label_dtype;
    int64_t          max_batch;
    int64_t          n_params;
    float           *params, *grads; /* (P,) each, 64-byte aligned */
    int              n_ptensors;
    loom_param_info  pinfo[2 * LOOM_MAX_LAYERS];
    int              pinit[2 * LOOM_MAX_LAYERS];   /* loom_init of each tensor (bias: zeros) */
    double           pfan_in[2 * LOOM_MAX_LAYERS], pfan_out[2 * LOOM_MAX_LAYERS];
    float           *gbuf[2];       /* ping-pong gradient buffers, (max_batch, max n) each */
    float           *col;           /* im2col scratch, largest conv chunk */
    int32_t         *labels;        /* (max_batch,) sparse labels converted to int */
    double           flops;         /* forward, per example */
};

/* ---- kernels (layers.c) ------------------------------------------------- */

const char *nn_loc_str_(const loom_loc *l, char *buf, size_t n);
const char *nn_layer_kind_name_(loom_layer_kind k);
const char *nn_activation_name_(loom_activation a);

/* Forward of layer l on B examples from x (the previous output). training
 * switches dropout on; rng_key seeds it. */
void nn_layer_forward_(loom_model *m, nn_layer_ *l, int li, const float *x, int64_t B, int training, uint64_t rng_key);
/* Backward of layer l: g holds d(loss)/d(output) (B, n_out) and may be
 * overwritten; writes parameter gradients and, when l->needs_dx, the input
 * gradient into *gx (either g itself for element-wise layers or other).
 * Returns the buffer holding the input gradient. */
float *nn_layer_backward_(loom_model *m, nn_layer_ *l, float *g, float *other, int64_t B);

/* Loss on the final outputs z (B, n): per-example loss sum, correct count, and
 * (when g is not NULL) d(sum loss)/dz * inv_gb into g. */
double nn_loss_sparse_ce_(const float *z, const int32_t *labels, int64_t B, int64_t n, float inv_gb, float *g,
                          int64_t *correct);
double nn_loss_mse_(const float *z, const float *t, int64_t B, int64_t n, float inv_gb, float *g, int64_t *correct);
void   nn_softmax_rows_(const float *z, float *p, int64_t B, int64_t n);

#endif
