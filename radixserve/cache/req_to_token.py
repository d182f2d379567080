"""Request-to-token table: one row of KV slots per running request."""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """``table[row, i]`` is the KV slot of token ``i`` of the request that holds ``row``."""

    def __init__(self, max_requests: int, max_context_len: int, device: torch.device | str = "cpu") -> None:
        self.max_requests = max_requests
        self.max_context_len = max_context_len
        self.table = torch.zeros((max_requests, max_context_len), dtype=torch.int32, device=device)
        self._free_rows = list(range(max_requests - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        if row in self._free_rows:
            raise RuntimeError(f"request row {row} freed twice")
        self._free_rows.append(row)

    def reset(self) -> None:
        self._free_rows = list(range(self.max_requests - 1, -1, -1))
