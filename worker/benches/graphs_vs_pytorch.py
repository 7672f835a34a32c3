#!/usr/bin/env python3
"""CUDA graphs on the GPU machine (issue 19, `make bench-gpu`): accrue
with the micro-step captured as a CUDA graph, against PyTorch's eager loop
and against the same PyTorch loop with its micro-step captured by hand.

A measurement, not a test. In one call, for --rounds rounds (the order of
the sides rotates every round), each side trains the model at CIFAR shape
on synthetic data resident on the GPU, b samples a micro-batch, k
micro-batches a step, SGD(lr 0.05, momentum 0.9, weight decay 1e-4) with
norm clipping at 1.0, fp32, one rank:

  pytorch-eager    for each micro-batch: loss = cross_entropy(model(x), y) / k;
                   loss.backward(); every k: clip_grad_norm_; step; zero_grad
  pytorch-graphed  the same, with the micro-step (forward, loss / k,
                   backward into .grad) captured once by torch.cuda.graph
                   after three warm-up micro-steps on a side stream, inputs
                   copied into static buffers, then replayed; clip and SGD
                   eager; gradients zeroed in place (the graph holds them)
  accrue           `accrue-worker train` with [performance] cuda_graphs = true
  accrue-eager     the same with cuda_graphs = false

Throughput: samples of the steps after --warmup over the time since the
warm-up ended (accrue: when each step's JSON line is read). Needs a worker
built with ACCRUE_CUDA=1 and a Python with CUDA torch; the worker finds
libtorch and libcudart through LD_LIBRARY_PATH, set here to that torch's
lib folder and nvidia/cu13/lib.

  python worker/benches/graphs_vs_pytorch.py --binary gpu-bin/accrue-worker \\
      [--model resnet18] [--batch 128] [--k 4] [--steps 40] [--warmup 8] [--rounds 3]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "reference"))

from amp_vs_pytorch import (  # noqa: E402
    CLASSES, LR, MAX_NORM, MOMENTUM, WEIGHT_DECAY, job as amp_job, rate, run_spec)

SIDES = ["pytorch-eager", "pytorch-graphed", "accrue", "accrue-eager"]


def job(model, b, k, steps, graphs):
    table = f"[performance]\ncuda_graphs = {'true' if graphs else 'false'}\n"
    return amp_job(model, b, k, steps, "fp32", device="cuda", extra=table)


def torch_child(cfg):
    import torch
    import torch.nn.functional as F
    from torch_reference import build
    torch.manual_seed(0)
    dev = torch.device("cuda")
    b, k, steps = cfg["b"], cfg["k"], cfg["steps"]
    n = b * k * steps
    X = torch.randn(n, 3, 32, 32, device=dev)
    Y = torch.randint(0, CLASSES, (n,), device=dev)
    model = build(cfg["model"], 3, 32, 32, CLASSES).to(dev)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    perm = torch.randperm(n, device=dev)
    graphed = cfg["graphed"]
    if graphed:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        sx = torch.empty(b, 3, 32, 32, device=dev)
        sy = torch.empty(b, dtype=torch.long, device=dev)
        sx.copy_(X[:b])
        sy.copy_(Y[:b])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                (F.cross_entropy(model(sx), sy) / k).backward()
        torch.cuda.current_stream().wait_stream(side)
        for p in model.parameters():
            p.grad.zero_()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            sloss = F.cross_entropy(model(sx), sy) / k
            sloss.backward()
        for p in model.parameters():
            p.grad.zero_()
    torch.cuda.synchronize()
    ends = []
    for s in range(steps):
        for m in range(k):
            idx = perm[(s * k + m) * b:(s * k + m + 1) * b]
            if graphed:
                torch.index_select(X, 0, idx, out=sx)
                torch.index_select(Y, 0, idx, out=sy)
                g.replay()
                loss = sloss
            else:
                loss = F.cross_entropy(model(X.index_select(0, idx)), Y.index_select(0, idx)) / k
                loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=not graphed)
        _ = loss.item(), norm.item()
        ends.append(time.perf_counter())
    print(json.dumps({"ends": ends}))


def run_torch(cfg):
    proc = subprocess.run([sys.executable, __file__, "--_child", json.dumps(cfg)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"PyTorch loop failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["ends"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default="gpu-bin/accrue-worker")
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--_child", dest="child")
    a = ap.parse_args()
    if a.child:
        torch_child(json.loads(a.child))
        return
    import torch
    env = dict(os.environ)
    torch_dir = Path(torch.__file__).parent
    libs = [str(torch_dir / "lib"), str(torch_dir.parent / "nvidia" / "cu13" / "lib")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [env.get("LD_LIBRARY_PATH", "")])
    b, k = a.batch, a.k
    per_step = b * k
    results = {s: [] for s in SIDES}
    last = {}
    for r in range(a.rounds):
        order = SIDES[r % len(SIDES):] + SIDES[:r % len(SIDES)]
        for side in order:
            if side.startswith("pytorch"):
                ends = run_torch(dict(model=a.model, b=b, k=k, steps=a.steps,
                                      graphed=side == "pytorch-graphed"))
            else:
                text = job(a.model, b, k, a.steps, side == "accrue")
                steps = []
                ends, _ = run_spec(a.binary, text, 1, env, steps)
                last[side] = steps[-1] if steps else {}
            results[side].append(rate(ends, per_step, a.warmup))
    print(f"`{' '.join(sys.argv)}` ({time.strftime('%Y-%m-%d')}, "
          f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {a.model}, "
          f"b = {b}, k = {k}, {a.steps} steps of which {a.warmup} warm-up, "
          f"{a.rounds} rounds, sides interleaved)\n")
    print("| side | samples/s per round | median |")
    print("|---|---|---:|")
    med = {s: statistics.median(v) for s, v in results.items()}
    for s in SIDES:
        print(f"| {s} | {' / '.join(f'{x:,.0f}' for x in results[s])} | {med[s]:,.0f} |")
    for s in ("accrue", "accrue-eager"):
        ev = last.get(s, {})
        print(f"\n{s}, last step: {ev.get('graph_replays')} micro-step replays "
              f"(eager: {ev.get('eager_reason')!r}), sync graph replayed: "
              f"{ev.get('sync_graph_replayed')} (eager: {ev.get('sync_eager_reason')!r})")
    if not last.get("accrue", {}).get("sync_graph_replayed"):
        print("\nWARNING: the accrue side did not replay its sync graph: not a graphed run")
    print(f"\naccrue / pytorch-eager: {med['accrue'] / med['pytorch-eager']:.2f} (goal >= 4); "
          f"accrue / pytorch-graphed: {med['accrue'] / med['pytorch-graphed']:.2f} (goal >= 0.9); "
          f"accrue graphed / accrue eager: {med['accrue'] / med['accrue-eager']:.2f}")


if __name__ == "__main__":
    main()
