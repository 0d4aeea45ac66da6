/* text.c - map(tokenize): a string (uint8 (L,), the bytes up to its trailing
 * zero bytes: a text source's "line", a csv string column) -> int64 ids,
 * Keras TextVectorization's output_mode "int" with a chosen unit:
 *   bytes       id = byte + 1 (1..256; input_dim 257), no vocabulary
 *   utf8_chars  code points: through a vocabulary (adapt = true or
 *               vocabulary_file: ids as below), else id = code point + 1
 *   whitespace, vocabulary  words split on ASCII whitespace, through a
 *               vocabulary (required)
 * With a vocabulary: 0 = padding (Keras' mask token ""), 1 .. num_oov_indices
 * = out of vocabulary (1 is "[UNK]"; several: a hash of the token's bytes),
 * then the vocabulary's tokens in order (adapt: most frequent first; a file:
 * its lines). standardize (ASCII, as Keras' regexes): lower-case and/or strip
 * string.punctuation before the split. Output (n,) varying ("ragged", the
 * default, its largest L) or (output_sequence_length,) padded with 0, longer
 * sequences truncated and counted. Invalid UTF-8 in utf8_chars: replaced with
 * U+FFFD (counted, reported at the pass's end) or an error naming the file
 * and byte offset (when the map reads a text source directly) or the element.
 * Beside a text source's "line", its "length" marks the string's end (the
 * bytes after it are zeros), sparing a scan back over max_length bytes.
 * The stage keeps a cursor (epoch, pos) for messages; its output is a function
 * of its input alone, so its saved state is that cursor.
 * Threads: one thread drives the stage (data_internal.h); tokenize_split_ is
 * reentrant (the adapt pass calls it). */
#include "data/data_internal.h"

#include <stdio.h>
#include <string.h>

typedef struct tokst {
    dstage        s;
    int64_t       epoch, pos;
    loom_map_spec m;
    int           f;        /* the feature tokenized */
    int           len_f;    /* the text source's "length" beside its "line" (the string's end without a scan), or -1 */
    int64_t       L;        /* bytes of one input string (its max) */
    int64_t       cap;      /* ids the output holds */
    int64_t      *ids;      /* (cap,) the lent output */
    uint8_t      *scratch;  /* (L + 4): the standardized string */
    loom_vocab   *file_vocab; /* vocabulary_file's, owned */
    const loom_vocab *vocab;
    int64_t      *vtab;     /* open addressing: token index + 1 */
    uint64_t      vmask;
    int           in_mut[LOOM_MAX_FEATURES];
    /* this pass, reported at its end */
    int64_t       n_seq, n_trunc, longest, n_invalid;
    bool          reported;
} tokst;
DCURSOR_STAGE_CHECK(tokst);

/* ---- splitting ------------------------------------------------------------ */

static bool is_punct(uint8_t c) { return (c >= 33 && c <= 47) || (c >= 58 && c <= 64) || (c >= 91 && c <= 96) || (c >= 123 && c <= 126); }
static bool is_space(uint8_t c) { return c == ' ' || (c >= '\t' && c <= '\r'); }

/* Length of the valid UTF-8 sequence at p (n bytes left) and its code point,
 * or 0 with *bad the bytes of its maximal invalid prefix (at least 1). */
static int utf8_next(const uint8_t *p, size_t n, uint32_t *cp, int *bad)
{
    uint8_t c = p[0];
    int len;
    uint32_t v, lo = 0x80, hi = 0xBF;
    if (c < 0x80) {
        *cp = c;
        return 1;
    }
    if (c >= 0xC2 && c <= 0xDF) len = 2, v = c & 0x1F;
    else if (c >= 0xE0 && c <= 0xEF) len = 3, v = c & 0x0F, lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
    else if (c >= 0xF0 && c <= 0xF4) len = 4, v = c & 0x07, lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
    else {
        *bad = 1;
        return 0;
    }
    for (int k = 1; k < len; k++) {
        uint8_t b = (size_t)k < n ? p[k] : 0;
        if ((size_t)k >= n || b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xBF)) {
            *bad = k; /* the lead and the continuation bytes that fit: one U+FFFD (Unicode's maximal subpart) */
            return 0;
        }
        v = (v << 6) | (b & 0x3F);
    }
    *cp = v;
    return len;
}

