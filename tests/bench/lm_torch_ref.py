#!/usr/bin/python3
"""lm_torch_ref.py - the PyTorch reference of the language-model benchmark (lm_bench.sh).

Reads the same text files Loom trained on (one element per line), maps each
character to Loom's id through the vocabulary Loom adapted (model_dir/adapt.txt:
ids 2.. in file order, 1 out of vocabulary, 0 padding), concatenates every
line's ids in file order (Loom's unbatch), cuts windows of T + 1 ids at a
shift of T (Loom's window, drop_remainder) and makes (input, target) pairs
shifted by one (lm_pairs). The model is Loom's: embedding (uniform +-0.05)
-> nn.LSTM (Keras' defaults as Loom's: a Glorot-uniform input kernel, an
orthogonal recurrent kernel, the forget-gate bias at 1, the others 0, bias_hh
frozen at 0 since Loom's lstm has one bias) -> linear (Glorot, zero bias), the loss the
mean token cross-entropy, Adam (Keras epsilon 1e-7) with gradients clipped to
a global norm, batches of the shuffled training windows (a shuffle of its own:
the same data, not the same order), the same number of steps. Evaluates the
mean token loss over the eval windows in order. Prints one JSON line.
Run by Debian's /usr/bin/python3 (python3-torch).
"""
import argparse
import json
import math
import time
import urllib.parse

import torch


def vocab(path):
    ids = {}
    with open(path, encoding="utf-8") as f:
        lines = [l.rstrip("\n") for l in f if l.startswith("=")]
    for i, l in enumerate(lines):
        tok = urllib.parse.unquote(l[1:].rsplit(" ", 1)[0])
        ids[tok] = i + 2
    return ids


def windows(path, ids, T):
    stream = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            stream.extend(ids.get(c, 1) for c in line.rstrip("\n"))
    n = (len(stream) - 1) // T
    t = torch.tensor(stream[: n * T + 1], dtype=torch.long)
    w = t[: n * T].view(n, T), t[1 : n * T + 1].view(n, T)
    return w


class LM(torch.nn.Module):
    def __init__(self, V, E, H, cell):
        super().__init__()
        self.emb = torch.nn.Embedding(V, E)
        self.rnn = (torch.nn.LSTM if cell == "lstm" else torch.nn.GRU)(E, H, batch_first=True)
        self.out = torch.nn.Linear(H, V)
        g = 4 if cell == "lstm" else 3
        with torch.no_grad():
            torch.nn.init.uniform_(self.emb.weight, -0.05, 0.05)
            # Loom's (and Keras') defaults: the input kernel Glorot on Loom's (in, gates H)
            # layout (limit sqrt(6 / (in + gates H))), the recurrent kernel orthogonal (torch's
            # (gates H, H) weight_hh is Loom's (H, gates H) transposed: orthonormal columns
            # there are orthonormal rows here), the lstm's forget-gate bias at 1 (i f g o)
            a = math.sqrt(6.0 / (E + g * H))
            self.rnn.weight_ih_l0.uniform_(-a, a)
            torch.nn.init.orthogonal_(self.rnn.weight_hh_l0)
            self.rnn.bias_ih_l0.zero_()
            self.rnn.bias_hh_l0.zero_()
            if cell == "lstm":
                self.rnn.bias_ih_l0[H:2 * H] = 1.0
            if cell == "lstm":
                self.rnn.bias_hh_l0.requires_grad_(False)
            torch.nn.init.xavier_uniform_(self.out.weight)
            self.out.bias.zero_()

    def forward(self, x):
        y, _ = self.rnn(self.emb(x))
        return self.out(y)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--eval", required=True)
    p.add_argument("--vocab", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--eval-batch", type=int, default=256)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--embed", type=int, default=64)
    p.add_argument("--units", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=100)
    p.add_argument("--lr", type=float, default=0.002)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--cell", default="lstm")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    ids = vocab(a.vocab)
    xt, yt = windows(a.train, ids, a.seq)
    xe, ye = windows(a.eval, ids, a.seq)
    model = LM(a.vocab_size, a.embed, a.units, a.cell)
    params = [q for q in model.parameters() if q.requires_grad]
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
