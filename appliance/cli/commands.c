/* commands.c - `loom train|evaluate|predict|check|inspect|records`, options,
 * help, and the mapping of errors to exit statuses (0 ok, 2 bad config or
 * usage, 1 runtime). Commands with subcommands (records) parse their own
 * arguments through `main`. */
#include "cli.h"
#include "cluster/cluster.h"
#include "plugin/plugin.h"
#include "script/script.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_SETS 64

typedef struct cli_opts {
    const char *config;
    const char *model_dir;
    const char *sets[MAX_SETS];
    int         n_sets;
    bool        fresh, print, quiet, verbose, gradcheck;
    const char *input, *output, *checkpoint;
    const char *id;   /* predict --id NAMES */
    const char *task; /* --task ROLE:I */
    bool        watch;        /* evaluate --watch */
    double      idle_timeout; /* evaluate --watch --idle-timeout S */
    char        status_set[48]; /* --status-port N, as "run.status_port=N" in sets */
    char        model_dir_abs[PATH_MAX]; /* --model-dir made absolute (cwd_path) */
} cli_opts;

/* A path given on the command line, relative to the working directory as
 * shells expect, made absolute (into buf) so that every message naming it
 * shows where it is; v itself when the working directory is unknown. */
static const char *cwd_path(const char *v, char *buf, size_t n)
{
    char cwd[PATH_MAX];
    if (!v) return v;
    int w = v[0] == '/' ? snprintf(buf, n, "%s", v) : getcwd(cwd, sizeof cwd) ? snprintf(buf, n, "%s/%s", cwd, v) : -1;
    return w > 0 && (size_t)w < n ? loom_path_normalize(buf) : v; /* "/a/j6/../j5" shown as "/a/j5" */
}

typedef struct command {
    const char *name;
    const char *summary;
    const char *usage;
    const char *help;
    int (*run)(const cli_opts *o, double start, loom_err *err);
    unsigned    accepts; /* option bits below */
    /* (optional) parses argv (argv[0] is the command's name) itself and
     * returns the exit status; run, usage, help and accepts are then unused */
    int (*main)(int argc, char **argv, double start);
} command;

enum { OPT_MODEL_DIR = 1, OPT_SET = 2, OPT_FRESH = 4, OPT_PRINT = 8, OPT_INPUT = 16, OPT_OUTPUT = 32,
       OPT_CHECKPOINT = 64, OPT_TASK = 128, OPT_STATUS_PORT = 256, OPT_WATCH = 512, OPT_ID = 1024 };

void loom_cli_print_err_(const loom_err *err)
{
    char buf[1200];
    loom_err_format(err, buf, sizeof buf);
    fprintf(stderr, "loom: %s", buf);
}

void loom_cli_print_errlist_(const loom_errlist *l)
{
    for (int i = 0; i < l->n; i++) loom_cli_print_err_(&l->e[i]);
    if (l->n == LOOM_MAX_ERRORS) fprintf(stderr, "loom: (stopped after %d errors)\n", LOOM_MAX_ERRORS);
}

/* Plugins load once, after the config (for its plugins.path and require)
 * and before anything needs a provider; then the provider names the config
 * gives (strategy.type, cross_device_ops, strategy.options) are checked. */
static int load_plugins(const loom_spec *spec, loom_errlist *errs)
{
    loom_err err = {0};
    int rc = loom_script_register(&err); /* the "lua" map/filter provider, a built-in */
    if (!rc) rc = loom_plugins_load(spec, &err);
    if (rc) {
        errs->n = 1;
        errs->e[0] = err;
    } else {
        rc = loom_plugins_check_spec(spec, errs);
    }
    if (rc) loom_cli_print_errlist_(errs);
    return rc;
}

/* Loads the config and the plugins, printing every problem; returns NULL on
 * failure. training: the command builds a model, so the config must give it
 * batches (loom_config_check_training), found here before anything runs. */
static loom_spec *load_as(const cli_opts *o, int *status, bool training)
{
    loom_spec *spec = NULL;
    loom_errlist *errs = calloc(1, sizeof *errs);
    if (!errs) {
        *status = LOOM_EXIT_RUNTIME;
        return NULL;
    }
    int rc = loom_config_load(&spec, o->config, o->sets, o->n_sets, errs);
    if (rc) {
        loom_cli_print_errlist_(errs);
        if (errs->n == 0) fprintf(stderr, "loom: %s: %s\n", o->config, loom_err_string(rc));
        *status = rc == LOOM_EIO ? LOOM_EXIT_USAGE : LOOM_EXIT_USAGE;
        spec = NULL;
    } else if (training && loom_config_check_training(spec, errs)) {
        loom_cli_print_errlist_(errs);
        *status = LOOM_EXIT_USAGE;
        loom_config_free(spec);
        spec = NULL;
    } else if (load_plugins(spec, errs)) {
        *status = LOOM_EXIT_USAGE;
        loom_config_free(spec);
        spec = NULL;
    }
    free(errs);
    return spec;
}
static loom_spec *load(const cli_opts *o, int *status) { return load_as(o, status, false); }
static loom_spec *load_training(const cli_opts *o, int *status) { return load_as(o, status, true); }

/* Maps with adapt = true get their numbers (data.h loom_data_adapt), with
 * the context loom train builds its pipelines with: those of the checkpoint
 * used (`checkpoint`, else the latest in the model directory) when it holds
 * them, so a copied checkpoint or a model_dir without adapt.txt gives the
 * same outputs; FRESH adapts anew. */
