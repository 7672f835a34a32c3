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
import os
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_vs_torch import accrue_job, launch, model_fields, token_file  # noqa: E402


def run(worker, d, text, stages):
    """Median step time and stage 0 waiting share (steps 3..), and each
    rank's peak resident memory in MiB."""
    steps, peaks = launch(worker, d, text, stages, rss=shutil.which("time"))
    peaks = peaks or [float("nan")] * stages
    steps = steps[2:]
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
        try:
            from transformers import LlamaConfig, LlamaForCausalLM
        except ImportError:  # the GPU machine's Python: accrue's own init from the seed
            LlamaForCausalLM = None
        if LlamaForCausalLM is not None:
            torch.manual_seed(0)
            model = LlamaForCausalLM(LlamaConfig(**fields))
            params = sum(p.numel() for p in model.parameters())
            save_file({n: p.detach().contiguous() for n, p in model.state_dict().items()},
                      str(root / "init.safetensors"))
        else:
            params = float("nan")
        token_file(root / "train.bin", a.steps * max(ks) * a.batch * a.seq_len + 1, a.vocab)
        for stages in stages_list:
            for k in ks:
                d = root / f"p{stages}-k{k}"
                d.mkdir()
                per = [a.layers // stages] * stages
                per[-1] += a.layers - sum(per)
                text = accrue_job(root, fields, a.seq_len, a.batch, k, a.steps, stages, per,
                                  a.schedule, init=LlamaForCausalLM is not None)
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
