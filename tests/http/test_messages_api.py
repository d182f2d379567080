"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) end to end: a
real `radixserve serve` process on the tiny chat model, the official ``anthropic`` client.

The tiny random model cannot choose to call a tool, so tool calls are held to the grammar of
``tool_choice`` ``tool`` / ``any`` (finite schemas, so a call always finishes), as on the chat
route.  Greedy answers are compared with ``/v1/chat/completions``' for the same conversation:
both routes run one chat request.
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
from helpers.api_clients import anthropic_client, post_raw, server_pins
from helpers.server import memory_checked_after_each_test, openai_client, tiny_chat_server
from helpers.tool_schemas import SCHEMAS, WEATHER

from radixserve.chat.anthropic import FIELD_RENAMES, CountTokensRequest, field_names
from radixserve.frontend.errors import APIError, renamed

server = tiny_chat_server("--max-total-tokens", "20000", "--context-length", "1024",
                          "--max-request-body-bytes", "65536")
memory_invariant = memory_checked_after_each_test("server")

TOOLS = [{"name": name, "description": f"{name} tool", "input_schema": schema}
         for name, schema in SCHEMAS.items()]
SYSTEM = "You are a travel assistant. " * 30  # long enough to span many pages
ASK = [{"role": "user", "content": "What is the weather in Oslo this week?"}]
# The client of this SDK version has no sampling arguments; older ones send these fields.
GREEDY = {"temperature": 0, "top_k": 1}


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic_client(server)


def test_create_is_the_chat_request_of_the_same_conversation(server, client) -> None:
    msg = client.messages.create(model="tiny", max_tokens=12, system="Be brief.", messages=ASK,
                                 extra_body=GREEDY)
    chat = openai_client(server).chat.completions.create(
        model="tiny", max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, *ASK])
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == chat.choices[0].message.content
    assert msg.usage.output_tokens == chat.usage.completion_tokens
    usage = msg.usage
    total = usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
    assert total == chat.usage.prompt_tokens
    expected = "max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn"
    assert msg.stop_reason == expected


def test_stream_events_assemble_to_the_created_message(client) -> None:
    args = {"model": "tiny", "max_tokens": 10, "messages": ASK, "extra_body": GREEDY,
            "system": [{"type": "text", "text": "Be brief."}]}
    created = client.messages.create(**args)
    with client.messages.stream(**args) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[-2] == "message_delta" and "content_block_start" in kinds
    assert kinds.index("content_block_start") < kinds.index("content_block_stop")
    assert final.content[0].text == created.content[0].text
    assert final.stop_reason == created.stop_reason
    assert final.usage.output_tokens == created.usage.output_tokens


def test_stop_sequence_is_reported(client) -> None:
    free = client.messages.create(model="tiny", max_tokens=16, messages=ASK, extra_body=GREEDY)
    text = free.content[0].text
    stop = text[len(text) // 2:][:2]
    assert len(stop) == 2, text
    cut = client.messages.create(model="tiny", max_tokens=16, messages=ASK, extra_body=GREEDY,
                                 stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]


def test_tool_use_round_trip_with_tool_result(client) -> None:
    first = client.messages.create(model="tiny", max_tokens=200, messages=ASK, tools=TOOLS,
                                   tool_choice={"type": "tool", "name": "get_weather"})
    assert first.stop_reason == "tool_use"
    calls = [b for b in first.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].id.startswith("toolu_")
    jsonschema.validate(calls[0].input, WEATHER)
    # The answer's blocks handed back as they came, as Anthropic's examples do.
    history = [*ASK, {"role": "assistant", "content": first.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                             "content": "Sunny, 21 C"}]}]
    count = client.messages.count_tokens(model="tiny", messages=history, tools=TOOLS)
    second = client.messages.create(model="tiny", max_tokens=8, messages=history, tools=TOOLS)
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in second.content] == ["text"]
    usage = second.usage
    assert count.input_tokens == (usage.input_tokens + usage.cache_read_input_tokens
                                  + usage.cache_creation_input_tokens)
    # The history renders as the first turn's prompt continued: its prefix comes from the cache.
    assert usage.cache_read_input_tokens > 0


