"""One request schema: every sampling field is described once (``SamplingParams``' specs), and
``/generate`` (with ``Engine.generate``, which shares its checks), the OpenAI bodies and their
OpenAPI documents all follow it.  A bound changed in one place only fails here."""

from __future__ import annotations

import copy
import math
from dataclasses import fields
from typing import Any

import jsonschema
import pytest
from pydantic import ValidationError

from radixserve.frontend.native_protocol import GenerateRequest
from radixserve.frontend.protocol import ChatCompletionRequest, CompletionRequest
from radixserve.sampling import SamplingParams
from radixserve.sampling.fields import BIAS, BOOL, FLOAT, INT, STOPS, TEXT, TOKEN_IDS, Spec, specs
from radixserve.sampling.params import sampling_params_json_schema
from radixserve.schema.sampling import OPENAI_SAMPLING
from radixserve.validation import FieldError

SPECS = specs(SamplingParams)
MSG = [{"role": "user", "content": "hi"}]


def candidates(spec: Spec) -> list[Any]:
    """Values at and around every edge the spec draws, plus values of the wrong type."""
    wrong = ["1", True, [1], {"a": 1}]
    if spec.kind in (INT, FLOAT):
        edges = [b for b in (spec.ge, spec.gt, spec.le, spec.openai_le, spec.off, 0) if b is not None]
        near = [x + d for x in edges for d in (-1, -0.5, 0, 0.5, 1)]
        values = near + [2**63 - 1, 2**63, -(2**63) - 1, math.inf, math.nan, 1e300]
        if spec.kind == INT:
            values = [int(v) for v in values if isinstance(v, int) or float(v).is_integer()]
        return values + wrong
    if spec.kind == STOPS:
        return ["x", "", ["a"] * spec.max_items, ["a"] * (spec.max_items + 1), ["a", ""], [5], "\ud800", *wrong]
    if spec.kind == TOKEN_IDS:
        return [[], [0, 5], [-1], [True], [1.5], [2**64], *wrong]
    if spec.kind == BIAS:
        return [{}, {"5": spec.le}, {"5": spec.ge}, {"5": spec.le + 0.5}, {"-5": 1}, {"x": 1}, {"5": "1"},
                {"5": True}, *wrong]
    if spec.kind == BOOL:
        return [True, False, 0, 1, *wrong]
    assert spec.kind == TEXT
    return ["x", "\ud800", *wrong]


def native_accepts(name: str, value: Any) -> bool:
    extra = {"max_new_tokens": 2**63 - 1} if name == "min_new_tokens" else {}
    try:
        SamplingParams.from_dict({name: value, **extra})
    except FieldError as e:
        assert e.field == name, e  # the error names the field as data
        return False
    return True


def openai_accepts(field: str, value: Any) -> bool:
    try:
        ChatCompletionRequest.model_validate({"model": "m", "messages": copy.deepcopy(MSG), field: value})
    except ValidationError as e:
        # the field, in the location or (a check on the whole body) as the error's param
        at = {err["loc"][0] if err["loc"] else err["ctx"]["param"] for err in e.errors()}
        assert at == {field}, e
        return False
    return True


CASES = [(openai, name, value) for openai, (name, spec) in OPENAI_SAMPLING.items() for value in candidates(spec)]


@pytest.mark.parametrize(("openai", "name", "value"), CASES, ids=[f"{o}={v!r}"[:60] for o, _, v in CASES])
def test_the_openai_routes_and_generate_accept_the_same_values(openai: str, name: str, value: Any) -> None:
    spec = SPECS[name]
    native = native_accepts(name, value)
    if spec.openai_le is not None and isinstance(value, (int, float)) and not isinstance(value, bool) \
            and native and value > spec.openai_le:
        assert not openai_accepts(openai, value)  # OpenAI's narrower documented range
        return
    assert openai_accepts(openai, value) == native


def test_every_field_carries_a_spec_and_every_default_passes_it() -> None:
    assert [f.name for f in fields(SamplingParams)] == list(SPECS)
    defaults = SamplingParams()
    for name, spec in SPECS.items():
        value = getattr(defaults, name)
        if value is not None:
            assert spec.check(name, name, value) == value


def test_the_openapi_documents_are_the_specs() -> None:
    native = sampling_params_json_schema()["properties"]
    for name, spec in SPECS.items():
        assert native[name]["anyOf"][0] == spec.json_schema()
    for body in (ChatCompletionRequest, CompletionRequest):
        props = body.model_json_schema()["properties"]
        for openai, (_, spec) in OPENAI_SAMPLING.items():
            assert props[openai]["anyOf"][0] == spec.json_schema(openai=True)
            jsonschema.validators.validator_for(props[openai]).check_schema(props[openai])
    generate = GenerateRequest.model_json_schema()["properties"]["sampling_params"]["anyOf"]
    assert generate[0] == sampling_params_json_schema()


@pytest.mark.parametrize("stop", [["s"] * 17, [f"s{i}" for i in range(20)]])
def test_at_most_16_stop_sequences_on_every_route(stop: list[str]) -> None:
    with pytest.raises(FieldError, match="at most 16 stop sequences") as info:
        SamplingParams.from_dict({"stop": stop})  # /generate and Engine.generate
    assert info.value.field == "stop"
    for body in (ChatCompletionRequest, CompletionRequest):
        extra = {"messages": MSG} if body is ChatCompletionRequest else {"prompt": "hi"}
        with pytest.raises(ValidationError, match="at most 16 stop sequences"):
            body.model_validate({"model": "m", "stop": stop, **extra})
    assert SamplingParams.from_dict({"stop": stop[:16]}).stop == stop[:16]
