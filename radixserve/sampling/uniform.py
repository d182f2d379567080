"""Counter-based uniforms for seeded draws (sampler.py): a pure function of a request's seed
and of how many tokens it has generated, computed on tensors (splitmix64).  cpu_ext/sampler.cpp
computes the first uniform of each row with the same bits."""

from __future__ import annotations

import torch

# splitmix64 constants, as signed int64 (torch has no uint64 arithmetic; int64 multiply
# and add wrap modulo 2**64, which is all the hash needs).
_GAMMA = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64
_UNIFORM_BITS = 23  # 0.5 + k over 2**23 stays strictly inside (0, 1) in float32


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser; consumes ``x`` (in place)."""
    x ^= _shr(x, 30)
    x *= _MIX1
    x ^= _shr(x, 27)
    x *= _MIX2
    x ^= _shr(x, 31)
    return x


def counter_uniform(seeds: torch.Tensor, steps: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[B, num_tokens]`` float32 uniform in (0, 1); entry ``[b, t]`` is a pure function of
    ``(seeds[b], steps[b], t)``.  seeds, steps: [B] int64."""
    key = _mix64(seeds.to(torch.int64) + _GAMMA)
    key = _mix64(key + (steps.to(torch.int64) + 1) * _GAMMA)
    tokens = torch.arange(1, num_tokens + 1, dtype=torch.int64, device=seeds.device) * _GAMMA
    bits = _shr(_mix64(key[:, None] + tokens[None, :]), 64 - _UNIFORM_BITS)
    return (bits.to(torch.float32) + 0.5) * (1.0 / (1 << _UNIFORM_BITS))
