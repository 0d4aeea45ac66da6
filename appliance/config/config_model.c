/* config_model.c - the model section: input, label, loss, metrics,
 * class weights and the list of layers.
 * Threads: none. */
#include "config/config_internal.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <string.h>

static void parse_metrics(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_class_weight(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_layer_inputs(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_model_inputs(cfg_ctx *c, const config_setting_t *s, void *base);

#define LY(k) K(LOOM_LAYER_##k)
/* the 2-D convolutions, and every layer with a kernel of its own and an activation */
#define CONV2S (LY(CONV2D) | LY(DEPTHWISE_CONV2D) | LY(SEPARABLE_CONV2D) | LY(CONV2D_TRANSPOSE))
#define KERNELED (LY(DENSE) | CONV2S | LY(CONV1D))
#define RNNS (LY(LSTM) | LY(GRU) | LY(BIDIRECTIONAL))
static void parse_zero_padding(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_target_shape(cfg_ctx *c, const config_setting_t *s, void *base);
static const cfg_opt layer_opts[] = {
    O_KIND(loom_layer_spec, "type", kind, 0, loom_layer_names_, ALL, "layer type"),
    O_STR(loom_layer_spec, "name", name, "", NULL, ALL, 0, "layer name; default <type>_<index>"),
    O_INT(loom_layer_spec, "units", units, 0, 1, LOOM_MAX_UNITS, LY(DENSE) | RNNS, LY(DENSE) | RNNS, "output units"),
    O_BOOL(loom_layer_spec, "return_sequences", return_sequences, 0, RNNS,
           "output every time step (T, units) rather than the last one's (units,)"),
    O_BOOL(loom_layer_spec, "return_state", return_state, 0, LY(LSTM) | LY(GRU),
           "also the final states, as the layers \"<name>/h\" and (lstm) \"<name>/c\""),
    O_ENUM(loom_layer_spec, "recurrent_activation", recurrent_activation, LOOM_ACT_SIGMOID, loom_activation_names_,
           RNNS, 0, "the gates' activation (sigmoid or hard_sigmoid-free: sigmoid, tanh, relu)"),
    O_ENUM(loom_layer_spec, "recurrent_init", recurrent_init, LOOM_INIT_ORTHOGONAL, loom_init_names_, RNNS, 0,
           "the recurrent kernel's initialiser (Keras' recurrent_initializer); default orthogonal"),
    O_BOOL(loom_layer_spec, "unit_forget_bias", unit_forget_bias, 1, LY(LSTM) | LY(BIDIRECTIONAL),
           "lstm: the forget gate's bias starts at 1 (Keras' default); false: at 0"),
    O_BOOL(loom_layer_spec, "reset_after", reset_after, 1, LY(GRU) | LY(BIDIRECTIONAL),
           "gru: reset gate applied after the recurrent product (Keras 2 default, cuDNN, PyTorch)"),
    O_ENUM(loom_layer_spec, "layer", cell, 0, loom_cell_names_, LY(BIDIRECTIONAL), LY(BIDIRECTIONAL),
           "the recurrent layer run forward and backward: lstm or gru"),
    O_ENUM(loom_layer_spec, "merge_mode", merge_mode, 0, loom_merge_mode_names_, LY(BIDIRECTIONAL), 0,
           "how the two directions' outputs combine: concat (default) or sum"),
    O_BOOL(loom_layer_spec, "mask_zero", mask_zero, 0, LY(EMBEDDING),
           "id 0 is padding: its time steps are masked in the recurrent layers and the per-token loss"),
    O_INT(loom_layer_spec, "filters", filters, 0, 1, LOOM_MAX_UNITS, (CONV2S & ~LY(DEPTHWISE_CONV2D)) | LY(CONV1D),
          (CONV2S & ~LY(DEPTHWISE_CONV2D)) | LY(CONV1D), "output channels"),
    O_PAIR(loom_layer_spec, "kernel_size", kernel, 0, 1, INT_MAX, CONV2S, CONV2S, "int or [h, w]"),
    O_INT(loom_layer_spec, "kernel_size", kernel[1], 0, 1, INT_MAX, LY(CONV1D), LY(CONV1D), "window length"),
    O_PAIR(loom_layer_spec, "strides", stride, 1, 1, INT_MAX, CONV2S | LY(MAX_POOL2D) | LY(AVG_POOL2D), 0,
           "int or [h, w]; default 1 (convolutions) or pool_size (pooling)"),
    O_INT(loom_layer_spec, "strides", stride[1], 1, 1, INT_MAX, LY(CONV1D), 0, "step along the sequence; default 1"),
    O_PAIR(loom_layer_spec, "dilation_rate", dilation, 1, 1, INT_MAX, CONV2S, 0,
           "int or [h, w]: the kernel's taps that far apart (atrous); default 1"),
    O_INT(loom_layer_spec, "dilation_rate", dilation[1], 1, 1, INT_MAX, LY(CONV1D), 0,
          "the kernel's taps that far apart; default 1"),
    O_ENUM(loom_layer_spec, "algorithm", algorithm, LOOM_CONV_AUTO, loom_conv_algorithm_names_, LY(CONV2D), 0,
           "auto (default: Winograd F(2x2, 5x5) or F(4x4, 3x3) where it is faster), direct (never Winograd) or "
           "winograd"),
    O_INT(loom_layer_spec, "groups", groups, 1, 1, LOOM_MAX_UNITS, LY(CONV2D) | LY(CONV1D), 0,
          "input channels and filters split in that many groups, each convolved on its own; default 1"),
    O_INT(loom_layer_spec, "depth_multiplier", depth_multiplier, 1, 1, LOOM_MAX_UNITS,
          LY(DEPTHWISE_CONV2D) | LY(SEPARABLE_CONV2D), 0, "output channels per input channel; default 1"),
    O_PAIR(loom_layer_spec, "pool_size", pool, 2, 1, INT_MAX, LY(MAX_POOL2D) | LY(AVG_POOL2D), 0, "int or [h, w]"),
    O_PAIR(loom_layer_spec, "size", size, 2, 1, 4096, LY(UPSAMPLING2D), 0, "int or [h, w]: the repeats; default 2"),
    O_ENUM(loom_layer_spec, "padding", padding, LOOM_PAD_VALID, loom_padding_names_,
           CONV2S | LY(MAX_POOL2D) | LY(AVG_POOL2D) | LY(CONV1D), 0, "valid or same (conv1d: or causal)"),
    O_CUSTOM("padding", parse_zero_padding, LY(ZERO_PADDING2D), 0,
             "int, [h, w] or ([top, bottom], [left, right]); default 1"),
    O_CUSTOM("target_shape", parse_target_shape, LY(RESHAPE), LY(RESHAPE),
             "the output's shape per example, 1 to 3 dims, one of them may be -1"),
    O_F64(loom_layer_spec, "alpha", alpha, 0.3, 0.0, 0, F_NO_HI, LY(ACTIVATION), 0, "leaky_relu: slope below 0"),
    O_F64(loom_layer_spec, "momentum", momentum, 0.99, 0.0, 1.0, F_HI_OPEN, LY(BATCH_NORM), 0,
          "moving statistics: m = momentum * m + (1 - momentum) * batch"),
    O_F64(loom_layer_spec, "epsilon", epsilon, 0.001, 0.0, 0, F_LO_OPEN | F_NO_HI, LY(BATCH_NORM) | LY(LAYER_NORM), 0,
          "added to the variance"),
    O_BOOL(loom_layer_spec, "sync", sync, 0, LY(BATCH_NORM),
           "batch statistics over the global batch of every replica and worker (SyncBatchNormalization)"),
    O_ENUM(loom_layer_spec, "activation", activation, LOOM_ACT_NONE, loom_activation_names_,
           KERNELED | LY(ACTIVATION) | RNNS, LY(ACTIVATION), "activation function (lstm, gru: default tanh)"),
    O_ENUM(loom_layer_spec, "kernel_init", kernel_init, LOOM_INIT_GLOROT_UNIFORM, loom_init_names_, KERNELED | RNNS, 0,
           "kernel initialiser"),
    O_BOOL(loom_layer_spec, "use_bias", use_bias, 1, KERNELED | RNNS, "add a bias"),
    O_F64(loom_layer_spec, "rate", rate, 0, 0.0, 1.0, F_HI_OPEN, LY(DROPOUT), LY(DROPOUT), "drop probability"),
    O_INT(loom_layer_spec, "input_dim", input_dim, 0, 1, (int64_t)1 << 31, LY(EMBEDDING), LY(EMBEDDING),
          "rows of the table: ids are in [0, input_dim)"),
    O_INT(loom_layer_spec, "output_dim", output_dim, 0, 1, 1 << 16, LY(EMBEDDING), LY(EMBEDDING),
          "the embedding width"),
    O_CUSTOM("inputs", parse_layer_inputs, ALL, 0,
             "[\"name\", ...]: the layers or model inputs this layer takes (default: the previous layer)"),
    O_INT(loom_layer_spec, "axis", axis, -1, -9, 8, LY(CONCATENATE), 0,
          "the axis to join on, the batch being axis 0; default -1 (the last)"),
    O_INT(loom_layer_spec, "num_heads", num_heads, 0, 1, 1024, LY(MULTI_HEAD_ATTENTION) | LY(TRANSFORMER_BLOCK),
          LY(MULTI_HEAD_ATTENTION) | LY(TRANSFORMER_BLOCK), "attention heads"),
    O_INT(loom_layer_spec, "key_dim", key_dim, 0, 1, LOOM_MAX_UNITS, LY(MULTI_HEAD_ATTENTION) | LY(TRANSFORMER_BLOCK),
          LY(MULTI_HEAD_ATTENTION) | LY(TRANSFORMER_BLOCK), "per head: the query and key width"),
    O_INT(loom_layer_spec, "value_dim", value_dim, 0, 1, LOOM_MAX_UNITS, LY(MULTI_HEAD_ATTENTION), 0,
          "per head: the value width; default key_dim"),
    O_F64(loom_layer_spec, "dropout", rate, 0, 0.0, 1.0, F_HI_OPEN, LY(MULTI_HEAD_ATTENTION) | LY(TRANSFORMER_BLOCK), 0,
          "drop probability (attention: of the attention weights; transformer_block: also after each sublayer)"),
    O_BOOL(loom_layer_spec, "causal", causal, 0, LY(MULTI_HEAD_ATTENTION) | LY(TRANSFORMER_BLOCK),
           "query step t attends to key steps <= t only (a decoder, a language model)"),
    O_BOOL(loom_layer_spec, "use_bias", use_bias, 1, LY(MULTI_HEAD_ATTENTION), "biases on the projections"),
    O_ENUM(loom_layer_spec, "kernel_init", kernel_init, LOOM_INIT_GLOROT_UNIFORM, loom_init_names_,
           LY(MULTI_HEAD_ATTENTION), 0, "kernel initialiser"),
    O_INT(loom_layer_spec, "max_length", max_length, 0, 1, 1 << 20, LY(POSITIONAL_EMBEDDING),
          LY(POSITIONAL_EMBEDDING), "the longest sequence (rows of a learned table)"),
    O_ENUM(loom_layer_spec, "mode", pos_mode, LOOM_POS_LEARNED, loom_pos_mode_names_, LY(POSITIONAL_EMBEDDING), 0,
           "learned (a trained (max_length, D) table) or sinusoidal (fixed)"),
    O_INT(loom_layer_spec, "ff_dim", ff_dim, 0, 1, LOOM_MAX_UNITS, LY(TRANSFORMER_BLOCK), LY(TRANSFORMER_BLOCK),
          "the feed-forward's hidden width"),
    O_BOOL(loom_layer_spec, "norm_first", norm_first, 0, LY(TRANSFORMER_BLOCK),
           "layer normalization before each sublayer (pre-norm, GPT-2) instead of after the residual add"),
    O_INT(loom_layer_spec, "embed_dim", output_dim, 0, 1, 1 << 16, LY(TRANSFORMER_BLOCK), 0,
          "the width D of the block's (T, D) input; default: found from the layers before it"),
    O_ENUM(loom_layer_spec, "combiner", combiner, LOOM_COMBINER_SUM, loom_combiner_names_, LY(EMBEDDING), 0,
           "several ids per column (input (columns, k)): sum or mean of their rows"),
    O_END,
};

/* A layer whose type is no built-in kind: a plugin's (nn/layer_plugin.h),
 * checked to be registered once plugins are loaded (loom_plugins_check_spec).
 * Its keys other than type, name and inputs reach the plugin as text. */
static bool plugin_layer(cfg_ctx *c, const config_setting_t *e, loom_layer_spec *l, int i)
{
    const config_setting_t *ty = config_setting_get_member(e, "type");
    if (!ty || config_setting_type(ty) != CONFIG_TYPE_STRING) return false;
    const char *tn = config_setting_get_string(ty);
    if (!strcmp(tn, "plugin")) {
        cfg_err_(c, ty, "type = \"plugin\": name the plugin's layer type (`loom plugins` lists them)");
        return true;
    }
    for (int k = 0; loom_layer_names_[k]; k++)
        if (!strcmp(tn, loom_layer_names_[k])) return false;
    if (strlen(tn) >= sizeof l->plugin || !*tn) return false; /* the usual "unknown layer type" */
    l->kind = LOOM_LAYER_PLUGIN;
    snprintf(l->plugin, sizeof l->plugin, "%s", tn);
    cfg_parse_opts_(c, e, layer_opts, LOOM_LAYER_PLUGIN, l); /* name, inputs */
    cfg_plugin_opts_group_(c, e, &l->settings);
    int n = 0;
    for (int k = 0; k < l->settings.n; k++) {
        const char *key = l->settings.key[k];
        if (!strcmp(key, "type") || !strcmp(key, "name") || !strcmp(key, "inputs")) continue;
        if (n != k) {
            memcpy(l->settings.key[n], key, sizeof l->settings.key[n]);
            memcpy(l->settings.value[n], l->settings.value[k], sizeof l->settings.value[n]);
            l->settings.line[n] = l->settings.line[k];
        }
        n++;
    }
    l->settings.n = n;
    if (!l->name[0]) snprintf(l->name, sizeof l->name, "%.40s_%d", tn, i);
    return true;
}

/* zero_padding2d's padding: 1 (all sides), [h, w] (top and bottom h, left
 * and right w) or [[top, bottom], [left, right]], each >= 0. */
static void parse_zero_padding(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_layer_spec *l = base;
    char v[300];
    int64_t x;
    const int64_t hi = 1 << 20;
    if (cfg_is_int_(s)) {
        if (cfg_get_int_in_(c, s, 0, hi, &x)) l->pad[0] = l->pad[1] = l->pad[2] = l->pad[3] = (int)x;
        return;
    }
    bool list = (config_setting_is_array(s) || config_setting_is_list(s)) && config_setting_length(s) == 2;
    if (list && cfg_is_int_(config_setting_get_elem(s, 0)) && cfg_is_int_(config_setting_get_elem(s, 1))) {
        int64_t h, w;
        if (cfg_get_int_in_(c, config_setting_get_elem(s, 0), 0, hi, &h) &&
            cfg_get_int_in_(c, config_setting_get_elem(s, 1), 0, hi, &w))
            l->pad[0] = l->pad[1] = (int)h, l->pad[2] = l->pad[3] = (int)w;
        return;
    }
    for (int i = 0; list && i < 2; i++) {
        const config_setting_t *e = config_setting_get_elem(s, i);
        list = (config_setting_is_array(e) || config_setting_is_list(e)) && config_setting_length(e) == 2;
    }
    if (!list) {
        cfg_err_(c, s, "expected an integer >= 0, [h, w] or ([top, bottom], [left, right]), got %s",
                 cfg_value_str_(s, v, sizeof v));
        return;
    }
    int p[4];
    for (int i = 0; i < 4; i++) {
        if (!cfg_get_int_in_(c, config_setting_get_elem(config_setting_get_elem(s, i / 2), i % 2), 0, hi, &x)) return;
        p[i] = (int)x;
    }
    memcpy(l->pad, p, sizeof p);
}

/* reshape's target_shape: [d0, ...] of 1 to 3 dims, each >= 1 or one -1. */
static void parse_target_shape(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_layer_spec *l = base;
    char v[300];
    int n = config_setting_is_array(s) || config_setting_is_list(s) ? config_setting_length(s) : 0;
    if (n < 1 || n > 3) {
        cfg_err_(c, s, "expected a shape of 1 to 3 dims such as [7, 7, 64] (one may be -1), got %s",
                 cfg_value_str_(s, v, sizeof v));
        return;
    }
    int unknown = 0;
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = config_setting_get_elem(s, i);
        int64_t x;
        if (cfg_is_int_(e) && config_setting_get_int64(e) == -1) {
            if (unknown++) {
                cfg_err_(c, e, "only one dim of target_shape may be -1 (the one inferred from the input)");
                return;
            }
            l->target[i] = -1;
            continue;
        }
        if (!cfg_get_int_in_(c, e, 1, INT_MAX, &x)) return;
        l->target[i] = x;
    }
    l->n_target = n;
}

/* What the option table cannot say about a layer: which kinds take which
 * padding, groups against filters, strides with dilation (as Keras refuses). */
static void check_layer(cfg_ctx *c, const config_setting_t *e, loom_layer_spec *l)
{
    const config_setting_t *s;
    if (l->activation == LOOM_ACT_SILU) l->activation = LOOM_ACT_SWISH;
    if ((l->kind == LOOM_LAYER_LSTM || l->kind == LOOM_LAYER_GRU || l->kind == LOOM_LAYER_BIDIRECTIONAL) &&
        !config_setting_get_member(e, "activation"))
        l->activation = LOOM_ACT_TANH; /* Keras' default for the recurrent layers */
    if ((l->kind == LOOM_LAYER_LSTM || l->kind == LOOM_LAYER_GRU || l->kind == LOOM_LAYER_BIDIRECTIONAL)) {
        const loom_activation ok[] = {LOOM_ACT_SIGMOID, LOOM_ACT_TANH, LOOM_ACT_RELU, LOOM_ACT_NONE};
        bool a = false, r = false;
        for (int i = 0; i < 4; i++) a |= l->activation == ok[i], r |= l->recurrent_activation == ok[i];
        if ((!a && (s = config_setting_get_member(e, "activation"))) ||
            (!r && (s = config_setting_get_member(e, "recurrent_activation"))))
            cfg_err_(c, s, "a recurrent layer's activations are sigmoid, tanh, relu or none");
    }
    if (l->kind == LOOM_LAYER_CONV1D) l->kernel[0] = l->stride[0] = l->dilation[0] = 1;
    if (l->kind == LOOM_LAYER_ZERO_PADDING2D && !config_setting_get_member(e, "padding"))
        l->pad[0] = l->pad[1] = l->pad[2] = l->pad[3] = 1;
    if (l->padding == LOOM_PAD_CAUSAL && l->kind != LOOM_LAYER_CONV1D && (s = config_setting_get_member(e, "padding"))) {
        loom_err *er = cfg_err_(c, s, "padding \"causal\" applies only to conv1d (expected \"valid\" or \"same\")");
        if (er) loom_err_hint(er, "for a causal 2-D window pad the top with zero_padding2d and use padding \"valid\"");
    }
    if ((l->kind == LOOM_LAYER_CONV2D || l->kind == LOOM_LAYER_CONV1D) && l->groups > 1 && l->filters > 0 &&
        l->filters % l->groups && (s = config_setting_get_member(e, "groups")))
        cfg_err_(c, s, "groups = %d must divide filters = %d", l->groups, l->filters);
    bool dil = l->dilation[0] > 1 || l->dilation[1] > 1, str = l->stride[0] > 1 || l->stride[1] > 1;
    if (l->kind != LOOM_LAYER_CONV2D_TRANSPOSE && dil && str && (s = config_setting_get_member(e, "dilation_rate"))) {
        loom_err *er = cfg_err_(c, s, "dilation_rate > 1 with strides > 1 (Keras refuses it too)");
        if (er) loom_err_hint(er, "use strides = 1 with a dilation, or dilation_rate = 1 with strides");
    }
}

/* ---- transformer_block: expanded at load into the graph of its parts ---- */

/* A part of kind k with the option table's defaults, named "<block>/<part>" ("<block>" for the last). */
static loom_layer_spec *block_part(loom_model_spec *m, const loom_layer_spec *b, int k, const char *part)
{
    loom_layer_spec *p = &m->layer[m->n_layers++];
    memset(p, 0, sizeof *p);
    for (const cfg_opt *o = layer_opts; o->name; o++)
        if (!(o->flags & F_KIND) && cfg_applies_(o, k) && o->type != OT_SUB && o->type != OT_CUSTOM)
            cfg_opt_default_(o, p);
    p->kind = (loom_layer_kind)k;
    p->loc = b->loc;
    if (part) snprintf(p->name, sizeof p->name, "%.*s/%s", (int)(sizeof p->name - 16), b->name, part);
    else snprintf(p->name, sizeof p->name, "%s", b->name);
    return p;
}

static void part_inputs(loom_layer_spec *p, const char *a, const char *b)
{
    p->n_inputs = b ? 2 : 1;
    snprintf(p->inputs[0], sizeof p->inputs[0], "%s", a);
    if (b) snprintf(p->inputs[1], sizeof p->inputs[1], "%s", b);
}

/* The width D of layer `name`'s (T, D) output, followed back through the layers that keep it; 0: unknown. */
static int block_width(const loom_model_spec *m, const char *name, int depth)
{
    for (int j = m->n_layers - 1; j >= 0 && depth < 64; j--) {
        const loom_layer_spec *l = &m->layer[j];
        if (strcmp(l->name, name)) continue;
        if (l->kind == LOOM_LAYER_EMBEDDING) return l->output_dim;
        if (l->kind == LOOM_LAYER_DENSE) return l->units;
        if (l->kind == LOOM_LAYER_TRANSFORMER_BLOCK) return l->output_dim;
        if (l->kind == LOOM_LAYER_CONCATENATE || l->kind == LOOM_LAYER_RESHAPE || l->kind == LOOM_LAYER_PLUGIN) return 0;
        for (int k = 0; k < l->n_inputs; k++) { /* a merge's inputs share the width: the first one known */
            int d = block_width(m, l->inputs[k], depth + 1);
            if (d > 0 || l->kind != LOOM_LAYER_ADD) return d;
        }
        if (l->n_inputs) return 0;
        return j > 0 ? block_width(m, m->layer[j - 1].name, depth + 1) : 0;
    }
    return 0;
}

/* Replaces the block (the last layer of m) by its parts: post-norm (Vaswani et al., Keras's TransformerEncoder):
 * x1 = norm1(x + drop(attn(x))), y = norm2(x1 + drop(ff2(ff1(x1)))); norm_first (GPT-2):
 * x1 = x + drop(attn(norm1(x))), y = x1 + drop(ff2(ff1(norm2(x1)))); ff1 relu. The last part is named as the block. */
static void expand_block(cfg_ctx *c, const config_setting_t *e, loom_model_spec *m)
{
    loom_layer_spec b = m->layer[--m->n_layers];
    char in[LOOM_NAME_MAX], prev[LOOM_NAME_MAX], res[LOOM_NAME_MAX];
    if (b.n_inputs > 1) {
        cfg_err_(c, e, "transformer_block takes one input, got %d", b.n_inputs);
        return;
    }
    if (!b.n_inputs && m->n_layers == 0) {
        loom_err *er = cfg_err_(c, e, "transformer_block cannot be the first layer");
        if (er) loom_err_hint(er, "put an embedding (and a positional_embedding) before it, or name its input in inputs");
        return;
    }
    const loom_layer_spec *pl = &m->layer[m->n_layers - 1]; /* (after a return_state's views: their layer) */
    snprintf(in, sizeof in, "%s", b.n_inputs ? b.inputs[0] : pl->state_of ? pl->inputs[0] : pl->name);
    int D = b.output_dim ? b.output_dim : block_width(m, in, 0);
    if (D < 1) {
        loom_err *er = cfg_err_(c, e, "transformer_block \"%s\": cannot tell the width of its input \"%s\"", b.name, in);
        if (er) loom_err_hint(er, "set embed_dim to the last dim of the block's (T, D) input");
        return;
    }
    if (m->n_layers + 11 > LOOM_MAX_LAYERS) {
        cfg_err_(c, e, "too many layers once transformer_block \"%s\" is expanded (at most %d)", b.name, LOOM_MAX_LAYERS);
        return;
    }
    const bool drop = b.rate > 0, pre = b.norm_first;
    loom_layer_spec *p;
    snprintf(prev, sizeof prev, "%s", in);
    for (int half = 0; half < 2; half++) {
        snprintf(res, sizeof res, "%s", prev);
        if (pre) {
            p = block_part(m, &b, LOOM_LAYER_LAYER_NORM, half ? "norm2" : "norm1");
            p->epsilon = 1e-5, part_inputs(p, prev, NULL), snprintf(prev, sizeof prev, "%s", p->name);
        }
        if (!half) {
            p = block_part(m, &b, LOOM_LAYER_MULTI_HEAD_ATTENTION, "attn");
            p->num_heads = b.num_heads, p->key_dim = b.key_dim, p->rate = b.rate, p->causal = b.causal;
        } else {
            p = block_part(m, &b, LOOM_LAYER_DENSE, "ff1");
            p->units = b.ff_dim, p->activation = LOOM_ACT_RELU, part_inputs(p, prev, NULL);
            snprintf(prev, sizeof prev, "%s", p->name);
            p = block_part(m, &b, LOOM_LAYER_DENSE, "ff2");
            p->units = D;
        }
        part_inputs(p, prev, NULL), snprintf(prev, sizeof prev, "%s", p->name);
        if (drop) {
            p = block_part(m, &b, LOOM_LAYER_DROPOUT, half ? "drop2" : "drop1");
            p->rate = b.rate, part_inputs(p, prev, NULL), snprintf(prev, sizeof prev, "%s", p->name);
        }
        p = block_part(m, &b, LOOM_LAYER_ADD, pre && half ? NULL : half ? "add2" : "add1");
        part_inputs(p, res, prev), snprintf(prev, sizeof prev, "%s", p->name);
        if (!pre) {
            p = block_part(m, &b, LOOM_LAYER_LAYER_NORM, half ? NULL : "norm1");
            p->epsilon = 1e-5, part_inputs(p, prev, NULL), snprintf(prev, sizeof prev, "%s", p->name);
        }
    }
}

static const cfg_opt model_opts[] = {
    O_STR(loom_model_spec, "input", input, "image", NULL, ALL, 0, "feature fed to the first layer"),
    O_CUSTOM("inputs", parse_model_inputs, ALL, 0,
             "[\"feature\", ...]: several features as model inputs (instead of input); layers name them in inputs"),
    O_STR(loom_model_spec, "label", label, "label", NULL, ALL, 0, "feature holding the target"),
    O_ENUM(loom_model_spec, "loss", loss, LOOM_LOSS_SPARSE_SOFTMAX_CE, loom_loss_names_, ALL, 0, "loss function"),
    O_CUSTOM("metrics", parse_metrics, ALL, 0,
             "list of: accuracy, auc, precision, recall, top_k_accuracy, mae, rmse, perplexity (default: accuracy for a "
             "classification, none for a regression)"),
    O_INT(loom_model_spec, "auc_thresholds", auc_thresholds, 200, 2, 100000, ALL, 0, "auc: number of thresholds"),
    O_BOOL(loom_model_spec, "multi_label", multi_label, 0, ALL, "auc: one curve per output, averaged"),
    O_INT(loom_model_spec, "top_k", top_k, 5, 1, LOOM_MAX_UNITS, ALL, 0, "top_k_accuracy: k"),
    O_F64(loom_model_spec, "l2", l2, 0.0, 0.0, 0, F_NO_HI, ALL, 0,
          "L2 penalty on every dense and conv kernel: loss += l2 * sum(w^2)"),
    O_F64(loom_model_spec, "huber_delta", huber_delta, 1.0, 0.0, 0, F_LO_OPEN | F_NO_HI, ALL, 0,
          "huber: where the loss turns from quadratic to linear"),
    O_STR(loom_model_spec, "sample_weight", sample_weight, "", NULL, ALL, 0,
          "feature of per-example loss weights (Keras sample_weight), shape () or [1]"),
    O_CUSTOM("class_weight", parse_class_weight, ALL, 0,
             "one loss weight per class (binary_cross_entropy: [negative, positive])"),
    O_INT(loom_model_spec, "ignore_label", ignore_label, -100, INT32_MIN, INT32_MAX, ALL, 0,
          "per-token sparse_softmax_cross_entropy: tokens with this label count as masked (torch's ignore_index)"),
    O_SUB("layers", 0, ALL, "a list of layer groups"),
    O_SUB("outputs", 0, 0,
          "output heads: a list of { layer; label; loss; weight; metrics } (the first is the last layer)"),
    O_END,
};

static void parse_head_metrics(cfg_ctx *c, const config_setting_t *s, void *base);
static const cfg_opt head_opts[] = {
    O_STR(struct loom_head_spec, "layer", layer, "", NULL, ALL, ALL, "the layer whose output the head is"),
    O_STR(struct loom_head_spec, "label", label, "", NULL, ALL, ALL, "the feature holding the head's target"),
    O_ENUM(struct loom_head_spec, "loss", loss, LOOM_LOSS_SPARSE_SOFTMAX_CE, loom_loss_names_, ALL, 0,
           "the head's loss function"),
    O_F64(struct loom_head_spec, "weight", weight, 1.0, 0.0, 0, F_NO_HI, ALL, 0,
          "the head's loss weight in the total loss (Keras' loss_weights)"),
    O_CUSTOM("metrics", parse_head_metrics, ALL, 0,
             "the head's metrics (the first head: as model.metrics; the others: [\"accuracy\"] or [])"),
    O_END,
};

static void parse_metrics(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_model_spec *m = base;
    char v[300];
    cfg_loc_of_(c, s, &m->metrics_loc);
    if (!config_setting_is_array(s) && !config_setting_is_list(s)) {
        cfg_err_(c, s, "expected a list of metric names [\"accuracy\", \"auc\", ...], got %s",
                 cfg_value_str_(s, v, sizeof v));
        return;
    }
    int n = config_setting_length(s);
    m->n_metrics = 0;
    m->metrics_set = true;
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = config_setting_get_elem(s, i);
        int k = cfg_get_enum_(c, e, loom_metric_names_);
        if (k < 0) continue;
        bool dup = false;
        for (int j = 0; j < m->n_metrics; j++) dup |= (int)m->metric[j] == k;
        if (dup) {
            cfg_err_(c, e, "metric \"%s\" is listed twice", loom_metric_names_[k]);
            continue;
        }
        m->metric[m->n_metrics++] = (loom_metric_kind)k;
    }
}

static void parse_class_weight(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_model_spec *m = base;
    char v[300];
    if (!config_setting_is_array(s) && !config_setting_is_list(s)) {
        cfg_err_(c, s, "expected an array of weights, one per class [w0, w1, ...], got %s",
                 cfg_value_str_(s, v, sizeof v));
        return;
    }
    int n = config_setting_length(s);
    if (n < 2 || n > LOOM_MAX_CLASS_WEIGHTS) {
        cfg_err_(c, s, "expected 2 to %d class weights, got %d", LOOM_MAX_CLASS_WEIGHTS, n);
        return;
    }
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = config_setting_get_elem(s, i);
        if (!cfg_is_number_(e) || !(cfg_get_number_(e) >= 0) || !isfinite(cfg_get_number_(e))) {
            cfg_err_(c, e, "expected a class weight >= 0, got %s", cfg_value_str_(e, v, sizeof v));
            return;
        }
        m->class_weight[i] = (float)cfg_get_number_(e);
    }
    m->n_class_weights = n;
}

/* A list of names into names (at most max, each LOOM_NAME_MAX); the count, or -1 after an error. */
static int parse_names(cfg_ctx *c, const config_setting_t *s, char (*names)[LOOM_NAME_MAX], int max, const char *what)
{
    int n = cfg_string_list_(c, s, max, what);
    if (n < 0) return -1;
    bool one = config_setting_type(s) == CONFIG_TYPE_STRING;
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = one ? s : config_setting_get_elem(s, i);
        const char *v = config_setting_get_string(e);
        if (strlen(v) >= LOOM_NAME_MAX) {
            cfg_err_(c, e, "name \"%s\" is longer than %d characters", v, LOOM_NAME_MAX - 1);
            return -1;
        }
        snprintf(names[i], LOOM_NAME_MAX, "%s", v);
    }
    return n;
}

