#!/usr/bin/env python3
"""Two builds of accrue side by side on the CPU: the Llama benchmark of
lm_vs_ddp.py (`accrue local`, W = 2, k = 4) and the pipeline benchmark of
pipeline_vs_torch.py (P = 2, 1F1B), each launched with the one build then
the other, alternating, `--repeat` times (docs/BENCHMARKS.md, "The engine
runs through its own parts"). A measurement, not a test: it prints a
Markdown table of tokens/s (median of the repeats; after / before: the
median and range of the per-repeat ratios).

    .venv/bin/python worker/benches/before_after.py --before DIR --after DIR [--repeat 3]

DIR holds `accrue` and `accrue-worker` of one release build
(`cargo build --release -p accrue -p accrue-worker`).
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import lm_vs_ddp as lm  # noqa: E402
import pipeline_vs_torch as pp  # noqa: E402


def lm_rate(binary: Path, cfg: dict, tmp: Path) -> float:
    one = lm.run_accrue(binary, cfg, lm.EPOCHS[0], tmp)
    five = lm.run_accrue(binary, cfg, lm.EPOCHS[1], tmp)
    return lm.summarize(one, five, cfg)["rate"]


def lm_setup(name: str, tmp: Path) -> dict:
    cfg = lm.parse_config(name)
    spe = lm.auto_steps_per_epoch(cfg)
    cfg.update(steps_per_epoch=spe, accrue_omp_env=True, backend="auto")
    cfg["samples"] = lm.W * lm.K * cfg["b"] * spe
    path = tmp / f"tokens-{name}.bin"
    cfg["data"], cfg["count"] = str(path), lm.write_tokens(path, cfg["samples"], cfg["seq_len"])
    init = tmp / f"init-{name}.safetensors"
    cfg["init"], cfg["params"] = str(init), lm.write_init(init, cfg)
    return cfg


def pipeline_setup(d: Path, layers: int, hidden: int, k: int, steps: int, b: int, t: int) -> str:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = pp.model_fields(layers, hidden)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**fields))
    save_file({n: p.detach().contiguous() for n, p in model.state_dict().items()},
              str(d / "init.safetensors"))
    pp.token_file(d / "train.bin", steps * k * b * t + 1)
    per = [layers // 2, layers - layers // 2]
    return pp.accrue_job(d, fields, t, b, k, steps, 2, per, "1f1b")


def pipeline_rate(worker: Path, d: Path, text: str) -> float:
    """Median tokens/s of steps 3.. (a token file's samples are tokens)."""
    for r in range(2):
        shutil.rmtree(d / f"ckpt-{r}", ignore_errors=True)
    rate, _bubble = pp.run_accrue(str(worker), d, text, 2)
    return rate


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, type=Path)
    ap.add_argument("--after", required=True, type=Path)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--lm-configs", default="L2-H128-T64,L4-H256-T128")
    ap.add_argument("--pipeline-ks", default="4,8")
    a = ap.parse_args()
    builds = {"before": a.before.resolve(), "after": a.after.resolve()}
    for name, d in builds.items():
        for b in ("accrue", "accrue-worker"):
            if not (d / b).is_file():
                sys.exit(f"--{name}: no {d / b}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="accrue-before-after-") as tmp:
        tmp = Path(tmp)
        work = []
        for name in filter(None, (n.strip() for n in a.lm_configs.split(","))):
            cfg = lm_setup(name, tmp)
            work.append((f"Llama {name} (`accrue local`, W = 2, k = 4)",
                         lambda d, cfg=cfg: lm_rate(d / "accrue", cfg, tmp)))
        for k in [int(x) for x in a.pipeline_ks.split(",")]:
            d = tmp / f"pp-k{k}"
            d.mkdir()
            text = pipeline_setup(d, 4, 128, k, 8, 4, 64)
            work.append((f"pipeline P = 2, 1F1B, L4 H128 T64 b4, k = {k}",
                         lambda w, d=d, text=text: pipeline_rate(w / "accrue-worker", d, text)))
        for label, run in work:
            got = {"before": [], "after": []}
            for rep in range(a.repeat):
                order = ("before", "after") if rep % 2 == 0 else ("after", "before")
                for side in order:
                    got[side].append(run(builds[side]))
                print(f"[{label} rep {rep + 1}] before {got['before'][-1]:,.0f} "
                      f"after {got['after'][-1]:,.0f} tokens/s", file=sys.stderr, flush=True)
            ratios = [x / y for x, y in zip(got["after"], got["before"])]
            rows.append((label, statistics.median(got["before"]), statistics.median(got["after"]),
                         statistics.median(ratios), min(ratios), max(ratios)))
    print(f"- command: `{' '.join(sys.argv)}`")
    print(f"- CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"load average at the end {os.getloadavg()[0]:.2f}")
    print(f"- {a.repeat} launch(es) a build, alternating (before first on odd repeats)")
    print()
    print("| workload | before tokens/s | after tokens/s | after / before |")
    print("|---|---:|---:|---:|")
    for label, b, f, r, lo, hi in rows:
        print(f"| {label} | {b:,.0f} | {f:,.0f} | {r:.3f} ({lo:.3f}-{hi:.3f}) |")


if __name__ == "__main__":
    main()
