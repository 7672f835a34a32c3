#!/usr/bin/env python3
"""ZeRO stages 1 and 2 against stage 0: optimizer-state bytes, gradient
bytes, peak resident memory and step time per rank (docs/BENCHMARKS.md
section 6).

A measurement, not a test. For each world size W and stage, W
`accrue-worker train` processes (static rendezvous on loopback, one intra-op
thread each) train ResNet-34 with Adam on CIFAR-shaped synthetic data
(3x32x32, 10 classes) for --steps optimizer steps, then write the final
checkpoint. Per rank it reads:

  optimizer state: the `optimizer_state_bytes` the engine logs at the end
                   (the state this rank holds: stages 1, 2 its slice only);
  gradients:       the most gradient bytes held after a micro-step that is
                   not a sync step (`gradient_bytes_between_micro_steps`)
                   and after the last sync step (`..._after_sync`);
  peak RSS:        the process's VmHWM (/proc) when training has ended, read
                   as the engine logs the line above (polled every 10 ms),
                   so before the final checkpoint, whose gather of the
                   whole state under stage 1 is not training memory;
  step time:       rank 0's step reports (compute + comm + clip + optimizer),
                   mean over the steps after the first.

  python3 worker/benches/zero_memory.py --binary target/release/accrue-worker \
      [--worlds 2,4] [--steps 5] [--batch 4] [--k 2] [--device cpu|cuda]

With --device cuda (the GPU machine, issue 31) every rank trains on cuda:0
(W ranks share the one GPU) and the table adds each rank's peak CUDA
memory: the most `nvidia-smi --query-compute-apps` reported for that
process while it trained (polled every 50 ms; the CUDA context plus what
libtorch's caching allocator holds, i.e. what the GPU has given the
process, not only live tensors), and the peak of the whole GPU's
`memory.used` above its level at the start, all ranks together (a
container may hide nvidia-smi's per-process list).

Runs, per W: stages 0, 1 and 2 with sync = "boundary", then stages 0 and 2
with sync = "every_step" (k micro-steps per window in both).

Prints a Markdown table.
"""
import argparse
import json
import os
import re
import socket
import subprocess
import tempfile
import time

JOB = """
name = "zero-bench"
seed = 3
max_steps = {steps}
device = "{device}"
threads = 1
[model]
kind = "{model}"
[data]
kind = "synthetic"
samples = {samples}
eval_samples = 0
shape = [3, 32, 32]
classes = 10
batch_size = {batch}
[accumulation]
steps = {k}
sync = "{sync}"
[optimizer]
kind = "adam"
lr = 0.001
[clipping]
max_norm = 1.0
[sharding]
stage = {stage}
[comm]
timeout_s = 300
connect_timeout_s = 120
"""


