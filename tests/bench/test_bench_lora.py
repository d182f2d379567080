"""bench/lora.py in a small run: the report's rows and what does not depend on noise."""

from __future__ import annotations

import json


def test_quick_lora_report(tmp_path, tiny_chat_model) -> None:
    """On the tiny chat model (the default model's tokenizer, so the same prompts): what is
    checked here is the rows and the cache, not the model's output."""
    from bench.lora import main

    out = tmp_path / "lora.json"
    report = main(["--quick", "--model", tiny_chat_model, "--out", str(out)])
    assert json.loads(out.read_text()) == report
    rows = {r["config"]: r for r in report["rows"]}
    assert list(rows) == ["base", "base, LoRA on", "1 adapter", "4 adapters"]
    for row in rows.values():
        assert row["output_tokens"] == 8 * 6 and row["requests"] == 8
        assert row["tokens_per_s"] > 0 and row["one_request_decode_ms_per_token"] > 0
    # The system prompt is computed once per adapter: 8 requests over 4 adapters share it in
    # pairs, over 1 adapter (or the base model) 7 of 8 read it from the cache.
    assert rows["base"]["cache_hit_rate"] == rows["1 adapter"]["cache_hit_rate"] > 0.5
    assert set(rows["4 adapters"]["adapter_cache_hit_rate"]) == {f"adapter-{i}" for i in range(4)}
    assert rows["4 adapters"]["cache_hit_rate"] < rows["1 adapter"]["cache_hit_rate"]
    assert rows["4 adapters"]["lowest_adapter_hit_rate"] > 0
    assert rows["base"]["adapter_cache_hit_rate"] == {} and rows["base"]["adapters"] == 0
