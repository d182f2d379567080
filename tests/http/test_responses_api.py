"""OpenAI's Responses API (``/v1/responses``) end to end: a real `radixserve serve` process on
the tiny chat model and the official ``openai`` client.

Greedy answers are compared with ``/v1/chat/completions``' for the same conversation (both
routes run one chat request); tool calls are held to the grammar of ``tool_choice``
``required`` / a named function, as on the chat route.
"""

from __future__ import annotations

import json
import random

import jsonschema
import openai
import pytest
from helpers.api_clients import post_raw, server_pins
from helpers.server import memory_checked_after_each_test, openai_client, tiny_chat_server
from helpers.tool_schemas import WEATHER

from radixserve.chat.responses import FIELD_RENAMES, ResponsesRequest, conversation, field_names
from radixserve.frontend.errors import APIError, renamed

STORE_SIZE = 6
server = tiny_chat_server("--max-total-tokens", "6000", "--context-length", "1024",
                          "--max-pinned-fraction", "0.8", "--max-request-body-bytes", "65536",
                          "--response-store-size", str(STORE_SIZE))
memory_invariant = memory_checked_after_each_test("server")

TOOLS = [{"type": "function", "name": "get_weather", "description": "weather of a city",
          "parameters": WEATHER}]
QUESTION = "What is the weather in Oslo this week?"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server)


def _client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)


def test_create_is_the_chat_request_of_the_same_conversation(server, client) -> None:
    resp = client.responses.create(model="tiny", instructions="Be brief.", input=QUESTION,
                                   max_output_tokens=12, temperature=0, store=False)
    chat = openai_client(server).chat.completions.create(
        model="tiny", max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": QUESTION}])
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert [item.type for item in resp.output] == ["message"]
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.output_tokens_details.reasoning_tokens == 0  # no reasoning parser
    # The same prompt again: every prompt token but the last comes from the radix cache, on
    # either route.
    assert chat.usage.prompt_tokens_details.cached_tokens >= resp.usage.input_tokens - 1
    again = client.responses.create(model="tiny", instructions="Be brief.", input=QUESTION,
                                    max_output_tokens=12, temperature=0, store=False)
    assert again.usage.input_tokens_details.cached_tokens >= resp.usage.input_tokens - 1
    truncated = chat.choices[0].finish_reason == "length"
    assert resp.status == ("incomplete" if truncated else "completed")


def test_stream_events_assemble_to_the_created_response(client) -> None:
    args = {"model": "tiny", "input": [{"role": "user", "content": QUESTION}],
            "max_output_tokens": 10, "temperature": 0, "store": False}
    created = client.responses.create(**args)
    with client.responses.stream(**args) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    # A response cut off by max_output_tokens ends with response.incomplete (as OpenAI's).
    expected = "response.completed" if created.status == "completed" else "response.incomplete"
    assert kinds[-1] == expected
    final = events[-1].response
    assert final.status == created.status
    assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds
    assert final.output_text == created.output_text
    assert final.usage.output_tokens == created.usage.output_tokens


def test_retrieve_and_delete_a_stored_response(client) -> None:
    resp = client.responses.create(model="tiny", input="Hello", max_output_tokens=4)
    got = client.responses.retrieve(resp.id)
    assert got.id == resp.id and got.output_text == resp.output_text and got.store
    client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(resp.id)
    unstored = client.responses.create(model="tiny", input="Hello", max_output_tokens=2,
                                       store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_function_call_round_trip_through_previous_response_id(client) -> None:
    # One call: sampled at random, a run of parallel calls can outgrow max_output_tokens.
    first = client.responses.create(model="tiny", input=QUESTION, tools=TOOLS,
                                    tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=200)
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and len(calls) >= 1
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "Sunny, 21 C"}
               for c in calls]
    second = client.responses.create(model="tiny", previous_response_id=first.id, input=outputs,
                                     tools=TOOLS, max_output_tokens=4)
    assert second.previous_response_id == first.id
    # The stored conversation's tokens were kept: the whole first prompt is read from the cache.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    with pytest.raises(openai.BadRequestError, match="answers no function_call"):
        client.responses.create(model="tiny", previous_response_id=first.id, tools=TOOLS,
                                input=[{"type": "function_call_output", "call_id": "call_x",
                                        "output": "?"}])


