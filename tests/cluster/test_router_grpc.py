"""radixserve workers as smg's ``grpc://`` workers, with KV events: smg tokenizes, renders the
chat template and detokenizes; the workers take and give token ids (``--grpc-port``) and
publish their radix trees (``--kv-events-config``), which smg's event-driven cache-aware
routing reads.

Through the real smg binary: completions (whole and streamed) and chat answer what a worker's
own HTTP routes answer; smg's index of each worker holds exactly as many blocks as the
worker's tree, after serving and after a flush through smg; a group's repeated prefix is routed
by that index to the worker holding it and served from its cache."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from helpers.assertions import assert_eventually
from helpers.router import ROUTER_TEST_FLAGS, RouterProcess
from helpers.server import ServerProcess, check_memory_idle, free_port, server_info

PAGE = 16
WORKER_ENV = {"OMP_NUM_THREADS": "1"}
SYSTEM = "You are a travel agent. Be concise, friendly and precise in every answer. " * 4


@dataclass
class Worker:
    server: ServerProcess
    grpc_url: str


@pytest.fixture(scope="module")
def cluster(tiny_chat_model: str) -> Iterator[tuple[list[Worker], RouterProcess]]:
    workers = []
    for _ in range(2):
        kv, replay, port = free_port(), free_port(), free_port()
        events = {"publisher": "zmq", "endpoint": f"tcp://*:{kv}", "replay_endpoint": f"tcp://*:{replay}"}
        srv = ServerProcess("--model", tiny_chat_model, "--served-model-name", "tiny", "--page-size", str(PAGE),
                            "--max-total-tokens", "8192", "--context-length", "1024", "--grpc-port", str(port),
                            "--kv-events-config", json.dumps(events), env=WORKER_ENV)
        workers.append(Worker(srv, f"grpc://127.0.0.1:{port}"))
    router = None
    try:
        for w in workers:
            w.server.wait_ready()
        router = RouterProcess([w.grpc_url for w in workers], *ROUTER_TEST_FLAGS["smg"], "--model-path",
                               tiny_chat_model, "--block-size", str(PAGE)).wait_ready(2)
        yield workers, router
    finally:
        if router is not None:
            router.stop()
        codes = [w.server.stop() for w in workers]
    assert codes == [0, 0], [w.server.log() for w in workers]


@pytest.fixture(autouse=True)
def memory_invariant(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "cluster" in request.fixturenames:
        for w in request.getfixturevalue("cluster")[0]:
            check_memory_idle(w.server)


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=60)


def index_agrees(workers: list[Worker], router: RouterProcess) -> bool:
    """smg's event index holds, per worker, as many blocks as the worker's tree."""
    return all(router.metric("smg_kv_index_blocks", worker=w.grpc_url) * PAGE
               == server_info(w.server)["stats"]["tree_tokens"] for w in workers)


def test_completions_and_chat_through_smg_answer_what_a_worker_answers(cluster) -> None:
    workers, router = cluster
    routed = client(router.base_url)
    prompt = SYSTEM + "\nQ: Where is Oslo?\nA:"
    direct = client(workers[0].server.base_url).completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                                                  temperature=0)
    plain = routed.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    streamed = "".join(c.choices[0].text for c in routed.completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True) if c.choices)
    assert plain.choices[0].text == streamed == direct.choices[0].text
    assert plain.usage.prompt_tokens == direct.usage.prompt_tokens and plain.usage.completion_tokens == 8
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a river."}]
    chat = routed.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    own = client(workers[1].server.base_url).chat.completions.create(model="tiny", messages=messages,
                                                                    max_tokens=8, temperature=0)
    # smg renders the same template (same prompt length) and trims what the worker keeps.
    assert chat.usage.prompt_tokens == own.usage.prompt_tokens and chat.usage.completion_tokens == 8
    assert (chat.choices[0].message.content or "").strip() == own.choices[0].message.content.strip()


def test_smg_routes_on_the_workers_kv_events(cluster) -> None:
    """Six groups, each with its system prompt: each group's first request lands somewhere,
    and its repeats follow it there because smg's index (from the workers' KV events, not a
    guess) holds the prefix; the index matches the trees block for block, and a flush through
    smg empties both."""
    workers, router = cluster
    assert httpx.post(router.base_url + "/flush_cache", timeout=30).status_code == 200
    assert_eventually(lambda: index_agrees(workers, router), 20, "smg's index is empty after the flush")
    hits_before = router.metric("smg_cache_aware_policy_branch_total", branch="event_hit")
    groups = [f"You are agent number {g}, an expert in the history of city {g}. " * 6 for g in range(6)]
    routed = client(router.base_url)
    cached, prompt_tokens = 0, 0
    for q in range(4):
        for system in groups:
            out = routed.completions.create(model="tiny", prompt=system + f"\nQuestion {q}?", max_tokens=2,
                                            temperature=0)
            if q:
                cached += out.usage.prompt_tokens_details.cached_tokens
                prompt_tokens += out.usage.prompt_tokens
        assert_eventually(lambda: index_agrees(workers, router), 20, "smg's index follows the trees")
    assert router.metric("smg_cache_aware_policy_branch_total", branch="event_hit") - hits_before >= 6 * 3
    # The repeats found their group's prefix: all of it but the partial page and the question.
    assert cached / prompt_tokens > 0.75, (cached, prompt_tokens)
    assert all(server_info(w.server)["stats"]["requests_finished"] > 0 for w in workers)  # both took groups
