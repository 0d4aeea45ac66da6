/* nn.h - layers, losses, metrics, optimizers and learning-rate schedules.
 *
 * A model is a chain of layers built from a loom_model_spec. All parameters
 * of a model live in one flat float buffer and all gradients in another, in
 * layer order (each layer: kernel, then bias), so reducing, applying or
 * saving them is one contiguous operation. Activations are NHWC for images.
 *
 * Loss convention (tf.distribute): a step computes the SUM of per-example
 * losses of its (per-replica) batch and the gradient of that sum divided by
 * the GLOBAL batch size, so N replicas' gradients add up to one device's.
 *
 * Threads: a model is used by one thread at a time. Inside a step it may use
 * more (loom_model_set_threads): the batch is split into one chunk of
 * contiguous examples per thread, each chunk runs forward and backward with
 * single-threaded BLAS; then dense layers' parameter gradients are computed
 * once over the whole batch, split by kernel rows across the threads, and
 * the chunks' conv gradients, losses and counts are summed in chunk order.
 * So a step is deterministic for a given thread count and differs between
 * thread counts only by float summation order.
 * Randomness (dropout) is keyed by (seed, step, replica) given to each call
 * and by the example's position in the batch, never by the chunking. */
#ifndef LOOM_NN_H
#define LOOM_NN_H

#include "config/config.h"
#include "tensor/device.h"
#include "tensor/tensor.h"

typedef struct loom_model loom_model;

/* One named parameter tensor inside the flat buffer. */
typedef struct loom_param_info {
    char       name[96];   /* "dense_1/kernel", "conv2d_0/bias" */
    int64_t    offset;     /* in floats, into params/grads */
    loom_shape shape;      /* dense kernel (in, out); conv kernel (kh, kw, cin, cout); bias (out,) */
} loom_param_info;

/* Builds the model for inputs of shape `input` (per example, no batch dim;
 * must be float32) and targets `label` (per example: an integer scalar for
 * sparse softmax cross-entropy, float32 of the output's shape for MSE), for
 * batches of up to max_batch examples. Shape mismatches between layers, or
 * between the data and the model, are LOOM_ESHAPE naming the layer's
 * file:line and both shapes. Free with loom_model_free. */
int  loom_model_new(loom_model **out, const loom_model_spec *spec, const loom_shape *input, loom_dtype input_dtype,
                    const loom_shape *label, loom_dtype label_dtype, int64_t max_batch, loom_err *err);
void loom_model_free(loom_model *m); /* NULL is a no-op */

int64_t      loom_model_num_params(const loom_model *m);
float       *loom_model_params(loom_model *m);  /* (P,) borrowed */
float       *loom_model_grads(loom_model *m);   /* (P,) borrowed */
int          loom_model_num_param_tensors(const loom_model *m);
const loom_param_info *loom_model_param_tensor(const loom_model *m, int i);
loom_shape   loom_model_output_shape(const loom_model *m); /* per example */
/* FLOPs of one example's forward pass (multiply-add = 2). */
double       loom_model_forward_flops(const loom_model *m);
/* Prints a Keras-like summary: layer, output shape, parameters. */
void         loom_model_summary(const loom_model *m, FILE *f);

/* Sets the threads a step uses (0 = all cores; at most max_batch) and
 * preallocates their buffers: an im2col scratch each and, for all but the
 * first, a gradient buffer of the model's size when the model has conv
 * layers (dense gradients are whole-batch). The default is 1. With more
 * than 1 this also sets BLAS to 1 thread (loom_blas_set_threads, a process-
 * wide setting), since the model's threads call BLAS concurrently and BLAS
 * threads on top would oversubscribe the cores. On failure (LOOM_ENOMEM) the
 * model keeps its previous setting. */
int  loom_model_set_threads(loom_model *m, int threads, loom_err *err);
int  loom_model_threads(const loom_model *m);
/* The pool of the model's threads, borrowed until the next set_threads or
 * free; NULL with 1 thread. For loom_optimizer_set_pool. */
loom_pool *loom_model_pool(loom_model *m);

/* Initialises the parameters from seed (kernels by their initialiser, biases zero). */
void loom_model_init_params(loom_model *m, uint64_t seed);

/* Forward and backward on a batch of B = x->shape.dim[0] examples.
 * Writes the gradient of (sum of losses) / global_batch into the grads buffer
 * (overwriting it). Returns the sum of per-example losses in *loss_sum and the
 * number of correctly classified examples in *correct (argmax of the output vs
 * the label; for MSE with one-hot targets vs the target's argmax).
 * rng_key seeds dropout for this step. LOOM_ENUMERIC if the loss is not finite. */
