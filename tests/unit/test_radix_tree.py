"""Radix tree: unit tests plus hypothesis state machines: one against a brute-force prefix
model, one over a fake two-tier (device + host) setup with page allocators."""

from __future__ import annotations

import importlib.util
import itertools
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from helpers.kv_events import KVIndex, sglang_block_hashes
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from radixserve.cache.allocator import PageAllocator
from radixserve.cache.eviction import EVICTION_POLICIES, SLRU_PROTECT_HITS
from radixserve.cache.kv_events import KVEventRecorder
from radixserve.cache.radix_tree import RadixCache
from radixserve.cache.tree_check import check_tree, tree_text
from radixserve.cache.tree_node import DEVICE, HOST, TreeNode

REPO = Path(__file__).resolve().parents[2]


class Pool:
    """Hands out fresh slots and records every slot the tree frees."""

    def __init__(self) -> None:
        self._next = itertools.count(100)
        self.freed: list[np.ndarray] = []

    def alloc(self, n: int) -> np.ndarray:
        return np.array([next(self._next) for _ in range(n)], dtype=np.int64)

    def free(self, slots: np.ndarray) -> None:
        self.freed.append(np.array(slots, dtype=np.int64))

    def freed_slots(self) -> list[int]:
        return sorted(int(s) for arr in self.freed for s in arr)


def make(page_size: int = 1, disable: bool = False) -> tuple[RadixCache, Pool]:
    pool = Pool()
    return RadixCache(page_size, pool.free, disable=disable), pool


def make_policy(policy: str) -> tuple[RadixCache, Pool]:
    pool = Pool()
    return RadixCache(1, pool.free, eviction_policy=policy), pool


def path_len(node: TreeNode) -> int:
    n = 0
    while node.parent is not None:
        n += len(node)
        node = node.parent
    return n


# ---------------------------------------------------------------------- unit tests


def test_empty_tree_matches_nothing():
    tree, _ = make()
    result = tree.match_prefix([1, 2, 3])
    assert len(result.slots) == 0 and result.slots.dtype == np.int64
    assert result.node is tree.root
    assert tree.total_size() == 0
    check_tree(tree)


def test_insert_returns_already_present_length():
    tree, _ = make()
    assert tree.insert([1, 2, 3, 4], np.arange(4)) == 0
    assert tree.insert([1, 2, 3, 4, 5, 6], np.arange(10, 16)) == 4
    assert tree.insert([1, 2, 9], np.arange(20, 23)) == 2
    assert tree.insert([1, 2], np.arange(30, 32)) == 2
    # The tree kept its own slots for the shared prefix and took only the new tails.
    np.testing.assert_array_equal(tree.match_prefix([1, 2, 3, 4, 5, 6]).slots, [0, 1, 2, 3, 14, 15])
    np.testing.assert_array_equal(tree.match_prefix([1, 2, 9]).slots, [0, 1, 22])
    assert tree.total_size() == 7
    check_tree(tree)


def test_match_splits_node_where_match_ends():
    tree, _ = make()
    tree.insert([1, 2, 3, 4, 5], np.arange(5))
    assert len(tree.root.children) == 1
    result = tree.match_prefix([1, 2, 3, 7])
    np.testing.assert_array_equal(result.slots, [0, 1, 2])
    assert result.node.key.tolist() == [1, 2, 3]
    (lower,) = result.node.children.values()
    assert lower.key.tolist() == [4, 5] and lower.value.tolist() == [3, 4]
    assert tree.root.children[1] is result.node
    # A match that ends exactly at the end of the key also splits.
    result = tree.match_prefix([1, 2])
    assert result.node.key.tolist() == [1, 2] and path_len(result.node) == 2
    check_tree(tree)


def test_match_returns_node_at_end_of_full_match():
    tree, _ = make()
    tree.insert([1, 2, 3], np.arange(3))
    tree.insert([1, 2, 3, 4, 5], np.arange(5))
    result = tree.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert result.slots.tolist() == [0, 1, 2, 3, 4]
    assert result.node.key.tolist() == [4, 5]
    assert not result.node.children


@pytest.mark.parametrize("page_size", [4, 16])
def test_pages_align_keys_and_splits(page_size):
    tree, _ = make(page_size)
    p = page_size
    key = list(range(3 * p + 2))  # three pages and a partial page
    assert tree.insert(key, np.arange(len(key))) == 0
    assert tree.total_size() == 3 * p  # the partial page is not cached
    # Differs inside the second page: the match stops at the first page boundary.
    other = key[: p + 1] + [999] * (2 * p)
    result = tree.match_prefix(other)
    assert result.slots.tolist() == list(range(p))
    assert len(result.node) == p
    # A short key uses only its whole pages.
    assert len(tree.match_prefix(key[: p - 1]).slots) == 0
    assert len(tree.match_prefix(key[: 2 * p + 1]).slots) == 2 * p
    # Two children whose first pages share a first token are distinct.
    assert tree.insert(other, np.arange(100, 100 + len(other))) == p
    first = tree.root.children[tuple(range(p))]
    assert set(first.children) == {tuple(key[p : 2 * p]), tuple(other[p : 2 * p])}
    for node in (first, *first.children.values()):
        assert len(node) % p == 0
    check_tree(tree)


def test_page_size_one_children_keyed_by_token():
    tree, _ = make(1)
    tree.insert([5, 6], np.arange(2))
    tree.insert([7], np.arange(2, 3))
    assert set(tree.root.children) == {5, 7}


def test_numpy_keys_and_int32_slots():
    tree, _ = make(4)
    key = np.arange(10, dtype=np.int32)
    assert tree.insert(key, np.arange(10, dtype=np.int32)) == 0
    result = tree.match_prefix(list(range(10)))
    assert result.slots.dtype == np.int64 and result.slots.tolist() == list(range(8))
    assert tree.insert(np.arange(8), np.arange(8)) == 8


def test_insert_copies_caller_slots():
    tree, _ = make()
    slots = np.arange(4)
    tree.insert([1, 2, 3, 4], slots)
    slots[:] = -1
    assert tree.match_prefix([1, 2, 3, 4]).slots.tolist() == [0, 1, 2, 3]


def test_match_returns_a_copy():
    tree, _ = make()
    tree.insert([1, 2], np.arange(2))
    tree.match_prefix([1, 2]).slots[:] = -1
    assert tree.match_prefix([1, 2]).slots.tolist() == [0, 1]


