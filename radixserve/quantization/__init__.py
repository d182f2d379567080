"""Weight-only quantization of a model's matmuls on a CPU (``--quantization``).

One file per method, each a registered class (registry.py; base.py says what a method is):
``none`` (none.py, the float weights), ``int8`` (int8.py), ``int4`` (int4.py) and ``gguf``
(gguf.py, a GGUF's Q4_0 / Q4_1 / Q8_0 tensors and its K-quants, kquant.py, served as stored).
``auto`` (the default) takes ``gguf`` for a GGUF model with such tensors on a CPU, else ``none``
(registry.resolve).
apply.py quantizes a model in place; matmul.py's :func:`linear` multiplies by a float or a
quantized weight; weights.py says what a quantized weight is and how its matmuls run.
"""

from __future__ import annotations

from radixserve.quantization.apply import quantize_model
from radixserve.quantization.float_linear import KERNEL_MAX_ROWS
from radixserve.quantization.int4 import BLOCK4, Int4Weight
from radixserve.quantization.int8 import GROUP, Int8Weight
from radixserve.quantization.matmul import LINEAR_SCOPE, linear
from radixserve.quantization.weights import QuantizedWeight, mark_weights_changed, weights_changes

__all__ = ["BLOCK4", "GROUP", "KERNEL_MAX_ROWS", "LINEAR_SCOPE", "Int4Weight", "Int8Weight",
           "QuantizedWeight", "linear", "mark_weights_changed", "quantize_model", "weights_changes"]
