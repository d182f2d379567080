"""The scheduler's control commands, in one registry the scheduler owns.

Every control message (``ipc/messages.py``: :class:`ControlReq` for the commands without
arguments, :class:`UnpinReq`, :class:`CacheTreeReq`) is answered with the result of its handler
here; the process loop only passes messages in and results out.  A command that fails in an
expected way (an unknown command, a profile started twice, a bad sort key) answers
``{"error": ...}``; anything else raised reaches the process's exception boundary.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from radixserve.cache.tree_view import summary_rows
from radixserve.ipc import messages as m
from radixserve.scheduler.adapters import COMMANDS as ADAPTER_COMMANDS

if TYPE_CHECKING:
    from collections import deque

    from radixserve.cache.allocator import PageAllocator
    from radixserve.cache.radix_tree import RadixCache
    from radixserve.cache.tiers import TierManager
    from radixserve.config import ServerArgs
    from radixserve.executor.model_runner import ModelRunner
    from radixserve.ipc.kv_publisher import KVEventPublisher
    from radixserve.scheduler.constraints import Constraints
    from radixserve.scheduler.kv_manager import KVManager
    from radixserve.scheduler.pins import Pins
    from radixserve.scheduler.profiling import StepProfiler
    from radixserve.scheduler.request import Req
    from radixserve.scheduler.stats import SchedulerStats
    from radixserve.scheduler.stop import StopChecker
    from radixserve.speculative import Proposer

Result = dict[str, Any]


class SchedulerControl:
    """The scheduler's side of the control commands (the Scheduler is one); the parts of the
    scheduler they read are named here."""

    reqs: dict[str, Req]
    allocator: PageAllocator
    tree: RadixCache
    kv: KVManager
    pins: Pins
    tiers: TierManager | None
    kv_events: KVEventPublisher | None
    runner: ModelRunner
    stats: SchedulerStats
    profiler: StepProfiler
    constraints: Constraints
    spec: Proposer | None
    near_misses: deque[dict[str, Any]]
    running: list[Req]
    waiting: deque[Req]
    chunked: Req | None
    new_token_ratio: float
    has_work: bool
    args: ServerArgs
    vocab_size: int
    context_len: int
    pool_tokens: int
    max_running: int
    page_size: int
    stop_checker: StopChecker

    def info(self, tokenizer_path: str, torch_threads: int) -> m.ModelInfo:
        return m.ModelInfo(
            vocab_size=self.vocab_size,
            context_length=self.context_len,
            max_total_tokens=self.pool_tokens,
            max_running_requests=self.max_running,
            page_size=self.page_size,
            eos_token_ids=sorted(self.stop_checker.eos_token_ids),
            dtype=self.args.dtype,
            kv_cache_dtype=self.runner.kv_pool.kv_cache_dtype,
            kv_cache_bytes_per_token=self.runner.kv_pool.bytes_per_token,
            device=self.args.device,
            attention_backend=self.args.attention_backend,
            tp_size=self.args.tp_size,
            quantization=self.args.quantization,
            speculative_algorithm=self.args.speculative_algorithm,
            tokenizer_path=tokenizer_path,
            torch_threads=torch_threads,
            disaggregation_mode=self.args.disaggregation_mode,
            lora_enabled=self.runner.lora is not None,
            lora_adapters={} if self.runner.lora is None else self.runner.lora.listing(),
            max_lora_rank=0 if self.runner.lora is None else self.runner.lora.max_rank,
        )

    def record_near_miss(self, req: Req) -> None:
        """Its match stopped inside a long cached sequence: keep the spot for people to see
        (``/cache/misses``; a re-rendered chat history is the usual cause)."""
        assert req.hit.divergence is not None
        self.stats.near_misses += 1
        self.near_misses.append({"rid": req.rid, "time": time.time(), "salted": bool(req.extra_key),
                                 "prompt_tokens": req.prompt_len, **req.hit.divergence.to_dict()})

    def live_requests(self) -> list[Req]:
        return [r for r in self.reqs.values() if r.kv.row is not None]

    def check_memory(self) -> dict[str, Any]:
        idle = not self.has_work
        return self.kv.check_invariant(self.live_requests(), idle=idle)

    def flush_cache(self) -> bool:
        """Drop the whole tree; refused (False) while requests are in flight."""
        if self.has_work:
            return False
        self.tree.reset()
        self.allocator.reset()
        self.pins.clear()
        if self.tiers is not None and self.tiers.host_alloc is not None:
            self.tiers.host_alloc.reset()
        return True

    def publish_kv_events(self) -> None:
        """Send the tree's changes since the last call to the KV event subscribers."""
        if self.kv_events is not None and (events := self.tree.events.take()):
            self.kv_events.publish(events)

    def close(self) -> None:
        """Let queued disk-tier writes and KV events go out (bounded); stop the tensor-parallel
        ranks."""
        if self.tiers is not None:
            self.tiers.close()
        if self.kv_events is not None:
            self.publish_kv_events()
            self.kv_events.close()
        if self.runner.link is not None:
            self.runner.link.close()
            self.runner.link = None

    def start_profile(self) -> dict[str, Any]:
        """Profile the steps from now on (``profiling.py``); RuntimeError if already profiling."""
        return self.profiler.start()

    def stop_profile(self) -> dict[str, Any]:
        """Seconds per category of the steps since ``start_profile``; RuntimeError if none."""
        return self.profiler.stop()

    def get_stats(self) -> dict[str, Any]:
        d = self.stats.to_dict()
        d.update(
            running=len(self.running) + (1 if self.chunked else 0),
            waiting=len(self.waiting),
            waiting_tokens=sum(r.prompt_len for r in self.waiting),
            grammar_waiting=sum(
                r.grammar is None and r.grammar_future is not None for r in self.waiting
            ),
            free_pages=self.allocator.num_free_pages,
            total_pages=self.allocator.num_pages,
            tree_tokens=self.tree.total_size(),
            evictable_tokens=self.tree.evictable_size(),
            pinned_tokens=self.tree.pinned_size(),
            num_pins=len(self.pins),
            new_token_ratio=self.new_token_ratio,
        )
        d.update(self.constraints.stats())
        if self.spec is not None:
            d.update(self.spec.stats())
        if self.tiers is not None:
            d.update(self.tiers.to_dict(), host_tree_tokens=self.tree.host_size())
        return d


