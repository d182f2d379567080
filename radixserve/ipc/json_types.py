"""Type checks of decoded JSON values against annotations (the forms ``messages`` uses: str,
int, float, bool, None, unions of them, ``list[...]``, ``dict[str, ...]``, ``Any``).

``compile_test(tp)`` returns a fast ``value -> bool``; ``explain(tp, value)`` says what is
wrong and where (``"[3][0]: expected an integer, got str"``), or None.
"""

from __future__ import annotations

import itertools
import types
import typing
from collections.abc import Callable
from typing import Any

# A type check comes in two parts: a fast test and, only when the test fails, an
# explanation: what is wrong and where inside the value (``"[3][0]: expected an integer, got
# str"``).  The test runs on every message, so it calls no Python function per item: for
# each nesting level of the value it collects the set of the level's item types in C
# (``set(map(type, ...))``, with ``itertools.chain`` flattening the level above) and compares
# it with the types allowed there.  Decoded values are orjson's exact types (str, int, float,
# bool, None, list, dict), so comparing types is exact, and a bool is not an int.
_SCALARS = {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
            type(None): "null"}
_TEST_GLOBALS = {"_chain": itertools.chain.from_iterable}


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _levels(tp: Any, nullable: bool = False) -> list[tuple[str, frozenset]]:
    """``(step, allowed types)`` per nesting level of ``tp`` (or null, when ``nullable``):
    ``step`` makes a level's items from the level above (``{}``), and a value fits ``tp``
    when every level's item types are among that level's allowed types."""
    if tp is Any:
        return []
    null = {type(None)} if nullable else set()
    if tp in _SCALARS:
        return [("{}", frozenset({float, int} if tp is float else {tp}) | null)]  # an int is a float
    args = typing.get_args(tp)
    if _is_union(tp):
        rest = [a for a in args if a is not type(None)]
        nullable = nullable or len(rest) < len(args)
        if len(rest) == 1:
            return _levels(rest[0], nullable)
        if all(a in _SCALARS for a in rest):
            return [("{}", frozenset().union(*(_levels(a, nullable)[0][1] for a in rest)))]
        raise TypeError(f"no type check for the annotation {tp!r}")
    # The level below holds the items of this level's containers.  ``filter(None, ...)``
    # skips the nulls (and empty containers, which have no items; any other falsy value has
    # failed this level's test already).
    containers = "filter(None, {})" if nullable else "{}"
    origin = typing.get_origin(tp)
    if origin is list:
        below, item = f"_chain({containers})", args[0]
    elif origin is dict:  # JSON object keys are always strings: only the values need a test
        below, item = f"_chain(map(dict.values, {containers}))", args[1]
    else:
        raise TypeError(f"no type check for the annotation {tp!r}")
    here = ("{}", frozenset({origin} | null))
    inner = _levels(item)
    if not inner:  # list[Any], dict[str, Any]: the items are not checked
        return [here]
    return [here, (below, inner[0][1]), *inner[1:]]


def compile_test(tp: Any) -> Callable[[Any], bool]:
    """The fast test for one field (the expression's text comes from annotations only).

    Level 0 is the field's value; each level below is gathered once into a list ``l<k>``
    from the level above, so every item is visited once.
    """
    levels = _levels(tp)
    if not levels:
        return lambda v: True
    scope: dict[str, Any] = {**_TEST_GLOBALS, "_allowed0": levels[0][1]}
    terms, above = ["type(v) in _allowed0"], "(v,)"
    for k, (step, allowed) in enumerate(levels[1:], start=1):
        scope[f"_allowed{k}"] = allowed
        items = step.format(above)
        if items == "_chain((v,))":  # the items of the value itself
            items = above = "v"
        elif k < len(levels) - 1:  # gathered once, for this level's test and the next's
            items, above = f"(l{k} := list({items}))", f"l{k}"
        terms.append(f"set(map(type, {items})) <= _allowed{k}")
    return eval(f"lambda v: {' and '.join(terms)}", scope)


def _got(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def explain(tp: Any, v: Any) -> str | None:
    """What is wrong with ``v`` as a ``tp`` (None when nothing is); the slow twin of the test."""
    if tp is Any:
        return None
    if tp in _SCALARS:
        ok = type(v) is tp or (tp is float and type(v) is int)
        return None if ok else f": expected {_SCALARS[tp]}, got {_got(v)}"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        errors = [explain(a, v) for a in args]
        if None in errors:
            return None
        if v is not None:  # "expected X, got Y" from the branch the value could be
            errors = [e for a, e in zip(args, errors, strict=True) if a is not type(None)]
        return "; or ".join(dict.fromkeys(errors))  # type: ignore[arg-type]
    if origin is list:
        if type(v) is not list:
            return f": expected a list, got {_got(v)}"
        for i, x in enumerate(v):
            err = explain(args[0], x)
            if err is not None:
                return f"[{i}]{err}"
        return None
    if type(v) is not dict:
        return f": expected an object, got {_got(v)}"
    for k, x in v.items():
        err = explain(args[1], x)
        if err is not None:
            return f"[{k!r}]{err}"
    return None
