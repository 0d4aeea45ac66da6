#!/usr/bin/python3
"""elastic_torch_ref.py - the torch side of tests/bench/elastic_bench.sh:
torch's elastic agent (torch.distributed.launcher.api.elastic_launch, what
torchrun runs; LaunchConfig with redirects and tee off: torchrun's own
--redirects crashes here) running 3 DDP (gloo) workers of a small MLP
(784-64-10, momentum 0.9, global batch 96, each step padded to about 15 ms
as loom's side is by tests/lua/mwm_slow.lua), min_nodes 1, max_nodes 3
(--nnodes 1:3), a checkpoint every 50 steps (the user's own, as torch
elastic requires). At step KILL_AT one worker is killed (SIGKILL); the agent
restarts every worker, which reload the checkpoint. Prints one JSON line:
the seconds from the kill to the first step the job completes after it.

  elastic_torch_ref.py --port 29612 [--monitor 5] [--kill-at 60]"""
import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time

DATA_DIR = "/usr/share/datasets/fashion-mnist"


def train(work, steps):
    import gzip
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(os.path.join(work, "pid.%d" % rank), "w") as f:
        f.write(str(os.getpid()))
    with gzip.open(os.path.join(DATA_DIR, "train-images-idx3-ubyte.gz"), "rb") as f:
        x = np.frombuffer(f.read(), dtype=np.uint8, offset=16).reshape(-1, 784)[:9600]
    with gzip.open(os.path.join(DATA_DIR, "train-labels-idx1-ubyte.gz"), "rb") as f:
        y = np.frombuffer(f.read(), dtype=np.uint8, offset=8)[:9600]
    X = torch.from_numpy(x.astype("float32") / 255.0)
    Y = torch.from_numpy(y.astype("int64"))
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ckpt = os.path.join(work, "ckpt.pt")
    start = 0
    if os.path.exists(ckpt):
        st = torch.load(ckpt)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        start = st["step"]
    ddp = nn.parallel.DistributedDataParallel(model)
    loss_fn = nn.CrossEntropyLoss()
    per = 96 // world
    for s in range(start, steps):
        t = time.monotonic()
        lo = (s % 100) * 96 + rank * per
        opt.zero_grad(set_to_none=True)
        loss_fn(ddp(X[lo:lo + per]), Y[lo:lo + per]).backward()
        opt.step()
        if rank == 0:
            with open(os.path.join(work, "progress"), "a") as f:
                f.write("%d %.6f\n" % (s + 1, time.time()))
            if (s + 1) % 50 == 0:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": s + 1}, ckpt + ".tmp")
                os.replace(ckpt + ".tmp", ckpt)
        left = 0.015 - (time.monotonic() - t)
        if left > 0:
            time.sleep(left)
    dist.destroy_process_group()


def last_step(path):
    try:
        with open(path) as f:
            lines = f.read().split("\n")
        lines = [l for l in lines if l]
        return [(int(l.split()[0]), float(l.split()[1])) for l in lines]
    except OSError:
        return []


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=29612)
    ap.add_argument("--monitor", type=float, default=5.0, help="the agent's monitor_interval (torchrun: 5 s)")
    ap.add_argument("--kill-at", type=int, default=60)
    ap.add_argument("--steps", type=int, default=300)
    a = ap.parse_args()
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    from torch.distributed.elastic.multiprocessing import Std
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    work = tempfile.mkdtemp(prefix="elastic_torch_")
    cfg = LaunchConfig(min_nodes=1, max_nodes=3, nproc_per_node=3, run_id="elastic_bench", rdzv_backend="c10d",
                       rdzv_endpoint="127.0.0.1:%d" % a.port, max_restarts=3, monitor_interval=a.monitor,
                       redirects=Std.NONE, tee=Std.NONE, start_method="spawn")
    result = {}

    def killer():
        prog = os.path.join(work, "progress")
        while True:
            p = last_step(prog)
            if p and p[-1][0] >= a.kill_at:
                break
            time.sleep(0.01)
        with open(os.path.join(work, "pid.2")) as f:
            pid = int(f.read())
        at = p[-1][0]
        t_kill = time.time()
        os.kill(pid, signal.SIGKILL)
        while True:
            p = last_step(prog)
            later = [t for s, t in p if t > t_kill and s > at + 1]
            if later:
                result["recovery_s"] = later[0] - t_kill
                result["killed_at_step"] = at
                return
            time.sleep(0.005)

    th = threading.Thread(target=killer, daemon=True)
    th.start()
    elastic_launch(cfg, train)(work, a.steps)
    th.join(timeout=5)
    result["monitor_interval_s"] = a.monitor
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
