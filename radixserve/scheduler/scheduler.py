"""The scheduler: request queue, admission, decode bookkeeping and the step loop (no I/O).
Beside it: its KV memory (``memory.py``), what a step sends (``output.py``), sampled tokens
taken into outputs (``taker.py``), the control commands (``control.py``), requests in and
aborted (``intake.py``)."""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import torch

from radixserve.config import ServerArgs
from radixserve.executor.model_runner import ModelRunner
from radixserve.ipc.messages import ErrorOut, FinishReason, TokenOut
from radixserve.lora.slots import LoraPool
from radixserve.scheduler.adapters import SchedulerAdapters
from radixserve.scheduler.admission import PrefillAdder, reserve_tokens
from radixserve.scheduler.constraints import Constraints
from radixserve.scheduler.control import SchedulerControl
from radixserve.scheduler.decode import reserve_decode_slots, retract
from radixserve.scheduler.intake import RequestIntake
from radixserve.scheduler.memory import KVMemory
from radixserve.scheduler.output import rows_to_send, token_out
from radixserve.scheduler.policy import SchedulePolicy
from radixserve.scheduler.profiling import StepProfiler
from radixserve.scheduler.request import Req, ReqState, num_drafts
from radixserve.scheduler.stats import SchedulerStats
from radixserve.scheduler.stop import StopChecker
from radixserve.scheduler.taker import TokenTaker
from radixserve.speculative import Proposer, server_proposer

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
NEAR_MISS_RING = 64  # recent near-misses kept for /cache/misses


