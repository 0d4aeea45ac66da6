/* buffer_plan.c - one arena for a step's short-lived buffers, its offsets
 * planned at load from the layers' topological order, as TF's and XLA's
 * buffer assignment do (a heap simulator over live intervals).
 *
 * A model with batch normalization runs a step in phases separated by
 * barriers (model.c forward_all / backward_all: the chunks' segments between
 * batch normalizations, each of those over the whole batch, the loss). A
 * buffer lives over an interval of phases; two buffers whose intervals do not
 * meet share bytes. Phases, not layers, are the unit: within a phase the
 * chunks run unsynchronised on their own rows, and rows of two buffers of
 * different widths overlap across chunks. The buffers placed here:
 *   - y of a batch normalization or zero_padding2d read only by layers whose
 *     backward does not read their input (an add without broadcasting, a
 *     max_pool2d, which keeps its argmax): dead once its readers ran forward;
 *   - dz of a conv2d whose parameter gradients are taken right after its
 *     backward segment (l->early): dead when that segment ends;
 *   - dgy of a layer gathering its output's gradient: live from its first
 *     consumer's backward to the last layer down its chain that takes the
 *     gradient from those rows in place.
 * A model without batch normalization runs its whole step in one phase: no
 * plan, every buffer its own (as before). Threads: load time only. */
#include "nn_internal.h"

#include <stdlib.h>
#include <string.h>

typedef struct plan_buf {
    int     layer, what;   /* NN_ARENA_* */
    int     t0, t1;        /* the phases it lives in, inclusive */
    int64_t floats, off;   /* its size (64-byte multiple) and offset in the arena, in floats */
} plan_buf;

/* Layer c's backward reads none of its inputs' values. */
static bool backward_skips_inputs(const nn_layer_ *c)
{
    if (c->spec.kind == LOOM_LAYER_MAX_POOL2D) return !c->fused;
    if (c->spec.kind != LOOM_LAYER_ADD) return false;
    for (int k = 0; k < c->n_src; k++)
        if (c->bstride[k][0] >= 0) return false;
    return true;
}

static bool is_head(const loom_model *m, int li)
{
    for (int h = 0; h < m->n_heads; h++)
        if (m->head[h].layer == li) return true;
    return li == m->n_layers - 1;
}

/* Layer L's output is read by the forward alone (its own backward reads neither it nor its input's values). */
static bool y_forward_only(const loom_model *m, int L)
{
    const nn_layer_ *l = &m->layer[L];
    if ((l->spec.kind != LOOM_LAYER_BATCH_NORM && l->spec.kind != LOOM_LAYER_ZERO_PADDING2D) || l->inplace ||
        l->n_cons < 1 || is_head(m, L))
        return false;
    for (int c = L + 1; c < m->n_layers; c++) {
        const nn_layer_ *cl = &m->layer[c];
        for (int k = 0; k < cl->n_src; k++)
            if (cl->src[k] == L && (cl->inplace || !backward_skips_inputs(cl))) return false;
    }
    return true;
}

/* A conv2d whose dz rows nothing but its backward and its parameter gradients touch. */
bool nn_plan_early_(const nn_layer_ *l)
{
    return l->spec.kind == LOOM_LAYER_CONV2D && !l->direct && !l->fuse_pool && l->kernel_off >= 0 &&
           (l->act == LOOM_ACT_NONE || l->act == LOOM_ACT_RELU);
}

/* The phases of layer i: forward (segments at even numbers, batch normalizations at odd ones), the loss
 * after them, then the backward from the top (model.c forward_all, backward_all). */
typedef struct phases {
    int bn_below[LOOM_MAX_LAYERS + 1]; /* batch normalizations before layer i */
    int nb;
} phases;

static int is_bn(const loom_model *m, int i) { return m->layer[i].spec.kind == LOOM_LAYER_BATCH_NORM; }
static int ph_fwd(const loom_model *m, const phases *p, int i) { return 2 * p->bn_below[i] + is_bn(m, i); }
static int ph_bwd(const loom_model *m, const phases *p, int i)
{
    return 2 * p->nb + 2 + 2 * (p->nb - p->bn_below[i] - is_bn(m, i)) + is_bn(m, i);
}

/* A layer kind whose output the arena may hold over its whole life: its
 * readers are itself, its consumers and the layers over its buffer in place
 * (as inputs, in their forward and backward), nothing after the step. */