def test_streamed_tool_use_sends_input_json_deltas(client) -> None:
    with client.messages.stream(model="tiny", max_tokens=200, messages=ASK, tools=TOOLS,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                ) as stream:
        deltas: dict[int, list[str]] = {}
        for e in stream:
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta":
                deltas.setdefault(e.index, []).append(e.delta.partial_json)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    calls = {i: b for i, b in enumerate(final.content) if b.type == "tool_use"}
    assert len(calls) == 1 and set(deltas) == set(calls)
    for i, call in calls.items():  # each block's deltas are its input, as JSON text
        assert call.name in SCHEMAS and json.loads("".join(deltas[i])) == call.input
        jsonschema.validate(call.input, SCHEMAS[call.name])


def test_count_tokens_counts_system_tools_and_messages(client) -> None:
    bare = client.messages.count_tokens(model="tiny", messages=ASK).input_tokens
    with_system = client.messages.count_tokens(model="tiny", messages=ASK, system=SYSTEM)
    with_tools = client.messages.count_tokens(model="tiny", messages=ASK, tools=TOOLS)
    assert 0 < bare < with_system.input_tokens and bare < with_tools.input_tokens
    msg = client.messages.create(model="tiny", max_tokens=2, messages=ASK, system=SYSTEM)
    usage = msg.usage
    assert with_system.input_tokens == (usage.input_tokens + usage.cache_read_input_tokens
                                        + usage.cache_creation_input_tokens)


