"""What every request body shares: the base model, the field groups, and errors naming a field.

OpenAI's fields fall in three groups:

- implemented: they change what radixserve generates or returns;
- ``IGNORED_FIELDS``: accepted, type-checked and ignored, because ignoring them cannot
  change an answer a client relies on;
- ``UNSUPPORTED``: their only meaning is something radixserve does not do (audio, images,
  web search, ...).  Leaving them unset or null is fine; asking for that meaning is a 400
  naming the field.

SGLang's own extensions (what its clients and router send) are one table of their own,
``sglang_fields.SGLANG_FIELDS``, on the same rules.

A field nobody defines is a 400 naming it (``extra="forbid"`` on :class:`Body`), and an
explicit ``null`` means "not given" for every optional field (OpenAI's own schema marks them
nullable, and some clients send nulls).  Checks that span several fields raise ``reject``,
whose ``param`` the error handler (``errors.py``) appends to the error's location.
"""

from __future__ import annotations

from typing import Annotated, Any

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator
from pydantic_core import PydanticCustomError

from radixserve.validation import is_text

NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for schema and function names

# Accepted, type-checked, ignored: field -> why ignoring it is harmless (listed on the docs'
# HTTP API page).
IGNORED_FIELDS: dict[str, str] = {
    "store": "nothing is stored for later retrieval",
    "metadata": "only meaningful for stored completions",
    "service_tier": "every request is served the same way",
    "user": "an end-user id for OpenAI's abuse monitoring",
    "safety_identifier": "an end-user id for OpenAI's abuse monitoring",
    "prompt_cache_key": "the radix tree reuses every shared prefix without a key",
    "prompt_cache_retention": "cached prefixes stay until memory pressure evicts them (LRU)",
    "prompt_cache_options": "cached prefixes stay until memory pressure evicts them (LRU)",
    "messages[].content[].prompt_cache_breakpoint": "every prefix is cached, not only marked ones",
    "verbosity": "a hint for OpenAI's models; the model here is sampled as is",
    "reasoning_effort": "a hint for OpenAI's reasoning models (use chat_template_kwargs to "
    "switch a template's thinking mode)",
    "prediction": "a latency hint (predicted outputs); the output is the same without it",
    "stream_options.include_obfuscation": "stream chunks carry no padding",
    "response_format.json_schema.strict": "the schema is always enforced in full",
    "response_format.json_schema.description": "not shown to the model",
}

# Refused with a 400 when the request asks for them: field -> the meaning radixserve lacks.
UNSUPPORTED: dict[str, str] = {
    "audio": "audio output",
    "modalities": "the 'audio' output modality (['text'] is accepted)",
    "web_search_options": "web search",
    "moderation": "moderation of the input and output",
    "messages[].content[]": "image_url, input_audio, file (and video_url, audio_url) parts: "
    "radixserve serves text-only models",
    "messages[].audio": "a reference to an earlier audio answer",
    "messages[].tools": "tools given in a message (give them in the request's tools)",
    "tools[].type": "tool types other than 'function' (custom tools)",
    "suffix": "a non-empty suffix (insertion)",
    "best_of": "best_of > n (server-side candidates ranked by log probability)",
}


Port = Annotated[StrictInt, Field(ge=1, le=65535)]  # a TCP port (SGLang's bootstrap_port)
# SGLang's bootstrap_room: an unsigned 64-bit number
Room = Annotated[StrictInt, Field(ge=0, lt=2**64)]


def reject(param: str, message: str) -> PydanticCustomError:
    """A validation error whose ``param`` (a path below where it is raised: ``"audio"``,
    ``"[2].type"`` or ``""``) the HTTP error handler reports.  The message names the field too."""
    return PydanticCustomError("invalid_request", "{message}", {"param": param, "message": message})


def refuse_meaning(where: str, meaning: str, param: str | None = None) -> PydanticCustomError:
    """Refuse the field at ``where`` (its full path; ``param`` as in ``check_json_schema``)
    for asking for ``meaning``, something radixserve does not do."""
    return reject(where if param is None else param,
                  f"'{where}' asks for {meaning}, which radixserve does not support")


def unsupported(
    where: str, key: str | None = None, param: str | None = None
) -> PydanticCustomError:
    """Refuse the field at ``where`` for asking for ``UNSUPPORTED[key or where]``."""
    return refuse_meaning(where, UNSUPPORTED[key or where], param)


def check_json_schema(where: str, schema: Any, param: str | None = None) -> None:
    """Raise ``reject`` unless ``schema`` is a valid JSON schema object.  ``where`` is the
    field's full path, for the message; ``param`` its path below the validator (default
    ``where``, right for checks on a whole request)."""
    param = where if param is None else param
    if not isinstance(schema, dict):
        raise reject(param, f"{where} must be a JSON schema object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise reject(param, f"{where} is not a valid JSON schema: {e.message}") from e


# The base of every body and nested object: unknown fields are refused, a null optional
# field takes its default.
class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        optional = {f.alias or name for name, f in cls.model_fields.items() if not f.is_required()}
        return {k: v for k, v in data.items() if v is not None or k not in optional}


def _lone_surrogate(value: Any, path: str = "") -> str | None:
    """The path (``messages[0].content``) of a string holding a lone surrogate, if any."""
    if isinstance(value, str):
        return None if is_text(value) else path
    if isinstance(value, list):
        for i, x in enumerate(value):
            found = _lone_surrogate(x, f"{path}[{i}]")
            if found is not None:
                return found
    elif isinstance(value, dict):
        for k, x in value.items():
            bad_key = not is_text(str(k))
            key = str(k).encode("utf-8", "backslashreplace").decode() if bad_key else str(k)
            where = f"{path}.{key}" if path else key
            found = where if bad_key else _lone_surrogate(x, where)
            if found is not None:
                return found
    return None


class RequestBody(Body):
    """A whole request body: besides ``Body``'s rules, every string (keys too) is valid
    Unicode text."""

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        where = _lone_surrogate(data)
        if where is not None:
            raise reject(where, f"'{where or 'the body'}' holds a lone UTF-16 surrogate "
                                "(\\ud800-\\udfff), which is not valid Unicode text")
        return data


# Integers that reach the scheduler cross a process boundary as JSON, which carries int64.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Int64 = Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)]
