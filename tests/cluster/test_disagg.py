"""Prefill-decode disaggregation behind the real smg binary (``--pd-disaggregation``), on the
default model: a prefill worker and a decode worker answer what one worker answers, token for
token, on every route (chat, completions, ``/generate``, streamed, logprobs, ``cached_tokens``),
and the decode worker's next turn hits its own tree; only the part of a prompt the decode worker
does not hold moves.  Failures end the request on both sides with an error and leave no slot
behind: a room used twice, a transfer that never comes, prompts that differ, a killed worker.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from helpers.router import ROUTER_TEST_FLAGS, RouterProcess
from helpers.server import ServerProcess, check_memory_idle, free_port, openai_client, server_info

from radixserve.config import ServerArgs
from radixserve.runtime.jobs import bootstraps

WORKER_ENV = {"OMP_NUM_THREADS": "1"}
TIMEOUT = "5"  # --disaggregation-timeout of the workers here
MODEL = "SmolLM2-135M-Instruct"


@dataclass
class Pair:
    prefill: ServerProcess
    decode: ServerProcess
    boot: int
    router: RouterProcess | None = None

    def client(self) -> openai.OpenAI:
        assert self.router is not None
        return openai.OpenAI(base_url=self.router.base_url + "/v1", api_key="none", max_retries=0)


def start_pair(*, grpc: bool = False, backend: str = "zmq") -> Pair:
    """A prefill and a decode worker behind smg, as HTTP workers or (``grpc``) as smg's
    ``grpc://`` workers (smg then tokenizes and detokenizes); the KV moved by ``backend``."""
    boot, ports = free_port(), [free_port(), free_port()]
    extra = [["--grpc-port", str(port)] * grpc + ["--disaggregation-transfer-backend", backend] for port in ports]
    pair = Pair(ServerProcess("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot),
                              "--disaggregation-timeout", TIMEOUT, *extra[0], env=WORKER_ENV),
                ServerProcess("--disaggregation-mode", "decode", "--disaggregation-timeout", TIMEOUT, *extra[1],
                              env=WORKER_ENV),
                boot)
    try:
        pair.prefill.wait_ready()
        pair.decode.wait_ready()
        urls = [f"grpc://127.0.0.1:{port}" for port in ports] if grpc else [pair.prefill.base_url, pair.decode.base_url]
        tokenizer = ["--model-path", server_info(pair.decode)["model_path"]] if grpc else []
        pair.router = RouterProcess([], "--pd-disaggregation", "--prefill", urls[0], str(boot), "--decode", urls[1],
                                    *tokenizer, *ROUTER_TEST_FLAGS["smg"], policy="round_robin").wait_ready(2)
    except BaseException:
        stop_pair(pair)
        raise
    return pair


def stop_pair(pair: Pair) -> list[int]:
    if pair.router is not None:
        pair.router.stop()
    return [pair.prefill.stop(), pair.decode.stop()]


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    p = start_pair()
    yield p
    codes = stop_pair(p)
    assert codes == [0, 0], [p.prefill.log(), p.decode.log()]


@pytest.fixture(scope="module")
def single() -> Iterator[ServerProcess]:
    srv = ServerProcess(env=WORKER_ENV).wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(autouse=True)
