#!/usr/bin/env python3
"""Causal LM training: `accrue local` against torchrun + DDP + no_sync with
transformers' LlamaForCausalLM (issue 30, "Measured"; docs/BENCHMARKS.md).

A measurement, not a test: it prints a Markdown block (command, date, CPU,
versions, table) for docs/BENCHMARKS.md.

Setting: CPU, W = 2 processes, k = 4 micro-batches a window, one intra-op
thread a rank on both sides (accrue: `threads = 1` in the job and
`--threads 1`; torchrun: OMP_NUM_THREADS=1 and torch.set_num_threads(1)).
Both sides get the same thread environment, OMP_NUM_THREADS = 1 (what
torchrun sets for its children by itself), OPENBLAS_NUM_THREADS and
MKL_NUM_THREADS = 1; `--accrue-omp-env unset` runs accrue without them, as
`accrue local` runs when nobody sets them (accrue-worker sets its one
intra-op thread itself; on the 2-core machine of the smoke run the two made
no measurable difference).
Models: Llama (Hugging Face layout) of L = 2 or 4 layers, hidden H = 128 or
256 (H / 64 heads of 64, no GQA, intermediate 8H/3 rounded up to 64 = 384
or 704, vocab 4,096, untied lm_head, RMSNorm eps 1e-6, RoPE theta 10,000,
SDPA attention on both sides), T = 64, 128 or 256; micro-batch b = 1024 / T
rows, so every window is W * k * b * T = 8,192 target tokens whatever T.

Data: one synthetic llm.c token file per T (256 x int32 header, magic
20240520 = u16 tokens, version 1, count; uniform random tokens below
4,096), count = n T + 1 with n = W k b * --steps-per-epoch samples, so an
epoch is exactly --steps-per-epoch full windows (sample j =
tokens[jT : jT + T + 1]). Both sides start from the same initial weights
(transformers' init, seed 0, written once as safetensors; accrue reads it
through `model.init`) and walk the same windows: accrue's sampler with
`shuffle = true, seed = 0` is DistributedSampler(shuffle=True, seed=0) with
set_epoch (torch's randperm of seed + epoch, rank r takes [r::W]), and rank
r's micro-batch m is its samples [m b, (m + 1) b). The per-step gradient
norms of both sides are compared (column "max |Δ norm|", relative): equal
windows, weights and normalization give the same norms up to float
rounding.

Training on both sides: loss normalized by the window's global target
count (accrue: normalize = "global_count", N riding the sync step's
reduction; DDP: Hugging Face Trainer's CE_sum * W / N_global per rank, N
all-reduced once per window before its micro-batches, then DDP's average),
`no_sync()` on the first k - 1 micro-batches, clip_grad_norm_(max_norm =
1.0), AdamW (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.1,
torch's default implementation), zero_grad. DDP with its defaults (gloo,
25 MB buckets). Rank 0 of DDP reads the norm and its local loss with
.item() every step (accrue reports both every step).

Measured: each side runs 1 epoch and 5 epochs as separate, complete
launches (`accrue local JOB --workers 2 --threads 1 --json` with its
embedded coordinator, throw-away certificates and final checkpoint;
`python -m torch.distributed.run --standalone --nproc-per-node 2` with its
imports of torch and transformers); wall clock from launch to exit.
tokens/s = 4 epochs' target tokens / (t(5 epochs) - t(1 epoch)), so start-up
and shutdown cancel; "start-up" = t(1) - (t(5) - t(1)) / 4, the fixed cost
of a launch. "steady" = tokens/s from the step-end times of the 5-epoch run
after its first epoch (accrue: when this script reads rank 0's step line;
DDP: rank 0's clock after the step), a cross-check. Peak RSS per rank: the
VmHWM of each rank's process (accrue-worker; torchrun's children), polled
every 0.1 s during the 5-epoch run, the last value read before it exits
(so accrue's includes its final checkpoint; DDP's includes the imports of
torch and transformers). With --repeat R the launches are interleaved
(accrue 1, DDP 1, accrue 5, DDP 5, R times) and the median is reported;
accrue / DDP is the median of the per-repeat ratios (range in
parentheses).

Usage (what `make bench-lm` runs):
    .venv/bin/python worker/benches/lm_vs_ddp.py --accrue target/release/accrue
    .venv/bin/python worker/benches/lm_vs_ddp.py --configs L2-H128-T64 --repeat 1
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SEED = 0
W = 2
K = 4
VOCAB = 4096
WINDOW_TOKENS = 8192  # W * k * b * T
LR, BETAS, EPS, WEIGHT_DECAY, MAX_NORM = 1e-3, (0.9, 0.999), 1e-8, 0.1, 1.0
EPOCHS = (1, 5)
# Both sides' environment (torchrun sets OMP_NUM_THREADS=1 for its children
# unless told otherwise; accrue gets the same unless --accrue-omp-env unset).
THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
MAGIC_U16 = 20240520

ALL_CONFIGS = [f"L{layers}-H{hidden}-T{t}"
               for layers in (2, 4) for hidden in (128, 256) for t in (64, 128, 256)]


def parse_config(name):
    m = re.fullmatch(r"L(\d+)-H(\d+)-T(\d+)", name)
    if not m:
        sys.exit(f"bad config {name!r}: want L<layers>-H<hidden>-T<seq_len>, e.g. L2-H128-T64")
    layers, hidden, t = map(int, m.groups())
    if hidden % 64 or (WINDOW_TOKENS // (W * K)) % t:
        sys.exit(f"{name}: hidden must be a multiple of 64 and T divide {WINDOW_TOKENS // (W * K)}")
    return dict(name=name, layers=layers, hidden=hidden, seq_len=t,
                heads=hidden // 64, intermediate=-(-8 * hidden // 3 // 64) * 64,
                b=WINDOW_TOKENS // (W * K * t))


def mflop_per_token(cfg):
    """Training MFLOP per token, estimated: 6 x the matmul parameters
    (layers and lm_head; the embedding is a lookup) + 12 L T H (attention's
    score and value products, forward and backward)."""
    h, i, layers, t = cfg["hidden"], cfg["intermediate"], cfg["layers"], cfg["seq_len"]
    matmul = layers * (4 * h * h + 3 * h * i) + h * VOCAB
    return (6 * matmul + 12 * layers * t * h) / 1e6


def auto_steps_per_epoch(cfg):
    """Windows an epoch, so that the 4 epochs between the two launches are
    about as much work whatever the model: 12 for the smallest (about 5.9
    MFLOP a token: 48 windows, some 30 s on one core a rank), fewer for
    larger ones, at least 4."""
    return max(4, min(12, round(12 * 5.9 / mflop_per_token(cfg))))


def hf_config(cfg):
    return dict(vocab_size=VOCAB, hidden_size=cfg["hidden"],
                intermediate_size=cfg["intermediate"], num_hidden_layers=cfg["layers"],
                num_attention_heads=cfg["heads"], num_key_value_heads=cfg["heads"],
                max_position_embeddings=max(256, cfg["seq_len"]), rms_norm_eps=1e-6,
                rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False,
                mlp_bias=False)


def build_hf(cfg):
    from transformers import LlamaConfig, LlamaForCausalLM
    conf = LlamaConfig(**hf_config(cfg), use_cache=False)
    conf._attn_implementation = "sdpa"
    return LlamaForCausalLM(conf)


# --------------------------------------------------------------------------
# inputs: token files and initial weights
# --------------------------------------------------------------------------

def write_tokens(path, samples, seq_len):
    import numpy as np
    count = samples * seq_len + 1
    header = np.zeros(256, dtype="<i4")
    header[0], header[1], header[2] = MAGIC_U16, 1, count
    rng = np.random.default_rng(SEED + seq_len)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(rng.integers(0, VOCAB, size=count, dtype=np.uint16).astype("<u2").tobytes())
    return count


def write_init(path, cfg):
    import torch
    from safetensors.torch import save_file
    torch.manual_seed(SEED)
    model = build_hf(cfg)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------
# the DDP side (torchrun's children)
# --------------------------------------------------------------------------

def ddp_worker(cfg):
    import resource

    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from safetensors.torch import load_file
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DistributedSampler

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    t, b, k = cfg["seq_len"], cfg["b"], K
    count = cfg["count"]
    tokens = np.memmap(cfg["data"], dtype="<u2", mode="r", offset=1024, shape=(count,))
    n = (count - 1) // t
    model = build_hf(cfg)
    model.load_state_dict(load_file(cfg["init"]))
    model.train()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WEIGHT_DECAY)
    sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True,
                                 seed=SEED)

    def batch(idx):
        rows = np.stack([tokens[j * t: j * t + t + 1] for j in idx]).astype(np.int64)
        rows = torch.from_numpy(rows)
        return rows[:, :-1], rows[:, 1:]

    step_end, norms, losses, phases = [], [], [], []
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        mine = list(sampler)
        micro = [mine[i:i + b] for i in range(0, len(mine), b)]
        for w in range(0, len(micro), k):
            window = [batch(idx) for idx in micro[w:w + k]]
            n_local = torch.tensor(float(sum((y != -100).sum().item() for _, y in window)))
            dist.all_reduce(n_local)
            n_global = n_local.item()
            loss_sum = torch.zeros(())
            t_start = time.perf_counter()
            for i, (x, y) in enumerate(window):
                sync = i + 1 == len(window)
                with contextlib.nullcontext() if sync else ddp.no_sync():
                    logits = ddp(input_ids=x).logits.float()
                    ce = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1),
                                         ignore_index=-100, reduction="sum")
                    (ce * world / n_global).backward()
                loss_sum += ce.detach()
            t_micro = time.perf_counter()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=MAX_NORM)
            t_clip = time.perf_counter()
            opt.step()
            opt.zero_grad()
            t_opt = time.perf_counter()
            phases.append((t_micro - t_start, t_clip - t_micro, t_opt - t_clip))
            norms.append(norm.item())
            losses.append(loss_sum.item() / (n_global / world))
            step_end.append(time.monotonic())
    Path(cfg["out"] + f".rank{rank}").write_text(json.dumps({
        "step_end": step_end, "grad_norm": norms, "local_loss": losses, "phases": phases,
        "ru_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }))
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------
# peak RSS of a process tree's ranks
# --------------------------------------------------------------------------

def _children(pid):
    """Children of every thread of `pid` (a child belongs to the thread
    that forked it)."""
    kids = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return kids
    for task in tasks:
        try:
            kids += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


def _descendants(root):
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        for c in _children(p):
            out.append(c)
            todo.append(c)
    return out


class HwmPoller:
    """Polls the VmHWM of the processes under `root` that `is_rank` picks
    (pid -> cmdline); keeps the last value read per pid."""

    def __init__(self, root, is_rank, interval=0.1):
        self.root, self.is_rank, self.interval = root, is_rank, interval
        self.hwm, self.known = {}, {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            for pid in _descendants(self.root):
                # A negative answer is asked again: a child read between
                # fork and exec still shows its parent's command line.
                if not self.known.get(pid):
                    try:
                        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                        self.known[pid] = self.is_rank(pid, [c.decode(errors="replace") for c in cmd])
                    except OSError:
                        continue
            for pid, yes in self.known.items():
                if yes:
                    try:
                        s = Path(f"/proc/{pid}/status").read_text()
                        self.hwm[pid] = int(re.search(r"VmHWM:\s+(\d+) kB", s).group(1))
                    except (OSError, AttributeError):
                        pass
            self.stop.wait(self.interval)

    def finish(self):
        self.stop.set()
        self.thread.join()
        return [self.hwm[p] / 1024 for p in sorted(self.hwm)]  # MiB, by pid


# --------------------------------------------------------------------------
# one launch of each side
# --------------------------------------------------------------------------

def job_toml(cfg, epochs):
    m = hf_config(cfg)
    return f"""\