static int adapt(loom_spec *spec, const char *model_dir, loom_adapt_mode mode, const char *checkpoint, loom_err *err)
{
    loom_lua_opts lua = {.model_dir = spec->run.model_dir, .unsafe = spec->hooks.unsafe,
                         .memory_limit = spec->hooks.memory_limit, .instruction_limit = spec->hooks.instruction_limit};
    loom_data_ctx ctx = {.seed = spec->run.seed, .threads = spec->run.threads > 0 ? spec->run.threads : loom_num_cores(),
                         .name = "adapt", .custom_options = &lua};
    const char *dir = model_dir ? model_dir : spec->run.model_dir;
    bool any = false;
    for (int d = 0; d < 2; d++) {
        const loom_dataset_spec *ds = d ? &spec->eval : &spec->train;
        for (int i = 0; i < ds->n_transforms; i++) any |= ds->transform[i].kind == LOOM_T_MAP && ds->transform[i].map.adapt;
    }
    loom_buf blob;
    loom_buf_init(&blob);
    loom_adapt_source ck = {0};
    char path[LOOM_PATH_MAX], abs[PATH_MAX];
    if (any && mode != LOOM_ADAPT_FRESH) {
        loom_err quiet = {0}; /* an unreadable checkpoint is reported where it is loaded */
        int64_t step;
        int rc = checkpoint ? (snprintf(path, sizeof path, "%s", checkpoint), LOOM_OK)
                            : loom_ckpt_latest(dir, path, &step, &quiet);
        if (!rc && loom_ckpt_read_blob(path, "adapt", &blob, &quiet) == LOOM_OK)
            ck = (loom_adapt_source){.name = realpath(path, abs) ? abs : path, .text = blob.data, .len = blob.len};
    }
    int rc = loom_data_adapt_from(spec, dir, mode, &ctx, ck.text ? &ck : NULL, err);
    loom_buf_fini(&blob);
    return rc;
}

/* This process's task in a cluster (NULL for one process), from --task,
 * TF_CONFIG, Slurm or MPI, checked against the roles the strategy describes
 * (plugins are loaded by now); every error before anything opens. */
static int resolve_cluster(const loom_spec *spec, const cli_opts *o, loom_cluster **out, bool need_task, loom_err *err)
{
    const loom_cluster_roles *roles = loom_strategy_roles(spec);
    int rc = need_task ? loom_cluster_resolve(out, spec, roles, o->task, NULL, err)
                       : loom_cluster_resolve_any(out, spec, roles, o->task, NULL, err);
    if (!rc && *out && !(*out)->secret_len && !(*out)->insecure && !getenv("LOOM_LAUNCH"))
        loom_warn("the cluster has no secret: every address is loopback, so it runs, but any local process could "
                  "join it; set cluster.secret_file or LOOM_CLUSTER_SECRET");
    return rc;
}

/* The sidecar evaluator: a cluster's evaluator task (cl), or `loom evaluate --watch`. */
static int watch(const loom_spec *spec, const cli_opts *o, const loom_cluster *cl, loom_err *err)
{
    char who[32];
    loom_watch_opts wo = {.idle_secs = o->idle_timeout};
    if (cl && cl->role == LOOM_ROLE_EVALUATOR) { /* started with the job: an earlier run's end does not count */
        wo.who = loom_task_name(cl->role, cl->index, who, sizeof who);
        wo.after_wall = loom_wall_time();
    }
    int n = 0;
    return loom_evaluate_watch(spec, o->model_dir, &wo, &n, err);
}

static int cmd_train(const cli_opts *o, double start, loom_err *err)
{
    int status = 0;
    loom_spec *spec = load_training(o, &status);
    if (!spec) return -status;
    loom_cluster *cl = NULL;
    int rc = resolve_cluster(spec, o, &cl, true, err);
    if (!rc) {
        if (cl) {
            char nm[32];
            loom_task_name(cl->role, cl->index, nm, sizeof nm);
            if (cl->rank >= cl->n_train_ranks) /* strategy.elastic: a worker past the cluster's list */
                loom_info("cluster task %s (%s), training rank %d, past the %d listed (strategy.elastic: a job of up to "
                          "%d workers); it listens on an ephemeral port", nm, cl->task_detail, cl->rank,
                          cl->n_train_ranks, loom_cluster_train_slots(cl));
            else if (cl->rank >= 0)
                loom_info("cluster task %s (%s), training rank %d of %d", nm, cl->task_detail, cl->rank, cl->n_train_ranks);
            else if (cl->role == LOOM_ROLE_PS) /* (it computes nothing: "rank -1 of N" said nothing true) */
                loom_info("cluster task %s (%s), parameter server %d of %d: holds its shards of the variables for "
                          "the %d worker%s", nm, cl->task_detail, cl->index, cl->n_tasks[LOOM_ROLE_PS],
                          cl->n_tasks[LOOM_ROLE_WORKER], cl->n_tasks[LOOM_ROLE_WORKER] == 1 ? "" : "s");
            else
                loom_info("cluster task %s (%s), %snot a training rank", nm, cl->task_detail,
                          cl->role == LOOM_ROLE_EVALUATOR ? "the sidecar evaluator, " : "");
        }
        if (cl && cl->role == LOOM_ROLE_EVALUATOR) { /* the sidecar evaluator: it trains nothing */
            rc = adapt(spec, o->model_dir, LOOM_ADAPT_CHECK, NULL, err); /* the trainer's numbers, or the same pass */
            if (!rc) rc = watch(spec, o, cl, err);
        } else {
            loom_train_opts to = {.model_dir = o->model_dir, .fresh = o->fresh, .start_time = start, .cluster = cl};
            rc = adapt(spec, o->model_dir, o->fresh ? LOOM_ADAPT_FRESH : LOOM_ADAPT_TRAIN, NULL, err);
            if (!rc) rc = loom_train(spec, &to, err);
        }
    }
    loom_cluster_free(cl);
    loom_config_free(spec);
    return rc;
}

