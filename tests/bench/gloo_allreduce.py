#!/usr/bin/python3
"""gloo_allreduce.py - torch.distributed's gloo all-reduce between processes
over loopback, the reference tests/bench/cluster_bench.sh runs beside Loom's.

    gloo_allreduce.py RANKS SIZES_BYTES_COMMA_SEPARATED REPS

For each size: a warm-up, then REPS all-reduces of float32 (SUM), each after
a barrier and timed on rank 0; prints "SIZE_BYTES MEDIAN_SECONDS" per size,
as cluster_allreduce does. Needs Debian's python3-torch (/usr/bin/python3).
With RANK, MASTER_ADDR and MASTER_PORT in the environment it runs that one
rank of a job across hosts (netns_allreduce_bench.sh starts one per host)."""
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank, n, port, sizes, reps, addr="127.0.0.1"):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=n)
    for size in sizes:
        t = torch.ones(size // 4, dtype=torch.float32)
        for _ in range(1 if size >= 16 << 20 else 3):
            dist.all_reduce(t)
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        if rank == 0:
            print(f"{size} {statistics.median(times):.9f}", flush=True)
    dist.destroy_process_group()


def main():
    n, sizes, reps = int(sys.argv[1]), [int(s) for s in sys.argv[2].split(",")], int(sys.argv[3])
    if "RANK" in os.environ:  # one rank of a job across hosts
        rank_main(int(os.environ["RANK"]), n, int(os.environ["MASTER_PORT"]), sizes, reps, os.environ["MASTER_ADDR"])
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(rank_main, args=(n, port, sizes, reps), nprocs=n, join=True)


if __name__ == "__main__":
    main()
