"""The Llama-family architectures: each one a description of how it differs from Llama."""

from __future__ import annotations

from typing import Any

from radixserve.model.decoder import ArchSpec, CausalLM


class LlamaForCausalLM(CausalLM):
    @classmethod
    def arch_spec(cls, hf_config: Any) -> ArchSpec:
        # Llama's `attention_bias` covers q/k/v and o; `mlp_bias` the three MLP projections.
        attn_bias = bool(getattr(hf_config, "attention_bias", False))
        return ArchSpec(
            qkv_bias=attn_bias,
            o_bias=attn_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        )


class MistralForCausalLM(LlamaForCausalLM):
    """Llama weights and math.  ``sliding_window`` is not applied: outputs match HF only while
    the context fits in the window (4096+ for released checkpoints)."""


class Qwen2ForCausalLM(CausalLM):
    spec = ArchSpec(qkv_bias=True)


class Qwen3ForCausalLM(CausalLM):
    @classmethod
    def arch_spec(cls, hf_config: Any) -> ArchSpec:
        attn_bias = bool(getattr(hf_config, "attention_bias", False))
        return ArchSpec(qkv_bias=attn_bias, o_bias=attn_bias, qk_norm=True)
