"""Per-layer K/V memory addressed by slot (slot = page * page_size + offset)."""

from __future__ import annotations

import torch


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
    ) -> None:
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_slots, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

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
