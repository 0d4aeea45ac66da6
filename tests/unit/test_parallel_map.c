/* test_parallel_map.c - map with parallel = N | auto: the same output for any
 * parallelism (random maps included), deterministic = false yields the same
 * multiset, exact save/restore mid-epoch with shuffle + batch + prefetch, a
 * map error surfaces at its element, clean shutdown mid-epoch, the profile
 * report, and samples/s of Fashion-MNIST with parallel 1 vs 2 (a TAP
 * comment, not a check). LOOM_DATA_SKIP_CATALOG=1 skips the real dataset. */
#include "harness.h"
#include "test_util.h"
#include "data/data.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>


#define N_ITEMS 300
#define BAD_AT  137 /* label out of range for one_hot(depth 10) */

static void setup(void)
{
    if (tmpdir[0]) return;
    snprintf(tmpdir, sizeof tmpdir, "/tmp/loom_test_parmap_%ld", (long)getpid());
    mkdir(tmpdir, 0755);
    static uint8_t im[N_ITEMS * 6 * 5];
    int32_t lab[N_ITEMS], id[N_ITEMS], bad[N_ITEMS];
    for (int i = 0; i < N_ITEMS; i++) {
        for (int k = 0; k < 30; k++) im[i * 30 + k] = (uint8_t)(i * 7 + k * 13);
        lab[i] = i % 10;
        bad[i] = i == BAD_AT ? 99 : i % 10;
        id[i] = i;
    }
    uint32_t di[3] = {N_ITEMS, 6, 5}, dl[1] = {N_ITEMS};
    write_idx_file(tpath("img.idx"), 0x08, 3, di, im);
    write_idx_file(tpath("lbl.idx"), 0x0C, 1, dl, lab);
    write_idx_file(tpath("bad.idx"), 0x0C, 1, dl, bad);
    write_idx_file(tpath("id.idx"), 0x0C, 1, dl, id);
}

/* ---- spec builders -------------------------------------------------------- */

static loom_dataset_spec *spec_base(int bad_labels)
{
    setup();
    loom_dataset_spec *s = calloc(1, sizeof *s);
    s->present = true;
    spec_feature(s, "image", tpath("img.idx"));
    spec_feature(s, "label", tpath(bad_labels ? "bad.idx" : "lbl.idx"));
    spec_feature(s, "id", tpath("id.idx"));
    return s;
}

/* par: 1, N or LOOM_PARALLEL_AUTO */
static loom_map_spec *add_map(loom_dataset_spec *s, loom_map_kind k, const char *feature, int par, bool det)
{
    return spec_map(s, k, feature, par, det);
}

static const loom_data_ctx ctx4 = {.seed = 42, .threads = 4, .name = "train"};

static loom_iter *open_ok(const loom_dataset_spec *s) { return iter_open_ok(s, &ctx4); }

/* Hashes of the elements of passes [epoch0, epoch0 + passes), up to max in
 * total; errors end a pass. Returns the count. */
static int run(loom_iter *it, int64_t epoch0, int passes, uint64_t *out, int max)
{
    int n = 0;
    loom_err err;
    for (int p = 0; p < passes; p++) {
        if (p || epoch0) loom_iter_rewind(it, epoch0 + p, &err);
        loom_elem *e;
        while (n < max && loom_iter_next(it, &e, &err) == LOOM_OK) out[n++] = elem_hash(e);
    }
    return n;
}

/* cast -> random flip -> scale on the image, then batch; every map with par. */
static loom_dataset_spec *spec_maps(int par, bool det, int batch)
{
    loom_dataset_spec *s = spec_base(0);
    add_map(s, LOOM_MAP_CAST, "image", par, det)->dtype = LOOM_CFG_F32;
    add_map(s, LOOM_MAP_FLIP_LR, "image", par, det);
    add_map(s, LOOM_MAP_SCALE, "image", par, det)->scale = 1.0 / 255.0;
    add_map(s, LOOM_MAP_ONE_HOT, "label", par, det)->depth = 10;
    if (batch) spec_batch(s, batch);
    return s;
}

#define MAXH 4096

/* ---- tests ------------------------------------------------------------------ */

