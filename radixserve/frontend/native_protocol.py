"""The native routes' request bodies: ``/generate`` (SGLang's shape), ``/cache/pin`` and
``/cache/unpin``, ``/abort_request``.  The OpenAI routes' bodies are ``protocol.py``'s."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, StrictBool, StrictInt, WithJsonSchema, field_validator, model_validator

from radixserve.chat.messages import ChatMessage
from radixserve.frontend.sglang_fields import GENERATE, SAMPLING, take_sglang_fields
from radixserve.runtime.tokenizer_manager import MAX_EXTRA_KEY_CHARS, PRIORITY_LIMIT
from radixserve.sampling.params import sampling_params_json_schema
from radixserve.schema.base import Int64, Port, RequestBody, Room, reject

_SAMPLING = sampling_params_json_schema()
# Checked by SamplingParams.from_dict (its errors name the field); documented precisely.
SamplingParamsField = Annotated[
    dict[str, Any] | list[dict[str, Any]] | None,
    WithJsonSchema({"anyOf": [_SAMPLING, {"type": "array", "items": _SAMPLING}, {"type": "null"}],
                    "description": "one object, or one per prompt of a batch"}),
]


class GenerateRequest(RequestBody):
    """Native ``/generate`` (SGLang's shape).  SGLang's fields for features radixserve lacks
    (images, LoRA, sessions, ...) are ``SGLANG_FIELDS``'s."""

    text: str | list[str] | None = None
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    sampling_params: SamplingParamsField = None
    stream: StrictBool = False
    return_logprob: StrictBool = False
    top_logprobs_num: StrictInt = Field(0, ge=0, le=20)
    # Prompt logprobs from this position on; -1: the last prompt position only (SGLang's rule).
    logprob_start_len: Int64 = -1
    return_text_in_logprobs: StrictBool = False  # each logprob entry carries its token's text
    rid: str | None = None
    # Cache namespace (one, or one per prompt of a batch); what cache_salt is on /v1 routes.
    extra_key: str | list[str | None] | None = None
    # --schedule-policy priority
    priority: StrictInt | None = Field(None, gt=-PRIORITY_LIMIT, lt=PRIORITY_LIMIT)
    # meta_info.cache_report: where the prefix match stopped and what the cache held from there
    return_cache_report: StrictBool = False
    model: str | None = None  # SGLang's router sends null; a name must be the served model's
    # (or a LoRA adapter's)
    # a LoRA adapter's name (one, or one per prompt of a batch), SGLang's field
    lora_path: str | list[str | None] | None = None
    # SGLang's bootstrap fields (one, or one per prompt): smg's PD mode names the prefill worker
    # and the request's room (radixserve/disagg)
    bootstrap_host: str | list[str | None] | None = None
    bootstrap_port: Port | list[Port | None] | None = None
    bootstrap_room: Room | list[Room] | None = None

    @model_validator(mode="before")
    @classmethod
    def _sglang_fields(cls, data: Any) -> Any:
        return take_sglang_fields(data, GENERATE)

    @field_validator("sampling_params", mode="before")
    @classmethod
    def _sglang_sampling_fields(cls, v: Any) -> Any:
        """SGLang's sampling fields radixserve has no field for (``sampling_seed`` is ``seed``)."""
        if isinstance(v, list):
            return [take_sglang_fields(d, SAMPLING, where=f"sampling_params[{i}]", param=f"[{i}]")
                    for i, d in enumerate(v)]
        return take_sglang_fields(v, SAMPLING, where="sampling_params")

    @model_validator(mode="after")
    def _check(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise reject("text", "give exactly one of text and input_ids")
        return self


class CachePinRequest(RequestBody):
    """``/cache/pin`` and ``/cache/unpin``: a prefix as ``text``, ``input_ids`` or chat
    ``messages`` (rendered by the chat template, without the generation prompt unless asked),
    in a cache namespace (``cache_salt``); ``/cache/unpin`` also takes a ``pin_id``."""

    text: str | None = Field(None, min_length=1)
    input_ids: list[StrictInt] | None = Field(None, min_length=1)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_EXTRA_KEY_CHARS)
    ttl: float | None = Field(None, gt=0, lt=1e9, allow_inf_nan=False)  # seconds; pin only
    pin_id: str | None = Field(None, min_length=1)  # unpin only

    @model_validator(mode="after")
    def _check(self) -> CachePinRequest:
        given = [n for n in ("text", "input_ids", "messages") if getattr(self, n) is not None]
        if len(given) > 1 or (not given and self.pin_id is None):
            raise reject("text",
                         "give exactly one of text, input_ids and messages (or pin_id to unpin)")
        if given and self.pin_id is not None:
            raise reject("pin_id", "give pin_id alone, or the prefix alone")
        return self


class AbortRequest(RequestBody):
    rid: str