static void parse_layer_inputs(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_layer_spec *l = base;
    int n = parse_names(c, s, l->inputs, LOOM_MAX_LAYER_INPUTS, "inputs");
    if (n == 0) cfg_err_(c, s, "expected at least one input");
    l->n_inputs = n > 0 ? n : 0;
}

static void parse_model_inputs(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_model_spec *m = base;
    int n = parse_names(c, s, m->inputs, LOOM_MAX_MODEL_INPUTS, "model inputs");
    if (n == 0) cfg_err_(c, s, "expected at least one feature");
    m->n_inputs = n > 0 ? n : 0;
    for (int i = 0; i < m->n_inputs; i++)
        for (int j = 0; j < i; j++)
            if (!strcmp(m->inputs[i], m->inputs[j])) {
                cfg_err_(c, s, "feature \"%s\" is listed twice", m->inputs[i]);
                return;
            }
}

static void add_state_views(cfg_ctx *c, const config_setting_t *e, loom_model_spec *m);
static void wire_state_views(cfg_ctx *c, const config_setting_t *ll, loom_model_spec *m, const int *elem);

static void parse_layers(cfg_ctx *c, const config_setting_t *g, loom_model_spec *m)
{
    const config_setting_t *ll = cfg_sub_list_(c, g, "layers");
    if (!ll) return;
    int n = config_setting_length(ll);
    if (n < 1) {
        cfg_err_(c, ll, "expected at least one layer");
        return;
    }
    if (n > LOOM_MAX_LAYERS) {
        cfg_err_(c, ll, "too many layers: %d (at most %d)", n, LOOM_MAX_LAYERS);
        n = LOOM_MAX_LAYERS;
    }
    int elem[LOOM_MAX_LAYERS]; /* each layer's element of the list (a transformer_block's parts share theirs) */
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = config_setting_get_elem(ll, i);
        if (m->n_layers >= LOOM_MAX_LAYERS) {
            cfg_err_(c, e, "too many layers once the transformer blocks are expanded (at most %d)", LOOM_MAX_LAYERS);
            break;
        }
        for (int j = m->n_layers; j < LOOM_MAX_LAYERS; j++) elem[j] = i;
        loom_layer_spec *l = &m->layer[m->n_layers++];
        memset(l, 0, sizeof *l); /* a refused transformer_block leaves its slot behind */
        cfg_loc_of_(c, e, &l->loc);
        if (!config_setting_is_group(e)) {
            char v[300];
            cfg_err_(c, e, "expected a group { type = ...; }, got %s", cfg_value_str_(e, v, sizeof v));
            continue;
        }
        if (plugin_layer(c, e, l, i)) continue;
        int k = cfg_parse_kind_(c, e, layer_opts, l);
        cfg_parse_opts_(c, e, layer_opts, k, l);
        cfg_scope sc = {layer_opts, k, NULL};
        cfg_check_keys_(c, e, &sc, 1);
        if (k >= 0) check_layer(c, e, l);
        if (k == LOOM_LAYER_TRANSFORMER_BLOCK) {
            if (!l->name[0]) snprintf(l->name, sizeof l->name, "transformer_block_%d", i);
            expand_block(c, e, m);
            continue;
        }
        if ((k == LOOM_LAYER_MAX_POOL2D || k == LOOM_LAYER_AVG_POOL2D) && !config_setting_get_member(e, "strides"))
            l->stride[0] = l->pool[0], l->stride[1] = l->pool[1];
        if (!l->name[0] && k >= 0 && k != LOOM_LAYER_PLUGIN) snprintf(l->name, sizeof l->name, "%s_%d", loom_layer_names_[k], i);
        if (l->return_state) add_state_views(c, e, m);
    }
    wire_state_views(c, ll, m, elem);
    for (int i = 0; i < m->n_layers; i++)
        for (int j = 0; j < i; j++)
            if (m->layer[i].name[0] && !strcmp(m->layer[i].name, m->layer[j].name)) {
                cfg_err_(c, config_setting_get_elem(ll, elem[i]), "layer name \"%s\" is already used by %s",
                     m->layer[i].name, m->layer[j].loc.path);
                break;
            }
}

