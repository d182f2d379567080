"""Parameter grids for the default run and the ``slow`` run."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import pytest


def pairwise_then_slow(*axes: Sequence[Any]) -> list[Any]:
    """Every combination of the axes' values, as ``pytest.param``: a greedy set of combinations
    that holds every pair of values of any two axes runs by default, the rest with ``-m slow``.

    A kernel's shape parameters (GQA ratio, head dim, page size) interact in pairs (a ratio's
    tiling with a head dim, a head dim's padding with a page size); the full product adds cases,
    not kinds of case."""
    combos = list(itertools.product(*axes))
    pairs = lambda c: {(i, c[i], j, c[j]) for i, j in itertools.combinations(range(len(c)), 2)}  # noqa: E731
    needed = set().union(*(pairs(c) for c in combos))
    chosen: set[tuple[Any, ...]] = set()
    while needed:
        best = max(combos, key=lambda c: (len(pairs(c) & needed), -combos.index(c)))
        chosen.add(best)
        needed -= pairs(best)
    return [pytest.param(*c, marks=() if c in chosen else pytest.mark.slow) for c in combos]


def each_value_then_slow(*axes: Sequence[Any]) -> list[Any]:
    """Every combination of the axes' values, as ``pytest.param``: the diagonal that takes each
    value of every axis at least once (the k-th combination takes each axis' k-th value, round
    robin) runs by default, the rest with ``-m slow``.  For axes whose values are independent
    kinds of case (a batch's shape, a pool's element type) rather than interacting sizes."""
    chosen = {tuple(a[k % len(a)] for a in axes) for k in range(max(len(a) for a in axes))}
    return [pytest.param(*c, marks=() if c in chosen else pytest.mark.slow)
            for c in itertools.product(*axes)]
