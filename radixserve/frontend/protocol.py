"""OpenAI-compatible and native request bodies, validated by pydantic.

Every field of OpenAI's Chat Completions and (legacy) Completions request schemas is
accepted, plus the extensions SGLang and vLLM clients send (``top_k``, ``min_p``,
``min_tokens``, ``regex``, ``ebnf``, ``json_schema``, ``chat_template_kwargs``, ...).  Which
fields are implemented, ignored (``IGNORED_FIELDS``) or refused (``UNSUPPORTED``), and how
nulls and errors are handled, is in ``radixserve/schema/base.py``; the rest of SGLang's
request schemas (what its clients and router send) is the table in ``sglang_fields.py``; chat
messages are in ``radixserve/chat/messages.py``, ``response_format`` in ``response_format.py``.
Validation errors become HTTP 400 with an OpenAI-style body (see ``errors.py``).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import Field, StrictBool, StrictInt, field_validator, model_validator

from radixserve.chat.messages import (
    ApplyChatTemplateRequest,
    ChatMessage,
    ContentPart,
    FunctionDef,
    FunctionName,
    Prediction,
    ToolCall,
    ToolCallFunction,
    check_continue_final,
)
from radixserve.frontend.response_format import (
    JSON_OBJECT_SCHEMA,
    RESPONSE_FORMAT_TYPES,
    JSONSchemaFormat,
    ResponseFormat,
)
from radixserve.frontend.sglang_fields import (
    CHAT,
    COMPLETIONS,
    take_sglang_fields,
)
from radixserve.runtime.jobs import bootstraps
from radixserve.runtime.tokenizer_manager import (
    MAX_EXTRA_KEY_CHARS,
    PRIORITY_LIMIT,
    SchedulingHints,
)
from radixserve.schema.base import (
    IGNORED_FIELDS,
    INT64_MAX,
    NAME_PATTERN,
    UNSUPPORTED,
    Body,
    Port,
    RequestBody,
    Room,
    check_json_schema,
    reject,
    unsupported,
)
from radixserve.schema.sampling import sampling_fields_model, sampling_values

__all__ = [
    "IGNORED_FIELDS",
    "JSON_OBJECT_SCHEMA",
    "NAME_PATTERN",
    "RESPONSE_FORMAT_TYPES",
    "UNSUPPORTED",
    "ApplyChatTemplateRequest",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ContentPart",
    "FunctionDef",
    "FunctionName",
    "JSONSchemaFormat",
    "Prediction",
    "ResponseFormat",
    "StreamOptions",
    "ToolCall",
    "ToolCallFunction",
    "check_json_schema",
]

class StreamOptions(Body):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM: usage on every chunk (with include_usage)
    include_obfuscation: StrictBool | None = None  # ignored (IGNORED_FIELDS)


class _SamplingFields(sampling_fields_model(RequestBody)):  # type: ignore[misc]
    """Fields shared by both OpenAI routes.  The sampling fields themselves (``temperature``,
    ``stop``, SGLang's and vLLM's ``top_k``, ``min_tokens``, ...) come from ``SamplingParams``'
    specs (``radixserve/schema/sampling.py``), with their bounds and checks."""

    SGLANG_ROUTE: ClassVar[str] = ""  # which fields of ``SGLANG_FIELDS`` the route takes

    model: str | None = None
    n: StrictInt = Field(1, ge=1, le=16)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # ignored
    # Cache namespace (vLLM's name): prefixes are shared only with requests of the same salt.
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_EXTRA_KEY_CHARS)
    extra_key: str | None = Field(None, max_length=MAX_EXTRA_KEY_CHARS)  # SGLang's name for it
    lora_path: str | None = Field(None, min_length=1)  # a LoRA adapter's name (SGLang's field)
    # The request's id (SGLang): meta_info.id, /abort_request; "<rid>_<i>" for choice i of several.
    rid: str | None = Field(None, min_length=1)
    # --schedule-policy priority
    priority: StrictInt | None = Field(None, gt=-PRIORITY_LIMIT, lt=PRIORITY_LIMIT)
    # usage.cache_report: where the prompt's prefix match stopped (the first prompt's)
    return_cache_report: StrictBool = False
    # SGLang's bootstrap fields: smg's PD mode names the prefill worker and the request's room
    # (one value, or a list: one per choice of a chat, one per prompt of a completion)
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: Port | list[Port | None] | None = None
    bootstrap_room: Room | list[Room] | None = None
    # Constrained decoding: at most one of response_format (other than text), regex, ebnf,
    # json_schema.  regex and ebnf use xgrammar's dialects; the grammar backend checks them.
    response_format: ResponseFormat | None = None
    regex: str | None = Field(None, min_length=1)
    ebnf: str | None = Field(None, min_length=1)
    json_schema: str | dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _sglang_fields(cls, data: Any) -> Any:
        return take_sglang_fields(data, cls.SGLANG_ROUTE)

    @field_validator("json_schema")
    @classmethod
    def _json_schema(cls, v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if isinstance(v, str):
            try:
                parsed = json.loads(v)
            except json.JSONDecodeError as e:
                raise reject("", f"json_schema is not valid JSON: {e}") from e
            check_json_schema("json_schema", parsed, param="")
            return parsed
        check_json_schema("json_schema", v, param="")
        return v

    @model_validator(mode="after")
    def _sampling_checks(self) -> _SamplingFields:
        rf = self.response_format
        if rf is not None and rf.json_schema is not None and rf.json_schema.schema_ is not None:
            check_json_schema("response_format.json_schema.schema", rf.json_schema.schema_)
        given = [name for name in ("response_format", "regex", "ebnf", "json_schema")
                 if getattr(self, name) is not None
                 and not (name == "response_format" and rf is not None and rf.type == "text")]
        if len(given) > 1:
            raise reject(given[1], f"give at most one constraint; got {' and '.join(given)}")
        if self.extra_key and self.cache_salt and self.extra_key != self.cache_salt:
            raise reject("extra_key", "extra_key and cache_salt name the same cache namespace; "
                                      "give one of them (or both with the same value)")
        bound = self.max_new_tokens
        if self.min_tokens and bound is not None and self.min_tokens > bound:
            raise reject("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed the "
                                       f"maximum number of tokens ({bound})")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return None

    def grammar_fields(self) -> dict[str, str]:
        """The request's constraint as sampling-param fields (empty when it has none)."""
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            return {"json_schema": json.dumps(JSON_OBJECT_SCHEMA)}
        if rf is not None and rf.json_schema is not None:
            schema = rf.json_schema.schema_
            return {"json_schema": json.dumps(JSON_OBJECT_SCHEMA if schema is None else schema)}
        if rf is not None and rf.format is not None:
            return {"structural_tag": json.dumps({"type": "structural_tag", "format": rf.format})}
        if self.json_schema is not None:
            return {"json_schema": json.dumps(self.json_schema)}
        if self.regex is not None:
            return {"regex": self.regex}
        if self.ebnf is not None:
            return {"ebnf": self.ebnf}
        return {}

    @property
    def include_usage(self) -> bool:
        """A streamed response ends with a usage chunk (``stream_options.include_usage``)."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every streamed chunk also carries its choice's usage so far (vLLM's
        ``stream_options.continuous_usage_stats``, with ``include_usage``)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def hints(self, requests: int = 1, prompts: int = 1,
              lora: str | None = None) -> list[SchedulingHints]:
        """The cache namespace, priority level and bootstrap fields of each of the call's
        ``requests`` (``prompts`` prompts' choices, in order), and their LoRA adapter."""
        rooms = bootstraps(self.bootstrap_host, self.bootstrap_port, self.bootstrap_room,
                           requests, prompts)
        return [SchedulingHints(self.cache_salt or self.extra_key or "", self.priority or 0,
                                cache_report=self.return_cache_report, bootstrap=b, lora=lora)
                for b in rooms]

    def sampling_dict(self, max_new_tokens: int | None) -> dict[str, Any]:
        """SGLang sampling_params for this body (what it leaves out takes the default)."""
        d = {"max_new_tokens": max_new_tokens, **sampling_values(self), **self.grammar_fields()}
        return {k: v for k, v in d.items() if v is not None}


class ChatCompletionRequest(_SamplingFields):
    SGLANG_ROUTE: ClassVar[str] = CHAT

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: StrictInt | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    # Deprecated by OpenAI; mapped onto tools / tool_choice in _map_functions (a one-to-one
    # rename, so mapping is simpler than refusing).  Answers carry tool_calls.
    functions: list[FunctionDef] | None = Field(None, min_length=1)
    function_call: Literal["none", "auto"] | FunctionName | None = None
    # Harmless: accepted, type-checked, ignored (IGNORED_FIELDS).  Enumerated ones are typed
    # as str so a value OpenAI adds later does not turn an ignored field into a 400.
    store: StrictBool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    verbosity: str | None = None
    reasoning_effort: str | None = None
    prediction: Prediction | None = None
    # UNSUPPORTED meanings: refused when set.
    audio: Any = None
    modalities: list[Literal["text", "audio"]] | None = None
    web_search_options: Any = None
    moderation: Any = None
    # SGLang / vLLM chat extensions
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: StrictBool = True
    # false: a stream sends the reasoning in one delta, once it ends
    stream_reasoning: StrictBool = True
    continue_final_message: StrictBool = False
    add_generation_prompt: StrictBool = True

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None and (
            len(v) > 16 or any(len(k) > 64 or len(x) > 512 for k, x in v.items())
        ):
            raise ValueError(
                "metadata holds at most 16 pairs; keys up to 64 characters, values up to 512"
            )
        return v

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, tool in enumerate(v or []):
            if tool.get("type", "function") != "function":
                raise unsupported(f"tools[{i}].type", "tools[].type", param=f"[{i}].type")
            fn = tool.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise reject(f"[{i}].function.name",
                             f"tools[{i}].function.name must be a non-empty string")
            if fn.get("parameters") is not None:
                check_json_schema(f"tools[{i}].function.parameters", fn["parameters"],
                                  param=f"[{i}].function.parameters")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if isinstance(v, str) and v not in ("none", "auto", "required"):
            raise ValueError(
                f"tool_choice must be 'none', 'auto', 'required' or an object, got {v!r}"
            )
        return v

    @model_validator(mode="after")
    def _chat_checks(self) -> ChatCompletionRequest:
        for name in ("audio", "web_search_options", "moderation"):
            if getattr(self, name) is not None:
                raise unsupported(name)
        if self.modalities and "audio" in self.modalities:
            raise unsupported("modalities")
        if self.top_logprobs and not self.logprobs:
            raise reject("top_logprobs", "top_logprobs requires logprobs=true")
        check_continue_final(self)
        self._map_functions()
        return self

    def _map_functions(self) -> None:
        if self.functions is not None:
            if self.tools is not None:
                raise reject("functions", "give tools or the deprecated functions, not both")
            for i, f in enumerate(self.functions):
                if f.parameters is not None:
                    check_json_schema(f"functions[{i}].parameters", f.parameters)
            self.tools = [{"type": "function", "function": f.model_dump(exclude_none=True)}
                          for f in self.functions]
        if self.function_call is not None:
            if self.functions is None or self.tool_choice is not None:
                raise reject("function_call", "function_call needs functions, and no tool_choice")
            fc = self.function_call
            self.tool_choice = (
                fc if isinstance(fc, str) else {"type": "function", "function": {"name": fc.name}}
            )

    @property
    def legacy_functions(self) -> bool:
        """The client used the deprecated ``functions`` (it may expect ``function_call`` back)."""
        return self.functions is not None

    @property
    def max_new_tokens(self) -> int | None:
        """None when the client gave no limit: the route caps at the context length."""
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_SamplingFields):
    SGLANG_ROUTE: ClassVar[str] = COMPLETIONS

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    # OpenAI's documented default for completions; 0 (with echo) scores the prompt only.
    max_tokens: StrictInt = Field(16, ge=0, le=INT64_MAX)
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    suffix: str | None = None  # UNSUPPORTED when non-empty
    best_of: StrictInt | None = Field(None, ge=1, le=INT64_MAX)  # UNSUPPORTED when > n

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.suffix:
            raise unsupported("suffix")
        if self.max_tokens == 0 and not self.echo:
            raise reject("max_tokens", "max_tokens must be >= 1 (0 is only valid with echo=true, "
                                       "to score the prompt)")
        if self.best_of is not None and self.best_of < self.n:
            raise reject("best_of", f"best_of ({self.best_of}) must be >= n ({self.n})")
        if self.best_of is not None and self.best_of > self.n:
            raise unsupported("best_of")
        p = self.prompt
        if isinstance(p, list) and len(p) == 0:
            raise reject("prompt", "prompt must not be empty")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]