static void test_same_output_any_parallelism(void)
{
    static uint64_t ref[MAXH], got[MAXH];
    const int pars[] = {1, 2, 4, LOOM_PARALLEL_AUTO};
    for (int batch = 0; batch <= 8; batch += 8) {
        int nref = 0;
        for (size_t k = 0; k < sizeof pars / sizeof pars[0]; k++) {
            loom_dataset_spec *s = spec_maps(pars[k], true, batch);
            loom_iter *it = open_ok(s);
            if (it) {
                int n = run(it, 0, 3, k ? got : ref, MAXH);
                if (!k) {
                    nref = n;
                    CHECK(n == 3 * (batch ? (N_ITEMS + 7) / 8 : N_ITEMS));
                } else {
                    CHECK_MSG(n == nref && !memcmp(ref, got, (size_t)n * sizeof *got), "parallel %d, batch %d: differs", pars[k],
                              batch);
                }
                loom_stage_stats st[8];
                int ns = loom_iter_stats(it, st, 8);
                CHECK(ns == 6 - !batch);
                if (pars[k] > 1) CHECK(st[1].parallel == pars[k]);
                if (pars[k] == LOOM_PARALLEL_AUTO) CHECK(st[1].parallel >= 1 && st[1].parallel <= 4);
                if (pars[k] == 1) CHECK(st[1].parallel == 0);
                loom_iter_close(it);
            }
            free(s);
        }
    }
}

/* With the autotuner moving the window while the pipeline runs (data.options
 * present, maps fused, sequential maps made parallel by map_parallelization),
 * the output is still that of the sequential maps, and the choice is reported. */
