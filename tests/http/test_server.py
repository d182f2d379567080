"""End to end over HTTP: a real `radixserve serve` process and the official openai client."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from helpers.assertions import expected_cached_len
from helpers.server import (
    memory_checked_after_each_test,
    openai_client,
    server_info,
    tiny_chat_server,
    wait_idle,
)

SYSTEM = "You are a travel agent. Be concise, friendly and precise in every answer. " * 4


server = tiny_chat_server("--max-total-tokens", "20000", "--context-length", "1024",
                          "--max-queued-requests", "200")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_model):
    from radixserve.tokenizer import load_tokenizer

    return load_tokenizer(tiny_chat_model)


memory_invariant = memory_checked_after_each_test("server")


def test_models_and_health(server, client) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/health_generate", timeout=30).status_code == 200


def chat_prompt_ids(tokenizer, msgs: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def test_chat_completion_and_cached_tokens(server, client, tokenizer) -> None:
    assert httpx.post(server.base_url + "/flush_cache").status_code == 200
    page_size = server_info(server)["model_info"]["page_size"]
    kwargs = dict(model="tiny", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is Rome?"}]
    first_ids = chat_prompt_ids(tokenizer, msgs)
    first = client.chat.completions.create(messages=msgs, **kwargs)
    assert first.object == "chat.completion"
    assert first.choices[0].message.role == "assistant"
    assert first.choices[0].finish_reason == "length"
    assert first.usage.prompt_tokens == len(first_ids)
    assert first.usage.completion_tokens == 8
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # the tree was just flushed
    msgs[1]["content"] = "And where is Oslo?"
    second_ids = chat_prompt_ids(tokenizer, msgs)
    second = client.chat.completions.create(messages=msgs, **kwargs)
    assert second.usage.prompt_tokens == len(second_ids)
    # The tree holds the first prompt (and output); the second is served the system part
    # both share, up to the user's words, in whole pages.
    shared = expected_cached_len(second_ids, [first_ids], page_size)
    assert shared > 40
    assert second.usage.prompt_tokens_details.cached_tokens == shared


def test_cache_salt_isolates_tenants(server, client, tokenizer) -> None:
    """Requests share cached prefixes only with requests of the same salt (``cache_salt`` on
    the OpenAI routes, ``extra_key`` on /generate); no salt is a namespace of its own."""
    assert httpx.post(server.base_url + "/flush_cache").status_code == 200
    page_size = server_info(server)["model_info"]["page_size"]
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is Bergen?"}]
    ids = chat_prompt_ids(tokenizer, msgs)
    full = (len(ids) - 1) // page_size * page_size

    def chat(salt: str | None) -> int:
        extra = {"ignore_eos": True} | ({"cache_salt": salt} if salt is not None else {})
        out = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, temperature=0,
                                             extra_body=extra)
        return out.usage.prompt_tokens_details.cached_tokens

    def native(key: str | None) -> int:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}} | ({"extra_key": key} if key else {})
        r = httpx.post(server.base_url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]["cached_tokens"]

    assert chat("tenant-a") == 0
    assert chat("tenant-b") == 0  # the same prompt, another tenant: nothing of a's is visible
    assert chat(None) == 0
    assert native("tenant-c") == 0
    assert chat("tenant-a") == chat("tenant-b") == chat(None) == full
    assert native("tenant-a") == native("tenant-c") == native(None) == full
    prompt = tokenizer.decode(ids)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body={"cache_salt": "tenant-d"})
    assert out.usage.prompt_tokens_details is None or not out.usage.prompt_tokens_details.cached_tokens

    base = {"model": "tiny", "messages": msgs, "max_tokens": 1}
    for bad, param in (({"cache_salt": ""}, "cache_salt"), ({"cache_salt": 7}, "cache_salt"),
                       ({"priority": "high"}, "priority"), ({"priority": 2**40}, "priority")):
        r = httpx.post(server.base_url + "/v1/chat/completions", json=base | bad, timeout=30)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == param
    r = httpx.post(server.base_url + "/generate", json={"text": ["a", "b"], "extra_key": ["x"]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "extra_key"
    r = httpx.post(server.base_url + "/v1/chat/completions", json=base | {"priority": 3}, timeout=60)
    assert r.status_code == 200


def test_cache_pin_and_unpin(server, client) -> None:
    url = server.base_url
    assert httpx.post(url + "/flush_cache").status_code == 200
    msgs = [{"role": "system", "content": SYSTEM}]
    r = httpx.post(url + "/cache/pin", json={"messages": msgs, "ttl": 300}, timeout=60)
    assert r.status_code == 200, r.text
    pin = r.json()
    assert pin["success"] and pin["tokens"] > 40 and 0 < pin["expires_in"] <= 300
    listed = server_info(server)["pins"]
    assert [p["pin_id"] for p in listed["pins"]] == [pin["pin_id"]] and listed["pinned_tokens"] == pin["tokens"]
    page_size = server_info(server)["model_info"]["page_size"]
    assert pin_metrics(server) == (1, pin["tokens"] // page_size)
    # A chat with that system prompt is served the pinned prefix from the tree.
    out = client.chat.completions.create(model="tiny", messages=msgs + [{"role": "user", "content": "Hi"}],
                                         max_tokens=1)
    assert out.usage.prompt_tokens_details.cached_tokens >= pin["tokens"] - 16
    for body, status, param in (({"text": "a", "input_ids": [1, 2]}, 400, "text"), ({}, 400, "text"),
                                ({"text": "hello", "ttl": 0}, 400, "ttl"),
                                ({"text": "hello", "pin_id": "pin-1"}, 400, "pin_id")):
        r = httpx.post(url + "/cache/pin", json=body, timeout=30)
        assert r.status_code == status and r.json()["error"]["param"] == param, (body, r.text)
    r = httpx.post(url + "/cache/unpin", json={"pin_id": pin["pin_id"]}, timeout=30)
    assert r.status_code == 200 and r.json()["unpinned"] == [pin["pin_id"]]
    r = httpx.post(url + "/cache/unpin", json={"pin_id": pin["pin_id"]}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "pin_id"
    # By content: the same messages pinned again, then unpinned by them.
    assert httpx.post(url + "/cache/pin", json={"messages": msgs}, timeout=60).status_code == 200
    r = httpx.post(url + "/cache/unpin", json={"messages": msgs}, timeout=30)
    assert r.status_code == 200 and len(r.json()["unpinned"]) == 1
    assert server_info(server)["pins"]["pins"] == []
    assert pin_metrics(server) == (0, 0)


def pin_metrics(server) -> tuple[float, float]:
    """``radixserve:num_pins`` and ``radixserve:kv_pages_pinned`` from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.base_url + "/metrics").text
    values = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    return values["radixserve:num_pins"], values["radixserve:kv_pages_pinned"]


