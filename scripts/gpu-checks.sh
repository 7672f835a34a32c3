#!/usr/bin/env bash
# The CUDA checks of issues 17, 18 and 19 on the GPU machine
# (docs/DEVELOPING.md, "The CUDA checks on the GPU machine"). Run from the
# repository root of the carried tree, with gpu-bin/ from `make gpu-worker`:
#
#   scripts/gpu-checks.sh [tests|bench|bench-lm|zero|profile-lm|bubble|all]   (default: all)
#
# CHECKS="graphs lm_lifecycle" runs only the checks named (a rerun after a
# fix); LIMIT=S stops each check after S seconds (default 400).
#
# The test checks run side by side (16 cores and one GPU hold them; none
# times anything), the benchmarks one after another and alone.
#
# Each check's output goes to $OUT/<check>.log (the device tool's $OUT;
# gpu-out/ elsewhere); a summary line per check goes to stdout. The CUDA
# tests are `#[ignore = "needs CUDA"]`: they run here with `--ignored` and
# ACCRUE_REQUIRE_CUDA=1, which turns a missing CUDA into a failure. Exits 1
# if any check failed, skipped (a SKIPPED line), or ran no test at all.
set -u
export ACCRUE_REQUIRE_CUDA=1
what=${1:-all}
out=${OUT:-gpu-out}
mkdir -p "$out"
py=${GPU_PYTHON:-/opt/torch/.venv/bin/python}
sp=$("$py" -c 'import site; print(site.getsitepackages()[0])') || exit 1
export LD_LIBRARY_PATH="$sp/torch/lib:$sp/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# `make gpu-worker` packs gpu-bin/ into gpu-carry/gpu-bin.tar.xz (carry
# gpu-carry: gpu-bin/ itself is larger than the device tool carries).
if [ ! -f gpu-bin/BUILT-AT ] && [ -f gpu-carry/gpu-bin.tar.xz ]; then
  "$py" -c 'import tarfile; tarfile.open("gpu-carry/gpu-bin.tar.xz").extractall(".")' || exit 1
fi

# The test binaries name the tree (reference scripts) and the worker binary
# by the paths they were built at: make those paths lead here.
read -r built target < gpu-bin/BUILT-AT || exit 1
if [ "$built" != "$PWD" ] && [ ! -e "$built" ]; then
  mkdir -p "$(dirname "$built")" && ln -s "$PWD" "$built"
fi
mkdir -p "$target/release"
cmp -s gpu-bin/accrue-worker "$target/release/accrue-worker" ||
  cp gpu-bin/accrue-worker "$target/release/accrue-worker"

check() {
  local name=$1
  shift
  if [ -n "${CHECKS:-}" ] && [[ " $CHECKS " != *" $name "* ]]; then
    return 0
  fi
  local t0=$SECONDS
  timeout "${LIMIT:-400}" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  local why=""
  if grep -q SKIPPED "$out/$name.log"; then
    why="; FAILED: a check skipped"
    rc=1
  elif [ $rc = 0 ] && [ "${name#bench}" = "$name" ] && ! grep -Eq '^test result: ok\. [1-9][0-9]* passed' "$out/$name.log"; then
    why="; FAILED: no test ran"
    rc=1
  fi
  echo "$name: exit $rc after $((SECONDS - t0)) s; $(grep -E '^test result|SKIPPED|accrue / pytorch|^\| accrue' "$out/$name.log" | tr '\n' ' ')$why" > "$out/$name.summary"
  cat "$out/$name.summary"
  return $rc
}

status=0
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
if [ "$what" = tests ] || [ "$what" = all ]; then
  check graphs gpu-bin/graphs --ignored --nocapture --test-threads 1 cuda_graphed &
  check sharding gpu-bin/sharding --ignored --nocapture --test-threads 1 on_cuda &
  check pytorch_reference gpu-bin/pytorch_reference --ignored --nocapture --test-threads 1 on_cuda &
  check distributed gpu-bin/distributed --ignored --nocapture --test-threads 1 on_cuda &
  check lm_lifecycle gpu-bin/lm_lifecycle --ignored --nocapture --test-threads 1 cuda &
  check lm_data gpu-bin/lm_data --ignored --nocapture --test-threads 1 cuda &
  check fused_ops gpu-bin/fused_ops --ignored --nocapture --test-threads 1 cuda &
  # issue 38: NCCL at W = 1 through the engine's c10d group path.
  check c10d_jobs gpu-bin/c10d_jobs --ignored --nocapture --test-threads 1 nccl &
  # issue 40: pipeline stages on cuda:0 (two processes sharing the GPU).
  check pipeline gpu-bin/pipeline --ignored --nocapture --test-threads 1 on_cuda &
  # issue 42: tensor parallelism on cuda:0 (two ranks sharing the GPU).
  check tensor_parallel gpu-bin/tensor_parallel --ignored --nocapture --test-threads 1 on_cuda &
  for job in $(jobs -p); do wait "$job" || status=1; done
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  check bench "$py" worker/benches/graphs_vs_pytorch.py --binary gpu-bin/accrue-worker ${BENCH_ARGS:-} || status=1
  cat "$out/bench.log"
fi
if [ "$what" = bench-lm ] || [ "$what" = all ]; then
  # issue 30/31: a ~110 M Llama in bf16, T = 1024, against PyTorch eager
  # and torch.compile (worker/benches/lm_gpu.py).
  check bench-lm "$py" worker/benches/lm_gpu.py --binary gpu-bin/accrue-worker ${BENCH_LM_ARGS:-} || status=1
  cat "$out/bench-lm.log"
fi
if [ "$what" = zero ] || [ "$what" = all ]; then
  # issue 31: CUDA memory per rank under ZeRO stages 0, 1 and 2, ResNet-34
  # + Adam, W = 2 ranks sharing the GPU (worker/benches/zero_memory.py).
  check bench-zero "$py" worker/benches/zero_memory.py --binary gpu-bin/accrue-worker \
    --device cuda --worlds 2 --steps 6 --batch 32 --k 2 || status=1
  cat "$out/bench-zero.log"
fi
if [ "$what" = bubble ]; then
  # issue 40: the pipeline's bubble at P = 1, 2, 4 on the CPU (one core a
  # stage: this machine's 16 cores; docs/BENCHMARKS.md section 13).
  check bench-bubble "$py" worker/benches/pipeline_bubble.py --worker gpu-bin/accrue-worker \
    ${BUBBLE_ARGS:-} || status=1
  cat "$out/bench-bubble.log"
fi
if [ "$what" = profile-lm ]; then
  # issue 31: where the Llama step's GPU time goes, PyTorch eager against
  # torch.compile, and accrue's step split (worker/benches/lm_gpu_profile.py).
  check bench-profile-lm "$py" worker/benches/lm_gpu_profile.py --binary gpu-bin/accrue-worker || status=1
  cat "$out/bench-profile-lm.log"
fi
exit $status
