"""Quantize a model in place (``--quantization``): its layers' float weights replaced by the
stored form of the method registered under the name (registry.py), and the flags that pick
their kernels (``--int8-activations``, ``wide_one_row``) set.

A tied embedding is the LM head's table, so it is quantized with the head and its lookups
dequantize the rows they take.
"""

from __future__ import annotations

import logging

from torch import nn

from radixserve import cpu_ext
from radixserve.quantization.registry import get_method, methods
from radixserve.quantization.weights import Q8_BLOCK, QuantizedWeight, mark_weights_changed

log = logging.getLogger("radixserve")



def quantize_model(model: nn.Module, mode: str, gguf_path: str | None = None,
                   int8_activations: bool = False, wide_one_row: bool = False) -> None:
    """Replace, in place, the weight of every linear layer that has one (and of a tied
    embedding) by its quantized form.  ``mode`` is a registered method's name (``auto``
    resolved: registry.resolve); ``gguf`` takes the blocks of ``gguf_path``, the file the model
    was converted from; ``int8_activations``: the decode rows of the weights that take it (4-bit
    blocks, int8 groups of 32; the LM head's aside) through ``int4_linear_q8`` /
    ``int8_linear_q8``; ``wide_one_row`` (ignored with it, or where the kernels lack AVX-512
    VNNI): one-row steps of 4-bit weights through ``int4_linear_q16`` (int4.py), of K-quant
    weights through ``kq_linear_q16`` (kquant.py)."""
    method = get_method(mode)
    if int8_activations:
        ops = cpu_ext.load()
        if not method.int8_activations or ops is None or not ops.q8_supported():
            taking = [m.name for m in methods() if m.int8_activations]
            raise ValueError(
                f"int8_activations needs quantized weights (quantization {', '.join(taking[:-1])} "
                f"or {taking[-1]}) and a CPU with AVX-512 VNNI (quantization {mode}; the kernels "
                f"{'did not build' if ops is None else 'were built without it'})")
    mark_weights_changed()  # before anything changes: a failure half way still counts
    head = _head_module(model)
    method.apply(model, _quantizable(model), head, gguf_path)
    # The LM head (int8 groups of 32: a GGUF's Q8_0, int4's head) keeps float activations:
    # int8_linear already reads its 49,152 rows at the memory's rate, so quantizing x adds work
    # without saving any (int8_linear_q8 is slower there at every row count); and its products
    # stay exact.
    taking = [w for w in _weights(model, head) if w.takes_int8_activations]
    for weight in taking:
        weight.int8_activations = int8_activations
    if int8_activations and not taking:
        raise ValueError(f"int8_activations: no layer of this model is served in 4-bit blocks or "
                         f"int8 groups of {Q8_BLOCK} with quantization {mode}")
    if int8_activations:
        log.info("int8 activations: decode rows through %d quantized layer(s) quantize x to int8 "
                 "per %d (AVX-512 VNNI dot products)", len(taking), Q8_BLOCK)
    elif wide_one_row:
        _take_wide_one_row(model)


def _weights(model: nn.Module, but: nn.Module | None = None) -> list[QuantizedWeight]:
    """The model's quantized weights (but that of the module ``but``)."""
    return [m.weight for m in model.modules()
            if m is not but and isinstance(getattr(m, "weight", None), QuantizedWeight)]


def _take_wide_one_row(model: nn.Module) -> None:
    """Mark the 4-bit weights' one-row steps for ``int4_linear_q16`` (a GGUF's K-quant
    weights': ``kq_linear_q16``) where this CPU's kernels run it."""
    ops = cpu_ext.load()
    weights = [w for w in _weights(model) if w.takes_wide_one_row]
    if not weights or ops is None or not ops.q8_supported():
        return
    for weight in weights:
        weight.wide_one_row = True
    log.info("one-row steps of %d 4-bit or K-quant layer(s) take x in 16-bit integers per %d "
             "(AVX-512 VNNI dot products)", len(weights), Q8_BLOCK)


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


def _head_module(model: nn.Module) -> nn.Module | None:
    """The module whose weight is the LM head: ``lm_head``, or the tied embedding."""
    return getattr(model, "lm_head", None) or getattr(getattr(model, "model", None),
                                                       "embed_tokens", None)