/* ---- return_state: the final states as layers ("<name>/h", "<name>/c") read from the recurrent layer ---- */

/* After the lstm or gru (the last layer of m): a view of its final h (and c), named "<name>/h" ("<name>/c"). */
static void add_state_views(cfg_ctx *c, const config_setting_t *e, loom_model_spec *m)
{
    const loom_layer_spec r = m->layer[m->n_layers - 1];
    int nv = r.kind == LOOM_LAYER_LSTM ? 2 : 1;
    if (m->n_layers + nv > LOOM_MAX_LAYERS) {
        cfg_err_(c, e, "too many layers once the states of \"%s\" are added (at most %d)", r.name, LOOM_MAX_LAYERS);
        return;
    }
    for (int v = 1; v <= nv; v++) {
        loom_layer_spec *p = block_part(m, &r, r.kind, v == 1 ? "h" : "c");
        p->state_of = v, p->units = r.units, p->activation = r.activation;
        p->recurrent_activation = r.recurrent_activation, p->reset_after = r.reset_after;
        part_inputs(p, r.name, NULL);
    }
}

/* A layer after the views that takes "the previous layer" takes the recurrent layer; the views end no model. */
static void wire_state_views(cfg_ctx *c, const config_setting_t *ll, loom_model_spec *m, const int *elem)
{
    for (int i = 1; i < m->n_layers; i++) {
        const loom_layer_spec *p = &m->layer[i - 1];
        if (!p->state_of || m->layer[i].state_of || m->layer[i].n_inputs) continue;
        m->layer[i].n_inputs = 1;
        snprintf(m->layer[i].inputs[0], sizeof m->layer[i].inputs[0], "%s", p->inputs[0]);
    }
    if (m->n_layers > 0 && m->layer[m->n_layers - 1].state_of) {
        const loom_layer_spec *v = &m->layer[m->n_layers - 1];
        loom_err *er = cfg_err_(c, config_setting_get_elem(ll, elem[m->n_layers - 1]), "layer \"%s\" has "
                                "return_state = true but is the model's last layer: its states would feed nothing",
                                v->inputs[0]);
        if (er) loom_err_hint(er, "add the layers that read \"%s/h\" (inputs = [\"%s/h\"]) after it, or drop "
                                  "return_state", v->inputs[0], v->inputs[0]);
    }
}

