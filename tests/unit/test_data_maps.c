/* test_data_maps.c - the input pipeline's map ops on the IDX fixtures of
 * data_fixtures.h: cast, scale and normalize, one_hot, reshape, the random
 * flips, pad, random_crop (sequential and parallel) and standardize, each
 * with the errors it gives (test_data.c has the sources, shuffle, batch and
 * the rest). */
#include "data_fixtures.h"

#include <math.h>

/* ---- map ops ------------------------------------------------------------------ */

static void test_map_cast_scale_normalize(void)
{
    setup();
    loom_dataset_spec *s = spec_small(0);
    add_map(s, LOOM_MAP_CAST, "image")->dtype = LOOM_CFG_F32;
    loom_map_spec *m = add_map(s, LOOM_MAP_SCALE, "image");
    m->scale = 0.5;
    m->offset = 1.0;
    m = add_map(s, LOOM_MAP_NORMALIZE, "label");
    m->mean = 2.0;
    m->std = 4.0;
    add_map(s, LOOM_MAP_CAST, "label")->dtype = LOOM_CFG_F64; /* float32 -> float64 */
    loom_iter *it = open_ok(s);
    if (it) {
        char buf[256];
        CHECK_CONTAINS(loom_elem_spec_str(loom_iter_spec(it), buf, sizeof buf), "image: float32 (4, 3); label: float64 ()");
        loom_elem *e;
        loom_err err;
        int i = 0, bad = 0;
        while (loom_iter_next(it, &e, &err) == LOOM_OK) {
            const float *x = e->t[0].data;
            for (int k = 0; k < 12; k++) bad += fabsf(x[k] - ((float)(i * 16 + k) * 0.5f + 1.0f)) > 1e-6f;
            bad += fabs(*(double *)e->t[1].data - (i - 2.0) / 4.0) > 1e-6;
            i++;
        }
        CHECK(i == N_ITEMS && bad == 0);
        loom_iter_close(it);
    }
    free(s);
    /* the source stays untouched (maps must not write into the loaded arrays): run twice */
    s = spec_small(0);
    add_map(s, LOOM_MAP_SCALE, "image")->scale = 2.0;
    it = open_ok(s);
    if (it) {
        blob a = {0}, b = {0};
        loom_err err;
        run_into(it, &a, -1);
        loom_iter_rewind(it, 1, &err);
        run_into(it, &b, -1);
        CHECK(a.n == b.n && !memcmp(a.p, b.p, a.n));
        free(a.p);
        free(b.p);
        loom_iter_close(it);
    }
    free(s);
    /* a NaN in an IDX float file is refused at open (on_nonfinite = error),
     * naming the file, the item and the offset */
    float fv[4] = {-5.0f, 3.7f, 300.0f, NAN};
    uint32_t d[2] = {1, 4};
    write_idx(tpath("fsat.idx"), 0, 0x0D, 2, d, fv, 0);
    s = spec_new();
    spec_feature(s, "x", tpath("fsat.idx"));
    {
        loom_err err;
        CHECK(open_fail(s, &err) == LOOM_EDATA);
        CHECK_CONTAINS(err.where, "fsat.idx");
        CHECK_CONTAINS(err.msg, "item 0 (0-based) of feature \"x\": non-finite value nan at offset 3");
    }
    free(s);
    /* float -> uint8 saturates, int32 in place, same dtype is a no-op */
    fv[3] = -0.5f;
    write_idx(tpath("fsat.idx"), 0, 0x0D, 2, d, fv, 0);
    s = spec_new();
    spec_feature(s, "x", tpath("fsat.idx"));
    add_map(s, LOOM_MAP_CAST, "x")->dtype = LOOM_CFG_U8;
    add_map(s, LOOM_MAP_CAST, "x")->dtype = LOOM_CFG_U8;
    add_map(s, LOOM_MAP_CAST, "x")->dtype = LOOM_CFG_I64;
    it = open_ok(s);
    if (it) {
        loom_elem *e;
        loom_err err;
        CHECK(loom_iter_next(it, &e, &err) == LOOM_OK);
        CHECK(e->t[0].dtype == LOOM_I64);
        const int64_t *v = e->t[0].data;
        CHECK(v[0] == 0 && v[1] == 3 && v[2] == 255 && v[3] == 0);
        loom_iter_close(it);
    }
    free(s);
}

