#!/usr/bin/env python3
"""Activation checkpointing on the CPU (issue 41, "Measured";
docs/BENCHMARKS.md section 14): peak memory saved and time spent.

A measurement, not a test: it prints a Markdown block.

accrue trains the same Llama (the Hugging Face layout, L layers, hidden
H, H / 64 heads, vocab --vocab, untied head) in one process with one
intra-op thread, AdamW, for each T in --seq-lens: without activation
checkpointing, and with `activation_checkpointing = "full"` for each
segment length in --every. Per run: the process's peak resident memory
(GNU time's maximum resident set size over the whole run) and the median
step time over steps 3 onwards.

Usage:
    .venv/bin/python worker/benches/activation_checkpointing.py --worker target/release/accrue-worker
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_vs_torch import accrue_job, launch, model_fields, token_file  # noqa: E402


def run(worker, d, text):
    """Median step time (steps 3..) and the peak resident memory in MiB."""
    steps, peaks = launch(worker, d, text, 1, rss=True)
    times = [s["samples"] / s["samples_per_sec"] for s in steps[2:]]
    return statistics.median(times), peaks[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq-lens", default="256,1024")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--every", default="1,2")
    a = ap.parse_args()
    fields = model_fields(a.layers, a.hidden, a.vocab)
    fields["max_position_embeddings"] = max(int(t) for t in a.seq_lens.split(","))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**fields))
        params = sum(p.numel() for p in model.parameters())
        save_file({n: p.detach().contiguous() for n, p in model.state_dict().items()},
                  str(root / "init.safetensors"))
        for t in [int(x) for x in a.seq_lens.split(",")]:
            token_file(root / "train.bin", a.steps * a.k * a.batch * t + 1, a.vocab)
            base = accrue_job(root, fields, t, a.batch, a.k, a.steps, 1, [a.layers], "1f1b")
            for every in [None] + [int(x) for x in a.every.split(",")]:
                d = root / f"t{t}-{every}"
                d.mkdir()
                text = base if every is None else base + (
                    "[performance]\nactivation_checkpointing = \"full\"\n"
                    f"checkpoint_every = {every}\n")
                step, peak = run(a.worker, d, text)
                print(f"T={t} every={every}: step {step * 1000:.0f} ms, peak {peak:.0f} MiB",
                      file=sys.stderr)
                rows.append((t, every, step, peak))
    print(f"- command: `{' '.join(sys.argv)}`")
    print(f"- CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"torch {torch.__version__}")
    print(f"- model: Llama L={a.layers}, H={a.hidden}, vocab {a.vocab} ({params / 1e6:.1f} M "
          f"parameters), b={a.batch}, k={a.k}; one process, one thread; {a.steps} steps, "
          f"median of steps 3..")
    print()
    print("| T | activation checkpointing | peak resident memory (MiB) | saved | step ms | time |")
    print("|---|---|---|---|---|---|")
    base = {}
    for t, every, step, peak in rows:
        if every is None:
            base[t] = (step, peak)
            print(f"| {t} | none | {peak:,.0f} | | {step * 1000:,.0f} | |")
        else:
            s0, p0 = base[t]
            print(f"| {t} | full, every {every} block(s) | {peak:,.0f} | {p0 - peak:,.0f} MiB "
                  f"({(p0 - peak) / p0:.0%}) | {step * 1000:,.0f} | +{step / s0 - 1:.0%} |")


if __name__ == "__main__":
    main()
