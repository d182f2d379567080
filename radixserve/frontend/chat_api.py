"""/v1/chat/completions: the chat template, tool calls and reasoning, streamed or not.

A request goes: validate the tool fields (``parsers.plan_tools``) -> render the messages with
the chat template (natively, or in radixserve's prompted tool format) -> add the grammar that
enforces ``tool_choice`` -> generate ``n`` choices -> parse each choice's output on its own
into ``reasoning_content``, ``content`` and ``tool_calls`` (incrementally when streaming).
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request

from radixserve.chat.parsers import (
    Delta,
    ParsedMessage,
    ParseSpec,
    ReasoningDelta,
    ToolCallStart,
    ToolFormat,
    ToolPlan,
    ToolRequestError,
    openai_deltas,
    plan_tools,
    prompt_opens_reasoning,
    tool_call_grammar,
    tool_format,
)
from radixserve.chat.render import (
    ChatTemplateError,
    render_chat,
    template_kwargs,
    tool_parser,
)
from radixserve.frontend.errors import APIError
from radixserve.frontend.json_response import JSONBytesResponse
from radixserve.frontend.openai_common import (
    choice_rids,
    chunk_event,
    fan_in,
    params_per_choice,
    server_state,
    start_stream,
    token_text,
    usage_dict,
)
from radixserve.frontend.protocol import ChatCompletionRequest
from radixserve.frontend.state import ServerState, collect
from radixserve.ipc.messages import CacheReport
from radixserve.runtime.pieces import Piece, RequestMeta, merge
from radixserve.sampling import SamplingParams

router = APIRouter()


@functools.lru_cache(maxsize=8)
def _is_single_token(tokenizer: Any, text: str) -> bool:
    return text in tokenizer.get_vocab()


def _grammar_reasoning(st: ServerState, prompt: str, thinking: bool) -> str | None:
    """What a tool grammar must allow before the calls (see parsers.tool_grammar)."""
    parser = st.args.reasoning_parser
    if parser == "deepseek-r1":
        return "required"
    if parser == "qwen3" and thinking:
        return "required" if prompt_opens_reasoning(prompt) else "optional"
    return None


def _sampling(st: ServerState, body: ChatCompletionRequest, plan: ToolPlan, fmt: ToolFormat,
              prompt: str, thinking: bool) -> dict[str, Any]:
    sampling = body.sampling_dict(body.max_new_tokens)
    marker_token = fmt.marker_is_special and _is_single_token(st.tokenizer, fmt.start)
    try:
        grammar = tool_call_grammar(plan, fmt, reasoning=_grammar_reasoning(st, prompt, thinking),
                                    marker_token=marker_token)
    except ValueError as e:
        raise APIError(str(e), 400, param="tools") from e
    if grammar:
        given = body.grammar_fields()
        if given:
            raise APIError(
                f"tool_choice {plan.choice!r} is enforced by a grammar and cannot be combined with "
                f"another constraint ({', '.join(given)}); use tool_choice 'auto'",
                400,
                param="tool_choice",
            )
        sampling.update(grammar)
    if plan.parses and fmt.marker_is_special and body.skip_special_tokens is None:
        sampling["skip_special_tokens"] = False  # the parser must see the marker token
    return sampling


def _chat_logprobs(
    st: ServerState, ids: list[int], lps: list[float], tops: list[Any]
) -> dict[str, Any]:
    content = []
    for j, (tok, lp) in enumerate(zip(ids, lps, strict=False)):
        s = token_text(st, tok)
        alts = tops[j] if j < len(tops) and tops[j] else []
        content.append({
            "token": s, "logprob": lp, "bytes": list(s.encode()),
            "top_logprobs": [
                {"token": (a := token_text(st, int(t))), "logprob": v, "bytes": list(a.encode())}
                for t, v in alts
            ],
        })
    return {"content": content}


def _message(spec: ParseSpec, text: str) -> tuple[dict[str, Any], bool]:
    """The assistant message for one choice's output, and whether it holds tool calls."""
    if not spec.active:
        return {"role": "assistant", "content": text}, False
    parsed: ParsedMessage = spec.new_parser().parse(text)
    msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if spec.reasoning_parser:
        msg["reasoning_content"] = parsed.reasoning_content
    if parsed.tool_calls:
        msg["tool_calls"] = [{"id": cid, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}}
                             for cid, c in parsed.tool_calls]
    elif msg["content"] is None:
        msg["content"] = ""
    return msg, bool(parsed.tool_calls)


def _hold_reasoning(pieces: list[Delta], held: list[str], finished: bool) -> list[Delta]:
    """``pieces`` with their reasoning deltas held back in ``held`` until something else
    follows (or the choice finishes): then the whole reasoning goes first, as one delta."""
    out: list[Delta] = []
    for p in pieces:
        if isinstance(p, ReasoningDelta):
            held.append(p.text)
            continue
        if held:
            out.append(ReasoningDelta("".join(held)))
            held.clear()
        out.append(p)
    if finished and held:
        out.append(ReasoningDelta("".join(held)))
        held.clear()
    return out


def _finish_reason(meta: RequestMeta, has_calls: bool) -> str | None:
    reason = meta.finish_type
    return "tool_calls" if has_calls and reason == "stop" else reason


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    st = server_state(request)
    st.check_model(body.model)
    call = _prepare_chat(st, body)
    if not body.stream:
        return await _chat_response(call, request)
    return await start_stream(_chat_chunks(call))


