"""What a program appends to its state: text, generations, choices and chat roles.

``s += "text"``, ``s += gen("name", ...)``, ``s += select("name", choices=[...])`` and
``s += user("..." + gen(...))`` build these expressions; the state executes them in order
(:mod:`radixserve.program.state`).  Arguments are checked here, where the program builds the
expression, so a bad program fails in the caller's code with a ``ValueError``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from radixserve.program.choices import ChoicesMethod, token_length_normalized

# Regexes for ``gen(dtype=...)``: what an int, float, bool or quoted string looks like.
_DTYPE_REGEX = {
    "int": r"[-+]?[0-9]+",
    "float": r"[-+]?[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?",
    "bool": r"(True|False)",
    "str": r'"[^"\\\n]*"',
}
_NUMBER_STOPS = [" ", "\n"]  # a number ends at the first space or line break
ROLES = ("system", "user", "assistant")


class Expr:
    """Something a program appends; ``+`` joins expressions (and strings) in order."""

    def __add__(self, other: Any) -> Concat:
        return Concat([*_parts(self), *_parts(other)])

    def __radd__(self, other: Any) -> Concat:
        return Concat([*_parts(other), *_parts(self)])


@dataclass
class Text(Expr):
    value: str


@dataclass
class Gen(Expr):
    """A generation; its text is appended and stored under ``name``."""

    name: str | None
    sampling: dict[str, Any]  # native sampling_params; unset fields are left to defaults
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False


@dataclass
class Select(Expr):
    """A choice among fixed texts, by the model's logprobs of each; the choice is appended."""

    name: str | None
    choices: list[str]
    method: ChoicesMethod


@dataclass
class Role(Expr):
    """A chat message rendered with the model's chat template; ``content`` may generate."""

    role: str
    content: list[Expr]


@dataclass
class Concat(Expr):
    parts: list[Expr] = field(default_factory=list)


def _parts(x: Any) -> list[Expr]:
    if isinstance(x, Concat):
        return list(x.parts)
    if isinstance(x, Expr):
        return [x]
    if isinstance(x, str):
        return [Text(x)]
    raise ValueError(
        f"a program can append text or gen/select/role expressions, not {type(x).__name__}"
    )


def as_exprs(x: Any) -> list[Expr]:
    """What ``s += x`` appends, as a flat list of expressions."""
    return _parts(x)


def _name(name: Any) -> str | None:
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"a variable name must be a non-empty string, got {name!r}")
    return name


def _put(sampling: dict[str, Any], key: str, value: Any) -> None:
    if value is not None:
        sampling[key] = value


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    *,
    min_tokens: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    repetition_penalty: float | None = None,
    ignore_eos: bool | None = None,
    seed: int | None = None,
    regex: str | None = None,
    json_schema: dict[str, Any] | str | None = None,
    dtype: type | str | None = None,
    choices: list[str] | None = None,
    choices_method: ChoicesMethod | None = None,
    return_logprob: bool = False,
    top_logprobs_num: int = 0,
    logprob_start_len: int = -1,
    return_text_in_logprobs: bool = False,
) -> Gen | Select:
    """Generate text into variable ``name``.  Unset sampling fields take the run's defaults,
    then the server's.  ``regex``, ``json_schema`` (a dict or its JSON text) and ``dtype``
    (``int``, ``float``, ``bool``, ``str``) constrain the output; ``choices`` makes it a
    :func:`select`."""
    if choices is not None:
        return select(name, choices, choices_method=choices_method)
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0
    ):
        raise ValueError(f"gen max_tokens must be an integer >= 0, got {max_tokens!r}")
    constraints = [k for k, v in (("regex", regex), ("json_schema", json_schema), ("dtype", dtype))
                   if v is not None]
    if len(constraints) > 1:
        raise ValueError(f"gen takes one constraint, got {' and '.join(constraints)}")
    if regex is not None and not isinstance(regex, str):
        raise ValueError(f"gen regex must be a string, got {type(regex).__name__}")
    if json_schema is not None:
        if isinstance(json_schema, dict):
            json_schema = json.dumps(json_schema)
        elif not isinstance(json_schema, str):
            raise ValueError("gen json_schema must be a dict or a JSON string, "
                             f"got {type(json_schema).__name__}")
    if dtype is not None:
        key = dtype if isinstance(dtype, str) else getattr(dtype, "__name__", "")
        if key not in _DTYPE_REGEX:
            raise ValueError(f"gen dtype must be one of int, float, bool, str, got {dtype!r}")
        regex = _DTYPE_REGEX[key]
        if key in ("int", "float"):
            stop = [*([stop] if isinstance(stop, str) else stop or []), *_NUMBER_STOPS]
    if isinstance(stop, tuple):
        stop = list(stop)
    sampling: dict[str, Any] = {}
    for key, value in (
        ("max_new_tokens", max_tokens), ("min_new_tokens", min_tokens), ("stop", stop),
        ("stop_token_ids", stop_token_ids), ("temperature", temperature), ("top_p", top_p),
        ("top_k", top_k), ("min_p", min_p), ("frequency_penalty", frequency_penalty),
        ("presence_penalty", presence_penalty), ("repetition_penalty", repetition_penalty),
        ("ignore_eos", ignore_eos), ("seed", seed), ("regex", regex), ("json_schema", json_schema),
    ):
        _put(sampling, key, value)
    return Gen(_name(name), sampling, bool(return_logprob), int(top_logprobs_num),
               int(logprob_start_len), bool(return_text_in_logprobs))


def select(name: str | None = None, choices: list[str] | None = None, *,
           choices_method: ChoicesMethod | None = None) -> Select:
    """Choose one of ``choices`` by the model's logprobs of each after the current text
    (``choices_method``: :data:`token_length_normalized` by default,
    :data:`greedy_token_selection`, :data:`unconditional_likelihood_normalized`)."""
    if not isinstance(choices, (list, tuple)) or not choices:
        raise ValueError("select needs a non-empty list of choices")
    bad = [c for c in choices if not isinstance(c, str) or not c]
    if bad:
        raise ValueError(f"select choices must be non-empty strings, got {bad[0]!r}")
    if len(set(choices)) != len(choices):
        raise ValueError("select choices must be distinct")
    method = choices_method or token_length_normalized
    if not isinstance(method, ChoicesMethod):
        raise ValueError(
            f"choices_method must be one of the program's choices methods, got {method!r}"
        )
    return Select(_name(name), list(choices), method)


def _role(role: str, content: Any) -> Role:
    return Role(role, as_exprs(content) if content is not None else [])


def system(content: Any = None) -> Role:
    return _role("system", content)


def user(content: Any = None) -> Role:
    return _role("user", content)


def assistant(content: Any = None) -> Role:
    return _role("assistant", content)
