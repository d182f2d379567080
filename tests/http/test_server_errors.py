"""Bad requests get a 4xx with a clear message; process death and SIGTERM end the server cleanly."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import threading
from typing import Any, NamedTuple

import httpx
import psutil
import pytest
from helpers.assertions import assert_eventually
from helpers.server import ServerProcess, server_info, tiny_chat_server, wait_idle

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
LONG = "word " * 1200  # > the 1024-token context below


class Bad(NamedTuple):
    """A bad request and the error it must get: status, ``param``, a piece of the message."""

    name: str
    route: str
    body: dict[str, Any] | bytes  # bytes: sent as they are
    status: int
    param: str | None  # the offending field, as OpenAI's error.param names it
    fragment: str  # the message names the field (or, with no field at fault, the problem)
    code: int | str | None = None  # error.code when it is not the status


BAD_REQUESTS = [
    Bad("malformed json", CHAT, b'{"model": "tiny", "messages": [', 400, None, "not valid JSON"),
    Bad("non-utf8 body", CHAT, b'{"model": "tiny", "messages": "\xff\xfe"}', 400, None, "error parsing the body"),
    Bad("body is a list", CHAT, b"[1, 2, 3]", 400, None, "valid dictionary"),
    Bad("empty body", CHAT, b"", 400, None, "the request body is missing"),
    Bad("unknown model", CHAT, {"model": "gpt-9", "messages": MSG}, 404, "model", "'gpt-9' does not exist",
        code="model_not_found"),
    Bad("missing messages", CHAT, {"model": "tiny"}, 400, "messages", "missing required field 'messages'"),
    Bad("empty messages", CHAT, {"model": "tiny", "messages": []}, 400, "messages", "'messages'"),
    Bad("messages not a list", CHAT, {"model": "tiny", "messages": "hi"}, 400, "messages", "'messages'"),
    Bad("unknown role", CHAT, {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400,
        "messages[0].role", "'messages[0].role'"),
    Bad("missing content", CHAT, {"model": "tiny", "messages": [{"role": "user"}]}, 400,
        "messages[0].content", "needs content"),
    Bad("content wrong type", CHAT, {"model": "tiny", "messages": [{"role": "user", "content": 5}]}, 400,
        "messages[0].content", "'messages[0].content'"),
    Bad("negative max_tokens", CHAT, {"model": "tiny", "messages": MSG, "max_tokens": -1}, 400, "max_tokens",
        "'max_tokens'"),
    Bad("zero max_tokens", CHAT, {"model": "tiny", "messages": MSG, "max_tokens": 0}, 400, "max_tokens",
        "'max_tokens'"),
    Bad("huge max_tokens", CHAT, {"model": "tiny", "messages": MSG, "max_tokens": 10**9}, 400, "max_tokens",
        "context length is 1024"),
    Bad("max_tokens string", CHAT, {"model": "tiny", "messages": MSG, "max_tokens": "ten"}, 400, "max_tokens",
        "'max_tokens'"),
    Bad("n = 0", CHAT, {"model": "tiny", "messages": MSG, "n": 0}, 400, "n", "'n'"),
    Bad("n too big", CHAT, {"model": "tiny", "messages": MSG, "n": 1000}, 400, "n", "'n'"),
    Bad("temperature -1", CHAT, {"model": "tiny", "messages": MSG, "temperature": -1}, 400, "temperature",
        "'temperature'"),
    Bad("top_p 2", CHAT, {"model": "tiny", "messages": MSG, "top_p": 2}, 400, "top_p", "'top_p'"),
    Bad("top_p 0", CHAT, {"model": "tiny", "messages": MSG, "top_p": 0}, 400, "top_p", "'top_p'"),
    Bad("top_k 0", CHAT, {"model": "tiny", "messages": MSG, "top_k": 0}, 400, "top_k", "'top_k'"),
    Bad("presence_penalty 5", CHAT, {"model": "tiny", "messages": MSG, "presence_penalty": 5}, 400,
        "presence_penalty", "'presence_penalty'"),
    Bad("frequency_penalty -3", CHAT, {"model": "tiny", "messages": MSG, "frequency_penalty": -3}, 400,
        "frequency_penalty", "'frequency_penalty'"),
    Bad("seed string", CHAT, {"model": "tiny", "messages": MSG, "seed": "abc"}, 400, "seed", "'seed'"),
    Bad("stream not bool", CHAT, {"model": "tiny", "messages": MSG, "stream": "yes"}, 400, "stream", "'stream'"),
    Bad("stop not str", CHAT, {"model": "tiny", "messages": MSG, "stop": 5}, 400, "stop", "'stop'"),
    Bad("empty stop", CHAT, {"model": "tiny", "messages": MSG, "stop": [""]}, 400, "stop", "'stop'"),
    Bad("logit_bias bad key", CHAT, {"model": "tiny", "messages": MSG, "logit_bias": {"abc": 1}}, 400,
        "logit_bias", "'logit_bias'"),
    Bad("logit_bias bad value", CHAT, {"model": "tiny", "messages": MSG, "logit_bias": {"5": 500}}, 400,
        "logit_bias", "'logit_bias'"),
    Bad("logit_bias id out of vocab", CHAT, {"model": "tiny", "messages": MSG, "logit_bias": {"99999999": 1}},
        400, "logit_bias", "logit_bias token ids [99999999]"),
    Bad("top_logprobs without logprobs", CHAT, {"model": "tiny", "messages": MSG, "top_logprobs": 3}, 400,
        "top_logprobs", "top_logprobs requires logprobs"),
    Bad("top_logprobs 50", CHAT, {"model": "tiny", "messages": MSG, "logprobs": True, "top_logprobs": 50}, 400,
        "top_logprobs", "'top_logprobs'"),
    Bad("unknown field", CHAT, {"model": "tiny", "messages": MSG, "temprature": 0.5}, 400, "temprature",
        "unknown field 'temprature'"),
    Bad("prompt too long (chat)", CHAT, {"model": "tiny", "messages": [{"role": "user", "content": LONG}]}, 400,
        "messages", "context length is 1024"),
    Bad("prompt too long", COMP, {"model": "tiny", "prompt": LONG}, 400, "prompt", "context length is 1024"),
    Bad("empty prompt", COMP, {"model": "tiny", "prompt": ""}, 400, "prompt", "the prompt is empty"),
    Bad("empty prompt list", COMP, {"model": "tiny", "prompt": []}, 400, "prompt", "prompt must not be empty"),
    Bad("token id out of vocab", COMP, {"model": "tiny", "prompt": [1, 2, 10**7]}, 400, "prompt",
        "token id 10000000 is outside the vocabulary"),
    Bad("negative token id", COMP, {"model": "tiny", "prompt": [1, -2]}, 400, "prompt",
        "token id -2 is outside the vocabulary"),
    Bad("prompt wrong type", COMP, {"model": "tiny", "prompt": {"a": 1}}, 400, "prompt", "'prompt'"),
    Bad("suffix", COMP, {"model": "tiny", "prompt": "x", "suffix": "y"}, 400, "suffix", "'suffix'"),
    Bad("generate: neither text nor ids", "/generate", {"sampling_params": {}}, 400, "text",
        "one of text and input_ids"),
    Bad("generate: unknown sampling key", "/generate", {"text": "x", "sampling_params": {"bogus": 1}}, 400,
        "sampling_params", "'bogus'"),
    Bad("generate: max_new_tokens -1", "/generate", {"text": "x", "sampling_params": {"max_new_tokens": -1}}, 400,
        "sampling_params.max_new_tokens", "max_new_tokens must be >= 0"),
    Bad("generate: n 2", "/generate", {"text": "x", "sampling_params": {"n": 2}}, 400,
        "sampling_params.n", "sampling_params.n = 2"),
    Bad("generate: stop_regex", "/generate", {"text": "x", "sampling_params": {"stop_regex": ["a+"]}}, 400,
        "sampling_params.stop_regex", "stop_regex asks for"),
    Bad("generate: image_data", "/generate", {"text": "x", "image_data": "data:image/png;base64,AAAA"}, 400,
        "image_data", "'image_data' asks for image inputs"),
    Bad("completions: max_tokens 0 without echo", COMP, {"model": "tiny", "prompt": "x", "max_tokens": 0}, 400,
        "max_tokens", "0 is only valid with echo=true"),
    Bad("abort without rid", "/abort_request", {}, 400, "rid", "missing required field 'rid'"),
    Bad("wrong method", "/v1/models", {"x": 1}, 405, None, "Method Not Allowed"),
    Bad("unknown route", "/v1/nothing", {}, 404, None, "Not Found"),
]
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
               503: "service_unavailable"}


def post(url: str, body: dict[str, Any] | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=30)
    return httpx.post(url, json=body, timeout=30)


def openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    """The ``error`` object of an OpenAI-style error response, its shape checked."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) <= {"object", "error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"], err
    assert err["type"] == ERROR_TYPES[status], err
    return err


