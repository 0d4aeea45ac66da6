/* nn_internal.h - the model's private layout shared by model_build.c, model.c and layers.c.
 * A layer is a small record of its resolved geometry plus the buffers it owns
 * (output activations, pooling argmax, dropout mask), all sized for max_batch
 * at loom_model_new so a step never allocates (loom_model_new_plan's model:
 * at its first step); with batch normalization most of them are offsets in
 * one arena, planned by live phases (buffer_plan.c). A step splits its batch into
 * chunks of contiguous examples, one per thread (nn_chunk_): each chunk uses
 * its own rows of those shared buffers, so chunks never touch the same
 * bytes, plus its own im2col scratch and gradient buffer. */
#ifndef LOOM_NN_INTERNAL_H
#define LOOM_NN_INTERNAL_H

#include "nn.h"

typedef struct nn_layer_ {
    loom_layer_spec spec;          /* copied from the model spec */
    char            where[LOOM_PATH_MAX + 16]; /* "file:line" of the layer, for errors */
    loom_shape      in, out;       /* per example */
    int64_t         n_in, n_out;   /* elements per example */
    loom_activation act;           /* applied after the layer's op; a softmax fused into the loss becomes NONE */
    int64_t         kernel_off;    /* into params/grads, -1 when absent */
    int64_t         bias_off;      /* -1 when absent (use_bias = false or no parameters) */
    int             needs_dx;      /* some earlier layer has parameters, so the input gradient is needed */
    /* conv2d, max_pool2d geometry */
    int ih, iw, cin, oh, ow, cout, kh, kw, sh, sw, pad_t, pad_l;
    int chunk;                     /* conv2d: examples per im2col chunk */
    int fma;                       /* conv2d with cin = 1: the explicit-FMA direct kernels, 1: AVX2+FMA, 2: AVX-512 (same bits) */
    /* conv2d followed by a max_pool2d whose windows tile the conv's output
     * exactly, the conv's activation none or relu: one pass instead of four.
     * The conv (fuse_pool) leaves its pre-activation in y (the GEMM path
     * before the bias) and pools each im2col chunk while it is in cache; the
     * pool (fused) takes the max, then adds the bias and applies the ReLU:
     * x -> x + b keeps order under rounding and ReLU commutes with max, so
     * the pooled values are the unfused ones bit for bit. Its backward writes
     * the conv's dz at the window maxima (zeros elsewhere) and keeps the
     * ReLU-masked pooled gradient in its own dz for the conv's bias sums. */
    int fuse_pool;                 /* conv2d */
    int fused;                     /* max_pool2d */
    /* an activation whose gradient comes from its output (relu, sigmoid, ...), or an add, whose input 0 is
     * a batch normalization or an add that nothing else reads and whose backward needs not its output:
     * y is that input's buffer, overwritten in place (model.c, fuse), as PyTorch's inplace ReLU */
    int inplace;
    /* a relu activation inplace on a batch normalization: the batch normalization's passes apply it (bn_relu:
     * its normalize writes max(0, y); its backward takes the gradient where its output, recomputed from bn_x,
     * is > 0), and the activation (relu_in_bn) passes x and g on: the unfused bits, two passes fewer */
    int bn_relu, relu_in_bn;
    /* a batch normalization over layer i - 1, a conv2d with no activation that it alone reads: its backward
     * writes the input gradient straight into that conv's dz rows (bn_pass.c), which the conv's backward then
     * takes as its g without copying them (model.c, graph.c hand those rows on) */
    int bn_dx_dz;
    float         *y;              /* (max_batch, n_out) owned output; NULL for flatten */
    int32_t       *argmax;         /* max_pool2d: (max_batch, n_out) input index within the example */
    uint8_t       *mask;           /* dropout: (max_batch, n_out) 1 = kept */
    float         *dz;             /* dense, conv2d: (max_batch, n_out) d(loss)/d(pre-activation), kept from the
                                      chunks' backward for the whole-batch kernel and bias gradients;
                                      layer_normalization, embedding: d(loss)/d(output) */
    /* batch_ and layer_normalization: kernel_off is gamma, bias_off beta; C the normalised axis (the last) */
    int64_t        mm_off, mv_off; /* batch_normalization: moving mean and variance (not trained) */
    int64_t        C;
    float         *xhat;           /* layer_normalization: (max_batch, n_out) the normalised input */
    const float   *bn_x;           /* batch_normalization: the last training forward's input rows (the whole
                                      batch's, kept by the layer before for the step), xhat's source */
    float         *stat;           /* batch: (2 C) mean, 1/std of the batch; layer: (max_batch * n_out / C) 1/std */
    double         sync_n;         /* batch_normalization, sync: the global batch's rows of the last forward */
    /* embedding: the table is the kernel, (rows, dim); input (cols,) or (cols, k) ids, output (cols, dim) */
    int64_t        rows;           /* input_dim */
    int            dim, cols, k;   /* output_dim; columns and ids per column of an example */
    int64_t        sp_max;         /* distinct rows a batch can touch: min(max_batch * cols * k, rows) */
    int64_t        sp_n;           /* rows touched by the last backward */
    int64_t       *sp_ids;         /* (sp_max,) their ids, first-seen order */
    float         *sp_val;         /* (sp_max, dim) their summed gradient rows */
    int64_t       *hkey;           /* (hsize,) open-addressing id -> slot map, -1 = empty */
    int32_t       *hval;           /* (hsize,) */
    int64_t        hsize;          /* a power of two >= 2 sp_max */
    /* issue 23's layers (conv_more.c) */
    int            dh, dw;         /* convolutions: dilation (1: none) */
    int            groups;         /* convolutions: channel groups (depthwise: cin; 1: none) */
    int            mult;           /* depthwise_, separable_conv2d: depth_multiplier */
    int            direct;         /* a convolution the direct loops of conv_more.c run (not conv2d's im2col) */
    int            pad_b, pad_r;   /* zero_padding2d (with pad_t, pad_l) */
    int64_t        pw_off;         /* separable_conv2d: the pointwise kernel, -1 when absent */
    float         *mid, *dmid;     /* separable_conv2d: (max_batch, oh*ow*cin*mult) depthwise output, its gradient */
    /* the graph (graph.c): the layers run in a topological order, the output last */
    int            n_src;          /* inputs: 1, or 2 and more for a merge layer */
    int            src[LOOM_MAX_LAYER_INPUTS]; /* each a layer (>= 0, earlier) or model input f as -1 - f */
    loom_shape     src_shape[LOOM_MAX_LAYER_INPUTS];
    int64_t        bstride[LOOM_MAX_LAYER_INPUTS][LOOM_MAX_RANK]; /* merge: input k's stride along each output
                                      axis (0 where it broadcasts); bstride[k][0] < 0: k has the output's shape */
    int            n_cons;         /* layers taking its output */
    int            gacc;           /* its output's gradient is summed in dgy (several consumers, or one that is not
                                      the next layer), not handed down the chain in the chunk's g */
    int            need_out;       /* the gradient of its output is needed (parameters here or upstream) */
    float         *dgy;            /* gacc: (max_batch, n_out) that gradient, over its consumers in reverse order */
    int            arena;          /* NN_ARENA_* bits: y, dz, dgy placed in the model's arena (buffer_plan.c) */
    int            early;          /* conv2d: parameter gradients right after its backward segment (dz then dead) */
    /* a plugin's layer kind (layer_plugin.c); its dz rows keep dy for param_grads */
    const loom_layer_ops *pops;
    void          *pinst;
    loom_layer_plan *pplan;        /* what build() declared */
    int64_t        poff[LOOM_LAYER_MAX_PARAMS]; /* each parameter tensor's offset in the flat buffer */
    unsigned char *pscratch;       /* (max_batch * scratch_per_example) bytes */
    float         *pdx;            /* several inputs or whole_batch: (max_batch, each input's numel) in input order,
                                      the input gradients the host hands on (input 0's of a chunk: its other buffer) */
    /* sequences (issue 24): dense on the last axis, the recurrent layers (recurrent.c) */
    int64_t        steps;          /* dense: rows per example (the input's elements over its last axis; 1 for rank 1);
                                      lstm, gru, bidirectional: T, the time steps */
    int            H, D;           /* recurrent: units, input features per step */
    int            gates;          /* recurrent: 4 (lstm, i f g o) or 3 (gru, r z n) */
    int64_t        rk_off;         /* recurrent: the recurrent kernel (H, gates H); direction 2 of a bidirectional: +dir2 */
    int64_t        dir2;           /* bidirectional: offset of the backward direction's tensors from the forward's */
    float         *rs;             /* recurrent: (max_batch, rs_per) the steps' saved state (recurrent.c) */
    int64_t        rs_per;         /* floats of rs per example */
    /* multi_head_attention, positional_embedding (attention.c): an example is (T, D) */
    int            heads, dk, dv;  /* attention: heads, per-head key and value widths */
    int            T, S;           /* query and key steps */
    int            Dq, Dkv, Do;    /* query, key and output widths */
    int            Dvin;           /* value width (self-attention: Dq) */
    int64_t        aoff[8];        /* attention: its parameter tensors (attention.c AW_*), -1 when absent */
    float         *ab[12];         /* attention: its (max_batch, ...) buffers (attention.c AB_*); sinusoidal: ab[0] the table */
} nn_layer_;