static void test_map_one_hot(void)
{
    setup();
    loom_dataset_spec *s = spec_small(1);
    add_map(s, LOOM_MAP_ONE_HOT, "label")->depth = 10;
    loom_iter *it = open_ok(s);
    if (it) {
        CHECK(loom_iter_spec(it)->shape[1].rank == 1 && loom_iter_spec(it)->shape[1].dim[0] == 10);
        CHECK(loom_iter_spec(it)->dtype[1] == LOOM_F32);
        loom_elem *e;
        loom_err err;
        int i = 0, bad = 0;
        while (loom_iter_next(it, &e, &err) == LOOM_OK) {
            bad += e->t[1].shape.rank != 1 || e->t[1].shape.dim[0] != 10;
            for (int k = 0; k < 10; k++) bad += ((float *)e->t[1].data)[k] != (k == i ? 1.0f : 0.0f);
            i++;
        }
        CHECK(i == N_ITEMS && bad == 0);
        loom_iter_close(it);
    }
    /* out of range: an error naming the element, after the good ones */
    s->transform[0].map.depth = 7;
    it = open_ok(s);
    if (it) {
        loom_elem *e;
        loom_err err = {0};
        int i = 0, rc;
        while ((rc = loom_iter_next(it, &e, &err)) == LOOM_OK) i++;
        CHECK(i == 7);
        CHECK(rc == LOOM_EDATA);
        CHECK_CONTAINS(err.msg, "element 7");
        CHECK_CONTAINS(err.msg, "value 7");
        CHECK_CONTAINS(err.where, "test.cfg:20");
        loom_iter_close(it);
    }
    /* after batch: (B,) -> (B, depth) */
    s->transform[0].map.depth = 10;
    s->n_transforms = 0;
    add_batch(s, 4, false);
    add_map(s, LOOM_MAP_ONE_HOT, "label")->depth = 10;
    it = open_ok(s);
    if (it) {
        loom_elem *e;
        loom_err err;
        CHECK(loom_iter_next(it, &e, &err) == LOOM_OK);
        CHECK(e->t[1].shape.rank == 2 && e->t[1].shape.dim[0] == 4 && e->t[1].shape.dim[1] == 10);
        CHECK(((float *)e->t[1].data)[2 * 10 + 2] == 1.0f && ((float *)e->t[1].data)[2 * 10 + 3] == 0.0f);
        loom_iter_close(it);
    }
    /* on a float feature: refused at open */
    s->n_transforms = 0;
    add_map(s, LOOM_MAP_CAST, "label")->dtype = LOOM_CFG_F32;
    add_map(s, LOOM_MAP_ONE_HOT, "label")->depth = 10;
    loom_err err;
    CHECK(open_fail(s, &err) == LOOM_ESHAPE);
    CHECK_CONTAINS(err.where, "test.cfg:21");
    CHECK_CONTAINS(err.msg, "float32");
    free(s);
}

