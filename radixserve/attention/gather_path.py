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
MiB, so SDPA reads them back from cache instead of memory.  All index tensors and masks are
built once per forward in :meth:`GatherPath.prepare`; the per-layer work is a
bounded number of tensor ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from radixserve.attention.base import AttentionLayerInfo
from radixserve.attention.shared_prefix import SharedPrefixDecode, find_shared_prefixes

if TYPE_CHECKING:
    from radixserve.batch import ForwardBatch

# Target size of the gathered K+V of one decode chunk (bytes, float32 of the default model's
# geometry).  Measured on a 2-core EPYC: chunks of ~4 requests x 1100 tokens beat one big
# gather by ~1.7x because SDPA then reads the K/V from cache.
DECODE_CHUNK_BYTES = 7 << 20


@dataclass
class _DecodeChunk:
    rows: torch.Tensor  # [n] positions within the decode group
    slots: torch.Tensor  # [n * L] int64 KV slots; padding points at slot 0
    mask: torch.Tensor | None  # [n, 1, 1, L] bool, True where key j < seq_len; None if no pad
    max_len: int  # L


@dataclass
class _DecodeGroup:
    token_idx: torch.Tensor  # [Bd] index into the T new tokens
    chunks: list[_DecodeChunk]  # rows without a shared prefix
    shared: SharedPrefixDecode | None = None  # rows that share a cached prefix


@dataclass
class _ExtendGroup:
    query_idx: torch.Tensor  # [Be * Emax] index into the T new tokens (padding -> 0)
    valid: torch.Tensor  # [Be * Emax] bool, False on padded query rows
    token_idx: torch.Tensor  # [sum extend_len] index into T of the valid query rows, in order
    slots: torch.Tensor | None  # [Be * Lmax] KV slots, None when keys are the new tokens only
    mask: torch.Tensor | None  # [Be, 1, Emax, Lmax] bool, None when plain causal suffices
    num_rows: int  # Be
    max_extend: int  # Emax
    max_len: int  # Lmax