def memory_invariant(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "pair" in request.fixturenames:
        p = request.getfixturevalue("pair")
        check_memory_idle(p.prefill)
        check_memory_idle(p.decode)


def transfers(srv: ServerProcess) -> dict:
    return server_info(srv)["stats"]["disaggregation"]


# ---- a pair answers what one worker answers ---------------------------------------------------
def chat_turns_equal_one_workers(pair: Pair, single: ServerProcess, system: bool = True, grpc: bool = False) -> None:
    """Two turns of one conversation through the pair and on one worker: the same answers and
    counts; the second turn's history is in the decode worker's tree, and only the part of each
    prompt the decode worker's tree did not hold moved.  (smg's gRPC chat trims whitespace.)"""
    bytes_per_token = server_info(pair.decode)["model_info"]["kv_cache_bytes_per_token"]
    messages = [{"role": "system", "content": "You are a helpful assistant who answers briefly."}] * system + \
        [{"role": "user", "content": "Name three rivers in Europe."}]
    for turn in range(2):
        before = transfers(pair.decode)
        got = pair.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
        want = openai_client(single).chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                                             temperature=0)
        text = want.choices[0].message.content
        assert got.choices[0].message.content == ((text or "").strip() if grpc else text)
        assert got.choices[0].finish_reason == want.choices[0].finish_reason
        assert got.usage.completion_tokens == want.usage.completion_tokens
        assert got.usage.prompt_tokens == want.usage.prompt_tokens
        cached = got.usage.prompt_tokens_details.cached_tokens
        after = transfers(pair.decode)
        assert after["transfers"] == before["transfers"] + 1
        moved = (after["bytes"] - before["bytes"]) // bytes_per_token
        # smg's gRPC PD path reports the prefill worker's cached_tokens; the decode worker's hit
        # (what did not move) is then the one worker's
        hit = want.usage.prompt_tokens_details.cached_tokens if grpc else cached
        assert cached == want.usage.prompt_tokens_details.cached_tokens or grpc
        assert (cached > 0) == (hit > 0) == (turn == 1)
        assert moved == got.usage.prompt_tokens - hit
        messages += [{"role": "assistant", "content": want.choices[0].message.content},
                     {"role": "user", "content": "And three mountains?"}]


def test_chat_turns_equal_one_workers_and_the_next_turn_hits_the_decode_workers_tree(pair, single) -> None:
    chat_turns_equal_one_workers(pair, single)


def test_streamed_chat_and_completions_with_two_choices_equal_one_workers(pair, single) -> None:
    def stream_text(client: openai.OpenAI) -> str:
        chunks = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to five."}],
                                                max_tokens=20, temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    assert stream_text(pair.client()) == stream_text(openai_client(single))
    got = pair.client().completions.create(model=MODEL, prompt="The tallest mountain in the world", max_tokens=16,
                                           temperature=0, n=2)
    want = openai_client(single).completions.create(model=MODEL, prompt="The tallest mountain in the world",
                                                    max_tokens=16, temperature=0, n=2)
    assert [c.text for c in got.choices] == [c.text for c in want.choices]
    assert got.choices[0].text == got.choices[1].text  # each choice had its own room
    # smg sends a chat with n > 1 one room per choice (lists of bootstrap fields), and min_tokens
    # > 1 reaches the prefill worker, which samples one token
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "Say yes."}], "max_tokens": 12,
          "temperature": 0, "n": 2, "extra_body": {"min_tokens": 6}}
    got, want = pair.client().chat.completions.create(**kw), openai_client(single).chat.completions.create(**kw)
    assert [c.message.content for c in got.choices] == [c.message.content for c in want.choices]
    assert got.usage.completion_tokens == want.usage.completion_tokens >= 12


def test_generate_with_logprobs_and_a_batch_equal_one_workers(pair, single) -> None:
    body = {"text": "Water boils at", "sampling_params": {"max_new_tokens": 12, "temperature": 0},
            "return_logprob": True, "top_logprobs_num": 2}
    got = httpx.post(pair.router.base_url + "/generate", json=body, timeout=60).json()
    want = httpx.post(single.base_url + "/generate", json=body, timeout=60).json()
    assert got["text"] == want["text"]
    for key in ("output_token_logprobs", "input_token_logprobs"):
        assert [t[1] for t in got["meta_info"][key]] == [t[1] for t in want["meta_info"][key]]
        assert [t[0] for t in got["meta_info"][key]] == pytest.approx([t[0] for t in want["meta_info"][key]], abs=1e-4)
    assert [[t[1] for t in row] for row in got["meta_info"]["output_top_logprobs"]] == \
        [[t[1] for t in row] for row in want["meta_info"]["output_top_logprobs"]]
    # a batch (smg's schema takes one prompt per /generate; SGLang's clients send batches with a
    # room per prompt): sent to both workers as smg would
    batch = {"text": ["One plus one is", "The color of the sky is"],
             "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    _, got = post_both(pair, *[{**batch, "bootstrap_host": "127.0.0.1", "bootstrap_port": pair.boot,
                                "bootstrap_room": [11, 12]}] * 2)
    want = httpx.post(single.base_url + "/generate", json=batch, timeout=60).json()
    assert [r["text"] for r in got.json()] == [r["text"] for r in want]


