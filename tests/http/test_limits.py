"""Limits and hostile input, against real server processes: body size (413), headers (431,
or uvicorn's 400 and a closed connection), JSON nesting depth (400), floods beyond the queue
(503 with Retry-After, memory bounded), the API key (401), CORS, and a port in use (exit 2
before the model loads)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import orjson
import psutil
import pytest
from helpers.server import ServerProcess, check_memory_idle, serving
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.frontend.limits import (
    MAX_HEADER_BYTES,
    MAX_HEADER_COUNT,
    MAX_INCOMPLETE_HEAD_BYTES,
    MAX_JSON_DEPTH,
    json_depth_exceeds,
)

KEY = "sk-test-7f3a9c1e5b"
WRONG_KEY = "sk-test-0000000000"  # same length: only the constant-time compare tells them apart
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 1 << 20
ORIGINS = ("http://a.example", "http://b.example")
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_chat_model: str) -> Iterator[ServerProcess]:
    """API key, a 1 MiB body limit and CORS for two origins."""
    with serving(tiny_chat_model, "--api-key", KEY, "--max-request-body-bytes", str(BODY_LIMIT),
                 "--cors-allow-origins", ",".join(ORIGINS), "--context-length", "1024",
                 "--max-total-tokens", "4000") as srv:
        yield srv


@pytest.fixture(scope="module")
def plain(tiny_chat_model: str) -> Iterator[ServerProcess]:
    """Default limits, no key, no CORS; a scheduler holding 1 running + 2 queued requests."""
    with serving(tiny_chat_model, "--max-queued-requests", "2", "--max-running-requests", "1",
                 "--slow-reader-timeout", "3600", "--context-length", "2048",
                 "--max-total-tokens", "8000") as srv:
        yield srv


@pytest.fixture(autouse=True)
def memory_invariant(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "plain" in request.fixturenames:
        check_memory_idle(request.getfixturevalue("plain"))
    if "server" in request.fixturenames:
        srv = request.getfixturevalue("server")
        deadline = time.monotonic() + 20
        while True:
            info = httpx.get(srv.base_url + "/server_info", headers=AUTH, timeout=30).json()
            if info["stats"]["running"] == 0 and info["stats"]["waiting"] == 0:
                break
            assert time.monotonic() < deadline, info["stats"]
            time.sleep(0.2)
        assert info["memory"]["ok"] and info["memory"]["locked_tokens"] == 0, info["memory"]


def completes(srv: ServerProcess, headers: dict[str, str] | None = None) -> None:
    """The server still serves an ordinary request."""
    r = httpx.post(srv.base_url + COMP, json={"model": "tiny", "prompt": "Hello", "max_tokens": 2},
                   headers=headers, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["object"] == "error" and body["error"]["code"] == status, body
    return body["error"]


# ---- raw HTTP/1.1, for what httpx will not send or cannot read back -------------------------
def raw_exchange(port: int, head: bytes, body: bytes = b"") -> tuple[int | None, dict[str, str], bytes]:
    """Send ``head`` (and ``body``), read until the server closes; (status, headers, body).

    Status None: the connection was reset or closed with no response.
    """
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(head + body)
        data = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):
                data += chunk
    return parse_response(data)


def parse_response(data: bytes) -> tuple[int | None, dict[str, str], bytes]:
    if not data.startswith(b"HTTP/1.1 "):
        return None, {}, data
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict((k.strip().lower(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:]))
    return int(lines[0].split()[1]), headers, body


def request_head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


# ---- body size -------------------------------------------------------------------------------
def test_body_over_the_limit_gets_413_and_one_under_it_is_read(server) -> None:
    big = {"model": "tiny", "prompt": "x" * BODY_LIMIT, "max_tokens": 1}
    err = error_of(httpx.post(server.base_url + COMP, json=big, headers=AUTH, timeout=60), 413)
    assert str(BODY_LIMIT) in err["message"] and "--max-request-body-bytes" in err["message"]
    # Just under the limit, the body is read and judged by the route (here: too long a prompt).
    under = {"model": "tiny", "prompt": "word " * ((BODY_LIMIT - 200) // 5), "max_tokens": 1}
    assert len(orjson.dumps(under)) < BODY_LIMIT
    err = error_of(httpx.post(server.base_url + COMP, json=under, headers=AUTH, timeout=60), 400)
    assert "context length" in err["message"]
    completes(server, AUTH)


def test_content_length_over_the_limit_is_refused_before_the_body_is_sent(server) -> None:
    # The head claims 10 GB and no body follows: an answer at all means it was not waited for.
    head = request_head("POST", COMP, {**AUTH, "Content-Type": "application/json",
                                       "Content-Length": str(10**10)})
    status, headers, body = raw_exchange(server.port, head)
    assert status == 413 and headers["connection"] == "close"
    assert "10000000000 bytes" in orjson.loads(body)["error"]["message"]
    completes(server, AUTH)


def test_chunked_body_growing_past_the_limit_is_cut_off(server) -> None:
    """No Content-Length: the server counts while reading, answers 413 once past the limit and
    reads no further, so the client cannot push its 256 MiB."""
    total = 256 << 20
    chunk = b"x" * (64 << 10)
    head = request_head("POST", COMP, {**AUTH, "Content-Type": "application/json",
                                       "Transfer-Encoding": "chunked"})
    sent = 0
    data = b""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(head + frame(b'{"model": "tiny", "prompt": "'))
        while sent < total and not select.select([s], [], [], 0)[0]:  # until an answer comes
            try:
                s.sendall(frame(chunk))
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(chunk)
        with contextlib.suppress(ConnectionResetError):
            while piece := s.recv(65536):
                data += piece
    status, _, body = parse_response(data)
    assert status == 413, data[:300]
    assert f"more than {BODY_LIMIT} bytes" in orjson.loads(body)["error"]["message"]
    assert sent < total // 4, f"the server read {sent} bytes of a body limited to {BODY_LIMIT}"
    completes(server, AUTH)


def frame(data: bytes) -> bytes:
    """One chunk of a chunked transfer."""
    return b"%x\r\n" % len(data) + data + b"\r\n"


# ---- JSON nesting depth ----------------------------------------------------------------------
def nested_schema(levels: int, leaf: str = '{"type": "integer"}') -> str:
    """An object schema with ``levels`` nested "properties" (2 JSON levels each)."""
    return '{"type": "object", "properties": {"a": ' * levels + leaf + "}}" * levels


def schema_chat(schema: str) -> bytes:
    """A chat request whose schema object sits at depth 4 of the body."""
    return ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, '
            '"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": '
            + schema + "}}}").encode()


def post_raw(srv: ServerProcess, path: str, body: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(srv.base_url + path, content=body, timeout=60,
                      headers={"Content-Type": "application/json", **(headers or {})})


@pytest.mark.parametrize("body", [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"a": ' * 100_000 + b"1" + b"}" * 100_000,
    b"[" * 100_000,  # unbalanced: refused for its depth before a parser sees it
], ids=["array", "object", "unclosed"])
def test_json_nested_100000_deep_is_a_clear_400(plain, body) -> None:
    err = error_of(post_raw(plain, CHAT, body), 400)
    assert f"more than {MAX_JSON_DEPTH} levels deep" in err["message"]
    completes(plain)


def test_json_depth_limit_is_exact_and_deep_schemas_no_longer_crash(plain) -> None:
    # Depth 64 exactly (schema at depth 4, 30 levels of 2): served.
    r = post_raw(plain, CHAT, schema_chat(nested_schema(30)))
    assert r.status_code == 200, r.text
    # One more level, inside the innermost schema: refused before parsing.
    err = error_of(post_raw(plain, CHAT, schema_chat(nested_schema(30, '{"type": "integer", "enum": [1]}'))), 400)
    assert f"more than {MAX_JSON_DEPTH} levels deep" in err["message"]
    # 200 levels used to end in a RecursionError and a 500 from the grammar code.
    err = error_of(post_raw(plain, CHAT, schema_chat(nested_schema(200))), 400)
    assert "levels deep" in err["message"]
    assert "RecursionError" not in plain.log()
    completes(plain)


def test_non_json_content_type_is_not_scanned(plain) -> None:
    """The depth scan is for JSON bodies; other content types are the route's to refuse."""
    body = b"[" * 1000
    r = httpx.post(plain.base_url + CHAT, content=body, headers={"Content-Type": "text/plain"}, timeout=30)
    assert r.status_code in (400, 415, 422) and "levels deep" not in r.text, r.text


