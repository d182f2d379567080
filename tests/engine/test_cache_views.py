"""The cache seen from outside, on an in-process scheduler with a tiny model: the tree summary
(``GET /cache/tree``), per-request cache reports and near-miss diagnostics."""

from __future__ import annotations

import random

import pytest
from helpers.sched_driver import make_scheduler, run_until_idle, submit

from radixserve.cache.tree_view import EDGE_IDS, NEAR_MISS_MIN_AFTER, NEAR_MISS_MIN_MATCHED, summary


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, 256) for _ in range(n)]


def run(sched, prompt: list[int], n: int = 4, **fields) -> dict:
    rid = submit(sched, prompt, req_fields=fields or None, max_new_tokens=n, ignore_eos=True)
    return run_until_idle(sched)[rid]


@pytest.fixture
def sched(tiny_model_dir):
    return make_scheduler(tiny_model_dir("llama"), max_total_tokens=4096)


def three_systems(sched) -> tuple[list[int], list[int], list[int]]:
    """Three system prompts sent 4, 2 and 1 times, each time with another question (whose
    first token differs from every other question's)."""
    a, b, c = tokens(48, 1), tokens(40, 2), tokens(36, 3)
    first = iter(range(6, 256))
    for system, times in ((a, 4), (b, 2), (c, 1)):
        for _ in range(times):
            run(sched, system + [next(first)] + tokens(10, next(first)))
    return a, b, c


def test_summary_orders_counts_and_heads_of_three_system_prompts(sched) -> None:
    a, b, c = three_systems(sched)
    view = summary(sched.tree, "weight")
    top = view["prefixes"]
    # A: 48 tokens reused by 3 admissions; B: 40 reused once; everything else never reused.
    assert [(p["tokens"], p["hits"], p["weight"]) for p in top[:2]] == [(48, 3, 144), (40, 1, 40)]
    assert top[0]["head_ids"] == a[:EDGE_IDS] and top[0]["tail_ids"] == a[-EDGE_IDS:]
    assert top[1]["head_ids"] == b[:EDGE_IDS]
    assert (top[0]["children"], top[1]["children"]) == (4, 2)
    assert all(p["weight"] == 0 for p in top[2:])
    assert top[0]["depth"] == 1 and top[0]["start"] == 0 and top[0]["parent"] is None
    assert top[0]["tier"] == "device" and top[0]["locks"] == 0 and not top[0]["pinned"]
    # Each request left its question + 4 output tokens (the last one has no KV: 14 tokens).
    assert top[0]["subtree_tokens"] == 48 + 4 * 14
    # Nodes: each system prompt; per request its question (11) and, below, its output (3).
    assert view["nodes"] == (1 + 4 * 2) + (1 + 2 * 2) + 2 and view["device_tokens"] == sched.tree.total_size()
    # By tokens held: A's subtree, then B's, then C's (36 + 11 + 3).
    held = summary(sched.tree, "tokens", limit=3)["prefixes"]
    assert [p["subtree_tokens"] for p in held] == [48 + 4 * 14, 40 + 2 * 14, 50]
    assert [p["head_ids"] for p in held] == [a[:EDGE_IDS], b[:EDGE_IDS], c[:EDGE_IDS]]
    # depth 1: the three system prompts only (C's node holds its question too).
    shallow = summary(sched.tree, "tokens", depth=1)
    assert shallow["nodes"] == 3
    assert sorted(p["tokens"] for p in shallow["prefixes"]) == [40, 47, 48]
    assert len(summary(sched.tree, limit=2)["prefixes"]) == 2
    with pytest.raises(ValueError, match="sort"):
        summary(sched.tree, "size")


def test_a_rerendered_history_is_a_near_miss_and_a_stable_one_is_not(sched) -> None:
    history = tokens(80, 4)
    run(sched, history)  # turn 1: cached with its output
    stable = history + tokens(3, 5)  # turn 1 grown by turn 2 (the cached output differs: too short a tail)
    run(sched, history + tokens(20, 6))
    assert sched.stats.near_misses == 0 and not sched.near_misses
    changed = history[:50] + [history[50] ^ 1] + history[51:] + tokens(10, 7)  # one token re-rendered
    out = run(sched, changed, return_cache_report=True)
    assert sched.stats.near_misses == 1
    (miss,) = sched.near_misses
    assert miss["position"] == 50 and miss["near_miss"]
    assert miss["request_ids"] == changed[50 : 50 + EDGE_IDS] and miss["cached_ids"] == history[50 : 50 + EDGE_IDS]
    assert miss["before_ids"] == history[50 - EDGE_IDS : 50]
    assert miss["cached_after"] >= 30 >= NEAR_MISS_MIN_AFTER
    report = out["meta"]["cache_report"]
    assert report["position"] == 50 and report["near_miss"] and report["cached_tokens"] == 50
    # Another request leaving at the same spot meets a branch point now: no news.
    run(sched, history[:50] + [history[50] ^ 2] + tokens(20, 8))
    assert sched.stats.near_misses == 1
    # Identical prompts (the match stops one token short, by rule) are no near-miss either.
    run(sched, stable)
    run(sched, stable)
    assert sched.stats.near_misses == 1


def test_short_matches_and_short_remainders_are_no_near_misses(sched) -> None:
    long_run = tokens(100, 9)
    run(sched, long_run)
    early = long_run[: NEAR_MISS_MIN_MATCHED - 2] + tokens(30, 10)  # diverges too early
    late = long_run[: 100 - NEAR_MISS_MIN_AFTER + 6] + tokens(30, 11)  # too little left after
    out = run(sched, early, return_cache_report=True)
    run(sched, late)
    assert sched.stats.near_misses == 0
    report = out["meta"]["cache_report"]
    assert report["position"] == NEAR_MISS_MIN_MATCHED - 2 and not report["near_miss"]
    # A request that asks for no report gets none; one that matched nothing gets the bare count.
    assert "cache_report" not in run(sched, tokens(20, 12))["meta"]
    assert run(sched, tokens(20, 13), return_cache_report=True)["meta"]["cache_report"]["cached_tokens"] == 0
