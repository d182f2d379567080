"""Type checks of decoded JSON values against annotations (the forms ``messages`` uses: str,
int, float, bool, None, unions of them, ``list[...]``, ``dict[str, ...]``, ``Any``, records:
dataclasses, sent as JSON objects of their fields, and ``JsonObject``: a JSON document).

``compile_test(tp)`` returns a fast ``value -> bool``; ``explain(tp, value)`` says what is
wrong and where (``"[3][0]: expected an integer, got str"``), or None.  A record's fields are
checked when it is built: ``compile_build(tp)`` returns ``value -> value`` that turns every
JSON object standing for a record into the record (ValueError saying where a field is wrong),
or None when ``tp`` holds no record.
"""

from __future__ import annotations

import dataclasses
import functools
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


class JsonObject:
    """Annotation of a JSON document served as it is (a control command's stats, tree view or
    profile): an object whose values are JSON values down to the leaves (null, booleans,
    numbers, strings, and lists and string-keyed objects of them), nothing else."""


def _json_error(v: Any) -> str | None:
    """Where ``v`` holds something other than a JSON value (``"['a'][2]: got set"``), or None."""
    stack: list[tuple[str, Any]] = [("", v)]
    while stack:
        path, x = stack.pop()
        if type(x) is dict:
            for k, y in x.items():
                if type(k) is not str:
                    return f"{path}: a key that is not a string, {k!r}"
                stack.append((f"{path}[{k!r}]", y))
        elif type(x) is list:
            stack.extend((f"{path}[{i}]", y) for i, y in enumerate(x))
        elif type(x) not in _SCALARS:
            return f"{path}: expected a JSON value, got {type(x).__name__}"
    return None


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _is_record(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


@dataclasses.dataclass(frozen=True)
class Fields:
    """A dataclass's fields as a JSON object carries them: their annotations, fast tests,
    record builders, and the required ones (a message's, or a record's inside one)."""

    hints: dict[str, Any]
    tests: dict[str, Callable[[Any], bool]]
    builds: dict[str, Callable[[Any], Any]]
    required: frozenset[str]


@functools.cache
def fields_of(tp: type) -> Fields:
    hints = typing.get_type_hints(tp)
    fields = [f for f in dataclasses.fields(tp) if f.init]
    return Fields(
        hints={f.name: hints[f.name] for f in fields},
        tests={f.name: compile_test(hints[f.name]) for f in fields},
        builds={f.name: b for f in fields if (b := compile_build(hints[f.name])) is not None},
        required=frozenset(f.name for f in fields if f.default is dataclasses.MISSING
                           and f.default_factory is dataclasses.MISSING),
    )


def check_fields(
    rec: Fields, value: dict[str, Any], head: str, where: Callable[[str], str]
) -> None:
    """The names and the types of ``value``'s fields; a ValueError starts with ``head`` for
    wrong names, with ``where(name)`` for a wrong value."""
    names = value.keys()
    if not (rec.required <= names <= rec.hints.keys()):
        raise ValueError(f"{head} has fields {sorted(names)}, expected {sorted(rec.hints)}")
    for name, item in value.items():
        if not rec.tests[name](item):
            raise ValueError(f"{where(name)}{explain(rec.hints[name], item)}")


def _build_record(tp: type, value: dict[str, Any]) -> Any:
    rec = fields_of(tp)
    check_fields(rec, value, ":", ".{}".format)
    if rec.builds:
        value = dict(value)
        build_fields(rec.builds, value, ".{}".format)
    try:
        return tp(**value)
    except (TypeError, ValueError) as e:  # the record's own checks (__post_init__)
        raise ValueError(f": {e}") from None


def build_fields(builds: dict[str, Callable[[Any], Any]], values: dict[str, Any],
                 where: Callable[[str], str]) -> None:
    """Build the records in ``values`` (in place) with the fields' builders; a ValueError
    names the field as ``where(name)`` says."""
    for name, build in builds.items():
        if name in values:
            try:
                values[name] = build(values[name])
            except ValueError as e:
                raise ValueError(f"{where(name)}{e}") from None


def compile_build(tp: Any) -> Callable[[Any], Any] | None:
    """``value -> value`` with every record in it built (its JSON object checked first);
    None when ``tp`` holds no record.  Run after ``compile_test(tp)`` passed."""
    if _is_record(tp):
        return functools.partial(_build_record, tp)
    args = typing.get_args(tp)
    if _is_union(tp):
        rest = [a for a in args if a is not type(None)]
        inner = compile_build(rest[0]) if len(rest) == 1 else None
        if inner is None:
            if any(compile_build(a) is not None for a in rest):
                raise TypeError(f"no record builder for the annotation {tp!r}")
            return None
        return lambda v: None if v is None else inner(v)
    origin = typing.get_origin(tp)
    if origin is list:
        item = compile_build(args[0])
        return None if item is None else functools.partial(_build_items, item)
    if origin is dict:
        item = compile_build(args[1])
        return None if item is None else functools.partial(_build_values, item)
    return None


def _build_items(item: Callable[[Any], Any], v: list[Any]) -> list[Any]:
    try:
        return [item(x) for x in v]
    except ValueError:
        for i, x in enumerate(v):  # the slow way, to say which item
            try:
                item(x)
            except ValueError as e:
                raise ValueError(f"[{i}]{e}") from None
        raise


def _build_values(item: Callable[[Any], Any], v: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, x in v.items():
        try:
            out[k] = item(x)
        except ValueError as e:
            raise ValueError(f"[{k!r}]{e}") from None
    return out


def _levels(tp: Any, nullable: bool = False) -> list[tuple[str, frozenset]]:
    """``(step, allowed types)`` per nesting level of ``tp`` (or null, when ``nullable``):
    ``step`` makes a level's items from the level above (``{}``), and a value fits ``tp``
    when every level's item types are among that level's allowed types."""
    if tp is Any:
        return []
    null = {type(None)} if nullable else set()
    if _is_record(tp):  # an object; its fields are checked when it is built
        return [("{}", frozenset({dict} | null))]
    if tp in _SCALARS:
        # an int is a float
        return [("{}", frozenset({float, int} if tp is float else {tp}) | null)]
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
    if tp is JsonObject:
        return lambda v: type(v) is dict and _json_error(v) is None
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
    if tp is JsonObject:
        return _json_error(v) if type(v) is dict else f": expected an object, got {_got(v)}"
    if _is_record(tp):
        return None if type(v) is dict else f": expected an object, got {_got(v)}"
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
