/* fuzz_ckpt.c - libFuzzer target for the checkpoint reader and validator
 * (loom_ckpt_load into a small model + momentum optimizer, and
 * loom_ckpt_inspect). The input is a checkpoint without its trailer: the
 * harness appends "LOOMEND\0" and the file CRC, so that the fuzzer reaches the
 * record structure instead of stopping at the whole-file checksum (per-record
 * CRCs stay the input's). Built and run by tests/fuzz/run.sh; by hand:
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined -D_GNU_SOURCE -I appliance \
 *     tests/fuzz/fuzz_ckpt.c appliance/train/checkpoint.c appliance/nn/[a-z]*.c \
 *     appliance/tensor/[a-z]*.c appliance/core/[a-z]*.c -lz -lzstd -lm -ldl -lpthread -o /tmp/fuzz_ckpt
 *   /tmp/fuzz_ckpt -max_total_time=30 /tmp/corpus_ckpt tests/fuzz/corpus/ckpt
 * FUZZ_CKPT_SEED=FILE writes a valid seed (a checkpoint of the model, minus
 * its trailer) to FILE and exits.
 * Invariants: no over-read or leak (ASan); success leaves every weight and
 * slot finite; failure says why and leaves both blobs empty. */
#include "train/train.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define CHECK(c) do { if (!(c)) __builtin_trap(); } while (0)

static loom_model *model;
static loom_optimizer *opt;
static FILE *devnull;
static int memfd = -1;

static void setup(void)
{
    static loom_model_spec s;
    loom_err err;
    snprintf(s.loc.file, sizeof s.loc.file, "fuzz.cfg");
    snprintf(s.input, sizeof s.input, "image");
    snprintf(s.label, sizeof s.label, "label");
    s.loss = LOOM_LOSS_SPARSE_SOFTMAX_CE;
    s.n_layers = 3;
    s.layer[0].kind = LOOM_LAYER_FLATTEN;
    snprintf(s.layer[0].name, sizeof s.layer[0].name, "flatten_0");
    for (int i = 1; i < 3; i++) {
        s.layer[i].kind = LOOM_LAYER_DENSE;
        snprintf(s.layer[i].name, sizeof s.layer[i].name, "dense_%d", i);
        s.layer[i].units = i == 1 ? 5 : 3;
        s.layer[i].kernel_init = LOOM_INIT_GLOROT_UNIFORM;
        s.layer[i].use_bias = true;
    }
    loom_shape in = {2, {4, 4}}, lab = {0, {0}};
    CHECK(loom_model_new(&model, &s, &in, LOOM_F32, &lab, LOOM_U8, 1, &err) == LOOM_OK);
    loom_optimizer_spec o;
    memset(&o, 0, sizeof o);
    o.kind = LOOM_OPT_MOMENTUM;
    o.learning_rate = 0.01;
    o.momentum = 0.9;
    o.schedule.kind = LOOM_SCHED_CONSTANT;
    CHECK(loom_optimizer_new(&opt, &o, loom_model_num_params(model), &err) == LOOM_OK);
    devnull = fopen("/dev/null", "w");
    CHECK(devnull && (memfd = memfd_create("fuzz_ckpt", 0)) >= 0);
    loom_log_set_level(LOOM_LOG_ERROR);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc, (void)argv;
    setup();
    const char *seed = getenv("FUZZ_CKPT_SEED");
    if (!seed) return 0;
    char dir[] = "/tmp/fuzz_ckpt_XXXXXX", path[LOOM_PATH_MAX];
    CHECK(mkdtemp(dir));
    loom_buf tr, it;
    loom_buf_init(&tr);
    loom_buf_init(&it);
    loom_buf_put_u32(&tr, 1);
    for (int i = 0; i < 6; i++) loom_buf_put_i64(&tr, i == 0 ? 3 : 0);
    loom_buf_put(&it, "iterator", 8);
    loom_err err;
    CHECK(loom_ckpt_save(dir, 3, model, opt, &tr, &it, 1, path, &err) == LOOM_OK);
    uint8_t *d;
    size_t n;
    CHECK(loom_read_file(path, &d, &n, &err) == LOOM_OK);
    FILE *f = fopen(seed, "wb");
    CHECK(f && fwrite(d, 1, n - 12, f) == n - 12 && fclose(f) == 0);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    CHECK(system(cmd) == 0);
    exit(0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size > (1 << 20)) return 0;
    uint8_t *file = malloc(size + 12);
    memcpy(file, data, size);
    uint32_t crc = loom_crc32c(data, size);
    memcpy(file + size, "LOOMEND", 8);
    memcpy(file + size + 8, &crc, 4);
    int ok = ftruncate(memfd, 0) == 0 && pwrite(memfd, file, size + 12, 0) == (ssize_t)(size + 12);
    free(file);
    if (!ok) return 0;
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", memfd);
    loom_buf tr, it;
    loom_err err = {0};
    int rc = loom_ckpt_load(path, model, opt, &tr, &it, &err);
    if (rc == LOOM_OK) {
        const float *p = loom_model_params(model);
        for (int64_t i = 0; i < loom_model_num_params(model); i++) CHECK(isfinite(p[i]));
        const float *s = loom_optimizer_slots(opt);
        for (int64_t i = 0; i < loom_model_num_params(model) * loom_optimizer_num_slots(opt); i++) CHECK(isfinite(s[i]));
    } else {
        CHECK(err.msg[0] && tr.len == 0 && it.len == 0);
    }
    loom_buf_fini(&tr);
    loom_buf_fini(&it);
    loom_err e2 = {0};
    rc = loom_ckpt_inspect(path, devnull, &e2);
    CHECK(rc == LOOM_OK || e2.msg[0]);
    return 0;
}