static int cmd_evaluate(const cli_opts *o, double start, loom_err *err)
{
    (void)start;
    int status = 0;
    loom_spec *spec = load_training(o, &status);
    if (!spec) return -status;
    loom_eval_result res;
    loom_cluster *cl = NULL;
    int rc = resolve_cluster(spec, o, &cl, false, err); /* checked; evaluation itself runs in this process */
    if (!rc && (o->watch || (cl && cl->role == LOOM_ROLE_EVALUATOR && cl->index >= 0))) {
        if (o->checkpoint) rc = loom_err_set(err, LOOM_EUSAGE, NULL, "--watch evaluates every new checkpoint: "
                                             "it takes no --checkpoint");
        else if (!(rc = adapt(spec, o->model_dir, LOOM_ADAPT_CHECK, NULL, err))) /* the trainer's numbers, or the same pass */
            rc = watch(spec, o, cl, err);
        loom_cluster_free(cl);
        loom_config_free(spec);
        return rc;
    }
    loom_cluster_free(cl);
    if (!rc) rc = adapt(spec, o->model_dir, LOOM_ADAPT_LOAD, o->checkpoint, err);
    if (!rc) rc = loom_evaluate(spec, o->model_dir, o->checkpoint, &res, err);
    if (!rc && res.examples == 0) { /* JSON has no nan: null, and say why */
        printf("{\"checkpoint\": \"%s\", \"step\": %lld, \"examples\": 0, \"eval_loss\": null}\n", res.checkpoint,
               (long long)res.step);
        loom_info("%s (step %lld): no eval data: data.eval yielded no examples", res.checkpoint, (long long)res.step);
    } else if (!rc) {
        /* eval_loss, then eval_<metric> for each of model.metrics */
        char js[2048] = "", tx[1536] = "";
        size_t jl = 0, tl = 0;
        for (int i = 0; i < res.n_metrics; i++) {
            int w = isfinite(res.metric[i])
                        ? snprintf(js + jl, sizeof js - jl, ", \"eval_%s\": %.6g", res.metric_name[i], res.metric[i])
                        : snprintf(js + jl, sizeof js - jl, ", \"eval_%s\": null", res.metric_name[i]);
            if (w > 0 && jl + (size_t)w < sizeof js) jl += (size_t)w;
            w = snprintf(tx + tl, sizeof tx - tl, ", %s %.4f", res.metric_name[i], res.metric[i]);
            if (w > 0 && tl + (size_t)w < sizeof tx) tl += (size_t)w;
        }
        printf("{\"checkpoint\": \"%s\", \"step\": %lld, \"examples\": %lld, \"eval_loss\": %.6g%s}\n",
               res.checkpoint, (long long)res.step, (long long)res.examples, res.loss, js);
        loom_info("%s (step %lld): eval loss %.4f%s on %lld examples", res.checkpoint, (long long)res.step,
                  res.loss, tx, (long long)res.examples);
    }
    loom_config_free(spec);
    return rc;
}

static int cmd_predict(const cli_opts *o, double start, loom_err *err)
{
    (void)start;
    if (!o->output) return loom_err_set(err, LOOM_EUSAGE, NULL, "predict needs --output FILE (or - for stdout)");
    int status = 0;
    loom_spec *spec = load_training(o, &status);
    if (!spec) return -status;
    int rc = adapt(spec, o->model_dir, LOOM_ADAPT_LOAD, o->checkpoint, err);
    loom_predict_opts po = {.model_dir = o->model_dir, .checkpoint = o->checkpoint, .input = o->input ? o->input : "eval",
                            .output = o->output, .id = o->id};
    if (!rc) rc = loom_predict_run(spec, &po, err);
    loom_config_free(spec);
    return rc;
}

static int cmd_check(const cli_opts *o, double start, loom_err *err)
{
    (void)start;
    int status = 0;
    loom_spec *spec = load_as(o, &status, !o->print); /* --print only prints the config */
    if (!spec) return -status;
    loom_cluster *cl = NULL;
    int rc = resolve_cluster(spec, o, &cl, false, err);
    if (!rc && o->print) {
        loom_config_print(spec, stdout);
    } else if (!rc) {
        if (cl || spec->cluster.present) loom_cluster_print(cl, stdout);
        rc = adapt(spec, o->model_dir, LOOM_ADAPT_CHECK, NULL, err);
        if (!rc) rc = loom_check(spec, cl, stdout, err);
        if (!rc && o->gradcheck) rc = loom_gradcheck(spec, cl, stdout, err);
        if (!rc) printf("%s: ok\n", o->config);
    }
    loom_cluster_free(cl);
    loom_config_free(spec);
    return rc;
}

/* The hidden task `loom launch --command cluster-selftest` starts: loads the
 * config and the plugins and resolves the cluster as train does (a plugin's
 * strategy gives the roles; a provider name the config gives is checked),
 * then does what $LOOM_SELFTEST says (launch.c). */
static int cmd_selftest(const cli_opts *o, double start, loom_err *err)
{
    (void)start;
    int status = 0;
    loom_spec *spec = load(o, &status);
    if (!spec) return -status;
    loom_cluster *cl = NULL;
    int rc = resolve_cluster(spec, o, &cl, true, err);
    if (!rc) rc = -loom_cli_selftest_(cl, o->model_dir, o->fresh); /* its own exit status, negated as for a config that did not load */
    loom_cluster_free(cl);
    loom_config_free(spec);
    return rc;
}

static int cmd_inspect(const cli_opts *o, double start, loom_err *err)
{
    (void)start;
    return loom_ckpt_inspect(o->config, stdout, err);
}

static int exit_status(int code);

/* `loom profile CONFIG [--steps N] [--set k=v ...]`: the training input
 * pipeline alone, then its per-stage report (data/engine/profile.c). */
