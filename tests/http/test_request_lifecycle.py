"""A request's life from its id to its last answer, over HTTP and through the Engine: client
request ids reused or duplicated, aborts by client id, the time-to-first-token metric of
non-streaming requests, a failed request in an Engine batch (the others are aborted), errors
that name the request field, and a client that leaves before its answer."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from helpers.server import memory_checked_after_each_test, tiny_chat_server, wait_idle
from prometheus_client.parser import text_string_to_metric_families

server = tiny_chat_server("--max-total-tokens", "8000", "--context-length", "2048")
memory_invariant = memory_checked_after_each_test("server")

LONG = {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0}  # seconds of decoding


async def _wait_running(base: str, client: httpx.AsyncClient, n: int) -> None:
    deadline = time.monotonic() + 60
    while (await client.get(base + "/server_info")).json()["stats"]["running"] < n:
        assert time.monotonic() < deadline, "the request never started"
        await asyncio.sleep(0.05)


def _post_generate(client: httpx.AsyncClient, base: str, rid: str, params: dict,
                   text: str = "Hello") -> asyncio.Future:
    return asyncio.ensure_future(client.post(base + "/generate", json={
        "text": text, "rid": rid, "sampling_params": params}))


def test_duplicate_rid_is_refused_and_the_first_request_still_answers(server) -> None:
    base = server.base_url

    async def main() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            first = _post_generate(client, base, "dup-1", {**LONG, "max_new_tokens": 300})
            await _wait_running(base, client, 1)
            second = await client.post(base + "/generate", json={
                "text": "Other", "rid": "dup-1", "sampling_params": {"max_new_tokens": 4}})
            return await first, second

    first, second = asyncio.run(main())
    assert second.status_code == 400
    err = second.json()["error"]
    assert "dup-1" in err["message"] and "already running" in err["message"]
    assert first.status_code == 200
    meta = first.json()["meta_info"]
    assert meta["id"] == "dup-1"
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 300
    # Once finished, the id is free again.
    again = httpx.post(base + "/generate", json={"text": "Hi", "rid": "dup-1",
                                                 "sampling_params": {"max_new_tokens": 3}}, timeout=60)
    assert again.status_code == 200 and again.json()["meta_info"]["completion_tokens"] == 3


def test_rid_reused_right_after_an_abort_gets_its_own_answer(server) -> None:
    """The aborted request's late terminal reply must not end the new request with the same id."""
    base = server.base_url

    async def main() -> httpx.Response:
        async with httpx.AsyncClient(timeout=120) as client:
            first = _post_generate(client, base, "reuse-1", LONG)
            await _wait_running(base, client, 1)
            aborted = await client.post(base + "/abort_request", json={"rid": "reuse-1"})
            assert aborted.status_code == 200
            second = _post_generate(client, base, "reuse-1", {**LONG, "max_new_tokens": 40})
            r1 = await first
            assert r1.json()["meta_info"]["finish_reason"]["type"] == "abort"
            return await second

    second = asyncio.run(main())
    if second.status_code == 400:  # the abort's reply had not reached the front end yet
        assert "already running" in second.json()["error"]["message"]
        return
    meta = second.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 40


def test_abort_request_of_a_client_rid_aborts_it(server) -> None:
    base = server.base_url

    async def main() -> httpx.Response:
        async with httpx.AsyncClient(timeout=120) as client:
            req = _post_generate(client, base, "abort-me", LONG)
            await _wait_running(base, client, 1)
            await client.post(base + "/abort_request", json={"rid": "abort-me"})
            return await req

    meta = asyncio.run(main()).json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert meta["completion_tokens"] < LONG["max_new_tokens"]


def _histogram(text: str, name: str) -> tuple[float, float]:
    """(count, sum) of the histogram ``radixserve:<name>``."""
    for family in text_string_to_metric_families(text):
        if family.name == f"radixserve:{name}":
            samples = {s.name.rsplit("_", 1)[-1]: s.value for s in family.samples if not s.labels.get("le")}
            return samples["count"], samples["sum"]
    raise AssertionError(f"no histogram {name}")


