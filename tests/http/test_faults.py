"""Faults: bad messages at the process boundaries, processes killed under load, slow readers.

The in-process tests drive the detokenizer's and the scheduler's message handling directly;
the others kill real processes (``radixserve serve`` and the ``Engine``) with SIGKILL while a
request streams, and check that every client gets an error instead of hanging, that the
surviving processes stop with a clear log line, and that no process is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import orjson
import psutil
import pytest
import zmq
from helpers.sched_driver import make_scheduler, run_until_idle, submit
from helpers.server import ServerProcess, check_memory_idle, openai_client, server_info

from radixserve.detokenizer import DetokenizerLoop, IncrementalDetokenizer
from radixserve.frontend.openai_common import guarded_stream
from radixserve.ipc import messages as m
from radixserve.runtime.tokenizer_manager import RequestError
from radixserve.scheduler.process import _run_step, handle_frame

EXIT_S = 10.0  # survivors must be gone this long after a kill
BAD_ID = -1  # a token id the tokenizer cannot decode (OverflowError)
FLAGS = ("--context-length", "2048", "--max-total-tokens", "8000")


class Outbox:
    """Stands in for a PUSH socket: keeps what was sent, decoded."""

    def __init__(self) -> None:
        self.msgs: list[Any] = []

    def send(self, data: bytes) -> None:
        self.msgs.append(m.decode(data))


def token_out(rows: list[tuple[str, list[int], dict | None]], init: bool = False) -> bytes:
    """A TokenOut frame from ``(rid, new_ids, finished)`` rows."""
    return m.encode(m.TokenOut(
        rids=[r for r, _, _ in rows], new_ids=[ids for _, ids, _ in rows],
        finished=[None if f is None else m.FinishReason(**f) for _, _, f in rows],
        meta=[m.ReqMeta(len(ids), 0, len(ids), None) for _, ids, _ in rows],
        init=[m.DetokSettings([]) if init else None for _ in rows],
    ))


# ---------------------------------------------------------------- detokenizer boundary


@pytest.fixture(scope="module")
def tokenizer(default_model_path: str) -> Any:
    from radixserve.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path)


def test_detokenizer_drops_malformed_frames(tokenizer, caplog) -> None:
    loop = DetokenizerLoop(IncrementalDetokenizer(tokenizer))
    for frame in [b"\xff not json", b"[1, 2]", b'{"type": "nope"}', b'{"type": "token_out", "rids": []}',
                  b'{"type": "token_out", "rids": "ab", "new_ids": 5, "finished": 1, "meta": 2, "init": 3}']:
        assert loop.handle(frame) == []
    assert caplog.text.count("dropped a malformed message") == 5
    ids = tokenizer.encode("still working", add_special_tokens=False)
    out = m.decode(loop.handle(token_out([("ok", ids, {"type": "length", "matched": None})], init=True))[0])
    assert out.text_deltas == ["still working"]


def test_detokenizer_error_answers_every_request_of_the_message(tokenizer, caplog) -> None:
    loop = DetokenizerLoop(IncrementalDetokenizer(tokenizer))
    hello = tokenizer.encode("Hello there", add_special_tokens=False)
    first = m.decode(loop.handle(token_out([("a", hello[:1], None), ("b", hello[:1], None)], init=True))[0])
    assert first.TYPE == "str_out" and set(loop.detok.states) == {"a", "b"}

    # Row "a" cannot be decoded: both requests of the message get an ErrorOut (500) and
    # their state is dropped.
    frames = loop.handle(token_out([("b", hello[1:], None), ("a", [BAD_ID], None)]))
    errors = [m.decode(f) for f in frames]
    assert [(e.TYPE, e.rid, e.status) for e in errors] == [("error_out", "b", 500), ("error_out", "a", 500)]
    assert "internal error in the detokenizer" in errors[0].message and "OverflowError" in errors[0].message
    assert "Traceback" in caplog.text and loop.detok.states == {}

    # Their later rows are skipped (the scheduler keeps going until the abort arrives), a
    # request sharing the message is served, and their end (a finished row, or the
    # scheduler's own ErrorOut) is not forwarded again: one terminal message per request.
    later = loop.handle(token_out([("a", hello[1:2], None), ("c", hello, None)], init=True))
    assert [m.decode(f).rids for f in later] == [["c"]]
    assert loop.handle(token_out([("a", [], {"type": "abort", "matched": None})])) == []
    assert loop.handle(m.encode(m.ErrorOut(rid="b", message="scheduler said no", status=500))) == []
    assert loop.failed == set() and set(loop.detok.states) == {"c"}
    # An ErrorOut for a live request passes through and drops its state.
    passed = loop.handle(m.encode(m.ErrorOut(rid="c", message="gone", status=500)))
    assert m.decode(passed[0]).message == "gone" and loop.detok.states == {}


# ---------------------------------------------------------------- scheduler boundary


@pytest.fixture()
def sched(tiny_model_dir) -> Any:
    return make_scheduler(tiny_model_dir("llama"), max_total_tokens=512)


def test_scheduler_drops_malformed_frames_and_survives_any_handler_error(sched, caplog, monkeypatch) -> None:
    out = Outbox()
    for frame in [b"\x00garbage", b'{"type": "generate"}', b'{"type": "abort", "rid": "x", "extra": 1}',
                  m.encode(m.GenerateReq(rid=["not", "hashable"], input_ids=[5, 6], sampling_params={}, seed=0)),
                  m.encode(m.AbortReq(rid={"a": 1}))]:
        handle_frame(sched, frame, out)
    assert out.msgs == [] and caplog.text.count("dropped a malformed message") == 5

    def broken(*args: Any) -> Any:
        raise RuntimeError("boom")

    # A request whose handling raises gets an ErrorOut; a control call an error result.
    monkeypatch.setattr(sched.constraints, "on_arrival", broken)
    handle_frame(sched, m.encode(m.GenerateReq(rid="r1", input_ids=[5, 6], sampling_params={}, seed=0)), out)
    monkeypatch.undo()
    monkeypatch.setattr(sched, "get_stats", broken)
    handle_frame(sched, m.encode(m.ControlReq(cid="c1", command="stats")), out)
    monkeypatch.undo()
    assert [(x.TYPE, getattr(x, "rid", None), getattr(x, "status", None)) for x in out.msgs] == [
        ("error_out", "r1", 500), ("control_out", None, None)]
    assert "boom" in out.msgs[0].message and "boom" in out.msgs[1].result["error"]
    assert "r1" not in sched.reqs

    # The scheduler still serves, and its memory invariant holds.
    rid = submit(sched, [5, 6, 7], max_new_tokens=3)
    assert run_until_idle(sched)[rid]["finished"]["type"] == "length"


def test_failed_step_answers_every_live_request_and_frees_their_pages(sched, monkeypatch) -> None:
    rids = [submit(sched, [5 + i, 6, 7], max_new_tokens=50, ignore_eos=True) for i in range(3)]
    out = Outbox()
    for _ in range(2):
        _run_step(sched, out)
    assert len(sched.running) == 3 and sched.check_memory()["locked_tokens"] > 0

    def broken() -> Any:
        raise RuntimeError("step broke")

    monkeypatch.setattr(sched, "step", broken)
    out.msgs.clear()
    _run_step(sched, out)
    monkeypatch.undo()
    assert sorted(e.rid for e in out.msgs) == sorted(rids)
    assert all(e.TYPE == "error_out" and e.status == 500 and "step broke" in e.message for e in out.msgs)
    assert not sched.has_work and not sched.reqs
    report = sched.check_memory()
    assert report["request_pages"] == 0 and report["locked_tokens"] == 0
    rid = submit(sched, [9, 9, 9], max_new_tokens=2)
    assert run_until_idle(sched)[rid]["finished"]["type"] == "length"


def test_unsendable_output_is_answered_with_errors(sched, monkeypatch) -> None:
    rid = submit(sched, [5, 6, 7], max_new_tokens=1)
    real = sched.step

    def with_bad_meta() -> Any:
        out = real()
        out.meta[0].spec = {"bad": object()}  # orjson cannot encode it
        return out

    monkeypatch.setattr(sched, "step", with_bad_meta)
    out = Outbox()
    _run_step(sched, out)
    assert [(e.TYPE, e.rid) for e in out.msgs] == [("error_out", rid)]
    assert not sched.reqs and sched.check_memory()["request_pages"] == 0


# ---------------------------------------------------------------- helpers for real processes


def sse_events(lines: Iterator[str]) -> Iterator[Any]:
    """Parsed ``data:`` payloads of an SSE stream (``"[DONE]"`` as a string)."""
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else orjson.loads(data)


def alive(procs: list[psutil.Process]) -> list[int]:
    out = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
    return out


def wait_gone(procs: list[psutil.Process], timeout: float = EXIT_S) -> list[int]:
    """Pids of ``procs`` still alive after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while alive(procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive(procs)


def push(addr: str, frames: list[bytes]) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(addr)
    for f in frames:
        sock.send(f)
    sock.close()
    ctx.term()


@contextlib.contextmanager
def started(tiny_chat_model: str, *flags: str) -> Iterator[ServerProcess]:
    srv = ServerProcess("--model", tiny_chat_model, "--served-model-name", "tiny", *FLAGS, *flags).wait_ready()
    try:
        yield srv
    finally:
        srv.stop()


LONG_STREAM = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me everything."}],
               "max_tokens": 1500, "ignore_eos": True, "temperature": 0}


