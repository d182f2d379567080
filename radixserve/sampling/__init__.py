"""Batched sampling: per-request parameters, penalties, logprobs and seeded draws.

The parameters import nothing heavy; the tensor code (torch) is imported on first use, so a
front end that only validates requests starts its model processes without waiting for torch.
"""

from importlib import import_module
from typing import Any

from radixserve.sampling.params import SamplingParams, draw_seed

_LAZY = {
    "apply_frequency_presence_penalties": "penalties",
    "apply_repetition_penalty": "penalties",
    "count_tokens": "penalties",
    "pad_token_ids": "penalties",
    "SampleOutput": "sampler",
    "SamplingBatch": "sampler",
    "counter_uniform": "uniform",
    "sample": "sampler",
}

__all__ = ["SamplingParams", "draw_seed", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"radixserve.sampling.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'radixserve.sampling' has no attribute {name!r}")