/* The slice of a step's batch that one thread works on: examples [b0, b0 + B).
 * Layer outputs go to rows b0.. of the layers' shared buffers. Dense and
 * conv layers leave their dz rows; their parameter gradients are computed
 * once over the whole batch after all chunks finish (nn_*_param_grads_). */
typedef struct nn_chunk_ {
    int64_t      b0, B;
    int64_t      bt;                       /* the batch's examples (all chunks'), for loom_sgemm_rows' tiles */
    float       *pad;                      /* loom_sgemm_rows' tile scratch (m->padmax floats); NULL when none */
    float       *grads;                    /* the model's (P,) for chunk 0; NULL for the others */
    float       *col;                      /* im2col scratch; NULL when no conv needs one */
    float       *gbuf[2];                  /* (B, max n) ping-pong gradient rows of this chunk */
    const float *act[LOOM_MAX_LAYERS + 1]; /* act[i] (B, n_in of layer i): layer i's input; act[n_layers]: output */
    float       *g, *other;                /* the backward's gradient buffers between layers and segments */
    int          bw_done;                  /* the backward needs no earlier layer */
    const float *yo[LOOM_MAX_LAYERS];      /* a graph's layer outputs (c->act[i + 1] of a chain) */
    const float *xin[LOOM_MAX_MODEL_INPUTS]; /* a graph's model inputs, this chunk's rows */
    uint8_t      ginit[LOOM_MAX_LAYERS];   /* a graph's backward: dgy rows of the layer hold a first gradient */
    int          dx_acc;                   /* graph.c: the layer's backward adds its input gradient to other's
                                              rows (nn_dx_into_: its input's dgy rows, already holding one) */
    double       pt[LOOM_MAX_LAYERS];      /* a profiled phase: seconds of each layer on this chunk */
    double       pu[LOOM_MAX_LAYERS];      /* a profiled gradient pass: seconds of each layer's in-step update */
    double       loss;                     /* results of the chunk (the heads' weighted sum) */
    int64_t      correct;
    double       hloss[LOOM_MAX_HEADS];    /* each head's own loss sum (unweighted) and correct count */
    int64_t      hcorrect[LOOM_MAX_HEADS];
    double       tok_loss;                 /* sparse softmax cross-entropy: the chunk's token losses, summed */
    int64_t      tok_ok, tok_n;            /* its right tokens, and tokens (unmasked); one per example without time */
} __attribute__((aligned(64))) nn_chunk_;

