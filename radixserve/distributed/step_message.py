"""What rank 0 tells the other tensor-parallel ranks to compute: one message per forward.

A forward is fully described by the batch's host arrays (the same ones rank 0 builds its
``ForwardBatch`` from) and, for each request, its KV slots ``[0, seq_len)``: the other ranks
keep no request table of their own, they rebuild a compact one (row ``b`` = request ``b``)
each step.  Slot numbers are the same on every rank (one allocator, on rank 0), so the
compact table addresses each rank's shard of the pool exactly as rank 0's table does its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import orjson

FORWARD = b"forward"
STOP = b"stop"


@dataclass
class StepBatch:
    input_ids: np.ndarray  # [T] int64, the new tokens of every request, in request order
    prefix_lens: np.ndarray  # [B] int64, tokens already in the pool per request
    extend_lens: np.ndarray  # [B] int64, tokens computed now per request
    out_cache_loc: np.ndarray  # [T] int64, the new tokens' slots
    # [sum(seq_lens)] int32: request b's slots [0, prefix_lens[b] + extend_lens[b]), concatenated
    slots: np.ndarray
    extra_logits: np.ndarray  # [E] int64, token indices whose logits are also wanted

    _FIELDS = ("input_ids", "prefix_lens", "extend_lens", "out_cache_loc", "slots", "extra_logits")
    _DTYPES = (np.int64, np.int64, np.int64, np.int64, np.int32, np.int64)

    def encode(self) -> list[bytes]:
        arrays = [
            np.ascontiguousarray(getattr(self, f), dtype=d)
            for f, d in zip(self._FIELDS, self._DTYPES, strict=True)
        ]
        header = orjson.dumps([len(a) for a in arrays])
        return [FORWARD, header, *(a.tobytes() for a in arrays)]

    @classmethod
    def decode(cls, frames: list[bytes]) -> StepBatch:
        if len(frames) != 2 + len(cls._FIELDS) or frames[0] != FORWARD:
            raise ValueError(f"not a step message ({len(frames)} frames)")
        lengths = orjson.loads(frames[1])
        arrays = {}
        for name, dtype, n, data in zip(cls._FIELDS, cls._DTYPES, lengths, frames[2:], strict=True):
            array = np.frombuffer(data, dtype=dtype).copy()  # writable: torch wraps it
            if len(array) != n:
                raise ValueError(f"step message field {name}: {len(array)} values, header says {n}")
            arrays[name] = array
        batch = cls(**arrays)
        if int((batch.prefix_lens + batch.extend_lens).sum()) != len(batch.slots):
            raise ValueError("step message: slots do not cover every request's sequence")
        return batch

    def table(self) -> np.ndarray:
        """``[B, max seq_len]`` int32: row b holds request b's slots, zero-padded."""
        seq_lens = self.prefix_lens + self.extend_lens
        table = np.zeros((len(seq_lens), int(seq_lens.max(initial=1))), dtype=np.int32)
        # Mask of the live cells, filled row by row in one assignment.
        live = np.arange(table.shape[1])[None, :] < seq_lens[:, None]
        table[live] = self.slots
        return table


def pack_rows(table: np.ndarray, rows: list[int], seq_lens: list[int]) -> np.ndarray:
    """Each request's slots ``table[row, :seq_len]``, concatenated (rank 0's side of
    :attr:`StepBatch.slots`)."""
    if not rows:
        return np.zeros(0, dtype=np.int32)
    return np.concatenate(
        [table[r, :n] for r, n in zip(rows, seq_lens, strict=True)]
    ).astype(np.int32, copy=False)