/* ---- the graph: each layer's inputs (names of layers or model inputs) ---- */

static bool merge_kind(int k) { return k >= LOOM_LAYER_ADD && k <= LOOM_LAYER_CONCATENATE; }

/* The model's input features: model.inputs, or model.input alone. */
static int model_input_count(const loom_model_spec *m) { return m->n_inputs ? m->n_inputs : 1; }
static const char *model_input_name(const loom_model_spec *m, int i) { return m->n_inputs ? m->inputs[i] : m->input; }

/* Layer i's inputs resolved: src[k] >= 0 a layer, -1 - f model input f, LOOM_MAX_LAYERS unknown. */
static int layer_sources(const loom_model_spec *m, int i, int *src)
{
    const loom_layer_spec *l = &m->layer[i];
    if (l->n_inputs == 0) {
        src[0] = i > 0 ? i - 1 : -1;
        return 1;
    }
    for (int k = 0; k < l->n_inputs; k++) {
        src[k] = LOOM_MAX_LAYERS;
        for (int j = 0; j < m->n_layers && src[k] == LOOM_MAX_LAYERS; j++)
            if (!strcmp(m->layer[j].name, l->inputs[k])) src[k] = j;
        for (int f = 0; f < model_input_count(m) && src[k] == LOOM_MAX_LAYERS; f++)
            if (!strcmp(model_input_name(m, f), l->inputs[k])) src[k] = -1 - f;
    }
    return l->n_inputs;
}

