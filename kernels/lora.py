"""Many LoRA adapters in one batch (gathered LoRA, as Punica's BGMV / S-LoRA apply them).

Every token ``t`` of a batch names the adapter it uses by its slot ``s = token_slots[t]`` in
the stacked adapter weights (``-1``: no adapter), and the layer's output row gains

    out[t] += b[s] @ (a[s] @ x[t])

with ``a`` [S, R, K] (A of every slot, rank padded to R with zero rows) and ``b`` [S, N, R]
(B with the LoRA scaling folded in, zero columns past the rank).  Two launches:

1. ``_lora_shrink_kernel``, grid ``(T, R blocks)``: ``mid[t, r] = sum_k a[s, r, k] * x[t, k]``
   into a float32 buffer ``mid`` [T, R].
2. ``_lora_expand_kernel``, grid ``(T, N blocks)``: ``out[t, n] += sum_r b[s, n, r] * mid[t, r]``,
   summed in float32 and added to ``out``'s element in float32, rounded once to its dtype.

One program serves one token (a per-token gather: decode batches are small), so each product
is a row-vector times a tile, summed with ``tl.sum`` rather than ``tl.dot`` (whose operands
need 16 rows).  A token with slot -1 runs neither body: its ``mid`` row stays unwritten and its
``out`` row untouched.  Slots must be below S; they are not checked, which would read the
device tensor back.

``lora_apply_reference`` is the torch oracle the tests hold the kernels to.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The shrink's tile is [BLOCK_R, BLOCK_K], the expand's [BLOCK_N, BLOCK_R]; ranks up to
# MAX_BLOCK_R take one R block (the expand then sums R in one step).
MAX_BLOCK_R = 64
BLOCK_K = 64
BLOCK_N = 128


@triton.jit
def _lora_shrink_kernel(
    X, A, Slots, Mid,
    stride_xt, stride_xk,
    stride_as, stride_ar, stride_ak,
    stride_mt,
    rank, in_dim,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    r_block = tl.program_id(1)
    slot = tl.load(Slots + t).to(tl.int64)
    if slot >= 0:
        offs_r = r_block * BLOCK_R + tl.arange(0, BLOCK_R)
        offs_k = tl.arange(0, BLOCK_K)
        r_mask = offs_r < rank
        a_rows = A + slot * stride_as + offs_r[:, None] * stride_ar
        x_row = X + t * stride_xt
        acc = tl.zeros([BLOCK_R], tl.float32)
        for k0 in range(0, in_dim, BLOCK_K):
            # Columns [k0, k0 + BLOCK_K) ∩ [0, K) of x[t] and of rows offs_r of a[slot].
            k = k0 + offs_k
            k_mask = k < in_dim
            xv = tl.load(x_row + k * stride_xk, mask=k_mask, other=0.0).to(tl.float32)
            av = tl.load(a_rows + k[None, :] * stride_ak,
                         mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(av * xv[None, :], 1)
        tl.store(Mid + t * stride_mt + offs_r, acc, mask=r_mask)


@triton.jit
def _lora_expand_kernel(
    Mid, B, Slots, Out,
    stride_mt,
    stride_bs, stride_bn, stride_br,
    stride_ot, stride_on,
    rank, out_dim,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    n_block = tl.program_id(1)
    slot = tl.load(Slots + t).to(tl.int64)
    if slot >= 0:
        offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, BLOCK_R)
        n_mask = offs_n < out_dim
        b_rows = B + slot * stride_bs + offs_n[:, None] * stride_bn
        mid_row = Mid + t * stride_mt
        acc = tl.zeros([BLOCK_N], tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            # Ranks [r0, r0 + BLOCK_R) ∩ [0, R) of mid[t] and of rows offs_n of b[slot].
            r = r0 + offs_r
            r_mask = r < rank
            mv = tl.load(mid_row + r, mask=r_mask, other=0.0)
            bv = tl.load(b_rows + r[None, :] * stride_br,
                         mask=n_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(bv * mv[None, :], 1)
        out_ptr = Out + t * stride_ot + offs_n * stride_on
        prev = tl.load(out_ptr, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr, (prev + acc).to(Out.dtype.element_ty), mask=n_mask)


def check_lora_shapes(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      token_slots: torch.Tensor) -> tuple[int, int, int, int]:
    """``(T, N, K, R)`` of a LoRA launch; ValueError for shapes that do not fit together."""
    if out.dim() != 2 or x.dim() != 2 or a.dim() != 3 or b.dim() != 3 or token_slots.dim() != 1:
        raise ValueError(
            "lora_apply needs out [T, N], x [T, K], a [S, R, K], b [S, N, R], token_slots [T];"
            f" got out {tuple(out.shape)}, x {tuple(x.shape)}, a {tuple(a.shape)},"
            f" b {tuple(b.shape)}, token_slots {tuple(token_slots.shape)}"
        )
    num_tokens, out_dim = out.shape
    in_dim = x.shape[1]
    num_slots, rank = a.shape[0], a.shape[1]
    if x.shape[0] != num_tokens or token_slots.shape[0] != num_tokens:
        raise ValueError(
            f"out has {num_tokens} rows but x has {x.shape[0]} and token_slots "
            f"{token_slots.shape[0]}"
        )
    if a.shape[2] != in_dim:
        raise ValueError(f"a {tuple(a.shape)} must have x's K = {in_dim} as its last dim")
    if tuple(b.shape) != (num_slots, out_dim, rank):
        raise ValueError(
            f"b must be [S, N, R] = {(num_slots, out_dim, rank)} (S, R from a, N from out), "
            f"got {tuple(b.shape)}"
        )
    if token_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"token_slots must be int32 or int64, got {token_slots.dtype}")
    return num_tokens, out_dim, in_dim, rank


def lora_apply(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               token_slots: torch.Tensor) -> None:
    """out[t] += b[s] @ (a[s] @ x[t]) for every token t whose slot s = token_slots[t] >= 0
    (in place); rows with slot -1 are left as they are.
    out: [T, N] (model dtype), x: [T, K], a: [S, R, K] (the adapters' A, stacked by slot, rank
    padded with zero rows), b: [S, N, R] (B with the scaling folded in, zero columns past the
    rank), token_slots: [T] int64 (or int32)."""
    num_tokens, out_dim, in_dim, rank = check_lora_shapes(out, x, a, b, token_slots)
    if num_tokens == 0 or rank == 0:
        return
    block_r = min(triton.next_power_of_2(rank), MAX_BLOCK_R)
    # Rows of tokens with slot -1 are never written (nor read).
    mid = torch.empty((num_tokens, rank), dtype=torch.float32, device=x.device)
    _lora_shrink_kernel[(num_tokens, triton.cdiv(rank, block_r))](
        x, a, token_slots, mid,
        x.stride(0), x.stride(1),
        a.stride(0), a.stride(1), a.stride(2),
        mid.stride(0),
        rank, in_dim,
        BLOCK_R=block_r, BLOCK_K=BLOCK_K,
        num_warps=4,
    )
    _lora_expand_kernel[(num_tokens, triton.cdiv(out_dim, BLOCK_N))](
        mid, b, token_slots, out,
        mid.stride(0),
        b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), out.stride(1),
        rank, out_dim,
        BLOCK_N=BLOCK_N, BLOCK_R=block_r,
        num_warps=4,
    )


def lora_apply_reference(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         token_slots: torch.Tensor) -> None:
    """What :func:`lora_apply` computes, in torch: per adapter slot in use, its tokens' rows
    through ``a[s]`` then ``b[s]`` in float32, added to ``out`` in float32 and rounded once to
    its dtype (as the kernel does).  Reads the slots back: an oracle, not for the step loop."""
    num_tokens = check_lora_shapes(out, x, a, b, token_slots)[0]
    if num_tokens == 0:
        return
    acc = out.float()  # exact for the half types, so untouched rows copy back bit for bit
    for slot in torch.unique(token_slots).tolist():
        if slot < 0:
            continue
        rows = torch.nonzero(token_slots == slot).flatten()
        xs = x.index_select(0, rows).float()
        delta = (xs @ a[slot].float().T) @ b[slot].float().T
        acc.index_add_(0, rows, delta)
    out.copy_(acc)
