/* mirrored.c - the mirrored and central_storage strategies: N replicas of the
 * model in this process, each computing its share of the global batch on a
 * thread of a persistent pool (the train thread is one of them), so a step
 * costs one wake-up of the replica threads, never a thread of its own.
 *
 * mirrored: every replica holds its own variables. In one trip through the
 * replica threads each replica runs forward and backward on its share, then
 * the update is sharded (ZeRO-1): the gradient buffers are reduce-scattered
 * (SUM) through the cross-device op's per-rank collectives (loom_xcomm), each
 * replica applies the optimizer to its own shard of its variables, and the
 * variables are all-gathered. The ring moves the bytes of one all-reduce so,
 * and the optimizer's work is split among the replicas instead of repeated by
 * each. (With several gradient packs the packs are all-reduced instead, as
 * their cuts fall inside shards.) The optimizer is element-wise and the
 * shards lie on whole cache lines, and the reduce-scatter gives the bits
 * of the all-reduce, so the variables are those of every replica applying
 * the whole all-reduced update, and the replicas stay bit-equal. There is one
 * optimizer, replica 0's: the replicas update disjoint ranges of its slots,
 * so it always holds them whole, for checkpoints.
 *
 * central_storage: one copy of the variables and the one optimizer live with
 * replica 0 (on the host). The replicas sum their gradients once into replica
 * 0's buffer (each sums a slice, over the replicas in a fixed order), the
 * update is applied once, and the other replicas copy the variables in at the
 * start of their next step, as devices read CPU-held variables in TensorFlow.
 *
 * Replicas on a device backend (model_device.c) download their gradients
 * and reduce them on the host as above, unless the cross-device op works on
 * device memory (nccl; LOOM_XOPS_DEVICE_MEM): then the gradients stay on the
 * devices and the op all-reduces the n device buffers (SUM, pack by pack;
 * the communicator's rendezvous hands the last replica to arrive all n, so
 * the op's collective runs once). mirrored: each replica downloads its shard
 * of the sum and updates its shard of the variables with the one optimizer;
 * the variables are all-gathered on the host and uploaded, so the replicas
 * stay bit-equal and replica 0 holds the variables and slots a checkpoint
 * saves. central_storage: replica 0 downloads the sum for its one update.
 *
 * Batches are split as tf.distribute splits them (loom_batch_split: ceil(B /
 * N) consecutive examples each; a short last batch splits unevenly, and a
 * replica may get none). Each replica's gradient is of its per-example losses
 * over the GLOBAL batch, so the SUM over replicas is one device's gradient:
 * any split gives the same update, up to float summation order.
 * Threads: run.threads (0 = the cores) are shared out: each replica's model
 * gets max(1, threads / N) intra-op threads, BLAS 1 (train.c). More replicas
 * than cores is allowed when asked for (replicas = N) and logged. The pool
 * has exactly N threads: a training job waits inside (a collective, a
 * barrier) until every replica arrives, so each must be on a thread of its
 * own, and a waiting replica sleeps rather than spins when they outnumber
 * the cores.
 * Dropout is keyed by (seed, step, replica); replica 0 draws one_device's mask. */
#include "distribute.h"
#include "mirrored_internal.h"
#include "placement_internal.h"
#include "xops_internal.h"
#include "tensor/tensor.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

typedef struct replica {
    loom_model     *model;
    loom_model_dev *dev;   /* on a device backend: the executor of model's steps; NULL: nn's host code */
    loom_optimizer *opt;   /* replica 0's only: the one optimizer */
    loom_elem       share; /* this job's slice of the batch (views) */
    int64_t         row0;  /* its first row in the batch */
    loom_step_result res;
    int              rc;        /* the replica's own work: set before any collective */
    loom_err         err;
    int              reduce_rc; /* mirrored: the all-reduce's, after it */
    loom_err         reduce_err;
    void            *owner;     /* the replicated it belongs to (the gradient hook's argument is the replica) */
    int              packs_done; /* multi-worker overlap: packs this replica has reduced locally in this step */
} __attribute__((aligned(64))) replica;

enum { JOB_TRAIN, JOB_EVAL, JOB_PREDICT, JOB_PART, JOB_GRADS, JOB_APPLY, JOB_IDLE };

typedef struct replicated {
    int          central;   /* central_storage, else mirrored */
    int          n;         /* replicas */
    replica     *rep;       /* (n,) */
    loom_pool   *pool;      /* n threads with the caller: item r is replica r's work */
    loom_xcomm  *comm;      /* mirrored, or dev_reduce: the cross-device op's n ranks */
    pthread_barrier_t bar;  /* central_storage: all gradients ready before the sum */
    int          bar_init;
    int64_t      P;         /* parameters */
    int          dev_reduce; /* device replicas whose op works on device memory: gradients reduced there */
    int          n_packs;   /* mirrored or dev_reduce: gradient packs, all-reduced one after the other, in plan order */
    loom_pack   *packs;
    int          stale;     /* central_storage: replicas > 0 hold variables older than replica 0's */
    int          pinned;    /* the replica threads are pinned one per core (pin_replicas) */
    uint64_t     seed;
    char         devices[LOOM_MAX_DEVICES][16]; /* for the plan (the first ones) */
    loom_placement_ place;  /* the device backend running the replicas (ops NULL: the host) */
    /* the current job */
    int          job;
    int64_t      step, global_batch;
    float       *out;       /* predict: (B, classes) */
    int64_t      classes;
    loom_step_part part;
    /* multi_worker_mirrored (loom_replicated_grads_ / _apply_): the losses'
     * divisor (the job's global batch), replica 0's index among the job's
     * replicas (dropout keys), and the gradients to apply (the job's sum) */
    int64_t      loss_div;
    int          rank0;
    const float *ext_grads;
    /* multi-worker overlap (loom_replicated_set_pack_ready_): called on
     * replica 0's thread as each pack's local sum becomes final during backward */
    void       (*pack_ready)(void *arg, int pack);
    void        *pack_arg;
    /* synchronised batch normalization (bn_sync): the replicas' buffers of
     * the current call, the barrier they meet at, and multi_worker's sum of
     * replica 0's across the workers (loom_replicated_set_bn_cross_) */
    float      **sync_buf;  /* (n,) */
    pthread_barrier_t sync_bar;
    int          sync_bar_init;
    int        (*sync_cross)(void *arg, float *buf, int64_t n, loom_err *err);
    void        *sync_cross_arg;
    int          sync_rc;
    loom_err     sync_err;
} replicated;

static int input_idx(const loom_strategy *s) { return s->args->input_idx; }
static int label_idx(const loom_strategy *s) { return s->args->label_idx; }

/* ---- opening ------------------------------------------------------------------ */

static const char *kind_name(const replicated *m) { return m->central ? "central_storage" : "mirrored"; }

