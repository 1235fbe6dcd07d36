"""Makes the tiny random-weight Llama the real-engine check serves, with no download.

2 layers, hidden 128, 2 heads (head_dim 64: vLLM's CPU attention refuses 16), a vocabulary of
1,024 token ids. Usage: python make_model.py DIR
"""

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    out = sys.argv[1]
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)


if __name__ == "__main__":
    main()
