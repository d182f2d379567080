"""Thread placement of the server's processes: the scheduler owns the cores, the others get one.

The scheduler runs the model, so its torch intra-op pool gets every core the process may run
on (``os.sched_getaffinity``: a ``taskset`` or cgroup limit is honoured), unless the user set
``OMP_NUM_THREADS``, which then wins.  The detokenizer and the front end never run a tensor op
worth a second thread: they get one torch thread, so no idle OpenMP worker of theirs spins on
a core the scheduler's matmuls need.
"""

from __future__ import annotations

import os
import sys


def available_cores() -> int:
    """Cores this process may run on (its affinity mask; all cores where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def scheduler_threads() -> tuple[int, str]:
    """Torch intra-op threads for the scheduler, and where the number comes from."""
    explicit = os.environ.get("OMP_NUM_THREADS", "").strip()
    if explicit.isdigit() and int(explicit) > 0:
        return int(explicit), "OMP_NUM_THREADS"
    return available_cores(), "cores available (sched_getaffinity)"


def use_one_thread() -> None:
    """One torch thread for a process that runs no model (detokenizer, front end).

    Before torch is imported, ``OMP_NUM_THREADS=1`` makes its OpenMP pool a single thread from
    the start (this process's children inherit that, so only call it before starting any);
    once torch is loaded, ``set_num_threads(1)`` leaves it no worker thread to spin.
    """
    if "torch" not in sys.modules:
        os.environ["OMP_NUM_THREADS"] = "1"
        return
    import torch

    torch.set_num_threads(1)
