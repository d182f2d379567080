"""An 8-bit KV pool in the scheduler with a tiny model: the radix tree, the host and disk tiers,
swap and recompute retraction keep working (the memory invariant is checked after every step by
``run_until_idle``), and the tokens equal those of the same 8-bit pool serving each request alone.
Accuracy against the model's dtype is measured on the default model by ``bench/kv_quant.py``."""

from __future__ import annotations

import logging
import random
from functools import cache
from pathlib import Path

import pytest
from helpers.sched_driver import make_scheduler, run_one, run_until_idle, submit
from helpers.sched_driver import random_prompts as prompts

from radixserve.cache.kv_pool import kv_bytes_per_token

QUANT = ("int8", "fp8_e4m3")




@cache
def _alone(folder: str, kv: str, prompt: tuple[int, ...], n: int) -> list[int]:
    """The request served alone by an 8-bit pool large enough to never evict."""
    sched = make_scheduler(folder, max_total_tokens=4096, kv_cache_dtype=kv)
    return run_one(sched, list(prompt), n)["output_ids"]


def alone(folder: str, kv: str, prompt: list[int], n: int) -> list[int]:
    return _alone(folder, kv, tuple(prompt), n)


@pytest.mark.parametrize("kv", QUANT)
def test_pool_size_and_info_count_the_8bit_element(tiny_model_dir, kv: str) -> None:
    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, max_total_tokens=256, kv_cache_dtype=kv)
    pool = sched.runner.kv_pool
    assert pool.store_dtype.itemsize == 1 and pool.dtype.itemsize == 4
    info = sched.info(tokenizer_path=folder, torch_threads=1)
    assert info.kv_cache_dtype == kv
    assert info.kv_cache_bytes_per_token == pool.bytes_per_token
    cfg = sched.model_config
    full = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, pool.dtype)
    assert full / pool.bytes_per_token >= 3.5  # float32 model: about 4x the tokens per byte


@pytest.mark.parametrize("kv", QUANT)
def test_prefix_hits_read_the_8bit_prefix(tiny_model_dir, kv: str) -> None:
    """A request whose prompt continues a cached one reads the cached 8-bit KV and answers as
    it does alone (where it computes that KV itself)."""
    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, max_total_tokens=1024, kv_cache_dtype=kv)
    system = prompts(1, 90, 90, seed=1)[0]
    run_one(sched, system + [7, 8])
    again = system + [9, 10, 11]
    out = run_one(sched, again, 12)
    assert out["meta"]["cached_tokens"] >= 90
    assert out["output_ids"] == alone(folder, kv, again, 12)


@pytest.mark.parametrize("page_size", [1, 4])
def test_host_tier_moves_the_8bit_kv_and_its_scales(tiny_model_dir, page_size: int) -> None:
    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, max_total_tokens=256, host_cache_size=1024, page_size=page_size,
                           kv_cache_dtype="int8")
    assert sched.tiers.host_pool.kv_cache_dtype == "int8"
    system = prompts(1, 120, 120, seed=1)[0]
    run_one(sched, system + [7, 8, 9])
    for p in prompts(6, 100, 100, seed=2):  # push the prefix out of the device pool
        run_one(sched, p, 1)
    again = system + [10, 11, 12]
    out = run_one(sched, again)
    assert out["meta"]["cached_tokens_details"]["host"] >= 112
    assert out["output_ids"] == alone(folder, "int8", again, 8)


@pytest.mark.parametrize("kv", QUANT)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_retraction_with_an_8bit_pool(tiny_model_dir, mode: str, kv: str) -> None:
    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, max_total_tokens=200, max_prefill_tokens=64, preemption_mode=mode,
                           kv_cache_dtype=kv)
    reqs = prompts(8, 30, 40, seed=4)  # room for about two of them: retraction happens
    rids = [submit(sched, p, max_new_tokens=100, ignore_eos=True) for p in reqs]
    results = run_until_idle(sched)
    assert sched.get_stats()["retractions"] > 0
    for rid, p in zip(rids, reqs, strict=True):
        assert results[rid]["output_ids"] == alone(folder, kv, p, 100), (mode, rid)


