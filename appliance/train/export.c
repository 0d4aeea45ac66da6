/* export.c - `loom export`: a trained model as ONNX (for onnxruntime and
 * the rest of the ONNX world) or as an .npz of its variables (for numpy).
 *
 * ONNX is protobuf. The few messages needed (ModelProto, GraphProto,
 * NodeProto, AttributeProto, TensorProto, ValueInfoProto and the type
 * protos) are written here with a small wire-format writer, field numbers
 * from onnx.proto (named beside each constant): see README.md's dependency
 * list for why not protobuf-c. Each submessage is built in its own buffer
 * and appended with its length, so nothing needs sizes up front.
 *
 * Layouts: Loom runs images NHWC, ONNX's Conv and MaxPool take NCHW. The
 * graph keeps Loom's input layout (the same arrays `loom predict` reads),
 * transposes to NCHW before the first conv or pool and back to NHWC before
 * a flatten, so flatten's element order, and hence the dense kernels after
 * it, are Loom's. Conv kernels (kh, kw, cin, cout) become (cout, cin, kh, kw).
 * A graph's layers are emitted in the order they run, each reading its
 * inputs' values by name with their layout (emit_merge brings a merge's
 * inputs to one).
 *
 * Threads: the main thread. */
#include "train.h"
#include "protobuf_internal.h"
#include "export_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#define ONNX_OPSET      17 /* onnxruntime >= 1.13 (PyPI, 2022) */
#define ONNX_IR_VERSION 8  /* the IR of opset 17 */

/* ---- protobuf wire format --------------------------------------------------- */

static void pb_int(loom_buf *b, int field, int64_t v) { pb_key(b, field, WT_VARINT), pb_varint(b, (uint64_t)v); }
/* Appends sub as a length-delimited field and empties it for reuse. */
static void pb_msg(loom_buf *b, int field, loom_buf *sub)
{
    pb_bytes(b, field, sub->data, sub->len);
    if (sub->failed) b->failed = 1;
    sub->len = 0;
}

/* onnx.proto field numbers */
enum { MODEL_IR_VERSION = 1, MODEL_PRODUCER_NAME = 2, MODEL_PRODUCER_VERSION = 3, MODEL_DOC = 6, MODEL_GRAPH = 7,
       MODEL_OPSET_IMPORT = 8 };
enum { OPSET_DOMAIN = 1, OPSET_VERSION = 2 };
enum { GRAPH_NODE = 1, GRAPH_NAME = 2, GRAPH_INITIALIZER = 5, GRAPH_INPUT = 11, GRAPH_OUTPUT = 12 };
enum { NODE_INPUT = 1, NODE_OUTPUT = 2, NODE_NAME = 3, NODE_OP_TYPE = 4, NODE_ATTRIBUTE = 5 };
enum { ATTR_NAME = 1, ATTR_F = 2, ATTR_I = 3, ATTR_S = 4, ATTR_INTS = 8, ATTR_TYPE = 20 };
enum { ATTR_TYPE_FLOAT = 1, ATTR_TYPE_INT = 2, ATTR_TYPE_STRING = 3, ATTR_TYPE_INTS = 7 };
enum { TENSOR_DIMS = 1, TENSOR_DATA_TYPE = 2, TENSOR_NAME = 8, TENSOR_RAW_DATA = 9 };
enum { ONNX_FLOAT = 1, ONNX_UINT8 = 2, ONNX_INT32 = 6, ONNX_INT64 = 7, ONNX_DOUBLE = 11 };
enum { VALUE_NAME = 1, VALUE_TYPE = 2 };
enum { TYPE_TENSOR = 1, TTENSOR_ELEM_TYPE = 1, TTENSOR_SHAPE = 2, SHAPE_DIM = 1, DIM_VALUE = 1, DIM_PARAM = 2 };

/* The graph under construction. */
typedef struct onnx_graph {
    loom_buf g;         /* GraphProto fields */
    loom_buf node, sub; /* scratch for a NodeProto and its attributes */
    int      n_nodes;
    int      n_values;  /* for fresh value names */
} onnx_graph;

static void attr_int(onnx_graph *o, const char *name, int64_t v)
{
    pb_str(&o->sub, ATTR_NAME, name);
    pb_int(&o->sub, ATTR_TYPE, ATTR_TYPE_INT);
    pb_int(&o->sub, ATTR_I, v);
    pb_msg(&o->node, NODE_ATTRIBUTE, &o->sub);
}

static void attr_float(onnx_graph *o, const char *name, float v)
{
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    uint8_t le[4] = {(uint8_t)u, (uint8_t)(u >> 8), (uint8_t)(u >> 16), (uint8_t)(u >> 24)};
    pb_str(&o->sub, ATTR_NAME, name);
    pb_int(&o->sub, ATTR_TYPE, ATTR_TYPE_FLOAT);
    pb_key(&o->sub, ATTR_F, WT_I32);
    loom_buf_put(&o->sub, le, 4);
    pb_msg(&o->node, NODE_ATTRIBUTE, &o->sub);
}

static void attr_str(onnx_graph *o, const char *name, const char *v)
{
    pb_str(&o->sub, ATTR_NAME, name);
    pb_int(&o->sub, ATTR_TYPE, ATTR_TYPE_STRING);
    pb_str(&o->sub, ATTR_S, v);
    pb_msg(&o->node, NODE_ATTRIBUTE, &o->sub);
}

static void attr_ints(onnx_graph *o, const char *name, const int64_t *v, int n)
{
    pb_str(&o->sub, ATTR_NAME, name);
    pb_int(&o->sub, ATTR_TYPE, ATTR_TYPE_INTS);
    for (int i = 0; i < n; i++) pb_int(&o->sub, ATTR_INTS, v[i]);
    pb_msg(&o->node, NODE_ATTRIBUTE, &o->sub);
}

/* Starts a node: op with up to 3 inputs (NULL ends the list) and one output,
 * named out. Attributes follow (attr_*), then node_end. */
static void node_begin(onnx_graph *o, const char *op, const char *out, const char *in0, const char *in1,
                       const char *in2)
{
    const char *in[3] = {in0, in1, in2};
    for (int i = 0; i < 3 && in[i]; i++) pb_str(&o->node, NODE_INPUT, in[i]);
    pb_str(&o->node, NODE_OUTPUT, out);
    char name[64];
    snprintf(name, sizeof name, "%s_%d", op, o->n_nodes++);
    pb_str(&o->node, NODE_NAME, name);
    pb_str(&o->node, NODE_OP_TYPE, op);
}
static void node_end(onnx_graph *o) { pb_msg(&o->g, GRAPH_NODE, &o->node); }

/* A fresh value name "v<N>" into buf. */
static const char *fresh(onnx_graph *o, char buf[32])
{
    snprintf(buf, 32, "v%d", o->n_values++);
    return buf;
}

static void initializer(onnx_graph *o, const char *name, int dtype, const int64_t *dims, int rank, const void *raw,
                        size_t bytes)
{
    for (int i = 0; i < rank; i++) pb_int(&o->sub, TENSOR_DIMS, dims[i]);
    pb_int(&o->sub, TENSOR_DATA_TYPE, dtype);
    pb_str(&o->sub, TENSOR_NAME, name);
    pb_bytes(&o->sub, TENSOR_RAW_DATA, raw, bytes);
    pb_msg(&o->g, GRAPH_INITIALIZER, &o->sub);
}

/* A graph input or output: dtype, dim 0 the symbolic "batch", then dims. */
static void value_info(onnx_graph *o, int field, const char *name, int dtype, const loom_shape *per_example)
{
    loom_buf shape, tt, type, vi;
    loom_buf_init(&shape), loom_buf_init(&tt), loom_buf_init(&type), loom_buf_init(&vi);
    loom_buf dim;
    loom_buf_init(&dim);
    pb_str(&dim, DIM_PARAM, "batch");
    pb_msg(&shape, SHAPE_DIM, &dim);
    for (int i = 0; i < per_example->rank; i++) {
        pb_int(&dim, DIM_VALUE, per_example->dim[i]);
        pb_msg(&shape, SHAPE_DIM, &dim);
    }
    pb_int(&tt, TTENSOR_ELEM_TYPE, dtype);
    pb_msg(&tt, TTENSOR_SHAPE, &shape);
    pb_msg(&type, TYPE_TENSOR, &tt);
    pb_str(&vi, VALUE_NAME, name);
    pb_msg(&vi, VALUE_TYPE, &type);
    pb_msg(&o->g, field, &vi);
    if (dim.failed || shape.failed || tt.failed || type.failed) o->g.failed = 1;
    loom_buf_fini(&shape), loom_buf_fini(&tt), loom_buf_fini(&type), loom_buf_fini(&vi), loom_buf_fini(&dim);
}

/* A float32 scalar constant as an initializer named name. */
static void const_scalar(onnx_graph *o, const char *name, float v) { initializer(o, name, ONNX_FLOAT, NULL, 0, &v, 4); }

static int onnx_dtype(loom_dtype t)
{
    switch (t) {
    case LOOM_U8: return ONNX_UINT8;
    case LOOM_I32: return ONNX_INT32;
    case LOOM_I64: return ONNX_INT64;
    case LOOM_F64: return ONNX_DOUBLE;
    default: return ONNX_FLOAT;
    }
}

/* ---- the model's graph ---------------------------------------------------------- */

/* What export needs of the config's data: the model input's per-example
 * shape and dtype as the model sees it, and, for --include-preprocessing,
 * as the source yields it with the maps between. */
typedef struct export_input {
    loom_shape shape, label_shape; /* per example, after the eval pipeline's maps */
    loom_dtype dtype, label_dtype;
    loom_shape raw_shape;          /* per example, as the source yields it */
    loom_dtype raw_dtype;
    int        n;                  /* model inputs (model.inputs; 1 for model.input, then shape and dtype) */
    loom_shape shapes[LOOM_MAX_MODEL_INPUTS], raw_shapes[LOOM_MAX_MODEL_INPUTS]; /* each, as shape and raw_shape */
    loom_dtype dtypes[LOOM_MAX_MODEL_INPUTS], raw_dtypes[LOOM_MAX_MODEL_INPUTS];
} export_input;

/* The eval pipeline's maps of model input f folded into the graph: cast,
 * scale, normalize and reshape, in order; anything else that changes values
 * is an error naming the map. Writes the name of the value the model's
 * layers read into cur. */
