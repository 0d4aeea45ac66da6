#!/usr/bin/python3
"""transformer_torch_ref.py - the PyTorch reference of transformer_bench.sh.

The data as lm_torch_ref.py makes it (the same text files, Loom's adapted
vocabulary, windows of T + 1 characters at a shift of T, pairs shifted by
one). The model is transformer_bench.sh's Loom model: embedding (uniform
+-0.05) + a learned position table (Glorot uniform) -> BLOCKS pre-norm blocks
(layer norm eps 1e-5 -> causal nn.MultiheadAttention with D = heads x key_dim,
Glorot-uniform q, k, v and output kernels as Loom's per-projection (D, D)
kernels, zero biases -> residual add -> layer norm -> linear FF relu -> linear
-> residual add) -> layer norm -> linear V, no dropout; the mean token
cross-entropy, Adam (Keras epsilon 1e-7) with gradients clipped to a global
norm, the same batch size and number of steps. Evaluates the mean token loss
over the eval windows in order. Prints one JSON line.
Run by Debian's /usr/bin/python3 (python3-torch).
"""
import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lm_torch_ref import vocab, windows  # noqa: E402


def glorot_(w, fan_in, fan_out):
    a = math.sqrt(6.0 / (fan_in + fan_out))
    with torch.no_grad():
        w.uniform_(-a, a)


class Block(torch.nn.Module):
    def __init__(self, D, H, F):
        super().__init__()
        self.n1 = torch.nn.LayerNorm(D, eps=1e-5)
        self.attn = torch.nn.MultiheadAttention(D, H, batch_first=True)
        self.n2 = torch.nn.LayerNorm(D, eps=1e-5)
        self.ff1 = torch.nn.Linear(D, F)
        self.ff2 = torch.nn.Linear(F, D)
        with torch.no_grad():
            for k in range(3):
                glorot_(self.attn.in_proj_weight[k * D:(k + 1) * D], D, D)
            self.attn.in_proj_bias.zero_()
            glorot_(self.attn.out_proj.weight, D, D)
            self.attn.out_proj.bias.zero_()
            for lin in (self.ff1, self.ff2):
                torch.nn.init.xavier_uniform_(lin.weight)
                lin.bias.zero_()

    def forward(self, x, mask):
        h = self.n1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.ff2(torch.relu(self.ff1(self.n2(x))))


class LM(torch.nn.Module):
    def __init__(self, V, D, H, F, T, blocks):
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.pos = torch.nn.Parameter(torch.empty(T, D))
        self.blocks = torch.nn.ModuleList(Block(D, H, F) for _ in range(blocks))
        self.norm = torch.nn.LayerNorm(D, eps=1e-5)
        self.out = torch.nn.Linear(D, V)
        with torch.no_grad():
            torch.nn.init.uniform_(self.emb.weight, -0.05, 0.05)
            glorot_(self.pos, T, D)
            torch.nn.init.xavier_uniform_(self.out.weight)
            self.out.bias.zero_()
        self.register_buffer("mask", torch.triu(torch.full((T, T), float("-inf")), 1))

    def forward(self, x):
        h = self.emb(x) + self.pos[: x.shape[1]]
        for b in self.blocks:
            h = b(h, self.mask)
        return self.out(self.norm(h))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--eval", required=True)
    p.add_argument("--vocab", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--eval-batch", type=int, default=256)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ff", type=int, default=256)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=100)
    p.add_argument("--lr", type=float, default=0.001)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    ids = vocab(a.vocab)
    xt, yt = windows(a.train, ids, a.seq)
    xe, ye = windows(a.eval, ids, a.seq)
    model = LM(a.vocab_size, a.dim, a.heads, a.ff, a.seq, a.blocks)
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=a.lr, eps=1e-7)
    lossf = torch.nn.CrossEntropyLoss()
    perm = torch.randperm(xt.shape[0])
    pos, t0, first = 0, None, 0.0
    for step in range(a.steps):
        if pos + a.batch > perm.numel():
            perm, pos = torch.randperm(xt.shape[0]), 0
        idx = perm[pos : pos + a.batch]
        pos += a.batch
        s = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = lossf(model(xt[idx]).reshape(-1, a.vocab_size), yt[idx].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, a.clip)
        opt.step()
        if step == 0:
            first = time.perf_counter() - s
            t0 = time.perf_counter()
    sec = time.perf_counter() - t0
    tot, n = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, xe.shape[0], a.eval_batch):
            z = model(xe[i : i + a.eval_batch])
            tot += torch.nn.functional.cross_entropy(z.reshape(-1, a.vocab_size), ye[i : i + a.eval_batch].reshape(-1),
                                                     reduction="sum").item()
            n += ye[i : i + a.eval_batch].numel()
    sps = (a.steps - 1) * a.batch / sec
    print(json.dumps({"samples_per_sec": sps, "tokens_per_sec": sps * a.seq, "eval_loss": tot / n,
                      "final_train_loss": loss.item(), "steps": a.steps, "first_step_ms": first * 1e3,
                      "train_windows": int(xt.shape[0]), "eval_windows": int(xe.shape[0])}))


if __name__ == "__main__":
    main()
