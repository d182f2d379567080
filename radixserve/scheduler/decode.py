"""Decode bookkeeping: a slot for every running request's next token, or retraction."""

from __future__ import annotations

import logging

from radixserve.ipc.messages import FinishReason
from radixserve.scheduler.kv_manager import KVManager
from radixserve.scheduler.request import Req, ReqState

logger = logging.getLogger(__name__)


def retract(req: Req, kv: KVManager) -> None:
    """Free the request's pages (its computed KV stays in the tree) and send it back to wait.

    Its output so far is kept: on re-admission it recomputes ``prompt + output`` (mostly
    from the tree) and continues where it stopped.  Under ``--preemption-mode swap`` its own
    KV moves to the host tier now and is copied back on re-admission instead.
    """
    kv.release(req, cache=True, swap=True)
    if req.kv.tiers is not None:
        req.kv.tiers.checked = False  # look on disk again when it waits
    req.state = ReqState.WAITING
    req.num_retractions += 1


def reserve_decode_slots(
    decoding: list[Req], prefilling: list[Req], kv: KVManager
) -> tuple[list[Req], list[Req]]:
    """Make sure every decoding request has slots for its next tokens: one sampled token,
    plus any text a grammar forced after it (jump-forward), computed together next step.

    When pages run out: evict unlocked tree leaves (LRU); if that is not enough, retract the
    most recently admitted requests (a partially prefilled one first, as it is the newest
    claim) until the rest fit.  A request that cannot grow even alone finishes with
    ``length``.  Returns ``(retracted, finished_for_memory)``.
    """
    retracted: list[Req] = []
    out_of_memory: list[Req] = []
    active = list(decoding)
    candidates = sorted(prefilling, key=lambda r: r.admit_seq) + sorted(
        active, key=lambda r: r.admit_seq
    )

    def need() -> int:
        return sum(kv.new_pages_needed(r, r.remaining_extend) for r in active)

    while need() > kv.available_pages() and candidates:
        victim = candidates.pop()  # newest claim first
        if victim in active:
            if len(active) == 1 and not candidates:
                break
            active.remove(victim)
        retract(victim, kv)
        retracted.append(victim)
    if need() > kv.available_pages():
        for req in active:
            if kv.new_pages_needed(req, req.remaining_extend):
                logger.warning("request %s cannot grow: KV pool exhausted; finishing it", req.rid)
                req.finish_reason = FinishReason("length", length=req.output_len)
                out_of_memory.append(req)
        active = [r for r in active if r not in out_of_memory]
    if not kv.ensure_slots_many(active, [r.remaining_extend for r in active]):
        raise RuntimeError(
            f"no slots for the next tokens of {len(active)} requests after reservation"
        )
    return retracted, out_of_memory
