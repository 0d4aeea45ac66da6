/* adapt.c - maps with adapt = true (Keras' Normalization.adapt and
 * StringLookup.adapt): `normalize` gets the mean and standard deviation (mode
 * "mean_std") or the min and range (mode "min_max") of each index of the
 * feature's last axis, `string_lookup` its vocabulary (most frequent first),
 * `tokenize` the vocabulary of its tokens (split as transform/text.c does,
 * in Keras TextVectorization's order), from one pass over data.train up to the map (shuffles, repeats and
 * prefetches left out), written into the map's spec. An adapt map of
 * data.eval takes the numbers of the train map of the same kind on the same
 * feature. The numbers are kept as text (loom_data_adapt_text) in
 * <model_dir>/adapt.txt and, by the trainer, in every checkpoint, so that a
 * resumed run, evaluate, predict and export use exactly what training used.
 * Threads: the caller's (main) thread; the pass runs an ordinary pipeline. */
#include "data/data_internal.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define MAX_ADAPT LOOM_MAX_TRANSFORMS
#define MAX_VOCAB ((int64_t)1 << 24) /* distinct strings counted by one adapt pass */

static bool is_adapt(const loom_transform_spec *t)
{
    return t->kind == LOOM_T_MAP && t->map.adapt &&
           (t->map.kind == LOOM_MAP_NORMALIZE || t->map.kind == LOOM_MAP_STRING_LOOKUP ||
            t->map.kind == LOOM_MAP_TOKENIZE);
}

/* A map whose adapt makes a vocabulary: string_lookup (whole strings), tokenize (its tokens, text.c). */
static bool is_vocab(const loom_map_spec *m) { return m->kind == LOOM_MAP_STRING_LOOKUP || m->kind == LOOM_MAP_TOKENIZE; }

static const char *kind_name(const loom_map_spec *m)
{
    return m->kind == LOOM_MAP_STRING_LOOKUP ? "string_lookup" : m->kind == LOOM_MAP_TOKENIZE ? "tokenize" : "normalize";
}

static int where_err(loom_err *err, int code, const loom_loc *loc, const char *fmt, const char *a, const char *b)
{
    char w[LOOM_PATH_MAX + 16];
    loom_loc_str(loc, w, sizeof w);
    return loom_err_set(err, code, w, fmt, a, b);
}

static void set_vocab(loom_map_spec *m, loom_vocab *v, bool owned)
{
    if (m->vocab_owned) loom_free(m->vocab);
    m->vocab = v;
    m->vocab_owned = owned;
}

/* One block: the header, n + 1 offsets, n counts, then the bytes. */
static loom_vocab *vocab_new(int64_t n, size_t bytes)
{
    size_t head = (sizeof(loom_vocab) + 7) / 8 * 8;
    loom_vocab *v = loom_calloc(1, head + (size_t)(2 * n + 1) * 8 + bytes + 1);
    if (!v) return NULL;
    v->n = n;
    v->off = (uint64_t *)((char *)v + head);
    v->count = (int64_t *)(v->off + n + 1);
    v->data = (char *)(v->count + n);
    return v;
}

static void vocab_digest(loom_vocab *v)
{
    uint64_t h = loom_data_str_hash((const uint8_t *)v->data, (size_t)v->off[v->n]);
    for (int64_t k = 0; k <= v->n; k++) h = (h ^ v->off[k]) * 0x100000001b3ull;
    v->digest = h;
}

/* ---- counting strings --------------------------------------------------- */

typedef struct tok {
    uint64_t hash;
    uint64_t off;   /* into the arena */
    uint32_t len;
    int64_t  count;
} tok;

typedef struct counter {
    tok     *t;       /* open addressing, size mask + 1; count 0 = empty */
    uint64_t mask;
    int64_t  n;
    char    *arena;
    size_t   alen, acap;
} counter;

static int counter_grow(counter *c)
{
    uint64_t size = c->t ? (c->mask + 1) * 2 : 1024;
    tok *nt = loom_calloc(size, sizeof *nt);
    if (!nt) return LOOM_ENOMEM;
    for (uint64_t i = 0; c->t && i <= c->mask; i++) {
        if (!c->t[i].count) continue;
        uint64_t j = c->t[i].hash & (size - 1);
        while (nt[j].count) j = (j + 1) & (size - 1);
        nt[j] = c->t[i];
    }
    loom_free(c->t);
    c->t = nt;
    c->mask = size - 1;
    return LOOM_OK;
}

