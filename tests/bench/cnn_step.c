/* cnn_step.c - train steps of the Fashion-MNIST CNN (or, with -m mlp, the
 * MLP) on synthetic data, in process, for instruction counts of the kernels
 * under callgrind and for A/B timings of two builds on a busy machine:
 *
 *   valgrind --tool=callgrind build/tests/bench/cnn_step [-b 16] [-s 1] [-t 1]
 *   callgrind_annotate callgrind.out.<pid> | grep layers.c
 *   build/tests/bench/cnn_step -b 128 -s 30 -t 2 [-m mlp] [-o after|in]
 *
 * -o times the optimizer in the step (momentum 0.9, Nesterov, lr 0.1, as
 * configs/fashion_mnist_mlp.cfg): "after" the step (loom_optimizer_apply on
 * the model's threads), "in" it (loom_model_train_step_update, each layer
 * updated after its gradients), the same bits; without -o an untimed plain
 * SGD update follows each step.
 *
 * Prints the mean, median and fastest wall time per step (the fastest is
 * the one other processes disturbed least: compare two builds by it, runs
 * alternated) and a CRC-32C of the gradients and parameters after the
 * steps, so a change meant to keep the bits can be checked to keep them.
 * The architectures are configs/fashion_mnist_cnn.cfg's and _mlp.cfg's. */
#include "nn/nn.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static loom_layer_spec layer(loom_layer_kind k)
{
    loom_layer_spec s = {0};
    s.kind = k;
    s.kernel_init = LOOM_INIT_GLOROT_UNIFORM;
    s.use_bias = true;
    s.stride[0] = s.stride[1] = 1;
    return s;
}

