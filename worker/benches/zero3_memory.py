#!/usr/bin/env python3
"""ZeRO stages 0 to 3 on a Llama: each worker's peak resident memory and
step time (issue 41, "Measured"; docs/BENCHMARKS.md section 15).

A measurement, not a test: it prints a Markdown table.

For each W in --worlds, each stage in --stages and each sync mode in
--syncs (and, with --ac, activation checkpointing off and on), W
`accrue-worker train` processes (static rendezvous on loopback, one
intra-op thread each) train the same Llama (the Hugging Face layout,
untied head) with AdamW on the same token file, T = --seq-len, b rows a
micro-batch, k micro-steps a window, from accrue's own initial weights.
Per rank:

- peak RSS while training: the most `peak_rss_bytes` (the process's
  VmHWM at each commit) of its step reports, so the build, the first step
  and every window, not the final checkpoint;
- peak RSS of the whole run (GNU time's maximum resident set size:
  building, training and writing the final checkpoint), where
  /usr/bin/time exists;
- step time: rank 0's median window wall time over steps 2 onwards.

Beside them, the arithmetic of the issue: 16 bytes a parameter (fp32
weights, gradients and AdamW's two moments) over the data degree where
sharded.

Usage:
    .venv/bin/python worker/benches/zero3_memory.py --worker target/release/accrue-worker
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_vs_torch import free_ports, model_fields, token_file  # noqa: E402


def job(d, fields, a, stage, sync, ac, world):
    model = "\n".join(f"{key} = {json.dumps(v)}" for key, v in fields.items())
    perf = '[performance]\nactivation_checkpointing = "full"\n' if ac else ""
    return f"""
name = "zero3-bench"
seed = 0
workers = {world}
max_steps = {a.steps}
device = "cpu"
threads = 1
[model]
kind = "llama"
{model}
[data]
kind = "tokens"
path = "{d}/train.bin"
seq_len = {a.seq_len}
batch_size = {a.batch}
shuffle = false
[accumulation]
steps = {a.k}
sync = "{sync}"
[optimizer]
kind = "adamw"
lr = 0.001
weight_decay = 0.1
[sharding]
stage = {stage}
[comm]
timeout_s = 300
connect_timeout_s = 60
{perf}"""


def launch(worker, d, text, world):
    """Runs `text` on `world` processes; each rank's step reports and GNU
    time's peak (MiB, or None)."""
    (d / "job.toml").write_text(text)
    (d / "secret").write_text("bench-secret\n")
    peers = ",".join(f"127.0.0.1:{p}" for p in free_ports(world))
    env = dict(os.environ, OMP_NUM_THREADS="1", RUST_LOG="warn")
    gnu_time = shutil.which("time") and Path("/usr/bin/time").exists()
    procs = []
    for r in range(world):
        timed = ["/usr/bin/time", "-f", "%M", "-o", str(d / f"rank{r}.rss")] if gnu_time else []
        procs.append(subprocess.Popen(
            timed + [worker, "train", str(d / "job.toml"), "--json", "--rank", str(r),
                     "--world-size", str(world), "--peers", peers,
                     "--secret-file", str(d / "secret"), "--checkpoint-dir", str(d / "ckpt")],
            stdout=open(d / f"rank{r}.out", "w"), stderr=open(d / f"rank{r}.log", "w"), env=env))
    for r, p in enumerate(procs):
        if p.wait(timeout=3600) != 0:
            sys.exit(f"rank {r} failed:\n{(d / f'rank{r}.log').read_text()[-3000:]}")
    steps, whole = [], []
    for r in range(world):
        lines = [json.loads(x) for x in (d / f"rank{r}.out").read_text().splitlines()
                 if x.startswith("{")]
        steps.append([e["step"] for e in lines if e.get("event") == "step"])
        whole.append(int((d / f"rank{r}.rss").read_text().split()[-1]) / 1024
                     if gnu_time else None)
    return steps, whole


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--stages", default="0,2,3")
    ap.add_argument("--syncs", default="boundary,every_step")
    ap.add_argument("--ac", action="store_true", help="also with activation checkpointing")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    fields = model_fields(a.layers, a.hidden, a.vocab)
    h, i, v, n = a.hidden, fields["intermediate_size"], a.vocab, a.layers
    params = 2 * v * h + n * (4 * h * h + 3 * h * i + 2 * h) + h
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        worlds = [int(x) for x in a.worlds.split(",")]
        token_file(root / "train.bin",
                   (a.steps + 1) * a.k * a.batch * max(worlds) * (a.seq_len + 1) + 1, a.vocab)
        for world in worlds:
            for sync in a.syncs.split(","):
                for ac in ([False, True] if a.ac else [False]):
                    for stage in [int(x) for x in a.stages.split(",")]:
                        d = root / f"w{world}-s{stage}-{sync}-{int(ac)}"
                        d.mkdir()
                        steps, whole = launch(a.worker, d,
                                              job(root, fields, a, stage, sync, ac, world),
                                              world)
                        train = [max(s["peak_rss_bytes"] for s in st) / 2**20 for st in steps]
                        t = statistics.median(s["samples"] / s["samples_per_sec"]
                                              for s in steps[0][1:])
                        rows.append((world, sync, ac, stage, train, whole, t))
                        print(f"W={world} {sync} ac={ac} stage {stage}: train peak "
                              f"{', '.join(f'{m:.0f}' for m in train)} MiB, step {t * 1000:.0f} ms",
                              file=sys.stderr)
    print(f"- command: `{' '.join(sys.argv)}`")
    print(f"- CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print(f"- model: Llama L={a.layers}, H={a.hidden}, intermediate {i}, vocab {a.vocab}, untied "
          f"({params / 1e6:.1f} M parameters, {params * 4 / 2**20:.0f} MiB of fp32 weights); "
          f"AdamW; T={a.seq_len}, b={a.batch}, k={a.k}; {a.steps} steps")
    print()
    print("| W | sync | act. ckpt | stage | peak RSS training, per rank (MiB) "
          "| peak RSS whole run (MiB) | step ms | 16 B/param arithmetic (MiB) |")
    print("|---|---|---|---|---|---|---|---|")
    for world, sync, ac, stage, train, whole, t in rows:
        shard = lambda nbytes, on: nbytes / world if on else nbytes  # noqa: E731
        every = sync == "every_step"
        arith = (shard(4 * params, stage >= 3) + shard(4 * params, stage >= 2 and every)
                 + shard(8 * params, stage >= 1)) / 2**20
        w = ", ".join(f"{m:.0f}" for m in whole) if whole[0] is not None else "-"
        print(f"| {world} | {sync} | {'full' if ac else 'none'} | {stage} | "
              f"{', '.join(f'{m:.0f}' for m in train)} | {w} | {t * 1000:.0f} | {arith:.0f} |")


if __name__ == "__main__":
    main()
