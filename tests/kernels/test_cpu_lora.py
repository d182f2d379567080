"""The CPU kernel that applies each row's LoRA adapter (radixserve/cpu_ext/lora_ops.cpp,
``lora_apply_``) against the same sums in float64 torch."""

from __future__ import annotations

import pytest
import torch

from radixserve import cpu_ext

OPS = cpu_ext.load()

S, R, N = 3, 16, 3 * 64 + 5  # N: three blocks of the expand and a tail shorter than a vector
RANKS = (8, 16, 16)  # per slot: rank 8 is padded to R with zero rows of A and columns of B
# (K, R, ranks): K = 72 has a tail past the last whole vector of 16 floats (AVX-512), K = 75 and
# R = 12 tails for vectors of 8 (AVX2) too.
SHAPES = [(72, R, RANKS), (576, R, RANKS), (75, 12, (4, 12, 12))]
# Each row's slot per T; rows of slot -1 must be left as they are, bit for bit.
SLOTS = {1: [2], 3: [0, -1, 2], 8: [1, -1, 0, 1, 2, -1, 1, 0]}


def _adapters(k: int, r: int, ranks: tuple[int, ...], dtype: torch.dtype,
              gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A [S, r, K] and B [S, N, r], slot s's rows of A and columns of B past ranks[s] zero."""
    a = torch.zeros(S, r, k, dtype=torch.float64)
    b = torch.zeros(S, N, r, dtype=torch.float64)
    for s, rank in enumerate(ranks):
        a[s, :rank] = torch.randn((rank, k), generator=gen, dtype=torch.float64) / k**0.5
        b[s, :, :rank] = torch.randn((N, rank), generator=gen, dtype=torch.float64) / rank**0.5
    return a.to(dtype), b.to(dtype)


def _reference(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               slots: list[int]) -> torch.Tensor:
    """out + b[s] @ (a[s] @ x[t]) per row of a slot, in float64 on the same (rounded) inputs."""
    ref = out.double().clone()
    for t, s in enumerate(slots):
        if s >= 0:
            ref[t] += b[s].double() @ (a[s].double() @ x[t].double())
    return ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k", "r", "ranks"), SHAPES)
@pytest.mark.parametrize("t", sorted(SLOTS))
def test_lora_apply_matches_float64(t: int, k: int, r: int, ranks: tuple[int, ...],
                                    dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(t * 1000 + k)
    a, b = _adapters(k, r, ranks, dtype, gen)
    x = torch.randn((t, k + 40), generator=gen).to(dtype)[:, :k]  # rows of a wider tensor
    assert x.stride(0) == k + 40
    out = torch.randn((t, N), generator=gen).to(dtype)
    before = out.clone()
    slots = SLOTS[t]
    OPS.lora_apply_(out, x, a, b, torch.tensor(slots, dtype=torch.int64))
    ref = _reference(before, x, a, b, slots)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    else:  # one rounding of out + delta to nearest: within half a bf16 ulp (2^-8 relative)
        torch.testing.assert_close(out.double(), ref, rtol=2**-8, atol=1e-6)
    for row, s in enumerate(slots):
        if s < 0:
            assert torch.equal(out[row].view(torch.int16), before[row].view(torch.int16))
        else:
            assert not torch.equal(out[row], before[row])


def test_bfloat16_ties_round_to_even_as_torch_adds() -> None:
    """out + 2^-8 with out in [1, 2) is halfway between two bf16 values: torch's add_ (and the
    kernel) rounds it to the one with an even last bit, up from 1 + 2^-7, down from 1."""
    k = 72
    a = torch.zeros(S, R, k, dtype=torch.bfloat16)
    b = torch.zeros(S, N, R, dtype=torch.bfloat16)
    a[1, 0, 0] = b[1, :, 0] = 1
    x = torch.zeros(2, k, dtype=torch.bfloat16)
    x[:, 0] = 2**-8
    pair = torch.tensor([1.0, 1 + 2**-7], dtype=torch.bfloat16)
    out = pair.repeat(2, (N + 1) // 2)[:, :N].contiguous()
    expected = out.clone().add_(torch.full_like(out, 2**-8))
    assert not torch.equal(expected, out) and torch.equal(expected[:, ::2], out[:, ::2])
    OPS.lora_apply_(out, x, a, b, torch.tensor([1, 1]))
    assert torch.equal(out, expected)


def test_out_may_be_x_itself() -> None:
    """Every row's A @ x is formed before out is written, so x can be updated in place."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn((4, N), generator=gen)
    a = torch.randn((S, R, N), generator=gen) / N**0.5
    b = torch.randn((S, N, R), generator=gen) / R**0.5
    slots = [2, 0, -1, 2]
    ref = _reference(x, x, a, b, slots)
    OPS.lora_apply_(x, x, a, b, torch.tensor(slots))
    torch.testing.assert_close(x.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [S, -2])
def test_a_slot_outside_the_stack_is_an_error(bad: int) -> None:
    a = torch.zeros(S, R, 72)
    b = torch.zeros(S, N, R)
    out = torch.zeros(2, N)
    with pytest.raises(RuntimeError, match="slot"):
        OPS.lora_apply_(out, torch.zeros(2, 72), a, b, torch.tensor([0, bad]))
    assert torch.equal(out, torch.zeros(2, N))  # checked before anything is written


def test_mismatched_shapes_and_dtypes_are_errors() -> None:
    a, b = torch.zeros(S, R, 72), torch.zeros(S, N, R)
    out, x, slots = torch.zeros(2, N), torch.zeros(2, 72), torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="a must be"):
        OPS.lora_apply_(out, torch.zeros(2, 64), a, b, slots)
    with pytest.raises(RuntimeError, match="b must be"):
        OPS.lora_apply_(out, x, a, torch.zeros(S, N, R + 1), slots)
    with pytest.raises(RuntimeError, match="all float32 or all bfloat16"):
        OPS.lora_apply_(out, x, a.bfloat16(), b, slots)
    with pytest.raises(RuntimeError, match="token_slots"):
        OPS.lora_apply_(out, x, a, b, slots.int())
