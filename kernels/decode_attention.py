"""Decode attention over paged KV: one query token per request, split over the KV length.

Flash-decoding in two launches:

1. ``_decode_split_kernel``, grid ``(B, KV heads, S splits)``.  Program ``(b, kv, s)`` serves
   all ``G = H / KV`` query heads that share KV head ``kv`` (their queries form the rows of one
   ``[G, D] x [D, N]`` dot, padded to 16 rows for the tensor cores), so each K/V element is read
   once per request, not once per query head.  Request ``b``'s keys ``[0, seq_len)`` are cut
   into S splits of ``split_len`` keys (a multiple of BLOCK_N); split ``s`` covers
   ``[s * split_len, min((s + 1) * split_len, seq_len))`` and is read through the table row:
   key ``j`` lives in pool slot ``req_to_token[row, j]``, so any page size works.  It writes its
   normalised partial output and its log-sum-exp (log2 units) to the workspace.  Splits that
   start at or past ``seq_len`` write nothing.
2. ``_decode_reduce_kernel``, grid ``(B, H)``: merges the non-empty splits of each head,
   ``out = sum_s 2^(lse_s - m) * o_s / sum_s 2^(lse_s - m)``, into the output row of the token.

Both kernels also serve the cascade path (``shared_prefix_decode``) through constexpr
switches that compile away here: with ``HAS_KV_START`` the split kernel covers only a
request's own keys ``[kv_start, seq_len)``, and with ``HAS_SHARED`` the reduce also merges the
shared-prefix partials kept in workspace splits ``[S, 2S)``.

The new token's own K/V must already be in the pool (``kv_store`` runs first): the table row's
column ``seq_len - 1`` points at it.

An 8-bit pool (kv_pool.py: int8 with a scale per slot and KV head, or fp8) is read in place:
each K/V tile is widened to the query's dtype as it is loaded (``common.load_kv``), and the
attention computes in that dtype.  A float pool's kernel carries none of the 8-bit code: the
switches are the pool's element type, known when the kernel is compiled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from radixserve.kernels.common import (
    LOG2E,
    attend_block,
    dot_in_fp32,
    dot_precision,
    kv_compute_dtype,
    kv_scales,
    last_dim_contiguous,
    load_kv,
)

MAX_SPLITS = 64


@triton.jit
def split_len(num_keys, num_splits, BLOCK_N: tl.constexpr):
    """Keys per split when ``num_keys`` keys are cut into ``num_splits`` splits: a multiple of
    BLOCK_N (0 when there are no keys).  Split ``s`` covers ``[s * len, (s + 1) * len)`` of
    them, so splits ``[0, cdiv(num_keys, len))`` are the non-empty ones."""
    return tl.cdiv(tl.cdiv(num_keys, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def _decode_split_kernel(
    Q, K_buf, V_buf, K_scale, V_scale, Req_to_token, Table_rows, Seq_lens, Token_idx, Kv_start,
    Mid_o, Mid_lse,
    stride_qt, stride_qh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_ksc, stride_vsc,
    stride_tab,
    stride_mo_b, stride_mo_h, stride_mo_s,
    stride_ml_b, stride_ml_h,
    qk_scale, num_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr, HAS_KV_START: tl.constexpr,
):
    b = tl.program_id(0)
    kv = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(Seq_lens + b).to(tl.int32)
    # The splits cut the request's own keys [kv_begin, seq_len); kv_begin is 0 without
    # HAS_KV_START (Kv_start is then not read).
    if HAS_KV_START:
        kv_begin = tl.load(Kv_start + b).to(tl.int32)
    else:
        kv_begin = 0
    length = split_len(seq_len - kv_begin, num_splits, BLOCK_N)
    start = kv_begin + split * length
    end = tl.minimum(start + length, seq_len)
    if start < end:
        row = tl.load(Table_rows + b).to(tl.int64)
        token = tl.load(Token_idx + b).to(tl.int64)
        offs_g = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        g_mask = offs_g < GROUP
        d_mask = offs_d < HEAD_DIM
        heads = kv * GROUP + offs_g
        # The compute dtype: a float pool's own, the query's with an 8-bit pool.
        dtype = K_buf.dtype.element_ty
        if dtype.primitive_bitwidth == 8:
            dtype = Q.dtype.element_ty
        q = tl.load(
            Q + token * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
            mask=g_mask[:, None] & d_mask[None, :], other=0.0,
        ).to(dtype)

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        table = Req_to_token + row * stride_tab
        for n0 in range(start, end, BLOCK_N):
            # Keys [n0, n0 + BLOCK_N) ∩ [start, end); slots from the table row.
            n = n0 + offs_n
            n_mask = n < end
            slot = tl.load(table + n, mask=n_mask, other=0).to(tl.int64)
            k_t = load_kv(K_buf, K_scale, slot[None, :], kv, offs_d[:, None],
                          n_mask[None, :] & d_mask[:, None], stride_kbs, stride_kbh, stride_ksc,
                          dtype)
            v = load_kv(V_buf, V_scale, slot[:, None], kv, offs_d[None, :],
                        n_mask[:, None] & d_mask[None, :], stride_vbs, stride_vbh, stride_vsc,
                        dtype)
            acc, m_i, l_i = attend_block(
                acc, m_i, l_i, q, k_t, v, n_mask[None, :], qk_scale, True, PRECISION, DOT_IN_FP32
            )

        mid = Mid_o + b * stride_mo_b + heads[:, None] * stride_mo_h + split * stride_mo_s
        tl.store(mid + offs_d[None, :], acc / l_i[:, None],
                 mask=g_mask[:, None] & d_mask[None, :])
        tl.store(Mid_lse + b * stride_ml_b + heads * stride_ml_h + split, m_i + tl.log2(l_i),
                 mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    Mid_o, Mid_lse, Out, Seq_lens, Token_idx, Kv_start,
    stride_mo_b, stride_mo_h, stride_mo_s,
    stride_ml_b, stride_ml_h,
    stride_ot,
    num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr, HAS_SHARED: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(Seq_lens + b).to(tl.int32)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    # Same split arithmetic as the first stage(s): only non-empty splits are read.
    if HAS_SHARED:
        # Splits [0, S): own keys [kv_start, seq_len) (never empty); splits [S, 2S): the
        # shared keys [0, kv_start), none when kv_start is 0.  max() keeps the divisor > 0.
        kv_start = tl.load(Kv_start + b).to(tl.int32)
        own = seq_len - kv_start
        own_active = tl.cdiv(own, split_len(own, num_splits, BLOCK_N))
        shared_active = tl.cdiv(
            kv_start, tl.maximum(split_len(kv_start, num_splits, BLOCK_N), BLOCK_N)
        )
        s_mask = (offs_s < own_active) | (
            (offs_s >= num_splits) & (offs_s < num_splits + shared_active)
        )
    else:
        s_mask = offs_s < tl.cdiv(seq_len, split_len(seq_len, num_splits, BLOCK_N))
    lse = tl.load(Mid_lse + b * stride_ml_b + h * stride_ml_h + offs_s, mask=s_mask,
                  other=float("-inf"))
    o = tl.load(
        Mid_o + b * stride_mo_b + h * stride_mo_h + offs_s[:, None] * stride_mo_s
        + offs_d[None, :],
        mask=s_mask[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0,
    )
    w = tl.exp2(lse - tl.max(lse, 0))  # 0 on empty splits
    merged = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    token = tl.load(Token_idx + b).to(tl.int64)
    tl.store(Out + token * stride_ot + h * HEAD_DIM + offs_d, merged.to(Out.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int
    num_warps: int
    num_stages: int


def decode_config(head_dim: int, dtype: torch.dtype) -> DecodeConfig:
    """Block sizes per head dim / compute dtype (the pool's ``dtype``, also for an 8-bit pool:
    its tiles are widened to it before they meet the query)."""
    wide = dtype == torch.float32 or head_dim > 128
    return DecodeConfig(block_n=32 if wide else 64, num_warps=4, num_stages=2)


def decode_num_splits(batch: int, kv_heads: int, max_seq_len: int, sms: int, block_n: int) -> int:
    """Splits per request so that ~8 programs per SM are in flight, never more splits than
    blocks of keys in the longest request."""
    want = triton.cdiv(8 * sms, max(1, batch * kv_heads))
    return max(1, min(want, triton.cdiv(max_seq_len, block_n), MAX_SPLITS))


def alloc_decode_workspace(
    batch: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial outputs ``[B, H, S, D]`` and log-sum-exps ``[B, H, S]`` (float32)."""
    mid_o = torch.empty(
        (batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=device
    )
    mid_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=device)
    return mid_o, mid_lse


