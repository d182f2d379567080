"""Per-request sampling parameters: SGLang's names and defaults, validated once on arrival.

A bad value raises ``ValueError`` naming the field, so the frontend can answer 400 instead of
the scheduler crashing on it later.  The object is frozen and crosses process boundaries as
a plain dict (``to_dict`` / ``from_dict``), which orjson serializes as is.
"""

from __future__ import annotations

import math
import numbers
import secrets
from dataclasses import dataclass, field, fields
from typing import Any

from radixserve.validation import FieldError, is_text

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


def draw_seed() -> int:
    """A fresh random seed for a request that did not ask for one (fits int64)."""
    return secrets.randbits(63)


def _check_int(name: str, value: Any) -> int:
    """An integer that fits in 64 bits: the parameters cross process boundaries as JSON,
    which carries no larger integer."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise FieldError(name, f"sampling_params.{name} must be an integer, got {value!r}")
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise FieldError(name, f"sampling_params.{name} must fit in 64 bits, got {value}")
    return int(value)


def _check_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise FieldError(name, f"sampling_params.{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise FieldError(name, f"sampling_params.{name} must be finite, got {value!r}")
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise FieldError(name, f"sampling_params.{name} must be a boolean, got {value!r}")
    return value


def _escaped(s: str) -> str:
    """``s`` printable (a lone surrogate cannot be encoded, not even into an error message)."""
    return s.encode("utf-8", "backslashreplace").decode()[:80]


def _check_stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise FieldError(
            "stop",
            f"sampling_params.stop must be a string or a list of strings, got {value!r}"
        )
    for s in value:
        if not isinstance(s, str) or not s:
            raise FieldError("stop", f"sampling_params.stop must hold non-empty strings, got {s!r}")
        if not is_text(s):
            raise FieldError("stop", f"sampling_params.stop holds a lone UTF-16 surrogate: {_escaped(s)}")
    return list(value)


def _check_logit_bias(value: Any) -> dict[int, float]:
    """``{token_id: bias}``; keys may be ints or digit strings (JSON objects), bias in [-100, 100]."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise FieldError("logit_bias", f"sampling_params.logit_bias must be an object, got {value!r}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            tok = int(key) if not isinstance(key, bool) else -1
        except (TypeError, ValueError):
            tok = -1
        if tok < 0:
            raise FieldError("logit_bias", f"sampling_params.logit_bias keys must be token ids, got {key!r}")
        bias = _check_float("logit_bias", bias)
        if not -100.0 <= bias <= 100.0:
            raise FieldError("logit_bias", f"sampling_params.logit_bias values must be in [-100, 100], got {bias}")
        out[tok] = bias
    return out


def _check_stop_token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise FieldError(
            "stop_token_ids",
            f"sampling_params.stop_token_ids must be a list of integers, got {value!r}"
        )
    out = []
    for t in value:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
            raise FieldError("stop_token_ids", f"sampling_params.stop_token_ids must hold integers >= 0, got {t!r}")
        out.append(int(t))
    return out


GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")


def _check_n(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        return f"sampling_params.n must be an integer >= 1, got {value!r}"
    if value != 1:
        return (f"sampling_params.n = {value} asks for several samples of one prompt, which "
                "/generate and Engine.generate do not support; send the prompt n times in a "
                "batch (the OpenAI routes take n)")
    return None


def _check_stop_regex(value: Any) -> str | None:
    if value in ("", [], ()):
        return None
    return ("sampling_params.stop_regex asks for stopping on a regular expression, which "
            "radixserve does not support; use stop strings or a regex constraint")


def _check_spaces(value: Any) -> str | None:
    if not isinstance(value, bool):
        return f"sampling_params.spaces_between_special_tokens must be a boolean, got {value!r}"
    if not value:
        return ("sampling_params.spaces_between_special_tokens = false asks for a decoding "
                "radixserve does not support")
    return None


# Fields SGLang's clients send (its frontend language sends every one of them) that name a
# feature radixserve lacks: accepted at the value that asks for nothing (or null), refused
# with a message naming them otherwise.  They are checked and dropped by ``from_dict``.
SGLANG_ONLY_FIELDS: dict[str, Any] = {
    "n": _check_n,
    "stop_regex": _check_stop_regex,
    "spaces_between_special_tokens": _check_spaces,
}

# What ``from_dict`` accepts, as a JSON schema, for API documents (the native /generate
# route's OpenAPI schema).  The checks in ``SamplingParams.__post_init__`` are the reference;
# this mirrors them.  Every field may also be null ("the default").
def _int(minimum: int = _INT64_MIN) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "maximum": _INT64_MAX}


_FIELD_SCHEMAS: dict[str, dict[str, Any]] = {
    "max_new_tokens": {**_int(0), "description": "0: compute (and cache) the prompt only"},
    "temperature": {"type": "number", "minimum": 0},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"anyOf": [{"const": -1}, _int(1)], "description": "-1: off"},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "stop": {"anyOf": [{"type": "string", "minLength": 1},
                       {"type": "array", "items": {"type": "string", "minLength": 1}}]},
    "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "seed": _int(),
    "ignore_eos": {"type": "boolean"},
    "skip_special_tokens": {"type": "boolean"},
    "no_stop_trim": {"type": "boolean"},
    "logit_bias": {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                   "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                   "description": "token id -> bias added to its logit"},
    "min_new_tokens": {**_int(0), "description": "at most max_new_tokens"},
    "json_schema": {"type": "string", "description": "a JSON schema, as a JSON string"},
    "regex": {"type": "string"},
    "ebnf": {"type": "string", "description": "xgrammar's GBNF dialect, root rule 'root'"},
    "structural_tag": {"type": "string", "description": "an xgrammar structural tag, as a JSON string"},
    # SGLANG_ONLY_FIELDS: only the values that ask for nothing.
    "n": {"const": 1, "description": "several samples per prompt are not supported here"},
    "stop_regex": {"anyOf": [{"const": ""}, {"type": "array", "maxItems": 0}],
                   "description": "not supported: only empty"},
    "spaces_between_special_tokens": {"const": True},
}


