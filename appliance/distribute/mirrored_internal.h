/* mirrored_internal.h - between distribute.c and mirrored.c: registering the
 * built-in replicated strategies. */
#ifndef LOOM_MIRRORED_INTERNAL_H
#define LOOM_MIRRORED_INTERNAL_H

#include "distribute.h"

/* Registers mirrored and central_storage. */
int loom_replicated_register_(loom_err *err);
/* Whether ops is mirrored's or central_storage's. */
int loom_replicated_owns_(const loom_strategy_ops *ops);
/* The one_device and multi_worker_mirrored vtables (one_device.c, multi_worker.c). */
const loom_strategy_ops *loom_one_device_ops_(void);
const loom_strategy_ops *loom_multi_worker_ops_(void);
const loom_strategy_ops *loom_parameter_server_ops_(void); /* parameter_server.c */

/* The mirrored machinery that multi_worker_mirrored runs on each worker:
 * open mirrored's replicas (rank0: the index of this worker's replica 0 among
 * the job's replicas, for dropout keys; loss_div: the job's global batch,
 * the divisor of every replica's summed losses); one step's gradients,
 * summed over this worker's replicas into replica 0's buffer (batch NULL:
 * this worker has no examples: zero); the update of every replica with the
 * job's summed gradients (P floats, read only). The other functions of the
 * vtable are mirrored's (loom_mirrored_ops_). */
const loom_strategy_ops *loom_mirrored_ops_(void);
int    loom_replicated_open_(loom_strategy *s, const loom_strategy_args *a, int rank0, int64_t loss_div, loom_err *err);
int    loom_replicated_grads_(loom_strategy *s, const loom_elem *batch, int64_t step, loom_step_result *out,
                              loom_err *err);
float *loom_replicated_grads0_(loom_strategy *s);
int64_t loom_replicated_num_params_(loom_strategy *s);
int    loom_replicated_apply_(loom_strategy *s, const float *grads, int64_t step, loom_err *err);
/* multi_worker_mirrored's sharded update: whether it applies (one replica
 * on the host, mirrored, an optimizer whose update of a range reads only
 * that range of the gradients: no clip_norm), and the update of parameters
 * [lo, hi) of that replica with the job's summed gradients (P floats, read
 * in [lo, hi) only), on its intra-op threads. */
bool   loom_replicated_shardable_(loom_strategy *s);
void   loom_replicated_apply_range_(loom_strategy *s, const float *grads, int64_t step, int64_t lo, int64_t hi);
/* The gradient packs (strategy.bytes_per_pack / num_packs), in reduction
 * order: the last layers' first. */
const loom_pack *loom_replicated_packs_(loom_strategy *s, int *n);
/* Overlap: during loom_replicated_grads_, fn(arg, k) is called on replica
 * 0's thread for each pack k, in order, as soon as its sum over this
 * worker's replicas is final (backprop still running for earlier layers);
 * packs no hook reached (a replica without examples, a device replica, a
 * failed step) are summed after the step and not announced. fn NULL: off. */
void   loom_replicated_set_pack_ready_(loom_strategy *s, void (*fn)(void *arg, int pack), void *arg);
/* Synchronised batch normalization across workers: after the sum over this
 * worker's replicas, replica 0's thread calls fn(arg, buf, n, err) to sum buf
 * over the workers (every worker calls it in the same order: a step without
 * examples makes the calls with zeros). */
int    loom_replicated_set_bn_cross_(loom_strategy *s, int (*fn)(void *arg, float *buf, int64_t n, loom_err *err),
                                     void *arg, loom_err *err);

#endif
