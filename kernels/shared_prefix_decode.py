"""Cascade decode attention: a prefix that several requests share is read once per group.

Requests that hit the same radix-tree path have table rows that start with the same KV slots
(an agent's system prompt).  For decode row ``b`` of such a group, with the group's shared
length ``kv_start[b]`` (0 for a row outside every group):

  ``[0, kv_start)``        shared keys: read once per *group tile* by ``_shared_prefix_kernel``
  ``[kv_start, seq_len)``  the row's own keys (never empty: its newest token is its own), read
                           by the plain split kernel with ``HAS_KV_START``

Three launches, all sized from tensor shapes (nothing is read back from the device):

1. ``_decode_split_kernel`` (``decode_attention``), grid ``(B, KV, S)``: own keys, cut into S
   splits, partials into workspace splits ``[0, S)``.
2. ``_shared_prefix_kernel``, grid ``(tiles, KV, S)``: tile ``t`` is up to
   ``BLOCK_M // G`` members of one group, ``tile_members[tile_ptr[t] : tile_ptr[t + 1]]``
   (decode rows).  Their queries times the G query heads of KV head ``kv`` form the
   ``BLOCK_M`` rows of one tile (row ``i``: member ``i // G``, head ``kv * G + i % G``), so
   each shared K/V element is read once per tile, not once per request.  The keys
   ``[0, tile_len[t])`` (slots from table row ``tile_row[t]``) are cut into S splits with the
   same arithmetic; partials go to workspace splits ``[S, 2S)``.
3. ``_decode_reduce_kernel`` with ``HAS_SHARED``, grid ``(B, H)``: merges the non-empty
   splits of both ranges by log-sum-exp.  It finds the shared splits from ``kv_start``, so
   every member of tile ``t`` must have ``kv_start == tile_len[t]`` (``build_cascade_plan``
   guarantees it).

The plan is built on the host (``build_cascade_plan``, numpy) from the host copy of the
request-to-token table; the caller uploads its arrays with the rest of the step's metadata.

An 8-bit pool is read in place as in ``decode_attention``: tiles widened to the query's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from radixserve.kernels.common import (
    LOG2E,
    attend_table_keys,
    dot_in_fp32,
    dot_precision,
    kv_compute_dtype,
    kv_scales,
    last_dim_contiguous,
)
from radixserve.kernels.decode_attention import (
    MAX_SPLITS,
    _decode_reduce_kernel,
    _decode_split_kernel,
    alloc_decode_workspace,
    check_decode_layout,
    decode_config,
    split_len,
)
from radixserve.kernels.groups import find_shared_groups


@triton.jit
def _shared_prefix_kernel(
    Q, K_buf, V_buf, K_scale, V_scale, Req_to_token, Token_idx,
    Tile_row, Tile_len, Tile_ptr, Tile_members, Mid_o, Mid_lse,
    stride_qt, stride_qh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_ksc, stride_vsc,
    stride_tab,
    stride_mo_b, stride_mo_h, stride_mo_s,
    stride_ml_b, stride_ml_h,
    qk_scale, num_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):
    t = tl.program_id(0)
    kv = tl.program_id(1)
    split = tl.program_id(2)
    shared_len = tl.load(Tile_len + t).to(tl.int32)
    length = split_len(shared_len, num_splits, BLOCK_N)
    start = split * length
    end = tl.minimum(start + length, shared_len)
    if start < end:
        first = tl.load(Tile_ptr + t).to(tl.int32)
        # A plan from build_cascade_plan never exceeds the cap; min() keeps a bad one in bounds.
        count = tl.minimum(tl.load(Tile_ptr + t + 1).to(tl.int32) - first, BLOCK_M // GROUP)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        member = offs_m // GROUP
        m_mask = member < count
        d_mask = offs_d < HEAD_DIM
        b = tl.load(Tile_members + first + member, mask=m_mask, other=0).to(tl.int64)
        token = tl.load(Token_idx + b, mask=m_mask, other=0).to(tl.int64)
        heads = kv * GROUP + offs_m % GROUP
        # The compute dtype: a float pool's own, the query's with an 8-bit pool.
        dtype = K_buf.dtype.element_ty
        if dtype.primitive_bitwidth == 8:
            dtype = Q.dtype.element_ty
        q = tl.load(
            Q + token[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
            mask=m_mask[:, None] & d_mask[None, :], other=0.0,
        ).to(dtype)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        table = Req_to_token + tl.load(Tile_row + t).to(tl.int64) * stride_tab
        # Keys [start, end): whole blocks, then the tail (only the last split has one).
        acc, m_i, l_i = attend_table_keys(
            acc, m_i, l_i, q, table, start, end, K_buf, V_buf, K_scale, V_scale, kv,
            stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_ksc, stride_vsc,
            m_mask, offs_d, d_mask,
            qk_scale, BLOCK_N, PRECISION, DOT_IN_FP32,
        )

        # Shared partials live in workspace splits [S, 2S).
        slot_s = num_splits + split
        mid = Mid_o + b[:, None] * stride_mo_b + heads[:, None] * stride_mo_h + slot_s * stride_mo_s
        tl.store(mid + offs_d[None, :], acc / l_i[:, None], mask=m_mask[:, None] & d_mask[None, :])
        tl.store(Mid_lse + b * stride_ml_b + heads * stride_ml_h + slot_s, m_i + tl.log2(l_i),
                 mask=m_mask)


@dataclass(frozen=True)
class CascadeConfig:
    block_m: int  # rows of a group tile: members * G query heads
    block_n: int  # must equal decode_config's: the reduce uses one split arithmetic
    num_warps: int
    num_stages: int


def cascade_config(group_size: int, head_dim: int, dtype: torch.dtype) -> CascadeConfig:
    """Tile of the shared-prefix kernel; a tile holds ``block_m // group_size`` members."""
    block_n = decode_config(head_dim, dtype).block_n
    block_m = max(64, triton.next_power_of_2(group_size))
    num_stages = 1 if dtype == torch.float32 and head_dim > 64 else 2
    return CascadeConfig(block_m=block_m, block_n=block_n, num_warps=4, num_stages=num_stages)


