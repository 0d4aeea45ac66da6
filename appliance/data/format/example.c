/* example.c - a hand-written tf.train.Example codec (tf_semantics §1.6-1.7):
 * a validating zero-copy parser (features by name -> spans of the input),
 * typed extraction against a declared parse spec, and an encoder that writes
 * packed lists as TF does. Every read is bounds-checked: malformed input is
 * an error, never an over-read.
 * Threads: the structs here belong to one thread at a time. */
#include "data/data.h"

#include <stdio.h>
#include <string.h>

/* ---- protobuf wire reading ----------------------------------------------- */

enum { WT_VARINT = 0, WT_I64 = 1, WT_LEN = 2, WT_I32 = 5 };

typedef struct pb {
    const uint8_t *p, *end;
    const uint8_t *base; /* start of the whole Example, for offsets in messages */
    loom_err      *err;
} pb;

static int pb_fail(pb *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int pb_fail(pb *r, const char *fmt, ...)
{
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    loom_err_set(r->err, LOOM_EDATA, NULL, "malformed tf.train.Example: %s (at byte %td)", what, r->p - r->base);
    return LOOM_EDATA;
}

static inline int pb_varint(pb *r, uint64_t *v)
{
    if (r->p < r->end && *r->p < 0x80) { /* one byte: keys, small lengths and values */
        *v = *r->p++;
        return LOOM_OK;
    }
    uint64_t x = 0;
    *v = 0;
    for (int i = 0; i < 10; i++) {
        if (r->p >= r->end) return pb_fail(r, "truncated varint");
        uint8_t b = *r->p++;
        x |= (uint64_t)(b & 0x7f) << (7 * i);
        if (!(b & 0x80)) {
            *v = x;
            return LOOM_OK;
        }
    }
    return pb_fail(r, "varint longer than 10 bytes");
}

/* Reads a key; *field and *wt. Field 0 and groups are malformed here. */
static int pb_key(pb *r, uint32_t *field, int *wt)
{
    uint64_t k = 0;
    *field = 0;
    *wt = 0;
    int rc = pb_varint(r, &k);
    if (rc) return rc;
    *wt = (int)(k & 7);
    if (k >> 3 == 0 || k >> 3 > 0x1fffffff) return pb_fail(r, "invalid field number %llu", (unsigned long long)(k >> 3));
    *field = (uint32_t)(k >> 3);
    return LOOM_OK;
}

/* A length-delimited value: a sub-reader over its bytes. */
static int pb_len(pb *r, pb *sub)
{
    uint64_t n = 0;
    *sub = (pb){r->p, r->p, r->base, r->err};
    int rc = pb_varint(r, &n);
    if (rc) return rc;
    if (n > (uint64_t)(r->end - r->p))
        return pb_fail(r, "length %llu runs past the end of its message (%td bytes left)", (unsigned long long)n, r->end - r->p);
    *sub = (pb){r->p, r->p + n, r->base, r->err};
    r->p += n;
    return LOOM_OK;
}

static int pb_skip(pb *r, int wt, uint32_t field)
{
    uint64_t v;
    pb sub;
    size_t n;
    switch (wt) {
    case WT_VARINT: return pb_varint(r, &v);
    case WT_LEN: return pb_len(r, &sub);
    case WT_I64: n = 8; break;
    case WT_I32: n = 4; break;
    default: return pb_fail(r, "field %u has wire type %d (groups and types 6/7 are not valid here)", field, wt);
    }
    if ((size_t)(r->end - r->p) < n) return pb_fail(r, "truncated fixed%zu field %u", n * 8, field);
    r->p += n;
    return LOOM_OK;
}

static int pb_want(pb *r, const char *what, int wt, int want)
{
    return pb_fail(r, "%s has wire type %d, expected %d", what, wt, want);
}

/* ---- names --------------------------------------------------------------- */

const char *loom_feature_kind_name(loom_feature_kind k)
{
    static const char *const names[] = {"no kind (empty Feature)", "bytes_list", "float_list", "int64_list"};
    return (unsigned)k <= LOOM_FEATURE_INT64 ? names[k] : "?";
}

/* ---- parsing ------------------------------------------------------------- */

/* Counts the values of one list message of the given kind. */
static int count_list(pb *r, loom_feature_kind kind, int64_t *count, int64_t *bytes)
{
    static const char *const what[] = {"", "BytesList.value", "FloatList.value", "Int64List.value"};
    while (r->p < r->end) {
        uint32_t field;
        int wt, rc;
        if ((rc = pb_key(r, &field, &wt))) return rc;
        if (field != 1) {
            if ((rc = pb_skip(r, wt, field))) return rc;
            continue;
        }
        pb sub;
        if (kind == LOOM_FEATURE_BYTES) {
            if (wt != WT_LEN) return pb_want(r, what[kind], wt, WT_LEN);
            if ((rc = pb_len(r, &sub))) return rc;
            (*count)++;
            *bytes += sub.end - sub.p;
        } else if (kind == LOOM_FEATURE_FLOAT) {
            if (wt == WT_I32) {
                if (r->end - r->p < 4) return pb_fail(r, "truncated float");
                r->p += 4;
                (*count)++;
            } else if (wt == WT_LEN) {
                if ((rc = pb_len(r, &sub))) return rc;
                if ((sub.end - sub.p) % 4) return pb_fail(r, "packed FloatList of %td bytes is not a multiple of 4", sub.end - sub.p);
                *count += (sub.end - sub.p) / 4;
            } else {
                return pb_want(r, what[kind], wt, WT_LEN);
            }
        } else {
            uint64_t v;
            if (wt == WT_VARINT) {
                if ((rc = pb_varint(r, &v))) return rc;
                (*count)++;
            } else if (wt == WT_LEN) {
                if ((rc = pb_len(r, &sub))) return rc;
                while (sub.p < sub.end) {
                    if ((rc = pb_varint(&sub, &v))) return rc;
                    (*count)++;
                }
            } else {
                return pb_want(r, what[kind], wt, WT_LEN);
            }
        }
    }
    return LOOM_OK;
}

/* Walks a Feature message, merging into (kind, count, bytes): a list of the
 * current kind appends, another kind replaces (oneof semantics). */
static int parse_feature(pb *r, loom_example_feature *f)
{
    static const char *const what[] = {"", "Feature.bytes_list", "Feature.float_list", "Feature.int64_list"};
    while (r->p < r->end) {
        uint32_t field;
        int wt, rc;
        if ((rc = pb_key(r, &field, &wt))) return rc;
        if (field < 1 || field > 3) {
            if ((rc = pb_skip(r, wt, field))) return rc;
            continue;
        }
        loom_feature_kind kind = (loom_feature_kind)field; /* 1 bytes, 2 float, 3 int64 */
        if (wt != WT_LEN) return pb_want(r, what[kind], wt, WT_LEN);
        pb sub;
        if ((rc = pb_len(r, &sub))) return rc;
        if (f->kind != kind) {
            f->kind = kind;
            f->count = f->bytes_total = 0;
        }
        if ((rc = count_list(&sub, kind, &f->count, &f->bytes_total))) return rc;
    }
    return LOOM_OK;
}

static uint32_t hash_name(const uint8_t *p, size_t n)
{
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 16777619u;
    return h;
}

/* Slot of name in the hash table: its feature index, or the empty slot. */
static int32_t *hash_slot(const loom_example *ex, const uint8_t *name, size_t n)
{
    uint32_t mask = (uint32_t)ex->hcap_ - 1;
    for (uint32_t i = hash_name(name, n) & mask;; i = (i + 1) & mask) {
        int32_t *s = &ex->hash_[i];
        if (*s < 0) return s;
        const loom_bytes_view *k = &ex->f[*s].name;
        if (k->len == n && (n == 0 || !memcmp(k->data, name, n))) return s;
    }
}

static int add_feature(loom_example *ex, const loom_example_feature *f, loom_err *err)
{
    if ((int64_t)(ex->n + 1) * 2 > ex->hcap_) {
        int hcap = ex->hcap_ ? ex->hcap_ * 2 : 64;
        int32_t *h = loom_realloc(ex->hash_, (size_t)hcap * sizeof *h);
        if (!h) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot grow the Example feature table");
        ex->hash_ = h;
        ex->hcap_ = hcap;
        memset(h, 0xff, (size_t)hcap * sizeof *h);
        for (int i = 0; i < ex->n; i++) *hash_slot(ex, ex->f[i].name.data, ex->f[i].name.len) = i;
    }
    int32_t *slot = hash_slot(ex, f->name.data, f->name.len);
    if (*slot >= 0) { /* duplicate map key: the last entry wins */
        ex->f[*slot] = *f;
        return LOOM_OK;
    }
    if (ex->n == ex->cap) {
        int cap = ex->cap ? ex->cap * 2 : 16;
        loom_example_feature *nf = loom_realloc(ex->f, (size_t)cap * sizeof *nf);
        if (!nf) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot grow the Example feature table");
        ex->f = nf;
        ex->cap = cap;
    }
    *slot = ex->n;
    ex->f[ex->n++] = *f;
    return LOOM_OK;
}

/* One map entry {key = 1; value = 2}; fields in any order, repeated values merged. */
static int parse_entry(pb *r, loom_example *ex)
{
    loom_example_feature f = {.name = {(const uint8_t *)"", 0}, .entry_ = {r->p, (size_t)(r->end - r->p)}};
    while (r->p < r->end) {
        uint32_t field;
        int wt, rc;
        if ((rc = pb_key(r, &field, &wt))) return rc;
        pb sub;
        if (field == 1 || field == 2) {
            if (wt != WT_LEN) return pb_want(r, field == 1 ? "Features.feature key" : "Features.feature value", wt, WT_LEN);
            if ((rc = pb_len(r, &sub))) return rc;
            if (field == 1) f.name = (loom_bytes_view){sub.p, (size_t)(sub.end - sub.p)};
            else if ((rc = parse_feature(&sub, &f))) return rc;
        } else if ((rc = pb_skip(r, wt, field))) {
            return rc;
        }
    }
    return add_feature(ex, &f, r->err);
}

void loom_example_init(loom_example *ex) { memset(ex, 0, sizeof *ex); }

void loom_example_fini(loom_example *ex)
{
    loom_free(ex->f);
    loom_free(ex->hash_);
    memset(ex, 0, sizeof *ex);
}

int loom_example_parse(loom_example *ex, const uint8_t *data, size_t len, loom_err *err)
{
    ex->n = 0;
    if (ex->hash_) memset(ex->hash_, 0xff, (size_t)ex->hcap_ * sizeof *ex->hash_);
    pb r = {data, data + len, data, err};
    while (r.p < r.end) {
        uint32_t field;
        int wt, rc;
        if ((rc = pb_key(&r, &field, &wt))) return rc;
        if (field != 1) {
            if ((rc = pb_skip(&r, wt, field))) return rc;
            continue;
        }
        if (wt != WT_LEN) return pb_want(&r, "Example.features", wt, WT_LEN);
        pb feats;
        if ((rc = pb_len(&r, &feats))) return rc;
        while (feats.p < feats.end) { /* Features seen twice are merged */
            if ((rc = pb_key(&feats, &field, &wt))) return rc;
            if (field != 1) {
                if ((rc = pb_skip(&feats, wt, field))) return rc;
                continue;
            }
            if (wt != WT_LEN) return pb_want(&feats, "Features.feature", wt, WT_LEN);
            pb entry;
            if ((rc = pb_len(&feats, &entry)) || (rc = parse_entry(&entry, ex))) return rc;
        }
    }
    return LOOM_OK;
}

const loom_example_feature *loom_example_find(const loom_example *ex, const char *name)
{
    if (!ex->hcap_) return NULL;
    int32_t i = *hash_slot(ex, (const uint8_t *)name, strlen(name));
    return i >= 0 ? &ex->f[i] : NULL;
}

/* ---- value extraction ---------------------------------------------------- */

/* Where values of one kind go while walking a validated entry again. */
typedef struct sink {
    loom_feature_kind kind;
    void             *out;   /* float / int64_t / loom_bytes_view */
    int64_t           max, i;
} sink;

static void put_float(sink *s, float v)
{
    if (s->i < s->max) ((float *)s->out)[s->i] = v;
    s->i++;
}

static void put_int64(sink *s, int64_t v)
{
    if (s->i < s->max) ((int64_t *)s->out)[s->i] = v;
    s->i++;
}

static void put_bytes(sink *s, loom_bytes_view v)
{
    if (s->i < s->max) ((loom_bytes_view *)s->out)[s->i] = v;
    s->i++;
}

static float le_float(const uint8_t *p)
{
    uint32_t u = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* The entry was validated by parse: errors here only stop the walk. */
static void walk_list(pb *r, sink *s)
{
    while (r->p < r->end) {
        uint32_t field;
        int wt;
        if (pb_key(r, &field, &wt)) return;
        if (field != 1) {
            if (pb_skip(r, wt, field)) return;
            continue;
        }
        pb sub;
        if (wt == WT_LEN) {
            if (pb_len(r, &sub)) return;
            if (s->kind == LOOM_FEATURE_BYTES) {
                put_bytes(s, (loom_bytes_view){sub.p, (size_t)(sub.end - sub.p)});
            } else if (s->kind == LOOM_FEATURE_FLOAT) {
                for (; sub.end - sub.p >= 4; sub.p += 4) put_float(s, le_float(sub.p));
            } else {
                uint64_t v;
                while (sub.p < sub.end && !pb_varint(&sub, &v)) put_int64(s, (int64_t)v);
            }
        } else if (wt == WT_I32 && s->kind == LOOM_FEATURE_FLOAT && r->end - r->p >= 4) {
            put_float(s, le_float(r->p));
            r->p += 4;
        } else if (wt == WT_VARINT && s->kind == LOOM_FEATURE_INT64) {
            uint64_t v;
            if (pb_varint(r, &v)) return;
            put_int64(s, (int64_t)v);
        } else {
            return;
        }
    }
}

static int64_t walk_entry(const loom_example_feature *f, sink *s)
{
    if (f->kind != s->kind) return 0;
    pb r = {f->entry_.data, f->entry_.data + f->entry_.len, f->entry_.data, NULL};
    loom_feature_kind cur = LOOM_FEATURE_NONE;
    while (r.p < r.end) {
        uint32_t field;
        int wt;
        pb val;
        if (pb_key(&r, &field, &wt)) break;
        if (field != 2 || wt != WT_LEN) {
            if (pb_skip(&r, wt, field)) break;
            continue;
        }
        if (pb_len(&r, &val)) break;
        while (val.p < val.end) {
            pb list;
            if (pb_key(&val, &field, &wt)) break;
            if (field < 1 || field > 3 || wt != WT_LEN) {
                if (pb_skip(&val, wt, field)) break;
                continue;
            }
            if (pb_len(&val, &list)) break;
            if ((loom_feature_kind)field != cur) { /* oneof switch: start over */
                cur = (loom_feature_kind)field;
                s->i = 0;
            }
            if (cur == s->kind) walk_list(&list, s);
        }
    }
    return s->i < s->max ? s->i : s->max;
}

int64_t loom_example_floats(const loom_example_feature *f, float *out, int64_t max)
{
    sink s = {LOOM_FEATURE_FLOAT, out, max, 0};
    return walk_entry(f, &s);
}

int64_t loom_example_int64s(const loom_example_feature *f, int64_t *out, int64_t max)
{
    sink s = {LOOM_FEATURE_INT64, out, max, 0};
    return walk_entry(f, &s);
}

int64_t loom_example_bytes(const loom_example_feature *f, loom_bytes_view *out, int64_t max)
{
    sink s = {LOOM_FEATURE_BYTES, out, max, 0};
    return walk_entry(f, &s);
}

/* ---- parse spec ---------------------------------------------------------- */

static const char *const parse_dtype_names[] = {"float32", "int64", "uint8 (raw bytes)", "bytes"};
static const loom_feature_kind parse_kind[] = {LOOM_FEATURE_FLOAT, LOOM_FEATURE_INT64, LOOM_FEATURE_BYTES, LOOM_FEATURE_BYTES};
static const size_t parse_esize[] = {sizeof(float), sizeof(int64_t), 1, sizeof(loom_bytes_view)};

static void fill(loom_parse_dtype dt, void *out, int64_t from, int64_t to, double v)
{
    for (int64_t i = from; i < to; i++) {
        switch (dt) {
        case LOOM_PARSE_F32: ((float *)out)[i] = (float)v; break;
        case LOOM_PARSE_I64: ((int64_t *)out)[i] = (int64_t)v; break;
        case LOOM_PARSE_U8_BYTES: ((uint8_t *)out)[i] = (uint8_t)v; break;
        case LOOM_PARSE_BYTES: ((loom_bytes_view *)out)[i] = (loom_bytes_view){(const uint8_t *)"", 0}; break;
        }
    }
}

static int extract_one(const loom_example *ex, const loom_feature_spec *s, int64_t record, loom_feature_out *o, loom_err *err)
{
    LOOM_ASSERT(s->name && (unsigned)s->dtype <= LOOM_PARSE_BYTES && o->data);
    char shp[96]; /* the shape in words, formatted only for an error (SHP_) */
#define SHP_ loom_shape_str(&s->shape, shp, sizeof shp)
    int64_t numel, bytes;
    if (s->shape.rank < 0 || s->shape.rank > LOOM_MAX_RANK || !loom_dims_ok(s->shape.dim, s->shape.rank, &numel) ||
        !loom_mul_ok(numel, (int64_t)parse_esize[s->dtype], &bytes))
        return loom_err_set(err, LOOM_ESHAPE, NULL, "feature \"%s\": shape %s has no size that fits in memory", s->name,
                            s->shape.rank >= 0 && s->shape.rank <= LOOM_MAX_RANK ? SHP_ : "(bad rank)");
    const char *dtn = parse_dtype_names[s->dtype];
    loom_feature_kind want = parse_kind[s->dtype];
    const loom_example_feature *f = loom_example_find(ex, s->name);
    o->length = 0;
    if (!f || f->kind == LOOM_FEATURE_NONE) {
        if (s->required)
            return loom_err_set(err, LOOM_EDATA, NULL, "record %lld: feature \"%s\": required but missing (expected %s %s %s)",
                                (long long)record, s->name, loom_feature_kind_name(want), dtn, SHP_);
        if (s->default_data && !s->var_len) memcpy(o->data, s->default_data, (size_t)bytes);
        else fill(s->dtype, o->data, 0, numel, s->var_len ? s->pad_value : s->default_value);
        return LOOM_OK;
    }
    if (f->kind != want)
        return loom_err_set(err, LOOM_EDATA, NULL, "record %lld: feature \"%s\": expected %s (%s %s), found %s with %lld values",
                            (long long)record, s->name, loom_feature_kind_name(want), dtn, SHP_,
                            loom_feature_kind_name(f->kind), (long long)f->count);
    int64_t have = f->count;
    loom_bytes_view raw;
    if (s->dtype == LOOM_PARSE_U8_BYTES) {
        if (f->count != 1)
            return loom_err_set(err, LOOM_EDATA, NULL, "record %lld: feature \"%s\": expected 1 bytes value holding %lld raw uint8 %s, "
                                "found %lld bytes values", (long long)record, s->name, (long long)numel, SHP_, (long long)f->count);
        loom_example_bytes(f, &raw, 1);
        have = (int64_t)raw.len;
    }
    if (s->var_len ? have > numel : have != numel) {
        loom_err_set(err, LOOM_EDATA, NULL, "record %lld: feature \"%s\": expected %s%lld %s %s, found %lld",
                     (long long)record, s->name, s->var_len ? "at most " : "", (long long)numel,
                     s->dtype == LOOM_PARSE_U8_BYTES ? "bytes for" : "values of", dtn, (long long)have);
        /* encoded images stored the TensorFlow way (tf.io.encode_png) look like this: say so */
        static const uint8_t png_sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
        const char *img = s->dtype != LOOM_PARSE_U8_BYTES ? NULL
                          : raw.len >= 8 && !memcmp(raw.data, png_sig, 8) ? "PNG"
                          : raw.len >= 3 && raw.data[0] == 0xFF && raw.data[1] == 0xD8 && raw.data[2] == 0xFF ? "JPEG" : NULL;
        if (img)
            /* (only this record is known here: N bounds every record's size, which later ones may exceed) */
            loom_err_hint(err, "it holds a %s image, not raw pixels: declare it { dtype = \"uint8\"; shape = [N]; var_len = "
                          "true; } with N >= every record's encoded size (this one's is %lld bytes) and decode it with "
                          "map fn = \"decode_image\"", img, (long long)have);
        return err->code;
    }
    switch (s->dtype) {
    case LOOM_PARSE_F32: loom_example_floats(f, o->data, numel); break;
    case LOOM_PARSE_I64: loom_example_int64s(f, o->data, numel); break;
    case LOOM_PARSE_U8_BYTES: if (have) memcpy(o->data, raw.data, (size_t)have); break;
    case LOOM_PARSE_BYTES: loom_example_bytes(f, o->data, numel); break;
    }
    fill(s->dtype, o->data, have, numel, s->pad_value);
    o->length = have;
    return LOOM_OK;
#undef SHP_
}

int loom_example_extract(const loom_example *ex, const loom_feature_spec *spec, int n, int64_t record,
                         loom_feature_out *out, loom_err *err)
{
    for (int i = 0; i < n; i++) {
        int rc = extract_one(ex, &spec[i], record, &out[i], err);
        if (rc) return rc;
    }
    return LOOM_OK;
}

/* ---- the fast path -------------------------------------------------------- */

bool loom_example_fast_learn(loom_example_fast *fp, const loom_example *ex, const loom_feature_spec *spec, int n)
{
    if (n < 1 || n > LOOM_MAX_FEATURES || ex->n != n) return false; /* an entry not declared, or one missing */
    int16_t order[LOOM_MAX_FEATURES];
    for (int k = 0; k < n; k++) {
        const loom_bytes_view *name = &ex->f[k].name;
        int j = 0;
        while (j < n && (strlen(spec[j].name) != name->len || memcmp(spec[j].name, name->data, name->len))) j++;
        int64_t numel;
        if (j == n || spec[j].dtype == LOOM_PARSE_BYTES || spec[j].shape.rank < 0 || spec[j].shape.rank > LOOM_MAX_RANK ||
            !loom_dims_ok(spec[j].shape.dim, spec[j].shape.rank, &numel))
            return false;
        order[k] = (int16_t)j;
    }
    for (int k = 0; k < n; k++) {
        int j = order[k];
        fp->order[k] = (int16_t)j;
        fp->name_len[j] = strlen(spec[j].name);
        loom_dims_ok(spec[j].shape.dim, spec[j].shape.rank, &fp->numel[j]);
    }
    fp->n = n;
    return true;
}

/* A varint as pb_varint reads it; false when truncated or over 10 bytes. */
static inline bool fast_varint(const uint8_t **pp, const uint8_t *end, uint64_t *v)
{
    const uint8_t *p = *pp;
    if (p < end && *p < 0x80) {
        *v = *p;
        *pp = p + 1;
        return true;
    }
    uint64_t x = 0;
    for (int i = 0; i < 10 && p < end; i++) {
        uint8_t b = *p++;
        x |= (uint64_t)(b & 0x7f) << (7 * i);
        if (!(b & 0x80)) {
            *v = x;
            *pp = p;
            return true;
        }
    }
    return false;
}

/* The tag byte `tag` then a length that fits before end: *sub_end. */
static inline bool fast_len(const uint8_t **pp, const uint8_t *end, uint8_t tag, const uint8_t **sub_end)
{
    uint64_t n;
    if (*pp >= end || **pp != tag) return false;
    (*pp)++;
    if (!fast_varint(pp, end, &n) || n > (uint64_t)(end - *pp)) return false;
    *sub_end = *pp + n;
    return true;
}

bool loom_example_fast_extract(const loom_example_fast *fp, const uint8_t *data, size_t len,
                               const loom_feature_spec *spec, int n, loom_feature_out *out)
{
    if (fp->n != n || n < 1) return false;
    const uint8_t *p = data, *end = data + len, *feats;
    if (!fast_len(&p, end, 0x0a, &feats) || feats != end) return false; /* Example { features = 1 } alone */
    for (int k = 0; k < n; k++) {
        const uint8_t *entry, *key, *feature, *list, *vals;
        if (!fast_len(&p, end, 0x0a, &entry) || !fast_len(&p, entry, 0x0a, &key)) return false;
        int j = fp->order[k];
        const loom_feature_spec *s = &spec[j];
        size_t kl = (size_t)(key - p);
        if (kl != fp->name_len[j] || memcmp(s->name, p, kl)) return false;
        p = key;
        if (!fast_len(&p, entry, 0x12, &feature) || feature != entry) return false; /* value, last */
        /* Feature { one list of the declared kind } */
        uint8_t tag = (uint8_t)(parse_kind[s->dtype] << 3 | WT_LEN);
        if (!fast_len(&p, feature, tag, &list) || list != feature) return false;
        int64_t numel = fp->numel[j], have = 0;
        if (p < list && !(fast_len(&p, list, 0x0a, &vals) && vals == list)) return false; /* one packed value field */
        size_t bytes = p < list ? (size_t)(list - p) : 0;
        switch (s->dtype) {
        case LOOM_PARSE_U8_BYTES:
            if (p == list) return false; /* no value: the general path says so */
            have = (int64_t)bytes;
            if (s->var_len ? have > numel : have != numel) return false;
            if (have) memcpy(out[j].data, p, bytes);
            break;
        case LOOM_PARSE_F32:
            if (bytes % 4) return false;
            have = (int64_t)(bytes / 4);
            if (s->var_len ? have > numel : have != numel) return false;
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
            if (bytes) memcpy(out[j].data, p, bytes);
#else
            for (int64_t i = 0; i < have; i++) ((float *)out[j].data)[i] = le_float(p + 4 * i);
#endif
            break;
        case LOOM_PARSE_I64: {
            const uint8_t *q = p;
            int64_t *o = out[j].data;
            while (q < list) {
                uint64_t v;
                if (have == numel || !fast_varint(&q, list, &v)) return false;
                o[have++] = (int64_t)v;
            }
            if (!s->var_len && have != numel) return false;
            break;
        }
        default: return false;
        }
        fill(s->dtype, out[j].data, have, numel, s->pad_value);
        out[j].length = have;
        p = entry;
    }
    return p == end;
}

int loom_feature_spec_tensor(const loom_feature_spec *s, loom_tensor *t, loom_err *err)
{
    static const int dt[] = {LOOM_F32, LOOM_I64, LOOM_U8, -1};
    if ((unsigned)s->dtype > LOOM_PARSE_BYTES || dt[s->dtype] < 0)
        return loom_err_set(err, LOOM_EUNSUPPORTED, NULL, "feature \"%s\": bytes features have no tensor dtype", s->name);
    int64_t n;
    if (s->shape.rank < 0 || s->shape.rank > LOOM_MAX_RANK || !loom_dims_ok(s->shape.dim, s->shape.rank, &n) ||
        !loom_mul_ok(n, (int64_t)parse_esize[s->dtype], &n) || n > loom_phys_bytes())
        return loom_err_set(err, LOOM_ESHAPE, NULL, "feature \"%s\": its shape has no size that fits in memory", s->name);
    return loom_tensor_init(t, (loom_dtype)dt[s->dtype], &s->shape, err);
}

/* ---- encoding ------------------------------------------------------------ */

static size_t varint_size(uint64_t v)
{
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

static void put_varint(loom_buf *b, uint64_t v)
{
    uint8_t tmp[10];
    size_t n = 0;
    while (v >= 0x80) {
        tmp[n++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    tmp[n++] = (uint8_t)v;
    loom_buf_put(b, tmp, n);
}

static void put_tag_len(loom_buf *b, uint8_t tag, size_t len)
{
    loom_buf_put(b, &tag, 1);
    put_varint(b, len);
}

void loom_example_builder_init(loom_example_builder *b)
{
    loom_buf_init(&b->body);
    loom_buf_init(&b->out);
}

void loom_example_builder_fini(loom_example_builder *b)
{
    loom_buf_fini(&b->body);
    loom_buf_fini(&b->out);
}

void loom_example_builder_reset(loom_example_builder *b)
{
    b->body.len = b->body.pos = 0;
    b->body.failed = 0;
}

/* Entry header for a Feature whose list (tag list_tag) has payload P bytes. */
static void begin_entry(loom_example_builder *b, const char *name, uint8_t list_tag, size_t P)
{
    size_t klen = strlen(name);
    size_t F = 1 + varint_size(P) + P;                         /* Feature { list } */
    size_t E = 1 + varint_size(klen) + klen + 1 + varint_size(F) + F; /* entry { key, value } */
    put_tag_len(&b->body, 0x0a, E);
    put_tag_len(&b->body, 0x0a, klen);
    loom_buf_put(&b->body, name, klen);
    put_tag_len(&b->body, 0x12, F);
    put_tag_len(&b->body, list_tag, P);
}

void loom_example_add_bytes(loom_example_builder *b, const char *name, const loom_bytes_view *v, int64_t n)
{
    size_t P = 0;
    for (int64_t i = 0; i < n; i++) P += 1 + varint_size(v[i].len) + v[i].len;
    begin_entry(b, name, 0x0a, P);
    for (int64_t i = 0; i < n; i++) {
        put_tag_len(&b->body, 0x0a, v[i].len);
        loom_buf_put(&b->body, v[i].data, v[i].len);
    }
}

void loom_example_add_floats(loom_example_builder *b, const char *name, const float *v, int64_t n)
{
    size_t data = (size_t)n * 4;
    begin_entry(b, name, 0x12, n ? 1 + varint_size(data) + data : 0);
    if (!n) return; /* an empty packed field is omitted, as protobuf writes it */
    put_tag_len(&b->body, 0x0a, data);
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &v[i], 4);
        uint8_t le[4] = {(uint8_t)u, (uint8_t)(u >> 8), (uint8_t)(u >> 16), (uint8_t)(u >> 24)};
        loom_buf_put(&b->body, le, 4);
    }
}

void loom_example_add_int64s(loom_example_builder *b, const char *name, const int64_t *v, int64_t n)
{
    size_t data = 0;
    for (int64_t i = 0; i < n; i++) data += varint_size((uint64_t)v[i]);
    begin_entry(b, name, 0x1a, n ? 1 + varint_size(data) + data : 0);
    if (!n) return;
    put_tag_len(&b->body, 0x0a, data);
    for (int64_t i = 0; i < n; i++) put_varint(&b->body, (uint64_t)v[i]);
}

int loom_example_finish(loom_example_builder *b, const uint8_t **data, size_t *len, loom_err *err)
{
    b->out.len = b->out.pos = 0;
    b->out.failed = 0;
    put_tag_len(&b->out, 0x0a, b->body.len);
    if (b->body.len) loom_buf_put(&b->out, b->body.data, b->body.len);
    if (b->body.failed || b->out.failed) {
        *data = NULL;
        *len = 0;
        return loom_err_set(err, LOOM_ENOMEM, NULL, "out of memory building a tf.train.Example");
    }
    *data = b->out.data;
    *len = b->out.len;
    return LOOM_OK;
}
