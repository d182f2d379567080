"""``response_format``: plain text, JSON mode, a JSON schema, or an xgrammar structural tag."""

from __future__ import annotations

from typing import Any

from pydantic import Field, StrictBool, field_validator, model_validator

from radixserve.schema.base import NAME_PATTERN, Body, reject

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag")
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}  # OpenAI's JSON mode: a JSON object


class JSONSchemaFormat(Body):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None  # ignored
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # absent: any JSON object
    strict: StrictBool | None = None  # ignored: the schema is always enforced


class ResponseFormat(Body):
    """``{"type": "text"}``, ``{"type": "json_object"}``,
    ``{"type": "json_schema", "json_schema": {...}}``, or (SGLang) ``{"type": "structural_tag",
    "format": {...}}`` with xgrammar's structural-tag format."""

    type: str
    json_schema: JSONSchemaFormat | None = None
    format: dict[str, Any] | None = None

    @field_validator("type")
    @classmethod
    def _type(cls, v: str) -> str:
        if v not in RESPONSE_FORMAT_TYPES:
            raise reject("", f"unknown response_format type {v!r}; expected one of "
                             f"{', '.join(RESPONSE_FORMAT_TYPES)}")
        return v

    @model_validator(mode="after")
    def _fields_match_type(self) -> ResponseFormat:
        for name, kind in (("json_schema", "json_schema"), ("format", "structural_tag")):
            given = getattr(self, name) is not None
            if given != (self.type == kind):
                raise reject(name,
                             f"response_format.{name} is required with type {kind!r}" if not given
                             else f"response_format.{name} is only valid with type {kind!r}")
        return self
