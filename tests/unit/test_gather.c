/* test_gather.c - a batch over an index-mode shuffle (or a source in plain
 * order) of in-memory rows gathers them (transform/transforms.c batch_gather):
 * the elements, the iterator states and the per-stage element counts are
 * those of the element-by-element path (LOOM_DATA_GATHER=0) over several
 * epochs with shuffle, repeat, shard, drop_remainder, partial last batches
 * and maps before a prefetch; a state saved by one path restores in the
 * other; and configs/fashion_mnist_mlp.cfg takes the gather
 * (LOOM_DATA_SKIP_CATALOG=1 skips that one). A map(scale) right after the
 * batch runs in its row copies (batch(gather+scale)), and a pipeline handed
 * the consumer's pool (loom_iter_share_pool) gathers inline on it: both
 * with the element path's elements and states. */
#include "harness.h"
#include "test_util.h"
#include "data/data.h"
#include "config/config.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define N_ITEMS 203 /* prime: every batch size below leaves a partial last batch */

static void setup(void)
{
    if (tmpdir[0]) return;
    snprintf(tmpdir, sizeof tmpdir, "/tmp/loom_test_gather_%ld", (long)getpid());
    mkdir(tmpdir, 0755);
    static uint8_t im[N_ITEMS * 7 * 5], big[N_ITEMS * 28 * 28];
    int32_t lab[N_ITEMS], id[N_ITEMS];
    for (int i = 0; i < N_ITEMS; i++) {
        for (int k = 0; k < 35; k++) im[i * 35 + k] = (uint8_t)(i * 11 + k * 13 + (i >> 3));
        lab[i] = i % 10;
        id[i] = i;
    }
    for (int i = 0; i < N_ITEMS * 28 * 28; i++) big[i] = (uint8_t)(i * 7 + (i / 784) * 3);
    uint32_t di[3] = {N_ITEMS, 7, 5}, db[3] = {N_ITEMS, 28, 28}, dl[1] = {N_ITEMS};
    write_idx_file(tpath("big.idx"), 0x08, 3, db, big);
    write_idx_file(tpath("img.idx"), 0x08, 3, di, im);
    write_idx_file(tpath("lbl.idx"), 0x0C, 1, dl, lab);
    write_idx_file(tpath("id.idx"), 0x0C, 1, dl, id);
}

/* big: 28x28 images (a batch of 16 is past the gather's split size), else 7x5 */
static loom_dataset_spec *spec_images(bool options, bool big)
{
    setup();
    loom_dataset_spec *s = calloc(1, sizeof *s);
    s->present = true;
    spec_feature(s, "image", tpath(big ? "big.idx" : "img.idx"));
    spec_feature(s, "label", tpath("lbl.idx"));
    spec_feature(s, "id", tpath("id.idx"));
    if (options) { /* data.options' defaults: shuffle+repeat fused, maps chained */
        loom_data_options *o = &s->options;
        o->present = o->deterministic = o->autotune = true;
        o->noop_elimination = o->map_and_batch_fusion = o->map_fusion = o->shuffle_and_repeat_fusion = true;
    }
    return s;
}

static loom_dataset_spec *spec_base(bool options) { return spec_images(options, false); }

static void add_batch(loom_dataset_spec *s, int64_t size, bool drop)
{
    loom_transform_spec *t = spec_add(s, LOOM_T_BATCH);
    t->batch_size = size;
    t->drop_remainder = drop;
}

static void add_shard(loom_dataset_spec *s, int64_t n, int64_t index)
{
    loom_transform_spec *t = spec_add(s, LOOM_T_SHARD);
    t->num_shards = n;
    t->index = index;
}

static void gather_on(bool on)
{
    if (on) unsetenv("LOOM_DATA_GATHER");
    else setenv("LOOM_DATA_GATHER", "0", 1);
}

static const loom_data_ctx ctx1 = {.seed = 42, .threads = 1, .name = "train"};
static const loom_data_ctx ctx2 = {.seed = 42, .threads = 2, .name = "train"};

/* When set, open_mode hands the gather's iterators this pool (loom_iter_share_pool), expecting it taken. */
static loom_pool *share_pool;