def test_json_schema_output_and_seeded_sampling_equal_one_workers(pair, single) -> None:
    """The prefill worker's grammar picks the first token, the decode worker's takes it and
    goes on; a seeded draw depends only on the seed and the token's position."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "people": {"type": "integer"}},
              "required": ["city", "people"]}
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "Describe Paris as JSON."}], "max_tokens": 40,
          "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}}
    got = pair.client().chat.completions.create(**kw).choices[0].message.content
    assert got == openai_client(single).chat.completions.create(**kw).choices[0].message.content
    kw = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 1.0, "seed": 7}
    got = pair.client().completions.create(**kw).choices[0].text
    assert got == openai_client(single).completions.create(**kw).choices[0].text


# The default run moves the KV of the gRPC pair through NIXL (the HTTP pair above moves it
# through ZMQ); the gRPC pair over ZMQ and the HTTP pair over NIXL run with -m slow.
@pytest.mark.parametrize("backend", [pytest.param("zmq", marks=pytest.mark.slow), "nixl"])
def test_a_pair_of_grpc_workers_behind_smg_equals_one_worker(single, backend: str) -> None:
    """smg's gRPC PD path: it sends the bootstrap fields as ``disaggregated_params``."""
    pair = start_pair(grpc=True, backend=backend)
    try:
        assert httpx.post(single.base_url + "/flush_cache", timeout=30).status_code == 200  # both start empty
        chat_turns_equal_one_workers(pair, single, system=False, grpc=True)
        check_memory_idle(pair.prefill)
        check_memory_idle(pair.decode)
    finally:
        stop_pair(pair)


@pytest.mark.slow
def test_the_kv_written_through_nixl_gives_one_workers_answers(single) -> None:
    """--disaggregation-transfer-backend nixl: the prefill worker writes the KV into the decode
    worker's slots (UCX, here over shared memory or TCP between two processes)."""
    pair = start_pair(backend="nixl")
    try:
        assert httpx.post(single.base_url + "/flush_cache", timeout=30).status_code == 200
        chat_turns_equal_one_workers(pair, single)
        body = {"text": "Water boils at", "sampling_params": {"max_new_tokens": 8, "temperature": 0},
                "return_logprob": True}
        got = httpx.post(pair.router.base_url + "/generate", json=body, timeout=60).json()
        want = httpx.post(single.base_url + "/generate", json=body, timeout=60).json()
        assert got["text"] == want["text"]
        assert [t[0] for t in got["meta_info"]["output_token_logprobs"]] == \
            pytest.approx([t[0] for t in want["meta_info"]["output_token_logprobs"]], abs=1e-4)
        check_memory_idle(pair.prefill)
        check_memory_idle(pair.decode)
    finally:
        stop_pair(pair)


# ---- failures: an error for the client, nothing left behind ----------------------------------
def post_both(pair: Pair, prefill_body: dict, decode_body: dict) -> tuple[httpx.Response, httpx.Response]:
    """What smg does: the same room to both workers at once."""
    with cf.ThreadPoolExecutor(2) as ex:
        p = ex.submit(httpx.post, pair.prefill.base_url + "/generate", json=prefill_body, timeout=60)
        d = ex.submit(httpx.post, pair.decode.base_url + "/generate", json=decode_body, timeout=60)
        return p.result(), d.result()