static int fold_preprocessing(onnx_graph *o, const loom_spec *spec, const loom_dataset_spec *ds,
                              const export_input *in, int f, char cur[32], loom_err *err)
{
    char nb[32], cb[32];
    const char *feat = f ? spec->model.inputs[f] : spec->model.input;
    bool is_float = in->raw_dtypes[f] == LOOM_F32, reshaped = false;
    for (int i = 0; i < ds->n_transforms; i++) {
        const loom_transform_spec *t = &ds->transform[i];
        if (t->kind != LOOM_T_MAP || strcmp(t->map.feature, feat)) continue;
        const loom_map_spec *m = &t->map;
        char w[LOOM_PATH_MAX + 16];
        if (m->kind == LOOM_MAP_RESHAPE) { /* the final Reshape below gives the model's shape */
            reshaped = true;
            continue;
        }
        if (m->kind == LOOM_MAP_NORMALIZE && m->n_norm > 1 && reshaped) {
            loom_err_set(err, LOOM_EUNSUPPORTED, loom_loc_str(&t->loc, w, sizeof w),
                         "--include-preprocessing: a per-index normalize of \"%s\" after a reshape has no ONNX form in "
                         "Loom's export (the values broadcast over the raw input's last axis)", m->feature);
            return loom_err_hint(err, "export without --include-preprocessing, or normalize before the reshape");
        }
        if (m->kind != LOOM_MAP_CAST && m->kind != LOOM_MAP_SCALE && m->kind != LOOM_MAP_NORMALIZE) {
            loom_err_set(err, LOOM_EUNSUPPORTED, loom_loc_str(&t->loc, w, sizeof w),
                         "--include-preprocessing: the map \"%s\" of feature \"%s\" has no ONNX form in Loom's export",
                         loom_map_kind_name(m->kind), m->feature);
            return loom_err_hint(err, "export without --include-preprocessing and apply it before the model");
        }
        if (!is_float) { /* every map here computes in float32 (a cast to another dtype is refused at load) */
            strcpy(nb, fresh(o, cb));
            node_begin(o, "Cast", nb, cur, NULL, NULL);
            attr_int(o, "to", ONNX_FLOAT);
            node_end(o);
            strcpy(cur, nb);
            is_float = true;
        }
        if (m->kind == LOOM_MAP_SCALE || m->kind == LOOM_MAP_NORMALIZE) {
            char k1[48], k2[48];
            snprintf(k1, sizeof k1, "preprocess_%d/a", i);
            snprintf(k2, sizeof k2, "preprocess_%d/b", i);
            if (m->kind == LOOM_MAP_NORMALIZE && m->n_norm > 0) { /* per index of the last axis: broadcast [L] */
                int64_t L = m->n_norm;
                initializer(o, k1, ONNX_FLOAT, &L, 1, m->mean_v, (size_t)L * sizeof(float));
                initializer(o, k2, ONNX_FLOAT, &L, 1, m->std_v, (size_t)L * sizeof(float));
            } else {
                const_scalar(o, k1, (float)(m->kind == LOOM_MAP_SCALE ? m->scale : m->mean));
                const_scalar(o, k2, (float)(m->kind == LOOM_MAP_SCALE ? m->offset : m->std));
            }
            strcpy(nb, fresh(o, cb));
            node_begin(o, m->kind == LOOM_MAP_SCALE ? "Mul" : "Sub", nb, cur, k1, NULL);
            node_end(o);
            strcpy(cur, nb);
            strcpy(nb, fresh(o, cb));
            node_begin(o, m->kind == LOOM_MAP_SCALE ? "Add" : "Div", nb, cur, k2, NULL);
            node_end(o);
            strcpy(cur, nb);
        }
    }
    if (!is_float && in->raw_dtypes[f] != in->dtypes[f]) { /* (an embedding's ids reach it as they are) */
        char w[LOOM_PATH_MAX + 16];
        return loom_err_set(err, LOOM_EUNSUPPORTED, loom_loc_str(&ds->loc, w, sizeof w),
                            "--include-preprocessing: feature \"%s\" reaches the model as %s without a cast or scale map",
                            feat, loom_dtype_name(in->raw_dtypes[f]));
    }
    /* the model's per-example shape, batch dim free */
    const loom_shape *sh = &in->shapes[f];
    int64_t dims[LOOM_MAX_RANK + 1] = {-1};
    for (int i = 0; i < sh->rank; i++) dims[i + 1] = sh->dim[i];
    char sn[LOOM_NAME_MAX + 32];
    if (in->n > 1) snprintf(sn, sizeof sn, "preprocess/%s/shape", feat);
    else snprintf(sn, sizeof sn, "preprocess/shape");
    initializer(o, sn, ONNX_INT64, (int64_t[]){sh->rank + 1}, 1, dims, (size_t)(sh->rank + 1) * sizeof(int64_t));
    strcpy(nb, fresh(o, cb));
    node_begin(o, "Reshape", nb, cur, sn, NULL);
    node_end(o);
    strcpy(cur, nb);
    return LOOM_OK;
}

static const char *act_op(loom_activation a)
{
    switch (a) {
    case LOOM_ACT_RELU: return "Relu";
    case LOOM_ACT_SIGMOID: return "Sigmoid";
    case LOOM_ACT_TANH: return "Tanh";
    case LOOM_ACT_SOFTMAX: return "Softmax";
    case LOOM_ACT_SOFTPLUS: return "Softplus";
    case LOOM_ACT_ELU: return "Elu"; /* alpha 1, the default */
    case LOOM_ACT_HARD_SWISH: return "HardSwish"; /* x max(0, min(1, x / 6 + 1 / 2)) = x relu6(x + 3) / 6 */
    default: return NULL;
    }
}

/* Appends an activation node after cur (none: nothing); alpha is leaky_relu's slope. */
static void activation_a(onnx_graph *o, loom_activation a, float alpha, char cur[32])
{
    char nb[32], cb[32];
    if (a == LOOM_ACT_LEAKY_RELU) {
        strcpy(nb, fresh(o, cb));
        node_begin(o, "LeakyRelu", nb, cur, NULL, NULL);
        attr_float(o, "alpha", alpha);
        node_end(o);
        strcpy(cur, nb);
        return;
    }
    if (a == LOOM_ACT_GELU) { /* opset 17 has no Gelu: x * (1 + erf(x / sqrt 2)) * 0.5 */
        char c1[32], c2[32], c3[32], t1[32], t2[32], t3[32], t4[32];
        snprintf(c1, sizeof c1, "gelu_c%d_sqrt2", o->n_values), snprintf(c2, sizeof c2, "gelu_c%d_one", o->n_values);
        snprintf(c3, sizeof c3, "gelu_c%d_half", o->n_values);
        const_scalar(o, c1, 1.41421356237309515f), const_scalar(o, c2, 1.f), const_scalar(o, c3, 0.5f);
        strcpy(t1, fresh(o, cb)), node_begin(o, "Div", t1, cur, c1, NULL), node_end(o);
        strcpy(t2, fresh(o, cb)), node_begin(o, "Erf", t2, t1, NULL, NULL), node_end(o);
        strcpy(t3, fresh(o, cb)), node_begin(o, "Add", t3, t2, c2, NULL), node_end(o);
        strcpy(t4, fresh(o, cb)), node_begin(o, "Mul", t4, cur, t3, NULL), node_end(o);
        strcpy(nb, fresh(o, cb)), node_begin(o, "Mul", nb, t4, c3, NULL), node_end(o);
        strcpy(cur, nb);
        return;
    }
    if (a == LOOM_ACT_SWISH) { /* x sigmoid(x) */
        char sg[32];
        strcpy(sg, fresh(o, cb)), node_begin(o, "Sigmoid", sg, cur, NULL, NULL), node_end(o);
        strcpy(nb, fresh(o, cb)), node_begin(o, "Mul", nb, cur, sg, NULL), node_end(o);
        strcpy(cur, nb);
        return;
    }
    const char *op = act_op(a);
    if (!op) return;
    strcpy(nb, fresh(o, cb));
    node_begin(o, op, nb, cur, NULL, NULL);
    if (a == LOOM_ACT_SOFTMAX) attr_int(o, "axis", -1);
    node_end(o);
    strcpy(cur, nb);
}

/* TF's SAME padding along one axis (as nn/model.c): before and after. */
static void same_pads(int64_t in, int k, int s, int64_t *before, int64_t *after)
{
    int64_t out = (in + s - 1) / s;
    int64_t tot = (out - 1) * s + k - in;
    if (tot < 0) tot = 0;
    *before = tot / 2;
    *after = tot - tot / 2;
}

static void activation(onnx_graph *o, loom_activation a, char cur[32]) { activation_a(o, a, 0.f, cur); }

/* A parameter tensor of the model as an initializer of its name; returns the name. */
static const char *param_init(onnx_graph *o, loom_model *m, int i)
{
    const loom_param_info *p = loom_model_param_tensor(m, i);
    initializer(o, p->name, ONNX_FLOAT, p->shape.dim, p->shape.rank, loom_model_params(m) + p->offset,
                (size_t)loom_shape_numel(&p->shape) * sizeof(float));
    return p->name;
}

/* A node op(a, b) into a fresh value, which becomes cur. */
static void binary(onnx_graph *o, const char *op, const char *a, const char *b, char cur[32])
{
    char nb[32];
    node_begin(o, op, fresh(o, nb), a, b, NULL);
    node_end(o);
    strcpy(cur, nb);
}

/* An embedding layer (nn.h): ids (columns,) or (columns, k) (or a scalar)
 * of dtype idt in cur look up the table's rows; -1 ("no id") adds nothing,
 * so each id is clamped to 0 for the Gather and its row multiplied by a 0/1
 * mask; the k rows of a column are summed (ReduceSum), and the mean
 * combiner divides by the ids present, at least 1 (as nn skips -1s: not
 * ReduceMean, which would count them). Returns the output shape. */
static loom_shape embedding(onnx_graph *o, const loom_layer_spec *l, const char *table, loom_dtype idt, loom_shape s,
                            char cur[32])
{
    char ids[32], v[32], mask[32], zero[80], last[80], axis[80], one[80]; /* a layer name (63) and a suffix */
    snprintf(ids, sizeof ids, "%s", cur);
    snprintf(zero, sizeof zero, "%s/zero_id", l->name);
    snprintf(last, sizeof last, "%s/last_axis", l->name);
    const int64_t z64 = 0, minus1 = -1;
    const int32_t z32 = 0;
    initializer(o, zero, onnx_dtype(idt), NULL, 0, idt == LOOM_I32 ? (const void *)&z32 : (const void *)&z64,
                idt == LOOM_I32 ? sizeof z32 : sizeof z64);
    initializer(o, last, ONNX_INT64, (int64_t[]){1}, 1, &minus1, sizeof minus1);
    binary(o, "GreaterOrEqual", ids, zero, v); /* 1 where an id is present */
    node_begin(o, "Cast", fresh(o, mask), v, NULL, NULL);
    attr_int(o, "to", ONNX_FLOAT);
    node_end(o);
    binary(o, "Max", ids, zero, v); /* -1 -> row 0, masked out below */
    node_begin(o, "Gather", fresh(o, cur), table, v, NULL);
    attr_int(o, "axis", 0);
    node_end(o);
    binary(o, "Unsqueeze", mask, last, v);
    binary(o, "Mul", cur, v, cur);
    loom_shape out = {.rank = s.rank == 0 ? 1 : 2, .dim = {s.rank == 0 ? l->output_dim : s.dim[0], l->output_dim}};
    if (s.rank < 2) return out; /* one id per column: sum and mean are the row */
    snprintf(axis, sizeof axis, "%s/ids_axis", l->name); /* (batch, columns, k, dim): k is axis 2 */
    const int64_t two = 2;
    initializer(o, axis, ONNX_INT64, (int64_t[]){1}, 1, &two, sizeof two);
    char sum[32];
    node_begin(o, "ReduceSum", fresh(o, sum), cur, axis, NULL);
    attr_int(o, "keepdims", 0);
    node_end(o);
    strcpy(cur, sum);
    if (l->combiner != LOOM_COMBINER_MEAN) return out;
    snprintf(one, sizeof one, "%s/one", l->name);
    const_scalar(o, one, 1.f);
    node_begin(o, "ReduceSum", fresh(o, v), mask, axis, NULL); /* ids present per column, (batch, columns, 1) */
    attr_int(o, "keepdims", 1);
    node_end(o);
    binary(o, "Max", v, one, v);
    binary(o, "Div", sum, v, cur);
    return out;
}

