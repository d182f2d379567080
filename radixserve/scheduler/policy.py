"""Ordering of the waiting queue: FCFS, or longest cached prefix first (LPM)."""

from __future__ import annotations

from radixserve.scheduler.kv_manager import KVManager
from radixserve.scheduler.request import Req

# Matching every waiting request costs O(queue) tree walks per step; past this queue length
# LPM falls back to FCFS, as the benefit no longer pays for the matching.
LPM_MAX_QUEUE = 128


def order_waiting(waiting: list[Req], policy: str, kv: KVManager) -> list[Req]:
    """Return the queue in admission order (stable: FCFS among equal prefix matches)."""
    if policy == "fcfs" or kv.tree.disable or len(waiting) > LPM_MAX_QUEUE or len(waiting) < 2:
        return list(waiting)
    matched = {id(r): len(kv.match(r)[0]) for r in waiting}
    return sorted(waiting, key=lambda r: -matched[id(r)])
