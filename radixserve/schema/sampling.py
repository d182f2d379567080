"""The OpenAI bodies' sampling fields, derived from ``SamplingParams``' field specs.

Each spec with an OpenAI name (``Spec.openai``) becomes one optional pydantic field: its type
from the spec's kind, its OpenAPI schema from ``Spec.json_schema``, its check from
``Spec.check`` (the check ``SamplingParams`` runs, so the routes cannot drift apart).  A
failed check is a 400 naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    WithJsonSchema,
    create_model,
)

from radixserve.sampling import SamplingParams
from radixserve.sampling.fields import (
    BIAS,
    BOOL,
    FLOAT,
    INT,
    INT64_MAX,
    STOPS,
    TEXT,
    TOKEN_IDS,
    Spec,
    specs,
)

Int64Id = Annotated[StrictInt, Field(ge=0, le=INT64_MAX)]

# What pydantic parses each kind as, before the spec's check.
_TYPES: dict[str, Any] = {
    INT: StrictInt,
    FLOAT: StrictFloat,
    BOOL: StrictBool,
    TEXT: str,
    STOPS: str | list[str],
    TOKEN_IDS: list[Int64Id],  # pydantic names the bad element (stop_token_ids[2])
    BIAS: dict[str, StrictFloat],
}

# OpenAI field name -> (SamplingParams field name, spec)
OPENAI_SAMPLING: dict[str, tuple[str, Spec]] = {
    spec.openai: (name, spec) for name, spec in specs(SamplingParams).items() if spec.openai
}


def _checked(name: str, spec: Spec) -> AfterValidator:
    """The spec's check; the field keeps the value normalised as ``SamplingParams`` holds it
    (a stop string as a list, logit_bias keys as ints)."""
    def check(value: Any) -> Any:
        return None if value is None else spec.check(name, name, value, openai=True)

    return AfterValidator(check)


def _field(name: str, spec: Spec) -> tuple[Any, None]:
    schema = {"anyOf": [spec.json_schema(openai=True), {"type": "null"}]}
    return Annotated[_TYPES[spec.kind] | None, _checked(name, spec), WithJsonSchema(schema)], None


def sampling_fields_model(base: type[BaseModel]) -> type[BaseModel]:
    """``base`` with one optional field per OpenAI sampling field (null: the default)."""
    return create_model(  # type: ignore[call-overload, no-any-return]
        "OpenAISamplingFields", __base__=base,
        **{openai: _field(openai, spec) for openai, (_, spec) in OPENAI_SAMPLING.items()},
    )


def sampling_values(body: BaseModel) -> dict[str, Any]:
    """The body's sampling fields under ``SamplingParams``' names (None: not given)."""
    return {name: getattr(body, openai) for openai, (name, _) in OPENAI_SAMPLING.items()}