/* standardize, its default resolved: none for bytes and code points, Keras' for words. */
static loom_tok_std eff_std(const loom_map_spec *m)
{
    if (m->standardize != LOOM_STD_DEFAULT) return m->standardize;
    return m->tok_mode == LOOM_TOK_WHITESPACE || m->tok_mode == LOOM_TOK_VOCABULARY ? LOOM_STD_LOWER_AND_STRIP : LOOM_STD_NONE;
}

size_t tokenize_standardize_(const loom_map_spec *m, const uint8_t *p, size_t n, uint8_t *out)
{
    loom_tok_std sd = eff_std(m);
    bool lower = sd == LOOM_STD_LOWER || sd == LOOM_STD_LOWER_AND_STRIP;
    bool strip = sd == LOOM_STD_STRIP || sd == LOOM_STD_LOWER_AND_STRIP;
    if (!lower && !strip) {
        memmove(out, p, n);
        return n;
    }
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        uint8_t c = p[i];
        if (strip && is_punct(c)) continue;
        out[k++] = lower && c >= 'A' && c <= 'Z' ? (uint8_t)(c + 32) : c;
    }
    return k;
}

int tokenize_split_(const loom_map_spec *m, const uint8_t *p, size_t n, tok_emit_fn emit, void *ctx, int64_t *invalid)
{
    static const uint8_t fffd[3] = {0xEF, 0xBF, 0xBD};
    int rc;
    switch (m->tok_mode) {
    case LOOM_TOK_BYTES:
        for (size_t i = 0; i < n; i++)
            if ((rc = emit(ctx, p + i, 1, p[i]))) return rc;
        return LOOM_OK;
    case LOOM_TOK_UTF8_CHARS:
        for (size_t i = 0; i < n;) {
            uint32_t cp;
            int bad = 0, len = utf8_next(p + i, n - i, &cp, &bad);
            if (!len) {
                if (invalid) (*invalid)++;
                if ((rc = emit(ctx, fffd, 3, 0xFFFD))) return rc;
                i += (size_t)bad;
                continue;
            }
            if ((rc = emit(ctx, p + i, (size_t)len, cp))) return rc;
            i += (size_t)len;
        }
        return LOOM_OK;
    default: /* words */
        for (size_t i = 0; i < n;) {
            while (i < n && is_space(p[i])) i++;
            size_t s = i;
            while (i < n && !is_space(p[i])) i++;
            if (i > s && (rc = emit(ctx, p + s, i - s, 0))) return rc;
        }
        return LOOM_OK;
    }
}

/* The first invalid UTF-8 byte of p[0..n), or -1. */
static int64_t utf8_first_invalid(const uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        int bad = 0, len = utf8_next(p + i, n - i, &cp, &bad);
        if (!len) return (int64_t)i;
        i += (size_t)len;
    }
    return -1;
}

/* ---- vocabulary ----------------------------------------------------------- */

static int64_t vfind(const tokst *s, const uint8_t *p, size_t n)
{
    const loom_vocab *v = s->vocab;
    for (uint64_t i = loom_data_str_hash(p, n) & s->vmask;; i = (i + 1) & s->vmask) {
        int64_t k = s->vtab[i] - 1;
        if (k < 0) return -1;
        if (v->off[k + 1] - v->off[k] == n && !memcmp(v->data + v->off[k], p, n)) return k;
    }
}

