"""The activations a Llama's training forward saves for its backward, as
PyTorch counts them: transformers' model of the shape zero3_memory.py
trains, one micro-batch, every tensor autograd saves recorded through
`torch.autograd.graph.saved_tensors_hooks` and counted once per storage
(parameters and their views left out: the arithmetic counts those). The
"activations" term of issue 41's memory arithmetic (docs/BENCHMARKS.md
section 15), measured independently of accrue.

    .venv/bin/python worker/benches/activation_bytes.py [--layers 8 --hidden 512
        --vocab 4096 --batch 2 --seq-len 128]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_vs_torch import model_fields  # noqa: E402


def saved_bytes(model, ids, attn):
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in params and ptr != 0:
            seen[ptr] = max(seen.get(ptr, 0), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=ids)
    # The loss's own saved tensors are in `seen`; the logits are the
    # output (held until the backward too).
    total = sum(seen.values())
    del out
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    a = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = model_fields(a.layers, a.hidden, a.vocab)
    torch.manual_seed(0)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq_len))
    for attn in ["eager", "sdpa"]:
        cfg = LlamaConfig(**fields, attn_implementation=attn)
        model = LlamaForCausalLM(cfg).train()
        b = saved_bytes(model, ids, attn)
        params = sum(p.numel() for p in model.parameters())
        print(f"{attn}: {b / 2**20:.1f} MiB saved for the backward "
              f"({params / 1e6:.1f} M parameters, b={a.batch}, T={a.seq_len})")


if __name__ == "__main__":
    main()
