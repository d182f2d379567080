"""Where a scheduler step's time goes: torch.profiler over a window of steps, aggregated.

``start_profile`` / ``stop_profile`` control requests open and close the window (control
messages are handled between steps, so it holds whole steps).  The step time of the window
comes from the scheduler's own clock (``SchedulerStats.step_seconds``); the profiler splits it:

    attention   inside ``ATTENTION_SCOPE`` (each layer's attention backend call)
    linear      top-level ``LINEAR_SCOPE`` ranges (every matmul of the model's layers, the C++
                kernels' included) and aten::linear / addmm / mm / matmul in the forward,
                outside attention
    other       the rest of ``FORWARD_SCOPE`` (building the batch, norms, RoPE, activations...)
    sampling    inside ``SAMPLING_SCOPE``
    scheduler   the step minus forward and sampling (admission, KV bookkeeping, output)

The five add up to the step time.  Every profiled op pays the profiler's own overhead (a few
microseconds), so a profiled step is slower than an unprofiled one and the many small ops of
``other`` weigh more than they do unprofiled.  Times are host times: on a GPU they are the
cost of launching the kernels, not of running them.  ``stop`` aggregates the window's events
in the scheduler process, which serves nothing meanwhile (seconds for ~10^6 ops).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from radixserve.executor.model_runner import FORWARD_SCOPE, SAMPLING_SCOPE
from radixserve.model.decoder import ATTENTION_SCOPE
from radixserve.quantization import LINEAR_SCOPE
from radixserve.scheduler.stats import SchedulerStats

LINEAR_OPS = frozenset({LINEAR_SCOPE, "aten::linear", "aten::addmm", "aten::mm", "aten::matmul"})
CATEGORIES = ("attention", "linear", "other", "scheduler", "sampling")


class StepProfiler:
    """One profiling window at a time over the steps of one scheduler."""

    def __init__(self, stats: SchedulerStats) -> None:
        self.stats = stats
        self._prof: profile | None = None
        self._start: tuple[int, float, int, int] = (0, 0.0, 0, 0)

    @property
    def active(self) -> bool:
        return self._prof is not None

    def _counters(self) -> tuple[int, float, int, int]:
        s = self.stats
        return s.forward_steps, s.step_seconds, s.decode_steps, s.decode_tokens

    def start(self) -> dict[str, Any]:
        if self._prof is not None:
            raise RuntimeError("a profile is already running; stop it first")
        prof = profile(activities=[ProfilerActivity.CPU], record_shapes=False, with_stack=False)
        prof.start()
        self._prof = prof
        self._start = self._counters()
        return {"started": True}

    def stop(self) -> dict[str, Any]:
        """Seconds per category over the window, with its step count and step time."""
        if self._prof is None:
            raise RuntimeError("no profile is running; start one first")
        prof, self._prof = self._prof, None
        prof.stop()
        end = self._counters()
        steps, step_s, decode_steps, decode_rows = (
            b - a for a, b in zip(self._start, end, strict=True)
        )
        events = prof.events()
        scopes = scope_seconds(events)
        return {
            "steps": steps,
            "decode_steps": decode_steps,
            "decode_rows": decode_rows,
            "step_s": step_s,
            "forward_s": scopes["forward"],
            "attention_s": scopes["attention"],
            "linear_s": scopes["linear"],
            "other_s": scopes["forward"] - scopes["attention"] - scopes["linear"],
            "sampling_s": scopes["sampling"],
            "scheduler_s": step_s - scopes["forward"] - scopes["sampling"],
            "profiled_ops": len(events),
            "torch_threads": torch.get_num_threads(),
        }


def scope_seconds(events: Any) -> dict[str, float]:
    """Seconds in the forward, attention and sampling scopes and in top-level linear ops of
    the forward outside attention, from a profile's event tree (``profile.events()``)."""
    us = {"forward": 0.0, "attention": 0.0, "linear": 0.0, "sampling": 0.0}
    # Walk down from the roots; an event counted whole (attention, a linear op, sampling)
    # is not descended into, so nothing is counted twice.
    stack = [(ev, False) for ev in events if ev.cpu_parent is None]
    while stack:
        ev, in_forward = stack.pop()
        name = ev.name
        if name == FORWARD_SCOPE:
            us["forward"] += ev.time_range.elapsed_us()
            in_forward = True
        elif name == SAMPLING_SCOPE:
            us["sampling"] += ev.time_range.elapsed_us()
            continue
        elif in_forward and name == ATTENTION_SCOPE:
            us["attention"] += ev.time_range.elapsed_us()
            continue
        elif in_forward and name in LINEAR_OPS:
            us["linear"] += ev.time_range.elapsed_us()
            continue
        stack.extend((child, in_forward) for child in ev.cpu_children)
    return {k: v / 1e6 for k, v in us.items()}
