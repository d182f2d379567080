"""What a quantized weight is: :class:`QuantizedWeight`, the stand-in for a linear layer's float
Parameter (int8.py and int4.py hold the formats), and the count of the model's weight changes.

The matmul path (float activations unless ``--int8-activations``):
- at most ``KERNEL_MAX_ROWS`` rows (decode): the format's C++ kernel (cpu_ext/linear_ops.cpp,
  named by :meth:`QuantizedWeight.kernel_args`) converts the weights to float in registers, so
  a step reads each quantized weight once from memory;
- more rows (prefill, large batches): the weight dequantized once per call into a shared buffer
  and the float matmul this CPU runs fastest at that many rows (float_linear.py): torch's
  blocked GEMM for a prefill, which the row loop does not match there.  A weight larger than
  the buffer (``SCRATCH_ELEMENTS``) goes through it in runs of rows, so the float copy a
  prefill needs stays one small buffer, not a float copy of the largest weight.
torch's own ``_weight_int8pack_mm`` is not used: on an AVX2 CPU it is slower than the float32
matmul at one row and far slower at prefill sizes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve import cpu_ext
from radixserve.quantization.float_linear import KERNEL_MAX_ROWS, float_linear

Q8_BLOCK = 32  # x's block in the *_q8 / *_q16 kernels (BLOCK4 in cpu_ext/linear_ops.cpp)


class QuantizedWeight:
    """A weight ``[N, K]`` held in fewer bits; what the model's layers call in place of a
    float Parameter."""

    shape: torch.Size
    dtype: torch.dtype  # the model's dtype: what lookups and matmuls return
    kernels: tuple[str, ...] = ()  # the cpu_ext ops that :meth:`kernel_args` and prefill name
    # whether --int8-activations may take its kernel rows (apply.py sets ``int8_activations``)
    takes_int8_activations: bool = False
    # whether its one-row steps may take x in 16-bit integers (int4_linear_q16, kq_linear_q16;
    # apply.py sets ``wide_one_row``)
    takes_wide_one_row: bool = False

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The float weight (a new tensor)."""
        raise NotImplementedError

    def dequantize_into(self, out: torch.Tensor, start: int = 0) -> None:
        """Write the float rows ``start .. start + len(out)`` of the weight into ``out``
        (``[rows, K]``, the matmul's dtype)."""
        out.copy_(self.rows(torch.arange(start, start + out.shape[0])))

    def kernel_args(self, rows: int) -> tuple[str, tuple[torch.Tensor, ...]]:
        """The C++ kernel a step of ``rows`` rows goes through (its name in cpu_ext) and the
        weight's tensors it takes after x: what :meth:`kernel_matmul` calls, and
        model/fused_decode.py too."""
        raise NotImplementedError

    def kernel_matmul(self, ops: object, x: torch.Tensor) -> torch.Tensor:
        """``x @ w.T`` for a few rows through the C++ kernel, in x's dtype (float32 sums rounded
        once)."""
        name, tensors = self.kernel_args(x.shape[0])
        return getattr(ops, name)(x, *tensors)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows ``ids``, dequantized to float32 (``[len(ids), K]``)."""
        raise NotImplementedError

    def take_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The weight of the rows ``index``, in order, in the same stored form."""
        raise NotImplementedError

    @classmethod
    def cat(cls, parts: list[QuantizedWeight]) -> QuantizedWeight:
        """The parts' rows one after the other (a merged q/k/v or gate/up layer's weight)."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ w.T`` for x ``[T, K]``, in x's dtype."""
        ops = cpu_ext.load() if x.device.type == "cpu" else None
        if ops is None:
            return F.linear(x, self.dequantized(x.dtype))
        if x.shape[0] <= KERNEL_MAX_ROWS:
            return self.kernel_matmul(ops, x)
        n, k = self.shape
        run = max(1, SCRATCH_ELEMENTS // k)
        if n <= run:
            weight = _scratch(n * k, x.dtype).view(n, k)
            self.dequantize_into(weight)
            return float_linear(x, weight)
        out = x.new_empty((x.shape[0], n))
        for start in range(0, n, run):
            rows = min(run, n - start)
            weight = _scratch(rows * k, x.dtype).view(rows, k)
            self.dequantize_into(weight, start)
            out[:, start:start + rows] = float_linear(x, weight)
        return out

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids``, dequantized (a tied embedding's lookup)."""
        return self.rows(ids).to(self.dtype)


# The most weights dequantized at once for a many-row matmul: 16 MB in bfloat16.  Runs of rows
# this large keep torch's GEMM at its full rate, and the buffer is small beside the model.
SCRATCH_ELEMENTS = 8 << 20
_SCRATCH: dict[torch.dtype, torch.Tensor] = {}


def _scratch(elements: int, dtype: torch.dtype) -> torch.Tensor:
    """The first ``elements`` of one float buffer per dtype, shared by every layer (a model's
    forward runs one matmul at a time): a fresh one per call would cost more in page faults
    than the matmul.  It grows to the largest run asked for, at most ``SCRATCH_ELEMENTS``."""
    buf = _SCRATCH.get(dtype)
    if buf is None or buf.numel() < elements:
        buf = _SCRATCH[dtype] = torch.empty(elements, dtype=dtype)
    return buf[:elements]


_changes = [0]


def weights_changes() -> int:
    """How many times :func:`~radixserve.quantization.apply.quantize_model` has replaced weights
    or set their int8 flag in this process: what holds a model's weights (model/fused_decode.py)
    rebuilds when it moves."""
    return _changes[0]


def mark_weights_changed() -> None:
    """Count one more change of the model's weights (see :func:`weights_changes`)."""
    _changes[0] += 1
