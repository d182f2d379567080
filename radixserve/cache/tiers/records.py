"""The tier manager's records: a disk load in flight, a request's tier state, the counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from concurrent.futures import Future

    from radixserve.cache.tiers.disk import LoadResult
    from radixserve.cache.tree_node import TreeNode


@dataclass
class DiskLoad:
    future: Future[LoadResult]
    node: TreeNode  # deepest tree node the blocks continue (locked until the load lands)
    start: int  # index of the first block
    names: list[bytes]
    matched: int  # tokens the tree matched when the load began


@dataclass
class ReqTiers:
    """A request's tier state (``Req.kv.tiers``)."""

    names: list[bytes] = field(default_factory=list)  # its full blocks' names so far
    stored: int = 0  # leading blocks known to be on disk (written or found)
    load: DiskLoad | None = None  # a disk load in flight
    checked: bool = False  # disk looked up since the request last began to wait
    disk_tokens: int = 0  # tokens of its prefix that came from disk


@dataclass
class TierStats:
    demoted_tokens: int = 0  # device -> host (eviction)
    swapped_out_tokens: int = 0  # device -> host (swap preemption)
    promoted_tokens: int = 0  # host -> device
    host_dropped_tokens: int = 0  # host leaves evicted
    disk_loads: int = 0
    disk_loaded_tokens: int = 0
    # Time the step loop spent in one copy between tiers (demotion, promotion, disk blocks
    # landing on the device): the longest, and in all.
    copy_s_max: float = 0.0
    copy_s_total: float = 0.0
    cached_tokens: dict[str, int] = field(
        default_factory=lambda: {"device": 0, "host": 0, "disk": 0}
    )