class Scheduler(SchedulerControl, RequestIntake, SchedulerAdapters):
    def __init__(
        self, args: ServerArgs, model: torch.nn.Module, model_config: Any, tokenizer: Any | None
    ) -> None:
        self.args = args
        self.model_config = model_config
        self.device = torch.device(args.device)
        self.dtype = getattr(torch, args.dtype)
        self.page_size = args.page_size
        self.context_len = args.context_length or model_config.max_context_len
        self.vocab_size = model_config.vocab_size

        # the adapters' slots first: on a GPU the KV pool is sized from the memory left
        loras = (LoraPool.from_args(args, model_config, self.dtype, self.device)
                 if args.enable_lora else None)
        mem = KVMemory.build(args, model, model_config, self.device, self.dtype)
        self.pool_tokens = mem.pool_tokens
        self.max_running = mem.max_running
        self.allocator, self.req_pool, self.tree = mem.allocator, mem.req_pool, mem.tree
        self.tiers, self.kv, self.pins, self.kv_events = mem.tiers, mem.kv, mem.pins, mem.kv_events
        kv_pool = mem.kv_pool
        self.policy = SchedulePolicy(
            args.schedule_policy,
            args.schedule_policy_max_queue,
            seed=args.random_seed,
            low_priority_values_first=args.schedule_low_priority_values_first,
            preemption=args.priority_preemption,
        )
        self.runner = ModelRunner(
            model, self.vocab_size, kv_pool, self.req_pool, args.attention_backend, self.device
        )
        self.runner.lora = loras
        if args.cuda_graph_max_bs and self.device.type == "cuda" and args.tp_size == 1:
            if self.runner.backend.supports_cuda_graphs:
                self.runner.use_decode_graphs(
                    min(args.cuda_graph_max_bs, self.max_running), self.context_len
                )
            else:
                logger.info(
                    "the %s attention backend has no CUDA-graph decode: decode runs eagerly",
                    args.attention_backend,
                )
        self.stop_checker = StopChecker(
            set(model_config.eos_token_ids), self.context_len, tokenizer
        )
        self.constraints = Constraints(
            args.grammar_backend, tokenizer, self.vocab_size, list(model_config.eos_token_ids),
            jump_forward=not args.disable_jump_forward,
        )

        self.spec: Proposer | None = server_proposer(args)

        self.reqs: dict[str, Req] = {}
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.stats = SchedulerStats()
        self.profiler = StepProfiler(self.stats)
        self.taker = TokenTaker(
            self.stop_checker, self.constraints, self.spec, self.kv, self.stats, self.context_len
        )
        self._admit_counter = 0
        self._step_counter = 0
        self._errors: list[ErrorOut] = []
        self.near_misses: deque[dict[str, Any]] = deque(maxlen=NEAR_MISS_RING)
        # ended between steps (aborted, KV handed on): the next step reports them
        self._ended: list[Req] = []
        self._last_forward_s = 0.0

    def attach_tokenizer(self, decoder: Any, tokenizer: Any) -> None:
        """What was not there at construction: the ``decoder`` of stop strings (anything with
        ``decode``) and the tokenizer of grammars (or a DeferredTokenizer)."""
        self.stop_checker.tokenizer = decoder
        self.constraints.attach_tokenizer(tokenizer)

    # ---- requests in -------------------------------------------------------------------
    def drop(self, rid: str) -> None:
        """Forget a request without an output row (its error is answered by the caller),
        freeing its pages; used after an internal error, when its state may be broken."""
        req = self.reqs.get(rid)
        if req is None:
            return
        try:
            self.abort(rid)
        except Exception:  # broken state: forget the request all the same
            logger.exception("could not abort request %s cleanly", rid)
        if req in self._ended:
            self._ended.remove(req)
        del self.reqs[rid]

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self._ended)

    @property
    def nothing_to_run(self) -> bool:
        """Nothing can run until a grammar compiles or a disk load lands: the loop may wait."""
        return (
            not self.running and self.chunked is None and not self._ended
            and all(self.kv.loading(r) or (r.grammar is None and r.grammar_future is not None)
                    for r in self.waiting)
        )

    # ---- the step ----------------------------------------------------------------------
    def step(self) -> TokenOut | None:
        """One iteration: reserve decode slots, admit prefill work, forward, sample, stop."""
        t_start = time.perf_counter()
        self._step_counter += 1
        finished: list[Req] = list(self._ended)
        self._ended.clear()
        if len(self.pins):
            self.pins.expire()

        prefilling = [self.chunked] if self.chunked is not None else []
        retracted, out_of_memory = reserve_decode_slots(self.running, prefilling, self.kv)
        for req in retracted:
            if req is self.chunked:
                self.chunked = None
            else:
                self.running.remove(req)
        for req in reversed(sorted(retracted, key=lambda r: r.admit_seq)):
            self.waiting.appendleft(req)
        if retracted:
            self.stats.retractions += len(retracted)
            self.new_token_ratio = 1.0
            logger.info("retracted %d request(s): KV pool full", len(retracted))
        for req in out_of_memory:
            self.running.remove(req)
            self._finish(req, finished)
        if self.policy.preemption:
            self._preempt_for_priority()
        if self.kv.disk is not None and self.waiting:
            self.kv.land_loads(self.waiting)
            for req in self.waiting:
                self.kv.prefetch(req)

        decodes = list(self.running)
        plan = None
        if self.args.schedule_mode == "prefill-first":
            # prompt work runs alone (a whole budget of it); the decodes wait until none is left
            plan = self._plan_prefill(0)
            if plan:
                decodes = []
        drafted = (
            self.spec.propose(decodes, self.kv, self.context_len)
            if self.spec is not None and decodes
            else 0
        )
        if plan is None:
            plan = self._plan_prefill(len(decodes) + drafted)
        # A decode computes its sampled token, plus the text a grammar forced after it, plus
        # its speculative drafts.
        entries = [(r, r.remaining_extend + num_drafts(r)) for r in decodes] + plan
        generated = self.stats.generation_tokens
        if entries:
            self._run_forward(entries, len(plan) > 0, finished)
            if decodes:
                self.new_token_ratio = max(
                    MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY
                )
        self.stats.evicted_tokens = self.kv.evicted_tokens
        rows = rows_to_send(
            finished, self.running, self._step_counter % self.args.stream_interval == 0
        )
        out = token_out(rows) if rows else None
        for req in finished:
            self.reqs.pop(req.rid, None)
        if entries:
            step_s = time.perf_counter() - t_start
            self.stats.record_step(len(entries), not plan, step_s, self._last_forward_s,
                                   self.stats.generation_tokens - generated)
        return out

    def _preempt_for_priority(self) -> None:
        """``--priority-preemption``: retract lower-priority running requests so that the
        highest-priority waiting one is admitted in this step."""
        victims = self.policy.preemption_victims(self.running, self._admissible(), self.kv,
                                                 self.max_running, self.new_token_ratio)
        for req in victims:
            self.running.remove(req)
            retract(req, self.kv)
            self.waiting.appendleft(req)  # ahead of later arrivals of its level
        if victims:
            self.stats.retractions += len(victims)
            self.stats.priority_preemptions += len(victims)
            logger.info("retracted %d lower-priority request(s) for a waiting one", len(victims))

    def _plan_prefill(self, num_decodes: int) -> list[tuple[Req, int]]:
        if not self.waiting and self.chunked is None:
            return []
        reserved = sum(reserve_tokens(r, self.new_token_ratio) for r in self.running)
        adder = PrefillAdder(
            self.kv,
            token_budget=max(1, self.args.max_prefill_tokens - num_decodes),
            chunk_size=self.args.chunked_prefill_size,
            reserved_tokens=reserved,
            new_token_ratio=self.new_token_ratio,
        )
        if self.chunked is not None:
            if not adder.add_chunked(self.chunked) or adder.chunked is not None:
                return adder.plan.entries
        admitted: set[int] = set()
        for req in self.policy.order(self._admissible(), self.kv):
            if not self.take_lora_slot(req):  # every adapter slot is in use: it waits
                continue
            verdict = adder.add_waiting(req)
            if verdict == "stop":
                break
            if verdict == "admitted":
                admitted.add(id(req))
                self._admit_counter += 1
                req.admit_seq = self._admit_counter
                if req.queue_time is None:
                    req.queue_time = time.perf_counter() - req.arrival_time
                if req.num_retractions == 0:
                    self.stats.prompt_tokens += req.prompt_len
                    self.stats.cached_tokens += req.hit.tokens or 0
                    if req.lora_name is not None:
                        self.stats.record_adapter(req.lora_name, req.prompt_len,
                                                  req.hit.tokens or 0, req.hit.by_tier)
                    if req.hit.divergence is not None and req.hit.divergence.near_miss:
                        self.record_near_miss(req)
                    if self.tiers is not None and req.hit.by_tier:
                        for tier, n in req.hit.by_tier.items():
                            self.tiers.stats.cached_tokens[tier] += n
        if admitted:
            self.waiting = deque(r for r in self.waiting if id(r) not in admitted)
        return adder.plan.entries

    def _run_forward(
        self, entries: list[tuple[Req, int]], has_prefill: bool, finished: list[Req]
    ) -> None:
        t0 = time.perf_counter()
        # Rows that sample: decodes, and prefills whose whole prompt is computed by this forward,
        # except prefill-only requests (max_new_tokens 0), which finish here with nothing
        # sampled: their prompt goes to the tree when they are released, like any finished
        # request's.  A decode with k drafts samples k + 1 rows (speculative/).
        done = [
            i
            for i, (r, n) in enumerate(entries)
            if r.kv.computed_len + n == r.fill_len + num_drafts(r)
        ]
        sample_idx = [i for i in done if entries[i][0].params.max_new_tokens > 0]
        drafts = {i: k for i in sample_idx if (k := num_drafts(entries[i][0]))}
        sample_logits = self.runner.forward(entries, sample_idx, drafts)
        for req, n in entries:
            req.kv.computed_len += n - num_drafts(req)  # accepted drafts are added once verified
        for i in done:
            if entries[i][0].params.max_new_tokens == 0:
                entries[i][0].finish_reason = FinishReason("length", length=0)
        sample_reqs = [entries[i][0] for i in sample_idx]
        draft_lists = (
            [r.spec.draft if r.spec is not None else [] for r in sample_reqs] if drafts else None
        )
        out = None
        if sample_reqs:
            # Masked in place: the forward's rows of the sampling requests (nothing else reads
            # them after sampling).
            with torch.inference_mode():  # the logits are an inference tensor: masked in place
                self.constraints.mask_logits(sample_logits, sample_reqs, draft_lists)
            out = self.runner.sample(sample_logits, sample_reqs, draft_lists)
        self._last_forward_s = time.perf_counter() - t0

        num_decode = sum(1 for r, n in entries if r.state == ReqState.RUNNING)
        self.stats.decode_tokens += num_decode
        self.stats.lm_head_rows += len(entries) + sum(drafts.values())
        self.stats.prefill_tokens_computed += sum(
            n for r, n in entries if r.state == ReqState.PREFILLING
        )
        if num_decode:
            self.stats.decode_steps += 1
            if has_prefill:
                self.stats.mixed_steps += 1

        if out is not None:
            row = 0
            for req in sample_reqs:
                k = num_drafts(req)
                self.taker.take(req, out, row, k)
                row += k + 1

        sampled = {id(r) for r in sample_reqs}
        for req, _ in entries:
            if req.state == ReqState.PREFILLING:
                if req.finished:
                    self._drop_from_lists(req)
                    self._finish(req, finished)
                    continue
                if id(req) in sampled:  # prompt done, first token sampled
                    req.state = ReqState.RUNNING
                    self.running.append(req)
                    if self.chunked is req:
                        self.chunked = None
                else:
                    self.chunked = req
                self.kv.cache_unfinished(req)
            elif req.finished:
                self.running.remove(req)
                self._finish(req, finished)

    def _drop_from_lists(self, req: Req) -> None:
        if self.chunked is req:
            self.chunked = None
        if req in self.running:
            self.running.remove(req)

    def _finish(self, req: Req, finished: list[Req]) -> None:
        self.kv.release(req, cache=True)
        if req.pin:  # its prompt is in the tree now, and nothing ran in between
            req.pin_result = self.pins.pin(
                req.tokens(0, req.prompt_len), req.namespace, req.pin_ttl
            )
        req.state = ReqState.FINISHED
        self.stats.requests_finished += 1
        finished.append(req)