static loom_iter *open_mode(const loom_dataset_spec *s, const loom_data_ctx *ctx, bool gather)
{
    gather_on(gather);
    loom_iter *it = iter_open_ok(s, ctx);
    gather_on(true);
    if (it && gather && share_pool) CHECK_MSG(loom_iter_share_pool(it, share_pool), "the pool is taken");
    return it;
}

static bool plan_has(const loom_iter *it, const char *what)
{
    char *p = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&p, &n);
    loom_iter_plan(it, f);
    fclose(f);
    bool has = p && strstr(p, what);
    free(p);
    return has;
}

/* Two digests are equal (memcmp is not called with the NULL of an empty one). */
static bool same_blob(const blob *a, const blob *b)
{
    return a->n == b->n && (a->n == 0 || !memcmp(a->p, b->p, a->n));
}

/* Hashes of `count` elements (every one when count < 0) across passes up to
 * epochs, rewinding at each end of pass; *epoch tracks the pass. */
static int drive(loom_iter *it, blob *b, int count, int64_t *epoch, int64_t epochs)
{
    int k = 0;
    loom_elem *e;
    loom_err err = {0};
    while ((count < 0 || k < count) && *epoch < epochs) {
        int rc = loom_iter_next(it, &e, &err);
        if (rc == LOOM_EEOF) {
            if (++*epoch < epochs) CHECK_MSG(loom_iter_rewind(it, *epoch, &err) == LOOM_OK, "rewind: %s", err.msg);
            continue;
        }
        if (rc) {
            CHECK_MSG(0, "next: %s: %s", err.where, err.msg);
            break;
        }
        uint64_t h = elem_hash(e);
        blob_put(b, &h, sizeof h);
        k++;
    }
    return k;
}

/* One case: both paths yield the same elements over epochs, with the same
 * per-stage element counts; the gather is taken when expected; at cuts every
 * stride elements, a state saved by either path restores into either and
 * continues the uninterrupted sequence, and the two paths' states are equal. */
static void check_case(const char *name, const loom_dataset_spec *s, const loom_data_ctx *ctx, int64_t epochs, bool expect_gather,
                       int stride)
{
    blob ref = {0}, fast = {0};
    int64_t ep = 0;
    loom_iter *g = open_mode(s, ctx, false), *f = open_mode(s, ctx, true);
    if (!g || !f) {
        loom_iter_close(g);
        loom_iter_close(f);
        return;
    }
    CHECK_MSG(!plan_has(g, "batch(gather)"), "%s: LOOM_DATA_GATHER=0 keeps the element path", name);
    CHECK_MSG(plan_has(f, "batch(gather") == expect_gather, "%s: the gather is %s", name,
              expect_gather ? "taken" : "not taken");
    int total = drive(g, &ref, -1, &ep, epochs);
    ep = 0;
    int total_f = drive(f, &fast, -1, &ep, epochs);
    CHECK_MSG(total == total_f && same_blob(&ref, &fast),
              "%s: %d elements by the gather, %d by the element path, %s", name, total_f, total,
              same_blob(&ref, &fast) ? "the same" : "different");
    loom_stage_stats sg[LOOM_MAX_TRANSFORMS + 3], sf[LOOM_MAX_TRANSFORMS + 3];
    int ng = loom_iter_stats(g, sg, LOOM_MAX_TRANSFORMS + 3), nf = loom_iter_stats(f, sf, LOOM_MAX_TRANSFORMS + 3);
    CHECK_MSG(ng == nf, "%s: %d stages vs %d", name, nf, ng);
    for (int i = 0; i < ng && i < nf; i++)
        CHECK_MSG(sg[i].elements == sf[i].elements, "%s: stage %d (%s) counted %lld elements, the element path %lld", name, i,
                  sf[i].name, (long long)sf[i].elements, (long long)sg[i].elements);
    loom_iter_close(g);
    loom_iter_close(f);

    for (int cut = 1; cut < total; cut += stride) {
        loom_buf st[2];
        for (int from = 0; from < 2; from++) { /* from 0: saved by the element path, 1: by the gather */
            blob got = {0};
            loom_err err = {0};
            loom_buf_init(&st[from]);
            ep = 0;
            loom_iter *a = open_mode(s, ctx, from);
            if (!a) break;
            drive(a, &got, cut, &ep, epochs);
            CHECK(loom_iter_save(a, &st[from], &err) == LOOM_OK);
            loom_iter_close(a);
            int64_t ep_cut = ep;
            for (int to = 0; to < 2; to++) {
                blob rest = {0};
                blob_put(&rest, got.p, got.n);
                st[from].pos = 0;
                loom_iter *b = open_mode(s, ctx, to);
                if (!b) break;
                int rc = loom_iter_restore(b, &st[from], &err);
                CHECK_MSG(rc == LOOM_OK, "%s: restore at %d: %s: %s", name, cut, err.where, err.msg);
                ep = ep_cut;
                drive(b, &rest, -1, &ep, epochs);
                loom_iter_close(b);
                CHECK_MSG(same_blob(&rest, &ref), "%s: cut %d, saved by the %s path, restored by the "
                          "%s: %zu hashes vs %zu", name, cut, from ? "gather" : "element", to ? "gather" : "element path",
                          rest.n / 8, ref.n / 8);
                free(rest.p);
            }
            free(got.p);
        }
        /* (a prefetch's state holds what its producer thread had queued: a matter of timing) */
        CHECK_MSG(ctx->threads > 1 || (st[0].len == st[1].len && (!st[0].len || !memcmp(st[0].data, st[1].data, st[0].len))), "%s: cut %d: the two paths' states "
                  "differ (%zu vs %zu bytes)", name, cut, st[0].len, st[1].len);
        loom_buf_fini(&st[0]);
        loom_buf_fini(&st[1]);
    }
    free(ref.p);
    free(fast.p);
}