def test_non_streaming_ttft_is_the_first_tokens_time(server) -> None:
    wait_idle(server)
    before = httpx.get(server.base_url + "/metrics").text
    r = httpx.post(server.base_url + "/generate", json={
        "text": "Count with me", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True,
                                                       "temperature": 0}}, timeout=120)
    assert r.json()["meta_info"]["completion_tokens"] == 200
    meta = r.json()["meta_info"]
    assert 0 < meta["ttft"] < meta["e2e_latency"]
    after = httpx.get(server.base_url + "/metrics").text
    ttft = [a - b for a, b in zip(_histogram(after, "time_to_first_token_seconds"),
                                  _histogram(before, "time_to_first_token_seconds"), strict=True)]
    e2e = [a - b for a, b in zip(_histogram(after, "e2e_request_latency_seconds"),
                                 _histogram(before, "e2e_request_latency_seconds"), strict=True)]
    itl = [a - b for a, b in zip(_histogram(after, "inter_token_latency_seconds"),
                                 _histogram(before, "inter_token_latency_seconds"), strict=True)]
    assert ttft[0] == 1 and e2e[0] == 1
    # 199 decode steps happen after the first token: TTFT is well below the total, and the
    # gaps between tokens add up to the rest instead of being recorded as zeros.
    assert ttft[1] < e2e[1]
    assert itl[0] == 199
    assert itl[1] == pytest.approx(e2e[1] - ttft[1], rel=0.2, abs=0.05)


def test_engine_batch_failure_aborts_the_other_requests(tiny_chat_model) -> None:
    from radixserve import Engine

    with Engine(tiny_chat_model, max_total_tokens=8000, context_length=2048, dtype="float32") as engine:
        params = [{"regex": "(unclosed", "max_new_tokens": 4}] + [dict(LONG) for _ in range(3)]
        with pytest.raises(ValueError, match="regex"):
            engine.generate(["a b", "c d", "e f", "g h"], params, progress=True)
        deadline = time.monotonic() + 30
        while (stats := engine.get_stats())["running"] + stats["waiting"]:
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
        assert stats["requests_aborted"] == 3
        assert stats["generation_tokens"] < 3 * LONG["max_new_tokens"]
        assert engine.check_memory()["ok"]
        assert engine.generate("a b", {"max_new_tokens": 3})["meta_info"]["completion_tokens"] == 3


def _start_engine_in(model: str, result) -> None:
    from radixserve import Engine

    try:
        Engine(model, dtype="float32")
        result.put("started")
    except RuntimeError as e:
        result.put(str(e))


def test_engine_in_a_daemonic_process_is_a_clear_error(tiny_chat_model) -> None:
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    result = ctx.Queue()
    proc = ctx.Process(target=_start_engine_in, args=(tiny_chat_model, result), daemon=True)
    proc.start()
    message = result.get(timeout=120)
    proc.join(30)
    assert "daemonic multiprocessing process" in message


def test_largest_seed_with_n_choices_wraps_instead_of_failing(server) -> None:
    r = httpx.post(server.base_url + "/v1/completions", json={
        "model": "tiny", "prompt": "Hi", "max_tokens": 2, "n": 2, "seed": 2**63 - 1}, timeout=60)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "stop_token_ids": [99999999]}, "stop_token_ids"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/generate", {"text": "Hi", "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
    ("/generate", {"input_ids": [99999999]}, "input_ids"),
])
def test_errors_name_the_request_field(server, route: str, body: dict, param: str) -> None:
    r = httpx.post(server.base_url + route, json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_engine_refuses_a_prompt_with_a_lone_surrogate(tiny_chat_model) -> None:
    from radixserve import Engine

    with Engine(tiny_chat_model, max_total_tokens=2048, dtype="float32") as engine:
        with pytest.raises(ValueError, match="lone surrogate"):
            engine.generate("hi \ud800", {"max_new_tokens": 2})
        assert engine.generate("hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_client_leaving_a_non_streaming_request_is_logged_as_such(server) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/generate", json={"text": "Hello", "sampling_params": LONG}, timeout=0.5)
    wait_idle(server)
    log = server.log()
    assert "/generate: the client disconnected; its request was aborted" in log
    assert "unhandled error" not in log
