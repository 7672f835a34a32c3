#!/usr/bin/env bash
# The CUDA checks of issues 17, 18 and 19 on the GPU machine
# (docs/OPERATIONS.md, "The CUDA checks on the GPU machine"). Run from the
# repository root of the carried tree, with gpu-bin/ from `make gpu-worker`:
#
#   scripts/gpu-checks.sh [tests|bench|all]     (default: all)
#
# Each check's output goes to $OUT/<check>.log (the device tool's $OUT;
# gpu-out/ elsewhere); a summary line per check goes to stdout. Exits 1 if
# any check failed.
set -u
what=${1:-all}
out=${OUT:-gpu-out}
mkdir -p "$out"
py=${GPU_PYTHON:-/opt/torch/.venv/bin/python}
sp=$("$py" -c 'import site; print(site.getsitepackages()[0])') || exit 1
export LD_LIBRARY_PATH="$sp/torch/lib:$sp/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# The test binaries name the tree (reference scripts) and the worker binary
# by the paths they were built at: make those paths lead here.
read -r built target < gpu-bin/BUILT-AT || exit 1
if [ "$built" != "$PWD" ] && [ ! -e "$built" ]; then
  mkdir -p "$(dirname "$built")" && ln -s "$PWD" "$built"
fi
mkdir -p "$target/release"
cmp -s gpu-bin/accrue-worker "$target/release/accrue-worker" ||
  cp gpu-bin/accrue-worker "$target/release/accrue-worker"

status=0
check() {
  local name=$1
  shift
  local t0=$SECONDS
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - t0)) s; $(grep -E '^test result|SKIPPED|accrue / pytorch' "$out/$name.log" | tr '\n' ' ')"
  [ $rc = 0 ] || status=1
}

nvidia-smi > "$out/nvidia-smi.txt" 2>&1
if [ "$what" = tests ] || [ "$what" = all ]; then
  check graphs gpu-bin/graphs --nocapture --test-threads 1 cuda_graphed
  check sharding gpu-bin/sharding --nocapture --test-threads 1 on_cuda
  check pytorch_reference gpu-bin/pytorch_reference --nocapture --test-threads 1 on_cuda
  check distributed gpu-bin/distributed --nocapture --test-threads 1 on_cuda
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  check bench "$py" worker/benches/graphs_vs_pytorch.py --binary gpu-bin/accrue-worker
  cat "$out/bench.log"
fi
exit $status
