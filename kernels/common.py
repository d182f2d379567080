"""Pieces shared by the attention kernels: the online-softmax step and launch helpers."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# exp(x) == exp2(x * LOG2E): the kernels fold LOG2E into the softmax scale and use exp2.
LOG2E = 1.4426950408889634


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs must not be rounded to tf32 (tests hold float32 to 1e-5)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Triton 3.9's interpreter multiplies bfloat16 dot operands as their raw uint16 bits, so
    under the interpreter bfloat16 dots run on float32 copies of the (bf16-valued) operands;
    compiled kernels use the bfloat16 tensor-core dot."""
    return dtype == torch.bfloat16 and interpreting()


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The kernels index heads and tokens by stride but assume unit stride along head_dim."""
    return x if x.stride(-1) == 1 else x.contiguous()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (1 under the interpreter)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def mma(a, b, PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """``tl.dot(a, b)`` with a float32 accumulator (see ``dot_in_fp32``)."""
    if DOT_IN_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def attend_block(acc, m_i, l_i, q, k_t, v, mask, qk_scale,
                 APPLY_MASK: tl.constexpr, PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """One step of the online softmax over a block of keys.

    ``q`` [M, D], ``k_t`` [D, N] (keys transposed), ``v`` [N, D]; ``mask`` [M, N] (or
    broadcastable) is applied only when ``APPLY_MASK``.  ``acc`` [M, D] (float32) holds the
    un-normalised output, ``m_i`` [M] the running max of the scaled scores in log2 units,
    ``l_i`` [M] the running sum of ``exp2(score - m_i)``.  Every row must see at least one
    unmasked key in the first block it processes, so ``m_i`` never stays ``-inf``.
    """
    qk = mma(q, k_t, PRECISION, DOT_IN_FP32) * qk_scale
    if APPLY_MASK:
        qk = tl.where(mask, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, PRECISION, DOT_IN_FP32)
    return acc, m_new, l_i


@triton.jit
def attend_table_keys(acc, m_i, l_i, q, table, start, end, K_buf, V_buf, kv,
                      stride_kbs, stride_kbh, stride_vbs, stride_vbh, row_mask, offs_d, d_mask,
                      qk_scale, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                      DOT_IN_FP32: tl.constexpr):
    """:func:`attend_block` over keys ``[start, end)`` of one table row (``table`` points at
    it; column ``j`` holds key ``j``'s pool slot), KV head ``kv``: whole blocks of BLOCK_N keys
    unmasked (``row_mask`` [M] only keeps padded query rows' loads in bounds), then the tail
    masked by key."""
    offs_n = tl.arange(0, BLOCK_N)
    full_end = start + ((end - start) // BLOCK_N) * BLOCK_N
    for n0 in range(start, full_end, BLOCK_N):
        slot = tl.load(table + n0 + offs_n).to(tl.int64)
        k_t = tl.load(K_buf + slot[None, :] * stride_kbs + kv * stride_kbh + offs_d[:, None],
                      mask=d_mask[:, None], other=0.0)
        v = tl.load(V_buf + slot[:, None] * stride_vbs + kv * stride_vbh + offs_d[None, :],
                    mask=d_mask[None, :], other=0.0)
        acc, m_i, l_i = attend_block(acc, m_i, l_i, q, k_t, v, row_mask[:, None], qk_scale,
                                     False, PRECISION, DOT_IN_FP32)
    if full_end < end:
        n = full_end + offs_n
        n_mask = n < end
        slot = tl.load(table + n, mask=n_mask, other=0).to(tl.int64)
        k_t = tl.load(K_buf + slot[None, :] * stride_kbs + kv * stride_kbh + offs_d[:, None],
                      mask=n_mask[None, :] & d_mask[:, None], other=0.0)
        v = tl.load(V_buf + slot[:, None] * stride_vbs + kv * stride_vbh + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        acc, m_i, l_i = attend_block(acc, m_i, l_i, q, k_t, v, n_mask[None, :], qk_scale,
                                     True, PRECISION, DOT_IN_FP32)
    return acc, m_i, l_i
