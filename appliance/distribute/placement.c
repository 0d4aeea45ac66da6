/* placement.c - which device backend runs a strategy's replicas, and on
 * which devices: strategy.device(s) and strategy.device_backend resolved
 * against the backends registered now (after plugins are loaded), with
 * config errors at the settings' file:line. */
#include "placement_internal.h"

#include <stdio.h>
#include <string.h>

/* "path: " for messages located at loc, unless "--set path" names it already. */
static const char *setting_of(const loom_loc *loc, char *where, size_t wn, char *buf, size_t n)
{
    loom_loc_str(loc, where, wn);
    buf[0] = '\0';
    if (strncmp(where, "--set ", 6)) snprintf(buf, n, "%s: ", loc->path);
    return buf;
}

/* The backend named by strategy.device_backend; unknown names list the known ones. */
static int find_backend(const loom_strategy_spec *st, const char *name, const loom_device_ops **out, loom_err *err)
{
    if (!strcmp(name, "cpu")) {
        *out = loom_device_cpu();
        return LOOM_OK;
    }
    if ((*out = loom_device_backend(name))) return LOOM_OK;
    char w[600], set[160], names[256];
    setting_of(&st->device_backend_loc, w, sizeof w, set, sizeof set);
    loom_registry_names(LOOM_REG_DEVICE, names, sizeof names);
    loom_err_set(err, LOOM_ECONFIG, w, "%sunknown device backend \"%s\" (available: cpu%s%s)", set, name,
                 names[0] ? ", " : "", names);
    const char *known, *best = loom_edit_distance(name, "cpu") < 2 ? "cpu" : NULL;
    for (int i = 0; loom_registry_entry(LOOM_REG_DEVICE, i, &known, NULL, NULL) == 0; i++)
        if (loom_edit_distance(name, known) < 3) best = known;
    if (best) return loom_err_hint(err, "did you mean \"%s\"?", best);
    return loom_err_hint(err, "\"\" runs cpu devices natively and gpu devices on cuda; \"cpu\" runs them through "
                         "the CPU reference backend; a GPU backend is available once its plugin is loaded");
}

/* The usable GPUs of backend ops (NULL: cuda, not loaded): with cuda, why
 * names what is missing (plugin, driver or device). */
static int count_gpus(const loom_device_ops *ops, char *why, size_t n)
{
    if (!ops || ops == loom_device_backend("cuda")) return loom_device_gpus(why, n);
    int k = ops->probe(why, n);
    return k > 0 ? k : 0;
}

static int place_gpus(const char (*devices)[16], int n, const loom_loc *loc, loom_placement_ *p, loom_err *err)
{
    char w[600], set[160], why[600] = "";
    setting_of(loc, w, sizeof w, set, sizeof set);
    int gpus = count_gpus(p->ops, why, sizeof why);
    if (gpus == 0)
        return loom_err_set(err, LOOM_ECONFIG, w, "%sdevice \"%s\" is not usable: %s", set, devices[0],
                            why[0] ? why : "the backend found no device"),
               loom_err_hint(err, "`loom devices` lists what this machine can use; build the cuda plugin where "
                             "the CUDA toolkit is installed and run where a GPU and its driver are, or use "
                             "devices = [\"cpu:0\", \"cpu:1\"]; (one_device: device = \"cpu:0\")");
    if (!strcmp(devices[0], "gpu:*")) {
        p->n = gpus < LOOM_MAX_DEVICES ? gpus : LOOM_MAX_DEVICES;
        for (int i = 0; i < p->n; i++) p->index[i] = i;
        return LOOM_OK;
    }
    p->n = n;
    for (int i = 0; i < n; i++) {
        unsigned idx = 0;
        sscanf(devices[i], "gpu:%u", &idx);
        if ((int)idx >= gpus)
            return loom_err_set(err, LOOM_ECONFIG, w, "%sdevice \"%s\" does not exist: this machine has gpu:0 to "
                                "gpu:%d", set, devices[i], gpus - 1),
                   loom_err_hint(err, "`loom devices` lists them; or use \"gpu:*\" for every GPU");
        p->index[i] = (int)idx;
    }
    return LOOM_OK;
}

int loom_place_devices_(const loom_strategy_spec *st, const char (*devices)[16], int n, const loom_loc *loc,
                        const loom_model_spec *ms, loom_placement_ *p, loom_err *err)
{
    memset(p, 0, sizeof *p);
    p->gpu = n > 0 && devices[0][0] == 'g';
    const char *name = st->device_backend[0] ? st->device_backend : p->gpu ? "cuda" : "";
    if (!name[0]) return LOOM_OK; /* cpu devices, nn's own host code */
    int mrc = loom_model_spec_dev_check(ms, name, err);
    if (mrc) return mrc;
    if (!st->device_backend[0]) { /* gpu devices on cuda: "not usable" says what is missing */
        p->ops = loom_device_backend("cuda");
        return place_gpus(devices, n, loc, p, err);
    }
    int rc = find_backend(st, name, &p->ops, err);
    if (rc) return rc;
    char w[600], set[160];
    setting_of(&st->device_backend_loc, w, sizeof w, set, sizeof set);
    if (p->gpu && p->ops == loom_device_cpu())
        return loom_err_set(err, LOOM_ECONFIG, w, "%sthe cpu backend runs cpu devices, not \"%s\"", set, devices[0]),
               loom_err_hint(err, "to test the device path here list cpu devices (devices = [\"cpu:0\", \"cpu:1\"]); "
                             "gpu devices run on cuda (device_backend = \"\")");
    if (!p->gpu && p->ops != loom_device_cpu())
        return loom_err_set(err, LOOM_ECONFIG, w, "%sthe \"%s\" backend runs gpu devices; the replicas are on cpu "
                            "devices", set, name),
               loom_err_hint(err, "list gpu devices (\"gpu:0\", \"gpu:*\"), or use device_backend = \"cpu\" or \"\"");
    return p->gpu ? place_gpus(devices, n, loc, p, err) : LOOM_OK;
}

int loom_place_index_(const loom_placement_ *p, int r) { return p->gpu ? p->index[r] : 0; }

const char *loom_place_describe_(const loom_placement_ *p, char *buf, size_t n)
{
    if (!p->ops)
        snprintf(buf, n, "nn's native host code (device_backend \"\")");
    else if (p->ops == loom_device_cpu())
        snprintf(buf, n, "the \"cpu\" device backend (the reference; parameters and gradients copied each step)");
    else
        snprintf(buf, n, "the \"%s\" device backend (master variables and optimizer on the host: gradients "
                 "downloaded, parameters uploaded each step)", p->ops->name);
    return buf;
}
