"""Tiny randomly initialised Llama-family checkpoints, built in the test (nothing downloaded)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

# name -> (config class name, overrides)
TINY_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    # tied embeddings + llama3 rope scaling (low/high frequency bands both exercised)
    "llama-tied-llama3": (
        "LlamaConfig",
        {
            "tie_word_embeddings": True,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "llama-linear-rope": (
        "LlamaConfig",
        {"rope_scaling": {"rope_type": "linear", "factor": 4.0}, "attention_bias": True},
    ),
    "mistral-mha": ("MistralConfig", {"num_key_value_heads": 4, "head_dim": 16}),  # GQA ratio 1
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True, "rope_theta": 1000000.0}),
    "qwen3-hd128": ("Qwen3Config", {"head_dim": 128, "num_key_value_heads": 1}),  # ratio 4
}


def build_tiny_model(name: str, folder: str, seed: int = 0) -> str:
    """Write tiny model ``name`` (a key of :data:`TINY_MODELS`) to ``folder``; return it.

    Every parameter is re-drawn at random (norm weights around 1, biases non-zero) so that no
    code path is hidden behind zeros or ones.  ``generation_config.json`` lists EOS ids 2 and 5.
    """
    import transformers

    cls_name, overrides = TINY_MODELS[name]
    config = getattr(transformers, cls_name)(**{**_COMMON, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(folder, safe_serialization=True)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": [2, 5]}, f)
    return folder
