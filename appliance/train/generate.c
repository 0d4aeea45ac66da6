/* generate.c - `loom generate`: a language model's checkpoint sampled token
 * by token from a prompt (nn.h loom_decoder), the prompt tokenised and the
 * tokens detokenised by data.train's tokenize map with its adapted
 * vocabulary (data.h loom_tokenizer), each token written and flushed as it
 * is drawn (never padding nor an OOV id). Threads: the caller's (the model runs on one). */
#include "run_internal.h"

#include <errno.h>
#include <string.h>

/* data.train's tokenize map: the first (it makes the model's ids). */
static const loom_map_spec *find_tokenize(const loom_spec *spec, loom_err *err)
{
    for (int i = 0; i < spec->train.n_transforms; i++) {
        const loom_transform_spec *t = &spec->train.transform[i];
        if (t->kind == LOOM_T_MAP && t->map.kind == LOOM_MAP_TOKENIZE) return &t->map;
    }
    char w[600];
    const loom_loc *l = spec->train.loc.file[0] ? &spec->train.loc : &spec->model.loc;
    loom_err_set(err, LOOM_ECONFIG, loom_loc_str(l, w, sizeof w),
                 "data.train.transforms: no tokenize map; generate turns the prompt into ids and the model's ids "
                 "into text with data.train's tokenize map");
    loom_err_hint(err, "a language model's pipeline tokenizes text, e.g. { op = \"map\"; fn = \"tokenize\"; "
                       "feature = \"line\"; mode = \"utf8_chars\"; adapt = true; }");
    return NULL;
}

typedef struct gen_job {
    const loom_generate_opts *o;
    loom_tokenizer *tok;
    loom_decoder   *dec;
    bool            words; /* whitespace or vocabulary tokens: a space before each */
    int64_t         lo, hi; /* ids drawn from [lo, hi): no padding, no OOV id, none the tokenizer lacks */
    int64_t        *ids;    /* (n_ids,) the prompt's */
    int64_t         n_ids;
    loom_rng        rng;    /* the draws of every sample, one after the other */
} gen_job;

/* The prompt as ids (j->ids); *n_oov of them out of the vocabulary. */
static int encode_prompt(gen_job *j, int64_t *n_oov, loom_err *err)
{
    size_t n = strlen(j->o->prompt);
    int64_t cap = (int64_t)n + 1;
    if (!(j->ids = loom_alloc((size_t)cap * sizeof *j->ids)))
        return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating the prompt's ids");
    int rc = loom_tokenizer_encode(j->tok, (const uint8_t *)j->o->prompt, n, j->ids, cap, &j->n_ids, n_oov, err);
    if (rc) loom_err_prefix(err, "--prompt");
    if (!rc && j->n_ids == 0)
        rc = loom_err_set(err, LOOM_EUSAGE, NULL, "--prompt \"%s\" has no token: generate continues a prompt of at "
                          "least one", j->o->prompt);
    if (j->n_ids > cap) j->n_ids = cap; /* (a token is at least a byte) */
    return rc;
}

/* One sample: the prompt into a new sequence, then up to max_tokens tokens
 * drawn, each written as it comes, then a newline; *made counts them. */
static int sample_loop(gen_job *j, float *scratch, int64_t *made, loom_err *err)
{
    const loom_generate_opts *o = j->o;
    FILE *f = o->out ? o->out : stdout;
    int rc = LOOM_OK;
    char buf[64];
    loom_decoder_reset(j->dec);
    for (int64_t i = 0; !rc && i < j->n_ids; i++) rc = loom_decoder_push(j->dec, j->ids[i], err);
    for (int64_t k = 0; !rc && k < o->max_tokens; k++, ++*made) {
        const float *z;
        if ((rc = loom_decoder_logits(j->dec, &z, err))) break;
        int64_t id = loom_decode_sample(z, j->lo, j->hi, o->temperature, o->top_k, &j->rng, scratch);
        int len = loom_tokenizer_decode(j->tok, id, buf + 1, sizeof buf - 1);
        if (len > 0) {
            buf[0] = ' ';
            if (fwrite(j->words ? buf : buf + 1, 1, (size_t)len + j->words, f) != (size_t)len + j->words ||
                fflush(f) != 0) {
                rc = loom_err_set(err, LOOM_EIO, "-", "write failed: %s", strerror(errno));
                break;
            }
        }
        if ((rc = loom_decoder_push(j->dec, id, err))) break;
    }
    if (!rc && (fputc('\n', f) == EOF || fflush(f) != 0))
        rc = loom_err_set(err, LOOM_EIO, "-", "write failed: %s", strerror(errno));
    return rc;
}

