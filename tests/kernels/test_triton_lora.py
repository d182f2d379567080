"""The gathered-LoRA Triton kernels (kernels/lora.py) against their torch reference.

On a CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET);
on a CUDA machine the same tests run compiled.  Every case draws random inputs (never zeros):
two adapters of ranks 8 and 12 stacked at R = 16 (zero rows of A, zero columns of B past each
rank), K = 96 and N = 3 * 64 + 5 (neither a multiple of the kernels' blocks), and an ``out``
full of random values, so rows with slot -1 must come back bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from radixserve.kernels.lora import lora_apply, lora_apply_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Both sides sum in float32 and round once to out's dtype; bfloat16 may land one ulp apart.
TOL = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (1e-2, 1e-2)}
RANKS = (8, 12)
MAX_RANK = 16
IN_DIM = 96
OUT_DIM = 3 * 64 + 5


def make_adapters(dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` [S, R, K] and ``b`` [S, N, R] for the adapters of RANKS, zero past each rank."""
    a = torch.zeros(len(RANKS), MAX_RANK, IN_DIM)
    b = torch.zeros(len(RANKS), OUT_DIM, MAX_RANK)
    for s, rank in enumerate(RANKS):
        a[s, :rank] = torch.randn(rank, IN_DIM, generator=gen) * 0.1
        b[s, :, :rank] = torch.randn(OUT_DIM, rank, generator=gen) * 0.1
    return a.to(DEVICE, dtype), b.to(DEVICE, dtype)


def make_inputs(num_tokens: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """``out`` [T, N], ``x`` [T, K] (a column slice of a wider tensor: the kernels go by
    strides), ``a``, ``b``."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.randn(num_tokens, OUT_DIM, generator=gen).to(DEVICE, dtype)
    wide = torch.randn(num_tokens, IN_DIM + 8, generator=gen).to(DEVICE, dtype)
    a, b = make_adapters(dtype, gen)
    return out, wide[:, :IN_DIM], a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", [
    [0, -1, 1, 1, -1, 0, 1],  # mixed, T = 7
    [1] * 7,  # one adapter for every row
    [0],  # T = 1
    [-1, -1, -1],  # no adapter anywhere: nothing changes
], ids=["mixed", "one-slot", "single-token", "all-minus-one"])
def test_lora_apply_matches_reference(slots: list[int], dtype: torch.dtype) -> None:
    out, x, a, b = make_inputs(len(slots), dtype, seed=len(slots) + sum(slots))
    token_slots = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    before = out.clone()
    expected = out.clone()
    lora_apply_reference(expected, x, a, b, token_slots)
    lora_apply(out, x, a, b, token_slots)

    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)
    untouched = token_slots < 0
    assert torch.equal(out[untouched], before[untouched])
    # Rows with an adapter really moved (the deltas are far above the tolerance).
    if (~untouched).any():
        assert (out[~untouched].float() - before[~untouched].float()).abs().max() > 0.1


def test_reference_is_per_token_formula() -> None:
    """The oracle itself: out[t] += b[s] @ (a[s] @ x[t]) row by row, in float64."""
    slots = [1, -1, 0, 1]
    out, x, a, b = make_inputs(len(slots), torch.float32, seed=3)
    expected = out.double().clone()
    for t, s in enumerate(slots):
        if s >= 0:
            expected[t] += b[s].double() @ (a[s].double() @ x[t].double())
    lora_apply_reference(out, x, a, b, torch.tensor(slots, device=DEVICE))
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_lora_apply_int32_slots_and_empty_batch() -> None:
    out, x, a, b = make_inputs(3, torch.float32, seed=5)
    slots = torch.tensor([1, 0, -1], dtype=torch.int32, device=DEVICE)
    expected = out.clone()
    lora_apply_reference(expected, x, a, b, slots.long())
    lora_apply(out, x, a, b, slots)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)

    empty_out, empty_x = out[:0], x[:0]
    lora_apply(empty_out, empty_x, a, b, slots[:0])  # T == 0: returns without a launch
    assert empty_out.shape == (0, OUT_DIM)


@pytest.mark.parametrize("bad, match", [
    ("x_rows", "rows"),
    ("a_in_dim", "last dim"),
    ("b_out_dim", r"b must be \[S, N, R\]"),
    ("b_rank", r"b must be \[S, N, R\]"),
    ("slots_dtype", "int32 or int64"),
    ("x_1d", "lora_apply needs"),
])
def test_lora_apply_rejects_mismatched_shapes(bad: str, match: str) -> None:
    out, x, a, b = make_inputs(4, torch.float32, seed=7)
    slots = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    if bad == "x_rows":
        x = x[:3]
    elif bad == "a_in_dim":
        a = a[:, :, :-1]
    elif bad == "b_out_dim":
        b = b[:, :-1]
    elif bad == "b_rank":
        b = b[:, :, :-1]
    elif bad == "slots_dtype":
        slots = slots.float()
    elif bad == "x_1d":
        x = x[0]
    with pytest.raises(ValueError, match=match):
        lora_apply(out, x, a, b, slots)
    with pytest.raises(ValueError, match=match):
        lora_apply_reference(out, x, a, b, slots)
