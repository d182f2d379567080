"""Smoke test of bench/program.py (the branching program benchmark) on the tiny chat model.

No timing assertions: only the report's shape and the token accounting, which hold whatever
the machine (request counts, prompt tokens against the scheduler's counters, the unique-token
count against a brute-force set of prefixes, cache on against cache off).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.program_workload import BRANCH_TASKS, LABELS, branching_workload, unique_prefix_tokens  # noqa: E402

PROGRAMS = 4
# Per program: the select's prompt and one request per choice, fork's prefix request, one gen
# per branch and the join's gen; as chat calls: the select, one call per branch, the join.
PROGRAM_REQUESTS = {"select prompt": 1, "select choice": len(LABELS), "fork prefix": 1, "gen": len(BRANCH_TASKS) + 1}
CHAT_REQUESTS = {"select": 1, "branch": len(BRANCH_TASKS), "final": 1}


def brute_force_unique(prompts: list[list[int]]) -> int:
    return len({tuple(p[: i + 1]) for p in prompts for i in range(len(p))})


def test_unique_prefix_tokens_counts_distinct_prefixes() -> None:
    assert unique_prefix_tokens([]) == 0
    # Prefixes: 1 | 1 2 | 1 2 3 | 1 2 4 | 5; a repeat and a prefix of another add nothing.
    assert unique_prefix_tokens([[1, 2, 3], [1, 2, 4], [1, 2], [5], [1, 2, 3]]) == 5
    rng = random.Random(0)
    for _ in range(200):
        prompts = [[rng.randrange(3) for _ in range(rng.randrange(6))] for _ in range(rng.randrange(1, 8))]
        assert unique_prefix_tokens(prompts) == brute_force_unique(prompts), prompts


def test_workload_interleaves_documents_and_gives_every_program_its_own_ticket(default_model_path: str) -> None:
    from radixserve.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path)
    work = branching_workload(tokenizer, programs=6, documents=3, doc_len=80, gen_len=5, seed=1)
    kwargs = work.program_kwargs()
    assert [kw["document"] for kw in kwargs] == [work.documents[i % 3] for i in range(6)]
    assert len(set(work.documents)) == 3 and len({kw["ticket"] for kw in kwargs}) == 6
    assert all(kw["gen_len"] == 5 for kw in kwargs)
    for doc in work.documents:  # a decoded window re-encodes to about its length
        assert 70 <= len(tokenizer.encode(doc, add_special_tokens=False)) <= 90
    assert branching_workload(tokenizer, 6, 3, 80, 5, seed=1) == work


@pytest.fixture(scope="module")
def bench_run(tiny_chat_model: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ...]:
    from bench.program import parse_args, run

    out = tmp_path_factory.mktemp("bench") / "program.json"
    args = parse_args(["--model", tiny_chat_model, "--programs", str(PROGRAMS), "--documents", "2",
                       "--doc-len", "96", "--gen-len", "3", "--dtypes", "float32", "--select-ks", "1", "4",
                       "--select-repeats", "1", "--select-prefix-len", "64", "--max-total-tokens", "20000",
                       "--no-progress", "--out", str(out)])
    report, rows = run(args)
    return report, {r["config"]: r for r in rows}, json.loads(out.read_text())


def test_report_is_written_with_every_config_and_target(bench_run: tuple[Any, ...]) -> None:
    report, rows, written = bench_run
    assert written == report and report["benchmark"] == "program_branching"
    assert {"platform", "cpu_count", "torch"} <= set(report["machine"])
    assert [(r["config"], r["dtype"]) for r in report["results"]] == [
        ("program", "float32"), ("program-no-radix", "float32"), ("openai-chat", "float32")]
    assert all("prompt_ids" not in r and "results" not in r for r in report["results"])
    no_radix = rows["program-no-radix"]
    for r in rows.values():
        assert r["programs"] == PROGRAMS and len(r["results"]) == PROGRAMS
        assert r["computed_over_unique"] == pytest.approx(r["prefill_computed"] / r["unique_tokens"])
        assert r["speedup_vs_no_radix"] == pytest.approx(no_radix["wall_s"] / r["wall_s"])
        assert r["memory_invariant_ok"], r["config"]
        assert all(res["label"] in LABELS and len(res["notes"]) == len(BRANCH_TASKS) for res in r["results"])
    targets = {t["target"]: t for t in report["targets"]}
    assert set(targets) == {"program: no-radix wall / radix wall >=", "program: prefill computed / unique <=",
                            "select: k=4 time / k=1 time <="}
    program = rows["program"]
    for name, value in (("program: no-radix wall / radix wall >=", program["speedup_vs_no_radix"]),
                        ("program: prefill computed / unique <=", program["computed_over_unique"]),
                        ("select: k=4 time / k=1 time <=", program["select"]["ratio_vs_k1"]["4"])):
        t = targets[name]
        at_least = name.endswith(">=")
        assert t["value"] == value and t["ok"] is (value >= t["limit"] if at_least else value <= t["limit"])


def test_every_prompt_is_counted_exactly(bench_run: tuple[Any, ...]) -> None:
    _, rows, _ = bench_run
    for config, per_program in (("program", PROGRAM_REQUESTS), ("program-no-radix", PROGRAM_REQUESTS),
                                ("openai-chat", CHAT_REQUESTS)):
        r = rows[config]
        counts = {k: d["requests"] for k, d in r["by_kind"].items()}
        assert counts == {k: n * PROGRAMS for k, n in per_program.items()}
        assert r["requests"] == len(r["prompt_ids"]) == sum(per_program.values()) * PROGRAMS
        # The recorded prompts are what the scheduler admitted, token for token in number.
        assert r["prompt_tokens_match_stats"], config
        by_kind_total = sum(d["prompt_tokens"] for d in r["by_kind"].values())
        assert r["prompt_tokens"] == r["stats"]["prompt_tokens"] == by_kind_total
        assert r["unique_tokens"] == brute_force_unique(r["prompt_ids"])
        assert r["hit_rate"] == pytest.approx(r["stats"]["cached_tokens"] / r["prompt_tokens"])


def test_the_cache_computes_each_shared_prefix_once(bench_run: tuple[Any, ...]) -> None:
    _, rows, _ = bench_run
    program, no_radix, chat = rows["program"], rows["program-no-radix"], rows["openai-chat"]
    # Without the cache every prompt is computed in full.
    assert no_radix["prefill_computed"] == no_radix["prompt_tokens"] and no_radix["hit_rate"] == 0.0
    # With it, every distinct prefix at least once (no prompt of the program extends generated
    # text), and the shared documents once, not once per request.
    assert program["unique_tokens"] <= program["prefill_computed"] < no_radix["prefill_computed"]
    # A request computes what it was not served from the tree (nothing is retracted here).
    assert program["stats"]["retractions"] == 0
    assert program["prefill_computed"] == program["prompt_tokens"] - program["stats"]["cached_tokens"]
    assert chat["prefill_computed"] < chat["prompt_tokens"]
    # Every choice of a select was served the prompt from the cache, but for the last two
    # tokens: its logprobs start at the prompt's last token, whose logprob needs the one before.
    kinds = program["by_kind"]
    select_prompts = kinds["select prompt"]["prompt_tokens"]
    assert kinds["select choice"]["cached_tokens"] >= len(LABELS) * (select_prompts - 2 * PROGRAMS)
    sel = program["select"]
    assert sel["prefix_tokens_min"] >= 64 and sel["choice_cached_tokens_min"] >= sel["prefix_tokens_min"] - 2
    assert sel["ratio_vs_k1"]["1"] == 1.0 and set(sel["median_s"]) == {"1", "4"}
