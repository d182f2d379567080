"""Pure-torch attention over slots gathered from the pool: the CPU fallback where the C++
kernel cannot be built (no compiler), and the second reference of the attention tests.

Each forward splits the batch into two groups so that a long prefill never pads the decodes:

- decode rows (``extend_len == 1``): one query token per request.  The ``G = H / KV`` query
  heads that share a KV head are folded into the query-length axis, so SDPA sees plain
  multi-head attention ``[n, KV, G, D] x [n, KV, L, D]`` with a key-padding mask and the
  KV is never expanded.
  Decode rows whose table rows start with the same slots (a prefix shared through the radix
  tree) go through ``shared_prefix.py`` instead: the shared K/V is read once per group.
- extend rows (``extend_len > 1``): queries padded to ``[Be, Emax]``, keys to ``[Be, Lmax]``,
  and a boolean mask that is causal over the new tokens and open over the cached prefix.

Keys and values are gathered from the pool by slot into a workspace that is reused across
layers and steps (allocating a fresh gather buffer per layer costs more than the gather
itself on CPU).  Decode rows are processed in chunks of rows whose gathered K/V fit in a few
MiB, so SDPA reads them back from cache instead of memory.  All index arrays are
computed on the host once per forward in :meth:`GatherPath.plan` (they travel in the batch's one
upload), the slot grids and masks derived from them on the device in :meth:`GatherPath.finish`;
nothing reads a device tensor back, and the per-layer work is a bounded number of tensor ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from radixserve.attention.base import AttentionLayerInfo
from radixserve.attention.shared_prefix import SharedPrefixDecode, find_shared_prefixes

if TYPE_CHECKING:
    from radixserve.batch import ForwardBatch
    from radixserve.cache.kv_pool import KVPool

# Target size of the gathered K+V of one decode chunk (bytes, float32 of the default model's
# geometry): a few requests' K/V per chunk, small enough that SDPA reads the gathered K/V back
# from cache, where one big gather would go out to memory.
DECODE_CHUNK_BYTES = 7 << 20


@dataclass
class _DecodeChunk:
    rows: Any  # [n] positions within the decode group
    table_rows: Any  # [n] rows of req_to_token
    lens: Any  # [n] keys of each row
    max_len: int  # L
    padded: bool  # some row has fewer than L keys
    # Derived on the device once the upload is sent:
    slots: torch.Tensor | None = None  # [n * L] int64 KV slots; padding points at slot 0
    # [n, 1, 1, L] bool, True where key j < seq_len; None if no pad
    mask: torch.Tensor | None = None

    def finish(self, req_to_token: torch.Tensor) -> None:
        live = torch.arange(self.max_len, device=req_to_token.device)[None, :] < self.lens[:, None]
        slots = req_to_token[:, : self.max_len].index_select(0, self.table_rows).to(torch.int64)
        self.slots = torch.where(live, slots, 0).reshape(-1)
        self.mask = live[:, None, None, :] if self.padded else None


@dataclass
class _DecodeGroup:
    token_idx: Any  # [Bd] index into the T new tokens
    chunks: list[_DecodeChunk]  # rows without a shared prefix
    shared: SharedPrefixDecode | None = None  # rows that share a cached prefix


@dataclass
class _ExtendGroup:
    query_idx: Any  # [Be * Emax] index into the T new tokens (padding -> 0)
    valid_idx: Any  # [sum extend_len] positions in [0, Be * Emax) of the real query rows
    token_idx: Any  # [sum extend_len] index into T of the valid query rows, in order
    num_rows: int  # Be
    max_extend: int  # Emax
    max_len: int  # Lmax
    # None when the keys are the new tokens only (one fresh prompt: plain causal attention).
    table_rows: Any = None  # [Be] rows of req_to_token
    prefix_lens: Any = None  # [Be]
    seq_lens: Any = None  # [Be]
    # Derived on the device once the upload is sent:
    slots: torch.Tensor | None = None  # [Be * Lmax] KV slots
    mask: torch.Tensor | None = None  # [Be, 1, Emax, Lmax] bool

    def finish(self, req_to_token: torch.Tensor) -> None:
        if self.table_rows is None:
            return
        # Key grid [Be, Lmax]: columns [0, prefix_len) cached, [prefix_len, seq_len) new,
        # [seq_len, Lmax) padding -> slot 0.  New token i may see key j iff j <= prefix_len + i.
        device = req_to_token.device
        kj = torch.arange(self.max_len, device=device)
        qi = torch.arange(self.max_extend, device=device)
        live = kj[None, :] < self.seq_lens[:, None]  # [Be, Lmax]
        slots = req_to_token[:, : self.max_len].index_select(0, self.table_rows).to(torch.int64)
        self.slots = torch.where(live, slots, 0).reshape(-1)
        causal = kj[None, None, :] <= (self.prefix_lens[:, None, None] + qi[None, :, None])
        self.mask = (causal & live[:, None, :])[:, None]  # padded queries keep key 0: no empty rows


def bucket_extend_rows(
    rows: list[int], extend_lens: list[int], seq_lens: list[int]
) -> list[list[int]]:
    """Split extend rows into groups padded together, so that no group computes more than
    1.25 times the attention area (queries x keys) its rows need: a 1024-token prompt and fifteen
    48-token questions in one step must not pad every question to 1024 queries."""
    order = sorted(rows, key=lambda b: (-extend_lens[b], -seq_lens[b]))
    buckets: list[list[int]] = []
    need = emax = lmax = 0
    for b in order:
        e, sl = extend_lens[b], seq_lens[b]
        if buckets:
            new_need, new_l = need + e * sl, max(lmax, sl)
            if 4 * (len(buckets[-1]) + 1) * emax * new_l <= 5 * new_need:
                buckets[-1].append(b)
                need, lmax = new_need, new_l
                continue
        buckets.append([b])
        need, emax, lmax = e * sl, e, sl
    # Batch order inside each bucket: a single bucket's output is then already in token order.
    return [sorted(bucket) for bucket in buckets]


@dataclass
class TorchAttentionMetadata:
    decode: _DecodeGroup | None
    extend: list[_ExtendGroup]
    # True when every token belongs to one group in order, so outputs need no scatter.
    single_group: bool


class GatherPath:
    """Batched SDPA over slots gathered from the KV pool."""

    def __init__(self) -> None:
        self._workspace: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    # ---------------------------------------------------------------- metadata (once per step)

    def plan(self, fb: ForwardBatch) -> None:
        """Host decisions and staged index arrays; :meth:`finish` derives the rest on the
        device once they are there."""
        extend_lens = fb.extend_lens_cpu
        seq_lens = fb.seq_lens_cpu
        starts = fb.token_starts_cpu
        dec_rows = [b for b, e in enumerate(extend_lens) if e == 1]
        ext_rows = [b for b, e in enumerate(extend_lens) if e > 1]
        decode = self._plan_decode(fb, dec_rows, starts, seq_lens) if dec_rows else None
        extend = [
            self._plan_extend(fb, bucket, starts, seq_lens)
            for bucket in bucket_extend_rows(ext_rows, extend_lens, seq_lens)
        ]
        fb.attn_metadata = TorchAttentionMetadata(
            decode=decode,
            extend=extend,
            single_group=(
                (decode is None and len(extend) == 1) or (decode is not None and not extend)
            ),
        )

    def finish(self, fb: ForwardBatch) -> None:
        meta: TorchAttentionMetadata = fb.attn_metadata
        if meta.decode is not None:
            for chunk in meta.decode.chunks:
                chunk.finish(fb.req_to_token)
            if meta.decode.shared is not None:
                meta.decode.shared.finish(fb.req_to_token)
        for group in meta.extend:
            group.finish(fb.req_to_token)

    def _plan_decode(
        self, fb: ForwardBatch, rows: list[int], starts: list[int], seq_lens: list[int]
    ) -> _DecodeGroup:
        pool, upload = fb.kv_pool, fb.upload
        bytes_per_key = 2 * pool.num_kv_heads * pool.head_dim * 4
        budget = max(1, DECODE_CHUNK_BYTES // bytes_per_key)  # padded keys per chunk
        # Longest contexts first, so each chunk pads its rows to similar lengths; a chunk takes
        # rows while (rows * its longest seq_len) fits the budget (always at least one row).
        shared, plain = find_shared_prefixes(fb, rows, seq_lens)
        order = sorted(plain, key=lambda i: -seq_lens[rows[i]])
        chunks = []
        i = 0
        while i < len(order):
            n_len = seq_lens[rows[order[i]]]
            n = max(1, min(len(order) - i, budget // n_len))
            members = order[i : i + n]
            i += n
            batch_rows = [rows[m] for m in members]
            lens = [seq_lens[b] for b in batch_rows]
            chunks.append(_DecodeChunk(
                rows=upload.add(members),
                table_rows=upload.add(fb.rows_cpu[batch_rows]),
                lens=upload.add(lens),
                max_len=n_len,
                padded=min(lens) != n_len,
            ))
        return _DecodeGroup(
            token_idx=upload.add([starts[b] for b in rows]), chunks=chunks, shared=shared
        )

    def _plan_extend(
        self, fb: ForwardBatch, rows: list[int], starts: list[int], seq_lens: list[int]
    ) -> _ExtendGroup:
        upload = fb.upload
        ext = np.asarray([fb.extend_lens_cpu[b] for b in rows], dtype=np.int64)
        pre = np.asarray([fb.prefix_lens_cpu[b] for b in rows], dtype=np.int64)
        start = np.asarray([starts[b] for b in rows], dtype=np.int64)
        max_extend, max_len = int(ext.max()), int((pre + ext).max())
        # Query grid [Be, Emax]: column i < extend_len is new token start + i; the rest pads.
        qi = np.arange(max_extend)
        valid = (qi[None, :] < ext[:, None]).reshape(-1)
        query_idx = np.where(valid, (start[:, None] + qi[None, :]).reshape(-1), 0)
        group = _ExtendGroup(
            query_idx=upload.add(query_idx),
            valid_idx=upload.add(np.flatnonzero(valid)),
            token_idx=upload.add(query_idx[valid]),
            num_rows=len(rows),
            max_extend=max_extend,
            max_len=max_len,
        )
        # One fresh prompt over a pool in the model's dtype: plain causal attention over this
        # step's k/v.  An 8-bit pool is read back (every path attends over the stored values).
        if len(rows) > 1 or pre[0] > 0 or fb.kv_pool.quantized:
            group.table_rows = upload.add(fb.rows_cpu[rows])
            group.prefix_lens = upload.add(pre)
            group.seq_lens = upload.add(pre + ext)
        return group

    # ---------------------------------------------------------------- per layer

    def _buffers(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A reusable [2, numel] buffer for gathered K and V (grows, never shrinks)."""
        key = (dtype, device)
        buf = self._workspace.get(key)
        if buf is None or buf.shape[1] < numel:
            buf = torch.empty((2, numel), dtype=dtype, device=device)
            self._workspace[key] = buf
        return buf

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayerInfo,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        """Attend; ``k``/``v`` are already stored in the pool."""
        meta: TorchAttentionMetadata = fb.attn_metadata
        pool = fb.kv_pool
        num_tokens = q.shape[0]
        width = layer.num_heads * layer.head_dim
        if meta.single_group:
            if meta.decode is not None:
                return self._decode(q, pool, layer, meta.decode)
            return self._extend(q, k, v, pool, layer, meta.extend[0])
        out = q.new_empty((num_tokens, width))
        if meta.decode is not None:
            out.index_copy_(0, meta.decode.token_idx, self._decode(q, pool, layer, meta.decode))
        for group in meta.extend:
            out.index_copy_(0, group.token_idx, self._extend(q, k, v, pool, layer, group))
        return out

    def _decode(
        self,
        q: torch.Tensor,
        pool: KVPool,
        layer: AttentionLayerInfo,
        group: _DecodeGroup,
    ) -> torch.Tensor:
        kv_heads, dim = layer.num_kv_heads, layer.head_dim
        heads_per_kv = layer.num_heads // kv_heads
        bd = group.token_idx.shape[0]
        # Heads h = kv * G + g share KV head kv: fold g into the query axis.
        qd = q.index_select(0, group.token_idx).view(bd, kv_heads, heads_per_kv, dim)
        qd = qd.to(pool.dtype)
        out = q.new_empty((bd, kv_heads, heads_per_kv, dim), dtype=pool.dtype)
        if group.shared is not None:
            o = group.shared.forward(qd, pool, layer)
            out.index_copy_(0, group.shared.rows, o.to(out.dtype))
        if not group.chunks:
            return out.view(bd, kv_heads * heads_per_kv * dim).to(q.dtype)
        biggest = max(c.slots.shape[0] for c in group.chunks)
        buf = self._buffers(biggest * kv_heads * dim, pool.dtype, pool.device)
        for c in group.chunks:
            n = c.rows.shape[0]
            numel = c.slots.shape[0] * kv_heads * dim
            kg = buf[0, :numel].view(-1, kv_heads, dim)
            vg = buf[1, :numel].view(-1, kv_heads, dim)
            pool.read(layer.layer_id, c.slots, kg, vg)
            kc = kg.view(n, c.max_len, kv_heads, dim).transpose(1, 2)
            vc = vg.view(n, c.max_len, kv_heads, dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                qd.index_select(0, c.rows), kc, vc, attn_mask=c.mask, scale=layer.scaling
            )
            out.index_copy_(0, c.rows, o)
        return out.view(bd, kv_heads * heads_per_kv * dim).to(q.dtype)

    def _extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pool: KVPool,
        layer: AttentionLayerInfo,
        group: _ExtendGroup,
    ) -> torch.Tensor:
        heads, kv_heads, dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
        be, emax, lmax = group.num_rows, group.max_extend, group.max_len
        dtype = pool.dtype
        if group.slots is None:
            # Single fresh prompt: no padding, keys are this step's k/v.
            if q.shape[0] != emax:  # mixed batch: pick this prompt's tokens
                q, k, v = (t.index_select(0, group.token_idx) for t in (q, k, v))
            qe = q.to(dtype).view(1, emax, heads, dim).transpose(1, 2)
            ke = k.to(dtype).view(1, emax, kv_heads, dim).transpose(1, 2)
            ve = v.to(dtype).view(1, emax, kv_heads, dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                qe, ke, ve, is_causal=True, scale=layer.scaling, enable_gqa=heads != kv_heads
            )
            return o.transpose(1, 2).reshape(emax, heads * dim).to(q.dtype)
        qe = q.index_select(0, group.query_idx).to(dtype).view(be, emax, heads, dim).transpose(1, 2)
        numel = group.slots.shape[0] * kv_heads * dim
        buf = self._buffers(numel, dtype, pool.device)
        kg = buf[0, :numel].view(-1, kv_heads, dim)
        vg = buf[1, :numel].view(-1, kv_heads, dim)
        pool.read(layer.layer_id, group.slots, kg, vg)
        ke = kg.view(be, lmax, kv_heads, dim).transpose(1, 2)
        ve = vg.view(be, lmax, kv_heads, dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            qe, ke, ve, attn_mask=group.mask, scale=layer.scaling, enable_gqa=heads != kv_heads
        )
        o = o.transpose(1, 2).reshape(be * emax, heads * dim)
        if be > 1 or emax != group.token_idx.shape[0]:
            o = o.index_select(0, group.valid_idx)
        return o.to(q.dtype)
