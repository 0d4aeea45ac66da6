/* fuzz_net_frame.c - libFuzzer target for the cluster transport's frame
 * decoder (appliance/cluster/wire.c), fed the input as a byte stream the way
 * net.c's reader does: frame after frame, in pieces of the sizes the input's
 * first bytes choose, under a length bound they choose too.
 * Built and run by tests/fuzz/run.sh (meson test --suite fuzz), or by hand from the repository root:
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined -D_GNU_SOURCE -I appliance \
 *     tests/fuzz/fuzz_net_frame.c appliance/cluster/wire.c appliance/core/[a-z]*.c \
 *     -lcrypto -lz -lm -ldl -lpthread -o /tmp/fuzz_net_frame
 *   /tmp/fuzz_net_frame -max_total_time=30 /tmp/corpus_net_frame tests/fuzz/corpus/net_frame
 * Invariants: the decoder never reads past what it is given (ASan); a frame it
 * accepts lies inside the bytes, respects the bound and re-encodes to the same
 * header; asking for more bytes is never asked with all of them present; a
 * prefix of an accepted frame is never rejected, nor accepted. */
#include "cluster/net_internal.h"

#include <stdlib.h>
#include <string.h>

#define CHECK(c) do { if (!(c)) __builtin_trap(); } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 2) return 0;
    uint32_t max = data[0] < 128 ? (uint32_t)data[0] * 16 : LOOM_NET_HANDSHAKE_MAX;
    size_t piece = (size_t)data[1] + 1;
    data += 2, size -= 2;
    /* Copy into an exact-size heap block, so ASan sees any over-read. */
    uint8_t *buf = malloc(size ? size : 1);
    memcpy(buf, data, size);
    size_t off = 0, avail = 0;
    loom_err err = {0};
    while (off < size) {
        avail = avail + piece > size - off ? size - off : avail + piece;
        uint8_t *p = malloc(avail ? avail : 1);
        memcpy(p, buf + off, avail);
        loom_net_frame f;
        size_t need = 0;
        long r = loom_net_frame_decode_(p, avail, max, &f, &need, &err);
        if (r < 0) {
            CHECK(err.code == LOOM_ENET && err.msg[0]);
            free(p);
            break;
        }
        if (r == 0) {
            CHECK(need > avail || avail < LOOM_NET_HDR);
            free(p);
            if (avail == size - off) break; /* the stream ends mid-frame */
            continue;
        }
        CHECK((size_t)r <= avail && (size_t)r == LOOM_NET_HDR + f.len && f.len <= max);
        CHECK(f.payload == p + LOOM_NET_HDR);
        uint8_t hdr[LOOM_NET_HDR];
        loom_net_frame_header_(hdr, f.type, f.payload, f.len);
        CHECK(memcmp(hdr, p, LOOM_NET_HDR) == 0);
        /* Every proper prefix asks for more. */
        for (size_t k = 0; k < (size_t)r; k += 1 + (size_t)r / 7) {
            loom_net_frame g;
            CHECK(loom_net_frame_decode_(p, k ? k : 1, max, &g, NULL, &err) == 0 || k == 0);
        }
        free(p);
        off += (size_t)r;
        avail = 0;
    }
    free(buf);
    return 0;
}