struct loom_model {
    int              n_layers;
    nn_layer_        layer[LOOM_MAX_LAYERS];
    loom_loss_kind   loss;
    char             where[LOOM_PATH_MAX + 16]; /* the model block's file:line */
    loom_shape       input, label;  /* per example */
    loom_dtype       label_dtype;
    int64_t          max_batch;
    int64_t          n_params;
    int              params_overflow; /* add_param: the count passed INT_MAX (offsets are int) */
    float           *params, *grads; /* (P,) each, 64-byte aligned */
    int              n_ptensors;
    loom_param_info  pinfo[4 * LOOM_MAX_LAYERS];   /* batch normalization has 4 */
    int              pinit[4 * LOOM_MAX_LAYERS];   /* loom_init of each tensor (bias: zeros) */
    double           pfan_in[4 * LOOM_MAX_LAYERS], pfan_out[4 * LOOM_MAX_LAYERS];
    float           *gbuf[2];       /* ping-pong gradient buffers, (max_batch, max n) each */
    int64_t          gmax;          /* max n: the row stride of gbuf */
    int64_t          colmax;        /* floats of im2col scratch per chunk (0: none) */
    int64_t          padmax;        /* floats of loom_sgemm_rows' tile scratch per chunk (0: none) */
    int32_t         *labels;        /* (max_batch,) sparse labels converted to int */
    float           *targets;       /* (max_batch, outputs) the other losses' labels converted to float */
    int              n_cw;          /* model.class_weight: 0 (none) or one per class */
    float            cw[LOOM_MAX_CLASS_WEIGHTS];
    float            huber_delta;
    float            l2;            /* model.l2 on every dense and conv kernel */
    const loom_tensor *sw;          /* loom_model_set_sample_weights: the next steps' weights, or NULL */
    float           *swb;           /* (max_batch,) those weights as float (nn_read_label_) */
    /* model.metrics (metrics.c): additive state over the steps since the last take */
    int              n_metrics;
    loom_metric_kind metric[LOOM_MAX_METRICS];
    int64_t          moff[LOOM_MAX_METRICS]; /* each metric's doubles in mstate */
    int64_t          msize;         /* doubles of state (0: none kept) */
    double          *mstate;        /* (msize,) */
    int              auc_T, auc_curves, top_k;
    double           flops;         /* forward, per example */
    /* intra-op threads: chunk[t] belongs to thread t; chunk[0] always exists */
    int              threads;
    int              row_q;        /* the BLAS's row quantum (loom_blas_row_quantum) when the buffers are made */
    bool             chunks_free;  /* chunks may start anywhere: every product over a chunk's rows goes through
                                      loom_sgemm_rows (model_build.c); else they start at multiples of row_q */
    int              n_split;      /* chunks of the last split_batch (model.c): what the token metrics sum over */
    loom_pool       *pool;          /* NULL when threads == 1 */
    nn_chunk_       *chunk;         /* (threads,) 64-byte aligned */
    /* a train step taken in parts (loom_model_forward, _loss, _backward) */
    loom_dtype       input_dtype;   /* float32, or int32 / int64 ids when layer 0 is an embedding */
    int              sparse_owner;  /* tables' dense grads are written by the model alone (loom_model_set_sparse_owner) */
    int              part_done;     /* phases done on the current batch: 0, 1 (forward), 2 (loss) */
    int              n_bn;          /* batch_normalization layers: a step runs in segments between them */
    int64_t          part_B;        /* its examples */
    int              part_chunks;   /* the chunks its forward split them into (split_batch: fewer than the threads
                                     * where the BLAS row quantum rounds a cut to 0) */
    int64_t          part_gb;       /* and the global batch of its loss */
    loom_grad_ready_fn grad_hook;   /* loom_model_set_grad_hook */
    void            *grad_hook_arg;
    loom_model_prof *prof;          /* loom_model_set_prof; NULL: off */
    /* the optimizer inside the step (loom_model_train_step_update), for its duration; NULL: none */
    loom_optimizer  *upd;
    int64_t          upd_step;
    /* synchronised batch normalization (loom_model_set_bn_sync): a step's
     * calls of fn are numbered; sync_k is the next, sync_rc/err the first failure */
    float           *arena;         /* buffer_plan.c: the layers' short-lived buffers, (arena_floats,) */
    int64_t          arena_floats;
    int              gbuf_arena;    /* gbuf[0], gbuf[1] are in the arena */
    int              ready;         /* the step's buffers: 0 not yet allocated (`loom check` never does), 1 there, -1 failed */
    /* the graph (graph.c) */
    int              graph;         /* some layer is not a chain link: the executor's graph paths */
    int              n_inputs;      /* model inputs (model.inputs; 1 for model.input) */
    loom_shape       in_shape[LOOM_MAX_MODEL_INPUTS]; /* per example; [0] is input */
    char             in_name[LOOM_MAX_MODEL_INPUTS][LOOM_NAME_MAX];
    const loom_tensor *xs[LOOM_MAX_MODEL_INPUTS];     /* loom_model_set_inputs: inputs 1.. of the next steps */
    /* output heads (model.outputs): head 0 is the last layer, with loss, label and the metrics above;
     * the others are computed in the loss phase, their gradient written into their layer's dgy rows */
    int              n_heads;       /* 1 without model.outputs */
    struct nn_head_ {
        int              layer;     /* index in layer[] (head 0: n_layers - 1) */
        loom_loss_kind   loss;
        float            weight;
        bool             accuracy;  /* heads 1..: report <name>_accuracy */
        char             name[LOOM_NAME_MAX];
        const loom_tensor *label;   /* loom_model_set_head_labels: the next steps' (heads 1..) */
        int32_t         *labels;    /* (max_batch,) sparse classes */
        float           *targets;   /* (max_batch, n_out) the other losses' */
    } head[LOOM_MAX_HEADS];
    int64_t          hoff;          /* several heads: their (loss sum, correct) pairs in mstate */
    double           hloss[LOOM_MAX_HEADS];    /* the last train / loss / evaluate step's, per head */
    int64_t          hcorrect[LOOM_MAX_HEADS];
    loom_bn_sync_fn  bn_sync;
    void            *bn_sync_arg;
    int              n_sync_bn;
    int              sync_k;
    int              sync_rc;
    loom_err         sync_err;
    /* Sequences (issue 24). The time mask is the carrier of padding between
     * layers: tmask (max_batch, mask_T), 1 = a real step, 0 = padding, one
     * row per example at the example's batch row, so a chunk reads and writes
     * rows b0.. like its activations. An embedding with mask_zero writes it
     * in its forward (id <= 0: padding; padded_batch pads with 0, so its mask
     * feature and this one agree); the layers with a time axis of mask_T
     * steps read it (lstm, gru, bidirectional, the per-token loss, attention).
     * mask_T = 0: no mask. */
    int              mask_T;
    uint8_t         *tmask;
    int64_t          seq_T;         /* per-token sparse_softmax_cross_entropy: output (seq_T, V), labels (seq_T,); 0: none */
    int64_t          ignore_label;  /* those labels count as masked tokens */
    /* a plugin layer's failure inside a step (layer_plugin.c): the first one, taken by nn_plugin_error_ */
    int              plugin_rc;
    loom_err         plugin_err;
};

/* Part `part` of `parts`'s start in a product's n rows when the parts are separate BLAS calls: the
 * nearest multiple of the model's row quantum (split_batch's rule), so each row gets the same bits
 * whatever the part count. Part `parts` starts at n. */
static inline int64_t nn_part_row_(const loom_model *m, int64_t n, int part, int parts)
{
    if (part >= parts) return n;
    const int64_t q = m->row_q > 1 ? m->row_q : 1, e = n * part / parts;
    const int64_t r = (e + q / 2) / q * q;
    return r > n ? n : r;
}

