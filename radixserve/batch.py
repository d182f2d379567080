"""Explicit batch metadata handed to the model's forward and to the attention backend.

It lives outside the scheduler, the model and the attention backends because all three use it
and none owns it.  Whoever runs the forward (the scheduler's model runner, a tensor-parallel
rank) builds it from host arrays and then has the backend prepare it:
``backend.prepare(fb)`` plans the attention on the host and sends the batch's one upload.

Every index a forward uses is computed on the host and staged in ``fb.upload``; the device
fields below are :class:`~radixserve.transfer.Staged` placeholders until it is sent (on a CPU
they are tensors from the start).  Nothing here reads a device tensor back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from radixserve.transfer import Upload, resolve

if TYPE_CHECKING:
    from radixserve.cache.kv_pool import KVPool


class AttentionBackend(Protocol):
    """What a batch and the model's layers call on their attention backend (the interface
    every backend implements is ``attention/base.py``'s, which sits above this module)."""

    def prepare(self, fb: ForwardBatch) -> None: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any,
                fb: ForwardBatch) -> torch.Tensor: ...


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
    ``table_host`` is the same table on the host, what attention plans are built from.
    """

    # Device side (Staged until ``send``).
    input_ids: Any  # [T] int64
    positions: Any  # [T] int64
    out_cache_loc: Any  # [T] int64 KV slot of each new token
    req_pool_indices: Any  # [B] int64 rows of req_to_token
    prefix_lens: Any  # [B] int64
    extend_lens: Any  # [B] int64
    seq_lens: Any  # [B] int64 = prefix_lens + extend_lens
    # The rows the LM head reads, indices in [0, T): [0, B) each request's last new token (what
    # the sampler reads), then [B, B + E) the extra rows (prompt logprobs).
    logits_indices: Any
    req_to_token: torch.Tensor  # [max_running_requests, max_context_len] int32, on the device
    # Host side.
    rows_cpu: np.ndarray  # [B] int64 = req_pool_indices
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    table_host: np.ndarray  # req_to_token's host copy (rows [0, seq_len) agree once sent)
    num_tokens: int
    kv_pool: KVPool
    attn_backend: AttentionBackend
    upload: Upload
    # filled by attn_backend.prepare(self), the runner's call
    attn_metadata: Any = field(default=None)
    num_extra_logits: int = 0  # E
    # (flat index, slot) cells of req_to_token the device copy lacks; written by ``send``.
    table_updates: tuple[Any, Any] | None = None
    # The LoRA adapters of the batch's rows (``lora/batch.py``'s LoraBatch); None: base only.
    lora: Any = None

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens_cpu)

    @property
    def seq_lens_cpu(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens_cpu, self.extend_lens_cpu, strict=True)]

    @property
    def token_starts_cpu(self) -> list[int]:
        """First token index in ``[0, T)`` of each request's new tokens."""
        starts, acc = [], 0
        for e in self.extend_lens_cpu:
            starts.append(acc)
            acc += e
        return starts

    @property
    def is_decode(self) -> bool:
        return all(e == 1 for e in self.extend_lens_cpu)

    @property
    def device(self) -> torch.device:
        return self.upload.device

    def send(self) -> None:
        """The batch's one host-to-device copy (what the backend staged included); then the
        request table's missing cells are written on the device."""
        self.upload.send()
        if not self.upload.direct:  # on the host device nothing was staged: no placeholders
            resolve(self)
        if self.table_updates is not None:
            index, slots = self.table_updates
            self.req_to_token.view(-1).index_copy_(0, index, slots)
            self.table_updates = None

    @classmethod
    def build(
        cls,
        *,
        input_ids: list[int] | np.ndarray,
        prefix_lens: list[int],
        extend_lens: list[int],
        req_pool_indices: list[int],
        out_cache_loc: np.ndarray | torch.Tensor,
        req_to_token: torch.Tensor,
        kv_pool: KVPool,
        attn_backend: AttentionBackend,
        device: torch.device | str = "cpu",
        extra_logits_indices: np.ndarray | None = None,
        table_host: np.ndarray | None = None,
        table_updates: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> ForwardBatch:
        """Build from host arrays; positions are ``prefix_len + i`` for the i-th new token.

        ``extra_logits_indices``: token indices whose logits the forward also returns (after
        the B last-token rows), e.g. for prompt logprobs.  ``table_host``: the host copy of
        ``req_to_token`` (read from the device when not given: for callers outside the step
        loop); ``table_updates``: the cells of it the device copy lacks.
        """
        upload = Upload(device)
        prefix_np = np.asarray(prefix_lens, dtype=np.int64)
        extend_np = np.asarray(extend_lens, dtype=np.int64)
        # Token t of request b sits at position prefix_lens[b] + (t - first token index of b).
        starts = np.cumsum(extend_np) - extend_np
        positions = np.arange(int(extend_np.sum()), dtype=np.int64) + np.repeat(
            prefix_np - starts, extend_np
        )
        last = np.cumsum(extend_np) - 1
        extra = (
            np.zeros(0, dtype=np.int64) if extra_logits_indices is None else extra_logits_indices
        )
        if isinstance(out_cache_loc, torch.Tensor) and out_cache_loc.device.type != "cpu":
            out_loc: Any = out_cache_loc.to(torch.int64)  # a caller's device tensor, as given
        else:
            out_loc = upload.add(np.asarray(out_cache_loc))
        if table_host is None:
            table_host = req_to_token.cpu().numpy()
        updates = None
        if table_updates is not None:
            updates = (upload.add(table_updates[0]), upload.add(table_updates[1], np.int32))
        return cls(
            input_ids=upload.add(input_ids),
            positions=upload.add(positions),
            out_cache_loc=out_loc,
            req_pool_indices=upload.add(req_pool_indices),
            prefix_lens=upload.add(prefix_np),
            extend_lens=upload.add(extend_np),
            seq_lens=upload.add(prefix_np + extend_np),
            logits_indices=upload.add(np.concatenate([last, np.asarray(extra, dtype=np.int64)])),
            req_to_token=req_to_token,
            rows_cpu=np.asarray(req_pool_indices, dtype=np.int64),
            prefix_lens_cpu=list(prefix_lens),
            extend_lens_cpu=list(extend_lens),
            table_host=table_host,
            num_tokens=len(positions),
            kv_pool=kv_pool,
            attn_backend=attn_backend,
            upload=upload,
            num_extra_logits=len(extra),
            table_updates=updates,
        )
