"""What a weight format of ``--quantization`` is: a :class:`QuantMethod` (one per CLI name,
registry.py) and, for each GGUF tensor type served as stored, a :class:`GGUFType`.

A method says what it accepts (a float checkpoint's weights, a GGUF file's tensors of some
types), whether ``auto`` may choose it and where, how it turns a layer's float weight into its
stored form (a :class:`~radixserve.quantization.weights.QuantizedWeight`), which C++ kernels
its weights run through (cpu_ext/linear_ops.cpp), and whether ``--int8-activations`` applies.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from radixserve.quantization.weights import QuantizedWeight

log = logging.getLogger("radixserve")


@dataclass(frozen=True)
class GGUFType:
    """A GGUF tensor type whose blocks a weight class holds as stored (``--quantization gguf``)."""

    kind: str  # GGUF's name of the type ("Q4_1"), as checkpoint/gguf_index.py reads it
    block_weights: int  # weights per block along a row
    block_bytes: int  # bytes per block
    # the tensor's blocks, uint8 [rows, K / block_weights, block_bytes], and the model's dtype
    # -> the weight ([rows, K]) in its stored form
    read: Callable[[torch.Tensor, torch.dtype], QuantizedWeight]
    weight: type[QuantizedWeight]  # the class ``read`` returns (its ``kernels`` run it)
    label: str  # what the load's log line counts the layers that take it as ("Q4 blocks")


class QuantMethod:
    """One weight format of ``--quantization``.  Subclasses set the class attributes and
    :meth:`quantize_weight` (a format that rounds float weights) or :meth:`apply` (one that
    takes its weights from elsewhere, as ``gguf`` does)."""

    name: ClassVar[str]  # the CLI name (one of config.QUANTIZATIONS)
    # Accepts: a float checkpoint's weights, rounded to the format...
    quantizes_float: ClassVar[bool] = False
    # ...and / or a GGUF file's tensors of these types, served as stored (registry.py's GGUF types)
    gguf_types: ClassVar[tuple[str, ...]] = ()
    # ``auto``: registry.resolve takes the highest-ranked method that may run there (None: never
    # chosen by ``auto``); ``auto_cpu_only``: chosen only on a CPU; a method with gguf_types is
    # chosen only for a GGUF model that has tensors of one of them.
    auto_rank: ClassVar[int | None] = None
    auto_cpu_only: ClassVar[bool] = False
    one_rank: ClassVar[bool] = False  # its weights are served by one rank (tp_size 1)
    # its weights run on a GPU (the float method); the others' kernels are cpu_ext's, and
    # hardware.check_quantization_device refuses them there
    on_gpu: ClassVar[bool] = False
    int8_activations: ClassVar[bool] = False  # --int8-activations may quantize x for its weights
    # the log line's description of the stored form (methods that round float weights)
    stored_as: ClassVar[str] = ""

    def kernels(self) -> tuple[str, ...]:
        """The cpu_ext ops (cpu_ext/linear_ops.cpp) its weights' matmuls run through."""
        return ()

    def quantize_weight(self, weight: torch.Tensor, is_head: bool) -> QuantizedWeight | None:
        """A layer's float weight ``[N, K]`` in this format (``is_head``: the LM head's, a tied
        embedding's included), or None where the layer keeps its float weight."""
        return None

    def apply(self, model: nn.Module, modules: list[tuple[str, nn.Module]], head: nn.Module | None,
              gguf_path: str | None) -> None:
        """Replace, in place, the float weight of each ``(name, module)`` by its stored form
        (``head``: the module whose weight is the LM head; ``gguf_path``: the .gguf the model
        was converted from, or None)."""
        before = after = kept = 0
        for _, module in modules:
            weight = module.weight
            q = self.quantize_weight(weight, module is head)
            if q is None:  # no whole groups: this layer keeps its float weight
                kept += 1
                continue
            before += weight.numel() * weight.element_size()
            after += q.nbytes
            del module.weight  # the Parameter goes; forward reads the attribute set below
            module.weight = q
        log.info("weights quantized to %s (%s): %.0f MB -> %.0f MB; decode rows through the C++ "
                 "kernels, prefill through dequantized float matmuls%s", self.name, self.stored_as,
                 before / 2**20, after / 2**20,
                 f"; {kept} layer(s) kept in float (in-features not whole groups)" if kept else "")
