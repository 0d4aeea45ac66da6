#!/usr/bin/python3
"""ddp_ref.py - PyTorch DistributedDataParallel (gloo) reference for
tests/bench/mwm_bench.sh: the MLP of configs/fashion_mnist_multi_worker.cfg
(784-256-128-10, SGD with Nesterov momentum 0.9, lr 0.1) trained by WORLD
processes on 127.0.0.1, global batch 128 (128 / WORLD per process), one pass
over Fashion-MNIST's training set. Each process holds its shard of the data
as one float tensor scaled once (PyTorch's fastest feeding, as torch_ref.py),
so the figure is DDP's step at its best. Rank 0 prints one JSON line:
samples/s over the whole job (steps x global batch / the slowest rank's time).

  ddp_ref.py --world 2 --port 29512 [--steps N]
Spawns the ranks itself (torch.multiprocessing); OPENBLAS_NUM_THREADS and
torch threads are 1 per rank (2 ranks on 2 cores)."""
import argparse
import gzip
import json
import os
import sys
import time

DATA_DIR = "/usr/share/datasets/fashion-mnist"


def read_idx(path):
    import numpy as np
    with gzip.open(path, "rb") as f:
        data = f.read()
    rank = data[3]
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(rank)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * rank).reshape(dims)


def worker(rank, world, port, steps_limit, out):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x = read_idx(os.path.join(DATA_DIR, "train-images-idx3-ubyte.gz"))
    y = read_idx(os.path.join(DATA_DIR, "train-labels-idx1-ubyte.gz"))
    g = torch.Generator().manual_seed(42)
    perm = torch.randperm(len(x), generator=g)
    X = torch.from_numpy(x.reshape(len(x), -1).astype("float32") / 255.0)[perm]
    Y = torch.from_numpy(y.astype("int64"))[perm]
    per = 128 // world
    steps = len(X) // 128
    if steps_limit:
        steps = min(steps, steps_limit)
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    loss_fn = nn.CrossEntropyLoss()
    dist.barrier()
    t0 = time.monotonic()
    for s in range(steps):
        lo = s * 128 + rank * per
        xb, yb = X[lo:lo + per], Y[lo:lo + per]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(xb), yb)
        loss.backward()
        opt.step()
    dt = torch.tensor([time.monotonic() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    if rank == 0:
        out.put({"ranks": world, "steps": steps, "global_batch": 128, "seconds": dt.item(),
                 "samples_per_sec": steps * 128 / dt.item(), "loss": loss.item()})
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--port", type=int, default=29512)
    ap.add_argument("--steps", type=int, default=0)
    a = ap.parse_args()
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, a.world, a.port, a.steps, q)) for r in range(a.world)]
    for p in procs:
        p.start()
    res = q.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
