"""Incremental scanning of the JSON inside tool calls.

The streaming tool parser must decide on a prefix of the output whether it is looking at a
call header (``{"name": "f", "arguments": {``), and then follow the arguments object to its
closing brace without waiting for the whole JSON.  These helpers do that on plain strings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum

from radixserve.chat.parsers.base import ToolCallParsed

_WS = " \t\r\n"


class Match(Enum):
    DONE = "done"
    PARTIAL = "partial"  # the text so far could still become a header
    FAIL = "fail"


@dataclass(frozen=True)
class HeadMatch:
    status: Match
    end: int = 0  # just past the arguments' opening "{" (status DONE)
    name: str = ""


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def _literal(text: str, pos: int, options: tuple[str, ...]) -> tuple[Match, int]:
    rest = text[pos:]
    for lit in options:
        if rest.startswith(lit):
            return Match.DONE, pos + len(lit)
    if any(lit.startswith(rest) for lit in options):
        return Match.PARTIAL, pos
    return Match.FAIL, pos


def _json_string(text: str, pos: int) -> tuple[Match, int, str]:
    """A JSON string starting at ``pos`` (its opening quote)."""
    if pos >= len(text):
        return Match.PARTIAL, pos, ""
    if text[pos] != '"':
        return Match.FAIL, pos, ""
    i, escaped = pos + 1, False
    while i < len(text):
        c = text[i]
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == '"':
            try:
                return Match.DONE, i + 1, json.loads(text[pos:i + 1])
            except json.JSONDecodeError:
                return Match.FAIL, pos, ""
        elif c < " ":
            return Match.FAIL, pos, ""
        i += 1
    return Match.PARTIAL, pos, ""


def match_call_head(text: str, arg_keys: tuple[str, ...]) -> HeadMatch:
    """Match ``ws { ws "name" ws : ws "<name>" ws , ws "<arg key>" ws : ws {`` at the start of
    ``text``.  PARTIAL means the text is a prefix of such a header (wait for more)."""
    keys = tuple(json.dumps(k) for k in arg_keys)
    pos, name = 0, ""
    steps: list[tuple[str, tuple[str, ...]]] = [
        ("lit", ("{",)), ("lit", ('"name"',)), ("lit", (":",)), ("str", ()), ("lit", (",",)),
        ("lit", keys), ("lit", (":",)), ("lit", ("{",)),
    ]
    for kind, options in steps:
        pos = _skip_ws(text, pos)
        if pos >= len(text):
            return HeadMatch(Match.PARTIAL)
        if kind == "str":
            status, pos, name = _json_string(text, pos)
        else:
            status, pos = _literal(text, pos, options)
        if status is not Match.DONE:
            return HeadMatch(status)
    return HeadMatch(Match.DONE, pos, name)


class JsonDepth:
    """Follows brackets and strings of a JSON text fed piece by piece.

    ``feed`` returns how many characters of the piece it consumed: all of them, or up to and
    including the one that brings the depth back to zero (the value is complete).
    """

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> int:
        for i, c in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return len(text)

    @property
    def closed(self) -> bool:
        return self.depth == 0


def call_from_object(
    obj: object, arg_keys: tuple[str, ...], names: frozenset[str] | None
) -> ToolCallParsed | None:
    """``{"name": ..., "arguments": {...}}`` as a call, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    key = next((k for k in arg_keys if k in obj), None)
    if key is None or not isinstance(obj[key], dict):
        return None
    return ToolCallParsed(obj["name"], json.dumps(obj[key], ensure_ascii=False))


def calls_from_json_text(
    text: str, arg_keys: tuple[str, ...], names: frozenset[str] | None
) -> list[ToolCallParsed] | None:
    """Calls from a JSON array of call objects, or from call objects separated by ``;`` or
    ``,`` (a trailing ``]`` allowed); None unless the whole text is such calls."""
    decoder = json.JSONDecoder()
    text = text.strip()
    if not text:
        return None
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None
    objects: list[object] = []
    if isinstance(whole, list):
        objects = whole
    else:
        pos = 0
        while pos < len(text):
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                return None
            objects.append(obj)
            pos = _skip_ws(text, pos)
            if pos < len(text) and text[pos] in ";,":
                pos = _skip_ws(text, pos + 1)
            elif text[pos:].strip() == "]":
                break
    calls = [call_from_object(o, arg_keys, names) for o in objects]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]
