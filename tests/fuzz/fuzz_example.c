/* fuzz_example.c - libFuzzer target for the tf.train.Example parser, the
 * value walkers and the parse-spec extraction, plus a re-encode round trip.
 * Built and run by tests/fuzz/run.sh (meson test --suite fuzz), or by hand from the repository root:
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined -D_GNU_SOURCE -I appliance \
 *     tests/fuzz/fuzz_example.c appliance/data/format/example.c \
 *     appliance/core/[a-z]*.c appliance/tensor/{tensor,blas}.c -lz -lm -ldl -lpthread -o /tmp/fuzz_example
 *   /tmp/fuzz_example -max_total_time=30 /tmp/corpus_example
 * Invariants checked: the parser never over-reads (ASan), counts agree with
 * what the walkers return, and a re-encoded Example parses to the same values. */
#include "data/data.h"

#include <stdlib.h>
#include <string.h>

#define CHECK(c) do { if (!(c)) __builtin_trap(); } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    loom_example ex, ex2;
    loom_example_init(&ex);
    loom_example_init(&ex2);
    loom_example_builder b;
    loom_example_builder_init(&b);
    loom_err err = {0};
    if (loom_example_parse(&ex, data, size, &err) == LOOM_OK) {
        for (int i = 0; i < ex.n; i++) {
            const loom_example_feature *f = &ex.f[i];
            CHECK(f->count >= 0 && f->count <= (int64_t)size);
            int64_t n = f->count;
            char *name = malloc(f->name.len + 1);
            memcpy(name, f->name.data, f->name.len);
            name[f->name.len] = 0;
            bool has_nul = strlen(name) != f->name.len;
            if (f->kind == LOOM_FEATURE_FLOAT) {
                float *v = malloc((size_t)(n ? n : 1) * sizeof *v);
                CHECK(loom_example_floats(f, v, n) == n);
                if (!has_nul) loom_example_add_floats(&b, name, v, n);
                free(v);
            } else if (f->kind == LOOM_FEATURE_INT64) {
                int64_t *v = malloc((size_t)(n ? n : 1) * sizeof *v);
                CHECK(loom_example_int64s(f, v, n) == n);
                if (!has_nul) loom_example_add_int64s(&b, name, v, n);
                free(v);
            } else if (f->kind == LOOM_FEATURE_BYTES) {
                loom_bytes_view *v = malloc((size_t)(n ? n : 1) * sizeof *v);
                CHECK(loom_example_bytes(f, v, n) == n);
                int64_t total = 0;
                for (int64_t k = 0; k < n; k++) total += (int64_t)v[k].len;
                CHECK(total == f->bytes_total);
                if (!has_nul) loom_example_add_bytes(&b, name, v, n);
                free(v);
            }
            /* a spec of every dtype against every feature: errors are fine */
            for (int dt = 0; dt <= LOOM_PARSE_BYTES; dt++) {
                loom_feature_spec s = {.name = name, .dtype = (loom_parse_dtype)dt, .shape = {1, {3}},
                                       .var_len = (i & 1) != 0, .pad_value = 1};
                union { float f[3]; int64_t i[3]; uint8_t u[3]; loom_bytes_view b[3]; } out;
                loom_feature_out o = {&out, 0};
                (void)loom_example_extract(&ex, &s, 1, i, &o, &err);
            }
            free(name);
        }
        /* round trip: what we re-encode parses to the same counts */
        const uint8_t *enc;
        size_t len;
        if (loom_example_finish(&b, &enc, &len, &err) == LOOM_OK) {
            CHECK(loom_example_parse(&ex2, enc, len, &err) == LOOM_OK);
            for (int i = 0; i < ex2.n; i++) {
                char key[256];
                if (ex2.f[i].name.len >= sizeof key) continue;
                memcpy(key, ex2.f[i].name.data, ex2.f[i].name.len);
                key[ex2.f[i].name.len] = 0;
                const loom_example_feature *f = loom_example_find(&ex, key);
                CHECK(f && f->kind == ex2.f[i].kind && f->count == ex2.f[i].count);
            }
        }
    }
    loom_example_builder_fini(&b);
    loom_example_fini(&ex2);
    loom_example_fini(&ex);
    return 0;
}
