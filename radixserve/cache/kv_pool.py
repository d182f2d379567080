"""Per-layer K/V memory addressed by slot (slot = page * page_size + offset).

The pool stores K/V in the model's dtype, or in 8 bits (``kv_cache_dtype``):

- ``int8``: symmetric, one scale per token and KV head (``amax / 127`` of the head's row, stored
  as float16 beside the values), as llama.cpp's ``q8_0`` cache type keeps one scale per block.
  With the default model's heads of 64 values a token costs 66 bytes per head and K or V: 1.94x
  the tokens of a bfloat16 pool in the same memory, 3.88x float32's.
- ``fp8_e4m3`` / ``fp8_e5m2``: the value itself in 8 bits, saturated at the format's largest
  finite value, with a scale of 1 (SGLang reads per-layer scales from checkpoints that carry
  them; the models served here carry none): 2x / 4x the tokens, no scale bytes.

An 8-bit pool stores K and V in a rotated basis (QuaRot's trick): each head's row times the
normalised Hadamard matrix H before it is quantized.  H is orthogonal, so attention is unchanged
when the queries are turned the same way, ``q.k = (H q).(H k)``, and the output ``sum p (H v)`` is
turned back by H (its own inverse).  The rotation spreads the few large channels of a key over
all of them, so a row's ``amax`` (its int8 step) shrinks towards its RMS, and an int8 pool's
logprobs and greedy tokens stay closer to float32's (bench/kv_quant.py measures both; where a
prompt meets a near tie, greedy tokens can still differ from one CPU to another).

Kernels read the 8-bit pool directly (the C++ paged kernel, the Triton kernels) and compute in
the model's dtype; nothing keeps a dequantized copy of the pool.
"""

from __future__ import annotations

import numpy as np
import torch

from radixserve.config import KV_CACHE_DTYPES

# Slots that padded index tensors point at (slot 0; a page of up to 64 slots is covered).
PADDING_SLOTS = 64

_STORE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
INT8_SCALE_DTYPE = torch.float16


def kv_store_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The element type of a pool for a model computing in ``dtype``."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )
    return _STORE_DTYPES.get(kv_cache_dtype, dtype)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       kv_cache_dtype: str = "auto") -> int:
    """Bytes of K and V one token takes in every layer (scales included)."""
    store = kv_store_dtype(kv_cache_dtype, dtype)
    per_head = head_dim * store.itemsize + (INT8_SCALE_DTYPE.itemsize if store == torch.int8 else 0)
    return 2 * num_layers * num_kv_heads * per_head


