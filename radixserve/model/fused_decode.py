"""Steps of few rows through every decoder layer in one C++ call (``cpu_ext`` ``DecodeLayers``).

On a CPU the Python between a one-row decode step's kernels (module calls, views, argument
checks and conversions, every layer) is a large share of the step.  Where a
step's layers run on the C++ kernels anyway (a CPU, one rank, at most ``KERNEL_MAX_ROWS`` rows,
the paged kernel's plan, a pool its store writes, no q/k norm), they run in one call instead:
the same kernels in the same order on the same tensors, so the logits are the same bits
(tests/kernels/test_fused_decode.py).  Anything else takes the Python layers, and so does every step
under torch's profiler, whose breakdown (scheduler/profiling.py) reads the layers' ranges.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from radixserve import cpu_ext
from radixserve.attention.paged_plan import KernelPlan
from radixserve.attention.torch_backend import KERNEL_MAX_GROUP
from radixserve.quantization import KERNEL_MAX_ROWS, QuantizedWeight, weights_changes
from radixserve.quantization.float_linear import kernel_takes

if TYPE_CHECKING:
    from radixserve.batch import ForwardBatch

# How DecodeLayers runs a matmul (decode_layers.cpp's Linear): a float weight through the C++
# loop or torch, a quantized one through the kernel its kernel_args name.
FLOAT_KERNEL, FLOAT_TORCH = 0, 1
QUANTIZED_KINDS = {
    "int8_linear": 2,
    "int8_linear_q8": 3,
    "int4_linear": 4,
    "int4_linear_q8": 5,
    "int4_linear_q16": 6,
    "kq_linear": 7,
    "kq_linear_q16": 8,
}
WEIGHT_TENSORS = 3  # per matmul, before its bias (fewer: padded with empty tensors)
_EMPTY = torch.empty(0)
_NO_LORA: tuple[list[torch.Tensor], torch.Tensor] = ([], _EMPTY)  # a batch without adapters


def _linear_parts(
    module: torch.nn.Module,
) -> tuple[tuple[int, int] | None, list[torch.Tensor]] | None:
    """A layer's matmul as DecodeLayers takes it: its kinds for a step of one row and of more
    (None: a float weight, whose kind float_linear picks by the rows) and its weight tensors then
    bias; None if it cannot."""
    w, bias = module.weight, module.bias if module.bias is not None else _EMPTY
    if isinstance(w, QuantizedWeight):
        (one, tensors), (many, _) = w.kernel_args(1), w.kernel_args(2)
        if one not in QUANTIZED_KINDS or many not in QUANTIZED_KINDS or (
                len(tensors) > WEIGHT_TENSORS):
            return None
        padding = [_EMPTY] * (WEIGHT_TENSORS - len(tensors))
        return (QUANTIZED_KINDS[one], QUANTIZED_KINDS[many]), [*tensors, *padding, bias]
    if isinstance(w, torch.Tensor) and w.dim() == 2:
        return None, [w, _EMPTY, _EMPTY, bias]
    return None


class FusedDecode:
    """The model's layers as ``DecodeLayers`` holds them, or nothing where it cannot take them
    (then :meth:`run` answers None)."""

    def __init__(self, model: torch.nn.Module) -> None:
        """``model``: a model/decoder.py CausalLM."""
        on_cpu = next(model.parameters()).device.type == "cpu"
        self.ops = cpu_ext.load() if on_cpu else None  # never built for a GPU's model
        self.layers = model.model.layers
        info = self.layers[0].self_attn.info
        self.dims = [info.num_heads, info.num_kv_heads, info.head_dim]
        self.scaling = info.scaling
        self.eps = self.layers[0].input_layernorm.eps
        self.model_fits = (
            self.ops is not None
            and model.tp.size == 1
            and info.num_heads // info.num_kv_heads <= KERNEL_MAX_GROUP
            and all(
                layer.self_attn.q_norm is None
                and layer.mlp.act is F.silu
                and layer.input_layernorm.eps == layer.post_attention_layernorm.eps == self.eps
                for layer in self.layers
            )
        )
        self.version: int | None = None  # quantization.weights_changes() when the lists were built
        self.pool: object = None
        self.native = None  # the C++ DecodeLayers over the lists and the pool's tensors
        self.weights: list[torch.Tensor] = []
        self.kinds: list[tuple[int, int] | None] = []
        self.float_weights: list[torch.Tensor] = []
        self._kinds_by_rows: dict[int, list[int]] = {}

    def _build(self) -> None:
        """The lists from the modules as they are; no kinds where some matmul cannot go (then
        every step takes the Python layers until the weights change)."""
        self.version, self.native, self._kinds_by_rows = weights_changes(), None, {}
        self.weights, self.kinds, self.float_weights = [], [], []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.weights += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            for module in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                parts = _linear_parts(module)
                if parts is None:
                    self.kinds = []
                    return
                kind, tensors = parts
                self.weights += tensors
                self.kinds.append(kind)
                if kind is None:
                    self.float_weights.append(tensors[0])

    def _kinds(self, rows: int) -> list[int]:
        """The matmuls' kinds for a step of ``rows`` rows (a float weight's as float_linear
        picks)."""
        if rows not in self._kinds_by_rows:
            it = iter(self.float_weights)
            self._kinds_by_rows[rows] = [
                k[rows > 1]
                if k is not None
                else (FLOAT_KERNEL if kernel_takes(rows, next(it)) else FLOAT_TORCH)
                for k in self.kinds
            ]
        return self._kinds_by_rows[rows]

    def _native(self, pool: object) -> object:
        if self.native is None or self.pool is not pool:
            tensors = []
            for layer in range(len(self.layers)):
                k_scale, v_scale = pool.get_scales(layer)
                tensors += [*pool.get_kv(layer), _EMPTY if k_scale is None else k_scale,
                            _EMPTY if v_scale is None else v_scale]
            self.native = self.ops.DecodeLayers(
                self.weights, tensors, self.eps, self.dims, self.scaling
            )
            self.pool = pool
        return self.native

    def run(
        self, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor | None:
        """The last layer's MLP output (``residual`` updated in place), as the Python layers
        give it; None where this step takes the Python layers."""
        rows = residual.shape[0]
        plan = fb.attn_metadata
        if (
            not self.model_fits
            or rows > KERNEL_MAX_ROWS
            or torch.autograd.profiler._is_profiler_enabled
            or not isinstance(plan, KernelPlan)
            or not residual.is_contiguous()
            or fb.lora is not None and fb.lora.kernel != "cpu"
        ):
            return None
        if self.version != weights_changes():
            self._build()
        pool = fb.kv_pool
        if not self.kinds or not pool.quantized and pool.get_kv(0)[0].dtype != residual.dtype:
            return None  # a matmul it cannot take; a pool the Python path writes through torch
        return self._native(pool).run(
            residual,
            self._kinds(rows),
            cos.view(rows, -1),
            sin.view(rows, -1),
            pool.quantized,
            pool.rotated,
            fb.out_cache_loc,
            fb.req_to_token,
            list(plan.args()),
            *(_NO_LORA if fb.lora is None else fb.lora.kernel_args()),
        )