@dataclass
class _ChatCall:
    """One chat request, rendered and validated: what its choices generate from."""

    st: ServerState
    body: ChatCompletionRequest
    ids: list[int]
    choice_params: list[SamplingParams]
    spec: ParseSpec
    cid: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def streams(self, stream: bool) -> list[AsyncIterator[Piece]]:
        rids = choice_rids(self.body.rid, len(self.choice_params))
        hints = self.body.hints(len(rids))
        return [self.st.stream(self.ids, p, stream=stream, logprob=self.body.logprobs,
                               top_n=self.body.top_logprobs or 0, rid=rid, hints=h)
                for p, rid, h in zip(self.choice_params, rids, hints, strict=True)]

    def chunk(self, choices: list[dict[str, Any]], usage: Any = None) -> bytes:
        head = {"id": self.cid, "object": "chat.completion.chunk", "created": self.created,
                "model": self.st.model_name}
        return chunk_event(head, choices, self.body.include_usage, usage)


def _prepare_chat(st: ServerState, body: ChatCompletionRequest) -> _ChatCall:
    """Plan the tools, render the prompt with the chat template, set up the output parsing,
    validate the sampling values; APIError (400) naming the field at fault."""
    try:
        plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    except ToolRequestError as e:
        raise APIError(str(e), 400, param=e.param) from e
    parser = tool_parser(st.tokenizer, st.args.tool_call_parser)
    fmt = tool_format(parser)
    try:
        kwargs = template_kwargs(st.tokenizer, body.chat_template_kwargs)
        prompt = render_chat(st.tokenizer, body.messages, parser=parser, offered=plan.offered,
                             add_generation_prompt=body.add_generation_prompt,
                             continue_final_message=body.continue_final_message, kwargs=kwargs)
    except ChatTemplateError as e:
        raise APIError(str(e), 400, param=e.param) from e
    thinking = kwargs.get("enable_thinking") is not False
    spec = ParseSpec(
        tool_format=fmt if plan.parses else None,
        tool_names=frozenset(plan.names) if plan.parses else None,
        max_calls=None if plan.parallel else 1,
        reasoning_parser=st.args.reasoning_parser if body.separate_reasoning else None,
        prompt_opened=prompt_opens_reasoning(prompt),
        thinking=thinking,
    )
    sampling = _sampling(st, body, plan, fmt, prompt, thinking)
    ids, params = st.prepare(prompt, None, sampling, check_total=True, prompt_param="messages")
    return _ChatCall(st, body, ids, params_per_choice(params, body.n), spec)


async def _chat_response(call: _ChatCall, request: Request) -> JSONBytesResponse:
    st, body = call.st, call.body
    results = await asyncio.gather(*[collect(s, request) for s in call.streams(False)])
    merged = [merge(r) for r in results]
    choices = []
    for i, r in enumerate(merged):
        msg, has_calls = _message(call.spec, r.text)
        choices.append({
            "index": i, "message": msg,
            "logprobs": (
                _chat_logprobs(st, r.output_ids, r.logprobs, r.top_logprobs)
                if body.logprobs else None
            ),
            "finish_reason": _finish_reason(r.meta, has_calls),
        })
    usage = usage_dict(len(call.ids), sum(r.meta.completion_tokens for r in merged),
                       merged[0].meta.cached_tokens, merged[0].meta.cache_report)
    return JSONBytesResponse({"id": call.cid, "object": "chat.completion", "created": call.created,
                              "model": st.model_name, "choices": choices, "usage": usage})


async def _chat_chunks(call: _ChatCall) -> AsyncIterator[bytes]:
    st, body, spec, chunk = call.st, call.body, call.spec, call.chunk
    n = len(call.choice_params)
    parsers = [spec.new_parser() for _ in range(n)]
    # stream_reasoning=false: each choice's reasoning so far, sent in one delta once it ends.
    reasoning: list[list[str]] | None = None if body.stream_reasoning else [[] for _ in range(n)]
    has_calls = [False] * n
    # Per choice, the logprobs of tokens whose text the parser still holds back: they
    # ride on the next chunk that carries a delta.
    held: list[tuple[list[int], list[float], list[Any]]] = [([], [], []) for _ in range(n)]
    started = set()
    completion, cached = 0, 0
    report: CacheReport | None = None
    async for i, piece in fan_in(call.streams(True)):
        if i not in started:
            started.add(i)
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}])
        meta, finished = piece.meta, piece.finished
        if spec.active:
            pieces = parsers[i].feed(piece.text) + (parsers[i].finish() if finished else [])
            if reasoning is not None:
                pieces = _hold_reasoning(pieces, reasoning[i], finished)
            has_calls[i] |= any(isinstance(p, ToolCallStart) for p in pieces)
            deltas = openai_deltas(pieces)
        else:
            deltas = [{"content": piece.text}] if piece.text else []
        if body.logprobs:
            h = held[i]
            h[0].extend(piece.output_ids)
            h[1].extend(piece.logprobs)
            h[2].extend(piece.top_logprobs)
        if finished and not deltas:
            deltas = [{}]
        for k, delta in enumerate(deltas):
            lp = None
            if body.logprobs and k == 0:
                lp = _chat_logprobs(st, *held[i])
                held[i] = ([], [], [])
            last = finished and k == len(deltas) - 1
            yield chunk([{"index": i, "delta": delta, "logprobs": lp,
                          "finish_reason": _finish_reason(meta, has_calls[i]) if last else None}])
        if finished:
            completion += meta.completion_tokens
            if i == 0:
                cached, report = meta.cached_tokens, meta.cache_report
    if body.include_usage:
        yield chunk([], usage_dict(len(call.ids), completion, cached, report))
    yield b"data: [DONE]\n\n"
