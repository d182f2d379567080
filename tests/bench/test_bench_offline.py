"""Smoke test of bench/offline.py (the offline benchmark) and its workload generators.

No timing assertions: the numbers depend on the machine; only their shape, the token
accounting and the arithmetic between the reported numbers are checked.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.offline import CONFIGS  # noqa: E402
from bench.workloads import (  # noqa: E402
    english_paragraphs,
    multi_turn_workload,
    offline_multi_turn,
    offline_shared_prefix,
    shared_prefix_workload,
)

# The default model (SmolLM2-135M): per layer fused q/k/v 576 -> 576 + 2 x 192, o_proj, fused
# gate/up 576 -> 2 x 1536, down; 30 layers; LM head 576 -> 49152.
DEFAULT_MODEL_SHAPES = {"layers": [[576, 960, 30], [576, 576, 30], [576, 3072, 30], [1536, 576, 30]],
                        "head": [576, 49152]}
BREAKDOWN_CATEGORIES = ("attention", "linear", "other", "scheduler", "sampling")


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


def test_the_corpus_does_not_depend_on_what_was_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    """An import that replaces a corpus module's function (torch replaces inspect.getfile)
    leaves every paragraph and its order: a benchmark's prompts are the same in any process."""
    import inspect

    before = english_paragraphs()
    assert "Work out which source or compiled file an object was defined in." in before

    def replaced(obj: object) -> str:  # defined here: its __module__ is this test's
        return ""

    monkeypatch.setattr(inspect, "getfile", replaced)
    assert english_paragraphs() == before


def test_multi_turn_turns_resend_the_history(tokenizer) -> None:
    chats = multi_turn_workload(tokenizer, conversations=3, turns=3, system_len=20, question_len=5, seed=2)
    work = offline_multi_turn(chats, output_len=4)
    assert (work.num_turns, work.num_requests) == (3, 9)
    answers0 = [[100 + c, 1, 2, 3] for c in range(3)]
    answers1 = [[200 + c, 1, 2, 3] for c in range(3)]
    turn0 = work.prompts(0, [], [])
    turn1 = work.prompts(1, turn0, answers0)
    turn2 = work.prompts(2, turn1, answers1)
    for c in range(3):
        system, qs = chats.systems[c], chats.questions[c]
        assert turn0[c] == system + qs[0]
        assert turn2[c] == system + qs[0] + answers0[c] + qs[1] + answers1[c] + qs[2]
    assert work.prompt_tokens == sum(len(p) for p in turn0 + turn1 + turn2)
    # A perfect cache computes systems and questions once, and the last token of each answer.
    assert work.unique_tokens == 3 * (20 + 3 * 5) + 3 * 2
    shared = offline_shared_prefix(shared_prefix_workload(tokenizer, 2, 3, 16, 4, seed=1), output_len=2)
    assert shared.num_turns == 1 and shared.prompts(0, [], []) == shared.first


def check_floor(row: dict, shapes: dict) -> None:
    """The floor is the row's matmul FLOPs (from what its scheduler computed) at the rates."""
    floor, stats = row["floor"], row["stats"]
    layer_params = sum(k * m * n for k, m, n in shapes["layers"])
    head_params = shapes["head"][0] * shapes["head"][1]
    assert floor["prefill_flops"] == 2 * layer_params * stats["prefill_tokens_computed"]
    assert floor["decode_flops"] == 2 * layer_params * stats["decode_tokens"]
    assert floor["head_flops"] == 2 * head_params * stats["lm_head_rows"]
    assert floor["flops"] == floor["prefill_flops"] + floor["decode_flops"] + floor["head_flops"]
    rates = floor["rates_flop_per_s"]
    assert set(rates) == {"layers@64", "layers@512", "head@64"} and min(rates.values()) > 0
    assert floor["floor_s"] == pytest.approx(floor["prefill_flops"] / rates["layers@512"]
                                             + floor["decode_flops"] / rates["layers@64"]
                                             + floor["head_flops"] / rates["head@64"])
    assert floor["floor_s"] > 0 and floor["threads"] >= 1
    assert floor["wall_over_floor"] == pytest.approx(row["wall_s"] / floor["floor_s"])


