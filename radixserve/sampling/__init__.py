"""Batched sampling: per-request parameters, penalties, logprobs and seeded draws."""

from radixserve.sampling.params import SamplingParams, draw_seed
from radixserve.sampling.penalties import (
    apply_frequency_presence_penalties,
    apply_repetition_penalty,
    count_tokens,
    pad_token_ids,
)
from radixserve.sampling.sampler import SampleOutput, SamplingBatch, counter_uniform, sample

__all__ = [
    "SampleOutput",
    "SamplingBatch",
    "SamplingParams",
    "apply_frequency_presence_penalties",
    "apply_repetition_penalty",
    "count_tokens",
    "counter_uniform",
    "draw_seed",
    "pad_token_ids",
    "sample",
]
