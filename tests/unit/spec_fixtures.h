/* spec_fixtures.h - the layer-spec builders and the model-spec fixture the nn
 * unit tests share (nn_fixtures.h, test_embed.c, test_tasks.c, test_seq.c):
 * one builder per layer kind, and mk(), a model spec from a layer array with
 * its file:line provenance filled, in one static buffer that a test may then
 * adjust field by field. Included by one test file per executable; all static. */
#ifndef LOOM_SPEC_FIXTURES_H
#define LOOM_SPEC_FIXTURES_H

#include "nn/nn.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

static inline loom_layer_spec L_dense(int units, loom_activation a)
{
    loom_layer_spec s = {0};
    s.kind = LOOM_LAYER_DENSE;
    s.units = units;
    s.activation = a;
    s.kernel_init = LOOM_INIT_GLOROT_UNIFORM;
    s.use_bias = true;
    return s;
}

static inline loom_layer_spec L_conv(int filters, int k, int stride, loom_padding p, loom_activation a)
{
    loom_layer_spec s = {0};
    s.kind = LOOM_LAYER_CONV2D;
    s.filters = filters;
    s.kernel[0] = s.kernel[1] = k;
    s.stride[0] = s.stride[1] = stride;
    s.padding = p;
    s.activation = a;
    s.kernel_init = LOOM_INIT_GLOROT_UNIFORM;
    s.use_bias = true;
    return s;
}

static inline loom_layer_spec L_pool(int k, int stride, loom_padding p)
{
    loom_layer_spec s = {0};
    s.kind = LOOM_LAYER_MAX_POOL2D;
    s.pool[0] = s.pool[1] = k;
    s.stride[0] = s.stride[1] = stride;
    s.padding = p;
    return s;
}

/* A layer with no shape of its own: dropout (rate), activation, flatten, ... */
static inline loom_layer_spec L_kind(loom_layer_kind k, double rate, loom_activation a)
{
    loom_layer_spec s = {0};
    s.kind = k;
    s.rate = rate;
    s.activation = a;
    return s;
}

static inline loom_layer_spec L_flat(void) { return L_kind(LOOM_LAYER_FLATTEN, 0, LOOM_ACT_NONE); }

/* An embedding named "emb" of rows x dim; sequence tests set mask_zero on it. */
static inline loom_layer_spec L_emb(int64_t rows, int dim, loom_combiner comb)
{
    loom_layer_spec s = {0};
    s.kind = LOOM_LAYER_EMBEDDING;
    s.input_dim = rows;
    s.output_dim = dim;
    s.combiner = comb;
    snprintf(s.name, sizeof s.name, "emb");
    return s;
}

static loom_model_spec spec_buf __attribute__((unused));

/* The model spec of test.cfg: the model at line 5, layer i at line 10 + i,
 * input "image" and label "label"; callers adjust spec_buf after. */
static inline loom_model_spec *mk(loom_loss_kind loss, int n, const loom_layer_spec *layers)
{
    memset(&spec_buf, 0, sizeof spec_buf);
    snprintf(spec_buf.loc.file, sizeof spec_buf.loc.file, "test.cfg");
    spec_buf.loc.line = 5;
    spec_buf.loss = loss;
    spec_buf.n_layers = n;
    snprintf(spec_buf.input, sizeof spec_buf.input, "image");
    snprintf(spec_buf.label, sizeof spec_buf.label, "label");
    for (int i = 0; i < n; i++) {
        spec_buf.layer[i] = layers[i];
        snprintf(spec_buf.layer[i].loc.file, sizeof spec_buf.layer[i].loc.file, "test.cfg");
        spec_buf.layer[i].loc.line = 10 + i;
    }
    return &spec_buf;
}

#endif
