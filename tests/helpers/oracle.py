"""Hugging Face transformers as the oracle: float32 greedy decoding, no KV cache tricks."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any, Protocol

import torch


@contextlib.contextmanager
def gguf_pure_calls_shared() -> Iterator[None]:
    """During one transformers load of a GGUF: the ``gguf`` package's reader parses a file once
    (transformers parses it for the config, then again for the weights: seconds each for the
    default model's vocabulary), and its tensor name map is built once per architecture and
    layer count (transformers builds it again for every submodule).  Both are pure: the model
    loaded is the same."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def shared_reader(path: str, mode: str = "r") -> Any:
        key = (os.path.abspath(path), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


# Unbounded: the tiny models are small, and the default model's load (transformers reading
# its GGUF, ~10 s) is paid once a session however many tiny folders are used between its users.
@functools.cache
def hf_model(folder: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from radixserve.model.gguf_folder import transformers_args

    where, kwargs = transformers_args(folder)  # a GGUF model's folder: the file itself
    with gguf_pure_calls_shared() if kwargs else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kwargs)
    return model.eval()


class GreedyRule(Protocol):
    """What a constrained greedy reference adds to each step (see ``hf_greedy``)."""

    def mask(self, logits: torch.Tensor) -> None:
        """Edit the step's logits ([1, vocab], a float32 copy) in place before the argmax."""

    def accept(self, tok: int) -> bool:
        """Take the chosen token (not a stop token); False ends the output after it."""


@torch.inference_mode()
def hf_greedy(
    folder: str,
    prompt: list[int],
    max_new_tokens: int,
    eos_ids: set[int] | tuple[int, ...] | None = None,
    rule: GreedyRule | None = None,
) -> list[int]:
    """Greedy tokens by HF transformers (with its own KV cache), stopping after a token of
    ``eos_ids``; ``rule``, when given, masks each step's logits and may end the output."""
    model = hf_model(folder)
    ids = torch.tensor([prompt])
    out: list[int] = []
    past = None
    for _ in range(max_new_tokens):
        res = model(input_ids=ids, cache=past, use_cache=True)
        past = getattr(res, "cache", None) or res.past_key_values
        logits = res.logits[:, -1]
        if rule is not None:
            logits = logits.float().clone()
            rule.mask(logits)
        tok = int(logits[0].argmax())
        out.append(tok)
        if eos_ids and tok in eos_ids:
            break
        if rule is not None and not rule.accept(tok):
            break
        ids = torch.tensor([[tok]])
    return out