static void test_tuned_same_output(void)
{
    static uint64_t ref[MAXH], got[MAXH];
    loom_dataset_spec *s = spec_maps(1, true, 8);
    loom_iter *it = open_ok(s);
    int nref = it ? run(it, 0, 3, ref, MAXH) : 0;
    loom_iter_close(it);
    const int pars[] = {LOOM_PARALLEL_AUTO, 1};
    for (int k = 0; k < 2; k++) {
        free(s);
        s = spec_maps(pars[k], true, 8);
        s->options = (loom_data_options){.present = true, .deterministic = true, .autotune = true, .cpu_budget = 3,
                                         .ram_fraction = 0.5, .noop_elimination = true, .map_fusion = true,
                                         .map_and_batch_fusion = true, .map_parallelization = true, .inject_prefetch = true};
        it = open_ok(s);
        if (!it) continue;
        int n = run(it, 0, 3, got, MAXH);
        CHECK_MSG(n == nref && !memcmp(ref, got, (size_t)n * sizeof *got), "parallel %d tuned: differs", pars[k]);
        char tuned[512];
        loom_iter_tuned(it, tuned, sizeof tuned);
        CHECK_CONTAINS(tuned, "map(cast+random_flip_left_right+scale+..)+batch: parallel "); /* maps and batch fused */
        loom_iter_close(it);
    }
    free(s);
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static void test_nondeterministic_same_multiset(void)
{
    static uint64_t ref[MAXH], got[MAXH];
    /* downstream of an unordered stage the element indices change, so only the
     * first map is random: its RNG index is fixed at dispatch, in input order */
    loom_dataset_spec *a = spec_maps(1, true, 0), *b = spec_maps(4, false, 0);
    for (int i = 0; i < 2; i++) {
        loom_dataset_spec *x = i ? b : a;
        loom_transform_spec t = x->transform[0];
        x->transform[0] = x->transform[1];
        x->transform[1] = t;
    }
    loom_iter *ia = open_ok(a), *ib = open_ok(b);
    if (ia && ib) {
        int na = run(ia, 0, 2, ref, MAXH), nb = run(ib, 0, 2, got, MAXH);
        CHECK(na == 2 * N_ITEMS);
        CHECK(nb == na);
        /* per epoch: the same elements */
        for (int ep = 0; ep < 2; ep++) {
            qsort(ref + ep * N_ITEMS, N_ITEMS, sizeof *ref, cmp_u64);
            qsort(got + ep * N_ITEMS, N_ITEMS, sizeof *got, cmp_u64);
        }
        CHECK(!memcmp(ref, got, (size_t)na * sizeof *ref));
    }
    loom_iter_close(ia);
    loom_iter_close(ib);
    free(a);
    free(b);
}

/* shuffle -> parallel flip -> parallel cast+scale -> batch -> parallel one_hot -> prefetch */
static loom_dataset_spec *spec_resume(int par)
{
    loom_dataset_spec *s = spec_base(0);
    spec_shuffle(s, 64);
    add_map(s, LOOM_MAP_FLIP_LR, "image", par, true);
    add_map(s, LOOM_MAP_CAST, "image", par, true)->dtype = LOOM_CFG_F32;
    add_map(s, LOOM_MAP_SCALE, "image", par == 1 ? 1 : 3, true)->scale = 0.5;
    spec_batch(s, 7);
    add_map(s, LOOM_MAP_ONE_HOT, "label", par == 1 ? 1 : LOOM_PARALLEL_AUTO, true)->depth = 10;
    spec_prefetch(s, 2);
    return s;
}

static void test_save_restore_exact(void)
{
    static uint64_t ref[MAXH];
    const int per = (N_ITEMS + 6) / 7;
    /* the reference: parallel 1, two epochs */
    loom_dataset_spec *s1 = spec_resume(1);
    loom_iter *it = open_ok(s1);
    int nref = it ? run(it, 0, 2, ref, MAXH) : 0;
    CHECK(nref == 2 * per);
    loom_iter_close(it);
    free(s1);
    loom_dataset_spec *s = spec_resume(4);
    const int cuts[] = {0, 1, 5, 20, per - 1, per, per + 3};
    for (size_t c = 0; c < sizeof cuts / sizeof cuts[0]; c++) {
        int cut = cuts[c];
        loom_iter *a = open_ok(s);
        if (!a) break;
        loom_err err;
        loom_elem *e;
        int n = 0, ok = 1;
        int64_t epoch = 0;
        while (n < cut) {
            int rc = loom_iter_next(a, &e, &err);
            if (rc == LOOM_EEOF) {
                loom_iter_rewind(a, ++epoch, &err);
                continue;
            }
            ok = ok && rc == LOOM_OK && elem_hash(e) == ref[n];
            n++;
        }
        CHECK_MSG(ok, "cut %d: the prefix differs", cut);
        loom_buf b;
        loom_buf_init(&b);
        CHECK(loom_iter_save(a, &b, &err) == LOOM_OK);
        /* the saved iterator goes on unchanged */
        int m = n;
        while (m < n + 10 && m < nref) {
            int rc = loom_iter_next(a, &e, &err);
            if (rc == LOOM_EEOF) {
                loom_iter_rewind(a, ++epoch, &err);
                continue;
            }
            CHECK_MSG(rc == LOOM_OK && elem_hash(e) == ref[m], "cut %d: after save, element %d differs", cut, m);
            m++;
        }
        loom_iter_close(a);
        /* a new iterator restored from the state continues exactly */
        loom_iter *r = open_ok(s);
        if (!r) {
            loom_buf_fini(&b);
            break;
        }
        loom_buf rb;
        loom_buf_wrap(&rb, b.data, b.len);
        int rc = loom_iter_restore(r, &rb, &err);
        CHECK_MSG(rc == LOOM_OK, "cut %d: restore: %s", cut, err.msg);
        epoch = n > per ? 1 : 0;
        int k = 0;
        for (m = n; m < nref && !rc;) {
            rc = loom_iter_next(r, &e, &err);
            if (rc == LOOM_EEOF) {
                rc = loom_iter_rewind(r, ++epoch, &err);
                continue;
            }
            if (rc != LOOM_OK || elem_hash(e) != ref[m]) break;
            m++, k++;
        }
        CHECK_MSG(m == nref, "cut %d: resumed stream matches up to %d of %d", cut, m, nref);
        loom_iter_close(r);
        loom_buf_fini(&b);
    }
    free(s);
}

static void test_error_in_order(void)
{
    for (int par = 1; par <= 4; par += 3) {
        loom_dataset_spec *s = spec_base(1);
        add_map(s, LOOM_MAP_CAST, "image", par, true)->dtype = LOOM_CFG_F32;
        add_map(s, LOOM_MAP_ONE_HOT, "label", par, true)->depth = 10;
        loom_iter *it = open_ok(s);
        if (!it) {
            free(s);
            continue;
        }
        int fid = loom_elem_spec_find(loom_iter_spec(it), "id");
        loom_elem *e;
        loom_err err;
        int k = 0, rc, order_ok = 1;
        while ((rc = loom_iter_next(it, &e, &err)) == LOOM_OK) {
            order_ok = order_ok && ((int32_t *)e->t[fid].data)[0] == k;
            k++;
        }
        CHECK(order_ok);
        CHECK_MSG(k == BAD_AT, "parallel %d: the error surfaced after %d elements, not %d", par, k, BAD_AT);
        CHECK(rc == LOOM_EDATA);
        CHECK_CONTAINS(err.msg, "element 137 has value 99");
        CHECK_CONTAINS(err.where, "test.cfg:21");
        /* then the pass goes on with the next element, as the sequential map does */
        rc = loom_iter_next(it, &e, &err);
        CHECK(rc == LOOM_OK && ((int32_t *)e->t[fid].data)[0] == BAD_AT + 1);
        int rest = 1;
        while (loom_iter_next(it, &e, &err) == LOOM_OK) rest++;
        CHECK(rest == N_ITEMS - BAD_AT - 1);
        loom_iter_close(it);
        free(s);
    }
}

static void test_shutdown_mid_epoch(void)
{
    for (int reads = 0; reads < 40; reads += 13) {
        loom_dataset_spec *s = spec_resume(4);
        loom_iter *it = open_ok(s);
        loom_elem *e;
        loom_err err;
        for (int i = 0; it && i < reads; i++) CHECK(loom_iter_next(it, &e, &err) == LOOM_OK);
        loom_iter_close(it); /* with calls in flight and a producer running */
        free(s);
    }
    CHECK(1);
}

static void test_report(void)
{
    loom_dataset_spec *s = spec_resume(2);
    loom_iter *it = open_ok(s);
    if (it) {
        loom_elem *e;
        loom_err err;
        double t0 = loom_now();
        while (loom_iter_next(it, &e, &err) == LOOM_OK) {}
        char *buf = NULL;
        size_t len = 0;
        FILE *f = open_memstream(&buf, &len);
        CHECK(loom_iter_report(it, loom_now() - t0, f) == LOOM_OK);
        fclose(f);
        CHECK_CONTAINS(buf, "map(random_flip_left_right)");
        CHECK_CONTAINS(buf, "shuffle");
        CHECK_CONTAINS(buf, "prefetch");
        CHECK_CONTAINS(buf, "bottleneck: ");
        free(buf);
        loom_iter_close(it);
    }
    free(s);
}

static void test_config_rejects(void)
{
    /* parallel 0 means "unset" (1); a map's window is at least one slot */
    loom_dataset_spec *s = spec_maps(0, true, 0);
    loom_iter *it = open_ok(s);
    loom_stage_stats st[8];
    if (it) CHECK(loom_iter_stats(it, st, 8) == 5 && st[1].parallel == 0);
    loom_iter_close(it);
    free(s);
}

static int skip_catalog(void)
{
    const char *v = getenv("LOOM_DATA_SKIP_CATALOG");
    if (v && *v == '1') return 1;
    char img[LOOM_PATH_MAX], lbl[LOOM_PATH_MAX];
    loom_err err;
    if (loom_catalog_resolve("fashion_mnist", "train", img, lbl, &err) != LOOM_OK) {
        printf("# skipped: %s\n", err.msg);
        return 1;
    }
    return 0;
}

static void test_throughput_fashion_mnist(void)
{
    if (skip_catalog()) return;
    for (int where = 0; where < 2; where++)
        for (int par = 1; par <= 2; par++) {
            loom_dataset_spec *s = calloc(1, sizeof *s);
            s->present = true;
            s->source.kind = LOOM_SRC_CATALOG;
            snprintf(s->source.catalog.name, sizeof s->source.catalog.name, "fashion_mnist");
            snprintf(s->source.catalog.split, sizeof s->source.catalog.split, "train");
            if (where) spec_batch(s, 128);
            add_map(s, LOOM_MAP_CAST, "image", par, true)->dtype = LOOM_CFG_F32;
            add_map(s, LOOM_MAP_FLIP_LR, "image", par, true);
            add_map(s, LOOM_MAP_NORMALIZE, "image", par, true)->std = 64.0;
            if (!where) spec_batch(s, 128);
            spec_prefetch(s, -1);
            loom_iter *it = open_ok(s);
            if (!it) {
                free(s);
                return;
            }
            loom_elem *e;
            loom_err err;
            double t0 = loom_now();
            int64_t n = 0;
            while (loom_iter_next(it, &e, &err) == LOOM_OK) n += e->t[0].shape.dim[0];
            double dt = loom_now() - t0;
            CHECK(n == 60000);
            printf("# fashion_mnist %s maps (cast, flip, normalize) parallel %d: %.0f samples/s (%.3f s/epoch, %d cores)\n",
                   where ? "batch-level" : "element-level", par, (double)n / dt, dt, loom_num_cores());
            loom_iter_close(it);
            free(s);
        }
}

static void test_cleanup(void) { tmpdir_remove(); }

static const loom_test tests[] = {
    {"same_output_any_parallelism", test_same_output_any_parallelism},
    {"nondeterministic_same_multiset", test_nondeterministic_same_multiset},
    {"tuned_same_output", test_tuned_same_output},
    {"save_restore_exact", test_save_restore_exact},
    {"error_in_order", test_error_in_order},
    {"shutdown_mid_epoch", test_shutdown_mid_epoch},
    {"report", test_report},
    {"parallel_unset_is_sequential", test_config_rejects},
    {"throughput_fashion_mnist", test_throughput_fashion_mnist},
    {"cleanup", test_cleanup},
    {0},
};

int main(void) { return loom_test_run(tests); }
