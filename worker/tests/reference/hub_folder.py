"""transformers reads an accrue step folder as a Hub model (issue 39).

    python hub_folder.py STEP_DIR OUT_JSON PROMPT_IDS

Loads STEP_DIR with AutoTokenizer, GenerationConfig and
AutoModelForCausalLM (offline), then greedy-generates from PROMPT_IDS
(comma-separated) with up to 10 new tokens, the end-of-text id forbidden
for the first two and forced as the third (prefix_allowed_tokens_fn): the
generation config is what must stop it there. Also runs
pipeline("text-generation") on the folder. Writes what it saw to OUT_JSON,
and the model's state dict as loaded to OUT_JSON's name + ".safetensors".
"""
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerFast,
    pipeline,
)


def main():
    step, out, prompt = sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3].split(",")]
    tok = AutoTokenizer.from_pretrained(step)
    gen = GenerationConfig.from_pretrained(step)
    model = AutoModelForCausalLM.from_pretrained(step)
    eos = tok.eos_token_id
    vocab = model.config.vocab_size
    others = [i for i in range(vocab) if i != eos]

    def allowed(_batch, ids):
        return [eos] if ids.shape[-1] - len(prompt) == 2 else others

    torch.manual_seed(0)
    with torch.no_grad():
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                             prefix_allowed_tokens_fn=allowed)
    new = ids[0, len(prompt):].tolist()
    # The tokenizer of tokenizer.json itself: transformers 5 maps a generic
    # tokenizer_class to the model type's own (Qwen2Tokenizer for qwen2),
    # which re-splits this test's word-level vocabulary into nothing.
    fast = PreTrainedTokenizerFast.from_pretrained(step)
    text = pipeline("text-generation", model=step, tokenizer=fast)(
        fast.decode(prompt), max_new_tokens=3, do_sample=False)[0]["generated_text"]
    from safetensors.torch import save_file
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
              out + ".safetensors")
    with open(out, "w") as f:
        json.dump({
            "eos_token": tok.eos_token,
            "eos_token_id": eos,
            "generation_eos": gen.eos_token_id,
            "config_eos": model.config.eos_token_id,
            "model_max_length": tok.model_max_length,
            "new_tokens": new,
            "pipeline_text": text,
            "class": type(model).__name__,
        }, f)


if __name__ == "__main__":
    main()
