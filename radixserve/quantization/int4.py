"""``--quantization int4``: 4-bit blocks of 32 weights, ``w = d * q + m`` (llama.cpp's Q4_1
scheme, :class:`Int4Weight`), 5 bits a weight (d and m float16); the LM head in int8 (a scale
per 32).  The same weight class holds a GGUF's Q4_0 and Q4_1 blocks as stored (:data:`Q4_0`,
:data:`Q4_1`, ``--quantization gguf``).

Kernels (cpu_ext/linear_ops.cpp): ``int4_linear`` for decode rows; with ``--int8-activations``
``int4_linear_q8`` (x quantized to int8 per 32 and VNNI integer dot products, llama.cpp's Q4 x
Q8, whose products are not the weights' exact ones: bench/quant_accuracy.py).  Without that
flag, on a VNNI CPU, a server that drafts no tokens takes the one-row steps through
``int4_linear_q16`` (``wide_one_row``): x in 16-bit integers per 32 (|error| at most
amax / 65,278 a block, against bfloat16's own amax / 512), each as two signed bytes through the
same VNNI dot products.  That is twice q8's dot products, so it pays only at one row; and a
speculative verify's rows must be the one-row steps' own bits, so a server with drafts keeps
the float kernel.  Prefill dequantizes through ``int4_dequant_``.
"""

from __future__ import annotations

import torch

from radixserve import cpu_ext
from radixserve.quantization.base import GGUFType, QuantMethod
from radixserve.quantization.int8 import Int8Weight
from radixserve.quantization.weights import QuantizedWeight

BLOCK4 = 32  # weights per 4-bit block (BLOCK4 in cpu_ext/linear_ops.cpp)


