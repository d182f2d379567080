"""Weight-only quantization of a model's matmuls on a CPU (``--quantization``).

Modes (:data:`radixserve.config.QUANTIZATIONS`):
- ``int8``: every projection (q/k/v, o, gate/up, down) and the LM head as int8 with a float32
  scale and offset per ``GROUP`` (32) weights of a row, asymmetric: the 256 steps span each
  group's own range (weights.py: :class:`Int8Weight`).  On the default model 100% of float32's
  greedy tokens over eight prompts (bench/quant_accuracy.py; symmetric groups of 64: 67%, of 32:
  86%) — its float weights are dequantized Q4_1 blocks, whose 4-bit steps are 17 int8 steps of
  such a group, so it keeps them almost exactly.  The kernel ran 0-30% slower than symmetric
  groups of 64 on the model's shapes (Zen 4).
- ``int4``: 4-bit blocks of 32 weights, ``w = d * q + m`` (llama.cpp's Q4_1 scheme,
  :class:`Int4Weight`), 5 bits a weight (d and m float16); the LM head in int8 (a scale per 32).
- ``gguf``: a GGUF model's Q4_0 / Q4_1 / Q8_0 tensors served as stored (gguf_blocks.py), the
  same weights float32 computes with in a quarter to a sixth of the bytes.
- ``auto`` (the default): ``gguf`` for a GGUF model with such tensors on a CPU, else ``none``:
  int8 and int4 of a float checkpoint round every weight, the GGUF's blocks none.
A tied embedding is the LM head's table, so its lookups dequantize the rows they take.

The matmul path, chosen by measurement (2-core CPUs, the default model's shapes, float
activations):
- at most ``KERNEL_MAX_ROWS`` rows (decode): the C++ kernels ``int8_linear`` / ``int4_linear``
  (cpu_ext/linear_ops.cpp), the weights converted to float in registers; with
  ``--int8-activations`` they run ``int4_linear_q8`` / ``int8_linear_q8`` instead (the LM head
  aside): x quantized to int8 per 32 and VNNI integer dot products (llama.cpp's Q4 x Q8 and Q8 x
  Q8): the default model's 120 4-bit layers (bfloat16, cycled from memory, 2-core Xeon) at one
  row 3.2 against 5.0 ms, 2 rows 4.2 against 4.7, 3-8 rows within the noise of the float kernel
  (which expands each weight once for all rows); the agent loop's one-row step 10-14% faster,
  even with drafts; no longer the weights' exact products (bench/quant_accuracy.py);
  without that flag, on such a CPU, a server that drafts no tokens takes the one-row steps of
  4-bit weights through ``int4_linear_q16`` (``wide_one_row``): x in 16-bit integers per 32
  (|error| at most amax / 65,278 a block, against bfloat16's own amax / 512), each as two signed
  bytes through the same VNNI dot products.  The default model's 4-bit layers at one row 2.7-2.9
  against 3.7-4.0 ms (2-core Xeon, cycled); a one-row step in-process, interleaved, 9.60 -> 9.04
  ms in bfloat16 and 10.79 -> 10.09 in float32.  At 2-8 rows it is slower than the float kernel
  (8 rows 11.5-12.9 against 8.8-10.4 ms: twice q8's dot products), and a speculative verify's rows
  must be the one-row steps' own bits, so a server with drafts keeps the float kernel;
- more rows (prefill, large batches): the weight dequantized once per call into a shared buffer
  (the default model's layers: 25 ms in bfloat16, 57 in float32, on Zen 4) and the float
  matmul this CPU runs fastest at that many rows (float_linear.py): torch's blocked GEMM for a
  prefill, which the row loop does not match there.
torch's own ``_weight_int8pack_mm`` ran 4.7x slower than the float32 matmul at one row and 40x
at 512 rows on an AVX2 CPU (Zen 3), so it is not used.
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
    # int8_linear_q8 took 1.32 ms against int8_linear's 1.04 for the default model's head at one
    # row, 2.5 against 1.9 at 4, 4.0 against 2.6 at 8 (2-core Xeon), where int8_linear reads its
    # 49,152 rows at the memory's rate; and its products stay exact.
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
        # in 6 or 8 bits: in 4 bits it alone took the default model from 100% to 36% of its
        # float32 greedy tokens (bench/quant_accuracy.py)
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
