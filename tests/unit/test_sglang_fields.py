"""SGLang's request fields (``sglang_fields.SGLANG_FIELDS``): what SGLang's router forwards is
accepted; each field of the table at null or its default is accepted on every route it lists
and changes nothing; a value asking for a feature radixserve lacks, or of the wrong type, is a
400 naming the field; ``sampling_seed`` is ``seed``.  Also the chat fields SGLang adds that
radixserve implements (``stream_reasoning``, ``rid``, message ``reasoning_content``, ...).
Unit tests on the pydantic models, errors described as the HTTP handler describes them."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from radixserve.chat.parsers import ContentDelta, ReasoningDelta, ToolCallStart
from radixserve.frontend.chat_api import _hold_reasoning
from radixserve.frontend.errors import _describe_validation
from radixserve.frontend.native_protocol import GenerateRequest
from radixserve.frontend.openai_common import choice_rids
from radixserve.frontend.protocol import ChatCompletionRequest, CompletionRequest
from radixserve.frontend.sglang_fields import SGLANG_FIELDS, SGLangField
from radixserve.sampling import SamplingParams

MSG = [{"role": "user", "content": "Is it sunny in Oslo?"}]

# What sglang-router 0.3.2 forwarded to a worker (captured by a stand-in worker that logged
# the bodies it got), for plain client requests: it rebuilds each body from SGLang's request
# schemas, adding their defaults, dropping fields they lack (on chat: cache_salt, priority,
# return_cache_report, rid, user, add_generation_prompt, prediction; on /generate:
# return_cache_report and, in sampling_params, seed and logit_bias) and renaming max_tokens to
# max_completion_tokens on chat.  /v1/completions bodies pass through with defaults added.
ROUTER_GENERATE = {
    "text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "sampling_seed": 3},
    "model": None, "stream": False, "return_text_in_logprobs": False, "log_metrics": True,
    "return_hidden_states": False, "background": False, "no_logs": False, "return_bytes": False,
    "return_entropy": False,
}
ROUTER_GENERATE_BATCH = {
    "input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 4}, "model": None,
    "return_text_in_logprobs": False, "stream": False, "log_metrics": True, "return_hidden_states": False,
    "background": False, "no_logs": False, "return_bytes": False, "return_entropy": False,
}
ROUTER_CHAT = {
    "messages": [{"content": "s", "role": "system"}, {"content": "d", "role": "developer"},
                 {"content": [{"text": "hi", "type": "text"}], "role": "user"},
                 {"role": "assistant", "tool_calls": [
                     {"function": {"arguments": None, "name": "f"}, "id": "c1", "type": "function"}]},
                 {"content": "r", "role": "tool", "tool_call_id": "c1"},
                 {"content": "x", "reasoning_content": "think", "role": "assistant"},
                 {"content": "again", "role": "user"}],
    "model": "tiny", "max_completion_tokens": 4, "temperature": 0.0, "seed": 5, "sampling_seed": 5,
    "continue_final_message": False, "ignore_eos": False, "logprobs": False, "no_stop_trim": False,
    "return_hidden_states": False, "separate_reasoning": True, "skip_special_tokens": True, "stream": False,
    "stream_reasoning": True,
}
ROUTER_COMPLETIONS = {
    "prompt": "hi", "model": "tiny", "max_tokens": 4, "echo": False, "ignore_eos": False, "no_stop_trim": False,
    "return_hidden_states": False, "skip_special_tokens": True, "stream": False, "sampling_seed": 4,
    "cache_salt": "tenant-a",
}

ROUTES: dict[str, tuple[type[BaseModel], dict[str, Any]]] = {
    "c": (ChatCompletionRequest, {"model": "tiny", "messages": MSG}),
    "p": (CompletionRequest, {"prompt": "hi"}),
    "g": (GenerateRequest, {"text": "hi"}),
}
# A value of each JSON kind that asks for something.
ASKING = {bool: True, int: 3, str: "adapter-1", list: ["adapter-1"], dict: {"id": "s1"}}


def rejection(model: type[BaseModel], body: dict[str, Any]) -> tuple[str, str | None]:
    """(message, param) exactly as the HTTP error handler reports the validation error."""
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return _describe_validation(RequestValidationError(info.value.errors()))


def with_field(route: str, name: str, value: Any) -> tuple[type[BaseModel], dict[str, Any], str]:
    """The route's model, a small body carrying ``name: value``, and the field's path."""
    if route == "s":
        return GenerateRequest, {"text": "hi", "sampling_params": {"max_new_tokens": 2, name: value}}, \
            f"sampling_params.{name}"
    model, base = ROUTES[route]
    return model, copy.deepcopy(base) | {name: value}, name


def plain(route: str) -> BaseModel:
    """The small body of ``with_field`` without the field, validated."""
    if route == "s":
        return GenerateRequest.model_validate({"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    model, base = ROUTES[route]
    return model.model_validate(base)


def fits(value: Any, kinds: tuple[type, ...]) -> bool:
    return bool in kinds if isinstance(value, bool) else isinstance(value, kinds)


def same_request(a: BaseModel, b: BaseModel) -> bool:
    return a.model_dump() == b.model_dump()


CASES = [(name, spec, route) for name, spec in SGLANG_FIELDS.items() for route in spec.routes]
IDS = [f"{name}-{route}" for name, _, route in CASES]


# ---------------------------------------------------------------- what the router sends


@pytest.mark.parametrize("model, body", [
    (GenerateRequest, ROUTER_GENERATE), (GenerateRequest, ROUTER_GENERATE_BATCH),
    (ChatCompletionRequest, ROUTER_CHAT), (CompletionRequest, ROUTER_COMPLETIONS),
], ids=["generate", "generate-batch", "chat", "completions"])
def test_what_the_router_forwards_is_accepted(model: type[BaseModel], body: dict[str, Any]) -> None:
    model.model_validate(body)


def test_router_bodies_mean_what_the_client_asked() -> None:
    gen = GenerateRequest.model_validate(ROUTER_GENERATE)
    assert gen.sampling_params == {"max_new_tokens": 4, "temperature": 0.0, "seed": 3}
    assert gen.model is None and gen.text == "hi"
    chat = ChatCompletionRequest.model_validate(ROUTER_CHAT)
    assert chat.seed == 5 and chat.max_new_tokens == 4 and chat.stream_reasoning
    assert chat.messages[3].tool_calls[0].function.arguments == "{}"  # null: a call without arguments
    assert chat.messages[5].reasoning_content == "think"
    comp = CompletionRequest.model_validate(ROUTER_COMPLETIONS)
    assert comp.seed == 4 and comp.hints()[0].extra_key == "tenant-a"


# ---------------------------------------------------------------- the table, field by field


@pytest.mark.parametrize("name, spec, route", CASES, ids=IDS)
def test_unset_or_default_is_accepted_and_changes_nothing(name: str, spec: SGLangField, route: str) -> None:
    model, body, _ = with_field(route, name, None)
    assert same_request(model.model_validate(body), plain(route))
    if spec.lacks:  # the default, and empty values (a batch's list of nulls)
        for unset in [v for v in (spec.default, "", [None, None], {}) if v is not None and fits(v, spec.kinds)]:
            model, body, _ = with_field(route, name, unset)
            assert same_request(model.model_validate(body), plain(route)), unset


@pytest.mark.parametrize("name, spec, route", [c for c in CASES if c[1].lacks],
                         ids=[i for i, c in zip(IDS, CASES, strict=True) if c[1].lacks])
def test_asking_for_what_radixserve_lacks_is_refused_naming_the_field(name: str, spec: SGLangField,
                                                                      route: str) -> None:
    for kind in spec.kinds:
        value = ASKING[kind]
        if value == spec.default and type(value) is type(spec.default):
            continue
        model, body, path = with_field(route, name, value)
        message, param = rejection(model, body)
        assert param == path, (value, message)
        assert message == f"'{path}' asks for {spec.lacks}, which radixserve does not support"


@pytest.mark.parametrize("name, spec, route", CASES, ids=IDS)
def test_a_value_of_the_wrong_type_is_refused_naming_the_field(name: str, spec: SGLangField, route: str) -> None:
    wrong = next(v for v in (5, "x", True, {"k": "v"}, ["x"]) if not fits(v, spec.kinds))
    model, body, path = with_field(route, name, wrong)
    message, param = rejection(model, body)
    assert param == path and message.startswith(f"'{path}' must be "), message


@pytest.mark.parametrize("name, spec, route", [c for c in CASES if c[1].ignored],
                         ids=[i for i, c in zip(IDS, CASES, strict=True) if c[1].ignored])
def test_ignored_fields_take_any_value_of_their_type(name: str, spec: SGLangField, route: str) -> None:
    for kind in spec.kinds:
        model, body, _ = with_field(route, name, {"team": "a"} if kind is dict else ASKING[kind])
        assert same_request(model.model_validate(body), plain(route))


def test_data_parallel_rank_zero_is_this_server() -> None:
    for name in ("data_parallel_rank", "routed_dp_rank"):
        GenerateRequest.model_validate({"text": "hi", name: 0})
        message, param = rejection(GenerateRequest, {"text": "hi", name: 1})
        assert param == name and "data-parallel rank other than 0" in message


def test_sampling_seed_is_seed() -> None:
    assert ChatCompletionRequest.model_validate({"messages": MSG, "sampling_seed": 7}).seed == 7
    assert CompletionRequest.model_validate({"prompt": "x", "sampling_seed": 7, "seed": 7}).seed == 7
    batch = GenerateRequest.model_validate({"text": ["a", "b"], "sampling_params": [{"sampling_seed": 1}, {"seed": 2}]})
    assert batch.sampling_params == [{"seed": 1}, {"seed": 2}]
    message, param = rejection(CompletionRequest, {"prompt": "x", "sampling_seed": 7, "seed": 8})
    assert param == "sampling_seed" and "SGLang's name for 'seed'" in message
    message, param = rejection(GenerateRequest, {"text": ["a"], "sampling_params": [{"sampling_seed": 1, "seed": 2}]})
    assert param == "sampling_params[0].sampling_seed", message


def test_fields_belong_to_their_routes() -> None:
    """A field of another route's schema is still unknown here, and no table entry shadows a
    field the route's model implements (the table would take it away from the model)."""
    assert rejection(ChatCompletionRequest, {"messages": MSG, "log_metrics": True}) == \
        ("unknown field 'log_metrics'", "log_metrics")
    assert rejection(CompletionRequest, {"prompt": "x", "image_data": None}) == \
        ("unknown field 'image_data'", "image_data")
    params = GenerateRequest.model_validate({"text": "x", "sampling_params": {"lora_path": "a"}}).sampling_params
    with pytest.raises(ValueError, match="unknown sampling parameter"):  # the route answers 400
        SamplingParams.from_dict(params)
    for name, spec in SGLANG_FIELDS.items():
        for route in spec.routes.replace("s", ""):
            assert name not in ROUTES[route][0].model_fields, (name, route)


