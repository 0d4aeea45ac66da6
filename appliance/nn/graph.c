/* graph.c - a model as a graph of layers (Keras' functional API): each
 * layer takes the outputs of the layers (or the model inputs) it names, merge
 * layers (add, subtract, multiply, average, maximum, concatenate) join
 * several, and the executor's graph paths: forward in a topological order,
 * backward in the reverse order, a gradient summed where an output feeds
 * several layers.
 *
 * A chain link (a layer whose one input is the previous layer, which feeds
 * nothing else) reads its input and hands its input gradient down exactly as
 * a sequential model does: no copy. Elsewhere a layer's output gradient is
 * gathered in its own dgy rows: the first consumer (in reverse topological
 * order, fixed) copies its contribution there, the others add theirs, so a
 * step gives the same bits run to run and for any number of threads (each
 * chunk sums its own rows in the same order).
 * Threads: as model.c (a chunk's functions touch only the chunk's rows). */
#include "nn_internal.h"
#include "kernel_internal.h"

#include <string.h>

static bool merge_kind(loom_layer_kind k) { return k >= LOOM_LAYER_ADD && k <= LOOM_LAYER_CONCATENATE; }

/* ---- the order --------------------------------------------------------------- */

static int find_source(const loom_model_spec *spec, const loom_model *m, int i, const char *name)
{
    for (int j = 0; j < spec->n_layers; j++)
        if (j != i && !strcmp(spec->layer[j].name, name)) return j;
    for (int f = 0; f < m->n_inputs; f++)
        if (!strcmp(m->in_name[f], name)) return -1 - f;
    if (i >= 0 && !strcmp(spec->layer[i].name, name)) return i;
    return LOOM_MAX_LAYERS;
}