static int cmd_profile_main(int argc, char **argv, double start)
{
    (void)start;
    cli_opts o = {0};
    long long steps = 0;
    bool train = false;
    loom_input_ctx input = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            printf("usage: loom profile CONFIG [--steps N] [--input-pipeline ID/N] [--set key.path=value ...]\n"
                   "       loom profile --train CONFIG [--steps N] [--set key.path=value ...]\n\n"
                   "Runs data.train alone (no model) for N batches (default: one epoch, at most 500) and\n"
                   "prints per stage: elements/s, own time per element, buffer occupancy, parallelism and\n"
                   "memory, then the bottleneck (the stage with the highest own time).\n"
                   "--input-pipeline ID/N builds input pipeline ID of N, as worker ID of N would, sharded\n"
                   "by data.train.shard_policy, and first prints which files or elements it gets.\n"
                   "--train profiles training steps instead (default 20, after 3 warm-up), writing nothing:\n"
                   "microseconds per step of the input hand-off, each layer's forward, the loss, each\n"
                   "layer's backward and weight gradients, the gradient reduction and the optimizer, each\n"
                   "as a share of the step and against the GEMM-only time of its products. Lua hooks\n"
                   "(callbacks, a custom train_step) are not run.\n");
            return LOOM_EXIT_OK;
        } else if (!strcmp(a, "--train")) {
            train = true;
        } else if (!strcmp(a, "--input-pipeline") && i + 1 < argc) {
            const char *v = argv[++i];
            int id, n, len = 0;
            if (sscanf(v, "%d/%d%n", &id, &n, &len) != 2 || v[len] || n < 1 || n > 1000000 || id < 0 || id >= n) {
                fprintf(stderr, "loom profile: --input-pipeline expects ID/N with 0 <= ID < N, got \"%s\"\n", v);
                return LOOM_EXIT_USAGE;
            }
            input = (loom_input_ctx){.num_input_pipelines = n, .input_pipeline_id = id, .num_replicas_in_sync = n};
        } else if ((!strcmp(a, "--steps") || !strcmp(a, "--set")) && i + 1 < argc) {
            const char *v = argv[++i];
            if (a[3] == 'e') {
                if (o.n_sets == MAX_SETS || !strchr(v, '=')) {
                    fprintf(stderr, "loom profile: bad --set %s (key.path=value, at most %d)\n", v, MAX_SETS);
                    return LOOM_EXIT_USAGE;
                }
                o.sets[o.n_sets++] = v;
            } else {
                char *end;
                steps = strtoll(v, &end, 10);
                if (*end || steps < 1 || steps > 1000000000) {
                    fprintf(stderr, "loom profile: --steps expects an integer in [1, 1e9], got \"%s\"\n", v);
                    return LOOM_EXIT_USAGE;
                }
            }
        } else if (a[0] != '-' && !o.config) {
            o.config = a;
        } else {
            fprintf(stderr, "loom profile: unexpected argument \"%s\"\nusage: loom profile CONFIG [--steps N]\n", a);
            return LOOM_EXIT_USAGE;
        }
    }
    if (!o.config) {
        fprintf(stderr, "loom profile: missing CONFIG\nusage: loom profile CONFIG [--steps N]\n");
        return LOOM_EXIT_USAGE;
    }
    int status = 0;
    loom_spec *spec = load(&o, &status);
    if (!spec) return status;
    loom_err err = {0};
    if (train && input.num_input_pipelines) {
        loom_config_free(spec);
        fprintf(stderr, "loom profile: --train and --input-pipeline do not go together\n");
        return LOOM_EXIT_USAGE;
    }
    if (train) { /* adapted maps as loom train has them (model_dir's numbers), or the same pass */
        int rc = adapt(spec, NULL, LOOM_ADAPT_CHECK, NULL, &err);
        if (!rc) rc = loom_train_profile(spec, steps, 3, stdout, &err);
        loom_config_free(spec);
        if (rc) loom_cli_print_err_(&err);
        return exit_status(rc);
    }
    int threads = spec->run.threads > 0 ? spec->run.threads : loom_num_cores();
    loom_lua_opts lua = {.model_dir = spec->run.model_dir, .unsafe = spec->hooks.unsafe, /* as loom train runs Lua maps */
                         .memory_limit = spec->hooks.memory_limit, .instruction_limit = spec->hooks.instruction_limit};
    loom_data_ctx ctx = {.seed = spec->run.seed, .threads = threads, .name = "data.train", .input = input,
                         .custom_options = &lua};
    int rc = adapt(spec, NULL, LOOM_ADAPT_CHECK, NULL, &err);
    if (!rc && input.num_input_pipelines) rc = loom_data_input_report(&spec->train, &ctx, stdout, &err);
    if (!rc) rc = loom_data_profile(&spec->train, &ctx, steps, stdout, &err);
    loom_config_free(spec);
    if (rc) loom_cli_print_err_(&err);
    return exit_status(rc);
}

/* `loom export CONFIG --format onnx|npz --output FILE [--checkpoint FILE]
 * [--model-dir DIR] [--include-preprocessing] [--set key.path=value ...]`. */