def test_structured_output_follows_text_format(client) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    resp = client.responses.create(
        model="tiny", input="Is Oslo in Norway?", max_output_tokens=40, store=False,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    jsonschema.validate(json.loads(resp.output_text), schema)


def test_a_tenant_never_reads_another_tenants_responses(server) -> None:
    alice, bob = _client(server, "key-alice"), _client(server, "key-bob")
    resp = alice.responses.create(model="tiny", input="Hello", max_output_tokens=2)
    assert alice.responses.retrieve(resp.id).id == resp.id
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(resp.id)
    with pytest.raises(openai.BadRequestError, match="no stored response"):
        bob.responses.create(model="tiny", input="Hi", previous_response_id=resp.id)
    with pytest.raises(openai.NotFoundError):  # the cache salt is part of the tenant too
        alice.responses.retrieve(resp.id, extra_query={"cache_salt": "other"})
    assert alice.responses.retrieve(resp.id).id == resp.id  # Bob's delete deleted nothing


def test_the_store_keeps_the_newest_responses(client) -> None:
    ids = [client.responses.create(model="tiny", input=f"Count {i}", max_output_tokens=1).id
           for i in range(STORE_SIZE + 2)]
    for gone in ids[:2]:
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(gone)
    assert [client.responses.retrieve(i).id for i in ids[2:]] == ids[2:]


def test_a_stored_conversation_survives_a_flood_of_other_prompts(server, client) -> None:
    task = "You are a planner. " * 60 + QUESTION
    first = client.responses.create(model="tiny", input=task, tools=TOOLS,
                                    tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=200)
    call = next(item for item in first.output if item.type == "function_call")
    assert any(p["tokens"] >= first.usage.input_tokens for p in server_pins(server))
    rng = random.Random(0)
    words = ["alpha", "bravo", "delta", "kilo", "lima", "oscar", "tango", "zulu"]
    for _ in range(16):  # ~10,000 tokens of one-off prompts through a 6,000-token pool
        text = " ".join(rng.choice(words) for _ in range(350))
        client.responses.create(model="tiny", input=text, max_output_tokens=1, store=False)
    second = client.responses.create(
        model="tiny", previous_response_id=first.id, tools=TOOLS, max_output_tokens=2,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Rain"}])
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


def _openai_error(response) -> dict:
    body = response.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize(("body", "fragment"), [
    ({"input": [{"type": "computer_call", "call_id": "c"}]}, "computer_call"),
    ({"input": [{"type": "function_call_output", "call_id": "call_none", "output": "1"}]},
     "answers no function_call"),
    ({"input": "Hi", "previous_response_id": "resp_missing"}, "no stored response"),
    ({"input": []}, "input"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "schema"),
    ({"input": "Hi", "background": True}, "background"),
])
def test_bad_input_is_a_400_in_openai_shape(server, client, body, fragment) -> None:
    r = post_raw(server, "/v1/responses", {"model": "tiny", **body})
    assert r.status_code == 400, r.text
    error = _openai_error(r)
    assert error["type"] == "invalid_request_error" and fragment in error["message"]
    assert client.responses.create(model="tiny", input="Hi", max_output_tokens=1, store=False)


def test_oversized_body_unknown_ids_and_cancel(server, client) -> None:
    r = post_raw(server, "/v1/responses", {"model": "tiny", "input": "x" * 70000})
    assert r.status_code == 413 and _openai_error(r)["code"] == 413
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_missing")
    done = client.responses.create(model="tiny", input="Hi", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError, match="only a running response"):
        client.responses.cancel(done.id)
    kinds, cancelled = [], None
    with client.responses.stream(model="tiny", input=QUESTION, max_output_tokens=900) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.created":
                rid = event.response.id
            if event.type == "response.output_text.delta" and cancelled is None:
                cancelled = client.responses.cancel(rid)
            if event.type in ("response.failed", "response.completed", "response.incomplete"):
                final = event.response
    assert cancelled.status == "cancelled" and kinds[-1] == "response.failed"
    assert final.status == "cancelled" and final.usage.output_tokens < 900
    assert client.responses.retrieve(rid).status == "cancelled"
    assert client.responses.create(model="tiny", input="Hi", max_output_tokens=1, store=False)


BAD_SCHEMA = {"type": 5}  # not a JSON schema


@pytest.mark.parametrize(("body", "param", "named"), [
    ({"input": "Hi", "max_output_tokens": 2000}, "max_output_tokens", None),
    ({"input": "word " * 1100}, "input", None),
    ({"input": "Hi", "tools": [{"type": "function", "name": "f", "parameters": BAD_SCHEMA}]},
     "tools[0].parameters", "tools[0].parameters"),
    ({"input": "Hi", "tools": [{"type": "function", "name": "f",
                                "parameters": {"type": "string"}}]},
     "tools", "tools[0].parameters"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x",
                                         "schema": BAD_SCHEMA}}}, "text.format", None),
])
def test_errors_name_the_responses_field_the_client_sent(server, body, param, named) -> None:
    """The request runs as a chat request; its errors name the Responses field, not the chat
    field it became (max_tokens, messages, tools[0].function.parameters, response_format)."""
    r = post_raw(server, "/v1/responses", {"model": "tiny", **body})
    assert r.status_code == 400, r.text
    error = _openai_error(r)
    assert error["param"] == param or error["param"].startswith(param + "."), error
    for chat_name in ("max_tokens", "messages", "function", "response_format"):
        assert chat_name not in error["message"] and chat_name not in error["param"], error
    if named is not None:
        assert named in error["message"], error


