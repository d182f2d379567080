"""Typed messages that cross process boundaries, serialized with orjson.

Every message is a dataclass registered under a type tag.  ``encode`` writes
``{"type": tag, **fields}``; ``decode`` checks the tag, the field names and every field's
type against the dataclass's annotations before building it, and for a message of parallel
row lists (:class:`TokenOut`, :class:`StrOut`) that the rows line up, so a malformed message
fails loudly at the boundary, with a ``ValueError`` saying what is wrong, instead of crashing
whoever handles it.

Every request id gets exactly one terminal message: a :class:`TokenOut` / :class:`StrOut`
row with ``finished`` set (reason ``stop``, ``length`` or ``abort``), or an :class:`ErrorOut`.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import orjson

from radixserve.ipc.json_types import compile_test, explain

_REGISTRY: dict[str, type] = {}


def message(tag: str, rows: bool = False) -> Callable[[type], type]:
    """Class decorator: make ``cls`` a dataclass and register it under ``tag``.

    ``rows``: every field is a list with one entry per row (per request); fields with a
    default may instead be empty (not sent).
    """

    def wrap(cls: type) -> type:
        cls = dataclass(cls)
        hints = typing.get_type_hints(cls)
        cls.TYPE = tag
        cls._FIELDS = {f.name for f in fields(cls)}
        cls._REQUIRED = {
            f.name
            for f in fields(cls)
            if f.default is MISSING and f.default_factory is MISSING
        }
        cls._HINTS = {f.name: hints[f.name] for f in fields(cls)}
        cls._TESTS = {f.name: compile_test(hints[f.name]) for f in fields(cls)}
        cls._ROWS = [f.name for f in fields(cls)] if rows else []
        _REGISTRY[tag] = cls
        return cls

    return wrap


def encode(msg: Any) -> bytes:
    payload = {"type": type(msg).TYPE}
    payload.update({name: getattr(msg, name) for name in type(msg)._FIELDS})
    return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)


def decode(data: bytes) -> Any:
    """The message in ``data``; ``ValueError`` saying what is wrong when it is not one."""
    payload = orjson.loads(data)  # orjson.JSONDecodeError is a ValueError
    if not isinstance(payload, dict) or "type" not in payload:
        raise ValueError("message without a type tag")
    tag = payload.pop("type")
    cls = _REGISTRY.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ValueError(f"unknown message type {tag!r}")
    names = set(payload)
    if names - cls._FIELDS or cls._REQUIRED - names:
        raise ValueError(
            f"message {tag!r} has fields {sorted(names)}, expected {sorted(cls._FIELDS)}"
        )
    tests = cls._TESTS
    for name, value in payload.items():
        if not tests[name](value):
            err = explain(cls._HINTS[name], value)
            raise ValueError(f"message {tag!r}: field {name!r}{err}")
    if cls._ROWS:
        _check_rows(tag, cls, payload)
    return cls(**payload)


def _check_rows(tag: str, cls: type, payload: dict[str, Any]) -> None:
    """Parallel row lists: one entry per row, or (a field with a default) none at all."""
    n = len(payload[cls._ROWS[0]])
    for name in cls._ROWS[1:]:
        k = len(payload[name]) if name in payload else 0
        if k != n and not (k == 0 and name not in cls._REQUIRED):
            raise ValueError(
                f"message {tag!r}: field {name!r} has {k} rows, {cls._ROWS[0]!r} has {n}"
            )


# A logprob is a number, or null for -inf (a token masked out by a grammar or a filter, among
# the top logprobs): JSON has no infinity, and orjson writes it as null.
Logprob = float | None
# One position's top logprobs: ``[token id, logprob]`` pairs.
TopLogprobs = list[list[Logprob]]


# ---------------------------------------------------------------- front end -> scheduler


@message("generate")
class GenerateReq:
    rid: str
    input_ids: list[int]
    sampling_params: dict[str, Any]  # SamplingParams.to_dict()
    seed: int  # the user's seed, or one drawn by the front end
    return_logprob: bool = False
    top_logprobs_num: int = 0
    stream: bool = False
    # -1: no prompt logprobs; k >= 0: logprobs of prompt tokens [k, prompt_len) (with return_logprob)
    logprob_start_len: int = -1
    extra_key: str = ""  # cache namespace (``cache_salt``): prefixes are shared only within it
    priority: int = 0  # level for ``--schedule-policy priority``
    pin: bool = False  # when it finishes, pin its cached prompt (scheduler/pins.py)
    pin_ttl: float | None = None  # seconds the pin lasts; None: until unpinned
    return_cache_report: bool = False  # meta carries where the prefix match stopped (cache/tree_view.py)


@message("abort")
class AbortReq:
    rid: str


@message("control")
class ControlReq:
    """``command``: ``stats`` | ``flush_cache`` | ``check_memory`` | ``start_profile`` |
    ``stop_profile`` | ``pins`` | ``unpin`` | ``cache_tree`` | ``cache_misses``; answered by
    ControlOut."""

    cid: str
    command: str
    args: dict[str, Any] = field(default_factory=dict)  # ``unpin``: pin_id or input_ids + extra_key


# ---------------------------------------------------------------- scheduler -> detokenizer


@message("token_out", rows=True)
class TokenOut:
    """One scheduler step's new tokens, for every request that produced some.

    Rows are parallel lists.  ``finished[i]`` is None while request i runs, else a dict
    ``{"type": "stop"|"length"|"abort", "matched": token id | stop string | None}``.
    ``init[i]`` carries the detokenizer settings (stop strings, skip_special_tokens,
    no_stop_trim) on the first message of a request, else None.
    """

    rids: list[str]
    new_ids: list[list[int]]
    finished: list[dict[str, Any] | None]
    meta: list[dict[str, Any]]  # prompt_tokens, cached_tokens, completion_tokens
    init: list[dict[str, Any] | None]
    logprobs: list[list[Logprob] | None] = field(default_factory=list)
    top_logprobs: list[list[TopLogprobs] | None] = field(default_factory=list)
    # Prompt logprobs, on the request's first row only (else None): one entry per prompt
    # position from logprob_start_len on, None at position 0.
    input_logprobs: list[list[Logprob] | None] = field(default_factory=list)
    input_top_logprobs: list[list[TopLogprobs | None] | None] = field(default_factory=list)


@message("error_out")
class ErrorOut:
    rid: str
    message: str
    status: int = 400


@message("control_out")
class ControlOut:
    cid: str
    result: dict[str, Any]


# ---------------------------------------------------------------- detokenizer -> front end


@message("str_out", rows=True)
class StrOut:
    """Text deltas for the rows of one TokenOut (same row order)."""

    rids: list[str]
    text_deltas: list[str]
    new_ids: list[list[int]]
    finished: list[dict[str, Any] | None]
    meta: list[dict[str, Any]]
    logprobs: list[list[Logprob] | None] = field(default_factory=list)
    top_logprobs: list[list[TopLogprobs] | None] = field(default_factory=list)
    # Prompt logprobs, passed through from TokenOut.
    input_logprobs: list[list[Logprob] | None] = field(default_factory=list)
    input_top_logprobs: list[list[TopLogprobs | None] | None] = field(default_factory=list)

