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
#include "tensor/tensor.h"
#include "nn/layer_plugin.h"

typedef struct loom_model loom_model;
typedef struct loom_optimizer loom_optimizer; /* optimizers, below */

/* One named parameter tensor inside the flat buffer. */
typedef struct loom_param_info {
    char       name[96];   /* "dense_1/kernel", "conv2d_0/bias" */
    int64_t    offset;     /* in floats, into params/grads */
    loom_shape shape;      /* dense kernel (in, out); conv kernel (kh, kw, cin, cout); bias (out,) */
} loom_param_info;

/* Builds the model for inputs of shape `input` (per example, no batch dim;
 * must be float32) and targets `label` (per example: an integer scalar for
 * sparse softmax cross-entropy; for the other losses any number type of the
 * output's shape, or a scalar when the output is one unit), for
 * batches of up to max_batch examples. Shape mismatches between layers, or
 * between the data and the model, are LOOM_ESHAPE naming the layer's
 * file:line and both shapes. Free with loom_model_free. */
int  loom_model_new(loom_model **out, const loom_model_spec *spec, const loom_shape *input, loom_dtype input_dtype,
                    const loom_shape *label, loom_dtype label_dtype, int64_t max_batch, loom_err *err);
void loom_model_free(loom_model *m); /* NULL is a no-op */
/* A graph with several model inputs (model.inputs, n of them, in that
 * order): loom_model_new with each input's per-example shape and dtype
 * (input 0 as loom_model_new's; the others float32). loom_model_new itself
 * refuses a spec with several inputs. */
int  loom_model_new_inputs(loom_model **out, const loom_model_spec *spec, int n, const loom_shape *inputs,
                           const loom_dtype *dtypes, const loom_shape *label, loom_dtype label_dtype,
                           int64_t max_batch, loom_err *err);
int  loom_model_num_inputs(const loom_model *m); /* 1 but for loom_model_new_inputs */
/* loom_model_new_inputs (n = 1: loom_model_new) without the step's buffers
 * (the layers' outputs and gradients): for a model that is described, not
 * run (`loom check`: ResNet-50's batch of 32 reserved 6.9 GB for nothing).
 * Its first step (train, forward, evaluate, predict) or decoder allocates
 * them, LOOM_ENOMEM there when they do not fit; every later step allocates
 * nothing, as loom_model_new's do. */
int  loom_model_new_plan(loom_model **out, const loom_model_spec *spec, int n, const loom_shape *inputs,
                         const loom_dtype *dtypes, const loom_shape *label, loom_dtype label_dtype, int64_t max_batch,
                         loom_err *err);
/* The batches of inputs 1..n-1 (xs[f - 1] for input f, each float32 (B,
 * input f's shape), B that of the x the next step takes) for the steps that
 * follow, as loom_model_set_sample_weights: borrowed until the next call;
 * a step of a model with several inputs without them is LOOM_ESHAPE. */
void loom_model_set_inputs(loom_model *m, const loom_tensor *const *xs, int n);
/* Output heads (model.outputs): head 0 is the model's output (its last layer,
 * model.loss and the label the steps take, with model.metrics); heads 1..
 * each name a layer, a loss and a weight. The steps' loss is the weighted sum
 * (Keras' loss_weights) and its gradient the weighted sum of the heads'; each
 * head's own (unweighted) loss sum and correct count of the last train, loss
 * or evaluate step are loom_model_head_results. Heads 1..'s labels (labels[h
 * - 1] for head h, any number type: (B,) classes for sparse softmax
 * cross-entropy, else (B, outputs)) for the steps that follow; a step
 * without them is LOOM_ESHAPE, a bad label LOOM_EDATA. */
