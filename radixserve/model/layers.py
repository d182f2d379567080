"""Building blocks of the Llama-family decoder: norms, rotary embedding, fused projections."""

from __future__ import annotations

import math

import torch
from torch import nn

from radixserve import cpu_ext
from radixserve.model.config import RopeConfig
from radixserve.quantization import linear


def fused_ops(x: torch.Tensor):  # noqa: ANN201 - the compiled module or None
    """The C++ fused elementwise ops for ``x``, or None (not on a CPU, or no kernel build)."""
    return cpu_ext.load() if x.device.type == "cpu" else None


class RMSNorm(nn.Module):
    """RMS norm computed in float32 and cast back, as in the HF Llama reference."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = fused_ops(x)
        if ops is not None and x.dim() == 2 and x.is_contiguous():
            return ops.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def add_forward(self, residual: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``residual += delta`` (in place, rounded to its dtype), then the norm of it."""
        ops = fused_ops(residual)
        if ops is not None and residual.dim() == 2 and residual.is_contiguous():
            return ops.add_rms_norm(residual, delta, self.weight, self.eps)
        residual.add_(delta)
        return self(residual)


class MergedLinear(nn.Module):
    """One matmul for several projections of the same input (q/k/v, gate/up).

    ``shard_sizes`` are the checkpoint's rows of each projection; ``parts`` (tensor
    parallelism: a column-parallel layer) keeps rows ``[start, end)`` of each, all of them by
    default.  The weight is the row-wise concatenation of the kept rows; :meth:`load_shard`
    copies one checkpoint tensor's kept rows into place.
    """

    quantizable = True  # radixserve/quantization/ may replace its weight by a quantized one

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool,
                 parts: dict[str, tuple[int, int]] | None = None) -> None:
        super().__init__()
        self.shard_sizes = dict(shard_sizes)
        self.parts = {
            name: (parts or {}).get(name, (0, size)) for name, size in shard_sizes.items()
        }
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, (lo, hi) in self.parts.items():
            self.shard_offsets[name] = (start, hi - lo)
            start += hi - lo
        self.weight = nn.Parameter(torch.empty(start, in_features))
        self.bias = nn.Parameter(torch.empty(start)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def load_shard(self, shard: str, kind: str, tensor: torch.Tensor) -> None:
        start, size = self.shard_offsets[shard]
        target = self.weight if kind == "weight" else self.bias
        if target is None:
            raise ValueError(f"checkpoint has a {shard} bias but the model expects none")
        if tensor.shape[0] != self.shard_sizes[shard]:
            raise ValueError(f"shard {shard}.{kind}: expected {self.shard_sizes[shard]} rows, "
                             f"got {tensor.shape[0]}")
        lo, hi = self.parts[shard]
        with torch.no_grad():
            target[start : start + size].copy_(tensor[lo:hi])


def _inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies (float32, [head_dim / 2]) with the configured scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        # Wavelengths longer than the original context are slowed down by `factor`, short ones
        # kept, and the band between the two limits blended linearly in 1 / wavelength.
        orig = rope.original_max_position
        long_wavelen = orig / rope.low_freq_factor
        short_wavelen = orig / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > long_wavelen, inv_freq / rope.factor, inv_freq)
        blend = (orig / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        blended = (1 - blend) * scaled / rope.factor + blend * scaled
        in_band = (wavelen >= short_wavelen) & (wavelen <= long_wavelen)
        return torch.where(in_band, blended, scaled)
    return inv_freq


class RotaryEmbedding:
    """Rotate-half RoPE.  ``cos_sin`` is computed once per forward and shared by all layers."""

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        self.inv_freq = _inv_freq(head_dim, rope)  # kept off the module: never a meta tensor

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """``cos`` and ``sin`` [T, 1, D] rounded to ``dtype`` as the reference rounds them; on a
        CPU held in float32, which the C++ rotation reads as they are (no conversion per layer
        and projection; the torch path casts back)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2] float32
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        return (cos.float(), sin.float()) if positions.device.type == "cpu" else (cos, sin)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x``: [T, heads, D]; ``cos``/``sin``: [T, 1, D] from :meth:`cos_sin`.  May rotate
        ``x`` in place."""
        ops = fused_ops(x)
        if ops is not None and x.stride(-1) == 1 and x.stride(1) == x.shape[-1]:
            ops.rotary_(x, cos.view(cos.shape[0], -1), sin.view(sin.shape[0], -1))
            return x
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)
