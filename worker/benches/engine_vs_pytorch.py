#!/usr/bin/env python3
"""Training throughput of the accrue engine against the same plain PyTorch loop.

A measurement, not a test: it prints a Markdown block (command line, date,
CPU, torch version, a table) meant to be pasted into docs/BENCHMARKS.md.

For every configuration it runs, R times each (alternating which goes first):

  (a) accrue:  `accrue-worker train JOB.toml --json --state-dir TMP --threads N`
      on a generated job spec (data.kind = "synthetic"), in a fresh temporary
      state directory per run;
  (b) PyTorch: the idiomatic Python loop, in a fresh Python process (this
      script with a private flag) so both sides start from a clean process:

          for each micro-batch:
              out = model(x); loss = criterion(out, y) / k; loss.backward()
              every k micro-batches:
                  clip_grad_norm_(model.parameters(), max_norm=1.0)
                  optimizer.step(); optimizer.zero_grad()

Both sides use the same model, the same in-memory data set shape and size
(N samples, reshuffled every epoch, micro-batches gathered with index_select),
the same b and k, SGD(lr=0.05, momentum=0.9, weight_decay=1e-4), norm clipping
at 1.0, the same number of intra-op threads and the same number of optimizer
steps. accrue runs with its default `accumulation.normalize = "global_count"`
(per-sample losses summed, gradients divided by the window's sample count at
the sync step), which equals the PyTorch loop's loss/k for full micro-batches
(N is a multiple of b*k, so every window is full). Like accrue's step report,
the PyTorch loop reads the window's loss and the gradient norm once per
optimizer step (one .item() each); nothing is read per micro-step. On CPU,
torch.optim.SGD and clip_grad_norm_ take their per-tensor (non-foreach) paths,
as accrue's optimizer and clipping do. The child sets OPENBLAS_NUM_THREADS=1
(unless set) so numpy's idle OpenBLAS pool, which the loop never uses, does
not compete for cores; torch's own kernels use MKL/oneDNN and the thread
count set by torch.set_num_threads.

How throughput is measured (the same for both sides): the wall-clock time at
which each optimizer step finished is recorded (accrue: when this script reads
the step's JSON line from the worker's stdout, which Rust flushes per line;
PyTorch: time.perf_counter() after zero_grad). The first --warmup steps are
discarded; throughput = samples of steps warmup+1..S / (t[S] - t[warmup])
(1-based step numbers).
Start-up (data generation, model build), the final checkpoint and the final
evaluation therefore never count. The reported number is the median over
--repeat runs. The engine's own figure (samples / window wall time, from the
`samples_per_sec` field, which leaves out the time between windows) and the
per-phase timing fields are printed in a second table for diagnosis.

Usage:
    .venv/bin/python worker/benches/engine_vs_pytorch.py \
        --binary target/release/accrue-worker --threads 1 --steps 200 --repeat 3
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

LR, MOMENTUM, WEIGHT_DECAY, MAX_NORM = 0.05, 0.9, 1e-4, 1.0
CLASSES = 10
SEED = 0

# name -> model kind, hidden widths (mlp), per-sample shape, b, k
CONFIGS = {
    "mlp": dict(model="mlp", hidden=[512, 256], shape=[784], b=32, k=4,
                label="MLP 784-512-256-10"),
    "lenet5": dict(model="lenet5", hidden=[], shape=[1, 28, 28], b=32, k=4,
                   label="LeNet-5 1x28x28"),
    "mlp-small-batch": dict(model="mlp", hidden=[512, 256], shape=[784], b=8, k=8,
                            label="MLP 784-512-256-10, small batches"),
}


# --------------------------------------------------------------------------
# (b) the PyTorch loop, run in a child process
# --------------------------------------------------------------------------

def build_torch_model(cfg):
    import torch
    from torch import nn

    if cfg["model"] == "mlp":
        widths = [int(_prod(cfg["shape"]))] + list(cfg["hidden"]) + [CLASSES]
        layers = []
        for i in range(len(widths) - 1):
            layers.append(nn.Linear(widths[i], widths[i + 1]))
            if i < len(widths) - 2:
                layers.append(nn.ReLU())
        return nn.Sequential(*layers)

    c, h, w = cfg["shape"]
    feat = 16 * (((h // 2) - 4) // 2) * (((w // 2) - 4) // 2)

    class LeNet5(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(c, 6, 5, padding=2)
            self.conv2 = nn.Conv2d(6, 16, 5)
            self.fc1 = nn.Linear(feat, 120)
            self.fc2 = nn.Linear(120, 84)
            self.fc3 = nn.Linear(84, CLASSES)

        def forward(self, x):
            F = torch.nn.functional
            x = F.max_pool2d(F.relu(self.conv1(x)), 2)
            x = F.max_pool2d(F.relu(self.conv2(x)), 2)
            x = torch.flatten(x, 1)
            x = F.relu(self.fc1(x))
            x = F.relu(self.fc2(x))
            return self.fc3(x)

    return LeNet5()


def torch_worker(cfg):
    """Trains cfg["steps"] optimizer steps; prints one JSON object."""
    import torch
    from torch import nn

    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(SEED)
    b, k, n, steps = cfg["b"], cfg["k"], cfg["samples"], cfg["steps"]
    X = torch.randn(n, *cfg["shape"])
    Y = torch.randint(0, CLASSES, (n,))
    model = build_torch_model(cfg)
    model.train()
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM,
                                weight_decay=WEIGHT_DECAY)
    flatten = cfg["model"] == "mlp" and len(cfg["shape"]) > 1
    micro_per_epoch = n // b  # n is a multiple of b*k

    step_end, compute, clip, opt = [], [], [], []
    perf = time.perf_counter
    step = 0
    micro = 0
    perm = None
    window_loss = None
    t_window = perf()
    while step < steps:
        m = micro % micro_per_epoch
        if m == 0:
            perm = torch.randperm(n)
        idx = perm[m * b:(m + 1) * b]
        x = X.index_select(0, idx)
        y = Y.index_select(0, idx)
        if flatten:
            x = x.flatten(1)
        out = model(x)
        loss = criterion(out, y) / k
        loss.backward()
        window_loss = loss.detach() if window_loss is None else window_loss + loss.detach()
        micro += 1
        if micro % k == 0:
            t1 = perf()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=MAX_NORM)
            t2 = perf()
            optimizer.step()
            optimizer.zero_grad()
            t3 = perf()
            # What accrue reports per step: the window's loss and the norm.
            _ = window_loss.item(), norm.item()
            window_loss = None
            t4 = perf()
            step += 1
            step_end.append(t4)
            compute.append(t1 - t_window)
            clip.append(t2 - t1)
            opt.append(t3 - t2)
            t_window = t4
    print(json.dumps({
        "step_end": step_end,
        "samples": [b * k] * steps,
        "compute_s": compute,
        "clip_s": clip,
        "optimizer_s": opt,
    }))


def _prod(xs):
    p = 1
    for x in xs:
        p *= x
    return p


# --------------------------------------------------------------------------
# (a) accrue through the binary
# --------------------------------------------------------------------------

def job_toml(cfg):
    hidden = ", ".join(str(h) for h in cfg["hidden"])
    shape = ", ".join(str(s) for s in cfg["shape"])
    return f"""\
