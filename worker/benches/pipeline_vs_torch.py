#!/usr/bin/env python3
"""Pipeline parallelism on the CPU: accrue's stages against
torch.distributed.pipelining (issue 40, "Measured"; docs/BENCHMARKS.md).

A measurement, not a test: it prints a Markdown block for
docs/BENCHMARKS.md.

Setting: P processes (one stage each, one intra-op thread each, gloo
point-to-point between stages on both sides), a Llama of the Hugging Face
layout (L layers, hidden H, H / 64 heads, intermediate 8H/3 rounded up to
64, vocab 4,096, untied head, SDPA), T = 64, micro-batch b rows, k
micro-batches a window; the same initial weights (transformers' init,
seed 0; accrue reads them through `model.init`), the same token file
(llm.c format), the same windows in order (accrue: shuffle = false), the
same stage split (layers_per_stage), AdamW (lr 1e-3, weight decay 0.1), no
clipping. PyTorch: pipeline_torch.py under torchrun, Schedule1F1B,
ScheduleGPipe or ScheduleInterleaved1F1B (`--schedule interleaved_1f1b
--stages-per-rank V`: V chunks a rank on both sides, the ideal bubble
(P - 1) / (V k + P - 1)) with scale_grads=False and the summed loss divided by the
window's token count. tokens/s: the median over the steps after the first
two (accrue: each step report's tokens/s, the window's wall time; PyTorch:
rank 0's time between barriers around schedule.step and the optimizer
step). accrue's step reports also give the first stage's bubble (waiting
for the other stage) and transfer time.

Usage:
    .venv/bin/python worker/benches/pipeline_vs_torch.py --worker target/release/accrue-worker
"""

from __future__ import annotations

