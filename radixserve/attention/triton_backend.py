"""Triton attention: the GPU default.  Kernels live in ``kernels/`` (``radixserve.kernels``).

Each forward splits the batch the way the torch backend does, but both groups write straight
into one output tensor, so nothing is padded or scattered:

- decode rows (``extend_len == 1``) go to the split-KV decode kernel, all query heads of a KV
  head in one program;
- extend rows (``extend_len > 1``) go to the extend kernel, one launch for all of them.

Per layer that is: one KV store launch, then at most two decode launches (split + merge) and
one extend launch.  Everything they index with (table rows, lengths, work items, the split
workspace) is planned once per forward in :meth:`TritonAttentionBackend.plan` from the host-side
lists, and its arrays travel in the batch's one upload: no device sync.

An 8-bit pool (``--kv-cache-dtype``) is read in place by the same kernels, its scales passed
beside it; its rows are stored in the Hadamard basis (kv_pool.py), so q, k and v are turned
into that basis before the launches and the output is turned back after them.

Without a CUDA device the kernels run in Triton's interpreter (slow; for tests and CPU
debugging): ``TRITON_INTERPRET=1`` is set before Triton is first imported, here and in
``radixserve.kernels``, so ``--attention-backend triton`` also works in a spawned scheduler.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from radixserve.attention.base import AttentionBackend, AttentionLayerInfo  # noqa: E402
from radixserve.cache.kv_pool import fwht  # noqa: E402
from radixserve.kernels.common import num_sms  # noqa: E402
from radixserve.kernels.decode_attention import (  # noqa: E402
    alloc_decode_workspace,
    decode_attention,
    decode_config,
    decode_num_splits,
)
from radixserve.kernels.extend_attention import (  # noqa: E402
    ExtendPlan,
    build_extend_plan,
    extend_attention,
)
from radixserve.kernels.kv_store import store_kv  # noqa: E402
from radixserve.kernels.shared_prefix_decode import (  # noqa: E402
    CascadeHostPlan,
    alloc_cascade_workspace,
    build_cascade_plan,
    cascade_decode_attention,
)

# What decides graph replay against a cascade for a decode batch with shared prefixes (see
# graph_compatible): an HBM rate of a current data-centre GPU, and the ~10 launches of a few
# microseconds per layer that one graph replay saves.  Estimates; bench/gpu_check.sh measures.
DEVICE_BYTES_PER_S = 3e12
GRAPH_SAVES_S_PER_LAYER = 40e-6

if TYPE_CHECKING:
    from radixserve.batch import ForwardBatch
    from radixserve.cache.kv_pool import KVPool


@dataclass
class DecodePlan:
    table_rows: Any  # [Bd] rows of req_to_token (uploaded with the batch)
    seq_lens: Any  # [Bd] keys per row, the new token included
    token_idx: Any  # [Bd] the row's token in [0, T)
    num_splits: int
    # [Bd, H, S, D] / [Bd, H, S] float32 ([.., 2S, ..] with a cascade), allocated by the first
    # layer and reused by the rest.
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None
    # Shared prefixes read once per group (kernels/shared_prefix_decode.py): kv_start, tile_row,
    # tile_len, tile_ptr, tile_members, uploaded with the batch; None: plain decode.
    cascade: tuple[Any, ...] | None = None


@dataclass
class TritonAttentionMetadata:
    decode: DecodePlan | None
    extend: ExtendPlan | None


class TritonAttentionBackend(AttentionBackend):
    """Paged decode / extend attention in Triton kernels."""

    name = "triton"
    supports_cuda_graphs = True

    def __init__(self, num_splits: int | None = None) -> None:
        # None: chosen per forward from the batch shape and the device's SM count.
        self.num_splits = num_splits
        self.cascade_steps = 0  # decode forwards that read a shared prefix once per group
        self._cascade_for: tuple[ForwardBatch, CascadeHostPlan | None] | None = None

    # ---------------------------------------------------------------- metadata (once per step)

    def plan(self, fb: ForwardBatch) -> None:
        extend_lens = fb.extend_lens_cpu
        dec_rows = [b for b, e in enumerate(extend_lens) if e == 1]
        ext_rows = [b for b, e in enumerate(extend_lens) if e > 1]
        # Token range of request b in [0, T): [starts[b], starts[b] + extend_lens[b]).
        starts = fb.token_starts_cpu
        decode = self._plan_decode(fb, dec_rows, starts) if dec_rows else None
        extend = None
        if ext_rows:
            rows = fb.req_pool_indices if not dec_rows else fb.upload.add(fb.rows_cpu[ext_rows])
            extend = build_extend_plan(
                rows,
                [fb.prefix_lens_cpu[b] for b in ext_rows],
                [extend_lens[b] for b in ext_rows],
                [starts[b] for b in ext_rows],
                fb.kv_pool.head_dim,
                fb.kv_pool.dtype,
                upload=fb.upload,
            )
        fb.attn_metadata = TritonAttentionMetadata(decode=decode, extend=extend)

    def _plan_decode(self, fb: ForwardBatch, rows: list[int], starts: list[int]) -> DecodePlan:
        upload = fb.upload
        if len(rows) == fb.batch_size:  # pure decode: token b is request b
            table_rows, seq_lens = fb.req_pool_indices, fb.seq_lens
            token_idx = upload.add(np.arange(len(rows)))
        else:
            table_rows = upload.add(fb.rows_cpu[rows])
            seq_lens = upload.add([fb.prefix_lens_cpu[b] + 1 for b in rows])
            token_idx = upload.add([starts[b] for b in rows])
        num_splits = self.num_splits
        if num_splits is None:
            pool = fb.kv_pool
            max_len = max(fb.prefix_lens_cpu[b] + 1 for b in rows)
            block_n = decode_config(pool.head_dim, pool.dtype).block_n
            num_splits = decode_num_splits(
                len(rows), pool.num_kv_heads, max_len, num_sms(fb.device), block_n
            )
        cascade = None
        host = self._cascade_plan(fb, rows)
        if host is not None:
            self.cascade_steps += 1
            cascade = (upload.add(host.kv_start, np.int32), upload.add(host.tile_row, np.int32),
                       upload.add(host.tile_len, np.int32), upload.add(host.tile_ptr, np.int32),
                       upload.add(host.tile_members, np.int32))
        return DecodePlan(table_rows, seq_lens, token_idx, num_splits, cascade=cascade)

    def _cascade_plan(self, fb: ForwardBatch, rows: list[int]) -> CascadeHostPlan | None:
        """Groups of decode rows sharing a cached prefix (host table), or None.  Needs the
        model's head layout (``self.layer``, set by the runner)."""
        cached = self._cascade_for
        if cached is not None and cached[0] is fb:
            return cached[1]
        plan = None
        if self.layer is not None and len(rows) > 1:
            layer = self.layer
            plan = build_cascade_plan(
                fb.table_host, fb.rows_cpu[rows], [fb.prefix_lens_cpu[b] + 1 for b in rows],
                layer.num_heads // layer.num_kv_heads, layer.head_dim, fb.kv_pool.dtype)
        self._cascade_for = (fb, plan)
        return plan

    def graph_compatible(self, fb: ForwardBatch) -> bool:
        """A graph replays plain decode.  A batch whose shared prefixes would cost more to
        read once per request than the launches a graph saves runs eagerly, as a cascade."""
        plan = self._cascade_plan(fb, list(range(fb.batch_size)))
        if plan is None:
            return True
        members = np.diff(plan.tile_ptr)
        saved_keys = int((plan.tile_len.astype(np.int64) * (members - 1)).sum())
        pool = fb.kv_pool
        key_bytes = pool.bytes_per_token
        return (
            saved_keys * key_bytes / DEVICE_BYTES_PER_S < pool.num_layers * GRAPH_SAVES_S_PER_LAYER
        )

    def graph_plan(self, table_rows: torch.Tensor, seq_lens: torch.Tensor, token_idx: torch.Tensor,
                   layer: AttentionLayerInfo, kv_pool: KVPool, max_context_len: int
                   ) -> TritonAttentionMetadata:
        """Decode over static buffers: the split count fixed for the longest context (splits
        past a row's keys are skipped), the workspace allocated now, outside any capture."""
        bs, device = table_rows.shape[0], table_rows.device
        num_splits = self.num_splits or decode_num_splits(
            bs, layer.num_kv_heads, max_context_len, num_sms(device),
            decode_config(layer.head_dim, kv_pool.dtype).block_n,
        )
        workspace = alloc_decode_workspace(bs, layer.num_heads, num_splits, layer.head_dim, device)
        return TritonAttentionMetadata(
            decode=DecodePlan(table_rows, seq_lens, token_idx, num_splits, workspace), extend=None)

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
        pool = fb.kv_pool
        k_buf, v_buf = pool.get_kv(layer.layer_id)
        k_scale, v_scale = pool.get_scales(layer.layer_id)
        if out is None:
            out = q.new_empty((q.shape[0], layer.num_heads * layer.head_dim))
        if pool.rotated:
            # The pool holds rows turned by the Hadamard matrix (kv_pool.py): turn q, k and v
            # the same way, attend in that basis, and turn the output back below.
            q, k, v = fwht(q).to(q.dtype), fwht(k), fwht(v)
        store_kv(k_buf, v_buf, fb.out_cache_loc, k, v, k_scale, v_scale)
        scales = {"k_scale": k_scale, "v_scale": v_scale}
        dec = meta.decode
        if dec is not None:
            batch = dec.table_rows.shape[0]
            if dec.cascade is not None:
                if dec.workspace is None:
                    dec.workspace = alloc_cascade_workspace(
                        batch, layer.num_heads, dec.num_splits, layer.head_dim, q.device)
                cascade_decode_attention(
                    q, k_buf, v_buf, out, fb.req_to_token, dec.table_rows, dec.seq_lens,
                    dec.token_idx, *dec.cascade, layer.scaling, dec.num_splits, dec.workspace,
                    **scales,
                )
            else:
                if dec.workspace is None:
                    dec.workspace = alloc_decode_workspace(
                        batch, layer.num_heads, dec.num_splits, layer.head_dim, q.device)
                decode_attention(
                    q, k_buf, v_buf, out, fb.req_to_token, dec.table_rows, dec.seq_lens,
                    dec.token_idx, layer.scaling, dec.num_splits, dec.workspace, **scales,
                )
        if meta.extend is not None:
            extend_attention(
                q, k, v, k_buf, v_buf, out, fb.req_to_token, meta.extend, layer.scaling, **scales
            )
        if pool.rotated:
            heads = out.view(out.shape[0], layer.num_heads, layer.head_dim)
            heads.copy_(fwht(heads))
        return out
