"""bench/kv_quant.py in a small run: the report's shape and what does not depend on noise."""

from __future__ import annotations

import json


def test_kv_quant_report(tmp_path, default_model_path) -> None:
    from bench.kv_quant import main

    out = tmp_path / "kv_quant.json"
    report = main(["--quick", "--dtypes", "float32", "--kv-dtypes", "int8", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    rows = {r["kv_cache_dtype"]: r for r in report["results"]}
    assert set(rows) == {"auto", "int8"}
    # The default model: 30 layers x 3 KV heads x (64 values + a float16 scale) x K and V.
    assert rows["auto"]["bytes_per_token"] == 2 * 30 * 3 * 64 * 4
    assert rows["int8"]["bytes_per_token"] == 2 * 30 * 3 * (64 + 2)
    assert rows["int8"]["tokens_ratio"] >= 3.8
    assert 0.0 <= rows["int8"]["identical"] <= 1.0 and len(rows["int8"]["output_ids"]) == len(report["prompt_tokens"])
    # A 256-token document makes the long prompt the longest.
    assert max(report["prompt_tokens"]) > 256
    assert {t["target"] for t in report["targets"]} == {
        "int8 KV identical greedy tokens, teacher-forced >=", "int8 KV mean |d logprob| <=", "int8 KV pool tokens vs float32 >="}
    # Teacher-forced agreement and the flip margins: one margin (top-1 minus top-2 logprob, so
    # never negative) per prompt whose free-running tokens parted from the reference's.
    got = rows["int8"]
    parted = [i for i, (a, b) in enumerate(zip(rows["auto"]["output_ids"], got["output_ids"], strict=True)) if a != b]
    assert len(got["flip_margins"]) == len(parted) and all(m >= 0 for m in got["flip_margins"])
    assert 0.0 <= got["identical_forced"] <= 1.0