static void test_shuffle_batch(void)
{
    loom_dataset_spec *s = spec_base(false); /* shuffle(indices) -> batch, a partial last batch of 203 % 16 */
    spec_shuffle(s, 64);
    add_batch(s, 16, false);
    check_case("shuffle(64) + batch(16)", s, &ctx1, 3, true, 5);
    free(s);
    s = spec_base(false); /* a buffer over the whole pass, no reshuffle, drop_remainder */
    spec_shuffle(s, 1000);
    s->transform[0].reshuffle = false;
    add_batch(s, 16, true);
    check_case("shuffle(1000, no reshuffle) + batch(16, drop)", s, &ctx1, 3, true, 4);
    free(s);
    s = spec_base(false); /* a batch larger than a gather chunk (256), larger than the pass */
    spec_shuffle(s, 50);
    add_batch(s, 300, false);
    check_case("shuffle(50) + batch(300)", s, &ctx1, 3, true, 1);
    free(s);
    s = spec_base(false);
    spec_shuffle(s, 50);
    add_batch(s, 300, true);
    check_case("shuffle(50) + batch(300, drop): no batch at all", s, &ctx1, 1, true, 1);
    free(s);
}

static void test_plain_order(void)
{
    loom_dataset_spec *s = spec_base(false); /* the source draws its own positions */
    add_batch(s, 10, false);
    check_case("batch(10)", s, &ctx1, 2, true, 3);
    free(s);
    s = spec_base(false);
    add_batch(s, 7, true);
    spec_count(s, LOOM_T_REPEAT, 2);
    check_case("batch(7, drop) + repeat(2)", s, &ctx1, 2, true, 7);
    free(s);
}

static void test_repeat(void)
{
    loom_dataset_spec *s = spec_base(true); /* fused shuffle+repeat in index mode draws across passes */
    spec_shuffle(s, 40);
    spec_count(s, LOOM_T_REPEAT, 3);
    add_batch(s, 32, false);
    check_case("shuffle(40)+repeat(3) + batch(32), fused", s, &ctx1, 2, true, 3);
    free(s);
    s = spec_base(false); /* unfused: repeat draws nothing, the element path runs */
    spec_shuffle(s, 40);
    spec_count(s, LOOM_T_REPEAT, 3);
    add_batch(s, 32, false);
    check_case("shuffle(40) + repeat(3) + batch(32), unfused", s, &ctx1, 2, false, 3);
    free(s);
    s = spec_base(true); /* repeat forever: a few hundred batches of one pass */
    spec_shuffle(s, 300);
    spec_count(s, LOOM_T_REPEAT, -1);
    add_batch(s, 64, true);
    spec_count(s, LOOM_T_TAKE, 20);
    check_case("shuffle(300)+repeat(-1) + batch(64, drop) + take(20)", s, &ctx1, 2, true, 6);
    free(s);
}

