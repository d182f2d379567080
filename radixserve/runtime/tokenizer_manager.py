"""Front-end side of the processes: tokenizes, validates, sends requests, routes replies.

Runs on one asyncio loop (the HTTP server's, or the Engine's background loop).  Every
request has a queue fed by the receive task; exactly one terminal item ends it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from radixserve.ipc import messages as m
from radixserve.ipc.messages import CacheReport
from radixserve.runtime.pieces import Piece, RequestMeta
from radixserve.sampling import SamplingParams, draw_seed
from radixserve.validation import check_input_ids, check_logprob_start_len, is_text

logger = logging.getLogger(__name__)


class RequestError(RuntimeError):
    """The server answered a request with an error (``status`` is an HTTP-like code;
    ``param`` the request field at fault, when one is)."""

    def __init__(self, message: str, status: int = 500, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


class InvalidRequestError(RequestError, ValueError):
    """The request is invalid (status 400): a bad field, or a grammar the scheduler cannot
    compile; a ``ValueError`` for Python callers, a 400 for HTTP ones."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message, status, param)


def request_error(message: str, status: int) -> RequestError:
    if 400 <= status < 500:  # the request's fault (a bad field, an adapter not loaded)
        return InvalidRequestError(message, status)
    return RequestError(message, status)


MAX_EXTRA_KEY_CHARS = 1024
PRIORITY_LIMIT = 2**31  # |priority| below this


@dataclass(frozen=True)
class SchedulingHints:
    """How the scheduler treats a request beyond its prompt and sampling.

    ``extra_key``: the cache namespace (OpenAI extension ``cache_salt``, native ``extra_key``):
    cached prefixes are shared only between requests with the same key; "" (none) is a
    namespace of its own.  ``priority``: the level used by ``--schedule-policy priority``.
    ``pin``: pin the prompt's cached path when the request finishes (``POST /cache/pin``), for
    ``pin_ttl`` seconds (None: until unpinned).  ``cache_report``: ``meta_info.cache_report``
    says where the prompt's prefix match stopped and what the cache held from there.
    """

    extra_key: str = ""
    priority: int = 0
    pin: bool = False
    pin_ttl: float | None = None
    cache_report: bool = False
    # SGLang's bootstrap fields (smg's PD mode): the prefill worker and the request's room
    bootstrap: m.Bootstrap | None = None
    lora: str | None = None  # the LoRA adapter's name (None: the base model)

    def __post_init__(self) -> None:
        if not isinstance(self.extra_key, str) or len(self.extra_key) > MAX_EXTRA_KEY_CHARS:
            raise InvalidRequestError(f"cache_salt / extra_key must be a string of at most "
                                      f"{MAX_EXTRA_KEY_CHARS} characters", param="extra_key")
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            raise InvalidRequestError(f"lora_path must be an adapter's name, got {self.lora!r}",
                                      param="lora_path")
        if (
            isinstance(self.priority, bool)
            or not isinstance(self.priority, int)
            or abs(self.priority) >= PRIORITY_LIMIT
        ):
            raise InvalidRequestError(
                f"priority must be an integer with |priority| < 2**31, got {self.priority!r}",
                param="priority",
            )
        if self.pin_ttl is not None and not (
            isinstance(self.pin_ttl, (int, float)) and 0 < self.pin_ttl < 1e9
        ):
            raise InvalidRequestError(
                f"ttl must be a positive number of seconds, got {self.pin_ttl!r}", param="ttl"
            )


def decode_divergence(tokenizer: Any, report: dict[str, Any]) -> dict[str, Any]:
    """A cache report or near-miss with its token ids decoded: ``context`` (the text just
    before the stop), ``request_next`` and ``cached_next`` (the two ways on from it)."""
    out = dict(report)
    for ids_key, text_key in (("before_ids", "context"), ("request_ids", "request_next"),
                              ("cached_ids", "cached_next")):
        if ids_key in out:
            out[text_key] = tokenizer.decode(out[ids_key], skip_special_tokens=False)
    return out


# A stream whose consumer leaves more pieces than this unread is "behind"; behind for longer
# than ``slow_reader_timeout`` seconds, it is cut off (its backlog dropped, the request aborted).
STREAM_BACKLOG_PIECES = 64


@dataclass
class _ReqState:
    rid: str  # the client's id (``meta_info.id``, ``/abort_request``)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    created: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    behind_since: float | None = None  # when the unread backlog last went over the limit
    cut_off: bool = False