int loom_model_train_step(loom_model *m, const loom_tensor *x, const loom_tensor *label, int64_t global_batch,
                          uint64_t rng_key, double *loss_sum, int64_t *correct, loom_err *err);
/* Gradient readiness, for reductions that overlap the backward pass (as
 * PyTorch DDP's buckets, caffe's layer callbacks): while
 * loom_model_train_step runs, fn(arg, t) is called each time the gradients
 * of parameter tensors [t, n_param_tensors) have become final, t decreasing
 * (backprop finishes the last layers first), last with t = 0; fn runs on the
 * thread that called train_step, between layers, and may block (start a
 * reduction, wait for peers) but must not touch the model. The gradients are
 * the same bits with or without a hook: with one thread each layer's kernel
 * and bias gradients are computed right after its input gradient, with more
 * the layers' whole-batch gradient passes run one layer at a time, last
 * layer first. A step whose loss is not finite calls no hook. Only
 * train_step calls it (not loom_model_backward). fn NULL: no hook. */
typedef void (*loom_grad_ready_fn)(void *arg, int first_final_tensor);
void loom_model_set_grad_hook(loom_model *m, loom_grad_ready_fn fn, void *arg);

/* The same training step in three parts, for custom training steps (a Lua
 * train_step): forward (dropout on, keyed by rng_key), then the loss (its sum
 * and correct count, as train_step returns them; LOOM_ENUMERIC if not
 * finite), then backward into the grads buffer (overwriting it). Called in
 * this order on one batch, they give gradients bit-identical to
 * loom_model_train_step's; out of order, LOOM_EUSAGE. Any other step
 * (train_step, evaluate, predict) in between discards the parts done. */
int loom_model_forward(loom_model *m, const loom_tensor *x, uint64_t rng_key, loom_err *err);
int loom_model_loss(loom_model *m, const loom_tensor *label, int64_t global_batch, double *loss_sum, int64_t *correct,
                    loom_err *err);
int loom_model_backward(loom_model *m, loom_err *err);
/* Forward only (dropout off): loss sum and correct count. */
int loom_model_evaluate(loom_model *m, const loom_tensor *x, const loom_tensor *label, double *loss_sum,
                        int64_t *correct, loom_err *err);
/* Forward only (dropout off): the model's outputs, probabilities when the loss
 * is softmax cross-entropy, into out (B, outputs). */
int loom_model_predict(loom_model *m, const loom_tensor *x, float *out, loom_err *err);

/* ---- running a model on a device (model_device.c) ---------------------------
 * An executor runs a model's steps through a device backend (device.h): a
 * GPU's, or the CPU reference to test that path anywhere. The host model
 * keeps the master variables and the gradients: a train step uploads the
 * batch, computes on the device and downloads the gradients into
 * loom_model_grads(m); after the host optimizer changed the parameters (or a
 * restore did), loom_model_dev_upload_params gives them to the device. The
 * steps keep the contracts of the host ones above (losses, counts, errors,
 * dropout masks) with results equal up to float rounding.
 * Threads: one thread at a time per executor, and the model is not used by
 * another thread meanwhile. */

typedef struct loom_model_dev loom_model_dev;

/* Opens device `device` of backend ops and allocates its buffers for m's
 * batches (up to m's max_batch): parameters, gradients, activations,
 * deltas, scratch; then uploads m's parameters. A layer the device cannot
 * run is LOOM_EUNSUPPORTED naming its file:line. m is borrowed and must
 * outlive the executor. Close with loom_model_dev_close. */
int  loom_model_dev_open(loom_model_dev **out, loom_model *m, const loom_device_ops *ops, int device, loom_err *err);
void loom_model_dev_close(loom_model_dev *d); /* NULL is a no-op */
/* The host model's parameters to the device; returns once they are copied. */
int  loom_model_dev_upload_params(loom_model_dev *d, loom_err *err);
/* As loom_model_train_step, _forward, _loss, _backward, _evaluate and
 * _predict; the gradients end up in the host model's grads buffer. */
int loom_model_dev_train_step(loom_model_dev *d, const loom_tensor *x, const loom_tensor *label, int64_t global_batch,
                              uint64_t rng_key, double *loss_sum, int64_t *correct, loom_err *err);