/* The lookup table; a token twice is an error naming where (the file's lines, or the adapted text). */
static int vtable(tokst *s, loom_err *err)
{
    const loom_vocab *v = s->vocab;
    uint64_t size = 16;
    while (size < 2 * (uint64_t)v->n + 2) size *= 2;
    if (!(s->vtab = loom_calloc(size, sizeof *s->vtab)))
        return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate the lookup table of %lld tokens", (long long)v->n);
    s->vmask = size - 1;
    for (int64_t k = 0; k < v->n; k++) {
        const uint8_t *p = (const uint8_t *)v->data + v->off[k];
        size_t n = (size_t)(v->off[k + 1] - v->off[k]);
        int64_t j = vfind(s, p, n);
        if (j >= 0) {
            char w[LOOM_PATH_MAX + 32];
            if (s->file_vocab) snprintf(w, sizeof w, "%s:%lld", s->m.vocabulary_file, (long long)k + 1);
            else snprintf(w, sizeof w, "%s", s->s.where);
            loom_err_set(err, LOOM_EDATA, w, "tokenize: vocabulary token \"%.*s\" appears twice (%s %lld and %lld)",
                         (int)(n > 60 ? 60 : n), (const char *)p, s->file_vocab ? "lines" : "entries",
                         (long long)j + 1, (long long)k + 1);
            return loom_err_hint(err, "a vocabulary lists each token once: remove the duplicate line");
        }
        uint64_t i = loom_data_str_hash(p, n) & s->vmask;
        while (s->vtab[i]) i = (i + 1) & s->vmask;
        s->vtab[i] = k + 1;
    }
    return LOOM_OK;
}

/* vocabulary_file: one token a line ('\n' or "\r\n"), none empty, none twice. */
static int read_vocab_file(tokst *s, loom_err *err)
{
    const char *path = s->m.vocabulary_file;
    uint8_t *text = NULL;
    size_t len = 0;
    int rc = loom_read_file_max(path, &text, &len, (uint64_t)1 << 30, err);
    if (rc) return loom_err_hint(err, "vocabulary_file (at %s) names a file of tokens, one a line", s->s.where);
    int64_t lines = 0;
    for (size_t i = 0; i < len; i++) lines += text[i] == '\n';
    if (len && text[len - 1] != '\n') lines++;
    int64_t room = s->m.max_tokens > 0 ? s->m.max_tokens - 1 - s->m.num_oov_indices : lines;
    int64_t n = lines < room ? lines : room;
    size_t head = (sizeof(loom_vocab) + 7) / 8 * 8;
    loom_vocab *v = loom_calloc(1, head + (size_t)(2 * n + 1) * 8 + len + 1);
    if (!v) {
        loom_free(text);
        return loom_err_set(err, LOOM_ENOMEM, path, "cannot hold a vocabulary of %lld tokens", (long long)n);
    }
    v->off = (uint64_t *)((char *)v + head);
    v->count = (int64_t *)(v->off + n + 1);
    v->data = (char *)(v->count + n);
    size_t i = 0;
    for (int64_t k = 0; k < lines; k++) {
        size_t e = i;
        while (e < len && text[e] != '\n') e++;
        size_t tl = e - i;
        if (tl && text[i + tl - 1] == '\r') tl--;
        if (!tl) {
            char w[LOOM_PATH_MAX + 32];
            snprintf(w, sizeof w, "%s:%lld", path, (long long)k + 1);
            loom_free(text);
            loom_free(v);
            loom_err_set(err, LOOM_EDATA, w, "tokenize: an empty line in the vocabulary (every line is one token; "
                         "id 0 is the padding \"\" already)");
            return loom_err_hint(err, "remove the empty line (a trailing newline at the file's end is fine)");
        }
        if (k < n) {
            memcpy(v->data + v->off[k], text + i, tl);
            v->off[k + 1] = v->off[k] + tl;
        }
        i = e + 1;
    }
    v->n = n;
    loom_free(text);
    s->file_vocab = v;
    s->vocab = v;
    if (lines > n)
        loom_warn("%s: tokenize: max_tokens = %lld keeps the first %lld of the %lld tokens of %s", s->s.where,
                  (long long)s->m.max_tokens, (long long)n, (long long)lines, path);
    return LOOM_OK;
}

/* ---- the stage ------------------------------------------------------------- */

