"""HTTP API fuzzing with schemathesis, bounded for CI: a seeded run over every route and
every documented top-level body field of a real server (the long run is
``bench/fuzz_api.py``; both drive ``bench/api_fuzzer.py``).

Every case: no 5xx, no hang, no process death, an error body on every 4xx and a complete
event stream, each in the shape of the route's API (OpenAI's; Anthropic's on /v1/messages; the
Responses API's on /v1/responses);
after each route and after the run: the memory invariant holds once idle, and a chat request
is answered.  The 96-token context bounds every generation, whatever ``max_tokens`` asks.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.server import ServerProcess, memory_checked_after_each_test

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.api_fuzzer import (  # noqa: E402
    BASES,
    Target,
    anthropic_error_problems,
    error_body_problems,
    fuzz,
    response_problems,
    responses_stream_problems,
    summary,
)
from bench.fuzz_api import ROUTE_WEIGHTS, SERVER_ENV  # noqa: E402

CASES = 220
SEED = 0
ROUTES = {"GET /v1/models", "POST /v1/completions", "POST /v1/chat/completions", "POST /generate",
          "GET /health", "GET /health_generate", "GET /get_server_info", "GET /server_info",
          "POST /flush_cache", "POST /abort_request", "GET /metrics", "GET /get_model_info", "GET /model_info", "GET /get_load",
          "GET /v1/loads",
          "POST /apply_chat_template", "POST /concate_and_append_request", "POST /cache/pin",
          "POST /cache/unpin", "GET /cache/tree", "GET /cache/misses",
          "POST /v1/messages", "POST /v1/messages/count_tokens", "POST /v1/responses",
          "GET /v1/responses/{response_id}", "DELETE /v1/responses/{response_id}",
          "POST /v1/responses/{response_id}/cancel",
          # without --enable-lora every load and unload is a 400 (whole-schema cases only)
          "POST /load_lora_adapter", "POST /v1/load_lora_adapter", "POST /unload_lora_adapter",
          "POST /v1/unload_lora_adapter"}


@pytest.fixture(scope="module")
def server(tiny_chat_model: str) -> Iterator[ServerProcess]:
    """The tiny chat model with a 96-token context; one torch thread (``SERVER_ENV``)."""
    srv = ServerProcess("--model", tiny_chat_model, "--served-model-name", "tiny", "--max-total-tokens", "8192",
                        "--context-length", "96", env=SERVER_ENV).wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


memory_invariant = memory_checked_after_each_test("server")


@pytest.fixture(scope="module")
def results(server) -> dict[str, Any]:
    return fuzz(Target(server.base_url, timeout=60), ROUTE_WEIGHTS, CASES, SEED)


def test_every_route_and_documented_field_gets_cases(server, results) -> None:
    import httpx

    routes = {r["route"]: r for r in results["routes"]}
    assert set(routes) == ROUTES  # a new route is fuzzed too: add it here and to ROUTE_WEIGHTS
    assert summary(results)["cases"] >= 200
    schema = httpx.get(server.base_url + "/openapi.json").json()
    for route in BASES:
        method, path = route.split(" ", 1)
        ref = schema["paths"][path][method.lower()]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        fields = schema["components"]["schemas"][ref.rsplit("/", 1)[-1]]["properties"]
        units = routes[route]["units"]
        for name in fields:  # one schema-conforming and one schema-violating case at least
            assert sum(units[f"field:{name}"].values()) >= 2, (route, name)
        # Cases get past validation: the fuzzing reaches generation on every route.
        assert routes[route]["statuses"].get("200", 0) >= 3, (route, routes[route]["statuses"])


def test_no_case_fails(results) -> None:
    failures = [(r["route"], f) for r in results["routes"] for f in r["failures"]]
    assert not failures, "\n".join(f"{route} [{f['unit']}] {f['status']}: {f['problems']} body={f['body'][:400]}"
                                   for route, f in failures)


def test_server_is_sound_after_every_route(results) -> None:
    assert results["soundness"].keys() == {r["route"] for r in results["routes"]}
    assert not {route: p for route, p in results["soundness"].items() if p}


# ---------------------------------------------------------------- the checks themselves


OPENAI_ERROR = b'{"object":"error","error":{"message":"bad","type":"invalid_request_error","param":null,"code":400}}'
ANTHROPIC_ERROR = b'{"type":"error","error":{"type":"invalid_request_error","message":"bad"}}'


def _sse(*events: tuple[str, dict[str, Any]]) -> bytes:
    import json

    return b"".join(f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n".encode()
                    for name, data in events)


MESSAGES_STREAM = _sse(("message_start", {"message": {}}), ("message_delta", {"delta": {}}),
                       ("message_stop", {}))
RESPONSES_STREAM = _sse(("response.created", {"response": {"status": "in_progress"}}),
                        ("response.completed", {"response": {"status": "completed"}}))


@pytest.mark.parametrize("status, content_type, body, cut, path, fragment", [
    (500, "application/json", OPENAI_ERROR, False, "", "server error 500"),
    (503, "application/json", b"{}", False, "", "server error 503"),
    (400, "application/json", b'{"detail": "bad"}', False, "", "no 'error' object"),
    (422, "application/json", b"not json", False, "", "not JSON"),
    (400, "application/json", b'{"error": {"message": "", "type": "x", "param": null, "code": 400}}', False, "",
     "message"),
    (400, "application/json", b'{"error": {"message": "m", "type": "x", "code": 400}}', False, "", "'param'"),
    (200, "application/json", b'{"id": ', False, "", "does not parse"),
    (200, "text/event-stream", b"data: {}\n\n", False, "", "[DONE]"),
    # Each API's own shape, and another API's shape on its routes
    (400, "application/json", OPENAI_ERROR, False, "/v1/messages", "Anthropic"),
    (404, "application/json", ANTHROPIC_ERROR, False, "/v1/responses/resp_1", "'param'"),
    (400, "application/json", b'{"type":"error","error":{"type":"oops","message":"m"}}', False,
     "/v1/messages", "error types"),
    (400, "application/json", b'{"type":"error","error":{"type":"api_error","message":""}}', False,
     "/v1/messages/count_tokens", "message"),
    (200, "text/event-stream", MESSAGES_STREAM + b"data: [DONE]\n\n", False, "/v1/messages", "not JSON"),
    (200, "text/event-stream", MESSAGES_STREAM[:-len(_sse(("message_stop", {})))], False, "/v1/messages",
     "message_stop"),
    (200, "text/event-stream", RESPONSES_STREAM, False, "/v1/messages", "message_stop"),
    (200, "text/event-stream", _sse(("error", {"error": {"message": "m"}})), False, "/v1/messages", "error types"),
    (200, "text/event-stream", b"data: {}\n\ndata: [DONE]\n\n", False, "/v1/responses", "differ"),
    (200, "text/event-stream", RESPONSES_STREAM[:RESPONSES_STREAM.index(b"event: response.completed")], False,
     "/v1/responses", "ends with 'response.created'"),
    (200, "text/event-stream", _sse(("response.completed", {})), False, "/v1/responses", "status"),
    (200, "text/event-stream", MESSAGES_STREAM, False, "/v1/chat/completions", "[DONE]"),
])
def test_checks_catch_bad_answers(status: int, content_type: str, body: bytes, cut: bool, path: str,
                                  fragment: str) -> None:
    problems = response_problems(status, content_type, body, cut, path)
    assert problems and fragment in " ".join(problems), problems


def test_checks_pass_good_answers() -> None:
    assert error_body_problems(OPENAI_ERROR) == []
    assert anthropic_error_problems(ANTHROPIC_ERROR) == []
    assert response_problems(400, "application/json", OPENAI_ERROR, False) == []
    assert response_problems(400, "application/json", OPENAI_ERROR, False, "/v1/responses") == []
    assert response_problems(401, "application/json", ANTHROPIC_ERROR, False, "/v1/messages/count_tokens") == []
    assert response_problems(200, "text/event-stream", b"data: {}\n\ndata: [DONE]\n\n", False) == []
    assert response_problems(200, "text/event-stream", b"data: {}\n\n", True) == []  # the client stopped
    assert response_problems(200, "text/plain", b"# metrics", False) == []
    assert response_problems(200, "text/event-stream", MESSAGES_STREAM, False, "/v1/messages") == []
    failed = _sse(("message_start", {"message": {}}), ("error", {"error": {"type": "api_error", "message": "m"}}))
    assert response_problems(200, "text/event-stream", failed, False, "/v1/messages") == []
    assert response_problems(200, "text/event-stream", RESPONSES_STREAM, False, "/v1/responses") == []
    # /v1/messagesfoo is no route of Anthropic's API
    assert response_problems(400, "application/json", OPENAI_ERROR, False, "/v1/messagesfoo") == []


def test_responses_stream_failure_ends_as_the_responses_api_ends_a_stream() -> None:
    """A Responses stream that fails after it started ends with ``error`` and
    ``response.failed`` (once it ended with the chat route's error chunk and ``[DONE]``)."""
    from types import SimpleNamespace

    from radixserve.frontend.response_items import ItemStream
    from radixserve.frontend.responses_api import _failure_events
    from radixserve.runtime.tokenizer_manager import RequestError

    items = ItemStream(None)
    call = SimpleNamespace(response=lambda status, output: {"id": "resp_1", "status": status, "output": output})
    head = items.event("response.created", response=call.response("in_progress", []))
    events = _failure_events(call, items)(RequestError("the grammar does not compile", 400))
    assert responses_stream_problems(head + b"".join(events)) == []
    assert b'"code":"invalid_prompt"' in events[0] and b'"status":"failed"' in events[1]


# ---------------------------------------------------------------- what the fuzzing found

HUGE = 2**70  # no JSON int64: once crossed to the scheduler as is, and answered 500
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMP = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
GEN = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
REGRESSIONS = [
    # (name, route, body, expected param or None, fragment of the message)
    ("chat top_k > int64", "/v1/chat/completions", {**CHAT, "top_k": HUGE}, "top_k", "top_k"),
    ("completion top_k > int64", "/v1/completions", {**COMP, "top_k": HUGE}, "top_k", "top_k"),
    ("completion seed > int64", "/v1/completions", {**COMP, "seed": 2**63}, "seed", "seed"),
    ("chat min_tokens > int64", "/v1/chat/completions", {**CHAT, "min_tokens": HUGE}, "min_tokens", "min_tokens"),
    ("chat max_completion_tokens > int64", "/v1/chat/completions", {**CHAT, "max_completion_tokens": HUGE},
     "max_completion_tokens", "max_completion_tokens"),
    ("stop_token_ids > int64", "/v1/completions", {**COMP, "stop_token_ids": [HUGE]}, "stop_token_ids[0]",
     "stop_token_ids"),
    ("generate max_new_tokens > int64", "/generate", {**GEN, "sampling_params": {"max_new_tokens": HUGE}},
     "sampling_params.max_new_tokens", "sampling_params.max_new_tokens must fit in 64 bits"),
    ("generate top_k > int64", "/generate", {**GEN, "sampling_params": {"max_new_tokens": 2, "top_k": HUGE}},
     "sampling_params.top_k", "sampling_params.top_k must fit in 64 bits"),
    ("generate min_new_tokens > int64", "/generate", {**GEN, "sampling_params": {"min_new_tokens": -HUGE}},
     "sampling_params.min_new_tokens", "sampling_params.min_new_tokens must fit in 64 bits"),
]


@pytest.mark.parametrize("name, route, body, param, fragment", REGRESSIONS, ids=[r[0] for r in REGRESSIONS])
def test_found_by_fuzzing_answered_400_naming_the_field(server, name, route, body, param, fragment) -> None:
    import httpx

    r = httpx.post(server.base_url + route, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and fragment in err["message"], err


def test_responses_stream_refused_by_the_runtime_keeps_its_status(server) -> None:
    """A grammar that does not compile is refused when generation starts: the Responses stream
    waits for it, so the refusal is a 400 (it was a 200 stream ending in the chat route's error
    chunk and ``[DONE]``)."""
    import httpx

    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=a)b"}}}
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 2, "stream": True, "store": False,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}
    r = httpx.post(server.base_url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400 and "json_schema" in r.json()["error"]["message"], r.text


def test_infinite_penalty_is_refused_naming_the_field(server) -> None:
    import httpx

    body = b'{"model": "tiny", "prompt": "Hi", "max_tokens": 2, "repetition_penalty": 1e999}'  # JSON inf
    r = httpx.post(server.base_url + "/v1/completions", content=body,
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty", r.text


def test_masked_top_logprobs_cross_the_processes(server) -> None:
    """Top logprobs of tokens a grammar masks out are -inf, sent between processes as null:
    the type checks at decode accept them (they once dropped the message: the client hung)."""
    import httpx

    body = {**CHAT, "logprobs": True, "top_logprobs": 20, "response_format": {"type": "json_object"}}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    tops = [t["logprob"] for tok in r.json()["choices"][0]["logprobs"]["content"] for t in tok["top_logprobs"]]
    assert len(tops) == 20 * r.json()["usage"]["completion_tokens"] and None in tops


SURROGATES = [
    # (route, raw body with a lone surrogate spelled as a JSON escape, the field named)
    ("/v1/completions", b'{"prompt": "Hi \\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": "Hi", "stop": ["x", "\\udfff"], "max_tokens": 2}', "stop[1]"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 2}',
     "messages[0].content"),
    ("/generate", b'{"text": "\\ud800", "sampling_params": {"max_new_tokens": 2}}', "text"),
    ("/generate", b'{"text": "x", "rid": "\\ud800", "sampling_params": {"max_new_tokens": 2}}', "rid"),
    ("/generate", b'{"text": "x", "sampling_params": {"max_new_tokens": 2, "stop": "\\ud800"}}', "sampling_params.stop"),
    ("/abort_request", b'{"rid": "\\ud800"}', "rid"),
]


@pytest.mark.parametrize("route, body, param", SURROGATES, ids=[f"{r} {p}" for r, _, p in SURROGATES])
def test_lone_surrogate_is_refused_naming_the_field(server, route: str, body: bytes, param: str) -> None:
    """Once answered 500: the tokenizer (TypeError) or orjson between processes refused it."""
    import httpx

    r = httpx.post(server.base_url + route, content=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "lone UTF-16 surrogate" in err["message"], err


def test_surrogate_pairs_are_text(server) -> None:
    import httpx

    body = b'{"model": "tiny", "prompt": "smile \\ud83d\\ude00", "max_tokens": 2}'
    r = httpx.post(server.base_url + "/v1/completions", content=body, headers={"Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 200, r.text


def test_the_fuzzer_judges_each_path_in_the_shape_the_server_answers_it() -> None:
    """Anthropic's shape on exactly its two routes, as the server chooses it; a path that only
    starts like them is OpenAI's 404."""
    from bench.api_fuzzer import ANTHROPIC, OPENAI, RESPONSES, api_shape

    assert api_shape("/v1/messages") is api_shape("/v1/messages/count_tokens") is ANTHROPIC
    assert api_shape("/v1/messagesX") is api_shape("/v1/messages/batches") is OPENAI
    assert api_shape("/v1/responses") is api_shape("/v1/responses/resp_1/cancel") is RESPONSES
    assert api_shape("/v1/responsesX") is api_shape("/v1/chat/completions") is OPENAI
