"""Layers split over the tensor-parallel ranks.

A column-parallel projection is :class:`radixserve.model.layers.MergedLinear` with ``parts``
(each rank keeps some output rows).  The layers here are the ones whose result needs the other
ranks: a row-parallel projection (each rank holds some input columns; the partial products
are summed) and the embedding split over the vocabulary.  With one rank they are the plain
layers, and compute exactly what ``nn.Linear`` / ``nn.Embedding`` compute.

Each module names the checkpoint slice it holds in ``tp_slices``: parameter name ->
``(dim, start, end, full)``; the weight loader checks that the checkpoint tensor has ``full``
entries along ``dim`` and copies the slice ``[start, end)`` of it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.distributed.group import TensorParallel
from radixserve.quantization import QuantizedWeight, linear


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with the input features ``[start, end)`` on this rank: each rank
    multiplies its columns, one all-reduce sums the parts, then the bias is added once."""

    quantizable = True  # radixserve/quantization/ may replace its weight by a quantized one

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel,
                 part: tuple[int, int]) -> None:
        super().__init__()
        self.tp = tp
        start, end = part
        self.weight = nn.Parameter(torch.empty(out_features, end - start))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.tp_slices = {} if tp.size == 1 else {"weight": (1, start, end, in_features)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return linear(x, self.weight, self.bias)
        y = self.tp.all_reduce(linear(x, self.weight))
        return y if self.bias is None else y.add_(self.bias)


class VocabParallelEmbedding(nn.Module):
    """The embedding table's rows ``[start, end)`` of the vocabulary on this rank: a token
    outside them contributes zeros, and one all-reduce puts every token's row together."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.start, self.end = tp.split(vocab_size, "vocabulary rows")
        self.weight = nn.Parameter(torch.empty(self.end - self.start, hidden_size))
        self.tp_slices = {} if tp.size == 1 else {"weight": (0, self.start, self.end, vocab_size)}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, QuantizedWeight):  # a tied LM head's table, quantized
            return self.weight.embedding(input_ids)
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])  # elementwise: no read-back
        rows = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.tp.all_reduce(rows * inside.unsqueeze(1).to(rows.dtype))


class ParallelLMHead(nn.Module):
    """The LM head's vocabulary rows ``[start, end)`` on this rank (untied models)."""

    quantizable = True

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        start, end = tp.split(vocab_size, "vocabulary rows")
        self.weight = nn.Parameter(torch.empty(end - start, hidden_size))
        self.tp_slices = {} if tp.size == 1 else {"weight": (0, start, end, vocab_size)}
