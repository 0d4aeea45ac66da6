/* optimizer.c - SGD, momentum (Keras/TF), Adam (Keras/TF), LR schedules.
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
 * Adagrad follows Keras (ResourceApplyAdagradV2): acc starts at
 * initial_accumulator_value, acc += g^2;  p -= lr g / (sqrt(acc) + eps).
 * Embedding tables (loom_optimizer_set_tables) are updated lazily: only
 * elements whose gradient is not 0.0, from the rows the batch touched. */
#include "nn.h"

#include <math.h>
#include <string.h>

/* Baseline x86-64 builds get AVX2 / AVX-512 clones of the update loops. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define NN_HOT __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define NN_HOT
#endif

struct loom_optimizer {
    loom_optimizer_spec spec;
    int64_t             n;           /* parameters */
    int                 n_slots;
    float              *slots;       /* (n_slots * n,) 64-byte aligned, zeroed */
    double              lr_override; /* > 0 replaces the schedule */
    loom_pool          *pool;        /* borrowed; NULL: the calling thread alone */
    int                 nonfinite;   /* an update left a NaN or infinite weight (atomic: ranges run concurrently) */
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
    if (spec->kind != LOOM_OPT_SGD && spec->kind != LOOM_OPT_MOMENTUM && spec->kind != LOOM_OPT_ADAM &&
        spec->kind != LOOM_OPT_ADAGRAD)
        return loom_err_set(err, LOOM_ECONFIG, where, "unknown optimizer kind %d", (int)spec->kind);
    loom_optimizer *o = loom_calloc(1, sizeof *o);
    if (!o) return loom_err_set(err, LOOM_ENOMEM, where, "cannot allocate the optimizer");
    o->spec = *spec;
    o->n = num_params;
    o->n_slots = spec->kind == LOOM_OPT_SGD ? 0 : spec->kind == LOOM_OPT_ADAM ? 2 : 1;
    if (o->n_slots) {
        size_t bytes = (size_t)(o->n_slots * (num_params ? num_params : 1)) * sizeof(float);
        if (!(o->slots = loom_alloc_aligned(bytes))) {
            loom_free(o);
            return loom_err_set(err, LOOM_ENOMEM, where, "cannot allocate %zu bytes of optimizer slots", bytes);
        }
        memset(o->slots, 0, bytes);
        if (spec->kind == LOOM_OPT_ADAGRAD)
            for (int64_t i = 0; i < num_params; i++) o->slots[i] = (float)spec->initial_accumulator;
    }
    *out = o;
    return LOOM_OK;
}

void loom_optimizer_free(loom_optimizer *o)
{
    if (!o) return;
    loom_free(o->slots);
    loom_free(o);
}

double loom_optimizer_lr(const loom_optimizer *o, int64_t step)
{
    if (o->lr_override > 0) return o->lr_override;
    return loom_schedule_lr(&o->spec.schedule, o->spec.learning_rate, step);
}

void loom_optimizer_set_lr(loom_optimizer *o, double lr) { o->lr_override = lr > 0 ? lr : 0; }

NN_HOT static uint32_t apply_sgd(int64_t n, float lr, float *restrict p, const float *restrict g)
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