# Generated by worker/benches/engine_vs_pytorch.py
name = "bench-{cfg['name']}"
workers = 1
seed = {SEED}
max_steps = {cfg['steps']}
device = "cpu"

[model]
kind = "{cfg['model']}"
{f'hidden = [{hidden}]' if cfg['hidden'] else ''}
num_classes = {CLASSES}

[data]
kind = "synthetic"
samples = {cfg['samples']}
eval_samples = 0
shape = [{shape}]
classes = {CLASSES}
batch_size = {cfg['b']}
shuffle = true

[accumulation]
steps = {cfg['k']}
normalize = "global_count"
sync = "boundary"

[clipping]
max_norm = {MAX_NORM}
norm_type = 2.0

[optimizer]
kind = "sgd"
lr = {LR}
momentum = {MOMENTUM}
weight_decay = {WEIGHT_DECAY}

[schedule]
kind = "constant"

[checkpoint]
every_steps = 0
keep = 1
"""


def run_accrue(binary, cfg):
    with tempfile.TemporaryDirectory(prefix="accrue-bench-") as tmp:
        job = Path(tmp) / "job.toml"
        job.write_text(job_toml(cfg))
        state = Path(tmp) / "state"  # fresh: accrue refuses a dir with checkpoints
        cmd = [str(binary), "train", str(job), "--json", "--state-dir", str(state),
               "--threads", str(cfg["threads"])]
        err_path = Path(tmp) / "stderr.txt"
        with open(err_path, "w") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err,
                                    text=True, bufsize=1)
            step_end, reports = [], []
            for line in iter(proc.stdout.readline, ""):
                now = time.perf_counter()
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if event.get("event") == "step":
                    step_end.append(now)
                    reports.append(event["step"])
            rc = proc.wait()
        if rc != 0:
            sys.exit(f"accrue-worker failed (exit {rc}) on config {cfg['name']}:\n"
                     f"  {shlex.join(cmd)}\n{err_path.read_text()}\n"
                     f"job spec:\n{job.read_text()}")
        shapes = checkpoint_shapes(state)
    if len(reports) != cfg["steps"]:
        sys.exit(f"accrue-worker reported {len(reports)} steps, expected {cfg['steps']}")
    return {
        "step_end": step_end,
        "samples": [r["samples"] for r in reports],
        "compute_s": [r["timing"]["compute_s"] for r in reports],
        "comm_s": [r["timing"]["comm_s"] for r in reports],
        "clip_s": [r["timing"]["clip_s"] for r in reports],
        "optimizer_s": [r["timing"]["optimizer_s"] for r in reports],
        "self_rate": [r["samples_per_sec"] for r in reports],
        "param_shapes": shapes,
    }


def checkpoint_shapes(state_dir):
    """{name: shape} of the parameters in the run's final checkpoint."""
    from safetensors import safe_open

    files = sorted(Path(state_dir).glob("checkpoints/*/step-*/model.safetensors"))
    if not files:
        return None
    with safe_open(str(files[-1]), framework="numpy") as f:
        return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}


