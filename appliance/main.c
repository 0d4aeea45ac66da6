/* main.c - loom's entry point. */
#include "cli/cli.h"

int main(int argc, char **argv)
{
    double start = loom_now();
    return loom_cli_main(argc, argv, start);
}