int nn_graph_order_(const loom_model *m, const loom_model_spec *spec, int *order, int *n,
                    int (*src)[LOOM_MAX_LAYER_INPUTS], int *n_src, loom_err *err)
{
    int ns = spec->n_layers;
    int ssrc[LOOM_MAX_LAYERS][LOOM_MAX_LAYER_INPUTS], snum[LOOM_MAX_LAYERS];
    char w[LOOM_PATH_MAX + 16];
    for (int i = 0; i < ns; i++) {
        const loom_layer_spec *l = &spec->layer[i];
        const char *name = l->name[0] ? l->name : "(unnamed)";
        nn_loc_str_(&l->loc, w, sizeof w);
        if (!w[0]) snprintf(w, sizeof w, "%s", m->where);
        if (l->n_inputs == 0) {
            snum[i] = 1;
            ssrc[i][0] = i > 0 ? i - 1 : -1;
        } else {
            snum[i] = l->n_inputs > LOOM_MAX_LAYER_INPUTS ? LOOM_MAX_LAYER_INPUTS : l->n_inputs;
            for (int k = 0; k < snum[i]; k++) {
                ssrc[i][k] = find_source(spec, m, i, l->inputs[k]);
                if (ssrc[i][k] == LOOM_MAX_LAYERS)
                    return loom_err_set(err, LOOM_ECONFIG, w, "layer \"%s\": input \"%s\" is neither a layer nor a "
                                        "model input", name, l->inputs[k]);
                if (ssrc[i][k] == i)
                    return loom_err_set(err, LOOM_ECONFIG, w, "layer \"%s\" takes itself as input: a cycle", name);
            }
        }
        bool merge = merge_kind(l->kind), mha = l->kind == LOOM_LAYER_MULTI_HEAD_ATTENTION;
        bool plugin = l->kind == LOOM_LAYER_PLUGIN; /* a plugin's build checks its count */
        if ((merge && (snum[i] < 2 || (l->kind == LOOM_LAYER_SUBTRACT && snum[i] != 2))) ||
            (!merge && !mha && !plugin && snum[i] != 1) || (mha && snum[i] > 3))
            return loom_err_set(err, LOOM_ECONFIG, w, "layer \"%s\" (%s) has %d inputs", name,
                                nn_layer_kind_name_(l->kind), snum[i]),
                   loom_err_hint(err, "merge layers take 2 or more (subtract exactly 2), multi_head_attention 1 to "
                                      "3, a plugin's layer what it builds with, the others one");
    }
    /* the layers the output (the last) and the other heads depend on */
    bool used[LOOM_MAX_LAYERS] = {false};
    if (ns > 0) used[ns - 1] = true;
    for (int h = 0; h < spec->n_heads; h++) {
        int j = find_source(spec, m, -1, spec->head[h].layer);
        nn_loc_str_(&spec->head[h].loc, w, sizeof w);
        if (!w[0]) snprintf(w, sizeof w, "%s", m->where);
        if (j < 0 || j >= ns)
            return loom_err_set(err, LOOM_ECONFIG, w, "model.outputs: head %d's layer \"%s\" is not a layer", h,
                                spec->head[h].layer),
                   loom_err_hint(err, "name a layer of model.layers (its name)");
        if (h == 0 && j != ns - 1)
            return loom_err_set(err, LOOM_ECONFIG, w, "model.outputs: head 0's layer \"%s\" is not the last layer "
                                "(\"%s\")", spec->head[h].layer, spec->layer[ns - 1].name),
                   loom_err_hint(err, "the first head is the model's output: list its layer last in model.layers");
        used[j] = true;
    }
    for (bool more = true; more;) {
        more = false;
        for (int i = 0; i < ns; i++)
            for (int k = 0; used[i] && k < snum[i]; k++)
                if (ssrc[i][k] >= 0 && !used[ssrc[i][k]]) used[ssrc[i][k]] = more = true;
    }
    /* Kahn's order, the smallest ready spec index first */
    int pos[LOOM_MAX_LAYERS], cnt = 0;
    for (int i = 0; i < ns; i++) pos[i] = -1;
    while (true) {
        int pick = -1;
        for (int i = 0; i < ns && pick < 0; i++) {
            if (!used[i] || pos[i] >= 0) continue;
            bool ready = true;
            for (int k = 0; k < snum[i] && ready; k++) ready = ssrc[i][k] < 0 || pos[ssrc[i][k]] >= 0;
            if (ready) pick = i;
        }
        if (pick < 0) break;
        pos[pick] = cnt;
        order[cnt++] = pick;
    }
    int want = 0;
    for (int i = 0; i < ns; i++) want += used[i];
    if (cnt < want) {
        for (int i = 0; i < ns; i++)
            if (used[i] && pos[i] < 0) {
                nn_loc_str_(&spec->layer[i].loc, w, sizeof w);
                if (!w[0]) snprintf(w, sizeof w, "%s", m->where);
                return loom_err_set(err, LOOM_ECONFIG, w, "layer \"%s\" is on a cycle of layers", spec->layer[i].name),
                       loom_err_hint(err, "a model is a directed acyclic graph: remove one of the inputs on the cycle");
            }
    }
    if (spec->n_heads > 1 && cnt > 0 && order[cnt - 1] != ns - 1) {
        nn_loc_str_(&spec->head[0].loc, w, sizeof w);
        if (!w[0]) snprintf(w, sizeof w, "%s", m->where);
        return loom_err_set(err, LOOM_ECONFIG, w, "model.outputs: another head's layer takes head 0's layer \"%s\" "
                            "as input", spec->layer[ns - 1].name),
               loom_err_hint(err, "head 0 is the model's output and runs last: list first a head nothing depends on");
    }
    for (int i = 0; i < cnt; i++) {
        int si = order[i];
        n_src[i] = snum[si];
        for (int k = 0; k < snum[si]; k++) src[i][k] = ssrc[si][k] >= 0 ? pos[ssrc[si][k]] : ssrc[si][k];
    }
    *n = cnt;
    return LOOM_OK;
}

/* Layer i, read by the add nx alone, takes nx's gradient down the chain: an add's input gradient is its
 * output's (no broadcasting), left in c->g for layer i, the next backward (merge_backward delivers it
 * to the add's other inputs first). A residual block's last batch normalization so takes its gradient
 * without a copy into rows of its own. */
static bool add_link(const nn_layer_ *nx, int i)
{
    if (nx->spec.kind != LOOM_LAYER_ADD) return false;
    for (int k = 0; k < nx->n_src; k++)
        if (nx->src[k] == i) return nx->bstride[k][0] < 0;
    return false;
}