/* ---- the layers: one emitter per layer kind ----------------------------------
 * The walk over the model's layers carries the current tensor (its name, its
 * per-example shape in Loom's layout, and whether it is held in ONNX's NCHW)
 * and the next parameter tensor; each emitter appends its layer's nodes and
 * initializers and moves the walk on. */

typedef struct onnx_walk {
    onnx_graph *o;
    loom_model *m;
    loom_dtype  in_dtype; /* the model input's (ids for an embedding) */
    int         pi;       /* the next parameter tensor */
    char        cur[32];  /* the current tensor */
    loom_shape  s;        /* its shape per example, Loom's layout (HWC) */
    bool        nchw;     /* cur is in ONNX's layout (CHW) */
    char        seq_lens[32]; /* an embedding's mask_zero: int32 (batch,) real steps per example; "" none */
    char        key_mask[32]; /* the same mask as bool (batch, mask_T): ids > 0, for attention's keys; "" none */
    int64_t     mask_T;
} onnx_walk;

static const int64_t to_nchw[] = {0, 3, 1, 2}, to_nhwc[] = {0, 2, 3, 1};

/* cur transposed by perm (to_nchw or to_nhwc) into a fresh value */
static void transpose(onnx_walk *w, const int64_t perm[4], bool nchw)
{
    char nb[32];
    node_begin(w->o, "Transpose", fresh(w->o, nb), w->cur, NULL, NULL);
    attr_ints(w->o, "perm", perm, 4);
    node_end(w->o);
    strcpy(w->cur, nb);
    w->nchw = nchw;
}

static int emit_dense(onnx_walk *w, const loom_layer_spec *l, loom_err *err)
{
    (void)err;
    char nb[32];
    const char *kernel = param_init(w->o, w->m, w->pi++);
    const char *bias = l->use_bias ? param_init(w->o, w->m, w->pi++) : NULL;
    if (w->s.rank > 1) { /* on the last axis: MatMul broadcasts over (N, T, D), Gemm takes 2-D only */
        node_begin(w->o, "MatMul", fresh(w->o, nb), w->cur, kernel, NULL);
        node_end(w->o);
        strcpy(w->cur, nb);
        if (bias) {
            node_begin(w->o, "Add", fresh(w->o, nb), w->cur, bias, NULL);
            node_end(w->o);
            strcpy(w->cur, nb);
        }
        activation(w->o, l->activation, w->cur);
        w->s.dim[w->s.rank - 1] = l->units;
        return LOOM_OK;
    }
    node_begin(w->o, bias ? "Gemm" : "MatMul", fresh(w->o, nb), w->cur, kernel, bias);
    node_end(w->o);
    strcpy(w->cur, nb);
    activation(w->o, l->activation, w->cur);
    w->s = (loom_shape){.rank = 1, .dim = {l->units}};
    return LOOM_OK;
}

static int emit_embedding(onnx_walk *w, const loom_layer_spec *l, loom_err *err)
{
    (void)err;
    if (l->mask_zero) { /* the time mask as the recurrent ops take it: the count of ids > 0 per example */
        char pad[80], axis[80], v[32];
        snprintf(pad, sizeof pad, "%s/pad_id", l->name);
        snprintf(axis, sizeof axis, "%s/time_axis", l->name);
        const int64_t z64 = 0, one = 1;
        const int32_t z32 = 0;
        initializer(w->o, pad, onnx_dtype(w->in_dtype), NULL, 0,
                    w->in_dtype == LOOM_I32 ? (const void *)&z32 : (const void *)&z64,
                    w->in_dtype == LOOM_I32 ? sizeof z32 : sizeof z64);
        initializer(w->o, axis, ONNX_INT64, (int64_t[]){1}, 1, &one, sizeof one);
        binary(w->o, "Greater", w->cur, pad, v);
        strcpy(w->key_mask, v);
        w->mask_T = w->s.rank ? w->s.dim[0] : 1;
        node_begin(w->o, "Cast", fresh(w->o, w->seq_lens), v, NULL, NULL);
        attr_int(w->o, "to", ONNX_INT32);
        node_end(w->o);
        node_begin(w->o, "ReduceSum", fresh(w->o, v), w->seq_lens, axis, NULL);
        attr_int(w->o, "keepdims", 0);
        node_end(w->o);
        strcpy(w->seq_lens, v);
    }
    w->s = embedding(w->o, l, param_init(w->o, w->m, w->pi++), w->in_dtype, w->s, w->cur);
    return LOOM_OK;
}

/* One recurrent tensor (kernel (K, G H), recurrent_kernel, or a bias row)
 * of each direction as ONNX's [dirs, G H, K] with its gates reordered:
 * dst gate q takes Loom's gate perm[q] (ONNX lstm: i o f c from i f g o;
 * gru: z r h from r z n). bias: K = 1, rows kept as (dirs, G H). */
static void rnn_gates(const float *src, int64_t dir2, int dirs, int64_t K, int H, int G, const int *perm, float *dst)
{
    for (int d = 0; d < dirs; d++)
        for (int q = 0; q < G; q++)
            for (int j = 0; j < H; j++)
                for (int64_t k = 0; k < K; k++)
                    dst[(((int64_t)d * G + q) * H + j) * K + k] = src[d * dir2 + k * (int64_t)G * H + perm[q] * H + j];
}

/* ONNX LSTM and GRU (opset 17) for lstm, gru and bidirectional: X, W, R, B,
 * sequence_lens (the embedding's mask as lengths: exact for trailing
 * padding, which padded_batch and output_sequence_length make); Y or Y_h
 * brought to Loom's (batch, T, dirs H) or (batch, dirs H), or summed over
 * the directions. Initialisers W, R, B under the layer's name. */
static int emit_rnn(onnx_walk *w, const loom_layer_spec *l, loom_err *err)
{
    bool gru = l->kind == LOOM_LAYER_GRU || (l->kind == LOOM_LAYER_BIDIRECTIONAL && l->cell == 1);
    int dirs = l->kind == LOOM_LAYER_BIDIRECTIONAL ? 2 : 1, H = l->units, G = gru ? 3 : 4;
    if (l->return_state || l->state_of) {
        char where[LOOM_PATH_MAX + 16];
        return loom_err_set(err, LOOM_EUNSUPPORTED, loom_loc_str(&l->loc, where, sizeof where), "layer \"%s\": "
                            "return_state (its final states as layers) does not export to ONNX", l->name),
               loom_err_hint(err, "export a model without return_state, or its weights with --format npz");
    }
    if (l->activation != LOOM_ACT_TANH || l->recurrent_activation != LOOM_ACT_SIGMOID) {
        char where[LOOM_PATH_MAX + 16];
        return loom_err_set(err, LOOM_EUNSUPPORTED, loom_loc_str(&l->loc, where, sizeof where), "layer \"%s\": "
                            "the export writes the default activations (tanh, recurrent sigmoid) only", l->name);
    }
    const int64_t D = w->s.dim[1], T = w->s.dim[0];
    static const int lstm_perm[4] = {0, 3, 1, 2}, gru_perm[3] = {1, 0, 2};
    const int *perm = gru ? gru_perm : lstm_perm;
    const loom_param_info *pk = loom_model_param_tensor(w->m, w->pi);
    const loom_param_info *pb = l->use_bias ? loom_model_param_tensor(w->m, w->pi + 2) : NULL;
    const int64_t dir2 = dirs == 2 ? loom_model_param_tensor(w->m, w->pi + (l->use_bias ? 3 : 2))->offset - pk->offset : 0;
    const float *P = loom_model_params(w->m);
    const int64_t nW = dirs * G * H * D, nR = dirs * (int64_t)G * H * H, nB = dirs * 2 * (int64_t)G * H;
    float *buf = loom_calloc((size_t)(nW + nR + nB), sizeof(float));
    if (!buf) return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating layer \"%s\"'s ONNX weights", l->name);
    rnn_gates(P + pk->offset, dir2, dirs, D, H, G, perm, buf);
    rnn_gates(P + loom_model_param_tensor(w->m, w->pi + 1)->offset, dir2, dirs, H, H, G, perm, buf + nW);
    for (int d = 0; d < dirs && pb; d++) /* Wb then Rb per direction; lstm: one bias, Rb = 0 */
        for (int r = 0; r < (gru ? 2 : 1); r++)
            rnn_gates(P + pb->offset + d * dir2 + r * G * H, 0, 1, 1, H, G, perm, buf + nW + nR + (2 * d + r) * G * H);
    w->pi += (l->use_bias ? 3 : 2) * dirs;
    char nw[80], nr[80], nbias[80], x[32], y[32], yh[32];
    snprintf(nw, sizeof nw, "%s/W", l->name), snprintf(nr, sizeof nr, "%s/R", l->name);
    snprintf(nbias, sizeof nbias, "%s/B", l->name);
    initializer(w->o, nw, ONNX_FLOAT, (int64_t[]){dirs, G * H, D}, 3, buf, (size_t)nW * sizeof(float));
    initializer(w->o, nr, ONNX_FLOAT, (int64_t[]){dirs, G * H, H}, 3, buf + nW, (size_t)nR * sizeof(float));
    initializer(w->o, nbias, ONNX_FLOAT, (int64_t[]){dirs, 2 * G * H}, 2, buf + nW + nR, (size_t)nB * sizeof(float));
    loom_free(buf);
    node_begin(w->o, "Transpose", fresh(w->o, x), w->cur, NULL, NULL); /* (T, batch, D) */
    attr_ints(w->o, "perm", (const int64_t[]){1, 0, 2}, 3);
    node_end(w->o);
    /* the node: inputs X W R B (sequence_lens), outputs Y Y_h */
    const char *in[5] = {x, nw, nr, nbias, w->seq_lens};
    for (int i = 0; i < (w->seq_lens[0] ? 5 : 4); i++) pb_str(&w->o->node, NODE_INPUT, in[i]);
    pb_str(&w->o->node, NODE_OUTPUT, fresh(w->o, y));
    pb_str(&w->o->node, NODE_OUTPUT, fresh(w->o, yh));
    char name[64];
    snprintf(name, sizeof name, "%s_%d", gru ? "GRU" : "LSTM", w->o->n_nodes++);
    pb_str(&w->o->node, NODE_NAME, name);
    pb_str(&w->o->node, NODE_OP_TYPE, gru ? "GRU" : "LSTM");
    attr_int(w->o, "hidden_size", H);
    attr_str(w->o, "direction", dirs == 2 ? "bidirectional" : "forward");
    if (gru) attr_int(w->o, "linear_before_reset", 1);
    node_end(w->o);
    bool seq = l->return_sequences, sum = dirs == 2 && l->merge_mode == 1;
    char v[32], shape[80];
    node_begin(w->o, "Transpose", fresh(w->o, v), seq ? y : yh, NULL, NULL); /* batch first, then (T,) dirs, H */
    attr_ints(w->o, "perm", seq ? (const int64_t[]){2, 0, 1, 3} : (const int64_t[]){1, 0, 2}, seq ? 4 : 3);
    node_end(w->o);
    snprintf(shape, sizeof shape, "%s/%s", l->name, sum ? "dir_axis" : "shape");
    const int64_t axis = seq ? 2 : 1, shp[3] = {0, seq ? 0 : -1, -1};
    if (sum) initializer(w->o, shape, ONNX_INT64, (int64_t[]){1}, 1, &axis, sizeof axis);
    else initializer(w->o, shape, ONNX_INT64, (int64_t[]){seq ? 3 : 2}, 1, shp, (size_t)(seq ? 3 : 2) * sizeof(int64_t));
    node_begin(w->o, sum ? "ReduceSum" : "Reshape", fresh(w->o, w->cur), v, shape, NULL);
    if (sum) attr_int(w->o, "keepdims", 0);
    node_end(w->o);
    int64_t width = sum ? H : (int64_t)dirs * H;
    w->s = seq ? (loom_shape){.rank = 2, .dim = {T, width}} : (loom_shape){.rank = 1, .dim = {width}};
    return LOOM_OK;
}

