"""Scheduling policies, eviction policies, cache namespaces (cache_salt) and priority
preemption, on an in-process scheduler with a tiny model."""

from __future__ import annotations

import random

import pytest
from helpers.oracle import hf_greedy
from helpers.sched_driver import make_scheduler, run_until_idle, submit

from radixserve.cache.eviction import EVICTION_POLICIES
from radixserve.scheduler.policy import POLICIES


def prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, 256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("eviction", EVICTION_POLICIES)
def test_every_policy_gives_hf_greedy_tokens_under_pressure(tiny_model_dir, policy: str, eviction: str) -> None:
    folder = tiny_model_dir("llama")
    # A pool that holds about two requests: retraction and eviction both happen.
    sched = make_scheduler(folder, schedule_policy=policy, radix_eviction_policy=eviction,
                           max_total_tokens=160, max_prefill_tokens=48, priority_preemption=policy == "priority")
    system = prompts(1, 24, 24, seed=1)[0]
    reqs = [system + t for t in prompts(4, 3, 8, seed=2)] + prompts(3, 10, 20, seed=3)
    rids = [submit(sched, p, req_fields={"priority": i % 3}, max_new_tokens=30, ignore_eos=True)
            for i, p in enumerate(reqs)]
    results = run_until_idle(sched)
    for rid, p in zip(rids, reqs, strict=True):
        assert results[rid]["output_ids"] == hf_greedy(folder, p, 30), (policy, eviction, rid)
    stats = sched.get_stats()
    assert stats["retractions"] > 0 and stats["evicted_tokens"] > 0


def waiting_order(sched) -> list[str]:
    return [r.rid for r in sched.policy.order(list(sched.waiting), sched.kv)]


def cache_prompts(sched, *cached: list[int]) -> None:
    for p in cached:
        submit(sched, p, max_new_tokens=0)
    run_until_idle(sched)


