"""Random non-zero peft LoRA adapters for the tiny models, and transformers + peft as the oracle."""

from __future__ import annotations

import copy
from typing import Any

import torch

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _base(model_folder: str) -> Any:
    """transformers' model of the folder (a GGUF model's folder: transformers reads the file),
    copied: transformers hands out the same modules for the same GGUF file again, and peft
    changes the modules it is given."""
    from helpers.oracle import hf_model

    return copy.deepcopy(hf_model(model_folder))


def write_adapter(model_folder: str, out_folder: str, *, r: int = 8, alpha: float = 16,
                  targets: tuple[str, ...] = ALL_PROJECTIONS, use_rslora: bool = False,
                  rank_pattern: dict[str, int] | None = None, seed: int = 0,
                  scale: float = 1.0) -> str:
    """A peft adapter for the model at ``model_folder`` whose A and B are both random (peft's
    ``init_lora_weights=False``; B multiplied by ``scale``), saved as peft saves it."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                        use_rslora=use_rslora, rank_pattern=rank_pattern or {},
                        init_lora_weights=False)
    model = get_peft_model(_base(model_folder), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale)
    model.save_pretrained(out_folder)
    return out_folder


def peft_greedy(model_folder: str, adapter_folder: str | None, prompts: list[list[int]],
                n: int) -> list[list[int]]:
    """Greedy continuations (``n`` tokens, EOS ignored) by transformers (+ peft), float32."""
    from peft import PeftModel

    model = _base(model_folder)
    if adapter_folder is not None:
        model = PeftModel.from_pretrained(model, adapter_folder)
    model.eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(n):
                logits = model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
            outs.append(ids[len(prompt):])
    return outs