/* A conv2d that is a plain product over pixels: 1x1, stride 1, no padding (no im2col copy). */
static inline bool nn_conv_pointwise_(const nn_layer_ *l)
{
    return l->kh == 1 && l->kw == 1 && l->sh == 1 && l->sw == 1 && l->pad_t == 0 && l->pad_l == 0;
}

/* Where part `part` of `parts` of a dense or conv2d layer's gradient pass
 * starts in its n kernel rows (n_in, or kh*kw*cin): the gradient writers and
 * the in-part update (model.c) must agree on it. A one-channel conv2d that is
 * not pointwise splits its kh*kw taps evenly; the others at nn_part_row_. */
static inline int64_t nn_grad_row_(const loom_model *m, const nn_layer_ *l, int64_t n, int part, int parts)
{
    if (l->spec.kind == LOOM_LAYER_CONV2D && l->cin == 1 && !nn_conv_pointwise_(l)) return n * part / parts;
    return nn_part_row_(m, n, part, parts);
}

/* How long the intra-op workers busy-wait for the next phase before they
 * sleep (loom_pool_set_spin): longer than the gaps inside a training step
 * and between steps (input hand-off, metrics, the optimizer's call), short
 * enough that an idle model's threads sleep within a fraction of a ms. */
#define NN_POOL_SPIN_US 300

/* loom_init of the tensors that start at one (normalisation scales and variances) */
#define NN_INIT_ONES_ 100

/* ---- the graph (graph.c) ----------------------------------------------------- */

/* Which layers of spec the model runs and in what order: order[i] the spec
 * index of model layer i (a topological order, the smallest spec index
 * first among the ready ones, so a sequential spec keeps its order; layers
 * the output does not depend on are left out), src[i] its inputs as model
 * indices (or -1 - f, model input f). LOOM_ECONFIG for an unknown input, a
 * wrong count of inputs or a cycle (specs built in code; a config's are
 * refused at load). */
int  nn_graph_order_(const loom_model *m, const loom_model_spec *spec, int *order, int *n,
                     int (*src)[LOOM_MAX_LAYER_INPUTS], int *n_src, loom_err *err);
/* After the layers' shapes: consumers, the gradient paths (gacc), m->graph. */
void nn_graph_links_(loom_model *m);
/* d (c->B, n_out of layer s) added to layer s's dgy rows (the first consumer copies): an input gradient
 * handed to a layer that gathers its output's gradient (gacc). */
void nn_graph_deliver_(const loom_model *m, int s, nn_chunk_ *c, const float *d);
/* A merge layer's shape rule (Keras: elementwise with broadcasting, concatenate along axis). */
int  nn_merge_shapes_(loom_model *m, nn_layer_ *l, int li, loom_err *err);
/* C (M, N) = A (M, K) B (K, N) (trans_b: B is (N, K)) over chunk c's rows from its example e0, R rows an
 * example: loom_sgemm_rows with the batch's row offset, its total and the chunk's tile scratch, so every row
 * has the bits of a tile-aligned call wherever the chunks split the batch (model.c split_batch). */
static inline void nn_chunk_gemm_(const loom_model *m, const nn_chunk_ *c, int64_t e0, int64_t R, bool trans_b,
                                  int64_t M, int N, int K, const float *A, int lda, const float *B, int ldb, float *C,
                                  int ldc)
{
    loom_sgemm_rows(trans_b, (c->b0 + e0) * R, c->bt * R, m->row_q, (int)M, N, K, A, lda, B, ldb, C, ldc, c->pad);
}
/* Where input k of layer l reads on chunk c. */
static inline const float *nn_src_ptr_(const nn_chunk_ *c, int s) { return s >= 0 ? c->yo[s] : c->xin[-1 - s]; }
/* A graph's forward of layer li on chunk c (its inputs from the outputs
 * of the layers it names), and its backward: the gradient of its output
 * (from the chain's g or its dgy rows), the layer's backward, the input
 * gradients handed on (down the chain in g, or added to the dgy rows of
 * the layers it names). */
void nn_graph_forward_(const loom_model *m, int li, nn_chunk_ *c, int training, uint64_t rng_key);
void nn_graph_backward_(const loom_model *m, int li, nn_chunk_ *c);
/* A graph's batch normalization li between segments: its input for every
 * chunk before nn_bn_forward_, its output after; the gradient rows of its
 * output before nn_bn_backward_, handed on after. */
void nn_graph_bn_in_(loom_model *m, int li, int nchunks);
void nn_graph_bn_out_(loom_model *m, int li, int nchunks);
void nn_graph_bn_grad_in_(loom_model *m, int li, int nchunks);
void nn_graph_bn_grad_out_(loom_model *m, int li, int nchunks);

/* ---- the step's buffer plan (buffer_plan.c) ---------------------------------- */

#define NN_ARENA_Y   1
#define NN_ARENA_DZ  2
#define NN_ARENA_DGY 4
#define NN_ARENA_GBUF 8 /* the model's gbuf (m->gbuf_arena) */
/* With batch normalization (a step in phases): the buffers that live over a
 * few phases placed in one arena (m->arena, offsets by live intervals), the
 * layers' arena bits and early set; the layers' own buffers are allocated
 * after it. false: out of memory. */
bool nn_plan_buffers_(loom_model *m);
/* Allocates the step's buffers (the layers', the arena, the gradient ping-pong) on a model's first step
 * (forward, train, evaluate, predict); LOOM_ENOMEM when they do not fit. */
int  nn_model_ready_(loom_model *m, loom_err *err);
/* Whether conv2d l's parameter gradients can be taken right after its backward segment. */
bool nn_plan_early_(const nn_layer_ *l);

/* ---- batch checks (model.c), shared with the device executor ------------- */

/* x (B, input...) is float32 of the model's input shape with 1 <= B <=
 * max_batch, and label (when not NULL) matches: LOOM_ESHAPE otherwise,
 * located at the model's file:line. */
int nn_check_batch_(loom_model *m, const loom_tensor *x, const loom_tensor *label, int64_t *B, loom_err *err);
int nn_check_label_(loom_model *m, const loom_tensor *label, int64_t B, loom_err *err);
/* Sparse labels into m->labels as int32, each checked to be a class (LOOM_EDATA). */
int nn_read_labels_(loom_model *m, const loom_tensor *label, int64_t B, loom_err *err);
/* The batch's labels as the loss reads them: sparse classes into m->labels,
 * the other losses' targets into m->targets as float (binary_cross_entropy's
 * checked to be in [0, 1], all to be finite: LOOM_EDATA naming the example). */
int nn_read_label_(loom_model *m, const loom_tensor *label, int64_t B, loom_err *err);
/* The loss of every kind on outputs z (B, n) of the batch's examples [b0, b0 + B)
 * (labels read by nn_read_label_), as nn_loss_sparse_ce_ below. */
