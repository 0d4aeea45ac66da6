/* config_optimizer.c - the optimizer section and its learning-rate schedule.
 * Threads: none. */
#include "config/config_internal.h"

#include <math.h>

static void parse_boundaries(cfg_ctx *c, const config_setting_t *s, void *base);
static void parse_values(cfg_ctx *c, const config_setting_t *s, void *base);

#define OPT(k) K(LOOM_OPT_##k)
static const cfg_opt optimizer_opts[] = {
    O_KIND(loom_optimizer_spec, "type", kind, 0, loom_opt_names_, ALL, "optimizer"),
    O_F64(loom_optimizer_spec, "learning_rate", learning_rate, 0, 0.0, 0, F_LO_OPEN | F_NO_HI, ALL, ALL,
          "base learning rate"),
    O_F64(loom_optimizer_spec, "momentum", momentum, 0.9, 0.0, 1.0, F_HI_OPEN, OPT(MOMENTUM), 0, "momentum"),
    O_BOOL(loom_optimizer_spec, "nesterov", nesterov, 0, OPT(MOMENTUM), "Nesterov momentum"),
    O_F64(loom_optimizer_spec, "beta1", beta1, 0.9, 0.0, 1.0, F_HI_OPEN, OPT(ADAM) | OPT(ADAMW), 0, "adam beta1"),
    O_F64(loom_optimizer_spec, "beta2", beta2, 0.999, 0.0, 1.0, F_HI_OPEN, OPT(ADAM) | OPT(ADAMW), 0, "adam beta2"),
    O_F64(loom_optimizer_spec, "epsilon", epsilon, 1e-7, 0.0, 0, F_LO_OPEN | F_NO_HI,
          OPT(ADAM) | OPT(ADAMW) | OPT(RMSPROP) | OPT(ADAGRAD), 0, "adam, adamw, rmsprop, adagrad epsilon"),
    O_F64(loom_optimizer_spec, "weight_decay", weight_decay, 0.004, 0.0, 1.0, F_HI_OPEN, OPT(ADAMW), 0,
          "adamw: decoupled weight decay, p -= lr * weight_decay * p"),
    O_F64(loom_optimizer_spec, "rho", rho, 0.9, 0.0, 1.0, F_HI_OPEN, OPT(RMSPROP), 0, "rmsprop: decay of the mean square"),
    O_F64(loom_optimizer_spec, "clip_norm", clip_norm, 0.0, 0.0, 0, F_NO_HI, ALL, 0,
          "> 0: clip the gradients to this global norm (0 = off)"),
    O_F64(loom_optimizer_spec, "initial_accumulator_value", initial_accumulator, 0.1, 0.0, 0, F_NO_HI, OPT(ADAGRAD), 0,
          "adagrad: the accumulator's start"),
    O_SUB("schedule", 0, 0, "learning-rate schedule"),
    O_END,
};

#define SCH(k) K(LOOM_SCHED_##k)
static const cfg_opt schedule_opts[] = {
    O_KIND(loom_schedule_spec, "type", kind, LOOM_SCHED_CONSTANT, loom_sched_names_, 0, "schedule type"),
    O_INT(loom_schedule_spec, "decay_steps", decay_steps, 0, 1, INT64_MAX, SCH(EXPONENTIAL_DECAY) | SCH(COSINE),
          SCH(EXPONENTIAL_DECAY) | SCH(COSINE), "steps per decay period"),
    O_F64(loom_schedule_spec, "decay_rate", decay_rate, 0, 0.0, 0, F_LO_OPEN | F_NO_HI, SCH(EXPONENTIAL_DECAY),
          SCH(EXPONENTIAL_DECAY), "factor per decay period"),
    O_BOOL(loom_schedule_spec, "staircase", staircase, 0, SCH(EXPONENTIAL_DECAY), "integer division"),
    O_F64(loom_schedule_spec, "alpha", alpha, 0.0, 0.0, 1.0, 0, SCH(COSINE), 0, "floor as a fraction of lr"),
    O_CUSTOM("boundaries", parse_boundaries, SCH(PIECEWISE_CONSTANT), SCH(PIECEWISE_CONSTANT),
             "increasing step numbers"),
    O_CUSTOM("values", parse_values, SCH(PIECEWISE_CONSTANT), SCH(PIECEWISE_CONSTANT),
             "learning rates, one more than boundaries"),
    O_END,
};

