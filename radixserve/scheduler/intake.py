"""Requests into the scheduler: validation and queueing, aborts, and the waiting requests
whose grammar is ready for admission (the Scheduler is a RequestIntake).

A request that fails validation is answered at once with an :class:`ErrorOut` (400, or 503 when
the queue is full); one whose grammar fails to compile is answered through :meth:`take_errors`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.ipc.messages import ErrorOut, FinishReason, GenerateReq
from radixserve.scheduler.adapters import NOT_ENABLED
from radixserve.scheduler.request import PromptLogprobs, Req, ReqState
from radixserve.validation import check_input_ids

if TYPE_CHECKING:
    from collections import deque

    from radixserve.config import ServerArgs
    from radixserve.executor.model_runner import ModelRunner
    from radixserve.scheduler.constraints import Constraints
    from radixserve.scheduler.kv_manager import KVManager
    from radixserve.scheduler.stats import SchedulerStats


class RequestIntake:
    """The scheduler's side of arriving and aborted requests; the parts of the scheduler they
    read are named here."""

    args: ServerArgs
    reqs: dict[str, Req]
    waiting: deque[Req]
    running: list[Req]
    chunked: Req | None
    kv: KVManager
    runner: ModelRunner
    constraints: Constraints
    stats: SchedulerStats
    vocab_size: int
    context_len: int
    pool_tokens: int
    max_running: int
    _ended: list[Req]
    _errors: list[ErrorOut]

    def add_request(self, msg: GenerateReq) -> ErrorOut | None:
        """Queue a request; a request that fails validation is answered with an ErrorOut."""
        try:
            if msg.rid in self.reqs:
                raise ValueError(f"request id {msg.rid!r} is already in use")
            ids = check_input_ids(
                msg.input_ids, self.vocab_size, self.context_len, self.pool_tokens
            )
            params = msg.sampling_params  # checked as it was decoded
            params.validate_for_model(self.vocab_size)
            prompt_lp = PromptLogprobs.for_request(
                msg.return_logprob, msg.logprob_start_len, len(ids), msg.top_logprobs_num
            )
        except ValueError as e:
            return ErrorOut(rid=msg.rid, message=str(e), status=400)
        lora = None
        if msg.lora is not None:
            pool = self.runner.lora
            if pool is None:
                return ErrorOut(rid=msg.rid, message=NOT_ENABLED, status=400)
            lora = pool.adapters.get(msg.lora)
            if lora is None:
                return ErrorOut(rid=msg.rid, status=404,
                                message=f"the LoRA adapter {msg.lora!r} is not loaded")
        limit = self.args.max_queued_requests
        # Requests that arrived this step wait until the next admission even when a running
        # place is free for them: only those beyond the free places count as queued.
        free_places = self.max_running - len(self.running) - (1 if self.chunked else 0)
        if limit is not None and len(self.waiting) - max(free_places, 0) >= limit:
            return ErrorOut(
                rid=msg.rid,
                message=f"the request queue is full ({limit} waiting); retry later",
                status=503,
            )
        req = Req(
            msg.rid,
            ids,
            params,
            msg.seed,
            msg.return_logprob,
            msg.top_logprobs_num,
            msg.stream,
            extra_key=msg.extra_key,
            priority=msg.priority,
            lora=lora,
        )
        req.pin, req.pin_ttl = msg.pin, msg.pin_ttl
        req.return_cache_report = msg.return_cache_report
        req.prompt_logprobs = prompt_lp
        try:
            self.constraints.on_arrival(req)
        except ValueError as e:
            return ErrorOut(rid=msg.rid, message=str(e), status=400)
        self.reqs[req.rid] = req
        self.waiting.append(req)
        self.stats.requests_received += 1
        return None

    def abort(self, rid: str) -> None:
        """Drop a request wherever it is; its partial KV never enters the tree."""
        req = self.reqs.get(rid)
        if req is None or req.finished:
            return
        if req.state == ReqState.WAITING:
            self.waiting.remove(req)
            self.kv.forget_waiting(req)
        elif req is self.chunked:
            self.chunked = None
        elif req in self.running:
            self.running.remove(req)
        self.kv.release(req, cache=False)
        req.finish_reason = FinishReason("abort")
        req.state = ReqState.FINISHED
        self.stats.requests_aborted += 1
        self._ended.append(req)

    def take_errors(self) -> list[ErrorOut]:
        """Requests answered with an error since the last call (a grammar that failed)."""
        errors, self._errors = self._errors, []
        return errors

    def _admissible(self) -> list[Req]:
        """Waiting requests whose grammar (if any) is compiled; a failed one is answered."""
        ready = []
        failed = []
        for req in self.waiting:
            if self.kv.loading(req):  # its prefix is coming from disk
                continue
            state = self.constraints.poll(req)
            if state == "ready":
                ready.append(req)
            elif state != "compiling":
                failed.append(req)
                self._errors.append(ErrorOut(rid=req.rid, message=state, status=400))
        for req in failed:
            self.waiting.remove(req)
            self.kv.forget_waiting(req)
            req.finish_reason = FinishReason("abort")
            req.state = ReqState.FINISHED
            self.reqs.pop(req.rid, None)
        return ready
