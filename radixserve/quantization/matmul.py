"""The model's matmul: :func:`linear`, for a float weight or a quantized one."""

from __future__ import annotations

import torch

from radixserve.profiler_scopes import scope
from radixserve.quantization.float_linear import float_linear
from radixserve.quantization.weights import QuantizedWeight

LINEAR_SCOPE = "radixserve.linear"  # a matmul through the C++ kernels (no aten op names it)


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for a float or a quantized weight: a quantized one through its kernels, a
    float one through :func:`float_linear` (the C++ loop where it beats torch on this CPU).
    Under torch's profiler each call is a :data:`LINEAR_SCOPE` range (scheduler/profiling.py)."""
    with scope(LINEAR_SCOPE):
        return _linear(x, weight, bias)


def _linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight,
            bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(weight, QuantizedWeight):
        y = weight.matmul(x)
        return y if bias is None else y + bias
    return float_linear(x, weight, bias)