void nn_graph_links_(loom_model *m)
{
    m->graph = m->n_inputs > 1;
    for (int i = 0; i < m->n_layers; i++) m->layer[i].n_cons = 0;
    for (int i = 0; i < m->n_layers; i++)
        for (int k = 0; k < m->layer[i].n_src; k++)
            if (m->layer[i].src[k] >= 0) m->layer[m->layer[i].src[k]].n_cons++;
    for (int i = 0; i < m->n_layers; i++) {
        nn_layer_ *l = &m->layer[i];
        bool link = l->n_src == 1 && l->src[0] == i - 1; /* layer 0: -1 is model input 0 */
        if (!link) m->graph = 1;
        /* the output of i goes down the chain when its one consumer is i + 1, a chain link, or an add (add_link) */
        const nn_layer_ *nx = i + 1 < m->n_layers ? &m->layer[i + 1] : NULL;
        const bool down = nx && ((nx->n_src == 1 && nx->src[0] == i) || add_link(nx, i));
        l->gacc = !(l->n_cons == 0 || (l->n_cons == 1 && down));
    }
    /* a head but the last: its loss writes its gradient into the layer's dgy rows first */
    for (int h = 1; h < m->n_heads; h++) {
        m->layer[m->head[h].layer].gacc = 1;
        m->graph = 1;
    }
}

/* ---- merge layers: shapes ------------------------------------------------------ */

static const char *src_name(const loom_model *m, const nn_layer_ *l, int k)
{
    int s = l->src[k];
    return s >= 0 ? m->layer[s].spec.name : m->in_name[-1 - s];
}

int nn_merge_shapes_(loom_model *m, nn_layer_ *l, int li, loom_err *err)
{
    (void)li;
    char a[96], b[96];
    const loom_layer_spec *s = &l->spec;
    const char *kind = nn_layer_kind_name_(s->kind);
    if (s->kind == LOOM_LAYER_CONCATENATE) {
        const loom_shape *s0 = &l->src_shape[0];
        int r = s0->rank, ax = s->axis < 0 ? r + 1 + s->axis : s->axis; /* with the batch as axis 0 */
        if (r < 1 || ax < 1 || ax > r)
            return loom_err_set(err, LOOM_ESHAPE, l->where, "layer \"%s\" (concatenate): axis %d is not an axis of "
                                "its inputs' %s (the batch is axis 0)", s->name, s->axis,
                                loom_shape_str(s0, a, sizeof a)),
                   loom_err_hint(err, "axis = -1 joins along the last axis (Keras' default)");
        l->out = *s0;
        l->out.dim[ax - 1] = 0;
        for (int k = 0; k < l->n_src; k++) {
            const loom_shape *sk = &l->src_shape[k];
            bool ok = sk->rank == r;
            for (int d = 0; ok && d < r; d++) ok = d == ax - 1 || sk->dim[d] == s0->dim[d];
            if (!ok)
                return loom_err_set(err, LOOM_ESHAPE, l->where,
                                    "layer \"%s\" (concatenate): inputs \"%s\" %s and \"%s\" %s differ outside axis %d",
                                    s->name, src_name(m, l, 0), loom_shape_str(s0, a, sizeof a), src_name(m, l, k),
                                    loom_shape_str(sk, b, sizeof b), s->axis),
                       loom_err_hint(err, "concatenate needs the same shape on every axis but the one it joins "
                                          "along; add a flatten or reshape before, or change axis");
            l->out.dim[ax - 1] += sk->dim[ax - 1];
        }
        l->C = ax - 1; /* the axis within an example */
        return LOOM_OK;
    }
    /* elementwise, broadcast as NumPy and Keras: from the last axis, sizes equal or one of them 1 */
    loom_shape out = l->src_shape[0];
    for (int k = 1; k < l->n_src; k++) {
        const loom_shape *sk = &l->src_shape[k];
        loom_shape o = out.rank >= sk->rank ? out : *sk;
        const loom_shape *lo = out.rank >= sk->rank ? sk : &out;
        for (int d = 0; d < lo->rank; d++) {
            int od = o.rank - lo->rank + d;
            int64_t x = o.dim[od], y = lo->dim[d];
            if (x == y || y == 1) continue;
            if (x == 1) {
                o.dim[od] = y;
                continue;
            }
            return loom_err_set(err, LOOM_ESHAPE, l->where,
                                "layer \"%s\" (%s): shapes %s and %s (input \"%s\") do not merge: %lld against %lld "
                                "on axis %d", s->name, kind, loom_shape_str(&out, a, sizeof a),
                                loom_shape_str(sk, b, sizeof b), src_name(m, l, k), (long long)x, (long long)y, od + 1),
                   loom_err_hint(err, "elementwise merges need equal shapes, or sizes of 1 that broadcast (from the "
                                      "last axis); a 1x1 conv2d or a dense layer can match the channels");
        }
        out = o;
    }
    l->out = out;
    for (int k = 0; k < l->n_src; k++) {
        const loom_shape *sk = &l->src_shape[k];
        if (loom_shape_eq(sk, &out)) {
            l->bstride[k][0] = -1;
            continue;
        }
        int64_t st = 1;
        for (int d = out.rank - 1; d >= 0; d--) {
            int sd = d - (out.rank - sk->rank);
            int64_t sz = sd >= 0 ? sk->dim[sd] : 1;
            l->bstride[k][d] = sz == 1 ? 0 : st;
            st *= sz;
        }
    }
    m->flops += (double)(l->n_src - 1) * (double)loom_shape_numel(&out);
    return LOOM_OK;
}

