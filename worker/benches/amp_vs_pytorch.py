#!/usr/bin/env python3
"""Mixed precision on the CPU: samples/s and peak memory of bf16 against
fp32, accrue against the same PyTorch autocast loop (docs/BENCHMARKS.md
section 7, issue 18).

A measurement, not a test. For every (model, b, precision) it runs, one
after the other:

  (a) accrue:  `accrue-worker train JOB.toml --json --threads T` on a
      generated spec (synthetic CIFAR-shaped data, `precision = ...`);
  (b) PyTorch: the same loop in a fresh Python process:

          for each micro-batch:
              with torch.autocast("cpu", dtype=torch.bfloat16):   # bf16 only
                  loss = cross_entropy(model(x), y)
              (loss / k).backward()
              every k micro-batches: clip_grad_norm_(1.0); SGD step; zero_grad

Both: torchvision's ResNet (torch_reference.build), SGD(lr 0.05, momentum
0.9, weight decay 1e-4), the same b, k, number of steps and intra-op
threads. Throughput as in engine_vs_pytorch.py: the end time of each step
(accrue: when its JSON line is read), samples of the steps after --warmup
over the time since the end of the warm-up. Peak memory: the process's
maximum resident set size (accrue: ru_maxrss from wait4, so it includes
the final checkpoint; PyTorch: its own ru_maxrss after the last step).

  .venv/bin/python worker/benches/amp_vs_pytorch.py \\
      --binary target/release/accrue-worker [--models resnet18,resnet34] \\
      [--batches 128,256] [--k 4] [--steps 4] [--warmup 1] [--threads 2] \\
      [--precisions fp32,bf16]

Prints a Markdown table.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "reference"))

LR, MOMENTUM, WEIGHT_DECAY, MAX_NORM, CLASSES = 0.05, 0.9, 1e-4, 1.0, 10


def job(model, b, k, steps, precision, device="cpu", extra=""):
    """The benchmark's job spec (`extra`: TOML tables appended)."""
    return f"""precision = "{precision}"
name = "amp-bench"
seed = 0
max_steps = {steps}
device = "{device}"
[model]
kind = "{model}"
num_classes = {CLASSES}
[data]
kind = "synthetic"
samples = {b * k * steps}
eval_samples = 0
shape = [3, 32, 32]
classes = {CLASSES}
batch_size = {b}
[accumulation]
steps = {k}
normalize = "mean"
[clipping]
max_norm = {MAX_NORM}
[optimizer]
kind = "sgd"
lr = {LR}
momentum = {MOMENTUM}
weight_decay = {WEIGHT_DECAY}
{extra}"""


def wait_rss(proc):
    """Waits for `proc`; (exit code, peak RSS in MB)."""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss / 1024


def run_spec(binary, text, threads, env=None, steps=None, args=()):
    """Runs `accrue-worker train` on the job spec `text` (with `args`
    added); (the time each step's JSON line was read, peak RSS in MB).
    Each step's JSON object is appended to the list `steps` when one is
    given."""
    with tempfile.TemporaryDirectory(prefix="accrue-bench-") as tmp:
        spec = Path(tmp) / "job.toml"
        spec.write_text(text)
        cmd = [binary, "train", str(spec), "--json", "--threads", str(threads),
               "--state-dir", str(Path(tmp) / "state"), *args]
        err = open(Path(tmp) / "stderr", "w")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1,
                                env=env)
        ends = []
        for line in iter(proc.stdout.readline, ""):
            now = time.perf_counter()
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue
            if ev.get("event") == "step":
                ends.append(now)
                if steps is not None:
                    steps.append(ev.get("step", {}))
        rc, rss = wait_rss(proc)
        if rc != 0:
            sys.exit(f"accrue failed ({rc}): {open(Path(tmp) / 'stderr').read()[-2000:]}")
    return ends, rss


def run_accrue(binary, model, b, k, steps, precision, threads):
    return run_spec(binary, job(model, b, k, steps, precision), threads)


def torch_child(cfg):
    import torch
    from torch_reference import build
    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(0)
    b, k, steps = cfg["b"], cfg["k"], cfg["steps"]
    n = b * k * steps
    X = torch.randn(n, 3, 32, 32)
    Y = torch.randint(0, CLASSES, (n,))
    model = build(cfg["model"], 3, 32, 32, CLASSES)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    bf16 = cfg["precision"] == "bf16"
    perm = torch.randperm(n)
    ends = []
    for s in range(steps):
        for m in range(k):
            idx = perm[(s * k + m) * b:(s * k + m + 1) * b]
            x, y = X.index_select(0, idx), Y.index_select(0, idx)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            (loss / k).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=MAX_NORM)
        opt.step()
        opt.zero_grad()
        _ = loss.item(), norm.item()
        ends.append(time.perf_counter())
    import resource
    print(json.dumps({"ends": ends, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def run_torch(cfg):
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, __file__, "--_child", json.dumps(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    out, err = proc.communicate()
    if proc.returncode != 0:
        sys.exit(f"PyTorch loop failed: {err[-2000:]}")
    r = json.loads(out.strip().splitlines()[-1])
    return r["ends"], r["rss_mb"]


def rate(ends, samples_per_step, warmup):
    wall = ends[-1] - ends[warmup - 1]
    return samples_per_step * (len(ends) - warmup) / wall


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default="target/release/accrue-worker")
    ap.add_argument("--models", default="resnet18,resnet34")
    ap.add_argument("--batches", default="128,256")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--_child", dest="child")
    a = ap.parse_args()
    if a.child:
        torch_child(json.loads(a.child))
        return
    import torch
    print(f"`{' '.join(sys.argv)}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, k = {a.k}, {a.steps} steps of which {a.warmup} warm-up)\n")
    print("| model | b | precision | accrue samples/s | PyTorch samples/s | accrue / PyTorch "
          "| accrue peak RSS (MB) | PyTorch peak RSS (MB) |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for model in a.models.split(","):
        for b in map(int, a.batches.split(",")):
            for precision in a.precisions.split(","):
                cfg = dict(model=model, b=b, k=a.k, steps=a.steps, precision=precision,
                           threads=a.threads)
                ends, rss = run_accrue(a.binary, model, b, a.k, a.steps, precision, a.threads)
                t_ends, t_rss = run_torch(cfg)
                ra, rt = rate(ends, b * a.k, a.warmup), rate(t_ends, b * a.k, a.warmup)
                print(f"| {model} | {b} | {precision} | {ra:.1f} | {rt:.1f} | {ra / rt:.2f} "
                      f"| {rss:.0f} | {t_rss:.0f} |", flush=True)


if __name__ == "__main__":
    main()
