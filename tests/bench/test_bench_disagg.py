"""bench/disagg.py in its quick mode on the tiny chat model: a prefill and a decode worker behind
smg (over ZeroMQ and over NIXL) against two colocated workers, chat clients and bursts over
HTTP: every request answered in full, the KV of each PD request moved between the workers, the
transfer overhead measured, the targets checked, the JSON and the table written."""

from __future__ import annotations

import json

import pytest


# The cluster family's smoke run in the default run is tests/bench/test_bench_cluster.py;
# disaggregation itself is covered there by tests/cluster/test_disagg.py.
@pytest.mark.slow
def test_quick_disagg_report(tmp_path, tiny_chat_model, capsys) -> None:
    import torch
    from transformers import AutoConfig

    from bench.disagg import main
    from radixserve.cache.kv_pool import kv_bytes_per_token
    from radixserve.model.config import ModelConfig

    out = tmp_path / "disagg.json"
    report = main(["--quick", "--model", tiny_chat_model, "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert "ran out of messages" not in capsys.readouterr().out  # the clients talked the whole time
    params = report["params"]
    runs = {r["config"]: r for r in report["runs"]}
    assert list(runs) == ["pd", "colocated", "pd-nixl"]
    for name, r in runs.items():
        assert r["failed"] == 0 and r["errors"] == [] and r["short_outputs"] == 0, name
        assert r["chat_requests"] > 0 and r["burst_requests"] >= 1, name
        assert r["output_tokens"] == (r["chat_requests"] * params["chat_tokens"]
                                      + r["burst_requests"] * params["burst_tokens"]), name
    # PD: every request reaches both workers and its KV crosses from the prefill worker to the
    # decode worker; colocated workers move nothing.
    dtype = getattr(torch, params["dtype"])
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_chat_model), dtype)
    per_token = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype)
    for name in ("pd", "pd-nixl"):
        prefill, decode = runs[name]["requests_per_worker"]
        kv = runs[name]["kv"]
        assert prefill == decode == kv["transfers"] > 0 and kv["failed"] == 0, name
        assert 0 < kv["bytes_per_request"] <= params["burst_len"] * per_token, name
    assert "kv" not in runs["colocated"]
    for key, name in (("transfer_overhead", "pd"), ("transfer_overhead_nixl", "pd-nixl")):
        cost = report[key]
        assert cost["config"] == name
        # the prompts' KV past what the decode worker's tree already holds (the template's start)
        assert 0 < cost["kv_bytes"] <= cost["prompt_tokens"] * per_token
        assert cost["transfer_ms"] > 0 and cost["prefill_ms"] > 0
        assert cost["share"] == cost["transfer_ms"] / cost["prefill_ms"]
    assert [t["target"] for t in report["targets"]] == [
        "colocated / pd chat ITL p99 (whole run) >=", "colocated / pd chat ITL p99 (during bursts) >=",
        "transfer / prefill ms of a 1k-token prompt <="]
    assert out.with_suffix(".md").read_text().strip()