void           loom_model_set_head_labels(loom_model *m, const loom_tensor *const *labels, int n);
int            loom_model_num_heads(const loom_model *m); /* 1 without model.outputs */
const char    *loom_model_head_name(const loom_model *m, int h);   /* its layer's name */
float          loom_model_head_weight(const loom_model *m, int h);
loom_loss_kind loom_model_head_loss_kind(const loom_model *m, int h);
int            loom_model_head_layer(const loom_model *m, int h);  /* index in the executor's order */
void           loom_model_head_results(const loom_model *m, int h, double *loss_sum, int64_t *correct);
/* With several heads the model.metrics state (loom_model_metrics_take) also
 * sums each head's loss and correct count: head h's mean loss (which = 0) or
 * accuracy (1) over the state's examples; NaN with one head. Heads 1.. report
 * accuracy when their spec's accuracy is set (head 0's is model.metrics'). */
double         loom_model_head_value(const loom_model *m, int h, int which, const double *acc, int64_t examples);
bool           loom_model_head_accuracy(const loom_model *m, int h);
/* Floats per example that loom_model_predict writes: the output's, or with
 * several heads each head's outputs in head order (head 0's first). */
int64_t        loom_model_predict_width(const loom_model *m);
int64_t        loom_model_head_outputs(const loom_model *m, int h); /* head h's outputs per example */
/* The parameter tensors (names, offsets, shapes) loom_model_new would build,
 * and *n_params, the floats of them all, for the n_in model inputs (inputs,
 * dtypes: as loom_model_new_inputs), without allocating any buffer: for
 * a task that holds only some of them (a parameter server). The same
 * checks as loom_model_new. *out (n) is freed with loom_free. table (may be
 * NULL): the model's embedding table when it has exactly one (n = 0, no
 * gradient), else param = -1. */
struct loom_sparse_grad;
int loom_model_param_list(const loom_model_spec *spec, int n_in, const loom_shape *inputs, const loom_dtype *dtypes,
                          const loom_shape *label, loom_dtype label_dtype, loom_param_info **out, int *n,
                          int64_t *n_params, struct loom_sparse_grad *table, loom_err *err);

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
/* `loom check --gradcheck` (gradcheck.c): each layer of m built alone for
 * its input shape, its backward (input gradient and every trained parameter
 * tensor's) compared with central differences of a mean squared error on a
 * small random batch; prints a table (layer, elements checked, max abs and
 * rel error, pass or FAIL) to f. *failed: the layers that failed. Returns
 * an error only when a check could not run (memory, a layer that does not
 * build alone). */
int          loom_model_gradcheck(const loom_model *m, FILE *f, int *failed, loom_err *err);

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

/* The optimizer inside the step (one replica, nothing that needs every
 * gradient first): loom_model_train_step_update is loom_model_train_step
 * followed by loom_optimizer_apply(o, params, grads, step), except that each
 * layer's parameters are updated as soon as their gradients are final, while
 * they are in cache and on the thread that computed them (a dense layer's
 * kernel rows and bias columns by the part of the gradient pass that wrote
 * them; other layers' right after their pass). The update is element-wise,
 * so params, slots and grads end with the same bits as the two calls, and
 * o's non-finite flag is set as loom_optimizer_apply sets it. *applied is
 * false (and the step is loom_model_train_step alone, the caller applying o)
 * when loom_model_can_update_in_step says no, or the step failed (a step
 * whose loss is not finite updates nothing). */
bool loom_model_can_update_in_step(const loom_model *m, const loom_optimizer *o);
int  loom_model_train_step_update(loom_model *m, const loom_tensor *x, const loom_tensor *label, int64_t global_batch,
                                  uint64_t rng_key, loom_optimizer *o, int64_t step, double *loss_sum,
                                  int64_t *correct, bool *applied, loom_err *err);
/* Whether a profile is attached (loom_model_set_prof). */
bool loom_model_profiled(const loom_model *m);

