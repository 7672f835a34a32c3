"""Side by side in one run: accrue's ring all-reduce (allreduce-bench), torch
gloo all_reduce, and raw loopback TCP streams (one way and both ways at once).
Prints a Markdown table for docs/BENCHMARKS.md.

Usage: .venv/bin/python worker/benches/allreduce_vs_gloo.py \
           --bench target/release/allreduce-bench --worlds 2,3 --iters 20
"""
import argparse
import datetime
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = "4K,16K,64K,256K,1M,4M,16M,64M,256M"


def csv(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rows = [l.split(",") for l in out.strip().splitlines()]
    return [dict(zip(rows[0], r)) for r in rows[1:]]


def human(n):
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n // div} {unit}"
    return f"{n} B"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bench", default="target/release/allreduce-bench")
    p.add_argument("--worlds", default="2,3")
    p.add_argument("--sizes", default=SIZES)
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    raw = {int(r["bytes"]): float(r["GBps_per_direction"]) for r in csv([a.bench, "raw", "--sizes", a.sizes])}
    both = {
        int(r["bytes"]): float(r["GBps_per_direction"])
        for r in csv([a.bench, "raw", "--bidir", "--sizes", a.sizes])
    }
    print(f"- command: `{' '.join([os.path.relpath(sys.executable)] + sys.argv)}`")
    print(f"- date: {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC; {os.cpu_count()} CPUs; loopback TCP")
    for w in [int(x) for x in a.worlds.split(",")]:
        ring = {int(r["bytes"]): r for r in csv([a.bench, "ring", "--world", str(w), "--sizes", a.sizes, "--iters", str(a.iters)])}
        gloo_rows = subprocess.run(
            [sys.executable, os.path.join(HERE, "gloo_allreduce.py"), "--world", str(w), "--sizes", a.sizes, "--iters", str(a.iters)],
            check=True, capture_output=True, text=True,
        ).stdout.strip().splitlines()
        gloo = {int(r.split(",")[2]): r.split(",") for r in gloo_rows}
        print()
        print(f"W = {w}: latency (µs) and bus bandwidth (GB/s, = size/time x 2(W-1)/W)")
        print()
        print("| size | accrue µs | gloo µs | accrue busbw | gloo busbw | accrue/gloo | raw one-way GB/s | accrue/raw | raw both-ways GB/s | accrue/both-ways | accrue wire bytes/op |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for size in sorted(ring):
            r, g = ring[size], gloo.get(size)
            rb, gb = float(r["busbw_GBps"]), float(g[6]) if g else float("nan")
            rw, bw = raw.get(size, float("nan")), both.get(size, float("nan"))
            print(
                f"| {human(size)} | {float(r['latency_us']):,.0f} | {float(g[4]) if g else float('nan'):,.0f} | {rb:.3f} | {gb:.3f} | {rb / gb:.2f} "
                f"| {rw:.3f} | {rb / rw:.0%} | {bw:.3f} | {rb / bw:.0%} | {int(r['wire_bytes_per_op']):,} |"
            )


if __name__ == "__main__":
    main()