/* Element e of an example's output: input k's element. */
static inline int64_t bidx(const nn_layer_ *l, int k, int64_t e)
{
    if (l->bstride[k][0] < 0) return e;
    int64_t idx = 0;
    for (int d = l->out.rank - 1; d >= 0; d--) {
        int64_t q = e % l->out.dim[d];
        e /= l->out.dim[d];
        idx += q * l->bstride[k][d];
    }
    return idx;
}

/* ---- merge layers: forward and backward -------------------------------------- */

static void concat_geom(const nn_layer_ *l, int k, int64_t *outer, int64_t *inner)
{
    const loom_shape *s = &l->src_shape[k];
    int ax = (int)l->C;
    *outer = 1;
    for (int d = 0; d < ax; d++) *outer *= s->dim[d];
    *inner = 1;
    for (int d = ax; d < s->rank; d++) *inner *= s->dim[d];
}

/* y (n) = a + b, vectorised for the machine: an add of two same-shape inputs, as a residual block's. */
static inline LOOM_CLONE_BODY void add_rows_body(float *y, const float *a, const float *b, int64_t n)
{
    for (int64_t e = 0; e < n; e++) y[e] = a[e] + b[e];
}
LOOM_CLONES(, void, add_rows, (float *y, const float *a, const float *b, int64_t n), (y, a, b, n))

/* y (n) += d. */
static inline LOOM_CLONE_BODY void add_into_body(float *restrict y, const float *restrict d, int64_t n)
{
    for (int64_t e = 0; e < n; e++) y[e] += d[e];
}
LOOM_CLONES(, void, add_into, (float *restrict y, const float *restrict d, int64_t n), (y, d, n))