/* Synchronised batch normalization (layers with sync = true, as TF's
 * SyncBatchNormalization). A strategy with replicas in sync gives every
 * replica's model fn: fn(arg, buf, n, err) must replace buf (n floats) with
 * the element-wise SUM of the buffers every replica of the job passed in
 * the same call, and return on every replica together. A training step
 * (train_step, or forward then backward) then calls it on the replica's
 * thread: in forward, once per sync layer in layer order with (count, sum
 * of x, sum of (x - moving mean)^2) per channel (2 C + 1 floats: the
 * statistics of the global batch), in backward once per sync layer that
 * passes a gradient down, last first, with (sum of g, sum of g * xhat)
 * (2 C floats: the input gradient's two means over the global batch).
 * Every step makes the whole sequence of calls, whatever happens: a step
 * that fails part-way (a bad batch, a non-finite loss) makes the rest with
 * zeros, so the other replicas never wait for it; a failure of fn itself
 * fails the step with fn's error. Without fn (one_device, parameter
 * server) a sync layer normalises over its own batch, as any other. */
typedef int (*loom_bn_sync_fn)(void *arg, float *buf, int64_t n, loom_err *err);
void loom_model_set_bn_sync(loom_model *m, loom_bn_sync_fn fn, void *arg);
/* Batch normalization layers with sync = true (0: fn is never called). */
int  loom_model_num_sync_bn(const loom_model *m);
/* A replica without examples in a step: makes the step's calls with zeros
 * (it adds nothing to the sums): those of a whole train step, or of the
 * forward or backward part (LOOM_BN_SYNC_*). Returns fn's failure, if any. */
enum { LOOM_BN_SYNC_STEP, LOOM_BN_SYNC_FORWARD, LOOM_BN_SYNC_BACKWARD };
int  loom_model_bn_sync_idle(loom_model *m, int pass, loom_err *err);

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
/* loom_model_backward with o's `step`-th update in it, as
 * loom_model_train_step_update (*applied likewise): for a profile of a
 * step that updates in the step (loom_model_prof.upd times it). */
int loom_model_backward_update(loom_model *m, loom_optimizer *o, int64_t step, bool *applied, loom_err *err);
/* ---- profiling a step (`loom profile --train`) -----------------------------
 * With a profile attached, loom_model_forward and loom_model_backward clock
 * each layer on each chunk (no barrier is added between layers) and add the
 * mean over the chunks to it; the time a phase takes beyond its layers' is
 * dispatch and imbalance between the chunks (and model.l2's gradient), the
 * imbalance measured apart (imbalance[]). A
 * batch normalization runs over the whole batch between the chunks' segments
 * and is clocked whole, its parameter gradients in its backward; an
 * embedding's sparse rows are gathered by one part of the weight-gradient
 * pass, so its weights row is that time over the chunks. The computations
 * are the unprofiled ones, so the bits are too (tests/unit/test_nn.c,
 * "profiled step"). loom_model_train_step ignores the profile. */
typedef struct loom_model_prof {
    double fwd[LOOM_MAX_LAYERS];   /* seconds, summed over the steps profiled, mean over the chunks: forward */
    double bwd[LOOM_MAX_LAYERS];   /* the layer's dz rows and input gradient */
    double pgrad[LOOM_MAX_LAYERS]; /* its part of the parameter gradients over the whole batch; 0: none */
    double upd[LOOM_MAX_LAYERS];   /* loom_model_backward_update: the optimizer on its parameters (mean over the parts) */
    double imbalance[2];           /* forward, backward (its weight-gradient pass too): over each pool run of the
                                      chunks, the slowest chunk's clocked layers less the mean chunk's; the rest
                                      of a phase beyond its layers is dispatch (wake-ups, the executor between
                                      layers, the segments' hand-offs) */
} loom_model_prof;
void loom_model_set_prof(loom_model *m, loom_model_prof *p); /* p borrowed until unset; NULL: off */
int  loom_model_num_layers(const loom_model *m);
/* Layer i in the order the layers run (a topological order: the listed one
 * for a chain; layers the output does not depend on left out): its spec, and
 * its inputs in src (room for LOOM_MAX_LAYER_INPUTS), each an earlier layer
 * k >= 0 of this order or model input f as -1 - f, *n_src of them. */