import argparse
import array
import json
import os
import platform
import random
import socket
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
VOCAB = 4096


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def model_fields(layers, hidden, vocab=VOCAB):
    inter = -(-(8 * hidden // 3) // 64) * 64
    return {
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": hidden // 64,
        "num_key_value_heads": hidden // 64, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    }


def token_file(path, count, vocab=VOCAB):
    """llm.c's token file (a 256 x int32 header, then uint16 ids), drawn
    with Python's own generator so that the GPU machine's Python, which
    may lack numpy, writes it too."""
    rng = random.Random(0)
    header = array.array("i", [20240520, 1, count] + [0] * 253)
    ids = array.array("H", (rng.randrange(vocab) for _ in range(count)))
    if sys.byteorder != "little":
        header.byteswap()
        ids.byteswap()
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(ids.tobytes())


def accrue_job(d, fields, t, b, k, steps, stages, per, schedule, balance=None, init=True, v=1):
    model = "\n".join(f"{key} = {json.dumps(v)}" for key, v in fields.items())
    return f"""
name = "pp-bench"
seed = 0
workers = {stages}
max_steps = {steps}
device = "cpu"
threads = 1
[model]
kind = "llama"
{model}
{f'init = "{d}/init.safetensors"' if init else ""}
[data]
kind = "tokens"
path = "{d}/train.bin"
seq_len = {t}
batch_size = {b}
shuffle = false
[accumulation]
steps = {k}
[optimizer]
kind = "adamw"
lr = 0.001
weight_decay = 0.1
[comm]
timeout_s = 300
connect_timeout_s = 60
""" + (f"""[parallel]
pipeline = {stages}
schedule = "{schedule}"
""" + (f"stages_per_rank = {v}\n" if v > 1 else "") + (f'balance = "{balance}"\n' if balance else f"layers_per_stage = {json.dumps(per)}\n")
    if stages > 1 else "")


def launch(worker, d, text, stages, rss=False):
    """Runs `text` on `stages` processes to the end: rank 0's step
    reports, and (`rss`: the path of GNU time) each process's peak resident
    memory in MiB (GNU time's: a child forked from this Python would
    inherit its high-water mark, torch loaded, across exec)."""
    job = d / "job.toml"
    job.write_text(text)
    (d / "secret").write_text("bench-secret\n")
    peers = ",".join(f"127.0.0.1:{p}" for p in free_ports(stages))
    env = dict(os.environ, OMP_NUM_THREADS="1", RUST_LOG="warn")
    procs = []
    for r in range(stages):
        out = open(d / f"rank{r}.out", "w")
        err = open(d / f"rank{r}.log", "w")
        timed = [rss, "-f", "%M", "-o", str(d / f"rank{r}.rss")] if rss else []
        procs.append(subprocess.Popen(
            timed + [worker, "train", str(job), "--json", "--rank", str(r),
                     "--world-size", str(stages), "--peers", peers,
                     "--secret-file", str(d / "secret"), "--checkpoint-dir", str(d / f"ckpt-{r}")],
            stdout=out, stderr=err, env=env))
    for r, p in enumerate(procs):
        if p.wait(timeout=3600) != 0:
            sys.exit(f"accrue rank {r} failed:\n{(d / f'rank{r}.log').read_text()[-3000:]}")
    lines = [json.loads(line) for line in (d / "rank0.out").read_text().splitlines()
             if line.startswith("{")]
    steps = [e["step"] for e in lines if e.get("event") == "step"]
    peaks = [int((d / f"rank{r}.rss").read_text().split()[-1]) / 1024
             for r in range(stages)] if rss else None
    return steps, peaks


def run_accrue(worker, d, text, stages):
    steps, _ = launch(worker, d, text, stages)
    rates = [s["samples_per_sec"] for s in steps[2:]]
    bubble = [s["timing"]["bubble_s"] / (s["samples"] / s["samples_per_sec"]) for s in steps[2:]]
    return statistics.median(rates), statistics.median(bubble)


def run_torch(d, cfg, stages):
    path = d / "torch.json"
    path.write_text(json.dumps(cfg))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(stages), str(HERE / "pipeline_torch.py"), str(path)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    if r.returncode != 0:
        sys.exit(f"torchrun failed:\n{r.stderr[-3000:]}")
    times = json.loads(Path(cfg["out"]).read_text())["times"]
    tokens = cfg["batch"] * cfg["k"] * cfg["seq_len"]
    return tokens / statistics.median(times[2:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--ks", default="4,8")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--schedule", default="1f1b",
                    choices=["1f1b", "gpipe", "interleaved_1f1b"])
    ap.add_argument("--stages-per-rank", type=int, default=1,
                    help="V model chunks a rank (interleaved_1f1b; the layers split P x V ways)")
    ap.add_argument("--split", help="layers per stage, e.g. 4,2 (default: even)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="launches of each side, alternating; medians and the ratio's range")
    ap.add_argument("--balance", choices=["parameters", "compute"],
                    help="accrue's [parallel] balance instead of --split's counts "
                         "(PyTorch keeps --split)")
    a = ap.parse_args()
    fields = model_fields(a.layers, a.hidden)
    if a.split:
        per = [int(x) for x in a.split.split(",")]
    else:
        chunks = a.stages * a.stages_per_rank
        per = [a.layers // chunks] * chunks
        per[-1] += a.layers - sum(per)
    from transformers import LlamaConfig, LlamaForCausalLM  # the PyTorch side only

    rows = []
    for k in [int(x) for x in a.ks.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp)
            torch.manual_seed(0)
            model = LlamaForCausalLM(LlamaConfig(**fields))
            save_file({n: p.detach().contiguous() for n, p in model.state_dict().items()},
                      str(d / "init.safetensors"))
            token_file(d / "train.bin", a.steps * k * a.batch * a.seq_len + 1)
            text = accrue_job(d, fields, a.seq_len, a.batch, k, a.steps, a.stages, per, a.schedule,
                              a.balance, v=a.stages_per_rank)
            cfg = {"init": str(d / "init.safetensors"), "tokens": str(d / "train.bin"),
                   "seq_len": a.seq_len, "batch": a.batch, "k": k, "steps": a.steps,
                   "schedule": a.schedule, "stages_per_rank": a.stages_per_rank,
                   "model": fields, "layers_per_stage": per,
                   "out": str(d / "torch-out.json")}
            # Alternating launches; the ratio within each repeat.
            runs = []
            for _ in range(a.repeat):
                for r in range(a.stages):
                    shutil.rmtree(d / f"ckpt-{r}", ignore_errors=True)
                ours, bubble = run_accrue(a.worker, d, text, a.stages)
                theirs = run_torch(d, cfg, a.stages)
                runs.append((ours, theirs, bubble, ours / theirs))
            ideal = (a.stages - 1) / (a.stages_per_rank * k + a.stages - 1)
            med = [statistics.median(r[i] for r in runs) for i in range(4)]
            ratios = [r[3] for r in runs]
            rows.append((k, med[0], med[1], med[2], ideal, med[3], min(ratios), max(ratios)))
    print(f"- command: `{' '.join(sys.argv)}`")
    print(f"- CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"torch {torch.__version__}")
    print(f"- model: Llama L={a.layers}, H={a.hidden}, vocab {VOCAB}, T={a.seq_len}, b={a.batch}; "
          f"P={a.stages} ({a.schedule}, V={a.stages_per_rank}), layers_per_stage={per}"
          + (f" for PyTorch, accrue: balance = \"{a.balance}\"" if a.balance else "")
          + f"; {a.steps} steps, median of steps 3.., {a.repeat} launch(es) a side")
    print()
    print("| k | accrue tokens/s | torch.distributed.pipelining tokens/s | accrue / torch "
          "| accrue stage 0 bubble share | (P - 1) / (V k + P - 1) |")
    print("|---|---|---|---|---|---|")
    for k, ours, theirs, bubble, ideal, ratio, lo, hi in rows:
        spread = f" ({lo:.2f}-{hi:.2f})" if a.repeat > 1 else ""
        print(f"| {k} | {ours:,.0f} | {theirs:,.0f} | {ratio:.2f}x{spread} | {bubble:.0%} | {ideal:.0%} |")


if __name__ == "__main__":
    main()
