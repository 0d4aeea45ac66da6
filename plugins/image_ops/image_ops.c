/* image_ops.c - a plugin providing a transform provider "image_ops" and the
 * dataset source "npy" (npy.c): image augmentation in C for map/filter,
 * and NumPy .npy arrays as a dataset.
 *
 *   { op = "map"; plugin = "image_ops:cutout"; args: { feature = "image"; size = 8; }; }
 *   { op = "map"; plugin = "image_ops:gaussian_noise"; args: { feature = "image"; std = 0.1; }; }
 *   { op = "filter"; plugin = "image_ops:min_std"; args: { feature = "image"; min = 1.0; }; }
 *
 * cutout (DeVries & Taylor 2017): a size x size square centred at a uniform
 * pixel (clipped at the border) is set to `value` (default 0) in every
 * channel, with probability p (default 1). gaussian_noise adds N(0, std)
 * to every value of a float32 feature. min_std keeps an element whose
 * feature's standard deviation is at least min (drops blank images).
 * The maps take one unbatched image, (H, W) or (H, W, C), uint8 or float32,
 * and pass the other features through. Randomness comes from the call's
 * key alone (host->rng_mix), so results do not depend on threads, parallel
 * maps or the resume point. */
#include "image_ops.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

const loom_host *img_host;

enum { F_CUTOUT, F_NOISE, F_MIN_STD };

typedef struct img_fn {
    int    fn;
    int    feature; /* index in the input element */
    int    size;    /* cutout */
    double p, value, std, min;
} img_fn;

/* ---- options ---------------------------------------------------------------- */

/* The value of args KEY parsed as a number in [lo, hi] into *out (unchanged when absent). */
static int arg_num(const loom_options *o, const char *key, double lo, double hi, double *out, loom_err *err)
{
    for (int i = 0; i < o->n; i++) {
        if (strcmp(o->key[i], key)) continue;
        char *end;
        double v = strtod(o->value[i], &end);
        if (end == o->value[i] || *end || !(v >= lo && v <= hi))
            return img_host->err_set(err, LOOM_ECONFIG, o->where[i], "args.%s: expected a number in [%g, %g], got \"%s\"",
                                     key, lo, hi, o->value[i]);
        *out = v;
    }
    return LOOM_EOK;
}

/* Every key of o must be one of valid (NULL-terminated). */
static int known_args(const loom_options *o, const char *const *valid, const char *fn, loom_err *err)
{
    for (int i = 0; i < o->n; i++) {
        int ok = 0;
        for (int j = 0; valid[j]; j++) ok |= !strcmp(valid[j], o->key[i]);
        if (ok) continue;
        char list[128] = "";
        for (int j = 0; valid[j]; j++) strncat(list, j ? ", " : "", sizeof list - strlen(list) - 1),
                                        strncat(list, valid[j], sizeof list - strlen(list) - 1);
        return img_host->err_set(err, LOOM_ECONFIG, o->where[i], "args.%s: unknown argument of image_ops:%s (valid: %s)",
                                 o->key[i], fn, list);
    }
    return LOOM_EOK;
}

/* The feature named by args.feature (default "image"): an image (H, W[, C]), uint8 or float32. */
static int find_feature(const loom_custom_args *a, img_fn *f, loom_err *err)
{
    const char *name = "image", *where = a->where;
    for (int i = 0; i < a->args->n; i++)
        if (!strcmp(a->args->key[i], "feature")) name = a->args->value[i], where = a->args->where[i];
    f->feature = -1;
    for (int i = 0; i < a->in->n; i++)
        if (!strcmp(a->in->name[i], name)) f->feature = i;
    if (f->feature < 0) return img_host->err_set(err, LOOM_ECONFIG, where, "image_ops:%s: the element has no feature \"%s\"", a->ref, name);
    const loom_shape *s = &a->in->shape[f->feature];
    loom_dtype dt = a->in->dtype[f->feature];
    if (s->rank < 2 || s->rank > 3 || (dt != LOOM_U8 && dt != LOOM_F32) || (f->fn == F_NOISE && dt != LOOM_F32))
        return img_host->err_set(err, LOOM_ECONFIG, where,
                                 "image_ops:%s: feature \"%s\" must be one unbatched image (H, W) or (H, W, C) of %s", a->ref,
                                 name, f->fn == F_NOISE ? "float32" : "uint8 or float32");
    for (int d = 0; d < s->rank; d++)
        if (s->dim[d] < 0)
            return img_host->err_set(err, LOOM_ECONFIG, where, "image_ops:%s: feature \"%s\" has a varying shape", a->ref, name);
    return LOOM_EOK;
}

