"""Typed messages that cross process boundaries, serialized with orjson.

Every message is a dataclass registered under a type tag.  ``encode`` writes
``{"type": tag, **fields}``; ``decode`` checks the tag, the field names and every field's
type against the dataclass's annotations before building it, and for a message of parallel
row lists (:class:`TokenOut`, :class:`StrOut`) that the rows line up, so a malformed message
fails loudly at the boundary, with a ``ValueError`` saying what is wrong, instead of crashing
whoever handles it.  A field may hold records (dataclasses: :class:`FinishReason`,
:class:`ReqMeta`, ``SamplingParams``, ...): they travel as JSON objects and are checked field
by field and rebuilt on decode, so no untyped dict crosses a boundary.

Every request id gets exactly one terminal message: a :class:`TokenOut` / :class:`StrOut`
row with ``finished`` set (reason ``stop``, ``length`` or ``abort``), or an :class:`ErrorOut`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import orjson

from radixserve.ipc.json_types import JsonObject, build_fields, check_fields, fields_of
from radixserve.sampling.params import SamplingParams

_REGISTRY: dict[str, type] = {}


def message(tag: str, rows: bool = False) -> Callable[[type], type]:
    """Class decorator: make ``cls`` a dataclass and register it under ``tag``.

    ``rows``: every field is a list with one entry per row (per request); fields with a
    default may instead be empty (not sent).
    """

    def wrap(cls: type) -> type:
        cls = dataclass(cls)
        cls.TYPE = tag
        cls._FIELDS = fields_of(cls)
        cls._ROWS = [f.name for f in fields(cls)] if rows else []
        _REGISTRY[tag] = cls
        return cls

    return wrap


def encode(msg: Any) -> bytes:
    payload = {"type": type(msg).TYPE}
    payload.update({name: getattr(msg, name) for name in type(msg)._FIELDS.hints})
    # Records (dataclasses) are written as objects; int keys (a logit bias) as strings.
    return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS)


def decode(data: bytes) -> Any:
    """The message in ``data``; ``ValueError`` saying what is wrong when it is not one."""
    payload = orjson.loads(data)  # orjson.JSONDecodeError is a ValueError
    if not isinstance(payload, dict) or "type" not in payload:
        raise ValueError("message without a type tag")
    tag = payload.pop("type")
    cls = _REGISTRY.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ValueError(f"unknown message type {tag!r}")
    where = f"message {tag!r}: field {{!r}}".format
    check_fields(cls._FIELDS, payload, f"message {tag!r}", where)
    if cls._ROWS:
        _check_rows(tag, cls, payload)
    build_fields(cls._FIELDS.builds, payload, where)
    return cls(**payload)


def request_id(data: bytes) -> str | None:
    """The id of the generate request in ``data`` if it has a string one (None otherwise),
    for answering a request whose message did not decode."""
    try:
        payload = orjson.loads(data)
    except ValueError:
        return None
    if isinstance(payload, dict) and payload.get("type") == GenerateReq.TYPE:
        rid = payload.get("rid")
        return rid if isinstance(rid, str) else None
    return None


def _check_rows(tag: str, cls: type, payload: dict[str, Any]) -> None:
    """Parallel row lists: one entry per row, or (a field with a default) none at all."""
    n = len(payload[cls._ROWS[0]])
    for name in cls._ROWS[1:]:
        k = len(payload[name]) if name in payload else 0
        if k != n and not (k == 0 and name not in cls._FIELDS.required):
            raise ValueError(
                f"message {tag!r}: field {name!r} has {k} rows, {cls._ROWS[0]!r} has {n}"
            )


# A logprob is a number, or null for -inf (a token masked out by a grammar or a filter, among
# the top logprobs): JSON has no infinity, and orjson writes it as null.
Logprob = float | None
# One position's top logprobs: ``[token id, logprob]`` pairs.
TopLogprobs = list[list[Logprob]]


# ---------------------------------------------------------------- records inside messages


@dataclass
class FinishReason:
    """Why a request ended: ``stop`` (``matched``: the stop token id or string, None for EOS
    or a finished grammar), ``length`` (``length``: the output's length then, as SGLang
    reports it) or ``abort``."""

    type: str
    matched: int | str | None = None
    length: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """SGLang's ``meta_info.finish_reason``."""
        d: dict[str, Any] = {"type": self.type, "matched": self.matched}
        if self.type == "length":
            d["length"] = self.length
        return d


