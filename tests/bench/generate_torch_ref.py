#!/usr/bin/python3
"""generate_torch_ref.py - the PyTorch side of generate_bench.sh.

The model of configs/fortunes_char_embed.cfg (nn.Embedding(V, 16) over the
last T ids, flatten, Linear(T*16, 256) + ReLU, Linear(256, V)) generating
at batch 1 with the loop `loom generate` runs: the last T tokens (left-
padded with id 0), one forward under torch.inference_mode(), the logits of
ids 2..V-1 (no padding, no OOV id) divided by the temperature, a draw
(torch.multinomial, seeded), the token's text written to stdout and
flushed. Weights are random (speed does not depend on them). Prints one
JSON line to stderr: tokens/s of the loop.
"""
import argparse
import json
import sys
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--context", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=100)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(1)
    T, V = a.context, a.vocab
    model = torch.nn.Sequential(torch.nn.Embedding(V, 16), torch.nn.Flatten(), torch.nn.Linear(T * 16, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, V)).eval()
    text = [chr(32 + (i % 90)) for i in range(V)]
    seq = [5, 6, 7, 8]
    out = sys.stdout
    with torch.inference_mode():
        for _ in range(50):  # warm-up
            model(torch.zeros(1, T, dtype=torch.long))
        t0 = time.perf_counter()
        for _ in range(a.tokens):
            ctx = seq[-T:]
            x = torch.tensor([[0] * (T - len(ctx)) + ctx], dtype=torch.long)
            z = model(x)[0, 2:]
            p = torch.softmax(z / a.temperature, dim=0)
            tok = 2 + int(torch.multinomial(p, 1))
            out.write(text[tok])
            out.flush()
            seq.append(tok)
        dt = time.perf_counter() - t0
    out.write("\n")
    print(json.dumps({"tokens": a.tokens, "seconds": dt, "tokens_per_sec": a.tokens / dt}), file=sys.stderr)


if __name__ == "__main__":
    main()