def test_model_on_generate_and_message_fields() -> None:
    assert GenerateRequest.model_validate({"text": "x", "model": "tiny"}).model == "tiny"
    message, param = rejection(ChatCompletionRequest, {"messages": [
        {"role": "developer", "content": "d", "tools": [{"type": "function", "function": {"name": "f"}}]}]})
    assert param == "messages[0].tools" and "tools given in a message" in message
    ChatCompletionRequest.model_validate({"messages": [{"role": "developer", "content": "d", "tools": None}]})
    message, param = rejection(ChatCompletionRequest, {"messages": [
        {"role": "user", "content": "d", "reasoning_content": "r"}]})
    assert param == "messages[0].reasoning_content" and "only valid in assistant messages" in message


def test_render_gives_reasoning_content_to_the_template() -> None:
    from radixserve.chat.render import render_chat

    class Template:  # records the messages apply_chat_template gets
        chat_template = "{{ messages }}"

        def apply_chat_template(self, msgs: list[dict[str, Any]], **kwargs: Any) -> str:
            self.msgs = msgs
            return "rendered"

    tok = Template()
    body = ChatCompletionRequest.model_validate({"messages": [
        *MSG, {"role": "assistant", "content": "yes", "reasoning_content": "the sky is clear"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "index": 0,
                                              "function": {"name": "f", "arguments": None}}]}]})
    render_chat(tok, body.messages, parser="hermes", add_generation_prompt=True, continue_final_message=False,
                kwargs={})
    assert tok.msgs[1]["reasoning_content"] == "the sky is clear" and "reasoning_content" not in tok.msgs[0]
    assert tok.msgs[2]["tool_calls"][0]["function"]["arguments"] == {}  # "{}" parsed for the template
    assert "index" not in tok.msgs[2]["tool_calls"][0]