int main(int argc, char **argv)
{
    int B = 16, steps = 1, threads = 1, mlp = 0, opt = 0; /* opt: 0 none, 1 after, 2 in */
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "-b")) B = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-s")) steps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-t")) threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-m")) mlp = !strcmp(argv[i + 1], "mlp");
        else if (!strcmp(argv[i], "-o")) opt = !strcmp(argv[i + 1], "after") ? 1 : !strcmp(argv[i + 1], "in") ? 2 : -1;
    }
    if (B < 1 || steps < 1 || threads < 1 || opt < 0) {
        fprintf(stderr, "usage: cnn_step [-b batch] [-s steps] [-t threads] [-m cnn|mlp] [-o after|in]\n");
        return 2;
    }
    loom_model_spec spec = {0};
    snprintf(spec.input, sizeof spec.input, "image");
    snprintf(spec.label, sizeof spec.label, "label");
    spec.loss = LOOM_LOSS_SPARSE_SOFTMAX_CE;
    loom_layer_spec *L = spec.layer;
    for (int c = 0; c < 2; c++) {
        L[3 * c] = layer(LOOM_LAYER_CONV2D);
        L[3 * c].filters = c ? 64 : 32;
        L[3 * c].kernel[0] = L[3 * c].kernel[1] = 5;
        L[3 * c].padding = LOOM_PAD_SAME;
        L[3 * c].activation = LOOM_ACT_RELU;
        L[3 * c + 1] = layer(LOOM_LAYER_MAX_POOL2D);
        L[3 * c + 1].pool[0] = L[3 * c + 1].pool[1] = 2;
        L[3 * c + 1].stride[0] = L[3 * c + 1].stride[1] = 2;
        L[3 * c + 2] = layer(LOOM_LAYER_FLATTEN);
    }
    /* conv pool conv pool flatten dense(128) dropout dense(10): the flatten after the first pool is replaced */
    L[2] = L[3], L[3] = L[4];
    L[4] = layer(LOOM_LAYER_FLATTEN);
    L[5] = layer(LOOM_LAYER_DENSE);
    L[5].units = 128;
    L[5].activation = LOOM_ACT_RELU;
    L[6] = layer(LOOM_LAYER_DROPOUT);
    L[6].rate = 0.4;
    L[7] = layer(LOOM_LAYER_DENSE);
    L[7].units = 10;
    spec.n_layers = 8;
    if (mlp) { /* flatten, dense 256 relu, dense 128 relu, dense 10 */
        L[0] = layer(LOOM_LAYER_FLATTEN);
        for (int k = 1; k < 4; k++) {
            L[k] = layer(LOOM_LAYER_DENSE);
            L[k].units = k == 1 ? 256 : k == 2 ? 128 : 10;
            L[k].activation = k < 3 ? LOOM_ACT_RELU : LOOM_ACT_NONE;
        }
        spec.n_layers = 4;
    }

    loom_err err = {0};
    int64_t in_d[3] = {28, 28, 1};
    loom_shape in = loom_shape_make(3, in_d), lab = loom_shape_make(0, in_d);
    loom_model *m = NULL;
    if (loom_blas_init(1, &err) || loom_model_new(&m, &spec, &in, LOOM_F32, &lab, LOOM_I32, B, &err) ||
        loom_model_set_threads(m, threads, &err)) {
        fprintf(stderr, "cnn_step: %s: %s\n", err.where, err.msg);
        return 1;
    }
    loom_model_init_params(m, 7);
    loom_optimizer *o = NULL;
    loom_optimizer_spec os = {.kind = LOOM_OPT_MOMENTUM, .learning_rate = 0.1, .momentum = 0.9, .nesterov = true};
    if (opt && loom_optimizer_new(&o, &os, loom_model_num_params(m), &err)) {
        fprintf(stderr, "cnn_step: %s\n", err.msg);
        return 1;
    }
    if (o) loom_optimizer_set_pool(o, loom_model_pool(m));
    int64_t xd[4] = {B, 28, 28, 1}, yd[1] = {B};
    loom_tensor x = {0}, y = {0};
    loom_shape xs = loom_shape_make(4, xd), ys = loom_shape_make(1, yd);
    if (loom_tensor_init(&x, LOOM_F32, &xs, &err) || loom_tensor_init(&y, LOOM_I32, &ys, &err)) {
        fprintf(stderr, "cnn_step: %s\n", err.msg);
        return 1;
    }
    float *xp = x.data;
    int32_t *yp = y.data;
    uint32_t h = 12345;
    for (int64_t i = 0; i < (int64_t)B * 784; i++) {
        h = h * 1664525u + 1013904223u;
        xp[i] = (float)(h >> 8) / 16777216.0f;
    }
    for (int b = 0; b < B; b++) yp[b] = b % 10;
    double loss = 0, t0 = loom_now();
    int64_t correct;
    double *ts = calloc((size_t)steps, sizeof *ts);
    for (int s = 0; s < steps; s++) {
        double ts0 = loom_now();
        bool applied = false;
        int rc = opt == 2 ? loom_model_train_step_update(m, &x, &y, B, (uint64_t)s, o, s, &loss, &correct, &applied, &err)
                          : loom_model_train_step(m, &x, &y, B, (uint64_t)s, &loss, &correct, &err);
        if (rc) {
            fprintf(stderr, "cnn_step: %s\n", err.msg);
            return 1;
        }
        if (o && !applied) loom_optimizer_apply(o, loom_model_params(m), loom_model_grads(m), s);
        ts[s] = loom_now() - ts0;
        if (o) continue;
        float *p = loom_model_params(m);
        const float *g = loom_model_grads(m);
        for (int64_t i = 0; i < loom_model_num_params(m); i++) p[i] -= 0.01f * g[i];
    }
    double dt = (loom_now() - t0) / steps;
    for (int a = 1; a < steps; a++) /* insertion sort: a few hundred steps at most */
        for (int k = a; k > 0 && ts[k] < ts[k - 1]; k--) {
            double t = ts[k];
            ts[k] = ts[k - 1], ts[k - 1] = t;
        }
    size_t nb = (size_t)loom_model_num_params(m) * sizeof(float);
    printf("cnn_step: %s batch %d, %d thread(s), %d step(s): %.3f ms/step (median %.3f, fastest %.3f), loss %.6f, "
           "crc32c grads %08x params %08x\n", mlp ? "mlp" : "cnn", B, threads, steps, dt * 1e3, ts[steps / 2] * 1e3,
           ts[0] * 1e3, loss, loom_crc32c(loom_model_grads(m), nb), loom_crc32c(loom_model_params(m), nb));
    free(ts);
    loom_optimizer_free(o);
    loom_tensor_fini(&x);
    loom_tensor_fini(&y);
    loom_model_free(m);
    return 0;
}