# ---------------------------------------------------------------- errors inside a live stream


async def _chunks(items: list[Any], closed: list[bool]) -> AsyncIterator[bytes]:
    try:
        for x in items:
            if isinstance(x, Exception):
                raise x
            yield x
    finally:
        closed.append(True)


@pytest.mark.parametrize("error, message, kind, code", [
    (RequestError("scheduler process exited with code -9", 503), "scheduler process exited", "service_unavailable", 503),
    (RequestError("the client fell behind", 408), "fell behind", "invalid_request_error", 408),
    (KeyError("oops"), "internal error: KeyError('oops')", "server_error", 500),
])
def test_stream_failing_after_start_ends_with_error_event_and_done(error, message, kind, code) -> None:
    closed: list[bool] = []

    async def run() -> list[bytes]:
        rest = _chunks([b"data: 2\n\n", error, b"data: never\n\n"], closed)
        return [c async for c in guarded_stream(b"data: 1\n\n", rest)]

    out = asyncio.run(run())
    assert out[:2] == [b"data: 1\n\n", b"data: 2\n\n"] and out[-1] == b"data: [DONE]\n\n" and len(out) == 4
    event = orjson.loads(out[2].removeprefix(b"data: "))
    assert set(event) == {"error"} and message in event["error"]["message"]
    assert event["error"]["type"] == kind and event["error"]["code"] == code and "param" in event["error"]
    assert closed == [True]


