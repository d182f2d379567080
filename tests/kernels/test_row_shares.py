"""The split of a quantized one-row matmul's output rows over the threads (cpu_ext/row_shares.h,
for linear_ops.cpp's int4 and int8 kernels): each thread owns a share of the rows and takes what
is left of the others' shares.  Whatever the number of threads (more than the cores, so that one
is held up and its share taken), each output is computed whole by one thread: the same bits as
one thread, and as the weight's rows multiplied a few at a time.  kq_linear's split:
tests/kernels/test_gguf_kquants.py."""

from __future__ import annotations

import pytest
import torch

from radixserve import cpu_ext
from radixserve.quantization import BLOCK4, Int4Weight, Int8Weight

OPS = cpu_ext.load()
N, K = 1203, 4 * BLOCK4  # many chunks, shares of unequal length, a tile tail
SLICE = 60  # rows a slice: fewer than one thread takes (16 tiles of 4)


def _weights() -> dict[str, tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(5)
    base = torch.randn((N, K), generator=gen) * 0.05
    w4 = Int4Weight.quantize(base)
    w8 = Int8Weight.quantize(base, BLOCK4, asymmetric=False)
    w8o = Int8Weight.quantize(base, BLOCK4, asymmetric=True)
    return {"int4": (w4.qs, w4.d, w4.m), "int8": (w8.q, w8.scale, torch.empty(0)),
            "int8_offset": (w8o.q, w8o.scale, w8o.offset)}


KERNELS = [("int4_linear", "int4", False), ("int4_linear_q8", "int4", True),
           ("int4_linear_q16", "int4", True), ("int8_linear", "int8", False),
           ("int8_linear", "int8_offset", False), ("int8_linear_q8", "int8", True),
           ("int8_linear_q8", "int8_offset", True)]


@pytest.mark.parametrize(("kernel", "weight", "vnni"), KERNELS,
                         ids=[f"{k}-{w}" for k, w, _ in KERNELS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_threads_split_changes_no_bit(kernel: str, weight: str, vnni: bool,
                                          dtype: torch.dtype) -> None:
    if vnni and not OPS.q8_supported():
        pytest.skip("the CPU kernels were built without AVX-512 VNNI")
    w = _weights()[weight]
    op = getattr(OPS, kernel)
    x = torch.randn((3, K), generator=torch.Generator().manual_seed(6)).to(dtype)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3, 5):
            torch.set_num_threads(threads)
            outs += [op(x[:rows], *w) for _ in range(3) for rows in (1, 3)]
    finally:
        torch.set_num_threads(before)
    ones, threes = outs[0::2], outs[1::2]
    assert not torch.isnan(threes[0]).any()
    assert all(torch.equal(o, ones[0]) for o in ones) and torch.equal(ones[0], threes[0][:1])
    assert all(torch.equal(o, threes[0]) for o in threes)
    # the rows of the weight a slice at a time (each on one thread): the same outputs
    sliced = torch.cat([op(x, *(t[a:a + SLICE] if t.numel() else t for t in w))
                        for a in range(0, N, SLICE)], dim=1)
    assert torch.equal(sliced, threes[0])
    assert threes[0].dtype == dtype and threes[0].shape == (3, N)
