"""Request-to-token table: one row of KV slots per running request.

The host array ``host`` is the only copy the scheduler reads or writes.  The attention kernels
read ``table``, the device copy, which is brought up to date one forward at a time: each write
marks where its row starts to differ from the device (``_synced``), and :meth:`sync_updates`
returns the cells a forward's rows need, for the forward's one packed upload.  On a CPU the two
are the same memory and there is nothing to update.
"""

from __future__ import annotations

import numpy as np
import torch


class ReqToTokenPool:
    """``host[row, i]`` is the KV slot of token ``i`` of the request that holds ``row``."""

    def __init__(
        self, max_requests: int, max_context_len: int, device: torch.device | str = "cpu"
    ) -> None:
        self.max_requests = max_requests
        self.max_context_len = max_context_len
        self.host = np.zeros((max_requests, max_context_len), dtype=np.int32)
        device = torch.device(device)
        self.shared = device.type == "cpu"  # the device copy is the host array itself
        if self.shared:
            self.table = torch.from_numpy(self.host)
        else:
            self.table = torch.zeros(
                (max_requests, max_context_len), dtype=torch.int32, device=device
            )
        # Columns [0, _synced[row]) of the device row equal the host row.
        self._synced = np.zeros(max_requests, dtype=np.int64)
        self._free_rows = list(range(max_requests - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self._synced[row] = 0
        return row

    def free(self, row: int) -> None:
        if row in self._free_rows:
            raise RuntimeError(f"request row {row} freed twice")
        self._free_rows.append(row)

    def reset(self) -> None:
        self._free_rows = list(range(self.max_requests - 1, -1, -1))
        self._synced[:] = 0

    # ---- writes (host) -----------------------------------------------------------------
    def write(self, row: int, start: int, slots: np.ndarray) -> None:
        """``host[row, start : start + len(slots)] = slots``."""
        self.host[row, start : start + len(slots)] = slots
        self._synced[row] = min(self._synced[row], start)

    def write_runs(
        self, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray, slots: np.ndarray
    ) -> None:
        """Run ``i`` writes ``slots`` (consumed in order) to ``host[rows[i], starts[i] :
        starts[i] + counts[i]]``: one indexing op for a whole decode step's new pages."""
        offsets = (
            np.arange(len(slots), dtype=np.int64)
            - np.repeat(np.cumsum(counts) - counts, counts)
        )
        self.host[np.repeat(rows, counts), np.repeat(starts, counts) + offsets] = slots
        np.minimum.at(self._synced, rows, starts)

    def read(self, row: int, start: int, end: int) -> np.ndarray:
        """Slots ``[start, end)`` of a row, as int64."""
        return self.host[row, start:end].astype(np.int64)

    # ---- the device copy ---------------------------------------------------------------
    def sync_updates(
        self, rows: list[int], ends: list[int]
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """The cells the device copy lacks for ``host[rows[i], :ends[i]]``: ``(flat index into
        the table, slot)``, for the forward's upload (``ForwardBatch.send`` writes them into
        ``table``).  None when the device copy is the host array or already up to date.  Marks
        them as synced."""
        if self.shared:
            return None
        rows_np = np.asarray(rows, dtype=np.int64)
        ends_np = np.asarray(ends, dtype=np.int64)
        starts = self._synced[rows_np]
        counts = np.maximum(ends_np - starts, 0)
        if not counts.any():
            return None
        offsets = (
            np.arange(int(counts.sum()), dtype=np.int64)
            - np.repeat(np.cumsum(counts) - counts, counts)
        )
        cols = np.repeat(starts, counts) + offsets
        flat_rows = np.repeat(rows_np, counts)
        np.maximum.at(self._synced, rows_np, ends_np)
        return flat_rows * self.max_context_len + cols, self.host[flat_rows, cols]
