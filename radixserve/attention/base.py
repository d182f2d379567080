"""The interface every attention backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixserve.batch import ForwardBatch
    from radixserve.cache.kv_pool import KVPool


@dataclass(frozen=True)
class AttentionLayerInfo:
    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float


class AttentionBackend(ABC):
    """Writes new K/V into the pool and attends over cached prefix + new tokens."""

    name: str = "base"
    supports_cuda_graphs: bool = False  # has graph_plan (executor/cuda_graph.py)
    # The model's attention layout (heads, head size), set by whoever runs the model: plans that
    # depend on the query heads (the Triton cascade's tiles) need it before the first layer.
    layer: AttentionLayerInfo | None = None

    def prepare(self, fb: ForwardBatch) -> None:
        """Plan the forward on the host, then send the batch's one upload (the plan's device
        arrays travel in it)."""
        self.plan(fb)
        fb.send()
        self.finish(fb)

    @abstractmethod
    def plan(self, fb: ForwardBatch) -> None:
        """Build per-forward metadata once (stored in ``fb.attn_metadata``); layers reuse it.
        Only host fields may be read; device arrays are staged in ``fb.upload``."""

    # an optional hook: most backends need none
    def finish(self, fb: ForwardBatch) -> None:  # noqa: B027
        """After the upload: derive device-side metadata from the sent arrays (device ops
        only, nothing read back)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        layer: AttentionLayerInfo,
        fb: ForwardBatch,
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        """Store k/v at ``fb.out_cache_loc`` in layer ``layer.layer_id``, then attend causally."""

    # ---- CUDA graphs (executor/cuda_graph.py) ------------------------------------------
    def graph_compatible(self, fb: ForwardBatch) -> bool:
        """Whether this decode batch may replay a captured graph (whose plan is static)."""
        return False

    def graph_plan(self, table_rows: torch.Tensor, seq_lens: torch.Tensor, token_idx: torch.Tensor,
                   layer: AttentionLayerInfo, kv_pool: KVPool, max_context_len: int) -> object:
        """The static decode metadata of a captured graph over these buffers."""
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA-graph decode")
