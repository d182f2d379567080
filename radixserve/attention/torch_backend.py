"""The CPU attention backend: the C++ paged kernel, with the pure-torch gather path as fallback.

Every forward (prefill, decode, chunked extend, mixed) is one kernel call per layer that reads
K/V in place from the pool through the request-to-token table, in the pool's dtype, with
float32 accumulation; a prefix shared through the radix tree is read once per group of
requests (see ``paged_plan.py``).  Fresh prompts go through the kernel too: on a causal
prompt it keeps pace with PyTorch's flash SDPA, and one call per layer keeps a mixed batch in
one call.  The reasons for C++ over compiled torch are in ``radixserve/cpu_ext/__init__.py``.

Where the kernel cannot be built (no C++ compiler) or the head size is not one it was
instantiated for, the backend runs :class:`GatherPath` (SDPA over gathered copies).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixserve import cpu_ext
from radixserve.attention.base import AttentionBackend, AttentionLayerInfo
from radixserve.attention.gather_path import GatherPath
from radixserve.attention.paged_plan import KernelPlan, build_plan

if TYPE_CHECKING:
    from radixserve.batch import ForwardBatch

KERNEL_HEAD_DIMS = (16, 32, 64, 128)
KERNEL_MAX_GROUP = 32  # query heads per KV head (MAX_ROWS in paged_attention.cpp)


class TorchAttentionBackend(AttentionBackend):
    """CPU attention; ``use_kernel=False`` forces the gather path (tests compare the two)."""

    name = "torch"

    def __init__(self, use_kernel: bool = True) -> None:
        self._kernel = cpu_ext.load() if use_kernel else None
        self._gather = GatherPath()

    @property
    def uses_kernel(self) -> bool:
        return self._kernel is not None

    def _kernel_fits(self, fb: ForwardBatch) -> bool:
        return (self._kernel is not None and fb.device.type == "cpu"
                and fb.kv_pool.head_dim in KERNEL_HEAD_DIMS)

    def plan(self, fb: ForwardBatch) -> None:
        if not self._kernel_fits(fb):
            self._gather.plan(fb)
            return
        fb.attn_metadata = build_plan(
            fb.table_host, fb.rows_cpu, fb.prefix_lens_cpu, fb.extend_lens_cpu
        )

    def finish(self, fb: ForwardBatch) -> None:
        if not isinstance(fb.attn_metadata, KernelPlan):
            self._gather.finish(fb)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayerInfo,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        pool = fb.kv_pool
        k_scale, v_scale = pool.get_scales(layer.layer_id)
        k_pool, v_pool = pool.get_kv(layer.layer_id)
        native = self._kernel is not None and fb.device.type == "cpu"
        if native and pool.quantized:
            self._kernel.store_kv_quant(
                k,
                v,
                k_pool,
                v_pool,
                _or_empty(k_scale),
                _or_empty(v_scale),
                fb.out_cache_loc,
                pool.rotated,
            )
        elif native and k.dtype == k_pool.dtype:
            self._kernel.store_kv(k, v, k_pool, v_pool, fb.out_cache_loc)
        else:
            pool.set_kv(layer.layer_id, fb.out_cache_loc, k, v)
        plan = fb.attn_metadata
        if (
            isinstance(plan, KernelPlan)
            and layer.num_heads // layer.num_kv_heads > KERNEL_MAX_GROUP
        ):
            # A model the kernel was not built for: this forward gathers (on the CPU, where
            # staged arrays are tensors at once).
            self._gather.plan(fb)
            self._gather.finish(fb)
            plan = fb.attn_metadata
        if not isinstance(plan, KernelPlan):
            return self._gather.forward(q, k, v, layer, fb)
        out = self._kernel.paged_attention(
            q.contiguous(), k_pool, v_pool, _or_empty(k_scale), _or_empty(v_scale), fb.req_to_token,
            *plan.args(), layer.scaling, pool.rotated
        )
        return out.view(q.shape[0], layer.num_heads * layer.head_dim)


_EMPTY = torch.empty(0)


def _or_empty(scale: torch.Tensor | None) -> torch.Tensor:
    """The kernels' "no scales" (a pool that is not int8)."""
    return _EMPTY if scale is None else scale