static void parse_boundaries(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_schedule_spec *sch = base;
    char v[300];
    if (!config_setting_is_array(s) && !config_setting_is_list(s)) {
        cfg_err_(c, s, "expected an array of step numbers [b0, b1, ...], got %s", cfg_value_str_(s, v, sizeof v));
        return;
    }
    int n = config_setting_length(s);
    if (n < 1 || n > LOOM_MAX_BOUNDARIES) {
        cfg_err_(c, s, "expected 1 to %d boundaries, got %d", LOOM_MAX_BOUNDARIES, n);
        return;
    }
    for (int i = 0; i < n; i++) {
        const config_setting_t *b = config_setting_get_elem(s, i);
        int64_t x;
        if (!cfg_get_int_in_(c, b, 0, INT64_MAX, &x)) return;
        if (i > 0 && x <= sch->boundaries[i - 1]) {
            cfg_err_(c, b, "boundaries must be increasing: %lld follows %lld", (long long)x,
                 (long long)sch->boundaries[i - 1]);
            return;
        }
        sch->boundaries[i] = x;
    }
    sch->n_boundaries = n;
}

static void parse_values(cfg_ctx *c, const config_setting_t *s, void *base)
{
    loom_schedule_spec *sch = base;
    char v[300];
    if (!config_setting_is_array(s) && !config_setting_is_list(s)) {
        cfg_err_(c, s, "expected an array of learning rates [v0, v1, ...], got %s", cfg_value_str_(s, v, sizeof v));
        return;
    }
    int n = config_setting_length(s);
    if (n < 2 || n > LOOM_MAX_BOUNDARIES + 1) {
        cfg_err_(c, s, "expected 2 to %d values, got %d", LOOM_MAX_BOUNDARIES + 1, n);
        return;
    }
    for (int i = 0; i < n; i++) {
        const config_setting_t *e = config_setting_get_elem(s, i);
        if (!cfg_is_number_(e) || !(cfg_get_number_(e) > 0) || !isfinite(cfg_get_number_(e))) {
            cfg_err_(c, e, "expected a learning rate > 0, got %s", cfg_value_str_(e, v, sizeof v));
            return;
        }
        sch->values[i] = cfg_get_number_(e);
    }
}

static void parse_schedule(cfg_ctx *c, const config_setting_t *og, loom_optimizer_spec *o)
{
    loom_schedule_spec *sch = &o->schedule;
    const config_setting_t *g = cfg_sub_group_(c, og, "schedule");
    if (!g) {
        sch->kind = LOOM_SCHED_CONSTANT;
        sch->loc = o->loc;
        snprintf(sch->loc.path, sizeof sch->loc.path, "optimizer.schedule");
        return;
    }
    cfg_loc_of_(c, g, &sch->loc);
    int k = cfg_parse_kind_(c, g, schedule_opts, sch);
    cfg_parse_opts_(c, g, schedule_opts, k, sch);
    cfg_scope sc = {schedule_opts, k, NULL};
    cfg_check_keys_(c, g, &sc, 1);
    if (k == LOOM_SCHED_PIECEWISE_CONSTANT) {
        const config_setting_t *b = config_setting_get_member(g, "boundaries");
        const config_setting_t *v = config_setting_get_member(g, "values");
        if (b && v && (config_setting_is_array(b) || config_setting_is_list(b)) &&
            (config_setting_is_array(v) || config_setting_is_list(v)) &&
            config_setting_length(v) != config_setting_length(b) + 1)
            cfg_err_(c, v, "expected %d values (one more than the %d boundaries), got %d", config_setting_length(b) + 1,
                 config_setting_length(b), config_setting_length(v));
    }
}

/* optimizer: its kind, its options, the schedule. */
void cfg_parse_optimizer_(cfg_ctx *c, const config_setting_t *root, loom_optimizer_spec *o)
{
    const config_setting_t *g;
    if ((g = cfg_sub_group_(c, root, "optimizer"))) {
        cfg_loc_of_(c, g, &o->loc);
        int k = cfg_parse_kind_(c, g, optimizer_opts, o);
        cfg_parse_opts_(c, g, optimizer_opts, k, o);
        cfg_scope sc = {optimizer_opts, k, NULL};
        cfg_check_keys_(c, g, &sc, 1);
        parse_schedule(c, g, o);
    }
}
