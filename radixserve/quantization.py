"""Weight-only int8 quantization of a model's matmuls on a CPU (``--quantization int8``).

Every projection (q/k/v, o, gate/up, down) and the LM head keeps its weight as int8 with one
float32 scale per ``GROUP`` weights of a row: ``w ~ q * scale``, ``scale = max |w_group| / 127``,
``q = round(w / scale)`` (symmetric).  Over the first 32 greedy tokens of four chat prompts,
one scale per whole row (per channel) kept 80% of the default model's positions identical to
float32's, one per 64 weights 93% (llama.cpp's Q8_0 blocks are 32), for 6% more bytes.  A tied
embedding is the LM head's table, so its lookups dequantize the rows they take.  The weights
take about a quarter of float32's bytes, and a batch-1 decode step reads that much less memory.

The matmul path, chosen by measurement on the 2-core AVX2 CPU (Zen 3, the default model's
shapes, float32 activations):
- at most ``KERNEL_MAX_ROWS`` rows (decode): the C++ kernel ``int8_linear`` (cpu_ext/
  linear_ops.cpp), int8 converted to float in registers;
- more rows (prefill, large batches): the weight dequantized once per call and torch's float
  matmul, whose blocked GEMM the row loop does not match there.
torch's own ``_weight_int8pack_mm`` ran 4.7x slower than the float32 matmul at one row and 40x
at 512 rows on that CPU, so it is not used.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from radixserve import cpu_ext
from radixserve.config import QUANTIZATIONS, cpu_bf16_feature

log = logging.getLogger("radixserve")

KERNEL_MAX_ROWS = 8
GROUP = 64  # weights per scale along a row (GROUP in cpu_ext/linear_ops.cpp)


class Int8Weight:
    """A weight ``[N, K]`` as int8 rows and their float32 scales, in place of the Parameter."""

    def __init__(self, weight: torch.Tensor) -> None:
        n, k = weight.shape
        if k % GROUP:
            raise ValueError(f"int8 weights need in-features divisible by {GROUP}, got {k}")
        w = weight.detach().float().view(n, k // GROUP, GROUP)
        scale = w.abs().amax(dim=2, keepdim=True).clamp_min(1e-12) / 127.0
        self.q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8).view(n, k).contiguous()
        self.scale = scale.view(n, k // GROUP).contiguous()
        self.dtype = weight.dtype
        self.shape = weight.shape

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The float weight (a new tensor)."""
        n, k = self.shape
        return (self.q.float().view(n, k // GROUP, GROUP) * self.scale[:, :, None]).view(n, k).to(dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ w.T`` for x ``[T, K]``, in x's dtype."""
        ops = cpu_ext.load() if x.device.type == "cpu" else None
        if ops is None:
            return F.linear(x, self.dequantized(x.dtype))
        if x.shape[0] <= KERNEL_MAX_ROWS:
            return ops.int8_linear(x, self.q, self.scale).to(x.dtype)
        weight = _scratch(self.q.shape, x.dtype)
        ops.int8_dequant_(self.q, self.scale, weight)
        return F.linear(x, weight)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids``, dequantized (a tied embedding's lookup)."""
        n, k = len(ids), self.shape[1]
        rows = F.embedding(ids, self.q).float().view(n, k // GROUP, GROUP)
        return (rows * self.scale[ids][:, :, None]).view(n, k).to(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 4 * self.scale.numel()


_SCRATCH: dict[tuple[torch.Size, torch.dtype], torch.Tensor] = {}


def _scratch(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """One float buffer per weight shape, shared by the layers of that shape (a model's forward
    runs one matmul at a time): a fresh one per call cost more in page faults than the matmul."""
    buf = _SCRATCH.get((shape, dtype))
    if buf is None:
        buf = _SCRATCH[(shape, dtype)] = torch.empty(shape, dtype=dtype)
    return buf


def linear(x: torch.Tensor, weight: torch.Tensor | Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for a float or an int8 weight.  A float32 or bfloat16 matmul of a few rows
    (``_kernel_rows``) goes through the C++ loop ``float_linear`` (cpu_ext/linear_ops.cpp), which
    streams the weights faster than torch's matmul there; everything else is torch's."""
    if isinstance(weight, Int8Weight):
        y = weight.matmul(x)
    elif _float_kernel_fits(x, weight):
        y = _float_kernel().float_linear(x, weight)
    else:
        return F.linear(x, weight, bias)
    return y if bias is None else y + bias


@functools.cache
def _kernel_rows(dtype: torch.dtype, width: int) -> range:
    """Row counts where ``float_linear`` beat torch's matmul, one decode step of the default
    model's weights (2 threads):
    - float32, AVX2 (8-float vectors, Zen 3): 28.7 against 45.6 ms at 1 row, 50.7 against 85-90
      ms at 8;
    - float32, AVX-512 (Sapphire Rapids class): equal at 1 row (20.2 ms, the memory's rate),
      torch ahead at 2-3, the loop at 4-8 (28.1 against 36.3 ms at 4, 33.6 against 47.7 at 8);
    - bfloat16 with AVX-512 BF16 (the same CPU): 12.2 against 20.4 ms at 1 row, 18.9 against
      21.7 at 4, torch (AMX) ahead from 6.  Without bfloat16 instructions torch emulates
      bfloat16 (1.3 GFLOP/s on Zen 3) and the loop, which widens it to float32, takes 8 rows.
    """
    if dtype == torch.float32:
        return range(1, KERNEL_MAX_ROWS + 1) if width == 8 else range(4, KERNEL_MAX_ROWS + 1)
    if dtype == torch.bfloat16:
        return range(1, 5) if cpu_bf16_feature() else range(1, KERNEL_MAX_ROWS + 1)
    return range(0)


def _float_kernel_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if x.device.type != "cpu" or x.dim() != 2 or x.shape[1] % 32 or x.dtype != weight.dtype:
        return False
    if not (x.is_contiguous() and weight.is_contiguous()):
        return False
    ops = _float_kernel()
    return ops is not None and x.shape[0] in _kernel_rows(x.dtype, ops.vector_width())


@functools.cache
def _float_kernel():  # noqa: ANN202 - the compiled module or None
    return cpu_ext.load()


def quantize_model(model: nn.Module, mode: str) -> None:
    """Replace, in place, the weight of every linear layer that has one (and of a tied
    embedding) by its int8 form.  ``mode`` is one of :data:`QUANTIZATIONS`."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {mode!r}")
    if mode == "none":
        return
    tied = getattr(model, "lm_head", False) is None  # the embedding table is the LM head
    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    before = after = kept = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        wanted = getattr(module, "quantizable", False) or (tied and module is embedding)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 2 or not wanted:
            continue
        if weight.shape[1] % GROUP:  # no whole groups: this layer keeps its float weight
            kept += 1
            continue
        q = Int8Weight(weight)
        before += weight.numel() * weight.element_size()
        after += q.nbytes
        del module.weight  # the Parameter goes; forward reads the attribute set below
        module.weight = q
    log.info("weights quantized to int8 (a scale per %d weights): %.0f MB -> %.0f MB; decode rows "
             "through the C++ int8 kernel, prefill through dequantized float matmuls%s", GROUP,
             before / 2**20, after / 2**20,
             f"; {kept} layer(s) kept in float (in-features not a multiple of {GROUP})" if kept else "")