static int counter_add(counter *c, const uint8_t *p, size_t len)
{
    if (!c->t || (uint64_t)(c->n + 1) * 2 > c->mask + 1) {
        if (counter_grow(c)) return LOOM_ENOMEM;
    }
    uint64_t h = loom_data_str_hash(p, len), i = h & c->mask;
    for (; c->t[i].count; i = (i + 1) & c->mask)
        if (c->t[i].hash == h && c->t[i].len == len && !memcmp(c->arena + c->t[i].off, p, len)) {
            c->t[i].count++;
            return LOOM_OK;
        }
    if (c->n >= MAX_VOCAB) return LOOM_EDATA;
    if (c->alen + len > c->acap) {
        size_t nc = c->acap ? c->acap : 65536;
        while (nc < c->alen + len) nc *= 2;
        char *na = loom_realloc(c->arena, nc);
        if (!na) return LOOM_ENOMEM;
        c->arena = na;
        c->acap = nc;
    }
    memcpy(c->arena + c->alen, p, len);
    c->t[i] = (tok){h, c->alen, (uint32_t)len, 1};
    c->alen += len;
    c->n++;
    return LOOM_OK;
}

static int count_token(void *ctx, const uint8_t *tok, size_t n, uint32_t cp)
{
    (void)cp;
    return counter_add(ctx, tok, n);
}

/* Counts the strings of t (numel bytes, one string per L): whole (string_lookup) or their tokens (tokenize). */
static int count_strings(counter *cnt, const loom_map_spec *m, const loom_tensor *t, int64_t L, int64_t numel,
                         uint8_t **scratch)
{
    int rc = LOOM_OK;
    if (m->kind == LOOM_MAP_TOKENIZE && !*scratch && !(*scratch = loom_alloc((size_t)L + 4))) return LOOM_ENOMEM;
    for (int64_t i = 0; i + L <= numel && !rc; i += L) {
        const uint8_t *p = (const uint8_t *)t->data + i;
        size_t len = (size_t)L;
        while (len && !p[len - 1]) len--;
        if (m->kind == LOOM_MAP_TOKENIZE) { /* the tokens tokenize looks up */
            len = tokenize_standardize_(m, p, len, *scratch);
            rc = tokenize_split_(m, *scratch, len, count_token, cnt, NULL);
        } else {
            rc = counter_add(cnt, p, len);
        }
    }
    return rc;
}

static _Thread_local const char *cmp_arena; /* for cmp_tok: qsort has no context argument */

/* Most frequent first; ties in byte order (shorter first), so the vocabulary is a function of the data alone. */
static int cmp_tok(const void *x, const void *y)
{
    const tok *a = x, *b = y;
    if (a->count != b->count) return a->count > b->count ? -1 : 1;
    int c = memcmp(cmp_arena + a->off, cmp_arena + b->off, a->len < b->len ? a->len : b->len);
    if (c) return c;
    return a->len < b->len ? -1 : a->len > b->len;
}

/* tokenize's order, Keras TextVectorization's (np.lexsort((tokens, counts))[::-1]): most
 * frequent first, ties in reverse byte order (longer first). */
static int cmp_tok_keras(const void *x, const void *y)
{
    const tok *a = x, *b = y;
    if (a->count != b->count) return a->count > b->count ? -1 : 1;
    return -cmp_tok(x, y);
}

/* The counted strings as m's vocabulary, bounded by max_tokens. */
static int counter_vocab(counter *c, loom_map_spec *m, loom_err *err)
{
    tok *all = loom_alloc((size_t)(c->n ? c->n : 1) * sizeof *all);
    if (!all) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot sort %lld strings", (long long)c->n);
    int64_t k = 0;
    for (uint64_t i = 0; c->t && i <= c->mask; i++)
        if (c->t[i].count) all[k++] = c->t[i];
    cmp_arena = c->arena;
    qsort(all, (size_t)k, sizeof *all, m->kind == LOOM_MAP_TOKENIZE ? cmp_tok_keras : cmp_tok);
    int64_t reserved = m->num_oov_indices + (m->kind == LOOM_MAP_TOKENIZE); /* tokenize: id 0 is the padding */
    if (m->max_tokens > 0 && k > m->max_tokens - reserved) k = m->max_tokens - reserved;
    size_t bytes = 0;
    for (int64_t i = 0; i < k; i++) bytes += all[i].len;
    loom_vocab *v = vocab_new(k, bytes);
    if (!v) {
        loom_free(all);
        return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a vocabulary of %lld strings", (long long)k);
    }
    for (int64_t i = 0; i < k; i++) {
        memcpy(v->data + v->off[i], c->arena + all[i].off, all[i].len);
        v->off[i + 1] = v->off[i] + all[i].len;
        v->count[i] = all[i].count;
    }
    vocab_digest(v);
    set_vocab(m, v, true);
    loom_free(all);
    return LOOM_OK;
}

