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


def float_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear``, through the C++ loop where :func:`_kernel_rows` says it wins."""
    if not _float_kernel_fits(x, weight):
        return F.linear(x, weight, bias)
    y = _float_kernel().float_linear(x, weight)
    return y if bias is None else y + bias


@functools.cache
def _kernel_rows(dtype: torch.dtype, width: int, feature: str | None) -> range:
    """Row counts where ``float_linear`` beats torch's matmul on one decode step of the default
    model's weights (2 threads), by CPU kind (``width``: the kernels' float lanes; ``feature``:
    :func:`cpu_bf16_feature`, AMX or AVX-512 BF16).  The loop streams each weight once for all
    the rows, so it wins while a step is bound by reading the weights; torch's blocked GEMM wins
    once the arithmetic dominates, at a row count that depends on the CPU kind:
    - float32, AVX2 (8-float vectors): up to ``KERNEL_MAX_ROWS``;
    - float32, AVX-512, with or without AMX: up to 32 rows (with AMX the two are level at 1-2
      rows, where both read the weights at the memory's rate);
    - bfloat16 with AMX: up to ``KERNEL_MAX_ROWS``; AMX's tiles take torch ahead beyond that;
    - bfloat16 with AVX-512 BF16 and no AMX: up to 24 rows;
    - bfloat16 without either: torch emulates bfloat16, and the loop, which widens it to
      float32, takes ``KERNEL_MAX_ROWS``.
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
    if (
        weight.device.type != "cpu"
        or weight.dim() != 2
        or weight.shape[1] % 32
        or not weight.is_contiguous()
    ):
        return False
    ops = _float_kernel()
    return ops is not None and rows in _kernel_rows(
        weight.dtype, ops.vector_width(), cpu_bf16_feature()
    )


@functools.cache
def _float_kernel():  # noqa: ANN202 - the compiled module or None
    return cpu_ext.load()