def check_same_model(cfg, accrue_shapes):
    """Both sides must train the same architecture: same names and shapes."""
    ours = {k: list(v.shape) for k, v in build_torch_model(cfg).state_dict().items()}
    if accrue_shapes is None:
        print(f"warning: no accrue checkpoint found for {cfg['name']}; model not compared",
              file=sys.stderr)
    elif accrue_shapes != ours:
        sys.exit(f"config {cfg['name']}: accrue's model differs from the PyTorch one:\n"
                 f"  accrue:  {accrue_shapes}\n  PyTorch: {ours}")


def run_torch(cfg):
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_pytorch-worker",
           json.dumps(cfg)]
    env = dict(os.environ)
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(f"PyTorch loop failed on config {cfg['name']}:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------
# summary
# --------------------------------------------------------------------------

def summarize(run, warmup):
    """Steady-state numbers from one run: steps warmup+1..S (1-based), timed
    from the end of step `warmup` to the end of step S."""
    t = run["step_end"]
    n = sum(run["samples"][warmup:])
    wall = t[-1] - t[warmup - 1]
    steps = len(t) - warmup
    s = {"rate": n / wall, "step_ms": 1e3 * wall / steps}
    for key in ("compute_s", "comm_s", "clip_s", "optimizer_s"):
        if key in run:
            s[key] = 1e3 * statistics.fmean(run[key][warmup:])
    if "self_rate" in run:
        # Engine's own figure: samples / sum of window wall times.
        window_s = sum(sm / r for sm, r in zip(run["samples"][warmup:],
                                               run["self_rate"][warmup:]))
        s["self_rate"] = n / window_s
    return s


def median_run(summaries):
    """The run whose rate is the median (lower median for even R)."""
    ordered = sorted(summaries, key=lambda s: s["rate"])
    return ordered[(len(ordered) - 1) // 2]


def cpu_model():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_rev():
    try:
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", default="target/release/accrue-worker",
                    help="accrue-worker to measure (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads on both sides (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=200,
                    help="optimizer steps per run (default: %(default)s)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs per side and config; the median is reported (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=10,
                    help="leading optimizer steps left out of the timing (default: %(default)s)")
    ap.add_argument("--samples", type=int, default=4096,
                    help="data set size, rounded down to a multiple of b*k (default: %(default)s)")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="comma-separated subset of: " + ", ".join(CONFIGS))
    ap.add_argument("--_pytorch-worker", dest="pytorch_worker", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.pytorch_worker:
        torch_worker(json.loads(args.pytorch_worker))
        return

    binary = Path(args.binary)
    if not binary.is_absolute():
        binary = (Path.cwd() / binary) if (Path.cwd() / binary).exists() else REPO / binary
    if not binary.is_file():
        sys.exit(f"no accrue-worker binary at {binary} (build it: cargo build --release -p accrue-worker)")
    if args.warmup < 1:
        sys.exit("--warmup must be >= 1 (the end of the last warm-up step starts the clock)")
    if args.steps < args.warmup + 2:
        sys.exit(f"--steps ({args.steps}) must be at least --warmup + 2 ({args.warmup + 2})")
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        sys.exit(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")

    import torch  # only for the version line; the loops run in child processes

    exe = sys.executable
    if exe.startswith(os.getcwd() + os.sep):
        exe = os.path.relpath(exe)
    command = shlex.join([exe] + sys.argv)
    started = _dt.datetime.now(_dt.timezone.utc).astimezone()
    load = os.getloadavg() if hasattr(os, "getloadavg") else None

    rows, details = [], []
    for name in names:
        base = CONFIGS[name]
        window = base["b"] * base["k"]
        samples = max(window, args.samples // window * window)
        cfg = dict(base, name=name, threads=args.threads, steps=args.steps, samples=samples)
        acc, pt = [], []
        for r in range(args.repeat):
            order = ("accrue", "torch") if r % 2 == 0 else ("torch", "accrue")
            for side in order:
                if side == "accrue":
                    run = run_accrue(binary, cfg)
                    if not acc:
                        check_same_model(cfg, run["param_shapes"])
                    acc.append(summarize(run, args.warmup))
                else:
                    pt.append(summarize(run_torch(cfg), args.warmup))
                print(f"[{name} run {r + 1}/{args.repeat}] {side}: "
                      f"{(acc if side == 'accrue' else pt)[-1]['rate']:.0f} samples/s",
                      file=sys.stderr, flush=True)
        a_rate = statistics.median(s["rate"] for s in acc)
        p_rate = statistics.median(s["rate"] for s in pt)
        rows.append((base["label"], base["b"], base["k"], args.threads, a_rate, p_rate,
                     min(s["rate"] for s in acc), max(s["rate"] for s in acc),
                     min(s["rate"] for s in pt), max(s["rate"] for s in pt)))
        details.append((name, base["k"], median_run(acc), median_run(pt)))

    debug = "/debug/" in str(binary.resolve())
    print()
    print(f"### accrue engine vs PyTorch loop ({started:%Y-%m-%d})")
    print()
    print(f"- command: `{command}`")
    print(f"- date: {started:%Y-%m-%d %H:%M %Z}")
    print(f"- CPU: {cpu_model()} ({os.cpu_count()} logical CPUs)"
          + (f", load average at start {load[0]:.2f}" if load else ""))
    print(f"- torch {torch.__version__} (Python {platform.python_version()}); "
          f"accrue-worker `{args.binary}`{' (DEBUG build: not representative)' if debug else ''}, "
          f"workspace {git_rev()}")
    print(f"- {args.steps} optimizer steps per run, first {args.warmup} left out, "
          f"median of {args.repeat} runs; synthetic data set of {args.samples} samples "
          f"(rounded down to a multiple of b*k), SGD lr {LR} momentum {MOMENTUM} weight_decay {WEIGHT_DECAY}, "
          f"clip_grad_norm {MAX_NORM}; ratio = accrue / PyTorch")
    print()
    print("| config | b | k | threads | accrue samples/s | PyTorch samples/s | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, b, k, th, a, p, amin, amax, pmin, pmax in rows:
        spread = args.repeat > 1
        a_s = f"{a:,.0f}" + (f" ({amin:,.0f}–{amax:,.0f})" if spread else "")
        p_s = f"{p:,.0f}" + (f" ({pmin:,.0f}–{pmax:,.0f})" if spread else "")
        print(f"| {label} | {b} | {k} | {th} | {a_s} | {p_s} | {a / p:.2f} |")
    if args.repeat > 1:
        print()
        print("Ranges in parentheses: slowest–fastest of the runs.")
    print()
    print("Per optimizer step, median run (ms; accrue: its `timing` fields; "
          "PyTorch: the same phases timed in the loop; other = wall - phases):")
    print()
    print("| config | side | wall/step | compute (k micro-steps) | per micro-step "
          "| clip (+normalize) | optimizer (+zero) | other | self-reported samples/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, k, a, p in details:
        for side, s in (("accrue", a), ("PyTorch", p)):
            phases = s["compute_s"] + s["clip_s"] + s["optimizer_s"] + s.get("comm_s", 0.0)
            other = s["step_ms"] - phases
            self_rate = f"{s['self_rate']:,.0f}" if "self_rate" in s else "–"
            print(f"| {name} | {side} | {s['step_ms']:.2f} | {s['compute_s']:.2f} | "
                  f"{s['compute_s'] / k:.3f} | {s['clip_s']:.3f} | {s['optimizer_s']:.3f} | "
                  f"{other:.3f} | {self_rate} |")


if __name__ == "__main__":
    main()
