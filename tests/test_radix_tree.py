"""Radix tree: unit tests plus a hypothesis state machine against a brute-force prefix model."""

from __future__ import annotations

import importlib.util
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from radixserve.cache.radix_tree import EVICTION_POLICIES, SLRU_PROTECT_HITS, RadixCache, TreeNode

REPO = Path(__file__).resolve().parent.parent


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
    tree.check_invariants()


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
    tree.check_invariants()


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
    tree.check_invariants()


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
    tree.check_invariants()


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
    tree.check_invariants()


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
    tree.check_invariants()


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
    tree.check_invariants()


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
    tree.check_invariants()


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
    tree.check_invariants()


def test_evict_frees_at_least_requested_in_whole_pages():
    tree, pool = make(4)
    for i in range(5):
        tree.insert([i] * 8, np.arange(8 * i, 8 * i + 8))
    assert tree.evict(9) == 16
    assert all(len(arr) % 4 == 0 for arr in pool.freed)
    assert tree.evict(0) == 0
    tree.check_invariants()


def test_evict_after_many_touches_keeps_heap_bounded():
    tree, _ = make()
    for i in range(10):
        tree.insert([i, i], np.array([2 * i, 2 * i + 1]))
    for _ in range(1000):
        tree.match_prefix([3, 3])
    assert len(tree._heap) <= 2 * 10 + 64 + 1
    tree.check_invariants()
    assert tree.evict(20) == 20


def test_disable():
    tree, pool = make(disable=True)
    assert tree.insert([1, 2, 3], np.arange(3)) == 0
    result = tree.match_prefix([1, 2, 3])
    assert len(result.slots) == 0 and result.node is tree.root
    assert tree.total_size() == 0 and tree.evict(10) == 0
    assert len(tree.all_slots()) == 0 and not pool.freed
    tree.check_invariants()


def test_reset_drops_everything_without_freeing():
    tree, pool = make()
    tree.insert([1, 2], np.arange(2))
    tree.inc_lock_ref(tree.match_prefix([1, 2]).node)
    tree.reset()
    assert tree.total_size() == 0 and len(tree.all_slots()) == 0
    assert not pool.freed
    assert tree.evict(10) == 0
    tree.check_invariants()


def test_all_slots_and_pretty():
    tree, _ = make()
    tree.insert([1, 2, 3], np.array([7, 8, 9]))
    tree.insert([1, 5], np.array([7, 4]))
    assert sorted(tree.all_slots().tolist()) == [4, 7, 8, 9]
    text = tree.pretty()
    assert "[1]" in text and "[2, 3]" in text and "[5]" in text


def test_check_invariants_detects_corruption():
    tree, _ = make()
    tree.insert([1, 2, 3], np.arange(3))
    tree.insert([1, 2, 4], np.arange(10, 13))
    node = tree.match_prefix([1, 2, 3]).node
    node.lock_ref = 1  # without the ancestors and the size counters
    with pytest.raises(RuntimeError):
        tree.check_invariants()
    node.lock_ref = 0
    tree.check_invariants()
    node.value = np.array([0], dtype=np.int64)  # duplicate of the parent's first slot
    with pytest.raises(RuntimeError, match="two tree positions"):
        tree.check_invariants()


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
    tree.check_invariants()
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
    tree.check_invariants()


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
        self.tree.check_invariants()
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