/* Depth-first from layer i along its inputs: 0 white, 1 on the path, 2 done.
 * Returns the layer that closes a cycle (path[0..*np) ends there), or -1. */
static int find_cycle(const loom_model_spec *m, int i, int *color, int *path, int *np)
{
    color[i] = 1;
    path[(*np)++] = i;
    int src[LOOM_MAX_LAYER_INPUTS], ns = layer_sources(m, i, src);
    for (int k = 0; k < ns; k++) {
        int s = src[k];
        if (s < 0 || s >= m->n_layers) continue;
        if (color[s] == 1) return s;
        if (color[s] == 0) {
            int r = find_cycle(m, s, color, path, np);
            if (r >= 0) return r;
        }
    }
    color[i] = 2;
    (*np)--;
    return -1;
}

static void check_graph(cfg_ctx *c, const config_setting_t *ll, loom_model_spec *m)
{
    int n = m->n_layers, bad = 0;
    for (int i = 0; i < n; i++) {
        const loom_layer_spec *l = &m->layer[i];
        const config_setting_t *e = config_setting_get_elem(ll, i);
        const config_setting_t *ins = config_setting_get_member(e, "inputs");
        for (int f = 0; f < model_input_count(m); f++)
            if (!strcmp(l->name, model_input_name(m, f))) {
                loom_err *er = cfg_err_(c, e, "layer name \"%s\" is also a model input; a name refers to one thing",
                                        l->name);
                if (er) loom_err_hint(er, "rename the layer");
                bad++;
            }
        int src[LOOM_MAX_LAYER_INPUTS], ns = layer_sources(m, i, src);
        for (int k = 0; k < ns; k++) {
            if (src[k] == i) {
                cfg_err_(c, ins, "layer \"%s\" takes itself as input: a cycle", l->name), bad++;
            } else if (src[k] == LOOM_MAX_LAYERS) {
                char names[256] = "";
                for (int f = 0; f < model_input_count(m); f++)
                    snprintf(names + strlen(names), sizeof names - strlen(names), "%s\"%s\"", f ? ", " : "",
                             model_input_name(m, f));
                loom_err *er = cfg_err_(c, ins, "layer \"%s\": input \"%s\" is neither a layer nor a model input",
                                        l->name, l->inputs[k]);
                if (er)
                    loom_err_hint(er, "name a layer of model.layers (by its name, default <type>_<index>) or a feature "
                                      "of model.input / model.inputs (here %s)", names);
                bad++;
            }
        }
        int k = (int)l->kind;
        if (merge_kind(k) && (l->n_inputs < 2 || (k == LOOM_LAYER_SUBTRACT && l->n_inputs != 2))) {
            loom_err *er = cfg_err_(c, ins ? ins : e, "layer \"%s\" (%s) takes %s inputs, got %d", l->name,
                                    loom_layer_names_[k], k == LOOM_LAYER_SUBTRACT ? "exactly 2" : "2 or more",
                                    l->n_inputs);
            if (er) loom_err_hint(er, "list them: inputs = [\"a\", \"b\"];");
            bad++;
        } else if (k == LOOM_LAYER_MULTI_HEAD_ATTENTION && l->n_inputs > 3) {
            loom_err *er = cfg_err_(c, ins, "layer \"%s\" (multi_head_attention) takes 1 to 3 inputs, got %d", l->name,
                                    l->n_inputs);
            if (er) loom_err_hint(er, "inputs = [query] (self-attention), [query, value] or [query, value, key]");
            bad++;
        } else if (!merge_kind(k) && k >= 0 && l->n_inputs > 1 && k != LOOM_LAYER_MULTI_HEAD_ATTENTION &&
                   k != LOOM_LAYER_PLUGIN) { /* a plugin's layer: its build checks the count */
            loom_err *er = cfg_err_(c, ins, "layer \"%s\" (%s) takes one input, got %d", l->name,
                                    loom_layer_names_[k], l->n_inputs);
            if (er) loom_err_hint(er, "join them first with a merge layer (add, concatenate, ...)");
            bad++;
        }
    }
    if (bad) return;
    int color[LOOM_MAX_LAYERS] = {0}, path[LOOM_MAX_LAYERS];
    for (int i = 0; i < n; i++) {
        if (color[i]) continue;
        int np = 0, r = find_cycle(m, i, color, path, &np);
        if (r < 0) continue;
        /* path ends in the layer whose input r closes the cycle; print it in data-flow order */
        char txt[1024] = "";
        int from = np - 1;
        while (from > 0 && path[from] != r) from--;
        snprintf(txt, sizeof txt, "\"%s\"", m->layer[r].name);
        for (int q = np - 1; q > from; q--)
            snprintf(txt + strlen(txt), sizeof txt - strlen(txt), " -> \"%s\"", m->layer[path[q]].name);
        snprintf(txt + strlen(txt), sizeof txt - strlen(txt), " -> \"%s\"", m->layer[r].name);
        loom_err *er = cfg_err_(c, config_setting_get_elem(ll, r), "the layers form a cycle: %s", txt);
        if (er) loom_err_hint(er, "a model is a directed acyclic graph: remove one of these inputs");
        return;
    }
    /* the output is the last layer; a layer it does not depend on is not used */
    bool used[LOOM_MAX_LAYERS] = {false};
    used[n - 1] = true;
    for (int h = 1; h < m->n_heads; h++)
        for (int i = 0; i < n; i++)
            if (!strcmp(m->layer[i].name, m->head[h].layer)) used[i] = true;
    for (int i = n - 1; i >= 0; i--) {
        if (!used[i]) continue;
        int src[LOOM_MAX_LAYER_INPUTS], ns = layer_sources(m, i, src);
        for (int k = 0; k < ns; k++)
            if (src[k] >= 0) used[src[k]] = true;
    }
    /* used[] is closed only when inputs come earlier; walk again until no change (inputs may name later layers) */
    for (bool more = true; more;) {
        more = false;
        for (int i = 0; i < n; i++) {
            if (!used[i]) continue;
            int src[LOOM_MAX_LAYER_INPUTS], ns = layer_sources(m, i, src);
            for (int k = 0; k < ns; k++)
                if (src[k] >= 0 && !used[src[k]]) used[src[k]] = more = true;
        }
    }
    for (int i = 0; i < n; i++)
        if (!used[i]) {
            char w[LOOM_PATH_MAX + 16];
            loom_warn("%s: layer \"%s\" is not used: the model's output (its last layer, \"%s\") does not depend on "
                      "it; it is left out of the model", loom_loc_str(&m->layer[i].loc, w, sizeof w), m->layer[i].name,
                      m->layer[n - 1].name);
        }
}