static bool y_placeable(const loom_model *m, int L)
{
    const nn_layer_ *l = &m->layer[L];
    switch (l->spec.kind) {
    case LOOM_LAYER_CONV2D: return !l->direct && !l->fuse_pool && !nn_act_needs_x_(l->act);
    case LOOM_LAYER_DENSE: return !nn_act_needs_x_(l->act);
    case LOOM_LAYER_ACTIVATION: return l->act != LOOM_ACT_NONE && !nn_act_needs_x_(l->act);
    case LOOM_LAYER_MAX_POOL2D: return !l->fused;
    case LOOM_LAYER_BATCH_NORM:
    case LOOM_LAYER_ADD:
    case LOOM_LAYER_ZERO_PADDING2D:
    case LOOM_LAYER_AVG_POOL2D:
    case LOOM_LAYER_GLOBAL_AVG_POOL2D: return true;
    default: return false;
    }
}

/* The last phase reading layer L's output (or the layers' over it in place): -1 when a head reads it. */
static int y_last_read(const loom_model *m, const phases *p, int L)
{
    bool grp[LOOM_MAX_LAYERS] = {false};
    grp[L] = true;
    int t1 = ph_bwd(m, p, L);
    for (int i = L; i < m->n_layers; i++) {
        const nn_layer_ *l = &m->layer[i];
        if (i > L && l->inplace && l->src[0] >= 0 && grp[l->src[0]]) grp[i] = true;
        if (grp[i] && is_head(m, i)) return -1;
        /* a consumer's parameter gradients read it after the whole backward (model.c grad_part), unless early */
        bool late = l->kernel_off >= 0 && l->spec.kind != LOOM_LAYER_BATCH_NORM && !nn_plan_early_(l);
        for (int k = 0; k < l->n_src; k++)
            if (l->src[k] >= 0 && grp[l->src[k]] && late) t1 = ph_bwd(m, p, 0) + 1;
    }
    return t1; /* (the backward runs from the top: no reader after L's own backward but the late ones) */
}

/* The lowest layer down the chain from L whose backward may take its gradient in L's dgy rows (graph.c:
 * grad_out leaves the rows in c->g, as an add does for the input below it, add_link; a layer that
 * gathers its own gradient ends the chain). */
static int chain_end(const loom_model *m, int L)
{
    int k = L;
    while (k > 0 && !m->layer[k - 1].gacc && m->layer[k - 1].n_cons == 1) k--;
    return k;
}

/* The buffers to place; returns their count (at most 3 per layer). */
static int collect(loom_model *m, plan_buf *b)
{
    phases p = {.nb = 0};
    for (int i = 0; i < m->n_layers; i++) {
        p.bn_below[i] = p.nb;
        p.nb += is_bn(m, i);
    }
    int n = 0;
    const int64_t mb = m->max_batch;
    for (int L = 0; L < m->n_layers; L++) {
        nn_layer_ *l = &m->layer[L];
        int64_t fl = (mb * l->n_out + 15) & ~(int64_t)15;
        if (y_forward_only(m, L)) {
            int t1 = ph_fwd(m, &p, L);
            for (int c = L + 1; c < m->n_layers; c++)
                for (int k = 0; k < m->layer[c].n_src; k++)
                    if (m->layer[c].src[k] == L && ph_fwd(m, &p, c) > t1) t1 = ph_fwd(m, &p, c);
            b[n++] = (plan_buf){L, NN_ARENA_Y, ph_fwd(m, &p, L), t1, fl, -1};
        } else if (!l->inplace && y_placeable(m, L) && y_last_read(m, &p, L) >= 0) {
            b[n++] = (plan_buf){L, NN_ARENA_Y, ph_fwd(m, &p, L), y_last_read(m, &p, L), fl, -1};
        }
        if (nn_plan_early_(l)) {
            l->early = 1;
            int t0 = ph_bwd(m, &p, L); /* its consumers' backward may write it already (a BN's dx) */
            for (int c = L + 1; c < m->n_layers; c++)
                for (int k = 0; k < m->layer[c].n_src; k++)
                    if (m->layer[c].src[k] == L && ph_bwd(m, &p, c) < t0) t0 = ph_bwd(m, &p, c);
            b[n++] = (plan_buf){L, NN_ARENA_DZ, t0, ph_bwd(m, &p, L), fl, -1};
        }
        if (l->gacc && !is_head(m, L)) {
            int t0 = ph_bwd(m, &p, L);
            for (int c = L + 1; c < m->n_layers; c++)
                for (int k = 0; k < m->layer[c].n_src; k++)
                    if (m->layer[c].src[k] == L && ph_bwd(m, &p, c) < t0) t0 = ph_bwd(m, &p, c);
            b[n++] = (plan_buf){L, NN_ARENA_DGY, t0, ph_bwd(m, &p, chain_end(m, L)), fl, -1};
        }
    }
    /* the two gradient buffers: from the loss to the backward's end */
    int64_t gmax = 1;
    for (int i = 0; i < m->n_layers; i++) {
        if (m->layer[i].n_in > gmax) gmax = m->layer[i].n_in;
        if (m->layer[i].n_out > gmax) gmax = m->layer[i].n_out;
    }
    for (int k = 0; k < 2; k++)
        b[n++] = (plan_buf){-1 - k, NN_ARENA_GBUF, 2 * p.nb + 1, ph_bwd(m, &p, 0), (mb * gmax + 15) & ~(int64_t)15, -1};
    /* (phase ph_bwd(0) + 1: the gradient pass after the backward, model.c grad_part) */
    return n;
}