def free_addrs(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    addrs = [f"127.0.0.1:{s.getsockname()[1]}" for s in socks]
    for s in socks:
        s.close()
    return addrs


class GpuPeaks:
    """Peak `used_memory` (MiB) per process id from nvidia-smi's loop, and
    the peak of the whole GPU's `memory.used` above what it was at the
    start (all ranks together: a container may hide the per-process
    list)."""

    def __init__(self):
        import threading
        self.peak = {}
        q = ["nvidia-smi", "--format=csv,noheader,nounits", "-lms", "50"]
        self.base = int(subprocess.run(q[:2] + ["--query-gpu=memory.used", "--id=0"],
                                       capture_output=True, text=True).stdout.split()[0])
        self.total = 0
        self.procs = [
            subprocess.Popen(q + ["--query-compute-apps=pid,used_memory"], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True),
            subprocess.Popen(q + ["--query-gpu=memory.used", "--id=0"], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True),
        ]
        for target in (self._apps, self._gpu):
            threading.Thread(target=target, daemon=True).start()

    def _apps(self):
        for line in self.procs[0].stdout:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
                pid, mib = int(parts[0]), int(parts[1])
                self.peak[pid] = max(self.peak.get(pid, 0), mib)

    def _gpu(self):
        for line in self.procs[1].stdout:
            if line.strip().isdigit():
                self.total = max(self.total, int(line) - self.base)

    def stop(self):
        for p in self.procs:
            p.kill()
            p.wait()


def run(binary, model, world, stage, steps, batch, k, sync, device="cpu"):
    d = tempfile.mkdtemp(prefix=f"zero-w{world}-s{stage}-")
    job = os.path.join(d, "job.toml")
    with open(job, "w") as f:
        f.write(JOB.format(model=model, steps=steps, device=device, samples=world * batch * k * (steps + 1),
                           batch=batch, stage=stage, k=k, sync=sync))
    secret = os.path.join(d, "secret")
    with open(secret, "w") as f:
        f.write("zero-bench-secret\n")
    peers = ",".join(free_addrs(world))
    procs = []
    gpu = GpuPeaks() if device.startswith("cuda") else None
    started = time.time()
    for r in range(world):
        cmd = [binary, "train", job, "--json", "--rank", str(r), "--world-size", str(world),
               "--peers", peers, "--secret-file", secret,
               "--checkpoint-dir", os.path.join(d, "ckpt")]
        out = open(os.path.join(d, f"rank{r}.out"), "w")
        err = open(os.path.join(d, f"rank{r}.log"), "w")
        env = dict(os.environ, RUST_LOG="info", NO_COLOR="1")
        procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, env=env))
    hwm = [None] * world
    while any(p.poll() is None for p in procs):
        for r, p in enumerate(procs):
            if hwm[r] is None and p.poll() is None:
                if "optimizer state held" in open(os.path.join(d, f"rank{r}.log")).read():
                    try:
                        status = open(f"/proc/{p.pid}/status").read()
                        hwm[r] = int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1))
                    except (OSError, AttributeError):
                        pass
        time.sleep(0.01)
    if gpu is not None:
        gpu.stop()
    for r, p in enumerate(procs):
        if p.wait() != 0:
            raise SystemExit(f"rank {r} of W={world} stage {stage} failed; see {d}/rank{r}.log")
    ranks = []
    for r in range(world):
        rss_kib = hwm[r]
        log = open(os.path.join(d, f"rank{r}.log")).read()
        num = lambda key: (lambda m: int(m.group(1)) if m else None)(re.search(key + r"=(\d+)", log))
        cuda_mib = gpu.peak.get(procs[r].pid) if gpu is not None else None
        ranks.append((rss_kib, num("optimizer_state_bytes"),
                      num("gradient_bytes_between_micro_steps"), num("gradient_bytes_after_sync"),
                      cuda_mib))
    steps_t = []
    for line in open(os.path.join(d, "rank0.out")):
        ev = json.loads(line)
        if ev.get("event") == "step":
            t = ev["step"]["timing"]
            steps_t.append(t["compute_s"] + t["comm_s"] + t["clip_s"] + t["optimizer_s"])
    mean = sum(steps_t[1:]) / max(1, len(steps_t) - 1)
    return ranks, mean, (gpu.total if gpu is not None else None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", required=True)
    ap.add_argument("--model", default="resnet34")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    cuda = a.device.startswith("cuda")
    print(f"`python3 worker/benches/zero_memory.py --binary {a.binary} --worlds {a.worlds} "
          f"--steps {a.steps} --batch {a.batch} --k {a.k} --device {a.device}` "
          f"({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores)\n")
    print("| model | W | sync | stage | optimizer state per rank (MB) | gradients between micro-steps / after sync, rank 0 (MB) "
          "| peak RSS per rank (MB) |" + (" peak CUDA memory per rank (MiB) | GPU memory used, all ranks (MiB) |" if cuda else "") + " step time (s) |")
    print("|---|---:|---|---:|---|---|---|" + ("---|---:|" if cuda else "") + "---:|")
    mb = lambda b: f"{b / 1e6:.1f}" if b is not None else "?"
    for world in map(int, a.worlds.split(",")):
        for sync, stages in (("boundary", (0, 1, 2)), ("every_step", (0, 2))):
            for stage in stages:
                ranks, step_s, gpu_total = run(a.binary, a.model, world, stage, a.steps, a.batch, a.k, sync,
                                       a.device)
                state = ", ".join(mb(r[1]) for r in ranks)
                grads = f"{mb(ranks[0][2])} / {mb(ranks[0][3])}"
                rss = ", ".join(f"{r[0] / 1024:.0f}" if r[0] is not None else "?" for r in ranks)
                gpu = (" " + ", ".join(str(r[4]) if r[4] is not None else "?" for r in ranks)
                       + f" | {gpu_total} |" if cuda else "")
                print(f"| {a.model} | {world} | {sync} | {stage} | {state} | {grads} | {rss} |{gpu} {step_s:.3f} |",
                      flush=True)


if __name__ == "__main__":
    main()
