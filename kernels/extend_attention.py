"""Extend attention: new tokens over their cached prefix (paged) plus causal among themselves.

Request ``r`` of the launch has ``prefix_len`` cached keys, found through its table row
(key ``j < prefix_len`` lives in pool slot ``req_to_token[row, j]``), and ``extend_len`` new
tokens, rows ``[token_start, token_start + extend_len)`` of this step's q/k/v.  New token ``i``
attends to every cached key and to new keys ``[0, i]``.

Grid ``(work items, H)``: a work item is one block of BLOCK_M new tokens of one request,
``(request, m_start)``, listed by the host (``extend_work_items``) so that requests of very
different lengths share one launch without empty programs.  Each program runs the online
softmax over

  1. cached keys ``[0, prefix_len)`` in blocks of BLOCK_N, slots read from the table (only the
     last block is masked), then
  2. new keys ``[0, min(m_start + BLOCK_M, extend_len))`` read straight from this step's k/v:
     blocks ``[0, m_start)`` are fully visible, blocks from ``m_start`` on get the causal mask.

Each query row sees key 0 of one of the two phases in its first block, so no row's running
max stays ``-inf``.

An 8-bit pool (kv_pool.py) is read in place: its prefix tiles are widened to the query's dtype
as they are loaded (``common.load_kv``), this step's new keys are cast to it, and the attention
computes in it.  A float pool's kernel carries none of the 8-bit code (the pool's element
type is known when the kernel is compiled).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl
from radixserve.kernels.common import (
    LOG2E,
    attend_block,
    attend_table_keys,
    dot_in_fp32,
    dot_precision,
    kv_compute_dtype,
    kv_scales,
    last_dim_contiguous,
)


@triton.jit
def _extend_kernel(
    Q, K, V, K_buf, V_buf, K_scale, V_scale, Out, Req_to_token,
    Item_req, Item_m, Req_table_row, Req_prefix, Req_extend, Req_start,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_ksc, stride_vsc,
    stride_ot, stride_tab,
    qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):
    item = tl.program_id(0)
    head = tl.program_id(1)
    kv = head // GROUP
    r = tl.load(Item_req + item)
    m_start = tl.load(Item_m + item).to(tl.int32)
    row = tl.load(Req_table_row + r).to(tl.int64)
    prefix_len = tl.load(Req_prefix + r).to(tl.int32)
    extend_len = tl.load(Req_extend + r).to(tl.int32)
    token_start = tl.load(Req_start + r).to(tl.int64)

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < extend_len
    d_mask = offs_d < HEAD_DIM
    # The compute dtype: a float pool's own, the query's with an 8-bit pool.
    dtype = K_buf.dtype.element_ty
    if dtype.primitive_bitwidth == 8:
        dtype = Q.dtype.element_ty
    q = tl.load(
        Q + (token_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :], other=0.0,
    ).to(dtype)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Phase 1: cached prefix, table columns [0, prefix_len).
    table = Req_to_token + row * stride_tab
    acc, m_i, l_i = attend_table_keys(
        acc, m_i, l_i, q, table, 0, prefix_len, K_buf, V_buf, K_scale, V_scale, kv,
        stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_ksc, stride_vsc,
        m_mask, offs_d, d_mask,
        qk_scale, BLOCK_N, PRECISION, DOT_IN_FP32,
    )

    # Phase 2: this step's new keys.  [0, m_start) lies wholly below the diagonal.
    k_new = K + token_start * stride_kt + kv * stride_kh
    v_new = V + token_start * stride_vt + kv * stride_vh
    for n0 in range(0, m_start, BLOCK_N):
        n = n0 + offs_n
        k_t = tl.load(k_new + n[None, :] * stride_kt + offs_d[:, None],
                      mask=d_mask[:, None], other=0.0).to(dtype)
        v = tl.load(v_new + n[:, None] * stride_vt + offs_d[None, :],
                    mask=d_mask[None, :], other=0.0).to(dtype)
        acc, m_i, l_i = attend_block(acc, m_i, l_i, q, k_t, v, m_mask[:, None], qk_scale,
                                     False, PRECISION, DOT_IN_FP32)
    causal_end = tl.minimum(m_start + BLOCK_M, extend_len)
    for n0 in range(m_start, causal_end, BLOCK_N):
        n = n0 + offs_n
        n_mask = n < extend_len
        k_t = tl.load(k_new + n[None, :] * stride_kt + offs_d[:, None],
                      mask=n_mask[None, :] & d_mask[:, None], other=0.0).to(dtype)
        v = tl.load(v_new + n[:, None] * stride_vt + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0).to(dtype)
        visible = (n[None, :] <= offs_m[:, None]) & n_mask[None, :]
        acc, m_i, l_i = attend_block(acc, m_i, l_i, q, k_t, v, visible, qk_scale,
                                     True, PRECISION, DOT_IN_FP32)

    out = acc / l_i[:, None]
    tl.store(
        Out + (token_start + offs_m)[:, None] * stride_ot + head * HEAD_DIM + offs_d[None, :],
        out.to(Out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :],
    )


@dataclass(frozen=True)
class ExtendConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def extend_config(head_dim: int, dtype: torch.dtype) -> ExtendConfig:
    """Tile sizes per head dim / compute dtype (the pool's ``dtype``, also for an 8-bit pool);
    BLOCK_M is a multiple of BLOCK_N (see the kernel)."""
    if dtype == torch.float32 or head_dim > 128:
        return ExtendConfig(block_m=64, block_n=32, num_warps=4, num_stages=1)
    if head_dim > 64:
        return ExtendConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)
    return ExtendConfig(block_m=128, block_n=64, num_warps=4, num_stages=2)


@dataclass
class ExtendPlan:
    """Per-request arrays and the work-item list of one extend launch (all on the device)."""

    table_rows: torch.Tensor  # [R] row of req_to_token
    prefix_lens: torch.Tensor  # [R] cached keys
    extend_lens: torch.Tensor  # [R] new tokens (>= 1)
    token_starts: torch.Tensor  # [R] first row of the request's new tokens in q/k/v/out
    item_req: torch.Tensor  # [I] request of each work item (index into the arrays above)
    item_m: torch.Tensor  # [I] first new token of the work item
    config: ExtendConfig


def extend_work_items(
    prefix_lens: list[int], extend_lens: list[int], block_m: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(request, m_start)`` of every BLOCK_M block of new tokens, most work first.

    A block's work is about ``prefix_len + m_start + block_m`` keys; launching the biggest
    blocks first keeps the tail of the grid short.
    """
    req, start, work = [], [], []
    for r, (p, e) in enumerate(zip(prefix_lens, extend_lens, strict=True)):
        for m in range(0, e, block_m):
            req.append(r)
            start.append(m)
            work.append(p + m + block_m)
    order = np.argsort(-np.asarray(work, dtype=np.int64), kind="stable")
    return np.asarray(req, dtype=np.int64)[order], np.asarray(start, dtype=np.int64)[order]


def build_extend_plan(
    table_rows: Any,
    prefix_lens: list[int],
    extend_lens: list[int],
    token_starts: list[int],
    head_dim: int,
    dtype: torch.dtype,
    config: ExtendConfig | None = None,
    upload: Any = None,
) -> ExtendPlan:
    """Host lists -> device arrays: staged in ``upload`` (a ``radixserve.transfer.Upload``:
    the batch's one copy), or without one copied now in one host-to-device copy."""
    cfg = config or extend_config(head_dim, dtype)
    if cfg.block_m % cfg.block_n:
        raise ValueError("block_m must be a multiple of block_n")
    item_req, item_m = extend_work_items(prefix_lens, extend_lens, cfg.block_m)
    arrays = [
        np.asarray(a, dtype=np.int64)
        for a in (prefix_lens, extend_lens, token_starts, item_req, item_m)
    ]
    if upload is not None:
        staged = [upload.add(a) for a in arrays]
    else:
        sizes = np.cumsum([len(a) for a in arrays])[:-1]
        dev = torch.from_numpy(np.concatenate(arrays)).to(table_rows.device)
        staged = list(torch.tensor_split(dev, sizes.tolist()))
    return ExtendPlan(table_rows, *staged, config=cfg)


def extend_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KV, D] this step's keys
    v: torch.Tensor,  # [T, KV, D]
    k_buf: torch.Tensor,  # [num_slots, KV, D] cached keys
    v_buf: torch.Tensor,  # [num_slots, KV, D]
    out: torch.Tensor,  # [T, H * D]; the plan's token rows are written, the others untouched
    req_to_token: torch.Tensor,  # [R, max_context] int32
    plan: ExtendPlan,
    scale: float,
    k_scale: torch.Tensor | None = None,  # [num_slots, KV] an int8 pool's scales
    v_scale: torch.Tensor | None = None,
) -> None:
    """Attention of every new token of the plan's requests; writes their rows of ``out``.  An
    8-bit pool computes in ``q``'s dtype (see the top of this file)."""
    num_items = plan.item_req.shape[0]
    if num_items == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_buf.shape[1]
    if num_heads % kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {kv_heads} KV heads")
    if out.stride(-1) != 1 or k_buf.stride(-1) != 1 or v_buf.stride(-1) != 1:
        raise ValueError("out and the KV pool must be contiguous along head_dim")
    k_scale, v_scale, stride_ksc, stride_vsc = kv_scales(k_buf, v_buf, k_scale, v_scale)
    dtype = kv_compute_dtype(q, k_buf)
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    cfg = plan.config
    _extend_kernel[(num_items, num_heads)](
        q, k, v, k_buf, v_buf, k_scale, v_scale, out, req_to_token,
        plan.item_req, plan.item_m, plan.table_rows, plan.prefix_lens, plan.extend_lens,
        plan.token_starts,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1), stride_ksc, stride_vsc,
        out.stride(0), req_to_token.stride(0),
        scale * LOG2E,
        GROUP=num_heads // kv_heads, HEAD_DIM=head_dim,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=triton.next_power_of_2(head_dim),
        PRECISION=dot_precision(dtype), DOT_IN_FP32=dot_in_fp32(dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