int loom_model_dev_forward(loom_model_dev *d, const loom_tensor *x, uint64_t rng_key, loom_err *err);
int loom_model_dev_loss(loom_model_dev *d, const loom_tensor *label, int64_t global_batch, double *loss_sum,
                        int64_t *correct, loom_err *err);
int loom_model_dev_backward(loom_model_dev *d, loom_err *err);
int loom_model_dev_evaluate(loom_model_dev *d, const loom_tensor *x, const loom_tensor *label, double *loss_sum,
                            int64_t *correct, loom_err *err);
int loom_model_dev_predict(loom_model_dev *d, const loom_tensor *x, float *out, loom_err *err);
/* For a reduction in device memory (a cross-device op of device memory, such
 * as nccl): train_step and backward that leave the gradients in the device's
 * gradient buffer and the host grads buffer untouched; the device is idle on
 * return, so the buffer may be reduced at once, from any thread. */
int loom_model_dev_train_step_keep(loom_model_dev *d, const loom_tensor *x, const loom_tensor *label,
                                   int64_t global_batch, uint64_t rng_key, double *loss_sum, int64_t *correct,
                                   loom_err *err);
int loom_model_dev_backward_keep(loom_model_dev *d, loom_err *err);
/* The device's gradient buffer: (P,) device memory, laid out as
 * loom_model_grads (one flat buffer, every layer's tensors at their host
 * offsets); borrowed until close. */
float *loom_model_dev_grads(loom_model_dev *d);
/* Gradients [lo, hi) (0 <= lo <= hi <= P) from the device buffer into the
 * same range of loom_model_grads; returns once they are copied. */
int loom_model_dev_download_grads(loom_model_dev *d, int64_t lo, int64_t hi, loom_err *err);
/* loom_model_grads (all P) into the device buffer (a custom step's changed
 * gradients, or zeros); the device is idle on return. */
int loom_model_dev_upload_grads(loom_model_dev *d, loom_err *err);

/* ---- optimizers ------------------------------------------------------------ */

typedef struct loom_optimizer loom_optimizer;

int  loom_optimizer_new(loom_optimizer **out, const loom_optimizer_spec *spec, int64_t num_params, loom_err *err);
void loom_optimizer_free(loom_optimizer *o); /* NULL is a no-op */
/* The learning rate of the schedule at `step` (0-based count of applied updates). */
double loom_optimizer_lr(const loom_optimizer *o, int64_t step);
/* Overrides the schedule from now on (callbacks); <= 0 restores the schedule. */
void loom_optimizer_set_lr(loom_optimizer *o, double lr);
/* Runs loom_optimizer_apply on pool's threads (borrowed, e.g. loom_model_pool;
 * NULL: the calling thread alone). The update is element-wise, so the result
 * is the same with or without a pool. */
void loom_optimizer_set_pool(loom_optimizer *o, loom_pool *pool);
/* params -= update(grads) for the `step`-th update (0-based). */
void loom_optimizer_apply(loom_optimizer *o, float *params, const float *grads, int64_t step);
/* The same update for parameters [lo, hi) only (params, grads and slots at
 * those offsets; the rest untouched), on pool's threads (NULL: the calling
 * thread). The update is element-wise, so applying the ranges of a partition
 * of [0, P) equals loom_optimizer_apply, bit for bit; it reads the optimizer
 * without changing it, so disjoint ranges may be applied concurrently from
 * different threads (each with its own pool, or none). */
void loom_optimizer_apply_range(const loom_optimizer *o, loom_pool *pool, float *params, const float *grads,
                                int64_t step, int64_t lo, int64_t hi);
/* 1 when an update since the last call left a NaN or infinite weight (from a
 * non-finite gradient, learning rate or slot), then clears it. Checked in the
 * update's own pass, so it costs no pass of its own. */
int loom_optimizer_take_nonfinite(loom_optimizer *o);
/* The first non-finite parameter: its index, or -1 when all are finite, and
 * "layer/kernel[k] = nan" in buf. One pass; for error reports. */
int64_t loom_model_find_nonfinite(const loom_model *m, char *buf, size_t n);
/* The slot buffers (momentum, Adam m and v), contiguous, for checkpoints. */
int     loom_optimizer_num_slots(const loom_optimizer *o);  /* 0, 1 or 2 */
float  *loom_optimizer_slots(loom_optimizer *o);            /* (num_slots * P,) borrowed */
const char *loom_optimizer_slot_name(const loom_optimizer *o, int i); /* "momentum", "m", "v" */

/* The schedule alone, for tests and for printing. */
double loom_schedule_lr(const loom_schedule_spec *s, double base_lr, int64_t step);

#endif