static void test_shard(void)
{
    for (int i = 0; i < 2; i++) {
        loom_dataset_spec *s = spec_base(false); /* shard after the shuffle: the element path */
        spec_shuffle(s, 64);
        add_shard(s, 2, i);
        add_batch(s, 16, false);
        check_case("shuffle + shard(2) + batch", s, &ctx1, 2, false, 3);
        free(s);
        s = spec_base(false); /* shard first: no random access, an element-mode shuffle */
        add_shard(s, 2, i);
        spec_shuffle(s, 64);
        add_batch(s, 16, true);
        check_case("shard(2) + shuffle + batch(drop)", s, &ctx1, 2, false, 3);
        free(s);
    }
}

static void test_maps_prefetch(void)
{
    loom_dataset_spec *s = spec_base(false); /* the MLP config's shape: the map writes into the prefetch's slot */
    spec_shuffle(s, 100);
    add_batch(s, 16, false);
    loom_map_spec *m = spec_map(s, LOOM_MAP_SCALE, "image", 1, true);
    m->scale = 1.0 / 255;
    m->offset = 0.25;
    spec_map(s, LOOM_MAP_CAST, "label", 1, true)->dtype = LOOM_CFG_F32;
    spec_prefetch(s, 2);
    check_case("shuffle + batch + scale + cast + prefetch(2)", s, &ctx2, 3, true, 4);
    free(s);
    s = spec_base(true); /* chained maps (map_fusion) with a normalize */
    spec_shuffle(s, 100);
    add_batch(s, 16, false);
    m = spec_map(s, LOOM_MAP_NORMALIZE, "image", 1, true);
    m->mean = 100;
    m->std = 60;
    spec_prefetch(s, 2);
    check_case("shuffle + batch + normalize (chained) + prefetch(2)", s, &ctx2, 2, true, 4);
    free(s);
    s = spec_base(false); /* a map before the shuffle: no random access, the element path */
    spec_map(s, LOOM_MAP_CAST, "label", 1, true)->dtype = LOOM_CFG_F32;
    spec_shuffle(s, 100);
    add_batch(s, 16, false);
    check_case("cast + shuffle + batch", s, &ctx1, 2, false, 4);
    free(s);
}

/* A scale of the image right after the batch: in the gather's row copies. */
static loom_map_spec *add_scale(loom_dataset_spec *s, double scale, double offset)
{
    loom_map_spec *m = spec_map(s, LOOM_MAP_SCALE, "image", 1, true);
    m->scale = scale;
    m->offset = offset;
    return m;
}

static void check_plan(const loom_dataset_spec *s, const loom_data_ctx *ctx, const char *want)
{
    loom_iter *it = open_mode(s, ctx, true);
    if (!it) return;
    char *p = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&p, &n);
    loom_iter_plan(it, f);
    fclose(f);
    CHECK_MSG(p && strstr(p, want), "plan %s has %s", p ? p : "(none)", want);
    free(p);
    loom_iter_close(it);
}