@dataclass
class CascadeHostPlan:
    """Host arrays of one cascade launch (int32, numpy); decode row = index into the batch."""

    kv_start: np.ndarray  # [B] first own key of each decode row (its shared length, or 0)
    tile_row: np.ndarray  # [NT] table row whose columns [0, tile_len) hold the shared slots
    tile_len: np.ndarray  # [NT] shared keys of the tile's group
    tile_ptr: np.ndarray  # [NT + 1] members of tile t: tile_members[ptr[t] : ptr[t + 1]]
    tile_members: np.ndarray  # [sum of members] decode rows
    num_groups: int  # groups found (for stats and tests)


def build_cascade_plan(
    table: np.ndarray,
    rows: np.ndarray,
    seq_lens: np.ndarray,
    group_size: int,
    head_dim: int,
    dtype: torch.dtype,
    min_shared: int = 64,
) -> CascadeHostPlan | None:
    """Group the decode rows whose table rows start with the same slots; None when no group of
    two or more rows shares ``min_shared`` keys.

    ``table``: host request-to-token table [R, C]; ``rows``: table row of each decode row;
    ``seq_lens``: keys of each decode row, its new token included; ``group_size``: query heads
    per KV head; ``dtype``: the compute dtype (the KV pool's ``dtype``, also when it stores 8
    bits).
    """
    rows = np.asarray(rows, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    # Decode row b may share keys [0, seq_len - 1): its newest key stays its own.  Rows that
    # cannot share min_shared keys stay out, so they cannot cut a group's shared run short.
    groups = find_shared_groups(table, rows, seq_lens - 1, min_shared)
    if not groups:
        return None

    cap = cascade_config(group_size, head_dim, dtype).block_m // group_size
    kv_start = np.zeros(len(rows), dtype=np.int32)
    tiles: list[tuple[int, int, np.ndarray]] = []  # (table row, shared length, members)
    for members, shared in groups:
        kv_start[members] = shared
        # A group of more than `cap` members becomes several tiles of near-equal size.
        for part in np.array_split(members, -(-len(members) // cap)):
            tiles.append((int(rows[members[0]]), shared, part))
    tiles.sort(key=lambda tile: -tile[1])  # longest prefixes first: they take longest

    tile_ptr = np.zeros(len(tiles) + 1, dtype=np.int32)
    np.cumsum([len(part) for _, _, part in tiles], out=tile_ptr[1:])
    return CascadeHostPlan(
        kv_start=kv_start,
        tile_row=np.array([row for row, _, _ in tiles], dtype=np.int32),
        tile_len=np.array([shared for _, shared, _ in tiles], dtype=np.int32),
        tile_ptr=tile_ptr,
        tile_members=np.concatenate([part for _, _, part in tiles]).astype(np.int32),
        num_groups=len(groups),
    )


def alloc_cascade_workspace(
    batch: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial outputs ``[B, H, 2S, D]`` and log-sum-exps ``[B, H, 2S]`` (float32): splits
    ``[0, S)`` of the own keys, ``[S, 2S)`` of the shared prefix."""
    return alloc_decode_workspace(batch, num_heads, 2 * num_splits, head_dim, device)


def cascade_decode_attention(
    q: torch.Tensor,  # [T, H, D]; row token_idx[b] is decode row b's query
    k_buf: torch.Tensor,  # [num_slots, KV, D]
    v_buf: torch.Tensor,  # [num_slots, KV, D]
    out: torch.Tensor,  # [T, H * D]; rows token_idx[b] are written, the others untouched
    req_to_token: torch.Tensor,  # [R, max_context] int32 KV slots
    table_rows: torch.Tensor,  # [B] row of req_to_token of each decode row
    seq_lens: torch.Tensor,  # [B] keys of each decode row (>= 1), its new token included
    token_idx: torch.Tensor,  # [B] row of q / out of each decode row
    kv_start: torch.Tensor,  # [B] CascadeHostPlan.kv_start, uploaded
    tile_row: torch.Tensor,  # [NT] ... and the tile arrays, uploaded
    tile_len: torch.Tensor,  # [NT]
    tile_ptr: torch.Tensor,  # [NT + 1]
    tile_members: torch.Tensor,  # [sum of members]
    scale: float,
    num_splits: int,
    workspace: tuple[torch.Tensor, torch.Tensor],  # from alloc_cascade_workspace
    k_scale: torch.Tensor | None = None,  # [num_slots, KV] an int8 pool's scales
    v_scale: torch.Tensor | None = None,
) -> None:
    """Decode attention with shared prefixes read once per group tile; writes
    ``out[token_idx]`` like ``decode_attention``.  The plan must come from
    ``build_cascade_plan`` with this launch's G, head dim and compute dtype (``q``'s with an
    8-bit pool, else the pool's)."""
    batch = table_rows.shape[0]
    num_tiles = tile_row.shape[0]
    if batch == 0:
        return
    num_heads, head_dim, kv_heads = check_decode_layout(q, k_buf, v_buf, out, num_splits)
    plan_sizes = (kv_start.shape[0], tile_len.shape[0], tile_ptr.shape[0])
    if plan_sizes != (batch, num_tiles, num_tiles + 1):
        raise ValueError(f"cascade plan sizes (kv_start, tile_len, tile_ptr) {plan_sizes} do not "
                         f"fit {batch} decode rows and {num_tiles} tiles")
    mid_o, mid_lse = workspace
    if mid_o.shape[0] < batch or mid_o.shape[1] != num_heads or mid_o.shape[2] < 2 * num_splits:
        raise ValueError(f"cascade workspace {tuple(mid_o.shape)} too small "
                         f"(alloc_cascade_workspace gives [B, H, 2 * num_splits, D])")
    if mid_o.stride(-1) != 1 or mid_lse.stride(-1) != 1:
        raise ValueError("cascade workspace must be contiguous along its last dim")
    k_scale, v_scale, stride_ksc, stride_vsc = kv_scales(k_buf, v_buf, k_scale, v_scale)
    dtype = kv_compute_dtype(q, k_buf)
    q = last_dim_contiguous(q)
    group = num_heads // kv_heads
    dcfg = decode_config(head_dim, dtype)
    ccfg = cascade_config(group, head_dim, dtype)
    block_d = triton.next_power_of_2(head_dim)
    qk_scale = scale * LOG2E
    precision, in_fp32 = dot_precision(dtype), dot_in_fp32(dtype)
    workspace_strides = (mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
                         mid_lse.stride(0), mid_lse.stride(1))

    # 1. Own keys [kv_start, seq_len) -> splits [0, S).
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, k_buf, v_buf, k_scale, v_scale, req_to_token, table_rows, seq_lens, token_idx,
        kv_start, mid_o, mid_lse,
        q.stride(0), q.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1), stride_ksc, stride_vsc,
        req_to_token.stride(0),
        *workspace_strides,
        qk_scale, num_splits,
        GROUP=group, HEAD_DIM=head_dim,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=dcfg.block_n,
        PRECISION=precision, DOT_IN_FP32=in_fp32, HAS_KV_START=True,
        num_warps=dcfg.num_warps, num_stages=dcfg.num_stages,
    )
    # 2. Shared keys [0, tile_len) of every group tile -> its members' splits [S, 2S).
    if num_tiles:
        _shared_prefix_kernel[(num_tiles, kv_heads, num_splits)](
            q, k_buf, v_buf, k_scale, v_scale, req_to_token, token_idx,
            tile_row, tile_len, tile_ptr, tile_members, mid_o, mid_lse,
            q.stride(0), q.stride(1),
            k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
            stride_ksc, stride_vsc,
            req_to_token.stride(0),
            *workspace_strides,
            qk_scale, num_splits,
            GROUP=group, HEAD_DIM=head_dim,
            BLOCK_M=ccfg.block_m, BLOCK_D=block_d, BLOCK_N=ccfg.block_n,
            PRECISION=precision, DOT_IN_FP32=in_fp32,
            num_warps=ccfg.num_warps, num_stages=ccfg.num_stages,
        )
    # 3. Merge both ranges into out[token_idx].
    block_s = triton.next_power_of_2(2 * num_splits)
    _decode_reduce_kernel[(batch, num_heads)](
        mid_o, mid_lse, out, seq_lens, token_idx, kv_start,
        *workspace_strides,
        out.stride(0),
        num_splits,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=dcfg.block_n,
        BLOCK_S=block_s, HAS_SHARED=True,
        num_warps=(1 if block_d <= 64 else 2) * (2 if block_s > MAX_SPLITS else 1),
    )