static int cmd_export_main(int argc, char **argv, double start)
{
    (void)start;
    cli_opts o = {0};
    loom_export_opts eo = {.format = LOOM_EXPORT_ONNX};
    const char *usage_line = "usage: loom export CONFIG --format onnx|npz --output FILE [--checkpoint FILE] "
                             "[--model-dir DIR] [--include-preprocessing] [--set key.path=value ...]\n";
    bool have_format = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            printf("%s\n"
                   "Writes the model of CONFIG with the weights of a checkpoint (the latest in the model\n"
                   "directory unless --checkpoint) as:\n"
                   "  onnx  an ONNX model (opset 17) with input \"input\" (batch, ...) and output \"output\"\n"
                   "        (batch, classes): probabilities under softmax cross-entropy, as loom predict;\n"
                   "        --include-preprocessing folds the eval pipeline's cast/scale/normalize maps of\n"
                   "        the input in, so the input is the source's raw feature (e.g. uint8 pixels)\n"
                   "  npz   one float32 array per variable, named as loom inspect names them\n",
                   usage_line);
            return LOOM_EXIT_OK;
        } else if (!strcmp(a, "--include-preprocessing")) {
            eo.include_preprocessing = true;
        } else if (!strcmp(a, "--quiet") || !strcmp(a, "-q")) {
            loom_log_set_level(LOOM_LOG_WARN);
        } else if ((!strcmp(a, "--format") || !strcmp(a, "--output") || !strcmp(a, "--checkpoint") ||
                    !strcmp(a, "--model-dir") || !strcmp(a, "--set")) && i + 1 < argc) {
            const char *v = argv[++i];
            if (!strcmp(a, "--format")) {
                if (strcmp(v, "onnx") && strcmp(v, "npz")) {
                    fprintf(stderr, "loom export: unknown --format \"%s\" (expected one of: onnx, npz)\n", v);
                    return LOOM_EXIT_USAGE;
                }
                eo.format = strcmp(v, "npz") ? LOOM_EXPORT_ONNX : LOOM_EXPORT_NPZ;
                have_format = true;
            } else if (!strcmp(a, "--output")) {
                eo.output = v;
            } else if (!strcmp(a, "--checkpoint")) {
                eo.checkpoint = v;
            } else if (!strcmp(a, "--model-dir")) {
                eo.model_dir = cwd_path(v, o.model_dir_abs, sizeof o.model_dir_abs);
            } else if (o.n_sets == MAX_SETS || !strchr(v, '=')) {
                fprintf(stderr, "loom export: bad --set %s (key.path=value, at most %d)\n", v, MAX_SETS);
                return LOOM_EXIT_USAGE;
            } else {
                o.sets[o.n_sets++] = v;
            }
        } else if (a[0] != '-' && !o.config) {
            o.config = a;
        } else {
            fprintf(stderr, "loom export: unexpected argument \"%s\"\n%s", a, usage_line);
            return LOOM_EXIT_USAGE;
        }
    }
    if (!o.config || !eo.output || !have_format) {
        fprintf(stderr, "loom export: missing %s\n%s", !o.config ? "CONFIG" : !have_format ? "--format" : "--output",
                usage_line);
        return LOOM_EXIT_USAGE;
    }
    if (eo.include_preprocessing && eo.format != LOOM_EXPORT_ONNX) {
        fprintf(stderr, "loom export: --include-preprocessing applies to --format onnx only\n");
        return LOOM_EXIT_USAGE;
    }
    int status = 0;
    loom_spec *spec = load(&o, &status);
    if (!spec) return status;
    loom_err err = {0};
    int rc = adapt(spec, eo.model_dir, LOOM_ADAPT_LOAD, eo.checkpoint, &err);
    if (!rc) rc = loom_export(spec, &eo, &err);
    loom_config_free(spec);
    if (rc) loom_cli_print_err_(&err);
    return exit_status(rc);
}

/* `loom plugins [--config CONFIG] [--set key.path=value ...]`: loads the
 * plugins as a command reading CONFIG would, then lists them. */
static int cmd_plugins_main(int argc, char **argv, double start)
{
    (void)start;
    cli_opts o = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            printf("usage: loom plugins [--config CONFIG] [--set key.path=value ...]\n\n"
                   "Loads every plugin (*.so) of plugins/ next to the loom binary, of CONFIG's plugins.path and\n"
                   "of $LOOM_PLUGIN_PATH (colon-separated), then lists the directories searched, the plugins\n"
                   "loaded with what each provides, the files refused and why, and the built-in providers.\n"
                   "With CONFIG, its plugins.require and provider names are checked too (exit 2 if wrong).\n");
            return LOOM_EXIT_OK;
        } else if ((!strcmp(a, "--config") || !strcmp(a, "--set")) && i + 1 < argc) {
            const char *v = argv[++i];
            if (a[2] == 'c') {
                o.config = v;
            } else if (o.n_sets == MAX_SETS || !strchr(v, '=')) {
                fprintf(stderr, "loom plugins: bad --set %s (key.path=value, at most %d)\n", v, MAX_SETS);
                return LOOM_EXIT_USAGE;
            } else {
                o.sets[o.n_sets++] = v;
            }
        } else {
            fprintf(stderr, "loom plugins: unexpected argument \"%s\"\nusage: loom plugins [--config CONFIG]\n", a);
            return LOOM_EXIT_USAGE;
        }
    }
    int status = LOOM_EXIT_OK;
    loom_spec *spec = o.config ? load(&o, &status) : NULL;
    loom_err err = {0};
    if (!spec && loom_plugins_load(NULL, &err)) { /* no config, or a bad one: still list what loads */
        loom_cli_print_err_(&err);
        return LOOM_EXIT_RUNTIME;
    }
    loom_plugins_report(stdout);
    loom_config_free(spec);
    return status;
}