static int by_size(const void *a, const void *b)
{
    const plan_buf *x = a, *y = b;
    if (x->floats != y->floats) return x->floats > y->floats ? -1 : 1;
    if (x->t0 != y->t0) return x->t0 - y->t0;
    return x->layer != y->layer ? x->layer - y->layer : x->what - y->what; /* a fixed order: the same plan */
}

static int by_off(const void *a, const void *b)
{
    const plan_buf *x = *(plan_buf *const *)a, *y = *(plan_buf *const *)b;
    return x->off < y->off ? -1 : x->off > y->off;
}

/* Each buffer, largest first, at the lowest offset clear of the placed ones it meets in time. */
static int64_t place(plan_buf *b, int n, plan_buf **meet)
{
    int64_t top = 0;
    qsort(b, (size_t)n, sizeof *b, by_size);
    for (int i = 0; i < n; i++) {
        int nm = 0;
        for (int j = 0; j < i; j++)
            if (b[j].t0 <= b[i].t1 && b[i].t0 <= b[j].t1) meet[nm++] = &b[j];
        qsort(meet, (size_t)nm, sizeof *meet, by_off);
        int64_t off = 0;
        for (int j = 0; j < nm; j++) {
            if (meet[j]->off >= off + b[i].floats) break;
            if (meet[j]->off + meet[j]->floats > off) off = meet[j]->off + meet[j]->floats;
        }
        b[i].off = off;
        if (off + b[i].floats > top) top = off + b[i].floats;
    }
    return top;
}

bool nn_plan_buffers_(loom_model *m)
{
    for (int i = 0; i < m->n_layers; i++) m->layer[i].arena = 0, m->layer[i].early = 0;
    if (!m->n_bn) return true;
    plan_buf *b = loom_alloc((size_t)(3 * m->n_layers + 2) * sizeof *b);
    plan_buf **meet = loom_alloc((size_t)(3 * m->n_layers + 2) * sizeof *meet);
    if (!b || !meet) {
        loom_free(b);
        loom_free(meet);
        return false;
    }
    int n = collect(m, b);
    m->gbuf_arena = 1;
    int64_t floats = place(b, n, meet);
    bool ok = n == 0 || (m->arena = loom_alloc_aligned((size_t)floats * sizeof(float))) != NULL;
    for (int i = 0; ok && i < n; i++) {
        float *p = m->arena + b[i].off;
        if (b[i].what == NN_ARENA_GBUF) {
            m->gbuf[-1 - b[i].layer] = p;
            continue;
        }
        nn_layer_ *l = &m->layer[b[i].layer];
        l->arena |= b[i].what;
        if (b[i].what == NN_ARENA_Y) l->y = p;
        else if (b[i].what == NN_ARENA_DZ) l->dz = p;
        else l->dgy = p;
    }
    m->arena_floats = ok ? floats : 0;
    loom_free(b);
    loom_free(meet);
    return ok;
}
