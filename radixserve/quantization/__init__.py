"""Weight-only quantization of a model's matmuls on a CPU (``--quantization``).

Modes (:data:`radixserve.config.QUANTIZATIONS`):
- ``int8``: every projection (q/k/v, o, gate/up, down) and the LM head as int8 with a float32
  scale and offset per ``GROUP`` (32) weights of a row, asymmetric: the 256 steps span each
  group's own range (weights.py: :class:`Int8Weight`).  Asymmetric because the default model's
  float weights are dequantized Q4_1 blocks, whose 4-bit steps are 17 int8 steps of such a group,
  so it keeps them almost exactly, where symmetric groups lose greedy tokens
  (bench/quant_accuracy.py); the offset costs the kernel some speed against symmetric groups.
- ``int4``: 4-bit blocks of 32 weights, ``w = d * q + m`` (llama.cpp's Q4_1 scheme,
  :class:`Int4Weight`), 5 bits a weight (d and m float16); the LM head in int8 (a scale per 32).
- ``gguf``: a GGUF model's Q4_0 / Q4_1 / Q8_0 tensors served as stored (gguf_blocks.py), the
  same weights float32 computes with in a quarter to a sixth of the bytes.
- ``auto`` (the default): ``gguf`` for a GGUF model with such tensors on a CPU, else ``none``:
  int8 and int4 of a float checkpoint round every weight, the GGUF's blocks none.
A tied embedding is the LM head's table, so its lookups dequantize the rows they take.

The matmul path (float activations unless ``--int8-activations``):
- at most ``KERNEL_MAX_ROWS`` rows (decode): the C++ kernels ``int8_linear`` / ``int4_linear``
  (cpu_ext/linear_ops.cpp) convert the weights to float in registers, so a step reads each
  quantized weight once from memory.  With ``--int8-activations`` the projections (not the LM
  head) run ``int4_linear_q8`` / ``int8_linear_q8`` instead: x quantized to int8 per 32 and VNNI
  integer dot products (llama.cpp's Q4 x Q8 and Q8 x Q8), whose products are not the weights'
  exact ones (bench/quant_accuracy.py).  Without that flag, on a VNNI CPU, a server that
  drafts no tokens takes the one-row steps of 4-bit weights through ``int4_linear_q16``
  (``wide_one_row``): x in 16-bit integers per 32 (|error| at most amax / 65,278 a block,
  against bfloat16's own amax / 512), each as two signed bytes through the same VNNI dot
  products.  That is twice q8's dot products, so it pays only at one row; and a speculative verify's rows must be the one-row
  steps' own bits, so a server with drafts keeps the float kernel;
- more rows (prefill, large batches): the weight dequantized once per call into a shared buffer
  and the float matmul this CPU runs fastest at that many rows (float_linear.py): torch's
  blocked GEMM for a prefill, which the row loop does not match there.
torch's own ``_weight_int8pack_mm`` is not used: on an AVX2 CPU it is slower than the float32
matmul at one row and far slower at prefill sizes.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from radixserve import cpu_ext
from radixserve.config import INT8_ACTIVATION_MODES, QUANTIZATIONS
from radixserve.profiler_scopes import scope
from radixserve.quantization.float_linear import float_linear
from radixserve.quantization.weights import (
    BLOCK4,
    GROUP,
    KERNEL_MAX_ROWS,
    Int4Weight,
    Int8Weight,
    QuantizedWeight,
)

__all__ = ["BLOCK4", "GROUP", "KERNEL_MAX_ROWS", "LINEAR_SCOPE", "Int4Weight", "Int8Weight", "QuantizedWeight", "linear",
           "mark_weights_changed", "quantize_model", "weights_changes"]

log = logging.getLogger("radixserve")

LINEAR_SCOPE = "radixserve.linear"  # a matmul through the C++ kernels (no aten op names it)


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for a float or a quantized weight: a quantized one through its kernels, a
    float one through :func:`float_linear` (the C++ loop where it beats torch on this CPU).
    Under torch's profiler each call is a :data:`LINEAR_SCOPE` range (scheduler/profiling.py)."""
    with scope(LINEAR_SCOPE):
        return _linear(x, weight, bias)


def _linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(weight, QuantizedWeight):
        y = weight.matmul(x)
        return y if bias is None else y + bias
    return float_linear(x, weight, bias)