/* model.class_weight (the setting cw) against the loss: weights per class
 * need a loss with classes, and binary cross-entropy's are [negative,
 * positive]. The model refuses both when it is built (specs built in code);
 * sparse_softmax_cross_entropy's count is checked there, against the output. */
static void check_class_weight(cfg_ctx *c, const config_setting_t *cw, const loom_model_spec *m)
{
    if (!cw || m->n_class_weights == 0) return;
    if (m->loss != LOOM_LOSS_SPARSE_SOFTMAX_CE && m->loss != LOOM_LOSS_BCE) {
        loom_err *e = cfg_err_(c, cw, "needs classes; the loss %s has none", loom_loss_name(m->loss));
        if (e) loom_err_hint(e, "class weights go with sparse_softmax_cross_entropy (one per class) or "
                             "binary_cross_entropy ([negative, positive]); remove class_weight");
    } else if (m->loss == LOOM_LOSS_BCE && m->n_class_weights != 2) {
        loom_err *e =
            cfg_err_(c, cw, "binary_cross_entropy takes [negative, positive], got %d weights", m->n_class_weights);
        if (e) loom_err_hint(e, "write class_weight = [w0, w1]");
    }
}

/* A head's metrics: the first head's are model.metrics (read there); the others report accuracy or nothing. */
static void parse_head_metrics(cfg_ctx *c, const config_setting_t *s, void *base)
{
    struct loom_head_spec *h = base;
    int n = cfg_string_list_(c, s, LOOM_MAX_METRICS, "metrics");
    if (n < 0) return;
    bool one = config_setting_type(s) == CONFIG_TYPE_STRING;
    h->accuracy = false;
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = one ? s : config_setting_get_elem(s, i);
        int k = cfg_get_enum_(c, e, loom_metric_names_);
        if (k == LOOM_METRIC_ACCURACY) h->accuracy = true; /* the others: refused by parse_outputs but for head 0 */
    }
}