# ---------------------------------------------------------------- implemented under SGLang's names


def test_stream_reasoning_false_sends_the_reasoning_in_one_delta() -> None:
    held: list[str] = []
    assert _hold_reasoning([ReasoningDelta("a"), ReasoningDelta("b")], held, finished=False) == []
    assert _hold_reasoning([ReasoningDelta("c"), ContentDelta("x"), ContentDelta("y")], held, finished=False) == \
        [ReasoningDelta("abc"), ContentDelta("x"), ContentDelta("y")]
    call = ToolCallStart(0, "call_1", "f")
    assert _hold_reasoning([ReasoningDelta("d"), call], held, finished=False) == [ReasoningDelta("d"), call]
    assert _hold_reasoning([ReasoningDelta("e")], held, finished=True) == [ReasoningDelta("e")]  # cut off
    assert held == []
    assert ChatCompletionRequest.model_validate({"messages": MSG, "stream_reasoning": False}).stream_reasoning is False


def test_rid_names_each_choice() -> None:
    assert choice_rids(None, 2) == [None, None]
    assert choice_rids("req-1", 1) == ["req-1"]
    assert choice_rids("req-1", 3) == ["req-1_0", "req-1_1", "req-1_2"]
    assert ChatCompletionRequest.model_validate({"messages": MSG, "rid": "req-1"}).rid == "req-1"
    assert rejection(CompletionRequest, {"prompt": "x", "rid": ""})[1] == "rid"


def test_extra_key_is_the_cache_namespace() -> None:
    assert CompletionRequest.model_validate({"prompt": "x", "extra_key": "t"}).hints()[0].extra_key == "t"
    assert ChatCompletionRequest.model_validate(
        {"messages": MSG, "extra_key": "t", "cache_salt": "t"}).hints()[0].extra_key == "t"
    message, param = rejection(CompletionRequest, {"prompt": "x", "extra_key": "t", "cache_salt": "u"})
    assert param == "extra_key" and "same cache namespace" in message
