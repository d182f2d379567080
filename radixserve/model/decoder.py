"""The one decoder shared by the Llama family; architectures only say what differs.

Module names follow the Hugging Face checkpoints except for two fusions: ``self_attn.qkv_proj``
(q/k/v) and ``mlp.gate_up_proj`` (gate/up), each one matmul.  :meth:`CausalLM.load_weights`
maps checkpoint names onto them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.attention.base import AttentionLayerInfo
from radixserve.batch import ForwardBatch
from radixserve.distributed.group import SINGLE, TensorParallel
from radixserve.distributed.layers import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from radixserve.model.config import ModelConfig
from radixserve.model.fused_decode import FusedDecode
from radixserve.model.layers import MergedLinear, RMSNorm, RotaryEmbedding, fused_ops
from radixserve.profiler_scopes import scope
from radixserve.quantization import linear

if TYPE_CHECKING:
    from radixserve.lora.batch import LoraBatch

_ACTIVATIONS = {"silu": F.silu}
# Profiler scope around each layer's attention backend call (bench/offline.py --breakdown).
ATTENTION_SCOPE = "radixserve.attention"


@dataclass(frozen=True)
class ArchSpec:
    """What one architecture changes in the shared decoder."""

    qkv_bias: bool = False  # bias on q/k/v projections
    o_bias: bool = False  # bias on the output projection
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)


class Attention(nn.Module):
    """With tensor parallelism this rank holds query heads ``[qs, qe)`` and KV heads
    ``[ks, ke)`` (``TensorParallel.head_ranges``); ``info`` describes the local heads."""

    def __init__(
        self, config: ModelConfig, spec: ArchSpec, layer_id: int, tp: TensorParallel
    ) -> None:
        super().__init__()
        d = config.head_dim
        (qs, qe), (ks, ke) = tp.head_ranges(config.num_heads, config.num_kv_heads)
        h, kv = qe - qs, ke - ks
        self.q_size, self.kv_size = h * d, kv * d
        full_q, full_kv = config.num_heads * d, config.num_kv_heads * d
        self.qkv_proj = MergedLinear(
            config.hidden_size, {"q": full_q, "k": full_kv, "v": full_kv}, bias=spec.qkv_bias,
            parts={"q": (qs * d, qe * d), "k": (ks * d, ke * d), "v": (ks * d, ke * d)},
        )
        self.o_proj = RowParallelLinear(
            full_q, config.hidden_size, spec.o_bias, tp, (qs * d, qe * d)
        )
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if spec.qk_norm else None
        self.info = AttentionLayerInfo(layer_id, h, kv, d, d**-0.5)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        info = self.info
        # split_with_sizes: Tensor.split's Python wrapper is a visible cost in a one-row decode step
        qkv = self.qkv_proj(x)
        if fb.lora is not None:
            fb.lora.add(qkv, x, info.layer_id, "qkv")
        q, k, v = qkv.split_with_sizes(
            [self.q_size, self.kv_size, self.kv_size], dim=-1
        )
        q = q.view(-1, info.num_heads, info.head_dim)
        k = k.view(-1, info.num_kv_heads, info.head_dim)
        v = v.view(-1, info.num_kv_heads, info.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = RotaryEmbedding.apply(q, cos, sin)
        k = RotaryEmbedding.apply(k, cos, sin)
        with scope(ATTENTION_SCOPE):
            attn = fb.attn_backend.forward(q, k, v, info, fb)
        out = self.o_proj(attn)
        if fb.lora is not None:
            fb.lora.add(out, attn, info.layer_id, "o")
        return out


class MLP(nn.Module):
    """With tensor parallelism this rank holds intermediate columns ``[start, end)``."""

    def __init__(
        self, config: ModelConfig, spec: ArchSpec, layer_id: int, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}")
        self.act = _ACTIVATIONS[config.hidden_act]
        full = config.intermediate_size
        part = tp.split(full, "MLP columns")
        self.inter = part[1] - part[0]
        self.gate_up_proj = MergedLinear(
            config.hidden_size, {"gate": full, "up": full}, bias=spec.mlp_bias,
            parts={"gate": part, "up": part},
        )
        self.down_proj = RowParallelLinear(full, config.hidden_size, spec.mlp_bias, tp, part)

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        """``lora``: the batch's adapters (``fb.lora``), added to both projections."""
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            lora.add(gate_up, x, self.layer_id, "gate_up")
        ops = fused_ops(gate_up)
        if ops is not None and self.act is F.silu and gate_up.is_contiguous():
            h = ops.silu_mul(gate_up)
        else:
            gate, up = gate_up.split(self.inter, dim=-1)
            h = self.act(gate) * up
        out = self.down_proj(h)
        if lora is not None:
            lora.add(out, h, self.layer_id, "down")
        return out


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, spec: ArchSpec, layer_id: int, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, spec, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, spec, layer_id, tp)

    def forward(
        self,
        delta: torch.Tensor | None,
        residual: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        """Adds ``delta`` (the previous layer's MLP output; None for the first layer) to the
        residual stream in place, and returns this layer's MLP output: the adds fuse with the
        norms that follow them."""
        if delta is None:
            h = self.input_layernorm(residual)
        else:
            h = self.input_layernorm.add_forward(residual, delta)
        attn = self.self_attn(h, cos, sin, fb)
        return self.mlp(self.post_attention_layernorm.add_forward(residual, attn), fb.lora)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, spec: ArchSpec, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(config, spec, i, tp) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


# checkpoint name pattern -> (our fused module path, shard)
_FUSED = [
    (re.compile(r"(.*\.self_attn)\.([qkv])_proj\.(weight|bias)$"), "qkv_proj"),
    (re.compile(r"(.*\.mlp)\.(gate|up)_proj\.(weight|bias)$"), "gate_up_proj"),
]


class CausalLM(nn.Module):
    """Decoder + LM head.  Subclasses set :attr:`spec` (and may derive it from the HF config).

    ``tp``: this process's rank of a tensor-parallel group (:mod:`radixserve.distributed`); it
    builds only its shard, and its forward returns the logits on rank 0 only.
    """

    spec = ArchSpec()

    def __init__(
        self, config: ModelConfig, hf_config: Any = None, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        spec = self.arch_spec(hf_config)
        self.model = DecoderModel(config, spec, tp)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope)
        self.fused: FusedDecode | None = None

    @classmethod
    def arch_spec(cls, hf_config: Any) -> ArchSpec:
        return cls.spec

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank stores (all of them without tensor parallelism)."""
        return self.model.layers[0].self_attn.info.num_kv_heads

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor | None:
        """Float32 logits ``[B + E, vocab]``: each request's last new token, then the E extra
        rows of ``fb.logits_indices`` (none unless a request asked for prompt logprobs).
        None on tensor-parallel ranks other than 0."""
        residual = self.model.embed_tokens(fb.input_ids)
        cos, sin = self.rotary.cos_sin(fb.positions, residual.dtype)
        if self.fused is None:  # built at the first forward, once the weights are in place
            self.fused = FusedDecode(self)
        delta = self.fused.run(residual, cos, sin, fb)
        if delta is None:
            for layer in self.model.layers:
                delta = layer(delta, residual, cos, sin, fb)
        # Only the rows the sampler (and prompt logprobs) read go through the norm and LM head.
        rows = fb.logits_indices
        x = self.model.norm(residual.index_select(0, rows) + delta.index_select(0, rows))
        return self.tp.gather_vocab(linear(x, self.lm_head_weight).float(), self.config.vocab_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the (fused) parameters; every parameter must be covered."""
        params = dict(self.named_parameters())
        expected: set[str] = set()
        for name in params:
            fused = getattr(self.get_submodule(name.rsplit(".", 1)[0]), "shard_offsets", None)
            if fused is None:
                expected.add(name)
            else:
                prefix = name.rsplit(".", 1)[0]
                expected.update(f"{prefix}:{shard}.{name.rsplit('.', 1)[1]}" for shard in fused)
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            for pattern, fused_name in _FUSED:
                m = pattern.match(name)
                if m:
                    module_path, shard, kind = m.group(1), m.group(2), m.group(3)
                    module = self.get_submodule(f"{module_path}.{fused_name}")
                    module.load_shard(shard, kind, tensor)
                    loaded.add(f"{module_path}.{fused_name}:{shard}.{kind}")
                    break
            else:
                if name not in params:
                    raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
                p = params[name]
                module_path, _, kind = name.rpartition(".")
                piece = getattr(self.get_submodule(module_path), "tp_slices", {}).get(kind)
                if piece is not None:  # tensor parallelism: this rank's slice
                    dim, start, end, full = piece
                    if tensor.dim() <= dim or tensor.shape[dim] != full:
                        raise ValueError(f"{name}: shape {tuple(tensor.shape)} has not {full} "
                                         f"entries along dimension {dim}")
                    tensor = tensor.narrow(dim, start, end - start)
                if p.shape != tensor.shape:
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(p.shape)}")
                with torch.no_grad():
                    p.copy_(tensor)
                loaded.add(name)
        missing = expected - loaded
        if missing:
            raise ValueError(
                f"checkpoint is missing {len(missing)} weights, e.g. {sorted(missing)[:5]}"
            )
