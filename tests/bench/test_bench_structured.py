"""Smoke test of bench/structured.py (JSON-schema constrained decoding vs unconstrained).

No timing assertions: only the shape of the report, the token and step accounting, and the
validity of the constrained outputs are checked.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.structured_workload import TICKET_SCHEMA, check_outputs, ticket_texts  # noqa: E402


def test_tickets_are_distinct_deterministic_and_the_schema_is_valid() -> None:
    import jsonschema

    tickets = ticket_texts(32, seed=0)
    assert len(set(tickets)) == 32
    assert ticket_texts(32, seed=0) == tickets and ticket_texts(32, seed=1) != tickets
    assert all("Subject: " in t and "@" in t for t in tickets)
    jsonschema.Draft202012Validator.check_schema(TICKET_SCHEMA)
    props = TICKET_SCHEMA["properties"]
    assert props["order"]["properties"]["items"]["maxItems"] == 3
    assert set(TICKET_SCHEMA["required"]) == set(props)


def test_check_outputs_counts_valid_outputs_and_finish_reasons() -> None:
    good = {"customer": {"name": "A", "email": "a@example.com", "plan": "pro"}, "category": "billing",
            "priority": "low", "order": {"order_id": "A-1", "items": [{"sku": "X", "quantity": 2}]},
            "sentiment": 0, "summary": "double charge"}
    bad_enum = {**good, "priority": "whenever"}

    def result(text: str, reason: str) -> dict:
        return {"text": text, "meta_info": {"finish_reason": {"type": reason, "matched": None}}}

    got = check_outputs(
        [result(json.dumps(good), "stop"), result(json.dumps(bad_enum), "stop"),
         result(json.dumps(good)[:40], "length")],
        TICKET_SCHEMA,
    )
    assert (got["finished_stop"], got["hit_max_tokens"], got["valid"]) == (2, 1, 1)
    assert got["valid_share_of_stop"] == 0.5
    assert got["invalid_stop_examples"] == [json.dumps(bad_enum)]


@pytest.mark.slow
def test_tiny_benchmark_writes_sane_json(tmp_path, tiny_chat_model) -> None:
    from bench.structured import MODES, main

    out = tmp_path / "structured.json"
    n, max_new = 2, 160
    returned = main(["--model", tiny_chat_model, "--requests", str(n), "--max-new-tokens", str(max_new),
                     "--repeats", "2", "--compile-repeats", "2", "--no-progress", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["benchmark"] == returned["benchmark"] == "structured_generation"
    assert {"platform", "cpu_count", "torch"} <= set(report["machine"])
    assert report["workload"]["requests"] == n and report["workload"]["schema"] == TICKET_SCHEMA

    compile_ms = report["compile_ms"]
    assert all(len(compile_ms[f"{k}_ms_all"]) == 2 for k in ("first", "cold", "cached"))
    # A cache hit, not a recompile.
    assert 0 < compile_ms["cached_ms"] < min(compile_ms["cold_ms"], compile_ms["first_ms"])

    rows = {r["mode"]: r for r in report["results"]}
    assert list(rows) == list(MODES) and all(r["dtype"] == "float32" for r in rows.values())
    for r in rows.values():
        assert r["requests"] == n and r["memory_invariant_ok"]
        assert len(r["wall_s_all"]) == 2 and r["wall_s"] == pytest.approx(sum(r["wall_s_all"]) / 2)
        assert r["wall_s"] > 0 and r["output_tok_per_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
        assert sum(r["output_lens"]) == r["output_tokens"] and max(r["output_lens"]) <= max_new
        assert r["forward_ms_per_step"] > 0 and isinstance(r["outputs_same_across_repeats"], bool)
        assert r["forward_steps"] >= r["decode_steps"] >= 1
        assert r["finished_stop"] + r["hit_max_tokens"] == n
        # Output tokens are the sampled ones plus the grammar-forced ones.
        assert r["output_tokens"] == r["sampled_tokens"] + r["jump_forward_tokens"]
    plain, constrained, jump = (rows[m] for m in MODES)
    assert plain["ratio_vs_unconstrained"] == 1.0
    assert plain["jump_forward_tokens"] == constrained["jump_forward_tokens"] == 0
    assert plain["mask_ms_per_step"] == 0.0
    for r in (constrained, jump):
        assert r["finished_stop"] >= 1 and r["valid_share_of_stop"] == 1.0
        assert r["valid"] == r["finished_stop"]
        assert r["mask_ms_per_step"] > 0 and r["stats"]["grammars_compiled"] == 1
        assert r["ratio_vs_unconstrained"] > 0
    assert jump["jump_forward_tokens"] > 0
    assert jump["forward_steps"] <= constrained["forward_steps"]
    assert jump["sampled_tokens"] < constrained["sampled_tokens"]
    assert 0.0 <= jump["same_text_as_json_schema"] <= 1.0

    assert len(report["targets"]) == 4 and all(t["ok"] in (True, False) for t in report["targets"])
