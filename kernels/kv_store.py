"""Write this step's K/V rows into their KV pool slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from radixserve.kernels.common import last_dim_contiguous


@triton.jit
def _store_kv_kernel(
    K, V, K_buf, V_buf, Loc,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per new token t: pool[Loc[t], :, :] = k[t] / v[t] (all KV heads).
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Loc + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = K_buf + slot * stride_kbs + offs_h[:, None] * stride_kbh + offs_d[None, :]
    v_dst = V_buf + slot * stride_vbs + offs_h[:, None] * stride_vbh + offs_d[None, :]
    tl.store(k_dst, k.to(K_buf.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(V_buf.dtype.element_ty), mask=mask)


def store_kv(
    k_buf: torch.Tensor,  # [num_slots, KV, D] one layer's K pool
    v_buf: torch.Tensor,  # [num_slots, KV, D]
    loc: torch.Tensor,  # [T] int64 slot of each new token
    k: torch.Tensor,  # [T, KV, D]
    v: torch.Tensor,  # [T, KV, D]
) -> None:
    """``k_buf[loc] = k``, ``v_buf[loc] = v``, cast to the pool's dtype."""
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k_buf.stride(-1) != 1 or v_buf.stride(-1) != 1:
        raise ValueError("KV pool buffers must be contiguous along head_dim")
    k, v = last_dim_contiguous(k), last_dim_contiguous(v)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_buf, v_buf, loc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4 if kv_heads * head_dim >= 1024 else 1,
    )
