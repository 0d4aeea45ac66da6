/* recurrent.c - lstm, gru and bidirectional layers over (B, T, D) inputs.
 * Threads: the forward and backward run per chunk on the chunk's rows; the
 * parameter gradients once over the whole batch (nn_rnn_param_grads_). */
#include "nn_internal.h"

#include <math.h>
#include <string.h>

bool nn_is_rnn_kind_(loom_layer_kind k)
{
    return k == LOOM_LAYER_LSTM || k == LOOM_LAYER_GRU || k == LOOM_LAYER_BIDIRECTIONAL;
}

int nn_rnn_shapes_(loom_model *m, nn_layer_ *l, int li, loom_err *err)
{
    (void)m, (void)li;
    return loom_err_set(err, LOOM_EUNSUPPORTED, l->where, "layer \"%s\": %s is not built yet", l->spec.name,
                        nn_layer_kind_name_(l->spec.kind));
}

bool nn_rnn_buffers_(nn_layer_ *l, int64_t max_batch)
{
    (void)l, (void)max_batch;
    return true;
}

void nn_rnn_forward_(const loom_model *m, int li, nn_chunk_ *c) { (void)m, (void)li, (void)c; }

float *nn_rnn_backward_(const loom_model *m, int li, nn_chunk_ *c, float *g, float *other)
{
    (void)m, (void)li, (void)c, (void)g, (void)other;
    return NULL;
}

void nn_rnn_param_grads_(const loom_model *m, int li, const float *x, int64_t B, int part, int parts)
{
    (void)m, (void)li, (void)x, (void)B, (void)part, (void)parts;
}