def fwht(x: torch.Tensor) -> torch.Tensor:
    """``x`` ([..., n], n a power of two) times the normalised Hadamard matrix in Sylvester's
    order, in float32: the butterflies of the C++ kernels' ``hadamard_row``, so both give the
    same bits.  Applied twice it gives ``x`` back."""
    n = x.shape[-1]
    y = x.float().reshape(-1, n)
    h = 1
    while h < n:
        y = y.view(-1, n // (2 * h), 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
        h *= 2
    return y.reshape(x.shape) * n ** -0.5


def quantize_kv(x: torch.Tensor, store: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` ([n, heads, dim]) in the pool's element type, and its int8 scales ([n, heads]).
    The reference of the kernels' quantization (C++ ``store_kv``, Triton ``store_kv``)."""
    if store == torch.int8:
        xf = x.float()
        scale = (xf.abs().amax(dim=-1) / 127.0).to(INT8_SCALE_DTYPE)
        # Divide by the stored (rounded) scale, so value * scale reproduces x within half a step.
        safe = torch.where(scale > 0, scale.float(), 1.0)
        q = torch.round(xf / safe[..., None]).clamp_(-127, 127).to(torch.int8)
        return q, scale
    if store.is_floating_point and store.itemsize == 1:
        top = torch.finfo(store).max
        return x.float().clamp(-top, top).to(store), None
    return x.to(store), None


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Stored values (and int8 scales) back in ``dtype``."""
    if scale is None:
        return x.to(dtype)
    return (x.float() * scale.float()[..., None]).to(dtype)


class KVPool:
    """K and V buffers of shape ``[num_slots, num_kv_heads, head_dim]`` for every layer, and for
    an int8 pool their scales ``[num_slots, num_kv_heads]``.

    ``dtype`` is the model's (what attention computes in and reads back), ``store_dtype`` the
    buffers' element type.  Page 0 (slots ``[0, page_size)``) is never handed out by the
    allocator: padded index tensors may point at slot 0 and read harmless values.
    """

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.store_dtype = kv_store_dtype(kv_cache_dtype, dtype)
        # 8-bit rows are stored rotated (see the top of this file); head sizes that are not a
        # power of two are stored as they are.
        self.rotated = self.store_dtype != dtype and head_dim & (head_dim - 1) == 0
        self.device = torch.device(device)
        shape = (num_slots, num_kv_heads, head_dim)
        self.k_buffers = [
            self._buffer(shape, self.store_dtype, pin_memory) for _ in range(num_layers)
        ]
        self.v_buffers = [
            self._buffer(shape, self.store_dtype, pin_memory) for _ in range(num_layers)
        ]
        self.k_scales: list[torch.Tensor] = []
        self.v_scales: list[torch.Tensor] = []
        if self.quantized_int8:
            scale_shape = (num_slots, num_kv_heads)
            self.k_scales = [
                self._buffer(scale_shape, INT8_SCALE_DTYPE, pin_memory) for _ in range(num_layers)
            ]
            self.v_scales = [
                self._buffer(scale_shape, INT8_SCALE_DTYPE, pin_memory) for _ in range(num_layers)
            ]

    @property
    def quantized_int8(self) -> bool:
        return self.store_dtype == torch.int8

    @property
    def quantized(self) -> bool:
        return self.store_dtype != self.dtype

    def _buffer(self, shape: tuple[int, ...], dtype: torch.dtype, pin_memory: bool) -> torch.Tensor:
        """One layer's K or V (or their scales).  A slot is written before any kernel reads it,
        except the padding slots of page 0, which are zeroed.  On a CPU the rest is left as
        allocated: the OS maps pages on first touch, so a pool sized for all free memory costs
        nothing until used (zeroing gigabytes would take seconds of every start).  pin_memory: a
        host tier in page-locked memory, so that copies to a GPU are asynchronous (pinning
        touches every page anyway)."""
        if self.device.type != "cpu" or pin_memory:
            return torch.zeros(shape, dtype=dtype, device=self.device, pin_memory=pin_memory)
        buf = torch.empty(shape, dtype=dtype)
        buf[: PADDING_SLOTS].zero_()
        return buf

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows ``[n, num_kv_heads, head_dim]`` as this pool stores them, and their int8 scales."""
        return quantize_kv(fwht(x) if self.rotated else x, self.store_dtype)

    def set_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` of shape ``[n, num_kv_heads, head_dim]`` into ``slots`` (``[n]``)."""
        kq, ks = self.encode(k)
        vq, vs = self.encode(v)
        self.k_buffers[layer_id][slots] = kq
        self.v_buffers[layer_id][slots] = vq
        if ks is not None:
            self.k_scales[layer_id][slots] = ks
            self.v_scales[layer_id][slots] = vs

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def get_scales(self, layer_id: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The int8 scales of layer ``layer_id`` (None, None for other pools)."""
        if not self.quantized_int8:
            return None, None
        return self.k_scales[layer_id], self.v_scales[layer_id]

    def read(self, layer_id: int, slots: torch.Tensor, k_out: torch.Tensor | None = None,
             v_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``slots`` (``[n, num_kv_heads, head_dim]``, the model's dtype, written into
        ``k_out`` / ``v_out`` when given): a gathered copy for the pure-torch attention,
        dequantized and turned back from the rotated basis."""
        outs = []
        for buf, scales, out in (
            (self.k_buffers, self.k_scales, k_out),
            (self.v_buffers, self.v_scales, v_out),
        ):
            if not self.quantized:
                outs.append(torch.index_select(buf[layer_id], 0, slots, out=out) if out is not None
                            else buf[layer_id].index_select(0, slots))
                continue
            values = buf[layer_id].index_select(0, slots)
            scale = scales[layer_id].index_select(0, slots) if scales else None
            got = dequantize_kv(values, scale, torch.float32)
            got = (fwht(got) if self.rotated else got).to(self.dtype)
            outs.append(got if out is None else out.copy_(got))
        return outs[0], outs[1]

    @property
    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype,
                                  self.kv_cache_dtype)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot of one layer's K (or V), scales included."""
        return self.bytes_per_token // (2 * self.num_layers)

    def _planes(self, layer: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Layer ``layer``'s K tensors and V tensors (values, then scales for int8); fp8 values
        as bytes (torch's index copies have no fp8 kernels)."""
        if self.quantized_int8:
            return (
                (self.k_buffers[layer], self.k_scales[layer]),
                (self.v_buffers[layer], self.v_scales[layer]),
            )
        if self.quantized:
            return (
                (self.k_buffers[layer].view(torch.uint8),),
                (self.v_buffers[layer].view(torch.uint8),),
            )
        return (self.k_buffers[layer],), (self.v_buffers[layer],)

    def gather(self, slots: np.ndarray) -> torch.Tensor:
        """K and V of ``slots`` for every layer as stored, ``[2, num_layers, n, slot_bytes]``
        uint8 on this pool's device (a copy): a slot's row is its values, then its int8 scales."""
        idx = torch.from_numpy(np.asarray(slots, dtype=np.int64)).to(self.device)
        n = len(idx)
        out = torch.empty(
            (2, self.num_layers, n, self.slot_bytes), dtype=torch.uint8, device=self.device
        )
        for layer in range(self.num_layers):
            for side, planes in enumerate(self._planes(layer)):
                col = 0
                for plane in planes:
                    part = plane.index_select(0, idx).reshape(n, -1).view(torch.uint8)
                    out[side, layer, :, col : col + part.shape[1]] = part
                    col += part.shape[1]
        return out

    def scatter(self, slots: np.ndarray, kv: torch.Tensor) -> None:
        """Write ``kv`` (as :meth:`gather` returns it, any device) into ``slots``."""
        idx = torch.from_numpy(np.asarray(slots, dtype=np.int64)).to(self.device)
        kv = kv.to(self.device, non_blocking=True)
        n = len(idx)
        for layer in range(self.num_layers):
            for side, planes in enumerate(self._planes(layer)):
                col = 0
                for plane in planes:
                    width = plane[0].numel() * plane.element_size()
                    rows = kv[side, layer, :, col : col + width].contiguous().view(plane.dtype)
                    plane.index_copy_(0, idx, rows.view(n, *plane.shape[1:]))
                    col += width


def copy_slots(src: KVPool, src_slots: np.ndarray, dst: KVPool, dst_slots: np.ndarray) -> None:
    """Copy the K/V of ``src_slots`` in ``src`` to ``dst_slots`` in ``dst`` (every layer; the
    pools store the same element type)."""
    if len(src_slots) != len(dst_slots):
        raise ValueError(
            f"copy_slots: {len(src_slots)} source slots, {len(dst_slots)} destination slots"
        )
    if src.store_dtype != dst.store_dtype:
        raise ValueError(
            f"copy_slots: a {src.kv_cache_dtype} pool copied into a {dst.kv_cache_dtype} pool"
        )
    src_idx = torch.from_numpy(np.asarray(src_slots, dtype=np.int64)).to(src.device)
    dst_idx = torch.from_numpy(np.asarray(dst_slots, dtype=np.int64)).to(dst.device)
    for layer in range(src.num_layers):
        for s_planes, d_planes in zip(src._planes(layer), dst._planes(layer), strict=True):
            for s_buf, d_buf in zip(s_planes, d_planes, strict=True):
                d_buf.index_copy_(
                    0, dst_idx, s_buf.index_select(0, src_idx).to(dst.device, non_blocking=True)
                )