def test_disk_tier_of_an_8bit_pool_survives_a_restart_and_keeps_to_its_dtype(
        tiny_model_dir, tmp_path: Path, caplog) -> None:
    folder = tiny_model_dir("llama")
    system = prompts(1, 200, 200, seed=5)[0]
    first = make_scheduler(folder, max_total_tokens=512, disk_cache_dir=str(tmp_path), kv_cache_dtype="int8")
    run_one(first, system + [7, 8, 9])
    first.close()
    second = make_scheduler(folder, max_total_tokens=512, disk_cache_dir=str(tmp_path), kv_cache_dtype="int8")
    prompt = system + [10, 11]
    out = run_one(second, prompt)
    assert out["meta"]["cached_tokens_details"] == {"device": 0, "host": 0, "disk": 192}
    assert out["output_ids"] == alone(folder, "int8", prompt, 8)
    second.close()
    # A pool of another KV dtype never reads these blocks (its identity differs).
    with caplog.at_level(logging.INFO):
        other = make_scheduler(folder, max_total_tokens=512, disk_cache_dir=str(tmp_path), kv_cache_dtype="fp8_e4m3")
    assert "belong to another model, dtype or layout" in caplog.text
    assert run_one(other, prompt)["meta"]["cached_tokens"] == 0
    other.close()


@pytest.mark.parametrize("seed", range(2))
def test_tier_bookkeeping_holds_with_an_8bit_pool(tiny_model_dir, tmp_path: Path, seed: int) -> None:
    """Shared prefixes, retraction, aborts, host and disk tiers over an int8 pool: every page in
    exactly one place after every step, nothing locked when idle, outputs as served alone."""
    folder = tiny_model_dir("llama")
    rng = random.Random(seed)
    sched = make_scheduler(folder, max_total_tokens=180, max_prefill_tokens=64, page_size=rng.choice([1, 2, 4]),
                           host_cache_size=rng.choice([96, 400]), disk_cache_dir=str(tmp_path),
                           preemption_mode=rng.choice(["swap", "recompute"]), kv_cache_dtype="int8")
    bases = prompts(3, 64, 80, seed=seed)
    for _wave in range(2):
        expected = {}
        for _ in range(5):
            p = rng.choice(bases) + prompts(1, 2, 20, seed=rng.randrange(1 << 30))[0]
            n = rng.randint(1, 24)
            expected[submit(sched, p, max_new_tokens=n, ignore_eos=True)] = (p, n)
        victim = rng.choice(list(expected))
        results = run_until_idle(sched, on_step=lambda step, s, v=victim: s.abort(v) if step == 3 else None)
        for rid, (p, n) in expected.items():
            if rid == victim and results[rid]["finished"]["type"] == "abort":
                continue
            assert results[rid]["output_ids"] == alone(folder, "int8", p, n), (seed, rid)
    sched.close()


def test_speculative_decoding_over_an_8bit_pool(tiny_model_dir) -> None:
    """n-gram drafts verified through the 8-bit pool: the same greedy tokens as without
    speculation, and the rejected drafts' slots freed (the memory invariant)."""
    folder = tiny_model_dir("llama")
    base = prompts(1, 40, 40, seed=12)[0]
    prompt = base + base[:20] + base + base[:10]  # text that repeats: drafts are found
    plain = alone(folder, "int8", prompt, 40)
    sched = make_scheduler(folder, max_total_tokens=1024, kv_cache_dtype="int8", speculative_algorithm="ngram",
                           speculative_disable_by_batch_size=8)
    out = run_one(sched, prompt, 40)
    assert out["output_ids"] == plain
    assert out["meta"]["spec_num_correct_drafts"] > 0
