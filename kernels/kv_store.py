"""Write this step's K/V rows into their KV pool slots.

A float pool gets the rows cast to its dtype.  An 8-bit pool (kv_pool.py) gets them encoded as
``kv_pool.quantize_kv``, its reference, does: int8 rows with a float16 scale per (token, KV
head), fp8 values saturated at the format's largest finite value.  The pool's element type
picks the path when the kernel is compiled, so a float pool's kernel carries none of the
8-bit code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from radixserve.kernels.common import kv_scales, last_dim_contiguous


@triton.jit
def round_half_even(x):
    """``x`` (float32, |x| < 2**22) rounded to an integer, ties to even, as torch.round: adding
    1.5 * 2**23 leaves no fraction bits, so the float add itself rounds (to nearest even).
    (libdevice's rint would do on a GPU, but Triton's interpreter has none.)"""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def round_to_fp8(x, FP8: tl.constexpr):
    """``x`` (float32) saturated at FP8's largest finite value and rounded to the nearest FP8
    value, ties to even, still in float32.  The result is exactly representable, so the cast
    that follows is exact everywhere.  The cast alone rounds this way on a GPU, but Triton
    3.9's interpreter truncates when it narrows to fp8 and flushes fp8 subnormals, which would
    leave the interpreter's pools (and the tests) with other bits than quantize_kv's."""
    if FP8 == tl.float8e4nv:  # e4m3fn: 3 mantissa bits, normals from 2**-6, at most 448
        top: tl.constexpr = 448.0
        mantissa: tl.constexpr = 3
        min_exp: tl.constexpr = -6
    else:  # e5m2: 2 mantissa bits, normals from 2**-14, at most 57344
        top: tl.constexpr = 57344.0
        mantissa: tl.constexpr = 2
        min_exp: tl.constexpr = -14
    x = tl.minimum(tl.maximum(x, -top), top)
    bits = x.to(tl.int32, bitcast=True)
    # The binade of |x| (subnormals share the smallest normal one's step), and its step
    # 2**(exp - mantissa) and inverse built as float32 bit patterns: exact powers of two.
    exp = tl.maximum(((bits >> 23) & 0xFF) - 127, min_exp) - mantissa
    step = ((exp + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - exp) << 23).to(tl.float32, bitcast=True)
    y = round_half_even(tl.abs(x) * inv_step) * step
    return tl.where(bits < 0, -y, y)  # the sign bit, so -0.0 stays -0.0 as torch casts it


@triton.jit
def store_8bit(src, dst, scale_dst, mask, h_mask):
    """One token's rows ``src`` [BLOCK_H, BLOCK_D] into an 8-bit pool at ``dst``; ``mask``
    keeps real heads and dims, ``h_mask`` real heads (``scale_dst`` [BLOCK_H]: their int8
    scales)."""
    x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    if dst.dtype.element_ty == tl.int8:
        # scale = amax / 127 as stored (float16); values round(x / that scale), ties to even,
        # in [-127, 127]; a zero row gets scale 0 and values 0.  div_rn: IEEE division, as
        # torch's (Triton's `/` may compile to an approximate one).
        scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), 127.0).to(tl.float16)
        tl.store(scale_dst, scale, mask=h_mask)
        divisor = tl.where(scale > 0, scale.to(tl.float32), 1.0)
        q = round_half_even(tl.math.div_rn(x, divisor[:, None]))
        tl.store(dst, tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int8), mask=mask)
    else:
        tl.store(dst, round_to_fp8(x, dst.dtype.element_ty).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_kernel(
    K, V, K_buf, V_buf, K_scale, V_scale, Loc,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_ksc, stride_vsc,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per new token t: pool[Loc[t], :, :] = k[t] / v[t] (all KV heads).
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Loc + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k_src = K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    v_src = V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    k_dst = K_buf + slot * stride_kbs + offs_h[:, None] * stride_kbh + offs_d[None, :]
    v_dst = V_buf + slot * stride_vbs + offs_h[:, None] * stride_vbh + offs_d[None, :]
    if K_buf.dtype.element_ty.primitive_bitwidth == 8:
        h_mask = offs_h < NUM_KV_HEADS
        store_8bit(k_src, k_dst, K_scale + slot * stride_ksc + offs_h, mask, h_mask)
        store_8bit(v_src, v_dst, V_scale + slot * stride_vsc + offs_h, mask, h_mask)
    else:
        k = tl.load(k_src, mask=mask)
        v = tl.load(v_src, mask=mask)
        tl.store(k_dst, k.to(K_buf.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(V_buf.dtype.element_ty), mask=mask)


def store_kv(
    k_buf: torch.Tensor,  # [num_slots, KV, D] one layer's K pool
    v_buf: torch.Tensor,  # [num_slots, KV, D]
    loc: torch.Tensor,  # [T] int64 slot of each new token
    k: torch.Tensor,  # [T, KV, D]
    v: torch.Tensor,  # [T, KV, D]
    k_scale: torch.Tensor | None = None,  # [num_slots, KV] an int8 pool's scales (written)
    v_scale: torch.Tensor | None = None,
) -> None:
    """``k_buf[loc] = k``, ``v_buf[loc] = v`` in the pool's format (see the top of this file)."""
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k_buf.stride(-1) != 1 or v_buf.stride(-1) != 1:
        raise ValueError("KV pool buffers must be contiguous along head_dim")
    k_scale, v_scale, stride_ksc, stride_vsc = kv_scales(k_buf, v_buf, k_scale, v_scale)
    k, v = last_dim_contiguous(k), last_dim_contiguous(v)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_buf, v_buf, k_scale, v_scale, loc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1), stride_ksc, stride_vsc,
        NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4 if kv_heads * head_dim >= 1024 else 1,
    )
