"""What the OpenAI-compatible routes (``openai_api``: completions, models; ``chat_api``: chat)
share: server state lookup, SSE framing, usage, choices of ``n``, and stream fan-in."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import StreamingResponse

from radixserve.frontend.errors import error_body
from radixserve.frontend.state import ServerState
from radixserve.ipc.messages import CacheReport
from radixserve.runtime.pieces import Piece
from radixserve.runtime.tokenizer_manager import RequestError
from radixserve.sampling import SamplingParams
from radixserve.sampling.params import to_int64

logger = logging.getLogger(__name__)
SSE_DONE = b"data: [DONE]\n\n"


def server_state(request: Request) -> ServerState:
    return request.app.state.server


def sse_event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chunk_event(head: dict[str, Any], choices: list[dict[str, Any]], body: Any,
                usage: Any = None, progress: tuple[int, int] | None = None) -> bytes:
    """One streamed chunk of an OpenAI response: ``head`` (id, object, created, model), the
    choices' deltas, and, when the client asked for it (``body.include_usage``), ``usage``: null
    until the last chunk, or with ``body.continuous_usage`` the chunk's choice's ``progress``
    (its prompt and completion tokens so far) as vLLM sends it."""
    obj = {**head, "choices": choices}
    if body.include_usage:
        if usage is None and progress is not None and body.continuous_usage:
            prompt, completion = progress
            usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                     "total_tokens": prompt + completion}
        obj["usage"] = usage
    return sse_event(obj)


def params_per_choice(params: SamplingParams, n: int) -> list[SamplingParams]:
    """n choices: distinct seeds (the user's seed + i keeps them reproducible)."""
    if n == 1:
        return [params]
    base = params.seed
    # Seeds are 64-bit: the ones after the largest wrap around to the smallest.
    return [dataclasses.replace(params, seed=None if base is None else to_int64(base + i))
            for i in range(n)]


def choice_rids(rid: str | None, count: int) -> list[str | None]:
    """The request ids of ``count`` choices: the client's ``rid`` for one, ``<rid>_<i>`` for
    several (SGLang's naming for a batch), generated ones (None) when no ``rid`` is given."""
    if rid is None:
        return [None] * count
    return [rid] if count == 1 else [f"{rid}_{i}" for i in range(count)]


def usage_dict(prompt_tokens: int, completion_tokens: int, cached: int,
               cache_report: CacheReport | None = None) -> dict[str, Any]:
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if cache_report is not None:  # return_cache_report (an extension)
        usage["cache_report"] = cache_report.to_dict()
    return usage


async def fan_in(streams: list[AsyncIterator[Piece]]) -> AsyncIterator[tuple[int, Piece]]:
    """Interleave several requests' pieces as ``(index, piece)``; an error ends everything.

    The queue is bounded: when the consumer stops reading (a slow client), the pumps stop
    too, so the backlog stays in the tokenizer manager's queues, which cut off a reader that
    stays behind (``slow_reader_timeout``)."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))

    async def pump(i: int, s: AsyncIterator[Piece]) -> None:
        try:
            async for piece in s:
                await queue.put((i, piece))
        except Exception as e:  # handed to the consumer, which raises it
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item.finished:
                remaining -= 1
            yield i, item
    finally:
        for t in tasks:
            t.cancel()


def stream_failure(e: Exception) -> tuple[str, int]:
    """What to tell the reader of a stream that failed after it started: the message and the
    HTTP status it would have had.  Logged here: the client may not be there to read it."""
    if isinstance(e, RequestError):
        logger.warning("a stream ended with an error (%d): %s", e.status, e)
        return str(e), e.status
    logger.error("a stream ended with an internal error", exc_info=e)
    return f"internal error: {e!r}", 500


def stream_error_events(e: Exception) -> list[bytes]:
    """The events that end a stream which failed after it started: OpenAI's shape
    (``{"error": {message, type, param, code}}``, which the ``openai`` client raises as
    ``APIError``), then ``[DONE]``."""
    message, status = stream_failure(e)
    return [sse_event({"error": error_body(message, status)["error"]}), SSE_DONE]


async def guarded_stream(first: bytes, rest: AsyncIterator[bytes],
                         on_error: Callable[[Exception], list[bytes]] = stream_error_events
                         ) -> AsyncIterator[bytes]:
    """``first``, then ``rest``; an error after the stream started ends it with
    ``on_error``'s events instead of a connection broken mid-chunk.  However it ends (client
    gone included), ``rest`` is closed, which aborts its requests still running."""
    try:
        yield first
        try:
            async for chunk in rest:
                yield chunk
        except Exception as e:  # not CancelledError: a client gone just stops
            for event in on_error(e):
                yield event
    finally:
        aclose = getattr(rest, "aclose", None)
        if aclose is not None:
            await aclose()


async def start_stream(gen: AsyncIterator[bytes],
                       on_error: Callable[[Exception], list[bytes]] = stream_error_events
                       ) -> StreamingResponse:
    """Run the generator to its first chunk before answering, so errors keep their status."""
    it = gen.__aiter__()
    first = await it.__anext__()
    return StreamingResponse(guarded_stream(first, it, on_error), media_type="text/event-stream")


def token_text(st: ServerState, tok: int) -> str:
    return st.tokenizer.decode([tok])