def test_insert_length_mismatch_raises():
    tree, _ = make()
    with pytest.raises(ValueError):
        tree.insert([1, 2, 3], np.arange(2))


def test_lock_moves_sizes_between_evictable_and_protected():
    tree, _ = make()
    tree.insert([1, 2, 3, 4], np.arange(4))
    tree.insert([1, 2, 5], np.arange(10, 13))
    node = tree.match_prefix([1, 2, 3, 4]).node
    assert (tree.evictable_size(), tree.protected_size()) == (5, 0)
    tree.inc_lock_ref(node)
    assert (tree.evictable_size(), tree.protected_size()) == (1, 4)
    tree.inc_lock_ref(node)
    assert (tree.evictable_size(), tree.protected_size()) == (1, 4)
    tree.dec_lock_ref(node)
    assert (tree.evictable_size(), tree.protected_size()) == (1, 4)
    tree.dec_lock_ref(node)
    assert (tree.evictable_size(), tree.protected_size()) == (5, 0)
    assert tree.total_size() == 5
    check_tree(tree)


def test_lock_root_is_noop():
    tree, _ = make()
    tree.inc_lock_ref(tree.root)
    tree.dec_lock_ref(tree.root)
    assert tree.root.lock_ref == 0


def test_dec_lock_ref_below_zero_raises():
    tree, _ = make()
    tree.insert([1, 2], np.arange(2))
    node = tree.match_prefix([1, 2]).node
    with pytest.raises(RuntimeError):
        tree.dec_lock_ref(node)
    tree.inc_lock_ref(node)
    tree.dec_lock_ref(node)
    with pytest.raises(RuntimeError):
        tree.dec_lock_ref(node)
    check_tree(tree)


def test_evict_is_lru():
    tree, pool = make()
    tree.insert([1, 1], np.array([10, 11]))
    tree.insert([2, 2], np.array([20, 21]))
    tree.insert([3, 3], np.array([30, 31]))
    tree.match_prefix([1, 1])  # 1 is now the most recently used
    assert tree.evict(1) == 2
    assert pool.freed[-1].tolist() == [20, 21]
    assert tree.evict(2) == 2
    assert pool.freed[-1].tolist() == [30, 31]
    assert tree.match_prefix([1, 1]).slots.tolist() == [10, 11]
    check_tree(tree)


def test_evict_order_follows_last_use():
    tree, pool = make()
    tree.insert([1], np.array([10]))
    tree.insert([2], np.array([20]))
    tree.match_prefix([1])
    tree.insert([3], np.array([30]))
    for _ in range(3):
        tree.evict(1)
    assert [arr.tolist() for arr in pool.freed] == [[20], [10], [30]]


def test_insert_refreshes_lru():
    tree, pool = make()
    tree.insert([1], np.array([10]))
    tree.insert([2], np.array([20]))
    tree.insert([1], np.array([99]))  # already present: touches it, takes nothing
    tree.evict(1)
    assert pool.freed[-1].tolist() == [20]


def test_locked_path_never_evicted():
    tree, pool = make()
    tree.insert([1, 2, 3], np.arange(3))
    tree.insert([1, 2, 4], np.arange(10, 13))
    tree.insert([5], np.array([20]))
    node = tree.match_prefix([1, 2, 3]).node
    tree.inc_lock_ref(node)
    assert tree.evict(100) == 2  # the [4] leaf and [5]; [1, 2] and [3] stay
    assert sorted(pool.freed_slots()) == [12, 20]
    assert tree.match_prefix([1, 2, 3]).slots.tolist() == [0, 1, 2]
    assert (tree.evictable_size(), tree.protected_size()) == (0, 3)
    tree.dec_lock_ref(node)
    assert tree.evict(100) == 3
    assert tree.total_size() == 0 and not tree.root.children
    check_tree(tree)


def test_parent_becomes_evictable_after_children():
    tree, pool = make()
    tree.insert([1, 2, 3], np.arange(3))
    tree.insert([1, 2, 4], np.arange(10, 13))  # [1, 2] -> {[3], [4]}
    assert tree.evict(1) == 1
    assert tree.evict(1) == 1
    assert tree.total_size() == 2
    assert tree.evict(1) == 2  # [1, 2] is a leaf now
    assert pool.freed_slots() == [0, 1, 2, 12]  # the tree kept its own [0, 1] for [1, 2]
    assert tree.total_size() == 0
    check_tree(tree)


def test_evict_frees_at_least_requested_in_whole_pages():
    tree, pool = make(4)
    for i in range(5):
        tree.insert([i] * 8, np.arange(8 * i, 8 * i + 8))
    assert tree.evict(9) == 16
    assert all(len(arr) % 4 == 0 for arr in pool.freed)
    assert tree.evict(0) == 0
    check_tree(tree)


def test_evict_after_many_touches_keeps_heap_bounded():
    tree, _ = make()
    for i in range(10):
        tree.insert([i, i], np.array([2 * i, 2 * i + 1]))
    for _ in range(1000):
        tree.match_prefix([3, 3])
    assert len(tree._heap) <= 2 * 10 + 64 + 1
    check_tree(tree)
    assert tree.evict(20) == 20


def test_disable():
    tree, pool = make(disable=True)
    assert tree.insert([1, 2, 3], np.arange(3)) == 0
    result = tree.match_prefix([1, 2, 3])
    assert len(result.slots) == 0 and result.node is tree.root
    assert tree.total_size() == 0 and tree.evict(10) == 0
    assert len(tree.all_slots()) == 0 and not pool.freed
    check_tree(tree)


def test_reset_drops_everything_without_freeing():
    tree, pool = make()
    tree.insert([1, 2], np.arange(2))
    tree.inc_lock_ref(tree.match_prefix([1, 2]).node)
    tree.reset()
    assert tree.total_size() == 0 and len(tree.all_slots()) == 0
    assert not pool.freed
    assert tree.evict(10) == 0
    check_tree(tree)


def test_all_slots_and_pretty():
    tree, _ = make()
    tree.insert([1, 2, 3], np.array([7, 8, 9]))
    tree.insert([1, 5], np.array([7, 4]))
    assert sorted(tree.all_slots().tolist()) == [4, 7, 8, 9]
    text = tree_text(tree)
    assert "[1]" in text and "[2, 3]" in text and "[5]" in text


