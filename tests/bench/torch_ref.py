#!/usr/bin/python3
"""torch_ref.py - the PyTorch reference for Loom's Fashion-MNIST benchmarks.

Trains the same MLP or CNN as configs/fashion_mnist_{mlp,cnn}.cfg, with the
same hyper-parameters, and prints one JSON line with training samples/s, test
accuracy, peak RSS and the time to the first step. Run it with Debian's
/usr/bin/python3 (python3-torch 1.13.1); train_bench.sh does.

PyTorch's best settings on this machine (2 vCPUs, Xeon family 6 model 85 =
Cascade Lake, AVX-512, KVM), found with tests/bench/torch_sweep.sh and
in-process step timing; figures in README.md:
  * nn.Linear runs on OpenBLAS 0.3.21 through the libblas.so.3 alternative
    (openblas-pthread). It recognises model 85 and picks the SkylakeX kernel
    by itself (OPENBLAS_VERBOSE=2 prints "Core: SkylakeX"), so as installed it
    already runs the right kernel: OPENBLAS_CORETYPE=SkylakeX changes nothing,
    Haswell is slower. (On the model-207 Xeon the issue was written on, 0.3.21
    falls back to a generic kernel: that is the ~12,000 vs ~92,000 there, and
    there OPENBLAS_CORETYPE=SkylakeX is required.)
  * OpenBLAS's thread count comes from OPENBLAS_NUM_THREADS in the environment
    before the process starts (default: all cores); torch.set_num_threads only
    sets torch's own OpenMP threads (elementwise ops, oneDNN). Debian's torch
    defaults to 1 thread here.
  * torch.backends.mkldnn.is_available() is True: conv2d runs on oneDNN 2.6;
    with it disabled the CNN is ~3x slower.
  * Best: MLP  OPENBLAS_NUM_THREADS=2, torch threads 1 (= as installed here).
              torch threads 2 is 2-8x slower: OpenMP and OpenBLAS threads
              spin against each other on 2 cores.
         CNN  torch threads 2, --channels-last (NHWC, ~5-10% over NCHW),
              OPENBLAS_NUM_THREADS=2 (only the dense layers use it).
    train_bench.sh runs exactly these.
Keras/PyTorch differences left as they are: Adam adds eps to sqrt(v_hat) in
PyTorch, to sqrt(v) scaled in Keras (immaterial at 1e-7); the flatten order of
NCHW vs NHWC permutes dense weights, which does not change the model family.

Input feeding is PyTorch's fastest idiom: the whole training set is decoded,
scaled by 1/255 once and held as one float tensor; every epoch draws a random
permutation and each step gathers a batch by slicing it. A
torch.utils.data.DataLoader with per-sample transforms (ToTensor, Normalize)
would be far slower (128 Python-level sample fetches and transforms per
step against a ~1-3 ms step; not measured here), so this is PyTorch at its
best, not as commonly written.
"""
import argparse
import ctypes
import gzip
import json
import math
import os
import resource
import sys
import time

T_SCRIPT = time.monotonic()


