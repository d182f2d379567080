"""KV tiers (host pool, disk store) and swap preemption on an in-process scheduler with a tiny
model: greedy parity with promoted prefixes, per-tier hit counts, warm restarts from disk,
damaged files, and the tier bookkeeping under randomized workloads."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import pytest
from helpers.oracle import hf_greedy
from helpers.sched_driver import make_scheduler, run_one, run_until_idle, submit
from helpers.sched_driver import random_prompts as prompts

from radixserve.cache.tiers import ReqTiers
from radixserve.cache.tiers.disk import SUFFIX
from radixserve.cache.tree_check import check_tree
from radixserve.cache.tree_node import HOST


def flood(sched, count: int, length: int, seed: int) -> None:
    """Unrelated prompts that push everything else out of the device pool."""
    for p in prompts(count, length, length, seed=seed):
        submit(sched, p, max_new_tokens=1)
    run_until_idle(sched)


@pytest.mark.parametrize("page_size", [1, 4])
def test_host_tier_keeps_evicted_prefixes_and_promotes_them(tiny_model_dir, page_size: int) -> None:
    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, max_total_tokens=256, host_cache_size=1024, page_size=page_size)
    system = prompts(1, 120, 120, seed=1)[0]
    first = run_one(sched, system + [7, 8, 9])
    assert first["meta"]["cached_tokens_details"] == {"device": 0, "host": 0, "disk": 0}
    flood(sched, 6, 100, seed=2)
    assert sched.tree.host_size() >= 120 // page_size * page_size
    again = system + [10, 11, 12]
    out = run_one(sched, again)
    assert out["output_ids"] == hf_greedy(folder, again, 8)
    split = out["meta"]["cached_tokens_details"]
    assert split["host"] >= 112 and split["device"] + split["host"] == out["meta"]["cached_tokens"]
    stats = sched.get_stats()
    assert stats["promoted_tokens"] >= split["host"] and stats["demoted_tokens"] > 0
    assert stats["cached_tokens_by_tier"]["host"] == split["host"]


def test_without_a_host_tier_the_same_workload_recomputes(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, max_total_tokens=256)
    system = prompts(1, 120, 120, seed=1)[0]
    run_one(sched, system + [7, 8, 9])
    flood(sched, 6, 100, seed=2)
    out = run_one(sched, system + [10, 11, 12])
    assert out["meta"]["cached_tokens"] == 0 and "cached_tokens_details" not in out["meta"]


def test_a_small_host_tier_drops_its_least_recently_used_leaves(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, max_total_tokens=200, host_cache_size=150)
    for p in prompts(8, 90, 90, seed=3):
        run_one(sched, p, 2)
    stats = sched.get_stats()
    assert stats["host_dropped_tokens"] > 0
    assert sched.tree.host_size() <= 150
    check_tree(sched.tree)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_swap_and_recompute_preemption_give_hf_greedy_tokens(tiny_model_dir, mode: str) -> None:
    folder = tiny_model_dir("llama")
    # Room for about two of the eight requests: retraction happens.
    sched = make_scheduler(folder, max_total_tokens=200, max_prefill_tokens=64, preemption_mode=mode)
    reqs = prompts(8, 30, 40, seed=4)
    rids = [submit(sched, p, max_new_tokens=100, ignore_eos=True) for p in reqs]
    results = run_until_idle(sched)
    for rid, p in zip(rids, reqs, strict=True):
        assert results[rid]["output_ids"] == hf_greedy(folder, p, 100), (mode, rid)
    stats = sched.get_stats()
    assert stats["retractions"] > 0
    if mode == "swap":
        assert stats["swapped_out_tokens"] > 0 and stats["promoted_tokens"] > 0
        assert stats["host_tokens"] == 2 * sched.pool_tokens  # sized for swapping when unset
    else:
        assert "swapped_out_tokens" not in stats


def test_swapped_requests_recompute_less_than_recomputed_ones(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    computed = {}
    for mode in ("recompute", "swap"):
        sched = make_scheduler(folder, max_total_tokens=200, max_prefill_tokens=64, preemption_mode=mode)
        for p in prompts(8, 30, 40, seed=4):
            submit(sched, p, max_new_tokens=100, ignore_eos=True)
        run_until_idle(sched)
        computed[mode] = sched.get_stats()["prefill_tokens_computed"]
    assert computed["swap"] < computed["recompute"]


def disk_sched(folder: str, path: Path, **kw):
    return make_scheduler(folder, max_total_tokens=512, disk_cache_dir=str(path), **kw)


@pytest.mark.parametrize("host", [0, 512])
def test_disk_tier_serves_prefixes_after_a_restart(tiny_model_dir, tmp_path: Path, host: int) -> None:
    folder = tiny_model_dir("llama")
    system = prompts(1, 200, 200, seed=5)[0]
    first = disk_sched(folder, tmp_path, host_cache_size=host)
    run_one(first, system + [7, 8, 9])
    first.close()
    files = list(tmp_path.glob("*/*" + SUFFIX))
    assert len(files) == 3  # 203 tokens: three full blocks of 64
    second = disk_sched(folder, tmp_path, host_cache_size=host)  # a restart: empty tree
    prompt = system + [10, 11]
    out = run_one(second, prompt)
    assert out["output_ids"] == hf_greedy(folder, prompt, 8)
    assert out["meta"]["cached_tokens"] == 192
    assert out["meta"]["cached_tokens_details"] == {"device": 0, "host": 0, "disk": 192}
    stats = second.get_stats()
    assert stats["disk_loads"] == 1 and stats["disk_loaded_tokens"] == 192
    assert stats["prefill_tokens_computed"] == len(prompt) - 192
    second.close()


def test_disk_blocks_continue_a_prefix_the_tree_still_holds(tiny_model_dir, tmp_path: Path) -> None:
    folder = tiny_model_dir("llama")
    system = prompts(1, 100, 100, seed=6)[0]
    history = prompts(1, 150, 150, seed=7)[0]
    sched = disk_sched(folder, tmp_path)
    run_one(sched, system + history + [3])
    sched.close()
    sched = disk_sched(folder, tmp_path)
    run_one(sched, system[:64] + [9, 9, 9])  # the tree holds the first block only
    prompt = system + history + [4]
    out = run_one(sched, prompt)
    assert out["output_ids"] == hf_greedy(folder, prompt, 8)
    assert out["meta"]["cached_tokens_details"] == {"device": 64, "host": 0, "disk": 128}


def test_damaged_disk_files_are_detected_and_never_loaded(tiny_model_dir, tmp_path: Path, caplog) -> None:
    folder = tiny_model_dir("llama")
    system = prompts(1, 200, 200, seed=8)[0]
    sched = disk_sched(folder, tmp_path)
    run_one(sched, system + [7])
    sched.close()
    sched = disk_sched(folder, tmp_path)
    names = sched.tiers.block_names(ReqTiers(), np.array(system), "")
    sched.close()
    paths = [next(tmp_path.glob(f"*/{n.hex()}{SUFFIX}")) for n in names]
    data = bytearray(paths[1].read_bytes())
    data[-100] ^= 0xFF  # a flipped bit in block 1's payload
    paths[1].write_bytes(bytes(data))
    paths[2].write_bytes(paths[2].read_bytes()[:1000])  # block 2 truncated
    sched = disk_sched(folder, tmp_path)
    prompt = system + [8]
    with caplog.at_level(logging.WARNING):
        out = run_one(sched, prompt)
    assert out["output_ids"] == hf_greedy(folder, prompt, 8)
    assert out["meta"]["cached_tokens"] == 64  # block 0 only: block 1 is damaged
    assert "checksum mismatch" in caplog.text
    assert sched.get_stats()["disk_corrupt_blocks"] == 1
    sched.close()  # block 1 was deleted, then computed and written again; block 2 not read yet
    caplog.clear()
    for expected, message in ((128, "payload of"), (192, None)):
        sched = disk_sched(folder, tmp_path)
        with caplog.at_level(logging.WARNING):
            out = run_one(sched, prompt)
        assert out["output_ids"] == hf_greedy(folder, prompt, 8)
        assert out["meta"]["cached_tokens"] == expected
        assert (message in caplog.text) if message else "damaged" not in caplog.text
        sched.close()
        caplog.clear()


def test_a_disk_tier_of_other_weights_or_dtype_is_ignored(tiny_model_dir, tmp_path: Path, caplog) -> None:
    system = prompts(1, 130, 130, seed=9)[0]
    sched = disk_sched(tiny_model_dir("llama"), tmp_path)
    run_one(sched, system + [7])
    sched.close()
    with caplog.at_level(logging.INFO):
        other = disk_sched(tiny_model_dir("llama-tied-llama3"), tmp_path)
    assert "belong to another model" in caplog.text
    out = run_one(other, system + [8])
    assert out["meta"]["cached_tokens"] == 0
    other.close()


def test_salts_never_share_disk_blocks(tiny_model_dir, tmp_path: Path) -> None:
    folder = tiny_model_dir("llama")
    system = prompts(1, 130, 130, seed=10)[0]
    sched = disk_sched(folder, tmp_path)
    rid = submit(sched, system + [7], req_fields={"extra_key": "tenant-a"}, max_new_tokens=2)
    run_until_idle(sched)
    sched.close()
    sched = disk_sched(folder, tmp_path)
    rid_b = submit(sched, system + [7], req_fields={"extra_key": "tenant-b"}, max_new_tokens=2)
    rid_a = submit(sched, system + [7], req_fields={"extra_key": "tenant-a"}, max_new_tokens=2)
    results = run_until_idle(sched)
    assert results[rid_b]["meta"]["cached_tokens"] == 0
    assert results[rid_a]["meta"]["cached_tokens"] == 128
    assert rid != rid_a
    sched.close()


def test_an_aborted_request_waiting_for_its_disk_load_leaves_nothing_locked(tiny_model_dir, tmp_path: Path) -> None:
    folder = tiny_model_dir("llama")
    system = prompts(1, 200, 200, seed=11)[0]
    sched = disk_sched(folder, tmp_path, host_cache_size=256)
    run_one(sched, system + [7])
    sched.close()
    sched = disk_sched(folder, tmp_path, host_cache_size=256)
    rid = submit(sched, system + [8], max_new_tokens=4)
    sched.step()  # the load starts
    assert sched.kv.loading(sched.reqs[rid])
    sched.abort(rid)
    run_until_idle(sched)
    sched.close()


@pytest.mark.parametrize("seed", range(4))
def test_tier_bookkeeping_holds_under_random_workloads(tiny_model_dir, tmp_path: Path, seed: int) -> None:
    """Shared prefixes, retraction (swap), aborts, host and disk tiers: after every step each
    page is in exactly one place (``run_until_idle`` checks free + tree + requests per pool and
    the tree's invariants), and every output equals HF greedy."""
    folder = tiny_model_dir("llama")
    rng = random.Random(seed)
    sched = make_scheduler(folder, max_total_tokens=180, max_prefill_tokens=64, page_size=rng.choice([1, 2, 4]),
                           host_cache_size=rng.choice([96, 400]), disk_cache_dir=str(tmp_path),
                           preemption_mode=rng.choice(["swap", "recompute"]),
                           radix_eviction_policy=rng.choice(["lru", "slru"]))
    bases = prompts(3, 64, 80, seed=seed)
    expected = {}
    for wave in range(3):
        rids = []
        for _ in range(5):
            p = rng.choice(bases) + prompts(1, 2, 20, seed=rng.randrange(1 << 30))[0]
            n = rng.randint(1, 24)
            rid = submit(sched, p, max_new_tokens=n, ignore_eos=True)
            expected[rid] = (p, n)
            rids.append(rid)
        victim = rng.choice(rids)
        results = run_until_idle(sched, on_step=lambda step, s, v=victim: s.abort(v) if step == 3 else None)
        for rid in rids:
            if rid == victim and results[rid]["finished"]["type"] == "abort":
                continue
            p, n = expected[rid]
            assert results[rid]["output_ids"] == hf_greedy(folder, p, n), (seed, wave, rid)
        for node in sched.tree._nodes():
            assert node.tier != HOST or node.lock_ref == 0  # idle: no host node held
    sched.close()