NN_HOT static uint32_t apply_momentum(int64_t n, float lr, float mu, int nesterov, float *restrict p, const float *restrict g,
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

NN_HOT static uint32_t apply_adam(int64_t n, float lr_t, float b1, float b2, float eps, float *restrict p,
                       const float *restrict g, float *restrict m, float *restrict v)
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

NN_HOT static uint32_t apply_adagrad(int64_t n, float lr, float eps, float *restrict p, const float *restrict g,
                                     float *restrict acc)
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

/* The lazy update of n elements of a table: params p[i], slots at p's own
 * offset i0 (+ i), gradients g[i]; elements whose gradient is 0.0 are left
 * alone. The same arithmetic as the dense loops above, element by element. */
static uint32_t apply_lazy(const loom_optimizer *o, float lr, float *restrict p, const float *restrict g, int64_t i0,
                           int64_t n)
{
    uint32_t e = 0;
    const float b1 = (float)o->spec.beta1, b2 = (float)o->spec.beta2, eps = (float)o->spec.epsilon,
                mu = (float)o->spec.momentum;
    float *s0 = o->slots ? o->slots + i0 : NULL, *s1 = o->n_slots > 1 ? o->slots + o->n + i0 : NULL;
    for (int64_t i = 0; i < n; i++) {
        float gi = g[i], pi;
        if (gi == 0.f) continue;
        switch (o->spec.kind) {
        case LOOM_OPT_SGD: pi = p[i] - lr * gi; break;
        case LOOM_OPT_MOMENTUM: {
            float vi = mu * s0[i] - lr * gi;
            s0[i] = vi;
            pi = o->spec.nesterov ? p[i] + (mu * vi - lr * gi) : p[i] + vi;
            break;
        }
        case LOOM_OPT_ADAM: {
            float mi = b1 * s0[i] + (1.f - b1) * gi;
            float vi = b2 * s1[i] + (1.f - b2) * gi * gi;
            s0[i] = mi;
            s1[i] = vi;
            pi = p[i] - lr * mi / (sqrtf(vi) + eps);
            break;
        }
        default: { /* adagrad */
            float ai = s0[i] + gi * gi;
            s0[i] = ai;
            pi = p[i] - lr * gi / (sqrtf(ai) + (float)o->spec.epsilon);
            break;
        }
        }
        p[i] = pi;
        uint32_t b = exp_bits(pi);
        e = b > e ? b : e;
    }
    return e;
}

/* One update, over part `part` out of `parts` of parameters [lo, hi). */
typedef struct apply_job {
    const loom_optimizer *o;
    float                *params;
    const float          *grads;
    float                 lr;     /* sgd, momentum: lr; adam: lr_t */
    int64_t               lo, hi;
    int                   parts;
    int                  *nonfinite; /* set when the part left a non-finite weight */
    int                   lazy;      /* a table's range: apply_lazy */
} apply_job;

static void apply_part(void *arg, int part)
{
    const apply_job *j = arg;
    const loom_optimizer *o = j->o;
    /* parts of whole 16-float (64-byte) lines, so parts share no cache line */
    int64_t lines = (j->hi - j->lo + 15) / 16;
    int64_t i0 = j->lo + lines * part / j->parts * 16, i1 = j->lo + lines * (part + 1) / j->parts * 16;
    if (i1 > j->hi) i1 = j->hi;
    if (i0 >= i1) return;
    float *p = j->params + i0;
    const float *g = j->grads + i0;
    uint32_t e = 0;
    if (j->lazy) e = apply_lazy(o, j->lr, p, g, i0, i1 - i0);
    else switch (o->spec.kind) {
    case LOOM_OPT_ADAGRAD:
        e = apply_adagrad(i1 - i0, j->lr, (float)o->spec.epsilon, p, g, o->slots + i0);
        break;
    case LOOM_OPT_SGD:
        e = apply_sgd(i1 - i0, j->lr, p, g);
        break;
    case LOOM_OPT_MOMENTUM:
        e = apply_momentum(i1 - i0, j->lr, (float)o->spec.momentum, o->spec.nesterov, p, g, o->slots + i0);
        break;
    case LOOM_OPT_ADAM:
        e = apply_adam(i1 - i0, j->lr, (float)o->spec.beta1, (float)o->spec.beta2, (float)o->spec.epsilon, p, g,
                   o->slots + i0, o->slots + o->n + i0);
        break;
    }
    /* a non-finite gradient (or slot) makes a non-finite weight in every optimizer */
    if (e == 0x7f800000u) __atomic_store_n(j->nonfinite, 1, __ATOMIC_RELAXED);
}

void loom_optimizer_set_pool(loom_optimizer *o, loom_pool *pool) { o->pool = pool; }

/* Reads o and writes only params, and the slots, in [lo, hi): disjoint ranges
 * may run at once from different threads. */
static float step_lr(const loom_optimizer *o, int64_t step)
{
    double lr = loom_optimizer_lr(o, step);
    if (o->spec.kind == LOOM_OPT_ADAM) {
        double t = (double)(step + 1);
        lr = lr * sqrt(1.0 - pow(o->spec.beta2, t)) / (1.0 - pow(o->spec.beta1, t));
    }
    return (float)lr;
}

static void apply_dense(const loom_optimizer *o, loom_pool *pool, float *params, const float *grads, float lr,
                        int64_t lo, int64_t hi, int lazy)
{
    /* below ~64K parameters a wake-up of the pool costs more than the pass */
    int parts = pool && hi - lo >= 65536 ? loom_pool_size(pool) : 1;
    apply_job j = {.o = o, .params = params, .grads = grads, .lr = lr, .lo = lo, .hi = hi, .parts = parts,
                   .nonfinite = (int *)&o->nonfinite, /* the one field ranges may write, atomically */
                   .lazy = lazy};
    loom_pool_run(parts > 1 ? pool : NULL, parts, apply_part, &j);
}

/* Rows ids[0..n) of the table at offset (dim floats a row), clipped to [lo, hi). */
static uint32_t apply_rows(const loom_optimizer *o, float lr, float *params, const float *grads, int64_t offset,
                           int64_t dim, const int64_t *ids, int64_t n, const float *values, int64_t lo, int64_t hi)
{
    uint32_t e = 0;
    for (int64_t k = 0; k < n; k++) {
        int64_t a = offset + ids[k] * dim, b = a + dim;
        int64_t a2 = a > lo ? a : lo, b2 = b < hi ? b : hi;
        if (a2 >= b2) continue;
        const float *g = values ? values + k * dim + (a2 - a) : grads + a2;
        uint32_t r = apply_lazy(o, lr, params + a2, g, a2, b2 - a2);
        e = r > e ? r : e;
    }
    return e;
}

/* Reads o and writes only params, and the slots, in [lo, hi): disjoint ranges
 * may run at once from different threads. Tables' parts are lazy. */
static void apply_range(const loom_optimizer *o, loom_pool *pool, float *params, const float *grads, int64_t step,
                        int64_t lo, int64_t hi)
{
    float lr = step_lr(o, step);
    int64_t cur = lo;
    for (int t = 0; t < o->n_tables; t++) {
        const loom_sparse_grad *tb = &o->table[t];
        int64_t a = tb->offset > lo ? tb->offset : lo, end = tb->offset + tb->rows * tb->dim, b = end < hi ? end : hi;
        if (a >= b) continue;
        if (cur < a) apply_dense(o, pool, params, grads, lr, cur, a, 0);
        if (o->use_rows) {
            loom_sparse_grad sg;
            loom_model_sparse_grad(o->tables, t, &sg);
            if (apply_rows(o, lr, params, grads, sg.offset, sg.dim, sg.ids, sg.n, NULL, a, b) == 0x7f800000u)
                __atomic_store_n((int *)&o->nonfinite, 1, __ATOMIC_RELAXED);
        } else {
            apply_dense(o, pool, params, grads, lr, a, b, 1);
        }
        cur = b;
    }
    if (cur < hi) apply_dense(o, pool, params, grads, lr, cur, hi, 0);
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
    if (apply_rows(o, step_lr(o, step), params, grads, offset, dim, ids, n, values, 0, o->n) == 0x7f800000u)
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

int loom_optimizer_num_slots(const loom_optimizer *o) { return o->n_slots; }
float *loom_optimizer_slots(loom_optimizer *o) { return o->slots; }

const char *loom_optimizer_slot_name(const loom_optimizer *o, int i)
{
    if (i < 0 || i >= o->n_slots) return NULL;
    if (o->spec.kind == LOOM_OPT_MOMENTUM) return "momentum";
    if (o->spec.kind == LOOM_OPT_ADAGRAD) return "accumulator";
    return i == 0 ? "m" : "v";
}