def test_stream_stopped_by_its_client_closes_its_source() -> None:
    closed: list[bool] = []

    async def run() -> None:
        stream = guarded_stream(b"data: 1\n\n", _chunks([b"data: 2\n\n"] * 5, closed))
        assert await stream.__anext__() == b"data: 1\n\n"
        assert await stream.__anext__() == b"data: 2\n\n"
        await stream.aclose()  # what the server does when the client goes away

    asyncio.run(run())
    assert closed == [True]


def test_detokenizer_error_fails_the_request_and_nothing_dies(tiny_chat_model) -> None:
    from radixserve import Engine

    with Engine(tiny_chat_model, max_total_tokens=4096, context_length=2048, dtype="float32") as eng:
        pids = [p.pid for p in eng.procs.procs.values()]
        # Long enough that the request is still running when the bad frame arrives, however
        # slow the machine; the front end aborts it once its error is delivered.
        params = {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0}
        stream = eng.generate("Once upon a time", params, stream=True)
        assert next(stream)["output_ids"]
        (key,) = list(eng.tm.states)  # the request's id between the processes
        push(eng.procs.paths.detokenizer, [b"garbage", token_out([(key, [BAD_ID], None)])])
        with pytest.raises(RequestError, match="internal error in the detokenizer.*OverflowError") as info:
            for _ in stream:
                pass
        assert info.value.status == 500
        # Nothing died; the engine keeps serving; once the failed request has run out (or
        # been aborted), the memory invariant holds.
        assert all(psutil.pid_exists(p) for p in pids) and eng.procs.dead_process() is None
        assert eng.generate("Hi", {"max_new_tokens": 3, "ignore_eos": True})["meta_info"]["completion_tokens"] == 3
        deadline = time.monotonic() + 60
        while eng.get_stats()["running"] and time.monotonic() < deadline:
            time.sleep(0.2)
        report = eng.check_memory()
        assert report["ok"] and report["locked_tokens"] == 0 and report["request_pages"] == 0