def _stats(sched: SchedulerControl, msg: m.ControlReq) -> Result:
    return sched.get_stats()


def _flush_cache(sched: SchedulerControl, msg: m.ControlReq) -> Result:
    return {"success": sched.flush_cache()}


def _check_memory(sched: SchedulerControl, msg: m.ControlReq) -> Result:
    try:
        return {"ok": True, **sched.check_memory()}
    except RuntimeError as e:  # the invariant does not hold: say so, do not crash
        return {"ok": False, "error": str(e)}


def _pins(sched: SchedulerControl, msg: m.ControlReq) -> Result:
    return {"pins": sched.pins.listing(), "pinned_tokens": sched.tree.pinned_size(),
            "cap_tokens": sched.pins.cap_tokens}


def _cache_misses(sched: SchedulerControl, msg: m.ControlReq) -> Result:
    return {"near_misses": list(sched.near_misses), "total": sched.stats.near_misses}


def _start_profile(sched: SchedulerControl, msg: m.ControlReq) -> Result:
    try:
        return sched.start_profile()
    except RuntimeError as e:  # already profiling
        return {"error": str(e)}


def _stop_profile(sched: SchedulerControl, msg: m.ControlReq) -> Result:
    try:
        return sched.stop_profile()
    except RuntimeError as e:  # no profile running
        return {"error": str(e)}


def _unpin(sched: SchedulerControl, msg: m.UnpinReq) -> Result:
    namespace = sched.adapter_namespace(msg.extra_key, msg.lora)
    if namespace is None:  # an adapter that is not loaded holds no pins
        return {"unpinned": []}
    return {"unpinned": sched.pins.unpin(msg.pin_id, msg.input_ids, namespace)}


def _kv_events_snapshot(sched: SchedulerControl, msg: m.ControlReq) -> Result:
    """Publish everything the tree holds as one batch (after the changes not yet sent), for a
    subscriber that starts from the current state; its sequence number."""
    if sched.kv_events is None:
        return {"error": "KV events are off (--kv-events-config)"}
    sched.publish_kv_events()
    tree = sched.tree
    return {"sequence": sched.kv_events.publish(tree.events.snapshot(tree._roots, tree._nodes()))}


def _cache_tree(sched: SchedulerControl, msg: m.CacheTreeReq) -> Result:
    try:
        return summary_rows(sched.tree, msg.sort, msg.depth, msg.limit)
    except ValueError as e:  # an unknown sort key
        return {"error": str(e)}


COMMANDS: dict[str, Callable[[Any, Any], Result]] = {
    "stats": _stats,
    "flush_cache": _flush_cache,
    "check_memory": _check_memory,
    "pins": _pins,
    "cache_misses": _cache_misses,
    "start_profile": _start_profile,
    "stop_profile": _stop_profile,
    "kv_events_snapshot": _kv_events_snapshot,
    m.UnpinReq.TYPE: _unpin,
    m.CacheTreeReq.TYPE: _cache_tree,
    **ADAPTER_COMMANDS,
}
CONTROL_MESSAGES = (m.ControlReq, *m.CONTROL_WITH_ARGS.values())


def run_control(sched: SchedulerControl, msg: Any) -> Result:
    """The result of one control message."""
    name = msg.command if isinstance(msg, m.ControlReq) else msg.TYPE
    handler = COMMANDS.get(name)
    if handler is None:
        return {"error": f"unknown control command {name!r}"}
    return handler(sched, msg)