def test_cache_control_pins_the_prefix_and_reports_reads(server, client) -> None:
    system = [{"type": "text", "text": "You plan trips to Lisbon. " * 40,
               "cache_control": {"type": "ephemeral"}}]
    first = client.messages.create(model="tiny", max_tokens=2, system=system,
                                   messages=[{"role": "user", "content": "Day one?"}])
    # What the tree held before (the template's opening, from earlier tests) is read; the rest
    # of the pinned prefix is created.
    created, read = first.usage.cache_creation_input_tokens, first.usage.cache_read_input_tokens
    prefix = created + read
    assert created > 200 and read < 20
    pins = [p for p in server_pins(server) if p["tokens"] == prefix]
    assert len(pins) == 1 and 250 < pins[0]["expires_in"] <= 300, (prefix, server_pins(server))
    again = client.messages.create(model="tiny", max_tokens=2, system=system,
                                   messages=[{"role": "user", "content": "Day two?"}])
    assert again.usage.cache_read_input_tokens >= prefix
    assert again.usage.cache_creation_input_tokens == 0
    # The same prefix is held by one pin whose TTL restarted, not by one pin per request.
    assert len([p for p in server_pins(server) if p["tokens"] == prefix]) == 1
    hour = [{**system[0], "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    client.messages.create(model="tiny", max_tokens=2, system=hour,
                           messages=[{"role": "user", "content": "Day three?"}])
    longest = max(p["expires_in"] for p in server_pins(server) if p["tokens"] == prefix)
    assert longest > 3000


def _anthropic_error(response) -> str:
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    return body["error"]["type"]


@pytest.mark.parametrize(("body", "fragment"), [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_never", "content": "42"}]}]},
     "answers no tool_use"),
    ({"messages": ASK, "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"messages": ASK, "temperature": 1.5}, "temperature"),
    ({"messages": ASK, "unknown_field": 1}, "unknown_field"),
    ({"messages": [], "max_tokens": 4}, "messages"),
])
def test_bad_input_is_a_400_in_anthropic_shape(server, client, body, fragment) -> None:
    full = {"model": "tiny", "max_tokens": 4, **body}
    r = post_raw(server, "/v1/messages", full)
    assert r.status_code == 400 and _anthropic_error(r) == "invalid_request_error"
    assert fragment in r.json()["error"]["message"]
    named = ("model", "max_tokens", "messages")
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(**{k: full[k] for k in named},
                               extra_body={k: v for k, v in full.items() if k not in named})
    if "max_tokens" in body:
        return
    r = post_raw(server, "/v1/messages/count_tokens", body)
    assert r.status_code == 400 and _anthropic_error(r) == "invalid_request_error"
    assert client.messages.create(model="tiny", max_tokens=2, messages=ASK).content  # still serves


def test_oversized_and_malformed_bodies_and_unknown_model(server, client) -> None:
    big = {"model": "tiny", "max_tokens": 4,
           "messages": [{"role": "user", "content": "x" * 70000}]}
    r = post_raw(server, "/v1/messages", big)
    assert r.status_code == 413 and _anthropic_error(r) == "request_too_large"
    r = post_raw(server, "/v1/messages", b"{not json")
    assert r.status_code == 400 and _anthropic_error(r) == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError, match="does not exist"):
        client.messages.create(model="claude-nope", max_tokens=4, messages=ASK)
    r = post_raw(server, "/v1/chat/completions", {"model": "tiny", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"  # OpenAI's shape
    assert client.messages.create(model="tiny", max_tokens=2, messages=ASK).content


BAD_SCHEMA = {"type": 5}  # not a JSON schema


@pytest.mark.parametrize(("body", "named", "unsent"), [
    ({"stop_sequences": [""]}, "'stop_sequences'", "'stop'"),
    ({"tools": [{"name": "f", "input_schema": BAD_SCHEMA}]}, "tools[0].input_schema", "function"),
    ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "tools[0].input_schema",
     "function"),
    ({"tool_choice": {"type": "any"}}, "tool_choice {'type': 'any'}", "'required'"),
    ({"tools": TOOLS, "tool_choice": {"type": "any"}, "output_config": {"format": {
        "type": "json_schema", "schema": {"type": "object"}}}}, "output_config.format",
     "response_format"),
])
def test_errors_name_the_messages_field_the_client_sent(server, body, named, unsent) -> None:
    """The request runs as a chat request; its errors speak of the Messages fields (and
    values) the client sent, not of the chat fields they became."""
    r = post_raw(server, "/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": ASK,
                                          **body})
    assert r.status_code == 400 and _anthropic_error(r) == "invalid_request_error", r.text
    message = r.json()["error"]["message"]
    assert named in message and unsent not in message, message


def test_chat_message_fields_map_back_to_blocks() -> None:
    body = CountTokensRequest.model_validate({"system": "Be brief.", "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Call it.", "signature": ""},
            {"type": "tool_use", "id": "t1", "name": "f", "input": {}},
            {"type": "tool_use", "id": "t2", "name": "g", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "1"},
            {"type": "tool_result", "tool_use_id": "t2", "content": "2"},
            {"type": "text", "text": "Thanks."}]}]})
    names = field_names(body)

    def rename(path: str) -> str | None:
        return renamed(APIError(f"{path} is wrong", 400, path), names, FIELD_RENAMES).param

    assert rename("messages[0].content") == "system"
    assert rename("messages[1].content") == "messages[0].content"
    assert rename("messages[2].tool_calls[1].function.arguments") == "messages[1].content[2].input"
    assert rename("messages[2].reasoning_content") == "messages[1].content[0].thinking"
    assert rename("messages[4].content") == "messages[2].content[1].content"
    assert rename("messages[5].content") == "messages[2].content"
    assert rename("tools[1].function.parameters") == "tools[1].input_schema"
    assert rename("stop[3]") == "stop_sequences[3]" and rename("max_tokens") == "max_tokens"


def test_count_tokens_counts_a_prompt_longer_than_the_context(server, client) -> None:
    long = [{"role": "user", "content": "word " * 1500}]  # the context is 1024 tokens
    counted = client.messages.count_tokens(model="tiny", messages=long).input_tokens
    assert counted > 1500
    with pytest.raises(anthropic.BadRequestError, match="context length"):
        client.messages.create(model="tiny", max_tokens=4, messages=long)
    r = post_raw(server, "/v1/messages/count_tokens",
                 {"model": "tiny", "messages": [{"role": "user", "content": "x" * 70000}]})
    assert r.status_code == 413 and _anthropic_error(r) == "request_too_large"


@pytest.mark.parametrize("path", ["/v1/messagesX", "/v1/messages/count_tokensX",
                                  "/v1/messages/batches"])
def test_other_paths_answer_in_openai_shape(server, path) -> None:
    r = post_raw(server, path, {"model": "tiny", "max_tokens": 4, "messages": ASK})
    assert r.status_code == 404
    body = r.json()
    assert body["object"] == "error" and body["error"]["type"] == "not_found_error", body
    assert set(body["error"]) == {"message", "type", "param", "code"}