static void test_fused_scale(void)
{
    loom_dataset_spec *s = spec_base(false); /* the MLP config's shape, without a prefetch: next() */
    spec_shuffle(s, 100);
    add_batch(s, 16, false);
    add_scale(s, 1.0 / 255, 0);
    check_plan(s, &ctx1, "shuffle(indices) -> batch(gather+scale) -> map(scale in the batch)\n");
    check_case("shuffle + batch + scale, fused", s, &ctx1, 3, true, 4);
    free(s);
    s = spec_images(false, true); /* 28x28 into a prefetch's slot, an offset, a partial last batch */
    spec_shuffle(s, 150);
    add_batch(s, 32, false);
    add_scale(s, 1.0 / 255, -0.5);
    spec_prefetch(s, 2);
    check_plan(s, &ctx2, "batch(gather+scale) -> map(scale in the batch) -> prefetch\n");
    check_case("28x28: shuffle + batch + scale + prefetch(2), fused", s, &ctx2, 2, true, 3);
    free(s);
    s = spec_base(true); /* a chain (map_fusion): scale first, a cast of the label after it */
    spec_shuffle(s, 100);
    add_batch(s, 16, true);
    add_scale(s, 0.5, 3);
    spec_map(s, LOOM_MAP_CAST, "label", 1, true)->dtype = LOOM_CFG_F32;
    spec_prefetch(s, 2);
    check_plan(s, &ctx2, "batch(gather+scale) -> map(scale in the batch+cast) -> prefetch\n");
    check_case("chain: scale (fused) + cast + prefetch(2)", s, &ctx2, 2, true, 4);
    free(s);
    s = spec_base(true); /* a chain that maps the scaled feature again: the scale into its own buffer */
    spec_shuffle(s, 100);
    add_batch(s, 16, false);
    add_scale(s, 1.0 / 255, 0);
    loom_map_spec *m = spec_map(s, LOOM_MAP_NORMALIZE, "image", 1, true);
    m->mean = 0.3;
    m->std = 0.2;
    check_plan(s, &ctx1, "batch(gather+scale) -> map(scale in the batch+normalize)");
    check_case("chain: scale (fused) + normalize, no prefetch", s, &ctx1, 2, true, 5);
    free(s);
    s = spec_base(false); /* a scale of another feature (int32 id): fused too */
    spec_shuffle(s, 64);
    add_batch(s, 10, false);
    spec_map(s, LOOM_MAP_SCALE, "id", 1, true)->scale = 0.125;
    check_plan(s, &ctx1, "batch(gather+scale) -> map(scale in the batch)");
    check_case("scale of an int32 feature, fused", s, &ctx1, 2, true, 6);
    free(s);
    s = spec_base(false); /* a scale after another map: not fused */
    spec_shuffle(s, 64);
    add_batch(s, 10, false);
    spec_map(s, LOOM_MAP_CAST, "label", 1, true)->dtype = LOOM_CFG_F32;
    add_scale(s, 2, 0);
    check_plan(s, &ctx1, "batch(gather) -> map(cast) -> map(scale)\n");
    check_case("cast + scale after the batch: not fused", s, &ctx1, 2, true, 6);
    free(s);
}

