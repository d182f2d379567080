"""``--quantization int8``: every projection (q/k/v, o, gate/up, down) and the LM head as int8
with a float32 scale and offset per ``GROUP`` (32) weights of a row, asymmetric: the 256 steps
span each group's own range (:class:`Int8Weight`).  Asymmetric because the default model's float
weights are dequantized Q4_1 blocks, whose 4-bit steps are 17 int8 steps of such a group, so it
keeps them almost exactly, where symmetric groups lose greedy tokens (bench/quant_accuracy.py);
the offset costs the kernel some speed against symmetric groups.

The same weight class without offsets holds a GGUF's Q8_0 blocks as stored (:data:`Q8_0`,
``--quantization gguf``) and int4's LM head.  Kernels (cpu_ext/linear_ops.cpp): ``int8_linear``
for decode rows, ``int8_linear_q8`` with ``--int8-activations`` (groups of 32: x quantized to
int8 per 32, VNNI integer dot products, llama.cpp's Q8 x Q8), ``int8_dequant_`` for prefill.
"""

from __future__ import annotations

import torch

from radixserve import cpu_ext
from radixserve.quantization.base import GGUFType, QuantMethod
from radixserve.quantization.weights import Q8_BLOCK, QuantizedWeight

GROUP = 32  # weights per int8 scale (and offset) along a row, as a GGUF Q8_0 tensor's


class Int8Weight(QuantizedWeight):
    """Int8 rows and a float32 scale per ``group`` weights of a row, and optionally an offset per
    group: ``w ~ q * scale (+ offset)``.  Without offsets (symmetric) it holds a GGUF's Q8_0
    blocks as stored; ``--quantization int8`` quantizes with offsets (asymmetric), whose 256 steps
    span each group's own range instead of twice its largest magnitude."""

    kernels = ("int8_linear", "int8_linear_q8", "int8_dequant_")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                 offset: torch.Tensor | None = None) -> None:
        n, k = q.shape
        if q.dtype != torch.int8 or scale.dim() != 2 or scale.shape[0] != n or (
                k % max(scale.shape[1], 1)) or (offset is not None and offset.shape != scale.shape):
            raise ValueError(f"int8 weight: q [N, K] int8, scale (and offset) [N, K / group], got "
                             f"{tuple(q.shape)} {q.dtype} and {tuple(scale.shape)}")
        self.q, self.scale = q.contiguous(), scale.float().contiguous()
        self.offset = None if offset is None else offset.float().contiguous()
        self.group = k // scale.shape[1]
        self.dtype, self.shape = dtype, q.shape
        self.int8_activations = False  # kernel rows through int8_linear_q8 (apply.py sets it)

    @property
    def takes_int8_activations(self) -> bool:
        return self.group == Q8_BLOCK

    @classmethod
    def quantize(cls, weight: torch.Tensor, group: int = GROUP,
                 asymmetric: bool = False) -> Int8Weight:
        """Symmetric: ``scale = max |w_group| / 127``, ``q = round(w / scale)``.  Asymmetric: the
        group's range ``[low, high]`` in 255 steps, ``scale = (high - low) / 255`` and ``offset =
        low + 128 scale``, ``q = round((w - offset) / scale)`` in [-128, 127]."""
        n, k = weight.shape
        if k % group:
            raise ValueError(f"int8 weights need in-features divisible by {group}, got {k}")
        w = weight.detach().float().view(n, k // group, group)
        if not asymmetric:
            scale = w.abs().amax(dim=2, keepdim=True).clamp_min(1e-12) / 127.0
            q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8).view(n, k)
            return cls(q, scale.view(n, k // group), weight.dtype)
        low, high = w.amin(dim=2, keepdim=True), w.amax(dim=2, keepdim=True)
        # 11 significant bits: q * scale is then exact in float32, and the one rounding of
        # q * scale + offset is the same in the kernels (fused or not) and in torch
        mantissa, exponent = torch.frexp(((high - low) / 255.0).clamp_min(1e-12))
        scale = torch.ldexp(torch.round(mantissa * 2048) / 2048, exponent)
        offset = low + 128.0 * scale
        q = torch.round((w - offset) / scale).clamp_(-128, 127).to(torch.int8).view(n, k)
        return cls(q, scale.view(n, k // group), weight.dtype, offset.view(n, k // group))

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return self.rows(None).to(dtype)

    def dequantize_into(self, out: torch.Tensor, start: int = 0) -> None:
        rows = slice(start, start + out.shape[0])
        offset = _NO_OFFSET if self.offset is None else self.offset[rows]
        cpu_ext.load().int8_dequant_(self.q[rows], self.scale[rows], offset, out)

    def kernel_args(self, rows: int) -> tuple[str, tuple[torch.Tensor, ...]]:
        name = "int8_linear_q8" if self.int8_activations else "int8_linear"
        return name, (self.q, self.scale, self._offset_arg())

    def _offset_arg(self) -> torch.Tensor:
        return _NO_OFFSET if self.offset is None else self.offset

    def rows(self, ids: torch.Tensor | None) -> torch.Tensor:
        q, scale, offset = self.q, self.scale, self.offset
        if ids is not None:
            q, scale, offset = q[ids], scale[ids], None if offset is None else offset[ids]
        n, k = q.shape
        w = q.float().view(n, k // self.group, self.group) * scale[:, :, None]
        return (w if offset is None else w + offset[:, :, None]).view(n, k)

    def take_rows(self, index: torch.Tensor) -> Int8Weight:
        offset = None if self.offset is None else self.offset[index]
        return Int8Weight(self.q[index], self.scale[index], self.dtype, offset)

    @classmethod
    def cat(cls, parts: list[QuantizedWeight]) -> Int8Weight:
        offsets = [p.offset for p in parts]
        offset = None if any(o is None for o in offsets) else torch.cat(offsets)
        return cls(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                   parts[0].dtype, offset)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 4 * self.scale.numel() * (1 if self.offset is None else 2)


_NO_OFFSET = torch.empty(0)  # the kernels' "no offsets" (symmetric groups)


def _read_q8_0(blocks: torch.Tensor, dtype: torch.dtype) -> Int8Weight:
    """Q8_0: per block of 32, a float16 scale then 32 int8 values."""
    rows, nb, _ = blocks.shape
    d = blocks[:, :, 0:2].contiguous().view(torch.float16).view(rows, nb)
    q = blocks[:, :, 2:].contiguous().view(torch.int8).reshape(rows, nb * 32)
    return Int8Weight(q, d.float(), dtype)


Q8_0 = GGUFType("Q8_0", block_weights=32, block_bytes=34, read=_read_q8_0, weight=Int8Weight,
                label="Q8_0 blocks")


class Int8Method(QuantMethod):
    name = "int8"
    quantizes_float = True
    one_rank = True
    int8_activations = True
    stored_as = f"a scale and an offset per {GROUP} weights"

    def kernels(self) -> tuple[str, ...]:
        return Int8Weight.kernels

    def quantize_weight(self, weight: torch.Tensor, is_head: bool) -> QuantizedWeight | None:
        if weight.shape[1] % GROUP:
            return None
        return Int8Weight.quantize(weight, GROUP, asymmetric=True)