const loom_layer_spec *loom_model_layer_spec(const loom_model *m, int i, int *src, int *n_src);
/* Layer i for a profile row, e.g. "dense_1 dense 256->128 relu", "conv2d_0 conv2d 5x5 1->32 relu". */
const char *loom_model_layer_describe(const loom_model *m, int i, char *buf, size_t n);
/* The matrix products (row-major C(M,N) = op(A)(M,K) op(B)(K,N), as
 * loom_sgemm takes them) that layer i's phases amount to on a batch of B:
 * which = 0 forward, 1 input gradient, 2 kernel gradient. A conv layer
 * counts as its im2col product. Returns 0 when the phase has none. */
typedef struct loom_gemm_shape { bool ta, tb; int M, N, K; } loom_gemm_shape;
int  loom_model_layer_gemm(const loom_model *m, int i, int64_t B, int which, loom_gemm_shape *out);

/* Forward only (dropout off): loss sum and correct count. */
int loom_model_evaluate(loom_model *m, const loom_tensor *x, const loom_tensor *label, double *loss_sum,
                        int64_t *correct, loom_err *err);
/* Forward only (dropout off): the model's outputs, probabilities when the loss
 * is softmax or binary cross-entropy, into out (B, outputs). */
int loom_model_predict(loom_model *m, const loom_tensor *x, float *out, loom_err *err);

/* Per-example loss weights (model.sample_weight, Keras' sample_weight) for
 * the train, loss and evaluate steps that follow: w is (B,) or (B, 1) of any
 * number type for the step's B examples, each finite and >= 0 (else the
 * step is LOOM_EDATA naming the example); each example's loss and gradient
 * are multiplied by its weight (the sum still divided by the global batch,
 * as Keras' SUM_OVER_BATCH_SIZE). Borrowed until the next call; NULL: none.
 * The metrics are not weighted. */
void loom_model_set_sample_weights(loom_model *m, const loom_tensor *w);

/* ---- metrics (model.metrics; metrics.c) --------------------------------------
 * The model's metrics, in the config's order (without model.metrics:
 * accuracy for a classification, none for a regression). accuracy is the
 * steps' correct / examples; every other metric is computed from a state of
 * sums that each train, loss and evaluate step of this model adds to (never
 * predict), so the states of several replicas, or of several takes, add up. */
int              loom_model_num_metrics(const loom_model *m);
loom_metric_kind loom_model_metric(const loom_model *m, int i);
int64_t          loom_model_metrics_size(const loom_model *m); /* doubles of state; 0: none kept */
/* acc (metrics_size doubles; NULL: dropped) += the state; then the state is cleared. */
void             loom_model_metrics_take(loom_model *m, double *acc);
/* Metric i's value from an accumulated state (acc, may be NULL when
 * metrics_size is 0) and the same steps' correct and examples; NaN when no
 * example was seen. */
double           loom_model_metric_value(const loom_model *m, int i, const double *acc, int64_t correct,
                                         int64_t examples);

/* ---- embeddings and sparse gradients -------------------------------------
 * An embedding layer (type = "embedding"; input_dim, output_dim, combiner)
 * is the model's first layer; the model input is then int32 or int64 ids of
 * shape (columns,) or (columns, k): every categorical column of an example
 * looks up the ONE shared table (input_dim, output_dim), so columns are
 * hashed into one id space by the data (the synthetic ctr source does), and
 * k ids of a column (multi-hot) are combined by sum or mean. An id of -1 is
 * "no id" (padding: it adds nothing, and mean divides by the ids present);
 * any other id outside [0, input_dim) fails the step (LOOM_EDATA). The
 * output is (columns, output_dim) (for (columns,) and (columns, k) inputs)
 * or (output_dim,) for a scalar id; put a flatten before dense layers.
 * The table is a parameter tensor ("<name>/embeddings") of the flat buffer
 * like any other, so checkpoints, broadcasts and restores carry it as they
 * are. Its gradient is sparse: a backward leaves, per table, the distinct
 * rows the batch looked up and their gradient rows, summed over the batch
 * (loom_model_sparse_grad), and writes the same rows into the dense grads
 * buffer, whose other table rows are zero. So a strategy that reduces the
 * dense buffer (mirrored, central_storage, multi_worker_mirrored) works
 * unchanged: it densifies, moving the whole table's gradient. */
