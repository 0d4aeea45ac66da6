/* rng.c - Philox4x32-10 (Salmon et al., SC'11) and stream splitting. */
#include "core.h"

#include <math.h>

void loom_philox4x32(uint64_t key, uint64_t counter, uint32_t out[4])
{
    uint32_t c0 = (uint32_t)counter, c1 = (uint32_t)(counter >> 32), c2 = 0, c3 = 0;
    uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
    for (int r = 0; r < 10; r++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c0, p1 = (uint64_t)0xCD9E8D57u * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0, n1 = (uint32_t)p1;
        uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1, n3 = (uint32_t)p0;
        c0 = n0; c1 = n1; c2 = n2; c3 = n3;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}

/* SplitMix64's finaliser: a bijective mix, so distinct labels give distinct keys. */
static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

uint64_t loom_rng_mix(uint64_t seed, uint64_t label)
{
    return mix64(mix64(seed + 0x9E3779B97F4A7C15ull) ^ (label * 0xD6E8FEB86659FD93ull + 0x632BE59BD9B4E019ull));
}

void loom_rng_init(loom_rng *r, uint64_t seed, uint64_t a, uint64_t b, uint64_t c)
{
    r->key = loom_rng_mix(loom_rng_mix(loom_rng_mix(seed, a), b), c);
    r->counter = 0;
    r->avail = 0;
}

uint32_t loom_rng_u32(loom_rng *r)
{
    if (r->avail == 0) {
        loom_philox4x32(r->key, r->counter++, r->buf);
        r->avail = 4;
    }
    return r->buf[4 - r->avail--];
}

uint64_t loom_rng_u64(loom_rng *r)
{
    uint64_t hi = loom_rng_u32(r);
    return hi << 32 | loom_rng_u32(r);
}

float loom_rng_uniform(loom_rng *r) { return (float)(loom_rng_u32(r) >> 8) * (1.0f / 16777216.0f); }

double loom_rng_uniform64(loom_rng *r) { return (double)(loom_rng_u64(r) >> 11) * (1.0 / 9007199254740992.0); }

float loom_rng_normal(loom_rng *r)
{
    double u1 = loom_rng_uniform64(r), u2 = loom_rng_uniform64(r);
    if (u1 < 1e-300) u1 = 1e-300;
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

uint64_t loom_rng_below(loom_rng *r, uint64_t n)
{
    if (n <= 1) return 0;
    /* Lemire's nearly-divisionless method on 64 bits would need 128-bit
     * products; rejection on the top range is simple and unbiased. Its
     * limit, UINT64_MAX - UINT64_MAX % n, is above UINT64_MAX - n, so an x
     * up to that is accepted without the division that computes the limit
     * (the same draws, one division fewer per draw). */
    uint64_t x;
    for (;;) {
        x = loom_rng_u64(r);
        if (x <= UINT64_MAX - n || x < UINT64_MAX - UINT64_MAX % n) return x % n;
    }
}

void loom_rng_save(const loom_rng *r, loom_buf *b)
{
    loom_buf_put_u64(b, r->key);
    loom_buf_put_u64(b, r->counter);
    loom_buf_put_u32(b, (uint32_t)r->avail);
    for (int i = 0; i < 4; i++) loom_buf_put_u32(b, r->buf[i]);
}

int loom_rng_restore(loom_rng *r, loom_buf *b)
{
    r->key = loom_buf_get_u64(b);
    r->counter = loom_buf_get_u64(b);
    r->avail = (int)loom_buf_get_u32(b);
    for (int i = 0; i < 4; i++) r->buf[i] = loom_buf_get_u32(b);
    return b->failed || r->avail < 0 || r->avail > 4 ? -1 : 0;
}
