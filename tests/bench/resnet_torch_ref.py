#!/usr/bin/python3
"""resnet_torch_ref.py - PyTorch's side of tests/bench/resnet_bench.sh: the
residual models of issue 23, layer for layer as Loom's configs declare them.
Run it with Debian's /usr/bin/python3 (python3-torch; torchvision is not
needed: the models are written here).

  --model resnet20   configs/fashion_mnist_resnet.cfg (ResNet-20 v1 for 28x28):
                     a 3x3 conv (16) - BN - relu stem; three stages of three
                     basic blocks (16, 32, 64 filters; conv3x3-BN-relu-
                     conv3x3-BN, added to the shortcut, relu), the first block
                     of stages 2 and 3 with stride 2 and a 1x1 conv + BN
                     shortcut; global average pooling, dense 10 (logits).
                     As the config: convs without bias, he_normal kernels
                     (Keras': a normal truncated at 2 sd, sd = sqrt(2 / fan_in)
                     / 0.8796), the dense layer glorot_uniform with a zero
                     bias; BN momentum 0.99 (Keras) = 0.01 (PyTorch), eps
                     1e-3; "same" padding as TensorFlow pads it (a stride-2
                     3x3 on an even size pads 0 before, 1 after: PyTorch's
                     padding=1 would shift every window by one pixel);
                     model.l2 = 1e-4 on conv and dense kernels (the loss's
                     l2 * sum(w^2), i.e. weight decay 2e-4 on those only);
                     momentum 0.9 (not Nesterov), lr 0.1 with cosine decay to 0
                     over 7035 steps (15 epochs of 469), per step; batch 128,
                     the last partial batch kept; a fresh shuffle each epoch; no
                     augmentation (--augment: pad 2 + random 28x28 crop +
                     random left-right flip, Loom's "pad", "random_crop" and
                     "random_flip_left_right" maps, for a config that adds
                     them). Trained on the Fashion-MNIST IDX files; one JSON
                     line per epoch (samples/s, train loss, test accuracy),
                     then a final line with the run's figures.
  --model resnet50   configs/resnet50.cfg (Keras' ResNet50 v1: the stride on
                     each stage's first 1x1 conv, biases on every conv, BN eps
                     1.001e-5, dense 1000 softmax), training steps at batch 32
                     on random 224x224x3 images (channels-last by default,
                     oneDNN), momentum 0.9 lr 0.01; timed after warm-up at
                     each of --threads (default 1,2: the best is reported),
                     samples/s, the fraction of --peak-gflops (3 x the forward's
                     FLOPs per image, multiply-add = 2) and the peak RSS.
"""
import argparse
import gzip
import json
import math
import os
import resource
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

DATA_DIR = "/usr/share/datasets/fashion-mnist"