/* model.outputs: the heads, each a layer of model.layers (the first the last
 * layer) with a label feature, a loss, a weight and metrics; the first
 * head's label, loss and metrics are the model's. */
static void parse_outputs(cfg_ctx *c, const config_setting_t *g, loom_model_spec *m)
{
    const config_setting_t *ol = config_setting_get_member(g, "outputs");
    if (!ol) return;
    char v[300];
    if (!config_setting_is_list(ol) && !config_setting_is_array(ol)) {
        cfg_err_(c, ol, "expected a list of heads ( { layer = \"...\"; label = \"...\"; }, ... ), got %s",
                 cfg_value_str_(ol, v, sizeof v));
        return;
    }
    int n = config_setting_length(ol);
    if (n < 1 || n > LOOM_MAX_HEADS) {
        cfg_err_(c, ol, "expected 1 to %d heads, got %d", LOOM_MAX_HEADS, n);
        return;
    }
    int bad = 0;
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = config_setting_get_elem(ol, i);
        struct loom_head_spec *h = &m->head[i];
        cfg_loc_of_(c, e, &h->loc);
        if (!config_setting_is_group(e)) {
            cfg_err_(c, e, "expected a group { layer = ...; label = ...; }, got %s", cfg_value_str_(e, v, sizeof v));
            bad++;
            continue;
        }
        cfg_parse_opts_(c, e, head_opts, 0, h);
        cfg_scope sc = {head_opts, 0, NULL};
        cfg_check_keys_(c, e, &sc, 1);
        const config_setting_t *ms = config_setting_get_member(e, "metrics");
        if (i == 0) {
            if (ms) parse_metrics(c, ms, m);
        } else if (ms) {
            int nm = config_setting_is_list(ms) || config_setting_is_array(ms) ? config_setting_length(ms) : 1;
            for (int k = 0; k < nm; k++) {
                const config_setting_t *me = nm == 1 && config_setting_type(ms) == CONFIG_TYPE_STRING
                                                 ? ms : config_setting_get_elem(ms, k);
                const char *name = me ? config_setting_get_string(me) : NULL;
                if (name && strcmp(name, "accuracy")) {
                    loom_err *er = cfg_err_(c, me, "head \"%s\": metric \"%s\" is the first head's only",
                                            h->layer, name);
                    if (er) loom_err_hint(er, "the other heads report their loss and accuracy; list [\"accuracy\"] "
                                              "or nothing");
                    bad++;
                }
            }
        } else {
            h->accuracy = h->loss == LOOM_LOSS_SPARSE_SOFTMAX_CE || h->loss == LOOM_LOSS_BCE;
        }
        int li = -1;
        for (int j = 0; j < m->n_layers; j++)
            if (!strcmp(m->layer[j].name, h->layer)) li = j;
        const config_setting_t *le = config_setting_get_member(e, "layer");
        if (h->layer[0] && li < 0) {
            loom_err *er = cfg_err_(c, le ? le : e, "head %d: \"%s\" is not a layer of model.layers", i, h->layer);
            if (er) loom_err_hint(er, "name a layer by its name (default <type>_<index>)");
            bad++;
        } else if (i == 0 && li >= 0 && li != m->n_layers - 1) {
            loom_err *er = cfg_err_(c, le ? le : e, "the first head's layer \"%s\" is not the last layer (\"%s\")",
                                    h->layer, m->layer[m->n_layers - 1].name);
            if (er) loom_err_hint(er, "the first head is the model's output: list its layer last in model.layers");
            bad++;
        }
        for (int j = 0; j < i; j++) {
            if (!strcmp(m->head[j].layer, h->layer)) {
                loom_err *er = cfg_err_(c, le ? le : e, "layer \"%s\" is already head %d", h->layer, j);
                if (er) loom_err_hint(er, "each head names a layer of its own");
                bad++;
            }
        }
    }
    if (bad) return;
    m->n_heads = n;
    snprintf(m->label, sizeof m->label, "%s", m->head[0].label);
    m->loss = m->head[0].loss;
    for (int k = 0; k < 2; k++) {
        const char *key = k ? "loss" : "label";
        if (config_setting_get_member(g, key)) {
            loom_err *er = cfg_err_(c, config_setting_get_member(g, key), "give model.%s or model.outputs, not both",
                                    key);
            if (er) loom_err_hint(er, "the first head's %s is the model's: remove model.%s", key, key);
        }
    }
}