/* BatchNormalization normalises axis 1 (C in NCHW); LayerNormalization the
 * last axis (C in Loom's layout). */
static int emit_norm(onnx_walk *w, const loom_layer_spec *l, loom_err *err)
{
    (void)err;
    onnx_graph *o = w->o;
    bool bn = l->kind == LOOM_LAYER_BATCH_NORM;
    if (bn && w->s.rank == 3 && !w->nchw) transpose(w, to_nchw, true);
    else if (!bn && w->nchw) transpose(w, to_nhwc, false);
    const char *gamma = param_init(o, w->m, w->pi++), *beta = param_init(o, w->m, w->pi++);
    char nb[32];
    fresh(o, nb);
    if (bn) { /* five inputs: node_begin takes three */
        const char *mean = param_init(o, w->m, w->pi++), *var = param_init(o, w->m, w->pi++);
        pb_str(&o->node, NODE_INPUT, w->cur);
        pb_str(&o->node, NODE_INPUT, gamma);
        pb_str(&o->node, NODE_INPUT, beta);
        pb_str(&o->node, NODE_INPUT, mean);
        pb_str(&o->node, NODE_INPUT, var);
        pb_str(&o->node, NODE_OUTPUT, nb);
        char name[64];
        snprintf(name, sizeof name, "BatchNormalization_%d", o->n_nodes++);
        pb_str(&o->node, NODE_NAME, name);
        pb_str(&o->node, NODE_OP_TYPE, "BatchNormalization");
    } else {
        node_begin(o, "LayerNormalization", nb, w->cur, gamma, beta);
        attr_int(o, "axis", -1);
    }
    attr_float(o, "epsilon", (float)(l->epsilon > 0 ? l->epsilon : 1e-3));
    node_end(o);
    strcpy(w->cur, nb);
    return LOOM_OK;
}

static int emit_global_pool(onnx_walk *w, const loom_layer_spec *l, loom_err *err)
{
    (void)err;
    if (!w->nchw) transpose(w, to_nchw, true);
    binary(w->o, l->kind == LOOM_LAYER_GLOBAL_MAX_POOL2D ? "GlobalMaxPool" : "GlobalAveragePool", w->cur, NULL, w->cur);
    char nb[32];
    node_begin(w->o, "Flatten", fresh(w->o, nb), w->cur, NULL, NULL); /* (N, C, 1, 1) -> (N, C) */
    attr_int(w->o, "axis", 1);
    node_end(w->o);
    strcpy(w->cur, nb);
    w->nchw = false;
    w->s = (loom_shape){.rank = 1, .dim = {w->s.dim[2]}};
    return LOOM_OK;
}

/* A convolution's kernel, (kh, kw, cin, cout) in Loom's memory (dims d, or
 * the tensor's own when NULL), as ONNX's (cout, cin, kh, kw) (dims od of
 * rank r when given: the same memory seen otherwise, a conv1d's 3 dims). */
static const char *conv_kernel_as(onnx_walk *w, const int64_t *dd, const int64_t *odd, int r, loom_err *err)
{
    const loom_param_info *k = loom_model_param_tensor(w->m, w->pi++);
    const int64_t *d = dd ? dd : k->shape.dim;
    int64_t n = loom_shape_numel(&k->shape);
    float *t = loom_alloc((size_t)n * sizeof(float));
    if (!t) return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating a conv kernel"), NULL;
    const float *src = loom_model_params(w->m) + k->offset;
    for (int64_t y = 0; y < d[0]; y++)
        for (int64_t x = 0; x < d[1]; x++)
            for (int64_t ci = 0; ci < d[2]; ci++)
                for (int64_t co = 0; co < d[3]; co++)
                    t[((co * d[2] + ci) * d[0] + y) * d[1] + x] = src[((y * d[1] + x) * d[2] + ci) * d[3] + co];
    int64_t od[4] = {d[3], d[2], d[0], d[1]};
    initializer(w->o, k->name, ONNX_FLOAT, odd ? odd : od, odd ? r : 4, t, (size_t)n * sizeof(float));
    loom_free(t);
    return k->name;
}

static const char *conv_kernel(onnx_walk *w, loom_err *err) { return conv_kernel_as(w, NULL, NULL, 0, err); }

/* Issue 23's convolutions over NCHW: conv2d with groups or dilation_rate,
 * depthwise_conv2d (Conv, group = cin: the kernel (kh, kw, cin, mult) is
 * (kh, kw, 1, cin mult) in memory), separable_conv2d (that, then a 1x1 Conv
 * with the bias) and conv2d_transpose (ConvTranspose: Loom's (kh, kw, cout,
 * cin) is ONNX's (cin, cout, kh, kw) through the same transpose). */
static int emit_conv_more(onnx_walk *w, const loom_layer_spec *l, loom_err *err)
{
    onnx_graph *o = w->o;
    if (!w->nchw) transpose(w, to_nchw, true);
    const loom_layer_kind kind = l->kind;
    const int64_t ih = w->s.dim[0], iw = w->s.dim[1], cin = w->s.dim[2];
    const int kh = l->kernel[0], kw = l->kernel[1];
    const int sh = l->stride[0] > 0 ? l->stride[0] : 1, sw = l->stride[1] > 0 ? l->stride[1] : 1;
    const int dh = l->dilation[0] > 0 ? l->dilation[0] : 1, dw = l->dilation[1] > 0 ? l->dilation[1] : 1;
    const int keh = (kh - 1) * dh + 1, kew = (kw - 1) * dw + 1;
    const int64_t mult = l->depth_multiplier > 0 ? l->depth_multiplier : 1;
    int64_t pads[4] = {0, 0, 0, 0}, oh, ow, oc, group = l->groups > 1 ? l->groups : 1;
    int64_t kernel[2] = {kh, kw}, strides[2] = {sh, sw}, dil[2] = {dh, dw}, outpad[2] = {0, 0};
    char nb[32];
    fresh(o, nb);
    if (kind == LOOM_LAYER_CONV2D_TRANSPOSE) { /* as nn/conv_more.c: Keras's output length, the forward's pads */
        oh = l->padding == LOOM_PAD_SAME ? ih * sh : ih * sh + (keh > sh ? keh - sh : 0);
        ow = l->padding == LOOM_PAD_SAME ? iw * sw : iw * sw + (kew > sw ? kew - sw : 0);
        int64_t th = (ih - 1) * sh + keh - oh, tw = (iw - 1) * sw + kew - ow;
        pads[0] = th > 0 ? th / 2 : 0, pads[2] = th > 0 ? th - th / 2 : 0;
        pads[1] = tw > 0 ? tw / 2 : 0, pads[3] = tw > 0 ? tw - tw / 2 : 0;
        outpad[0] = th < 0 ? -th : 0, outpad[1] = tw < 0 ? -tw : 0;
        oc = l->filters;
        const char *k = conv_kernel(w, err);
        if (!k) return err->code;
        node_begin(o, "ConvTranspose", nb, w->cur, k, l->use_bias ? param_init(o, w->m, w->pi++) : NULL);
        attr_ints(o, "output_padding", outpad, 2);
    } else {
        if (l->padding == LOOM_PAD_SAME) {
            same_pads(ih, keh, sh, &pads[0], &pads[2]);
            same_pads(iw, kew, sw, &pads[1], &pads[3]);
        }
        oh = (ih + pads[0] + pads[2] - keh) / sh + 1;
        ow = (iw + pads[1] + pads[3] - kew) / sw + 1;
        oc = kind == LOOM_LAYER_DEPTHWISE_CONV2D ? cin * mult : l->filters;
        const char *k;
        if (kind == LOOM_LAYER_CONV2D) {
            k = conv_kernel(w, err);
        } else {
            group = cin;
            k = conv_kernel_as(w, (int64_t[]){kh, kw, 1, cin * mult}, NULL, 0, err);
        }
        if (!k) return err->code;
        const bool sep = kind == LOOM_LAYER_SEPARABLE_CONV2D;
        node_begin(o, "Conv", nb, w->cur, k, l->use_bias && !sep ? param_init(o, w->m, w->pi++) : NULL);
    }
    attr_ints(o, "kernel_shape", kernel, 2);
    attr_ints(o, "strides", strides, 2);
    attr_ints(o, "dilations", dil, 2);
    attr_ints(o, "pads", pads, 4);
    if (kind != LOOM_LAYER_CONV2D_TRANSPOSE) attr_int(o, "group", group);
    node_end(o);
    strcpy(w->cur, nb);
    if (kind == LOOM_LAYER_SEPARABLE_CONV2D) { /* the pointwise 1x1 with the bias */
        const char *pk = conv_kernel(w, err);
        if (!pk) return err->code;
        node_begin(o, "Conv", fresh(o, nb), w->cur, pk, l->use_bias ? param_init(o, w->m, w->pi++) : NULL);
        attr_ints(o, "kernel_shape", (int64_t[]){1, 1}, 2);
        node_end(o);
        strcpy(w->cur, nb);
    }
    activation(o, l->activation, w->cur);
    w->s = (loom_shape){.rank = 3, .dim = {oh, ow, oc}};
    return LOOM_OK;
}

/* conv1d on (T, C): transposed to (C, T) for a 1-D Conv and back; the kernel
 * (k, cin / groups, filters) as (filters, cin / groups, k). */
