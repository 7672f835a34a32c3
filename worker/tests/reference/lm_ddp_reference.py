"""The independent reference for accrue's causal language-model training:
transformers' LlamaForCausalLM under PyTorch DDP (gloo) with no_sync, the
loss normalized by the window's global target count as Hugging Face's
Trainer does it (CE_sum * W / N_global per rank, then DDP's average).

  python lm_ddp_reference.py prepare DIR CONFIG_JSON
      writes DIR/init.safetensors (the model's initial weights, HF names)
      and DIR/data.safetensors (a `sequences` file: tokens, offsets,
      loss_mask) with rows of very uneven length per rank, a micro-batch
      without any target and a fully masked row.

  python -m torch.distributed.run --nproc-per-node 2 ... \
      lm_ddp_reference.py train DIR CONFIG_JSON
      trains each mode in CONFIG["modes"] ("global_count" or "mean") from
      the initial weights: DistributedSampler(shuffle=False), micro-batches
      of b rows, backward of CE_sum * W / N_global (global_count) or of
      the micro-batch's token mean / k (mean; 0 without targets) under
      ddp.no_sync() for k - 1 micro-batches, then clip_grad_norm_, AdamW
      and zero_grad. Rank r writes DIR/ddp-<mode>-rank<r>.safetensors (the
      final state_dict, HF names) and DIR/ddp-<mode>-rank<r>.json (per
      step: the loss (the window's token-weighted mean), the total norm
      before clipping and N).

  python lm_ddp_reference.py hf DIR CONFIG_JSON
      transformers against accrue's files: loads accrue's step folder
      CONFIG["step_dir"] with LlamaForCausalLM.from_pretrained (offline)
      and writes the logits it gives for DIR/ids.safetensors's `ids` to
      DIR/hf-logits.safetensors; then writes a fresh model with
      save_pretrained to DIR/hf (and sharded at 16 KB to DIR/hf-sharded,
      in bfloat16 to DIR/hf-bf16) and the loss per target token of its
      first 16 rows (accrue's rows-to-samples rule) to DIR/hf-loss.json.

Optional "reference": "fsdp" trains with FSDP2 instead of DDP (issue 41,
ZeRO-3): fully_shard on every decoder layer and on the model (gloo), and
with CONFIG["sync"] = "boundary" set_requires_gradient_sync(False) on all
but each window's last micro-batch ("every_step": every micro-batch
reduces); global_count only: FSDP2's reduce-scatter averages (its
set_gradient_divide_factor(1.0) asks gloo for PREMUL_SUM, which gloo
refuses), so each micro-batch's backward is of CE_sum * W / N_global, then
clip_grad_norm_ on the sharded gradients, AdamW; rank r writes the full
state_dict to DIR/fsdp-<sync>-global_count-rank<r>.safetensors and its
steps to the .json beside it.

CONFIG_JSON: seed, batch, k, epochs, seq_len, max_norm, lr, weight_decay,
pad_id, model (LlamaConfig fields), modes; optional "model_type" (qwen2,
mistral: their class, "model" with their keys); optional "optimizer": "sgd"
(torch.optim.SGD at lr and weight_decay, no momentum, instead of AdamW; the
ddp mode only); optional "precision": "bf16"
runs the forward and the loss under torch.autocast("cpu", bfloat16)
(fp32 master weights, as accrue's precision = "bf16") with backward of
CE_sum * W and the summed gradients divided by N_global after the
all-reduce (the same gradient, in accrue's order), and its outputs are
named ddp-bf16-<mode>-rank<r>.*; "fp16" runs under torch.autocast("cpu",
float16) with torch.amp.GradScaler("cpu"), each rank's backward of
CE_sum * scale / k (accrue's order, so fp16 overflows where accrue's
would), unscale_, the gradients times k * W / N_global, clip, scaler.step
and update; outputs ddp-fp16-<mode>-rank<r>.*.
"""
import contextlib
import copy
import json
import math
import os
import sys

