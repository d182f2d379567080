"""The scheduler of a prefill or a decode worker: :class:`Scheduler` with its requests' KV
handed to (prefill) or taken from (decode) another worker.  A request without bootstrap
fields, or one asking for no output token, runs here as on any worker."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from radixserve.config import ServerArgs
from radixserve.disagg.decode import Arrival, DecodeSide
from radixserve.disagg.nixl import NixlEnd
from radixserve.disagg.prefill import PrefillSide
from radixserve.disagg.wire import pool_layout
from radixserve.ipc.messages import ErrorOut, FinishReason, GenerateReq
from radixserve.sampling.sampler import SampleOutput
from radixserve.scheduler.admission import reserve_tokens
from radixserve.scheduler.request import PromptLogprobs, Req, ReqState
from radixserve.scheduler.scheduler import Scheduler


class DisaggScheduler(Scheduler):
    def __init__(
        self, args: ServerArgs, model: torch.nn.Module, model_config: Any, tokenizer: Any | None
    ) -> None:
        super().__init__(args, model, model_config, tokenizer)
        pool = self.runner.kv_pool
        layout = pool_layout(pool, self.page_size)
        self.prefill_side: PrefillSide | None = None
        self.decode_side: DecodeSide | None = None
        nixl = NixlEnd(pool) if args.disaggregation_transfer_backend == "nixl" else None
        if args.disaggregation_mode == "prefill":
            self.prefill_side = PrefillSide(
                args.disaggregation_bootstrap_port,
                args.disaggregation_timeout,
                pool,
                self.req_pool,
                layout,
                nixl,
            )
        else:
            self.decode_side = DecodeSide(
                args.disaggregation_timeout, layout, pool.bytes_per_token, nixl
            )
        self._idle_step = False  # the last step computed nothing and sent nothing

    # ---- requests in -------------------------------------------------------------------
    def add_request(self, msg: GenerateReq) -> ErrorOut | None:
        if msg.bootstrap is None or msg.sampling_params.max_new_tokens == 0:
            return super().add_request(msg)
        err = super().add_request(msg)
        if err is not None:
            return err
        req = self.reqs[msg.rid]
        req.bootstrap = msg.bootstrap
        self.waiting.remove(req)
        refused: tuple[str, int] | None
        if self.prefill_side is not None:
            # the prefill samples the first token; the decode worker samples the rest
            p = req.params
            req.params = dataclasses.replace(
                p, max_new_tokens=1, min_new_tokens=min(p.min_new_tokens, 1)
            )
            refused = self.prefill_side.claim(req)
            if refused is None:
                self.waiting.append(req)
        else:
            assert self.decode_side is not None
            error = self.decode_side.claim(req)  # it waits for its KV there
            refused = None if error is None else (error, 400)
            # the prefill worker's answer carries them (smg merges)
            if req.prompt_logprobs is not None:
                req.prompt_logprobs = PromptLogprobs.for_request(
                    True, req.prompt_len, req.prompt_len, req.top_logprobs_num
                )
        if refused is not None:
            del self.reqs[req.rid]
            return ErrorOut(rid=msg.rid, message=refused[0], status=refused[1])
        return None

    def abort(self, rid: str) -> None:
        req = self.reqs.get(rid)
        if req is None or req.bootstrap is None or req.state == ReqState.FINISHED:
            super().abort(rid)
            return
        where = ""  # "free": it waited here; "hold": its slots wait for a NIXL write to be over
        if self.prefill_side is not None:
            where = "free" if self.prefill_side.holds(req) else ""
            self.prefill_side.forget(req)
        elif self.decode_side is not None:
            where = self.decode_side.forget(req)
        if not where:  # in the scheduler's lists
            super().abort(rid)
            return
        if where == "free":
            self.kv.release(req, cache=self.prefill_side is not None)  # a prefilled prompt is whole
        req.finish_reason = FinishReason("abort")
        req.state = ReqState.FINISHED
        self.stats.requests_aborted += 1
        self._ended.append(req)

    @property
    def has_work(self) -> bool:
        side = self.prefill_side or self.decode_side
        return super().has_work or (side is not None and side.busy)

    @property
    def nothing_to_run(self) -> bool:
        """Also when the last step computed nothing while transfers are pending."""
        return super().nothing_to_run or self._idle_step

    # ---- the step ----------------------------------------------------------------------
    def step(self) -> Any:
        now = time.monotonic()
        if self.prefill_side is not None:
            self.prefill_side.sweep(self.reqs)  # requests the base dropped (a grammar that failed)
            self._settle(self.prefill_side.poll(now))
        if self.decode_side is not None:
            arrivals, failed, released = self.decode_side.poll(now)
            for req in released:
                self.kv.release(req, cache=False)
            for f in failed:
                self._fail(f.req, f.error, f.status, release=not f.hold)
            for arrival in arrivals:
                self._take_kv(arrival)
            self._reserve()
        rows = self.stats.lm_head_rows
        out = super().step()
        self._idle_step = self.stats.lm_head_rows == rows and out is None
        return out

    def _finish(self, req: Req, finished: list[Req]) -> None:
        if (
            self.prefill_side is not None
            and req.bootstrap is not None
            and req.finish_reason.type != "abort"
        ):
            self._settle(self.prefill_side.prefilled(req))  # finished once its KV is acknowledged
            return
        super()._finish(req, finished)

    def _settle(self, ended: list[Any]) -> None:
        """Prefill side: requests whose transfer ended, answered now; one that failed while
        still waiting or prefilling leaves the scheduler's lists uncomputed."""
        for e in ended:
            if e.error is None:
                super()._finish(e.req, self._ended)
                continue
            req = e.req
            if req in self.waiting:
                self.waiting.remove(req)
                self.kv.forget_waiting(req)
            self._drop_from_lists(req)
            self._fail(req, e.error, e.status)

    def _fail(self, req: Req, error: str, status: int, release: bool = True) -> None:
        """Answer the request with an error; its computed prompt stays in the tree.  Without
        ``release`` its slots stay reserved (the decode side frees them later)."""
        if release:
            self.kv.release(
                req, cache=self.prefill_side is not None and req.kv.computed_len >= req.prompt_len
            )
        req.finish_reason = FinishReason("abort")
        req.state = ReqState.FINISHED
        self.reqs.pop(req.rid, None)
        self._errors.append(ErrorOut(rid=req.rid, message=error, status=status))

    # ---- decode side -------------------------------------------------------------------
    def _reserve(self) -> None:
        """Give waiting transfers their cached prefix and slots for the rest, oldest first, as
        far as the pool allows after the future tokens of the running requests and of the
        transfers in flight; then ask for the KV."""
        assert self.decode_side is not None
        if not self.decode_side.queue:
            return
        ahead = [*self.running, *(t.req for t in self.decode_side.inflight.values())]
        reserved = self.kv.pages_for(sum(reserve_tokens(r, self.new_token_ratio) for r in ahead))
        for req in list(self.decode_side.queue):
            state = self.constraints.poll(req)
            if state == "compiling":
                continue
            if state != "ready":
                self.decode_side.forget(req, state)
                self._fail(req, state, 400)
                continue
            if not self.kv.admit(req, page_budget=self.kv.available_pages() - reserved):
                return  # no free row
            n = req.prompt_len - req.kv.computed_len
            future = self.kv.pages_for(reserve_tokens(req, self.new_token_ratio))
            # the matched prefix is locked now: what is left to take from
            if self.kv.new_pages_needed(req, n) + future > self.kv.available_pages() - reserved \
                    or not self.kv.ensure_slots(req, n):
                self.kv.release(req, cache=False)
                return
            reserved += future
            self.kv.drop_swap_hold(req)
            req.hit.tokens = req.kv.cached_len
            req.hit.by_tier = req.hit.split if self.kv.tiers is not None else None
            req.state = ReqState.PREFILLING
            req.queue_time = time.perf_counter() - req.arrival_time
            self.stats.prompt_tokens += req.prompt_len
            self.stats.cached_tokens += req.kv.cached_len
            if not self.decode_side.want(
                req, self.req_pool.read(req.kv.row, req.kv.cached_len, req.prompt_len)
            ):
                self._fail(
                    req,
                    f"the prefill worker at {self.decode_side.key(req)[0]} reads no requests "
                    "(its queue is full)",
                    502,
                )

    def _take_kv(self, arrival: Arrival) -> None:
        """The prompt's KV arrived: write it, take the first token, decode from here on."""
        assert self.decode_side is not None
        t0 = time.perf_counter()
        req, data = arrival.transfer.req, arrival.data
        pool = self.runner.kv_pool
        n = data.length - data.have
        if (
            data.have != req.kv.cached_len
            or data.length != req.prompt_len
            or arrival.kv.numel()
            != (0 if data.written else 2 * pool.num_layers * n * pool.slot_bytes)
        ):
            self.decode_side.drop(
                arrival.transfer.endpoint, data.room, "KV of another shape than asked"
            )
            self._fail(req, "the prefill worker sent KV of another shape than asked", 502)
            return
        if not data.written:  # else it is in the slots already (NIXL)
            slots = self.req_pool.read(req.kv.row, data.have, data.length)
            pool.scatter(slots, arrival.kv.view(2, pool.num_layers, n, pool.slot_bytes))
        self.decode_side.ack(arrival.transfer.endpoint, data.room)
        req.kv.computed_len = data.length
        req.bootstrap = None  # a retraction from here on recomputes it here, as any request
        top = list(zip(data.top_ids or [], data.top_logprobs or [], strict=True))
        out = SampleOutput([data.token], [data.logprob] if data.logprob is not None else None,
                           [top] if data.top_ids is not None else None)
        self.taker.take(req, out, 0, 0)
        self.decode_side.stats["write_s"] += time.perf_counter() - t0
        self.decode_side.stats["transfers"] += 1
        if req.finished:
            super()._finish(req, self._ended)
            return
        req.state = ReqState.RUNNING
        self.running.append(req)
        self.kv.cache_unfinished(req)

    def live_requests(self) -> list[Req]:
        """With the ended requests whose slots a NIXL write may still reach."""
        held = (
            [t.req for t in self.decode_side.held.values()] if self.decode_side is not None else []
        )
        return [*super().live_requests(), *held]

    def get_stats(self) -> dict[str, Any]:
        """A decode worker's transfers count as waiting (for their KV), a prefill worker's as
        running (they hold their KV until it is acknowledged)."""
        s = super().get_stats()
        if self.decode_side is not None:
            s["waiting"] += len(self.decode_side.queue) + len(self.decode_side.inflight)
        elif self.prefill_side is not None:
            s["running"] += len(self.prefill_side.parked) + len(self.prefill_side.sent)
        return {**s, "disaggregation": self.disagg_stats()}

    def disagg_stats(self) -> dict[str, Any]:
        side = self.prefill_side or self.decode_side
        assert side is not None
        s: dict[str, Any] = {"mode": self.args.disaggregation_mode, **side.stats}
        if self.decode_side is not None:
            s["queued"], s["in_flight"] = (
                len(self.decode_side.queue),
                len(self.decode_side.inflight),
            )
        else:
            assert self.prefill_side is not None
            s["waiting_for_decode"] = len(self.prefill_side.parked)
            s["waiting_for_ack"] = len(self.prefill_side.sent)
        return s

    def close(self) -> None:
        side = self.prefill_side or self.decode_side
        if side is not None:
            side.close()
        super().close()