def room(pair: Pair, text: str, number: int, port: int | None = None) -> dict:
    return {"text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": port or pair.boot, "bootstrap_room": number}


def test_a_room_used_twice_is_refused_and_a_prefill_or_a_decode_left_alone_times_out(pair) -> None:
    """Also: a decode request whose transfer never comes (no prefill worker at its bootstrap
    port) fails at the timeout, waited for at the same time as the prefill's."""
    body = room(pair, "A room for one request", 77)
    with cf.ThreadPoolExecutor(3) as ex:
        first = ex.submit(httpx.post, pair.prefill.base_url + "/generate", json=body, timeout=60)
        orphan = ex.submit(httpx.post, pair.decode.base_url + "/generate", timeout=60,
                           json=room(pair, "Nobody prefills this", 78, free_port()))
        time.sleep(1.0)
        second = httpx.post(pair.prefill.base_url + "/generate", json=body, timeout=60)
        assert second.status_code == 400 and "bootstrap_room 77 is already in use" in second.text
        t0 = time.monotonic()
        first = first.result()
        orphan = orphan.result()
    assert first.status_code == 504 and "no decode worker asked for the KV of bootstrap_room 77" in first.text
    assert time.monotonic() - t0 < 10
    assert orphan.status_code == 504 and "no KV arrived from the prefill worker" in orphan.text
    assert transfers(pair.decode)["in_flight"] == 0


def test_a_client_gone_from_a_prefilled_request_frees_it_at_once(pair) -> None:
    """Prefilled and waiting for a decode worker that never asks: the client leaving aborts
    it then, not at the timeout; its room is not taken again."""
    before = transfers(pair.prefill)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(pair.prefill.base_url + "/generate", json=room(pair, "Nobody decodes this", 81), timeout=1.5)
    deadline = time.monotonic() + 3  # under the 5 s timeout
    while server_info(pair.prefill)["stats"]["running"]:
        assert time.monotonic() < deadline, "the prefilled request was not freed when its client left"
        time.sleep(0.1)
    assert transfers(pair.prefill)["failed"] == before["failed"]  # aborted, not timed out
    again = httpx.post(pair.prefill.base_url + "/generate", json=room(pair, "Nobody decodes this", 81), timeout=30)
    assert again.status_code == 400 and "was used by an earlier request" in again.text


def test_a_room_dropped_by_the_decode_worker_and_a_room_used_again_are_refused_at_once(pair) -> None:
    with pytest.raises(httpx.TimeoutException):  # the decode worker's client leaves before the prefill comes
        httpx.post(pair.decode.base_url + "/generate", json=room(pair, "Late prefill", 82), timeout=1.0)
    time.sleep(0.5)
    t0 = time.monotonic()
    late = httpx.post(pair.prefill.base_url + "/generate", json=room(pair, "Late prefill", 82), timeout=30)
    assert late.status_code == 502 and "the decode worker dropped the request" in late.text
    assert time.monotonic() - t0 < 2  # not computed, not waited for
    p, d = post_both(pair, room(pair, "Used once", 83), room(pair, "Used once", 83))
    assert p.status_code == d.status_code == 200
    again = httpx.post(pair.prefill.base_url + "/generate", json=room(pair, "Used once", 83), timeout=30)
    assert again.status_code == 400 and "was used by an earlier request" in again.text


def test_a_bootstrap_host_that_is_no_address_is_refused(pair) -> None:
    r = httpx.post(pair.decode.base_url + "/generate", timeout=30,
                   json={**room(pair, "x", 84), "bootstrap_host": "http://not a host"})
    assert r.status_code == 400 and "are no address" in r.text


