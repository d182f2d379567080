"""The programs in examples/ run against a live server (tiny model, short outputs) and show
what their docstrings promise: later calls read the shared prefix from the radix cache."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import httpx
import pytest
from helpers.server import ServerProcess

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    srv = ServerProcess("--model", tiny_chat_model, "--max-total-tokens", "20000",
                        "--context-length", "2048").wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture
def cold(server) -> str:
    """The server's URL, with an empty radix cache."""
    assert httpx.post(server.base_url + "/flush_cache", timeout=30).status_code == 200
    return server.base_url


def test_every_example_documents_itself() -> None:
    names = sorted(p.stem for p in EXAMPLES.glob("*.py"))
    assert names == ["agent_team", "multi_turn_chat", "offline_batch", "pipeline"]
    for name in names:
        module = load(name)
        assert module.__doc__ and "What it shows" in module.__doc__, name
        flags = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), "--help"],
                               capture_output=True, text=True, timeout=120)
        assert flags.returncode == 0 and "--max-tokens" in flags.stdout, name
        if name != "offline_batch":
            assert "--base-url" in flags.stdout, name


def test_agent_team_shares_the_system_prompt(cold, capsys) -> None:
    records = load("agent_team").main(["--base-url", cold, "--max-tokens", "4", "--rounds", "2"])
    assert len(records) == 8 and [r["round"] for r in records] == [1] * 4 + [2] * 4
    assert records[0]["cached_tokens"] == 0 and records[0]["prompt_tokens"] > 400
    for r in records[1:]:  # the system prompt and tool list (and later the history) are cached
        assert r["cached_tokens"] >= 0.8 * r["prompt_tokens"], r
    assert "cached" in capsys.readouterr().out


def test_multi_turn_chat_reuses_earlier_turns(cold) -> None:
    records = load("multi_turn_chat").main(["--base-url", cold, "--max-tokens", "4", "--turns", "3"])
    assert [r["turn"] for r in records] == [1, 2, 3]
    assert records[0]["cached_tokens"] == 0
    for prev, cur in zip(records, records[1:], strict=False):
        assert cur["prompt_tokens"] > prev["prompt_tokens"]
        assert cur["cached_tokens"] >= 0.8 * prev["prompt_tokens"], (prev, cur)


def test_pipeline_steps_share_the_document(cold, capsys) -> None:
    import jsonschema

    pipeline = load("pipeline")
    records = pipeline.main(["--base-url", cold, "--max-tokens", "4"])
    by_step = {r["step"]: r for r in records}
    assert [r["step"] for r in records] == ["classify", *pipeline.FIELDS, "summary"]
    classify = by_step["classify"]
    assert classify["text"] in pipeline.KINDS and classify["prompt_tokens"] > 200
    # The select computed its prompt once: every choice was served it from the cache, but for
    # the last two tokens (its logprobs start at the prompt's last token, which needs the one before).
    assert len(classify["choices_cached_tokens"]) == len(pipeline.KINDS)
    assert all(c >= classify["prompt_tokens"] - 2 for c in classify["choices_cached_tokens"])
    # Each branch and the summary continue the classify conversation: served it from the cache.
    for name in (*pipeline.FIELDS, "summary"):
        r = by_step[name]
        assert r["prompt_tokens"] > classify["prompt_tokens"], r
        assert r["cached_tokens"] >= classify["prompt_tokens"], r
    for name, (_, schema) in pipeline.FIELDS.items():
        r = by_step[name]
        assert r["schema"] == schema
        jsonschema.validate(json.loads(r["text"]), schema)
        assert r["value"] == json.loads(r["text"])
    assert "cached" in capsys.readouterr().out


def test_offline_batch(tiny_chat_model) -> None:
    results = load("offline_batch").main(["--model", tiny_chat_model, "--max-tokens", "3",
                                          "--max-total-tokens", "8000"])
    assert len(results) == 8
    assert all(r["meta_info"]["completion_tokens"] <= 3 for r in results)
    # The instruction prefix is computed once: (nearly) every other prompt reads it from the cache.
    assert sum(r["meta_info"]["cached_tokens"] > 30 for r in results) >= 6