typedef struct emitctx {
    tokst   *s;
    int64_t  n;        /* ids produced (also past cap: counted) */
    int64_t  oov_left; /* num_oov_indices == 0: the first unknown token, for the error */
    const uint8_t *bad;
    size_t   bad_len;
} emitctx;

static int emit_id(void *ctx, const uint8_t *tok, size_t n, uint32_t cp)
{
    emitctx *e = ctx;
    tokst *s = e->s;
    int64_t id;
    if (!s->vocab) {
        id = (int64_t)cp + 1;
    } else {
        int64_t k = vfind(s, tok, n), oov = s->m.num_oov_indices;
        if (k >= 0) id = 1 + oov + k;
        else if (oov > 0) id = 1 + (oov > 1 ? (int64_t)(loom_data_str_hash(tok, n) % (uint64_t)oov) : 0);
        else {
            e->bad = tok;
            e->bad_len = n;
            return LOOM_EDATA;
        }
    }
    if (e->n < s->cap) s->ids[e->n] = id;
    e->n++;
    return LOOM_OK;
}

/* Where element pos of the pass came from: file and byte offset when the input is a text source. */
static int elem_where(const tokst *s, char *buf, size_t n, int64_t byte)
{
    char file[LOOM_PATH_MAX];
    uint64_t off;
    if (text_source_where_(s->s.in, byte, file, sizeof file, &off))
        return snprintf(buf, n, "%s: byte offset %llu", file, (unsigned long long)off);
    return snprintf(buf, n, "element %lld of the pass, byte %lld of \"%s\"", (long long)s->pos, (long long)byte,
                    s->m.feature);
}

static void report(tokst *s)
{
    if (s->reported) return;
    s->reported = true;
    if (s->n_trunc)
        loom_warn("%s: tokenize on \"%s\": %lld of %lld sequences were longer than output_sequence_length = %lld and "
                  "were truncated (the longest had %lld ids)", s->s.where, s->m.feature, (long long)s->n_trunc,
                  (long long)s->n_seq, (long long)s->m.output_sequence_length, (long long)s->longest);
    if (s->n_invalid)
        loom_warn("%s: tokenize on \"%s\": %lld invalid UTF-8 sequence%s replaced with U+FFFD in this pass of %lld "
                  "strings (on_invalid = \"error\" stops at the first)", s->s.where, s->m.feature,
                  (long long)s->n_invalid, s->n_invalid == 1 ? "" : "s", (long long)s->n_seq);
}

static int tok_next(dstage *st, loom_elem **out, loom_err *err)
{
    tokst *s = (tokst *)st;
    loom_elem *e;
    int rc = dstage_next_(st->in, &e, err);
    if (rc == LOOM_EEOF) report(s);
    if (rc) return rc;
    const loom_tensor *t = &e->t[s->f];
    const uint8_t *p = t->data;
    size_t n = (size_t)t->shape.dim[0];
    int64_t known = s->len_f >= 0 ? *(const int64_t *)e->t[s->len_f].data : -1;
    if (known >= 0 && (size_t)known <= n) n = (size_t)known; /* the source zeroed the rest */
    else
        while (n && !p[n - 1]) n--;
    if (s->m.tok_mode == LOOM_TOK_UTF8_CHARS && s->m.on_invalid == LOOM_INVALID_ERROR) {
        int64_t bad = utf8_first_invalid(p, n);
        if (bad >= 0) {
            char w[LOOM_PATH_MAX + 64];
            elem_where(s, w, sizeof w, bad);
            loom_err_set(err, LOOM_EDATA, w, "tokenize: invalid UTF-8 (byte 0x%02X) in \"%s\"", p[bad], s->m.feature);
            return loom_err_hint(err, "fix or re-encode the file, or set on_invalid = \"replace\" (at %s) to count "
                                      "and replace it with U+FFFD", st->where);
        }
    }
    if (eff_std(&s->m) != LOOM_STD_NONE) {
        n = tokenize_standardize_(&s->m, p, n, s->scratch);
        p = s->scratch;
    }
    emitctx ec = {.s = s};
    rc = tokenize_split_(&s->m, p, n, emit_id, &ec, &s->n_invalid);
    if (rc) {
        char w[LOOM_PATH_MAX + 64];
        elem_where(s, w, sizeof w, 0);
        loom_err_set(err, LOOM_EDATA, w, "tokenize on \"%s\": \"%.*s\" is not in the vocabulary (%lld tokens), and "
                     "num_oov_indices = 0", s->m.feature, (int)(ec.bad_len > 60 ? 60 : ec.bad_len),
                     (const char *)ec.bad, (long long)s->vocab->n);
        return loom_err_hint(err, "set num_oov_indices = 1; to map unknown tokens to id 1 (\"[UNK]\")");
    }
    s->n_seq++;
    int64_t len = ec.n;
    if (s->m.output_sequence_length) {
        if (len > s->m.output_sequence_length) {
            s->n_trunc++;
            if (len > s->longest) s->longest = len;
            len = s->m.output_sequence_length;
        }
        for (int64_t i = len; i < s->cap; i++) s->ids[i] = 0;
        len = s->m.output_sequence_length;
    }
    LOOM_ASSERT(len <= s->cap);
    loom_elem *o = &st->out;
    elem_copy_(o, e);
    o->t[s->f] = (loom_tensor){.dtype = LOOM_I64, .shape = {.rank = 1, .dim = {len}}, .data = s->ids};
    memcpy(st->mut, st->in->mut, sizeof st->mut);
    st->mut[s->f] = 1;
    s->pos++;
    *out = o;
    return LOOM_OK;
}

