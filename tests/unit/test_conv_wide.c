/* test_conv_wide.c - appliance/nn/conv_wide.c, the direct kernel gradient of a 1x1 conv2d without padding (stride 1
 * and 2): against a double-precision reference of dW = sum over the output pixels of x(p)^T dz(p); bit-identical
 * whatever the split of the kernel rows between threads (1, 2, 3 parts) and between the AVX2 and the AVX-512 kernels;
 * nn_convp_ok_ takes only the shapes it handles, nn_convp_grad_ok_ (layers.c's) only their stride-2 ones
 * on AVX-512. */
#include "harness.h"
#include "nn/nn_internal.h"
#include "tensor/tensor.h"

#include <stdint.h>

static nn_layer_ layer(int hw, int cin, int cout, int s, int fma)
{
    nn_layer_ l;
    memset(&l, 0, sizeof l);
    l.ih = l.iw = hw, l.cin = cin, l.cout = cout, l.kh = l.kw = 1, l.sh = l.sw = s;
    l.oh = l.ow = (hw - 1) / s + 1, l.fma = fma;
    return l;
}

static float frand(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((*s >> 40) & 0xffff) / 65536.f - 0.5f;
}

/* one shape: B examples; every ISA the CPU has, 1-3 parts, against the reference */
static void check_shape(int hw, int cin, int cout, int s, int B)
{
    nn_layer_ l = layer(hw, cin, cout, s, 1);
    const int64_t nin = (int64_t)hw * hw * cin, P = (int64_t)l.oh * l.ow, K = cin;
    float *x = malloc((size_t)(B * nin) * sizeof *x), *dz = malloc((size_t)(B * P * cout) * sizeof *dz);
    float *first = malloc((size_t)(K * cout) * sizeof *first), *dw = malloc((size_t)(K * cout) * sizeof *dw);
    uint64_t seed = 7;
    for (int64_t i = 0; i < B * nin; i++) x[i] = frand(&seed);
    for (int64_t i = 0; i < B * P * cout; i++) dz[i] = frand(&seed);
    int have = loom_cpu()->level >= LOOM_CPU_AVX512 ? 2 : loom_cpu()->level >= LOOM_CPU_AVX2_FMA;
    if (!have) {
        printf("# no AVX2: nn_convp_ok_ refuses\n");
        l.fma = 0;
        CHECK(!nn_convp_ok_(&l));
    }
    int runs = 0;
    for (int fma = 1; fma <= have; fma++)
        for (int parts = 1; parts <= 3; parts++) {
            l.fma = fma;
            CHECK(nn_convp_ok_(&l));
            memset(dw, 0xff, (size_t)(K * cout) * sizeof *dw); /* NaNs: every row must be written */
            for (int part = 0; part < parts; part++) {
                int k0 = (int)(K * part / parts), k1 = (int)(K * (part + 1) / parts);
                if (k1 > k0) nn_convp_kernel_grad_(&l, x, dz, B, k0, k1, dw);
            }
            if (!runs++) memcpy(first, dw, (size_t)(K * cout) * sizeof *dw);
            CHECK_MSG(!memcmp(first, dw, (size_t)(K * cout) * sizeof *dw),
                      "%dx%d %d->%d stride %d: fma %d, %d parts differ from fma 1, 1 part", hw, hw, cin, cout, s, fma,
                      parts);
        }
    double worst = 0;
    for (int64_t k = 0; runs && k < K; k++)
        for (int co = 0; co < cout; co++) {
            double ref = 0, mag = 0;
            for (int b = 0; b < B; b++)
                for (int oy = 0; oy < l.oh; oy++)
                    for (int ox = 0; ox < l.ow; ox++) {
                        double v = (double)x[b * nin + ((int64_t)oy * s * hw + ox * s) * cin + k] *
                                   dz[((b * P) + oy * l.ow + ox) * cout + co];
                        ref += v, mag += fabs(v);
                    }
            double e = fabs(first[k * cout + co] - ref) / (mag + 1e-30);
            if (!(e <= worst)) worst = e;
        }
    CHECK_MSG(worst <= 1e-5, "%dx%d %d->%d stride %d: relative error %g", hw, hw, cin, cout, s, worst);
    free(x), free(dz), free(first), free(dw);
}

/* 81 pixels (a 64-pixel chain and a 17-pixel one), 18 kernel rows (sixes and ones), 80 channels (64 + 16) */
static void test_stride1(void) { check_shape(9, 18, 80, 1, 3); }
/* every other pixel of 13 (7x7 = 49 pixels, the last column read) and of 14 (the last column skipped) */
static void test_stride2(void)
{
    check_shape(13, 20, 32, 2, 2);
    check_shape(14, 64, 144, 2, 2);
}

static void test_ok(void)
{
    int fma = loom_cpu()->level >= LOOM_CPU_AVX2_FMA;
    nn_layer_ l = layer(9, 18, 80, 1, fma);
    CHECK(nn_convp_ok_(&l) == fma);
    l = layer(9, 18, 72, 1, fma); /* cout not a multiple of 16 */
    CHECK(!nn_convp_ok_(&l));
    l = layer(9, 8, 80, 1, fma); /* cin under 16 */
    CHECK(!nn_convp_ok_(&l));
    l = layer(9, 1024, 256, 1, fma); /* wider than 512 */
    CHECK(!nn_convp_ok_(&l));
    l = layer(9, 18, 80, 1, fma);
    l.kh = l.kw = 3; /* not 1x1 */
    CHECK(!nn_convp_ok_(&l));
    l = layer(9, 18, 80, 1, fma);
    l.pad_t = 1; /* padded */
    CHECK(!nn_convp_ok_(&l));
    l = layer(9, 18, 80, 1, 0); /* no AVX2 */
    CHECK(!nn_convp_ok_(&l));
    /* layers.c takes it at stride 2 on AVX-512 only */
    l = layer(9, 18, 80, 1, 2);
    CHECK(!nn_convp_grad_ok_(&l));
    l = layer(13, 18, 80, 2, 1);
    CHECK(!nn_convp_grad_ok_(&l));
    l = layer(13, 18, 80, 2, 2);
    CHECK(nn_convp_grad_ok_(&l) == nn_convp_ok_(&l));
}

static const loom_test tests[] = {
    {"conv_wide_stride1", test_stride1},
    {"conv_wide_stride2", test_stride2},
    {"conv_wide_ok", test_ok},
    {0},
};

int main(void) { return loom_test_run(tests); }
