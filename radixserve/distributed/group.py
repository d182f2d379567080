"""The tensor-parallel group of one server: who this rank is, what it holds, its collectives."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from radixserve.distributed import TensorParallelError, shm

# A collective waits this long for a peer before it fails.  Ranks do the same work each step,
# so a healthy peer is never far behind; a dead one is normally noticed at once (its sockets
# close) and by the launcher's watchdog within a second; this is the last line.
COLLECTIVE_TIMEOUT_S = 300


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, end)`` of part ``index`` when ``n`` items are split into ``parts`` contiguous
    parts whose sizes differ by at most one (the first ``n % parts`` parts get one more)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of ``size``; ``size == 1`` (the default, :data:`SINGLE`) is no parallelism
    and every collective is a no-op.  ``shm``: the shared-memory collectives of a CPU host
    (:mod:`radixserve.distributed.shm`), used for every tensor that fits them."""

    rank: int = 0
    size: int = 1
    shm: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of {self.size} is not a rank")

    def split(self, n: int, what: str = "items") -> tuple[int, int]:
        """This rank's ``[start, end)`` of ``n`` items (MLP columns, vocabulary rows)."""
        if n < self.size:
            raise ValueError(f"{n} {what} cannot be split over {self.size} tensor-parallel ranks")
        return split_range(n, self.size, self.rank)

    def head_ranges(
        self, num_heads: int, num_kv_heads: int
    ) -> tuple[tuple[int, int], tuple[int, int]]:
        """This rank's query heads ``[qs, qe)`` and KV heads ``[ks, ke)``.

        With at least as many KV heads as ranks, the KV heads are split (unevenly if they must:
        3 over 2 ranks is 2 + 1) and each rank takes the query heads of its KV heads.  With
        fewer, each KV head is replicated on ``size / num_kv_heads`` ranks, which share its
        query heads; that needs both divisions to be exact.
        """
        group = num_heads // num_kv_heads
        if num_kv_heads >= self.size:
            ks, ke = split_range(num_kv_heads, self.size, self.rank)
            return (ks * group, ke * group), (ks, ke)
        per_kv = self.size // num_kv_heads  # ranks sharing one KV head
        if self.size % num_kv_heads or group % per_kv:
            raise ValueError(
                f"{num_heads} query heads on {num_kv_heads} KV heads cannot be split over "
                f"{self.size} tensor-parallel ranks: with fewer KV heads than ranks, the ranks "
                "must divide evenly among the KV heads and among each one's query heads"
            )
        kv = self.rank // per_kv
        qs, qe = split_range(group, per_kv, self.rank % per_kv)
        return (kv * group + qs, kv * group + qe), (kv, kv + 1)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it."""
        if self.size > 1 and self.shm is not None and self.shm.fits(x):
            return self.shm.all_reduce(x)
        if self.size > 1:
            try:
                dist.all_reduce(x)
            except RuntimeError as e:
                raise TensorParallelError(
                    f"tensor-parallel all-reduce failed on rank {self.rank}: {e}"
                ) from e
        return x

    def gather_vocab(self, x: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Rows of logits split over the vocabulary (``[R, this rank's part]``) put together on
        rank 0 as ``[R, vocab_size]``; None on the other ranks."""
        if self.size == 1:
            return x
        width = split_range(vocab_size, self.size, 0)[1]  # rank 0 has the widest part
        padded = x if x.shape[1] == width else torch.nn.functional.pad(x, (0, width - x.shape[1]))
        padded = padded.contiguous()
        widths = [
            b - a for a, b in (split_range(vocab_size, self.size, r) for r in range(self.size))
        ]
        if self.shm is not None and self.shm.fits(padded):
            stacked = self.shm.gather(padded)
            if stacked is None:
                return None
            return torch.cat([p[:, :w] for p, w in zip(stacked, widths, strict=True)], dim=1)
        try:
            if self.rank != 0:
                dist.gather(padded, None, dst=0)
                return None
            parts = [torch.empty_like(padded) for _ in range(self.size)]
            dist.gather(padded, parts, dst=0)
        except RuntimeError as e:
            raise TensorParallelError(
                f"tensor-parallel gather failed on rank {self.rank}: {e}"
            ) from e
        return torch.cat([p[:, :w] for p, w in zip(parts, widths, strict=True)], dim=1)


SINGLE = TensorParallel()


def rank_device(device: str, rank: int) -> str:
    """The device of rank ``rank``: ``cuda`` becomes ``cuda:<rank>``; a CPU is shared."""
    return f"cuda:{rank}" if device == "cuda" else device


def init_group(rank: int, size: int, folder: str, device: str) -> TensorParallel:
    """Join the group (every rank calls this once; it returns when all have).

    The rendezvous is a file in the server's private temp folder, and gloo is bound to the
    loopback interface: nothing listens beyond this host.  On a CPU the ranks also map one
    shared-memory file for the per-layer collectives (:mod:`radixserve.distributed.shm`),
    unless ``RADIXSERVE_TP_SHM=0`` (every collective through gloo).
    """
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    on_gpu = device.startswith("cuda")
    if on_gpu:
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(
        "nccl" if on_gpu else "gloo",
        init_method=f"file://{os.path.join(folder, 'tp-store')}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    use_shm = shm.usable(device) and os.environ.get("RADIXSERVE_TP_SHM", "1") != "0"
    return TensorParallel(rank, size, _map_shared_memory(rank, size, folder) if use_shm else None)


def _map_shared_memory(rank: int, size: int, folder: str) -> shm.ShmCollectives:
    """Rank 0 creates the file (in /dev/shm when it has room, else in ``folder``), every rank
    maps it, and rank 0 removes its name: nothing is left behind, however the server ends."""
    need = 2 * (shm.HEADER_BYTES + 2 * size * shm.SLOT_BYTES)
    try:
        st = os.statvfs("/dev/shm")
        roomy = st.f_bavail * st.f_frsize >= need
    except OSError:
        roomy = False
    path = os.path.join("/dev/shm" if roomy else folder, os.path.basename(folder) + "-tp-shm")
    if rank == 0:
        collectives = shm.ShmCollectives(path, rank, size, COLLECTIVE_TIMEOUT_S)
    dist.barrier()
    if rank != 0:
        collectives = shm.ShmCollectives(path, rank, size, COLLECTIVE_TIMEOUT_S)
    dist.barrier()
    if rank == 0:
        os.unlink(path)
    return collectives


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
