/* devices.c - `loom devices`: what strategy.devices can name on this
 * machine, and for GPUs what is missing when they cannot be used (the
 * plugin not built or refused, no driver, no device), with the library
 * versions the plugins found; then the cross-device ops and the memory each
 * works on. Reads the plugin records and the registry; starts nothing on a
 * device. */
#include "cli/cli.h"
#include "distribute/distribute.h"
#include "plugin/plugin.h"
#include "tensor/tensor.h"

#include <string.h>

/* The record of the plugin file named <name>.so, loaded or refused; NULL if none was seen. */
static const loom_plugin_record *record_of(const char *name)
{
    char file[64];
    snprintf(file, sizeof file, "/%s.so", name);
    const loom_plugin_record *found = NULL, *r;
    for (int i = 0; (r = loom_plugin_record_at(i)); i++) {
        size_t n = strlen(r->path), k = strlen(file);
        if (n >= k && !strcmp(r->path + n - k, file) && (!found || r->loaded)) found = r;
    }
    return found;
}

/* Why a plugin that provides nothing usable is absent: refused (and why) or never found. */
static void print_absent(FILE *f, const char *name, const char *what)
{
    const loom_plugin_record *r = record_of(name);
    if (r && !r->loaded)
        fprintf(f, "  %-6s refused: %s: %s\n", name, r->path, r->why.msg);
    else
        fprintf(f,
                "  %-6s not loaded: no %s.so in the plugin directories (%s is built only where the CUDA toolkit "
                "is found; see `loom plugins`)\n",
                name, name, what);
}

static void print_gpus(FILE *f)
{
    const char *origin = NULL;
    const loom_device_ops *cuda = loom_registry_find(LOOM_REG_DEVICE, "cuda", &origin);
    int n = 0; /* usable GPUs */
    char line[400], why[400];
    if (!cuda) {
        print_absent(f, "cuda", "the cuda plugin");
        if (loom_device_gpus(why, sizeof why) == 0) fprintf(f, "         gpu: none usable: %s\n", why);
    } else {
        cuda->describe(-1, line, sizeof line);
        fprintf(f, "  cuda   loaded: %s (%s)\n", origin, line);
        n = cuda->probe(why, sizeof why);
        if (n == 0) fprintf(f, "         gpu: none usable: %s\n", why);
        for (int i = 0; i < n; i++) {
            cuda->describe(i, line, sizeof line);
            fprintf(f, "         gpu:%d  %s\n", i, line);
        }
    }
    const char *xorigin = NULL;
    if (!loom_registry_find(LOOM_REG_CROSS_DEVICE_OPS, "nccl", &xorigin)) {
        print_absent(f, "nccl", "the nccl plugin, which also needs libnccl and nccl.h,");
        return;
    }
    const loom_plugin_record *r = record_of("nccl");
    fprintf(f, "  nccl   loaded: %s (%s)%s\n", xorigin, r ? r->description : "",
            n ? "" : "; collectives report the missing device");
}

/* Every cross-device op with the memory it reduces: replicas run natively
 * on the CPU need one that works on host memory (strategy.cross_device_ops
 * is checked so); replicas on a device backend take either, downloading
 * their gradients first for an op of host memory. */
static void print_xops(FILE *f)
{
    fprintf(f, "cross-device ops (strategy.cross_device_ops), by the memory they work on:\n");
    const char *name, *origin;
    const void *x;
    for (int i = 0; loom_registry_entry(LOOM_REG_CROSS_DEVICE_OPS, i, &name, &x, &origin) == 0; i++) {
        unsigned m = loom_xops_memory(x);
        const char *mem = !((const loom_cross_device_ops *)x)->all_reduce ? "across processes: communication"
                          : m == (LOOM_XOPS_HOST_MEM | LOOM_XOPS_DEVICE_MEM) ? "host or device memory: any replicas"
                          : m & LOOM_XOPS_DEVICE_MEM ? "device memory: device replicas"
                                                     : "host memory: any replicas";
        fprintf(f, "  %-22s %-35s %s\n", name, mem, origin);
    }
}

int loom_cli_devices_(int argc, char **argv, double start_time)
{
    (void)start_time;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            printf("usage: loom devices\n\n"
                   "Lists the devices strategy.devices can name: cpu:0 to cpu:N-1 (one per core), and\n"
                   "gpu:N when the cuda plugin is loaded and finds a driver and a GPU; otherwise it says\n"
                   "which of them is missing; then the cross-device ops and the memory each works on\n"
                   "(host memory for CPU replicas, GPU memory for GPU replicas). Plugins load as for\n"
                   "`loom plugins` ($LOOM_PLUGIN_PATH).\n");
            return LOOM_EXIT_OK;
        }
        fprintf(stderr, "loom devices: unexpected argument \"%s\"\nusage: loom devices\n", argv[i]);
        return LOOM_EXIT_USAGE;
    }
    loom_err err = {0};
    if (loom_plugins_load(NULL, &err)) {
        loom_cli_print_err_(&err);
        return LOOM_EXIT_RUNTIME;
    }
    loom_blas_init(0, &err); /* only so the line below names the BLAS kernel; failure shows as "not loaded" */
    char line[400];
    loom_device_cpu()->describe(0, line, sizeof line);
    int cores = loom_num_cores();
    printf("cpu:0 to cpu:%d  usable (%s)\n", cores - 1, line);
    printf("  cpu: %s\n", loom_cpu_describe(line, sizeof line));
    printf("  BLAS core: %s (%s); calls split at multiples of %d rows\n", loom_blas_core(), loom_blas_core_reason(),
           loom_blas_row_quantum());
    printf("gpu backends:\n");
    print_gpus(stdout);
    print_xops(stdout);
    return LOOM_EXIT_OK;
}