def _depth(value: object) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


_TRICKY = st.text(alphabet='[]{}"\\ab\n\u00e9', max_size=12)
_VALUES = st.recursive(st.none() | st.integers() | _TRICKY,
                       lambda kids: st.lists(kids, max_size=3) | st.dictionaries(_TRICKY, kids, max_size=3),
                       max_leaves=30)


@settings(max_examples=400, deadline=None)
@given(_VALUES, st.integers(0, 8), st.booleans())
def test_depth_scan_matches_a_parser(value: object, limit: int, ascii_only: bool) -> None:
    """The vectorised scan against the depth of the value, on bodies whose strings are full
    of brackets, quotes and backslashes."""
    body = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert json_depth_exceeds(body, limit) == (_depth(value) > limit), body


def test_depth_scan_edge_cases() -> None:
    assert json_depth_exceeds(b"[" * 100_000 + b"]" * 100_000, MAX_JSON_DEPTH)
    assert not json_depth_exceeds(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH, MAX_JSON_DEPTH)
    assert json_depth_exceeds(b"[" * (MAX_JSON_DEPTH + 1), MAX_JSON_DEPTH)  # unclosed counts
    assert not json_depth_exceeds(b'["' + b"[" * 100 + b'"]', MAX_JSON_DEPTH)  # inside a string
    assert not json_depth_exceeds(b'["\\"' + b"[" * 100 + b'"]', MAX_JSON_DEPTH)  # \" is no end
    assert json_depth_exceeds(b'["\\\\"' + b"[" * 100 + b'"]', MAX_JSON_DEPTH)  # \\ ends the string


