#!/usr/bin/env python3
"""Where a Llama step's GPU time goes (issue 31): the same model and loop as
worker/benches/lm_gpu.py, PyTorch eager and under torch.compile, profiled
with torch.profiler for a few steps after warm-up; CUDA kernel time summed
into kinds (matrix products, attention, the fused kernels Inductor
generates, elementwise, reductions and norms, softmax and cross-entropy,
the optimizer, copies and casts); and accrue's own split of a step
(compute, comm, clip, optimizer: the step report's timing) and its own
CUDA kernels, from `accrue-worker train --profile` (libtorch's profiler,
the same Kineto that torch.profiler drives, written as a Chrome trace).

A measurement, not a test.

  python worker/benches/lm_gpu_profile.py --binary gpu-bin/accrue-worker \\
      [--preset 100m] [--seq-len 1024] [--batch 8] [--k 4] [--steps 3] [--warmup 4]
"""
import argparse
import json
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
    from torch.profiler import ProfilerActivity, profile
    torch.manual_seed(lm_gpu.SEED)
    dev = torch.device("cuda")
    model = lm_gpu.llama(c).to(dev)
    step = lm_gpu.torch_step(model, compile_, dev, c["vocab_size"], a.batch, a.seq_len, a.k,
                             "bf16")

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


def accrue_profile(a, c):
    """accrue's seconds a step (JSON lines' arrival), the mean of each part
    of its step reports over the steps after the warm-up, and its CUDA
    kernels' time a step by kind from `--profile`'s trace of --steps steps
    after --warmup (ms), with its largest kernels."""
    ns = argparse.Namespace(device="cuda", precision="bf16", seq_len=a.seq_len,
                            batch=a.batch, k=a.k, steps=a.warmup + a.steps + 1)
    with tempfile.TemporaryDirectory(prefix="accrue-lm-prof-") as tmp:
        data = Path(tmp) / "train.bin"
        tokens = ns.steps * a.batch * a.seq_len * a.k
        lm_gpu.write_tokens(data, tokens + a.seq_len + 1, c["vocab_size"])
        trace = Path(tmp) / "trace.json"
        reports = []
        ends, _ = run_spec(a.binary, lm_gpu.accrue_job(ns, c, data, True), 2, steps=reports,
                           args=["--profile", str(trace), "--profile-after", str(a.warmup),
                                 "--profile-steps", str(a.steps)])
        events = json.loads(trace.read_text()).get("traceEvents", [])
    parts = {}
    for s in reports[a.warmup:]:
        for key, val in s.get("timing", {}).items():
            if isinstance(val, (int, float)):
                parts.setdefault(key, []).append(val)
    wall = (ends[-1] - ends[a.warmup - 1]) / (len(ends) - a.warmup)
    kinds, by_name = {}, {}
    for e in events:
        if e.get("cat") != "kernel" or "dur" not in e:
            continue
        ms = e["dur"] / 1000 / a.steps
        kinds[kind_of(e["name"])] = kinds.get(kind_of(e["name"]), 0.0) + ms
        t, n = by_name.get(e["name"], (0.0, 0))
        by_name[e["name"]] = (t + ms, n + 1)
    top = sorted(((t, n // a.steps, k) for k, (t, n) in by_name.items()), reverse=True)[:12]
    return wall, {k: statistics.mean(v) for k, v in parts.items()}, kinds, top


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
    split = None
    try:
        wall, parts, kinds, top = accrue_profile(a, c)
        results["accrue"] = (1000 * wall, kinds, top)
        split = parts
    except Exception as e:  # a measurement: say what failed and keep the rest
        print(f"accrue: failed: {e}", file=sys.stderr)
    names = sorted({k for r in results.values() for k in r[1]},
                   key=lambda k: -results["pytorch-eager"][1].get(k, 0.0))
    print("| kernels (ms a step) | " + " | ".join(results) + " |")
    print("|---|" + "---:|" * len(results))
    for k in names:
        print(f"| {k} | " + " | ".join(f"{r[1].get(k, 0.0):.1f}" for r in results.values()) + " |")
    print("| all kernels | " + " | ".join(f"{sum(r[1].values()):.1f}" for r in results.values()) + " |")
    print("| step (PyTorch: CUDA events under the profiler; accrue: JSON lines) | "
          + " | ".join(f"{r[0]:.1f}" for r in results.values()) + " |\n")
    for name, r in results.items():
        print(f"{name}, the largest kernels (ms a step, launches a step):\n")
        for ms, count, key in r[2]:
            print(f"- {ms:.2f} ms, {count}x: `{key[:110]}`")
        print()
    if split is not None:
        print("accrue (graphs on), step report split (ms): "
              + ", ".join(f"{k} {1000 * v:.1f}" for k, v in split.items()))


if __name__ == "__main__":
    main()
