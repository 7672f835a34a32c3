#!/usr/bin/env python3
"""The pipeline's bubble and memory on the CPU (issue 40, "Measured";
docs/BENCHMARKS.md section 13).

A measurement, not a test: it prints a Markdown block.

For each P in --stages and k in --ks, accrue trains the same Llama (the
Hugging Face layout, L layers, hidden H, H / 64 heads, vocab --vocab,
untied head) in P stages (P processes, one intra-op thread each, gloo
between stages; P = 1 is one process), T = 64, b rows a micro-batch, the
same token file, AdamW. Per run:

- the step time: the median over steps 3.. of each step report's window
  wall time (samples / samples_per_sec, rank 0);
- the step time the bubble formula predicts: one stage's share of P = 1's
  micro-step, T1(k) / (k P), times (k + P - 1) micro-step slots;
- the bubble measured from the step time: 1 - (T1(k) / P) / T(P, k), the
  share of the step a perfectly balanced stage would not need, beside
  (P - 1) / (k + P - 1);
- stage 0's waiting share (its step reports' `timing.bubble_s`);
- each process's peak resident memory (GNU time's maximum resident set
  size: the whole run, checkpoint writing included).

Usage:
    .venv/bin/python worker/benches/pipeline_bubble.py --worker target/release/accrue-worker
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def model_fields(layers, hidden, vocab):
    inter = -(-(8 * hidden // 3) // 64) * 64
    return {
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": hidden // 64,
        "num_key_value_heads": hidden // 64, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    }


def token_file(path, count, vocab):
    rng = np.random.default_rng(0)
    header = np.zeros(256, dtype=np.int32)
    header[:3] = [20240520, 1, count]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(rng.integers(0, vocab, count, dtype=np.uint16).tobytes())


def job(d, fields, t, b, k, steps, stages, schedule):
    model = "\n".join(f"{key} = {json.dumps(v)}" for key, v in fields.items())
    parallel = f"[parallel]\npipeline = {stages}\nschedule = \"{schedule}\"\n" if stages > 1 else ""
    return f"""
name = "pp-bubble"
seed = 0
workers = {stages}
max_steps = {steps}
device = "cpu"
threads = 1
[model]
kind = "llama"
{model}
init = "{d}/init.safetensors"
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
{parallel}"""


def run(worker, d, text, stages):
    """Median step time and stage 0 waiting share (steps 3..), and each
    rank's peak resident memory in MiB."""
    path = d / "job.toml"
    path.write_text(text)
    (d / "secret").write_text("bench-secret\n")
    peers = ",".join(f"127.0.0.1:{p}" for p in free_ports(stages))
    env = dict(os.environ, OMP_NUM_THREADS="1", RUST_LOG="warn")
    procs = []
    for r in range(stages):
        out = open(d / f"rank{r}.out", "w")
        err = open(d / f"rank{r}.log", "w")
        # GNU time reports the worker's own peak: a child forked from this
        # Python would inherit its high-water mark (torch loaded) across
        # exec, and wait4's ru_maxrss would be that.
        procs.append(subprocess.Popen(
            ["/usr/bin/time", "-f", "%M", "-o", str(d / f"rank{r}.rss"),
             worker, "train", str(path), "--json", "--rank", str(r), "--world-size", str(stages),
             "--peers", peers, "--secret-file", str(d / "secret"),
             "--checkpoint-dir", str(d / f"ckpt-{r}")],
            stdout=out, stderr=err, env=env))
    peaks = []
    for r, p in enumerate(procs):
        if p.wait(timeout=3600) != 0:
            sys.exit(f"accrue rank {r} failed:\n{(d / f'rank{r}.log').read_text()[-3000:]}")
        peaks.append(int((d / f"rank{r}.rss").read_text().split()[-1]) / 1024)
    lines = [json.loads(line) for line in (d / "rank0.out").read_text().splitlines()
             if line.startswith("{")]
    steps = [e["step"] for e in lines if e.get("event") == "step"][2:]
    times = [s["samples"] / s["samples_per_sec"] for s in steps]
    waits = [s["timing"]["bubble_s"] / t for s, t in zip(steps, times)]
    return statistics.median(times), statistics.median(waits), peaks


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--stages", default="1,2,4")
    ap.add_argument("--ks", default="1,2,4,8,16")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--schedule", default="1f1b")
    a = ap.parse_args()
    fields = model_fields(a.layers, a.hidden, a.vocab)
    stages_list = [int(x) for x in a.stages.split(",")]
    assert stages_list[0] == 1, "P = 1 first: the others are measured against it"
    ks = [int(x) for x in a.ks.split(",")]
    rows, memory, t1 = [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**fields))
        params = sum(p.numel() for p in model.parameters())
        save_file({n: p.detach().contiguous() for n, p in model.state_dict().items()},
                  str(root / "init.safetensors"))
        token_file(root / "train.bin", a.steps * max(ks) * a.batch * a.seq_len + 1, a.vocab)
        for stages in stages_list:
            for k in ks:
                d = root / f"p{stages}-k{k}"
                d.mkdir()
                text = job(root, fields, a.seq_len, a.batch, k, a.steps, stages, a.schedule)
                step, wait, peaks = run(a.worker, d, text, stages)
                print(f"P={stages} k={k}: step {step * 1000:.1f} ms, stage 0 waits {wait:.0%}, "
                      f"peak RSS {', '.join(f'{m:.0f}' for m in peaks)} MiB", file=sys.stderr)
                if stages == 1:
                    t1[k] = step
                    rows.append((stages, k, step, None, None, None, None))
                else:
                    predicted = (k + stages - 1) * t1[k] / (k * stages)
                    bubble = 1 - (t1[k] / stages) / step
                    ideal = (stages - 1) / (k + stages - 1)
                    rows.append((stages, k, step, predicted, bubble, ideal, wait))
                memory.setdefault(stages, peaks)
    print(f"- command: `{' '.join(sys.argv)}`")
    print(f"- CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"torch {torch.__version__}")
    print(f"- model: Llama L={a.layers}, H={a.hidden}, vocab {a.vocab} ({params / 1e6:.1f} M "
          f"parameters), T={a.seq_len}, b={a.batch}; {a.schedule}, even layers_per_stage; "
          f"{a.steps} steps, median of steps 3..")
    print()
    print("| P | k | step ms | predicted ms ((k + P - 1) T1 / (k P)) | measured / predicted "
          "| bubble from step time | (P - 1) / (k + P - 1) | stage 0 waits |")
    print("|---|---|---|---|---|---|---|---|")
    for stages, k, step, predicted, bubble, ideal, wait in rows:
        if predicted is None:
            print(f"| {stages} | {k} | {step * 1000:.1f} | | | | | |")
        else:
            print(f"| {stages} | {k} | {step * 1000:.1f} | {predicted * 1000:.1f} | "
                  f"{step / predicted:.2f} | {bubble:.0%} | {ideal:.0%} | {wait:.0%} |")
    print()
    print("| P | peak resident memory per rank (MiB, k = first of --ks) |")
    print("|---|---|")
    for stages, peaks in memory.items():
        print(f"| {stages} | {', '.join(f'{m:.0f}' for m in peaks)} |")


if __name__ == "__main__":
    main()