/* The replica count and device names the spec asks for, checked against this
 * machine: cpu:N exists for N below the cores this process may run on; GPUs
 * need a GPU backend (cuda, from a plugin) that finds them usable now, and
 * strategy.device_backend may run cpu replicas on the CPU reference backend. */
static int resolve_devices(replicated *m, const loom_spec *spec, int64_t max_batch, loom_err *err)
{
    const loom_strategy_spec *st = &spec->strategy;
    int cores = loom_num_cores();
    char w[600];
    loom_loc_str(&st->devices_loc, w, sizeof w);
    char setting[160] = ""; /* the setting's path, unless "--set path" already names it */
    if (strncmp(w, "--set ", 6)) snprintf(setting, sizeof setting, "%s: ", st->devices_loc.path);
    int rc = loom_place_devices_(st, st->devices, st->devices_listed ? st->n_devices : 0, &st->devices_loc,
                                 &spec->model, &m->place, err);
    if (rc) return rc;
    if (m->place.gpu) {
        m->n = m->place.n;
        for (int i = 0; i < m->n; i++) snprintf(m->devices[i], sizeof m->devices[i], "gpu:%d", m->place.index[i]);
    } else if (st->devices_listed) {
        for (int i = 0; i < st->n_devices; i++) {
            unsigned idx = 0;
            sscanf(st->devices[i], "cpu:%u", &idx);
            if ((int)idx >= cores)
                return loom_err_set(err, LOOM_ECONFIG, w,
                                    "%sdevice \"%s\" does not exist: this machine has cpu:0 to cpu:%d (one per "
                                    "core this process may run on)", setting, st->devices[i], cores - 1),
                       loom_err_hint(err, "cpu:N is replica N on core N; for more replicas than cores set "
                                     "replicas = N instead of devices");
            snprintf(m->devices[i], sizeof m->devices[i], "%s", st->devices[i]);
        }
        m->n = st->n_devices;
    } else {
        m->n = st->replicas > 0 ? st->replicas : cores;
        for (int i = 0; i < m->n && i < LOOM_MAX_DEVICES; i++) snprintf(m->devices[i], sizeof m->devices[i], "cpu:%d", i);
    }
    if (m->n > max_batch)
        return loom_err_set(err, LOOM_ECONFIG, w,
                            "%s%d replicas but the global batch is %lld: each replica needs at least one example",
                            setting, m->n, (long long)max_batch),
               loom_err_hint(err, "raise the batch size (the global batch, split among the replicas) or set replicas");
    if (m->n > cores && !m->place.gpu)
        loom_info("%s: %d replicas on %d cores: the replica threads outnumber the cores, as configured", kind_name(m),
                  m->n, cores);
    return LOOM_OK;
}

/* Replica threads on cpu devices, one compute thread each and no more than
 * the cores, stay on their cores (cpu:N on the N-th core this process may
 * use): the collectives of a step hand buffers between them, and the
 * scheduler would otherwise now and then put two on one core for a while
 * (MLP mirrored(2) whole runs: +3% pinned; a ring all-reduce of 8-16 MiB
 * between two threads no longer drops to half speed in some runs). */
static void pin_replicas(replicated *m, int intra)
{
    if (m->n < 2 || intra > 1 || m->n > loom_num_cores() || m->place.gpu || m->n > LOOM_MAX_DEVICES) return;
    int core[LOOM_MAX_DEVICES];
    for (int r = 0; r < m->n; r++)
        if (sscanf(m->devices[r], "cpu:%d", &core[r]) != 1) return;
    loom_err err;
    if (loom_pool_pin(m->pool, core, &err)) /* only slower: train on, say so */
        loom_warn("%s: replica threads not pinned to their cores: %s", kind_name(m), err.msg);
    else
        m->pinned = 1;
}

/* "auto" resolves here, where the replicas are known; any other name was
 * resolved by loom_strategy_open. Device replicas whose op works on device
 * memory reduce their gradients there (dev_reduce). central_storage sums
 * host gradients itself (in replica order: reduce_to_one_device's sum), so
 * it takes an op only to reduce in device memory: "auto" resolves only for
 * GPU replicas, and another op of host memory is refused. */
static int resolve_xops(loom_strategy *s, replicated *m, const loom_strategy_spec *st, loom_err *err)
{
    const int chosen = !s->xops; /* "auto" */
    char why[256];
    if (chosen && (!m->central || m->place.gpu)) {
        s->xops = loom_xops_auto_(m->n, m->place.gpu, why, sizeof why);
        if (!s->xops) return loom_err_set(err, LOOM_EPLUGIN, NULL, "cross_device_ops = \"auto\" found no op");
    }
    m->dev_reduce = m->place.ops && s->xops && (loom_xops_memory(s->xops) & LOOM_XOPS_DEVICE_MEM);
    if (chosen && s->xops && (m->dev_reduce || !m->central))
        loom_info("cross_device_ops = \"auto\": %s (%s); the gradients are reduced in %s memory", s->xops->name,
                  why, m->dev_reduce ? "device" : "host");
    else if (chosen && s->xops)
        loom_info("cross_device_ops = \"auto\": no op of GPU memory is loaded, so central_storage sums the "
                  "downloaded gradients in host memory itself");
    if (m->central && !m->dev_reduce) {
        if (s->xops && !chosen && strcmp(s->xops->name, "reduce_to_one_device")) {
            char w[600];
            loom_loc_str(&st->cross_device_ops_loc, w, sizeof w);
            const char *setting = strncmp(w, "--set ", 6) ? "strategy.cross_device_ops: " : "";
            return loom_err_set(err, LOOM_ECONFIG, w, "%s\"%s\" would reduce the gradients in host memory, where "
                                "central_storage sums them itself; it takes an op only to reduce device replicas' "
                                "gradients in device memory", setting, s->xops->name),
                   loom_err_hint(err, "remove the setting (central_storage sums in replica order, as "
                                 "reduce_to_one_device does), use an op of device memory (nccl) with gpu devices, "
                                 "or use type = \"mirrored\"");
        }
        if (chosen) s->xops = NULL;
        return LOOM_OK;
    }
    if (m->n == 1) return LOOM_OK;
    int rc = loom_xcomm_open(&m->comm, s->xops, m->n, err);
    if (!rc) loom_xcomm_set_timeouts(m->comm, LOOM_XCOMM_STALL_WARN, st->collective_timeout);
    return rc;
}

