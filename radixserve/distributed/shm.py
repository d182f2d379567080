"""All-reduce and gather between the ranks of one CPU host through shared memory.

gloo moves every collective through loopback TCP and an I/O thread: on a small CPU host each
call costs a round trip through the OS however small the tensor, and a decoder layer makes two
calls, so collectives alone would dominate a decode step.  Here the ranks map one file into
memory and meet at sequence counters: each rank copies its tensor into its own slot, then
publishes the step's sequence number; a reader spins until every rank it needs has published,
and reads the slots.  A call costs a few microseconds plus the copies.

Layout of the file: ``flags[size]`` int64 (the last sequence number each rank published),
``pids[size]`` int64, then ``2 x size`` data slots of ``slot_bytes``: calls alternate between
the two halves by the parity of their sequence number, so a slot is written again only two
calls later, by when every rank has finished reading it (it had to publish the call in
between, which it only does after reading).

Ordering: a rank writes its slot, then its flag; a reader reads the flag, then the slots.  x86
keeps stores in order and loads in order (TSO), which is what makes this correct; the
collectives are used on x86 CPUs only (:func:`usable`), elsewhere gloo does every call.
Every rank sums the slots in the same order (in float32), so all ranks hold the same result.
"""

from __future__ import annotations

import os
import platform
import time

import torch

from radixserve.distributed import TensorParallelError

HEADER_BYTES = 4096
SLOT_BYTES = 32 << 20  # tensors up to this size go through shared memory, larger ones through gloo
SPINS_BETWEEN_CHECKS = 2000  # then: a yield, and every CHECK_S a look at the other ranks' health
CHECK_S = 0.05


def usable(device: str) -> bool:
    return device == "cpu" and platform.machine() in ("x86_64", "AMD64")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except (OSError, IndexError):
        return False


class ShmCollectives:
    """Rank ``rank`` of ``size``'s view of the shared file at ``path`` (every rank opens the
    same path; rank 0 creates it first, and removes it once all have mapped it)."""

    def __init__(
        self, path: str, rank: int, size: int, timeout_s: float, slot_bytes: int = SLOT_BYTES
    ) -> None:
        if size * 16 > HEADER_BYTES:
            raise ValueError(f"{size} ranks do not fit the shared-memory header")
        self.rank, self.size, self.slot_bytes, self.timeout_s = rank, size, slot_bytes, timeout_s
        total = HEADER_BYTES + 2 * size * slot_bytes
        buf = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        self._buf = buf  # keeps the mapping alive
        self.flags = buf[: 8 * size].view(torch.int64).numpy()
        self.pids = buf[8 * size : 16 * size].view(torch.int64).numpy()
        self.data = buf[HEADER_BYTES:].view(2, size, slot_bytes)
        self.pids[rank] = os.getpid()
        self.seq = int(self.flags[rank])

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.slot_bytes

    def _slots(self, parity: int, x: torch.Tensor) -> torch.Tensor:
        """``[size, *x.shape]``: every rank's slot of this call, viewed as ``x``."""
        nbytes = x.numel() * x.element_size()
        return self.data[parity, :, :nbytes].view(x.dtype).view(self.size, *x.shape)

    def _publish(self, x: torch.Tensor) -> torch.Tensor:
        self.seq += 1
        slots = self._slots(self.seq & 1, x)
        slots[self.rank].copy_(x)
        self.flags[self.rank] = self.seq  # after the data: readers see both in this order
        return slots

    def _wait(self, ranks: range) -> None:
        seq, flags = self.seq, self.flags
        start = last_check = time.monotonic()
        for r in ranks:
            spins = 0
            while flags[r] < seq:
                spins += 1
                if spins % SPINS_BETWEEN_CHECKS:
                    continue
                os.sched_yield()  # a rank waiting for a slower one leaves it the core
                now = time.monotonic()
                if now - last_check < CHECK_S:
                    continue
                last_check = now
                if not _alive(int(self.pids[r])):
                    raise TensorParallelError(f"tensor-parallel rank {r} is gone (rank {self.rank} "
                                              "was waiting for it in a collective)")
                if now - start > self.timeout_s:
                    raise TensorParallelError(f"tensor-parallel rank {r} did not reach collective "
                                              f"{seq} within {self.timeout_s:.0f} s")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (float32 accumulation, rank order)."""
        slots = self._publish(x)
        self._wait(range(self.size))
        x.copy_(slots.sum(0, dtype=torch.float32) if x.dtype != torch.float32 else slots.sum(0))
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``x`` stacked on rank 0 (``[size, *x.shape]``, a copy); None elsewhere."""
        slots = self._publish(x)
        if self.rank != 0:
            return None
        self._wait(range(1, self.size))
        return slots.clone()
