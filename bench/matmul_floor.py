"""Matmul floor of an offline run: its matmul FLOPs at this machine's measured matmul rate.

The shapes are the model's own: every 2-D weight of the decoder layers (fused q/k/v, o_proj,
fused gate/up, down; whatever the architecture builds) and the LM head, read from a copy of
the model built on the meta device (no weights loaded).  The rate is timed here, with
``F.linear`` in the run's dtype on random data, as many distinct weights as the model has,
with torch's thread count set to the scheduler's, at ``DECODE_ROWS`` and ``PREFILL_ROWS``
input rows (best of a few repeats).

FLOPs count what the scheduler computed (its counters, ``SchedulerStats``): every prefill and
decode token goes through the layer matmuls (2 x in x out each), and only the LM-head rows,
one per request per forward step, through the head.  The floor charges the prefill tokens at
the layers' rate at ``PREFILL_ROWS`` rows, the decode tokens and the head rows at the rates at
``DECODE_ROWS``.  ``wall / floor`` says how far the run is from spending its time in matmuls
alone at the speed this machine gives them.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

DECODE_ROWS = 64
PREFILL_ROWS = 512
MIN_TIMED_S = 0.5  # per row count: repeat until this much time was measured
MIN_REPEATS = 3


@dataclass(frozen=True)
class MatmulShapes:
    """Matmul weights ``(in_features, out_features)`` of all decoder layers, with how often
    each occurs, and the LM head's."""

    layers: dict[tuple[int, int], int]
    head: tuple[int, int]

    @property
    def layer_params(self) -> int:
        """Weights one token meets in the decoder layers (2 FLOPs each)."""
        return sum(n * k * m for (k, m), n in self.layers.items())

    @property
    def head_params(self) -> int:
        return self.head[0] * self.head[1]


def model_matmul_shapes(model_path: str | None) -> MatmulShapes:
    """Shapes of the model in ``model_path`` (None: the default model), as the engine builds it."""
    import torch
    from transformers import AutoConfig

    from radixserve.model import get_model_class
    from radixserve.model.config import ModelConfig
    from radixserve.model.loader import resolve_model_path

    folder = resolve_model_path(model_path)
    hf_config = AutoConfig.from_pretrained(folder)
    config = ModelConfig.from_hf(hf_config, torch.float32, folder)
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, hf_config)
    layers = Counter(
        (p.shape[1], p.shape[0]) for p in model.model.layers.parameters() if p.dim() == 2
    )
    vocab, hidden = model.lm_head_weight.shape
    return MatmulShapes(dict(layers), (hidden, vocab))


def _seconds(fn: Any) -> float:
    """Best time of ``fn()`` over at least ``MIN_REPEATS`` runs and ``MIN_TIMED_S`` seconds."""
    fn()  # warm-up: first-call allocation and kernel choice
    best, spent, runs = float("inf"), 0.0, 0
    while runs < MIN_REPEATS or spent < MIN_TIMED_S:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent, runs = min(best, dt), spent + dt, runs + 1
    return best


def _rate(rows: int, weights: dict[tuple[int, int], int], dtype: Any) -> float:
    """FLOP/s of ``rows`` input rows through ``count`` distinct weights of each ``(in, out)``,
    one after the other as a forward meets them (so the weights stream from memory as the
    model's do, instead of staying in cache)."""
    import torch
    import torch.nn.functional as F

    inputs = {k: torch.randn(rows, k).to(dtype) for k, _ in weights}
    mats = [torch.randn(m, k).to(dtype) for (k, m), count in weights.items() for _ in range(count)]

    def run() -> None:
        for w in mats:
            F.linear(inputs[w.shape[1]], w)

    flops = sum(count * 2 * rows * k * m for (k, m), count in weights.items())
    return flops / _seconds(run)


def matmul_rates(shapes: MatmulShapes, dtype: str, threads: int) -> dict[str, float]:
    """FLOP/s of the layer matmuls at ``DECODE_ROWS`` and ``PREFILL_ROWS`` rows (the shapes in
    the model's proportions) and of the LM head at ``DECODE_ROWS`` rows, on ``threads`` threads."""
    import torch

    dt = getattr(torch, dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            return {
                f"layers@{DECODE_ROWS}": _rate(DECODE_ROWS, shapes.layers, dt),
                f"layers@{PREFILL_ROWS}": _rate(PREFILL_ROWS, shapes.layers, dt),
                f"head@{DECODE_ROWS}": _rate(DECODE_ROWS, {shapes.head: 1}, dt),
            }
    finally:
        torch.set_num_threads(before)


def matmul_floor(
    shapes: MatmulShapes, rates: dict[str, float], prefill_tokens: int, decode_tokens: int, head_rows: int
) -> dict[str, float]:
    """FLOPs of the computed tokens and the seconds they take at ``rates`` (``matmul_rates``)."""
    prefill = 2 * shapes.layer_params * prefill_tokens
    decode = 2 * shapes.layer_params * decode_tokens
    head = 2 * shapes.head_params * head_rows
    floor_s = (
        prefill / rates[f"layers@{PREFILL_ROWS}"]
        + decode / rates[f"layers@{DECODE_ROWS}"]
        + head / rates[f"head@{DECODE_ROWS}"]
    )
    return {
        "prefill_flops": prefill,
        "decode_flops": decode,
        "head_flops": head,
        "flops": prefill + decode + head,
        "floor_s": floor_s,
    }