static int emit_conv1d(onnx_walk *w, const loom_layer_spec *l, loom_err *err)
{
    onnx_graph *o = w->o;
    char nb[32];
    const int64_t T = w->s.dim[0], cin = w->s.dim[1], g = l->groups > 1 ? l->groups : 1;
    const int k = l->kernel[1], s = l->stride[1] > 0 ? l->stride[1] : 1, d = l->dilation[1] > 0 ? l->dilation[1] : 1;
    const int ke = (k - 1) * d + 1;
    int64_t pads[2] = {0, 0};
    if (l->padding == LOOM_PAD_SAME) same_pads(T, ke, s, &pads[0], &pads[1]);
    if (l->padding == LOOM_PAD_CAUSAL) pads[0] = ke - 1;
    int64_t out = (T + pads[0] + pads[1] - ke) / s + 1;
    static const int64_t swap[3] = {0, 2, 1};
    node_begin(o, "Transpose", fresh(o, nb), w->cur, NULL, NULL);
    attr_ints(o, "perm", swap, 3);
    node_end(o);
    strcpy(w->cur, nb);
    const char *kn = conv_kernel_as(w, (int64_t[]){1, k, cin / g, l->filters}, (int64_t[]){l->filters, cin / g, k}, 3,
                                    err);
    if (!kn) return err->code;
    node_begin(o, "Conv", fresh(o, nb), w->cur, kn, l->use_bias ? param_init(o, w->m, w->pi++) : NULL);
    attr_ints(o, "kernel_shape", (int64_t[]){k}, 1);
    attr_ints(o, "strides", (int64_t[]){s}, 1);
    attr_ints(o, "dilations", (int64_t[]){d}, 1);
    attr_ints(o, "pads", pads, 2);
    attr_int(o, "group", g);
    node_end(o);
    strcpy(w->cur, nb);
    node_begin(o, "Transpose", fresh(o, nb), w->cur, NULL, NULL);
    attr_ints(o, "perm", swap, 3);
    node_end(o);
    strcpy(w->cur, nb);
    activation(o, l->activation, w->cur);
    w->s = (loom_shape){.rank = 2, .dim = {out, l->filters}};
    return LOOM_OK;
}

/* zero_padding2d: Pad (constant zeros) in whichever layout cur is. */
static int emit_zero_padding(onnx_walk *w, const loom_layer_spec *l, loom_err *err)
{
    (void)err;
    char nb[32], pn[80];
    const int64_t t = l->pad[0], b = l->pad[1], lf = l->pad[2], r = l->pad[3];
    int64_t pads[8] = {0, t, lf, 0, 0, b, r, 0}; /* NHWC: begins, then ends */
    if (w->nchw) {
        int64_t p2[8] = {0, 0, t, lf, 0, 0, b, r};
        memcpy(pads, p2, sizeof pads);
    }
    snprintf(pn, sizeof pn, "%s/pads", l->name);
    initializer(w->o, pn, ONNX_INT64, (int64_t[]){8}, 1, pads, sizeof pads);
    node_begin(w->o, "Pad", fresh(w->o, nb), w->cur, pn, NULL);
    node_end(w->o);
    strcpy(w->cur, nb);
    w->s.dim[0] += t + b, w->s.dim[1] += lf + r;
    return LOOM_OK;
}

/* reshape: in Loom's layout, batch kept (0), the target's -1 resolved. */
static int emit_reshape(onnx_walk *w, const loom_layer_spec *l, loom_err *err)
{
    (void)err;
    if (w->nchw) transpose(w, to_nhwc, false);
    char nb[32], sn[80];
    int64_t n = loom_shape_numel(&w->s), known = 1, dims[4] = {0};
    loom_shape out = {.rank = l->n_target};
    for (int i = 0; i < l->n_target; i++) known *= l->target[i] > 0 ? l->target[i] : 1;
    for (int i = 0; i < l->n_target; i++) out.dim[i] = dims[i + 1] = l->target[i] > 0 ? l->target[i] : n / known;
    snprintf(sn, sizeof sn, "%s/shape", l->name);
    initializer(w->o, sn, ONNX_INT64, (int64_t[]){l->n_target + 1}, 1, dims, (size_t)(l->n_target + 1) * sizeof(int64_t));
    node_begin(w->o, "Reshape", fresh(w->o, nb), w->cur, sn, NULL);
    node_end(w->o);
    strcpy(w->cur, nb);
    w->s = out;
    return LOOM_OK;
}

/* upsampling2d: Resize, nearest, output pixel o reads input floor(o / size) (asymmetric). */
static int emit_upsampling(onnx_walk *w, const loom_layer_spec *l, loom_err *err)
{
    (void)err;
    char nb[32], sn[80];
    const int sh = l->size[0] > 0 ? l->size[0] : 2, sw = l->size[1] > 0 ? l->size[1] : 2;
    float sc[4] = {1.f, (float)sh, (float)sw, 1.f};
    if (w->nchw) sc[1] = 1.f, sc[2] = (float)sh, sc[3] = (float)sw;
    snprintf(sn, sizeof sn, "%s/scales", l->name);
    initializer(w->o, sn, ONNX_FLOAT, (int64_t[]){4}, 1, sc, sizeof sc);
    node_begin(w->o, "Resize", fresh(w->o, nb), w->cur, "", sn);
    attr_str(w->o, "mode", "nearest");
    attr_str(w->o, "coordinate_transformation_mode", "asymmetric");
    attr_str(w->o, "nearest_mode", "floor");
    node_end(w->o);
    strcpy(w->cur, nb);
    w->s.dim[0] *= sh, w->s.dim[1] *= sw;
    return LOOM_OK;
}

/* conv2d, max_pool2d and average_pooling2d: a window over NCHW */
static int emit_window(onnx_walk *w, const loom_layer_spec *l, loom_err *err)
{
    onnx_graph *o = w->o;
    if (l->kind == LOOM_LAYER_CONV2D && (l->groups > 1 || l->dilation[0] > 1 || l->dilation[1] > 1))
        return emit_conv_more(w, l, err);
    if (!w->nchw) transpose(w, to_nchw, true);
    bool conv = l->kind == LOOM_LAYER_CONV2D;
    int kh = conv ? l->kernel[0] : l->pool[0], kw = conv ? l->kernel[1] : l->pool[1];
    /* as nn/model.c: an unset stride is 1 for a conv, the window for a pool */
    int sh = l->stride[0] > 0 ? l->stride[0] : (conv ? 1 : kh), sw = l->stride[1] > 0 ? l->stride[1] : (conv ? 1 : kw);
    int64_t pads[4] = {0, 0, 0, 0}; /* top, left, bottom, right */
    if (l->padding == LOOM_PAD_SAME) {
        same_pads(w->s.dim[0], kh, sh, &pads[0], &pads[2]);
        same_pads(w->s.dim[1], kw, sw, &pads[1], &pads[3]);
    }
    int64_t kernel[2] = {kh, kw}, strides[2] = {sh, sw};
    int64_t oh = (w->s.dim[0] + pads[0] + pads[2] - kh) / sh + 1;
    int64_t ow = (w->s.dim[1] + pads[1] + pads[3] - kw) / sw + 1;
    int64_t oc = conv ? l->filters : w->s.dim[2];
    char nb[32];
    fresh(o, nb);
    if (conv) {
        const char *k = conv_kernel(w, err);
        if (!k) return err->code;
        const char *bias = l->use_bias ? param_init(o, w->m, w->pi++) : NULL;
        node_begin(o, "Conv", nb, w->cur, k, bias);
    } else {
        /* AveragePool's count_include_pad = 0: the mean of the window's elements inside, as Keras */
        node_begin(o, l->kind == LOOM_LAYER_AVG_POOL2D ? "AveragePool" : "MaxPool", nb, w->cur, NULL, NULL);
    }
    attr_ints(o, "kernel_shape", kernel, 2);
    attr_ints(o, "strides", strides, 2);
    attr_ints(o, "pads", pads, 4);
    node_end(o);
    strcpy(w->cur, nb);
    if (conv) activation(o, l->activation, w->cur);
    w->s = (loom_shape){.rank = 3, .dim = {oh, ow, oc}};
    return LOOM_OK;
}

static int emit_flatten(onnx_walk *w, const loom_layer_spec *l, loom_err *err)
{
    (void)l, (void)err;
    if (w->nchw) transpose(w, to_nhwc, false);
    char nb[32];
    node_begin(w->o, "Flatten", fresh(w->o, nb), w->cur, NULL, NULL);
    attr_int(w->o, "axis", 1);
    node_end(w->o);
    strcpy(w->cur, nb);
    w->s = (loom_shape){.rank = 1, .dim = {loom_shape_numel(&w->s)}};
    return LOOM_OK;
}

static int emit_dropout(onnx_walk *w, const loom_layer_spec *l, loom_err *err)
{
    (void)w, (void)l, (void)err; /* identity at inference */
    return LOOM_OK;
}

static int emit_activation(onnx_walk *w, const loom_layer_spec *l, loom_err *err)
{
    char where[LOOM_PATH_MAX + 16];
    if (w->nchw && l->activation == LOOM_ACT_SOFTMAX) /* not reached: softmax needs rank 1 (model.c) */
        return loom_err_set(err, LOOM_EUNSUPPORTED, loom_loc_str(&l->loc, where, sizeof where),
                            "layer \"%s\": softmax over an image", l->name);
    activation_a(w->o, l->activation, (float)l->alpha, w->cur);
    return LOOM_OK;
}

/* A plugin's layer: the node its onnx() names, on Loom's layout (channels
 * last), its inputs the layer's then its parameter tensors. */
static int emit_plugin(onnx_walk *w, const loom_layer_spec *l, loom_err *err)
{
    loom_layer_onnx node;
    int np = 0;
    loom_shape out;
    int rc = loom_model_plugin_onnx(w->m, l, &node, &np, &out, err);
    if (rc) return rc;
    if (np > 2)
        return loom_err_set(err, LOOM_EUNSUPPORTED, NULL, "layer \"%s\" (%s): an ONNX node with %d parameter "
                            "tensors (Loom's export takes at most 2)", l->name, l->plugin, np);
    if (w->nchw) transpose(w, to_nhwc, false);
    char nb[32];
    const char *p0 = np > 0 ? param_init(w->o, w->m, w->pi++) : NULL;
    const char *p1 = np > 1 ? param_init(w->o, w->m, w->pi++) : NULL;
    node_begin(w->o, node.op_type, fresh(w->o, nb), w->cur, p0, p1);
    for (int a = 0; a < node.n_attr; a++) attr_int(w->o, node.attr_name[a], node.attr_value[a]);
    node_end(w->o);
    strcpy(w->cur, nb);
    w->s = out;
    return LOOM_OK;
}

/* ---- attention (issue 24) as opset-17 MatMul / Softmax graphs ---- */

/* in reshaped to dims (0 keeps the batch) into a fresh value, out; the shape an initializer "<layer>/<tag>" */
static void reshape_to(onnx_walk *w, const loom_layer_spec *l, const char *in, const char *tag, const int64_t *dims,
                       int n, char out[32])
{
    char sn[LOOM_NAME_MAX + 64];
    snprintf(sn, sizeof sn, "%s/%s", l->name, tag);
    initializer(w->o, sn, ONNX_INT64, (int64_t[]){n}, 1, dims, (size_t)n * sizeof(int64_t));
    node_begin(w->o, "Reshape", fresh(w->o, out), in, sn, NULL);
    node_end(w->o);
}