def test_dfs_weight_finishes_the_heaviest_branch_first_and_lpm_the_longest_match(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    a, b = prompts(1, 20, 20, seed=4)[0], prompts(1, 40, 40, seed=5)[0]
    orders = {}
    for policy in ("dfs-weight", "lpm", "fcfs"):
        sched = make_scheduler(folder, schedule_policy=policy, max_total_tokens=1024)
        cache_prompts(sched, a + [7], b + [7])
        tails = prompts(6, 4, 4, seed=6)
        queue = [("a1", a), ("b1", b), ("a2", a), ("c1", []), ("b2", b), ("a3", a)]
        rid_of = {}
        for (name, base), tail in zip(queue, tails, strict=True):
            rid_of[submit(sched, base + tail, max_new_tokens=1)] = name
        orders[policy] = [rid_of[r] for r in waiting_order(sched)]
    # Branch a has three waiting requests, b two (with the longer cached prefix), c none.
    assert orders["dfs-weight"] == ["a1", "a2", "a3", "b1", "b2", "c1"]
    assert orders["lpm"] == ["b1", "b2", "a1", "a2", "a3", "c1"]
    assert orders["fcfs"] == ["a1", "b1", "a2", "c1", "b2", "a3"]


def test_cache_aware_policies_fall_back_to_fcfs_on_a_deep_queue(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    a = prompts(1, 30, 30, seed=7)[0]
    for policy in ("lpm", "dfs-weight"):
        sched = make_scheduler(folder, schedule_policy=policy, schedule_policy_max_queue=3, max_total_tokens=1024)
        cache_prompts(sched, a + [9])
        rids = [submit(sched, p, max_new_tokens=1) for p in prompts(3, 5, 5, seed=8)]
        rids.append(submit(sched, a + [10, 11], max_new_tokens=1))
        assert waiting_order(sched) == rids  # 4 waiting > 3: arrival order, no tree walk


def test_lof_random_and_priority_orders(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    ps = prompts(5, 5, 5, seed=9)
    sched = make_scheduler(folder, schedule_policy="lof", max_total_tokens=1024)
    rids = [submit(sched, p, max_new_tokens=n) for p, n in zip(ps, [3, 9, 1, 9, 5], strict=True)]
    assert waiting_order(sched) == [rids[1], rids[3], rids[4], rids[0], rids[2]]

    orders = []
    for _ in range(2):
        sched = make_scheduler(folder, schedule_policy="random", random_seed=3, max_total_tokens=1024)
        rids = [submit(sched, p, max_new_tokens=1) for p in ps]
        orders.append([rids.index(r) for r in waiting_order(sched)])
    assert orders[0] == orders[1] and sorted(orders[0]) == list(range(5)) and orders[0] != list(range(5))

    for low_first, expected in ((False, [1, 3, 4, 0, 2]), (True, [2, 0, 4, 1, 3])):
        sched = make_scheduler(folder, schedule_policy="priority", max_total_tokens=1024,
                               schedule_low_priority_values_first=low_first)
        rids = [submit(sched, p, req_fields={"priority": lvl}, max_new_tokens=1)
                for p, lvl in zip(ps, [0, 5, -2, 5, 1], strict=True)]
        assert waiting_order(sched) == [rids[i] for i in expected]  # FCFS within a level


@pytest.mark.parametrize("preempt", [False, True])
def test_priority_preemption_retracts_lower_levels(tiny_model_dir, preempt: bool) -> None:
    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, schedule_policy="priority", priority_preemption=preempt,
                           max_running_requests=2, max_total_tokens=1024)
    low = prompts(2, 10, 10, seed=10)
    urgent = prompts(1, 10, 10, seed=11)[0]
    low_rids = [submit(sched, p, req_fields={"priority": 0}, max_new_tokens=40, ignore_eos=True) for p in low]
    for _ in range(3):
        sched.step()
    assert len(sched.running) == 2
    urgent_rid = submit(sched, urgent, req_fields={"priority": 10}, max_new_tokens=5, ignore_eos=True)
    sched.step()
    running = {r.rid for r in sched.running}
    assert (urgent_rid in running) == preempt
    assert sched.get_stats()["priority_preemptions"] == (1 if preempt else 0)
    results = run_until_idle(sched)
    for rid, p, n in [(low_rids[0], low[0], 40), (low_rids[1], low[1], 40), (urgent_rid, urgent, 5)]:
        assert results[rid]["output_ids"] == hf_greedy(folder, p, n)


def pin(sched, p: list[int], **fields) -> dict:
    rid = submit(sched, p, req_fields={"pin": True, **fields}, max_new_tokens=0)
    return run_until_idle(sched)[rid]["meta"]["pin"]


def test_pins_survive_eviction_expire_and_are_capped(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, max_total_tokens=256, max_pinned_fraction=0.5, radix_eviction_policy="lru")
    system = prompts(1, 60, 60, seed=20)[0]
    first = pin(sched, system)
    assert first["tokens"] == 60 and first["expires_in"] is None
    assert sched.check_memory()["pinned_tokens"] == 60
    # Traffic that fills the pool many times over: the pinned prefix stays, hits every time.
    for p in prompts(12, 40, 60, seed=21):
        submit(sched, p, max_new_tokens=8, ignore_eos=True)
    run_until_idle(sched)
    assert sched.get_stats()["evicted_tokens"] > 256
    rid = submit(sched, system + [9, 9], max_new_tokens=1)
    assert run_until_idle(sched)[rid]["meta"]["cached_tokens"] == 60
    # The cap: 128 tokens of 256; 60 are pinned, a new 80-token prefix would pass it.
    refused = pin(sched, prompts(1, 80, 80, seed=22)[0])
    assert "cap of 128 tokens" in refused["error"]
    assert sched.tree.pinned_size() == 60
    # Pinning a prefix of the pinned path costs nothing more; both count once.
    again = pin(sched, system[:30])
    assert again["tokens"] == 30 and sched.tree.pinned_size() == 60
    # A pin with a TTL goes at the first step after it expires.
    short = pin(sched, prompts(1, 20, 20, seed=23)[0], pin_ttl=0.05)
    assert sched.tree.pinned_size() == 80
    import time
    time.sleep(0.1)
    submit(sched, [7, 8, 9], max_new_tokens=1)
    run_until_idle(sched)
    assert [p["pin_id"] for p in sched.pins.listing()] == [first["pin_id"], again["pin_id"]]
    assert short["pin_id"] not in sched.pins.unpin(short["pin_id"])
    assert sched.pins.unpin(first["pin_id"]) == [first["pin_id"]]
    assert sched.pins.unpin(ids=system[:30]) == [again["pin_id"]]
    assert sched.tree.pinned_size() == 0
    assert sched.check_memory()["locked_tokens"] == 0
    pin(sched, system)
    assert sched.flush_cache() and sched.pins.listing() == [] and sched.tree.total_size() == 0


def test_namespaces_share_prefixes_only_within_one(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, max_total_tokens=1024)
    p = prompts(1, 30, 30, seed=12)[0]

    def cached(key: str) -> int:
        rid = submit(sched, p, req_fields={"extra_key": key}, max_new_tokens=2, ignore_eos=True)
        return run_until_idle(sched)[rid]["meta"]["cached_tokens"]

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # the same prompt under another salt: no hit
    assert cached("") == 0  # no salt is a namespace of its own
    assert cached("tenant-a") == cached("tenant-b") == cached("") == len(p) - 1
    # Each namespace holds its own copy: three times the prompt plus the outputs.
    assert sched.tree.total_size() >= 3 * len(p)
    sched.check_memory()