@pytest.mark.slow
def test_quick_breakdown_splits_the_step_time_and_reports_the_floor(tmp_path) -> None:
    from bench.offline import main

    out = tmp_path / "offline.json"
    main(["--quick", "--breakdown", "--configs", "radix", "--no-overhead-check", "--no-progress",
          "--out", str(out)])
    report = json.loads(out.read_text())
    params = report["params"]
    n_requests = params["groups"] * params["questions"]
    assert report["matmul_shapes"] == DEFAULT_MODEL_SHAPES
    (row,) = report["results"]
    # Each request is prefilled in one forward, then decoded: one LM-head row per forward each.
    stats = row["stats"]
    assert stats["decode_tokens"] == n_requests * (params["output_len"] - 1)
    assert stats["lm_head_rows"] == stats["decode_tokens"] + n_requests
    check_floor(row, report["matmul_shapes"])

    breakdown = row["breakdown"]
    assert set(breakdown) == {"workload", "decode"}
    for name, b in breakdown.items():
        assert b["steps"] >= params["output_len"], name
        assert sum(b[f"{c}_s"] for c in BREAKDOWN_CATEGORIES) == pytest.approx(b["step_s"]), name
        assert sum(b[f"{c}_share"] for c in BREAKDOWN_CATEGORIES) == pytest.approx(1.0), name
        for c in BREAKDOWN_CATEGORIES:
            assert b[f"{c}_s"] >= 0, (name, c)
            assert b[f"{c}_ms"] == pytest.approx(1000 * b[f"{c}_s"] / b["steps"]), (name, c)
        assert b["attention_s"] > 0 and b["linear_s"] > 0, name
        assert b["profiled_step_ms"] == pytest.approx(1000 * b["step_s"] / b["steps"])
        assert b["unprofiled_step_ms"] > 0, name
    assert breakdown["workload"]["unprofiled_step_ms"] == pytest.approx(
        1000 * stats["step_seconds"] / stats["forward_steps"])
    decode = breakdown["decode"]
    assert (decode["requests"], decode["output_len"]) == (n_requests, params["output_len"])
    assert decode["decode_steps"] >= params["output_len"] - 1
    assert 1 <= decode["decode_rows_per_step"] <= n_requests
    targets = {t["target"]: t for t in report["targets"]}
    share = targets[f"radix decode step at {n_requests} requests: attention share <="]
    assert share["value"] == decode["attention_share"] and share["limit"] == 0.35


@pytest.mark.slow
def test_quick_multi_turn_computes_only_the_unique_tokens(tmp_path) -> None:
    from bench.offline import main

    out = tmp_path / "offline.json"
    main(["--quick", "--workload", "multi-turn", "--configs", "radix,no-radix", "--no-overhead-check",
          "--no-progress", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["benchmark"] == "offline_multi_turn"
    params, workload = report["params"], report["workload"]
    conversations, turns, out_len = params["conversations"], params["turns"], params["output_len"]
    assert (workload["turns"], workload["requests"]) == (turns, conversations * turns)
    assert workload["unique_tokens"] == conversations * (
        params["system_len"] + turns * params["question_len"] + turns - 1)
    rows = {r["config"]: r for r in report["results"]}
    for r in rows.values():
        assert r["output_tokens"] == conversations * turns * out_len and r["all_outputs_full_length"]
        check_floor(r, report["matmul_shapes"])
    # Each turn finds the history in the tree: all but the last answer token of the last turn.
    assert rows["radix"]["prefill_computed"] == workload["unique_tokens"]
    assert rows["no-radix"]["prefill_computed"] == workload["prompt_tokens"]
    assert rows["no-radix"]["outputs_match_radix"] == 1.0
    assert "radix hit rate >=" not in {t["target"] for t in report["targets"]}


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
    assert set(rows) == {(config, "float32") for config in CONFIGS}  # every config by default
    radix, no_radix, hf = rows[("radix", "float32")], rows[("no-radix", "float32")], rows[("hf-static", "float32")]
    # The pure-torch engine (C++ kernels off) computes the same tokens and, in float32, the
    # same greedy outputs.
    pure = rows[("radix-torch", "float32")]
    assert pure["prefill_computed"] == radix["prefill_computed"]
    assert pure["outputs_match_radix"] == 1.0
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
    # The cache serves the same prefixes with drafts, sampling, an int8 pool or 4-bit weights;
    # n-gram drafts keep the greedy tokens; sampled outputs are not compared.
    for config in ("radix-ngram", "radix-sampled", "radix-int8kv", "radix-gguf"):
        row = rows[(config, "float32")]
        assert row["prefill_computed"] == unique and row["memory_invariant_ok"], config
    assert rows[("radix-ngram", "float32")]["outputs_match_radix"] == 1.0
    assert rows[("radix-sampled", "float32")]["outputs_match_radix"] is None
    check_floor(radix, report["matmul_shapes"])
    check_floor(no_radix, report["matmul_shapes"])
    assert "floor" not in hf and "breakdown" not in radix
    # float32 greedy decoding agrees across the three implementations.
    assert no_radix["outputs_match_radix"] == hf["outputs_match_radix"] == 1.0

    check = radix["overhead_check"]
    assert (check["requests"], check["bucket"]) == (8, "8")
    assert check["overhead_ms_at_bucket"] is not None  # decode-only steps ran with all 8 requests

    # Targets: the token counts decide two verdicts; the timed ones follow value and limit.
    targets = {t["target"]: t for t in report["targets"]}
    assert set(targets) == {
        "radix computed/unique <=", "no-radix wall / radix wall >=", "hf-static wall / radix wall >=",
        "radix hit rate >=", "scheduler overhead ms at batch 8 <=", "radix wall / matmul floor <=",
        "radix wall / radix-torch wall <=", "radix-sampled wall / radix wall <=", "radix-ngram wall / radix wall <=",
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
        "radix wall / matmul floor <=": (radix["floor"]["wall_over_floor"], False),
        "radix wall / radix-torch wall <=": (radix["wall_s"] / pure["wall_s"], False),
        "radix-sampled wall / radix wall <=": (rows[("radix-sampled", "float32")]["speedup_of_radix"], False),
        "radix-ngram wall / radix wall <=": (rows[("radix-ngram", "float32")]["speedup_of_radix"], False),
    }
    for name, (value, at_least) in timed.items():
        t = targets[name]
        assert t["value"] == value, name
        assert t["ok"] is (value >= t["limit"] if at_least else value <= t["limit"]), name
