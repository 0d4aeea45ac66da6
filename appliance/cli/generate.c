/* generate.c - `loom generate CONFIG --prompt TEXT [--max-tokens N]
 * [--temperature T] [--top-k K] [--seed S] [--checkpoint FILE] [--model-dir
 * DIR] [--set key.path=value ...]`: the options, then train.h loom_generate.
 * The text goes to stdout, everything else to stderr. */
#include "cli.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char usage_line[] =
    "usage: loom generate CONFIG --prompt TEXT [--max-tokens N] [--temperature T] [--top-k K] [--seed S]\n"
    "                     [--samples N] [--checkpoint FILE] [--model-dir DIR] [--set key.path=value ...]\n";

static void help(void)
{
    printf("%s\n"
           "Continues TEXT with a language model trained from CONFIG: the latest checkpoint of its model\n"
           "directory (or --checkpoint FILE), the prompt tokenised by data.train's tokenize map with the\n"
           "vocabulary adapted at training. Tokens are drawn one at a time and written to stdout as they\n"
           "come (flushed), then a newline; prompt tokens outside the vocabulary map to the out-of-\n"
           "vocabulary id, and stderr says how many. The model reads token ids (T,) (an embedding first)\n"
           "and outputs vocabulary logits, (V,) for the next token or (T, V) for each position.\n"
           "  --max-tokens N      tokens to draw (default 200)\n"
           "  --temperature T     a draw from softmax(logits / T) (default 1); 0: greedy, the most likely\n"
           "                      token each time\n"
           "  --top-k K           draw among the K most likely tokens only (default 0: all)\n"
           "  --seed S            the sampler's seed (default run.seed): the same seed gives the same text\n"
           "  --samples N         N continuations of the prompt (default 1), one a line\n"
           "  --checkpoint FILE   use this checkpoint instead of the latest\n"
           "  --model-dir DIR     use DIR instead of run.model_dir\n"
           "  --generic           run the whole window per token even where the model can run one\n"
           "                      position at a time from a state (an LSTM's, attention's keys and values)\n"
           "  --set key.path=value  override a config setting (repeatable)\n",
           usage_line);
}

static bool num_arg(const char *name, const char *v, double lo, double hi, double *out)
{
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (!*v || *end || errno || !isfinite(x) || x < lo || x > hi) {
        fprintf(stderr, "loom generate: %s expects a number in [%g, %g], got \"%s\"\n", name, lo, hi, v);
        return false;
    }
    *out = x;
    return true;
}

static bool int_arg(const char *name, const char *v, long long lo, long long hi, long long *out)
{
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (!*v || *end || errno || x < lo || x > hi) {
        fprintf(stderr, "loom generate: %s expects an integer in [%lld, %lld], got \"%s\"\n", name, lo, hi, v);
        return false;
    }
    *out = x;
    return true;
}

typedef struct gen_args {
    const char *config;
    const char *sets[LOOM_CLI_MAX_SETS];
    int         n_sets;
    bool        seed_set;
    char        dir_abs[PATH_MAX];
    loom_generate_opts go;
} gen_args;

/* One option at argv[*i] with its value; false: reported. */
static bool parse_opt(gen_args *g, int argc, char **argv, int *i)
{
    const char *a = argv[*i];
    if (*i + 1 >= argc) {
        fprintf(stderr, "loom generate: %s needs a value\n%s", a, usage_line);
        return false;
    }
    const char *v = argv[++*i];
    long long n;
    if (!strcmp(a, "--prompt")) g->go.prompt = v;
    else if (!strcmp(a, "--checkpoint")) g->go.checkpoint = v;
    else if (!strcmp(a, "--model-dir")) g->go.model_dir = loom_cli_cwd_path_(v, g->dir_abs, sizeof g->dir_abs);
    else if (!strcmp(a, "--temperature")) return num_arg(a, v, 0, 1e6, &g->go.temperature);
    else if (!strcmp(a, "--max-tokens")) {
        if (!int_arg(a, v, 0, 100000000, &n)) return false;
        g->go.max_tokens = n;
    } else if (!strcmp(a, "--top-k")) {
        if (!int_arg(a, v, 0, 1 << 24, &n)) return false;
        g->go.top_k = n;
    } else if (!strcmp(a, "--samples")) {
        if (!int_arg(a, v, 1, 1000000, &n)) return false;
        g->go.samples = n;
    } else if (!strcmp(a, "--seed")) {
        if (!int_arg(a, v, 0, LLONG_MAX, &n)) return false;
        g->go.seed = (uint64_t)n, g->seed_set = true;
    } else if (g->n_sets == LOOM_CLI_MAX_SETS || !strchr(v, '=')) {
        fprintf(stderr, "loom generate: bad --set %s (key.path=value, at most %d)\n", v, LOOM_CLI_MAX_SETS);
        return false;
    } else g->sets[g->n_sets++] = v;
    return true;
}

static const char *const value_opts[] = {"--prompt", "--checkpoint", "--model-dir", "--temperature", "--max-tokens",
                                         "--top-k", "--seed", "--samples", "--set", NULL};

int loom_cli_generate_(int argc, char **argv, double start_time)
{
    (void)start_time;
    gen_args g = {.go = {.max_tokens = 200, .temperature = 1.0}};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool takes = false;
        for (int k = 0; value_opts[k]; k++) takes |= !strcmp(a, value_opts[k]);
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            help();
            return LOOM_EXIT_OK;
        } else if (!strcmp(a, "--quiet") || !strcmp(a, "-q")) {
            loom_log_set_level(LOOM_LOG_WARN);
        } else if (!strcmp(a, "--generic")) {
            g.go.generic = true;
        } else if (takes) {
            if (!parse_opt(&g, argc, argv, &i)) return LOOM_EXIT_USAGE;
        } else if (a[0] != '-' && !g.config) {
            g.config = a;
        } else {
            fprintf(stderr, "loom generate: unexpected argument \"%s\"\n%s", a, usage_line);
            return LOOM_EXIT_USAGE;
        }
    }
    if (!g.config || !g.go.prompt) {
        fprintf(stderr, "loom generate: missing %s\n%s", !g.config ? "CONFIG" : "--prompt TEXT", usage_line);
        return LOOM_EXIT_USAGE;
    }
    int status = 0;
    loom_spec *spec = loom_cli_load_(g.config, g.sets, g.n_sets, true, &status);
    if (!spec) return status;
    if (!g.seed_set) g.go.seed = spec->run.seed;
    loom_err err = {0};
    int rc = loom_cli_adapt_(spec, g.go.model_dir, LOOM_ADAPT_LOAD, g.go.checkpoint, &err);
    if (!rc) rc = loom_generate(spec, &g.go, &err);
    loom_config_free(spec);
    if (rc) loom_cli_print_err_(&err);
    return loom_cli_exit_status_(rc);
}
