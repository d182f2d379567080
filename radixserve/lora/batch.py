"""The adapters of one forward: which slot each new token reads, and the extra products.

A batch mixes the base model (slot -1) and several adapters.  Each fused module's output
gains ``b[s] (a[s] x)`` on the rows of slot ``s`` (``lora/slots.py`` holds a and b):
- up to 256 rows on a CPU (decode and mixed steps): one C++ call per module, a gather over the
  rows' slots (``cpu_ext/lora_ops.cpp``);
- on a GPU: the Triton kernels (``kernels/lora.py``), the same gather;
- otherwise (prefill chunks on a CPU): two matmuls per segment of rows that share a slot, a
  slice when the segment's rows are contiguous (the usual case: requests are laid out one after
  another), else a gather and an ``index_add_``.
The fused C++ decode layers (``model/fused_decode.py``) take the same gather kernel inside
their loop.  Every index is computed on the host and travels in the batch's one upload.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from radixserve import cpu_ext
from radixserve.lora.slots import FUSED_MODULES, LoraPool
from radixserve.transfer import Upload

# Rows up to which a CPU step runs the C++ gather kernel (it reads each row's A and B from the
# cache, where matmuls per segment pay their per-call cost per adapter); a longer step (a
# prefill chunk) runs a matmul per segment.
CPU_KERNEL_MAX_ROWS = 256
_EMPTY = torch.empty(0)


@dataclass
class Segment:
    """Rows of one slot: ``[start, end)`` when contiguous, else ``rows`` (an index tensor)."""

    slot: int
    start: int = 0
    end: int = 0
    rows: Any = None


@dataclass
class LoraBatch:
    token_slots: Any  # [T] int64: each new token's slot, -1 for the base model
    segments: list[Segment]
    kernel: str  # "cpu", "triton" or "torch"
    pool: LoraPool = field(repr=False, compare=False)

    @classmethod
    def build(cls, pool: LoraPool, entry_slots: list[int], extend_lens: list[int],
              upload: Upload) -> LoraBatch | None:
        """The batch's adapters (None when every request runs the base model)."""
        if max(entry_slots) < 0:
            return None
        token_slots = np.repeat(np.asarray(entry_slots, dtype=np.int64), extend_lens)
        kernel = kernel_for(upload.device, len(token_slots))
        segments = []
        if kernel == "torch":
            for slot in np.unique(token_slots[token_slots >= 0]).tolist():
                rows = np.flatnonzero(token_slots == slot)
                start, end = int(rows[0]), int(rows[-1]) + 1
                if end - start == len(rows):
                    segments.append(Segment(slot, start, end))
                else:
                    segments.append(Segment(slot, rows=upload.add(rows)))
        return cls(upload.add(token_slots), segments, kernel, pool)

    def kernel_args(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """What the fused C++ decode layers take (``cpu_ext/decode_layers.cpp``): each fused
        module's a and b of every layer (empty tensors where no adapter may target it), and
        the rows' slots."""
        tensors = []
        for module in FUSED_MODULES:
            w = self.pool.modules.get(module)
            tensors += [_EMPTY, _EMPTY] if w is None else [w.a, w.b]
        return tensors, self.token_slots

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, module: str) -> None:
        """``out += b (a x)`` on every adapter row of the fused ``module``'s output (in place)."""
        weights = self.pool.modules.get(module)
        if weights is None:  # no adapter may target this module
            return
        a, b = weights.a[layer], weights.b[layer]  # [S, R, in], [S, out, R]
        if self.kernel == "cpu":
            _cpu_kernel()(out, x, a, b, self.token_slots)
            return
        if self.kernel == "triton":
            from radixserve.kernels.lora import lora_apply

            lora_apply(out, x, a, b, self.token_slots)
            return
        for seg in self.segments:
            if seg.rows is None:
                xs = x[seg.start : seg.end]
                out[seg.start : seg.end] += (xs @ a[seg.slot].T) @ b[seg.slot].T
            else:
                xs = x.index_select(0, seg.rows)
                out.index_add_(0, seg.rows, (xs @ a[seg.slot].T) @ b[seg.slot].T)


def kernel_for(device: torch.device, rows: int) -> str:
    """Which path computes a batch's products (see the module's docstring)."""
    if device.type == "cuda":
        return "triton"
    if rows <= CPU_KERNEL_MAX_ROWS and _cpu_kernel() is not None:
        return "cpu"
    return "torch"


def _cpu_kernel() -> Any:
    """The C++ gather kernel, or None (no kernel build)."""
    ops = cpu_ext.load()
    return getattr(ops, "lora_apply_", None) if ops is not None else None
