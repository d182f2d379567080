"""Per-request sampling parameters: SGLang's names and defaults, validated once on arrival.

A bad value raises ``ValueError`` naming the field, so the frontend can answer 400 instead of
the scheduler crashing on it later.  The object is frozen and crosses process boundaries as
a plain dict (``to_dict`` / ``from_dict``), which orjson serializes as is.
"""

from __future__ import annotations

import numbers
import secrets
from dataclasses import dataclass, fields
from typing import Any

from radixserve.sampling.fields import (
    BIAS,
    BOOL,
    FLOAT,
    INT,
    MAX_STOP_SEQUENCES,
    STOPS,
    TEXT,
    TOKEN_IDS,
    default_of,
    param,
    specs,
)
from radixserve.validation import FieldError


def to_int64(x: int) -> int:
    """``x`` wrapped into a signed 64-bit integer (a seed as the sampler's tensors hold it)."""
    return (x + 2**63) % 2**64 - 2**63


def draw_seed() -> int:
    """A fresh random seed for a request that did not ask for one (fits int64)."""
    return secrets.randbits(63)


GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
_NULLABLE = ("seed", *GRAMMAR_FIELDS)  # None is their default: "no seed given", "no constraint"


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

# The values of ``SGLANG_ONLY_FIELDS`` that ask for nothing, as JSON schema.
_SGLANG_ONLY_SCHEMAS: dict[str, dict[str, Any]] = {
    "n": {"const": 1, "description": "several samples per prompt are not supported here"},
    "stop_regex": {"anyOf": [{"const": ""}, {"type": "array", "maxItems": 0}],
                   "description": "not supported: only empty"},
    "spaces_between_special_tokens": {"const": True},
}


def sampling_params_json_schema() -> dict[str, Any]:
    """The JSON schema of a ``sampling_params`` object (see ``SamplingParams.from_dict``),
    derived from the fields' specs.  Every field may also be null ("the default")."""
    schemas = {name: spec.json_schema() for name, spec in specs(SamplingParams).items()}
    return {
        "type": "object",
        "title": "SamplingParams",
        "description": f"At most one of {', '.join(GRAMMAR_FIELDS)}.",
        "properties": {name: {"anyOf": [schema, {"type": "null"}]}
                       for name, schema in {**schemas, **_SGLANG_ONLY_SCHEMAS}.items()},
        "additionalProperties": False,
    }


@dataclass(frozen=True)
class SamplingParams:
    """SGLang's sampling parameters.  Each field carries its spec (``fields.param``): the
    checks below, ``/generate``'s JSON schema and the OpenAI bodies' fields derive from it."""

    max_new_tokens: int = param(128, INT, "0: compute (and cache) the prompt only", ge=0)
    temperature: float = param(1.0, FLOAT, "0: greedy", ge=0, openai="temperature", openai_le=2)
    top_p: float = param(1.0, FLOAT, gt=0, le=1, openai="top_p")
    top_k: int = param(-1, INT, "-1: off", ge=1, off=-1, openai="top_k")
    min_p: float = param(0.0, FLOAT, ge=0, le=1, openai="min_p")
    stop: list[str] = param(
        list, STOPS, "a string or a list of strings", max_items=MAX_STOP_SEQUENCES, openai="stop"
    )
    stop_token_ids: list[int] = param(list, TOKEN_IDS, openai="stop_token_ids")
    repetition_penalty: float = param(1.0, FLOAT, gt=0, openai="repetition_penalty")
    frequency_penalty: float = param(0.0, FLOAT, ge=-2, le=2, openai="frequency_penalty")
    presence_penalty: float = param(0.0, FLOAT, ge=-2, le=2, openai="presence_penalty")
    seed: int | None = param(None, INT, "null: a random seed", openai="seed")
    ignore_eos: bool = param(False, BOOL, openai="ignore_eos")
    skip_special_tokens: bool = param(True, BOOL, openai="skip_special_tokens")
    no_stop_trim: bool = param(False, BOOL, "keep the matched stop string in the output",
                               openai="no_stop_trim")
    logit_bias: dict[int, float] = param(dict, BIAS, "token id -> bias added to its logit first",
                                         ge=-100, le=100, openai="logit_bias")
    min_new_tokens: int = param(
        0,
        INT,
        "EOS and stop tokens are masked until this many new tokens "
        "exist (at most the maximum number of new tokens)",
        ge=0,
        openai="min_tokens",
    )
    # Constrained decoding: at most one of these (see radixserve/grammar).  The OpenAI bodies
    # spell them their own way (response_format, ...), so they are not derived there.
    json_schema: str | None = param(None, TEXT, "a JSON schema, as a JSON string")
    regex: str | None = param(None, TEXT)
    ebnf: str | None = param(None, TEXT, "xgrammar's GBNF dialect, root rule 'root'")
    structural_tag: str | None = param(None, TEXT, "an xgrammar structural tag, as a JSON string")

    def __post_init__(self) -> None:
        # Normalise (ints accepted for floats, a str for stop) and check each field against
        # its spec; the dataclass is frozen, so values go in through object.__setattr__.
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name not in _NULLABLE:
                value = default_of(f)  # None: the default (a list or object field given as null)
            if value is not None:
                object.__setattr__(
                    self,
                    f.name,
                    f.metadata["spec"].check(f"sampling_params.{f.name}", f.name, value),
                )
        given = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(
                f"give at most one of {', '.join(GRAMMAR_FIELDS)}; got {', '.join(given)}"
            )
        if self.min_new_tokens > self.max_new_tokens:
            raise FieldError(
                "min_new_tokens",
                "sampling_params.min_new_tokens must be in [0, max_new_tokens], "
                f"got {self.min_new_tokens}",
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Build from a request's JSON object.  A key set to ``None`` means "use the default"
        (OpenAI and SGLang clients send explicit nulls).  Unknown keys are an error, not
        ignored; ``SGLANG_ONLY_FIELDS`` are checked (refused when they ask for something)
        and dropped."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise FieldError(
                "sampling_params", f"sampling_params must be an object, got {type(d).__name__}"
            )
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
                f"sampling_params.logit_bias token ids {bad} out of range for vocab size "
                f"{vocab_size}",
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
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