static int new_replica(loom_strategy *s, replicated *m, replica *rp, int intra, int64_t max_share, loom_err *err)
{
    const loom_strategy_args *a = s->args;
    const loom_spec *spec = a->spec;
    int rc = loom_strategy_model_new_(&rp->model, a, max_share, err);
    if (!rc) rc = loom_model_set_threads(rp->model, intra, err);
    if (rc) return rc;
    /* every replica starts from the same seed: equal variables, as a broadcast would make them
     * (`loom check`, plan_only: no values wanted, 25M of them took ResNet-50's check 0.3 s) */
    if (!a->plan_only) loom_model_init_params(rp->model, m->seed);
    int r = (int)(rp - m->rep);
    if (m->place.ops && (rc = loom_model_dev_open(&rp->dev, rp->model, m->place.ops, loom_place_index_(&m->place, r),
                                                  err)))
        return rc;
    if (rp != m->rep) return LOOM_OK;
    rc = loom_optimizer_new(&rp->opt, &spec->optimizer, loom_model_num_params(rp->model), err);
    if (!rc) loom_optimizer_for_model(rp->opt, rp->model);
    /* central: the update runs on all replica threads; mirrored: each replica's shard on its own */
    if (!rc && m->central) loom_optimizer_set_pool(rp->opt, m->pool);
    /* embedding tables: the reduced gradient holds every replica's rows, so
     * the lazy update scans the table's gradient for them (densified) */
    if (!rc) loom_optimizer_set_tables(rp->opt, rp->model, 0);
    return rc;
}

/* Synchronised batch normalization (nn.h: loom_model_set_bn_sync): replica
 * rp's buf becomes the sum of every replica's. The replicas meet at a
 * barrier; each sums its slice of the elements over the replicas in replica
 * order and writes it into every buffer (the same bits everywhere), and they
 * meet again before any returns. Under multi_worker_mirrored replica 0 then
 * sums the result across the workers and the others copy it. The local part
 * cannot fail, and nn makes every call on every replica (with zeros when it
 * has no examples or failed), so no replica is left at the barrier. */
static int bn_sync(void *arg, float *buf, int64_t n, loom_err *err)
{
    replica *rp = arg;
    replicated *m = rp->owner;
    const int r = (int)(rp - m->rep);
    if (m->n > 1) {
        m->sync_buf[r] = buf;
        pthread_barrier_wait(&m->sync_bar);
        for (int64_t i = n * r / m->n, i1 = n * (r + 1) / m->n; i < i1; i++) {
            float acc = m->sync_buf[0][i];
            for (int k = 1; k < m->n; k++) acc += m->sync_buf[k][i];
            for (int k = 0; k < m->n; k++) m->sync_buf[k][i] = acc;
        }
        pthread_barrier_wait(&m->sync_bar);
    }
    if (!m->sync_cross) return LOOM_OK;
    if (r == 0) m->sync_rc = m->sync_cross(m->sync_cross_arg, buf, n, &m->sync_err);
    if (m->n > 1) {
        pthread_barrier_wait(&m->sync_bar);
        if (!m->sync_rc && r) memcpy(buf, m->sync_buf[0], (size_t)n * sizeof *buf);
    }
    int rc = m->sync_rc;
    if (rc) *err = m->sync_err;
    if (m->n > 1) pthread_barrier_wait(&m->sync_bar); /* replica 0's buffer stays until every copy is made */
    return rc;
}

/* Gives every replica's model bn_sync when it has synchronised batch
 * normalization layers and there is someone to sync with. */
static int enable_bn_sync(replicated *m, loom_err *err)
{
    if (!loom_model_num_sync_bn(m->rep[0].model) || (m->n == 1 && !m->sync_cross)) return LOOM_OK;
    if (m->n > 1 && !m->sync_bar_init) {
        if (!(m->sync_buf = loom_calloc((size_t)m->n, sizeof *m->sync_buf)))
            return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating the batch normalization sync");
        if (pthread_barrier_init(&m->sync_bar, NULL, (unsigned)m->n))
            return loom_err_set(err, LOOM_ENOMEM, NULL, "pthread_barrier_init failed");
        m->sync_bar_init = 1;
    }
    for (int r = 0; r < m->n; r++) loom_model_set_bn_sync(m->rep[r].model, bn_sync, &m->rep[r]);
    return LOOM_OK;
}

static int rep_open(loom_strategy *s, const loom_strategy_args *a, int central, loom_err *err)
{
    const loom_spec *spec = a->spec;
    replicated *m = loom_calloc(1, sizeof *m);
    if (!m) return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating the %s strategy", central ? "central_storage" : "mirrored");
    s->impl = m;
    m->central = central;
    m->seed = spec->run.seed;
    int rc = resolve_devices(m, spec, a->max_batch, err);
    if (rc) return rc;
    int budget = spec->run.threads > 0 ? spec->run.threads : loom_num_cores();
    int intra = budget / m->n > 1 ? budget / m->n : 1;
    m->rep = loom_alloc_aligned((size_t)m->n * sizeof *m->rep);
    if (!m->rep) return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating %d replicas", m->n);
    memset(m->rep, 0, (size_t)m->n * sizeof *m->rep);
    for (int r = 0; r < m->n; r++) m->rep[r].owner = m;
    if ((rc = loom_pool_new(&m->pool, m->n, err))) return rc;
    pin_replicas(m, intra);
    if (central) {
        if (pthread_barrier_init(&m->bar, NULL, (unsigned)m->n))
            return loom_err_set(err, LOOM_ENOMEM, NULL, "pthread_barrier_init failed");
        m->bar_init = 1;
    }
    int64_t share = (a->max_batch + m->n - 1) / m->n; /* the largest share loom_batch_split gives */
    for (int r = 0; r < m->n; r++)
        if ((rc = new_replica(s, m, &m->rep[r], intra, share, err))) return rc;
    if ((rc = enable_bn_sync(m, err))) return rc;
    m->P = loom_model_num_params(m->rep[0].model);
    /* an op of device memory only with cpu replicas run natively was refused by loom_strategy_open */
    if ((rc = resolve_xops(s, m, &spec->strategy, err)) || (central && !m->dev_reduce)) return rc;
    /* strategy.bytes_per_pack / num_packs (default: one pack of everything); central_storage: dev_reduce's */
    loom_model *m0 = m->rep[0].model;
    int nt = loom_model_num_param_tensors(m0);
    loom_param_info *pi = loom_alloc((size_t)(nt ? nt : 1) * sizeof *pi);
    if (!pi) return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating the parameter list");
    for (int i = 0; i < nt; i++) pi[i] = *loom_model_param_tensor(m0, i);
    /* central_storage has no packing settings: one pack */
    rc = loom_pack_plan(pi, nt, central ? 0 : spec->strategy.bytes_per_pack, central ? 1 : spec->strategy.num_packs,
                        &m->packs, &m->n_packs, err);
    loom_free(pi);
    return rc;
}

static int mirrored_open(loom_strategy *s, const loom_strategy_args *a, loom_err *err) { return rep_open(s, a, 0, err); }
static int central_open(loom_strategy *s, const loom_strategy_args *a, loom_err *err) { return rep_open(s, a, 1, err); }

