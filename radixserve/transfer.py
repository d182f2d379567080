"""Host-device transfers of the step loop: one packed upload per forward, one read-back.

On a GPU every host-to-device copy of a small index array is a launch, and every read of a
device tensor on the host (``.item()``, ``.tolist()``, ``.cpu()``, boolean indexing) stalls the
host until the GPU has caught up.  The step loop therefore keeps its bookkeeping on the host
(numpy), gathers everything a forward indexes with into one :class:`Upload`, and reads the
sampled tokens back once through :func:`read_back`.

An array staged in an :class:`Upload` is a :class:`Staged` placeholder until the upload is
sent; :func:`resolve` then swaps every placeholder in a dataclass (and the dataclasses and lists
inside it) for its view of the copied buffer.  When the device is the host's, nothing is copied:
``add`` returns the array itself as a tensor.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

ALIGN = 16  # bytes; every staged array starts at a multiple (any dtype may view it)
_NUMPY_TO_TORCH = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
    np.dtype(np.bool_): torch.bool,
    np.dtype(np.uint8): torch.uint8,
}
_reading_back: contextvars.ContextVar[bool] = contextvars.ContextVar("reading_back", default=False)


@dataclasses.dataclass
class Staged:
    """A host array waiting in an :class:`Upload`; ``tensor`` is set when it is sent."""

    offset: int
    array: np.ndarray
    tensor: torch.Tensor | None = None


class Upload:
    """Host arrays gathered for one host-to-device copy."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.direct = self.device.type == "cpu"  # the device is the host: nothing to copy
        self._staged: list[Staged] = []
        self._size = 0
        self.sent = False

    def add(self, array: np.ndarray | list[int], dtype: Any = np.int64) -> Any:
        """Stage ``array``: a tensor at once on the host device (sharing the array's memory
        when it already has the dtype), else a :class:`Staged` (a copy is taken at send)."""
        arr = np.ascontiguousarray(array, dtype=dtype)
        if self.direct:
            return torch.from_numpy(arr)
        if self.sent:
            raise RuntimeError("this upload was already sent; stage arrays before sending")
        staged = Staged(self._size, arr)
        self._staged.append(staged)
        self._size += -(-arr.nbytes // ALIGN) * ALIGN
        return staged

    def send(self) -> None:
        """Copy everything staged in one transfer and give each placeholder its tensor."""
        if self.sent:
            return
        self.sent = True
        if not self._staged:
            return
        pinned = self.device.type == "cuda"
        host = torch.empty(self._size, dtype=torch.uint8, pin_memory=pinned)
        buf = host.numpy()
        for s in self._staged:
            buf[s.offset : s.offset + s.array.nbytes] = s.array.reshape(-1).view(np.uint8)
        device_buf = host.to(self.device, non_blocking=pinned)
        for s in self._staged:
            part = device_buf[s.offset : s.offset + s.array.nbytes]
            s.tensor = part.view(_NUMPY_TO_TORCH[s.array.dtype]).view(s.array.shape)


def resolve(obj: Any) -> Any:
    """``obj`` with every sent :class:`Staged` replaced by its tensor: fields of dataclasses
    and items of lists are replaced in place, tuples rebuilt, recursively."""
    if isinstance(obj, Staged):
        if obj.tensor is None:
            raise RuntimeError("a staged array was used before its upload was sent")
        return obj.tensor
    if isinstance(obj, tuple):
        return tuple(resolve(item) for item in obj)
    if isinstance(obj, list):
        for i, item in enumerate(obj):
            obj[i] = resolve(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if isinstance(value, (Staged, list, tuple)) or dataclasses.is_dataclass(value):
                setattr(obj, f.name, resolve(value))
    return obj


@contextmanager
def _marked_read_back() -> Iterator[None]:
    token = _reading_back.set(True)
    try:
        yield
    finally:
        _reading_back.reset(token)


def reading_back() -> bool:
    """True inside :func:`read_back` (the one device-to-host copy a step is allowed)."""
    return _reading_back.get()


def read_back(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t``.  On CUDA it waits on an event, not on the stream, so a step run
    under ``torch.cuda.set_sync_debug_mode("error")`` may call it."""
    if t.device.type == "cpu":
        return t
    with _marked_read_back():
        if t.device.type == "cuda":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            done.synchronize()
            return host
        return t.to("cpu")
