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
def test_quick_benchmark_writes_sane_json(tmp_path, default_model_path) -> None:
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

    rows = {(r["config"], r["dtype"]): r for r in report["results"]}
    assert set(rows) == {("radix", "float32"), ("no-radix", "float32"), ("hf-static", "float32")}
    for r in rows.values():
        assert r["wall_s"] > 0 and r["output_tok_per_s"] > 0
        assert r["output_tokens"] == n_requests * params["output_len"]
        assert r["all_outputs_full_length"]
        assert 0.0 <= r["hit_rate"] <= 1.0
        assert r["computed_over_unique"] == pytest.approx(r["prefill_computed"] / unique)
        assert r["speedup_of_radix"] > 0
    radix, no_radix, hf = rows[("radix", "float32")], rows[("no-radix", "float32")], rows[("hf-static", "float32")]
    prompt_tokens = report["workload"]["prompt_tokens"]
    assert radix["prefill_computed"] < no_radix["prefill_computed"]
    assert radix["prefill_computed"] >= unique  # nothing was cached before the run
    assert no_radix["prefill_computed"] == hf["prefill_computed"] == prompt_tokens
    assert radix["hit_rate"] > 0 and no_radix["hit_rate"] == hf["hit_rate"] == 0.0
    assert radix["speedup_of_radix"] == 1.0
    assert radix["memory_invariant_ok"] and no_radix["memory_invariant_ok"]
    # float32 greedy decoding agrees across the three implementations.
    assert no_radix["outputs_match_radix"] == hf["outputs_match_radix"] == 1.0

    check = radix["overhead_check"]
    assert check["bucket"] == "8" and check["overhead_ms_at_bucket"] >= 0
    targets = {t["target"] for t in report["targets"]}
    assert len(targets) == 5 and all(t["ok"] in (True, False) for t in report["targets"])