def _quantizable(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers whose float weight a mode may replace: those marked ``quantizable``, and the
    embedding table where it is the LM head too (tied)."""
    tied = getattr(model, "lm_head", False) is None
    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    found = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        wanted = getattr(module, "quantizable", False) or (tied and module is embedding)
        if isinstance(weight, nn.Parameter) and weight.dim() == 2 and wanted:
            found.append((name, module))
    return found


_changes = [0]


def weights_changes() -> int:
    """How many times :func:`quantize_model` has replaced weights or set their int8 flag in this
    process: what holds a model's weights (model/fused_decode.py) rebuilds when it moves."""
    return _changes[0]


def mark_weights_changed() -> None:
    """Count one more change of the model's weights (see :func:`weights_changes`)."""
    _changes[0] += 1


def quantize_model(model: nn.Module, mode: str, gguf_path: str | None = None, int8_activations: bool = False,
                   wide_one_row: bool = False) -> None:
    """Replace, in place, the weight of every linear layer that has one (and of a tied
    embedding) by its quantized form.  ``mode`` is one of :data:`QUANTIZATIONS` (``auto``
    resolved); ``gguf`` takes the blocks of ``gguf_path``, the file the model was converted from;
    ``int8_activations``: the decode rows of the 4-bit weights and of int8 groups of 32 (the LM
    head's aside) through ``int4_linear_q8`` / ``int8_linear_q8``; ``wide_one_row`` (ignored with
    it, or where the kernels lack AVX-512 VNNI): one-row steps of 4-bit weights through
    ``int4_linear_q16`` (the top of this file)."""
    if mode not in QUANTIZATIONS or mode == "auto":
        raise ValueError(f"quantization must be one of {[q for q in QUANTIZATIONS if q != 'auto']}, got {mode!r}")
    if int8_activations:
        ops = cpu_ext.load()
        if mode not in INT8_ACTIVATION_MODES or ops is None or not ops.q8_supported():
            raise ValueError("int8_activations needs quantized weights (quantization int4, gguf or int8) and a "
                             f"CPU with AVX-512 VNNI (quantization {mode}; the kernels "
                             f"{'did not build' if ops is None else 'were built without it'})")
    mark_weights_changed()  # before anything changes: a failure half way still counts
    _quantize(model, mode, gguf_path)
    # The LM head (int8 groups of 32: a GGUF's Q8_0, int4's head) keeps float activations:
    # int8_linear already reads its 49,152 rows at the memory's rate, so quantizing x adds work
    # without saving any (int8_linear_q8 is slower there at every row count); and its products
    # stay exact.
    head = _head_module(model)
    taking = [m.weight for m in model.modules() if m is not head and (
        isinstance(getattr(m, "weight", None), Int4Weight)
        or isinstance(getattr(m, "weight", None), Int8Weight) and m.weight.group == BLOCK4)]
    for weight in taking:
        weight.int8_activations = int8_activations
    if int8_activations and not taking:
        raise ValueError(f"int8_activations: no layer of this model is served in 4-bit blocks or int8 groups of "
                         f"{BLOCK4} with quantization {mode}")
    if int8_activations:
        log.info("int8 activations: decode rows through %d quantized layer(s) quantize x to int8 per %d "
                 "(AVX-512 VNNI dot products)", len(taking), BLOCK4)
    elif wide_one_row:
        _take_wide_one_row(model)


def _take_wide_one_row(model: nn.Module) -> None:
    """Mark the 4-bit weights' one-row steps for ``int4_linear_q16`` where this CPU's kernels
    run it."""
    ops = cpu_ext.load()
    weights = [m.weight for m in model.modules() if isinstance(getattr(m, "weight", None), Int4Weight)]
    if not weights or ops is None or not ops.q8_supported():
        return
    for weight in weights:
        weight.wide_one_row = True
    log.info("one-row steps of %d 4-bit layer(s) take x in 16-bit integers per %d (AVX-512 VNNI dot products)",
             len(weights), BLOCK4)


def _head_module(model: nn.Module) -> nn.Module | None:
    """The module whose weight is the LM head: ``lm_head``, or the tied embedding."""
    return getattr(model, "lm_head", None) or getattr(getattr(model, "model", None), "embed_tokens", None)


def _quantize(model: nn.Module, mode: str, gguf_path: str | None) -> None:
    if mode == "none":
        return
    modules = _quantizable(model)
    if mode == "gguf":
        if gguf_path is None:
            raise ValueError("quantization gguf serves the blocks of a .gguf model; this model is not one "
                             "(int8 or int4 quantize a float checkpoint)")
        from radixserve.quantization.gguf_blocks import serve_gguf_blocks

        kinds, before, after = serve_gguf_blocks(model, gguf_path, modules)
        log.info("weights served as the GGUF's blocks: %.0f MB -> %.0f MB; %s", before / 2**20, after / 2**20,
                 ", ".join(f"{count} layer(s) {what}" for what, count in sorted(kinds.items())))
        return
    head = _head_module(model)
    before = after = kept = 0
    for _, module in modules:
        weight = module.weight
        # int4 keeps the LM head (a tied table too) in int8, as llama.cpp's 4-bit files keep it
        # in 6 or 8 bits: in 4 bits it alone loses most of the default model's float32 greedy
        # tokens (bench/quant_accuracy.py)
        in_int4 = mode == "int4" and module is not head
        group = GROUP if mode == "int8" else BLOCK4
        if weight.shape[1] % group:  # no whole groups: this layer keeps its float weight
            kept += 1
            continue
        q = Int4Weight.quantize(weight) if in_int4 else Int8Weight.quantize(weight, group, asymmetric=mode == "int8")
        before += weight.numel() * weight.element_size()
        after += q.nbytes
        del module.weight  # the Parameter goes; forward reads the attribute set below
        module.weight = q
    log.info("weights quantized to %s (%s): %.0f MB -> %.0f MB; decode rows through the C++ kernels, "
             "prefill through dequantized float matmuls%s", mode,
             f"a scale and an offset per {GROUP} weights" if mode == "int8" else
             f"blocks of {BLOCK4}, d * q + m; the LM head in int8, a scale per {BLOCK4}",
             before / 2**20, after / 2**20,
             f"; {kept} layer(s) kept in float (in-features not whole groups)" if kept else "")
