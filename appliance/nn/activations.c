/* activations.c - the activations whose gradients read their input (Keras's
 * definitions): swish (silu) x sigmoid(x), hard_swish x relu6(x + 3) / 6,
 * softplus log(1 + e^x) (stable: max(x, 0) + log1p(e^-|x|)) and elu
 * (alpha 1) x > 0 ? x : e^x - 1. A dense or convolution layer with one of
 * them keeps its pre-activation in its dz rows (nn_layer_act_), an
 * activation layer reads its input; both then call nn_act_grad_x_.
 * Element-wise, one pass each; nothing allocates. */
#include "nn_internal.h"

#include <math.h>

bool nn_act_needs_x_(loom_activation a)
{
    return a == LOOM_ACT_SWISH || a == LOOM_ACT_HARD_SWISH || a == LOOM_ACT_SOFTPLUS || a == LOOM_ACT_ELU;
}

static inline float sigm(float x) { return 1.f / (1.f + expf(-x)); }

void nn_act_apply_(loom_activation a, const float *x, float *y, int64_t n)
{
    switch (a) {
    case LOOM_ACT_SWISH:
        for (int64_t e = 0; e < n; e++) y[e] = x[e] * sigm(x[e]);
        break;
    case LOOM_ACT_HARD_SWISH:
        for (int64_t e = 0; e < n; e++) {
            float r = x[e] + 3.f;
            r = r < 0.f ? 0.f : r > 6.f ? 6.f : r;
            y[e] = x[e] * r / 6.f;
        }
        break;
    case LOOM_ACT_SOFTPLUS:
        for (int64_t e = 0; e < n; e++) {
            float v = x[e];
            y[e] = (v > 0.f ? v : 0.f) + log1pf(expf(-fabsf(v)));
        }
        break;
    case LOOM_ACT_ELU:
        for (int64_t e = 0; e < n; e++) y[e] = x[e] > 0.f ? x[e] : expm1f(x[e]);
        break;
    default:
        break;
    }
}

/* The derivatives: swish s + x s (1 - s); hard_swish 0 below -3, 1 from 3,
 * (2x + 3) / 6 between (relu6's gradient is 0 at its corners, as TF's);
 * softplus sigmoid(x); elu 1 above 0, e^x at and below. */
void nn_act_grad_x_(loom_activation a, const float *x, const float *g, float *dz, int64_t n)
{
    switch (a) {
    case LOOM_ACT_SWISH:
        for (int64_t e = 0; e < n; e++) {
            float v = x[e], s = sigm(v);
            dz[e] = g[e] * (s + v * s * (1.f - s));
        }
        break;
    case LOOM_ACT_HARD_SWISH:
        for (int64_t e = 0; e < n; e++) {
            float v = x[e];
            dz[e] = g[e] * (v <= -3.f ? 0.f : v >= 3.f ? 1.f : (2.f * v + 3.f) / 6.f);
        }
        break;
    case LOOM_ACT_SOFTPLUS:
        for (int64_t e = 0; e < n; e++) dz[e] = g[e] * sigm(x[e]);
        break;
    case LOOM_ACT_ELU:
        for (int64_t e = 0; e < n; e++) dz[e] = g[e] * (x[e] > 0.f ? 1.f : expf(x[e]));
        break;
    default:
        for (int64_t e = 0; e < n; e++) dz[e] = g[e];
        break;
    }
}
