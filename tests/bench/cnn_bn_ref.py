#!/usr/bin/python3
"""cnn_bn_ref.py - PyTorch's side of tests/bench/cnn_bn_bench.sh: the CNN with
batch normalization of configs/fashion_mnist_cnn_bn.cfg, with its
hyper-parameters (Adam lr 0.003, eps 1e-7, cosine decay to 0 over 5 epochs of
469 steps, batch 128, Keras' BatchNormalization momentum 0.99 = PyTorch's
momentum 0.01, eps 1e-3, glorot_uniform kernels), on Fashion-MNIST. Prints one
JSON line: test accuracy, training samples/s. Run with Debian's
/usr/bin/python3 (python3-torch); torch_ref.py's header gives this machine's
best thread settings, which cnn_bn_bench.sh uses."""
import argparse, gzip, json, math, os, time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def read_idx(path):
    raw = gzip.open(path).read() if path.endswith(".gz") else open(path, "rb").read()
    rank = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(rank)]
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * rank).reshape(dims)


class CNNBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(1, 32, 5, padding=2, bias=False)
        self.b1 = nn.BatchNorm2d(32, eps=1e-3, momentum=0.01)
        self.c2 = nn.Conv2d(32, 64, 5, padding=2, bias=False)
        self.b2 = nn.BatchNorm2d(64, eps=1e-3, momentum=0.01)
        self.f1 = nn.Linear(64 * 7 * 7, 128, bias=False)
        self.b3 = nn.BatchNorm1d(128, eps=1e-3, momentum=0.01)
        self.drop = nn.Dropout(0.4)
        self.f2 = nn.Linear(128, 10)

    def forward(self, x):
        x = x.reshape(-1, 1, 28, 28).contiguous(memory_format=torch.channels_last)
        x = F.max_pool2d(F.relu(self.b1(self.c1(x))), 2)
        x = F.max_pool2d(F.relu(self.b2(self.c2(x))), 2)
        x = self.drop(F.relu(self.b3(self.f1(x.flatten(1)))))
        return self.f2(x)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--data-dir", default=os.environ.get("LOOM_DATASETS_DIR", "/usr/share/datasets") + "/fashion-mnist")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(1)
    d = a.data_dir
    x = torch.from_numpy(read_idx(d + "/train-images-idx3-ubyte.gz").astype(np.float32) / 255.0)
    y = torch.from_numpy(read_idx(d + "/train-labels-idx1-ubyte.gz").astype(np.int64))
    xt = torch.from_numpy(read_idx(d + "/t10k-images-idx3-ubyte.gz").astype(np.float32) / 255.0)
    yt = torch.from_numpy(read_idx(d + "/t10k-labels-idx1-ubyte.gz").astype(np.int64))
    m = CNNBN().to(memory_format=torch.channels_last)
    for p in m.modules():
        if isinstance(p, (nn.Linear, nn.Conv2d)):
            nn.init.xavier_uniform_(p.weight)
            if p.bias is not None:
                nn.init.zeros_(p.bias)
    opt = torch.optim.Adam(m.parameters(), lr=0.003, eps=1e-7)
    total = 469 * 5
    step, t_train = 0, 0.0
    for _ in range(a.epochs):
        m.train()
        t0 = time.monotonic()
        perm = torch.randperm(x.shape[0])
        for i in range(0, x.shape[0], 128):
            idx = perm[i:i + 128]
            loss = F.cross_entropy(m(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.param_groups[0]["lr"] = 0.003 * 0.5 * (1 + math.cos(math.pi * min(step, total) / total))
            opt.step()
            step += 1
        t_train += time.monotonic() - t0
    m.eval()
    with torch.no_grad():
        correct = sum((m(xt[i:i + 1000]).argmax(1) == yt[i:i + 1000]).sum().item() for i in range(0, 10000, 1000))
    print(json.dumps({"impl": "pytorch", "torch": torch.__version__, "epochs": a.epochs, "steps": step,
                      "eval_accuracy": correct / 10000, "samples_per_sec": round(step * 128 / t_train, 1)}))


if __name__ == "__main__":
    main()