static void test_map_reshape(void)
{
    setup();
    loom_dataset_spec *s = spec_small(0);
    loom_map_spec *m = add_map(s, LOOM_MAP_RESHAPE, "image");
    m->rank = 3;
    m->shape[0] = 2;
    m->shape[1] = -1;
    m->shape[2] = 3;
    loom_iter *it = open_ok(s);
    if (it) {
        const loom_shape *sh = &loom_iter_spec(it)->shape[0];
        CHECK(sh->rank == 3 && sh->dim[0] == 2 && sh->dim[1] == 2 && sh->dim[2] == 3);
        loom_elem *e;
        loom_err err;
        CHECK(loom_iter_next(it, &e, &err) == LOOM_OK);
        CHECK(loom_shape_eq(&e->t[0].shape, sh));
        CHECK(((uint8_t *)e->t[0].data)[11] == 11);
        loom_iter_close(it);
    }
    /* wrong size: refused at open, naming the transform's file:line */
    m->shape[1] = 3;
    loom_err err;
    CHECK(open_fail(s, &err) == LOOM_ESHAPE);
    CHECK_CONTAINS(err.where, "test.cfg:20");
    CHECK_CONTAINS(err.msg, "data.train.transforms.[0]");
    CHECK_CONTAINS(err.msg, "12 values");
    CHECK_CONTAINS(err.msg, "18 values");
    /* unknown feature: lists the available ones */
    snprintf(m->feature, sizeof m->feature, "pixels");
    CHECK(open_fail(s, &err) == LOOM_ECONFIG);
    CHECK_CONTAINS(err.msg, "\"pixels\"");
    CHECK_CONTAINS(err.msg, "available: image, label");
    /* after batch the batch dim is kept */
    s->n_transforms = 0;
    add_batch(s, 4, true);
    m = add_map(s, LOOM_MAP_RESHAPE, "image");
    m->rank = 1;
    m->shape[0] = -1;
    it = open_ok(s);
    if (it) {
        const loom_shape *sh = &loom_iter_spec(it)->shape[0];
        CHECK(sh->rank == 2 && sh->dim[0] == 4 && sh->dim[1] == 12);
        loom_iter_close(it);
    }
    free(s);
}

static void test_map_flip(void)
{
    setup();
    /* 200 images (2, 5) with distinct rows, float32 via cast */
    enum { N = 200 };
    uint8_t im[N * 10];
    uint8_t lb[N];
    for (int i = 0; i < N; i++) {
        lb[i] = (uint8_t)i;
        for (int k = 0; k < 10; k++) im[i * 10 + k] = (uint8_t)(k + i);
    }
    uint32_t di[3] = {N, 2, 5}, dl[1] = {N};
    write_idx(tpath("flip_img.idx"), 0, 0x08, 3, di, im, 0);
    write_idx(tpath("flip_lbl.idx"), 0, 0x08, 1, dl, lb, 0);
    for (int variant = 0; variant < 3; variant++) {
        /* 0: on the read-only source (copy), 1: in place after a cast, 2: after batch */
        loom_dataset_spec *s = spec_new();
        spec_feature(s, "image", tpath("flip_img.idx"));
        spec_feature(s, "label", tpath("flip_lbl.idx"));
        if (variant == 1) add_map(s, LOOM_MAP_CAST, "image")->dtype = LOOM_CFG_I32;
        if (variant == 2) add_batch(s, 8, false);
        add_map(s, LOOM_MAP_FLIP_LR, "image");
        int stage = s->n_transforms; /* stage id of the flip */
        loom_iter *it = open_ok(s);
        if (!it) {
            free(s);
            continue;
        }
        for (int epoch = 0; epoch < 2; epoch++) {
            loom_elem *e;
            loom_err err;
            int idx = 0, flipped = 0, bad = 0;
            while (loom_iter_next(it, &e, &err) == LOOM_OK) {
                int64_t imgs = variant == 2 ? e->t[0].shape.dim[0] : 1;
                for (int64_t j = 0; j < imgs; j++, idx++) {
                    loom_rng g;
                    loom_rng_init(&g, 42, (uint64_t)stage, (uint64_t)epoch, (uint64_t)idx);
                    int want = loom_rng_uniform(&g) < 0.5f;
                    flipped += want;
                    for (int h = 0; h < 2; h++)
                        for (int w = 0; w < 5; w++) {
                            double got = loom_tensor_get(&e->t[0], j * 10 + h * 5 + w);
                            double exp = im[idx * 10 + h * 5 + (want ? 4 - w : w)];
                            bad += got != exp;
                        }
                }
            }
            CHECK(idx == N);
            CHECK_MSG(bad == 0, "variant %d epoch %d: %d wrong values", variant, epoch, bad);
            CHECK_MSG(flipped > 70 && flipped < 130, "flipped %d of %d", flipped, N);
            loom_iter_rewind(it, epoch + 1, &err);
        }
        /* the source arrays are unchanged: a plain pipeline still reads the originals */
        loom_iter_close(it);
        free(s);
    }
    loom_dataset_spec *s = spec_new();
    spec_feature(s, "image", tpath("flip_img.idx"));
    spec_feature(s, "label", tpath("flip_lbl.idx"));
    add_map(s, LOOM_MAP_FLIP_LR, "label");
    loom_err err;
    CHECK(open_fail(s, &err) == LOOM_ESHAPE);
    CHECK_CONTAINS(err.msg, "(H, W)");
    free(s);
}