static int tok_rewind(dstage *st, int64_t epoch, loom_err *err)
{
    tokst *s = (tokst *)st;
    s->n_seq = s->n_trunc = s->longest = s->n_invalid = 0;
    s->reported = false;
    return dcursor_stage_rewind_(st, epoch, err);
}

static void tok_close(dstage *st)
{
    tokst *s = (tokst *)st;
    loom_free(s->ids);
    loom_free(s->scratch);
    loom_free(s->vtab);
    loom_free(s->file_vocab);
    loom_free(s);
}

static const dstage_ops tok_ops = {
    .next = tok_next, .rewind = tok_rewind, .save = dcursor_stage_save_, .restore = dcursor_stage_restore_,
    .close = tok_close,
};

int tokenize_open_(dstage **out, dstage *in, int id, const loom_transform_spec *t, loom_err *err)
{
    tokst *s = loom_calloc(1, sizeof *s);
    if (!s) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a tokenize stage");
    dstage *st = &s->s;
    dstage_init_(st, &tok_ops, in, id, &t->loc);
    snprintf(st->name, sizeof st->name, "map(tokenize)");
    s->m = t->map;
    s->m.vocab_owned = false;
    int rc = LOOM_OK;
    char a[128];
    s->f = loom_elem_spec_find(&st->spec, s->m.feature);
    if (s->f < 0) {
        rc = dstage_err_(st, err, LOOM_ECONFIG, "map(tokenize): no feature \"%s\" reaches it", s->m.feature);
        goto fail;
    }
    loom_shape *sh = &st->spec.shape[s->f], *mx = &st->maxshape[s->f];
    if (st->spec.dtype[s->f] != LOOM_U8 || sh->rank != 1 || st->batch_dims) {
        rc = dstage_err_(st, err, LOOM_ESHAPE, "map(tokenize) needs one string per element (uint8 (L,), unbatched), "
                         "\"%s\" is %s %s%s", s->m.feature, loom_dtype_name(st->spec.dtype[s->f]),
                         loom_shape_str(sh, a, sizeof a), st->batch_dims ? " (batched)" : "");
        loom_err_hint(err, "strings come from the text source's \"line\" or a csv column with dtype = \"string\"; "
                           "tokenize before batch");
        goto fail;
    }
    s->L = mx->dim[0];
    /* a text source's line ends at its length (the bytes after it are zeros): no scan back over max_length */
    s->len_f = -1;
    int lf = loom_elem_spec_find(&st->spec, "length");
    if (!strcmp(s->m.feature, "line") && lf >= 0 && st->spec.dtype[lf] == LOOM_I64 && st->spec.shape[lf].rank == 0)
        s->len_f = lf;
    bool words = s->m.tok_mode == LOOM_TOK_WHITESPACE || s->m.tok_mode == LOOM_TOK_VOCABULARY;
    if (s->m.vocabulary_file[0]) {
        if ((rc = read_vocab_file(s, err))) goto fail;
    } else if (s->m.adapt) {
        if (!s->m.vocab) {
            rc = dstage_err_(st, err, LOOM_ECONFIG, "map(tokenize) on \"%s\": adapt = true, but no vocabulary was "
                             "adapted from data.train for it", s->m.feature);
            loom_err_hint(err, "loom train adapts it (and keeps it in model_dir/adapt.txt and its checkpoints) before "
                               "evaluate, predict or export can use it");
            goto fail;
        }
        s->vocab = s->m.vocab;
    } else if (words) {
        rc = dstage_err_(st, err, LOOM_ECONFIG, "map(tokenize): words need a vocabulary (vocabulary_file or adapt = true)");
        goto fail;
    }
    if (s->vocab && (rc = vtable(s, err))) goto fail;
    s->cap = s->m.output_sequence_length ? (s->m.output_sequence_length > s->L ? s->m.output_sequence_length : s->L)
                                         : (s->L ? s->L : 1);
    s->ids = loom_alloc_aligned((size_t)s->cap * sizeof *s->ids);
    s->scratch = loom_alloc((size_t)s->L + 4);
    if (!s->ids || !s->scratch) {
        rc = loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate %lld ids for map(tokenize)", (long long)s->cap);
        goto fail;
    }
    dstage_gauge_(&st->st_bytes, s->cap * 8 + s->L);
    st->spec.dtype[s->f] = LOOM_I64;
    sh->dim[0] = s->m.output_sequence_length ? s->m.output_sequence_length : -1;
    mx->dim[0] = s->m.output_sequence_length ? s->m.output_sequence_length : (s->L ? s->L : 1);
    st->card = in->card;
    snprintf(st->desc, sizeof st->desc, "map(tokenize,%s,%s,%s,%d,%lld,%lld,%016llx)", s->m.feature,
             loom_tok_mode_name(s->m.tok_mode), loom_tok_std_name(eff_std(&s->m)), s->m.num_oov_indices,
             (long long)s->m.output_sequence_length, s->vocab ? (long long)s->vocab->n : -1LL,
             s->vocab ? (unsigned long long)loom_data_str_hash((const uint8_t *)s->vocab->data, s->vocab->off[s->vocab->n]) : 0ULL);
    *out = st;
    return LOOM_OK;
fail:
    tok_close(st);
    return rc;
}

