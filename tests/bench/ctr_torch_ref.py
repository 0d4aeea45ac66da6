#!/usr/bin/python3
"""ctr_torch_ref.py - the PyTorch reference of the CTR benchmark (ctr_bench.sh).

Reads the TFRecord files `loom records convert --config configs/ctr.cfg` wrote
(features ids int64 (columns,), label float32 ()), holds them in memory, and
trains the model of configs/ctr.cfg on them: one shared nn.EmbeddingBag
(rows x dim, mode "sum", sparse=True) looked up once per column, flattened,
dense layers with ReLU, the same loss, Adagrad (which applies sparse gradients
to the table's touched rows only) for all parameters, one epoch in the files'
order at the same batch size. Prints one JSON line: samples/s of the training
loop (the data already in memory as tensors: the input pipeline costs
PyTorch nothing here), the final training loss, the mean distinct rows a
batch touches. Run by Debian's /usr/bin/python3 (python3-torch).
"""
import argparse
import glob
import json
import struct
import sys
import time

import numpy as np
import torch


def varint(b, i):
    v = s = 0
    while True:
        c = b[i]
        i += 1
        v |= (c & 0x7F) << s
        s += 7
        if c < 0x80:
            return v, i


def fields(b):
    """(field number, wire type, value) of a protobuf message; value: int or bytes."""
    i, n = 0, len(b)
    while i < n:
        k, i = varint(b, i)
        f, t = k >> 3, k & 7
        if t == 0:
            v, i = varint(b, i)
        elif t == 2:
            ln, i = varint(b, i)
            v, i = b[i:i + ln], i + ln
        elif t == 5:
            v, i = b[i:i + 4], i + 4
        elif t == 1:
            v, i = b[i:i + 8], i + 8
        else:
            raise ValueError("wire type %d" % t)
        yield f, t, v


def example(b):
    """A tf.train.Example as {name: list of numbers}."""
    out = {}
    for f, _, feats in fields(b):
        if f != 1:
            continue
        for _, _, entry in fields(feats):
            key = val = None
            for ef, _, ev in fields(entry):
                if ef == 1:
                    key = ev.decode()
                elif ef == 2:
                    val = ev
            vals = []
            for kind, _, lst in fields(val):
                for vf, vt, v in fields(lst):
                    if kind == 2:  # float_list
                        vals += list(struct.unpack("<%df" % (len(v) // 4), v)) if vt == 2 else [struct.unpack("<f", v)[0]]
                    elif kind == 3:  # int64_list
                        if vt == 2:
                            j = 0
                            while j < len(v):
                                x, j = varint(v, j)
                                vals.append(x - (1 << 64) if x >= 1 << 63 else x)
                        else:
                            vals.append(v)
            out[key] = vals
    return out


def read_records(pattern):
    ids, labels = [], []
    for path in sorted(glob.glob(pattern)):
        with open(path, "rb") as f:
            data = f.read()
        i = 0
        while i < len(data):
            (ln,) = struct.unpack_from("<Q", data, i)
            ex = example(data[i + 12:i + 12 + ln])
            i += 12 + ln + 4
            ids.append(ex["ids"])
            labels.append(ex["label"][0])
    return np.array(ids, dtype=np.int64), np.array(labels, dtype=np.float32)


class CTR(torch.nn.Module):
    def __init__(self, rows, dim, cols, units, outputs):
        super().__init__()
        self.cols, self.dim = cols, dim
        self.emb = torch.nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
        torch.nn.init.uniform_(self.emb.weight, -0.05, 0.05)
        layers, fan = [], cols * dim
        for u in units:
            layers += [torch.nn.Linear(fan, u), torch.nn.ReLU()]
            fan = u
        layers.append(torch.nn.Linear(fan, outputs))
        self.mlp = torch.nn.Sequential(*layers)

    def forward(self, ids):  # ids (B, cols): one bag per (example, column)
        B = ids.shape[0]
        flat = ids.reshape(-1)
        offsets = torch.arange(0, flat.numel(), dtype=torch.int64)
        e = self.emb(flat, offsets).view(B, self.cols * self.dim)
        return self.mlp(e)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", required=True, help="TFRecord glob")
    ap.add_argument("--rows", type=int, default=1 << 20)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--units", default="256,128")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--loss", choices=["softmax", "bce"], default="softmax")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=42)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    t0 = time.time()
    ids, labels = read_records(a.files)
    read_s = time.time() - t0
    n, cols = ids.shape
    steps = n // a.batch
    X = torch.from_numpy(ids)
    Y = torch.from_numpy(labels)
    model = CTR(a.rows, a.dim, cols, [int(u) for u in a.units.split(",")], 2 if a.loss == "softmax" else 1)
    opt = torch.optim.Adagrad(model.parameters(), lr=a.lr, initial_accumulator_value=0.1, eps=1e-7)
    distinct = 0
    for s in range(steps):
        distinct += len(np.unique(ids[s * a.batch:(s + 1) * a.batch]))
    t0 = time.time()
    total = 0.0
    for s in range(steps):
        x = X[s * a.batch:(s + 1) * a.batch]
        y = Y[s * a.batch:(s + 1) * a.batch]
        z = model(x)
        if a.loss == "softmax":
            loss = torch.nn.functional.cross_entropy(z, y.long())
        else:
            loss = torch.nn.functional.binary_cross_entropy_with_logits(z.view(-1), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total += float(loss)
    train_s = time.time() - t0
    print(json.dumps({"framework": "pytorch", "torch": torch.__version__, "threads": a.threads, "examples": steps * a.batch,
                      "samples_per_sec": steps * a.batch / train_s, "train_seconds": train_s, "read_seconds": read_s,
                      "train_loss": total / max(steps, 1), "mean_distinct_rows": distinct / max(steps, 1)}))


if __name__ == "__main__":
    sys.exit(main())
