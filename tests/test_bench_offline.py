"""Smoke test of bench/offline.py (the shared-prefix benchmark) and its workload generator.

No timing assertions: the numbers depend on the machine; only their shape and the token
accounting are checked.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.workloads import shared_prefix_workload  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path)


def test_workload_has_exact_sizes_shared_systems_and_distinct_questions(tokenizer) -> None:
    groups, questions, system_len, question_len = 3, 4, 40, 7
    work = shared_prefix_workload(tokenizer, groups, questions, system_len, question_len, seed=5)
    assert work.num_requests == groups * questions
    assert all(len(p) == system_len + question_len for p in work.prompts)
    assert work.group_of == [i % groups for i in range(work.num_requests)]  # interleaved
    systems = {tuple(p[:system_len]) for p in work.prompts}
    assert len(systems) == groups
    for i, p in enumerate(work.prompts):
        assert p[:system_len] == work.prompts[work.group_of[i]][:system_len]
    assert len({tuple(p[system_len:]) for p in work.prompts}) == work.num_requests
    assert work.unique_tokens == groups * system_len + groups * questions * question_len
    # Real English text, and deterministic per seed.
    text = tokenizer.decode(work.prompts[0])
    assert sum(c.isalpha() for c in text) > 0.6 * len(text) and " the " in f" {text.lower()} "
    again = shared_prefix_workload(tokenizer, groups, questions, system_len, question_len, seed=5)
    assert again.prompts == work.prompts
    other = shared_prefix_workload(tokenizer, groups, questions, system_len, question_len, seed=6)
    assert other.prompts != work.prompts


@pytest.mark.slow
def test_quick_benchmark_writes_sane_json(tmp_path, tokenizer) -> None:
    from bench.offline import main

    out = tmp_path / "offline.json"
    returned = main(["--quick", "--no-progress", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["benchmark"] == returned["benchmark"] == "offline_shared_prefix"
    assert {"platform", "cpu_count", "torch"} <= set(report["machine"])
    params = report["params"]
    n_requests = params["groups"] * params["questions"]
    unique = params["groups"] * params["system_len"] + n_requests * params["question_len"]
    assert report["workload"]["unique_tokens"] == unique
    prompt_tokens = report["workload"]["prompt_tokens"]
    assert prompt_tokens == n_requests * (params["system_len"] + params["question_len"])

    rows = {(r["config"], r["dtype"]): r for r in report["results"]}
    assert set(rows) == {("radix", "float32"), ("no-radix", "float32"), ("hf-static", "float32")}
    radix, no_radix, hf = rows[("radix", "float32")], rows[("no-radix", "float32")], rows[("hf-static", "float32")]
    for r in rows.values():
        assert r["output_tokens"] == n_requests * params["output_len"]
        assert r["all_outputs_full_length"]
        assert r["output_tok_per_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
        assert r["computed_over_unique"] == pytest.approx(r["prefill_computed"] / unique)
        assert r["speedup_of_radix"] == pytest.approx(r["wall_s"] / radix["wall_s"])

    # With the cache, each system prompt is computed once: the first question of its group
    # computes it, the others wait one step and read it from the tree (whole pages: the
    # system length is a multiple of 16).  Questions start with tokens of their own, so
    # nothing else is shared and the radix run computes exactly the unique tokens.
    work = shared_prefix_workload(tokenizer, params["groups"], params["questions"], params["system_len"],
                                  params["question_len"], seed=params["seed"])
    system_len = params["system_len"]
    assert system_len % 16 == 0
    assert all(p[system_len] != work.prompts[g][system_len]
               for i, (p, g) in enumerate(zip(work.prompts, work.group_of, strict=True)) if i != g)
    assert radix["prefill_computed"] == unique
    assert radix["hit_rate"] == pytest.approx((prompt_tokens - unique) / prompt_tokens)
    assert no_radix["prefill_computed"] == hf["prefill_computed"] == prompt_tokens
    assert no_radix["hit_rate"] == hf["hit_rate"] == 0.0
    assert radix["memory_invariant_ok"] and no_radix["memory_invariant_ok"]
    # float32 greedy decoding agrees across the three implementations.
    assert no_radix["outputs_match_radix"] == hf["outputs_match_radix"] == 1.0

    check = radix["overhead_check"]
    assert (check["requests"], check["bucket"]) == (8, "8")
    assert check["overhead_ms_at_bucket"] is not None  # decode-only steps ran with all 8 requests

    # Targets: the token counts decide two verdicts; the timed ones follow value and limit.
    targets = {t["target"]: t for t in report["targets"]}
    assert set(targets) == {
        "radix computed/unique <=", "no-radix wall / radix wall >=", "hf-static wall / radix wall >=",
        "radix hit rate >=", "scheduler overhead ms at batch 8 <=",
    }
    assert targets["radix computed/unique <="]["value"] == 1.0
    assert targets["radix computed/unique <="]["ok"] is True
    # Two questions per group serve at most 128 of 288 prompt tokens from the tree.
    assert targets["radix hit rate >="]["value"] == radix["hit_rate"]
    assert targets["radix hit rate >="]["ok"] is False
    timed = {
        "no-radix wall / radix wall >=": (no_radix["speedup_of_radix"], True),
        "hf-static wall / radix wall >=": (hf["speedup_of_radix"], True),
        "scheduler overhead ms at batch 8 <=": (check["overhead_ms_at_bucket"], False),
    }
    for name, (value, at_least) in timed.items():
        t = targets[name]
        assert t["value"] == value, name
        assert t["ok"] is (value >= t["limit"] if at_least else value <= t["limit"]), name