/* ---- the tokenizer outside a pipeline (data.h) -------------------------------------- */

struct loom_tokenizer {
    tokst s; /* a stage never opened: its settings, vocabulary and scratch */
};

int loom_tokenizer_new(loom_tokenizer **out, const loom_map_spec *m, loom_err *err)
{
    *out = NULL;
    loom_tokenizer *t = loom_calloc(1, sizeof *t);
    if (!t) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot allocate a tokenizer");
    tokst *s = &t->s;
    s->m = *m;
    s->m.vocab_owned = false;
    int rc = LOOM_OK;
    if (m->vocabulary_file[0]) rc = read_vocab_file(s, err);
    else if (m->adapt && !m->vocab)
        rc = loom_err_set(err, LOOM_ECONFIG, NULL, "tokenize on \"%s\": adapt = true, but no vocabulary was adapted",
                          m->feature);
    else s->vocab = m->adapt ? m->vocab : NULL;
    if (!rc && (m->tok_mode == LOOM_TOK_WHITESPACE || m->tok_mode == LOOM_TOK_VOCABULARY) && !s->vocab)
        rc = loom_err_set(err, LOOM_ECONFIG, NULL, "tokenize: words need a vocabulary (vocabulary_file or adapt = true)");
    if (!rc && s->vocab) rc = vtable(s, err);
    if (rc) {
        loom_tokenizer_free(t);
        return rc;
    }
    *out = t;
    return LOOM_OK;
}

