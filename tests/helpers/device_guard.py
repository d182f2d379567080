"""A stand-in GPU for the CPU test suite: device tensors that refuse every read-back.

Under :class:`DeviceGuard` the ``meta`` device plays the GPU.  A tensor created on it, or
copied to it, is a :class:`DeviceTensor`: it reports ``device='meta'`` (so ``.numpy()`` fails as
it would on CUDA) and keeps its data in a CPU tensor that every op computes on, so the model
really runs.  What a GPU step loop must not do raises :class:`DeviceReadback`:

- reading a device tensor on the host: ``.item()``, ``.tolist()``, ``int()``/``bool()``,
  ``.cpu()`` / ``.to("cpu")``, a copy into a host tensor (outside ``transfer.read_back``, the
  one read-back a step is allowed);
- ops whose output size depends on the data (a sync on CUDA): boolean-mask indexing,
  ``nonzero``, ``masked_select``, ``unique``, ``repeat_interleave`` without ``output_size``;
- mixing a host tensor into a device op (an upload outside the batch's, which on CUDA fails
  with a device mismatch); the model's own weights and buffers are the exception: the model runs
  on the CPU copy.

It counts host-to-device copies (``uploads``) and allowed read-backs (``reads``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from radixserve.transfer import reading_back

aten = torch.ops.aten
META = torch.device("meta")

# Ops whose result the host must wait for (their output size depends on the data).
_DATA_DEPENDENT = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten.unique_consecutive.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.repeat_interleave.Tensor,
    aten.repeat_interleave.self_Tensor,
}
_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


class DeviceReadback(AssertionError):
    """The step loop read a device tensor on the host (or did what needs a sync on a GPU)."""


class DeviceTensor(torch.Tensor):
    """Reports the meta device; its data lives in ``inner`` (CPU)."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> DeviceTensor:
        out = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(),
            dtype=inner.dtype, device=META, requires_grad=False,
        )
        out.inner = inner
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    def tolist(self) -> Any:
        raise DeviceReadback(".tolist() of a device tensor")

    def numpy(self, *args: Any, **kwargs: Any) -> Any:
        raise DeviceReadback(".numpy() of a device tensor")

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise DeviceReadback("numpy conversion of a device tensor")

    def __repr__(self) -> str:  # printing reads the values: show only the shape
        return f"DeviceTensor(shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        raise DeviceReadback(f"{func} ran on a device tensor outside a DeviceGuard")


def _is_device_tensor(x: Any) -> bool:
    return isinstance(x, DeviceTensor)


def _on_meta(device: Any) -> bool:
    return device is not None and torch.device(device).type == "meta"


def _copy_target(func: Any, args: tuple, kwargs: dict) -> torch.device | None:
    """The device a ``to`` / ``_to_copy`` sends its tensor to (None: not a copy, or no move)."""
    if func.overloadpacket not in (aten.to, aten._to_copy):
        return None
    target = kwargs.get("device")
    if target is None:
        target = next((a for a in args[1:] if isinstance(a, (torch.device, str))), None)
    return None if target is None else torch.device(target)


class DeviceGuard(TorchDispatchMode):
    """``with DeviceGuard(model): ...`` — see the module docstring."""

    def __init__(self, model: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.uploads = 0
        self.reads = 0
        # The model's weights and buffers (and tensors its modules hold) may meet device tensors.
        self._model_tensors: set[int] = set()
        if model is not None:
            for module in model.modules():
                for value in (*module.parameters(recurse=False), *module.buffers(recurse=False),
                              *vars(module).values()):
                    if isinstance(value, torch.Tensor):
                        self._model_tensors.add(id(value))

    def counts(self) -> tuple[int, int]:
        return self.uploads, self.reads

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        device_in = [x for x in flat if _is_device_tensor(x)]
        if not device_in:
            return self._host_op(func, args, kwargs, flat)
        name = str(func)
        if func in _DATA_DEPENDENT:
            raise DeviceReadback(f"{name} on a device tensor: the host would wait for the GPU")
        if func in _INDEXING:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
                raise DeviceReadback(f"boolean-mask indexing ({name}) of a device tensor")
        target = _copy_target(func, args, kwargs)
        if target is not None and target.type != "meta":
            return self._read_back(name, lambda: args[0].inner.to(
                dtype=kwargs.get("dtype") or args[0].dtype, copy=True))
        if func is aten.copy_.default and not _is_device_tensor(args[0]):
            return self._read_back(name, lambda: args[0].copy_(args[1].inner))
        if func is aten.copy_.default and not _is_device_tensor(args[1]):
            self.uploads += 1
            args[0].inner.copy_(args[1])
            return args[0]
        for x in flat:
            if (isinstance(x, torch.Tensor) and not _is_device_tensor(x) and x.dim() > 0
                    and id(x) not in self._model_tensors):
                raise DeviceReadback(f"{name} mixes a host tensor {tuple(x.shape)} into a device op "
                                     "(an upload outside the batch's)")
        wrappers = {id(x.inner): x for x in device_in}

        def unwrap(x: Any) -> Any:
            return x.inner if _is_device_tensor(x) else x

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        return tree_map(lambda y: wrappers.get(id(y), DeviceTensor(y)) if isinstance(y, torch.Tensor) else y, out)

    def _host_op(self, func: Any, args: tuple, kwargs: dict, flat: list) -> Any:
        """No device tensor in: a factory on the device, an upload, or plain host work."""
        target = _copy_target(func, args, kwargs)
        if target is not None and target.type == "meta":
            self.uploads += 1
            return DeviceTensor(args[0].to(dtype=kwargs.get("dtype") or args[0].dtype, copy=True))
        if _on_meta(kwargs.get("device")):  # a factory (empty, zeros, arange...) on the device
            return DeviceTensor(func(*args, **{**kwargs, "device": torch.device("cpu")}))
        return func(*args, **kwargs)

    def _read_back(self, name: str, copy: Any) -> Any:
        if not reading_back():
            raise DeviceReadback(f"{name} copies a device tensor to the host outside transfer.read_back")
        self.reads += 1
        return copy()