typedef struct loom_sparse_grad {
    int            param;  /* the table's parameter tensor (loom_model_param_tensor) */
    int64_t        offset; /* of the table in params/grads, floats */
    int64_t        rows;   /* input_dim */
    int64_t        dim;    /* output_dim */
    int64_t        n;      /* distinct rows the last backward touched */
    const int64_t *ids;    /* (n,) their ids, in first-seen order (example, column, k): the same every run */
    const float   *values; /* (n, dim) d(sum loss / global batch)/d(row), summed over the batch */
} loom_sparse_grad;
/* Embedding tables of the model, in layer order (0 without embeddings). */
int  loom_model_num_sparse(const loom_model *m);
/* Table i's sparse gradient from the last backward (n = 0 before any);
 * borrowed until the next step on m. */
void loom_model_sparse_grad(const loom_model *m, int i, loom_sparse_grad *out);
/* on: the model is the only writer of its grads buffer (one replica, no
 * reduction into it), so a backward clears just the table rows it wrote
 * last time instead of the whole table region (the default, always right).
 * A strategy that all-reduces into the buffer must leave it off. */
void loom_model_set_sparse_owner(loom_model *m, int on);

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
/* What of model spec ms no device backend runs yet (batch and layer
 * normalization, the pooling layers but max, embedding, leaky_relu, gelu;
 * model.l2; class or sample weights under sparse_softmax_cross_entropy),
 * checked before any device is looked for: LOOM_EUNSUPPORTED at the
 * layer's (or the model block's) file:line, naming backend and saying
 * what to do. loom_model_dev_open refuses the same. */
int  loom_model_spec_dev_check(const loom_model_spec *ms, const char *backend, loom_err *err);
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

/* ---- decoding a language model (decode.c; loom generate) ---------------------
 * A language model here has one input of token ids, int32 or int64 (T,),
 * and an output of logits over the vocabulary under sparse softmax
 * cross-entropy: (V,), the next token's, or (T, V), each position's. A
 * decoder holds a sequence (a prompt, then the tokens drawn) and gives the
 * logits of the token after it, by one of two paths that give the same:
 *  - generic: the model's forward on the last T tokens (left-padded with
 *    pad_id for a (V,) output; for (T, V) right-padded, row n - 1 read:
 *    a causal model's row n - 1 sees no padding), once per token;
 *  - incremental: when every layer kind has step ops (nn_internal.h
 *    nn_step_ops_, decode_step.c: per-sequence state such as an LSTM's h/c
 *    or attention's KV cache) and the output is (T, V), each new token runs
 *    through the layers once, giving the generic path's logits. Past T
 *    tokens a model whose state is unbounded (recurrent: no KV cache nor
 *    position table) goes on from it (it reads the whole sequence, where
 *    the generic path reads the last T); any other falls back to the
 *    generic path, which slides the window.
 * Threads: one thread at a time, and the model (borrowed; it must outlive
 * the decoder) is not used by another meanwhile. */
typedef struct loom_decoder loom_decoder;
/* A model that is not a language model as above is LOOM_ECONFIG at the model
 * block's file:line saying what it reads and outputs and what is needed.
 * incremental: take the incremental path when the model allows it. Sets the
 * model's threads to 1. Free with loom_decoder_free. */
int  loom_decoder_new(loom_decoder **out, loom_model *m, int64_t pad_id, bool incremental, loom_err *err);
void loom_decoder_free(loom_decoder *d); /* NULL is a no-op */
int64_t loom_decoder_context(const loom_decoder *d); /* T */
int64_t loom_decoder_vocab(const loom_decoder *d);   /* V */
bool loom_decoder_incremental(const loom_decoder *d); /* the incremental path serves the current sequence */
void loom_decoder_reset(loom_decoder *d);             /* a new, empty sequence */
int  loom_decoder_push(loom_decoder *d, int64_t id, loom_err *err); /* appends a token */
/* The logits (V,) of the token after the sequence (at least one token):
 * borrowed until the next call on d or a step on its model. */
