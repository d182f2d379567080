"""A CPU model's weights moved into one block of memory backed by 2 MB pages.

A decode step streams every weight once, a few hundred KB per matmul.  Allocated one tensor at
a time, in 4 KB pages, the default model's 4-bit layers span ~20k pages: more than the CPU's
second-level TLB holds, so the kernels wait on page walks besides the loads.  Here the weights
are copied, in the order a forward reads them, into one anonymous mapping that asks the kernel
for transparent huge pages (``madvise(MADV_HUGEPAGE)``; Linux's default THP mode ``madvise``
grants them, ``never`` leaves 4 KB pages and only the order).  The 4-bit kernels
(``int4_linear``, ``int4_linear_q8``) then stream their weights without the page walks.

The values do not change: each tensor is replaced by a view of the arena holding a copy.
"""

from __future__ import annotations

import ctypes
import logging
import mmap

import torch
from torch import nn

from radixserve.quantization import QuantizedWeight, mark_weights_changed

_LIBC = ctypes.CDLL(None)
log = logging.getLogger("radixserve")

HUGE_PAGE = 2 * 2**20
ALIGN = 64  # each tensor starts on a cache line


def _owned(t: torch.Tensor) -> bool:
    """A contiguous tensor that is its storage's only view (one that shares a storage with
    others stays where it is: copying it would break the sharing)."""
    return t.is_contiguous() and t.storage_offset() == 0 and (
        t.untyped_storage().nbytes() == t.numel() * t.element_size())


def _slots(model: nn.Module) -> list[tuple[object, str, torch.Tensor]]:
    """(owner, attribute, tensor) of every weight, in the order the modules are registered (a
    forward's order) with the embedding tables last: a step reads one row of those."""
    first: list[tuple[object, str, torch.Tensor]] = []
    last: list[tuple[object, str, torch.Tensor]] = []
    seen: set[int] = set()
    for module in model.modules():
        into = last if isinstance(module, nn.Embedding) else first
        for param in module.parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                into.append((param, "data", param.data))
        weight = getattr(module, "weight", None)
        if isinstance(weight, QuantizedWeight):
            for name, t in vars(weight).items():
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    into.append((weight, name, t))
    return [s for s in first + last if _owned(s[2]) and s[2].device.type == "cpu"]


def _huge_page_block(nbytes: int) -> torch.Tensor:
    """``nbytes`` of anonymous memory starting on a 2 MB boundary, asked to be huge pages."""
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(buf, dtype=torch.uint8)  # holds a reference to the mapping
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


RELEASE_EVERY = 128 << 20  # bytes copied between two hand-backs of the freed originals


def _release_freed() -> None:
    """Hand the C heap's free memory back to the OS.  glibc serves allocations below its
    (growing) mmap threshold from its heap and keeps what they free: a load's temporaries and
    the weights' first copies would stay resident beside the block."""
    trim = getattr(_LIBC, "malloc_trim", None)  # glibc's; other C libraries keep no such heap
    if trim is not None:
        trim(0)


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 64 << 10


def unmap_large_frees() -> None:
    """Make glibc map every allocation from ``MMAP_THRESHOLD`` up on its own and unmap it when
    freed.  By default the threshold grows with each large block freed (up to 32 MB), and a
    prefill's activations and the dequantized runs of rows (quantization/weights.py) then come
    from the heap, which keeps what they free: a served model's resident memory would carry a
    prefill's worth of freed buffers beside the weights.  A decode step's tensors stay under
    the threshold, on the heap."""
    mallopt = getattr(_LIBC, "mallopt", None)  # glibc's; other C libraries keep no such heap
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def pack_weights(model: nn.Module) -> int:
    """Move the CPU weights of ``model`` into one huge-page block; returns its size in bytes."""
    slots = _slots(model)
    total = sum(_aligned(t.numel() * t.element_size()) for _, _, t in slots)
    if not slots:
        return 0
    count = len(slots)
    mark_weights_changed()  # what holds the old tensors (model/fused_decode.py) rebuilds
    _release_freed()  # the load's temporaries, before the block grows
    arena = _huge_page_block(total)
    offset = released = 0
    slots.reverse()
    while slots:  # each tensor released once copied: the process holds one copy, not two
        owner, attribute, t = slots.pop()
        size = t.numel() * t.element_size()
        view = arena[offset:offset + size].view(t.dtype).view(t.shape)
        view.copy_(t)
        setattr(owner, attribute, view)
        offset += _aligned(size)
        del t
        if offset - released >= RELEASE_EVERY:
            _release_freed()
            released = offset
    _release_freed()
    log.info(
        "weights in one %.0f MB block of memory (%d tensors, huge pages asked for)",
        total / 2**20,
        count,
    )
    return total
