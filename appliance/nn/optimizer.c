/* optimizer.c - SGD, momentum (Keras/TF), Adam, AdamW, RMSprop (Keras), LR
 * schedules, gradient clipping by global norm.
 * Each update is one fused pass over the flat parameter buffer; the slots
 * (momentum; Adam m then v) live in one contiguous allocation so a
 * checkpoint saves them with one write. With a pool, the pass is split into
 * contiguous parameter ranges, one per thread; the update is element-wise,
 * so the result does not depend on the split.
 * Adam follows TF/Keras: with t = step + 1,
 *   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
 *   lr_t = lr sqrt(1 - b2^t) / (1 - b1^t);  p -= lr_t m / (sqrt(v) + eps)
 * (epsilon is "epsilon hat" of the paper, applied after the bias correction
 * folded into lr_t, as TF does; not PyTorch's eps placement).
 * AdamW (Keras): first p -= lr wd p (decoupled: lr, not lr_t), then Adam's step.
 * RMSprop (Keras 3, momentum 0, not centered): v = rho v + (1 - rho) g^2;
 *   p -= lr g / sqrt(v + eps).
 * clip_norm (tf.clip_by_global_norm): with n = ||g|| over the whole buffer,
 *   every g is used as g * clip / max(n, clip); the gradients themselves are
 *   not changed.
 * Adagrad follows Keras (ResourceApplyAdagradV2): acc starts at
 * initial_accumulator_value, acc += g^2;  p -= lr g / (sqrt(acc) + eps).
 * Embedding tables (loom_optimizer_set_tables) are updated lazily: only
 * elements whose gradient is not 0.0, from the rows the batch touched. */
#include "nn_internal.h"

#include <math.h>
#include <string.h>

/* Baseline x86-64 builds get AVX2 / AVX-512 clones of the update loops (tensor.h LOOM_CLONES). */

struct loom_optimizer {
    loom_optimizer_spec spec;
    int64_t             n;           /* parameters */
    int                 n_slots;
    float              *slots;       /* (n_slots * n,) 64-byte aligned, zeroed */
    double              lr_override; /* > 0 replaces the schedule */
    loom_pool          *pool;        /* borrowed; NULL: the calling thread alone */
    int                 nonfinite;   /* an update left a NaN or infinite weight (atomic: ranges run concurrently) */
    int                 n_frozen;    /* parameter ranges that are not trained (loom_optimizer_for_model) */
    int64_t             frozen[2 * LOOM_MAX_LAYERS][2];
    const loom_model   *tables;      /* borrowed: the model whose embedding tables update lazily; NULL: none */
    int                 use_rows;    /* take the touched rows from the model's last backward */
    int                 n_tables;
    loom_sparse_grad    table[8];    /* offset, rows, dim of each (ids read at apply time) */
};

/* The exponent field of x: 0xff << 23 when x is NaN or infinite. Each update
 * loop keeps the max over the weights it writes (an integer max, which
 * vectorises), so the check rides on the update's own pass. */
static inline uint32_t exp_bits(float x)
{
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    return b & 0x7f800000u;
}

double loom_schedule_lr(const loom_schedule_spec *s, double base_lr, int64_t step)
{
    if (step < 0) step = 0;
    switch (s->kind) {
    case LOOM_SCHED_EXPONENTIAL_DECAY: {
        double ds = s->decay_steps > 0 ? (double)s->decay_steps : 1.0;
        double p = s->staircase ? floor((double)step / ds) : (double)step / ds;
        return base_lr * pow(s->decay_rate, p);
    }
    case LOOM_SCHED_PIECEWISE_CONSTANT: {
        /* tf.keras PiecewiseConstantDecay: values[0] while step <= b0, values[i] while b(i-1) < step <= b(i) */
        for (int i = 0; i < s->n_boundaries; i++)
            if (step <= s->boundaries[i]) return s->values[i];
        return s->values[s->n_boundaries];
    }
    case LOOM_SCHED_COSINE: {
        double ds = s->decay_steps > 0 ? (double)s->decay_steps : 1.0;
        double t = (double)step < ds ? (double)step : ds;
        double cosd = 0.5 * (1.0 + cos(M_PI * t / ds));
        return base_lr * ((1.0 - s->alpha) * cosd + s->alpha);
    }
    case LOOM_SCHED_CONSTANT:
    default:
        return base_lr;
    }
}

