"""bench/cluster.py in its quick mode on the tiny chat model: two workers behind the real router
(cache_aware, cache_aware over gRPC with the workers' KV events, and round_robin), the same workers addressed directly, one bigger worker, and
TP=2 against TP=1: every request answered, the hit rates and tokens/s measured, the targets
checked, the JSON written."""

from __future__ import annotations

import json


def test_quick_cluster_report(tmp_path, tiny_chat_model) -> None:
    from bench.cluster import main

    out = tmp_path / "cluster.json"
    report = main(["--quick", "--model", tiny_chat_model, "--dtype", "float32", "--tp-dtypes", "float32",
                   "--out", str(out)])
    assert json.loads(out.read_text()) == report
    runs = report["routing"]["runs"]
    assert [r["config"] for r in runs] == ["cache_aware", "cache_aware+events", "sglang-router/cache_aware", "round_robin",
                                                 "direct", "single"]
    requests = report["routing"]["workload"]["requests"]
    for r in runs:
        s = r["summary"]
        assert s["completed"] == requests and s["failed"] == 0, r["config"]
        assert s["cache_hit_rate"] <= report["routing"]["workload"]["ideal_hit_rate"] + 0.05
        # round_robin's hits depend on arrival timing: at concurrency 4 a group's next question can
        # reach a worker before its first one's prefix is in that worker's tree.
        assert s["cache_hit_rate"] > 0 or r["config"] == "round_robin", r["config"]
        assert s["output_tokens"] == requests * report["params"]["output_len"]
    tp = report["tensor_parallel"]["runs"]
    assert [(r["dtype"], r["tp"]) for r in tp] == [("float32", 1), ("float32", 2)]
    assert all(r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0 for r in tp)
    assert [t["target"] for t in report["targets"]] == [
        "cache_aware hit rate >=", "cache_aware / round_robin hit rate >=",
        "|cache_aware - single worker| hit rate <=", "router / direct throughput >=",
        "cache_aware+events - cache_aware hit rate >="]
    assert out.with_suffix(".md").read_text().count("```") == 4