static void transpose_to(onnx_walk *w, const char *in, const int64_t perm[4], char out[32])
{
    node_begin(w->o, "Transpose", fresh(w->o, out), in, NULL, NULL);
    attr_ints(w->o, "perm", perm, 4);
    node_end(w->o);
}

/* One projection of x (N, T, k) by the next kernel (k, H, d) and bias (H, d), split in heads: (N, H, T, d)
 * with perm {0, 2, 1, 3}, or (N, H, d, T) for the keys {0, 2, 3, 1}. */
static void attn_proj(onnx_walk *w, const loom_layer_spec *l, const char *x, const char *tag, int64_t T, int64_t k,
                      int64_t d, const int64_t perm[4], char out[32])
{
    const int64_t H = l->num_heads;
    char kn[32], t[32], sh[32];
    const char *kernel = param_init(w->o, w->m, w->pi++);
    char tg[48];
    snprintf(tg, sizeof tg, "%s_kernel_shape", tag);
    reshape_to(w, l, kernel, tg, (int64_t[]){k, H * d}, 2, kn);
    binary(w->o, "MatMul", x, kn, t);
    if (l->use_bias) {
        const char *bias = param_init(w->o, w->m, w->pi++);
        snprintf(tg, sizeof tg, "%s_bias_shape", tag);
        reshape_to(w, l, bias, tg, (int64_t[]){H * d}, 1, kn);
        binary(w->o, "Add", t, kn, t);
    }
    snprintf(tg, sizeof tg, "%s_heads", tag);
    reshape_to(w, l, t, tg, (int64_t[]){0, T, H, d}, 4, sh);
    transpose_to(w, sh, perm, out);
}

/* multi_head_attention: softmax(Q K^T / sqrt(key_dim) + causal mask) V per head, the heads joined and projected
 * (attention dropout: identity); query xq (N, T, Dq), value xv (N, S, Dv), key xk (N, S, Dk). An embedding's
 * mask_zero masks padding keys of S steps (a key of padding alone gets uniform weights where nn gives 0). */
static int attention(onnx_walk *w, const loom_layer_spec *l, const char *xq, const char *xv, const char *xk,
                     const int64_t dims[5], loom_err *err)
{
    const int64_t T = dims[0], Dq = dims[1], S = dims[2], Dv = dims[3], Dk = dims[4], H = l->num_heads,
                  dk = l->key_dim, dv = l->value_dim > 0 ? l->value_dim : l->key_dim;
    const int64_t hp[4] = {0, 2, 1, 3}, kp[4] = {0, 2, 3, 1};
    char q[32], k[32], v[32], s[32], sn[LOOM_NAME_MAX + 32];
    attn_proj(w, l, xq, "query", T, Dq, dk, hp, q);
    attn_proj(w, l, xk, "key", S, Dk, dk, kp, k);
    attn_proj(w, l, xv, "value", S, Dv, dv, hp, v);
    binary(w->o, "MatMul", q, k, s); /* (N, H, T, S) */
    snprintf(sn, sizeof sn, "%s/scale", l->name);
    const_scalar(w->o, sn, 1.f / sqrtf((float)dk));
    binary(w->o, "Mul", s, sn, s);
    if (l->causal) {
        float *mk = loom_alloc((size_t)(T * S) * sizeof(float));
        if (!mk) return loom_err_set(err, LOOM_ENOMEM, NULL, "the causal mask of layer \"%s\"", l->name);
        for (int64_t i = 0; i < T * S; i++) mk[i] = i % S > i / S ? -INFINITY : 0.f;
        snprintf(sn, sizeof sn, "%s/causal_mask", l->name);
        initializer(w->o, sn, ONNX_FLOAT, (int64_t[]){T, S}, 2, mk, (size_t)(T * S) * sizeof(float));
        loom_free(mk);
        binary(w->o, "Add", s, sn, s);
    }
    if (w->key_mask[0] && w->mask_T == S) { /* the embedding's mask_zero on the keys: -1e9 (exp gives 0) */
        char m4[32], ax[LOOM_NAME_MAX + 32], zero[LOOM_NAME_MAX + 32], neg[LOOM_NAME_MAX + 32];
        snprintf(ax, sizeof ax, "%s/mask_axes", l->name);
        snprintf(zero, sizeof zero, "%s/mask_zero", l->name);
        snprintf(neg, sizeof neg, "%s/mask_neg", l->name);
        initializer(w->o, ax, ONNX_INT64, (int64_t[]){2}, 1, (int64_t[]){1, 2}, 2 * sizeof(int64_t));
        const_scalar(w->o, zero, 0.f);
        const_scalar(w->o, neg, -1e9f);
        binary(w->o, "Unsqueeze", w->key_mask, ax, m4); /* (N, 1, 1, S) */
        node_begin(w->o, "Where", fresh(w->o, sn), m4, zero, neg);
        node_end(w->o);
        binary(w->o, "Add", s, sn, s);
    }
    char p[32], c[32];
    node_begin(w->o, "Softmax", fresh(w->o, p), s, NULL, NULL);
    attr_int(w->o, "axis", -1);
    node_end(w->o);
    binary(w->o, "MatMul", p, v, c); /* (N, H, T, dv) */
    transpose_to(w, c, hp, s);
    reshape_to(w, l, s, "joined", (int64_t[]){0, T, H * dv}, 3, c);
    const char *ok = param_init(w->o, w->m, w->pi++);
    reshape_to(w, l, ok, "output_kernel_shape", (int64_t[]){H * dv, Dq}, 2, p);
    binary(w->o, "MatMul", c, p, w->cur);
    if (l->use_bias) binary(w->o, "Add", w->cur, param_init(w->o, w->m, w->pi++), w->cur);
    w->s = (loom_shape){.rank = 2, .dim = {T, Dq}};
    return LOOM_OK;
}

static int emit_attention(onnx_walk *w, const loom_layer_spec *l, loom_err *err)
{
    if (w->nchw) transpose(w, to_nhwc, false);
    char x[32];
    strcpy(x, w->cur);
    const int64_t T = w->s.dim[0], D = w->s.dim[1];
    return attention(w, l, x, x, x, (int64_t[]){T, D, T, D, D}, err);
}

/* positional_embedding: x + the table's first T rows (learned: a Slice of the parameter; sinusoidal: a constant) */
static int emit_positional(onnx_walk *w, const loom_layer_spec *l, loom_err *err)
{
    if (w->nchw) transpose(w, to_nhwc, false);
    const int64_t T = w->s.dim[0], D = w->s.dim[1];
    char sn[LOOM_NAME_MAX + 32], t[32];
    if (l->pos_mode == LOOM_POS_SINUSOIDAL) {
        float *pe = loom_alloc((size_t)(T * D) * sizeof(float));
        if (!pe) return loom_err_set(err, LOOM_ENOMEM, NULL, "the positions of layer \"%s\"", l->name);
        for (int64_t i = 0; i < T; i++) /* as nn's sinusoids (attention.c) */
            for (int64_t d = 0; d < D; d++) {
                double ang = (double)i / pow(10000.0, (double)(d - d % 2) / (double)D);
                pe[i * D + d] = (float)(d % 2 ? cos(ang) : sin(ang));
            }
        snprintf(sn, sizeof sn, "%s/sinusoids", l->name);
        initializer(w->o, sn, ONNX_FLOAT, (int64_t[]){T, D}, 2, pe, (size_t)(T * D) * sizeof(float));
        loom_free(pe);
        binary(w->o, "Add", w->cur, sn, w->cur);
        return LOOM_OK;
    }
    const char *table = param_init(w->o, w->m, w->pi++);
    char st[LOOM_NAME_MAX + 32], en[LOOM_NAME_MAX + 32];
    snprintf(st, sizeof st, "%s/rows_from", l->name);
    snprintf(en, sizeof en, "%s/rows_to", l->name);
    initializer(w->o, st, ONNX_INT64, (int64_t[]){1}, 1, (int64_t[]){0}, sizeof(int64_t));
    initializer(w->o, en, ONNX_INT64, (int64_t[]){1}, 1, (int64_t[]){T}, sizeof(int64_t));
    node_begin(w->o, "Slice", fresh(w->o, t), table, st, en);
    node_end(w->o);
    binary(w->o, "Add", w->cur, t, w->cur);
    return LOOM_OK;
}

/* The ONNX form of each layer kind, by loom_layer_kind. */
static int (*const kind_emit[])(onnx_walk *w, const loom_layer_spec *l, loom_err *err) = {
    [LOOM_LAYER_DENSE] = emit_dense,
    [LOOM_LAYER_CONV2D] = emit_window,
    [LOOM_LAYER_MAX_POOL2D] = emit_window,
    [LOOM_LAYER_AVG_POOL2D] = emit_window,
    [LOOM_LAYER_DROPOUT] = emit_dropout,
    [LOOM_LAYER_FLATTEN] = emit_flatten,
    [LOOM_LAYER_ACTIVATION] = emit_activation,
    [LOOM_LAYER_BATCH_NORM] = emit_norm,
    [LOOM_LAYER_LAYER_NORM] = emit_norm,
    [LOOM_LAYER_GLOBAL_AVG_POOL2D] = emit_global_pool,
    [LOOM_LAYER_EMBEDDING] = emit_embedding,
    [LOOM_LAYER_MULTI_HEAD_ATTENTION] = emit_attention,
    [LOOM_LAYER_POSITIONAL_EMBEDDING] = emit_positional,
    [LOOM_LAYER_PLUGIN] = emit_plugin,
    [LOOM_LAYER_ZERO_PADDING2D] = emit_zero_padding,
    [LOOM_LAYER_GLOBAL_MAX_POOL2D] = emit_global_pool,
    [LOOM_LAYER_RESHAPE] = emit_reshape,
    [LOOM_LAYER_UPSAMPLING2D] = emit_upsampling,
    [LOOM_LAYER_DEPTHWISE_CONV2D] = emit_conv_more,
    [LOOM_LAYER_SEPARABLE_CONV2D] = emit_conv_more,
    [LOOM_LAYER_CONV2D_TRANSPOSE] = emit_conv_more,
    [LOOM_LAYER_CONV1D] = emit_conv1d,
    [LOOM_LAYER_LSTM] = emit_rnn,
    [LOOM_LAYER_GRU] = emit_rnn,
    [LOOM_LAYER_BIDIRECTIONAL] = emit_rnn,
};

/* The graph's input: the source's raw feature with the preprocessing folded
 * in, int32/int64 ids for an embedding, or float32 features. */
