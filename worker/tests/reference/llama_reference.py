"""transformers' LlamaForCausalLM on accrue's llama weights (issue 30).

Usage: llama_reference.py CASES_JSON

CASES_JSON lists cases {"dir": ...}; each folder holds what the Rust test
wrote: config.json (accrue's LlamaConfig::to_hf_json), model.safetensors
(accrue's initial weights by name, lm_head left out when tied) and
batch.safetensors (input_ids [N, T] int64 right-padded, targets [N, T]
int64 with -100 on pads and masked tokens, already shifted). For each case
the model is built from the config, the weights are loaded strictly
(load_state_dict(strict=True), lm_head.weight the one key allowed to be
missing, and only when tied), then one forward on the batch, the loss
F.cross_entropy(logits.float(), targets, ignore_index=-100,
reduction="sum") and backward; reference.safetensors gets the logits, the
loss and each gradient as "grad.<name>". Prints one JSON line per case:
the state_dict's names and shapes, and checks made here.
"""

import json
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM


def run(case):
    d = case["dir"]
    # LlamaForCausalLM, or the family config.json's model_type names
    # (Qwen2ForCausalLM, MistralForCausalLM: issue 39).
    config = AutoConfig.from_pretrained(d)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    weights = load_file(f"{d}/model.safetensors")
    state_names = list(model.state_dict().keys())
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    tied = config.tie_word_embeddings
    if tied:
        # HF convention (save_pretrained): the head is the embedding and
        # is not in the file; every other key strictly.
        assert "lm_head.weight" not in weights
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert list(missing) == ["lm_head.weight"], missing
        assert list(unexpected) == [], unexpected
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    else:
        model.load_state_dict(weights, strict=True)
    # from_pretrained reads the same folder offline to the same weights.
    loaded = AutoModelForCausalLM.from_pretrained(d, attn_implementation="sdpa")
    same_weights = all(
        torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items()
    )
    # The same weights as transformers writes a model above its shard size
    # (issue 39): accrue's `init` reads this folder in the test.
    loaded.save_pretrained(f"{d}/hf-sharded", max_shard_size="8KB")
    model.train()
    batch = load_file(f"{d}/batch.safetensors")
    ids, targets = batch["input_ids"], batch["targets"]
    logits = model(input_ids=ids).logits
    vocab = logits.shape[-1]
    loss = F.cross_entropy(
        logits.float().reshape(-1, vocab),
        targets.reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )
    loss.backward()
    out = {"logits": logits.detach().float().contiguous(), "loss": loss.detach().reshape(1)}
    for name, p in model.named_parameters():
        out[f"grad.{name}"] = p.grad.detach().contiguous()
    save_file(out, f"{d}/reference.safetensors")
    if case.get("bf16"):
        # The same step under torch.autocast("cpu", torch.bfloat16).
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            amp_logits = model(input_ids=ids).logits
            amp_loss = F.cross_entropy(
                amp_logits.float().reshape(-1, vocab),
                targets.reshape(-1),
                ignore_index=-100,
                reduction="sum",
            )
        amp_loss.backward()
        amp = {"logits": amp_logits.detach().float().contiguous(), "loss": amp_loss.detach().reshape(1)}
        for name, p in model.named_parameters():
            amp[f"grad.{name}"] = p.grad.detach().contiguous()
        save_file(amp, f"{d}/reference-bf16.safetensors")
    # Right padding under a causal mask: the padding mask changes nothing
    # at the real positions (accrue passes none).
    with torch.no_grad():
        masked = model(input_ids=ids, attention_mask=batch["attention_mask"]).logits
        real = batch["attention_mask"].bool()
        mask_diff = (masked[real] - logits.detach()[real]).abs().max().item()
    return {
        "names": state_names,
        "shapes": shapes,
        "tied": tied,
        "attn": model.config._attn_implementation,
        "class": type(model).__name__,
        "same_weights_from_pretrained": same_weights,
        "mask_diff": mask_diff,
    }


def main():
    torch.set_num_threads(1)
    cases = json.load(open(sys.argv[1]))
    print(json.dumps([run(c) for c in cases]))


if __name__ == "__main__":
    main()