class TokenizerManager:
    """Requests are keyed by an internal id, unique per submission, so that a client's
    ``rid`` reused after an abort can never receive the earlier request's late replies;
    ``by_rid`` maps the client's ids of running requests to them (one running request
    per client id)."""

    def __init__(
        self,
        tokenizer: Any,
        model_info: m.ModelInfo,
        scheduler_addr: str,
        frontend_addr: str,
        slow_reader_timeout: float = 30.0,
    ) -> None:
        self.tokenizer = tokenizer
        self.info = model_info
        self.scheduler_addr = scheduler_addr
        self.frontend_addr = frontend_addr
        self.slow_reader_timeout = slow_reader_timeout
        self.states: dict[str, _ReqState] = {}  # internal id -> state
        self.by_rid: dict[str, str] = {}  # client's rid -> internal id
        self.control_waiters: dict[str, asyncio.Future] = {}
        self._recv_task: asyncio.Task | None = None
        self.dead_reason: str | None = None

    async def start(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.ctx.setsockopt(zmq.LINGER, 0)
        self.ctx.setsockopt(zmq.SNDHWM, 0)
        self.send_sock = self.ctx.socket(zmq.PUSH)
        self.send_sock.connect(self.scheduler_addr)
        self.recv_sock = self.ctx.socket(zmq.PULL)
        self.recv_sock.bind(self.frontend_addr)
        self._recv_task = asyncio.create_task(self._recv_loop())

    async def close(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
        self.ctx.destroy(linger=0)

    # ---- requests ----------------------------------------------------------------------
    def prepare(
        self,
        prompt: str | None,
        input_ids: list[int] | None,
        sampling_params: dict[str, Any] | None,
        logprob_start_len: int = -1,
    ) -> tuple[list[int], SamplingParams]:
        """Tokenize and validate (``logprob_start_len`` against the prompt's length too);
        raises ValueError with a clear message."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt (text) and input_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError("prompt must be a string")
            if prompt == "":
                raise ValueError("the prompt is empty")
            if not is_text(prompt):
                raise ValueError("the prompt is not valid Unicode text (it holds a lone surrogate)")
            input_ids = self.tokenizer.encode(prompt, add_special_tokens=False) or []
            if not input_ids:
                raise ValueError("the prompt is empty after tokenization")
        ids = check_input_ids(
            input_ids, self.info.vocab_size, self.info.context_length, self.info.max_total_tokens
        )
        check_logprob_start_len(logprob_start_len, len(ids))
        params = SamplingParams.from_dict(sampling_params)
        params.validate_for_model(self.info.vocab_size)
        return ids, params

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        stream: bool = False,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        rid: str | None = None,
        logprob_start_len: int = -1,
        hints: SchedulingHints | None = None,
    ) -> AsyncIterator[Piece]:
        """Yield the request's :class:`Piece` s (deltas), the last one ``finished``.

        With ``return_logprob``, pieces carry ``logprobs`` / ``top_logprobs`` of their output
        tokens, and with ``logprob_start_len >= 0`` the first one also ``input_logprobs`` /
        ``input_top_logprobs`` (prompt positions ``[logprob_start_len, prompt_len)``, None at
        position 0).  ``input_ids`` and ``logprob_start_len`` come checked from :meth:`prepare`.
        ``hints``: the cache namespace and priority level.
        Cancelling the consumer (client gone) aborts the request in the scheduler.
        """
        hints = hints or SchedulingHints()
        if self.dead_reason:
            raise RequestError(self.dead_reason, 503)
        key = uuid.uuid4().hex
        rid = key if rid is None else rid
        if rid in self.by_rid:
            raise InvalidRequestError(f"a request with rid {rid!r} is already running", param="rid")
        state = _ReqState(rid)
        self.states[key] = state
        self.by_rid[rid] = key
        msg = m.GenerateReq(
            rid=key,
            input_ids=input_ids,
            sampling_params=params,
            seed=params.seed if params.seed is not None else draw_seed(),
            return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num,
            stream=stream,
            logprob_start_len=logprob_start_len,
            extra_key=hints.extra_key,
            priority=hints.priority,
            pin=hints.pin,
            pin_ttl=None if hints.pin_ttl is None else float(hints.pin_ttl),
            return_cache_report=hints.cache_report,
            bootstrap=self._bootstrap(hints),
            lora=hints.lora,
        )
        finished = False  # the scheduler sent this request's terminal row
        try:
            await self.send_sock.send(m.encode(msg))
            while not finished:
                item = await state.queue.get()
                if isinstance(item, RequestError):
                    # Raised by the scheduler (the request is gone there) or on the way
                    # (detokenizer, slow reader, a dead process): the abort below makes sure
                    # the scheduler stops it; it ignores ids it does not hold.
                    raise item
                finished = item.finished
                yield item
        finally:
            self.states.pop(key, None)
            self.by_rid.pop(rid, None)
            if not finished and not self.dead_reason:
                await self.send_sock.send(m.encode(m.AbortReq(rid=key)))

    def _bootstrap(self, hints: SchedulingHints) -> m.Bootstrap | None:
        """The request's bootstrap fields, checked against what this worker is."""
        if hints.bootstrap is None:
            return None
        if self.info.disaggregation_mode == "null":
            raise InvalidRequestError(
                "bootstrap_room asks for prefill-decode disaggregation, and this worker prefills "
                "and decodes itself: start a pair with --disaggregation-mode prefill and decode",
                param="bootstrap_room",
            )
        if self.info.disaggregation_mode == "decode" and not hints.bootstrap.host:
            raise InvalidRequestError(
                "a decode worker needs bootstrap_host: the prefill worker to take the KV from",
                param="bootstrap_host",
            )
        return hints.bootstrap

    async def abort(self, rid: str) -> bool:
        """Abort the running request with the client's id ``rid``; False if there is none."""
        key = self.by_rid.get(rid)
        if key is None:
            return False
        await self.send_sock.send(m.encode(m.AbortReq(rid=key)))
        return True

    async def pin(self, ids: list[int], hints: SchedulingHints) -> dict[str, Any]:
        """Compute the prompt (prefill only, cached) and pin its cached path: the pin's
        description (``pin_id``, ``tokens``, ``expires_in``); InvalidRequestError when refused."""
        params = SamplingParams.from_dict({"max_new_tokens": 0})
        result = None
        async for piece in self.generate(ids, params, hints=dataclasses.replace(hints, pin=True)):
            result = piece.meta.pin
        if result is None or result.error is not None:
            raise InvalidRequestError(
                result.error if result else "the scheduler did not pin the prompt"
            )
        return result.to_dict()

    async def control(self, command: str, timeout: float = 30.0, **args: Any) -> dict[str, Any]:
        if self.dead_reason:
            raise RequestError(self.dead_reason, 503)
        cid = uuid.uuid4().hex
        fut = asyncio.get_running_loop().create_future()
        self.control_waiters[cid] = fut
        try:
            await self.send_sock.send(m.encode(m.control_request(cid, command, **args)))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.control_waiters.pop(cid, None)

    def fail_all(self, reason: str) -> None:
        """A process died: every waiting request gets an error instead of hanging."""
        self.dead_reason = reason
        for state in self.states.values():
            state.queue.put_nowait(RequestError(reason, 503))
        for fut in self.control_waiters.values():
            if not fut.done():
                fut.set_exception(RequestError(reason, 503))

    # ---- replies -----------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        while True:
            data = await self.recv_sock.recv()
            try:
                msg = m.decode(data)
            except ValueError as e:
                logger.error("front end dropped a malformed message: %s", e)
                continue
            if isinstance(msg, m.StrOut):
                self._route_str(msg)
            elif isinstance(msg, m.ErrorOut):
                state = self.states.get(msg.rid)
                if state is not None and not state.cut_off:
                    state.queue.put_nowait(request_error(msg.message, msg.status))
            elif isinstance(msg, m.ControlOut):
                fut = self.control_waiters.get(msg.cid)
                if fut is not None and not fut.done():
                    fut.set_result(msg.result)

    def _route_str(self, msg: m.StrOut) -> None:
        now = time.perf_counter()
        for i, key in enumerate(msg.rids):
            state = self.states.get(key)
            if state is None or state.cut_off:
                continue  # aborted by the client already
            row = msg.meta[i]
            if state.first_token_at is None and msg.new_ids[i]:
                state.first_token_at = now - row.since_first_token
            finished = msg.finished[i]
            meta = RequestMeta.of_row(
                state.rid, row, finished,
                ttft=None if state.first_token_at is None else state.first_token_at - state.created,
                e2e_latency=None if finished is None else now - state.created)
            if row.cache_report is not None:
                meta.cache_report = CacheReport(
                    **decode_divergence(self.tokenizer, row.cache_report.to_dict())
                )
            item = Piece(msg.text_deltas[i], msg.new_ids[i], meta, finished is not None)
            if msg.logprobs and msg.logprobs[i] is not None:
                item.logprobs = msg.logprobs[i]
                item.top_logprobs = (msg.top_logprobs[i] if msg.top_logprobs else None) or []
            if msg.input_logprobs and msg.input_logprobs[i] is not None:
                item.input_logprobs = msg.input_logprobs[i]
                item.input_top_logprobs = msg.input_top_logprobs[i]
            state.queue.put_nowait(item)
            self._check_backlog(key, state, now)

    def _check_backlog(self, key: str, state: _ReqState, now: float) -> None:
        """Bound what a slow stream reader can pile up: a reader behind for too long loses
        its backlog and gets an error, and the request is aborted in the scheduler."""
        if state.queue.qsize() <= STREAM_BACKLOG_PIECES:
            state.behind_since = None
            return
        if state.behind_since is None:
            state.behind_since = now
            return
        if now - state.behind_since < self.slow_reader_timeout:
            return
        while not state.queue.empty():
            state.queue.get_nowait()
        state.cut_off = True
        logger.warning("request %s: the client read nothing for %.0f s; aborted", state.rid,
                       now - state.behind_since)
        state.queue.put_nowait(RequestError(
            f"the client fell more than {STREAM_BACKLOG_PIECES} pieces behind the stream for "
            f"{self.slow_reader_timeout:g} s; the request was aborted", 408))
        self.send_sock.send(m.encode(m.AbortReq(rid=key)))
