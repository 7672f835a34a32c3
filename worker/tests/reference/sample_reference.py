"""transformers' greedy generation on a llama checkpoint accrue wrote
(issue 30, `accrue sample`).

Usage: sample_reference.py STEP_DIR PROMPT_IDS_JSON MAX_NEW_TOKENS

STEP_DIR holds config.json (accrue's LlamaConfig::to_hf_json) and
model.safetensors (accrue's names); LlamaForCausalLM.from_pretrained loads
it offline (SDPA attention, fp32, one thread) and
model.generate(input_ids, do_sample=False, max_new_tokens=N) continues the
prompt, with no end-of-sequence token (the config's default eos id 2 would
otherwise stop it early). Prints one JSON object: the new tokens, the
logits the last one was chosen from, and whether every weight of the file
was used.
"""

import json
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def main():
    step_dir, prompt, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(
        step_dir, attn_implementation="sdpa", dtype=torch.float32
    ).eval()
    state = model.state_dict()
    weights = load_file(f"{step_dir}/model.safetensors")
    same = all(torch.equal(state[k], v) for k, v in weights.items())
    gen = model.generation_config
    gen.eos_token_id = None
    gen.bos_token_id = None
    gen.pad_token_id = 0
    input_ids = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt):].tolist()
    last = out.logits[-1][0].float().tolist()
    print(
        json.dumps(
            {
                "tokens": tokens,
                "last_logits": last,
                "same_weights": same,
                "names": sorted(weights.keys()) == sorted(state.keys()),
            }
        )
    )


if __name__ == "__main__":
    main()
