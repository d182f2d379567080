"""Hugging Face transformers as the oracle: float32 greedy decoding, no KV cache tricks."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def hf_model(folder: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def hf_greedy(folder: str, prompt: list[int], max_new_tokens: int, eos_ids: set[int] | None = None) -> list[int]:
    """Greedy tokens by HF transformers (with its own KV cache), stopping at ``eos_ids``."""
    model = hf_model(folder)
    ids = torch.tensor([prompt])
    out: list[int] = []
    past = None
    for _ in range(max_new_tokens):
        res = model(input_ids=ids, cache=past, use_cache=True)
        past = getattr(res, "cache", None) or res.past_key_values
        tok = int(res.logits[0, -1].argmax())
        out.append(tok)
        if eos_ids and tok in eos_ids:
            break
        ids = torch.tensor([[tok]])
    return out
