"""Request bodies: every field OpenAI clients send, SGLang/vLLM extensions, response_format.

Unit tests on the pydantic models (errors described exactly as the HTTP handler describes
them), then the same bodies over HTTP against a real server.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx
import jsonschema
import pytest
from fastapi.exceptions import RequestValidationError
from helpers.server import memory_checked_after_each_test, openai_client, tiny_chat_server
from openai.types import completion_create_params as comp_params
from openai.types.chat import completion_create_params as chat_params
from pydantic import BaseModel, ValidationError

from radixserve.frontend.errors import _describe_validation
from radixserve.frontend.protocol import ChatCompletionRequest, CompletionRequest
from radixserve.sampling import SamplingParams
from radixserve.schema.base import IGNORED_FIELDS, UNSUPPORTED

MSG = [{"role": "user", "content": "Is it sunny in Oslo?"}]
VERDICT = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                   "confidence": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer", "confidence"],
    "additionalProperties": False,
}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}

# Every field of OpenAI's chat schema (checked against the installed SDK below) and the
# SGLang / vLLM extensions, with values a real client sends.  Unsupported meanings are null.
FULL_CHAT: dict[str, Any] = {
    "model": "tiny",
    "messages": [
        {"role": "developer", "content": "Answer in JSON.", "name": "ops"},
        {"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
        {"role": "user", "name": "ana", "content": [
            {"type": "text", "text": "Is it sunny in Oslo?", "prompt_cache_breakpoint": {"mode": "explicit"}}]},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": [{"type": "text", "text": "sunny, 21 C"}], "tool_call_id": "call_1"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot promise tomorrow."}],
         "name": "bot"},
        {"role": "function", "name": "get_weather", "content": "sunny"},
        {"role": "user", "content": "So, yes or no?"},
    ],
    "audio": None,
    "frequency_penalty": 0.1,
    "function_call": None,
    "functions": None,
    "logit_bias": {"198": -5},
    "logprobs": True,
    "max_completion_tokens": 8,
    "max_tokens": 8,
    "metadata": {"team": "search", "ticket": "4711"},
    "modalities": ["text"],
    "moderation": None,
    "n": 2,
    "parallel_tool_calls": True,
    "prediction": {"type": "content", "content": '{"answer": "yes"}'},
    "presence_penalty": 0.1,
    "prompt_cache_key": "user-42-session",
    "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
    "prompt_cache_retention": "in_memory",
    "reasoning_effort": "low",
    "response_format": {"type": "json_schema", "json_schema": {
        "name": "verdict", "description": "a yes/no verdict", "schema": VERDICT, "strict": True}},
    "safety_identifier": "hash-5f2a",
    "seed": 7,
    "service_tier": "auto",
    "stop": ["\n\n"],
    "store": False,
    "stream": False,
    "stream_options": {"include_usage": True, "include_obfuscation": False},
    "temperature": 0.7,
    "tool_choice": "auto",
    "tools": [WEATHER_TOOL],
    "top_logprobs": 2,
    "top_p": 0.9,
    "user": "user-42",
    "verbosity": "low",
    "web_search_options": None,
    # SGLang / vLLM extensions
    "top_k": 20,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "min_tokens": 2,
    "chat_template_kwargs": {"enable_thinking": False},
    "separate_reasoning": True,
    "skip_special_tokens": True,
    "continue_final_message": False,
    "add_generation_prompt": True,
    "stop_token_ids": [2],
    "ignore_eos": False,
    "no_stop_trim": False,
    "regex": None,
    "ebnf": None,
    "json_schema": None,
}

FULL_COMPLETION: dict[str, Any] = {
    "model": "tiny",
    "prompt": "The weather in Oslo is",
    "best_of": 2,
    "echo": True,
    "frequency_penalty": 0.1,
    "logit_bias": {"198": -5},
    "logprobs": None,
    "max_tokens": 6,
    "n": 2,
    "presence_penalty": 0.1,
    "seed": 3,
    "stop": [".", "\n"],
    "stream": False,
    "stream_options": None,
    "suffix": None,
    "temperature": 0.8,
    "top_p": 0.95,
    "user": "user-42",
    "top_k": 40,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "min_tokens": 1,
    "stop_token_ids": [2],
    "ignore_eos": False,
    "skip_special_tokens": True,
    "no_stop_trim": True,
    "regex": "[a-z ]+",
}


def sdk_fields(typed_dict: Any) -> set[str]:
    return set(typed_dict.__required_keys__) | set(typed_dict.__optional_keys__)


def rejection(model: type[BaseModel], body: dict[str, Any]) -> tuple[str, str | None]:
    """(message, param) exactly as the HTTP error handler reports the validation error."""
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return _describe_validation(RequestValidationError(info.value.errors()))


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": copy.deepcopy(MSG), **fields}


# ---------------------------------------------------------------- every field is accepted


def test_full_bodies_cover_the_openai_sdk_schemas() -> None:
    assert sdk_fields(chat_params.CompletionCreateParamsNonStreaming) - FULL_CHAT.keys() == set()
    assert sdk_fields(comp_params.CompletionCreateParamsNonStreaming) - FULL_COMPLETION.keys() == set()


def test_every_chat_field_is_accepted_and_used() -> None:
    body = ChatCompletionRequest.model_validate(FULL_CHAT)
    assert [m.role for m in body.messages] == [
        "developer", "system", "user", "assistant", "tool", "assistant", "function", "user"]
    assert body.messages[2].name == "ana" and body.messages[2].text() == "Is it sunny in Oslo?"
    assert body.messages[5].text() == "I cannot promise tomorrow."
    assert body.messages[3].tool_calls[0].function.name == "get_weather"
    assert body.max_new_tokens == 8 and body.n == 2 and body.top_logprobs == 2
    assert body.chat_template_kwargs == {"enable_thinking": False} and body.separate_reasoning
    sampling = body.sampling_dict(body.max_new_tokens)
    assert sampling == {
        "max_new_tokens": 8, "min_new_tokens": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 20,
        "min_p": 0.05, "stop": ["\n\n"], "stop_token_ids": [2], "repetition_penalty": 1.1,
        "frequency_penalty": 0.1, "presence_penalty": 0.1, "seed": 7, "ignore_eos": False,
        "skip_special_tokens": True, "no_stop_trim": False, "json_schema": json.dumps(VERDICT),
        "logit_bias": {198: -5.0},
    }
    params = SamplingParams.from_dict(sampling)  # the routes hand it over unchanged
    assert params.grammar == ("json_schema", json.dumps(VERDICT)) and params.min_new_tokens == 2


def test_every_completion_field_is_accepted_and_used() -> None:
    body = CompletionRequest.model_validate(FULL_COMPLETION)
    assert body.prompts() == ["The weather in Oslo is"] and body.echo and body.best_of == 2
    sampling = body.sampling_dict(body.max_tokens)
    assert sampling["regex"] == "[a-z ]+" and sampling["min_new_tokens"] == 1
    assert sampling["no_stop_trim"] is True and sampling["max_new_tokens"] == 6
    assert SamplingParams.from_dict(sampling).grammar == ("regex", "[a-z ]+")


def test_nulls_mean_not_given() -> None:
    body = ChatCompletionRequest.model_validate(chat(n=None, logprobs=None, stream=None, temperature=None,
                                                     separate_reasoning=None, max_tokens=None))
    assert body.n == 1 and body.logprobs is False and body.stream is False and body.separate_reasoning
    assert body.max_new_tokens is None  # the chat route then allows up to the context length
    assert CompletionRequest.model_validate({"prompt": "x", "max_tokens": None}).max_tokens == 16


def test_max_tokens_defaults() -> None:
    assert ChatCompletionRequest.model_validate(chat()).max_new_tokens is None
    assert "max_new_tokens" not in ChatCompletionRequest.model_validate(chat()).sampling_dict(None)
    assert ChatCompletionRequest.model_validate(chat(max_tokens=5, max_completion_tokens=9)).max_new_tokens == 9
    assert ChatCompletionRequest.model_validate(chat(max_tokens=5)).max_new_tokens == 5
    assert CompletionRequest.model_validate({"prompt": "x"}).max_tokens == 16


# ---------------------------------------------------------------- ignored, harmless fields

HARMLESS: dict[str, Any] = {
    "store": True, "metadata": {"k": "v"}, "service_tier": "flex", "user": "u1",
    "safety_identifier": "s1", "prompt_cache_key": "k1", "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "explicit"}, "verbosity": "high", "reasoning_effort": "high",
    "prediction": {"type": "content", "content": [{"type": "text", "text": "draft"}]},
    "stream_options": {"include_obfuscation": True},
}


def test_ignored_fields_change_nothing() -> None:
    plain = ChatCompletionRequest.model_validate(chat(max_tokens=4))
    decorated = ChatCompletionRequest.model_validate(chat(max_tokens=4, **HARMLESS))
    assert decorated.sampling_dict(4) == plain.sampling_dict(4)
    assert decorated.grammar_fields() == plain.grammar_fields() == {}
    assert [m.text() for m in decorated.messages] == [m.text() for m in plain.messages]
    assert decorated.tools is None and decorated.tool_choice is None


def test_ignored_field_list_names_real_fields() -> None:
    top = {k for k in IGNORED_FIELDS if "." not in k and "[" not in k}
    assert top <= ChatCompletionRequest.model_fields.keys()
    assert set(HARMLESS) - {"stream_options"} == top


@pytest.mark.parametrize("field, value", [
    ("store", "yes"), ("metadata", {"k": 5}), ("metadata", {f"k{i}": "v" for i in range(17)}),
    ("service_tier", 3), ("verbosity", ["low"]), ("reasoning_effort", 0.5), ("prompt_cache_key", 1),
    ("prediction", {"type": "diff", "content": "x"}), ("safety_identifier", {"id": 1}),
])
def test_ignored_fields_are_still_type_checked(field: str, value: Any) -> None:
    message, param = rejection(ChatCompletionRequest, chat(**{field: value}))
    assert param is not None and param.startswith(field), (message, param)
    assert field in message


# ---------------------------------------------------------------- unsupported meanings

IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
UNSUPPORTED_CHAT: list[tuple[str, dict[str, Any], str]] = [
    ("audio", chat(audio={"voice": "alloy", "format": "mp3"}, modalities=["text", "audio"]), "audio"),
    ("modalities", chat(modalities=["text", "audio"]), "modalities"),
    ("web_search_options", chat(web_search_options={"search_context_size": "low"}), "web_search_options"),
    ("empty web_search_options", chat(web_search_options={}), "web_search_options"),
    ("moderation", chat(moderation={"model": "omni-moderation-latest"}), "moderation"),
    ("image part", chat(messages=[{"role": "user", "content": [{"type": "text", "text": "what?"}, IMAGE]}]),
     "messages[0].content[1]"),
    ("audio part", chat(messages=[{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]), "messages[0].content[0]"),
    ("file part", chat(messages=[{"role": "user", "content": [
        {"type": "file", "file": {"file_id": "file-1"}}]}]), "messages[0].content[0]"),
    ("assistant audio", chat(messages=[*MSG, {"role": "assistant", "audio": {"id": "audio_1"}}]),
     "messages[1].audio"),
    ("custom tool", chat(tools=[{"type": "custom", "custom": {"name": "sql"}}]), "tools[0].type"),
]


@pytest.mark.parametrize("name, body, param", UNSUPPORTED_CHAT, ids=[c[0] for c in UNSUPPORTED_CHAT])
def test_unsupported_meaning_is_refused_naming_the_field(name: str, body: dict[str, Any], param: str) -> None:
    message, got = rejection(ChatCompletionRequest, body)
    assert got == param, message
    assert param.split("[")[0] in message or "content parts are not supported" in message
    assert "not support" in message


def test_unsupported_completion_meanings() -> None:
    assert rejection(CompletionRequest, {"prompt": "x", "suffix": "the end"})[1] == "suffix"
    message, param = rejection(CompletionRequest, {"prompt": "x", "best_of": 3, "n": 2})
    assert param == "best_of" and "best_of > n" in message
    message, param = rejection(CompletionRequest, {"prompt": "x", "best_of": 1, "n": 2})
    assert param == "best_of" and "must be >= n" in message
    # Asking for nothing unsupported is fine: an empty suffix, best_of == n.
    CompletionRequest.model_validate({"prompt": "x", "suffix": "", "best_of": 2, "n": 2})


def test_unsupported_fields_unset_are_fine() -> None:
    body = ChatCompletionRequest.model_validate(chat(audio=None, web_search_options=None, moderation=None,
                                                     modalities=["text"]))
    assert body.audio is None and body.modalities == ["text"]
    assert set(UNSUPPORTED) >= {"audio", "modalities", "web_search_options", "moderation", "suffix", "best_of"}


@pytest.mark.parametrize("body, param", [
    ({"temprature": 0.5}, "temprature"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
    ({"stream_options": {"include_usage": True, "bogus": 1}}, "stream_options.bogus"),
    ({"messages": [{"role": "user", "content": "hi", "mood": "happy"}]}, "messages[0].mood"),
    ({"image_data": "cat.png"}, "image_data"),  # SGLang's, but a /generate field, not a chat one
])
def test_unknown_fields_are_refused(body: dict[str, Any], param: str) -> None:
    message, got = rejection(ChatCompletionRequest, chat(**body))
    assert got == param and message == f"unknown field '{param}'"


def test_error_descriptions() -> None:
    message, param = rejection(ChatCompletionRequest, chat(messages=[{"role": "user", "content": 5}]))
    assert param == "messages[0].content"  # not the union branch ("...content.str")
    assert "valid string" in message and "valid list" in message
    empty = RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
    assert _describe_validation(empty) == ("the request body is missing", None)


# ---------------------------------------------------------------- messages


def test_message_roles_parts_and_legacy_function_call() -> None:
    body = ChatCompletionRequest.model_validate(chat(messages=[
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": "{}"}},
        {"role": "function", "name": "get_weather", "content": None},
        {"role": "assistant", "refusal": "no"},
    ]))
    assert body.messages[0].text() == "ab"
    assert body.messages[1].tool_calls[0].function.name == "get_weather"  # rendered like tools
    assert body.messages[2].text() == "" and body.messages[3].text() == "no"


@pytest.mark.parametrize("message, param, fragment", [
    ({"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}, "messages[0].content",
     "only valid in assistant"),
    ({"role": "user", "content": "x", "tool_calls": []}, "messages[0].tool_calls", "only valid in assistant"),
    ({"role": "function", "content": "sunny"}, "messages[0].name", "function's name"),
    ({"role": "user", "content": [{"type": "text"}]}, "messages[0].content[0].text", "text"),
    ({"role": "user", "content": [{"type": "video", "video": "x"}]}, "messages[0].content[0].type", "text"),
    ({"role": "system"}, "messages[0].content", "needs content"),
])
def test_bad_messages_name_the_field(message: dict[str, Any], param: str, fragment: str) -> None:
    got_message, got = rejection(ChatCompletionRequest, chat(messages=[message]))
    assert got == param and fragment in got_message, (got_message, got)


def test_deprecated_functions_map_onto_tools() -> None:
    fn = {"name": "get_weather", "description": "weather", "parameters": WEATHER_TOOL["function"]["parameters"]}
    body = ChatCompletionRequest.model_validate(chat(functions=[fn], function_call={"name": "get_weather"}))
    assert body.tools == [{"type": "function", "function": fn}]
    assert body.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert body.legacy_functions
    auto = ChatCompletionRequest.model_validate(chat(functions=[fn], function_call="auto"))
    assert auto.tool_choice == "auto"
    assert rejection(ChatCompletionRequest, chat(functions=[fn], tools=[WEATHER_TOOL]))[1] == "functions"
    assert rejection(ChatCompletionRequest, chat(function_call="auto"))[1] == "function_call"
    assert rejection(ChatCompletionRequest, chat(functions=[{**fn, "name": "get weather"}]))[1] == "functions[0].name"
    bad = {**fn, "parameters": {"type": "objekt"}}
    message, param = rejection(ChatCompletionRequest, chat(functions=[bad]))
    assert param == "functions[0].parameters" and "not a valid JSON schema" in message


def test_continue_final_message_needs_a_final_assistant_message() -> None:
    ok = chat(messages=[*MSG, {"role": "assistant", "content": "It is"}], continue_final_message=True)
    assert ChatCompletionRequest.model_validate(ok).continue_final_message
    assert rejection(ChatCompletionRequest, chat(continue_final_message=True))[1] == "continue_final_message"
    both = {**ok, "add_generation_prompt": True}
    assert rejection(ChatCompletionRequest, both)[1] == "continue_final_message"


# ---------------------------------------------------------------- response_format, grammars


@pytest.mark.parametrize("fields, expected", [
    ({}, {}),
    ({"response_format": {"type": "text"}}, {}),
    ({"response_format": {"type": "json_object"}}, {"json_schema": '{"type": "object"}'}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT}}},
     {"json_schema": json.dumps(VERDICT)}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "anything"}}},
     {"json_schema": '{"type": "object"}'}),
    ({"response_format": {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}},
     {"structural_tag": '{"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}'}),
    ({"json_schema": VERDICT}, {"json_schema": json.dumps(VERDICT)}),
    ({"json_schema": json.dumps(VERDICT, indent=2)}, {"json_schema": json.dumps(VERDICT)}),
    ({"regex": r"(yes|no)\.?"}, {"regex": r"(yes|no)\.?"}),
    ({"ebnf": 'root ::= "yes" | "no"'}, {"ebnf": 'root ::= "yes" | "no"'}),
    ({"response_format": {"type": "text"}, "regex": "a+"}, {"regex": "a+"}),
])
def test_grammar_fields_mapping(fields: dict[str, Any], expected: dict[str, str]) -> None:
    body = ChatCompletionRequest.model_validate(chat(**fields))
    assert body.grammar_fields() == expected
    sampling = body.sampling_dict(16)
    assert {k: sampling[k] for k in expected} == expected
    params = SamplingParams.from_dict(sampling)
    assert params.grammar == (next(iter(expected.items())) if expected else None)
    completion = CompletionRequest.model_validate({"prompt": "x", **fields})
    assert completion.grammar_fields() == expected


@pytest.mark.parametrize("fields, param, fragment", [
    ({"response_format": {"type": "xml"}}, "response_format.type", "unknown response_format type 'xml'"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "is required"),
    ({"response_format": {"type": "text", "json_schema": {"name": "a"}}}, "response_format.json_schema",
     "only valid with type 'json_schema'"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.format", "is required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": VERDICT}}},
     "response_format.json_schema.name", "missing required field"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "my verdict", "schema": VERDICT}}},
     "response_format.json_schema.name", "should match pattern"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "v", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema",
     "response_format.json_schema.schema is not a valid JSON schema: 'objekt' is not valid"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "v", "schema": {"minimum": "0"}}}},
     "response_format.json_schema.schema", "is not a valid JSON schema"),
    ({"json_schema": {"required": "answer"}}, "json_schema", "json_schema is not a valid JSON schema"),
    ({"json_schema": "{not json"}, "json_schema", "json_schema is not valid JSON"),
    ({"json_schema": "[1, 2]"}, "json_schema", "must be a JSON schema object"),
    ({"regex": ""}, "regex", "at least 1 character"),
    ({"response_format": {"type": "json_object"}, "regex": "a+"}, "regex", "at most one constraint"),
    ({"regex": "a+", "ebnf": 'root ::= "a"'}, "ebnf", "got regex and ebnf"),
    ({"json_schema": VERDICT, "response_format": {"type": "json_schema", "json_schema": {"name": "v"}}},
     "json_schema", "got response_format and json_schema"),
])
def test_response_format_and_constraint_errors(fields: dict[str, Any], param: str, fragment: str) -> None:
    message, got = rejection(ChatCompletionRequest, chat(**fields))
    assert got == param and fragment in message, (message, got)


def test_tools_are_checked() -> None:
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}
    message, param = rejection(ChatCompletionRequest, chat(tools=[WEATHER_TOOL, bad]))
    assert param == "tools[1].function.parameters" and "tools[1].function.parameters is not a valid" in message
    assert rejection(ChatCompletionRequest, chat(tools=[{"type": "function", "function": {}}]))[1] == \
        "tools[0].function.name"
    assert rejection(ChatCompletionRequest, chat(tools=[WEATHER_TOOL], tool_choice="always"))[1] == "tool_choice"


def test_min_tokens() -> None:
    body = ChatCompletionRequest.model_validate(chat(min_tokens=3, max_tokens=3))
    assert SamplingParams.from_dict(body.sampling_dict(3)).min_new_tokens == 3
    message, param = rejection(ChatCompletionRequest, chat(min_tokens=5, max_completion_tokens=4))
    assert param == "min_tokens" and "must not exceed" in message
    assert rejection(CompletionRequest, {"prompt": "x", "min_tokens": 17})[1] == "min_tokens"  # default 16
    assert rejection(ChatCompletionRequest, chat(min_tokens=-1))[1] == "min_tokens"


# ---------------------------------------------------------------- over HTTP, a real server


server = tiny_chat_server("--max-total-tokens", "20000", "--context-length", "1024")
memory_invariant = memory_checked_after_each_test("server")


def post(server, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + route, json=body, timeout=120)


def test_chat_with_every_field_over_http(server) -> None:
    r = post(server, "/v1/chat/completions", FULL_CHAT)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for choice in out["choices"]:
        assert choice["finish_reason"] in ("stop", "length")
        tokens = choice["logprobs"]["content"]
        assert 1 <= len(tokens) <= 8 and all(len(t["top_logprobs"]) == 2 for t in tokens)
    assert 2 <= out["usage"]["completion_tokens"] <= 16


def test_completion_with_every_field_over_http(server) -> None:
    r = post(server, "/v1/completions", FULL_COMPLETION)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2 and all(c["text"].startswith("The weather in Oslo is") for c in choices)


def test_min_tokens_reaches_the_sampler(server) -> None:
    eos_first = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0,
                 "logit_bias": {"2": 100}}  # 2 is the end-of-sequence token: sampled at once
    plain = post(server, "/v1/completions", eos_first).json()
    assert plain["choices"][0]["finish_reason"] == "stop" and plain["usage"]["completion_tokens"] <= 1
    held = post(server, "/v1/completions", {**eos_first, "min_tokens": 4}).json()
    assert held["usage"]["completion_tokens"] >= 4, held


BAD_OVER_HTTP: list[tuple[str, str, dict[str, Any], str]] = [
    *[(name, "/v1/chat/completions", body, param) for name, body, param in UNSUPPORTED_CHAT],
    ("unknown field", "/v1/chat/completions", chat(guided_json=VERDICT), "guided_json"),
    ("functions and tools", "/v1/chat/completions",
     chat(functions=[{"name": "f"}], tools=[WEATHER_TOOL]), "functions"),
    ("unknown response_format type", "/v1/chat/completions", chat(response_format={"type": "xml"}),
     "response_format.type"),
    ("schema without name", "/v1/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {"schema": VERDICT}}),
     "response_format.json_schema.name"),
    ("invalid schema", "/v1/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {"name": "v", "schema": {"type": 1}}}),
     "response_format.json_schema.schema"),
    ("two constraints", "/v1/chat/completions", chat(response_format={"type": "json_object"}, ebnf="root ::= \"a\""),
     "ebnf"),
    ("json_schema extension not JSON", "/v1/completions", {"prompt": "x", "json_schema": "{"}, "json_schema"),
    ("suffix", "/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("best_of > n", "/v1/completions", {"prompt": "x", "best_of": 4}, "best_of"),
]


@pytest.mark.parametrize("name, route, body, param", BAD_OVER_HTTP, ids=[b[0] for b in BAD_OVER_HTTP])
def test_bad_field_over_http_is_a_400_naming_it(server, name: str, route: str, body: dict[str, Any],
                                                param: str) -> None:
    r = post(server, route, body)
    assert r.status_code == 400, r.text
    out = r.json()
    assert out["object"] == "error" and out["error"]["type"] == "invalid_request_error"
    assert out["error"]["param"] == param and out["error"]["code"] == 400
    named = param.split("[")[0].split(".")[-1] if "content" not in param else "content parts"
    assert named in out["error"]["message"], out["error"]
    ok = post(server, "/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_json_schema_response_format_with_the_openai_client(server) -> None:
    client = openai_client(server)
    out = client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=64, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "verdict", "schema": VERDICT, "strict": True}},
    )
    assert out.choices[0].finish_reason == "stop", out
    jsonschema.validate(json.loads(out.choices[0].message.content), VERDICT)


def test_json_schema_streaming_assembles_the_same_json(server) -> None:
    client = openai_client(server)
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT}}
    whole = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=64,
                                           temperature=0, response_format=fmt)
    chunks = list(client.chat.completions.create(model="tiny", messages=MSG, max_tokens=64,
                                                 temperature=0, response_format=fmt, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    jsonschema.validate(json.loads(streamed), VERDICT)


def test_json_object_mode_and_regex_and_ebnf_extensions(server, tiny_chat_model) -> None:
    from radixserve.tokenizer import load_tokenizer

    client = openai_client(server)
    # The random model never closes a free-form key, so push it towards "}": unconstrained it
    # answers "}" alone; JSON mode must open the object first.
    tok = load_tokenizer(tiny_chat_model)
    close, open_ = tok.convert_tokens_to_ids("}"), tok.convert_tokens_to_ids("{")
    out = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=8, temperature=0,
                                         logit_bias={str(close): 100, str(open_): 50},
                                         response_format={"type": "json_object"})
    assert out.choices[0].message.content == "{}" and out.choices[0].finish_reason == "stop"
    plain = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=2, temperature=0,
                                           logit_bias={str(close): 100})
    assert plain.choices[0].message.content.startswith("}")
    out = client.completions.create(model="tiny", prompt="Answer:", max_tokens=8, temperature=0,
                                    extra_body={"regex": "(yes|no)!"})
    assert out.choices[0].text in ("yes!", "no!")
    out = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=8, temperature=0,
                                         extra_body={"ebnf": 'root ::= "a" [0-9] "b"'})
    text = out.choices[0].message.content
    assert len(text) == 3 and text[0] == "a" and text[1].isdigit() and text[2] == "b", text


# Grammars the request body cannot check (xgrammar's own dialects): the scheduler's compiler
# refuses them, and the route answers 400 with its message.
BAD_GRAMMARS = [
    ({"regex": "[a-"}, "invalid regex", "Unclosed"),
    ({"regex": "(ab"}, "invalid regex", ""),
    ({"ebnf": 'root ::= "a" |'}, "invalid ebnf", "EBNF parser error"),
    ({"ebnf": 'start ::= "a"'}, "invalid ebnf", "root"),
]


@pytest.mark.parametrize("fields, prefix, detail", BAD_GRAMMARS, ids=[str(b[0]) for b in BAD_GRAMMARS])
@pytest.mark.parametrize("stream", [False, True])
def test_grammar_the_compiler_refuses_is_a_400(server, fields: dict[str, str], prefix: str,
                                               detail: str, stream: bool) -> None:
    body = {"model": "tiny", "messages": MSG, "max_tokens": 8, "stream": stream, **fields}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith(prefix) and detail in message, message
    ok = post(server, "/v1/chat/completions", {"model": "tiny", "messages": MSG, "max_tokens": 8,
                                               "regex": "(yes|no)"})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] in ("yes", "no")
