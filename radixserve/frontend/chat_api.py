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
from pydantic import ValidationError

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
from radixserve.frontend.errors import APIError, describe_validation
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
from radixserve.validation import is_text

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
    st.check_model(body.model, body.lora_path)
    call = prepare_chat(st, body)
    if not body.stream:
        return await _chat_response(call, request)
    return await start_stream(_chat_chunks(call))


@dataclass
class ChatCall:
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
        hints = self.body.hints(len(rids),
                                lora=self.st.check_model(self.body.model, self.body.lora_path))
        return [self.st.stream(self.ids, p, stream=stream, logprob=self.body.logprobs,
                               top_n=self.body.top_logprobs or 0, rid=rid, hints=h)
                for p, rid, h in zip(self.choice_params, rids, hints, strict=True)]

    def chunk(self, choices: list[dict[str, Any]], usage: Any = None,
              so_far: int | None = None) -> bytes:
        """A chunk of the stream; ``so_far``: its choice's completion tokens as of it."""
        head = {"id": self.cid, "object": "chat.completion.chunk", "created": self.created,
                "model": self.st.model_name}
        progress = None if so_far is None else (len(self.ids), so_far)
        return chunk_event(head, choices, self.body, usage, progress)


@dataclass
class _Rendered:
    """A chat request's prompt text and what rendering it decided."""

    prompt: str
    plan: ToolPlan
    fmt: ToolFormat
    thinking: bool


def _render(st: ServerState, body: ChatCompletionRequest) -> _Rendered:
    """Plan the tools and render the prompt with the chat template; APIError (400) naming the
    field at fault."""
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
    return _Rendered(prompt, plan, fmt, kwargs.get("enable_thinking") is not False)


def chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """Another API's request converted to chat fields, validated as ``/v1/chat/completions``
    validates its body (APIError 400 naming the chat field at fault)."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        message, param = describe_validation(e.errors())
        raise APIError(message, 400, param=param) from None


def prompt_ids(st: ServerState, body: ChatCompletionRequest) -> list[int]:
    """The token ids of the prompt the chat route renders for ``body``, whatever its length
    (nothing is generated from them: counting is no request to the model)."""
    prompt = _render(st, body).prompt
    if not is_text(prompt):
        raise APIError("the messages are not valid Unicode text (they hold a lone surrogate)",
                       400, param="messages")
    return st.tokenizer.encode(prompt, add_special_tokens=False)


@dataclass(frozen=True)
class KnownPrefix:
    """Token ids the model already holds for the start of a conversation (an earlier turn's
    prompt and generated answer) and the text they decode to."""

    ids: list[int]
    text: str


def known_prefix(st: ServerState, ids: list[int]) -> KnownPrefix:
    return KnownPrefix(ids, _decode(st, ids))


def _decode(st: ServerState, ids: list[int]) -> str:
    return st.tokenizer.decode(ids, skip_special_tokens=False,
                               clean_up_tokenization_spaces=False)


def _reused_ids(st: ServerState, prompt: str, known: KnownPrefix) -> list[int] | None:
    """``prompt``'s token ids starting with the longest run of ``known.ids`` whose text
    starts ``prompt`` (the rest tokenized as usual), or None when not even the first token's
    does, or when the ids do not decode to ``prompt`` (a tokenizer whose decoding of a prefix
    is not a prefix of the text).  The generated ids are what the radix tree holds;
    re-tokenizing their text may merge or split tokens differently and miss the cache from
    there on."""
    ids, text = known.ids, known.text
    if not prompt.startswith(text):  # the template rendered the answer otherwise: search
        lo, hi = 0, len(ids)  # the longest n with decode(ids[:n]) a prefix of prompt
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if prompt.startswith(_decode(st, ids[:mid])):
                lo = mid
            else:
                hi = mid - 1
        ids, text = ids[:lo], _decode(st, ids[:lo])
        if not ids or not prompt.startswith(text):
            return None
    rest = prompt[len(text):]
    out = ids + (st.tokenizer.encode(rest, add_special_tokens=False) if rest else [])
    return out if _decode(st, out) == prompt else None


def prepare_chat(st: ServerState, body: ChatCompletionRequest,
                 known: KnownPrefix | None = None) -> ChatCall:
    """Plan the tools, render the prompt with the chat template, set up the output parsing,
    validate the sampling values; APIError (400) naming the field at fault.  With ``known``,
    the prompt's ids start with as many of its ids as render the prompt's start."""
    r = _render(st, body)
    spec = ParseSpec(
        tool_format=r.fmt if r.plan.parses else None,
        tool_names=frozenset(r.plan.names) if r.plan.parses else None,
        max_calls=None if r.plan.parallel else 1,
        reasoning_parser=st.args.reasoning_parser if body.separate_reasoning else None,
        prompt_opened=prompt_opens_reasoning(r.prompt),
        thinking=r.thinking,
    )
    sampling = _sampling(st, body, r.plan, r.fmt, r.prompt, r.thinking)
    reused = _reused_ids(st, r.prompt, known) if known is not None and is_text(r.prompt) else None
    prompt, given = (None, reused) if reused is not None else (r.prompt, None)
    ids, params = st.prepare(prompt, given, sampling, check_total=True, prompt_param="messages")
    return ChatCall(st, body, ids, params_per_choice(params, body.n), spec)


async def _chat_response(call: ChatCall, request: Request) -> JSONBytesResponse:
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


async def _chat_chunks(call: ChatCall) -> AsyncIterator[bytes]:
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
                          "logprobs": None, "finish_reason": None}], so_far=0)
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
                          "finish_reason": _finish_reason(meta, has_calls[i]) if last else None}],
                        so_far=meta.completion_tokens)
        if finished:
            completion += meta.completion_tokens
            if i == 0:
                cached, report = meta.cached_tokens, meta.cache_report
    if body.include_usage:
        yield chunk([], usage_dict(len(call.ids), completion, cached, report))
    yield b"data: [DONE]\n\n"
