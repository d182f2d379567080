"""Explicit batch metadata handed to the model's forward and to the attention backend.

It lives outside the scheduler, the model and the attention backends because all three use it
and none owns it.  Whoever runs the forward (the scheduler's model runner, a tensor-parallel
rank) builds it and then has the backend prepare its per-forward plan:
``backend.prepare(fb)``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from radixserve.attention.base import AttentionBackend
    from radixserve.cache.kv_pool import KVPool


@dataclass
class ForwardBatch:
    """One forward pass over B requests and T new tokens.

    Every batch is an "extend": request ``b`` has ``prefix_lens[b]`` tokens whose K/V are
    already in the pool (cached in the tree or computed by an earlier chunk or step) and
    ``extend_lens[b]`` new tokens computed now.  A decode step is ``extend_lens == 1``; a mixed
    batch simply has both kinds of rows.  New tokens are concatenated in request order.

    For request ``b`` its row ``req_to_token[req_pool_indices[b]]`` holds KV slots:
      ``[0, prefix_lens[b])``             already written, read by attention
      ``[prefix_lens[b], seq_lens[b])``   the new tokens' slots (== the matching part of
                                          ``out_cache_loc``), written by the backend first
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64 KV slot of each new token
    req_pool_indices: torch.Tensor  # [B] int64 rows of req_to_token
    prefix_lens: torch.Tensor  # [B] int64
    extend_lens: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64 = prefix_lens + extend_lens
    # Host copies, so backends can size buffers without a device sync.
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    req_to_token: torch.Tensor  # [max_running_requests, max_context_len] int32
    kv_pool: KVPool
    attn_backend: AttentionBackend
    attn_metadata: Any = field(default=None)  # filled by attn_backend.prepare(self), the runner's call
    # [E] int64 token indices in [0, T) whose logits are wanted besides each request's last
    # new token (prompt logprobs); None when no request asked.
    extra_logits_indices: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_lens_cpu(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens_cpu, self.extend_lens_cpu, strict=True)]

    @property
    def is_decode(self) -> bool:
        return all(e == 1 for e in self.extend_lens_cpu)

    @property
    def logits_indices(self) -> torch.Tensor:
        """The rows the LM head reads, indices in ``[0, T)``: ``[0, B)`` each request's last new
        token (what the sampler reads), then ``[B, B + E)`` the extra rows."""
        last = torch.cumsum(self.extend_lens, dim=0) - 1
        if self.extra_logits_indices is None:
            return last
        return torch.cat([last, self.extra_logits_indices])

    @classmethod
    def build(
        cls,
        *,
        input_ids: list[int] | np.ndarray,
        prefix_lens: list[int],
        extend_lens: list[int],
        req_pool_indices: list[int],
        out_cache_loc: torch.Tensor,
        req_to_token: torch.Tensor,
        kv_pool: KVPool,
        attn_backend: AttentionBackend,
        device: torch.device | str = "cpu",
        extra_logits_indices: np.ndarray | None = None,
    ) -> ForwardBatch:
        """Build from host lists; positions are ``prefix_len + i`` for the i-th new token.

        ``extra_logits_indices``: token indices whose logits the forward also returns (after
        the B last-token rows), e.g. for prompt logprobs.
        """
        prefix_np = np.asarray(prefix_lens, dtype=np.int64)
        extend_np = np.asarray(extend_lens, dtype=np.int64)
        # Token t of request b sits at position prefix_lens[b] + (t - first token index of b).
        starts = np.cumsum(extend_np) - extend_np
        positions = np.arange(int(extend_np.sum()), dtype=np.int64) + np.repeat(
            prefix_np - starts, extend_np
        )
        prefix_t = torch.from_numpy(prefix_np)
        extend_t = torch.from_numpy(extend_np)
        fb = cls(
            input_ids=torch.as_tensor(np.asarray(input_ids, dtype=np.int64)).to(device),
            positions=torch.from_numpy(positions).to(device),
            out_cache_loc=out_cache_loc.to(device=device, dtype=torch.int64),
            req_pool_indices=torch.tensor(req_pool_indices, dtype=torch.int64, device=device),
            prefix_lens=prefix_t.to(device),
            extend_lens=extend_t.to(device),
            seq_lens=(prefix_t + extend_t).to(device),
            prefix_lens_cpu=list(prefix_lens),
            extend_lens_cpu=list(extend_lens),
            req_to_token=req_to_token,
            kv_pool=kv_pool,
            attn_backend=attn_backend,
            extra_logits_indices=(
                None
                if extra_logits_indices is None or len(extra_logits_indices) == 0
                else torch.from_numpy(np.asarray(extra_logits_indices, dtype=np.int64)).to(device)
            ),
        )
        return fb