/* Checks the batched-refusal of an unbatched-only map kind k on the small fixture. */
static void check_refused_after_batch(loom_map_kind k)
{
    loom_dataset_spec *s = spec_small(0);
    add_batch(s, 4, false);
    loom_map_spec *m = add_map(s, k, "image");
    m->padding = 1;
    m->size[0] = m->size[1] = 2;
    loom_err err;
    CHECK(open_fail(s, &err) == LOOM_ECONFIG);
    CHECK_CONTAINS(err.where, "test.cfg:21");
    CHECK_CONTAINS(err.msg, "data.train.transforms.[1]");
    CHECK_CONTAINS(err.msg, "before the batch");
    free(s);
}

static void test_map_pad(void)
{
    setup();
    /* (4, 3) uint8 -> (6, 5), border 7 */
    loom_dataset_spec *s = spec_small(0);
    loom_map_spec *m = add_map(s, LOOM_MAP_PAD, "image");
    m->padding = 1;
    m->value = 7;
    loom_iter *it = open_ok(s);
    if (it) {
        const loom_shape *sh = &loom_iter_spec(it)->shape[0];
        CHECK(sh->rank == 2 && sh->dim[0] == 6 && sh->dim[1] == 5);
        CHECK(loom_iter_spec(it)->dtype[0] == LOOM_U8);
        loom_elem *e;
        loom_err err;
        int i = 0, bad = 0;
        while (loom_iter_next(it, &e, &err) == LOOM_OK) {
            CHECK(loom_shape_eq(&e->t[0].shape, sh));
            for (int h = 0; h < 6; h++)
                for (int w = 0; w < 5; w++) {
                    int in = h >= 1 && h <= 4 && w >= 1 && w <= 3;
                    double want = in ? i * 16 + (h - 1) * 3 + (w - 1) : 7;
                    bad += loom_tensor_get(&e->t[0], h * 5 + w) != want;
                }
            i++;
        }
        CHECK(i == N_ITEMS);
        CHECK_MSG(bad == 0, "%d wrong values", bad);
        loom_iter_close(it);
    }
    free(s);
    /* (2, 2, 3) float32 -> (6, 6, 3), border -1.5 */
    s = spec_small(0);
    add_map(s, LOOM_MAP_CAST, "image")->dtype = LOOM_CFG_F32;
    m = add_map(s, LOOM_MAP_RESHAPE, "image");
    m->rank = 3;
    m->shape[0] = 2;
    m->shape[1] = 2;
    m->shape[2] = 3;
    m = add_map(s, LOOM_MAP_PAD, "image");
    m->padding = 2;
    m->value = -1.5;
    it = open_ok(s);
    if (it) {
        const loom_shape *sh = &loom_iter_spec(it)->shape[0];
        CHECK(sh->rank == 3 && sh->dim[0] == 6 && sh->dim[1] == 6 && sh->dim[2] == 3);
        loom_elem *e;
        loom_err err;
        CHECK(loom_iter_next(it, &e, &err) == LOOM_OK);
        CHECK(e->t[0].dtype == LOOM_F32 && loom_shape_eq(&e->t[0].shape, sh));
        int bad = 0;
        for (int h = 0; h < 6; h++)
            for (int w = 0; w < 6; w++)
                for (int c = 0; c < 3; c++) {
                    int in = h >= 2 && h <= 3 && w >= 2 && w <= 3;
                    double want = in ? ((h - 2) * 2 + (w - 2)) * 3 + c : -1.5;
                    bad += loom_tensor_get(&e->t[0], (h * 6 + w) * 3 + c) != want;
                }
        CHECK_MSG(bad == 0, "%d wrong values", bad);
        loom_iter_close(it);
    }
    free(s);
    /* errors: a fill the dtype cannot hold, a scalar feature, after batch */
    loom_err err;
    s = spec_small(0);
    m = add_map(s, LOOM_MAP_PAD, "image");
    m->padding = 1;
    m->value = 300;
    CHECK(open_fail(s, &err) == LOOM_ECONFIG);
    CHECK_CONTAINS(err.where, "test.cfg:20");
    CHECK_CONTAINS(err.msg, "300");
    snprintf(m->feature, sizeof m->feature, "label");
    m->value = 0;
    CHECK(open_fail(s, &err) == LOOM_ESHAPE);
    CHECK_CONTAINS(err.msg, "(H, W)");
    free(s);
    check_refused_after_batch(LOOM_MAP_PAD);
}