double nn_loss_(const loom_model *m, const float *z, int64_t b0, int64_t B, float inv_gb, float *g, int64_t *correct);

/* ---- the optimizer inside the step (optimizer.c) ---------------------------- */

/* Whether o's update of a range reads nothing outside it: no clip_norm (the
 * global norm), no lazy embedding tables, no frozen ranges. */
bool nn_optimizer_ranged_(const loom_optimizer *o);

/* ---- metrics (metrics.c) ---------------------------------------------------- */

/* Resolves model.metrics for the built model (output, loss): the state
 * layout, and LOOM_ECONFIG at model.metrics' file:line for a metric that
 * does not fit the task. Allocates m->mstate. */
int  nn_metrics_init_(loom_model *m, const loom_model_spec *spec, loom_err *err);
/* Adds the outputs z (B, n) of the examples [0, B) (labels read) to the state. */
void nn_metrics_update_(loom_model *m, const float *z, int64_t B);
/* LOOM_ENUMERIC for a training batch of B examples whose loss is not finite, at the model's file:line, with a hint. */
int nn_loss_error_(const loom_model *m, double loss, int64_t B, loom_err *err);

/* ---- kernels (layers.c) ------------------------------------------------- */

/* Embedding layer li (layer 0): the sparse gradient of the whole batch of B
 * examples with ids x from its dz rows, in example order (so the same bits
 * for any number of threads), and the table's rows of the dense grads buffer:
 * the previous batch's rows cleared (or, unless m->sparse_owner, the whole
 * table region), the new ones written. */
void nn_embedding_param_grads_(loom_model *m, int li, const void *x, int64_t B);
/* Checks the ids of a batch for embedding layer li: each in [0, rows) or -1
 * (no id); LOOM_EDATA naming the example and column otherwise. */
int nn_embedding_check_ids_(const loom_model *m, int li, const void *x, int64_t B, loom_err *err);

const char *nn_loc_str_(const loom_loc *l, char *buf, size_t n);
const char *nn_layer_kind_name_(loom_layer_kind k);
const char *nn_activation_name_(loom_activation a);

/* Forward of layer li on chunk c: reads c->act[li], sets c->act[li + 1].
 * training switches dropout on; rng_key seeds it (the mask depends on the
 * example's position in the whole batch, not on the chunking). */
void nn_layer_forward_(const loom_model *m, int li, nn_chunk_ *c, int training, uint64_t rng_key);
/* Dropout layer li's keep mask (1 = kept) of elements [e0, e0 + n) of a
 * batch's outputs for rng_key: the mask the forward pass draws. */
void nn_dropout_mask_(const nn_layer_ *l, int li, uint8_t *mk, int64_t e0, int64_t n, uint64_t rng_key);
/* Backward of layer li on chunk c: g holds d(loss)/d(output) (c->B, n_out)
 * and may be overwritten; writes
 * dense and conv layers' dz rows into l->dz (see nn_*_param_grads_) and, when
 * the layer's needs_dx, the input gradient into g itself (element-wise
 * layers) or into other. Returns the buffer holding the input gradient, or
 * NULL when none is needed. */
float *nn_layer_backward_(const loom_model *m, int li, nn_chunk_ *c, float *g, float *other);

/* ---- plugin layer kinds (layer_plugin.c) ------------------------------------ */

#define NN_INIT_FORGET_BIAS_ 103 /* an lstm's bias (i f g o, H each, H in pfan_in): 1 on f, 0 elsewhere */
/* Keras' Orthogonal (init_orthogonal.c): false when out of memory. */
bool nn_init_orthogonal_(float *p, const loom_shape *shape, loom_rng *r);
#define NN_INIT_CONST_ 102 /* (101 is model_build.c NN_INIT_EMBEDDING) a plugin's LOOM_LINIT_CONSTANT: the value is kept in pfan_in */
/* The plugin's build: the output shape, its parameter tensors (nn_add_param_). */
int    nn_plugin_shapes_(loom_model *m, nn_layer_ *l, int li, loom_err *err);
bool   nn_plugin_buffers_(nn_layer_ *l, int64_t max_batch);
void   nn_plugin_free_(nn_layer_ *l);
void   nn_plugin_forward_(const loom_model *m, int li, nn_chunk_ *c, const float *x, float *y, int training,
                          uint64_t rng_key);
float *nn_plugin_backward_(const loom_model *m, int li, nn_chunk_ *c, float *g, float *other);
/* The whole batch's parameter gradients from the dz rows (chunk 0's thread, after every chunk). */
void   nn_plugin_param_grads_(loom_model *m, int li, const float *x, int64_t B);
/* The first plugin layer failure of the step just run (then cleared) into err, or LOOM_OK. */
int    nn_plugin_error_(loom_model *m, loom_err *err);
/* A whole_batch plugin layer, run as batch normalization is: between the
 * chunks' segments, once over the batch (its input rows those of chunk 0 on). */
bool   nn_whole_batch_layer_(const nn_layer_ *l);
void   nn_plugin_forward_whole_(loom_model *m, int li, int64_t B, int training, uint64_t rng_key);
void   nn_plugin_backward_whole_(loom_model *m, int li, nn_chunk_ *chunk, int nchunks, int64_t B);
/* Whether flat offset off is a plugin layer's state tensor (trainable = 0), and its length. */
bool   nn_plugin_state_(const nn_layer_ *l, int64_t off, int64_t *len);
/* --gradcheck of a plugin layer of several inputs: loom_layer_plugin_check on its own build. */
int    nn_plugin_check_(const loom_model *m, const nn_layer_ *l, double *max_err, loom_err *err);

/* Part `part` of `parts` of dense layer li's parameter gradients over the
 * whole batch of B examples whose layer input is x (B, n_in): kernel rows
 * [in * part / parts, in * (part + 1) / parts) = x^T dz, and the matching
 * range of bias columns = column sums of dz in example order. Parts write
 * disjoint ranges, each a fixed computation, so the result is the same run to
 * run for a given number of parts; bias sums are also the same for any number
 * of parts, and kernel rows differ between part counts at most by the BLAS's
 * blocking (with OpenBLAS they come out bit-identical). */
void nn_dense_param_grads_(const loom_model *m, int li, const float *x, int64_t B, int part, int parts);