# ---- headers ---------------------------------------------------------------------------------
def test_header_limits(server) -> None:
    url = server.base_url + "/v1/models"
    # Just over the total size (below what uvicorn buffers): judged here, 431 with a JSON body.
    err = error_of(httpx.get(url, headers={**AUTH, "X-Big": "a" * MAX_HEADER_BYTES}, timeout=30), 431)
    assert f"at most {MAX_HEADER_BYTES}" in err["message"]
    many = {f"X-H{i}": "v" for i in range(MAX_HEADER_COUNT)}
    err = error_of(httpx.get(url, headers={**AUTH, **many}, timeout=30), 431)
    assert f"at most {MAX_HEADER_COUNT}" in err["message"]
    # Within both limits: served.
    fine = {f"X-H{i}": "v" * 200 for i in range(MAX_HEADER_COUNT - 20)}
    assert httpx.get(url, headers={**AUTH, **fine}, timeout=30).status_code == 200
    # A head larger than uvicorn (h11) buffers is never read whole: uvicorn answers a plain
    # 400 and closes the connection (or the connection is reset under the client's feet).
    head = request_head("GET", "/v1/models", {**AUTH, "X-Huge": "a" * (8 * MAX_INCOMPLETE_HEAD_BYTES)})
    status, headers, body = raw_exchange(server.port, head)
    assert status in (400, None), (status, body[:200])
    if status == 400:
        assert headers["connection"] == "close" and b"Invalid HTTP request" in body
    completes(server, AUTH)