def check_decode_layout(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, out: torch.Tensor, num_splits: int
) -> tuple[int, int, int]:
    """``(query heads, head dim, KV heads)`` of a decode launch; ValueError for a layout the
    decode kernels cannot run."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_buf.shape[1]
    if num_heads % kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {kv_heads} KV heads")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    if out.stride(-1) != 1 or k_buf.stride(-1) != 1 or v_buf.stride(-1) != 1:
        raise ValueError("out and the KV pool must be contiguous along head_dim")
    return num_heads, head_dim, kv_heads


def decode_attention(
    q: torch.Tensor,  # [T, H, D]; row token_idx[b] is request b's query
    k_buf: torch.Tensor,  # [num_slots, KV, D]
    v_buf: torch.Tensor,  # [num_slots, KV, D]
    out: torch.Tensor,  # [T, H * D]; rows token_idx[b] are written, the others untouched
    req_to_token: torch.Tensor,  # [R, max_context] int32 KV slots
    table_rows: torch.Tensor,  # [B] row of req_to_token of each request
    seq_lens: torch.Tensor,  # [B] keys of each request (>= 1), its new token included
    token_idx: torch.Tensor,  # [B] row of q / out of each request
    scale: float,
    num_splits: int,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: DecodeConfig | None = None,
    k_scale: torch.Tensor | None = None,  # [num_slots, KV] an int8 pool's scales
    v_scale: torch.Tensor | None = None,
) -> None:
    """Attention of one new token per request over its KV; writes ``out[token_idx]``.  An
    8-bit pool computes in ``q``'s dtype (see the top of this file)."""
    batch = table_rows.shape[0]
    if batch == 0:
        return
    num_heads, head_dim, kv_heads = check_decode_layout(q, k_buf, v_buf, out, num_splits)
    k_scale, v_scale, stride_ksc, stride_vsc = kv_scales(k_buf, v_buf, k_scale, v_scale)
    dtype = kv_compute_dtype(q, k_buf)
    cfg = config or decode_config(head_dim, dtype)
    group = num_heads // kv_heads
    q = last_dim_contiguous(q)
    if workspace is None:
        workspace = alloc_decode_workspace(batch, num_heads, num_splits, head_dim, q.device)
    mid_o, mid_lse = workspace
    if mid_o.shape[0] < batch or mid_o.shape[1] != num_heads or mid_o.shape[2] < num_splits:
        raise ValueError(f"decode workspace {tuple(mid_o.shape)} too small")
    if mid_o.stride(-1) != 1 or mid_lse.stride(-1) != 1:
        raise ValueError("decode workspace must be contiguous along its last dim")
    block_d = triton.next_power_of_2(head_dim)

    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, k_buf, v_buf, k_scale, v_scale, req_to_token, table_rows, seq_lens, token_idx,
        seq_lens, mid_o, mid_lse,
        q.stride(0), q.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1), stride_ksc, stride_vsc,
        req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        scale * LOG2E, num_splits,
        GROUP=group, HEAD_DIM=head_dim,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=cfg.block_n,
        PRECISION=dot_precision(dtype), DOT_IN_FP32=dot_in_fp32(dtype),
        HAS_KV_START=False,  # seq_lens above stands in for the unread Kv_start
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    _decode_reduce_kernel[(batch, num_heads)](
        mid_o, mid_lse, out, seq_lens, token_idx, seq_lens,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0),
        num_splits,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=cfg.block_n,
        BLOCK_S=triton.next_power_of_2(num_splits), HAS_SHARED=False,
        num_warps=1 if block_d <= 64 else 2,
    )
