"""All-reduce throughput of the data group on each transport (issue 38):
starts W mesh-check processes per (transport, W) on loopback, hands them
each other's addresses, and prints rank 0's CSV lines (docs/BENCHMARKS.md).

    python worker/benches/groups_bench.py --bin target/release/mesh-check \
        --worlds 2,4 --sizes 1M,16M,64M,256M
"""
import argparse
import subprocess
import sys


def run(binary, backend, world, sizes, iters):
    procs = [
        subprocess.Popen(
            [binary, "--rank", str(r), "--data", str(world), "--backend", backend,
             "--timeout-s", "120", "--bench", "--sizes", sizes, "--iters", str(iters)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for r in range(world)
    ]
    addrs = []
    for p in procs:
        line = p.stdout.readline().strip()
        assert line.startswith("LISTEN "), line
        addrs.append(line.split()[1])
    for p in procs:
        p.stdin.write(",".join(addrs) + "\n")
        p.stdin.flush()
    out = procs[0].stdout.read()
    for p in procs:
        if p.wait() != 0:
            sys.exit(f"{backend} W={world}: a rank failed")
    return [l for l in out.splitlines() if l and not l.startswith("transport")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/mesh-check")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--sizes", default="1M,16M,64M,256M")
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    print("transport,world,bytes,iters,latency_us,busbw_GBps")
    for w in [int(x) for x in a.worlds.split(",")]:
        for backend in ["ring", "c10d"]:
            for line in run(a.bin, backend, w, a.sizes, a.iters):
                print(line, flush=True)


if __name__ == "__main__":
    main()
