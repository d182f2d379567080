"""Expectations shared by tests: what the radix cache must serve a request (worked out
independently of the tree's code), and waiting for a condition with a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading token ids on which ``a`` and ``b`` agree."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def expected_cached_len(prompt: Sequence[int], in_tree: Sequence[Sequence[int]], page_size: int) -> int:
    """Tokens of ``prompt`` served from a tree holding the sequences ``in_tree``.

    The longest prefix shared with one of them, at most ``len(prompt) - 1`` (the last prompt
    token is always computed: the forward must give logits to sample from), rounded down to
    whole pages (the tree shares whole pages only).
    """
    longest = max((common_prefix_len(prompt, seq) for seq in in_tree), default=0)
    return min(longest, len(prompt) - 1) // page_size * page_size


def assert_eventually(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``condition`` until it holds; AssertionError naming ``what`` after ``timeout`` s.

    A deadline for something that must happen, never a measure of how fast it happens.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)