/* The consumer's pool: the prefetch runs inline, the row copies split over it. */
static void test_share_pool(void)
{
    loom_pool *pool = NULL;
    loom_err err = {0};
    CHECK(loom_pool_new(&pool, 2, &err) == LOOM_OK);
    if (!pool) return;
    loom_dataset_spec *s = spec_images(false, true); /* 28x28: a batch of 16 splits over the pool */
    spec_shuffle(s, 150);
    add_batch(s, 16, false);
    add_scale(s, 1.0 / 255, 0);
    spec_prefetch(s, -1);
    share_pool = pool;
    check_plan(s, &ctx2, "batch(gather+scale) -> map(scale in the batch) -> prefetch(inline)\n");
    check_case("28x28: shuffle + batch + scale + prefetch(auto) on the pool", s, &ctx2, 3, true, 2);
    { /* the auto buffer of a prefetch gone inline tunes nothing: the tuner leaves it out of its report */
        loom_iter *it = open_mode(s, &ctx2, true);
        if (it) {
            blob h = {0};
            int64_t ep = 0;
            drive(it, &h, 5, &ep, 1);
            char tuned[512] = "x";
            int settled = loom_iter_tuned(it, tuned, sizeof tuned);
            CHECK_MSG(!settled && !strstr(tuned, "prefetch"), "an inline prefetch's knob reported: \"%s\" (%d)",
                      tuned, settled);
            free(h.p);
        }
        loom_iter_close(it);
    }
    free(s);
    s = spec_images(true, true); /* options: shuffle+repeat fused, the scale a chain of one map */
    spec_shuffle(s, 203);
    spec_count(s, LOOM_T_REPEAT, 2);
    add_batch(s, 48, true);
    add_scale(s, 1.0 / 255, 0.25);
    spec_prefetch(s, 3);
    check_plan(s, &ctx2, "shuffle(indices)+repeat -> batch(gather+scale) -> map(scale in the batch) -> prefetch(inline)\n");
    check_case("28x28: shuffle+repeat + batch(48, drop) + scale (chained) + prefetch(3) on the pool", s, &ctx2, 2, true, 2);
    free(s);
    s = spec_images(false, true); /* the batch alone before the prefetch */
    add_batch(s, 20, false);
    spec_prefetch(s, 2);
    check_case("28x28: batch(20) in plain order + prefetch(2) on the pool", s, &ctx2, 2, true, 3);
    share_pool = NULL;
    free(s);

    /* handed the pool after the producer queued batches: they come first, in order */
    s = spec_images(false, true);
    spec_shuffle(s, 100);
    add_batch(s, 16, false);
    add_scale(s, 1.0 / 255, 0);
    spec_prefetch(s, 4);
    blob ref = {0}, got = {0};
    int64_t ep = 0;
    loom_iter *a = open_mode(s, &ctx2, false), *b = open_mode(s, &ctx2, true);
    if (a && b) {
        drive(a, &ref, -1, &ep, 2);
        ep = 0;
        drive(b, &got, 3, &ep, 2);
        usleep(20000); /* the producer fills its queue */
        CHECK(loom_iter_share_pool(b, pool));
        CHECK_MSG(plan_has(b, "-> prefetch(inline)"), "the prefetch runs inline");
        CHECK_MSG(!loom_iter_share_pool(b, pool), "a second time: nothing to take");
        drive(b, &got, -1, &ep, 2);
        CHECK_MSG(same_blob(&ref, &got), "shared after 3 batches: %zu hashes, the element path %zu", got.n / 8, ref.n / 8);
    }
    loom_iter_close(a);
    loom_iter_close(b);
    free(ref.p);
    free(got.p);
    free(s);

    /* pipelines that keep their thread: nothing changes */
    struct {
        const char *what;
        int         kind; /* 0 a map between, 1 no prefetch thread, 2 the element path, 3 no pool, 4 a prefetch
                             before the batch, 5 a chain of the fused scale and a cast */
    } keep[] = {{"a cast after the batch", 0}, {"threads 0 (an inline prefetch)", 1}, {"LOOM_DATA_GATHER=0", 2},
                {"no pool", 3}, {"prefetch, then the batch", 4}, {"a chain: scale (fused) + cast", 5}};
    const loom_data_ctx ctx0 = {.seed = 42, .threads = 0, .name = "train"};
    for (size_t k = 0; k < sizeof keep / sizeof keep[0]; k++) {
        s = spec_base(keep[k].kind == 5);
        spec_shuffle(s, 64);
        if (keep[k].kind == 4) spec_prefetch(s, 2);
        add_batch(s, 16, false);
        if (keep[k].kind == 5) add_scale(s, 0.5, 0);
        if (keep[k].kind == 0 || keep[k].kind == 5) spec_map(s, LOOM_MAP_CAST, "label", 1, true)->dtype = LOOM_CFG_F32;
        if (keep[k].kind != 4) spec_prefetch(s, 2);
        loom_iter *it = open_mode(s, keep[k].kind == 1 ? &ctx0 : &ctx2, keep[k].kind != 2);
        if (it) {
            const char *want = keep[k].kind == 1 ? "-> prefetch(inline)\n" : keep[k].kind == 4 ? "-> batch\n" : "-> prefetch\n";
            CHECK_MSG(!loom_iter_share_pool(it, keep[k].kind == 3 ? NULL : pool), "%s: not taken", keep[k].what);
            CHECK_MSG(plan_has(it, want), "%s: the plan still ends %s", keep[k].what, want);
            blob x = {0}, y = {0};
            ep = 0;
            drive(it, &x, -1, &ep, 1);
            loom_iter *r = open_mode(s, &ctx1, false);
            ep = 0;
            if (r) drive(r, &y, -1, &ep, 1);
            CHECK_MSG(same_blob(&x, &y), "%s: the same elements", keep[k].what);
            loom_iter_close(r);
            free(x.p);
            free(y.p);
        }
        loom_iter_close(it);
        free(s);
    }
    loom_pool_free(pool);
}