/* ---- the adapt pass ----------------------------------------------------- */

/* The pipeline an adapt pass reads: data.train's source and its transforms
 * before k, without shuffle, repeat and prefetch (one ordered pass), unsharded;
 * *bd: the batch dimensions those transforms add. */
static loom_dataset_spec *adapt_pipeline(const loom_dataset_spec *train, int k, int *bd)
{
    loom_dataset_spec *d = loom_calloc(1, sizeof *d);
    if (!d) return NULL;
    d->present = true;
    d->loc = train->loc;
    d->source = train->source;
    d->shard_policy = LOOM_SHARD_OFF;
    d->on_nonfinite = train->on_nonfinite;
    d->options = train->options;
    d->options.inject_prefetch = false;
    *bd = 0;
    for (int i = 0; i < k; i++) {
        const loom_transform_spec *t = &train->transform[i];
        if (t->kind == LOOM_T_SHUFFLE || t->kind == LOOM_T_REPEAT || t->kind == LOOM_T_PREFETCH) continue;
        if (t->kind == LOOM_T_BATCH || t->kind == LOOM_T_PADDED_BATCH) (*bd)++;
        if (t->kind == LOOM_T_UNBATCH && *bd > 0) (*bd)--;
        d->transform[d->n_transforms++] = *t;
    }
    return d;
}

/* m's numbers from the sums of n rows of L indices (acc as compute fills it). */
static void set_numbers(loom_map_spec *m, const double *acc, int64_t L, int64_t n, bool minmax)
{
    for (int64_t j = 0; j < L; j++) {
        if (minmax) {
            double lo = acc[2 * j], range = acc[2 * j + 1] - lo;
            m->mean_v[j] = (float)lo;
            m->std_v[j] = range > 1e-12 * (fabs(lo) + 1) ? (float)range : 1.0f; /* a constant index: x - min */
        } else {
            double mu = acc[3 * j + 1] / (double)n, var = acc[3 * j + 2] / (double)n - mu * mu;
            double sd = var > 0 ? sqrt(var) : 0;
            m->mean_v[j] = (float)(acc[3 * j] + mu);
            m->std_v[j] = sd > 1e-12 * (fabs(m->mean_v[j]) + 1) ? (float)sd : 1.0f; /* a constant index: (x - mean) / 1 */
        }
    }
    m->n_norm = (int)L;
}

/* Feature f (bd batch dimensions) fits the adapt map m; *L: the indices of
 * its last axis (the length of one string for a vocabulary). */
static int check_feature(const loom_map_spec *m, const loom_elem_spec *es, int f, int bd, bool vocab, const char *w,
                         int64_t *L, loom_err *err)
{
    char a[64];
    const loom_shape *sh = &es->shape[f];
    *L = sh->rank > bd ? sh->dim[sh->rank - 1] : 1;
    if (vocab && (es->dtype[f] != LOOM_U8 || sh->rank <= bd)) {
        loom_err_set(err, LOOM_ESHAPE, w, "map(string_lookup) adapt on \"%s\": a vocabulary is made of strings "
                     "(uint8 bytes, the last axis one string), but \"%s\" is %s %s", m->feature, m->feature,
                     loom_dtype_name(es->dtype[f]), loom_shape_str(sh, a, sizeof a));
        return loom_err_hint(err, "strings come from a csv column with dtype = \"string\" or the text source's "
                                  "\"line\"; an int feature is an id already (one_hot or an embedding take it)");
    }
    if (!vocab && (*L < 1 || *L > LOOM_MAX_NORM)) {
        loom_err_set(err, LOOM_ESHAPE, w, "map(normalize) adapt on \"%s\": the last axis has %lld indices; adapt "
                     "keeps one pair of numbers per index, at most %d", m->feature, (long long)*L, LOOM_MAX_NORM);
        return loom_err_hint(err, "reshape the feature so that its last axis holds the values that share a mean "
                                  "(channels)");
    }
    return LOOM_OK;
}

