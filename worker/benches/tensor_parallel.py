#!/usr/bin/env python3
"""Tensor parallelism on the CPU (issue 42, "Measured"; docs/BENCHMARKS.md
section 16): tokens/s and each worker's peak resident memory at T = 1, 2
and 4 on the same Llama, beside PyTorch's own tensor parallelism
(worker/benches/tp_torch.py: `parallelize_module` with ColwiseParallel /
RowwiseParallel on gloo), and the bytes the tensor group carried per
decoder layer against Megatron-LM's count.

A measurement, not a test: it prints a Markdown table.

For each T in --degrees, T `accrue-worker train` processes (data = 1,
static rendezvous on loopback, one intra-op thread each) train the same
Llama (untied head) with AdamW on the same token file, T_seq = --seq-len,
b rows a micro-batch, k micro-steps a window, --steps windows. Per rank:
the most `peak_rss_bytes` of its step reports (VmHWM at each commit);
rank 0's median window time over steps 2 onwards; at the end each rank
logs the payload bytes of its tensor-parallel reductions
(`layer_allreduce_bytes`: the layers' f and g and the embedding's sum).
Megatron-LM's count without sequence parallelism: per decoder layer and
micro-batch two all-reduces of b x T_seq x H forward and two backward,
plus the embedding's one forward: (4 L + 1) b T_seq H x 4 bytes a
micro-batch (fp32). Then PyTorch's run of the same configuration.

Usage:
    .venv/bin/python worker/benches/tensor_parallel.py --worker target/release/accrue-worker
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_vs_torch import free_ports, model_fields, token_file  # noqa: E402


def job(d, fields, a, degree):
    model = "\n".join(f"{key} = {json.dumps(v)}" for key, v in fields.items())
    tensor = f"[parallel]\ntensor = {degree}\n" if degree > 1 else ""
    return f"""
name = "tp-bench"
seed = 0
workers = {degree}
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
[clipping]
max_norm = 1.0
[optimizer]
kind = "adamw"
lr = 0.001
weight_decay = 0.1
[comm]
timeout_s = 300
connect_timeout_s = 60
{tensor}"""


def launch(worker, d, text, world):
    """Runs `text` on `world` processes: each rank's step reports and its
    logged tensor-parallel layer bytes (0 at T = 1)."""
    (d / "job.toml").write_text(text)
    (d / "secret").write_text("bench-secret\n")
    peers = ",".join(f"127.0.0.1:{p}" for p in free_ports(world))
    env = dict(os.environ, OMP_NUM_THREADS="1", RUST_LOG="info")
    procs = [subprocess.Popen(
        [worker, "train", str(d / "job.toml"), "--json", "--rank", str(r),
         "--world-size", str(world), "--peers", peers,
         "--secret-file", str(d / "secret"), "--checkpoint-dir", str(d / "ckpt")],
        stdout=open(d / f"rank{r}.out", "w"), stderr=open(d / f"rank{r}.log", "w"), env=env)
        for r in range(world)]
    for r, p in enumerate(procs):
        if p.wait(timeout=3600) != 0:
            sys.exit(f"rank {r} failed:\n{(d / f'rank{r}.log').read_text()[-3000:]}")
    steps, layer_bytes = [], []
    for r in range(world):
        lines = [json.loads(x) for x in (d / f"rank{r}.out").read_text().splitlines()
                 if x.startswith("{")]
        steps.append([e["step"] for e in lines if e.get("event") == "step"])
        m = re.search(r"layer_allreduce_bytes=(\d+)", (d / f"rank{r}.log").read_text())
        layer_bytes.append(int(m.group(1)) if m else 0)
    return steps, layer_bytes


def torch_tp(d, root, fields, a, degree):
    cfg = {"model": fields, "seq_len": a.seq_len, "batch": a.batch, "k": a.k,
           "steps": a.steps, "tokens": str(root / "train.bin")}
    port = free_ports(1)[0]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(degree),
         "--master-addr", "127.0.0.1", "--master-port", str(port),
         str(Path(__file__).resolve().parent / "tp_torch.py"), json.dumps(cfg), str(d)],
        capture_output=True, text=True, env=env, timeout=3600)
    if run.returncode != 0:
        return None, run.stderr[-2000:]
    ranks = [json.loads((d / f"tp-rank{r}.json").read_text()) for r in range(degree)]
    return ([r["peak_mib"] for r in ranks], statistics.median(ranks[0]["times"][1:])), None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--degrees", default="1,2,4")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--no-torch", action="store_true", help="accrue alone")
    a = ap.parse_args()
    fields = model_fields(a.layers, a.hidden, a.vocab)
    h, i, v, n = a.hidden, fields["intermediate_size"], a.vocab, a.layers
    params = 2 * v * h + n * (4 * h * h + 3 * h * i + 2 * h) + h
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        token_file(root / "train.bin", (a.steps + 1) * a.k * a.batch * (a.seq_len + 1) + 1,
                   a.vocab)
        for degree in [int(x) for x in a.degrees.split(",")]:
            d = root / f"accrue-t{degree}"
            d.mkdir()
            steps, layer_bytes = launch(a.worker, d, job(root, fields, a, degree), degree)
            peaks = [max(s["peak_rss_bytes"] for s in st) / 2**20 for st in steps]
            t = statistics.median(s["samples"] / s["samples_per_sec"] for s in steps[0][1:])
            micro = a.steps * a.k
            megatron = (4 * n + 1) * a.batch * a.seq_len * h * 4 * micro if degree > 1 else 0
            rows.append((degree, "accrue", peaks, t, layer_bytes[0], megatron))
            print(f"T={degree} accrue: peaks {peaks}, step {t * 1000:.0f} ms, layer bytes "
                  f"{layer_bytes[0]} (Megatron {megatron})", file=sys.stderr)
            if not a.no_torch:
                d = root / f"torch-t{degree}"
                d.mkdir()
                got, err = torch_tp(d, root, fields, a, degree)
                if got is None:
                    print(f"T={degree} PyTorch failed: {err}", file=sys.stderr)
                    rows.append((degree, "PyTorch (failed)", [], float("nan"), None, None))
                else:
                    rows.append((degree, "PyTorch TP", got[0], got[1], None, None))
                    print(f"T={degree} PyTorch: peaks {got[0]}, step {got[1] * 1000:.0f} ms",
                          file=sys.stderr)
    print(f"- command: `{' '.join(sys.argv)}`")
    print(f"- CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print(f"- model: Llama L={a.layers}, H={a.hidden}, intermediate {i}, vocab {a.vocab}, untied "
          f"({params / 1e6:.1f} M parameters); AdamW, clip 1.0; T_seq={a.seq_len}, b={a.batch}, "
          f"k={a.k}; {a.steps} steps; data degree 1")
    print()
    print("| T | run | peak RSS per worker (MiB) | step ms | tokens/s "
          "| layer all-reduce bytes, rank 0 | Megatron's count |")
    print("|---|---|---|---|---|---|---|")
    for degree, run, peaks, t, got, want in rows:
        tokens = a.k * a.batch * a.seq_len / t if t == t else float("nan")
        print(f"| {degree} | {run} | {', '.join(f'{m:.0f}' for m in peaks) or '-'} "
              f"| {t * 1000:.0f} | {tokens:,.0f} | {got if got is not None else '-'} "
              f"| {want if want is not None else '-'} |")


if __name__ == "__main__":
    main()
