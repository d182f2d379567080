"""KV tiers over HTTP: a real server with a small pool, a host tier and a disk tier; the same
system prompt is served from the host tier after the pool forgot it, and from disk by a server
started again on the same folder (the first server's writes landed before it stopped)."""

from __future__ import annotations

from pathlib import Path

import httpx
from helpers.server import check_memory_idle, openai_client, serving

SYSTEM = "You are a careful librarian. Answer with the title and the shelf of each book. " * 12


def chat(client, question: str):
    return client.chat.completions.create(
        model="tiny", max_tokens=4, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])


def generate(server, text: str) -> dict:
    r = httpx.post(server.base_url + "/generate", timeout=60,
                   json={"text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]


def metric(server, name: str) -> str:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    return "\n".join(line for line in text.splitlines() if line.startswith(name))


def test_host_and_disk_tiers_over_http(tiny_chat_model: str, tmp_path: Path) -> None:
    flags = ("--max-total-tokens", "400", "--context-length", "512", "--host-cache-size", "2000",
             "--disk-cache-dir", str(tmp_path))
    with serving(tiny_chat_model, *flags) as server:
        client = openai_client(server)
        first = chat(client, "Where is Moby Dick?")
        assert first.usage.prompt_tokens > 200
        for i in range(6):  # unrelated prompts push the system prompt off the device
            generate(server, f"{i} " + "Unrelated words about the weather and the sea. " * 25)
        again = chat(client, "Where is Ulysses?")
        assert again.usage.prompt_tokens_details.cached_tokens > 100
        stats = httpx.get(server.base_url + "/server_info", timeout=30).json()["stats"]
        assert stats["promoted_tokens"] >= 100 and stats["cached_tokens_by_tier"]["host"] >= 100
        assert 'radixserve:cached_tokens_by_tier_total{tier="host"}' in metric(server, "radixserve:cached_tokens_by_tier")
        meta = generate(server, SYSTEM + " The end.")
        assert set(meta["cached_tokens_details"]) == {"device", "host", "disk"}
        check_memory_idle(server)
    assert list(tmp_path.glob("*/*.kv"))

    with serving(tiny_chat_model, *flags) as server:  # a restart on the same folder
        meta = generate(server, SYSTEM + " The end.")
        assert meta["cached_tokens_details"]["disk"] >= 128
        assert meta["cached_tokens"] == sum(meta["cached_tokens_details"].values())
        assert "radixserve:kv_disk_loaded_tokens" in metric(server, "radixserve:kv_disk_loaded_tokens")
        check_memory_idle(server)


def test_settings_that_cannot_work_are_refused(tiny_chat_model: str) -> None:
    from radixserve.config import ServerArgs

    for bad, message in (({"preemption_mode": "later"}, "preemption_mode"),
                         ({"host_cache_size": -1}, "host_cache_size"),
                         ({"disable_radix_cache": True, "host_cache_size": 100}, "need it on")):
        try:
            ServerArgs.from_kwargs(**bad)
        except ValueError as e:
            assert message in str(e)
        else:
            raise AssertionError(f"{bad} was accepted")