def test_check_invariants_detects_corruption():
    tree, _ = make()
    tree.insert([1, 2, 3], np.arange(3))
    tree.insert([1, 2, 4], np.arange(10, 13))
    node = tree.match_prefix([1, 2, 3]).node
    node.lock_ref = 1  # without the ancestors and the size counters
    with pytest.raises(RuntimeError):
        check_tree(tree)
    node.lock_ref = 0
    check_tree(tree)
    node.value = np.array([0], dtype=np.int64)  # duplicate of the parent's first slot
    with pytest.raises(RuntimeError, match="two tree positions"):
        check_tree(tree)


def test_slru_evicts_one_off_prompts_before_a_prefix_hit_twice():
    tree, pool = make_policy("slru")
    system = [1, 2, 3, 4]
    tree.insert(system, np.arange(10, 14))
    for _ in range(2):  # two admissions reuse the system prompt
        tree.record_hit(tree.match_prefix(system).node)
    for i in range(5):  # a burst of one-off prompts, all newer than the system prompt
        tree.insert([50 + i, 1], np.array([20 + 2 * i, 21 + 2 * i]))
    assert tree.evict(10) == 10
    assert tree.match_prefix(system).slots.tolist() == [10, 11, 12, 13]
    assert tree.evict(4) == 4  # only the protected prefix is left: it goes last
    assert pool.freed[-1].tolist() == [10, 11, 12, 13]


def test_lru_evicts_the_hot_prefix_behind_newer_one_offs():
    tree, pool = make_policy("lru")
    tree.insert([1, 2, 3, 4], np.arange(10, 14))
    tree.record_hit(tree.match_prefix([1, 2, 3, 4]).node)
    tree.insert([50, 1], np.array([20, 21]))
    tree.evict(1)
    assert tree.match_prefix([1, 2, 3, 4]).slots.tolist() == []


def test_lfu_evicts_least_hit_first_then_least_recent():
    tree, _ = make_policy("lfu")
    tree.insert([1], np.array([10]))
    tree.insert([2], np.array([11]))
    tree.insert([3], np.array([12]))
    for key in ([1], [1], [3]):
        tree.record_hit(tree.match_prefix(key).node)
    tree.evict(1)  # [2]: no hits
    assert [len(tree.match_prefix([k]).slots) for k in (1, 2, 3)] == [1, 0, 1]
    tree.evict(1)  # [3]: one hit against two
    assert [len(tree.match_prefix([k]).slots) for k in (1, 3)] == [1, 0]


def test_namespaces_never_share_and_empty_ones_are_dropped():
    tree, _ = make()
    tree.insert([1, 2, 3], np.array([10, 11, 12]))
    assert tree.match_prefix([1, 2, 3], "tenant-a").slots.tolist() == []
    assert tree.insert([1, 2, 3], np.array([20, 21, 22]), "tenant-a") == 0  # its own copy
    assert tree.match_prefix([1, 2, 3], "tenant-a").slots.tolist() == [20, 21, 22]
    assert tree.match_prefix([1, 2, 3]).slots.tolist() == [10, 11, 12]
    check_tree(tree)
    assert tree.evict(6) == 6
    assert set(tree._roots) == {""}


def test_pins_hold_their_path_and_count_once():
    tree, _ = make()
    tree.insert([1, 2, 3, 4], np.arange(10, 14))
    long_node = tree.match_prefix([1, 2, 3, 4]).node
    short_node = tree.match_prefix([1, 2]).node  # splits: [1, 2] | [3, 4]
    tree.pin(long_node)
    tree.pin(short_node)
    assert tree.pinned_size() == 4 and tree.evict(4) == 0
    tree.unpin(long_node)
    assert tree.pinned_size() == 2 and tree.evict(4) == 2
    assert tree.match_prefix([1, 2, 3, 4]).slots.tolist() == [10, 11]
    tree.unpin(short_node)
    with pytest.raises(RuntimeError):
        tree.unpin(short_node)
    check_tree(tree)


def test_unknown_eviction_policy_is_refused():
    with pytest.raises(ValueError, match="eviction_policy"):
        RadixCache(1, Pool().free, eviction_policy="mru")


