"""Named ranges for torch's profiler (bench/offline.py --breakdown, scheduler/profiling.py) that
cost nothing while it is off.

``torch.profiler.record_function`` opens a range through two dispatcher ops even when no
profiler records it: tens of microseconds each time.  The attention range of each layer and the
forward and sampling ranges of each step were ~0.5-0.9 ms of a one-row decode step of the
default model (4-bit weights; with the qkv split by split_with_sizes, bfloat16 15.4-15.7 ->
14.6-15.4 ms, float32 15.7-16.3 -> 14.8-15.2, back to back).
"""

from __future__ import annotations

import contextlib

import torch


def scope(name: str) -> contextlib.AbstractContextManager:
    """``record_function(name)`` while torch's profiler runs, else a context that does nothing."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()
