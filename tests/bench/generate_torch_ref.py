#!/usr/bin/python3
"""generate_torch_ref.py - the PyTorch side of generate_bench.sh.

--model mlp: configs/fortunes_char_embed.cfg's model (nn.Embedding(V, 16)
over the last T ids, flatten, Linear(T*16, 256) + ReLU, Linear(256, V)),
each token a forward over the last T tokens (left-padded with id 0), as
Loom's generic path. --model lstm: configs/fortunes_char_lstm.cfg's
(nn.Embedding(V, 64), nn.LSTM(64, 256), Linear(256, V)), each token one
step of the LSTM from the carried (h, c), as Loom's incremental path. The
loop of `loom generate` at batch 1, under torch.inference_mode(): the
logits of ids 2..V-1 (no padding, no OOV id) divided by the temperature, a
draw (torch.multinomial, seeded), the token's text written to stdout and
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
    ap.add_argument("--model", choices=["mlp", "lstm"], default="mlp")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(1)
    T, V = a.context, a.vocab
    text = [chr(32 + (i % 90)) for i in range(V)]
    seq = [5, 6, 7, 8]
    out = sys.stdout
    if a.model == "mlp":
        model = torch.nn.Sequential(torch.nn.Embedding(V, 16), torch.nn.Flatten(), torch.nn.Linear(T * 16, 256),
                                    torch.nn.ReLU(), torch.nn.Linear(256, V)).eval()
    else:
        emb, lstm, head = torch.nn.Embedding(V, 64), torch.nn.LSTM(64, 256, batch_first=True), torch.nn.Linear(256, V)
    with torch.inference_mode():
        if a.model == "mlp":
            for _ in range(50):  # warm-up
                model(torch.zeros(1, T, dtype=torch.long))
        else:
            _, state = lstm(emb(torch.tensor([seq[:-1]], dtype=torch.long)))  # the prompt but its last token
        t0 = time.perf_counter()
        for _ in range(a.tokens):
            if a.model == "mlp":
                ctx = seq[-T:]
                z = model(torch.tensor([[0] * (T - len(ctx)) + ctx], dtype=torch.long))[0, 2:]
            else:
                y, state = lstm(emb(torch.tensor([[seq[-1]]], dtype=torch.long)), state)
                z = head(y[0, -1])[2:]
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
