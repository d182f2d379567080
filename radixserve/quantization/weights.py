"""Quantized weights that stand in for a linear layer's float Parameter: int8 rows with a scale
per group (:class:`Int8Weight`) and 4-bit blocks (:class:`Int4Weight`).  Each multiplies a
few rows through its C++ kernel (cpu_ext/linear_ops.cpp) and many rows through torch's float
matmul on a weight dequantized into a shared scratch buffer."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve import cpu_ext
from radixserve.quantization.float_linear import KERNEL_MAX_ROWS, float_linear

GROUP = 32  # weights per int8 scale (and offset) along a row, as a GGUF Q8_0 tensor's
BLOCK4 = 32  # weights per 4-bit block (BLOCK4 in cpu_ext/linear_ops.cpp)


class QuantizedWeight:
    """A weight ``[N, K]`` held in fewer bits; what the model's layers call in place of a
    float Parameter."""

    shape: torch.Size
    dtype: torch.dtype  # the model's dtype: what lookups and matmuls return

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The float weight (a new tensor)."""
        raise NotImplementedError

    def dequantize_into(self, out: torch.Tensor) -> None:
        """Write the float weight into ``out`` (``[N, K]``, the matmul's dtype)."""
        out.copy_(self.dequantized(out.dtype))

    def kernel_args(self, rows: int) -> tuple[str, tuple[torch.Tensor, ...]]:
        """The C++ kernel a step of ``rows`` rows goes through (its name in cpu_ext) and the
        weight's tensors it takes after x: what :meth:`kernel_matmul` calls, and
        model/fused_decode.py too."""
        raise NotImplementedError

    def kernel_matmul(self, ops: object, x: torch.Tensor) -> torch.Tensor:
        """``x @ w.T`` for a few rows through the C++ kernel, in x's dtype (float32 sums rounded once)."""
        name, tensors = self.kernel_args(x.shape[0])
        return getattr(ops, name)(x, *tensors)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows ``ids``, dequantized to float32 (``[len(ids), K]``)."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ w.T`` for x ``[T, K]``, in x's dtype."""
        ops = cpu_ext.load() if x.device.type == "cpu" else None
        if ops is None:
            return F.linear(x, self.dequantized(x.dtype))
        if x.shape[0] <= KERNEL_MAX_ROWS:
            return self.kernel_matmul(ops, x)
        weight = _scratch(self.shape, x.dtype)
        self.dequantize_into(weight)
        return float_linear(x, weight)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids``, dequantized (a tied embedding's lookup)."""
        return self.rows(ids).to(self.dtype)


class Int8Weight(QuantizedWeight):
    """Int8 rows and a float32 scale per ``group`` weights of a row, and optionally an offset per
    group: ``w ~ q * scale (+ offset)``.  Without offsets (symmetric) it holds a GGUF's Q8_0
    blocks as stored; ``--quantization int8`` quantizes with offsets (asymmetric), whose 256 steps
    span each group's own range instead of twice its largest magnitude."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                 offset: torch.Tensor | None = None) -> None:
        n, k = q.shape
        if q.dtype != torch.int8 or scale.dim() != 2 or scale.shape[0] != n or k % max(scale.shape[1], 1) or (
                offset is not None and offset.shape != scale.shape):
            raise ValueError(f"int8 weight: q [N, K] int8, scale (and offset) [N, K / group], got {tuple(q.shape)} "
                             f"{q.dtype} and {tuple(scale.shape)}")
        self.q, self.scale = q.contiguous(), scale.float().contiguous()
        self.offset = None if offset is None else offset.float().contiguous()
        self.group = k // scale.shape[1]
        self.dtype, self.shape = dtype, q.shape
        self.int8_activations = False  # kernel rows through int8_linear_q8 (quantize_model sets it)

    @classmethod
    def quantize(cls, weight: torch.Tensor, group: int = GROUP, asymmetric: bool = False) -> Int8Weight:
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

    def dequantize_into(self, out: torch.Tensor) -> None:
        cpu_ext.load().int8_dequant_(self.q, self.scale, self._offset_arg(), out)

    def kernel_args(self, rows: int) -> tuple[str, tuple[torch.Tensor, ...]]:
        return ("int8_linear_q8" if self.int8_activations else "int8_linear"), (self.q, self.scale, self._offset_arg())

    def _offset_arg(self) -> torch.Tensor:
        return _NO_OFFSET if self.offset is None else self.offset

    def rows(self, ids: torch.Tensor | None) -> torch.Tensor:
        q, scale, offset = self.q, self.scale, self.offset
        if ids is not None:
            q, scale, offset = q[ids], scale[ids], None if offset is None else offset[ids]
        n, k = q.shape
        w = q.float().view(n, k // self.group, self.group) * scale[:, :, None]
        return (w if offset is None else w + offset[:, :, None]).view(n, k)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 4 * self.scale.numel() * (1 if self.offset is None else 2)


_NO_OFFSET = torch.empty(0)  # the kernels' "no offsets" (symmetric groups)


class Int4Weight(QuantizedWeight):
    """4-bit blocks of :data:`BLOCK4` weights along a row, ``w = d * q + m`` with ``q`` in
    [0, 15] and ``d``, ``m`` float16 per block (5 bits a weight, the bytes llama.cpp's Q4_1 reads):
    llama.cpp's Q4_1, and its Q4_0 with ``m = -8 d``.
    ``qs`` keeps a block's 32 values in 16 bytes as llama.cpp does (byte j: value j in the low
    nibble, value j + 16 in the high one), so a GGUF tensor's blocks are taken as they are."""

    def __init__(self, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor, dtype: torch.dtype) -> None:
        n, half = qs.shape
        k = 2 * half
        if qs.dtype != torch.uint8 or k % BLOCK4 or d.shape != (n, k // BLOCK4) or m.shape != d.shape:
            raise ValueError(f"int4 weight: qs [N, K / 2] uint8, d and m [N, K / {BLOCK4}], got "
                             f"{tuple(qs.shape)} {qs.dtype}, {tuple(d.shape)}, {tuple(m.shape)}")
        self.qs = qs.contiguous()
        # float16: d * q is then exact in float32 (the kernel's one rounding)
        self.d = d.to(torch.float16).contiguous()
        self.m = m.to(torch.float16).contiguous()
        self.dtype, self.shape = dtype, torch.Size((n, k))
        self.int8_activations = False  # kernel rows through int4_linear_q8 (quantize_model sets it)
        self.wide_one_row = False  # one-row steps through int4_linear_q16 (quantize_model sets it)

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

    def dequantize_into(self, out: torch.Tensor) -> None:
        cpu_ext.load().int4_dequant_(self.qs, self.d, self.m, out)

    def kernel_args(self, rows: int) -> tuple[str, tuple[torch.Tensor, ...]]:
        if self.int8_activations:
            return "int4_linear_q8", (self.qs, self.d, self.m)
        return ("int4_linear_q16" if self.wide_one_row and rows == 1 else "int4_linear"), (self.qs, self.d, self.m)

    def rows(self, ids: torch.Tensor | None) -> torch.Tensor:
        qs, d, m = (self.qs, self.d, self.m) if ids is None else (self.qs[ids], self.d[ids], self.m[ids])
        n = qs.shape[0]
        blocks = qs.view(n, -1, BLOCK4 // 2)
        q = torch.cat([blocks & 15, blocks >> 4], dim=2).float()
        # d * q is exact in float32 (float16 d, 4-bit q): one rounding, as the C++ kernel's FMA
        return torch.addcmul(m[:, :, None].float(), q, d[:, :, None].float()).view(n, -1)

    @property
    def nbytes(self) -> int:
        return self.qs.numel() + 2 * (self.d.numel() + self.m.numel())


_SCRATCH: dict[tuple[torch.Size, torch.dtype], torch.Tensor] = {}


def _scratch(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """One float buffer per weight shape, shared by the layers of that shape (a model's forward
    runs one matmul at a time): a fresh one per call would cost more in page faults than the matmul."""
    buf = _SCRATCH.get((shape, dtype))
    if buf is None:
        buf = _SCRATCH[(shape, dtype)] = torch.empty(shape, dtype=dtype)
    return buf
