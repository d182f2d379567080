"""Float32 / bfloat16 matmuls of a few rows through the C++ loop ``float_linear``
(cpu_ext/linear_ops.cpp) where it streams the weights faster than torch's matmul on this CPU
kind, and torch's everywhere else."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from radixserve import cpu_ext
from radixserve.hardware import cpu_bf16_feature

KERNEL_MAX_ROWS = 8  # rows of a step that the quantized weights' C++ kernels take (weights.py)


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, through the C++ loop where :func:`_kernel_rows` says it wins."""
    if not _float_kernel_fits(x, weight):
        return F.linear(x, weight, bias)
    y = _float_kernel().float_linear(x, weight)
    return y if bias is None else y + bias


@functools.cache
def _kernel_rows(dtype: torch.dtype, width: int, feature: str | None) -> range:
    """Row counts where ``float_linear`` beat torch's matmul, one decode step of the default
    model's weights (2 threads), by CPU kind (``width``: the kernels' float lanes; ``feature``:
    :func:`cpu_bf16_feature`, AMX or AVX-512 BF16):
    - float32, AVX2 (8-float vectors, Zen 3): 28.7 against 45.6 ms at 1 row, 50.7 against 85-90
      ms at 8;
    - float32, AVX-512 with AMX (Sapphire Rapids class), the layers' matrices: equal at 1-2 rows
      (15.2-15.9 ms, the memory's rate; 16.8-17.5 at 2), the loop ahead from 3 (17.2-18.1
      against 18.0-19.0 ms), 18 against 29 at 4, 21 against 34 at 8, 42 against 45 at 32;
    - float32, AVX-512 without AMX (Zen 4): the loop ahead at every count measured, 26 against
      56-66 ms at 1 row, 35 against 86 at 4, 65 against 110 at 16, 114 against 160 at 32;
    - bfloat16 with AMX, the layers' matrices: 9.2-9.6 against 16.6-16.7 ms at 1 row, 9.4
      against 16.2-17.1 at 2, 10.8-11.2 against 16.7-18.4 at 4, 16.1-16.7 against 16.4-18.5 at
      8, torch ahead from 10 (18.7-19.4 against 17.3-18.0);
    - bfloat16 with AVX-512 BF16 and no AMX (Zen 4): the loop ahead up to 24 rows (18.7 against
      32-42 ms at 1, 41 against 49-61 at 16, 62 against 77 at 24), even at 32;
    - bfloat16 without either: torch emulates it (1.3 GFLOP/s on Zen 3), and the loop, which
      widens it to float32, takes 8 rows.
    """
    amx = feature == "AMX"
    if dtype == torch.float32:
        if width == 8:
            return range(1, KERNEL_MAX_ROWS + 1)
        return range(1, 33)
    if dtype == torch.bfloat16:
        if amx:
            return range(1, KERNEL_MAX_ROWS + 1)
        return range(1, 25) if feature else range(1, KERNEL_MAX_ROWS + 1)
    return range(0)


def _float_kernel_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if x.device.type != "cpu" or x.dim() != 2 or x.dtype != weight.dtype or not x.is_contiguous():
        return False
    return kernel_takes(x.shape[0], weight)


def kernel_takes(rows: int, weight: torch.Tensor) -> bool:
    """Whether ``float_linear`` multiplies ``rows`` contiguous rows of the weight's dtype by
    ``weight`` through the C++ loop (model/fused_decode.py asks it once per step)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.shape[1] % 32 or not weight.is_contiguous():
        return False
    ops = _float_kernel()
    return ops is not None and rows in _kernel_rows(weight.dtype, ops.vector_width(), cpu_bf16_feature())


@functools.cache
def _float_kernel():  # noqa: ANN202 - the compiled module or None
    return cpu_ext.load()