def test_bench_quick(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "bench_radix_tree", REPO / "bench" / "radix_tree.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "radix.json"
    report = bench.main(["--quick", "--no-progress", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    quarter = [r for r in report["results"] if r["scenario"] == "quarter"]
    assert quarter and all(r["ops"]["evict"]["calls"] > 0 for r in quarter)


# ---------------------------------------------------------------------- model-based test

# Keys are glued from a few page-sized blocks and short runs, so that keys often share whole
# pages and then part ways in the middle of a page.
PIECES = [(0, 0, 0, 0), (0, 0, 0, 1), (1, 1, 1, 1), (0,), (1,), (2,), (0, 0), (1, 2)]
tokens = st.lists(st.sampled_from(PIECES), max_size=4).map(lambda ps: [t for p in ps for t in p])


NAMESPACES = st.sampled_from(["", "salt-a"])


class RadixModel(RuleBasedStateMachine):
    """Drives a RadixCache and a brute-force model side by side.

    The model maps every cached page-aligned prefix ``(namespace, tokens)`` to the slots of
    its last page, with the page's last access and hit count. Eviction is the tree's choice;
    the model follows by dropping the pages whose slots were freed, then checks that what was
    dropped was allowed to go: a leaf, not locked, not pinned, and never of higher priority
    under the eviction policy than a leaf that stayed.
    """

    @initialize(page_size=st.sampled_from([1, 4]), policy=st.sampled_from(EVICTION_POLICIES))
    def setup(self, page_size: int, policy: str) -> None:
        self.p = page_size
        self.policy = policy
        self.pool = Pool()
        self.tree = RadixCache(page_size, self.pool.free, eviction_policy=policy)
        Page = tuple[str, tuple[int, ...]]
        self.pages: dict[Page, tuple[int, ...]] = {}
        self.owner: dict[int, Page] = {}  # first slot of a page -> its prefix
        self.given: list[int] = []
        self.caller_freed: list[int] = []
        self.locks: list[tuple[TreeNode, Page]] = []
        self.pins: list[tuple[TreeNode, Page]] = []
        self.access: dict[Page, int] = {}  # last tick that touched the page
        self.hits: dict[Page, int] = {}
        self.clock = 0

    def touch(self, ns: str, key: list[int], length: int) -> None:
        self.clock += 1
        for end in range(self.p, length + 1, self.p):
            self.access[(ns, tuple(key[:end]))] = self.clock

    def priority(self, page: tuple[str, tuple[int, ...]]) -> tuple[int, ...]:
        hits, access = self.hits.get(page, 0), self.access[page]
        return {"lru": (access,), "lfu": (hits, access), "slru": (int(hits >= SLRU_PROTECT_HITS), access)}[self.policy]

    def expected_match(self, ns: str, key: list[int]) -> tuple[int, list[int]]:
        slots: list[int] = []
        n = 0
        while n + self.p <= len(key) and (ns, tuple(key[: n + self.p])) in self.pages:
            n += self.p
            slots.extend(self.pages[(ns, tuple(key[:n]))])
        return n, slots

    @rule(key=tokens, ns=NAMESPACES)
    def insert(self, key: list[int], ns: str) -> None:
        slots = self.pool.alloc(len(key))
        self.given.extend(slots.tolist())
        expected, _ = self.expected_match(ns, key)
        cached = self.tree.insert(key, slots, ns)
        assert cached == expected
        aligned = len(key) // self.p * self.p
        for end in range(cached + self.p, aligned + 1, self.p):
            page = tuple(slots[end - self.p : end].tolist())
            self.pages[(ns, tuple(key[:end]))] = page
            self.hits[(ns, tuple(key[:end]))] = 0
            self.owner[page[0]] = (ns, tuple(key[:end]))
        self.caller_freed.extend(slots[:cached].tolist() + slots[aligned:].tolist())
        self.touch(ns, key, aligned)

    def matched(self, key: list[int], ns: str) -> tuple[TreeNode, tuple[str, tuple[int, ...]]]:
        result = self.tree.match_prefix(key, ns)
        n, slots = self.expected_match(ns, key)
        assert result.slots.tolist() == slots
        assert path_len(result.node) == n
        self.touch(ns, key, n)
        return result.node, (ns, tuple(key[:n]))

    @rule(key=tokens, ns=NAMESPACES)
    def match(self, key: list[int], ns: str) -> None:
        self.matched(key, ns)

    @rule(key=tokens, ns=NAMESPACES)
    def hit(self, key: list[int], ns: str) -> None:
        node, (ns, prefix) = self.matched(key, ns)
        self.tree.record_hit(node)
        for end in range(self.p, len(prefix) + 1, self.p):
            self.hits[(ns, prefix[:end])] += 1

    @rule(key=tokens, ns=NAMESPACES)
    def lock(self, key: list[int], ns: str) -> None:
        node, page = self.matched(key, ns)
        self.tree.inc_lock_ref(node)
        self.locks.append((node, page))

    @precondition(lambda self: self.locks)
    @rule(index=st.integers(0, 100))
    def unlock(self, index: int) -> None:
        node, _ = self.locks.pop(index % len(self.locks))
        self.tree.dec_lock_ref(node)

    @rule(key=tokens, ns=NAMESPACES)
    def pin(self, key: list[int], ns: str) -> None:
        node, page = self.matched(key, ns)
        self.tree.pin(node)
        self.pins.append((node, page))

    @precondition(lambda self: self.pins)
    @rule(index=st.integers(0, 100))
    def unpin(self, index: int) -> None:
        node, _ = self.pins.pop(index % len(self.pins))
        self.tree.unpin(node)

    @rule(num_tokens=st.integers(0, 24))
    def evict(self, num_tokens: int) -> None:
        evictable = self.tree.evictable_size()
        n_freed = len(self.pool.freed)
        freed = self.tree.evict(num_tokens)
        new = self.pool.freed[n_freed:]
        assert freed == sum(len(arr) for arr in new)
        assert freed >= num_tokens if evictable >= num_tokens else freed == evictable
        held = self.held_pages(self.locks + self.pins)
        worst_evicted: tuple[int, ...] | None = None
        for arr in new:
            assert len(arr) % self.p == 0
            for start in range(0, len(arr), self.p):
                page = self.owner.pop(int(arr[start]))
                assert page not in held
                assert self.pages.pop(page) == tuple(arr[start : start + self.p].tolist())
                prio = self.priority(page)
                worst_evicted = prio if worst_evicted is None else max(worst_evicted, prio)
                del self.access[page], self.hits[page]
        for ns, prefix in self.pages:  # only leaves went: what is left is prefix-closed
            assert len(prefix) == self.p or (ns, prefix[: -self.p]) in self.pages
        # The policy's order: nothing evicted outranks a leaf that could have gone instead
        # (a parent never ranks below its children: a touch or hit covers the whole path).
        parents = {(ns, prefix[: -self.p]) for ns, prefix in self.pages}
        if worst_evicted is not None:
            for page in self.pages:
                if page not in parents and page not in held:
                    assert self.priority(page) >= worst_evicted
        for _, page in self.locks + self.pins:
            assert not page[1] or page in self.pages

    def held_pages(self, holders: list[tuple[TreeNode, tuple[str, tuple[int, ...]]]]) -> set:
        return {
            (ns, prefix[:end])
            for _, (ns, prefix) in holders
            for end in range(self.p, len(prefix) + 1, self.p)
        }

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "tree"):
            return
        check_tree(self.tree)
        assert self.tree.protected_size() == self.p * len(self.held_pages(self.locks + self.pins))
        assert self.tree.pinned_size() == self.p * len(self.held_pages(self.pins))
        assert self.tree.total_size() == self.p * len(self.pages)
        assert self.tree.evictable_size() + self.tree.protected_size() == self.tree.total_size()
        # Nothing lost, nothing freed twice: every slot is in exactly one place (so two
        # namespaces never share one).
        accounted = self.caller_freed + self.pool.freed_slots() + self.tree.all_slots().tolist()
        assert sorted(accounted) == sorted(self.given)

    def teardown(self) -> None:
        if not hasattr(self, "tree"):
            return
        for node, _ in self.locks:
            self.tree.dec_lock_ref(node)
        for node, _ in self.pins:
            self.tree.unpin(node)
        assert self.tree.protected_size() == 0 and self.tree.pinned_size() == 0
        self.tree.evict(self.tree.total_size())
        assert self.tree.total_size() == 0 and not self.tree.root.children


RadixModel.TestCase.settings = settings(
    max_examples=600,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRadixModel = RadixModel.TestCase


# ---------------------------------------------------------------------- tiers (device + host)


class TwoTier:
    """A fake two-tier setup: device and host page allocators under a tree.

    ``kv[tier]`` maps each written slot to what it caches, ``(namespace, tokens up to and
    including its token)``; ``demote`` and promotion copy it across tiers as the real pools
    copy KV, so a tree node's slots can be checked against the tokens of its path.
    """

    def __init__(self, page_size: int, device_pages: int, host_pages: int, policy: str = "lru") -> None:
        self.p = page_size
        self.dev = PageAllocator(device_pages, page_size)
        self.host = PageAllocator(host_pages, page_size)
        self.kv: dict[str, dict[int, tuple[str, tuple[int, ...]]]] = {DEVICE: {}, HOST: {}}
        self.refuse = False  # demote gives no host slots (as with the host tier off)
        self.tree = RadixCache(page_size, self.free_device, eviction_policy=policy,
                               demote=self.demote, free_host_slots=self.free_host,
                               events=KVEventRecorder(page_size))
        self.index = KVIndex()  # what a router learns from the tree's KV events

    def free_device(self, slots: np.ndarray) -> None:
        self.dev.free_slots(slots)  # raises on a double free
        for s in slots.tolist():
            self.kv[DEVICE].pop(s, None)

    def free_host(self, slots: np.ndarray) -> None:
        self.host.free_slots(slots)
        for s in slots.tolist():
            self.kv[HOST].pop(s, None)

    def demote(self, node: TreeNode) -> np.ndarray | None:
        # Only an unlocked, unpinned device leaf may leave the device.
        assert node.tier == DEVICE and node.lock_ref == 0 and node.pin_ref == 0
        assert not node.has_device_child() and node.parent is not None
        if self.refuse:
            return None
        pages = len(node.value) // self.p
        short = pages - self.host.num_free_pages
        if short > 0:
            self.tree.evict_host(short * self.p)
        slots = self.host.alloc_pages(pages)
        if slots is None:
            return None
        self.copy(DEVICE, node.value, HOST, slots)
        return slots

    def copy(self, src: str, src_slots: np.ndarray, dst: str, dst_slots: np.ndarray) -> None:
        for a, b in zip(src_slots.tolist(), dst_slots.tolist(), strict=True):
            self.kv[dst][b] = self.kv[src][a]

    def alloc(self, tier: str, n_tokens: int) -> np.ndarray | None:
        """Slots of the whole pages that cover ``n_tokens``, evicting from ``tier`` first when
        short; None when still short."""
        pages = -(-n_tokens // self.p)
        alloc = self.dev if tier == DEVICE else self.host
        short = pages - alloc.num_free_pages
        if short > 0:
            (self.tree.evict if tier == DEVICE else self.tree.evict_host)(short * self.p)
        return alloc.alloc_pages(pages)

    def write(self, tier: str, key: list[int], slots: np.ndarray, ns: str = "") -> None:
        for i, s in enumerate(slots[: len(key)].tolist()):
            self.kv[tier][s] = (ns, tuple(key[: i + 1]))

    def labels(self, tier: str, slots: np.ndarray) -> list:
        return [self.kv[tier].get(s) for s in slots.tolist()]

    def release(self, tier: str, key: list[int], slots: np.ndarray, cached: int) -> None:
        """Free what the caller keeps after ``insert``: its duplicates ``[0, cached)`` and the
        partial last page."""
        aligned = len(key) // self.p * self.p
        (self.free_device if tier == DEVICE else self.free_host)(
            np.concatenate([slots[:cached], slots[aligned:]]))

    def insert(self, key: list[int], ns: str = "", tier: str = DEVICE) -> int | None:
        """Compute (device) or load (host) ``key``'s KV into fresh pages and insert it; None
        when no pages could be had."""
        slots = self.alloc(tier, len(key))
        if slots is None:
            return None
        self.write(tier, key, slots, ns)
        cached = self.tree.insert(key, slots[: len(key)], ns, tier)
        self.release(tier, key, slots, cached)
        return cached

    def promote(self, key: list[int], ns: str = "", budget: int | None = None):
        """Match ``key`` and promote its host nodes top down, as many as ``budget`` device pages
        allow, the way the KV manager does: lock the path, evict device pages for it, copy,
        ``promote`` each.  Returns the match and the device slots given to the promoted part."""
        r = self.tree.match_prefix(key, ns)
        if not r.host_nodes:
            return r, np.empty(0, dtype=np.int64)
        self.tree.inc_lock_ref(r.host_nodes[-1])
        take, pages = [], 0
        for node in r.host_nodes:
            need = len(node.value) // self.p
            if budget is not None and pages + need > budget:
                break
            take.append(node)
            pages += need
        device = self.alloc(DEVICE, pages * self.p) if take else None
        self.tree.dec_lock_ref(r.host_nodes[-1])
        if device is None:
            return r, np.empty(0, dtype=np.int64)
        at = 0
        for node in take:
            n = len(node.value)
            self.copy(HOST, node.value, DEVICE, device[at : at + n])
            self.tree.promote(node, device[at : at + n])
            at += n
        return r, device

    def check(self, held: Sequence[np.ndarray] = ()) -> None:
        """Tree invariants; every node's slots cache its own tokens; no device node below a
        host node; every used page of each tier is held exactly once (the tree, or ``held``
        for device pages of requests), every other page is free."""
        tree = self.tree
        check_tree(tree)
        for ns, root in tree._roots.items():
            stack = [(child, ()) for child in root.children.values()]
            while stack:
                node, prefix = stack.pop()
                assert node.tier in (DEVICE, HOST)
                if node.tier == DEVICE:
                    assert node.parent.parent is None or node.parent.tier == DEVICE
                path = prefix + tuple(node.key.tolist())
                expected = [(ns, path[: i + 1]) for i in range(len(prefix), len(path))]
                assert self.labels(node.tier, node.value) == expected
                stack.extend((child, path) for child in node.children.values())
        for tier, alloc, extra in ((DEVICE, self.dev, list(held)), (HOST, self.host, [])):
            slots = np.concatenate([tree.all_slots(tier), *extra])
            assert len(np.unique(slots)) == len(slots), f"a {tier} slot is held twice"
            pages = np.unique(slots // self.p)
            assert len(slots) == len(pages) * self.p, f"a {tier} page is held in part"
            assert pages.tolist() == alloc.used_pages().tolist(), f"{tier} pages leaked or freed while held"
        assert tree.host_size() == len(tree.all_slots(HOST))
        self.check_events()

    def check_events(self) -> None:
        """The KV events so far, applied in order, tell a router exactly the blocks each tier
        holds, under SGLang's hashes of each node's path (salted per namespace)."""
        for event in self.tree.events.take():
            self.index.apply(event)
        expected: dict[str, set[int]] = {}
        medium = {DEVICE: "GPU", HOST: "CPU_PINNED"}
        for ns, root in self.tree._roots.items():
            stack = [(child, ()) for child in root.children.values()]
            while stack:
                node, prefix = stack.pop()
                path = prefix + tuple(node.key.tolist())
                hashes = sglang_block_hashes(path, self.p, ns)
                expected.setdefault(medium[node.tier], set()).update(hashes[len(prefix) // self.p:])
                stack.extend((child, path) for child in node.children.values())
        assert self.index.held() == {m: h for m, h in expected.items() if h}
        # A subscriber that starts now, from a snapshot of the tree, knows the same.
        fresh = KVIndex()
        for event in self.tree.events.snapshot(self.tree._roots, self.tree._nodes()):
            fresh.apply(event)
        assert fresh.held() == self.index.held()


def expect_labels(ns: str, key: Sequence[int], start: int, stop: int) -> list:
    return [(ns, tuple(key[: i + 1])) for i in range(start, stop)]


def peek(tree: RadixCache, key: Sequence[int], ns: str = "") -> tuple[int, int]:
    """(device tokens, host tokens) of the cached page-aligned prefix of ``key``, found
    without touching the tree (no split, no access time)."""
    p = tree.page_size
    aligned = len(key) // p * p
    node, pos, dev, host = tree._roots.get(ns), 0, 0, 0
    while node is not None and pos < aligned:
        best, best_n = None, 0
        for child in node.children.values():
            ck = child.key.tolist()
            n = 0
            while n < len(ck) and pos + n < aligned and ck[n] == key[pos + n]:
                n += 1
            n -= n % p
            if n > best_n:
                best, best_n = child, n
        if best is None:
            break
        if best.tier == DEVICE:
            assert host == 0, "device node below a host node"
            dev += best_n
        else:
            host += best_n
        pos += best_n
        node = best if best_n == len(best) else None
    return dev, host


def in_tree(tree: RadixCache, node: TreeNode) -> bool:
    while node.parent is not None:
        if not any(child is node for child in node.parent.children.values()):
            return False
        node = node.parent
    return any(root is node for root in tree._roots.values())


@pytest.mark.parametrize("page_size", [1, 4])
def test_tiers_promotion_keeps_token_coverage(page_size):
    p = page_size
    tt = TwoTier(p, device_pages=16, host_pages=16)
    tree = tt.tree
    key = list(range(1, 4 * p + 1))  # four pages
    assert tt.insert(key) == 0
    tree.match_prefix(key[:p])  # split: [page 0] | [pages 1..3]
    tree.match_prefix(key[: 2 * p])  # split again: [page 0] | [page 1] | [pages 2..3]
    before = tree.match_prefix(key).slots
    assert tree.evict(3 * p) == 3 * p  # pages 2..3 to the host, then page 1
    assert (tree.total_size(), tree.host_size()) == (p, 3 * p)
    tt.check()
    r = tree.match_prefix(key)
    assert len(r.slots) == p and [len(n) for n in r.host_nodes] == [p, 2 * p]
    assert tt.labels(HOST, np.concatenate([n.value for n in r.host_nodes])) == expect_labels("", key, p, 4 * p)
    # Promoting out of order is refused.
    with pytest.raises(RuntimeError, match="promote"):
        tree.promote(r.host_nodes[1], np.arange(2 * p))
    r, device = tt.promote(key)
    assert len(device) == 3 * p
    tt.check()
    after = tree.match_prefix(key)
    assert after.host_nodes == () and path_len(after.node) == 4 * p
    np.testing.assert_array_equal(after.slots, np.concatenate([r.slots, device]))
    assert tt.labels(DEVICE, after.slots) == tt.labels(DEVICE, before) == expect_labels("", key, 0, 4 * p)
    assert (tree.total_size(), tree.host_size()) == (4 * p, 0)
    assert tt.host.num_free_pages == 16  # the host copies went back
    tt.check()
    # The promoted leaf is the device leaf now: evictable again, first.
    assert tree.evict(1) == 2 * p and tree.host_size() == 2 * p
    tt.check()


@pytest.mark.parametrize("page_size", [1, 4])
def test_tiers_device_insert_adopts_host_path(page_size):
    p = page_size
    tt = TwoTier(p, device_pages=16, host_pages=16)
    tree = tt.tree
    key = list(range(1, 3 * p + 1))
    assert tt.insert(key) == 0
    tree.match_prefix(key[:p])  # [page 0] | [pages 1..2]
    assert tree.evict(1) == 2 * p
    top = tree.match_prefix(key[:p]).node
    (host_node,) = top.children.values()
    assert host_node.tier == HOST and len(host_node) == 2 * p
    host_slots = host_node.value.copy()
    tt.check()
    # The same prompt and one more page, computed again on the device.
    longer = key + list(range(100, 100 + p)) + [7] * (p - 1)  # and a partial page
    slots = tt.alloc(DEVICE, len(longer))
    tt.write(DEVICE, longer, slots)
    cached = tree.insert(longer, slots[: len(longer)])
    assert cached == p  # where the host part began, not where the match ended
    assert tree.host_size() == 0 and tree.total_size() == 4 * p
    assert tt.host._is_free[host_slots[::p] // p].all() and tt.host.num_free_pages == 16
    assert host_node.tier == DEVICE and host_node.value.tolist() == slots[p : 3 * p].tolist()
    tt.release(DEVICE, longer, slots, cached)
    r = tree.match_prefix(longer)
    assert r.host_nodes == ()
    np.testing.assert_array_equal(r.slots[p:], slots[p : 4 * p])  # the adopted part holds ours
    assert tt.labels(DEVICE, r.slots) == expect_labels("", longer, 0, 4 * p)
    tt.check()


@pytest.mark.parametrize("page_size", [1, 4])
def test_tiers_host_insert_adds_only_missing_tokens(page_size):
    p = page_size
    tt = TwoTier(p, device_pages=16, host_pages=16)
    tree = tt.tree
    key = list(range(1, 4 * p + 1))
    assert tt.insert(key[: 2 * p]) == 0
    assert tt.insert(key[:p] + [99] * p) == p  # [page 0] -> {[page 1], [99...]}
    tree.match_prefix(key[:p])
    assert tree.evict(p) == p  # the older leaf, [page 1], goes to the host
    assert peek(tree, key) == (p, p)
    assert tt.insert(key, tier=HOST) == 2 * p  # a disk load: only pages 2..3 are new
    assert peek(tree, key) == (p, 3 * p)
    assert (tree.total_size(), tree.host_size()) == (2 * p, 3 * p)
    assert tt.host.num_free_pages == 16 - 3
    tt.check()
    # A host load of what is all cached takes nothing.
    assert tt.insert(key[: 2 * p], tier=HOST) == 2 * p
    assert tt.host.num_free_pages == 16 - 3
    tt.check()


@pytest.mark.parametrize("page_size", [1, 4])
def test_tiers_refused_demote_drops_node_and_host_subtree(page_size):
    p = page_size
    tt = TwoTier(p, device_pages=16, host_pages=16)
    tree = tt.tree
    a, b = list(range(1, 3 * p + 1)), list(range(1, p + 1)) + list(range(50, 50 + 2 * p))
    tt.insert(a)
    tt.insert(b)  # [page 0] -> {a's pages 1..2, b's pages 1..2}
    tree.match_prefix(a[: 2 * p])  # a: [page 1] | [page 2]
    assert tree.evict(4 * p) == 4 * p  # everything below page 0 goes to the host
    assert (tree.total_size(), tree.host_size()) == (p, 4 * p)
    tt.check()
    top = tree.match_prefix(a[:p]).node
    assert len(top) == p and top.tier == DEVICE and len(top.children) == 2
    tt.refuse = True
    freed_before = tt.host.num_free_pages
    assert tree.evict(1) == p
    assert tree.total_size() == 0 and tree.host_size() == 0 and not tree.root.children
    assert tt.host.num_free_pages == freed_before + 4 and tt.dev.num_free_pages == 16
    assert top.parent is None
    tt.check()


def test_tiers_locked_host_path_survives_host_pressure():
    tt = TwoTier(1, device_pages=8, host_pages=2)
    tree = tt.tree
    tt.insert([1, 2])
    assert tree.evict(2) == 2  # [1, 2] on the host
    r = tree.match_prefix([1, 2])
    tree.inc_lock_ref(r.host_nodes[-1])  # a swapped-out request's hold
    tt.insert([3, 4])
    assert tree.evict(2) == 2  # no host room: [3, 4] is dropped instead
    assert peek(tree, [1, 2]) == (0, 2) and peek(tree, [3, 4]) == (0, 0)
    assert tree.evict_host(10) == 0
    tt.check()
    tree.dec_lock_ref(r.host_nodes[-1])
    assert tree.evict_host(10) == 2 and tt.host.num_free_pages == 2
    tt.check()


def test_tiers_demote_path_stops_at_a_shared_or_locked_node():
    tt = TwoTier(1, device_pages=16, host_pages=16)
    tree = tt.tree
    tt.insert([1, 2, 3, 4])
    tt.insert([1, 2, 9])  # [1, 2] -> {[3, 4], [9]}
    tip = tree.match_prefix([1, 2, 3, 4]).node
    assert tree.demote_path(tip) == 2  # [3, 4] only: [1, 2] still has the device child [9]
    assert peek(tree, [1, 2, 3, 4]) == (2, 2) and peek(tree, [1, 2, 9]) == (3, 0)
    tt.check()
    other = tree.match_prefix([1, 2, 9]).node
    tree.inc_lock_ref(other)
    assert tree.demote_path(other) == 0
    tree.dec_lock_ref(other)
    assert tree.demote_path(other) == 3  # [9], then [1, 2]
    assert tree.total_size() == 0 and tree.host_size() == 5
    tt.check()


def test_tiers_device_leaf_above_host_part_stays_evictable_after_match():
    """A match (or a host insert) through an unlocked device leaf into its host children
    touches the leaf; it must stay in the eviction heap with its new priority."""
    tt = TwoTier(1, device_pages=8, host_pages=8)
    tree = tt.tree
    tt.insert([1, 2])
    tree.match_prefix([1])  # [1] | [2]
    assert tree.evict(1) == 1  # [2] to the host; [1] is a device leaf
    tt.check()
    tree.match_prefix([1, 2])
    tt.check()
    assert tree.evict(1) == 1
    tt2 = TwoTier(1, device_pages=8, host_pages=8)
    tt2.insert([1])
    assert tt2.insert([1, 2], tier=HOST) == 1
    tt2.check()
    assert tt2.tree.evict(1) == 1


# A few prompts that share pages and part inside a page (and inside a page-sized node), cut
# at any length, so that requests keep meeting each other's prefixes on both tiers.
PROMPTS = [
    (0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
    (0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 5, 5, 3, 3, 3, 3),
    (0, 0, 0, 0, 1, 1, 1, 1, 6, 6, 6, 6),
    (0, 0, 0, 0, 7, 7, 7, 7, 2, 2, 2, 2),
    (9, 9, 9, 9, 1, 1, 1, 1),
]
tier_keys = st.tuples(st.sampled_from(PROMPTS), st.integers(1, 16)).map(lambda t: list(t[0][: t[1]]))


class TieredRadixModel(RuleBasedStateMachine):
    """Drives a RadixCache with a device and a host tier over small page allocators.

    The tree's own choices (what to evict, demote, drop) are not predicted; instead, after
    every step, :meth:`TwoTier.check` proves that no page of either tier is lost or held
    twice, that every node's slots hold the KV of its own tokens (so demotion, promotion and
    adoption moved the right data), that device nodes sit above host nodes, and that every
    node the test locks or pins is still in the tree (pinned or device-locked: on the device).
    """

    @initialize(page_size=st.sampled_from([1, 4]), policy=st.sampled_from(EVICTION_POLICIES))
    def setup(self, page_size: int, policy: str) -> None:
        device_pages, host_pages = (24, 12) if page_size == 1 else (8, 4)
        self.p = page_size
        self.t = TwoTier(page_size, device_pages, host_pages, policy)
        self.tree = self.t.tree
        self.running: list[tuple[list[int], str, np.ndarray]] = []  # computed KV, not inserted
        self.locks: list[tuple[TreeNode, str]] = []  # node and its tier when locked
        self.pins: list[TreeNode] = []

    def aligned(self, key: list[int]) -> int:
        return len(key) // self.p * self.p

    def matched(self, key: list[int], ns: str):
        dev, host = peek(self.tree, key, ns)
        r = self.tree.match_prefix(key, ns)
        assert path_len(r.node) == dev and r.host_len == host
        assert r.node.parent is None or r.node.tier == DEVICE
        assert self.t.labels(DEVICE, r.slots) == expect_labels(ns, key, 0, dev)
        parent = r.node
        for node in r.host_nodes:
            assert node.tier == HOST and node.parent is parent
            parent = node
        host_slots = np.concatenate([np.empty(0, dtype=np.int64), *(n.value for n in r.host_nodes)])
        assert self.t.labels(HOST, host_slots) == expect_labels(ns, key, dev, dev + host)
        return r

    @precondition(lambda self: len(self.running) < 2)
    @rule(key=tier_keys, ns=NAMESPACES)
    def compute(self, key: list[int], ns: str) -> None:
        """A request computes its KV into fresh device pages (evicting for them)."""
        slots = self.t.alloc(DEVICE, len(key))
        if slots is not None:
            self.t.write(DEVICE, key, slots, ns)
            self.running.append((key, ns, slots))

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100))
    def finish(self, index: int) -> None:
        """The request's KV goes into the tree (device tier); it frees the duplicates."""
        key, ns, slots = self.running.pop(index % len(self.running))
        dev, _ = peek(self.tree, key, ns)
        cached = self.tree.insert(key, slots[: len(key)], ns)
        assert cached == dev  # a host part on the path is adopted, not "already cached"
        assert peek(self.tree, key, ns) == (self.aligned(key), 0)
        self.t.release(DEVICE, key, slots, cached)

    @rule(key=tier_keys, ns=NAMESPACES, swap_out=st.booleans())
    def serve(self, key: list[int], ns: str, swap_out: bool) -> None:
        """A whole request: compute and insert; if retracted (``swap_out``), its path leaves
        the device as far as no one else holds it."""
        if len(self.running) < 2:
            self.compute(key, ns)
            if self.running and self.running[-1][0] is key:
                self.finish(len(self.running) - 1)
                if swap_out:
                    self.demote_path(key, ns)

    @rule(key=tier_keys, ns=NAMESPACES)
    def load_host(self, key: list[int], ns: str) -> None:
        """KV read into host pages (a disk hit) goes in with tier=HOST."""
        slots = self.t.alloc(HOST, len(key))
        if slots is None:
            return
        self.t.write(HOST, key, slots, ns)
        dev, host = peek(self.tree, key, ns)
        cached = self.tree.insert(key, slots[: len(key)], ns, tier=HOST)
        assert cached == dev + host
        assert peek(self.tree, key, ns) == (dev, self.aligned(key) - dev)
        self.t.release(HOST, key, slots, cached)

    @rule(key=tier_keys, ns=NAMESPACES, hold_host=st.booleans())
    def lock(self, key: list[int], ns: str, hold_host: bool) -> None:
        r = self.matched(key, ns)
        node = r.host_nodes[-1] if hold_host and r.host_nodes else r.node
        if node.parent is not None:
            self.tree.inc_lock_ref(node)
            self.locks.append((node, node.tier))

    @precondition(lambda self: self.locks)
    @rule(index=st.integers(0, 100))
    def unlock(self, index: int) -> None:
        node, _ = self.locks.pop(index % len(self.locks))
        self.tree.dec_lock_ref(node)

    @rule(key=tier_keys, ns=NAMESPACES)
    def pin(self, key: list[int], ns: str) -> None:
        node = self.matched(key, ns).node
        if node.parent is not None:
            self.tree.pin(node)
            self.pins.append(node)

    @precondition(lambda self: self.pins)
    @rule(index=st.integers(0, 100))
    def unpin(self, index: int) -> None:
        self.tree.unpin(self.pins.pop(index % len(self.pins)))

    @rule(key=tier_keys, ns=NAMESPACES)
    def hit(self, key: list[int], ns: str) -> None:
        self.tree.record_hit(self.matched(key, ns).node)

    @rule(key=tier_keys, ns=NAMESPACES, budget=st.none() | st.integers(0, 6))
    def promote(self, key: list[int], ns: str, budget: int | None) -> None:
        dev, host = peek(self.tree, key, ns)
        r, device = self.t.promote(key, ns, budget)
        n = len(device)
        assert peek(self.tree, key, ns) == (dev + n, host - n)  # the locked path stayed put
        self.consistent()  # before the match below touches (and re-queues) the path
        after = self.matched(key, ns)
        np.testing.assert_array_equal(after.slots, np.concatenate([r.slots, device]))

    @rule(num_tokens=st.integers(0, 12))
    def evict(self, num_tokens: int) -> None:
        evictable, total = self.tree.evictable_size(), self.tree.total_size()
        freed = self.tree.evict(num_tokens)
        assert total - self.tree.total_size() == freed
        assert freed >= num_tokens if evictable >= num_tokens else freed == evictable

    @rule(num_tokens=st.integers(0, 12))
    def evict_host(self, num_tokens: int) -> None:
        host = self.tree.host_size()
        freed = self.tree.evict_host(num_tokens)
        assert host - self.tree.host_size() == freed
        if freed < num_tokens:  # then no unlocked host leaf is left
            assert not any(n.tier == HOST and not n.children and not n.lock_ref for n in self.tree._nodes())

    @rule(key=tier_keys, ns=NAMESPACES)
    def demote_path(self, key: list[int], ns: str) -> None:
        """A retracted request's path is swapped out as far as no one else holds it."""
        node = self.matched(key, ns).node
        total, length = self.tree.total_size(), path_len(node)
        moved = self.tree.demote_path(node)
        assert total - self.tree.total_size() == moved <= length

    @rule(refuse=st.booleans())
    def host_refuses(self, refuse: bool) -> None:
        self.t.refuse = refuse

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "t"):
            return
        self.t.check(held=[slots for _, _, slots in self.running])
        for node, tier in self.locks:
            assert in_tree(self.tree, node), f"locked {node!r} left the tree"
            assert tier == HOST or node.tier == DEVICE, f"locked {node!r} left the device"
        for node in self.pins:
            assert in_tree(self.tree, node) and node.tier == DEVICE, f"pinned {node!r} moved"

    def teardown(self) -> None:
        if not hasattr(self, "t"):
            return
        for node, _ in self.locks:
            self.tree.dec_lock_ref(node)
        for node in self.pins:
            self.tree.unpin(node)
        for _, _, slots in self.running:
            self.t.free_device(slots)
        for _ in range(100):
            if not (self.tree.total_size() or self.tree.host_size()):
                break
            self.tree.evict(self.tree.total_size())
            self.tree.evict_host(self.tree.host_size())
        assert self.tree.total_size() == 0 and self.tree.host_size() == 0
        assert self.t.dev.num_free_pages == self.t.dev.num_pages
        assert self.t.host.num_free_pages == self.t.host.num_pages
        self.t.check()


TieredRadixModel.TestCase.settings = settings(
    max_examples=600,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestTieredRadixModel = TieredRadixModel.TestCase
