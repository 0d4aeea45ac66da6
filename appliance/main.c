/* main.c - loom's entry point. The soft descriptor limit goes up to the
 * hard limit first: a task that listens (the cluster port, the status
 * endpoint) keeps its connection bounds far below it (docs/cluster-transport.md). */
#include "cli/cli.h"

int main(int argc, char **argv)
{
    double start = loom_now();
    loom_fd_limit_raise();
    return loom_cli_main(argc, argv, start);
}