/* o->samples samples, one a line; *made: the tokens drawn. */
static int sample_all(gen_job *j, int64_t *made, loom_err *err)
{
    loom_rng_init(&j->rng, j->o->seed, 0x67656e, 0, 0); /* "gen" */
    float *scratch = loom_alloc((size_t)(j->hi - j->lo) * sizeof *scratch);
    if (!scratch) return loom_err_set(err, LOOM_ENOMEM, NULL, "allocating the sampler");
    int rc = LOOM_OK;
    *made = 0;
    for (int64_t s = 0; !rc && s < (j->o->samples > 0 ? j->o->samples : 1); s++) rc = sample_loop(j, scratch, made, err);
    loom_free(scratch);
    return rc;
}

/* The vocabulary against the model's logits: every id the tokenizer gives
 * needs one (a character tokenizer without a vocabulary draws ids below V). */
static int check_vocab(gen_job *j, const loom_spec *spec, const loom_map_spec *tm, loom_err *err)
{
    bool vocab = tm->tok_mode == LOOM_TOK_VOCABULARY || tm->adapt || tm->vocab; /* then ids 1.. are OOV's */
    j->lo = vocab ? 1 + tm->num_oov_indices : 1;
    int64_t size = loom_tokenizer_size(j->tok), V = loom_decoder_vocab(j->dec);
    bool open_ended = size > 0x10000; /* utf8_chars without a vocabulary: any code point */
    char w[600];
    if (!open_ended && V < size)
        return loom_err_set(err, LOOM_ECONFIG, loom_loc_str(&spec->model.loc, w, sizeof w),
                            "model: %lld logits per position, but the tokenize map gives %lld ids (padding 0 "
                            "included); generate needs a logit for each", (long long)V, (long long)size),
               loom_err_hint(err, "give the last dense layer units = %lld (the tokenize map's max_tokens + 1)",
                             (long long)size);
    j->hi = open_ended || V < size ? V : size;
    if (j->hi <= j->lo)
        return loom_err_set(err, LOOM_ECONFIG, loom_loc_str(&spec->model.loc, w, sizeof w),
                            "model: %lld logits; generate needs more than %lld (id 0 is padding, then the OOV ids)",
                            (long long)V, (long long)j->lo);
    return LOOM_OK;
}

int loom_generate(const loom_spec *spec, const loom_generate_opts *o, loom_err *err)
{
    gen_job j = {.o = o};
    const loom_map_spec *tm = find_tokenize(spec, err);
    if (!tm) return err->code;
    j.words = tm->tok_mode == LOOM_TOK_WHITESPACE || tm->tok_mode == LOOM_TOK_VOCABULARY;
    run r;
    char path[LOOM_PATH_MAX];
    int64_t step = -1, n_oov = 0, made = 0;
    int rc = train_run_open_(&r, spec, o->model_dir, false, NULL, false, err);
    loom_model *m = rc ? NULL : loom_strategy_model(r.strat);
    if (!rc) rc = loom_decoder_new(&j.dec, m, 0, !o->generic, err); /* the model's kind before any checkpoint */
    if (!rc) rc = loom_tokenizer_new(&j.tok, tm, err);
    if (!rc) rc = check_vocab(&j, spec, tm, err);
    if (!rc) rc = train_load_for_inference_(&r, o->checkpoint, path, &step, err);
    if (!rc) rc = encode_prompt(&j, &n_oov, err);
    if (!rc && n_oov > 0)
        loom_warn("--prompt: %lld of its %lld tokens %s not in the vocabulary: mapped to the out-of-vocabulary id",
                  (long long)n_oov, (long long)j.n_ids, n_oov == 1 ? "is" : "are");
    bool inc = j.dec && loom_decoder_incremental(j.dec);
    double t0 = loom_now();
    if (!rc) rc = sample_all(&j, &made, err);
    double dt = loom_now() - t0;
    if (!rc)
        loom_info("generated %lld tokens in %.3f s (%.1f tokens/s), %s path, from %s (step %lld)", (long long)made, dt,
                  dt > 0 ? (double)made / dt : 0.0, inc ? "incremental" : "generic", path,
                  (long long)step);
    loom_free(j.ids);
    loom_decoder_free(j.dec);
    loom_tokenizer_free(j.tok);
    train_run_close_(&r);
    return rc;
}