@dataclass
class DetokSettings:
    """What the detokenizer needs of a request, sent with its first row."""

    stop: list[str]
    skip_special_tokens: bool = True
    no_stop_trim: bool = False


@dataclass
class PinResult:
    """A pin made when its request finished (``POST /cache/pin``), or why none was."""

    pin_id: str | None = None
    tokens: int = 0
    cache_salt: str | None = None
    expires_in: float | None = None  # seconds; None: until unpinned
    error: str | None = None
    lora: str | None = None  # the LoRA adapter whose namespace holds the pin

    def to_dict(self) -> dict[str, Any]:
        if self.error is not None:
            return {"error": self.error}
        d = {"pin_id": self.pin_id, "tokens": self.tokens, "cache_salt": self.cache_salt,
             "expires_in": self.expires_in}
        return d if self.lora is None else {**d, "lora": self.lora}


@dataclass
class CacheReport:
    """Where a request's prefix match stopped (``meta_info.cache_report``): the tokens served
    from the cache and, when the match stopped inside the cache's text, the request's and the
    cache's next ids there (``cache/tree_view.py``; the front end adds their ``context``,
    ``request_next`` and ``cached_next`` text)."""

    cached_tokens: int
    position: int | None = None
    before_ids: list[int] | None = None
    request_ids: list[int] | None = None
    cached_ids: list[int] | None = None
    cached_after: int | None = None
    near_miss: bool | None = None
    context: str | None = None
    request_next: str | None = None
    cached_next: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class ReqMeta:
    """One row's request description, as the scheduler knows it."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    queue_time: float | None  # seconds from arrival to first admission
    # Lets the front end place the first token in time when it receives several at once
    # (non-streaming requests, stream_interval > 1).
    since_first_token: float = 0.0
    pin: PinResult | None = None
    cached_tokens_details: dict[str, int] | None = None  # the hit by the tier it came from
    cache_report: CacheReport | None = None
    spec: dict[str, float] | None = None  # SGLang's ``spec_*`` counters (speculative decoding)


# ---------------------------------------------------------------- front end -> scheduler


@dataclass(frozen=True)
class ModelInfo:
    """What the scheduler reports once it is ready (through the launcher's pipe): the served
    model and what it was given.  The front end and the Engine read it; ``to_dict`` is the
    Engine's ``info`` and part of ``/server_info``."""

    vocab_size: int
    context_length: int
    max_total_tokens: int  # the KV pool, in tokens
    max_running_requests: int
    page_size: int
    eos_token_ids: list[int]
    dtype: str
    kv_cache_dtype: str
    kv_cache_bytes_per_token: int
    device: str
    attention_backend: str
    tp_size: int
    quantization: str
    speculative_algorithm: str | None
    tokenizer_path: str
    torch_threads: int
    disaggregation_mode: str = "null"
    # LoRA (--enable-lora): the adapters loaded at start {name: folder}, the largest rank
    lora_enabled: bool = False
    lora_adapters: dict[str, str] = field(default_factory=dict)
    max_lora_rank: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Bootstrap:
    """Where a disaggregated request's KV comes from (SGLang's fields, set by smg): the prefill
    worker's host and bootstrap port, and the room naming the request on both workers."""

    host: str
    port: int
    room: str


@message("generate")
class GenerateReq:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    seed: int  # the user's seed, or one drawn by the front end
    return_logprob: bool = False
    top_logprobs_num: int = 0
    stream: bool = False
    # -1: no prompt logprobs; k >= 0: logprobs of prompt tokens [k, prompt_len)
    # (with return_logprob)
    logprob_start_len: int = -1
    extra_key: str = ""  # cache namespace (``cache_salt``): prefixes are shared only within it
    priority: int = 0  # level for ``--schedule-policy priority``
    pin: bool = False  # when it finishes, pin its cached prompt (scheduler/pins.py)
    pin_ttl: float | None = None  # seconds the pin lasts; None: until unpinned
    # meta carries where the prefix match stopped (cache/tree_view.py)
    return_cache_report: bool = False
    bootstrap: Bootstrap | None = None  # prefill-decode disaggregation (radixserve/disagg)
    lora: str | None = None  # the LoRA adapter's name (None: the base model)


@message("abort")
class AbortReq:
    rid: str


@message("control")
class ControlReq:
    """A control command without arguments (the scheduler's registry, ``scheduler/control.py``,
    names them: ``stats``, ``flush_cache``, ``check_memory``, ``pins``, ``cache_misses``,
    ``start_profile``, ``stop_profile``); every control message is answered by a ControlOut."""

    cid: str
    command: str


@message("unpin")
class UnpinReq:
    """Drop the pin ``pin_id``, or every pin of exactly ``input_ids`` in the namespace
    ``extra_key``."""

    cid: str
    pin_id: str | None = None
    input_ids: list[int] | None = None
    extra_key: str = ""
    lora: str | None = None  # the pins of this LoRA adapter's namespace (None: the base model)


@message("cache_tree")
class CacheTreeReq:
    """The cache tree's summary rows (``cache/tree_view.py``): ``sort`` order, ``depth`` (None:
    all levels) and at most ``limit`` rows."""

    cid: str
    sort: str = "weight"
    depth: int | None = None
    limit: int = 50


@message("lora_load")
class LoraLoadReq:
    """Load the peft adapter folder ``lora_path`` as ``lora_name``."""

    cid: str
    lora_name: str
    lora_path: str


@message("lora_unload")
class LoraUnloadReq:
    cid: str
    lora_name: str


# Control commands with arguments: their messages.
CONTROL_WITH_ARGS: dict[str, type] = {"unpin": UnpinReq, "cache_tree": CacheTreeReq,
                                      "lora_load": LoraLoadReq, "lora_unload": LoraUnloadReq}


def control_request(cid: str, command: str, **args: Any) -> Any:
    """The message of one control call (TypeError for arguments the command does not take)."""
    cls = CONTROL_WITH_ARGS.get(command)
    if cls is None:
        if args:
            raise TypeError(
                f"the control command {command!r} takes no arguments, got {sorted(args)}"
            )
        return ControlReq(cid=cid, command=command)
    return cls(cid=cid, **args)


# ---------------------------------------------------------------- scheduler -> detokenizer


@message("token_out", rows=True)
class TokenOut:
    """One scheduler step's new tokens, for every request that produced some.

    Rows are parallel lists.  ``finished[i]`` is None while request i runs.  ``init[i]``
    carries the detokenizer settings on the first message of a request, else None.
    """

    rids: list[str]
    new_ids: list[list[int]]
    finished: list[FinishReason | None]
    meta: list[ReqMeta]
    init: list[DetokSettings | None]
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
    result: JsonObject  # served as it is (/server_info, /metrics, the cache views)


# ---------------------------------------------------------------- detokenizer -> front end


@message("str_out", rows=True)
class StrOut:
    """Text deltas for the rows of one TokenOut (same row order)."""

    rids: list[str]
    text_deltas: list[str]
    new_ids: list[list[int]]
    finished: list[FinishReason | None]
    meta: list[ReqMeta]
    logprobs: list[list[Logprob] | None] = field(default_factory=list)
    top_logprobs: list[list[TopLogprobs] | None] = field(default_factory=list)
    # Prompt logprobs, passed through from TokenOut.
    input_logprobs: list[list[Logprob] | None] = field(default_factory=list)
    input_top_logprobs: list[list[TopLogprobs | None] | None] = field(default_factory=list)

