"""``--quantization none``: the checkpoint's float weights as they are, multiplied by torch or,
for a few rows, by the C++ loop ``float_linear`` where it wins on this CPU (float_linear.py).
``auto``'s choice wherever no other method applies (its rank is the lowest)."""

from __future__ import annotations

from torch import nn

from radixserve.quantization.base import QuantMethod


class FloatMethod(QuantMethod):
    name = "none"
    auto_rank = 0
    on_gpu = True

    def kernels(self) -> tuple[str, ...]:
        return ("float_linear",)

    def apply(self, model: nn.Module, modules: list[tuple[str, nn.Module]], head: nn.Module | None,
              gguf_path: str | None) -> None:
        return None
