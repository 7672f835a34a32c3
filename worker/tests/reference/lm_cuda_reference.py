"""PyTorch's side of accrue's Llama on CUDA under bf16 autocast
(worker/tests/lm_lifecycle.rs, `lm_bf16_on_cuda_equals_pytorch`). The GPU
machine's Python has torch only, so the model is worker/benches/lm_gpu.py's
`llama()`: transformers' LlamaForCausalLM in plain PyTorch (same names and
arithmetic; its `--check` compares the two on the CPU).

  lm_cuda_reference.py init DIR CFG_JSON
      the model's initial weights (torch.manual_seed(cfg seed)) as
      DIR/init.safetensors by transformers' names (tied head: no lm_head)
  lm_cuda_reference.py train DIR CFG_JSON
      trains from DIR/init.safetensors on DIR/train.bin (an llm.c u16 token
      file; sample j = tokens[jT : jT + T + 1], windows of k micro-batches
      of b samples in file order) on cfg device ("cuda" by default; "cpu"
      checks the harness) under torch.autocast(device, bfloat16): per
      micro-batch backward of the summed cross-entropy of
      logits.float(); the gradients divided by the window's target count
      N after the window (cfg order "after", accrue's order) or the loss
      divided by N before each backward (order "before", transformers'
      Trainer's); clip_grad_norm_, AdamW(fused=True); prints each step's
      loss (sum / N) and grad norm as JSON and writes the final weights to
      DIR/torch-<order>.safetensors
"""
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))
from lm_gpu import llama  # noqa: E402


def tokens(path):
    raw = Path(path).read_bytes()
    header = torch.frombuffer(bytearray(raw[:1024]), dtype=torch.int32)
    assert int(header[0]) == 20240520, "not an llm.c u16 token file"
    count = int(header[2])
    return torch.frombuffer(bytearray(raw[1024:1024 + 2 * count]), dtype=torch.int16).to(torch.int64) & 0xFFFF


def init(d, cfg):
    torch.manual_seed(cfg["seed"])
    model = llama(cfg["model"])
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, f"{d}/init.safetensors")


def train(d, cfg):
    dev = torch.device(cfg.get("device", "cuda"))
    c, t, b, k = cfg["model"], cfg["seq_len"], cfg["batch"], cfg["k"]
    model = llama(c).to(dev)
    model.load_state_dict(load_file(f"{d}/init.safetensors", device=str(dev)))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"],
                            fused=True)
    toks = tokens(f"{d}/train.bin").to(dev)
    losses, norms = [], []
    for step in range(cfg["steps"]):
        rows = [toks[j * t: j * t + t + 1] for j in range(step * k * b, (step + 1) * k * b)]
        rows = torch.stack(rows).view(k, b, t + 1)
        n = rows[:, :, 1:].numel()
        total = 0.0
        for m in range(k):
            x, y = rows[m, :, :-1], rows[m, :, 1:]
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, c["vocab_size"]).float(), y.reshape(-1),
                                   reduction="sum")
            total += loss.item()
            (loss / n if cfg["order"] == "before" else loss).backward()
        if cfg["order"] == "after":
            for p in model.parameters():
                p.grad.div_(n)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["max_norm"]).item())
        losses.append(total / n)
        opt.step()
        opt.zero_grad(set_to_none=True)
    save_file({k: v.detach().float().contiguous().cpu() for k, v in model.state_dict().items()},
              f"{d}/torch-{cfg['order']}.safetensors")
    print(json.dumps({"losses": losses, "norms": norms, "device": str(dev)}))


if __name__ == "__main__":
    cmd, d, cfg = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    {"init": init, "train": train}[cmd](d, cfg)