def test_chat_message_fields_map_back_to_input_items() -> None:
    """Where a chat message's field came from: the instructions, the stored conversation, or
    the input item (a run of function calls is one chat message, one item per call)."""
    body = ResponsesRequest.model_validate({"instructions": "Be brief.", "input": [
        {"role": "user", "content": "Hi"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text",
                                                          "text": "Two calls."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c2", "output": "2"}]})
    earlier = [{"role": "user", "content": "Before"}]
    messages, origins = conversation(body.items(), earlier)
    assert [m["role"] for m in messages] == ["user", "user", "assistant", "tool"]
    assert messages[2]["reasoning_content"] == "Two calls."  # handed back with its calls
    names = field_names(body, origins)

    def rename(path: str) -> str | None:
        return renamed(APIError(f"{path} is wrong", 400, path), names, FIELD_RENAMES).param

    assert rename("messages[0].content") == "instructions"
    assert rename("messages[1].content") == "previous_response_id"
    assert rename("messages[2].content") == "input[0].content"
    assert rename("messages[3].tool_calls[1].function.arguments") == "input[3].arguments"
    assert rename("messages[4].content") == "input[4].output"
    assert rename("tools[2].function.parameters") == "tools[2].parameters"
    assert rename("response_format.json_schema.schema") == "text.format.schema"
    assert rename("max_tokens") == "max_output_tokens" and rename("top_p") == "top_p"
    assert rename("messages") == "input"


def test_the_next_turn_reuses_the_generated_token_ids(server, client) -> None:
    """Turn 2 of a stored response starts with the very tokens turn 1 saw and generated, so
    the radix tree serves turn 1's prompt and its whole answer; the same conversation sent as
    text (the chat route re-tokenizes the answer) misses part of it."""
    instructions = "You are a story teller. " * 20
    first = client.responses.create(model="tiny", instructions=instructions, input=QUESTION,
                                    max_output_tokens=24, temperature=0)
    assert first.usage.output_tokens == 24
    turn_one = first.usage.input_tokens + first.usage.output_tokens
    second = client.responses.create(model="tiny", instructions=instructions,
                                     previous_response_id=first.id, input="Go on.",
                                     max_output_tokens=1)
    # The last generated token was never an input, so its KV is not in the tree.
    assert second.usage.input_tokens_details.cached_tokens >= turn_one - 1
    assert second.usage.input_tokens > turn_one
    chat = openai_client(server).chat.completions.create(
        model="tiny", max_tokens=1, messages=[
            {"role": "system", "content": instructions}, {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Go on."}])
    # Re-tokenized, the answer's text is other tokens (the case this reuse is for).
    assert chat.usage.prompt_tokens_details.cached_tokens < turn_one - 1