static void rep_close(loom_strategy *s)
{
    replicated *m = s->impl;
    if (!m) return;
    loom_pool_free(m->pool);
    loom_xcomm_close(m->comm);
    if (m->bar_init) pthread_barrier_destroy(&m->bar);
    if (m->sync_bar_init) pthread_barrier_destroy(&m->sync_bar);
    loom_free(m->sync_buf);
    for (int r = 0; m->rep && r < m->n; r++) {
        loom_model_dev_close(m->rep[r].dev);
        loom_model_free(m->rep[r].model);
        loom_optimizer_free(m->rep[r].opt);
    }
    loom_free(m->rep);
    loom_free(m->packs);
    loom_free(m);
}

/* ---- the replicas' work ------------------------------------------------------ */

/* central_storage: replica r > 0 reads the central variables after an
 * update; on a device every replica then uploads them (replica 0's were
 * updated in place). */
static int refresh(replicated *m, int r)
{
    if (!m->central || !m->stale) return LOOM_OK;
    if (r > 0)
        memcpy(loom_model_params(m->rep[r].model), loom_model_params(m->rep[0].model), (size_t)m->P * sizeof(float));
    return m->rep[r].dev ? loom_model_dev_upload_params(m->rep[r].dev, &m->rep[r].err) : LOOM_OK;
}

/* Replica r's dropout key: the job's replica index (rank0 + r) keys it, so
 * replica k of a multi-worker job draws the mask of replica k in one process. */
static uint64_t rng_key(const replicated *m, int r)
{
    uint64_t k = loom_rng_mix(m->seed, (uint64_t)m->step);
    r += m->rank0;
    return r == 0 ? k : loom_rng_mix(k, (uint64_t)r);
}

/* Forward, loss and backward of replica r's share; a replica without
 * examples contributes a zero gradient. With dev_reduce the gradients stay in
 * the device's buffer. */
static int replica_grads(loom_strategy *s, replicated *m, int r)
{
    replica *rp = &m->rep[r];
    const loom_tensor *x = &rp->share.t[input_idx(s)], *y = &rp->share.t[label_idx(s)];
    rp->res.examples = x->shape.dim[0];
    loom_strategy_weights_(s->args, rp->model, &rp->share);
    if (rp->res.examples == 0) {
        memset(loom_model_grads(rp->model), 0, (size_t)m->P * sizeof(float));
        int rc = loom_model_bn_sync_idle(rp->model, LOOM_BN_SYNC_STEP, &rp->err); /* takes part with zeros */
        if (rc) return rc;
        return m->dev_reduce ? loom_model_dev_upload_grads(rp->dev, &rp->err) : LOOM_OK;
    }
    if (m->dev_reduce)
        return loom_model_dev_train_step_keep(rp->dev, x, y, m->global_batch, rng_key(m, r), &rp->res.loss_sum,
                                              &rp->res.correct, &rp->err);
    if (rp->dev) /* the gradients are downloaded into the model's buffer */
        return loom_model_dev_train_step(rp->dev, x, y, m->global_batch, rng_key(m, r), &rp->res.loss_sum,
                                         &rp->res.correct, &rp->err);
    return loom_model_train_step(rp->model, x, y, m->global_batch, rng_key(m, r), &rp->res.loss_sum,
                                 &rp->res.correct, &rp->err);
}

/* SUM-all-reduce replica r's gradient buffer g (the host's, or with
 * dev_reduce the device's) with the others', pack by pack. Every rank calls
 * it (and the collectives below) even after a failure of its own, so the
 * others never wait for it. */
static int reduce_packs(replicated *m, int r, float *g, loom_err *err)
{
    int rc = LOOM_OK;
    for (int k = 0; k < m->n_packs && m->comm; k++) {
        int c = loom_xcomm_all_reduce(m->comm, r, g + m->packs[k].offset, m->packs[k].count, LOOM_REDUCE_SUM, err);
        if (!rc) rc = c;
    }
    return rc;
}

/* The reduction before a sharded update: with one pack, a reduce-scatter of
 * the whole buffer; with several, packs cut the buffer where the shards must
 * not (see mirrored_apply_shard), so every pack is all-reduced. */
static int mirrored_reduce_scatter(replicated *m, int r, loom_err *err)
{
    if (m->n_packs > 1 || !m->comm || loom_optimizer_needs_full_grads(m->rep[0].opt)) /* clip_norm: the whole norm */
        return reduce_packs(m, r, loom_model_grads(m->rep[r].model), err);
    return loom_xcomm_reduce_scatter(m->comm, r, loom_model_grads(m->rep[r].model), m->P, LOOM_REDUCE_SUM, err);
}

/* Replica r's update of its shard of the variables with the one optimizer.
 * The shards of the whole buffer are on 16-float lines: the optimizer's
 * vector loop then covers the same elements as when it updates everything,
 * so the bits are those of one whole update (a loop's scalar tail may round
 * differently). */
static void mirrored_apply_shard(replicated *m, int r)
{
    replica *rp = &m->rep[r];
    int64_t lo = 0, hi = m->P;
    if (m->comm) loom_xcomm_shard(m->comm, r, m->P, &lo, &hi);
    loom_optimizer_apply_range(m->rep[0].opt, loom_model_pool(rp->model), loom_model_params(rp->model),
                               loom_model_grads(rp->model), m->step, lo, hi);
}

static int mirrored_gather(replicated *m, int r, loom_err *err)
{
    return m->comm ? loom_xcomm_all_gather_shards(m->comm, r, loom_model_params(m->rep[r].model), m->P, err)
                   : LOOM_OK;
}

/* central_storage: replica r sums its slice (on 16-float lines) of every
 * replica's gradients into replica 0's, in replica order. */
static void central_sum(replicated *m, int r)
{
    int64_t lines = (m->P + 15) / 16, i0 = lines * r / m->n * 16, i1 = lines * (r + 1) / m->n * 16;
    if (i1 > m->P) i1 = m->P;
    float *restrict dst = loom_model_grads(m->rep[0].model);
    for (int k = 1; k < m->n; k++) {
        const float *restrict src = loom_model_grads(m->rep[k].model);
        for (int64_t i = i0; i < i1; i++) dst[i] += src[i];
    }
}

/* After the all-reduce every rank has arrived, so every replica's rc of its
 * gradients (set before arriving) is visible: all apply, or none does. */
static int all_ok(const replicated *m)
{
    for (int k = 0; k < m->n; k++)
        if (m->rep[k].rc) return 0;
    return 1;
}

/* The fused update's apply (loom_xcomm_update): parameters [lo, hi) of
 * replica r with the one optimizer, unless some replica's gradients failed,
 * which every rank knows by then (each set its rc before publishing them). */
typedef struct update_arg {
    replicated *m;
    int         r;
} update_arg;

