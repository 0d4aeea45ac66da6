/* crc32c.c - CRC-32C (Castagnoli, reflected 0x82F63B78), slicing-by-8,
 * with the SSE4.2 instruction when the CPU has it. */
#include "core.h"

#include <pthread.h>
#include <string.h>

static uint32_t table[8][256];
static int have_sse42;
static pthread_once_t once = PTHREAD_ONCE_INIT;

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
    __builtin_cpu_init();
    have_sse42 = __builtin_cpu_supports("sse4.2");
#endif
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t c, const uint8_t *p, size_t n)
{
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
