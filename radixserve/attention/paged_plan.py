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

from radixserve.kernels.groups import find_shared_groups

# A shared job pays one extra partial output and merge per query row; below this many shared
# tokens the own jobs read the prefix themselves.
MIN_SHARED_TOKENS = 16
# A lone agent's decode is one job per KV head: 3 tasks for 2 threads on the default model, one
# thread idle a third of the time.  In a batch of at most SPLIT_MAX_REQUESTS requests, a cached
# range of SPLIT_MIN_KEYS or more is read by SPLIT_PARTS jobs (merged like a shared job's).
# Only decode rows (and a speculative verify's few): a prefill chunk has rows enough to share.
SPLIT_MAX_REQUESTS = 2
SPLIT_MAX_NEW_TOKENS = 8
SPLIT_MIN_KEYS = 512
SPLIT_PARTS = 4
# A batch of one request of at most this many new tokens gets its plan from Python ints.
LONE_MAX_NEW_TOKENS = 64


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


def _token_ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(starts[i], starts[i] + lens[i])`` over i."""
    total = int(lens.sum())
    offsets = np.repeat(starts - (np.cumsum(lens) - lens), lens)
    return np.arange(total, dtype=np.int64) + offsets


def _row_entries(
    num_tokens: int,
    own_first: int,
    num_entries: int,
    chunk_entry_rows: list[np.ndarray],
    shared_entry_of_row: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Each query row's entries, CSR: its own entry, its chunks' entries, then its shared entry."""
    own = np.arange(own_first, own_first + num_tokens, dtype=np.int64)
    chunk_ids = np.arange(own_first + num_tokens, num_entries, dtype=np.int64)
    chunk_rows = (
        np.concatenate(chunk_entry_rows) if chunk_entry_rows else np.zeros(0, dtype=np.int64)
    )
    in_group = shared_entry_of_row >= 0
    listed = np.concatenate([own, chunk_ids, shared_entry_of_row[in_group]])
    listed_rows = np.concatenate([np.arange(num_tokens, dtype=np.int64), chunk_rows,
                                  np.flatnonzero(in_group)])
    order = np.argsort(listed_rows, kind="stable")
    row_ptr = np.zeros(num_tokens + 1, dtype=np.int64)
    np.cumsum(np.bincount(listed_rows, minlength=num_tokens), out=row_ptr[1:])
    return row_ptr, listed[order]


def _lone_request_plan(row: int, pre: int, ext: int) -> KernelPlan:
    """build_plan's answer for a batch of one request of a few new tokens (a lone agent's decode
    or verify step), from Python ints, without the general path's ~30 numpy calls, each of
    which costs more than the arithmetic it does at this size."""
    split = pre >= SPLIT_MIN_KEYS and ext <= SPLIT_MAX_NEW_TOKENS
    parts = SPLIT_PARTS if split else 0
    bounds = [pre * i // SPLIT_PARTS for i in range(SPLIT_PARTS + 1)] if split else []
    tokens = list(range(ext))
    entry_row = tokens * (1 + parts)
    entry_limit = [pre + t + 1 for t in tokens] + [hi for hi in bounds[1:] for _ in tokens]
    # each token's own entry, then its entry in each part
    row_entries = [t + p * ext for t in tokens for p in range(1 + parts)]
    fields = (
        [row] * (1 + parts),
        [pre if split else 0] + bounds[:-1],
        [ext * j for j in range(2 + parts)],
        entry_row,
        entry_limit,
        [(1 + parts) * t for t in range(ext + 1)],
        row_entries,
    )
    # one tensor, split into the seven (views of it: contiguous, as the kernel reads them)
    views = torch.tensor([v for f in fields for v in f], dtype=torch.int64).split(
        [len(f) for f in fields]
    )
    return KernelPlan(*views, shared_groups=0)


def build_plan(table: np.ndarray, rows: list[int], prefix_lens: list[int],
               extend_lens: list[int], share: bool = True) -> KernelPlan:
    """The kernel plan of one forward (``table``: the request-to-token table, host view)."""
    if len(rows) == 1 and extend_lens[0] <= LONE_MAX_NEW_TOKENS:
        return _lone_request_plan(int(rows[0]), int(prefix_lens[0]), int(extend_lens[0]))
    return _batch_plan(table, rows, prefix_lens, extend_lens, share)


def _batch_plan(table: np.ndarray, rows: list[int], prefix_lens: list[int], extend_lens: list[int],
                share: bool) -> KernelPlan:
    rows_np = np.asarray(rows, dtype=np.int64)
    pre = np.asarray(prefix_lens, dtype=np.int64)
    ext = np.asarray(extend_lens, dtype=np.int64)
    num_tokens = int(ext.sum())
    starts = np.cumsum(ext) - ext
    groups = find_shared_groups(table, rows_np, pre, MIN_SHARED_TOKENS) if share else []

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
    # A batch of few requests splits each long cached range into SPLIT_PARTS jobs in front
    # of it, which every new token of the request sees whole (entry limit = the chunk's end).
    own_first = num_entries
    own_begin = shared_len.copy()
    split = (
        (pre - shared_len >= SPLIT_MIN_KEYS)
        & (ext <= SPLIT_MAX_NEW_TOKENS)
        & (len(rows) <= SPLIT_MAX_REQUESTS)
    )
    chunk_jobs: list[tuple[int, int, int]] = []  # (request, first key column, end)
    for b in np.flatnonzero(split):
        bounds = np.linspace(shared_len[b], pre[b], SPLIT_PARTS + 1).astype(np.int64)
        own_begin[b] = pre[b]  # the own job keeps the new tokens (causal)
        chunk_jobs += [
            (int(b), int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
        ]
    job_row.extend(rows_np.tolist())
    job_begin.extend(own_begin.tolist())
    job_sizes.extend(ext.tolist())
    positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(pre - starts, ext)
    entry_rows.append(np.arange(num_tokens, dtype=np.int64))
    entry_limits.append(positions + 1)
    num_entries += num_tokens
    chunk_entry_rows = []
    for b, lo, hi in chunk_jobs:
        tokens = np.arange(starts[b], starts[b] + ext[b], dtype=np.int64)
        job_row.append(rows_np[b])
        job_begin.append(lo)
        job_sizes.append(len(tokens))
        entry_rows.append(tokens)
        entry_limits.append(np.full(len(tokens), hi, dtype=np.int64))
        chunk_entry_rows.append(tokens)
        num_entries += len(tokens)

    row_ptr, row_entries = _row_entries(
        num_tokens, own_first, num_entries, chunk_entry_rows, shared_entry_of_row
    )
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
