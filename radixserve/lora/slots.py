"""The adapters the scheduler knows and the slots that hold the ones a batch may use.

Adapters are read once (``adapter.py``) and kept on the host; ``--max-loras-per-batch`` slots on
the model's device hold the weights the forward reads.  Per fused module of the decoder
(``qkv``, ``o``, ``gate_up``, ``down``) and layer, slot ``s`` holds

    a[layer, s]  [P * max_rank, in]   the A of each targeted part, stacked, zero-padded rows
    b[layer, s]  [out, P * max_rank]  each part's B (scaling folded in) in its own rows and
                                      its own block of columns, zeros elsewhere

so one fused module's extra product is ``b (a x)`` whatever its parts' ranks: two matmuls per
segment of rows that share an adapter (``lora/batch.py``).  Parts no adapter may target
(``--lora-target-modules``) take no columns.

A request takes a slot when it is admitted (:meth:`LoraPool.acquire`) and holds it while it
has a row of the request table; a slot whose adapter no live request uses may be given to
another adapter, the least recently used first.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.lora.adapter import (
    PROJECTIONS,
    LoraAdapter,
    ModuleShapes,
    adapter_rank,
    adapter_targets,
    read_adapter,
)
from radixserve.settings.lora import parse_lora_paths, target_modules

logger = logging.getLogger(__name__)

DEFAULT_MAX_RANK = 16  # --max-lora-rank when no adapter is given at start
# Fused module -> the projections it holds, in the order of its output columns.
FUSED_MODULES = {
    "qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",),
}


@dataclass
class SlotWeights:
    """One fused module's slots: ``a`` [L, S, R, in], ``b`` [L, S, out, R] (R = P * max_rank);
    ``parts``: the targeted projections with their output row offset and size."""

    a: torch.Tensor
    b: torch.Tensor
    parts: list[tuple[str, int, int, int]]  # (projection, part index, row offset, rows)


class LoraPool:
    """The known adapters (by name), and the slots on the device."""

    def __init__(self, shapes: ModuleShapes, max_loras: int, max_rank: int,
                 targets: frozenset[str], dtype: torch.dtype, device: torch.device) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError("max_loras_per_batch and max_lora_rank must be at least 1")
        self.shapes = shapes
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.targets = targets
        self.adapters: dict[str, LoraAdapter] = {}
        self.modules: dict[str, SlotWeights] = {}
        for module, projs in FUSED_MODULES.items():
            chosen = [p for p in projs if p in targets]
            if not chosen:
                continue
            fan_in = shapes.shapes[projs[0]][0]
            offsets, row = {}, 0
            for p in projs:
                offsets[p] = row
                row += shapes.shapes[p][1]
            r = len(chosen) * max_rank
            self.modules[module] = SlotWeights(
                torch.zeros(shapes.num_layers, max_loras, r, fan_in, dtype=dtype, device=device),
                torch.zeros(shapes.num_layers, max_loras, row, r, dtype=dtype, device=device),
                [(p, i, offsets[p], shapes.shapes[p][1]) for i, p in enumerate(chosen)],
            )
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # adapter name -> slot (LRU first)
        self._free = list(range(max_loras))

    @classmethod
    def from_args(cls, args: Any, config: Any, dtype: torch.dtype,
                  device: torch.device) -> LoraPool:
        """The pool of the server's settings, with the ``--lora-paths`` adapters read;
        ``--max-lora-rank`` and ``--lora-target-modules`` default to what those need (rank 16
        and every projection without any)."""
        paths = parse_lora_paths(args.lora_paths)
        max_rank = args.max_lora_rank or max(
            (adapter_rank(p) for p in paths.values()), default=DEFAULT_MAX_RANK)
        targets = target_modules(args)
        if targets is None:
            targets = (frozenset().union(*(adapter_targets(p) for p in paths.values()))
                       if paths else frozenset(PROJECTIONS))
        pool = cls(ModuleShapes.of(config), args.max_loras_per_batch, max_rank, targets,
                   dtype, device)
        for name, path in paths.items():
            pool.add(name, path)
        logger.info("LoRA: %d adapter(s) loaded, %d slots of %.1f MB (rank <= %d; %s)",
                    len(paths), pool.max_loras, pool.slot_bytes / pool.max_loras / 1e6,
                    max_rank, ", ".join(sorted(targets)))
        return pool

    @property
    def slot_bytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.modules.values())

    # ------------------------------------------------------------------ adapters

    def add(self, name: str, path: str) -> LoraAdapter:
        """Read and register the adapter ``name``; ValueError if the name is taken or the folder
        is not an adapter this model and these settings can serve."""
        self.check_name(name)
        adapter = read_adapter(name, path, self.shapes, self.max_rank, self.targets)
        self.adapters[name] = adapter
        return adapter

    def check_name(self, name: str) -> None:
        """ValueError unless ``name`` may name a new adapter."""
        if not name or not isinstance(name, str) or ":" in name:
            raise ValueError(f"LoRA adapter name {name!r}: a non-empty name without ':'")
        if name in self.adapters:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded "
                             f"(from {self.adapters[name].path}); unload it first")

    def remove(self, name: str) -> None:
        """Forget the adapter (its slot becomes free); KeyError if unknown."""
        del self.adapters[name]
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            self._free.append(slot)

    def listing(self) -> dict[str, str]:
        return {name: a.path for name, a in self.adapters.items()}

    # ------------------------------------------------------------------ slots

    def slot_of(self, name: str) -> int | None:
        return self._slot_of.get(name)

    def acquire(self, name: str, busy: Callable[[], Iterable[str]]) -> int | None:
        """The slot holding ``name``, loading it into a free slot or the least recently used
        one no live request uses (``busy``: the adapters of the live requests); None when every
        slot is busy (the request waits)."""
        slot = self._slot_of.get(name)
        if slot is not None:
            self._slot_of.move_to_end(name)
            return slot
        if not self._free:
            in_use = set(busy())
            victim = next((n for n in self._slot_of if n not in in_use), None)
            if victim is None:
                return None
            self._free.append(self._slot_of.pop(victim))
        slot = self._free.pop()
        self._write(slot, self.adapters[name])
        self._slot_of[name] = slot
        return slot

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy the adapter's weights into ``slot`` of every module (zeros where it has none)."""
        r = self.max_rank
        for w in self.modules.values():
            a, b = w.a[:, slot], w.b[:, slot]
            a.zero_()
            b.zero_()
            for proj, i, row, rows in w.parts:
                for layer in range(self.shapes.num_layers):
                    ab = adapter.weights.get((layer, proj))
                    if ab is None:
                        continue
                    pa, pb = ab
                    rank = pa.shape[0]
                    a[layer, i * r : i * r + rank].copy_(pa)
                    b[layer, row : row + rows, i * r : i * r + rank].copy_(pb)
        logger.info("LoRA adapter %r in slot %d", adapter.name, slot)