# ---------------------------------------------------------------- kill -9 under a live stream


def kill_child_under_stream(tiny_chat_model: str, victim: str, read_stream: Any) -> None:
    """Kill ``victim`` (scheduler | detokenizer) while ``read_stream(srv, kill)`` streams; the
    server must exit with code 1 within the limit, the survivor with a log line, no orphan."""
    srv = ServerProcess("--model", tiny_chat_model, "--served-model-name", "tiny", *FLAGS).wait_ready()
    try:
        pids = server_info(srv)["pids"]
        children = srv.children()
        assert {pids["scheduler"], pids["detokenizer"]} <= {c.pid for c in children}
        killed_at: list[float] = []

        def kill() -> None:
            os.kill(pids[victim], signal.SIGKILL)
            killed_at.append(time.monotonic())

        read_stream(srv, kill)
        assert killed_at and time.monotonic() - killed_at[0] < EXIT_S, "the stream outlived the limit"
        code = srv.proc.wait(EXIT_S - (time.monotonic() - killed_at[0]) + 1)
        assert code == 1, srv.log()
        assert wait_gone(children, 2) == [], "orphan processes"
        log = srv.log()
        assert f"{victim} process exited with code -9; the server stops" in log, log
        survivor = "detokenizer" if victim == "scheduler" else "scheduler"
        assert f"{survivor} stops: asked to by the launcher" in log, log
        assert "server stopped (exit code 1)" in log, log
    finally:
        srv.stop()


def test_killed_scheduler_ends_openai_stream_with_api_error(tiny_chat_model) -> None:
    import openai

    def read(srv: ServerProcess, kill: Any) -> None:
        client = openai_client(srv)
        stream = client.chat.completions.create(
            model="tiny", messages=LONG_STREAM["messages"], max_tokens=1500, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        chunks = 0
        with pytest.raises(openai.APIError, match="scheduler process exited with code -9") as info:
            for _ in stream:
                chunks += 1
                if chunks == 3:
                    kill()
        assert chunks >= 3 and info.value.body["code"] == 503

    kill_child_under_stream(tiny_chat_model, "scheduler", read)


@pytest.mark.slow
def test_killed_detokenizer_ends_completion_stream_with_error_event(tiny_chat_model) -> None:
    def read(srv: ServerProcess, kill: Any) -> None:
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=30) as r:
            events = []
            for event in sse_events(r.iter_lines()):
                events.append(event)
                if len(events) == 3:
                    kill()
        assert events[-1] == "[DONE]" and "choices" in events[0]
        err = events[-2]["error"]
        assert "detokenizer process exited with code -9" in err["message"], err
        assert err["type"] == "service_unavailable" and err["code"] == 503

    kill_child_under_stream(tiny_chat_model, "detokenizer", read)


