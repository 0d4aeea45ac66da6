/* cli.h - the command line: parsing, help, dispatch. Only main.c prints
 * errors and chooses the exit status. */
#ifndef LOOM_CLI_H
#define LOOM_CLI_H

#include "train/train.h"

/* Exit statuses. */
enum { LOOM_EXIT_OK = 0, LOOM_EXIT_RUNTIME = 1, LOOM_EXIT_USAGE = 2 };

/* Runs `loom argv...`; returns the exit status. start_time is loom_now() at
 * process start. */
int loom_cli_main(int argc, char **argv, double start_time);

/* Internal to the cli module: commands.c prints an error as "loom: where:
 * msg" (+ "  hint: ...") on stderr, and every error of a list (saying when
 * the list stopped at LOOM_MAX_ERRORS). */
void loom_cli_print_err_(const loom_err *err);
void loom_cli_print_errlist_(const loom_errlist *l);

/* Internal to the cli module (records.c): `loom records ...`, with argv[0]
 * = "records"; prints its own output and errors, returns the exit status. */
int loom_cli_records_(int argc, char **argv, double start_time);

/* devices.c: `loom devices`: the devices a config can name, and why GPUs cannot be used. */
int loom_cli_devices_(int argc, char **argv, double start_time);

/* launch.c: `loom launch --local CONFIG ...` (argv[0] = "launch"): starts,
 * supervises and restarts every task of a cluster on this machine. */
int loom_cli_launch_(int argc, char **argv, double start_time);
/* launch.c: the hidden `loom cluster-selftest` task launch's tests start
 * instead of `loom train`; c is this process's resolved cluster (NULL = none). */
struct loom_cluster;
int loom_cli_selftest_(const struct loom_cluster *c, const char *model_dir, bool fresh);

/* commands.c, for the commands of the module's other files: the config
 * with its plugins loaded (NULL: every problem printed, *status the exit
 * status; training: loom_config_check_training too); adapt maps' numbers
 * as the commands get them (those of the checkpoint used when it holds
 * them); the exit status of an error code; a command-line path made
 * absolute into buf. */
#define LOOM_CLI_MAX_SETS 64
loom_spec  *loom_cli_load_(const char *config, const char *const *sets, int n_sets, bool training, int *status);
int         loom_cli_adapt_(loom_spec *spec, const char *model_dir, loom_adapt_mode mode, const char *checkpoint,
                            loom_err *err);
int         loom_cli_exit_status_(int code);
const char *loom_cli_cwd_path_(const char *v, char *buf, size_t n);

/* generate.c: `loom generate CONFIG --prompt TEXT ...` (argv[0] = "generate"). */
int loom_cli_generate_(int argc, char **argv, double start_time);

#endif