static int img_open(void **inst, const loom_custom_args *a, loom_elem_spec *out, loom_shape *out_max, loom_err *err)
{
    static const char *const cutout_args[] = {"feature", "size", "p", "value", NULL};
    static const char *const noise_args[] = {"feature", "std", NULL};
    static const char *const min_std_args[] = {"feature", "min", NULL};
    img_fn f = {.size = 8, .p = 1.0, .std = 0.1};
    const char *const *valid;
    if (!strcmp(a->ref, "cutout") && !a->filter) f.fn = F_CUTOUT, valid = cutout_args;
    else if (!strcmp(a->ref, "gaussian_noise") && !a->filter) f.fn = F_NOISE, valid = noise_args;
    else if (!strcmp(a->ref, "min_std") && a->filter) f.fn = F_MIN_STD, valid = min_std_args;
    else
        return img_host->err_set(err, LOOM_ECONFIG, a->where, "image_ops has no %s function \"%s\" (%s)",
                                 a->filter ? "filter" : "map", a->ref, a->filter ? "filters: min_std" : "maps: cutout, gaussian_noise");
    double size = f.size;
    int rc = known_args(a->args, valid, a->ref, err);
    if (!rc) rc = arg_num(a->args, "size", 1, 1 << 20, &size, err);
    if (!rc) rc = arg_num(a->args, "p", 0, 1, &f.p, err);
    if (!rc) rc = arg_num(a->args, "value", -1e30, 1e30, &f.value, err);
    if (!rc) rc = arg_num(a->args, "std", 0, 1e30, &f.std, err);
    if (!rc) rc = arg_num(a->args, "min", 0, 1e30, &f.min, err);
    if (!rc) rc = find_feature(a, &f, err);
    if (rc) return rc;
    f.size = (int)size;
    if (!a->filter) { /* the maps return what they get */
        *out = *a->in;
        memcpy(out_max, a->in_max, sizeof(loom_shape) * (size_t)a->in->n);
    }
    img_fn *p = img_host->alloc(sizeof *p);
    if (!p) return img_host->err_set(err, LOOM_ENOMEM, NULL, "out of memory");
    *p = f;
    *inst = p;
    return LOOM_EOK;
}

/* ---- the functions -------------------------------------------------------------- */

