#!/usr/bin/python3
"""generate_torch_ref.py - the PyTorch side of generate_bench.sh.

--model mlp: configs/fortunes_char_embed.cfg's model (nn.Embedding(V, 16)
over the last T ids, flatten, Linear(T*16, 256) + ReLU, Linear(256, V)),
each token a forward over the last T tokens (left-padded with id 0), as
Loom's generic path. --model lstm: configs/fortunes_char_lstm.cfg's
(nn.Embedding(V, 64), nn.LSTM(64, 256), Linear(256, V)), each token one
step of the LSTM from the carried (h, c), as Loom's incremental path.
--model transformer: configs/fortunes_char_transformer.cfg's (embedding 64 +
learned positions, 2 causal pre-norm blocks of 4 heads x 16 and a ReLU
feed-forward of 256, a final layer norm, Linear(64, V)) with a KV cache:
each token one position through the blocks, attending to the cached keys
and values; --samples continuations of T - prompt tokens (the window), as
Loom's incremental path. The
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


class Block(torch.nn.Module):
    """A pre-norm causal block stepping one position with a KV cache."""

    def __init__(self, d, heads, ff):
        super().__init__()
        self.h, self.dk = heads, d // heads
        self.n1, self.n2 = torch.nn.LayerNorm(d, eps=1e-5), torch.nn.LayerNorm(d, eps=1e-5)
        self.qkv, self.o = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.ff1, self.ff2 = torch.nn.Linear(d, ff), torch.nn.Linear(ff, d)

    def step(self, x, cache):  # x (d,); cache: lists of keys and values (heads, dk) so far
        q, k, v = self.qkv(self.n1(x)).view(3, self.h, self.dk)
        cache[0].append(k)
        cache[1].append(v)
        K, V = torch.stack(cache[0], 1), torch.stack(cache[1], 1)  # (heads, t, dk)
        w = torch.softmax((K @ q.unsqueeze(-1)).squeeze(-1) / self.dk ** 0.5, dim=-1)  # (heads, t)
        x = x + self.o((w.unsqueeze(1) @ V).reshape(-1))
        return x + self.ff2(torch.relu(self.ff1(self.n2(x))))


def transformer_tokens(a, text, out):
    """--samples continuations of the window's length with a KV cache; returns the tokens drawn."""
    T, V = a.context, a.vocab
    emb, pos = torch.nn.Embedding(V, 64), torch.nn.Embedding(T, 64)
    blocks = [Block(64, 4, 256) for _ in range(2)]
    norm, head = torch.nn.LayerNorm(64, eps=1e-5), torch.nn.Linear(64, V)
    prompt, made = [5, 6, 7, 8], 0
    for _ in range(a.samples):
        caches = [([], []) for _ in blocks]
        seq = list(prompt)
        for t in range(T):
            x = emb.weight[seq[t]] + pos.weight[t]
            for b, c in zip(blocks, caches):
                x = b.step(x, c)
            if t + 1 < len(seq):
                continue  # the prompt
            z = head(norm(x))[2:]
            tok = 2 + int(torch.multinomial(torch.softmax(z / a.temperature, dim=0), 1))
            out.write(text[tok])
            out.flush()
            seq.append(tok)
            made += 1
        out.write("\n")
    return made


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--context", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=100)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", choices=["mlp", "lstm", "transformer"], default="mlp")
    ap.add_argument("--samples", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(1)
    T, V = a.context, a.vocab
    text = [chr(32 + (i % 90)) for i in range(V)]
    seq = [5, 6, 7, 8]
    out = sys.stdout
    if a.model == "transformer":
        with torch.inference_mode():
            t0 = time.perf_counter()
            made = transformer_tokens(a, text, out)
            dt = time.perf_counter() - t0
        print(json.dumps({"tokens": made, "seconds": dt, "tokens_per_sec": made / dt}), file=sys.stderr)
        return
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