void loom_tokenizer_free(loom_tokenizer *t)
{
    if (!t) return;
    loom_free(t->s.ids);
    loom_free(t->s.scratch);
    loom_free(t->s.vtab);
    loom_free(t->s.file_vocab);
    loom_free(t);
}

int64_t loom_tokenizer_size(const loom_tokenizer *t)
{
    const tokst *s = &t->s;
    if (s->vocab) return 1 + s->m.num_oov_indices + s->vocab->n;
    return s->m.tok_mode == LOOM_TOK_BYTES ? 257 : 0x110001;
}

int loom_tokenizer_encode(loom_tokenizer *t, const uint8_t *text, size_t n, int64_t *ids, int64_t cap, int64_t *n_ids,
                          int64_t *n_oov, loom_err *err)
{
    tokst *s = &t->s;
    uint8_t *buf = loom_alloc(n + 4);
    if (!buf) return loom_err_set(err, LOOM_ENOMEM, NULL, "cannot tokenize %zu bytes", n);
    size_t len = tokenize_standardize_(&s->m, text, n, buf);
    s->ids = ids; /* emit_id writes the first cap ids there */
    s->cap = cap;
    emitctx ec = {.s = s};
    int rc = tokenize_split_(&s->m, buf, len, emit_id, &ec, NULL);
    s->ids = NULL;
    int64_t oov = 0, first = 1 + s->m.num_oov_indices;
    for (int64_t i = 0; s->vocab && i < (ec.n < cap ? ec.n : cap); i++) oov += ids[i] < first;
    if (rc) {
        loom_err_set(err, LOOM_EDATA, NULL, "tokenize: \"%.*s\" is not in the vocabulary (%lld tokens), and "
                     "num_oov_indices = 0", (int)(ec.bad_len > 60 ? 60 : ec.bad_len), (const char *)ec.bad,
                     (long long)s->vocab->n);
        loom_free(buf);
        return rc;
    }
    loom_free(buf);
    *n_ids = ec.n;
    if (n_oov) *n_oov = oov;
    return LOOM_OK;
}

int loom_tokenizer_decode(const loom_tokenizer *t, int64_t id, char *buf, size_t cap)
{
    const tokst *s = &t->s;
    const char *p;
    size_t n;
    char u[4];
    if (id <= 0 || id >= loom_tokenizer_size(t)) return -1;
    if (s->vocab && id <= s->m.num_oov_indices) {
        p = "[UNK]";
        n = 5;
    } else if (s->vocab) {
        int64_t k = id - 1 - s->m.num_oov_indices;
        p = s->vocab->data + s->vocab->off[k];
        n = (size_t)(s->vocab->off[k + 1] - s->vocab->off[k]);
    } else if (s->m.tok_mode == LOOM_TOK_BYTES) {
        u[0] = (char)(id - 1);
        p = u;
        n = 1;
    } else { /* a code point as UTF-8 */
        uint32_t c = (uint32_t)(id - 1);
        if (c >= 0xD800 && c <= 0xDFFF) return -1;
        n = c < 0x80 ? 1 : c < 0x800 ? 2 : c < 0x10000 ? 3 : 4;
        if (n == 1) u[0] = (char)c;
        else if (n == 2) u[0] = (char)(0xC0 | (c >> 6)), u[1] = (char)(0x80 | (c & 0x3F));
        else if (n == 3) u[0] = (char)(0xE0 | (c >> 12)), u[1] = (char)(0x80 | ((c >> 6) & 0x3F)), u[2] = (char)(0x80 | (c & 0x3F));
        else u[0] = (char)(0xF0 | (c >> 18)), u[1] = (char)(0x80 | ((c >> 12) & 0x3F)), u[2] = (char)(0x80 | ((c >> 6) & 0x3F)),
             u[3] = (char)(0x80 | (c & 0x3F));
        p = u;
    }
    if (n > cap) n = cap;
    memcpy(buf, p, n);
    return (int)n;
}