@pytest.mark.slow
def test_killed_http_process_closes_streams_and_leaves_no_orphan(tiny_chat_model) -> None:
    srv = ServerProcess("--model", tiny_chat_model, "--served-model-name", "tiny", *FLAGS).wait_ready()
    try:
        children = srv.children()
        assert len(children) >= 2
        body = {"text": "Once upon a time", "stream": True,
                "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
        events = []
        with pytest.raises(httpx.TransportError), \
                httpx.stream("POST", srv.base_url + "/generate", json=body, timeout=30) as r:
            for event in sse_events(r.iter_lines()):
                events.append(event)
                if len(events) == 3:
                    os.kill(srv.proc.pid, signal.SIGKILL)
        assert "[DONE]" not in events
        assert srv.proc.wait(5) == -signal.SIGKILL
        assert wait_gone(children) == [], "orphan processes"
        log = srv.log()
        assert "launcher is gone; scheduler exits" in log and "launcher is gone; detokenizer exits" in log, log
    finally:
        srv.stop()


# ---------------------------------------------------------------- the offline Engine


def engine_kill(folder: str, victim: str) -> None:
    from radixserve import Engine

    eng = Engine(folder, max_total_tokens=4096, context_length=2048, dtype="float32")
    try:
        procs = {name: psutil.Process(p.pid) for name, p in eng.procs.procs.items()}
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["out"] = eng.generate("Once upon a time", {"max_new_tokens": 1500, "ignore_eos": True})
            except Exception as e:
                result["error"], result["at"] = e, time.monotonic()

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        deadline = time.monotonic() + 30
        while eng.get_stats()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        procs[victim].kill()
        killed = time.monotonic()
        worker.join(EXIT_S)
        assert not worker.is_alive(), "generate still waiting after the kill"
        err = result.get("error")
        assert isinstance(err, RequestError) and victim in str(err), result
        assert result["at"] - killed < EXIT_S
        with pytest.raises(RequestError, match=victim):
            eng.generate("Hi", {"max_new_tokens": 2})
        survivor = "detokenizer" if victim == "scheduler" else "scheduler"
        assert wait_gone([procs[survivor]], EXIT_S - (time.monotonic() - killed)) == [], \
            f"the {survivor} outlived the {victim}"
    finally:
        t0 = time.monotonic()
        eng.shutdown()
        assert time.monotonic() - t0 < 5, "shutdown() is slow after a process died"


def test_engine_fails_calls_when_its_scheduler_is_killed(tiny_chat_model) -> None:
    engine_kill(tiny_chat_model, "scheduler")


def test_engine_fails_calls_when_its_detokenizer_is_killed(tiny_chat_model) -> None:
    engine_kill(tiny_chat_model, "detokenizer")


# ---------------------------------------------------------------- slow readers


def open_unread_stream(srv: ServerProcess, n: int = 16) -> socket.socket:
    """A chat stream whose client reads nothing: many large chunks (``n`` choices with top
    logprobs) into a small receive window, so the server's socket buffers soon fill up and
    its writes block."""
    body = orjson.dumps({**LONG_STREAM, "max_tokens": 1000, "stream": True, "n": n, "logprobs": True,
                         "top_logprobs": 20, "temperature": 1.0})
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", srv.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


@pytest.mark.slow
def test_slow_reader_is_cut_off_and_does_not_stall_others(tiny_chat_model) -> None:
    with started(tiny_chat_model, "--slow-reader-timeout", "2", "--max-total-tokens", "20000") as srv:
        stats = server_info(srv)["stats"]
        before, finished = stats["requests_aborted"], stats["requests_finished"]
        sock = open_unread_stream(srv)
        try:
            ok = httpx.post(srv.base_url + "/v1/chat/completions", timeout=60, json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                "ignore_eos": True})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8
            # The 16 choices of the unread stream are aborted (not finished) in the scheduler,
            # long before their 1000 tokens, and their pages are freed.
            deadline = time.monotonic() + 120
            while (info := server_info(srv))["stats"]["requests_aborted"] < before + 16:
                assert info["stats"]["running"] > 0, f"the slow stream ran to its end: {info['stats']}"
                assert time.monotonic() < deadline, info["stats"]
                time.sleep(0.5)
            assert info["stats"]["requests_finished"] == finished + 1  # the other request only
            check_memory_idle(srv)
        finally:
            sock.close()
        assert srv.stop() == 0


# ---------------------------------------------------------------- the soak benchmark, briefly


@pytest.mark.slow
def test_soak_smoke_run(tiny_chat_model, tmp_path) -> None:
    """bench/soak.py for a few seconds: every request answered cleanly, memory sound, clean exit
    (its RSS and TTFT checks need minutes, so they are not asserted here)."""
    import sys
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[2])
    if repo not in sys.path:
        sys.path.insert(0, repo)
    from bench import soak

    report = soak.main(["--minutes", "0.25", "--model", tiny_chat_model, "--concurrency", "6",
                        "--out", str(tmp_path / "soak.json")])
    assert report["verdicts"].get("lost", 0) == 0 and report["verdicts"].get("unexpected", 0) == 0, report["verdicts"]
    assert sum(report["verdicts"].values()) >= 6
    by_name = {c["check"]: c["ok"] for c in report["checks"]}
    assert by_name["memory invariant when idle, no page or lock left"] is True
    assert by_name["the server exits 0 on SIGTERM"] is True
    assert (tmp_path / "soak.json").exists()
