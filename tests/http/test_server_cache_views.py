"""The cache views over HTTP (a real server, the tiny chat model): ``GET /cache/tree`` on three
system prompts with different traffic, ``GET /cache/misses`` on a chat whose history is
rendered differently on the next turn, ``return_cache_report``, the metric, and
``radixserve cache --url``."""

from __future__ import annotations

import subprocess
import sys

import httpx
from helpers.server import memory_checked_after_each_test, openai_client, tiny_chat_server

server = tiny_chat_server("--max-total-tokens", "20000", "--context-length", "1024")
memory_invariant = memory_checked_after_each_test("server")

SYSTEMS = {
    "A": "Alpha desk. You answer questions about trains: timetables, platforms, fares and delays. " * 3,
    "B": "Bravo desk. You answer questions about ferries: crossings, cabins, tickets and weather. " * 3,
    "C": "Charlie desk. You answer questions about planes: gates, luggage, seats and connections. " * 3,
}
REASONING = "<think>" + "The user asked about the 9:15 train; I should check the platform list. " * 3 + "</think>"


def common_len(seqs: list[list[int]]) -> int:
    n = 0
    while all(len(s) > n and s[n] == seqs[0][n] for s in seqs):
        n += 1
    return n


def render(tokenizer, msgs: list[dict[str, str]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=generation_prompt, tokenize=False)


def generate(server, text: str, salt: str, report: bool = False) -> dict:
    r = httpx.post(server.base_url + "/generate", timeout=60, json={
        "text": text, "extra_key": salt, "return_cache_report": report,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]


def test_cache_tree_orders_three_system_prompts_by_traffic(server, tiny_chat_model) -> None:
    from radixserve.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_chat_model)
    assert httpx.post(server.base_url + "/flush_cache").status_code == 200
    client = openai_client(server)
    prompts: dict[str, list[list[int]]] = {}
    for name, times in (("A", 3), ("B", 2), ("C", 1)):
        for i in range(times):
            msgs = [{"role": "system", "content": SYSTEMS[name]}, {"role": "user", "content": f"{i + 1} question?"}]
            client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, temperature=0)
            text = render(tokenizer, msgs, True)
            prompts.setdefault(name, []).append(tokenizer.encode(text, add_special_tokens=False))
    head = common_len([p for ps in prompts.values() for p in ps])  # "<|im_start|>system\n"
    r = httpx.get(server.base_url + "/cache/tree", params={"limit": 5})
    assert r.status_code == 200
    top = r.json()["prefixes"]
    expect_a, expect_b = common_len(prompts["A"]) - head, common_len(prompts["B"]) - head
    assert [(p["tokens"], p["hits"]) for p in top[:2]] == [(expect_a, 2), (expect_b, 1)]
    assert top[0]["head"].startswith("Alpha desk.") and top[1]["head"].startswith("Bravo desk.")
    assert top[0]["start"] == head and top[0]["children"] == 3 and top[0]["tier"] == "device"
    assert top[2]["tokens"] == head and top[2]["hits"] == 5  # the template's opening, shared by all
    by_held = httpx.get(server.base_url + "/cache/tree", params={"sort": "tokens", "limit": 1}).json()["prefixes"]
    assert by_held[0]["tokens"] == head and by_held[0]["children"] == 3
    assert httpx.get(server.base_url + "/cache/tree", params={"depth": 1}).json()["nodes"] == 1
    bad = httpx.get(server.base_url + "/cache/tree", params={"sort": "size"})
    assert bad.status_code == 400 and "sort" in bad.json()["error"]["message"]
    # The OpenAI routes carry the report in usage (an extension), streaming or not.
    msgs = [{"role": "system", "content": SYSTEMS["B"]}, {"role": "user", "content": "9 question?"}]
    out = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, temperature=0,
                                         extra_body={"return_cache_report": True})
    report = out.usage.model_extra["cache_report"]
    assert report["cached_tokens"] == out.usage.prompt_tokens_details.cached_tokens == report["position"]
    assert report["context"].endswith("user\n") and report["cached_next"].startswith(("1", "2"))
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"return_cache_report": True})
    usage = [c.usage for c in stream if c.usage is not None][0]
    assert usage.model_extra["cache_report"]["cached_tokens"] == usage.prompt_tokens_details.cached_tokens
    done = client.completions.create(model="tiny", prompt="Alpha desk.", max_tokens=1, extra_body={"return_cache_report": True})
    assert "cache_report" in done.usage.model_extra


def test_near_misses_name_a_rerendered_turn_and_not_a_stable_one(server, tiny_chat_model) -> None:
    from radixserve.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_chat_model)
    system = {"role": "system", "content": SYSTEMS["A"]}
    user1 = {"role": "user", "content": "Which platform for the 9:15?"}
    answer = "Platform 4, on time."
    user2 = {"role": "user", "content": "And the 10:15?"}
    before = httpx.get(server.base_url + "/cache/misses").json()["total"]
    for salt, kept in (("stable", REASONING + answer), ("stripped", answer)):
        turn1 = [system, user1, {"role": "assistant", "content": REASONING + answer}]
        generate(server, render(tokenizer, turn1, False), salt)
        turn2 = [system, user1, {"role": "assistant", "content": kept}, user2]
        meta = generate(server, render(tokenizer, turn2, True), salt, report=True)
        report = meta["cache_report"]
        if salt == "stable":
            assert not report.get("near_miss") and meta["cached_tokens"] > 100
            assert httpx.get(server.base_url + "/cache/misses").json()["total"] == before
    misses = httpx.get(server.base_url + "/cache/misses").json()
    assert misses["total"] == before + 1
    latest = misses["near_misses"][0]
    assert latest["cached_next"].startswith("<think>") and latest["request_next"].startswith("Platform 4")
    assert latest["context"].endswith("assistant\n") and latest["salted"]
    assert report["near_miss"] and report["position"] == latest["position"] == meta["cached_tokens"]
    assert report["cached_next"] == latest["cached_next"]
    metrics = httpx.get(server.base_url + "/metrics").text
    assert f"radixserve:cache_near_misses_total {float(before + 1)}" in metrics

    out = subprocess.run([sys.executable, "-m", "radixserve.cli", "cache", "--url", server.base_url, "--limit", "3"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "cached prefixes" in out.stdout and "near-misses: " in out.stdout
    assert "'<think>The user asked" in out.stdout and "'Platform 4, on time." in out.stdout
    bad = subprocess.run([sys.executable, "-m", "radixserve.cli", "cache", "--url", "http://127.0.0.1:9"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "cannot reach" in bad.stderr
