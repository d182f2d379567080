"""What the OpenAI-compatible routes (``openai_api``: completions, models; ``chat_api``: chat)
share: server state lookup, SSE framing, usage, choices of ``n``, and stream fan-in."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import StreamingResponse

from radixserve.frontend.serving import ServerState
from radixserve.sampling import SamplingParams


def server_state(request: Request) -> ServerState:
    return request.app.state.server


def sse_event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def finish_type(meta: dict[str, Any]) -> str | None:
    reason = meta.get("finish_reason")
    return None if reason is None else reason.get("type")


def params_per_choice(params: SamplingParams, n: int) -> list[SamplingParams]:
    """n choices: distinct seeds (the user's seed + i keeps them reproducible)."""
    if n == 1:
        return [params]
    base = params.seed
    return [dataclasses.replace(params, seed=None if base is None else base + i) for i in range(n)]


def usage_dict(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def fan_in(streams: list[AsyncIterator[dict[str, Any]]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several requests' pieces as ``(index, piece)``; an error ends everything."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: AsyncIterator[dict[str, Any]]) -> None:
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
            if item["finished"]:
                remaining -= 1
            yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def start_stream(gen: AsyncIterator[bytes]) -> StreamingResponse:
    """Run the generator to its first chunk before answering, so errors keep their status."""
    it = gen.__aiter__()
    first = await it.__anext__()

    async def body() -> AsyncIterator[bytes]:
        yield first
        async for chunk in it:
            yield chunk

    return StreamingResponse(body(), media_type="text/event-stream")


def token_text(st: ServerState, tok: int) -> str:
    return st.tokenizer.decode([tok])
