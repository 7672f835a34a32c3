"""torch.distributed gloo all_reduce on loopback: the same sizes and W as
allreduce-bench, printed in the same CSV columns.

Usage: python gloo_allreduce.py --world 2 --sizes 4K,1M,16M --iters 20
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def parse(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1].upper(), 1)
    return int(s[:-1] if mult > 1 else s) * mult


def iters_for(nbytes, iters):
    return max(3, min(iters * (4 << 20) // max(nbytes, 1), max(iters, 3) * 50))


def run(rank, world, sizes, iters, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for s in sizes:
        nbytes = parse(s)
        t = torch.arange(nbytes // 4, dtype=torch.float32).remainder_(7)
        for _ in range(2):
            dist.all_reduce(t)
        n = iters_for(nbytes, iters)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(t)
        dt = (time.perf_counter() - start) / n
        if rank == 0:
            algbw = nbytes / dt / 1e9
            busbw = algbw * 2 * (world - 1) / world
            print(f"gloo,{world},{nbytes},{n},{dt * 1e6:.1f},{algbw:.3f},{busbw:.3f},", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--sizes", default="4K,16K,64K,256K,1M,4M,16M,64M,256M")
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(run, args=(a.world, a.sizes.split(","), a.iters, port), nprocs=a.world)
