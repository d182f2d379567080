"""Many-row matmuls of quantized weights (weights.py): a weight larger than the shared buffer is
dequantized and multiplied in runs of rows, giving what the whole float weight gives, and the
buffer never grows past ``SCRATCH_ELEMENTS``; every format's row ranges dequantize to exactly
the rows of its whole float weight, across a merged weight's parts too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.gguf_quantize import quantize
from radixserve.quantization import KERNEL_MAX_ROWS, QuantizedWeight, weights
from radixserve.quantization.int4 import Int4Weight
from radixserve.quantization.int8 import Int8Weight
from radixserve.quantization.kquant import BLOCK_BYTES, QK_K, KQuantWeight

K = 2 * QK_K


def kquant(n: int, kind: str, seed: int) -> KQuantWeight:
    w = np.random.default_rng(seed).standard_normal((n, K)).astype(np.float32) * 0.05
    blocks = torch.from_numpy(quantize(w, kind).reshape(n, K // QK_K, BLOCK_BYTES[kind]))
    return KQuantWeight(blocks, kind, torch.float32)


def formats(n: int) -> dict[str, QuantizedWeight]:
    w = torch.randn((n, K), generator=torch.Generator().manual_seed(n))
    return {"int4": Int4Weight.quantize(w), "int8": Int8Weight.quantize(w),
            "int8-asymmetric": Int8Weight.quantize(w, asymmetric=True),
            "Q4_K+Q6_K": KQuantWeight.cat([kquant(n - 5, "Q4_K", 1), kquant(5, "Q6_K", 2)])}


@pytest.mark.parametrize("name", ["int4", "int8", "int8-asymmetric", "Q4_K+Q6_K"])
def test_row_ranges_dequantize_to_the_whole_weights_rows(name: str) -> None:
    weight = formats(23)[name]
    whole = weight.dequantized(torch.float32)
    for start, stop in [(0, 23), (0, 7), (7, 18), (16, 23), (18, 19)]:  # 18: the parts' border
        out = torch.empty((stop - start, K))
        weight.dequantize_into(out, start)
        assert torch.equal(out, whole[start:stop]), (start, stop)


@pytest.mark.parametrize("name", ["int4", "int8", "Q4_K+Q6_K"])
def test_a_weight_larger_than_the_buffer_goes_in_runs_of_rows(name: str, monkeypatch) -> None:
    monkeypatch.setattr(weights, "SCRATCH_ELEMENTS", 5 * K)  # runs of 5 rows: 23 = 4 x 5 + 3
    monkeypatch.setattr(weights, "_SCRATCH", {})
    weight = formats(23)[name]
    x = torch.randn((KERNEL_MAX_ROWS + 5, K), generator=torch.Generator().manual_seed(1))
    want = x.double() @ weight.dequantized(torch.float32).double().T
    torch.testing.assert_close(weight.matmul(x).double(), want, rtol=1e-5, atol=1e-5)
    assert weights._SCRATCH[torch.float32].numel() == 5 * K