server = tiny_chat_server("--max-total-tokens", "8000", "--context-length", "1024")


@pytest.mark.parametrize("bad", BAD_REQUESTS, ids=[b.name for b in BAD_REQUESTS])
def test_bad_request_gets_clear_4xx_and_server_keeps_serving(server, bad: Bad) -> None:
    err = openai_error(post(server.base_url + bad.route, bad.body), bad.status)
    assert err["param"] == bad.param, err
    assert bad.fragment in err["message"], err
    assert err["code"] == (bad.code or bad.status), err
    ok = httpx.post(server.base_url + COMP, json={"model": "tiny", "prompt": "Hello", "max_tokens": 2,
                                                  "ignore_eos": True}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_bad_requests_queue_nothing(server) -> None:
    """Refused requests never reach the queue: no request is received, no token computed."""
    before = server_info(server)["stats"]
    for bad in BAD_REQUESTS:
        assert post(server.base_url + bad.route, bad.body).status_code == bad.status, bad.name
    after = wait_idle(server)["stats"]
    for counter in ("requests_received", "prompt_tokens", "prefill_tokens_computed", "generation_tokens"):
        assert after[counter] == before[counter], counter


def test_full_queue_gets_503_with_retry_after(tiny_chat_model) -> None:
    srv = ServerProcess("--model", tiny_chat_model, "--max-queued-requests", "1", "--max-running-requests", "1",
                        "--context-length", "1024", "--max-total-tokens", "4000").wait_ready()
    try:
        body = {"model": srv_model(srv), "prompt": "x", "max_tokens": 200, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            rs = list(pool.map(lambda _: httpx.post(srv.base_url + COMP, json=body, timeout=120), range(8)))
        assert sorted({r.status_code for r in rs}) == [200, 503]
        for r in rs:
            if r.status_code == 200:
                assert r.json()["usage"]["completion_tokens"] == 200
            else:
                err = openai_error(r, 503)
                assert "queue is full" in err["message"] and err["code"] == 503
                assert r.headers["retry-after"] == "1"
    finally:
        assert srv.stop() == 0


def srv_model(srv: ServerProcess) -> str:
    return httpx.get(srv.base_url + "/v1/models").json()["data"][0]["id"]


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """The processes still running (a zombie has exited; it only waits to be reaped)."""
    out = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


def start_server(max_total_tokens: int, model: str) -> tuple[ServerProcess, list[psutil.Process]]:
    """A ready server and its child processes, the scheduler and the detokenizer among them."""
    srv = ServerProcess("--model", model, "--context-length", "1024",
                        "--max-total-tokens", str(max_total_tokens)).wait_ready()
    children = srv.children()
    pids = server_info(srv)["pids"]
    assert {pids["scheduler"], pids["detokenizer"]} <= {c.pid for c in children}
    return srv, children


def test_sigterm_exits_cleanly_without_orphans(tiny_chat_model) -> None:
    srv, children = start_server(2000, tiny_chat_model)
    # stop() sends SIGTERM and kills the server only if it has not exited in time: a
    # killed server's code is not 0.
    assert srv.stop() == 0
    assert_eventually(lambda: not alive(children), 10, "the server's children exit")


def test_killed_scheduler_stops_server_nonzero(tiny_chat_model) -> None:
    srv, children = start_server(2000, tiny_chat_model)
    os.kill(server_info(srv)["pids"]["scheduler"], signal.SIGKILL)
    try:
        code = srv.proc.wait(30)
    finally:
        srv.stop()
    assert code == 1  # the watchdog stops the server with exit code 1
    assert f"scheduler process exited with code {-signal.SIGKILL}" in srv.log()
    assert_eventually(lambda: not alive(children), 10, "the server's other children exit")


def test_killed_launcher_leaves_no_busy_orphans(tiny_chat_model) -> None:
    srv, children = start_server(4000, tiny_chat_model)
    # Keep the scheduler busy, then kill the launcher outright (no cleanup code runs).
    body = {"model": srv_model(srv), "prompt": "busy", "max_tokens": 900, "ignore_eos": True}

    def busy() -> None:
        with contextlib.suppress(httpx.HTTPError):  # the server is killed under this request
            httpx.post(srv.base_url + COMP, json=body, timeout=60)

    threading.Thread(target=busy, daemon=True).start()
    assert_eventually(lambda: server_info(srv)["stats"]["running"] == 1, 30, "the busy request runs")
    os.kill(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait(5)
    try:
        assert_eventually(lambda: not alive(children), 10, "the orphaned children exit")
    finally:
        srv.stop()
