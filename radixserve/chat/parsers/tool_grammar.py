"""Grammars that enforce ``tool_choice="required"`` and a named function.

The grammar is an xgrammar structural tag (sampling param ``structural_tag``) written in the
active parser's output format, so a constrained output always parses, and each call's
arguments follow that tool's JSON schema:

- hermes / prompted: ``<tool_call>\\n{"name": "f", "arguments": <schema>}\\n</tool_call>``
  blocks separated by a newline;
- llama3: ``{"name": "f", "parameters": <schema>}`` objects separated by ``"; "``;
- mistral: ``[TOOL_CALLS] [`` + ``{"name": "f", "arguments": <schema>}`` objects separated by
  ``", "`` + ``]``.

"required" allows one or more calls (exactly one with ``parallel_tool_calls=false``); a named
function allows exactly one call of it.  ``tool_choice="auto"`` gets no grammar: a mask on
every token of what is usually a prose answer costs a matcher step per token, it would take
the request's one grammar slot (``response_format`` still works with auto), and the parser
already returns a malformed call block as content instead of failing.

With a reasoning parser the grammar first lets the model think: ``reasoning="required"`` (the
prompt opened ``<think>``, or deepseek-r1, which always reasons) accepts free text up to
``</think>``; ``"optional"`` (qwen3) accepts an optional ``<think>...</think>`` block.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from radixserve.chat.parsers.tool_formats import ToolFormat
from radixserve.chat.parsers.tool_request import ToolPlan

# Caps each run of whitespace inside the arguments JSON, so a model cannot loop on spaces.
MAX_WHITESPACE = 1
_SEPARATORS = {"hermes": "\n", "llama3": "; ", "mistral": ", "}


def _const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def _call_tag(fmt: ToolFormat, name: str, schema: dict[str, Any]) -> dict[str, Any]:
    head = f'{{"name": {json.dumps(name)}, "{fmt.arg_keys[0]}": '
    begin, end = (f"{fmt.start}\n{head}", f"}}\n{fmt.end}") if fmt.end else (head, "}")
    content = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _reasoning_prefix(reasoning: str) -> dict[str, Any]:
    begin = "" if reasoning == "required" else "<think>"
    block = {"type": "sequence", "elements": [
        {"type": "tag", "begin": begin, "content": {"type": "any_text"}, "end": "</think>"},
        _const("\n\n"),
    ]}
    return block if reasoning == "required" else {"type": "optional", "content": block}


def tool_call_grammar(plan: ToolPlan, fmt: ToolFormat, *, reasoning: str | None = None,
                      marker_token: bool = False) -> dict[str, str]:
    """Sampling-param fields (``{"structural_tag": json}``) enforcing the plan's tool choice;
    empty when the choice is not enforced ("auto", "none").

    ``marker_token``: match the start marker (mistral's ``[TOOL_CALLS]``) as its special token.
    """
    if not plan.forced:
        return {}
    if reasoning not in (None, "required", "optional"):
        raise ValueError(f"reasoning must be None, 'required' or 'optional', got {reasoning!r}")
    names = [plan.function] if plan.function else plan.names
    tags = [_call_tag(fmt, n, plan.parameters(n)) for n in names]  # type: ignore[arg-type]
    if plan.function:
        calls: dict[str, Any] = tags[0]
    else:
        calls = {"type": "tags_with_separator", "tags": tags, "separator": _SEPARATORS[fmt.name],
                 "at_least_one": True, "stop_after_first": not plan.parallel}
    if fmt.list_open:  # mistral: the marker, then a JSON list of calls
        marker = {"type": "token", "token": fmt.start} if marker_token else _const(fmt.start)
        calls = {"type": "sequence", "elements": [
            marker, _const(f" {fmt.list_open}"), calls, _const(fmt.list_close or "")]}
    if reasoning:
        calls = {"type": "sequence", "elements": [_reasoning_prefix(reasoning), calls]}
    tag = json.dumps({"type": "structural_tag", "format": calls}, ensure_ascii=False)
    check_structural_tag(tag)
    return {"structural_tag": tag}


@functools.lru_cache(maxsize=256)
def check_structural_tag(tag: str) -> None:
    """Raise ValueError if xgrammar cannot build a grammar from the tag (e.g. a schema feature
    it does not support).  Token markers need a tokenizer and are checked by the scheduler."""
    if '"type": "token"' in tag:
        return
    import xgrammar as xgr  # lazy: only requests that force a tool call pay for it

    try:
        xgr.Grammar.from_structural_tag(tag)
    except Exception as e:  # xgrammar raises RuntimeError / InvalidJSONError with the reason
        raise ValueError(f"the tools' parameters cannot be enforced as a grammar: {e}") from None
