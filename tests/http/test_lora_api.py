"""LoRA adapters over HTTP: a real `radixserve serve` process with adapters, the official
``openai`` and ``anthropic`` clients, and adapters loaded and unloaded while requests run."""

from __future__ import annotations

import concurrent.futures as cf

import anthropic
import httpx
import openai
import pytest
from helpers.api_clients import anthropic_client, server_pins
from helpers.lora_adapters import peft_greedy, write_adapter
from helpers.server import check_memory_idle, openai_client, serving, wait_idle

N = 6
PROMPT = [1, 520, 3400, 92, 18, 7001, 311, 45]


@pytest.fixture(scope="module")
def adapters(tiny_chat_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("http-lora")
    return {
        "a": write_adapter(tiny_chat_model, str(root / "a"), r=8, alpha=16, seed=1),
        "b": write_adapter(tiny_chat_model, str(root / "b"), r=4, alpha=8, seed=2,
                           targets=("q_proj", "v_proj", "down_proj"), use_rslora=True),
    }


@pytest.fixture(scope="module")
def server(tiny_chat_model: str, adapters: dict[str, str]):
    with serving(tiny_chat_model, "--lora-paths", f"a={adapters['a']}",
                 "--max-loras-per-batch", "2", "--max-lora-rank", "8",
                 "--max-total-tokens", "20000", "--context-length", "1024") as srv:
        yield srv


@pytest.fixture(autouse=True)
def memory_invariant(server):
    yield
    check_memory_idle(server)


def _generate(server, **body) -> dict:
    r = httpx.post(server.base_url + "/generate", timeout=60, json={
        "input_ids": PROMPT, "sampling_params": {"max_new_tokens": N, "temperature": 0,
                                                 "ignore_eos": True}, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


def test_models_list_the_adapters_with_their_base(server, adapters) -> None:
    data = openai_client(server).models.list().data
    assert [(m.id, m.parent) for m in data] == [("tiny", None), ("a", "tiny")]
    assert data[1].root == adapters["a"]


def test_adapter_output_equals_peft(server, adapters, tiny_chat_model) -> None:
    """``lora_path`` on /generate, and ``model: NAME`` / ``BASE:NAME`` on the OpenAI routes,
    all run the adapter: transformers + peft's greedy tokens."""
    ref = peft_greedy(tiny_chat_model, adapters["a"], [PROMPT], N)[0]
    base = peft_greedy(tiny_chat_model, None, [PROMPT], N)[0]
    assert ref != base
    assert _generate(server, lora_path="a")["output_ids"] == ref
    assert _generate(server)["output_ids"] == base
    batch = _generate(server, input_ids=[PROMPT, PROMPT], lora_path=[None, "a"])
    assert [b["output_ids"] for b in batch] == [base, ref]
    client = openai_client(server)

    def text(model: str, **extra) -> str:
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0,
                                         extra_body={"ignore_eos": True, **extra}).choices[0].text

    adapted = text("tiny", lora_path="a")
    assert text("a") == text("tiny:a") == adapted != text("tiny")
    chat = client.chat.completions.create(model="a", max_tokens=4,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert chat.choices[0].message.content is not None
    reply = anthropic_client(server).messages.create(
        model="a", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert reply.stop_reason == "max_tokens"
    response = client.responses.create(model="tiny:a", input="Hi", max_output_tokens=4)
    assert response.status == "incomplete"
    # the stored conversation is pinned in the adapter's namespace, and deleting it unpins it
    pins = server_pins(server)
    assert [p.get("lora") for p in pins] == ["a"], pins
    client.responses.delete(response.id)
    assert server_pins(server) == []


def test_loads_report_each_adapters_cache_hits(server) -> None:
    _generate(server, lora_path="a")
    _generate(server, lora_path="a")
    lora = httpx.get(server.base_url + "/v1/loads?include=lora", timeout=30).json()
    counts = lora["loads"][0]["lora"]["adapter_tokens"]["a"]
    assert counts[0] >= 2 * len(PROMPT) and 0 < counts[1] <= counts[0]


def test_unknown_adapters_are_404(server) -> None:
    client = openai_client(server)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", max_tokens=2,
                                       messages=[{"role": "user", "content": "Hi"}])
    assert info.value.response.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tiny:nope", prompt="Hi", max_tokens=2)
    with pytest.raises(anthropic.NotFoundError):
        anthropic_client(server).messages.create(
            model="nope", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    r = _post(server, "/generate", {"text": "Hi", "lora_path": "nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_path"


def test_load_use_and_unload(server, adapters, tiny_chat_model) -> None:
    r = _post(server, "/load_lora_adapter", {"lora_name": "b", "lora_path": adapters["b"]})
    assert r.status_code == 200 and r.json()["loaded_adapters"] == {
        "a": adapters["a"], "b": adapters["b"]}
    assert [m.id for m in openai_client(server).models.list().data] == ["tiny", "a", "b"]
    ref = peft_greedy(tiny_chat_model, adapters["b"], [PROMPT], N)[0]
    assert _generate(server, lora_path="b")["output_ids"] == ref
    taken = _post(server, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": adapters["a"]})
    assert taken.status_code == 400 and taken.json()["error"]["param"] == "lora_name"
    bad = _post(server, "/load_lora_adapter", {"lora_name": "c", "lora_path": "/nonexistent"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "b"}).status_code == 200
    assert _post(server, "/unload_lora_adapter", {"lora_name": "b"}).status_code == 404
    r = _post(server, "/generate", {"text": "Hi", "lora_path": "b"})
    assert r.status_code == 404


def test_unload_waits_for_the_requests_that_use_it(server, adapters) -> None:
    """Unloading under load: refused while requests use the adapter, no request lost; once
    they finish it unloads, and loading it again serves it again."""
    assert _post(server, "/load_lora_adapter",
                 {"lora_name": "b", "lora_path": adapters["b"]}).status_code == 200
    body = {"input_ids": PROMPT, "lora_path": "b",
            "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}
    with cf.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(_post, server, "/generate", body) for _ in range(6)]
        refused = None
        for _ in range(100):
            r = _post(server, "/unload_lora_adapter", {"lora_name": "b"})
            if r.status_code == 400:
                refused = r
                break
            assert r.status_code == 200  # the requests had not arrived yet: load it again
            _post(server, "/load_lora_adapter", {"lora_name": "b", "lora_path": adapters["b"]})
        answers = [f.result() for f in futures]
    assert refused is not None and "in use" in refused.json()["error"]["message"]
    ok = [a for a in answers if a.status_code == 200]
    assert all(a.status_code in (200, 404) for a in answers) and ok
    assert all(len(a.json()["output_ids"]) == 200 for a in ok)
    wait_idle(server)
    assert _post(server, "/unload_lora_adapter", {"lora_name": "b"}).status_code == 200