/* crop [3, 4] of 200 images (5, 6) whose pixel k holds k; parallel: calls at once */
static loom_dataset_spec *spec_crop(int parallel)
{
    loom_dataset_spec *s = spec_new();
    spec_feature(s, "image", tpath("crop_img.idx"));
    spec_feature(s, "label", tpath("crop_lbl.idx"));
    loom_map_spec *m = add_map(s, LOOM_MAP_RANDOM_CROP, "image");
    m->size[0] = 3;
    m->size[1] = 4;
    s->transform[s->n_transforms - 1].parallel = parallel;
    s->transform[s->n_transforms - 1].deterministic = true; /* emit in input order */
    return s;
}

static void test_map_random_crop(void)
{
    setup();
    enum { N = 200 };
    uint8_t im[N * 30], lb[N];
    for (int i = 0; i < N; i++) {
        lb[i] = (uint8_t)i;
        for (int k = 0; k < 30; k++) im[i * 30 + k] = (uint8_t)k;
    }
    uint32_t di[3] = {N, 5, 6}, dl[1] = {N};
    write_idx(tpath("crop_img.idx"), 0, 0x08, 3, di, im, 0);
    write_idx(tpath("crop_lbl.idx"), 0, 0x08, 1, dl, lb, 0);
    loom_dataset_spec *s = spec_crop(1);
    int stage = s->n_transforms; /* stage id of the crop */
    loom_iter *it = open_ok(s);
    blob ep[3] = {0};
    if (it) {
        const loom_shape *sh = &loom_iter_spec(it)->shape[0];
        CHECK(sh->rank == 2 && sh->dim[0] == 3 && sh->dim[1] == 4);
        for (int pass = 0; pass < 3; pass++) {
            int epoch = pass == 2 ? 0 : pass; /* epochs 0, 1, then 0 again */
            loom_err err;
            if (pass) loom_iter_rewind(it, epoch, &err);
            loom_elem *e;
            int idx = 0, bad = 0, seen[9] = {0};
            while (loom_iter_next(it, &e, &err) == LOOM_OK) {
                CHECK(loom_shape_eq(&e->t[0].shape, sh));
                loom_rng g;
                loom_rng_init(&g, 42, (uint64_t)stage, (uint64_t)epoch, (uint64_t)idx);
                int oh = (int)loom_rng_below(&g, 3), ow = (int)loom_rng_below(&g, 3);
                seen[oh * 3 + ow]++;
                for (int r = 0; r < 3; r++)
                    for (int c = 0; c < 4; c++) bad += loom_tensor_get(&e->t[0], r * 4 + c) != (oh + r) * 6 + ow + c;
                blob_elem(&ep[pass], e);
                idx++;
            }
            CHECK(idx == N);
            CHECK_MSG(bad == 0, "epoch %d: %d wrong values", epoch, bad);
            for (int k = 0; k < 9; k++) CHECK_MSG(seen[k] > 5, "offset (%d, %d) seen %d times", k / 3, k % 3, seen[k]);
        }
        CHECK(ep[0].n == ep[2].n && !memcmp(ep[0].p, ep[2].p, ep[0].n));
        CHECK(ep[0].n == ep[1].n && memcmp(ep[0].p, ep[1].p, ep[0].n) != 0);
        loom_iter_close(it);
    }
    free(s);
    /* parallel map: the same crops */
    s = spec_crop(3);
    it = open_ok(s);
    if (it) {
        blob b = {0};
        CHECK(run_into(it, &b, -1) == LOOM_EEOF);
        CHECK(b.n == ep[0].n && !memcmp(b.p, ep[0].p, b.n));
        free(b.p);
        loom_iter_close(it);
    }
    for (int k = 0; k < 3; k++) free(ep[k].p);
    /* larger than the input: refused at open, naming the transform's file:line */
    s->transform[0].map.size[0] = 6;
    loom_err err;
    CHECK(open_fail(s, &err) == LOOM_ECONFIG);
    CHECK_CONTAINS(err.where, "test.cfg:20");
    CHECK_CONTAINS(err.msg, "[6, 4]");
    free(s);
    check_refused_after_batch(LOOM_MAP_RANDOM_CROP);
}

