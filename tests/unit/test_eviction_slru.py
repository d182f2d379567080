"""``--radix-eviction-policy slru`` is textbook segmented LRU: a prefix's first use (the request
that computed it) puts it on probation, its second use (one admission that reuses it) promotes
it to the protected segment, and every probationary leaf is evicted before a protected one."""

from __future__ import annotations

import random

import numpy as np
from helpers.sched_driver import make_scheduler, run_until_idle, submit

from radixserve.cache.radix_tree import RadixCache
from radixserve.cache.tree_check import check_tree


class _Pool:
    def __init__(self) -> None:
        self.freed: list[list[int]] = []

    def free(self, slots: np.ndarray) -> None:
        self.freed.append(slots.tolist())


def test_one_reuse_protects_a_prefix_from_a_burst_of_one_offs() -> None:
    pool = _Pool()
    tree = RadixCache(1, pool.free, eviction_policy="slru")
    system = [1, 2, 3, 4]
    tree.insert(system + [90], np.arange(10, 15))  # first use: the request that computed it
    node = tree.match_prefix(system + [91]).node  # second use: one admission reuses it
    tree.record_hit(node)
    tree.insert(system + [91], np.array([10, 11, 12, 13, 15]))
    for i in range(6):  # one-off prompts, all used more recently than the system prompt
        tree.insert([50 + i, 7], np.array([20 + 2 * i, 21 + 2 * i]))
    assert tree.evict(14) == 14  # the two tails and every one-off go first
    check_tree(tree)
    assert tree.match_prefix(system).slots.tolist() == [10, 11, 12, 13]
    assert tree.evict(1) == 4  # only the protected prefix is left: it goes last
    assert pool.freed[-1] == [10, 11, 12, 13]


def test_a_prefix_used_once_stays_on_probation() -> None:
    tree = RadixCache(1, _Pool().free, eviction_policy="slru")
    tree.insert([1, 2, 3, 4], np.arange(10, 14))  # used once, never reused
    tree.insert([50, 7], np.array([20, 21]))
    tree.evict(1)
    assert tree.match_prefix([1, 2, 3, 4]).slots.tolist() == []  # LRU within probation


def test_system_prompt_sent_twice_survives_ten_one_off_prompts(tiny_model_dir) -> None:
    """The issue's scenario, scaled to the tiny model's 512-token context: a system prompt
    sent twice, then ten one-off prompts whose total is several times the pool; the third
    request that sends it finds the whole system prompt cached."""
    sched = make_scheduler(tiny_model_dir("llama"), max_total_tokens=1024,
                           radix_eviction_policy="slru")
    rng = random.Random(5)
    system = [rng.randrange(6, 256) for _ in range(128)]

    def ask(prompt: list[int]) -> int:
        rid = submit(sched, prompt, max_new_tokens=2, ignore_eos=True)
        return run_until_idle(sched)[rid]["meta"]["cached_tokens"]

    assert ask(system + [10, 11, 12]) == 0
    assert ask(system + [20, 21, 22]) == len(system)  # the second use
    for _ in range(10):
        ask([rng.randrange(6, 256) for _ in range(400)])
    assert ask(system + [30, 31, 32]) == len(system)
