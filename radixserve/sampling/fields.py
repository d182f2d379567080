"""Each sampling field described once: its kind, default, bounds, documentation and its name
on the OpenAI routes.

``SamplingParams`` declares its fields with :func:`param`.  Everything else is derived from
these specs: the checks ``SamplingParams`` runs on arrival (:meth:`Spec.check`), the JSON
schema of ``/generate``'s ``sampling_params`` (:meth:`Spec.json_schema`), and the pydantic
fields of the OpenAI request bodies (``radixserve/schema/sampling.py``).  A bound or a
default changes here and nowhere else.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from radixserve.validation import FieldError, is_text

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # the parameters cross processes as JSON
MAX_STOP_SEQUENCES = 16

# Kinds of field: what JSON value each takes.
INT, FLOAT, BOOL, TEXT = "int", "float", "bool", "text"
STOPS = "stops"  # a non-empty string, or a list of them
TOKEN_IDS = "token_ids"  # a list of token ids (integers >= 0)
BIAS = "bias"  # {token id: number}; keys may be digit strings (JSON object keys)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


@dataclass(frozen=True)
class Spec:
    """One sampling field.  Bounds apply to the number (for ``BIAS``: to each bias)."""

    kind: str
    doc: str = ""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    off: int | None = None  # a value outside the bounds that means "off" (top_k -1)
    max_items: int | None = None  # ``STOPS``: at most this many
    openai: str | None = None  # its name on the OpenAI bodies (None: not a plain field there)
    openai_le: float | None = None  # a tighter upper bound there (OpenAI's documented range)

    # ---- the bounds, as text and as JSON schema ---------------------------------------
    def range_text(self, le: float | None = None) -> str:
        le = self.le if le is None else le
        low = self.ge if self.ge is not None else self.gt
        if low is not None and le is not None:
            text = f"in {'[' if self.ge is not None else '('}{_num(low)}, {_num(le)}]"
        elif low is not None:
            text = f"{'>=' if self.ge is not None else '>'} {_num(low)}"
        else:
            text = f"<= {_num(le)}" if le is not None else ""
        return f"{self.off} (off) or {text}" if self.off is not None else text

    def _in_range(self, v: float, le: float | None) -> bool:
        if self.off is not None and v == self.off:
            return True
        return ((self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
                and (le is None or v <= le))

    def _number_schema(self, le: float | None) -> dict[str, Any]:
        if self.kind == INT:
            out: dict[str, Any] = {"type": "integer", "minimum": INT64_MIN, "maximum": INT64_MAX}
        else:
            out = {"type": "number"}
        if self.ge is not None:
            out["minimum"] = self.ge
        if self.gt is not None:
            out["exclusiveMinimum"] = self.gt
        if le is not None:
            out["maximum"] = le
        return {"anyOf": [{"const": self.off}, out]} if self.off is not None else out

    def json_schema(self, openai: bool = False) -> dict[str, Any]:
        """What the field accepts (besides null, "the default"), as JSON schema."""
        le = self.openai_le if openai and self.openai_le is not None else self.le
        if self.kind in (INT, FLOAT):
            out = self._number_schema(le)
        elif self.kind == BOOL:
            out = {"type": "boolean"}
        elif self.kind == TEXT:
            out = {"type": "string"}
        elif self.kind == STOPS:
            item = {"type": "string", "minLength": 1}
            out = {"anyOf": [item, {"type": "array", "items": item, "maxItems": self.max_items}]}
        elif self.kind == TOKEN_IDS:
            out = {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": INT64_MAX},
            }
        else:
            out = {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                   "additionalProperties": Spec(FLOAT, ge=self.ge, le=self.le).json_schema()}
        return {**out, "description": self.doc} if self.doc else out

    # ---- the check ---------------------------------------------------------------------
    def check(self, where: str, name: str, value: Any, openai: bool = False) -> Any:
        """``value`` normalised (ints accepted for floats, a string for a list of stops), or
        ``FieldError(name, ...)`` saying what is wrong; ``where`` names it in the message."""
        kind = self.kind
        if kind in (INT, FLOAT):
            value = _int(where, name, value) if kind == INT else _float(where, name, value)
            le = self.openai_le if openai and self.openai_le is not None else self.le
            if not self._in_range(value, le):
                raise FieldError(name, f"{where} must be {self.range_text(le)}, got {value}")
            return value
        if kind == BOOL:
            if not isinstance(value, bool):
                raise FieldError(name, f"{where} must be a boolean, got {value!r}")
            return value
        if kind == TEXT:
            if not isinstance(value, str):
                raise FieldError(name, f"{where} must be a string, got {type(value).__name__}")
            if not is_text(value):
                raise FieldError(name, f"{where} holds a lone UTF-16 surrogate: {escaped(value)}")
            return value
        if kind == STOPS:
            return _stops(where, name, value, self.max_items)
        if kind == TOKEN_IDS:
            return _token_ids(where, name, value)
        return _bias(where, name, value, self)


def param(default: Any, kind: str, doc: str = "", **bounds: Any) -> Any:
    """A ``SamplingParams`` field carrying its ``Spec`` (``default``: a value, or
    ``list``/``dict``)."""
    spec = Spec(kind, doc, **bounds)
    if default in (list, dict):
        return field(default_factory=default, metadata={"spec": spec})
    return field(default=default, metadata={"spec": spec})


def specs(cls: type) -> dict[str, Spec]:
    """The specs of a dataclass declared with :func:`param`, in declaration order."""
    return {f.name: f.metadata["spec"] for f in fields(cls) if "spec" in f.metadata}


def default_of(f: Field) -> Any:
    return f.default_factory() if f.default is MISSING else f.default  # type: ignore[misc]


def escaped(s: str) -> str:
    """``s`` printable (a lone surrogate cannot be encoded, not even into an error message)."""
    return s.encode("utf-8", "backslashreplace").decode()[:80]


def _int(where: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise FieldError(name, f"{where} must be an integer, got {value!r}")
    if not INT64_MIN <= value <= INT64_MAX:
        raise FieldError(name, f"{where} must fit in 64 bits, got {value}")
    return int(value)


def _float(where: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise FieldError(name, f"{where} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise FieldError(name, f"{where} must be finite, got {value!r}")
    return value


def _stops(where: str, name: str, value: Any, max_items: int | None) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise FieldError(name, f"{where} must be a string or a list of strings, got {value!r}")
    if max_items is not None and len(value) > max_items:
        raise FieldError(name, f"{where}: at most {max_items} stop sequences, got {len(value)}")
    for s in value:
        if not isinstance(s, str) or not s:
            raise FieldError(name, f"{where} must hold non-empty strings, got {s!r}")
        if not is_text(s):
            raise FieldError(name, f"{where} holds a lone UTF-16 surrogate: {escaped(s)}")
    return list(value)


def _token_ids(where: str, name: str, value: Any) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise FieldError(name, f"{where} must be a list of integers, got {value!r}")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t <= INT64_MAX:
            raise FieldError(name, f"{where} must hold integers >= 0, got {t!r}")
    return [int(t) for t in value]


def _bias(where: str, name: str, value: Any, spec: Spec) -> dict[int, float]:
    if not isinstance(value, dict):
        raise FieldError(name, f"{where} must be an object, got {value!r}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        tok = key if isinstance(key, int) and not isinstance(key, bool) else -1
        if isinstance(key, str) and key.isascii() and key.isdigit():
            tok = int(key)
        if tok < 0:
            raise FieldError(name, f"{where} keys must be token ids, got {key!r}")
        bias = _float(where, name, bias)
        if not spec._in_range(bias, spec.le):
            raise FieldError(name, f"{where} values must be {spec.range_text()}, got {bias}")
        out[tok] = bias
    return out
