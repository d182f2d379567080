"""Ordering of the waiting queue (``--schedule-policy``), and preemption for priorities.

  ``lpm``         longest cached prefix first: the requests that compute least go first
  ``dfs-weight``  a depth-first walk of the tree over the waiting requests' matched paths,
                  heavier subtrees (more waiting requests under them) first, so that one branch
                  (one system prompt) is finished while it is cached (the SGLang paper's policy)
  ``fcfs``        arrival order (a retracted request rejoins at the front)
  ``lof``         longest remaining output (``max_new_tokens``) first
  ``random``      a shuffle per step, seeded by ``--random-seed``
  ``priority``    the request's ``priority``, higher values first (``--schedule-low-priority-
                  values-first`` for vLLM's order), arrival order within a level; with
                  ``--priority-preemption`` a waiting request that cannot be admitted retracts
                  running requests of lower levels

Every order is stable: requests that compare equal keep the queue's order.  The two
cache-aware policies match every waiting request against the tree each step; above
``--schedule-policy-max-queue`` waiting requests they fall back to ``fcfs`` (as SGLang does),
so a deep queue never costs a tree walk per request per step.
"""

from __future__ import annotations

import random
from collections import defaultdict

from radixserve.cache.radix_tree import TreeNode
from radixserve.scheduler.admission import reserve_tokens
from radixserve.scheduler.kv_manager import KVManager
from radixserve.scheduler.request import Req

POLICIES = ("lpm", "dfs-weight", "fcfs", "lof", "random", "priority")
CACHE_AWARE = ("lpm", "dfs-weight")


class SchedulePolicy:
    def __init__(
        self,
        policy: str,
        max_queue: int,
        seed: int = 0,
        low_priority_values_first: bool = False,
        preemption: bool = False,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"schedule_policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.max_queue = max_queue
        self._rng = random.Random(seed)
        self._sign = 1 if low_priority_values_first else -1
        self.preemption = preemption and policy == "priority"

    def rank(self, req: Req) -> int:
        """Sort key of a request's priority level: smaller goes first."""
        return self._sign * req.priority

    def order(self, waiting: list[Req], kv: KVManager) -> list[Req]:
        """The waiting requests in admission order."""
        policy = self.policy
        if len(waiting) < 2:
            return list(waiting)
        if policy in CACHE_AWARE and (kv.tree.disable or len(waiting) > self.max_queue):
            policy = "fcfs"
        if policy == "fcfs":
            return list(waiting)
        if policy == "lof":
            return sorted(waiting, key=lambda r: -(r.params.max_new_tokens - r.output_len))
        if policy == "random":
            out = list(waiting)
            self._rng.shuffle(out)
            return out
        if policy == "priority":
            return sorted(waiting, key=self.rank)
        matches = [kv.match(r) for r in waiting]
        if policy == "lpm":
            matched = {id(r): len(slots) for r, (slots, _) in zip(waiting, matches, strict=True)}
            return sorted(waiting, key=lambda r: -matched[id(r)])
        return dfs_weight_order(waiting, [node for _, node in matches])

    def preemption_victims(self, running: list[Req], waiting: list[Req], kv: KVManager,
                           max_running: int, new_token_ratio: float) -> list[Req]:
        """Running requests to retract so that the first waiting request in priority order
        fits: of strictly lower levels only, the lowest level first, the newest first within
        it.  Empty when it fits already or when retracting every lower one would not do."""
        if not self.preemption or not waiting or not running:
            return []
        top = min(waiting, key=self.rank)
        lower = sorted((r for r in running if self.rank(r) > self.rank(top)),
                       key=lambda r: (-self.rank(r), -r.admit_seq))
        if not lower:
            return []
        cached = len(kv.match(top)[0])
        need = (
            kv.pages_for(top.fill_len - cached)
            + kv.pages_for(reserve_tokens(top, new_token_ratio))
        )
        rows_short = len(running) + 1 - max_running
        pages_short = need - kv.available_pages()
        victims: list[Req] = []
        for req in lower:
            if rows_short <= 0 and pages_short <= 0:
                break
            victims.append(req)
            rows_short -= 1
            # Its own pages come back; its cached prefix stays in the tree (evictable once
            # nothing else holds it), so count its whole row.
            pages_short -= kv.pages_for(req.kv.allocated_len)
        return victims if rows_short <= 0 and pages_short <= 0 else []


def dfs_weight_order(waiting: list[Req], nodes: list[TreeNode]) -> list[Req]:
    """Depth-first over the matched paths of ``waiting`` (``nodes[i]``: the deepest tree node
    request i matched): at each node the heavier children first (weight = waiting requests in
    the subtree), then the requests that stop at the node itself, in queue order.  Only the
    paths of waiting requests are visited, not the whole tree."""
    at_node: dict[int, list[Req]] = defaultdict(list)
    weight: dict[int, int] = defaultdict(int)
    children: dict[int, dict[int, TreeNode]] = defaultdict(dict)
    roots: dict[int, TreeNode] = {}
    for req, node in zip(waiting, nodes, strict=True):
        at_node[id(node)].append(req)
        while True:
            weight[id(node)] += 1
            parent = node.parent
            if parent is None:
                roots[id(node)] = node
                break
            children[id(parent)][id(node)] = node
            node = parent
    out: list[Req] = []

    def heaviest_first(group: list[TreeNode]) -> list[TreeNode]:
        # Stable: equal weights keep first-seen (queue) order.
        return sorted(group, key=lambda n: weight[id(n)], reverse=True)

    # Popped last-in first-out: pushed in reverse so that the heaviest is visited first.
    stack = [(node, False) for node in reversed(heaviest_first(list(roots.values())))]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            out.extend(at_node.get(id(node), ()))
            continue
        stack.append((node, True))
        kids = heaviest_first(list(children.get(id(node), {}).values()))
        stack.extend((kid, False) for kid in reversed(kids))
    return out