/* The same for conv2d layer li: part `part` of `parts` of the kernel rows (of
 * kh*kw*cin; taps of kh*kw when cin = 1) and bias columns, over the whole
 * batch, im2col chunks at fixed example offsets; scratch is the part's
 * chunk's col buffer. Each element is one fixed computation over the whole
 * batch whatever the number of parts, so the gradients do not depend on the
 * thread count (DESIGN: bit-identical across intra-op threads). */
void nn_conv_param_grads_(const loom_model *m, int li, const float *x, int64_t B, int part, int parts, float *scratch);
/* The same for layer_normalization layer li: gamma and beta columns of part `part`. */
void nn_ln_param_grads_(const loom_model *m, int li, int64_t B, int part, int parts);

/* batch_normalization layer li over the whole batch of B (statistics cross
 * the chunks, so these run once, between the chunks' segments): forward
 * from x (B, n) into the layer's y with the batch's statistics (training:
 * also updates the moving ones) or the moving ones; backward on the
 * chunks' gradient rows in place (chunk t's g at chunk[t].g), writing gamma
 * and beta's gradients. */
void nn_bn_forward_(loom_model *m, int li, const float *x, int64_t B, int training);
void nn_bn_backward_(loom_model *m, int li, nn_chunk_ *chunk, int nchunks, int64_t B);
/* bn_pass.c: their passes over the batch in fixed blocks of rows on m->pool (the bits depend on the
 * batch alone). stat's floats for C channels; the training moments (double, biased variance);
 * x into the layer's y; the sums of g and g xhat (from bn_x) over the chunks' gradient rows; and
 * g = gamma rstd (g - sg / N - xhat sgh / N) on those rows in place. */
int64_t nn_bn_stat_floats_(int64_t C);
/* conv_stem.c: conv2d on 2-4 input channels, cout a multiple of 16, no padding of its own (ResNet-50's stem), on
 * an AVX2 or AVX-512 CPU (nn_convs_ok_), direct: y (nb, OH, OW, cout) = conv(x) without bias; the kernel gradient's
 * rows [k0, k1) of (kh*kw*cin, cout) over the batch's B examples. The input gradient stays on GEMM + col2im. */
int  nn_convs_ok_(const nn_layer_ *l);
void nn_convs_forward_(const nn_layer_ *l, const float *w, const float *x, float *y, int64_t nb);
void nn_convs_kernel_grad_(const nn_layer_ *l, const float *x, const float *dz, int64_t B, int k0, int k1, float *dw);
/* conv_wide.c: the kernel gradient of a 1x1 conv2d without padding (stride 1 or 2), cin 16-512, cout a multiple of
 * 16 up to 512, on an AVX2 or AVX-512 CPU (nn_convp_ok_), direct: rows [k0, k1) of dW (cin, cout) over the batch's B
 * examples; layers.c takes it where nn_convp_grad_ok_ (stride 2 on AVX-512: tests/bench/conv_wide_bench.c measures
 * it against OpenBLAS's sgemm). */
int  nn_convp_ok_(const nn_layer_ *l);
int  nn_convp_grad_ok_(const nn_layer_ *l);
void nn_convp_kernel_grad_(const nn_layer_ *l, const float *x, const float *dz, int64_t B, int k0, int k1, float *dw);
/* conv_fast.c: conv2d 3x3, stride 1 "same" or stride 2, cin and cout multiples of 16 up to 64, on an AVX2 or
 * AVX-512 CPU (nn_conv3_ok_), direct: y (nb, OH, OW, cout) = conv(x) without bias; dx (nb, H, W, cin) from dz
 * (stride 1 only: nn_conv3_dx_ok_); scratch of nn_conv3_scratch_(l) floats (the chunk's col). */
int     nn_conv3_ok_(const nn_layer_ *l);
int     nn_conv3_dx_ok_(const nn_layer_ *l);
int64_t nn_conv3_scratch_(const nn_layer_ *l);
void    nn_conv3_forward_(const nn_layer_ *l, const float *w, const float *x, float *y, int64_t nb, float *scratch);
void    nn_conv3_backward_data_(const nn_layer_ *l, const float *w, const float *dz, float *dx, int64_t nb,
                                float *scratch);
/* dW rows [r0, r1) of (9 cin, cout) = the sums over nb examples' pixels of x's shifted channel times dz,
 * each example's sum added in example order (so any split of the rows gives the same bits). */
void    nn_conv3_kernel_grad_(const nn_layer_ *l, const float *x, const float *dz, int64_t nb, int r0, int r1,
                              float *dW, float *scratch);
/* conv2d k x k (5, 7), stride 1, "same", 16k channels up to 64 in and out, on AVX2 / AVX-512
 * (nn_convd_ok_; conv_direct.c), direct, with or without a fused pool: the same calls as conv3's. */
int     nn_convd_ok_(const nn_layer_ *l);
int64_t nn_convd_scratch_(const nn_layer_ *l);
void    nn_convd_forward_(const nn_layer_ *l, const float *w, const float *x, float *y, int64_t nb, float *scratch);
void    nn_convd_backward_data_(const nn_layer_ *l, const float *w, const float *dz, float *dx, int64_t nb,
                                float *scratch);
/* conv_winograd.c: conv2d 5x5 and 3x3, stride 1, "same", 16k channels up to 256, on AVX2 / AVX-512 (nn_convw_ok_:
 * also algorithm != direct; 3x3 under "auto" only where measured faster than conv_fast.c), by Winograd
 * F(2x2, 5x5) / F(4x4, 3x3): forward and input gradient, the calls of convd's (the kernel gradient: 3x3 by
 * nn_convw_kernel_grad_ where nn_convw_kgrad_ok_, else convd's / conv3's); scratch of nn_convw_scratch_(l)
 * floats. The forward's transformed kernel goes to the scratch's start once (nn_convw_kernel_), then each run
 * of examples (nn_convw_forward_). */
int     nn_convw_ok_(const nn_layer_ *l);
int     nn_convw_shape_ok_(const nn_layer_ *l); /* the shape alone (algorithm = "winograd" is refused otherwise) */
int64_t nn_convw_scratch_(const nn_layer_ *l);
void    nn_convw_kernel_(const nn_layer_ *l, const float *w, float *scratch);
void    nn_convw_forward_(const nn_layer_ *l, const float *x, float *y, int64_t nb, float *scratch);
void    nn_convw_backward_data_(const nn_layer_ *l, const float *w, const float *dz, float *dx, int64_t nb,
                                float *scratch, int acc); /* acc: dx += the input gradient */
void    nn_convd_kernel_grad_(const nn_layer_ *l, const float *x, const float *dz, int64_t nb, int r0, int r1,
                              float *dW, float *scratch);
