"""What the runtime needs to know about a model, derived once from its Hugging Face config."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters.  ``rope_type`` is one of :data:`SUPPORTED_ROPE_TYPES`."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only: frequency band limits and the context length the model was trained on.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    @classmethod
    def from_hf(cls, hf_config: Any) -> RopeConfig:
        """Read ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling`` (4.x)."""
        params = dict(getattr(hf_config, "rope_parameters", None) or {})
        scaling = getattr(hf_config, "rope_scaling", None)
        if not params and scaling:
            params = dict(scaling)
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope scaling type {rope_type!r} (supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if rope_type == "default":
            return cls(theta=float(theta))
        factor = float(params["factor"])
        if rope_type == "linear":
            return cls(theta=float(theta), rope_type="linear", factor=factor)
        return cls(
            theta=float(theta),
            rope_type="llama3",
            factor=factor,
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position=int(params["original_max_position_embeddings"]),
        )


@dataclass(frozen=True)
class ModelConfig:
    """Model geometry and behaviour, independent of the architecture's HF config class."""

    architecture: str  # HF ``architectures[0]``, the registry key
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_context_len: int  # max_position_embeddings
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]  # every id that ends generation (config + generation_config)
    dtype: torch.dtype  # the dtype weights and activations run in
    hidden_act: str = "silu"
    sliding_window: int | None = None  # recorded, not applied (see model/__init__.py)

    @classmethod
    def from_hf(
        cls, hf_config: Any, dtype: torch.dtype, model_dir: str | None = None
    ) -> ModelConfig:
        """Build from a transformers config; ``model_dir`` adds generation_config.json's EOS ids."""
        archs = getattr(hf_config, "architectures", None) or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot pick a model class")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        num_kv = getattr(hf_config, "num_key_value_heads", None) or num_heads
        if num_heads % num_kv:
            raise ValueError(f"num_attention_heads={num_heads} not a multiple of kv heads={num_kv}")
        sliding = getattr(hf_config, "sliding_window", None)
        if hasattr(hf_config, "use_sliding_window") and not hf_config.use_sliding_window:
            sliding = None
        return cls(
            architecture=archs[0],
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            max_context_len=hf_config.max_position_embeddings,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope=RopeConfig.from_hf(hf_config),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            eos_token_ids=collect_eos_ids(hf_config, model_dir),
            dtype=dtype,
            hidden_act=getattr(hf_config, "hidden_act", "silu"),
            sliding_window=sliding,
        )


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def collect_eos_ids(hf_config: Any, model_dir: str | None) -> tuple[int, ...]:
    """EOS ids from the config and from ``generation_config.json`` (ints or lists), deduplicated."""
    ids = _as_ids(getattr(hf_config, "eos_token_id", None))
    if model_dir is not None:
        path = os.path.join(model_dir, "generation_config.json")
        if os.path.exists(path):
            with open(path) as f:
                ids += _as_ids(json.load(f).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))