int  loom_decoder_logits(loom_decoder *d, const float **out, loom_err *err);
/* The next token from logits among ids [lo, hi): with temperature <= 0 or
 * top_k = 1 the argmax (the lowest id among equal maxima), else a draw (one
 * loom_rng_uniform64 from rng) from softmax(logits / temperature) over the
 * top_k largest (0: all; among equal logits at the cut, the lowest ids).
 * scratch: hi - lo floats. */
int64_t loom_decode_sample(const float *logits, int64_t lo, int64_t hi, double temperature, int64_t top_k,
                           loom_rng *rng, float *scratch);

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
/* params -= update(grads) for the `step`-th update (0-based); with clip_norm
 * the update uses grads scaled to that global norm at most (grads unchanged). */
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
/* Sets that flag: an update of the same step elsewhere (another process's
 * shard of a sharded update) left a non-finite weight. */
void loom_optimizer_mark_nonfinite(loom_optimizer *o);
/* The first non-finite parameter: its index, or -1 when all are finite, and
 * "layer/kernel[k] = nan" in buf. One pass; for error reports. */
int64_t loom_model_find_nonfinite(const loom_model *m, char *buf, size_t n);
/* The slot buffers (momentum, Adam m and v, RMSprop rms, Adagrad accumulator), contiguous, for checkpoints. */
int     loom_optimizer_num_slots(const loom_optimizer *o);  /* 0, 1 or 2 */
float  *loom_optimizer_slots(loom_optimizer *o);            /* (num_slots * P,) borrowed */
const char *loom_optimizer_slot_name(const loom_optimizer *o, int i); /* "momentum", "m", "v", "rms", "accumulator" */
/* With optimizer.clip_norm the update reads the global norm of the whole
 * gradient buffer it is given, so loom_optimizer_apply_range needs every
 * element of grads [0, P) reduced, not only [lo, hi): a sharded update must
 * all-reduce (not reduce-scatter) first. */
bool    loom_optimizer_needs_full_grads(const loom_optimizer *o);
/* Tells the optimizer which of m's parameters are not trained (batch
 * normalization's moving statistics): their gradients are zero, and AdamW's
 * decoupled decay leaves them alone too. Call once after loom_optimizer_new
 * with the model it updates. */
void    loom_optimizer_for_model(loom_optimizer *o, const loom_model *m);

/* Sparse (lazy) updates of the model's embedding tables. After this call,
 * apply and apply_range update an element of a table only where its
 * gradient is not 0.0, and leave its slots as they are elsewhere: SGD and
 * Adagrad give the dense update's bits (a zero gradient changes nothing in
 * them); momentum and Adam become lazy (Adam as tfa.optimizers.LazyAdam and
 * torch.optim.SparseAdam: the moments of rows not looked up do not decay,
 * the bias correction uses the global step). With use_rows, the rows come
 * from m's last backward (loom_model_sparse_grad), so an update costs the
 * touched rows, not the table; without (replicas whose reduced gradient
 * holds other replicas' rows), the table's gradient is scanned for them.
 * m is borrowed and must outlive the optimizer. */
void loom_optimizer_set_tables(loom_optimizer *o, const loom_model *m, int use_rows);
/* The lazy update of rows ids[0..n) of a table (dim floats a row) at offset
 * (floats) into params and the slots: gradient row k is values + k * dim,
 * or (values NULL) grads at the row's own offset. Elements whose gradient
 * is 0.0 are left alone, as above. For a parameter server applying pushed
 * rows. Reads o without changing it (but for the non-finite flag). */
void loom_optimizer_apply_rows(const loom_optimizer *o, float *params, const float *grads, int64_t step,
                               int64_t offset, int64_t dim, const int64_t *ids, int64_t n, const float *values);

/* The schedule alone, for tests and for printing. */
double loom_schedule_lr(const loom_schedule_spec *s, double base_lr, int64_t step);

#endif
