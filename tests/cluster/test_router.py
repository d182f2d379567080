"""radixserve workers behind the real routers, end to end: smg (SGLang Model Gateway) and its
predecessor ``sglang-router``, each test once per router.

Two ``radixserve serve`` workers and the router (``cache_aware``) are started once per router.
Through the router, with the official ``openai`` client and httpx: chat, completions and
``/generate``, streamed or not, answer what a worker answers directly for the same greedy
request; a repeated prefix is served from the cache of the worker the router sent it to;
fields of SGLang's schemas that the router adds at their defaults are accepted, and one set to
ask for a feature radixserve lacks is a 400 naming it while the worker keeps serving;
radixserve's chat extensions pass through smg; a client that disconnects mid-stream frees the
worker's pages; the router's own endpoints that reach the workers (``/workers``,
``/get_loads`` from ``/v1/loads`` or ``/get_load``, ``/get_model_info``, ``/flush_cache``,
``/engine_metrics``) work; and with one worker killed the router answers from the other.
Needs the ``smg`` and ``sglang-router`` packages (dev dependencies).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import openai
import psutil
import pytest
from helpers.assertions import assert_eventually
from helpers.router import ROUTER_TEST_FLAGS, ROUTERS, RouterProcess
from helpers.server import ServerProcess, check_memory_idle, server_info

WORKER_FLAGS = ("--served-model-name", "tiny", "--max-total-tokens", "20000", "--context-length", "2048")
WORKER_ENV = {"OMP_NUM_THREADS": "1"}  # two workers share this machine's cores
SYSTEM = "You are a travel agent. Be concise, friendly and precise in every answer. " * 4
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@dataclass
class Cluster:
    workers: list[ServerProcess]
    router: RouterProcess
    killed: set[int] = field(default_factory=set)  # indexes of workers a test killed

    def alive(self) -> list[ServerProcess]:
        return [w for i, w in enumerate(self.workers) if i not in self.killed]


@pytest.fixture(scope="module", params=sorted(ROUTERS))
def cluster(tiny_chat_model: str, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    workers = [ServerProcess("--model", tiny_chat_model, *WORKER_FLAGS, env=WORKER_ENV) for _ in range(2)]
    router = None
    killed: set[int] = set()
    try:
        for w in workers:
            w.wait_ready()
        router = RouterProcess([w.base_url for w in workers], *ROUTER_TEST_FLAGS[request.param],
                                router=request.param).wait_ready(2)
        yield Cluster(workers, router, killed)
    finally:
        if router is not None:
            router.stop()
        codes = [w.stop() for w in workers]
    assert all(code == 0 for i, code in enumerate(codes) if i not in killed), [w.log() for w in workers]


@pytest.fixture(autouse=True)
def memory_invariant(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test: every live worker idle, its memory invariant holding, no page held."""
    yield
    if "cluster" in request.fixturenames:
        for w in request.getfixturevalue("cluster").alive():
            check_memory_idle(w)


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def routed(cluster: Cluster) -> openai.OpenAI:
    return client(cluster.router.base_url)


def stats(worker: ServerProcess) -> dict:
    return server_info(worker)["stats"]


def flush(cluster: Cluster) -> None:
    r = httpx.post(cluster.router.base_url + "/flush_cache", timeout=30)
    assert r.status_code == 200 and r.json()["workers_flushed"] == len(cluster.alive()), r.text


