/* adapt.c - `normalize` maps with adapt = true (Keras Normalization.adapt):
 * the mean and standard deviation of each index of the feature's last axis,
 * from one pass over data.train up to the map (shuffles, repeats and
 * prefetches left out), written into the map's spec. An adapt map of
 * data.eval takes the numbers of the train map on the same feature. The
 * numbers are cached in <model_dir>/adapt.txt so that a resumed run,
 * evaluate, predict and export use exactly what training used.
 * Threads: the caller's (main) thread; the pass runs an ordinary pipeline. */
#include "data/data_internal.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ADAPT LOOM_MAX_TRANSFORMS

static bool is_adapt(const loom_transform_spec *t)
{
    return t->kind == LOOM_T_MAP && t->map.kind == LOOM_MAP_NORMALIZE && t->map.adapt;
}

static int where_err(loom_err *err, int code, const loom_loc *loc, const char *fmt, const char *a, const char *b)
{
    char w[LOOM_PATH_MAX + 16];
    loom_loc_str(loc, w, sizeof w);
    return loom_err_set(err, code, w, fmt, a, b);
}

/* One pass of data.train's transforms before k: per-index mean and std of the feature into m. */
static int compute(const loom_dataset_spec *train, int k, loom_map_spec *m, const loom_data_ctx *ctx, int64_t *rows,
                   loom_err *err)
{
    loom_dataset_spec *d = loom_calloc(1, sizeof *d);
    if (!d) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the adapt pipeline's spec");
    d->present = true;
    d->loc = train->loc;
    d->source = train->source;
    d->shard_policy = LOOM_SHARD_OFF;
    d->on_nonfinite = train->on_nonfinite;
    d->options = train->options;
    d->options.inject_prefetch = false;
    int bd = 0;
    for (int i = 0; i < k; i++) {
        const loom_transform_spec *t = &train->transform[i];
        if (t->kind == LOOM_T_SHUFFLE || t->kind == LOOM_T_REPEAT || t->kind == LOOM_T_PREFETCH) continue;
        if (t->kind == LOOM_T_BATCH || t->kind == LOOM_T_PADDED_BATCH) bd++;
        if (t->kind == LOOM_T_UNBATCH && bd > 0) bd--;
        d->transform[d->n_transforms++] = *t;
    }
    loom_data_ctx c = *ctx;
    c.input = (loom_input_ctx){0}; /* every process adapts on all of data.train, so all agree */
    c.name = "adapt";
    loom_iter *it = NULL;
    double *acc = NULL;
    int rc = loom_data_open(&it, d, &c, err);
    if (rc) goto done;
    const loom_elem_spec *es = loom_iter_spec(it);
    int f = loom_elem_spec_find(es, m->feature);
    if (f < 0) {
        rc = where_err(err, LOOM_ECONFIG, &train->transform[k].loc,
                       "map(normalize) adapt: no feature \"%s\" reaches this map%s", m->feature, "");
        goto done;
    }
    const loom_shape *sh = &es->shape[f];
    int64_t L = sh->rank > bd ? sh->dim[sh->rank - 1] : 1;
    if (L < 1 || L > LOOM_MAX_NORM) {
        char w[LOOM_PATH_MAX + 16];
        rc = loom_err_set(err, LOOM_ESHAPE, loom_loc_str(&train->transform[k].loc, w, sizeof w),
                          "map(normalize) adapt on \"%s\": the last axis has %lld indices; adapt keeps one mean and std "
                          "per index, at most %d", m->feature, (long long)L, LOOM_MAX_NORM);
        loom_err_hint(err, "reshape the feature so that its last axis holds the values that share a mean (channels)");
        goto done;
    }
    acc = loom_calloc((size_t)L * 3, sizeof *acc); /* shift, sum(x - shift), sum((x - shift)^2) per index */
    if (!acc) {
        rc = loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the adapt sums");
        goto done;
    }
    int64_t n = 0;
    for (;;) {
        loom_elem *e;
        rc = loom_iter_next(it, &e, err);
        if (rc == LOOM_EEOF) {
            rc = LOOM_OK;
            break;
        }
        if (rc) goto done;
        const loom_tensor *t = &e->t[f];
        int64_t numel = loom_shape_numel(&t->shape);
        for (int64_t i = 0; i < numel; i++) {
            int64_t j = i % L;
            double x = loom_tensor_get(t, i);
            if (n == 0 && i < L) acc[3 * j] = x; /* the first row shifts the sums: no cancellation */
            x -= acc[3 * j];
            acc[3 * j + 1] += x;
            acc[3 * j + 2] += x * x;
        }
        n += numel / L;
    }
    if (n == 0) {
        rc = where_err(err, LOOM_EDATA, &train->transform[k].loc,
                       "map(normalize) adapt on \"%s\": data.train yields no elements before this map, so there is "
                       "nothing to adapt on%s", m->feature, "");
        loom_err_hint(err, "check the source's files and the split or filter before it (an empty split?)");
        goto done;
    }
    for (int64_t j = 0; j < L; j++) {
        double mu = acc[3 * j + 1] / (double)n, var = acc[3 * j + 2] / (double)n - mu * mu;
        double sd = var > 0 ? sqrt(var) : 0;
        m->mean_v[j] = (float)(acc[3 * j] + mu);
        m->std_v[j] = sd > 1e-12 * (fabs(m->mean_v[j]) + 1) ? (float)sd : 1.0f; /* a constant index: (x - mean) / 1 */
    }
    m->n_norm = (int)L;
    *rows = n;
done:
    loom_free(acc);
    loom_iter_close(it);
    loom_free(d);
    return rc;
}

