#!/usr/bin/env python3
"""Where a Llama step's GPU time goes (issue 31): the same model and loop as
worker/benches/lm_gpu.py, PyTorch eager and under torch.compile, profiled
with torch.profiler for a few steps after warm-up; CUDA kernel time summed
into kinds (matrix products, attention, the fused kernels Inductor
generates, elementwise, reductions and norms, softmax and cross-entropy,
the optimizer, copies and casts); and accrue's own split of a step
(compute, clip, optimizer: the step report's timing) from
`accrue-worker train`.

A measurement, not a test. accrue runs the same libtorch kernels as the
eager loop (its eager side measured 0.97 of PyTorch eager's tokens/s in
lm_gpu.py), so the eager profile is the picture for accrue's kernels too.

  python worker/benches/lm_gpu_profile.py --binary gpu-bin/accrue-worker \\
      [--preset 100m] [--seq-len 1024] [--batch 8] [--k 4] [--steps 3] [--warmup 4]
"""
import argparse
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import lm_gpu  # noqa: E402
from amp_vs_pytorch import run_spec  # noqa: E402

KINDS = [
    ("attention", ("flash", "fmha", "attention", "efficient")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("softmax / cross-entropy", ("softmax", "nll", "cross_entropy")),
    ("inductor fused", ("triton",)),
    ("matrix products", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "sm90", "sm80")),
    ("reductions / norms", ("reduce", "norm")),
    ("copies / casts", ("copy", "cast", "memcpy", "memset", "fill")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "index")),
]


def kind_of(name):
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def profile_torch(a, c, compile_):
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile
    torch.manual_seed(lm_gpu.SEED)
    dev = torch.device("cuda")
    model = lm_gpu.llama(c).to(dev)
    fwd = torch.compile(model) if compile_ else model
    opt = torch.optim.AdamW(model.parameters(), lr=lm_gpu.LR, weight_decay=lm_gpu.WD, fused=True)
    b, t, k, v = a.batch, a.seq_len, a.k, c["vocab_size"]

    def step():
        rows = torch.randint(0, v, (k, b, t + 1), device=dev)
        n = rows[:, :, 1:].numel()
        for m in range(k):
            x, y = rows[m, :, :-1], rows[m, :, 1:]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = fwd(x)
                loss = F.cross_entropy(logits.reshape(-1, v), y.reshape(-1), reduction="sum") / n
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), lm_gpu.MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(a.steps):
            step()
        end.record()
        torch.cuda.synchronize()
    wall_ms = start.elapsed_time(end) / a.steps
    kinds, top = {}, []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0)
        if us <= 0 or e.key.startswith("ProfilerStep"):
            continue
        kinds[kind_of(e.key)] = kinds.get(kind_of(e.key), 0.0) + us / 1000 / a.steps
        top.append((us / 1000 / a.steps, e.count // a.steps, e.key))
    top.sort(reverse=True)
    return wall_ms, kinds, top[:12]


def accrue_split(a, c):
    """accrue's seconds a step (JSON lines' arrival) and the mean of each
    part of its step reports, over the steps after the warm-up."""
    ns = argparse.Namespace(device="cuda", precision="bf16", seq_len=a.seq_len,
                            batch=a.batch, k=a.k, steps=a.warmup + a.steps)
    with tempfile.TemporaryDirectory(prefix="accrue-lm-prof-") as tmp:
        data = Path(tmp) / "train.bin"
        tokens = ns.steps * a.batch * a.seq_len * a.k
        lm_gpu.write_tokens(data, tokens + a.seq_len + 1, c["vocab_size"])
        reports = []
        ends, _ = run_spec(a.binary, lm_gpu.accrue_job(ns, c, data, True), 2, steps=reports)
    parts = {}
    for s in reports[a.warmup:]:
        for key, val in s.get("timing", {}).items():
            if isinstance(val, (int, float)):
                parts.setdefault(key, []).append(val)
    wall = (ends[-1] - ends[a.warmup - 1]) / (len(ends) - a.warmup)
    return wall, {k: statistics.mean(v) for k, v in parts.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default="gpu-bin/accrue-worker")
    ap.add_argument("--preset", choices=sorted(lm_gpu.PRESETS), default="100m")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=4)
    a = ap.parse_args()
    c = lm_gpu.model_config(argparse.Namespace(preset=a.preset, seq_len=a.seq_len))
    print(f"### Where a step's GPU time goes: Llama {a.preset}, bf16, T = {a.seq_len}, "
          f"b = {a.batch}, k = {a.k} ({a.steps} profiled steps after {a.warmup})\n")
    results = {}
    for name, comp in (("pytorch-eager", False), ("pytorch-compile", True)):
        results[name] = profile_torch(a, c, comp)
        print(f"{name}: {results[name][0]:.1f} ms a step", file=sys.stderr, flush=True)
    names = sorted({k for r in results.values() for k in r[1]},
                   key=lambda k: -results["pytorch-eager"][1].get(k, 0.0))
    print("| kernels (ms a step) | " + " | ".join(results) + " |")
    print("|---|" + "---:|" * len(results))
    for k in names:
        print(f"| {k} | " + " | ".join(f"{r[1].get(k, 0.0):.1f}" for r in results.values()) + " |")
    print("| all kernels | " + " | ".join(f"{sum(r[1].values()):.1f}" for r in results.values()) + " |")
    print("| step (CUDA events) | " + " | ".join(f"{r[0]:.1f}" for r in results.values()) + " |\n")
    for name, r in results.items():
        print(f"{name}, the largest kernels (ms a step, launches a step):\n")
        for ms, count, key in r[2]:
            print(f"- {ms:.2f} ms, {count}x: `{key[:110]}`")
        print()
    try:
        wall, parts = accrue_split(a, c)
        print(f"accrue (graphs on): {1000 * wall:.1f} ms a step; step report split (ms): "
              + ", ".join(f"{k} {1000 * v:.1f}" for k, v in parts.items()))
    except Exception as e:  # a measurement: say what failed and keep the rest
        print(f"accrue split: failed: {e}")


if __name__ == "__main__":
    main()