static const command commands[] = {
    {"train", "train a model as the config says, resuming from the latest checkpoint",
     "loom train CONFIG [--model-dir DIR] [--set key.path=value ...] [--fresh]",
     "Trains until run.epochs (or run.max_steps), evaluating data.eval at each epoch end,\n"
     "writing checkpoints to the model directory and one JSON line per epoch to\n"
     "<model_dir>/metrics.jsonl. If the model directory holds checkpoints, training\n"
     "resumes exactly where the latest one left off; --fresh starts over instead.\n"
     "Ctrl-C (or SIGTERM) saves a checkpoint and stops (exit status 130, or 143); run the\n"
     "command again to resume.\n"
     "In a cluster, this process's task comes from --task, TF_CONFIG, Slurm or MPI (docs/cluster.md).\n"
     "--status-port N (run.status_port) serves /metrics (Prometheus), /healthz and /status (JSON)\n"
     "on run.status_bind (default 127.0.0.1) while training.\n",
     cmd_train, OPT_MODEL_DIR | OPT_SET | OPT_FRESH | OPT_TASK | OPT_STATUS_PORT, NULL},
    {"evaluate", "evaluate the latest checkpoint on data.eval",
     "loom evaluate CONFIG [--model-dir DIR] [--checkpoint FILE | --watch [--idle-timeout S]] [--set key.path=value ...]",
     "Prints one JSON line with eval_loss and eval_accuracy on stdout.\n"
     "--watch is the sidecar evaluator: it evaluates each new checkpoint of the model\n"
     "directory once (the newest first when it falls behind, skipping older ones), appends\n"
     "an \"eval\" line to metrics.jsonl and eval_watch/ summaries (eval/ for a cluster's\n"
     "evaluator task; one writer per directory) for each, prints its JSON line,\n"
     "and exits after the final checkpoint of the training run (named by final.json,\n"
     "which the chief writes when training ends). --idle-timeout S gives up after S\n"
     "seconds without a new checkpoint. A cluster's evaluator task does the same.\n", cmd_evaluate,
     OPT_MODEL_DIR | OPT_SET | OPT_CHECKPOINT | OPT_TASK | OPT_WATCH, NULL},
    {"predict", "write predictions (class and probabilities) as CSV",
     "loom predict CONFIG --output FILE [--input train|eval|FILE] [--id NAMES] [--model-dir DIR] [--checkpoint FILE]",
     "--input names a dataset of the config (\"eval\", the default, or \"train\"; read in order,\n"
     "without shuffle, repeat or random maps), an IDX file of inputs, or a new file read by the\n"
     "config's csv or tfrecord source (only the model input and the --id features: labels may\n"
     "be absent); files get the eval pipeline's maps of the model input. --id id,label copies\n"
     "those features beside each prediction. Columns: index, the --id features, then by loss:\n"
     "class,p0,p1,... (softmax cross-entropy; per token: class_0,...,class_<T-1>, then p<t>_<c>)\n"
     "or prediction (mean squared error).\n",
     cmd_predict, OPT_MODEL_DIR | OPT_SET | OPT_INPUT | OPT_OUTPUT | OPT_CHECKPOINT | OPT_ID, NULL},
    {"check", "validate a config, its data and its model without training",
     "loom check CONFIG [--print] [--gradcheck] [--task ROLE:I] [--set key.path=value ...]",
     "Reports unknown keys, wrong types, out-of-range values, missing files and shape or\n"
     "dtype mismatches between the pipeline and the model, then prints the plan.\n"
     "--print prints the fully resolved config with every default filled in instead.\n"
     "--gradcheck then checks every layer's backward against central differences (a table;\n"
     "exit 1 when a layer fails).\n"
     "With a cluster (the config's cluster section, TF_CONFIG, Slurm or MPI), prints every\n"
     "task, this process's task and where each came from; it opens no socket.\n",
     cmd_check, OPT_SET | OPT_PRINT | OPT_TASK, NULL},
    {"inspect", "verify a checkpoint and list its tensors", "loom inspect CHECKPOINT",
     "Checks every checksum of a checkpoint file and lists its tensors (name, shape,\n"
     "CRC-32C of the values) and blobs (trainer and iterator state). Two checkpoints\n"
     "with the same tensor lines hold bit-identical weights and optimizer slots.\n",
     cmd_inspect, 0, NULL},
    {"records", "convert IDX or CSV to TFRecord shards; count, verify, show records",
     "loom records convert|count|verify|head ...", "", NULL, 0, loom_cli_records_},
    {"plugins", "list the plugins loaded, what each provides, and the files refused and why",
     "loom plugins [--config CONFIG]", "", NULL, 0, cmd_plugins_main},
    {"devices", "list the devices a config can use (cpu:N, gpu:N) and why GPUs are not usable",
     "loom devices", "", NULL, 0, loom_cli_devices_},
    {"profile", "run the training input pipeline alone and report each stage and the bottleneck",
     "loom profile [--train] CONFIG [--steps N] [--input-pipeline ID/N]", "", NULL, 0, cmd_profile_main},
    {"generate", "sample text from a language model's checkpoint, streaming each token",
     "loom generate CONFIG --prompt TEXT [--max-tokens N] [--temperature T] [--top-k K] [--seed S]", "", NULL, 0,
     loom_cli_generate_},
    {"export", "write a trained model as ONNX (for onnxruntime) or its variables as npz (numpy)",
     "loom export CONFIG --format onnx|npz --output FILE", "", NULL, 0, cmd_export_main},
    {"launch", "start every task of a cluster on this machine and supervise them (--local)",
     "loom launch --local CONFIG [--workers N] [--ps N] [--evaluator] [--restarts K]", "", NULL, 0, loom_cli_launch_},
    /* hidden (no summary): the stand-in task of the launch tests */
    {"cluster-selftest", NULL, "loom cluster-selftest CONFIG --task ROLE:I [--set ...]", "", cmd_selftest,
     OPT_MODEL_DIR | OPT_SET | OPT_FRESH | OPT_TASK, NULL},
};
#define N_COMMANDS (int)(sizeof commands / sizeof commands[0])

static void usage(FILE *f)
{
    fprintf(f, "usage: loom COMMAND ARGS [options]   (most commands take a CONFIG file)\n\ncommands:\n");
    for (int i = 0; i < N_COMMANDS; i++)
        if (commands[i].summary) fprintf(f, "  %-9s %s\n", commands[i].name, commands[i].summary);
    fprintf(f,
            "\noptions:\n"
            "  --set key.path=value  override a config setting (commands that read a config;\n"
            "                        libconfig syntax; quotes optional for strings)\n"
            "  --quiet, --verbose    less or more logging\n"
            "  -h, --help            help (loom COMMAND --help for a command's)\n"
            "  --version             print the version\n"
            "  --cflags              compiler flags for building a plugin: -I<dir of loom_plugin.h>\n"
            "\nexit status: 0 success, 2 bad config or usage, 1 runtime failure\n"
            "config reference: docs/config.md\n");
}