def bucket_extend_rows(rows: list[int], extend_lens: list[int], seq_lens: list[int]) -> list[list[int]]:
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

    def prepare(self, fb: ForwardBatch) -> None:
        device = fb.input_ids.device
        extend_lens = fb.extend_lens_cpu
        seq_lens = fb.seq_lens_cpu
        # Start of each request's new tokens in [0, T).
        starts, acc = [], 0
        for e in extend_lens:
            starts.append(acc)
            acc += e
        dec_rows = [b for b, e in enumerate(extend_lens) if e == 1]
        ext_rows = [b for b, e in enumerate(extend_lens) if e > 1]
        decode = None
        if dec_rows:
            decode = self._prepare_decode(fb, dec_rows, starts, seq_lens, device)
        extend = [
            self._prepare_extend(fb, bucket, starts, seq_lens, device)
            for bucket in bucket_extend_rows(ext_rows, extend_lens, seq_lens)
        ]
        fb.attn_metadata = TorchAttentionMetadata(
            decode=decode,
            extend=extend,
            single_group=(decode is None and len(extend) == 1) or (decode is not None and not extend),
        )

    def _prepare_decode(
        self,
        fb: ForwardBatch,
        rows: list[int],
        starts: list[int],
        seq_lens: list[int],
        device: torch.device,
    ) -> _DecodeGroup:
        pool = fb.kv_pool
        bytes_per_key = 2 * pool.num_kv_heads * pool.head_dim * 4
        budget = max(1, DECODE_CHUNK_BYTES // bytes_per_key)  # padded keys per chunk
        # Longest contexts first, so each chunk pads its rows to similar lengths; a chunk takes
        # rows while (rows * its longest seq_len) fits the budget (always at least one row).
        shared, plain = find_shared_prefixes(fb, rows, seq_lens, device)
        order = sorted(plain, key=lambda i: -seq_lens[rows[i]])
        rows_t = torch.tensor(rows, dtype=torch.int64, device=device)
        chunks = []
        i = 0
        while i < len(order):
            n_len = seq_lens[rows[order[i]]]
            n = max(1, min(len(order) - i, budget // n_len))
            members = order[i : i + n]
            i += n
            chunk_lens = [seq_lens[rows[m]] for m in members]
            rows_in_group = torch.tensor(members, dtype=torch.int64, device=device)
            batch_rows = rows_t.index_select(0, rows_in_group)
            # Columns [0, seq_len) of a row are live slots; [seq_len, n_len) pad -> slot 0.
            lens = fb.seq_lens.index_select(0, batch_rows)
            live = torch.arange(n_len, device=device)[None, :] < lens[:, None]  # [n, L]
            table_rows = fb.req_pool_indices.index_select(0, batch_rows)
            slots = fb.req_to_token[:, :n_len].index_select(0, table_rows).to(torch.int64)
            slots = torch.where(live, slots, 0).reshape(-1)
            mask = None if min(chunk_lens) == n_len else live[:, None, None, :]
            chunks.append(_DecodeChunk(rows_in_group, slots, mask, n_len))
        token_idx = torch.tensor([starts[b] for b in rows], dtype=torch.int64, device=device)
        return _DecodeGroup(token_idx=token_idx, chunks=chunks, shared=shared)

    def _prepare_extend(
        self,
        fb: ForwardBatch,
        rows: list[int],
        starts: list[int],
        seq_lens: list[int],
        device: torch.device,
    ) -> _ExtendGroup:
        prefix_lens = fb.prefix_lens_cpu
        extend_lens = fb.extend_lens_cpu
        n = len(rows)
        max_extend = max(extend_lens[b] for b in rows)
        max_len = max(seq_lens[b] for b in rows)
        rows_idx = torch.tensor(rows, dtype=torch.int64, device=device)
        ext = fb.extend_lens.index_select(0, rows_idx)  # [Be]
        pre = fb.prefix_lens.index_select(0, rows_idx)  # [Be]
        seq = pre + ext
        start = torch.tensor([starts[b] for b in rows], dtype=torch.int64, device=device)

        # Query grid [Be, Emax]: column i < extend_len is new token start + i; the rest pads.
        qi = torch.arange(max_extend, device=device)
        valid = qi[None, :] < ext[:, None]
        query_idx = torch.where(valid, start[:, None] + qi[None, :], 0).reshape(-1)
        valid = valid.reshape(-1)
        token_idx = query_idx[valid]

        if n == 1 and prefix_lens[rows[0]] == 0:
            # One fresh prompt: keys are exactly the new tokens; plain causal attention.
            return _ExtendGroup(query_idx, valid, token_idx, None, None, 1, max_extend, max_len)

        # Key grid [Be, Lmax]: columns [0, prefix_len) cached, [prefix_len, seq_len) new,
        # [seq_len, Lmax) padding -> slot 0.  New token i may see key j iff j <= prefix_len + i.
        kj = torch.arange(max_len, device=device)
        live = kj[None, :] < seq[:, None]  # [Be, Lmax]
        table_rows = fb.req_pool_indices.index_select(0, rows_idx)
        slots = fb.req_to_token[:, :max_len].index_select(0, table_rows).to(torch.int64)
        slots = torch.where(live, slots, 0).reshape(-1)
        causal = kj[None, None, :] <= (pre[:, None, None] + qi[None, :, None])  # [Be, Emax, Lmax]
        mask = (causal & live[:, None, :])[:, None]  # padded queries keep key 0: no empty rows
        return _ExtendGroup(query_idx, valid, token_idx, slots, mask, n, max_extend, max_len)

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
        k_pool, v_pool = fb.kv_pool.get_kv(layer.layer_id)
        num_tokens = q.shape[0]
        width = layer.num_heads * layer.head_dim
        if meta.single_group:
            if meta.decode is not None:
                return self._decode(q, k_pool, v_pool, layer, meta.decode)
            return self._extend(q, k, v, k_pool, v_pool, layer, meta.extend[0])
        out = q.new_empty((num_tokens, width))
        if meta.decode is not None:
            out[meta.decode.token_idx] = self._decode(q, k_pool, v_pool, layer, meta.decode)
        for group in meta.extend:
            out[group.token_idx] = self._extend(q, k, v, k_pool, v_pool, layer, group)
        return out

    def _decode(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        layer: AttentionLayerInfo,
        group: _DecodeGroup,
    ) -> torch.Tensor:
        kv_heads, dim = layer.num_kv_heads, layer.head_dim
        heads_per_kv = layer.num_heads // kv_heads
        bd = group.token_idx.shape[0]
        # Heads h = kv * G + g share KV head kv: fold g into the query axis.
        qd = q.index_select(0, group.token_idx).view(bd, kv_heads, heads_per_kv, dim)
        qd = qd.to(k_pool.dtype)
        out = q.new_empty((bd, kv_heads, heads_per_kv, dim), dtype=k_pool.dtype)
        if group.shared is not None:
            o = group.shared.forward(qd, k_pool, v_pool, layer)
            out.index_copy_(0, group.shared.rows, o.to(out.dtype))
        if not group.chunks:
            return out.view(bd, kv_heads * heads_per_kv * dim).to(q.dtype)
        biggest = max(c.slots.shape[0] for c in group.chunks)
        buf = self._buffers(biggest * kv_heads * dim, k_pool.dtype, k_pool.device)
        for c in group.chunks:
            n = c.rows.shape[0]
            numel = c.slots.shape[0] * kv_heads * dim
            kg = buf[0, :numel].view(-1, kv_heads, dim)
            vg = buf[1, :numel].view(-1, kv_heads, dim)
            torch.index_select(k_pool, 0, c.slots, out=kg)
            torch.index_select(v_pool, 0, c.slots, out=vg)
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
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        layer: AttentionLayerInfo,
        group: _ExtendGroup,
    ) -> torch.Tensor:
        heads, kv_heads, dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
        be, emax, lmax = group.num_rows, group.max_extend, group.max_len
        dtype = k_pool.dtype
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
        buf = self._buffers(numel, dtype, k_pool.device)
        kg = buf[0, :numel].view(-1, kv_heads, dim)
        vg = buf[1, :numel].view(-1, kv_heads, dim)
        torch.index_select(k_pool, 0, group.slots, out=kg)
        torch.index_select(v_pool, 0, group.slots, out=vg)
        ke = kg.view(be, lmax, kv_heads, dim).transpose(1, 2)
        ve = vg.view(be, lmax, kv_heads, dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            qe, ke, ve, attn_mask=group.mask, scale=layer.scaling, enable_gqa=heads != kv_heads
        )
        o = o.transpose(1, 2).reshape(be * emax, heads * dim)
        if be > 1 or emax != group.token_idx.shape[0]:
            o = o[group.valid]
        return o.to(q.dtype)
