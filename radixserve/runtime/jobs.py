"""One call's prompts as typed jobs: the batch rules of ``Engine.generate`` and ``/generate``.

A call gives one prompt or a batch (``text`` a list, or ``input_ids`` a list of lists), with
one sampling dict for all or one per prompt, and one cache namespace (``extra_key``) for all
or one per prompt.  :func:`split_batch` checks that the lists line up and yields one
:class:`PromptSpec` per prompt; :func:`prepare_jobs` tokenizes and validates each (a bad one
names its index in a batch) into a :class:`Job`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixserve.disagg.wire import room_key
from radixserve.ipc.messages import Bootstrap
from radixserve.runtime.tokenizer_manager import InvalidRequestError, SchedulingHints
from radixserve.sampling import SamplingParams
from radixserve.settings.disagg import DEFAULT_BOOTSTRAP_PORT


@dataclass(frozen=True)
class PromptSpec:
    """One prompt of a call as the caller gave it: text or ids, and its sampling dict."""

    text: str | None
    input_ids: list[int] | None
    sampling: dict[str, Any] | None
    hints: SchedulingHints


@dataclass(frozen=True)
class Job:
    """One prompt of a call, validated: its ids, sampling and scheduling hints."""

    ids: list[int]
    params: SamplingParams
    hints: SchedulingHints


def split_batch(
    text: str | list[str] | None,
    input_ids: list[int] | list[list[int]] | None,
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None,
    extra_key: str | list[str | None] | None = None,
    *,
    priority: int = 0,
    cache_report: bool = False,
    bootstrap: tuple[Any, Any, Any] | None = None,
    lora_path: str | list[str | None] | None = None,
) -> tuple[bool, list[PromptSpec]]:
    """``(batched, specs)``; InvalidRequestError (a ValueError) whose ``param`` is the field."""
    if text is None and input_ids is None:
        raise InvalidRequestError("give prompt or input_ids", param="text")
    if text is not None and input_ids is not None:
        raise InvalidRequestError("give prompt or input_ids, not both", param="text")
    if text is not None:
        batched = isinstance(text, list)
        texts: list[Any] = text if batched else [text]
        ids_list: list[Any] = [None] * len(texts)
    else:
        batched = bool(input_ids) and isinstance(input_ids[0], list)
        ids_list = input_ids if batched else [input_ids]
        texts = [None] * len(ids_list)
    n = len(texts)
    if batched and n == 0:
        raise InvalidRequestError(
            "the batch is empty", param="text" if text is not None else "input_ids"
        )
    if isinstance(sampling_params, list):
        if len(sampling_params) != n:
            raise InvalidRequestError(f"{len(sampling_params)} sampling_params for {n} prompts",
                                      param="sampling_params")
        sps = sampling_params
    elif sampling_params is None or isinstance(sampling_params, dict):
        sps = [sampling_params] * n
    else:
        raise InvalidRequestError(
            "sampling_params must be a dict or a list of dicts", param="sampling_params"
        )
    keys = extra_key if isinstance(extra_key, list) else [extra_key] * n
    if len(keys) != n:
        raise InvalidRequestError(
            f"{len(keys)} extra_key values for {n} prompts", param="extra_key"
        )
    loras = lora_path if isinstance(lora_path, list) else [lora_path] * n
    if len(loras) != n:
        raise InvalidRequestError(f"{len(loras)} lora_path values for {n} prompts",
                                  param="lora_path")
    rooms = bootstraps(*bootstrap, n) if bootstrap is not None else [None] * n
    hints = [SchedulingHints(key or "", priority, cache_report=cache_report, bootstrap=b,
                             lora=lora)
             for key, b, lora in zip(keys, rooms, loras, strict=True)]
    return batched, [
        PromptSpec(t, ids, sp, h) for t, ids, sp, h in zip(texts, ids_list, sps, hints, strict=True)
    ]


def bootstraps(
    host: Any, port: Any, room: Any, n: int, prompts: int | None = None
) -> list[Bootstrap | None]:
    """SGLang's bootstrap fields of a call of ``n`` requests as each one's :class:`Bootstrap`.

    Each field is one value, a list of one value per request, or (with ``prompts``: the
    requests are ``prompts`` prompts' ``n // prompts`` choices each, in order) one per prompt,
    as smg sends them for a list of completion prompts.  Requests that share a room number are
    told apart by their index: ``room.i``.  A null ``bootstrap_port`` is SGLang's default."""
    if room is None:
        return [None] * n
    groups = prompts or n
    columns = []
    for name, value in (
        ("bootstrap_host", host),
        ("bootstrap_port", port),
        ("bootstrap_room", room),
    ):
        if not isinstance(value, list):
            columns.append([value] * n)
        elif len(value) == n:
            columns.append(value)
        elif len(value) == groups:
            columns.append([v for v in value for _ in range(n // groups)])
        else:
            raise InvalidRequestError(f"{len(value)} {name} values for {n} requests", param=name)
    per = n if not isinstance(room, list) else n // len(room)  # requests sharing one room number
    return [None if r is None else Bootstrap(h or "", DEFAULT_BOOTSTRAP_PORT if p is None else p,
                                             room_key(r, i % per if per > 1 else None))
            for i, (h, p, r) in enumerate(zip(*columns, strict=True))]


Prepare = Callable[[PromptSpec], tuple[list[int], SamplingParams]]


def prepare_jobs(specs: list[PromptSpec], batched: bool, prepare: Prepare) -> list[Job]:
    """Each spec tokenized and validated by ``prepare``; in a batch, an error of prompt i
    says ``request i:`` first (its type and other attributes unchanged)."""
    jobs = []
    for i, spec in enumerate(specs):
        try:
            ids, params = prepare(spec)
        except Exception as e:  # InvalidRequestError, or the HTTP layer's own error type
            if batched:
                _prefix(e, f"request {i}: ")
            raise
        jobs.append(Job(ids, params, spec.hints))
    return jobs


def _prefix(e: Exception, head: str) -> None:
    e.args = (head + str(e), *e.args[1:])
    if isinstance(getattr(e, "message", None), str):
        e.message = head + e.message