/* model: its options, then the layers. */
void cfg_parse_model_(cfg_ctx *c, const config_setting_t *root, loom_model_spec *m)
{
    const config_setting_t *g;
    if ((g = cfg_sub_group_(c, root, "model"))) {
        cfg_loc_of_(c, g, &m->loc);
        m->metrics_loc = m->loc;
        cfg_parse_opts_(c, g, model_opts, 0, m);
        cfg_scope sc = {model_opts, 0, NULL};
        cfg_check_keys_(c, g, &sc, 1);
        check_class_weight(c, config_setting_get_member(g, "class_weight"), m);
        const config_setting_t *mi = config_setting_get_member(g, "inputs");
        if (mi && m->n_inputs) {
            if (config_setting_get_member(g, "input")) {
                loom_err *e = cfg_err_(c, mi, "give model.input (one feature) or model.inputs (several), not both");
                if (e) loom_err_hint(e, "remove model.input");
            }
            snprintf(m->input, sizeof m->input, "%s", m->inputs[0]);
        }
        parse_layers(c, g, m);
        const config_setting_t *ll = config_setting_get_member(g, "layers");
        if (ll && m->n_layers > 0 && m->n_layers == config_setting_length(ll)) {
            parse_outputs(c, g, m);
            check_graph(c, ll, m);
        }
    }
}

int loom_model_spec_graph_layer(const loom_model_spec *ms)
{
    if (ms->n_inputs > 1) return 0;
    for (int i = 0; i < ms->n_layers; i++) {
        const loom_layer_spec *l = &ms->layer[i];
        if (merge_kind((int)l->kind) || l->n_inputs > 1) return i;
        if (l->n_inputs == 1 && strcmp(l->inputs[0], i > 0 ? ms->layer[i - 1].name : model_input_name(ms, 0)))
            return i;
    }
    return -1;
}