/* scale of uint8 (vectorised by the CPU's features) gives the scalar loop's floats. */
static void test_scale_values(void)
{
    uint8_t v[259];
    for (int i = 0; i < 259; i++) v[i] = (uint8_t)(i * 37 + 5);
    const float sc[] = {0.00392156862745098f, 1.0f / 3, 7.5f, -0.1f}, off[] = {0, 0.5f, -3, 1e-3f};
    for (int k = 0; k < 4; k++)
        for (size_t n = 0; n < 259; n += 17) {
            float got[259];
            loom_data_scale(v, LOOM_U8, got, n, sc[k], off[k]);
            int bad = 0;
            for (size_t i = 0; i < n; i++) {
                volatile float x = (float)v[i] * sc[k]; /* volatile: the product rounded, as the map computes */
                float want = x + off[k];
                bad += memcmp(&got[i], &want, sizeof want) != 0;
            }
            CHECK_MSG(bad == 0, "scale %g + %g of %zu uint8 values: %d differ from the scalar loop", (double)sc[k],
                      (double)off[k], n, bad);
        }
}

/* configs/fashion_mnist_mlp.cfg gathers, and its first batches are the element path's. */
static void test_mlp_config(void)
{
    const char *skip = getenv("LOOM_DATA_SKIP_CATALOG");
    char img[LOOM_PATH_MAX], lbl[LOOM_PATH_MAX];
    loom_err err = {0};
    if ((skip && *skip == '1') || loom_catalog_resolve("fashion_mnist", "train", img, lbl, &err) != LOOM_OK) {
        printf("# skipped: %s\n", skip && *skip == '1' ? "LOOM_DATA_SKIP_CATALOG=1" : err.msg);
        return;
    }
    const char *root = getenv("LOOM_SOURCE_ROOT");
    char path[4096];
    snprintf(path, sizeof path, "%s/configs/fashion_mnist_mlp.cfg", root ? root : ".");
    loom_errlist *errs = calloc(1, sizeof *errs);
    loom_spec *spec = NULL;
    int rc = loom_config_load(&spec, path, NULL, 0, errs);
    CHECK_MSG(rc == LOOM_OK, "load %s: %s", path, rc ? errs->e[0].msg : "");
    free(errs);
    if (rc) return;
    loom_data_ctx ctx = {.seed = spec->run.seed, .threads = 2, .name = "train"};
    loom_iter *it[2] = {open_mode(&spec->train, &ctx, false), open_mode(&spec->train, &ctx, true)};
    if (it[0] && it[1]) {
        CHECK_MSG(plan_has(it[1], "shuffle(indices) -> batch(gather+scale) -> map(scale in the batch) -> prefetch(auto)"),
                  "the MLP config's plan gathers, the scale in the row copies");
        blob b[2] = {{0}, {0}};
        for (int k = 0; k < 2; k++) {
            int64_t ep = 0;
            CHECK(drive(it[k], &b[k], 60, &ep, 1) == 60);
        }
        CHECK_MSG(same_blob(&b[0], &b[1]), "the MLP config's first 60 batches: the same by both paths");
        free(b[0].p);
        free(b[1].p);
    }
    loom_iter_close(it[0]);
    loom_iter_close(it[1]);
    loom_config_free(spec);
}

static void test_cleanup(void) { tmpdir_remove(); }

static const loom_test tests[] = {
    {"shuffle(indices) + batch: the element path's batches and states", test_shuffle_batch},
    {"batch over a source in plain order", test_plain_order},
    {"shuffle+repeat draws across passes", test_repeat},
    {"shard: the element path, unchanged", test_shard},
    {"maps after the batch, into a prefetch's slot", test_maps_prefetch},
    {"scale of uint8: the scalar loop's floats", test_scale_values},
    {"a scale after the batch runs in its row copies", test_fused_scale},
    {"the consumer's pool: the prefetch inline, the copies split", test_share_pool},
    {"fashion_mnist_mlp.cfg gathers", test_mlp_config},
    {"cleanup", test_cleanup},
    {NULL, NULL},
};

int main(void) { return loom_test_run(tests); }