static void update_range(void *arg, int64_t lo, int64_t hi)
{
    const update_arg *u = arg;
    replica *rp = &u->m->rep[u->r];
    if (!all_ok(u->m)) return;
    loom_optimizer_apply_range(u->m->rep[0].opt, loom_model_pool(rp->model), loom_model_params(rp->model),
                               loom_model_grads(rp->model), u->m->step, lo, hi);
}

/* dev_reduce, mirrored: the device gradients are all-reduced; replica r
 * downloads its shard of the sum and updates that shard of its variables,
 * and the variables are all-gathered on the host. The all-gather of shards
 * copies host memory at the communicator's own rendezvous and never calls the
 * op, so the communicator of an op of device memory serves for it. */
static int mirrored_update_device(replicated *m, int r, loom_err *err)
{
    replica *rp = &m->rep[r];
    int rc = reduce_packs(m, r, loom_model_dev_grads(rp->dev), err);
    if (!rc && all_ok(m)) {
        int64_t lo = 0, hi = m->P;
        if (m->comm) loom_xcomm_shard(m->comm, r, m->P, &lo, &hi);
        if (loom_optimizer_needs_full_grads(m->rep[0].opt)) lo = 0, hi = m->P; /* clip_norm reads all */
        if (!(rc = loom_model_dev_download_grads(rp->dev, lo, hi, err))) mirrored_apply_shard(m, r);
    }
    int gc = mirrored_gather(m, r, rc ? NULL : err); /* every rank gathers, as every rank reduced */
    return rc ? rc : gc;
}

/* dev_reduce, central_storage: the device gradients are all-reduced and
 * replica 0 downloads the sum for the one update. */
static int central_reduce_device(replicated *m, int r, loom_err *err)
{
    int rc = reduce_packs(m, r, loom_model_dev_grads(m->rep[r].dev), err);
    return !rc && r == 0 && all_ok(m) ? loom_model_dev_download_grads(m->rep[0].dev, 0, m->P, err) : rc;
}

/* mirrored: one training step of replica r, update included. With one pack
 * the reduce-scatter, the shard's update and the all-gather are one
 * collective (loom_xcomm_update): the same bits in fewer passes. */
static void mirrored_train(loom_strategy *s, replicated *m, int r)
{
    replica *rp = &m->rep[r];
    rp->rc = replica_grads(s, m, r);
    loom_err rerr;
    int rc, gc = LOOM_OK;
    if (m->dev_reduce) {
        rc = mirrored_update_device(m, r, &rerr);
    } else if (m->comm && m->n_packs <= 1 && !loom_optimizer_needs_full_grads(m->rep[0].opt)) {
        update_arg u = {m, r};
        rc = loom_xcomm_update(m->comm, r, loom_model_grads(rp->model), loom_model_params(rp->model), m->P,
                               update_range, &u, &rerr);
    } else {
        rc = mirrored_reduce_scatter(m, r, &rerr);
        if (!rc && all_ok(m)) mirrored_apply_shard(m, r);
        gc = mirrored_gather(m, r, rc ? NULL : &rerr); /* every rank gathers, as every rank reduced */
    }
    if (!rc && !gc && rp->dev) gc = loom_model_dev_upload_params(rp->dev, &rerr); /* the new variables to the device */
    if (rc || gc) {
        rp->reduce_rc = rc ? rc : gc;
        rp->reduce_err = rerr;
    }
}

static int step_part_item(loom_strategy *s, replicated *m, int r);

/* The gradient hook of replica rp during a multi-worker step (JOB_GRADS):
 * the packs whose gradients are now final are summed over the local
 * replicas (the same all-reduces, in the same order, as after the step),
 * and replica 0 hands each to multi_worker's communicator. */
static void on_grads_ready(void *arg, int first_final)
{
    replica *rp = arg;
    replicated *m = rp->owner;
    int r = (int)(rp - m->rep);
    while (rp->packs_done < m->n_packs && m->packs[rp->packs_done].first >= first_final) {
        int k = rp->packs_done++;
        if (m->comm) {
            loom_err rerr;
            int c = loom_xcomm_all_reduce(m->comm, r, loom_model_grads(rp->model) + m->packs[k].offset,
                                          m->packs[k].count, LOOM_REDUCE_SUM, &rerr);
            if (c && !rp->reduce_rc) rp->reduce_rc = c, rp->reduce_err = rerr;
        }
        if (r == 0) m->pack_ready(m->pack_arg, k);
    }
}

/* Item r of a job: replica r's work. */
static void replica_item(void *arg, int r)
{
    loom_strategy *s = arg;
    replicated *m = s->impl;
    replica *rp = &m->rep[r];
    rp->rc = rp->reduce_rc = LOOM_OK;
    memset(&rp->res, 0, sizeof rp->res);
    int frc = refresh(m, r); /* on failure the job still runs (central_storage's barrier waits for all) but fails */
    const loom_tensor *x = &rp->share.t[input_idx(s)];
    switch (m->job) {
    case JOB_TRAIN:
        if (!m->central) {
            mirrored_train(s, m, r);
            break;
        }
        rp->rc = replica_grads(s, m, r);
        if (m->dev_reduce) {
            loom_err rerr;
            if ((rp->reduce_rc = central_reduce_device(m, r, &rerr))) rp->reduce_err = rerr;
            break;
        }
        pthread_barrier_wait(&m->bar); /* every gradient is ready */
        central_sum(m, r);
        break;
    case JOB_EVAL:
        rp->res.examples = x->shape.dim[0];
        loom_strategy_weights_(s->args, rp->model, &rp->share);
        if (rp->res.examples && rp->dev)
            rp->rc = loom_model_dev_evaluate(rp->dev, x, &rp->share.t[label_idx(s)], &rp->res.loss_sum,
                                             &rp->res.correct, &rp->err);
        else if (rp->res.examples)
            rp->rc = loom_model_evaluate(rp->model, x, &rp->share.t[label_idx(s)], &rp->res.loss_sum,
                                         &rp->res.correct, &rp->err);
        break;
    case JOB_PREDICT:
        loom_strategy_inputs_(s->args, rp->model, &rp->share); /* model.inputs beyond the first */
        if (x->shape.dim[0] && rp->dev)
            rp->rc = loom_model_dev_predict(rp->dev, x, m->out + rp->row0 * m->classes, &rp->err);
        else if (x->shape.dim[0])
            rp->rc = loom_model_predict(rp->model, x, m->out + rp->row0 * m->classes, &rp->err);
        break;
    case JOB_PART:
        rp->rc = step_part_item(s, m, r);
        break;
    case JOB_GRADS: { /* multi-worker: gradients, summed locally into every replica's buffer */
        rp->packs_done = 0;
        if (m->pack_ready) loom_model_set_grad_hook(rp->model, on_grads_ready, rp); /* packs reduced during backward */
        rp->rc = replica_grads(s, m, r);
        loom_model_set_grad_hook(rp->model, NULL, NULL);
        for (int k = rp->packs_done; k < m->n_packs && m->comm; k++) { /* the packs no hook reduced, in order */
            loom_err rerr;
            int c = loom_xcomm_all_reduce(m->comm, r, loom_model_grads(rp->model) + m->packs[k].offset,
                                          m->packs[k].count, LOOM_REDUCE_SUM, &rerr);
            if (c && !rp->reduce_rc) rp->reduce_rc = c, rp->reduce_err = rerr;
        }
        break;
    }
    case JOB_IDLE: /* multi-worker: this worker has no examples; its replicas take part in the syncs */
        rp->rc = loom_model_bn_sync_idle(rp->model, LOOM_BN_SYNC_STEP, &rp->err);
        break;
    case JOB_APPLY: { /* multi-worker: the job's summed gradients, shard by shard */
        int64_t lo = 0, hi = m->P;
        if (m->comm) loom_xcomm_shard(m->comm, r, m->P, &lo, &hi);
        loom_optimizer_apply_range(m->rep[0].opt, loom_model_pool(rp->model), loom_model_params(rp->model),
                                   m->ext_grads, m->step, lo, hi);
        loom_err rerr;
        int gc = mirrored_gather(m, r, &rerr);
        if (!gc && rp->dev) gc = loom_model_dev_upload_params(rp->dev, &rerr);
        if (gc) rp->reduce_rc = gc, rp->reduce_err = rerr;
        break;
    }
    }
    if (frc && !rp->rc) rp->rc = frc;
}