mode = sys.argv[1]
out_dir = sys.argv[2]
cfg = json.loads(sys.argv[3])
rank = int(os.environ.get("RANK", "0"))
if mode == "train":
    log = open(os.path.join(out_dir, f"ddp-rank{rank}.log"), "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    with open(os.path.join(out_dir, f"ddp-rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM  # noqa: E402


def build():
    # CONFIG's optional "model_type" (qwen2, mistral: issue 39) picks the
    # class; "model" may carry its own keys (sliding_window, rope_scaling).
    # Optional "attn": "eager" (transformers' own attention instead of
    # SDPA: another valid order of the same sums, for a floor).
    config = AutoConfig.for_model(cfg.get("model_type", "llama"), **cfg["model"],
                                  use_cache=False)
    return AutoModelForCausalLM.from_config(config,
                                            attn_implementation=cfg.get("attn", "sdpa"))


def weights(model):
    """The state_dict as save_pretrained writes it: a tied head is the
    embedding and is left out (safetensors refuses shared storage)."""
    tied = model.config.tie_word_embeddings
    return {k: v.contiguous() for k, v in model.state_dict().items()
            if not (tied and k == "lm_head.weight")}


def prepare():
    torch.manual_seed(cfg["seed"])
    model = build()
    save_file(weights(model), f"{out_dir}/init.safetensors")
    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    t, vocab = cfg["seq_len"], cfg["model"]["vocab_size"]
    rows, masks = [], []
    n = cfg["rows"]
    for i in range(n):
        if i % 2 == 0:
            # Rank 0 (DistributedSampler without shuffle: even rows): long
            # rows, some longer than T + 1 (cut).
            length = int(torch.randint(t - 2, t + 6, (1,), generator=g))
        else:
            # Rank 1: short rows; its first micro-batch (rows 1 and 3) has
            # no target at all (one token each).
            length = 1 if i in (1, 3) else int(torch.randint(2, 5, (1,), generator=g))
        row = torch.randint(0, vocab, (length,), generator=g)
        mask = torch.ones(length, dtype=torch.uint8)
        if i == 4:
            mask[:] = 0  # a fully masked row
        elif length > 4:
            mask[: length // 3] = 0  # a prompt
        rows.append(row)
        masks.append(mask)
    offsets = torch.tensor([0] + [len(r) for r in rows]).cumsum(0)
    save_file({
        "tokens": torch.cat(rows).to(torch.int32),
        "offsets": offsets.to(torch.int64),
        "loss_mask": torch.cat(masks),
    }, f"{out_dir}/data.safetensors")


def rows_to_batch(data, idx):
    """accrue's rule: cut to T + 1, inputs row[:-1], targets row[1:]
    (-100 where the target's mask is 0), right-padded to T."""
    t, pad = cfg["seq_len"], cfg["pad_id"]
    tok, off, m = data["tokens"].long(), data["offsets"], data["loss_mask"]
    inputs = torch.full((len(idx), t), pad, dtype=torch.long)
    targets = torch.full((len(idx), t), -100, dtype=torch.long)
    for j, i in enumerate(idx):
        row = tok[off[i]:off[i + 1]][: t + 1]
        mask = m[off[i]:off[i + 1]][: t + 1]
        n = len(row) - 1
        if n <= 0:
            continue
        inputs[j, :n] = row[:-1]
        tg = row[1:].clone()
        tg[mask[1:] == 0] = -100
        targets[j, :n] = tg
    return inputs, targets


def load_init(model):
    """The prepared initial weights, strictly but for a tied head (which
    is the embedding)."""
    missing, unexpected = model.load_state_dict(
        load_file(f"{out_dir}/init.safetensors"), strict=False)
    tied = model.config.tie_word_embeddings
    assert list(missing) == (["lm_head.weight"] if tied else []), missing
    assert list(unexpected) == [], unexpected


def windows(data, n, b, k, world):
    """Each window of this rank's micro-batches (DistributedSampler, no
    shuffle, every epoch) with the window's global target count."""
    import torch.distributed as dist
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=False)
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        mine = list(sampler)
        micro = [mine[i:i + b] for i in range(0, len(mine), b)]
        for w in range(0, len(micro), k):
            window = [rows_to_batch(data, idx) for idx in micro[w:w + k]]
            count = torch.tensor(float(sum(int((t != -100).sum()) for _, t in window)))
            dist.all_reduce(count)
            yield window, count.item()


def train():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    data = load_file(f"{out_dir}/data.safetensors")
    n = len(data["offsets"]) - 1
    b, k = cfg["batch"], cfg["k"]
    precision = cfg.get("precision", "fp32")
    bf16 = precision == "bf16"
    fp16 = precision == "fp16"
    tag = "" if precision == "fp32" else precision + "-"
    if cfg.get("reference") == "fsdp":
        return train_fsdp(data, n, b, k, world)
    for norm_mode in cfg["modes"]:
        model = build()
        load_init(model)
        ddp = DistributedDataParallel(model)
        opt_class = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[cfg.get("optimizer", "adamw")]
        opt = opt_class(ddp.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
        scaler = torch.amp.GradScaler("cpu") if fp16 else None
        scales = []
        steps = []
        for window, n_global in windows(data, n, b, k, world):
            loss_sum = torch.zeros((), dtype=torch.float64)
            for i, (x, t) in enumerate(window):
                sync = i + 1 == len(window)
                amp = (torch.autocast("cpu", dtype=torch.bfloat16) if bf16
                       else torch.autocast("cpu", dtype=torch.float16) if fp16
                       else contextlib.nullcontext())
                with contextlib.nullcontext() if sync else ddp.no_sync():
                    with amp:
                        logits = ddp(input_ids=x).logits.float()
                        ce = F.cross_entropy(logits.view(-1, logits.size(-1)), t.view(-1),
                                             ignore_index=-100, reduction="sum")
                        loss_sum += ce.detach().double()
                        if norm_mode == "global_count" and fp16:
                            # accrue's order: each rank's backward of
                            # the sum * scale / k (GradScaler's scale),
                            # so fp16 overflows where accrue's would;
                            # DDP averages, then the gradients are
                            # unscaled and multiplied by k * W / N.
                            loss = scaler.scale(ce / len(window))
                        elif norm_mode == "global_count" and bf16:
                            # accrue's order: backward of the sum (x W
                            # against DDP's average), 1/N after the
                            # reduction; 1/N inside a bf16 backward
                            # rounds differently (and AdamW's first
                            # steps turn a flipped near-zero gradient
                            # into a whole lr).
                            loss = ce * world
                        elif norm_mode == "global_count":
                            loss = ce * world / n_global
                        else:
                            targets = int((t != -100).sum())
                            loss = (ce / targets if targets else ce * 0.0) / len(window)
                    loss.backward()
            dist.all_reduce(loss_sum)
            if norm_mode == "global_count" and bf16:
                for p in model.parameters():
                    p.grad.div_(n_global)
            if fp16:
                scales.append(scaler.get_scale())
                scaler.unscale_(opt)
                for p in model.parameters():
                    p.grad.mul_(len(window) * world / n_global)
            norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=cfg["max_norm"])
            if fp16:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
            # JSON has no inf: a non-finite norm (an fp16 overflow) is null.
            g = norm.item()
            steps.append({"loss": loss_sum.item() / n_global,
                          "grad_norm": g if math.isfinite(g) else None,
                          "tokens": n_global, "loss_scale": scales[-1] if fp16 else 0.0})
        save_file(weights(model), f"{out_dir}/ddp-{tag}{norm_mode}-rank{rank}.safetensors")
        with open(f"{out_dir}/ddp-{tag}{norm_mode}-rank{rank}.json", "w") as f:
            json.dump({"world": world, "steps": steps}, f)
    # Every file is written: leave without tearing gloo down
    # (destroy_process_group, or the interpreter's exit, once sat in a
    # futex for minutes on one rank after both had written everything).
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def train_fsdp(data, n, b, k, world):
    """FSDP2 (see the module documentation): accrue's ZeRO-3 reference."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    sync_mode = cfg["sync"]
    model = build()
    load_init(model)
    tied = model.config.tie_word_embeddings
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    steps = []
    for window, n_global in windows(data, n, b, k, world):
        loss_sum = torch.zeros((), dtype=torch.float64)
        for i, (x, t) in enumerate(window):
            last = i + 1 == len(window)
            model.set_requires_gradient_sync(last or sync_mode == "every_step")
            logits = model(input_ids=x).logits.float()
            ce = F.cross_entropy(logits.view(-1, logits.size(-1)), t.view(-1),
                                 ignore_index=-100, reduction="sum")
            loss_sum += ce.detach().double()
            (ce * world / n_global).backward()
        dist.all_reduce(loss_sum)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=cfg["max_norm"])
        opt.step()
        opt.zero_grad()
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        steps.append({"loss": loss_sum.item() / n_global, "grad_norm": norm.item(),
                      "tokens": n_global, "loss_scale": 0.0})
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).contiguous()
            for k, v in model.state_dict().items()
            if not (tied and k == "lm_head.weight")}
    name = f"fsdp-{sync_mode}-global_count-rank{rank}"
    save_file(full, f"{out_dir}/{name}.safetensors")
    with open(f"{out_dir}/{name}.json", "w") as f:
        json.dump({"world": world, "steps": steps}, f)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def hf():
    model = LlamaForCausalLM.from_pretrained(cfg["step_dir"], local_files_only=True)
    model.eval()
    ids = load_file(f"{out_dir}/ids.safetensors")["ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    save_file({"logits": logits.contiguous()}, f"{out_dir}/hf-logits.safetensors")
    torch.manual_seed(cfg["seed"] + 2)
    fresh = build()
    fresh.save_pretrained(f"{out_dir}/hf")
    # The same weights as transformers writes a model above its shard
    # size (model-0000i-of-0000n.safetensors + the index), in float32 and
    # in bfloat16 (what the Hub mostly holds).
    fresh.save_pretrained(f"{out_dir}/hf-sharded", max_shard_size="16KB")
    copy.deepcopy(fresh).to(torch.bfloat16).save_pretrained(
        f"{out_dir}/hf-bf16", max_shard_size="16KB")
    data = load_file(f"{out_dir}/data.safetensors")
    x, t = rows_to_batch(data, list(range(16)))
    with torch.no_grad():
        logits = fresh(input_ids=x).logits.float()
        ce = F.cross_entropy(logits.view(-1, logits.size(-1)), t.view(-1),
                             ignore_index=-100, reduction="sum")
    n = int((t != -100).sum())
    with open(f"{out_dir}/hf-loss.json", "w") as f:
        json.dump({"loss": ce.item() / n, "tokens": n}, f)


{"prepare": prepare, "train": train, "hf": hf}[mode]()
