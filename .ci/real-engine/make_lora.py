"""Makes a LoRA adapter for the tiny model, with no download: rank 8 on every layer's q_proj
and v_proj, random weights (it need not be good, only loaded and served).

Usage: python make_lora.py DIR
"""

import json
import os
import sys

import torch
from safetensors.torch import save_file

RANK = 8
HIDDEN = 128
LAYERS = 2


def main() -> None:
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(1)
    tensors = {}
    for layer in range(LAYERS):
        for proj in ("q_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, HIDDEN) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(HIDDEN, RANK) * 0.01
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": RANK,
        "lora_alpha": 16,
        "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": "tiny",
        "bias": "none",
        "task_type": "CAUSAL_LM",
        "lora_dropout": 0.0,
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(config, f)


if __name__ == "__main__":
    main()
