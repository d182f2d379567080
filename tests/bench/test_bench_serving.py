"""Smoke tests of bench/serving.py and bench/compare.py against live servers on a tiny model.

Each workload runs a handful of requests and the JSON report is checked for its fields and its
token accounting (exact output lengths, cache hits where the workload must have them). No
timing assertions: the numbers depend on the machine.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.server import ServerProcess

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import serving  # noqa: E402

SERVER_FLAGS = ("--max-total-tokens", "20000", "--context-length", "2048")
SUMMARY_FIELDS = {
    "completed", "failed", "duration_s", "request_throughput", "input_tokens", "output_tokens",
    "cached_tokens", "input_throughput", "output_throughput", "total_throughput", "concurrency",
    "short_outputs", "cache_hit_rate", "server_cache_hit_rate", "ttft_ms", "tpot_ms", "itl_ms",
    "e2e_ms", "errors",
}


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    srv = ServerProcess("--model", tiny_chat_model, "--served-model-name", "tiny", *SERVER_FLAGS).wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


def bench(server, tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "report.json"
    returned = serving.main(["--base-url", server.base_url, "--disable-tqdm", "--out", str(out), *flags])
    report = json.loads(out.read_text())
    assert report["summary"] == json.loads(json.dumps(returned["summary"]))
    assert report["benchmark"] == "serving" and report["model"] == "tiny"
    assert SUMMARY_FIELDS <= set(report["summary"])
    s = report["summary"]
    assert s["failed"] == 0, s["errors"]
    assert s["completed"] == report["workload"]["requests"] == len(report["requests"])
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = s[key]
        assert set(d) == {"mean", "p50", "p90", "p99"} and d["p50"] > 0
        assert d["p50"] <= d["p90"] <= d["p99"]
    assert s["short_outputs"] == 0  # ignore_eos: every output has exactly O tokens
    assert s["output_tokens"] == sum(r["requested_output"] for r in report["requests"])
    assert s["duration_s"] > 0 and s["request_throughput"] > 0 and s["output_throughput"] > 0
    # The /metrics counters and usage.cached_tokens count the same tokens.
    assert report["server"]["flush_cache"] == "flushed"
    assert report["server"]["prompt_tokens"] == s["input_tokens"]
    assert s["server_cache_hit_rate"] == pytest.approx(s["cache_hit_rate"])
    return report


def test_shared_prefix(server, tmp_path) -> None:
    report = bench(server, tmp_path, "--workload", "shared-prefix", "-G", "2", "-P", "3", "-S", "64",
                   "-Q", "8", "-O", "4", "--max-concurrency", "1", "--plot")
    w = report["workload"]
    assert (w["groups"], w["questions"], w["system_len"], w["question_len"]) == (2, 3, 64, 8)
    assert w["requests"] == 6 and w["unique_prompt_tokens"] == 2 * 64 + 6 * 8
    requests = report["requests"]
    assert all(r["prompt_tokens"] == 72 and r["output_tokens"] == 4 for r in requests)
    # One at a time, interleaved g0 g1 g0 g1 ...: each group's first request misses, the rest
    # read the system prompt from the cache (the cache was flushed after the warm-up).
    assert [r["cached_tokens"] >= 64 for r in requests] == [False, False, True, True, True, True]
    assert report["summary"]["cache_hit_rate"] >= 4 * 64 / (6 * 72)
    assert (tmp_path / "report.png").stat().st_size > 10_000


def test_multi_turn_reuses_history(server, tmp_path) -> None:
    report = bench(server, tmp_path, "--workload", "multi-turn", "-C", "2", "-T", "3", "-S", "32",
                   "-Q", "8", "-O", "4", "--max-concurrency", "2")
    requests = report["requests"]
    assert [(r["job"], r["turn"]) for r in requests] == [(c, t) for c in range(2) for t in range(3)]
    for prev, cur in zip(requests, requests[1:], strict=False):
        if cur["turn"] == 0:
            assert cur["prompt_tokens"] == 32 + 8
            continue
        # The history grows by the answer and the question; all of the last prompt is cached.
        assert cur["prompt_tokens"] > prev["prompt_tokens"] + 8
        assert cur["cached_tokens"] >= prev["prompt_tokens"]


def test_no_reuse_with_poisson_arrivals(server, tmp_path) -> None:
    report = bench(server, tmp_path, "--workload", "no-reuse", "-N", "4", "-I", "24", "-O", "3",
                   "--request-rate", "20", "--prompt-format", "text")
    assert report["params"]["request_rate"] == 20 and "Poisson" in report["traffic"]
    assert report["summary"]["cache_hit_rate"] < 0.1
    assert report["workload"]["num_prompts"] == 4


def test_trace_replay_and_hash_blocks(server, tmp_path) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 40, "hash_ids": [7, 8], "output_length": 3},
        {"timestamp": 50, "prompt": "The harbour was quiet before the storm.", "output_length": 2},
        {"timestamp": 100, "input_length": 36, "hash_ids": [7, 8, 9], "output_length": 3},
        {"timestamp": 150, "input_ids": [504, 3575, 314, 4649], "max_tokens": 2},
    ]
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    report = bench(server, tmp_path, "--workload", "trace", "--trace-file", str(trace),
                   "--trace-time-unit", "ms", "--trace-block-size", "16", "--max-concurrency", "1")
    requests = report["requests"]
    assert [r["prompt_tokens"] for r in requests][::2] == [40, 36]
    assert [r["requested_output"] for r in requests] == [3, 2, 3, 2]
    assert requests[1]["prompt_tokens"] > 4 and requests[3]["prompt_tokens"] == 4
    assert requests[2]["cached_tokens"] >= 32  # blocks 7 and 8 were computed by the first line
    assert all(b["start"] >= a["start"] for a, b in zip(requests, requests[1:], strict=False))
    assert report["workload"]["trace_span_s"] == pytest.approx(0.15)


def test_arrival_times_and_prometheus_parsing() -> None:
    args = serving.parse_args(["--request-rate", "4", "--seed", "3"])
    jobs = [serving.Job([1], 1) for _ in range(400)]
    times = serving.arrival_times(jobs, args)
    assert times == serving.arrival_times(jobs, args) and times[0] == 0.0
    assert all(b >= a for a, b in zip(times, times[1:], strict=False))
    assert 0.2 < times[-1] / (len(times) - 1) < 0.3  # mean gap ~ 1 / rate
    assert serving.arrival_times(jobs, serving.parse_args([])) == [0.0] * 400
    assert math.isinf(serving.parse_args([]).request_rate)
    text = ("# HELP x\nradixserve:cached_tokens_total 30.0\nradixserve:prompt_tokens_total 120.0\n"
            'radixserve:requests_total{finish_reason="length"} 3.0\n'
            'radixserve:requests_total{finish_reason="stop"} 2.0\n')
    values = serving.parse_prometheus(text)
    assert values["radixserve:cached_tokens_total"] == 30 and values["radixserve:requests_total"] == 5


def test_cli_entry_point_help() -> None:
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "radixserve.cli", *args], capture_output=True,
                              text=True, timeout=120)

    out = cli("bench", "serving", "--help")
    assert out.returncode == 0, out.stderr
    assert "radixserve bench serving" in out.stdout and "--workload" in out.stdout
    assert "--max-concurrency" in out.stdout and "--no-ignore-eos" in out.stdout
    listing = cli("bench", "--help")
    assert listing.returncode == 0 and "serving" in listing.stdout and "compare" in listing.stdout
    assert cli("bench", "nonsense").returncode == 2
    assert "bench" in cli("--help").stdout


def compare_run(tmp_path: Path, model: str, *flags: str) -> dict:
    from bench import compare

    out = tmp_path / "compare.json"
    returned = compare.main(["--model", model, "--server-args", " ".join(SERVER_FLAGS), "--out", str(out),
                             "--disable-tqdm", "-G", "2", "-P", "2", "-S", "48", "-Q", "8", "-O", "3", *flags])
    saved = json.loads(out.read_text())
    assert saved["benchmark"] == returned["benchmark"] == "serving_compare"
    assert {"platform", "cpu_count", "torch"} <= set(saved["machine"])
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert out.with_suffix(".md").read_text().strip()  # the Markdown beside the JSON
    for run in saved["runs"]:
        s = run["report"]["summary"]
        assert s["completed"] == 4 and s["failed"] == 0, s["errors"]
    return saved


@pytest.mark.slow  # ~30 s: one server start dominates
def test_compare_one_server_two_concurrency_levels(tiny_chat_model, tmp_path) -> None:
    saved = compare_run(tmp_path, tiny_chat_model, "--radix", "on", "--concurrency", "1,all")
    runs = [(r["radix"], r["policy"], r["concurrency"]) for r in saved["runs"]]
    assert runs == [("on", "lpm", 1), ("on", "lpm", None)]
    one_at_a_time = saved["runs"][0]["report"]["summary"]
    assert 2 * 48 / (4 * 56) <= one_at_a_time["cache_hit_rate"] < 0.6  # the 2nd of each group
    # No radix-off run to compare TTFT with: that target is reported as not measured.
    ratio = [t for t in saved["targets"] if t["target"].startswith("TTFT")]
    assert len(ratio) == 2 and all(t["ok"] is None for t in ratio)


def test_compare_targets_table_and_chart_from_rows(tmp_path) -> None:
    from bench import compare

    def row(radix: str, hit: float, ttft: float) -> dict:
        ms = {"mean": ttft, "p50": ttft, "p90": ttft, "p99": ttft}
        summary = {"completed": 64, "failed": 0, "duration_s": 10.0, "request_throughput": 6.4,
                   "output_throughput": 204.8, "cache_hit_rate": hit, "server_cache_hit_rate": hit,
                   "ttft_ms": ms, "tpot_ms": ms, "itl_ms": ms, "e2e_ms": ms}
        requests = [{"ok": True, "ttft": ttft / 1000 * (1 + i / 10)} for i in range(8)]
        return {"radix": radix, "policy": "lpm", "concurrency": None, "label": f"radix {radix}, lpm",
                "report": {"summary": summary, "requests": requests}}

    checks = compare.check_targets([row("on", 0.9, 100.0), row("off", 0.0, 500.0)], "shared-prefix")
    assert [(c["target"], c["value"], c["ok"]) for c in checks] == [
        ("radix-on hit rate >=", 0.9, True), ("TTFT p50 radix on / off <=", 0.2, True)]
    checks = compare.check_targets([row("on", 0.8, 200.0), row("off", 0.0, 500.0)], "shared-prefix")
    assert [c["ok"] for c in checks] == [False, False]
    assert compare.check_targets([row("on", 0.9, 1.0)], "no-reuse") == []
    compare.plot_matrix([row("on", 0.9, 100.0), row("off", 0.0, 500.0)], "test", tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 10_000


# The serving family's default-run smoke runs are bench/serving.py's workloads above (one
# server); compare.py's targets and chart are checked from rows above, its server runs here
# with -m slow (--schedule-mode itself: tests/engine/test_schedule_mode.py).
@pytest.mark.slow
def test_compare_schedule_modes(tiny_chat_model, tmp_path) -> None:
    """--schedule-modes: one server per mode, each started with its --schedule-mode."""
    saved = compare_run(tmp_path, tiny_chat_model, "--radix", "on", "--schedule-modes", "mixed,prefill-first",
                        "--request-rate", "20")
    runs = [(r["schedule_mode"], r["label"]) for r in saved["runs"]]
    assert runs == [("mixed", "radix on, lpm, mixed"), ("prefill-first", "radix on, lpm, prefill-first")]
    cmds = [r["server_cmd"] for r in saved["runs"]]
    assert [c[c.index("--schedule-mode") + 1] for c in cmds] == ["mixed", "prefill-first"]


@pytest.mark.slow
def test_compare_radix_on_off(tiny_chat_model, tmp_path) -> None:
    saved = compare_run(tmp_path, tiny_chat_model, "--radix", "on,off", "--policies", "lpm,fcfs",
                        "--concurrency", "1")
    runs = {(r["radix"], r["policy"]): r["report"]["summary"] for r in saved["runs"]}
    assert set(runs) == {("on", "lpm"), ("on", "fcfs"), ("off", "lpm"), ("off", "fcfs")}
    for policy in ("lpm", "fcfs"):
        assert 2 * 48 / (4 * 56) <= runs[("on", policy)]["cache_hit_rate"] < 0.6
        assert runs[("off", policy)]["cache_hit_rate"] == 0.0
    assert len(saved["targets"]) == 4 and all(t["ok"] in (True, False) for t in saved["targets"])
