#!/usr/bin/env python3
"""End to end: `accrue local` against torchrun + DistributedDataParallel with no_sync.

A measurement, not a test: it prints a Markdown block (command, date, CPU,
versions, tables) for docs/BENCHMARKS.md. Both sides run the same training,
one after the other, in this one invocation:

  accrue:   `accrue local JOB.toml --workers W --threads T --json` (an embedded
            coordinator and W `accrue-worker daemon` processes on loopback; the
            ring all-reduce at every k-th micro-step), on a generated spec with
            data.kind = "synthetic";
  PyTorch:  W >= 2: `python -m torch.distributed.run --standalone
            --nproc_per_node W` running this script's DDP loop (gloo backend,
            DistributedDataParallel with its defaults, `with model.no_sync():`
            on the first k-1 micro-steps, loss / k, clip_grad_norm_ on the
            DDP-averaged gradients, SGD step, zero_grad);
            W = 1: the plain PyTorch loop (no process group, no DDP), which is
            what one would run on one worker and the baseline of scaling
            efficiency and of accrue's single-process overhead.

Same model (parameter names and shapes are checked against accrue's final
checkpoint), same per-sample shape, data set size, b, k, SGD settings,
clip_grad_norm_(max_norm=1.0), the same sharding (a seeded permutation per
epoch, rank r takes indices[r::W], as DistributedSampler) and the same intra-op
threads per process (T; torchrun gets OMP_NUM_THREADS=T too). accrue runs with
its default normalize = "global_count", which equals DDP's loss / k averaged
over ranks for full micro-batches (the data set size is a multiple of W*b*k).

Measured (identically on both sides, on rank 0): the wall-clock time at which
each optimizer step ended (accrue: when this script reads the step's JSON line,
which the coordinator forwards from rank 0; PyTorch: perf_counter after
zero_grad and reading the loss and the norm, as accrue reports both). The
first --warmup steps are left out; samples/s = global samples of the remaining
steps / their wall time. Phase split per optimizer step:
  accrue: the step report's timing (compute = the k forward/backward passes;
          comm = the all-reduce of the gradient buckets and counts; clip =
          normalization, norm and clip; optimizer = SGD step and zeroing);
  PyTorch: compute = the k micro-steps' forward/backward minus the exposed
          communication; comm = the sync micro-step's time minus the mean
          no_sync micro-step (DDP all-reduces inside the sync backward, so the
          exposed part is what it adds; not separable for k = 1, shown as
          "incl."); clip; optimizer (step + zero_grad).
Bytes: accrue's own byte counters per step (rank 0, framing included) against
the ring optimum 2(W-1)/W x gradient bytes; and for both sides the loopback
interface's transmitted bytes (/proc/net/dev, TCP/IP headers and control
traffic included) over the measured steps, divided by steps and by W.
Scaling efficiency: samples/s with W workers / (W x samples/s with one). As
a ceiling, W plain single-process loops are also started together with no
communication at all; their summed samples/s / (W x one loop alone) is what W
processes get out of the shared cores, caches and memory of this machine.

Usage (what `make bench` runs):
    .venv/bin/python worker/benches/e2e_vs_ddp.py --accrue target/release/accrue
"""

from __future__ import annotations

import argparse
import contextlib
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_vs_pytorch import (  # noqa: E402  (same folder)
    build_torch_model as build_small_model, checkpoint_shapes, cpu_model, git_rev,
)

REPO = Path(__file__).resolve().parents[2]
LR, MOMENTUM, WEIGHT_DECAY, MAX_NORM = 0.05, 0.9, 1e-4, 1.0
CLASSES = 10
SEED = 0

# name -> model kind, per-sample shape, micro-batch b, steps per run, data set size
MODELS = {
    "lenet5": dict(model="lenet5", hidden=[], shape=[1, 28, 28], b=32, steps=60,
                   samples=16384, label="LeNet-5, MNIST-shaped 1x28x28"),
    "resnet18": dict(model="resnet18", hidden=[], shape=[3, 32, 32], b=16, steps=14,
                     samples=2048, label="ResNet-18, CIFAR-shaped 3x32x32"),
}