def read_idx(path):
    """IDX file (gzip) -> numpy array. Magic: 0 0 dtype rank, then big-endian dims."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    if raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file")
    rank = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(rank)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * rank).reshape(dims)


def load(data_dir):
    return [read_idx(os.path.join(data_dir, f)) for f in (
        "train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
        "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")]


def he_normal_(w):
    # Keras HeNormal: truncated normal (|z| <= 2), stddev sqrt(2 / fan_in) / 0.87962566103423978
    fan_in = w[0].numel()
    sd = math.sqrt(2.0 / fan_in) / 0.87962566103423978
    nn.init.trunc_normal_(w, mean=0.0, std=sd, a=-2 * sd, b=2 * sd)


class SameConv(nn.Conv2d):
    """Conv2d with TensorFlow's "same" padding (the extra pixel after, not
    before, when the total is odd)."""

    def __init__(self, cin, cout, k, stride=1, bias=False):
        # stride 1, odd k: symmetric, PyTorch's own padding (no copy)
        super().__init__(cin, cout, k, stride=stride, padding=k // 2 if stride == 1 else 0, bias=bias)

    def forward(self, x):
        k, s = self.kernel_size[0], self.stride[0]
        if s == 1:
            return super().forward(x)
        h, w = x.shape[-2:]
        ph = max((math.ceil(h / s) - 1) * s + k - h, 0)
        pw = max((math.ceil(w / s) - 1) * s + k - w, 0)
        if ph or pw:
            x = F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2))
        return super().forward(x)


def bn(c, eps=1e-3):
    return nn.BatchNorm2d(c, eps=eps, momentum=0.01)  # Keras momentum 0.99


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1, self.bn1 = SameConv(cin, cout, 3, stride), bn(cout)
        self.conv2, self.bn2 = SameConv(cout, cout, 3), bn(cout)
        self.short = None
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(SameConv(cin, cout, 1, stride), bn(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (self.short(x) if self.short is not None else x))


class ResNet20(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.stem_bn = SameConv(1, 16, 3), bn(16)
        blocks, cin = [], 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            for b in range(3):
                blocks.append(BasicBlock(cin, cout, stride if b == 0 else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(64, 10)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                he_normal_(m.weight)
        nn.init.xavier_uniform_(self.fc.weight)
        nn.init.zeros_(self.fc.bias)

    def forward(self, x):
        x = F.relu(self.stem_bn(self.stem(x)))
        x = self.blocks(x)
        return self.fc(x.mean((2, 3)))


class Bottleneck(nn.Module):
    """keras.applications.resnet block1: the stride on the first 1x1 conv."""

    def __init__(self, cin, f, stride, shortcut):
        super().__init__()
        self.short = nn.Sequential(nn.Conv2d(cin, 4 * f, 1, stride), bn(4 * f, 1.001e-5)) if shortcut else None
        self.c1, self.b1 = nn.Conv2d(cin, f, 1, stride), bn(f, 1.001e-5)
        self.c2, self.b2 = nn.Conv2d(f, f, 3, padding=1), bn(f, 1.001e-5)
        self.c3, self.b3 = nn.Conv2d(f, 4 * f, 1), bn(4 * f, 1.001e-5)

    def forward(self, x):
        s = self.short(x) if self.short is not None else x
        y = F.relu(self.b1(self.c1(x)))
        y = F.relu(self.b2(self.c2(y)))
        y = self.b3(self.c3(y))
        return F.relu(s + y)


class ResNet50(nn.Module):
    def __init__(self, classes=1000):
        super().__init__()
        # ZeroPadding2D(3) + 7x7/2 valid = padding 3; ZeroPadding2D(1) + max pool
        # 3x3/2 valid = MaxPool2d(padding=1) (its -inf border loses to the relu's >= 0)
        self.conv1, self.bn1 = nn.Conv2d(3, 64, 7, 2, padding=3), bn(64, 1.001e-5)
        blocks, cin = [], 64
        for f, n, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for b in range(n):
                blocks.append(Bottleneck(cin, f, stride if b == 0 else 1, b == 0))
                cin = 4 * f
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(2048, classes)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):  # Keras' default: glorot_uniform, zero bias
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, padding=1)
        x = self.blocks(x)
        return self.fc(x.mean((2, 3)))  # softmax: inside cross_entropy


def param_counts(model):
    trainable = sum(p.numel() for p in model.parameters())
    stats = sum(b.numel() for n, b in model.named_buffers() if n.endswith(("running_mean", "running_var")))
    return {"total": trainable + stats, "trainable": trainable, "non_trainable": stats}


def conv_flops(model, shape):
    """Forward FLOPs per sample of the convs and dense layers (multiply-add = 2)."""
    total = [0]

    def hook(m, inp, out):
        if isinstance(m, nn.Conv2d):
            total[0] += 2 * out[0].numel() * m.weight[0].numel()
        elif isinstance(m, nn.Linear):
            total[0] += 2 * m.in_features * m.out_features
    hs = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    was = model.training
    model.eval()
    with torch.no_grad():
        model(torch.zeros(1, *shape))
    model.train(was)
    for h in hs:
        h.remove()
    return total[0]


def rss_mb():
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)


def evaluate(model, xt, yt, cl, batch=500):
    model.eval()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for i in range(0, xt.shape[0], batch):
            xb = xt[i:i + batch]
            if cl:
                xb = xb.contiguous(memory_format=torch.channels_last)
            out = model(xb)
            loss += F.cross_entropy(out, yt[i:i + batch], reduction="sum").item()
            correct += (out.argmax(1) == yt[i:i + batch]).sum().item()
    model.train()
    return correct / xt.shape[0], loss / xt.shape[0]


def augment(xb, gen):
    """pad 2 (zeros) -> random 28x28 crop -> random left-right flip, per image."""
    n = xb.shape[0]
    p = F.pad(xb, (2, 2, 2, 2))
    oy = torch.randint(0, 5, (n,), generator=gen)
    ox = torch.randint(0, 5, (n,), generator=gen)
    rows = (oy[:, None] + torch.arange(28))[:, None, :, None].expand(n, 1, 28, 32)
    out = p.gather(2, rows)
    cols = (ox[:, None] + torch.arange(28))[:, None, None, :].expand(n, 1, 28, 28)
    out = out.gather(3, cols)
    flip = torch.rand(n, generator=gen) < 0.5
    out[flip] = out[flip].flip(3)
    return out


def run_resnet20(args):
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    t = time.monotonic()
    x, y, xt, yt = load(args.data_dir)
    x = torch.from_numpy(x.astype(np.float32)).reshape(-1, 1, 28, 28).mul_(1.0 / 255.0)
    y = torch.from_numpy(y.astype(np.int64))
    xt = torch.from_numpy(xt.astype(np.float32)).reshape(-1, 1, 28, 28).mul_(1.0 / 255.0)
    yt = torch.from_numpy(yt.astype(np.int64))
    decode_s = time.monotonic() - t

    model = ResNet20()
    cl = args.channels_last
    if cl:
        model = model.to(memory_format=torch.channels_last)
    # model.l2 = 1e-4: loss + l2 * sum(w^2) over conv and dense kernels -> gradient 2 * l2 * w
    kernels = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
    others = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    opt = torch.optim.SGD([{"params": kernels, "weight_decay": 2 * args.l2}, {"params": others, "weight_decay": 0.0}],
                          lr=args.lr, momentum=0.9, nesterov=args.nesterov)
    n, B = x.shape[0], args.batch
    steps_per_epoch = -(-n // B)
    decay = args.decay_steps or 15 * steps_per_epoch
    steps = samples = 0
    train_s = 0.0
    epoch_log = []
    for epoch in range(args.epochs):
        t0 = time.monotonic()
        perm = torch.randperm(n, generator=gen)
        ep_loss, ep_steps, ep_samples = torch.zeros(()), 0, 0
        for i in range(0, n, B):
            idx = perm[i:i + B]
            xb, yb = x[idx], y[idx]
            if args.augment:
                xb = augment(xb, gen)
            if cl:
                xb = xb.contiguous(memory_format=torch.channels_last)
            for g in opt.param_groups:
                g["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * min(steps, decay) / decay))
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            ep_loss += loss.detach()
            ep_steps += 1
            ep_samples += xb.shape[0]
            steps += 1
            if args.max_steps and steps >= args.max_steps:
                break
        epoch_s = time.monotonic() - t0
        train_s += epoch_s
        samples += ep_samples
        acc, eval_loss = (None, None) if args.no_eval else evaluate(model, xt, yt, cl)
        rec = {"epoch": epoch + 1, "step": steps, "train_loss": round(ep_loss.item() / max(ep_steps, 1), 5),
               "samples_per_sec": round(ep_samples / epoch_s, 1), "epoch_s": round(epoch_s, 3),
               "eval_accuracy": acc, "eval_loss": eval_loss and round(eval_loss, 5),
               "learning_rate": opt.param_groups[0]["lr"]}
        epoch_log.append(rec)
        print(json.dumps(rec), flush=True)
        if args.max_steps and steps >= args.max_steps:
            break
    res = {"impl": "pytorch", "torch": torch.__version__, "model": "resnet20", "epochs": len(epoch_log),
           "steps": steps, "batch": B, "samples": samples, "train_s": round(train_s, 3),
           "samples_per_sec": round(samples / train_s, 1),
           "eval_accuracy": epoch_log[-1]["eval_accuracy"] if epoch_log else None,
           "decode_ms": round(decode_s * 1e3, 1), "peak_rss_mb": rss_mb(),
           "torch_threads": torch.get_num_threads(), "channels_last": cl, "augment": args.augment,
           "params": param_counts(model), "fwd_flops_per_sample": conv_flops(model, (1, 28, 28))}
    print(json.dumps(res), flush=True)


def run_resnet50(args):
    torch.manual_seed(args.seed)
    model = ResNet50()
    cl = args.channels_last
    counts = param_counts(model)
    fwd = conv_flops(model, (3, 224, 224))
    if cl:
        model = model.to(memory_format=torch.channels_last)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    B = args.batch
    g = torch.Generator().manual_seed(args.seed)
    xb = torch.randn(B, 3, 224, 224, generator=g)
    if cl:
        xb = xb.contiguous(memory_format=torch.channels_last)
    yb = torch.randint(0, 1000, (B,), generator=g)

    def step():
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    per_threads = []
    for th in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(th)
        for _ in range(args.warmup):
            step()
        times = []
        for _ in range(args.steps):
            t0 = time.monotonic()
            step()
            times.append(time.monotonic() - t0)
        med = statistics.median(times)
        r = {"threads": th, "step_ms_median": round(med * 1e3, 1), "step_ms_min": round(min(times) * 1e3, 1),
             "samples_per_sec": round(B / med, 2), "steps_per_sec": round(1 / med, 4)}
        if args.peak_gflops:
            r["peak_fraction"] = round(3 * fwd * B / med / (args.peak_gflops * 1e9), 4)
        per_threads.append(r)
        print(json.dumps(r), file=sys.stderr, flush=True)
    best = max(per_threads, key=lambda r: r["samples_per_sec"])
    res = {"impl": "pytorch", "torch": torch.__version__, "model": "resnet50", "batch": B,
           "channels_last": cl, "mkldnn": bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled),
           "warmup_steps": args.warmup, "timed_steps": args.steps,
           "samples_per_sec": best["samples_per_sec"], "steps_per_sec": best["steps_per_sec"],
           "best_threads": best["threads"], "peak_fraction": best.get("peak_fraction"),
           "peak_gflops": args.peak_gflops or None, "train_flops_per_sample": 3 * fwd,
           "fwd_flops_per_sample": fwd, "peak_rss_mb": rss_mb(), "params": counts, "per_threads": per_threads}
    print(json.dumps(res), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["resnet20", "resnet50"], default="resnet20")
    ap.add_argument("--epochs", type=int, default=15, help="resnet20: epochs (the config's 15)")
    ap.add_argument("--max-steps", type=int, default=0, help="resnet20: stop after N steps (speed runs)")
    ap.add_argument("--no-eval", action="store_true", help="resnet20: skip the per-epoch test evaluation")
    ap.add_argument("--augment", action="store_true", help="resnet20: pad 2 + random crop 28 + random flip")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--l2", type=float, default=1e-4, help="model.l2 (weight decay 2 x l2 on kernels)")
    ap.add_argument("--nesterov", action="store_true")
    ap.add_argument("--decay-steps", type=int, default=0, help="cosine decay steps (0: 15 epochs' worth)")
    ap.add_argument("--batch", type=int, default=0, help="default: 128 (resnet20), 32 (resnet50)")
    ap.add_argument("--threads", default="", help="torch threads; resnet50: a list to try (default 1,2), "
                    "resnet20: one count (default 2)")
    ap.add_argument("--warmup", type=int, default=2, help="resnet50: untimed steps per thread count")
    ap.add_argument("--steps", type=int, default=5, help="resnet50: timed steps per thread count")
    ap.add_argument("--peak-gflops", type=float, default=0.0,
                    help="resnet50: the machine's FMA peak (gemm_peak's 1024^3 median at the same threads)")
    ap.add_argument("--no-channels-last", dest="channels_last", action="store_false")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--data-dir", default=DATA_DIR)
    args = ap.parse_args()
    if args.model == "resnet20":
        args.batch = args.batch or 128
        torch.set_num_threads(int(args.threads or 2))
        run_resnet20(args)
    else:
        args.batch = args.batch or 32
        args.threads = args.threads or "1,2"
        run_resnet50(args)


if __name__ == "__main__":
    main()