static void command_help(const command *c)
{
    printf("usage: %s\n\n%s: %s.\n\n%s", c->usage, c->name, c->summary, c->help);
    printf("\noptions:\n");
    if (c->accepts & OPT_MODEL_DIR) printf("  --model-dir DIR       use DIR instead of run.model_dir\n");
    if (c->accepts & OPT_SET) printf("  --set key.path=value  override a config setting (repeatable)\n");
    if (c->accepts & OPT_FRESH) printf("  --fresh               ignore existing checkpoints and start from scratch\n");
    if (c->accepts & OPT_PRINT) printf("  --print               print the resolved config\n");
    if (c->accepts & OPT_PRINT) printf("  --gradcheck           check each layer's backward against central differences\n");
    if (c->accepts & OPT_INPUT)
        printf("  --input WHAT          train, eval (default), an IDX file, or a file for the config's csv/tfrecord "
               "source\n");
    if (c->accepts & OPT_ID) printf("  --id NAMES            features copied to the output beside each prediction (id,label)\n");
    if (c->accepts & OPT_OUTPUT) printf("  --output FILE         where to write the CSV (- for stdout)\n");
    if (c->accepts & OPT_CHECKPOINT) printf("  --checkpoint FILE     use this checkpoint instead of the latest\n");
    if (c->accepts & OPT_WATCH) printf("  --watch               evaluate each new checkpoint until training ends\n"
                                       "  --idle-timeout S      (--watch) give up after S s without a new checkpoint\n");
    if (c->accepts & OPT_TASK) printf("  --task ROLE:I         this process's task in the cluster, e.g. worker:1\n");
    if (c->accepts & OPT_STATUS_PORT) printf("  --status-port N       HTTP status endpoint on port N (run.status_port)\n");
}

/* Returns the option's value: "--opt value" or "--opt=value". */
static const char *opt_value(int argc, char **argv, int *i, const char *name, loom_err *err)
{
    size_t n = strlen(name);
    if (argv[*i][n] == '=') return argv[*i] + n + 1;
    if (*i + 1 >= argc) {
        loom_err_set(err, LOOM_EUSAGE, NULL, "%s needs a value", name);
        return NULL;
    }
    return argv[++*i];
}

static int is_opt(const char *arg, const char *name)
{
    size_t n = strlen(name);
    return !strncmp(arg, name, n) && (arg[n] == 0 || arg[n] == '=');
}

static int exit_status(int code)
{
    switch (code) {
    case LOOM_EOK: return LOOM_EXIT_OK;
    case LOOM_ECONFIG:
    case LOOM_EUSAGE:
    case LOOM_ESHAPE:
    case LOOM_EUNSUPPORTED: return LOOM_EXIT_USAGE;
    default: return LOOM_EXIT_RUNTIME;
    }
}

/* `loom --cflags`: -I of the directory holding loom_plugin.h, so a plugin
 * builds from anywhere: cc -shared -fPIC -O2 $(loom --cflags) op.c -o op.so.
 * Looked for beside an installed binary (<bin>/../include/loom), then where
 * this build installs headers, then in this build's source tree. */
static int print_cflags(void)
{
    char exe[LOOM_PATH_MAX], cand[LOOM_PATH_MAX + 32];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    const char *dirs = LOOM_PLUGIN_HEADER_DIRS;
    if (n > 0) {
        exe[n] = 0;
        char *slash = strrchr(exe, '/');
        if (slash) *slash = 0;
        snprintf(cand, sizeof cand, "%s/../include/loom/loom_plugin.h", exe);
        char real[PATH_MAX];
        if (realpath(cand, real)) {
            *strrchr(real, '/') = 0;
            printf("-I%s\n", real);
            return LOOM_EXIT_OK;
        }
    }
    for (const char *p = dirs; *p;) {
        size_t len = strcspn(p, ":");
        snprintf(cand, sizeof cand, "%.*s/loom_plugin.h", (int)len, p);
        if (access(cand, R_OK) == 0) {
            printf("-I%.*s\n", (int)len, p);
            return LOOM_EXIT_OK;
        }
        p += len + (p[len] == ':');
    }
    fprintf(stderr, "loom: loom_plugin.h is not installed beside this binary nor in %s\n"
                    "  hint: install loom (meson install), or pass -I<loom source>/plugins\n", dirs);
    return LOOM_EXIT_RUNTIME;
}

/* --status-port PORT: checked, then passed on as --set run.status_port=PORT.
 * -1 to go on, else the exit status of the usage error. */
static int status_port_arg(const command *cmd, const char *v, cli_opts *o)
{
    char *end;
    long port = strtol(v, &end, 10);
    if (!*v || *end || port < 1 || port > 65535) {
        fprintf(stderr, "loom %s: --status-port expects a port in [1, 65535], got \"%s\"\n", cmd->name, v);
        return LOOM_EXIT_USAGE;
    }
    if (o->n_sets == MAX_SETS) {
        fprintf(stderr, "loom: too many --set options (at most %d)\n", MAX_SETS);
        return LOOM_EXIT_USAGE;
    }
    snprintf(o->status_set, sizeof o->status_set, "run.status_port=%ld", port);
    o->sets[o->n_sets++] = o->status_set;
    return -1;
}

/* Argument *i of a command's argv (an option's value may take the next,
 * moving *i): -1 to go on, else the exit status (help printed, or the
 * usage error reported). */
