"""Smoke test of bench/agent.py (one agent loop at batch 1, float32, int8 and GGUF-block weights, n-gram
speculative decoding or not): the report's shape and the arithmetic between its numbers; no
timing assertion."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import agent  # noqa: E402


# The agent family's smoke run in the default run is the HTTP loop below; the weight formats
# and n-gram drafts it compares are covered by tests/kernels/ and tests/engine/.
@pytest.mark.slow
def test_quick_run_reports_every_weight_format_and_mode(tmp_path, default_model_path) -> None:
    out = tmp_path / "agent.json"
    report = agent.main(["--quick", "--quantizations", "none,int8,gguf", "--out", str(out)])
    assert json.loads(out.read_text())["results"] == json.loads(json.dumps(report["results"]))
    rows = {(r["quantization"], r["mode"], r["speculative"]): r for r in report["results"]}
    assert set(rows) == {(q, m, s) for q in ("none", "int8", "gguf") for m in ("greedy", "sampled") for s in ("none", "ngram")}
    for r in rows.values():
        assert len(r["ttft_ms"]) == 2 and all(len(ids) == 8 for ids in r["output_ids"])
        # turn 2 resends turn 1's conversation: the system prompt at least comes from the cache
        assert r["cached_tokens"][1] >= 100 and r["prompt_tokens"][1] > r["prompt_tokens"][0]
        bandwidth = report["memory_bandwidth_gbs"] * 1e9
        assert abs(r["floor_ms_per_token"] - 1e3 * r["weight_bytes_per_step"] / bandwidth) < 1e-6
        if r["speculative"] == "ngram":  # every verify step yields at least its one token
            assert r["spec_accept_length"] >= 1.0
        else:
            assert r["spec_accept_length"] is None and r["spec_draft_tokens"] == 0
    # int8 weights: a byte each, and a float32 scale and offset per 32 (5/16 of float32's bytes)
    ratio = rows[("int8", "greedy", "none")]["weight_bytes_per_step"] / rows[("none", "greedy", "none")]["weight_bytes_per_step"]
    assert abs(ratio - 5 / 16) < 0.005
    # the GGUF's blocks (Q4_1 layers: 24 bytes a block of 32 as kept here; the Q8_0 table)
    ratio = rows[("gguf", "greedy", "none")]["weight_bytes_per_step"] / rows[("none", "greedy", "none")]["weight_bytes_per_step"]
    assert 0.18 < ratio < 0.23
    assert rows[("gguf", "greedy", "none")]["identical_vs_none"] == [1.0, 1.0]  # float32's own weights
    assert rows[("none", "greedy", "none")]["identical_vs_none"] is None
    assert len(rows[("int8", "greedy", "none")]["identical_vs_none"]) == 2
    # Speculative decoding keeps the output: greedy, and sampled with the loop's seed.
    for mode in ("greedy", "sampled"):
        assert rows[("none", mode, "ngram")]["identical_vs_none"] == [1.0, 1.0]
        assert rows[("int8", mode, "ngram")]["output_ids"] == rows[("int8", mode, "none")]["output_ids"]


def test_http_loop_reports_each_server(tmp_path) -> None:
    """bench/agent_http.py against a real `radixserve serve` (llama-server is not installed here)."""
    from bench import agent_http

    out = tmp_path / "agent_http.json"
    report = agent_http.main(["--quick", "--servers", "float32-ngram", "--out", str(out)])
    (row,) = report["results"]
    assert json.loads(out.read_text())["results"] == json.loads(json.dumps(report["results"]))
    assert row["server"] == "float32-ngram" and row["completion_tokens"] == [8, 8]
    # the second turn resends the first: a longer prompt
    assert row["prompt_tokens"][1] > row["prompt_tokens"][0] > 100
    assert len(row["ttft_ms"]) == 2 and row["decode_ms_per_token"] > 0


def test_edit_workload_turns_carry_code_to_echo(default_model_path) -> None:
    """--workload edit: each turn's tool result is a standard-library function's source, and the
    user asks for it back renamed (copy-heavy turns for n-gram drafts)."""
    import inspect
    import textwrap

    from radixserve.tokenizer import load_tokenizer

    args = agent.parse_args(["--workload", "edit", "--turns", "3", "--system-len", "300"])
    system, users = agent.conversation(load_tokenizer(default_model_path), args)
    assert len(users) == 3 and "Tools:" in system
    assert inspect.getsource(textwrap.dedent) in users[0] and "`dedent_v2`" in users[0]
    assert len({u.splitlines()[0] for u in users}) == 3  # a different function each turn


def test_json_workload_turns_carry_a_record_to_echo(default_model_path) -> None:
    """--workload json: each turn's tool result is a JSON record to return with one field
    changed (JSON edits for n-gram drafts); the records differ by turn and follow the seed."""
    import json

    from radixserve.tokenizer import load_tokenizer

    args = agent.parse_args(["--workload", "json", "--turns", "3", "--system-len", "300"])
    tokenizer = load_tokenizer(default_model_path)
    _, users = agent.conversation(tokenizer, args)
    records = [json.loads(u.split("```json\n", 1)[1].split("\n```", 1)[0]) for u in users]
    assert all(r["status"] == "open" and '"status" set to "in_progress"' in u for r, u in zip(records, users, strict=True))
    assert len({r["id"] for r in records}) == 3
    assert agent.conversation(tokenizer, args)[1] == users  # the same seed, the same turns


# The agent family's default-run smoke run is test_http_loop_reports_each_server; a stored
# conversation surviving a flood is served in the default run by tests/http/test_responses_api.py.
@pytest.mark.slow
def test_flood_mode_keeps_the_stored_conversation_cached(tmp_path) -> None:
    """bench/agent_http.py --flood --quick against real servers: the Responses loop (stored,
    pinned conversation) finds every earlier turn in the cache after a flood that evicts the
    chat loop's resent, unpinned conversation."""
    from bench import agent_http

    out = tmp_path / "agent_http_flood.json"
    report = agent_http.main(["--flood", "--quick", "--servers", "float32", "--out", str(out)])
    assert json.loads(out.read_text())["results"] == json.loads(json.dumps(report["results"]))
    assert report["params"]["flood_prompts"] * report["params"]["flood_len"] > report["params"]["pool_tokens"]
    rows = {r["api"]: r for r in report["results"]}
    assert set(rows) == {"responses", "chat"} and all(r["server"] == "float32" for r in rows.values())
    responses, chat = rows["responses"], rows["chat"]
    for r in rows.values():
        assert len(r["prompt_tokens"]) == len(r["cached_tokens"]) == len(r["ttft_ms"]) == 2
        assert r["cached_fraction"] == [c / p for c, p in zip(r["cached_tokens"], r["prompt_tokens"], strict=True)]
        assert r["flood_s"] > 0 and 1 <= r["completion_tokens"][0] <= 8
    # Both loops ask the same greedy conversation: the same first prompt; the second holds the
    # same text, which the Responses turn starts with the answer's generated token ids and chat
    # re-tokenizes (the two can split the answer's text differently).
    assert responses["prompt_tokens"][0] == chat["prompt_tokens"][0] > 100
    assert abs(responses["prompt_tokens"][1] - chat["prompt_tokens"][1]) <= responses["completion_tokens"][0]
    assert responses["prompt_tokens"][1] > responses["prompt_tokens"][0]
    # The stored conversation is pinned, its answer included: turn 2 reads turn 1's whole prompt
    # and its answer but the last token (never an input) from the cache.
    assert responses["cached_tokens"][1] >= responses["prompt_tokens"][0] + responses["completion_tokens"][0] - 1
    # The flood evicted the chat loop's conversation.
    assert chat["cached_fraction"][1] < responses["cached_fraction"][1]
    assert chat["cached_tokens"][1] < chat["prompt_tokens"][0] // 2