def test_chat_stream_is_well_formed(client) -> None:
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=12,
        temperature=0, stream=True, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    full = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=12, temperature=0,
    )
    assert text == full.choices[0].message.content


def test_continuous_usage_stats_count_each_choices_tokens_so_far(client) -> None:
    """vLLM's ``continuous_usage_stats``: every chunk carries its choice's usage so far (0 on
    the role chunk, growing with its tokens), the last chunk the whole call's; without it the
    chunks' usage is null.  On both OpenAI routes, two choices."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    chat = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=6, n=2,
        temperature=0, stream=True, stream_options=options, extra_body={"ignore_eos": True}))
    plain = list(client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=6, n=2, temperature=0, stream=True,
        stream_options=options, extra_body={"ignore_eos": True}))
    for chunks in (chat, plain):
        prompt = chunks[-1].usage.prompt_tokens
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * 6
        for index in (0, 1):
            seen = [c.usage for c in chunks[:-1] if c.choices[0].index == index]
            counts = [u.completion_tokens for u in seen]
            assert counts == sorted(counts) and counts[-1] == 6, counts
            assert all(u.prompt_tokens == prompt and u.total_tokens == prompt + u.completion_tokens
                       for u in seen)
        if chunks is chat:
            assert chunks[0].usage.completion_tokens == 0  # the role chunk
    quiet = list(client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=3, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert all(c.usage is None for c in quiet[:-1]) and quiet[-1].usage.completion_tokens == 3


def test_n_choices_seeds_and_stop(client) -> None:
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Count to ten."}], max_tokens=10)
    sampled = dict(n=2, seed=7, temperature=1.0, extra_body={"ignore_eos": True}, **kwargs)
    a = client.chat.completions.create(**sampled)
    b = client.chat.completions.create(**sampled)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert [c.finish_reason for c in a.choices] == ["length", "length"]
    assert a.usage.completion_tokens == 2 * 10
    greedy = client.chat.completions.create(temperature=0, **kwargs).choices[0].message.content
    assert len(greedy) > 4
    stop = greedy[2:5]
    stopped = client.chat.completions.create(temperature=0, stop=[stop], **kwargs)
    assert stopped.choices[0].finish_reason == "stop"
    assert stop not in stopped.choices[0].message.content
    assert greedy.startswith(stopped.choices[0].message.content)


def test_completions_routes(client) -> None:
    out = client.completions.create(model="tiny", prompt=["Hello there", "The sea"], max_tokens=5, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == 10
    echo = client.completions.create(model="tiny", prompt="Hello there", max_tokens=3, temperature=0, echo=True)
    assert echo.choices[0].text.startswith("Hello there")
    ids = client.completions.create(model="tiny", prompt=[1, 2, 3, 4], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 4
    lp = client.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0, logprobs=2)
    assert len(lp.choices[0].logprobs.tokens) == 3
    assert [len(top) for top in lp.choices[0].logprobs.top_logprobs] == [2, 2, 2]
    streamed = client.completions.create(model="tiny", prompt="The sea", max_tokens=5, temperature=0, stream=True)
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    assert text == out.choices[1].text


def test_chat_logprobs_and_logit_bias(client, tokenizer) -> None:
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0,
        logprobs=True, top_logprobs=2,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    biased = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0,
        logit_bias={"1000": 100}, logprobs=True,
    )
    tokens = [c.token for c in biased.choices[0].logprobs.content]
    assert tokens == [tokenizer.decode([1000])] * 3


def test_logit_bias_forces_token(server) -> None:
    r = httpx.post(server.base_url + "/generate", json={
        "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 0,
                                                    "logit_bias": {"1000": 100}}}, timeout=30)
    assert r.json()["output_ids"] == [1000, 1000, 1000]


def test_native_generate(server) -> None:
    r = httpx.post(server.base_url + "/generate", json={
        "text": "Once upon a time", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}, timeout=30)
    body = r.json()
    assert r.status_code == 200 and len(body["output_ids"]) == 6
    assert body["meta_info"]["completion_tokens"] == 6 and body["meta_info"]["finish_reason"]["type"] == "length"
    batch = httpx.post(server.base_url + "/generate", json={
        "input_ids": [[1, 2, 3], [4, 5]], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}},
        timeout=30).json()
    assert [b["meta_info"]["prompt_tokens"] for b in batch] == [3, 2]
    assert [len(b["output_ids"]) for b in batch] == [2, 2]
    with httpx.stream("POST", server.base_url + "/generate", json={
            "text": "Once upon a time", "stream": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0}}, timeout=30) as s:
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last["output_ids"] == body["output_ids"] and last["text"] == body["text"]


def test_flush_cache(server, client) -> None:
    client.completions.create(model="tiny", prompt="warm the cache " * 10, max_tokens=2)
    assert server_info(server)["stats"]["tree_tokens"] > 0
    assert httpx.post(server.base_url + "/flush_cache").status_code == 200
    assert server_info(server)["stats"]["tree_tokens"] == 0


def test_64_concurrent_streams(server) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int, list[str | None]]:
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}"}],
            max_tokens=16, temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True},
        )
        text, usage, finishes = "", 0, []
        async for c in stream:
            if c.choices:
                text += c.choices[0].delta.content or ""
                finishes.append(c.choices[0].finish_reason)
            if c.usage:
                usage = c.usage.completion_tokens
        return text, usage, finishes

    async def main():
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
        return await asyncio.gather(*[one(client, i) for i in range(64)])

    results = asyncio.run(main())
    assert len(results) == 64
    for _text, usage, finishes in results:
        assert sum(f is not None for f in finishes) == 1 and finishes[-1] in ("stop", "length")
        # max_tokens ends the output at 16 tokens exactly; the end-of-sequence token earlier.
        assert usage == 16 if finishes[-1] == "length" else 1 <= usage < 16
    info = wait_idle(server)
    assert info["memory"]["ok"]


def test_client_disconnect_frees_pages(server, client) -> None:
    aborted_before = server_info(server)["stats"]["requests_aborted"]
    with httpx.stream("POST", server.base_url + "/v1/completions", json={
            "model": "tiny", "prompt": "A very long story begins", "max_tokens": 800,
            "stream": True, "ignore_eos": True}, timeout=30) as s:
        lines = s.iter_lines()
        for _ in range(3):
            next(lines)
        busy = server_info(server)
        assert busy["stats"]["running"] == 1
    info = wait_idle(server, timeout=10)
    assert info["memory"]["request_pages"] == 0
    assert info["stats"]["requests_aborted"] == aborted_before + 1
    ok = client.completions.create(model="tiny", prompt="Still there?", max_tokens=2, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 2


def test_metrics_parse_and_move(server, client) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict[str, float]:
        text = httpx.get(server.base_url + "/metrics").text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
                out[key] = s.value
        return out

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0)

    before = scrape()
    out = client.completions.create(model="tiny", prompt="metrics please", max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    after = scrape()
    assert all(k.startswith("radixserve:") for k in after)
    assert moved("radixserve:generation_tokens_total") == 4
    assert moved("radixserve:prompt_tokens_total") == out.usage.prompt_tokens
    assert moved("radixserve:cached_tokens_total") == out.usage.prompt_tokens_details.cached_tokens
    assert moved("radixserve:requests_total{finish_reason=length}") == 1
    assert moved("radixserve:time_to_first_token_seconds_count") == 1
    stats = server_info(server)["stats"]
    assert after["radixserve:kv_pages_total"] == stats["total_pages"]
    assert after["radixserve:num_running_requests"] == 0