static int parse_arg(const command *cmd, int argc, char **argv, int *i, cli_opts *o)
{
    loom_err err = {0};
    const char *a = argv[*i];
    const char *v = NULL;
    unsigned need = 0;
    if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
        command_help(cmd);
        return LOOM_EXIT_OK;
    } else if (!strcmp(a, "--quiet") || !strcmp(a, "-q")) {
        o->quiet = true;
    } else if (!strcmp(a, "--verbose") || !strcmp(a, "-v")) {
        o->verbose = true;
    } else if (is_opt(a, "--model-dir")) {
        need = OPT_MODEL_DIR;
        if ((v = opt_value(argc, argv, i, "--model-dir", &err)))
            o->model_dir = cwd_path(v, o->model_dir_abs, sizeof o->model_dir_abs);
    } else if (is_opt(a, "--set")) {
        need = OPT_SET;
        if ((v = opt_value(argc, argv, i, "--set", &err))) {
            if (o->n_sets == MAX_SETS) {
                fprintf(stderr, "loom: too many --set options (at most %d)\n", MAX_SETS);
                return LOOM_EXIT_USAGE;
            }
            if (!strchr(v, '=')) {
                fprintf(stderr, "loom: --set %s: expected key.path=value\n", v);
                return LOOM_EXIT_USAGE;
            }
            o->sets[o->n_sets++] = v;
        }
    } else if (!strcmp(a, "--fresh")) {
        need = OPT_FRESH;
        o->fresh = true;
    } else if (!strcmp(a, "--print")) {
        need = OPT_PRINT;
        o->print = true;
    } else if (!strcmp(a, "--gradcheck")) {
        need = OPT_PRINT; /* loom check's */
        o->gradcheck = true;
    } else if (is_opt(a, "--input")) {
        need = OPT_INPUT;
        if ((v = opt_value(argc, argv, i, "--input", &err))) o->input = v;
    } else if (is_opt(a, "--id")) {
        need = OPT_ID;
        if ((v = opt_value(argc, argv, i, "--id", &err))) o->id = v;
    } else if (is_opt(a, "--output")) {
        need = OPT_OUTPUT;
        if ((v = opt_value(argc, argv, i, "--output", &err))) o->output = v;
    } else if (is_opt(a, "--task")) {
        need = OPT_TASK;
        if ((v = opt_value(argc, argv, i, "--task", &err))) o->task = v;
    } else if (is_opt(a, "--status-port")) {
        need = OPT_STATUS_PORT;
        if ((v = opt_value(argc, argv, i, "--status-port", &err))) {
            int rc = status_port_arg(cmd, v, o);
            if (rc >= 0) return rc;
        }
    } else if (!strcmp(a, "--watch")) {
        need = OPT_WATCH;
        o->watch = true;
    } else if (is_opt(a, "--idle-timeout")) {
        need = OPT_WATCH;
        if ((v = opt_value(argc, argv, i, "--idle-timeout", &err))) {
            char *end;
            o->idle_timeout = strtod(v, &end);
            if (!*v || *end || !(o->idle_timeout > 0)) {
                fprintf(stderr, "loom %s: --idle-timeout expects seconds > 0, got \"%s\"\n", cmd->name, v);
                return LOOM_EXIT_USAGE;
            }
        }
    } else if (is_opt(a, "--checkpoint")) {
        need = OPT_CHECKPOINT;
        if ((v = opt_value(argc, argv, i, "--checkpoint", &err))) o->checkpoint = v;
    } else if (a[0] == '-' && a[1]) {
        fprintf(stderr, "loom %s: unknown option %s\nusage: %s\n", cmd->name, a, cmd->usage);
        return LOOM_EXIT_USAGE;
    } else if (!o->config) {
        o->config = a;
    } else {
        fprintf(stderr, "loom %s: unexpected argument \"%s\"\nusage: %s\n", cmd->name, a, cmd->usage);
        return LOOM_EXIT_USAGE;
    }
    if (err.code) {
        fprintf(stderr, "loom %s: %s\n", cmd->name, err.msg);
        return LOOM_EXIT_USAGE;
    }
    if (need && !(cmd->accepts & need)) {
        fprintf(stderr, "loom %s: option %s does not apply to this command\nusage: %s\n", cmd->name, a, cmd->usage);
        return LOOM_EXIT_USAGE;
    }
    return -1;
}

int loom_cli_main(int argc, char **argv, double start_time)
{
    if (argc < 2) {
        usage(stderr);
        return LOOM_EXIT_USAGE;
    }
    if (!strcmp(argv[1], "--version") || !strcmp(argv[1], "version")) {
        printf("loom %s\n", LOOM_VERSION);
        return LOOM_EXIT_OK;
    }
    if (!strcmp(argv[1], "--cflags")) return print_cflags();
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return LOOM_EXIT_OK;
    }
    const command *cmd = NULL;
    for (int i = 0; i < N_COMMANDS; i++)
        if (!strcmp(argv[1], commands[i].name)) cmd = &commands[i];
    if (!cmd) {
        const char *best = NULL;
        int bd = 3;
        for (int i = 0; i < N_COMMANDS; i++) {
            int d = loom_edit_distance(argv[1], commands[i].name);
            if (d < bd) bd = d, best = commands[i].name;
        }
        fprintf(stderr, "loom: unknown command \"%s\"%s%s%s\n", argv[1], best ? " (did you mean \"" : "",
                best ? best : "", best ? "\"?)" : "");
        usage(stderr);
        return LOOM_EXIT_USAGE;
    }
    if (cmd->main) return cmd->main(argc - 1, argv + 1, start_time);
    cli_opts o = {0};
    loom_err err = {0};
    for (int i = 2; i < argc; i++) {
        int status = parse_arg(cmd, argc, argv, &i, &o);
        if (status >= 0) return status;
    }
    if (!o.config) {
        fprintf(stderr, "loom %s: missing %s\nusage: %s\n", cmd->name, cmd->run == cmd_inspect ? "CHECKPOINT" : "CONFIG",
                cmd->usage);
        return LOOM_EXIT_USAGE;
    }
    if (o.quiet) loom_log_set_level(LOOM_LOG_WARN);
    if (o.verbose) loom_log_set_level(LOOM_LOG_DEBUG);
    int rc = cmd->run(&o, start_time, &err);
    if (rc < 0) return -rc; /* the config did not load; already reported */
    if (rc) loom_cli_print_err_(&err);
    if (rc && loom_stop_signal()) return 128 + loom_stop_signal(); /* stopped by SIGINT (130) or SIGTERM (143), saved */
    return exit_status(rc);
}

/* For the commands in the module's other files (cli.h). */
loom_spec *loom_cli_load_(const char *config, const char *const *sets, int n_sets, bool training, int *status)
{
    cli_opts o = {.config = config, .n_sets = n_sets < MAX_SETS ? n_sets : MAX_SETS};
    for (int i = 0; i < o.n_sets; i++) o.sets[i] = sets[i];
    return load_as(&o, status, training);
}

int loom_cli_adapt_(loom_spec *spec, const char *model_dir, loom_adapt_mode mode, const char *checkpoint, loom_err *err)
{
    return adapt(spec, model_dir, mode, checkpoint, err);
}

int loom_cli_exit_status_(int code) { return exit_status(code); }

const char *loom_cli_cwd_path_(const char *v, char *buf, size_t n) { return cwd_path(v, buf, n); }