/* conv_winograd.c's 3x3 kernel gradient (nn_convw_kgrad_ok_: nn_convw_ok_, 3x3, and under "auto" only where
 * measured faster than conv_fast.c's): dW rows (tap, c0 .. c1) for all 9 taps, input channels [c0, c1)
 * (multiples of 8), summed over nb examples' tiles in order (any split of the channels: the same bits). */
int     nn_convw_kgrad_ok_(const nn_layer_ *l);
void    nn_convw_kernel_grad_(const nn_layer_ *l, const float *x, const float *dz, int64_t nb, int c0, int c1,
                              float *dW, float *scratch);
/* Part `part` of `parts`'s first input channel in nn_convw_kernel_grad_'s split (a multiple of 8): the gradient
 * pass and the in-part update (model.c) agree on it. Part `parts` starts at cin. */
static inline int nn_convw_grad_ci_(const nn_layer_ *l, int part, int parts)
{
    return part >= parts ? l->cin : (int)((int64_t)(l->cin / 8) * part / parts) * 8;
}
void nn_bn_moments_(const loom_model *m, const nn_layer_ *l, const float *x, int64_t rows, double *mean, double *var);
void nn_bn_normalize_(const loom_model *m, const nn_layer_ *l, const float *x, int64_t rows, const float *mean,
                      const float *rstd, const float *gamma, const float *beta);
void nn_bn_grad_sums_(const loom_model *m, const nn_layer_ *l, const nn_chunk_ *chunk, int nchunks, int64_t B,
                      double *sg, double *sgh);
void nn_bn_grad_apply_(const loom_model *m, const nn_layer_ *l, const nn_chunk_ *chunk, int nchunks, int64_t B,
                       const float *gamma, const float *rstd, const double *sg, const double *sgh, double N);
/* Synchronised batch normalization: the step's next call of m->bn_sync on
 * buf (n floats; a failure is kept in m->sync_rc); nn_bn_sync_rest_ makes
 * the calls the step has not made yet (with zeros) and returns the step's
 * sync failure, then numbers the next step's calls from 0. forward_only:
 * only the forward pass's calls (loom_model_forward). */
void nn_bn_sync_(loom_model *m, float *buf, int64_t n);
int  nn_bn_sync_rest_(loom_model *m, bool forward_only, loom_err *err);

/* ---- issue 23's layer kinds (conv_more.c) and activations (activations.c) ----
 * zero_padding2d, global_max_pooling2d, reshape, upsampling2d, depthwise_,
 * separable_conv2d, conv2d_transpose, conv1d, and conv2d with groups or
 * dilation (l->direct): straightforward loops; every parameter gradient is
 * one fixed sum over the whole batch in example order, whatever the parts. */
bool  nn_is_more_kind_(loom_layer_kind k);
/* Output shape, parameters and flops of a layer of those kinds (and a direct conv2d). */
int   nn_more_shapes_(loom_model *m, nn_layer_ *l, int li, loom_err *err);
/* Whether layer l runs on conv_more.c's kernels (its kind, or a direct conv2d). */
bool  nn_runs_more_(const nn_layer_ *l);
void  nn_more_forward_(const loom_model *m, int li, nn_chunk_ *c);
float *nn_more_backward_(const loom_model *m, int li, nn_chunk_ *c, float *g, float *other);
void  nn_more_param_grads_(const loom_model *m, int li, const float *x, int64_t B, int part, int parts);
/* ---- recurrent layers (recurrent.c) ---------------------------------------- */
bool   nn_is_rnn_kind_(loom_layer_kind k);
int    nn_rnn_shapes_(loom_model *m, nn_layer_ *l, int li, loom_err *err);
bool   nn_rnn_buffers_(nn_layer_ *l, int64_t max_batch);
void   nn_rnn_forward_(const loom_model *m, int li, nn_chunk_ *c);
float *nn_rnn_backward_(const loom_model *m, int li, nn_chunk_ *c, float *g, float *other);
/* The whole batch's parameter gradients of part `part` of `parts` (x: the layer's input (B, T, D)). */
void   nn_rnn_param_grads_(const loom_model *m, int li, const float *x, int64_t B, int part, int parts);
/* The time mask rows of chunk c for a layer whose time axis has T steps: NULL when none applies. */
static inline const uint8_t *nn_tmask_(const loom_model *m, const nn_chunk_ *c, int64_t T)
{
    return m->mask_T && m->mask_T == T ? m->tmask + c->b0 * T : NULL;
}

/* ---- issue 24's sequence layers (attention.c): multi_head_attention, positional_embedding ---- */
bool   nn_is_attn_kind_(loom_layer_kind k);
int    nn_attn_shapes_(loom_model *m, nn_layer_ *l, int li, loom_err *err);
bool   nn_attn_buffers_(nn_layer_ *l, int64_t max_batch); /* y, dz, ab[], mask (dropout) */
void   nn_attn_free_(nn_layer_ *l);                        /* ab[] (the rest as any layer's) */
bool   nn_attn_owns_(const nn_layer_ *l, int64_t off);     /* off is one of its parameter tensors */
void   nn_attn_forward_(const loom_model *m, int li, nn_chunk_ *c, const float *x, float *y, int training,
                        uint64_t rng_key);
float *nn_attn_backward_(const loom_model *m, int li, nn_chunk_ *c, float *g, float *other);
/* Part `part` of `parts` of the whole batch's parameter gradients (x the layer's input, (B, T, D)). */
void   nn_attn_param_grads_(const loom_model *m, int li, const float *x, int64_t B, int part, int parts);
/* Tests only: loom_model_gradcheck scales the analytic gradients by 1 + this (0: off). */
extern float nn_gradcheck_skew_;

/* One element of --gradcheck: the loss (a sum) as a function of *p, the analytic d loss / d *p (ana), both
 * compared after multiplying by scale; num the central estimate compared. NN_GC_RETESTED: the central
 * estimates agreed but missed ana, and a one-sided slope (either side) matched it: a kink at the point. */
typedef double (*nn_gc_loss_fn_)(void *ctx, loom_err *err);
typedef enum { NN_GC_PASS, NN_GC_RETESTED, NN_GC_SKIPPED, NN_GC_BAD, NN_GC_ERROR } nn_gc_verdict_;
nn_gc_verdict_ nn_gc_element_(nn_gc_loss_fn_ loss, void *ctx, float *p, double ana, double scale, double *num,
                              loom_err *err);
/* The model's parameter allocator (model_build.c): offset of the new tensor, -1 on overflow. */
/* The kinds with a kernel of their own and an activation (model_build.c). */
bool  nn_kernel_kind_(loom_layer_kind k);
int   nn_add_param_(loom_model *m, const nn_layer_ *l, const char *suffix, const loom_shape *shape, int init,
                    double fan_in, double fan_out);