/* One pass of data.train's transforms before k: m's numbers or vocabulary. */
static int compute(const loom_dataset_spec *train, int k, loom_map_spec *m, const loom_data_ctx *ctx, int64_t *rows,
                   loom_err *err)
{
    int bd;
    loom_dataset_spec *d = adapt_pipeline(train, k, &bd);
    if (!d) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the adapt pipeline's spec");
    loom_data_ctx c = *ctx;
    c.input = (loom_input_ctx){0}; /* every process adapts on all of data.train, so all agree */
    c.name = "adapt";
    loom_iter *it = NULL;
    double *acc = NULL;
    counter cnt = {0};
    bool vocab = is_vocab(m), minmax = !vocab && m->norm_mode == LOOM_NORM_MIN_MAX;
    uint8_t *scratch = NULL;
    char w[LOOM_PATH_MAX + 16];
    loom_loc_str(&train->transform[k].loc, w, sizeof w);
    int rc = loom_data_open(&it, d, &c, err);
    if (rc) goto done;
    const loom_elem_spec *es = loom_iter_spec(it);
    int f = loom_elem_spec_find(es, m->feature);
    if (f < 0) {
        rc = loom_err_set(err, LOOM_ECONFIG, w, "map(%s) adapt: no feature \"%s\" reaches this map", kind_name(m),
                          m->feature);
        goto done;
    }
    int64_t L;
    if ((rc = check_feature(m, es, f, bd, vocab, w, &L, err))) goto done;
    if (!vocab && !(acc = loom_calloc((size_t)L * 3, sizeof *acc))) { /* mean_std: shift, sum(x - shift), sum((x - shift)^2) per index; min_max: min, max */
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
        if (vocab) {
            rc = count_strings(&cnt, m, t, L, numel, &scratch);
            if (rc == LOOM_EDATA) {
                rc = loom_err_set(err, LOOM_EDATA, w, "map(string_lookup) adapt on \"%s\": more than %lld distinct "
                                  "strings in data.train", m->feature, (long long)MAX_VOCAB);
                loom_err_hint(err, "is it a free-text or id column? hash it instead, or bound it earlier");
                goto done;
            }
            if (rc) {
                rc = loom_err_set(err, LOOM_ENOMEM, w, "map(string_lookup) adapt: out of memory counting %lld strings",
                                  (long long)cnt.n);
                goto done;
            }
            n += L ? numel / L : 0;
            continue;
        }
        for (int64_t i = 0; i < numel; i++) {
            int64_t j = i % L;
            double x = loom_tensor_get(t, i);
            if (minmax) {
                if ((n == 0 && i < L) || x < acc[2 * j]) acc[2 * j] = x;
                if ((n == 0 && i < L) || x > acc[2 * j + 1]) acc[2 * j + 1] = x;
                continue;
            }
            if (n == 0 && i < L) acc[3 * j] = x; /* the first row shifts the sums: no cancellation */
            x -= acc[3 * j];
            acc[3 * j + 1] += x;
            acc[3 * j + 2] += x * x;
        }
        n += numel / L;
    }
    if (n == 0) {
        rc = loom_err_set(err, LOOM_EDATA, w, "map(%s) adapt on \"%s\": data.train yields no elements before this map, "
                          "so there is nothing to adapt on", kind_name(m), m->feature);
        loom_err_hint(err, "check the source's files and the split or filter before it (an empty split?)");
        goto done;
    }
    if (vocab) rc = counter_vocab(&cnt, m, err);
    else set_numbers(m, acc, L, n, minmax);
    *rows = n;
done:
    loom_free(scratch);
    loom_free(acc);
    loom_free(cnt.t);
    loom_free(cnt.arena);
    loom_iter_close(it);
    loom_free(d);
    return rc;
}

/* ---- the text form -------------------------------------------------------
 * One block per adapt map of data.train, in order:
 *   map K FEATURE L            normalize, mode mean_std
 *   mean v0 ... v(L-1)
 *   std  v0 ... v(L-1)
 *   minmax K FEATURE L         normalize, mode min_max ((x - min) / range)
 *   min   v0 ... v(L-1)
 *   range v0 ... v(L-1)
 *   vocab K FEATURE N OOV MAX  string_lookup, tokenize: N tokens, num_oov_indices, max_tokens
 *   =TOKEN COUNT               N lines, most frequent first; bytes outside
 *                              '!'..'~' and '%' written %XX                  */

static void put_token(loom_buf *b, const char *p, size_t n)
{
    static const char hex[] = "0123456789ABCDEF";
    loom_buf_put(b, "=", 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)p[i];
        if (ch > ' ' && ch < 0x7f && ch != '%') {
            loom_buf_put(b, &p[i], 1);
        } else {
            char e[3] = {'%', hex[ch >> 4], hex[ch & 15]};
            loom_buf_put(b, e, 3);
        }
    }
}

