"""Triton attention: the GPU default.  Kernels live in ``kernels/`` (``radixserve.kernels``).

Each forward splits the batch the way the torch backend does, but both groups write straight
into one output tensor, so nothing is padded or scattered:

- decode rows (``extend_len == 1``) go to the split-KV decode kernel, all query heads of a KV
  head in one program;
- extend rows (``extend_len > 1``) go to the extend kernel, one launch for all of them.

Per layer that is: one KV store launch, then at most two decode launches (split + merge) and
one extend launch.  Everything they index with (table rows, lengths, work items, the split
workspace) is built once per forward in :meth:`TritonAttentionBackend.prepare`, from the
host-side length lists, without a device sync.

Without a CUDA device the kernels run in Triton's interpreter (slow; for tests and CPU
debugging): ``TRITON_INTERPRET=1`` is set before Triton is first imported, here and in
``radixserve.kernels``, so ``--attention-backend triton`` also works in a spawned scheduler.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from radixserve.attention.base import AttentionBackend, AttentionLayerInfo  # noqa: E402
from radixserve.kernels.common import num_sms  # noqa: E402
from radixserve.kernels.decode_attention import (  # noqa: E402
    alloc_decode_workspace,
    decode_attention,
    decode_config,
    decode_num_splits,
)
from radixserve.kernels.extend_attention import ExtendPlan, build_extend_plan, extend_attention  # noqa: E402
from radixserve.kernels.kv_store import store_kv  # noqa: E402

if TYPE_CHECKING:
    from radixserve.batch import ForwardBatch


@dataclass
class DecodePlan:
    table_rows: torch.Tensor  # [Bd] rows of req_to_token
    seq_lens: torch.Tensor  # [Bd] keys per row, the new token included
    token_idx: torch.Tensor  # [Bd] the row's token in [0, T)
    num_splits: int
    # [Bd, H, S, D] / [Bd, H, S] float32, allocated by the first layer and reused by the rest.
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class TritonAttentionMetadata:
    decode: DecodePlan | None
    extend: ExtendPlan | None


class TritonAttentionBackend(AttentionBackend):
    """Paged decode / extend attention in Triton kernels."""

    name = "triton"

    def __init__(self, num_splits: int | None = None) -> None:
        # None: chosen per forward from the batch shape and the device's SM count.
        self.num_splits = num_splits

    # ---------------------------------------------------------------- metadata (once per step)

    def prepare(self, fb: ForwardBatch) -> None:
        device = fb.input_ids.device
        extend_lens = fb.extend_lens_cpu
        dec_rows = [b for b, e in enumerate(extend_lens) if e == 1]
        ext_rows = [b for b, e in enumerate(extend_lens) if e > 1]
        # Token range of request b in [0, T): [starts[b], starts[b] + extend_lens[b]).
        starts, acc = [], 0
        for e in extend_lens:
            starts.append(acc)
            acc += e
        decode = self._prepare_decode(fb, dec_rows, starts, device) if dec_rows else None
        extend = None
        if ext_rows:
            rows = fb.req_pool_indices
            if dec_rows:
                rows = rows.index_select(0, torch.tensor(ext_rows, device=device))
            extend = build_extend_plan(
                rows,
                [fb.prefix_lens_cpu[b] for b in ext_rows],
                [extend_lens[b] for b in ext_rows],
                [starts[b] for b in ext_rows],
                fb.kv_pool.head_dim,
                fb.kv_pool.dtype,
            )
        fb.attn_metadata = TritonAttentionMetadata(decode=decode, extend=extend)

    def _prepare_decode(
        self, fb: ForwardBatch, rows: list[int], starts: list[int], device: torch.device
    ) -> DecodePlan:
        if len(rows) == fb.batch_size:  # pure decode: token b is request b
            table_rows, seq_lens = fb.req_pool_indices, fb.seq_lens
            token_idx = torch.arange(len(rows), device=device)
        else:
            # One copy: [rows | their token index].
            idx = torch.tensor(rows + [starts[b] for b in rows], device=device)
            rows_t, token_idx = idx[: len(rows)], idx[len(rows) :]
            table_rows = fb.req_pool_indices.index_select(0, rows_t)
            seq_lens = fb.seq_lens.index_select(0, rows_t)
        num_splits = self.num_splits
        if num_splits is None:
            pool = fb.kv_pool
            max_len = max(fb.prefix_lens_cpu[b] + 1 for b in rows)
            block_n = decode_config(pool.head_dim, pool.dtype).block_n
            num_splits = decode_num_splits(
                len(rows), pool.num_kv_heads, max_len, num_sms(device), block_n
            )
        return DecodePlan(table_rows, seq_lens, token_idx, num_splits)

    # ---------------------------------------------------------------- per layer

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayerInfo,
        fb: ForwardBatch,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As the interface says; ``out`` ([T, H * D], q's dtype) may be passed in, and every
        element of it is overwritten."""
        meta: TritonAttentionMetadata = fb.attn_metadata
        k_buf, v_buf = fb.kv_pool.get_kv(layer.layer_id)
        store_kv(k_buf, v_buf, fb.out_cache_loc, k, v)
        if out is None:
            out = q.new_empty((q.shape[0], layer.num_heads * layer.head_dim))
        dec = meta.decode
        if dec is not None:
            if dec.workspace is None:
                dec.workspace = alloc_decode_workspace(
                    dec.table_rows.shape[0], layer.num_heads, dec.num_splits, layer.head_dim,
                    q.device,
                )
            decode_attention(
                q, k_buf, v_buf, out, fb.req_to_token, dec.table_rows, dec.seq_lens,
                dec.token_idx, layer.scaling, dec.num_splits, dec.workspace,
            )
        if meta.extend is not None:
            extend_attention(
                q, k, v, k_buf, v_buf, out, fb.req_to_token, meta.extend, layer.scaling
            )
        return out
