"""Tool calls and reasoning end to end: a real `radixserve serve` process, the openai client.

The tiny random model cannot choose to call a tool, so these tests rely on the grammars that
enforce ``tool_choice="required"`` / a named function (the schemas are finite: enums, bounded
integers, booleans, so a random model always finishes a call), and on the radix cache to
show that the prompted tool format renders an agent's history identically turn after turn.
"""

from __future__ import annotations

import json
import os
import shutil

import jsonschema
import openai
import pytest
from helpers.chat_templates import THINKING_TEMPLATE, use_chat_template
from helpers.server import memory_checked_after_each_test, openai_client, serving, tiny_chat_server
from helpers.tool_schemas import SCHEMAS

TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": schema}}
         for name, schema in SCHEMAS.items()]
ASK = [{"role": "system", "content": "You are a travel assistant."},
       {"role": "user", "content": "What is the weather in Oslo this week?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}

# A Qwen3-style template that opens <think> in the prompt unless enable_thinking is false.

FLAGS = ("--max-total-tokens", "20000", "--context-length", "1024")
server = tiny_chat_server(*FLAGS)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def thinking_server(tiny_chat_model, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("thinking"))
    for name in os.listdir(tiny_chat_model):
        shutil.copy(os.path.join(tiny_chat_model, name), folder)
    use_chat_template(folder, THINKING_TEMPLATE)
    with serving(folder, *FLAGS, "--reasoning-parser", "qwen3") as srv:
        yield srv


memory_invariant = memory_checked_after_each_test("server", "thinking_server")


def chat(client: openai.OpenAI, messages: list, **kwargs):
    kwargs = {"model": "tiny", "temperature": 0, "seed": 3, "max_tokens": 60, **kwargs}
    return client.chat.completions.create(messages=messages, **kwargs)


def check_calls(calls, names=tuple(SCHEMAS)) -> None:
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed(client: openai.OpenAI, messages: list, **kwargs) -> dict:
    """What a client assembles from a stream: content, reasoning, tool calls, finish reason."""
    out = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for chunk in chat(client, messages, stream=True, **kwargs):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        out["content"] += choice.delta.content or ""
        out["reasoning"] += (choice.delta.model_extra or {}).get("reasoning_content") or ""
        for tc in choice.delta.tool_calls or []:
            entry = out["calls"].setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                assert entry["id"] is None and tc.type == "function" and tc.function.arguments == ""
                entry["id"], entry["name"] = tc.id, tc.function.name
            else:
                entry["arguments"] += tc.function.arguments
        out["finish"] = choice.finish_reason or out["finish"]
    return out


def test_required_single_call(client) -> None:
    out = chat(client, ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    check_calls(choice.message.tool_calls)


def test_required_parallel_calls(client) -> None:
    out = chat(client, ASK, tools=TOOLS, tool_choice="required", max_tokens=90)
    calls = out.choices[0].message.tool_calls
    assert len(calls) >= 1
    complete = calls if out.choices[0].finish_reason == "tool_calls" else calls[:-1]
    assert out.choices[0].finish_reason in ("tool_calls", "length")
    check_calls(complete)
    assert len({c.id for c in calls}) == len(calls)


def test_named_function(client) -> None:
    out = chat(client, ASK, tools=TOOLS, tool_choice=NAMED)
    calls = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in calls] == ["get_time"]
    check_calls(calls, names=("get_time",))


def test_legacy_functions_become_tool_calls(client) -> None:
    out = chat(client, ASK, functions=[t["function"] for t in TOOLS], function_call={"name": "get_weather"})
    calls = out.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather"]
    check_calls(calls)


def test_plain_chat_streams_unchanged(client) -> None:
    """Without tools or a reasoning parser the text passes through as is, logprobs included."""
    whole = chat(client, ASK, max_tokens=12, logprobs=True)
    text = whole.choices[0].message.content
    chunks = list(chat(client, ASK, max_tokens=12, logprobs=True, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    tokens = [t.token for c in chunks if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.content]
    assert tokens == [t.token for t in whole.choices[0].logprobs.content] and len(tokens) == 12
    assert whole.choices[0].message.tool_calls is None and whole.choices[0].finish_reason == "length"


@pytest.mark.parametrize("choice", ["required", NAMED, "auto"], ids=["required", "named", "auto"])
def test_stream_assembles_to_the_same_message(client, choice) -> None:
    kwargs = {"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": False, "max_tokens": 40}
    whole = chat(client, ASK, **kwargs).choices[0]
    got = streamed(client, ASK, **kwargs)
    calls = whole.message.tool_calls or []
    assert [(c["name"], c["arguments"]) for _, c in sorted(got["calls"].items())] == [
        (c.function.name, c.function.arguments) for c in calls]
    assert got["content"] == (whole.message.content or "")
    assert got["finish"] == whole.finish_reason
    if choice != "auto":
        assert len(calls) == 1 and whole.finish_reason == "tool_calls"
        check_calls(calls)


def test_n_choices_are_parsed_each(client) -> None:
    out = chat(client, ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
               n=3, temperature=1.0, seed=11)
    assert [c.index for c in out.choices] == [0, 1, 2]
    ids = set()
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls)
        ids.add(choice.message.tool_calls[0].id)
    assert len(ids) == 3


def test_tool_choice_none_hides_the_tools(client) -> None:
    plain = chat(client, ASK, max_tokens=1).usage.prompt_tokens
    hidden = chat(client, ASK, tools=TOOLS, tool_choice="none", max_tokens=1).usage.prompt_tokens
    shown = chat(client, ASK, tools=TOOLS, tool_choice="auto", max_tokens=1)
    assert hidden == plain
    assert shown.usage.prompt_tokens > plain + 100  # the schemas are in the prompt
    assert shown.choices[0].message.tool_calls is None


def test_agent_loop_hits_the_cache(client) -> None:
    """user -> tool call -> tool result -> answer -> next question: every step's prompt
    starts with the previous step's, so the radix cache holds all of it."""
    msgs = list(ASK)
    first = chat(client, msgs, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    check_calls([call])
    msgs += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": -3, "sky": "snow"})}]
    second = chat(client, msgs, tools=TOOLS, max_tokens=8)
    answer = second.choices[0].message
    msgs += [{"role": "assistant", "content": answer.content or "",
              **({"tool_calls": [c.model_dump() for c in answer.tool_calls]} if answer.tool_calls else {})},
             {"role": "user", "content": "And in Rome?"}]
    third = chat(client, msgs, tools=TOOLS, max_tokens=8)
    steps = [first.usage, second.usage, third.usage]
    for before, after in zip(steps, steps[1:], strict=False):
        assert after.prompt_tokens > before.prompt_tokens + before.completion_tokens - 1
        assert after.prompt_tokens_details.cached_tokens >= before.prompt_tokens


@pytest.mark.parametrize("kwargs,message", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "book_flight"}}},
     "'book_flight', which is not in tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools[0].function.parameters is not a valid JSON schema"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "must describe an object"),
    ({"tool_choice": "required"}, "needs a non-empty tools list"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "cannot be combined"),
    ({"extra_body": {"chat_template_kwargs": {"tokenize": True}}}, "chat_template_kwargs may not set"),
])
def test_bad_tool_requests_are_400(client, kwargs: dict, message: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, ASK, max_tokens=4, **kwargs)
    assert e.value.status_code == 400
    assert message in e.value.body["message"], e.value.body
    # the server keeps serving
    assert chat(client, ASK, max_tokens=2).choices[0].finish_reason == "length"


def test_reasoning_split(thinking_server) -> None:
    client = openai_client(thinking_server)
    ask = [{"role": "user", "content": "2+2?"}]
    forced = {"regex": "Two plus two[.]\n</think>\n\nFour[.]"}  # the template opened <think>
    out = chat(client, ask, extra_body=forced).choices[0].message
    assert (out.model_extra["reasoning_content"], out.content) == ("Two plus two.", "Four.")
    got = streamed(client, ask, extra_body=forced)
    assert (got["reasoning"], got["content"]) == ("Two plus two.", "Four.")
    # separate_reasoning=false: the raw text; thinking off: no reasoning expected
    raw = chat(client, ask, extra_body={**forced, "separate_reasoning": False}).choices[0].message
    assert raw.content == "Two plus two.\n</think>\n\nFour."
    off = chat(client, ask, extra_body={"regex": "Four[.]", "chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content == "Four."
    assert off.choices[0].message.model_extra["reasoning_content"] is None
    assert off.usage.prompt_tokens > chat(client, ask, max_tokens=1).usage.prompt_tokens  # closed block