# Generated by worker/benches/lm_vs_ddp.py
name = "lm-bench-{cfg['name'].lower()}-e{epochs}"
workers = {W}
seed = {SEED}
epochs = {epochs}
device = "cpu"
threads = 1

[model]
kind = "llama"
vocab_size = {m['vocab_size']}
hidden_size = {m['hidden_size']}
intermediate_size = {m['intermediate_size']}
num_hidden_layers = {m['num_hidden_layers']}
num_attention_heads = {m['num_attention_heads']}
num_key_value_heads = {m['num_key_value_heads']}
max_position_embeddings = {m['max_position_embeddings']}
rms_norm_eps = {m['rms_norm_eps']}
rope_theta = {m['rope_theta']}
tie_word_embeddings = false
init = "{cfg['init']}"

[data]
kind = "tokens"
path = "{cfg['data']}"
seq_len = {cfg['seq_len']}
batch_size = {cfg['b']}
shuffle = true

[accumulation]
steps = {K}
normalize = "global_count"
sync = "boundary"

[clipping]
max_norm = {MAX_NORM}
norm_type = 2.0

[optimizer]
kind = "adamw"
lr = {LR}
betas = [{BETAS[0]}, {BETAS[1]}]
eps = {EPS}
weight_decay = {WEIGHT_DECAY}