/* Mean and population std of n float32 values. */
static void moments(const float *x, int n, double *mean, double *sd)
{
    double m = 0, v = 0;
    for (int i = 0; i < n; i++) m += x[i];
    m /= n;
    for (int i = 0; i < n; i++) v += (x[i] - m) * (x[i] - m);
    *mean = m;
    *sd = sqrt(v / n);
}

static void test_map_standardize(void)
{
    setup();
    /* variant 0: from the read-only uint8 source; 1: in place after scale 0.001 (std below
     * the floor 1/sqrt(12)); 2: constant (scale 0); 3: as 0 with parallel = 2 */
    for (int variant = 0; variant < 4; variant++) {
        loom_dataset_spec *s = spec_small(0);
        if (variant == 1 || variant == 2) add_map(s, LOOM_MAP_SCALE, "image")->scale = variant == 1 ? 0.001 : 0.0;
        add_map(s, LOOM_MAP_STANDARDIZE, "image");
        if (variant == 3) {
            s->transform[0].parallel = 2;
            s->transform[0].deterministic = true;
        }
        loom_iter *it = open_ok(s);
        if (!it) {
            free(s);
            continue;
        }
        CHECK(loom_iter_spec(it)->dtype[0] == LOOM_F32);
        loom_elem *e;
        loom_err err;
        int i = 0, bad = 0;
        double sd12 = sqrt(143.0 / 12.0); /* std of 0..11 */
        while (loom_iter_next(it, &e, &err) == LOOM_OK) {
            const float *x = e->t[0].data;
            CHECK(e->t[0].dtype == LOOM_F32 && e->t[0].shape.rank == 2);
            double mean, sd;
            moments(x, 12, &mean, &sd);
            CHECK_NEAR(mean, 0.0, 1e-5);
            for (int k = 0; k < 12; k++) {
                double want = variant == 2 ? 0.0 : variant == 1 ? (k - 5.5) * 0.001 * sqrt(12.0) : (k - 5.5) / sd12;
                bad += fabs(x[k] - want) > 1e-4;
            }
            if (variant == 0 || variant == 3) CHECK_NEAR(sd, 1.0, 1e-5);
            i++;
        }
        CHECK(i == N_ITEMS);
        CHECK_MSG(bad == 0, "variant %d: %d wrong values", variant, bad);
        loom_iter_close(it);
        free(s);
    }
    check_refused_after_batch(LOOM_MAP_STANDARDIZE);
}

static void test_cleanup(void) { tmpdir_remove(); }

static const loom_test tests[] = {
    {"map_cast_scale_normalize", test_map_cast_scale_normalize},
    {"map_one_hot", test_map_one_hot},
    {"map_reshape", test_map_reshape},
    {"map_flip", test_map_flip},
    {"map_pad", test_map_pad},
    {"map_random_crop", test_map_random_crop},
    {"map_standardize", test_map_standardize},
    {"cleanup", test_cleanup},
    {0},
};

int main(void) { return loom_test_run(tests); }
