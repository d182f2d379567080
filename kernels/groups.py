"""Host-side grouping for the cascade kernels (numpy only: importing it imports no Triton).

The CPU plan (``radixserve/attention/paged_plan.py``) and the Triton cascade decode
(``shared_prefix_decode.py``, through ``radixserve/attention/shared_prefix.py``) group requests
by the cached prefix they share with this one function.
"""

from __future__ import annotations

import numpy as np


def find_shared_groups(table: np.ndarray, rows: np.ndarray, prefix_lens: np.ndarray,
                       min_shared: int) -> list[tuple[np.ndarray, int]]:
    """Requests (positions into ``rows``) whose cached prefixes start with the same slots, and
    the length of the run of slots they all share (at most their shortest ``prefix_len``).

    Two rows with the same first slot share a tree path (a slot belongs to one node), so
    grouping by the first slot and measuring the common run finds the shared prefix.
    """
    candidates = np.flatnonzero(prefix_lens >= min_shared)
    if len(candidates) < 2:
        return []
    firsts = table[rows[candidates], 0]
    order = np.argsort(firsts, kind="stable")
    bounds = np.flatnonzero(np.diff(firsts[order])) + 1
    groups = []
    for members in np.split(candidates[order], bounds):
        if len(members) < 2:
            continue
        limit = int(prefix_lens[members].min())
        sub = table[rows[members], :limit]
        differs = np.flatnonzero((sub != sub[:1]).any(axis=0))
        shared = int(differs[0]) if len(differs) else limit
        if shared >= min_shared:
            groups.append((np.sort(members), shared))
    return groups