/* The cache: one block per adapt map of data.train, in order:
 *   map K FEATURE L
 *   mean v0 ... v(L-1)
 *   std  v0 ... v(L-1)                                                        */
static int save(const char *path, const loom_dataset_spec *train, const int *ks, int n, loom_err *err)
{
    size_t cap = 256, len = 0;
    for (int a = 0; a < n; a++) cap += 128 + (size_t)train->transform[ks[a]].map.n_norm * 2 * 20;
    char *buf = loom_alloc(cap);
    if (!buf) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate %s", path);
    len += (size_t)snprintf(buf + len, cap - len,
                            "# loom: normalize adapt = true, per index of the last axis, from data.train\n");
    for (int a = 0; a < n; a++) {
        const loom_map_spec *m = &train->transform[ks[a]].map;
        len += (size_t)snprintf(buf + len, cap - len, "map %d %s %d\n", ks[a], m->feature, m->n_norm);
        for (int s = 0; s < 2; s++) {
            len += (size_t)snprintf(buf + len, cap - len, "%s", s ? "std" : "mean");
            for (int j = 0; j < m->n_norm; j++)
                len += (size_t)snprintf(buf + len, cap - len, " %.9g", (double)(s ? m->std_v[j] : m->mean_v[j]));
            len += (size_t)snprintf(buf + len, cap - len, "\n");
        }
    }
    int rc = loom_write_file_atomic(path, buf, len, err);
    loom_free(buf);
    return rc;
}

/* Reads the cache into the maps ks[] of train; LOOM_EEOF when there is no
 * cache, LOOM_EDATA (saying why) when it does not fit the config. */
static int load(const char *path, loom_dataset_spec *train, const int *ks, int n, loom_err *err)
{
    FILE *fp = fopen(path, "r");
    if (!fp) {
        if (errno == ENOENT) return LOOM_EEOF;
        return loom_err_set(err, LOOM_EIO, path, "cannot open: %s", strerror(errno));
    }
    int rc = LOOM_OK, a = 0;
    char word[16], feat[LOOM_NAME_MAX + 1];
    int c;
    while ((c = fgetc(fp)) == '#')
        while ((c = fgetc(fp)) != EOF && c != '\n') {}
    if (c != EOF) ungetc(c, fp);
    for (; a < n; a++) {
        loom_map_spec *m = &train->transform[ks[a]].map;
        int k, L;
        if (fscanf(fp, "%15s %d %64s %d", word, &k, feat, &L) != 4 || strcmp(word, "map") || L < 1 || L > LOOM_MAX_NORM) {
            rc = loom_err_set(err, LOOM_EDATA, path, "holds %d adapted map%s; the config's data.train has %d", a,
                              a == 1 ? "" : "s", n);
            break;
        }
        if (k != ks[a] || strcmp(feat, m->feature)) {
            char want[LOOM_NAME_MAX + 32], got[LOOM_NAME_MAX + 32];
            snprintf(want, sizeof want, "transforms.[%d] on \"%s\"", ks[a], m->feature);
            snprintf(got, sizeof got, "transforms.[%d] on \"%s\"", k, feat);
            rc = loom_err_set(err, LOOM_EDATA, path, "was adapted for %s; the config's adapt map is %s", got, want);
            break;
        }
        for (int s = 0; s < 2 && !rc; s++) {
            float *v = s ? m->std_v : m->mean_v;
            if (fscanf(fp, "%15s", word) != 1 || strcmp(word, s ? "std" : "mean")) rc = LOOM_EDATA;
            for (int j = 0; j < L && !rc; j++)
                if (fscanf(fp, "%f", &v[j]) != 1 || !isfinite(v[j]) || (s && !(v[j] > 0))) rc = LOOM_EDATA;
        }
        if (rc) {
            rc = loom_err_set(err, LOOM_EDATA, path, "map %d (\"%s\"): the mean or std line is damaged", k, feat);
            break;
        }
        m->n_norm = L;
    }
    fclose(fp);
    if (rc) loom_err_hint(err, "it is written by loom train; train again with --fresh to adapt anew");
    return rc;
}

