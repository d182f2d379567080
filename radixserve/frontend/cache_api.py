"""Cache routes: ``POST /cache/pin`` and ``POST /cache/unpin`` (pins are listed in
``/server_info``).

A pin computes its prefix if it is not cached yet (a prefill-only request), then holds the
cached path in the tree against eviction (``scheduler/pins.py``): a system prompt every agent
sends survives bursts of other traffic.  Pinned tokens are capped by ``--max-pinned-fraction``;
a pin beyond it is a 400 that says so.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request

from radixserve.chat.messages import ApplyChatTemplateRequest
from radixserve.chat.render import ChatTemplateError, render_without_tools
from radixserve.frontend.errors import APIError
from radixserve.frontend.json_response import JSONBytesResponse
from radixserve.frontend.native_protocol import CachePinRequest
from radixserve.frontend.state import ServerState
from radixserve.runtime.tokenizer_manager import InvalidRequestError, SchedulingHints

logger = logging.getLogger(__name__)
router = APIRouter()


def prefix_ids(st: ServerState, body: CachePinRequest) -> list[int]:
    """The token ids of the body's prefix, tokenized as the generation routes would."""
    if body.input_ids is not None:
        ids, _ = st.prepare(None, body.input_ids, {"max_new_tokens": 0}, prompt_param="input_ids")
        return ids
    text, param = body.text, "text"
    if body.messages is not None:
        param = "messages"
        chat = ApplyChatTemplateRequest(
            messages=body.messages,
            add_generation_prompt=body.add_generation_prompt,
            chat_template_kwargs=body.chat_template_kwargs,
        )
        try:
            text = render_without_tools(st.tokenizer, st.args.tool_call_parser, chat)
        except ChatTemplateError as e:
            raise APIError(str(e), 400, param=e.param) from e
    ids, _ = st.prepare(text, None, {"max_new_tokens": 0}, prompt_param=param)
    return ids


@router.post("/cache/pin")
async def pin(body: CachePinRequest, request: Request) -> JSONBytesResponse:
    st: ServerState = request.app.state.server
    if body.pin_id is not None:
        raise APIError("pin_id is for /cache/unpin; give the prefix to pin", 400, param="pin_id")
    ids = prefix_ids(st, body)
    try:
        result = await st.tm.pin(ids, SchedulingHints(body.cache_salt or "", pin_ttl=body.ttl))
    except InvalidRequestError as e:
        raise APIError(str(e), 400, param=e.param) from None
    return JSONBytesResponse({"success": True, **result})


@router.post("/cache/unpin")
async def unpin(body: CachePinRequest, request: Request) -> JSONBytesResponse:
    st: ServerState = request.app.state.server
    if body.pin_id is not None:
        result = await st.tm.control("unpin", pin_id=body.pin_id)
    else:
        ids = prefix_ids(st, body)
        result = await st.tm.control("unpin", input_ids=ids, extra_key=body.cache_salt or "")
    if not result.get("unpinned"):
        raise APIError("no pin matches", 404, param="pin_id" if body.pin_id is not None else None)
    return JSONBytesResponse({"success": True, "unpinned": result["unpinned"]})


async def keep_warm(st: ServerState, ids: list[int], namespace: str, ttl: float,
                    lora: str | None = None) -> bool:
    """Pin the cached path of ``ids`` for ``ttl`` seconds, replacing the pins of exactly
    these ids that an earlier call made (so a prefix that every turn marks holds one pin
    whose TTL restarts).  The other APIs' cache hints (Anthropic's ``cache_control``, stored
    Responses) use it; a pin refused (the cap, nothing cached) is logged and is no error:
    the hint is best effort, as in the APIs that define it.  ``lora``: the adapter whose KV
    the request computed (its own namespace)."""
    await st.tm.control("unpin", input_ids=ids, extra_key=namespace, lora=lora)
    try:
        await st.tm.pin(ids, SchedulingHints(namespace, pin_ttl=ttl, lora=lora))
    except InvalidRequestError as e:
        logger.info("a cache hint's pin of %d tokens was not made: %s", len(ids), e)
        return False
    return True
