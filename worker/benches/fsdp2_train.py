#!/usr/bin/env python3
"""PyTorch FSDP2's side of the ZeRO-3 benchmark (worker/benches/
zero3_memory.py; docs/BENCHMARKS.md section 15), run under torchrun.

transformers' LlamaForCausalLM with `fully_shard` on every decoder layer
and on the model (gloo, CPU, FSDP2's defaults: reshard_after_forward),
AdamW, the same token file and windows as accrue's run (rank r reads rows
r, r + W, ... of T + 1 tokens), k micro-batches of b rows a step:
`sync = "boundary"` sets `set_requires_gradient_sync(False)` on all but
the window's last micro-batch, `"every_step"` reduces every one; with
`ac`, transformers' gradient checkpointing on every layer; with
`keep_gathered`, `reshard_after_forward=False`. Each rank
writes OUT/fsdp-rank<r>.json: its step times (seconds) and its peak
resident memory (MiB, getrusage's ru_maxrss at the end of training).

    torchrun --nproc-per-node W fsdp2_train.py CONFIG_JSON OUT
"""

import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

cfg = json.loads(sys.argv[1])
out = sys.argv[2]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(**cfg["model"], use_cache=False))
if cfg["ac"]:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
keep = cfg.get("keep_gathered", False)
for layer in model.model.layers:
    fully_shard(layer, reshard_after_forward=not keep)
fully_shard(model, reshard_after_forward=not keep)
opt = torch.optim.AdamW(model.parameters(), lr=0.001, weight_decay=0.1)
t, b, k = cfg["seq_len"], cfg["batch"], cfg["k"]
with open(cfg["tokens"], "rb") as f:
    header = torch.frombuffer(bytearray(f.read(1024)), dtype=torch.int32)
    ids = torch.frombuffer(bytearray(f.read(int(header[2]) * 2)), dtype=torch.int16)
ids = ids.to(torch.int64) & 0xFFFF
rows = ids[: (len(ids) - 1) // (t + 1) * (t + 1)].view(-1, t + 1)
mine = rows[rank::world]
times = []
for step in range(cfg["steps"]):
    start = time.perf_counter()
    for i in range(k):
        batch = mine[(step * k + i) * b:(step * k + i + 1) * b]
        model.set_requires_gradient_sync(i + 1 == k or cfg["sync"] == "every_step")
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1),
                               reduction="sum") / (b * t * k)
        loss.backward()
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - start)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
with open(os.path.join(out, f"fsdp-rank{rank}.json"), "w") as f:
    json.dump({"times": times, "peak_mib": peak}, f)
dist.barrier()
sys.stdout.flush()
os._exit(0)