/* Splits batch among the replicas (NULL: keep the last split) and runs the
 * job; the first failing replica's error, in replica order, is the job's. */
static int run_job(loom_strategy *s, int job, const loom_elem *batch, loom_err *err)
{
    replicated *m = s->impl;
    m->job = job;
    if (batch) {
        m->global_batch = m->loss_div > 0 ? m->loss_div : batch->t[input_idx(s)].shape.dim[0];
        int64_t row0 = 0;
        for (int r = 0; r < m->n; r++) {
            int rc = loom_batch_split(batch, m->n, r, &m->rep[r].share, err);
            if (rc) return rc;
            m->rep[r].row0 = row0;
            row0 += m->rep[r].share.t[input_idx(s)].shape.dim[0];
        }
    }
    loom_pool_run(m->pool, m->n, replica_item, s);
    m->stale = 0; /* every replica has read the variables */
    for (int r = 0; r < m->n; r++)
        if (m->rep[r].rc || m->rep[r].reduce_rc) {
            if (err) *err = m->rep[r].rc ? m->rep[r].err : m->rep[r].reduce_err;
            return m->rep[r].rc ? m->rep[r].rc : m->rep[r].reduce_rc;
        }
    return LOOM_OK;
}

static void sum_results(const replicated *m, loom_step_result *out)
{
    memset(out, 0, sizeof *out);
    for (int r = 0; r < m->n; r++) {
        out->loss_sum += m->rep[r].res.loss_sum;
        out->correct += m->rep[r].res.correct;
        out->examples += m->rep[r].res.examples;
    }
}

/* central_storage: the one update, on all replica threads; the others read
 * the new variables at their next job. */
static void central_apply(replicated *m)
{
    loom_optimizer_apply(m->rep[0].opt, loom_model_params(m->rep[0].model), loom_model_grads(m->rep[0].model),
                         m->step);
    m->stale = 1;
}

static int rep_train_step(loom_strategy *s, const loom_elem *batch, int64_t step, loom_step_result *out, loom_err *err)
{
    replicated *m = s->impl;
    m->step = step;
    int rc = run_job(s, JOB_TRAIN, batch, err);
    sum_results(m, out);
    if (!rc && m->central) central_apply(m);
    return rc;
}

static int rep_eval_step(loom_strategy *s, const loom_elem *batch, loom_step_result *out, loom_err *err)
{
    replicated *m = s->impl;
    int rc = run_job(s, JOB_EVAL, batch, err);
    sum_results(m, out);
    return rc;
}

static int rep_predict(loom_strategy *s, const loom_elem *batch, float *out, loom_err *err)
{
    replicated *m = s->impl;
    loom_shape os = loom_model_output_shape(m->rep[0].model);
    m->classes = loom_shape_numel(&os);
    if (loom_model_num_heads(m->rep[0].model) > 1) m->classes = loom_model_predict_width(m->rep[0].model);
    m->out = out;
    /* predict passes an element holding only the inputs: split those tensors alone */
    const loom_strategy_args *a = s->args;
    int n_in = a->n_inputs > 1 ? a->n_inputs : 1;
    loom_elem in = {.n = n_in};
    in.t[0] = batch->t[input_idx(s)];
    for (int f = 1; f < n_in; f++) in.t[f] = batch->t[a->inputs_idx[f]];
    int64_t row0 = 0;
    for (int r = 0; r < m->n; r++) {
        loom_elem part;
        int rc = loom_batch_split(&in, m->n, r, &part, err);
        if (rc) return rc;
        m->rep[r].share.n = batch->n;
        m->rep[r].share.t[input_idx(s)] = part.t[0];
        for (int f = 1; f < n_in; f++) m->rep[r].share.t[a->inputs_idx[f]] = part.t[f];
        m->rep[r].row0 = row0;
        row0 += part.t[0].shape.dim[0];
    }
    return run_job(s, JOB_PREDICT, NULL, err);
}

/* ---- custom training steps (a Lua train_step), part by part ---------------------- */

/* dev_reduce, a custom step's all-reduce: backward downloaded the gradients,
 * which the step may have changed since (clipping), so they go up again; the
 * op sums them on the devices, and the sum comes down where the host path
 * leaves it: into every mirrored replica's buffer, into replica 0's for
 * central_storage. */
static int part_reduce_device(replicated *m, int r, loom_err *err)
{
    replica *rp = &m->rep[r];
    loom_err rerr;
    int rc = loom_model_dev_upload_grads(rp->dev, err);
    int c = reduce_packs(m, r, loom_model_dev_grads(rp->dev), rc ? &rerr : err); /* every rank reduces */
    if (rc || (rc = c)) return rc;
    return m->central && r > 0 ? LOOM_OK : loom_model_dev_download_grads(rp->dev, 0, m->P, err);
}

