"""What the HTTP routes share: server state, request submission, disconnect-aware collection,
per-request metrics and the one log line per request."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from radixserve.config import ServerArgs
from radixserve.frontend.errors import APIError, ClientGone
from radixserve.frontend.loads import ThroughputWindow
from radixserve.frontend.metrics import Metrics
from radixserve.frontend.response_store import ResponseStore
from radixserve.ipc.messages import ModelInfo
from radixserve.runtime.client import RuntimeClient
from radixserve.runtime.pieces import Piece
from radixserve.runtime.tokenizer_manager import SchedulingHints, TokenizerManager
from radixserve.sampling import SamplingParams
from radixserve.validation import FieldError

logger = logging.getLogger("radixserve.requests")
DISCONNECT_POLL_S = 0.1


# Model names that name no model: SGLang's default, and what SGLang's router sends for a chat
# request that gave none.
UNNAMED_MODELS = ("default", "unknown")
# Sampling parameters whose OpenAI request field has another name.
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


def _error_param(e: ValueError, openai: bool, prompt_param: str | None) -> str | None:
    """The request field an error is about (``FieldError.field``): a sampling parameter
    (``top_k`` on the OpenAI routes, ``sampling_params.top_k`` on the native one), the sampling
    parameters as a whole, ``logprob_start_len``, or else the prompt."""
    field = e.field if isinstance(e, FieldError) else None
    if field is None:
        return prompt_param
    if field == "sampling_params":
        return None if openai else "sampling_params"
    if field == "logprob_start_len":
        return field
    return _OPENAI_NAMES.get(field, field) if openai else f"sampling_params.{field}"


@dataclass
class ServerState:
    args: ServerArgs
    client: RuntimeClient
    info: ModelInfo
    model_name: str
    metrics: Metrics = field(default_factory=Metrics)
    started_at: float = field(default_factory=time.time)
    shutting_down: bool = False
    pids: dict[str, int] = field(default_factory=dict)  # scheduler / detokenizer processes
    model_path: str = ""  # the folder (or GGUF file) the model was loaded from
    # Generation requests in flight (sent and not finished) and their tokens so far (prompt
    # plus output): the load a router reads from /get_load.
    inflight_requests: int = 0
    inflight_tokens: int = 0
    # /v1/loads' gen_throughput
    gen_rate: ThroughputWindow = field(default_factory=ThroughputWindow)
    # stored Responses (/v1/responses), sized by the settings
    responses: ResponseStore = field(init=False)
    # the LoRA adapters loaded {name: folder}, kept as /load_lora_adapter changes them
    loras: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.loras = dict(self.info.lora_adapters)
        self.responses = ResponseStore(self.args.response_store_size,
                                       self.args.response_store_bytes)

    @property
    def tm(self) -> TokenizerManager:
        return self.client.tm

    @property
    def tokenizer(self) -> Any:
        return self.client.tokenizer

    def check_model(self, name: str | None, lora_path: str | None = None) -> str | None:
        """The LoRA adapter a request names (None: the base model), or an APIError.

        ``model`` may name the served model, an adapter (vLLM's convention) or ``BASE:NAME``
        (SGLang's); ``lora_path`` (SGLang's field) names an adapter too.  An adapter that is not
        loaded is a 404; naming one where LoRA is off, a 400."""
        lora = None
        if name is not None and name not in (self.model_name, *UNNAMED_MODELS):
            base, sep, adapter = name.partition(":")
            if name in self.loras:
                lora = name
            elif sep and base == self.model_name and adapter in self.loras:
                lora = adapter
            else:
                served = ", ".join([repr(self.model_name), *map(repr, self.loras)])
                raise APIError(f"the model '{name}' does not exist; this server serves {served}",
                               404, param="model", code="model_not_found")
        if lora_path is not None:
            if not self.info.lora_enabled:
                raise APIError("this server serves no LoRA adapters (start it with "
                               "--enable-lora or --lora-paths)", 400, param="lora_path")
            if lora_path not in self.loras:
                raise APIError(f"the LoRA adapter '{lora_path}' is not loaded", 404,
                               param="lora_path", code="model_not_found")
            if lora is not None and lora != lora_path:
                raise APIError(f"model names the adapter '{lora}' and lora_path "
                               f"'{lora_path}'", 400, param="lora_path")
            lora = lora_path
        return lora

    def adapter_of(self, name: str | None) -> str | None:
        """The LoRA adapter ``model`` names, or None (the base model, or an adapter unloaded
        since the request was checked): for what follows a request, such as its pins."""
        try:
            return self.check_model(name)
        except APIError:
            return None

    def prepare(self, prompt: str | None, input_ids: list[int] | None,
                sampling: dict[str, Any] | None, check_total: bool = False,
                logprob_start_len: int = -1,
                prompt_param: str | None = None) -> tuple[list[int], SamplingParams]:
        """Tokenize and validate one prompt; with ``check_total`` (the OpenAI routes' contract)
        the prompt plus the requested max tokens must fit the context, and a request that
        gives no max tokens may generate up to the context length, as in OpenAI and vLLM.
        A bad value is an APIError whose ``param`` is the request's field: the OpenAI name of
        a sampling parameter on those routes, else ``prompt_param``."""
        try:
            return self._prepare(prompt, input_ids, sampling, check_total, logprob_start_len)
        except APIError:
            raise
        except ValueError as e:
            raise APIError(str(e), 400, param=_error_param(e, check_total, prompt_param)) from e

    def _prepare(self, prompt: str | None, input_ids: list[int] | None,
                 sampling: dict[str, Any] | None, check_total: bool,
                 logprob_start_len: int) -> tuple[list[int], SamplingParams]:
        if self.shutting_down:
            raise APIError("the server is shutting down", 503)
        ctx = self.info.context_length
        up_to_context = check_total and (sampling or {}).get("max_new_tokens") is None
        if up_to_context:  # an upper bound until the prompt's length is known
            sampling = {**(sampling or {}), "max_new_tokens": ctx}
        ids, params = self.tm.prepare(prompt, input_ids, sampling, logprob_start_len)
        if up_to_context:
            room = ctx - len(ids)
            if room < 1:
                raise APIError(
                    f"this model's context length is {ctx} tokens; the prompt has {len(ids)}",
                    400, param="messages",
                )
            try:
                params = dataclasses.replace(params, max_new_tokens=room)
            except ValueError as e:
                raise APIError(str(e), 400) from e
            return ids, params
        if (check_total and sampling and sampling.get("max_new_tokens")
                and len(ids) + params.max_new_tokens > ctx):
            raise APIError(
                f"this model's context length is {ctx} tokens; the request asks for "
                f"{len(ids)} prompt tokens + {params.max_new_tokens} completion tokens",
                400, param="max_tokens",
            )
        return ids, params

    async def stream(self, ids: list[int], params: SamplingParams, *, stream: bool,
                     logprob: bool = False, top_n: int = 0, rid: str | None = None,
                     logprob_start_len: int = -1,
                     hints: SchedulingHints | None = None) -> AsyncIterator[Piece]:
        """The request's pieces, with metrics and the per-request log line."""
        rid = rid or uuid.uuid4().hex
        t0 = time.perf_counter()
        last = None
        ttft = None
        tokens = len(ids)  # this request's part of inflight_tokens
        self.inflight_requests += 1
        self.inflight_tokens += tokens
        try:
            async for piece in self.tm.generate(ids, params, stream, logprob, top_n, rid=rid,
                                                logprob_start_len=logprob_start_len, hints=hints):
                now = time.perf_counter()
                n = len(piece.output_ids)
                tokens += n
                self.inflight_tokens += n
                if n and ttft is None:
                    # The first token's own time, also when it arrives with others (non-streaming
                    # requests, stream_interval > 1): the tokens after it are spread over the rest.
                    ttft = piece.meta.ttft if piece.meta.ttft is not None else now - t0
                    self.metrics.on_first_token(ttft)
                    if n > 1:
                        self.metrics.on_tokens(now - t0 - ttft, n - 1)
                elif n and last is not None:
                    self.metrics.on_tokens(now - last, n)
                if n:
                    last = now
                if piece.finished:
                    meta = piece.meta
                    total = now - t0
                    self.metrics.on_finish(meta, total)
                    logger.info(
                        "request %s: prompt %d, cached %d, completion %d tokens, "
                        "ttft %.3f s, total %.3f s, %s",
                        rid, meta.prompt_tokens, meta.cached_tokens, meta.completion_tokens,
                        ttft if ttft is not None else total, total, meta.finish_type,
                    )
                yield piece
        finally:
            self.inflight_requests -= 1
            self.inflight_tokens -= tokens

async def collect(pieces: AsyncIterator[Piece], request: Request) -> list[Piece]:
    """All pieces of a non-streaming request; aborts it if the client disconnects first."""

    async def gather() -> list[Piece]:
        return [p async for p in pieces]

    task = asyncio.ensure_future(gather())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