/* y (rows, n) = act(y + b) (b may be NULL) with layer l's activation; an
 * activation whose gradient needs its input (nn_act_needs_x_) keeps the
 * pre-activation in l's dz rows matching y (y inside l->y). */
void  nn_layer_act_(const nn_layer_ *l, float *y, const float *b, int64_t rows, int64_t n);
/* dz (rows, n) = g * act'(): from y, or from the pre-activation nn_layer_act_
 * kept in dz (then dz is l's dz rows of that y). */
void  nn_layer_act_grad_(const nn_layer_ *l, float *dz, const float *g, const float *y, int64_t rows, int64_t n);
/* swish, hard_swish, softplus, elu: gradients from the input */
bool  nn_act_needs_x_(loom_activation a);
void  nn_act_apply_(loom_activation a, const float *x, float *y, int64_t n);     /* y may be x */
void  nn_act_grad_x_(loom_activation a, const float *x, const float *g, float *dz, int64_t n); /* dz may be x or g */

/* Loss on the final outputs z (B, n): per-example loss sum, correct count, and
 * (when g is not NULL) d(sum loss)/dz * inv_gb into g. */
double nn_loss_sparse_ce_(const float *z, const int32_t *labels, int64_t B, int64_t n, float inv_gb, float *g,
                          int64_t *correct);
double nn_loss_mse_(const float *z, const float *t, int64_t B, int64_t n, float inv_gb, float *g, int64_t *correct);
/* A head's loss (heads 1.. of model.outputs; layers.c): labels for sparse softmax cross-entropy, else targets t. */
double nn_head_loss_(loom_loss_kind kind, const float *z, const int32_t *labels, const float *t, int64_t B, int64_t n,
                     float inv_gb, float *g, int64_t *correct);
void   nn_softmax_rows_(const float *z, float *p, int64_t B, int64_t n);

/* ---- the layer families' kernels layers.c dispatches to (dense.c, pooling.c,
 * dropout.c, normalization.c, embedding.c; one chunk each, as layers.c) ---- */
/* y (rows, n) = act(y + b) (b may be NULL), one pass: layers.c's, for dense.c. */
void nn_bias_act_(float *y, const float *b, int64_t rows, int64_t n, loom_activation act);
void nn_dense_forward_(const loom_model *m, const nn_layer_ *l, const nn_chunk_ *c, const float *x, float *y);
float *nn_dense_backward_(const loom_model *m, const nn_layer_ *l, nn_chunk_ *c, const float *y, float *g,
                          float *other);
void nn_pool_forward_(const nn_layer_ *l, const float *x, float *y, int32_t *argmax, int64_t B);
float *nn_pool_backward_(const nn_layer_ *l, const int32_t *argmax, const float *g, float *other, int64_t B);
void nn_avg_pool_forward_(const nn_layer_ *l, const float *x, float *y, int64_t B);
float *nn_avg_pool_backward_(const nn_layer_ *l, const float *g, float *other, int64_t B);
void nn_gap_forward_(const nn_layer_ *l, const float *x, float *y, int64_t B);
float *nn_gap_backward_(const nn_layer_ *l, const float *g, float *other, int64_t B);
void nn_dropout_forward_(const nn_layer_ *l, int li, const float *restrict x, float *restrict y, uint8_t *restrict mk,
                         int64_t e0, int64_t n, uint64_t rng_key);
float *nn_dropout_backward_(const nn_layer_ *l, const uint8_t *restrict mk, float *restrict g, int64_t n);
void nn_ln_forward_(const loom_model *m, const nn_layer_ *l, const float *x, float *y, int64_t b0, int64_t B);
float *nn_ln_backward_(const loom_model *m, const nn_layer_ *l, nn_chunk_ *c, float *g);
void nn_embedding_forward_(const loom_model *m, const nn_layer_ *l, const void *x, int64_t e0, float *restrict y,
                           int64_t B);
void nn_embedding_tmask_(const loom_model *m, const nn_layer_ *l, const void *x, int64_t b0, int64_t B);

/* ---- incremental decoding (decode.c) ------------------------------------------
 * A layer kind that runs one position of a sequence at a time, keeping what
 * it needs of the positions before in a per-sequence state (an LSTM's h and
 * c, an attention's keys and values for the positions so far), so that
 * decoding a token costs one position rather than the whole window. Its
 * output is (T, ...) for an input (T, ...) and position t of it depends on
 * positions 0..t of its inputs alone (causal); fed positions 0..t in order
 * from a reset state, step gives row t of the layer's forward output on any
 * sequence that starts with them. A kind without step ops (flatten, a dense
 * layer over the whole window) makes the decoder take the generic path. */
typedef struct nn_step_ops_ {
    /* (optional) floats of per-sequence state for sequences of up to T positions; NULL: none */
    int64_t (*state_floats)(const nn_layer_ *l, int64_t T);
    /* (optional) the state before position 0; NULL: zeros */
    void    (*reset)(const nn_layer_ *l, float *state);
    /* position pos: x[k] the per-position row of input k (n_in / T floats; the
     * first layer's: the id as a float), y the layer's row (n_out / T floats) */
    void    (*step)(const loom_model *m, const nn_layer_ *l, float *state, int64_t pos, const float *const *x, float *y);
    /* steps positions below T only (a KV cache of T rows, a table of T positions); else any position:
     * a recurrent state carries on past the window */
    bool    bounded;
} nn_step_ops_;
/* The step ops of layer l's kind (built for its shapes), NULL when it has none. */
const nn_step_ops_ *nn_step_ops_of_(const nn_layer_ *l);
/* recurrent.c: a lstm or gru with return_sequences, one step at a time:
 * whether l is one, its state's floats, step pos (x (D,) -> y (H,)) */
bool    nn_rnn_can_step_(const nn_layer_ *l);
int64_t nn_rnn_step_state_(const nn_layer_ *l);
void    nn_rnn_step_(const loom_model *m, const nn_layer_ *l, float *state, int64_t pos, const float *x, float *y);
/* y (n) = layer l's activation (not softmax) of x (n), y may be x (layers.c) */
void nn_act_row_(const nn_layer_ *l, const float *x, float *y, int64_t n);
/* loom_decoder_new; lm_loss false: any loss (the tests' models whose (T, V)
 * output no sparse cross-entropy takes yet). */
int nn_decoder_new_(loom_decoder **out, loom_model *m, int64_t pad_id, bool incremental, bool lm_loss, loom_err *err);

#endif
