#!/usr/bin/env python3
"""A Llama on the GPU machine (issues 30 and 31): accrue against PyTorch
eager and `torch.compile` training the same model, in one call.

A measurement, not a test. Each side trains transformers'
`LlamaForCausalLM` (PyTorch: the same model in plain PyTorch, `llama()`
below, since the GPU machine's Python has torch only; `--check` compares it
with transformers where that is installed; accrue: its `llama` family) of --preset size on
synthetic uniform tokens, b rows of T tokens a micro-batch, k micro-batches
a step, one rank, the loss normalized by the window's target count, clip
1.0, AdamW (lr 3e-4, wd 0.1), under --precision autocast (bf16 by default)
with fp32 master weights. The sides, rotated every round:

  pytorch-eager    the loop: for each micro-batch, loss = CE_sum / N
                   (N = the window's targets) under torch.autocast;
                   backward; every k: clip_grad_norm_, AdamW (fused=True,
                   PyTorch's fastest on CUDA), zero_grad(set_to_none)
  pytorch-compile  the same with the model wrapped in torch.compile
  accrue           `accrue-worker train` with [performance] cuda_graphs = true
                   and, on CUDA, [optimizer] fused = true (the same fused
                   AdamW kernel as PyTorch's side)
  accrue-eager     the same with cuda_graphs = false
  accrue-aten      `accrue` with ACCRUE_FUSED_KERNELS=0: the fused
                   operations through ATen's ops instead of accrue's CUDA
                   kernels (what the kernels are worth)

tokens/s: target tokens of the steps after --warmup over the time since
the warm-up ended (accrue: when each step's JSON line is read). MFU:
tokens/s x model FLOPs per token / --peak-tflops (default 989: an H100
SXM's dense bf16), FLOPs per token = 6 x (parameters in matmuls, the head
included) + 12 x layers x hidden x T (attention scores and values, forward
and backward), as PaLM's appendix counts them.

  python worker/benches/lm_gpu.py --binary gpu-bin/accrue-worker \\
      [--preset 100m] [--seq-len 1024] [--batch 8] [--k 4] [--steps 30] \\
      [--warmup 10] [--rounds 2] [--sides ...]

`--device cpu --preset tiny` runs the same driver on the CPU (a smoke run
of the driver itself; its numbers mean nothing).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from amp_vs_pytorch import run_spec  # noqa: E402

SIDES = ["pytorch-eager", "pytorch-compile", "accrue", "accrue-eager", "accrue-aten"]
PRESETS = {
    # ~110 M parameters (tied embeddings): GPT-2 small's shape, Llama's blocks.
    "100m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                 num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2),
}
LR, WD, MAX_NORM, SEED = 3e-4, 0.1, 1.0, 0


def model_config(a):
    c = dict(PRESETS[a.preset])
    c.update(max_position_embeddings=a.seq_len, tie_word_embeddings=True,
             rms_norm_eps=1e-6, rope_theta=10000.0)
    return c


def flops_per_token(c, t):
    h, i, layers, v = (c["hidden_size"], c["intermediate_size"],
                       c["num_hidden_layers"], c["vocab_size"])
    d = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * d
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i
    matmul_params = layers * per_layer + v * h
    return 6 * matmul_params + 12 * layers * h * t


def parameters(c):
    h, i, layers, v = (c["hidden_size"], c["intermediate_size"],
                       c["num_hidden_layers"], c["vocab_size"])
    kv = c["num_key_value_heads"] * (h // c["num_attention_heads"])
    return v * h + layers * (h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h) + h


def write_tokens(path, count, vocab):
    """An llm.c token file (u16 when the vocabulary fits, else u32) of
    uniform tokens (the standard library only: the GPU machine's Python
    has torch and little else)."""
    import array
    import random
    rng = random.Random(SEED)
    u16 = vocab <= 65536
    header = array.array("i", [0] * 256)
    header[0], header[1], header[2] = (20240520 if u16 else 20240801), 1, count
    tokens = array.array("H" if u16 else "I", (rng.randrange(vocab) for _ in range(count)))
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.tobytes())


def accrue_job(a, c, data, graphs):
    lines = "\n".join(f"{k} = {json.dumps(v) if not isinstance(v, bool) else str(v).lower()}"
                      for k, v in c.items())
    return f"""name = "lm-gpu"
seed = {SEED}
max_steps = {a.steps}
device = "{a.device}"
precision = "{a.precision}"

[model]
kind = "llama"
{lines}

[data]
kind = "tokens"
path = "{data}"
seq_len = {a.seq_len}
batch_size = {a.batch}
shuffle = true

