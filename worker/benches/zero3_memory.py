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
sharded. With --fsdp (the default), each (W, sync, checkpointing) also
runs PyTorch FSDP2 on the same model and token file
(worker/benches/fsdp2_train.py under torchrun): its peak resident memory
per rank (ru_maxrss at the end of training) and its step time, so
tokens/s compare in one run. "above idle" subtracts each side's peak on a
tiny Llama (L = 1, H = 64, the same vocab and W, stage 3 for accrue):
what the process costs before the model (libtorch; for FSDP2 also
Python, torch and transformers).

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


def job(d, fields, a, stage, sync, ac, world, prefetch=True):
    keep = "reshard_after_forward = false\n" if stage == 3 and a.keep_gathered else ""
    if stage == 3 and not prefetch:
        keep += "prefetch = false\n"
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
{keep}[comm]
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


def fsdp(d, root, fields, a, sync, ac, world):
    """FSDP2's run of the same configuration: each rank's peak (MiB) and
    rank 0's median step time over steps 2 onwards."""
    cfg = {"model": fields, "ac": ac, "sync": sync, "seq_len": a.seq_len, "batch": a.batch,
           "k": a.k, "steps": a.steps, "tokens": str(root / "train.bin"),
           "keep_gathered": a.keep_gathered}
    port = free_ports(1)[0]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
         "--master-addr", "127.0.0.1", "--master-port", str(port),
         str(Path(__file__).resolve().parent / "fsdp2_train.py"), json.dumps(cfg), str(d)],
        capture_output=True, text=True, env=env, timeout=3600)
    if run.returncode != 0:
        sys.exit(f"FSDP2 failed:\n{run.stderr[-3000:]}")
    ranks = [json.loads((d / f"fsdp-rank{r}.json").read_text()) for r in range(world)]
    return [r["peak_mib"] for r in ranks], statistics.median(ranks[0]["times"][1:])


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
    ap.add_argument("--no-fsdp", action="store_true", help="accrue alone")
    ap.add_argument("--repeat", type=int, default=1,
                    help="each configuration N times, accrue and FSDP2 alternating")
    ap.add_argument("--prefetch", choices=["on", "off", "both"], default="on",
                    help="stage 3 with sharding.prefetch (the default), without, or both")
    ap.add_argument("--keep-gathered", action="store_true",
                    help="stage 3 with reshard_after_forward = false (FSDP2 too)")
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
        tiny = model_fields(1, 64, a.vocab)
        idle = {}
        for world in worlds:
            d = root / f"idle-{world}"
            d.mkdir()
            steps, _ = launch(a.worker, d, job(root, tiny, a, 3, "boundary", False, world), world)
            idle[("accrue", world)] = statistics.median(
                max(s["peak_rss_bytes"] for s in st) / 2**20 for st in steps)
            if not a.no_fsdp:
                (d / "fsdp").mkdir()
                peaks, _ = fsdp(d / "fsdp", root, tiny, a, "boundary", False, world)
                idle[("fsdp", world)] = statistics.median(peaks)
        for world in worlds:
            for sync in a.syncs.split(","):
                for ac in ([False, True] if a.ac else [False]):
                    for rep in range(a.repeat):
                        runs = [(int(x), p) for x in a.stages.split(",")
                                for p in ({"on": [True], "off": [False], "both": [True, False]}
                                          [a.prefetch] if int(x) == 3 else [True])]
                        for stage, prefetch in runs:
                            d = root / f"w{world}-s{stage}-{sync}-{int(ac)}-{int(prefetch)}-{rep}"
                            d.mkdir()
                            steps, whole = launch(a.worker, d,
                                                  job(root, fields, a, stage, sync, ac, world,
                                                      prefetch),
                                                  world)
                            train = [max(s["peak_rss_bytes"] for s in st) / 2**20 for st in steps]
                            t = statistics.median(s["samples"] / s["samples_per_sec"]
                                                  for s in steps[0][1:])
                            name = f"accrue stage {stage}"
                            if stage == 3 and a.prefetch == "both":
                                name += ", prefetch" if prefetch else ", no prefetch"
                            if a.repeat > 1:
                                name += f" #{rep + 1}"
                            rows.append((world, sync, ac, name, stage, train, whole, t))
                            print(f"W={world} {sync} ac={ac} {name}: train peak "
                                  f"{', '.join(f'{m:.0f}' for m in train)} MiB, step {t * 1000:.0f} ms",
                                  file=sys.stderr)
                        if not a.no_fsdp:
                            d = root / f"w{world}-fsdp-{sync}-{int(ac)}-{rep}"
                            d.mkdir()
                            peaks, t = fsdp(d, root, fields, a, sync, ac, world)
                            rows.append((world, sync, ac, "FSDP2" + (f" #{rep + 1}" if a.repeat > 1 else ""),
                                         3, peaks, [None], t))
                            print(f"W={world} {sync} ac={ac} FSDP2: peak "
                                  f"{', '.join(f'{m:.0f}' for m in peaks)} MiB, step {t * 1000:.0f} ms",
                                  file=sys.stderr)
    print(f"- command: `{' '.join(sys.argv)}`")
    print(f"- CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print(f"- model: Llama L={a.layers}, H={a.hidden}, intermediate {i}, vocab {a.vocab}, untied "
          f"({params / 1e6:.1f} M parameters, {params * 4 / 2**20:.0f} MiB of fp32 weights); "
          f"AdamW; T={a.seq_len}, b={a.batch}, k={a.k}; {a.steps} steps")
    print()
    print(f"- idle (tiny Llama) peaks, MiB: "
          f"{', '.join(f'{k[0]} W={k[1]} {v:.0f}' for k, v in idle.items())}")
    print()
    print("| W | sync | act. ckpt | run | peak RSS training, per rank (MiB) "
          "| above idle, max (MiB) | peak RSS whole run (MiB) | step ms | tokens/s "
          "| 16 B/param arithmetic (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for world, sync, ac, run, stage, train, whole, t in rows:
        shard = lambda nbytes, on: nbytes / world if on else nbytes  # noqa: E731
        every = sync == "every_step"
        arith = (shard(4 * params, stage >= 3) + shard(4 * params, stage >= 2 and every)
                 + shard(8 * params, stage >= 1)) / 2**20
        w = ", ".join(f"{m:.0f}" for m in whole) if whole[0] is not None else "-"
        tokens = world * a.k * a.batch * a.seq_len / t
        base = idle[("fsdp" if run == "FSDP2" else "accrue", world)]
        print(f"| {world} | {sync} | {'full' if ac else 'none'} | {run} | "
              f"{', '.join(f'{m:.0f}' for m in train)} | {max(train) - base:.0f} | {w} "
              f"| {t * 1000:.0f} | {tokens:,.0f} | {arith:.0f} |")


if __name__ == "__main__":
    main()
