"""What a durable checkpoint costs, accrue against PyTorch (BENCHMARKS.md
section 8). Runs target/release/checkpoint-bench (accrue's writer with and
without fsync), then writes the same tensors (read back from accrue's
checkpoint) the way a PyTorch loop does: torch.save of the model and
optimizer state dicts into a temporary folder, with and without os.fsync of
each file, the folder and the parent, then os.replace. Alternates the
variants; prints medians.

  python worker/benches/checkpoint_vs_pytorch.py --bench target/release/checkpoint-bench
"""
import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import torch
from safetensors.torch import load_file


def fsync_path(path, directory=False):
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_write(root, step, model, optim, sync):
    tmp = os.path.join(root, f".step-{step}.tmp")
    os.makedirs(tmp)
    for name, sd in (("model.pt", model), ("optimizer.pt", optim)):
        path = os.path.join(tmp, name)
        torch.save(sd, path)
        if sync:
            fsync_path(path)
    if sync:
        fsync_path(tmp, directory=True)
    final = os.path.join(root, f"step-{step}")
    os.replace(tmp, final)
    if sync:
        fsync_path(root, directory=True)
    old = os.path.join(root, f"step-{step - 2}")
    if os.path.exists(old):
        shutil.rmtree(old)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", required=True)
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--iters", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(2)
    work = tempfile.mkdtemp(prefix="ckbench-", dir="/tmp")
    ours = os.path.join(work, "accrue")
    out = subprocess.run(
        [args.bench, "--model", args.model, "--iters", str(args.iters), "--dir", ours, "--keep"],
        check=True, capture_output=True, text=True,
    ).stdout
    print(out, end="")
    latest = open(os.path.join(ours, "LATEST")).read().strip()
    model = load_file(os.path.join(ours, latest, "model.safetensors"))
    optim = load_file(os.path.join(ours, latest, "optimizer.safetensors"))
    root = os.path.join(work, "torch")
    os.makedirs(root)
    times = {True: [], False: []}
    for i in range(args.iters * 2):
        sync = i % 2 == 0
        t = time.perf_counter()
        torch_write(root, i + 1, model, optim, sync)
        times[sync].append(time.perf_counter() - t)
    mb = sum(t.numel() * t.element_size() for t in list(model.values()) + list(optim.values())) / 1e6
    for sync in (True, False):
        v = times[sync]
        print(
            f"pytorch torch.save {'with' if sync else 'without'} fsync: median "
            f"{statistics.median(v) * 1e3:.1f} ms ({min(v) * 1e3:.1f}..{max(v) * 1e3:.1f} ms, {len(v)} runs, {mb:.1f} MB)"
        )
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
