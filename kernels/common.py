"""Pieces shared by the attention kernels: the online-softmax step, reading a (possibly 8-bit)
KV pool, and launch helpers."""

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


def kv_compute_dtype(q: torch.Tensor, k_buf: torch.Tensor) -> torch.dtype:
    """What attention over ``k_buf`` computes in: a float pool's own dtype (the query is cast
    to it, as always), the query's for an 8-bit pool (its tiles are widened to it)."""
    return q.dtype if k_buf.element_size() == 1 else k_buf.dtype


def kv_scales(k_buf: torch.Tensor, v_buf: torch.Tensor, k_scale: torch.Tensor | None,
              v_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """``(k_scale, v_scale, k slot stride, v slot stride)`` to launch with.  An int8 pool needs
    its scales ``[num_slots, KV]`` (kv_pool.py); the kernels read no scale for other pools, so
    the buffers themselves stand in."""
    if k_buf.dtype != torch.int8:
        return k_buf, v_buf, 0, 0
    if k_scale is None or v_scale is None:
        raise ValueError("an int8 KV pool needs k_scale and v_scale")
    for buf, scale in ((k_buf, k_scale), (v_buf, v_scale)):
        if scale.shape != buf.shape[:2] or scale.stride(1) != 1:
            raise ValueError(
                f"KV scales must be [num_slots, KV heads] = {tuple(buf.shape[:2])} with "
                f"unit stride along the heads, got {tuple(scale.shape)}"
            )
    return k_scale, v_scale, k_scale.stride(0), v_scale.stride(0)


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
def load_kv(Buf, Scale, slot, kv, offs_d, mask, stride_s, stride_h, stride_scale,
            DTYPE: tl.constexpr):
    """A tile of KV head ``kv`` at pool slots ``slot`` in the compute dtype ``DTYPE``: ``slot``
    [1, N] with ``offs_d`` [D, 1] gives keys transposed [D, N], ``slot`` [N, 1] with ``offs_d``
    [1, D] values [N, D].  The pool's element type decides at compile time: a float pool's tile
    is returned as stored (no 8-bit code is compiled into it), an int8 pool's element
    times the scale of its (slot, head) (``Scale`` [num_slots, KV], row stride
    ``stride_scale``), an fp8 pool's element widened (its scale is 1).  Masked keys must still
    name a valid slot: the callers load them as slot 0."""
    x = tl.load(Buf + slot * stride_s + kv * stride_h + offs_d, mask=mask, other=0.0)
    if Buf.dtype.element_ty == tl.int8:
        scale = tl.load(Scale + slot * stride_scale + kv)
        x = (x.to(tl.float32) * scale.to(tl.float32)).to(DTYPE)
    elif Buf.dtype.element_ty.is_fp8():
        x = x.to(tl.float32).to(DTYPE)
    return x


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
def attend_table_keys(acc, m_i, l_i, q, table, start, end, K_buf, V_buf, K_scale, V_scale, kv,
                      stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_ksc, stride_vsc,
                      row_mask, offs_d, d_mask,
                      qk_scale, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                      DOT_IN_FP32: tl.constexpr):
    """:func:`attend_block` over keys ``[start, end)`` of one table row (``table`` points at
    it; column ``j`` holds key ``j``'s pool slot), KV head ``kv``: whole blocks of BLOCK_N keys
    unmasked (``row_mask`` [M] only keeps padded query rows' loads in bounds), then the tail
    masked by key.  Tiles are read by :func:`load_kv` in ``q``'s dtype."""
    offs_n = tl.arange(0, BLOCK_N)
    full_end = start + ((end - start) // BLOCK_N) * BLOCK_N
    for n0 in range(start, full_end, BLOCK_N):
        slot = tl.load(table + n0 + offs_n).to(tl.int64)
        k_t = load_kv(K_buf, K_scale, slot[None, :], kv, offs_d[:, None], d_mask[:, None],
                      stride_kbs, stride_kbh, stride_ksc, q.dtype)
        v = load_kv(V_buf, V_scale, slot[:, None], kv, offs_d[None, :], d_mask[None, :],
                    stride_vbs, stride_vbh, stride_vsc, q.dtype)
        acc, m_i, l_i = attend_block(acc, m_i, l_i, q, k_t, v, row_mask[:, None], qk_scale,
                                     False, PRECISION, DOT_IN_FP32)
    if full_end < end:
        n = full_end + offs_n
        n_mask = n < end
        slot = tl.load(table + n, mask=n_mask, other=0).to(tl.int64)
        k_t = load_kv(K_buf, K_scale, slot[None, :], kv, offs_d[:, None],
                      n_mask[None, :] & d_mask[:, None], stride_kbs, stride_kbh, stride_ksc,
                      q.dtype)
        v = load_kv(V_buf, V_scale, slot[:, None], kv, offs_d[None, :],
                    n_mask[:, None] & d_mask[None, :], stride_vbs, stride_vbh, stride_vsc,
                    q.dtype)
        acc, m_i, l_i = attend_block(acc, m_i, l_i, q, k_t, v, n_mask[None, :], qk_scale,
                                     True, PRECISION, DOT_IN_FP32)
    return acc, m_i, l_i