# --------------------------------------------------------------------------
# models (torchvision parameter names for ResNet-18)
# --------------------------------------------------------------------------

def build_torch_model(cfg):
    if cfg["model"] != "resnet18":
        return build_small_model(cfg)
    from torch import nn

    class BasicBlock(nn.Module):
        def __init__(self, c_in, c_out, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(c_out)
            self.relu = nn.ReLU(inplace=True)
            self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(c_out)
            self.downsample = None
            if stride != 1 or c_in != c_out:
                self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                                nn.BatchNorm2d(c_out))

        def forward(self, x):
            y = self.relu(self.bn1(self.conv1(x)))
            y = self.bn2(self.conv2(y))
            s = x if self.downsample is None else self.downsample(x)
            return self.relu(y + s)

    class ResNet18(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(64)
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            self.layer1 = nn.Sequential(BasicBlock(64, 64, 1), BasicBlock(64, 64, 1))
            self.layer2 = nn.Sequential(BasicBlock(64, 128, 2), BasicBlock(128, 128, 1))
            self.layer3 = nn.Sequential(BasicBlock(128, 256, 2), BasicBlock(256, 256, 1))
            self.layer4 = nn.Sequential(BasicBlock(256, 512, 2), BasicBlock(512, 512, 1))
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(512, CLASSES)

        def forward(self, x):
            import torch
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(torch.flatten(self.avgpool(x), 1))

    return ResNet18()


# --------------------------------------------------------------------------
# loopback byte counter
# --------------------------------------------------------------------------

def lo_tx_bytes():
    try:
        for line in Path("/proc/net/dev").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])
    except (OSError, ValueError, IndexError):
        pass
    return None


# --------------------------------------------------------------------------
# the PyTorch side (runs in torchrun's children, or alone for W = 1)
# --------------------------------------------------------------------------

def torch_worker(cfg):
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(cfg["threads"])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(SEED)
    b, k, n, steps = cfg["b"], cfg["k"], cfg["samples"], cfg["steps"]
    X = torch.randn(n, *cfg["shape"])
    Y = torch.randint(0, CLASSES, (n,))
    model = build_torch_model(cfg)
    model.train()
    ddp = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM,
                                weight_decay=WEIGHT_DECAY)
    per_rank = n // world
    micro_per_epoch = per_rank // b  # n is a multiple of W*b*k

    perf = time.perf_counter
    out = {"step_end": [], "samples": [], "compute_s": [], "comm_s": [], "clip_s": [],
           "optimizer_s": [], "lo_tx": []}
    micro = 0
    epoch = -1
    idx_rank = None
    for step in range(steps):
        t_window = perf()
        micro_times = []
        window_loss = None
        for j in range(k):
            m = micro % micro_per_epoch
            if m == 0:
                epoch += 1
                g = torch.Generator().manual_seed(SEED + epoch)
                idx_rank = torch.randperm(n, generator=g)[rank::world]
            idx = idx_rank[m * b:(m + 1) * b]
            x = X.index_select(0, idx)
            y = Y.index_select(0, idx)
            sync = j == k - 1
            ctx = ddp.no_sync() if (world > 1 and not sync) else contextlib.nullcontext()
            t0 = perf()
            with ctx:
                loss = criterion(ddp(x), y) / k
                loss.backward()
            micro_times.append(perf() - t0)
            window_loss = loss.detach() if window_loss is None else window_loss + loss.detach()
            micro += 1
        t1 = perf()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=MAX_NORM)
        t2 = perf()
        optimizer.step()
        optimizer.zero_grad()
        t3 = perf()
        _ = window_loss.item(), norm.item()
        t4 = perf()
        if world > 1 and k > 1:
            comm = max(0.0, micro_times[-1] - statistics.fmean(micro_times[:-1]))
        else:
            comm = None
        out["step_end"].append(t4)
        out["samples"].append(b * k * world)
        out["compute_s"].append((t1 - t_window) - (comm or 0.0))
        out["comm_s"].append(comm)
        out["clip_s"].append(t2 - t1)
        out["optimizer_s"].append(t3 - t2)
        out["lo_tx"].append(lo_tx_bytes() if rank == 0 else None)
    if rank == 0:
        Path(cfg["out"]).write_text(json.dumps(out))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def run_independent(cfg, world):
    """W plain single-process loops started together, no communication at
    all: what W processes get out of this machine's cores, memory and cache
    when they share it (the ceiling of any scaling measured here)."""
    with tempfile.TemporaryDirectory(prefix="accrue-solo-") as tmp:
        me = str(Path(__file__).resolve())
        env = dict(os.environ, OMP_NUM_THREADS=str(cfg["threads"]))
        env.setdefault("OPENBLAS_NUM_THREADS", "1")
        procs, outs = [], []
        for i in range(world):
            c = dict(cfg, out=str(Path(tmp) / f"out-{i}.json"))
            outs.append(Path(c["out"]))
            procs.append(subprocess.Popen([sys.executable, me, "--_pytorch-worker", json.dumps(c)],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, env=env))
        for p in procs:
            _, err = p.communicate()
            if p.returncode != 0:
                sys.exit(f"independent PyTorch loop failed ({cfg['name']}):\n{err}")
        return [json.loads(o.read_text()) for o in outs]