# ---- API key ---------------------------------------------------------------------------------
PROTECTED = [
    ("GET", "/v1/models", None),
    ("POST", CHAT, {"model": "tiny", "messages": MSG, "max_tokens": 1}),
    ("POST", COMP, {"model": "tiny", "prompt": "hi", "max_tokens": 1}),
    ("POST", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1}}),
    ("GET", "/server_info", None),
    ("GET", "/get_server_info", None),
    ("GET", "/metrics", None),
    ("GET", "/health_generate", None),
    ("POST", "/flush_cache", None),
    ("POST", "/abort_request", {"rid": "nothing-running"}),
    ("GET", "/get_model_info", None),
    ("GET", "/model_info", None),
    ("POST", "/apply_chat_template", {"messages": MSG}),
    ("POST", "/concate_and_append_request", {"src_rids": ["a"], "dst_rid": "b"}),
]
BAD_CREDENTIALS = [
    {},
    {"Authorization": f"Bearer {WRONG_KEY}"},
    {"Authorization": f"Bearer {KEY}x"},
    {"Authorization": f"Bearer {KEY[:-1]}"},
    {"Authorization": KEY},  # no scheme
    {"Authorization": f"Basic {KEY}"},
    {"X-API-Key": KEY},  # not read: only Authorization: Bearer, as OpenAI
]