def test_prompts_that_differ_fail_both_sides(pair) -> None:
    p, d = post_both(pair, room(pair, "The first prompt", 79), room(pair, "A different second prompt", 79))
    assert p.status_code == 400 and "differs from the prefill worker's" in p.text
    assert d.status_code == 400 and "differs from the prefill worker's" in d.text


def test_a_colocated_worker_refuses_bootstrap_fields(single) -> None:
    r = httpx.post(single.base_url + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "bootstrap_host": "127.0.0.1",
                         "bootstrap_port": 8998, "bootstrap_room": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bootstrap_room"


LONG = "The history of every river, mountain and city in Europe, told slowly. " * 400  # ~6k tokens


@pytest.mark.parametrize("victim", ["decode", pytest.param("prefill", marks=pytest.mark.slow)])
def test_a_killed_worker_fails_its_in_flight_request_and_the_survivor_frees_its_slots(victim: str) -> None:
    pair = start_pair()
    try:
        with cf.ThreadPoolExecutor(1) as ex:
            call = ex.submit(pair.client().completions.create, model=MODEL, prompt=LONG, max_tokens=32, temperature=0)
            deadline = time.monotonic() + 30
            while transfers(pair.decode)["in_flight"] == 0:  # the decode worker has asked for the KV
                assert time.monotonic() < deadline and not call.done(), "the transfer never started"
                time.sleep(0.02)
            killed = getattr(pair, victim)
            os.kill(killed.proc.pid, signal.SIGKILL)  # the launcher: its scheduler follows it
            with pytest.raises(openai.APIStatusError) as e:
                call.result(timeout=60)
        assert e.value.status_code >= 500
        survivor = pair.prefill if victim == "decode" else pair.decode
        check_memory_idle(survivor)
        info = server_info(survivor)  # its request failed, or was aborted when smg gave up on the pair
        assert info["stats"]["disaggregation"]["failed"] + info["stats"]["requests_aborted"] >= 1  # smg retries
        assert info["stats"]["disaggregation"]["transfers"] == 0
    finally:
        stop_pair(pair)


# ---- settings --------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, message", [
    ({"disaggregation_mode": "both"}, "disaggregation_mode must be one of null, prefill, decode"),
    ({"disaggregation_transfer_backend": "mooncake"}, "must be one of zmq, nixl"),
    ({"disaggregation_mode": "decode", "tp_size": 2}, "needs tp_size 1"),
    ({"disaggregation_bootstrap_port": 0}, "must be a TCP port"),
    ({"disaggregation_timeout": 0}, "positive number of seconds"),
])
def test_bad_settings_are_refused_before_the_model_loads(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kw)


def test_nixl_is_refused_where_it_is_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "nixl" else real(name, *a))
    with pytest.raises(ValueError, match="needs the nixl package"):
        ServerArgs(disaggregation_mode="prefill", disaggregation_transfer_backend="nixl")
    ServerArgs(disaggregation_transfer_backend="nixl")  # a colocated worker does not use it


def test_the_rooms_of_a_batch() -> None:
    one, two = bootstraps("h", None, 9, 2)
    assert (one.room, two.room, one.port, one.host) == ("9.0", "9.1", 8998, "h")
    assert [b.room for b in bootstraps(["a", "b"], [1, 2], [5, 6], 2)] == ["5", "6"]
    assert bootstraps(None, None, None, 3) == [None, None, None]
    with pytest.raises(ValueError, match="3 bootstrap_room values for 2 requests"):
        bootstraps("h", 1, [1, 2, 3], 2)
    # two completion prompts with two choices each: smg sends one room per prompt
    assert [b.room for b in bootstraps("h", 1, [5, 6], 4, prompts=2)] == ["5.0", "5.1", "6.0", "6.1"]
    assert [b.room for b in bootstraps("h", 1, [5, 6, 7, 8], 4, prompts=2)] == ["5", "6", "7", "8"]
    assert [b.room for b in bootstraps("h", 1, 9, 4, prompts=2)] == ["9.0", "9.1", "9.2", "9.3"]