/* Gives data.eval's adapt maps the numbers of train's map on the same feature. */
static int share_with(loom_dataset_spec *eval, const loom_dataset_spec *train, const int *ks, int n, loom_err *err)
{
    for (int i = 0; i < eval->n_transforms; i++) {
        loom_transform_spec *t = &eval->transform[i];
        if (!is_adapt(t)) continue;
        int used = 0; /* earlier eval adapt maps on the feature: the j-th takes train's j-th */
        for (int p = 0; p < i; p++) used += is_adapt(&eval->transform[p]) && !strcmp(eval->transform[p].map.feature, t->map.feature);
        const loom_map_spec *src = NULL;
        for (int a = 0, seen = 0; a < n; a++) {
            const loom_map_spec *m = &train->transform[ks[a]].map;
            if (strcmp(m->feature, t->map.feature)) continue;
            src = m;
            if (seen++ == used) break;
        }
        if (!src)
            return where_err(err, LOOM_ECONFIG, &t->loc,
                             "map(normalize) adapt on \"%s\" in data.eval takes the numbers adapted in data.train, "
                             "but data.train has no normalize map with adapt = true on \"%s\"", t->map.feature,
                             t->map.feature);
        t->map.n_norm = src->n_norm;
        memcpy(t->map.mean_v, src->mean_v, (size_t)src->n_norm * sizeof src->mean_v[0]);
        memcpy(t->map.std_v, src->std_v, (size_t)src->n_norm * sizeof src->std_v[0]);
    }
    return LOOM_OK;
}

int loom_data_adapt(loom_spec *spec, const char *model_dir, loom_adapt_mode mode, const loom_data_ctx *ctx,
                    loom_err *err)
{
    int ks[MAX_ADAPT], n = 0;
    bool eval_adapts = false;
    for (int i = 0; i < spec->train.n_transforms; i++)
        if (is_adapt(&spec->train.transform[i]) && n < MAX_ADAPT) ks[n++] = i;
    for (int i = 0; spec->eval.present && i < spec->eval.n_transforms; i++) eval_adapts |= is_adapt(&spec->eval.transform[i]);
    if (!n && !eval_adapts) return LOOM_OK;
    char path[LOOM_PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/adapt.txt", model_dir && model_dir[0] ? model_dir : ".");
    int rc = mode == LOOM_ADAPT_FRESH ? LOOM_EEOF : load(path, &spec->train, ks, n, err);
    if (rc && rc != LOOM_EEOF && mode == LOOM_ADAPT_TRAIN) {
        loom_warn("%s: %s; adapting again", err->where, err->msg);
        rc = LOOM_EEOF;
    }
    if (rc == LOOM_EEOF && mode == LOOM_ADAPT_LOAD) {
        char abs[PATH_MAX];
        if (model_dir && realpath(model_dir, abs)) snprintf(path, sizeof path, "%.*s/adapt.txt", LOOM_PATH_MAX, abs);
        rc = loom_err_set(err, LOOM_EIO, path, "no adapted normalize numbers: data.train has %d normalize map%s with "
                          "adapt = true", n, n == 1 ? "" : "s");
        return loom_err_hint(err, "run loom train first (it adapts them and writes this file), or point --model-dir at "
                                  "the run's directory");
    }
    if (rc == LOOM_EEOF) {
        for (int a = 0; a < n; a++) {
            loom_map_spec *m = &spec->train.transform[ks[a]].map;
            int64_t rows = 0;
            if ((rc = compute(&spec->train, ks[a], m, ctx, &rows, err))) return rc;
            loom_info("normalize adapt: \"%s\" (%d value%s per example) from %lld training rows: mean %.4g%s, std %.4g%s",
                      m->feature, m->n_norm, m->n_norm == 1 ? "" : "s", (long long)rows, (double)m->mean_v[0],
                      m->n_norm > 1 ? " ..." : "", (double)m->std_v[0], m->n_norm > 1 ? " ..." : "");
        }
        if (mode != LOOM_ADAPT_CHECK && n) {
            if ((rc = loom_mkdirs(model_dir && model_dir[0] ? model_dir : ".", err))) return rc;
            if ((rc = save(path, &spec->train, ks, n, err))) return rc;
        }
    } else if (rc) {
        return rc;
    } else if (n) {
        loom_info("normalize adapt: the numbers of %d map%s from %s", n, n == 1 ? "" : "s", path);
    }
    return spec->eval.present ? share_with(&spec->eval, &spec->train, ks, n, err) : LOOM_OK;
}