static int step_part_item(loom_strategy *s, replicated *m, int r)
{
    replica *rp = &m->rep[r];
    const loom_tensor *x = &rp->share.t[input_idx(s)], *y = &rp->share.t[label_idx(s)];
    int64_t B = x->shape.dim[0];
    switch (m->part) {
    case LOOM_PART_FORWARD:
        loom_strategy_weights_(s->args, rp->model, &rp->share);
        if (B && rp->dev) return loom_model_dev_forward(rp->dev, x, rng_key(m, r), &rp->err);
        return B ? loom_model_forward(rp->model, x, rng_key(m, r), &rp->err)
                 : loom_model_bn_sync_idle(rp->model, LOOM_BN_SYNC_FORWARD, &rp->err);
    case LOOM_PART_LOSS:
        rp->res.examples = B;
        loom_strategy_weights_(s->args, rp->model, &rp->share);
        if (B && rp->dev)
            return loom_model_dev_loss(rp->dev, y, m->global_batch, &rp->res.loss_sum, &rp->res.correct, &rp->err);
        return B ? loom_model_loss(rp->model, y, m->global_batch, &rp->res.loss_sum, &rp->res.correct, &rp->err)
                 : LOOM_OK;
    case LOOM_PART_BACKWARD: /* on a device, the gradients are downloaded into the model's buffer */
        if (B && rp->dev) return loom_model_dev_backward(rp->dev, &rp->err);
        if (B) return loom_model_backward(rp->model, &rp->err);
        memset(loom_model_grads(rp->model), 0, (size_t)m->P * sizeof(float));
        return loom_model_bn_sync_idle(rp->model, LOOM_BN_SYNC_BACKWARD, &rp->err);
    case LOOM_PART_ALL_REDUCE:
        if (m->dev_reduce) return part_reduce_device(m, r, &rp->err);
        if (m->central) {
            central_sum(m, r); /* backward finished in the previous job */
            return LOOM_OK;
        }
        return reduce_packs(m, r, loom_model_grads(rp->model), &rp->err);
    case LOOM_PART_APPLY: {
        if (m->central) return LOOM_OK;
        mirrored_apply_shard(m, r); /* the gradients are all-reduced: every shard is complete */
        int rc = mirrored_gather(m, r, &rp->err);
        return !rc && rp->dev ? loom_model_dev_upload_params(rp->dev, &rp->err) : rc;
    }
    }
    return loom_err_set(&rp->err, LOOM_EUSAGE, NULL, "unknown step part %d", (int)m->part);
}

static int rep_step_part(loom_strategy *s, loom_step_part part, const loom_elem *batch, int64_t step,
                         loom_step_result *per_replica, loom_err *err)
{
    replicated *m = s->impl;
    m->part = part;
    m->step = step;
    int rc = run_job(s, JOB_PART, part == LOOM_PART_FORWARD || part == LOOM_PART_LOSS ? batch : NULL, err);
    if (part == LOOM_PART_LOSS)
        for (int r = 0; r < m->n; r++) per_replica[r] = m->rep[r].res;
    if (!rc && part == LOOM_PART_APPLY && m->central) central_apply(m);
    return rc;
}

/* ---- the rest of the vtable ------------------------------------------------------- */

static loom_model *rep_model(loom_strategy *s) { return ((replicated *)s->impl)->rep[0].model; }
static loom_optimizer *rep_optimizer(loom_strategy *s) { return ((replicated *)s->impl)->rep[0].opt; }
static int rep_num_replicas(loom_strategy *s) { return ((replicated *)s->impl)->n; }

static loom_model *rep_replica(loom_strategy *s, int r)
{
    replicated *m = s->impl;
    return r >= 0 && r < m->n ? m->rep[r].model : NULL;
}

/* Replica 0's variables (and the optimizer's slots, which it holds whole) were
 * overwritten by a restore: every replica takes the variables. */
static int rep_sync(loom_strategy *s, loom_err *err)
{
    replicated *m = s->impl;
    if (m->central) {
        m->stale = 1; /* every replica's next job copies (r > 0) and uploads (on a device) them */
        return LOOM_OK;
    }
    const float *p0 = loom_model_params(m->rep[0].model);
    for (int r = 1; r < m->n; r++) memcpy(loom_model_params(m->rep[r].model), p0, (size_t)m->P * sizeof(float));
    for (int r = 0; r < m->n; r++) {
        int rc = m->rep[r].dev ? loom_model_dev_upload_params(m->rep[r].dev, err) : LOOM_OK;
        if (rc) return rc;
    }
    return LOOM_OK;
}

/* ---- the plan, for `loom check` ------------------------------------------------- */

static void print_bytes(FILE *f, int64_t b)
{
    if (b >= 1 << 20)
        fprintf(f, "%.2f MiB", (double)b / (1 << 20));
    else if (b >= 1 << 10)
        fprintf(f, "%.1f KiB", (double)b / (1 << 10));
    else
        fprintf(f, "%lld bytes", (long long)b);
}

static void print_shares(FILE *f, const replicated *m, int64_t b)
{
    int64_t c = (b + m->n - 1) / m->n;
    for (int r = 0; r < m->n; r++) {
        int64_t lo = c * r < b ? c * r : b, hi = c * (r + 1) < b ? c * (r + 1) : b;
        if (r == 8 && m->n > 9) {
            fprintf(f, ", ...");
            break;
        }
        fprintf(f, "%s%lld", r ? ", " : "", (long long)(hi - lo));
    }
}

static void rep_print_plan(loom_strategy *s, int64_t global_batch, FILE *f)
{
    const replicated *m = s->impl;
    const loom_model *m0 = m->rep[0].model;
    fprintf(f, "strategy: %s, %d replica%s on ", kind_name(m), m->n, m->n == 1 ? "" : "s");
    for (int r = 0; r < m->n && r < LOOM_MAX_DEVICES; r++) fprintf(f, "%s%s", r ? ", " : "", m->devices[r]);
    fprintf(f, "%s; %d compute thread%s each%s\n", m->n > LOOM_MAX_DEVICES ? ", ..." : "", loom_model_threads(m0),
            loom_model_threads(m0) == 1 ? "" : "s", m->pinned ? ", pinned to its core" : "");
    fprintf(f, "  global batch %lld, per-replica batch ", (long long)global_batch);
    print_shares(f, m, global_batch);
    fprintf(f, " (ceil(B / %d) each, in order; a short last batch splits unevenly)\n", m->n);
    char what[200];
    fprintf(f, "  compute: %s\n", loom_place_describe_(&m->place, what, sizeof what));
    if (m->dev_reduce)
        fprintf(f, "  gradients: reduced in device memory by \"%s\" (it works on device memory), then %s\n",
                s->xops->name, m->central ? "replica 0 downloads the sum" : "each replica downloads its shard");
    else if (m->central)
        fprintf(f, "  gradients: reduced in host memory (summed by the replica threads%s)\n",
                m->place.ops ? ", after every replica downloads its own" : "");
    else
        fprintf(f, "  gradients: reduced in host memory by \"%s\"%s\n", s->xops ? s->xops->name : "none",
                m->place.ops ? ", after every replica downloads its own" : "");
    int64_t bytes = m->P * (int64_t)sizeof(float);
    if (m->central) {
        fprintf(f, "  variables: one copy on the host (replica 0), one optimizer; per step the %d gradient buffers "
                "are %s (", m->n, m->dev_reduce ? "all-reduced once on the devices" : "summed once");
        print_bytes(f, bytes);
        fprintf(f, " each), the update applied once, and ");
        print_bytes(f, bytes * (m->n - 1));
        fprintf(f, " of variables copied to the other replicas\n");
        return;
    }
    fprintf(f, "  cross-device op: %s; %d pack%s (", s->xops ? s->xops->name : "none", m->n_packs,
            m->n_packs == 1 ? "" : "s");
    for (int k = 0; k < m->n_packs && k < 4; k++) {
        if (k) fputs(", ", f);
        print_bytes(f, m->packs[k].count * (int64_t)sizeof(float));
    }
    fprintf(f, "%s)%s; bytes_per_pack %lld, num_packs %d\n", m->n_packs > 4 ? ", ..." : "",
            m->n_packs > 1 ? " in reduction order" : "", (long long)s->args->spec->strategy.bytes_per_pack,
            s->args->spec->strategy.num_packs);
    fprintf(f, "  all-reduced per step: ");
    print_bytes(f, m->n > 1 ? bytes : 0);
    const char *how = m->dev_reduce ? "all-reduced on the devices"
                      : m->n_packs > 1 ? "all-reduced pack by pack"
                                       : "reduce-scattered";
    fprintf(f, " per replica (SUM of the gradients, %s); each replica updates its 1/%d of the variables, which "
            "are then all-gathered\n", how, m->n);
}

