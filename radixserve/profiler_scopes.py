"""Named ranges for torch's profiler (bench/offline.py --breakdown, scheduler/profiling.py) that
cost nothing while it is off.

``torch.profiler.record_function`` opens a range through two dispatcher ops even when no
profiler records it: tens of microseconds each time.  A decode step opens one for each layer's
attention and for the step's forward and sampling, so with the profiler off these ranges must
not be opened at all.
"""

from __future__ import annotations

import contextlib

import torch


def scope(name: str) -> contextlib.AbstractContextManager:
    """``record_function(name)`` while torch's profiler runs, else a context that does nothing."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()