class Int4Weight(QuantizedWeight):
    """4-bit blocks of :data:`BLOCK4` weights along a row, ``w = d * q + m`` with ``q`` in
    [0, 15] and ``d``, ``m`` float16 per block (5 bits a weight, the bytes llama.cpp's Q4_1
    reads): llama.cpp's Q4_1, and its Q4_0 with ``m = -8 d``.
    ``qs`` keeps a block's 32 values in 16 bytes as llama.cpp does (byte j: value j in the low
    nibble, value j + 16 in the high one), so a GGUF tensor's blocks are taken as they are."""

    kernels = ("int4_linear", "int4_linear_q8", "int4_linear_q16", "int4_dequant_")
    takes_int8_activations = True
    takes_wide_one_row = True

    def __init__(self, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                 dtype: torch.dtype) -> None:
        n, half = qs.shape
        k = 2 * half
        if (qs.dtype != torch.uint8 or k % BLOCK4 or d.shape != (n, k // BLOCK4)
                or m.shape != d.shape):
            raise ValueError(f"int4 weight: qs [N, K / 2] uint8, d and m [N, K / {BLOCK4}], got "
                             f"{tuple(qs.shape)} {qs.dtype}, {tuple(d.shape)}, {tuple(m.shape)}")
        self.qs = qs.contiguous()
        # float16: d * q is then exact in float32 (the kernel's one rounding)
        self.d = d.to(torch.float16).contiguous()
        self.m = m.to(torch.float16).contiguous()
        self.dtype, self.shape = dtype, torch.Size((n, k))
        self.int8_activations = False  # kernel rows through int4_linear_q8 (apply.py sets it)
        self.wide_one_row = False  # one-row steps through int4_linear_q16 (apply.py sets it)

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int4Weight:
        """Asymmetric, as llama.cpp's Q4_1: a block's range ``[min, max]`` in 15 steps,
        ``d = (max - min) / 15`` and ``m = min`` rounded to float16 first, then
        ``q = round((w - m) / d)`` clamped to [0, 15]."""
        n, k = weight.shape
        if k % BLOCK4:
            raise ValueError(f"int4 weights need in-features divisible by {BLOCK4}, got {k}")
        w = weight.detach().float().view(n, k // BLOCK4, BLOCK4)
        low, high = w.amin(dim=2), w.amax(dim=2)
        d = ((high - low) / 15).to(torch.float16)
        m = low.to(torch.float16)
        step = d.float().clamp_min(torch.finfo(torch.float16).tiny)[:, :, None]
        q = torch.round((w - m.float()[:, :, None]) / step).clamp_(0, 15).to(torch.uint8)
        qs = q[:, :, :16] | (q[:, :, 16:] << 4)
        return cls(qs.reshape(n, k // 2), d, m, weight.dtype)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return self.rows(None).to(dtype)

    def dequantize_into(self, out: torch.Tensor, start: int = 0) -> None:
        rows = slice(start, start + out.shape[0])
        cpu_ext.load().int4_dequant_(self.qs[rows], self.d[rows], self.m[rows], out)

    def kernel_args(self, rows: int) -> tuple[str, tuple[torch.Tensor, ...]]:
        if self.int8_activations:
            return "int4_linear_q8", (self.qs, self.d, self.m)
        name = "int4_linear_q16" if self.wide_one_row and rows == 1 else "int4_linear"
        return name, (self.qs, self.d, self.m)

    def rows(self, ids: torch.Tensor | None) -> torch.Tensor:
        if ids is None:
            qs, d, m = self.qs, self.d, self.m
        else:
            qs, d, m = self.qs[ids], self.d[ids], self.m[ids]
        n = qs.shape[0]
        blocks = qs.view(n, -1, BLOCK4 // 2)
        q = torch.cat([blocks & 15, blocks >> 4], dim=2).float()
        # d * q is exact in float32 (float16 d, 4-bit q): one rounding, as the C++ kernel's FMA
        return torch.addcmul(m[:, :, None].float(), q, d[:, :, None].float()).view(n, -1)

    def take_rows(self, index: torch.Tensor) -> Int4Weight:
        return Int4Weight(self.qs[index], self.d[index], self.m[index], self.dtype)

    @classmethod
    def cat(cls, parts: list[QuantizedWeight]) -> Int4Weight:
        return cls(torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]),
                   torch.cat([p.m for p in parts]), parts[0].dtype)

    @property
    def nbytes(self) -> int:
        return self.qs.numel() + 2 * (self.d.numel() + self.m.numel())


def _read_q4_0(blocks: torch.Tensor, dtype: torch.dtype) -> Int4Weight:
    """Q4_0: per block of 32, a float16 ``d`` then 16 bytes of nibbles (``m = -8 d``)."""
    rows, nb, _ = blocks.shape
    d = blocks[:, :, 0:2].contiguous().view(torch.float16).view(rows, nb)
    return Int4Weight(blocks[:, :, 2:].reshape(rows, nb * 16).contiguous(), d, d * -8, dtype)


def _read_q4_1(blocks: torch.Tensor, dtype: torch.dtype) -> Int4Weight:
    """Q4_1: per block of 32, float16 ``d`` and ``m`` then 16 bytes of nibbles."""
    rows, nb, _ = blocks.shape
    d = blocks[:, :, 0:2].contiguous().view(torch.float16).view(rows, nb)
    m = blocks[:, :, 2:4].contiguous().view(torch.float16).view(rows, nb)
    return Int4Weight(blocks[:, :, 4:].reshape(rows, nb * 16).contiguous(), d, m, dtype)


Q4_0 = GGUFType("Q4_0", block_weights=32, block_bytes=18, read=_read_q4_0, weight=Int4Weight,
                label="Q4 blocks")
Q4_1 = GGUFType("Q4_1", block_weights=32, block_bytes=20, read=_read_q4_1, weight=Int4Weight,
                label="Q4 blocks")


class Int4Method(QuantMethod):
    name = "int4"
    quantizes_float = True
    one_rank = True
    int8_activations = True
    stored_as = f"blocks of {BLOCK4}, d * q + m; the LM head in int8, a scale per {BLOCK4}"

    def kernels(self) -> tuple[str, ...]:
        return Int4Weight.kernels + Int8Weight.kernels  # the LM head's

    def quantize_weight(self, weight: torch.Tensor, is_head: bool) -> QuantizedWeight | None:
        if weight.shape[1] % BLOCK4:
            return None
        # the LM head (a tied table too) in int8, as llama.cpp's 4-bit files keep it in 6 or 8
        # bits: in 4 bits it alone loses most of the default model's float32 greedy tokens
        # (bench/quant_accuracy.py)
        if is_head:
            return Int8Weight.quantize(weight, BLOCK4, asymmetric=False)
        return Int4Weight.quantize(weight)

