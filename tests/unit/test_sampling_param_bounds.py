"""Sampling parameters' bounds, without a server: values that cannot cross the process
boundary (integers beyond int64, lone surrogates) are refused on arrival naming the field, the
documented bounds are the checked ones, and /generate documents every sampling parameter.

(The same over HTTP, a request -> a 400 naming the field, is in ``tests/http/test_fuzz_api.py``.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.frontend.native_protocol import GenerateRequest
from radixserve.sampling import SamplingParams
from radixserve.sampling.params import SGLANG_ONLY_FIELDS, sampling_params_json_schema

INT_FIELDS = [f.name for f in dataclasses.fields(SamplingParams) if f.type in ("int", "int | None")]


def field_schemas() -> dict[str, dict[str, Any]]:
    """Each field's schema, without the ``null`` alternative."""
    return {name: s["anyOf"][0] for name, s in sampling_params_json_schema()["properties"].items()}


@settings(max_examples=300, deadline=None, database=None, derandomize=True)
@given(name=st.sampled_from(INT_FIELDS), value=st.integers(-(2**80), 2**80))
def test_accepted_sampling_params_cross_the_process_boundary(name: str, value: int) -> None:
    """Found by fuzzing: top_k = 2**70 passed every check, then orjson could not encode it
    (500).  Every accepted value now fits JSON's int64."""
    try:
        params = SamplingParams.from_dict({name: value, "max_new_tokens": 2**63 - 1} if name == "min_new_tokens"
                                          else {name: value})
    except ValueError as e:
        assert name in str(e)
        return
    assert SamplingParams.from_dict(orjson.loads(orjson.dumps(params.to_dict()))) == params


@pytest.mark.parametrize("name", ["max_new_tokens", "top_k", "seed", "min_new_tokens"])
def test_integers_beyond_int64_name_the_field(name: str) -> None:
    with pytest.raises(ValueError, match=f"sampling_params.{name} must fit in 64 bits"):
        SamplingParams.from_dict({name: 2**63})


@pytest.mark.parametrize("given_params, name", [
    ({"stop": ["ok", "\ud800"]}, "stop"), ({"stop": "\udfff"}, "stop"), ({"regex": "a\ud800"}, "regex"),
    ({"json_schema": "\ud800"}, "json_schema"), ({"ebnf": "\udc00"}, "ebnf"),
])
def test_lone_surrogates_name_the_field(given_params: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=f"sampling_params.{name} holds a lone UTF-16 surrogate"):
        SamplingParams.from_dict(given_params)


def test_generate_documents_every_sampling_param() -> None:
    documented = GenerateRequest.model_json_schema()["properties"]["sampling_params"]["anyOf"][0]
    assert documented["additionalProperties"] is False
    assert set(documented["properties"]) == {f.name for f in dataclasses.fields(SamplingParams)} | set(
        SGLANG_ONLY_FIELDS)


def _bounds(schema: dict[str, Any]) -> list[tuple[float, bool]]:
    """(value, accepted) at and just past each documented bound of a number field."""
    out = [b for alternative in schema.get("anyOf", []) for b in _bounds(alternative)]
    if "const" in schema:
        out.append((schema["const"], True))
    step = 1 if schema.get("type") == "integer" else 1e-6
    if "minimum" in schema:
        out += [(schema["minimum"], True), (schema["minimum"] - step, False)]
    if "exclusiveMinimum" in schema:
        out += [(schema["exclusiveMinimum"], False), (schema["exclusiveMinimum"] + step, True)]
    if "maximum" in schema:
        out += [(schema["maximum"], True), (schema["maximum"] + step, False)]
    return out


@pytest.mark.parametrize("name", sorted(field_schemas()))
def test_documented_bounds_are_the_checked_bounds(name: str) -> None:
    schema = field_schemas()[name]
    for value, accepted in _bounds(schema):
        d = {name: value, **({"max_new_tokens": max(value, 1)} if name == "min_new_tokens" else {})}
        try:
            SamplingParams.from_dict(d)
            ok = True
        except ValueError:
            ok = False
        assert ok == accepted, (name, value)