def run_torch(cfg, world):
    with tempfile.TemporaryDirectory(prefix="accrue-ddp-") as tmp:
        c = dict(cfg, out=str(Path(tmp) / "out.json"))
        me = str(Path(__file__).resolve())
        if world == 1:
            cmd = [sys.executable, me, "--_pytorch-worker", json.dumps(c)]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nnodes", "1", "--nproc_per_node", str(world),
                   me, "--_pytorch-worker", json.dumps(c)]
        env = dict(os.environ, OMP_NUM_THREADS=str(cfg["threads"]))
        env.setdefault("OPENBLAS_NUM_THREADS", "1")
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if p.returncode != 0:
            sys.exit(f"PyTorch run failed ({cfg['name']}, W={world}, k={cfg['k']}):\n"
                     f"  {shlex.join(cmd)}\n{p.stdout}\n{p.stderr}")
        return json.loads(Path(c["out"]).read_text())


# --------------------------------------------------------------------------
# the accrue side
# --------------------------------------------------------------------------

def job_toml(cfg, world):
    shape = ", ".join(str(s) for s in cfg["shape"])
    return f"""\
# Generated by worker/benches/e2e_vs_ddp.py
name = "bench-{cfg['name']}-w{world}-k{cfg['k']}"
workers = {world}
seed = {SEED}
max_steps = {cfg['steps']}
device = "cpu"

[model]
kind = "{cfg['model']}"
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


def run_accrue(binary, cfg, world):
    with tempfile.TemporaryDirectory(prefix="accrue-e2e-") as tmp:
        job = Path(tmp) / "job.toml"
        job.write_text(job_toml(cfg, world))
        state = Path(tmp) / "state"
        cmd = [str(binary), "local", str(job), "--workers", str(world), "--threads",
               str(cfg["threads"]), "--state-dir", str(state), "--json"]
        err_path = Path(tmp) / "stderr.txt"
        env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "warn"))
        with open(err_path, "w") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                    bufsize=1, env=env)
            step_end, reports, lo = [], [], []
            for line in iter(proc.stdout.readline, ""):
                now = time.perf_counter()
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if event.get("event") == "step":
                    step_end.append(now)
                    lo.append(lo_tx_bytes())
                    reports.append(event)
            rc = proc.wait()
        if rc != 0 or len(reports) != cfg["steps"]:
            logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}"
                             for p in sorted((state / "logs").glob("*.log")))
            sys.exit(f"accrue failed (exit {rc}, {len(reports)} of {cfg['steps']} steps) on "
                     f"{cfg['name']} W={world} k={cfg['k']}:\n  {shlex.join(cmd)}\n"
                     f"{err_path.read_text()[-3000:]}\n{logs}")
        shapes = checkpoint_shapes(state)
    return {
        "step_end": step_end,
        "samples": [r["samples"] for r in reports],
        "compute_s": [r["timing"]["compute_s"] for r in reports],
        "comm_s": [r["timing"]["comm_s"] for r in reports],
        "clip_s": [r["timing"]["clip_s"] for r in reports],
        "optimizer_s": [r["timing"]["optimizer_s"] for r in reports],
        "bytes_sent": [r["bytes_sent"] for r in reports],
        "lo_tx": lo,
        "param_shapes": shapes,
    }


# --------------------------------------------------------------------------
# summary
# --------------------------------------------------------------------------

def summarize(run, warmup, world):
    t = run["step_end"]
    steps = len(t) - warmup
    wall = t[-1] - t[warmup - 1]
    n = sum(run["samples"][warmup:])
    s = {"rate": n / wall, "step_ms": 1e3 * wall / steps, "samples_per_step": n / steps}
    for key in ("compute_s", "comm_s", "clip_s", "optimizer_s"):
        vals = [v for v in run[key][warmup:] if v is not None]
        s[key] = 1e3 * statistics.fmean(vals) if vals else None
    if "bytes_sent" in run:
        s["bytes_sent"] = statistics.fmean(run["bytes_sent"][warmup:])
    lo = run["lo_tx"]
    if lo[warmup - 1] is not None and lo[-1] is not None:
        s["lo_per_rank"] = (lo[-1] - lo[warmup - 1]) / steps / world
    return s


def median_run(summaries):
    ordered = sorted(summaries, key=lambda s: s["rate"])
    return ordered[(len(ordered) - 1) // 2]


def fmt_ms(v):
    return "incl." if v is None else f"{v:.1f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--accrue", default="target/release/accrue",
                    help="the accrue CLI (accrue-worker must sit next to it) (default: %(default)s)")
    ap.add_argument("--models", default=",".join(MODELS),
                    help="comma-separated subset of: " + ", ".join(MODELS))
    ap.add_argument("--ks", default="1,4,8", help="accumulation steps (default: %(default)s)")
    ap.add_argument("--world", type=int, default=2, help="W (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                    help="intra-op threads per process, both sides, every W "
                         "(default: cores / 2 = %(default)s)")
    ap.add_argument("--steps-scale", type=float, default=1.0,
                    help="multiplies each model's optimizer steps per run (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=3,
                    help="leading optimizer steps left out (default: %(default)s)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs per side and setting; the median is reported (default: %(default)s)")
    ap.add_argument("--_pytorch-worker", dest="pytorch_worker", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.pytorch_worker:
        torch_worker(json.loads(args.pytorch_worker))
        return

    binary = Path(args.accrue)
    if not binary.is_absolute():
        binary = (Path.cwd() / binary) if (Path.cwd() / binary).exists() else REPO / binary
    if not binary.is_file() or not binary.with_name("accrue-worker").is_file():
        sys.exit(f"need {binary} and accrue-worker next to it "
                 "(cargo build --release -p accrue -p accrue-worker)")
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        sys.exit(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    ks = [int(k) for k in args.ks.split(",") if k.strip()]
    if args.world < 2 or any(k < 1 for k in ks) or args.warmup < 1:
        sys.exit("--world must be >= 2, every k >= 1 and --warmup >= 1")

    import torch

    command = shlex.join([os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd())
                          else sys.executable] + sys.argv)
    started = _dt.datetime.now(_dt.timezone.utc).astimezone()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    W = args.world
    results = {}  # (model, k, side, world) -> summary
    checked = set()
    for name in names:
        base = MODELS[name]
        steps = max(args.warmup + 2, int(round(base["steps"] * args.steps_scale)))
        for k in ks:
            window = W * base["b"] * k
            samples = max(window, base["samples"] // window * window)
            cfg = dict(base, name=name, k=k, steps=steps, samples=samples, threads=args.threads)
            # Repeats are interleaved (accrue, PyTorch, accrue, ... for each
            # W, then the independent loops), so a slow spell of a shared
            # machine falls on both sides rather than on one side's runs.
            runs = {}
            for _ in range(args.repeat):
                for world in (1, W):
                    for side in ("accrue", "torch"):
                        if side == "accrue":
                            run = run_accrue(binary, cfg, world)
                            if name not in checked:
                                ours = {kk: list(v.shape)
                                        for kk, v in build_torch_model(cfg).state_dict().items()
                                        if not kk.endswith("num_batches_tracked")}
                                theirs = {kk: v for kk, v in (run["param_shapes"] or {}).items()
                                          if not kk.endswith("num_batches_tracked")}
                                if ours != theirs:
                                    sys.exit(f"{name}: accrue's model differs from the PyTorch one:\n"
                                             f"  accrue: {theirs}\n  PyTorch: {ours}")
                                checked.add(name)
                        else:
                            run = run_torch(cfg, world)
                        s = summarize(run, args.warmup, world)
                        runs.setdefault((side, world), []).append(s)
                        print(f"[{name} k={k} W={world}] {side}: {s['rate']:.1f} samples/s, "
                              f"{s['step_ms']:.1f} ms/step", file=sys.stderr, flush=True)
                solo = [summarize(r, args.warmup, 1) for r in run_independent(cfg, W)]
                runs.setdefault(("solo", W), []).append({"rate": sum(x["rate"] for x in solo)})
                print(f"[{name} k={k}] {W} independent plain loops: "
                      f"{runs[('solo', W)][-1]['rate']:.1f} samples/s together",
                      file=sys.stderr, flush=True)
            for (side, world), rs in runs.items():
                results[(name, k, side, world)] = median_run(rs)
            # Ratios within each repeat (runs minutes apart at most), then
            # their median: steadier than a ratio of medians when the speed
            # of a shared machine drifts between repeats.
            a1, a2 = runs[("accrue", 1)], runs[("accrue", W)]
            p1, p2 = runs[("torch", 1)], runs[("torch", W)]
            so = runs[("solo", W)]
            vs_ddp = [a["rate"] / p["rate"] for a, p in zip(a2, p2)]
            scaling = [b["rate"] / (W * a["rate"]) for a, b in zip(a1, a2)]
            results[(name, k, "paired")] = {
                "vs_ddp": statistics.median(vs_ddp),
                "vs_plain": statistics.median([a["rate"] / p["rate"] for a, p in zip(a1, p1)]),
                "scaling": statistics.median(scaling),
                "ddp_scaling": statistics.median([b["rate"] / (W * a["rate"])
                                                  for a, b in zip(p1, p2)]),
                "solo": statistics.median([x["rate"] / (W * p["rate"]) for x, p in zip(so, p1)]),
                "vs_ddp_range": (min(vs_ddp), max(vs_ddp)),
                "scaling_range": (min(scaling), max(scaling)),
            }

    grad_elems = {}
    for name in names:
        grad_elems[name] = sum(p.numel() for p in build_torch_model(MODELS[name]).parameters())

    print(f"### accrue local vs torchrun DDP + no_sync ({started:%Y-%m-%d})")
    print()
    print(f"- command: `{command}`")
    print(f"- date: {started:%Y-%m-%d %H:%M %Z}; CPU: {cpu_model()} ({os.cpu_count()} logical CPUs)"
          + (f", load average at start {load:.2f}" if load is not None else ""))
    print(f"- torch {torch.__version__} (Python {platform.python_version()}), gloo; "
          f"accrue `{args.accrue}`, workspace {git_rev()}")
    print(f"- W = {W} processes on this machine, {args.threads} intra-op thread(s) per process "
          f"on both sides and for W = 1; synthetic data; SGD lr {LR} momentum {MOMENTUM} "
          f"weight_decay {WEIGHT_DECAY}; clip_grad_norm {MAX_NORM}; first {args.warmup} steps "
          f"left out; median of {args.repeat} run(s)")
    for name in names:
        m = MODELS[name]
        steps = max(args.warmup + 2, int(round(m["steps"] * args.steps_scale)))
        print(f"- {m['label']}: b = {m['b']} per worker, {steps} optimizer steps per run, "
              f"{grad_elems[name]:,} parameters ({4 * grad_elems[name] / 2**20:.2f} MiB of gradients)")
    print()
    print("Throughput (global samples/s) and scaling efficiency "
          f"(W = {W} against {W} x one worker):")
    print()
    print(f"| model | k | accrue W={W} | DDP W={W} | accrue / DDP | accrue W=1 | plain loop W=1 "
          f"| accrue / plain (W=1) | accrue scaling | DDP scaling | {W} independent loops |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in names:
        for k in ks:
            a2 = results[(name, k, "accrue", W)]["rate"]
            p2 = results[(name, k, "torch", W)]["rate"]
            a1 = results[(name, k, "accrue", 1)]["rate"]
            p1 = results[(name, k, "torch", 1)]["rate"]
            r = results[(name, k, "paired")]
            rng = lambda lo_hi: (f" ({lo_hi[0]:.2f}–{lo_hi[1]:.2f})"  # noqa: E731
                                 if args.repeat > 1 else "")
            print(f"| {name} | {k} | {a2:,.1f} | {p2:,.1f} | {r['vs_ddp']:.2f}{rng(r['vs_ddp_range'])} | "
                  f"{a1:,.1f} | {p1:,.1f} | {r['vs_plain']:.2f} | "
                  f"{r['scaling']:.2f}{rng(r['scaling_range'])} | {r['ddp_scaling']:.2f} | "
                  f"{r['solo']:.2f} |")
    print()
    print("samples/s: median of the runs. Ratios: the ratio within each repeat (both runs "
          "taken minutes apart at most, sides interleaved), then the median over repeats; "
          "in parentheses the lowest and highest of those ratios.")
    print()
    print(f"Scaling = samples/s at W = {W} / ({W} x the same side at W = 1). The last column is "
          f"the same ratio for {W} plain loops started together with no communication at all "
          f"(summed samples/s / ({W} x one plain loop alone)): how much of the machine {W} "
          f"processes get when they share it, the ceiling of either side's scaling here.")
    print()
    print(f"Per optimizer step at W = {W} (ms, rank 0; other = wall - phases):")
    print()
    print("| model | k | side | wall | compute | comm | clip | optimizer | other |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for name in names:
        for k in ks:
            for side, label in (("accrue", "accrue"), ("torch", "DDP")):
                s = results[(name, k, side, W)]
                phases = sum(v for v in (s["compute_s"], s["comm_s"], s["clip_s"],
                                         s["optimizer_s"]) if v is not None)
                print(f"| {name} | {k} | {label} | {s['step_ms']:.1f} | {s['compute_s']:.1f} | "
                      f"{fmt_ms(s['comm_s'])} | {s['clip_s']:.2f} | {s['optimizer_s']:.2f} | "
                      f"{s['step_ms'] - phases:.1f} |")
    print()
    print(f"Bytes per optimizer step and rank at W = {W} (ring optimum = 2(W-1)/W x gradient bytes):")
    print()
    print("| model | k | gradient bytes | ring optimum | accrue counter | accrue / optimum "
          "| accrue bytes/sample | vs k=1 per sample | accrue loopback | DDP loopback |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in names:
        gb = 4 * grad_elems[name]
        opt = 2 * (W - 1) / W * gb
        first = None
        for k in ks:
            s = results[(name, k, "accrue", W)]
            d = results[(name, k, "torch", W)]
            per_sample = s["bytes_sent"] * W / s["samples_per_step"]
            if first is None:
                first = (k, per_sample)
            red = f"{first[1] / per_sample:.2f}x fewer" if k != first[0] else "–"
            lo_a = f"{s['lo_per_rank']:,.0f}" if "lo_per_rank" in s else "–"
            lo_d = f"{d['lo_per_rank']:,.0f}" if "lo_per_rank" in d else "–"
            print(f"| {name} | {k} | {gb:,} | {opt:,.0f} | {s['bytes_sent']:,.0f} | "
                  f"{s['bytes_sent'] / opt:.4f} | {per_sample:,.0f} | {red} | {lo_a} | {lo_d} |")


if __name__ == "__main__":
    main()
