"""bench/cache_pressure.py in its quick mode: the report's shape and the counts that do not
depend on timing."""

from __future__ import annotations

import json

import pytest


# The cache family's smoke run in the default run is tests/bench/test_bench_cache_views.py; this
# one starts an Engine per policy and tier (about 15 starts) and runs with -m slow.
@pytest.mark.slow
def test_quick_cache_pressure_report(tmp_path, default_model_path) -> None:
    from bench.cache_pressure import EVICTION_POLICIES, SCHEDULE_POLICIES, TIER_CONFIGS, main

    out = tmp_path / "cache_pressure.json"
    report = main(["--quick", "--dtype", "float32", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    params = report["params"]
    hot = {r["policy"]: r for r in report["results"] if r["scenario"] == "hot-prefix"}
    assert set(hot) == set(EVICTION_POLICIES)
    for r in hot.values():
        assert len(r["agent_cached_tokens"]) == params["rounds"]
        assert 0.0 <= r["agent_hit_rate"] <= 1.0 and r["evicted_tokens"] > 0
    # Requests run one at a time, so the hits are the policies' own: each burst of one-off
    # prompts pushes the system prompt out under lru; slru and lfu keep it, as the warm-up
    # agents reused it.
    assert all(c == 0 for c in hot["lru"]["agent_cached_tokens"])
    for policy in ("slru", "lfu"):
        assert all(c >= params["system_len"] for c in hot[policy]["agent_cached_tokens"]), policy
    grp = {r["policy"]: r for r in report["results"] if r["scenario"] == "groups"}
    assert set(grp) == set(SCHEDULE_POLICIES)
    unique = params["groups"] * params["group_system_len"] + params["groups"] * params["per_group"] * params["question_len"]
    for r in grp.values():
        assert r["unique_tokens"] == unique and r["prefill_computed"] >= unique
    targets = {t["target"]: t for t in report["targets"]}
    assert targets["hot-prefix slru agent hit rate >="]["value"] == hot["slru"]["agent_hit_rate"]
    assert targets["hot-prefix lru agent hit rate <="]["value"] == hot["lru"]["agent_hit_rate"]
    # Tiers: the hits of turns 2+ come from the tier each config has, and only from it (the
    # pool, a quarter of the working set, keeps almost nothing of a conversation between turns).
    tiers = {r["policy"]: r for r in report["results"] if r["scenario"] == "tiers"}
    assert set(tiers) == set(TIER_CONFIGS)
    assert tiers["lru"]["cached_by_tier"]["host"] == tiers["lru"]["cached_by_tier"]["disk"] == 0
    for r in tiers.values():  # every cached token counted once, by the tier it came from
        assert sum(r["cached_by_tier"].values()) == r["cached_tokens"], r["policy"]
    assert tiers["host"]["cached_by_tier"]["host"] > 0 and tiers["host"]["cached_by_tier"]["disk"] == 0
    assert tiers["disk"]["cached_by_tier"]["disk"] > 0 and tiers["disk"]["cached_by_tier"]["host"] == 0
    assert tiers["host"]["hit_rate"] > tiers["lru"]["hit_rate"] and tiers["disk"]["hit_rate"] > tiers["lru"]["hit_rate"]
    # An int8 pool in the same memory holds 3.88x the tokens of the float32 one.
    assert tiers["int8-kv"]["kv_cache_dtype"] == "int8"
    assert tiers["int8-kv"]["pool_tokens"] == tiers["lru"]["pool_tokens"] * 46080 // 11880
    assert tiers["int8-kv"]["cached_by_tier"]["device"] > tiers["lru"]["cached_by_tier"]["device"]
    assert tiers["int8-kv"]["hit_rate"] > tiers["lru"]["hit_rate"]
    # A restart on the folder the cold server wrote serves the whole system prompt from disk.
    restart = {r["policy"]: r for r in report["results"] if r["scenario"] == "restart"}
    assert restart["cold"]["cached_tokens"] == 0
    assert restart["warm"]["cached_tokens"] == params["restart_system_len"]
    assert restart["warm"]["cached_by_tier"]["disk"] == params["restart_system_len"]
    pre = {r["policy"]: r for r in report["results"] if r["scenario"] == "preemption"}
    assert set(pre) == {"recompute", "swap"} and pre["recompute"]["swapped_out_tokens"] == 0