@pytest.mark.parametrize("method, path, body", PROTECTED, ids=[f"{m} {p}" for m, p, _ in PROTECTED])
def test_every_route_but_health_needs_the_key(server, method, path, body) -> None:
    for headers in BAD_CREDENTIALS:
        r = httpx.request(method, server.base_url + path, json=body, headers=headers, timeout=30)
        err = error_of(r, 401)
        assert err["type"] == "authentication_error" and r.headers["www-authenticate"] == "Bearer", headers
    r = httpx.request(method, server.base_url + path, json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    lower = httpx.request(method, server.base_url + path, json=body, timeout=60,
                          headers={"Authorization": f"bearer {KEY}"})  # the scheme is case-insensitive
    assert lower.status_code == 200, lower.text


def test_health_needs_no_key(server) -> None:
    assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200


def test_key_never_in_server_info_metrics_or_logs(server) -> None:
    r = httpx.get(server.base_url + "/server_info", headers=AUTH, timeout=30)
    assert r.status_code == 200 and KEY not in r.text and "api_key" not in r.json()["server_args"]
    assert KEY not in httpx.get(server.base_url + "/metrics", headers=AUTH, timeout=30).text
    # Refused and accepted requests (the tests above) left neither key in the logs.
    httpx.get(server.base_url + "/v1/models", headers={"Authorization": f"Bearer {WRONG_KEY}"}, timeout=30)
    log = server.log()
    assert KEY not in log and WRONG_KEY not in log


# ---- CORS ------------------------------------------------------------------------------------
def preflight(srv: ServerProcess, origin: str) -> httpx.Response:
    return httpx.options(srv.base_url + CHAT, timeout=30, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_cors_allows_only_the_configured_origins(server) -> None:
    url = server.base_url + "/v1/models"
    for origin in ORIGINS:
        r = httpx.get(url, headers={**AUTH, "Origin": origin}, timeout=30)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        # A preflight carries no key; it is answered all the same.
        r = preflight(server, origin)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = httpx.get(url, headers={**AUTH, "Origin": "http://evil.example"}, timeout=30)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = preflight(server, "http://evil.example")
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    # A refusal carries the header too, so a browser page can read why.
    r = httpx.get(url, headers={"Origin": ORIGINS[0]}, timeout=30)
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGINS[0]


def test_cors_is_off_by_default(plain) -> None:
    r = httpx.get(plain.base_url + "/v1/models", headers={"Origin": ORIGINS[0]}, timeout=30)
    assert r.status_code == 200 and not [h for h in r.headers if h.startswith("access-control-")]
    r = preflight(plain, ORIGINS[0])
    assert r.status_code != 200 and not [h for h in r.headers if h.startswith("access-control-")]


# ---- floods ----------------------------------------------------------------------------------
BLOCKER = orjson.dumps({
    # The native stream resends the whole output in every event, logprobs included: ~100 MB
    # for 1900 tokens.  Its reader never reads, so once the socket buffers are full (a few
    # MB) the response cannot end, and the request holds its place as long as the test needs.
    "text": "Hello", "stream": True, "return_logprob": True,
    "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True, "temperature": 0},
})
# Growth of the server's RSS allowed per refused request.  Refused in the front end, 10,000
# cost ~5 KiB each (connections open at once); the scheduler refusing them, after tokenizing
# and a round trip each, cost ~40 KiB each.
FLOOD_KIB_PER_REQUEST = 16


@contextlib.contextmanager
def every_place_held(srv: ServerProcess, running: int = 1, queued: int = 2) -> Iterator[None]:
    """Fill the server (1 running + 2 queued) with streams that never end; close them after.

    One at a time: the scheduler counts a request that has just arrived as queued until its
    next step admits it, so a burst could be refused although a running place is free.
    """
    socks = []
    received = httpx.get(srv.base_url + "/server_info", timeout=30).json()["stats"]["requests_received"]
    try:
        for held in range(1, running + queued + 1):
            s = socket.socket()
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # no autotuning: fills fast
            s.connect(("127.0.0.1", srv.port))
            s.sendall(request_head("POST", "/generate", {"Content-Type": "application/json",
                                                         "Content-Length": str(len(BLOCKER))}) + BLOCKER)
            deadline = time.monotonic() + 60
            while True:
                stats = httpx.get(srv.base_url + "/server_info", timeout=30).json()["stats"]
                if stats["requests_received"] - received == held:  # admitted to the queue
                    break
                assert time.monotonic() < deadline, stats
                time.sleep(0.05)
        yield
    finally:
        for s in socks:
            s.close()


async def _flood(port: int, n: int) -> list[tuple[int | None, dict[str, str], bytes]]:
    body = orjson.dumps({"model": "tiny", "prompt": "flood " * 50, "max_tokens": 1})
    head = request_head("POST", COMP, {"Content-Type": "application/json", "Content-Length": str(len(body))})

    async def one() -> tuple[int | None, dict[str, str], bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(head + body)
            await writer.drain()
            status, headers, _ = parse_response(await reader.readuntil(b"\r\n\r\n"))
            return status, headers, await reader.readexactly(int(headers["content-length"]))
        finally:
            writer.close()

    return await asyncio.gather(*(one() for _ in range(n)))


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def check_flood(srv: ServerProcess, n: int) -> tuple[float, float]:
    """``n`` concurrent requests while every place is taken: each gets a 503 from the front
    end; returns the server process's RSS (MiB) before and after."""
    with every_place_held(srv):
        before = rss_mib(srv.proc.pid)
        results = asyncio.run(_flood(srv.port, n))
        after = rss_mib(srv.proc.pid)
        assert srv.proc.poll() is None
    statuses = sorted({status for status, _, _ in results}, key=str)
    assert statuses == [503], statuses
    for _, headers, body in results:
        assert headers["retry-after"] == "1" and headers["connection"] == "close"
        # The front end's refusal, before tokenizing ("in flight"), not the scheduler's.
        assert "queue is full" in orjson.loads(body)["error"]["message"]
        assert "in flight" in orjson.loads(body)["error"]["message"]
    wait_idle_and_serve(srv)
    print(f"flood of {n}: server RSS {before:.0f} MiB before, {after:.0f} MiB after")
    return before, after


def wait_idle_and_serve(srv: ServerProcess) -> None:
    check_memory_idle(srv)
    completes(srv)


def test_flood_of_500_gets_503s(plain) -> None:
    before, after = check_flood(plain, 500)
    assert after - before < 8 + 500 * FLOOD_KIB_PER_REQUEST / 1024, (before, after)


@pytest.mark.slow
def test_flood_of_10000_gets_503s_with_memory_bounded(plain) -> None:
    before, after = check_flood(plain, 10_000)
    assert after - before < 8 + 10_000 * FLOOD_KIB_PER_REQUEST / 1024, (before, after)


# ---- start-up --------------------------------------------------------------------------------
def test_serving_line_comes_once_uvicorn_serves(plain) -> None:
    log = plain.log()
    line = f"serving {plain.proc.args[plain.proc.args.index('--model') + 1]} on http://127.0.0.1:{plain.port}"
    assert line in log and log.index("Application startup complete") < log.index(line), log


def test_port_in_use_exits_2_before_loading(tiny_chat_model) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "radixserve.cli", "serve", "--model", tiny_chat_model,
                               "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"radixserve: error: port {port} on 127.0.0.1 is in use; "
                                                "stop what is listening there or choose another port with --port"]
    assert proc.stdout == ""  # nothing loaded, nothing logged