def chat_messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def sse_events(lines: list[str]) -> list[dict]:
    events = [ln[6:] for ln in lines if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# ---------------------------------------------------------------- registration, router endpoints


def test_router_registers_workers_and_proxies_their_endpoints(cluster: Cluster, tiny_chat_model: str) -> None:
    router = cluster.router.base_url
    listed = {w["url"]: w for w in cluster.router.workers()}
    assert set(listed) == {w.base_url for w in cluster.workers}
    for w in listed.values():  # from /server_info and /model_info
        assert w["is_healthy"] and w["model_id"] == "tiny", w
        meta = cluster.router.labels(w)
        assert meta["model_path"] == tiny_chat_model and meta["served_model_name"] == "tiny"
        assert meta["tp_size"] == "1" and meta["dp_size"] == "1" and meta["model_type"] == "llama"
    assert [m["id"] for m in httpx.get(router + "/v1/models", timeout=10).json()["data"]] == ["tiny"]
    info = httpx.get(router + "/get_model_info", timeout=10).json()
    assert info["model_path"] == tiny_chat_model and info["architectures"] == ["LlamaForCausalLM"]
    # /get_loads asks every worker's load (/v1/loads or /get_load).
    loads = cluster.router.wait_loads(lambda loads: len(loads) == 2)
    assert sorted(loads) == sorted(listed) and set(loads.values()) == {0}, loads

    # One request reaches one worker: it has finished requests, the other none, and the
    # router still merges their metrics (label names agree), then flushes both caches.
    r = httpx.post(router + "/generate", json={"text": SYSTEM, "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    assert r.status_code == 200, r.text
    assert sorted(stats(w)["tree_tokens"] > 0 for w in cluster.workers) == [False, True]
    metrics = httpx.get(router + "/engine_metrics", timeout=10)
    assert metrics.status_code == 200, metrics.text
    name = cluster.router.metric_name("radixserve:requests_total")
    for w in cluster.workers:
        assert f'{name}{{finish_reason="length",worker_addr="{w.base_url}"}}' in metrics.text
    flush(cluster)
    assert [stats(w)["tree_tokens"] for w in cluster.workers] == [0, 0]


# ---------------------------------------------------------------- generation through the router


def test_chat_through_router_matches_the_worker_and_reuses_the_cache(cluster: Cluster, routed: openai.OpenAI) -> None:
    flush(cluster)
    msgs = chat_messages("Where is Rome?")
    first = routed.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # both caches were just flushed
    stream = routed.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    text, finishes, usage = "", [], None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finishes.append(chunk.choices[0].finish_reason)
        usage = chunk.usage or usage
    direct = client(cluster.workers[0].base_url).chat.completions.create(model="tiny", messages=msgs, max_tokens=8,
                                                                       **GREEDY)
    answer = direct.choices[0].message.content
    assert first.choices[0].message.content == answer and text == answer
    assert first.choices[0].finish_reason == "length" and [f for f in finishes if f] == ["length"]
    assert first.usage.completion_tokens == usage.completion_tokens == 8
    # cache_aware sent the repeat to the worker that holds the prompt: all of it but the last
    # token (whole pages) is served from that worker's tree.
    page = server_info(cluster.workers[0])["model_info"]["page_size"]
    assert usage.prompt_tokens == first.usage.prompt_tokens > 40
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // page * page
    # A chat request without a model: smg refuses it (OpenAI's schema requires one);
    # sglang-router names it "unknown", which a worker accepts.
    r = httpx.post(cluster.router.base_url + "/v1/chat/completions", timeout=60,
                   json={"messages": msgs, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    if cluster.router.router == "smg":
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    else:
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == answer, r.text


def test_completions_through_router_match_the_worker(cluster: Cluster, routed: openai.OpenAI) -> None:
    prompt = SYSTEM + "\nQ: Where is Oslo?\nA:"
    direct = client(cluster.workers[1].base_url).completions.create(model="tiny", prompt=prompt, max_tokens=8, **GREEDY)
    plain = routed.completions.create(model="tiny", prompt=prompt, max_tokens=8, **GREEDY)
    streamed = "".join(c.choices[0].text for c in routed.completions.create(
        model="tiny", prompt=prompt, max_tokens=8, stream=True, **GREEDY) if c.choices)
    assert plain.choices[0].text == streamed == direct.choices[0].text
    assert plain.usage.completion_tokens == 8 and plain.usage.prompt_tokens == direct.usage.prompt_tokens


def test_generate_through_router_matches_the_worker(cluster: Cluster) -> None:
    router, worker = cluster.router.base_url, cluster.workers[0].base_url
    body = {"text": SYSTEM + " Name three rivers.", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    direct = httpx.post(worker + "/generate", json=body, timeout=60).json()
    plain = httpx.post(router + "/generate", json=body, timeout=60)
    assert plain.status_code == 200, plain.text
    assert plain.json()["output_ids"] == direct["output_ids"] and plain.json()["text"] == direct["text"]
    with httpx.stream("POST", router + "/generate", json=body | {"stream": True}, timeout=60) as s:
        assert s.status_code == 200
        events = sse_events(list(s.iter_lines()))
    assert events[-1]["output_ids"] == direct["output_ids"]  # each event: the output so far
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    # The router forwards SGLang's sampling_seed (and drops radixserve's own name, seed): a
    # sampled answer through it is the one the worker gives for that seed.
    sampled = {"max_new_tokens": 8, "temperature": 1.0}
    seeded = httpx.post(worker + "/generate", json=body | {"sampling_params": sampled | {"seed": 1234}},
                        timeout=60).json()
    r = httpx.post(router + "/generate", json=body | {"sampling_params": sampled | {"sampling_seed": 1234}},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == seeded["output_ids"]


# ---------------------------------------------------------------- SGLang fields, errors


def test_unsupported_sglang_field_is_a_400_naming_it_and_workers_keep_serving(
        cluster: Cluster, routed: openai.OpenAI) -> None:
    msgs = chat_messages("Hi")
    for _ in range(12):  # more than the circuit breaker's default threshold (10)
        with pytest.raises(openai.BadRequestError) as info:
            routed.chat.completions.create(model="tiny", messages=msgs, max_tokens=2,
                                           extra_body={"return_hidden_states": True})
        error = info.value.response.json()["error"]
        assert info.value.status_code == 400 and error["param"] == "return_hidden_states", error
        assert "'return_hidden_states' asks for hidden states" in error["message"]
    with pytest.raises(openai.BadRequestError) as info:
        routed.completions.create(model="tiny", prompt="Hi", max_tokens=2, extra_body={"lora_path": "adapter-1"})
    assert info.value.response.json()["error"]["param"] == "lora_path"
    r = httpx.post(cluster.router.base_url + "/generate",
                   json={"text": "Hi", "session_params": {"id": "conversation-1"}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_params", r.text
    # The same fields at their defaults (as the router always sends them) are fine.
    ok = routed.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, extra_body={
        "return_hidden_states": False, "lora_path": None, "session_params": None, "ignore_eos": True})
    assert ok.usage.completion_tokens == 2
    assert all(w["is_healthy"] for w in cluster.router.workers())


def test_radixserve_chat_extensions_pass_through_smg(cluster: Cluster) -> None:
    """smg forwards the chat route's fields it does not know (``cache_salt``,
    ``return_cache_report``); sglang-router rebuilds the body from SGLang's schema and drops
    them (they pass on /v1/completions and /generate there)."""
    flush(cluster)
    salt = uuid.uuid4().hex

    def chat(salt: str) -> dict:
        body = {"model": "tiny", "messages": chat_messages("Which salt?"), "max_tokens": 2, "temperature": 0,
                "cache_salt": salt, "return_cache_report": True}
        r = httpx.post(cluster.router.base_url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    first, again, other = chat(salt), chat(salt), chat(salt + "-other")
    assert again["prompt_tokens_details"]["cached_tokens"] > 40  # the same worker, the same namespace
    if cluster.router.router == "smg":
        assert other["prompt_tokens_details"]["cached_tokens"] == 0  # another namespace
        assert first["cache_report"]["cached_tokens"] == 0 and again["cache_report"]["cached_tokens"] > 40
    else:
        assert other["prompt_tokens_details"]["cached_tokens"] == again["prompt_tokens_details"]["cached_tokens"]
        assert "cache_report" not in first


def test_client_disconnect_through_router_frees_the_worker_pages(cluster: Cluster) -> None:
    router = cluster.router.base_url
    aborted = [stats(w)["requests_aborted"] for w in cluster.workers]
    # Long enough to outlive smg's load poll (1 s) on a busy machine: 800 tokens did not always.
    body = {"model": "tiny", "prompt": "A very long story begins", "max_tokens": 2000, "stream": True,
            "ignore_eos": True}
    prompt_tokens = httpx.post(router + "/v1/completions", json=body | {"stream": False, "max_tokens": 1},
                               timeout=60).json()["usage"]["prompt_tokens"]
    with httpx.stream("POST", router + "/v1/completions", json=body, timeout=30) as s:
        lines = s.iter_lines()
        for _ in range(3):
            next(lines)
        loads = [httpx.get(w.base_url + "/get_load", timeout=10).json()[0] for w in cluster.workers]
        busy = [i for i, load in enumerate(loads) if load["num_reqs"]]
        assert len(busy) == 1, loads  # the request runs on one worker, counted with its tokens
        # Its prompt and at least the first streamed token.
        assert loads[busy[0]]["num_tokens"] > prompt_tokens and loads[busy[0]]["num_waiting_reqs"] == 0
        url = cluster.workers[busy[0]].base_url
        loads = cluster.router.wait_loads(lambda loads: loads.get(url, 0) > prompt_tokens)
        assert loads[url] > prompt_tokens, loads
    # The router closed its connection to the worker, which aborted the request.
    worker = cluster.workers[busy[0]]
    assert_eventually(lambda: stats(worker)["running"] == 0, 20, "the abandoned request stops")
    assert stats(worker)["requests_aborted"] == aborted[busy[0]] + 1
    info = server_info(worker)
    assert info["memory"]["ok"] and info["memory"]["request_pages"] == 0, info["memory"]
    assert httpx.get(worker.base_url + "/get_load", timeout=10).json()[0]["num_tokens"] == 0


# ---------------------------------------------------------------- routing quality (slow)


@pytest.mark.slow
def test_cache_aware_hit_rate_across_workers_matches_one_worker(cluster: Cluster) -> None:
    """Groups of requests, each group sharing a long system prompt: with cache_aware routing
    the two workers together serve as large a share of the prompt tokens from their caches
    as one worker that sees every request (within 5 points), while each worker takes groups.

    Each group's first request is held in flight until all groups have one (streams opened one
    after another, each read to its first event): the router sends a prefix it has not seen to
    its least loaded worker, so the groups spread over the workers.  The group's next requests
    follow one at a time, and the router sends them where their prefix went."""
    groups = [f"You are agent number {g}, expert in the history of city {g}. " * 8 for g in range(6)]

    def body(g: int, q: int, **extra: object) -> dict:
        return {"model": "tiny", "messages": [{"role": "system", "content": groups[g]},
                                              {"role": "user", "content": f"Question {q} about it?"}],
                "temperature": 0, "ignore_eos": True, "max_tokens": 2} | extra

    def hit_rate(base_url: str, workers: list[ServerProcess]) -> tuple[float, list[int]]:
        before = [stats(w) for w in workers]
        with contextlib.ExitStack() as held:
            firsts = []
            for g in range(len(groups)):
                s = held.enter_context(httpx.stream("POST", base_url + "/v1/chat/completions", timeout=120,
                                                    json=body(g, 0, stream=True, max_tokens=256)))
                assert s.status_code == 200
                lines = s.iter_lines()
                next(lines)
                firsts.append(lines)
            for lines in firsts:
                assert [ln for ln in lines if ln][-1] == "data: [DONE]"
        for q in range(1, 6):
            for g in range(len(groups)):
                r = httpx.post(base_url + "/v1/chat/completions", json=body(g, q), timeout=60)
                assert r.status_code == 200, r.text
        after = [stats(w) for w in workers]
        delta = {k: [a[k] - b[k] for a, b in zip(after, before, strict=True)]
                 for k in ("prompt_tokens", "cached_tokens", "requests_finished")}
        return sum(delta["cached_tokens"]) / sum(delta["prompt_tokens"]), delta["requests_finished"]

    flush(cluster)
    single, _ = hit_rate(cluster.workers[0].base_url, cluster.workers[:1])
    flush(cluster)
    routed_rate, served = hit_rate(cluster.router.base_url, cluster.workers)
    assert sum(served) == 6 * len(groups) and min(served) > 0, served
    assert single > 0.6
    assert abs(routed_rate - single) <= 0.05, (routed_rate, single)


# ---------------------------------------------------------------- a worker dies (last: it kills one)


def test_router_answers_from_the_other_worker_when_one_is_killed(cluster: Cluster, routed: openai.OpenAI) -> None:
    router = cluster.router.base_url
    body = {"text": SYSTEM + " Where next?", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    received = [stats(w)["requests_received"] for w in cluster.workers]
    answers = [httpx.post(router + "/generate", json=body, timeout=60).json()["output_ids"] for _ in range(3)]
    moved = [stats(w)["requests_received"] - n for w, n in zip(cluster.workers, received, strict=True)]
    assert sorted(moved) == [0, 3] and answers[0] == answers[1] == answers[2]  # one worker holds the prefix
    victim = moved.index(3)
    survivor = cluster.workers[1 - victim]
    children = cluster.workers[victim].children()
    os.kill(cluster.workers[victim].proc.pid, signal.SIGKILL)  # a crash: no goodbye to the router
    cluster.killed.add(victim)
    before = stats(survivor)["requests_received"]
    for _ in range(5):  # the prefix's worker is gone: the router retries on the other one
        r = httpx.post(router + "/generate", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["output_ids"] == answers[0], r.text
    assert stats(survivor)["requests_received"] == before + 5
    out = routed.chat.completions.create(model="tiny", messages=chat_messages("Still there?"), max_tokens=2,
                                         **GREEDY)
    assert out.usage.completion_tokens == 2
    dead = cluster.workers[victim].base_url
    assert_eventually(lambda: not any(w["is_healthy"] for w in cluster.router.workers() if w["url"] == dead), 20,
                      "the router marks the killed worker unhealthy")
    assert_eventually(lambda: not any(map(_alive, children)), 20, "the killed worker's scheduler and detokenizer exit")


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