[accumulation]
steps = {a.k}
normalize = "global_count"

[clipping]
max_norm = {MAX_NORM}

[optimizer]
kind = "adamw"
lr = {LR}
weight_decay = {WD}
fused = {"true" if a.device.startswith("cuda") else "false"}

[performance]
cuda_graphs = {"true" if graphs else "false"}
"""


def llama(c):
    """transformers' LlamaForCausalLM in plain PyTorch (same names, same
    arithmetic: fp32 RMSNorm, rotate_half RoPE, SDPA with is_causal, SwiGLU,
    tied head), so the GPU machine's Python needs only torch. Checked
    against transformers where it is installed (`--check`)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    h, heads, kvh = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d, eps = h // heads, c["rms_norm_eps"]

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(h))

        def forward(self, x):
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
            return self.weight * x32.to(x.dtype)

    def rotate_half(x):
        return torch.cat((-x[..., d // 2:], x[..., : d // 2]), -1)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = nn.Linear(h, heads * d, bias=False)
            self.k_proj = nn.Linear(h, kvh * d, bias=False)
            self.v_proj = nn.Linear(h, kvh * d, bias=False)
            self.o_proj = nn.Linear(heads * d, h, bias=False)

        def forward(self, x, cos, sin):
            n, t, _ = x.shape
            q = self.q_proj(x).view(n, t, -1, d).transpose(1, 2)
            k = self.k_proj(x).view(n, t, -1, d).transpose(1, 2)
            v = self.v_proj(x).view(n, t, -1, d).transpose(1, 2)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               enable_gqa=kvh < heads)
            return self.o_proj(o.transpose(1, 2).reshape(n, t, -1))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            i = c["intermediate_size"]
            self.gate_proj = nn.Linear(h, i, bias=False)
            self.up_proj = nn.Linear(h, i, bias=False)
            self.down_proj = nn.Linear(i, h, bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn, self.mlp = Attention(), MLP()
            self.input_layernorm, self.post_attention_layernorm = RMSNorm(), RMSNorm()

        def forward(self, x, cos, sin):
            x = x + self.self_attn(self.input_layernorm(x), cos, sin)
            return x + self.mlp(self.post_attention_layernorm(x))

    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(c["vocab_size"], h)
            self.layers = nn.ModuleList(Layer() for _ in range(c["num_hidden_layers"]))
            self.norm = RMSNorm()
            inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
            self.register_buffer("inv_freq", inv, persistent=False)

        def forward(self, ids):
            x = self.embed_tokens(ids)
            pos = torch.arange(ids.shape[1], device=ids.device).float()
            emb = torch.outer(pos, self.inv_freq)
            emb = torch.cat((emb, emb), -1)
            cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
            for layer in self.layers:
                x = layer(x, cos, sin)
            return self.norm(x)

    class CausalLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Body()
            for mod in self.modules():
                if isinstance(mod, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(mod.weight, std=0.02)

        def forward(self, ids):
            # Tied head; fp32 logits as transformers' loss upcasts them.
            return F.linear(self.model(ids), self.model.embed_tokens.weight).float()

    return CausalLM()


def check_against_transformers(c):
    """The plain model's logits equal transformers' on the same weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    ours = llama(c)
    theirs = LlamaForCausalLM(LlamaConfig(**c, use_cache=False, attn_implementation="sdpa"))
    theirs.load_state_dict(ours.state_dict(), strict=False)
    ids = torch.randint(0, c["vocab_size"], (2, 16))
    diff = (ours(ids) - theirs(input_ids=ids).logits.float()).abs().max().item()
    if diff > 1e-5:
        sys.exit(f"the plain Llama differs from transformers' by {diff:e}")
    print(f"plain Llama vs transformers' LlamaForCausalLM: max |logits diff| {diff:.1e}",
          file=sys.stderr)


def torch_step(model, compile_, dev, vocab, batch, seq_len, k, precision, gen=None):
    """One optimizer step of the PyTorch side, as a function of nothing:
    k micro-batches of uniform tokens, loss = CE_sum / N (N = the window's
    targets) under torch.autocast, backward; then clip_grad_norm_, AdamW
    (fused on CUDA), zero_grad(set_to_none). Used by the benchmark and by
    lm_gpu_profile.py."""
    import torch
    import torch.nn.functional as F
    fwd = torch.compile(model) if compile_ else model
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD,
                            fused=dev.type == "cuda")
    kind = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    def step():
        rows = torch.randint(0, vocab, (k, batch, seq_len + 1), device=dev, generator=gen)
        n = rows[:, :, 1:].numel()
        for m in range(k):
            x, y = rows[m, :, :-1], rows[m, :, 1:]
            with torch.autocast(dev.type, dtype=kind, enabled=kind is not None):
                logits = fwd(x)
                loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1),
                                       reduction="sum") / n
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def torch_child(cfg):
    import torch
    torch.manual_seed(SEED)
    dev = torch.device(cfg["device"])
    c = cfg["model"]
    model = llama(c).to(dev)
    gen = torch.Generator(device=dev).manual_seed(SEED)
    step = torch_step(model, cfg["compile"], dev, c["vocab_size"], cfg["batch"],
                      cfg["seq_len"], cfg["k"], cfg["precision"], gen)
    ends = []
    for _ in range(cfg["steps"]):
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        ends.append(time.perf_counter())
    print(json.dumps({"ends": ends}))


def run_torch(a, c, compile_):
    cfg = dict(model=c, device=a.device, compile=compile_, batch=a.batch,
               seq_len=a.seq_len, k=a.k, steps=a.steps, precision=a.precision)
    proc = subprocess.run([sys.executable, __file__, "--_child", json.dumps(cfg)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"pytorch side failed: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["ends"]


def rate(ends, tokens_per_step, warmup):
    return tokens_per_step * (len(ends) - warmup) / (ends[-1] - ends[warmup - 1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default="gpu-bin/accrue-worker")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="100m")
    ap.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--sides", default=",".join(SIDES))
    ap.add_argument("--check", action="store_true",
                    help="first check the plain Llama against transformers (needs transformers)")
    ap.add_argument("--_child", dest="child")
    a = ap.parse_args()
    if a.child:
        return torch_child(json.loads(a.child))
    if a.check:
        check_against_transformers(model_config(a))
    if not 1 <= a.warmup < a.steps:
        sys.exit(f"--warmup must be at least 1 and below --steps ({a.steps}), got {a.warmup}")
    sides = a.sides.split(",")
    unknown = [s for s in sides if s not in SIDES]
    if unknown:
        sys.exit(f"unknown side(s) {unknown}; allowed: {', '.join(SIDES)}")
    c = model_config(a)
    tokens_per_step = a.batch * a.seq_len * a.k
    fpt = flops_per_token(c, a.seq_len)
    results = {s: [] for s in sides}
    with tempfile.TemporaryDirectory(prefix="accrue-lm-gpu-") as tmp:
        data = Path(tmp) / "train.bin"
        write_tokens(data, a.steps * tokens_per_step + a.seq_len + 1, c["vocab_size"])
        for r in range(a.rounds):
            for s in sides[r % len(sides):] + sides[:r % len(sides)]:
                if s.startswith("pytorch"):
                    ends = run_torch(a, c, s == "pytorch-compile")
                else:
                    env = dict(os.environ)
                    if s == "accrue-aten":
                        env["ACCRUE_FUSED_KERNELS"] = "0"
                    ends, _ = run_spec(a.binary, accrue_job(a, c, data, s != "accrue-eager"),
                                       a.threads, env=env)
                tps = rate(ends, tokens_per_step, a.warmup)
                results[s].append(tps)
                print(f"[round {r + 1}] {s}: {tps:,.0f} tokens/s, MFU "
                      f"{100 * tps * fpt / (a.peak_tflops * 1e12):.1f}%", file=sys.stderr)
    print(f"### Llama {a.preset} ({parameters(c) / 1e6:.1f} M parameters), {a.precision}, "
          f"T = {a.seq_len}, b = {a.batch}, k = {a.k}, one rank, {a.device}\n")
    print(f"- command: `{' '.join(sys.argv)}`")
    print(f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"{a.steps} steps a run, the first {a.warmup} not timed; median of {a.rounds} rounds; "
          f"{fpt / 1e9:.2f} GFLOP a token; peak {a.peak_tflops:g} TFLOPS\n")
    print("| side | tokens/s | MFU | / pytorch-eager | / pytorch-compile |")
    print("|---|---:|---:|---:|---:|")
    med = {s: statistics.median(v) for s, v in results.items()}
    for s in sides:
        rel = [f"{med[s] / med[o]:.2f}" if o in med else "" for o in ("pytorch-eager", "pytorch-compile")]
        print(f"| {s} | {med[s]:,.0f} | {100 * med[s] * fpt / (a.peak_tflops * 1e12):.1f}% | "
              f"{rel[0]} | {rel[1]} |")


if __name__ == "__main__":
    main()