int loom_optimizer_new(loom_optimizer **out, const loom_optimizer_spec *spec, int64_t num_params, loom_err *err)
{
    char where[LOOM_PATH_MAX + 16] = "";
    if (spec->loc.file[0]) snprintf(where, sizeof where, "%s:%d", spec->loc.file, spec->loc.line);
    *out = NULL;
    if (num_params < 0) return loom_err_set(err, LOOM_EUSAGE, where, "num_params = %lld", (long long)num_params);
    if ((unsigned)spec->kind > LOOM_OPT_ADAGRAD)
        return loom_err_set(err, LOOM_ECONFIG, where, "unknown optimizer kind %d", (int)spec->kind);
    loom_optimizer *o = loom_calloc(1, sizeof *o);
    if (!o) return loom_err_set(err, LOOM_ENOMEM, where, "cannot allocate the optimizer");
    o->spec = *spec;
    o->n = num_params;
    o->n_slots = spec->kind == LOOM_OPT_SGD                                                                     ? 0
                 : spec->kind == LOOM_OPT_MOMENTUM || spec->kind == LOOM_OPT_RMSPROP || spec->kind == LOOM_OPT_ADAGRAD ? 1
                                                                                                                     : 2;
    if (o->n_slots) {
        size_t bytes = (size_t)(o->n_slots * (num_params ? num_params : 1)) * sizeof(float);
        if (!(o->slots = loom_alloc_zeroed(bytes))) {
            loom_free(o);
            return loom_err_set(err, LOOM_ENOMEM, where, "cannot allocate %zu bytes of optimizer slots", bytes);
        }
        if (spec->kind == LOOM_OPT_ADAGRAD)
            for (int64_t i = 0; i < num_params; i++) o->slots[i] = (float)spec->initial_accumulator;
    }
    *out = o;
    return LOOM_OK;
}

void loom_optimizer_free(loom_optimizer *o)
{
    if (!o) return;
    loom_free_zeroed(o->slots);
    loom_free(o);
}

double loom_optimizer_lr(const loom_optimizer *o, int64_t step)
{
    if (o->lr_override > 0) return o->lr_override;
    return loom_schedule_lr(&o->spec.schedule, o->spec.learning_rate, step);
}

void loom_optimizer_set_lr(loom_optimizer *o, double lr) { o->lr_override = lr > 0 ? lr : 0; }

static inline LOOM_CLONE_BODY uint32_t apply_sgd_body(int64_t n, float lr, float *restrict p, const float *restrict g)
{
    uint32_t e = 0;
    for (int64_t i = 0; i < n; i++) {
        float pi = p[i] - lr * g[i];
        p[i] = pi;
        uint32_t b = exp_bits(pi);
        e = b > e ? b : e;
    }
    return e;
}
LOOM_CLONES(, uint32_t, apply_sgd, (int64_t n, float lr, float *restrict p, const float *restrict g), (n, lr, p, g))

static inline LOOM_CLONE_BODY uint32_t apply_momentum_body(int64_t n, float lr, float mu, int nesterov,
                                                           float *restrict p, const float *restrict g,
                                                           float *restrict v)
{
    uint32_t e = 0;
    if (nesterov) {
        for (int64_t i = 0; i < n; i++) {
            float vi = mu * v[i] - lr * g[i];
            v[i] = vi;
            float pi = p[i] + (mu * vi - lr * g[i]);
            p[i] = pi;
            uint32_t b = exp_bits(pi);
            e = b > e ? b : e;
        }
    } else {
        for (int64_t i = 0; i < n; i++) {
            float vi = mu * v[i] - lr * g[i];
            v[i] = vi;
            float pi = p[i] + vi;
            p[i] = pi;
            uint32_t b = exp_bits(pi);
            e = b > e ? b : e;
        }
    }
    return e;
}
LOOM_CLONES(, uint32_t, apply_momentum,
            (int64_t n, float lr, float mu, int nesterov, float *restrict p, const float *restrict g,
             float *restrict v),
            (n, lr, mu, nesterov, p, g, v))

