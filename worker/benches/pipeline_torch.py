"""One rank of torch.distributed.pipelining's Schedule1F1B, ScheduleGPipe
or ScheduleInterleaved1F1B on transformers' Llama layers: the PyTorch
side of pipeline_vs_torch.py.

    torchrun --nproc-per-node P pipeline_torch.py CONFIG_JSON

CONFIG_JSON: {"init": INIT_SAFETENSORS, "tokens": TOKEN_FILE, "seq_len": T,
"batch": b, "k": k, "steps": S, "schedule": "1f1b"|"gpipe"|"interleaved_1f1b",
"stages_per_rank": V (interleaved: V model chunks a rank, default 1),
"model": {...LlamaConfig fields...}, "layers_per_stage": [.. P x V ..],
"out": OUT_JSON}.

Stage (chunk) c holds layers_per_stage[c] decoder layers, the first also
the embedding, the last the final norm and lm_head (accrue's split);
rank r holds chunks r, r + P, ..., r + (V - 1) P (Megatron's virtual
pipeline, as accrue places them).
Every rank reads the same token file (llm.c format, u16) and takes the
window's k micro-batches of b rows of T + 1 tokens in order (sample j =
tokens[jT : jT + T + 1]); the loss is the summed cross-entropy divided by
the window's target count (known in advance: b k T), scale_grads=False;
AdamW (lr 1e-3, weight decay 0.1). Rank 0 writes the wall time of every
step (after a barrier) to OUT_JSON.
"""
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from transformers import LlamaConfig, LlamaForCausalLM


class Stage(torch.nn.Module):
    def __init__(self, model, first, last, layers):
        super().__init__()
        self.first, self.last = first, last
        inner = model.model
        self.embed = inner.embed_tokens if first else None
        self.layers = torch.nn.ModuleList(inner.layers[i] for i in layers)
        self.rotary = inner.rotary_emb
        self.norm = inner.norm if last else None
        self.head = model.lm_head if last else None

    def forward(self, x):
        h = self.embed(x) if self.first else x
        positions = torch.arange(h.shape[1]).unsqueeze(0)
        pe = self.rotary(h, positions)
        for layer in self.layers:
            out = layer(h, attention_mask=None, position_ids=positions, position_embeddings=pe)
            h = out[0] if isinstance(out, tuple) else out
        if self.last:
            return self.head(self.norm(h)).float()
        return h


def main():
    cfg = json.load(open(sys.argv[1]))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = LlamaConfig(**cfg["model"])
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    model.load_state_dict(load_file(cfg["init"]), strict=False)
    per = cfg["layers_per_stage"]
    v_per_rank = cfg.get("stages_per_rank", 1)
    chunks = world * v_per_rank
    t, b, k = cfg["seq_len"], cfg["batch"], cfg["k"]
    tokens_per_window = b * k * t

    def loss_fn(logits, target):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                               reduction="sum") / tokens_per_window

    h = config.hidden_size
    mods, stages = [], []
    for c in range(rank, chunks, world):
        start = sum(per[:c])
        mod = Stage(model, c == 0, c == chunks - 1, range(start, start + per[c]))
        example = (torch.zeros(b, t, dtype=torch.long) if c == 0
                   else torch.zeros(b, t, h))
        mods.append(mod)
        stages.append(PipelineStage(mod, c, chunks, torch.device("cpu"), input_args=(example,)))
    if cfg["schedule"] == "interleaved_1f1b":
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=k, loss_fn=loss_fn,
                                           scale_grads=False)
    else:
        kind = Schedule1F1B if cfg["schedule"] == "1f1b" else ScheduleGPipe
        schedule = kind(stages[0], n_microbatches=k, loss_fn=loss_fn, scale_grads=False)
    params = [p for m in mods for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    raw = np.fromfile(cfg["tokens"], dtype=np.int32, count=256)
    data = np.fromfile(cfg["tokens"], dtype=np.uint16, offset=1024, count=int(raw[2]))
    data = torch.from_numpy(data.astype(np.int64))
    times = []
    for step in range(cfg["steps"]):
        rows = torch.stack([data[j * t:(j + 1) * t + 1]
                            for j in range(step * b * k, (step + 1) * b * k)])
        x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
        opt.step()
        opt.zero_grad()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        with open(cfg["out"], "w") as f:
            json.dump({"times": times}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