[schedule]
kind = "constant"

[checkpoint]
every_steps = 0
keep = 1

[comm]
backend = "{cfg.get('backend', 'auto')}"
"""


def run_accrue(binary, cfg, epochs, tmp):
    d = Path(tempfile.mkdtemp(prefix=f"accrue-e{epochs}-", dir=tmp))
    job = d / "job.toml"
    job.write_text(job_toml(cfg, epochs))
    state = d / "state"
    cmd = [str(binary), "local", str(job), "--workers", str(W), "--threads", "1",
           "--state-dir", str(state), "--json"]
    env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "warn"))
    if cfg["accrue_omp_env"]:
        env.update(THREAD_ENV)
    else:
        for key in THREAD_ENV:
            env.pop(key, None)
    err_path = d / "stderr.txt"
    step_end, norms, tokens, phases = [], [], [], []
    with open(err_path, "w") as err:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1,
                                env=env)
        poll = HwmPoller(proc.pid, lambda pid, cmd: Path(cmd[0]).name == "accrue-worker")
        for line in iter(proc.stdout.readline, ""):
            now = time.monotonic()
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue
            if ev.get("event") == "step":
                r = ev
                step_end.append(now)
                norms.append(r.get("grad_norm"))
                tm = r.get("timing") or {}
                phases.append((tm.get("compute_s", 0.0) + tm.get("comm_s", 0.0),
                               tm.get("clip_s", 0.0), tm.get("optimizer_s", 0.0)))
                tokens.append(r.get("samples"))
        rc = proc.wait()
        wall = time.monotonic() - t0
        rss = poll.finish()
    want = epochs * cfg["steps_per_epoch"]
    if rc != 0 or len(step_end) != want:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}"
                         for p in sorted((state / "logs").glob("*.log")))
        sys.exit(f"accrue failed (exit {rc}, {len(step_end)} of {want} steps) on {cfg['name']}, "
                 f"{epochs} epoch(s):\n  {shlex.join(cmd)}\n{err_path.read_text()[-3000:]}\n{logs}")
    return dict(wall=wall, step_end=step_end, grad_norm=norms, tokens=tokens, rss=rss,
                phases=phases)


def run_ddp(cfg, epochs, tmp):
    d = Path(tempfile.mkdtemp(prefix=f"ddp-e{epochs}-", dir=tmp))
    c = dict(cfg, epochs=epochs, out=str(d / "out.json"))
    me = str(Path(__file__).resolve())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", str(W), me, "--_ddp-worker", json.dumps(c)]
    env = dict(os.environ, **THREAD_ENV, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    log = d / "log.txt"
    with open(log, "w") as f:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        poll = HwmPoller(proc.pid, lambda pid, cmd: "--_ddp-worker" in cmd and pid != proc.pid)
        rc = proc.wait()
        wall = time.monotonic() - t0
        rss = poll.finish()
    if rc != 0:
        sys.exit(f"torchrun failed (exit {rc}) on {cfg['name']}, {epochs} epoch(s):\n"
                 f"  {shlex.join(cmd)}\n{log.read_text()[-5000:]}")
    ranks = [json.loads(Path(c["out"] + f".rank{r}").read_text()) for r in range(W)]
    r0 = ranks[0]
    return dict(wall=wall, step_end=r0["step_end"], grad_norm=r0["grad_norm"],
                tokens=[WINDOW_TOKENS] * len(r0["step_end"]), rss=rss, phases=r0["phases"],
                self_rss=[r["ru_maxrss_kib"] / 1024 for r in ranks])


# --------------------------------------------------------------------------
# summary
# --------------------------------------------------------------------------

def summarize(one, five, cfg):
    e1, e5 = EPOCHS
    epoch_tokens = cfg["samples"] * cfg["seq_len"]
    diff = five["wall"] - one["wall"]
    rate = (e5 - e1) * epoch_tokens / diff if diff > 0 else float("nan")
    spe = cfg["steps_per_epoch"]
    t = five["step_end"]
    steady = spe * (e5 - 1) * WINDOW_TOKENS / (t[-1] - t[spe - 1])
    startup = one["wall"] - diff / (e5 - e1)
    after = five["phases"][spe:]
    phases = [1e3 * statistics.fmean(p[i] for p in after) for i in range(3)]
    step_ms = 1e3 * (t[-1] - t[spe - 1]) / (len(t) - spe)
    return dict(rate=rate, steady=steady, startup=startup, wall1=one["wall"], wall5=five["wall"],
                rss=five["rss"], phases=phases, step_ms=step_ms)


def norm_diff(a, b):
    worst = 0.0
    for x, y in zip(a["grad_norm"], b["grad_norm"]):
        if x is None or y is None:
            return float("nan")
        worst = max(worst, abs(x - y) / max(abs(y), 1e-12))
    return worst


def cpu_model():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def git_rev():
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                             capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except OSError:
        return "unknown"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--accrue", default="target/release/accrue",
                    help="the accrue CLI (accrue-worker must sit next to it) (default: %(default)s)")
    ap.add_argument("--configs", default=",".join(ALL_CONFIGS),
                    help="comma-separated L<layers>-H<hidden>-T<seq_len> (default: all 12: "
                         "L2/L4 x H128/H256 x T64/128/256)")
    ap.add_argument("--steps-per-epoch", default="auto",
                    help="optimizer steps (windows of 8,192 tokens) per epoch, every config; "
                         "the 1- and 5-epoch runs differ by 4x this many steps (default: "
                         "auto: 12 for the smallest model, fewer for larger ones down to 4)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="launch pairs per side and config; medians reported (default: %(default)s)")
    ap.add_argument("--accrue-omp-env", choices=("1", "unset"), default="1",
                    help="1: accrue's processes get OMP_NUM_THREADS=1 (and OpenBLAS/MKL = 1) "
                         "as torchrun's children do; unset: they get none of these, as "
                         "`accrue local` runs by default (its workers still get threads = 1) "
                         "(default: %(default)s)")
    ap.add_argument("--backend", choices=("auto", "ring", "c10d"), default="auto",
                    help="accrue's [comm] backend: the ring or libtorch's gloo for the "
                         "gradients (default: %(default)s, the ring on the CPU)")
    ap.add_argument("--_ddp-worker", dest="ddp_worker", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.ddp_worker:
        ddp_worker(json.loads(args.ddp_worker))
        return

    binary = Path(args.accrue)
    if not binary.is_absolute():
        binary = (Path.cwd() / binary) if (Path.cwd() / binary).exists() else REPO / binary
    if not binary.is_file() or not binary.with_name("accrue-worker").is_file():
        sys.exit(f"need {binary} and accrue-worker next to it "
                 "(cargo build --release -p accrue -p accrue-worker)")
    cfgs = [parse_config(c.strip()) for c in args.configs.split(",") if c.strip()]
    if args.steps_per_epoch != "auto" and not (args.steps_per_epoch.isdigit()
                                                and int(args.steps_per_epoch) >= 1):
        sys.exit("--steps-per-epoch must be auto or an integer >= 1")
    if args.repeat < 1:
        sys.exit("--repeat must be >= 1")

    import torch
    import transformers

    command = shlex.join([os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd())
                          else sys.executable] + sys.argv)
    started = _dt.datetime.now(_dt.timezone.utc)
    load = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="accrue-lm-bench-") as tmp:
        tmp = Path(tmp)
        data_files, inits = {}, {}
        for cfg in cfgs:
            spe = (auto_steps_per_epoch(cfg) if args.steps_per_epoch == "auto"
                   else int(args.steps_per_epoch))
            cfg["steps_per_epoch"] = spe
            cfg["accrue_omp_env"] = args.accrue_omp_env == "1"
            cfg["backend"] = args.backend
            cfg["samples"] = W * K * cfg["b"] * spe
            t = cfg["seq_len"]
            if (t, spe) not in data_files:
                path = tmp / f"tokens-T{t}-{spe}.bin"
                data_files[(t, spe)] = (str(path), write_tokens(path, cfg["samples"], t))
            cfg["data"], cfg["count"] = data_files[(t, spe)]
            mkey = (cfg["layers"], cfg["hidden"])
            if mkey not in inits:
                path = tmp / f"init-L{mkey[0]}-H{mkey[1]}.safetensors"
                inits[mkey] = (str(path), write_init(path, cfg))
            cfg["init"], cfg["params"] = inits[mkey]

        for cfg in cfgs:
            runs = {"accrue": [], "ddp": []}
            for rep in range(args.repeat):
                got = {}
                for epochs in EPOCHS:
                    for side in ("accrue", "ddp"):
                        run = (run_accrue(binary, cfg, epochs, tmp) if side == "accrue"
                               else run_ddp(cfg, epochs, tmp))
                        got[(side, epochs)] = run
                        print(f"[{cfg['name']} rep {rep + 1}] {side} {epochs} epoch(s): "
                              f"{run['wall']:.2f} s", file=sys.stderr, flush=True)
                for side in ("accrue", "ddp"):
                    runs[side].append(summarize(got[(side, 1)], got[(side, 5)], cfg))
                nd = max(norm_diff(got[("accrue", e)], got[("ddp", e)]) for e in EPOCHS)
                runs.setdefault("norm_diff", []).append(nd)
                runs.setdefault("ddp_self_rss", []).append(got[("ddp", 5)]["self_rss"])
                a, p = runs["accrue"][-1], runs["ddp"][-1]
                print(f"[{cfg['name']} rep {rep + 1}] accrue {a['rate']:,.0f} tok/s "
                      f"(steady {a['steady']:,.0f}), DDP {p['rate']:,.0f} tok/s "
                      f"(steady {p['steady']:,.0f}), ratio {a['rate'] / p['rate']:.3f}, "
                      f"max rel. grad-norm diff {nd:.1e}", file=sys.stderr, flush=True)
                if not nd <= 1e-3:
                    print(f"WARNING: {cfg['name']}: grad norms differ by {nd:.1e} (relative): "
                          "the two sides may not train the same windows", file=sys.stderr)
            rows.append((cfg, runs))

    def med(xs):
        return statistics.median(xs)

    print(f"### Causal LM: accrue local vs torchrun DDP + no_sync, transformers' Llama "
          f"({started:%Y-%m-%d})")
    print()
    print(f"- command: `{command}`")
    print(f"- date: {started:%Y-%m-%d %H:%M} UTC; CPU: {cpu_model()} ({os.cpu_count()} logical "
          f"CPUs), load average at start {load:.2f}")
    print(f"- torch {torch.__version__}, transformers {transformers.__version__} (Python "
          f"{platform.python_version()}), gloo; accrue `{args.accrue}`, workspace {git_rev()}")
    print(f"- W = {W}, k = {K}, 1 intra-op thread a rank on both sides (OMP_NUM_THREADS=1 "
          f"for DDP's ranks; for accrue's: "
          f"{'the same' if args.accrue_omp_env == '1' else 'unset'}); b = 1024 / T rows, "
          f"{WINDOW_TOKENS:,} target tokens a window; windows an epoch: column \"steps/epoch\"; "
          f"synthetic uniform tokens, vocab {VOCAB:,}; same initial weights and windows; "
          f"global-count normalization; AdamW lr {LR} wd {WEIGHT_DECAY}; clip {MAX_NORM}; "
          f"1- and 5-epoch launches, median of {args.repeat}")
    print()
    print("| model | T | b | steps/epoch | parameters | accrue tokens/s | DDP tokens/s | accrue / DDP "
          "| accrue steady | DDP steady | start-up accrue / DDP (s) "
          "| peak RSS/rank accrue (MiB) | peak RSS/rank DDP (MiB) | max rel. Δ grad norm |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for cfg, runs in rows:
        a, p = runs["accrue"], runs["ddp"]
        ratios = [x["rate"] / y["rate"] for x, y in zip(a, p)]
        rng = f" ({min(ratios):.2f}–{max(ratios):.2f})" if len(ratios) > 1 else ""
        rss = lambda rs: " / ".join(f"{med([r[i] for r in rs]):.0f}"  # noqa: E731
                                    for i in range(min(len(r) for r in rs)))
        print(f"| L{cfg['layers']} H{cfg['hidden']} | {cfg['seq_len']} | {cfg['b']} | "
              f"{cfg['steps_per_epoch']} | "
              f"{cfg['params'] / 1e6:.2f} M | {med([x['rate'] for x in a]):,.0f} | "
              f"{med([x['rate'] for x in p]):,.0f} | {med(ratios):.2f}{rng} | "
              f"{med([x['steady'] for x in a]):,.0f} | {med([x['steady'] for x in p]):,.0f} | "
              f"{med([x['startup'] for x in a]):.1f} / {med([x['startup'] for x in p]):.1f} | "
              f"{rss([x['rss'] for x in a])} | {rss([x['rss'] for x in p])} | "
              f"{max(runs['norm_diff']):.1e} |")
    print()
    print("tokens/s: target tokens of 4 epochs / (wall(5 epochs) - wall(1 epoch)), each a "
          "complete launch, so start-up and shutdown cancel. accrue / DDP: the ratio within "
          "each repeat, median (range). steady: tokens/s from rank 0's step-end times after "
          "the first epoch of the 5-epoch run. start-up: wall(1 epoch) - one epoch's training "
          "time. Peak RSS: each rank's VmHWM (polled every 0.1 s) of the 5-epoch run, by pid; "
          "DDP's self-reported ru_maxrss per rank: " + "; ".join(
              f"{cfg['name']} " + " / ".join(f"{v:.0f}" for v in runs["ddp_self_rss"][0])
              for cfg, runs in rows) + " MiB. max rel. Δ grad norm: the largest relative "
          "difference between the two sides' per-step gradient norms (same windows, same "
          "initial weights).")
    print()
    print("Per optimizer step (ms, rank 0, 5-epoch run after its first epoch, median run): "
          "micro-steps = the k forward/backward passes with the gradient all-reduce (accrue: "
          "its compute + comm; DDP: all-reduce inside the last backward); other = wall - "
          "phases (data, loss and norm reads, reporting).")
    print()
    print("| model | T | side | wall | micro-steps | clip | optimizer | other |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for cfg, runs in rows:
        for side, label in (("accrue", "accrue"), ("ddp", "DDP")):
            rs = sorted(runs[side], key=lambda x: x["rate"])
            x = rs[(len(rs) - 1) // 2]
            print(f"| L{cfg['layers']} H{cfg['hidden']} | {cfg['seq_len']} | {label} | "
                  f"{x['step_ms']:.0f} | {x['phases'][0]:.0f} | {x['phases'][1]:.1f} | "
                  f"{x['phases'][2]:.1f} | {x['step_ms'] - sum(x['phases']):.0f} |")


if __name__ == "__main__":
    main()