def process_start_monotonic():
    """CLOCK_MONOTONIC-ish time the process started (10 ms resolution):
    /proc/self/stat starttime is in clock ticks since boot, and CLOCK_BOOTTIME
    counts from boot too."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
        hz = os.sysconf("SC_CLK_TCK")
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / hz
        return time.monotonic() - age
    except (OSError, ValueError, IndexError):
        return T_SCRIPT


T_PROC = process_start_monotonic()

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

T_IMPORTED = time.monotonic()

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
    x = read_idx(os.path.join(data_dir, "train-images-idx3-ubyte.gz"))
    y = read_idx(os.path.join(data_dir, "train-labels-idx1-ubyte.gz"))
    xt = read_idx(os.path.join(data_dir, "t10k-images-idx3-ubyte.gz"))
    yt = read_idx(os.path.join(data_dir, "t10k-labels-idx1-ubyte.gz"))
    return x, y, xt, yt


class MLP(nn.Module):
    # flatten 784 -> dense 256 relu -> dense 128 relu -> dense 10
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 256)
        self.fc2 = nn.Linear(256, 128)
        self.fc3 = nn.Linear(128, 10)

    def forward(self, x):
        x = x.reshape(x.shape[0], 784)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class CNN(nn.Module):
    # (28,28,1) -> conv5x5x32 same relu -> maxpool2 -> conv5x5x64 same relu ->
    # maxpool2 -> flatten -> dense 128 relu -> dropout 0.4 -> dense 10
    def __init__(self, channels_last=False):
        super().__init__()
        self.channels_last = channels_last
        self.conv1 = nn.Conv2d(1, 32, 5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, 5, padding=2)
        self.fc1 = nn.Linear(64 * 7 * 7, 128)
        self.drop = nn.Dropout(0.4)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = x.reshape(x.shape[0], 1, 28, 28)
        if self.channels_last:  # NHWC: oneDNN's fast layout; flatten order differs, the model does not
            x = x.contiguous(memory_format=torch.channels_last)
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.drop(F.relu(self.fc1(x.flatten(1))))
        return self.fc2(x)


def init_glorot(model):
    # Keras glorot_uniform kernels, zero biases. For conv weights (out,in,k,k)
    # torch's fan_in = in*k*k, fan_out = out*k*k: the same as Keras.
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            nn.init.xavier_uniform_(m.weight)
            nn.init.zeros_(m.bias)


def blas_core():
    """The kernel the loaded OpenBLAS runs ("SkylakeX"), via the process's
    already-loaded libblas.so.3 / libopenblas.so.0."""
    for name in ("libopenblas.so.0", "libblas.so.3"):
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
            fn = lib.openblas_get_corename
            fn.restype = ctypes.c_char_p
            nt = lib.openblas_get_num_threads
            return fn().decode(), int(nt())
        except (OSError, AttributeError):
            continue
    return "unknown", 0


def evaluate(model, xt, yt, batch=1000):
    model.eval()
    correct = 0
    loss = 0.0
    with torch.no_grad():
        for i in range(0, xt.shape[0], batch):
            out = model(xt[i:i + batch])
            loss += F.cross_entropy(out, yt[i:i + batch], reduction="sum").item()
            correct += (out.argmax(1) == yt[i:i + batch]).sum().item()
    model.train()
    return correct / xt.shape[0], loss / xt.shape[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch.set_num_threads (0: leave torch's default)")
    ap.add_argument("--max-steps", type=int, default=0,
                    help="stop after this many steps (speed-only runs; 0: whole epochs)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--channels-last", action="store_true",
                    help="CNN in NHWC (torch.channels_last): faster with oneDNN here")
    ap.add_argument("--flush-denormal", action="store_true", help="torch.set_flush_denormal(True)")
    ap.add_argument("--no-mkldnn", action="store_true", help="disable oneDNN (conv on torch's own kernels)")
    ap.add_argument("--no-eval", action="store_true", help="skip the test-set evaluation")
    ap.add_argument("--data-dir", default=DATA_DIR)
    ap.add_argument("--epoch-log", action="store_true", help="one JSON line per epoch on stderr")
    args = ap.parse_args()

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.no_mkldnn:
        torch.backends.mkldnn.enabled = False
    if args.flush_denormal:
        torch.set_flush_denormal(True)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    # Decode (gunzip + parse) and scale once; reported separately, as Loom's decode_ms is.
    t = time.monotonic()
    x, y, xt, yt = load(args.data_dir)
    x = torch.from_numpy(x.astype(np.float32)).reshape(-1, 784).mul_(1.0 / 255.0)
    y = torch.from_numpy(y.astype(np.int64))
    xt = torch.from_numpy(xt.astype(np.float32)).reshape(-1, 784).mul_(1.0 / 255.0)
    yt = torch.from_numpy(yt.astype(np.int64))
    decode_s = time.monotonic() - t

    model = MLP() if args.model == "mlp" else CNN(args.channels_last)
    init_glorot(model)
    if args.model == "cnn" and args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if args.model == "mlp":
        # configs/fashion_mnist_mlp.cfg: Nesterov momentum 0.9, lr 0.1 with cosine decay to 0 over 4690 steps
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    else:
        # configs/fashion_mnist_cnn.cfg: Adam lr 0.003 with cosine decay to 0 over 2345 steps
        opt = torch.optim.Adam(model.parameters(), lr=0.003, betas=(0.9, 0.999), eps=1e-7)
    model.train()

    n = x.shape[0]
    B = args.batch
    steps = 0
    samples = 0
    first_step_at = None
    train_s = 0.0
    epochs_done = 0
    epoch_log = []
    stop = False
    loss = None
    for epoch in range(args.epochs):
        t_epoch = time.monotonic()
        perm = torch.randperm(n, generator=gen)
        ep_loss = torch.zeros(())
        ep_steps = 0
        # Keras semantics: the last, partial batch (60000 % 128 = 96) is kept.
        for i in range(0, n, B):
            idx = perm[i:i + B]
            xb = x[idx]
            yb = y[idx]
            out = model(xb)
            loss = F.cross_entropy(out, yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if args.model == "mlp":
                opt.param_groups[0]["lr"] = 0.1 * 0.5 * (1 + math.cos(math.pi * min(steps, 4690) / 4690))
            else:
                opt.param_groups[0]["lr"] = 0.003 * 0.5 * (1 + math.cos(math.pi * min(steps, 2345) / 2345))
            opt.step()
            ep_loss += loss.detach()
            ep_steps += 1
            steps += 1
            samples += xb.shape[0]
            if first_step_at is None:
                first_step_at = time.monotonic()
            if args.max_steps and steps >= args.max_steps:
                stop = True
                break
        epoch_s = time.monotonic() - t_epoch
        train_s += epoch_s
        epochs_done += 1
        rec = {"epoch": epoch + 1, "step": steps, "train_loss": round(ep_loss.item() / max(ep_steps, 1), 5),
               "samples_per_sec": round(ep_steps and (min(n, ep_steps * B) / epoch_s), 1),
               "epoch_s": round(epoch_s, 3)}
        epoch_log.append(rec)
        if args.epoch_log:
            print(json.dumps(rec), file=sys.stderr, flush=True)
        if stop:
            break

    acc, eval_loss = (None, None) if args.no_eval else evaluate(model, xt, yt)
    core, blas_threads = blas_core()
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Steady state: samples/s without the first epoch (torch warms up lazily);
    # equals samples_per_sec when only one epoch ran.
    steady = None
    if len(epoch_log) > 1:
        st = sum(e["epoch_s"] for e in epoch_log[1:])
        steady = round((samples - min(n, epoch_log[0]["step"] * B)) / st, 1) if st > 0 else None
    res = {
        "impl": "pytorch",
        "torch": torch.__version__,
        "model": args.model,
        "epochs": epochs_done,
        "steps": steps,
        "batch": B,
        "samples": samples,
        "train_s": round(train_s, 3),
        # Over all training steps incl. the first (the same definition as Loom's
        # end-of-run samples_per_sec); evaluation excluded.
        "samples_per_sec": round(samples / train_s, 1),
        "samples_per_sec_steady": steady,
        "eval_accuracy": acc,
        "eval_loss": eval_loss and round(eval_loss, 5),
        "train_loss": epoch_log[-1]["train_loss"] if epoch_log else None,
        # Process start -> first step done, minus decode (Loom's first_step_ms definition).
        # Process start is from /proc/self/stat (10 ms ticks); import_ms is python + import torch.
        "first_step_ms": round((first_step_at - T_PROC - decode_s) * 1e3, 1) if first_step_at else None,
        "import_ms": round((T_IMPORTED - T_PROC) * 1e3, 1),
        "decode_ms": round(decode_s * 1e3, 1),
        "peak_rss_mb": round(rss_kb / 1024.0, 1),
        "torch_threads": torch.get_num_threads(),
        "channels_last": bool(args.model == "cnn" and args.channels_last),
        "flush_denormal": bool(args.flush_denormal),
        "mkldnn": bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled),
        "blas_core": core,
        "blas_threads": blas_threads,
        "env": {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "ONEDNN_MAX_CPU_ISA",
                                          "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
                if k in os.environ},
        "epoch_log": epoch_log,
    }
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