static void merge_forward(const loom_model *m, const nn_layer_ *l, nn_chunk_ *c)
{
    const int64_t B = c->B, n = l->n_out;
    float *y = l->y + c->b0 * n;
    const float *x[LOOM_MAX_LAYER_INPUTS];
    int64_t nk[LOOM_MAX_LAYER_INPUTS];
    (void)m;
    for (int k = 0; k < l->n_src; k++) {
        x[k] = nn_src_ptr_(c, l->src[k]);
        nk[k] = loom_shape_numel(&l->src_shape[k]);
    }
    if (l->spec.kind == LOOM_LAYER_CONCATENATE) {
        int64_t outer, inner, off = 0, row = 0;
        concat_geom(l, 0, &outer, &inner);
        for (int k = 0; k < l->n_src; k++) row += nk[k] / outer;
        for (int k = 0; k < l->n_src; k++) {
            concat_geom(l, k, &outer, &inner);
            for (int64_t b = 0; b < B; b++)
                for (int64_t o = 0; o < outer; o++)
                    memcpy(y + b * n + o * row + off, x[k] + b * nk[k] + o * inner, (size_t)inner * sizeof *y);
            off += inner;
        }
        return;
    }
    loom_layer_kind kind = l->spec.kind;
    if (kind == LOOM_LAYER_ADD && l->n_src == 2 && l->bstride[0][0] < 0 && l->bstride[1][0] < 0) {
        add_rows(y, x[0], x[1], B * n); /* the general loop's sums, element by element */
        return;
    }
    for (int64_t b = 0; b < B; b++) {
        float *yb = y + b * n;
        for (int64_t e = 0; e < n; e++) yb[e] = x[0][b * nk[0] + bidx(l, 0, e)];
        for (int k = 1; k < l->n_src; k++) {
            const float *xb = x[k] + b * nk[k];
            if (l->bstride[k][0] < 0) {
                switch (kind) {
                case LOOM_LAYER_SUBTRACT:
                    for (int64_t e = 0; e < n; e++) yb[e] -= xb[e];
                    break;
                case LOOM_LAYER_MULTIPLY:
                    for (int64_t e = 0; e < n; e++) yb[e] *= xb[e];
                    break;
                case LOOM_LAYER_MAXIMUM:
                    for (int64_t e = 0; e < n; e++) yb[e] = xb[e] > yb[e] ? xb[e] : yb[e];
                    break;
                default: /* add, average */
                    for (int64_t e = 0; e < n; e++) yb[e] += xb[e];
                    break;
                }
                continue;
            }
            for (int64_t e = 0; e < n; e++) {
                float v = xb[bidx(l, k, e)];
                switch (kind) {
                case LOOM_LAYER_SUBTRACT: yb[e] -= v; break;
                case LOOM_LAYER_MULTIPLY: yb[e] *= v; break;
                case LOOM_LAYER_MAXIMUM: yb[e] = v > yb[e] ? v : yb[e]; break;
                default: yb[e] += v; break;
                }
            }
        }
        if (kind == LOOM_LAYER_AVERAGE) {
            const float inv = 1.f / (float)l->n_src;
            for (int64_t e = 0; e < n; e++) yb[e] *= inv;
        }
    }
}

/* The rows of chunk c in layer s's dgy. */
static float *dgy_rows(const loom_model *m, int s, const nn_chunk_ *c)
{
    return m->layer[s].dgy + c->b0 * m->layer[s].n_out;
}

/* d (B, n) into layer s's dgy rows of chunk c: copied by the first consumer, added by the others. */
void nn_graph_deliver_(const loom_model *m, int s, nn_chunk_ *c, const float *d)
{
    const nn_layer_ *l = &m->layer[s];
    const int64_t cnt = c->B * l->n_out;
    float *g = dgy_rows(m, s, c);
    if (!c->ginit[s]) {
        memcpy(g, d, (size_t)cnt * sizeof *g);
        c->ginit[s] = 1;
        return;
    }
    add_into(g, d, cnt);
}

/* Whether input k of l takes a gradient: a layer whose output's gradient is needed. */
static bool wants_grad(const loom_model *m, const nn_layer_ *l, int k)
{
    return l->src[k] >= 0 && m->layer[l->src[k]].need_out;
}

/* The merge's input gradients from g (its output's, (B, n)), handed to the
 * layers it names; scratch has room for any of them. */
static void merge_backward(const loom_model *m, const nn_layer_ *l, nn_chunk_ *c, const float *g, float *scratch)
{
    const int64_t B = c->B, n = l->n_out;
    loom_layer_kind kind = l->spec.kind;
    for (int k = 0; k < l->n_src; k++) {
        if (!wants_grad(m, l, k)) continue;
        const int64_t nk = loom_shape_numel(&l->src_shape[k]);
        if (kind == LOOM_LAYER_CONCATENATE) {
            int64_t outer, inner, off = 0, row = n, o0;
            for (int q = 0; q < k; q++) {
                concat_geom(l, q, &o0, &inner);
                off += inner;
            }
            concat_geom(l, k, &outer, &inner);
            row = n / outer;
            for (int64_t b = 0; b < B; b++)
                for (int64_t o = 0; o < outer; o++)
                    memcpy(scratch + b * nk + o * inner, g + b * n + o * row + off, (size_t)inner * sizeof *g);
            nn_graph_deliver_(m, l->src[k], c, scratch);
            continue;
        }
        if (kind == LOOM_LAYER_ADD && l->bstride[k][0] < 0) { /* the output's gradient itself */
            if (m->layer[l->src[k]].gacc) nn_graph_deliver_(m, l->src[k], c, g); /* else in c->g (add_link) */
            continue;
        }
        const float *x[LOOM_MAX_LAYER_INPUTS];
        int64_t nq[LOOM_MAX_LAYER_INPUTS];
        for (int q = 0; q < l->n_src; q++) {
            x[q] = nn_src_ptr_(c, l->src[q]);
            nq[q] = loom_shape_numel(&l->src_shape[q]);
        }
        const float *y = l->y + c->b0 * n;
        memset(scratch, 0, (size_t)(B * nk) * sizeof *scratch);
        for (int64_t b = 0; b < B; b++) {
            const float *gb = g + b * n, *yb = y + b * n;
            float *d = scratch + b * nk;
            for (int64_t e = 0; e < n; e++) {
                float v = gb[e];
                switch (kind) {
                case LOOM_LAYER_SUBTRACT: v = k == 0 ? v : -v; break;
                case LOOM_LAYER_AVERAGE: v = v / (float)l->n_src; break;
                case LOOM_LAYER_MULTIPLY:
                    for (int q = 0; q < l->n_src; q++)
                        if (q != k) v *= x[q][b * nq[q] + bidx(l, q, e)];
                    break;
                case LOOM_LAYER_MAXIMUM: { /* to the first input holding the maximum (TF: ties to the first) */
                    int first = 0;
                    while (first < l->n_src && x[first][b * nq[first] + bidx(l, first, e)] != yb[e]) first++;
                    if (first != k) v = 0.f;
                    break;
                }
                default: break;
                }
                d[bidx(l, k, e)] += v;
            }
        }
        nn_graph_deliver_(m, l->src[k], c, scratch);
    }
}

