"""transformers loads an accrue step folder (issue 40: a pipeline job's).

    python load_step.py STEP_DIR OUT.safetensors

AutoModelForCausalLM.from_pretrained(STEP_DIR) offline, its state_dict
written to OUT (tied tensors cloned apart).
"""
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


def main():
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
              sys.argv[2])


if __name__ == "__main__":
    main()