static int graph_input(onnx_walk *w, const loom_spec *spec, const export_input *in, bool preprocessing,
                       const loom_dataset_spec *ds, loom_err *err)
{
    const loom_model_spec *ms = &spec->model;
    if (preprocessing) {
        value_info(w->o, GRAPH_INPUT, "input", onnx_dtype(in->raw_dtype), &in->raw_shape);
        return fold_preprocessing(w->o, spec, ds, in, 0, w->cur, err);
    }
    if (ms->n_layers > 0 && ms->layer[0].kind == LOOM_LAYER_EMBEDDING) { /* int32 or int64 ids */
        value_info(w->o, GRAPH_INPUT, "input", onnx_dtype(in->dtype), &in->shape);
        return LOOM_OK;
    }
    if (in->dtype != LOOM_F32)
        return loom_err_set(err, LOOM_EUNSUPPORTED, spec->path, "the model input \"%s\" is %s, not float32",
                            ms->input, loom_dtype_name(in->dtype));
    value_info(w->o, GRAPH_INPUT, "input", ONNX_FLOAT, &in->shape);
    return LOOM_OK;
}

/* A graph output named name, of the value in the walk, the output of the
 * layer l under loss: in Loom's layout, as loom predict gives it
 * (probabilities under softmax (binary) cross-entropy, unless the layer
 * ends on its own softmax (sigmoid)). */
static void graph_output(onnx_walk *w, const char *name, const loom_layer_spec *l, loom_loss_kind loss)
{
    onnx_graph *o = w->o;
    if (w->nchw) transpose(w, to_nhwc, false); /* a model ending on a conv or pool */
    bool ends_softmax = l && l->activation == LOOM_ACT_SOFTMAX;
    bool ends_sigmoid = l && l->activation == LOOM_ACT_SIGMOID;
    node_begin(o, loss == LOOM_LOSS_SPARSE_SOFTMAX_CE && !ends_softmax ? "Softmax"
                  : loss == LOOM_LOSS_BCE && !ends_sigmoid          ? "Sigmoid"
                                                                     : "Identity",
               name, w->cur, NULL, NULL);
    if (loss == LOOM_LOSS_SPARSE_SOFTMAX_CE && !ends_softmax) attr_int(o, "axis", -1);
    node_end(o);
    value_info(o, GRAPH_OUTPUT, name, ONNX_FLOAT, &w->s);
}

/* A value of the graph a layer reads: a model input or a layer's output,
 * as the walk carries it. */
typedef struct onnx_value {
    char       name[32];
    loom_shape s;    /* per example, Loom's layout */
    bool       nchw; /* held in ONNX's layout */
    loom_dtype dt;   /* float32 but a model input of ids */
} onnx_value;

/* The value v as the merge needs it, into name: in the layout nchw, and of
 * rank r (a lower rank gets 1s in front, as NumPy broadcasts from the last
 * axis: after the batch, not before it). */
static void merge_operand(onnx_walk *w, const loom_layer_spec *l, int k, const onnx_value *v, bool nchw, int r,
                          char name[32])
{
    strcpy(name, v->name);
    if (v->nchw != nchw) {
        char nb[32];
        node_begin(w->o, "Transpose", fresh(w->o, nb), name, NULL, NULL);
        attr_ints(w->o, "perm", nchw ? to_nchw : to_nhwc, 4);
        node_end(w->o);
        strcpy(name, nb);
    }
    if (v->s.rank < r) {
        char an[96];
        int64_t axes[LOOM_MAX_RANK], na = r - v->s.rank;
        for (int i = 0; i < na; i++) axes[i] = i + 1;
        snprintf(an, sizeof an, "%s/unsqueeze_%d", l->name, k);
        initializer(w->o, an, ONNX_INT64, &na, 1, axes, (size_t)na * sizeof(int64_t));
        binary(w->o, "Unsqueeze", name, an, name);
    }
}

/* inputs = [query, value(, key)]: each input's value by name (sequences: never NCHW) */
static int emit_attention_cross(onnx_walk *w, const loom_layer_spec *l, const onnx_value *v, int n, loom_err *err)
{
    const onnx_value *q = &v[0], *val = &v[1], *key = &v[n > 2 ? 2 : 1];
    strcpy(w->cur, q->name);
    w->nchw = false;
    return attention(w, l, q->name, val->name, key->name,
                     (int64_t[]){q->s.dim[0], q->s.dim[1], val->s.dim[0], val->s.dim[1], key->s.dim[1]}, err);
}

/* A merge layer (add, subtract, multiply, average, maximum, concatenate) of
 * the n values v: its inputs in one layout (ONNX's when one of them is in it
 * and all are images, Loom's otherwise), add and multiply chained in the
 * inputs' order as nn sums them, average as Mean, maximum as Max, and
 * concatenate's axis (the batch as 0, Loom's layout) mapped to the layout. */
static int emit_merge(onnx_walk *w, const loom_layer_spec *l, const onnx_value *v, int n, loom_err *err)
{
    (void)err;
    onnx_graph *o = w->o;
    int r = 0;
    bool any_nchw = false, same_rank = true;
    for (int k = 0; k < n; k++) {
        r = v[k].s.rank > r ? v[k].s.rank : r;
        any_nchw |= v[k].nchw;
        same_rank &= v[k].s.rank == v[0].s.rank;
    }
    bool nchw = any_nchw && same_rank;
    char in[LOOM_MAX_LAYER_INPUTS][32], nb[32];
    for (int k = 0; k < n; k++) merge_operand(w, l, k, &v[k], nchw, r, in[k]);
    loom_shape out = {.rank = r};
    if (l->kind == LOOM_LAYER_CONCATENATE) {
        int ax = l->axis < 0 ? r + 1 + l->axis : l->axis; /* 1..r: H, W, C of an image */
        out = v[0].s;
        out.dim[ax - 1] = 0;
        for (int k = 0; k < n; k++) out.dim[ax - 1] += v[k].s.dim[ax - 1];
        fresh(o, nb);
        for (int k = 0; k < n; k++) pb_str(&o->node, NODE_INPUT, in[k]);
        pb_str(&o->node, NODE_OUTPUT, nb);
        char name[64];
        snprintf(name, sizeof name, "Concat_%d", o->n_nodes++);
        pb_str(&o->node, NODE_NAME, name);
        pb_str(&o->node, NODE_OP_TYPE, "Concat");
        attr_int(o, "axis", nchw ? (ax == 3 ? 1 : ax + 1) : ax);
        node_end(o);
        strcpy(w->cur, nb);
    } else {
        for (int d = 0; d < r; d++) out.dim[d] = 1; /* broadcast from the last axis, as nn */
        for (int k = 0; k < n; k++)
            for (int d = 0; d < v[k].s.rank; d++) {
                int od = r - v[k].s.rank + d;
                if (v[k].s.dim[d] != 1) out.dim[od] = v[k].s.dim[d];
            }
        if (l->kind == LOOM_LAYER_AVERAGE || l->kind == LOOM_LAYER_MAXIMUM) { /* variadic */
            fresh(o, nb);
            for (int k = 0; k < n; k++) pb_str(&o->node, NODE_INPUT, in[k]);
            pb_str(&o->node, NODE_OUTPUT, nb);
            const char *op = l->kind == LOOM_LAYER_AVERAGE ? "Mean" : "Max";
            char name[64];
            snprintf(name, sizeof name, "%s_%d", op, o->n_nodes++);
            pb_str(&o->node, NODE_NAME, name);
            pb_str(&o->node, NODE_OP_TYPE, op);
            node_end(o);
            strcpy(w->cur, nb);
        } else {
            const char *op = l->kind == LOOM_LAYER_ADD ? "Add" : l->kind == LOOM_LAYER_SUBTRACT ? "Sub" : "Mul";
            strcpy(w->cur, in[0]);
            for (int k = 1; k < n; k++) binary(o, op, w->cur, in[k], w->cur);
        }
    }
    w->s = out;
    w->nchw = nchw;
    return LOOM_OK;
}

/* Several model inputs (model.inputs): one graph input each, named by its
 * feature, ids (int32/int64) for an embedding or float32; or the source's
 * raw feature with its maps folded in. */
static int graph_inputs(onnx_walk *w, const loom_spec *spec, const export_input *in, bool preprocessing,
                        const loom_dataset_spec *ds, onnx_value *iv, loom_err *err)
{
    for (int f = 0; f < in->n; f++) {
        const char *feat = spec->model.inputs[f];
        loom_dtype dt = in->dtypes[f];
        if (dt != LOOM_F32 && dt != LOOM_I32 && dt != LOOM_I64)
            return loom_err_set(err, LOOM_EUNSUPPORTED, spec->path, "the model input \"%s\" is %s, not float32 or "
                                "int32/int64 ids", feat, loom_dtype_name(dt));
        if (preprocessing) value_info(w->o, GRAPH_INPUT, feat, onnx_dtype(in->raw_dtypes[f]), &in->raw_shapes[f]);
        else value_info(w->o, GRAPH_INPUT, feat, onnx_dtype(dt), &in->shapes[f]);
        iv[f] = (onnx_value){.s = in->shapes[f], .dt = dt};
        if (strlen(feat) < sizeof iv[f].name) {
            strcpy(iv[f].name, feat);
        } else { /* the walk's values are short names */
            node_begin(w->o, "Identity", fresh(w->o, iv[f].name), feat, NULL, NULL);
            node_end(w->o);
        }
        int rc = preprocessing ? fold_preprocessing(w->o, spec, ds, in, f, iv[f].name, err) : LOOM_OK;
        if (rc) return rc;
    }
    return LOOM_OK;
}

/* The ONNX graph of the model: its inputs, each layer by its kind's emitter
 * in the order the layers run, reading its inputs' values by name, its
 * output. A chain comes out as the walk along it always did. */