/* The call's random stream: splitmix64 from the key alone. */
static uint64_t next_u64(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static double uniform(uint64_t *s) { return (double)(next_u64(s) >> 11) * 0x1.0p-53; }

static uint64_t key_state(const loom_custom_key *k)
{
    uint64_t s = img_host->rng_mix(k->seed, 0x696d6167655f6f70ull); /* "image_op" */
    s = img_host->rng_mix(s, (uint64_t)k->stage);
    s = img_host->rng_mix(s, (uint64_t)k->epoch);
    return img_host->rng_mix(s, (uint64_t)k->index);
}

static size_t nbytes(const loom_tensor *t)
{
    size_t n = t->dtype == LOOM_U8 ? 1 : t->dtype == LOOM_I32 || t->dtype == LOOM_F32 ? 4 : 8;
    for (int d = 0; d < t->shape.rank; d++) n *= (size_t)t->shape.dim[d];
    return n;
}

static void cutout(const img_fn *f, loom_tensor *t, uint64_t *rng)
{
    int64_t H = t->shape.dim[0], W = t->shape.dim[1], C = t->shape.rank == 3 ? t->shape.dim[2] : 1;
    if (uniform(rng) >= f->p) return;
    int64_t cy = (int64_t)(uniform(rng) * (double)H), cx = (int64_t)(uniform(rng) * (double)W);
    int64_t y0 = cy - f->size / 2, x0 = cx - f->size / 2, y1 = y0 + f->size, x1 = x0 + f->size;
    y0 = y0 < 0 ? 0 : y0, x0 = x0 < 0 ? 0 : x0, y1 = y1 > H ? H : y1, x1 = x1 > W ? W : x1;
    uint8_t v8 = (uint8_t)(f->value < 0 ? 0 : f->value > 255 ? 255 : f->value);
    for (int64_t y = y0; y < y1; y++)
        for (int64_t i = (y * W + x0) * C; i < (y * W + x1) * C; i++) {
            if (t->dtype == LOOM_U8) ((uint8_t *)t->data)[i] = v8;
            else ((float *)t->data)[i] = (float)f->value;
        }
}

static void noise(const img_fn *f, loom_tensor *t, uint64_t *rng)
{
    float *x = t->data;
    size_t n = nbytes(t) / sizeof(float);
    for (size_t i = 0; i < n; i++) { /* Box-Muller, one value per pair of uniforms */
        double u1 = uniform(rng), u2 = uniform(rng);
        x[i] += (float)(f->std * sqrt(-2.0 * log(1.0 - u1)) * cos(6.283185307179586 * u2));
    }
}

static int img_map(void *inst, const loom_elem *in, loom_elem *out, const loom_custom_key *key, loom_err *err)
{
    (void)err;
    const img_fn *f = inst;
    for (int i = 0; i < in->n; i++) { /* every feature into its output buffer, unchanged */
        memcpy(out->t[i].data, in->t[i].data, nbytes(&in->t[i]));
        out->t[i].shape = in->t[i].shape;
    }
    uint64_t rng = key_state(key);
    if (f->fn == F_CUTOUT) cutout(f, &out->t[f->feature], &rng);
    else noise(f, &out->t[f->feature], &rng);
    return LOOM_EOK;
}

static int img_filter(void *inst, const loom_elem *in, int *keep, const loom_custom_key *key, loom_err *err)
{
    (void)key, (void)err;
    const img_fn *f = inst;
    const loom_tensor *t = &in->t[f->feature];
    size_t n = nbytes(t) / (t->dtype == LOOM_U8 ? 1 : sizeof(float));
    double sum = 0, sq = 0;
    for (size_t i = 0; i < n; i++) {
        double v = t->dtype == LOOM_U8 ? ((const uint8_t *)t->data)[i] : ((const float *)t->data)[i];
        sum += v, sq += v * v;
    }
    double mean = n ? sum / (double)n : 0, var = n ? sq / (double)n - mean * mean : 0;
    *keep = sqrt(var > 0 ? var : 0) >= f->min;
    return LOOM_EOK;
}

static void img_close(void *inst) { img_host->free(inst); }

static const loom_custom_ops image_ops = {
    .version = LOOM_CUSTOM_OPS_VERSION,
    .name = "image_ops",
    .open = img_open,
    .map = img_map,
    .filter = img_filter,
    .close = img_close,
};

/* ---- the plugin ------------------------------------------------------------------- */

static int init(const loom_host *h, loom_err *err)
{
    img_host = h;
    if (h->size <= offsetof(loom_host, register_transform))
        return h->err_set(err, LOOM_EPLUGIN, NULL, "this loom (%s) cannot register transforms or sources", h->loom_version);
    int rc = h->register_transform(&image_ops, err);
    return rc ? rc : h->register_source(&npy_source_ops, err);
}

static const loom_plugin plugin = {
    .abi = LOOM_PLUGIN_ABI_VERSION,
    .size = sizeof(loom_plugin),
    .name = "image_ops",
    .version = "1.0",
    .description = "transforms: image_ops (cutout, gaussian_noise, min_std); source: npy (NumPy .npy arrays)",
    .init = init,
};

const loom_plugin *loom_plugin_entry(void) { return &plugin; }
