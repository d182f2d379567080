"""Bad requests get a 4xx with a clear message; process death and SIGTERM end the server cleanly."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import httpx
import pytest
from helpers.server import ServerProcess, tiny_chat_server

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
LONG = "word " * 1200  # > the 1024-token context below

# (name, route, body or raw bytes, expected status, a fragment the message must contain)
BAD_REQUESTS = [
    ("malformed json", CHAT, b'{"model": "tiny", "messages": [', 400, "JSON"),
    ("non-utf8 body", CHAT, b'{"model": "tiny", "messages": "\xff\xfe"}', 400, ""),
    ("body is a list", CHAT, b"[1, 2, 3]", 400, ""),
    ("empty body", CHAT, b"", 400, ""),
    ("unknown model", CHAT, {"model": "gpt-9", "messages": MSG}, 400, "gpt-9"),
    ("missing messages", CHAT, {"model": "tiny"}, 400, "messages"),
    ("empty messages", CHAT, {"model": "tiny", "messages": []}, 400, "messages"),
    ("messages not a list", CHAT, {"model": "tiny", "messages": "hi"}, 400, "messages"),
    ("unknown role", CHAT, {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("missing content", CHAT, {"model": "tiny", "messages": [{"role": "user"}]}, 400, "content"),
    ("content wrong type", CHAT, {"model": "tiny", "messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ("negative max_tokens", CHAT, {"model": "tiny", "messages": MSG, "max_tokens": -1}, 400, "max_tokens"),
    ("zero max_tokens", CHAT, {"model": "tiny", "messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    ("huge max_tokens", CHAT, {"model": "tiny", "messages": MSG, "max_tokens": 10**9}, 400, "context length"),
    ("max_tokens string", CHAT, {"model": "tiny", "messages": MSG, "max_tokens": "ten"}, 400, "max_tokens"),
    ("n = 0", CHAT, {"model": "tiny", "messages": MSG, "n": 0}, 400, "n"),
    ("n too big", CHAT, {"model": "tiny", "messages": MSG, "n": 1000}, 400, "n"),
    ("temperature -1", CHAT, {"model": "tiny", "messages": MSG, "temperature": -1}, 400, "temperature"),
    ("top_p 2", CHAT, {"model": "tiny", "messages": MSG, "top_p": 2}, 400, "top_p"),
    ("top_p 0", CHAT, {"model": "tiny", "messages": MSG, "top_p": 0}, 400, "top_p"),
    ("top_k 0", CHAT, {"model": "tiny", "messages": MSG, "top_k": 0}, 400, "top_k"),
    ("presence_penalty 5", CHAT, {"model": "tiny", "messages": MSG, "presence_penalty": 5}, 400, "presence_penalty"),
    ("frequency_penalty -3", CHAT, {"model": "tiny", "messages": MSG, "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("seed string", CHAT, {"model": "tiny", "messages": MSG, "seed": "abc"}, 400, "seed"),
    ("stream not bool", CHAT, {"model": "tiny", "messages": MSG, "stream": "yes"}, 400, "stream"),
    ("stop not str", CHAT, {"model": "tiny", "messages": MSG, "stop": 5}, 400, "stop"),
    ("empty stop", CHAT, {"model": "tiny", "messages": MSG, "stop": [""]}, 400, "stop"),
    ("logit_bias bad key", CHAT, {"model": "tiny", "messages": MSG, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("logit_bias bad value", CHAT, {"model": "tiny", "messages": MSG, "logit_bias": {"5": 500}}, 400, "logit_bias"),
    ("logit_bias id out of vocab", CHAT, {"model": "tiny", "messages": MSG, "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ("top_logprobs without logprobs", CHAT, {"model": "tiny", "messages": MSG, "top_logprobs": 3}, 400, "logprobs"),
    ("top_logprobs 50", CHAT, {"model": "tiny", "messages": MSG, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("unknown field", CHAT, {"model": "tiny", "messages": MSG, "temprature": 0.5}, 400, "temprature"),
    ("prompt too long (chat)", CHAT, {"model": "tiny", "messages": [{"role": "user", "content": LONG}]}, 400, "context length"),
    ("prompt too long", COMP, {"model": "tiny", "prompt": LONG}, 400, "context length"),
    ("empty prompt", COMP, {"model": "tiny", "prompt": ""}, 400, "empty"),
    ("empty prompt list", COMP, {"model": "tiny", "prompt": []}, 400, "prompt"),
    ("token id out of vocab", COMP, {"model": "tiny", "prompt": [1, 2, 10**7]}, 400, "vocabulary"),
    ("negative token id", COMP, {"model": "tiny", "prompt": [1, -2]}, 400, "vocabulary"),
    ("prompt wrong type", COMP, {"model": "tiny", "prompt": {"a": 1}}, 400, "prompt"),
    ("suffix", COMP, {"model": "tiny", "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("generate: neither text nor ids", "/generate", {"sampling_params": {}}, 400, "text"),
    ("generate: unknown sampling key", "/generate", {"text": "x", "sampling_params": {"bogus": 1}}, 400, "bogus"),
    ("generate: max_new_tokens 0", "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 0}}, 400, "max_new_tokens"),
    ("abort without rid", "/abort_request", {}, 400, "rid"),
    ("wrong method", "/v1/models", {"x": 1}, 405, ""),
    ("unknown route", "/v1/nothing", {}, 404, ""),
]


server = tiny_chat_server("--max-total-tokens", "8000", "--context-length", "1024")


def test_at_least_30_kinds_of_bad_request(server) -> None:
    assert len(BAD_REQUESTS) >= 30


@pytest.mark.parametrize("name, route, body, status, fragment", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_gets_clear_4xx_and_server_keeps_serving(server, name, route, body, status, fragment) -> None:
    url = server.base_url + route
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=30)
    else:
        r = httpx.post(url, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and fragment.lower() in (err["message"] + str(err.get("param"))).lower(), err
    ok = httpx.post(server.base_url + COMP, json={"model": "tiny", "prompt": "Hello", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_full_queue_gets_503_with_retry_after(tiny_chat_model) -> None:
    srv = ServerProcess("--model", tiny_chat_model, "--max-queued-requests", "1", "--max-running-requests", "1",
                        "--context-length", "1024", "--max-total-tokens", "4000").wait_ready()
    try:
        import concurrent.futures

        body = {"model": srv_model(srv), "prompt": "x", "max_tokens": 200, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            rs = list(pool.map(lambda _: httpx.post(srv.base_url + COMP, json=body, timeout=120), range(8)))
        codes = sorted(r.status_code for r in rs)
        assert 200 in codes and 503 in codes
        rejected = next(r for r in rs if r.status_code == 503)
        assert rejected.headers["retry-after"] and "queue" in rejected.json()["error"]["message"]
    finally:
        assert srv.stop() == 0


def srv_model(srv: ServerProcess) -> str:
    return httpx.get(srv.base_url + "/v1/models").json()["data"][0]["id"]


def test_sigterm_exits_cleanly_without_orphans(tiny_chat_model) -> None:
    srv = ServerProcess("--model", tiny_chat_model, "--context-length", "1024", "--max-total-tokens", "2000").wait_ready()
    children = srv.children()
    assert len(children) >= 2
    t0 = time.monotonic()
    assert srv.stop() == 0
    assert time.monotonic() - t0 < 10
    time.sleep(0.5)
    assert not [c for c in children if c.is_running() and c.status() != "zombie"]


def test_killed_scheduler_stops_server_nonzero(tiny_chat_model) -> None:
    srv = ServerProcess("--model", tiny_chat_model, "--context-length", "1024", "--max-total-tokens", "2000").wait_ready()
    children = srv.children()
    pid = httpx.get(srv.base_url + "/server_info", timeout=30).json()["pids"]["scheduler"]
    assert pid in [c.pid for c in children]
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    code = srv.proc.wait(10)
    assert code != 0 and time.monotonic() - t0 < 10
    log = srv.log()
    srv.stop()
    assert "process exited with code" in log
    time.sleep(0.5)
    assert not [c for c in children if c.is_running() and c.status() != "zombie"]


def test_killed_launcher_leaves_no_busy_orphans(tiny_chat_model) -> None:
    srv = ServerProcess("--model", tiny_chat_model, "--context-length", "1024", "--max-total-tokens", "4000").wait_ready()
    children = srv.children()
    import threading

    # Keep the scheduler busy, then kill the launcher outright (no cleanup code runs).
    body = {"model": srv_model(srv), "prompt": "busy", "max_tokens": 900, "ignore_eos": True}
    def busy() -> None:
        with contextlib.suppress(httpx.HTTPError):  # the server is killed under this request
            httpx.post(srv.base_url + COMP, json=body, timeout=60)

    threading.Thread(target=busy, daemon=True).start()
    time.sleep(1.0)
    os.kill(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait(5)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and [c for c in children if c.is_running() and c.status() != "zombie"]:
        time.sleep(0.2)
    srv.stop()
    assert not [c.pid for c in children if c.is_running() and c.status() != "zombie"]
