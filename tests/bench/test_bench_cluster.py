"""bench/cluster.py in its quick mode on the tiny chat model: two workers behind the real router
(cache_aware, cache_aware over gRPC with the workers' KV events, and round_robin), the same workers addressed directly, one bigger worker, and
TP=2 against TP=1: every request answered, the hit rates and tokens/s measured, the targets
checked, the JSON written.  The default run routes with cache_aware alone (each router and
policy is served end to end in tests/cluster/); every policy runs with -m slow."""

from __future__ import annotations

import json

import pytest

EVERY_POLICY = ["cache_aware", "cache_aware+events", "sglang-router/cache_aware", "round_robin"]


@pytest.mark.parametrize("policies", [
    pytest.param(["cache_aware"], id="cache_aware"),
    pytest.param(None, marks=pytest.mark.slow, id="every-policy"),  # the script's default list
])
def test_quick_cluster_report(tmp_path, tiny_chat_model, policies: list[str] | None) -> None:
    from bench.cluster import main

    out = tmp_path / "cluster.json"
    report = main(["--quick", "--model", tiny_chat_model, "--dtype", "float32", "--tp-dtypes", "float32",
                   "--out", str(out), *(["--policies", ",".join(policies)] if policies else [])])
    assert json.loads(out.read_text()) == report
    policies = policies or EVERY_POLICY
    runs = report["routing"]["runs"]
    assert [r["config"] for r in runs] == [*policies, "direct", "single"]
    requests = report["routing"]["workload"]["requests"]
    for r in runs:
        s = r["summary"]
        assert s["completed"] == requests and s["failed"] == 0, r["config"]
        assert s["cache_hit_rate"] <= report["routing"]["workload"]["ideal_hit_rate"] + 0.05
        # What the answers' usage said, through the router or not, is what the workers counted.
        workers = r["workers"]
        assert sum(w["requests"] for w in workers) == requests, r["config"]
        assert sum(w["prompt_tokens"] for w in workers) == s["input_tokens"], r["config"]
        assert sum(w["cached_tokens"] for w in workers) == s["cached_tokens"], r["config"]
        # Only the runs that place requests themselves must hit: the router's choices follow the
        # workers' load, and on a busy machine it may send most groups to one worker, whose pool
        # (half of the groups) then evicts each group's prefix before its next question.
        assert s["cache_hit_rate"] > 0 or r["config"] not in ("direct", "single"), r["config"]
        assert s["output_tokens"] == requests * report["params"]["output_len"]
    tp = report["tensor_parallel"]["runs"]
    assert [(r["dtype"], r["tp"]) for r in tp] == [("float32", 1), ("float32", 2)]
    assert all(r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0 for r in tp)
    assert [t["target"] for t in report["targets"]] == [
        "cache_aware hit rate >=",
        *(["cache_aware / round_robin hit rate >="] if "round_robin" in policies else []),
        "|cache_aware - single worker| hit rate <=", "router / direct throughput >=",
        *(["cache_aware+events - cache_aware hit rate >="] if "cache_aware+events" in policies else [])]
    assert out.with_suffix(".md").read_text().strip()