static inline LOOM_CLONE_BODY uint32_t apply_adam_body(int64_t n, float lr_t, float b1, float b2, float eps,
                                                       float *restrict p, const float *restrict g, float *restrict m,
                                                       float *restrict v)
{
    uint32_t e = 0;
    for (int64_t i = 0; i < n; i++) {
        float gi = g[i];
        float mi = b1 * m[i] + (1.f - b1) * gi;
        float vi = b2 * v[i] + (1.f - b2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        float pi = p[i] - lr_t * mi / (sqrtf(vi) + eps);
        p[i] = pi;
        uint32_t b = exp_bits(pi);
        e = b > e ? b : e;
    }
    return e;
}
LOOM_CLONES(, uint32_t, apply_adam,
            (int64_t n, float lr_t, float b1, float b2, float eps, float *restrict p, const float *restrict g,
             float *restrict m, float *restrict v),
            (n, lr_t, b1, b2, eps, p, g, m, v))

static inline LOOM_CLONE_BODY uint32_t apply_rmsprop_body(int64_t n, float lr, float rho, float eps, float *restrict p,
                                                          const float *restrict g, float *restrict v)
{
    uint32_t e = 0;
    for (int64_t i = 0; i < n; i++) {
        float gi = g[i];
        float vi = rho * v[i] + (1.f - rho) * gi * gi;
        v[i] = vi;
        float pi = p[i] - lr * gi / sqrtf(vi + eps);
        p[i] = pi;
        uint32_t b = exp_bits(pi);
        e = b > e ? b : e;
    }
    return e;
}
LOOM_CLONES(, uint32_t, apply_rmsprop,
            (int64_t n, float lr, float rho, float eps, float *restrict p, const float *restrict g, float *restrict v),
            (n, lr, rho, eps, p, g, v))

static inline LOOM_CLONE_BODY uint32_t apply_adagrad_body(int64_t n, float lr, float eps, float *restrict p,
                                                          const float *restrict g, float *restrict acc)
{
    uint32_t e = 0;
    for (int64_t i = 0; i < n; i++) {
        float gi = g[i];
        float ai = acc[i] + gi * gi;
        acc[i] = ai;
        float pi = p[i] - lr * gi / (sqrtf(ai) + eps);
        p[i] = pi;
        uint32_t b = exp_bits(pi);
        e = b > e ? b : e;
    }
    return e;
}
LOOM_CLONES(, uint32_t, apply_adagrad,
            (int64_t n, float lr, float eps, float *restrict p, const float *restrict g, float *restrict acc),
            (n, lr, eps, p, g, acc))

/* The lazy update of n elements of a table: params p[i], slots at p's own
 * offset i0 (+ i), gradients g[i] * clip; elements whose gradient is 0.0 are
 * left alone (AdamW's decay included). The same arithmetic as the dense
 * loops, element by element. */
static uint32_t apply_lazy(const loom_optimizer *o, float lr, float lr_raw, float clip, float *restrict p,
                           const float *restrict g, int64_t i0, int64_t n)
{
    uint32_t e = 0;
    const float b1 = (float)o->spec.beta1, b2 = (float)o->spec.beta2, eps = (float)o->spec.epsilon,
                mu = (float)o->spec.momentum, rho = (float)o->spec.rho, wd = lr_raw * (float)o->spec.weight_decay;
    float *s0 = o->slots ? o->slots + i0 : NULL, *s1 = o->n_slots > 1 ? o->slots + o->n + i0 : NULL;
    for (int64_t i = 0; i < n; i++) {
        if (g[i] == 0.f) continue;
        float gi = clip == 1.f ? g[i] : g[i] * clip, pi = p[i];
        switch (o->spec.kind) {
        case LOOM_OPT_SGD: pi = pi - lr * gi; break;
        case LOOM_OPT_MOMENTUM: {
            float vi = mu * s0[i] - lr * gi;
            s0[i] = vi;
            pi = o->spec.nesterov ? pi + (mu * vi - lr * gi) : pi + vi;
            break;
        }
        case LOOM_OPT_ADAMW:
            pi -= wd * pi;
            /* fall through */
        case LOOM_OPT_ADAM: {
            float mi = b1 * s0[i] + (1.f - b1) * gi;
            float vi = b2 * s1[i] + (1.f - b2) * gi * gi;
            s0[i] = mi;
            s1[i] = vi;
            pi = pi - lr * mi / (sqrtf(vi) + eps);
            break;
        }
        case LOOM_OPT_RMSPROP: {
            float vi = rho * s0[i] + (1.f - rho) * gi * gi;
            s0[i] = vi;
            pi = pi - lr * gi / sqrtf(vi + eps);
            break;
        }
        case LOOM_OPT_ADAGRAD: {
            float ai = s0[i] + gi * gi;
            s0[i] = ai;
            pi = pi - lr * gi / (sqrtf(ai) + eps);
            break;
        }
        }
        p[i] = pi;
        uint32_t b = exp_bits(pi);
        e = b > e ? b : e;
    }
    return e;
}

/* p *= (1 - lr wd) (AdamW's decoupled decay, before its Adam step). */
static inline LOOM_CLONE_BODY void decay_body(int64_t n, float k, float *restrict p)
{
    for (int64_t i = 0; i < n; i++) p[i] -= k * p[i];
}
LOOM_CLONES(, void, decay, (int64_t n, float k, float *restrict p), (n, k, p))

/* The decay of parameters [i0, i1) (at p), but not of the frozen ranges. */
static void decay_trained(const loom_optimizer *o, int64_t i0, int64_t i1, float k, float *p)
{
    int64_t a = i0;
    for (int f = 0; f < o->n_frozen && a < i1; f++) {
        int64_t f0 = o->frozen[f][0], f1 = o->frozen[f][1];
        if (f1 <= a || f0 >= i1) continue;
        if (f0 > a) decay(f0 - a, k, p + (a - i0));
        a = f1;
    }
    if (a < i1) decay(i1 - a, k, p + (a - i0));
}

void loom_optimizer_for_model(loom_optimizer *o, const loom_model *m)
{
    o->n_frozen = 0;
    for (int i = 0; i < m->n_layers; i++) { /* in layer order: the ranges ascend */
        const nn_layer_ *l = &m->layer[i];
        for (int t = 0; l->spec.kind == LOOM_LAYER_PLUGIN && t < l->pplan->n_params; t++) { /* a plugin's state */
            int64_t len;
            if (!nn_plugin_state_(l, l->poff[t], &len) || o->n_frozen >= 2 * LOOM_MAX_LAYERS) continue;
            o->frozen[o->n_frozen][0] = l->poff[t];
            o->frozen[o->n_frozen][1] = l->poff[t] + len;
            o->n_frozen++;
        }
        if (l->mm_off < 0) continue;
        o->frozen[o->n_frozen][0] = l->mm_off;
        o->frozen[o->n_frozen][1] = l->mm_off + 2 * l->C; /* moving mean, then moving variance */
        o->n_frozen++;
    }
}

/* g (n) * scale into out: the clipped gradients of one part. */
static inline LOOM_CLONE_BODY void scaled_body(int64_t n, float scale, const float *restrict g, float *restrict out)
{
    for (int64_t i = 0; i < n; i++) out[i] = g[i] * scale;
}
LOOM_CLONES(, void, scaled, (int64_t n, float scale, const float *restrict g, float *restrict out), (n, scale, g, out))

/* One update, over part `part` out of `parts` of parameters [lo, hi). */
typedef struct apply_job {
    const loom_optimizer *o;
    float                *params;
    const float          *grads;
    float                 clip;   /* clip_norm's factor (1: none) */
    float                 lr_raw; /* the schedule's lr (adamw's decay) */
    float                 lr;     /* sgd, momentum, rmsprop: lr; adam, adamw: lr_t */
    int64_t               lo, hi;
    int                   parts;
    int                  *nonfinite; /* set when the part left a non-finite weight */
    int                   lazy;      /* a table's range: apply_lazy */
} apply_job;

static uint32_t apply_block(const apply_job *j, int64_t i0, int64_t i1, const float *g);

static void apply_part(void *arg, int part)
{
    const apply_job *j = arg;
    /* parts of whole 16-float (64-byte) lines, so parts share no cache line */
    int64_t lines = (j->hi - j->lo + 15) / 16;
    int64_t i0 = j->lo + lines * part / j->parts * 16, i1 = j->lo + lines * (part + 1) / j->parts * 16;
    if (i1 > j->hi) i1 = j->hi;
    if (i0 >= i1) return;
    uint32_t e = 0;
    if (j->lazy) {
        e = apply_lazy(j->o, j->lr, j->lr_raw, j->clip, j->params + i0, j->grads + i0, i0, i1 - i0);
    } else if (j->clip != 1.f) { /* clipped gradients through a stack buffer, 4 KiB at a time */
        float buf[1024];
        for (int64_t a = i0; a < i1; a += 1024) {
            int64_t b = a + 1024 < i1 ? a + 1024 : i1;
            scaled(b - a, j->clip, j->grads + a, buf);
            uint32_t eb = apply_block(j, a, b, buf);
            e = eb > e ? eb : e;
        }
    } else {
        e = apply_block(j, i0, i1, j->grads + i0);
    }
    /* a non-finite gradient (or slot) makes a non-finite weight in every optimizer */
    if (e == 0x7f800000u) __atomic_store_n(j->nonfinite, 1, __ATOMIC_RELAXED);
}

/* The update of parameters [i0, i1) with their gradients g (i1 - i0); the max exponent bits written. */
static uint32_t apply_block(const apply_job *j, int64_t i0, int64_t i1, const float *g)
{
    const loom_optimizer *o = j->o;
    float *p = j->params + i0;
    uint32_t e = 0;
    switch (o->spec.kind) {
    case LOOM_OPT_SGD:
        e = apply_sgd(i1 - i0, j->lr, p, g);
        break;
    case LOOM_OPT_MOMENTUM:
        e = apply_momentum(i1 - i0, j->lr, (float)o->spec.momentum, o->spec.nesterov, p, g, o->slots + i0);
        break;
    case LOOM_OPT_ADAMW:
        decay_trained(o, i0, i1, j->lr_raw * (float)o->spec.weight_decay, p);
        /* fall through */
    case LOOM_OPT_ADAM:
        e = apply_adam(i1 - i0, j->lr, (float)o->spec.beta1, (float)o->spec.beta2, (float)o->spec.epsilon, p, g,
                   o->slots + i0, o->slots + o->n + i0);
        break;
    case LOOM_OPT_RMSPROP:
        e = apply_rmsprop(i1 - i0, j->lr, (float)o->spec.rho, (float)o->spec.epsilon, p, g, o->slots + i0);
        break;
    case LOOM_OPT_ADAGRAD:
        e = apply_adagrad(i1 - i0, j->lr, (float)o->spec.epsilon, p, g, o->slots + i0);
        break;
    }
    return e;
}

void loom_optimizer_set_pool(loom_optimizer *o, loom_pool *pool) { o->pool = pool; }

/* The step's learning rates: lr_raw the schedule's, *lr_t Adam's bias-corrected one (others: lr_raw). */
static double step_lr(const loom_optimizer *o, int64_t step, double *lr_t)
{
    double lr = loom_optimizer_lr(o, step);
    *lr_t = lr;
    if (o->spec.kind == LOOM_OPT_ADAM || o->spec.kind == LOOM_OPT_ADAMW) {
        double t = (double)(step + 1);
        *lr_t = lr * sqrt(1.0 - pow(o->spec.beta2, t)) / (1.0 - pow(o->spec.beta1, t));
    }
    return lr;
}

/* Rows ids[0..n) of the table at offset (dim floats a row), clipped to [lo, hi). */
static uint32_t apply_rows(const loom_optimizer *o, float lr, float lr_raw, float clip, float *params,
                           const float *grads, int64_t offset, int64_t dim, const int64_t *ids, int64_t n,
                           const float *values, int64_t lo, int64_t hi)
{
    uint32_t e = 0;
    for (int64_t k = 0; k < n; k++) {
        int64_t a = offset + ids[k] * dim, b = a + dim;
        int64_t a2 = a > lo ? a : lo, b2 = b < hi ? b : hi;
        if (a2 >= b2) continue;
        const float *g = values ? values + k * dim + (a2 - a) : grads + a2;
        uint32_t r = apply_lazy(o, lr, lr_raw, clip, params + a2, g, a2, b2 - a2);
        e = r > e ? r : e;
    }
    return e;
}

/* Reads o and writes only params, and the slots, in [lo, hi): disjoint ranges
 * may run at once from different threads. Tables' parts are lazy. */
static void apply_range(const loom_optimizer *o, loom_pool *pool, float *params, const float *grads, int64_t step,
                        int64_t lo, int64_t hi)
{
    double lr, lr_raw = step_lr(o, step, &lr);
    float clip = 1.f;
    if (o->spec.clip_norm > 0) { /* the global norm of the whole (reduced) buffer, whichever range is applied */
        double ss = 0;
        for (int64_t i = 0; i < o->n; i++) ss += (double)grads[i] * grads[i];
        double norm = sqrt(ss);
        if (norm > o->spec.clip_norm) clip = (float)(o->spec.clip_norm / norm);
    }
    apply_job j = {.o = o, .params = params, .grads = grads, .clip = clip, .lr_raw = (float)lr_raw, .lr = (float)lr,
                   .nonfinite = (int *)&o->nonfinite}; /* the one field ranges may write, atomically */
    /* [lo, hi) in runs: dense between the tables, lazy on them */
    int64_t cur = lo;
    for (int t = 0; t <= o->n_tables; t++) {
        int64_t a = hi, b = hi;
        if (t < o->n_tables) {
            const loom_sparse_grad *tb = &o->table[t];
            int64_t end = tb->offset + tb->rows * tb->dim;
            a = tb->offset > lo ? tb->offset : lo;
            b = end < hi ? end : hi;
            if (a >= b) continue;
        }
        if (cur < a) { /* below ~64K parameters a wake-up of the pool costs more than the pass */
            j.lo = cur, j.hi = a, j.lazy = 0;
            j.parts = pool && a - cur >= 65536 ? loom_pool_size(pool) : 1;
            loom_pool_run(j.parts > 1 ? pool : NULL, j.parts, apply_part, &j);
        }
        if (t == o->n_tables) break;
        if (o->use_rows) {
            loom_sparse_grad sg;
            loom_model_sparse_grad(o->tables, t, &sg);
            if (apply_rows(o, j.lr, j.lr_raw, clip, params, grads, sg.offset, sg.dim, sg.ids, sg.n, NULL, a, b) ==
                0x7f800000u)
                __atomic_store_n(j.nonfinite, 1, __ATOMIC_RELAXED);
        } else {
            j.lo = a, j.hi = b, j.lazy = 1;
            j.parts = pool && b - a >= 65536 ? loom_pool_size(pool) : 1;
            loom_pool_run(j.parts > 1 ? pool : NULL, j.parts, apply_part, &j);
        }
        cur = b;
    }
}

void loom_optimizer_set_tables(loom_optimizer *o, const loom_model *m, int use_rows)
{
    int n = loom_model_num_sparse(m);
    LOOM_ASSERT(n <= (int)(sizeof o->table / sizeof o->table[0]));
    o->tables = n ? m : NULL;
    o->use_rows = use_rows != 0;
    o->n_tables = n;
    for (int i = 0; i < n; i++) loom_model_sparse_grad(m, i, &o->table[i]);
}

void loom_optimizer_apply_rows(const loom_optimizer *o, float *params, const float *grads, int64_t step,
                               int64_t offset, int64_t dim, const int64_t *ids, int64_t n, const float *values)
{
    LOOM_ASSERT(offset >= 0 && dim >= 1);
    for (int64_t k = 0; k < n; k++) LOOM_ASSERT(ids[k] >= 0 && offset + (ids[k] + 1) * dim <= o->n);
    double lr, lr_raw = step_lr(o, step, &lr);
    if (apply_rows(o, (float)lr, (float)lr_raw, 1.f, params, grads, offset, dim, ids, n, values, 0, o->n) ==
        0x7f800000u)
        __atomic_store_n((int *)&o->nonfinite, 1, __ATOMIC_RELAXED);
}

void loom_optimizer_apply(loom_optimizer *o, float *params, const float *grads, int64_t step)
{
    apply_range(o, o->pool, params, grads, step, 0, o->n);
}

void loom_optimizer_apply_range(const loom_optimizer *o, loom_pool *pool, float *params, const float *grads,
                                int64_t step, int64_t lo, int64_t hi)
{
    LOOM_ASSERT(lo >= 0 && lo <= hi && hi <= o->n);
    apply_range(o, pool, params, grads, step, lo, hi);
}

int loom_optimizer_take_nonfinite(loom_optimizer *o)
{
    return __atomic_exchange_n(&o->nonfinite, 0, __ATOMIC_RELAXED);
}

void loom_optimizer_mark_nonfinite(loom_optimizer *o) { __atomic_store_n(&o->nonfinite, 1, __ATOMIC_RELAXED); }

int loom_optimizer_num_slots(const loom_optimizer *o) { return o->n_slots; }
bool loom_optimizer_needs_full_grads(const loom_optimizer *o) { return o->spec.clip_norm > 0; }
bool nn_optimizer_ranged_(const loom_optimizer *o) { return o->spec.clip_norm <= 0 && !o->n_tables && !o->n_frozen; }
float *loom_optimizer_slots(loom_optimizer *o) { return o->slots; }

const char *loom_optimizer_slot_name(const loom_optimizer *o, int i)
{
    if (i < 0 || i >= o->n_slots) return NULL;
    if (o->spec.kind == LOOM_OPT_MOMENTUM) return "momentum";
    if (o->spec.kind == LOOM_OPT_RMSPROP) return "rms";
    if (o->spec.kind == LOOM_OPT_ADAGRAD) return "accumulator";
    return i == 0 ? "m" : "v";
}