static int build_graph(onnx_graph *o, const loom_spec *spec, loom_model *m, const export_input *in,
                       bool preprocessing, const loom_dataset_spec *ds, loom_err *err)
{
    const loom_model_spec *ms = &spec->model;
    onnx_walk w = {.o = o, .m = m, .in_dtype = in->dtype, .cur = "input", .s = in->shape};
    pb_str(&o->g, GRAPH_NAME, "loom");
    onnx_value iv[LOOM_MAX_MODEL_INPUTS];
    int rc = in->n > 1 ? graph_inputs(&w, spec, in, preprocessing, ds, iv, err) : graph_input(&w, spec, in, preprocessing, ds, err);
    if (rc) return rc;
    if (in->n <= 1) {
        iv[0] = (onnx_value){.s = w.s, .dt = in->dtype};
        strcpy(iv[0].name, w.cur);
    }
    int n = loom_model_num_layers(m);
    onnx_value *val = loom_calloc((size_t)(n > 0 ? n : 1), sizeof *val);
    if (!val) return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating the export's values");
    for (int li = 0; li < n && !rc; li++) {
        int src[LOOM_MAX_LAYER_INPUTS], ns;
        const loom_layer_spec *l = loom_model_layer_spec(m, li, src, &ns);
        onnx_value sv[LOOM_MAX_LAYER_INPUTS] = {0};
        for (int k = 0; k < ns; k++) sv[k] = src[k] >= 0 ? val[src[k]] : iv[-1 - src[k]];
        if (l->kind >= LOOM_LAYER_ADD && l->kind <= LOOM_LAYER_CONCATENATE) {
            rc = emit_merge(&w, l, sv, ns, err);
        } else if (l->kind == LOOM_LAYER_MULTI_HEAD_ATTENTION && ns > 1) {
            rc = emit_attention_cross(&w, l, sv, ns, err);
        } else if ((unsigned)l->kind >= sizeof kind_emit / sizeof kind_emit[0] || !kind_emit[l->kind]) {
            char where[LOOM_PATH_MAX + 16];
            rc = loom_err_set(err, LOOM_EUNSUPPORTED, loom_loc_str(&l->loc, where, sizeof where),
                              "layer \"%s\" (%s) has no ONNX form in Loom's export", l->name,
                              l->kind == LOOM_LAYER_PLUGIN ? l->plugin : loom_layer_kind_name(l->kind));
        } else {
            strcpy(w.cur, sv[0].name);
            w.s = sv[0].s, w.nchw = sv[0].nchw, w.in_dtype = sv[0].dt;
            rc = kind_emit[l->kind](&w, l, err);
        }
        strcpy(val[li].name, w.cur);
        val[li].s = w.s, val[li].nchw = w.nchw, val[li].dt = LOOM_F32;
    }
    if (!rc) graph_output(&w, "output", ms->n_layers > 0 ? &ms->layer[ms->n_layers - 1] : NULL, ms->loss);
    /* several heads (model.outputs): each other head's an output named by its layer, after "output" */
    for (int h = 1; h < loom_model_num_heads(m) && !rc; h++) {
        int li = loom_model_head_layer(m, h), src[LOOM_MAX_LAYER_INPUTS], ns;
        strcpy(w.cur, val[li].name);
        w.s = val[li].s, w.nchw = val[li].nchw;
        graph_output(&w, ms->head[h].layer, loom_model_layer_spec(m, li, src, &ns), ms->head[h].loss);
    }
    loom_free(val);
    return rc;
}

static int write_onnx(const loom_spec *spec, loom_model *m, const export_input *in, bool preprocessing,
                      const loom_dataset_spec *ds, const char *ckpt, const char *output, loom_err *err)
{
    onnx_graph o = {0};
    loom_buf_init(&o.g), loom_buf_init(&o.node), loom_buf_init(&o.sub);
    int rc = build_graph(&o, spec, m, in, preprocessing, ds, err);
    loom_buf model, opset;
    loom_buf_init(&model), loom_buf_init(&opset);
    if (!rc) {
        pb_int(&model, MODEL_IR_VERSION, ONNX_IR_VERSION);
        pb_str(&model, MODEL_PRODUCER_NAME, "loom");
        pb_str(&model, MODEL_PRODUCER_VERSION, LOOM_VERSION);
        char doc[LOOM_PATH_MAX * 2 + 64];
        snprintf(doc, sizeof doc, "%s, checkpoint %s", spec->path, ckpt);
        pb_str(&model, MODEL_DOC, doc);
        pb_msg(&model, MODEL_GRAPH, &o.g);
        pb_str(&opset, OPSET_DOMAIN, "");
        pb_int(&opset, OPSET_VERSION, ONNX_OPSET);
        pb_msg(&model, MODEL_OPSET_IMPORT, &opset);
        if (model.failed || o.g.failed) rc = loom_err_set(err, LOOM_ENOMEM, NULL, "building the ONNX model");
    }
    if (!rc) rc = loom_write_file_atomic(output, model.data, model.len, err);
    loom_buf_fini(&o.g), loom_buf_fini(&o.node), loom_buf_fini(&o.sub), loom_buf_fini(&model), loom_buf_fini(&opset);
    return rc;
}

/* ---- the command ---------------------------------------------------------------- */

/* The model input's shapes from the config's eval pipeline (train without
 * one): its maps and batches (shapes per example: the batch dimension
 * dropped); for preprocessing, the source alone. */
static int input_of(const loom_spec *spec, const loom_dataset_spec *base, bool raw, export_input *in, loom_err *err)
{
    loom_dataset_spec *ds = loom_calloc(1, sizeof *ds);
    if (!ds) return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating a dataset spec");
    int rc = LOOM_OK;
    for (int pass = 0; pass < (raw ? 2 : 1) && !rc; pass++) { /* each pass reads the source: export's main cost */
        *ds = *base;
        ds->n_transforms = 0;
        bool batched = false; /* the maps with the batches they run on (a Lua map may read a batch's rows) */
        if (pass == 0) /* the maps, their batches, and the transforms that make a text's examples (issue 24) */
            for (int i = 0; i < base->n_transforms; i++) {
                loom_transform_kind k = base->transform[i].kind;
                if (k == LOOM_T_MAP || k == LOOM_T_BATCH || k == LOOM_T_SELECT || k == LOOM_T_UNBATCH ||
                    k == LOOM_T_WINDOW || k == LOOM_T_LM_PAIRS || k == LOOM_T_FLAT_MAP) {
                    batched |= k == LOOM_T_BATCH;
                    ds->transform[ds->n_transforms++] = base->transform[i];
                }
            }
        loom_iter *it = NULL;
        loom_data_ctx ctx = {.seed = spec->run.seed, .threads = 0, .name = "export"};
        rc = loom_data_open(&it, ds, &ctx, err);
        if (rc) {
            loom_err_prefix(err, "%s", base == &spec->eval ? "data.eval" : "data.train");
            break;
        }
        loom_elem_spec unb = *loom_iter_spec(it), *es = &unb;
        for (int f = 0; batched && f < unb.n; f++) /* per example: the batch dimension dropped */
            unb.shape[f] = loom_shape_make(unb.shape[f].rank - 1, unb.shape[f].dim + 1);
        int xi = loom_elem_spec_find(es, spec->model.input), yi = loom_elem_spec_find(es, spec->model.label);
        if (xi < 0 || (pass == 0 && yi < 0)) {
            char have[512];
            rc = loom_err_set(err, LOOM_ESHAPE, spec->path, "the pipeline has no feature \"%s\" (it yields %s)",
                              xi < 0 ? spec->model.input : spec->model.label, loom_elem_spec_str(es, have, sizeof have));
        } else if (pass == 0) {
            in->shape = es->shape[xi], in->dtype = es->dtype[xi];
            in->label_shape = es->shape[yi], in->label_dtype = es->dtype[yi];
            in->n = spec->model.n_inputs > 1 ? spec->model.n_inputs : 1;
            for (int f = 0; f < in->n && !rc; f++) {
                int fi = f ? loom_elem_spec_find(es, spec->model.inputs[f]) : xi;
                if (fi < 0) {
                    char have[512];
                    rc = loom_err_set(err, LOOM_ESHAPE, spec->path, "the pipeline has no feature \"%s\" (it yields %s)",
                                      spec->model.inputs[f], loom_elem_spec_str(es, have, sizeof have));
                } else {
                    in->shapes[f] = es->shape[fi], in->dtypes[f] = es->dtype[fi];
                }
            }
        } else {
            in->raw_shape = es->shape[xi], in->raw_dtype = es->dtype[xi];
            for (int f = 0; f < in->n && !rc; f++) {
                int fi = f ? loom_elem_spec_find(es, spec->model.inputs[f]) : xi;
                if (fi < 0) {
                    char have[512];
                    rc = loom_err_set(err, LOOM_ESHAPE, spec->path, "the source has no feature \"%s\" (it yields %s)",
                                      spec->model.inputs[f], loom_elem_spec_str(es, have, sizeof have));
                } else {
                    in->raw_shapes[f] = es->shape[fi], in->raw_dtypes[f] = es->dtype[fi];
                }
            }
        }
        loom_iter_close(it);
    }
    loom_free(ds);
    return rc;
}

int loom_export(const loom_spec *spec, const loom_export_opts *opts, loom_err *err)
{
    double t0 = loom_now();
    const loom_dataset_spec *base = spec->eval.present ? &spec->eval : &spec->train;
    for (int i = 0; i < base->n_transforms; i++)
        if (base->transform[i].kind == LOOM_T_MAP && base->transform[i].map.kind == LOOM_MAP_LUA &&
            opts->include_preprocessing) { /* maps whole elements: the input's values may change */
            char w[LOOM_PATH_MAX + 16];
            loom_err_set(err, LOOM_EUNSUPPORTED, loom_loc_str(&base->transform[i].loc, w, sizeof w),
                         "--include-preprocessing: a Lua map has no ONNX form");
            return loom_err_hint(err, "export without --include-preprocessing and apply it before the model");
        }
    /* the output (new, or a regular file, or a link to one: written through)
     * and its directory must be writable before any work */
    char target[LOOM_PATH_MAX], dir[LOOM_PATH_MAX];
    int rc = loom_output_target(opts->output, target, sizeof target, err);
    if (rc) return rc;
    snprintf(dir, sizeof dir, "%s", target);
    char *slash = strrchr(dir, '/');
    if (slash) *slash = 0;
    else snprintf(dir, sizeof dir, ".");
    if (!*dir) snprintf(dir, sizeof dir, "/");
    if (access(dir, W_OK | X_OK) != 0)
        return loom_err_set(err, LOOM_EIO, opts->output, "cannot write the export here: %s: %s", dir, strerror(errno)),
               loom_err_hint(err, "choose a path in a directory that exists and you may write to");
    export_input in = {0};
    rc = input_of(spec, base, opts->format == LOOM_EXPORT_ONNX && opts->include_preprocessing, &in, err);
    if (rc) return rc;
    loom_model *m = NULL;
    rc = in.n > 1 ? loom_model_new_inputs(&m, &spec->model, in.n, in.shapes, in.dtypes, &in.label_shape,
                                          in.label_dtype, 1, err)
                  : loom_model_new(&m, &spec->model, &in.shape, in.dtype, &in.label_shape, in.label_dtype, 1, err);
    if (rc) return rc;
    char path[LOOM_PATH_MAX];
    int64_t step = -1;
    if (opts->checkpoint) {
        snprintf(path, sizeof path, "%s", opts->checkpoint);
    } else {
        const char *md = opts->model_dir ? opts->model_dir : spec->run.model_dir;
        rc = loom_ckpt_latest(md, path, &step, err);
        if (rc == LOOM_EEOF)
            rc = loom_err_set(err, LOOM_EIO, md, "no checkpoint in the model directory"),
            loom_err_hint(err, "train first (loom train %s) or pass --checkpoint FILE", spec->path);
    }
    if (!rc) rc = loom_ckpt_load(path, m, NULL, NULL, NULL, err);
    double t1 = loom_now();
    if (!rc)
        rc = opts->format == LOOM_EXPORT_NPZ
                 ? loom_export_npz_(m, opts->output, err)
                 : write_onnx(spec, m, &in, opts->include_preprocessing, base, path, opts->output, err);
    if (!rc)
        loom_info("exported %s to %s as %s in %.1f ms (%.1f ms of it building the model and reading the checkpoint)",
                  path, opts->output, opts->format == LOOM_EXPORT_NPZ ? "npz" : "onnx", 1e3 * (loom_now() - t0),
                  1e3 * (t1 - t0));
    loom_model_free(m);
    return rc;
}