/* ---- the executor's graph paths ---------------------------------------------- */

void nn_graph_forward_(const loom_model *m, int li, nn_chunk_ *c, int training, uint64_t rng_key)
{
    const nn_layer_ *l = &m->layer[li];
    if (merge_kind(l->spec.kind)) {
        merge_forward(m, l, c);
        c->act[li + 1] = l->y + c->b0 * l->n_out;
    } else {
        c->act[li] = nn_src_ptr_(c, l->src[0]);
        nn_layer_forward_(m, li, c, training, rng_key);
    }
    c->yo[li] = c->act[li + 1];
}

/* The gradient of layer li's output into c->g: its dgy rows when gathered
 * there (zeros if no consumer gave one), else the chain's c->g as left. */
static void grad_in(const loom_model *m, int li, nn_chunk_ *c)
{
    const nn_layer_ *l = &m->layer[li];
    if (!l->gacc) return;
    float *g = dgy_rows(m, li, c);
    if (!c->ginit[li]) memset(g, 0, (size_t)(c->B * l->n_out) * sizeof *g);
    c->g = g;
    c->other = c->gbuf[0];
}

/* After layer li's backward left its input gradient in r: down the chain, or to its input's dgy rows (unless
 * the backward wrote it there itself, dx_into). */
static void grad_out(const loom_model *m, int li, nn_chunk_ *c, float *r)
{
    const nn_layer_ *l = &m->layer[li];
    c->g = r;
    c->other = r == c->gbuf[0] ? c->gbuf[1] : c->gbuf[0];
    if (wants_grad(m, l, 0) && m->layer[l->src[0]].gacc && r != dgy_rows(m, l->src[0], c))
        nn_graph_deliver_(m, l->src[0], c, r);
}

/* A layer whose backward writes (or adds) its input gradient straight into its input's dgy rows, where
 * grad_out would copy (or add) it from other: a conv2d by Winograd (conv_winograd.c: its output transform
 * adds to the rows with the bits of the add after), as a residual block's first convolution, whose input
 * the shortcut reads too. */
static bool dx_into(const loom_model *m, const nn_layer_ *l)
{
    return l->spec.kind == LOOM_LAYER_CONV2D && !l->direct && l->needs_dx && wants_grad(m, l, 0) &&
           m->layer[l->src[0]].gacc && nn_convw_ok_(l);
}

void nn_graph_backward_(const loom_model *m, int li, nn_chunk_ *c)
{
    const nn_layer_ *l = &m->layer[li];
    if (!l->need_out) return;
    grad_in(m, li, c);
    if (merge_kind(l->spec.kind)) {
        merge_backward(m, l, c, c->g, c->other);
        return;
    }
    const float *keep = c->act[li + 1];
    c->act[li] = nn_src_ptr_(c, l->src[0]);
    c->act[li + 1] = c->yo[li];
    const bool into = dx_into(m, l);
    if (into) c->dx_acc = c->ginit[l->src[0]];
    float *r = nn_layer_backward_(m, li, c, c->g, into ? dgy_rows(m, l->src[0], c) : c->other);
    if (into) c->dx_acc = 0, c->ginit[l->src[0]] = 1;
    c->act[li + 1] = keep;
    if (r) grad_out(m, li, c, r);
}