def sampling_params_json_schema() -> dict[str, Any]:
    """The JSON schema of a ``sampling_params`` object (see ``SamplingParams.from_dict``)."""
    return {
        "type": "object",
        "title": "SamplingParams",
        "description": f"At most one of {', '.join(GRAMMAR_FIELDS)}.",
        "properties": {name: {"anyOf": [schema, {"type": "null"}]} for name, schema in _FIELD_SCHEMAS.items()},
        "additionalProperties": False,
    }


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128  # 0: prefill only (the prompt is computed and cached; nothing sampled)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)  # accepts a str, a list of str, or None
    stop_token_ids: list[int] = field(default_factory=list)
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to the logits first
    min_new_tokens: int = 0  # EOS and stop tokens are masked until this many tokens exist
    # Constrained decoding: at most one of these (see radixserve/grammar).
    json_schema: str | None = None  # a JSON schema as a JSON string
    regex: str | None = None
    ebnf: str | None = None  # xgrammar's GBNF dialect, root rule "root"
    structural_tag: str | None = None  # xgrammar structural tag as a JSON string

    def __post_init__(self) -> None:
        # Normalise types (ints accepted for floats, str for stop) and check ranges.  The
        # dataclass is frozen, so normalised values go in through object.__setattr__.
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("max_new_tokens", _check_int("max_new_tokens", self.max_new_tokens))
        put("min_new_tokens", _check_int("min_new_tokens", self.min_new_tokens))
        for name in GRAMMAR_FIELDS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise FieldError(name, f"sampling_params.{name} must be a string, got {type(value).__name__}")
            if value is not None and not is_text(value):
                raise FieldError(name, f"sampling_params.{name} holds a lone UTF-16 surrogate: {_escaped(value)}")
        given = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of {', '.join(GRAMMAR_FIELDS)}; got {', '.join(given)}")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
        ):
            put(name, _check_float(name, getattr(self, name)))
        put("top_k", _check_int("top_k", self.top_k))
        put("stop", _check_stop(self.stop))
        put("stop_token_ids", _check_stop_token_ids(self.stop_token_ids))
        put("logit_bias", _check_logit_bias(self.logit_bias))
        if self.seed is not None:
            put("seed", _check_int("seed", self.seed))
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            _check_bool(name, getattr(self, name))

        if self.max_new_tokens < 0:
            raise FieldError(
                "max_new_tokens",
                f"sampling_params.max_new_tokens must be >= 0, got {self.max_new_tokens}"
            )
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise FieldError(
                "min_new_tokens",
                f"sampling_params.min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}"
            )
        if self.temperature < 0:
            raise FieldError("temperature", f"sampling_params.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise FieldError("top_p", f"sampling_params.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise FieldError("top_k", f"sampling_params.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise FieldError("min_p", f"sampling_params.min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise FieldError(
                "repetition_penalty",
                f"sampling_params.repetition_penalty must be > 0, got {self.repetition_penalty}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise FieldError(name, f"sampling_params.{name} must be in [-2, 2], got {v}")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Build from a request's JSON object.  A key set to ``None`` means "use the default"
        (OpenAI and SGLang clients send explicit nulls).  Unknown keys are an error, not
        ignored; ``SGLANG_ONLY_FIELDS`` are checked (refused when they ask for something)
        and dropped."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise FieldError("sampling_params", f"sampling_params must be an object, got {type(d).__name__}")
        valid = [f.name for f in fields(cls)]
        unknown = sorted(k for k in d if k not in valid and k not in SGLANG_ONLY_FIELDS)
        if unknown:
            raise FieldError(
                "sampling_params",
                f"unknown sampling parameter(s) {', '.join(map(repr, unknown))}; "
                f"valid: {', '.join(valid + list(SGLANG_ONLY_FIELDS))}"
            )
        for name, check in SGLANG_ONLY_FIELDS.items():
            if d.get(name) is not None and (error := check(d[name])) is not None:
                raise FieldError(name, error)
        return cls(**{k: v for k, v in d.items() if v is not None and k not in SGLANG_ONLY_FIELDS})

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of JSON types; ``from_dict(p.to_dict()) == p``."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["stop"] = list(self.stop)
        out["stop_token_ids"] = list(self.stop_token_ids)
        out["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}  # JSON keys are str
        return out

    def validate_for_model(self, vocab_size: int) -> None:
        """Checks that need the model: every stop token id must be a real token."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise FieldError(
                "stop_token_ids",
                f"sampling_params.stop_token_ids {bad} out of range for vocab size {vocab_size}"
            )
        bad = [t for t in self.logit_bias if t >= vocab_size]
        if bad:
            raise FieldError(
                "logit_bias",
                f"sampling_params.logit_bias token ids {bad} out of range for vocab size {vocab_size}"
            )

    @property
    def grammar(self) -> tuple[str, str] | None:
        """``(kind, text)`` of the request's constraint, or None when it has none."""
        for name in GRAMMAR_FIELDS:
            value = getattr(self, name)
            if value is not None:
                return name, value
        return None

    @property
    def has_penalties(self) -> bool:
        """Sampling reads the output (and prompt) ids: repetition, frequency or presence penalty."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