static void rep_where(loom_strategy *s, char *buf, size_t n)
{
    const replicated *m = s->impl;
    snprintf(buf, n, "%d %s replica%s, each", m->n, kind_name(m), m->n == 1 ? "" : "s");
}

/* mirrored and central_storage differ only in where the variables live,
 * which open decides; every other entry is shared. Two vtables all the
 * same: the registry keys strategies by name, and loom_replicated_owns_
 * tells them by pointer. */
static const loom_cluster_roles replicated_roles = {.flags = LOOM_ROLES_ONE_PROCESS}; /* its replicas are threads */
#define REPLICATED_OPS(NAME, OPEN)                                                                               \
    {                                                                                                            \
        .version = LOOM_STRATEGY_OPS_VERSION, .name = NAME, .open = OPEN, .close = rep_close,                    \
        .train_step = rep_train_step, .eval_step = rep_eval_step, .predict = rep_predict, .model = rep_model,    \
        .optimizer = rep_optimizer, .sync = rep_sync, .num_replicas = rep_num_replicas,                          \
        .step_part = rep_step_part, .replica = rep_replica, .caps = LOOM_STRATEGY_OWN_THREADS,                   \
        .print_plan = rep_print_plan, .where = rep_where, .roles = &replicated_roles,                            \
    }
static const loom_strategy_ops mirrored_ops = REPLICATED_OPS("mirrored", mirrored_open);
static const loom_strategy_ops central_storage_ops = REPLICATED_OPS("central_storage", central_open);

int loom_replicated_owns_(const loom_strategy_ops *ops) { return ops == &mirrored_ops || ops == &central_storage_ops; }

int loom_replicated_register_(loom_err *err)
{
    int rc = loom_register_strategy(&mirrored_ops, err);
    return rc ? rc : loom_register_strategy(&central_storage_ops, err);
}


/* ---- the local half of multi_worker_mirrored (mirrored_internal.h) ------------------ */

int loom_replicated_open_(loom_strategy *s, const loom_strategy_args *a, int rank0, int64_t loss_div, loom_err *err)
{
    int rc = rep_open(s, a, 0, err);
    if (rc) return rc;
    replicated *m = s->impl;
    m->rank0 = rank0;
    m->loss_div = loss_div;
    if (m->dev_reduce)
        return loom_err_set(err, LOOM_EUNSUPPORTED, NULL, "multi_worker_mirrored reduces host memory only: \"%s\" "
                            "works on device memory", s->xops->name),
               loom_err_hint(err, "use strategy.communication = \"ring\" and cpu replicas");
    return LOOM_OK;
}

int loom_replicated_grads_(loom_strategy *s, const loom_elem *batch, int64_t step, loom_step_result *out, loom_err *err)
{
    replicated *m = s->impl;
    m->step = step;
    memset(out, 0, sizeof *out);
    if (!batch) { /* this worker has no examples in this step: a zero gradient */
        memset(loom_model_grads(m->rep[0].model), 0, (size_t)m->P * sizeof(float));
        return m->sync_cross && loom_model_num_sync_bn(m->rep[0].model) ? run_job(s, JOB_IDLE, NULL, err) : LOOM_OK;
    }
    int rc = run_job(s, JOB_GRADS, batch, err);
    sum_results(m, out);
    return rc;
}

float *loom_replicated_grads0_(loom_strategy *s) { return loom_model_grads(((replicated *)s->impl)->rep[0].model); }

int64_t loom_replicated_num_params_(loom_strategy *s) { return ((replicated *)s->impl)->P; }

int loom_replicated_apply_(loom_strategy *s, const float *grads, int64_t step, loom_err *err)
{
    replicated *m = s->impl;
    m->step = step;
    m->ext_grads = grads;
    int rc = run_job(s, JOB_APPLY, NULL, err);
    m->ext_grads = NULL;
    return rc;
}

bool loom_replicated_shardable_(loom_strategy *s)
{
    replicated *m = s->impl;
    return m->n == 1 && !m->central && !m->rep[0].dev && !loom_optimizer_needs_full_grads(m->rep[0].opt);
}

void loom_replicated_apply_range_(loom_strategy *s, const float *grads, int64_t step, int64_t lo, int64_t hi)
{
    replicated *m = s->impl;
    loom_model *md = m->rep[0].model;
    loom_optimizer_apply_range(m->rep[0].opt, loom_model_pool(md), loom_model_params(md), grads, step, lo, hi);
}

void loom_replicated_set_pack_ready_(loom_strategy *s, void (*fn)(void *arg, int pack), void *arg)
{
    replicated *m = s->impl;
    m->pack_ready = fn;
    m->pack_arg = arg;
}

const loom_pack *loom_replicated_packs_(loom_strategy *s, int *n)
{
    replicated *m = s->impl;
    *n = m->n_packs;
    return m->packs;
}

const loom_strategy_ops *loom_mirrored_ops_(void) { return &mirrored_ops; }

int loom_replicated_set_bn_cross_(loom_strategy *s, int (*fn)(void *arg, float *buf, int64_t n, loom_err *err),
                                  void *arg, loom_err *err)
{
    replicated *m = s->impl;
    m->sync_cross = fn;
    m->sync_cross_arg = arg;
    return enable_bn_sync(m, err);
}