static void put_fmt(loom_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put_fmt(loom_buf *b, const char *fmt, ...)
{
    char line[LOOM_NAME_MAX + 128];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (n > 0) loom_buf_put(b, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
}

static void text_of(const loom_dataset_spec *train, const int *ks, int n, loom_buf *b)
{
    put_fmt(b, "# loom: normalize adapt = true, per index of the last axis, from data.train\n");
    for (int a = 0; a < n; a++) {
        const loom_map_spec *m = &train->transform[ks[a]].map;
        if (is_vocab(m)) {
            const loom_vocab *v = m->vocab;
            int64_t N = v ? v->n : 0;
            put_fmt(b, "vocab %d %s %lld %d %lld\n", ks[a], m->feature, (long long)N, m->num_oov_indices,
                    (long long)m->max_tokens);
            for (int64_t i = 0; i < N; i++) {
                put_token(b, v->data + v->off[i], (size_t)(v->off[i + 1] - v->off[i]));
                put_fmt(b, " %lld\n", (long long)v->count[i]);
            }
            continue;
        }
        bool mm = m->norm_mode == LOOM_NORM_MIN_MAX;
        put_fmt(b, "%s %d %s %d\n", mm ? "minmax" : "map", ks[a], m->feature, m->n_norm);
        for (int s = 0; s < 2; s++) {
            put_fmt(b, "%s", s ? (mm ? "range" : "std") : (mm ? "min" : "mean"));
            for (int j = 0; j < m->n_norm; j++) put_fmt(b, " %.9g", (double)(s ? m->std_v[j] : m->mean_v[j]));
            put_fmt(b, "\n");
        }
    }
}

/* A cursor over the text: words separated by blanks and line ends. */
typedef struct rd {
    const char *p, *end;
} rd;

static bool rd_word(rd *r, const char **w, size_t *n)
{
    while (r->p < r->end && (*r->p == ' ' || *r->p == '\n' || *r->p == '\t' || *r->p == '\r')) r->p++;
    *w = r->p;
    while (r->p < r->end && *r->p != ' ' && *r->p != '\n' && *r->p != '\t' && *r->p != '\r') r->p++;
    *n = (size_t)(r->p - *w);
    return *n > 0;
}

static bool rd_is(rd *r, const char *want)
{
    const char *w;
    size_t n;
    return rd_word(r, &w, &n) && n == strlen(want) && !memcmp(w, want, n);
}

static bool rd_i64(rd *r, long long *v)
{
    const char *w;
    size_t n;
    char tmp[32], *e;
    if (!rd_word(r, &w, &n) || n >= sizeof tmp) return false;
    memcpy(tmp, w, n);
    tmp[n] = 0;
    errno = 0;
    *v = strtoll(tmp, &e, 10);
    return !*e && !errno;
}

static bool rd_f32(rd *r, float *v)
{
    const char *w;
    size_t n;
    char tmp[48], *e;
    if (!rd_word(r, &w, &n) || n >= sizeof tmp) return false;
    memcpy(tmp, w, n);
    tmp[n] = 0;
    *v = strtof(tmp, &e);
    return !*e && isfinite(*v);
}

static int hexval(char c) { return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1; }

/* A "=TOKEN" word decoded into out (at most cap bytes; out NULL: only
 * measured): its length, or -1. */
static int64_t rd_token(rd *r, char *out, size_t cap)
{
    const char *w;
    size_t n, k = 0;
    if (!rd_word(r, &w, &n) || w[0] != '=') return -1;
    for (size_t i = 1; i < n; i++) {
        if (out && k >= cap) return -1;
        char ch = w[i];
        if (ch == '%') {
            if (i + 2 >= n || hexval(w[i + 1]) < 0 || hexval(w[i + 2]) < 0) return -1;
            ch = (char)(hexval(w[i + 1]) * 16 + hexval(w[i + 2]));
            i += 2;
        }
        if (out) out[k] = ch;
        k++;
    }
    return (int64_t)k;
}

/* The numbers of the text (from `name`: a file or a checkpoint) into the maps
 * ks[] of train; LOOM_EDATA (saying why) when they do not fit the config. */
static int parse(const char *text, size_t len, const char *name, loom_dataset_spec *train, const int *ks, int n,
                 loom_err *err)
{
    rd r = {text, text + len};
    while (r.p < r.end && *r.p == '#')
        while (r.p < r.end && *r.p++ != '\n') {}
    int rc = LOOM_OK;
    for (int a = 0; a < n && !rc; a++) {
        loom_map_spec *m = &train->transform[ks[a]].map;
        bool vocab = is_vocab(m), mm = !vocab && m->norm_mode == LOOM_NORM_MIN_MAX;
        const char *want = vocab ? "vocab" : mm ? "minmax" : "map";
        const char *w, *f;
        size_t wn, fn;
        long long k, L;
        if (!rd_word(&r, &w, &wn) || !rd_i64(&r, &k) || !rd_word(&r, &f, &fn) || !rd_i64(&r, &L)) {
            rc = loom_err_set(err, LOOM_EDATA, name, "holds %d adapted map%s; the config's data.train has %d", a,
                              a == 1 ? "" : "s", n);
            break;
        }
        if (k != ks[a] || fn != strlen(m->feature) || memcmp(f, m->feature, fn) || wn != strlen(want) ||
            memcmp(w, want, wn)) {
            char got[LOOM_NAME_MAX + 64];
            snprintf(got, sizeof got, "%.*s transforms.[%lld] on \"%.*s\"", (int)(wn > 8 ? 8 : wn), w, k,
                     (int)(fn > LOOM_NAME_MAX ? LOOM_NAME_MAX : fn), f);
            rc = loom_err_set(err, LOOM_EDATA, name, "was adapted for %s; the config's adapt map is %s transforms.[%d] "
                              "on \"%s\"", got, want, ks[a], m->feature);
            break;
        }
        if (!vocab) {
            if (L < 1 || L > LOOM_MAX_NORM) rc = LOOM_EDATA;
            for (int s = 0; s < 2 && !rc; s++) {
                float *v = s ? m->std_v : m->mean_v;
                if (!rd_is(&r, s ? (mm ? "range" : "std") : (mm ? "min" : "mean"))) rc = LOOM_EDATA;
                for (int j = 0; j < L && !rc; j++)
                    if (!rd_f32(&r, &v[j]) || (s && !(v[j] > 0))) rc = LOOM_EDATA;
            }
            if (rc) {
                rc = loom_err_set(err, LOOM_EDATA, name, "map %lld (\"%s\"): the %s line is damaged", k, m->feature,
                                  mm ? "min or range" : "mean or std");
                break;
            }
            m->n_norm = (int)L;
            continue;
        }
        long long oov, maxt;
        if (L < 0 || L > MAX_VOCAB || !rd_i64(&r, &oov) || !rd_i64(&r, &maxt)) {
            rc = loom_err_set(err, LOOM_EDATA, name, "vocab %lld (\"%s\"): the header line is damaged", k, m->feature);
            break;
        }
        if (oov != m->num_oov_indices || maxt != m->max_tokens) {
            rc = loom_err_set(err, LOOM_EDATA, name, "the vocabulary of \"%s\" was adapted with num_oov_indices = %lld, "
                              "max_tokens = %lld; the config says %d and %lld", m->feature, oov, maxt,
                              m->num_oov_indices, (long long)m->max_tokens);
            break;
        }
        /* two passes over the token lines: sizes, then the bytes */
        rd t0 = r;
        size_t bytes = 0;
        long long cnt;
        for (long long i = 0; i < L && !rc; i++) {
            int64_t tl = rd_token(&r, NULL, 0);
            if (tl < 0 || !rd_i64(&r, &cnt) || cnt < 0) rc = LOOM_EDATA;
            else bytes += (size_t)tl;
        }
        loom_vocab *v = rc ? NULL : vocab_new(L, bytes);
        if (!rc && !v) rc = LOOM_ENOMEM;
        r = t0;
        for (long long i = 0; i < L && !rc; i++) {
            int64_t tl = rd_token(&r, v->data + v->off[i], bytes - v->off[i]);
            if (tl < 0 || !rd_i64(&r, &cnt)) rc = LOOM_EDATA;
            else v->off[i + 1] = v->off[i] + (uint64_t)tl, v->count[i] = cnt;
        }
        if (rc) {
            loom_free(v);
            rc = rc == LOOM_ENOMEM ? loom_err_set(err, rc, name, "cannot allocate a vocabulary of %lld strings", L)
                                   : loom_err_set(err, LOOM_EDATA, name, "vocab %lld (\"%s\"): token %s damaged", k,
                                                  m->feature, "lines are");
            break;
        }
        vocab_digest(v);
        set_vocab(m, v, true);
    }
    return rc;
}

int loom_data_adapt_text(const loom_spec *spec, loom_buf *out)
{
    int ks[MAX_ADAPT], n = 0;
    for (int i = 0; i < spec->train.n_transforms; i++)
        if (is_adapt(&spec->train.transform[i]) && n < MAX_ADAPT) ks[n++] = i;
    if (n) text_of(&spec->train, ks, n, out);
    return n;
}

/* Gives data.eval's adapt maps the numbers of train's map of the same kind on the same feature. */
static int share_with(loom_dataset_spec *eval, const loom_dataset_spec *train, const int *ks, int n, loom_err *err)
{
    for (int i = 0; i < eval->n_transforms; i++) {
        loom_transform_spec *t = &eval->transform[i];
        if (!is_adapt(t)) continue;
        int used = 0; /* earlier eval adapt maps of the kind on the feature: the j-th takes train's j-th */
        for (int p = 0; p < i; p++)
            used += is_adapt(&eval->transform[p]) && eval->transform[p].map.kind == t->map.kind &&
                    !strcmp(eval->transform[p].map.feature, t->map.feature);
        const loom_map_spec *src = NULL;
        for (int a = 0, seen = 0; a < n; a++) {
            const loom_map_spec *m = &train->transform[ks[a]].map;
            if (strcmp(m->feature, t->map.feature) || m->kind != t->map.kind) continue;
            src = m;
            if (seen++ == used) break;
        }
        const char *kn = kind_name(&t->map);
        if (!src) {
            char w[LOOM_PATH_MAX + 16];
            return loom_err_set(err, LOOM_ECONFIG, loom_loc_str(&t->loc, w, sizeof w),
                                "map(%s) adapt on \"%s\" in data.eval takes what was adapted in data.train, but "
                                "data.train has no %s map with adapt = true on \"%s\"", kn, t->map.feature, kn,
                                t->map.feature);
        }
        if (is_vocab(&t->map)) {
            if (t->map.num_oov_indices != src->num_oov_indices || t->map.max_tokens != src->max_tokens)
                return where_err(err, LOOM_ECONFIG, &t->loc, "map(string_lookup) on \"%s\" in data.eval: num_oov_indices "
                                 "and max_tokens must be data.train's (%s), or the ids would differ", t->map.feature,
                                 "give both maps the same settings");
            set_vocab(&t->map, src->vocab, false);
            continue;
        }
        if (t->map.norm_mode != src->norm_mode)
            return where_err(err, LOOM_ECONFIG, &t->loc, "map(normalize) adapt on \"%s\" in data.eval: its mode "
                             "differs from data.train's map on the feature%s", t->map.feature, "");
        t->map.n_norm = src->n_norm;
        memcpy(t->map.mean_v, src->mean_v, (size_t)src->n_norm * sizeof src->mean_v[0]);
        memcpy(t->map.std_v, src->std_v, (size_t)src->n_norm * sizeof src->std_v[0]);
    }
    return LOOM_OK;
}

static void report(const loom_map_spec *m, int64_t rows)
{
    if (is_vocab(m)) {
        const loom_vocab *v = m->vocab;
        int first = m->num_oov_indices + (m->kind == LOOM_MAP_TOKENIZE);
        loom_info("%s adapt: \"%s\": %lld tokens from %lld training strings (ids %d..%lld; %d "
                  "out-of-vocabulary id%s), the most frequent \"%.*s\"", kind_name(m), m->feature, (long long)v->n, (long long)rows,
                  first, (long long)(first + v->n - 1), m->num_oov_indices,
                  m->num_oov_indices == 1 ? "" : "s", v->n ? (int)(v->off[1] > 40 ? 40 : v->off[1]) : 0, v->data);
        return;
    }
    bool mm = m->norm_mode == LOOM_NORM_MIN_MAX;
    loom_info("normalize adapt: \"%s\" (%d value%s per example) from %lld training rows: %s %.4g%s, %s %.4g%s",
              m->feature, m->n_norm, m->n_norm == 1 ? "" : "s", (long long)rows, mm ? "min" : "mean",
              (double)m->mean_v[0], m->n_norm > 1 ? " ..." : "", mm ? "range" : "std", (double)m->std_v[0],
              m->n_norm > 1 ? " ..." : "");
}

/* What <model_dir>/adapt.txt holds: LOOM_OK with *text (loom_free), LOOM_EEOF when absent. */
static int read_cache(const char *path, uint8_t **text, size_t *len, loom_err *err)
{
    struct stat st;
    *text = NULL;
    *len = 0;
    if (stat(path, &st) < 0 && errno == ENOENT) return LOOM_EEOF;
    return loom_read_file_max(path, text, len, (uint64_t)1 << 31, err);
}

int loom_data_adapt_from(loom_spec *spec, const char *model_dir, loom_adapt_mode mode, const loom_data_ctx *ctx,
                         const loom_adapt_source *ck, loom_err *err)
{
    int ks[MAX_ADAPT], n = 0;
    bool eval_adapts = false;
    for (int i = 0; i < spec->train.n_transforms; i++)
        if (is_adapt(&spec->train.transform[i]) && n < MAX_ADAPT) ks[n++] = i;
    for (int i = 0; spec->eval.present && i < spec->eval.n_transforms; i++) eval_adapts |= is_adapt(&spec->eval.transform[i]);
    if (!n && !eval_adapts) return LOOM_OK;
    const char *dir = model_dir && model_dir[0] ? model_dir : ".";
    char path[LOOM_PATH_MAX + 16], abs[PATH_MAX];
    if (realpath(dir, abs)) dir = abs; /* messages name where it is */
    snprintf(path, sizeof path, "%.*s/adapt.txt", LOOM_PATH_MAX, dir);
    uint8_t *cache = NULL;
    size_t clen = 0;
    int rc;
    if (ck && ck->text && mode != LOOM_ADAPT_FRESH) { /* the checkpoint's numbers win */
        if ((rc = parse(ck->text, ck->len, ck->name, &spec->train, ks, n, err)))
            return loom_err_hint(err, "the checkpoint was written for another config's adapt maps; use the config "
                                      "that trained it, or train again with --fresh");
        int crc = read_cache(path, &cache, &clen, err);
        bool same = !crc && clen == ck->len && !memcmp(cache, ck->text, clen);
        if (!crc && !same && !(ck->said && *ck->said)) {
            loom_warn("%s: its adapted numbers differ from %s; using the checkpoint's", ck->name, path);
            if (ck->said) *ck->said = true;
        }
        loom_free(cache);
        if (n) loom_info("adapt: the numbers of %d map%s from the checkpoint %s", n, n == 1 ? "" : "s", ck->name);
        if (!same && mode == LOOM_ADAPT_TRAIN && !(rc = loom_mkdirs(dir, err))) /* the directory agrees with its checkpoints */
            rc = loom_write_file_atomic(path, ck->text, ck->len, err);
        if (rc) return rc;
        return spec->eval.present ? share_with(&spec->eval, &spec->train, ks, n, err) : LOOM_OK;
    }
    rc = mode == LOOM_ADAPT_FRESH ? LOOM_EEOF : read_cache(path, &cache, &clen, err);
    if (!rc) rc = parse((const char *)cache, clen, path, &spec->train, ks, n, err);
    if (rc && rc != LOOM_EEOF) loom_err_hint(err, "it is written by loom train; train again with --fresh to adapt anew");
    loom_free(cache);
    if (rc && rc != LOOM_EEOF && mode == LOOM_ADAPT_TRAIN) {
        loom_warn("%s: %s; adapting again", err->where, err->msg);
        rc = LOOM_EEOF;
    }
    if (rc == LOOM_EEOF && mode == LOOM_ADAPT_LOAD) {
        rc = loom_err_set(err, LOOM_EIO, path, "nothing adapted: data.train has %d map%s with adapt = true, and neither "
                          "this file nor the checkpoint holds %s", n, n == 1 ? "" : "s", n == 1 ? "its numbers" : "theirs");
        return loom_err_hint(err, "run loom train first (it adapts them and keeps them here and in every checkpoint), "
                                  "or point --model-dir or --checkpoint at the run's");
    }
    if (rc == LOOM_EEOF) {
        for (int a = 0; a < n; a++) {
            loom_map_spec *m = &spec->train.transform[ks[a]].map;
            int64_t rows = 0;
            if ((rc = compute(&spec->train, ks[a], m, ctx, &rows, err))) return rc;
            report(m, rows);
        }
        if (mode != LOOM_ADAPT_CHECK && n) {
            loom_buf b;
            loom_buf_init(&b);
            text_of(&spec->train, ks, n, &b);
            if (b.failed) rc = loom_err_set(err, LOOM_ENOMEM, path, "cannot hold the adapted numbers");
            if (!rc) rc = loom_mkdirs(dir, err);
            if (!rc) rc = loom_write_file_atomic(path, b.data, b.len, err);
            loom_buf_fini(&b);
            if (rc) return rc;
        }
    } else if (rc) {
        return rc;
    } else if (n) {
        loom_info("adapt: the numbers of %d map%s from %s", n, n == 1 ? "" : "s", path);
    }
    return spec->eval.present ? share_with(&spec->eval, &spec->train, ks, n, err) : LOOM_OK;
}

int loom_data_adapt(loom_spec *spec, const char *model_dir, loom_adapt_mode mode, const loom_data_ctx *ctx,
                    loom_err *err)
{
    return loom_data_adapt_from(spec, model_dir, mode, ctx, NULL, err);
}
