#!/usr/bin/env python3
"""PyTorch's own tensor parallelism, the other side of worker/benches/
tensor_parallel.py (issue 42; docs/BENCHMARKS.md section 16), run under
torchrun with T processes.

transformers' LlamaForCausalLM on a 1-D device mesh over gloo (CPU),
`parallelize_module` with torchtitan's plan: per decoder layer q, k, v,
gate and up `ColwiseParallel`, o and down `RowwiseParallel`; the
embedding `RowwiseParallel(input_layouts=Replicate())` and the head
`ColwiseParallel(output_layouts=Replicate())` (the logits gathered whole,
as accrue's autograd path does). AdamW, the norm clipped at 1.0 (the
sharded gradients' norm over the mesh with the replicated ones', counted
once: clip_grad_norm_ itself refuses the mix), the same token file and windows as accrue's run
(data = 1: every rank reads the same rows), k micro-batches of b rows a
step. Each rank writes OUT/tp-rank<r>.json: its step times (seconds) and
its peak resident memory (MiB, ru_maxrss at the end of training).

    torchrun --nproc-per-node T tp_torch.py CONFIG_JSON OUT
"""

import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)
from transformers import LlamaConfig, LlamaForCausalLM

cfg = json.loads(sys.argv[1])
out = sys.argv[2]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(**cfg["model"], use_cache=False))
if world > 1:
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        })
    parallelize_module(model, mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    })


def clip(params, max_norm):
    """clip_grad_norm_ over sharded (DTensor) and replicated (plain)
    gradients: clip_grad_norm_ refuses the mix, so each kind's norm is
    taken apart (a DTensor's over the mesh, a replicated tensor's once)
    and the grads scaled by one coefficient."""
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g for g in grads if isinstance(g, DTensor)]
    whole = [g for g in grads if not isinstance(g, DTensor)]
    total = torch.zeros(())
    if sharded:
        n = torch.nn.utils.get_total_norm(sharded, 2.0)
        total = total + (n.full_tensor() if isinstance(n, DTensor) else n) ** 2
    if whole:
        total = total + torch.nn.utils.get_total_norm(whole, 2.0) ** 2
    coef = min(1.0, max_norm / (float(total.sqrt()) + 1e-6))
    for g in grads:
        g.mul_(coef)


opt = torch.optim.AdamW(model.parameters(), lr=0.001, weight_decay=0.1)
t, b, k = cfg["seq_len"], cfg["batch"], cfg["k"]
with open(cfg["tokens"], "rb") as f:
    header = torch.frombuffer(bytearray(f.read(1024)), dtype=torch.int32)
    ids = torch.frombuffer(bytearray(f.read(int(header[2]) * 2)), dtype=torch.int16)
ids = ids.to(torch.int64) & 0xFFFF
rows = ids[: (len(ids) - 1) // (t + 1) * (t + 1)].view(-1, t + 1)
times = []
for step in range(cfg["steps"]):
    start = time.perf_counter()
    for i in range(k):
        batch = rows[(step * k + i) * b:(step * k + i + 1) * b]
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(),
                               batch[:, 1:].reshape(-1), reduction="sum") / (b * t * k)
        loss.backward()
    clip(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - start)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
with open(os.path.join(out, f"tp-rank{rank}.json"), "w") as f:
    json.dump({"times": times, "peak_mib": peak}, f)
dist.barrier()
sys.stdout.flush()
os._exit(0)
