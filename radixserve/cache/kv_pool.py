"""Per-layer K/V memory addressed by slot (slot = page * page_size + offset)."""

from __future__ import annotations

import numpy as np
import torch

# Slots that padded index tensors point at (slot 0; a page of up to 64 slots is covered).
PADDING_SLOTS = 64


class KVPool:
    """K and V buffers of shape ``[num_slots, num_kv_heads, head_dim]`` for every layer.

    Page 0 (slots ``[0, page_size)``) is never handed out by the allocator: padded index
    tensors may point at slot 0 and read harmless values.
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
    ) -> None:
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_slots, num_kv_heads, head_dim)
        self.k_buffers = [self._buffer(shape, pin_memory) for _ in range(num_layers)]
        self.v_buffers = [self._buffer(shape, pin_memory) for _ in range(num_layers)]

    def _buffer(self, shape: tuple[int, int, int], pin_memory: bool) -> torch.Tensor:
        """One layer's K or V.  A slot is written before any kernel reads it, except the padding
        slots of page 0, which are zeroed.  On a CPU the rest is left as allocated: the OS maps
        pages on first touch, so a pool sized for all free memory costs nothing until used
        (zeroing 5 GB took 6 s of every start).  pin_memory: a host tier in page-locked memory,
        so that copies to a GPU are asynchronous (pinning touches every page anyway)."""
        if self.device.type != "cpu" or pin_memory:
            return torch.zeros(shape, dtype=self.dtype, device=self.device, pin_memory=pin_memory)
        buf = torch.empty(shape, dtype=self.dtype)
        buf[: PADDING_SLOTS].zero_()
        return buf

    def set_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` of shape ``[n, num_kv_heads, head_dim]`` into ``slots`` (``[n]``)."""
        self.k_buffers[layer_id][slots] = k.to(self.dtype)
        self.v_buffers[layer_id][slots] = v.to(self.dtype)

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    def gather(self, slots: np.ndarray) -> torch.Tensor:
        """K and V of ``slots`` for every layer: ``[2, num_layers, n, num_kv_heads, head_dim]``
        on this pool's device (a copy)."""
        idx = torch.from_numpy(np.asarray(slots, dtype=np.int64)).to(self.device)
        k = torch.stack([buf.index_select(0, idx) for buf in self.k_buffers])
        v = torch.stack([buf.index_select(0, idx) for buf in self.v_buffers])
        return torch.stack((k, v))

    def scatter(self, slots: np.ndarray, kv: torch.Tensor) -> None:
        """Write ``kv`` (as :meth:`gather` returns it, any device) into ``slots``."""
        idx = torch.from_numpy(np.asarray(slots, dtype=np.int64)).to(self.device)
        kv = kv.to(self.device, self.dtype, non_blocking=True)
        for layer in range(self.num_layers):
            self.k_buffers[layer].index_copy_(0, idx, kv[0, layer])
            self.v_buffers[layer].index_copy_(0, idx, kv[1, layer])


def copy_slots(src: KVPool, src_slots: np.ndarray, dst: KVPool, dst_slots: np.ndarray) -> None:
    """Copy the K/V of ``src_slots`` in ``src`` to ``dst_slots`` in ``dst`` (every layer)."""
    if len(src_slots) != len(dst_slots):
        raise ValueError(f"copy_slots: {len(src_slots)} source slots, {len(dst_slots)} destination slots")
    src_idx = torch.from_numpy(np.asarray(src_slots, dtype=np.int64)).to(src.device)
    dst_idx = torch.from_numpy(np.asarray(dst_slots, dtype=np.int64)).to(dst.device)
    for layer in range(src.num_layers):
        for s_buf, d_buf in ((src.k_buffers[layer], dst.k_buffers[layer]),
                             (src.v_buffers[layer], dst.v_buffers[layer])):
            d_buf.index_copy_(0, dst_idx, s_buf.index_select(0, src_idx).to(dst.device, non_blocking=True))
