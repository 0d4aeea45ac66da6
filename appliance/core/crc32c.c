/* crc32c.c - CRC-32C (Castagnoli, reflected 0x82F63B78), slicing-by-8,
 * with the SSE4.2 instruction when the CPU has it. The instruction has a
 * latency of 3 cycles and a throughput of 1 a cycle, so one chain over a
 * buffer runs at a third of what the unit can do: buffers of 3 blocks or
 * more go through three chains at once (three independent blocks), joined
 * by the linearity of the CRC register: crc(s, X || Y) = crc(s, X) shifted
 * over |Y| zero bytes, xor crc(0, Y). The shift over BLOCK and 2 x BLOCK
 * zero bytes is a 32x32 bit matrix over GF(2), applied as 4 tables of 256
 * (one per byte of the register), built once from the instruction itself. */
#include "core.h"

#include <pthread.h>
#include <string.h>

static uint32_t table[8][256];
static int have_sse42;
#define BLOCK 256                  /* bytes per chain: a TFRecord of Fashion-MNIST (~830 bytes) gets one round */
static uint32_t shift1[4][256];    /* the register after BLOCK zero bytes, by register byte */
static uint32_t shift2[4][256];    /* after 2 x BLOCK */
static pthread_once_t once = PTHREAD_ONCE_INIT;

#if defined(__x86_64__)
static void init_shift_tables(void);
#endif

static void init_tables(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        table[0][i] = c;
    }
    for (int t = 1; t < 8; t++)
        for (int i = 0; i < 256; i++) table[t][i] = (table[t - 1][i] >> 8) ^ table[0][table[t - 1][i] & 0xff];
#if defined(__x86_64__)
    have_sse42 = loom_cpu_probe()->sse42;
    if (have_sse42) init_shift_tables();
#endif
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t zeros_hw(uint32_t c, size_t n)
{
    for (; n >= 8; n -= 8) c = (uint32_t)__builtin_ia32_crc32di(c, 0);
    while (n--) c = __builtin_ia32_crc32qi(c, 0);
    return c;
}

static void init_shift_tables(void)
{
    for (int b = 0; b < 4; b++)
        for (uint32_t v = 0; v < 256; v++) {
            uint32_t x = v << (8 * b);
            shift1[b][v] = zeros_hw(x, BLOCK);
            shift2[b][v] = zeros_hw(x, 2 * BLOCK);
        }
}

static inline uint32_t shift(const uint32_t t[4][256], uint32_t c)
{
    return t[0][c & 0xff] ^ t[1][(c >> 8) & 0xff] ^ t[2][(c >> 16) & 0xff] ^ t[3][c >> 24];
}

__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t c, const uint8_t *p, size_t n)
{
    for (; n >= 3 * BLOCK; n -= 3 * BLOCK, p += 3 * BLOCK) {
        uint64_t a = c, b = 0, d = 0;
        for (size_t i = 0; i < BLOCK; i += 8) {
            uint64_t wa, wb, wd;
            memcpy(&wa, p + i, 8);
            memcpy(&wb, p + BLOCK + i, 8);
            memcpy(&wd, p + 2 * BLOCK + i, 8);
            a = __builtin_ia32_crc32di(a, wa);
            b = __builtin_ia32_crc32di(b, wb);
            d = __builtin_ia32_crc32di(d, wd);
        }
        c = shift(shift2, (uint32_t)a) ^ shift(shift1, (uint32_t)b) ^ (uint32_t)d;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = (uint32_t)__builtin_ia32_crc32di(c, w);
        p += 8;
        n -= 8;
    }
    while (n--) c = __builtin_ia32_crc32qi(c, *p++);
    return c;
}
#endif

uint32_t loom_crc32c_extend(uint32_t crc, const void *data, size_t n)
{
    pthread_once(&once, init_tables);
    const uint8_t *p = data;
    uint32_t c = ~crc;
#if defined(__x86_64__)
    if (have_sse42) return ~crc_hw(c, p, n);
#endif
    while (n >= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
        lo ^= c;
        c = table[7][lo & 0xff] ^ table[6][(lo >> 8) & 0xff] ^ table[5][(lo >> 16) & 0xff] ^ table[4][lo >> 24] ^
            table[3][hi & 0xff] ^ table[2][(hi >> 8) & 0xff] ^ table[1][(hi >> 16) & 0xff] ^ table[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) c = (c >> 8) ^ table[0][(c ^ *p++) & 0xff];
    return ~c;
}
