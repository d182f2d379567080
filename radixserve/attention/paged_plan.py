"""The per-step plan of the C++ paged-attention kernel, built on the host from the batch.

The kernel (``cpu_ext/paged_attention.cpp``) runs *jobs*; each job reads one table row's key
columns ``[kv_begin, limit)`` for a list of *entries* (a query row and its own ``limit``).
For request ``b`` with ``prefix_len`` cached tokens and ``extend_len`` new ones, new token
``i`` is query row ``start_b + i`` and may see table columns ``[0, prefix_len + i]``:

  ``[0, shared_len)``           the prefix that ``b`` shares with other requests of the batch
                                through the radix tree (same slots); read once by the group's
                                *shared job* for all its members' queries
  ``[shared_len, prefix_len)``  ``b``'s own cached tokens    } read by ``b``'s *own job*,
  ``[prefix_len, seq_len)``     this step's new tokens       } causal over the new ones

``shared_len`` is 0 for a request outside every group.  A query row in a group has two
entries (shared job, own job); the kernel merges their partial softmaxes by log-sum-exp.
Everything here is numpy on host lists: no device tensor is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# A shared job pays one extra partial output and merge per query row; below this many shared
# tokens the own jobs read the prefix themselves.
MIN_SHARED_TOKENS = 16


@dataclass
class KernelPlan:
    job_row: torch.Tensor  # [J] table row each job reads
    job_kv_begin: torch.Tensor  # [J] first key column of each job
    job_entry_ptr: torch.Tensor  # [J + 1] entries of job j: [ptr[j], ptr[j + 1])
    entry_row: torch.Tensor  # [N] query row (index into the T new tokens) of each entry
    entry_limit: torch.Tensor  # [N] entry sees key columns [kv_begin, limit)
    row_entry_ptr: torch.Tensor  # [T + 1] entries of query row t: row_entries[ptr[t]:ptr[t + 1]]
    row_entries: torch.Tensor  # [N]
    shared_groups: int  # number of shared jobs (for tests and stats)

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.job_row, self.job_kv_begin, self.job_entry_ptr, self.entry_row,
                self.entry_limit, self.row_entry_ptr, self.row_entries)


def find_shared_groups(table: np.ndarray, rows: np.ndarray, prefix_lens: np.ndarray,
                       min_shared: int = MIN_SHARED_TOKENS) -> list[tuple[np.ndarray, int]]:
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


def _token_ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(starts[i], starts[i] + lens[i])`` over i."""
    total = int(lens.sum())
    offsets = np.repeat(starts - (np.cumsum(lens) - lens), lens)
    return np.arange(total, dtype=np.int64) + offsets


def build_plan(table: np.ndarray, rows: list[int], prefix_lens: list[int],
               extend_lens: list[int], share: bool = True) -> KernelPlan:
    """The kernel plan of one forward (``table``: the request-to-token table, host view)."""
    rows_np = np.asarray(rows, dtype=np.int64)
    pre = np.asarray(prefix_lens, dtype=np.int64)
    ext = np.asarray(extend_lens, dtype=np.int64)
    num_tokens = int(ext.sum())
    starts = np.cumsum(ext) - ext
    groups = find_shared_groups(table, rows_np, pre) if share else []

    job_row, job_begin, job_sizes = [], [], []
    entry_rows, entry_limits = [], []
    shared_entry_of_row = np.full(num_tokens, -1, dtype=np.int64)
    shared_len = np.zeros(len(rows), dtype=np.int64)
    num_entries = 0
    for members, shared in groups:
        tokens = _token_ranges(starts[members], ext[members])
        job_row.append(rows_np[members[0]])
        job_begin.append(0)
        job_sizes.append(len(tokens))
        entry_rows.append(tokens)
        entry_limits.append(np.full(len(tokens), shared, dtype=np.int64))
        shared_entry_of_row[tokens] = num_entries + np.arange(len(tokens))
        shared_len[members] = shared
        num_entries += len(tokens)

    # Own jobs: one per request, its tokens in order; new token i sees [.., prefix_len + i].
    own_first = num_entries
    job_row.extend(rows_np.tolist())
    job_begin.extend(shared_len.tolist())
    job_sizes.extend(ext.tolist())
    positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(pre - starts, ext)
    entry_rows.append(np.arange(num_tokens, dtype=np.int64))
    entry_limits.append(positions + 1)

    # Each query row: its own entry, then its shared entry if it has one.
    in_group = shared_entry_of_row >= 0
    counts = 1 + in_group.astype(np.int64)
    row_ptr = np.zeros(num_tokens + 1, dtype=np.int64)
    np.cumsum(counts, out=row_ptr[1:])
    row_entries = np.empty(int(row_ptr[-1]), dtype=np.int64)
    row_entries[row_ptr[:-1]] = own_first + np.arange(num_tokens)
    row_entries[row_ptr[:-1][in_group] + 1] = shared_entry_of_row[in_group]

    job_ptr = np.zeros(len(job_sizes) + 1, dtype=np.int64)
    np.cumsum(job_sizes, out=job_ptr[1:])
    as_t = torch.from_numpy
    return KernelPlan(
        job_row=as_t(np.asarray(job_row, dtype=np.int64)),
        job_kv_begin=as_t(np.asarray(job_begin, dtype=np.int64)),
        job_entry_ptr=as_t(job_ptr),
        entry_row=as_t(np.concatenate(entry_rows)),
        entry_limit=as_t(np.concatenate(entry_limits)),
        row_entry_ptr=as_t(row_ptr),
        row_entries=as_t(row_entries),
        shared_groups=len(groups),
    )