void nn_graph_bn_in_(loom_model *m, int li, int nchunks)
{
    for (int t = 0; t < nchunks; t++) m->chunk[t].act[li] = nn_src_ptr_(&m->chunk[t], m->layer[li].src[0]);
}

void nn_graph_bn_out_(loom_model *m, int li, int nchunks)
{
    for (int t = 0; t < nchunks; t++) m->chunk[t].yo[li] = m->chunk[t].act[li + 1];
}

void nn_graph_bn_grad_in_(loom_model *m, int li, int nchunks)
{
    for (int t = 0; t < nchunks; t++) grad_in(m, li, &m->chunk[t]);
}

void nn_graph_bn_grad_out_(loom_model *m, int li, int nchunks)
{
    for (int t = 0; t < nchunks; t++) {
        nn_chunk_ *c = &m->chunk[t];
        c->bw_done = 0; /* another branch may still need the layers below */
        const nn_layer_ *l = &m->layer[li]; /* bn_dx_dz: its input gradient is in the conv's dz rows */
        if (l->needs_dx) grad_out(m, li, c, l->bn_dx_dz ? l[-1].dz + c->b0 * l->n_out : c->g);
    }
}

/* ---- the summary ------------------------------------------------------------------ */

void loom_model_summary(const loom_model *m, FILE *f)
{
    char a[96], b[112], ob[120], con[256];
    const int W = 112;
    char eq[121];
    memset(eq, '=', sizeof eq - 1);
    eq[sizeof eq - 1] = 0;
    fprintf(f, "%-40s %-22s %12s   %s\n", "Layer (type)", "Output Shape", "Param #", "Connected to");
    fprintf(f, "%.*s\n", W, eq);
    int64_t frozen = 0;
    for (int i = 0; i < m->n_layers; i++) {
        const nn_layer_ *l = &m->layer[i];
        int64_t np = 0;
        for (int k = 0; k < m->n_ptensors; k++) {
            int64_t off = m->pinfo[k].offset, cnt = loom_shape_numel(&m->pinfo[k].shape);
            bool mine = off == l->kernel_off || off == l->bias_off || off == l->pw_off || nn_attn_owns_(l, off);
            for (int t = 0; l->spec.kind == LOOM_LAYER_PLUGIN && t < l->pplan->n_params; t++) mine |= off == l->poff[t];
            if (mine) np += cnt;
            if (mine && nn_plugin_state_(l, off, NULL)) frozen += cnt; /* a plugin's state: not trained */
            if (off == l->mm_off || off == l->mv_off) np += cnt, frozen += cnt; /* moving statistics: not trained */
        }
        snprintf(b, sizeof b, "%s (%s)", l->spec.name,
                 l->spec.kind == LOOM_LAYER_PLUGIN ? l->spec.plugin : nn_layer_kind_name_(l->spec.kind));
        loom_shape_str(&l->out, a, sizeof a);
        snprintf(ob, sizeof ob, "(None, %s", a + 1);
        if (l->out.rank == 1) snprintf(ob, sizeof ob, "(None, %lld)", (long long)l->out.dim[0]);
        con[0] = 0;
        for (int k = 0; k < l->n_src; k++)
            snprintf(con + strlen(con), sizeof con - strlen(con), "%s%s", k ? ", " : "", src_name(m, l, k));
        fprintf(f, "%-40s %-22s %12lld   %s\n", b, ob, (long long)np, con);
    }
    fprintf(f, "%.*s\n", W, eq);
    fprintf(f, "Total params: %lld (%.2f KB)\n", (long long)m->n_params, (double)m->n_params * 4 / 1024);
    fprintf(f, "Trainable params: %lld (%.2f KB)\n", (long long)(m->n_params - frozen),
            (double)(m->n_params - frozen) * 4 / 1024);
    fprintf(f, "Non-trainable params: %lld (%.2f KB)\n", (long long)frozen, (double)frozen * 4 / 1024);
}
