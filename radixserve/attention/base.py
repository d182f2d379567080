"""The interface every attention backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixserve.batch import ForwardBatch


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

    @abstractmethod
    def prepare(self, fb: ForwardBatch) -> None:
        """Build per-forward metadata once (stored in ``fb.attn_metadata``); layers reuse it."""

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
